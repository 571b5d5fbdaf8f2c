// LoRA adapters inside the whole ESM-2 (model/lora.hpp wired through esm2.cpp and
// encoder_layer.cpp): adapter tensors in the table, the initial adapted model equals the base
// one, every gradient (adapters and the base tensors below them) against central finite
// differences in double for each recompute mode, the merged plain model's logits equal the
// adapted model's, and the configurations that are refused.  Tiny shapes (2 layers, hidden 8,
// rank 3: no dimension a multiple of a block) keep it fast.
#include "core/error.hpp"
#include "model/esm2.hpp"
#include "model_test_util.hpp"

#include <algorithm>

namespace plm::model::test {
namespace {

Esm2Config tinyLoraConfig(unsigned targets = ~0u & 63u) {
  Esm2Config c;
  c.num_layers = 2;
  c.hidden = 8;
  c.heads = 2;
  c.ffn = 16;
  c.lora.rank = 3;
  c.lora.alpha = 6;
  c.lora.targets = targets;
  return c;
}

bool isAdapter(const std::string& name) { return name.find(".lora_") != std::string::npos; }

/// Every tensor random (adapters B included, so each adapter path carries signal).
template <class T> void randomize(Esm2<T>& model, std::uint64_t seed) {
  model.initialize(seed);
  auto params = model.parameters();
  for (const auto& t : model.tensors()) {
    View1<T> view(params.data() + t.offset, t.size);
    const bool gain = t.shape.size() == 1 && t.name.find("weight") != std::string::npos;
    fillNormal(view, seed * 131 + t.offset, t.shape.size() == 2 ? 0.5 : 0.2, gain ? 1.0 : 0.0);
  }
  const auto& e = model.tensor("esm.embeddings.word_embeddings.weight");
  Kokkos::deep_copy(View1<T>(params.data() + e.offset + 1 * e.shape[1], e.shape[1]), T(0));
}

template <class T> std::vector<T> logits(Esm2<T>& model, const data::MicroBatch& batch) {
  ForwardOutputs<T> out;
  out.want_logits = true;
  model.forward(batch, &out);
  return toHost(flat(out.logits));
}

TEST(ModelLoraEsm2, AdaptersAreTableRowsInTheirLayer) {
  const auto c = tinyLoraConfig();
  Esm2<float> model(c);
  int adapters = 0;
  for (int l = 0; l < c.num_layers; ++l) {
    const auto [lo, count] = model.layerRange(l);
    for (const char* stem : {"attention.self.query", "attention.self.key", "attention.self.value",
                             "attention.output.dense", "intermediate.dense", "output.dense"}) {
      const std::string p = "esm.encoder.layer." + std::to_string(l) + "." + stem;
      const auto& w = model.tensor(p + ".weight");
      const auto& a = model.tensor(p + ".lora_A.weight");
      const auto& b = model.tensor(p + ".lora_B.weight");
      EXPECT_EQ(a.shape, (std::vector<std::int64_t>{3, w.shape[1]})) << p;
      EXPECT_EQ(b.shape, (std::vector<std::int64_t>{w.shape[0], 3})) << p;
      for (const auto* t : {&a, &b}) {  // inside the layer's group (sharding, gradient sync)
        EXPECT_GE(t->offset, lo) << t->name;
        EXPECT_LE(t->offset + t->size, lo + count) << t->name;
      }
      adapters += 2;
    }
  }
  EXPECT_EQ(adapters, 24);
  // Only the named targets get adapters.
  Esm2<float> qv(tinyLoraConfig(lora_q | lora_v));
  int n = 0;
  for (const auto& t : qv.tensors()) n += isAdapter(t.name);
  EXPECT_EQ(n, 2 * 2 * 2);
  EXPECT_THROW(qv.tensor("esm.encoder.layer.0.attention.self.key.lora_A.weight"), Error);
}

TEST(ModelLoraEsm2, InitialAdaptedModelIsTheBaseModel) {
  // B = 0: the adapted model's logits are the base model's bit for bit, and the base tensors
  // draw the values they draw without adapters (adapters have random streams of their own).
  Esm2Config base_config = tinyLoraConfig();
  base_config.lora = LoraConfig{};
  Esm2<float> base(base_config), adapted(tinyLoraConfig());
  base.initialize(77);
  adapted.initialize(77);
  const auto pb = toHost(base.parameters()), pa = toHost(adapted.parameters());
  for (const auto& t : base.tensors()) {
    const auto& u = adapted.tensor(t.name);
    for (std::int64_t i = 0; i < t.size; ++i)
      ASSERT_EQ(pb[t.offset + i], pa[u.offset + i]) << t.name << "[" << i << "]";
  }
  for (const auto& t : adapted.tensors()) {
    if (!isAdapter(t.name)) continue;
    const bool is_a = t.name.find("lora_A") != std::string::npos;
    const double bound = 1.0 / std::sqrt(double(t.shape[1]));
    double largest = 0;
    for (std::int64_t i = 0; i < t.size; ++i)
      largest = std::max(largest, double(std::abs(pa[t.offset + i])));
    if (is_a) {
      EXPECT_LE(largest, bound) << t.name;
      EXPECT_GT(largest, 0.3 * bound) << t.name;
    } else {
      EXPECT_EQ(largest, 0.0) << t.name << ": B starts at zero";
    }
  }
  const auto batch = makeBatch({9, 14, 5}, 3, 0.4);
  EXPECT_EQ(logits(base, batch), logits(adapted, batch));
}

TEST(ModelLoraEsm2, EveryGradientMatchesFiniteDifferences) {
  for (Recompute recompute : {Recompute::None, Recompute::Layer, Recompute::Selective}) {
    auto c = tinyLoraConfig();
    c.recompute = recompute;
    Esm2<double> model(c);
    randomize(model, 5);
    const auto batch = makeBatch({1, 5, 9}, 3, 0.4);
    ASSERT_GT(batch.num_masked, 0);
    model.zeroGradients();
    model.forwardBackward(batch, 1.0);
    const std::string what =
        std::string("esm2 + lora (recompute ") + recomputeName(recompute) + ")";
    checkGradient(
        what, model.parameters(), model.gradients(), [&]() { return model.forward(batch); }, 1e-7,
        1e-5, 100000);
    // The adapters' own gradients are not all zero (each adapter path is exercised).
    const auto g = toHost(model.gradients());
    for (const auto& t : model.tensors()) {
      if (!isAdapter(t.name)) continue;
      double norm = 0;
      for (std::int64_t i = 0; i < t.size; ++i) norm += g[t.offset + i] * g[t.offset + i];
      EXPECT_GT(norm, 0.0) << what << ": " << t.name;
    }
  }
}

TEST(ModelLoraEsm2, MergedPlainModelGivesTheAdaptedLogits) {
  const auto c = tinyLoraConfig();
  Esm2<float> adapted(c);
  // ESM-2's initialisation (N(0, 0.02) weights, PEFT's A) with trained-looking B.
  adapted.initialize(11);
  for (const auto& t : adapted.tensors())
    if (t.name.find("lora_B") != std::string::npos)
      fillNormal(View1<float>(adapted.parameters().data() + t.offset, t.size), t.offset, 0.3);
  const auto values = toHost(adapted.parameters());
  const auto merged = mergeLora(c, adapted.tensors(), values.data());
  Esm2Config pc = c;
  pc.lora = LoraConfig{};
  Esm2<float> plain(pc);
  ASSERT_EQ(merged.size(), std::size_t(plain.bufferElements()));
  auto host = Kokkos::create_mirror_view(plain.parameters());
  std::copy(merged.begin(), merged.end(), host.data());
  Kokkos::deep_copy(plain.parameters(), host);
  const auto batch = makeBatch({12, 30, 7}, 4, 0.3);
  const auto la = logits(adapted, batch), lp = logits(plain, batch);
  ASSERT_EQ(la.size(), lp.size());
  double worst = 0, moved = 0;
  // The base model alone (B zeroed) must differ, or the comparison proves nothing.
  auto params = adapted.parameters();
  for (const auto& t : adapted.tensors())
    if (t.name.find("lora_B") != std::string::npos)
      Kokkos::deep_copy(View1<float>(params.data() + t.offset, t.size), 0.0f);
  const auto lb = logits(adapted, batch);
  for (std::size_t i = 0; i < la.size(); ++i) {
    worst = std::max(worst, double(std::abs(la[i] - lp[i])) / (1.0 + std::abs(la[i])));
    moved = std::max(moved, double(std::abs(la[i] - lb[i])));
  }
  EXPECT_LT(worst, 1e-6) << "merged vs unmerged logits";
  EXPECT_GT(moved, 0.01) << "the adapters do not change the logits";
  std::printf("merged vs unmerged: worst %.3g (relative to 1 + |logit|), adapters move %.3g\n",
              worst, moved);
}

TEST(ModelLoraEsm2, RefusesWhatIsNotImplemented) {
  auto expectError = [](const Esm2Config& c, const std::string& needle) {
    try {
      Esm2<float> model(c);
      ADD_FAILURE() << "no error; expected one naming " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  auto c = tinyLoraConfig();
  c.precision = Precision::Fp8;
  expectError(c, "fp8");
  c = tinyLoraConfig();
  c.lora.alpha = 0;
  expectError(c, "lora.alpha");
  c = tinyLoraConfig();
  c.moe.experts = 4;
  c.moe.top_k = 2;
  c.moe.expert_ffn = 16;
  expectError(c, "ffn_in/ffn_out");
}

}  // namespace
}  // namespace plm::model::test
