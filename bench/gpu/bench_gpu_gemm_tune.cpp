// cuBLASLt's heuristic first choice against the autotuned choice (train.gemm_autotune: the
// fastest of its first 8 candidates, timed) on the bf16 GEMMs of one encoder layer of ESM-2
// 650M (hidden 1280, FFN 5120) and 3B (2560, 10240) at T tokens per micro-batch: each Linear
// (QKV, attention out, FFN up, FFN down) in its three GEMMs with the layouts and epilogues of
// the bf16 model (forward Y = X W^T + b, GELU fused into FFN up; dgrad dX = dY W, dGELU fused
// into FFN down's; wgrad dW += dY^T X in fp32 with the bias gradient), next to an 8192^3 bf16
// reference.  Then the LayerNorm kernels' achieved bandwidth (compulsory bytes / time) against a
// device-to-device copy's, at 16k x 1280, 16k x 2560, 8k x 5120 and 32k x 2560, x fp32 and bf16.
// Gemm::tune times every candidate on scratch outputs (mean of 5 after a warm-up).
//
//   bench_gpu_gemm_tune [T ...]      (default: 16384 32768)
//   bench_gpu_gemm_tune --layernorm  (the LayerNorm table only)
#include "gpu/gemm.hpp"
#include "gpu/layer_norm.hpp"

#include "bench_util.hpp"
#include "core/error.hpp"
#include "layer_gemms.hpp"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <type_traits>
#include <vector>

namespace {

using namespace plm::gpu;

struct Totals {
  double flops = 0, heuristic_ms = 0, tuned_ms = 0;
  bool complete = true;
};

// One GEMM: prints M N K, TFLOP/s of the heuristic's first choice and of the tuned one.
void benchOne(Gemm& gemm, const char* label, GemmArgs a, Totals& totals) {
  GemmOperands ops(a);
  PLM_CHECK_CUDA(cudaMemset(ops.D.ptr, 0, a.m * a.n * 4));
  const double flops = 2.0 * a.m * a.n * a.k;
  Gemm::TuneResult r;
  try {
    r = gemm.tune(nullptr, a);
  } catch (const plm::Error& e) {
    std::printf("  %-22s refused: %s\n", label, e.what());
    totals.complete = false;
    return;
  }
  if (r.heuristic_ms <= 0 || r.tuned_ms <= 0) {
    std::printf("  %-22s %6ld %6ld %6ld  not timed (heuristic %.3f ms, %d candidates)\n", label,
                long(a.m), long(a.n), long(a.k), r.heuristic_ms, r.candidates);
    totals.complete = false;
    return;
  }
  totals.flops += flops;
  totals.heuristic_ms += r.heuristic_ms;
  totals.tuned_ms += r.tuned_ms;
  std::printf("  %-22s %6ld %6ld %6ld  %7.1f (%7.3f)  %7.1f (%7.3f) #%d/%d  %5.2fx\n", label,
              long(a.m), long(a.n), long(a.k), flops / r.heuristic_ms / 1e9, r.heuristic_ms,
              flops / r.tuned_ms / 1e9, r.tuned_ms, r.tuned_index, r.candidates,
              r.heuristic_ms / r.tuned_ms);
  std::fflush(stdout);
}

void layerTable(Gemm& gemm, const char* model, std::int64_t C, std::int64_t F, std::int64_t T) {
  std::printf(
      "\n%s, T = %ld tokens: TFLOP/s (ms)       M      N      K    heuristic #0"
      "        tuned            speed-up\n",
      model, long(T));
  Totals totals;
  for (LayerGemm& g : layerGemms(C, F, T)) benchOne(gemm, g.label.c_str(), g.args, totals);
  if (!totals.complete) {
    std::printf("  layer total: incomplete\n");
    return;
  }
  std::printf("  %-43s %7.1f (%7.3f)  %7.1f (%7.3f)         %5.2fx\n", "layer total (12 GEMMs)",
              totals.flops / totals.heuristic_ms / 1e9, totals.heuristic_ms,
              totals.flops / totals.tuned_ms / 1e9, totals.tuned_ms,
              totals.heuristic_ms / totals.tuned_ms);
  std::printf(
      "RESULT gemm_tune model=%s T=%ld layer_ms heuristic=%.3f tuned=%.3f "
      "tflops heuristic=%.1f tuned=%.1f\n",
      model, long(T), totals.heuristic_ms, totals.tuned_ms,
      totals.flops / totals.heuristic_ms / 1e9, totals.flops / totals.tuned_ms / 1e9);
}

void reference(Gemm& gemm) {
  const std::int64_t s = 8192;
  GemmArgs a;
  a.m = a.n = a.k = s;
  a.trans_b = true;
  a.lda = a.ldb = s;
  Totals totals;
  std::printf(
      "\nreference                              M      N      K    heuristic #0"
      "        tuned            speed-up\n");
  benchOne(gemm, "8192^3 bf16 NT", a, totals);
}

// Device-to-device copy bandwidth (bytes read + written / time) of 1 GiB.
double copyGBs() {
  const std::size_t bytes = std::size_t(1) << 30;
  Buffer src(bytes), dst(bytes);
  PLM_CHECK_CUDA(cudaMemset(src.ptr, 1, bytes));
  return 2.0 * bytes / copyMs(dst, src, bytes) / 1e6;
}

// One LayerNorm shape (T rows of C) with x in TX: forward (y bf16 written, mean and rstd
// written) and backward.  With fp32 x (the model's residual-stream LayerNorms) the backward runs
// in residual mode (bf16 dy, fp32 residual gradient read and written, bf16 copy written); with
// bf16 x (the final and head LayerNorms) in plain mode (bf16 dy, bf16 dx written).  Bytes are
// the compulsory traffic, each tensor once: forward x + y + mean/rstd + gamma/beta; backward
// dy + x + mean/rstd + gamma (+ residual read and write) + dx; the per-block dgamma/dbeta
// partials (a few MB) are not counted.  Each time is the median of 15 runs of 10 back-to-back
// calls (as a training step issues them), divided by 10.
template <class TX> void layerNormRow(std::int64_t C, std::int64_t T, double copy) {
  constexpr bool f32 = std::is_same_v<TX, float>;
  constexpr double bx = sizeof(TX);
  Buffer x(T * C * sizeof(TX)), y(T * C * 2), dy(T * C * 2), dx(T * C * 2), res(T * C * 4),
      gamma(C * 4), beta(C * 4), mean(T * 4), rstd(T * 4), dg(C * 4), db(C * 4),
      work(layerNormBackwardWorkspace(T, static_cast<int>(C)));
  if constexpr (f32)
    fillF(x, T * C, 2.0f, 7);
  else
    fill(x, T * C, 2.0f, 7);
  fill(dy, T * C, 1.0f, 8);
  fillF(gamma, C, 1.0f, 9);
  fillF(beta, C, 1.0f, 10);
  fillF(res, T * C, 1.0f, 11);
  PLM_CHECK_CUDA(cudaMemset(dg.ptr, 0, C * 4));
  PLM_CHECK_CUDA(cudaMemset(db.ptr, 0, C * 4));
  const double n = static_cast<double>(T * C), rows = static_cast<double>(T);
  constexpr int reps = 10;
  const double f = medianMsPerCall(
      [&] {
        layerNormForward(nullptr, x.as<TX>(), gamma.as<float>(), beta.as<float>(), y.as<bf16>(),
                         mean.as<float>(), rstd.as<float>(), T, static_cast<int>(C), 1e-5f);
      },
      reps);
  const double f_bytes = (bx + 2.0) * n + 8.0 * rows + 8.0 * C;
  const double f_gbs = f_bytes / f / 1e6;
  const double b = medianMsPerCall(
      [&] {
        layerNormBackward(nullptr, dy.as<bf16>(), x.as<TX>(), gamma.as<float>(), mean.as<float>(),
                          rstd.as<float>(), f32 ? res.as<float>() : nullptr, true, dx.as<bf16>(),
                          dg.as<float>(), db.as<float>(), T, static_cast<int>(C), work.as<void>());
      },
      reps);
  const double b_bytes = (2.0 + bx + (f32 ? 8.0 : 0.0) + 2.0) * n + 8.0 * rows + 4.0 * C;
  const double b_gbs = b_bytes / b / 1e6;
  const char* in = f32 ? "fp32" : "bf16";
  std::printf("  layernorm fwd  (%6ld x %5ld, x %s)  %8.4f ms  %6.0f GB/s  %5.1f%% of copy\n",
              long(T), long(C), in, f, f_gbs, 100.0 * f_gbs / copy);
  std::printf("  layernorm bwd  (%6ld x %5ld, x %s)  %8.4f ms  %6.0f GB/s  %5.1f%% of copy\n",
              long(T), long(C), in, b, b_gbs, 100.0 * b_gbs / copy);
  std::printf(
      "RESULT layernorm C=%ld T=%ld x=%s fwd_gbs=%.0f fwd_pct=%.1f bwd_gbs=%.0f bwd_pct=%.1f "
      "copy_gbs=%.0f\n",
      long(C), long(T), in, f_gbs, 100.0 * f_gbs / copy, b_gbs, 100.0 * b_gbs / copy, copy);
}

// ESM-2 650M, 3B and 15B hidden sizes at 8k to 32k tokens.
void layerNormTable() {
  const double copy = copyGBs();
  std::printf(
      "\nLayerNorm bandwidth (compulsory bytes / time, 10 back-to-back calls); device copy %.0f "
      "GB/s\n",
      copy);
  const std::int64_t shapes[][2] = {{16384, 1280}, {16384, 2560}, {8192, 5120}, {32768, 2560}};
  for (const auto& s : shapes) layerNormRow<float>(s[1], s[0], copy);
  for (const auto& s : shapes) layerNormRow<bf16>(s[1], s[0], copy);
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::int64_t> tokens;
  bool layernorm_only = false;
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--layernorm")
      layernorm_only = true;
    else
      tokens.push_back(std::atoll(argv[i]));
  }
  if (tokens.empty()) tokens = {16384, 32768};
  cudaDeviceProp prop{};
  PLM_CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  if (layernorm_only) {
    std::printf("bench_gpu_gemm_tune --layernorm on %s\n", prop.name);
    layerNormTable();
    return 0;
  }
  std::printf(
      "bench_gpu_gemm_tune on %s: bf16 GEMMs, cuBLASLt heuristic #0 vs the fastest of "
      "its first 8 candidates\n",
      prop.name);
  Gemm gemm;
  reference(gemm);
  for (std::int64_t T : tokens) {
    layerTable(gemm, "650M", 1280, 5120, T);
    layerTable(gemm, "3B", 2560, 10240, T);
  }
  layerNormTable();
  return 0;
}
