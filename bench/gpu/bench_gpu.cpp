// Times each CUDA kernel of plm::gpu on the shapes of an ESM-2 training step (650M unless
// stated), with CUDA events: warm-up first, then the median of the timed repeats, on random
// data (never zeros).  Prints one table row per kernel: time, TFLOP/s for matrix work, GB/s
// (bytes that must move, each input read once and each output written once) for the rest.
//
//   bench_gpu [tokens]        (default 24576 tokens per micro-batch)
#include "gpu/flash_attention.hpp"
#include "gpu/fused.hpp"
#include "gpu/gemm.hpp"
#include "gpu/layer_norm.hpp"

#include "attention_case.hpp"
#include "bench_util.hpp"
#include "core/error.hpp"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <string>
#include <vector>

namespace {

using namespace plm::gpu;

void row(const std::string& name, double ms, double flops, double bytes) {
  std::printf("%-44s %9.3f ms", name.c_str(), ms);
  if (flops > 0) std::printf("  %7.1f TFLOP/s", flops / ms / 1e9);
  if (bytes > 0) std::printf("  %7.0f GB/s", bytes / ms / 1e6);
  std::printf("\n");
  std::fflush(stdout);
}

// Sequence lengths like doc/anchors.md section 6: exp(N(0,1) 0.7 + ln 300) clamped to [30, 1024].
std::vector<int> drawLengths(int n, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> z(0.0, 1.0);
  std::vector<int> v(n);
  for (auto& l : v)
    l = std::clamp(static_cast<int>(std::lround(std::exp(z(rng) * 0.7 + std::log(300.0)))), 30,
                   1024);
  return v;
}

void benchGemm(Gemm& gemm, const char* name, bool ta, bool tb, std::int64_t m, std::int64_t n,
               std::int64_t k, Epilogue epi, DType dt, float beta) {
  Buffer a(m * k * 2), b(k * n * 2), d(m * n * 4), aux(m * n * 2), bias(std::max(m, n) * 4);
  fill(a, m * k, 1.0f, 1);
  fill(b, k * n, 1.0f, 2);
  fill(aux, m * n, 1.0f, 3);
  fill(bias, std::max(m, n), 1.0f, 4);
  GemmArgs g;
  g.trans_a = ta;
  g.trans_b = tb;
  g.m = m;
  g.n = n;
  g.k = k;
  g.a = a.ptr;
  g.lda = ta ? m : k;
  g.b = b.ptr;
  g.ldb = tb ? k : n;
  g.d = d.ptr;
  g.ldd = n;
  g.d_type = dt;
  g.beta = beta;
  g.epilogue = epi;
  g.bias = bias.ptr;
  g.aux = aux.ptr;
  g.ldaux = n;
  g.bias_grad = bias.ptr;
  double ms = medianMs([&] { gemm.run(nullptr, g); });
  char label[128];
  std::snprintf(label, sizeof label, "gemm %s %ldx%ldx%ld", name, long(m), long(n), long(k));
  row(label, ms, 2.0 * m * n * k, 0);
}

void benchAttention(const std::vector<int>& lengths, int heads, int dim, const char* name) {
  const AttentionCase a(lengths, heads, dim, /*interleaved_grads=*/false);
  const FlashParams& p = a.p;
  // FLOPs by the usual convention: forward 4 L^2 D per head, backward 2.5x that.
  double fwd_flops = 4.0 * a.sum_sq * dim * heads;
  const FwdBwdMs t = medianFwdBwdMs([&] { flashAttentionForward(nullptr, p); },
                                    [&] { flashAttentionBackward(nullptr, p); });
  char label[160];
  std::snprintf(label, sizeof label, "attn %s %zu seqs %ld tok H%d D%d fwd", name, lengths.size(),
                long(a.tokens), heads, dim);
  row(label, t.f, fwd_flops, 0);
  std::snprintf(label, sizeof label, "attn %s bwd", name);
  row(label, t.b, 2.5 * fwd_flops, 0);
  std::snprintf(label, sizeof label, "attn %s fwd+bwd", name);
  row(label, t.fb, 3.5 * fwd_flops, 0);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    std::int64_t T = argc > 1 ? std::atoll(argv[1]) : 24576;
    cudaDeviceProp prop{};
    PLM_CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
    std::printf("bench_gpu: %s, %d SMs, tokens per micro-batch %ld\n", prop.name,
                prop.multiProcessorCount, long(T));

    Gemm gemm;
    const int C = 1280, F = 5120;
    benchGemm(gemm, "ceiling", false, false, 8192, 8192, 8192, Epilogue::None, DType::BF16, 0);
    benchGemm(gemm, "qkv fwd (bias)", false, true, T, 3 * C, C, Epilogue::Bias, DType::BF16, 0);
    benchGemm(gemm, "attn out fwd (bias)", false, true, T, C, C, Epilogue::Bias, DType::BF16, 0);
    benchGemm(gemm, "ffn up fwd (bias+gelu+aux)", false, true, T, F, C, Epilogue::BiasGeluAux,
              DType::BF16, 0);
    benchGemm(gemm, "ffn down fwd (bias)", false, true, T, C, F, Epilogue::Bias, DType::BF16, 0);
    benchGemm(gemm, "ffn down dX (dgelu)", false, false, T, F, C, Epilogue::DGelu, DType::BF16, 0);
    benchGemm(gemm, "ffn up dX", false, false, T, C, F, Epilogue::None, DType::BF16, 0);
    benchGemm(gemm, "ffn up dW (+=, bgrad) fp32", true, false, F, C, T, Epilogue::BGradA,
              DType::F32, 1);
    benchGemm(gemm, "ffn down dW (+=, bgrad) fp32", true, false, C, F, T, Epilogue::BGradA,
              DType::F32, 1);
    benchGemm(gemm, "qkv dW (+=, bgrad) fp32", true, false, 3 * C, C, T, Epilogue::BGradA,
              DType::F32, 1);

    auto lengths = drawLengths(64, 2026);
    benchAttention(lengths, 20, 64, "varlen");
    benchAttention(std::vector<int>(16, 1024), 20, 64, "dense16x1024");
    benchAttention(lengths, 16, 128, "varlen");

    {
      // As the model calls them: fp32 residual stream in, fp32 masters for gamma/beta, bf16 dy;
      // the backward in residual mode (fp32 gradient +=, bf16 copy written).
      Buffer x(T * C * 4), y(T * C * 2), dy(T * C * 2), dx(T * C * 2), res(T * C * 4), gamma(C * 4),
          beta(C * 4), mean(T * 4), rstd(T * 4), dg(C * 4), db(C * 4),
          work(layerNormBackwardWorkspace(T, C));
      fillF(x, T * C, 2.0f, 7);
      fill(dy, T * C, 1.0f, 8);
      fillF(gamma, C, 1.0f, 9);
      fillF(beta, C, 1.0f, 10);
      fillF(res, T * C, 1.0f, 11);
      PLM_CHECK_CUDA(cudaMemset(dg.ptr, 0, C * 4));
      PLM_CHECK_CUDA(cudaMemset(db.ptr, 0, C * 4));
      double f = medianMs([&] {
        layerNormForward(nullptr, x.as<float>(), gamma.as<float>(), beta.as<float>(), y.as<bf16>(),
                         mean.as<float>(), rstd.as<float>(), T, C, 1e-5f);
      });
      row("layernorm fwd " + std::to_string(T) + "x1280 (fp32 in)", f, 0, T * C * 6.0);
      double b = medianMs([&] {
        layerNormBackward(nullptr, dy.as<bf16>(), x.as<float>(), gamma.as<float>(),
                          mean.as<float>(), rstd.as<float>(), res.as<float>(), true, dx.as<bf16>(),
                          dg.as<float>(), db.as<float>(), T, C, work.as<void>());
      });
      row("layernorm bwd (residual)", b, 0, T * C * 16.0);
    }
    {
      std::vector<std::int32_t> cu{0};
      auto lens = drawLengths(1000, 7);
      for (int l : lens) {
        if (cu.back() + l > T) break;
        cu.push_back(cu.back() + l);
      }
      std::int64_t tokens = cu.back();
      int nseq = int(cu.size()) - 1;
      Buffer cu_dev(cu.size() * 4), qkv(tokens * 3 * C * 2), ids(tokens), w(33 * C * 2),
          emb(tokens * C * 2), dw(33 * C * 4);
      PLM_CHECK_CUDA(cudaMemcpy(cu_dev.ptr, cu.data(), cu.size() * 4, cudaMemcpyHostToDevice));
      std::vector<std::int32_t> pos_h(tokens);
      for (int s = 0; s < nseq; ++s)
        for (int t = cu[s]; t < cu[s + 1]; ++t) pos_h[t] = t - cu[s];
      Buffer pos(tokens * 4);
      PLM_CHECK_CUDA(cudaMemcpy(pos.ptr, pos_h.data(), tokens * 4, cudaMemcpyHostToDevice));
      fill(qkv, tokens * 3 * C, 1.0f, 11);
      fill(w, 33 * C, 1.0f, 12);
      std::vector<std::uint8_t> ids_h(tokens);
      std::mt19937 rng(3);
      for (auto& id : ids_h) id = rng() % 100 < 12 ? 32 : 4 + rng() % 20;
      PLM_CHECK_CUDA(cudaMemcpy(ids.ptr, ids_h.data(), tokens, cudaMemcpyHostToDevice));
      double r = medianMs([&] {
        rotary(nullptr, qkv.as<bf16>(), 3 * C, qkv.as<bf16>() + C, 3 * C, pos.as<std::int32_t>(),
               tokens, 20, 64, false);
      });
      row("rotary q,k (H20 D64)", r, 0, 2.0 * 2 * tokens * C * 2);
      double e = medianMs([&] {
        embeddingForward(nullptr, ids.as<std::uint8_t>(), w.as<bf16>(), emb.as<bf16>(),
                         cu_dev.as<std::int32_t>(), nseq, C, 32, true);
      });
      row("embedding+token dropout fwd", e, 0, 1.0 * tokens * C * 2);
      Buffer ework(embeddingBackwardWorkspace(nseq, 33, C));
      double eb = medianMs([&] {
        embeddingBackward(nullptr, ids.as<std::uint8_t>(), emb.as<bf16>(), dw.as<float>(),
                          cu_dev.as<std::int32_t>(), nseq, 33, C, 32, true, -1, ework.ptr);
      });
      row("embedding bwd", eb, 0, 1.0 * tokens * C * 2);
    }
    {
      std::int64_t rows = T * 15 / 100;
      Buffer logits(rows * 33 * 4), labels(rows * 4), dl(rows * 33 * 2), loss(8);
      fillF(logits, rows * 33, 3.0f, 13);
      std::vector<std::int32_t> lab(rows);
      for (std::int64_t i = 0; i < rows; ++i) lab[i] = int(4 + i % 20);
      PLM_CHECK_CUDA(cudaMemcpy(labels.ptr, lab.data(), rows * 4, cudaMemcpyHostToDevice));
      double c = medianMs([&] {
        crossEntropy(nullptr, logits.as<float>(), labels.as<std::int32_t>(), dl.as<bf16>(),
                     loss.as<double>(), rows, 33, 1.0f);
      });
      row("cross-entropy (masked rows only)", c, 0, rows * 33 * 6.0);
    }
    {
      std::int64_t n = 651000000;  // ESM-2 650M
      Buffer w(n * 4), g(n * 4), m(n * 4), v(n * 4), wb(n * 2), seg(16), dec(8), ss(8);
      fillF(w, n, 0.1f, 14);
      fillF(g, n, 1e-3f, 15);
      fillF(m, n, 1e-4f, 16);
      fillF(v, n, 1e-6f, 17);
      PLM_CHECK_CUDA(cudaMemset(v.ptr, 0, n * 4));
      std::int64_t segs[2] = {0, n};
      std::uint8_t decay = 1;
      PLM_CHECK_CUDA(cudaMemcpy(seg.ptr, segs, 16, cudaMemcpyHostToDevice));
      PLM_CHECK_CUDA(cudaMemcpy(dec.ptr, &decay, 1, cudaMemcpyHostToDevice));
      PLM_CHECK_CUDA(cudaMemset(ss.ptr, 0, 8));
      AdamWParams p;
      p.lr = 1e-4f;
      p.weight_decay = 0.01f;
      p.max_norm = 1.0f;
      p.grad_sumsq = ss.as<double>();
      double s = medianMs([&] { sumSquares(nullptr, g.as<float>(), n, ss.as<double>()); });
      row("grad norm (sum of squares) 651M", s, 0, n * 4.0);
      double a = medianMs([&] {
        adamwStep(nullptr, w.as<float>(), g.as<float>(), m.as<float>(), v.as<float>(),
                  wb.as<bf16>(), n, seg.as<std::int64_t>(), dec.as<std::uint8_t>(), 1, p);
      });
      row("adamw fp32 master + bf16 copy 651M", a, 0, n * (16.0 + 12.0 + 2.0));
    }
    PLM_CHECK_CUDA(cudaDeviceSynchronize());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_gpu: %s\n", e.what());
    return 1;
  }
}
