// The planner behind `plm plan`: bytes per rank, FLOPs per token and predicted step time of a
// training run, before it is launched (doc/plan.md gives every formula this file computes).
//
// Design choice: the activation bytes are counted tensor by tensor in the order and with the
// 256-byte rounding of the model's own workspace carver (src/model/esm2.cpp, `carve`), so the
// prediction of the largest term is exact for the portable and bf16 paths; everything else is
// a closed formula of the configuration and the per-device rates (rates.hpp).
#pragma once

#include "model/esm2.hpp"
#include "plan/rates.hpp"
#include "train/optim/optimizer.hpp"

#include <Teuchos_ParameterList.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace plm::plan {

/// fp8: bf16 storage plus the FP8 layers' weight codes (and kept X^T codes); their GEMMs at the
/// rates table's FP8 rates, their operand casts timed as a row of their own.
enum class Compute { Fp32, Bf16, Fp8 };
Compute parseCompute(const std::string& name);  // "fp32" | "bf16" | "fp8"; collective error
const char* computeName(Compute c);

/// How the ranks are laid out. world = ranks_per_node * nodes = shard * replicate * context
/// (replicate is what is left); expert applies to mixture-of-experts models only: the routed
/// experts of every MoE layer are split over `expert` consecutive ranks, while the dense part
/// follows shard and replicate (HSDP across nodes: shard within a node, replicate across).
struct Layout {
  int ranks_per_node = 1;
  int nodes = 1;
  int shard = 1;    // parameters, gradients and optimizer states split over this many ranks
  int context = 1;  // a micro-batch's tokens split over this many ranks
  int expert = 1;   // experts split over this many ranks (dense ESM-2: must be 1)
  int world() const { return ranks_per_node * nodes; }
  int dataParallel() const { return world() / context; }  // ranks that see different tokens
  int replicate() const { return world() / (shard * context); }
};

/// \brief The deck's `parallel` degrees (shard_degree, 0 = a node's ranks; replicate_degree;
/// context_degree; expert_degree) over `ranks_per_node` x `nodes` ranks.  Throws a collective
/// plm::Error naming the key when they do not divide the ranks.
Layout layoutFromDeck(const Teuchos::ParameterList& deck, int ranks_per_node, int nodes);

/// \brief The fewest ranks on one node the deck's `parallel` degrees need: the least common
/// multiple of shard x context and expert (1 for a plain deck; shard_degree 0 counts as 1).
int ranksForDeck(const Teuchos::ParameterList& deck);

struct Input {
  model::Esm2Config model;
  Compute compute = Compute::Fp32;
  std::int64_t micro_batch_tokens = 8192;  // data.micro_batch_tokens
  std::int64_t micro_batches = 1;          // per rank and optimizer step (accumulation)
  double mean_seqlen = 460;                // token-weighted mean sequence length S (doc/flops.md)
  double mask_prob = 0.15;                 // labelled fraction: rows the LM head runs on
  double fill = 0.97;  // real tokens per micro-batch / micro_batch_tokens (packing)
  Layout layout;
  bool reshard_after_forward = true;  // parallel.reshard_after_forward (sharding: gathered layers)
  bool gather_bf16 = false;           // parallel.gather_dtype resolved (sharding: bf16 gathers)
  Rates rates;
  train::OptimizerOptions optimizer;  // optimizer.name and its settings: the state's bytes
  // MoE under expert parallelism: the rows the fullest rank's experts compute per layer, as a
  // multiple of the balanced share (tokens x top_k).  0 = the default: the capacity bound
  // (moe.dropless: false), or 2 (dropless); never more than the expert degree (all rows on one
  // rank).  plm train's first-step report plans at the load it measured.
  double moe_load = 0;
};

/// One line of the memory or time table, with the formula it comes from (doc/plan.md).
struct Item {
  std::string name;
  double value = 0;  // bytes or seconds
  std::string formula;
  bool allocated = true;  // memory: a Kokkos allocation (what train::AllocationTracker measures)
};

/// Activation workspace of one micro-batch, by layer part, exactly as the model carves it.
struct Activations {
  std::int64_t residual = 0;   // layer inputs x_0..x_L and the token multipliers
  std::int64_t attention = 0;  // ln1, q/k/v, attention output, log-sum-exp, their statistics
  std::int64_t mlp = 0;        // x_mid, ln2, FFN pre-activation and GELU, their statistics
  std::int64_t head = 0;       // final LayerNorm, LM head rows, logits
  std::int64_t backward = 0;   // gradient scratch of one layer and the LM head
  std::int64_t total() const { return residual + attention + mlp + head + backward; }
};

/// \brief The model's workspace arena for `tokens` tokens of which `rows` run through the LM
/// head, forward + backward (`backward`) or forward only; mirrors Esm2::Impl::carve.
Activations activationBytes(const model::Esm2Config& config, Compute compute, std::int64_t tokens,
                            std::int64_t rows, bool backward);

/// Elements of one rank's flat parameter buffer, counted over the model's own tensor table
/// (model::tensorTable, holding the routed experts of one rank of an expert group), and of its
/// bf16 compute copy (the packed GEMM weights, laid out as Esm2's bind()).
struct ParameterCounts {
  std::int64_t flat = 0;             // the rank's whole buffer (every tensor rounded up to 16)
  std::int64_t experts = 0;          // of which the routed experts it holds
  std::int64_t embed = 0, head = 0;  // the embeddings; final LayerNorm and LM head
  std::int64_t layer_max = 0;        // the widest encoder layer (a sharding unit)
  std::int64_t compute = 0;          // bf16 compute copy, whole
  std::int64_t compute_experts = 0;  // of which the routed experts'
  std::int64_t compute_embed = 0, compute_head = 0, compute_layer_max = 0;
  std::int64_t dense() const { return flat - experts; }
};
/// \brief Counts of a rank of an expert group of `expert_degree` ranks; `fp8_gpu`: the FP8
/// layers' bf16 biases join the compute copy (train.precision: fp8 on the CUDA build).
ParameterCounts parameterCounts(const model::Esm2Config& config, int expert_degree = 1,
                                bool fp8_gpu = false);

/// The buffers every MoE layer keeps for itself (src/model/moe.cpp, MoeMlp::State: grow-only,
/// one set per layer whatever model.recompute), in bytes over all MoE layers of one rank.
struct MoeBuffers {
  int layers = 0;                // MoE layers
  std::int64_t rows = 0;         // permuted rows a rank routes per layer (kept slots)
  std::int64_t expert_rows = 0;  // rows its experts compute per layer (expert parallelism: the
                                 // rows received from the group)
  double load = 1;               // expert_rows / (tokens x top_k)
  std::int64_t routing = 0;      // router logits and their gradient, gates, row maps
  std::int64_t token_side = 0;   // permuted rows, expert outputs and their gradients
  std::int64_t expert_side = 0;  // FFN pre-activation, GELU and its gradient (+ exchange rows)
  std::int64_t shared = 0;       // shared experts' pre-activation, GELU and its gradient
  std::int64_t total() const { return routing + token_side + expert_side + shared; }
};
/// \brief The MoE buffers of a rank for `tokens` tokens per micro-batch at `load` (the rows its
/// experts compute over tokens x top_k; 1 = balanced; capped at the expert degree and at the
/// capacity bound).  `gpu`: the CUDA build's paths (device routing, bf16 rows under bf16).
MoeBuffers moeBufferBytes(const model::Esm2Config& config, Compute compute, bool gpu,
                          std::int64_t tokens, int expert_degree, double load);

/// \brief Elements of the model's flat parameter buffer (every tensor rounded up to 16).
std::int64_t flatParameterCount(const model::Esm2Config& config);
/// \brief Elements of one encoder layer's tensors in that buffer.
std::int64_t layerParameterCount(const model::Esm2Config& config);
/// \brief Elements of the bf16 compute copy of the GEMM weights (embedding, q/k/v, output,
/// FFN, LM-head dense and their biases where the kernels read them in bf16).
std::int64_t computeCopyCount(const model::Esm2Config& config);

struct Plan {
  std::vector<Item> memory;  // bytes per rank
  double memory_total = 0;
  double memory_allocated = 0;  // the items that are Kokkos allocations (no NCCL, no runtime)
  double memory_available = 0;
  bool fits = false;
  double model_flops_per_token = 0;     // doc/flops.md
  double hardware_flops_per_token = 0;  // + recomputation
  std::vector<Item> time;               // seconds per optimizer step, by kind
  double step_seconds = 0;
  double tokens_per_step = 0;       // global, real tokens
  double tokens_per_s = 0;          // global
  double mfu = 0, hfu = 0;          // against rates.peak_tflops per rank
  std::vector<std::string> notes;   // assumptions worth reading
  std::vector<std::string> advice;  // what to change when it does not fit
  // MoE: the load the expert buffers and the all-to-all were planned at, and where it came from.
  double moe_load = 0;
  std::string moe_load_source;
};

/// Exit status of `plm plan` when the run does not fit (doc/plan.md); 0 when it fits.
constexpr int exit_does_not_fit = 3;

/// \brief The plan of `in`; throws a collective plm::Error on an impossible layout (the world
/// size not a multiple of shard * context, expert > 1 on a dense model, ...).
Plan makePlan(const Input& in);

/// \brief The planner input of a resolved deck (model, train.precision, data.*), laid out over
/// `ranks_per_node` x `nodes` ranks with the `rates` of the device.
Input inputFromDeck(const Teuchos::ParameterList& deck, const Layout& layout, const Rates& rates);

/// \brief Human-readable tables (memory, FLOPs, time, advice).
std::string formatPlan(const Input& in, const Plan& plan);
io::json::Value planToJson(const Input& in, const Plan& plan);

/// \brief "1.23 GiB" / "456 MiB".
std::string bytesText(double bytes);

}  // namespace plm::plan
