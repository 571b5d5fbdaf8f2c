// Varlen flash attention kernels (see flash_attention.hpp for the design).
//
// Register fragments follow PTX's mma.m16n8k16 layouts: lane = 4 g + t; an accumulator tile
// (16 x 8, fp32) holds rows g and g + 8, columns 2t and 2t + 1.  Two adjacent accumulator tiles
// are, once rounded to bf16, exactly the A fragment of the next product (the FA2 trick), so P
// never leaves registers.  Shared-memory rows are padded by 8 elements (16 bytes) so ldmatrix
// and cp.async rows stay 16-byte aligned and fall on distinct banks.
#include "gpu/flash_attention.hpp"

#include "core/error.hpp"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdlib>
#include <string>

namespace plm::gpu {

namespace {

constexpr int kPad = 8;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

using bfloat = __nv_bfloat16;

__device__ __forceinline__ std::uint32_t smemAddr(const void* p) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cpAsync16(void* smem, const void* gmem, bool valid) {
  int src_size = valid ? 16 : 0;  // 0: fill the 16 bytes with zeros, read nothing
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smemAddr(smem)), "l"(gmem),
               "r"(src_size));
}
__device__ __forceinline__ void cpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void ldsm4(std::uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smemAddr(p)));
}
__device__ __forceinline__ void ldsm4t(std::uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smemAddr(p)));
}

__device__ __forceinline__ void mma(float (&c)[4], const std::uint32_t (&a)[4], std::uint32_t b0,
                                    std::uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// c = A B (the accumulator starts at zero: no registers to clear first).
__device__ __forceinline__ void mmaZero(float (&c)[4], const std::uint32_t (&a)[4],
                                        std::uint32_t b0, std::uint32_t b1) {
  const float z = 0.0f;
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%10,%10,%10,%10};\n"
      : "=f"(c[0]), "=f"(c[1]), "=f"(c[2]), "=f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(z));
}

// 2^x on the special-function unit, subnormal results flushed to zero (ex2(-inf) = 0).
__device__ __forceinline__ float fastExp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ std::uint32_t pack(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<std::uint32_t*>(&v);
}

// A fragment (16 x 16) of rows row0.., columns k0.. of a row-major tile.
__device__ __forceinline__ void loadA(std::uint32_t (&a)[4], const bfloat* tile, int ld, int row0,
                                      int k0, int lane) {
  int mi = lane >> 3, r = lane & 7;
  ldsm4(a, tile + (row0 + (mi & 1) * 8 + r) * ld + k0 + (mi >> 1) * 8);
}
// B fragments for n-tiles n0 and n0 + 8 (b[0..1], b[2..3]), k chunk k0, of a tile stored [n][k].
__device__ __forceinline__ void loadBnk(std::uint32_t (&b)[4], const bfloat* tile, int ld, int n0,
                                        int k0, int lane) {
  int mi = lane >> 3, r = lane & 7;
  ldsm4(b, tile + (n0 + (mi >> 1) * 8 + r) * ld + k0 + (mi & 1) * 8);
}
// The same from a tile stored [k][n] (transposed on the way in).
__device__ __forceinline__ void loadBkn(std::uint32_t (&b)[4], const bfloat* tile, int ld, int k0,
                                        int n0, int lane) {
  int mi = lane >> 3, r = lane & 7;
  ldsm4t(b, tile + (k0 + (mi & 1) * 8 + r) * ld + n0 + (mi >> 1) * 8);
}

// A fragment for k chunk c made of accumulator tiles 2c and 2c + 1.
template <int NT>
__device__ __forceinline__ void accToA(std::uint32_t (&a)[4], const float (&acc)[NT][4], int c) {
  a[0] = pack(acc[2 * c][0], acc[2 * c][1]);
  a[1] = pack(acc[2 * c][2], acc[2 * c][3]);
  a[2] = pack(acc[2 * c + 1][0], acc[2 * c + 1][1]);
  a[3] = pack(acc[2 * c + 1][2], acc[2 * c + 1][3]);
}

// acc (a warp's 16 x N accumulator tiles) += A (16 x K, accumulator tiles p rounded to bf16)
// times the K x N tile stored [k][n] at `tile` (leading dimension ld).  ROWSUM: also
// rowsum += A times a column of ones (every column of the tile then holds A's row sums).
template <int K, int N, bool ROWSUM = false>
__device__ __forceinline__ void mmaAccTimesTile(float (&acc)[N / 8][4], const float (&p)[K / 8][4],
                                                const bfloat* tile, int ld, int lane,
                                                float (*rowsum)[4] = nullptr) {
  constexpr std::uint32_t kOnes = 0x3F803F80u;  // two bf16 1.0
#pragma unroll
  for (int c = 0; c < K / 16; ++c) {
    std::uint32_t a[4];
    accToA<K / 8>(a, p, c);
#pragma unroll
    for (int np = 0; np < N / 16; ++np) {
      std::uint32_t b[4];
      loadBkn(b, tile, ld, c * 16, np * 16, lane);
      mma(acc[2 * np], a, b[0], b[1]);
      mma(acc[2 * np + 1], a, b[2], b[3]);
    }
    if constexpr (ROWSUM) mma(*rowsum, a, kOnes, kOnes);
  }
}

// acc (16 x 8N) = A (16 x 16K, the first K chunks of a) times B stored [n][k] at `tile`: the
// score products S = Q K^T and dP = dO V^T, the first k chunk without clearing acc.
template <int KC, int N>
__device__ __forceinline__ void mmaRowsTimesTileT(float (&acc)[N / 8][4],
                                                  const std::uint32_t (&a)[KC][4],
                                                  const bfloat* tile, int ld, int lane) {
#pragma unroll
  for (int kc = 0; kc < KC; ++kc) {
#pragma unroll
    for (int np = 0; np < N / 16; ++np) {
      std::uint32_t b[4];
      loadBnk(b, tile, ld, np * 16, kc * 16, lane);
      if (kc == 0) {
        mmaZero(acc[2 * np], a[kc], b[0], b[1]);
        mmaZero(acc[2 * np + 1], a[kc], b[2], b[3]);
      } else {
        mma(acc[2 * np], a[kc], b[0], b[1]);
        mma(acc[2 * np + 1], a[kc], b[2], b[3]);
      }
    }
  }
}

// ROWS x D tile of a (T, H, dh) tensor into shared memory; rows at or past `valid` and columns
// at or past the true head_dim dh (D is dh rounded up to a multiple of 16) become zeros.
template <int ROWS, int D, int THREADS>
__device__ __forceinline__ void loadTile(bfloat* smem, const bfloat* gmem, std::int64_t stride,
                                         int valid, int dh) {
  constexpr int chunks = D / 8;
  for (int i = threadIdx.x; i < ROWS * chunks; i += THREADS) {
    int r = i / chunks, c = i % chunks;
    bool ok = r < valid && c * 8 < dh;
    cpAsync16(smem + r * (D + kPad) + c * 8, ok ? gmem + r * stride + c * 8 : gmem, ok);
  }
}

// A warp's 16 x D accumulator (rows row0..) as bf16 rows of global memory, through its own 16
// rows of a shared tile, with 16-byte stores.
template <int D> __device__ __forceinline__ void storeRows(const float (&acc)[D / 8][4],
                                                           float scale, bfloat* stage, int row0,
                                                           bfloat* gmem, std::int64_t stride,
                                                           int valid, int dh, int lane) {
  int g = lane >> 2, t = lane & 3;
  constexpr int ld = D + kPad;
#pragma unroll
  for (int nt = 0; nt < D / 8; ++nt) {
    *reinterpret_cast<std::uint32_t*>(stage + (row0 + g) * ld + nt * 8 + 2 * t) =
        pack(acc[nt][0] * scale, acc[nt][1] * scale);
    *reinterpret_cast<std::uint32_t*>(stage + (row0 + g + 8) * ld + nt * 8 + 2 * t) =
        pack(acc[nt][2] * scale, acc[nt][3] * scale);
  }
  __syncwarp();
  constexpr int chunks = D / 8;
  for (int i = lane; i < 16 * chunks; i += 32) {
    int r = i / chunks, c = i % chunks;
    if (row0 + r < valid && c * 8 < dh)
      *reinterpret_cast<uint4*>(gmem + (row0 + r) * stride + c * 8) =
          *reinterpret_cast<const uint4*>(stage + (row0 + r) * ld + c * 8);
  }
}

struct SeqBlock {
  std::int64_t start;
  int len;
};

__device__ __forceinline__ SeqBlock seqOf(const std::int32_t* cu, int s) {
  int a = cu[s], b = cu[s + 1];
  return {a, b - a};
}

// The key/value double buffer of the forward and dQ kernels at key block j (of nblocks): starts
// the copy of block j + 1 into the other half of ks/vs (each (2, BN, D + kPad)) and waits until
// block j has landed in half j & 1.
template <int BN, int D, int THREADS>
__device__ __forceinline__ void nextKeyValueBlock(bfloat* ks, bfloat* vs, const bfloat* kg,
                                                  const bfloat* vg, const FlashParams& p, int len,
                                                  int j, int nblocks) {
  constexpr int LD = D + kPad;
  if (j + 1 < nblocks) {
    const int next = (j + 1) * BN, other = (j & 1) ^ 1;
    loadTile<BN, D, THREADS>(ks + other * BN * LD, kg + next * p.k_stride, p.k_stride, len - next,
                             p.head_dim);
    loadTile<BN, D, THREADS>(vs + other * BN * LD, vg + next * p.v_stride, p.v_stride, len - next,
                             p.head_dim);
    cpAsyncCommit();
    cpAsyncWait<1>();
  } else {
    cpAsyncWait<0>();
  }
  __syncthreads();
}

// ---------------------------------------------------------------------------------------------
// Forward: CTA = 64 queries (4 warps x 16 rows) of one head of one sequence.

// FAST (the small-head_dim path, bound by the per-score instructions): hardware ex2 of one FFMA
// per score, keys masked only in the last key block, the row sums on the tensor cores.
template <int D, int BN, bool FAST> __global__ void __launch_bounds__(128, FAST&& D == 16 ? 7 : 0)
    flashForwardKernel(FlashParams p) {
  constexpr int BM = 64, LD = D + kPad, THREADS = 128;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bfloat* qs = reinterpret_cast<bfloat*>(smem_raw);  // (BM, LD)
  bfloat* ks = qs + BM * LD;                         // (2, BN, LD)
  bfloat* vs = ks + 2 * BN * LD;                     // (2, BN, LD)

  SeqBlock seq = seqOf(p.cu_seqlens, blockIdx.z);
  const SeqBlock kseq = seqOf(p.cu_seqlens_k, blockIdx.z);
  int q0 = blockIdx.x * BM;
  if (q0 >= seq.len) return;
  int h = blockIdx.y;
  int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  int g = lane >> 2, t = lane & 3;
  if (kseq.len == 0) {  // no keys: o = 0, lse = -inf (an empty part of a ring merge)
    for (int r = threadIdx.x; r < BM && q0 + r < seq.len; r += THREADS) {
      const std::int64_t row = seq.start + q0 + r;
      bfloat* orow = reinterpret_cast<bfloat*>(p.o) + row * p.o_stride + h * p.head_dim;
      for (int c = 0; c < p.head_dim; ++c) orow[c] = __float2bfloat16(0.0f);
      p.lse[row * p.heads + h] = -INFINITY;
    }
    return;
  }

  const bfloat* qg =
      reinterpret_cast<const bfloat*>(p.q) + (seq.start + q0) * p.q_stride + h * p.head_dim;
  const bfloat* kg =
      reinterpret_cast<const bfloat*>(p.k) + kseq.start * p.k_stride + h * p.head_dim;
  const bfloat* vg =
      reinterpret_cast<const bfloat*>(p.v) + kseq.start * p.v_stride + h * p.head_dim;
  int nblocks = (kseq.len + BN - 1) / BN;

  loadTile<BM, D, THREADS>(qs, qg, p.q_stride, seq.len - q0, p.head_dim);
  loadTile<BN, D, THREADS>(ks, kg, p.k_stride, kseq.len, p.head_dim);
  loadTile<BN, D, THREADS>(vs, vg, p.v_stride, kseq.len, p.head_dim);
  cpAsyncCommit();

  std::uint32_t qf[D / 16][4];
  float o[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
  // FAST keeps the row sums as one more accumulator tile, P times a column of ones on the
  // tensor cores (the sum of the bf16 P that the P V product weighs V with); the general path
  // adds the fp32 P per lane and across the lanes of a row at the end.
  float lsum[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  const float scale_log2 = p.softmax_scale * kLog2e;

  for (int j = 0; j < nblocks; ++j) {
    int buf = j & 1;
    nextKeyValueBlock<BN, D, THREADS>(ks, vs, kg, vg, p, kseq.len, j, nblocks);
    if (j == 0) {
#pragma unroll
      for (int kc = 0; kc < D / 16; ++kc) loadA(qf[kc], qs, LD, warp * 16, kc * 16, lane);
    }
    const bfloat* kb = ks + buf * BN * LD;
    const bfloat* vb = vs + buf * BN * LD;

    float s[BN / 8][4];
    mmaRowsTimesTileT<D / 16, BN>(s, qf, kb, LD, lane);
    int key0 = j * BN;
    float corr[2];
    if constexpr (FAST) {
      // The row maximum of the raw scores (scaling by a positive factor keeps the order, and
      // rounding is monotone, so max(s) * c is max(s * c)); p = 2^(s c - m) in one FFMA.
      if (key0 + BN > kseq.len) {  // the last key block: keys past the end get p = 0
#pragma unroll
        for (int nt = 0; nt < BN / 8; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            if (key0 + nt * 8 + 2 * t + (e & 1) >= kseq.len) s[nt][e] = -INFINITY;
      }
      float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int nt = 0; nt < BN / 8; ++nt) {
        mx[0] = fmaxf(mx[0], fmaxf(s[nt][0], s[nt][1]));
        mx[1] = fmaxf(mx[1], fmaxf(s[nt][2], s[nt][3]));
      }
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
        const float mnew = fmaxf(m[r], mx[r] * scale_log2);
        corr[r] = fastExp2(m[r] - mnew);
        m[r] = mnew;
      }
#pragma unroll
      for (int nt = 0; nt < BN / 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) s[nt][e] = fastExp2(fmaf(s[nt][e], scale_log2, -m[e >> 1]));
      }
#pragma unroll
      for (int e = 0; e < 4; ++e) lsum[e] *= corr[e >> 1];
    } else {
      // Online softmax (log2 domain); keys past the sequence's end get probability 0.
      float mx[2] = {m[0], m[1]};
#pragma unroll
      for (int nt = 0; nt < BN / 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          int key = key0 + nt * 8 + 2 * t + (e & 1);
          float x = key < kseq.len ? s[nt][e] * scale_log2 : -INFINITY;
          s[nt][e] = x;
          mx[e >> 1] = fmaxf(mx[e >> 1], x);
        }
      }
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
      }
      float rowsum[2] = {0.0f, 0.0f};
#pragma unroll
      for (int r = 0; r < 2; ++r) corr[r] = exp2f(m[r] - mx[r]);
#pragma unroll
      for (int nt = 0; nt < BN / 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float pe = exp2f(s[nt][e] - mx[e >> 1]);
          s[nt][e] = pe;
          rowsum[e >> 1] += pe;
        }
      }
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        l[r] = l[r] * corr[r] + rowsum[r];
        m[r] = mx[r];
      }
    }
#pragma unroll
    for (int nt = 0; nt < D / 8; ++nt) {
      o[nt][0] *= corr[0];
      o[nt][1] *= corr[0];
      o[nt][2] *= corr[1];
      o[nt][3] *= corr[1];
    }
    mmaAccTimesTile<BN, D, FAST>(o, s, vb, LD, lane, &lsum);  // O += P V (and P's row sums)
    __syncthreads();
  }

  if constexpr (FAST) {
    l[0] = lsum[0];
    l[1] = lsum[2];
  } else {  // row sums across the 4 lanes of a row group
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
      l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    }
  }
  float inv0 = 1.0f / l[0], inv1 = 1.0f / l[1];
#pragma unroll
  for (int nt = 0; nt < D / 8; ++nt) {
    o[nt][0] *= inv0;
    o[nt][1] *= inv0;
    o[nt][2] *= inv1;
    o[nt][3] *= inv1;
  }
  bfloat* og = reinterpret_cast<bfloat*>(p.o) + (seq.start + q0) * p.o_stride + h * p.head_dim;
  storeRows<D>(o, 1.0f, qs, warp * 16, og, p.o_stride, seq.len - q0, p.head_dim, lane);
  if (t == 0) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      int row = q0 + warp * 16 + g + 8 * r;
      if (row < seq.len) p.lse[(seq.start + row) * p.heads + h] = (m[r] + log2f(l[r])) * kLn2;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Backward, step 0: delta = rowsum(dO * O), 8 lanes per (token, head) row.

template <int D> __global__ void flashBackwardDeltaKernel(FlashParams p) {
  std::int64_t row = (blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x) >> 3;
  int sub = threadIdx.x & 7;
  std::int64_t rows = p.total_tokens * p.heads;
  bool ok = row < rows;
  float sum = 0.0f;
  if (ok) {
    std::int64_t tok = row / p.heads;
    int h = static_cast<int>(row % p.heads);
    const bfloat* dog =
        reinterpret_cast<const bfloat*>(p.dout) + tok * p.dout_stride + h * p.head_dim;
    const bfloat* og = reinterpret_cast<const bfloat*>(p.o) + tok * p.o_stride + h * p.head_dim;
#pragma unroll
    for (int c = sub; c < p.head_dim / 8; c += 8) {
      uint4 a = *reinterpret_cast<const uint4*>(dog + c * 8);
      uint4 b = *reinterpret_cast<const uint4*>(og + c * 8);
      const __nv_bfloat162* a2 = reinterpret_cast<const __nv_bfloat162*>(&a);
      const __nv_bfloat162* b2 = reinterpret_cast<const __nv_bfloat162*>(&b);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float2 x = __bfloat1622float2(a2[e]), y = __bfloat1622float2(b2[e]);
        sum += x.x * y.x + x.y * y.y;
      }
    }
  }
  sum += __shfl_xor_sync(0xffffffffu, sum, 1);
  sum += __shfl_xor_sync(0xffffffffu, sum, 2);
  sum += __shfl_xor_sync(0xffffffffu, sum, 4);
  if (ok && sub == 0) p.delta[row] = sum;
}

// ---------------------------------------------------------------------------------------------
// Backward, dK and dV: CTA = 64 keys (4 warps x 16 rows); loop over BQ-query blocks.
//   S^T = K Q^T, P^T = exp(scale S^T - lse), dV += P^T dO, dP^T = V dO^T,
//   dS^T = P^T (dP^T - delta), dK += scale dS^T Q.

// CTAs per SM that ptxas keeps the registers for (0: no bound; it took 88 registers at head_dim
// 16, 5 CTAs, and 182 at 64, 2 CTAs; more at 32 spills).
template <int D, int BQ> __global__ void __launch_bounds__(128, D == 16   ? 6
                                                                : D == 64 ? 3
                                                                          : 0)
    flashBackwardKVKernel(FlashParams p) {
  constexpr int BN = 64, LD = D + kPad, THREADS = 128;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bfloat* ks = reinterpret_cast<bfloat*>(smem_raw);           // (BN, LD)
  bfloat* vs = ks + BN * LD;                                  // (BN, LD)
  bfloat* qs = vs + BN * LD;                                  // (2, BQ, LD)
  bfloat* dos = qs + 2 * BQ * LD;                             // (2, BQ, LD)
  float* lses = reinterpret_cast<float*>(dos + 2 * BQ * LD);  // (2, BQ) log2 domain
  float* dels = lses + 2 * BQ;                                // (2, BQ)

  SeqBlock seq = seqOf(p.cu_seqlens, blockIdx.z);
  const SeqBlock kseq = seqOf(p.cu_seqlens_k, blockIdx.z);
  int k0 = blockIdx.x * BN;
  if (k0 >= kseq.len) return;
  int h = blockIdx.y;
  int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  int t = lane & 3;

  const bfloat* qg = reinterpret_cast<const bfloat*>(p.q) + seq.start * p.q_stride + h * p.head_dim;
  const bfloat* dog =
      reinterpret_cast<const bfloat*>(p.dout) + seq.start * p.dout_stride + h * p.head_dim;
  const bfloat* kg =
      reinterpret_cast<const bfloat*>(p.k) + (kseq.start + k0) * p.k_stride + h * p.head_dim;
  const bfloat* vg =
      reinterpret_cast<const bfloat*>(p.v) + (kseq.start + k0) * p.v_stride + h * p.head_dim;
  int nblocks = (seq.len + BQ - 1) / BQ;  // no queries: dK = dV = 0

  auto loadQBlock = [&](int i, int buf) {
    int q0 = i * BQ;
    loadTile<BQ, D, THREADS>(qs + buf * BQ * LD, qg + q0 * p.q_stride, p.q_stride, seq.len - q0,
                             p.head_dim);
    loadTile<BQ, D, THREADS>(dos + buf * BQ * LD, dog + q0 * p.dout_stride, p.dout_stride,
                             seq.len - q0, p.head_dim);
    for (int r = threadIdx.x; r < BQ; r += THREADS) {
      int q = q0 + r;
      bool ok = q < seq.len;
      std::int64_t idx = (seq.start + q) * p.heads + h;
      lses[buf * BQ + r] = ok ? p.lse[idx] * kLog2e : INFINITY;  // P = 0 past the end
      dels[buf * BQ + r] = ok ? p.delta[idx] : 0.0f;
    }
  };

  loadTile<BN, D, THREADS>(ks, kg, p.k_stride, kseq.len - k0, p.head_dim);
  loadTile<BN, D, THREADS>(vs, vg, p.v_stride, kseq.len - k0, p.head_dim);
  loadQBlock(0, 0);
  cpAsyncCommit();
  if (nblocks == 0) {  // the loop below waits for these copies; ks and vs stage the stores
    cpAsyncWait<0>();
    __syncthreads();
  }

  float dk[D / 8][4], dv[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i)
    for (int e = 0; e < 4; ++e) dk[i][e] = dv[i][e] = 0.0f;
  const float scale_log2 = p.softmax_scale * kLog2e;

  for (int i = 0; i < nblocks; ++i) {
    int buf = i & 1;
    if (i + 1 < nblocks) {
      loadQBlock(i + 1, buf ^ 1);
      cpAsyncCommit();
      cpAsyncWait<1>();
    } else {
      cpAsyncWait<0>();
    }
    __syncthreads();
    const bfloat* qb = qs + buf * BQ * LD;
    const bfloat* dob = dos + buf * BQ * LD;
    const float* lb = lses + buf * BQ;
    const float* db = dels + buf * BQ;

    float s[BQ / 8][4], dp[BQ / 8][4];
#pragma unroll
    for (int kc = 0; kc < D / 16; ++kc) {
      std::uint32_t ka[4], va[4];
      loadA(ka, ks, LD, warp * 16, kc * 16, lane);
      loadA(va, vs, LD, warp * 16, kc * 16, lane);
#pragma unroll
      for (int np = 0; np < BQ / 16; ++np) {
        std::uint32_t b[4], c[4];
        loadBnk(b, qb, LD, np * 16, kc * 16, lane);
        loadBnk(c, dob, LD, np * 16, kc * 16, lane);
        if (kc == 0) {
          mmaZero(s[2 * np], ka, b[0], b[1]);
          mmaZero(s[2 * np + 1], ka, b[2], b[3]);
          mmaZero(dp[2 * np], va, c[0], c[1]);
          mmaZero(dp[2 * np + 1], va, c[2], c[3]);
        } else {
          mma(s[2 * np], ka, b[0], b[1]);
          mma(s[2 * np + 1], ka, b[2], b[3]);
          mma(dp[2 * np], va, c[0], c[1]);
          mma(dp[2 * np + 1], va, c[2], c[3]);
        }
      }
    }
    // P^T and dS^T in place (columns are queries; a lane's two columns 2t, 2t + 1 of each
    // n-tile are adjacent, so their lse and delta come in one 8-byte load each).
#pragma unroll
    for (int n = 0; n < BQ / 8; ++n) {
      const float2 lse2 = *reinterpret_cast<const float2*>(lb + n * 8 + 2 * t);
      const float2 del2 = *reinterpret_cast<const float2*>(db + n * 8 + 2 * t);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float lc = e & 1 ? lse2.y : lse2.x, dc = e & 1 ? del2.y : del2.x;
        float pe = fastExp2(fmaf(s[n][e], scale_log2, -lc));
        s[n][e] = pe;
        dp[n][e] = pe * (dp[n][e] - dc);
      }
    }
    // dV += P^T dO and dK += dS^T Q: two mmaAccTimesTile products, kept interleaved in one loop
    // (as measured); two calls would issue them one after the other.
#pragma unroll
    for (int c = 0; c < BQ / 16; ++c) {
      std::uint32_t pa[4], dsa[4];
      accToA<BQ / 8>(pa, s, c);
      accToA<BQ / 8>(dsa, dp, c);
#pragma unroll
      for (int dpair = 0; dpair < D / 16; ++dpair) {
        std::uint32_t b[4];
        loadBkn(b, dob, LD, c * 16, dpair * 16, lane);
        mma(dv[2 * dpair], pa, b[0], b[1]);
        mma(dv[2 * dpair + 1], pa, b[2], b[3]);
        loadBkn(b, qb, LD, c * 16, dpair * 16, lane);
        mma(dk[2 * dpair], dsa, b[0], b[1]);
        mma(dk[2 * dpair + 1], dsa, b[2], b[3]);
      }
    }
    __syncthreads();
  }

  bfloat* dkg = reinterpret_cast<bfloat*>(p.dk) + (kseq.start + k0) * p.dk_stride + h * p.head_dim;
  bfloat* dvg = reinterpret_cast<bfloat*>(p.dv) + (kseq.start + k0) * p.dv_stride + h * p.head_dim;
  storeRows<D>(dk, p.softmax_scale, ks, warp * 16, dkg, p.dk_stride, kseq.len - k0, p.head_dim,
               lane);
  storeRows<D>(dv, 1.0f, vs, warp * 16, dvg, p.dv_stride, kseq.len - k0, p.head_dim, lane);
}

// ---------------------------------------------------------------------------------------------
// Backward, dQ: CTA = 64 queries (4 warps x 16 rows); loop over BN-key blocks.
//   S = Q K^T, P = exp(scale S - lse), dP = dO V^T, dS = P (dP - delta), dQ += scale dS K.

template <int D, int BN> __global__ void __launch_bounds__(128)
    flashBackwardQKernel(FlashParams p) {
  constexpr int BM = 64, LD = D + kPad, THREADS = 128;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bfloat* qs = reinterpret_cast<bfloat*>(smem_raw);  // (BM, LD)
  bfloat* dos = qs + BM * LD;                        // (BM, LD)
  bfloat* ks = dos + BM * LD;                        // (2, BN, LD)
  bfloat* vs = ks + 2 * BN * LD;                     // (2, BN, LD)

  SeqBlock seq = seqOf(p.cu_seqlens, blockIdx.z);
  const SeqBlock kseq = seqOf(p.cu_seqlens_k, blockIdx.z);
  int q0 = blockIdx.x * BM;
  if (q0 >= seq.len) return;
  int h = blockIdx.y;
  int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  int g = lane >> 2, t = lane & 3;

  const bfloat* qg =
      reinterpret_cast<const bfloat*>(p.q) + (seq.start + q0) * p.q_stride + h * p.head_dim;
  const bfloat* dog =
      reinterpret_cast<const bfloat*>(p.dout) + (seq.start + q0) * p.dout_stride + h * p.head_dim;
  const bfloat* kg =
      reinterpret_cast<const bfloat*>(p.k) + kseq.start * p.k_stride + h * p.head_dim;
  const bfloat* vg =
      reinterpret_cast<const bfloat*>(p.v) + kseq.start * p.v_stride + h * p.head_dim;
  int nblocks = (kseq.len + BN - 1) / BN;  // no keys: dQ = 0

  loadTile<BM, D, THREADS>(qs, qg, p.q_stride, seq.len - q0, p.head_dim);
  loadTile<BM, D, THREADS>(dos, dog, p.dout_stride, seq.len - q0, p.head_dim);
  loadTile<BN, D, THREADS>(ks, kg, p.k_stride, kseq.len, p.head_dim);
  loadTile<BN, D, THREADS>(vs, vg, p.v_stride, kseq.len, p.head_dim);
  cpAsyncCommit();
  if (nblocks == 0) {  // the loop below waits for these copies; qs stages the stores
    cpAsyncWait<0>();
    __syncthreads();
  }

  float lse2[2], del[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    int row = q0 + warp * 16 + g + 8 * r;
    bool ok = row < seq.len;
    std::int64_t idx = (seq.start + row) * p.heads + h;
    lse2[r] = ok ? p.lse[idx] * kLog2e : 0.0f;  // rows past the end are never stored
    del[r] = ok ? p.delta[idx] : 0.0f;
  }

  std::uint32_t qf[D / 16][4], dof[D / 16][4];
  float dq[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) dq[i][0] = dq[i][1] = dq[i][2] = dq[i][3] = 0.0f;
  const float scale_log2 = p.softmax_scale * kLog2e;

  for (int j = 0; j < nblocks; ++j) {
    int buf = j & 1;
    nextKeyValueBlock<BN, D, THREADS>(ks, vs, kg, vg, p, kseq.len, j, nblocks);
    if (j == 0) {
#pragma unroll
      for (int kc = 0; kc < D / 16; ++kc) {
        loadA(qf[kc], qs, LD, warp * 16, kc * 16, lane);
        loadA(dof[kc], dos, LD, warp * 16, kc * 16, lane);
      }
    }
    const bfloat* kb = ks + buf * BN * LD;
    const bfloat* vb = vs + buf * BN * LD;

    // S and dP interleaved (rather than mmaRowsTimesTileT twice: ptxas then took 106 registers
    // against 61 at head_dim 16).
    float s[BN / 8][4], dp[BN / 8][4];
#pragma unroll
    for (int kc = 0; kc < D / 16; ++kc) {
#pragma unroll
      for (int np = 0; np < BN / 16; ++np) {
        std::uint32_t b[4], c[4];
        loadBnk(b, kb, LD, np * 16, kc * 16, lane);
        loadBnk(c, vb, LD, np * 16, kc * 16, lane);
        if (kc == 0) {
          mmaZero(s[2 * np], qf[kc], b[0], b[1]);
          mmaZero(s[2 * np + 1], qf[kc], b[2], b[3]);
          mmaZero(dp[2 * np], dof[kc], c[0], c[1]);
          mmaZero(dp[2 * np + 1], dof[kc], c[2], c[3]);
        } else {
          mma(s[2 * np], qf[kc], b[0], b[1]);
          mma(s[2 * np + 1], qf[kc], b[2], b[3]);
          mma(dp[2 * np], dof[kc], c[0], c[1]);
          mma(dp[2 * np + 1], dof[kc], c[2], c[3]);
        }
      }
    }
    const int key0 = j * BN;
    // Keys past the end (zero rows of K and V) get P = 0; only the last block has them.
    const int valid = kseq.len - key0 - 2 * t;  // >= BN: the whole block
#pragma unroll
    for (int n = 0; n < BN / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float pe = fastExp2(fmaf(s[n][e], scale_log2, -lse2[e >> 1]));
        if (n * 8 + (e & 1) >= valid) pe = 0.0f;
        dp[n][e] = pe * (dp[n][e] - del[e >> 1]);
      }
    }
    mmaAccTimesTile<BN, D>(dq, dp, kb, LD, lane);  // dQ += dS K
    __syncthreads();
  }

  bfloat* dqg = reinterpret_cast<bfloat*>(p.dq) + (seq.start + q0) * p.dq_stride + h * p.head_dim;
  storeRows<D>(dq, p.softmax_scale, qs, warp * 16, dqg, p.dq_stride, seq.len - q0, p.head_dim,
               lane);
}

template <class Kernel>
void launch(Kernel kernel, dim3 grid, int smem, Stream stream, const FlashParams& p) {
  if (smem > 48 * 1024)
    PLM_CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  kernel<<<grid, 128, smem, stream>>>(p);
  PLM_CHECK_CUDA(cudaGetLastError());
}

/// The small-head_dim forward (head_dim <= 32), unless asked for the general kernels
/// (Kernels::Legacy or PLM_FLASH_LEGACY=1).
bool smallD(const FlashParams& p) {
  if (p.head_dim > 32 || p.kernels == FlashParams::Kernels::Legacy) return false;
  static const bool legacy = [] {
    const char* e = std::getenv("PLM_FLASH_LEGACY");
    return e != nullptr && std::string(e) == "1";
  }();
  return !legacy;
}

void checkParams(const FlashParams& p) {
  if (p.head_dim <= 0 || p.head_dim % 8 != 0 || p.head_dim > 128)
    throw Error("plm::gpu::flashAttention: head_dim " + std::to_string(p.head_dim) +
                " is not supported on the GPU (a multiple of 8 up to 128); use the portable "
                "attention path for this model");
  // The small-head_dim forward takes the row maximum of the unscaled scores.
  if (!(p.softmax_scale > 0.0f) || !std::isfinite(p.softmax_scale))
    throw Error("plm::gpu::flashAttention: softmax_scale " + std::to_string(p.softmax_scale) +
                " must be positive and finite (a bug in the caller)");
}

/// p with the key layout filled in (the query layout when none is given).
FlashParams withKeys(FlashParams p) {
  if (p.cu_seqlens_k == nullptr) {
    p.cu_seqlens_k = p.cu_seqlens;
    p.max_seqlen_k = p.max_seqlen;
  }
  return p;
}

/// 64-row blocks of the longest sequence `longest` x heads x sequences.  (A grid of one CTA per
/// block of the packed rows, each CTA finding its sequence by a 32-way search of cu_seqlens, was
/// slower on an H200 at the 8M and 35M shapes: 1.10 against 1.05 ms backward at 8M, although
/// about 60% of this grid's CTAs have no rows and return at once.)
dim3 gridOf(int longest, const FlashParams& p) {
  return dim3((longest + 63) / 64, p.heads, p.num_seqs);
}

template <int D, bool FAST = false> void forwardD(Stream stream, const FlashParams& p) {
  constexpr int BN = 64, LD = D + kPad;
  int smem = (64 + 4 * BN) * LD * 2;
  launch(flashForwardKernel<D, BN, FAST>, gridOf(p.max_seqlen, p), smem, stream, p);
}

template <int D> void backwardD(Stream stream, const FlashParams& p) {
  constexpr int LD = D + kPad;
  std::int64_t rows = p.total_tokens * p.heads;
  flashBackwardDeltaKernel<D><<<static_cast<unsigned>((rows * 8 + 255) / 256), 256, 0, stream>>>(p);
  PLM_CHECK_CUDA(cudaGetLastError());

  constexpr int BQ = D == 128 ? 32 : 64;
  int smem_kv = (2 * 64 + 4 * BQ) * LD * 2 + 4 * BQ * 4;
  launch(flashBackwardKVKernel<D, BQ>, gridOf(p.max_seqlen_k, p), smem_kv, stream, p);

  constexpr int BN = D == 128 ? 32 : 64;
  int smem_q = (2 * 64 + 4 * BN) * LD * 2;
  launch(flashBackwardQKernel<D, BN>, gridOf(p.max_seqlen, p), smem_q, stream, p);
}

}  // namespace

void flashAttentionForward(Stream stream, const FlashParams& given) {
  checkParams(given);
  const FlashParams p = withKeys(given);
  if (p.num_seqs == 0 || p.total_tokens == 0) return;
  const bool fast = smallD(p);
  if (p.head_dim <= 16)
    fast ? forwardD<16, true>(stream, p) : forwardD<16>(stream, p);
  else if (p.head_dim <= 32)
    fast ? forwardD<32, true>(stream, p) : forwardD<32>(stream, p);
  else if (p.head_dim <= 64)
    forwardD<64>(stream, p);
  else
    forwardD<128>(stream, p);
}

void flashAttentionBackward(Stream stream, const FlashParams& given) {
  checkParams(given);
  const FlashParams p = withKeys(given);
  if (p.num_seqs == 0 || p.total_tokens == 0) return;
  if (p.head_dim <= 16)
    backwardD<16>(stream, p);
  else if (p.head_dim <= 32)
    backwardD<32>(stream, p);
  else if (p.head_dim <= 64)
    backwardD<64>(stream, p);
  else
    backwardD<128>(stream, p);
}

}  // namespace plm::gpu
