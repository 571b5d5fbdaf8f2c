// Esm2Config: presets (doc/anchors.md §1), parameter and FLOP counts, validation.
#include "model/esm2.hpp"

#include "core/error.hpp"

#include <map>

namespace plm::model {
namespace {

struct Shape {
  int layers, hidden, heads, ffn;
};

/// MoE presets: the dense shape plus the `moe` section they imply (doc/model.md).
struct MoePreset {
  Shape shape;
  int experts, top_k, every, expert_ffn;
  ExpertActivation activation = ExpertActivation::Gelu;
};

const std::map<std::string, MoePreset>& moePresets() {
  // esm2_moe_<total>_a<active>: a dense preset's attention and active FFN FLOPs (8 experts of
  // ffn / 2, top-2 = one ffn-wide FFN per token); AIDO.Protein-16B's shape as published
  // with its SwiGLU experts (vocabulary and the rest: see doc/model.md).
  static const std::map<std::string, MoePreset> table = {
      {"esm2_moe_100m_a35m", {{12, 480, 20, 1920}, 8, 2, 1, 960}},
      {"esm2_moe_2b_a650m", {{33, 1280, 20, 5120}, 8, 2, 1, 2560}},
      {"aido_protein_16b", {{36, 2304, 36, 7680}, 8, 2, 1, 7680, ExpertActivation::Swiglu}},
  };
  return table;
}

const std::map<std::string, Shape>& presets() {
  static const std::map<std::string, Shape> table = {
      {"esm2_8m", {6, 320, 20, 1280}},    {"esm2_35m", {12, 480, 20, 1920}},
      {"esm2_150m", {30, 640, 20, 2560}}, {"esm2_650m", {33, 1280, 20, 5120}},
      {"esm2_3b", {36, 2560, 40, 10240}}, {"esm2_15b", {48, 5120, 40, 20480}},
  };
  return table;
}

}  // namespace

std::vector<std::string> Esm2Config::presetNames() {
  return {"esm2_8m",  "esm2_35m",           "esm2_150m",         "esm2_650m",       "esm2_3b",
          "esm2_15b", "esm2_moe_100m_a35m", "esm2_moe_2b_a650m", "aido_protein_16b"};
}

Esm2Config Esm2Config::preset(const std::string& name) {
  auto moe = moePresets().find(name);
  if (moe != moePresets().end()) {
    Esm2Config c;
    c.num_layers = moe->second.shape.layers;
    c.hidden = moe->second.shape.hidden;
    c.heads = moe->second.shape.heads;
    c.ffn = moe->second.shape.ffn;
    c.moe.experts = moe->second.experts;
    c.moe.top_k = moe->second.top_k;
    c.moe.every = moe->second.every;
    c.moe.expert_ffn = moe->second.expert_ffn;
    c.moe.expert_activation = moe->second.activation;
    return c;
  }
  auto it = presets().find(name);
  if (it == presets().end()) {
    std::string names;
    for (const auto& n : presetNames()) names += (names.empty() ? "" : ", ") + n;
    throw collectiveError("model.preset: unknown ESM-2 preset '" + name + "'; use one of " + names +
                          ", or \"custom\" with explicit model.layers/hidden/heads/ffn");
  }
  Esm2Config c;
  c.num_layers = it->second.layers;
  c.hidden = it->second.hidden;
  c.heads = it->second.heads;
  c.ffn = it->second.ffn;
  return c;
}

namespace {

/// Matmul weights one token passes through in layer l's FFN (router included).
double ffnMatmulWeights(const Esm2Config& c, int layer) {
  const double h = c.hidden;
  if (!c.moe.isMoeLayer(layer)) return 2 * h * c.ffn;
  const double fe = c.moe.expert_ffn;
  return h * c.moe.experts + c.moe.expertMatrices() * h * fe * c.moe.top_k +
         2 * h * fe * c.moe.shared_experts;
}

}  // namespace

std::int64_t Esm2Config::numParameters() const {
  std::int64_t n = 0;
  for (const auto& t : tensorTable(*this)) n += t.size;
  return n;
}

std::int64_t Esm2Config::activeParameters() const {
  // Routing sends a token through top_k routed experts of each MoE layer (any top_k of them
  // have as many parameters as the first); the balancing bias only picks them.
  std::int64_t n = 0;
  for (const auto& t : tensorTable(*this))
    if (t.trained && t.expert < moe.top_k) n += t.size;
  return n;
}

double Esm2Config::trainFlopsPerToken(double mean_seqlen_weighted) const {
  // Dense: 6 x (4 H^2 + 2 H F) per layer.  MoE: the router GEMM and top_k (+ shared) experts
  // of width expert_ffn count for each token (active FLOPs; dropped slots are not subtracted).
  const double h = hidden, v = vocab;
  if (!moe.enabled()) {
    const double f = ffn;
    const double dense = num_layers * (4 * h * h + 2 * h * f) + h * h + v * h;
    return 6.0 * dense + 12.0 * num_layers * h * mean_seqlen_weighted;
  }
  double matmul_weights = h * h + v * h;
  for (int l = 0; l < num_layers; ++l) matmul_weights += 4 * h * h + ffnMatmulWeights(*this, l);
  return 6.0 * matmul_weights + 12.0 * num_layers * h * mean_seqlen_weighted;
}

void Esm2Config::validate() const {
  auto fail = [](const std::string& what) {
    throw collectiveError("model: " + what +
                          " (set model.layers/hidden/heads/ffn in the deck, or a preset)");
  };
  if (num_layers <= 0) fail("layers must be positive, got " + std::to_string(num_layers));
  if (hidden <= 0 || heads <= 0 || ffn <= 0)
    fail("hidden, heads and ffn must be positive, got hidden=" + std::to_string(hidden) +
         " heads=" + std::to_string(heads) + " ffn=" + std::to_string(ffn));
  if (hidden % heads != 0)
    fail("hidden (" + std::to_string(hidden) + ") must be a multiple of heads (" +
         std::to_string(heads) + ")");
  if (headDim() % 2 != 0)
    fail("head_dim = hidden/heads = " + std::to_string(headDim()) +
         " must be even (rotary pairs dimensions)");
  if (vocab != 33) fail("vocab must be 33 (the ESM-2 alphabet), got " + std::to_string(vocab));
  if (max_positions <= 2) fail("max_positions must exceed 2, got " + std::to_string(max_positions));
  if (!(layer_norm_eps > 0)) fail("layer_norm_eps must be positive");
  moe.validate(hidden);
  if (lora.enabled()) {
    if (!(lora.alpha > 0))
      throw collectiveError("lora.alpha must be positive, got " + std::to_string(lora.alpha));
    if (lora.targets == 0 || (lora.targets & ~63u) != 0)
      throw collectiveError("lora.targets: none given; name at least one of " +
                            loraTargetNames(~0u));
    if (moe.enabled() && (lora.has(lora_ffn_in) || lora.has(lora_ffn_out)))
      throw collectiveError("lora.targets " + loraTargetNames(lora.targets) +
                            ": ffn_in/ffn_out adapters are not implemented for Mixture-of-Experts "
                            "models; use attention targets (q,k,v,o)");
  }
}

}  // namespace plm::model
