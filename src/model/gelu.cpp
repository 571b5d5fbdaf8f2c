// Accumulation rule: written (=), in place allowed.  erf is math::erf (vectorizable polynomial
// in float, libm in double).
#include "model/gelu.hpp"

#include "model/detail/avx2.hpp"
#include "model/math.hpp"

#include <type_traits>

namespace plm::model {
namespace {

#ifdef PLM_MODEL_HAVE_AVX2_PATH
__attribute__((target("avx2,fma"), noinline)) void geluRowAvx2(std::int64_t n, const float* x,
                                                               float* y) {
  std::int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    const __m256 cdf =
        _mm256_fmadd_ps(detail::erf8(_mm256_mul_ps(v, _mm256_set1_ps(0.70710678118654752440f))),
                        _mm256_set1_ps(0.5f), _mm256_set1_ps(0.5f));
    _mm256_storeu_ps(y + i, _mm256_mul_ps(v, cdf));
  }
  for (; i < n; ++i) y[i] = 0.5f * x[i] * (1.0f + math::erf(x[i] * 0.70710678118654752440f));
}

__attribute__((target("avx2,fma"), noinline)) void geluGradRowAvx2(std::int64_t n, const float* x,
                                                                   const float* dy, float* dx) {
  std::int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    const __m256 cdf =
        _mm256_fmadd_ps(detail::erf8(_mm256_mul_ps(v, _mm256_set1_ps(0.70710678118654752440f))),
                        _mm256_set1_ps(0.5f), _mm256_set1_ps(0.5f));
    const __m256 pdf =
        _mm256_mul_ps(_mm256_set1_ps(0.39894228040143267794f),
                      detail::exp8(_mm256_mul_ps(_mm256_set1_ps(-0.5f), _mm256_mul_ps(v, v))));
    _mm256_storeu_ps(dx + i, _mm256_mul_ps(_mm256_loadu_ps(dy + i), _mm256_fmadd_ps(v, pdf, cdf)));
  }
  for (; i < n; ++i) {
    const float v = x[i];
    const float cdf = 0.5f * (1.0f + math::erf(v * 0.70710678118654752440f));
    const float pdf = 0.39894228040143267794f * math::exp(-0.5f * v * v);
    dx[i] = dy[i] * (cdf + v * pdf);
  }
}
#endif

template <class T> KOKKOS_INLINE_FUNCTION bool fastRow(std::int64_t n, const T* x, T* y) {
#ifdef PLM_MODEL_HAVE_AVX2_PATH
  if constexpr (std::is_same_v<T, float>)
    if (detail::haveAvx2()) {
      geluRowAvx2(n, x, y);
      return true;
    }
#endif
  (void)n, (void)x, (void)y;
  return false;
}

template <class T>
KOKKOS_INLINE_FUNCTION bool fastGradRow(std::int64_t n, const T* x, const T* dy, T* dx) {
#ifdef PLM_MODEL_HAVE_AVX2_PATH
  if constexpr (std::is_same_v<T, float>)
    if (detail::haveAvx2()) {
      geluGradRowAvx2(n, x, dy, dx);
      return true;
    }
#endif
  (void)n, (void)x, (void)dy, (void)dx;
  return false;
}

}  // namespace

template <class T> void geluForward(const ExecSpace& space, const View2<T>& x, const View2<T>& y) {
  const auto rows = static_cast<std::int64_t>(x.extent(0));
  const auto cols = static_cast<std::int64_t>(x.extent(1));
  Kokkos::parallel_for(
      "plm::model::gelu_forward", FlatPolicy(space, 0, rows), KOKKOS_LAMBDA(const std::int64_t i) {
        const T* xr = &x(i, 0);
        T* yr = &y(i, 0);
        if (fastRow(cols, xr, yr)) return;
        for (std::int64_t c = 0; c < cols; ++c) {
          const T v = xr[c];
          yr[c] = T(0.5) * v * (T(1) + math::erf(v * T(0.70710678118654752440)));
        }
      });
}

template <class T> void geluBackward(const ExecSpace& space, const View2<T>& x, const View2<T>& dy,
                                     const View2<T>& dx) {
  const auto rows = static_cast<std::int64_t>(x.extent(0));
  const auto cols = static_cast<std::int64_t>(x.extent(1));
  Kokkos::parallel_for(
      "plm::model::gelu_backward", FlatPolicy(space, 0, rows), KOKKOS_LAMBDA(const std::int64_t i) {
        const T* xr = &x(i, 0);
        const T* dyr = &dy(i, 0);
        T* dxr = &dx(i, 0);
        if (fastGradRow(cols, xr, dyr, dxr)) return;
        for (std::int64_t c = 0; c < cols; ++c) {
          const T v = xr[c];
          const T cdf = T(0.5) * (T(1) + math::erf(v * T(0.70710678118654752440)));
          const T pdf = T(0.39894228040143267794) * math::exp(T(-0.5) * v * v);
          dxr[c] = dyr[c] * (cdf + v * pdf);
        }
      });
}

#define PLM_MODEL_GELU_INSTANTIATE(T)                                               \
  template void geluForward<T>(const ExecSpace&, const View2<T>&, const View2<T>&); \
  template void geluBackward<T>(const ExecSpace&, const View2<T>&, const View2<T>&, \
                                const View2<T>&);

PLM_MODEL_GELU_INSTANTIATE(float)
PLM_MODEL_GELU_INSTANTIATE(double)

}  // namespace plm::model
