// One data-parallel optimizer step and one evaluation pass, independent of decks and files so
// tests can drive them with hand-made micro-batches and any communicator.
//
// Design choice: the loss is the mean over every masked token of the GLOBAL batch.  Each rank
// knows its micro-batches' masked counts before computing, so the count is all-reduced first and
// the model accumulates grad_scale = 1/global_count times d(sum CE)/dθ; after the gradient
// all-reduce (a plain sum) the buffer holds the gradient of the global mean.  Nothing depends on
// how the batch is split into micro-batches or ranks, except summation order.
#pragma once

#include "core/types.hpp"
#include "data/batch.hpp"
#include "data/loader.hpp"
#include "model/esm2.hpp"
#include "train/optim/adamw.hpp"

#include <mpi.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <vector>

namespace plm::train {

/// Global (all-rank) sums of one step's batch.
struct BatchStats {
  double loss_sum = 0.0;    // sum of masked-token cross-entropy
  std::int64_t masked = 0;  // masked (target) tokens
  std::int64_t tokens = 0;  // tokens, <cls>/<eos> included (packed: no padding)
  std::int64_t sequences = 0;
  double sum_sq_seqlen = 0.0;  // sum over sequences of length^2 (attention FLOPs)

  double loss() const { return masked > 0 ? loss_sum / static_cast<double>(masked) : 0.0; }
  double perplexity() const { return std::exp(loss()); }
  /// \brief Length-weighted mean sequence length sum(L^2)/sum(L), the attention-FLOP average.
  double weightedSeqlen() const {
    return tokens > 0 ? sum_sq_seqlen / static_cast<double>(tokens) : 0.0;
  }
};

struct StepStats : BatchStats {
  double grad_norm = 0.0;    // global norm before clipping
  double clip_factor = 1.0;  // applied to the gradient (1 = not clipped)
  double lr = 0.0;
  bool applied = true;     // false when the global batch had no masked token, or nonfinite
  bool nonfinite = false;  // the loss or the gradient norm was NaN or infinite: not applied
};

/// \brief Sums of the local micro-batches' counts, all-reduced over `comm` (loss_sum left 0).
BatchStats countBatch(const std::vector<data::MicroBatch>& local, MPI_Comm comm);

/// \brief Under expert parallelism every pass is collective: `local` with empty micro-batches
/// put first, up to the most any rank of `comm` holds.
std::vector<data::MicroBatch> padForExperts(const std::vector<data::MicroBatch>& local,
                                            MPI_Comm comm);

/// \brief Zeroes the gradients, runs forward+backward over this rank's micro-batches with
/// grad_scale = 1/global masked count, and all-reduces gradients and loss: afterwards every
/// rank holds the gradient of the global mean loss.
template <class P> BatchStats accumulateGradients(const ExecSpace& space, model::Esm2<P>& model,
                                                  const std::vector<data::MicroBatch>& local,
                                                  MPI_Comm comm);

/// \brief accumulateGradients, then the padding-row mask, global-norm clipping (`clip_norm` <= 0:
/// off) and one optimizer update with learning rate `lr`.
template <class P> StepStats trainStep(const ExecSpace& space, model::Esm2<P>& model,
                                       Optimizer<P>& optimizer,
                                       const std::vector<data::MicroBatch>& local, double lr,
                                       double clip_norm, MPI_Comm comm);

/// \brief The second half of trainStep, after accumulateGradients gave `batch`: the padding-row
/// mask, global-norm clipping and one optimizer update, unless the batch had no masked token or its
/// loss or gradient norm is not finite (then nothing changes; `applied` false, `nonfinite`).
/// `comm`: the step's ranks, needed (collective) when the model holds part of the experts.
template <class P> StepStats finishStep(const ExecSpace& space, model::Esm2<P>& model,
                                        Optimizer<P>& optimizer, const BatchStats& batch, double lr,
                                        double clip_norm, MPI_Comm comm = MPI_COMM_NULL);

/// \brief The global gradient norm: globalNorm of `grads` (reduced, identical on every rank), or,
/// when `model` holds part of the routed experts, the dense part plus every expert's once
/// (one all-reduce over `comm`).
template <class P> double gradientNorm(const ExecSpace& space, const model::Esm2<P>& model,
                                       View1<P> grads, MPI_Comm comm);

/// A forward-only pass that joins collectives (FSDP's gathers): nullptr = no data on this rank,
/// join them anyway.  Returns the micro-batch's loss sum.
using CollectiveForward = std::function<double(const data::MicroBatch*)>;

/// \brief Forward-only loss over a single-pass loader (seeked to its start first), at most
/// `max_steps` loader steps (0 = the whole pass), summed over `comm`.  With `forward` (FSDP:
/// one unit gathered at a time, as in training), every rank runs the same number of passes per
/// loader step, the most any rank holds, and the model's whole buffers are never used.
template <class P> BatchStats evaluate(const ExecSpace& space, model::Esm2<P>& model,
                                       data::Loader& loader, std::int64_t max_steps, MPI_Comm comm,
                                       const CollectiveForward& forward = {});

}  // namespace plm::train
