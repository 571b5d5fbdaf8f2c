#include "train/optim/lion.hpp"

#include "core/flat.hpp"
#include "train/optim/detail/subset.hpp"

namespace plm::train {

template <class P> Lion<P>::Lion(View1<P> params, ParamLayout layout, const LionOptions& options)
    : Optimizer<P>(params, std::move(layout)), options_member(options) {
  exp_avg_member = detail::elementwiseBuffer("exp_avg", this->layout_member);
}

template <class P> std::map<std::string, double> Lion<P>::attributes() const {
  return {{"beta1", options_member.beta1},
          {"beta2", options_member.beta2},
          {"weight_decay", options_member.weight_decay}};
}

template <class P>
void Lion<P>::update(const ExecSpace& space, View1<P> grads, double lr, double grad_scale) {
  const master_t beta1 = static_cast<master_t>(options_member.beta1);
  const master_t beta2 = static_cast<master_t>(options_member.beta2);
  const master_t one_minus_beta1 = static_cast<master_t>(1.0 - options_member.beta1);
  const master_t one_minus_beta2 = static_cast<master_t>(1.0 - options_member.beta2);
  const master_t step = static_cast<master_t>(lr);
  const master_t decay = static_cast<master_t>(1.0 - lr * options_member.weight_decay);
  const master_t scale = static_cast<master_t>(grad_scale);
  constexpr std::uint8_t decay_flag = Optimizer<P>::decay_flag;
  constexpr std::uint8_t frozen_flag = Optimizer<P>::frozen_flag;
  auto master = this->master_member;
  auto m = exp_avg_member.f32;
  auto flags = this->flags_member;
  plm::flatFor(
      "plm::train::lion", space, 0, master.extent(0), KOKKOS_LAMBDA(const std::int64_t i) {
        const std::uint8_t f = flags(i);
        if (f & frozen_flag) return;
        const master_t g = static_cast<master_t>(grads(i)) * scale;
        const master_t c = beta1 * m(i) + one_minus_beta1 * g;
        const master_t sign = c > master_t(0) ? master_t(1) : (c < master_t(0) ? master_t(-1) : 0);
        master_t p = master(i);
        if (f & decay_flag) p *= decay;
        master(i) = p - step * sign;
        m(i) = beta2 * m(i) + one_minus_beta2 * g;
      });
}

template class Lion<float>;
template class Lion<double>;

}  // namespace plm::train
