// MoE GPU kernels against the portable path's arithmetic (host double, from the same
// bf16-rounded inputs): the permutation (gatherRows with the host routing's row order), the
// looped cuBLASLt expert FFNs, the fused gate-weighted unpermute with the residual, its backward
// (gate gradients and the permuted output gradient) and the combine of the input gradient.  The
// routing drops slots (capacity 1.0) and leaves one expert without rows (selection bias -100),
// so the kernels see dropped slots, a token with none kept and an empty expert.
#include "gpu/fused.hpp"
#include "gpu/moe.hpp"
#include "gpu_test_util.hpp"
#include "model/moe.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <deque>

namespace plm::gpu {
namespace {

using test::Bf16Tensor;
using test::DeviceBuffer;

double geluTanh(double x) {
  return 0.5 * x * (1.0 + std::tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)));
}

TEST(MoeKernels, MatchThePortableArithmetic) {
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
}

}  // namespace
}  // namespace plm::gpu
