// bf16 ring attention's elementwise kernels (see ring_attention.hpp for the design).
#include "gpu/ring_attention.hpp"

#include "core/error.hpp"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>

namespace plm::gpu {

namespace {

using bfloat = __nv_bfloat16;

constexpr int kThreads = 256;

unsigned blocksFor(std::int64_t n) { return static_cast<unsigned>((n + kThreads - 1) / kThreads); }

// One thread per (token, head): the merge reads both lse values once.
__global__ void ringMergeKernel(float* acc, float* lse, const bfloat* o_blk, std::int64_t o_stride,
                                const float* lse_blk, std::int64_t tokens, int heads, int head_dim,
                                bool first) {
  const std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
  if (i >= tokens * heads) return;
  const std::int64_t t = i / heads;
  const int h = static_cast<int>(i % heads);
  const int width = heads * head_dim;
  float* a = acc + t * width + h * head_dim;
  const bfloat* b = o_blk + t * o_stride + h * head_dim;
  const float lb = lse_blk[i];
  if (first) {
    for (int c = 0; c < head_dim; ++c) a[c] = __bfloat162float(b[c]);
    lse[i] = lb;
    return;
  }
  if (lb == -INFINITY) return;  // the block holds no key of this query's sequence
  const float la = lse[i];
  const float mx = fmaxf(la, lb);
  const float wa = la == -INFINITY ? 0.0f : expf(la - mx);
  const float wb = expf(lb - mx);
  const float sum = wa + wb;
  const float ca = wa / sum, cb = wb / sum;
  for (int c = 0; c < head_dim; ++c) a[c] = ca * a[c] + cb * __bfloat162float(b[c]);
  lse[i] = mx + logf(sum);
}

__global__ void ringAccumulateKernel(float* acc, const bfloat* src, std::int64_t src_stride,
                                     std::int64_t rows, int width, bool first) {
  const std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
  if (i >= rows * width) return;
  const std::int64_t r = i / width;
  const int c = static_cast<int>(i % width);
  const float x = __bfloat162float(src[r * src_stride + c]);
  acc[i] = first ? x : acc[i] + x;
}

__global__ void ringAddKernel(float* acc, const float* src, std::int64_t n) {
  const std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) acc[i] += src[i];
}

__global__ void ringStoreKernel(const float* src, bfloat* dst, std::int64_t dst_stride,
                                std::int64_t rows, int width) {
  const std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
  if (i >= rows * width) return;
  const std::int64_t r = i / width;
  const int c = static_cast<int>(i % width);
  dst[r * dst_stride + c] = __float2bfloat16(src[i]);
}

__global__ void scaleRowsKernel(float* x, const float* mult, std::int64_t rows, int cols) {
  const std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
  if (i < rows * cols) x[i] *= mult[i / cols];
}

__global__ void scaleRowsBf16Kernel(const bfloat* src, const float* mult, bfloat* dst,
                                    std::int64_t rows, int cols) {
  const std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
  if (i < rows * cols) dst[i] = __float2bfloat16(__bfloat162float(src[i]) * mult[i / cols]);
}

}  // namespace

void scaleRows(Stream stream, float* x, const float* mult, std::int64_t rows, int cols) {
  const std::int64_t n = rows * cols;
  if (n == 0) return;
  scaleRowsKernel<<<blocksFor(n), kThreads, 0, stream>>>(x, mult, rows, cols);
  PLM_CHECK_CUDA(cudaGetLastError());
}

void scaleRows(Stream stream, const bf16* src, const float* mult, bf16* dst, std::int64_t rows,
               int cols) {
  const std::int64_t n = rows * cols;
  if (n == 0) return;
  scaleRowsBf16Kernel<<<blocksFor(n), kThreads, 0, stream>>>(
      reinterpret_cast<const bfloat*>(src), mult, reinterpret_cast<bfloat*>(dst), rows, cols);
  PLM_CHECK_CUDA(cudaGetLastError());
}

void ringPack(Stream stream, const bf16* k, std::int64_t k_stride, const bf16* v,
              std::int64_t v_stride, std::int64_t tokens, int width, bf16* dst) {
  if (tokens == 0) return;
  const std::size_t row = static_cast<std::size_t>(width) * sizeof(bf16);
  PLM_CHECK_CUDA(cudaMemcpy2DAsync(dst, row, k, static_cast<std::size_t>(k_stride) * sizeof(bf16),
                                   row, static_cast<std::size_t>(tokens), cudaMemcpyDeviceToDevice,
                                   stream));
  PLM_CHECK_CUDA(cudaMemcpy2DAsync(
      dst + tokens * width, row, v, static_cast<std::size_t>(v_stride) * sizeof(bf16), row,
      static_cast<std::size_t>(tokens), cudaMemcpyDeviceToDevice, stream));
}

void ringMerge(Stream stream, float* acc, float* lse, const bf16* o_blk, std::int64_t o_stride,
               const float* lse_blk, std::int64_t tokens, int heads, int head_dim, bool first) {
  const std::int64_t n = tokens * heads;
  if (n == 0) return;
  ringMergeKernel<<<blocksFor(n), kThreads, 0, stream>>>(
      acc, lse, reinterpret_cast<const bfloat*>(o_blk), o_stride, lse_blk, tokens, heads, head_dim,
      first);
  PLM_CHECK_CUDA(cudaGetLastError());
}

void ringAccumulate(Stream stream, float* acc, const bf16* src, std::int64_t src_stride,
                    std::int64_t rows, int width, bool first) {
  const std::int64_t n = rows * width;
  if (n == 0) return;
  ringAccumulateKernel<<<blocksFor(n), kThreads, 0, stream>>>(
      acc, reinterpret_cast<const bfloat*>(src), src_stride, rows, width, first);
  PLM_CHECK_CUDA(cudaGetLastError());
}

void ringAdd(Stream stream, float* acc, const float* src, std::int64_t rows, int width) {
  const std::int64_t n = rows * width;
  if (n == 0) return;
  ringAddKernel<<<blocksFor(n), kThreads, 0, stream>>>(acc, src, n);
  PLM_CHECK_CUDA(cudaGetLastError());
}

void ringStore(Stream stream, const float* src, bf16* dst, std::int64_t dst_stride,
               std::int64_t rows, int width) {
  const std::int64_t n = rows * width;
  if (n == 0) return;
  ringStoreKernel<<<blocksFor(n), kThreads, 0, stream>>>(src, reinterpret_cast<bfloat*>(dst),
                                                         dst_stride, rows, width);
  PLM_CHECK_CUDA(cudaGetLastError());
}

}  // namespace plm::gpu
