// CUDA kernels of the Mixture-of-Experts block (doc/model.md "Mixture of Experts"): the fused
// gate-weighted unpermute (with the residual add), its backward (gate gradients and the
// permuted output gradient in one pass), the combine of the permuted input gradient, and the
// experts' GEMMs over contiguous row blocks through cuBLASLt.
//
// Design: the routing (top-k, capacity, the stable permutation) stays the host reference of
// model/moe.cpp; these kernels consume its index arrays.  Permuting the tokens is gatherRows
// (gpu/fused.hpp).  Every reduction runs in a fixed order (one warp per token, slots in order),
// so results are deterministic.  bf16 activations, fp32 gates and residual stream (the bf16
// policy of the model).  The expert GEMMs are a loop of cuBLASLt calls, one up (bias + GELU,
// pre-activation kept) and one down (bias) per expert with rows; experts without rows launch
// nothing.  Plain references are in test/gpu/test_moe.cpp.
#pragma once

#include "gpu/device.hpp"
#include "gpu/gemm.hpp"

#include <cstdint>
#include <vector>

namespace plm::gpu {

/// \brief out(t) = residual(t) + sum over j < k with slot_row[t k + j] >= 0 of
/// slot_gate[t k + j] * y(slot_row[t k + j]); y (rows, hidden) bf16; residual, out (T, hidden)
/// fp32 (out may be residual).
void moeUnpermute(Stream stream, const bf16* y, const std::int32_t* slot_row,
                  const float* slot_gate, const float* residual, float* out, std::int64_t tokens,
                  int k, int hidden);

/// \brief For every kept slot (t, j) with row p: dy(p) = gate * dout(t) (bf16) and
/// dgate[t k + j] = dout(t) . y(p) (fp32); dropped slots get dgate 0.
void moeUnpermuteBackward(Stream stream, const bf16* dout, const bf16* y,
                          const std::int32_t* slot_row, const float* slot_gate, bf16* dy,
                          float* dgate, std::int64_t tokens, int k, int hidden);

/// \brief dh(t) = sum over the kept slots of token t of dx(row) (fp32 sum, bf16 out; 0 for a
/// token whose slots were all dropped).
void moeCombineGradient(Stream stream, const bf16* dx, const std::int32_t* slot_row, bf16* dh,
                        std::int64_t tokens, int k, int hidden);

/// One expert's bf16 weights (device pointers): W1 (ffn, hidden), b1 (ffn), W2 (hidden, ffn),
/// b2 (hidden).
struct ExpertWeights {
  const bf16* w1 = nullptr;
  const bf16* b1 = nullptr;
  const bf16* w2 = nullptr;
  const bf16* b2 = nullptr;
};

/// \brief For each expert e with rows[e] > 0, on its block of rows (experts back to back):
/// pre = x W1^T + b1, act = gelu_tanh(pre), y = act W2^T + b2.  x, y (sum rows, hidden),
/// pre, act (sum rows, ffn), bf16; hidden and ffn multiples of 8.
void expertFfnForward(Gemm& gemm, Stream stream, const std::vector<ExpertWeights>& experts,
                      const std::vector<std::int64_t>& rows, const bf16* x, bf16* pre, bf16* act,
                      bf16* y, int hidden, int ffn);

}  // namespace plm::gpu
