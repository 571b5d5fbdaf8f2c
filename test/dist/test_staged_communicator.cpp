// Staged MPI (dist/staged_communicator.hpp) against the plain MPI backend on the same inputs.
// Both run the same MPI calls, so every result must be bitwise equal; the inputs are random
// floats, where any change of summation order would show.  The "device" is host memory behind a
// counting HostCopier, so the CPU CI runs the same staging code the CUDA copier drives on a GPU,
// and the test sees every allocation, copy and synchronisation.  The last tests go through
// makeCommunicator(MpiStaged) on the model's memory space (CUDA memory and the CUDA copier on a
// GPU build).  Runs at 1, 2 and 4 ranks.
#include "core/error.hpp"
#include "core/types.hpp"
#include "dist/communicator.hpp"
#include "dist/process_groups.hpp"
#include "dist/staged_communicator.hpp"
#include "dist/stream.hpp"

#include <gtest/gtest.h>
#include <Kokkos_Core.hpp>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace {

using plm::dist::Backend;
using plm::dist::Communicator;
using plm::dist::Work;

/// HostCopier that counts what the staged communicator asks of it.
class CountingCopier : public plm::dist::HostCopier {
 public:
  int allocations = 0, frees = 0, synchronizations = 0;
  std::size_t bytes_in = 0, bytes_out = 0;
  void* allocateHost(std::size_t bytes) override {
    ++allocations;
    return HostCopier::allocateHost(bytes);
  }
  void freeHost(void* host) override {
    ++frees;
    HostCopier::freeHost(host);
  }
  void toHost(void* host, const void* device, std::size_t bytes, plm::dist::Stream s) override {
    bytes_in += bytes;
    HostCopier::toHost(host, device, bytes, s);
  }
  void toDevice(void* device, const void* host, std::size_t bytes, plm::dist::Stream s) override {
    bytes_out += bytes;
    HostCopier::toDevice(device, host, bytes, s);
  }
  void synchronize(plm::dist::Stream) override { ++synchronizations; }
};

struct Pair {
  std::shared_ptr<CountingCopier> copier = std::make_shared<CountingCopier>();
  std::unique_ptr<Communicator> staged = plm::dist::makeStagedCommunicator(MPI_COMM_WORLD, copier);
  std::unique_ptr<Communicator> mpi = plm::dist::makeCommunicator(MPI_COMM_WORLD, Backend::Mpi);
  int p = staged->size(), me = staged->rank();
};

template <class T> std::vector<T> randomBuffer(int rank, std::int64_t n, int salt) {
  std::mt19937_64 gen(static_cast<std::uint64_t>(rank) * 7919 + static_cast<std::uint64_t>(salt));
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  std::vector<T> v(static_cast<std::size_t>(n));
  for (auto& x : v) {
    if constexpr (std::is_floating_point_v<T>)
      x = static_cast<T>(u(gen));
    else
      x = static_cast<T>(gen() % 60000);
  }
  return v;
}

template <class T> bool bitwiseEqual(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

TEST(StagedCommunicator, IsDeviceMemoryOverMpiRanks) {
  Pair c;
  EXPECT_EQ(c.staged->backend(), Backend::MpiStaged);
  EXPECT_TRUE(c.staged->deviceMemory());
  EXPECT_EQ(c.staged->rank(), c.mpi->rank());
  EXPECT_EQ(c.staged->size(), c.mpi->size());
  EXPECT_STREQ(plm::dist::nameOf(Backend::MpiStaged), "mpi-staged");
  auto made = plm::dist::makeCommunicator(MPI_COMM_WORLD, Backend::MpiStaged);
  EXPECT_EQ(made->backend(), Backend::MpiStaged);
  EXPECT_TRUE(made->deviceMemory());
}

// 0 (nothing moves), 1, odd, and more than a 4 KiB staging page.
const std::int64_t kSizes[] = {0, 1, 1001, 70001};

template <class T> void checkAllReduce() {
  Pair c;
  for (std::int64_t n : kSizes) {
    auto staged = randomBuffer<T>(c.me, n, 1);
    auto plain = staged;
    const std::size_t in_before = c.copier->bytes_in;
    c.staged->allReduceSum(staged.data(), n).wait();
    c.mpi->allReduceSum(plain.data(), n).wait();
    EXPECT_TRUE(bitwiseEqual(staged, plain)) << "n = " << n;
    // Staged only where MPI moves anything (one rank sums nothing).
    const std::size_t moved = (n > 0 && c.p > 1) ? n * sizeof(T) : 0;
    EXPECT_EQ(c.copier->bytes_in - in_before, moved) << "n = " << n;
  }
}
TEST(StagedCommunicator, AllReduceSumFloatBitwiseAsMpi) { checkAllReduce<float>(); }
TEST(StagedCommunicator, AllReduceSumDoubleBitwiseAsMpi) { checkAllReduce<double>(); }
TEST(StagedCommunicator, AllReduceSumInt64BitwiseAsMpi) { checkAllReduce<std::int64_t>(); }

TEST(StagedCommunicator, RefusesBf16SumsLikeMpi) {
  Pair c;
  std::vector<std::uint16_t> bits(4, 0x3f80);
  if (c.p > 1) EXPECT_THROW(c.staged->allReduceSum(bits.data(), 4), plm::Error);
  EXPECT_THROW(c.staged->reduceScatterSum(bits.data(), bits.data(), 1), plm::Error);
}

TEST(StagedCommunicator, ReduceScatterSumBitwiseAsMpiIncludingInPlace) {
  Pair c;
  for (std::int64_t block : kSizes) {
    const auto send = randomBuffer<float>(c.me, block * c.p, 2);
    std::vector<float> staged(block, -7.0f), plain(block, -7.0f);
    c.staged->reduceScatterSum(send.data(), staged.data(), block).wait();
    c.mpi->reduceScatterSum(send.data(), plain.data(), block).wait();
    EXPECT_TRUE(bitwiseEqual(staged, plain)) << "block " << block;
    // NCCL's in-place form: the result lands in this rank's block of the send buffer, and the
    // other blocks keep what they held.
    auto inplace = send;
    c.staged->reduceScatterSum(inplace.data(), inplace.data() + c.me * block, block).wait();
    for (std::int64_t i = 0; i < block * c.p; ++i) {
      const bool mine = i >= c.me * block && i < (c.me + 1) * block;
      const float want = mine ? plain[i - c.me * block] : send[i];
      ASSERT_EQ(std::memcmp(&inplace[i], &want, sizeof(float)), 0) << "in place, element " << i;
    }
  }
}

TEST(StagedCommunicator, AllGatherBitwiseAsMpiIncludingInPlace) {
  Pair c;
  for (std::int64_t n : kSizes) {
    const auto send = randomBuffer<double>(c.me, n, 3);
    std::vector<double> staged(n * c.p, -7.0), plain(n * c.p, -7.0);
    c.staged->allGather(send.data(), staged.data(), n).wait();
    c.mpi->allGather(send.data(), plain.data(), n).wait();
    EXPECT_TRUE(bitwiseEqual(staged, plain)) << "n = " << n;
    // In place (send is this rank's slot of recv), bf16 bits.
    auto bits = randomBuffer<std::uint16_t>(c.me, n * c.p, 4);
    std::vector<std::uint16_t> want(bits.size());
    for (int r = 0; r < c.p; ++r) {
      const auto theirs = randomBuffer<std::uint16_t>(r, n * c.p, 4);
      std::copy(theirs.begin() + r * n, theirs.begin() + (r + 1) * n, want.begin() + r * n);
    }
    c.staged->allGather(bits.data() + c.me * n, bits.data(), n).wait();
    EXPECT_TRUE(bitwiseEqual(bits, want)) << "in place, n = " << n;
  }
}

// Rank r sends count(r, q) elements to rank q: uneven, zero for some pairs, and nothing at all
// from or to the last rank at 2 and 4 ranks (an empty rank).
std::int64_t count(int from, int to, int p) {
  if (p > 1 && (from == p - 1 || to == p - 1)) return 0;
  return (from + 2 * to) % 3 == 0 ? 0 : (from * 7 + to * 3) % 11 + 1;
}

TEST(StagedCommunicator, AllToAllVBitwiseAsMpiWithEmptyRanksAndGaps) {
  Pair c;
  std::vector<std::int64_t> sc(c.p), so(c.p), rc(c.p), ro(c.p);
  std::int64_t sent = 0, received = 0;
  for (int q = c.p - 1; q >= 0; --q) {  // blocks in reverse rank order: offsets are honoured
    sc[q] = count(c.me, q, c.p);
    so[q] = sent;
    sent += sc[q] + 1;
    rc[q] = count(q, c.me, c.p);
    ro[q] = received;
    received += rc[q] + 2;  // a gap after each block, which must stay untouched
  }
  const auto send = randomBuffer<float>(c.me, sent, 5);
  std::vector<float> staged(received, -7.0f), plain(received, -7.0f);
  const std::size_t out_before = c.copier->bytes_out;
  c.staged->allToAllV(send.data(), sc, so, staged.data(), rc, ro).wait();
  c.mpi->allToAllV(send.data(), sc, so, plain.data(), rc, ro).wait();
  EXPECT_TRUE(bitwiseEqual(staged, plain));
  std::int64_t got = 0;
  for (int q = 0; q < c.p; ++q) {
    got += rc[q];
    EXPECT_EQ(staged[ro[q] + rc[q]], -7.0f) << "the gap after rank " << q << "'s block";
  }
  EXPECT_EQ(c.copier->bytes_out - out_before, got * sizeof(float)) << "only received blocks";
  // Every count zero: a collective that moves nothing.
  std::vector<std::int64_t> zero(c.p, 0);
  float x = 1.0f;
  c.staged->allToAllV(&x, zero, zero, &x, zero, zero).wait();
  EXPECT_EQ(x, 1.0f);
  std::vector<std::int64_t> wrong(c.p + 1, 0);
  EXPECT_THROW(c.staged->allToAllV(&x, wrong, wrong, &x, wrong, wrong), plm::Error);
}

// One-sided ranks: even ranks send (to odd ranks) and receive nothing, odd ranks receive and
// send nothing: the MoE exchange's shape when a rank has no tokens or hosts no routed rows.  A
// rank with an empty send side once had its receive region at the same staging address as its
// (empty) send region, which Open MPI's libnbc took for MPI_IN_PLACE and sent the receive
// counts from it, to ranks that expected nothing: the exchange hung.  Also
// through the plain MPI backend with send == recv on a rank that sends nothing.
TEST(StagedCommunicator, AllToAllVWithOnlySendingAndOnlyReceivingRanks) {
  Pair c;
  // Blocks over Open MPI's shared-memory eager limit (4 KiB): a stray in-place send of that
  // size waits for a receive that is never posted (small ones completed unseen).
  auto n = [&](int from, int to) -> std::int64_t {
    return (from % 2 == 0 && to % 2 == 1) ? 3000 * (from + to + 1) : 0;
  };
  std::vector<std::int64_t> sc(c.p), so(c.p), rc(c.p), ro(c.p);
  std::int64_t sent = 0, received = 0;
  for (int q = 0; q < c.p; ++q) {
    sc[q] = n(c.me, q);
    so[q] = sent;
    sent += sc[q];
    rc[q] = n(q, c.me);
    ro[q] = received;
    received += rc[q];
  }
  const auto send = randomBuffer<float>(c.me, std::max<std::int64_t>(sent, 1), 9);
  std::vector<float> staged(std::max<std::int64_t>(received, 1), -7.0f), plain = staged;
  c.staged->allToAllV(send.data(), sc, so, staged.data(), rc, ro).wait();
  c.mpi->allToAllV(send.data(), sc, so, plain.data(), rc, ro).wait();
  EXPECT_TRUE(bitwiseEqual(staged, plain));
  // What each sender put in its block for this rank, element by element.
  for (int q = 0; q < c.p; ++q) {
    if (rc[q] == 0) continue;
    std::int64_t at = 0;
    for (int t = 0; t < c.me; ++t) at += n(q, t);
    const auto theirs = randomBuffer<float>(q, std::max<std::int64_t>(at + rc[q], 1), 9);
    for (std::int64_t i = 0; i < rc[q]; ++i)
      ASSERT_EQ(staged[ro[q] + i], theirs[at + i]) << "from rank " << q << ", element " << i;
  }
  // Plain MPI with the receive buffer passed as the send buffer by a rank that sends nothing.
  std::vector<float> same(staged.size(), -7.0f);
  const float* out = sent == 0 ? same.data() : send.data();
  c.mpi->allToAllV(out, sc, so, same.data(), rc, ro).wait();
  EXPECT_TRUE(bitwiseEqual(same, plain));
}

TEST(StagedCommunicator, SendRecvAroundARingBitwiseAsMpi) {
  Pair c;
  const int next = (c.me + 1) % c.p, prev = (c.me + c.p - 1) % c.p;
  // Rank r sends 100 + 37 r elements (rank 0 of several: none, a rank that only receives).
  auto sends = [&](int r) -> std::int64_t { return (c.p > 1 && r == 0) ? 0 : 100 + 37 * r; };
  for (int round = 0; round < 3; ++round) {
    const auto send = randomBuffer<double>(c.me, sends(c.me), 6 + round);
    std::vector<double> staged(sends(prev) + 1, -7.0), plain(sends(prev) + 1, -7.0);
    Work a = c.staged->sendRecv(send.data(), sends(c.me), next, staged.data(), sends(prev), prev);
    Work b = c.mpi->sendRecv(send.data(), sends(c.me), next, plain.data(), sends(prev), prev);
    a.wait();
    b.wait();
    EXPECT_TRUE(bitwiseEqual(staged, plain)) << "round " << round;
    EXPECT_EQ(staged.back(), -7.0) << "wrote past the received elements";
    const auto theirs = randomBuffer<double>(prev, sends(prev), 6 + round);
    EXPECT_EQ(std::memcmp(staged.data(), theirs.data(), theirs.size() * sizeof(double)), 0);
  }
  float x = 1.0f;
  EXPECT_THROW(c.staged->sendRecv(&x, 1, c.p, &x, 0, prev), plm::Error);
}

// FSDP's pattern: the next layer's all-gather prefetched while a reduce-scatter runs, and an
// all-reduce besides, waited in another order than started; then again, to check the three
// in-flight collectives each had their own staging buffer and the pool settled.
TEST(StagedCommunicator, CollectivesInFlightTogetherKeepTheirOwnBuffers) {
  Pair c;
  const std::int64_t n = 3001;
  int allocations_after_first = 0;
  for (int round = 0; round < 4; ++round) {
    const auto shard = randomBuffer<float>(c.me, n, 10 + round);
    const auto grads = randomBuffer<float>(c.me, n * c.p, 20 + round);
    auto sum = randomBuffer<double>(c.me, n, 30 + round);
    std::vector<float> gathered(n * c.p), reduced(n);
    auto sum_plain = sum;
    std::vector<float> gathered_plain(n * c.p), reduced_plain(n);

    Work g = c.staged->allGather(shard.data(), gathered.data(), n);
    Work r = c.staged->reduceScatterSum(grads.data(), reduced.data(), n);
    Work s = c.staged->allReduceSum(sum.data(), n);
    s.wait();
    EXPECT_TRUE(s.test());
    r.wait();
    g.wait();
    g.wait();  // idempotent

    c.mpi->allGather(shard.data(), gathered_plain.data(), n).wait();
    c.mpi->reduceScatterSum(grads.data(), reduced_plain.data(), n).wait();
    c.mpi->allReduceSum(sum_plain.data(), n).wait();
    EXPECT_TRUE(bitwiseEqual(gathered, gathered_plain)) << "round " << round;
    EXPECT_TRUE(bitwiseEqual(reduced, reduced_plain)) << "round " << round;
    EXPECT_TRUE(bitwiseEqual(sum, sum_plain)) << "round " << round;
    if (round == 0) allocations_after_first = c.copier->allocations;
  }
  // Three buffers in flight at once (two at one rank: its all-reduce stages nothing).
  EXPECT_EQ(allocations_after_first, c.p > 1 ? 3 : 2);
  EXPECT_EQ(c.copier->allocations, allocations_after_first) << "the staging pool grew again";
  EXPECT_EQ(c.copier->frees, 0);
}

TEST(StagedCommunicator, RepeatedSameSizeCallsAllocateOnce) {
  Pair c;
  const std::int64_t n = 20000;
  auto data = randomBuffer<float>(c.me, n * c.p, 40);
  std::vector<float> out(n * c.p);
  int after_first = 0;
  for (int i = 0; i < 10; ++i) {
    c.staged->allGather(data.data(), out.data(), n).wait();
    c.staged->reduceScatterSum(out.data(), data.data(), n).wait();
    if (c.p > 1) c.staged->allReduceSum(data.data(), n).wait();
    if (i == 0) after_first = c.copier->allocations;
  }
  // One collective at a time: one buffer, grown once (the reduce-scatter stages its send and
  // receive blocks, more than the all-gather's buffer), then reused.
  EXPECT_LE(after_first, 2);
  EXPECT_EQ(c.copier->allocations, after_first) << "same-size calls allocated again";
  // Each collective synchronises before MPI and after copying back.
  EXPECT_EQ(c.copier->synchronizations, 10 * (c.p > 1 ? 3 : 2) * 2);
}

TEST(StagedCommunicator, GrowingSizesSettleAfterFewAllocations) {
  Pair c;
  std::vector<std::int64_t> counts(c.p, 0), offsets(c.p, 0);
  int allocations = 0;
  for (std::int64_t n = 1000; n <= 100000; n += 1000) {  // all-to-all-v sizes vary per step
    std::vector<double> send(n * c.p, 1.0), recv(n * c.p);
    for (int q = 0; q < c.p; ++q) {
      counts[q] = n;
      offsets[q] = q * n;
    }
    c.staged->allToAllV(send.data(), counts, offsets, recv.data(), counts, offsets).wait();
    ASSERT_EQ(recv, send);
    allocations = c.copier->allocations;
  }
  // 100 sizes over a factor 100: growing by half each time needs about log(100)/log(1.5) = 12.
  EXPECT_LE(allocations, 14) << "each growth should be at least half the buffer";
  EXPECT_EQ(c.copier->frees, allocations - 1) << "a grown buffer replaces the old one";
}

// A kernel in a free function: CUDA's extended lambdas may not live in gtest's private TestBody.
void scaleBy2(const plm::ExecSpace& space, const plm::View1<float>& v) {
  Kokkos::parallel_for(
      "plm::test::staged::scale",
      Kokkos::RangePolicy<plm::ExecSpace>(space, 0, static_cast<std::int64_t>(v.extent(0))),
      KOKKOS_LAMBDA(std::int64_t i) { v(i) *= 2.0f; });
}

// Through makeCommunicator on the model's memory space: CUDA memory and the CUDA copier on a
// GPU build (ranks may share the GPU), host memory and memcpy on a CPU build.
TEST(StagedCommunicator, ModelMemoryThroughMakeCommunicator) {
  auto staged = plm::dist::makeCommunicator(MPI_COMM_WORLD, Backend::MpiStaged);
  auto mpi = plm::dist::makeCommunicator(MPI_COMM_WORLD, Backend::Mpi);
  const int p = staged->size(), me = staged->rank();
  const std::int64_t n = 4097;
  const auto host = randomBuffer<float>(me, n * p, 50);
  plm::View1<float> send("send", n * p), gathered("gathered", n * p), reduced("reduced", n);
  Kokkos::deep_copy(send, plm::HostView1<float>(const_cast<float*>(host.data()), n * p));
  plm::ExecSpace space;
  const auto stream = plm::dist::streamOf(space);
  // Queued on the stream, not fenced: the staged communicator orders after it.
  scaleBy2(space, send);
  Work g = staged->allGather(send.data() + me * n, gathered.data(), n, stream);
  Work r = staged->reduceScatterSum(send.data(), reduced.data(), n, stream);
  r.wait(stream);
  g.wait(stream);
  std::vector<float> got_g(n * p), got_r(n);
  Kokkos::deep_copy(plm::HostView1<float>(got_g.data(), n * p), gathered);
  Kokkos::deep_copy(plm::HostView1<float>(got_r.data(), n), reduced);

  std::vector<float> doubled(host);
  for (auto& x : doubled) x *= 2.0f;
  std::vector<float> want_g(n * p), want_r(n);
  mpi->allGather(doubled.data() + me * n, want_g.data(), n).wait();
  mpi->reduceScatterSum(doubled.data(), want_r.data(), n).wait();
  EXPECT_TRUE(bitwiseEqual(got_g, want_g));
  EXPECT_TRUE(bitwiseEqual(got_r, want_r));
}

/// Sets PLM_COMM_BACKEND for one scope.
class ScopedBackendEnv {
 public:
  explicit ScopedBackendEnv(const char* value) {
    if (const char* old = std::getenv("PLM_COMM_BACKEND")) old_member = old, had_member = true;
    if (value)
      setenv("PLM_COMM_BACKEND", value, 1);
    else
      unsetenv("PLM_COMM_BACKEND");
  }
  ~ScopedBackendEnv() {
    if (had_member)
      setenv("PLM_COMM_BACKEND", old_member.c_str(), 1);
    else
      unsetenv("PLM_COMM_BACKEND");
  }

 private:
  std::string old_member;
  bool had_member = false;
};

TEST(DefaultBackend, ChoosesByBuildAndGpuSharingAndHonoursTheOverride) {
  {
    ScopedBackendEnv env(nullptr);
    const Backend b = plm::dist::defaultBackend(MPI_COMM_WORLD);
    if (!plm::dist::ncclAvailable())
      EXPECT_EQ(b, Backend::Mpi) << "a CPU build's memory is host memory";
    else
      EXPECT_NE(b, Backend::Mpi) << "a CUDA build's model memory needs a device-memory backend";
  }
  {
    ScopedBackendEnv env("mpi-staged");
    EXPECT_EQ(plm::dist::defaultBackend(MPI_COMM_WORLD), Backend::MpiStaged);
  }
  {
    ScopedBackendEnv env("mpi");
    EXPECT_EQ(plm::dist::defaultBackend(MPI_COMM_WORLD), Backend::Mpi);
  }
  {
    ScopedBackendEnv env("auto");
    EXPECT_NO_THROW(plm::dist::defaultBackend(MPI_COMM_WORLD));
  }
  {
    ScopedBackendEnv env("infiniband");
    try {
      plm::dist::defaultBackend(MPI_COMM_WORLD);
      FAIL() << "an unknown PLM_COMM_BACKEND was accepted";
    } catch (const plm::Error& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("PLM_COMM_BACKEND=infiniband"), std::string::npos) << what;
      EXPECT_NE(what.find("mpi-staged"), std::string::npos) << what;
    }
  }
  if (!plm::dist::ncclAvailable()) {
    ScopedBackendEnv env("nccl");
    EXPECT_THROW(plm::dist::defaultBackend(MPI_COMM_WORLD), plm::Error);
  }
}

}  // namespace
