// The DeviceCopier of staged MPI on a CUDA build: pinned host staging buffers, copies queued on
// the caller's stream (cudaMemcpyDefault, so a host pointer handed in by mistake still copies
// correctly), and a stream synchronisation where the staged communicator needs the bytes.
// Plain host code (no Kokkos header), so PLM_CHECK_CUDA_SOURCES compiles it with nvcc on
// CPU-only machines.
#include "core/error.hpp"
#include "dist/detail/backends.hpp"

#include <cuda_runtime.h>

#include <memory>

namespace plm::dist::detail {

namespace {

cudaStream_t cudaStreamOf(Stream stream) { return static_cast<cudaStream_t>(stream.handle); }

class CudaCopier final : public DeviceCopier {
 public:
  void* allocateHost(std::size_t bytes) override {
    void* host = nullptr;
    PLM_CHECK_CUDA(cudaMallocHost(&host, bytes));
    return host;
  }
  // Errors ignored: at process exit the CUDA runtime may already be unloading.
  void freeHost(void* host) override { cudaFreeHost(host); }
  void toHost(void* host, const void* device, std::size_t bytes, Stream stream) override {
    PLM_CHECK_CUDA(cudaMemcpyAsync(host, device, bytes, cudaMemcpyDefault, cudaStreamOf(stream)));
  }
  void toDevice(void* device, const void* host, std::size_t bytes, Stream stream) override {
    PLM_CHECK_CUDA(cudaMemcpyAsync(device, host, bytes, cudaMemcpyDefault, cudaStreamOf(stream)));
  }
  void synchronize(Stream stream) override {
    PLM_CHECK_CUDA(cudaStreamSynchronize(cudaStreamOf(stream)));
  }
};

}  // namespace

std::shared_ptr<DeviceCopier> makeCudaCopier() { return std::make_shared<CudaCopier>(); }

}  // namespace plm::dist::detail
