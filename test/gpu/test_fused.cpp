// Fused kernels against host double references: LayerNorm forward/backward, rotary (and its
// inverse), embedding with token dropout (forward/backward), cross-entropy, gradient norm and
// AdamW.
#include "gpu/fused.hpp"
#include "gpu/layer_norm.hpp"
#include "gpu_test_util.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

namespace plm::gpu {
namespace {

using test::Bf16Tensor;
using test::DeviceBuffer;

// x fp32 (the residual stream) or bf16, fp32 gamma/beta (the masters), bf16 output; the backward
// with dy fp32 or bf16 in both modes: plain (dx written as bf16) and residual (fp32 residual
// gradient += dx, its bf16 copy written).  Widths: ESM-2's 320 to 5120 (every tile: one warp per
// row up to 640 or 1280, then 2, 4, 8 warps), 328 and 1000 and 4104 (multiples of 8 between the
// tiles, partly filled), 322 (even but not a multiple of 4: the pair kernels).  About 2.6M values
// per case: more row groups than 3 blocks per SM on 132 SMs hold at once, so the persistent
// backward blocks take several rows each and the fixed-order partial sums of dgamma/dbeta are
// exercised; a rerun must be bitwise identical.
struct LnWidthCase {
  int cols;
  bool x_bf16;
  bool dy_bf16;
};

class LayerNormWidth : public ::testing::TestWithParam<LnWidthCase> {};

// fp32 values on the device as fp32 or bf16; `values` what the device holds.
struct Input {
  std::vector<float> values;
  DeviceBuffer<float> f32;
  DeviceBuffer<std::uint16_t> b16;
  Input(const std::vector<float>& v, bool bf16_values)
      : values(v), f32(bf16_values ? 0 : v.size()), b16(bf16_values ? v.size() : 0) {
    if (!bf16_values) {
      f32.upload(v);
      return;
    }
    std::vector<std::uint16_t> bits(v.size());
    for (std::size_t i = 0; i < v.size(); ++i) {
      bits[i] = test::toBf16Bits(v[i]);
      values[i] = test::fromBf16Bits(bits[i]);
    }
    b16.upload(bits);
  }
};

TEST_P(LayerNormWidth, ForwardBackward) {
  const LnWidthCase p = GetParam();
  const int cols = p.cols;
  const std::int64_t rows = 2'560'000 / cols + 3;
  const std::int64_t n = rows * cols;
  std::vector<float> xh = test::randomNormal(n, 1, 2.0f);
  for (std::int64_t i = 0; i < n; i += 5) xh[i] += 1.0f;  // non-zero means
  Input x(xh, p.x_bf16), dy(test::randomNormal(n, 4), p.dy_bf16);
  auto g0 = test::randomNormal(cols, 2);
  for (auto& g : g0) g += 1.0f;
  const auto b0 = test::randomNormal(cols, 3);
  DeviceBuffer<float> gamma(g0), beta(b0);
  DeviceBuffer<std::uint16_t> y(n), dx(n), dx2(n), dres_bf(n);
  DeviceBuffer<float> mean(rows), rstd(rows);
  std::vector<float> dg0 = test::randomNormal(cols, 5), db0 = test::randomNormal(cols, 6);
  std::vector<float> res0 = test::randomNormal(n, 8);
  DeviceBuffer<float> dgamma(dg0), dbeta(db0), residual(res0), residual2(res0);
  DeviceBuffer<std::uint8_t> work(layerNormBackwardWorkspace(rows, cols));
  y.poison();
  dx.poison();
  auto forward = [&](auto* xp) {
    layerNormForward(nullptr, xp, gamma.get(), beta.get(), reinterpret_cast<bf16*>(y.get()),
                     mean.get(), rstd.get(), rows, cols, 1e-5f);
  };
  auto backward = [&](float* res, bool accumulate, DeviceBuffer<std::uint16_t>& out) {
    auto call = [&](auto* xp, auto* dyp) {
      layerNormBackward(nullptr, dyp, xp, gamma.get(), mean.get(), rstd.get(), res, accumulate,
                        reinterpret_cast<bf16*>(out.get()), dgamma.get(), dbeta.get(), rows, cols,
                        work.get());
    };
    auto with_dy = [&](auto* xp) {
      if (p.dy_bf16)
        call(xp, reinterpret_cast<const bf16*>(dy.b16.get()));
      else
        call(xp, static_cast<const float*>(dy.f32.get()));
    };
    if (p.x_bf16)
      with_dy(reinterpret_cast<const bf16*>(x.b16.get()));
    else
      with_dy(static_cast<const float*>(x.f32.get()));
  };
  if (p.x_bf16)
    forward(reinterpret_cast<const bf16*>(x.b16.get()));
  else
    forward(static_cast<const float*>(x.f32.get()));
  backward(nullptr, false, dx);
  const auto dg1 = dgamma.download(), db1 = dbeta.download();
  backward(residual.get(), true, dres_bf);

  std::vector<double> y_ref(n), dx_ref(n), dg_ref(dg0.begin(), dg0.end()),
      db_ref(db0.begin(), db0.end()), res_ref(n);
  for (std::int64_t r = 0; r < rows; ++r) {
    const float* xr = x.values.data() + r * cols;
    const float* dyr = dy.values.data() + r * cols;
    double mu = 0, var = 0;
    for (int c = 0; c < cols; ++c) mu += xr[c];
    mu /= cols;
    for (int c = 0; c < cols; ++c) var += (xr[c] - mu) * (xr[c] - mu);
    double rs = 1.0 / std::sqrt(var / cols + 1e-5);
    double a = 0, b = 0;
    for (int c = 0; c < cols; ++c) {
      double h = (xr[c] - mu) * rs, d = dyr[c];
      y_ref[r * cols + c] = h * g0[c] + b0[c];
      a += d * g0[c];
      b += d * g0[c] * h;
      dg_ref[c] += 2 * d * h;  // two backward calls
      db_ref[c] += 2 * d;
    }
    a /= cols;
    b /= cols;
    for (int c = 0; c < cols; ++c) {
      double h = (xr[c] - mu) * rs;
      dx_ref[r * cols + c] = rs * (dyr[c] * g0[c] - a - h * b);
      res_ref[r * cols + c] = res0[r * cols + c] + dx_ref[r * cols + c];
    }
  }
  const std::string what = "cols " + std::to_string(cols) + (p.x_bf16 ? " x bf16" : " x fp32") +
                           (p.dy_bf16 ? " dy bf16" : " dy fp32");
  EXPECT_LT(test::relError(test::downloadBf16(y), y_ref), 1e-2) << what;
  EXPECT_LT(test::relError(test::downloadBf16(dx), dx_ref), 1e-2) << what;
  EXPECT_LT(test::relError(residual.download(), res_ref), 1e-5) << what;
  EXPECT_LT(test::relError(test::downloadBf16(dres_bf), res_ref), 1e-2) << what;
  EXPECT_LT(test::relError(dgamma.download(), dg_ref), 1e-4) << what;
  EXPECT_LT(test::relError(dbeta.download(), db_ref), 1e-4) << what;

  // Reruns from the same state: bitwise the same dgamma, dbeta, dx and residual gradient.
  const auto dx1 = dx.download(), dres1 = dres_bf.download();
  const auto res1 = residual.download();
  dgamma.upload(dg0);
  dbeta.upload(db0);
  backward(nullptr, false, dx2);
  EXPECT_EQ(dgamma.download(), dg1) << what;
  EXPECT_EQ(dbeta.download(), db1) << what;
  EXPECT_EQ(dx2.download(), dx1) << what;
  dres_bf.poison();
  backward(residual2.get(), true, dres_bf);
  EXPECT_EQ(residual2.download(), res1) << what;
  EXPECT_EQ(dres_bf.download(), dres1) << what;
}

std::vector<LnWidthCase> layerNormWidthCases() {
  std::vector<LnWidthCase> cases;
  for (int cols : {320, 480, 640, 1280, 2560, 5120, 328, 1000, 4104, 322})
    for (int types = 0; types < 4; ++types) cases.push_back({cols, types / 2 == 1, types % 2 == 1});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(FusedKernels, LayerNormWidth, ::testing::ValuesIn(layerNormWidthCases()),
                         [](const ::testing::TestParamInfo<LnWidthCase>& info) {
                           return std::to_string(info.param.cols) +
                                  (info.param.x_bf16 ? "_xbf16" : "_xf32") +
                                  (info.param.dy_bf16 ? "_dybf16" : "_dyf32");
                         });

// dx = dy * gelu'(pre): the 16-byte path (aligned, 8 elements a step), an unaligned start and a
// length that is not a multiple of 8 (one element at a time), and in place (dx = dy, as the FP8
// dgrad's dGELU pass runs), each against the host in double.
TEST(FusedKernels, GeluTanhBackwardVectorTailAndInPlace) {
  const std::int64_t n = 4099;
  const Bf16Tensor dy(test::randomNormal(n + 1, 41)), pre(test::randomNormal(n + 1, 42, 2.0f));
  auto want = [&](std::int64_t off, std::int64_t count) {
    std::vector<double> w(count);
    for (std::int64_t i = 0; i < count; ++i) {
      const double x = pre.values[off + i], c = 0.7978845608028654;
      const double t = std::tanh(c * (x + 0.044715 * x * x * x));
      w[i] = dy.values[off + i] *
             (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * c * (1.0 + 3.0 * 0.044715 * x * x));
    }
    return w;
  };
  for (const std::int64_t off : {std::int64_t(0), std::int64_t(1)}) {
    for (const std::int64_t count : {std::int64_t(4096), n}) {
      DeviceBuffer<std::uint16_t> dx(n + 1);
      geluTanhBackward(nullptr, dy.get() + off, pre.get() + off,
                       reinterpret_cast<bf16*>(dx.get()) + off, count);
      PLM_CHECK_CUDA(cudaDeviceSynchronize());
      const std::vector<float> got = test::downloadBf16(dx);
      const std::vector<float> part(got.begin() + off, got.begin() + off + count);
      const std::string what = "offset " + std::to_string(off) + ", " + std::to_string(count);
      EXPECT_LT(test::relError(part, want(off, count)), 4e-3) << what;
    }
  }
  Bf16Tensor inplace(dy.values);  // dx = dy
  geluTanhBackward(nullptr, inplace.get(), pre.get(), inplace.get(), n);
  PLM_CHECK_CUDA(cudaDeviceSynchronize());
  std::vector<float> got = test::downloadBf16(inplace.device);
  got.resize(n);
  EXPECT_LT(test::relError(got, want(0, n)), 4e-3) << "in place";
}

TEST(FusedKernels, RotaryPositionsRestartPerSequenceAndInverseUndoes) {
  std::vector<std::int32_t> cu{0, 1, 300, 317, 1341};
  const std::int64_t tokens = cu.back();
  const int heads = 2, dim = 64;
  const std::int64_t stride = 3 * heads * dim;  // q and k inside a QKV row
  std::vector<float> qkv0 = test::randomNormal(tokens * stride, 7);
  Bf16Tensor qkv(qkv0);
  std::vector<std::int32_t> positions(tokens);
  for (std::size_t s = 0; s + 1 < cu.size(); ++s)
    for (int t = cu[s]; t < cu[s + 1]; ++t) positions[t] = t - cu[s];
  DeviceBuffer<std::int32_t> pos_dev(positions);
  bf16* q = qkv.get();
  bf16* k = qkv.get() + heads * dim;
  const float q_scale = 0.125f;
  rotary(nullptr, q, stride, k, stride, pos_dev.get(), tokens, heads, dim, false, q_scale);
  auto out = test::downloadBf16(qkv.device);
  std::vector<double> ref(qkv.values.begin(), qkv.values.end());
  for (std::size_t s = 0; s + 1 < cu.size(); ++s)
    for (int t = cu[s]; t < cu[s + 1]; ++t)
      for (int which = 0; which < 2; ++which)
        for (int h = 0; h < heads; ++h)
          for (int i = 0; i < dim / 2; ++i) {
            double inv_freq = 1.0 / std::pow(10000.0, 2.0 * i / dim);
            double ang = (t - cu[s]) * inv_freq;
            std::int64_t base = t * stride + which * heads * dim + h * dim;
            double x1 = qkv.values[base + i], x2 = qkv.values[base + i + dim / 2];
            double f = which == 0 ? q_scale : 1.0;
            ref[base + i] = f * (x1 * std::cos(ang) - x2 * std::sin(ang));
            ref[base + i + dim / 2] = f * (x2 * std::cos(ang) + x1 * std::sin(ang));
          }
  EXPECT_LT(test::relError(out, ref), 1e-2);
  // V (the third block of each row) is untouched.
  for (std::int64_t t = 0; t < tokens; ++t)
    for (int i = 0; i < heads * dim; ++i)
      ASSERT_EQ(out[t * stride + 2 * heads * dim + i],
                qkv.values[t * stride + 2 * heads * dim + i]);
  rotary(nullptr, q, stride, k, stride, pos_dev.get(), tokens, heads, dim, true, 1.0f / q_scale);
  EXPECT_LT(test::relError(test::downloadBf16(qkv.device), qkv.values), 1.5e-2);
}

TEST(FusedKernels, EmbeddingTokenDropoutForwardBackward) {
  const int vocab = 33, cols = 320, mask = 32;
  std::vector<std::int32_t> cu{0, 5, 6, 400, 1000};
  const std::int64_t tokens = cu.back();
  std::mt19937 rng(9);
  std::vector<std::uint8_t> ids(tokens);
  for (auto& id : ids) id = static_cast<std::uint8_t>(rng() % 100 < 15 ? mask : 4 + rng() % 20);
  ids[5] = 7;    // a length-1 sequence without a mask token
  ids[700] = 1;  // a padding token: embedded, but its row gets no gradient
  Bf16Tensor w(test::randomNormal(vocab * cols, 10)), dout(test::randomNormal(tokens * cols, 11));
  DeviceBuffer<std::uint8_t> ids_dev(ids);
  DeviceBuffer<std::int32_t> cu_dev(cu);
  DeviceBuffer<std::uint16_t> out(tokens * cols);
  std::vector<float> dw0 = test::randomNormal(vocab * cols, 12);
  DeviceBuffer<float> dw(dw0);
  out.poison();
  embeddingForward(nullptr, ids_dev.get(), w.get(), reinterpret_cast<bf16*>(out.get()),
                   cu_dev.get(), 4, cols, mask, true);
  DeviceBuffer<std::uint8_t> work(embeddingBackwardWorkspace(4, vocab, cols));
  embeddingBackward(nullptr, ids_dev.get(), dout.get(), dw.get(), cu_dev.get(), 4, vocab, cols,
                    mask, true, /*padding_id=*/1, work.get());
  const auto dw_once = dw.download();
  // Same inputs from the same starting point: bitwise the same (no float atomics).
  dw.upload(dw0);
  embeddingBackward(nullptr, ids_dev.get(), dout.get(), dw.get(), cu_dev.get(), 4, vocab, cols,
                    mask, true, /*padding_id=*/1, work.get());
  EXPECT_EQ(dw.download(), dw_once);
  std::vector<double> out_ref(tokens * cols), dw_ref(dw0.begin(), dw0.end());
  for (std::size_t s = 0; s + 1 < cu.size(); ++s) {
    int len = cu[s + 1] - cu[s], nmask = 0;
    for (int t = cu[s]; t < cu[s + 1]; ++t) nmask += ids[t] == mask;
    double scale = (1.0 - 0.12) / (1.0 - double(nmask) / len);
    for (int t = cu[s]; t < cu[s + 1]; ++t)
      for (int c = 0; c < cols; ++c) {
        bool m = ids[t] == mask;
        out_ref[t * cols + c] = m ? 0.0 : w.values[ids[t] * cols + c] * scale;
        if (!m && ids[t] != 1) dw_ref[ids[t] * cols + c] += scale * dout.values[t * cols + c];
      }
  }
  EXPECT_LT(test::relError(test::downloadBf16(out), out_ref), 1e-2);
  EXPECT_LT(test::relError(dw.download(), dw_ref), 1e-5);
}

TEST(FusedKernels, CrossEntropyLossAndGradient) {
  const std::int64_t rows = 1000;
  const int vocab = 33;
  std::vector<float> logits = test::randomNormal(rows * vocab, 13, 3.0f);
  std::vector<std::int32_t> labels(rows);
  std::mt19937 rng(14);
  for (auto& l : labels) l = rng() % 4 == 0 ? static_cast<std::int32_t>(rng() % vocab) : -100;
  DeviceBuffer<float> logits_dev(logits);
  DeviceBuffer<std::int32_t> labels_dev(labels);
  DeviceBuffer<std::uint16_t> dlogits(rows * vocab);
  DeviceBuffer<double> loss(std::vector<double>{0.5});
  dlogits.poison();
  const float grad_scale = 0.01f;
  crossEntropy(nullptr, logits_dev.get(), labels_dev.get(), reinterpret_cast<bf16*>(dlogits.get()),
               loss.get(), rows, vocab, grad_scale);
  double loss_ref = 0.5;
  std::vector<double> d_ref(rows * vocab, 0.0);
  for (std::int64_t r = 0; r < rows; ++r) {
    if (labels[r] < 0) continue;
    double mx = -1e300, se = 0;
    for (int i = 0; i < vocab; ++i) mx = std::max(mx, double(logits[r * vocab + i]));
    for (int i = 0; i < vocab; ++i) se += std::exp(logits[r * vocab + i] - mx);
    double lse = mx + std::log(se);
    loss_ref += lse - logits[r * vocab + labels[r]];
    for (int i = 0; i < vocab; ++i)
      d_ref[r * vocab + i] =
          grad_scale * (std::exp(logits[r * vocab + i] - lse) - (i == labels[r]));
  }
  EXPECT_NEAR(loss.download()[0], loss_ref, 1e-5 * std::abs(loss_ref));
  EXPECT_LT(test::relError(test::downloadBf16(dlogits), d_ref), 1e-2);
}

TEST(FusedKernels, CrossEntropyWithRowStride) {
  const std::int64_t rows = 50;
  const int vocab = 33, ld = 40;
  std::vector<float> logits = test::randomNormal(rows * ld, 19, 2.0f);
  std::vector<std::int32_t> labels(rows);
  for (std::int64_t r = 0; r < rows; ++r) labels[r] = static_cast<std::int32_t>((r * 7) % vocab);
  DeviceBuffer<float> logits_dev(logits);
  DeviceBuffer<std::int32_t> labels_dev(labels);
  DeviceBuffer<std::uint16_t> dlogits(rows * ld);
  DeviceBuffer<double> loss(std::vector<double>{0.0});
  dlogits.poison();
  crossEntropy(nullptr, logits_dev.get(), labels_dev.get(), reinterpret_cast<bf16*>(dlogits.get()),
               loss.get(), rows, vocab, 1.0f, ld);
  double loss_ref = 0;
  std::vector<double> d_ref(rows * ld, 0.0);
  for (std::int64_t r = 0; r < rows; ++r) {
    double mx = -1e300, se = 0;
    for (int i = 0; i < vocab; ++i) mx = std::max(mx, double(logits[r * ld + i]));
    for (int i = 0; i < vocab; ++i) se += std::exp(logits[r * ld + i] - mx);
    double lse = mx + std::log(se);
    loss_ref += lse - logits[r * ld + labels[r]];
    for (int i = 0; i < vocab; ++i)
      d_ref[r * ld + i] = std::exp(logits[r * ld + i] - lse) - (i == labels[r]);
  }
  EXPECT_NEAR(loss.download()[0], loss_ref, 1e-5 * loss_ref);
  EXPECT_LT(test::relError(test::downloadBf16(dlogits), d_ref), 1e-2);  // padding columns are 0
}

TEST(FusedKernels, AdamWWithClippingAndDecayMask) {
  const std::int64_t n = 100003;
  std::vector<std::int64_t> seg{0, 1000, 1001, 50000, n};
  std::vector<std::uint8_t> decay{1, 0, 1, 0};
  auto w0 = test::randomNormal(n, 15), g0 = test::randomNormal(n, 16, 5.0f);
  auto m0 = test::randomNormal(n, 17, 0.1f), v0 = test::randomNormal(n, 18, 0.1f);
  for (auto& x : v0) x = x * x;
  DeviceBuffer<float> w(w0), g(g0), m(m0), v(v0);
  DeviceBuffer<std::uint16_t> wb(n);
  DeviceBuffer<std::int64_t> seg_dev(seg);
  DeviceBuffer<std::uint8_t> decay_dev(decay);
  DeviceBuffer<double> sumsq(std::vector<double>{0.0});
  wb.poison();
  sumSquares(nullptr, g.get(), n, sumsq.get());
  AdamWParams p;
  p.lr = 1e-3f;
  p.weight_decay = 0.01f;
  p.step = 3;
  p.grad_scale = 0.5f;
  p.max_norm = 1.0f;
  p.grad_sumsq = sumsq.get();
  adamwStep(nullptr, w.get(), g.get(), m.get(), v.get(), reinterpret_cast<bf16*>(wb.get()), n,
            seg_dev.get(), decay_dev.get(), 4, p);
  double ss = 0;
  for (float x : g0) ss += double(x) * x;
  EXPECT_NEAR(sumsq.download()[0], ss, 1e-5 * ss);
  double norm = std::sqrt(ss) * p.grad_scale;
  double scale = p.grad_scale * (norm > p.max_norm ? p.max_norm / (norm + 1e-6) : 1.0);
  std::vector<double> w_ref(n), m_ref(n), v_ref(n);
  double bc1 = 1 - std::pow(0.9, 3), bc2 = 1 - std::pow(0.98, 3);
  for (std::int64_t i = 0; i < n; ++i) {
    int s = 0;
    while (seg[s + 1] <= i) ++s;
    double gi = g0[i] * scale, wi = w0[i];
    if (decay[s]) wi -= 1e-3 * 0.01 * wi;
    m_ref[i] = 0.9 * m0[i] + 0.1 * gi;
    v_ref[i] = 0.98 * v0[i] + 0.02 * gi * gi;
    w_ref[i] = wi - 1e-3 / bc1 * m_ref[i] / (std::sqrt(v_ref[i] / bc2) + 1e-8);
  }
  auto w_out = w.download();
  double max_diff = 0;
  for (std::int64_t i = 0; i < n; ++i) max_diff = std::max(max_diff, std::abs(w_out[i] - w_ref[i]));
  EXPECT_LT(max_diff, 1e-6);
  EXPECT_LT(test::relError(m.download(), m_ref), 1e-5);
  EXPECT_LT(test::relError(v.download(), v_ref), 1e-5);
  EXPECT_LT(test::relError(test::downloadBf16(wb), w_ref), 1e-2);
}

}  // namespace
}  // namespace plm::gpu
