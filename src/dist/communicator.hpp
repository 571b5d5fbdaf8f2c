// Collectives of one process group behind one interface: all-reduce, reduce-scatter,
// all-gather and all-to-all-v, plus the point-to-point send/recv of a ring, each asynchronous,
// each returning a Work handle.
//
// Design choice: buffers are raw pointer + element count + DataType tag (typed template
// wrappers below), so the interface needs no Kokkos and the NCCL backend compiles as a plain
// .cu under nvcc (PLM_CHECK_CUDA_SOURCES).  Pointers are device memory with NCCL and staged
// MPI, host memory with MPI (deviceMemory() says which).  Only staged MPI
// (dist/staged_communicator.hpp) goes through the host: it copies device buffers into pinned
// host buffers, runs the MPI backend on them and copies the results back, so ranks that share
// one GPU (which NCCL refuses) can still run every device-memory collective.
//
// Ordering, per backend:
//   - NCCL: each call records an event on the caller's `Stream`, the communicator's own
//     communication stream waits on it, the collective runs there and records a completion
//     event; Work::wait(stream) makes `stream` wait on that event.  No host synchronisation.
//   - MPI: non-blocking MPI (MPI_Iallreduce, ...) on a duplicate of the group's MPI_Comm; the
//     caller fences the producing execution space before the call (the Stream is ignored) and
//     Work::wait blocks in MPI_Waitall.
//   - Staged MPI: the call synchronises the caller's `Stream` after queueing the device-to-host
//     copies, then starts the MPI collective; Work::wait blocks in MPI_Waitall and copies the
//     results back on the waiting stream (synchronised before it returns).
// Every rank of the group must issue the same collectives in the same order (MPI and NCCL
// both require it).  Buffers must stay alive and untouched until wait() returns (MPI) or until
// the waiting stream has passed the completion event (NCCL).
//
// Determinism (sums): MPI reduces in an order fixed by rank count and message size (the MPI
// standard asks implementations for reproducible reductions; Open MPI's algorithms are fixed
// trees and rings), so reruns with the same rank count are bitwise identical.  NCCL's order is
// fixed for a fixed rank count, topology, algorithm, protocol and channel count; pin them with
// NCCL_ALGO / NCCL_PROTO (doc/architecture.md, "dist").
#pragma once

#include <mpi.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace plm::dist {

/// Element types a collective moves.  BFloat16 is stored as 16 raw bits (std::uint16_t).
/// Apart from model::DType and gpu::DType on purpose: each lists what its API accepts.
enum class DataType { Float32, Float64, BFloat16, Int32, Int64, UInt8, UInt16 };

/// \brief Bytes per element of `type`.
std::size_t sizeOf(DataType type);
/// \brief "float32", "bfloat16", ... for messages.
const char* nameOf(DataType type);

template <class T> struct DataTypeOf;
template <> struct DataTypeOf<float> { static constexpr DataType value = DataType::Float32; };
template <> struct DataTypeOf<double> { static constexpr DataType value = DataType::Float64; };
template <> struct DataTypeOf<std::int32_t> { static constexpr DataType value = DataType::Int32; };
template <> struct DataTypeOf<std::int64_t> { static constexpr DataType value = DataType::Int64; };
template <> struct DataTypeOf<std::uint8_t> { static constexpr DataType value = DataType::UInt8; };
/// uint16 buffers are moved as bf16 bits (gather, all-to-all; sums of them are refused by MPI).
template <> struct DataTypeOf<std::uint16_t> {
  static constexpr DataType value = DataType::BFloat16;
};

/// \brief A compute stream: the cudaStream_t of a Kokkos::Cuda instance (dist/stream.hpp's
/// streamOf), or null (the default stream on CUDA; ignored by MPI).
struct Stream {
  void* handle = nullptr;
};

/// Mpi: host memory.  Nccl: device memory, one GPU per rank.  MpiStaged: device memory through
/// host staging buffers and MPI (ranks may share a GPU; for correctness runs and small jobs).
enum class Backend { Mpi, Nccl, MpiStaged };
/// \brief "mpi", "nccl", "mpi-staged" (the values PLM_COMM_BACKEND takes).
const char* nameOf(Backend backend);

namespace detail {
/// One backend's in-flight collective.
class WorkImpl {
 public:
  virtual ~WorkImpl() = default;
  virtual void wait(Stream stream) = 0;
  virtual bool test() = 0;
};
}  // namespace detail

/// \brief Handle of one asynchronous collective.  An empty Work (nothing was launched, e.g. a
/// zero-sized call) is already complete.
class Work {
 public:
  Work() = default;
  explicit Work(std::unique_ptr<detail::WorkImpl> impl) : impl_member(std::move(impl)) {}
  Work(Work&&) noexcept = default;
  Work& operator=(Work&&) noexcept = default;
  /// \brief MPI: blocks until the collective completed.  NCCL: makes `stream` wait on the
  /// collective's completion event and returns at once.  Idempotent.
  void wait(Stream stream = {});
  /// \brief True once the collective completed (never blocks; MPI: also drives progress).
  bool test();
  bool empty() const { return !impl_member; }

 private:
  std::unique_ptr<detail::WorkImpl> impl_member;
};

/// \brief The collectives of one process group.
class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual Backend backend() const = 0;
  /// \brief True: buffers are device memory and collectives are ordered on streams (NCCL,
  /// staged MPI).  False: host memory, and the caller fences the producers before a call (MPI).
  virtual bool deviceMemory() const = 0;

  /// \brief data[i] = sum over ranks of data[i], in place, for i < count.
  virtual Work allReduceSum(void* data, std::int64_t count, DataType type, Stream stream) = 0;
  /// \brief recv[i] = sum over ranks r of send_r[rank() * recv_count + i], i < recv_count;
  /// `send` holds size() * recv_count elements.
  virtual Work reduceScatterSum(const void* send, void* recv, std::int64_t recv_count,
                                DataType type, Stream stream) = 0;
  /// \brief recv[r * send_count + i] = send_r[i]; `recv` holds size() * send_count elements.
  /// In place when send == recv + rank() * send_count.
  virtual Work allGather(const void* send, void* recv, std::int64_t send_count, DataType type,
                         Stream stream) = 0;
  /// \brief Rank r's send[send_offsets[q] + i], i < send_counts[q], lands in rank q's
  /// recv[recv_offsets[r] + i]; counts and offsets are in elements, one entry per rank, and
  /// recv_counts[r] on q must equal send_counts[q] on r.  Zero counts are allowed.
  virtual Work allToAllV(const void* send, const std::vector<std::int64_t>& send_counts,
                         const std::vector<std::int64_t>& send_offsets, void* recv,
                         const std::vector<std::int64_t>& recv_counts,
                         const std::vector<std::int64_t>& recv_offsets, DataType type,
                         Stream stream) = 0;

  /// \brief Point-to-point exchange: sends `send_count` elements of `send` to rank `dest` and
  /// receives `recv_count` elements from rank `source` into `recv` (the ring step of context
  /// parallelism).  Not collective over the group: only the ranks that call it pair up, and
  /// rank `source` must send `recv_count` elements here in its matching call.  Zero counts are
  /// allowed (both sides must agree); `send` and `recv` must not overlap.
  virtual Work sendRecv(const void* send, std::int64_t send_count, int dest, void* recv,
                        std::int64_t recv_count, int source, DataType type, Stream stream) = 0;

  // Typed wrappers: the element type picks the DataType.
  template <class T> Work allReduceSum(T* data, std::int64_t count, Stream stream = {}) {
    return allReduceSum(static_cast<void*>(data), count, DataTypeOf<T>::value, stream);
  }
  template <class T>
  Work reduceScatterSum(const T* send, T* recv, std::int64_t recv_count, Stream stream = {}) {
    return reduceScatterSum(static_cast<const void*>(send), static_cast<void*>(recv), recv_count,
                            DataTypeOf<T>::value, stream);
  }
  template <class T>
  Work allGather(const T* send, T* recv, std::int64_t send_count, Stream stream = {}) {
    return allGather(static_cast<const void*>(send), static_cast<void*>(recv), send_count,
                     DataTypeOf<T>::value, stream);
  }
  template <class T> Work sendRecv(const T* send, std::int64_t send_count, int dest, T* recv,
                                   std::int64_t recv_count, int source, Stream stream = {}) {
    return sendRecv(static_cast<const void*>(send), send_count, dest, static_cast<void*>(recv),
                    recv_count, source, DataTypeOf<T>::value, stream);
  }
  template <class T> Work allToAllV(const T* send, const std::vector<std::int64_t>& send_counts,
                                    const std::vector<std::int64_t>& send_offsets, T* recv,
                                    const std::vector<std::int64_t>& recv_counts,
                                    const std::vector<std::int64_t>& recv_offsets,
                                    Stream stream = {}) {
    return allToAllV(static_cast<const void*>(send), send_counts, send_offsets,
                     static_cast<void*>(recv), recv_counts, recv_offsets, DataTypeOf<T>::value,
                     stream);
  }
};

/// \brief A communicator over the ranks of `comm` (collective over `comm`).  Mpi duplicates
/// `comm`; Nccl broadcasts a unique id over `comm` and needs one GPU per rank (the current
/// CUDA device); MpiStaged is Mpi behind host staging buffers, copying with CUDA on a CUDA
/// build and with memcpy on a CPU build.  Nccl on a build without NCCL throws plm::Error.
std::unique_ptr<Communicator> makeCommunicator(MPI_Comm comm, Backend backend);

/// \brief True when this build has the NCCL backend (a CUDA build).
bool ncclAvailable();

/// \brief The backend for the model's memory on `comm` (collective): Nccl when this build has
/// NCCL and every rank of `comm` drives its own GPU; MpiStaged on a CUDA build whose ranks share
/// a GPU (NCCL refuses that); Mpi on a CPU build.  The environment variable PLM_COMM_BACKEND
/// (auto | nccl | mpi | mpi-staged, the same on every rank) overrides the choice; a bad value
/// throws plm::Error.  The first choice of each kind is logged with its reason.
Backend defaultBackend(MPI_Comm comm);

}  // namespace plm::dist
