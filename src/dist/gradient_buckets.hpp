// Bucketed data-parallel all-reduce of one flat gradient buffer, overlapped with backward.
//
// Design choice (as PyTorch DDP's reducer): the buffer is covered by ranges given in the order
// their gradients become final during backward; consecutive ranges are packed into buckets of
// about `bucket_bytes` (a range larger than a bucket is cut, so a bucket boundary may fall
// inside a range).  The plan is fixed at construction, so every rank launches the same
// collectives in the same order, as MPI and NCCL require.  A bucket is launched as soon as all
// of its ranges are ready and every earlier bucket has been launched; inside a bucket, pieces
// that touch in memory are merged so a bucket is usually one in-place collective, with no
// packing copy.  The sums are elementwise, so only the reduction order of the backend decides
// the bits: reruns with the same rank count and bucket size are bitwise identical on the MPI
// backend (see communicator.hpp for NCCL).
//
// How the trainer uses it, once per optimizer step:
//   GradientBuckets<float> sync(grads, ranges_in_backward_order, communicator);  // once
//   ... per step: forward/backward of the last micro-batch; in each layer's "after backward"
//   hook (gradients of that layer final, accumulation over micro-batches done):
//   sync.ready(space, layer_offset, layer_count);
//   ... sync.finish(space);  // before the optimizer reads the gradients
// ready() must be called only after the LAST micro-batch's backward of the range (the range
// must not be written again until finish()).  finish() launches any bucket still pending (a
// range never marked counts as ready), waits for every bucket and re-arms for the next step.
// With the MPI backend, ready() fences `space` before the collective reads host memory; with
// NCCL it does not block the host: the collective waits on `space`'s stream, and finish() makes
// `space` wait on the collectives.
#pragma once

#include "core/types.hpp"
#include "dist/communicator.hpp"

#include <cstdint>
#include <map>
#include <vector>

namespace plm::dist {

/// PyTorch DDP's default bucket size.
constexpr std::int64_t default_bucket_bytes = std::int64_t(25) << 20;

/// One contiguous stretch of the flat buffer, in elements.
struct BufferRange {
  std::int64_t offset = 0;
  std::int64_t count = 0;
};

template <class T> class GradientBuckets {
 public:
  /// \brief Plans the buckets.  `ready_order` lists disjoint, non-empty ranges of `gradients`
  /// in the order they will become ready; identical on every rank of `comm`.  `comm` must
  /// outlive this object.  Ranges need not cover the buffer (uncovered elements are not
  /// reduced).  Device memory on an MPI communicator is staged through a host copy (the
  /// fallback when several ranks share a GPU and NCCL cannot run).
  GradientBuckets(View1<T> gradients, std::vector<BufferRange> ready_order, Communicator& comm,
                  std::int64_t bucket_bytes = default_bucket_bytes);
  ~GradientBuckets();
  GradientBuckets(const GradientBuckets&) = delete;
  GradientBuckets& operator=(const GradientBuckets&) = delete;

  /// \brief Marks the range starting at `offset` (one of the constructor's ranges, `count`
  /// elements) final, and launches every bucket that became complete, in bucket order.
  void ready(const ExecSpace& space, std::int64_t offset, std::int64_t count);
  /// \brief Launches what is left, waits for every bucket (MPI: blocks; NCCL: `space` waits
  /// on the collectives), and re-arms for the next step.
  void finish(const ExecSpace& space);

  int numBuckets() const { return static_cast<int>(buckets_member.size()); }
  /// \brief Bucket `b`'s collectives: contiguous runs of the buffer, in launch order.
  const std::vector<BufferRange>& bucketRuns(int b) const { return buckets_member[b].runs; }
  /// \brief Buckets launched so far in this step.
  int numLaunched() const { return next_launch_member; }

 private:
  struct Bucket {
    std::vector<BufferRange> runs;  // merged pieces, ascending offset
    int ranges = 0;                 // how many ranges have a piece here
    int pending = 0;                // of those, not ready yet this step
    std::vector<Work> work;         // one per run while in flight
  };
  struct RangeState {
    BufferRange range;
    std::vector<int> buckets;  // buckets holding a piece of it
    bool ready = false;
  };

  void launchReady(const ExecSpace& space);
  void launch(const ExecSpace& space, Bucket& bucket);

  View1<T> gradients_member;    // (n) the flat buffer, reduced in place
  HostView1<T> staging_member;  // (n) host copy: device memory on the MPI backend only
  Communicator* comm_member;
  std::vector<RangeState> ranges_member;         // in ready order
  std::map<std::int64_t, int> by_offset_member;  // range offset -> index in ranges_member
  std::vector<Bucket> buckets_member;
  int next_launch_member = 0;
};

}  // namespace plm::dist
