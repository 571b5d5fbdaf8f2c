// train::GradientSync: the ranges ESM-2's tensor table gives the buckets (backward order,
// whole buffer covered), the bucketed reduction against the chunked dist::allreduceSum it
// replaced, and accumulateGradients' bits across reruns.  Runs at 1, 2 and 4 ranks.
#include "../train/batches.hpp"
#include "dist/allreduce.hpp"
#include "dist/communicator.hpp"
#include "dist/process_groups.hpp"
#include "model/esm2.hpp"
#include "train/gradient_sync.hpp"
#include "train/step.hpp"

#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace {

using plm::ExecSpace;
using plm::model::Esm2;
using plm::model::Esm2Config;

Esm2Config tinyConfig() {
  Esm2Config c;
  c.num_layers = 3;
  c.hidden = 32;
  c.heads = 4;
  c.ffn = 64;
  return c;
}

bool inside(const plm::dist::BufferRange& r, const plm::model::TensorInfo& t) {
  return t.offset >= r.offset && t.offset + t.size <= r.offset + r.count;
}

TEST(GradientSync, RangesFollowBackwardOrderAndCoverTheBuffer) {
  Esm2<float> model(tinyConfig());
  const int layers = model.config().num_layers;
  const auto n = static_cast<std::int64_t>(model.gradients().extent(0));
  const auto ranges = plm::train::backwardOrderRanges(model.tensors(), n);
  ASSERT_EQ(static_cast<int>(ranges.size()), layers + 2);  // head, layers, embeddings
  // Each range ends where the next starts (buffer order is the reverse of the list).
  EXPECT_EQ(ranges.back().offset, 0);
  EXPECT_EQ(ranges.front().offset + ranges.front().count, n);
  for (std::size_t i = 0; i + 1 < ranges.size(); ++i)
    EXPECT_EQ(ranges[i + 1].offset + ranges[i + 1].count, ranges[i].offset);
  for (const auto& t : model.tensors()) {
    int expected = 0;  // head
    if (t.name.rfind("esm.embeddings.", 0) == 0) {
      expected = layers + 1;
    } else if (t.name.rfind("esm.encoder.layer.", 0) == 0) {
      const int l = std::stoi(t.name.substr(std::string("esm.encoder.layer.").size()));
      expected = plm::train::GradientSync<float>::rangeOfLayer(l, layers);
    }
    EXPECT_TRUE(inside(ranges[expected], t)) << t.name << " not in range " << expected;
  }
}

std::vector<float> hostCopy(plm::View1<float> v) {
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), v);
  return std::vector<float>(h.data(), h.data() + h.extent(0));
}

TEST(GradientSync, PerLayerReadyMatchesTheChunkedAllReduceItReplaced) {
  const int rank = plm::dist::commRank(MPI_COMM_WORLD), world = plm::dist::commSize(MPI_COMM_WORLD);
  Esm2<float> model(tinyConfig());
  ExecSpace space;
  auto grads = model.gradients();
  auto h = Kokkos::create_mirror_view(grads);
  std::mt19937_64 gen(77 + rank);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (std::size_t i = 0; i < h.extent(0); ++i) h(i) = u(gen);
  Kokkos::deep_copy(grads, h);
  plm::View1<float> old("old", grads.extent(0));
  Kokkos::deep_copy(old, grads);
  plm::dist::allreduceSum(space, old, MPI_COMM_WORLD);

  // Small buckets, so several collectives are in flight, marked the way a per-layer hook will.
  plm::train::GradientSync<float> sync(model, MPI_COMM_WORLD,
                                       plm::dist::defaultBackend(MPI_COMM_WORLD), 4096);
  const int layers = model.config().num_layers;
  ASSERT_GT(sync.buckets().numBuckets(), layers);
  const auto& r = sync.ranges();
  sync.buckets().ready(space, r[0].offset, r[0].count);
  for (int l = layers - 1; l >= 0; --l) {
    const auto& lr = r[plm::train::GradientSync<float>::rangeOfLayer(l, layers)];
    sync.buckets().ready(space, lr.offset, lr.count);
  }
  EXPECT_GT(sync.buckets().numLaunched(), 0) << "no bucket launched before the embeddings";
  sync.buckets().ready(space, r.back().offset, r.back().count);
  sync.finish(space);
  space.fence();
  const auto a = hostCopy(grads), b = hostCopy(old);
  ASSERT_EQ(a.size(), b.size());
  if (world <= 2) {
    // Two addends: every order gives the same bits.
    EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0);
  } else {
    for (std::size_t i = 0; i < a.size(); ++i) ASSERT_NEAR(a[i], b[i], 1e-6 * world) << i;
  }
}

TEST(GradientSync, AccumulateGradientsRerunsBitwise) {
  const int rank = plm::dist::commRank(MPI_COMM_WORLD), world = plm::dist::commSize(MPI_COMM_WORLD);
  Esm2<float> model(tinyConfig());
  model.initialize(3);
  auto global = plm::test::globalStep(42, 1, 4, 3);
  std::vector<plm::data::MicroBatch> local;
  for (int j = 0; j < static_cast<int>(global.size()); ++j)
    if (j % world == rank) local.push_back(global[j]);
  const auto first = plm::train::accumulateGradients(ExecSpace(), model, local, MPI_COMM_WORLD);
  const auto g1 = hostCopy(model.gradients());
  const auto second = plm::train::accumulateGradients(ExecSpace(), model, local, MPI_COMM_WORLD);
  const auto g2 = hostCopy(model.gradients());
  EXPECT_EQ(first.loss_sum, second.loss_sum);
  EXPECT_EQ(std::memcmp(g1.data(), g2.data(), g1.size() * sizeof(float)), 0);
  double norm = 0.0;
  for (float g : g1) norm += double(g) * g;
  EXPECT_GT(norm, 0.0);
  // Every rank holds the same (reduced) gradient.
  std::vector<float> rank0 = g1;
  MPI_Bcast(rank0.data(), static_cast<int>(rank0.size()), MPI_FLOAT, 0, MPI_COMM_WORLD);
  EXPECT_EQ(std::memcmp(g1.data(), rank0.data(), g1.size() * sizeof(float)), 0);
}

}  // namespace
