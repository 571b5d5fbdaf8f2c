// Attention at the small ESM-2 shapes (8M: 20 heads x 16, 35M: 20 x 24, 150M: 20 x 32) on one
// 65,536-token micro-batch of log-normal lengths (median 300, clamped to [1, 1024], fixed seed):
// the general (legacy) flash kernels, the default ones (the small-head_dim forward with the
// general backward; "small" below, the general kernels both ways under PLM_FLASH_LEGACY=1) and
// cuDNN (deterministic backward) in one run.  Forward, backward and both, median ms and
// effective TFLOP/s (forward 4 sum(L^2) D H, backward 2.5x), the largest difference of the
// default kernels' O, lse and gradients from the legacy ones', and one RESULT line per shape.
//
//   bench_gpu_attention [tokens] [--once]   (default 65536)
//
// --once runs each kernel set's forward and backward once per shape, untimed and unchecked: the
// launches a profiler (ncu) should see, without the timing loops' repetitions.
#include "gpu/cudnn_attention.hpp"
#include "gpu/flash_attention.hpp"

#include "attention_case.hpp"
#include "bench_util.hpp"
#include "core/error.hpp"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <random>
#include <string>
#include <vector>

namespace {

using namespace plm::gpu;

std::vector<int> drawLengths(std::int64_t tokens, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> z(0.0, 1.0);
  std::vector<int> v;
  std::int64_t sum = 0;
  while (sum < tokens) {
    int l = std::clamp(static_cast<int>(std::lround(std::exp(z(rng) * 0.7 + std::log(300.0)))), 1,
                       1024);
    l = static_cast<int>(std::min<std::int64_t>(l, tokens - sum));
    v.push_back(l);
    sum += l;
  }
  return v;
}

std::vector<float> downloadBf16(const void* p, std::size_t n) {
  std::vector<std::uint16_t> bits(n);
  PLM_CHECK_CUDA(cudaMemcpy(bits.data(), p, n * 2, cudaMemcpyDeviceToHost));
  std::vector<float> f(n);
  for (std::size_t i = 0; i < n; ++i) {
    std::uint32_t u = std::uint32_t(bits[i]) << 16;
    std::memcpy(&f[i], &u, 4);
  }
  return f;
}

std::vector<float> downloadF(const void* p, std::size_t n) {
  std::vector<float> f(n);
  PLM_CHECK_CUDA(cudaMemcpy(f.data(), p, n * 4, cudaMemcpyDeviceToHost));
  return f;
}

// max |a - b| / max |b|.
double relDiff(const std::vector<float>& a, const std::vector<float>& b) {
  double d = 0, m = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i]) || !std::isfinite(b[i])) {
      if (a[i] != b[i]) return INFINITY;
      continue;
    }
    d = std::max(d, std::abs(double(a[i]) - b[i]));
    m = std::max(m, std::abs(double(b[i])));
  }
  return m > 0 ? d / m : d;
}

void row(const char* what, double ms, double flops) {
  std::printf("  %-34s %9.3f ms  %7.1f TFLOP/s\n", what, ms, flops / ms / 1e9);
  std::fflush(stdout);
}

/// Each flash kernel set's forward and backward once (for a profiler).
void runOnce(const std::vector<int>& lengths, int heads, int dim) {
  const AttentionCase a(lengths, heads, dim, /*interleaved_grads=*/true);
  for (FlashParams::Kernels k : {FlashParams::Kernels::Legacy, FlashParams::Kernels::Auto}) {
    FlashParams q = a.p;
    q.kernels = k;
    flashAttentionForward(nullptr, q);
    flashAttentionBackward(nullptr, q);
  }
  PLM_CHECK_CUDA(cudaDeviceSynchronize());
}

void benchShape(const char* model, const std::vector<int>& lengths, int heads, int dim,
                CudnnAttention* cudnn) {
  // dq, dk, dv interleaved (T, 3, H, D) like q, k, v (cuDNN's backward needs the gradients at
  // q, k, v's strides).
  const AttentionCase a(lengths, heads, dim, /*interleaved_grads=*/true);
  const FlashParams& p = a.p;
  const std::int64_t tokens = a.tokens;
  const std::size_t n = a.n;
  const double sum_sq = a.sum_sq;
  const double fwd_flops = 4.0 * sum_sq * dim * heads, bwd_flops = 2.5 * fwd_flops;
  std::printf("%s: %zu sequences, %ld tokens, mean length %.0f, sum L^2 %.3g, H%d D%d\n", model,
              lengths.size(), long(tokens), double(tokens) / lengths.size(), sum_sq, heads, dim);

  auto timeFlash = [&](FlashParams::Kernels k, const char* name) {
    FlashParams q = p;
    q.kernels = k;
    const FwdBwdMs t = medianFwdBwdMs([&] { flashAttentionForward(nullptr, q); },
                                      [&] { flashAttentionBackward(nullptr, q); });
    std::string s = std::string(name) + " fwd";
    row(s.c_str(), t.f, fwd_flops);
    s = std::string(name) + " bwd";
    row(s.c_str(), t.b, bwd_flops);
    s = std::string(name) + " fwd+bwd";
    row(s.c_str(), t.fb, fwd_flops + bwd_flops);
    return t;
  };
  auto outputs = [&](FlashParams::Kernels k) {
    FlashParams q = p;
    q.kernels = k;
    flashAttentionForward(nullptr, q);
    flashAttentionBackward(nullptr, q);
    PLM_CHECK_CUDA(cudaDeviceSynchronize());
    return std::vector<std::vector<float>>{downloadBf16(a.o.ptr, n),
                                           downloadF(a.lse.ptr, tokens * heads),
                                           downloadBf16(a.dq.ptr, 3 * n)};
  };

  const FwdBwdMs legacy = timeFlash(FlashParams::Kernels::Legacy, "flash legacy");
  const FwdBwdMs small = timeFlash(FlashParams::Kernels::Auto, "flash small-d");
  FwdBwdMs cd;
  bool have_cudnn = false;
  try {
    have_cudnn = cudnn != nullptr && cudnn->forward(nullptr, p) && cudnn->backward(nullptr, p);
  } catch (const std::exception& e) {
    std::printf("  cudnn: %s\n", e.what());
  }
  if (have_cudnn) {
    cd = medianFwdBwdMs([&] { cudnn->forward(nullptr, p); }, [&] { cudnn->backward(nullptr, p); });
    row("cudnn fwd", cd.f, fwd_flops);
    row("cudnn bwd (deterministic)", cd.b, bwd_flops);
    row("cudnn fwd+bwd", cd.fb, fwd_flops + bwd_flops);
  } else {
    std::printf("  cudnn: not available for this shape/build\n");
  }

  const auto ref = outputs(FlashParams::Kernels::Legacy);
  const auto got = outputs(FlashParams::Kernels::Auto);
  const auto again = outputs(FlashParams::Kernels::Auto);
  const double d_o = relDiff(got[0], ref[0]), d_lse = relDiff(got[1], ref[1]),
               d_g = relDiff(got[2], ref[2]);
  const bool bitwise = got[2] == again[2];
  std::printf(
      "  small-d vs legacy: O %.2e  lse %.2e  dQKV %.2e (max |diff| / max |legacy|); "
      "backward rerun bitwise %s\n",
      d_o, d_lse, d_g, bitwise ? "equal" : "DIFFERENT");
  std::printf(
      "RESULT attention model=%s H=%d D=%d tokens=%ld fwd_ms legacy=%.3f small=%.3f "
      "cudnn=%.3f bwd_ms legacy=%.3f small=%.3f cudnn=%.3f fwdbwd_ms legacy=%.3f "
      "small=%.3f cudnn=%.3f speedup=%.2f small_tflops=%.1f diff_o=%.1e diff_grad=%.1e "
      "deterministic=%d\n",
      model, heads, dim, long(tokens), legacy.f, small.f, cd.f, legacy.b, small.b, cd.b, legacy.fb,
      small.fb, cd.fb, legacy.fb / small.fb, (fwd_flops + bwd_flops) / small.fb / 1e9, d_o, d_g,
      bitwise ? 1 : 0);
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const std::int64_t tokens = argc > 1 ? std::atoll(argv[1]) : 65536;
    const std::vector<int> lengths = drawLengths(tokens, 2026);
    if (argc > 2 && std::string(argv[2]) == "--once") {
      for (int dim : {16, 24, 32}) runOnce(lengths, 20, dim);
      return 0;
    }
    CudnnAttention* cudnn = nullptr;
    if (cudnnAttentionAvailable()) cudnn = new CudnnAttention(/*deterministic_backward=*/true);
    benchShape("esm2_8m", lengths, 20, 16, cudnn);
    benchShape("esm2_35m", lengths, 20, 24, cudnn);
    benchShape("esm2_150m", lengths, 20, 32, cudnn);
    delete cudnn;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_gpu_attention: %s\n", e.what());
    return 1;
  }
  return 0;
}
