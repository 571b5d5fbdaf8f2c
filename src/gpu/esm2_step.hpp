// ESM-2 forward + backward in bf16 on CUDA, over the model's own fp32 parameter and gradient
// buffers (train.precision: bf16).
//
// Design: the fp32 master parameters stay where plm::model::Esm2 keeps them (one flat buffer,
// Hugging Face layout); before each micro-batch a bf16 compute copy is refreshed from them in one
// launch, packed for the GEMMs (query/key/value weights stacked into one (3H, H) matrix, so the
// QKV projection and its input gradient are single GEMMs).  Activations are bf16, except the
// residual stream and its gradient, which stay fp32 as under PyTorch autocast; LayerNorm and
// softmax statistics are fp32.  Parameter gradients accumulate (+=) into the fp32 gradient buffer
// straight from the GEMMs (beta = 1) and the fused kernels.  Residual adds ride on the GEMMs'
// C operand; biases, GELU and bias gradients on their epilogues.  The LM head runs on labelled
// rows only.  GELU is cuBLASLt's tanh form (HF ESM uses erf; the two differ by < 1e-3, below
// bf16 resolution: doc/gpu.md).
#pragma once

#include "gpu/device.hpp"

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace plm::gpu {

struct Esm2Shape {
  int layers = 0, hidden = 0, heads = 0, ffn = 0, vocab = 33;
  float eps = 1e-5f;
  bool token_dropout = true;
  int mask_id = 32, pad_id = 1;
};

/// Element offsets of every tensor in the flat fp32 parameter (and gradient) buffer.
struct Esm2Offsets {
  struct Layer {
    std::int64_t wq, bq, wk, bk, wv, bv, wo, bo, ln1_g, ln1_b, w1, b1, w2, b2, ln2_g, ln2_b;
  };
  std::int64_t embed = 0;
  std::vector<Layer> layers;
  std::int64_t lnf_g = 0, lnf_b = 0, head_w = 0, head_b = 0, head_ln_g = 0, head_ln_b = 0,
               head_bias = 0;
};

/// A packed micro-batch on the host (data::MicroBatch's arrays).
struct HostBatch {
  const std::uint8_t* tokens = nullptr;      // (T)
  const std::int32_t* labels = nullptr;      // (T), -100 = not a target
  const std::int32_t* cu_seqlens = nullptr;  // (n+1)
  std::int64_t num_tokens = 0;
  int num_seqs = 0;
  int max_seqlen = 0;
};

class Esm2Bf16 {
 public:
  Esm2Bf16(const Esm2Shape& shape, const Esm2Offsets& offsets);
  ~Esm2Bf16();
  Esm2Bf16(const Esm2Bf16&) = delete;
  Esm2Bf16& operator=(const Esm2Bf16&) = delete;

  /// \brief Forward and backward of one micro-batch: grads += grad_scale * d(sum of masked CE)
  /// / d(params); returns that sum (synchronises the stream).  `master` and `grads` are the
  /// model's flat fp32 device buffers.
  double forwardBackward(Stream stream, const float* master, float* grads, const HostBatch& batch,
                         double grad_scale);
  /// \brief Bytes of device memory held (bf16 weights, activations, workspaces).
  std::size_t deviceBytes() const;

  /// \brief Time every launch of the next calls with CUDA events, by kind (GEMM, attention,
  /// LayerNorm, other); costs a little speed, so off by default.
  void setProfiling(bool on);
  /// \brief Milliseconds per kind summed over the calls since setProfiling(true).
  std::vector<std::pair<std::string, double>> profile() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_member;
};

}  // namespace plm::gpu
