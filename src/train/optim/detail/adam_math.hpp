// The AdamW element update, written once for AdamW (train/optim/adamw.cpp) and 8-bit AdamW's fp32
// moments and parameter step (train/optim/adamw8bit.cpp): torch.optim.AdamW's form, decay first.
#pragma once

#include "core/types.hpp"
#include "train/optim/optimizer.hpp"

#include <Kokkos_Core.hpp>

#include <cmath>

namespace plm::train::detail {

/// The step's constants, in master_t, for update count t.
struct AdamStep {
  master_t beta1, beta2, one_minus_beta1, one_minus_beta2;
  master_t step_size;       // lr / (1 - beta1^t)
  master_t inv_sqrt_bias2;  // 1 / sqrt(1 - beta2^t)
  master_t eps, decay, scale;

  AdamStep(double b1, double b2, double eps_, double wd, double lr, double t, double grad_scale)
      : beta1(static_cast<master_t>(b1)),
        beta2(static_cast<master_t>(b2)),
        one_minus_beta1(static_cast<master_t>(1.0 - b1)),
        one_minus_beta2(static_cast<master_t>(1.0 - b2)),
        step_size(static_cast<master_t>(lr / (1.0 - std::pow(b1, t)))),
        inv_sqrt_bias2(static_cast<master_t>(1.0 / std::sqrt(1.0 - std::pow(b2, t)))),
        eps(static_cast<master_t>(eps_)),
        decay(static_cast<master_t>(1.0 - lr * wd)),
        scale(static_cast<master_t>(grad_scale)) {}

  /// New moments from the old ones and the (unscaled) gradient g.
  KOKKOS_INLINE_FUNCTION void moments(master_t g, master_t& m, master_t& v) const {
    const master_t gs = g * scale;
    m = beta1 * m + one_minus_beta1 * gs;
    v = beta2 * v + one_minus_beta2 * gs * gs;
  }
  /// The parameter after decay (when `decays`) and the step with moments m, v.
  KOKKOS_INLINE_FUNCTION master_t apply(master_t p, bool decays, master_t m, master_t v) const {
#if KOKKOS_VERSION >= 30700
    using Kokkos::sqrt;
#else
    using Kokkos::Experimental::sqrt;
#endif
    if (decays) p *= decay;
    return p - step_size * m / (sqrt(v) * inv_sqrt_bias2 + eps);
  }
};

}  // namespace plm::train::detail
