// Routing balance at initialisation on real proteins (doc/model.md "Router initialisation"):
// at hidden 1280 (esm2_moe_2b_a650m's layer) and in the esm2_moe_100m_a35m shape, N(0, 0.02)
// routers send almost every token to the same experts (the LN2 output is mostly one vector all
// tokens share), and routers centred on the mean router input (Esm2::centreRouters, what the
// trainer does before step 1 under moe.router_init: centred) route the first training pass
// within load max/mean 1.5 in every MoE layer.  The proteins are the first records of Debian's
// mmseqs2-examples (the quickstart's data); the tests skip where that file is absent.
#include "core/vocab.hpp"
#include "io/fasta.hpp"
#include "model/esm2.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

namespace plm::model {
namespace {

const char* const proteins_path = "/usr/share/doc/mmseqs2/example-data/DB.fasta.gz";

/// Packed micro-batches of real proteins: the first records of the file, each cut to a window
/// of at most `max_len` - 2 residues (seeded start, as the loader crops), masked by ESM-2's
/// 15% / 80-10-10 rule, packed in file order into micro-batches of at most `micro_tokens`
/// tokens, `total` tokens in all.
std::vector<data::MicroBatch> realBatches(std::int64_t total, int max_len,
                                          std::int64_t micro_tokens) {
  io::fasta::Parsed parsed;
  io::fasta::Segment seg;
  seg.path = proteins_path;
  seg.gzip = true;
  seg.file_size = static_cast<std::int64_t>(std::filesystem::file_size(proteins_path));
  seg.end = std::min<std::int64_t>(seg.file_size, 1 << 20);  // compressed bytes: ~3k records
  io::fasta::parseSegment(seg, io::fasta::Policy::skip, parsed);
  std::mt19937_64 rng(7);
  std::vector<std::vector<token_t>> seqs;
  std::int64_t at = 0, tokens = 0;
  for (std::int64_t len : parsed.lengths) {
    const std::int64_t w = std::min<std::int64_t>(len, max_len - 2);
    const std::int64_t start = len > w ? static_cast<std::int64_t>(rng() % (len - w + 1)) : 0;
    if (tokens + w + 2 > total) break;
    std::vector<token_t> s{vocab::cls};
    for (std::int64_t i = 0; i < w; ++i) s.push_back(parsed.tokens[at + start + i]);
    s.push_back(vocab::eos);
    tokens += static_cast<std::int64_t>(s.size());
    seqs.push_back(std::move(s));
    at += len;
  }
  std::vector<data::MicroBatch> out;
  for (std::size_t first = 0; first < seqs.size();) {
    std::size_t last = first;
    std::int64_t n = 0;
    while (last < seqs.size() && n + std::int64_t(seqs[last].size()) <= micro_tokens)
      n += static_cast<std::int64_t>(seqs[last++].size());
    data::MicroBatch b;
    b.tokens = HostView1<token_t>("tokens", n);
    b.labels = HostView1<std::int32_t>("labels", n);
    b.cu_seqlens = HostView1<seqlen_t>("cu", last - first + 1);
    std::int64_t t = 0;
    for (std::size_t q = first; q < last; ++q) {
      const auto& s = seqs[q];
      for (std::size_t i = 0; i < s.size(); ++i, ++t) {
        token_t tok = s[i];
        b.labels(t) = vocab::ignore_label;
        if (i > 0 && i + 1 < s.size() && rng() % 100 < 15) {
          b.labels(t) = tok;
          const auto r = rng() % 10;
          tok = r < 8 ? vocab::mask : r < 9 ? static_cast<token_t>(4 + rng() % 20) : tok;
          ++b.num_masked;
        }
        b.tokens(t) = tok;
      }
      b.cu_seqlens(q - first + 1) = static_cast<seqlen_t>(t);
      b.max_seqlen = std::max<std::int32_t>(b.max_seqlen, static_cast<std::int32_t>(s.size()));
    }
    out.push_back(b);
    first = last;
  }
  return out;
}

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
