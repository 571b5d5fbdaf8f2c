// The planner (src/plan, doc/plan.md) against hand counts for a small configuration, against
// the model's own allocations, and against the measured resident memory of a CPU step.
#include "core/error.hpp"
#include "data/batch.hpp"
#include "deck/deck.hpp"
#include "model/esm2.hpp"
#include "plan/bench_rates.hpp"
#include "plan/plan.hpp"
#include "plan/train_report.hpp"
#include "train/optim/adamw.hpp"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <random>

using namespace plm;
using plan::Compute;

namespace {

// L = 2, h = 32, 4 heads, f = 64, V = 33: every size below is counted by hand in the tests.
model::Esm2Config small() {
  model::Esm2Config c;
  c.num_layers = 2;
  c.hidden = 32;
  c.heads = 4;
  c.ffn = 64;
  return c;
}

// A packed micro-batch of the given sequence lengths with exactly `labelled` labelled tokens.
data::MicroBatch makeBatch(const std::vector<int>& lengths, std::int64_t labelled,
                           std::uint64_t seed) {
  std::int64_t t = 0;
  for (int n : lengths) t += n;
  data::MicroBatch b;
  b.tokens = HostView1<token_t>("tokens", t);
  b.labels = HostView1<std::int32_t>("labels", t);
  b.cu_seqlens = HostView1<seqlen_t>("cu", lengths.size() + 1);
  std::mt19937_64 rng(seed);
  for (std::int64_t i = 0; i < t; ++i) {
    b.tokens(i) = static_cast<token_t>(4 + rng() % 20);
    b.labels(i) = i < labelled ? static_cast<std::int32_t>(4 + rng() % 20) : -100;
  }
  b.cu_seqlens(0) = 0;
  for (std::size_t s = 0; s < lengths.size(); ++s) {
    b.cu_seqlens(s + 1) = b.cu_seqlens(s) + lengths[s];
    b.max_seqlen = std::max(b.max_seqlen, lengths[s]);
  }
  b.num_masked = labelled;
  return b;
}

std::int64_t residentBytes() {
  std::ifstream in("/proc/self/statm");
  std::int64_t size = 0, resident = 0;
  in >> size >> resident;
  return resident * static_cast<std::int64_t>(sysconf(_SC_PAGESIZE));
}

plan::Rates unitRates() {
  plan::Rates r;
  r.kind = "unit";
  r.memory_bytes = 1e9;
  r.gemm_tflops_fp32 = r.gemm_tflops_bf16 = r.gemm_tflops_fp8 = 1;  // 1e12 FLOP/s, half_k 0
  r.gemm_tflops_fp8_block = 1;
  r.attention_tflops = 1;
  r.layernorm_gbps = r.elementwise_gbps = r.optimizer_gbps = 1;
  r.fp8_cast_gbps = r.fp8_block_cast_gbps = 1;
  r.peak_tflops = 1;
  r.intra_node_gbps = r.inter_node_gbps = 1;
  r.ranks_per_node = 8;
  return r;
}

/// The hand-checked step: small() at S = 5, 3 micro-batches of t = 1000 real tokens (m = 100
/// labelled rows), unit rates.
plan::Input handInput() {
  plan::Input in;
  in.model = small();
  in.mean_seqlen = 5;
  in.micro_batch_tokens = 1000;
  in.fill = 1;
  in.mask_prob = 0.1;
  in.micro_batches = 3;
  in.rates = unitRates();
  return in;
}

double item(const std::vector<plan::Item>& items, const std::string& prefix) {
  for (const auto& i : items)
    if (i.name.rfind(prefix, 0) == 0) return i.value;
  ADD_FAILURE() << "no item " << prefix;
  return 0;
}

}  // namespace

TEST(Plan, ParameterCountsByHand) {
  // per layer 4 (h^2 + h) + 2 (2h) + (f h + f) + (h f + h) = 4224 + 128 + 2112 + 2080 = 8544;
  // total V h + L 8544 + 2h + (h^2 + h) + 2h + V = 1056 + 17088 + 64 + 1056 + 64 + 33 = 19361;
  // the flat buffer rounds each tensor to 16: only lm_head.bias (33 -> 48) changes.
  const auto c = small();
  EXPECT_EQ(c.numParameters(), 19361);
  EXPECT_EQ(plan::layerParameterCount(c), 8544);
  EXPECT_EQ(plan::flatParameterCount(c), 19376);
  model::Esm2<float> m(c);
  EXPECT_EQ(static_cast<std::int64_t>(m.parameters().extent(0)), plan::flatParameterCount(c));
  // bf16 copy: V h + L (3h^2 + 3h + h^2 + f h + f + h f) + h^2 + h = 1056 + 2 8352 + 1024 + 32
  EXPECT_EQ(plan::computeCopyCount(c),
            1056 + 2 * (3072 + 96 + 1024 + 2048 + 64 + 2048) + 1024 + 32);
}

TEST(Plan, ActivationBytesByHand) {
  // fp32, t = 10 tokens, m = 3 head rows, no recomputation. Each allocation rounds to 256 bytes:
  // (t, h) 1280, (t) 256, (t, nh) 256, (t, f) 2560, (m, h) 512, (m) 256, (m, 33) 512.
  const auto a = plan::activationBytes(small(), Compute::Fp32, 10, 3, true);
  EXPECT_EQ(a.residual, 256 + 3 * 1280);                                 // mult, x_0..x_2
  EXPECT_EQ(a.attention, 2 * (1280 + 2 * 256 + 3 * 1280 + 1280 + 256));  // ln1, stats, qkv, o, lse
  EXPECT_EQ(a.mlp, 2 * (1280 + 1280 + 2 * 256 + 2 * 2560));     // xmid, ln2, stats, pre, act
  EXPECT_EQ(a.head, 1280 + 2 * 256 + 4 * 512 + 2 * 256 + 512);  // hidden, head, logits
  EXPECT_EQ(a.backward, 3 * 1280 + 3 * 1280 + 256 + 2560 + 1280 + 3 * 512);
  EXPECT_EQ(a.total(), 52992);
}

TEST(Plan, ActivationBytesMatchTheModelsWorkspace) {
  // The planner's count against what Esm2 really allocates, for every recomputation mode,
  // forward + backward and forward only, at two sizes (odd rows reach the 256-byte rounding).
  for (auto rc : {model::Recompute::None, model::Recompute::Layer, model::Recompute::Selective}) {
    for (auto [lengths, labelled] :
         {std::pair<std::vector<int>, int>{{4, 6}, 3}, {{33, 17, 50}, 29}}) {
      auto c = small();
      c.recompute = rc;
      std::int64_t t = 0;
      for (int n : lengths) t += n;
      {
        model::Esm2<float> m(c);
        m.initialize(1);
        m.forwardBackward(makeBatch(lengths, labelled, 2), 1.0);
        EXPECT_EQ(m.workspaceBytes(),
                  plan::activationBytes(c, Compute::Fp32, t, labelled, true).total())
            << model::recomputeName(rc) << " t=" << t;
      }
      {
        model::Esm2<float> m(c);
        m.initialize(1);
        m.forward(makeBatch(lengths, labelled, 2));
        EXPECT_EQ(m.workspaceBytes(),
                  plan::activationBytes(c, Compute::Fp32, t, labelled, false).total())
            << "forward only, " << model::recomputeName(rc) << " t=" << t;
      }
    }
  }
  // Recomputation keeps less: selective < none, layer < selective (at L = 2 already).
  const auto none = plan::activationBytes(small(), Compute::Bf16, 4096, 600, true).total();
  auto c = small();
  c.recompute = model::Recompute::Selective;
  const auto sel = plan::activationBytes(c, Compute::Bf16, 4096, 600, true).total();
  c.recompute = model::Recompute::Layer;
  const auto layer = plan::activationBytes(c, Compute::Bf16, 4096, 600, true).total();
  EXPECT_LT(sel, none);
  EXPECT_LT(layer, sel);
}

TEST(Plan, FlopsByHand) {
  // W = L (4h^2 + 2hf) + h^2 + V h = 2 8192 + 1024 + 1056 = 18464; at S = 5:
  // model 6 W + 12 L h S = 110784 + 3840 = 114624.
  plan::Input in;
  in.model = small();
  in.mean_seqlen = 5;
  in.rates = unitRates();
  auto p = plan::makePlan(in);
  EXPECT_DOUBLE_EQ(p.model_flops_per_token, 114624);
  EXPECT_DOUBLE_EQ(p.hardware_flops_per_token, 114624);
  in.model.recompute = model::Recompute::Layer;  // + 2 L (4h^2 + 2hf) + 4 L h S = 32768 + 1280
  EXPECT_DOUBLE_EQ(plan::makePlan(in).hardware_flops_per_token, 114624 + 34048);
  in.model.recompute = model::Recompute::Selective;  // + 4 L h S
  p = plan::makePlan(in);
  EXPECT_DOUBLE_EQ(p.hardware_flops_per_token, 114624 + 1280);
  EXPECT_DOUBLE_EQ(p.model_flops_per_token, 114624);  // MFU never counts recomputation
}

TEST(Plan, TimeByHand) {
  // Unit rates (1 TFLOP/s with no size penalty, 1 GB/s), t = 1000 real tokens, m = 100 rows.
  plan::Input in = handInput();
  const auto p = plan::makePlan(in);
  // GEMMs: 3 (6 L 8192 t + 6 (h^2 + V h) m) = 3 (98,304,000 + 1,248,000) FLOP at 1e12.
  EXPECT_NEAR(item(p.time, "GEMMs"), 3 * 99552000 / 1e12, 1e-15);
  // attention: 3 x 12 L h S t = 3 x 3,840,000 FLOP, at 1e12 d / (d + 0).
  EXPECT_NEAR(item(p.time, "attention"), 3 * 3840000 / 1e12, 1e-15);
  // LayerNorm fp32: ((2L+1) t + m) (8h + 20h) bytes = 5100 x 896 per micro-batch, at 1e9.
  EXPECT_NEAR(item(p.time, "LayerNorm"), 3 * 5100.0 * 896 / 1e9, 1e-12);
  // optimizer: 36 N bytes at 1e9.
  EXPECT_NEAR(item(p.time, "optimizer"), 36.0 * 19376 / 1e9, 1e-12);
  EXPECT_DOUBLE_EQ(item(p.time, "communication"), 0.0);  // one rank
  double sum = 0;
  for (const auto& i : p.time) sum += i.value;
  EXPECT_DOUBLE_EQ(p.step_seconds, sum);
  EXPECT_DOUBLE_EQ(p.tokens_per_step, 3000);
  EXPECT_NEAR(p.mfu, 114624.0 * 3000 / p.step_seconds / 1e12, 1e-12);
}

TEST(Plan, Fp8TimeByHand) {
  // The TimeByHand setup under fp8 with the FP8 GEMMs at 2 TFLOP/s: the FP8 layers' GEMMs at
  // that rate, the LM head and the layers fp8.first_layers_bf16 keeps at the bf16 one; the casts
  // move 3 bytes per element of the FP8 GEMMs' inputs (t (3h + f) per layer) and output
  // gradients (t (5h + f)), + 1 for the kept X^T (fp8.wgrad: fp8), + 2 for current scaling's
  // amax pass; layer recomputation casts the inputs again.
  plan::Input in = handInput();
  in.compute = Compute::Fp8;
  in.rates.gemm_tflops_fp8 = 2;
  const double layer = 6 * 8192 * 1000.0, head = 6 * (32 * 32 + 33 * 32) * 100.0;
  const double in_elems = 1000.0 * (3 * 32 + 64), out_elems = 1000.0 * (5 * 32 + 64);
  auto p = plan::makePlan(in);
  EXPECT_NEAR(item(p.time, "GEMMs"), 3 * (2 * layer / 2e12 + head / 1e12), 1e-15);
  EXPECT_NEAR(item(p.time, "FP8 casts"), 3 * 4 * 2 * (in_elems + out_elems) / 1e9, 1e-15);
  in.model.fp8.first_layers_bf16 = 1;
  p = plan::makePlan(in);
  EXPECT_NEAR(item(p.time, "GEMMs"), 3 * (layer / 2e12 + (layer + head) / 1e12), 1e-15);
  EXPECT_NEAR(item(p.time, "FP8 casts"), 3 * 4 * (in_elems + out_elems) / 1e9, 1e-15);
  in.model.fp8.recipe = model::Fp8Recipe::Current;
  EXPECT_NEAR(item(plan::makePlan(in).time, "FP8 casts"), 3 * 6 * (in_elems + out_elems) / 1e9,
              1e-15);
  in.model.fp8.recipe = model::Fp8Recipe::Delayed;
  in.model.fp8.wgrad = model::Fp8Wgrad::Bf16;
  EXPECT_NEAR(item(plan::makePlan(in).time, "FP8 casts"), 3 * 3 * (in_elems + out_elems) / 1e9,
              1e-15);
  in.model.fp8.wgrad = model::Fp8Wgrad::Fp8;
  in.model.recompute = model::Recompute::Layer;
  EXPECT_NEAR(item(plan::makePlan(in).time, "FP8 casts"), 3 * 4 * (2 * in_elems + out_elems) / 1e9,
              1e-15);
  // Block scaling: its own GEMM asymptote and cast rate.
  in.model.recompute = model::Recompute::None;
  in.model.fp8.recipe = model::Fp8Recipe::Block;
  in.rates.gemm_tflops_fp8_block = 1.5;
  in.rates.fp8_block_cast_gbps = 0.5;
  p = plan::makePlan(in);
  EXPECT_NEAR(item(p.time, "GEMMs"), 3 * (layer / 1.5e12 + (layer + head) / 1e12), 1e-15);
  EXPECT_NEAR(item(p.time, "FP8 casts"), 3 * 4 * (in_elems + out_elems) / 0.5e9, 1e-15);
  // bf16 has no cast row.
  in.compute = Compute::Bf16;
  for (const auto& i : plan::makePlan(in).time) EXPECT_NE(i.name, "FP8 casts");
}

TEST(Plan, Fp8CastsOfMoeLayersCountTheExpertRows) {
  // smallMoe's layers (h 32, experts of 48, top-2) at t = 1000: attention 2h in, 4h out over t
  // rows; the experts h + f_e in, f_e + h out over X = t k rows (expert degree 1).
  plan::Input in;
  in.model = small();
  in.model.moe.experts = 4;
  in.model.moe.top_k = 2;
  in.model.moe.every = 1;
  in.model.moe.expert_ffn = 48;
  in.compute = Compute::Fp8;
  in.micro_batch_tokens = 1000;
  in.fill = 1;
  in.rates = unitRates();
  const double per_layer = 6 * 32 * 1000.0 + 2000.0 * (2 * 32 + 2 * 48);
  EXPECT_NEAR(item(plan::makePlan(in).time, "FP8 casts"), 4 * 2 * per_layer / 1e9, 1e-15);
}

TEST(Plan, Fp8AgainstBf16WithTheBuiltInRates) {
  // With the shipped tables: FP8 is faster than bf16 but short of 2x (the casts, attention,
  // LayerNorm and the optimizer do not speed up), and block scaling is slower than delayed.
  for (const std::string gpu : {"h100", "h200"})
    for (const std::string preset : {"esm2_650m", "esm2_3b"}) {
      plan::Input in;
      in.model = model::Esm2Config::preset(preset);
      in.rates = plan::builtinRates(gpu);
      in.micro_batch_tokens = 16384;
      in.compute = Compute::Bf16;
      const auto bf16 = plan::makePlan(in);
      in.compute = Compute::Fp8;
      const auto delayed = plan::makePlan(in);
      in.model.fp8.recipe = model::Fp8Recipe::Block;
      const auto block = plan::makePlan(in);
      const std::string what = gpu + " " + preset;
      EXPECT_GT(item(delayed.time, "FP8 casts"), 0) << what;
      EXPECT_LT(item(delayed.time, "GEMMs"), item(bf16.time, "GEMMs")) << what;
      EXPECT_GT(delayed.tokens_per_s, bf16.tokens_per_s) << what;
      EXPECT_LT(delayed.tokens_per_s, 2 * bf16.tokens_per_s) << what;
      EXPECT_LT(block.tokens_per_s, delayed.tokens_per_s) << what;
      EXPECT_GT(item(block.time, "GEMMs"), item(delayed.time, "GEMMs")) << what;
      EXPECT_GT(item(block.time, "FP8 casts"), item(delayed.time, "FP8 casts")) << what;
    }
}

TEST(Plan, DataParallelAllReduceAndSharding) {
  plan::Input in;
  in.model = small();
  in.rates = unitRates();
  in.layout.ranks_per_node = 4;
  const auto p4 = plan::makePlan(in);
  // ring all-reduce of 4 N bytes: 2 (r-1)/r 4 N / busbw; the backward hides the rest but not
  // less than one layer's share.
  const double ar = 2 * 3.0 / 4 * 4 * 19376 / 1e9;
  EXPECT_GE(item(p4.time, "communication"), ar / 2 - 1e-15);
  EXPECT_LE(item(p4.time, "communication"), ar + 1e-15);
  EXPECT_DOUBLE_EQ(p4.tokens_per_step, 4 * in.fill * in.micro_batch_tokens);
  in.layout.shard = 4;
  const auto s4 = plan::makePlan(in);
  EXPECT_NEAR(item(s4.memory, "parameters"), 4.0 * 19376 / 4, 1e-9);
  EXPECT_NEAR(item(s4.memory, "optimizer states"), 9.0 * 19376 / 4, 1e-9);
  EXPECT_GT(item(s4.memory, "gathered"), 0);
  in.layout.shard = 3;  // 4 ranks do not split into 3
  EXPECT_THROW(plan::makePlan(in), Error);
  in.layout.shard = 1;
  in.layout.expert = 2;  // dense model
  EXPECT_THROW(plan::makePlan(in), Error);
}

TEST(Plan, AdviceWhenItDoesNotFit) {
  plan::Input in;
  // 15B: 19 bytes of state per parameter (285 GB) need sharding over 8 H100s.
  in.model = model::Esm2Config::preset("esm2_15b");
  in.model.recompute = model::Recompute::Layer;
  in.compute = Compute::Bf16;
  in.micro_batch_tokens = 2048;
  in.rates = plan::builtinRates("h100");
  in.layout.ranks_per_node = 8;
  const auto p = plan::makePlan(in);
  EXPECT_FALSE(p.fits);
  ASSERT_FALSE(p.advice.empty());
  // The suggested shard degree is the smallest that fits: one less does not.
  bool shard_advised = false;
  for (const auto& a : p.advice) {
    const auto at = a.find("--shard ");
    if (at == std::string::npos) continue;
    shard_advised = true;
    const int s = std::stoi(a.substr(at + 8));
    plan::Input t = in;
    t.layout.shard = s;
    EXPECT_TRUE(plan::makePlan(t).fits) << a;
    for (int smaller = 1; smaller < s; ++smaller) {
      if (8 % smaller) continue;
      t.layout.shard = smaller;
      EXPECT_FALSE(plan::makePlan(t).fits) << "shard " << smaller;
    }
  }
  EXPECT_TRUE(shard_advised);
  // Every preset plans without error on one H100, and 650M at 32K fits (measured: 59.6 GiB).
  in.micro_batch_tokens = 32768;
  in.model.recompute = model::Recompute::None;
  for (const auto& name : model::Esm2Config::presetNames()) {
    plan::Input t = in;
    t.model = model::Esm2Config::preset(name);
    t.layout.ranks_per_node = 1;
    EXPECT_NO_THROW(plan::makePlan(t)) << name;
  }
  plan::Input t = in;
  t.model = model::Esm2Config::preset("esm2_650m");
  t.layout.ranks_per_node = 1;
  const auto p650 = plan::makePlan(t);
  EXPECT_TRUE(p650.fits);
  const double gib = 1024.0 * 1024 * 1024;
  EXPECT_NEAR(p650.memory_total / gib, 59.6, 0.1 * 59.6);
}

TEST(Plan, RatesRoundTripAndErrors) {
  for (const auto& kind : plan::builtinRateKinds()) {
    const auto r = plan::builtinRates(kind);
    const auto back = plan::ratesFromJson(plan::ratesToJson(r), plan::Rates{}, "round trip");
    EXPECT_EQ(back.kind, kind);
    EXPECT_DOUBLE_EQ(back.memory_bytes, r.memory_bytes);
    EXPECT_DOUBLE_EQ(back.gemm_half_k, r.gemm_half_k);
    EXPECT_DOUBLE_EQ(back.inter_node_gbps, r.inter_node_gbps);
    EXPECT_DOUBLE_EQ(back.gemm_half_k_fp8, r.gemm_half_k_fp8);
    EXPECT_DOUBLE_EQ(back.gemm_tflops_fp8_block, r.gemm_tflops_fp8_block);
    EXPECT_DOUBLE_EQ(back.fp8_cast_gbps, r.fp8_cast_gbps);
    EXPECT_DOUBLE_EQ(back.fp8_block_cast_gbps, r.fp8_block_cast_gbps);
    // Every FP8 rate is set: a table without them would plan fp8 at infinite speed.
    for (double x :
         {r.gemm_tflops_fp8, r.gemm_tflops_fp8_block, r.fp8_cast_gbps, r.fp8_block_cast_gbps})
      EXPECT_GT(x, 0) << kind;
  }
  EXPECT_THROW(plan::builtinRates("a100"), Error);
  EXPECT_THROW(plan::ratesFromJson(io::json::parse("{\"gemm_tflops\": 1}"), plan::Rates{}, "x"),
               Error);
  EXPECT_THROW(plan::ratesFromJson(io::json::parse("{\"launch_us\": -1}"), plan::Rates{}, "x"),
               Error);
}

TEST(Plan, InputFromDeckAndOutputs) {
  auto deck = deck::resolve(*deck::readYamlString(
      "model: { preset: esm2_35m, recompute: selective }\n"
      "data: { tokens_per_batch: 65536, micro_batch_tokens: 8192, max_seq_len: 256 }\n"
      "train: { precision: bf16 }\n"));
  plan::Layout layout;
  layout.ranks_per_node = 2;
  const auto in = plan::inputFromDeck(*deck, layout, plan::builtinRates("h100"));
  EXPECT_EQ(in.model.num_layers, 12);
  EXPECT_EQ(in.model.recompute, model::Recompute::Selective);
  EXPECT_EQ(in.compute, Compute::Bf16);
  EXPECT_EQ(in.micro_batches, 4);  // 65536 / 8192 over 2 ranks
  EXPECT_DOUBLE_EQ(in.mean_seqlen, 256);
  const auto p = plan::makePlan(in);
  const std::string text = plan::formatPlan(in, p);
  EXPECT_NE(text.find("activations: attention"), std::string::npos);
  EXPECT_NE(text.find("tokens/s"), std::string::npos);
  const auto json = plan::planToJson(in, p);
  EXPECT_DOUBLE_EQ(json.at("time").at("tokens_per_s").asDouble(), p.tokens_per_s);
  EXPECT_DOUBLE_EQ(json.at("memory").at("total_bytes").asDouble(), p.memory_total);
}

TEST(Plan, MemoryAgainstResidentBytesOnTheCpu) {
  if (!Kokkos::SpaceAccessibility<Kokkos::HostSpace, plm::MemSpace>::accessible)
    GTEST_SKIP() << "the model lives in GPU memory here: the process's resident bytes do not "
                    "hold it (the GPU side is checked by validation/plan_accuracy.py)";
  // Warm up the BLAS and Kokkos on a throw-away model so their one-off buffers are resident.
  {
    model::Esm2<float> warm(small());
    warm.initialize(3);
    warm.forwardBackward(makeBatch({20, 12}, 5, 4), 1.0);
  }
  model::Esm2Config c;
  c.num_layers = 4;
  c.hidden = 256;
  c.heads = 8;
  c.ffn = 1024;
  const std::vector<int> lengths = {400, 300, 250, 500, 298, 300};  // 2048 tokens
  const std::int64_t labelled = 307;
  const auto batch = makeBatch(lengths, labelled, 5);
  const std::int64_t before = residentBytes();
  model::Esm2<float> m(c);
  m.initialize(6);
  train::AdamW<float> opt(m.parameters(), m.tensors(), train::AdamWOptions{});
  m.forwardBackward(batch, 1.0 / labelled);
  opt.step(ExecSpace(), m.gradients(), 1e-4);
  const double measured = static_cast<double>(residentBytes() - before);

  plan::Input in;
  in.model = c;
  in.micro_batch_tokens = 2048;
  in.mask_prob = labelled / 2048.0;
  in.rates = plan::builtinRates("cpu");
  const auto p = plan::makePlan(in);
  // The model's own buffers: exactly what the plan counts for them.
  EXPECT_EQ(m.workspaceBytes(),
            plan::activationBytes(c, Compute::Fp32, 2048, labelled, true).total());
  double model_bytes = 0;
  for (const auto& i : p.memory)
    if (i.name.rfind("workspace and runtime", 0) != 0) model_bytes += i.value;
  std::printf("planned %s, resident %s\n", plan::bytesText(model_bytes).c_str(),
              plan::bytesText(measured).c_str());
  EXPECT_NEAR(model_bytes, measured, 0.10 * measured)
      << "planned " << plan::bytesText(model_bytes) << ", resident " << plan::bytesText(measured);
}

TEST(Plan, FitSaturatingRecoversAsymptoteAndHalfSize) {
  // R(k) = 2 k / (k + 100) exactly: the fit returns (2, 100).
  std::vector<double> k = {16, 64, 256, 1024}, r;
  for (double x : k) r.push_back(2 * x / (x + 100));
  const auto [a, half] = plan::fitSaturating(k, r);
  EXPECT_NEAR(a, 2, 1e-9);
  EXPECT_NEAR(half, 100, 1e-6);
  // A rate that falls with size has no saturating form: the best rate, no size penalty.
  const auto [b, none] = plan::fitSaturating({64, 128}, {3.0, 2.0});
  EXPECT_DOUBLE_EQ(b, 3.0);
  EXPECT_DOUBLE_EQ(none, 0.0);
}

TEST(Plan, MeasuredRatesArePositive) {
  const auto r = plan::measureRates(plan::builtinRates("cpu"), 0.005, [](const std::string&) {});
  for (double x : {r.gemm_tflops_fp32, r.attention_tflops, r.layernorm_gbps, r.elementwise_gbps,
                   r.optimizer_gbps, r.launch_us}) {
    EXPECT_TRUE(std::isfinite(x));
    EXPECT_GT(x, 0);
  }
  EXPECT_GE(r.gemm_half_k, 0);
  // The CPU emulates fp8 in fp32: its FP8 rates are the measured fp32 GEMM and elementwise ones.
  EXPECT_DOUBLE_EQ(r.gemm_tflops_fp8_block, r.gemm_tflops_fp32);
  EXPECT_DOUBLE_EQ(r.gemm_half_k_fp8, r.gemm_half_k);
  EXPECT_DOUBLE_EQ(r.fp8_cast_gbps, r.elementwise_gbps);
  EXPECT_DOUBLE_EQ(r.memory_bytes, plan::builtinRates("cpu").memory_bytes);  // kept from base
  // The measured table plans (and round-trips through JSON like a shipped one).
  plan::Input in;
  in.model = small();
  in.rates = plan::ratesFromJson(plan::ratesToJson(r), plan::Rates{}, "measured");
  EXPECT_GT(plan::makePlan(in).tokens_per_s, 0);
}

TEST(Plan, NotesWhatPlmRefusesToday) {
  plan::Input in;
  in.model = model::Esm2Config::preset("esm2_15b");
  in.compute = Compute::Bf16;
  in.rates = plan::builtinRates("h100");
  in.layout.ranks_per_node = 8;
  in.layout.shard = 8;
  auto has = [](const plan::Plan& p, const std::string& what) {
    for (const auto& n : p.notes)
      if (n.find(what) != std::string::npos) return true;
    return false;
  };
  const auto p = plan::makePlan(in);
  EXPECT_FALSE(has(p, "hidden <= 5120")) << "esm2_15b runs in bf16 since the 5120 kernels";
  {
    plan::Input wide = in;
    wide.model.hidden = 6400;
    wide.model.heads = 50;
    wide.model.ffn = 4 * 6400;
    EXPECT_TRUE(has(plan::makePlan(wide), "hidden <= 5120"));
  }
  EXPECT_FALSE(has(p, "sharding runs")) << "bf16 shards since the compute copy is per unit";
  in.compute = Compute::Fp8;
  EXPECT_TRUE(has(plan::makePlan(in), "all-gathers the FP8 weights as their E4M3 codes"));
  in.compute = Compute::Bf16;
  in.layout.shard = 4;
  in.layout.context = 2;
  EXPECT_FALSE(has(plan::makePlan(in), "context_degree > 1 is refused"))
      << "bf16 runs the CUDA ring";
  in.compute = Compute::Fp32;
  in.layout.context = 1;
  EXPECT_FALSE(has(plan::makePlan(in), "sharding runs"));
  in.compute = Compute::Bf16;
  in.model = small();
  in.layout = plan::Layout{};
  EXPECT_FALSE(has(plan::makePlan(in), "hidden <= 5120"));
  in.rates = plan::builtinRates("cpu");
  EXPECT_TRUE(has(plan::makePlan(in), "CUDA build only"));
}

namespace {

// A small MoE model: 2 layers of h = 32, 4 experts of width 48, top-2 (both layers MoE).
model::Esm2Config smallMoe() {
  auto c = small();
  c.moe.experts = 4;
  c.moe.top_k = 2;
  c.moe.every = 1;
  c.moe.expert_ffn = 48;
  return c;
}

}  // namespace

TEST(Plan, MoeParameterCountsFollowTheModelsTable) {
  // The plan counts the buffer the model allocates, whole and for one rank of an expert group;
  // the routed experts divide by the expert degree, the rest does not.
  const auto c = smallMoe();
  const auto whole = plan::parameterCounts(c);
  {
    model::Esm2<float> m(c);
    EXPECT_EQ(static_cast<std::int64_t>(m.parameters().extent(0)), whole.flat);
  }
  // One expert: (48 h + 48) + (h 48 + h) = 1536 + 48 + 1536 + 32 = 3152 elements; 4 per layer.
  EXPECT_EQ(whole.experts, 2 * 4 * 3152);
  for (int degree : {2, 4}) {
    const auto part = plan::parameterCounts(c, degree);
    model::Esm2<float> m(c, model::ExpertPlacement{degree, 0});
    EXPECT_EQ(static_cast<std::int64_t>(m.parameters().extent(0)), part.flat) << degree;
    EXPECT_EQ(part.experts, whole.experts / degree);
    EXPECT_EQ(part.dense(), whole.dense());
    EXPECT_EQ(part.compute_experts, whole.compute_experts / degree);
  }
  // The compute copy packs every expert's four tensors (b2 too: an expert's output is bf16).
  EXPECT_EQ(whole.compute_experts, whole.experts);
  // SwiGLU experts: gate, up (48, h) and down (h, 48), no biases: 3 x 1536 elements each.
  auto swiglu = c;
  swiglu.moe.expert_activation = model::ExpertActivation::Swiglu;
  const auto three = plan::parameterCounts(swiglu);
  EXPECT_EQ(three.experts, 2 * 4 * 4608);
  EXPECT_EQ(three.compute_experts, three.experts);
  EXPECT_EQ(three.dense(), whole.dense());
  {
    model::Esm2<float> m(swiglu);
    EXPECT_EQ(static_cast<std::int64_t>(m.parameters().extent(0)), three.flat);
  }
  EXPECT_EQ(three.flat - whole.flat, 2 * 4 * (4608 - 3152));
  EXPECT_EQ(swiglu.numParameters() - c.numParameters(), 2 * 4 * (4608 - 3152));
  // A dense model's counts are the hand formula's.
  EXPECT_EQ(plan::parameterCounts(small()).flat, plan::flatParameterCount(small()));
  EXPECT_EQ(plan::parameterCounts(small()).experts, 0);
}

TEST(Plan, MoeBuffersByHand) {
  // fp32 on the CPU (host routing), t = 10 tokens, k = 2: R = 20 rows, h = 32, f_e = 48, E = 4,
  // two MoE layers.  Per layer: logits + dlogits 2 x 10 x 4 x 4, dgate 20 x 4; host maps
  // 20 x (4 + 4) + 20 x (4 + 4); token side 4 R h 4; expert side 3 R f_e 4.
  const auto c = smallMoe();
  const auto b = plan::moeBufferBytes(c, Compute::Fp32, false, 10, 1, 1.0);
  EXPECT_EQ(b.layers, 2);
  EXPECT_EQ(b.rows, 20);
  EXPECT_EQ(b.expert_rows, 20);
  EXPECT_EQ(b.routing, 2 * (320 + 80 + 160 + 160));
  EXPECT_EQ(b.token_side, 2 * 4 * 20 * 32 * 4);
  EXPECT_EQ(b.expert_side, 2 * 3 * 20 * 48 * 4);
  EXPECT_EQ(b.shared, 0);
  // Expert degree 2 at load 1.5: X = 30 rows, plus five (X, h) exchange buffers and two maps.
  const auto e2 = plan::moeBufferBytes(c, Compute::Fp32, false, 10, 2, 1.5);
  EXPECT_EQ(e2.expert_rows, 30);
  EXPECT_EQ(e2.expert_side, 2 * (3 * 30 * 48 * 4 + 5 * 30 * 32 * 4 + 2 * 30 * 4));
  // The load is capped at the expert degree (every row on one rank) and at the capacity bound.
  EXPECT_EQ(plan::moeBufferBytes(c, Compute::Fp32, false, 10, 2, 9.0).expert_rows, 40);
  auto capped = c;
  capped.moe.capacity_factor = 1.25;  // capacity ceil(1.25 x 20 / 4) = 7 per expert: 28 rows
  EXPECT_EQ(plan::moeBufferBytes(capped, Compute::Fp32, false, 10, 2, 9.0).expert_rows, 28);
  // bf16 on the GPU: rows in 2 bytes, device routing; no fp32 copy of the router's input nor
  // its gradient (a 4 x 32 router fits shared memory: its kernels read the bf16 input).
  const auto g = plan::moeBufferBytes(c, Compute::Bf16, true, 10, 1, 1.0);
  EXPECT_EQ(g.token_side, 2 * 4 * 20 * 32 * 2);
  // A router over 160 KiB (1,281 experts x 32 x 4 bytes) keeps both fp32 buffers (t h 4 each).
  auto wide = c;
  wide.moe.experts = 1281;
  EXPECT_EQ(plan::moeBufferBytes(wide, Compute::Bf16, true, 10, 1, 1.0).token_side,
            2 * (4 * 20 * 32 * 2 + 2 * 10 * 32 * 4));
  wide.moe.experts = 1280;  // exactly 160 KiB: it fits
  EXPECT_EQ(plan::moeBufferBytes(wide, Compute::Bf16, true, 10, 1, 1.0).token_side,
            2 * 4 * 20 * 32 * 2);
  EXPECT_EQ(g.expert_side, 2 * 3 * 20 * 48 * 2);
  // SwiGLU experts: pre-activation and its gradient 2 f_e wide, act and d(act) f_e wide.
  auto swiglu = c;
  swiglu.moe.expert_activation = model::ExpertActivation::Swiglu;
  EXPECT_EQ(plan::moeBufferBytes(swiglu, Compute::Fp32, false, 10, 1, 1.0).expert_side,
            2 * 6 * 20 * 48 * 4);
  // Shared experts: pre-activation, GELU and gradient over every token.
  auto shared = c;
  shared.moe.shared_experts = 1;
  EXPECT_EQ(plan::moeBufferBytes(shared, Compute::Fp32, false, 10, 1, 1.0).shared,
            2 * 3 * 10 * 48 * 4);
}

TEST(Plan, MoeMemoryFallsWithTheExpertDegreeAndGrowsWithTheLoad) {
  plan::Input in;
  in.model = model::Esm2Config::preset("aido_protein_16b");
  in.compute = Compute::Bf16;
  in.micro_batch_tokens = 8192;
  in.rates = plan::builtinRates("h200");
  in.layout.ranks_per_node = 8;
  auto state = [](const plan::Plan& p) {
    return item(p.memory, "parameters") + item(p.memory, "gradients") +
           item(p.memory, "optimizer states") + item(p.memory, "compute copy");
  };
  // One H200: the fp32 state alone (~19 bytes per parameter) is far beyond 140 GB.
  in.layout.ranks_per_node = 1;
  const auto one = plan::makePlan(in);
  EXPECT_FALSE(one.fits);
  EXPECT_GT(state(one), 16.0 * static_cast<double>(in.model.numParameters()));
  in.layout.ranks_per_node = 8;
  double previous = 0;
  for (int degree : {1, 2, 4, 8}) {
    in.layout.expert = degree;
    in.moe_load = 1.0;
    const auto p = plan::makePlan(in);
    const auto counts = plan::parameterCounts(in.model, degree);
    // The routed experts divide by the degree, the dense part stays whole.
    EXPECT_NEAR(item(p.memory, "parameters"),
                4.0 * static_cast<double>(counts.dense() + counts.experts), 1.0);
    if (degree > 1) {
      EXPECT_LT(state(p), previous) << degree;
      EXPECT_GT(item(p.time, "MoE all-to-all"), 0) << degree;
    }
    previous = state(p);
  }
  // At a fixed degree the expert rows grow with the load, up to the degree.
  in.layout.expert = 4;
  in.moe_load = 1.0;
  const double balanced = item(plan::makePlan(in).memory, "MoE: expert rows");
  in.moe_load = 4.0;
  const auto collapsed = plan::makePlan(in);
  EXPECT_NEAR(item(collapsed.memory, "MoE: expert rows"), 4 * balanced, 0.01 * balanced);
  EXPECT_DOUBLE_EQ(collapsed.moe_load, 4.0);
  in.moe_load = 0;  // dropless default: 2x balanced, said in a note
  const auto fallback = plan::makePlan(in);
  EXPECT_DOUBLE_EQ(fallback.moe_load, 2.0);
  EXPECT_NE(fallback.moe_load_source.find("dropless default"), std::string::npos);
  // Expert degree on a dense model, or one that does not divide the experts, is refused.
  in.layout.expert = 3;
  EXPECT_THROW(plan::makePlan(in), Error);
  // The advice names an expert degree when one fits (at 2,048-token micro-batches the
  // experts' state decides it).
  in.layout.expert = 1;
  in.moe_load = 0;
  in.micro_batch_tokens = 2048;
  const auto p1 = plan::makePlan(in);
  ASSERT_FALSE(p1.fits);
  bool expert_advised = false;
  for (const auto& a : p1.advice) expert_advised |= a.find("--expert ") != std::string::npos;
  EXPECT_TRUE(expert_advised);
  // Model FLOPs per token are the active ones (top-2 of 8), below the total parameters'.
  EXPECT_LT(p1.model_flops_per_token, 6.0 * static_cast<double>(in.model.numParameters()));
}

TEST(Plan, DeckSectionsAreHonoured) {
  // parallel (shard, expert), moe and fp8 from the deck; --set overrides it (deck::load's
  // overrides are what resolve() applies).
  auto deck = deck::resolve(*deck::readYamlString(
      "model: { preset: esm2_35m }\n"
      "data: { tokens_per_batch: 65536, micro_batch_tokens: 8192, max_seq_len: 256 }\n"
      "train: { precision: fp8 }\n"
      "fp8: { first_layers_bf16: 2, last_layers_bf16: 1 }\n"
      "moe: { experts: 8, top_k: 2, expert_ffn: 960, dropless: false, capacity_factor: 1.5 }\n"
      "parallel: { shard_degree: 1, expert_degree: 4 }\n"));
  EXPECT_EQ(plan::ranksForDeck(*deck), 4);
  auto layout = plan::layoutFromDeck(*deck, 8, 1);
  EXPECT_EQ(layout.expert, 4);
  EXPECT_EQ(layout.shard, 1);
  const auto in = plan::inputFromDeck(*deck, layout, plan::builtinRates("h100"));
  EXPECT_EQ(in.model.moe.experts, 8);
  EXPECT_EQ(in.model.moe.expert_ffn, 960);
  EXPECT_DOUBLE_EQ(in.model.moe.capacity_factor, 1.5);
  EXPECT_EQ(in.compute, Compute::Fp8);
  const auto p = plan::makePlan(in);
  EXPECT_DOUBLE_EQ(p.moe_load, 1.5);  // the capacity bound
  // FP8 codes only for the 12 - 2 - 1 = 9 FP8 layers: 2 x 9 x (4 h^2) (the FFNs are experts).
  // (The expert codes come with the MoE layers' FFN weights: counted with the codes below.)
  EXPECT_GT(item(p.memory, "FP8 weight codes"), 0);
  // Node-wide sharding (shard_degree 0) resolves to the ranks of a node; replicate the rest.
  auto sharded =
      deck::resolve(*deck::readYamlString("model: { preset: esm2_35m }\n"
                                          "parallel: { shard_degree: 0 }\n"));
  const auto l2 = plan::layoutFromDeck(*sharded, 8, 4);
  EXPECT_EQ(l2.shard, 8);
  EXPECT_EQ(l2.replicate(), 4);
  auto bad = deck::resolve(*deck::readYamlString("parallel: { shard_degree: 3 }\n"));
  EXPECT_THROW(plan::layoutFromDeck(*bad, 8, 1), Error);
}

TEST(Plan, Fp8CodesCountSwigluExpertsThreeMatrices) {
  // Under fp8 a held SwiGLU expert's FP8 codes are its stacked [gate; up] (2 f_e x h) and its
  // down matrix: h f_e more per held expert and FP8 MoE layer than a GELU expert's, twice (the
  // codes and their transpose).
  auto planFor = [](const std::string& activation) {
    auto deck = deck::resolve(*deck::readYamlString(
        "model: { preset: esm2_35m }\n"
        "data: { tokens_per_batch: 65536, micro_batch_tokens: 8192, max_seq_len: 256 }\n"
        "train: { precision: fp8 }\n"
        "fp8: { first_layers_bf16: 2, last_layers_bf16: 1 }\n"
        "moe: { experts: 8, top_k: 2, expert_ffn: 960, expert_activation: " +
        activation +
        " }\n"
        "parallel: { shard_degree: 1, expert_degree: 4 }\n"));
    const auto in =
        plan::inputFromDeck(*deck, plan::layoutFromDeck(*deck, 8, 1), plan::builtinRates("h100"));
    return std::make_pair(in.model, plan::makePlan(in));
  };
  const auto [gelu_c, gelu] = planFor("gelu");
  const auto [swiglu_c, swiglu] = planFor("swiglu");
  ASSERT_TRUE(swiglu_c.moe.swiglu());
  double layers = 0;
  for (int l = 0; l < swiglu_c.num_layers; ++l)
    layers += swiglu_c.moe.isMoeLayer(l) && swiglu_c.fp8.fp8Layer(l, swiglu_c.num_layers);
  EXPECT_GT(layers, 0);
  const double held = 8 / 4, h = swiglu_c.hidden, fe = 960;
  EXPECT_DOUBLE_EQ(item(swiglu.memory, "FP8 weight codes") - item(gelu.memory, "FP8 weight codes"),
                   2 * layers * held * h * fe);
}

TEST(Plan, MeasuredMoeLoadOfTheFullestRank) {
  // Two layers, 4 experts over 2 ranks (experts 0-1 on rank 0, 2-3 on rank 1).  Layer 0:
  // rank 0 gets 30 of 40 slots (load 2 x 30/40 = 1.5); layer 1 balanced (1.0): mean 1.25.
  const std::vector<std::vector<double>> routed = {{20, 10, 5, 5}, {10, 10, 10, 10}};
  EXPECT_DOUBLE_EQ(plan::measuredMoeLoad(routed, 4, 2), 1.25);
  EXPECT_DOUBLE_EQ(plan::measuredMoeLoad(routed, 4, 1), 0.0);           // no expert parallelism
  EXPECT_DOUBLE_EQ(plan::measuredMoeLoad({{40, 0, 0, 0}}, 4, 4), 4.0);  // collapsed
}
