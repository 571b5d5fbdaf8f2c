// Accumulation rule: written (=), in place allowed.  erf is math::erf (vectorizable polynomial
// in float, libm in double).
#include "model/gelu.hpp"

#include "model/math.hpp"

namespace plm::model {

template <class T>
void geluForward(const ExecSpace& space, const View2<T>& x, const View2<T>& y) {
  const auto rows = static_cast<std::int64_t>(x.extent(0));
  const auto cols = static_cast<std::int64_t>(x.extent(1));
  Kokkos::parallel_for(
      "plm::model::gelu_forward", Kokkos::RangePolicy<ExecSpace>(space, 0, rows),
      KOKKOS_LAMBDA(const std::int64_t i) {
        const T* xr = &x(i, 0);
        T* yr = &y(i, 0);
        for (std::int64_t c = 0; c < cols; ++c) {
          const T v = xr[c];
          yr[c] = T(0.5) * v * (T(1) + math::erf(v * T(0.70710678118654752440)));
        }
      });
}

template <class T>
void geluBackward(const ExecSpace& space, const View2<T>& x, const View2<T>& dy, const View2<T>& dx) {
  const auto rows = static_cast<std::int64_t>(x.extent(0));
  const auto cols = static_cast<std::int64_t>(x.extent(1));
  Kokkos::parallel_for(
      "plm::model::gelu_backward", Kokkos::RangePolicy<ExecSpace>(space, 0, rows),
      KOKKOS_LAMBDA(const std::int64_t i) {
        const T* xr = &x(i, 0);
        const T* dyr = &dy(i, 0);
        T* dxr = &dx(i, 0);
        for (std::int64_t c = 0; c < cols; ++c) {
          const T v = xr[c];
          const T cdf = T(0.5) * (T(1) + math::erf(v * T(0.70710678118654752440)));
          const T pdf = T(0.39894228040143267794) * math::exp(T(-0.5) * v * v);
          dxr[c] = dyr[c] * (cdf + v * pdf);
        }
      });
}

#define PLM_MODEL_GELU_INSTANTIATE(T)                                                         \
  template void geluForward<T>(const ExecSpace&, const View2<T>&, const View2<T>&);          \
  template void geluBackward<T>(const ExecSpace&, const View2<T>&, const View2<T>&,          \
                                const View2<T>&);

PLM_MODEL_GELU_INSTANTIATE(float)
PLM_MODEL_GELU_INSTANTIATE(double)

}  // namespace plm::model
