// FP8 casts (fp8.hpp): one pass over the input per tile, both layouts written from a shared-memory
// tile, amaxes reduced as integer maxima of |x|'s bit pattern (exact, order-free).
//
// Per-tensor cast: a grid of as many blocks as fit on the device at once striding over 64x128
// tiles, 16-byte loads, 8 codes per store of both copies; the transposed copy is written from
// the tile of codes in shared memory, each 64-byte run of its rows whole (castKernel says how).
// Block cast: 128x128 tiles (one 128x128 block, 128 1x128 row blocks and 128 128x1 column
// blocks) held in registers, so that the block amaxes and the codes come from one read of
// global memory (blockCastKernel says how).  Inputs are templated on their type: bf16 stays
// packed in registers.  Every kernel converts two values per instruction (the instruction the
// one-value intrinsic issues too).
#include "gpu/fp8.hpp"

#include "core/error.hpp"

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cfloat>
#include <string>

namespace plm::gpu {

namespace {

bool isFp8(DType t) { return t == DType::E4M3 || t == DType::E5M2; }

void checkCastTypes(const char* what, DType in_type, DType out_type) {
  if (in_type != DType::BF16 && in_type != DType::F32)
    throw Error(std::string("plm::gpu::") + what +
                ": the input must be bf16 or fp32 (got an FP8 tensor); cast from the "
                "higher-precision tensor");
  if (!isFp8(out_type))
    throw Error(std::string("plm::gpu::") + what + ": the output type must be E4M3 or E5M2");
}

__device__ __forceinline__ float loadIn(const void* p, bool bf16, std::int64_t i) {
  return bf16 ? __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i])
              : static_cast<const float*>(p)[i];
}

// Four consecutive inputs from element i; `vec`: one 8-byte (bf16) or 16-byte (fp32) load.
__device__ __forceinline__ void load4(const void* p, bool bf16, bool vec, std::int64_t i,
                                      float v[4]) {
  if (vec && bf16) {
    const uint2 w = *reinterpret_cast<const uint2*>(static_cast<const __nv_bfloat16*>(p) + i);
    v[0] = __uint_as_float(w.x << 16);
    v[1] = __uint_as_float(w.x & 0xffff0000u);
    v[2] = __uint_as_float(w.y << 16);
    v[3] = __uint_as_float(w.y & 0xffff0000u);
  } else if (vec) {
    const float4 w = *reinterpret_cast<const float4*>(static_cast<const float*>(p) + i);
    v[0] = w.x, v[1] = w.y, v[2] = w.z, v[3] = w.w;
  } else {
    for (int j = 0; j < 4; ++j) v[j] = loadIn(p, bf16, i + j);
  }
}

// |x| as ordered unsigned bits: finite < inf < NaN.
__device__ __forceinline__ unsigned absBits(float x) { return __float_as_uint(x) & 0x7fffffffu; }

// Block maximum, then one atomic per block (one atomic per warp put 245,760 atomics on the one
// address of the amax of a (24576, 5120) cast).  Every thread of the block must call it (it
// synchronises).
template <int kBlockSize>
__device__ __forceinline__ void amaxCommitBlock(unsigned bits, float* amax) {
  __shared__ unsigned warp_max[kBlockSize / 32];
  bits = __reduce_max_sync(0xffffffffu, bits);
  if ((threadIdx.x & 31u) == 0) warp_max[threadIdx.x / 32] = bits;
  __syncthreads();
  if (threadIdx.x < 32) {
    bits = threadIdx.x < kBlockSize / 32 ? warp_max[threadIdx.x] : 0u;
    bits = __reduce_max_sync(0xffffffffu, bits);
    if (threadIdx.x == 0 && bits != 0) atomicMax(reinterpret_cast<unsigned*>(amax), bits);
  }
}

// ---------------------------------------------------------------------------------------------
// Inputs in registers

// N (4 or 8) consecutive inputs of one row, kept as loaded (bf16: N / 2 32-bit words, half the
// registers of floats) and widened where used; an element outside the tensor is +0.
template <class In, int N> struct Vec;

template <int N> struct Vec<__nv_bfloat16, N> {
  unsigned w[N / 2];
  // Widened at each use: volatile, so that the compiler keeps the packed words rather than
  // hoisting 2N floats across the kernel (which spilled the block cast at 3 blocks per
  // multiprocessor; this way it fits 4 in 64 registers).
  __device__ __forceinline__ float operator[](int j) const {
    unsigned u;
    if (j % 2)
      asm volatile("and.b32 %0, %1, 0xffff0000;" : "=r"(u) : "r"(w[j / 2]));
    else
      asm volatile("shl.b32 %0, %1, 16;" : "=r"(u) : "r"(w[j / 2]));
    return __uint_as_float(u);
  }
  // x must be a bf16 value (the GELU's output is).
  __device__ __forceinline__ void set(int j, float x) {
    const unsigned b = __float_as_uint(x);
    w[j / 2] =
        j % 2 ? (w[j / 2] & 0xffffu) | (b & 0xffff0000u) : (w[j / 2] & 0xffff0000u) | (b >> 16);
  }
  // One 8- or 16-byte load (p aligned to it).
  __device__ __forceinline__ void load(const __nv_bfloat16* p) {
    if constexpr (N == 8) {
      const uint4 v = *reinterpret_cast<const uint4*>(p);
      w[0] = v.x, w[1] = v.y, w[2] = v.z, w[3] = v.w;
    } else {
      const uint2 v = *reinterpret_cast<const uint2*>(p);
      w[0] = v.x, w[1] = v.y;
    }
  }
  // N / 4 8-byte loads (p 8-byte aligned).
  __device__ __forceinline__ void loadHalves(const __nv_bfloat16* p) {
#pragma unroll
    for (int k = 0; k < N / 4; ++k) {
      const uint2 v = *reinterpret_cast<const uint2*>(p + 4 * k);
      w[2 * k] = v.x, w[2 * k + 1] = v.y;
    }
  }
  // The first n (may be <= 0) elements one by one, the rest +0.
  __device__ __forceinline__ void loadPartial(const __nv_bfloat16* p, std::int64_t n) {
    const auto* h = reinterpret_cast<const unsigned short*>(p);
#pragma unroll
    for (int k = 0; k < N / 2; ++k)
      w[k] = (2 * k < n ? unsigned(h[2 * k]) : 0u) |
             (2 * k + 1 < n ? unsigned(h[2 * k + 1]) << 16 : 0u);
  }
};

template <int N> struct Vec<float, N> {
  float v[N];
  __device__ __forceinline__ float operator[](int j) const { return v[j]; }
  __device__ __forceinline__ void set(int j, float x) { v[j] = x; }
  // One or two 16-byte loads (p 16-byte aligned).
  __device__ __forceinline__ void load(const float* p) {
#pragma unroll
    for (int k = 0; k < N / 4; ++k) {
      const float4 a = *reinterpret_cast<const float4*>(p + 4 * k);
      v[4 * k] = a.x, v[4 * k + 1] = a.y, v[4 * k + 2] = a.z, v[4 * k + 3] = a.w;
    }
  }
  __device__ __forceinline__ void loadHalves(const float* p) { loadPartial(p, N); }
  __device__ __forceinline__ void loadPartial(const float* p, std::int64_t n) {
#pragma unroll
    for (int j = 0; j < N; ++j) v[j] = j < n ? p[j] : 0.0f;
  }
};

// Codes of a and b (a in the low byte).  The pair conversion is the instruction that
// __nv_cvt_float_to_fp8 issues for one value (cvt.rn.satfinite.{e4m3,e5m2}x2.f32): the same
// codes, half the conversions.
__device__ __forceinline__ std::uint32_t encodePair(float a, float b, bool e4m3) {
  return __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, e4m3 ? __NV_E4M3 : __NV_E5M2);
}

// Codes of x[j0..j0+3] * scale as one word (element j0 in the low byte).
template <class V>
__device__ __forceinline__ std::uint32_t encode4(const V& x, int j0, float scale, bool e4m3) {
  return encodePair(x[j0] * scale, x[j0 + 1] * scale, e4m3) |
         encodePair(x[j0 + 2] * scale, x[j0 + 3] * scale, e4m3) << 16;
}

// bf16 bits of two values that are bf16 already (low half: a).
__device__ __forceinline__ std::uint32_t bf16Pair(float a, float b) {
  return (__float_as_uint(a) >> 16) | (__float_as_uint(b) & 0xffff0000u);
}

// ---------------------------------------------------------------------------------------------
// Per-tensor cast

constexpr int kTile = 64;       // rows of a tile, and of a column-sum partial
constexpr int kTileCols = 128;  // columns of a tile
constexpr int kThreads = 256;
constexpr int kGroups = kTileCols / 8;            // 8-column groups of a row (16)
constexpr int kRowStep = kThreads / kGroups;      // 16: a thread's rows are q + 16 i
constexpr int kRowsPerThread = kTile / kRowStep;  // 4
constexpr int kTileLd = kTileCols + 4;            // bytes per row of the code tile

struct CastParams {
  std::int64_t rows, cols;
  const void* in;
  std::int64_t ld_in;
  bool e4m3;
  std::uint8_t* out;
  std::int64_t ld_out;
  bool in_vec;    // 8-element loads allowed (16-byte aligned base and row stride)
  bool in_half;   // bf16: 4-element loads allowed (8-byte aligned)
  bool out_vec;   // 8-code stores allowed
  bool out_word;  // 4-code stores allowed
  std::uint8_t* out_t;
  std::int64_t ld_out_t;
  bool out_t_vec;   // 8-code stores allowed
  bool out_t_word;  // 4-code stores allowed
  const float* scale;
  float* scale_inv;
  float* amax;
  float* col_partial;  // (row tiles, cols) or nullptr
  bool gelu;
  __nv_bfloat16* gelu_out;
  std::int64_t ld_gelu_out;
  bool gelu_vec;  // 8-value stores allowed
  std::int64_t col_tiles, tiles;
};

__device__ __forceinline__ float geluTanhBf16(float x) {
  const float c = 0.7978845608028654f;  // sqrt(2/pi), as gemm.cu's reference
  return __bfloat162float(
      __float2bfloat16_rn(0.5f * x * (1.0f + tanhf(c * (x + 0.044715f * x * x * x)))));
}

// Grid-stride over 64x128 tiles (row tiles outer), 256 threads: thread (q, g) holds rows
// q, q + 16, q + 32, q + 48 of the tile at columns 8g..8g+7, loaded with one 16-byte load per
// row (two for fp32), 64 bytes in flight per thread.  Codes of `out` go from registers to global
// memory 8 per store; all codes also go to a byte tile in shared memory (conflict-free word
// stores), from which out_t's rows (the tile's columns) are written 8 consecutive codes per
// store, eight threads per 64-byte run (word loads and byte permutes, not byte loads).  Column
// sums: a thread's 4 rows in order, then the 16 row groups in order (the fixed order of the
// 64-row partials that colSumKernel adds up).  amax: one atomic per block, after its last tile.
// bf16 inputs stay packed in registers (16 registers for the 32 values), so that four blocks
// fit on a multiprocessor.
template <class In> __global__ void __launch_bounds__(kThreads, sizeof(In) == 2 ? 4 : 2)
    castKernel(CastParams p) {
  __shared__ __align__(16) std::uint8_t tile[kTile][kTileLd];
  __shared__ __align__(16) float red[kRowStep][kTileCols];
  const int g = threadIdx.x % kGroups, q = threadIdx.x / kGroups;
  const float scale = *p.scale;
  if (p.scale_inv && blockIdx.x == 0 && threadIdx.x == 0) *p.scale_inv = 1.0f / scale;
  const In* in = static_cast<const In*>(p.in);
  unsigned amax_bits = 0;
  for (std::int64_t t = blockIdx.x; t < p.tiles; t += gridDim.x) {
    const std::int64_t rt = t / p.col_tiles;
    const std::int64_t r0 = rt * kTile, c0 = (t % p.col_tiles) * kTileCols;
    const std::int64_t c = c0 + 8 * g;
    const bool full_cols = c + 7 < p.cols;
    // All loads first (independent, in flight together).
    Vec<In, 8> x[kRowsPerThread];
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
      const std::int64_t r = r0 + q + kRowStep * i;
      if (r < p.rows && full_cols && p.in_vec)
        x[i].load(in + r * p.ld_in + c);
      else if (r < p.rows && full_cols && p.in_half)
        x[i].loadHalves(in + r * p.ld_in + c);
      else
        x[i].loadPartial(in + (r < p.rows ? r : 0) * p.ld_in + c, r < p.rows ? p.cols - c : 0);
    }
    if (p.gelu) {  // +0 outside the tensor stays +0
#pragma unroll
      for (int i = 0; i < kRowsPerThread; ++i) {
#pragma unroll
        for (int j = 0; j < 8; ++j) x[i].set(j, geluTanhBf16(x[i][j]));
        const std::int64_t r = r0 + q + kRowStep * i;
        if (p.gelu_out && r < p.rows) {
          __nv_bfloat16* dst = p.gelu_out + r * p.ld_gelu_out + c;
          if (full_cols && p.gelu_vec) {
            *reinterpret_cast<uint4*>(dst) =
                make_uint4(bf16Pair(x[i][0], x[i][1]), bf16Pair(x[i][2], x[i][3]),
                           bf16Pair(x[i][4], x[i][5]), bf16Pair(x[i][6], x[i][7]));
          } else {
#pragma unroll
            for (int j = 0; j < 8; ++j)
              if (c + j < p.cols) dst[j] = __float2bfloat16_rn(x[i][j]);
          }
        }
      }
    }
    if (p.col_partial) {
      float sum[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        sum[j] = 0.0f;
#pragma unroll
        for (int i = 0; i < kRowsPerThread; ++i) sum[j] += x[i][j];
      }
      *reinterpret_cast<float4*>(&red[q][8 * g]) = make_float4(sum[0], sum[1], sum[2], sum[3]);
      *reinterpret_cast<float4*>(&red[q][8 * g + 4]) = make_float4(sum[4], sum[5], sum[6], sum[7]);
    }
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
      const int lr = q + kRowStep * i;
      const std::int64_t r = r0 + lr;
#pragma unroll
      for (int j = 0; j < 8; ++j) amax_bits = max(amax_bits, absBits(x[i][j]));
      const std::uint32_t lo = encode4(x[i], 0, scale, p.e4m3);
      const std::uint32_t hi = encode4(x[i], 4, scale, p.e4m3);
      *reinterpret_cast<std::uint32_t*>(&tile[lr][8 * g]) = lo;
      *reinterpret_cast<std::uint32_t*>(&tile[lr][8 * g + 4]) = hi;
      if (p.out && r < p.rows) {
        std::uint8_t* dst = p.out + r * p.ld_out + c;
        if (full_cols && p.out_vec) {
          *reinterpret_cast<uint2*>(dst) = make_uint2(lo, hi);
        } else if (full_cols && p.out_word) {
          reinterpret_cast<std::uint32_t*>(dst)[0] = lo;
          reinterpret_cast<std::uint32_t*>(dst)[1] = hi;
        } else {
#pragma unroll
          for (int j = 0; j < 8; ++j)
            if (c + j < p.cols)
              dst[j] = static_cast<std::uint8_t>((j < 4 ? lo : hi) >> (8 * (j % 4)));
        }
      }
    }
    __syncthreads();
    if (p.col_partial && threadIdx.x < kTileCols && c0 + threadIdx.x < p.cols) {
      float sum = 0.0f;
#pragma unroll
      for (int k = 0; k < kRowStep; ++k) sum += red[k][threadIdx.x];
      p.col_partial[rt * p.cols + c0 + threadIdx.x] = sum;
    }
    if (p.out_t) {
      // Thread (quad, piece): tile columns 4 quad..4 quad+3, rows 8 piece..8 piece+7.  Eight
      // words of the code tile (four columns each) are transposed by byte permutes into eight
      // codes of each column, one 8-byte store per out_t row; the 8 threads of a quad write each
      // of its rows' 64-byte runs whole.
      const int piece = threadIdx.x % 8, quad = threadIdx.x / 8;
      const std::int64_t r = r0 + 8 * piece;
      std::uint32_t w[8];
#pragma unroll
      for (int m = 0; m < 8; ++m)
        w[m] = *reinterpret_cast<const std::uint32_t*>(&tile[8 * piece + m][4 * quad]);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const std::int64_t col = c0 + 4 * quad + e;
        if (col >= p.cols || r >= p.rows) continue;
        const unsigned sel = e | (e + 4) << 4;  // byte e of each of two words
        const std::uint32_t lo =
            __byte_perm(__byte_perm(w[0], w[1], sel), __byte_perm(w[2], w[3], sel), 0x5410);
        const std::uint32_t hi =
            __byte_perm(__byte_perm(w[4], w[5], sel), __byte_perm(w[6], w[7], sel), 0x5410);
        std::uint8_t* dst = p.out_t + col * p.ld_out_t + r;
        if (p.out_t_vec && r + 7 < p.rows) {
          *reinterpret_cast<uint2*>(dst) = make_uint2(lo, hi);
        } else if (p.out_t_word && r + 7 < p.rows) {
          reinterpret_cast<std::uint32_t*>(dst)[0] = lo;
          reinterpret_cast<std::uint32_t*>(dst)[1] = hi;
        } else {
#pragma unroll
          for (int b = 0; b < 8; ++b)
            if (r + b < p.rows)
              dst[b] = static_cast<std::uint8_t>((b < 4 ? lo : hi) >> (8 * (b % 4)));
        }
      }
    }
    __syncthreads();  // the tiles are the next tile's
  }
  if (p.amax) amaxCommitBlock<kThreads>(amax_bits, p.amax);  // p.amax: the same in every thread
}

// max |x| of a strided tensor: blocks stride over rows, threads over columns, four elements per
// thread and step (vector loads where aligned).
__global__ void __launch_bounds__(kThreads)
    amaxKernel(const void* in, bool in_bf16, std::int64_t rows, std::int64_t cols, std::int64_t ld,
               float* amax) {
  unsigned bits = 0;
  const std::size_t align = in_bf16 ? 8 : 16;
  const bool vec = reinterpret_cast<std::uintptr_t>(in) % align == 0 && ld % 4 == 0;
  for (std::int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const std::int64_t base = r * ld;
    for (std::int64_t c = 4 * static_cast<std::int64_t>(threadIdx.x); c < cols;
         c += 4 * static_cast<std::int64_t>(blockDim.x)) {
      float v[4];
      if (c + 3 < cols) {
        load4(in, in_bf16, vec, base + c, v);
      } else {
        for (int j = 0; j < 4; ++j) v[j] = c + j < cols ? loadIn(in, in_bf16, base + c + j) : 0.0f;
      }
      for (int j = 0; j < 4; ++j) bits = max(bits, absBits(v[j]));
    }
  }
  amaxCommitBlock<kThreads>(bits, amax);
}

// max |bits| of the 8 bf16 or 4 fp32 values in a 16-byte chunk.
__device__ __forceinline__ unsigned chunkBits(uint4 v, bool in_bf16) {
  if (in_bf16) {
    const unsigned a = max(max(v.x & 0x7fffu, v.y & 0x7fffu), max(v.z & 0x7fffu, v.w & 0x7fffu));
    const unsigned b =
        max(max(v.x & 0x7fff0000u, v.y & 0x7fff0000u), max(v.z & 0x7fff0000u, v.w & 0x7fff0000u));
    return max(a << 16, b);
  }
  return max(max(v.x & 0x7fffffffu, v.y & 0x7fffffffu), max(v.z & 0x7fffffffu, v.w & 0x7fffffffu));
}

// max |x| of a contiguous, 16-byte aligned tensor: grid-stride over 16-byte chunks, four loads
// in flight per thread and step; the last n % (elements per chunk) elements by block 0.
__global__ void __launch_bounds__(kThreads)
    amaxFlatKernel(const uint4* in, std::int64_t chunks, const void* tail, int tail_n, bool in_bf16,
                   float* amax) {
  unsigned bits = 0;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * kThreads;
  std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  for (; i + 3 * stride < chunks; i += 4 * stride) {
    uint4 v[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) v[u] = in[i + u * stride];
#pragma unroll
    for (int u = 0; u < 4; ++u) bits = max(bits, chunkBits(v[u], in_bf16));
  }
  for (; i < chunks; i += stride) bits = max(bits, chunkBits(in[i], in_bf16));
  if (blockIdx.x == 0 && static_cast<int>(threadIdx.x) < tail_n)
    bits = max(bits, absBits(loadIn(tail, in_bf16, threadIdx.x)));
  amaxCommitBlock<kThreads>(bits, amax);
}

// col_sum[c] (=, or +=) the partial sums of the row tiles: kSumParts contiguous runs of tiles,
// each summed in tile order by its own thread, then the runs in order (a fixed order: the same
// bits on every run).  One thread per column walking all 384 tiles of 24,576 tokens left a
// 1280-column cast with 5 blocks and 40 us of dependent loads.
constexpr int kSumCols = 32;
constexpr int kSumParts = 16;
__global__ void __launch_bounds__(kSumCols* kSumParts)
    colSumKernel(const float* partial, std::int64_t tiles, std::int64_t cols, float* col_sum,
                 bool accumulate) {
  __shared__ float part[kSumParts][kSumCols];
  const int tx = threadIdx.x % kSumCols, ty = threadIdx.x / kSumCols;
  const std::int64_t c = blockIdx.x * static_cast<std::int64_t>(kSumCols) + tx;
  const std::int64_t per = (tiles + kSumParts - 1) / kSumParts;
  const std::int64_t t0 = ty * per, t1 = t0 + per < tiles ? t0 + per : tiles;
  float sum = 0.0f;
  if (c < cols)
    for (std::int64_t t = t0; t < t1; ++t) sum += partial[t * cols + c];
  part[ty][tx] = sum;
  __syncthreads();
  if (ty != 0 || c >= cols) return;
  float total = 0.0f;
  for (int k = 0; k < kSumParts; ++k) total += part[k][tx];
  col_sum[c] = accumulate ? col_sum[c] + total : total;
}

__global__ void scaleInvKernel(const float* scale, float* scale_inv) { *scale_inv = 1.0f / *scale; }

__global__ void scaleFromAmaxKernel(const float* amax, float fp8_max, int margin, float* scale,
                                    float* scale_inv) {
  const float a = *amax;
  float s = 1.0f;
  if (a > 0.0f && isfinite(a)) {
    s = ldexpf(fp8_max / a, -margin);
    if (isinf(s)) s = FLT_MAX;
  }
  *scale = s;
  if (scale_inv) *scale_inv = 1.0f / s;
}

// ---------------------------------------------------------------------------------------------
// Block cast

constexpr int kBlock = 128;
constexpr int kBlockThreads = 256;
constexpr int kBlockWarps = kBlockThreads / 32;
constexpr int kBlockRows = kBlock / kBlockWarps;  // rows of the tile per warp (16)
constexpr int kBlockLdT = kBlock + 4;             // bytes per row of the transposed code tile

struct BlockParams {
  std::int64_t rows, cols;
  const void* in;
  std::int64_t ld_in;
  bool in_vec;  // 4-element loads allowed (aligned base and row stride)
  bool e4m3;
  float fp8_max;
  bool square;  // 128x128 blocks (else 1x128)
  std::uint8_t* out;
  std::int64_t ld_out;
  bool out_vec;
  float* scale_inv;
  std::int64_t sld;       // blockScaleLayout(...).ld of out's scales (of the body's with a tail)
  std::int64_t out_rows;  // rows of out written (rows, or body + 8 with a tail: zero codes)
  std::int64_t tail;      // split_tail: the body's rows, where the tail's 8 rows start; else -1
  std::int64_t tail_scales;
  std::uint8_t* out_t;
  std::int64_t ld_out_t;
  bool out_t_vec;
  float* scale_inv_t;
  std::int64_t sld_t;
  float* amax;
  float* col_partial;
  bool gelu;
  __nv_bfloat16* gelu_out;
  std::int64_t ld_gelu_out;
  bool gelu_vec;  // 4-value stores allowed
};

// Transformer Engine's power-of-two scale from a block amax (bits of |x|).
__device__ __forceinline__ float pow2Scale(unsigned amax_bits, float fp8_max) {
  const float a = __uint_as_float(amax_bits);
  if (amax_bits == 0 || amax_bits >= 0x7f800000u) return 1.0f;
  const float s = fp8_max / a;
  if (isinf(s)) return 0x1p127f;
  return __uint_as_float(__float_as_uint(s) & 0xff800000u);
}

// One 128x128 tile per thread block, held in registers: warp w has rows 16w..16w+15 of the tile,
// lane l columns 4l..4l+3 (one 8- or 16-byte load per row, 16 in flight per thread; bf16 kept
// packed, 32 registers for the 64 values, so that four blocks fit on a multiprocessor and one
// block's loads overlap another's codes).  A row's amax (its 1x128 block) is a warp reduction;
// a column's (its 128x1 block) the maximum of the 8 warps' partials in shared memory, as are the
// column sums (16 rows per warp in order, then the warps in order: fixed, deterministic).  The
// 128 row and 128 column scales (a division each) are computed once per tile, one per thread,
// into shared memory.  The codes of `out` go straight from registers
// to global memory, 4 per store; those of `out_t` through a byte tile in shared memory, so that
// each row of out_t is written as 128 consecutive bytes.  Codes are converted two at a time.
template <class In> __global__ void __launch_bounds__(kBlockThreads, sizeof(In) == 2 ? 4 : 2)
    blockCastKernel(BlockParams p) {
  __shared__ unsigned col_part[kBlockWarps][kBlock];
  __shared__ float sum_part[kBlockWarps][kBlock];
  __shared__ float col_scale[kBlock];
  __shared__ unsigned row_bits[kBlock];
  __shared__ float row_scale[kBlock];
  __shared__ unsigned warp_bits[kBlockWarps];
  __shared__ __align__(16) std::uint8_t tile_t[kBlock][kBlockLdT];  // [column][row] codes
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const std::int64_t r0 = static_cast<std::int64_t>(blockIdx.y) * kBlock;
  const std::int64_t c0 = static_cast<std::int64_t>(blockIdx.x) * kBlock;
  const std::int64_t rw = r0 + warp * kBlockRows;  // this warp's first row
  const std::int64_t cl = c0 + 4 * lane;           // this lane's first column
  const bool full_cols = cl + 3 < p.cols;
  const In* in = static_cast<const In*>(p.in);

  // Loads, all in flight together.  Padding outside the tensor is +0.
  Vec<In, 4> v[kBlockRows];
#pragma unroll
  for (int i = 0; i < kBlockRows; ++i) {
    const std::int64_t r = rw + i;
    if (r < p.rows && full_cols && p.in_vec)
      v[i].load(in + r * p.ld_in + cl);
    else
      v[i].loadPartial(in + (r < p.rows ? r : 0) * p.ld_in + cl, r < p.rows ? p.cols - cl : 0);
  }
  if (p.gelu) {  // castKernel's GELU, element for element: the same bf16 values (+0 stays +0)
#pragma unroll
    for (int i = 0; i < kBlockRows; ++i) {
#pragma unroll
      for (int j = 0; j < 4; ++j) v[i].set(j, geluTanhBf16(v[i][j]));
      const std::int64_t r = rw + i;
      if (p.gelu_out && r < p.rows) {
        __nv_bfloat16* dst = p.gelu_out + r * p.ld_gelu_out + cl;
        if (full_cols && p.gelu_vec) {
          *reinterpret_cast<uint2*>(dst) =
              make_uint2(bf16Pair(v[i][0], v[i][1]), bf16Pair(v[i][2], v[i][3]));
        } else {
#pragma unroll
          for (int j = 0; j < 4; ++j)
            if (cl + j < p.cols) dst[j] = __float2bfloat16_rn(v[i][j]);
        }
      }
    }
  }
  // Row amaxes, column partials and sums over this warp's rows.
  unsigned tile_bits = 0;
#pragma unroll
  for (int i = 0; i < kBlockRows; ++i) {
    unsigned b =
        max(max(absBits(v[i][0]), absBits(v[i][1])), max(absBits(v[i][2]), absBits(v[i][3])));
    b = __reduce_max_sync(0xffffffffu, b);
    if (lane == 0) row_bits[warp * kBlockRows + i] = b;
    tile_bits = max(tile_bits, b);
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    unsigned b = 0;
    float sum = 0.0f;
#pragma unroll
    for (int i = 0; i < kBlockRows; ++i) {
      b = max(b, absBits(v[i][j]));
      sum += v[i][j];
    }
    col_part[warp][4 * lane + j] = b;
    sum_part[warp][4 * lane + j] = sum;
  }
  if (lane == 0) warp_bits[warp] = tile_bits;
  __syncthreads();
  tile_bits = 0;
#pragma unroll
  for (int w = 0; w < kBlockWarps; ++w) tile_bits = max(tile_bits, warp_bits[w]);
  if (threadIdx.x < kBlock) {
    const int c = threadIdx.x;
    unsigned b = 0;
    float sum = 0.0f;
#pragma unroll
    for (int w = 0; w < kBlockWarps; ++w) {
      b = max(b, col_part[w][c]);
      sum += sum_part[w][c];
    }
    col_scale[c] = pow2Scale(p.square ? tile_bits : b, p.fp8_max);
    row_scale[c] = pow2Scale(row_bits[c], p.fp8_max);
    if (p.col_partial && c0 + c < p.cols) p.col_partial[blockIdx.y * p.cols + c0 + c] = sum;
  }
  if (p.amax && threadIdx.x == 0 && tile_bits != 0)
    atomicMax(reinterpret_cast<unsigned*>(p.amax), tile_bits);
  __syncthreads();

  // Scale factors (scale_inv), with the layout's padding written as 1.
  const std::int64_t rb = blockIdx.y, cb = blockIdx.x;
  if (p.square) {
    if (threadIdx.x == 0) {
      const float inv = 1.0f / col_scale[0];
      if (p.out) {
        p.scale_inv[rb * p.sld + cb] = inv;
        if (cb == gridDim.x - 1)
          for (std::int64_t k = cb + 1; k < p.sld; ++k) p.scale_inv[rb * p.sld + k] = 1.0f;
      }
      if (p.out_t) {
        p.scale_inv_t[cb * p.sld_t + rb] = inv;
        if (rb == gridDim.y - 1)
          for (std::int64_t k = rb + 1; k < p.sld_t; ++k) p.scale_inv_t[cb * p.sld_t + k] = 1.0f;
      }
    }
  } else {
    // out: K = cols, its 1x128 block index is cb; lane i writes row rw + i (padding rows up to
    // sld; with a tail, its 8 rows in their own layout after the body's).
    if (p.out && lane < kBlockRows) {
      const std::int64_t r = rw + lane;
      const float inv = r < p.rows ? 1.0f / row_scale[warp * kBlockRows + lane] : 1.0f;
      if (r < p.sld) {
        p.scale_inv[cb * p.sld + r] = inv;
      } else if (p.tail >= 0 && r < p.tail + 8) {
        p.scale_inv[p.tail_scales + cb * 8 + (r - p.tail)] = inv;
      }
    }
    // out_t: rows of out_t are the columns c0 + t, K = rows, block index rb.
    if (p.out_t && threadIdx.x < kBlock && c0 + threadIdx.x < p.sld_t)
      p.scale_inv_t[rb * p.sld_t + c0 + threadIdx.x] =
          c0 + threadIdx.x < p.cols ? 1.0f / col_scale[threadIdx.x] : 1.0f;
  }

  // Codes of out: 4 per store, rows up to out_rows (rows past `rows` are zeros: zero codes).
  if (p.out) {
#pragma unroll
    for (int i = 0; i < kBlockRows; ++i) {
      const std::int64_t r = rw + i;
      if (r >= p.out_rows) break;
      const float s = p.square ? col_scale[0] : row_scale[warp * kBlockRows + i];
      const std::uint32_t word = encode4(v[i], 0, s, p.e4m3);
      if (p.out_vec && full_cols) {
        *reinterpret_cast<std::uint32_t*>(p.out + r * p.ld_out + cl) = word;
      } else {
        for (int j = 0; j < 4 && cl + j < p.cols; ++j)
          p.out[r * p.ld_out + cl + j] = static_cast<std::uint8_t>(word >> (8 * j));
      }
    }
  }
  if (!p.out_t) return;
    // Codes of out_t: column 4 lane + j of 4 consecutive rows as one word into the byte tile.
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float s = col_scale[4 * lane + j];
#pragma unroll
    for (int i = 0; i < kBlockRows; i += 4) {
      const std::uint32_t word = encodePair(v[i][j] * s, v[i + 1][j] * s, p.e4m3) |
                                 encodePair(v[i + 2][j] * s, v[i + 3][j] * s, p.e4m3) << 16;
      *reinterpret_cast<std::uint32_t*>(&tile_t[4 * lane + j][warp * kBlockRows + i]) = word;
    }
  }
  __syncthreads();
  // Row c of out_t (input column c0 + c): 128 codes, lane l writes input rows r0 + 4l..4l+3.
  const std::int64_t r = r0 + 4 * lane;
#pragma unroll 4
  for (int k = 0; k < kBlockRows; ++k) {
    const int c = warp * kBlockRows + k;
    if (c0 + c >= p.cols) break;
    const std::uint32_t word = *reinterpret_cast<const std::uint32_t*>(&tile_t[c][4 * lane]);
    std::uint8_t* dst = p.out_t + (c0 + c) * p.ld_out_t;
    if (p.out_t_vec && r + 3 < p.rows) {
      *reinterpret_cast<std::uint32_t*>(dst + r) = word;
    } else {
      for (int q = 0; q < 4 && r + q < p.rows; ++q)
        dst[r + q] = static_cast<std::uint8_t>(word >> (8 * q));
    }
  }
}

// One 64x64 tile per block through shared memory: rows of the input read and rows of the
// output written as consecutive bytes.
__global__ void __launch_bounds__(kThreads)
    transposeCodesKernel(const std::uint8_t* in, std::int64_t rows, std::int64_t cols,
                         std::uint8_t* out) {
  __shared__ std::uint8_t tile[kTile][kTile + 4];
  const std::int64_t r0 = static_cast<std::int64_t>(blockIdx.y) * kTile;
  const std::int64_t c0 = static_cast<std::int64_t>(blockIdx.x) * kTile;
  const int tx = threadIdx.x % kTile, ty = threadIdx.x / kTile;  // 4 rows of 64 per pass
  for (int i = ty; i < kTile; i += kThreads / kTile) {
    const std::int64_t r = r0 + i, c = c0 + tx;
    if (r < rows && c < cols) tile[i][tx] = in[r * cols + c];
  }
  __syncthreads();
  for (int i = ty; i < kTile; i += kThreads / kTile) {
    const std::int64_t c = c0 + i, r = r0 + tx;
    if (c < cols && r < rows) out[c * rows + r] = tile[tx][i];
  }
}

bool aligned4(const void* p, std::int64_t ld) {
  return p && reinterpret_cast<std::uintptr_t>(p) % 4 == 0 && ld % 4 == 0;
}

// Rows of `n`-element vectors of `elem`-byte values: the base aligned to a vector and every row
// starting on one.
bool vectorRows(const void* p, std::int64_t ld, int n, int elem) {
  return p && reinterpret_cast<std::uintptr_t>(p) % static_cast<std::uintptr_t>(n * elem) == 0 &&
         ld % n == 0;
}

int elemBytes(DType t) { return t == DType::BF16 ? 2 : 4; }

// Blocks of a kernel that fit on one multiprocessor at once.
int blocksPerSm(const void* kernel, int threads) {
  int per_sm = 0;
  PLM_CHECK_CUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, 0));
  return per_sm > 0 ? per_sm : 1;
}

// Blocks of a grid-stride kernel: as many as are resident at once, at most `tiles`.
unsigned residentGrid(int per_sm, std::int64_t tiles) {
  const std::int64_t resident = static_cast<std::int64_t>(multiprocessorCount()) * per_sm;
  return static_cast<unsigned>(tiles < resident ? tiles : resident);
}

unsigned gridDimOf(std::int64_t n, int tile) {
  return static_cast<unsigned>((n + tile - 1) / tile);
}

void checkGrid(const char* what, std::int64_t rows, int tile) {
  if ((rows + tile - 1) / tile > 65535)
    throw Error(std::string("plm::gpu::") + what + ": " + std::to_string(rows) +
                " rows exceed the kernel's grid (65535 tiles of " + std::to_string(tile) +
                "); cast the tensor in row ranges");
}

float* colPartial(const char* what, float* col_sum, void* workspace) {
  if (!col_sum) return nullptr;
  if (!workspace)
    throw Error(std::string("plm::gpu::") + what +
                ": col_sum needs a workspace of fp8ColSumWorkspace(rows, cols) bytes");
  return static_cast<float*>(workspace);
}

void finishColSum(Stream stream, float* col_sum, bool accumulate, const float* partial,
                  unsigned tiles, std::int64_t cols) {
  if (!col_sum) return;
  colSumKernel<<<static_cast<unsigned>((cols + kSumCols - 1) / kSumCols), kSumCols * kSumParts, 0,
                 stream>>>(partial, tiles, cols, col_sum, accumulate);
  PLM_CHECK_CUDA(cudaGetLastError());
}

void zeroAmax(Stream stream, float* amax, bool accumulate) {
  if (amax && !accumulate) PLM_CHECK_CUDA(cudaMemsetAsync(amax, 0, sizeof(float), stream));
}

}  // namespace

std::size_t fp8ColSumWorkspace(std::int64_t rows, std::int64_t cols) {
  // Partial sums per row tile: 64-row tiles (per-tensor casts) outnumber 128-row ones.
  return static_cast<std::size_t>((rows + kTile - 1) / kTile) * static_cast<std::size_t>(cols) *
         sizeof(float);
}

float fp8Max(DType format) {
  if (format == DType::E4M3) return 448.0f;
  if (format == DType::E5M2) return 57344.0f;
  throw Error("plm::gpu::fp8Max: not an FP8 type (E4M3 or E5M2)");
}

void castFp8(Stream stream, const Fp8CastArgs& a) {
  checkCastTypes("castFp8", a.in_type, a.out_type);
  if (!a.scale) throw Error("plm::gpu::castFp8: no scale (a device pointer to one fp32)");
  if (a.gelu_out && (!a.gelu || a.ld_gelu_out < a.cols))
    throw Error("plm::gpu::castFp8: gelu_out needs gelu and a row stride >= cols");
  zeroAmax(stream, a.amax, a.amax_accumulate);
  if (a.rows == 0 || a.cols == 0) {
    if (a.col_sum && !a.col_sum_accumulate && a.cols > 0)
      PLM_CHECK_CUDA(cudaMemsetAsync(a.col_sum, 0, a.cols * sizeof(float), stream));
    if (a.scale_inv) {  // still published: a GEMM after an empty cast reads it
      scaleInvKernel<<<1, 1, 0, stream>>>(a.scale, a.scale_inv);
      PLM_CHECK_CUDA(cudaGetLastError());
    }
    return;
  }
  const bool bf16 = a.in_type == DType::BF16;
  CastParams p{a.rows,
               a.cols,
               a.in,
               a.ld_in,
               a.out_type == DType::E4M3,
               static_cast<std::uint8_t*>(a.out),
               a.ld_out,
               bf16 ? vectorRows(a.in, a.ld_in, 8, 2) : vectorRows(a.in, a.ld_in, 4, 4),
               bf16 && vectorRows(a.in, a.ld_in, 4, 2),
               vectorRows(a.out, a.ld_out, 8, 1),
               vectorRows(a.out, a.ld_out, 4, 1),
               static_cast<std::uint8_t*>(a.out_t),
               a.ld_out_t,
               vectorRows(a.out_t, a.ld_out_t, 8, 1),
               vectorRows(a.out_t, a.ld_out_t, 4, 1),
               a.scale,
               a.scale_inv,
               a.amax,
               colPartial("castFp8", a.col_sum, a.workspace),
               a.gelu,
               static_cast<__nv_bfloat16*>(a.gelu_out),
               a.ld_gelu_out,
               vectorRows(a.gelu_out, a.ld_gelu_out, 8, 2),
               (a.cols + kTileCols - 1) / kTileCols,
               0};
  p.tiles = p.col_tiles * ((a.rows + kTile - 1) / kTile);
  // Occupancy of each instantiation, asked once (it depends on the architecture alone).
  static const int per_sm_bf16 =
      blocksPerSm(reinterpret_cast<const void*>(castKernel<__nv_bfloat16>), kThreads);
  static const int per_sm_f32 =
      blocksPerSm(reinterpret_cast<const void*>(castKernel<float>), kThreads);
  const unsigned blocks = residentGrid(bf16 ? per_sm_bf16 : per_sm_f32, p.tiles);
  if (bf16)
    castKernel<__nv_bfloat16><<<blocks, kThreads, 0, stream>>>(p);
  else
    castKernel<float><<<blocks, kThreads, 0, stream>>>(p);
  PLM_CHECK_CUDA(cudaGetLastError());
  finishColSum(stream, a.col_sum, a.col_sum_accumulate, p.col_partial, gridDimOf(a.rows, kTile),
               a.cols);
}

void amaxFp8(Stream stream, const void* in, DType in_type, std::int64_t rows, std::int64_t cols,
             std::int64_t ld, float* amax, bool accumulate) {
  if (in_type != DType::BF16 && in_type != DType::F32)
    throw Error("plm::gpu::amaxFp8: the input must be bf16 or fp32");
  if (!amax) throw Error("plm::gpu::amaxFp8: no amax (a device pointer to one fp32)");
  zeroAmax(stream, amax, accumulate);
  if (rows == 0 || cols == 0) return;
  const bool bf16 = in_type == DType::BF16;
  const std::int64_t sms = multiprocessorCount();
  if (ld == cols && reinterpret_cast<std::uintptr_t>(in) % 16 == 0) {
    // Contiguous: 16-byte chunks, whatever the tensor's shape.
    const int per = 16 / elemBytes(in_type);
    const std::int64_t n = rows * cols, chunks = n / per;
    const void* tail = static_cast<const std::uint8_t*>(in) + chunks * 16;
    const std::int64_t want = (chunks + kThreads - 1) / kThreads;
    const std::int64_t blocks = std::max<std::int64_t>(1, std::min(want, sms * 8));
    amaxFlatKernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
        static_cast<const uint4*>(in), chunks, tail, static_cast<int>(n % per), bf16, amax);
  } else {
    const std::int64_t blocks = std::min(rows, sms * 16);
    amaxKernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(in, bf16, rows, cols, ld,
                                                                       amax);
  }
  PLM_CHECK_CUDA(cudaGetLastError());
}

void scaleFromAmax(Stream stream, const float* amax, DType format, int margin, float* scale,
                   float* scale_inv) {
  if (!amax || !scale) throw Error("plm::gpu::scaleFromAmax: amax and scale are required");
  scaleFromAmaxKernel<<<1, 1, 0, stream>>>(amax, fp8Max(format), margin, scale, scale_inv);
  PLM_CHECK_CUDA(cudaGetLastError());
}

void castFp8Current(Stream stream, const Fp8CastArgs& args, float* scale, int margin) {
  checkCastTypes("castFp8Current", args.in_type, args.out_type);
  if (args.gelu)
    throw Error(
        "plm::gpu::castFp8Current: gelu is not offered with current scaling (its amax pass reads "
        "the pre-activation); apply the GELU first");
  if (!args.amax || !scale)
    throw Error(
        "plm::gpu::castFp8Current: current scaling needs args.amax and scale (device scalars)");
  if (args.amax_accumulate)
    throw Error(
        "plm::gpu::castFp8Current: amax_accumulate makes no sense for current scaling "
        "(the scale must come from this tensor alone)");
  amaxFp8(stream, args.in, args.in_type, args.rows, args.cols, args.ld_in, args.amax, false);
  scaleFromAmax(stream, args.amax, args.out_type, margin, scale, args.scale_inv);
  Fp8CastArgs cast = args;
  cast.scale = scale;
  cast.amax = nullptr;  // already written
  cast.scale_inv = nullptr;
  castFp8(stream, cast);
}

void transposeFp8Codes(Stream stream, const void* in, std::int64_t rows, std::int64_t cols,
                       void* out) {
  if (rows == 0 || cols == 0) return;
  checkGrid("transposeFp8Codes", rows, kTile);
  transposeCodesKernel<<<dim3(gridDimOf(cols, kTile), gridDimOf(rows, kTile)), kThreads, 0,
                         stream>>>(static_cast<const std::uint8_t*>(in), rows, cols,
                                   static_cast<std::uint8_t*>(out));
  PLM_CHECK_CUDA(cudaGetLastError());
}

BlockScaleLayout blockScaleLayout(Fp8ScaleMode scaling, std::int64_t rows, std::int64_t k) {
  auto up4 = [](std::int64_t x) { return (x + 3) / 4 * 4; };
  const std::int64_t kb = (k + kBlock - 1) / kBlock;
  switch (scaling) {
    case Fp8ScaleMode::Block1x128: return {up4(rows), up4(rows) * kb};
    case Fp8ScaleMode::Block128x128: return {up4(kb), up4(kb) * ((rows + kBlock - 1) / kBlock)};
    case Fp8ScaleMode::Tensor: return {1, 1};
  }
  return {1, 1};
}

BlockTailSplit blockTailSplit(std::int64_t rows, std::int64_t k) {
  BlockTailSplit s;
  if (rows % 8 == 0) {
    s.body = s.rows = rows;
    s.tail_scales = s.count = blockScaleLayout(Fp8ScaleMode::Block1x128, rows, k).count;
    return s;
  }
  s.body = rows / 8 * 8;
  s.rows = s.body + 8;
  s.tail_scales = (blockScaleLayout(Fp8ScaleMode::Block1x128, s.body, k).count + 63) / 64 * 64;
  s.count = s.tail_scales + blockScaleLayout(Fp8ScaleMode::Block1x128, 8, k).count;
  return s;
}

std::size_t fp8BlockTensorBytes(Fp8ScaleMode scaling, std::int64_t rows, std::int64_t cols) {
  return static_cast<std::size_t>((rows * cols + 255) / 256 * 256 +
                                  blockScaleLayout(scaling, rows, cols).count * 4);
}

void castFp8Block(Stream stream, const Fp8BlockCastArgs& a) {
  checkCastTypes("castFp8Block", a.in_type, a.out_type);
  if (a.scaling == Fp8ScaleMode::Tensor)
    throw Error(
        "plm::gpu::castFp8Block: scaling must be Block1x128 or Block128x128 (castFp8 "
        "does per-tensor scaling)");
  if ((a.out && !a.scale_inv) || (a.out_t && !a.scale_inv_t))
    throw Error(
        "plm::gpu::castFp8Block: every copy written (out, out_t) needs its scale_inv "
        "(blockScaleLayout() gives the size)");
  zeroAmax(stream, a.amax, a.amax_accumulate);
  if (a.rows == 0 || a.cols == 0) {
    if (a.col_sum && !a.col_sum_accumulate && a.cols > 0)
      PLM_CHECK_CUDA(cudaMemsetAsync(a.col_sum, 0, a.cols * sizeof(float), stream));
    return;
  }
  if (a.gelu_out && (!a.gelu || a.ld_gelu_out < a.cols))
    throw Error("plm::gpu::castFp8Block: gelu_out needs gelu and a row stride >= cols");
  checkGrid("castFp8Block", a.rows, kBlock);
  const bool tail = a.split_tail && a.out && a.rows % 8 != 0;
  if (tail && a.scaling != Fp8ScaleMode::Block1x128)
    throw Error("plm::gpu::castFp8Block: split_tail is for Block1x128 operands (the GEMM's A)");
  const BlockTailSplit split = blockTailSplit(a.rows, a.cols);
  BlockParams p{a.rows,
                a.cols,
                a.in,
                a.ld_in,
                vectorRows(a.in, a.ld_in, 4, elemBytes(a.in_type)),
                a.out_type == DType::E4M3,
                fp8Max(a.out_type),
                a.scaling == Fp8ScaleMode::Block128x128,
                static_cast<std::uint8_t*>(a.out),
                a.ld_out,
                aligned4(a.out, a.ld_out),
                a.scale_inv,
                blockScaleLayout(a.scaling, tail ? split.body : a.rows, a.cols).ld,
                tail ? split.rows : a.rows,
                tail ? split.body : -1,
                split.tail_scales,
                static_cast<std::uint8_t*>(a.out_t),
                a.ld_out_t,
                aligned4(a.out_t, a.ld_out_t),
                a.scale_inv_t,
                blockScaleLayout(a.scaling, a.cols, a.rows).ld,
                a.amax,
                colPartial("castFp8Block", a.col_sum, a.workspace),
                a.gelu,
                static_cast<__nv_bfloat16*>(a.gelu_out),
                a.ld_gelu_out,
                vectorRows(a.gelu_out, a.ld_gelu_out, 4, 2)};
  const dim3 grid(gridDimOf(a.cols, kBlock), gridDimOf(a.rows, kBlock));
  if (a.in_type == DType::BF16)
    blockCastKernel<__nv_bfloat16><<<grid, kBlockThreads, 0, stream>>>(p);
  else
    blockCastKernel<float><<<grid, kBlockThreads, 0, stream>>>(p);
  PLM_CHECK_CUDA(cudaGetLastError());
  finishColSum(stream, a.col_sum, a.col_sum_accumulate, p.col_partial, gridDimOf(a.rows, kBlock),
               a.cols);
}

}  // namespace plm::gpu
