// cuBLASLt GEMM plans cached per shape, and the plain reference kernel they are checked against.
// Row-major D(M,N) = op(A) op(B) is run as column-major D^T(N,M) = op(B)^T op(A)^T: cuBLASLt's
// "A" is our B and its "B" is our A, its m is our N and its n our M.
#include "gpu/gemm.hpp"

#include "core/error.hpp"

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <map>
#include <string>
#include <tuple>

namespace plm::gpu {

namespace {

cudaDataType_t cudaType(DType t) { return t == DType::BF16 ? CUDA_R_16BF : CUDA_R_32F; }

cublasLtEpilogue_t ltEpilogue(Epilogue e) {
  switch (e) {
    case Epilogue::None: return CUBLASLT_EPILOGUE_DEFAULT;
    case Epilogue::Bias: return CUBLASLT_EPILOGUE_BIAS;
    case Epilogue::BiasGeluAux: return CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
    case Epilogue::DGelu: return CUBLASLT_EPILOGUE_DGELU;
    case Epilogue::BGradA: return CUBLASLT_EPILOGUE_BGRADB;
  }
  return CUBLASLT_EPILOGUE_DEFAULT;
}

using PlanKey = std::tuple<bool, bool, std::int64_t, std::int64_t, std::int64_t, std::int64_t,
                           std::int64_t, std::int64_t, int, int, std::int64_t, std::int64_t, bool>;

struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr, d = nullptr;  // cuBLASLt's
  cublasLtMatmulAlgo_t algo{};
};

}  // namespace

struct Gemm::Impl {
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;
  std::size_t workspace_bytes = 0;
  std::map<PlanKey, Plan> plans;

  Plan& plan(const GemmArgs& g) {
    PlanKey key{g.trans_a,
                g.trans_b,
                g.m,
                g.n,
                g.k,
                g.lda,
                g.ldb,
                g.ldd,
                static_cast<int>(g.d_type),
                static_cast<int>(g.epilogue),
                g.c ? g.ldc : -1,
                g.ldaux,
                g.beta != 0.0f};
    auto it = plans.find(key);
    if (it != plans.end()) return it->second;

    Plan p;
    PLM_CHECK_CUBLAS(cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    // Our B becomes cuBLASLt's A: stored row-major (K,N) = column-major (N,K) = what D^T needs.
    cublasOperation_t op_lt_a = g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
    cublasOperation_t op_lt_b = g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
    PLM_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_lt_a,
                                                    sizeof(op_lt_a)));
    PLM_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_lt_b,
                                                    sizeof(op_lt_b)));
    cublasLtEpilogue_t epi = ltEpilogue(g.epilogue);
    PLM_CHECK_CUBLAS(
        cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi)));
    if (g.epilogue == Epilogue::BiasGeluAux || g.epilogue == Epilogue::DGelu) {
      std::int64_t ld = g.ldaux;
      PLM_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD,
                                                      &ld, sizeof(ld)));
    }
    // Column-major layouts (rows, cols, ld) of the stored matrices.
    std::uint64_t a_rows = g.trans_b ? g.k : g.n, a_cols = g.trans_b ? g.n : g.k;
    std::uint64_t b_rows = g.trans_a ? g.m : g.k, b_cols = g.trans_a ? g.k : g.m;
    PLM_CHECK_CUBLAS(cublasLtMatrixLayoutCreate(&p.a, CUDA_R_16BF, a_rows, a_cols, g.ldb));
    PLM_CHECK_CUBLAS(cublasLtMatrixLayoutCreate(&p.b, CUDA_R_16BF, b_rows, b_cols, g.lda));
    PLM_CHECK_CUBLAS(cublasLtMatrixLayoutCreate(&p.d, cudaType(g.d_type), g.n, g.m, g.ldd));
    PLM_CHECK_CUBLAS(
        cublasLtMatrixLayoutCreate(&p.c, cudaType(g.d_type), g.n, g.m, g.c ? g.ldc : g.ldd));

    cublasLtMatmulPreference_t pref = nullptr;
    PLM_CHECK_CUBLAS(cublasLtMatmulPreferenceCreate(&pref));
    PLM_CHECK_CUBLAS(cublasLtMatmulPreferenceSetAttribute(
        pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_bytes, sizeof(workspace_bytes)));
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    PLM_CHECK_CUBLAS(cublasLtMatmulAlgoGetHeuristic(handle, p.desc, p.a, p.b, p.c, p.d, pref, 1,
                                                    &result, &found));
    cublasLtMatmulPreferenceDestroy(pref);
    if (found == 0)
      throw Error("plm::gpu::Gemm: cuBLASLt has no algorithm for M=" + std::to_string(g.m) +
                  " N=" + std::to_string(g.n) + " K=" + std::to_string(g.k) + " epilogue " +
                  std::to_string(static_cast<int>(g.epilogue)) +
                  "; check leading dimensions (multiples of 8) and the epilogue's data types");
    p.algo = result.algo;
    return plans.emplace(key, p).first->second;
  }

  ~Impl() {
    for (auto& [key, p] : plans) {
      cublasLtMatrixLayoutDestroy(p.a);
      cublasLtMatrixLayoutDestroy(p.b);
      cublasLtMatrixLayoutDestroy(p.c);
      cublasLtMatrixLayoutDestroy(p.d);
      cublasLtMatmulDescDestroy(p.desc);
    }
    if (workspace) cudaFree(workspace);
    if (handle) cublasLtDestroy(handle);
  }
};

Gemm::Gemm(std::size_t workspace_bytes) : impl_member(std::make_unique<Impl>()) {
  PLM_CHECK_CUBLAS(cublasLtCreate(&impl_member->handle));
  impl_member->workspace_bytes = workspace_bytes;
  PLM_CHECK_CUDA(cudaMalloc(&impl_member->workspace, workspace_bytes));
}

Gemm::~Gemm() = default;

std::size_t Gemm::numPlans() const { return impl_member->plans.size(); }

void Gemm::run(Stream stream, const GemmArgs& g) {
  if (g.m == 0 || g.n == 0) return;
  Plan& p = impl_member->plan(g);
  if (g.epilogue == Epilogue::Bias || g.epilogue == Epilogue::BiasGeluAux) {
    PLM_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                    &g.bias, sizeof(g.bias)));
  }
  if (g.epilogue == Epilogue::BGradA) {
    PLM_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                    &g.bias_grad, sizeof(g.bias_grad)));
  }
  if (g.epilogue == Epilogue::BiasGeluAux || g.epilogue == Epilogue::DGelu) {
    PLM_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(
        p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &g.aux, sizeof(g.aux)));
  }
  PLM_CHECK_CUBLAS(cublasLtMatmul(impl_member->handle, p.desc, &g.alpha, g.b, p.a, g.a, p.b,
                                  &g.beta, g.c ? g.c : g.d, p.c, g.d, p.d, &p.algo,
                                  impl_member->workspace, impl_member->workspace_bytes, stream));
}

// ---------------------------------------------------------------------------------------------
// Reference

namespace {

__device__ float geluTanh(float x) {
  const float c = 0.7978845608028654f;  // sqrt(2/pi)
  return 0.5f * x * (1.0f + tanhf(c * (x + 0.044715f * x * x * x)));
}

__device__ float geluTanhGrad(float x) {
  const float c = 0.7978845608028654f;
  float t = tanhf(c * (x + 0.044715f * x * x * x));
  return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * c * (1.0f + 3.0f * 0.044715f * x * x);
}

__device__ float loadBf16(const void* p, std::int64_t i) {
  return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
}

__device__ float load(const void* p, DType t, std::int64_t i) {
  return t == DType::BF16 ? loadBf16(p, i) : static_cast<const float*>(p)[i];
}

__device__ void store(void* p, DType t, std::int64_t i, float v) {
  if (t == DType::BF16)
    static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16(v);
  else
    static_cast<float*>(p)[i] = v;
}

__global__ void gemmReferenceKernel(GemmArgs g) {
  std::int64_t idx = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
  if (idx >= g.m * g.n) return;
  std::int64_t m = idx / g.n, n = idx % g.n;
  float acc = 0.0f;
  for (std::int64_t k = 0; k < g.k; ++k) {
    float a = loadBf16(g.a, g.trans_a ? k * g.lda + m : m * g.lda + k);
    float b = loadBf16(g.b, g.trans_b ? n * g.ldb + k : k * g.ldb + n);
    acc += a * b;
  }
  float v = g.alpha * acc;
  if (g.beta != 0.0f)
    v += g.beta * (g.c ? load(g.c, g.d_type, m * g.ldc + n) : load(g.d, g.d_type, m * g.ldd + n));
  if (g.epilogue == Epilogue::Bias) v += load(g.bias, g.d_type, n);
  if (g.epilogue == Epilogue::BiasGeluAux) {
    v += load(g.bias, g.d_type, n);
    static_cast<__nv_bfloat16*>(g.aux)[m * g.ldaux + n] = __float2bfloat16(v);
    v = geluTanh(v);
  }
  if (g.epilogue == Epilogue::DGelu) v *= geluTanhGrad(loadBf16(g.aux, m * g.ldaux + n));
  store(g.d, g.d_type, m * g.ldd + n, v);
}

// BGradA: bias_grad[m] = sum over k of op(A)[m][k].
__global__ void biasGradRowsOfAKernel(GemmArgs g) {
  std::int64_t m = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
  if (m >= g.m) return;
  float sum = 0.0f;
  for (std::int64_t k = 0; k < g.k; ++k)
    sum += loadBf16(g.a, g.trans_a ? k * g.lda + m : m * g.lda + k);
  static_cast<float*>(g.bias_grad)[m] = sum;
}

}  // namespace

void gemmReference(Stream stream, const GemmArgs& g) {
  if (g.m == 0 || g.n == 0) return;
  const int threads = 256;
  if (g.epilogue == Epilogue::BGradA) {
    biasGradRowsOfAKernel<<<static_cast<unsigned>((g.m + threads - 1) / threads), threads, 0,
                            stream>>>(g);
    PLM_CHECK_CUDA(cudaGetLastError());
  }
  std::int64_t total = g.m * g.n;
  gemmReferenceKernel<<<static_cast<unsigned>((total + threads - 1) / threads), threads, 0,
                        stream>>>(g);
  PLM_CHECK_CUDA(cudaGetLastError());
}

}  // namespace plm::gpu
