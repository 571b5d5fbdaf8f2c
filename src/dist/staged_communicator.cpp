// Staged MPI (see staged_communicator.hpp): the MPI backend on host copies of device buffers.
#include "dist/staged_communicator.hpp"

#include "core/error.hpp"
#include "dist/detail/backends.hpp"
#include "plm/plm_config.hpp"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <new>
#include <string>
#include <utility>
#include <vector>

namespace plm::dist {

void* HostCopier::allocateHost(std::size_t bytes) {
  constexpr std::size_t align = 64;
  void* p = std::aligned_alloc(align, (bytes + align - 1) / align * align);
  if (!p) throw std::bad_alloc();
  return p;
}
void HostCopier::freeHost(void* host) { std::free(host); }
void HostCopier::toHost(void* host, const void* device, std::size_t bytes, Stream) {
  std::memcpy(host, device, bytes);
}
void HostCopier::toDevice(void* device, const void* host, std::size_t bytes, Stream) {
  std::memcpy(device, host, bytes);
}
void HostCopier::synchronize(Stream) {}

std::shared_ptr<DeviceCopier> deviceCopier() {
#if PLM_HAVE_CUDA
  return detail::makeCudaCopier();
#else
  return std::make_shared<HostCopier>();
#endif
}

namespace {

constexpr std::size_t kAlign = 64;  // each staged region starts on its own cache line
std::size_t aligned(std::size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }
/// The offset of a region that follows one of `bytes`: aligned, and past the first region's
/// start even when that region is empty, so two regions never share an address.
std::size_t regionAfter(std::size_t bytes) { return aligned(std::max<std::size_t>(bytes, 1)); }

/// Host staging buffers of one communicator, shared with its in-flight works (which may outlive
/// it).  A buffer belongs to one collective from its start until its Work completes.
class StagingPool {
 public:
  struct Block {
    void* data = nullptr;
    std::size_t capacity = 0;
  };

  explicit StagingPool(std::shared_ptr<DeviceCopier> copier) : copier_member(std::move(copier)) {}
  ~StagingPool() {
    for (auto& b : free_member) copier_member->freeHost(b.data);
  }
  StagingPool(const StagingPool&) = delete;
  StagingPool& operator=(const StagingPool&) = delete;

  /// The smallest free buffer of at least `bytes`; else the largest free one grown by at least
  /// half (so buffers of varying sizes, as all-to-all-v's, settle after a few calls); else new.
  Block take(std::size_t bytes) {
    std::lock_guard<std::mutex> lock(mutex_member);
    auto best = free_member.end();
    for (auto it = free_member.begin(); it != free_member.end(); ++it)
      if (it->capacity >= bytes && (best == free_member.end() || it->capacity < best->capacity))
        best = it;
    if (best != free_member.end()) {
      Block b = *best;
      free_member.erase(best);
      return b;
    }
    std::size_t capacity = std::max<std::size_t>(aligned(bytes), 4096);
    if (!free_member.empty()) {
      auto largest =
          std::max_element(free_member.begin(), free_member.end(),
                           [](const Block& a, const Block& b) { return a.capacity < b.capacity; });
      capacity = std::max(capacity, aligned(largest->capacity + largest->capacity / 2));
      copier_member->freeHost(largest->data);
      free_member.erase(largest);
    }
    return Block{copier_member->allocateHost(capacity), capacity};
  }

  void give(Block b) {
    std::lock_guard<std::mutex> lock(mutex_member);
    free_member.push_back(b);
  }

  DeviceCopier& copier() { return *copier_member; }

 private:
  std::shared_ptr<DeviceCopier> copier_member;
  std::mutex mutex_member;
  std::vector<Block> free_member;
};

/// One staging buffer held by one collective; returned to the pool when released.
class Staging {
 public:
  Staging(std::shared_ptr<StagingPool> pool, std::size_t bytes)
      : pool_member(std::move(pool)), block_member(pool_member->take(bytes)) {}
  ~Staging() { release(); }
  Staging(const Staging&) = delete;
  Staging& operator=(const Staging&) = delete;

  StagingPool& pool() const { return *pool_member; }
  unsigned char* at(std::size_t offset) const {
    return static_cast<unsigned char*>(block_member.data) + offset;
  }
  void release() {
    if (block_member.data) pool_member->give(block_member);
    block_member = {};
  }

 private:
  std::shared_ptr<StagingPool> pool_member;
  StagingPool::Block block_member;
};

/// A contiguous piece copied between a caller's buffer and the staging buffer.
struct Piece {
  void* device;
  std::size_t host_offset;
  std::size_t bytes;
};

/// The MPI collective on the staging buffer; on completion, the pieces it wrote go back to the
/// caller's buffers.
class StagedWork final : public detail::WorkImpl {
 public:
  // Declared before `inner`, so an abandoned collective completes (the MPI Work's destructor
  // waits) before its buffer returns to the pool.
  std::unique_ptr<Staging> staging;
  std::vector<Piece> back;  // what the collective wrote, to copy to the caller's buffers
  Stream issued;            // the caller's stream: test() copies back on it
  Work inner;               // the MPI backend's collective on the staging buffer

  void wait(Stream stream) override {
    if (done_member) return;
    inner.wait();
    copyBack(stream);
  }

  bool test() override {
    if (done_member) return true;
    if (!inner.test()) return false;
    copyBack(issued);
    return true;
  }

 private:
  void copyBack(Stream stream) {
    DeviceCopier& copier = staging->pool().copier();
    for (const Piece& p : back)
      copier.toDevice(p.device, staging->at(p.host_offset), p.bytes, stream);
    // The next collective may take the buffer as soon as it is released.
    copier.synchronize(stream);
    done_member = true;
    staging->release();
  }

  bool done_member = false;
};

class StagedCommunicator final : public Communicator {
 public:
  StagedCommunicator(MPI_Comm comm, std::shared_ptr<DeviceCopier> copier)
      : mpi_member(detail::makeMpiCommunicator(comm)),
        pool_member(std::make_shared<StagingPool>(std::move(copier))) {}

  int rank() const override { return mpi_member->rank(); }
  int size() const override { return mpi_member->size(); }
  Backend backend() const override { return Backend::MpiStaged; }
  bool deviceMemory() const override { return true; }

  Work allReduceSum(void* data, std::int64_t count, DataType type, Stream stream) override {
    // Nothing moves (the MPI backend checks the arguments and touches no memory).
    if (count <= 0 || size() == 1) return mpi_member->allReduceSum(data, count, type, stream);
    const std::size_t bytes = static_cast<std::size_t>(count) * sizeOf(type);
    Launch l = begin(bytes, stream);
    stageIn(l, {{data, 0, bytes}}, stream);
    l.work->inner = mpi_member->allReduceSum(l.staging()->at(0), count, type, stream);
    l.back = {{data, 0, bytes}};
    return finish(std::move(l));
  }

  Work reduceScatterSum(const void* send, void* recv, std::int64_t recv_count, DataType type,
                        Stream stream) override {
    if (recv_count <= 0) return mpi_member->reduceScatterSum(send, recv, recv_count, type, stream);
    const std::size_t block = static_cast<std::size_t>(recv_count) * sizeOf(type);
    const std::size_t all = block * static_cast<std::size_t>(size());
    // Send and receive in separate regions, so NCCL's in-place form (recv inside send) needs
    // no temporary on the host.
    Launch l = begin(aligned(all) + block, stream);
    stageIn(l, {{const_cast<void*>(send), 0, all}}, stream);
    l.work->inner = mpi_member->reduceScatterSum(l.staging()->at(0), l.staging()->at(aligned(all)),
                                                 recv_count, type, stream);
    l.back = {{recv, aligned(all), block}};
    return finish(std::move(l));
  }

  Work allGather(const void* send, void* recv, std::int64_t send_count, DataType type,
                 Stream stream) override {
    if (send_count <= 0) return mpi_member->allGather(send, recv, send_count, type, stream);
    const std::size_t block = static_cast<std::size_t>(send_count) * sizeOf(type);
    const std::size_t mine = block * static_cast<std::size_t>(rank());
    // The host side always gathers in place: this rank's block is staged where it belongs.
    Launch l = begin(block * static_cast<std::size_t>(size()), stream);
    stageIn(l, {{const_cast<void*>(send), mine, block}}, stream);
    l.work->inner =
        mpi_member->allGather(l.staging()->at(mine), l.staging()->at(0), send_count, type, stream);
    l.back = {{recv, 0, block * static_cast<std::size_t>(size())}};
    return finish(std::move(l));
  }

  Work allToAllV(const void* send, const std::vector<std::int64_t>& send_counts,
                 const std::vector<std::int64_t>& send_offsets, void* recv,
                 const std::vector<std::int64_t>& recv_counts,
                 const std::vector<std::int64_t>& recv_offsets, DataType type,
                 Stream stream) override {
    const auto p = static_cast<std::size_t>(size());
    PLM_REQUIRE(
        send_counts.size() == p && send_offsets.size() == p && recv_counts.size() == p &&
            recv_offsets.size() == p,
        "dist::allToAllV: counts and offsets need one entry per rank (" + std::to_string(p) + ")");
    const std::size_t width = sizeOf(type);
    // The host buffers keep the caller's offsets: [0, send extent) then [0, recv extent).
    std::int64_t send_extent = 0, recv_extent = 0;
    for (std::size_t q = 0; q < p; ++q) {
      PLM_REQUIRE(send_counts[q] >= 0 && send_offsets[q] >= 0 && recv_counts[q] >= 0 &&
                      recv_offsets[q] >= 0,
                  "dist::allToAllV: negative count or offset for rank " + std::to_string(q));
      if (send_counts[q] > 0) send_extent = std::max(send_extent, send_offsets[q] + send_counts[q]);
      if (recv_counts[q] > 0) recv_extent = std::max(recv_extent, recv_offsets[q] + recv_counts[q]);
    }
    if (send_extent == 0 && recv_extent == 0)  // still collective; MPI touches no buffer
      return mpi_member->allToAllV(send, send_counts, send_offsets, recv, recv_counts, recv_offsets,
                                   type, stream);
    // The receive region starts after the send region and never at its start, also when this
    // rank sends nothing: a receive buffer equal to the send buffer is MPI_IN_PLACE to Open
    // MPI's non-blocking all-to-all-v (libnbc), which then sends from the receive buffer with
    // the receive counts, and a rank that sends nothing but receives hangs the exchange.
    const std::size_t recv_base = regionAfter(static_cast<std::size_t>(send_extent) * width);
    Launch l = begin(recv_base + static_cast<std::size_t>(recv_extent) * width, stream);
    std::vector<Piece> in;
    auto* send_bytes = static_cast<unsigned char*>(const_cast<void*>(send));
    auto* recv_bytes = static_cast<unsigned char*>(recv);
    for (std::size_t q = 0; q < p; ++q) {
      if (send_counts[q] > 0)
        in.push_back({send_bytes + send_offsets[q] * width, send_offsets[q] * width,
                      static_cast<std::size_t>(send_counts[q]) * width});
      if (recv_counts[q] > 0)  // only the blocks received: the gaps between them stay as they are
        l.back.push_back({recv_bytes + recv_offsets[q] * width, recv_base + recv_offsets[q] * width,
                          static_cast<std::size_t>(recv_counts[q]) * width});
    }
    stageIn(l, in, stream);
    l.work->inner =
        mpi_member->allToAllV(l.staging()->at(0), send_counts, send_offsets,
                              l.staging()->at(recv_base), recv_counts, recv_offsets, type, stream);
    return finish(std::move(l));
  }

  Work sendRecv(const void* send, std::int64_t send_count, int dest, void* recv,
                std::int64_t recv_count, int source, DataType type, Stream stream) override {
    if (send_count <= 0 && recv_count <= 0)
      return mpi_member->sendRecv(send, send_count, dest, recv, recv_count, source, type, stream);
    PLM_REQUIRE(send_count >= 0 && recv_count >= 0, "dist::sendRecv: negative count");
    PLM_REQUIRE(dest >= 0 && dest < size() && source >= 0 && source < size(),
                "dist::sendRecv: peer " + std::to_string(dest) + " / " + std::to_string(source) +
                    " outside the group of " + std::to_string(size()) + " ranks");
    const std::size_t width = sizeOf(type);
    const std::size_t out = static_cast<std::size_t>(send_count) * width;
    const std::size_t back = static_cast<std::size_t>(recv_count) * width;
    Launch l = begin(regionAfter(out) + back, stream);
    if (out > 0) stageIn(l, {{const_cast<void*>(send), 0, out}}, stream);
    l.work->inner =
        mpi_member->sendRecv(l.staging()->at(0), send_count, dest,
                             l.staging()->at(regionAfter(out)), recv_count, source, type, stream);
    if (back > 0) l.back = {{recv, regionAfter(out), back}};
    return finish(std::move(l));
  }

 private:
  /// A collective being set up: its Work (which owns the staging buffer) and what comes back.
  struct Launch {
    std::unique_ptr<StagedWork> work;
    std::vector<Piece> back;
    Staging* staging() const { return work->staging.get(); }
  };

  Launch begin(std::size_t bytes, Stream stream) {
    Launch l;
    l.work = std::make_unique<StagedWork>();
    l.work->staging = std::make_unique<Staging>(pool_member, std::max<std::size_t>(bytes, 1));
    l.work->issued = stream;
    return l;
  }

  /// The pieces the collective reads, copied to the host after the kernels queued on `stream`.
  void stageIn(Launch& l, const std::vector<Piece>& pieces, Stream stream) {
    DeviceCopier& copier = pool_member->copier();
    for (const Piece& p : pieces)
      copier.toHost(l.staging()->at(p.host_offset), p.device, p.bytes, stream);
    copier.synchronize(stream);
  }

  Work finish(Launch l) {
    l.work->back = std::move(l.back);
    return Work(std::move(l.work));
  }

  std::unique_ptr<Communicator> mpi_member;
  std::shared_ptr<StagingPool> pool_member;
};

}  // namespace

std::unique_ptr<Communicator> makeStagedCommunicator(MPI_Comm comm,
                                                     std::shared_ptr<DeviceCopier> copier) {
  PLM_REQUIRE(copier != nullptr, "dist::makeStagedCommunicator: no DeviceCopier given");
  return std::make_unique<StagedCommunicator>(comm, std::move(copier));
}

}  // namespace plm::dist
