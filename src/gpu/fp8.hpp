// FP8 casts for Hopper's FP8 GEMMs: bf16/fp32 -> E4M3/E5M2 with per-tensor scales (delayed or
// current scaling) or power-of-two block scales (1x128 and 128x128, Transformer Engine's
// Float8BlockScaling), optionally writing the transposed copy in the same pass, with the amax of
// the input fused in.
//
// Design:
// - Scales follow Transformer Engine: fp8 = cast(x * scale), and the GEMM multiplies by
//   scale_inv = 1 / scale (cuBLASLt's A/B_SCALE_POINTER).  The cast is saturating
//   (__NV_SATFINITE: beyond +-max, infinities included, becomes +-max; NaN stays NaN) and rounds
//   to nearest, ties to even, on the fp32 product x * scale (bf16 inputs are widened exactly
//   first).  That is exactly plm::model::fp8::encode(format, x * scale), the CPU emulation.
// - Hopper's FP8 GEMMs take both operands with K contiguous ("TN"): in plm's row-major terms
//   A (M,K) and B (N,K) (GemmArgs::trans_a = false, trans_b = true).  For the three GEMMs of a
//   Linear layer Y = X W^T that means:  forward  Y  = X  W^T : A = X (T,in),   B = W (out,in);
//                                       dgrad    dX = dY W   : A = dY (T,out), B = W^T (in,out);
//                                       wgrad    dW = dY^T X : A = dY^T (out,T), B = X^T (in,T).
//   So X, W and dY are each cast once with `out_t` (the transposed copy) where a backward GEMM
//   needs it.
// - amax is max |x| over the input before scaling, as one fp32 device scalar, written (=) or
//   max-accumulated (amax_accumulate, e.g. over the micro-batches of a step).  It is reduced
//   with an integer atomicMax on the bit pattern of |x|, so it is exact and independent of
//   thread order (deterministic), and a NaN in the input makes amax NaN, an infinity +inf (the
//   caller can tell a non-finite tensor from the amax alone).
// - Block scales are powers of two (Transformer Engine's force_pow_2_scales): s = fp8_max / amax
//   in fp32, then its mantissa cleared (2^floor(log2 s)); s = 1 for a block whose amax is 0 or
//   not finite; an infinite s (amax below fp8_max * 2^-128) becomes 2^127.  So x * scale and the
//   GEMM's scale_inv = 1 / scale are exact.  What is stored is scale_inv (fp32), in the layout
//   cuBLASLt's VEC128_32F / BLK128x128_32F modes read, given by blockScaleLayout().  Partial
//   blocks at the edges are allowed.
//
// Every function is asynchronous on `stream` and takes device pointers; nothing here allocates
// or synchronises.  References for tests: plm::model::fp8 (the same encode) and
// test/gpu/test_fp8.cpp's host code.
#pragma once

#include "gpu/device.hpp"
#include "gpu/gemm.hpp"  // DType (BF16, F32, E4M3, E5M2), Fp8ScaleMode

#include <cstddef>
#include <cstdint>

namespace plm::gpu {

/// \brief Largest finite value of an FP8 format (448 for E4M3, 57344 for E5M2); throws for a
/// non-FP8 type.
float fp8Max(DType format);

/// \brief A per-tensor scaled cast (delayed or current scaling).
///   out[r][c]   = fp8(in[r][c] * scale)        (rows, cols), row stride ld_out
///   out_t[c][r] = the same code                (cols, rows), row stride ld_out_t
struct Fp8CastArgs {
  std::int64_t rows = 0, cols = 0;
  const void* in = nullptr;  // (rows, cols), in_type BF16 or F32
  DType in_type = DType::BF16;
  std::int64_t ld_in = 0;
  DType out_type = DType::E4M3;  // E4M3 or E5M2
  void* out = nullptr;           // optional (nullptr: not written)
  std::int64_t ld_out = 0;
  void* out_t = nullptr;  // optional transposed copy
  std::int64_t ld_out_t = 0;
  const float* scale = nullptr;  // device scalar, read (castFp8); written by castFp8Current
  float* scale_inv = nullptr;    // optional device scalar: 1 / scale written (for the GEMM)
  float* amax = nullptr;         // optional device scalar: max |in| (required by castFp8Current)
  bool amax_accumulate = false;  // amax = max(amax, max |in|) instead of =
  // Optional: col_sum[c] = sum over rows of in[r][c] in fp32 (a Linear layer's bias gradient from
  // dY, taken from the unquantised values in the same pass), in a fixed order (deterministic);
  // needs `workspace` of fp8ColSumWorkspace(rows, cols) bytes.
  float* col_sum = nullptr;
  bool col_sum_accumulate = false;  // col_sum += instead of =
  void* workspace = nullptr;
  // Optional: the input is a GELU's pre-activation (bf16 or fp32), and what is cast (its codes,
  // amax, column sums) is g = bf16(gelu_tanh(in)), the tanh form of cuBLASLt's GELU epilogue,
  // computed in fp32 from the input; g itself is written (bf16, row stride ld_gelu_out) where
  // gelu_out is given.  The FFN's GELU output cast in the pass that applies the GELU.
  bool gelu = false;
  void* gelu_out = nullptr;
  std::int64_t ld_gelu_out = 0;
};

/// \brief Bytes of workspace a cast with col_sum needs (per-tile partial sums).
std::size_t fp8ColSumWorkspace(std::int64_t rows, std::int64_t cols);

/// \brief Casts with the scale at args.scale (delayed scaling: computed from earlier steps'
/// amaxes), writing out and/or out_t in one pass over the input, and amax / scale_inv if given.
void castFp8(Stream stream, const Fp8CastArgs& args);

/// \brief max |in| over a (rows, cols) bf16/fp32 tensor with row stride ld, written to the
/// device scalar amax (or max-accumulated).  Exact and deterministic; NaN/inf propagate.
void amaxFp8(Stream stream, const void* in, DType in_type, std::int64_t rows, std::int64_t cols,
             std::int64_t ld, float* amax, bool accumulate = false);

/// \brief scale = (fp8Max(format) / amax) / 2^margin and scale_inv = 1 / scale on the device,
/// in fp32 (IEEE division, the power of two exact), Transformer Engine's rule: where amax is 0
/// or not finite scale = 1, where the quotient overflows FLT_MAX.  scale_inv may be nullptr.
void scaleFromAmax(Stream stream, const float* amax, DType format, int margin, float* scale,
                   float* scale_inv);

/// \brief Current scaling: amax of the input (written to args.amax, required), the scale from it
/// (written to `scale`, margin as in scaleFromAmax), then the cast with it (two passes over the
/// input, three launches); args.scale is ignored, args.scale_inv written if given.
void castFp8Current(Stream stream, const Fp8CastArgs& args, float* scale, int margin = 0);

/// \brief Where the block scales of an operand stored row-major (rows, k) (k = the GEMM's
/// contracted dimension, contiguous) live: scale_inv of element (r, kk) is at
///   Block1x128:   [(kk / 128) * ld + r]                 ld = rows rounded up to 4
///   Block128x128: [(r / 128) * ld + kk / 128]           ld = ceil(k / 128) rounded up to 4
/// `count` fp32 values in all (padding included; the cast writes padding as 1).
struct BlockScaleLayout {
  std::int64_t ld = 0;
  std::int64_t count = 0;
};
BlockScaleLayout blockScaleLayout(Fp8ScaleMode scaling, std::int64_t rows, std::int64_t k);

/// \brief A block-scaled cast (E4M3 in both directions in Transformer Engine's recipe; E5M2 is
/// allowed).  The input (rows, cols) is the operand with cols = K for `out`; the transposed copy
/// (cols, rows) has rows = K (e.g. X^T, dY^T for wgrad, W^T for dgrad).
/// - Block1x128: out gets 1x128 blocks along cols, scale_inv in
///   blockScaleLayout(Block1x128, rows, cols); out_t gets its own 1x128 blocks along ITS rows
///   (128x1 blocks of the input, so other scales and other codes), scale_inv_t in
///   blockScaleLayout(Block1x128, cols, rows).
/// - Block128x128: one scale per 128x128 block for both copies (the same values, transposed),
///   scale_inv in blockScaleLayout(Block128x128, rows, cols), scale_inv_t in
///   blockScaleLayout(Block128x128, cols, rows).
struct Fp8BlockCastArgs {
  std::int64_t rows = 0, cols = 0;
  const void* in = nullptr;  // (rows, cols), in_type BF16 or F32
  DType in_type = DType::BF16;
  std::int64_t ld_in = 0;
  DType out_type = DType::E4M3;
  Fp8ScaleMode scaling = Fp8ScaleMode::Block1x128;  // Block1x128 or Block128x128
  void* out = nullptr;                              // optional (rows, cols)
  std::int64_t ld_out = 0;
  float* scale_inv = nullptr;  // required with out
  void* out_t = nullptr;       // optional (cols, rows)
  std::int64_t ld_out_t = 0;
  float* scale_inv_t = nullptr;  // required with out_t
  float* amax = nullptr;         // optional: per-tensor max |in| (as in Fp8CastArgs)
  bool amax_accumulate = false;
  float* col_sum = nullptr;  // optional, as in Fp8CastArgs
  bool col_sum_accumulate = false;
  void* workspace = nullptr;  // fp8ColSumWorkspace(rows, cols) bytes with col_sum
  // Block1x128 `out` as the A operand of GEMMs whose M (= rows) must be a multiple of 8
  // (cuBLASLt's block-scaled GEMM): true writes it for two GEMMs over the same codes, the body
  // (rows rounded down to 8) and an 8-row tail whose rows past `rows` are zero codes (`out`
  // needs blockTailSplit().rows rows); scale_inv holds the body's scales
  // (blockScaleLayout(Block1x128, body, cols)) and, from blockTailSplit().tail_scales on, the
  // tail's (blockScaleLayout(Block1x128, 8, cols)).  Ignored where rows is a multiple of 8.
  bool split_tail = false;
  // Optional, as in Fp8CastArgs: the input is a GELU's pre-activation and what is cast (codes,
  // block and tensor amaxes, column sums) is g = bf16(gelu_tanh(in)), the exact values castFp8's
  // gelu pass writes, so the codes equal those of castFp8Block on that pass's output bit for
  // bit; g (bf16) is written to gelu_out (row stride ld_gelu_out) where given.  The FFN's GELU
  // output cast under block scaling in the pass that applies the GELU.
  bool gelu = false;
  void* gelu_out = nullptr;
  std::int64_t ld_gelu_out = 0;
};

/// \brief One pass over the input per 128x128 tile (block amaxes, scales, codes, both copies).
void castFp8Block(Stream stream, const Fp8BlockCastArgs& args);

/// \brief castFp8Block's split_tail layout of a Block1x128 operand (rows, k): body rows (rows
/// rounded down to 8), rows of codes (body + 8), the offset of the tail's scales (a 256-byte
/// boundary) and the scale count in all.  Where rows is a multiple of 8 there is no tail: body =
/// rows, and tail_scales = count = blockScaleLayout(Block1x128, rows, k).count.
struct BlockTailSplit {
  std::int64_t body = 0, rows = 0;
  std::int64_t tail_scales = 0, count = 0;
  bool split() const { return rows != body; }
};
BlockTailSplit blockTailSplit(std::int64_t rows, std::int64_t k);

/// \brief out (cols, rows), row stride rows = the transpose of the codes in (rows, cols), row
/// stride cols (one byte each).  What castFp8 / castFp8Block write to out_t where the codes came
/// from elsewhere (all-gathered by sharded data parallelism): a per-tensor or 128x128-block
/// scale makes a code depend on its element alone.
void transposeFp8Codes(Stream stream, const void* in, std::int64_t rows, std::int64_t cols,
                       void* out);

/// \brief An FP8 copy of a (rows, cols) tensor with its block scales in one allocation: the codes
/// (row stride cols) and, from the next 256-byte boundary, scale_inv in blockScaleLayout(scaling,
/// rows, cols).  Bytes in all, and where the scales start given the codes.
std::size_t fp8BlockTensorBytes(Fp8ScaleMode scaling, std::int64_t rows, std::int64_t cols);
inline float* fp8BlockTensorScales(void* codes, std::int64_t rows, std::int64_t cols) {
  return reinterpret_cast<float*>(static_cast<std::uint8_t*>(codes) +
                                  (rows * cols + 255) / 256 * 256);
}
inline const float* fp8BlockTensorScales(const void* codes, std::int64_t rows, std::int64_t cols) {
  return fp8BlockTensorScales(const_cast<void*>(codes), rows, cols);
}

}  // namespace plm::gpu
