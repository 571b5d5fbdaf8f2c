// The bf16 MoE layer of the training step (MoeMlp on the CUDA path: cuBLASLt expert GEMMs
// forward and backward, the fused unpermute / combine kernels, the router in fp32) against the
// same layer on the portable fp32 path, on the same GPU, from the same parameters and inputs
// (rounded to bf16 once, so both paths start from identical values and router logits equal to
// fp32 rounding (the bf16 path's gpu::routerLogits sums in another order than the reference's
// GEMM), here the identical routing: the bf16 path routes on the device, the reference on the
// host): the
// layer output, the input gradient and every parameter gradient (router, each expert's W1, b1, W2,
// b2, the shared experts') at bf16 tolerance.
//
// Why these tolerances: the bf16 path rounds the activations it keeps (pre-activation, GELU
// output, expert output, the permuted gradients) to 8 mantissa bits (relative 2^-9 = 0.2% each)
// and uses the tanh GELU of cuBLASLt's epilogue where the portable path uses erf (they differ
// by at most 1e-3 in absolute value); a chain of three or four such roundings gives about 1%
// relative (L2) error, the threshold is 3% (5% for the router, whose gradient is a sum over
// tokens of dot products of rounded rows).  A wrong index, gate or transposition errs by 30% to
// 100%.  Reruns are bitwise identical (no float atomics) and gradients accumulate (+=).
// GroupedExperts.* repeat the comparison with the grouped expert GEMMs (moe.expert_gemm: grouped),
// 64 experts top-8 and SwiGLU experts among them.
#include "gpu/moe_grouped.hpp"
#include "gpu_test_util.hpp"
#include "model/moe.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <deque>
#include <memory>
#include <string>

namespace plm::model {
namespace {

using gpu::test::Bf16Tensor;
using gpu::test::DeviceBuffer;
using gpu::test::relError;

std::vector<float> rounded(std::vector<float> v) {
  for (auto& x : v) x = gpu::test::roundBf16(x);
  return v;
}

Mat matOf(void* p, DType d, std::int64_t rows, std::int64_t cols) {
  return Mat{p, d, rows, cols, cols};
}
Vec vecOf(void* p, DType d, std::int64_t n) { return Vec{p, d, n}; }

/// One layer's parameters: fp32 (the reference's), their bf16 copies, fp32 gradients of each.
struct Params {
  struct Tensor {
    std::string name;
    std::int64_t rows, cols;  // cols 0: a vector
    std::vector<float> values;
    std::unique_ptr<DeviceBuffer<float>> f32, grad_ref, grad;
    std::unique_ptr<Bf16Tensor> b16;
  };
  std::deque<Tensor> t;

  Tensor& add(const std::string& name, std::int64_t rows, std::int64_t cols, std::uint64_t seed,
              float scale, float shift = 0) {
    auto v = gpu::test::randomNormal(rows * (cols ? cols : 1), seed, scale);
    for (auto& x : v) x += shift;
    t.push_back({name, rows, cols, rounded(v), nullptr, nullptr, nullptr, nullptr});
    auto& x = t.back();
    x.f32 = std::make_unique<DeviceBuffer<float>>(x.values);
    x.b16 = std::make_unique<Bf16Tensor>(x.values);
    std::vector<float> zero(x.values.size(), 0.0f);
    x.grad_ref = std::make_unique<DeviceBuffer<float>>(zero);
    x.grad = std::make_unique<DeviceBuffer<float>>(zero);
    return x;
  }
};

Mat wmat(Params::Tensor& x, bool bf16) {
  return bf16 ? matOf(x.b16->get(), DType::BF16, x.rows, x.cols)
              : matOf(x.f32->get(), DType::F32, x.rows, x.cols);
}
Vec wvec(Params::Tensor& x, bool bf16) {
  return bf16 ? vecOf(x.b16->get(), DType::BF16, x.rows) : vecOf(x.f32->get(), DType::F32, x.rows);
}
Mat gmat(Params::Tensor& x, bool ref) {
  return matOf(ref ? x.grad_ref->get() : x.grad->get(), DType::F32, x.rows, x.cols);
}
Vec gvec(Params::Tensor& x, bool ref) {
  return vecOf(ref ? x.grad_ref->get() : x.grad->get(), DType::F32, x.rows);
}

void compare(const MoeConfig& c, int tokens, int hidden, bool empty_expert) {
  const int e_n = c.experts, fe = c.expert_ffn, sw = c.shared_experts * fe;
  Params p;
  auto& router = p.add("router", e_n, hidden, 1, 0.3f);
  std::vector<Params::Tensor*> ex;
  // GELU experts: w1, b1, w2, b2; SwiGLU experts: [gate; up] (2 F_e, H) and down, no biases.
  const bool swiglu = c.swiglu();
  const int stride = swiglu ? 2 : 4;
  for (int e = 0; e < e_n; ++e) {
    const std::string n = "expert " + std::to_string(e) + " ";
    ex.push_back(&p.add(n + "w1", swiglu ? 2 * fe : fe, hidden, 10 + e, 0.15f));
    if (!swiglu) ex.push_back(&p.add(n + "b1", fe, 0, 30 + e, 0.1f));
    ex.push_back(&p.add(n + "w2", hidden, fe, 50 + e, 0.15f));
    if (!swiglu) ex.push_back(&p.add(n + "b2", hidden, 0, 70 + e, 0.1f));
  }
  std::vector<Params::Tensor*> sh;
  if (sw > 0) {
    sh.push_back(&p.add("shared w1", sw, hidden, 90, 0.15f));
    sh.push_back(&p.add("shared b1", sw, 0, 91, 0.1f));
    sh.push_back(&p.add("shared w2", hidden, sw, 92, 0.15f));
    sh.push_back(&p.add("shared b2", hidden, 0, 93, 0.1f));
  }
  // Selection bias (fp32, both paths): expert 3 receives no rows when asked.
  std::vector<float> bias(e_n, 0.0f);
  if (empty_expert) bias[3] = -100.0f;
  DeviceBuffer<float> bias_d(bias);

  auto weights = [&](bool bf16) {
    MoeWeights w;
    w.router = matOf(router.f32->get(), DType::F32, e_n, hidden);
    if (c.bias_balance) w.expert_bias = vecOf(bias_d.get(), DType::F32, e_n);
    for (int e = 0; e < e_n; ++e) {
      DenseMlpWeights d;
      if (swiglu) {
        d.w1 = wmat(*ex[stride * e], bf16);
        d.w2 = wmat(*ex[stride * e + 1], bf16);
        w.experts.push_back(d);
        continue;
      }
      d.w1 = wmat(*ex[4 * e], bf16);
      d.b1 = wvec(*ex[4 * e + 1], bf16);
      d.w2 = wmat(*ex[4 * e + 2], bf16);
      d.b2 = wvec(*ex[4 * e + 3], bf16);  // an expert's output (and so b2) is bf16
      w.experts.push_back(d);
    }
    if (sw > 0) {
      w.shared.w1 = wmat(*sh[0], bf16);
      w.shared.b1 = wvec(*sh[1], bf16);
      w.shared.w2 = wmat(*sh[2], bf16);
      w.shared.b2 = wvec(*sh[3], false);  // added into the fp32 residual stream
    }
    return w;
  };
  auto grads = [&](bool ref) {
    MoeWeights g;
    g.router = gmat(router, ref);
    for (int e = 0; e < e_n; ++e) {
      DenseMlpWeights d;
      if (swiglu) {
        d.w1 = gmat(*ex[stride * e], ref);
        d.w2 = gmat(*ex[stride * e + 1], ref);
        g.experts.push_back(d);
        continue;
      }
      d.w1 = gmat(*ex[4 * e], ref);
      d.b1 = gvec(*ex[4 * e + 1], ref);
      d.w2 = gmat(*ex[4 * e + 2], ref);
      d.b2 = gvec(*ex[4 * e + 3], ref);
      g.experts.push_back(d);
    }
    if (sw > 0) {
      g.shared.w1 = gmat(*sh[0], ref);
      g.shared.b1 = gvec(*sh[1], ref);
      g.shared.w2 = gmat(*sh[2], ref);
      g.shared.b2 = gvec(*sh[3], ref);
    }
    return g;
  };

  const auto h0 = rounded(gpu::test::randomNormal(std::size_t(tokens) * hidden, 2));
  const auto res0 = gpu::test::randomNormal(std::size_t(tokens) * hidden, 3);
  const auto dout0 = rounded(gpu::test::randomNormal(std::size_t(tokens) * hidden, 4, 0.5f));
  DeviceBuffer<float> h_f(h0), res(res0), out_ref(tokens * hidden), out(tokens * hidden),
      dout_f(dout0), dh_ref(tokens * hidden);
  Bf16Tensor h_b(h0), dout_b(dout0);
  DeviceBuffer<std::uint16_t> dh(std::size_t(tokens) * hidden);
  out.poison();
  dh.poison();

  MoeStep step_ref, step;
  for (MoeStep* s : {&step_ref, &step}) {
    s->loss_weight = 0.7;
    s->grad_scale = 1.0;
    s->training = true;
  }
  OpContext ctx_ref{ExecSpace()}, ctx{ExecSpace()};
  ctx.cuda();
  MoeMlp<float> ref(0, c, hidden, weights(false), grads(true), &step_ref);
  MoeMlp<float> m(0, c, hidden, weights(true), grads(false), &step);
  LayerScratch scratch;

  LayerActs saved_ref;
  saved_ref.ln2 = matOf(h_f.get(), DType::F32, tokens, hidden);
  ref.forward(ctx_ref, saved_ref.ln2, matOf(res.get(), DType::F32, tokens, hidden),
              matOf(out_ref.get(), DType::F32, tokens, hidden), saved_ref);
  ref.backward(ctx_ref, saved_ref, matOf(dout_f.get(), DType::F32, tokens, hidden),
               matOf(dh_ref.get(), DType::F32, tokens, hidden), scratch);

  LayerActs saved;
  saved.ln2 = matOf(h_b.get(), DType::BF16, tokens, hidden);
  auto pass = [&] {
    m.forward(ctx, saved.ln2, matOf(res.get(), DType::F32, tokens, hidden),
              matOf(out.get(), DType::F32, tokens, hidden), saved);
    m.backward(ctx, saved, matOf(dout_b.get(), DType::BF16, tokens, hidden),
               matOf(dh.get(), DType::BF16, tokens, hidden), scratch);
    Kokkos::fence();
  };
  pass();

  // The routing the tests are about: drops, an empty expert, a token with no slot kept.
  const auto& st = m.stats();
  EXPECT_EQ(st.routed, ref.stats().routed) << "both paths route identically";
  // Device routing sums in another order than the host reference, and the bf16 path's logits
  // come from gpu::routerLogits (another fp32 summation order than the reference's GEMM): equal
  // to fp32 rounding (2e-9 to 5.3e-9 relative, measured on an H200).
  EXPECT_NEAR(step.objective, step_ref.objective, 1e-7 * std::abs(step_ref.objective))
      << "router losses";
  EXPECT_GT(step_ref.objective, 0.0);
  if (c.capacity_factor > 0) EXPECT_GT(st.dropped, 0) << "capacity should drop slots";
  if (empty_expert) EXPECT_EQ(st.routed[3], 0.0) << "expert 3 should be empty";

  const auto o = out.download(), o_ref = out_ref.download();
  // The output holds the fp32 residual: compare the MoE part alone.
  std::vector<double> d(o.size()), d_ref(o.size());
  for (std::size_t i = 0; i < o.size(); ++i) {
    d[i] = double(o[i]) - res0[i];
    d_ref[i] = double(o_ref[i]) - res0[i];
  }
  EXPECT_LT(relError(d, d_ref), 2e-2) << "layer output (minus the residual)";
  const auto dh_got = gpu::test::downloadBf16(dh);
  EXPECT_LT(relError(dh_got, dh_ref.download()), 3e-2) << "input gradient";
  std::vector<std::vector<float>> g1;
  for (auto& x : p.t) {
    const auto got = x.grad->download(), want = x.grad_ref->download();
    g1.push_back(got);
    double norm = 0;
    for (float v : want) norm += double(v) * v;
    if (norm == 0) {  // an expert without rows: nothing may be written
      EXPECT_EQ(got, want) << x.name;
      continue;
    }
    EXPECT_LT(relError(got, want), x.name == "router" ? 5e-2 : 3e-2) << x.name;
  }

  // Rerun: bitwise the same output and input gradient; gradients accumulate.
  pass();
  EXPECT_EQ(out.download(), o) << "rerun output";
  EXPECT_EQ(gpu::test::downloadBf16(dh), dh_got) << "rerun input gradient";
  std::size_t i = 0;
  for (auto& x : p.t) {
    std::vector<double> twice(g1[i].size());
    for (std::size_t j = 0; j < twice.size(); ++j) twice[j] = 2.0 * g1[i][j];
    EXPECT_LT(relError(x.grad->download(), twice), 1e-6) << x.name << " accumulates";
    ++i;
  }
}

MoeConfig config() {
  MoeConfig c;
  c.experts = 8;
  c.top_k = 2;
  c.expert_ffn = 96;
  c.aux_loss = 0.01;
  c.z_loss = 1e-3;
  return c;
}

TEST(MoeBf16, DroplessMatchesFp32) {
  auto c = config();
  compare(c, 300, 64, false);
}

// SwiGLU experts: the per-expert cuBLASLt loop (forced: auto would take the grouped backward
// at this size) with the fused SiLU-gate kernels against the fp32 portable path (itself checked
// against the formula and by finite differences on the CPU).
TEST(MoeBf16, SwigluExpertsMatchFp32) {
  auto c = config();
  c.expert_activation = ExpertActivation::Swiglu;
  c.expert_gemm = ExpertGemmMode::Loop;
  compare(c, 300, 64, false);
  c.capacity_factor = 1.0;
  c.shared_experts = 1;
  c.bias_balance = true;
  compare(c, 257, 128, true);
}

TEST(MoeBf16, CapacityEmptyExpertSharedExpertsSigmoid) {
  auto c = config();
  c.capacity_factor = 1.0;
  c.shared_experts = 1;
  c.bias_balance = true;
  c.router = RouterKind::Sigmoid;
  c.seq_aux_loss = 0.0;
  compare(c, 257, 128, true);
}

/// The same comparisons with the experts' GEMMs forced to CUTLASS's grouped launches
/// (gpu/moe_grouped.hpp) by moe.expert_gemm: grouped.
class GroupedExperts : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!gpu::groupedExpertGemmAvailable()) GTEST_SKIP() << "no CUTLASS build or not sm_90";
  }
  static MoeConfig config() {
    MoeConfig c = ::plm::model::config();
    c.expert_gemm = ExpertGemmMode::Grouped;
    return c;
  }
};

TEST_F(GroupedExperts, DroplessMatchesFp32) { compare(config(), 300, 64, false); }

TEST_F(GroupedExperts, CapacityEmptyExpertSharedExpertsSigmoid) {
  auto c = config();
  c.capacity_factor = 1.0;
  c.shared_experts = 1;
  c.bias_balance = true;  // the selection bias that empties expert 3 is the balancing bias
  c.router = RouterKind::Sigmoid;
  compare(c, 257, 128, true);
}

// SwiGLU experts on the grouped path ([gate; up] one grouped GEMM, the fused SiLU-gate kernels
// over all rows) against the fp32 portable path, with an emptied expert and the capacity cut.
TEST_F(GroupedExperts, SwigluExpertsMatchFp32) {
  auto c = config();
  c.expert_activation = ExpertActivation::Swiglu;
  compare(c, 300, 64, false);
  c.capacity_factor = 1.0;
  c.shared_experts = 1;
  c.bias_balance = true;
  compare(c, 257, 128, true);
}

TEST_F(GroupedExperts, SixtyFourExpertsTopEight) {
  auto c = config();
  c.experts = 64;
  c.top_k = 8;
  c.expert_ffn = 32;
  c.bias_balance = true;
  compare(c, 200, 64, true);
}

}  // namespace
}  // namespace plm::model
