// Fused memory-bound kernels of the ESM-2 training step on CUDA.
//
// Design: each kernel reads its inputs once and writes its outputs once (bf16 activations, fp32
// statistics and parameter gradients); parameter gradients accumulate (+=) like the portable
// model's, activation gradients are written (=).  Sequence-aware kernels (rotary positions,
// token dropout) take the packed batch's cu_seqlens on the device.
#pragma once

#include "gpu/device.hpp"

#include <cstddef>
#include <cstdint>

namespace plm::gpu {

/// \brief ESM-2 rotary embedding, in place on q and k (T, H, D) (row strides in elements), at
/// each token's position inside its sequence (`positions`, (T), device).  q is also multiplied
/// by q_scale (ESM-2 scales q by head_dim^-1/2 before rotating).  `inverse` applies the
/// transpose (backward pass).
void rotary(Stream stream, bf16* q, std::int64_t q_stride, bf16* k, std::int64_t k_stride,
            const std::int32_t* positions, std::int64_t tokens, int heads, int head_dim,
            bool inverse, float q_scale = 1.0f);

/// \brief out[t] = W[ids[t]] * scale(seq) with ESM-2 token dropout: <mask> rows are zero and the
/// rest are scaled by (1 - 0.15 * 0.8) / (1 - masked fraction of the sequence).
void embeddingForward(Stream stream, const std::uint8_t* ids, const bf16* weight, bf16* out,
                      const std::int32_t* cu_seqlens, int num_seqs, int cols, int mask_id,
                      bool token_dropout);

/// \brief The same into an fp32 residual stream.
void embeddingForward(Stream stream, const std::uint8_t* ids, const bf16* weight, float* out,
                      const std::int32_t* cu_seqlens, int num_seqs, int cols, int mask_id,
                      bool token_dropout);

/// \brief Bytes of `workspace` embeddingBackward needs.
std::size_t embeddingBackwardWorkspace(int num_seqs, int vocab, int cols);

/// \brief dW[ids[t]] += scale(seq) * dout[t] (fp32 dW, (vocab, cols)); <mask> rows and the
/// padding row (PyTorch's padding_idx, -1 for none) receive nothing.  Per-sequence partial sums
/// are added in sequence order (no float atomics): the result is bitwise reproducible.
void embeddingBackward(Stream stream, const std::uint8_t* ids, const bf16* dout, float* dweight,
                       const std::int32_t* cu_seqlens, int num_seqs, int vocab, int cols,
                       int mask_id, bool token_dropout, int padding_id, void* workspace);

/// \brief Softmax cross-entropy over rows of logits (rows, vocab; row stride ld >= vocab) fp32
/// with labels (-100 = ignore): adds the loss sum to *loss_sum (device double) and writes
/// dlogits = grad_scale * (softmax - onehot) (0 on ignored rows and in columns vocab..ld-1) as
/// bf16 with the same row stride, in one pass.  ld = 0 means vocab.
void crossEntropy(Stream stream, const float* logits, const std::int32_t* labels, bf16* dlogits,
                  double* loss_sum, std::int64_t rows, int vocab, float grad_scale, int ld = 0);

/// \brief dst[r] = src[rows[r]] for r < m; rows of `cols` bf16 (cols a multiple of 8).
void gatherRows(Stream stream, const bf16* src, const std::int32_t* rows, bf16* dst, std::int64_t m,
                int cols);

/// \brief dst[rows[r]] = src[r] for r < m (rows distinct; other rows of dst untouched).
void scatterRows(Stream stream, const bf16* src, const std::int32_t* rows, bf16* dst,
                 std::int64_t m, int cols);

/// \brief dx = dy * gelu_tanh'(pre), the derivative of cuBLASLt's GELU epilogue (n elements).
void geluTanhBackward(Stream stream, const bf16* dy, const bf16* pre, bf16* dx, std::int64_t n);

/// \brief SwiGLU over `rows` rows: pre (rows, 2f) holds [gate | up] per row; act (rows, f) =
/// silu(gate) * up (fp32 arithmetic, bf16 out).
void swigluForward(Stream stream, const bf16* pre, bf16* act, std::int64_t rows, int f);

/// \brief Its backward in one pass: from dact (rows, f), dpre (rows, 2f) = [dact * up *
/// silu'(gate) | dact * silu(gate)].
void swigluBackward(Stream stream, const bf16* pre, const bf16* dact, bf16* dpre, std::int64_t rows,
                    int f);

/// \brief dst += src (fp32, n elements).
void addInto(Stream stream, float* dst, const float* src, std::int64_t n);

/// \brief dst (bf16) = src (fp32) over `num_chunks` chunks (src offset, dst offset, count) held
/// on the device as 3 int64 each: one launch refreshes a packed bf16 copy of scattered tensors.
void castChunks(Stream stream, const float* src, bf16* dst, const std::int64_t* chunks,
                int num_chunks);

/// \brief dst (fp32) = src (bf16), n elements.
void castToFloat(Stream stream, const bf16* src, float* dst, std::int64_t n);

/// \brief sum of squares of x (fp32, n) added to *out (device double).
void sumSquares(Stream stream, const float* x, std::int64_t n, double* out);

struct AdamWParams {
  float lr = 0, beta1 = 0.9f, beta2 = 0.98f, eps = 1e-8f, weight_decay = 0;
  int step = 1;                        // 1-based, for the bias corrections
  float grad_scale = 1.0f;             // gradients are multiplied by this first (1 / masked tokens)
  float max_norm = 0.0f;               // clip the scaled gradient's global norm to this (0 = off)
  const double* grad_sumsq = nullptr;  // device: sum of squares of the unscaled gradient
};

/// \brief One AdamW step over the flat parameter buffer (n): fp32 master, m, v updated in
/// place, bf16 compute copy written (unless param_bf16 is null).  Tensors [seg_offsets[i],
/// seg_offsets[i+1]) are decayed when seg_decay[i] (device arrays, num_segments + 1 offsets).
void adamwStep(Stream stream, float* master, const float* grad, float* m, float* v,
               bf16* param_bf16, std::int64_t n, const std::int64_t* seg_offsets,
               const std::uint8_t* seg_decay, int num_segments, const AdamWParams& p);

}  // namespace plm::gpu
