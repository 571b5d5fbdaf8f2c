// The FP8 scaling state machine (model/fp8_scaling.hpp): Transformer Engine's scale rule
// (margin, amax 0 or non-finite keeps the scale, overflow to FLT_MAX), the amax history's roll
// and its reduce modes, power-of-two block scales, the deck validation, the one all-reduce of
// a step on 1, 2 and 4 ranks, and the portable FP8 GEMM against a plain loop.
#include "core/error.hpp"
#include "dist/runtime.hpp"
#include "model/fp8_gemm.hpp"
#include "model/fp8_scaling.hpp"

#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <random>
#include <vector>

namespace {

using namespace plm::model;

TEST(Fp8Scale, TransformerEngineRule) {
  EXPECT_EQ(delayedScale(448.0f, 448.0f, 0, 7.0f), 1.0f);
  EXPECT_EQ(delayedScale(2.0f, 448.0f, 0, 7.0f), 224.0f);
  EXPECT_EQ(delayedScale(2.0f, 448.0f, 1, 7.0f), 112.0f);  // margin halves
  EXPECT_EQ(delayedScale(2.0f, 448.0f, 3, 7.0f), 28.0f);
  EXPECT_EQ(delayedScale(0.0f, 448.0f, 0, 7.0f), 7.0f);  // zero keeps the old scale
  EXPECT_EQ(delayedScale(NAN, 448.0f, 0, 7.0f), 7.0f);   // non-finite keeps it
  EXPECT_EQ(delayedScale(INFINITY, 448.0f, 0, 7.0f), 7.0f);
  EXPECT_EQ(delayedScale(1e-45f, 448.0f, 0, 7.0f), FLT_MAX);  // overflow: the largest float
  EXPECT_EQ(currentScale(4.0f, 57344.0f), 14336.0f);
  EXPECT_EQ(currentScale(0.0f, 448.0f), 1.0f);
  // Power-of-two scales: the largest 2^k not above fp8_max / amax.
  EXPECT_EQ(powerOfTwoScale(1.0f, 448.0f), 256.0f);
  EXPECT_EQ(powerOfTwoScale(448.0f, 448.0f), 1.0f);
  EXPECT_EQ(powerOfTwoScale(500.0f, 448.0f), 0.5f);
  EXPECT_EQ(powerOfTwoScale(0.001f, 448.0f), 262144.0f);
  EXPECT_EQ(powerOfTwoScale(0.0f, 448.0f), 1.0f);
}

Fp8Config delayed(int history, AmaxReduce reduce, int margin = 0) {
  Fp8Config c;
  c.amax_history = history;
  c.amax_reduce = reduce;
  c.margin = margin;
  return c;
}

// Runs steps with the given amaxes on one operand and returns the scale after each step.
std::vector<float> scalesAfter(const Fp8Config& c, const std::vector<float>& amaxes, Fp8Operand o) {
  Fp8Scaling s(c, 2);
  const int t = s.index(1, Fp8Gemm::FfnOut, o);
  std::vector<float> out;
  for (float a : amaxes) {
    s.record(t, a * 0.5f);  // several casts in a step: the max counts
    s.record(t, a);
    s.endStep(MPI_COMM_NULL);
    out.push_back(s.scale(t));
    EXPECT_EQ(s.scaleInv(t), 1.0f / s.scale(t));
    EXPECT_EQ(s.currentAmax(t), 0.0f);  // the next step starts from 0
  }
  // Other operands never recorded: scale 1.
  EXPECT_EQ(s.scale(s.index(0, Fp8Gemm::Qkv, Fp8Operand::Input)), 1.0f);
  return out;
}

TEST(Fp8Scaling, HistoryRollsOverItsWindow) {
  // Window of 3 steps: 4 stays the max for three steps, then leaves.
  const auto s =
      scalesAfter(delayed(3, AmaxReduce::Max), {4, 2, 1, 0.5f, 0.25f, 0.125f}, Fp8Operand::Input);
  EXPECT_EQ(s, (std::vector<float>{112, 112, 112, 224, 448, 896}));
}

TEST(Fp8Scaling, MostRecentUsesTheLastStep) {
  const auto s = scalesAfter(delayed(3, AmaxReduce::MostRecent), {4, 2, 1, 8}, Fp8Operand::Weight);
  EXPECT_EQ(s, (std::vector<float>{112, 224, 448, 56}));
}

TEST(Fp8Scaling, MarginAndGradientFormat) {
  // Hybrid: gradients in E5M2 (max 57344); margin 2 divides by 4.
  auto s = scalesAfter(delayed(4, AmaxReduce::Max, 2), {2}, Fp8Operand::Grad);
  EXPECT_EQ(s[0], 57344.0f / 2 / 4);
  Fp8Config c = delayed(4, AmaxReduce::Max);
  c.format = Fp8Format::E4M3;
  s = scalesAfter(c, {2}, Fp8Operand::Grad);
  EXPECT_EQ(s[0], 224.0f);
  c.recipe = Fp8Recipe::Block;
  c.format = Fp8Format::Hybrid;
  EXPECT_EQ(c.gradFormat(), fp8::Format::E4M3);  // block scaling: E4M3 both ways
}

TEST(Fp8Scaling, ZeroAndNonFiniteAmaxKeepTheScale) {
  // 0 keeps; NaN keeps and, under `max`, keeps the scale until it leaves the window.
  const auto s = scalesAfter(delayed(2, AmaxReduce::Max), {4, 0, NAN, 2, 1, 1}, Fp8Operand::Input);
  EXPECT_EQ(s, (std::vector<float>{112, 112, 112, 112, 224, 448}));
  const auto r =
      scalesAfter(delayed(2, AmaxReduce::MostRecent), {4, 0, INFINITY, 2}, Fp8Operand::Input);
  EXPECT_EQ(r, (std::vector<float>{112, 112, 112, 224}));
}

TEST(Fp8Scaling, RestoreContinuesExactly) {
  Fp8Config c = delayed(5, AmaxReduce::Max);
  Fp8Scaling a(c, 3), b(c, 3);
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> u(0.01f, 10.0f);
  auto run = [&](Fp8Scaling& s, int steps, std::mt19937& g) {
    for (int k = 0; k < steps; ++k) {
      for (int t = 0; t < s.numTensors(); ++t) s.record(t, u(g));
      s.endStep(MPI_COMM_NULL);
    }
  };
  run(a, 4, rng);
  b.restore(a.histories(), a.scales(), a.steps());
  std::mt19937 rng2 = rng;
  run(a, 6, rng);
  run(b, 6, rng2);
  EXPECT_EQ(a.histories(), b.histories());
  EXPECT_EQ(a.scales(), b.scales());
  EXPECT_EQ(a.steps(), b.steps());
  Fp8Scaling other(c, 2);
  EXPECT_THROW(other.restore(a.histories(), a.scales(), 1), plm::Error);
}

TEST(Fp8Scaling, ConfigErrorsNameTheKey) {
  auto message = [](const Fp8Config& c, int layers) {
    try {
      c.validate(layers);
    } catch (const plm::Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  Fp8Config c;
  c.amax_history = 0;
  EXPECT_NE(message(c, 4).find("fp8.amax_history"), std::string::npos);
  c = Fp8Config();
  c.margin = -1;
  EXPECT_NE(message(c, 4).find("fp8.margin"), std::string::npos);
  c = Fp8Config();
  c.first_layers_bf16 = 3;
  c.last_layers_bf16 = 2;
  EXPECT_NE(message(c, 4).find("exceed the model's 4 layers"), std::string::npos);
  EXPECT_TRUE(message(c, 5).empty());
  EXPECT_FALSE(c.fp8Layer(2, 5));
  EXPECT_FALSE(c.fp8Layer(3, 5));
  EXPECT_THROW(parseFp8Recipe("mxfp8"), plm::Error);
  EXPECT_EQ(parseFp8Recipe("block"), Fp8Recipe::Block);
  EXPECT_EQ(parseAmaxReduce("most_recent"), AmaxReduce::MostRecent);
  EXPECT_THROW(parseFp8Wgrad("fp16"), plm::Error);
}

// One all-reduce per step: rank r records amax r + 1 on every operand (and 100 on one operand
// of rank 0 only); every rank ends with the scales of the global max.
TEST(Fp8Scaling, AmaxReducedOverRanksOnce) {
  const int world = plm::dist::worldSize(), rank = plm::dist::worldRank();
  Fp8Scaling s(delayed(8, AmaxReduce::MostRecent), 2);
  for (int t = 0; t < s.numTensors(); ++t) s.record(t, float(rank + 1));
  if (rank == 0) s.record(5, 100.0f);
  s.endStep(MPI_COMM_WORLD);
  for (int t = 0; t < s.numTensors(); ++t) {
    const float amax = t == 5 ? 100.0f : float(world);
    const float fmax = t % 3 == 2 ? 57344.0f : 448.0f;
    EXPECT_EQ(s.scale(t), fmax / amax) << t;
  }
  EXPECT_EQ(s.histories()[std::size_t(5) * 8 + 7], 100.0f);  // rolled to the end
}

// The portable FP8 GEMM against a plain loop over quantised operands (delayed, current, block).
TEST(Fp8Gemm, ForwardAndBackwardMatchPlainLoops) {
  const std::int64_t rows = 150, in = 260, out = 140;  // partial blocks on every edge
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  auto fill = [&](plm::View2<float> v, float scale) {
    auto h = Kokkos::create_mirror_view(v);
    for (std::size_t i = 0; i < v.size(); ++i) h.data()[i] = normal(rng) * scale;
    h(3, 7) = 40.0f * scale;  // one outlier: its block gets a smaller scale
    Kokkos::deep_copy(v, h);
  };
  plm::View2<float> x("x", rows, in), w("w", out, in), dy("dy", rows, out);
  fill(x, 2.0f);
  fill(w, 0.05f);
  fill(dy, 1e-3f);
  for (Fp8Recipe recipe : {Fp8Recipe::Delayed, Fp8Recipe::Current, Fp8Recipe::Block}) {
    Fp8Config c;
    c.recipe = recipe;
    Fp8Scaling scaling(c, 1);
    scaling.setRecording(true);
    if (recipe == Fp8Recipe::Delayed) {  // a step with these amaxes sets the scales
      for (int o = 0; o < 3; ++o)
        scaling.record(scaling.index(0, Fp8Gemm::FfnIn, Fp8Operand(o)), o == 0   ? 10.0f
                                                                        : o == 1 ? 0.3f
                                                                                 : 5e-3f);
      scaling.endStep(MPI_COMM_NULL);
    }
    Fp8GemmSlot slot{&scaling, 0, Fp8Gemm::FfnIn};
    plm::model::OpContext ctx{plm::ExecSpace()};
    plm::View2<float> wq("wq", out, in);
    fp8QuantizeOperand(plm::ExecSpace(), slot, Fp8Operand::Weight, Fp8Blocks::Square, true, w, wq);
    plm::View1<float> b("b", out), db("db", out);
    plm::View2<float> y("y", rows, out), dx("dx", rows, in), dw("dw", out, in);
    fp8LinearForward(ctx, slot, x, wq, b, 0.0f, y);
    fp8LinearBackward(ctx, slot, x, wq, dy, 0.0f, dx, dw, db);
    // Reference: quantise on the host with the recipe's scales, then plain loops in double.
    auto hx = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), x);
    auto hw = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), w);
    auto hdy = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), dy);
    auto quant = [&](auto& h, std::int64_t r, std::int64_t cc, int br, int bc, fp8::Format f,
                     int operand) {
      std::vector<float> q(r * cc);
      for (std::int64_t r0 = 0; r0 < r; r0 += br)
        for (std::int64_t c0 = 0; c0 < cc; c0 += bc) {
          float amax = 0;
          for (std::int64_t i = r0; i < std::min(r, r0 + br); ++i)
            for (std::int64_t j = c0; j < std::min(cc, c0 + bc); ++j)
              amax = std::max(amax, std::fabs(h(i, j)));
          float s = recipe == Fp8Recipe::Block     ? powerOfTwoScale(amax, fp8::maxOf(f))
                    : recipe == Fp8Recipe::Current ? currentScale(amax, fp8::maxOf(f))
                                                   : scaling.scale(slot.index(Fp8Operand(operand)));
          for (std::int64_t i = r0; i < std::min(r, r0 + br); ++i)
            for (std::int64_t j = c0; j < std::min(cc, c0 + bc); ++j)
              q[i * cc + j] = fp8::quantize(f, h(i, j), s, 1.0f / s);
        }
      return q;
    };
    const bool block = recipe == Fp8Recipe::Block;
    const auto gf = c.gradFormat();
    const auto xr = quant(hx, rows, in, block ? 1 : rows, block ? 128 : in, fp8::Format::E4M3, 0);
    const auto xc = quant(hx, rows, in, block ? 128 : rows, block ? 1 : in, fp8::Format::E4M3, 0);
    const auto wr = quant(hw, out, in, block ? 128 : out, block ? 128 : in, fp8::Format::E4M3, 1);
    const auto dr = quant(hdy, rows, out, block ? 1 : rows, block ? 128 : out, gf, 2);
    const auto dc = quant(hdy, rows, out, block ? 128 : rows, block ? 1 : out, gf, 2);
    auto hy = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), y);
    auto hdx = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), dx);
    auto hdw = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), dw);
    auto hdb = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), db);
    double worst = 0;
    // Relative to the value (plus a floor of the typical magnitude for cancelling sums).
    auto check = [&](double got, double want, double scale) {
      worst = std::max(worst, std::fabs(got - want) / (std::fabs(want) + scale));
    };
    for (std::int64_t i = 0; i < rows; ++i)
      for (std::int64_t j = 0; j < out; ++j) {
        double s = 0;
        for (std::int64_t k = 0; k < in; ++k) s += double(xr[i * in + k]) * wr[j * in + k];
        check(hy(i, j), s, 1.0);
      }
    for (std::int64_t i = 0; i < rows; ++i)
      for (std::int64_t k = 0; k < in; ++k) {
        double s = 0;
        for (std::int64_t j = 0; j < out; ++j) s += double(dr[i * out + j]) * wr[j * in + k];
        check(hdx(i, k), s, 1e-3);
      }
    for (std::int64_t j = 0; j < out; ++j) {
      double sb = 0;
      for (std::int64_t i = 0; i < rows; ++i) sb += hdy(i, j);
      check(hdb(j), sb, 1e-3);
      for (std::int64_t k = 0; k < in; ++k) {
        double s = 0;
        for (std::int64_t i = 0; i < rows; ++i) s += double(dc[i * out + j]) * xc[i * in + k];
        check(hdw(j, k), s, 1e-3);
      }
    }
    // fp32 accumulation (BLAS order) of at most 260 terms vs double, with cancellation:
    // about 1e-5 relative; a wrong scale, format or block would show at FP8 resolution (1e-2).
    EXPECT_LT(worst, 1e-4) << fp8RecipeName(recipe);
    // And the FP8 result differs from the unquantised one (the emulation is not a no-op).
    double plain = 0;
    for (std::int64_t k = 0; k < in; ++k) plain += double(hx(0, k)) * hw(0, k);
    EXPECT_NE(float(plain), hy(0, 0)) << fp8RecipeName(recipe);
  }
}

}  // namespace
