// MoE layer against a dense FFN of the same active FLOPs, one GPU, bf16, forward (CUDA events,
// median of timed repeats after a warm-up).  MoE = permute (gatherRows in the host routing's
// order) + the experts' GEMMs (a loop of cuBLASLt calls, bias+GELU up, bias down) + the fused
// gate-weighted unpermute with the residual; dense = the same two GEMMs over all tokens with
// ffn = top_k x expert_ffn.  Tokens are routed by model::route from logits with a per-expert
// offset (uneven load, max/mean printed); the host routing's time is printed apart.
//
//   bench_gpu_moe [tokens]   (default: the shapes of doc/anchors.md §6 "MoE expert GEMMs")
#include "core/error.hpp"
#include "gpu/fused.hpp"
#include "gpu/gemm.hpp"
#include "gpu/moe.hpp"
#include "model/moe.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <vector>

namespace {

using namespace plm::gpu;

std::uint16_t bf16Bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>(u >> 16);
}

struct Buffer {
  void* ptr = nullptr;
  explicit Buffer(std::size_t bytes) { PLM_CHECK_CUDA(cudaMalloc(&ptr, bytes ? bytes : 16)); }
  ~Buffer() { cudaFree(ptr); }
  Buffer(const Buffer&) = delete;
  template <class T> T* as() const { return static_cast<T*>(ptr); }
};

Buffer* randomBf16(std::size_t n, unsigned seed, float scale) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> u(-scale, scale);
  std::vector<std::uint16_t> host(n);
  for (auto& h : host) h = bf16Bits(u(gen));
  auto* b = new Buffer(n * 2);
  PLM_CHECK_CUDA(cudaMemcpy(b->ptr, host.data(), n * 2, cudaMemcpyHostToDevice));
  return b;
}

double medianMs(const std::function<void()>& f, int repeats = 20) {
  for (int i = 0; i < 3; ++i) f();
  cudaEvent_t a, b;
  PLM_CHECK_CUDA(cudaEventCreate(&a));
  PLM_CHECK_CUDA(cudaEventCreate(&b));
  std::vector<float> ms(repeats);
  for (int i = 0; i < repeats; ++i) {
    PLM_CHECK_CUDA(cudaEventRecord(a));
    f();
    PLM_CHECK_CUDA(cudaEventRecord(b));
    PLM_CHECK_CUDA(cudaEventSynchronize(b));
    PLM_CHECK_CUDA(cudaEventElapsedTime(&ms[i], a, b));
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(ms.begin(), ms.end());
  return ms[repeats / 2];
}

void run(const char* name, std::int64_t tokens, int hidden, int experts, int k, int expert_ffn) {
  plm::model::MoeConfig c;
  c.experts = experts;
  c.top_k = k;
  c.expert_ffn = expert_ffn;
  std::mt19937 gen(7);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<double> logits(tokens * experts);
  for (std::size_t i = 0; i < logits.size(); ++i)
    logits[i] = normal(gen) + 0.15 * static_cast<double>(i % experts);  // uneven load
  const auto t0 = std::chrono::steady_clock::now();
  const plm::model::Routing r =
      plm::model::route(logits.data(), static_cast<int>(tokens), c, nullptr);
  const double route_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  const std::int64_t rows = r.rows();
  const double mean = static_cast<double>(rows) / experts;
  const double most = static_cast<double>(*std::max_element(r.kept.begin(), r.kept.end()));

  std::unique_ptr<Buffer> x(randomBf16(tokens * hidden, 1, 1.0f));
  std::vector<std::unique_ptr<Buffer>> w;
  std::vector<ExpertWeights> weights;
  for (int e = 0; e < experts; ++e) {
    w.emplace_back(randomBf16(std::size_t(expert_ffn) * hidden, 10 + e, 0.03f));
    w.emplace_back(randomBf16(expert_ffn, 20 + e, 0.1f));
    w.emplace_back(randomBf16(std::size_t(hidden) * expert_ffn, 30 + e, 0.03f));
    w.emplace_back(randomBf16(hidden, 40 + e, 0.1f));
    const std::size_t at = w.size() - 4;
    weights.push_back(
        {w[at]->as<bf16>(), w[at + 1]->as<bf16>(), w[at + 2]->as<bf16>(), w[at + 3]->as<bf16>()});
  }
  Buffer xperm(rows * hidden * 2), pre(rows * expert_ffn * 2), act(rows * expert_ffn * 2),
      y(rows * hidden * 2), residual(tokens * hidden * 4), out(tokens * hidden * 4);
  PLM_CHECK_CUDA(cudaMemset(residual.ptr, 0, tokens * hidden * 4));
  Buffer row_token(rows * 4), slot_row(tokens * k * 4), slot_gate(tokens * k * 4);
  std::vector<std::int32_t> rt(r.row_token.begin(), r.row_token.end());
  std::vector<std::int32_t> sr(r.row.begin(), r.row.end());
  std::vector<float> sg(r.gate.begin(), r.gate.end());
  PLM_CHECK_CUDA(cudaMemcpy(row_token.ptr, rt.data(), rt.size() * 4, cudaMemcpyHostToDevice));
  PLM_CHECK_CUDA(cudaMemcpy(slot_row.ptr, sr.data(), sr.size() * 4, cudaMemcpyHostToDevice));
  PLM_CHECK_CUDA(cudaMemcpy(slot_gate.ptr, sg.data(), sg.size() * 4, cudaMemcpyHostToDevice));

  Gemm gemm;
  const double permute_ms = medianMs([&] {
    gatherRows(nullptr, x->as<bf16>(), row_token.as<std::int32_t>(), xperm.as<bf16>(), rows,
               hidden);
  });
  const double experts_ms = medianMs([&] {
    expertFfnForward(gemm, nullptr, weights, r.kept, xperm.as<bf16>(), pre.as<bf16>(),
                     act.as<bf16>(), y.as<bf16>(), hidden, expert_ffn);
  });
  const double unpermute_ms = medianMs([&] {
    moeUnpermute(nullptr, y.as<bf16>(), slot_row.as<std::int32_t>(), slot_gate.as<float>(),
                 residual.as<float>(), out.as<float>(), tokens, k, hidden);
  });

  // Dense FFN of the same active width (top_k x expert_ffn) over all tokens.
  const int ffn = k * expert_ffn;
  std::unique_ptr<Buffer> w1(randomBf16(std::size_t(ffn) * hidden, 50, 0.03f)),
      b1(randomBf16(ffn, 51, 0.1f)), w2(randomBf16(std::size_t(hidden) * ffn, 52, 0.03f)),
      b2(randomBf16(hidden, 53, 0.1f));
  Buffer dpre(tokens * ffn * 2), dact(tokens * ffn * 2), dy(tokens * hidden * 2);
  ExpertWeights dense{w1->as<bf16>(), b1->as<bf16>(), w2->as<bf16>(), b2->as<bf16>()};
  const double dense_ms = medianMs([&] {
    expertFfnForward(gemm, nullptr, {dense}, {tokens}, x->as<bf16>(), dpre.as<bf16>(),
                     dact.as<bf16>(), dy.as<bf16>(), hidden, ffn);
  });
  const double moe_ms = permute_ms + experts_ms + unpermute_ms;
  const double flops = 4.0 * static_cast<double>(rows) * hidden * expert_ffn;
  const double dense_flops = 4.0 * static_cast<double>(tokens) * hidden * ffn;
  std::printf(
      "%-28s T %lld H %d E %d top-%d F_e %d | load max/mean %.2f, dropped %lld | dense %.3f ms "
      "(%.0f TFLOP/s) | moe %.3f ms = permute %.3f + experts %.3f (%.0f TFLOP/s) + unpermute "
      "%.3f | moe/dense tokens/s %.1f%% | host routing %.1f ms\n",
      name, static_cast<long long>(tokens), hidden, experts, k, expert_ffn, most / mean,
      static_cast<long long>(r.dropped), dense_ms, dense_flops / dense_ms / 1e9, moe_ms, permute_ms,
      experts_ms, flops / experts_ms / 1e9, unpermute_ms, 100.0 * dense_ms / moe_ms, route_ms);
}

}  // namespace

int main(int argc, char** argv) {
  const std::int64_t tokens = argc > 1 ? std::atoll(argv[1]) : 0;
  run("650M-like 8 experts top-2", tokens ? tokens : 24576, 1280, 8, 2, 2560);
  run("AIDO.Protein-16B layer", tokens ? tokens : 16384, 2304, 8, 2, 7680);
  run("fine-grained 64 experts top-8", tokens ? tokens : 16384, 1280, 64, 8, 640);
  return 0;
}
