// LayerNorm kernels (see layer_norm.hpp).
#include "gpu/layer_norm.hpp"

#include "core/error.hpp"

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <initializer_list>
#include <limits>
#include <string>
#include <type_traits>

namespace plm::gpu {

namespace {

using bfloat = __nv_bfloat16;

// Rows handled by one block of the backward: 8 warps of 256 threads, several rows per warp so
// the per-block dgamma/dbeta partial is written once for many rows.  (Two rows per warp measured
// 27% slower at 650M than about eleven.)
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxBlocks = 264;

template <int N> using Int = std::integral_constant<int, N>;

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

// |v| as ordered bits (finite < inf < NaN), for the amax.
__device__ __forceinline__ unsigned absBits(float v) { return __float_as_uint(v) & 0x7fffffffu; }

// The FP8 kernels' scale; block 0 publishes its inverse.
__device__ __forceinline__ float fp8Scale(const Fp8Out& q) {
  const float scale = *q.scale;
  if (q.scale_inv && blockIdx.x == 0 && threadIdx.x == 0) *q.scale_inv = 1.0f / scale;
  return scale;
}

// The end of an FP8 block (every thread calls it): the warps' amax into q.amax, then the
// transposed codes from the (kFp8Rows, cols + 4) shared tile of rows row0.., 8 threads to a
// column (4 rows each: one 32-byte sector per column).
__device__ __forceinline__ void finishFp8Block(const std::uint8_t* tile, const Fp8Out& q,
                                               unsigned amax_bits, std::int64_t rows,
                                               std::int64_t row0, int cols) {
  if (q.amax) {
    const unsigned bits = __reduce_max_sync(0xffffffffu, amax_bits);
    if ((threadIdx.x & 31) == 0 && bits != 0) atomicMax(reinterpret_cast<unsigned*>(q.amax), bits);
  }
  if (!q.codes_t) return;
  __syncthreads();
  const int stride = cols + 4;
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

template <class TX, int J> __global__ void __launch_bounds__(256)
    forwardFp8Kernel(const TX* x, const float* gamma, const float* beta, bfloat* y, float* mean,
                     float* rstd, std::int64_t rows, int cols, float eps, Fp8Out q) {
  extern __shared__ std::uint8_t tile[];  // (kFp8Rows, cols + 4) codes, for codes_t
  const int stride = cols + 4;
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  const std::int64_t row0 = blockIdx.x * std::int64_t(kFp8Rows);
  const float scale = fp8Scale(q);
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
        amax_bits = max(amax_bits, max(absBits(f.x), absBits(f.y)));
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
  finishFp8Block(tile, q, amax_bits, rows, row0, cols);
}

// Either FP8 forward kernel (forwardFp8Kernel, forwardFp8TileKernel): kFp8Rows rows per block,
// the shared tile only when there are transposed codes.
template <class Kernel, class TX>
void launchForwardFp8(Kernel kernel, Stream st, const TX* x, const float* gamma, const float* beta,
                      bfloat* y, float* mean, float* rstd, std::int64_t rows, int cols, float eps,
                      const Fp8Out& q) {
  const int smem = q.codes_t ? kFp8Rows * (cols + 4) : 0;
  if (smem > 48 * 1024)
    PLM_CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const auto blocks = static_cast<unsigned>((rows + kFp8Rows - 1) / kFp8Rows);
  kernel<<<blocks, kThreads, smem, st>>>(x, gamma, beta, y, mean, rstd, rows, cols, eps, q);
}

// The row-in-registers kernels' J (float2 per lane, >= cols / 64) for cols: f(Int<J>{}); past
// 5120 an error naming `where`.  J = 80 covers an odd multiple of 2 up to 5120 (and spills).
template <class F> void withPairsPerLane(int cols, const char* where, F&& f) {
  const int pairs_per_lane = (cols / 2 + 31) / 32;
  if (pairs_per_lane <= 4)
    f(Int<4>{});
  else if (pairs_per_lane <= 10)
    f(Int<10>{});
  else if (pairs_per_lane <= 20)
    f(Int<20>{});
  else if (pairs_per_lane <= 40)
    f(Int<40>{});
  else if (pairs_per_lane <= 80)
    f(Int<80>{});
  else
    throw Error(std::string(where) + "hidden " + std::to_string(cols) +
                " is larger than the kernels support (5120)");
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

// dgamma[c] += sum over blocks b of partial[b][c]; dbeta likewise from [cols + c].  A block
// takes 32 columns: warp w sums blocks w, w + 8, ... in order, then warp 0 adds the 8 sums in
// warp order (a fixed order: bitwise reproducible).
constexpr int kReduceSlices = kWarps;

__global__ void __launch_bounds__(kThreads)
    reducePartialsKernel(const float* partial, int blocks, int cols, float* dgamma, float* dbeta) {
  __shared__ float sums[kReduceSlices][33];
  const int lane = threadIdx.x & 31, slice = threadIdx.x / 32;
  const int c = blockIdx.x * 32 + lane;
  const std::int64_t n = 2 * std::int64_t(cols);
  float s = 0.0f;
  if (c < n) {
#pragma unroll 16  // 16 loads in flight; the adds stay in order
    for (int b = slice; b < blocks; b += kReduceSlices) s += partial[b * n + c];
  }
  sums[slice][lane] = s;
  __syncthreads();
  if (slice != 0 || c >= n) return;
  float total = sums[0][lane];
#pragma unroll
  for (int k = 1; k < kReduceSlices; ++k) total += sums[k][lane];
  if (c < cols)
    dgamma[c] += total;
  else
    dbeta[c - cols] += total;
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

// ---------------------------------------------------------------------------------------------
// The tiled kernels, taken whenever cols is a multiple of 4 and every row pointer is 16-byte
// aligned for fp32 (8-byte for bf16): one 16-byte (fp32) or 8-byte (bf16) load per 4 values.
// A row belongs to a group of R warps (T = 32 R threads, G = 8 / R rows per 256-thread block
// at a time); thread t of the group holds the 4-value chunks t + T v, v < V, in registers.
// R grows with the hidden size so that V stays small: the row stays in registers without
// spilling and many rows are in flight per SM.  Group sums go lane butterfly first, then over
// the group's warps 0..R-1 through shared memory: one fixed order, so results are bitwise
// reproducible, and the plain and FP8 forwards (same tile, same routine) agree bit for bit.

__device__ __forceinline__ float4 load4(const float* p, std::int64_t chunk) {
  return reinterpret_cast<const float4*>(p)[chunk];
}
__device__ __forceinline__ float4 bf16x4ToFloat4(uint2 u) {
  const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.x));
  const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.y));
  return make_float4(lo.x, lo.y, hi.x, hi.y);
}
__device__ __forceinline__ float4 load4(const bfloat* p, std::int64_t chunk) {
  return bf16x4ToFloat4(reinterpret_cast<const uint2*>(p)[chunk]);
}
__device__ __forceinline__ uint2 packBf16(float4 v) {
  const __nv_bfloat162 lo = __floats2bfloat162_rn(v.x, v.y), hi = __floats2bfloat162_rn(v.z, v.w);
  return make_uint2(*reinterpret_cast<const unsigned*>(&lo),
                    *reinterpret_cast<const unsigned*>(&hi));
}
__device__ __forceinline__ void store4(bfloat* p, std::int64_t chunk, float4 v) {
  reinterpret_cast<uint2*>(p)[chunk] = packBf16(v);
}
__device__ __forceinline__ void store4(float* p, std::int64_t chunk, float4 v) {
  reinterpret_cast<float4*>(p)[chunk] = v;
}

// 4 values as loaded: float4 for fp32, 4 packed bf16 for bf16.
template <class T> struct Raw4Of { using type = float4; };
template <> struct Raw4Of<bfloat> { using type = uint2; };
template <class T> using Raw4 = typename Raw4Of<T>::type;

__device__ __forceinline__ float4 loadRaw4(const float* p, std::int64_t chunk) {
  return load4(p, chunk);
}
__device__ __forceinline__ uint2 loadRaw4(const bfloat* p, std::int64_t chunk) {
  return reinterpret_cast<const uint2*>(p)[chunk];
}
__device__ __forceinline__ float4 toFloat4(float4 v) { return v; }
__device__ __forceinline__ float4 toFloat4(uint2 u) { return bf16x4ToFloat4(u); }
__device__ __forceinline__ float4 mul4(float4 a, float4 b) {
  return make_float4(a.x * b.x, a.y * b.y, a.z * b.z, a.w * b.w);
}

// The sum of v over a row group (every thread of the group gets it).  `red` holds kWarps
// floats; callers alternate between two such slots, so a slot is written again only after a
// later __syncthreads that every reader of its previous value has passed.  With R > 1 every
// thread of the block must call (inactive groups with 0).
template <int R> __device__ __forceinline__ float groupSum(float v, float* red, int warp) {
  v = warpSum(v);
  if constexpr (R == 1) {
    return v;
  } else {
    if ((threadIdx.x & 31) == 0) red[warp] = v;
    __syncthreads();
    const int first = warp - warp % R;
    float s = red[first];
#pragma unroll
    for (int w = 1; w < R; ++w) s += red[first + w];
    return s;
  }
}

template <int R> __device__ __forceinline__ float2 groupSum2(float2 v, float2* red, int warp) {
  v.x = warpSum(v.x);
  v.y = warpSum(v.y);
  if constexpr (R == 1) {
    return v;
  } else {
    if ((threadIdx.x & 31) == 0) red[warp] = v;
    __syncthreads();
    const int first = warp - warp % R;
    float2 s = red[first];
#pragma unroll
    for (int w = 1; w < R; ++w) {
      s.x += red[first + w].x;
      s.y += red[first + w].y;
    }
    return s;
  }
}

// Thread t's chunks of row xr (zeros past the end, or everywhere when !live) with the row's
// mean and 1 / sqrt(biased variance + eps), two passes over the registers.  red: 2 kWarps floats.
template <class TX, int R, int V>
__device__ __forceinline__ void tileRowStats(const TX* xr, bool live, int cols, float eps, int t,
                                             int warp, float* red, float4 (&v)[V], float& mu,
                                             float& rs) {
  constexpr int T = 32 * R;
  const int chunks = cols / 4;
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const int c = t + T * j;
    v[j] = live && c < chunks ? load4(xr, c) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  }
  float s = 0.0f;
#pragma unroll
  for (int j = 0; j < V; ++j) s += (v[j].x + v[j].y) + (v[j].z + v[j].w);
  mu = groupSum<R>(s, red, warp) / cols;
  float ss = 0.0f;
#pragma unroll
  for (int j = 0; j < V; ++j)
    if (t + T * j < chunks) {
      const float a = v[j].x - mu, b = v[j].y - mu, c = v[j].z - mu, d = v[j].w - mu;
      ss += (a * a + b * b) + (c * c + d * d);
    }
  rs = rsqrtf(groupSum<R>(ss, red + kWarps, warp) / cols + eps);
}

// y = (x - mean) * rstd * gamma + beta for one chunk: the one expression both forwards use.
__device__ __forceinline__ float4 normalizeChunk(float4 v, float mu, float rs, float4 g, float4 b) {
  return make_float4((v.x - mu) * rs * g.x + b.x, (v.y - mu) * rs * g.y + b.y,
                     (v.z - mu) * rs * g.z + b.z, (v.w - mu) * rs * g.w + b.w);
}

template <class TX, int R, int V> __global__ void __launch_bounds__(kThreads)
    forwardTileKernel(const TX* x, const float* gamma, const float* beta, bfloat* y, float* mean,
                      float* rstd, std::int64_t rows, int cols, float eps) {
  constexpr int T = 32 * R, G = kWarps / R;
  __shared__ float red[2 * kWarps];
  const int warp = threadIdx.x / 32, t = threadIdx.x % T;
  const int chunks = cols / 4;
  for (std::int64_t base = blockIdx.x * std::int64_t(G); base < rows;
       base += std::int64_t(gridDim.x) * G) {
    const std::int64_t row = base + warp / R;
    const bool live = row < rows;
    float4 v[V];
    float mu, rs;
    tileRowStats<TX, R, V>(x + row * cols, live, cols, eps, t, warp, red, v, mu, rs);
    if (!live) continue;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const int c = t + T * j;
      if (c < chunks)
        store4(y + row * cols, c, normalizeChunk(v[j], mu, rs, load4(gamma, c), load4(beta, c)));
    }
    if (t == 0) {
      mean[row] = mu;
      rstd[row] = rs;
    }
  }
}

// The FP8 forward on the tile: 32 rows per block as forwardFp8Kernel, G at a time.
template <class TX, int R, int V> __global__ void __launch_bounds__(kThreads)
    forwardFp8TileKernel(const TX* x, const float* gamma, const float* beta, bfloat* y, float* mean,
                         float* rstd, std::int64_t rows, int cols, float eps, Fp8Out q) {
  constexpr int T = 32 * R, G = kWarps / R;
  extern __shared__ std::uint8_t tile[];  // (kFp8Rows, cols + 4) codes, for codes_t
  __shared__ float red[2 * kWarps];
  const int stride = cols + 4;
  const int warp = threadIdx.x / 32, t = threadIdx.x % T;
  const std::int64_t row0 = blockIdx.x * std::int64_t(kFp8Rows);
  const float scale = fp8Scale(q);
  const int chunks = cols / 4;
  unsigned amax_bits = 0;  // |v| as ordered bits: finite < inf < NaN
  for (int rb = 0; rb < kFp8Rows; rb += G) {
    const int rl = rb + warp / R;
    const std::int64_t row = row0 + rl;
    const bool live = row < rows;
    float4 v[V];
    float mu, rs;
    tileRowStats<TX, R, V>(x + row * cols, live, cols, eps, t, warp, red, v, mu, rs);
    if (!live) continue;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const int c = t + T * j;
      if (c < chunks) {
        const uint2 h = packBf16(normalizeChunk(v[j], mu, rs, load4(gamma, c), load4(beta, c)));
        if (y) reinterpret_cast<uint2*>(y + row * cols)[c] = h;
        const float2 f0 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&h.x));
        const float2 f1 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&h.y));
        amax_bits = max(amax_bits,
                        max(max(absBits(f0.x), absBits(f0.y)), max(absBits(f1.x), absBits(f1.y))));
        const unsigned four = unsigned(encodeFp8(f0.x * scale, q.e4m3)) |
                              (unsigned(encodeFp8(f0.y * scale, q.e4m3)) << 8) |
                              (unsigned(encodeFp8(f1.x * scale, q.e4m3)) << 16) |
                              (unsigned(encodeFp8(f1.y * scale, q.e4m3)) << 24);
        if (q.codes) {  // the row stride is only even: two 2-byte stores
          auto* dst = reinterpret_cast<std::uint16_t*>(q.codes + row * q.ld) + 2 * c;
          dst[0] = static_cast<std::uint16_t>(four);
          dst[1] = static_cast<std::uint16_t>(four >> 16);
        }
        if (q.codes_t) *reinterpret_cast<unsigned*>(tile + rl * stride + 4 * c) = four;
      }
    }
    if (t == 0) {
      mean[row] = mu;
      rstd[row] = rs;
    }
  }
  finishFp8Block(tile, q, amax_bits, rows, row0, cols);
}

// The forward's tile for cols (a multiple of 4, at most 5120): one warp per row up to 1280,
// then 2 and 4; V chunks per thread (at most 10: 40 values of x in registers).
template <class F> void withForwardTile(int cols, F&& f) {
  const int chunks = cols / 4;
  const int need = (chunks + 31) / 32;
  if (need <= 2)
    f(Int<1>{}, Int<2>{});
  else if (need <= 3)
    f(Int<1>{}, Int<3>{});
  else if (need <= 4)
    f(Int<1>{}, Int<4>{});
  else if (need <= 5)
    f(Int<1>{}, Int<5>{});
  else if (need <= 8)
    f(Int<1>{}, Int<8>{});
  else if (need <= 10)
    f(Int<1>{}, Int<10>{});
  else if (chunks <= 640)
    f(Int<2>{}, Int<10>{});
  else
    f(Int<4>{}, Int<10>{});
}

// The backward: per row, phase 1 loads x, dy (and the old residual gradient) of the thread's
// chunks, keeps h = (x - mean) rstd and dy in registers, adds dy h and dy into the
// group's dgamma/dbeta sums in shared memory (each column has one owner thread in the group: no
// atomics) and the row sums of e and e h; phase 2 writes the input gradient.  The block is
// persistent over rows (grid-stride); at the end it adds its groups' sums in group order and
// writes one partial (2, cols) row.  At most 5 chunks per thread: with bf16 dy that fits the 80
// registers of 3 blocks per SM; fp32 dy (the final LayerNorms only) takes 2 blocks per SM and
// spills nothing.
constexpr int kBackwardBlocksPerSm = 3;  // the most, for the workspace
template <class TDY> constexpr int backwardBlocksPerSm() {
  return std::is_same_v<TDY, float> ? 2 : kBackwardBlocksPerSm;
}

template <class TX, class TDY, int R, int V>
__global__ void __launch_bounds__(kThreads, backwardBlocksPerSm<TDY>())
    backwardTileKernel(const TDY* dy, const TX* x, const float* gamma, const float* mean,
                       const float* rstd, float* residual, bool accumulate, bfloat* dx,
                       float* partial, std::int64_t rows, int cols) {
  constexpr int T = 32 * R, G = kWarps / R;
  extern __shared__ float4 acc4[];  // (G, 2, cols / 4): each group's dgamma, dbeta sums
  __shared__ float2 red[2][kWarps];
  const int warp = threadIdx.x / 32, group = warp / R, t = threadIdx.x % T;
  const int chunks = cols / 4;
  float4* ag = acc4 + group * 2 * chunks;
  float4* ab = ag + chunks;
  const float4 zero = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const int c = t + T * j;
    if (c < chunks) ag[c] = ab[c] = zero;
  }
  const bool add_old = residual && accumulate;
  int parity = 0;
  for (std::int64_t base = blockIdx.x * std::int64_t(G); base < rows;
       base += std::int64_t(gridDim.x) * G, parity ^= 1) {
    const std::int64_t row = base + group;
    const bool live = row < rows;
    // h in fp32; dy as loaded (bf16 dy takes half the registers), e = dy gamma recomputed in
    // phase 2 (gamma from L1): the row and the old residual gradient fit 80 registers.
    float4 h[V], old[V];
    Raw4<TDY> d[V];
    float a = 0.0f, b = 0.0f, rs = 0.0f;
    if (live) {
      const float mu = mean[row];
      rs = rstd[row];
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const int c = t + T * j;
        if (c < chunks) {
          h[j] = load4(x + row * cols, c);
          d[j] = loadRaw4(dy + row * cols, c);
          if (add_old) old[j] = load4(residual + row * cols, c);
        }
      }
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const int c = t + T * j;
        if (c < chunks) {
          const float4 dv = toFloat4(d[j]), e = mul4(dv, load4(gamma, c));
          float4 hh = h[j];
          hh = make_float4((hh.x - mu) * rs, (hh.y - mu) * rs, (hh.z - mu) * rs, (hh.w - mu) * rs);
          h[j] = hh;
          a += (e.x + e.y) + (e.z + e.w);
          b += (e.x * hh.x + e.y * hh.y) + (e.z * hh.z + e.w * hh.w);
          float4 sg = ag[c], sb = ab[c];
          sg.x += dv.x * hh.x;
          sg.y += dv.y * hh.y;
          sg.z += dv.z * hh.z;
          sg.w += dv.w * hh.w;
          sb.x += dv.x;
          sb.y += dv.y;
          sb.z += dv.z;
          sb.w += dv.w;
          ag[c] = sg;
          ab[c] = sb;
        }
      }
    }
    const float2 s = groupSum2<R>(make_float2(a, b), red[parity], warp);
    if (!live) continue;
    a = s.x / cols;
    b = s.y / cols;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const int c = t + T * j;
      if (c < chunks) {
        const float4 e = mul4(toFloat4(d[j]), load4(gamma, c));
        float4 g = make_float4(rs * (e.x - a - h[j].x * b), rs * (e.y - a - h[j].y * b),
                               rs * (e.z - a - h[j].z * b), rs * (e.w - a - h[j].w * b));
        if (residual) {
          if (add_old) {
            g.x += old[j].x;
            g.y += old[j].y;
            g.z += old[j].z;
            g.w += old[j].w;
          }
          store4(residual + row * cols, c, g);
        }
        store4(dx + row * cols, c, g);
      }
    }
  }
  __syncthreads();
  auto* out = reinterpret_cast<float4*>(partial + std::int64_t(blockIdx.x) * 2 * cols);
  for (int i = threadIdx.x; i < 2 * chunks; i += kThreads) {
    float4 s = acc4[i];
#pragma unroll
    for (int g = 1; g < G; ++g) {
      const float4 o = acc4[g * 2 * chunks + i];
      s.x += o.x;
      s.y += o.y;
      s.z += o.z;
      s.w += o.w;
    }
    out[i] = s;
  }
}

// The backward's tile for cols (a multiple of 4, at most 5120): at most 5 chunks per thread,
// one warp per row up to 640, then 2, 4 and 8 warps.  A table apart from withForwardTile's: the
// backward holds h, dy and the old gradient per chunk, so it spreads a row over more warps.
template <class F> void withBackwardTile(int cols, F&& f) {
  const int chunks = cols / 4;
  const int need = (chunks + 31) / 32;
  if (need <= 2)
    f(Int<1>{}, Int<2>{});
  else if (need <= 3)
    f(Int<1>{}, Int<3>{});
  else if (need <= 4)
    f(Int<1>{}, Int<4>{});
  else if (need <= 5)
    f(Int<1>{}, Int<5>{});
  else if (chunks <= 320)
    f(Int<2>{}, Int<5>{});
  else if (chunks <= 640)
    f(Int<4>{}, Int<5>{});
  else
    f(Int<8>{}, Int<5>{});
}

int backwardTileWarps(int cols) {
  int r = 1;
  withBackwardTile(cols, [&](auto R, auto) { r = decltype(R)::value; });
  return r;
}

// Blocks of the tiled backward: enough row groups for every block, at most the resident ones.
int backwardTileBlocks(std::int64_t rows, int cols, int per_sm = kBackwardBlocksPerSm) {
  const int groups = kWarps / backwardTileWarps(cols);
  const std::int64_t resident = std::int64_t(multiprocessorCount()) * per_sm;
  return static_cast<int>(
      std::max<std::int64_t>(1, std::min<std::int64_t>((rows + groups - 1) / groups, resident)));
}

bool aligned(const void* p, std::size_t bytes) {
  return reinterpret_cast<std::uintptr_t>(p) % bytes == 0;
}

// Whether cols and the pointers fit the tiled kernels (null pointers always fit).
constexpr int kMaxCols = 5120;
template <class TX> bool tileable(int cols, const TX* x, std::initializer_list<const void*> f32,
                                  std::initializer_list<const void*> b16) {
  if (cols % 4 != 0 || cols > kMaxCols || !aligned(x, 4 * sizeof(TX))) return false;
  for (const void* p : f32)
    if (!aligned(p, 16)) return false;
  for (const void* p : b16)
    if (!aligned(p, 8)) return false;
  return true;
}

}  // namespace

template <class TX> void layerNormForward(Stream stream, const TX* x, const float* gamma,
                                          const float* beta, bf16* y, float* mean, float* rstd,
                                          std::int64_t rows, int cols, float eps) {
  if (rows == 0) return;
  using NX = typename Native<TX>::type;
  const auto* xs = reinterpret_cast<const NX*>(x);
  auto* ys = reinterpret_cast<bfloat*>(y);
  if (tileable(cols, xs, {gamma, beta}, {ys})) {
    withForwardTile(cols, [&](auto R, auto V) {
      constexpr int G = kWarps / decltype(R)::value;
      const auto blocks = static_cast<unsigned>(
          std::min<std::int64_t>((rows + G - 1) / G, std::numeric_limits<int>::max()));
      forwardTileKernel<NX, decltype(R)::value, decltype(V)::value>
          <<<blocks, kThreads, 0, stream>>>(xs, gamma, beta, ys, mean, rstd, rows, cols, eps);
    });
    PLM_CHECK_CUDA(cudaGetLastError());
    return;
  }
  const unsigned blocks = static_cast<unsigned>((rows + 7) / 8);
  withPairsPerLane(cols, "plm::gpu::layerNormForward: ", [&](auto J) {
    forwardKernel<NX, decltype(J)::value>
        <<<blocks, 256, 0, stream>>>(xs, gamma, beta, ys, mean, rstd, rows, cols, eps);
  });
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
  if (tileable(cols, xs, {gamma, beta}, {ys})) {
    withForwardTile(cols, [&](auto R, auto V) {
      launchForwardFp8(forwardFp8TileKernel<NX, decltype(R)::value, decltype(V)::value>, stream, xs,
                       gamma, beta, ys, mean, rstd, rows, cols, eps, q);
    });
    PLM_CHECK_CUDA(cudaGetLastError());
    return;
  }
  withPairsPerLane(cols, where, [&](auto J) {
    launchForwardFp8(forwardFp8Kernel<NX, decltype(J)::value>, stream, xs, gamma, beta, ys, mean,
                     rstd, rows, cols, eps, q);
  });
  PLM_CHECK_CUDA(cudaGetLastError());
}

std::size_t layerNormBackwardWorkspace(std::int64_t rows, int cols) {
  int blocks = backwardBlocks(rows);
  if (rows > 0 && cols % 4 == 0 && cols > 0 && cols <= kMaxCols)
    blocks = std::max(blocks, backwardTileBlocks(rows, cols));
  return static_cast<std::size_t>(blocks) * 2 * cols * sizeof(float);
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
  if (tileable(cols, xs, {gamma, residual, partial}, {dys, dxs}) && aligned(dys, 4 * sizeof(NDY))) {
    const int blocks = backwardTileBlocks(rows, cols, backwardBlocksPerSm<NDY>());
    withBackwardTile(cols, [&](auto R, auto V) {
      constexpr int G = kWarps / decltype(R)::value;
      backwardTileKernel<NX, NDY, decltype(R)::value, decltype(V)::value>
          <<<blocks, kThreads, G * 2 * cols * sizeof(float), stream>>>(
              dys, xs, gamma, mean, rstd, residual, accumulate, dxs, partial, rows, cols);
    });
    PLM_CHECK_CUDA(cudaGetLastError());
    reducePartialsKernel<<<(2 * cols + 31) / 32, kThreads, 0, stream>>>(partial, blocks, cols,
                                                                        dgamma, dbeta);
    PLM_CHECK_CUDA(cudaGetLastError());
    return;
  }
  const int blocks = backwardBlocks(rows);
  withPairsPerLane(cols, "plm::gpu::layerNormBackward: ", [&](auto J) {
    launchBackward<NX, NDY, decltype(J)::value>(stream, dys, xs, gamma, mean, rstd, residual,
                                                accumulate, dxs, partial, rows, cols, blocks);
  });
  PLM_CHECK_CUDA(cudaGetLastError());
  reducePartialsKernel<<<(2 * cols + 31) / 32, kThreads, 0, stream>>>(partial, blocks, cols, dgamma,
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
