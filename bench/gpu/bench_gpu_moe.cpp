// MoE layer against a dense FFN of the same active FLOPs, one GPU, bf16, forward (CUDA events,
// median of timed repeats after a warm-up).  MoE = permute (gatherRows in the host routing's
// order) + the experts' GEMMs (a loop of cuBLASLt calls, bias+GELU up, bias down) + the fused
// gate-weighted unpermute with the residual; dense = the same two GEMMs over all tokens with
// ffn = top_k x expert_ffn.  Tokens are routed by model::route from logits with a per-expert
// offset (uneven load, max/mean printed); the host routing's time is printed apart.
//
// Then the training step's layers: MoeMlp (bf16 path: fp32 router GEMM, host routing, permute,
// cuBLASLt experts, unpermute; backward: unpermute backward, per-expert dgrad/wgrad with dGELU,
// router backward, combine) against DenseMlp of ffn = top_k x expert_ffn, forward + backward,
// wall clock after a device synchronise (the host routing and its copies included).
//
//   bench_gpu_moe [tokens]   (default: the shapes of doc/anchors.md §6 "MoE expert GEMMs")
#include "core/error.hpp"
#include "gpu/fused.hpp"
#include "gpu/gemm.hpp"
#include "gpu/moe.hpp"
#include "model/moe.hpp"

#include <cuda_runtime.h>
#include <Kokkos_Core.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
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

/// Parameters of one FFN (bf16 weights, fp32 gradients) owned by the benchmark.
struct Ffn {
  std::vector<std::unique_ptr<Buffer>> own;
  plm::model::DenseMlpWeights w, g;
  Ffn(int hidden, int ffn, unsigned seed, bool b2_bf16) {
    using plm::model::DType;
    using plm::model::Mat;
    auto bf = [&](std::int64_t rows, std::int64_t cols, float scale) {
      own.emplace_back(randomBf16(rows * cols, seed++, scale));
      return own.back()->ptr;
    };
    auto zero = [&](std::int64_t n) {
      own.emplace_back(new Buffer(n * 4));
      PLM_CHECK_CUDA(cudaMemset(own.back()->ptr, 0, n * 4));
      return own.back()->ptr;
    };
    w.w1 = {bf(ffn, hidden, 0.03f), DType::BF16, ffn, hidden, hidden};
    w.b1 = {bf(ffn, 1, 0.1f), DType::BF16, ffn};
    w.w2 = {bf(hidden, ffn, 0.03f), DType::BF16, hidden, ffn, ffn};
    w.b2 = b2_bf16 ? plm::model::Vec{bf(hidden, 1, 0.1f), DType::BF16, hidden}
                   : plm::model::Vec{zero(hidden), DType::F32, hidden};
    g.w1 = {zero(std::int64_t(ffn) * hidden), DType::F32, ffn, hidden, hidden};
    g.b1 = {zero(ffn), DType::F32, ffn};
    g.w2 = {zero(std::int64_t(ffn) * hidden), DType::F32, hidden, ffn, ffn};
    g.b2 = {zero(hidden), DType::F32, hidden};
  }
};

double medianWallMs(const std::function<void()>& f, int repeats = 10) {
  for (int i = 0; i < 3; ++i) f();
  Kokkos::fence();
  std::vector<double> ms(repeats);
  for (int i = 0; i < repeats; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    Kokkos::fence();
    ms[i] =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  }
  std::sort(ms.begin(), ms.end());
  return ms[repeats / 2];
}

void trainLayer(const char* name, std::int64_t tokens, int hidden, int experts, int k,
                int expert_ffn) {
  using plm::ExecSpace;
  using plm::model::DenseMlp;
  using plm::model::DType;
  using plm::model::FfnBlock;
  using plm::model::LayerActs;
  using plm::model::LayerScratch;
  using plm::model::Mat;
  using plm::model::MoeConfig;
  using plm::model::MoeMlp;
  using plm::model::MoeStep;
  using plm::model::MoeWeights;
  using plm::model::OpContext;
  MoeConfig c;
  c.experts = experts;
  c.top_k = k;
  c.expert_ffn = expert_ffn;
  c.aux_loss = 0.01;
  const int ffn = k * expert_ffn;
  OpContext ctx{ExecSpace()};
  ctx.cuda();
  std::unique_ptr<Buffer> h(randomBf16(tokens * hidden, 1, 1.0f)),
      dout(randomBf16(tokens * hidden, 2, 0.01f));
  Buffer residual(tokens * hidden * 4), out(tokens * hidden * 4), dh(tokens * hidden * 2),
      pre(tokens * ffn * 2), act(tokens * ffn * 2), dffn(tokens * ffn * 2);
  PLM_CHECK_CUDA(cudaMemset(residual.ptr, 0, tokens * hidden * 4));
  auto mat = [](void* p, DType d, std::int64_t r, std::int64_t cols) {
    return Mat{p, d, r, cols, cols};
  };
  LayerActs saved;
  saved.ln2 = mat(h->ptr, DType::BF16, tokens, hidden);
  saved.pre = mat(pre.ptr, DType::BF16, tokens, ffn);
  saved.act = mat(act.ptr, DType::BF16, tokens, ffn);
  LayerScratch scratch;
  scratch.dffn = mat(dffn.ptr, DType::BF16, tokens, ffn);
  const Mat res = mat(residual.ptr, DType::F32, tokens, hidden);
  const Mat o = mat(out.ptr, DType::F32, tokens, hidden);
  const Mat dout_c = mat(dout->ptr, DType::BF16, tokens, hidden);
  const Mat dhm = mat(dh.ptr, DType::BF16, tokens, hidden);

  Ffn dense_p(hidden, ffn, 100, false);
  DenseMlp dense(dense_p.w, dense_p.g);
  auto step = [&](const FfnBlock& b) {
    b.forward(ctx, saved.ln2, res, o, saved);
    b.backward(ctx, saved, dout_c, dhm, scratch);
  };
  const double dense_ms = medianWallMs([&] { step(dense); });

  std::vector<std::unique_ptr<Ffn>> ex;
  MoeWeights w, g;
  std::unique_ptr<Buffer> router(new Buffer(std::size_t(experts) * hidden * 4)),
      router_g(new Buffer(std::size_t(experts) * hidden * 4));
  {
    std::mt19937 gen(9);
    std::normal_distribution<float> normal(0.0f, 0.02f);
    std::vector<float> r(std::size_t(experts) * hidden);
    for (auto& v : r) v = normal(gen);
    PLM_CHECK_CUDA(cudaMemcpy(router->ptr, r.data(), r.size() * 4, cudaMemcpyHostToDevice));
    PLM_CHECK_CUDA(cudaMemset(router_g->ptr, 0, r.size() * 4));
  }
  w.router = mat(router->ptr, DType::F32, experts, hidden);
  g.router = mat(router_g->ptr, DType::F32, experts, hidden);
  for (int e = 0; e < experts; ++e) {
    ex.emplace_back(new Ffn(hidden, expert_ffn, 200 + 10 * e, true));
    w.experts.push_back(ex.back()->w);
    g.experts.push_back(ex.back()->g);
  }
  MoeStep ms;
  ms.loss_weight = 1.0;
  ms.grad_scale = 1.0;
  ms.training = true;
  MoeMlp<float> moe(0, c, hidden, w, g, &ms);
  const double moe_ms = medianWallMs([&] { step(moe); });
  const auto& st = moe.stats();
  double most = 0, sum = 0;
  for (double v : st.routed) {
    most = std::max(most, v);
    sum += v;
  }
  const double flops = 3.0 * 4.0 * static_cast<double>(tokens) * hidden * ffn;  // fwd + bwd
  std::printf(
      "train %-22s T %lld H %d E %d top-%d F_e %d | load max/mean %.2f | dense fwd+bwd %.3f ms "
      "(%.0f TFLOP/s) | moe fwd+bwd %.3f ms (%.0f TFLOP/s active) | moe/dense tokens/s %.1f%%\n",
      name, static_cast<long long>(tokens), hidden, experts, k, expert_ffn,
      sum > 0 ? most / (sum / experts) : 0.0, dense_ms, flops / dense_ms / 1e9, moe_ms,
      flops / moe_ms / 1e9, 100.0 * dense_ms / moe_ms);
}

}  // namespace

int main(int argc, char** argv) {
  Kokkos::ScopeGuard kokkos(argc, argv);
  const std::int64_t tokens = argc > 1 ? std::atoll(argv[1]) : 0;
  run("650M-like 8 experts top-2", tokens ? tokens : 24576, 1280, 8, 2, 2560);
  run("AIDO.Protein-16B layer", tokens ? tokens : 16384, 2304, 8, 2, 7680);
  run("fine-grained 64 experts top-8", tokens ? tokens : 16384, 1280, 64, 8, 640);
  // The training step's layers (bf16 MoeMlp vs DenseMlp), forward + backward, with the routing
  // on the device (the default) and with the host reference (PLM_MOE_ROUTING=host).
  for (const char* routing : {"device", "host"}) {
    setenv("PLM_MOE_ROUTING", routing, 1);
    std::printf("routing on the %s:\n", routing);
    trainLayer("esm2_8m-like", tokens ? tokens : 32768, 320, 8, 2, 640);
    trainLayer("650M-like", tokens ? tokens : 24576, 1280, 8, 2, 2560);
    trainLayer("64 experts top-8", tokens ? tokens : 16384, 1280, 64, 8, 640);
  }
  return 0;
}
