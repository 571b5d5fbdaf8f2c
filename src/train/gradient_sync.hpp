// The data-parallel gradient all-reduce of ESM-2: dist::GradientBuckets planned from the
// model's tensor table in the order backward finalises the gradients.
//
// Design choice: the ranges are per layer, not per tensor (a layer's backward finalises all its
// tensors at once, and fewer ranges mean fewer hook calls); together they cover the whole flat
// buffer, alignment padding included, so the bucketed reduction reduces exactly what one
// whole-buffer all-reduce would.  Order: the head (everything after the last encoder layer:
// emb_layer_norm_after, lm_head.*), encoder layers L-1 .. 0, then the embeddings (the word
// embedding is tied to the LM head, so its gradient is final only after the embedding's
// backward).
//
// Wiring a per-layer hook (the model does not call it yet; accumulateGradients marks every
// range ready after the last micro-batch): in the last micro-batch's backward, after the
// layer's gradient kernels were queued on `space`, call
//   sync.buckets().ready(space, sync.ranges()[i].offset, sync.ranges()[i].count)
// with i = 0 for the head, 1 + (L-1-l) for layer l, L+1 for the embeddings (rangeOfLayer does
// the arithmetic), then sync.finish(space) before the optimizer.
#pragma once

#include "core/types.hpp"
#include "dist/communicator.hpp"
#include "dist/gradient_buckets.hpp"
#include "model/esm2.hpp"

#include <mpi.h>

#include <cstdint>
#include <memory>
#include <vector>

namespace plm::train {

/// \brief Ranges of the flat buffer (`buffer_size` elements) in backward order: head, layers
/// L-1..0, embeddings.  Throws plm::Error if a layer's tensors are not contiguous.
std::vector<dist::BufferRange> backwardOrderRanges(const std::vector<model::TensorInfo>& tensors,
                                                   std::int64_t buffer_size);

template <class P> class GradientSync {
 public:
  /// \brief Collective over `comm`: makes the communicator (`backend`) and plans the buckets
  /// over `model.gradients()`.
  GradientSync(model::Esm2<P>& model, MPI_Comm comm, dist::Backend backend,
               std::int64_t bucket_bytes = dist::default_bucket_bytes);

  dist::GradientBuckets<P>& buckets() { return *buckets_member; }
  dist::Communicator& communicator() { return *comm_member; }
  const std::vector<dist::BufferRange>& ranges() const { return ranges_member; }
  /// \brief Index into ranges() of encoder layer `layer` (of `num_layers`).
  static int rangeOfLayer(int layer, int num_layers) { return 1 + (num_layers - 1 - layer); }

  /// \brief Marks every range ready, in backward order (when no per-layer hook marked any).
  void readyAll(const ExecSpace& space);
  /// \brief Waits for every bucket; afterwards the gradients are summed over the ranks.
  void finish(const ExecSpace& space) { buckets_member->finish(space); }

 private:
  std::unique_ptr<dist::Communicator> comm_member;
  std::vector<dist::BufferRange> ranges_member;  // backward order
  std::unique_ptr<dist::GradientBuckets<P>> buckets_member;
};

}  // namespace plm::train
