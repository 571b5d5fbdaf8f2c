// The tensor table (tensor_table.hpp): the one place that lists an ESM-2 model's tensors, in
// buffer order, with their attributes.
#include "model/tensor_table.hpp"

#include "core/error.hpp"
#include "model/esm2.hpp"
#include "model/lora.hpp"
#include "model/model_file.hpp"

#include <algorithm>
#include <map>

namespace plm::model {

std::vector<TensorRow> tensorTable(const Esm2Config& c, const ExpertPlacement& held) {
  std::vector<TensorRow> table;
  std::int64_t offset = 0;
  std::uint64_t stream = 0;
  const std::int64_t h = c.hidden, f = c.ffn, v = c.vocab;
  // What the rows added next share: their group, layer, routed expert and FP8 GEMM.
  TensorGroup group = TensorGroup::Embedding;
  int layer = -1, expert = -1, fp8 = -1;
  bool trained = true;
  // LoRA adapters draw from streams of their own and take no Hugging Face position, so the base
  // tensors' values and HF order do not depend on whether adapters are present.
  std::uint64_t lora_stream = std::uint64_t(1) << 40;
  bool adapter = false;
  auto add = [&](const std::string& name, std::vector<std::int64_t> shape, bool decay,
                 InitKind init, ComputeCopy copy) {
    if (expert >= 0 && !held.holds(expert, c.moe.experts)) {
      ++stream;
      return;
    }
    TensorRow t;
    t.name = name;
    t.shape = shape;
    t.size = 1;
    for (auto e : shape) t.size *= e;
    t.offset = offset;
    t.weight_decay = decay;
    t.group = group;
    t.layer = layer;
    t.expert = expert;
    t.init = init;
    t.trained = trained;
    t.lora = adapter;
    if (adapter) {
      t.stream = lora_stream++;
    } else {
      t.stream = stream;
      t.hf_order = static_cast<int>(stream++);
    }
    t.copy = copy;
    t.fp8_gemm = decay ? fp8 : -1;  // a GEMM's weight, not its bias
    // Keep every tensor 64-byte aligned in the flat buffer (vector loads, sharding).
    offset += alignedElements(t.size);
    table.push_back(std::move(t));
  };
  auto linear = [&](const std::string& prefix, std::int64_t out, std::int64_t in, int gemm,
                    ComputeCopy weight, ComputeCopy bias) {
    fp8 = gemm;
    add(prefix + ".weight", {out, in}, true, InitKind::Normal, weight);
    add(prefix + ".bias", {out}, false, InitKind::Zero, bias);
    fp8 = -1;
  };
  auto norm = [&](const std::string& prefix, std::int64_t n) {
    add(prefix + ".weight", {n}, false, InitKind::One, ComputeCopy::Master);
    add(prefix + ".bias", {n}, false, InitKind::Zero, ComputeCopy::Master);
  };
  using CC = ComputeCopy;
  constexpr int qkv = int(Fp8Gemm::Qkv), attn_out = int(Fp8Gemm::AttnOut),
                ffn_in = int(Fp8Gemm::FfnIn), ffn_out = int(Fp8Gemm::FfnOut);
  add("esm.embeddings.word_embeddings.weight", {v, h}, false, InitKind::Normal, CC::Packed);
  group = TensorGroup::Layer;
  for (int l = 0; l < c.num_layers; ++l) {
    layer = l;
    const std::string p = "esm.encoder.layer." + std::to_string(l) + ".";
    linear(p + "attention.self.query", h, h, qkv, CC::QkvWeight, CC::QkvBias);
    linear(p + "attention.self.key", h, h, qkv, CC::QkvWeight, CC::QkvBias);
    linear(p + "attention.self.value", h, h, qkv, CC::QkvWeight, CC::QkvBias);
    linear(p + "attention.output.dense", h, h, attn_out, CC::Packed, CC::PackedFp8);
    norm(p + "attention.LayerNorm", h);
    if (c.moe.isMoeLayer(l)) {
      // Experts by name, one set of tensors each, so any expert degree reads the same table.
      const std::int64_t e_n = c.moe.experts, fe = c.moe.expert_ffn;
      add(p + "moe.router.weight", {e_n, h}, true, InitKind::Normal, CC::Master);
      if (c.moe.bias_balance) {
        trained = false;  // balanceExpertBias sets it
        add(p + "moe.router.expert_bias", {e_n}, false, InitKind::Zero, CC::Master);
        trained = true;
      }
      for (int e = 0; e < c.moe.experts; ++e) {
        expert = e;
        const std::string x = p + "moe.experts." + std::to_string(e) + ".";
        if (c.moe.swiglu()) {  // no biases; gate and up back to back (F_e H % 16 == 0)
          fp8 = ffn_in;
          add(x + "gate_proj.weight", {fe, h}, true, InitKind::Normal, CC::Packed);
          add(x + "up_proj.weight", {fe, h}, true, InitKind::Normal, CC::Packed);
          fp8 = ffn_out;
          add(x + "down_proj.weight", {h, fe}, true, InitKind::Normal, CC::Packed);
          fp8 = -1;
          continue;
        }
        // A routed expert's output is bf16, so its second bias is packed too.
        linear(x + "intermediate.dense", fe, h, ffn_in, CC::Packed, CC::Packed);
        linear(x + "output.dense", h, fe, ffn_out, CC::Packed, CC::Packed);
      }
      expert = -1;
      if (c.moe.shared_experts > 0) {
        const std::int64_t sw = fe * c.moe.shared_experts;
        linear(p + "moe.shared_experts.intermediate.dense", sw, h, ffn_in, CC::Packed, CC::Packed);
        linear(p + "moe.shared_experts.output.dense", h, sw, ffn_out, CC::Packed, CC::PackedFp8);
      }
    } else {
      linear(p + "intermediate.dense", f, h, ffn_in, CC::Packed, CC::Packed);
      linear(p + "output.dense", h, f, ffn_out, CC::Packed, CC::PackedFp8);
    }
    norm(p + "LayerNorm", h);
    // LoRA adapters (model/lora.hpp) last in the layer, so they are part of its group (layer
    // ranges, sharded units, its slice of the bf16 compute copy).  A decays like PEFT's.
    const std::int64_t r = c.lora.rank;
    auto lora = [&](LoraTarget target, const std::string& prefix, std::int64_t out,
                    std::int64_t in) {
      if (!c.lora.enabled() || !c.lora.has(target)) return;
      adapter = true;
      add(prefix + ".lora_A.weight", {r, in}, true, InitKind::LoraA, CC::Packed);
      add(prefix + ".lora_B.weight", {out, r}, true, InitKind::Zero, CC::Packed);
      adapter = false;
    };
    lora(lora_q, p + "attention.self.query", h, h);
    lora(lora_k, p + "attention.self.key", h, h);
    lora(lora_v, p + "attention.self.value", h, h);
    lora(lora_o, p + "attention.output.dense", h, h);
    if (!c.moe.isMoeLayer(l)) {
      lora(lora_ffn_in, p + "intermediate.dense", f, h);
      lora(lora_ffn_out, p + "output.dense", h, f);
    }
  }
  group = TensorGroup::Head;
  layer = -1;
  norm("esm.encoder.emb_layer_norm_after", h);
  const std::size_t lm_head = table.size();
  linear("lm_head.dense", h, h, -1, CC::Packed, CC::Packed);  // the LM head has no FP8 GEMM
  norm("lm_head.layer_norm", h);
  add("lm_head.bias", {v}, false, InitKind::Zero, CC::Master);
  // transformers' state dict lists a module's own parameters before its submodules'.
  const int bias_order = table[lm_head].hf_order;
  for (std::size_t i = lm_head; i + 1 < table.size(); ++i) ++table[i].hf_order;
  table.back().hf_order = bias_order;
  return table;
}

std::int64_t tableElements(const std::vector<TensorRow>& table) {
  if (table.empty()) return 0;
  const auto& last = table.back();
  return alignedElements(last.offset + last.size);
}

std::vector<std::int64_t> computeCopyElements(const std::vector<TensorRow>& table,
                                              const Esm2Config& c, bool fp8_gpu) {
  std::vector<std::int64_t> out(table.size(), 0);
  // (layer, QkvWeight | QkvBias) -> the row charged with the stacked run, and its elements.
  std::map<std::pair<int, ComputeCopy>, std::pair<std::size_t, std::int64_t>> stacks;
  for (std::size_t i = 0; i < table.size(); ++i) {
    const TensorRow& t = table[i];
    switch (t.copy) {
      case ComputeCopy::Master: break;
      case ComputeCopy::Packed: out[i] = alignedElements(t.size); break;
      case ComputeCopy::PackedFp8:
        if (fp8_gpu && t.layer >= 0 && c.fp8.fp8Layer(t.layer, c.num_layers))
          out[i] = alignedElements(t.size);
        break;
      case ComputeCopy::QkvWeight:
      case ComputeCopy::QkvBias: {
        auto [it, fresh] = stacks.try_emplace({t.layer, t.copy}, i, 0);
        (void)fresh;
        it->second.second += t.size;
        break;
      }
    }
  }
  for (const auto& [key, run] : stacks) out[run.first] = alignedElements(run.second);
  return out;
}

namespace {
// "...moe.experts.<e>." of `name` with <e> replaced by `expert` (naming an expert this rank
// does not hold after one it does).
std::string renameExpert(const std::string& name, int expert) {
  static const std::string key = ".moe.experts.";
  const std::size_t at = name.find(key) + key.size();
  const std::size_t end = name.find('.', at);
  return name.substr(0, at) + std::to_string(expert) + name.substr(end);
}
}  // namespace

WholeTable wholeTable(const std::vector<TensorInfo>& table, const ExpertPlacement& placement,
                      int experts) {
  WholeTable out;
  const int n = placement.count(std::max(experts, 1)), first = placement.first(experts);
  for (std::size_t i = 0; i < table.size();) {
    if (!placement.sharded() || table[i].expert < 0) {
      out.tensors.push_back(table[i]);
      out.local.push_back(static_cast<int>(i));
      ++i;
      continue;
    }
    // One layer's held experts: n sets of m entries, expert `first` first.
    const int layer = table[i].layer;
    std::size_t end = i;
    while (end < table.size() && table[end].expert >= 0 && table[end].layer == layer) ++end;
    const std::size_t run = end - i;
    const std::size_t m = run / static_cast<std::size_t>(n);
    PLM_REQUIRE(m > 0 && m * static_cast<std::size_t>(n) == run,
                "plm::model::wholeTable: the held experts of layer " + std::to_string(layer) +
                    " are not equal sets of tensors (a bug)");
    for (std::size_t k = 0; k < run; ++k)
      PLM_REQUIRE(
          table[i + k].expert == first + static_cast<int>(k / m) &&
              table[i + k].name == renameExpert(table[i + k % m].name, first + int(k / m)),
          "plm::model::wholeTable: unexpected expert tensor " + table[i + k].name + " (a bug)");
    for (int e = 0; e < experts; ++e)
      for (std::size_t j = 0; j < m; ++j) {
        if (placement.holds(e, experts)) {
          const std::size_t at = i + static_cast<std::size_t>(e - first) * m + j;
          out.tensors.push_back(table[at]);
          out.local.push_back(static_cast<int>(at));
        } else {
          TensorInfo t = table[i + j];
          t.name = renameExpert(t.name, e);
          t.expert = e;
          t.stream = t.stream + std::uint64_t(e) * m - std::uint64_t(first) * m;
          t.hf_order = static_cast<int>(t.stream);
          t.offset = -1;
          out.tensors.push_back(t);
          out.local.push_back(-1);
        }
      }
    i = end;
  }
  return out;
}

std::vector<TensorRows> heldRows(const std::vector<TensorInfo>& table,
                                 const ExpertPlacement& placement, int experts, int rank,
                                 int world) {
  const WholeTable whole = wholeTable(table, placement, experts);
  const int holders = std::max(1, world / placement.degree);
  std::vector<TensorRows> out;
  for (std::size_t i = 0; i < whole.tensors.size(); ++i) {
    TensorRows r;
    r.tensor = whole.tensors[i];
    const std::int64_t rows = r.tensor.shape.empty() ? 1 : r.tensor.shape[0];
    const bool expert = placement.sharded() && r.tensor.expert >= 0;
    if (whole.local[i] >= 0) {
      auto [first, last] = expert ? model::rowRange(rows, rank / placement.degree, holders)
                                  : model::rowRange(rows, rank, world);
      r.first_row = first;
      r.row_count = last - first;
    }
    out.push_back(std::move(r));
  }
  return out;
}

std::vector<std::pair<std::int64_t, std::int64_t>> expertRuns(
    const std::vector<TensorInfo>& table) {
  std::vector<std::pair<std::int64_t, std::int64_t>> runs;
  int layer = -1;
  for (const auto& t : table) {
    if (t.expert < 0) continue;
    if (runs.empty() || t.layer != layer) {
      runs.push_back({t.offset, t.size});
      layer = t.layer;
    } else {
      runs.back().second = t.offset + t.size - runs.back().first;
    }
  }
  return runs;
}

}  // namespace plm::model
