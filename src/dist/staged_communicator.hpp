// Staged MPI: a Communicator whose buffers are device memory, run by the MPI backend on host
// copies of them, so ranks that share one GPU (NCCL refuses them; this Open MPI is not
// CUDA-aware) can run every device-memory collective.
//
// Design choice: a decorator over the plain MPI backend, with the device copy behind a small
// `DeviceCopier` interface.  The same MPI calls run on the same host bytes as with
// Backend::Mpi, so results are bitwise those of the MPI backend; and the staging logic (which
// bytes go out, which come back, buffer reuse) is the same code in the CPU CI, where
// `HostCopier` (memcpy) stands in for the device, as on the GPU, where the CUDA copier uses
// cudaMemcpyAsync on the caller's stream and pinned host buffers.
//
// One collective: queue the device-to-host copies of what it reads on the caller's stream
// (after the kernels that produced the data), synchronise that stream, start the non-blocking
// MPI collective on host buffers.  Work::wait(stream): MPI_Waitall, queue the host-to-device
// copies of what it wrote on `stream`, synchronise `stream`, return the host buffers to the
// pool.  Only the elements a collective writes come back (all-to-all-v leaves gaps between
// its receive blocks untouched, as on NCCL).
//
// Staging buffers: a pool per communicator.  Each collective takes one buffer for as long as it
// is in flight (several can be: FSDP prefetches an all-gather while a reduce-scatter runs), the
// smallest free one that fits, else the largest free one grown (by half at least), else a new
// one; none is freed before the communicator and its last Work are gone.  Repeated collectives
// of one size therefore allocate nothing.
//
// This serialises compute and communication through host memory (two synchronisations per
// collective, PCIe both ways): it is for correctness runs and small jobs on shared GPUs; NCCL
// with one GPU per rank is the fast path (doc/parallelism.md, "Communication backends").
#pragma once

#include "dist/communicator.hpp"

#include <mpi.h>

#include <cstddef>
#include <memory>

namespace plm::dist {

/// \brief How the staged communicator moves bytes between the caller's buffers ("device") and
/// its host staging buffers, and how it allocates those.
class DeviceCopier {
 public:
  virtual ~DeviceCopier() = default;
  /// \brief A host buffer of `bytes` (> 0) for staging (pinned on CUDA).
  virtual void* allocateHost(std::size_t bytes) = 0;
  virtual void freeHost(void* host) = 0;
  /// \brief Queues device → host on `stream` (after what the stream has queued).
  virtual void toHost(void* host, const void* device, std::size_t bytes, Stream stream) = 0;
  /// \brief Queues host → device on `stream`.
  virtual void toDevice(void* device, const void* host, std::size_t bytes, Stream stream) = 0;
  /// \brief Blocks until everything queued on `stream` has completed.
  virtual void synchronize(Stream stream) = 0;
};

/// \brief The copier of host "device" memory: std::memcpy, aligned host allocations, nothing to
/// synchronise.  What the CPU build stages with; tests derive from it to count calls.
class HostCopier : public DeviceCopier {
 public:
  void* allocateHost(std::size_t bytes) override;
  void freeHost(void* host) override;
  void toHost(void* host, const void* device, std::size_t bytes, Stream stream) override;
  void toDevice(void* device, const void* host, std::size_t bytes, Stream stream) override;
  void synchronize(Stream stream) override;
};

/// \brief The copier for this build's device memory: CUDA (cudaMemcpyAsync with
/// cudaMemcpyDefault, cudaMallocHost, cudaStreamSynchronize) on a CUDA build, HostCopier on a
/// CPU build.
std::shared_ptr<DeviceCopier> deviceCopier();

/// \brief Staged MPI over the ranks of `comm` (collective over `comm`; duplicates it):
/// deviceMemory() is true, backend() is Backend::MpiStaged, every collective runs as the MPI
/// backend's on host copies that `copier` makes.
std::unique_ptr<Communicator> makeStagedCommunicator(MPI_Comm comm,
                                                     std::shared_ptr<DeviceCopier> copier);

}  // namespace plm::dist
