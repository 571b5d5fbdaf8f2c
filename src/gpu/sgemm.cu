// fp32 GEMM through cuBLAS (see sgemm.hpp).
#include "gpu/sgemm.hpp"

#include "core/error.hpp"

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <climits>
#include <string>

namespace plm::gpu {
namespace {

/// One handle per thread, never destroyed: destroying it after the CUDA runtime has shut down
/// (static destruction at exit) crashes, and the process owns one at most per thread.
cublasHandle_t handle() {
  thread_local cublasHandle_t h = [] {
    cublasHandle_t made = nullptr;
    PLM_CHECK_CUBLAS(cublasCreate(&made));
    PLM_CHECK_CUBLAS(cublasSetMathMode(made, CUBLAS_PEDANTIC_MATH));
    return made;
  }();
  return h;
}

int asInt(std::int64_t v, const char* what) {
  if (v < 0 || v > INT_MAX)
    throw Error(std::string("plm::gpu::sgemm: ") + what + " = " + std::to_string(v) +
                " is outside cuBLAS's 32-bit range (a bug in the caller)");
  return static_cast<int>(v);
}

__global__ void sgemmReferenceKernel(bool ta, bool tb, std::int64_t m, std::int64_t n,
                                     std::int64_t k, float alpha, const float* a, std::int64_t lda,
                                     const float* b, std::int64_t ldb, float beta, float* c,
                                     std::int64_t ldc) {
  const std::int64_t i = blockIdx.y * std::int64_t(blockDim.y) + threadIdx.y;
  const std::int64_t j = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x;
  if (i >= m || j >= n) return;
  float s = 0;
  for (std::int64_t p = 0; p < k; ++p)
    s += (ta ? a[p * lda + i] : a[i * lda + p]) * (tb ? b[j * ldb + p] : b[p * ldb + j]);
  c[i * ldc + j] = beta == 0.0f ? alpha * s : alpha * s + beta * c[i * ldc + j];
}

}  // namespace

void sgemm(Stream stream, bool trans_a, bool trans_b, std::int64_t m, std::int64_t n,
           std::int64_t k, float alpha, const float* a, std::int64_t lda, const float* b,
           std::int64_t ldb, float beta, float* c, std::int64_t ldc) {
  if (m == 0 || n == 0) return;
  cublasHandle_t h = handle();
  PLM_CHECK_CUBLAS(cublasSetStream(h, stream));
  // Row-major C (m,n) is column-major C^T (n,m): C^T = op(B)^T op(A)^T.
  PLM_CHECK_CUBLAS(cublasSgemm(h, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N,
                               trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, asInt(n, "n"), asInt(m, "m"),
                               asInt(k, "k"), &alpha, b, asInt(ldb, "ldb"), a, asInt(lda, "lda"),
                               &beta, c, asInt(ldc, "ldc")));
}

void sgemmReference(Stream stream, bool trans_a, bool trans_b, std::int64_t m, std::int64_t n,
                    std::int64_t k, float alpha, const float* a, std::int64_t lda, const float* b,
                    std::int64_t ldb, float beta, float* c, std::int64_t ldc) {
  if (m == 0 || n == 0) return;
  const dim3 block(32, 8);
  const dim3 grid(static_cast<unsigned>((n + 31) / 32), static_cast<unsigned>((m + 7) / 8));
  sgemmReferenceKernel<<<grid, block, 0, stream>>>(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb,
                                                   beta, c, ldc);
  PLM_CHECK_CUDA(cudaGetLastError());
}

}  // namespace plm::gpu
