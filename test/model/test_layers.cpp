// Each model kernel against a plain reference or central finite differences (double), plus the
// float paths against double.  Shapes are tiny and odd on purpose (no dimension a multiple of
// a block size) so every remainder path runs.
#include "model/cross_entropy.hpp"
#include "model/embedding.hpp"
#include "model/gelu.hpp"
#include "model/gemm.hpp"
#include "model/layer_norm.hpp"
#include "model/linear.hpp"
#include "model/rotary.hpp"
#include "model_test_util.hpp"

#include <string>

namespace plm::model::test {
namespace {

using V2 = View2<double>;
using V1 = View1<double>;

// ---------------------------------------------------------------- gemm

std::vector<std::string>* g_regions = nullptr;
void recordRegion(const char* name) {
  if (g_regions) g_regions->push_back(name);
}

template <class T> void checkGemmAgainstPortable(double tol) {
  const ExecSpace space;
  // (m, n, k) include 1 and a zero-sized k (C = beta C).
  const int shapes[][3] = {{5, 7, 3}, {1, 9, 4}, {13, 1, 6}, {6, 5, 0}, {33, 17, 19}};
  for (auto& s : shapes) {
    for (int ta = 0; ta < 2; ++ta)
      for (int tb = 0; tb < 2; ++tb)
        for (T beta : {T(0), T(1), T(0.5)}) {
          const int m = s[0], n = s[1], k = s[2];
          auto a = ta ? randomView<T>(k, m, 1) : randomView<T>(m, k, 1);
          auto b = tb ? randomView<T>(n, k, 2) : randomView<T>(k, n, 2);
          auto c1 = randomView<T>(m, n, 3);
          auto c2 = randomView<T>(m, n, 3);
          const Trans opa = ta ? Trans::T : Trans::N, opb = tb ? Trans::T : Trans::N;
          gemm(space, opa, opb, T(1.5), a, b, beta, c1);
          gemmPortable(space, opa, opb, T(1.5), a, b, beta, c2);
          auto x = toHost(c1), y = toHost(c2);
          for (std::size_t i = 0; i < x.size(); ++i)
            ASSERT_NEAR(x[i], y[i], tol * (1 + std::abs(y[i])))
                << "m=" << m << " n=" << n << " k=" << k << " ta=" << ta << " tb=" << tb
                << " beta=" << beta;
        }
  }
}

TEST(ModelGemm, MatchesPortableKernelEveryTransposeAndBeta) {
  checkGemmAgainstPortable<double>(1e-12);
  checkGemmAgainstPortable<float>(1e-5);
}

TEST(ModelGemm, HostPathGoesToVendorBlas) {
  if (!std::is_same_v<MemSpace, HostSpace>) GTEST_SKIP() << "device build";
  EXPECT_TRUE(gemmUsesVendorBlas<float>());
  EXPECT_TRUE(gemmUsesVendorBlas<double>());
  // Kokkos Kernels names its BLAS path in a profiling region; watch for it.
  std::vector<std::string> regions;
  g_regions = &regions;
  Kokkos::Tools::Experimental::set_push_region_callback(&recordRegion);
  auto a = randomView<float>(4, 3, 1), b = randomView<float>(3, 5, 2),
       c = randomView<float>(4, 5, 3);
  gemm(ExecSpace(), Trans::N, Trans::N, 1.0f, a, b, 0.0f, c);
  Kokkos::Tools::Experimental::set_push_region_callback(nullptr);
  g_regions = nullptr;
  bool tpl = false;
  for (auto& r : regions) tpl = tpl || r.find("TPL_BLAS") != std::string::npos;
  EXPECT_TRUE(tpl) << "KokkosBlas::gemm did not take the BLAS TPL path";
}

// ---------------------------------------------------------------- linear

TEST(ModelLinear, GradientsMatchFiniteDifferences) {
  const ExecSpace space;
  const int rows = 5, in = 4, out = 3;
  auto x = randomView<double>(rows, in, 11), w = randomView<double>(out, in, 12);
  auto b = randomVector<double>(out, 13);
  auto r = randomView<double>(rows, out, 14);  // loss = sum(y * r)
  V2 y("y", rows, out);
  auto loss = [&]() {
    linearForward(space, x, w, b, 0.0, y);
    return dotViews(y, r);
  };
  V2 dx("dx", rows, in), dw("dw", out, in);
  V1 db("db", out);
  linearBackward(space, x, w, r, 0.0, dx, dw, db);
  checkGradient("linear dx", flat(x), flat(dx), loss);
  checkGradient("linear dW", flat(w), flat(dw), loss);
  checkGradient("linear db", b, db, loss);
  // Parameter gradients accumulate; dx with beta 1 adds.
  auto dw1 = toHost(dw);
  auto dx1 = toHost(dx);
  linearBackward(space, x, w, r, 1.0, dx, dw, db);
  auto dw2 = toHost(dw);
  auto dx2 = toHost(dx);
  for (std::size_t i = 0; i < dw1.size(); ++i) EXPECT_NEAR(dw2[i], 2 * dw1[i], 1e-12);
  for (std::size_t i = 0; i < dx1.size(); ++i) EXPECT_NEAR(dx2[i], 2 * dx1[i], 1e-12);
}

TEST(ModelLinear, ResidualFormAddsToOutput) {
  const ExecSpace space;
  auto x = randomView<double>(3, 4, 1), w = randomView<double>(2, 4, 2);
  auto b = randomVector<double>(2, 3);
  auto y0 = randomView<double>(3, 2, 4);
  V2 y("y", 3, 2), fresh("fresh", 3, 2);
  Kokkos::deep_copy(y, y0);
  linearForward(space, x, w, b, 1.0, y);
  linearForward(space, x, w, b, 0.0, fresh);
  auto a = toHost(y), c = toHost(fresh), s = toHost(y0);
  for (std::size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], s[i] + c[i], 1e-12);
}

// ---------------------------------------------------------------- layer norm

TEST(ModelLayerNorm, ForwardNormalisesAndGradientsMatchFiniteDifferences) {
  const ExecSpace space;
  const int rows = 5, h = 8;
  auto x = randomView<double>(rows, h, 21, 2.0, 3.0);  // large mean: two-pass statistics matter
  auto gamma = randomVector<double>(h, 22, 0.5, 1.0), beta = randomVector<double>(h, 23);
  auto r = randomView<double>(rows, h, 24);
  V2 y("y", rows, h);
  V1 mean("mean", rows), rstd("rstd", rows);
  // With gamma = 1, beta = 0 every row has mean 0 and variance h/(h + eps h/var) ~ 1.
  {
    V1 ones("ones", h), zeros("zeros", h);
    Kokkos::deep_copy(ones, 1.0);
    layerNormForward(space, x, ones, zeros, 1e-5, y, mean, rstd);
    auto yy = toHost(y);
    for (int i = 0; i < rows; ++i) {
      double m = 0, v = 0;
      for (int c = 0; c < h; ++c) m += yy[i * h + c] / h;
      for (int c = 0; c < h; ++c) v += (yy[i * h + c] - m) * (yy[i * h + c] - m) / h;
      EXPECT_NEAR(m, 0.0, 1e-12);
      EXPECT_NEAR(v, 1.0, 1e-3);
    }
  }
  auto loss = [&]() {
    layerNormForward(space, x, gamma, beta, 1e-5, y, mean, rstd);
    return dotViews(y, r);
  };
  loss();
  V2 dx("dx", rows, h);
  V1 dg("dg", h), dbeta("db", h);
  layerNormBackward(space, x, gamma, mean, rstd, r, dx, dg, dbeta);
  checkGradient("layernorm dx", flat(x), flat(dx), loss);
  checkGradient("layernorm dgamma", gamma, dg, loss);
  checkGradient("layernorm dbeta", beta, dbeta, loss);
}

// ---------------------------------------------------------------- GELU

TEST(ModelGelu, ExactErfFormAndGradient) {
  const ExecSpace space;
  auto x = randomView<double>(4, 7, 31, 1.5);
  auto r = randomView<double>(4, 7, 32);
  V2 y("y", 4, 7);
  geluForward(space, x, y);
  auto xx = toHost(x), yy = toHost(y);
  for (std::size_t i = 0; i < xx.size(); ++i)
    EXPECT_NEAR(yy[i], 0.5 * xx[i] * (1 + std::erf(xx[i] / std::sqrt(2.0))), 1e-14);
  auto loss = [&]() {
    geluForward(space, x, y);
    return dotViews(y, r);
  };
  V2 dx("dx", 4, 7);
  geluBackward(space, x, r, dx);
  checkGradient("gelu dx", flat(x), flat(dx), loss);
}

TEST(ModelGelu, FloatApproximationMatchesDouble) {
  const ExecSpace space;
  auto xd = randomView<double>(16, 65, 33, 3.0);
  View2<float> xf("xf", 16, 65), yf("yf", 16, 65), dyf("dyf", 16, 65);
  V2 yd("yd", 16, 65), dyd("dyd", 16, 65), ones("ones", 16, 65);
  View2<float> onesf("onesf", 16, 65);
  Kokkos::deep_copy(ones, 1.0);
  Kokkos::deep_copy(onesf, 1.0f);
  auto host = toHost(xd);
  std::vector<float> hf(host.begin(), host.end());
  Kokkos::deep_copy(flat(xf), Kokkos::View<float*, HostSpace>(hf.data(), hf.size()));
  geluForward(space, xd, yd);
  geluForward(space, xf, yf);
  geluBackward(space, xd, ones, dyd);
  geluBackward(space, xf, onesf, dyf);
  auto a = toHost(yd), da = toHost(dyd);
  auto b = toHost(yf), db = toHost(dyf);
  for (std::size_t i = 0; i < a.size(); ++i) {
    EXPECT_NEAR(b[i], a[i], 1e-6 * (1 + std::abs(a[i])));
    EXPECT_NEAR(db[i], da[i], 1e-6);
  }
}

TEST(ModelMath, FloatExpIsAccurate) {
  for (double x = -80; x < 80; x += 0.0137) {
    const float got = math::exp(static_cast<float>(x));
    const double want = std::exp(double(static_cast<float>(x)));
    ASSERT_NEAR(got / want, 1.0, 4e-7) << "x=" << x;
  }
  EXPECT_LT(math::exp(-1e30f), 1e-37f);
}

// ---------------------------------------------------------------- rotary

TEST(ModelRotary, MatchesRotateHalfFormulaAndBackwardIsTranspose) {
  const ExecSpace space;
  const int tokens = 7, heads = 2, d = 6;
  View1<seqlen_t> position("pos", tokens);
  const std::vector<seqlen_t> pos_host = {0, 1, 2, 0, 1, 2, 3};  // two sequences
  Kokkos::deep_copy(position, Kokkos::View<const seqlen_t*, HostSpace>(pos_host.data(), tokens));
  V2 cos_t("cos", 8, d / 2), sin_t("sin", 8, d / 2);
  rotaryTables(space, d, cos_t, sin_t);
  auto x = randomView<double>(tokens, heads * d, 41);
  auto x0 = toHost(x);
  const double scale = 0.4;
  rotaryForward(space, x, position, heads, cos_t, sin_t, scale);
  auto y = toHost(x);
  for (int t = 0; t < tokens; ++t)
    for (int h = 0; h < heads; ++h)
      for (int i = 0; i < d / 2; ++i) {
        const double theta = pos_host[t] / std::pow(10000.0, 2.0 * i / d);
        const double a = scale * x0[t * heads * d + h * d + i],
                     b = scale * x0[t * heads * d + h * d + i + d / 2];
        EXPECT_NEAR(y[t * heads * d + h * d + i], a * std::cos(theta) - b * std::sin(theta), 1e-14);
        EXPECT_NEAR(y[t * heads * d + h * d + i + d / 2], b * std::cos(theta) + a * std::sin(theta),
                    1e-14);
      }
  // <R x, r> == <x, R^T r> for the backward.
  auto xa = randomView<double>(tokens, heads * d, 42);
  auto r = randomView<double>(tokens, heads * d, 43);
  V2 rx("rx", tokens, heads * d), rtr("rtr", tokens, heads * d);
  Kokkos::deep_copy(rx, xa);
  Kokkos::deep_copy(rtr, r);
  rotaryForward(space, rx, position, heads, cos_t, sin_t, scale);
  rotaryBackward(space, rtr, position, heads, cos_t, sin_t, scale);
  EXPECT_NEAR(dotViews(rx, r), dotViews(xa, rtr), 1e-12);
  // Gradient by finite differences as well.
  V2 work("work", tokens, heads * d);
  auto loss = [&]() {
    Kokkos::deep_copy(work, xa);
    rotaryForward(space, work, position, heads, cos_t, sin_t, scale);
    return dotViews(work, r);
  };
  checkGradient("rotary dx", flat(xa), flat(rtr), loss);
}

// ---------------------------------------------------------------- embedding + token dropout

TEST(ModelEmbedding, TokenDropoutScalesPerSequenceAndGradientMatches) {
  const ExecSpace space;
  // Three sequences of lengths 1, 5, 9 with 0, 2 and 1 <mask> tokens.
  const std::vector<token_t> tok = {0, 0, 32, 5, 32, 2, 0, 4, 5, 6, 32, 7, 8, 9, 2};
  const std::vector<seqlen_t> cu = {0, 1, 6, 15};
  const int t = static_cast<int>(tok.size()), h = 4, vocab = 33;
  View1<token_t> tokens("tok", t);
  View1<seqlen_t> cu_d("cu", 4), position("pos", t);
  Kokkos::deep_copy(tokens, Kokkos::View<const token_t*, HostSpace>(tok.data(), t));
  Kokkos::deep_copy(cu_d, Kokkos::View<const seqlen_t*, HostSpace>(cu.data(), 4));
  V1 mult("mult", t);
  sequenceInfo(space, cu_d, tokens, true, 32, position, mult);
  auto m = toHost(mult);
  auto p = toHost(position);
  const double k = 1 - 0.15 * 0.8;
  const std::vector<double> want = {k,
                                    k / (1 - 2.0 / 5),
                                    0,
                                    k / (1 - 2.0 / 5),
                                    0,
                                    k / (1 - 2.0 / 5),
                                    k / (1 - 1.0 / 9),
                                    k / (1 - 1.0 / 9),
                                    k / (1 - 1.0 / 9),
                                    k / (1 - 1.0 / 9),
                                    0,
                                    k / (1 - 1.0 / 9),
                                    k / (1 - 1.0 / 9),
                                    k / (1 - 1.0 / 9),
                                    k / (1 - 1.0 / 9)};
  const std::vector<seqlen_t> want_pos = {0, 0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6, 7, 8};
  for (int i = 0; i < t; ++i) {
    EXPECT_NEAR(m[i], want[i], 1e-15) << i;
    EXPECT_EQ(p[i], want_pos[i]) << i;
  }
  auto weight = randomView<double>(vocab, h, 51);
  auto r = randomView<double>(t, h, 52);
  V2 x("x", t, h);
  auto loss = [&]() {
    embeddingForward(space, tokens, mult, weight, x);
    return dotViews(x, r);
  };
  V2 dw("dw", vocab, h);
  embeddingBackward(space, tokens, mult, r, data::vocab::pad, dw);
  checkGradient("embedding dW", flat(weight), flat(dw), loss);
  // The padding row gets no gradient even when a <pad> token appears.
  const std::vector<token_t> with_pad = {0, 1, 2};
  View1<token_t> tp("tp", 3);
  Kokkos::deep_copy(tp, Kokkos::View<const token_t*, HostSpace>(with_pad.data(), 3));
  V1 ones("ones", 3);
  Kokkos::deep_copy(ones, 1.0);
  V2 dw2("dw2", vocab, h);
  embeddingBackward(space, tp, ones, randomView<double>(3, h, 53), data::vocab::pad, dw2);
  auto g = toHost(dw2);
  for (int c = 0; c < h; ++c) {
    EXPECT_EQ(g[1 * h + c], 0.0);
    EXPECT_NE(g[0 * h + c], 0.0);
  }
  // Token dropout off: multiplier 1 everywhere.
  sequenceInfo(space, cu_d, tokens, false, 32, position, mult);
  for (double v : toHost(mult)) EXPECT_EQ(v, 1.0);
}

// ---------------------------------------------------------------- cross-entropy

TEST(ModelCrossEntropy, SumOverLabelledRowsAndGradient) {
  const ExecSpace space;
  const int rows = 6, vocab = 33;
  auto logits = randomView<double>(rows, vocab, 61, 2.0);
  const std::vector<std::int32_t> lab = {4, -100, 32, 0, -100, 17};
  View1<std::int32_t> labels("labels", rows);
  Kokkos::deep_copy(labels, Kokkos::View<const std::int32_t*, HostSpace>(lab.data(), rows));
  V2 none;
  const double loss = crossEntropy(space, logits, labels, 1.0, none);
  auto l = toHost(logits);
  double want = 0;
  for (int i = 0; i < rows; ++i) {
    if (lab[i] < 0) continue;
    double z = 0;
    for (int c = 0; c < vocab; ++c) z += std::exp(l[i * vocab + c]);
    want += std::log(z) - l[i * vocab + lab[i]];
  }
  EXPECT_NEAR(loss, want, 1e-12);
  V2 grad("grad", rows, vocab);
  const double scale = 0.25;
  crossEntropy(space, logits, labels, scale, grad);
  V2 scaled("scaled", rows, vocab);
  Kokkos::deep_copy(scaled, grad);
  auto g = toHost(grad);
  for (int c = 0; c < vocab; ++c) EXPECT_EQ(g[1 * vocab + c], 0.0);
  // grad_scale scales the gradient, not the returned sum.
  std::vector<double> unscaled(g.size());
  for (std::size_t i = 0; i < g.size(); ++i) unscaled[i] = g[i] / scale;
  V1 unscaled_d("u", unscaled.size());
  Kokkos::deep_copy(unscaled_d, Kokkos::View<double*, HostSpace>(unscaled.data(), unscaled.size()));
  checkGradient("cross-entropy dlogits", flat(logits), unscaled_d,
                [&]() { return crossEntropy(space, logits, labels, 1.0, none); });
}

}  // namespace
}  // namespace plm::model::test
