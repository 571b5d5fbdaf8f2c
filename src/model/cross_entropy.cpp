// Accumulation rule: dlogits written (=), may alias logits; loss summed in double.
#include "model/cross_entropy.hpp"

#include "data/batch.hpp"
#include "model/math.hpp"

namespace plm::model {

template <class T> double crossEntropy(const ExecSpace& space, const View2<T>& logits,
                                       const View1<std::int32_t>& labels, double grad_scale,
                                       const View2<T>& dlogits) {
  const auto rows = static_cast<std::int64_t>(logits.extent(0));
  const int vocab = static_cast<int>(logits.extent(1));
  const bool want_grad = dlogits.extent(0) != 0;
  const T scale = static_cast<T>(grad_scale);
  double total = 0;
  Kokkos::parallel_reduce(
      "plm::model::cross_entropy", FlatPolicy(space, 0, rows),
      KOKKOS_LAMBDA(const std::int64_t i, double& sum) {
        const std::int32_t label = labels(i);
        if (label == data::vocab::ignore_label) {
          if (want_grad)
            for (int c = 0; c < vocab; ++c) dlogits(i, c) = 0;
          return;
        }
        T mx = logits(i, 0);
        for (int c = 1; c < vocab; ++c) mx = logits(i, c) > mx ? logits(i, c) : mx;
        T z = 0;
        for (int c = 0; c < vocab; ++c) z += math::libm::exp(logits(i, c) - mx);
        const T lse = mx + math::libm::log(z);
        sum += static_cast<double>(lse - logits(i, label));
        if (want_grad) {
          for (int c = 0; c < vocab; ++c) {
            const T p = math::libm::exp(logits(i, c) - lse);
            dlogits(i, c) = scale * (p - (c == label ? T(1) : T(0)));
          }
        }
      },
      total);
  return total;
}

template double crossEntropy<float>(const ExecSpace&, const View2<float>&,
                                    const View1<std::int32_t>&, double, const View2<float>&);
template double crossEntropy<double>(const ExecSpace&, const View2<double>&,
                                     const View1<std::int32_t>&, double, const View2<double>&);

}  // namespace plm::model
