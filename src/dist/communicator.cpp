#include "dist/communicator.hpp"

#include "core/error.hpp"
#include "core/log.hpp"
#include "dist/detail/backends.hpp"
#include "dist/staged_communicator.hpp"
#include "plm/plm_config.hpp"

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <set>
#include <utility>

namespace plm::dist {

std::size_t sizeOf(DataType type) {
  switch (type) {
    case DataType::Float32: return 4;
    case DataType::Float64: return 8;
    case DataType::BFloat16: return 2;
    case DataType::Int32: return 4;
    case DataType::Int64: return 8;
    case DataType::UInt8: return 1;
    case DataType::UInt16: return 2;
  }
  throw Error("dist::sizeOf: unknown DataType");
}

const char* nameOf(DataType type) {
  switch (type) {
    case DataType::Float32: return "float32";
    case DataType::Float64: return "float64";
    case DataType::BFloat16: return "bfloat16";
    case DataType::Int32: return "int32";
    case DataType::Int64: return "int64";
    case DataType::UInt8: return "uint8";
    case DataType::UInt16: return "uint16";
  }
  return "unknown";
}

const char* nameOf(Backend backend) {
  switch (backend) {
    case Backend::Mpi: return "mpi";
    case Backend::Nccl: return "nccl";
    case Backend::MpiStaged: return "mpi-staged";
  }
  return "unknown";
}

void Work::wait(Stream stream) {
  if (impl_member) impl_member->wait(stream);
}

bool Work::test() { return !impl_member || impl_member->test(); }

bool ncclAvailable() { return PLM_HAVE_CUDA != 0; }

std::unique_ptr<Communicator> makeCommunicator(MPI_Comm comm, Backend backend) {
  if (backend == Backend::Mpi) return detail::makeMpiCommunicator(comm);
  if (backend == Backend::MpiStaged) return makeStagedCommunicator(comm, deviceCopier());
#if PLM_HAVE_CUDA
  return detail::makeNcclCommunicator(comm);
#else
  throw Error(
      "dist::makeCommunicator: the NCCL backend needs a CUDA build of plm (this build has no "
      "NCCL); use Backend::Mpi with host memory, or build with the `cuda` preset (doc/gpu.md)");
#endif
}

namespace {

/// Logs each distinct choice once per process (defaultBackend runs for every process group).
Backend chosen(Backend backend, const std::string& why) {
  static std::mutex mutex;
  static std::set<std::string> said;
  const std::string line =
      std::string("dist: collectives over ") + nameOf(backend) + " (" + why + ")";
  std::lock_guard<std::mutex> lock(mutex);
  if (said.insert(line).second) log::info("%s", line.c_str());
  return backend;
}

}  // namespace

Backend defaultBackend(MPI_Comm comm) {
  const char* env = std::getenv("PLM_COMM_BACKEND");
  const std::string choice = env ? env : "";
  if (choice == "mpi") return chosen(Backend::Mpi, "PLM_COMM_BACKEND=mpi");
  if (choice == "mpi-staged") return chosen(Backend::MpiStaged, "PLM_COMM_BACKEND=mpi-staged");
  if (choice == "nccl") {
    if (!ncclAvailable())
      throw Error(
          "PLM_COMM_BACKEND=nccl: this build of plm has no NCCL; unset PLM_COMM_BACKEND (or "
          "set auto, mpi or mpi-staged), or build with the `cuda` preset (doc/gpu.md)");
    return chosen(Backend::Nccl, "PLM_COMM_BACKEND=nccl");
  }
  if (!choice.empty() && choice != "auto")
    throw Error("PLM_COMM_BACKEND=" + choice +
                ": unknown communication backend; use auto (the default), nccl, mpi or "
                "mpi-staged (doc/parallelism.md, \"Communication backends\")");
#if PLM_HAVE_CUDA
  if (detail::ranksOnDistinctGpus(comm)) return chosen(Backend::Nccl, "one GPU per rank");
  return chosen(Backend::MpiStaged,
                "ranks share a GPU, which NCCL refuses: device buffers are staged through host "
                "memory; for speed run one rank per GPU");
#else
  (void)comm;
  return chosen(Backend::Mpi, "CPU build, host memory");
#endif
}

namespace detail {

namespace {

MPI_Datatype mpiDataType(DataType type) {
  switch (type) {
    case DataType::Float32: return MPI_FLOAT;
    case DataType::Float64: return MPI_DOUBLE;
    case DataType::BFloat16: return MPI_UINT16_T;  // moved as bits; sums are refused
    case DataType::Int32: return MPI_INT32_T;
    case DataType::Int64: return MPI_INT64_T;
    case DataType::UInt8: return MPI_UINT8_T;
    case DataType::UInt16: return MPI_UINT16_T;
  }
  throw Error("dist: unknown DataType");
}

void requireSummable(DataType type, const char* what) {
  if (type == DataType::BFloat16)
    throw Error(std::string("dist::") + what +
                ": the MPI backend cannot sum bfloat16 (MPI has no bf16 type); sum in float32, "
                "or use the NCCL backend");
}

int toInt(std::int64_t n, const char* what) {
  PLM_REQUIRE(n >= 0 && n <= INT_MAX, std::string("dist::") + what + ": count " +
                                          std::to_string(n) +
                                          " is negative or beyond MPI's int range");
  return static_cast<int>(n);
}

/// Non-blocking MPI requests, plus what to do once all completed (copy out of a temporary).
class MpiWork final : public WorkImpl {
 public:
  std::vector<MPI_Request> requests;
  std::vector<int> counts;                 // all-to-all-v arguments MPI reads until completion
  std::vector<unsigned char> scratch;      // a temporary the collective writes into
  std::function<void(MpiWork&)> complete;  // runs once, after every request completed

  void wait(Stream) override {
    if (!requests.empty())
      PLM_CHECK_MPI(
          MPI_Waitall(static_cast<int>(requests.size()), requests.data(), MPI_STATUSES_IGNORE));
    finish();
  }

  bool test() override {
    int flag = 1;
    if (!requests.empty())
      PLM_CHECK_MPI(MPI_Testall(static_cast<int>(requests.size()), requests.data(), &flag,
                                MPI_STATUSES_IGNORE));
    if (flag) finish();
    return flag != 0;
  }

  ~MpiWork() override {
    // An abandoned collective still owns `counts` and `scratch`: complete it before freeing.
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized && !requests.empty())
      MPI_Waitall(static_cast<int>(requests.size()), requests.data(), MPI_STATUSES_IGNORE);
  }

 private:
  void finish() {
    if (!complete) return;
    auto f = std::move(complete);
    complete = nullptr;
    f(*this);
  }
};

class MpiCommunicator final : public Communicator {
 public:
  explicit MpiCommunicator(MPI_Comm comm) {
    // A private duplicate: these non-blocking collectives never match a caller's own
    // collectives on `comm`.
    PLM_CHECK_MPI(MPI_Comm_dup(comm, &comm_member));
    PLM_CHECK_MPI(MPI_Comm_rank(comm_member, &rank_member));
    PLM_CHECK_MPI(MPI_Comm_size(comm_member, &size_member));
  }
  ~MpiCommunicator() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Comm_free(&comm_member);
  }
  MpiCommunicator(const MpiCommunicator&) = delete;
  MpiCommunicator& operator=(const MpiCommunicator&) = delete;

  int rank() const override { return rank_member; }
  int size() const override { return size_member; }
  Backend backend() const override { return Backend::Mpi; }
  bool deviceMemory() const override { return false; }

  Work allReduceSum(void* data, std::int64_t count, DataType type, Stream) override {
    requireSummable(type, "allReduceSum");
    PLM_REQUIRE(count >= 0, "dist::allReduceSum: negative count");
    if (count == 0 || size_member == 1) return Work();
    auto work = std::make_unique<MpiWork>();
    // MPI counts are int: a larger buffer goes as several requests (elementwise, so the split
    // changes no sum).
    constexpr std::int64_t chunk = std::int64_t(1) << 30;
    auto* bytes = static_cast<unsigned char*>(data);
    const std::size_t width = sizeOf(type);
    for (std::int64_t start = 0; start < count; start += chunk) {
      const int n = static_cast<int>(std::min(chunk, count - start));
      work->requests.emplace_back();
      PLM_CHECK_MPI(MPI_Iallreduce(MPI_IN_PLACE, bytes + start * width, n, mpiDataType(type),
                                   MPI_SUM, comm_member, &work->requests.back()));
    }
    return Work(std::move(work));
  }

  Work reduceScatterSum(const void* send, void* recv, std::int64_t recv_count, DataType type,
                        Stream) override {
    requireSummable(type, "reduceScatterSum");
    const int n = toInt(recv_count, "reduceScatterSum");
    if (n == 0) return Work();
    const std::size_t block = static_cast<std::size_t>(n) * sizeOf(type);
    auto work = std::make_unique<MpiWork>();
    work->requests.emplace_back();
    const auto* send_bytes = static_cast<const unsigned char*>(send);
    auto* recv_bytes = static_cast<unsigned char*>(recv);
    const bool overlaps = recv_bytes + block > send_bytes &&
                          send_bytes + block * static_cast<std::size_t>(size_member) > recv_bytes;
    if (overlaps) {
      // recv inside send (NCCL's in-place form): reduce into a temporary, copy on completion.
      work->scratch.resize(block);
      PLM_CHECK_MPI(MPI_Ireduce_scatter_block(send, work->scratch.data(), n, mpiDataType(type),
                                              MPI_SUM, comm_member, &work->requests.back()));
      work->complete = [recv_bytes, block](MpiWork& w) {
        std::memcpy(recv_bytes, w.scratch.data(), block);
      };
    } else {
      PLM_CHECK_MPI(MPI_Ireduce_scatter_block(send, recv, n, mpiDataType(type), MPI_SUM,
                                              comm_member, &work->requests.back()));
    }
    return Work(std::move(work));
  }

  Work allGather(const void* send, void* recv, std::int64_t send_count, DataType type,
                 Stream) override {
    const int n = toInt(send_count, "allGather");
    toInt(send_count * size_member, "allGather");
    if (n == 0) return Work();
    auto work = std::make_unique<MpiWork>();
    work->requests.emplace_back();
    const bool in_place = static_cast<const unsigned char*>(send) ==
                          static_cast<unsigned char*>(recv) +
                              static_cast<std::size_t>(rank_member) * n * sizeOf(type);
    PLM_CHECK_MPI(MPI_Iallgather(in_place ? MPI_IN_PLACE : send, n, mpiDataType(type), recv, n,
                                 mpiDataType(type), comm_member, &work->requests.back()));
    return Work(std::move(work));
  }

  Work allToAllV(const void* send, const std::vector<std::int64_t>& send_counts,
                 const std::vector<std::int64_t>& send_offsets, void* recv,
                 const std::vector<std::int64_t>& recv_counts,
                 const std::vector<std::int64_t>& recv_offsets, DataType type, Stream) override {
    const auto p = static_cast<std::size_t>(size_member);
    PLM_REQUIRE(
        send_counts.size() == p && send_offsets.size() == p && recv_counts.size() == p &&
            recv_offsets.size() == p,
        "dist::allToAllV: counts and offsets need one entry per rank (" + std::to_string(p) + ")");
    auto work = std::make_unique<MpiWork>();
    work->counts.resize(4 * p);
    int* sc = work->counts.data();
    int* sd = sc + p;
    int* rc = sd + p;
    int* rd = rc + p;
    for (std::size_t q = 0; q < p; ++q) {
      sc[q] = toInt(send_counts[q], "allToAllV");
      sd[q] = toInt(send_offsets[q], "allToAllV");
      rc[q] = toInt(recv_counts[q], "allToAllV");
      rd[q] = toInt(recv_offsets[q], "allToAllV");
    }
    // Open MPI's non-blocking all-to-all-v (libnbc) takes send == recv for MPI_IN_PLACE and
    // then sends from the receive buffer with the receive counts: a rank that sends nothing
    // but receives would hang the exchange.  Such a rank's send buffer is never read, so it
    // gets a distinct one; real overlap is the caller's bug.
    if (send == recv && std::any_of(rc, rc + p, [](int c) { return c > 0; })) {
      PLM_REQUIRE(std::all_of(sc, sc + p, [](int c) { return c == 0; }),
                  "dist::allToAllV: the send and receive buffers are the same; all-to-all-v "
                  "has no in-place form here, pass separate buffers");
      work->scratch.resize(1);
      send = work->scratch.data();
    }
    work->requests.emplace_back();
    PLM_CHECK_MPI(MPI_Ialltoallv(send, sc, sd, mpiDataType(type), recv, rc, rd, mpiDataType(type),
                                 comm_member, &work->requests.back()));
    return Work(std::move(work));
  }

  Work sendRecv(const void* send, std::int64_t send_count, int dest, void* recv,
                std::int64_t recv_count, int source, DataType type, Stream) override {
    const int ns = toInt(send_count, "sendRecv");
    const int nr = toInt(recv_count, "sendRecv");
    PLM_REQUIRE(dest >= 0 && dest < size_member && source >= 0 && source < size_member,
                "dist::sendRecv: peer " + std::to_string(dest) + " / " + std::to_string(source) +
                    " outside the group of " + std::to_string(size_member) + " ranks");
    auto work = std::make_unique<MpiWork>();
    // A fixed tag on the private duplicate: MPI keeps the order of messages between one pair
    // of ranks, so successive ring steps match in the order they were posted.
    constexpr int tag = 7;
    if (nr > 0) {
      work->requests.emplace_back();
      PLM_CHECK_MPI(
          MPI_Irecv(recv, nr, mpiDataType(type), source, tag, comm_member, &work->requests.back()));
    }
    if (ns > 0) {
      work->requests.emplace_back();
      PLM_CHECK_MPI(
          MPI_Isend(send, ns, mpiDataType(type), dest, tag, comm_member, &work->requests.back()));
    }
    return Work(std::move(work));
  }

 private:
  MPI_Comm comm_member = MPI_COMM_NULL;
  int rank_member = 0;
  int size_member = 1;
};

}  // namespace

std::unique_ptr<Communicator> makeMpiCommunicator(MPI_Comm comm) {
  return std::make_unique<MpiCommunicator>(comm);
}

}  // namespace detail

}  // namespace plm::dist
