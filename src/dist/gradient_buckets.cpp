#include "dist/gradient_buckets.hpp"

#include "core/error.hpp"
#include "core/trace.hpp"
#include "dist/stream.hpp"

#include <algorithm>
#include <string>
#include <utility>

namespace plm::dist {

namespace {

constexpr bool hostAccessible() {
  return Kokkos::SpaceAccessibility<Kokkos::HostSpace, MemSpace>::accessible;
}

std::string describe(std::int64_t offset, std::int64_t count) {
  return "[" + std::to_string(offset) + ", " + std::to_string(offset + count) + ")";
}

}  // namespace

template <class T>
GradientBuckets<T>::GradientBuckets(View1<T> gradients, std::vector<BufferRange> ready_order,
                                    Communicator& comm, std::int64_t bucket_bytes)
    : gradients_member(gradients), comm_member(&comm) {
  const auto n = static_cast<std::int64_t>(gradients.extent(0));
  PLM_REQUIRE(bucket_bytes > 0, "dist::GradientBuckets: bucket_bytes must be positive");
  // Disjoint and inside the buffer: checked on a copy sorted by offset.
  auto sorted = ready_order;
  std::sort(sorted.begin(), sorted.end(),
            [](const BufferRange& a, const BufferRange& b) { return a.offset < b.offset; });
  for (std::size_t i = 0; i < sorted.size(); ++i) {
    const auto& r = sorted[i];
    PLM_REQUIRE(r.count > 0 && r.offset >= 0 && r.offset + r.count <= n,
                "dist::GradientBuckets: range " + describe(r.offset, r.count) +
                    " is empty or outside the buffer of " + std::to_string(n) + " elements");
    PLM_REQUIRE(i == 0 || sorted[i - 1].offset + sorted[i - 1].count <= r.offset,
                "dist::GradientBuckets: ranges " +
                    describe(sorted[i - 1].offset, sorted[i - 1].count) + " and " +
                    describe(r.offset, r.count) + " overlap");
  }

  // Cut the ranges, in ready order, into buckets of at most `capacity` elements.
  const std::int64_t capacity = std::max<std::int64_t>(1, bucket_bytes / std::int64_t(sizeof(T)));
  std::vector<std::vector<BufferRange>> pieces;  // per bucket
  std::int64_t room = 0;
  for (std::size_t i = 0; i < ready_order.size(); ++i) {
    const BufferRange& r = ready_order[i];
    // Cut from the end that touches the next range (backward order walks the buffer
    // downwards), so the pieces sharing a bucket touch and merge into one run below.
    const bool downwards = i + 1 < ready_order.size()
                               ? ready_order[i + 1].offset < r.offset
                               : i > 0 && ready_order[i - 1].offset > r.offset;
    RangeState state;
    state.range = r;
    for (std::int64_t done = 0; done < r.count;) {
      if (room == 0) {
        pieces.emplace_back();
        room = capacity;
      }
      const std::int64_t take = std::min(room, r.count - done);
      const std::int64_t start = downwards ? r.offset + r.count - done - take : r.offset + done;
      pieces.back().push_back({start, take});
      state.buckets.push_back(static_cast<int>(pieces.size()) - 1);
      done += take;
      room -= take;
    }
    by_offset_member[r.offset] = static_cast<int>(ranges_member.size());
    ranges_member.push_back(std::move(state));
  }
  // Pieces that touch in memory become one collective (backward order walks the buffer
  // downwards, so a bucket of whole layers is one run).
  for (auto& p : pieces) {
    std::sort(p.begin(), p.end(),
              [](const BufferRange& a, const BufferRange& b) { return a.offset < b.offset; });
    Bucket b;
    for (const auto& piece : p) {
      if (!b.runs.empty() && b.runs.back().offset + b.runs.back().count == piece.offset)
        b.runs.back().count += piece.count;
      else
        b.runs.push_back(piece);
    }
    buckets_member.push_back(std::move(b));
  }
  for (const auto& r : ranges_member)
    for (int b : r.buckets) ++buckets_member[b].ranges;
  for (auto& b : buckets_member) b.pending = b.ranges;

  if (!comm.deviceMemory() && !hostAccessible())
    staging_member = HostView1<T>(
        Kokkos::view_alloc(Kokkos::WithoutInitializing, "plm::dist::GradientBuckets::staging"), n);
}

template <class T> GradientBuckets<T>::~GradientBuckets() {
  // Outstanding MPI requests complete in Work's destructor; NCCL events are released there.
  for (auto& b : buckets_member) b.work.clear();
}

template <class T>
void GradientBuckets<T>::ready(const ExecSpace& space, std::int64_t offset, std::int64_t count) {
  auto it = by_offset_member.find(offset);
  if (it == by_offset_member.end() || ranges_member[it->second].range.count != count)
    throw Error("dist::GradientBuckets::ready: " + describe(offset, count) +
                " is not one of the ranges the buckets were planned with");
  RangeState& r = ranges_member[it->second];
  if (r.ready)
    throw Error("dist::GradientBuckets::ready: range " + describe(offset, count) +
                " was marked ready twice in one step (call finish() between steps)");
  r.ready = true;
  for (int b : r.buckets) --buckets_member[b].pending;
  launchReady(space);
}

template <class T> void GradientBuckets<T>::launchReady(const ExecSpace& space) {
  // In bucket order only: ranks may see ranges become ready in different orders, but they
  // must issue the collectives in one order.
  while (next_launch_member < numBuckets() && buckets_member[next_launch_member].pending == 0)
    launch(space, buckets_member[next_launch_member++]);
}

template <class T> void GradientBuckets<T>::launch(const ExecSpace& space, Bucket& bucket) {
  Kokkos::Profiling::pushRegion("plm::dist::GradientBuckets::launch");
  PLM_TRACE("plm::comm gradient all-reduce launch");
  const Stream stream = streamOf(space);
  if (!comm_member->deviceMemory()) space.fence();  // MPI reads the memory from the host
  for (const auto& run : bucket.runs) {
    T* data = gradients_member.data() + run.offset;
    if (staging_member.data()) {
      const auto span = std::make_pair(run.offset, run.offset + run.count);
      Kokkos::deep_copy(Kokkos::subview(staging_member, span),
                        Kokkos::subview(gradients_member, span));
      data = staging_member.data() + run.offset;
    }
    bucket.work.push_back(comm_member->allReduceSum(data, run.count, stream));
  }
  Kokkos::Profiling::popRegion();
}

template <class T> void GradientBuckets<T>::finish(const ExecSpace& space) {
  Kokkos::Profiling::pushRegion("plm::dist::GradientBuckets::finish");
  PLM_TRACE("plm::comm gradient all-reduce finish");
  for (auto& b : buckets_member) b.pending = 0;  // a range never marked counts as ready
  launchReady(space);
  const Stream stream = streamOf(space);
  for (auto& b : buckets_member) {
    for (auto& w : b.work) w.wait(stream);
    b.work.clear();
    if (staging_member.data())
      for (const auto& run : b.runs) {
        const auto span = std::make_pair(run.offset, run.offset + run.count);
        Kokkos::deep_copy(space, Kokkos::subview(gradients_member, span),
                          Kokkos::subview(staging_member, span));
      }
    b.pending = b.ranges;
  }
  for (auto& r : ranges_member) r.ready = false;
  next_launch_member = 0;
  Kokkos::Profiling::popRegion();
}

template class GradientBuckets<float>;
template class GradientBuckets<double>;

}  // namespace plm::dist
