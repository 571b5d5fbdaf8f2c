// Learning-rate schedules: linear warmup, then linear or cosine decay to a fraction of the peak
// (ESM-2 recipe, doc/anchors.md §1: 2,000 warmup steps, linear decay to 0.1x), or constant.
//
// Steps are counted from 1: update t (the t-th optimizer step) uses lr(t).  Warmup reaches the
// peak exactly at t = warmup_steps (lr(1) = peak/warmup, never 0, so no update is wasted);
// decay reaches final_lr_ratio * peak exactly at t = decay_steps and stays there.
#pragma once

#include <cstdint>
#include <string>

namespace plm::train {

enum class Decay { linear, cosine, constant };

struct ScheduleOptions {
  double peak_lr = 4e-4;
  std::int64_t warmup_steps = 2000;
  Decay decay = Decay::linear;
  double final_lr_ratio = 0.1;
  std::int64_t decay_steps = 0;  // step at which the final lr is reached (resolved, > 0)
};

/// \brief "linear", "cosine" or "constant"; throws a collective plm::Error otherwise.
Decay parseDecay(const std::string& name);

/// \brief The learning rate of update `step` (1-based).
double learningRate(const ScheduleOptions& options, std::int64_t step);

}  // namespace plm::train
