// The NCCL backend of dist::Communicator: device buffers, stream-ordered, no host fence.
//
// Design choice: every collective runs on the communicator's own communication stream, which
// first waits on an event recorded on the caller's compute stream (so it starts after the
// kernels that produced the data) and records a completion event that Work::wait(stream) makes
// the consumer's stream wait on.  Compute and communication therefore overlap without host
// synchronisation; the only host blocking is Work::test() polling an event.  Plain host code
// (no Kokkos header), so PLM_CHECK_CUDA_SOURCES compiles it with nvcc on CPU-only machines.
#include "core/error.hpp"
#include "dist/detail/backends.hpp"
#include "dist/health.hpp"

#include <cuda_runtime.h>
#include <mpi.h>
#include <nccl.h>

#include <cstdio>
#include <cstring>
#include <set>
#include <string>
#include <vector>

namespace plm::dist::detail {

namespace {

cudaStream_t cudaStreamOf(Stream stream) { return static_cast<cudaStream_t>(stream.handle); }

ncclDataType_t ncclSumType(DataType type, const char* what) {
  switch (type) {
    case DataType::Float32: return ncclFloat32;
    case DataType::Float64: return ncclFloat64;
    case DataType::BFloat16: return ncclBfloat16;
    case DataType::Int32: return ncclInt32;
    case DataType::Int64: return ncclInt64;
    case DataType::UInt8: return ncclUint8;
    case DataType::UInt16: break;
  }
  throw Error(std::string("dist::") + what + ": NCCL cannot sum " + nameOf(type));
}

/// One collective in flight: its completion event on the communication stream.
class NcclWork final : public WorkImpl {
 public:
  explicit NcclWork(cudaEvent_t done) : done_member(done) {}
  ~NcclWork() override { cudaEventDestroy(done_member); }  // released once the event fired
  NcclWork(const NcclWork&) = delete;
  NcclWork& operator=(const NcclWork&) = delete;

  void wait(Stream stream) override {
    PLM_CHECK_CUDA(cudaStreamWaitEvent(cudaStreamOf(stream), done_member, 0));
  }
  bool test() override {
    const cudaError_t status = cudaEventQuery(done_member);
    if (status == cudaErrorNotReady) return false;
    PLM_CHECK_CUDA(status);
    return true;
  }

 private:
  cudaEvent_t done_member;
};

class NcclCommunicator final : public Communicator {
 public:
  explicit NcclCommunicator(MPI_Comm comm) {
    PLM_CHECK_MPI(MPI_Comm_rank(comm, &rank_member));
    PLM_CHECK_MPI(MPI_Comm_size(comm, &size_member));
    ncclUniqueId id;
    if (rank_member == 0) PLM_CHECK_NCCL(ncclGetUniqueId(&id));
    PLM_CHECK_MPI(MPI_Bcast(&id, sizeof(id), MPI_BYTE, 0, comm));
    PLM_CHECK_NCCL(ncclCommInitRank(&comm_member, size_member, id, rank_member));
    // The highest priority, so gradient buckets are not queued behind the backward's kernels.
    int least = 0, greatest = 0;
    PLM_CHECK_CUDA(cudaDeviceGetStreamPriorityRange(&least, &greatest));
    PLM_CHECK_CUDA(cudaStreamCreateWithPriority(&stream_member, cudaStreamNonBlocking, greatest));
    // A failed peer or network shows up here, not as a failed call: the watchdog polls it
    // (ncclCommGetAsyncError is safe from another thread) and ends the job with the reason.
    health_id_member = addHealthCheck([comm = comm_member, rank = rank_member]() -> std::string {
      ncclResult_t async = ncclSuccess;
      const ncclResult_t status = ncclCommGetAsyncError(comm, &async);
      if (status != ncclSuccess)
        return std::string("ncclCommGetAsyncError failed: ") + ncclGetErrorString(status);
      if (async == ncclSuccess || async == ncclInProgress) return "";
      return "NCCL reported an asynchronous error on communicator rank " + std::to_string(rank) +
             ": " + ncclGetErrorString(async) + " (" + ncclGetLastError(comm) + ")";
    });
  }
  ~NcclCommunicator() override {
    removeHealthCheck(health_id_member);
    // Errors are ignored here: at process exit the CUDA runtime may already be unloading.
    cudaStreamSynchronize(stream_member);
    ncclCommDestroy(comm_member);
    cudaStreamDestroy(stream_member);
  }
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  int rank() const override { return rank_member; }
  int size() const override { return size_member; }
  Backend backend() const override { return Backend::Nccl; }
  bool deviceMemory() const override { return true; }

  Work allReduceSum(void* data, std::int64_t count, DataType type, Stream stream) override {
    const ncclDataType_t t = ncclSumType(type, "allReduceSum");
    PLM_REQUIRE(count >= 0, "dist::allReduceSum: negative count");
    if (count == 0) return Work();
    begin(stream);
    PLM_CHECK_NCCL(ncclAllReduce(data, data, static_cast<std::size_t>(count), t, ncclSum,
                                 comm_member, stream_member));
    return end();
  }

  Work reduceScatterSum(const void* send, void* recv, std::int64_t recv_count, DataType type,
                        Stream stream) override {
    const ncclDataType_t t = ncclSumType(type, "reduceScatterSum");
    PLM_REQUIRE(recv_count >= 0, "dist::reduceScatterSum: negative count");
    if (recv_count == 0) return Work();
    begin(stream);
    PLM_CHECK_NCCL(ncclReduceScatter(send, recv, static_cast<std::size_t>(recv_count), t, ncclSum,
                                     comm_member, stream_member));
    return end();
  }

  // Gather and all-to-all only move data: bytes, so every DataType (bf16 bits included) goes.
  Work allGather(const void* send, void* recv, std::int64_t send_count, DataType type,
                 Stream stream) override {
    PLM_REQUIRE(send_count >= 0, "dist::allGather: negative count");
    if (send_count == 0) return Work();
    begin(stream);
    PLM_CHECK_NCCL(ncclAllGather(send, recv, static_cast<std::size_t>(send_count) * sizeOf(type),
                                 ncclUint8, comm_member, stream_member));
    return end();
  }

  Work allToAllV(const void* send, const std::vector<std::int64_t>& send_counts,
                 const std::vector<std::int64_t>& send_offsets, void* recv,
                 const std::vector<std::int64_t>& recv_counts,
                 const std::vector<std::int64_t>& recv_offsets, DataType type,
                 Stream stream) override {
    const auto p = static_cast<std::size_t>(size_member);
    PLM_REQUIRE(
        send_counts.size() == p && send_offsets.size() == p && recv_counts.size() == p &&
            recv_offsets.size() == p,
        "dist::allToAllV: counts and offsets need one entry per rank (" + std::to_string(p) + ")");
    const std::size_t width = sizeOf(type);
    const auto* send_bytes = static_cast<const unsigned char*>(send);
    auto* recv_bytes = static_cast<unsigned char*>(recv);
    begin(stream);
    // One fused group of point-to-point calls; zero counts are skipped (NCCL pairs each send
    // with the peer's recv, and both sides agree on which counts are zero).
    PLM_CHECK_NCCL(ncclGroupStart());
    for (std::size_t q = 0; q < p; ++q) {
      const int peer = static_cast<int>(q);
      if (send_counts[q] > 0)
        PLM_CHECK_NCCL(ncclSend(send_bytes + send_offsets[q] * width, send_counts[q] * width,
                                ncclUint8, peer, comm_member, stream_member));
      if (recv_counts[q] > 0)
        PLM_CHECK_NCCL(ncclRecv(recv_bytes + recv_offsets[q] * width, recv_counts[q] * width,
                                ncclUint8, peer, comm_member, stream_member));
    }
    PLM_CHECK_NCCL(ncclGroupEnd());
    return end();
  }

  Work sendRecv(const void* send, std::int64_t send_count, int dest, void* recv,
                std::int64_t recv_count, int source, DataType type, Stream stream) override {
    PLM_REQUIRE(send_count >= 0 && recv_count >= 0, "dist::sendRecv: negative count");
    PLM_REQUIRE(dest >= 0 && dest < size_member && source >= 0 && source < size_member,
                "dist::sendRecv: peer " + std::to_string(dest) + " / " + std::to_string(source) +
                    " outside the group of " + std::to_string(size_member) + " ranks");
    const std::size_t width = sizeOf(type);
    begin(stream);
    // Send and receive in one group, so a ring of them cannot deadlock (NCCL pairs each send
    // with the peer's receive); bytes, so bf16 needs no NCCL type.
    PLM_CHECK_NCCL(ncclGroupStart());
    if (send_count > 0)
      PLM_CHECK_NCCL(
          ncclSend(send, send_count * width, ncclUint8, dest, comm_member, stream_member));
    if (recv_count > 0)
      PLM_CHECK_NCCL(
          ncclRecv(recv, recv_count * width, ncclUint8, source, comm_member, stream_member));
    PLM_CHECK_NCCL(ncclGroupEnd());
    return end();
  }

 private:
  // The communication stream waits on what the caller has queued so far.
  void begin(Stream stream) {
    cudaEvent_t ready;
    PLM_CHECK_CUDA(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming));
    PLM_CHECK_CUDA(cudaEventRecord(ready, cudaStreamOf(stream)));
    PLM_CHECK_CUDA(cudaStreamWaitEvent(stream_member, ready, 0));
    PLM_CHECK_CUDA(cudaEventDestroy(ready));
  }

  Work end() {
    cudaEvent_t done;
    PLM_CHECK_CUDA(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
    PLM_CHECK_CUDA(cudaEventRecord(done, stream_member));
    return Work(std::make_unique<NcclWork>(done));
  }

  ncclComm_t comm_member = nullptr;
  cudaStream_t stream_member = nullptr;
  int rank_member = 0;
  int size_member = 1;
  int health_id_member = 0;  // dist::addHealthCheck
};

}  // namespace

std::unique_ptr<Communicator> makeNcclCommunicator(MPI_Comm comm) {
  return std::make_unique<NcclCommunicator>(comm);
}

bool ranksOnDistinctGpus(MPI_Comm comm) {
  // "host/bus-id" per rank: CUDA_VISIBLE_DEVICES may renumber devices per rank, the PCI bus id
  // does not.
  constexpr int width = MPI_MAX_PROCESSOR_NAME + 32;
  char mine[width] = {};
  int device = -1, length = 0;
  char host[MPI_MAX_PROCESSOR_NAME] = {};
  PLM_CHECK_MPI(MPI_Get_processor_name(host, &length));
  char bus[32] = "none";
  if (cudaGetDevice(&device) == cudaSuccess) PLM_CHECK_CUDA(cudaDeviceGetPCIBusId(bus, 32, device));
  std::snprintf(mine, width, "%s/%s", host, bus);
  int size = 1;
  PLM_CHECK_MPI(MPI_Comm_size(comm, &size));
  std::vector<char> all(static_cast<std::size_t>(width) * size);
  PLM_CHECK_MPI(MPI_Allgather(mine, width, MPI_CHAR, all.data(), width, MPI_CHAR, comm));
  std::set<std::string> seen;
  for (int r = 0; r < size; ++r) {
    std::string id(all.data() + static_cast<std::size_t>(r) * width);
    if (id.find("/none") != std::string::npos || !seen.insert(id).second) return false;
  }
  return true;
}

}  // namespace plm::dist::detail
