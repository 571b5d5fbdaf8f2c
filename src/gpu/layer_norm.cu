// LayerNorm kernels (see layer_norm.hpp).
#include "gpu/layer_norm.hpp"

#include "core/error.hpp"

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

namespace plm::gpu {

namespace {

using bfloat = __nv_bfloat16;

// Rows handled by one block of the backward: 8 warps of 256 threads, several rows per warp so
// the per-block dgamma/dbeta partial is written once for many rows.  (Two rows per warp measured
// 27% slower at 650M than about eleven.)
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxBlocks = 264;

__device__ __forceinline__ float warpSum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

template <class T> struct Native { using type = T; };
template <> struct Native<bf16> { using type = bfloat; };

template <class T> __device__ __forceinline__ float2 load2(const T* p, std::int64_t i);
template <> __device__ __forceinline__ float2 load2<float>(const float* p, std::int64_t i) {
  return reinterpret_cast<const float2*>(p)[i];
}
template <> __device__ __forceinline__ float2 load2<bfloat>(const bfloat* p, std::int64_t i) {
  return __bfloat1622float2(reinterpret_cast<const __nv_bfloat162*>(p)[i]);
}
__device__ __forceinline__ void store2(bfloat* p, std::int64_t i, float a, float b) {
  reinterpret_cast<__nv_bfloat162*>(p)[i] = __floats2bfloat162_rn(a, b);
}

// A warp's row of `cols` values into registers (lane holds pairs lane + 32 j, zeros past the
// end; J >= cols / 64), with its mean and 1 / sqrt(variance + eps) (two passes over the
// registers, the biased variance as torch.nn.LayerNorm).
template <class TX, int J>
__device__ __forceinline__ void loadRowStats(const TX* xr, int cols, float eps, int lane,
                                             float2 (&v)[J], float& mu, float& rs) {
  const int pairs = cols / 2;
#pragma unroll
  for (int j = 0; j < J; ++j) {
    int i = lane + 32 * j;
    v[j] = i < pairs ? load2(xr, i) : make_float2(0.0f, 0.0f);
  }
  float s = 0.0f;
#pragma unroll
  for (int j = 0; j < J; ++j) s += v[j].x + v[j].y;
  mu = warpSum(s) / cols;
  float ss = 0.0f;
#pragma unroll
  for (int j = 0; j < J; ++j)
    if (lane + 32 * j < pairs) ss += (v[j].x - mu) * (v[j].x - mu) + (v[j].y - mu) * (v[j].y - mu);
  rs = rsqrtf(warpSum(ss) / cols + eps);
}

// One warp per row, the row held in registers (J >= pairs / 32 float2 per lane): x is read from
// memory once, with all of a lane's loads in flight together, instead of once per pass.
template <class TX, int J>
__global__ void forwardKernel(const TX* x, const float* gamma, const float* beta, bfloat* y,
                              float* mean, float* rstd, std::int64_t rows, int cols, float eps) {
  std::int64_t row = blockIdx.x * std::int64_t(blockDim.x / 32) + threadIdx.x / 32;
  int lane = threadIdx.x & 31;
  if (row >= rows) return;
  int pairs = cols / 2;
  float2 v[J];
  float mu, rs;
  loadRowStats<TX, J>(x + row * cols, cols, eps, lane, v, mu, rs);
#pragma unroll
  for (int j = 0; j < J; ++j) {
    int i = lane + 32 * j;
    if (i < pairs) {
      float2 g = load2(gamma, i), b = load2(beta, i);
      store2(y + row * cols, i, (v[j].x - mu) * rs * g.x + b.x, (v[j].y - mu) * rs * g.y + b.y);
    }
  }
  if (lane == 0) {
    mean[row] = mu;
    rstd[row] = rs;
  }
}

// The FP8 variant: 32 rows per block (8 warps, 4 rows each, each row held in registers as
// above).  The codes of a row go straight to `codes` (2 per lane, coalesced) and into a shared
// (32, cols) tile; after the block's rows are done, 8 threads write the 32 codes of one column
// of the transposed copy (one 32-byte sector each).  Codes and amax come from the bf16-rounded
// output, as castFp8 reads it.
constexpr int kFp8Rows = 32;

struct Fp8Out {
  std::uint8_t* codes;
  std::int64_t ld;
  std::uint8_t* codes_t;
  std::int64_t ld_t;
  const float* scale;
  float* scale_inv;
  float* amax;
  bool e4m3;
};

__device__ __forceinline__ std::uint8_t encodeFp8(float v, bool e4m3) {
  return __nv_cvt_float_to_fp8(v, __NV_SATFINITE, e4m3 ? __NV_E4M3 : __NV_E5M2);
}

template <class TX, int J> __global__ void __launch_bounds__(256)
    forwardFp8Kernel(const TX* x, const float* gamma, const float* beta, bfloat* y, float* mean,
                     float* rstd, std::int64_t rows, int cols, float eps, Fp8Out q) {
  extern __shared__ std::uint8_t tile[];  // (kFp8Rows, cols + 4) codes, for codes_t
  const int stride = cols + 4;
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  const std::int64_t row0 = blockIdx.x * std::int64_t(kFp8Rows);
  const float scale = *q.scale;
  if (q.scale_inv && blockIdx.x == 0 && threadIdx.x == 0) *q.scale_inv = 1.0f / scale;
  const int pairs = cols / 2;
  unsigned amax_bits = 0;  // |v| as ordered bits: finite < inf < NaN
  for (int rl = warp; rl < kFp8Rows; rl += kThreads / 32) {
    const std::int64_t row = row0 + rl;
    if (row >= rows) break;  // uniform in the warp
    float2 v[J];
    float mu, rs;
    loadRowStats<TX, J>(x + row * cols, cols, eps, lane, v, mu, rs);
#pragma unroll
    for (int j = 0; j < J; ++j) {
      int i = lane + 32 * j;
      if (i < pairs) {
        float2 g = load2(gamma, i), b = load2(beta, i);
        const __nv_bfloat162 h =
            __floats2bfloat162_rn((v[j].x - mu) * rs * g.x + b.x, (v[j].y - mu) * rs * g.y + b.y);
        if (y) reinterpret_cast<__nv_bfloat162*>(y + row * cols)[i] = h;
        const float2 f = __bfloat1622float2(h);
        amax_bits = max(
            amax_bits, max(__float_as_uint(f.x) & 0x7fffffffu, __float_as_uint(f.y) & 0x7fffffffu));
        const std::uint16_t two = static_cast<std::uint16_t>(encodeFp8(f.x * scale, q.e4m3) |
                                                             (encodeFp8(f.y * scale, q.e4m3) << 8));
        if (q.codes) reinterpret_cast<std::uint16_t*>(q.codes + row * q.ld)[i] = two;
        if (q.codes_t) *reinterpret_cast<std::uint16_t*>(tile + rl * stride + 2 * i) = two;
      }
    }
    if (lane == 0) {
      mean[row] = mu;
      rstd[row] = rs;
    }
  }
  if (q.amax) {
    const unsigned bits = __reduce_max_sync(0xffffffffu, amax_bits);
    if (lane == 0 && bits != 0) atomicMax(reinterpret_cast<unsigned*>(q.amax), bits);
  }
  if (!q.codes_t) return;
  __syncthreads();
  const int nrows = rows - row0 < kFp8Rows ? static_cast<int>(rows - row0) : kFp8Rows;
  for (int w = threadIdx.x; w < cols * (kFp8Rows / 4); w += blockDim.x) {
    const int c = w / (kFp8Rows / 4), r = 4 * (w % (kFp8Rows / 4));
    if (r >= nrows) continue;
    std::uint8_t* dst = q.codes_t + c * q.ld_t + row0 + r;
    if (r + 4 <= nrows) {
      const unsigned b0 = tile[r * stride + c], b1 = tile[(r + 1) * stride + c],
                     b2 = tile[(r + 2) * stride + c], b3 = tile[(r + 3) * stride + c];
      *reinterpret_cast<unsigned*>(dst) = b0 | (b1 << 8) | (b2 << 16) | (b3 << 24);
    } else {
      for (int k = 0; k < nrows - r; ++k) dst[k] = tile[(r + k) * stride + c];
    }
  }
}

template <class TX, int J> void launchForwardFp8(Stream st, const TX* x, const float* gamma,
                                                 const float* beta, bfloat* y, float* mean,
                                                 float* rstd, std::int64_t rows, int cols,
                                                 float eps, const Fp8Out& q) {
  const int smem = q.codes_t ? kFp8Rows * (cols + 4) : 0;
  if (smem > 48 * 1024)
    PLM_CHECK_CUDA(cudaFuncSetAttribute(forwardFp8Kernel<TX, J>,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const auto blocks = static_cast<unsigned>((rows + kFp8Rows - 1) / kFp8Rows);
  forwardFp8Kernel<TX, J>
      <<<blocks, kThreads, smem, st>>>(x, gamma, beta, y, mean, rstd, rows, cols, eps, q);
}

// A lane always owns the same column pairs (lane + 32 j), so it sums dgamma and dbeta over all
// rows of its warp in registers (J >= pairs / 32, unrolled).  The warps of a block then add
// their sums into shared memory one warp after the other (a fixed order), and the block writes
// its partial (2, cols) row to `partial`.
template <class TX, class TDY, int J> __global__ void __launch_bounds__(kThreads)
    backwardKernel(const TDY* dy, const TX* x, const float* gamma, const float* mean,
                   const float* rstd, float* residual, bool accumulate, bfloat* dx, float* partial,
                   std::int64_t rows, int cols) {
  extern __shared__ float acc[];  // (2, cols)
  int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  int pairs = cols / 2;
  float2 dg[J], db[J];
#pragma unroll
  for (int j = 0; j < J; ++j) dg[j] = db[j] = make_float2(0.0f, 0.0f);
  for (std::int64_t row = blockIdx.x * std::int64_t(kWarps) + warp; row < rows;
       row += std::int64_t(gridDim.x) * kWarps) {
    const TX* xr = x + row * cols;
    const TDY* dyr = dy + row * cols;
    float mu = mean[row], rs = rstd[row];
    float2 h[J], d[J];
    float a = 0.0f, b = 0.0f;
#pragma unroll
    for (int j = 0; j < J; ++j) {
      int i = lane + 32 * j;
      if (i < pairs) {
        float2 v = load2(xr, i), gm = load2(gamma, i);
        d[j] = load2(dyr, i);
        h[j] = make_float2((v.x - mu) * rs, (v.y - mu) * rs);
        a += d[j].x * gm.x + d[j].y * gm.y;
        b += d[j].x * gm.x * h[j].x + d[j].y * gm.y * h[j].y;
        dg[j].x += d[j].x * h[j].x;
        dg[j].y += d[j].y * h[j].y;
        db[j].x += d[j].x;
        db[j].y += d[j].y;
      }
    }
    a = warpSum(a) / cols;
    b = warpSum(b) / cols;
#pragma unroll
    for (int j = 0; j < J; ++j) {
      int i = lane + 32 * j;
      if (i < pairs) {
        float2 gm = load2(gamma, i);
        float d0 = rs * (d[j].x * gm.x - a - h[j].x * b);
        float d1 = rs * (d[j].y * gm.y - a - h[j].y * b);
        if (residual) {
          float2* gr = reinterpret_cast<float2*>(residual + row * cols);
          if (accumulate) {
            float2 old = gr[i];
            d0 += old.x;
            d1 += old.y;
          }
          gr[i] = make_float2(d0, d1);
        }
        store2(dx + row * cols, i, d0, d1);
      }
    }
  }
  for (int w = 0; w < kWarps; ++w) {
    if (warp == w) {
#pragma unroll
      for (int j = 0; j < J; ++j) {
        int i = lane + 32 * j;
        if (i < pairs) {
          float* g = acc + 2 * i;
          float* bb = acc + cols + 2 * i;
          g[0] = (w == 0 ? 0.0f : g[0]) + dg[j].x;
          g[1] = (w == 0 ? 0.0f : g[1]) + dg[j].y;
          bb[0] = (w == 0 ? 0.0f : bb[0]) + db[j].x;
          bb[1] = (w == 0 ? 0.0f : bb[1]) + db[j].y;
        }
      }
    }
    __syncthreads();
  }
  float* out = partial + std::int64_t(blockIdx.x) * 2 * cols;
  for (int i = threadIdx.x; i < 2 * cols; i += blockDim.x) out[i] = acc[i];
}

// dgamma[c] += sum over blocks b of partial[b][c] (b in order); dbeta likewise from [cols + c].
__global__ void reducePartialsKernel(const float* partial, int blocks, int cols, float* dgamma,
                                     float* dbeta) {
  int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= 2 * cols) return;
  float s = 0.0f;
  for (int b = 0; b < blocks; ++b) s += partial[std::int64_t(b) * 2 * cols + c];
  if (c < cols)
    dgamma[c] += s;
  else
    dbeta[c - cols] += s;
}

int backwardBlocks(std::int64_t rows) {
  return static_cast<int>(std::max<std::int64_t>(
      1, std::min<std::int64_t>((rows + 4 * kWarps - 1) / (4 * kWarps), kMaxBlocks)));
}

template <class TX, class TDY, int J>
void launchBackward(Stream st, const TDY* dy, const TX* x, const float* gamma, const float* mean,
                    const float* rstd, float* residual, bool accumulate, bfloat* dx, float* partial,
                    std::int64_t rows, int cols, int blocks) {
  int smem = 2 * cols * 4;
  if (smem > 48 * 1024)
    PLM_CHECK_CUDA(cudaFuncSetAttribute(backwardKernel<TX, TDY, J>,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  backwardKernel<TX, TDY, J><<<blocks, kThreads, smem, st>>>(dy, x, gamma, mean, rstd, residual,
                                                             accumulate, dx, partial, rows, cols);
}

}  // namespace

template <class TX> void layerNormForward(Stream stream, const TX* x, const float* gamma,
                                          const float* beta, bf16* y, float* mean, float* rstd,
                                          std::int64_t rows, int cols, float eps) {
  if (rows == 0) return;
  using NX = typename Native<TX>::type;
  const auto* xs = reinterpret_cast<const NX*>(x);
  auto* ys = reinterpret_cast<bfloat*>(y);
  const unsigned blocks = static_cast<unsigned>((rows + 7) / 8);
  const int pairs_per_lane = (cols / 2 + 31) / 32;
  if (pairs_per_lane <= 4)
    forwardKernel<NX, 4>
        <<<blocks, 256, 0, stream>>>(xs, gamma, beta, ys, mean, rstd, rows, cols, eps);
  else if (pairs_per_lane <= 10)
    forwardKernel<NX, 10>
        <<<blocks, 256, 0, stream>>>(xs, gamma, beta, ys, mean, rstd, rows, cols, eps);
  else if (pairs_per_lane <= 20)
    forwardKernel<NX, 20>
        <<<blocks, 256, 0, stream>>>(xs, gamma, beta, ys, mean, rstd, rows, cols, eps);
  else if (pairs_per_lane <= 40)
    forwardKernel<NX, 40>
        <<<blocks, 256, 0, stream>>>(xs, gamma, beta, ys, mean, rstd, rows, cols, eps);
  else if (pairs_per_lane <= 80)  // esm2_15b (hidden 5120): spills registers, LayerNorm is
                                  // a small share of that model's step
    forwardKernel<NX, 80>
        <<<blocks, 256, 0, stream>>>(xs, gamma, beta, ys, mean, rstd, rows, cols, eps);
  else
    throw Error("plm::gpu::layerNormForward: hidden " + std::to_string(cols) +
                " is larger than the kernels support (5120)");
  PLM_CHECK_CUDA(cudaGetLastError());
}

template <class TX> void layerNormForwardFp8(Stream stream, const TX* x, const float* gamma,
                                             const float* beta, bf16* y, float* mean, float* rstd,
                                             std::int64_t rows, int cols, float eps,
                                             const LayerNormFp8Args& a) {
  const char* where = "plm::gpu::layerNormForwardFp8: ";
  if (a.out_type != DType::E4M3 && a.out_type != DType::E5M2)
    throw Error(std::string(where) + "the codes must be E4M3 or E5M2");
  if (!a.scale) throw Error(std::string(where) + "no scale (a device pointer to one fp32)");
  if (a.codes && (a.ld_codes < cols || a.ld_codes % 2 != 0 ||
                  reinterpret_cast<std::uintptr_t>(a.codes) % 2 != 0))
    throw Error(std::string(where) + "codes need an even row stride >= cols and 2-byte alignment");
  if (a.codes_t && (a.ld_codes_t < rows || a.ld_codes_t % 4 != 0 ||
                    reinterpret_cast<std::uintptr_t>(a.codes_t) % 4 != 0))
    throw Error(
        std::string(where) +
        "transposed codes need a row stride >= rows, a multiple of 4, and 4-byte alignment");
  if (a.amax && !a.amax_accumulate)
    PLM_CHECK_CUDA(cudaMemsetAsync(a.amax, 0, sizeof(float), stream));
  if (rows == 0) {
    if (a.scale_inv) {  // still published: a GEMM after an empty cast reads it
      Fp8Out q{nullptr, 0, nullptr, 0, a.scale, a.scale_inv, nullptr, true};
      using NX = typename Native<TX>::type;
      forwardFp8Kernel<NX, 4>
          <<<1, kThreads, 0, stream>>>(nullptr, gamma, beta, nullptr, mean, rstd, 0, cols, eps, q);
      PLM_CHECK_CUDA(cudaGetLastError());
    }
    return;
  }
  using NX = typename Native<TX>::type;
  const auto* xs = reinterpret_cast<const NX*>(x);
  auto* ys = reinterpret_cast<bfloat*>(y);
  const Fp8Out q{static_cast<std::uint8_t*>(a.codes),
                 a.ld_codes,
                 static_cast<std::uint8_t*>(a.codes_t),
                 a.ld_codes_t,
                 a.scale,
                 a.scale_inv,
                 a.amax,
                 a.out_type == DType::E4M3};
  const int pairs_per_lane = (cols / 2 + 31) / 32;
  if (pairs_per_lane <= 4)
    launchForwardFp8<NX, 4>(stream, xs, gamma, beta, ys, mean, rstd, rows, cols, eps, q);
  else if (pairs_per_lane <= 10)
    launchForwardFp8<NX, 10>(stream, xs, gamma, beta, ys, mean, rstd, rows, cols, eps, q);
  else if (pairs_per_lane <= 20)
    launchForwardFp8<NX, 20>(stream, xs, gamma, beta, ys, mean, rstd, rows, cols, eps, q);
  else if (pairs_per_lane <= 40)
    launchForwardFp8<NX, 40>(stream, xs, gamma, beta, ys, mean, rstd, rows, cols, eps, q);
  else if (pairs_per_lane <= 80)
    launchForwardFp8<NX, 80>(stream, xs, gamma, beta, ys, mean, rstd, rows, cols, eps, q);
  else
    throw Error(std::string(where) + "hidden " + std::to_string(cols) +
                " is larger than the kernels support (5120)");
  PLM_CHECK_CUDA(cudaGetLastError());
}

std::size_t layerNormBackwardWorkspace(std::int64_t rows, int cols) {
  return static_cast<std::size_t>(backwardBlocks(rows)) * 2 * cols * sizeof(float);
}

template <class TX, class TDY>
void layerNormBackward(Stream stream, const TDY* dy, const TX* x, const float* gamma,
                       const float* mean, const float* rstd, float* residual, bool accumulate,
                       bf16* dx, float* dgamma, float* dbeta, std::int64_t rows, int cols,
                       void* workspace) {
  if (rows == 0) return;
  using NX = typename Native<TX>::type;
  using NDY = typename Native<TDY>::type;
  const auto* xs = reinterpret_cast<const NX*>(x);
  const auto* dys = reinterpret_cast<const NDY*>(dy);
  auto* dxs = reinterpret_cast<bfloat*>(dx);
  auto* partial = static_cast<float*>(workspace);
  const int blocks = backwardBlocks(rows);
  const int pairs_per_lane = (cols / 2 + 31) / 32;
  if (pairs_per_lane <= 4)
    launchBackward<NX, NDY, 4>(stream, dys, xs, gamma, mean, rstd, residual, accumulate, dxs,
                               partial, rows, cols, blocks);
  else if (pairs_per_lane <= 10)
    launchBackward<NX, NDY, 10>(stream, dys, xs, gamma, mean, rstd, residual, accumulate, dxs,
                                partial, rows, cols, blocks);
  else if (pairs_per_lane <= 20)
    launchBackward<NX, NDY, 20>(stream, dys, xs, gamma, mean, rstd, residual, accumulate, dxs,
                                partial, rows, cols, blocks);
  else if (pairs_per_lane <= 40)
    launchBackward<NX, NDY, 40>(stream, dys, xs, gamma, mean, rstd, residual, accumulate, dxs,
                                partial, rows, cols, blocks);
  else if (pairs_per_lane <= 80)
    launchBackward<NX, NDY, 80>(stream, dys, xs, gamma, mean, rstd, residual, accumulate, dxs,
                                partial, rows, cols, blocks);
  else
    throw Error("plm::gpu::layerNormBackward: hidden " + std::to_string(cols) +
                " is larger than the kernels support (5120)");
  PLM_CHECK_CUDA(cudaGetLastError());
  reducePartialsKernel<<<(2 * cols + 255) / 256, 256, 0, stream>>>(partial, blocks, cols, dgamma,
                                                                   dbeta);
  PLM_CHECK_CUDA(cudaGetLastError());
}

template void layerNormForward<float>(Stream, const float*, const float*, const float*, bf16*,
                                      float*, float*, std::int64_t, int, float);
template void layerNormForward<bf16>(Stream, const bf16*, const float*, const float*, bf16*, float*,
                                     float*, std::int64_t, int, float);
template void layerNormForwardFp8<float>(Stream, const float*, const float*, const float*, bf16*,
                                         float*, float*, std::int64_t, int, float,
                                         const LayerNormFp8Args&);
template void layerNormForwardFp8<bf16>(Stream, const bf16*, const float*, const float*, bf16*,
                                        float*, float*, std::int64_t, int, float,
                                        const LayerNormFp8Args&);
#define PLM_GPU_LN_BACKWARD(TX, TDY)                                                        \
  template void layerNormBackward<TX, TDY>(Stream, const TDY*, const TX*, const float*,     \
                                           const float*, const float*, float*, bool, bf16*, \
                                           float*, float*, std::int64_t, int, void*);
PLM_GPU_LN_BACKWARD(float, float)
PLM_GPU_LN_BACKWARD(float, bf16)
PLM_GPU_LN_BACKWARD(bf16, float)
PLM_GPU_LN_BACKWARD(bf16, bf16)
#undef PLM_GPU_LN_BACKWARD

}  // namespace plm::gpu
