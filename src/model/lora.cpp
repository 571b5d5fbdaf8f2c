// LoRA adapter kernels (see lora.hpp for the accumulation rule).
#include "model/lora.hpp"

#include "core/error.hpp"
#include "model/gemm.hpp"
#include "model/math.hpp"

#include <cmath>

namespace plm::model {
template <class T> void loraInitA(const ExecSpace& space, const View2<T>& a, std::uint64_t seed,
                                  std::uint64_t stream) {
  // kaiming_uniform_(a = sqrt(5)): gain sqrt(2 / (1 + 5)), bound gain * sqrt(3 / fan_in) =
  // 1 / sqrt(fan_in).
  const std::int64_t in = static_cast<std::int64_t>(a.extent(1));
  const double bound = in > 0 ? 1.0 / std::sqrt(static_cast<double>(in)) : 0.0;
  T* data = a.data();
  Kokkos::parallel_for(
      "plm::model::lora_init_a",
      Kokkos::RangePolicy<ExecSpace>(space, 0, static_cast<std::int64_t>(a.size())),
      KOKKOS_LAMBDA(const std::int64_t i) {
        data[i] = static_cast<T>(loraUniform(seed, stream, i, bound));
      });
}

template <class T> void loraForward(const ExecSpace& space, const View2<T>& x, const View2<T>& a,
                                    const View2<T>& b, T s, const View2<T>& tmp,
                                    const View2<T>& y) {
  gemm(space, Trans::N, Trans::T, T(1), x, a, T(0), tmp);
  gemm(space, Trans::N, Trans::T, s, tmp, b, T(1), y);
}

template <class T> void loraBackward(const ExecSpace& space, const View2<T>& x, const View2<T>& a,
                                     const View2<T>& b, T s, const View2<T>& tmp,
                                     bool recompute_tmp, const View2<T>& dy, const View2<T>& dtmp,
                                     const View2<T>& dx, const View2<T>& da, const View2<T>& db) {
  if (recompute_tmp) gemm(space, Trans::N, Trans::T, T(1), x, a, T(0), tmp);
  gemm(space, Trans::T, Trans::N, s, dy, tmp, T(1), db);     // (out, r)
  gemm(space, Trans::N, Trans::N, s, dy, b, T(0), dtmp);     // (R, r)
  gemm(space, Trans::T, Trans::N, T(1), dtmp, x, T(1), da);  // (r, in)
  if (dx.extent(0) != 0) gemm(space, Trans::N, Trans::N, T(1), dtmp, a, T(1), dx);
}

template <class T> void loraMerge(const ExecSpace& space, const View2<T>& w, const View2<T>& a,
                                  const View2<T>& b, T s) {
  gemm(space, Trans::N, Trans::N, s, b, a, T(1), w);
}

namespace {

// Scratch slots of the context (ops.hpp) the adapter products use.
constexpr int scratch_tmp = 48, scratch_dtmp = 49;

Mat scratchMat(OpContext& ctx, int slot, std::int64_t rows, std::int64_t cols, DType d) {
  return Mat{ctx.scratch(slot, static_cast<std::size_t>(rows * cols) * sizeOf(d)), d, rows, cols,
             cols};
}

}  // namespace

void loraForward(OpContext& ctx, const LoraAdapter& ad, double s, const Mat& x, const Mat& y,
                 bool accumulate) {
  const Mat tmp = scratchMat(ctx, scratch_tmp, x.rows, ad.a.rows, x.dtype);
  matmul(ctx, false, true, 1.0, x, ad.a, 0.0, tmp);
  matmul(ctx, false, true, s, tmp, ad.b, accumulate ? 1.0 : 0.0, y);
}

void loraBackward(OpContext& ctx, const LoraAdapter& ad, double s, const Mat& x, const Mat& dy,
                  const Mat& dx) {
  const Mat tmp = scratchMat(ctx, scratch_tmp, x.rows, ad.a.rows, x.dtype);
  const Mat dtmp = scratchMat(ctx, scratch_dtmp, x.rows, ad.a.rows, dy.dtype);
  matmul(ctx, false, true, 1.0, x, ad.a, 0.0, tmp);    // (R, r), recomputed: r is small
  matmul(ctx, true, false, s, dy, tmp, 1.0, ad.gb);    // (out, r)
  matmul(ctx, false, false, s, dy, ad.b, 0.0, dtmp);   // (R, r)
  matmul(ctx, true, false, 1.0, dtmp, x, 1.0, ad.ga);  // (r, in)
  if (!dx.empty()) matmul(ctx, false, false, 1.0, dtmp, ad.a, 1.0, dx);
}

#define PLM_MODEL_LORA_INSTANTIATE(T)                                                             \
  template void loraInitA<T>(const ExecSpace&, const View2<T>&, std::uint64_t, std::uint64_t);    \
  template void loraForward<T>(const ExecSpace&, const View2<T>&, const View2<T>&,                \
                               const View2<T>&, T, const View2<T>&, const View2<T>&);             \
  template void loraBackward<T>(                                                                  \
      const ExecSpace&, const View2<T>&, const View2<T>&, const View2<T>&, T, const View2<T>&,    \
      bool, const View2<T>&, const View2<T>&, const View2<T>&, const View2<T>&, const View2<T>&); \
  template void loraMerge<T>(const ExecSpace&, const View2<T>&, const View2<T>&, const View2<T>&, \
                             T);

PLM_MODEL_LORA_INSTANTIATE(float)
PLM_MODEL_LORA_INSTANTIATE(double)

}  // namespace plm::model
