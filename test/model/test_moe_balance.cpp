// Routing balance at initialisation on real proteins (doc/model.md "Router initialisation"):
// at hidden 1280 (esm2_moe_2b_a650m's layer) and in the esm2_moe_100m_a35m shape, N(0, 0.02)
// routers send almost every token to the same experts (the LN2 output is mostly one vector all
// tokens share), and routers centred on the mean router input (Esm2::centreRouters, what the
// trainer does before step 1 under moe.router_init: centred) route the first training pass
// within load max/mean 1.5 in every MoE layer.  The proteins are the first records of Debian's
// mmseqs2-examples (the quickstart's data); the tests skip where that file is absent.
#include "model/esm2.hpp"
#include "moe_proteins.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

namespace plm::model {
namespace {

/// Per MoE layer, max/mean of the slots routed to each expert over `batches` (the routing of a
/// training pass over them; forward only, which routes the same).
std::vector<double> loadRatios(Esm2<float>& model, const std::vector<data::MicroBatch>& batches) {
  model.resetMoeStats();
  ForwardOutputs<float> record;
  record.moe_stats = true;
  for (const auto& b : batches) model.forward(b, &record);
  std::vector<double> out;
  for (const auto& s : model.moeStats()) {
    double sum = 0, most = 0;
    for (double r : s.routed) {
      sum += r;
      most = std::max(most, r);
    }
    out.push_back(most / (sum / static_cast<double>(s.routed.size())));
    EXPECT_EQ(s.dropped, 0) << "dropless routing dropped slots in layer " << s.layer;
  }
  model.resetMoeStats();
  return out;
}

std::string show(const std::vector<double>& v) {
  std::string out;
  char text[16];
  for (double x : v) {
    std::snprintf(text, sizeof text, " %.2f", x);
    out += text;
  }
  return out;
}

/// `preset`'s shape cut to `layers` layers (all MoE, dropless, top-2 softmax), at
/// initialisation: the N(0, 0.02) routers collapse, the centred ones stay within 1.5.
void checkBalance(const std::string& preset, int layers, std::int64_t tokens, int max_len) {
  if (!std::filesystem::exists(proteins_path))
    GTEST_SKIP() << proteins_path << " is absent (Debian package mmseqs2-examples)";
  Esm2Config c = Esm2Config::preset(preset);
  c.num_layers = layers;
  c.moe.router_projection = false;  // these passes record statistics: route with the stored router
  ASSERT_TRUE(c.moe.enabled());
  Esm2<float> model(c);
  model.initialize(1);
  const auto batches = realBatches(tokens, max_len, 2048);
  const auto before = loadRatios(model, batches);
  const auto centring = model.centreRouters(batches, MPI_COMM_WORLD);
  const auto after = loadRatios(model, batches);
  std::vector<double> shares;
  for (const auto& l : centring) shares.push_back(l.mean_share);
  std::printf(
      "%s, %d layers, %lld tokens: load max/mean per layer: normal%s, centred%s; "
      "mean share of the router input%s\n",
      preset.c_str(), layers, static_cast<long long>(centring.at(0).tokens), show(before).c_str(),
      show(after).c_str(), show(shares).c_str());
  ASSERT_EQ(after.size(), static_cast<std::size_t>(layers));
  // The premise: without centring, the first layer sends most tokens to one or two experts.
  EXPECT_GT(before.front(), 2.5) << "the N(0, 0.02) routers no longer collapse";
  for (std::size_t l = 0; l < after.size(); ++l)
    EXPECT_LE(after[l], 1.5) << preset << " layer " << l << " after centring";
}

TEST(MoeBalance, CentredRoutersBalanceHidden1280) {
  checkBalance("esm2_moe_2b_a650m", 2, 4096, 256);
}

TEST(MoeBalance, CentredRoutersBalanceMoe100mShape) {
  checkBalance("esm2_moe_100m_a35m", 4, 8192, 512);
}

}  // namespace
}  // namespace plm::model
