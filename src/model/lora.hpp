// LoRA adapters (Hu et al. 2021, with PEFT's conventions) for the encoder's linear layers: a
// target y = x W^T + b becomes y = x W^T + b + s (x A^T) B^T with s = alpha / r, A (r, in) and
// B (out, r).  A starts kaiming-uniform (a = sqrt(5), PEFT's default: U(-1/sqrt(in), 1/sqrt(in)))
// and B at zero, so at step 0 the adapted model is the base model exactly.
//
// Accumulation rule: y and dx are added to (+=, the base linear has written them); dA and dB
// accumulate (+=) like every parameter gradient; `tmp` and `dtmp` are scratch (written).
// The rank-r products go through the gemm dispatch point (gemm.hpp), so they run on every
// backend; merging (W += s B A) is what `plm convert --to-hf` does to export a plain model.
#pragma once

#include "core/error.hpp"
#include "core/types.hpp"
#include "model/math.hpp"
#include "model/ops.hpp"

#include <array>
#include <cstdint>
#include <string>

namespace plm::model {

/// The linear layers of an encoder layer an adapter may target (a bit each).
enum LoraTarget : unsigned {
  lora_q = 1u << 0,
  lora_k = 1u << 1,
  lora_v = 1u << 2,
  lora_o = 1u << 3,
  lora_ffn_in = 1u << 4,
  lora_ffn_out = 1u << 5,
};

/// The deck's `lora` section.
struct LoraConfig {
  int rank = 0;        // 0 = no adapters
  double alpha = 8.0;  // scale = alpha / rank
  unsigned targets = lora_q | lora_k | lora_v | lora_o;
  double dropout = 0.0;  // on the adapter input; only 0 is implemented
  bool enabled() const { return rank > 0; }
  double scale() const { return rank > 0 ? alpha / rank : 0.0; }
  bool has(LoraTarget t) const { return (targets & t) != 0; }
};

namespace detail {

struct LoraTargetName {
  const char* name;
  LoraTarget bit;
};

inline constexpr LoraTargetName lora_target_names[] = {
    {"q", lora_q}, {"k", lora_k},           {"v", lora_v},
    {"o", lora_o}, {"ffn_in", lora_ffn_in}, {"ffn_out", lora_ffn_out}};

}  // namespace detail

/// \brief The names parseLoraTargets accepts, comma-separated, for messages and docs.
inline std::string loraTargetNames(unsigned targets) {
  std::string out;
  for (const auto& t : detail::lora_target_names)
    if (targets & t.bit) out += (out.empty() ? "" : ",") + std::string(t.name);
  return out;
}

/// \brief Parses lora.targets ("q,k,v,o", any subset of q,k,v,o,ffn_in,ffn_out; spaces
/// allowed); a bad name throws a collective Error naming it and the accepted names.  Inline:
/// plm_io reads and writes targets in model files without linking the model library.
inline unsigned parseLoraTargets(const std::string& text) {
  unsigned targets = 0;
  std::string item;
  auto flush = [&] {
    if (item.empty()) return;
    bool found = false;
    for (const auto& t : detail::lora_target_names)
      if (item == t.name) {
        targets |= t.bit;
        found = true;
      }
    if (!found)
      throw collectiveError("lora.targets: unknown target '" + item + "' in '" + text +
                            "'; use a comma-separated subset of " + loraTargetNames(~0u));
    item.clear();
  };
  for (char ch : text) {
    if (ch == ',')
      flush();
    else if (ch != ' ' && ch != '\t')
      item += ch;
  }
  flush();
  if (targets == 0)
    throw collectiveError("lora.targets: empty; name at least one of " + loraTargetNames(~0u));
  return targets;
}

/// \brief Adapter parameters (A and B of every target) of a dense encoder of `layers` layers.
std::int64_t loraAdapterParameters(const LoraConfig& config, int layers, std::int64_t hidden,
                                   std::int64_t ffn);

/// \brief Element `index` of an adapter A drawn from (seed, stream): U(-bound, bound) with
/// bound = 1/sqrt(in), counter-based, so any shard of A draws the values the whole tensor has.
KOKKOS_INLINE_FUNCTION double loraUniform(std::uint64_t seed, std::uint64_t stream,
                                          std::int64_t index, double bound) {
  const std::uint64_t base = math::hash64(seed ^ math::hash64(stream + 0x4C6F5241ull));
  const double u =
      static_cast<double>(math::hash64(base + static_cast<std::uint64_t>(index)) >> 11) *
      (1.0 / 9007199254740992.0);  // [0, 1)
  return (2.0 * u - 1.0) * bound;
}

/// \brief A (r, in) ~ U(-1/sqrt(in), 1/sqrt(in)) from a counter-based stream (seed, stream):
/// the same values on every rank and backend.
template <class T>
void loraInitA(const ExecSpace& space, const View2<T>& a, std::uint64_t seed, std::uint64_t stream);

/// \brief y += s (x A^T) B^T.  x (R, in), a (r, in), b (out, r), tmp (R, r) scratch, y (R, out).
template <class T> void loraForward(const ExecSpace& space, const View2<T>& x, const View2<T>& a,
                                    const View2<T>& b, T s, const View2<T>& tmp, const View2<T>& y);

/// \brief Backward of loraForward given dy: dB += s dy^T tmp (tmp = x A^T, recomputed when
/// `recompute_tmp`), dA += s (dy B)^T x, dx += s (dy B) A (skipped if dx is empty).
/// dtmp (R, r) is scratch.
template <class T> void loraBackward(const ExecSpace& space, const View2<T>& x, const View2<T>& a,
                                     const View2<T>& b, T s, const View2<T>& tmp,
                                     bool recompute_tmp, const View2<T>& dy, const View2<T>& dtmp,
                                     const View2<T>& dx, const View2<T>& da, const View2<T>& db);

/// \brief w += s B A: folds the adapter into the base weight (w (out, in)).
template <class T> void loraMerge(const ExecSpace& space, const View2<T>& w, const View2<T>& a,
                                  const View2<T>& b, T s);

/// One adapter of a model's linear layer on the dispatch points: A (r, in) and B (out, r) in
/// compute precision (the bf16 copy under bf16), their gradients in the master type.
struct LoraAdapter {
  Mat a, b;    // (r, in), (out, r)
  Mat ga, gb;  // (r, in), (out, r)
  bool active() const { return !a.empty(); }
};

/// The adapters of one encoder layer (an inactive one: no adapter on that linear layer).
struct LayerLora {
  double scale = 0.0;  // alpha / r
  LoraAdapter q, k, v, o, ffn_in, ffn_out;
  std::array<LoraAdapter*, 6> adapters() { return {&q, &k, &v, &o, &ffn_in, &ffn_out}; }
};

/// \brief y += s (x A^T) B^T (y = ... when !accumulate) on the dispatch points (x, y compute
/// precision, or y the master residual stream); the (R, r) product lives in context scratch.
void loraForward(OpContext& ctx, const LoraAdapter& ad, double s, const Mat& x, const Mat& y,
                 bool accumulate = true);
/// \brief Its backward given dy: gb += s dy^T (x A^T), ga += s (dy B)^T x, and
/// dx += s (dy B) A (skipped if dx is empty).
void loraBackward(OpContext& ctx, const LoraAdapter& ad, double s, const Mat& x, const Mat& dy,
                  const Mat& dx);

}  // namespace plm::model
