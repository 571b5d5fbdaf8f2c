// Sharded data parallelism (train/fsdp.hpp) against the single-rank reference:
//  - every layout the world size allows (shard 1, 2, 4; 2 shard x 2 replicate at 4 ranks), with
//    and without resharding after forward and with layer and selective recomputation (the
//    model computing on two gathered layer slots, its whole buffers freed), trains 20 AdamW steps
//    whose losses match trainStep on one rank with all micro-batches to 1e-5 relative, and ends
//    with the same parameters (gathered, to 1e-5 of the largest);
//  - 5 micro-batches per step, so at 2 and 4 ranks some ranks have one fewer and only join the
//    collectives (the idle path);
//  - poison: resharded ranges are NaN, so a layer whose all-gather is skipped (its
//    beforeForward hook swallowed) turns the loss into NaN, while the engine's own hooks keep
//    every loss finite: no layer is read before its all-gather completed.
//  - the shard plan: slices cover every unit, the cut tensor table covers each tensor once.
//  - CUDA builds, bf16: the compute copy cast beside each gathered unit (no whole bf16 copy
//    held) trains like bf16 data parallelism on one rank, to the bf16 bound below, and poison
//    reaches the bf16 copy too.
#include "batches.hpp"
#include "core/error.hpp"
#include "dist/process_groups.hpp"
#include "dist/runtime.hpp"
#include "plm/plm_config.hpp"
#include "train/fsdp.hpp"
#include "train/memory_tracker.hpp"
#include "train/schedule.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
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

constexpr int steps = 20;
constexpr int micro_per_step = 5;

std::vector<double> hostCopy(plm::View1<float> v) {
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), v);
  return std::vector<double>(h.data(), h.data() + h.extent(0));
}

plm::train::ScheduleOptions schedule() {
  plm::train::ScheduleOptions s;
  s.peak_lr = 3e-3;
  s.warmup_steps = 4;
  s.decay_steps = steps;
  return s;
}

struct TrainRun {
  std::vector<double> losses;
  std::vector<double> params;
};

Esm2Config bf16Config() {
  Esm2Config c = tinyConfig();
  c.precision = plm::model::Precision::Bf16;
  return c;
}

TrainRun reference(const Esm2Config& config) {
  Esm2<float> model(config);
  model.initialize(11);
  plm::train::AdamW<float> opt(model.parameters(), model.tensors(), plm::train::AdamWOptions{},
                               plm::train::esm2FrozenRanges(model.tensors(), config.hidden));
  TrainRun r;
  for (int step = 1; step <= steps; ++step) {
    auto global = plm::test::globalStep(42, step, micro_per_step, 3);
    auto st = plm::train::trainStep(ExecSpace(), model, opt, global,
                                    plm::train::learningRate(schedule(), step), 0.5, MPI_COMM_SELF);
    r.losses.push_back(st.loss());
  }
  r.params = hostCopy(model.parameters());
  return r;
}

// The backend for the model's memory: NCCL with one GPU per rank, staged MPI with ranks
// sharing a GPU (the single-GPU CUDA ctest), MPI on host memory.  Device memory over plain MPI
// (PLM_COMM_BACKEND=mpi on a CUDA build) has no collectives: skipped.
bool backendFor(MPI_Comm shard, plm::dist::Backend* backend) {
  *backend = plm::dist::defaultBackend(shard);
  return *backend != plm::dist::Backend::Mpi ||
         Kokkos::SpaceAccessibility<Kokkos::HostSpace, plm::MemSpace>::accessible;
}

// `drawn`: the trainer's start-up (a model without whole buffers, each rank drawing its own
// shards); else a whole model initialised on every rank and handed over.
TrainRun sharded(const Esm2Config& config, int shard, const plm::train::FsdpOptions& options,
                 bool drawn = true) {
  const int rank = plm::dist::worldRank(), world = plm::dist::worldSize();
  plm::dist::ProcessGroups groups(MPI_COMM_WORLD, shard);
  Esm2<float> model(config, {},
                    drawn ? plm::model::ModelBuffers::None : plm::model::ModelBuffers::Whole);
  if (!drawn) model.initialize(11);
  plm::dist::Backend backend;
  backendFor(groups.shard(), &backend);
  plm::train::Fsdp<float> fsdp(model, groups.shard(), groups.replicate(),
                               plm::train::AdamWOptions{}, options, backend);
  if (drawn) fsdp.initialize(ExecSpace(), 11);
  TrainRun r;
  for (int step = 1; step <= steps; ++step) {
    auto global = plm::test::globalStep(42, step, micro_per_step, 3);
    std::vector<plm::data::MicroBatch> local;
    for (int j = 0; j < micro_per_step; ++j)
      if (j % world == rank) local.push_back(global[j]);
    auto st = fsdp.step(ExecSpace(), local, plm::train::learningRate(schedule(), step), 0.5,
                        MPI_COMM_WORLD);
    r.losses.push_back(st.loss());
  }
  fsdp.gatherAll(ExecSpace());
  r.params = hostCopy(model.parameters());
  return r;
}

// fp32: the layouts differ only in the order of gradient sums (1e-5).  bf16: a master that
// differs in its last fp32 bits can round to a neighbouring bf16 value (relative step 2^-8) in
// the compute copy, so the bound is the bf16 one; a stale or mis-placed compute copy is off by
// far more (the loss of an untrained layer, or NaN from the poison buffers).
//
// Parameters after 20 steps get their own bound under bf16: where a gradient element is tiny,
// AdamW's update is about +-lr whatever its size, so a bf16 rounding that flips its sign moves
// that parameter by up to 2 lr (3e-3 at the peak here) per step; measured on the H100 at 2
// ranks: 0.7% of the largest parameter (the loss to 7e-5).
void expectSame(const TrainRun& ref, const TrainRun& got, const std::string& what,
                double tol = 1e-5, double param_tol = -1) {
  if (param_tol < 0) param_tol = tol;
  ASSERT_EQ(ref.losses.size(), got.losses.size());
  double worst = 0;
  for (std::size_t s = 0; s < ref.losses.size(); ++s) {
    const double rel = std::abs(got.losses[s] - ref.losses[s]) / std::abs(ref.losses[s]);
    worst = std::max(worst, rel);
    EXPECT_LE(rel, tol) << what << ", step " << s + 1 << ": " << got.losses[s] << " vs "
                        << ref.losses[s];
  }
  EXPECT_LT(ref.losses.back(), ref.losses.front()) << "training did not reduce the loss";
  ASSERT_EQ(ref.params.size(), got.params.size());
  double max_abs = 0, max_diff = 0;
  for (std::size_t i = 0; i < ref.params.size(); ++i) {
    max_abs = std::max(max_abs, std::abs(ref.params[i]));
    max_diff = std::max(max_diff, std::abs(ref.params[i] - got.params[i]));
  }
  EXPECT_LE(max_diff, param_tol * max_abs) << what << ": parameters after the run differ";
  if (plm::dist::worldRank() == 0)
    std::printf("%s on %d ranks: worst relative loss difference %.3g, parameters %.3g\n",
                what.c_str(), plm::dist::worldSize(), worst, max_diff / max_abs);
}

TEST(Fsdp, EveryLayoutMatchesOneRank) {
  const int world = plm::dist::worldSize();
  plm::dist::Backend backend;
  if (!backendFor(MPI_COMM_WORLD, &backend)) GTEST_SKIP() << "device memory over plain MPI";
  const Esm2Config config = tinyConfig();
  const TrainRun ref = reference(config);
  for (int shard = 1; shard <= world; shard *= 2) {
    plm::train::FsdpOptions o;
    o.poison = true;  // any read outside a gather shows up as NaN in the loss
    expectSame(ref, sharded(config, shard, o),
               "shard " + std::to_string(shard) + " x replicate " + std::to_string(world / shard));
  }
  plm::train::FsdpOptions o;  // a whole model handed over (tests, tools) trains the same
  o.poison = true;
  expectSame(ref, sharded(config, world, o, false), "whole model handed over");
}

// Start-up that scales (doc/parallelism.md, "Start-up"): a model built without whole buffers
// whose engine draws only its own shards gathers to exactly the one-rank initialize() values,
// every element bitwise, at every shard degree the world allows; no Kokkos allocation made
// during the start-up is larger than this rank's parameter shard, which is 1/shard of the
// whole buffer (plus at most one padding element per unit).  Eight layers keep a gathered
// layer smaller than a quarter of the model, as in every real model.
TEST(Fsdp, ShardedStartDrawsOnlyItsShardsAndEqualsOneRank) {
  const int world = plm::dist::worldSize();
  plm::dist::Backend backend;
  if (!backendFor(MPI_COMM_WORLD, &backend)) GTEST_SKIP() << "device memory over plain MPI";
  Esm2Config config = tinyConfig();
  config.num_layers = 8;
  Esm2<float> one(config);
  one.initialize(11);
  const std::vector<double> expected = hostCopy(one.parameters());
  const auto n = static_cast<std::int64_t>(expected.size());
  ASSERT_TRUE(plm::train::AllocationTracker::start());
  for (int shard = 1; shard <= world; shard *= 2) {
    const std::string what = "shard " + std::to_string(shard);
    plm::dist::ProcessGroups groups(MPI_COMM_WORLD, shard);
    plm::train::AllocationTracker::resetPeak();
    const std::int64_t before = plm::train::AllocationTracker::inUse();
    Esm2<float> model(config, {}, plm::model::ModelBuffers::None);
    EXPECT_EQ(model.parameters().extent(0), 0u) << what;
    EXPECT_EQ(model.bufferElements(), n) << what;
    plm::train::Fsdp<float> fsdp(model, groups.shard(), groups.replicate(),
                                 plm::train::AdamWOptions{}, plm::train::FsdpOptions{}, backend);
    fsdp.initialize(ExecSpace(), 11);
    const std::int64_t largest = plm::train::AllocationTracker::largest();
    const std::int64_t peak = plm::train::AllocationTracker::peak() - before;
    const auto shard_elements = static_cast<std::int64_t>(fsdp.shardParameters().extent(0));
    const auto units = static_cast<std::int64_t>(fsdp.units().size());
    EXPECT_GE(shard_elements * shard, n) << what;
    EXPECT_LE(shard_elements, n / shard + units) << what;
    EXPECT_LE(largest, shard_elements * std::int64_t(sizeof(float)))
        << what << ": an allocation larger than this rank's shard during the start-up";
    if (shard > 1)
      EXPECT_LT(largest, n * std::int64_t(sizeof(float))) << what << ": a whole-model buffer";
    const plm::train::FsdpMemory planned = fsdp.plannedMemory();
    EXPECT_EQ(planned.params, shard_elements * std::int64_t(sizeof(float))) << what;
    // (The plan of shard 1 is plain data parallelism, without gathered buffers; a few bytes of
    // scalars, e.g. the communicators', are not in the plan.)
    if (shard > 1)
      EXPECT_LE(peak, planned.total() + 4096) << what << ": the start-up held more than the plan";
    EXPECT_EQ(model.parameters().extent(0), 0u) << what;
    fsdp.gatherAll(ExecSpace());
    const std::vector<double> got = hostCopy(model.parameters());
    ASSERT_EQ(got.size(), expected.size()) << what;
    std::int64_t differ = 0;
    for (std::int64_t i = 0; i < n; ++i) differ += got[i] != expected[i] ? 1 : 0;
    EXPECT_EQ(differ, 0) << what << ": drawn shards differ from the one-rank initial values";
  }
  plm::train::AllocationTracker::stop();
}

TEST(Fsdp, NoReshardAfterForwardAndRecomputeMatchOneRank) {
  const int world = plm::dist::worldSize();
  plm::dist::Backend backend;
  if (!backendFor(MPI_COMM_WORLD, &backend)) GTEST_SKIP() << "device memory over plain MPI";
  plm::train::FsdpOptions keep;
  keep.poison = true;
  keep.reshard_after_forward = false;
  expectSame(reference(tinyConfig()), sharded(tinyConfig(), world, keep),
             "reshard_after_forward false");
  Esm2Config rc = tinyConfig();
  rc.recompute = plm::model::Recompute::Layer;
  plm::train::FsdpOptions poison;
  poison.poison = true;
  expectSame(reference(rc), sharded(rc, world, poison), "recompute layer");
  rc.recompute = plm::model::Recompute::Selective;
  expectSame(reference(rc), sharded(rc, world, poison), "recompute selective");
}

// Forwards every hook but the last layer's beforeForward: that layer's forward then reads its
// parameters before their all-gather completed.  The collective sequence is unchanged (the
// layer's all-gather was prefetched by the layer before and is consumed before its backward),
// so every rank stays in step.
class SkipGather : public plm::model::LayerHooks {
 public:
  SkipGather(plm::model::LayerHooks& inner, int skip) : inner_member(inner), skip_member(skip) {}
  void beforeForward(int l) override {
    if (l == skip_member && !backward_member) return;
    inner_member.beforeForward(l);
  }
  void beforeBackward(int l) override {
    backward_member = true;
    inner_member.beforeBackward(l);
  }
  void afterBackward(int l) override { inner_member.afterBackward(l); }
  void afterModelBackward() override { inner_member.afterModelBackward(); }

 private:
  plm::model::LayerHooks& inner_member;
  int skip_member;
  bool backward_member = false;
};

// parallel.gather_dtype: bf16 on fp32 compute (the CPU): every layout trains like the same
// engine at shard 1 (the gathers then round the masters locally) to the bf16 bound, the
// layers really compute on bf16-rounded parameters (the run differs from fp32 gathers, by
// less than the rounding can move a 20-step curve), the masters stay fp32 (gatherAll), and
// the plan counts the bf16 copy.
TEST(Fsdp, Bf16GathersMatchAcrossLayoutsAndRoundTheLayers) {
  const int world = plm::dist::worldSize();
  plm::dist::Backend backend;
  if (!backendFor(MPI_COMM_WORLD, &backend)) GTEST_SKIP() << "device memory over plain MPI";
  plm::train::FsdpOptions o;
  o.poison = true;
  o.gather_bf16 = true;
  const TrainRun one = sharded(tinyConfig(), 1, o);
  for (int shard = 2; shard <= world; shard *= 2)
    expectSame(one, sharded(tinyConfig(), shard, o),
               "bf16 gathers, shard " + std::to_string(shard) + " x replicate " +
                   std::to_string(world / shard),
               2e-3);
  const TrainRun fp32 = reference(tinyConfig());
  double differ = 0;
  for (std::size_t s = 0; s < fp32.losses.size(); ++s)
    differ = std::max(differ, std::abs(one.losses[s] - fp32.losses[s]) / fp32.losses[s]);
  EXPECT_GT(differ, 1e-6) << "bf16 gathers left the layers' parameters unrounded";
  EXPECT_LT(differ, 2e-2) << "bf16-rounded parameters should train like fp32 ones";
  bool off_grid = false;  // gatherAll returns the fp32 masters, not their bf16 copies
  for (double v : one.params) {
    const float f = static_cast<float>(v);
    std::uint32_t bits = 0;
    std::memcpy(&bits, &f, sizeof bits);
    off_grid = off_grid || (bits & 0xFFFFu) != 0;
  }
  EXPECT_TRUE(off_grid) << "gatherAll handed out bf16-rounded parameters";
  plm::train::ShardSizes n;
  n.flat = 1000;
  n.layer_unit = 100;
  n.embed_unit = 200;
  n.head_unit = 300;
  n.layers = 7;
  const auto fp32_mem = plm::train::shardedMemory(n, 4);
  const auto bf16_mem = plm::train::shardedMemory(n, 4, 2, false, 4, true);
  EXPECT_EQ(bf16_mem.params - fp32_mem.params, fp32_mem.params / 2);
  EXPECT_EQ(bf16_mem.gathered - fp32_mem.gathered, 2 * (200 + 300 + 2 * 100));
}

// One sharded micro-batch with the engine's hooks stays finite; with the last layer's
// beforeForward swallowed (its parameters, and under bf16 its compute copy, still at the NaN
// buffers) the loss is NaN.
void expectPoisonCatchesSkippedGather(const Esm2Config& config) {
  const int world = plm::dist::worldSize();
  plm::dist::ProcessGroups groups(MPI_COMM_WORLD, world);
  plm::dist::Backend backend;
  if (!backendFor(groups.shard(), &backend)) GTEST_SKIP() << "device memory over plain MPI";
  Esm2<float> model(config);
  model.initialize(11);
  plm::train::FsdpOptions o;
  o.poison = true;
  plm::train::Fsdp<float> fsdp(model, groups.shard(), groups.replicate(),
                               plm::train::AdamWOptions{}, o, backend);
  // Sharded: the model's whole buffers (and its packed bf16 copy) are gone; its views point
  // into the engine's buffers.
  EXPECT_EQ(model.parameters().extent(0), 0u);
  EXPECT_EQ(model.gradients().extent(0), 0u);
  auto batch = plm::test::globalStep(7, 1, 1, 3)[0];
  const double good = fsdp.microBatch(ExecSpace(), &batch, 1.0);
  fsdp.finishGradients(ExecSpace());
  EXPECT_TRUE(std::isfinite(good)) << "the engine's own hooks read a resharded layer";
  SkipGather skip(fsdp.hooks(), config.num_layers - 1);
  const double bad = fsdp.microBatch(ExecSpace(), &batch, 1.0, &skip);
  fsdp.finishGradients(ExecSpace());
  EXPECT_TRUE(std::isnan(bad)) << "a layer read before its all-gather was not detected";
}

TEST(Fsdp, PoisonCatchesAReadBeforeTheAllGather) { expectPoisonCatchesSkippedGather(tinyConfig()); }

#if PLM_HAVE_CUDA
TEST(Fsdp, Bf16ComputeCopyBesideGatheredUnitsMatchesOneRank) {
  const int world = plm::dist::worldSize();
  plm::dist::Backend backend;
  if (!backendFor(MPI_COMM_WORLD, &backend)) GTEST_SKIP() << "device memory over plain MPI";
  const TrainRun ref = reference(bf16Config());
  for (int shard = 1; shard <= world; shard *= 2) {
    plm::train::FsdpOptions o;
    o.poison = true;
    expectSame(
        ref, sharded(bf16Config(), shard, o),
        "bf16 shard " + std::to_string(shard) + " x replicate " + std::to_string(world / shard),
        2e-3, 3e-2);
  }
  plm::train::FsdpOptions keep;
  keep.reshard_after_forward = false;
  expectSame(ref, sharded(bf16Config(), world, keep), "bf16 reshard_after_forward false", 2e-3,
             3e-2);
  plm::train::FsdpOptions gathers;  // parallel.gather_dtype auto under bf16: bf16 all-gathers
  gathers.poison = true;
  gathers.gather_bf16 = true;
  const TrainRun one = sharded(bf16Config(), 1, gathers);
  expectSame(ref, one, "bf16 compute, bf16 gathers, shard 1", 2e-3, 3e-2);
  for (int shard = 2; shard <= world; shard *= 2)
    expectSame(one, sharded(bf16Config(), shard, gathers),
               "bf16 compute, bf16 gathers, shard " + std::to_string(shard), 2e-3, 3e-2);
  Esm2Config rc = bf16Config();
  rc.recompute = plm::model::Recompute::Selective;
  plm::train::FsdpOptions poison;
  poison.poison = true;
  expectSame(reference(rc), sharded(rc, world, poison), "bf16 recompute selective", 2e-3, 3e-2);
}

TEST(Fsdp, Bf16PoisonCatchesAReadBeforeTheAllGather) {
  expectPoisonCatchesSkippedGather(bf16Config());
}
#endif

TEST(Fsdp, ShardPlanCoversEveryElementOnce) {
  Esm2<float> model(tinyConfig());
  const auto n = static_cast<std::int64_t>(model.parameters().extent(0));
  for (int shard : {1, 2, 3, 4, 7}) {
    const auto units = plm::train::planShardUnits(model.tensors(), n, shard);
    ASSERT_EQ(static_cast<int>(units.size()), tinyConfig().num_layers + 2);
    std::vector<int> covered(n, 0);
    std::int64_t local = 0;
    for (const auto& u : units) {
      EXPECT_EQ(u.local, local);
      EXPECT_GE(u.slice * shard, u.count);
      EXPECT_LT(u.slice * shard - u.count, shard);
      local += u.slice;
      for (std::int64_t i = 0; i < u.count; ++i) ++covered[u.offset + i];
    }
    for (std::int64_t i = 0; i < n; ++i) ASSERT_EQ(covered[i], 1) << "element " << i;
    // Each tensor element appears in exactly one rank's cut table.
    std::int64_t tensor_total = 0, pieces_total = 0;
    for (const auto& t : model.tensors()) tensor_total += t.size;
    for (int r = 0; r < shard; ++r)
      for (const auto& p : plm::train::shardTensorTable(model.tensors(), units, shard, r)) {
        EXPECT_GE(p.offset, 0);
        EXPECT_LE(p.offset + p.size, local);
        pieces_total += p.size;
      }
    EXPECT_EQ(pieces_total, tensor_total) << "shard " << shard;
  }
}

}  // namespace

namespace {

TEST(Fsdp, LayoutResolvesDefaultsAndNamesBothNumbers) {
  using plm::train::resolveLayout;
  auto l = resolveLayout(0, 0, 8, 4);  // a node's ranks x the rest
  EXPECT_EQ(l.shard, 4);
  EXPECT_EQ(l.replicate, 2);
  l = resolveLayout(1, 0, 4, 4);
  EXPECT_EQ(l.shard, 1);
  EXPECT_EQ(l.replicate, 4);
  l = resolveLayout(2, 2, 4, 4);
  EXPECT_EQ(l.shard, 2);
  EXPECT_EQ(l.replicate, 2);
  l = resolveLayout(0, 0, 2, 4);  // fewer ranks than a node holds
  EXPECT_EQ(l.shard, 2);
  try {
    resolveLayout(2, 3, 4, 4);
    ADD_FAILURE() << "2 x 3 on 4 ranks accepted";
  } catch (const plm::Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("shard_degree 2"), std::string::npos) << m;
    EXPECT_NE(m.find("replicate_degree 3"), std::string::npos) << m;
    EXPECT_NE(m.find("4 ranks"), std::string::npos) << m;
  }
  EXPECT_THROW(resolveLayout(3, 0, 4, 4), plm::Error);
}

}  // namespace
