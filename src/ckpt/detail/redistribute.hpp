// Moving tensor elements from one layout of a set of tensors to another over a communicator:
// the sharded checkpoint path (src/ckpt/checkpoint.cpp) uses it between FSDP's shard layout
// (each rank's slices of every sharding unit, train/fsdp.hpp) and a checkpoint's row layout
// (each rank's model::rowRange rows of every tensor, back to back), in both directions.
//
// Design choice: a layout is a list of segments per rank.  Every rank learns every rank's
// segments (one all-gather of a few int64 per segment: O(tensors) per rank), so a sender and
// a receiver compute the same overlaps in the same order (tensor, then position) and the data
// moves without per-message metadata, in one MPI_Alltoallv per batch of tensors: a batch holds
// at most `batch_limit` elements of whole tensors (a larger tensor is a batch of its own), which
// keeps MPI's int counts and the staging buffers bounded.  Staging is Kokkos host memory, so
// train::AllocationTracker sees it (the sharded save's memory test counts it).
#pragma once

#include <mpi.h>

#include <cstdint>
#include <vector>

namespace plm::ckpt::detail {

/// The MPI datatype of the values checkpoints move between ranks (one definition for ckpt).
template <class T> MPI_Datatype mpiTypeOf();
template <> inline MPI_Datatype mpiTypeOf<float>() { return MPI_FLOAT; }
template <> inline MPI_Datatype mpiTypeOf<double>() { return MPI_DOUBLE; }
template <> inline MPI_Datatype mpiTypeOf<std::uint8_t>() { return MPI_UINT8_T; }

/// Elements [start, start + count) of tensor `tensor` (row-major) lie at [local, local + count)
/// of a rank's buffer.
struct Segment {
  std::int64_t tensor = 0;
  std::int64_t start = 0;
  std::int64_t count = 0;
  std::int64_t local = 0;
};

/// \brief Collective over `comm`: fills every rank's `to` segments of `to_values` with the
/// elements the `from` segments of `from_values` hold on whichever rank has them.  The `from`
/// segments of all ranks must be disjoint and must cover every rank's `to` segments; `tensor`
/// indexes `tensor_sizes`.  A plm::Error says so when the received counts show they do not.
/// Elements of `to_values` outside the `to` segments are not touched.
template <class T> void redistribute(MPI_Comm comm, const std::vector<std::int64_t>& tensor_sizes,
                                     const std::vector<Segment>& from, const T* from_values,
                                     const std::vector<Segment>& to, T* to_values,
                                     std::int64_t batch_limit = std::int64_t(1) << 27);

}  // namespace plm::ckpt::detail
