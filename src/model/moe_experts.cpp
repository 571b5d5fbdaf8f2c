// The experts' dispatch point (see moe_experts.hpp): the loop over the ordinary dispatch points,
// or on CUDA with bf16 the grouped launches of gpu/moe_grouped.hpp.
#include "model/moe_experts.hpp"

#include "core/error.hpp"
#include "plm/plm_config.hpp"
#if PLM_HAVE_CUDA
#include "gpu/moe_grouped.hpp"
#endif

#include <string>

namespace plm::model {
namespace {

/// Rows [first, first + rows) of m.
Mat rowsOf(const Mat& m, std::int64_t first, std::int64_t rows) {
  return Mat{static_cast<char*>(m.data) + first * m.ld * static_cast<std::int64_t>(sizeOf(m.dtype)),
             m.dtype,
             rows,
             m.cols,
             m.ld,
             m.fp8};
}

#if PLM_HAVE_CUDA
/// Scratch slot of OpContext holding the grouped launches' argument arrays (ops.cpp's slots
/// run to the high 30s; 64 keeps clear of them).
constexpr int kGroupedScratch = 64;

bool contiguousBf16(const Mat& m) { return m.dtype == DType::BF16 && m.ld == m.cols; }

/// Whether this call takes the grouped path: bf16 activations, bf16 weights (not FP8; the
/// biases too unless SwiGLU, which has none), fp32 gradients, and gpu::chooseExpertGemm says
/// Grouped for this shape (ffn = the activation's width: F_e for GELU and SwiGLU alike).
bool useGrouped(const std::vector<ExpertRows>& experts, const Mat& x, const Mat& pre, int ffn,
                bool backward, ExpertGemmMode mode, bool swiglu) {
  if (experts.empty() || !contiguousBf16(x) || !contiguousBf16(pre)) return false;
  for (const auto& e : experts) {
    if (e.w->w1.fp8 || e.w->w2.fp8 || e.w->w1.dtype != DType::BF16 || e.w->w2.dtype != DType::BF16)
      return false;
    if (!swiglu && (e.w->b1.dtype != DType::BF16 || e.w->b2.dtype != DType::BF16)) return false;
    if (backward && (e.g->w1.dtype != DType::F32 || e.g->w2.dtype != DType::F32)) return false;
    if (backward && !swiglu && (e.g->b1.dtype != DType::F32 || e.g->b2.dtype != DType::F32))
      return false;
  }
  const gpu::ExpertGemm asked = mode == ExpertGemmMode::Loop      ? gpu::ExpertGemm::Loop
                                : mode == ExpertGemmMode::Grouped ? gpu::ExpertGemm::Grouped
                                                                  : gpu::ExpertGemm::Auto;
  return gpu::chooseExpertGemm(asked, static_cast<int>(experts.size()), static_cast<int>(x.cols),
                               ffn, backward) == gpu::ExpertGemm::Grouped;
}

template <class E> const E* as(const void* p) { return static_cast<const E*>(p); }

/// What a grouped launch needs besides the tensors: the experts' bf16 weights, their row
/// counts and the argument workspace (OpContext scratch).
struct GroupedCall {
  std::vector<gpu::ExpertWeights> w;
  std::vector<std::int64_t> rows;
  void* workspace = nullptr;
  std::size_t bytes = 0;
};

GroupedCall groupedCall(OpContext& ctx, const std::vector<ExpertRows>& experts, const Mat& x,
                        int ffn) {
  GroupedCall c;
  for (const auto& e : experts) {
    const DenseMlpWeights& x = *e.w;
    c.w.push_back({as<gpu::bf16>(x.w1.data), as<gpu::bf16>(x.b1.data), as<gpu::bf16>(x.w2.data),
                   as<gpu::bf16>(x.b2.data)});
    c.rows.push_back(e.rows);
  }
  c.bytes = gpu::groupedExpertWorkspaceBytes(static_cast<int>(experts.size()),
                                             static_cast<int>(x.cols), ffn);
  c.workspace = ctx.scratch(kGroupedScratch, c.bytes);
  return c;
}
#endif

}  // namespace

void expertsForward(OpContext& ctx, const std::vector<ExpertRows>& experts, const Mat& x,
                    const Mat& pre, const Mat& act, const Mat& y, ExpertGemmMode mode,
                    ExpertActivation activation) {
  if (activation == ExpertActivation::Swiglu) {
#if PLM_HAVE_CUDA
    const int fe = static_cast<int>(act.cols);
    if (contiguousBf16(act) && contiguousBf16(y) &&
        useGrouped(experts, x, pre, fe, false, mode, true)) {
      const GroupedCall c = groupedCall(ctx, experts, x, fe);
      gpu::groupedSwigluExpertForward(
          ctx.space().cuda_stream(), c.w, c.rows, as<gpu::bf16>(x.data),
          static_cast<gpu::bf16*>(pre.data), static_cast<gpu::bf16*>(act.data),
          static_cast<gpu::bf16*>(y.data), static_cast<int>(x.cols), fe, c.workspace, c.bytes);
      ctx.mark(OpKind::Gemm);
      return;
    }
#endif
    std::int64_t o = 0;
    for (const auto& e : experts) {
      if (e.rows > 0) {
        linear(ctx, rowsOf(x, o, e.rows), e.w->w1, Vec{}, rowsOf(pre, o, e.rows));
        swigluForward(ctx, rowsOf(pre, o, e.rows), rowsOf(act, o, e.rows));
        linear(ctx, rowsOf(act, o, e.rows), e.w->w2, Vec{}, rowsOf(y, o, e.rows));
      }
      o += e.rows;
    }
    return;
  }
#if PLM_HAVE_CUDA
  if (useGrouped(experts, x, pre, static_cast<int>(pre.cols), false, mode, false)) {
    const GroupedCall c = groupedCall(ctx, experts, x, static_cast<int>(pre.cols));
    gpu::groupedExpertForward(ctx.space().cuda_stream(), c.w, c.rows, as<gpu::bf16>(x.data),
                              static_cast<gpu::bf16*>(pre.data), static_cast<gpu::bf16*>(act.data),
                              static_cast<gpu::bf16*>(y.data), static_cast<int>(x.cols),
                              static_cast<int>(pre.cols), c.workspace, c.bytes);
    ctx.mark(OpKind::Gemm);
    return;
  }
#else
  (void)mode;  // the choice exists on the CUDA build only
#endif
  std::int64_t o = 0;
  for (const auto& e : experts) {
    if (e.rows > 0) {
      linearGelu(ctx, rowsOf(x, o, e.rows), e.w->w1, e.w->b1, rowsOf(pre, o, e.rows),
                 rowsOf(act, o, e.rows));
      linear(ctx, rowsOf(act, o, e.rows), e.w->w2, e.w->b2, rowsOf(y, o, e.rows));
    }
    o += e.rows;
  }
}

bool expertsForwardOnDevice(OpContext& ctx, const std::vector<ExpertRows>& experts,
                            const DeviceExpertRows& rows, const Mat& x, const Mat& pre,
                            const Mat& act, const Mat& y, ExpertGemmMode mode,
                            ExpertActivation activation) {
#if PLM_HAVE_CUDA
  const bool swiglu = activation == ExpertActivation::Swiglu;
  const int fe = static_cast<int>(act.cols);
  const bool shapes_ok = experts.size() <= static_cast<std::size_t>(gpu::kMaxRouteExperts) &&
                         x.cols % 8 == 0 && fe % 8 == 0;
  if (mode == ExpertGemmMode::Loop || !shapes_ok || !gpu::groupedExpertGemmAvailable() ||
      !contiguousBf16(act) || !contiguousBf16(y) ||
      !useGrouped(experts, x, pre, fe, false, ExpertGemmMode::Grouped, swiglu))
    return false;
  const GroupedCall c = groupedCall(ctx, experts, x, fe);
  const gpu::DeviceRows d{rows.rows, rows.first, rows.total};
  auto* p = static_cast<gpu::bf16*>(pre.data);
  auto* a = static_cast<gpu::bf16*>(act.data);
  auto* out = static_cast<gpu::bf16*>(y.data);
  if (swiglu)
    gpu::groupedSwigluExpertForward(ctx.space().cuda_stream(), c.w, d, as<gpu::bf16>(x.data), p, a,
                                    out, static_cast<int>(x.cols), fe, c.workspace, c.bytes);
  else
    gpu::groupedExpertForward(ctx.space().cuda_stream(), c.w, d, as<gpu::bf16>(x.data), p, a, out,
                              static_cast<int>(x.cols), fe, c.workspace, c.bytes);
  ctx.mark(OpKind::Gemm);
  return true;
#else
  (void)ctx, (void)experts, (void)rows, (void)x, (void)pre, (void)act, (void)y, (void)mode,
      (void)activation;
  return false;
#endif
}

void expertsBackward(OpContext& ctx, const std::vector<ExpertRows>& experts, const Mat& x,
                     const Mat& pre, const Mat& act, const Mat& dy, const Mat& dpre, const Mat& dx,
                     ExpertGemmMode mode, ExpertActivation activation, const Mat& dact) {
  for (const auto& e : experts)
    if (!e.g) throw Error("plm::model::expertsBackward: an expert without gradients (a bug)");
  if (activation == ExpertActivation::Swiglu) {
    if (dact.empty() || dact.rows < x.rows)
      throw Error("plm::model::expertsBackward: SwiGLU experts need a dact buffer (a bug)");
#if PLM_HAVE_CUDA
    const int fe = static_cast<int>(act.cols);
    if (contiguousBf16(act) && contiguousBf16(dy) && contiguousBf16(dpre) && contiguousBf16(dx) &&
        contiguousBf16(dact) && useGrouped(experts, x, pre, fe, true, mode, true)) {
      const GroupedCall c = groupedCall(ctx, experts, x, fe);
      std::vector<gpu::ExpertGrads> g(experts.size());
      for (std::size_t i = 0; i < experts.size(); ++i)
        g[i] = {static_cast<float*>(experts[i].g->w1.data), nullptr,
                static_cast<float*>(experts[i].g->w2.data), nullptr};
      gpu::groupedSwigluExpertBackward(
          ctx.space().cuda_stream(), c.w, g, c.rows, as<gpu::bf16>(x.data), as<gpu::bf16>(pre.data),
          as<gpu::bf16>(act.data), as<gpu::bf16>(dy.data), static_cast<gpu::bf16*>(dact.data),
          static_cast<gpu::bf16*>(dpre.data), static_cast<gpu::bf16*>(dx.data),
          static_cast<int>(x.cols), fe, c.workspace, c.bytes);
      ctx.mark(OpKind::Gemm);
      return;
    }
#endif
    std::int64_t o = 0;
    for (const auto& e : experts) {
      if (e.rows > 0) {
        linearBackward(ctx, rowsOf(act, o, e.rows), e.w->w2, rowsOf(dy, o, e.rows),
                       rowsOf(dact, o, e.rows), false, e.g->w2, Vec{});
        swigluBackward(ctx, rowsOf(pre, o, e.rows), rowsOf(dact, o, e.rows),
                       rowsOf(dpre, o, e.rows));
        linearBackward(ctx, rowsOf(x, o, e.rows), e.w->w1, rowsOf(dpre, o, e.rows),
                       rowsOf(dx, o, e.rows), false, e.g->w1, Vec{});
      }
      o += e.rows;
    }
    return;
  }
#if PLM_HAVE_CUDA
  if (useGrouped(experts, x, pre, static_cast<int>(pre.cols), true, mode, false) &&
      contiguousBf16(dy) && contiguousBf16(dpre) && contiguousBf16(dx) && contiguousBf16(act)) {
    const GroupedCall c = groupedCall(ctx, experts, x, static_cast<int>(pre.cols));
    std::vector<gpu::ExpertGrads> g(experts.size());
    for (std::size_t i = 0; i < experts.size(); ++i) {
      const DenseMlpGrads& ge = *experts[i].g;
      g[i] = {static_cast<float*>(ge.w1.data), static_cast<float*>(ge.b1.data),
              static_cast<float*>(ge.w2.data), static_cast<float*>(ge.b2.data)};
    }
    gpu::groupedExpertBackward(ctx.space().cuda_stream(), c.w, g, c.rows, as<gpu::bf16>(x.data),
                               as<gpu::bf16>(pre.data), as<gpu::bf16>(act.data),
                               as<gpu::bf16>(dy.data), static_cast<gpu::bf16*>(dpre.data),
                               static_cast<gpu::bf16*>(dx.data), static_cast<int>(x.cols),
                               static_cast<int>(pre.cols), c.workspace, c.bytes);
    ctx.mark(OpKind::Gemm);
    return;
  }
#else
  (void)mode;
#endif
  std::int64_t o = 0;
  for (const auto& e : experts) {
    if (e.rows > 0) {
      linearBackwardGelu(ctx, rowsOf(act, o, e.rows), e.w->w2, rowsOf(dy, o, e.rows),
                         rowsOf(pre, o, e.rows), rowsOf(dpre, o, e.rows), e.g->w2, e.g->b2);
      linearBackward(ctx, rowsOf(x, o, e.rows), e.w->w1, rowsOf(dpre, o, e.rows),
                     rowsOf(dx, o, e.rows), false, e.g->w1, e.g->b1);
    }
    o += e.rows;
  }
}

}  // namespace plm::model
