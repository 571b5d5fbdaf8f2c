// The `moe` deck section as the model sees it (doc/model.md "Mixture of Experts"); kept apart
// from moe.hpp so that Esm2Config carries it without the block's dependencies.
#pragma once

#include "core/error.hpp"

#include <string>
#include <vector>

namespace plm::model {

enum class RouterKind { Softmax, Sigmoid };

/// How the experts' GEMMs run under bf16 on the GPU (model/moe_experts.hpp): Auto picks by the
/// measured crossover, Loop = one cuBLASLt call per expert, Grouped = one CUTLASS grouped launch
/// per GEMM.  The environment variable PLM_MOE_GEMM overrides it (benchmarks).
enum class ExpertGemmMode { Auto, Loop, Grouped };

/// The `moe` deck section.  experts == 0: a dense model (no MoE layer at all).
struct MoeConfig {
  int experts = 0;
  int top_k = 2;
  int every = 1;       // layer l is MoE when (l + 1) % every == 0
  int expert_ffn = 0;  // width of each expert's FFN
  int shared_experts = 0;
  RouterKind router = RouterKind::Softmax;
  bool normalize_topk = true;
  double capacity_factor = 0;  // 0 = dropless; else capacity = ceil(cf * T * top_k / experts)
  double aux_loss = 0;         // Switch/GShard load-balancing loss coefficient
  double seq_aux_loss = 0;     // per-sequence load-balancing loss coefficient (DeepSeek-V3)
  double z_loss = 0;           // router z-loss coefficient
  bool bias_balance = false;   // aux-loss-free expert bias (DeepSeek-V3)
  ExpertGemmMode expert_gemm = ExpertGemmMode::Auto;
  double bias_rate = 1e-3;

  bool enabled() const { return experts > 0; }
  bool isMoeLayer(int layer) const { return enabled() && (layer + 1) % every == 0; }
  /// \brief Throws a collective plm::Error naming the `moe.*` key that is wrong.
  void validate(int hidden) const;
};

/// \brief "softmax" | "sigmoid"; a collective plm::Error otherwise.  Inline: io reads it too.
inline RouterKind parseRouter(const std::string& name) {
  if (name == "softmax") return RouterKind::Softmax;
  if (name == "sigmoid") return RouterKind::Sigmoid;
  throw collectiveError("moe.router: unknown router '" + name + "'; use softmax or sigmoid");
}
/// \brief "auto" | "loop" | "grouped"; a collective plm::Error otherwise.
inline ExpertGemmMode parseExpertGemm(const std::string& name) {
  if (name == "auto") return ExpertGemmMode::Auto;
  if (name == "loop") return ExpertGemmMode::Loop;
  if (name == "grouped") return ExpertGemmMode::Grouped;
  throw collectiveError("moe.expert_gemm: unknown mode '" + name + "'; use auto, loop or grouped");
}

inline const char* routerName(RouterKind r) {
  return r == RouterKind::Softmax ? "softmax" : "sigmoid";
}

/// Per-layer statistics, summed over the micro-batches since the last reset.
struct MoeLayerStats {
  int layer = 0;
  std::vector<double> routed;  // (E) slots routed to each expert (before the capacity cut)
  double slots = 0, dropped = 0;
  double aux = 0, z = 0, entropy = 0;  // token-weighted sums
  double tokens = 0;
};

}  // namespace plm::model
