// dist::GradientBuckets: the bucketed all-reduce equals one whole-buffer all-reduce, whatever
// the bucket size (boundaries inside ranges, buckets smaller than one range, one bucket for
// everything) and whatever order the ranges are marked in (a different shuffle on each rank);
// reruns are bitwise identical; the plan and the launch order are what the header promises.
// Runs at 1, 2 and 4 ranks on the backend a training step would pick.
#include "core/error.hpp"
#include "core/types.hpp"
#include "dist/communicator.hpp"
#include "dist/gradient_buckets.hpp"
#include "dist/process_groups.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

namespace {

using plm::dist::BufferRange;
using plm::dist::GradientBuckets;

// An uneven partition of [0, n) into ranges, listed from the end of the buffer down (the order
// backward produces layers).  Sizes: 1, 2, 3, 5, 8, ... capped, so some ranges are smaller
// and some larger than the buckets below.
std::vector<BufferRange> descendingPartition(std::int64_t n) {
  std::vector<BufferRange> up;
  std::int64_t a = 1, b = 2;
  for (std::int64_t offset = 0; offset < n;) {
    const std::int64_t count = std::min(a, n - offset);
    up.push_back({offset, count});
    offset += count;
    std::int64_t c = std::min<std::int64_t>(a + b, 300);
    a = b;
    b = c;
  }
  std::reverse(up.begin(), up.end());
  return up;
}

template <class T> plm::HostView1<T> fill(int rank, std::int64_t n) {
  plm::HostView1<T> h("grads", n);
  std::mt19937_64 gen(12345u + static_cast<unsigned>(rank));
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  for (std::int64_t i = 0; i < n; ++i) h(i) = static_cast<T>(u(gen));
  return h;
}

// Runs one step: marks every range in `order` (a permutation of the ranges), finishes, and
// returns the reduced buffer on the host.
template <class T>
plm::HostView1<T> bucketed(plm::dist::Communicator& comm, const std::vector<BufferRange>& ranges,
                           std::int64_t n, std::int64_t bucket_bytes, std::uint64_t shuffle_seed) {
  plm::ExecSpace space;
  plm::View1<T> grads("grads", n);
  Kokkos::deep_copy(grads, fill<T>(comm.rank(), n));
  GradientBuckets<T> buckets(grads, ranges, comm, bucket_bytes);
  std::vector<BufferRange> order = ranges;
  std::mt19937_64 gen(shuffle_seed);
  std::shuffle(order.begin(), order.end(), gen);
  for (const auto& r : order) buckets.ready(space, r.offset, r.count);
  buckets.finish(space);
  space.fence();
  auto out = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), grads);
  return out;
}

template <class T> plm::HostView1<T> wholeBuffer(plm::dist::Communicator& comm, std::int64_t n) {
  // The reference all-reduce reads the memory its backend reads: device memory for NCCL, host
  // memory for MPI (which, built without CUDA support, faults on device pointers).
  if (!comm.deviceMemory()) {
    plm::HostView1<T> host("grads", n);
    Kokkos::deep_copy(host, fill<T>(comm.rank(), n));
    comm.allReduceSum(host.data(), n, plm::dist::Stream{}).wait();
    return host;
  }
  plm::View1<T> grads("grads", n);
  Kokkos::deep_copy(grads, fill<T>(comm.rank(), n));
  Kokkos::fence();
  comm.allReduceSum(grads.data(), n, plm::dist::Stream{}).wait();
  Kokkos::fence();
  return Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), grads);
}

std::unique_ptr<plm::dist::Communicator> stepCommunicator() {
  return plm::dist::makeCommunicator(MPI_COMM_WORLD, plm::dist::defaultBackend(MPI_COMM_WORLD));
}

template <class T> void checkMatchesWholeBuffer() {
  auto comm = stepCommunicator();
  const std::int64_t n = 5003;
  const auto ranges = descendingPartition(n);
  const auto whole = wholeBuffer<T>(*comm, n);
  // Bucket sizes: 1 element (every piece its own bucket), 97 elements (boundaries inside the
  // 300-element ranges), 1 KiB, and one bucket larger than the buffer.
  for (std::int64_t bucket_elements :
       {std::int64_t(1), std::int64_t(97), std::int64_t(256), n * 2}) {
    const std::int64_t bytes = bucket_elements * std::int64_t(sizeof(T));
    // A different shuffle on each rank: launches must still line up across ranks.
    const auto a = bucketed<T>(*comm, ranges, n, bytes, 7 + comm->rank());
    const auto b = bucketed<T>(*comm, ranges, n, bytes, 1000 + 3 * comm->rank());
    const double tol = (sizeof(T) == 4 ? 1e-6 : 1e-14) * comm->size();
    for (std::int64_t i = 0; i < n; ++i)
      ASSERT_NEAR(a(i), whole(i), tol) << "element " << i << ", bucket " << bucket_elements;
    EXPECT_EQ(std::memcmp(a.data(), b.data(), n * sizeof(T)), 0)
        << "two runs with the same bucket plan differ in their bits (bucket " << bucket_elements
        << ")";
  }
}

TEST(GradientBuckets, FloatMatchesWholeBufferAllReduce) { checkMatchesWholeBuffer<float>(); }
TEST(GradientBuckets, DoubleMatchesWholeBufferAllReduce) { checkMatchesWholeBuffer<double>(); }

TEST(GradientBuckets, PlanCutsRangesAndMergesTouchingPieces) {
  auto comm = stepCommunicator();
  plm::View1<float> grads("grads", 1000);
  // Backward order walks the buffer downwards: [600,1000) then [100,600) then [0,100).
  const std::vector<BufferRange> ranges = {{600, 400}, {100, 500}, {0, 100}};
  GradientBuckets<float> big(grads, ranges, *comm, 4000 * 4);
  ASSERT_EQ(big.numBuckets(), 1);
  ASSERT_EQ(big.bucketRuns(0).size(), 1u) << "touching ranges were not merged into one run";
  EXPECT_EQ(big.bucketRuns(0)[0].offset, 0);
  EXPECT_EQ(big.bucketRuns(0)[0].count, 1000);

  // 300-element buckets: [700,1000) | [600,700)+[400,600) | [100,400) | [0,100).
  GradientBuckets<float> small(grads, ranges, *comm, 300 * 4);
  ASSERT_EQ(small.numBuckets(), 4);
  std::int64_t total = 0;
  for (int b = 0; b < small.numBuckets(); ++b)
    for (const auto& run : small.bucketRuns(b)) {
      EXPECT_LE(run.count, 300);
      total += run.count;
    }
  EXPECT_EQ(total, 1000);
  ASSERT_EQ(small.bucketRuns(1).size(), 1u);
  EXPECT_EQ(small.bucketRuns(1)[0].offset, 400);
  EXPECT_EQ(small.bucketRuns(1)[0].count, 300);
}

TEST(GradientBuckets, LaunchesInBucketOrderAsSoonAsReady) {
  auto comm = stepCommunicator();
  plm::ExecSpace space;
  plm::View1<float> grads("grads", 1000);
  const std::vector<BufferRange> ranges = {{600, 400}, {100, 500}, {0, 100}};
  GradientBuckets<float> buckets(grads, ranges, *comm, 300 * 4);
  buckets.ready(space, 0, 100);  // bucket 3 complete, but buckets 0-2 are not launched yet
  EXPECT_EQ(buckets.numLaunched(), 0);
  buckets.ready(space, 600, 400);  // completes bucket 0; bucket 1 also needs [100,600)
  EXPECT_EQ(buckets.numLaunched(), 1);
  buckets.ready(space, 100, 500);  // completes 1 and 2, and 3 was waiting
  EXPECT_EQ(buckets.numLaunched(), 4);
  buckets.finish(space);
  EXPECT_EQ(buckets.numLaunched(), 0) << "finish() did not re-arm";
}

TEST(GradientBuckets, UnmarkedRangesAreReducedByFinishAndUncoveredElementsUntouched) {
  auto comm = stepCommunicator();
  plm::ExecSpace space;
  const std::int64_t n = 64;
  plm::View1<double> grads("grads", n);
  Kokkos::deep_copy(grads, 1.0);
  GradientBuckets<double> buckets(grads, {{32, 16}, {0, 16}}, *comm, 8 * 8);
  buckets.ready(space, 32, 16);
  buckets.finish(space);  // [0,16) never marked: reduced anyway
  space.fence();
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), grads);
  for (std::int64_t i = 0; i < n; ++i) {
    const bool covered = i < 16 || (i >= 32 && i < 48);
    ASSERT_EQ(h(i), covered ? double(comm->size()) : 1.0) << "element " << i;
  }
}

TEST(GradientBuckets, RejectsBadRangesAndBadReadyCalls) {
  auto comm = stepCommunicator();
  plm::ExecSpace space;
  plm::View1<float> grads("grads", 100);
  EXPECT_THROW(GradientBuckets<float>(grads, {{0, 60}, {50, 50}}, *comm), plm::Error);
  EXPECT_THROW(GradientBuckets<float>(grads, {{90, 20}}, *comm), plm::Error);
  EXPECT_THROW(GradientBuckets<float>(grads, {{10, 0}}, *comm), plm::Error);
  GradientBuckets<float> buckets(grads, {{50, 50}, {0, 50}}, *comm, 10 * 4);
  EXPECT_THROW(buckets.ready(space, 10, 40), plm::Error);  // not a planned range
  EXPECT_THROW(buckets.ready(space, 0, 49), plm::Error);   // wrong count
  buckets.ready(space, 50, 50);
  EXPECT_THROW(buckets.ready(space, 50, 50), plm::Error);  // twice in one step
  buckets.finish(space);
}

}  // namespace
