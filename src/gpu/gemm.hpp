// GEMMs through cuBLASLt: bf16 or FP8 (E4M3/E5M2) operands, fp32 accumulation, bf16 or fp32
// output.
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
//
// FP8 (a_type/b_type E4M3 or E5M2, not both E5M2; Hopper): both operands K-contiguous, i.e.
// trans_a = false (A stored (M,K)) and trans_b = true (B stored (N,K)); leading dimensions
// multiples of 16.  The operands are dequantised by their scale_inv (fp8.hpp): per tensor (one
// fp32 device scalar each, A/B_SCALE_POINTER) or per block (a_scaling/b_scaling Block1x128 or
// Block128x128, not both 128x128, in blockScaleLayout()'s layout).  D is bf16 or fp32, C (beta)
// as for bf16; the Bias epilogue takes a bf16 bias; amax_d (optional) receives max |D| (computed
// by cuBLASLt where it offers it, else by a pass over D).  fast_accum is cuBLASLt's FP8 fast
// accumulation (no periodic promotion to fp32; per-tensor scaling only, Transformer Engine uses
// it for the forward GEMM).
#pragma once

#include "gpu/device.hpp"

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace plm::gpu {

/// Element types of GPU tensors: GEMM outputs are BF16 or F32; E4M3/E5M2 are FP8 operands.
/// Apart from model::DType and dist::DataType on purpose: each lists what its API accepts.
enum class DType { BF16, F32, E4M3, E5M2 };

/// \brief How the scales of an FP8 GEMM operand are given (fp8.hpp casts write them).
enum class Fp8ScaleMode {
  Tensor,       // one fp32 scale_inv (CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F)
  Block1x128,   // one per 128 elements along K of each row (VEC128_32F); activations/gradients
  Block128x128  // one per 128x128 block (BLK128x128_32F); weights
};

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
  const void* a = nullptr;  // a_type
  std::int64_t lda = 0;     // row stride of A as stored
  const void* b = nullptr;  // b_type
  std::int64_t ldb = 0;
  DType a_type = DType::BF16;  // BF16, or E4M3/E5M2 with b_type FP8 too
  DType b_type = DType::BF16;
  void* d = nullptr;  // d_type
  std::int64_t ldd = 0;
  DType d_type = DType::BF16;
  float alpha = 1.0f;
  float beta = 0.0f;        // with c == nullptr, C is D itself: beta = 1 accumulates into D
  const void* c = nullptr;  // optional separate C (d_type, ldc): D = alpha AB + beta C
  std::int64_t ldc = 0;
  Epilogue epilogue = Epilogue::None;
  const void* bias = nullptr;  // Bias, BiasGeluAux: d_type (FP8 GEMMs: bf16), length n
  void* aux = nullptr;         // BiasGeluAux (written) / DGelu (read): bf16 (M,N), ld = ldaux
  std::int64_t ldaux = 0;
  void* bias_grad = nullptr;  // BGradA: fp32 (M), written
  // FP8 only:
  const float* a_scale_inv = nullptr;  // device: one value (Tensor) or the block scales
  const float* b_scale_inv = nullptr;
  Fp8ScaleMode a_scaling = Fp8ScaleMode::Tensor;
  Fp8ScaleMode b_scaling = Fp8ScaleMode::Tensor;
  float* amax_d = nullptr;  // optional device scalar: max |D| written
  bool fast_accum = false;
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
  /// \brief The heuristic's first choice and the autotuned choice for `args` (bf16 or FP8), timed
  /// now on scratch outputs: ms of each (heuristic, tuned) and the tuned choice's index in the
  /// heuristic's list.  For benchmarks; the plan cache is not touched.
  struct TuneResult {
    double heuristic_ms = -1, tuned_ms = -1;
    int tuned_index = 0, candidates = 0;
  };
  TuneResult tune(Stream stream, const GemmArgs& args);
  /// \brief For an FP8 call with amax_d, after it has run: whether cuBLASLt computed max |D|
  /// in the GEMM (true) or a separate pass over D did (false).
  bool amaxFromCublas(const GemmArgs& args);
  /// \brief How the plan for `args` runs: its K splits (1: none) and whether the bias gradient
  /// of a BGradA call comes from a separate pass (split-K without the epilogue).  Plans it.
  struct PlanInfo {
    int splits = 1;
    bool bias_pass = false;
    bool streamk = false;  // CUTLASS's stream-K kernel (bias gradient by the separate pass)
  };
  PlanInfo planInfo(Stream stream, const GemmArgs& args);
  /// \brief For benchmarks (bf16): cuBLASLt's heuristic #0, the split-K rule's choice, the
  /// fastest split-K variant at each split count (2 to 16; made from the heuristic's first 4
  /// candidates) and CUTLASS's stream-K kernel where it takes the call, whatever setGemmSplit
  /// says, each timed now on scratch outputs (mean of 5 after
  /// a warm-up) and run once more from the caller's D as C for the largest |difference| from
  /// heuristic #0's D and bias gradient.  The plan cache is not touched.
  struct SplitKRow {
    int splits = 1;
    bool rule = false;       // the SplitK rule's choice (what train.gemm_split runs untuned)
    bool bias_pass = false;  // BGradA without the epilogue, bias gradient by a separate pass
    bool streamk = false;    // CUTLASS's stream-K kernel (splits not meaningful)
    int base = 0;            // index of the heuristic candidate it was made from
    double ms = -1;          // -1: refused at launch
    double max_diff = -1, max_bias_diff = -1;
  };
  struct SplitKReport {
    double ref_max = 0;           // max |D| of heuristic #0's result
    std::vector<SplitKRow> rows;  // rows[0]: heuristic #0; empty when nothing could run
  };
  SplitKReport splitKReport(Stream stream, const GemmArgs& args);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_member;
};

/// \brief Process-wide GEMM autotuning (train.gemm_autotune), for the bf16 and FP8 GEMMs of every
/// Gemm object created or planned after the call.  On: the first call of each shape asks cuBLASLt's
/// heuristic for up to `candidates` algorithms, times each on scratch outputs (the caller's
/// results are untouched), and keeps the fastest for every later call of that shape.  Choices
/// are read from / appended to `cache_file` (empty: memory only), keyed by shape, layouts,
/// types, FP8 scaling, epilogue, cuBLASLt version and device; `write_cache` false reads only
/// (ranks other than 0).  Each call replaces the process's choices by the file's.
void setGemmAutotune(bool on, const std::string& cache_file = "", bool write_cache = true,
                     int candidates = 8);
bool gemmAutotune();

/// \brief How the bf16 GEMMs whose output has too few tiles to keep every SM busy over a long K
/// (the weight gradients dW += dY^T X: K = tokens, a few hundred 128x128 tiles for 132 SMs) are
/// spread over the device (train.gemm_split):
///   Off:     as cuBLASLt's heuristic (or train.gemm_autotune) chooses;
///   SplitK:  K split in s parts by cuBLASLt where a cost model (waves of tiles over the SMs,
///            plus the extra read-modify-write of D per part) expects at least 10% gain;
///   StreamK: CUTLASS's stream-K kernel for the weight gradients it takes (fp32 D, A stored
///            (K,M)) whose tiles fill their last wave below 90%, SplitK's rule for the rest.
/// Under train.gemm_autotune (SplitK or StreamK) the split variants and the stream-K kernel join
/// the timed candidates instead.  The parts are reduced in a fixed order (cuBLASLt's INPLACE
/// scheme with its ordering counters for fp32 D, else fp32 parts in the workspace summed by a
/// separate pass; CUTLASS's deterministic turnstile): results repeat bit for bit, but differ from
/// the unsplit GEMM's in the last bits.
enum class GemmSplit { Off, SplitK, StreamK };
/// \brief "off", "splitk" or "streamk"; anything else throws, naming the three.
GemmSplit parseGemmSplit(const std::string& name);
/// \brief For the bf16 GEMMs planned after the call.  `force_splits` > 1 (tests) splits every
/// eligible GEMM (fp32 output, epilogue none or BGradA, bf16 operands) in exactly that many
/// parts where cuBLASLt accepts it.  A split BGradA call runs without the epilogue, its bias
/// gradient from the separate pass.
void setGemmSplit(GemmSplit mode, int force_splits = 0);
GemmSplit gemmSplit();
/// \brief Whether this build holds CUTLASS's SM90 stream-K weight-gradient kernel.
bool gemmStreamKCompiled();
/// \brief Whether plans made after the call may use it at all (default true; benchmarks).
void setGemmStreamKAllowed(bool allowed);

/// \brief Plain reference: one thread per output element, fp32 accumulation, the same
/// epilogues (exact for the GELU's tanh form); FP8 operands are decoded exactly and multiplied
/// by their scale_inv (per tensor or per block) before the product.  For tests and as a fallback.
void gemmReference(Stream stream, const GemmArgs& args);

}  // namespace plm::gpu
