// The one optimizer interface the trainer, FSDP and checkpoints call: AdamW, Lion, Adafactor and
// 8-bit AdamW (doc/optimizers.md) each update the fp32 masters of one rank's slice of the flat
// parameter buffer.
//
// Design choices:
//  - What is common lives here, once: the fp32 master (an alias of the parameters when the model
//    computes in master_t), the per-element decay / frozen flags built from the tensor table,
//    the step count, and the frozen-gradient mask.  A kind adds its state and its update().
//  - A rank's buffer is described by a ParamLayout: the whole model's tensor table plus the
//    pieces of it this rank holds (one piece per tensor unsharded; FSDP's slices sharded).  State
//    that is defined per whole tensor (Adafactor's row and column factors, 8-bit block scales) is
//    indexed by global tensor coordinates, so every rank computes it the same way and the result
//    does not depend on the shard count.  The partial sums and maxima a slice contributes are
//    all-reduced over the shard group (setShardGroup): small host arrays, one or two MPI calls a
//    step (at most rows + columns + tensors doubles, or one float per 2048-element block).
//  - State is a list of named buffers (StateBuffer), each either laid out by pieces (elementwise:
//    one value per parameter of a subset of tensors, sharded like the parameters) or replicated
//    (per whole tensor, identical on every rank of a shard group).  Checkpoints write every
//    buffer by name at its full per-tensor shape; exportState/importState move a sharded
//    optimizer's state to and from the full layout, so a checkpoint resumes at any rank count.
#pragma once

#include "core/types.hpp"
#include "model/esm2.hpp"

#include <mpi.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace plm::train {

/// Elements [offset, offset + size) of the flat buffer that never change.
struct FrozenRange {
  std::int64_t offset = 0;
  std::int64_t size = 0;
};

/// \brief The frozen ranges of an ESM-2 model: the word embedding's `<pad>` row; with LoRA
/// adapters in the table, every tensor but the adapters.
std::vector<FrozenRange> esm2FrozenRanges(const std::vector<model::TensorInfo>& tensors,
                                          int hidden);

enum class OptimizerKind { AdamW, Lion, Adafactor, AdamW8bit };

/// \brief "adamw", "lion", "adafactor", "adamw8bit" (the deck's optimizer.name).
const char* optimizerName(OptimizerKind kind);
/// \brief The kind named `name`; a collective plm::Error listing the names otherwise.
OptimizerKind parseOptimizerKind(const std::string& name);

struct AdamWOptions {  // Loshchilov & Hutter 2019; betas and eps as ESM-2 trained
  double beta1 = 0.9;
  double beta2 = 0.98;
  double eps = 1e-8;
  double weight_decay = 0.01;
};

struct LionOptions {  // Chen et al. 2023 (symbolic discovery of optimization algorithms)
  double beta1 = 0.9;
  double beta2 = 0.99;
  double weight_decay = 0.01;
};

struct AdafactorOptions {       // Shazeer & Stern 2018, as transformers.Adafactor with a given lr
  double beta1 = 0.0;           // first moment (EMA of the update); 0 = none (the paper's default)
  double decay_rate = -0.8;     // beta2_t = 1 - t^decay_rate
  double eps1 = 1e-30;          // added to g^2
  double eps2 = 1e-3;           // floor of the parameter scale RMS(p)
  double clip_threshold = 1.0;  // update clipping: U / max(1, RMS(U) / d)
  bool scale_parameter = true;  // step = lr * max(eps2, RMS(p)) per tensor
  double weight_decay = 0.01;
};

struct AdamW8bitOptions {  // Dettmers et al. 2022 (bitsandbytes' blockwise 8-bit Adam)
  double beta1 = 0.9;
  double beta2 = 0.98;
  double eps = 1e-8;
  double weight_decay = 0.01;
  std::int64_t block_size = 2048;     // elements per quantisation block (per tensor)
  std::int64_t min_8bit_size = 4096;  // smaller tensors keep fp32 state (bitsandbytes' default)
  // The tensor whose state stays fp32 (bitsandbytes' StableEmbedding keeps 32-bit state).
  std::string fp32_tensor = "esm.embeddings.word_embeddings.weight";
};

struct OptimizerOptions {
  OptimizerOptions() = default;
  /// AdamW with `adamw` (what callers from before the other kinds pass).
  OptimizerOptions(const AdamWOptions& a) : adamw(a) {}  // NOLINT: implicit on purpose
  OptimizerKind kind = OptimizerKind::AdamW;
  AdamWOptions adamw;
  LionOptions lion;
  AdafactorOptions adafactor;
  AdamW8bitOptions adamw8bit;
};

/// Elements [local, local + count) of a rank's buffer are elements [start, start + count) (in
/// row-major order) of whole tensor `tensor`.
struct TensorPiece {
  int tensor = 0;
  std::int64_t local = 0;
  std::int64_t start = 0;
  std::int64_t count = 0;
};

/// What a rank's slice of the flat parameter buffer holds.
struct ParamLayout {
  std::vector<model::TensorInfo> tensors;  // the whole model's table (global shapes, offsets)
  std::vector<TensorPiece> pieces;         // at most one per tensor, by increasing local offset
  std::int64_t local_size = 0;             // elements of this rank's buffer (padding included)
  std::vector<FrozenRange> frozen;         // local offsets
};

/// \brief The unsharded layout: every tensor whole at its own offset.
ParamLayout wholeLayout(const std::vector<model::TensorInfo>& tensors, std::int64_t buffer_size,
                        const std::vector<FrozenRange>& frozen = {});

/// One named piece of optimizer state.
struct StateBuffer {
  enum class Layout {
    Pieces,     // elementwise over a subset of tensors; this rank holds `pieces` of them
    Replicated  // per whole tensor; identical on every rank of a shard group
  };
  std::string name;  // checkpoint group /optimizer/<name>
  Layout layout = Layout::Pieces;
  View1<master_t> f32;  // exactly one of f32 and u8 is allocated
  View1<std::uint8_t> u8;
  // The full layout, as checkpoints store it: one entry per whole tensor (name, full shape,
  // offset into the full buffer; Replicated buffers give their own shapes).
  std::vector<model::TensorInfo> table;
  std::int64_t full_size = 0;
  // Pieces: where this rank's elements live (`local` into this buffer, `tensor` indexes `table`).
  std::vector<TensorPiece> pieces;

  bool isBytes() const { return u8.data() != nullptr; }
  std::int64_t bytes() const {
    return isBytes() ? std::int64_t(u8.extent(0)) : std::int64_t(f32.extent(0) * sizeof(master_t));
  }
};

template <class P> class Optimizer {
 public:
  /// `params`: this rank's flat parameter buffer (compute precision P), laid out as `layout`.
  Optimizer(View1<P> params, ParamLayout layout);
  virtual ~Optimizer();
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;

  virtual OptimizerKind kind() const = 0;
  /// \brief The named state buffers (views: writing them changes the optimizer).
  virtual std::vector<StateBuffer> state() const = 0;
  /// \brief Hyper-parameters as checkpoint attributes.
  virtual std::map<std::string, double> attributes() const = 0;

  /// \brief All-reduces the per-tensor partial sums of sharded state over `shard` (a
  /// communicator the optimizer duplicates; MPI_COMM_NULL or one rank: unsharded).
  void setShardGroup(MPI_Comm shard);

  /// \brief Zeroes the gradient of frozen elements (call before the norm).
  void maskGradients(const ExecSpace& space, View1<P> grads) const;

  /// \brief One update with learning rate `lr`, using `grad_scale * grads` as the gradient
  /// (grad_scale carries the clipping factor).  Increments stepCount() first (bias corrections
  /// and Adafactor's beta2_t use the new count), then writes the compute parameters.
  void step(const ExecSpace& space, View1<P> grads, double lr, double grad_scale = 1.0);

  /// \brief Writes the compute parameters as a cast of the master (no-op when they alias).
  void syncParameters(const ExecSpace& space);

  View1<master_t> master() const { return master_member; }
  std::int64_t stepCount() const { return step_member; }
  void setStepCount(std::int64_t step) { step_member = step; }
  bool mastersAlias() const { return aliased_member; }
  const ParamLayout& layout() const { return layout_member; }
  /// \brief The fp32 state buffer `name`; a plm::Error naming the kind if it has none.
  View1<master_t> stateF32(const std::string& name) const;
  /// AdamW-era names (AdamW, 8-bit AdamW's fp32 part): exp_avg and exp_avg_sq.
  View1<master_t> expAvg() const { return stateF32("exp_avg"); }
  View1<master_t> expAvgSq() const { return stateF32("exp_avg_sq"); }

  /// \brief Bytes of optimizer state this rank holds, measured from the allocations: every
  /// state buffer, the flags and the separate master copy (when it does not alias).
  std::int64_t stateBytes() const;

  static constexpr std::uint8_t decay_flag = 1;
  static constexpr std::uint8_t frozen_flag = 2;
  View1<std::uint8_t> flags() const { return flags_member; }

  /// \brief The kind's update of the masters (step() calls it after counting the step).
  /// Public only because CUDA extended lambdas may not live in non-public member functions.
  virtual void update(const ExecSpace& space, View1<P> grads, double lr, double grad_scale) = 0;

 protected:
  /// In-place sums / maxima over the shard group (no-ops unsharded).
  void shardSum(std::vector<double>& values) const;
  void shardMax(std::vector<float>& values) const;

  View1<P> params_member;            // (N) compute parameters (the model's buffer or its shard)
  View1<master_t> master_member;     // (N) fp32 master weights (alias of params when P == master_t)
  View1<std::uint8_t> flags_member;  // (N) decay_flag | frozen_flag
  ParamLayout layout_member;
  std::int64_t step_member = 0;
  bool aliased_member = false;
  MPI_Comm shard_member = MPI_COMM_NULL;
};

/// \brief The optimizer `options.kind` over `params` laid out as `layout`.
template <class P> std::unique_ptr<Optimizer<P>> makeOptimizer(const OptimizerOptions& options,
                                                               View1<P> params, ParamLayout layout);

/// \brief Collective over `shard`: writes `from`'s (this rank's) state into `to`, an optimizer
/// of the same kind over the whole model (full layout), on every rank of the shard group.  The
/// masters and step count are not touched (FSDP moves the masters itself).
template <class P> void exportState(const Optimizer<P>& from, Optimizer<P>& to, MPI_Comm shard);
/// \brief The inverse: takes this rank's pieces of `from`'s full-layout state.  No communication.
template <class P> void importState(const Optimizer<P>& from, Optimizer<P>& to);

/// \brief Optimizer state bytes per parameter for `options` over `tensors` (unsharded, master
/// aliased, flags included): what `plm plan` counts.  Computed from the same layout rules the
/// optimizers allocate with; tests compare it to stateBytes().
double optimizerBytesPerParameter(const OptimizerOptions& options,
                                  const std::vector<model::TensorInfo>& tensors);
/// \brief The same as a total for a buffer of `buffer_size` elements, per rank when sharded
/// `shard` ways: elementwise state divides, per-tensor state (Adafactor's factors, 8-bit block
/// scales and maps) is replicated on every rank of the shard group.
std::int64_t optimizerStateBytes(const OptimizerOptions& options,
                                 const std::vector<model::TensorInfo>& tensors,
                                 std::int64_t buffer_size, int shard = 1);

}  // namespace plm::train
