// Accumulation rule: y, mean, rstd written (=); dx, dgamma, dbeta accumulate (+=).
// Statistics use two passes over the row (mean, then centred variance), as PyTorch does, so
// rows with a large mean do not lose precision.
#include "model/layer_norm.hpp"

#include "model/math.hpp"

namespace plm::model {

template <class T> void layerNormForward(const ExecSpace& space, const View2<T>& x,
                                         const View1<T>& gamma, const View1<T>& beta, double eps,
                                         const View2<T>& y, const View1<T>& mean,
                                         const View1<T>& rstd) {
  const auto rows = static_cast<std::int64_t>(x.extent(0));
  const int h = static_cast<int>(x.extent(1));
  const T eps_t = static_cast<T>(eps);
  Kokkos::parallel_for(
      "plm::model::layer_norm_forward", FlatPolicy(space, 0, rows),
      KOKKOS_LAMBDA(const std::int64_t i) {
        const T* xr = &x(i, 0);
        T* yr = &y(i, 0);
        T sum = 0;
        for (int c = 0; c < h; ++c) sum += xr[c];
        const T mu = sum / T(h);
        T var = 0;
        for (int c = 0; c < h; ++c) var += (xr[c] - mu) * (xr[c] - mu);
        const T rs = T(1) / math::libm::sqrt(var / T(h) + eps_t);
        for (int c = 0; c < h; ++c) yr[c] = (xr[c] - mu) * rs * gamma(c) + beta(c);
        mean(i) = mu;
        rstd(i) = rs;
      });
}

template <class T>
void layerNormBackward(const ExecSpace& space, const View2<T>& x, const View1<T>& gamma,
                       const View1<T>& mean, const View1<T>& rstd, const View2<T>& dy,
                       const View2<T>& dx, const View1<T>& dgamma, const View1<T>& dbeta) {
  const auto rows = static_cast<std::int64_t>(x.extent(0));
  const int h = static_cast<int>(x.extent(1));
  Kokkos::parallel_for(
      "plm::model::layer_norm_backward_input", FlatPolicy(space, 0, rows),
      KOKKOS_LAMBDA(const std::int64_t i) {
        const T* xr = &x(i, 0);
        const T* dyr = &dy(i, 0);
        T* dxr = &dx(i, 0);
        const T mu = mean(i), rs = rstd(i);
        T sum_g = 0, sum_gx = 0;  // sum of dxhat, sum of dxhat * xhat
        for (int c = 0; c < h; ++c) {
          const T g = dyr[c] * gamma(c);
          sum_g += g;
          sum_gx += g * (xr[c] - mu) * rs;
        }
        const T mg = sum_g / T(h), mgx = sum_gx / T(h);
        for (int c = 0; c < h; ++c) {
          const T xhat = (xr[c] - mu) * rs;
          dxr[c] += rs * (dyr[c] * gamma(c) - mg - xhat * mgx);
        }
      });
  // Parameter gradients: one thread per block of columns walking the rows (contiguous reads,
  // fixed summation order).
  constexpr int block = 64;
  const std::int64_t blocks = (h + block - 1) / block;
  Kokkos::parallel_for(
      "plm::model::layer_norm_backward_params", FlatPolicy(space, 0, blocks),
      KOKKOS_LAMBDA(const std::int64_t blk) {
        const int c0 = static_cast<int>(blk * block);
        const int nc = h - c0 < block ? h - c0 : block;
        T acc_g[block], acc_b[block];
        for (int c = 0; c < nc; ++c) acc_g[c] = acc_b[c] = 0;
        for (std::int64_t i = 0; i < rows; ++i) {
          const T* xr = &x(i, c0);
          const T* dyr = &dy(i, c0);
          const T mu = mean(i), rs = rstd(i);
          for (int c = 0; c < nc; ++c) {
            acc_g[c] += dyr[c] * (xr[c] - mu) * rs;
            acc_b[c] += dyr[c];
          }
        }
        for (int c = 0; c < nc; ++c) {
          dgamma(c0 + c) += acc_g[c];
          dbeta(c0 + c) += acc_b[c];
        }
      });
}

#define PLM_MODEL_LAYER_NORM_INSTANTIATE(T)                                                    \
  template void layerNormForward<T>(const ExecSpace&, const View2<T>&, const View1<T>&,        \
                                    const View1<T>&, double, const View2<T>&, const View1<T>&, \
                                    const View1<T>&);                                          \
  template void layerNormBackward<T>(const ExecSpace&, const View2<T>&, const View1<T>&,       \
                                     const View1<T>&, const View1<T>&, const View2<T>&,        \
                                     const View2<T>&, const View1<T>&, const View1<T>&);

PLM_MODEL_LAYER_NORM_INSTANTIATE(float)
PLM_MODEL_LAYER_NORM_INSTANTIATE(double)

}  // namespace plm::model
