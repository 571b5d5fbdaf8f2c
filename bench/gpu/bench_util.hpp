// What the GPU benchmarks share: a device buffer, hashed random fills (never zeros) and the
// median time of a callable with CUDA events after a warm-up.  Each benchmark is one translation
// unit, so the kernels below live in an unnamed namespace.
#pragma once

#include "core/error.hpp"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <functional>
#include <type_traits>
#include <vector>

namespace {

/// cudaMalloc'd bytes, freed with the object.
struct Buffer {
  void* ptr = nullptr;
  explicit Buffer(std::size_t bytes) { PLM_CHECK_CUDA(cudaMalloc(&ptr, bytes ? bytes : 16)); }
  ~Buffer() { cudaFree(ptr); }
  Buffer(const Buffer&) = delete;
  template <class T> T* as() const { return static_cast<T*>(ptr); }
};

// A value in [-scale, scale) from a hash of the element index and the seed.
__device__ inline float hashedUniform(std::size_t i, float scale, unsigned seed) {
  unsigned h = static_cast<unsigned>(i) * 2654435761u ^ seed;
  h ^= h >> 13;
  h *= 0x5bd1e995u;
  h ^= h >> 15;
  return scale * ((h & 0xffff) / 32768.0f - 1.0f);
}

template <class T> __global__ void fillKernel(T* p, std::size_t n, float scale, unsigned seed) {
  for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < n;
       i += std::size_t(gridDim.x) * blockDim.x) {
    const float v = hashedUniform(i, scale, seed);
    if constexpr (std::is_same_v<T, float>)
      p[i] = v;
    else
      p[i] = __float2bfloat16(v);
  }
}

/// Fills n bf16 values of b with hashed uniform values in [-scale, scale).
void fill(const Buffer& b, std::size_t n, float scale, unsigned seed) {
  fillKernel<<<1024, 256>>>(b.as<__nv_bfloat16>(), n, scale, seed);
  PLM_CHECK_CUDA(cudaGetLastError());
}

/// The same for n fp32 values.
void fillF(const Buffer& b, std::size_t n, float scale, unsigned seed) {
  fillKernel<<<1024, 256>>>(b.as<float>(), n, scale, seed);
  PLM_CHECK_CUDA(cudaGetLastError());
}

/// Median milliseconds of `fn` over `iters` timed runs (CUDA events on the default stream),
/// after `warmup` untimed ones.
double medianMs(const std::function<void()>& fn, int warmup = 3, int iters = 15) {
  for (int i = 0; i < warmup; ++i) fn();
  cudaEvent_t a, b;
  PLM_CHECK_CUDA(cudaEventCreate(&a));
  PLM_CHECK_CUDA(cudaEventCreate(&b));
  std::vector<float> ms(iters);
  for (int i = 0; i < iters; ++i) {
    PLM_CHECK_CUDA(cudaEventRecord(a));
    fn();
    PLM_CHECK_CUDA(cudaEventRecord(b));
    PLM_CHECK_CUDA(cudaEventSynchronize(b));
    PLM_CHECK_CUDA(cudaEventElapsedTime(&ms[i], a, b));
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(ms.begin(), ms.end());
  return ms[iters / 2];
}

}  // namespace
