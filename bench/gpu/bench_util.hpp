// What the GPU benchmarks share: a device buffer, hashed random fills (never zeros) and their
// timing: the median time of a callable with CUDA events after a warm-up (per call of a
// back-to-back batch, of a forward, backward and both, of a device copy), and host wall-clock
// times for work that fences itself.  Each benchmark is one translation unit, so the kernels
// below live in an unnamed namespace.
#pragma once

#include "core/error.hpp"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
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

/// medianMs of `calls` back-to-back calls of `fn` (as a training step issues them), per call.
double medianMsPerCall(const std::function<void()>& fn, int calls) {
  return medianMs([&] {
           for (int i = 0; i < calls; ++i) fn();
         }) /
         calls;
}

/// Median ms of a forward, a backward and the two in a row; NAN where not timed.
struct FwdBwdMs {
  double f = NAN, b = NAN, fb = NAN;
};

/// medianMs of fwd, of bwd and of fwd then bwd, in that order.
FwdBwdMs medianFwdBwdMs(const std::function<void()>& fwd, const std::function<void()>& bwd) {
  FwdBwdMs t;
  t.f = medianMs(fwd);
  t.b = medianMs(bwd);
  t.fb = medianMs([&] {
    fwd();
    bwd();
  });
  return t;
}

/// medianMs of a device-to-device copy of `bytes` from src to dst (the bandwidth yardstick).
double copyMs(const Buffer& dst, const Buffer& src, std::size_t bytes) {
  return medianMs(
      [&] { PLM_CHECK_CUDA(cudaMemcpyAsync(dst.ptr, src.ptr, bytes, cudaMemcpyDeviceToDevice)); });
}

using WallClock = std::chrono::steady_clock;

/// Seconds from `from` to `to` on the host clock.
double secondsBetween(WallClock::time_point from, WallClock::time_point to) {
  return std::chrono::duration<double>(to - from).count();
}

/// Host wall-clock milliseconds of one call of `fn`; device work counts only where `fn` waits
/// for it.
double wallMs(const std::function<void()>& fn) {
  const auto t0 = WallClock::now();
  fn();
  return std::chrono::duration<double, std::milli>(WallClock::now() - t0).count();
}

/// Median wallMs of `fn` over `repeats` calls after `warmup` untimed ones (`fn` ends with a
/// fence of the work it launched).
double medianWallMs(const std::function<void()>& fn, int warmup = 3, int repeats = 10) {
  for (int i = 0; i < warmup; ++i) fn();
  std::vector<double> ms(repeats);
  for (int i = 0; i < repeats; ++i) ms[i] = wallMs(fn);
  std::sort(ms.begin(), ms.end());
  return ms[repeats / 2];
}

}  // namespace
