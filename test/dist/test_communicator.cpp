// dist::Communicator (MPI backend, host memory) and ProcessGroups against references every
// rank computes locally: each rank fills its buffers from a formula of (rank, index), so every
// rank knows what every other rank sent.  Values are small integers where the test wants an
// exact sum (any summation order gives the same bits), random where it checks tolerance and
// rerun bit-equality.  Runs at 1, 2 and 4 ranks.
#include "core/error.hpp"
#include "dist/communicator.hpp"
#include "dist/process_groups.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

namespace {

using plm::dist::Backend;
using plm::dist::Communicator;
using plm::dist::makeCommunicator;

std::unique_ptr<Communicator> mpiWorld() { return makeCommunicator(MPI_COMM_WORLD, Backend::Mpi); }

// Integer-valued, so sums are exact in float and double.
double exactValue(int rank, std::int64_t i) { return static_cast<double>((rank + 1) * 3 + i % 17); }

double randomValue(int rank, std::int64_t i) {
  std::mt19937_64 gen(static_cast<std::uint64_t>(rank) * 1000003 + static_cast<std::uint64_t>(i));
  return std::uniform_real_distribution<double>(-1.0, 1.0)(gen);
}

TEST(Communicator, RankAndSizeMatchMpi) {
  auto comm = mpiWorld();
  EXPECT_EQ(comm->rank(), plm::dist::commRank(MPI_COMM_WORLD));
  EXPECT_EQ(comm->size(), plm::dist::commSize(MPI_COMM_WORLD));
  EXPECT_EQ(comm->backend(), Backend::Mpi);
  EXPECT_FALSE(comm->deviceMemory());
}

template <class T> void checkExactAllReduce() {
  auto comm = mpiWorld();
  const int p = comm->size();
  const std::int64_t n = 1001;  // odd, not a multiple of any rank count
  std::vector<T> data(n);
  for (std::int64_t i = 0; i < n; ++i) data[i] = static_cast<T>(exactValue(comm->rank(), i));
  comm->allReduceSum(data.data(), n).wait();
  for (std::int64_t i = 0; i < n; ++i) {
    double expected = 0.0;
    for (int r = 0; r < p; ++r) expected += exactValue(r, i);
    ASSERT_EQ(data[i], static_cast<T>(expected)) << "element " << i;
  }
}

TEST(Communicator, AllReduceSumFloatIsExactOnIntegers) { checkExactAllReduce<float>(); }
TEST(Communicator, AllReduceSumDoubleIsExactOnIntegers) { checkExactAllReduce<double>(); }
TEST(Communicator, AllReduceSumInt64IsExact) { checkExactAllReduce<std::int64_t>(); }

TEST(Communicator, AllReduceSumRandomMatchesReferenceAndRerunsBitwise) {
  auto comm = mpiWorld();
  const int p = comm->size();
  const std::int64_t n = 4099;
  std::vector<float> first(n), second(n);
  for (std::int64_t i = 0; i < n; ++i)
    first[i] = second[i] = static_cast<float>(randomValue(comm->rank(), i));
  comm->allReduceSum(first.data(), n).wait();
  comm->allReduceSum(second.data(), n).wait();
  for (std::int64_t i = 0; i < n; ++i) {
    double expected = 0.0;
    for (int r = 0; r < p; ++r) expected += static_cast<float>(randomValue(r, i));
    ASSERT_NEAR(first[i], expected, 1e-6 * p) << "element " << i;
  }
  EXPECT_EQ(std::memcmp(first.data(), second.data(), n * sizeof(float)), 0)
      << "two identical all-reduces differ in their bits";
}

TEST(Communicator, SeveralCollectivesInFlightCompleteInAnyWaitOrder) {
  auto comm = mpiWorld();
  const int p = comm->size();
  std::vector<std::vector<double>> buffers(5, std::vector<double>(257));
  for (std::size_t b = 0; b < buffers.size(); ++b)
    for (std::size_t i = 0; i < buffers[b].size(); ++i)
      buffers[b][i] = exactValue(comm->rank(), static_cast<std::int64_t>(b * 1000 + i));
  std::vector<plm::dist::Work> work;
  for (auto& b : buffers) work.push_back(comm->allReduceSum(b.data(), std::int64_t(b.size())));
  for (auto it = work.rbegin(); it != work.rend(); ++it) it->wait();
  for (auto& w : work) EXPECT_TRUE(w.test());
  for (std::size_t b = 0; b < buffers.size(); ++b)
    for (std::size_t i = 0; i < buffers[b].size(); ++i) {
      double expected = 0.0;
      for (int r = 0; r < p; ++r)
        expected += exactValue(r, static_cast<std::int64_t>(b * 1000 + i));
      ASSERT_EQ(buffers[b][i], expected);
    }
}

TEST(Communicator, ZeroCountIsAnEmptyCompletedWork) {
  auto comm = mpiWorld();
  float unused = 7.0f;
  plm::dist::Work w = comm->allReduceSum(&unused, 0);
  EXPECT_TRUE(w.test());
  w.wait();
  EXPECT_EQ(unused, 7.0f);
}

TEST(Communicator, MpiRefusesBf16Sums) {
  auto comm = mpiWorld();
  std::vector<std::uint16_t> bits(4, 0x3f80);  // 1.0 in bf16
  EXPECT_THROW(comm->allReduceSum(bits.data(), 4), plm::Error);
}

TEST(Communicator, ReduceScatterSumGivesEachRankItsBlock) {
  auto comm = mpiWorld();
  const int p = comm->size(), me = comm->rank();
  const std::int64_t block = 37;
  std::vector<float> send(block * p), recv(block, -1.0f);
  for (std::int64_t i = 0; i < block * p; ++i) send[i] = static_cast<float>(exactValue(me, i));
  comm->reduceScatterSum(send.data(), recv.data(), block).wait();
  for (std::int64_t i = 0; i < block; ++i) {
    double expected = 0.0;
    for (int r = 0; r < p; ++r) expected += exactValue(r, me * block + i);
    ASSERT_EQ(recv[i], static_cast<float>(expected)) << "element " << i;
  }
  // NCCL's in-place form: the result lands in this rank's block of the send buffer.
  std::vector<double> inplace(block * p);
  for (std::int64_t i = 0; i < block * p; ++i) inplace[i] = exactValue(me, i);
  double* mine = inplace.data() + me * block;
  comm->reduceScatterSum(inplace.data(), mine, block).wait();
  for (std::int64_t i = 0; i < block; ++i) {
    double expected = 0.0;
    for (int r = 0; r < p; ++r) expected += exactValue(r, me * block + i);
    ASSERT_EQ(mine[i], expected) << "in place, element " << i;
  }
}

TEST(Communicator, AllGatherConcatenatesInRankOrder) {
  auto comm = mpiWorld();
  const int p = comm->size(), me = comm->rank();
  const std::int64_t n = 23;
  std::vector<float> send(n), recv(n * p, -1.0f);
  for (std::int64_t i = 0; i < n; ++i) send[i] = static_cast<float>(exactValue(me, i));
  comm->allGather(send.data(), recv.data(), n).wait();
  for (int r = 0; r < p; ++r)
    for (std::int64_t i = 0; i < n; ++i)
      ASSERT_EQ(recv[r * n + i], static_cast<float>(exactValue(r, i)));

  // bf16 as raw bits (uint16), gathered in place from this rank's slot.
  std::vector<std::uint16_t> bits(n * p, 0);
  for (std::int64_t i = 0; i < n; ++i)
    bits[me * n + i] = static_cast<std::uint16_t>(0x3f00 + me * 64 + i);
  comm->allGather(bits.data() + me * n, bits.data(), n).wait();
  for (int r = 0; r < p; ++r)
    for (std::int64_t i = 0; i < n; ++i)
      ASSERT_EQ(bits[r * n + i], static_cast<std::uint16_t>(0x3f00 + r * 64 + i));
}

// Rank r sends count(r, q) elements to rank q: uneven, and zero for some pairs (every pair
// (r, r+1 mod 3) at 4 ranks, the self pair of rank 0 at 1 rank).
std::int64_t count(int from, int to) {
  return (from + 2 * to) % 3 == 0 ? 0 : (from + 2 * to) % 5 + 1;
}
std::int64_t payload(int from, int to, std::int64_t i) { return from * 100000 + to * 1000 + i; }

template <class T> void checkAllToAllV() {
  auto comm = mpiWorld();
  const int p = comm->size(), me = comm->rank();
  std::vector<std::int64_t> sc(p), so(p), rc(p), ro(p);
  std::int64_t sent = 0, received = 0;
  for (int q = 0; q < p; ++q) {
    sc[q] = count(me, q);
    so[q] = sent;
    sent += sc[q] + 1;  // a gap between the blocks: offsets are honoured
    rc[q] = count(q, me);
    ro[q] = received;
    received += rc[q] + 2;
  }
  std::vector<T> send(sent, T(0)), recv(received, T(-1));
  for (int q = 0; q < p; ++q)
    for (std::int64_t i = 0; i < sc[q]; ++i)
      send[so[q] + i] = static_cast<T>(payload(me, q, i) % 30000);
  comm->allToAllV(send.data(), sc, so, recv.data(), rc, ro).wait();
  for (int q = 0; q < p; ++q) {
    for (std::int64_t i = 0; i < rc[q]; ++i)
      ASSERT_EQ(recv[ro[q] + i], static_cast<T>(payload(q, me, i) % 30000)) << "from " << q;
    ASSERT_EQ(recv[ro[q] + rc[q]], T(-1)) << "the gap after rank " << q << "'s block was written";
  }
}

TEST(Communicator, AllToAllVUnevenWithZeroCountsFloat) { checkAllToAllV<float>(); }
TEST(Communicator, AllToAllVUnevenWithZeroCountsInt64) { checkAllToAllV<std::int64_t>(); }
TEST(Communicator, AllToAllVUnevenWithZeroCountsBf16Bits) { checkAllToAllV<std::uint16_t>(); }

TEST(Communicator, AllToAllVRejectsWrongNumberOfCounts) {
  auto comm = mpiWorld();
  std::vector<std::int64_t> wrong(comm->size() + 1, 0);
  float x = 0.0f;
  EXPECT_THROW(comm->allToAllV(&x, wrong, wrong, &x, wrong, wrong), plm::Error);
}

TEST(Communicator, NcclOnABuildWithoutNcclIsAClearError) {
  if (plm::dist::ncclAvailable()) GTEST_SKIP() << "this build has NCCL";
  try {
    makeCommunicator(MPI_COMM_WORLD, Backend::Nccl);
    FAIL() << "makeCommunicator(Nccl) did not throw";
  } catch (const plm::Error& e) {
    EXPECT_NE(std::string(e.what()).find("NCCL"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("CUDA build"), std::string::npos) << e.what();
  }
  EXPECT_EQ(plm::dist::defaultBackend(MPI_COMM_WORLD), Backend::Mpi);
}

TEST(ProcessGroups, WorldNodeShardAndReplicate) {
  const int p = plm::dist::commSize(MPI_COMM_WORLD), me = plm::dist::commRank(MPI_COMM_WORLD);
  plm::dist::ProcessGroups plain(MPI_COMM_WORLD);
  EXPECT_EQ(plm::dist::commSize(plain.world()), p);
  EXPECT_EQ(plm::dist::commRank(plain.world()), me);
  EXPECT_GE(plm::dist::commSize(plain.node()), 1);
  EXPECT_LE(plm::dist::commSize(plain.node()), p);
  EXPECT_EQ(plm::dist::commSize(plain.shard()), 1);
  EXPECT_EQ(plm::dist::commSize(plain.replicate()), p);

  if (p % 2 == 0) {
    plm::dist::ProcessGroups hybrid(MPI_COMM_WORLD, 2);
    EXPECT_EQ(plm::dist::commSize(hybrid.shard()), 2);
    EXPECT_EQ(plm::dist::commRank(hybrid.shard()), me % 2);
    EXPECT_EQ(plm::dist::commSize(hybrid.replicate()), p / 2);
    EXPECT_EQ(plm::dist::commRank(hybrid.replicate()), me / 2);
    // A communicator over a group reduces over that group only.
    auto shard = makeCommunicator(hybrid.shard(), Backend::Mpi);
    std::int64_t v = me;
    shard->allReduceSum(&v, 1).wait();
    EXPECT_EQ(v, (me / 2) * 2 + (me / 2) * 2 + 1);
  }
  EXPECT_THROW(plm::dist::ProcessGroups(MPI_COMM_WORLD, p + 1), plm::Error);
}

}  // namespace
