// The full ESM-2: configuration and parameter table, initialisation statistics, gradients of
// every parameter against finite differences (double, tiny shape), recomputation, float vs
// double, gradient accumulation, and independence of how sequences are packed.
#include "model/esm2.hpp"
#include "model_test_util.hpp"

#include "core/error.hpp"

#include <set>

namespace plm::model::test {
namespace {

Esm2Config tinyConfig() {
  Esm2Config c;
  c.num_layers = 2;
  c.hidden = 8;
  c.heads = 2;
  c.ffn = 16;
  return c;
}

TEST(ModelConfig, PresetsAndParameterCounts) {
  const auto m8 = Esm2Config::preset("esm2_8m");
  EXPECT_EQ(m8.num_layers, 6);
  EXPECT_EQ(m8.hidden, 320);
  EXPECT_EQ(m8.heads, 20);
  EXPECT_EQ(m8.ffn, 1280);
  EXPECT_NEAR(m8.numParameters() / 1e6, 7.5, 0.05);
  EXPECT_NEAR(Esm2Config::preset("esm2_650m").numParameters() / 1e6, 651, 1.0);
  EXPECT_NEAR(Esm2Config::preset("esm2_3b").numParameters() / 1e9, 2.84, 0.05);
  EXPECT_NEAR(Esm2Config::preset("esm2_15b").numParameters() / 1e9, 15.1, 0.2);
  for (const auto& name : Esm2Config::presetNames())
    EXPECT_NO_THROW(Esm2Config::preset(name).validate()) << name;
  EXPECT_THROW(Esm2Config::preset("esm2_7m"), Error);
  // doc/anchors.md: about 4.2 GFLOP per trained token for 650M with packed attention.
  EXPECT_NEAR(Esm2Config::preset("esm2_650m").trainFlopsPerToken(600) / 1e9, 4.2, 0.2);
  // Attention FLOPs grow linearly with the weighted sequence length.
  const auto c = Esm2Config::preset("esm2_35m");
  EXPECT_NEAR(c.trainFlopsPerToken(200) - c.trainFlopsPerToken(100), 12.0 * 12 * 480 * 100, 1.0);
}

TEST(ModelConfig, ValidateRejectsBadShapes) {
  auto c = tinyConfig();
  c.heads = 3;  // 8 % 3 != 0
  EXPECT_THROW(c.validate(), Error);
  c = tinyConfig();
  c.hidden = 6;
  c.heads = 2;  // head_dim 3 is odd
  EXPECT_THROW(c.validate(), Error);
  c = tinyConfig();
  c.num_layers = 0;
  EXPECT_THROW(c.validate(), Error);
  EXPECT_THROW(Esm2<float>{c}, Error);
}

TEST(ModelTensors, HuggingFaceNamesShapesOffsetsAndDecay) {
  Esm2<float> model(tinyConfig());
  const auto& table = model.tensors();
  std::set<std::string> names;
  std::int64_t total = 0, end = 0;
  for (const auto& t : table) {
    EXPECT_TRUE(names.insert(t.name).second) << "duplicate " << t.name;
    std::int64_t size = 1;
    for (auto e : t.shape) size *= e;
    EXPECT_EQ(size, t.size) << t.name;
    EXPECT_GE(t.offset, end) << t.name << " overlaps the previous tensor";
    end = t.offset + t.size;
    total += t.size;
    const bool linear_weight =
        t.shape.size() == 2 && t.name != "esm.embeddings.word_embeddings.weight";
    EXPECT_EQ(t.weight_decay, linear_weight) << t.name;
  }
  EXPECT_LE(end, static_cast<std::int64_t>(model.parameters().extent(0)));
  EXPECT_EQ(model.gradients().extent(0), model.parameters().extent(0));
  EXPECT_EQ(total, tinyConfig().numParameters());
  for (const char* n :
       {"esm.embeddings.word_embeddings.weight", "esm.encoder.layer.1.attention.self.query.weight",
        "esm.encoder.layer.0.attention.self.key.bias",
        "esm.encoder.layer.0.attention.self.value.weight",
        "esm.encoder.layer.1.attention.output.dense.bias",
        "esm.encoder.layer.0.attention.LayerNorm.weight",
        "esm.encoder.layer.1.intermediate.dense.weight", "esm.encoder.layer.1.output.dense.weight",
        "esm.encoder.layer.0.LayerNorm.bias", "esm.encoder.emb_layer_norm_after.weight",
        "lm_head.dense.weight", "lm_head.layer_norm.bias", "lm_head.bias"})
    EXPECT_TRUE(names.count(n)) << n;
  EXPECT_EQ(model.tensor("esm.encoder.layer.1.intermediate.dense.weight").shape,
            (std::vector<std::int64_t>{16, 8}));
  EXPECT_EQ(model.tensor("esm.encoder.layer.1.output.dense.weight").shape,
            (std::vector<std::int64_t>{8, 16}));
  EXPECT_EQ(model.tensor("lm_head.bias").shape, (std::vector<std::int64_t>{33}));
  EXPECT_THROW(model.tensor("lm_head.decoder.weight"), Error);  // tied to the embedding
}

TEST(ModelInit, Statistics) {
  Esm2Config c;
  c.num_layers = 2;
  c.hidden = 320;
  c.heads = 20;
  c.ffn = 1280;
  Esm2<float> model(c);
  model.initialize(1234);
  auto p = toHost(model.parameters());
  for (const auto& t : model.tensors()) {
    double sum = 0, sq = 0;
    for (std::int64_t i = 0; i < t.size; ++i) {
      sum += p[t.offset + i];
      sq += double(p[t.offset + i]) * p[t.offset + i];
    }
    const double mean = sum / t.size, std = std::sqrt(sq / t.size - mean * mean);
    const bool is_norm_weight = t.name.find("LayerNorm.weight") != std::string::npos ||
                                t.name.find("layer_norm") != std::string::npos ||
                                t.name.find("emb_layer_norm_after.weight") != std::string::npos;
    if (t.shape.size() == 2) {
      EXPECT_NEAR(std, 0.02, 0.02 * (t.size > 10000 ? 0.03 : 0.2)) << t.name;
      EXPECT_NEAR(mean, 0.0, 0.002) << t.name;
    } else if (is_norm_weight && t.name.find("weight") != std::string::npos) {
      EXPECT_EQ(mean, 1.0) << t.name;
      EXPECT_EQ(std, 0.0) << t.name;
    } else {
      EXPECT_EQ(sq, 0.0) << t.name << " should start at zero";
    }
  }
  const auto& e = model.tensor("esm.embeddings.word_embeddings.weight");
  for (int c2 = 0; c2 < 320; ++c2) EXPECT_EQ(p[e.offset + 1 * 320 + c2], 0.0f) << "padding row";
  // Deterministic in the seed, different across seeds.
  Esm2<float> same(c), other(c);
  same.initialize(1234);
  other.initialize(1235);
  EXPECT_EQ(toHost(same.parameters()), p);
  EXPECT_NE(toHost(other.parameters()), p);
}

/// Random (not just initial) parameters so every path carries signal: LayerNorm gains and all
/// biases non-trivial.
template <class T> void randomizeParameters(Esm2<T>& model, std::uint64_t seed) {
  model.initialize(seed);
  auto params = model.parameters();
  for (const auto& t : model.tensors()) {
    View1<T> view(params.data() + t.offset, t.size);
    const bool gain = t.shape.size() == 1 && t.name.find("weight") != std::string::npos;
    const double scale = t.shape.size() == 2 ? 0.5 : 0.2;
    fillNormal(view, seed * 131 + t.offset, scale, gain ? 1.0 : 0.0);
  }
  const auto& e = model.tensor("esm.embeddings.word_embeddings.weight");
  Kokkos::deep_copy(View1<T>(params.data() + e.offset + 1 * e.shape[1], e.shape[1]), T(0));
}

TEST(ModelEsm2, EveryParameterGradientMatchesFiniteDifferences) {
  for (Recompute recompute : {Recompute::None, Recompute::Layer, Recompute::Selective}) {
    auto c = tinyConfig();
    c.recompute = recompute;
    Esm2<double> model(c);
    randomizeParameters(model, 5);
    const auto batch = makeBatch({1, 5, 9}, 3, 0.4);
    ASSERT_GT(batch.num_masked, 0);
    model.zeroGradients();
    const double loss = model.forwardBackward(batch, 1.0);
    EXPECT_NEAR(loss, model.forward(batch), 1e-12);
    checkGradient(
        std::string("esm2 (recompute ") + recomputeName(recompute) + ")", model.parameters(),
        model.gradients(), [&]() { return model.forward(batch); }, 1e-7, 1e-5, 100000);
  }
}

TEST(ModelEsm2, GradScaleAndAccumulation) {
  Esm2<double> model(tinyConfig());
  randomizeParameters(model, 6);
  const auto batch = makeBatch({7, 3, 11}, 4);
  model.zeroGradients();
  model.forwardBackward(batch, 1.0);
  auto g1 = toHost(model.gradients());
  model.forwardBackward(batch, 0.5);
  auto g2 = toHost(model.gradients());
  double norm = 0;
  for (std::size_t i = 0; i < g1.size(); ++i) {
    EXPECT_NEAR(g2[i], 1.5 * g1[i], 1e-12 * (1 + std::abs(g1[i])));
    norm += g1[i] * g1[i];
  }
  EXPECT_GT(norm, 0.0);
  model.zeroGradients();
  for (double v : toHost(model.gradients())) ASSERT_EQ(v, 0.0);
}

TEST(ModelEsm2, RecomputeGivesIdenticalGradients) {
  auto c = tinyConfig();
  c.num_layers = 3;
  c.hidden = 32;
  c.heads = 4;
  c.ffn = 64;
  Esm2<float> stored(c);
  randomizeParameters(stored, 7);
  const auto batch = makeBatch({40, 1, 77, 66}, 5);
  stored.zeroGradients();
  const double l1 = stored.forwardBackward(batch, 1.0 / batch.num_masked);
  std::int64_t previous_bytes = stored.workspaceBytes();
  // Same shape, same order of every sum: recomputation is bitwise by construction.  Selective
  // keeps more than layer, and both less than none.
  for (Recompute mode : {Recompute::Selective, Recompute::Layer}) {
    c.recompute = mode;
    Esm2<float> recomputed(c);
    randomizeParameters(recomputed, 7);
    recomputed.zeroGradients();
    const double l2 = recomputed.forwardBackward(batch, 1.0 / batch.num_masked);
    EXPECT_EQ(l1, l2) << recomputeName(mode);
    EXPECT_EQ(toHost(stored.gradients()), toHost(recomputed.gradients())) << recomputeName(mode);
    EXPECT_LT(recomputed.workspaceBytes(), previous_bytes) << recomputeName(mode);
    previous_bytes = recomputed.workspaceBytes();
  }
}

TEST(ModelEsm2, FloatAgreesWithDouble) {
  auto c = tinyConfig();
  c.num_layers = 2;
  c.hidden = 64;
  c.heads = 4;
  c.ffn = 256;
  Esm2<float> f(c);
  Esm2<double> d(c);
  f.initialize(9);
  d.initialize(9);
  const auto batch = makeBatch({100, 1, 37, 130}, 6);
  f.zeroGradients();
  d.zeroGradients();
  const double lf = f.forwardBackward(batch, 1.0);
  const double ld = d.forwardBackward(batch, 1.0);
  EXPECT_NEAR(lf / ld, 1.0, 1e-5);
  auto gf = toHost(f.gradients());
  auto gd = toHost(d.gradients());
  for (const auto& t : d.tensors()) {
    double diff = 0, norm = 0;
    for (std::int64_t i = t.offset; i < t.offset + t.size; ++i) {
      diff += (gf[i] - gd[i]) * (gf[i] - gd[i]);
      norm += gd[i] * gd[i];
    }
    if (norm > 0) EXPECT_LT(std::sqrt(diff / norm), 1e-4) << t.name;
  }
}

TEST(ModelEsm2, PackingDoesNotMatter) {
  // Loss, gradients and hidden states of sequences packed together equal those of each alone.
  Esm2<double> model(tinyConfig());
  randomizeParameters(model, 8);
  const auto both = makeBatch({6, 9}, 7, 0.5);
  auto slice = [&](int begin, int end) {
    data::MicroBatch b;
    const int n = end - begin;
    b.tokens = HostView1<token_t>("t", n);
    b.labels = HostView1<std::int32_t>("l", n);
    b.cu_seqlens = HostView1<seqlen_t>("cu", 2);
    for (int i = 0; i < n; ++i) {
      b.tokens(i) = both.tokens(begin + i);
      b.labels(i) = both.labels(begin + i);
    }
    b.cu_seqlens(1) = n;
    b.max_seqlen = n;
    return b;
  };
  const auto a = slice(0, 6), b = slice(6, 15);
  model.zeroGradients();
  const double l_both = model.forwardBackward(both, 1.0);
  auto g_both = toHost(model.gradients());
  model.zeroGradients();
  const double l_a = model.forwardBackward(a, 1.0);
  const double l_b = model.forwardBackward(b, 1.0);
  auto g_sep = toHost(model.gradients());
  EXPECT_NEAR(l_both, l_a + l_b, 1e-12);
  for (std::size_t i = 0; i < g_both.size(); ++i) ASSERT_NEAR(g_both[i], g_sep[i], 1e-12) << i;
  ForwardOutputs<double> out_both, out_b;
  out_both.want_hidden = out_both.want_logits = true;
  out_b.want_hidden = out_b.want_logits = true;
  model.forward(both, &out_both);
  model.forward(b, &out_b);
  ASSERT_EQ(out_both.logits.extent(0), 15u);
  ASSERT_EQ(out_both.logits.extent(1), 33u);
  ASSERT_EQ(out_both.hidden.extent(1), 8u);
  auto hb = toHost(out_both.hidden), h1 = toHost(out_b.hidden);
  for (int i = 0; i < 9 * 8; ++i) EXPECT_NEAR(hb[6 * 8 + i], h1[i], 1e-12);
  auto lb = toHost(out_both.logits), l1 = toHost(out_b.logits);
  for (int i = 0; i < 9 * 33; ++i) EXPECT_NEAR(lb[6 * 33 + i], l1[i], 1e-12);
}

TEST(ModelEsm2, LogitsGiveTheReturnedLoss) {
  Esm2<double> model(tinyConfig());
  randomizeParameters(model, 10);
  const auto batch = makeBatch({12, 4, 1}, 8, 0.5);
  ForwardOutputs<double> out;
  out.want_logits = true;
  const double loss = model.forward(batch, &out);
  auto logits = toHost(out.logits);
  double want = 0;
  for (std::int64_t t = 0; t < batch.numTokens(); ++t) {
    if (batch.labels(t) < 0) continue;
    double z = 0;
    for (int c = 0; c < 33; ++c) z += std::exp(logits[t * 33 + c]);
    want += std::log(z) - logits[t * 33 + batch.labels(t)];
  }
  EXPECT_NEAR(loss, want, 1e-10);
  // Loading weights = writing into parameters() at tensors() offsets: a decoder bias of +1 on
  // one token raises that logit by exactly 1 everywhere.
  const auto& bias = model.tensor("lm_head.bias");
  addToElement(model.parameters(), bias.offset + 5, 1.0);
  ForwardOutputs<double> shifted;
  shifted.want_logits = true;
  model.forward(batch, &shifted);
  auto l2 = toHost(shifted.logits);
  for (std::int64_t t = 0; t < batch.numTokens(); ++t)
    EXPECT_NEAR(l2[t * 33 + 5] - logits[t * 33 + 5], 1.0, 1e-12);
}

TEST(ModelEsm2, EmptyBatchIsANoOp) {
  Esm2<double> model(tinyConfig());
  randomizeParameters(model, 12);
  model.zeroGradients();
  data::MicroBatch empty;
  EXPECT_EQ(model.forwardBackward(empty, 1.0), 0.0);
  for (double g : toHost(model.gradients())) ASSERT_EQ(g, 0.0);
  ForwardOutputs<double> out;
  out.want_logits = true;
  EXPECT_EQ(model.forward(empty, &out), 0.0);
  EXPECT_EQ(out.logits.extent(0), 0u);
}

TEST(ModelEsm2, RejectsBadBatches) {
  Esm2<float> model(tinyConfig());
  model.initialize(1);
  auto batch = makeBatch({5, 4}, 9);
  batch.tokens(3) = 40;
  EXPECT_THROW(model.forward(batch), Error);
  batch = makeBatch({5, 4}, 9);
  batch.cu_seqlens(2) = 8;
  EXPECT_THROW(model.forward(batch), Error);
}

}  // namespace
}  // namespace plm::model::test
