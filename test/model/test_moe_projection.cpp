// moe.router_projection (Esm2::projectRouters, doc/model.md "Router initialisation"): after the
// training passes of a step the router is made orthogonal to that step's mean router input, the
// input summed over every rank.  Run on 1 and 2 ranks.
#include "model/esm2.hpp"
#include "moe_proteins.hpp"

#include <gtest/gtest.h>
#include <mpi.h>

#include <cmath>
#include <vector>

namespace plm::model {
namespace {

/// The router weight of MoE layer 0 as host values.
std::vector<double> router0(Esm2<float>& model) {
  const TensorInfo& t = model.tensor("esm.encoder.layer.0.moe.router.weight");
  std::vector<float> all(model.parameters().extent(0));
  Kokkos::deep_copy(HostView1<float>(all.data(), all.size()), model.parameters());
  return std::vector<double>(all.begin() + t.offset, all.begin() + t.offset + t.size);
}

double distance(const std::vector<double>& a, const std::vector<double>& b) {
  double d = 0;
  for (std::size_t i = 0; i < a.size(); ++i) d += (a[i] - b[i]) * (a[i] - b[i]);
  return std::sqrt(d);
}

/// moe.router_projection (Esm2::projectRouters): after the training passes of a step, the
/// router is made orthogonal to that step's mean router input, W m = 0.  With one MoE layer its
/// input does not depend on the router, so a second step over the same tokens finds W m = 0
/// already and leaves W alone.  The sums are summed over the communicator: each of 2 ranks
/// training on half the micro-batches gives the router that one rank gets from all of them.
TEST(MoeBalance, RouterProjectionRemovesTheStepMean) {
  if (!std::filesystem::exists(proteins_path))
    GTEST_SKIP() << proteins_path << " is absent (Debian package mmseqs2-examples)";
  Esm2Config c = Esm2Config::preset("esm2_moe_2b_a650m");
  c.num_layers = 1;
  ASSERT_TRUE(c.moe.router_projection);
  const auto batches = realBatches(4096, 256, 1024);
  ASSERT_GE(batches.size(), 2u);
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);

  Esm2<float> whole(c);  // every micro-batch on this rank alone
  whole.initialize(1);
  const auto start = router0(whole);
  whole.projectRouters(MPI_COMM_SELF);  // no training pass yet: nothing to project on
  EXPECT_EQ(distance(router0(whole), start), 0.0);
  for (const auto& b : batches) whole.forwardBackward(b, 1.0);
  whole.projectRouters(MPI_COMM_SELF);
  const auto once = router0(whole);
  const double moved = distance(once, start);
  EXPECT_GT(moved, 1e-3 * std::sqrt(static_cast<double>(start.size())) * 0.02)
      << "the N(0, 0.02) router had no component along the mean input";
  for (const auto& b : batches) whole.forwardBackward(b, 1.0);
  whole.projectRouters(MPI_COMM_SELF);
  EXPECT_LT(distance(router0(whole), once), 1e-4 * moved) << "W m != 0 after the projection";

  Esm2<float> shared(c);  // micro-batch i on rank i % size, the sums reduced over all ranks
  shared.initialize(1);
  for (std::size_t i = 0; i < batches.size(); ++i)
    if (static_cast<int>(i % size) == rank) shared.forwardBackward(batches[i], 1.0);
  shared.projectRouters(MPI_COMM_WORLD);
  EXPECT_LT(distance(router0(shared), once), 1e-5 * moved)
      << size << " ranks project on another mean than one rank with every micro-batch";
}

}  // namespace
}  // namespace plm::model
