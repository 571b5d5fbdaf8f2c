#include "train/adamw.hpp"

#include "core/error.hpp"
#include "data/batch.hpp"

#include <cmath>
#include <type_traits>

namespace plm::train {

namespace {
#if KOKKOS_VERSION >= 30700
using Kokkos::sqrt;
#else
using Kokkos::Experimental::sqrt;
#endif
}  // namespace

namespace detail {
// A free function: CUDA extended lambdas may not live in constructors.
template <class To, class From>
void castCopy(const ExecSpace& space, View1<To> to, View1<From> from, const char* label) {
  Kokkos::parallel_for(
      label, Kokkos::RangePolicy<ExecSpace>(space, 0, to.extent(0)),
      KOKKOS_LAMBDA(const std::int64_t i) { to(i) = static_cast<To>(from(i)); });
}
}  // namespace detail

std::vector<FrozenRange> esm2FrozenRanges(const std::vector<model::TensorInfo>& tensors,
                                          int hidden) {
  for (const auto& t : tensors) {
    if (t.name == "esm.embeddings.word_embeddings.weight")
      return {FrozenRange{t.offset + static_cast<std::int64_t>(data::vocab::pad) * hidden, hidden}};
  }
  throw Error("AdamW: the model has no tensor esm.embeddings.word_embeddings.weight");
}

template <class G> double globalNorm(const ExecSpace& space, View1<G> grads) {
  double sum = 0.0;
  Kokkos::parallel_reduce(
      "plm::train::gradNorm", Kokkos::RangePolicy<ExecSpace>(space, 0, grads.extent(0)),
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
    : options_member(options), params_member(params) {
  const std::int64_t n = static_cast<std::int64_t>(params.extent(0));
  if constexpr (std::is_same_v<P, master_t>) {
    master_member = params;
    aliased_member = true;
  } else {
    master_member =
        View1<master_t>(Kokkos::view_alloc(Kokkos::WithoutInitializing, "plm::train::master"), n);
    detail::castCopy(ExecSpace(), master_member, params, "plm::train::masterFromParams");
  }
  exp_avg_member = View1<master_t>("plm::train::exp_avg", n);
  exp_avg_sq_member = View1<master_t>("plm::train::exp_avg_sq", n);

  // Flags are built on the host once per run (a tensor table, not a tensor loop).
  HostView1<std::uint8_t> flags("plm::train::flags_host", n);
  for (const auto& t : tensors) {
    PLM_REQUIRE(t.offset >= 0 && t.offset + t.size <= n,
                "AdamW: tensor " + t.name + " lies outside the parameter buffer");
    if (!t.weight_decay) continue;
    for (std::int64_t i = t.offset; i < t.offset + t.size; ++i) flags(i) |= decay_flag;
  }
  for (const auto& r : frozen) {
    PLM_REQUIRE(r.offset >= 0 && r.offset + r.size <= n, "AdamW: frozen range out of bounds");
    for (std::int64_t i = r.offset; i < r.offset + r.size; ++i) flags(i) = frozen_flag;
  }
  flags_member = View1<std::uint8_t>("plm::train::flags", n);
  Kokkos::deep_copy(flags_member, flags);
}

template <class P> void AdamW<P>::maskGradients(const ExecSpace& space, View1<P> grads) const {
  auto flags = flags_member;
  Kokkos::parallel_for(
      "plm::train::maskGradients", Kokkos::RangePolicy<ExecSpace>(space, 0, grads.extent(0)),
      KOKKOS_LAMBDA(const std::int64_t i) {
        if (flags(i) & frozen_flag) grads(i) = P(0);
      });
}

template <class P>
void AdamW<P>::step(const ExecSpace& space, View1<P> grads, double lr, double grad_scale) {
  PLM_REQUIRE(grads.extent(0) == master_member.extent(0),
              "AdamW::step: gradient and parameter buffers differ in length");
  ++step_member;
  const double t = static_cast<double>(step_member);
  const master_t beta1 = static_cast<master_t>(options_member.beta1);
  const master_t beta2 = static_cast<master_t>(options_member.beta2);
  const master_t one_minus_beta1 = static_cast<master_t>(1.0 - options_member.beta1);
  const master_t one_minus_beta2 = static_cast<master_t>(1.0 - options_member.beta2);
  const double bias1 = 1.0 - std::pow(options_member.beta1, t);
  const double bias2 = 1.0 - std::pow(options_member.beta2, t);
  // torch: denom = sqrt(v)/sqrt(bias2) + eps; p -= (lr/bias1) * m / denom.
  const master_t step_size = static_cast<master_t>(lr / bias1);
  const master_t inv_sqrt_bias2 = static_cast<master_t>(1.0 / std::sqrt(bias2));
  const master_t eps = static_cast<master_t>(options_member.eps);
  const master_t decay = static_cast<master_t>(1.0 - lr * options_member.weight_decay);
  const master_t scale = static_cast<master_t>(grad_scale);

  auto master = master_member;
  auto m = exp_avg_member;
  auto v = exp_avg_sq_member;
  auto flags = flags_member;
  Kokkos::parallel_for(
      "plm::train::adamw", Kokkos::RangePolicy<ExecSpace>(space, 0, master.extent(0)),
      KOKKOS_LAMBDA(const std::int64_t i) {
        const std::uint8_t f = flags(i);
        if (f & frozen_flag) return;
        const master_t g = static_cast<master_t>(grads(i)) * scale;
        const master_t mi = beta1 * m(i) + one_minus_beta1 * g;
        const master_t vi = beta2 * v(i) + one_minus_beta2 * g * g;
        m(i) = mi;
        v(i) = vi;
        master_t p = master(i);
        if (f & decay_flag) p *= decay;
        p -= step_size * mi / (sqrt(vi) * inv_sqrt_bias2 + eps);
        master(i) = p;
      });
  syncParameters(space);
}

template <class P> void AdamW<P>::syncParameters(const ExecSpace& space) {
  if (aliased_member) return;
  detail::castCopy(space, params_member, master_member, "plm::train::paramsFromMaster");
}

template double globalNorm<float>(const ExecSpace&, View1<float>);
template double globalNorm<double>(const ExecSpace&, View1<double>);
template class AdamW<float>;
template class AdamW<double>;

}  // namespace plm::train
