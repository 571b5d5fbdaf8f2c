// GEMMs through cuBLASLt: bf16 operands, fp32 accumulation, bf16 or fp32 output.
//
// Design: the call is stated in row-major terms, D(M,N) = alpha * op(A) op(B) + beta * C with
// op(A) (M,K) and op(B) (K,N), and mapped onto cuBLASLt's column-major convention by computing
// D^T = op(B)^T op(A)^T (no copies).  Epilogues save a pass over the output where cuBLASLt can:
// bias (per column of D, i.e. per output feature), bias + GELU (tanh form) with the
// pre-activation kept in `aux` for the backward pass, dGELU from `aux`, and the bias gradient
// over K of op(A)'s rows (cuBLASLt's BGRADB once transposed: for a Linear layer's
// dW = dY^T X this is db = sum over tokens of dY, in fp32).  cuBLASLt 13 takes the bias in D's
// type only and has no fp32 bias gradient next to a bf16 D, so the FFN's first bias gradient
// comes from its weight-gradient GEMM (BGradA) rather than from DGELU_BGRAD.  Descriptors, layouts
// and the heuristic's choice are cached per shape and epilogue; one workspace per Gemm object. Bias
// gradients are written (=), not accumulated.
#pragma once

#include "gpu/device.hpp"

#include <cstdint>
#include <memory>

namespace plm::gpu {

enum class DType { BF16, F32 };

enum class Epilogue {
  None,
  Bias,         // D = AB + bias[n]
  BiasGeluAux,  // aux = AB + bias[n]; D = gelu_tanh(aux)
  DGelu,        // D = (AB) * gelu_tanh'(aux)
  BGradA,       // D = AB; bias_grad[m] = sum over k of op(A)[m][k]
};

struct GemmArgs {
  bool trans_a = false;  // A stored (K,M) when true, (M,K) otherwise
  bool trans_b = false;  // B stored (N,K) when true, (K,N) otherwise
  std::int64_t m = 0, n = 0, k = 0;
  const void* a = nullptr;  // bf16
  std::int64_t lda = 0;     // row stride of A as stored
  const void* b = nullptr;  // bf16
  std::int64_t ldb = 0;
  void* d = nullptr;  // d_type
  std::int64_t ldd = 0;
  DType d_type = DType::BF16;
  float alpha = 1.0f;
  float beta = 0.0f;        // with c == nullptr, C is D itself: beta = 1 accumulates into D
  const void* c = nullptr;  // optional separate C (d_type, ldc): D = alpha AB + beta C
  std::int64_t ldc = 0;
  Epilogue epilogue = Epilogue::None;
  const void* bias = nullptr;  // Bias, BiasGeluAux: d_type, length n
  void* aux = nullptr;         // BiasGeluAux (written) / DGelu (read): bf16 (M,N), ld = ldaux
  std::int64_t ldaux = 0;
  void* bias_grad = nullptr;  // BGradA: fp32 (M), written
};

/// \brief A cuBLASLt handle, a workspace and the per-shape plan cache.  One per stream.
class Gemm {
 public:
  explicit Gemm(std::size_t workspace_bytes = 32u << 20);
  ~Gemm();
  Gemm(const Gemm&) = delete;
  Gemm& operator=(const Gemm&) = delete;

  /// \brief Enqueues D = alpha op(A) op(B) + beta D (+ epilogue) on `stream`.  Pointers must be
  /// 16-byte aligned and leading dimensions multiples of 8 elements.
  void run(Stream stream, const GemmArgs& args);
  /// \brief Number of distinct plans built so far (each new shape/epilogue adds one).
  std::size_t numPlans() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_member;
};

/// \brief Plain reference: one thread per output element, fp32 accumulation, the same
/// epilogues (exact for the GELU's tanh form).  For tests and as a fallback.
void gemmReference(Stream stream, const GemmArgs& args);

}  // namespace plm::gpu
