// Accumulation rule: C is scaled by beta and added to (beta = 1 accumulates, beta = 0 writes).
#include "model/gemm.hpp"

#include "core/error.hpp"
#include "plm/plm_config.hpp"
#if PLM_HAVE_CUDA
#include "gpu/sgemm.hpp"
#endif

#include <KokkosBlas3_gemm.hpp>

#include <string>
#include <type_traits>

namespace plm::model {
namespace {

// Exactly the view types KokkosBlas::gemm forwards to its implementation, so the TPL table
// lookup below is the one the call makes.
using HostDevice = Kokkos::Device<HostExec, HostSpace>;
template <class T> using ColMajor =
    Kokkos::View<T**, Kokkos::LayoutLeft, HostDevice, Kokkos::MemoryTraits<Kokkos::Unmanaged>>;
template <class T> using ConstColMajor = Kokkos::View<const T**, Kokkos::LayoutLeft, HostDevice,
                                                      Kokkos::MemoryTraits<Kokkos::Unmanaged>>;

template <class T> constexpr bool vendorBlas() {
  if constexpr (!std::is_same_v<MemSpace, HostSpace> ||
                !(std::is_same_v<T, float> || std::is_same_v<T, double>)) {
    return false;
  } else {
    return KokkosBlas::Impl::gemm_tpl_spec_avail<ConstColMajor<T>, ConstColMajor<T>,
                                                 ColMajor<T>>::value;
  }
}

template <class T> void checkShapes(Trans ta, Trans tb, const View2<T>& a, const View2<T>& b,
                                    const View2<T>& c, std::int64_t& m, std::int64_t& n,
                                    std::int64_t& k) {
  m = static_cast<std::int64_t>(ta == Trans::N ? a.extent(0) : a.extent(1));
  k = static_cast<std::int64_t>(ta == Trans::N ? a.extent(1) : a.extent(0));
  const auto kb = static_cast<std::int64_t>(tb == Trans::N ? b.extent(0) : b.extent(1));
  n = static_cast<std::int64_t>(tb == Trans::N ? b.extent(1) : b.extent(0));
  if (k != kb || m != static_cast<std::int64_t>(c.extent(0)) ||
      n != static_cast<std::int64_t>(c.extent(1)))
    throw Error("plm::model::gemm: shape mismatch: op(A) is " + std::to_string(m) + "x" +
                std::to_string(k) + ", op(B) is " + std::to_string(kb) + "x" + std::to_string(n) +
                ", C is " + std::to_string(c.extent(0)) + "x" + std::to_string(c.extent(1)) +
                " (a bug in the caller)");
}

}  // namespace

template <class T> bool gemmUsesVendorBlas() { return vendorBlas<T>(); }

template <class T> void gemmPortable(const ExecSpace& space, Trans trans_a, Trans trans_b, T alpha,
                                     const View2<T>& a, const View2<T>& b, T beta,
                                     const View2<T>& c) {
  std::int64_t m, n, k;
  checkShapes(trans_a, trans_b, a, b, c, m, n, k);
  if (m == 0 || n == 0) return;
  const bool at = trans_a == Trans::T, bt = trans_b == Trans::T;
  Kokkos::parallel_for(
      "plm::model::gemm_portable",
      Kokkos::MDRangePolicy<ExecSpace, Kokkos::Rank<2>>(space, {0, 0}, {m, n}),
      KOKKOS_LAMBDA(const std::int64_t i, const std::int64_t j) {
        T sum = 0;
        for (std::int64_t p = 0; p < k; ++p)
          sum += (at ? a(p, i) : a(i, p)) * (bt ? b(j, p) : b(p, j));
        c(i, j) = beta == T(0) ? alpha * sum : alpha * sum + beta * c(i, j);
      });
}

template <class T> void gemm(const ExecSpace& space, Trans trans_a, Trans trans_b, T alpha,
                             const View2<T>& a, const View2<T>& b, T beta, const View2<T>& c) {
#if PLM_HAVE_CUDA
  // fp32 on the GPU: cuBLAS (pedantic fp32, no TF32); k == 0 stays with the portable kernel,
  // which scales C by beta as the accumulation rule says.
  if constexpr (std::is_same_v<T, float> && !std::is_same_v<MemSpace, HostSpace>) {
    std::int64_t m, n, k;
    checkShapes(trans_a, trans_b, a, b, c, m, n, k);
    if (m == 0 || n == 0) return;
    if (k > 0) {
      gpu::sgemm(space.cuda_stream(), trans_a == Trans::T, trans_b == Trans::T, m, n, k, alpha,
                 a.data(), static_cast<std::int64_t>(a.stride(0)), b.data(),
                 static_cast<std::int64_t>(b.stride(0)), beta, c.data(),
                 static_cast<std::int64_t>(c.stride(0)));
      return;
    }
  }
#endif
  if constexpr (vendorBlas<T>()) {
    std::int64_t m, n, k;
    checkShapes(trans_a, trans_b, a, b, c, m, n, k);
    if (m == 0 || n == 0) return;
    if (k == 0) {  // BLAS would leave C untouched only when beta == 1
      Kokkos::parallel_for(
          "plm::model::gemm_scale",
          Kokkos::MDRangePolicy<ExecSpace, Kokkos::Rank<2>>(space, {0, 0}, {m, n}),
          KOKKOS_LAMBDA(const std::int64_t i, const std::int64_t j) {
            c(i, j) = beta == T(0) ? T(0) : beta * c(i, j);
          });
      return;
    }
    // Row-major X (r x s) is column-major X^T (s x r) over the same memory.
    ConstColMajor<T> a_t(a.data(), a.extent(1), a.extent(0));
    ConstColMajor<T> b_t(b.data(), b.extent(1), b.extent(0));
    ColMajor<T> c_t(c.data(), c.extent(1), c.extent(0));
    const char ta = trans_a == Trans::N ? 'N' : 'T';
    const char tb = trans_b == Trans::N ? 'N' : 'T';
    const char op_b[2] = {tb, '\0'}, op_a[2] = {ta, '\0'};
    space.fence();
    KokkosBlas::gemm(op_b, op_a, alpha, b_t, a_t, beta, c_t);
  } else {
    gemmPortable(space, trans_a, trans_b, alpha, a, b, beta, c);
  }
}

#define PLM_MODEL_GEMM_INSTANTIATE(T)                                                           \
  template void gemm<T>(const ExecSpace&, Trans, Trans, T, const View2<T>&, const View2<T>&, T, \
                        const View2<T>&);                                                       \
  template void gemmPortable<T>(const ExecSpace&, Trans, Trans, T, const View2<T>&,             \
                                const View2<T>&, T, const View2<T>&);                           \
  template bool gemmUsesVendorBlas<T>();

PLM_MODEL_GEMM_INSTANTIATE(float)
PLM_MODEL_GEMM_INSTANTIATE(double)

}  // namespace plm::model
