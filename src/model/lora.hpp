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

#include "core/types.hpp"

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

/// \brief Parses lora.targets ("q,k,v,o", any subset of q,k,v,o,ffn_in,ffn_out; spaces
/// allowed); a bad name throws a collective Error naming it and the accepted names.
unsigned parseLoraTargets(const std::string& text);

/// \brief The names parseLoraTargets accepts, comma-separated, for messages and docs.
std::string loraTargetNames(unsigned targets);

/// \brief Adapter parameters (A and B of every target) of a dense encoder of `layers` layers.
std::int64_t loraAdapterParameters(const LoraConfig& config, int layers, std::int64_t hidden,
                                   std::int64_t ffn);

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

}  // namespace plm::model
