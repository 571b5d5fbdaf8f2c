// The tensor table (model/tensor_table.hpp) against the model that binds it and the consumers
// that read it: for a dense model, a GELU MoE model (shared experts, balancing bias) and a SwiGLU
// MoE model, each whole and as one rank of an expert group of 2,
//  - the rows equal Esm2::tensors() (names, shapes, offsets, sizes, attributes) and lie in the
//    buffer without overlap, each at an aligned offset, their layer's rows inside layerRange;
//  - the values Esm2::initialize draws follow each row's init kind, and a held expert's values
//    equal the whole model's (one random stream per row, whatever the placement);
//  - under fp8 (portable path) the FP8 weight copies read exactly the rows with an FP8 slot;
//  - Hugging Face names: transformers' state-dict order written out by hand, the table's rows
//    by HF order, and model::hf::esmTensors agree, and each HF entry finds its row back by name;
//  - parameter counts from the table equal the model's buffer, the planner's, and hand counts.
#include "model/esm2.hpp"
#include "model/hf_esm.hpp"
#include "model/tensor_table.hpp"
#include "plan/plan.hpp"
#include "plm/plm_config.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <set>
#include <string>
#include <vector>

namespace {

using namespace plm;
using model::Esm2;
using model::Esm2Config;
using model::TensorRow;

Esm2Config dense() {
  Esm2Config c;
  c.num_layers = 2;
  c.hidden = 16;
  c.heads = 2;
  c.ffn = 24;
  return c;
}

Esm2Config gelu() {
  Esm2Config c = dense();
  c.num_layers = 4;
  c.moe.experts = 4;
  c.moe.top_k = 2;
  c.moe.every = 2;
  c.moe.expert_ffn = 8;
  c.moe.shared_experts = 1;
  c.moe.bias_balance = true;
  return c;
}

Esm2Config swiglu() {
  Esm2Config c = gelu();
  c.moe.expert_activation = model::ExpertActivation::Swiglu;
  c.moe.expert_ffn = 16;
  c.moe.shared_experts = 0;
  c.moe.bias_balance = false;
  return c;
}

std::vector<Esm2Config> configs() { return {dense(), gelu(), swiglu()}; }

std::vector<model::ExpertPlacement> placements(const Esm2Config& c) {
  if (!c.moe.enabled()) return {{}};
  return {{}, {2, 1}};
}

TEST(TensorTable, AlignedElements) {
  EXPECT_EQ(model::alignedElements(0), 0);
  EXPECT_EQ(model::alignedElements(1), 16);
  EXPECT_EQ(model::alignedElements(16), 16);
  EXPECT_EQ(model::alignedElements(17), 32);
}

TEST(TensorTable, RowsAreTheModelsTensors) {
  for (const auto& c : configs())
    for (const auto& held : placements(c)) {
      SCOPED_TRACE("experts " + std::to_string(c.moe.experts) + " degree " +
                   std::to_string(held.degree));
      Esm2<double> m(c, held);
      const auto rows = model::tensorTable(c, held);
      const auto& bound = m.tensors();
      ASSERT_EQ(rows.size(), bound.size());
      EXPECT_EQ(model::tableElements(rows), m.bufferElements());
      std::int64_t end = 0;
      std::uint64_t last_stream = 0;
      for (std::size_t i = 0; i < rows.size(); ++i) {
        const TensorRow& r = rows[i];
        const TensorRow& b = bound[i];
        SCOPED_TRACE(r.name);
        EXPECT_EQ(r.name, b.name);
        EXPECT_EQ(r.shape, b.shape);
        EXPECT_EQ(r.offset, b.offset);
        EXPECT_EQ(r.size, b.size);
        EXPECT_EQ(r.group, b.group);
        EXPECT_EQ(r.layer, b.layer);
        EXPECT_EQ(r.expert, b.expert);
        EXPECT_EQ(r.stream, b.stream);
        std::int64_t size = 1;
        for (auto d : r.shape) size *= d;
        EXPECT_EQ(r.size, size);
        EXPECT_EQ(r.offset % 16, 0);
        EXPECT_GE(r.offset, end);  // buffer order, no overlap
        end = r.offset + r.size;
        if (i > 0) EXPECT_GT(r.stream, last_stream);
        last_stream = r.stream;
        EXPECT_EQ(&m.tensor(r.name), &b);
        if (r.expert >= 0) EXPECT_TRUE(held.holds(r.expert, c.moe.experts));
        if (r.group == model::TensorGroup::Layer) {
          const auto [lo, count] = m.layerRange(r.layer);
          EXPECT_GE(r.offset, lo);
          EXPECT_LE(r.offset + r.size, lo + count);
        } else {
          EXPECT_EQ(r.layer, -1);
          EXPECT_EQ(r.expert, -1);
        }
      }
      // Every expert of every MoE layer, as far as held, with the expected rows per expert.
      std::map<std::pair<int, int>, int> per_expert;
      for (const auto& r : rows)
        if (r.expert >= 0) ++per_expert[{r.layer, r.expert}];
      int moe_layers = 0;
      for (int l = 0; l < c.num_layers; ++l) moe_layers += c.moe.isMoeLayer(l) ? 1 : 0;
      EXPECT_EQ(static_cast<int>(per_expert.size()),
                moe_layers * (c.moe.enabled() ? held.count(c.moe.experts) : 0));
      for (const auto& [key, n] : per_expert) EXPECT_EQ(n, c.moe.swiglu() ? 3 : 4);
      EXPECT_EQ(model::expertRuns(rows).size(), static_cast<std::size_t>(moe_layers));
    }
}

TEST(TensorTable, InitialValuesFollowTheRows) {
  for (const auto& c : configs()) {
    SCOPED_TRACE("experts " + std::to_string(c.moe.experts));
    Esm2<double> whole(c);
    whole.initialize(7);
    const auto all = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), whole.parameters());
    std::int64_t end = 0;
    for (const auto& r : whole.tensors()) {
      SCOPED_TRACE(r.name);
      for (std::int64_t g = end; g < r.offset; ++g) ASSERT_EQ(all(g), 0.0);  // padding
      end = r.offset + r.size;
      int zeros = 0, ones = 0;
      for (std::int64_t e = 0; e < r.size; ++e) {
        zeros += all(r.offset + e) == 0.0;
        ones += all(r.offset + e) == 1.0;
      }
      switch (r.init) {
        case model::InitKind::Zero: EXPECT_EQ(zeros, r.size); break;
        case model::InitKind::One: EXPECT_EQ(ones, r.size); break;
        case model::InitKind::Normal:
          // The embedding's <pad> row stays zero; nothing else draws an exact 0 or 1.
          EXPECT_LE(zeros, r.group == model::TensorGroup::Embedding ? r.shape[1] : 0);
          EXPECT_EQ(ones, 0);
          break;
      }
    }
    if (!c.moe.enabled()) continue;
    // The second rank of an expert group of 2 draws its rows as the whole model does.
    Esm2<double> part(c, {2, 1});
    part.initialize(7);
    const auto mine = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), part.parameters());
    for (const auto& r : part.tensors()) {
      const auto& w = whole.tensor(r.name);
      EXPECT_EQ(r.stream, w.stream) << r.name;
      for (std::int64_t e = 0; e < r.size; ++e)
        ASSERT_EQ(mine(r.offset + e), all(w.offset + e)) << r.name << " element " << e;
    }
  }
}

TEST(TensorTable, Fp8SlotsAreTheFp8WeightCopies) {
  for (Esm2Config c : {dense(), gelu()}) {
    c.precision = model::Precision::Fp8;
    c.fp8.first_layers_bf16 = 1;  // layer 0 keeps its GEMMs out of FP8
    Esm2<float> m(c);
    const auto copies = m.fp8Weights();
    if (copies.empty()) GTEST_SKIP() << "the CUDA path keeps no portable FP8 weight copies";
    std::map<std::int64_t, const TensorRow*> by_offset;
    for (const auto& r : m.tensors()) by_offset[r.offset] = &r;
    std::set<std::int64_t> read, expected;
    for (const auto& w : copies) {
      int gemm = -2;
      for (std::int64_t at : w.from) {
        read.insert(at);
        ASSERT_TRUE(by_offset.count(at));
        const TensorRow& r = *by_offset[at];
        if (gemm == -2) gemm = r.fp8_gemm;
        EXPECT_EQ(r.fp8_gemm, gemm) << r.name << ": stacked with another GEMM's weight";
      }
      EXPECT_EQ(w.from.size(), gemm == int(model::Fp8Gemm::Qkv) ? 3u : 1u);
    }
    for (const auto& r : m.tensors())
      if (r.fp8_gemm >= 0 && c.fp8.fp8Layer(r.layer, c.num_layers)) expected.insert(r.offset);
    EXPECT_EQ(read, expected);
    EXPECT_FALSE(expected.empty());
  }
}

TEST(TensorTable, HuggingFaceNamesRoundTrip) {
  Esm2Config c = dense();
  c.num_layers = 1;
  // transformers' EsmForMaskedLM state dict (tied lm_head.decoder.weight left out).
  const std::vector<std::string> hf = {"esm.embeddings.word_embeddings.weight",
                                       "esm.encoder.layer.0.attention.self.query.weight",
                                       "esm.encoder.layer.0.attention.self.query.bias",
                                       "esm.encoder.layer.0.attention.self.key.weight",
                                       "esm.encoder.layer.0.attention.self.key.bias",
                                       "esm.encoder.layer.0.attention.self.value.weight",
                                       "esm.encoder.layer.0.attention.self.value.bias",
                                       "esm.encoder.layer.0.attention.output.dense.weight",
                                       "esm.encoder.layer.0.attention.output.dense.bias",
                                       "esm.encoder.layer.0.attention.LayerNorm.weight",
                                       "esm.encoder.layer.0.attention.LayerNorm.bias",
                                       "esm.encoder.layer.0.intermediate.dense.weight",
                                       "esm.encoder.layer.0.intermediate.dense.bias",
                                       "esm.encoder.layer.0.output.dense.weight",
                                       "esm.encoder.layer.0.output.dense.bias",
                                       "esm.encoder.layer.0.LayerNorm.weight",
                                       "esm.encoder.layer.0.LayerNorm.bias",
                                       "esm.encoder.emb_layer_norm_after.weight",
                                       "esm.encoder.emb_layer_norm_after.bias",
                                       "lm_head.bias",
                                       "lm_head.dense.weight",
                                       "lm_head.dense.bias",
                                       "lm_head.layer_norm.weight",
                                       "lm_head.layer_norm.bias"};
  for (const auto& cfg : {c, dense(), gelu()}) {
    const auto rows = model::tensorTable(cfg);
    Esm2<double> m(cfg);
    std::vector<const TensorRow*> by_hf(rows.size(), nullptr);
    for (const auto& r : rows) {
      ASSERT_GE(r.hf_order, 0) << r.name;
      ASSERT_LT(r.hf_order, static_cast<int>(rows.size())) << r.name;
      EXPECT_EQ(by_hf[r.hf_order], nullptr) << r.name << " shares its HF position";
      by_hf[r.hf_order] = &r;
    }
    if (cfg.num_layers == 1)
      for (std::size_t i = 0; i < hf.size(); ++i) EXPECT_EQ(by_hf[i]->name, hf[i]);
    if (cfg.moe.enabled()) continue;  // plm's MoE format stores the table in buffer order
    const auto tensors = model::hf::esmTensors(cfg);
    ASSERT_EQ(tensors.size(), rows.size());
    std::int64_t offset = 0;
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      const auto& t = tensors[i];
      EXPECT_EQ(t.name, by_hf[i]->name);
      EXPECT_EQ(t.offset, offset);  // safetensors order, unpadded
      offset += t.size;
      const auto& r = m.tensor(t.name);  // HF name -> the bound row
      EXPECT_EQ(r.shape, t.shape);
      EXPECT_EQ(r.weight_decay, t.weight_decay);
      EXPECT_EQ(r.hf_order, static_cast<int>(i));
    }
  }
}

TEST(TensorTable, ParameterCountsAgree) {
  for (const auto& c : configs())
    for (const auto& held : placements(c)) {
      SCOPED_TRACE("experts " + std::to_string(c.moe.experts) + " degree " +
                   std::to_string(held.degree));
      const auto rows = model::tensorTable(c, held);
      Esm2<double> m(c, held);
      const auto counts = plan::parameterCounts(c, held.degree);
      EXPECT_EQ(counts.flat, m.bufferElements());
      std::int64_t expert_elements = 0, copy = 0;
      for (const auto& r : rows)
        expert_elements += r.expert >= 0 ? model::alignedElements(r.size) : 0;
      EXPECT_EQ(counts.experts, expert_elements);
      for (auto n : model::computeCopyElements(rows, c, false)) copy += n;
      EXPECT_EQ(counts.compute, copy);
    }
  // By hand: h 16, f 24, V 33; MoE layers 1 and 3 of 4 with 4 experts of width f_e.
  const std::int64_t h = 16, f = 24, v = 33;
  const std::int64_t attention = 4 * (h * h + h) + 2 * 2 * h, ffn = (f * h + f) + (h * f + h);
  const std::int64_t outer = v * h + 2 * h + (h * h + h) + 2 * h + v;
  EXPECT_EQ(dense().numParameters(), outer + 2 * (attention + ffn));  // attention: both LNs
  const std::int64_t fe = 8, e = 4;
  const std::int64_t expert = (fe * h + fe) + (h * fe + h);       // GELU, with biases
  const std::int64_t moe_gelu = e * h + e + e * expert + expert;  // router, bias, experts, shared
  const Esm2Config g = gelu();
  EXPECT_EQ(g.numParameters(), outer + 4 * attention + 2 * ffn + 2 * moe_gelu);
  EXPECT_EQ(g.activeParameters(), g.numParameters() - 2 * (e + 2 * expert));
  const std::int64_t fs = 16, swi = 3 * fs * h;  // SwiGLU: gate, up, down, no biases
  const Esm2Config s = swiglu();
  EXPECT_EQ(s.numParameters(), outer + 4 * attention + 2 * ffn + 2 * (e * h + e * swi));
  EXPECT_EQ(s.activeParameters(), s.numParameters() - 2 * 2 * swi);
  std::int64_t sum = 0;
  for (const auto& r : model::tensorTable(s)) sum += r.size;
  EXPECT_EQ(sum, s.numParameters());
}

}  // namespace
