// `plm bench rates`: a rates table measured on this machine (doc/plan.md, "Rates").
#pragma once

#include "plan/rates.hpp"

#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace plm::plan {

/// \brief Measures GEMM (fitted asymptote and half-rate size), attention (fitted over head
/// dimensions 16-64), LayerNorm, elementwise and optimizer bandwidths and the per-kernel cost
/// with the model's dispatch points in fp32, each op for at least `seconds`; memory, peak and
/// link figures are kept from `base`. `say` receives one line per measurement.
/// \brief (A, half) of R(k) = A k / (k + half) by least squares of 1/R on 1/k; when noise
/// hides the size dependence (negative slope or intercept), (the best rate, 0).
std::pair<double, double> fitSaturating(const std::vector<double>& k, const std::vector<double>& r);

Rates measureRates(const Rates& base, double seconds, const std::function<void(std::string)>& say);

}  // namespace plm::plan
