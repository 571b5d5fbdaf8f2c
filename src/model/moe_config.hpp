// The `moe` deck section as the model sees it (doc/model.md "Mixture of Experts"); kept apart
// from moe.hpp so that Esm2Config carries it without the block's dependencies.
#pragma once

#include "core/error.hpp"

#include <string>
#include <vector>

namespace plm::model {

enum class RouterKind { Softmax, Sigmoid };

/// How the routers start (doc/model.md "Router initialisation"): Normal = N(0, 0.02) like every
/// other weight; Centred = that draw with each router's rows then made orthogonal to the mean
/// router input of the first training step (Esm2::centreRouters, called by the trainer once
/// before step 1 of a fresh run), so that the component every token shares at initialisation
/// does not decide the routing.
enum class RouterInit { Normal, Centred };

/// The bias_balance update after each step (moe.bias_update), with load_e expert e's slots over
/// the step and mean their mean: Sign = bias_rate * sign(mean - load_e) (DeepSeek-V3);
/// Proportional = bias_rate * (mean - load_e) / mean.
enum class BiasUpdate { Sign, Proportional };

/// How the experts' GEMMs run under bf16 on the GPU (model/moe_experts.hpp): Auto picks by the
/// measured crossover, Loop = one cuBLASLt call per expert, Grouped = one CUTLASS grouped launch
/// per GEMM.
enum class ExpertGemmMode { Auto, Loop, Grouped };

/// The routed experts' FFN (moe.expert_activation): Gelu = ESM-2's MLP, intermediate.dense
/// (F_e, H) + bias, GELU, output.dense (H, F_e) + bias; Swiglu = the Mixtral / Qwen / AIDO form
/// without biases, y = down(silu(gate x) * up x): gate_proj, up_proj (F_e, H), down_proj (H, F_e).
/// In memory gate_proj and up_proj lie back to back, one (2 F_e, H) matrix (DenseMlpWeights::w1,
/// b1 and b2 empty).  Shared experts stay GELU MLPs.
enum class ExpertActivation { Gelu, Swiglu };

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
  ExpertActivation expert_activation = ExpertActivation::Gelu;
  double bias_rate = 1e-3;
  BiasUpdate bias_update = BiasUpdate::Sign;  // read by the trainer only (not in model files)
  // Most bytes one rank's expert-side buffers of one MoE layer may take under expert
  // parallelism (moe.dispatch_budget_gib); 0 = what the device has free when the layer runs.
  double dispatch_budget_bytes = 0;
  // Under expert parallelism a rank's own rows skip the all-to-all and are computed while the
  // others travel (moe.overlap; measured slower on 2 GPUs, doc/model.md "Expert parallelism").
  bool overlap = false;
  bool host_routing = false;  // moe.routing: host = the host reference routing on the bf16 path
  RouterInit router_init = RouterInit::Centred;  // read by the trainer only (not in model files)
  // After every optimizer step each router is made orthogonal to that step's mean router input
  // (Esm2::projectRouters; trainer only, not in model files).  Training forwards then sum the
  // router input on the device.
  bool router_projection = true;
  int router_projection_means = 1;  // the last steps' means the router is kept orthogonal to

  bool enabled() const { return experts > 0; }
  bool isMoeLayer(int layer) const { return enabled() && (layer + 1) % every == 0; }
  bool swiglu() const { return expert_activation == ExpertActivation::Swiglu; }
  /// Weight matrices of one routed expert (3 SwiGLU, 2 GELU).
  int expertMatrices() const { return swiglu() ? 3 : 2; }
  /// \brief Throws a collective plm::Error naming the `moe.*` key that is wrong.
  void validate(int hidden) const;
};

/// Which routed experts this rank holds in memory (parallel.expert_degree): rank `rank` of an
/// expert group of `degree` ranks holds experts [rank E/degree, (rank + 1) E/degree) of every MoE
/// layer (parameters, gradients, optimizer state); the router, shared experts and dense tensors
/// are held whole on every rank.  The default holds every expert (degree 1).
struct ExpertPlacement {
  int degree = 1;
  int rank = 0;
  int count(int experts) const { return experts / degree; }
  int first(int experts) const { return rank * count(experts); }
  bool holds(int expert, int experts) const {
    return expert >= first(experts) && expert < first(experts) + count(experts);
  }
  bool sharded() const { return degree > 1; }
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

/// \brief "gelu" | "swiglu"; a collective plm::Error otherwise.
inline ExpertActivation parseExpertActivation(const std::string& name) {
  if (name == "gelu") return ExpertActivation::Gelu;
  if (name == "swiglu") return ExpertActivation::Swiglu;
  throw collectiveError("moe.expert_activation: unknown activation '" + name +
                        "'; use gelu or swiglu");
}
inline const char* expertActivationName(ExpertActivation a) {
  return a == ExpertActivation::Swiglu ? "swiglu" : "gelu";
}

/// \brief "sign" | "proportional"; a collective plm::Error otherwise.
inline BiasUpdate parseBiasUpdate(const std::string& name) {
  if (name == "sign") return BiasUpdate::Sign;
  if (name == "proportional") return BiasUpdate::Proportional;
  throw collectiveError("moe.bias_update: unknown rule '" + name + "'; use sign or proportional");
}

/// \brief "centred" | "normal"; a collective plm::Error otherwise.
inline RouterInit parseRouterInit(const std::string& name) {
  if (name == "centred") return RouterInit::Centred;
  if (name == "normal") return RouterInit::Normal;
  throw collectiveError("moe.router_init: unknown initialisation '" + name +
                        "'; use centred or normal");
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

/// One MoE layer's router input over the passes of Esm2::centreRouters (summed over all ranks).
struct RouterCentring {
  int layer = 0;
  double tokens = 0;         // tokens seen
  double mean_share = 0;     // |mean input|^2 / mean |input|^2: the part every token shares
  std::vector<double> mean;  // (H) the mean router input (empty when no token was seen)
};

}  // namespace plm::model
