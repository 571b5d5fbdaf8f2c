// The portable emulation of an FP8 GEMM with fp32 accumulation (the CPU path of the FP8
// precision policy, and the reference the GPU's FP8 GEMMs are compared with).
//
// Design choice: an FP8 GEMM is emulated exactly by quantise-dequantise of both operands with
// the recipe's scales (fp8.hpp's quantize: decode(encode(x * scale)) * scale_inv, what the
// tensor core sees after cuBLASLt applies A/B_SCALE), followed by the ordinary fp32 GEMM of
// gemm.hpp.  Storage stays in the master type; only the values are FP8's.
//
// Which operands, in which format and with which blocks (Transformer Engine's recipes):
//   forward  y  = Q(x) Q(W)^T + b        x: E4M3, rowwise (blocks 1x128 along `in`)
//   dgrad    dx = Q(dy) Q(W)             dy: E5M2 (hybrid) / E4M3, rowwise (1x128 along `out`)
//   wgrad    dW += Q(dy)^T Q(x)          columnwise (blocks 128x1 along the token dimension);
//                                        with fp8.wgrad: bf16 the unquantised dy and x
//   bias     db += column sums of dy     unquantised (TE's fused bgrad reads the bf16 dy)
// Q(W) is the compute copy of the weight, quantised once per optimizer step (128x128 blocks
// under block scaling, so the same values serve both layouts).  Per-tensor recipes use one
// scale per tensor, so rowwise and columnwise quantisation coincide.
// Accumulation rule (as linear.hpp): y and dx are beta-scaled; dW and db accumulate (+=).
#pragma once

#include "model/fp8_scaling.hpp"
#include "model/ops.hpp"

namespace plm::model {

/// \brief max |x| over a (rows, cols) view, +inf if any element is NaN or infinite.
template <class T> float fp8Amax(const ExecSpace& space, const View2<T>& x);

/// \brief y = quantize(x) with one scale (y may be x).
template <class T> void fp8QuantizeTensor(const ExecSpace& space, const View2<T>& x,
                                          const View2<T>& y, fp8::Format format, float scale,
                                          float scale_inv);

/// \brief y = quantize(x) per (block_rows x block_cols) block with the block's power-of-two
/// scale (powerOfTwoScale of its amax); edge blocks are partial.  y may be x.
template <class T> void fp8QuantizeBlocks(const ExecSpace& space, const View2<T>& x,
                                          const View2<T>& y, fp8::Format format, int block_rows,
                                          int block_cols);

/// How an operand is laid out for its GEMM: the blocks of block scaling run along the GEMM's
/// inner dimension, which is the tensor's rows or columns.
enum class Fp8Blocks { Rowwise, Columnwise, Square };

/// \brief y = quantize(x) as operand `o` of the slot's GEMM under its recipe: delayed reads the
/// step's scale (and records the amax when `record`), current takes the tensor's own amax,
/// block quantises per block.  y may be x.
template <class T> void fp8QuantizeOperand(const ExecSpace& space, const Fp8GemmSlot& slot,
                                           Fp8Operand o, Fp8Blocks blocks, bool record,
                                           const View2<T>& x, const View2<T>& y);

/// \brief y = beta y + Q(x) wq^T + b, wq already quantised (the compute copy).
template <class T> void fp8LinearForward(OpContext& ctx, const Fp8GemmSlot& slot, const View2<T>& x,
                                         const View2<T>& wq, const View1<T>& b, T beta,
                                         const View2<T>& y);

/// \brief dx = dx_beta dx + Q(dy) wq (skipped when dx is empty); dW += Q(dy)^T Q(x) (or the
/// unquantised product under fp8.wgrad: bf16); db += column sums of dy.
template <class T> void fp8LinearBackward(OpContext& ctx, const Fp8GemmSlot& slot,
                                          const View2<T>& x, const View2<T>& wq, const View2<T>& dy,
                                          T dx_beta, const View2<T>& dx, const View2<T>& dw,
                                          const View1<T>& db);

}  // namespace plm::model
