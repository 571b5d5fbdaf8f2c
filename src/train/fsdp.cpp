#include "train/fsdp.hpp"

#include "core/error.hpp"
#include "core/log.hpp"
#include "dist/allreduce.hpp"
#include "dist/process_groups.hpp"
#include "dist/stream.hpp"
#include "train/gradient_sync.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

namespace plm::train {

std::vector<ShardUnit> planShardUnits(const std::vector<model::TensorInfo>& tensors,
                                      std::int64_t buffer_size, int shard) {
  PLM_REQUIRE(shard >= 1, "train::planShardUnits: shard size " + std::to_string(shard));
  std::vector<ShardUnit> units;
  std::int64_t local = 0;
  for (const auto& r : backwardOrderRanges(tensors, buffer_size)) {
    ShardUnit u;
    u.offset = r.offset;
    u.count = r.count;
    u.slice = (r.count + shard - 1) / shard;
    u.local = local;
    local += u.slice;
    units.push_back(u);
  }
  return units;
}

ParallelLayout resolveLayout(int shard_degree, int replicate_degree, int world, int node_ranks) {
  ParallelLayout l;
  l.shard = shard_degree > 0 ? shard_degree : std::min(node_ranks, world);
  if (l.shard > world || world % l.shard != 0)
    throw collectiveError("parallel.shard_degree: " + std::to_string(l.shard) +
                          (shard_degree > 0 ? "" : " (the ranks of a node)") +
                          " does not divide the " + std::to_string(world) +
                          " ranks of this job; choose a divisor of the rank count");
  l.replicate = replicate_degree > 0 ? replicate_degree : world / l.shard;
  if (l.shard * l.replicate != world)
    throw collectiveError("parallel: shard_degree " + std::to_string(l.shard) +
                          " x replicate_degree " + std::to_string(l.replicate) + " = " +
                          std::to_string(l.shard * l.replicate) + ", but the job has " +
                          std::to_string(world) +
                          " ranks; the product must equal the rank count (set replicate_degree: "
                          "0 to take the rest)");
  return l;
}

namespace {

// Calls f(local_offset, global_offset, length) for each piece of [begin, begin + n) that
// `rank` owns.
template <class F> void forOwnedPieces(const std::vector<ShardUnit>& units, int rank,
                                       std::int64_t begin, std::int64_t n, F&& f) {
  for (const auto& u : units) {
    const std::int64_t own_begin = u.offset + rank * u.slice;
    const std::int64_t own_end = std::min(own_begin + u.slice, u.offset + u.count);
    const std::int64_t a = std::max(begin, own_begin);
    const std::int64_t b = std::min(begin + n, own_end);
    if (a < b) f(u.local + (a - own_begin), a, b - a);
  }
}

}  // namespace

std::vector<model::TensorInfo> shardTensorTable(const std::vector<model::TensorInfo>& tensors,
                                                const std::vector<ShardUnit>& units, int shard,
                                                int rank) {
  (void)shard;
  std::vector<model::TensorInfo> out;
  for (const auto& t : tensors) {
    forOwnedPieces(units, rank, t.offset, t.size,
                   [&](std::int64_t local, std::int64_t, std::int64_t n) {
                     model::TensorInfo piece = t;
                     piece.offset = local;
                     piece.size = n;
                     piece.shape = {n};
                     out.push_back(piece);
                   });
  }
  return out;
}

ParamLayout shardParamLayout(const std::vector<model::TensorInfo>& tensors,
                             const std::vector<ShardUnit>& units, int rank, int hidden) {
  ParamLayout l;
  l.tensors = tensors;
  for (const auto& u : units) l.local_size += u.slice;
  for (std::size_t t = 0; t < tensors.size(); ++t)
    forOwnedPieces(
        units, rank, tensors[t].offset, tensors[t].size,
        [&](std::int64_t local, std::int64_t global, std::int64_t n) {
          l.pieces.push_back({static_cast<int>(t), local, global - tensors[t].offset, n});
        });
  std::sort(l.pieces.begin(), l.pieces.end(),
            [](const TensorPiece& a, const TensorPiece& b) { return a.local < b.local; });
  for (const auto& f : esm2FrozenRanges(tensors, hidden))
    forOwnedPieces(units, rank, f.offset, f.size,
                   [&](std::int64_t local, std::int64_t, std::int64_t n) {
                     l.frozen.push_back({local, n});
                   });
  return l;
}

template <class P> struct Fsdp<P>::Impl : model::LayerHooks {
  model::Esm2<P>& model;
  FsdpOptions options;
  MPI_Comm shard_mpi = MPI_COMM_NULL;  // duplicates, for the scalar norm reduction
  std::unique_ptr<dist::Communicator> shard_comm, replicate_comm;
  int layers = 0;
  std::vector<ShardUnit> units;  // backward order: head, layers L-1..0, embeddings
  View1<P> params_shard;         // (sum of slices) master shard
  View1<P> grads_shard;          // (sum of slices)
  View1<P> gather_buf[2];        // (max slice * shard) [0] blocking, [1] prefetch
  View1<P> scatter_buf[2];       // (max slice * shard) alternating reduce-scatter sends
  dist::Work scatter_work[2];
  int scatter_next = 0;
  std::vector<char> gathered;
  int pending_unit = -1;  // unit whose all-gather into gather_buf[1] is in flight
  dist::Work pending_work;
  std::unique_ptr<Optimizer<P>> optimizer;
  ExecSpace space;
  bool last = false;
  bool backward_phase = false;
  bool head_reduced = false;

  Impl(model::Esm2<P>& m, MPI_Comm shard, MPI_Comm replicate, const OptimizerOptions& opt,
       const FsdpOptions& opts, dist::Backend backend)
      : model(m), options(opts), layers(m.config().num_layers) {
    PLM_REQUIRE(m.config().precision == model::Precision::Fp32,
                "parallel.shard_degree > 1 runs train.precision: fp32 only (the bf16 compute "
                "copy is not gathered per layer yet); set train.precision: fp32 or "
                "parallel.shard_degree: 1");
    PLM_CHECK_MPI(MPI_Comm_dup(shard, &shard_mpi));
    shard_comm = dist::makeCommunicator(shard, backend);
    replicate_comm = dist::makeCommunicator(replicate, backend);
    if (!shard_comm->deviceMemory() &&
        !Kokkos::SpaceAccessibility<Kokkos::HostSpace, MemSpace>::accessible)
      throw Error(
          "parallel: sharding device memory needs the NCCL backend (one GPU per rank); "
          "this job would hand device pointers to MPI");
    const int s = shard_comm->size();
    View1<P> full = m.parameters();
    units = planShardUnits(m.tensors(), static_cast<std::int64_t>(full.extent(0)), s);
    std::int64_t total = 0, widest = 0;
    for (const auto& u : units) {
      total += u.slice;
      widest = std::max(widest, u.slice * s);
    }
    params_shard = View1<P>("plm::train::fsdp::params_shard", total);
    grads_shard = View1<P>("plm::train::fsdp::grads_shard", total);
    for (int b = 0; b < 2; ++b) {
      gather_buf[b] = View1<P>(
          Kokkos::view_alloc(Kokkos::WithoutInitializing, "plm::train::fsdp::gather_buf"), widest);
      scatter_buf[b] = View1<P>("plm::train::fsdp::scatter_buf", widest);
    }
    gathered.assign(units.size(), 1);  // the model's buffers hold the initial parameters
    const int r = shard_comm->rank();
    forOwnedPieces(units, r, 0, static_cast<std::int64_t>(full.extent(0)),
                   [&](std::int64_t local, std::int64_t global, std::int64_t n) {
                     Kokkos::deep_copy(
                         space, Kokkos::subview(params_shard, std::make_pair(local, local + n)),
                         Kokkos::subview(full, std::make_pair(global, global + n)));
                   });
    optimizer = makeOptimizer<P>(opt, params_shard,
                                 shardParamLayout(m.tensors(), units, r, m.config().hidden));
    optimizer->setShardGroup(shard_mpi);
    space.fence();
  }

  ~Impl() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (shard_mpi != MPI_COMM_NULL && !finalized) MPI_Comm_free(&shard_mpi);
  }

  int unitOfLayer(int l) const { return 1 + (layers - 1 - l); }
  int headUnit() const { return 0; }
  int embedUnit() const { return layers + 1; }

  void fenceForMpi() {
    if (!shard_comm->deviceMemory()) space.fence();
  }

  dist::Work launchGather(int u, int buf) {
    const ShardUnit& su = units[u];
    fenceForMpi();
    return shard_comm->allGather(params_shard.data() + su.local, gather_buf[buf].data(), su.slice,
                                 dist::streamOf(space));
  }

  void ensureGathered(int u) {
    if (gathered[u]) return;
    int buf = 0;
    if (pending_unit == u) {
      pending_work.wait(dist::streamOf(space));
      pending_unit = -1;
      buf = 1;
    } else {
      launchGather(u, 0).wait(dist::streamOf(space));
    }
    const ShardUnit& su = units[u];
    Kokkos::deep_copy(
        space, Kokkos::subview(model.parameters(), std::make_pair(su.offset, su.offset + su.count)),
        Kokkos::subview(gather_buf[buf], std::make_pair(std::int64_t(0), su.count)));
    gathered[u] = 1;
  }

  void prefetch(int u) {
    if (gathered[u] || pending_unit == u) return;
    if (pending_unit >= 0) ensureGathered(pending_unit);  // one prefetch in flight at a time
    pending_work = launchGather(u, 1);
    pending_unit = u;
  }

  void reshard(int u) {
    if (!gathered[u]) return;
    gathered[u] = 0;
    if (!options.poison) return;
    const ShardUnit& su = units[u];
    Kokkos::deep_copy(
        space, Kokkos::subview(model.parameters(), std::make_pair(su.offset, su.offset + su.count)),
        std::numeric_limits<P>::quiet_NaN());
  }

  void reduceScatter(int u) {
    const int b = scatter_next;
    scatter_next = 1 - b;
    scatter_work[b].wait(dist::streamOf(space));  // the buffer's previous send is done
    const ShardUnit& su = units[u];
    const int s = shard_comm->size();
    View1<P> send = scatter_buf[b];
    Kokkos::deep_copy(
        space, Kokkos::subview(send, std::make_pair(std::int64_t(0), su.count)),
        Kokkos::subview(model.gradients(), std::make_pair(su.offset, su.offset + su.count)));
    if (su.slice * s > su.count)
      Kokkos::deep_copy(space, Kokkos::subview(send, std::make_pair(su.count, su.slice * s)), P(0));
    fenceForMpi();
    scatter_work[b] = shard_comm->reduceScatterSum(send.data(), grads_shard.data() + su.local,
                                                   su.slice, dist::streamOf(space));
  }

  // LayerHooks: the one sequence of collectives (see the header).
  void beforeForward(int l) override {
    if (!backward_phase) {
      if (l > 0 && options.reshard_after_forward) reshard(unitOfLayer(l - 1));
      ensureGathered(unitOfLayer(l));
      if (l + 1 < layers) prefetch(unitOfLayer(l + 1));
    } else {  // a recomputing forward inside backward
      ensureGathered(unitOfLayer(l));
      if (l > 0) prefetch(unitOfLayer(l - 1));
    }
  }
  void beforeBackward(int l) override {
    if (!backward_phase) {
      backward_phase = true;
      if (last) {
        reduceScatter(headUnit());
        head_reduced = true;
      }
    }
    ensureGathered(unitOfLayer(l));
    if (l > 0) prefetch(unitOfLayer(l - 1));
  }
  void afterBackward(int l) override {
    if (last) reduceScatter(unitOfLayer(l));
    reshard(unitOfLayer(l));
  }
  void afterModelBackward() override {
    if (last && !head_reduced) reduceScatter(headUnit());
    if (last) reduceScatter(embedUnit());
    reshard(headUnit());
    reshard(embedUnit());
  }

  double microBatch(const data::MicroBatch* batch, double grad_scale, bool is_last,
                    model::LayerHooks* h) {
    last = is_last;
    backward_phase = false;
    head_reduced = false;
    ensureGathered(embedUnit());  // read before the first hook and by the tied LM head
    ensureGathered(headUnit());
    double loss = 0.0;
    // A context shard without tokens still runs the pass (its ring steps pass K/V on).
    if (batch != nullptr && (batch->numTokens() > 0 || batch->context)) {
      struct Unhook {
        model::Esm2<P>& m;
        ~Unhook() { m.setHooks(nullptr); }
      } unhook{model};
      model.setHooks(h);
      loss = model.forwardBackward(*batch, grad_scale, false);
    } else {  // no data on this rank: join the collectives in the same order
      for (int l = 0; l < layers; ++l) h->beforeForward(l);
      for (int l = layers - 1; l >= 0; --l) {
        h->beforeBackward(l);
        h->afterBackward(l);
      }
      h->afterModelBackward();
    }
    return loss;
  }

  void finishGradients() {
    for (auto& w : scatter_work) w.wait(dist::streamOf(space));
    if (replicate_comm->size() > 1) {
      fenceForMpi();
      replicate_comm->allReduceSum(grads_shard.data(), grads_shard.extent(0), dist::streamOf(space))
          .wait(dist::streamOf(space));
    }
    space.fence();
  }
};

template <class P>
Fsdp<P>::Fsdp(model::Esm2<P>& model, MPI_Comm shard, MPI_Comm replicate,
              const OptimizerOptions& optimizer, const FsdpOptions& options, dist::Backend backend)
    : impl_member(new Impl(model, shard, replicate, optimizer, options, backend)) {
  impl_member->space.fence();
  if (options.poison) reshardAll(impl_member->space);
}

template <class P> Fsdp<P>::~Fsdp() { delete impl_member; }

template <class P> double Fsdp<P>::microBatch(const ExecSpace& space, const data::MicroBatch* batch,
                                              double grad_scale, bool last,
                                              model::LayerHooks* hooks) {
  impl_member->space = space;
  return impl_member->microBatch(batch, grad_scale, last, hooks ? hooks : impl_member);
}

template <class P> void Fsdp<P>::finishGradients(const ExecSpace& space) {
  impl_member->space = space;
  impl_member->finishGradients();
}

template <class P> StepStats Fsdp<P>::step(const ExecSpace& space,
                                           const std::vector<data::MicroBatch>& local, double lr,
                                           double clip_norm, MPI_Comm comm) {
  Kokkos::Profiling::pushRegion("plm::train::fsdp::step");
  Impl& m = *impl_member;
  m.space = space;
  StepStats st;
  static_cast<BatchStats&>(st) = countBatch(local, comm);
  st.lr = lr;
  // Every rank of a shard group joins every all-gather, so all run the same micro-batch count.
  const auto micro =
      static_cast<std::int64_t>(dist::allreduceMax(static_cast<double>(local.size()), comm));
  const double grad_scale = st.masked > 0 ? 1.0 / static_cast<double>(st.masked) : 0.0;
  m.model.zeroGradients();
  double loss = 0.0;
  for (std::int64_t i = 0; i < micro; ++i) {
    const data::MicroBatch* mb = i < static_cast<std::int64_t>(local.size()) ? &local[i] : nullptr;
    loss += m.microBatch(mb, grad_scale, i + 1 == micro, &m);
  }
  if (micro > 0) m.finishGradients();
  st.loss_sum = dist::allreduceSum(loss, comm);
  if (st.masked == 0) {
    st.applied = false;
    log::warn("train: a global batch had no masked token; the optimizer step is skipped");
    Kokkos::Profiling::popRegion();
    return st;
  }
  m.optimizer->maskGradients(space, m.grads_shard);
  View1<P> g = m.grads_shard;
  double partial = 0.0;
  Kokkos::parallel_reduce(
      "plm::train::fsdp::gradNormPartial", Kokkos::RangePolicy<ExecSpace>(space, 0, g.extent(0)),
      KOKKOS_LAMBDA(const std::int64_t i, double& acc) {
        const double x = static_cast<double>(g(i));
        acc += x * x;
      },
      partial);
  // Replicas hold the same shard after the all-reduce: the shard group alone has every element.
  st.grad_norm = std::sqrt(dist::allreduceSum(partial, m.shard_mpi));
  st.clip_factor = clipFactor(st.grad_norm, clip_norm);
  m.optimizer->step(space, g, lr, st.clip_factor);
  space.fence();
  Kokkos::Profiling::popRegion();
  return st;
}

template <class P> void Fsdp<P>::gatherAll(const ExecSpace& space) {
  impl_member->space = space;
  for (int u = 0; u < static_cast<int>(impl_member->units.size()); ++u)
    impl_member->ensureGathered(u);
  space.fence();
}

template <class P> void Fsdp<P>::reshardAll(const ExecSpace& space) {
  impl_member->space = space;
  if (impl_member->pending_unit >= 0) impl_member->ensureGathered(impl_member->pending_unit);
  for (int u = 0; u < static_cast<int>(impl_member->units.size()); ++u) impl_member->reshard(u);
  space.fence();
}

namespace {

// full[unit range] = all-gather of every rank's slice of `shard`, unit by unit.
template <class T> void gatherUnits(const ExecSpace& space, dist::Communicator& comm,
                                    const std::vector<ShardUnit>& units, View1<T> shard,
                                    View1<T> full) {
  std::int64_t widest = 0;
  for (const auto& u : units) widest = std::max(widest, u.slice * comm.size());
  View1<T> staging(Kokkos::view_alloc(Kokkos::WithoutInitializing, "plm::train::fsdp::export"),
                   widest);
  for (const auto& u : units) {
    space.fence();
    comm.allGather(shard.data() + u.local, staging.data(), u.slice, dist::streamOf(space))
        .wait(dist::streamOf(space));
    Kokkos::deep_copy(space, Kokkos::subview(full, std::make_pair(u.offset, u.offset + u.count)),
                      Kokkos::subview(staging, std::make_pair(std::int64_t(0), u.count)));
  }
  space.fence();
}

template <class T> void takeOwned(const ExecSpace& space, const std::vector<ShardUnit>& units,
                                  int rank, View1<T> full, View1<T> shard) {
  Kokkos::deep_copy(space, shard, T(0));
  forOwnedPieces(units, rank, 0, static_cast<std::int64_t>(full.extent(0)),
                 [&](std::int64_t local, std::int64_t global, std::int64_t n) {
                   Kokkos::deep_copy(space,
                                     Kokkos::subview(shard, std::make_pair(local, local + n)),
                                     Kokkos::subview(full, std::make_pair(global, global + n)));
                 });
  space.fence();
}

}  // namespace

template <class P> void Fsdp<P>::exportFull(const ExecSpace& space, Optimizer<P>& full) {
  Impl& m = *impl_member;
  m.space = space;
  if (m.pending_unit >= 0) m.ensureGathered(m.pending_unit);
  Optimizer<P>& opt = *m.optimizer;
  gatherUnits(space, *m.shard_comm, m.units, opt.master(), full.master());
  exportState(opt, full, m.shard_mpi);
  full.setStepCount(opt.stepCount());
  gatherAll(space);
}

template <class P> void Fsdp<P>::importFull(const ExecSpace& space, const Optimizer<P>& full) {
  Impl& m = *impl_member;
  m.space = space;
  const int r = m.shard_comm->rank();
  Optimizer<P>& opt = *m.optimizer;
  takeOwned(space, m.units, r, full.master(), opt.master());
  importState(full, opt);
  if (!opt.mastersAlias()) opt.syncParameters(space);
  opt.setStepCount(full.stepCount());
  reshardAll(space);
}

template <class P> View1<P> Fsdp<P>::shardParameters() const { return impl_member->params_shard; }
template <class P> View1<P> Fsdp<P>::shardGradients() const { return impl_member->grads_shard; }
template <class P> Optimizer<P>& Fsdp<P>::optimizer() { return *impl_member->optimizer; }
template <class P> const std::vector<ShardUnit>& Fsdp<P>::units() const {
  return impl_member->units;
}
template <class P> int Fsdp<P>::shardSize() const { return impl_member->shard_comm->size(); }
template <class P> int Fsdp<P>::shardRank() const { return impl_member->shard_comm->rank(); }
template <class P> model::LayerHooks& Fsdp<P>::hooks() { return *impl_member; }

template <class P> FsdpMemory Fsdp<P>::plannedMemory() const {
  const Impl& m = *impl_member;
  FsdpMemory mem;
  const auto local = static_cast<std::int64_t>(m.params_shard.extent(0));
  mem.params = local * static_cast<std::int64_t>(sizeof(P));
  mem.grads = mem.params;
  mem.optimizer = m.optimizer->stateBytes();
  mem.gathered = 2 * static_cast<std::int64_t>(m.model.parameters().extent(0) * sizeof(P));
  mem.staging = 4 * static_cast<std::int64_t>(m.gather_buf[0].extent(0) * sizeof(P));
  return mem;
}

template class Fsdp<float>;
template class Fsdp<double>;

}  // namespace plm::train
