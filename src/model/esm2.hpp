// ESM-2 (Hugging Face `EsmForMaskedLM`, ANCHORS.md §1) on Kokkos Views, packed (THD) input only.
//
// Parameters live in one flat buffer with named views into it; gradients mirror that layout, so
// the optimizer, the data-parallel all-reduce and checkpoints treat the model as one array plus
// a table of named tensors (tensors()), whose names are the Hugging Face parameter names.
// Gradients accumulate (+=) across micro-batches until zeroGradients(); activations are written
// (=).  T is the compute scalar: float in training, double for finite-difference checks.
#pragma once

#include "core/types.hpp"
#include "data/batch.hpp"

#include <cstdint>
#include <string>
#include <vector>

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
  bool recompute = false;     // recompute each layer's activations in backward

  /// \brief esm2_8m, esm2_35m, esm2_150m, esm2_650m, esm2_3b, esm2_15b; throws a collective
  /// plm::Error listing the valid names otherwise.
  static Esm2Config preset(const std::string& name);
  static std::vector<std::string> presetNames();

  int headDim() const { return hidden / heads; }
  std::int64_t numParameters() const;  // unique parameters (decoder tied to the embedding)
  /// \brief Model FLOPs per trained token (forward + backward, recomputation not counted):
  /// 6 * (matmul weights incl. the tied decoder) + 12 * layers * hidden * S, where
  /// S = sum_s len_s^2 / sum_s len_s is the token-weighted mean sequence length of the packed
  /// batches (doc/model.md derives it).
  double trainFlopsPerToken(double mean_seqlen_weighted) const;
  /// \brief Throws a collective plm::Error if the shape is invalid (hidden % heads, even
  /// head_dim, positive sizes).
  void validate() const;
};

/// A named tensor inside the flat parameter (and gradient) buffer.
struct TensorInfo {
  std::string name;  // Hugging Face name, e.g. "esm.encoder.layer.0.attention.self.query.weight"
  std::vector<std::int64_t> shape;  // Hugging Face shape (Linear weights are (out, in))
  std::int64_t offset = 0;          // into parameters() / gradients()
  std::int64_t size = 0;            // product of shape
  bool weight_decay = false;        // AdamW decays this tensor (not biases, LayerNorm, embedding)
};

/// Optional outputs of a forward pass (device views, allocated by the model).
template <class T> struct ForwardOutputs {
  bool want_logits = false;
  bool want_hidden = false;
  View2<T> logits;  // (T, vocab) when want_logits
  View2<T> hidden;  // (T, hidden) last_hidden_state (after emb_layer_norm_after) when want_hidden
};

template <class T> class Esm2 {
 public:
  explicit Esm2(const Esm2Config& config);
  ~Esm2();
  Esm2(const Esm2&) = delete;
  Esm2& operator=(const Esm2&) = delete;

  const Esm2Config& config() const;
  /// \brief Every parameter, in a fixed order (the checkpoint and convert order).
  const std::vector<TensorInfo>& tensors() const;
  const TensorInfo& tensor(const std::string& name) const;  // throws plm::Error if unknown

  View1<T> parameters();  // (numParameters)
  View1<T> gradients();   // (numParameters), same layout

  /// \brief normal(0, 0.02) weights, zero biases, LayerNorm 1/0, padding row zeroed.
  void initialize(std::uint64_t seed);
  void zeroGradients();

  /// \brief Forward and backward over one packed micro-batch. Accumulates
  /// grad_scale * d(sum of masked-token cross-entropy)/dparams into gradients() and returns that
  /// sum (not the mean), so the trainer can normalise by the global masked-token count.
  /// An empty micro-batch (no tokens) returns 0 and changes nothing.
  double forwardBackward(const data::MicroBatch& batch, double grad_scale);

  /// \brief Forward only; returns the sum of masked-token cross-entropy.  Logits and hidden
  /// states requested in `outputs` are fresh allocations the caller owns.
  double forward(const data::MicroBatch& batch, ForwardOutputs<T>* outputs = nullptr);

  /// \brief Bytes of the activation workspace now allocated (it grows to the largest
  /// micro-batch seen and is reused).
  std::int64_t workspaceBytes() const;

  /// \brief train.precision bf16: forwardBackward runs in bf16 on the GPU (plm::gpu::Esm2Bf16,
  /// doc/gpu.md) over these fp32 parameters and gradients, which stay the masters.  Only
  /// Esm2<float> in a CUDA build; elsewhere `on` throws a collective plm::Error.
  void setBf16Compute(bool on);

 public:
  // Public only because nvcc refuses extended __host__ __device__ lambdas (KOKKOS_LAMBDA) inside
  // a private nested class; Impl is defined in esm2.cpp and is not an interface.
  struct Impl;

 private:
  Impl* impl_member;
};

}  // namespace plm::model
