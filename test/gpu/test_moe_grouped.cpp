// The grouped expert GEMMs (CUTLASS SM90, gpu/moe_grouped.hpp) against plain host references
// (double, from the same bf16 values) and against the loop of cuBLASLt calls: forward (x W1^T +
// b1, tanh GELU, act W2^T + b2) and backward (dy W2 with dGELU, dx, the fp32 weight and bias
// gradients accumulated onto non-zero values).  Row counts per expert include 0 (an expert left
// out of the group: its gradients must stay bit for bit), 1, and counts that are not multiples
// of 8, 16 or 64 (partial tiles), with hidden and ffn multiples of 8 but not of the 64/128 tile
// (136, 200).  A second case has 64 experts (fine-grained) with many empty ones.  Also the fp32
// router GEMM (cuBLAS, gpu/sgemm.hpp) against its plain reference in all four transpositions.
// The forwards are also run from row counts held on the device (gpu::DeviceRows, a dropless
// routing's): the same bits as from the host's counts.
// MoeGrouped.Swiglu* do the same for SwiGLU experts ([gate; up] in one grouped GEMM, the SiLU
// gate, the down GEMM; backward dact, d[gate | up], dx and the two weight gradients).
//
// Tolerances: outputs rounded to bf16 err by 2^-9 relative each; two or three roundings in a
// chain give ~0.5% (threshold 1%); the weight gradients are fp32 accumulations of exact bf16
// products (threshold 1e-4); a wrong row block, transposition or stride errs by 30% or more.
#include "gpu/gemm.hpp"
#include "gpu/moe.hpp"
#include "gpu/moe_grouped.hpp"
#include "gpu/sgemm.hpp"
#include "gpu_test_util.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <deque>
#include <numeric>

namespace plm::gpu {
namespace {

using test::Bf16Tensor;
using test::DeviceBuffer;
using test::relError;

double geluTanh(double x) {
  return 0.5 * x * (1.0 + std::tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)));
}
double geluTanhGrad(double x) {
  const double c = 0.7978845608028654, t = std::tanh(c * (x + 0.044715 * x * x * x));
  return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * c * (1.0 + 3.0 * 0.044715 * x * x);
}

bf16* bits(const DeviceBuffer<std::uint16_t>& b) { return reinterpret_cast<bf16*>(b.get()); }

/// The row counts and first rows of `rows` on the device, as a dropless routing leaves them.
struct DeviceRowsOf {
  DeviceBuffer<std::int64_t> rows, first;
  std::int64_t total;
  explicit DeviceRowsOf(const std::vector<std::int64_t>& r)
      : rows(r), first(firstRows(r)), total(std::accumulate(r.begin(), r.end(), std::int64_t(0))) {}
  static std::vector<std::int64_t> firstRows(const std::vector<std::int64_t>& r) {
    std::vector<std::int64_t> f(r.size(), 0);
    for (std::size_t e = 1; e < r.size(); ++e) f[e] = f[e - 1] + r[e - 1];
    return f;
  }
  DeviceRows view() const { return DeviceRows{rows.get(), first.get(), total}; }
};

/// Runs `forward(rows on the device, pre, act, y)` into fresh poisoned buffers sized as the
/// host-counts run's `pre`, `act` and `y`, and expects the same bits as that run.
template <class Forward> void expectDeviceRowsSameBits(const std::vector<std::int64_t>& rows,
                                                       const DeviceBuffer<std::uint16_t>& pre,
                                                       const DeviceBuffer<std::uint16_t>& act,
                                                       const DeviceBuffer<std::uint16_t>& y,
                                                       Forward forward) {
  const DeviceRowsOf d(rows);
  DeviceBuffer<std::uint16_t> pre_v(pre.size()), act_v(act.size()), y_v(y.size());
  pre_v.poison();
  act_v.poison();
  y_v.poison();
  forward(d.view(), bits(pre_v), bits(act_v), bits(y_v));
  EXPECT_EQ(pre.download(), pre_v.download()) << "pre-activation, device row counts";
  EXPECT_EQ(act.download(), act_v.download()) << "activation, device row counts";
  EXPECT_EQ(y.download(), y_v.download()) << "expert output, device row counts";
}

void checkGrouped(const std::vector<std::int64_t>& rows, int hidden, int ffn) {
  if (!groupedExpertGemmAvailable()) GTEST_SKIP() << "no CUTLASS build or not an sm_90 GPU";
  const int e_n = static_cast<int>(rows.size());
  const std::int64_t total = std::accumulate(rows.begin(), rows.end(), std::int64_t(0));
  std::vector<std::int64_t> first(e_n + 1, 0);
  for (int e = 0; e < e_n; ++e) first[e + 1] = first[e] + rows[e];

  Bf16Tensor x(test::randomNormal(total * hidden, 1));
  std::deque<Bf16Tensor> w1, b1, w2, b2;  // deque: Bf16Tensor does not move
  std::vector<ExpertWeights> weights;
  for (int e = 0; e < e_n; ++e) {
    w1.emplace_back(test::randomNormal(std::size_t(ffn) * hidden, 10 + e, 0.1f));
    b1.emplace_back(test::randomNormal(ffn, 300 + e, 0.1f));
    w2.emplace_back(test::randomNormal(std::size_t(hidden) * ffn, 600 + e, 0.1f));
    b2.emplace_back(test::randomNormal(hidden, 900 + e, 0.1f));
  }
  for (int e = 0; e < e_n; ++e)
    weights.push_back({w1[e].get(), b1[e].get(), w2[e].get(), b2[e].get()});

  // Forward, grouped and looped.
  const std::size_t ws_bytes = groupedExpertWorkspaceBytes(e_n, hidden, ffn);
  DeviceBuffer<char> ws(ws_bytes);
  DeviceBuffer<std::uint16_t> pre(total * ffn), act(total * ffn), y(total * hidden);
  DeviceBuffer<std::uint16_t> pre_l(total * ffn), act_l(total * ffn), y_l(total * hidden);
  pre.poison();
  act.poison();
  y.poison();
  groupedExpertForward(nullptr, weights, rows, x.get(), bits(pre), bits(act), bits(y), hidden, ffn,
                       ws.get(), ws_bytes);
  Gemm gemm;
  expertFfnForward(gemm, nullptr, weights, rows, x.get(), bits(pre_l), bits(act_l), bits(y_l),
                   hidden, ffn);
  const auto pre_d = test::downloadBf16(pre), act_d = test::downloadBf16(act),
             y_d = test::downloadBf16(y);
  std::vector<double> pre_ref(total * ffn), act_ref(total * ffn), y_ref(total * hidden);
  for (int e = 0; e < e_n; ++e)
    for (std::int64_t r = first[e]; r < first[e + 1]; ++r) {
      for (int i = 0; i < ffn; ++i) {
        double s = b1[e].values[i];
        for (int j = 0; j < hidden; ++j)
          s += double(w1[e].values[std::size_t(i) * hidden + j]) * x.values[r * hidden + j];
        pre_ref[r * ffn + i] = s;
        act_ref[r * ffn + i] = geluTanh(s);
      }
      for (int o = 0; o < hidden; ++o) {
        double s = b2[e].values[o];
        for (int i = 0; i < ffn; ++i)
          s += double(w2[e].values[std::size_t(o) * ffn + i]) * act_d[r * ffn + i];
        y_ref[r * hidden + o] = s;
      }
    }
  EXPECT_LT(relError(pre_d, pre_ref), 1e-2) << "pre-activation";
  EXPECT_LT(relError(act_d, act_ref), 1e-2) << "GELU output";
  EXPECT_LT(relError(y_d, y_ref), 1e-2) << "expert output (from the device's act)";
  const auto y_loop = test::downloadBf16(y_l);
  EXPECT_LT(relError(y_d, std::vector<double>(y_loop.begin(), y_loop.end())), 1e-2)
      << "grouped against the cuBLASLt loop";
  expectDeviceRowsSameBits(rows, pre, act, y, [&](const DeviceRows& d, bf16* p, bf16* a, bf16* o) {
    groupedExpertForward(nullptr, weights, d, x.get(), p, a, o, hidden, ffn, ws.get(), ws_bytes);
  });

  // Backward onto non-zero gradients (they accumulate).
  Bf16Tensor dy(test::randomNormal(total * hidden, 2));
  std::deque<DeviceBuffer<float>> gw1, gb1, gw2, gb2;
  std::vector<std::vector<float>> g0(4 * e_n);
  std::vector<ExpertGrads> grads;
  for (int e = 0; e < e_n; ++e) {
    g0[4 * e] = test::randomNormal(std::size_t(ffn) * hidden, 1000 + e, 0.5f);
    g0[4 * e + 1] = test::randomNormal(ffn, 1100 + e, 0.5f);
    g0[4 * e + 2] = test::randomNormal(std::size_t(hidden) * ffn, 1200 + e, 0.5f);
    g0[4 * e + 3] = test::randomNormal(hidden, 1300 + e, 0.5f);
    gw1.emplace_back(g0[4 * e]);
    gb1.emplace_back(g0[4 * e + 1]);
    gw2.emplace_back(g0[4 * e + 2]);
    gb2.emplace_back(g0[4 * e + 3]);
    grads.push_back({gw1[e].get(), gb1[e].get(), gw2[e].get(), gb2[e].get()});
  }
  DeviceBuffer<std::uint16_t> dpre(total * ffn), dx(total * hidden);
  dpre.poison();
  dx.poison();
  groupedExpertBackward(nullptr, weights, grads, rows, x.get(), bits(pre), bits(act), dy.get(),
                        bits(dpre), bits(dx), hidden, ffn, ws.get(), ws_bytes);
  const auto dpre_d = test::downloadBf16(dpre), dx_d = test::downloadBf16(dx);
  std::vector<double> dpre_ref(total * ffn), dx_ref(total * hidden);
  for (int e = 0; e < e_n; ++e) {
    std::vector<double> w1r(g0[4 * e].begin(), g0[4 * e].end()),
        b1r(g0[4 * e + 1].begin(), g0[4 * e + 1].end()),
        w2r(g0[4 * e + 2].begin(), g0[4 * e + 2].end()),
        b2r(g0[4 * e + 3].begin(), g0[4 * e + 3].end());
    for (std::int64_t r = first[e]; r < first[e + 1]; ++r) {
      for (int i = 0; i < ffn; ++i) {
        double s = 0;
        for (int o = 0; o < hidden; ++o)
          s += double(dy.values[r * hidden + o]) * w2[e].values[std::size_t(o) * ffn + i];
        dpre_ref[r * ffn + i] = s * geluTanhGrad(pre_d[r * ffn + i]);
      }
      for (int j = 0; j < hidden; ++j) {
        double s = 0;
        for (int i = 0; i < ffn; ++i)
          s += double(dpre_d[r * ffn + i]) * w1[e].values[std::size_t(i) * hidden + j];
        dx_ref[r * hidden + j] = s;
      }
      for (int o = 0; o < hidden; ++o) {
        b2r[o] += dy.values[r * hidden + o];
        for (int i = 0; i < ffn; ++i)
          w2r[std::size_t(o) * ffn + i] += double(dy.values[r * hidden + o]) * act_d[r * ffn + i];
      }
      for (int i = 0; i < ffn; ++i) {
        b1r[i] += dpre_d[r * ffn + i];
        for (int j = 0; j < hidden; ++j)
          w1r[std::size_t(i) * hidden + j] +=
              double(dpre_d[r * ffn + i]) * x.values[r * hidden + j];
      }
    }
    const std::string who =
        "expert " + std::to_string(e) + " (" + std::to_string(rows[e]) + " rows) ";
    if (rows[e] == 0) {
      EXPECT_EQ(gw1[e].download(), g0[4 * e]) << who << "dW1 touched";
      EXPECT_EQ(gb1[e].download(), g0[4 * e + 1]) << who << "db1 touched";
      EXPECT_EQ(gw2[e].download(), g0[4 * e + 2]) << who << "dW2 touched";
      EXPECT_EQ(gb2[e].download(), g0[4 * e + 3]) << who << "db2 touched";
      continue;
    }
    EXPECT_LT(relError(gw1[e].download(), w1r), 1e-4) << who << "dW1";
    EXPECT_LT(relError(gb1[e].download(), b1r), 1e-4) << who << "db1";
    EXPECT_LT(relError(gw2[e].download(), w2r), 1e-4) << who << "dW2";
    EXPECT_LT(relError(gb2[e].download(), b2r), 1e-4) << who << "db2";
  }
  EXPECT_LT(relError(dpre_d, dpre_ref), 1e-2) << "dpre (dGELU of dy W2)";
  EXPECT_LT(relError(dx_d, dx_ref), 1e-2) << "dx (from the device's dpre)";
}

double silu(double g) { return g / (1.0 + std::exp(-g)); }

/// SwiGLU experts (no biases, W1 = [gate; up] (2 ffn, hidden)) on the grouped path against
/// the double reference from the same bf16 values: forward, then backward onto non-zero
/// gradients (experts without rows untouched bit for bit).
void checkGroupedSwiglu(const std::vector<std::int64_t>& rows, int hidden, int ffn) {
  if (!groupedExpertGemmAvailable()) GTEST_SKIP() << "no CUTLASS build or not an sm_90 GPU";
  const int e_n = static_cast<int>(rows.size()), wide = 2 * ffn;
  const std::int64_t total = std::accumulate(rows.begin(), rows.end(), std::int64_t(0));
  std::vector<std::int64_t> first(e_n + 1, 0);
  for (int e = 0; e < e_n; ++e) first[e + 1] = first[e] + rows[e];
  Bf16Tensor x(test::randomNormal(total * hidden, 3));
  std::deque<Bf16Tensor> w1, w2;
  std::vector<ExpertWeights> weights;
  for (int e = 0; e < e_n; ++e) {
    w1.emplace_back(test::randomNormal(std::size_t(wide) * hidden, 20 + e, 0.1f));
    w2.emplace_back(test::randomNormal(std::size_t(hidden) * ffn, 700 + e, 0.1f));
  }
  for (int e = 0; e < e_n; ++e) weights.push_back({w1[e].get(), nullptr, w2[e].get(), nullptr});

  const std::size_t ws_bytes = groupedExpertWorkspaceBytes(e_n, hidden, ffn);
  DeviceBuffer<char> ws(ws_bytes);
  DeviceBuffer<std::uint16_t> pre(total * wide), act(total * ffn), y(total * hidden);
  pre.poison();
  act.poison();
  y.poison();
  groupedSwigluExpertForward(nullptr, weights, rows, x.get(), bits(pre), bits(act), bits(y), hidden,
                             ffn, ws.get(), ws_bytes);
  const auto pre_d = test::downloadBf16(pre), act_d = test::downloadBf16(act),
             y_d = test::downloadBf16(y);
  std::vector<double> pre_ref(total * wide), act_ref(total * ffn), y_ref(total * hidden);
  for (int e = 0; e < e_n; ++e)
    for (std::int64_t r = first[e]; r < first[e + 1]; ++r) {
      for (int i = 0; i < wide; ++i) {
        double s = 0;
        for (int j = 0; j < hidden; ++j)
          s += double(w1[e].values[std::size_t(i) * hidden + j]) * x.values[r * hidden + j];
        pre_ref[r * wide + i] = s;
      }
      for (int i = 0; i < ffn; ++i)  // from the device's pre: one rounding at a time
        act_ref[r * ffn + i] = silu(pre_d[r * wide + i]) * pre_d[r * wide + ffn + i];
      for (int o = 0; o < hidden; ++o) {
        double s = 0;
        for (int i = 0; i < ffn; ++i)
          s += double(w2[e].values[std::size_t(o) * ffn + i]) * act_d[r * ffn + i];
        y_ref[r * hidden + o] = s;
      }
    }
  EXPECT_LT(relError(pre_d, pre_ref), 1e-2) << "[gate | up]";
  EXPECT_LT(relError(act_d, act_ref), 1e-2) << "silu(gate) * up";
  EXPECT_LT(relError(y_d, y_ref), 1e-2) << "expert output (from the device's act)";
  expectDeviceRowsSameBits(rows, pre, act, y, [&](const DeviceRows& d, bf16* p, bf16* a, bf16* o) {
    groupedSwigluExpertForward(nullptr, weights, d, x.get(), p, a, o, hidden, ffn, ws.get(),
                               ws_bytes);
  });

  Bf16Tensor dy(test::randomNormal(total * hidden, 4));
  std::deque<DeviceBuffer<float>> gw1, gw2;
  std::vector<std::vector<float>> g0(2 * e_n);
  std::vector<ExpertGrads> grads;
  for (int e = 0; e < e_n; ++e) {
    g0[2 * e] = test::randomNormal(std::size_t(wide) * hidden, 1400 + e, 0.5f);
    g0[2 * e + 1] = test::randomNormal(std::size_t(hidden) * ffn, 1500 + e, 0.5f);
    gw1.emplace_back(g0[2 * e]);
    gw2.emplace_back(g0[2 * e + 1]);
    grads.push_back({gw1[e].get(), nullptr, gw2[e].get(), nullptr});
  }
  DeviceBuffer<std::uint16_t> dact(total * ffn), dpre(total * wide), dx(total * hidden);
  dact.poison();
  dpre.poison();
  dx.poison();
  groupedSwigluExpertBackward(nullptr, weights, grads, rows, x.get(), bits(pre), bits(act),
                              dy.get(), bits(dact), bits(dpre), bits(dx), hidden, ffn, ws.get(),
                              ws_bytes);
  const auto dact_d = test::downloadBf16(dact), dpre_d = test::downloadBf16(dpre),
             dx_d = test::downloadBf16(dx);
  std::vector<double> dact_ref(total * ffn), dpre_ref(total * wide), dx_ref(total * hidden);
  for (int e = 0; e < e_n; ++e) {
    std::vector<double> w1r(g0[2 * e].begin(), g0[2 * e].end()),
        w2r(g0[2 * e + 1].begin(), g0[2 * e + 1].end());
    for (std::int64_t r = first[e]; r < first[e + 1]; ++r) {
      for (int i = 0; i < ffn; ++i) {
        double s = 0;
        for (int o = 0; o < hidden; ++o)
          s += double(dy.values[r * hidden + o]) * w2[e].values[std::size_t(o) * ffn + i];
        dact_ref[r * ffn + i] = s;
        const double g = pre_d[r * wide + i], u = pre_d[r * wide + ffn + i],
                     d = dact_d[r * ffn + i];
        const double sg = 1.0 / (1.0 + std::exp(-g));
        dpre_ref[r * wide + i] = d * u * sg * (1.0 + g * (1.0 - sg));
        dpre_ref[r * wide + ffn + i] = d * silu(g);
      }
      for (int j = 0; j < hidden; ++j) {
        double s = 0;
        for (int i = 0; i < wide; ++i)
          s += double(dpre_d[r * wide + i]) * w1[e].values[std::size_t(i) * hidden + j];
        dx_ref[r * hidden + j] = s;
      }
      for (int o = 0; o < hidden; ++o)
        for (int i = 0; i < ffn; ++i)
          w2r[std::size_t(o) * ffn + i] += double(dy.values[r * hidden + o]) * act_d[r * ffn + i];
      for (int i = 0; i < wide; ++i)
        for (int j = 0; j < hidden; ++j)
          w1r[std::size_t(i) * hidden + j] +=
              double(dpre_d[r * wide + i]) * x.values[r * hidden + j];
    }
    const std::string who =
        "expert " + std::to_string(e) + " (" + std::to_string(rows[e]) + " rows) ";
    if (rows[e] == 0) {
      EXPECT_EQ(gw1[e].download(), g0[2 * e]) << who << "d[gate; up] touched";
      EXPECT_EQ(gw2[e].download(), g0[2 * e + 1]) << who << "dW_down touched";
      continue;
    }
    EXPECT_LT(relError(gw1[e].download(), w1r), 1e-4) << who << "d[gate; up]";
    EXPECT_LT(relError(gw2[e].download(), w2r), 1e-4) << who << "dW_down";
  }
  EXPECT_LT(relError(dact_d, dact_ref), 1e-2) << "dact (dy W_down)";
  EXPECT_LT(relError(dpre_d, dpre_ref), 1e-2) << "d[gate | up] (from the device's dact)";
  EXPECT_LT(relError(dx_d, dx_ref), 1e-2) << "dx (from the device's dpre)";
}

TEST(MoeGrouped, SwigluEightExpertsRaggedRows) {
  checkGroupedSwiglu({0, 1, 13, 64, 100, 0, 257, 7}, 136, 200);
}

TEST(MoeGrouped, SwigluSixtyFourExpertsManyEmpty) {
  std::vector<std::int64_t> rows(64);
  for (int e = 0; e < 64; ++e) rows[e] = e % 5 == 0 ? 0 : (e * 37) % 61;
  checkGroupedSwiglu(rows, 64, 40);
}

TEST(MoeGrouped, EightExpertsRaggedRows) {
  // 0 and 1 rows, counts not multiples of 8/16/64, one expert over two 128-row tiles.
  checkGrouped({0, 1, 13, 64, 100, 0, 257, 7}, 136, 200);
}

TEST(MoeGrouped, LastExpertsEmptyAndOneExpertTakesAll) {
  checkGrouped({5, 300, 0, 0}, 64, 40);
  checkGrouped({0, 0, 0, 129}, 64, 40);
}

TEST(MoeGrouped, SixtyFourExpertsManyEmpty) {
  std::vector<std::int64_t> rows(64);
  for (int e = 0; e < 64; ++e) rows[e] = e % 5 == 0 ? 0 : (e * 37) % 61;
  checkGrouped(rows, 64, 40);
}

TEST(MoeGrouped, PerLayoutTiles) {
  // setGroupedTiles(F, D, W): each layout with the other tile than its neighbour, so every
  // layout runs its 256x128 kernel in one of the two cases (the ragged rows of the test above).
  const GroupedTiles defaults = groupedTiles();
  EXPECT_EQ(defaults.forward, 128);
  EXPECT_EQ(defaults.dgrad, 256);
  EXPECT_EQ(defaults.wgrad, 128);
  for (const GroupedTiles tiles : {GroupedTiles{256, 128, 256}, GroupedTiles{128, 256, 128}}) {
    SCOPED_TRACE(std::to_string(tiles.forward) + "," + std::to_string(tiles.dgrad) + "," +
                 std::to_string(tiles.wgrad));
    setGroupedTiles(tiles);
    checkGrouped({0, 1, 13, 64, 100, 0, 257, 7}, 136, 200);
  }
  // A tile that does not exist: a clear error, and the tiles in use stay.
  for (const GroupedTiles bad : {GroupedTiles{64, 128, 128}, GroupedTiles{128, 128, 512}}) {
    EXPECT_THROW(setGroupedTiles(bad), Error);
    EXPECT_EQ(groupedTiles().forward, 128);
  }
  setGroupedTiles(defaults);
}

TEST(MoeGrouped, BiasGradientColumnSums) {
  // Needs no CUTLASS.  An expert of 4,099 rows (17 row slices of 242: more than the kernel's
  // 4 x 8 rows in flight, not a multiple of them), experts whose last slices are short or empty
  // (515, 130 and 1 rows in 17 slices), empty ones (untouched), 264 columns (a full 256-column
  // tile and a partial one); accumulated onto non-zero values; a second run from the same start
  // is bitwise equal.
  const std::vector<std::int64_t> rows = {0, 1, 4099, 515, 0, 130};
  const int cols = 264, e_n = static_cast<int>(rows.size());
  const std::size_t ws_bytes = expertBiasGradientWorkspaceBytes(e_n, cols);
  DeviceBuffer<char> ws(ws_bytes);
  const std::int64_t total = std::accumulate(rows.begin(), rows.end(), std::int64_t(0));
  Bf16Tensor d(test::randomNormal(total * cols, 21));
  std::vector<std::vector<float>> g0;
  std::deque<DeviceBuffer<float>> db;
  std::vector<float*> ptr;
  for (int e = 0; e < e_n; ++e) {
    g0.push_back(test::randomNormal(cols, 40 + e, 0.5f));
    db.emplace_back(g0.back());
    ptr.push_back(db.back().get());
  }
  expertBiasGradient(nullptr, ptr, rows, d.get(), cols, ws.get(), ws_bytes);
  std::vector<std::vector<float>> first_run;
  std::int64_t at = 0;
  for (int e = 0; e < e_n; ++e) {
    std::vector<double> ref(g0[e].begin(), g0[e].end());
    for (std::int64_t r = at; r < at + rows[e]; ++r)
      for (int c = 0; c < cols; ++c) ref[c] += d.values[r * cols + c];
    first_run.push_back(db[e].download());
    if (rows[e] == 0)
      EXPECT_EQ(first_run.back(), g0[e]) << "expert " << e << " has no rows but was touched";
    else
      EXPECT_LT(relError(first_run.back(), ref), 1e-5) << "expert " << e;
    at += rows[e];
  }
  for (int e = 0; e < e_n; ++e) db[e].upload(g0[e]);
  expertBiasGradient(nullptr, ptr, rows, d.get(), cols, ws.get(), ws_bytes);
  for (int e = 0; e < e_n; ++e)
    EXPECT_EQ(db[e].download(), first_run[e]) << "expert " << e << ": rerun not bitwise equal";
  EXPECT_THROW(expertBiasGradient(nullptr, ptr, rows, d.get(), 12, ws.get(), ws_bytes), Error)
      << "cols % 8 != 0";
  EXPECT_THROW(expertBiasGradient(nullptr, ptr, rows, d.get(), cols, ws.get(), ws_bytes - 256),
               Error)
      << "workspace too small";
}

TEST(MoeGrouped, BiasGradientOfOneLargeBlock) {
  // A dense layer's bias (one "expert", gpu/gemm.cu's bias pass): 70,001 rows of 320 columns
  // take 256 row slices of 274 rows (the last short) so that the launch fills the GPU.
  const std::vector<std::int64_t> rows = {70001};
  const int cols = 320;
  const std::size_t ws_bytes = expertBiasGradientWorkspaceBytes(1, cols);
  EXPECT_EQ(ws_bytes, std::size_t(256) * cols * sizeof(float));
  DeviceBuffer<char> ws(ws_bytes);
  Bf16Tensor d(test::randomNormal(rows[0] * cols, 22));
  const std::vector<float> g0 = test::randomNormal(cols, 41, 0.5f);
  DeviceBuffer<float> db(g0);
  expertBiasGradient(nullptr, {db.get()}, rows, d.get(), cols, ws.get(), ws_bytes);
  std::vector<double> ref(g0.begin(), g0.end());
  for (std::int64_t r = 0; r < rows[0]; ++r)
    for (int c = 0; c < cols; ++c) ref[c] += d.values[r * cols + c];
  const auto got = db.download();
  EXPECT_LT(relError(got, ref), 1e-5);
  db.upload(g0);
  expertBiasGradient(nullptr, {db.get()}, rows, d.get(), cols, ws.get(), ws_bytes);
  EXPECT_EQ(db.download(), got) << "rerun not bitwise equal";
}

TEST(MoeGrouped, ChoiceAndErrors) {
  EXPECT_EQ(parseExpertGemm("loop", "test"), ExpertGemm::Loop);
  EXPECT_EQ(parseExpertGemm("grouped", "test"), ExpertGemm::Grouped);
  EXPECT_EQ(parseExpertGemm("auto", "test"), ExpertGemm::Auto);
  EXPECT_THROW(parseExpertGemm("cutlass", "test"), Error);
  EXPECT_EQ(chooseExpertGemm(ExpertGemm::Loop, 64, 1280, 640), ExpertGemm::Loop);
  // Shapes the grouped kernels cannot take fall back to the loop under Auto.
  EXPECT_EQ(chooseExpertGemm(ExpertGemm::Auto, 64, 1280, 636), ExpertGemm::Loop);
  if (groupedExpertGemmAvailable()) {
    EXPECT_EQ(chooseExpertGemm(ExpertGemm::Auto, 64, 1280, 640), ExpertGemm::Grouped);
    EXPECT_EQ(chooseExpertGemm(ExpertGemm::Auto, 64, 1280, 640, true), ExpertGemm::Grouped);
    // The measured crossover: 8 experts forward by the loop; backward grouped at 1280 x 2560,
    // looped at 2304 x 7680.
    EXPECT_EQ(chooseExpertGemm(ExpertGemm::Auto, 8, 1280, 2560), ExpertGemm::Loop);
    EXPECT_EQ(chooseExpertGemm(ExpertGemm::Auto, 8, 1280, 2560, true), ExpertGemm::Grouped);
    EXPECT_EQ(chooseExpertGemm(ExpertGemm::Auto, 8, 2304, 7680, true), ExpertGemm::Loop);
    EXPECT_THROW(chooseExpertGemm(ExpertGemm::Grouped, 8, 1280, 636), Error);
  } else {
    EXPECT_THROW(chooseExpertGemm(ExpertGemm::Grouped, 8, 1280, 640), Error);
  }
}

TEST(RouterSgemm, MatchesReferenceInEveryTransposition) {
  // Router shapes in miniature: odd sizes (no multiple of 4 or 8 anywhere).
  const std::int64_t m = 77, n = 13, k = 45;
  for (int ta = 0; ta < 2; ++ta)
    for (int tb = 0; tb < 2; ++tb) {
      const auto a0 = test::randomNormal(m * k, 5 + ta), b0 = test::randomNormal(n * k, 7 + tb),
                 c0 = test::randomNormal(m * n, 9);
      DeviceBuffer<float> a(a0), b(b0), c(c0), r(c0);
      const std::int64_t lda = ta ? m : k, ldb = tb ? k : n;
      sgemm(nullptr, ta, tb, m, n, k, 0.5f, a.get(), lda, b.get(), ldb, 1.0f, c.get(), n);
      sgemmReference(nullptr, ta, tb, m, n, k, 0.5f, a.get(), lda, b.get(), ldb, 1.0f, r.get(), n);
      const auto got = c.download(), want = r.download();
      EXPECT_LT(relError(got, want), 1e-6) << "trans_a " << ta << " trans_b " << tb;
      double diff = 0;
      for (std::size_t i = 0; i < got.size(); ++i) diff += std::abs(got[i] - c0[i]);
      EXPECT_GT(diff, 1.0) << "C was not written";
      // beta = 0 overwrites (poisoned C must not leak through).
      c.poison();
      sgemm(nullptr, ta, tb, m, n, k, 1.0f, a.get(), lda, b.get(), ldb, 0.0f, c.get(), n);
      sgemmReference(nullptr, ta, tb, m, n, k, 1.0f, a.get(), lda, b.get(), ldb, 0.0f, r.get(), n);
      EXPECT_LT(relError(c.download(), r.download()), 1e-6) << "beta 0, " << ta << tb;
    }
}

}  // namespace
}  // namespace plm::gpu
