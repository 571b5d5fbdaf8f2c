// The planned bytes per rank (plm plan's memory table, the one formula train::shardedMemory
// shares with the sharding engine) against the measured Kokkos allocations
// (train::AllocationTracker) of real CPU training steps, at every layout the rank count
// allows: shard 1 (data parallelism: the model's whole buffers and AdamW) and shard 2 and 4
// (train::Fsdp, replicated over the remaining ranks).
//  - The model state at rest (parameters, gradients, optimizer, gathered-layer buffers) is
//    what the plan counts for it, to 10%.
//  - The peak of the first step (state + activations + batch) is the plan's buffers, to 10%.
//  - The measured state per rank falls with the shard degree (shard 2 < shard 1, 4 < 2).
// Model: 8 layers of hidden 128 (1.6 M parameters) and micro-batches of 256 tokens, so the
// sharded state is a sizeable part of the peak next to the activations.
// MoE: the same model with 4 experts of width 256, top-2, in every layer, its experts split
// over all ranks (expert degree = ranks): the plan at the load the step's routing put on this
// rank (its experts' rows over the balanced t k) against this rank's measured peak, to 10%;
// the state per rank falls with the expert degree.
#include "dist/communicator.hpp"
#include "dist/process_groups.hpp"
#include "dist/runtime.hpp"
#include "plan/plan.hpp"
#include "train/fsdp.hpp"
#include "train/memory_tracker.hpp"
#include "train/optim/adamw.hpp"

#include <gtest/gtest.h>

#include <cstdio>
#include <random>
#include <vector>

namespace {

using namespace plm;

model::Esm2Config config() {
  model::Esm2Config c;
  c.num_layers = 8;
  c.hidden = 128;
  c.heads = 8;
  c.ffn = 512;
  return c;
}

constexpr std::int64_t tokens = 256;
constexpr std::int64_t labelled = 41;

// A packed micro-batch of `tokens` tokens in four sequences, `labelled` of them labelled.
data::MicroBatch makeBatch(std::uint64_t seed) {
  data::MicroBatch b;
  b.tokens = HostView1<token_t>("tokens", tokens);
  b.labels = HostView1<std::int32_t>("labels", tokens);
  b.cu_seqlens = HostView1<seqlen_t>("cu", 5);
  std::mt19937_64 rng(seed);
  for (std::int64_t i = 0; i < tokens; ++i) {
    b.tokens(i) = static_cast<token_t>(4 + rng() % 20);
    b.labels(i) = i % 6 == 0 && i / 6 < labelled ? static_cast<std::int32_t>(4 + rng() % 20)
                                                 : data::vocab::ignore_label;
  }
  for (int s = 0; s <= 4; ++s) b.cu_seqlens(s) = static_cast<seqlen_t>(s * tokens / 4);
  b.max_seqlen = static_cast<std::int32_t>(tokens / 4);
  b.num_masked = labelled;
  return b;
}

plan::Plan planOf(int shard, int world) {
  plan::Input in;
  in.model = config();
  in.micro_batch_tokens = tokens;
  in.mask_prob = (labelled - 0.5) / tokens;  // ceil(mask_prob t) = labelled rows
  in.layout.ranks_per_node = world;
  in.layout.shard = shard;
  in.rates = plan::builtinRates("cpu");
  return plan::makePlan(in);
}

// Parameters, gradients, optimizer, gathered buffers (not the activations, the batch or the
// MoE layers' buffers, which the first step allocates).
double stateOf(const plan::Plan& p) {
  double s = 0;
  for (const auto& i : p.memory)
    if (i.allocated && i.name.rfind("activations", 0) != 0 && i.name.rfind("batch", 0) != 0 &&
        i.name.rfind("MoE", 0) != 0)
      s += i.value;
  return s;
}

struct Measured {
  double state = 0;  // in use after construction, before the first step
  double peak = 0;   // the first step's high-water mark
};

// One layout: build the model (and the engine), measure, run one step, measure its peak.
Measured measure(int shard) {
  const int world = dist::worldSize(), rank = dist::worldRank();
  const std::int64_t base = train::AllocationTracker::inUse();
  Measured out;
  auto global = std::vector<data::MicroBatch>();
  for (int j = 0; j < world; ++j) global.push_back(makeBatch(17 + j));
  std::vector<data::MicroBatch> local = {global[rank]};
  model::Esm2<float> model(config());
  model.initialize(3);
  if (shard == 1) {
    train::AdamW<float> opt(model.parameters(), model.tensors(), train::AdamWOptions{});
    out.state = static_cast<double>(train::AllocationTracker::inUse() - base);
    train::AllocationTracker::resetPeak();
    train::trainStep(ExecSpace(), model, opt, local, 1e-4, 1.0, MPI_COMM_WORLD);
    out.peak = static_cast<double>(train::AllocationTracker::peak() - base);
  } else {
    dist::ProcessGroups groups(MPI_COMM_WORLD, shard);
    train::Fsdp<float> fsdp(model, groups.shard(), groups.replicate(), train::AdamWOptions{}, {},
                            dist::defaultBackend(groups.shard()));
    out.state = static_cast<double>(train::AllocationTracker::inUse() - base);
    train::AllocationTracker::resetPeak();
    fsdp.step(ExecSpace(), local, 1e-4, 1.0, MPI_COMM_WORLD);
    out.peak = static_cast<double>(train::AllocationTracker::peak() - base);
  }
  return out;
}

TEST(MemoryPlan, MeasuredBytesMatchThePlanAndFallWithTheShardDegree) {
  if (!train::AllocationTracker::start()) GTEST_SKIP() << "a Kokkos tool library is loaded";
  // Device memory with ranks sharing a GPU has no sharding backend (the single-GPU ctest).
  if (dist::worldSize() > 1 && dist::defaultBackend(MPI_COMM_WORLD) != dist::Backend::Nccl &&
      !Kokkos::SpaceAccessibility<Kokkos::HostSpace, MemSpace>::accessible)
    GTEST_SKIP() << "ranks share a GPU: no NCCL";
  const int world = dist::worldSize();
  std::vector<double> states;
  for (int shard = 1; shard <= world; shard *= 2) {
    const Measured m = measure(shard);
    const plan::Plan p = planOf(shard, world);
    const double planned_state = stateOf(p);
    if (dist::worldRank() == 0)
      std::printf(
          "shard %d of %d ranks: state planned %s, measured %s; first step peak planned "
          "%s, measured %s\n",
          shard, world, plan::bytesText(planned_state).c_str(), plan::bytesText(m.state).c_str(),
          plan::bytesText(p.memory_allocated).c_str(), plan::bytesText(m.peak).c_str());
    EXPECT_NEAR(m.state, planned_state, 0.10 * planned_state) << "shard " << shard;
    // The first step's peak is planned for the CPU's portable model; on a GPU the portable
    // kernels' device workspaces differ (doc/plan.md: validation/plan_accuracy.py checks GPUs).
    if (Kokkos::SpaceAccessibility<Kokkos::HostSpace, plm::MemSpace>::accessible)
      EXPECT_NEAR(m.peak, p.memory_allocated, 0.10 * p.memory_allocated) << "shard " << shard;
    if (!states.empty()) EXPECT_LT(m.state, states.back()) << "shard " << shard;
    states.push_back(m.state);
  }
  train::AllocationTracker::stop();
}

model::Esm2Config moeConfig() {
  auto c = config();
  c.moe.experts = 4;
  c.moe.top_k = 2;
  c.moe.every = 1;
  c.moe.expert_ffn = 256;
  return c;
}

TEST(MemoryPlan, MoeBuffersMatchThePlanAtTheMeasuredLoad) {
  if (!train::AllocationTracker::start()) GTEST_SKIP() << "a Kokkos tool library is loaded";
  if (!Kokkos::SpaceAccessibility<Kokkos::HostSpace, MemSpace>::accessible)
    GTEST_SKIP() << "the CPU's portable MoE path is what this test plans (GPU: "
                    "validation/plan_accuracy.py)";
  const int world = dist::worldSize(), rank = dist::worldRank();
  if (4 % world != 0) GTEST_SKIP() << "the 4 experts split over 1, 2 or 4 ranks";
  auto comm = dist::makeCommunicator(MPI_COMM_WORLD, dist::defaultBackend(MPI_COMM_WORLD));
  // GELU experts, then SwiGLU experts (three matrices each; twice the activations per row).
  for (const auto activation : {model::ExpertActivation::Gelu, model::ExpertActivation::Swiglu}) {
    auto c = moeConfig();
    c.moe.expert_activation = activation;
    const std::int64_t base = train::AllocationTracker::inUse();
    double state = 0, peak = 0;
    std::vector<std::vector<double>> routed;
    {
      model::Esm2<float> model(c, model::ExpertPlacement{world, rank});
      model.initialize(3);
      if (world > 1) model.setExpertParallel(comm.get());
      train::AdamW<float> opt(model.parameters(), model.tensors(), train::AdamWOptions{});
      state = static_cast<double>(train::AllocationTracker::inUse() - base);
      train::AllocationTracker::resetPeak();
      model.zeroGradients();
      model.forwardBackward(makeBatch(17 + rank), 1.0 / labelled);
      opt.step(ExecSpace(), model.gradients(), 1e-4);
      peak = static_cast<double>(train::AllocationTracker::peak() - base);
      for (const auto& s : model.moeStats()) routed.push_back(s.routed);
    }
    // This rank's load: its experts' slots (routed by every rank of the group) over t k.
    for (auto& layer : routed)
      MPI_Allreduce(MPI_IN_PLACE, layer.data(), static_cast<int>(layer.size()), MPI_DOUBLE, MPI_SUM,
                    MPI_COMM_WORLD);
    double load = 0;
    for (const auto& layer : routed) {
      double mine = 0, all = 0;
      for (int e = 0; e < 4; ++e) {
        all += layer[e];
        if (e / (4 / world) == rank) mine += layer[e];
      }
      load += world * mine / all / static_cast<double>(routed.size());
    }
    plan::Input in;
    in.model = c;
    in.micro_batch_tokens = tokens;
    in.mask_prob = (labelled - 0.5) / tokens;
    in.layout.ranks_per_node = world;
    in.layout.expert = world;
    in.moe_load = load;
    in.rates = plan::builtinRates("cpu");
    const auto p = plan::makePlan(in);
    const double planned_state = stateOf(p);
    std::printf(
        "%s experts, rank %d, expert degree %d, load %.3f: state planned %s, measured %s; first "
        "step peak planned %s, measured %s\n",
        model::expertActivationName(activation), rank, world, load,
        plan::bytesText(planned_state).c_str(), plan::bytesText(state).c_str(),
        plan::bytesText(p.memory_allocated).c_str(), plan::bytesText(peak).c_str());
    EXPECT_NEAR(state, planned_state, 0.10 * planned_state);
    EXPECT_NEAR(peak, p.memory_allocated, 0.10 * p.memory_allocated);
    // The MoE buffers are the part this test is about: without them the plan misses the peak.
    double moe = 0;
    for (const auto& i : p.memory)
      if (i.name.rfind("MoE", 0) == 0) moe += i.value;
    EXPECT_GT(moe, 0.10 * peak);
    EXPECT_GT(peak - (p.memory_allocated - moe), 0.5 * moe);
    // The state per rank falls with the expert degree (the routed experts divide by it).
    if (world > 1) {
      plan::Input one = in;
      one.layout.expert = 1;
      EXPECT_LT(planned_state, stateOf(plan::makePlan(one)));
    }
  }
  train::AllocationTracker::stop();
}

// FSDP beside expert parallelism (4 ranks: shard 2 x expert 2, doc/parallelism.md): each rank
// holds half the experts and shards them, with the dense tensors, over the two ranks holding the
// same experts.  The plan's model state (parameters, gradients, AdamW, gathered units) is the
// fullest rank's measured one to 10% (the replicate all-reduce sums the dense pieces in place:
// no copy of the expert pieces), and below the same experts unsharded (expert degree 2 alone).
TEST(MemoryPlan, ShardedExpertsMatchThePlan) {
  if (!train::AllocationTracker::start()) GTEST_SKIP() << "a Kokkos tool library is loaded";
  const int world = dist::worldSize(), rank = dist::worldRank();
  if (world != 4) GTEST_SKIP() << "shard 2 x expert 2 needs 4 ranks";
  if (dist::defaultBackend(MPI_COMM_WORLD) != dist::Backend::Nccl &&
      !Kokkos::SpaceAccessibility<Kokkos::HostSpace, MemSpace>::accessible)
    GTEST_SKIP() << "ranks share a GPU: no NCCL";
  const int degree = 2;
  const auto c = moeConfig();
  // As train::Trainer splits them: the shard group holds the same experts (ranks p, p + 2),
  // the replicate group is the expert group (consecutive ranks).
  MPI_Comm shard = MPI_COMM_NULL, replicate = MPI_COMM_NULL;
  MPI_Comm_split(MPI_COMM_WORLD, rank % degree, rank, &shard);
  MPI_Comm_split(MPI_COMM_WORLD, rank / degree, rank, &replicate);
  double state = 0;
  {
    auto experts = dist::makeCommunicator(replicate, dist::defaultBackend(replicate));
    const std::int64_t base = train::AllocationTracker::inUse();
    model::Esm2<float> model(c, model::ExpertPlacement{degree, rank % degree});
    model.initialize(3);
    model.setExpertParallel(experts.get());
    train::Fsdp<float> fsdp(model, shard, replicate, train::AdamWOptions{}, {},
                            dist::defaultBackend(shard));
    state = static_cast<double>(train::AllocationTracker::inUse() - base);
  }
  // The plan is the fullest rank's (the last of a shard group holds most of the experts).
  const double mine = state;
  MPI_Allreduce(MPI_IN_PLACE, &state, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  plan::Input in;
  in.model = c;
  in.micro_batch_tokens = tokens;
  in.mask_prob = (labelled - 0.5) / tokens;
  in.layout.ranks_per_node = world;
  in.layout.shard = 2;
  in.layout.expert = degree;
  in.rates = plan::builtinRates("cpu");
  const double planned = stateOf(plan::makePlan(in));
  plan::Input alone = in;
  alone.layout.shard = 1;
  const double unsharded = stateOf(plan::makePlan(alone));
  std::printf(
      "shard 2 x expert 2, rank %d: state planned %s, measured %s here, %s on the fullest rank "
      "(expert 2 alone: %s)\n",
      rank, plan::bytesText(planned).c_str(), plan::bytesText(mine).c_str(),
      plan::bytesText(state).c_str(), plan::bytesText(unsharded).c_str());
  EXPECT_NEAR(state, planned, 0.10 * planned);
  EXPECT_LT(state, 0.75 * unsharded) << "the held experts are sharded too";
  MPI_Comm_free(&shard);
  MPI_Comm_free(&replicate);
  train::AllocationTracker::stop();
}

}  // namespace
