// Lion, Adafactor and 8-bit AdamW (train/optim/) against plain references of their published
// update rules, written out here element by element on random tensors:
//  - Lion: the authors' lion_pytorch.py step, in the same float operations (equal to 1e-7);
//  - Adafactor: transformers.Adafactor's step on whole matrices in double (factored rows and
//    columns, an unfactored vector, update clipping, parameter scaling, with and without the
//    first moment), to 2e-6 relative;
//  - 8-bit AdamW: bitsandbytes' blockwise scheme (dequantise, AdamW in fp32, new block absmax,
//    nearest code by brute force) with a partial last block and fp32-state tensors: codes and
//    scales identical, parameters to 1e-6; the quantile maps' shape; its distance from AdamW;
//  - every kind: the decay mask, a frozen row that never moves, and stateBytes() equal to the
//    planner's optimizerStateBytes(); 8-bit AdamW at least 35% below AdamW.
#include "train/optim/adafactor.hpp"
#include "train/optim/adamw.hpp"
#include "train/optim/adamw8bit.hpp"
#include "train/optim/lion.hpp"

#include "views.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

namespace {

using plm::View1;
using plm::model::TensorInfo;
using plm::test::fromView;
using plm::test::toView;
using namespace plm::train;

TensorInfo info(const std::string& name, std::int64_t offset, std::vector<std::int64_t> shape,
                bool decay) {
  TensorInfo t;
  t.name = name;
  t.shape = shape;
  t.offset = offset;
  t.size = 1;
  for (auto d : shape) t.size *= d;
  t.weight_decay = decay;
  return t;
}

std::vector<float> randomVector(std::size_t n, std::mt19937& gen, double scale) {
  std::normal_distribution<double> normal(0.0, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = static_cast<float>(normal(gen));
  return v;
}

// A small model-like table: a (7, 5) matrix with decay, a bias, a (33, 4) "word embedding"
// whose row 1 is frozen, and a 5000-element matrix (three 2048 blocks, the last partial), with
// one padding element between tensors.
struct Table {
  std::vector<TensorInfo> tensors;
  std::int64_t size = 0;
  std::vector<FrozenRange> frozen;
};
Table table() {
  Table t;
  auto add = [&](const std::string& name, std::vector<std::int64_t> shape, bool decay) {
    t.tensors.push_back(info(name, t.size, shape, decay));
    t.size += t.tensors.back().size + 1;
  };
  add("w", {7, 5}, true);
  add("b", {5}, false);
  add("esm.embeddings.word_embeddings.weight", {33, 4}, false);
  add("big", {100, 50}, true);
  t.frozen = {{t.tensors[2].offset + 4, 4}};
  return t;
}

bool frozen(const Table& t, std::int64_t i) {
  for (const auto& r : t.frozen)
    if (i >= r.offset && i < r.offset + r.size) return true;
  return false;
}

bool decays(const Table& t, std::int64_t i) {
  for (const auto& x : t.tensors)
    if (i >= x.offset && i < x.offset + x.size) return x.weight_decay;
  return false;
}

TEST(Lion, MatchesReferenceCode) {
  const Table tab = table();
  std::mt19937 gen(3);
  auto p0 = randomVector(tab.size, gen, 0.5);
  LionOptions o;
  o.weight_decay = 0.3;
  View1<float> params = toView(p0);
  Lion<float> opt(params, wholeLayout(tab.tensors, tab.size, tab.frozen), o);
  std::vector<float> p = p0, m(tab.size, 0.0f);
  for (int step = 1; step <= 6; ++step) {
    const auto g = randomVector(tab.size, gen, 1.0);
    const double lr = 1e-2 * step, scale = step == 3 ? 0.5 : 1.0;
    opt.step(plm::ExecSpace(), toView(g), lr, scale);
    for (std::int64_t i = 0; i < tab.size; ++i) {
      if (frozen(tab, i)) continue;
      const float gi = g[i] * static_cast<float>(scale);
      // lion_pytorch.py: p *= 1 - lr*wd; update = sign(beta1*m + (1-beta1)*g); p -= lr*update;
      // m = beta2*m + (1-beta2)*g.
      if (decays(tab, i)) p[i] *= static_cast<float>(1.0 - lr * o.weight_decay);
      const float c = 0.9f * m[i] + 0.1f * gi;
      p[i] -= static_cast<float>(lr) * (c > 0 ? 1.0f : (c < 0 ? -1.0f : 0.0f));
      m[i] = 0.99f * m[i] + (1.0f - 0.99f) * gi;
    }
  }
  const auto got = fromView(params), got_m = fromView(opt.expAvg());
  for (std::int64_t i = 0; i < tab.size; ++i) {
    EXPECT_NEAR(got[i], p[i], 1e-6) << i;
    EXPECT_NEAR(got_m[i], m[i], 1e-7) << i;
    if (frozen(tab, i)) EXPECT_EQ(got[i], p0[i]);
  }
}

// transformers.Adafactor.step for one tensor, in double.
struct RefAdafactor {
  TensorInfo t;
  bool factored = false;
  std::vector<double> row, col, v, m;
  void init() {
    factored = t.shape.size() == 2;
    if (factored) {
      row.assign(t.shape[0], 0.0);
      col.assign(t.shape[1], 0.0);
    } else {
      v.assign(t.size, 0.0);
    }
    m.assign(t.size, 0.0);
  }
  void step(std::vector<double>& p, const std::vector<double>& g, int step, double lr,
            const AdafactorOptions& o, const std::vector<bool>& frozen_mask) {
    const std::size_t n = p.size();
    auto rms = [](const std::vector<double>& x) {
      double s = 0;
      for (double y : x) s += y * y;
      return std::sqrt(s / x.size());
    };
    const double alpha = lr * (o.scale_parameter ? std::max(o.eps2, rms(p)) : 1.0);
    const double beta2t = 1.0 - std::pow(step, o.decay_rate);
    std::vector<double> u(n);
    if (factored) {
      const auto R = t.shape[0], C = t.shape[1];
      for (std::int64_t r = 0; r < R; ++r) {
        double s = 0;
        for (std::int64_t c = 0; c < C; ++c) s += g[r * C + c] * g[r * C + c] + o.eps1;
        row[r] = beta2t * row[r] + (1 - beta2t) * s / C;
      }
      for (std::int64_t c = 0; c < C; ++c) {
        double s = 0;
        for (std::int64_t r = 0; r < R; ++r) s += g[r * C + c] * g[r * C + c] + o.eps1;
        col[c] = beta2t * col[c] + (1 - beta2t) * s / R;
      }
      double mean = 0;
      for (double x : row) mean += x / R;
      for (std::int64_t r = 0; r < R; ++r)
        for (std::int64_t c = 0; c < C; ++c)
          u[r * C + c] = g[r * C + c] / std::sqrt(row[r] / mean) / std::sqrt(col[c]);
    } else {
      for (std::size_t i = 0; i < n; ++i) {
        v[i] = beta2t * v[i] + (1 - beta2t) * (g[i] * g[i] + o.eps1);
        u[i] = g[i] / std::sqrt(v[i]);
      }
    }
    const double clip = std::max(1.0, rms(u) / o.clip_threshold);
    for (std::size_t i = 0; i < n; ++i) {
      if (frozen_mask[i]) continue;
      double ui = alpha * u[i] / clip;
      if (o.beta1 > 0) {
        m[i] = o.beta1 * m[i] + (1 - o.beta1) * ui;
        ui = m[i];
      }
      if (t.weight_decay) p[i] *= 1 - o.weight_decay * alpha;
      p[i] -= ui;
    }
  }
};

void checkAdafactor(const AdafactorOptions& o) {
  const Table tab = table();
  std::mt19937 gen(11);
  const auto p0 = randomVector(tab.size, gen, 0.3);
  View1<float> params = toView(p0);
  Adafactor<float> opt(params, wholeLayout(tab.tensors, tab.size, tab.frozen), o);
  std::vector<RefAdafactor> ref(tab.tensors.size());
  std::vector<std::vector<double>> p(tab.tensors.size());
  for (std::size_t k = 0; k < ref.size(); ++k) {
    ref[k].t = tab.tensors[k];
    ref[k].init();
    p[k].assign(p0.begin() + tab.tensors[k].offset,
                p0.begin() + tab.tensors[k].offset + tab.tensors[k].size);
  }
  for (int step = 1; step <= 5; ++step) {
    auto g = randomVector(tab.size, gen, step == 2 ? 30.0 : 1.0);  // step 2: clipping bites
    for (const auto& r : tab.frozen)
      std::fill(g.begin() + r.offset, g.begin() + r.offset + r.size, 0.0f);
    const double lr = 1e-2 / step;
    opt.step(plm::ExecSpace(), toView(g), lr, 0.75);
    for (std::size_t k = 0; k < ref.size(); ++k) {
      const auto& t = tab.tensors[k];
      std::vector<double> gk(t.size);
      std::vector<bool> fk(t.size);
      for (std::int64_t i = 0; i < t.size; ++i) {
        gk[i] = static_cast<double>(g[t.offset + i] * 0.75f);
        fk[i] = frozen(tab, t.offset + i);
      }
      ref[k].step(p[k], gk, step, lr, o, fk);
    }
  }
  const auto got = fromView(params);
  for (std::size_t k = 0; k < ref.size(); ++k) {
    const auto& t = tab.tensors[k];
    for (std::int64_t i = 0; i < t.size; ++i) {
      const double want = p[k][i];
      EXPECT_NEAR(got[t.offset + i], want, 2e-6 * std::max(1.0, std::abs(want)))
          << t.name << " element " << i;
      if (frozen(tab, t.offset + i)) EXPECT_EQ(got[t.offset + i], p0[t.offset + i]);
    }
  }
  // The factors themselves, and only the unfactored bias in exp_avg_sq.
  const auto rows = fromView(opt.stateF32("exp_avg_sq_row"));
  ASSERT_EQ(rows.size(), 7u + 33u + 100u);
  for (int r = 0; r < 7; ++r) EXPECT_NEAR(rows[r], ref[0].row[r], 1e-6 * ref[0].row[r]);
  EXPECT_EQ(opt.stateF32("exp_avg_sq").extent(0), 5u);
}

TEST(Adafactor, MatchesTransformersReferenceWithoutFirstMoment) {
  AdafactorOptions o;
  o.weight_decay = 0.1;
  checkAdafactor(o);
}

TEST(Adafactor, MatchesReferenceWithFirstMomentAndNoParameterScaling) {
  AdafactorOptions o;
  o.beta1 = 0.9;
  o.scale_parameter = false;
  o.clip_threshold = 0.5;
  o.weight_decay = 0.0;
  checkAdafactor(o);
}

TEST(AdamW8bit, QuantileMapsAsBitsandbytes) {
  const auto s = dynamicQuantileMap(true), u = dynamicQuantileMap(false);
  EXPECT_TRUE(std::is_sorted(s.begin(), s.end()));
  EXPECT_TRUE(std::is_sorted(u.begin(), u.end()));
  EXPECT_EQ(s[255], 1.0f);
  EXPECT_EQ(u[255], 1.0f);
  EXPECT_EQ(u[0], 0.0f);
  EXPECT_NEAR(s[0], -0.99296875, 1e-7);  // -(0.9859375 + 1) / 2: the last decade's last mean
  EXPECT_NEAR(u[1], 1e-6 * (0.1 + 0.55) / 2, 1e-13);  // smallest positive unsigned code
  EXPECT_EQ(std::count(s.begin(), s.end(), 0.0f), 1);
  EXPECT_EQ(std::count_if(s.begin(), s.end(), [](float x) { return x < 0; }), 127);
  // Nearest code, against a brute-force search.
  std::mt19937 gen(5);
  std::uniform_real_distribution<float> x(-1.0f, 1.0f);
  for (int i = 0; i < 2000; ++i) {
    const float v = i % 3 ? x(gen) : x(gen) * 1e-4f;
    const auto c = quantizeNearest(s, v);
    for (int k = 0; k < 256; ++k) ASSERT_LE(std::abs(s[c] - v), std::abs(s[k] - v)) << v;
  }
}

TEST(AdamW8bit, MatchesBlockwiseReference) {
  const Table tab = table();
  std::mt19937 gen(17);
  const auto p0 = randomVector(tab.size, gen, 0.3);
  AdamW8bitOptions o;
  o.min_8bit_size = 30;  // the (7, 5) matrix is quantised too: one partial block
  o.weight_decay = 0.05;
  View1<float> params = toView(p0);
  AdamW8bit<float> opt(params, wholeLayout(tab.tensors, tab.size, tab.frozen), o);
  const auto smap = dynamicQuantileMap(true), umap = dynamicQuantileMap(false);
  auto brute = [](const std::array<float, 256>& map, float v) {
    int best = 0;
    for (int k = 1; k < 256; ++k)
      if (std::abs(map[k] - v) < std::abs(map[best] - v)) best = k;
    return static_cast<std::uint8_t>(best);
  };
  // Reference state: codes + scales for quantised tensors, fp32 for the others.
  std::vector<float> p = p0;
  struct Q {
    std::vector<std::uint8_t> mc, vc;
    std::vector<float> ma, va;
    std::vector<float> m32, v32;
  };
  std::vector<Q> q(tab.tensors.size());
  for (std::size_t k = 0; k < q.size(); ++k) {
    const auto& t = tab.tensors[k];
    const std::int64_t blocks = (t.size + o.block_size - 1) / o.block_size;
    q[k].mc.assign(t.size, brute(smap, 0.0f));
    q[k].vc.assign(t.size, brute(umap, 0.0f));
    q[k].ma.assign(blocks, 0.0f);
    q[k].va.assign(blocks, 0.0f);
    q[k].m32.assign(t.size, 0.0f);
    q[k].v32.assign(t.size, 0.0f);
  }
  for (int step = 1; step <= 5; ++step) {
    auto g = randomVector(tab.size, gen, 1.0);
    for (const auto& r : tab.frozen)
      std::fill(g.begin() + r.offset, g.begin() + r.offset + r.size, 0.0f);
    const double lr = 1e-2;
    opt.step(plm::ExecSpace(), toView(g), lr, 1.0);
    const float step_size = static_cast<float>(lr / (1.0 - std::pow(0.9, step)));
    const float inv_sqrt_bias2 = static_cast<float>(1.0 / std::sqrt(1.0 - std::pow(0.98, step)));
    const float decay = static_cast<float>(1.0 - lr * o.weight_decay);
    for (std::size_t k = 0; k < q.size(); ++k) {
      const auto& t = tab.tensors[k];
      const bool quantised = adamw8bitQuantised(o, t);
      std::vector<float> m(t.size), v(t.size);
      for (std::int64_t i = 0; i < t.size; ++i) {
        const std::int64_t b = i / o.block_size;
        const float gi = g[t.offset + i];
        const float mo = quantised ? smap[q[k].mc[i]] * q[k].ma[b] : q[k].m32[i];
        const float vo = quantised ? umap[q[k].vc[i]] * q[k].va[b] : q[k].v32[i];
        m[i] = 0.9f * mo + static_cast<float>(1.0 - 0.9) * gi;
        v[i] = 0.98f * vo + static_cast<float>(1.0 - 0.98) * gi * gi;
        const std::int64_t at = t.offset + i;
        if (frozen(tab, at)) {
          m[i] = mo;  // fp32-state frozen elements are skipped entirely, as in AdamW
          v[i] = vo;
          continue;
        }
        if (t.weight_decay) p[at] *= decay;
        p[at] -= step_size * m[i] / (std::sqrt(v[i]) * inv_sqrt_bias2 + 1e-8f);
      }
      if (!quantised) {
        q[k].m32 = m;
        q[k].v32 = v;
        continue;
      }
      for (std::size_t b = 0; b < q[k].ma.size(); ++b) {
        float am = 0, av = 0;
        for (std::int64_t i = b * o.block_size;
             i < std::min<std::int64_t>(t.size, (b + 1) * o.block_size); ++i) {
          am = std::max(am, std::abs(m[i]));
          av = std::max(av, v[i]);
        }
        q[k].ma[b] = am;
        q[k].va[b] = av;
        for (std::int64_t i = b * o.block_size;
             i < std::min<std::int64_t>(t.size, (b + 1) * o.block_size); ++i) {
          q[k].mc[i] = brute(smap, m[i] / am);
          q[k].vc[i] = brute(umap, v[i] / av);
        }
      }
    }
  }
  const auto got = fromView(params);
  for (std::int64_t i = 0; i < tab.size; ++i) EXPECT_NEAR(got[i], p[i], 1e-6) << i;
  // Codes and scales, tensor by tensor, in the compact layouts the state buffers describe.
  for (const auto& b : opt.state()) {
    if (b.name.find("codes") == std::string::npos && b.name.find("absmax") == std::string::npos)
      continue;
    for (std::size_t j = 0; j < b.table.size(); ++j) {
      std::size_t k = 0;
      while (tab.tensors[k].name != b.table[j].name) ++k;
      const auto off = b.table[j].offset;
      if (b.name == "exp_avg_codes" || b.name == "exp_avg_sq_codes") {
        const auto codes = fromView(b.u8);
        const auto& want = b.name == "exp_avg_codes" ? q[k].mc : q[k].vc;
        int differ = 0;
        for (std::int64_t i = 0; i < b.table[j].size; ++i) differ += codes[off + i] != want[i];
        EXPECT_EQ(differ, 0) << b.name << " " << b.table[j].name;
      } else if (b.name == "exp_avg_absmax" || b.name == "exp_avg_sq_absmax") {
        const auto s = fromView(b.f32);
        const auto& want = b.name == "exp_avg_absmax" ? q[k].ma : q[k].va;
        ASSERT_EQ(b.table[j].size, static_cast<std::int64_t>(want.size()));
        // Bitwise on the host; on CUDA the device code contracts into FMAs (4 ulp).
        for (std::size_t i = 0; i < want.size(); ++i) {
          if (Kokkos::SpaceAccessibility<Kokkos::HostSpace, plm::MemSpace>::accessible)
            EXPECT_EQ(s[off + i], want[i]) << b.name;
          else
            EXPECT_FLOAT_EQ(s[off + i], want[i]) << b.name;
        }
      }
    }
  }
  // Which tensors are quantised: not the word embedding, not the bias (5 < 30).
  for (const auto& b : opt.state())
    if (b.name == "exp_avg_codes") {
      ASSERT_EQ(b.table.size(), 2u);
      EXPECT_EQ(b.table[0].name, "w");
      EXPECT_EQ(b.table[1].name, "big");
    }
}

TEST(AdamW8bit, StaysCloseToAdamW) {
  const Table tab = table();
  std::mt19937 gen(23);
  const auto p0 = randomVector(tab.size, gen, 0.3);
  View1<float> a = toView(p0), b = toView(p0);
  AdamW<float> exact(a, tab.tensors, AdamWOptions{}, tab.frozen);
  AdamW8bitOptions o;
  o.min_8bit_size = 0;
  o.fp32_tensor = "";
  AdamW8bit<float> eight(b, wholeLayout(tab.tensors, tab.size, tab.frozen), o);
  for (int step = 1; step <= 20; ++step) {
    auto g = randomVector(tab.size, gen, 1.0);
    for (std::int64_t i = 0; i < tab.size; ++i) g[i] += 0.5f;  // a consistent direction
    exact.step(plm::ExecSpace(), toView(g), 1e-3);
    eight.step(plm::ExecSpace(), toView(g), 1e-3);
  }
  const auto pa = fromView(a), pb = fromView(b);
  double moved = 0, diff = 0;
  for (std::int64_t i = 0; i < tab.size; ++i) {
    moved += std::abs(pa[i] - p0[i]);
    diff += std::abs(pa[i] - pb[i]);
  }
  EXPECT_GT(moved, 0.0);
  EXPECT_LT(diff, 0.05 * moved);  // the quantised moments change the path by a few percent
  EXPECT_GT(diff, 0.0);           // ... but they do change it: the moments are 8 bits
}

TEST(Optimizers, StateBytesAsPlannedAndEightBitSaves) {
  const Table tab = table();
  View1<float> params("p", tab.size);
  std::int64_t adamw_bytes = 0, eight_bytes = 0;
  for (auto kind : {OptimizerKind::AdamW, OptimizerKind::Lion, OptimizerKind::Adafactor,
                    OptimizerKind::AdamW8bit}) {
    for (double beta1 : {0.0, 0.9}) {
      OptimizerOptions o;
      o.kind = kind;
      o.adafactor.beta1 = beta1;
      o.adamw8bit.min_8bit_size = 30;
      auto opt = makeOptimizer<float>(o, params, wholeLayout(tab.tensors, tab.size));
      EXPECT_EQ(opt->kind(), kind);
      EXPECT_EQ(opt->stateBytes(), optimizerStateBytes(o, tab.tensors, tab.size))
          << optimizerName(kind);
      if (kind == OptimizerKind::AdamW) adamw_bytes = opt->stateBytes();
      if (kind == OptimizerKind::AdamW8bit) eight_bytes = opt->stateBytes();
    }
  }
  EXPECT_EQ(adamw_bytes, 9 * tab.size);
  EXPECT_LE(eight_bytes, 0.65 * adamw_bytes);
  EXPECT_EQ(parseOptimizerKind("adafactor"), OptimizerKind::Adafactor);
  try {
    parseOptimizerKind("adam");
    FAIL() << "no error";
  } catch (const plm::Error& e) {
    EXPECT_NE(std::string(e.what()).find("choose adamw, lion, adafactor or adamw8bit"),
              std::string::npos);
  }
}

}  // namespace
