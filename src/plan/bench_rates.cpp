// `plm bench rates`: measures a rates table (rates.hpp) with the model's own dispatch points in
// the build's fp32 arithmetic: the whole `cpu` table in a CPU build, the fp32 figures of the
// portable path in a CUDA build (the bf16 figures there come from bench_gpu, doc/plan.md).
//
// Design choice: the size-dependent rates are fitted, not read off one size: 1/R is linear in
// 1/k for R(k) = A k / (k + k_half), so a least-squares line through the measured (1/k, 1/R)
// gives the asymptote A and the half-rate size k_half the planner uses.
#include "plan/bench_rates.hpp"

#include "core/error.hpp"
#include "model/ops.hpp"
#include "train/optim/adamw.hpp"

#include <Kokkos_Core.hpp>

#include <unistd.h>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <vector>

namespace plm::plan {

namespace {

using Clock = std::chrono::steady_clock;
using model::DType;
using model::Mat;
using model::Vec;

// Mean seconds of `op` after one warm-up call, repeated for at least `seconds` and 3 times.
template <class F> double timeOf(const ExecSpace& space, double seconds, F&& op) {
  op();
  space.fence();
  int reps = 0;
  const auto t0 = Clock::now();
  double elapsed = 0;
  do {
    op();
    space.fence();
    ++reps;
    elapsed = std::chrono::duration<double>(Clock::now() - t0).count();
  } while (reps < 3 || elapsed < seconds);
  return elapsed / reps;
}

View1<float> filled(std::int64_t n, float value) {
  View1<float> v("plm::plan::bench", n);
  Kokkos::deep_copy(v, value);
  return v;
}

Mat mat(const View1<float>& v, std::int64_t rows, std::int64_t cols) {
  return Mat{v.data(), DType::F32, rows, cols, cols};
}
Vec vec(const View1<float>& v, std::int64_t n) { return Vec{v.data(), DType::F32, n}; }

}  // namespace

std::pair<double, double> fitSaturating(const std::vector<double>& k,
                                        const std::vector<double>& r) {
  const double n = static_cast<double>(k.size());
  double sx = 0, sy = 0, sxx = 0, sxy = 0;
  for (std::size_t i = 0; i < k.size(); ++i) {
    const double x = 1 / k[i], y = 1 / r[i];
    sx += x;
    sy += y;
    sxx += x * x;
    sxy += x * y;
  }
  const double b = (n * sxy - sx * sy) / (n * sxx - sx * sx);
  const double a = (sy - b * sx) / n;
  if (!(a > 0) || !(b >= 0)) {  // noise: no size dependence visible; take the best rate
    double best = 0;
    for (double x : r) best = std::max(best, x);
    return {best, 0.0};
  }
  return {1 / a, b / a};
}

Rates measureRates(const Rates& base, double seconds, const std::function<void(std::string)>& say) {
  const ExecSpace space;
  model::OpContext ctx(space);
  Rates r = base;
  char text[256];

  // GEMMs: y = x W^T + b with x (t, k), W (k, k): 2 t k^2 FLOPs.
  const std::int64_t t = 2048;
  std::vector<double> ks, gemm_rates;
  for (std::int64_t k : {64, 128, 256, 512}) {
    auto x = filled(t * k, 0.01f), w = filled(k * k, 0.02f), b = filled(k, 0), y = filled(t * k, 0);
    const double s = timeOf(space, seconds, [&] {
      model::linear(ctx, mat(x, t, k), mat(w, k, k), vec(b, k), mat(y, t, k));
    });
    ks.push_back(static_cast<double>(k));
    gemm_rates.push_back(2.0 * t * k * k / s / 1e12);
    std::snprintf(text, sizeof text, "GEMM (%lld x %lld) x (%lld x %lld): %.4g TFLOP/s",
                  static_cast<long long>(t), static_cast<long long>(k), static_cast<long long>(k),
                  static_cast<long long>(k), gemm_rates.back());
    say(text);
  }
  const auto [gemm_a, gemm_half] = fitSaturating(ks, gemm_rates);
  r.gemm_tflops_fp32 = gemm_a;
  r.gemm_half_k = gemm_half;
  if (r.kind == "cpu") {  // fp32 arithmetic only
    r.gemm_tflops_bf16 = r.gemm_tflops_fp8 = r.gemm_tflops_fp8_block = gemm_a;
    r.gemm_half_k_fp8 = gemm_half;
  }

  // Attention: 8 sequences of 128 tokens, 4 heads of d, forward + backward; model FLOPs
  // 12 h S per token (doc/flops.md) with S = 128.
  const int seqs = 8, len = 128, heads = 4;
  const std::int64_t tokens = seqs * len;
  View1<seqlen_t> cu("plm::plan::bench_cu", seqs + 1);
  Kokkos::parallel_for(
      "plm::plan::bench_cu", Kokkos::RangePolicy<ExecSpace>(space, 0, seqs + 1),
      KOKKOS_LAMBDA(const int i) { cu(i) = static_cast<seqlen_t>(i * len); });
  model::DeviceBatch batch;
  batch.tokens = tokens;
  batch.num_seqs = seqs;
  batch.max_seqlen = len;
  batch.cu_seqlens = cu;
  std::vector<double> ds, attn_rates;
  for (int d : {16, 32, 64}) {
    const std::int64_t h = std::int64_t(heads) * d;
    auto q = filled(tokens * h, 0.1f), k = filled(tokens * h, 0.1f), v = filled(tokens * h, 0.1f);
    auto o = filled(tokens * h, 0), lse = filled(tokens * heads, 0),
         dout = filled(tokens * h, 0.01f);
    auto delta = filled(tokens * heads, 0), dq = filled(tokens * h, 0), dk = filled(tokens * h, 0),
         dv = filled(tokens * h, 0);
    const model::Qkv qkv{mat(q, tokens, h), mat(k, tokens, h), mat(v, tokens, h)};
    const model::Qkv dqkv{mat(dq, tokens, h), mat(dk, tokens, h), mat(dv, tokens, h)};
    const double s = timeOf(space, seconds, [&] {
      model::attention(ctx, batch, qkv, heads, mat(o, tokens, h), mat(lse, tokens, heads));
      model::attentionBackward(ctx, batch, qkv, mat(o, tokens, h), mat(lse, tokens, heads),
                               mat(dout, tokens, h), heads, mat(delta, tokens, heads), dqkv);
    });
    ds.push_back(d);
    attn_rates.push_back(12.0 * h * len * tokens / s / 1e12);
    std::snprintf(text, sizeof text,
                  "attention forward + backward, head_dim %d, S %d: %.4g TFLOP/s (model FLOPs)", d,
                  len, attn_rates.back());
    say(text);
  }
  const auto [attn_a, attn_half] = fitSaturating(ds, attn_rates);
  r.attention_tflops = attn_a;
  r.attention_half_head_dim = attn_half;

  // LayerNorm forward + backward (residual mode) on (t, 256): (4 + 4) h + (12 + 8) h bytes per row.
  {
    const std::int64_t h = 256, rows = 4 * t;
    auto x = filled(rows * h, 0.5f), g = filled(h, 1), be = filled(h, 0), y = filled(rows * h, 0);
    auto mean = filled(rows, 0), rstd = filled(rows, 0), dy = filled(rows * h, 0.01f);
    auto dres = filled(rows * h, 0), dg = filled(h, 0), db = filled(h, 0);
    const double s = timeOf(space, seconds, [&] {
      model::layerNorm(ctx, mat(x, rows, h), vec(g, h), vec(be, h), 1e-5, mat(y, rows, h),
                       vec(mean, rows), vec(rstd, rows));
      model::layerNormBackward(ctx, mat(x, rows, h), vec(g, h), vec(mean, rows), vec(rstd, rows),
                               mat(dy, rows, h), mat(dres, rows, h), true, mat(dres, rows, h),
                               vec(dg, h), vec(db, h));
    });
    r.layernorm_gbps = static_cast<double>(rows) * 28 * h / s / 1e9;
    std::snprintf(text, sizeof text, "LayerNorm forward + backward (%lld x %lld): %.4g GB/s",
                  static_cast<long long>(rows), static_cast<long long>(h), r.layernorm_gbps);
    say(text);
  }
  // Elementwise: the GELU backward over (t, 1024) reads pre and dy, writes dx: 12 bytes each.
  {
    const std::int64_t n = 4 * t * 1024;
    auto pre = filled(n, 0.3f), dy = filled(n, 0.01f), dx = filled(n, 0);
    const double s = timeOf(space, seconds, [&] {
      model::geluBackward(ctx, mat(pre, n / 1024, 1024), mat(dy, n / 1024, 1024),
                          mat(dx, n / 1024, 1024));
    });
    r.elementwise_gbps = 12.0 * n / s / 1e9;
    if (r.kind == "cpu")  // the fp8 emulation's casts are elementwise passes too
      r.fp8_cast_gbps = r.fp8_block_cast_gbps = r.elementwise_gbps;
    std::snprintf(text, sizeof text, "elementwise (GELU backward, %lld elements): %.4g GB/s",
                  static_cast<long long>(n), r.elementwise_gbps);
    say(text);
  }
  // Optimizer: AdamW (28 bytes per parameter) and the gradient norm (4) over 8M parameters.
  {
    const std::int64_t n = 8 << 20;
    auto p = filled(n, 0.1f), grad = filled(n, 0.001f);
    model::TensorInfo info;
    info.name = "bench";
    info.shape = {n};
    info.size = n;
    info.weight_decay = true;
    train::AdamW<float> adam(p, {info}, train::AdamWOptions{});
    const double s = timeOf(space, seconds, [&] {
      (void)train::globalNorm(space, grad);
      adam.step(space, grad, 1e-6);
    });
    r.optimizer_gbps = 32.0 * n / s / 1e9;
    std::snprintf(text, sizeof text, "AdamW + gradient norm (%lld parameters): %.4g GB/s",
                  static_cast<long long>(n), r.optimizer_gbps);
    say(text);
  }
  // Launch cost: a LayerNorm of one 16-wide row, nearly no work.
  {
    auto x = filled(16, 0.5f), g = filled(16, 1), be = filled(16, 0), y = filled(16, 0);
    auto mean = filled(1, 0), rstd = filled(1, 0);
    const double s = timeOf(space, std::min(seconds, 0.05), [&] {
      for (int i = 0; i < 100; ++i)
        model::layerNorm(ctx, mat(x, 1, 16), vec(g, 16), vec(be, 16), 1e-5, mat(y, 1, 16),
                         vec(mean, 1), vec(rstd, 1));
    });
    r.launch_us = s / 100 * 1e6;
  }
  char host[256] = "?";
  gethostname(host, sizeof host - 1);
  std::time_t now = std::time(nullptr);
  char date[64];
  std::strftime(date, sizeof date, "%Y-%m-%d %H:%M UTC", std::gmtime(&now));
  r.source = std::string("plm bench rates on ") + host + ", " + date +
             " (fp32 through the model's dispatch points; memory, peak and links from the `" +
             base.kind + "` table)";
  return r;
}

}  // namespace plm::plan
