// Fp8Scaling and the recipes' names (fp8_scaling.hpp).
#include "model/fp8_scaling.hpp"

#include "core/error.hpp"
#include "dist/allreduce.hpp"
#include "dist/process_groups.hpp"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <limits>

namespace plm::model {

namespace {

[[noreturn]] void badName(const char* key, const std::string& name, const char* valid) {
  throw collectiveError(std::string(key) + ": '" + name + "' is not one of " + valid +
                        " (doc/fp8.md)");
}

}  // namespace

Fp8Recipe parseFp8Recipe(const std::string& name) {
  if (name == "delayed") return Fp8Recipe::Delayed;
  if (name == "current") return Fp8Recipe::Current;
  if (name == "block") return Fp8Recipe::Block;
  badName("fp8.recipe", name, "delayed, current, block");
}

Fp8Format parseFp8Format(const std::string& name) {
  if (name == "hybrid") return Fp8Format::Hybrid;
  if (name == "e4m3") return Fp8Format::E4M3;
  badName("fp8.format", name, "hybrid, e4m3");
}

AmaxReduce parseAmaxReduce(const std::string& name) {
  if (name == "max") return AmaxReduce::Max;
  if (name == "most_recent") return AmaxReduce::MostRecent;
  badName("fp8.amax_reduce", name, "max, most_recent");
}

Fp8Wgrad parseFp8Wgrad(const std::string& name) {
  if (name == "fp8") return Fp8Wgrad::Fp8;
  if (name == "bf16") return Fp8Wgrad::Bf16;
  badName("fp8.wgrad", name, "fp8, bf16");
}

const char* fp8RecipeName(Fp8Recipe r) {
  return r == Fp8Recipe::Delayed ? "delayed" : r == Fp8Recipe::Current ? "current" : "block";
}
const char* fp8FormatName(Fp8Format f) { return f == Fp8Format::Hybrid ? "hybrid" : "e4m3"; }
const char* amaxReduceName(AmaxReduce r) { return r == AmaxReduce::Max ? "max" : "most_recent"; }
const char* fp8WgradName(Fp8Wgrad w) { return w == Fp8Wgrad::Fp8 ? "fp8" : "bf16"; }

const char* fp8GemmName(Fp8Gemm g) {
  switch (g) {
    case Fp8Gemm::Qkv: return "qkv";
    case Fp8Gemm::AttnOut: return "attention_out";
    case Fp8Gemm::FfnIn: return "ffn_in";
    case Fp8Gemm::FfnOut: return "ffn_out";
  }
  return "?";
}

const char* fp8OperandName(Fp8Operand o) {
  return o == Fp8Operand::Input ? "input" : o == Fp8Operand::Weight ? "weight" : "grad";
}

void Fp8Config::validate(int num_layers) const {
  auto fail = [](const std::string& what) { throw collectiveError(what + " (doc/fp8.md)"); };
  if (amax_history < 1 || amax_history > (1 << 20))
    fail("fp8.amax_history: " + std::to_string(amax_history) +
         " is not a history length; use 1 to 1048576 (Transformer Engine's default is 1024)");
  if (margin < 0 || margin > 32)
    fail("fp8.margin: " + std::to_string(margin) +
         " is out of range; use 0 to 32 (scales are divided by 2^margin)");
  if (first_layers_bf16 < 0 || last_layers_bf16 < 0)
    fail("fp8.first_layers_bf16 / fp8.last_layers_bf16 must not be negative");
  if (first_layers_bf16 + last_layers_bf16 > num_layers)
    fail("fp8.first_layers_bf16 (" + std::to_string(first_layers_bf16) +
         ") + fp8.last_layers_bf16 (" + std::to_string(last_layers_bf16) + ") exceed the model's " +
         std::to_string(num_layers) + " layers; lower them");
}

float delayedScale(float amax, float fp8_max, int margin, float previous) {
  if (!(amax > 0.0f) || !std::isfinite(amax)) return previous;
  const float s = (fp8_max / amax) / std::ldexp(1.0f, margin);
  return std::isinf(s) ? FLT_MAX : s;
}

float currentScale(float amax, float fp8_max) {
  if (!(amax > 0.0f) || !std::isfinite(amax)) return 1.0f;
  const float s = fp8_max / amax;
  return std::isinf(s) ? FLT_MAX : s;
}

float powerOfTwoScale(float amax, float fp8_max) {
  if (!(amax > 0.0f) || !std::isfinite(amax)) return 1.0f;
  // Transformer Engine keeps the exponent bits of the fp32 quotient: 2^floor(log2(q)).
  const float q = fp8_max / amax;
  if (std::isinf(q)) return std::ldexp(1.0f, 127);
  int e = 0;
  std::frexp(q, &e);  // q = f * 2^e, f in [0.5, 1)
  const float s = std::ldexp(1.0f, e - 1);
  return s;
}

Fp8Scaling::Fp8Scaling(const Fp8Config& config, int num_layers, const std::vector<int>& moe_layers,
                       int experts)
    : config_member(config),
      layers_member(num_layers),
      moe_layers_member(moe_layers),
      experts_member(moe_layers.empty() ? 0 : experts) {
  config_member.validate(num_layers);
  if (!std::is_sorted(moe_layers.begin(), moe_layers.end()) ||
      (!moe_layers.empty() && (moe_layers.front() < 0 || moe_layers.back() >= num_layers)) ||
      experts < 0)
    throw Error("plm::model::Fp8Scaling: MoE layers or expert count out of range (a bug)");
  history_member.assign(std::size_t(numTensors()) * hist(), 0.0f);
  scale_member.assign(numTensors(), 1.0f);
  scale_inv_member.assign(numTensors(), 1.0f);
}

int Fp8Scaling::expertIndex(int layer, int expert, Fp8Gemm g, Fp8Operand o) const {
  const auto at = std::lower_bound(moe_layers_member.begin(), moe_layers_member.end(), layer);
  if (at == moe_layers_member.end() || *at != layer || expert < 0 || expert >= experts_member ||
      (g != Fp8Gemm::FfnIn && g != Fp8Gemm::FfnOut))
    throw Error("plm::model::Fp8Scaling: no expert slot for layer " + std::to_string(layer) +
                ", expert " + std::to_string(expert) + ", " + fp8GemmName(g) + " (a bug)");
  const int moe = static_cast<int>(at - moe_layers_member.begin());
  const int gemm = (moe * experts_member + expert) * 2 + (g == Fp8Gemm::FfnOut ? 1 : 0);
  return (layers_member * fp8_gemms + gemm) * fp8_operands + static_cast<int>(o);
}

void Fp8Scaling::record(int t, float amax) {
  float& slot = history_member[std::size_t(t) * hist()];
  if (!std::isfinite(amax)) amax = std::numeric_limits<float>::infinity();
  slot = std::max(slot, amax);
}

void Fp8Scaling::endStep(MPI_Comm comm) {
  if (config_member.recipe != Fp8Recipe::Delayed) {
    ++steps_member;
    return;
  }
  const int n = numTensors();
  const std::size_t h = hist();
  std::vector<float> current(n);
  for (int t = 0; t < n; ++t) current[t] = history_member[t * h];
  const int world = comm != MPI_COMM_NULL ? dist::commSize(comm) : 1;
  if (world > 1) dist::allreduceMax(current, comm);  // +inf marks a non-finite amax
  for (int t = 0; t < n; ++t) {
    float* row = history_member.data() + t * h;
    row[0] = current[t];
    const float amax =
        config_member.amax_reduce == AmaxReduce::Max ? *std::max_element(row, row + h) : row[0];
    const float fmax = fp8::maxOf(format(static_cast<Fp8Operand>(t % fp8_operands)));
    scale_member[t] = delayedScale(amax, fmax, config_member.margin, scale_member[t]);
    scale_inv_member[t] = 1.0f / scale_member[t];
    // Transformer Engine's roll: entry i moves to i - 1, the current one to the end, and the
    // next step's amax starts at 0 in entry 0.
    std::rotate(row, row + 1, row + h);
    row[0] = 0.0f;
  }
  ++steps_member;
}

void Fp8Scaling::restore(const std::vector<float>& histories, const std::vector<float>& scales,
                         std::int64_t steps) {
  if (histories.size() != history_member.size() || scales.size() != scale_member.size())
    throw collectiveError(
        "fp8 scaling state: stored sizes (" + std::to_string(histories.size()) +
        " history entries, " + std::to_string(scales.size()) + " scales) do not fit this model (" +
        std::to_string(history_member.size()) + ", " + std::to_string(scale_member.size()) + ")");
  history_member = histories;
  scale_member = scales;
  for (std::size_t t = 0; t < scale_member.size(); ++t)
    scale_inv_member[t] = 1.0f / scale_member[t];
  steps_member = steps;
}

}  // namespace plm::model
