// The device queries that kernels' launchers share (device.hpp), cached per device.
#include "gpu/device.hpp"

#include "core/error.hpp"

#include <cuda_runtime.h>

#include <atomic>

namespace plm::gpu {

int multiprocessorCount() {
  constexpr int kCached = 64;  // devices per process remembered; beyond, queried every call
  static std::atomic<int> cache[kCached] = {};
  int dev = 0;
  PLM_CHECK_CUDA(cudaGetDevice(&dev));
  if (dev < kCached) {
    const int known = cache[dev].load(std::memory_order_relaxed);
    if (known > 0) return known;
  }
  int sms = 0;
  PLM_CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  if (dev < kCached) cache[dev].store(sms, std::memory_order_relaxed);
  return sms;
}

}  // namespace plm::gpu
