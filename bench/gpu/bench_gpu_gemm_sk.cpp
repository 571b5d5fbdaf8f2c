// Split-K and stream-K against cuBLASLt's heuristic first choice on the bf16 GEMMs of one
// encoder layer of ESM-2 650M (hidden 1280, FFN 5120) and 3B (2560, 10240) at T tokens per
// micro-batch, in the bf16 model's layouts and epilogues (as bench_gpu_gemm_tune): forward
// Y = X W^T + b (GELU fused into FFN up), dgrad dX = dY W (dGELU fused into FFN down's), wgrad
// dW += dY^T X in fp32 with the bias gradient.  Per GEMM (Gemm::splitKReport, each timed as the
// mean of 5 after a warm-up): heuristic #0; the train.gemm_split rule's choice; the fastest
// cuBLASLt split-K variant per split count (from the heuristic's first 4 candidates; BGradA
// either with the epilogue or, marked "+pass", without it and the bias gradient by a separate
// pass); CUTLASS's stream-K kernel (weight gradients, where built); the winner; and the largest
// |difference| of each one's D (and bias gradient) from heuristic #0's, run once from the same
// D, relative to max |D|.  Split-K applies to the epilogue-free and bias-gradient GEMMs only.
//
//   bench_gpu_gemm_sk [--no-streamk] [T ...]      (default: 16384 32768)
//   --no-streamk leaves CUTLASS's kernel out (the stage's rerun should it fail).
//
// RESULT lines, one per model and T: the layer's 12 GEMMs in ms under heuristic #0, the rule,
// and the fastest candidate of each GEMM, and the worst relative difference seen.
#include "gpu/gemm.hpp"

#include "bench_util.hpp"
#include "core/error.hpp"
#include "layer_gemms.hpp"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace {

using namespace plm::gpu;

struct Totals {
  double flops = 0, heuristic_ms = 0, rule_ms = 0, best_ms = 0, worst_rel = 0;
  bool complete = true;
};

std::string rowName(const Gemm::SplitKRow& r) {
  if (r.streamk) return "streamK";
  std::string s = r.splits == 1 ? "#0" : "s" + std::to_string(r.splits);
  if (r.bias_pass) s += "+pass";
  return s;
}

void benchOne(Gemm& gemm, const char* label, GemmArgs a, Totals& totals) {
  GemmOperands ops(a);
  if (a.d_type == DType::F32)
    fillF(ops.D, a.m * a.n, 1.0f, 5);
  else
    fill(ops.D, a.m * a.n, 1.0f, 5);
  const double flops = 2.0 * a.m * a.n * a.k;
  Gemm::SplitKReport r;
  try {
    r = gemm.splitKReport(nullptr, a);
  } catch (const plm::Error& e) {
    std::printf("  %-16s refused: %s\n", label, e.what());
    totals.complete = false;
    return;
  }
  if (r.rows.empty() || r.rows[0].ms <= 0) {
    std::printf("  %-16s %6ld %6ld %6ld  not timed\n", label, long(a.m), long(a.n), long(a.k));
    totals.complete = false;
    return;
  }
  const Gemm::SplitKRow& h = r.rows[0];
  const Gemm::SplitKRow* rule = nullptr;
  const Gemm::SplitKRow* best = &h;
  for (const auto& row : r.rows) {
    if (row.rule) rule = &row;
    if (row.ms > 0 && row.ms < best->ms) best = &row;
  }
  auto tf = [&](double ms) { return ms > 0 ? flops / ms / 1e9 : 0.0; };
  const double rule_ms = rule && rule->ms > 0 ? rule->ms : h.ms;
  std::string rule_text = rule ? rowName(*rule) : "-";
  std::printf("  %-16s %6ld %6ld %6ld  %7.1f  %-9s %7.1f  %-9s %7.1f  %5.2fx\n", label, long(a.m),
              long(a.n), long(a.k), tf(h.ms), rule_text.c_str(), tf(rule_ms),
              rowName(*best).c_str(), tf(best->ms), h.ms / best->ms);
  if (r.rows.size() > 1) {
    std::string line = "      ";
    double worst = 0, worst_bias = 0;
    for (std::size_t i = 1; i < r.rows.size(); ++i) {
      const auto& row = r.rows[i];
      char buf[96];
      std::snprintf(buf, sizeof(buf), "%s%s %.0f  ", row.rule ? "rule:" : "", rowName(row).c_str(),
                    tf(row.ms));
      line += buf;
      if (row.max_diff >= 0) worst = std::max(worst, row.max_diff);
      if (row.max_bias_diff >= 0) worst_bias = std::max(worst_bias, row.max_bias_diff);
    }
    const double rel = r.ref_max > 0 ? worst / r.ref_max : worst;
    // fp32 outputs: both sides accumulate in fp32, only the summation order differs; bf16
    // outputs differ by a rounding of the last place at most.
    const double tol = a.d_type == DType::F32 ? 1e-4 : 1e-2;
    std::printf("%s\n      max |dD| %.3g (%.2g of max |D| %.3g)%s, max |d bias grad| %.3g\n",
                line.c_str(), worst, rel, r.ref_max, rel > tol ? "  ** ABOVE TOLERANCE **" : "",
                worst_bias);
    totals.worst_rel = std::max(totals.worst_rel, rel);
  }
  std::fflush(stdout);
  totals.flops += flops;
  totals.heuristic_ms += h.ms;
  totals.rule_ms += rule_ms;
  totals.best_ms += best->ms;
}

void layerTable(Gemm& gemm, const char* model, std::int64_t C, std::int64_t F, std::int64_t T) {
  std::printf(
      "\n%s, T = %ld tokens: TFLOP/s  M      N      K    heur #0  rule        TFLOP/s  "
      "fastest     TFLOP/s  speed-up\n",
      model, long(T));
  Totals totals;
  for (LayerGemm& g : layerGemms(C, F, T)) benchOne(gemm, g.label.c_str(), g.args, totals);
  if (!totals.complete) {
    std::printf("  layer total: incomplete\n");
    return;
  }
  std::printf(
      "  layer (12 GEMMs): heuristic #0 %.3f ms (%.1f TFLOP/s), rule %.3f ms (%.1f, %.3fx), "
      "fastest %.3f ms (%.1f, %.3fx)\n",
      totals.heuristic_ms, totals.flops / totals.heuristic_ms / 1e9, totals.rule_ms,
      totals.flops / totals.rule_ms / 1e9, totals.heuristic_ms / totals.rule_ms, totals.best_ms,
      totals.flops / totals.best_ms / 1e9, totals.heuristic_ms / totals.best_ms);
  std::printf(
      "RESULT gemm_sk model=%s T=%ld layer_ms heuristic=%.3f rule=%.3f fastest=%.3f "
      "speedup rule=%.3f fastest=%.3f worst_rel_diff=%.2g\n",
      model, long(T), totals.heuristic_ms, totals.rule_ms, totals.best_ms,
      totals.heuristic_ms / totals.rule_ms, totals.heuristic_ms / totals.best_ms, totals.worst_rel);
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::int64_t> tokens;
  bool streamk = true;
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--no-streamk")
      streamk = false;
    else
      tokens.push_back(std::atoll(argv[i]));
  }
  setGemmStreamKAllowed(streamk);
  if (tokens.empty()) tokens = {16384, 32768};
  cudaDeviceProp prop{};
  PLM_CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf(
      "bench_gpu_gemm_sk on %s (%d SMs): bf16 GEMMs, cuBLASLt heuristic #0 vs split-K (rule and "
      "variants) and CUTLASS stream-K (%s)\n",
      prop.name, prop.multiProcessorCount,
      !gemmStreamKCompiled() ? "not in this build"
      : streamk              ? "built"
                             : "left out");
  Gemm gemm;
  {
    GemmArgs a;
    a.m = a.n = a.k = 8192;
    a.trans_b = true;
    a.lda = a.ldb = 8192;
    Totals ref;
    std::printf("\nreference                 M      N      K    heur #0\n");
    benchOne(gemm, "8192^3 bf16 NT", a, ref);
  }
  for (std::int64_t T : tokens) {
    layerTable(gemm, "650M", 1280, 5120, T);
    layerTable(gemm, "3B", 2560, 10240, T);
  }
  return 0;
}
