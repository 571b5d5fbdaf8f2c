#include "train/schedule.hpp"

#include "core/error.hpp"

#include <algorithm>
#include <cmath>

namespace plm::train {

Decay parseDecay(const std::string& name) {
  if (name == "linear") return Decay::linear;
  if (name == "cosine") return Decay::cosine;
  if (name == "constant") return Decay::constant;
  throw collectiveError("schedule.decay: unknown value `" + name +
                        "`; use linear, cosine or constant");
}

double learningRate(const ScheduleOptions& o, std::int64_t step) {
  const double peak = o.peak_lr;
  if (o.warmup_steps > 0 && step <= o.warmup_steps)
    return peak * static_cast<double>(std::max<std::int64_t>(step, 1)) /
           static_cast<double>(o.warmup_steps);
  if (o.decay == Decay::constant) return peak;
  const double final_lr = o.final_lr_ratio * peak;
  if (step >= o.decay_steps) return final_lr;
  const std::int64_t span = o.decay_steps - o.warmup_steps;  // > 0: warmup < step < decay_steps
  const double progress =
      static_cast<double>(step - o.warmup_steps) / static_cast<double>(span);  // (0, 1)
  if (o.decay == Decay::linear) return peak + (final_lr - peak) * progress;
  const double pi = 3.14159265358979323846;
  return final_lr + (peak - final_lr) * 0.5 * (1.0 + std::cos(pi * progress));
}

}  // namespace plm::train
