#include "train/optim/adamw.hpp"

#include "core/error.hpp"
#include "core/flat.hpp"
#include "train/optim/detail/adam_math.hpp"
#include "train/optim/detail/subset.hpp"

#include <cmath>

namespace plm::train {

template <class G> double globalNorm(const ExecSpace& space, View1<G> grads) {
  double sum = 0.0;
  plm::flatReduce(
      "plm::train::gradNorm", space, 0, grads.extent(0),
      KOKKOS_LAMBDA(const std::int64_t i, double& acc) {
        const double g = static_cast<double>(grads(i));
        acc += g * g;
      },
      sum);
  return std::sqrt(sum);
}

double clipFactor(double norm, double max_norm) {
  if (max_norm <= 0.0) return 1.0;
  const double factor = max_norm / (norm + 1e-6);
  return factor < 1.0 ? factor : 1.0;
}

template <class P>
AdamW<P>::AdamW(View1<P> params, const std::vector<model::TensorInfo>& tensors,
                const AdamWOptions& options, const std::vector<FrozenRange>& frozen)
    : AdamW(params, wholeLayout(tensors, static_cast<std::int64_t>(params.extent(0)), frozen),
            options) {}

template <class P> AdamW<P>::AdamW(View1<P> params, ParamLayout layout, const AdamWOptions& options)
    : Optimizer<P>(params, std::move(layout)), options_member(options) {
  exp_avg_member = detail::elementwiseBuffer("exp_avg", this->layout_member);
  exp_avg_sq_member = detail::elementwiseBuffer("exp_avg_sq", this->layout_member);
}

template <class P> std::map<std::string, double> AdamW<P>::attributes() const {
  return {{"beta1", options_member.beta1},
          {"beta2", options_member.beta2},
          {"eps", options_member.eps},
          {"weight_decay", options_member.weight_decay}};
}

template <class P>
void AdamW<P>::update(const ExecSpace& space, View1<P> grads, double lr, double grad_scale) {
  const auto& o = options_member;
  const detail::AdamStep a(o.beta1, o.beta2, o.eps, o.weight_decay, lr,
                           static_cast<double>(this->step_member), grad_scale);
  constexpr std::uint8_t decay_flag = Optimizer<P>::decay_flag;
  constexpr std::uint8_t frozen_flag = Optimizer<P>::frozen_flag;
  auto master = this->master_member;
  auto m = exp_avg_member.f32;
  auto v = exp_avg_sq_member.f32;
  auto flags = this->flags_member;
  plm::flatFor(
      "plm::train::adamw", space, 0, master.extent(0), KOKKOS_LAMBDA(const std::int64_t i) {
        const std::uint8_t f = flags(i);
        if (f & frozen_flag) return;
        master_t mi = m(i), vi = v(i);
        a.moments(static_cast<master_t>(grads(i)), mi, vi);
        m(i) = mi;
        v(i) = vi;
        master(i) = a.apply(master(i), f & decay_flag, mi, vi);
      });
}

template double globalNorm<float>(const ExecSpace&, View1<float>);
template double globalNorm<double>(const ExecSpace&, View1<double>);
template class AdamW<float>;
template class AdamW<double>;

}  // namespace plm::train
