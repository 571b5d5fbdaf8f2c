// MoE layer against a dense FFN of the same active FLOPs, one GPU, bf16 (CUDA events, median of
// timed repeats after a warm-up).
//
// 1. Forward kernels: MoE = permute (gatherRows in the host routing's order) + the experts'
//    GEMMs + the fused gate-weighted unpermute with the residual; the experts run both ways, as
//    the loop of cuBLASLt calls (bias+GELU up, bias down) and as CUTLASS grouped launches
//    (gpu/moe_grouped.hpp; tiles 128x128 and 256x128; where this build has them); dense = the same
//    two GEMMs over all tokens with ffn = top_k x expert_ffn.  Tokens are routed by model::route
//    from logits with a per-expert offset (uneven load, max/mean printed).
// 2. The training step's layers: MoeMlp (bf16 path: fp32 router GEMM on cuBLAS, device routing,
//    permute, experts, unpermute; backward: unpermute backward, expert dgrad/wgrad with dGELU,
//    router backward, combine) against DenseMlp of ffn = top_k x expert_ffn, forward and forward
//    + backward, wall clock after a device synchronise, for moe.expert_gemm = loop, grouped (CTA
//    tile 128 and 256, gpu::setGroupedTiles) and auto (the per-direction pick), the latter also
//    with each dgrad/wgrad tile (gpu::setGroupedTiles).  The first part also times the
//    grouped backward per dgrad/wgrad tile and the bias gradients alone.
//    The phase split comes from OpContext's per-kind CUDA-event profile (expert GEMMs = "gemm";
//    the rest of the layer: router GEMMs, routing, permute, unpermute, combine, bias/GELU passes).
//
//   bench_gpu_moe [tokens [name]]   (default: the shapes of doc/anchors.md §6 "MoE expert
//   GEMMs"; tokens 0 = each shape's own; name: only the shapes whose name contains it, e.g. 650M)
#include "core/error.hpp"
#include "gpu/fused.hpp"
#include "gpu/gemm.hpp"
#include "gpu/moe.hpp"
#include "gpu/moe_grouped.hpp"
#include "model/moe.hpp"

#include "bench_util.hpp"

#include <cuda_runtime.h>
#include <Kokkos_Core.hpp>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

namespace {

using namespace plm::gpu;

// The grouped tiles (forward, dgrad, wgrad; gpu::setGroupedTiles) timed for the grouped backward
// and the auto training layer: the default (128,256,128) first, then the other dgrad x wgrad
// pairs.
constexpr GroupedTiles kBwdTile[] = {
    {128, 256, 128}, {128, 128, 128}, {128, 128, 256}, {128, 256, 256}};
constexpr int kBwdTiles = sizeof(kBwdTile) / sizeof(kBwdTile[0]);
const char* kBwdTileName[kBwdTiles] = {"128,256,128", "128,128,128", "128,128,256", "128,256,256"};

Buffer* randomBf16(std::size_t n, unsigned seed, float scale) {
  auto* b = new Buffer(n * 2);
  fill(*b, n, scale, seed);
  return b;
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
  plm::model::Routing r;
  const double route_ms =
      wallMs([&] { r = plm::model::route(logits.data(), static_cast<int>(tokens), c, nullptr); });
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
  double grouped_ms[2] = {0, 0};  // tiles 128 and 256 (gpu::setGroupedTiles)
  const GroupedTiles default_tiles = groupedTiles();
  if (groupedExpertGemmAvailable()) {
    const std::size_t bytes = groupedExpertWorkspaceBytes(experts, hidden, expert_ffn);
    Buffer ws(bytes);
    for (int t = 0; t < 2; ++t) {
      const int tile = t ? 256 : 128;
      setGroupedTiles({tile, tile, tile});
      grouped_ms[t] = medianMs([&] {
        groupedExpertForward(nullptr, weights, r.kept, xperm.as<bf16>(), pre.as<bf16>(),
                             act.as<bf16>(), y.as<bf16>(), hidden, expert_ffn, ws.ptr, bytes);
      });
    }
    setGroupedTiles(default_tiles);
  }
  // The grouped backward (dgrad, dGELU, wgrad, bias gradients, dx) per dgrad/wgrad tile, and the
  // bias gradients (fixed-order column sums of dy and dpre) alone.
  double grouped_bwd_ms[kBwdTiles] = {};
  double bias_grad_ms = 0;
  {
    std::unique_ptr<Buffer> dy_perm(randomBf16(rows * hidden, 3, 0.01f));
    Buffer dpre_perm(rows * expert_ffn * 2), dx_perm(rows * hidden * 2);
    std::vector<std::unique_ptr<Buffer>> gbuf;
    std::vector<ExpertGrads> grads;
    std::vector<float*> db1, db2;
    const std::size_t wn = std::size_t(expert_ffn) * hidden;
    for (int e = 0; e < experts; ++e) {
      for (std::size_t n : {wn, std::size_t(expert_ffn), wn, std::size_t(hidden)}) {
        gbuf.emplace_back(new Buffer(n * 4));
        PLM_CHECK_CUDA(cudaMemset(gbuf.back()->ptr, 0, n * 4));
      }
      const std::size_t at = gbuf.size() - 4;
      grads.push_back({gbuf[at]->as<float>(), gbuf[at + 1]->as<float>(), gbuf[at + 2]->as<float>(),
                       gbuf[at + 3]->as<float>()});
      db1.push_back(grads.back().b1);
      db2.push_back(grads.back().b2);
    }
    const std::size_t sum_bytes = expertBiasGradientWorkspaceBytes(experts, expert_ffn);
    Buffer sum_ws(sum_bytes);
    bias_grad_ms = medianMs([&] {
      expertBiasGradient(nullptr, db2, r.kept, dy_perm->as<bf16>(), hidden, sum_ws.ptr, sum_bytes);
      expertBiasGradient(nullptr, db1, r.kept, pre.as<bf16>(), expert_ffn, sum_ws.ptr, sum_bytes);
    });
    if (groupedExpertGemmAvailable()) {
      const std::size_t bytes = groupedExpertWorkspaceBytes(experts, hidden, expert_ffn);
      Buffer ws(bytes);
      for (int t = 0; t < kBwdTiles; ++t) {
        setGroupedTiles(kBwdTile[t]);
        grouped_bwd_ms[t] = medianMs([&] {
          groupedExpertBackward(nullptr, weights, grads, r.kept, xperm.as<bf16>(), pre.as<bf16>(),
                                act.as<bf16>(), dy_perm->as<bf16>(), dpre_perm.as<bf16>(),
                                dx_perm.as<bf16>(), hidden, expert_ffn, ws.ptr, bytes);
        });
      }
      setGroupedTiles(default_tiles);
    }
  }
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
  if (grouped_ms[0] > 0) {
    for (int t = 0; t < 2; ++t) {
      const double g_ms = permute_ms + grouped_ms[t] + unpermute_ms;
      std::printf(
          "%-28s   experts grouped (tile %d) %.3f ms (%.0f TFLOP/s) vs loop %.3f ms "
          "(%.0f TFLOP/s) | moe/dense tokens/s grouped %.1f%% loop %.1f%%\n",
          "", t ? 256 : 128, grouped_ms[t], flops / grouped_ms[t] / 1e9, experts_ms,
          flops / experts_ms / 1e9, 100.0 * dense_ms / g_ms, 100.0 * dense_ms / moe_ms);
    }
    for (int t = 0; t < kBwdTiles; ++t)
      std::printf(
          "%-28s   backward grouped (tiles %s) %.3f ms (%.0f TFLOP/s, the four "
          "GEMMs with dGELU and bias gradients)\n",
          "", kBwdTileName[t], grouped_bwd_ms[t], 2.0 * flops / grouped_bwd_ms[t] / 1e9);
  } else {
    std::printf("%-28s   experts grouped: not in this build or not an sm_90 GPU\n", "");
  }
  const double bias_bytes = 2.0 * static_cast<double>(rows) * (hidden + expert_ffn);
  std::printf("%-28s   bias gradients (column sums of dy and dpre) %.3f ms (%.0f GB/s read)\n", "",
              bias_grad_ms, bias_bytes / bias_grad_ms / 1e6);
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
  // Wall clock of the layer's work: each timed call ends with a fence.
  auto fenced = [](const std::function<void()>& f) {
    return [f] {
      f();
      Kokkos::fence();
    };
  };
  const double dense_ms = medianWallMs(fenced([&] { step(dense); }));
  const double dense_fwd_ms =
      medianWallMs(fenced([&] { dense.forward(ctx, saved.ln2, res, o, saved); }));

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
  std::unique_ptr<MoeMlp<float>> last;
  const double flops = 3.0 * 4.0 * static_cast<double>(tokens) * hidden * ffn;  // fwd + bwd
  std::printf(
      "train %-22s T %lld H %d E %d top-%d F_e %d | dense fwd %.3f ms, fwd+bwd %.3f ms "
      "(%.0f TFLOP/s)\n",
      name, static_cast<long long>(tokens), hidden, experts, k, expert_ffn, dense_fwd_ms, dense_ms,
      flops / dense_ms / 1e9);
  // auto: the pick of gpu::chooseExpertGemm per direction (moe.expert_gemm's default).
  // Each mode: its label, moe.expert_gemm and the grouped tiles; a tile triple as the label =
  // the per-direction pick with those tiles (kBwdTile).
  using plm::model::ExpertGemmMode;
  struct Mode {
    const char* label;
    ExpertGemmMode gemm;
    GroupedTiles tiles;
  };
  const GroupedTiles default_tiles = groupedTiles();
  std::vector<Mode> modes = {Mode{"loop", ExpertGemmMode::Loop, default_tiles},
                             Mode{"grouped", ExpertGemmMode::Grouped, {128, 128, 128}},
                             Mode{"grouped256", ExpertGemmMode::Grouped, {256, 256, 256}},
                             Mode{"auto", ExpertGemmMode::Auto, default_tiles}};
  for (int t = 0; t < kBwdTiles; ++t)
    modes.push_back(Mode{kBwdTileName[t], ExpertGemmMode::Auto, kBwdTile[t]});
  for (const Mode& m : modes) {
    const char* mode = m.label;
    if (m.gemm != ExpertGemmMode::Loop && !plm::gpu::groupedExpertGemmAvailable()) {
      std::printf("  %s: not in this build or not an sm_90 GPU\n", mode);
      continue;
    }
    c.expert_gemm = m.gemm;
    setGroupedTiles(m.tiles);
    last = std::make_unique<MoeMlp<float>>(0, c, hidden, w, g, &ms);
    MoeMlp<float>& moe = *last;
    const double fwd_ms = medianWallMs(fenced([&] { moe.forward(ctx, saved.ln2, res, o, saved); }));
    const double moe_ms = medianWallMs(fenced([&] { step(moe); }));
    // One profiled step: the expert (and shared) GEMMs are "gemm"; the rest of the layer is the
    // remainder of the step's time.
    Kokkos::fence();
    ctx.setProfiling(true);
    const double one_ms = wallMs(fenced([&] { step(moe); }));
    double gemm_ms = 0, other_ms = 0;
    for (const auto& [kind, t] : ctx.profile())
      (kind.rfind("gemm", 0) == 0 ? gemm_ms : other_ms) += t;
    ctx.setProfiling(false);
    std::printf(
        "  %-19s moe fwd %.3f ms (%.1f%% of dense fwd) | fwd+bwd %.3f ms (%.0f TFLOP/s active) | "
        "bwd %.3f ms | profiled step %.3f ms: expert GEMMs %.3f, marked other %.3f, unmarked "
        "(router GEMMs, routing, permute, unpermute, combine) %.3f | moe/dense tokens/s "
        "%.1f%%\n",
        mode, fwd_ms, 100.0 * dense_fwd_ms / fwd_ms, moe_ms, flops / moe_ms / 1e9, moe_ms - fwd_ms,
        one_ms, gemm_ms, other_ms, one_ms - gemm_ms - other_ms, 100.0 * dense_ms / moe_ms);
  }
  setGroupedTiles(default_tiles);
  if (!last) return;
  const auto& st = last->stats();
  double most = 0, sum = 0;
  for (double v : st.routed) {
    most = std::max(most, v);
    sum += v;
  }
  std::printf("  load max/mean %.2f\n", sum > 0 ? most / (sum / experts) : 0.0);
}

}  // namespace

int main(int argc, char** argv) {
  Kokkos::ScopeGuard kokkos(argc, argv);
  const std::int64_t tokens = argc > 1 ? std::atoll(argv[1]) : 0;
  // Only the shapes whose name contains argv[2] (e.g. "650M"), where given.
  const std::string only = argc > 2 ? argv[2] : "";
  auto pick = [&](const char* name) { return std::string(name).find(only) != std::string::npos; };
  if (pick("650M-like"))
    run("650M-like 8 experts top-2", tokens ? tokens : 24576, 1280, 8, 2, 2560);
  if (pick("AIDO-like")) run("AIDO.Protein-16B layer", tokens ? tokens : 16384, 2304, 8, 2, 7680);
  if (pick("64 experts top-8"))
    run("fine-grained 64 experts top-8", tokens ? tokens : 16384, 1280, 64, 8, 640);
  if (pick("esm2_8m-like"))
    run("esm2_8m-like 8 experts top-2", tokens ? tokens : 32768, 320, 8, 2, 640);
  // The training step's layers (bf16 MoeMlp vs DenseMlp), forward + backward, routing on the
  // device (the bf16 path's default).
  if (pick("esm2_8m-like")) trainLayer("esm2_8m-like", tokens ? tokens : 32768, 320, 8, 2, 640);
  if (pick("650M-like")) trainLayer("650M-like", tokens ? tokens : 24576, 1280, 8, 2, 2560);
  if (pick("AIDO-like")) trainLayer("AIDO-like", tokens ? tokens : 16384, 2304, 8, 2, 7680);
  if (pick("64 experts top-8"))
    trainLayer("64 experts top-8", tokens ? tokens : 16384, 1280, 64, 8, 640);
  return 0;
}
