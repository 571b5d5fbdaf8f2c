#include "train/fsdp.hpp"

#include "core/error.hpp"
#include "core/flat.hpp"
#include "core/log.hpp"
#include "core/trace.hpp"
#include "dist/allreduce.hpp"
#include "dist/process_groups.hpp"
#include "dist/stream.hpp"
#include "model/fp8.hpp"
#include "train/gradient_sync.hpp"

#if PLM_FP8_CUDA
#include "gpu/fp8.hpp"
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
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

bool gatherInBf16(const std::string& gather_dtype, bool bf16_compute) {
  if (gather_dtype == "auto") return bf16_compute;
  if (gather_dtype == "bf16") return true;
  if (gather_dtype == "fp32") return false;
  throw Error("parallel.gather_dtype: `" + gather_dtype + "` is not one of auto, fp32, bf16");
}

FsdpMemory shardedMemory(const ShardSizes& n, int shard, int layer_buffers, bool poison,
                         int element_bytes, bool gather_bf16) {
  const std::int64_t s = std::max(1, shard);
  const std::int64_t p = element_bytes;
  auto padded = [s](std::int64_t count) { return (count + s - 1) / s * s; };
  FsdpMemory mem;
  // Whole-model parameters and gradients under data parallelism; this rank's slice of every
  // unit under sharding (units are padded to a multiple of the shard size).
  const std::int64_t local = s == 1 ? n.flat
                                    : n.layers * (padded(n.layer_unit) / s) +
                                          padded(n.embed_unit) / s + padded(n.head_unit) / s;
  mem.params = local * p;
  mem.grads = local * p;
  mem.optimizer = local * (2 * p + 1);  // AdamW m, v and one flag byte (the master is params)
  if (s == 1) return mem;
  // The embeddings and the head gathered (parameters and gradient) for the whole micro-batch;
  // `layer_buffers` gathered layers (two: in use and prefetched), two layer gradients
  // (one computed while the other is reduce-scattered).
  const std::int64_t layer = padded(n.layer_unit);
  mem.gathered = (2 * (padded(n.embed_unit) + padded(n.head_unit)) +
                  (layer_buffers + 2 + (poison ? 1 : 0)) * layer) *
                 p;
  // The reduce-scatter outputs of the four gradient buffers, added into the gradient shard.
  mem.staging = (2 * layer / s + padded(n.embed_unit) / s + padded(n.head_unit) / s) * p;
  if (gather_bf16) {  // the shard's bf16 copy; a bf16 buffer beside each gathered one
    mem.params += 2 * local;
    mem.gathered += 2 * (padded(n.embed_unit) + padded(n.head_unit) + layer_buffers * layer);
  }
  return mem;
}

namespace {
// bf16 as 16 raw bits: round to nearest even, NaN kept quiet.
KOKKOS_INLINE_FUNCTION std::uint16_t bf16Bits(float x) {
  std::uint32_t bits = 0;
  memcpy(&bits, &x, sizeof bits);
  if ((bits & 0x7F800000u) == 0x7F800000u && (bits & 0x007FFFFFu) != 0)
    return static_cast<std::uint16_t>((bits >> 16) | 0x0040u);
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<std::uint16_t>(bits >> 16);
}
KOKKOS_INLINE_FUNCTION float bf16Value(std::uint16_t b) {
  const std::uint32_t bits = static_cast<std::uint32_t>(b) << 16;
  float x = 0;
  memcpy(&x, &bits, sizeof x);
  return x;
}
}  // namespace

template <class P> struct Fsdp<P>::Impl : model::LayerHooks {
  // One reduce-scatter source: its full-unit send buffer, the slice it receives, and the
  // unit whose result is in flight (added into the gradient shard when it completes).
  struct Channel {
    View1<P> send;  // (padded unit)
    View1<P> recv;  // (slice)
    dist::Work work;
    int unit = -1;
  };

  model::Esm2<P>& model;
  FsdpOptions options;
  MPI_Comm shard_mpi = MPI_COMM_NULL;  // duplicates, for the scalar norm reduction
  std::unique_ptr<dist::Communicator> shard_comm, replicate_comm;
  int layers = 0;
  std::vector<ShardUnit> units;   // backward order: head, layers L-1..0, embeddings
  View1<P> params_shard;          // (sum of slices) master shard
  View1<P> grads_shard;           // (sum of slices)
  View1<P> outer_params[2];       // (padded head unit), (padded embedding unit): gathered
  std::vector<View1<P>> slots;    // (padded widest layer) gathered layers, a pool
  std::vector<int> free_slots;    // indices into slots
  std::vector<int> slot_of;       // per unit: its slot while gathered, else -1
  Channel channel[4];             // [0], [1] layer gradients (alternating), [2] head, [3] emb.
  int layer_channel = 0;          // the next layer's gradient buffer
  std::vector<int> grad_channel;  // per unit: the channel whose send buffer holds its gradient
  // bf16 policy: the compute copy of each gathered unit beside its masters (the model casts
  // it after the all-gather): the outer units' own, one per layer slot, one beside poison_buf.
  bool bf16 = false;
  View1<std::uint16_t> outer_compute[2];
  std::vector<View1<std::uint16_t>> compute_slots;
  View1<std::uint16_t> poison_compute;
  // options.gather_bf16: the shard's bf16 copy (recast after every change of the masters) is
  // what the all-gathers move, into a bf16 buffer beside each gathered fp32 buffer, which is
  // then widened into it (exact): half the bytes of an fp32 gather.
  View1<std::uint16_t> shard_bf16;
  View1<std::uint16_t> outer_stage[2];
  std::vector<View1<std::uint16_t>> stage_slots;
  View1<P> poison_buf;  // (padded widest layer) NaN, where resharded layers point
  // fp8 (portable path): a unit holding FP8 GEMM weights travels as a byte "wire": each FP8
  // weight element as its E4M3 code, every other element as its P value (aligned), rank by
  // rank, each rank's part padded to the widest (wire_slice bytes).  castShardToFp8 quantises
  // this rank's master slices once per step with the scales one rank would use (amaxes
  // reduced over the shard group); landGather decodes a gathered wire into the slot and the
  // model's FP8 weight copy.  Segments: runs of one kind in the kernels' iteration space.
  struct WireSeg {
    std::int64_t elem = 0;   // first element in the iteration space
    std::int64_t at = 0;     // encode: shard offset; decode: offset in the gathered unit
    std::int64_t byte = 0;   // first byte in the wire buffer
    std::int64_t widx = -1;  // FP8: row-major index of the first element in its weight
    int w = -1;              // FP8: the weight (index into fp8_w); -1: P values
  };
  using SegView = Kokkos::View<WireSeg*, MemSpace>;
  std::vector<typename model::Esm2<P>::Fp8WeightCopy> fp8_w;
  std::vector<std::int64_t> wire_slice, wire_local;  // per unit (bytes; 0: a plain gather)
  View1<std::uint8_t> shard_wire;                    // (sum of wire slices) this rank's codes
  std::vector<View1<std::uint8_t>> wire_stage;       // beside each layer slot
  SegView enc_segs;                                  // this rank's slices of the wire units
  std::int64_t enc_elems = 0;
  std::vector<SegView> dec_segs;            // per unit: the whole gathered unit
  std::vector<std::int64_t> block_at;       // block: each weight's first block slot
  View1<std::int64_t> w_cols, w_block_at;   // (weights)
  View1<std::uintptr_t> w_copy;             // (weights) the model's FP8 copies
  View1<std::uint32_t> amax_bits;           // (amax slots) max |x| as fp32 bits
  View1<float> wire_scale, wire_scale_inv;  // (amax slots)
  // CUDA path: the codes land in the model's FP8 code buffers (fp8_w[w].codes, w_code), the
  // transposed codes are derived per gathered unit (unit_weights), the scales are written
  // once per encode.  fp8_stale: the masters changed since the wire was encoded.
  bool cuda_codes = false;
  View1<std::uintptr_t> w_code;                // (weights) fp8_w[w].codes
  View1<std::uintptr_t> w_scale_inv;           // (weights) fp8_w[w].scale_inv
  std::vector<std::vector<int>> unit_weights;  // per unit: the FP8 weights it holds
  bool fp8_stale = true;
  std::int64_t gather_bytes = 0;  // sent by this rank (training gathers)
  std::vector<char> gathered;
  int pending_unit = -1;  // unit whose prefetched all-gather is in flight
  dist::Work pending_work;
  bool whole = false;  // gatherAll(): the model's whole buffers hold every unit
  // Expert parallelism (the shard group holds one expert-group position): this rank's pieces of
  // the routed experts' runs, (shard offset, count).  Their gradients are complete after the
  // shard group's reduce-scatter; the replicas hold other experts, so the replicate all-reduce
  // leaves them as they are (it sums dense_pieces only) and the norm sums them over every rank.
  std::vector<std::pair<std::int64_t, std::int64_t>> expert_pieces;
  // The rest of the gradient shard, (shard offset, count): what the replicate all-reduce sums
  // under expert parallelism (the expert pieces in between are left as they are).
  std::vector<std::pair<std::int64_t, std::int64_t>> dense_pieces;
  std::unique_ptr<Optimizer<P>> optimizer;
  ExecSpace space;
  bool backward_phase = false;
  bool head_reduced = false;

  Impl(model::Esm2<P>& m, MPI_Comm shard, MPI_Comm replicate, const OptimizerOptions& opt,
       const FsdpOptions& opts, dist::Backend backend)
      : model(m), options(opts), layers(m.config().num_layers) {
    // fp8: the FP8 weights are all-gathered as codes (planFp8Wire); the CUDA path is the bf16
    // policy otherwise (the rest of a gathered unit gets its bf16 copy).
    const bool fp8 = m.config().precision == model::Precision::Fp8;
    if (fp8 && !PLM_FP8_CUDA && opts.gather_bf16)
      throw collectiveError(
          "parallel.gather_dtype: bf16 with train.precision: fp8 on the portable path: the FP8 "
          "GEMM weights are all-gathered as their E4M3 codes and the rest of each unit in fp32; "
          "set parallel.gather_dtype: auto or fp32");
    bf16 = m.config().precision == model::Precision::Bf16 || (fp8 && PLM_FP8_CUDA);
    PLM_CHECK_MPI(MPI_Comm_dup(shard, &shard_mpi));
    shard_comm = dist::makeCommunicator(shard, backend);
    // The replicas of a shard may share a GPU where the shard's ranks do not (NCCL refuses
    // that): device-memory backends are chosen per group, host memory stays on MPI.
    replicate_comm = dist::makeCommunicator(
        replicate, backend == dist::Backend::Mpi ? backend : dist::defaultBackend(replicate));
    if (!shard_comm->deviceMemory() &&
        !Kokkos::SpaceAccessibility<Kokkos::HostSpace, MemSpace>::accessible)
      throw Error(
          "parallel: sharding device memory needs a device-memory backend, NCCL (one GPU per "
          "rank) or staged MPI (ranks sharing a GPU); this job would hand device pointers to "
          "plain MPI: unset PLM_COMM_BACKEND or set it to auto, nccl or mpi-staged");
    const int s = shard_comm->size();
    const std::int64_t n = m.bufferElements();
    units = planShardUnits(m.tensors(), n, s);
    std::int64_t total = 0, widest = 0;
    for (const auto& u : units) total += u.slice;
    for (int l = 0; l < layers; ++l) widest = std::max(widest, units[unitOfLayer(l)].slice * s);
    auto alloc = [](const char* label, std::int64_t count) {
      return View1<P>(Kokkos::view_alloc(Kokkos::WithoutInitializing, std::string(label)), count);
    };
    // The gathered buffers first: the model's views move there and its whole gradient buffer
    // goes before the shards are allocated, so a rank never holds whole parameters, whole
    // gradients and its shards at once (15B: 60 GB + 60 GB + 64 GB would not fit an H200).
    const int outer[2] = {headUnit(), embedUnit()};
    for (int k = 0; k < 2; ++k) {
      const std::int64_t padded = units[outer[k]].slice * s;
      outer_params[k] = alloc("plm::train::fsdp::outer_params", padded);
      channel[2 + k].send = View1<P>("plm::train::fsdp::outer_grads", padded);
      channel[2 + k].recv = alloc("plm::train::fsdp::outer_recv", units[outer[k]].slice);
    }
    for (int b = 0; b < 2; ++b) {
      channel[b].send = View1<P>("plm::train::fsdp::layer_grads", widest);
      channel[b].recv = alloc("plm::train::fsdp::layer_recv", widest / s);
      slots.push_back(alloc("plm::train::fsdp::gathered_layer", widest));
    }
    free_slots = {1, 0};
    if (options.poison) {
      poison_buf = alloc("plm::train::fsdp::poison", widest);
      Kokkos::deep_copy(space, poison_buf, std::numeric_limits<P>::quiet_NaN());
    }
    if (bf16) {
      std::int64_t widest_compute = 0;
      for (int l = 0; l < layers; ++l)
        widest_compute = std::max(widest_compute, computeOf(unitOfLayer(l)));
      for (int k = 0; k < 2; ++k)
        outer_compute[k] =
            View1<std::uint16_t>("plm::train::fsdp::outer_compute", computeOf(outer[k]));
      for (int b = 0; b < 2; ++b)
        compute_slots.push_back(
            View1<std::uint16_t>("plm::train::fsdp::gathered_compute", widest_compute));
      if (options.poison) {
        poison_compute = View1<std::uint16_t>("plm::train::fsdp::poison_compute", widest_compute);
        Kokkos::deep_copy(space, poison_compute, kBf16NaN);
      }
    }
    gathered.assign(units.size(), 0);
    slot_of.assign(units.size(), -1);
    grad_channel.assign(units.size(), 0);
    grad_channel[headUnit()] = 2;
    grad_channel[embedUnit()] = 3;
    const int r = shard_comm->rank();
    if (m.expertPlacement().sharded()) {
      for (const auto& [offset, count] : model::expertRuns(m.tensors()))
        for (const auto& u : units) {
          const std::int64_t mine = u.offset + r * u.slice;
          const std::int64_t a = std::max({offset, mine, u.offset});
          const std::int64_t b = std::min({offset + count, mine + u.slice, u.offset + u.count});
          if (a >= b) continue;
          expert_pieces.push_back({u.local + (a - mine), b - a});
        }
      auto sorted = expert_pieces;
      std::sort(sorted.begin(), sorted.end());
      std::int64_t at = 0;
      for (const auto& [offset, count] : sorted) {
        if (offset > at) dense_pieces.push_back({at, offset - at});
        at = std::max(at, offset + count);
      }
      if (total > at) dense_pieces.push_back({at, total - at});
    }
    // A model built without whole buffers (ModelBuffers::None) has nothing to copy: its views
    // move from reserved addresses to the gathered buffers, and initialize/fillShards draw the
    // shards.  A whole model hands over its parameters and frees its buffers.
    View1<P> full = m.parameters();  // the initial parameters, identical on every rank
    for (int u = 0; u < static_cast<int>(units.size()); ++u) park(u);
    if (full.extent(0) > 0) model.holdWholeBuffers(true, false);
    params_shard = flatZeros<P>("plm::train::fsdp::params_shard", total);
    grads_shard = flatZeros<P>("plm::train::fsdp::grads_shard", total);
    if (full.extent(0) > 0) {
      forOwnedPieces(units, r, 0, n, [&](std::int64_t local, std::int64_t global, std::int64_t c) {
        Kokkos::deep_copy(space, Kokkos::subview(params_shard, std::make_pair(local, local + c)),
                          Kokkos::subview(full, std::make_pair(global, global + c)));
      });
      space.fence();
      model.holdWholeBuffers(false, false);
      full = View1<P>();  // the whole buffer is freed here
    }
    optimizer = makeOptimizer<P>(opt, params_shard,
                                 shardParamLayout(m.tensors(), units, r, m.config().hidden));
    optimizer->setShardGroup(shard_mpi);
    if (options.gather_bf16) {
      shard_bf16 = flatZeros<std::uint16_t>("plm::train::fsdp::shard_bf16", total);
      for (int k = 0; k < 2; ++k)
        outer_stage[k] =
            View1<std::uint16_t>("plm::train::fsdp::outer_stage", outer_params[k].extent(0));
      for (const auto& slot : slots)
        stage_slots.push_back(
            View1<std::uint16_t>("plm::train::fsdp::gather_stage", slot.extent(0)));
      castShardToBf16();
    }
    planFp8Wire();
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
  bool isOuter(int u) const { return u == headUnit() || u == embedUnit(); }
  View1<P>& outerParams(int u) { return outer_params[u == headUnit() ? 0 : 1]; }

  void fenceForMpi() {
    if (!shard_comm->deviceMemory()) space.fence();
  }

  static constexpr std::uint16_t kBf16NaN = 0x7FC0;

  std::int64_t computeOf(int u) const {
    return model.computeElements(units[u].offset, units[u].count);
  }

  // bf16: the compute buffer that goes with the masters at `params` (nullptr: home).
  std::uint16_t* computeBeside(const P* params) {
    if (!bf16 || params == nullptr) return nullptr;
    for (int k = 0; k < 2; ++k)
      if (params == outer_params[k].data()) return outer_compute[k].data();
    if (params == poison_buf.data()) return poison_compute.data();
    for (std::size_t i = 0; i < slots.size(); ++i)
      if (params == slots[i].data()) return compute_slots[i].data();
    throw Error("plm::train::fsdp: no compute buffer beside a gathered unit (a bug)");
  }

  void place(int u, P* params) {
    const ShardUnit& su = units[u];
    model.placeRange(su.offset, su.count, params, channel[grad_channel[u]].send.data(),
                     computeBeside(params));
  }

  // Where a unit's all-gather lands: the embeddings' and head's own buffers, or a free slot of
  // the layer pool (a new one only when both are taken: reshard_after_forward false).
  P* home(int u) {
    if (isOuter(u)) return outerParams(u).data();
    if (free_slots.empty()) {
      free_slots.push_back(static_cast<int>(slots.size()));
      slots.push_back(View1<P>(
          Kokkos::view_alloc(Kokkos::WithoutInitializing, "plm::train::fsdp::gathered_layer"),
          slots.front().extent(0)));
      if (bf16)
        compute_slots.push_back(View1<std::uint16_t>("plm::train::fsdp::gathered_compute",
                                                     compute_slots.front().extent(0)));
      if (options.gather_bf16)
        stage_slots.push_back(
            View1<std::uint16_t>("plm::train::fsdp::gather_stage", slots.front().extent(0)));
      if (!wire_stage.empty())
        wire_stage.push_back(View1<std::uint8_t>(
            Kokkos::view_alloc(Kokkos::WithoutInitializing, "plm::train::fsdp::wire_stage"),
            wire_stage.front().extent(0)));
    }
    slot_of[u] = free_slots.back();
    free_slots.pop_back();
    return slots[slot_of[u]].data();
  }

  // The bf16 buffer the gather into fp32 buffer `to` lands in first (gather_bf16).
  View1<std::uint16_t> stageBeside(const P* to) {
    for (int k = 0; k < 2; ++k)
      if (to == outer_params[k].data()) return outer_stage[k];
    for (std::size_t i = 0; i < slots.size(); ++i)
      if (to == slots[i].data()) return stage_slots[i];
    throw Error("plm::train::fsdp: no bf16 staging buffer beside a gather (a bug)");
  }

  // `masters`: the fp32 masters even under gather_bf16 (gatherAll: evaluation, model files).
  dist::Work launchGather(int u, P* to, bool masters = false) {
    const ShardUnit& su = units[u];
    fenceForMpi();
    if (!masters && wire_slice[u] > 0) {
      gather_bytes += wire_slice[u];
      return shard_comm->allGather(shard_wire.data() + wire_local[u], wireBeside(to).data(),
                                   wire_slice[u], dist::streamOf(space));
    }
    if (!masters)
      gather_bytes += su.slice * static_cast<std::int64_t>(options.gather_bf16 ? 2 : sizeof(P));
    if (options.gather_bf16 && !masters)
      return shard_comm->allGather(shard_bf16.data() + su.local, stageBeside(to).data(), su.slice,
                                   dist::streamOf(space));
    return shard_comm->allGather(params_shard.data() + su.local, to, su.slice,
                                 dist::streamOf(space));
  }

  // After unit u's gather into `to` completed: gather_bf16 widens the bf16 values into it.
  void landGather(int u, P* to) {
    if (wire_slice[u] > 0) return decodeWire(u, to);
    if (!options.gather_bf16) return;
    const std::int64_t n = units[u].slice * shard_comm->size();
    const View1<std::uint16_t> from = stageBeside(to);
    P* dst = to;
    plm::flatFor(
        "plm::train::fsdp::widen_bf16", space, 0, n,
        KOKKOS_LAMBDA(const std::int64_t i) { dst[i] = static_cast<P>(bf16Value(from(i))); });
  }

  // The masters changed (an update, a restore): gather_bf16's copy is recast now, the FP8
  // wire before its next use.
  void mastersChanged() {
    fp8_stale = true;
    castShardToBf16();
  }

  // gather_bf16: the shard's bf16 copy, round to nearest even (NaN stays NaN).
  void castShardToBf16() {
    if (!options.gather_bf16) return;
    const View1<P> from = params_shard;
    const View1<std::uint16_t> to = shard_bf16;
    plm::flatFor(
        "plm::train::fsdp::shard_to_bf16", space, 0, static_cast<std::int64_t>(from.extent(0)),
        KOKKOS_LAMBDA(const std::int64_t i) { to(i) = bf16Bits(static_cast<float>(from(i))); });
  }

  // The wire staging buffer beside layer slot `to`.
  View1<std::uint8_t> wireBeside(const P* to) {
    for (std::size_t i = 0; i < slots.size(); ++i)
      if (to == slots[i].data()) return wire_stage[i];
    throw Error("plm::train::fsdp: FP8 codes of a unit outside the layer slots (a bug)");
  }

  static constexpr std::int64_t kWeightBlock = 128;  // doc/fp8.md: 128x128 weight blocks
  // The weight amax pass (castShardToFp8): lanes of a warp, elements per thread.
  static constexpr std::int64_t kLanes = 32, kAmaxRun = 64;

  bool blockScaling() const {
    return model.fp8Scaling()->config().recipe == model::Fp8Recipe::Block;
  }

  // The wire layout of every unit that holds FP8 weights (see the members): the same on every
  // rank, from the tensor table and the shard plan alone.
  void planFp8Wire() {
    wire_slice.assign(units.size(), 0);
    wire_local.assign(units.size(), 0);
    unit_weights.assign(units.size(), {});
    fp8_w = model.fp8Weights();
    if (fp8_w.empty()) return;
    cuda_codes = fp8_w.front().codes != nullptr;
    const bool block = blockScaling();
    std::int64_t slots_n = 0;
    std::vector<std::int64_t> cols;
    for (const auto& w : fp8_w) {
      block_at.push_back(slots_n);
      cols.push_back(w.cols);
      slots_n += block ? ((w.rows + kWeightBlock - 1) / kWeightBlock) *
                             ((w.cols + kWeightBlock - 1) / kWeightBlock)
                       : 1;
    }
    struct Run {
      std::int64_t start, len, widx;
      int w;
    };
    std::vector<Run> runs;
    for (std::size_t w = 0; w < fp8_w.size(); ++w) {
      const auto& fw = fp8_w[w];
      const std::int64_t part = fw.rows / static_cast<std::int64_t>(fw.from.size()) * fw.cols;
      for (std::size_t p = 0; p < fw.from.size(); ++p)
        runs.push_back({fw.from[p], part, static_cast<std::int64_t>(p) * part, int(w)});
    }
    std::sort(runs.begin(), runs.end(),
              [](const Run& a, const Run& b) { return a.start < b.start; });
    const int s = shard_comm->size(), me = shard_comm->rank();
    const std::int64_t align = sizeof(P);
    // One rank's slice of unit u as segments (at: offset in the unit; byte: from the rank's
    // part of the wire); returns its bytes.
    auto cut = [&](int u, int r, std::vector<WireSeg>& out) {
      const ShardUnit& su = units[u];
      std::int64_t pos = r * su.slice, byte = 0;
      const std::int64_t end = pos + su.slice;
      while (pos < end) {
        const std::int64_t g = su.offset + pos;
        auto it = std::upper_bound(runs.begin(), runs.end(), g,
                                   [](std::int64_t x, const Run& q) { return x < q.start; });
        WireSeg seg;
        seg.at = pos;
        std::int64_t stop = end;
        if (it != runs.begin() && pos < su.count && g < std::prev(it)->start + std::prev(it)->len) {
          const Run& q = *std::prev(it);
          seg.w = q.w;
          seg.widx = q.widx + (g - q.start);
          stop = std::min(end, q.start + q.len - su.offset);
          seg.byte = byte;
          byte += stop - pos;
        } else {
          if (it != runs.end()) stop = std::min(end, it->start - su.offset);
          byte = (byte + align - 1) / align * align;
          seg.byte = byte;
          byte += (stop - pos) * align;
        }
        out.push_back(seg);
        pos = stop;
      }
      return byte;
    };
    std::vector<WireSeg> enc;
    dec_segs.assign(units.size(), SegView());
    std::int64_t wire_total = 0;
    for (int u = 0; u < static_cast<int>(units.size()); ++u) {
      std::vector<std::vector<WireSeg>> per(s);
      std::int64_t widest_bytes = 0;
      bool any = false;
      for (int r = 0; r < s; ++r) {
        widest_bytes = std::max(widest_bytes, cut(u, r, per[r]));
        for (const auto& g : per[r]) any = any || g.w >= 0;
      }
      if (!any) continue;
      PLM_REQUIRE(!isOuter(u), "plm::train::fsdp: FP8 weights in the embeddings or head (a bug)");
      wire_slice[u] = (widest_bytes + 7) / 8 * 8;
      wire_local[u] = wire_total;
      wire_total += wire_slice[u];
      std::vector<WireSeg> dec;
      for (int r = 0; r < s; ++r)
        for (std::size_t k = 0; k < per[r].size(); ++k) {
          WireSeg g = per[r][k];
          auto& held = unit_weights[u];
          if (g.w >= 0 && std::find(held.begin(), held.end(), g.w) == held.end())
            held.push_back(g.w);
          if (r == me) {  // this rank's slice: encoded from the shard
            const std::int64_t next =
                k + 1 < per[r].size() ? per[r][k + 1].at : (r + 1) * units[u].slice;
            WireSeg e = g;
            e.elem = enc_elems;
            e.at = units[u].local + (g.at - r * units[u].slice);
            e.byte = wire_local[u] + g.byte;
            enc_elems += next - g.at;
            enc.push_back(e);
          }
          g.elem = g.at;
          g.byte += r * wire_slice[u];
          dec.push_back(g);
        }
      dec_segs[u] = toDevice(dec, "plm::train::fsdp::wire_decode");
    }
    enc_segs = toDevice(enc, "plm::train::fsdp::wire_encode");
    shard_wire = flatZeros<std::uint8_t>("plm::train::fsdp::shard_wire", wire_total);
    std::int64_t widest_wire = 0;
    for (auto b : wire_slice) widest_wire = std::max(widest_wire, b * s);
    for (std::size_t i = 0; i < slots.size(); ++i)
      wire_stage.push_back(View1<std::uint8_t>("plm::train::fsdp::wire_stage", widest_wire));
    std::vector<std::uintptr_t> copies, codes, scale_invs;
    for (const auto& w : fp8_w) {
      copies.push_back(reinterpret_cast<std::uintptr_t>(w.copy));
      codes.push_back(reinterpret_cast<std::uintptr_t>(w.codes));
      scale_invs.push_back(reinterpret_cast<std::uintptr_t>(w.scale_inv));
    }
    w_copy = toDevice(copies, "plm::train::fsdp::fp8_copies");
    w_code = toDevice(codes, "plm::train::fsdp::fp8_codes");
    w_scale_inv = toDevice(scale_invs, "plm::train::fsdp::fp8_scale_invs");
    w_cols = toDevice(cols, "plm::train::fsdp::fp8_cols");
    w_block_at = toDevice(block_at, "plm::train::fsdp::fp8_block_at");
    amax_bits = View1<std::uint32_t>("plm::train::fsdp::fp8_amax", slots_n);
    wire_scale = View1<float>("plm::train::fsdp::fp8_scale", slots_n);
    wire_scale_inv = View1<float>("plm::train::fsdp::fp8_scale_inv", slots_n);
  }

  template <class V>
  static Kokkos::View<V*, MemSpace> toDevice(const std::vector<V>& host, const char* label) {
    Kokkos::View<V*, MemSpace> d(std::string(label), host.size());
    auto h = Kokkos::create_mirror_view(d);
    for (std::size_t i = 0; i < host.size(); ++i) h(i) = host[i];
    Kokkos::deep_copy(d, h);
    return d;
  }

  // The segment of `segs` holding iteration element e (segments sorted by elem, the first at 0).
  KOKKOS_INLINE_FUNCTION static std::int64_t segmentOf(const SegView& segs, std::int64_t e) {
    std::int64_t lo = 0, hi = static_cast<std::int64_t>(segs.extent(0)) - 1;
    while (lo < hi) {
      const std::int64_t mid = (lo + hi + 1) / 2;
      if (segs(mid).elem <= e)
        lo = mid;
      else
        hi = mid - 1;
    }
    return lo;
  }

  // Element widx of a weight with `cols` columns: its amax slot (the weight, or its 128x128
  // block under block scaling).
  KOKKOS_INLINE_FUNCTION static std::int64_t amaxSlot(bool block, int w, std::int64_t widx,
                                                      std::int64_t cols, std::int64_t block_at) {
    if (!block) return w;
    const std::int64_t nbc = (cols + kWeightBlock - 1) / kWeightBlock;
    return block_at + (widx / cols / kWeightBlock) * nbc + (widx % cols) / kWeightBlock;
  }

  // Once per change of the masters (the first pass after it), collective over the shard group:
  // this rank's FP8 weight slices quantised into shard_wire with the scales one unsharded rank
  // would use: the weight amaxes (per tensor, or per 128x128 block) are max-reduced over the
  // shard group first; delayed scaling records them for the step (Fp8Scaling::record, as
  // Esm2's own refresh does).  The CUDA path quantises what its unsharded casts read, the bf16
  // copy of the masters (`rounded`), and writes the scale_inv its GEMMs read.
  void castShardToFp8() {
    fp8_stale = false;
    if (fp8_w.empty()) return;
    model::Fp8Scaling& st = *model.fp8Scaling();
    const bool block = blockScaling();
    const bool rounded = cuda_codes;
    const model::fp8::Format format = st.format(model::Fp8Operand::Weight);
    const SegView segs = enc_segs;
    const View1<P> shard = params_shard;
    const View1<std::uint32_t> amax = amax_bits;
    const View1<std::int64_t> cols = w_cols, bat = w_block_at;
    Kokkos::deep_copy(space, amax, 0u);
    // A weight's elements are contiguous here, so one atomic per element would send every
    // thread in flight to the same amax slot and serialise the pass on one address.  Each
    // thread keeps a running maximum over kAmaxRun elements and adds it once per slot it met. Lanes
    // of a warp read consecutive elements: thread t reads element (t / kLanes) * kLanes * kAmaxRun
    // + j * kLanes + t % kLanes, j < kAmaxRun.
    const std::int64_t groups = (enc_elems + kLanes * kAmaxRun - 1) / (kLanes * kAmaxRun);
    const std::int64_t total = enc_elems;
    const auto nseg = static_cast<std::int64_t>(segs.extent(0));
    Kokkos::parallel_for(
        "plm::train::fsdp::fp8_weight_amax", FlatPolicy(space, 0, groups * kLanes),
        KOKKOS_LAMBDA(const std::int64_t t) {
          std::int64_t e = (t / kLanes) * kLanes * kAmaxRun + t % kLanes;
          if (e >= total) return;
          std::int64_t sg = segmentOf(segs, e);
          std::int64_t slot = -1;
          std::uint32_t run = 0;
          for (std::int64_t j = 0; j < kAmaxRun && e < total; ++j, e += kLanes) {
            while (sg + 1 < nseg && segs(sg + 1).elem <= e) ++sg;
            const WireSeg g = segs(sg);
            if (g.w < 0) continue;
            const std::int64_t i = e - g.elem;
            // |x| by its bits; NaN and infinity count as +inf (fp8Amax, fp8QuantizeBlocks).
            float x = static_cast<float>(shard(g.at + i));
            if (rounded) x = bf16Value(bf16Bits(x));
            std::uint32_t a = model::fp8::detail::bitsOf(x) & 0x7FFFFFFFu;
            if (a > 0x7F800000u) a = 0x7F800000u;
            const std::int64_t k = amaxSlot(block, g.w, g.widx + i, cols(g.w), bat(g.w));
            if (k != slot) {
              if (slot >= 0) Kokkos::atomic_fetch_max(&amax(slot), run);
              slot = k;
              run = 0;
            }
            run = a > run ? a : run;
          }
          if (slot >= 0) Kokkos::atomic_fetch_max(&amax(slot), run);
        });
    std::vector<std::uint32_t> host(amax.extent(0));
    Kokkos::deep_copy(
        space, Kokkos::View<std::uint32_t*, Kokkos::HostSpace>(host.data(), host.size()), amax);
    space.fence();
    // Non-negative floats order as their bit patterns.
    PLM_CHECK_MPI(MPI_Allreduce(MPI_IN_PLACE, host.data(), static_cast<int>(host.size()),
                                MPI_UINT32_T, MPI_MAX, shard_mpi));
    std::vector<float> scale(host.size()), scale_inv(host.size());
    const float fmax = model::fp8::maxOf(format);
    for (std::size_t k = 0; k < host.size(); ++k) {
      const float a = model::fp8::detail::floatOf(host[k]);
      float sc = 1.0f, si = 1.0f;
      if (block) {  // fp8QuantizeBlocks' power-of-two scale
        if (host[k] < 0x7F800000u && a > 0.0f) {
          const std::uint32_t qe = model::fp8::detail::bitsOf(fmax / a) & 0x7F800000u;
          sc = qe >= 0x7F800000u ? model::fp8::detail::pow2(127) : model::fp8::detail::floatOf(qe);
        }
        si = 1.0f / sc;
      } else if (st.config().recipe == model::Fp8Recipe::Current) {
        sc = model::currentScale(a, fmax);
        si = 1.0f / sc;
      } else {  // delayed: this step's scale; the amax goes into the history
        const int t = fp8_w[k].operand;
        st.record(t, a);
        sc = st.scale(t);
        si = st.scaleInv(t);  // 1 / scale, as the CUDA cast writes it
      }
      scale[k] = sc;
      scale_inv[k] = si;
    }
    Kokkos::deep_copy(space, wire_scale,
                      Kokkos::View<const float*, Kokkos::HostSpace>(scale.data(), scale.size()));
    Kokkos::deep_copy(
        space, wire_scale_inv,
        Kokkos::View<const float*, Kokkos::HostSpace>(scale_inv.data(), scale_inv.size()));
    const View1<std::uint8_t> wire = shard_wire;
    const View1<float> sv = wire_scale;
    Kokkos::parallel_for(
        "plm::train::fsdp::fp8_weight_encode", Kokkos::RangePolicy<ExecSpace>(space, 0, enc_elems),
        KOKKOS_LAMBDA(const std::int64_t e) {
          const WireSeg g = segs(segmentOf(segs, e));
          const std::int64_t i = e - g.elem;
          float x = static_cast<float>(shard(g.at + i));
          if (g.w < 0) {
            reinterpret_cast<P*>(wire.data() + g.byte)[i] = shard(g.at + i);
            return;
          }
          if (rounded) x = bf16Value(bf16Bits(x));
          const float sc = sv(amaxSlot(block, g.w, g.widx + i, cols(g.w), bat(g.w)));
          wire(g.byte + i) = model::fp8::encode(format, x * sc);
        });
    if (cuda_codes) writeCudaScales(block);
    space.fence();  // `scale` and `scale_inv` are host vectors going out of scope
  }

  // CUDA: this encode's scale_inv where the GEMMs read it: the per-tensor scalar of each
  // weight, or both copies' 128x128 block scales in gpu::blockScaleLayout (padding 1), which
  // follow the codes in the model's code buffers.  They hold until the next encode.
  void writeCudaScales(bool block) {
#if PLM_FP8_CUDA
    const View1<float> si = wire_scale_inv;
    if (!block) {
      const View1<std::uintptr_t> to = w_scale_inv;
      Kokkos::parallel_for(
          "plm::train::fsdp::fp8_tensor_scales",
          FlatPolicy(space, 0, static_cast<std::int64_t>(fp8_w.size())),
          KOKKOS_LAMBDA(const std::int64_t w) { *reinterpret_cast<float*>(to(w)) = si(w); });
      return;
    }
    for (std::size_t w = 0; w < fp8_w.size(); ++w) {
      const auto& fw = fp8_w[w];
      const std::int64_t nbr = (fw.rows + kWeightBlock - 1) / kWeightBlock;
      const std::int64_t nbc = (fw.cols + kWeightBlock - 1) / kWeightBlock;
      const std::int64_t at = block_at[w];
      for (const bool t : {false, true}) {
        // W (rows, cols): blocks (nbr, nbc); W^T: (nbc, nbr), the same values transposed.
        const std::int64_t out_r = t ? nbc : nbr, out_c = t ? nbr : nbc;
        const auto layout = gpu::blockScaleLayout(gpu::Fp8ScaleMode::Block128x128,
                                                  t ? fw.cols : fw.rows, t ? fw.rows : fw.cols);
        float* to = gpu::fp8BlockTensorScales(t ? fw.codes_t : fw.codes, t ? fw.cols : fw.rows,
                                              t ? fw.rows : fw.cols);
        const std::int64_t ld = layout.ld;
        Kokkos::parallel_for(
            "plm::train::fsdp::fp8_block_scales", FlatPolicy(space, 0, layout.count),
            KOKKOS_LAMBDA(const std::int64_t i) {
              const std::int64_t r = i / ld, c = i % ld;
              to[i] = r < out_r && c < out_c ? si(at + (t ? c * nbc + r : r * nbc + c)) : 1.0f;
            });
      }
    }
#else
    (void)block;
#endif
  }

  // A gathered wire into the unit's slot `to` and the model's FP8 copies: codes decoded with
  // this step's scales (model::fp8::quantize's decode(code) * scale_inv), P values as they are.
  void decodeWire(int u, P* to) {
    const SegView segs = dec_segs[u];
    const View1<std::uint8_t> wire = wireBeside(to);
    const View1<std::int64_t> cols = w_cols, bat = w_block_at;
    const View1<std::uintptr_t> copies = w_copy, codes = w_code;
    const View1<float> si = wire_scale_inv;
    const bool block = blockScaling(), to_codes = cuda_codes;
    const model::fp8::Format format = model.fp8Scaling()->format(model::Fp8Operand::Weight);
    Kokkos::parallel_for(
        "plm::train::fsdp::fp8_weight_decode",
        Kokkos::RangePolicy<ExecSpace>(space, 0, units[u].slice * shard_comm->size()),
        KOKKOS_LAMBDA(const std::int64_t e) {
          const WireSeg g = segs(segmentOf(segs, e));
          const std::int64_t i = e - g.elem;
          if (g.w < 0) {
            to[g.at + i] = reinterpret_cast<const P*>(wire.data() + g.byte)[i];
            return;
          }
          const std::int64_t widx = g.widx + i;
          const std::uint8_t code = wire(g.byte + i);
          const float v = model::fp8::decode(format, code) *
                          si(amaxSlot(block, g.w, widx, cols(g.w), bat(g.w)));
          to[g.at + i] = static_cast<P>(v);
          if (to_codes)
            reinterpret_cast<std::uint8_t*>(codes(g.w))[widx] = code;
          else
            reinterpret_cast<P*>(copies(g.w))[widx] = static_cast<P>(v);
        });
#if PLM_FP8_CUDA
    // The dgrad GEMM's W^T codes: the gathered codes transposed (an element's code depends on
    // its value and its tensor's or 128x128 block's scale only, so W^T's cast is this).
    if (to_codes)
      for (const int w : unit_weights[u])
        gpu::transposeFp8Codes(space.cuda_stream(), fp8_w[w].codes, fp8_w[w].rows, fp8_w[w].cols,
                               fp8_w[w].codes_t);
#endif
  }

  void ensureGathered(int u) {
    PLM_TRACE("plm::comm fsdp gather");
    if (gathered[u]) return;
    P* to = nullptr;
    if (pending_unit == u) {
      pending_work.wait(dist::streamOf(space));
      pending_unit = -1;
      to = isOuter(u) ? outerParams(u).data() : slots[slot_of[u]].data();
    } else {
      to = home(u);
      launchGather(u, to).wait(dist::streamOf(space));
    }
    landGather(u, to);
    place(u, to);
    // bf16: the compute copy beside it; CUDA fp8: a wire unit's codes came with it.
    model.refreshComputeRange(units[u].offset, units[u].count, wire_slice[u] == 0);
    gathered[u] = 1;
  }

  void prefetch(int u) {
    if (gathered[u] || pending_unit == u) return;
    if (pending_unit >= 0) ensureGathered(pending_unit);  // one prefetch in flight at a time
    pending_work = launchGather(u, home(u));
    pending_unit = u;
  }

  // The layer's slot returns to the pool; with `poison` its views move to the NaN buffer (the
  // embeddings and head buffers are filled with NaN), so a read before the next all-gather
  // shows up as a NaN loss.
  void reshard(int u) {
    if (!gathered[u]) return;
    gathered[u] = 0;
    if (!isOuter(u)) {
      free_slots.push_back(slot_of[u]);
      slot_of[u] = -1;
    }
    if (!options.poison) return;
    if (isOuter(u)) {
      Kokkos::deep_copy(space, outerParams(u), std::numeric_limits<P>::quiet_NaN());
      if (bf16) Kokkos::deep_copy(space, outer_compute[u == headUnit() ? 0 : 1], kBf16NaN);
    } else {
      place(u, poison_buf.data());
    }
  }

  // Waits for channel c's reduce-scatter and adds the received slice into the gradient shard.
  void drain(int c) {
    Channel& ch = channel[c];
    if (ch.unit < 0) return;
    ch.work.wait(dist::streamOf(space));
    const ShardUnit& su = units[ch.unit];
    ch.unit = -1;
    View1<P> shard = Kokkos::subview(grads_shard, std::make_pair(su.local, su.local + su.slice));
    View1<P> recv = ch.recv;
    plm::flatFor(
        "plm::train::fsdp::accumulate_shard", space, 0, su.slice,
        KOKKOS_LAMBDA(const std::int64_t i) { shard(i) += recv(i); });
  }

  // The unit's gradient buffer, zeroed, with the model's gradient views pointing into it.
  void armGradients(int u, int c) {
    drain(c);
    grad_channel[u] = c;
    Kokkos::deep_copy(space, channel[c].send, P(0));
  }

  void reduceScatter(int u) {
    PLM_TRACE("plm::comm fsdp reduce-scatter");
    const int c = grad_channel[u];
    Channel& ch = channel[c];
    fenceForMpi();
    ch.work = shard_comm->reduceScatterSum(ch.send.data(), ch.recv.data(), units[u].slice,
                                           dist::streamOf(space));
    ch.unit = u;
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
      reduceScatter(headUnit());  // the head's backward ran before the first layer's
      head_reduced = true;
    }
    const int u = unitOfLayer(l);
    armGradients(u, layer_channel);
    layer_channel = 1 - layer_channel;
    ensureGathered(u);
    place(u, slots[slot_of[u]].data());  // the gradient views into the armed buffer
    if (l > 0) prefetch(unitOfLayer(l - 1));
  }
  void afterBackward(int l) override {
    reduceScatter(unitOfLayer(l));
    reshard(unitOfLayer(l));
  }
  void afterModelBackward() override {
    if (!head_reduced) reduceScatter(headUnit());
    reduceScatter(embedUnit());
    reshard(headUnit());
    reshard(embedUnit());
  }

  double microBatch(const data::MicroBatch* batch, double grad_scale, model::LayerHooks* h) {
    if (whole) reshardAll();
    backward_phase = false;
    head_reduced = false;
    for (int u : {headUnit(), embedUnit()}) armGradients(u, grad_channel[u]);
    ensureGathered(embedUnit());  // read before the first hook and by the tied LM head
    ensureGathered(headUnit());
    double loss = 0.0;
    // A context shard without tokens still runs the pass (its ring steps pass K/V on).
    // Under expert parallelism an empty micro-batch still runs the pass: it serves its experts.
    if (batch != nullptr && (batch->numTokens() > 0 || batch->context || model.expertParallel())) {
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

  // Evaluation: the training forward's gathers (one unit at a time), no gradients; every unit
  // resharded after it.  `batch` null: no data here, join the gathers anyway.
  double forwardOnly(const data::MicroBatch* batch) {
    if (whole) reshardAll();
    if (fp8_stale && !fp8_w.empty()) {  // the updated masters' codes, with the next step's scales
      model.beginFp8Step();
      castShardToFp8();
    }
    backward_phase = false;
    ensureGathered(embedUnit());
    ensureGathered(headUnit());
    double loss = 0.0;
    const data::MicroBatch none;
    if (batch == nullptr && model.expertParallel()) batch = &none;  // serves its experts
    if (batch != nullptr && (batch->numTokens() > 0 || batch->context || model.expertParallel())) {
      struct Unhook {
        model::Esm2<P>& m;
        ~Unhook() { m.setHooks(nullptr); }
      } unhook{model};
      model.setHooks(this);
      loss = model.forward(*batch, nullptr, false);
    } else {
      for (int l = 0; l < layers; ++l) beforeForward(l);
    }
    reshardAll();
    return loss;
  }

  void finishGradients() {
    for (int c = 0; c < 4; ++c) drain(c);
    if (replicate_comm->size() > 1) {
      // The replicas hold other experts: under expert parallelism only the dense pieces of
      // the shard are summed over them, each in place (no copy of the expert pieces).
      fenceForMpi();
      if (expert_pieces.empty()) {
        replicate_comm
            ->allReduceSum(grads_shard.data(), grads_shard.extent(0), dist::streamOf(space))
            .wait(dist::streamOf(space));
      } else {
        for (const auto& [offset, count] : dense_pieces)
          replicate_comm->allReduceSum(grads_shard.data() + offset, count, dist::streamOf(space))
              .wait(dist::streamOf(space));
      }
    }
    space.fence();
  }

  // Every unit all-gathered into the model's whole parameter buffer (allocated again), which
  // its views then read; gradients stay in the engine's buffers.
  void gatherAll() {
    if (whole) return;
    reshardAll();
    model.holdWholeBuffers(true, false);
    View1<P> full = model.parameters();
    for (int u = 0; u < static_cast<int>(units.size()); ++u) {
      const ShardUnit& su = units[u];
      View1<P> staging = isOuter(u) ? outerParams(u) : slots.front();
      launchGather(u, staging.data(), true).wait(dist::streamOf(space));
      Kokkos::deep_copy(space,
                        Kokkos::subview(full, std::make_pair(su.offset, su.offset + su.count)),
                        Kokkos::subview(staging, std::make_pair(std::int64_t(0), su.count)));
      place(u, nullptr);
    }
    whole = true;
    space.fence();
  }

  // Where a unit's views wait between uses: the embeddings and head in their own buffers, a
  // layer in the first slot (or, with `poison`, at the NaN buffer); gradients in its channel.
  void park(int u) {
    place(u, isOuter(u)       ? outerParams(u).data()
             : options.poison ? poison_buf.data()
                              : slots.front().data());
    if (isOuter(u) && options.poison) {
      Kokkos::deep_copy(space, outerParams(u), std::numeric_limits<P>::quiet_NaN());
      if (bf16) Kokkos::deep_copy(space, outer_compute[u == headUnit() ? 0 : 1], kBf16NaN);
    }
  }

  // Every unit resharded; after gatherAll the views leave the whole buffer, which is freed.
  void reshardAll() {
    if (pending_unit >= 0) ensureGathered(pending_unit);
    for (int u = 0; u < static_cast<int>(units.size()); ++u) reshard(u);
    if (whole) {
      for (int u = 0; u < static_cast<int>(units.size()); ++u) park(u);
      model.holdWholeBuffers(false, false);
      whole = false;
    }
    space.fence();
  }
};

template <class P>
Fsdp<P>::Fsdp(model::Esm2<P>& model, MPI_Comm shard, MPI_Comm replicate,
              const OptimizerOptions& optimizer, const FsdpOptions& options, dist::Backend backend)
    : impl_member(new Impl(model, shard, replicate, optimizer, options, backend)) {}

template <class P> Fsdp<P>::~Fsdp() { delete impl_member; }

template <class P> double Fsdp<P>::microBatch(const ExecSpace& space, const data::MicroBatch* batch,
                                              double grad_scale, model::LayerHooks* hooks) {
  impl_member->space = space;
  return impl_member->microBatch(batch, grad_scale, hooks ? hooks : impl_member);
}

template <class P>
double Fsdp<P>::forwardOnly(const ExecSpace& space, const data::MicroBatch* batch) {
  impl_member->space = space;
  return impl_member->forwardOnly(batch);
}

template <class P> void Fsdp<P>::finishGradients(const ExecSpace& space) {
  impl_member->space = space;
  impl_member->finishGradients();
}

template <class P> StepStats Fsdp<P>::step(const ExecSpace& space,
                                           const std::vector<data::MicroBatch>& local, double lr,
                                           double clip_norm, MPI_Comm comm,
                                           const std::function<void()>& before_update) {
  Kokkos::Profiling::pushRegion("plm::train::fsdp::step");
  Impl& m = *impl_member;
  m.space = space;
  StepStats st;
  static_cast<BatchStats&>(st) = countBatch(local, comm);
  st.lr = lr;
  // Every rank of a shard group joins every all-gather, so all run the same micro-batch count;
  // under expert parallelism the missing ones are empty micro-batches first, which serve the
  // experts (padForExperts, as the data-parallel path does).
  const std::vector<data::MicroBatch> padded =
      m.model.expertParallel() ? padForExperts(local, comm) : std::vector<data::MicroBatch>{};
  const std::vector<data::MicroBatch>& run = m.model.expertParallel() ? padded : local;
  const auto micro =
      static_cast<std::int64_t>(dist::allreduceMax(static_cast<double>(run.size()), comm));
  const double grad_scale = st.masked > 0 ? 1.0 / static_cast<double>(st.masked) : 0.0;
  flatFill(space, m.grads_shard, P(0));
  m.model.beginFp8Step();  // fp8 on CUDA: the step's scales to the device
  m.castShardToFp8();      // fp8: this step's weight codes of the shard, gathered by the layers
  double loss = 0.0;
  for (std::int64_t i = 0; i < micro; ++i) {
    const data::MicroBatch* mb = i < static_cast<std::int64_t>(run.size()) ? &run[i] : nullptr;
    loss += m.microBatch(mb, grad_scale, &m);
  }
  if (micro > 0) m.finishGradients();
  if (m.model.fp8Scaling()) m.model.endFp8Step(comm);  // the step's amaxes, new delayed scales
  st.loss_sum = dist::allreduceSum(loss, comm);
  if (st.masked == 0) {
    st.applied = false;
    log::warn("train: a global batch had no masked token; the optimizer step is skipped");
    Kokkos::Profiling::popRegion();
    return st;
  }
  if (before_update) before_update();
  m.optimizer->maskGradients(space, m.grads_shard);
  View1<P> g = m.grads_shard;
  double partial = 0.0;
  plm::flatReduce(
      "plm::train::fsdp::gradNormPartial", space, 0, g.extent(0),
      KOKKOS_LAMBDA(const std::int64_t i, double& acc) {
        const double x = static_cast<double>(g(i));
        acc += x * x;
      },
      partial);
  // Replicas hold the same shard after the all-reduce: the shard group alone has every element.
  // Routed experts differ between replicas (each holds its expert-group position's): their
  // pieces are summed over every rank instead, so each expert counts once.  That sum is
  // collective whatever this rank's slices hold: with small experts a rank's slice of every
  // layer may hold none of them (moe.expert_ffn 16 at hidden 32, test_train_composition).
  double experts = 0.0;
  for (const auto& [offset, count] : m.expert_pieces) {
    double piece = 0.0;
    plm::flatReduce(
        "plm::train::fsdp::expertNormPartial", space, offset, offset + count,
        KOKKOS_LAMBDA(const std::int64_t i, double& acc) {
          const double x = static_cast<double>(g(i));
          acc += x * x;
        },
        piece);
    experts += piece;
  }
  st.grad_norm =
      std::sqrt(dist::allreduceSum(partial - experts, m.shard_mpi) +
                (m.model.expertPlacement().sharded() ? dist::allreduceSum(experts, comm) : 0.0));
  if (!std::isfinite(st.grad_norm) || !std::isfinite(st.loss_sum)) {
    st.applied = false;  // the norm and the loss are all-reduced: every rank gets here
    st.nonfinite = true;
    Kokkos::Profiling::popRegion();
    return st;
  }
  st.clip_factor = clipFactor(st.grad_norm, clip_norm);
  m.optimizer->step(space, g, lr, st.clip_factor);
  m.mastersChanged();
  space.fence();
  Kokkos::Profiling::popRegion();
  return st;
}

template <class P> void Fsdp<P>::gatherAll(const ExecSpace& space) {
  impl_member->space = space;
  impl_member->gatherAll();
}

template <class P>
void Fsdp<P>::gatherRanges(const ExecSpace& space,
                           const std::vector<std::pair<std::int64_t, std::int64_t>>& ranges,
                           P* host) {
  Impl& m = *impl_member;
  m.space = space;
  m.reshardAll();
  for (int u = 0; u < static_cast<int>(m.units.size()); ++u) {
    const ShardUnit& su = m.units[u];
    const View1<P> staging = m.isOuter(u) ? m.outerParams(u) : m.slots.front();
    m.launchGather(u, staging.data(), true).wait(dist::streamOf(space));
    for (const auto& [offset, count] : ranges) {
      const std::int64_t a = std::max(offset, su.offset);
      const std::int64_t b = std::min(offset + count, su.offset + su.count);
      if (a >= b) continue;
      Kokkos::deep_copy(space, HostView1<P>(host + a, b - a),
                        Kokkos::subview(staging, std::make_pair(a - su.offset, b - su.offset)));
    }
    space.fence();  // the staging buffer is reused by the next unit
  }
  m.reshardAll();  // the outer units' buffers held masters, not their gathered state
}

template <class P> std::vector<P> Fsdp<P>::readParameters(const ExecSpace& space,
                                                          std::int64_t offset, std::int64_t count) {
  Impl& m = *impl_member;
  m.space = space;
  m.reshardAll();
  std::vector<P> out(static_cast<std::size_t>(count));
  for (int u = 0; u < static_cast<int>(m.units.size()); ++u) {
    const ShardUnit& su = m.units[u];
    const std::int64_t a = std::max(offset, su.offset);
    const std::int64_t b = std::min(offset + count, su.offset + su.count);
    if (a >= b) continue;  // the same units on every rank: the range is the same
    const View1<P> staging = m.isOuter(u) ? m.outerParams(u) : m.slots.front();
    m.launchGather(u, staging.data(), true).wait(dist::streamOf(space));
    Kokkos::deep_copy(space, HostView1<P>(out.data() + (a - offset), b - a),
                      Kokkos::subview(staging, std::make_pair(a - su.offset, b - su.offset)));
    space.fence();
  }
  m.reshardAll();  // the outer units' buffers held masters, not their gathered state
  return out;
}

namespace {
// f(master element, j) over this rank's pieces of [offset, offset + n): i in the shard, j in
// the range (the separate parameters follow); on the host, for a few elements at a time (router
// rows, selection biases).
template <class P, class F>
void editOwned(const ExecSpace& space, const std::vector<ShardUnit>& units, int rank,
               Optimizer<P>& opt, std::int64_t offset, std::int64_t n, F&& f) {
  const View1<master_t> master = opt.master();
  forOwnedPieces(units, rank, offset, n,
                 [&](std::int64_t local, std::int64_t global, std::int64_t c) {
                   const auto range = std::make_pair(local, local + c);
                   auto hm = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(),
                                                                 Kokkos::subview(master, range));
                   for (std::int64_t k = 0; k < c; ++k) f(hm(k), global - offset + k);
                   Kokkos::deep_copy(space, Kokkos::subview(master, range), hm);
                   space.fence();
                 });
  if (!opt.mastersAlias()) opt.syncParameters(space);
}
}  // namespace

template <class P> void Fsdp<P>::writeParameters(const ExecSpace& space, std::int64_t offset,
                                                 const std::vector<P>& values) {
  Impl& m = *impl_member;
  m.space = space;
  m.reshardAll();
  editOwned(space, m.units, m.shard_comm->rank(), *m.optimizer, offset,
            static_cast<std::int64_t>(values.size()),
            [&](master_t& x, std::int64_t j) { x = static_cast<master_t>(values[j]); });
  m.mastersChanged();
  space.fence();
}

template <class P> void Fsdp<P>::addToParameters(const ExecSpace& space, std::int64_t offset,
                                                 const std::vector<double>& deltas) {
  Impl& m = *impl_member;
  m.space = space;
  m.reshardAll();
  editOwned(space, m.units, m.shard_comm->rank(), *m.optimizer, offset,
            static_cast<std::int64_t>(deltas.size()),
            [&](master_t& x, std::int64_t j) { x += static_cast<master_t>(deltas[j]); });
  m.mastersChanged();
  space.fence();
}

template <class P> void Fsdp<P>::reshardAll(const ExecSpace& space) {
  impl_member->space = space;
  impl_member->reshardAll();
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
  flatFill(space, shard, T(0));
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
  m.reshardAll();
  Optimizer<P>& opt = *m.optimizer;
  gatherUnits(space, *m.shard_comm, m.units, opt.master(), full.master());
  exportState(opt, full, m.shard_mpi);
  full.setStepCount(opt.stepCount());
}

template <class P> void Fsdp<P>::importFull(const ExecSpace& space, const Optimizer<P>& full) {
  Impl& m = *impl_member;
  m.space = space;
  const int r = m.shard_comm->rank();
  Optimizer<P>& opt = *m.optimizer;
  takeOwned(space, m.units, r, full.master(), opt.master());
  importState(full, opt);
  if (!opt.mastersAlias()) opt.syncParameters(space);
  m.mastersChanged();
  opt.setStepCount(full.stepCount());
  reshardAll(space);
}

template <class P> void Fsdp<P>::fillShards(const ExecSpace& space, const RangeSource& values) {
  Impl& m = *impl_member;
  m.space = space;
  m.reshardAll();
  const View1<P> shard = m.params_shard;
  flatFill(space, shard, P(0));  // the units' padding
  space.fence();                 // the source may enqueue on another instance
  forOwnedPieces(m.units, m.shard_comm->rank(), 0, m.model.bufferElements(),
                 [&](std::int64_t local, std::int64_t global, std::int64_t n) {
                   values(global, n, shard.data() + local);
                 });
  Kokkos::fence();
  if (!m.optimizer->mastersAlias()) {  // a separate fp32 master (Fsdp<double>) from the values
    const View1<master_t> master = m.optimizer->master();
    plm::flatFor(
        "plm::train::fsdp::master_from_shard", space, 0, static_cast<std::int64_t>(shard.extent(0)),
        KOKKOS_LAMBDA(const std::int64_t i) { master(i) = static_cast<master_t>(shard(i)); });
  }
  space.fence();
  restoredShards(space);
}

template <class P> void Fsdp<P>::initialize(const ExecSpace& space, std::uint64_t seed) {
  const model::Esm2<P>& model = impl_member->model;
  fillShards(space, [&](std::int64_t offset, std::int64_t count, P* out) {
    model.initializeRange(seed, offset, count, out);
  });
}

template <class P> void Fsdp<P>::restoredShards(const ExecSpace& space) {
  Impl& m = *impl_member;
  m.space = space;
  Optimizer<P>& opt = *m.optimizer;
  // Every copy importFull refreshes after its slices are taken must be refreshed here too.
  if (!opt.mastersAlias()) opt.syncParameters(space);
  m.mastersChanged();  // gather_bf16: the bf16 copy of the restored shard; the FP8 wire
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
template <class P> MPI_Comm Fsdp<P>::shardComm() const { return impl_member->shard_mpi; }
template <class P> model::LayerHooks& Fsdp<P>::hooks() { return *impl_member; }
template <class P> std::int64_t Fsdp<P>::gatherBytes() const { return impl_member->gather_bytes; }
template <class P> std::int64_t Fsdp<P>::unitGatherBytes(int u) const {
  const Impl& m = *impl_member;
  if (m.wire_slice[u] > 0) return m.wire_slice[u];
  return m.units[u].slice * static_cast<std::int64_t>(m.options.gather_bf16 ? 2 : sizeof(P));
}

template <class P> FsdpMemory Fsdp<P>::plannedMemory() const {
  const Impl& m = *impl_member;
  ShardSizes n;
  n.layers = m.layers;
  n.flat = 0;
  for (const auto& u : m.units) n.flat += u.count;
  for (int l = 0; l < m.layers; ++l)
    n.layer_unit = std::max(n.layer_unit, m.units[m.unitOfLayer(l)].count);
  n.head_unit = m.units[m.headUnit()].count;
  n.embed_unit = m.units[m.embedUnit()].count;
  const int buffers = m.options.reshard_after_forward ? 2 : m.layers;
  FsdpMemory mem = shardedMemory(n, m.shard_comm->size(), buffers, m.options.poison,
                                 static_cast<int>(sizeof(P)), m.options.gather_bf16);
  mem.optimizer = m.optimizer->stateBytes();  // the configured optimizer's state of the shard
  // fp8: the shard's byte wire beside its masters, a gathered wire beside each layer slot.
  mem.params += static_cast<std::int64_t>(m.shard_wire.extent(0));
  if (!m.wire_stage.empty())
    mem.gathered += buffers * static_cast<std::int64_t>(m.wire_stage.front().extent(0));
  if (m.bf16) {  // the compute copies beside the gathered units (2 bytes each)
    std::int64_t c = m.outer_compute[0].extent(0) + m.outer_compute[1].extent(0) +
                     buffers * static_cast<std::int64_t>(m.compute_slots.front().extent(0)) +
                     static_cast<std::int64_t>(m.poison_compute.extent(0));
    mem.gathered += 2 * c;
  }
  return mem;
}

template class Fsdp<float>;
template class Fsdp<double>;

}  // namespace plm::train
