// MoE kernels (see moe.hpp for the design): one warp per token for the unpermute and its
// backward, so each token's slots are summed in a fixed order and no atomics are needed.
#include "gpu/moe.hpp"

#include "core/error.hpp"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <mutex>
#include <set>

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
                                      std::int64_t tokens, int k, int hidden, const float* add) {
  const int lane = threadIdx.x % kWarp;
  for (std::int64_t t = blockIdx.x * std::int64_t(kWarpsPerBlock) + threadIdx.x / kWarp; t < tokens;
       t += std::int64_t(gridDim.x) * kWarpsPerBlock) {
    for (int c = lane; c < hidden; c += kWarp) {
      float acc = add ? add[t * hidden + c] : 0.0f;
      for (int j = 0; j < k; ++j) {
        const std::int32_t p = slot_row[t * k + j];
        if (p >= 0) acc += __bfloat162float(dx[std::int64_t(p) * hidden + c]);
      }
      dh[t * hidden + c] = __float2bfloat16(acc);
    }
  }
}

// ---- 16-byte versions (hidden a multiple of 8, 16-byte aligned rows): each lane moves 8 bf16
// (one uint4) and 8 fp32 (two float4) at a time.  Per element the sums run in the same order as
// the scalar kernels above (residual / add first, then the slots in order), so unpermute and
// combine give the same bits; the gate gradient's dot product is summed per lane in another
// order (fp32 rounding differs).

struct Vec8 {
  float v[8];
};

__device__ __forceinline__ Vec8 loadBf16x8(const bfloat* p) {
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  const auto* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
  Vec8 r;
  for (int j = 0; j < 4; ++j) {
    const float2 f = __bfloat1622float2(h[j]);
    r.v[2 * j] = f.x;
    r.v[2 * j + 1] = f.y;
  }
  return r;
}

__device__ __forceinline__ void storeBf16x8(bfloat* p, const Vec8& x) {
  uint4 raw;
  auto* h = reinterpret_cast<__nv_bfloat162*>(&raw);
  for (int j = 0; j < 4; ++j) h[j] = __floats2bfloat162_rn(x.v[2 * j], x.v[2 * j + 1]);
  *reinterpret_cast<uint4*>(p) = raw;
}

__device__ __forceinline__ Vec8 loadF32x8(const float* p) {
  const float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
  return Vec8{{a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w}};
}

__device__ __forceinline__ void storeF32x8(float* p, const Vec8& x) {
  reinterpret_cast<float4*>(p)[0] = make_float4(x.v[0], x.v[1], x.v[2], x.v[3]);
  reinterpret_cast<float4*>(p)[1] = make_float4(x.v[4], x.v[5], x.v[6], x.v[7]);
}

__global__ void unpermuteVec8Kernel(const bfloat* y, const std::int32_t* slot_row,
                                    const float* slot_gate, const float* residual, float* out,
                                    std::int64_t tokens, int k, int hidden) {
  const int lane = threadIdx.x % kWarp;
  for (std::int64_t t = blockIdx.x * std::int64_t(kWarpsPerBlock) + threadIdx.x / kWarp; t < tokens;
       t += std::int64_t(gridDim.x) * kWarpsPerBlock) {
    for (int c = lane * 8; c < hidden; c += kWarp * 8) {
      Vec8 acc = loadF32x8(residual + t * hidden + c);
      for (int j = 0; j < k; ++j) {
        const std::int32_t p = slot_row[t * k + j];
        if (p < 0) continue;
        const float g = slot_gate[t * k + j];
        const Vec8 v = loadBf16x8(y + std::int64_t(p) * hidden + c);
        for (int i = 0; i < 8; ++i) acc.v[i] += g * v.v[i];
      }
      storeF32x8(out + t * hidden + c, acc);
    }
  }
}

__global__ void unpermuteBackwardVec8Kernel(const bfloat* dout, const bfloat* y,
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
        for (int c = lane * 8; c < hidden; c += kWarp * 8) {
          const Vec8 d = loadBf16x8(dout + t * hidden + c);
          const Vec8 v = loadBf16x8(y + std::int64_t(p) * hidden + c);
          Vec8 out;
          for (int i = 0; i < 8; ++i) {
            dot += d.v[i] * v.v[i];
            out.v[i] = g * d.v[i];
          }
          storeBf16x8(dy + std::int64_t(p) * hidden + c, out);
        }
      }
      for (int offset = kWarp / 2; offset > 0; offset /= 2)
        dot += __shfl_xor_sync(0xffffffffu, dot, offset);
      if (lane == 0) dgate[t * k + j] = dot;
    }
  }
}

__global__ void combineGradientVec8Kernel(const bfloat* dx, const std::int32_t* slot_row,
                                          bfloat* dh, std::int64_t tokens, int k, int hidden,
                                          const float* add) {
  const int lane = threadIdx.x % kWarp;
  for (std::int64_t t = blockIdx.x * std::int64_t(kWarpsPerBlock) + threadIdx.x / kWarp; t < tokens;
       t += std::int64_t(gridDim.x) * kWarpsPerBlock) {
    for (int c = lane * 8; c < hidden; c += kWarp * 8) {
      Vec8 acc = add ? loadF32x8(add + t * hidden + c) : Vec8{};
      for (int j = 0; j < k; ++j) {
        const std::int32_t p = slot_row[t * k + j];
        if (p < 0) continue;
        const Vec8 v = loadBf16x8(dx + std::int64_t(p) * hidden + c);
        for (int i = 0; i < 8; ++i) acc.v[i] += v.v[i];
      }
      storeBf16x8(dh + t * hidden + c, acc);
    }
  }
}

/// The router (experts x hidden fp32) into the block's shared memory, for every thread.
__device__ __forceinline__ void stageRouter(float* router, const float* w, int n) {
  for (int i = threadIdx.x; i < n; i += blockDim.x) router[i] = w[i];
  __syncthreads();
}

/// combineGradientVec8Kernel with the router's part formed per element from the router staged in
/// shared memory (experts x hidden fp32): r = sum_e dl(t, e) W(e, c) in e order, then - v(c).
__global__ void combineRouterVec8Kernel(const bfloat* dx, const std::int32_t* slot_row, bfloat* dh,
                                        std::int64_t tokens, int k, int hidden, const float* dl,
                                        const float* w, const float* v, int experts) {
  extern __shared__ float router[];  // (experts, hidden)
  stageRouter(router, w, experts * hidden);
  const int lane = threadIdx.x % kWarp;
  for (std::int64_t t = blockIdx.x * std::int64_t(kWarpsPerBlock) + threadIdx.x / kWarp; t < tokens;
       t += std::int64_t(gridDim.x) * kWarpsPerBlock) {
    const float* dlt = dl + t * experts;
    for (int c = lane * 8; c < hidden; c += kWarp * 8) {
      Vec8 acc{};
      for (int e = 0; e < experts; ++e) {
        const float g = dlt[e];
        const float* we = router + e * hidden + c;
        for (int i = 0; i < 8; ++i) acc.v[i] = fmaf(g, we[i], acc.v[i]);
      }
      if (v) {
        const Vec8 vc = loadF32x8(v + c);
        for (int i = 0; i < 8; ++i) acc.v[i] -= vc.v[i];
      }
      for (int j = 0; j < k; ++j) {
        const std::int32_t p = slot_row[t * k + j];
        if (p < 0) continue;
        const Vec8 x = loadBf16x8(dx + std::int64_t(p) * hidden + c);
        for (int i = 0; i < 8; ++i) acc.v[i] += x.v[i];
      }
      storeBf16x8(dh + t * hidden + c, acc);
    }
  }
}

/// The most shared memory a combine block stages the router in (opted in above 48 KiB).
constexpr std::size_t kRouterSmemBytes = 160u << 10;

std::atomic<bool>& scalarKernels() {
  static std::atomic<bool> scalar{false};
  return scalar;
}

/// The 16-byte kernels need hidden % 8 == 0 and every base pointer 16-byte aligned.
bool vec8(int hidden, std::initializer_list<const void*> ptrs) {
  if (hidden % 8 != 0 || scalarKernels().load(std::memory_order_relaxed)) return false;
  for (const void* p : ptrs)
    if (p && reinterpret_cast<std::uintptr_t>(p) % 16 != 0) return false;
  return true;
}

}  // namespace

void setMoeScalarKernels(bool scalar) { scalarKernels().store(scalar); }

void moeUnpermute(Stream stream, const bf16* y, const std::int32_t* slot_row,
                  const float* slot_gate, const float* residual, float* out, std::int64_t tokens,
                  int k, int hidden) {
  if (tokens == 0) return;
  if (vec8(hidden, {y, residual, out})) {
    unpermuteVec8Kernel<<<blocksForTokens(tokens), kWarp * kWarpsPerBlock, 0, stream>>>(
        reinterpret_cast<const bfloat*>(y), slot_row, slot_gate, residual, out, tokens, k, hidden);
    PLM_CHECK_CUDA(cudaGetLastError());
    return;
  }
  unpermuteKernel<<<blocksForTokens(tokens), kWarp * kWarpsPerBlock, 0, stream>>>(
      reinterpret_cast<const bfloat*>(y), slot_row, slot_gate, residual, out, tokens, k, hidden);
  PLM_CHECK_CUDA(cudaGetLastError());
}

void moeUnpermuteBackward(Stream stream, const bf16* dout, const bf16* y,
                          const std::int32_t* slot_row, const float* slot_gate, bf16* dy,
                          float* dgate, std::int64_t tokens, int k, int hidden) {
  if (tokens == 0) return;
  if (vec8(hidden, {dout, y, dy})) {
    unpermuteBackwardVec8Kernel<<<blocksForTokens(tokens), kWarp * kWarpsPerBlock, 0, stream>>>(
        reinterpret_cast<const bfloat*>(dout), reinterpret_cast<const bfloat*>(y), slot_row,
        slot_gate, reinterpret_cast<bfloat*>(dy), dgate, tokens, k, hidden);
    PLM_CHECK_CUDA(cudaGetLastError());
    return;
  }
  unpermuteBackwardKernel<<<blocksForTokens(tokens), kWarp * kWarpsPerBlock, 0, stream>>>(
      reinterpret_cast<const bfloat*>(dout), reinterpret_cast<const bfloat*>(y), slot_row,
      slot_gate, reinterpret_cast<bfloat*>(dy), dgate, tokens, k, hidden);
  PLM_CHECK_CUDA(cudaGetLastError());
}

void moeCombineGradient(Stream stream, const bf16* dx, const std::int32_t* slot_row, bf16* dh,
                        std::int64_t tokens, int k, int hidden, const float* add) {
  if (tokens == 0) return;
  if (vec8(hidden, {dx, dh, add})) {
    combineGradientVec8Kernel<<<blocksForTokens(tokens), kWarp * kWarpsPerBlock, 0, stream>>>(
        reinterpret_cast<const bfloat*>(dx), slot_row, reinterpret_cast<bfloat*>(dh), tokens, k,
        hidden, add);
    PLM_CHECK_CUDA(cudaGetLastError());
    return;
  }
  combineGradientKernel<<<blocksForTokens(tokens), kWarp * kWarpsPerBlock, 0, stream>>>(
      reinterpret_cast<const bfloat*>(dx), slot_row, reinterpret_cast<bfloat*>(dh), tokens, k,
      hidden, add);
  PLM_CHECK_CUDA(cudaGetLastError());
}

// ---- the router's products with its bf16 input ----------------------------------------------
// routerLogits: one warp per token, each lane 8 columns at a time (16-byte loads of h), the
// router staged in shared memory; up to kLogitGroup experts (and h s) accumulated per pass over
// the row, lanes' partial sums added by a fixed shuffle tree.  routerOuter: a block of one warp
// per (256-column tile, row slice) accumulates up to kOuterGroup rows of [g | gs] x 8 columns
// per lane over its rows in order, the slices' sums added in slice order by a second launch.
namespace {

constexpr int kLogitGroup = 8;
constexpr int kOuterGroup = 9;                 // rows of g per pass in routerOuter (E 8 and gs)
constexpr std::int64_t kOuterSliceRows = 128;  // rows per slice, at least
constexpr int kOuterMaxSlices = 256;

__device__ __forceinline__ float warpSum(float x) {
  for (int o = kWarp / 2; o > 0; o /= 2) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

__global__ void routerLogitsKernel(const bfloat* h, std::int64_t tokens, int hidden, const float* w,
                                   int experts, const float* s, float* logits, float* hs) {
  extern __shared__ float router[];  // (experts, hidden)
  stageRouter(router, w, experts * hidden);
  const int lane = threadIdx.x % kWarp;
  for (std::int64_t t = blockIdx.x * std::int64_t(kWarpsPerBlock) + threadIdx.x / kWarp; t < tokens;
       t += std::int64_t(gridDim.x) * kWarpsPerBlock) {
    const bfloat* row = h + t * hidden;
    for (int e0 = 0; e0 < experts; e0 += kLogitGroup) {
      const int n = min(kLogitGroup, experts - e0);
      const bool with_s = s != nullptr && e0 == 0;
      float acc[kLogitGroup + 1] = {};
      for (int c = lane * 8; c < hidden; c += kWarp * 8) {
        const Vec8 x = loadBf16x8(row + c);
        for (int e = 0; e < n; ++e) {
          const float* we = router + (e0 + e) * hidden + c;
          for (int i = 0; i < 8; ++i) acc[e] = fmaf(x.v[i], we[i], acc[e]);
        }
        if (with_s) {
          const Vec8 sc = loadF32x8(s + c);
          for (int i = 0; i < 8; ++i) acc[kLogitGroup] = fmaf(x.v[i], sc.v[i], acc[kLogitGroup]);
        }
      }
      for (int e = 0; e < n; ++e) {
        const float v = warpSum(acc[e]);
        if (lane == 0) logits[t * experts + e0 + e] = v;
      }
      if (with_s) {
        const float v = warpSum(acc[kLogitGroup]);
        if (lane == 0) hs[t] = v;
      }
    }
  }
}

int outerSlices(std::int64_t tokens) {
  return static_cast<int>(std::clamp<std::int64_t>((tokens + kOuterSliceRows - 1) / kOuterSliceRows,
                                                   1, kOuterMaxSlices));
}

/// Block (column tile, slice): one warp, lane's 8 columns; partial (slices, experts + 1, hidden).
__global__ void routerOuterKernel(const bfloat* h, const float* g, std::int64_t tokens, int hidden,
                                  int experts, const float* gs, int slices, float* partial) {
  const int lane = threadIdx.x, slice = blockIdx.y;
  const int c = blockIdx.x * kWarp * 8 + lane * 8;
  const std::int64_t per = (tokens + slices - 1) / slices;
  const std::int64_t first = min(tokens, slice * per), last = min(tokens, first + per);
  const int width = experts + 1;
  float* out = partial + std::int64_t(slice) * width * hidden;
  if (c >= hidden) return;
  for (int e0 = 0; e0 < width; e0 += kOuterGroup) {
    const int n = min(kOuterGroup, width - e0);
    float acc[kOuterGroup][8] = {};
    for (std::int64_t t = first; t < last; ++t) {
      const Vec8 x = loadBf16x8(h + t * hidden + c);
      for (int e = 0; e < n; ++e) {
        const int ee = e0 + e;
        const float ge = ee < experts ? g[t * experts + ee] : (gs ? gs[t] : 0.0f);
        for (int i = 0; i < 8; ++i) acc[e][i] = fmaf(ge, x.v[i], acc[e][i]);
      }
    }
    for (int e = 0; e < n; ++e) {
      Vec8 v;
      for (int i = 0; i < 8; ++i) v.v[i] = acc[e][i];
      storeF32x8(out + std::int64_t(e0 + e) * hidden + c, v);
    }
  }
}

/// dw(e, c) += sum over slices (in order) of partial(slice, e, c); xg(c) = the same for row
/// `experts` (where xg != nullptr).
__global__ void routerOuterFinishKernel(const float* partial, int slices, int hidden, int experts,
                                        float* dw, float* xg) {
  const std::int64_t i = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x;
  const int width = experts + 1;
  if (i >= std::int64_t(width) * hidden) return;
  const int e = static_cast<int>(i / hidden);
  if (e == experts && !xg) return;
  float sum = 0.0f;
  for (int k = 0; k < slices; ++k) sum += partial[std::int64_t(k) * width * hidden + i];
  if (e < experts)
    dw[i] += sum;
  else
    xg[i - std::int64_t(experts) * hidden] = sum;
}

}  // namespace

namespace {

/// The grid of a kernel that stages the router (`smem` bytes) in every block and strides over
/// the tokens: enough blocks to fill the GPU twice.  Opts the kernel in to more than 48 KiB of
/// shared memory the first time it needs it.
unsigned routerGrid(const void* kernel, std::size_t smem, std::int64_t tokens) {
  static std::mutex mutex;
  static std::set<const void*> opted;
  if (smem > (48u << 10)) {
    std::lock_guard<std::mutex> lock(mutex);
    if (opted.insert(kernel).second)
      PLM_CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(kRouterSmemBytes)));
  }
  int device = 0, sms = 0;
  PLM_CHECK_CUDA(cudaGetDevice(&device));
  PLM_CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  return std::min<unsigned>(blocksForTokens(tokens), unsigned(2 * sms));
}

}  // namespace

bool routerFitsShared(int hidden, int experts) {
  return experts > 0 && hidden % 8 == 0 &&
         std::size_t(experts) * std::size_t(hidden) * sizeof(float) <= kRouterSmemBytes;
}

bool moeCombineTakesRouter(int hidden, int experts, std::initializer_list<const void*> ptrs) {
  return routerFitsShared(hidden, experts) && vec8(hidden, ptrs);
}

void moeCombineGradient(Stream stream, const bf16* dx, const std::int32_t* slot_row, bf16* dh,
                        std::int64_t tokens, int k, int hidden, const RouterInputGradient& router) {
  if (!moeCombineTakesRouter(hidden, router.experts, {dx, dh, router.v}))
    throw Error("plm::gpu::moeCombineGradient: the router's part cannot be formed here (hidden " +
                std::to_string(hidden) + ", " + std::to_string(router.experts) +
                " experts; a bug in the caller: ask moeCombineTakesRouter)");
  if (tokens == 0) return;
  const std::size_t smem = std::size_t(router.experts) * hidden * sizeof(float);
  const unsigned blocks =
      routerGrid(reinterpret_cast<const void*>(combineRouterVec8Kernel), smem, tokens);
  combineRouterVec8Kernel<<<blocks, kWarp * kWarpsPerBlock, smem, stream>>>(
      reinterpret_cast<const bfloat*>(dx), slot_row, reinterpret_cast<bfloat*>(dh), tokens, k,
      hidden, router.dl, router.w, router.v, router.experts);
  PLM_CHECK_CUDA(cudaGetLastError());
}

void routerLogits(Stream stream, const bf16* h, std::int64_t tokens, int hidden, const float* w,
                  int experts, const float* s, float* logits, float* hs) {
  if (!routerFitsShared(hidden, experts) || reinterpret_cast<std::uintptr_t>(h) % 16 != 0 ||
      (s && reinterpret_cast<std::uintptr_t>(s) % 16 != 0))
    throw Error("plm::gpu::routerLogits: hidden " + std::to_string(hidden) + ", " +
                std::to_string(experts) +
                " experts or unaligned rows (a bug in the caller: ask "
                "routerFitsShared)");
  if (tokens == 0) return;
  const std::size_t smem = std::size_t(experts) * hidden * sizeof(float);
  const unsigned blocks =
      routerGrid(reinterpret_cast<const void*>(routerLogitsKernel), smem, tokens);
  routerLogitsKernel<<<blocks, kWarp * kWarpsPerBlock, smem, stream>>>(
      reinterpret_cast<const bfloat*>(h), tokens, hidden, w, experts, s, logits, hs);
  PLM_CHECK_CUDA(cudaGetLastError());
}

std::size_t routerOuterWorkspaceBytes(std::int64_t tokens, int hidden, int experts) {
  return std::size_t(outerSlices(tokens)) * std::size_t(experts + 1) * std::size_t(hidden) *
         sizeof(float);
}

void routerOuter(Stream stream, const bf16* h, const float* g, std::int64_t tokens, int hidden,
                 int experts, const float* gs, float* dw, float* xg, void* workspace,
                 std::size_t workspace_bytes) {
  if (hidden % 8 != 0 || reinterpret_cast<std::uintptr_t>(h) % 16 != 0 ||
      workspace_bytes < routerOuterWorkspaceBytes(tokens, hidden, experts))
    throw Error("plm::gpu::routerOuter: hidden " + std::to_string(hidden) +
                ", unaligned rows or a workspace under " +
                std::to_string(routerOuterWorkspaceBytes(tokens, hidden, experts)) +
                " bytes (a bug in the caller)");
  if (tokens == 0) {
    if (xg) PLM_CHECK_CUDA(cudaMemsetAsync(xg, 0, std::size_t(hidden) * sizeof(float), stream));
    return;
  }
  const int slices = outerSlices(tokens);
  auto* partial = static_cast<float*>(workspace);
  routerOuterKernel<<<dim3((hidden + kWarp * 8 - 1) / (kWarp * 8), slices), kWarp, 0, stream>>>(
      reinterpret_cast<const bfloat*>(h), g, tokens, hidden, experts, gs, slices, partial);
  PLM_CHECK_CUDA(cudaGetLastError());
  const std::int64_t n = std::int64_t(experts + 1) * hidden;
  routerOuterFinishKernel<<<static_cast<unsigned>((n + 255) / 256), 256, 0, stream>>>(
      partial, slices, hidden, experts, dw, xg);
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

// ---- routing on the device ---------------------------------------------------------------------
// Design: one thread per token decides its slots (double, as the host reference); the capacity
// cut and the permutation need each slot's rank among the earlier slots of its expert, found in
// chunks of kChunk slots (a rank inside the chunk, counts per chunk, one scan over the chunks per
// expert); every sum over tokens is a fixed-order block reduction, so a routing is
// deterministic and independent of the launch shape.
namespace {

constexpr int kChunk = 256;
constexpr int kRouteThreads = 128;

std::int64_t chunksOf(std::int64_t slots) { return (slots + kChunk - 1) / kChunk; }

__global__ void routeTokensKernel(RouteArgs a, RouteBuffers b) {
  const std::int64_t t = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x;
  if (t >= a.tokens) return;
  const int e_n = a.experts, k = a.top_k;
  const float* l = a.logits + t * e_n;
  double m = -INFINITY;
  for (int e = 0; e < e_n; ++e) m = fmax(m, double(l[e]));
  double s = 0;
  for (int e = 0; e < e_n; ++e) s += exp(double(l[e]) - m);
  const double lse = m + log(s);
  double* p = b.prob + t * e_n;
  double total = 0;
  for (int e = 0; e < e_n; ++e) {
    p[e] = a.softmax ? exp(double(l[e]) - m) / s : 1.0 / (1.0 + exp(-double(l[e])));
    total += p[e];
  }
  double h = 0;
  for (int e = 0; e < e_n; ++e) {
    const double q = p[e] / total;
    if (q > 0) h -= q * log(q);
  }
  b.lse[t] = lse;
  b.token_stats[2 * t] = lse * lse;
  b.token_stats[2 * t + 1] = h;
  // Top-k by repeated arg-max: descending score, ties to the lower expert (the reference's
  // partial_sort order).
  unsigned long long taken[kMaxRouteExperts / 64] = {};
  double sel = 0;
  for (int j = 0; j < k; ++j) {
    int best = -1;
    double best_score = 0;
    for (int e = 0; e < e_n; ++e) {
      if (taken[e / 64] >> (e % 64) & 1ull) continue;
      const double score = p[e] + (a.bias ? double(a.bias[e]) : 0.0);
      if (best < 0 || score > best_score) {
        best = e;
        best_score = score;
      }
    }
    taken[best / 64] |= 1ull << (best % 64);
    b.expert[t * k + j] = best;
    sel += p[best];
  }
  for (int j = 0; j < k; ++j) {
    const int e = b.expert[t * k + j];
    b.gate[t * k + j] = static_cast<float>(a.normalize_topk ? p[e] / sel : p[e]);
  }
}

__global__ void chunkRankKernel(RouteArgs a, RouteBuffers b) {
  __shared__ std::int32_t chunk[kChunk];
  const std::int64_t slots = a.tokens * a.top_k;
  const std::int64_t s = blockIdx.x * std::int64_t(kChunk) + threadIdx.x;
  const std::int32_t e = s < slots ? b.expert[s] : -1;
  chunk[threadIdx.x] = e;
  __syncthreads();
  if (s < slots) {
    std::int32_t r = 0;
    for (int i = 0; i < static_cast<int>(threadIdx.x); ++i) r += chunk[i] == e;
    b.rank[s] = r;
  }
  for (int x = threadIdx.x; x < a.experts; x += blockDim.x) {
    std::int64_t c = 0;
    for (int i = 0; i < kChunk; ++i) c += chunk[i] == x;
    b.chunk_count[blockIdx.x * std::int64_t(a.experts) + x] = c;
  }
}

__global__ void scanChunksKernel(RouteArgs a, RouteBuffers b, std::int64_t chunks) {
  const int e_n = a.experts;
  for (int e = threadIdx.x; e < e_n; e += blockDim.x) {
    std::int64_t run = 0;
    for (std::int64_t c = 0; c < chunks; ++c) {
      const std::int64_t n = b.chunk_count[c * e_n + e];
      b.chunk_count[c * e_n + e] = run;
      run += n;
    }
    b.counts[e] = run;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    std::int64_t start = 0;
    for (int e = 0; e < e_n; ++e) {
      const std::int64_t routed = b.counts[e];
      const std::int64_t kept = a.capacity > 0 && routed > a.capacity ? a.capacity : routed;
      b.counts[e_n + e] = kept;
      b.counts[2 * e_n + e] = start;
      start += kept;
    }
  }
}

__global__ void placeSlotsKernel(RouteArgs a, RouteBuffers b) {
  const std::int64_t slots = a.tokens * a.top_k;
  const std::int64_t s = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x;
  if (s >= slots) return;
  const int e = b.expert[s];
  const std::int64_t r = b.chunk_count[(s / kChunk) * a.experts + e] + b.rank[s];
  if (a.capacity > 0 && r >= a.capacity) {
    b.slot_row[s] = -1;
    return;
  }
  const std::int64_t row = b.counts[2 * a.experts + e] + r;
  b.slot_row[s] = static_cast<std::int32_t>(row);
  b.row_token[row] = static_cast<std::int32_t>(s / a.top_k);
  b.row_gate[row] = b.gate[s];
}

/// Block i < E sums prob(., i); block E the lse^2 and block E + 1 the entropies, fixed order.
__global__ void routeSumsKernel(RouteArgs a, RouteBuffers b) {
  __shared__ double part[kChunk];
  const int i = blockIdx.x, e_n = a.experts;
  double acc = 0;
  for (std::int64_t t = threadIdx.x; t < a.tokens; t += blockDim.x)
    acc += i < e_n ? b.prob[t * e_n + i] : b.token_stats[2 * t + (i - e_n)];
  part[threadIdx.x] = acc;
  __syncthreads();
  for (int w = blockDim.x / 2; w > 0; w /= 2) {
    if (static_cast<int>(threadIdx.x) < w) part[threadIdx.x] += part[threadIdx.x + w];
    __syncthreads();
  }
  if (threadIdx.x == 0) b.sums[i] = part[0];
}

/// The aux loss's probability gradient (E) by value: a kernel parameter, not a copy.
struct AuxGradient {
  double dp[kMaxRouteExperts];
};

__global__ void routeBackwardKernel(RouteArgs a, RouteBuffers b, const float* dgate, double z_scale,
                                    float* dlogits, const __grid_constant__ AuxGradient aux) {
  const std::int64_t t = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x;
  if (t >= a.tokens) return;
  const int e_n = a.experts, k = a.top_k;
  const double* p = b.prob + t * e_n;
  const float* l = a.logits + t * e_n;
  double dp[kMaxRouteExperts];
  for (int e = 0; e < e_n; ++e) dp[e] = aux.dp[e];
  const std::int64_t s0 = t * k;
  if (a.normalize_topk) {
    double sel = 0, inner = 0;
    for (int j = 0; j < k; ++j) sel += p[b.expert[s0 + j]];
    for (int j = 0; j < k; ++j)
      if (b.slot_row[s0 + j] >= 0) inner += double(dgate[s0 + j]) * (p[b.expert[s0 + j]] / sel);
    for (int j = 0; j < k; ++j) {
      const double dg = b.slot_row[s0 + j] >= 0 ? double(dgate[s0 + j]) : 0.0;
      dp[b.expert[s0 + j]] += (dg - inner) / sel;
    }
  } else {
    for (int j = 0; j < k; ++j)
      if (b.slot_row[s0 + j] >= 0) dp[b.expert[s0 + j]] += double(dgate[s0 + j]);
  }
  double dot = 0;
  if (a.softmax)
    for (int e = 0; e < e_n; ++e) dot += p[e] * dp[e];
  const double lse = b.lse[t];
  for (int e = 0; e < e_n; ++e) {
    double dl = a.softmax ? p[e] * (dp[e] - dot) : dp[e] * p[e] * (1.0 - p[e]);
    if (z_scale != 0) dl += z_scale * 2.0 * lse * exp(double(l[e]) - lse) / double(a.tokens);
    dlogits[t * e_n + e] = static_cast<float>(dl);
  }
}

template <class X> X* carve(char*& at, std::int64_t n) {
  X* p = reinterpret_cast<X*>(at);
  at += (n * std::int64_t(sizeof(X)) + 255) / 256 * 256;
  return p;
}

void checkRouteArgs(const RouteArgs& a) {
  if (a.experts < 1 || a.experts > kMaxRouteExperts || a.top_k < 1 || a.top_k > a.experts)
    throw Error("plm::gpu::routeOnDevice: " + std::to_string(a.experts) + " experts, top-" +
                std::to_string(a.top_k) + " (device routing takes up to " +
                std::to_string(kMaxRouteExperts) + " experts; a bug in the caller)");
}

}  // namespace

RouteBuffers routeBuffers(void* workspace, std::int64_t tokens, int experts, int top_k) {
  char* at = static_cast<char*>(workspace);
  const std::int64_t slots = tokens * top_k;
  RouteBuffers b;
  b.prob = carve<double>(at, tokens * experts);
  b.lse = carve<double>(at, tokens);
  b.token_stats = carve<double>(at, 2 * tokens);
  b.expert = carve<std::int32_t>(at, slots);
  b.gate = carve<float>(at, slots);
  b.slot_row = carve<std::int32_t>(at, slots);
  b.rank = carve<std::int32_t>(at, slots);
  b.row_token = carve<std::int32_t>(at, slots);
  b.row_gate = carve<float>(at, slots);
  b.chunk_count = carve<std::int64_t>(at, chunksOf(slots) * experts);
  b.counts = carve<std::int64_t>(at, 3 * experts);
  b.sums = carve<double>(at, experts + 2);
  return b;
}

std::size_t routeWorkspaceBytes(std::int64_t tokens, int experts, int top_k) {
  RouteBuffers b = routeBuffers(nullptr, tokens, experts, top_k);
  return reinterpret_cast<std::size_t>(b.sums) +
         ((std::size_t(experts) + 2) * sizeof(double) + 255) / 256 * 256;
}

struct RouteReadback::Impl {
  std::int64_t* counts = nullptr;  // (2 E) routed, kept; pinned
  double* sums = nullptr;          // (E + 2) probability sums, lse^2, entropy; pinned
  cudaEvent_t done = nullptr;
  int experts = 0;
  bool pending = false;  // an event was recorded and not yet waited for
};

RouteReadback::RouteReadback() : impl_member(new Impl()) {
  PLM_CHECK_CUDA(cudaMallocHost(&impl_member->counts, 2 * kMaxRouteExperts * sizeof(std::int64_t)));
  PLM_CHECK_CUDA(cudaMallocHost(&impl_member->sums, (kMaxRouteExperts + 2) * sizeof(double)));
  PLM_CHECK_CUDA(cudaEventCreateWithFlags(&impl_member->done, cudaEventDisableTiming));
}

RouteReadback::~RouteReadback() {
  // Errors are not thrown from a destructor: the pinned memory and the event are released
  // when the context goes in any case.
  if (impl_member->pending) (void)cudaEventSynchronize(impl_member->done);
  (void)cudaEventDestroy(impl_member->done);
  (void)cudaFreeHost(impl_member->sums);
  (void)cudaFreeHost(impl_member->counts);
  delete impl_member;
}

void routeOnDeviceAsync(Stream stream, const RouteArgs& a, const RouteBuffers& b,
                        RouteReadback& rb) {
  checkRouteArgs(a);
  RouteReadback::Impl& r = *rb.impl_member;
  const int e_n = a.experts;
  r.experts = e_n;
  if (r.pending) PLM_CHECK_CUDA(cudaEventSynchronize(r.done));  // the buffers are reused
  r.pending = false;
  if (a.tokens == 0) {
    std::fill(r.counts, r.counts + 2 * e_n, std::int64_t(0));
    std::fill(r.sums, r.sums + e_n + 2, 0.0);
    return;
  }
  const std::int64_t slots = a.tokens * a.top_k, chunks = chunksOf(slots);
  // The summary's inputs first (the sums, then the counts), its copy and event, then the
  // placement of the slots, which the host does not need: the host's wait ends while the GPU
  // places them.  Each kernel reads only what routeTokensKernel (placeSlotsKernel: the scan)
  // wrote, so the order changes no result.
  routeTokensKernel<<<static_cast<unsigned>((a.tokens + kRouteThreads - 1) / kRouteThreads),
                      kRouteThreads, 0, stream>>>(a, b);
  PLM_CHECK_CUDA(cudaGetLastError());
  routeSumsKernel<<<e_n + 2, kChunk, 0, stream>>>(a, b);
  PLM_CHECK_CUDA(cudaGetLastError());
  chunkRankKernel<<<static_cast<unsigned>(chunks), kChunk, 0, stream>>>(a, b);
  PLM_CHECK_CUDA(cudaGetLastError());
  scanChunksKernel<<<1, kChunk, 0, stream>>>(a, b, chunks);
  PLM_CHECK_CUDA(cudaGetLastError());
  PLM_CHECK_CUDA(cudaMemcpyAsync(r.counts, b.counts, 2 * e_n * sizeof(std::int64_t),
                                 cudaMemcpyDeviceToHost, stream));
  PLM_CHECK_CUDA(
      cudaMemcpyAsync(r.sums, b.sums, (e_n + 2) * sizeof(double), cudaMemcpyDeviceToHost, stream));
  PLM_CHECK_CUDA(cudaEventRecord(r.done, stream));
  r.pending = true;
  placeSlotsKernel<<<static_cast<unsigned>(chunks), kChunk, 0, stream>>>(a, b);
  PLM_CHECK_CUDA(cudaGetLastError());
}

RouteSummary routeSummary(RouteReadback& rb) {
  RouteReadback::Impl& r = *rb.impl_member;
  if (r.pending) PLM_CHECK_CUDA(cudaEventSynchronize(r.done));
  r.pending = false;
  const int e_n = r.experts;
  RouteSummary out;
  out.routed.assign(r.counts, r.counts + e_n);
  out.kept.assign(r.counts + e_n, r.counts + 2 * e_n);
  out.prob_sum.assign(r.sums, r.sums + e_n);
  out.lse2_sum = r.sums[e_n];
  out.entropy_sum = r.sums[e_n + 1];
  return out;
}

RouteSummary routeOnDevice(Stream stream, const RouteArgs& a, const RouteBuffers& b) {
  RouteReadback rb;
  routeOnDeviceAsync(stream, a, b, rb);
  return routeSummary(rb);
}

void routeBackwardOnDevice(Stream stream, const RouteArgs& a, const RouteBuffers& b,
                           const float* dgate, const std::vector<double>& aux_dp, double z_scale,
                           float* dlogits) {
  checkRouteArgs(a);
  if (a.tokens == 0) return;
  if (static_cast<int>(aux_dp.size()) != a.experts)
    throw Error("plm::gpu::routeBackwardOnDevice: aux_dp has " + std::to_string(aux_dp.size()) +
                " entries for " + std::to_string(a.experts) + " experts (a bug)");
  AuxGradient aux{};
  std::copy(aux_dp.begin(), aux_dp.end(), aux.dp);
  routeBackwardKernel<<<static_cast<unsigned>((a.tokens + kRouteThreads - 1) / kRouteThreads),
                        kRouteThreads, 0, stream>>>(a, b, dgate, z_scale, dlogits, aux);
  PLM_CHECK_CUDA(cudaGetLastError());
}

}  // namespace plm::gpu
