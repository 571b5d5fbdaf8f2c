#include "train/step.hpp"

#include "core/error.hpp"
#include "core/log.hpp"
#include "core/phase.hpp"
#include "core/trace.hpp"
#include "data/context_split.hpp"
#include "dist/allreduce.hpp"
#include "dist/process_groups.hpp"
#include "dist/runtime.hpp"
#include "train/gradient_sync.hpp"

#include <cmath>
#include <memory>

namespace plm::train {

namespace {

// Local counts only; the caller reduces.
BatchStats localCounts(const std::vector<data::MicroBatch>& local) {
  BatchStats s;
  for (const auto& mb : local) {
    s.masked += mb.num_masked;
    s.tokens += mb.numTokens();
    if (mb.context) {  // a context shard: the group's rank 0 counts the whole sequences
      if (mb.context->rank != 0) continue;
      s.sequences += mb.context->numSequences();
      for (const std::int32_t len : mb.context->seq_length)
        s.sum_sq_seqlen += static_cast<double>(len) * len;
      continue;
    }
    s.sequences += mb.numSequences();
    for (std::int32_t q = 0; q < mb.numSequences(); ++q) {
      const double len = static_cast<double>(mb.cu_seqlens(q + 1) - mb.cu_seqlens(q));
      s.sum_sq_seqlen += len * len;
    }
  }
  return s;
}

void reduce(BatchStats& s, MPI_Comm comm) {
  phase::Scope in_phase("loss and count all-reduce (MPI)");
  std::vector<std::int64_t> counts = {s.masked, s.tokens, s.sequences};
  dist::allreduceSum(counts, comm);
  std::vector<double> sums = {s.loss_sum, s.sum_sq_seqlen};
  dist::allreduceSum(sums, comm);
  s.masked = counts[0];
  s.tokens = counts[1];
  s.sequences = counts[2];
  s.loss_sum = sums[0];
  s.sum_sq_seqlen = sums[1];
}

// The gradient sync of the last (model, comm) a step ran on, kept across steps: a communicator
// (an MPI_Comm_dup, or an NCCL init) is too costly to make per step.  The hit test is agreed
// over `comm` so every rank rebuilds together (the rebuild is collective).  The key holds the
// buffer's address and length and the communicator's group; a hit on a buffer reused at the
// same address is still correct, since the ranges cover the whole buffer whatever the layout.
// Released before Kokkos finalizes (the communicator may own CUDA streams, MPI comms).
template <class P> struct SyncCache {
  std::unique_ptr<GradientSync<P>> sync;
  MPI_Comm comm = MPI_COMM_NULL;
  MPI_Group group = MPI_GROUP_NULL;
  const P* data = nullptr;
  std::size_t size = 0;
  int layers = 0;  // the hooks' range indices depend on it

  void reset() {
    sync.reset();
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (group != MPI_GROUP_NULL && !finalized) MPI_Group_free(&group);
    group = MPI_GROUP_NULL;
    comm = MPI_COMM_NULL;
  }

  bool matches(MPI_Comm c, const View1<P>& grads, int layers_now) const {
    if (!sync || c != comm || grads.data() != data || grads.extent(0) != size ||
        layers_now != layers)
      return false;
    MPI_Group g;
    PLM_CHECK_MPI(MPI_Comm_group(c, &g));
    int same = MPI_UNEQUAL;
    PLM_CHECK_MPI(MPI_Group_compare(g, group, &same));
    PLM_CHECK_MPI(MPI_Group_free(&g));
    return same == MPI_IDENT;
  }
};

template <class P> GradientSync<P>& gradientSync(model::Esm2<P>& model, MPI_Comm comm) {
  static SyncCache<P> cache;
  static bool hooked = false;
  if (!hooked) {
    Kokkos::push_finalize_hook([] { cache.reset(); });
    hooked = true;
  }
  View1<P> grads = model.gradients();
  const int layers = model.config().num_layers;
  if (dist::allTrue(cache.matches(comm, grads, layers), comm)) return *cache.sync;
  cache.reset();
  const dist::Backend backend = dist::defaultBackend(comm);
  cache.sync = std::make_unique<GradientSync<P>>(model, comm, backend);
  cache.comm = comm;
  PLM_CHECK_MPI(MPI_Comm_group(comm, &cache.group));
  cache.data = grads.data();
  cache.size = grads.extent(0);
  cache.layers = layers;
  log::debug("train: gradient all-reduce over %s in %d bucket(s)", dist::nameOf(backend),
             cache.sync->buckets().numBuckets());
  return *cache.sync;
}

/// Marks the gradient ranges of GradientSync ready from the model's layer hooks: the head
/// (final LayerNorm, LM head) once the first layer's backward starts, each layer after its
/// backward, the embeddings (tied to the decoder) after the whole backward.
template <class P> class BucketHooks : public model::LayerHooks {
 public:
  BucketHooks(GradientSync<P>& sync, const ExecSpace& space, int layers)
      : sync_member(sync), space_member(space), layers_member(layers) {}
  void beforeBackward(int layer) override {
    if (layer == layers_member - 1) markHead();
  }
  void afterBackward(int layer) override {
    mark(GradientSync<P>::rangeOfLayer(layer, layers_member));
  }
  void afterModelBackward() override {
    markHead();
    mark(layers_member + 1);
  }

 private:
  void markHead() {
    if (!head_done_member) mark(0);
    head_done_member = true;
  }
  void mark(int index) { sync_member.ready(space_member, index); }
  GradientSync<P>& sync_member;
  ExecSpace space_member;
  int layers_member;
  bool head_done_member = false;
};

}  // namespace

BatchStats countBatch(const std::vector<data::MicroBatch>& local, MPI_Comm comm) {
  BatchStats s = localCounts(local);
  reduce(s, comm);
  return s;
}

/// Under context parallelism the ranks of a context group hold the same micro-batches and each
/// keeps its shard of them (shards pass through), so the masked count, the loss and the
/// gradient are partial sums that the data-parallel reductions over all ranks complete.
template <class P> std::vector<data::MicroBatch> forContext(const model::Esm2<P>& model,
                                                            std::vector<data::MicroBatch> local) {
  if (model.contextDegree() == 1) return local;
  for (auto& mb : local)
    if (!mb.context && mb.numTokens() > 0)
      mb = data::contextShard(mb, model.contextDegree(), model.contextRank());
  return local;
}

// Empty micro-batches first: ranks with fewer run them first (they serve their experts), so
// the real last micro-batch keeps the layer hooks.
std::vector<data::MicroBatch> padForExperts(const std::vector<data::MicroBatch>& local,
                                            MPI_Comm comm) {
  const double most = dist::allreduceMax(static_cast<double>(local.size()), comm);
  std::vector<data::MicroBatch> out(static_cast<std::size_t>(most) - local.size());
  out.insert(out.end(), local.begin(), local.end());
  return out;
}

template <class P> BatchStats accumulateGradients(const ExecSpace& space, model::Esm2<P>& model,
                                                  const std::vector<data::MicroBatch>& given,
                                                  MPI_Comm comm) {
  Kokkos::Profiling::pushRegion("plm::train::accumulateGradients");
  const std::vector<data::MicroBatch> local = model.expertParallel()
                                                  ? padForExperts(forContext(model, given), comm)
                                                  : forContext(model, given);
  BatchStats s = localCounts(local);
  phase::set("masked-token count all-reduce (MPI)");
  std::int64_t global_masked = dist::allreduceSum(s.masked, comm);
  phase::set("forward/backward");
  model.zeroGradients();
  const double grad_scale = global_masked > 0 ? 1.0 / static_cast<double>(global_masked) : 0.0;
  model.refreshComputeWeights();    // the bf16 copy of the masters, once per optimizer step
  if (dist::commSize(comm) == 1) {  // nothing to reduce
    for (const auto& mb : local) s.loss_sum += model.forwardBackward(mb, grad_scale, false);
  } else {
    GradientSync<P>& sync = gradientSync(model, comm);
    // Gradients are final in the last micro-batch's backward: there the model's layer hooks
    // hand each range to the buckets as soon as it is done, so the all-reduce of the last
    // layers overlaps the backward of the first ones.
    BucketHooks<P> hooks(sync, space, model.config().num_layers);
    struct Unhook {  // the model must not keep a pointer to `hooks` past this scope
      model::Esm2<P>& m;
      ~Unhook() { m.setHooks(nullptr); }
    } unhook{model};
    // A rank without a micro-batch (an empty one, expert parallelism's idle pass) marks every
    // range after the loop instead.
    const bool idle_last =
        local.empty() || (local.back().numTokens() == 0 && !local.back().context);
    for (std::size_t i = 0; i < local.size(); ++i) {
      model.setHooks(i + 1 == local.size() && !idle_last ? &hooks : nullptr);
      s.loss_sum += model.forwardBackward(local[i], grad_scale, false);
    }
    model.setHooks(nullptr);
    if (idle_last)
      sync.readyAll(space);  // a rank with no micro-batch this step (a shard ran the hooks)
    phase::set("gradient all-reduce (finish)");
    sync.finish(space);
  }
  if (model.fp8Scaling()) {  // the step's amaxes: one all-reduce (MAX), new scales
    phase::set("fp8 amax all-reduce (MPI)");
    model.endFp8Step(comm);
  }
  reduce(s, comm);
  Kokkos::Profiling::popRegion();
  return s;
}

template <class P> StepStats trainStep(const ExecSpace& space, model::Esm2<P>& model,
                                       Optimizer<P>& optimizer,
                                       const std::vector<data::MicroBatch>& local, double lr,
                                       double clip_norm, MPI_Comm comm) {
  const BatchStats batch = accumulateGradients(space, model, local, comm);
  return finishStep(space, model, optimizer, batch, lr, clip_norm, comm);
}

template <class P> double gradientNorm(const ExecSpace& space, const model::Esm2<P>& model,
                                       View1<P> grads, MPI_Comm comm) {
  const model::ExpertPlacement& held = model.expertPlacement();
  if (!held.sharded()) return globalNorm(space, grads);
  PLM_REQUIRE(comm != MPI_COMM_NULL,
              "train::gradientNorm: a model holding part of the experts needs the step's ranks");
  // Everything but the routed experts is identical on every rank; each expert's (reduced)
  // gradient is held by world / degree ranks, so the world sum counts it that many times.
  double dense = 0, experts = 0;
  std::int64_t at = 0;
  auto sumSquares = [&](std::int64_t begin, std::int64_t end) {
    const double norm = globalNorm(space, View1<P>(grads.data() + begin, end - begin));
    return norm * norm;
  };
  for (const auto& [offset, count] : model::expertRuns(model.tensors())) {
    dense += sumSquares(at, offset);
    experts += sumSquares(offset, offset + count);
    at = offset + count;
  }
  dense += sumSquares(at, static_cast<std::int64_t>(grads.extent(0)));
  const double replicas = static_cast<double>(dist::commSize(comm) / held.degree);
  return std::sqrt(dense + dist::allreduceSum(experts, comm) / replicas);
}

template <class P> StepStats finishStep(const ExecSpace& space, model::Esm2<P>& model,
                                        Optimizer<P>& optimizer, const BatchStats& batch, double lr,
                                        double clip_norm, MPI_Comm comm) {
  StepStats st;
  static_cast<BatchStats&>(st) = batch;
  st.lr = lr;
  if (st.masked == 0) {
    // Possible only with tiny batches and a low mask_prob; an update from a zero gradient would
    // still move the weights (decay, momentum), so the step is skipped instead.
    st.applied = false;
    log::warn("train: a global batch had no masked token; the optimizer step is skipped");
    return st;
  }
  phase::Scope in_phase("optimizer step");
  Kokkos::Profiling::pushRegion("plm::train::optimizerStep");
  PLM_TRACE("plm::optimizer step");
  View1<P> grads = model.gradients();
  optimizer.maskGradients(space, grads);
  st.grad_norm = gradientNorm(space, model, grads, comm);
  if (!std::isfinite(st.grad_norm) || !std::isfinite(st.loss_sum)) {
    // Every rank holds the same all-reduced gradient and loss, so all of them get here; the
    // weights and moments stay as they were (train/stability.hpp decides what happens next).
    st.applied = false;
    st.nonfinite = true;
    Kokkos::Profiling::popRegion();
    return st;
  }
  st.clip_factor = clipFactor(st.grad_norm, clip_norm);
  optimizer.step(space, grads, lr, st.clip_factor);
  space.fence();
  Kokkos::Profiling::popRegion();
  return st;
}

template <class P> BatchStats evaluate(const ExecSpace& space, model::Esm2<P>& model,
                                       data::Loader& loader, std::int64_t max_steps, MPI_Comm comm,
                                       const CollectiveForward& forward) {
  Kokkos::Profiling::pushRegion("plm::train::evaluate");
  loader.seek(data::Cursor{});
  BatchStats s;
  if (!forward) model.refreshComputeWeights();  // FSDP casts each unit as it gathers it
  // No collective inside the loop (unless passes are collective): ranks may reach the end of
  // the pass one call apart.
  for (std::int64_t step = 0; max_steps <= 0 || step < max_steps; ++step) {
    std::vector<data::MicroBatch> local = forContext(model, loader.nextStep());
    if (model.expertParallel()) {  // passes are collective: agree on each loader step
      local = padForExperts(local, comm);
      if (local.empty()) break;
    }
    if (forward) {  // every rank joins the same number of gathered passes
      const auto micro =
          static_cast<std::size_t>(dist::allreduceMax(static_cast<double>(local.size()), comm));
      if (micro == 0) break;
      BatchStats c = localCounts(local);
      s.masked += c.masked;
      s.tokens += c.tokens;
      s.sequences += c.sequences;
      s.sum_sq_seqlen += c.sum_sq_seqlen;
      for (std::size_t i = 0; i < micro; ++i)
        s.loss_sum += forward(i < local.size() ? &local[i] : nullptr);
      continue;
    }
    if (local.empty()) break;
    BatchStats c = localCounts(local);
    s.masked += c.masked;
    s.tokens += c.tokens;
    s.sequences += c.sequences;
    s.sum_sq_seqlen += c.sum_sq_seqlen;
    for (const auto& mb : local) s.loss_sum += model.forward(mb, nullptr, false);
  }
  space.fence();
  reduce(s, comm);
  Kokkos::Profiling::popRegion();
  return s;
}

#define PLM_TRAIN_INSTANTIATE(P)                                                                   \
  template BatchStats accumulateGradients<P>(const ExecSpace&, model::Esm2<P>&,                    \
                                             const std::vector<data::MicroBatch>&, MPI_Comm);      \
  template StepStats trainStep<P>(const ExecSpace&, model::Esm2<P>&, Optimizer<P>&,                \
                                  const std::vector<data::MicroBatch>&, double, double, MPI_Comm); \
  template StepStats finishStep<P>(const ExecSpace&, model::Esm2<P>&, Optimizer<P>&,               \
                                   const BatchStats&, double, double, MPI_Comm);                   \
  template BatchStats evaluate<P>(const ExecSpace&, model::Esm2<P>&, data::Loader&, std::int64_t,  \
                                  MPI_Comm, const CollectiveForward&);

PLM_TRAIN_INSTANTIATE(float)
PLM_TRAIN_INSTANTIATE(double)
#undef PLM_TRAIN_INSTANTIATE

}  // namespace plm::train
