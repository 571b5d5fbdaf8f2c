// ESM-2 bf16 forward + backward on CUDA (see esm2_step.hpp for the design).
//
// GEMMs are written in row-major terms (gemm.hpp): a Linear layer y = x W^T + b is
// (T, out) = (T, in) (out, in)^T; its input gradient is dy W and its weight gradient dy^T x,
// with the bias gradient from the same GEMM's BGRADB epilogue (written to a scratch vector and
// added, since the epilogue overwrites).
#include "gpu/esm2_step.hpp"

#include "core/error.hpp"
#include "gpu/flash_attention.hpp"
#include "gpu/fused.hpp"
#include "gpu/gemm.hpp"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <string>

namespace plm::gpu {

namespace {

using bfloat = __nv_bfloat16;

__device__ __forceinline__ float warpSum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

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

unsigned blocksFor(std::int64_t work, int per_block) {
  return static_cast<unsigned>((work + per_block - 1) / per_block);
}

// LayerNorm forward: x (rows, cols) fp32 or bf16 -> y bf16; gamma, beta fp32 masters.
template <class TX>
__global__ void lnForwardKernel(const TX* x, const float* gamma, const float* beta, bfloat* y,
                                float* mean, float* rstd, std::int64_t rows, int cols, float eps) {
  std::int64_t row = blockIdx.x * std::int64_t(blockDim.x / 32) + threadIdx.x / 32;
  int lane = threadIdx.x & 31;
  if (row >= rows) return;
  const TX* xr = x + row * cols;
  int pairs = cols / 2;
  float s = 0.0f;
  for (int i = lane; i < pairs; i += 32) {
    float2 v = load2(xr, i);
    s += v.x + v.y;
  }
  float mu = warpSum(s) / cols;
  float ss = 0.0f;
  for (int i = lane; i < pairs; i += 32) {
    float2 v = load2(xr, i);
    ss += (v.x - mu) * (v.x - mu) + (v.y - mu) * (v.y - mu);
  }
  float rs = rsqrtf(warpSum(ss) / cols + eps);
  for (int i = lane; i < pairs; i += 32) {
    float2 v = load2(xr, i), g = load2(gamma, i), b = load2(beta, i);
    store2(y + row * cols, i, (v.x - mu) * rs * g.x + b.x, (v.y - mu) * rs * g.y + b.y);
  }
  if (lane == 0) {
    mean[row] = mu;
    rstd[row] = rs;
  }
}

// LayerNorm backward.  Residual mode: g (fp32) = (accumulate ? g : 0) + dx and gb = bf16(g), the
// residual-stream gradient and its bf16 copy for the next GEMM.  Otherwise dx is written as bf16
// to gb.  A lane always owns the same column pairs (lane + 32 j), so it sums dgamma and dbeta
// over all rows of its warp in registers (J >= pairs / 32, unrolled), then adds them once into
// shared memory and the block once into the fp32 gradients.
template <class TX, class TDY, int J> __global__ void __launch_bounds__(256)
    lnBackwardKernel(const TDY* dy, const TX* x, const float* gamma, const float* mean,
                     const float* rstd, float* g, bfloat* gb, float* dgamma, float* dbeta,
                     std::int64_t rows, int cols, bool residual, bool accumulate) {
  extern __shared__ float acc[];  // (2, cols)
  for (int i = threadIdx.x; i < 2 * cols; i += blockDim.x) acc[i] = 0.0f;
  __syncthreads();
  int warps = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  int pairs = cols / 2;
  float2 dg[J], db[J];
#pragma unroll
  for (int j = 0; j < J; ++j) dg[j] = db[j] = make_float2(0.0f, 0.0f);
  for (std::int64_t row = blockIdx.x * std::int64_t(warps) + warp; row < rows;
       row += std::int64_t(gridDim.x) * warps) {
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
          float2* gr = reinterpret_cast<float2*>(g + row * cols);
          if (accumulate) {
            float2 old = gr[i];
            d0 += old.x;
            d1 += old.y;
          }
          gr[i] = make_float2(d0, d1);
        }
        store2(gb + row * cols, i, d0, d1);
      }
    }
  }
#pragma unroll
  for (int j = 0; j < J; ++j) {
    int i = lane + 32 * j;
    if (i < pairs) {
      atomicAdd(&acc[2 * i], dg[j].x);
      atomicAdd(&acc[2 * i + 1], dg[j].y);
      atomicAdd(&acc[cols + 2 * i], db[j].x);
      atomicAdd(&acc[cols + 2 * i + 1], db[j].y);
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < cols; i += blockDim.x) {
    atomicAdd(&dgamma[i], acc[i]);
    atomicAdd(&dbeta[i], acc[cols + i]);
  }
}

// Position of every token inside its sequence (rotary restarts at 0); one block per sequence.
__global__ void positionsKernel(const std::int32_t* cu, std::int32_t* pos) {
  int s = blockIdx.x;
  for (int i = cu[s] + threadIdx.x; i < cu[s + 1]; i += blockDim.x) pos[i] = i - cu[s];
}

// Rotary on q and k inside the QKV rows (stride 3C), two adjacent dimensions per thread; q is
// also scaled.  sign = -1 applies the transpose (backward).
__global__ void rotaryQKKernel(bfloat* qkv, std::int64_t stride, int k_offset,
                               const std::int32_t* pos, std::int64_t tokens, int heads,
                               int head_dim, float sign, float q_scale) {
  const int half = head_dim / 2, quads = half / 2;
  std::int64_t idx = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x;
  if (idx >= tokens * heads * quads) return;
  std::int64_t t = idx / (heads * quads);
  int rem = static_cast<int>(idx % (heads * quads));
  int h = rem / quads, i = 2 * (rem % quads);
  const float log2_base = 13.287712379549449f;  // log2(10000)
  float p = static_cast<float>(pos[t]);
  float c[2], sn[2];
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    float inv_freq = exp2f(-static_cast<float>(2 * (i + e)) / head_dim * log2_base);
    sincosf(p * inv_freq, &sn[e], &c[e]);
    sn[e] *= sign;
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    bfloat* row = qkv + t * stride + r * k_offset + h * head_dim;
    float f = r == 0 ? q_scale : 1.0f;
    float2 x1 = load2(row, i / 2), x2 = load2(row + half, i / 2);
    store2(row, i / 2, f * (x1.x * c[0] - x2.x * sn[0]), f * (x1.y * c[1] - x2.y * sn[1]));
    store2(row + half, i / 2, f * (x2.x * c[0] + x1.x * sn[0]), f * (x2.y * c[1] + x1.y * sn[1]));
  }
}

// fp32 masters -> packed bf16 weights, one block per chunk (src_off, dst_off, n) of a tensor.
__global__ void packChunksKernel(const float* src, bfloat* dst, const std::int64_t* chunks) {
  std::int64_t so = chunks[3 * blockIdx.x], d = chunks[3 * blockIdx.x + 1],
               n = chunks[3 * blockIdx.x + 2];
  for (std::int64_t i = threadIdx.x; i < n; i += blockDim.x)
    dst[d + i] = __float2bfloat16(src[so + i]);
}

__global__ void gatherRowsKernel(const bfloat* src, const std::int32_t* rows, bfloat* dst,
                                 std::int64_t m, int cols) {
  int chunks = cols / 8;
  for (std::int64_t i = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; i < m * chunks;
       i += std::int64_t(gridDim.x) * blockDim.x) {
    std::int64_t r = i / chunks;
    int c = static_cast<int>(i % chunks);
    reinterpret_cast<uint4*>(dst + r * cols)[c] =
        reinterpret_cast<const uint4*>(src + std::int64_t(rows[r]) * cols)[c];
  }
}

__global__ void scatterRowsKernel(const bfloat* src, const std::int32_t* rows, bfloat* dst,
                                  std::int64_t m, int cols) {
  int chunks = cols / 8;
  for (std::int64_t i = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; i < m * chunks;
       i += std::int64_t(gridDim.x) * blockDim.x) {
    std::int64_t r = i / chunks;
    int c = static_cast<int>(i % chunks);
    reinterpret_cast<uint4*>(dst + std::int64_t(rows[r]) * cols)[c] =
        reinterpret_cast<const uint4*>(src + r * cols)[c];
  }
}

// dx = dy * gelu_tanh'(pre), the derivative of cuBLASLt's GELU epilogue.
__global__ void geluBackwardKernel(const bfloat* dy, const bfloat* pre, bfloat* dx,
                                   std::int64_t n) {
  const float c = 0.7978845608028654f;
  for (std::int64_t i = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; i < n;
       i += std::int64_t(gridDim.x) * blockDim.x) {
    float x = __bfloat162float(pre[i]);
    float t = tanhf(c * (x + 0.044715f * x * x * x));
    float d = 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * c * (1.0f + 3.0f * 0.044715f * x * x);
    dx[i] = __float2bfloat16(__bfloat162float(dy[i]) * d);
  }
}

__global__ void addKernel(float* dst, const float* src, std::int64_t n) {
  for (std::int64_t i = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; i < n;
       i += std::int64_t(gridDim.x) * blockDim.x)
    dst[i] += src[i];
}

int gridCap(std::int64_t blocks) {
  return static_cast<int>(std::min<std::int64_t>(blocks, 132 * 8));
}

constexpr int kLogitsLd = 40;  // vocab 33 padded to 16-byte rows

}  // namespace

struct Esm2Bf16::Impl {
  Esm2Shape s;
  Esm2Offsets off;
  Gemm gemm;

  // Packed bf16 weights (element offsets into wb).
  struct PackedLayer {
    std::int64_t wqkv, bqkv, wo, w1, b1, w2;
  };
  std::vector<PackedLayer> pl;
  std::int64_t p_embed = 0, p_head_w = 0, p_head_b = 0, packed_total = 0;
  bfloat* wb = nullptr;
  std::int64_t* chunks_dev = nullptr;
  int num_segs = 0, num_chunks = 0;

  // Activations and workspaces, carved from one allocation sized for (T, M).
  void* arena = nullptr;
  std::size_t arena_bytes = 0;
  std::int64_t cap_t = -1, cap_m = -1, cap_n = -1;
  struct LayerActs {
    bfloat *h, *qkv, *o, *h2, *pre, *u;
    float *mean1, *rstd1, *lse, *xmid, *mean2, *rstd2;
  };
  std::vector<float*> xs;
  std::vector<LayerActs> acts;
  bfloat *hidden, *hm, *zpre, *z, *zn, *dlogits, *dzn, *dz, *dzpre, *dhm, *dhidden;
  float *meanf, *rstdf, *meanh, *rstdh, *logits;
  float *g, *dh, *delta, *scratch;
  bfloat *gb, *du, *dh2, *dout, *dqkv;
  std::uint8_t* tokens_d;
  std::int32_t *cu_d, *rows_d, *labels_d, *pos_d;
  float* qkv_grad;  // (3C, C) weight gradient of the stacked QKV projection, then (3C) bias
  double* loss_d;
  std::vector<std::int32_t> rows_h, labels_h;

  // Profiling: an event after every launch; the interval before it is charged to its kind.
  enum Kind { kGemm, kAttention, kLayerNorm, kOther, kKinds };
  bool profiling = false;
  std::vector<cudaEvent_t> events;
  std::vector<int> kinds;
  std::size_t marks = 0;
  double totals[kKinds] = {0, 0, 0, 0};
  Stream prof_stream = nullptr;
  void mark(int kind) {
    if (!profiling) return;
    if (marks == events.size()) {
      cudaEvent_t e;
      PLM_CHECK_CUDA(cudaEventCreate(&e));
      events.push_back(e);
      kinds.push_back(0);
    }
    PLM_CHECK_CUDA(cudaEventRecord(events[marks], prof_stream));
    kinds[marks++] = kind;
  }
  void collect() {
    if (!profiling || marks < 2) return;
    PLM_CHECK_CUDA(cudaEventSynchronize(events[marks - 1]));
    for (std::size_t i = 1; i < marks; ++i) {
      float ms = 0;
      PLM_CHECK_CUDA(cudaEventElapsedTime(&ms, events[i - 1], events[i]));
      totals[kinds[i]] += ms;
    }
    marks = 0;
  }

  Impl(const Esm2Shape& shape, const Esm2Offsets& offsets) : s(shape), off(offsets) {
    if (s.hidden % 16 != 0 || s.ffn % 16 != 0 || s.hidden % s.heads != 0)
      throw Error("plm::gpu::Esm2Bf16: hidden (" + std::to_string(s.hidden) + ") and ffn (" +
                  std::to_string(s.ffn) + ") must be multiples of 16 and hidden of heads");
    const std::int64_t C = s.hidden, F = s.ffn, V = s.vocab;
    std::vector<std::int64_t> seg;  // src_off, dst_off, n
    std::int64_t dst = 0;
    auto add = [&](std::int64_t src, std::int64_t n) {
      seg.insert(seg.end(), {src, dst, n});
      std::int64_t at = dst;
      dst += (n + 15) / 16 * 16;
      return at;
    };
    p_embed = add(off.embed, V * C);
    for (const auto& L : off.layers) {
      PackedLayer p{};
      p.wqkv = dst;  // q, k, v weights stacked: (3C, C), contiguous since C*C is a multiple of 16
      add(L.wq, C * C);
      add(L.wk, C * C);
      add(L.wv, C * C);
      p.bqkv = dst;
      seg.insert(seg.end(), {L.bq, dst, C});
      seg.insert(seg.end(), {L.bk, dst + C, C});
      seg.insert(seg.end(), {L.bv, dst + 2 * C, C});
      dst += (3 * C + 15) / 16 * 16;
      p.wo = add(L.wo, C * C);
      p.w1 = add(L.w1, F * C);
      p.b1 = add(L.b1, F);
      p.w2 = add(L.w2, C * F);
      pl.push_back(p);
    }
    p_head_w = add(off.head_w, C * C);
    p_head_b = add(off.head_b, C);
    packed_total = dst;
    num_segs = static_cast<int>(seg.size() / 3);
    std::vector<std::int64_t> chunks;
    constexpr std::int64_t kChunk = 16384;
    for (int i = 0; i < num_segs; ++i)
      for (std::int64_t o = 0; o < seg[3 * i + 2]; o += kChunk)
        chunks.insert(chunks.end(),
                      {seg[3 * i] + o, seg[3 * i + 1] + o, std::min(kChunk, seg[3 * i + 2] - o)});
    num_chunks = static_cast<int>(chunks.size() / 3);
    PLM_CHECK_CUDA(cudaMalloc(&chunks_dev, chunks.size() * sizeof(std::int64_t)));
    PLM_CHECK_CUDA(cudaMemcpy(chunks_dev, chunks.data(), chunks.size() * sizeof(std::int64_t),
                              cudaMemcpyHostToDevice));
    PLM_CHECK_CUDA(cudaMalloc(&wb, packed_total * sizeof(bfloat)));
    PLM_CHECK_CUDA(cudaMemset(wb, 0, packed_total * sizeof(bfloat)));
  }

  ~Impl() {
    for (auto e : events) cudaEventDestroy(e);
    cudaFree(wb);
    cudaFree(chunks_dev);
    cudaFree(arena);
  }

  void reserve(std::int64_t T, std::int64_t M, std::int64_t n) {
    if (T <= cap_t && M <= cap_m && n <= cap_n) return;
    T = std::max(T, cap_t);
    M = std::max(M, cap_m);
    n = std::max(n, cap_n);
    const std::int64_t C = s.hidden, F = s.ffn, H = s.heads;
    const std::int64_t Mr = std::max<std::int64_t>(M, 1);
    std::size_t used = 0;
    char* base = nullptr;
    auto take = [&](std::size_t bytes) {
      void* p = base ? base + used : nullptr;
      used += (bytes + 255) / 256 * 256;
      return p;
    };
    auto carve = [&]() {
      used = 0;
      xs.assign(s.layers + 1, nullptr);
      acts.assign(s.layers, LayerActs{});
      for (auto& x : xs) x = static_cast<float*>(take(T * C * 4));
      for (auto& a : acts) {
        a.h = static_cast<bfloat*>(take(T * C * 2));
        a.qkv = static_cast<bfloat*>(take(T * 3 * C * 2));
        a.o = static_cast<bfloat*>(take(T * C * 2));
        a.h2 = static_cast<bfloat*>(take(T * C * 2));
        a.pre = static_cast<bfloat*>(take(T * F * 2));
        a.u = static_cast<bfloat*>(take(T * F * 2));
        a.mean1 = static_cast<float*>(take(T * 4));
        a.rstd1 = static_cast<float*>(take(T * 4));
        a.lse = static_cast<float*>(take(T * H * 4));
        a.xmid = static_cast<float*>(take(T * C * 4));
        a.mean2 = static_cast<float*>(take(T * 4));
        a.rstd2 = static_cast<float*>(take(T * 4));
      }
      hidden = static_cast<bfloat*>(take(T * C * 2));
      dhidden = static_cast<bfloat*>(take(T * C * 2));
      meanf = static_cast<float*>(take(T * 4));
      rstdf = static_cast<float*>(take(T * 4));
      for (bfloat** p : {&hm, &zpre, &z, &zn, &dzn, &dz, &dzpre, &dhm})
        *p = static_cast<bfloat*>(take(Mr * C * 2));
      meanh = static_cast<float*>(take(Mr * 4));
      rstdh = static_cast<float*>(take(Mr * 4));
      logits = static_cast<float*>(take(Mr * kLogitsLd * 4));
      dlogits = static_cast<bfloat*>(take(Mr * kLogitsLd * 2));
      g = static_cast<float*>(take(T * C * 4));
      dh = static_cast<float*>(take(T * C * 4));
      delta = static_cast<float*>(take(T * H * 4));
      scratch = static_cast<float*>(take(std::max<std::int64_t>(3 * C, F) * 4 + 64 * 4));
      gb = static_cast<bfloat*>(take(T * C * 2));
      du = static_cast<bfloat*>(take(T * F * 2));
      dh2 = static_cast<bfloat*>(take(T * C * 2));
      dout = static_cast<bfloat*>(take(T * C * 2));
      dqkv = static_cast<bfloat*>(take(T * 3 * C * 2));
      tokens_d = static_cast<std::uint8_t*>(take(T));
      cu_d = static_cast<std::int32_t*>(take((n + 1) * 4));
      pos_d = static_cast<std::int32_t*>(take(T * 4));
      qkv_grad = static_cast<float*>(take((3 * C * C + 3 * C) * 4));
      rows_d = static_cast<std::int32_t*>(take(Mr * 4));
      labels_d = static_cast<std::int32_t*>(take(Mr * 4));
      loss_d = static_cast<double*>(take(8));
    };
    carve();  // measure
    if (arena) cudaFree(arena);
    arena = nullptr;
    PLM_CHECK_CUDA(cudaMalloc(&arena, used));
    arena_bytes = used;
    base = static_cast<char*>(arena);
    carve();
    cap_t = T;
    cap_m = M;
    cap_n = n;
  }

  // Row-major GEMM helper.
  void mm(Stream st, bool ta, bool tb, std::int64_t m, std::int64_t n, std::int64_t k,
          const void* a, std::int64_t lda, const void* b, std::int64_t ldb, void* d,
          std::int64_t ldd, DType dt, float beta = 0.0f, Epilogue epi = Epilogue::None,
          const void* bias = nullptr, void* aux = nullptr, std::int64_t ldaux = 0,
          void* bias_grad = nullptr, const void* c = nullptr, std::int64_t ldc = 0) {
    GemmArgs x;
    x.trans_a = ta;
    x.trans_b = tb;
    x.m = m;
    x.n = n;
    x.k = k;
    x.a = a;
    x.lda = lda;
    x.b = b;
    x.ldb = ldb;
    x.d = d;
    x.ldd = ldd;
    x.d_type = dt;
    x.beta = beta;
    x.epilogue = epi;
    x.bias = bias;
    x.aux = aux;
    x.ldaux = ldaux;
    x.bias_grad = bias_grad;
    x.c = c;
    x.ldc = ldc;
    gemm.run(st, x);
    mark(kGemm);
  }

  // Weight gradient of a Linear layer: gW (out, in) += dy^T x; gb (out) += sum_rows dy.
  void linearGrad(Stream st, std::int64_t rows, std::int64_t out, std::int64_t in, const bfloat* dy,
                  std::int64_t lddy, const bfloat* x, std::int64_t ldx, float* gw, float* gbias) {
    mm(st, true, false, out, in, rows, dy, lddy, x, ldx, gw, in, DType::F32, 1.0f, Epilogue::BGradA,
       nullptr, nullptr, 0, scratch);
    addKernel<<<gridCap(blocksFor(out, 256)), 256, 0, st>>>(gbias, scratch, out);
    mark(kOther);
  }

  void rotaryQK(Stream st, bfloat* qkv, std::int64_t T, bool inverse, float q_scale) {
    const int Dh = s.hidden / s.heads;
    std::int64_t work = T * s.heads * (Dh / 4);
    rotaryQKKernel<<<blocksFor(work, 256), 256, 0, st>>>(
        qkv, 3 * s.hidden, s.hidden, pos_d, T, s.heads, Dh, inverse ? -1.0f : 1.0f, q_scale);
    mark(kOther);
  }

  template <class TX> void lnForward(Stream st, const TX* x, const float* gamma, const float* beta,
                                     bfloat* y, float* mean, float* rstd, std::int64_t rows) {
    lnForwardKernel<TX>
        <<<blocksFor(rows, 8), 256, 0, st>>>(x, gamma, beta, y, mean, rstd, rows, s.hidden, s.eps);
    mark(kLayerNorm);
  }

  template <class TX, class TDY>
  void lnBackward(Stream st, const TDY* dy, const TX* x, const float* gamma, const float* mean,
                  const float* rstd, float* gres, bfloat* gbf, float* dgamma, float* dbeta,
                  std::int64_t rows, bool residual, bool accumulate) {
    const int pairs_per_lane = (s.hidden / 2 + 31) / 32;
    if (pairs_per_lane <= 4)
      lnBackwardJ<TX, TDY, 4>(st, dy, x, gamma, mean, rstd, gres, gbf, dgamma, dbeta, rows,
                              residual, accumulate);
    else if (pairs_per_lane <= 10)
      lnBackwardJ<TX, TDY, 10>(st, dy, x, gamma, mean, rstd, gres, gbf, dgamma, dbeta, rows,
                               residual, accumulate);
    else if (pairs_per_lane <= 20)
      lnBackwardJ<TX, TDY, 20>(st, dy, x, gamma, mean, rstd, gres, gbf, dgamma, dbeta, rows,
                               residual, accumulate);
    else if (pairs_per_lane <= 40)
      lnBackwardJ<TX, TDY, 40>(st, dy, x, gamma, mean, rstd, gres, gbf, dgamma, dbeta, rows,
                               residual, accumulate);
    else
      throw Error("plm::gpu::Esm2Bf16: hidden " + std::to_string(s.hidden) +
                  " is larger than the LayerNorm kernels support (5120)");
    mark(kLayerNorm);
  }

  template <class TX, class TDY, int J>
  void lnBackwardJ(Stream st, const TDY* dy, const TX* x, const float* gamma, const float* mean,
                   const float* rstd, float* gres, bfloat* gbf, float* dgamma, float* dbeta,
                   std::int64_t rows, bool residual, bool accumulate) {
    int smem = 2 * s.hidden * 4;
    if (smem > 48 * 1024)
      PLM_CHECK_CUDA(cudaFuncSetAttribute(lnBackwardKernel<TX, TDY, J>,
                                          cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    // About 11 rows per warp at 24K tokens: the dgamma/dbeta shared-memory adds happen once per
    // warp.  (Two rows per warp measured 27% slower at 650M: 37.8 against 29.7 ms per step.)
    int blocks = static_cast<int>(std::min<std::int64_t>(blocksFor(rows, 8 * 4), 132 * 2));
    lnBackwardKernel<TX, TDY, J><<<std::max(blocks, 1), 256, smem, st>>>(
        dy, x, gamma, mean, rstd, gres, gbf, dgamma, dbeta, rows, s.hidden, residual, accumulate);
  }

  double step(Stream st, const float* master, float* grads, const HostBatch& batch,
              double grad_scale) {
    const std::int64_t T = batch.num_tokens, C = s.hidden, F = s.ffn, V = s.vocab;
    const int H = s.heads, Dh = s.hidden / s.heads;
    rows_h.clear();
    labels_h.clear();
    for (std::int64_t t = 0; t < T; ++t)
      if (batch.labels[t] != -100) {
        rows_h.push_back(static_cast<std::int32_t>(t));
        labels_h.push_back(batch.labels[t]);
      }
    const std::int64_t M = static_cast<std::int64_t>(rows_h.size());
    reserve(T, M, batch.num_seqs);
    if (T == 0) return 0.0;

    PLM_CHECK_CUDA(cudaMemcpyAsync(tokens_d, batch.tokens, T, cudaMemcpyHostToDevice, st));
    PLM_CHECK_CUDA(cudaMemcpyAsync(cu_d, batch.cu_seqlens, (batch.num_seqs + 1) * 4,
                                   cudaMemcpyHostToDevice, st));
    if (M > 0) {
      PLM_CHECK_CUDA(cudaMemcpyAsync(rows_d, rows_h.data(), M * 4, cudaMemcpyHostToDevice, st));
      PLM_CHECK_CUDA(cudaMemcpyAsync(labels_d, labels_h.data(), M * 4, cudaMemcpyHostToDevice, st));
    }
    PLM_CHECK_CUDA(cudaMemsetAsync(loss_d, 0, 8, st));
    prof_stream = st;
    mark(kOther);
    packChunksKernel<<<num_chunks, 256, 0, st>>>(master, wb, chunks_dev);
    PLM_CHECK_CUDA(cudaGetLastError());
    mark(kOther);

    auto P = [&](std::int64_t o) { return master + o; };
    auto G = [&](std::int64_t o) { return grads + o; };
    const float q_scale = 1.0f / std::sqrt(static_cast<float>(Dh));

    FlashParams fp;
    fp.cu_seqlens = cu_d;
    fp.num_seqs = batch.num_seqs;
    fp.max_seqlen = batch.max_seqlen;
    fp.total_tokens = T;
    fp.heads = H;
    fp.head_dim = Dh;
    fp.softmax_scale = 1.0f;
    fp.q_stride = fp.k_stride = fp.v_stride = 3 * C;
    fp.o_stride = C;
    fp.dout_stride = C;
    fp.dq_stride = fp.dk_stride = fp.dv_stride = 3 * C;
    fp.delta = delta;

    positionsKernel<<<batch.num_seqs, 256, 0, st>>>(cu_d, pos_d);
    // ---- forward
    embeddingForward(st, tokens_d, reinterpret_cast<const bf16*>(wb + p_embed), xs[0], cu_d,
                     batch.num_seqs, static_cast<int>(C), s.mask_id, s.token_dropout);
    mark(kOther);
    for (int l = 0; l < s.layers; ++l) {
      const auto& L = off.layers[l];
      const auto& W = pl[l];
      auto& a = acts[l];
      lnForward(st, xs[l], P(L.ln1_g), P(L.ln1_b), a.h, a.mean1, a.rstd1, T);
      mm(st, false, true, T, 3 * C, C, a.h, C, wb + W.wqkv, C, a.qkv, 3 * C, DType::BF16, 0.0f,
         Epilogue::Bias, wb + W.bqkv);
      rotaryQK(st, a.qkv, T, false, q_scale);
      mark(kOther);
      fp.q = reinterpret_cast<const bf16*>(a.qkv);
      fp.k = reinterpret_cast<const bf16*>(a.qkv + C);
      fp.v = reinterpret_cast<const bf16*>(a.qkv + 2 * C);
      fp.o = reinterpret_cast<bf16*>(a.o);
      fp.lse = a.lse;
      flashAttentionForward(st, fp);
      mark(kAttention);
      mm(st, false, true, T, C, C, a.o, C, wb + W.wo, C, a.xmid, C, DType::F32, 1.0f,
         Epilogue::Bias, P(L.bo), nullptr, 0, nullptr, xs[l], C);
      lnForward(st, a.xmid, P(L.ln2_g), P(L.ln2_b), a.h2, a.mean2, a.rstd2, T);
      mm(st, false, true, T, F, C, a.h2, C, wb + W.w1, C, a.u, F, DType::BF16, 0.0f,
         Epilogue::BiasGeluAux, wb + W.b1, a.pre, F);
      mm(st, false, true, T, C, F, a.u, F, wb + W.w2, F, xs[l + 1], C, DType::F32, 1.0f,
         Epilogue::Bias, P(L.b2), nullptr, 0, nullptr, a.xmid, C);
    }
    lnForward(st, xs[s.layers], P(off.lnf_g), P(off.lnf_b), hidden, meanf, rstdf, T);

    // ---- LM head on the labelled rows, loss and dlogits
    if (M > 0) {
      gatherRowsKernel<<<gridCap(blocksFor(M * C / 8, 256)), 256, 0, st>>>(hidden, rows_d, hm, M,
                                                                           static_cast<int>(C));
      mark(kOther);
      mm(st, false, true, M, C, C, hm, C, wb + p_head_w, C, z, C, DType::BF16, 0.0f,
         Epilogue::BiasGeluAux, wb + p_head_b, zpre, C);
      lnForward(st, z, P(off.head_ln_g), P(off.head_ln_b), zn, meanh, rstdh, M);
      mm(st, false, true, M, V, C, zn, C, wb + p_embed, C, logits, kLogitsLd, DType::F32, 0.0f,
         Epilogue::Bias, P(off.head_bias));
      crossEntropy(st, logits, labels_d, reinterpret_cast<bf16*>(dlogits), loss_d, M,
                   static_cast<int>(V), static_cast<float>(grad_scale), kLogitsLd);
      mark(kOther);

      // ---- backward through the head
      linearGrad(st, M, V, C, dlogits, kLogitsLd, zn, C, G(off.embed), G(off.head_bias));
      mm(st, false, false, M, C, V, dlogits, kLogitsLd, wb + p_embed, C, dzn, C, DType::BF16);
      lnBackward(st, dzn, z, P(off.head_ln_g), meanh, rstdh, nullptr, dz, G(off.head_ln_g),
                 G(off.head_ln_b), M, false, false);
      geluBackwardKernel<<<gridCap(blocksFor(M * C, 256)), 256, 0, st>>>(dz, zpre, dzpre, M * C);
      mark(kOther);
      linearGrad(st, M, C, C, dzpre, C, hm, C, G(off.head_w), G(off.head_b));
      mm(st, false, false, M, C, C, dzpre, C, wb + p_head_w, C, dhm, C, DType::BF16);
    }
    PLM_CHECK_CUDA(cudaMemsetAsync(dhidden, 0, T * C * 2, st));
    if (M > 0)
      scatterRowsKernel<<<gridCap(blocksFor(M * C / 8, 256)), 256, 0, st>>>(dhm, rows_d, dhidden, M,
                                                                            static_cast<int>(C));
    mark(kOther);
    lnBackward(st, dhidden, xs[s.layers], P(off.lnf_g), meanf, rstdf, g, gb, G(off.lnf_g),
               G(off.lnf_b), T, true, false);

    // ---- backward through the blocks; g / gb hold dL/d(residual stream)
    for (int l = s.layers - 1; l >= 0; --l) {
      const auto& L = off.layers[l];
      const auto& W = pl[l];
      auto& a = acts[l];
      linearGrad(st, T, C, F, gb, C, a.u, F, G(L.w2), G(L.b2));
      mm(st, false, false, T, F, C, gb, C, wb + W.w2, F, du, F, DType::BF16, 0.0f, Epilogue::DGelu,
         nullptr, a.pre, F);
      linearGrad(st, T, F, C, du, F, a.h2, C, G(L.w1), G(L.b1));
      mm(st, false, false, T, C, F, du, F, wb + W.w1, C, dh2, C, DType::BF16);
      lnBackward(st, dh2, a.xmid, P(L.ln2_g), a.mean2, a.rstd2, g, gb, G(L.ln2_g), G(L.ln2_b), T,
                 true, true);
      linearGrad(st, T, C, C, gb, C, a.o, C, G(L.wo), G(L.bo));
      mm(st, false, false, T, C, C, gb, C, wb + W.wo, C, dout, C, DType::BF16);
      fp.q = reinterpret_cast<const bf16*>(a.qkv);
      fp.k = reinterpret_cast<const bf16*>(a.qkv + C);
      fp.v = reinterpret_cast<const bf16*>(a.qkv + 2 * C);
      fp.o = reinterpret_cast<bf16*>(a.o);
      fp.lse = a.lse;
      fp.dout = reinterpret_cast<const bf16*>(dout);
      fp.dq = reinterpret_cast<bf16*>(dqkv);
      fp.dk = reinterpret_cast<bf16*>(dqkv + C);
      fp.dv = reinterpret_cast<bf16*>(dqkv + 2 * C);
      flashAttentionBackward(st, fp);
      mark(kAttention);
      rotaryQK(st, dqkv, T, true, q_scale);
      mark(kOther);
      // One (3C, C) weight-gradient GEMM for q, k and v, then added into their three tensors.
      mm(st, true, false, 3 * C, C, T, dqkv, 3 * C, a.h, C, qkv_grad, C, DType::F32, 0.0f,
         Epilogue::BGradA, nullptr, nullptr, 0, qkv_grad + 3 * C * C);
      for (int part = 0; part < 3; ++part) {
        std::int64_t w_off = part == 0 ? L.wq : part == 1 ? L.wk : L.wv;
        std::int64_t b_off = part == 0 ? L.bq : part == 1 ? L.bk : L.bv;
        addKernel<<<gridCap(blocksFor(C * C, 256)), 256, 0, st>>>(G(w_off), qkv_grad + part * C * C,
                                                                  C * C);
        addKernel<<<gridCap(blocksFor(C, 256)), 256, 0, st>>>(G(b_off),
                                                              qkv_grad + 3 * C * C + part * C, C);
      }
      mark(kOther);
      mm(st, false, false, T, C, 3 * C, dqkv, 3 * C, wb + W.wqkv, C, dh, C, DType::F32);
      lnBackward(st, dh, xs[l], P(L.ln1_g), a.mean1, a.rstd1, g, gb, G(L.ln1_g), G(L.ln1_b), T,
                 true, true);
    }
    embeddingBackward(st, tokens_d, reinterpret_cast<const bf16*>(gb), G(off.embed), cu_d,
                      batch.num_seqs, static_cast<int>(V), static_cast<int>(C), s.mask_id,
                      s.token_dropout, s.pad_id);
    PLM_CHECK_CUDA(cudaGetLastError());
    mark(kOther);
    collect();
    double loss = 0.0;
    PLM_CHECK_CUDA(cudaMemcpyAsync(&loss, loss_d, 8, cudaMemcpyDeviceToHost, st));
    PLM_CHECK_CUDA(cudaStreamSynchronize(st));
    return loss;
  }
};

Esm2Bf16::Esm2Bf16(const Esm2Shape& shape, const Esm2Offsets& offsets)
    : impl_member(std::make_unique<Impl>(shape, offsets)) {}

Esm2Bf16::~Esm2Bf16() = default;

double Esm2Bf16::forwardBackward(Stream stream, const float* master, float* grads,
                                 const HostBatch& batch, double grad_scale) {
  return impl_member->step(stream, master, grads, batch, grad_scale);
}

void Esm2Bf16::setProfiling(bool on) {
  impl_member->profiling = on;
  for (double& t : impl_member->totals) t = 0;
  impl_member->marks = 0;
}

std::vector<std::pair<std::string, double>> Esm2Bf16::profile() const {
  const char* names[] = {"gemm (cuBLASLt)", "flash attention", "layernorm", "other fused"};
  std::vector<std::pair<std::string, double>> out;
  for (int k = 0; k < Impl::kKinds; ++k) out.emplace_back(names[k], impl_member->totals[k]);
  return out;
}

std::size_t Esm2Bf16::deviceBytes() const {
  return impl_member->arena_bytes + impl_member->packed_total * 2 + (32u << 20);
}

}  // namespace plm::gpu
