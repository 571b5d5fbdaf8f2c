// MoE kernels (see moe.hpp for the design): one warp per token for the unpermute and its
// backward, so each token's slots are summed in a fixed order and no atomics are needed.
#include "gpu/moe.hpp"

#include "core/error.hpp"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>

namespace plm::gpu {
namespace {

using bfloat = __nv_bfloat16;
constexpr int kWarp = 32;
constexpr int kWarpsPerBlock = 8;

unsigned blocksForTokens(std::int64_t tokens) {
  const std::int64_t blocks = (tokens + kWarpsPerBlock - 1) / kWarpsPerBlock;
  return static_cast<unsigned>(std::min<std::int64_t>(blocks, 65535 * 8));
}

__global__ void unpermuteKernel(const bfloat* y, const std::int32_t* slot_row,
                                const float* slot_gate, const float* residual, float* out,
                                std::int64_t tokens, int k, int hidden) {
  const int lane = threadIdx.x % kWarp;
  for (std::int64_t t = blockIdx.x * std::int64_t(kWarpsPerBlock) + threadIdx.x / kWarp; t < tokens;
       t += std::int64_t(gridDim.x) * kWarpsPerBlock) {
    for (int c = lane; c < hidden; c += kWarp) {
      float acc = residual[t * hidden + c];
      for (int j = 0; j < k; ++j) {
        const std::int32_t p = slot_row[t * k + j];
        if (p >= 0) acc += slot_gate[t * k + j] * __bfloat162float(y[std::int64_t(p) * hidden + c]);
      }
      out[t * hidden + c] = acc;
    }
  }
}

__global__ void unpermuteBackwardKernel(const bfloat* dout, const bfloat* y,
                                        const std::int32_t* slot_row, const float* slot_gate,
                                        bfloat* dy, float* dgate, std::int64_t tokens, int k,
                                        int hidden) {
  const int lane = threadIdx.x % kWarp;
  for (std::int64_t t = blockIdx.x * std::int64_t(kWarpsPerBlock) + threadIdx.x / kWarp; t < tokens;
       t += std::int64_t(gridDim.x) * kWarpsPerBlock) {
    for (int j = 0; j < k; ++j) {
      const std::int32_t p = slot_row[t * k + j];
      float dot = 0.0f;
      if (p >= 0) {
        const float g = slot_gate[t * k + j];
        for (int c = lane; c < hidden; c += kWarp) {
          const float d = __bfloat162float(dout[t * hidden + c]);
          dot += d * __bfloat162float(y[std::int64_t(p) * hidden + c]);
          dy[std::int64_t(p) * hidden + c] = __float2bfloat16(g * d);
        }
      }
      for (int offset = kWarp / 2; offset > 0; offset /= 2)
        dot += __shfl_xor_sync(0xffffffffu, dot, offset);
      if (lane == 0) dgate[t * k + j] = dot;
    }
  }
}

__global__ void combineGradientKernel(const bfloat* dx, const std::int32_t* slot_row, bfloat* dh,
                                      std::int64_t tokens, int k, int hidden) {
  const int lane = threadIdx.x % kWarp;
  for (std::int64_t t = blockIdx.x * std::int64_t(kWarpsPerBlock) + threadIdx.x / kWarp; t < tokens;
       t += std::int64_t(gridDim.x) * kWarpsPerBlock) {
    for (int c = lane; c < hidden; c += kWarp) {
      float acc = 0.0f;
      for (int j = 0; j < k; ++j) {
        const std::int32_t p = slot_row[t * k + j];
        if (p >= 0) acc += __bfloat162float(dx[std::int64_t(p) * hidden + c]);
      }
      dh[t * hidden + c] = __float2bfloat16(acc);
    }
  }
}

}  // namespace

void moeUnpermute(Stream stream, const bf16* y, const std::int32_t* slot_row,
                  const float* slot_gate, const float* residual, float* out, std::int64_t tokens,
                  int k, int hidden) {
  if (tokens == 0) return;
  unpermuteKernel<<<blocksForTokens(tokens), kWarp * kWarpsPerBlock, 0, stream>>>(
      reinterpret_cast<const bfloat*>(y), slot_row, slot_gate, residual, out, tokens, k, hidden);
  PLM_CHECK_CUDA(cudaGetLastError());
}

void moeUnpermuteBackward(Stream stream, const bf16* dout, const bf16* y,
                          const std::int32_t* slot_row, const float* slot_gate, bf16* dy,
                          float* dgate, std::int64_t tokens, int k, int hidden) {
  if (tokens == 0) return;
  unpermuteBackwardKernel<<<blocksForTokens(tokens), kWarp * kWarpsPerBlock, 0, stream>>>(
      reinterpret_cast<const bfloat*>(dout), reinterpret_cast<const bfloat*>(y), slot_row,
      slot_gate, reinterpret_cast<bfloat*>(dy), dgate, tokens, k, hidden);
  PLM_CHECK_CUDA(cudaGetLastError());
}

void moeCombineGradient(Stream stream, const bf16* dx, const std::int32_t* slot_row, bf16* dh,
                        std::int64_t tokens, int k, int hidden) {
  if (tokens == 0) return;
  combineGradientKernel<<<blocksForTokens(tokens), kWarp * kWarpsPerBlock, 0, stream>>>(
      reinterpret_cast<const bfloat*>(dx), slot_row, reinterpret_cast<bfloat*>(dh), tokens, k,
      hidden);
  PLM_CHECK_CUDA(cudaGetLastError());
}

void expertFfnForward(Gemm& gemm, Stream stream, const std::vector<ExpertWeights>& experts,
                      const std::vector<std::int64_t>& rows, const bf16* x, bf16* pre, bf16* act,
                      bf16* y, int hidden, int ffn) {
  if (rows.size() != experts.size())
    throw Error("plm::gpu::expertFfnForward: " + std::to_string(rows.size()) + " row counts for " +
                std::to_string(experts.size()) + " experts (a bug)");
  std::int64_t at = 0;
  for (std::size_t e = 0; e < experts.size(); ++e) {
    const std::int64_t n = rows[e];
    if (n == 0) continue;
    GemmArgs up;  // act (n, ffn) = gelu(x W1^T + b1), pre kept
    up.trans_b = true;
    up.m = n;
    up.n = ffn;
    up.k = hidden;
    up.a = x + at * hidden;
    up.lda = hidden;
    up.b = experts[e].w1;
    up.ldb = hidden;
    up.d = act + at * ffn;
    up.ldd = ffn;
    up.epilogue = Epilogue::BiasGeluAux;
    up.bias = experts[e].b1;
    up.aux = pre + at * ffn;
    up.ldaux = ffn;
    gemm.run(stream, up);
    GemmArgs down;  // y (n, hidden) = act W2^T + b2
    down.trans_b = true;
    down.m = n;
    down.n = hidden;
    down.k = ffn;
    down.a = act + at * ffn;
    down.lda = ffn;
    down.b = experts[e].w2;
    down.ldb = ffn;
    down.d = y + at * hidden;
    down.ldd = hidden;
    down.epilogue = Epilogue::Bias;
    down.bias = experts[e].b2;
    gemm.run(stream, down);
    at += n;
  }
}

}  // namespace plm::gpu
