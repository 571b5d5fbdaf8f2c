// ESM-2 (Hugging Face `EsmForMaskedLM`, doc/anchors.md §1) on Kokkos Views, packed (THD) input
// only.
//
// Parameters live in one flat buffer with named views into it; gradients mirror that layout, so
// the optimizer, the data-parallel all-reduce and checkpoints treat the model as one array plus
// a table of named tensors (tensors()), whose names are the Hugging Face parameter names.
// Gradients accumulate (+=) across micro-batches until zeroGradients(); activations are written
// (=).  T is the master scalar: float in training, double for finite-difference checks.
// One orchestration (esm2.cpp, encoder_layer.cpp) runs every backend: each operation is a
// dispatch point (ops.hpp) that picks the portable Kokkos kernel or the CUDA specialisation by
// the precision policy (Esm2Config::precision) and the execution space.
#pragma once

#include "core/types.hpp"
#include "data/batch.hpp"
#include "model/fp8_scaling.hpp"
#include "model/lora.hpp"
#include "model/moe_config.hpp"
#include "model/ops.hpp"
#include "model/tensor_table.hpp"

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace plm::dist {
class Communicator;
}

namespace plm::model {

struct Esm2Config {
  int num_layers = 6;
  int hidden = 320;
  int heads = 20;
  int ffn = 1280;
  int vocab = 33;
  int max_positions = 1026;  // so at most 1024 tokens per sequence
  double layer_norm_eps = 1e-5;
  bool token_dropout = true;  // applied in training and evaluation, as Hugging Face does
  Recompute recompute = Recompute::None;  // what backward recomputes instead of keeping
  Precision precision = Precision::Fp32;  // compute arithmetic (bf16: CUDA build, Esm2<float>)
  AttentionKernel attention = AttentionKernel::Auto;  // train.attention (bf16 on CUDA)
  bool deterministic = true;  // train.deterministic: false = cuDNN's atomic attention backward
  MoeConfig moe;              // Mixture-of-Experts FFN layers (moe.experts == 0: the dense ESM-2)
  Fp8Config fp8;              // the FP8 recipe (read under precision == Fp8; doc/fp8.md)
  LoraConfig lora;            // LoRA adapters (lora.rank == 0: none; model/lora.hpp)

  /// \brief esm2_8m, esm2_35m, esm2_150m, esm2_650m, esm2_3b, esm2_15b; throws a collective
  /// plm::Error listing the valid names otherwise.
  static Esm2Config preset(const std::string& name);
  static std::vector<std::string> presetNames();

  int headDim() const { return hidden / heads; }
  std::int64_t numParameters() const;  // unique parameters (decoder tied to the embedding)
  /// \brief Parameters one token passes through (an MoE layer counts its router, top_k experts
  /// and the shared experts); numParameters() for a dense model.
  std::int64_t activeParameters() const;
  /// \brief Model FLOPs per trained token (forward + backward, recomputation not counted):
  /// 6 * (matmul weights incl. the tied decoder) + 12 * layers * hidden * S, where
  /// S = sum_s len_s^2 / sum_s len_s is the token-weighted mean sequence length of the packed
  /// batches (doc/model.md derives it).
  double trainFlopsPerToken(double mean_seqlen_weighted) const;
  /// \brief Throws a collective plm::Error if the shape is invalid (hidden % heads, even
  /// head_dim, positive sizes).
  void validate() const;
};

/// \brief The plain model of one with LoRA adapters (config.lora enabled, every expert held):
/// `values` (host, laid out as `tensors`) with every adapted weight W replaced by
/// W + (alpha / r) B A and the adapters dropped, laid out as tensorTable(config without lora) (its
/// whole flat buffer, padding included). What `plm convert --to-hf` and the model file at the end
/// of a run write (doc/finetune.md).
std::vector<float> mergeLora(const Esm2Config& config, const std::vector<TensorInfo>& tensors,
                             const float* values);

/// Optional outputs of a forward pass (device views, allocated by the model).
template <class T> struct ForwardOutputs {
  bool want_logits = false;
  bool want_hidden = false;
  bool moe_stats = false;  // the pass's routing adds to moeStats() as a training pass's does
  View2<T> logits;         // (T, vocab) when want_logits
  View2<T> hidden;  // (T, hidden) last_hidden_state (after emb_layer_norm_after) when want_hidden
};

/// \brief Replaces the LM head and its cross-entropy in Esm2::forwardBackward with a loss on the
/// last hidden state (task heads, train/finetune.hpp), so the encoder trains through it.
template <class T> class HiddenHead {
 public:
  virtual ~HiddenHead() = default;
  /// \brief `hidden` (T, H): the micro-batch's last_hidden_state (after emb_layer_norm_after,
  /// master type).  Returns the micro-batch's loss sum and writes dhidden (T, H) = grad_scale
  /// * d(loss sum)/d(hidden) (zero where the loss reads nothing).
  virtual double lossAndGradient(const data::MicroBatch& batch, const View2<T>& hidden,
                                 double grad_scale, const View2<T>& dhidden) = 0;
};

/// \brief Called by the orchestration around each encoder layer: where sharded data parallelism
/// gathers a layer's parameters before use and reduces its gradients once final, and where the
/// bucketed data-parallel all-reduce starts.  Default: nothing.
class LayerHooks {
 public:
  virtual ~LayerHooks() = default;
  /// \brief Before layer `layer`'s parameters are read by a forward (also a recomputing one).
  virtual void beforeForward(int layer) { (void)layer; }
  /// \brief Before layer `layer`'s backward.
  virtual void beforeBackward(int layer) { (void)layer; }
  /// \brief Layer `layer`'s backward is done: its gradient range is final for this micro-batch.
  virtual void afterBackward(int layer) { (void)layer; }
  /// \brief The whole backward is done (embedding, final LayerNorm and LM head gradients too).
  virtual void afterModelBackward() {}
};

/// What a model allocates when it is built.
enum class ModelBuffers {
  Whole,  // the flat parameter and gradient buffers (and the bf16 policy's packed compute copy)
  None,   // none of them: every group's views must be placed (Esm2::placeRange) before a pass;
          // sharded data parallelism (train/fsdp.hpp) builds its model so, and draws its shards
          // with initializeRange, so no rank ever holds the whole model
};

template <class T> class Esm2 {
 public:
  /// `experts`: the routed experts this rank holds (expert parallelism shards them in memory;
  /// setExpertParallel must then get a group of that degree with this rank at that rank).
  /// `buffers`: ModelBuffers::None builds the table, the layers and their views without any
  /// whole-model buffer (views point into reserved address space with no memory behind it
  /// until placed); under fp8 the FP8 weight copy (portable path: filled by the sharded
  /// engine, fp8Weights()) or codes (CUDA path: cast per placed group) stay whole buffers.
  explicit Esm2(const Esm2Config& config, const ExpertPlacement& experts = {},
                ModelBuffers buffers = ModelBuffers::Whole);
  ~Esm2();
  Esm2(const Esm2&) = delete;
  Esm2& operator=(const Esm2&) = delete;

  const Esm2Config& config() const;
  /// \brief Every parameter, in a fixed order (the checkpoint and convert order).
  const std::vector<TensorInfo>& tensors() const;
  const TensorInfo& tensor(const std::string& name) const;  // throws plm::Error if unknown

  View1<T> parameters();  // (bufferElements()); empty while the whole buffer is not held
  View1<T> gradients();   // (bufferElements()), same layout
  /// \brief Elements of the flat parameter buffer (alignment padding included), also while
  /// the whole buffers are not held.
  std::int64_t bufferElements() const;

  /// \brief normal(0, 0.02) weights, zero biases, LayerNorm 1/0, padding row zeroed.
  void initialize(std::uint64_t seed);
  /// \brief Writes the initial values (initialize(seed)'s) of the flat buffer elements
  /// [offset, offset + count) to `out` (count elements in the model's memory space), without
  /// drawing any other element: each tensor has its own random stream, counter-based
  /// (math::normal(seed, stream, element)), so a shard of it is drawn where it starts.  Padding
  /// elements are 0.  Enqueued on the model's execution space (not fenced).
  void initializeRange(std::uint64_t seed, std::int64_t offset, std::int64_t count, T* out) const;
  void zeroGradients();

  /// \brief Forward and backward over one packed micro-batch. Accumulates
  /// grad_scale * d(sum of masked-token cross-entropy)/dparams into gradients() and returns that
  /// sum (not the mean), so the trainer can normalise by the global masked-token count.
  /// An empty micro-batch (no tokens) returns 0 and changes nothing.
  /// The bf16 compute copy of the parameters is refreshed from the masters first unless
  /// refresh_weights is false (the caller ran refreshComputeWeights() since the last change).
  double forwardBackward(const data::MicroBatch& batch, double grad_scale,
                         bool refresh_weights = true);

  /// \brief Forward only; returns the sum of masked-token cross-entropy.  Logits and hidden
  /// states requested in `outputs` are fresh allocations the caller owns.
  double forward(const data::MicroBatch& batch, ForwardOutputs<T>* outputs = nullptr,
                 bool refresh_weights = true);

  /// \brief Recasts the compute-precision copy of the parameters (bf16 policy) from the
  /// masters; nothing under fp32.  Once per optimizer step is enough.
  void refreshComputeWeights();

  /// \brief The FP8 scaling state (precision: fp8), nullptr otherwise.  The trainer ends each
  /// step with endFp8Step(comm); checkpoints save and restore it.
  Fp8Scaling* fp8Scaling();
  /// \brief Collective over `comm` under fp8 (nothing otherwise): ends the step's scaling, the
  /// device amaxes of the CUDA path included, with one all-reduce (Fp8Scaling::endStep).
  void endFp8Step(MPI_Comm comm);
  /// \brief Under fp8 (nothing otherwise): the scaling state a checkpoint stored
  /// (Fp8Scaling::restore); on the CUDA path the device's amax accumulators are cleared too,
  /// since what the casts before the restore recorded (the initial weights') belongs to no step
  /// of the restored run.
  void restoreFp8Scaling(const std::vector<float>& histories, const std::vector<float>& scales,
                         std::int64_t steps);

  /// One FP8 GEMM weight: its master parts (q, k and v stacked as one tensor), its scaling
  /// operand, and what the GEMMs read: on the portable path the quantised copy (rows x cols,
  /// row-major, the parts one after the other); on the CUDA path the E4M3 codes of that
  /// (rows, cols) tensor and of its transpose, with the per-tensor scale_inv (a device scalar)
  /// or, under block scaling, each copy's 128x128 scale_inv after its codes
  /// (gpu::fp8BlockTensorScales).
  struct Fp8WeightCopy {
    int operand = -1;                 // Fp8Scaling index of its Weight operand
    std::int64_t rows = 0, cols = 0;  // of the stacked tensor
    std::vector<std::int64_t> from;   // flat master offsets of the parts ((rows / parts) x cols)
    T* copy = nullptr;                // portable: (rows, cols) quantise-dequantised values
    std::uint8_t* codes = nullptr;    // CUDA: (rows, cols) E4M3 codes, row stride cols
    std::uint8_t* codes_t = nullptr;  // CUDA: (cols, rows) the transposed codes
    float* scale_inv = nullptr;       // CUDA, per-tensor recipes: the GEMMs' weight scale_inv
  };
  /// \brief Under fp8, every FP8 GEMM weight this model computes with (empty otherwise).
  /// Sharded data parallelism (train/fsdp.hpp) quantises each rank's master slices, all-gathers
  /// the codes and decodes them straight into `copy` (portable) or `codes` (CUDA, which then
  /// derives `codes_t`), so the model's own casts from whole tensors are not run while the
  /// model is sharded.
  std::vector<Fp8WeightCopy> fp8Weights();

  /// \brief Under fp8 on the CUDA path: this step's delayed scales to the device, what
  /// refreshComputeWeights does first; a sharded model (train/fsdp.hpp) calls it once per step
  /// before its first refreshComputeRange, which casts the gathered group's FP8 weight codes
  /// from its bf16 copy.  Nothing otherwise.
  void beginFp8Step();

  /// \brief [offset, offset + count) of layer `layer`'s tensors in parameters() / gradients().
  std::pair<std::int64_t, std::int64_t> layerRange(int layer) const;

  /// \brief Re-points the parameter and gradient views of the tensors in the flat range
  /// [offset, offset + count) at `params` and `grads`, which hold that range from their first
  /// element (nullptr: back into parameters() / gradients()).  The range is one group: a
  /// layer's tensors (layerRange, padding after them allowed), the embeddings (before the
  /// layers) or the head (after them).  The memory stays the caller's; sharded data
  /// parallelism (train/fsdp.hpp) points a layer at the buffer its all-gather filled.  Under
  /// the bf16 policy the group's compute copy (computeElements() bf16 values) moves to
  /// `compute` as well (nullptr: back into the model's packed copy); the caller then refreshes
  /// it with refreshComputeRange once the masters are in place.
  void placeRange(std::int64_t offset, std::int64_t count, T* params, T* grads,
                  std::uint16_t* compute = nullptr);
  /// \brief bf16 elements of the compute copy of the group placeRange(offset, count) moves
  /// (0 under other policies).
  std::int64_t computeElements(std::int64_t offset, std::int64_t count) const;
  /// \brief bf16 policy: recasts that group's compute copy from its masters, wherever both are
  /// placed now (one launch on the model's stream; nothing under other policies); under fp8 on
  /// the CUDA path also the group's FP8 weight codes, with the scales of beginFp8Step, unless
  /// `cast_fp8` is false (the caller placed the codes: fp8Weights()).
  void refreshComputeRange(std::int64_t offset, std::int64_t count, bool cast_fp8 = true);
  /// \brief Frees (false) or allocates again (true, zero-filled) the whole-model buffers behind
  /// parameters() and gradients() (empty views while freed); the bf16 packed compute copy goes
  /// and comes with parameters().  Freeing one requires every group's views into it to be
  /// placed elsewhere (placeRange); views placed elsewhere stay.
  void holdWholeBuffers(bool params, bool grads);

  /// \brief The router losses (aux and z, with their coefficients) the last pass added to the
  /// objective, in the units of the returned cross-entropy sum: labelled rows x the per-token
  /// losses.  Gradients hold grad_scale x d(cross-entropy sum + routerLoss()).  On a context
  /// shard: this rank's token share of the micro-batch's router losses (the group's sum is one
  /// rank's), as the returned cross-entropy sum is a partial sum.
  double routerLoss() const;
  /// \brief Per MoE layer, the routing statistics summed over the training micro-batches since
  /// resetMoeStats() (empty for a dense model).
  std::vector<MoeLayerStats> moeStats() const;
  void resetMoeStats();
  /// \brief Aux-loss-free balancing (moe.bias_balance): `routed[i]` = slots routed to each
  /// expert of the i-th MoE layer over the whole step (all ranks).
  void balanceExpertBias(const std::vector<std::vector<double>>& routed);
  /// \brief Data-dependent router initialisation (moe.router_init: centred; doc/model.md
  /// "Router initialisation"): forward passes over `batches`, then each MoE layer's router rows
  /// made orthogonal to that layer's mean router input over all of them and all ranks of
  /// `comm` (centreRows).  At ESM-2's initialisation about 80% of every token's LN2 output is
  /// one vector all tokens share; without this the routers send every token to the same
  /// experts.  In its passes each layer routes with its router centred on the pass's own mean,
  /// so a layer's mean input is the one its centred predecessors give.  Collective over `comm`,
  /// and under expert parallelism every rank must pass as many micro-batches (empty ones pad).
  /// The mean is that of the micro-batches given: pass a whole global step's on every layout
  /// and every layout gets the same routers (up to summation order).  Nothing for a dense
  /// model.  Returns per MoE layer the tokens seen and the share of the mean.
  std::vector<RouterCentring> centreRouters(const std::vector<data::MicroBatch>& batches,
                                            MPI_Comm comm);
  /// \brief The passes and means of centreRouters without centring the stored routers: for a
  /// caller that holds them elsewhere (FSDP's master shards, train::MoeRun), which centres its
  /// rows on each layer's RouterCentring::mean.  `pass` runs a micro-batch's forward in place of
  /// forward() (FSDP's gathered forwardOnly); the same collective rules apply.
  std::vector<RouterCentring> routerInputMeans(
      const std::vector<data::MicroBatch>& batches, MPI_Comm comm,
      const std::function<void(const data::MicroBatch&)>& pass = {});
  /// \brief moe.router_projection, after an optimizer step: every MoE layer's router (fp32
  /// master) made orthogonal to the mean of its input over the step's training forwards, summed
  /// over `comm` (every rank that saw other tokens), W <- W - (W m) m^T / |m|^2, on the device.
  /// The sums are then cleared.  Collective over `comm`; nothing for a dense model or a layer
  /// that saw no tokens.
  void projectRouters(MPI_Comm comm);
  /// \brief Expert parallelism over `comm` (not owned; nullptr = every expert local): its
  /// size must divide moe.experts.  Collective: every rank of `comm` must then run the same
  /// sequence of passes (a rank without tokens passes an empty micro-batch).
  void setExpertParallel(dist::Communicator* comm);
  /// \brief True when MoE layers exchange tokens with other ranks (passes are collective).
  bool expertParallel() const;
  /// \brief The routed experts this model holds (its construction argument).
  const ExpertPlacement& expertPlacement() const;

  /// \brief Context parallelism over `comm` (not owned; nullptr = none): micro-batches that are
  /// context shards of this rank (data::contextShard with comm's size and rank) run their
  /// attention as ring attention over `comm` (model/context_parallel.hpp).  Collective per
  /// pass: every rank of `comm` runs the same passes on shards of the same micro-batches.
  /// MoE layers reduce their routing statistics, losses and capacity cut over `comm`
  /// (model/moe.hpp), so they route as one rank would on the whole micro-batch.
  void setContextParallel(dist::Communicator* comm);
  /// \brief The context group's size and this rank in it (1 and 0 without one).
  int contextDegree() const;
  int contextRank() const;

  /// \brief Hooks around each layer (not owned; nullptr = none).
  void setHooks(LayerHooks* hooks);
  /// \brief With a head (not owned; nullptr = none, the masked-LM objective), forwardBackward
  /// skips the LM head and backpropagates the head's loss instead: the head's loss sum is
  /// returned, grad_scale * its gradient accumulates into gradients() (the LM head's own
  /// tensors get none).  forward() is unchanged.
  void setHiddenHead(HiddenHead<T>* head);

  /// \brief Per-kind CUDA-event timing of the bf16 path's launches (GEMM, attention,
  /// LayerNorm, other), summed over the calls since setProfiling(true).
  void setProfiling(bool on);
  std::vector<std::pair<std::string, double>> profile();

  /// \brief The dispatch context (execution space, attention tiles of the portable path).
  OpContext& context();

  /// \brief Bytes of the activation workspace now allocated (it grows to the largest
  /// micro-batch seen and is reused).
  std::int64_t workspaceBytes() const;

 public:
  // Public only because nvcc refuses extended __host__ __device__ lambdas (KOKKOS_LAMBDA) inside
  // a private nested class; Impl is defined in esm2.cpp and is not an interface.
  struct Impl;

 private:
  Impl* impl_member;
};

}  // namespace plm::model
