// MoE GPU kernels against the portable path's arithmetic (host double, from the same
// bf16-rounded inputs): the permutation (gatherRows with the host routing's row order), the
// looped cuBLASLt expert FFNs, the fused gate-weighted unpermute with the residual, its backward
// (gate gradients and the permuted output gradient) and the combine of the input gradient.  The
// routing drops slots (capacity 1.0) and leaves one expert without rows (selection bias -100),
// so the kernels see dropped slots, a token with none kept and an empty expert.  The unpermute,
// its backward and the combine run twice: their 16-byte kernels and the scalar ones.
#include "gpu/fused.hpp"
#include "gpu/moe.hpp"
#include "gpu_test_util.hpp"
#include "model/moe.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <deque>
#include <type_traits>

namespace plm::gpu {
namespace {

using test::Bf16Tensor;
using test::DeviceBuffer;

double geluTanh(double x) {
  return 0.5 * x * (1.0 + std::tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)));
}

void checkKernels() {
  const int tokens = 300, hidden = 64, ffn = 96, experts = 8, k = 2;
  model::MoeConfig c;
  c.experts = experts;
  c.top_k = k;
  c.expert_ffn = ffn;
  c.capacity_factor = 1.0;
  std::vector<double> logits(tokens * experts), bias(experts, 0.0);
  {
    auto l = test::randomNormal(logits.size(), 1, 1.5f);
    for (std::size_t i = 0; i < l.size(); ++i) logits[i] = l[i] + 0.3 * (i % experts);  // uneven
  }
  bias[3] = -100.0;
  const model::Routing r = model::route(logits.data(), tokens, c, bias.data());
  ASSERT_EQ(r.kept[3], 0) << "expert 3 should receive no rows";
  ASSERT_GT(r.dropped, 0) << "capacity 1.0 should drop slots";
  const std::int64_t rows = r.rows();

  Bf16Tensor x(test::randomNormal(tokens * hidden, 2));
  std::deque<Bf16Tensor> w1, b1, w2, b2;  // deque: Bf16Tensor does not move
  std::vector<ExpertWeights> weights;
  for (int e = 0; e < experts; ++e) {
    w1.emplace_back(test::randomNormal(ffn * hidden, 10 + e, 0.15f));
    b1.emplace_back(test::randomNormal(ffn, 30 + e, 0.1f));
    w2.emplace_back(test::randomNormal(hidden * ffn, 50 + e, 0.15f));
    b2.emplace_back(test::randomNormal(hidden, 70 + e, 0.1f));
  }
  for (int e = 0; e < experts; ++e)
    weights.push_back({w1[e].get(), b1[e].get(), w2[e].get(), b2[e].get()});
  const auto residual0 = test::randomNormal(tokens * hidden, 3);
  DeviceBuffer<float> residual(residual0), out(tokens * hidden);
  DeviceBuffer<std::int32_t> row_token(
      std::vector<std::int32_t>(r.row_token.begin(), r.row_token.end()));
  DeviceBuffer<std::int32_t> slot_row(std::vector<std::int32_t>(r.row.begin(), r.row.end()));
  DeviceBuffer<float> slot_gate(std::vector<float>(r.gate.begin(), r.gate.end()));
  DeviceBuffer<std::uint16_t> xperm(rows * hidden), pre(rows * ffn), act(rows * ffn),
      y(rows * hidden);
  out.poison();
  y.poison();

  gatherRows(nullptr, x.get(), row_token.get(), reinterpret_cast<bf16*>(xperm.get()), rows, hidden);
  Gemm gemm;
  expertFfnForward(gemm, nullptr, weights, r.kept, reinterpret_cast<bf16*>(xperm.get()),
                   reinterpret_cast<bf16*>(pre.get()), reinterpret_cast<bf16*>(act.get()),
                   reinterpret_cast<bf16*>(y.get()), hidden, ffn);
  moeUnpermute(nullptr, reinterpret_cast<bf16*>(y.get()), slot_row.get(), slot_gate.get(),
               residual.get(), out.get(), tokens, k, hidden);
  const auto got = out.download();
  const auto y_dev = test::downloadBf16(y);

  // Reference: the portable MoeMlp's formula, token by token (tanh GELU, bf16 activations).
  std::vector<double> ref(residual0.begin(), residual0.end()), y_ref(rows * hidden);
  for (std::int64_t p = 0, e = 0, left = 0; p < rows; ++p) {
    while (left == 0) left = r.kept[e++];
    const int ex = static_cast<int>(e - 1);
    --left;
    const float* xt = &x.values[std::int64_t(r.row_token[p]) * hidden];
    std::vector<double> a(ffn);
    for (int i = 0; i < ffn; ++i) {
      double s = b1[ex].values[i];
      for (int j = 0; j < hidden; ++j) s += w1[ex].values[i * hidden + j] * double(xt[j]);
      a[i] = test::roundBf16(static_cast<float>(geluTanh(s)));
    }
    for (int o = 0; o < hidden; ++o) {
      double s = b2[ex].values[o];
      for (int i = 0; i < ffn; ++i) s += w2[ex].values[o * ffn + i] * a[i];
      y_ref[p * hidden + o] = s;
    }
  }
  EXPECT_LT(test::relError(y_dev, y_ref), 1e-2) << "expert FFNs";
  for (int t = 0; t < tokens; ++t)
    for (int j = 0; j < k; ++j) {
      const int p = r.row[t * k + j];
      if (p < 0) continue;
      for (int o = 0; o < hidden; ++o)
        ref[t * hidden + o] += double(float(r.gate[t * k + j])) * y_dev[p * hidden + o];
    }
  EXPECT_LT(test::relError(got, ref), 1e-6) << "unpermute (from the device's expert outputs)";
  moeUnpermute(nullptr, reinterpret_cast<bf16*>(y.get()), slot_row.get(), slot_gate.get(),
               residual.get(), out.get(), tokens, k, hidden);
  EXPECT_EQ(out.download(), got) << "not deterministic";

  // Backward: dgate and dy from dout; dh from dx.
  Bf16Tensor dout(test::randomNormal(tokens * hidden, 4));
  Bf16Tensor dx(test::randomNormal(rows * hidden, 5));
  DeviceBuffer<std::uint16_t> dy(rows * hidden), dh(tokens * hidden);
  DeviceBuffer<float> dgate(tokens * k);
  dy.poison();
  dh.poison();
  dgate.poison();
  moeUnpermuteBackward(nullptr, dout.get(), reinterpret_cast<bf16*>(y.get()), slot_row.get(),
                       slot_gate.get(), reinterpret_cast<bf16*>(dy.get()), dgate.get(), tokens, k,
                       hidden);
  moeCombineGradient(nullptr, dx.get(), slot_row.get(), reinterpret_cast<bf16*>(dh.get()), tokens,
                     k, hidden);
  std::vector<double> dgate_ref(tokens * k, 0.0), dy_ref(rows * hidden), dh_ref(tokens * hidden);
  for (int t = 0; t < tokens; ++t)
    for (int j = 0; j < k; ++j) {
      const int p = r.row[t * k + j];
      if (p < 0) continue;
      for (int o = 0; o < hidden; ++o) {
        const double d = dout.values[t * hidden + o];
        dgate_ref[t * k + j] += d * y_dev[p * hidden + o];
        dy_ref[p * hidden + o] = float(r.gate[t * k + j]) * d;
        dh_ref[t * hidden + o] += dx.values[p * hidden + o];
      }
    }
  EXPECT_LT(test::relError(dgate.download(), dgate_ref), 1e-5) << "gate gradients";
  EXPECT_LT(test::relError(test::downloadBf16(dy), dy_ref), 5e-3) << "permuted output gradient";
  EXPECT_LT(test::relError(test::downloadBf16(dh), dh_ref), 5e-3) << "combined input gradient";

  // With the router's input gradient (fp32) added in the same pass.
  const auto add0 = test::randomNormal(tokens * hidden, 6);
  DeviceBuffer<float> add(add0);
  moeCombineGradient(nullptr, dx.get(), slot_row.get(), reinterpret_cast<bf16*>(dh.get()), tokens,
                     k, hidden, add.get());
  for (std::size_t i = 0; i < dh_ref.size(); ++i) dh_ref[i] += add0[i];
  EXPECT_LT(test::relError(test::downloadBf16(dh), dh_ref), 5e-3) << "combine with the addend";

  // With the router's input gradient formed in the pass: dl (tokens, 5) W (5, hidden) - v.
  if (!moeCombineTakesRouter(hidden, 5, {dx.get(), dh.get()})) return;  // the scalar kernels
  const int router_e = 5;
  const auto dl0 = test::randomNormal(tokens * router_e, 7);
  const auto w0 = test::randomNormal(router_e * hidden, 8, 0.2f);
  const auto v0 = test::randomNormal(hidden, 9, 0.1f);
  DeviceBuffer<float> dl_d(dl0), w_d(w0), v_d(v0);
  std::vector<double> with_v = dh_ref, without_v = dh_ref;
  for (int t = 0; t < tokens; ++t)
    for (int o = 0; o < hidden; ++o) {
      double r = 0;
      for (int e = 0; e < router_e; ++e) r += double(dl0[t * router_e + e]) * w0[e * hidden + o];
      const std::size_t i = std::size_t(t) * hidden + o;
      with_v[i] = dh_ref[i] - add0[i] + r - v0[o];
      without_v[i] = dh_ref[i] - add0[i] + r;
    }
  moeCombineGradient(nullptr, dx.get(), slot_row.get(), reinterpret_cast<bf16*>(dh.get()), tokens,
                     k, hidden, RouterInputGradient{dl_d.get(), w_d.get(), v_d.get(), router_e});
  EXPECT_LT(test::relError(test::downloadBf16(dh), with_v), 5e-3) << "combine with dl W - v";
  moeCombineGradient(nullptr, dx.get(), slot_row.get(), reinterpret_cast<bf16*>(dh.get()), tokens,
                     k, hidden, RouterInputGradient{dl_d.get(), w_d.get(), nullptr, router_e});
  EXPECT_LT(test::relError(test::downloadBf16(dh), without_v), 5e-3) << "combine with dl W";
}

// hidden 64: the 16-byte kernels; setMoeScalarKernels(true) the scalar ones, same references.
TEST(MoeKernels, MatchThePortableArithmetic) { checkKernels(); }

TEST(MoeKernels, ScalarKernelsMatchThePortableArithmetic) {
  setMoeScalarKernels(true);
  checkKernels();
  setMoeScalarKernels(false);
}

// Device routing against model::route / model::routeBackward (host, double): identical experts,
// rows and permutation; gates to float rounding; the summary (counts, probability sums, lse^2,
// entropy) to 1e-12; the logit gradient to float rounding.  Cases: softmax and sigmoid,
// normalised or not, dropless and capacity cuts, a selection bias that empties an expert, exact
// ties (duplicated logits: ties go to the lower expert), token counts that cross the 256-slot
// chunks unevenly, 64 experts top-8, and no tokens at all.
void checkRouting(model::MoeConfig c, int tokens, bool ties, bool empty_expert,
                  std::uint64_t seed) {
  const int e_n = c.experts, k = c.top_k;
  std::vector<float> logits_f(std::size_t(tokens) * e_n);
  {
    auto l = test::randomNormal(logits_f.size(), seed, 1.5f);
    for (std::size_t i = 0; i < l.size(); ++i) logits_f[i] = l[i] + 0.2f * float(i % e_n);
    if (ties)
      for (int t = 0; t < tokens; t += 3)
        for (int e = 1; e < e_n; e += 2)
          logits_f[std::size_t(t) * e_n + e] = logits_f[std::size_t(t) * e_n + e - 1];
  }
  std::vector<float> bias_f(e_n, 0.0f);
  for (int e = 0; e < e_n; ++e) bias_f[e] = 0.01f * float(e % 3);
  if (empty_expert) bias_f[1] = -100.0f;
  std::vector<double> logits(logits_f.begin(), logits_f.end()), bias(bias_f.begin(), bias_f.end());
  const model::Routing r = model::route(logits.data(), tokens, c, bias.data());

  DeviceBuffer<float> dl(logits_f), db(bias_f);
  const std::size_t bytes = routeWorkspaceBytes(tokens, e_n, k);
  DeviceBuffer<char> ws(bytes);
  ws.poison();
  RouteArgs a;
  a.tokens = tokens;
  a.experts = e_n;
  a.top_k = k;
  a.softmax = c.router == model::RouterKind::Softmax;
  a.normalize_topk = c.normalize_topk;
  a.capacity = r.capacity;
  a.logits = dl.get();
  a.bias = db.get();
  const RouteBuffers b = routeBuffers(ws.get(), tokens, e_n, k);
  const RouteSummary sum = routeOnDevice(nullptr, a, b);
  EXPECT_EQ(sum.routed, r.routed);
  EXPECT_EQ(sum.kept, r.kept);
  if (tokens == 0) return;
  auto down = [](const auto* p, std::size_t n) {
    std::vector<std::remove_const_t<std::remove_pointer_t<decltype(p)>>> h(n);
    PLM_CHECK_CUDA(cudaDeviceSynchronize());
    PLM_CHECK_CUDA(cudaMemcpy(h.data(), p, n * sizeof(h[0]), cudaMemcpyDeviceToHost));
    return h;
  };
  const std::size_t slots = std::size_t(tokens) * k, rows = r.rows();
  EXPECT_EQ(down(b.expert, slots), std::vector<std::int32_t>(r.expert.begin(), r.expert.end()));
  EXPECT_EQ(down(b.slot_row, slots), std::vector<std::int32_t>(r.row.begin(), r.row.end()));
  EXPECT_EQ(down(b.row_token, rows),
            std::vector<std::int32_t>(r.row_token.begin(), r.row_token.end()));
  const auto gate = down(b.gate, slots);
  const auto row_gate = down(b.row_gate, rows);
  for (std::size_t s = 0; s < slots; ++s) ASSERT_EQ(gate[s], float(r.gate[s])) << "slot " << s;
  for (std::size_t p = 0; p < rows; ++p)
    ASSERT_EQ(row_gate[p], float(r.row_gate[p])) << "row " << p;
  EXPECT_NEAR(sum.lse2_sum / tokens, r.z, 1e-12 * std::abs(r.z));
  EXPECT_NEAR(sum.entropy_sum / tokens, r.entropy, 1e-12 * std::abs(r.entropy));
  double aux = 0;
  for (int e = 0; e < e_n; ++e) {
    double p = 0;
    for (int t = 0; t < tokens; ++t) p += r.prob[std::size_t(t) * e_n + e];
    EXPECT_NEAR(sum.prob_sum[e], p, 1e-12 * tokens) << "expert " << e;
    aux += e_n * (double(r.routed[e]) / (double(tokens) * k)) * (sum.prob_sum[e] / tokens);
  }
  EXPECT_NEAR(aux, r.aux, 1e-12);

  // Backward: random gate gradients, the aux and z losses.
  const auto dgate_f = test::randomNormal(slots, seed + 1);
  const double aux_scale = 0.3, z_scale = 0.05;
  std::vector<double> aux_dp(e_n);
  for (int e = 0; e < e_n; ++e)
    aux_dp[e] = aux_scale * e_n * (double(r.routed[e]) / (double(tokens) * k)) / tokens;
  DeviceBuffer<float> dgate(dgate_f), dlogits(std::size_t(tokens) * e_n);
  dlogits.poison();
  routeBackwardOnDevice(nullptr, a, b, dgate.get(), aux_dp, z_scale, dlogits.get());
  std::vector<double> dg(dgate_f.begin(), dgate_f.end()), ref(std::size_t(tokens) * e_n);
  model::routeBackward(r, c, logits.data(), dg.data(), aux_scale, z_scale, ref.data());
  EXPECT_LT(test::relError(dlogits.download(), ref), 1e-6) << "logit gradient";
}

// The asynchronous routing (routeOnDeviceAsync + routeSummary, what the MoE layer runs) on a
// stream of its own, one RouteReadback reused over routings of other sizes (dropless, a
// capacity cut, no tokens), once with a second routing launched before the first's summary was
// taken: every summary is bit for bit routeOnDevice's of the same (last) routing.
TEST(MoeRouting, AsyncReadbackMatchesRouteOnDevice) {
  const int e_n = 8, k = 2;
  cudaStream_t stream = nullptr;
  PLM_CHECK_CUDA(cudaStreamCreate(&stream));
  RouteReadback rb;
  auto expectSame = [](const RouteSummary& got, const RouteSummary& want, int tokens) {
    EXPECT_EQ(got.routed, want.routed) << tokens << " tokens";
    EXPECT_EQ(got.kept, want.kept) << tokens << " tokens";
    EXPECT_EQ(got.prob_sum, want.prob_sum) << tokens << " tokens";
    EXPECT_EQ(got.lse2_sum, want.lse2_sum) << tokens << " tokens";
    EXPECT_EQ(got.entropy_sum, want.entropy_sum) << tokens << " tokens";
  };
  for (const int tokens : {300, 1000, 0, 777}) {
    auto logits = test::randomNormal(std::size_t(tokens) * e_n, 40 + tokens, 1.5f);
    DeviceBuffer<float> dl(std::max<std::size_t>(logits.size(), 1));
    if (tokens > 0) dl.upload(logits);
    const std::size_t bytes = routeWorkspaceBytes(tokens, e_n, k);
    DeviceBuffer<char> ws(bytes), ws_ref(bytes);
    RouteArgs a;
    a.tokens = tokens;
    a.experts = e_n;
    a.top_k = k;
    a.capacity = tokens == 777 ? 150 : 0;
    a.logits = dl.get();
    const RouteBuffers b = routeBuffers(ws.get(), tokens, e_n, k);
    const RouteBuffers b_ref = routeBuffers(ws_ref.get(), tokens, e_n, k);
    const RouteSummary want = routeOnDevice(nullptr, a, b_ref);
    routeOnDeviceAsync(stream, a, b, rb);
    expectSame(routeSummary(rb), want, tokens);
    if (tokens == 1000) {  // a routing replaced before its summary was taken
      RouteArgs other = a;
      other.tokens = 500;
      routeOnDeviceAsync(stream, other, b, rb);
      routeOnDeviceAsync(stream, a, b, rb);
      expectSame(routeSummary(rb), want, tokens);
    }
  }
  PLM_CHECK_CUDA(cudaStreamDestroy(stream));
}

TEST(MoeRouting, DeviceMatchesHostReference) {
  model::MoeConfig c;
  c.experts = 8;
  c.top_k = 2;
  c.expert_ffn = 8;
  checkRouting(c, 300, false, false, 11);  // dropless softmax, 600 slots: 3 uneven chunks
  checkRouting(c, 0, false, false, 12);    // no tokens
  c.capacity_factor = 1.0;
  checkRouting(c, 1000, true, true, 13);  // capacity cut, ties, an empty expert
  c.router = model::RouterKind::Sigmoid;
  c.normalize_topk = false;
  checkRouting(c, 777, true, false, 14);
  c.normalize_topk = true;
  c.capacity_factor = 1.25;
  checkRouting(c, 129, false, true, 15);
  c.experts = 64;
  c.top_k = 8;
  c.router = model::RouterKind::Softmax;
  checkRouting(c, 1000, true, true, 16);  // fine-grained
  c.capacity_factor = 0;
  c.top_k = 1;
  checkRouting(c, 513, false, false, 17);  // top-1
}

// The router's products with its bf16 input (gpu::routerLogits, gpu::routerOuter) against
// double references from the same bf16 values: logits and h s; dW accumulated onto non-zero
// values and X^T gs written.  11 experts (a group of 8 and one of 3), hidden 72 (a partial
// 256-column tile), 1,000 tokens (8 row slices of 125), and a rerun bitwise equal.
TEST(MoeRouter, Bf16InputProductsMatchDouble) {
  const int tokens = 1000, hidden = 72, e_n = 11;
  ASSERT_TRUE(routerFitsShared(hidden, e_n));
  Bf16Tensor h(test::randomNormal(std::size_t(tokens) * hidden, 31));
  const auto w0 = test::randomNormal(std::size_t(e_n) * hidden, 32, 0.1f);
  const auto s0 = test::randomNormal(hidden, 33);
  DeviceBuffer<float> w(w0), s(s0), logits(std::size_t(tokens) * e_n), hs(tokens);
  logits.poison();
  hs.poison();
  routerLogits(nullptr, h.get(), tokens, hidden, w.get(), e_n, s.get(), logits.get(), hs.get());
  std::vector<double> l_ref(std::size_t(tokens) * e_n), hs_ref(tokens);
  for (int t = 0; t < tokens; ++t) {
    for (int e = 0; e < e_n; ++e) {
      double a = 0;
      for (int c = 0; c < hidden; ++c) a += double(h.values[t * hidden + c]) * w0[e * hidden + c];
      l_ref[std::size_t(t) * e_n + e] = a;
    }
    double a = 0;
    for (int c = 0; c < hidden; ++c) a += double(h.values[t * hidden + c]) * s0[c];
    hs_ref[t] = a;
  }
  EXPECT_LT(test::relError(logits.download(), l_ref), 1e-5) << "logits";
  EXPECT_LT(test::relError(hs.download(), hs_ref), 1e-5) << "h s";

  const auto g0 = test::randomNormal(std::size_t(tokens) * e_n, 34);
  const auto gs0 = test::randomNormal(tokens, 35);
  const auto dw0 = test::randomNormal(std::size_t(e_n) * hidden, 36);
  DeviceBuffer<float> g(g0), gs(gs0), dw(dw0), xg(hidden);
  xg.poison();
  const std::size_t bytes = routerOuterWorkspaceBytes(tokens, hidden, e_n);
  DeviceBuffer<char> ws(bytes);
  routerOuter(nullptr, h.get(), g.get(), tokens, hidden, e_n, gs.get(), dw.get(), xg.get(),
              ws.get(), bytes);
  std::vector<double> dw_ref(dw0.begin(), dw0.end()), xg_ref(hidden, 0.0);
  for (int t = 0; t < tokens; ++t)
    for (int c = 0; c < hidden; ++c) {
      const double x = h.values[t * hidden + c];
      for (int e = 0; e < e_n; ++e) dw_ref[e * hidden + c] += double(g0[t * e_n + e]) * x;
      xg_ref[c] += double(gs0[t]) * x;
    }
  const auto dw_got = dw.download(), xg_got = xg.download();
  EXPECT_LT(test::relError(dw_got, dw_ref), 1e-5) << "dW += G^T h";
  EXPECT_LT(test::relError(xg_got, xg_ref), 1e-5) << "X^T gs";
  dw.upload(dw0);
  routerOuter(nullptr, h.get(), g.get(), tokens, hidden, e_n, gs.get(), dw.get(), xg.get(),
              ws.get(), bytes);
  EXPECT_EQ(dw.download(), dw_got) << "rerun not bitwise equal";
  EXPECT_EQ(xg.download(), xg_got) << "rerun not bitwise equal";
  EXPECT_THROW(routerOuter(nullptr, h.get(), g.get(), tokens, hidden, e_n, gs.get(), dw.get(),
                           xg.get(), ws.get(), bytes - 4),
               Error)
      << "workspace too small";
}

}  // namespace
}  // namespace plm::gpu
