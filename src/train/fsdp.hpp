// Sharded data parallelism (ZeRO-3 / FSDP, and HSDP with replicas) of ESM-2 over the
// dist::Communicator: each rank of a shard group owns a contiguous 1/shard slice of every
// sharding unit of the flat FP32 master buffer, of its gradient and of the AdamW state.
//
// Design choices:
//  - Units follow the order backward finalises gradients (train::backwardOrderRanges): the head
//    (final LayerNorm, LM head), one unit per encoder layer, the embeddings.  Each unit is padded
//    to a multiple of the shard size; rank s owns elements [s * slice, (s + 1) * slice) of each
//    padded unit, stored back to back in its shard buffers (FSDP1's flat parameter per unit).
//  - The model's whole buffers are freed: a rank holds its shards, the embeddings and the head
//    gathered for the whole micro-batch (small: V x H and H x H + vectors, and the embedding is
//    read at both ends as the tied LM decoder), and at most two gathered layers (the layer in
//    use and the prefetched next one, a pool of two slots; `reshard_after_forward: false`
//    keeps every layer from its forward to its backward, so the pool grows to L).  Before use
//    a layer's views are re-pointed (Esm2::placeRange) at the slot its all-gather filled.
//  - Gradients: a layer's backward accumulates into one of two layer-size gradient buffers
//    (zeroed first), which is reduce-scattered (FP32) while the next layer's backward fills
//    the other; the received slice is added into the gradient shard.  So every micro-batch
//    reduce-scatters (gradients accumulate in the shard, as FSDP2 does).  With `poison` a
//    resharded layer points at a NaN buffer, so a read before its next all-gather turns the
//    loss into NaN (the poison test).
//  - Collectives come from the layer hooks in one order on every rank: the embeddings and head
//    before each micro-batch, layer l at beforeForward(l) with layer l+1's all-gather
//    prefetched, again before the layer's backward (layer l-1 prefetched) when resharding
//    after forward; each unit's gradient is reduce-scattered as soon as it is final (the head
//    before the first layer's backward, the embeddings last).  Ranks with fewer micro-batches
//    run the same hook sequence without computing.  The replicas then all-reduce the gradient
//    shards in one call.
//  - The optimizer (train/optim/optimizer.hpp: AdamW, Lion, Adafactor, 8-bit AdamW) runs on the
//    shard: its layout is the model's tensor table cut to this rank's slices (shardParamLayout),
//    so decay flags and the frozen <pad> row carry over, and per-tensor state (Adafactor's
//    factors, 8-bit block scales) is reduced over the shard group.  The global
//    gradient norm is one all-reduce of the shards' partial sums of squares.
//  - FP8 (doc/parallelism.md "FP8 under sharding"): a layer unit holding FP8 GEMM weights is
//    all-gathered as a byte wire (E4M3 codes of this rank's master slices, quantised once per
//    change of the masters with amaxes max-reduced over the shard group, and the unit's other
//    elements in fp32), decoded into the slot and the model's FP8 weights: the emulation's
//    quantised copy (portable), or the codes the FP8 GEMMs read, whose transpose is taken after
//    the gather, with the scales written once per encode (CUDA).  The step ends with the
//    model's FP8 amax all-reduce over all ranks.
#pragma once

#include "core/types.hpp"
#include "data/batch.hpp"
#include "dist/communicator.hpp"
#include "model/esm2.hpp"
#include "train/optim/adamw.hpp"
#include "train/optim/optimizer.hpp"
#include "train/step.hpp"

#include <mpi.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

namespace plm::train {

struct FsdpOptions {
  bool reshard_after_forward = true;  // all-gather again before each layer's backward
  bool poison = false;                // fill resharded ranges with NaN (tests, debugging)
  // All-gather bf16 copies of the shards (parallel.gather_dtype: bf16): the layers compute on
  // bf16-rounded parameters (FSDP2's param_dtype), half the bytes of an fp32 gather.
  bool gather_bf16 = false;
};

/// \brief parallel.gather_dtype resolved: true = bf16 all-gathers ("auto": under bf16 compute).
bool gatherInBf16(const std::string& gather_dtype, bool bf16_compute);

/// The sharded layout of a job: shard_degree x replicate_degree = ranks.
struct ParallelLayout {
  int shard = 1;
  int replicate = 1;
};

/// \brief Resolves the deck's parallel.shard_degree and parallel.replicate_degree (0 = default:
/// shard over the `node_ranks` ranks of a node, replicate over the rest) for `world` ranks.
/// Throws a collective plm::Error naming both numbers when they do not multiply to `world`.
ParallelLayout resolveLayout(int shard_degree, int replicate_degree, int world, int node_ranks);

/// One sharding unit: [offset, offset + count) of the model's flat buffer, padded to
/// slice * shard elements; this rank's slice starts at `local` in the shard buffers.
struct ShardUnit {
  std::int64_t offset = 0;
  std::int64_t count = 0;
  std::int64_t slice = 0;
  std::int64_t local = 0;
};

/// \brief The units of a model with `tensors` over a flat buffer of `buffer_size` elements,
/// sharded `shard` ways, in backward order (head, layers L-1..0, embeddings).
std::vector<ShardUnit> planShardUnits(const std::vector<model::TensorInfo>& tensors,
                                      std::int64_t buffer_size, int shard);

/// \brief `tensors` cut to the slices `rank` owns, with offsets into the shard buffer (pieces
/// keep the tensor's name and decay flag; their shape is the flat piece length).
std::vector<model::TensorInfo> shardTensorTable(const std::vector<model::TensorInfo>& tensors,
                                                const std::vector<ShardUnit>& units, int shard,
                                                int rank);

/// \brief The optimizer layout of `rank`'s slices: the whole table, with one piece per tensor
/// slice (its offset in the shard buffer and in the tensor) and the frozen <pad> row's pieces.
ParamLayout shardParamLayout(const std::vector<model::TensorInfo>& tensors,
                             const std::vector<ShardUnit>& units, int rank, int hidden);

/// Bytes one rank holds for a sharded model (planned, per rank).
struct FsdpMemory {
  std::int64_t params = 0;     // master shard
  std::int64_t grads = 0;      // gradient shard
  std::int64_t optimizer = 0;  // optimizer state of the shard (Optimizer::stateBytes)
  std::int64_t gathered = 0;   // gathered embeddings, head and layers, layer gradient buffers
  std::int64_t staging = 0;    // reduce-scatter outputs
  std::int64_t total() const { return params + grads + optimizer + gathered + staging; }
};

/// Element counts of the flat buffer's sharding units (planShardUnits), unpadded.
struct ShardSizes {
  std::int64_t flat = 0;        // the whole buffer
  std::int64_t layer_unit = 0;  // the widest encoder layer
  std::int64_t embed_unit = 0;  // the embeddings
  std::int64_t head_unit = 0;   // final LayerNorm and LM head
  int layers = 0;
};

/// \brief THE memory formula of the model state per rank (`plm plan` and the engine use it):
/// shard 1 is plain data parallelism (whole parameters, gradients and AdamW state);
/// shard > 1 holds 1/shard of them plus the gathered buffers, with `layer_buffers` gathered
/// layers (2, or L without resharding after forward) and a NaN layer buffer with `poison`.
/// `gather_bf16` adds the shard's bf16 copy and a bf16 staging buffer beside each gathered one.
FsdpMemory shardedMemory(const ShardSizes& sizes, int shard, int layer_buffers = 2,
                         bool poison = false, int element_bytes = 4, bool gather_bf16 = false);

template <class P> class Fsdp {
 public:
  /// \brief Collective over `shard` and `replicate`.  A model built with its whole buffers
  /// hands over its current parameters (identical on every rank, e.g. after initialize(seed))
  /// as the initial shards and its whole buffers are freed; a model built without them
  /// (model::ModelBuffers::None, what the trainer does) starts with zero shards, and
  /// initialize(seed) or fillShards then draws or reads only this rank's slices.  From here on
  /// the model's views point into this engine's buffers, so the model must not run without (or
  /// after) the engine.
  Fsdp(model::Esm2<P>& model, MPI_Comm shard, MPI_Comm replicate, const OptimizerOptions& optimizer,
       const FsdpOptions& options = {}, dist::Backend backend = dist::Backend::Mpi);
  ~Fsdp();
  Fsdp(const Fsdp&) = delete;
  Fsdp& operator=(const Fsdp&) = delete;

  /// \brief One optimizer step over this rank's micro-batches (trainStep's contract, with the
  /// world `comm` for the batch counts): gathered forward/backward, reduce-scattered gradients,
  /// clipping by the global norm, the optimizer on the local shard.
  /// A non-finite loss or gradient norm (every rank sees the same) leaves the weights and
  /// moments as they were and returns nonfinite (train/stability.hpp decides what follows).
  /// `before_update` runs between the gradients and the update (the trainer's fault injection).
  StepStats step(const ExecSpace& space, const std::vector<data::MicroBatch>& local, double lr,
                 double clip_norm, MPI_Comm comm, const std::function<void()>& before_update = {});

  /// \brief Collective over the shard group: the forward of `batch` (its loss sum) with the
  /// training forward's gathers, one unit at a time, no gradients; every unit resharded after.
  /// `batch` null: this rank has no data but joins the gathers (evaluate's CollectiveForward).
  double forwardOnly(const ExecSpace& space, const data::MicroBatch* batch);

  /// \brief All-gathers every unit into the model's whole parameter buffer, allocated again for
  /// it (evaluation, the final model file, tests); the next step or reshardAll frees it.  The
  /// fp32 masters, also under gather_bf16.
  void gatherAll(const ExecSpace& space);
  /// \brief Collective over the shard group: all-gathers the fp32 masters unit by unit (one
  /// unit-size device buffer) and copies the parts of the flat ranges `ranges` ([offset,
  /// offset + count) of the model's buffer) into `host` at their flat offsets; nothing else of
  /// `host` is written.  What a rank writes of a model file (its rows), without the whole
  /// model on the device or in host memory (`host` may be an untouched n-element allocation:
  /// only the pages of the ranges become resident).
  void gatherRanges(const ExecSpace& space,
                    const std::vector<std::pair<std::int64_t, std::int64_t>>& ranges, P* host);
  /// \brief Collective over the shard group: the values of the model's flat parameter elements
  /// [offset, offset + count) (the fp32 masters, all-gathered unit by unit), on the host.
  std::vector<P> readParameters(const ExecSpace& space, std::int64_t offset, std::int64_t count);
  /// \brief Sets elements [offset, offset + values.size()) of the model's flat parameters:
  /// each rank writes the pieces it owns into its masters (every rank of the shard group and
  /// its replicas passes the same values), then every derived copy follows.  No communication.
  void writeParameters(const ExecSpace& space, std::int64_t offset, const std::vector<P>& values);
  /// \brief Adds `deltas` (each cast to the master type first, as a whole-model update adds
  /// it) to elements [offset, offset + deltas.size()) of the model's flat parameters, as
  /// writeParameters does: the bias_balance update of a selection bias.  No communication.
  void addToParameters(const ExecSpace& space, std::int64_t offset,
                       const std::vector<double>& deltas);
  /// \brief Reshards every unit and frees the model's whole buffer (with `poison`: the layers'
  /// views point at NaN).
  void reshardAll(const ExecSpace& space);

  /// \brief Writes the whole-model state into `full`, an optimizer of the same kind over the
  /// whole model (every rank gets all of it): parameters into the model's buffers, master, state
  /// and step count into `full` (which checkpoints read).  Collective.
  void exportFull(const ExecSpace& space, Optimizer<P>& full);
  /// \brief Takes this rank's shards from `full` (after a checkpoint restore into it), with its
  /// step count; the inverse of exportFull.  No communication.
  void importFull(const ExecSpace& space, const Optimizer<P>& full);
  /// Writes the values of the model's flat buffer elements [offset, offset + count) to `out`
  /// (count elements in the model's memory space; enqueued on the default execution space).
  using RangeSource = std::function<void(std::int64_t offset, std::int64_t count, P* out)>;
  /// \brief Sets the parameter shards from `values`, asked only for the pieces this rank owns
  /// (one call per piece, unit by unit), then derives every copy as restoredShards does.  The
  /// sharded start-up path: no rank materialises a whole-model buffer, on the host or the
  /// device.  A source that can read any range (a model file, a checkpoint) makes a sharded
  /// load.  Optimizer state is left as it is (zero at start-up).  No communication.
  void fillShards(const ExecSpace& space, const RangeSource& values);
  /// \brief fillShards from model::Esm2::initializeRange: each rank draws its slices of every
  /// tensor from the tensor's own counter-based stream, so the gathered parameters equal
  /// Esm2::initialize(seed) on one rank exactly, for every shard degree.
  void initialize(const ExecSpace& space, std::uint64_t seed);
  /// \brief After the shards' masters and state were written directly (a sharded checkpoint
  /// restore, ckpt/detail/snapshot.hpp): recasts every copy derived from the masters (the
  /// compute shard when it does not alias them) and reshards every unit, so the next use
  /// gathers the restored values.  What importFull does after taking its slices.
  void restoredShards(const ExecSpace& space);

  /// \brief This rank's parameter shard (master type; padding elements are 0).
  View1<P> shardParameters() const;
  View1<P> shardGradients() const;
  Optimizer<P>& optimizer();
  const std::vector<ShardUnit>& units() const;
  int shardSize() const;
  int shardRank() const;
  /// \brief The shard group (this engine's duplicate; for host-side collectives on the
  /// shards, e.g. checkpoints).
  MPI_Comm shardComm() const;
  FsdpMemory plannedMemory() const;
  /// \brief Bytes this rank has sent in the parameter all-gathers of training passes (fp32,
  /// bf16, or under fp8 the units' byte wires: one byte per FP8 weight element), since
  /// construction; evaluation and model-file gathers of the masters are not counted.
  std::int64_t gatherBytes() const;
  /// \brief Bytes this rank sends in one training all-gather of unit `u` (units()).
  std::int64_t unitGatherBytes(int u) const;

  /// \brief The hooks the step installs (exposed so tests can wrap them).
  model::LayerHooks& hooks();
  /// \brief Runs one micro-batch under `hooks` (default: the engine's own); its gradients are
  /// reduce-scattered and added into the gradient shard (zeroed by step()).  nullptr batch:
  /// this rank only joins the collectives.
  double microBatch(const ExecSpace& space, const data::MicroBatch* batch, double grad_scale,
                    model::LayerHooks* hooks = nullptr);
  /// \brief Waits for the reduce-scatters and all-reduces the shards over the replicas.
  void finishGradients(const ExecSpace& space);

  struct Impl;

 private:
  Impl* impl_member;
};

}  // namespace plm::train
