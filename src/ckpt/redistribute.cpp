// Tensor elements from one per-rank segment layout to another: one MPI_Alltoallv per batch.
#include "ckpt/detail/redistribute.hpp"

#include "core/error.hpp"
#include "core/types.hpp"
#include "dist/process_groups.hpp"

#include <Kokkos_Core.hpp>

#include <algorithm>
#include <climits>
#include <cstring>
#include <string>

namespace plm::ckpt::detail {

namespace {

bool before(const Segment& a, const Segment& b) {
  return a.tensor != b.tensor ? a.tensor < b.tensor : a.start < b.start;
}

// Every rank's segments, each rank's list sorted by (tensor, start).
std::vector<std::vector<Segment>> gatherSegments(const std::vector<Segment>& mine, MPI_Comm comm) {
  const int world = dist::commSize(comm);
  std::vector<std::int64_t> flat;
  flat.reserve(4 * mine.size());
  for (const auto& s : mine) flat.insert(flat.end(), {s.tensor, s.start, s.count, s.local});
  int length = static_cast<int>(flat.size());
  std::vector<int> lengths(world), at(world, 0);
  PLM_CHECK_MPI(MPI_Allgather(&length, 1, MPI_INT, lengths.data(), 1, MPI_INT, comm));
  for (int r = 1; r < world; ++r) at[r] = at[r - 1] + lengths[r - 1];
  std::vector<std::int64_t> all(std::size_t(at[world - 1] + lengths[world - 1]));
  PLM_CHECK_MPI(MPI_Allgatherv(flat.data(), length, MPI_INT64_T, all.data(), lengths.data(),
                               at.data(), MPI_INT64_T, comm));
  std::vector<std::vector<Segment>> out(world);
  for (int r = 0; r < world; ++r) {
    for (int i = at[r]; i < at[r] + lengths[r]; i += 4)
      out[r].push_back({all[i], all[i + 1], all[i + 2], all[i + 3]});
    std::sort(out[r].begin(), out[r].end(), before);
  }
  return out;
}

// Calls f(a, b, first, length) for every overlap of a segment of `a` with one of `b` within
// tensors [t0, t1), in (tensor, position) order; both lists sorted by (tensor, start), each
// list's segments disjoint.  Sender and receiver therefore list the same overlaps in the
// same order.
template <class F> void forOverlaps(const std::vector<Segment>& a, const std::vector<Segment>& b,
                                    std::int64_t t0, std::int64_t t1, F&& f) {
  auto first = [t0](const std::vector<Segment>& s) {
    return std::lower_bound(s.begin(), s.end(), t0,
                            [](const Segment& x, std::int64_t t) { return x.tensor < t; }) -
           s.begin();
  };
  std::size_t i = std::size_t(first(a)), k = std::size_t(first(b));
  while (i < a.size() && k < b.size() && a[i].tensor < t1 && b[k].tensor < t1) {
    const Segment &x = a[i], &y = b[k];
    if (x.tensor != y.tensor) {
      (x.tensor < y.tensor ? i : k)++;
      continue;
    }
    const std::int64_t lo = std::max(x.start, y.start);
    const std::int64_t hi = std::min(x.start + x.count, y.start + y.count);
    if (lo < hi) f(x, y, lo, hi - lo);
    (x.start + x.count <= y.start + y.count ? i : k)++;
  }
}

}  // namespace

template <class T> void redistribute(MPI_Comm comm, const std::vector<std::int64_t>& tensor_sizes,
                                     const std::vector<Segment>& from, const T* from_values,
                                     const std::vector<Segment>& to, T* to_values,
                                     std::int64_t batch_limit) {
  const int rank = dist::commRank(comm), world = dist::commSize(comm);
  const auto sources = gatherSegments(from, comm);
  const auto targets = gatherSegments(to, comm);
  const auto& mine_from = sources[std::size_t(rank)];
  const auto& mine_to = targets[std::size_t(rank)];
  std::int64_t expected = 0, received = 0;
  for (const auto& s : to) expected += s.count;

  const auto tensors = static_cast<std::int64_t>(tensor_sizes.size());
  std::vector<int> send_counts(world), send_at(world), recv_counts(world), recv_at(world);
  for (std::int64_t t0 = 0; t0 < tensors;) {
    std::int64_t t1 = t0, total = 0;
    while (t1 < tensors && (t1 == t0 || total + tensor_sizes[t1] <= batch_limit))
      total += tensor_sizes[t1++];
    PLM_REQUIRE(total <= INT_MAX, "ckpt::redistribute: tensor " + std::to_string(t0) + " has " +
                                      std::to_string(total) +
                                      " elements, more than one MPI count can carry");
    std::int64_t sends = 0, receives = 0;
    for (int r = 0; r < world; ++r) {
      std::int64_t s = 0, v = 0;
      forOverlaps(mine_from, targets[r], t0, t1,
                  [&](const Segment&, const Segment&, std::int64_t, std::int64_t n) { s += n; });
      forOverlaps(sources[r], mine_to, t0, t1,
                  [&](const Segment&, const Segment&, std::int64_t, std::int64_t n) { v += n; });
      send_counts[r] = int(s);
      recv_counts[r] = int(v);
      send_at[r] = int(sends);
      recv_at[r] = int(receives);
      sends += s;
      receives += v;
    }
    HostView1<T> send(
        Kokkos::view_alloc(Kokkos::WithoutInitializing, "plm::ckpt::redistribute::send"), sends);
    HostView1<T> receive(
        Kokkos::view_alloc(Kokkos::WithoutInitializing, "plm::ckpt::redistribute::receive"),
        receives);
    for (int r = 0; r < world; ++r) {
      T* out = send.data() + send_at[r];
      forOverlaps(mine_from, targets[r], t0, t1,
                  [&](const Segment& x, const Segment&, std::int64_t lo, std::int64_t n) {
                    std::memcpy(out, from_values + x.local + (lo - x.start),
                                std::size_t(n) * sizeof(T));
                    out += n;
                  });
    }
    PLM_CHECK_MPI(MPI_Alltoallv(send.data(), send_counts.data(), send_at.data(), mpiTypeOf<T>(),
                                receive.data(), recv_counts.data(), recv_at.data(), mpiTypeOf<T>(),
                                comm));
    for (int r = 0; r < world; ++r) {
      const T* in = receive.data() + recv_at[r];
      forOverlaps(sources[r], mine_to, t0, t1,
                  [&](const Segment&, const Segment& y, std::int64_t lo, std::int64_t n) {
                    std::memcpy(to_values + y.local + (lo - y.start), in,
                                std::size_t(n) * sizeof(T));
                    in += n;
                  });
    }
    received += receives;
    t0 = t1;
  }
  PLM_REQUIRE(received == expected,
              "ckpt::redistribute: rank " + std::to_string(rank) + " received " +
                  std::to_string(received) + " of the " + std::to_string(expected) +
                  " elements its layout asks for: the source layouts overlap or leave gaps "
                  "(a bug in the shard or row layouts, not in the checkpoint)");
}

template void redistribute<float>(MPI_Comm, const std::vector<std::int64_t>&,
                                  const std::vector<Segment>&, const float*,
                                  const std::vector<Segment>&, float*, std::int64_t);
template void redistribute<double>(MPI_Comm, const std::vector<std::int64_t>&,
                                   const std::vector<Segment>&, const double*,
                                   const std::vector<Segment>&, double*, std::int64_t);
template void redistribute<std::uint8_t>(MPI_Comm, const std::vector<std::int64_t>&,
                                         const std::vector<Segment>&, const std::uint8_t*,
                                         const std::vector<Segment>&, std::uint8_t*, std::int64_t);

}  // namespace plm::ckpt::detail
