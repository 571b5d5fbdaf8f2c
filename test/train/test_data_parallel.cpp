// The loss is the mean over the masked tokens of the global batch, so neither the micro-batch
// split nor the rank count changes the result beyond summation order:
//  - accumulation: one micro-batch of N sequences vs two of N/2 give the same loss and gradient;
//  - data parallel: 20 AdamW steps over the world communicator (rank r takes global micro-batch
//    j when j % world == r) match, per step to 1e-5 relative, a single-rank reference that rank 0
//    recomputes on MPI_COMM_SELF with all micro-batches of each step.
#include "batches.hpp"
#include "dist/runtime.hpp"
#include "train/optim/adamw.hpp"
#include "train/schedule.hpp"
#include "train/step.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <vector>

namespace {

using plm::ExecSpace;
using plm::model::Esm2;
using plm::model::Esm2Config;

Esm2Config tinyConfig() {
  Esm2Config c;
  c.num_layers = 2;
  c.hidden = 32;
  c.heads = 4;
  c.ffn = 64;
  return c;
}

std::vector<float> hostCopy(plm::View1<float> v) {
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), v);
  return std::vector<float>(h.data(), h.data() + h.extent(0));
}

TEST(Accumulation, OneMicroBatchEqualsTwoHalves) {
  std::mt19937_64 gen(5);
  std::vector<plm::test::Sequence> seqs;
  for (int q = 0; q < 6; ++q) seqs.push_back(plm::test::randomSequence(gen, 6, 40));
  const auto whole = plm::test::pack(seqs);
  const auto first = plm::test::pack({seqs.begin(), seqs.begin() + 3});
  const auto second = plm::test::pack({seqs.begin() + 3, seqs.end()});
  ASSERT_GT(whole.num_masked, 0);

  Esm2<float> a(tinyConfig()), b(tinyConfig());
  a.initialize(3);
  b.initialize(3);
  auto sa = plm::train::accumulateGradients(ExecSpace(), a, {whole}, MPI_COMM_SELF);
  auto sb = plm::train::accumulateGradients(ExecSpace(), b, {first, second}, MPI_COMM_SELF);
  EXPECT_EQ(sa.masked, sb.masked);
  EXPECT_EQ(sa.tokens, sb.tokens);
  EXPECT_EQ(sa.sequences, 6);
  EXPECT_NEAR(sa.loss(), sb.loss(), 1e-6 * sa.loss());
  // The mean, not the sum: forward() over the same batch divided by its masked count.
  EXPECT_NEAR(sa.loss(), a.forward(whole) / static_cast<double>(whole.num_masked),
              1e-6 * sa.loss());

  auto ga = hostCopy(a.gradients()), gb = hostCopy(b.gradients());
  double max_abs = 0, max_diff = 0;
  for (std::size_t i = 0; i < ga.size(); ++i) {
    max_abs = std::max(max_abs, std::abs(static_cast<double>(ga[i])));
    max_diff = std::max(max_diff, std::abs(static_cast<double>(ga[i]) - gb[i]));
  }
  ASSERT_GT(max_abs, 0.0);
  EXPECT_LT(max_diff, 1e-5 * max_abs);
}

// Runs `steps` training steps; this rank takes the global micro-batches j with j % world == rank
// of `comm`.  Returns the per-step global losses.
std::vector<double> train(MPI_Comm comm, int steps) {
  int rank = 0, world = 1;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &world);
  Esm2<float> model(tinyConfig());
  model.initialize(11);
  plm::train::AdamWOptions o;  // ESM-2 betas/eps, weight decay 0.01
  plm::train::AdamW<float> opt(
      model.parameters(), model.tensors(), o,
      plm::train::esm2FrozenRanges(model.tensors(), model.config().hidden));
  plm::train::ScheduleOptions sched;
  sched.peak_lr = 3e-3;
  sched.warmup_steps = 4;
  sched.decay_steps = steps;
  std::vector<double> losses;
  for (int step = 1; step <= steps; ++step) {
    auto global = plm::test::globalStep(42, step, 4, 3);
    std::vector<plm::data::MicroBatch> local;
    for (int j = 0; j < static_cast<int>(global.size()); ++j)
      if (j % world == rank) local.push_back(global[j]);
    // Clip at 0.5 so clipping is active in some steps (the norm is a global quantity too).
    auto st = plm::train::trainStep(ExecSpace(), model, opt, local,
                                    plm::train::learningRate(sched, step), 0.5, comm);
    losses.push_back(st.loss());
  }
  return losses;
}

TEST(DataParallel, LossesMatchSingleRankReference) {
  const int steps = 20;
  std::vector<double> distributed = train(MPI_COMM_WORLD, steps);
  int rank = plm::dist::worldRank();
  int ok = 1;
  if (rank == 0) {
    std::vector<double> reference = train(MPI_COMM_SELF, steps);
    ASSERT_EQ(reference.size(), distributed.size());
    EXPECT_LT(distributed.back(), distributed.front()) << "training did not reduce the loss";
    double worst = 0;
    for (int s = 0; s < steps; ++s) {
      const double rel = std::abs(distributed[s] - reference[s]) / std::abs(reference[s]);
      worst = std::max(worst, rel);
      EXPECT_LE(rel, 1e-5) << "step " << s + 1 << ": " << distributed[s] << " vs " << reference[s]
                           << " on " << plm::dist::worldSize() << " ranks";
      if (rel > 1e-5) ok = 0;
    }
    std::printf(
        "%d ranks vs 1: largest relative loss difference over %d steps %.3g "
        "(loss %.4f -> %.4f)\n",
        plm::dist::worldSize(), steps, worst, reference.front(), reference.back());
  }
  MPI_Bcast(&ok, 1, MPI_INT, 0, MPI_COMM_WORLD);
  EXPECT_EQ(ok, 1);
}

}  // namespace
