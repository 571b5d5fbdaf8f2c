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

/// Expert parallelism (a model holding part of the routed experts, model::ExpertPlacement):
/// the routed experts' gradients of each MoE layer (one run of the buffer, model::expertRuns)
/// are summed over the expert-data-parallel group instead (the ranks holding the same experts:
/// every degree-th rank), in buckets of their own over a communicator of that group; the rest
/// of each range over `comm` as above.  With one rank per expert group position (ranks ==
/// degree) the experts' gradients are already whole and are not reduced at all.
template <class P> class GradientSync {
 public:
  /// \brief Collective over `comm`: makes the communicators (`backend`) and plans the buckets
  /// over `model.gradients()`.
  GradientSync(model::Esm2<P>& model, MPI_Comm comm, dist::Backend backend,
               std::int64_t bucket_bytes = dist::default_bucket_bytes);
  ~GradientSync();
  GradientSync(const GradientSync&) = delete;
  GradientSync& operator=(const GradientSync&) = delete;

  /// \brief The buckets over `comm` (every range, less the routed experts' runs).
  dist::GradientBuckets<P>& buckets() { return *buckets_member; }
  dist::Communicator& communicator() { return *comm_member; }
  const std::vector<dist::BufferRange>& ranges() const { return ranges_member; }
  /// \brief Index into ranges() of encoder layer `layer` (of `num_layers`).
  static int rangeOfLayer(int layer, int num_layers) { return 1 + (num_layers - 1 - layer); }

  /// \brief Marks ranges()[index] final: its buckets over `comm`, and its experts' run.
  void ready(const ExecSpace& space, int index);
  /// \brief Marks every range ready, in backward order (when no per-layer hook marked any).
  void readyAll(const ExecSpace& space);
  /// \brief Waits for every bucket; afterwards the gradients are summed over the ranks.
  void finish(const ExecSpace& space);

 private:
  std::unique_ptr<dist::Communicator> comm_member;
  std::vector<dist::BufferRange> ranges_member;  // backward order
  std::unique_ptr<dist::GradientBuckets<P>> buckets_member;
  // Per range, its pieces reduced over `comm` (the whole range unless it holds an experts' run)
  // and its experts' run (-1: none).
  std::vector<std::vector<dist::BufferRange>> pieces_member;
  std::vector<int> expert_run_member;
  std::vector<dist::BufferRange> expert_runs_member;  // backward order
  MPI_Comm expert_data_member = MPI_COMM_NULL;        // the expert-data-parallel group
  std::unique_ptr<dist::Communicator> expert_comm_member;
  std::unique_ptr<dist::GradientBuckets<P>> expert_buckets_member;
};

}  // namespace plm::train
