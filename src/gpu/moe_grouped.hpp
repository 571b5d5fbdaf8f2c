// The experts' GEMMs of a MoE layer as grouped GEMMs: every expert of one GEMM in one launch
// (CUTLASS's SM90 grouped GEMM, gpu/moe_grouped_sm90a.cu), against the loop of cuBLASLt calls
// (gpu/moe.hpp expertFfnForward, model ops' linear* per expert) that stays the fallback.
//
// Design: experts own contiguous row blocks (expert e's rows follow expert e-1's, as the
// routing's permutation lays them out); experts without rows are left out of the group (their
// weight gradients are not touched).  The grouped GEMMs have no bias/GELU epilogue, so the
// forward runs grouped x W1^T, one fused pass pre += b1, act = gelu_tanh(pre) (16-byte vectors),
// grouped act W2^T and one pass y += b2; the backward runs grouped dy W2, then one pass (16 bytes
// a thread) that applies dGELU in place and sums the b1 gradient, grouped dW2 += dy^T act and
// dW1 += dpre^T x (fp32, accumulated), the b2 gradient, and grouped dx = dpre W1; the bias
// gradients are fixed-order column sums per expert over row slices (bitwise reproducible; the
// slices' sums go through a scratch part of the workspace).  The per-launch
// arguments go to the device as kernel parameters (no copy, no synchronisation).  Which path runs
// is chosen here (ExpertGemm), by the measured crossover (doc/performance.md "MoE grouped GEMM"):
// the grouped launch wins when experts are many and small, the loop when they are few and large.
#pragma once

#include "gpu/device.hpp"
#include "gpu/moe.hpp"

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace plm::gpu {

/// How the experts' GEMMs run: Auto picks by shape; Loop = one cuBLASLt call per expert;
/// Grouped = one CUTLASS grouped launch per GEMM (needs the CUTLASS build and an sm_90 GPU).
enum class ExpertGemm { Auto, Loop, Grouped };

/// \brief "auto", "loop" or "grouped"; throws plm::Error naming `where` otherwise.
ExpertGemm parseExpertGemm(const std::string& value, const std::string& where);

/// CTA tile rows (128 or 256) of the grouped launches of each layout: forward (A B^T), dgrad
/// (A B), wgrad (A^T B).  The defaults are the measured best (doc/model.md); benchmarks and
/// tests set others with setGroupedTiles to time and cover every tile.
struct GroupedTiles {
  int forward = 128, dgrad = 256, wgrad = 128;
};
/// \brief The tiles every later grouped launch of this process uses; throws plm::Error unless
/// each is 128 or 256.
void setGroupedTiles(const GroupedTiles& tiles);
GroupedTiles groupedTiles();
/// \brief True when the grouped kernels are compiled in (CUTLASS found) and the device is sm_90.
bool groupedExpertGemmAvailable();
/// \brief Loop or Grouped for the forward (backward = false) or backward GEMMs of a layer of
/// `experts` experts (hidden, ffn); Grouped asked for where it is not available throws
/// plm::Error saying so.  Auto, from the H100 measurements of doc/performance.md "MoE grouped
/// GEMM": forward grouped from 16 experts on (cuBLASLt's fused bias/GELU epilogues win below);
/// backward grouped from 16 experts on or while an expert's weight (hidden x ffn) is at most
/// 8M elements (650M-like 1280 x 2560 grouped, AIDO-like 2304 x 7680 looped).
ExpertGemm chooseExpertGemm(ExpertGemm asked, int experts, int hidden, int ffn,
                            bool backward = false);

/// fp32 gradients of one expert (device pointers), accumulated (+=).
struct ExpertGrads {
  float* w1 = nullptr;  // (ffn, hidden)
  float* b1 = nullptr;  // (ffn)
  float* w2 = nullptr;  // (hidden, ffn)
  float* b2 = nullptr;  // (hidden)
};

/// \brief Device workspace bytes the grouped forward and backward need for `experts` experts
/// of (hidden, ffn): the GEMMs' argument blocks and the bias gradients' scratch (any rows).
std::size_t groupedExpertWorkspaceBytes(int experts, int hidden, int ffn);

/// \brief As expertFfnForward (moe.hpp), in grouped launches: pre = x W1^T + b1,
/// act = gelu_tanh(pre), y = act W2^T + b2 for each expert's row block.
void groupedExpertForward(Stream stream, const std::vector<ExpertWeights>& experts,
                          const std::vector<std::int64_t>& rows, const bf16* x, bf16* pre,
                          bf16* act, bf16* y, int hidden, int ffn, void* workspace,
                          std::size_t workspace_bytes);

/// \brief The experts' backward in grouped launches: dpre = (dy W2) * gelu_tanh'(pre),
/// dx = dpre W1 (written), grads.w2 += dy^T act, grads.b2 += sum dy, grads.w1 += dpre^T x,
/// grads.b1 += sum dpre, per expert row block.
void groupedExpertBackward(Stream stream, const std::vector<ExpertWeights>& experts,
                           const std::vector<ExpertGrads>& grads,
                           const std::vector<std::int64_t>& rows, const bf16* x, const bf16* pre,
                           const bf16* act, const bf16* dy, bf16* dpre, bf16* dx, int hidden,
                           int ffn, void* workspace, std::size_t workspace_bytes);

/// \brief SwiGLU experts (no biases; W1 = [gate; up] stored (2 ffn, hidden), W2 (hidden, ffn)) in
/// grouped launches: pre (sum rows, 2 ffn) = x W1^T (one grouped GEMM for gate and up),
/// act (sum rows, ffn) = silu(pre_gate) * pre_up (gpu::swigluForward, one pass over all rows),
/// y = act W2^T.  The workspace is sized by groupedExpertWorkspaceBytes(experts, hidden, ffn).
void groupedSwigluExpertForward(Stream stream, const std::vector<ExpertWeights>& experts,
                                const std::vector<std::int64_t>& rows, const bf16* x, bf16* pre,
                                bf16* act, bf16* y, int hidden, int ffn, void* workspace,
                                std::size_t workspace_bytes);

/// \brief Their backward: dact (sum rows, ffn) = dy W2, dpre (sum rows, 2 ffn) =
/// gpu::swigluBackward(pre, dact), grads.w2 += dy^T act, grads.w1 += dpre^T x (2 ffn, hidden),
/// dx = dpre W1 (written); the bias gradients are not touched (nullptr allowed).
void groupedSwigluExpertBackward(Stream stream, const std::vector<ExpertWeights>& experts,
                                 const std::vector<ExpertGrads>& grads,
                                 const std::vector<std::int64_t>& rows, const bf16* x,
                                 const bf16* pre, const bf16* act, const bf16* dy, bf16* dact,
                                 bf16* dpre, bf16* dx, int hidden, int ffn, void* workspace,
                                 std::size_t workspace_bytes);

/// The experts' row blocks as a dropless device routing leaves them (gpu::RouteBuffers::counts):
/// expert e's `rows[e]` rows start at row `first[e]` (device arrays), `total` rows in all (known
/// to the host: T k).  Forward calls given these launch without the host ever seeing the counts,
/// so a layer's forward needs no synchronisation.
struct DeviceRows {
  const std::int64_t* rows = nullptr;   // (E) device
  const std::int64_t* first = nullptr;  // (E) device
  std::int64_t total = 0;
};

/// \brief groupedExpertForward with the row blocks on the device (bitwise the same results).
void groupedExpertForward(Stream stream, const std::vector<ExpertWeights>& experts,
                          const DeviceRows& rows, const bf16* x, bf16* pre, bf16* act, bf16* y,
                          int hidden, int ffn, void* workspace, std::size_t workspace_bytes);
/// \brief groupedSwigluExpertForward with the row blocks on the device.
void groupedSwigluExpertForward(Stream stream, const std::vector<ExpertWeights>& experts,
                                const DeviceRows& rows, const bf16* x, bf16* pre, bf16* act,
                                bf16* y, int hidden, int ffn, void* workspace,
                                std::size_t workspace_bytes);
/// \brief expertBiasGelu over `rows.total` rows whose expert blocks are on the device.
void expertBiasGelu(Stream stream, const std::vector<const bf16*>& bias, const DeviceRows& rows,
                    bf16* pre, bf16* act, int cols);

/// \brief Per expert e, rows [offset[e], offset[e] + rows[e]): pre = bf16(pre + b[e]),
/// act = gelu_tanh(pre) (act may be nullptr: only the bias is added); cols a multiple of 8.
void expertBiasGelu(Stream stream, const std::vector<const bf16*>& bias,
                    const std::vector<std::int64_t>& rows, bf16* pre, bf16* act, int cols);

/// \brief Per expert e: db[e][c] += sum over its rows of d(r, c) (fp32, in an order fixed by
/// the shape alone: bitwise reproducible); cols a multiple of 8, d 16-byte aligned; the
/// workspace (device) holds expertBiasGradientWorkspaceBytes(rows.size(), cols).
void expertBiasGradient(Stream stream, const std::vector<float*>& db,
                        const std::vector<std::int64_t>& rows, const bf16* d, int cols,
                        void* workspace, std::size_t workspace_bytes);
/// \brief The scratch bytes expertBiasGradient needs for `experts` experts of `cols` columns
/// (per-slice column sums; any rows).
std::size_t expertBiasGradientWorkspaceBytes(int experts, int cols);

}  // namespace plm::gpu
