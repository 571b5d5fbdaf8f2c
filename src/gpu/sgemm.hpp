// fp32 GEMM on the GPU through cuBLAS (model/gemm.cpp's CUDA branch: the MoE router's logits,
// its weight and input gradients, and every other fp32 product on a CUDA build).
//
// Design: the call is stated in row-major terms and mapped onto cuBLAS's column-major
// convention as C^T = op(B)^T op(A)^T (no copies).  The math mode is CUBLAS_PEDANTIC_MATH: true
// fp32 (no TF32, whatever NVIDIA_TF32_OVERRIDE says), so the result matches the portable Kokkos
// GEMM to fp32 rounding.  One cuBLAS handle per thread, set to the caller's stream per call.
#pragma once

#include "gpu/device.hpp"

#include <cstdint>

namespace plm::gpu {

/// \brief C (m,n) = alpha op(A) op(B) + beta C, fp32, row-major with leading dimensions lda,
/// ldb, ldc (elements); A stored (k,m) when trans_a, (m,k) otherwise; B stored (n,k) when
/// trans_b, (k,n) otherwise.  k > 0.
void sgemm(Stream stream, bool trans_a, bool trans_b, std::int64_t m, std::int64_t n,
           std::int64_t k, float alpha, const float* a, std::int64_t lda, const float* b,
           std::int64_t ldb, float beta, float* c, std::int64_t ldc);

/// \brief Plain reference of sgemm (one thread per element, fp32 accumulation in k order).
void sgemmReference(Stream stream, bool trans_a, bool trans_b, std::int64_t m, std::int64_t n,
                    std::int64_t k, float alpha, const float* a, std::int64_t lda, const float* b,
                    std::int64_t ldb, float beta, float* c, std::int64_t ldc);

}  // namespace plm::gpu
