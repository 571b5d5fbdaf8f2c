// What the trainer does about non-finite values and loss spikes (doc/operations.md).
//
// Design choice: a step whose loss or gradient norm is not finite never reaches the optimizer
// (finishStep in step.hpp leaves the weights and moments untouched and says so), so whatever
// train.on_nonfinite asks for starts from intact state: `stop` ends the run naming the step and
// the first non-finite gradient tensor, `skip` drops the update and goes on, `rollback` reloads
// the newest checkpoint and replays up to the offending step, whose batch it then skips (for a
// fault that damaged the state without making it non-finite; deterministic replay otherwise
// reaches the same weights as `skip`).  Every rank holds the same all-reduced loss and gradient,
// so every rank takes the same decision without a collective.
#pragma once

#include "core/types.hpp"
#include "model/esm2.hpp"

#include <cstdint>
#include <deque>
#include <string>

namespace plm::train {

enum class OnNonfinite { Skip, Stop, Rollback };
/// \brief "skip" | "stop" | "rollback" (collective plm::Error otherwise).
OnNonfinite parseOnNonfinite(const std::string& text);
const char* nameOf(OnNonfinite mode);

/// \brief The Hugging Face name of the first tensor (in tensor-table order) of `values` holding
/// a NaN or an infinity, with the count of such elements in it; "" when all are finite.  Copies
/// the buffer to the host: for the error path only.
template <class P> std::string firstNonfiniteTensor(const View1<P>& values,
                                                    const std::vector<model::TensorInfo>& tensors,
                                                    std::int64_t* count = nullptr);

/// \brief Flags a step loss far above the recent ones: at least `min_history` previous losses,
/// and above mean + `sigmas` x standard deviation of the last `window` (and 10% above the mean,
/// so a flat, noise-free curve does not flag rounding).  Only finite losses enter the window.
class LossSpikeDetector {
 public:
  explicit LossSpikeDetector(int window = 100, int min_history = 20, double sigmas = 6.0)
      : window_member(window), min_history_member(min_history), sigmas_member(sigmas) {}
  /// \brief Adds `loss`; true if it is a spike against the losses before it.
  bool add(double loss);
  double mean() const;
  double deviation() const;

 private:
  int window_member, min_history_member;
  double sigmas_member;
  std::deque<double> recent_member;
};

}  // namespace plm::train
