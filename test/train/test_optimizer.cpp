// AdamW, clipping and the learning-rate schedule against plain scalar references (the formulas
// of torch.optim.AdamW and torch.nn.utils.clip_grad_norm_ written out in double).
#include "core/error.hpp"
#include "train/optim/adamw.hpp"
#include "train/schedule.hpp"
#include "views.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

namespace {

using plm::View1;
using plm::model::TensorInfo;
using plm::test::fromView;
using plm::test::toView;
using plm::train::AdamW;
using plm::train::AdamWOptions;
using plm::train::FrozenRange;

TensorInfo info(const std::string& name, std::int64_t offset, std::int64_t size, bool decay) {
  TensorInfo t;
  t.name = name;
  t.shape = {size};
  t.offset = offset;
  t.size = size;
  t.weight_decay = decay;
  return t;
}

std::vector<float> randomVector(std::size_t n, std::mt19937& gen, double scale) {
  std::normal_distribution<double> normal(0.0, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = static_cast<float>(normal(gen));
  return v;
}

// torch.optim.AdamW for one element, in double.
struct ScalarAdamW {
  double p, m = 0, v = 0;
  void step(double g, double lr, std::int64_t t, const AdamWOptions& o, bool decay) {
    if (decay) p *= 1.0 - lr * o.weight_decay;
    m = o.beta1 * m + (1 - o.beta1) * g;
    v = o.beta2 * v + (1 - o.beta2) * g * g;
    const double bc1 = 1 - std::pow(o.beta1, static_cast<double>(t));
    const double bc2 = 1 - std::pow(o.beta2, static_cast<double>(t));
    p -= (lr / bc1) * m / (std::sqrt(v) / std::sqrt(bc2) + o.eps);
  }
};

TEST(AdamW, MatchesScalarReferenceWithDecayMaskAndFrozenRows) {
  // Tensors: a decayed weight (12), a bias without decay (5), an "embedding" without decay
  // (4 rows x 3) whose row 1 is frozen (the padding row).
  const std::int64_t n = 12 + 5 + 12;
  std::vector<TensorInfo> tensors = {info("w", 0, 12, true), info("b", 12, 5, false),
                                     info("emb", 17, 12, false)};
  std::vector<FrozenRange> frozen = {{17 + 3, 3}};
  AdamWOptions o;
  o.beta1 = 0.9;
  o.beta2 = 0.98;
  o.eps = 1e-8;
  o.weight_decay = 0.1;  // large, so a wrong mask shows

  std::mt19937 gen(7);
  std::vector<float> p0 = randomVector(n, gen, 0.5);
  for (int i = 20; i < 23; ++i) p0[i] = 0.0f;  // padding row starts at zero
  View1<float> params = toView(p0);
  AdamW<float> opt(params, tensors, o, frozen);
  EXPECT_TRUE(opt.mastersAlias());

  std::vector<ScalarAdamW> ref(n);
  for (std::int64_t i = 0; i < n; ++i) ref[i].p = p0[i];

  const double lrs[] = {1e-3, 5e-3, 2e-2, 1e-2, 3e-3};
  const double scales[] = {1.0, 0.5, 1.0, 0.25, 1.0};
  for (int s = 0; s < 5; ++s) {
    std::vector<float> g = randomVector(n, gen, 1.0);
    View1<float> grads = toView(g);
    opt.maskGradients(plm::ExecSpace(), grads);
    auto masked = fromView(grads);
    for (int i = 20; i < 23; ++i) EXPECT_EQ(masked[i], 0.0f) << "frozen gradient not zeroed";
    opt.step(plm::ExecSpace(), grads, lrs[s], scales[s]);
    for (std::int64_t i = 0; i < n; ++i) {
      if (i >= 20 && i < 23) continue;
      ref[i].step(static_cast<double>(g[i]) * scales[s], lrs[s], s + 1, o, i < 12);
    }
  }
  EXPECT_EQ(opt.stepCount(), 5);
  auto p = fromView(params);
  for (std::int64_t i = 0; i < n; ++i) {
    if (i >= 20 && i < 23) {
      EXPECT_EQ(p[i], 0.0f) << "padding row moved at " << i;
      continue;
    }
    EXPECT_NEAR(p[i], ref[i].p, 2e-6 * (1 + std::abs(ref[i].p))) << "element " << i;
  }
  auto m = fromView(opt.expAvg());
  auto v = fromView(opt.expAvgSq());
  for (std::int64_t i = 0; i < 12; ++i) {
    EXPECT_NEAR(m[i], ref[i].m, 1e-6 * (1 + std::abs(ref[i].m)));
    EXPECT_NEAR(v[i], ref[i].v, 1e-6 * (1 + std::abs(ref[i].v)));
  }
}

TEST(AdamW, DecayOnlyWhereFlagged) {
  // Zero gradient: only the decayed tensor moves, by exactly (1 - lr*wd).
  std::vector<TensorInfo> tensors = {info("w", 0, 4, true), info("b", 4, 4, false)};
  AdamWOptions o;
  o.weight_decay = 0.5;
  View1<float> params = toView(std::vector<float>(8, 2.0f));
  View1<float> grads = toView(std::vector<float>(8, 0.0f));
  AdamW<float> opt(params, tensors, o);
  opt.step(plm::ExecSpace(), grads, 0.1);
  auto p = fromView(params);
  for (int i = 0; i < 4; ++i) EXPECT_FLOAT_EQ(p[i], 2.0f * (1.0f - 0.05f));
  for (int i = 4; i < 8; ++i) EXPECT_FLOAT_EQ(p[i], 2.0f);
}

TEST(Clipping, GlobalNormAndFactor) {
  std::mt19937 gen(3);
  // An odd size so any blocked reduction has a remainder.
  std::vector<float> g = randomVector(1001, gen, 2.0);
  double sum = 0;
  for (float x : g) sum += static_cast<double>(x) * x;
  const double norm = plm::train::globalNorm(plm::ExecSpace(), toView(g));
  EXPECT_NEAR(norm, std::sqrt(sum), 1e-9 * std::sqrt(sum));
  EXPECT_NEAR(plm::train::clipFactor(norm, 1.0), 1.0 / (norm + 1e-6), 1e-12);
  EXPECT_EQ(plm::train::clipFactor(0.5, 1.0), 1.0);   // below the threshold: untouched
  EXPECT_EQ(plm::train::clipFactor(50.0, 0.0), 1.0);  // clipping off
  EXPECT_EQ(plm::train::globalNorm(plm::ExecSpace(), View1<float>("empty", 0)), 0.0);
}

TEST(Clipping, FactorInStepEqualsPrescaledGradient) {
  std::mt19937 gen(11);
  std::vector<TensorInfo> tensors = {info("w", 0, 64, true)};
  std::vector<float> p0 = randomVector(64, gen, 1.0);
  std::vector<float> g = randomVector(64, gen, 10.0);
  const double factor =
      plm::train::clipFactor(plm::train::globalNorm(plm::ExecSpace(), toView(g)), 1.0);
  ASSERT_LT(factor, 0.1);
  std::vector<float> g_scaled(g);
  for (auto& x : g_scaled) x = static_cast<float>(x * factor);

  View1<float> a = toView(p0), b = toView(p0);
  AdamW<float> opt_a(a, tensors, AdamWOptions{}), opt_b(b, tensors, AdamWOptions{});
  for (int s = 0; s < 3; ++s) {
    opt_a.step(plm::ExecSpace(), toView(g), 1e-2, factor);
    opt_b.step(plm::ExecSpace(), toView(g_scaled), 1e-2, 1.0);
  }
  auto pa = fromView(a), pb = fromView(b);
  for (int i = 0; i < 64; ++i) EXPECT_NEAR(pa[i], pb[i], 1e-6);
}

TEST(AdamW, SeparateMasterForNarrowerComputeType) {
  // P = double differs from master_t = float: the optimizer keeps its own master and writes
  // the compute copy as a cast of it.
  std::vector<TensorInfo> tensors = {info("w", 0, 8, true)};
  std::vector<double> p0(8, 1.0);
  View1<double> params = toView(p0);
  AdamW<double> opt(params, tensors, AdamWOptions{});
  EXPECT_FALSE(opt.mastersAlias());
  opt.step(plm::ExecSpace(), toView(std::vector<double>(8, 1.0)), 1e-2);
  auto master = fromView(opt.master());
  auto p = fromView(params);
  for (int i = 0; i < 8; ++i) {
    EXPECT_LT(p[i], 1.0);
    EXPECT_EQ(p[i], static_cast<double>(master[i]));
  }
}

TEST(Schedule, LinearWarmupThenLinearDecay) {
  plm::train::ScheduleOptions o;
  o.peak_lr = 4e-4;
  o.warmup_steps = 100;
  o.final_lr_ratio = 0.1;
  o.decay_steps = 1100;
  using plm::train::learningRate;
  EXPECT_DOUBLE_EQ(learningRate(o, 1), 4e-6);  // never 0: the first update counts
  EXPECT_DOUBLE_EQ(learningRate(o, 50), 2e-4);
  EXPECT_DOUBLE_EQ(learningRate(o, 100), 4e-4);
  EXPECT_DOUBLE_EQ(learningRate(o, 600), 0.5 * (4e-4 + 4e-5));
  EXPECT_DOUBLE_EQ(learningRate(o, 1100), 4e-5);
  EXPECT_DOUBLE_EQ(learningRate(o, 5000), 4e-5);
  // Monotone: up through warmup, down after.
  for (std::int64_t t = 1; t < 100; ++t) EXPECT_LT(learningRate(o, t), learningRate(o, t + 1));
  for (std::int64_t t = 100; t < 1100; ++t) EXPECT_GT(learningRate(o, t), learningRate(o, t + 1));
}

TEST(Schedule, CosineConstantAndNoWarmup) {
  plm::train::ScheduleOptions o;
  o.peak_lr = 1.0;
  o.warmup_steps = 10;
  o.final_lr_ratio = 0.2;
  o.decay_steps = 110;
  o.decay = plm::train::Decay::cosine;
  using plm::train::learningRate;
  const double pi = 3.14159265358979323846;
  EXPECT_DOUBLE_EQ(learningRate(o, 10), 1.0);
  EXPECT_NEAR(learningRate(o, 60), 0.6, 1e-12);  // halfway: the mean of peak and final
  EXPECT_NEAR(learningRate(o, 35), 0.2 + 0.8 * 0.5 * (1 + std::cos(pi / 4)), 1e-12);
  EXPECT_DOUBLE_EQ(learningRate(o, 110), 0.2);
  o.decay = plm::train::Decay::constant;
  EXPECT_DOUBLE_EQ(learningRate(o, 5), 0.5);
  EXPECT_DOUBLE_EQ(learningRate(o, 500), 1.0);
  o.decay = plm::train::Decay::linear;
  o.warmup_steps = 0;
  EXPECT_DOUBLE_EQ(learningRate(o, 1), 1.0 - 0.8 / 110);
  EXPECT_EQ(plm::train::parseDecay("cosine"), plm::train::Decay::cosine);
  EXPECT_THROW(plm::train::parseDecay("exp"), plm::Error);
}

}  // namespace
