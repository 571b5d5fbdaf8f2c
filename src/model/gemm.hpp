// The one dispatch point for dense matrix products in the model.
//
// C = alpha * op(A) * op(B) + beta * C on row-major (LayoutRight) 2-D views, op = transpose or
// not.  Paths, chosen by execution space and scalar type:
//   - host, float/double: KokkosBlas::gemm with the BLAS TPL (OpenBLAS on the CPU build), called
//     on the transposed problem C^T = op(B)^T op(A)^T through column-major (LayoutLeft)
//     unmanaged views of the same memory, so no copy is made;
//   - CUDA build, float: cuBLAS sgemm in true fp32 (gpu/sgemm.hpp) on the space's stream;
//   - anything else: gemmPortable, a plain Kokkos kernel (also the reference in tests).
// The CUDA build adds its vendor branch here and nowhere else.
#pragma once

#include "core/types.hpp"

namespace plm::model {

enum class Trans { N, T };

/// \brief C = alpha op(A) op(B) + beta C; shapes are checked (throws plm::Error on mismatch).
/// beta == 0 overwrites C (NaNs in C do not propagate).
template <class T> void gemm(const ExecSpace& space, Trans trans_a, Trans trans_b, T alpha,
                             const View2<T>& a, const View2<T>& b, T beta, const View2<T>& c);

/// \brief The portable Kokkos path of gemm (one thread per element of C); a test reference.
template <class T> void gemmPortable(const ExecSpace& space, Trans trans_a, Trans trans_b, T alpha,
                                     const View2<T>& a, const View2<T>& b, T beta,
                                     const View2<T>& c);

/// \brief True when gemm<T> on ExecSpace goes to the vendor BLAS (checked at compile time
/// against Kokkos Kernels' TPL availability table).
template <class T> bool gemmUsesVendorBlas();

}  // namespace plm::model
