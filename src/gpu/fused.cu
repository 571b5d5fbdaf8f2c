// Fused memory-bound kernels (see fused.hpp).  Row kernels give one warp to a row and read it
// with bf16x2 loads; statistics and reductions are fp32, loss sums double.
#include "gpu/fused.hpp"

#include "core/error.hpp"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

namespace plm::gpu {

namespace {

using bfloat = __nv_bfloat16;

__device__ __forceinline__ float warpSum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}
__device__ __forceinline__ float warpMax(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

__device__ __forceinline__ float2 load2(const bf16* p, std::int64_t i) {
  return __bfloat1622float2(reinterpret_cast<const __nv_bfloat162*>(p)[i]);
}
__device__ __forceinline__ void store2(bf16* p, std::int64_t i, float a, float b) {
  reinterpret_cast<__nv_bfloat162*>(p)[i] = __floats2bfloat162_rn(a, b);
}

unsigned blocksFor(std::int64_t work, int per_block) {
  return static_cast<unsigned>((work + per_block - 1) / per_block);
}

// --------------------------------------------------------------------------------------------
// Rotary

// One thread rotates V adjacent dimension pairs (i, i + half) of one head of q and of k, with
// bf16x2 loads when V = 2 (half even, every ESM-2 head size).  Positions come precomputed.
template <int V> __global__ void rotaryKernel(bf16* q, std::int64_t q_stride, bf16* k,
                                              std::int64_t k_stride, const std::int32_t* positions,
                                              std::int64_t tokens, int heads, int head_dim,
                                              float sign, float q_scale) {
  const int half = head_dim / 2, groups = half / V;
  std::int64_t idx = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
  std::int64_t per_token = static_cast<std::int64_t>(heads) * groups;
  if (idx >= tokens * per_token) return;
  std::int64_t t = idx / per_token;
  int rem = static_cast<int>(idx % per_token);
  int h = rem / groups, i = V * (rem % groups);
  const float pos = static_cast<float>(positions[t]);
  float c[V], sn[V];
#pragma unroll
  for (int e = 0; e < V; ++e) {
    // Hugging Face: inv_freq = 1 / 10000^(2i/D) in fp32, angle = pos * inv_freq.
    float inv_freq = 1.0f / powf(10000.0f, static_cast<float>(2 * (i + e)) / head_dim);
    sincosf(pos * inv_freq, &sn[e], &c[e]);
    sn[e] *= sign;
  }
  bfloat* rows[2] = {reinterpret_cast<bfloat*>(q) + t * q_stride + h * head_dim,
                     reinterpret_cast<bfloat*>(k) + t * k_stride + h * head_dim};
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float f = r == 0 ? q_scale : 1.0f;
    if constexpr (V == 2) {
      float2 x1 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(rows[r] + i));
      float2 x2 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(rows[r] + i + half));
      *reinterpret_cast<__nv_bfloat162*>(rows[r] + i) =
          __floats2bfloat162_rn(f * (x1.x * c[0] - x2.x * sn[0]), f * (x1.y * c[1] - x2.y * sn[1]));
      *reinterpret_cast<__nv_bfloat162*>(rows[r] + i + half) =
          __floats2bfloat162_rn(f * (x2.x * c[0] + x1.x * sn[0]), f * (x2.y * c[1] + x1.y * sn[1]));
    } else {
      float x1 = __bfloat162float(rows[r][i]), x2 = __bfloat162float(rows[r][i + half]);
      rows[r][i] = __float2bfloat16(f * (x1 * c[0] - x2 * sn[0]));
      rows[r][i + half] = __float2bfloat16(f * (x2 * c[0] + x1 * sn[0]));
    }
  }
}

// --------------------------------------------------------------------------------------------
// Embedding with token dropout

__device__ float tokenDropoutScale(const std::uint8_t* ids, std::int64_t start, int len,
                                   int mask_id, bool token_dropout, int* shared_count) {
  if (!token_dropout) return 1.0f;
  if (threadIdx.x == 0) *shared_count = 0;
  __syncthreads();
  int count = 0;
  for (int i = threadIdx.x; i < len; i += blockDim.x) count += ids[start + i] == mask_id;
  atomicAdd(shared_count, count);
  __syncthreads();
  float observed = static_cast<float>(*shared_count) / static_cast<float>(len);
  return (1.0f - 0.15f * 0.8f) / (1.0f - observed);
}

// Block = (sequence, 128-column chunk), so short batches still fill the machine.
template <class TOut> __global__ void embeddingForwardKernel(const std::uint8_t* ids,
                                                             const bf16* weight, TOut* out,
                                                             const std::int32_t* cu, int cols,
                                                             int mask_id, bool token_dropout) {
  __shared__ int count;
  int s = blockIdx.x;
  std::int64_t start = cu[s];
  int len = cu[s + 1] - cu[s];
  float scale = tokenDropoutScale(ids, start, len, mask_id, token_dropout, &count);
  int pair0 = blockIdx.y * 64;
  int pairs = min(64, cols / 2 - pair0);
  for (std::int64_t i = threadIdx.x; i < static_cast<std::int64_t>(len) * pairs; i += blockDim.x) {
    std::int64_t t = start + i / pairs;
    int c = pair0 + static_cast<int>(i % pairs);
    int id = ids[t];
    float2 w = load2(weight + static_cast<std::int64_t>(id) * cols, c);
    float f = (token_dropout && id == mask_id) ? 0.0f : scale;
    if constexpr (sizeof(TOut) == 4) {
      reinterpret_cast<float2*>(out + t * cols)[c] = make_float2(w.x * f, w.y * f);
    } else {
      store2(reinterpret_cast<bf16*>(out) + t * cols, c, w.x * f, w.y * f);
    }
  }
}

// Block = (sequence, 128-column chunk); shared (vocab, 128) accumulator, one column per thread.
// Each block writes its sequence's partial (vocab, cols) slice; a second kernel adds the slices in
// sequence order, so the result does not depend on scheduling (no float atomics).
__global__ void embeddingBackwardKernel(const std::uint8_t* ids, const bf16* dout, float* partial,
                                        const std::int32_t* cu, int vocab, int cols, int mask_id,
                                        bool token_dropout, int padding_id) {
  extern __shared__ float acc[];  // (vocab, 128)
  __shared__ int count;
  int s = blockIdx.x;
  std::int64_t start = cu[s];
  int len = cu[s + 1] - cu[s];
  float scale = tokenDropoutScale(ids, start, len, mask_id, token_dropout, &count);
  for (int i = threadIdx.x; i < vocab * 128; i += blockDim.x) acc[i] = 0.0f;
  __syncthreads();
  int c = blockIdx.y * 128 + threadIdx.x;
  if (c < cols) {
    // Tokens in order (the sum's order is fixed), their loads kUnroll at a time in flight: one
    // dependent load per token left the kernel waiting on memory (0.3 ms per 65,536-token
    // micro-batch at ESM-2 8M's shape on an H200).
    constexpr int kUnroll = 8;
    const bfloat* col = reinterpret_cast<const bfloat*>(dout) + start * cols + c;
    auto add = [&](int id, float v) {
      if ((token_dropout && id == mask_id) || id == padding_id) return;
      acc[id * 128 + threadIdx.x] += scale * v;
    };
    int i = 0;
    for (; i + kUnroll <= len; i += kUnroll) {
      int id[kUnroll];
      float v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        id[u] = ids[start + i + u];
        v[u] = __bfloat162float(col[static_cast<std::int64_t>(i + u) * cols]);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) add(id[u], v[u]);
    }
    for (; i < len; ++i)
      add(ids[start + i], __bfloat162float(col[static_cast<std::int64_t>(i) * cols]));
  }
  __syncthreads();
  if (c < cols) {
    float* out = partial + static_cast<std::int64_t>(s) * vocab * cols;
    for (int v = 0; v < vocab; ++v)
      out[static_cast<std::int64_t>(v) * cols + c] = acc[v * 128 + threadIdx.x];
  }
}

// dweight[e] += sum over sequences s (in order) of partial[s][e], e over vocab * cols.
__global__ void addSlicesKernel(const float* partial, int slices, std::int64_t n, float* dweight) {
  std::int64_t e = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
  if (e >= n) return;
  float sum = 0.0f;
  for (int s = 0; s < slices; ++s) sum += partial[s * n + e];
  dweight[e] += sum;
}

// --------------------------------------------------------------------------------------------
// Cross-entropy

__global__ void crossEntropyKernel(const float* logits, const std::int32_t* labels, bf16* dlogits,
                                   double* loss_sum, std::int64_t rows, int vocab, float grad_scale,
                                   int ld) {
  std::int64_t row = blockIdx.x * static_cast<std::int64_t>(blockDim.x / 32) + threadIdx.x / 32;
  int lane = threadIdx.x & 31;
  if (row >= rows) return;
  const float* lr = logits + row * ld;
  bfloat* dr = reinterpret_cast<bfloat*>(dlogits) + row * ld;
  int label = labels[row];
  for (int i = vocab + lane; i < ld; i += 32) dr[i] = __float2bfloat16(0.0f);
  if (label < 0) {
    for (int i = lane; i < vocab; i += 32) dr[i] = __float2bfloat16(0.0f);
    return;
  }
  float mx = -INFINITY;
  for (int i = lane; i < vocab; i += 32) mx = fmaxf(mx, lr[i]);
  mx = warpMax(mx);
  float se = 0.0f;
  for (int i = lane; i < vocab; i += 32) se += expf(lr[i] - mx);
  se = warpSum(se);
  float lse = mx + logf(se);
  for (int i = lane; i < vocab; i += 32) {
    float p = expf(lr[i] - lse);
    dr[i] = __float2bfloat16(grad_scale * (p - (i == label ? 1.0f : 0.0f)));
  }
  if (lane == 0) atomicAdd(loss_sum, static_cast<double>(lse - lr[label]));
}

__global__ void sumSquaresKernel(const float* x, std::int64_t n, double* out) {
  float s = 0.0f;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
    s += x[i] * x[i];
  s = warpSum(s);
  __shared__ float partial[32];
  if ((threadIdx.x & 31) == 0) partial[threadIdx.x / 32] = s;
  __syncthreads();
  if (threadIdx.x < 32) {
    float v = threadIdx.x < blockDim.x / 32 ? partial[threadIdx.x] : 0.0f;
    v = warpSum(v);
    if (threadIdx.x == 0) atomicAdd(out, static_cast<double>(v));
  }
}

// --------------------------------------------------------------------------------------------
// AdamW

__global__ void adamwKernel(float* master, const float* grad, float* m, float* v, bf16* param,
                            std::int64_t n, const std::int64_t* seg, const std::uint8_t* decay,
                            int num_segments, AdamWParams p) {
  float scale = p.grad_scale;
  if (p.max_norm > 0.0f && p.grad_sumsq != nullptr) {
    float norm = static_cast<float>(sqrt(*p.grad_sumsq)) * p.grad_scale;
    if (norm > p.max_norm) scale *= p.max_norm / (norm + 1e-6f);
  }
  float bc1 = 1.0f - powf(p.beta1, static_cast<float>(p.step));
  float bc2 = 1.0f - powf(p.beta2, static_cast<float>(p.step));
  float step_size = p.lr / bc1;
  float inv_sqrt_bc2 = rsqrtf(bc2);
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    int lo = 0, hi = num_segments;  // seg[lo] <= i < seg[hi]
    while (hi - lo > 1) {
      int mid = (lo + hi) / 2;
      if (seg[mid] <= i)
        lo = mid;
      else
        hi = mid;
    }
    float g = grad[i] * scale;
    float w = master[i];
    if (decay[lo]) w -= p.lr * p.weight_decay * w;  // decoupled decay (torch.optim.AdamW)
    float mi = p.beta1 * m[i] + (1.0f - p.beta1) * g;
    float vi = p.beta2 * v[i] + (1.0f - p.beta2) * g * g;
    w -= step_size * mi / (sqrtf(vi) * inv_sqrt_bc2 + p.eps);
    m[i] = mi;
    v[i] = vi;
    master[i] = w;
    if (param) reinterpret_cast<bfloat*>(param)[i] = __float2bfloat16(w);
  }
}

// Grid-stride kernels: at most 16 blocks of 256 threads per multiprocessor (two waves of resident
// blocks), the device's own count.
int gridCap(std::int64_t blocks) {
  return static_cast<int>(std::min<std::int64_t>(blocks, std::int64_t(multiprocessorCount()) * 16));
}

// --------------------------------------------------------------------------------------------
// Row gather/scatter, GELU backward, adds and casts

// gather and scatter are mirror images (which side is indexed by rows[r]); kept as two kernels
// so each store stays a plain vectorised copy.
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

__device__ __forceinline__ float geluTanhGrad(float x) {
  const float c = 0.7978845608028654f;  // sqrt(2 / pi)
  const float t = tanhf(c * (x + 0.044715f * x * x * x));
  return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * c * (1.0f + 3.0f * 0.044715f * x * x);
}

// dx = dy * gelu'(pre), 8 elements (16 bytes of each operand) per thread and step where all
// three are 16-byte aligned, the rest one at a time (dx may be dy: each element is read before
// it is written, by the same thread).
__global__ void geluTanhBackwardKernel(const bfloat* dy, const bfloat* pre, bfloat* dx,
                                       std::int64_t n, bool vec8) {
  const std::int64_t stride = std::int64_t(gridDim.x) * blockDim.x;
  const std::int64_t first = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x;
  const std::int64_t n8 = vec8 ? n / 8 : 0;
  for (std::int64_t v = first; v < n8; v += stride) {
    uint4 g = reinterpret_cast<const uint4*>(dy)[v];
    const uint4 x = reinterpret_cast<const uint4*>(pre)[v];
    __nv_bfloat162* g2 = reinterpret_cast<__nv_bfloat162*>(&g);
    const __nv_bfloat162* x2 = reinterpret_cast<const __nv_bfloat162*>(&x);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float2 gf = __bfloat1622float2(g2[e]), xf = __bfloat1622float2(x2[e]);
      g2[e] = __floats2bfloat162_rn(gf.x * geluTanhGrad(xf.x), gf.y * geluTanhGrad(xf.y));
    }
    reinterpret_cast<uint4*>(dx)[v] = g;
  }
  for (std::int64_t i = n8 * 8 + first; i < n; i += stride)
    dx[i] = __float2bfloat16(__bfloat162float(dy[i]) * geluTanhGrad(__bfloat162float(pre[i])));
}

__global__ void swigluForwardKernel(const bfloat* pre, bfloat* act, std::int64_t rows, int f) {
  const std::int64_t n = rows * f;
  for (std::int64_t i = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; i < n;
       i += std::int64_t(gridDim.x) * blockDim.x) {
    const std::int64_t r = i / f, c = i - r * f;
    const float g = __bfloat162float(pre[r * 2 * f + c]);
    const float u = __bfloat162float(pre[r * 2 * f + f + c]);
    act[i] = __float2bfloat16(g / (1.0f + __expf(-g)) * u);
  }
}

__global__ void swigluBackwardKernel(const bfloat* pre, const bfloat* dact, bfloat* dpre,
                                     std::int64_t rows, int f) {
  const std::int64_t n = rows * f;
  for (std::int64_t i = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; i < n;
       i += std::int64_t(gridDim.x) * blockDim.x) {
    const std::int64_t r = i / f, c = i - r * f;
    const float g = __bfloat162float(pre[r * 2 * f + c]);
    const float u = __bfloat162float(pre[r * 2 * f + f + c]);
    const float d = __bfloat162float(dact[i]);
    const float s = 1.0f / (1.0f + __expf(-g));
    dpre[r * 2 * f + c] = __float2bfloat16(d * u * s * (1.0f + g * (1.0f - s)));
    dpre[r * 2 * f + f + c] = __float2bfloat16(d * g * s);
  }
}

__global__ void addKernel(float* dst, const float* src, std::int64_t n) {
  for (std::int64_t i = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; i < n;
       i += std::int64_t(gridDim.x) * blockDim.x)
    dst[i] += src[i];
}

__global__ void castChunksKernel(const float* src, bfloat* dst, const std::int64_t* chunks) {
  std::int64_t so = chunks[3 * blockIdx.x], d = chunks[3 * blockIdx.x + 1],
               n = chunks[3 * blockIdx.x + 2];
  for (std::int64_t i = threadIdx.x; i < n; i += blockDim.x)
    dst[d + i] = __float2bfloat16(src[so + i]);
}

__global__ void castToFloatKernel(const bfloat* src, float* dst, std::int64_t n) {
  for (std::int64_t i = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; i < n;
       i += std::int64_t(gridDim.x) * blockDim.x)
    dst[i] = __bfloat162float(src[i]);
}

}  // namespace

void rotary(Stream stream, bf16* q, std::int64_t q_stride, bf16* k, std::int64_t k_stride,
            const std::int32_t* positions, std::int64_t tokens, int heads, int head_dim,
            bool inverse, float q_scale) {
  if (tokens == 0) return;
  PLM_REQUIRE(head_dim % 2 == 0, "plm::gpu::rotary: head_dim must be even");
  const float sign = inverse ? -1.0f : 1.0f;
  // bf16x2 access needs even element offsets: even half, even strides.
  const bool pairs = (head_dim / 2) % 2 == 0 && q_stride % 2 == 0 && k_stride % 2 == 0;
  const std::int64_t work = tokens * heads * (head_dim / 2) / (pairs ? 2 : 1);
  if (pairs)
    rotaryKernel<2><<<blocksFor(work, 256), 256, 0, stream>>>(
        q, q_stride, k, k_stride, positions, tokens, heads, head_dim, sign, q_scale);
  else
    rotaryKernel<1><<<blocksFor(work, 256), 256, 0, stream>>>(
        q, q_stride, k, k_stride, positions, tokens, heads, head_dim, sign, q_scale);
  PLM_CHECK_CUDA(cudaGetLastError());
}

namespace {

template <class TOut> void launchEmbeddingForward(Stream stream, const std::uint8_t* ids,
                                                  const bf16* weight, TOut* out,
                                                  const std::int32_t* cu_seqlens, int num_seqs,
                                                  int cols, int mask_id, bool token_dropout) {
  if (num_seqs == 0) return;
  PLM_REQUIRE(cols % 2 == 0, "plm::gpu::embeddingForward: cols must be even");
  dim3 grid(num_seqs, (cols / 2 + 63) / 64);
  embeddingForwardKernel<TOut>
      <<<grid, 256, 0, stream>>>(ids, weight, out, cu_seqlens, cols, mask_id, token_dropout);
  PLM_CHECK_CUDA(cudaGetLastError());
}

}  // namespace

void embeddingForward(Stream stream, const std::uint8_t* ids, const bf16* weight, bf16* out,
                      const std::int32_t* cu_seqlens, int num_seqs, int cols, int mask_id,
                      bool token_dropout) {
  launchEmbeddingForward(stream, ids, weight, out, cu_seqlens, num_seqs, cols, mask_id,
                         token_dropout);
}

void embeddingForward(Stream stream, const std::uint8_t* ids, const bf16* weight, float* out,
                      const std::int32_t* cu_seqlens, int num_seqs, int cols, int mask_id,
                      bool token_dropout) {
  launchEmbeddingForward(stream, ids, weight, out, cu_seqlens, num_seqs, cols, mask_id,
                         token_dropout);
}

std::size_t embeddingBackwardWorkspace(int num_seqs, int vocab, int cols) {
  return static_cast<std::size_t>(num_seqs) * vocab * cols * sizeof(float);
}

void embeddingBackward(Stream stream, const std::uint8_t* ids, const bf16* dout, float* dweight,
                       const std::int32_t* cu_seqlens, int num_seqs, int vocab, int cols,
                       int mask_id, bool token_dropout, int padding_id, void* workspace) {
  if (num_seqs == 0) return;
  int smem = vocab * 128 * static_cast<int>(sizeof(float));
  if (smem > 48 * 1024)
    PLM_CHECK_CUDA(cudaFuncSetAttribute(embeddingBackwardKernel,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  auto* partial = static_cast<float*>(workspace);
  dim3 grid(num_seqs, (cols + 127) / 128);
  embeddingBackwardKernel<<<grid, 128, smem, stream>>>(ids, dout, partial, cu_seqlens, vocab, cols,
                                                       mask_id, token_dropout, padding_id);
  PLM_CHECK_CUDA(cudaGetLastError());
  const std::int64_t n = static_cast<std::int64_t>(vocab) * cols;
  addSlicesKernel<<<blocksFor(n, 256), 256, 0, stream>>>(partial, num_seqs, n, dweight);
  PLM_CHECK_CUDA(cudaGetLastError());
}

void crossEntropy(Stream stream, const float* logits, const std::int32_t* labels, bf16* dlogits,
                  double* loss_sum, std::int64_t rows, int vocab, float grad_scale, int ld) {
  if (rows == 0) return;
  crossEntropyKernel<<<blocksFor(rows, 8), 256, 0, stream>>>(
      logits, labels, dlogits, loss_sum, rows, vocab, grad_scale, ld > 0 ? ld : vocab);
  PLM_CHECK_CUDA(cudaGetLastError());
}

void gatherRows(Stream stream, const bf16* src, const std::int32_t* rows, bf16* dst, std::int64_t m,
                int cols) {
  if (m == 0) return;
  gatherRowsKernel<<<gridCap(blocksFor(m * cols / 8, 256)), 256, 0, stream>>>(
      reinterpret_cast<const bfloat*>(src), rows, reinterpret_cast<bfloat*>(dst), m, cols);
  PLM_CHECK_CUDA(cudaGetLastError());
}

void scatterRows(Stream stream, const bf16* src, const std::int32_t* rows, bf16* dst,
                 std::int64_t m, int cols) {
  if (m == 0) return;
  scatterRowsKernel<<<gridCap(blocksFor(m * cols / 8, 256)), 256, 0, stream>>>(
      reinterpret_cast<const bfloat*>(src), rows, reinterpret_cast<bfloat*>(dst), m, cols);
  PLM_CHECK_CUDA(cudaGetLastError());
}

void geluTanhBackward(Stream stream, const bf16* dy, const bf16* pre, bf16* dx, std::int64_t n) {
  if (n == 0) return;
  const bool vec8 = (reinterpret_cast<std::uintptr_t>(dy) | reinterpret_cast<std::uintptr_t>(pre) |
                     reinterpret_cast<std::uintptr_t>(dx)) %
                        16 ==
                    0;
  geluTanhBackwardKernel<<<gridCap(blocksFor(vec8 ? (n + 7) / 8 : n, 256)), 256, 0, stream>>>(
      reinterpret_cast<const bfloat*>(dy), reinterpret_cast<const bfloat*>(pre),
      reinterpret_cast<bfloat*>(dx), n, vec8);
  PLM_CHECK_CUDA(cudaGetLastError());
}

void swigluForward(Stream stream, const bf16* pre, bf16* act, std::int64_t rows, int f) {
  if (rows == 0 || f == 0) return;
  swigluForwardKernel<<<gridCap(blocksFor(rows * f, 256)), 256, 0, stream>>>(
      reinterpret_cast<const bfloat*>(pre), reinterpret_cast<bfloat*>(act), rows, f);
  PLM_CHECK_CUDA(cudaGetLastError());
}

void swigluBackward(Stream stream, const bf16* pre, const bf16* dact, bf16* dpre, std::int64_t rows,
                    int f) {
  if (rows == 0 || f == 0) return;
  swigluBackwardKernel<<<gridCap(blocksFor(rows * f, 256)), 256, 0, stream>>>(
      reinterpret_cast<const bfloat*>(pre), reinterpret_cast<const bfloat*>(dact),
      reinterpret_cast<bfloat*>(dpre), rows, f);
  PLM_CHECK_CUDA(cudaGetLastError());
}

void addInto(Stream stream, float* dst, const float* src, std::int64_t n) {
  if (n == 0) return;
  addKernel<<<gridCap(blocksFor(n, 256)), 256, 0, stream>>>(dst, src, n);
  PLM_CHECK_CUDA(cudaGetLastError());
}

void castChunks(Stream stream, const float* src, bf16* dst, const std::int64_t* chunks,
                int num_chunks) {
  if (num_chunks == 0) return;
  castChunksKernel<<<num_chunks, 256, 0, stream>>>(src, reinterpret_cast<bfloat*>(dst), chunks);
  PLM_CHECK_CUDA(cudaGetLastError());
}

void castToFloat(Stream stream, const bf16* src, float* dst, std::int64_t n) {
  if (n == 0) return;
  castToFloatKernel<<<gridCap(blocksFor(n, 256)), 256, 0, stream>>>(
      reinterpret_cast<const bfloat*>(src), dst, n);
  PLM_CHECK_CUDA(cudaGetLastError());
}

void sumSquares(Stream stream, const float* x, std::int64_t n, double* out) {
  if (n == 0) return;
  sumSquaresKernel<<<gridCap(blocksFor(n, 256)), 256, 0, stream>>>(x, n, out);
  PLM_CHECK_CUDA(cudaGetLastError());
}

void adamwStep(Stream stream, float* master, const float* grad, float* m, float* v,
               bf16* param_bf16, std::int64_t n, const std::int64_t* seg_offsets,
               const std::uint8_t* seg_decay, int num_segments, const AdamWParams& p) {
  if (n == 0) return;
  adamwKernel<<<gridCap(blocksFor(n, 256)), 256, 0, stream>>>(
      master, grad, m, v, param_bf16, n, seg_offsets, seg_decay, num_segments, p);
  PLM_CHECK_CUDA(cudaGetLastError());
}

}  // namespace plm::gpu
