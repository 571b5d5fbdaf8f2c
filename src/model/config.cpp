// Esm2Config: presets (doc/anchors.md §1), parameter and FLOP counts, validation.
#include "model/esm2.hpp"

#include "core/error.hpp"

#include <map>

namespace plm::model {
namespace {

struct Shape {
  int layers, hidden, heads, ffn;
};

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
  return {"esm2_8m", "esm2_35m", "esm2_150m", "esm2_650m", "esm2_3b", "esm2_15b"};
}

Esm2Config Esm2Config::preset(const std::string& name) {
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

std::int64_t Esm2Config::numParameters() const {
  const std::int64_t h = hidden, f = ffn, v = vocab;
  const std::int64_t per_layer = 4 * (h * h + h) + 2 * (2 * h) + (f * h + f) + (h * f + h);
  return v * h + num_layers * per_layer + 2 * h + (h * h + h) + 2 * h + v;
}

double Esm2Config::trainFlopsPerToken(double mean_seqlen_weighted) const {
  const double h = hidden, f = ffn, v = vocab;
  const double matmul_weights = num_layers * (4 * h * h + 2 * h * f) + h * h + v * h;
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
}

}  // namespace plm::model
