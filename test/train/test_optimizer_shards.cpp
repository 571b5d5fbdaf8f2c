// Every optimizer on FSDP shards (1, 2, 4 ranks) against the same optimizer on one rank:
//  - kernels: a tiny ESM-2 tensor table, the same random parameters and gradients on every rank,
//    5 steps unsharded and 5 steps on this rank's slices (shardParamLayout, per-tensor state
//    reduced over the shard group).  AdamW, Lion and 8-bit AdamW give the same bits (8-bit block
//    scales are maxima, exact in any order); Adafactor's row/column sums and RMS are summed in
//    another order, so it agrees to 1e-6 relative.  exportState gathers the sharded state into
//    the full layout equal to the unsharded one's (codes and scales bit for bit), and
//    importState hands it to a fresh sharded optimizer that continues exactly as the original;
//  - end to end: Fsdp training with each kind matches trainStep on one rank (losses 1e-5).
#include "batches.hpp"
#include "dist/process_groups.hpp"
#include "dist/runtime.hpp"
#include "train/fsdp.hpp"
#include "train/schedule.hpp"

#include "views.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

namespace {

using plm::ExecSpace;
using plm::View1;
using plm::model::Esm2;
using plm::model::Esm2Config;
using plm::test::fromView;
using plm::test::toView;
using namespace plm::train;

Esm2Config tinyConfig() {
  Esm2Config c;
  c.num_layers = 2;
  c.hidden = 32;
  c.heads = 4;
  c.ffn = 96;
  return c;
}

std::vector<float> randomVector(std::size_t n, unsigned seed, double scale) {
  std::mt19937 gen(seed);
  std::normal_distribution<double> normal(0.0, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = static_cast<float>(normal(gen));
  return v;
}

// `full` cut to this rank's slices (zeros in the padding).
std::vector<float> owned(const std::vector<float>& full, const ParamLayout& layout) {
  std::vector<float> out(layout.local_size, 0.0f);
  for (const auto& p : layout.pieces)
    for (std::int64_t k = 0; k < p.count; ++k)
      out[p.local + k] = full[layout.tensors[p.tensor].offset + p.start + k];
  return out;
}

std::vector<OptimizerOptions> kinds() {
  std::vector<OptimizerOptions> out;
  for (auto kind : {OptimizerKind::AdamW, OptimizerKind::Lion, OptimizerKind::Adafactor,
                    OptimizerKind::AdamW8bit}) {
    OptimizerOptions o;
    o.kind = kind;
    o.adamw8bit.min_8bit_size = 100;  // quantise the small test matrices too
    o.adamw8bit.block_size = 64;      // many blocks, some cut by slice boundaries
    out.push_back(o);
  }
  OptimizerOptions momentum;
  momentum.kind = OptimizerKind::Adafactor;
  momentum.adafactor.beta1 = 0.9;
  out.push_back(momentum);
  return out;
}

TEST(OptimizerShards, EveryKindMatchesOneRank) {
  const int rank = plm::dist::worldRank(), world = plm::dist::worldSize();
  Esm2<float> model(tinyConfig());
  const auto& tensors = model.tensors();
  const std::int64_t n = static_cast<std::int64_t>(model.parameters().extent(0));
  const auto frozen = esm2FrozenRanges(tensors, tinyConfig().hidden);
  const auto units = planShardUnits(tensors, n, world);
  const ParamLayout layout = shardParamLayout(tensors, units, rank, tinyConfig().hidden);
  const auto p0 = randomVector(n, 1, 0.2);
  // Gradients are zero outside the tensors (the alignment padding), as the model's are.
  std::vector<bool> in_tensor(n, false);
  for (const auto& t : tensors)
    for (std::int64_t i = t.offset; i < t.offset + t.size; ++i) in_tensor[i] = true;
  auto gradient = [&](unsigned seed, double scale) {
    auto g = randomVector(n, seed, scale);
    for (std::int64_t i = 0; i < n; ++i)
      if (!in_tensor[i]) g[i] = 0.0f;
    for (const auto& f : frozen)
      for (std::int64_t i = f.offset; i < f.offset + f.size; ++i) g[i] = 0.0f;
    return g;
  };
  for (const auto& o : kinds()) {
    const std::string what =
        std::string(optimizerName(o.kind)) + (o.adafactor.beta1 > 0 ? " (beta1)" : "");
    View1<float> full_params = toView(p0), shard_params = toView(owned(p0, layout));
    auto ref = makeOptimizer<float>(o, full_params, wholeLayout(tensors, n, frozen));
    auto mine = makeOptimizer<float>(o, shard_params, layout);
    mine->setShardGroup(MPI_COMM_WORLD);
    auto run = [&](int first, int last, Optimizer<float>& sharded) {
      for (int step = first; step <= last; ++step) {
        const auto g = gradient(100 + step, step == 3 ? 20.0 : 1.0);
        const double lr = 1e-3 * step;
        ref->step(ExecSpace(), toView(g), lr, 0.8);
        sharded.step(ExecSpace(), toView(owned(g, layout)), lr, 0.8);
      }
    };
    run(1, 5, *mine);
    const bool exact = o.kind != OptimizerKind::Adafactor;
    auto compare = [&](const std::vector<float>& want, const std::vector<float>& got,
                       const std::string& name) {
      ASSERT_EQ(want.size(), got.size()) << what << " " << name;
      int bad = 0;
      for (std::size_t i = 0; i < want.size(); ++i) {
        const bool same =
            exact ? want[i] == got[i]
                  : std::abs(want[i] - got[i]) <= 1e-6 * std::max(1.0f, std::abs(want[i]));
        if (!same && bad++ < 3)
          ADD_FAILURE() << what << " " << name << "[" << i << "]: " << got[i] << " vs " << want[i]
                        << " (" << world << " ranks)";
      }
    };
    compare(owned(fromView(full_params), layout), fromView(shard_params), "parameters");

    // The state gathered into the full layout equals the unsharded optimizer's.
    View1<float> scratch = toView(p0);
    auto gathered = makeOptimizer<float>(o, scratch, wholeLayout(tensors, n, frozen));
    exportState(*mine, *gathered, MPI_COMM_WORLD);
    const auto want_state = ref->state(), got_state = gathered->state();
    ASSERT_EQ(want_state.size(), got_state.size());
    for (std::size_t b = 0; b < want_state.size(); ++b) {
      if (want_state[b].isBytes())
        EXPECT_EQ(fromView(want_state[b].u8), fromView(got_state[b].u8))
            << what << " " << want_state[b].name;
      else
        compare(fromView(want_state[b].f32), fromView(got_state[b].f32), want_state[b].name);
    }
    // ... and a fresh sharded optimizer continues from it as the original does.
    View1<float> again_params = toView(fromView(shard_params));
    auto again = makeOptimizer<float>(o, again_params, layout);
    again->setShardGroup(MPI_COMM_WORLD);
    importState(*gathered, *again);
    again->setStepCount(mine->stepCount());
    const auto g6 = gradient(106, 1.0);
    mine->step(ExecSpace(), toView(owned(g6, layout)), 6e-3, 1.0);
    again->step(ExecSpace(), toView(owned(g6, layout)), 6e-3, 1.0);
    EXPECT_EQ(fromView(shard_params), fromView(again_params)) << what << ": import";
    if (rank == 0) std::printf("%s: sharded over %d ranks as on one\n", what.c_str(), world);
  }
}

TEST(OptimizerShards, FsdpTrainsEveryKindAsOneRank) {
  const int rank = plm::dist::worldRank(), world = plm::dist::worldSize();
  if (!Kokkos::SpaceAccessibility<Kokkos::HostSpace, plm::MemSpace>::accessible &&
      plm::dist::defaultBackend(MPI_COMM_WORLD) == plm::dist::Backend::Mpi)
    GTEST_SKIP() << "device memory over plain MPI (PLM_COMM_BACKEND=mpi)";
  const Esm2Config config = tinyConfig();
  constexpr int steps = 6, micro = 4;
  ScheduleOptions s;
  s.peak_lr = 3e-3;
  s.warmup_steps = 2;
  s.decay_steps = steps;
  for (auto o : kinds()) {
    if (o.kind == OptimizerKind::Lion) o.lion.weight_decay = 0.1;
    // lr x RMS(p) would be too small a step to lower the loss in 6 steps.
    if (o.kind == OptimizerKind::Adafactor) o.adafactor.scale_parameter = false;
    std::vector<double> ref_losses, losses;
    {
      Esm2<float> model(config);
      model.initialize(5);
      auto opt =
          makeOptimizer<float>(o, model.parameters(),
                               wholeLayout(model.tensors(), model.parameters().extent(0),
                                           esm2FrozenRanges(model.tensors(), config.hidden)));
      for (int step = 1; step <= steps; ++step) {
        auto global = plm::test::globalStep(42, step, micro, 3);
        ref_losses.push_back(
            trainStep(ExecSpace(), model, *opt, global, learningRate(s, step), 1.0, MPI_COMM_SELF)
                .loss());
      }
    }
    Esm2<float> model(config);
    model.initialize(5);
    plm::dist::ProcessGroups groups(MPI_COMM_WORLD, world);
    Fsdp<float> fsdp(model, groups.shard(), groups.replicate(), o, FsdpOptions{},
                     plm::dist::defaultBackend(groups.shard()));
    for (int step = 1; step <= steps; ++step) {
      auto global = plm::test::globalStep(42, step, micro, 3);
      std::vector<plm::data::MicroBatch> local;
      for (int j = 0; j < micro; ++j)
        if (j % world == rank) local.push_back(global[j]);
      losses.push_back(
          fsdp.step(ExecSpace(), local, learningRate(s, step), 1.0, MPI_COMM_WORLD).loss());
    }
    for (int step = 0; step < steps; ++step)
      EXPECT_NEAR(losses[step], ref_losses[step], 1e-5 * ref_losses[step])
          << optimizerName(o.kind) << " step " << step + 1;
    EXPECT_LT(ref_losses.back(), ref_losses.front()) << optimizerName(o.kind);
  }
}

}  // namespace
