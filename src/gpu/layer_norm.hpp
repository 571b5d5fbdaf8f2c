// LayerNorm forward and backward on CUDA for the bf16 compute policy.
//
// Design: a row held in registers by one warp (or 2, 4, 8 warps for wide rows), 16-byte fp32 /
// 8-byte bf16 loads when the hidden size is a multiple of 4 (pair loads otherwise); statistics
// (mean, rstd) fp32; gamma and beta are the fp32 master parameters (no bf16 copy of them exists).
// The input may be the fp32 residual stream or a bf16 activation, the output gradient fp32 or bf16.
// The backward writes the input gradient (=) or, in residual mode, adds it to the fp32
// residual-stream gradient and writes that sum's bf16 copy for the next GEMM, in the same pass.
// dgamma and dbeta accumulate (+=) in a fixed order with no float atomics: each block sums its rows
// in a fixed order in registers and shared memory and writes one partial row to `workspace`, and a
// second kernel adds the partials in a fixed order, so bf16 runs are bitwise reproducible.
#pragma once

#include "gpu/device.hpp"
#include "gpu/gemm.hpp"  // DType

#include <cstddef>
#include <cstdint>

namespace plm::gpu {

/// \brief y (bf16) = (x - mean) * rstd * gamma + beta per row of x (rows, cols), x fp32 or bf16;
/// saves mean and rstd (rows).  cols even.
template <class TX> void layerNormForward(Stream stream, const TX* x, const float* gamma,
                                          const float* beta, bf16* y, float* mean, float* rstd,
                                          std::int64_t rows, int cols, float eps);

/// \brief The FP8 codes of a LayerNorm output, cast in the pass that computes it (delayed
/// scaling: the scale is a device scalar from earlier steps).  Each code is
/// fp8(float(bf16(y)) * scale), saturating, nearest-even: exactly what castFp8 (fp8.hpp) writes
/// from the bf16 output, so the fused and the separate cast agree bit for bit.
struct LayerNormFp8Args {
  DType out_type = DType::E4M3;  // E4M3 or E5M2
  void* codes = nullptr;         // optional (rows, cols), row stride ld_codes (even)
  std::int64_t ld_codes = 0;
  void* codes_t = nullptr;      // optional (cols, rows), row stride ld_codes_t (multiple of 4); the
  std::int64_t ld_codes_t = 0;  // columns from rows on are not written
  const float* scale = nullptr;  // device scalar, required
  float* scale_inv = nullptr;    // optional: 1 / scale written
  float* amax = nullptr;         // optional: max |bf16(y)|, written or max-accumulated
  bool amax_accumulate = false;
};

/// \brief layerNormForward (y may be nullptr: no bf16 output) with the FP8 codes of y and, in
/// the same pass, their transpose and amax: the cast of an FP8 GEMM's input fused into its
/// producer.  A block normalises 32 rows and writes their transposed codes in 32-byte runs.
template <class TX> void layerNormForwardFp8(Stream stream, const TX* x, const float* gamma,
                                             const float* beta, bf16* y, float* mean, float* rstd,
                                             std::int64_t rows, int cols, float eps,
                                             const LayerNormFp8Args& fp8);

/// \brief Bytes of `workspace` layerNormBackward needs for (rows, cols).
std::size_t layerNormBackwardWorkspace(std::int64_t rows, int cols);

/// \brief From dy (rows, cols; fp32 or bf16) and the forward's x, mean, rstd: dgamma, dbeta
/// (fp32) += their gradients, and the input gradient g.  With `residual` (fp32 (rows, cols)):
/// residual = (accumulate ? residual : 0) + g and dx = bf16(residual); without: dx = bf16(g).
/// cols even, at most 5120.
template <class TX, class TDY>
void layerNormBackward(Stream stream, const TDY* dy, const TX* x, const float* gamma,
                       const float* mean, const float* rstd, float* residual, bool accumulate,
                       bf16* dx, float* dgamma, float* dbeta, std::int64_t rows, int cols,
                       void* workspace);

}  // namespace plm::gpu
