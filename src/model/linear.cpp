// Accumulation rule: dW and db accumulate (+=); y and dx are beta-scaled (0 writes, 1 adds).
#include "model/linear.hpp"

#include "model/gemm.hpp"

namespace plm::model {

template <class T>
void columnSumAccumulate(const ExecSpace& space, const View2<T>& a, const View1<T>& out) {
  // One thread per block of columns walking the rows keeps reads contiguous in row-major memory
  // and the sum order fixed, so results do not depend on the thread count.
  constexpr int block = 64;
  const auto rows = static_cast<std::int64_t>(a.extent(0));
  const auto cols = static_cast<std::int64_t>(a.extent(1));
  const std::int64_t blocks = (cols + block - 1) / block;
  Kokkos::parallel_for(
      "plm::model::column_sum", FlatPolicy(space, 0, blocks),
      KOKKOS_LAMBDA(const std::int64_t blk) {
        const std::int64_t c0 = blk * block;
        const int nc = static_cast<int>(cols - c0 < block ? cols - c0 : block);
        T acc[block];
        for (int c = 0; c < nc; ++c) acc[c] = 0;
        for (std::int64_t i = 0; i < rows; ++i) {
          const T* row = &a(i, c0);
          for (int c = 0; c < nc; ++c) acc[c] += row[c];
        }
        for (int c = 0; c < nc; ++c) out(c0 + c) += acc[c];
      });
}

template <class T> void linearForward(const ExecSpace& space, const View2<T>& x, const View2<T>& w,
                                      const View1<T>& b, T beta, const View2<T>& y) {
  const auto rows = static_cast<std::int64_t>(y.extent(0));
  const auto cols = static_cast<std::int64_t>(y.extent(1));
  if (b.extent(0) == 0) {  // no bias (SwiGLU experts)
    gemm(space, Trans::N, Trans::T, T(1), x, w, beta, y);
    return;
  }
  Kokkos::parallel_for(
      "plm::model::linear_bias", FlatPolicy(space, 0, rows), KOKKOS_LAMBDA(const std::int64_t i) {
        for (std::int64_t j = 0; j < cols; ++j)
          y(i, j) = (beta == T(0) ? T(0) : beta * y(i, j)) + b(j);
      });
  gemm(space, Trans::N, Trans::T, T(1), x, w, T(1), y);
}

template <class T> void linearBackward(const ExecSpace& space, const View2<T>& x, const View2<T>& w,
                                       const View2<T>& dy, T dx_beta, const View2<T>& dx,
                                       const View2<T>& dw, const View1<T>& db) {
  if (dx.extent(0) != 0) gemm(space, Trans::N, Trans::N, T(1), dy, w, dx_beta, dx);
  gemm(space, Trans::T, Trans::N, T(1), dy, x, T(1), dw);
  if (db.extent(0) != 0) columnSumAccumulate(space, dy, db);
}

#define PLM_MODEL_LINEAR_INSTANTIATE(T)                                                 \
  template void linearForward<T>(const ExecSpace&, const View2<T>&, const View2<T>&,    \
                                 const View1<T>&, T, const View2<T>&);                  \
  template void linearBackward<T>(const ExecSpace&, const View2<T>&, const View2<T>&,   \
                                  const View2<T>&, T, const View2<T>&, const View2<T>&, \
                                  const View1<T>&);                                     \
  template void columnSumAccumulate<T>(const ExecSpace&, const View2<T>&, const View1<T>&);

PLM_MODEL_LINEAR_INSTANTIATE(float)
PLM_MODEL_LINEAR_INSTANTIATE(double)

}  // namespace plm::model
