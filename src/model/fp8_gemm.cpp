// The portable FP8 GEMM emulation (fp8_gemm.hpp).
#include "model/fp8_gemm.hpp"

#include "core/error.hpp"
#include "model/gemm.hpp"
#include "model/linear.hpp"

#include <cfloat>
#include <cmath>

namespace plm::model {

namespace {

// Scratch slots of OpContext (ops.cpp uses 0 to 4).
constexpr int kSlotDyRow = 8, kSlotDyCol = 9, kSlotX = 10;

template <class T>
View2<T> scratch2(OpContext& ctx, int slot, std::int64_t rows, std::int64_t cols) {
  return View2<T>(static_cast<T*>(ctx.scratch(slot, sizeof(T) * rows * cols)), rows, cols);
}

constexpr int kBlock = 128;  // Transformer Engine's Float8BlockScaling block edge

}  // namespace

template <class T> float fp8Amax(const ExecSpace& space, const View2<T>& x) {
  const int cols = static_cast<int>(x.extent(1));
  float amax = 0.0f;
  Kokkos::parallel_reduce(
      "plm::model::fp8_amax", FlatPolicy(space, 0, x.extent(0)),
      KOKKOS_LAMBDA(const std::int64_t r, float& m) {
        for (int c = 0; c < cols; ++c) {
          const float v = static_cast<float>(x(r, c));
          // |v| by the bit pattern; NaN and infinity (exponent all ones) count as +inf.
          const std::uint32_t u = fp8::detail::bitsOf(v) & 0x7FFFFFFFu;
          const float a =
              u >= 0x7F800000u ? fp8::detail::floatOf(0x7F800000u) : fp8::detail::floatOf(u);
          if (a > m) m = a;
        }
      },
      Kokkos::Max<float>(amax));
  return amax;
}

template <class T> void fp8QuantizeTensor(const ExecSpace& space, const View2<T>& x,
                                          const View2<T>& y, fp8::Format format, float scale,
                                          float scale_inv) {
  const int cols = static_cast<int>(x.extent(1));
  Kokkos::parallel_for(
      "plm::model::fp8_quantize", FlatPolicy(space, 0, x.extent(0)),
      KOKKOS_LAMBDA(const std::int64_t r) {
        for (int c = 0; c < cols; ++c)
          y(r, c) =
              static_cast<T>(fp8::quantize(format, static_cast<float>(x(r, c)), scale, scale_inv));
      });
}

template <class T> void fp8QuantizeBlocks(const ExecSpace& space, const View2<T>& x,
                                          const View2<T>& y, fp8::Format format, int block_rows,
                                          int block_cols) {
  const std::int64_t rows = x.extent(0), cols = x.extent(1);
  const std::int64_t nbr = (rows + block_rows - 1) / block_rows;
  const std::int64_t nbc = (cols + block_cols - 1) / block_cols;
  const float fmax = fp8::maxOf(format);
  Kokkos::parallel_for(
      "plm::model::fp8_quantize_blocks", FlatPolicy(space, 0, nbr * nbc),
      KOKKOS_LAMBDA(const std::int64_t blk) {
        const std::int64_t r0 = (blk / nbc) * block_rows, c0 = (blk % nbc) * block_cols;
        const std::int64_t r1 = r0 + block_rows < rows ? r0 + block_rows : rows;
        const std::int64_t c1 = c0 + block_cols < cols ? c0 + block_cols : cols;
        float amax = 0.0f;
        bool finite = true;
        for (std::int64_t r = r0; r < r1; ++r)
          for (std::int64_t c = c0; c < c1; ++c) {
            const std::uint32_t u = fp8::detail::bitsOf(static_cast<float>(x(r, c))) & 0x7FFFFFFFu;
            if (u >= 0x7F800000u) finite = false;
            const float a = fp8::detail::floatOf(u);
            if (finite && a > amax) amax = a;
          }
        // powerOfTwoScale (fp8_scaling.cpp) on the device: the exponent bits of fmax / amax.
        float scale = 1.0f;
        if (finite && amax > 0.0f) {
          const float q = fmax / amax;
          const std::uint32_t qe = fp8::detail::bitsOf(q) & 0x7F800000u;
          scale = qe >= 0x7F800000u ? fp8::detail::pow2(127) : fp8::detail::floatOf(qe);
        }
        const float scale_inv = 1.0f / scale;
        for (std::int64_t r = r0; r < r1; ++r)
          for (std::int64_t c = c0; c < c1; ++c)
            y(r, c) = static_cast<T>(
                fp8::quantize(format, static_cast<float>(x(r, c)), scale, scale_inv));
      });
}

template <class T> void fp8QuantizeOperand(const ExecSpace& space, const Fp8GemmSlot& slot,
                                           Fp8Operand o, Fp8Blocks blocks, bool record,
                                           const View2<T>& x, const View2<T>& y) {
  Fp8Scaling& s = *slot.scaling;
  const fp8::Format format = s.format(o);
  switch (s.config().recipe) {
    case Fp8Recipe::Delayed: {
      const int t = slot.index(o);
      if (record) s.record(t, fp8Amax(space, x));
      fp8QuantizeTensor(space, x, y, format, s.scale(t), s.scaleInv(t));
      return;
    }
    case Fp8Recipe::Current: {
      const float scale = currentScale(fp8Amax(space, x), fp8::maxOf(format));
      fp8QuantizeTensor(space, x, y, format, scale, 1.0f / scale);
      return;
    }
    case Fp8Recipe::Block: {
      const int br = blocks == Fp8Blocks::Rowwise ? 1 : kBlock;
      const int bc = blocks == Fp8Blocks::Columnwise ? 1 : kBlock;
      fp8QuantizeBlocks(space, x, y, format, br, bc);
      return;
    }
  }
}

template <class T> void fp8LinearForward(OpContext& ctx, const Fp8GemmSlot& slot, const View2<T>& x,
                                         const View2<T>& wq, const View1<T>& b, T beta,
                                         const View2<T>& y) {
  const auto& space = ctx.space();
  const View2<T> xq = scratch2<T>(ctx, kSlotX, x.extent(0), x.extent(1));
  fp8QuantizeOperand(space, slot, Fp8Operand::Input, Fp8Blocks::Rowwise, slot.scaling->recording(),
                     x, xq);
  linearForward(space, xq, wq, b, beta, y);
}

template <class T> void fp8LinearBackward(OpContext& ctx, const Fp8GemmSlot& slot,
                                          const View2<T>& x, const View2<T>& wq, const View2<T>& dy,
                                          T dx_beta, const View2<T>& dx, const View2<T>& dw,
                                          const View1<T>& db) {
  const auto& space = ctx.space();
  const bool block = slot.scaling->config().recipe == Fp8Recipe::Block;
  const bool record = slot.scaling->recording();
  const std::int64_t rows = dy.extent(0);
  // Rowwise Q(dy): the dgrad operand, and the wgrad one too under per-tensor scales.
  const View2<T> dy_row = scratch2<T>(ctx, kSlotDyRow, rows, dy.extent(1));
  fp8QuantizeOperand(space, slot, Fp8Operand::Grad, Fp8Blocks::Rowwise, record, dy, dy_row);
  if (dx.extent(0) != 0) gemm(space, Trans::N, Trans::N, T(1), dy_row, wq, dx_beta, dx);
  if (slot.scaling->config().wgrad == Fp8Wgrad::Bf16) {
    gemm(space, Trans::T, Trans::N, T(1), dy, x, T(1), dw);
  } else {
    View2<T> dy_col = dy_row;
    if (block) {
      dy_col = scratch2<T>(ctx, kSlotDyCol, rows, dy.extent(1));
      fp8QuantizeOperand(space, slot, Fp8Operand::Grad, Fp8Blocks::Columnwise, false, dy, dy_col);
    }
    // Q(x) as the forward cast it (same scale: delayed scales change only between steps), or
    // columnwise under block scaling; its amax was recorded by the forward.
    const View2<T> xq = scratch2<T>(ctx, kSlotX, x.extent(0), x.extent(1));
    fp8QuantizeOperand(space, slot, Fp8Operand::Input,
                       block ? Fp8Blocks::Columnwise : Fp8Blocks::Rowwise, false, x, xq);
    gemm(space, Trans::T, Trans::N, T(1), dy_col, xq, T(1), dw);
  }
  if (db.extent(0) != 0) columnSumAccumulate(space, dy, db);  // no bias: SwiGLU experts
}

#define PLM_MODEL_FP8_GEMM_INSTANTIATE(T)                                                          \
  template float fp8Amax<T>(const ExecSpace&, const View2<T>&);                                    \
  template void fp8QuantizeTensor<T>(const ExecSpace&, const View2<T>&, const View2<T>&,           \
                                     fp8::Format, float, float);                                   \
  template void fp8QuantizeBlocks<T>(const ExecSpace&, const View2<T>&, const View2<T>&,           \
                                     fp8::Format, int, int);                                       \
  template void fp8QuantizeOperand<T>(const ExecSpace&, const Fp8GemmSlot&, Fp8Operand, Fp8Blocks, \
                                      bool, const View2<T>&, const View2<T>&);                     \
  template void fp8LinearForward<T>(OpContext&, const Fp8GemmSlot&, const View2<T>&,               \
                                    const View2<T>&, const View1<T>&, T, const View2<T>&);         \
  template void fp8LinearBackward<T>(OpContext&, const Fp8GemmSlot&, const View2<T>&,              \
                                     const View2<T>&, const View2<T>&, T, const View2<T>&,         \
                                     const View2<T>&, const View1<T>&);

PLM_MODEL_FP8_GEMM_INSTANTIATE(float)
PLM_MODEL_FP8_GEMM_INSTANTIATE(double)
#undef PLM_MODEL_FP8_GEMM_INSTANTIATE

}  // namespace plm::model
