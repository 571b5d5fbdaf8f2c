// End-to-end bf16 training throughput of ESM-2 on one GPU: plm::model::Esm2<float> with the bf16
// precision policy holds the fp32 master parameters and gradients and runs forward + backward
// through its dispatch points in bf16, and the fused AdamW (fp32 masters and moments, global-norm
// clipping) updates them; one optimizer step per micro-batch.  Batches are packed (THD) with
// ESM-2-like lengths (doc/anchors.md section 6: exp(N(0,1)*0.7 + ln 300) clamped to [30, 1024],
// specials included), 15% of residues labelled. Reports real tokens/s (every token is real: no
// padding), model TFLOP/s, MFU against the measured 779 TFLOP/s BF16 GEMM ceiling and against 989,
// peak device memory, and the loss.
//
// Also times a forward-only pass (evaluation) over the same batches.
//
//   bench_gpu_train PRESET [tokens_per_micro_batch] [steps] [none|layer|selective] [KEY=VALUE...]
//   PLM_PRECISION=fp8 [PLM_FP8_RECIPE=delayed|current|block] times the FP8 policy (doc/fp8.md); the
//   step then ends with Esm2::endFp8Step, as in training.  KEY=VALUE sets one of the deck's kernel
//   keys as `plm train --set` would: train.attention=auto|cudnn|cudnn-fwd|flash,
//   train.deterministic=true|false, fp8.fused_cast=true|false, train.gemm_autotune=true|false,
//   train.gemm_split=off|splitk|streamk
//   (tuned in the warm-up steps, cached in memory only).
#include "core/error.hpp"
#include "data/synthetic.hpp"
#include "dist/runtime.hpp"
#include "gpu/fused.hpp"
#include "gpu/gemm.hpp"
#include "model/esm2.hpp"

#include "bench_util.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

namespace {

using namespace plm;

int run(int argc, char** argv) {
  const std::string preset = argc > 1 ? argv[1] : "esm2_8m";
  const std::int64_t budget = argc > 2 ? std::atoll(argv[2]) : 24576;
  const int steps = argc > 3 ? std::atoi(argv[3]) : 20;
  const int warmup = std::min(5, steps / 2);

  auto config = model::Esm2Config::preset(preset);
  config.precision = model::Precision::Bf16;
  if (const char* p = std::getenv("PLM_PRECISION"); p && *p)
    config.precision = model::parsePrecision(p);
  if (const char* r = std::getenv("PLM_FP8_RECIPE"); r && *r)
    config.fp8.recipe = model::parseFp8Recipe(r);
  if (argc > 4) config.recompute = model::parseRecompute(argv[4]);
  auto flag = [](const std::string& key, const std::string& v) {
    if (v == "true" || v == "1") return true;
    if (v == "false" || v == "0") return false;
    throw Error(key + "=" + v + ": expected true or false");
  };
  for (int i = 5; i < argc; ++i) {
    const std::string arg = argv[i];
    const std::size_t eq = arg.find('=');
    const std::string key = arg.substr(0, eq),
                      value = eq == std::string::npos ? "" : arg.substr(eq + 1);
    if (key == "train.attention")
      config.attention = model::parseAttentionKernel(value);
    else if (key == "train.deterministic")
      config.deterministic = flag(key, value);
    else if (key == "fp8.fused_cast")
      config.fp8.fused_cast = flag(key, value);
    else if (key == "train.gemm_autotune")
      gpu::setGemmAutotune(flag(key, value));
    else if (key == "train.gemm_split")
      gpu::setGemmSplit(gpu::parseGemmSplit(value));
    else
      throw Error("bench_gpu_train: unknown argument `" + arg +
                  "`; use train.attention=, train.deterministic=, fp8.fused_cast=, "
                  "train.gemm_autotune= or train.gemm_split=");
  }
  model::Esm2<float> model(config);
  model.initialize(1);
  gpu::Stream stream = Kokkos::Cuda().cuda_stream();

  const std::int64_t n = model.parameters().extent(0);
  float *m = nullptr, *v = nullptr;
  double* sumsq = nullptr;
  PLM_CHECK_CUDA(cudaMalloc(&m, n * 4));
  PLM_CHECK_CUDA(cudaMalloc(&v, n * 4));
  PLM_CHECK_CUDA(cudaMalloc(&sumsq, 8));
  PLM_CHECK_CUDA(cudaMemset(m, 0, n * 4));
  PLM_CHECK_CUDA(cudaMemset(v, 0, n * 4));
  std::vector<std::int64_t> seg;
  std::vector<std::uint8_t> decay;
  for (const auto& t : model.tensors()) {
    seg.push_back(t.offset);
    decay.push_back(t.weight_decay);
  }
  seg[0] = 0;
  seg.push_back(n);
  std::int64_t* seg_d = nullptr;
  std::uint8_t* decay_d = nullptr;
  PLM_CHECK_CUDA(cudaMalloc(&seg_d, seg.size() * 8));
  PLM_CHECK_CUDA(cudaMalloc(&decay_d, decay.size()));
  PLM_CHECK_CUDA(cudaMemcpy(seg_d, seg.data(), seg.size() * 8, cudaMemcpyHostToDevice));
  PLM_CHECK_CUDA(cudaMemcpy(decay_d, decay.data(), decay.size(), cudaMemcpyHostToDevice));

  std::vector<data::MicroBatch> batches;
  for (int i = 0; i < 8; ++i)
    batches.push_back(data::syntheticBatch(data::esmLikeLengths(budget, 2026 + i), 2026 + i));
  Kokkos::fence();

  double tokens = 0, flops = 0, seconds = 0, fb_seconds = 0, loss = 0;
  for (int it = 0; it < steps; ++it) {
    const auto& b = batches[it % batches.size()];
    double sq = 0, len = 0;
    for (int s = 0; s < b.numSequences(); ++s) {
      double l = b.cu_seqlens(s + 1) - b.cu_seqlens(s);
      sq += l * l;
      len += l;
    }
    auto t0 = WallClock::now();
    PLM_CHECK_CUDA(cudaMemsetAsync(model.gradients().data(), 0, n * 4, stream));
    double loss_sum = model.forwardBackward(b, 1.0 / b.num_masked);
    auto t1 = WallClock::now();
    PLM_CHECK_CUDA(cudaMemsetAsync(sumsq, 0, 8, stream));
    gpu::sumSquares(stream, model.gradients().data(), n, sumsq);
    gpu::AdamWParams p;
    p.lr = 4e-4f;
    p.beta1 = 0.9f;
    p.beta2 = 0.98f;
    p.eps = 1e-8f;
    p.weight_decay = 0.01f;
    p.step = it + 1;
    p.grad_scale = 1.0f;  // the loss was already scaled by 1 / masked tokens
    p.max_norm = 1.0f;
    p.grad_sumsq = sumsq;
    gpu::adamwStep(stream, model.parameters().data(), model.gradients().data(), m, v, nullptr, n,
                   seg_d, decay_d, static_cast<int>(decay.size()), p);
    model.endFp8Step(MPI_COMM_NULL);  // fp8: the step's amaxes into new scales
    PLM_CHECK_CUDA(cudaStreamSynchronize(stream));
    auto t2 = WallClock::now();
    loss = loss_sum / b.num_masked;
    if (it < 3 || it == steps - 1)
      std::printf("  step %d: loss %.4f, %ld tokens\n", it, loss, long(b.numTokens()));
    if (it >= warmup) {
      tokens += b.numTokens();
      flops += b.numTokens() * config.trainFlopsPerToken(sq / len);
      seconds += secondsBetween(t0, t2);
      fb_seconds += secondsBetween(t0, t1);
    }
  }
  // Where the time of one micro-batch's forward + backward goes (events after every launch).
  model.setProfiling(true);
  const int prof_steps = 3;
  double prof_tokens = 0;
  for (int it = 0; it < prof_steps; ++it) {
    const auto& b = batches[it % batches.size()];
    prof_tokens += b.numTokens();
    model.forwardBackward(b, 1.0 / b.num_masked);
  }
  const auto breakdown = model.profile();
  double prof_total = 0;
  for (const auto& [kind, ms] : breakdown) prof_total += ms;
  std::printf(
      "  breakdown of forward+backward (%s, %.0f tokens/micro-batch), ms per micro-batch:\n",
      preset.c_str(), prof_tokens / prof_steps);
  for (const auto& [kind, ms] : breakdown)
    std::printf("    %-18s %8.2f ms  %5.1f%%\n", kind.c_str(), ms / prof_steps,
                100 * ms / prof_total);
  model.setProfiling(false);

  // Forward only (what validation, plm eval and plm embed run), same batches and precision.
  double eval_tokens = 0, eval_seconds = 0;
  model.refreshComputeWeights();
  for (int it = 0; it < steps; ++it) {
    const auto& b = batches[it % batches.size()];
    auto t0 = WallClock::now();
    model.forward(b, nullptr, false);
    auto t1 = WallClock::now();
    if (it >= warmup) {
      eval_tokens += b.numTokens();
      eval_seconds += secondsBetween(t0, t1);
    }
  }
  std::size_t peak_free = 0, peak_total = 0;
  PLM_CHECK_CUDA(cudaMemGetInfo(&peak_free, &peak_total));

  std::size_t free_b = 0, total_b = 0;
  PLM_CHECK_CUDA(cudaMemGetInfo(&free_b, &total_b));
  const double tok_s = tokens / seconds, tflops = flops / seconds / 1e12;
  std::printf("EVAL %s recompute %s: forward-only %.0f tokens/s\n", preset.c_str(),
              model::recomputeName(config.recompute), eval_tokens / eval_seconds);
  std::printf(
      "RESULT %s params %.1fM tokens/micro-batch %ld: %.0f tokens/s, %.1f TFLOP/s, "
      "MFU %.1f%% of 779 / %.1f%% of 989, fwd+bwd %.1f%% of step, device memory in use "
      "%.1f GiB (workspace %.1f GiB, recompute %s, attention %s%s), final loss %.3f\n",
      preset.c_str(), config.numParameters() / 1e6, long(budget), tok_s, tflops, 100 * tflops / 779,
      100 * tflops / 989, 100 * fb_seconds / seconds, (total_b - free_b) / double(1 << 30),
      model.workspaceBytes() / double(1 << 30), model::recomputeName(config.recompute),
      model::attentionKernelName(
          model::attentionKernelFor(model.context(), config.hidden / config.heads)),
      model.context().deterministic ? "" : " non-deterministic", loss);
  if (config.precision == model::Precision::Fp8)
    std::printf(
        "FP8 %s recipe %s: %.1f TFLOP/s = MFU %.1f%% of the 1454 TFLOP/s FP8 GEMM ceiling\n",
        preset.c_str(), model::fp8RecipeName(config.fp8.recipe), tflops, 100 * tflops / 1454);
  cudaFree(m);
  cudaFree(v);
  cudaFree(sumsq);
  cudaFree(seg_d);
  cudaFree(decay_d);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  plm::dist::Runtime runtime(argc, argv);
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_gpu_train: %s\n", e.what());
    return 1;
  }
}
