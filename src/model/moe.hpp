// Mixture-of-Experts FFN block (the `moe` deck section; doc/model.md "Mixture of Experts").
//
// Design: an MoE layer replaces DenseMlp in the FFN slot of EncoderLayer.  One step is
//   router GEMM -> probabilities (softmax | sigmoid) -> top-k (expert bias for selection only)
//   -> capacity cut in token order -> stable permutation by expert -> expert FFNs (a loop over
//   experts, each through the ops.hpp dispatch points) -> unpermute weighted by the gates
//   -> + shared experts (one dense MLP of width shared_experts * expert_ffn) -> + residual.
// A token whose every slot was dropped passes through the residual (and shared experts) only.
// The routing bookkeeping (top-k, capacity, permutation, the gate and router-loss gradients) is
// plain host code in double (route / routeBackward): it is O(tokens * experts), the reference
// for any fused kernel, and deterministic.  Tensors move with the gather/combine kernels of
// moe.cpp.
// Expert parallelism: with an expert communicator of E_p ranks, rank r of it computes experts
// [r E/E_p, (r+1) E/E_p); routed rows travel there and back with all-to-all-v (counts first),
// in the compute precision (bf16 rows on the bf16 path; MPI, NCCL or staged MPI).  With
// moe.overlap: true a rank's own rows skip the exchange and run while the others' travel
// (off by default: it did not pay on 2 GPUs; doc/model.md "Expert parallelism").
// Precision: the experts' GEMMs follow their weight handles (fp32, bf16, or FP8 when a handle
// carries an FP8 slot: one per expert and projection, doc/fp8.md "Experts"); the router stays in
// the master type.
// A model built with an ExpertPlacement holds only its experts (the others' entries of
// MoeWeights::experts stay empty, rows 0): its expert group must be the one it was built for.
// A model holding every expert may still join an expert group (tests): it computes its group
// position's experts, and the others' gradients stay zero.  Tensors are stored by name, so a
// checkpoint resumes at any degree.
//
// Context parallelism (MoeStep::context): routing is per token, so a shard routes its own
// tokens; what depends on the whole micro-batch is reduced over the context group with one sum
// per layer and pass: the routed counts and probability sums (aux loss), the lse^2 sum (z
// loss), the per-sequence loads (sequence aux loss), and for a capacity cut the routed counts of
// every piece of the micro-batch, so each shard cuts its slots where one rank would.  The losses
// and their gradients are then one rank's; each shard adds its token share of the objective.
//
// Accumulation rule: as DenseMlp (parameter gradients +=, activations =); the router losses
// add loss_weight * (aux_loss * aux + z_loss * z) to the objective (see MoeStep).
#pragma once

#include "dist/communicator.hpp"
#include "model/encoder_layer.hpp"
#include "model/moe_config.hpp"

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace plm::model {

/// The routing of one micro-batch through one MoE layer (host, double).  Slot s = t*top_k + j
/// is token t's j-th choice (descending selection score, ties to the lower expert).
struct Routing {
  int tokens = 0, experts = 0, top_k = 0;
  std::vector<double> prob;          // (T, E) router probabilities (softmax or sigmoid)
  std::vector<double> lse;           // (T) log-sum-exp of the logits (z-loss)
  std::vector<int> expert;           // (T k) chosen expert of each slot
  std::vector<double> gate;          // (T k) gate weight (normalised over the top-k if asked)
  std::vector<int> row;              // (T k) row in the permuted buffer, -1 when dropped
  std::vector<int> row_token;        // (rows) token of each permuted row
  std::vector<double> row_gate;      // (rows) gate of each permuted row
  std::vector<std::int64_t> routed;  // (E) slots routed to each expert before the capacity cut
  std::vector<std::int64_t> kept;    // (E) rows of each expert after it (the permuted blocks)
  std::int64_t capacity = 0;         // per expert; 0 = dropless
  std::int64_t dropped = 0;          // slots dropped by the capacity cut
  double aux = 0;                    // E * sum_e f_e P_e, f_e = routed_e / (T k), P_e = mean prob
  double z = 0;                      // mean_t lse_t^2
  double entropy = 0;                // mean over tokens of the router distribution's entropy
  // What the aux and z losses average over: these tokens, or under context parallelism the
  // whole micro-batch (every shard of the context group); aux and z are taken over them.
  std::int64_t total_tokens = 0;
  std::vector<std::int64_t> total_routed;  // (E) routed over those tokens
  std::int64_t rows() const { return static_cast<std::int64_t>(row_token.size()); }
};

/// \brief Routes T tokens given their router logits (T, E, row-major) and the expert bias
/// (E, selection only; nullptr = none): selectExperts, then cutCapacity at this pass's capacity.
Routing route(const double* logits, int tokens, const MoeConfig& c, const double* bias);

/// \brief route's first half: probabilities, top-k, gates, counts, and the losses over these
/// tokens (total_* = this pass's); no slot is placed yet (row, kept, row_token empty).
Routing selectExperts(const double* logits, int tokens, const MoeConfig& c, const double* bias);

/// Where the capacity cut of a shard's slots starts counting: from local token `token` on, the
/// micro-batch's earlier slots (in its token order) routed to each expert (E).
struct CutStart {
  std::int64_t token = 0;
  std::vector<std::int64_t> before;
};

/// \brief route's second half: a slot is kept while fewer than `capacity` earlier slots of the
/// micro-batch (0 = dropless) chose its expert, counting in token order from the given starts
/// (none: from zero at token 0); then the stable permutation (expert-major, token order within).
void cutCapacity(Routing& r, std::int64_t capacity, const std::vector<CutStart>& starts = {});

/// \brief Capacity per expert of a micro-batch of `tokens` tokens (0 = dropless).
std::int64_t expertCapacity(const MoeConfig& c, std::int64_t tokens);

/// \brief dlogits (T, E) = d/dlogits of [sum over kept slots of dgate * gate + aux_scale * aux
/// + z_scale * z] + (the probability gradient dprob (T, E), when given, through the softmax or
/// sigmoid), dgate (T k) given per slot (dropped slots ignored).
void routeBackward(const Routing& r, const MoeConfig& c, const double* logits, const double* dgate,
                   double aux_scale, double z_scale, double* dlogits,
                   const double* dprob = nullptr);

/// \brief The sequence-level balancing loss: the mean over the n sequences (offsets cu, n + 1)
/// of E * sum_e f_{e,s} P_{e,s}, f and P taken within sequence s.  With dprob (T, E), adds
/// scale * d(loss)/d(prob) there.  `load` (n, 2E + 1), when given, holds each whole sequence's
/// routed slots (E), probability sums (E) and length (sequenceLoad summed over the shards of a
/// context group); else they are taken from these tokens.
double sequenceAux(const Routing& r, const int* cu, int n, double scale, double* dprob,
                   const double* load = nullptr);
/// \brief Per sequence of these tokens: routed slots (E), probability sums (E), length.
std::vector<double> sequenceLoad(const Routing& r, const int* cu, int n);

/// Parameters of one MoE layer (weights in compute precision, gradients in the master type).
struct MoeWeights {
  Mat router;                            // (E, H), no bias
  Vec expert_bias;                       // (E) selection bias (bias_balance), else empty
  std::vector<DenseMlpWeights> experts;  // E x {(F_e, H), (F_e), (H, F_e), (H)}
  DenseMlpWeights shared;                // (S F_e, H) ...; empty without shared experts
};

/// A pass over a context-parallel shard (model/context_parallel.hpp): the router statistics,
/// losses and capacities are the whole micro-batch's, reduced over the context group.  The
/// micro-batch is `segments` pieces in its token order; this rank holds the listed runs.
struct MoeContext {
  dist::Communicator* comm = nullptr;  // the context group (not owned)
  struct Run {
    int segment = 0;                  // which piece of the micro-batch
    std::int64_t begin = 0, end = 0;  // its tokens in this shard, [begin, end)
  };
  std::vector<Run> runs;  // in this shard's token order
  int segments = 0;
};

/// Set by the model before each pass; read by every MoE layer.
struct MoeStep {
  double loss_weight = 0;    // the router losses enter the objective as loss_weight * (...)
  double grad_scale = 0;     // the pass's gradient scale (0 in a forward-only pass)
  double objective = 0;      // sum over layers of loss_weight * (aux_loss aux + z_loss z), +=
  bool training = false;     // a forward that a backward follows: statistics are recorded
  bool recomputing = false;  // a rerun forward (Recompute::Layer): adds nothing
  bool centring = false;     // a forward of Esm2::centreRouters (router input sums; see MoeMlp)
  const std::vector<int>* cu_seqlens = nullptr;  // host sequence offsets of the pass (seq aux)
  const MoeContext* context = nullptr;           // a context shard's pass, else nullptr
};

/// The router input of one MoE layer summed over the tokens of the passes run with
/// MoeStep::centring.
struct RouterInputSums {
  std::vector<double> sum;  // (H) sum over tokens of the router input
  double tokens = 0;
  double power = 0;  // sum over tokens of |input|^2
};

/// \brief W <- W - (W m) m^T / |m|^2 for the router W (E, H, row-major) and a mean input m (H):
/// each row made orthogonal to m, so the logits no longer depend on a token's component along
/// m.  Nothing when m = 0.  Host, double arithmetic.
template <class T> void centreRows(std::vector<T>& w, int experts, const std::vector<double>& m);

/// \brief The bias_balance increment of one layer's selection bias (E) from the slots routed to
/// each expert over a step, summed over all ranks: bias_rate toward the mean load (sign or
/// proportional, MoeConfig::bias_update).  What MoeMlp::balanceBias adds; a caller holding the
/// bias elsewhere (FSDP's master shards) adds the same numbers.
std::vector<double> biasBalanceStep(const MoeConfig& c, const std::vector<double>& routed);

/// The expert-parallel group of an MoE layer (not owned; nullptr = every expert local).
struct ExpertParallel {
  dist::Communicator* comm = nullptr;
};

/// \brief An MoE FFN block on the portable path (fp32 / fp64).  T is the master type.
template <class T> class MoeMlp : public FfnBlock {
 public:
  MoeMlp(int layer, const MoeConfig& config, int hidden, const MoeWeights& weights,
         const MoeWeights& grads, MoeStep* step);
  ~MoeMlp() override;
  void forward(OpContext& ctx, const Mat& h, const Mat& residual, const Mat& out,
               LayerActs& saved) const override;
  void backward(OpContext& ctx, const LayerActs& saved, const Mat& dout_c, const Mat& dh,
                LayerScratch& scratch) const override;
  void relocate(const Relocation& r) override;

  void setExpertParallel(const ExpertParallel& ep);
  /// \brief The statistics so far (a pending routing summary taken first: settle).
  const MoeLayerStats& stats() const;
  void resetStats();
  /// \brief Takes the routing summary a forward left on its way (a dropless device routing on
  /// one rank runs its experts from the device counts and does not wait for it), adding its
  /// router losses to the pass's objective and its statistics.  The backward, the next forward
  /// and stats() call it; Esm2 also before it reads the objective or starts a pass.
  void settle() const;
  /// \brief Adds rate * sign(mean - routed_e) (MoeConfig::bias_update Sign) or
  /// rate * (mean - routed_e) / mean (Proportional) to the expert bias, routed_e given over the
  /// whole step (all ranks).  Nothing without bias_balance.
  void balanceBias(OpContext& ctx, const std::vector<double>& routed);
  /// \brief The router input sums of the MoeStep::centring passes since the last call (then
  /// cleared).  In such a pass the layer routes with its router centred (centreRows) on that
  /// pass's own mean input, so that the layers after it see about the routing the centred router
  /// will give; the stored router is unchanged until centreRouter.
  RouterInputSums takeRouterInputSums();
  /// \brief Centres the stored router on `mean` (H), the mean router input (centreRows).
  void centreRouter(OpContext& ctx, const std::vector<double>& mean);
  /// \brief Starts copying the router input summed over the training forwards since the last
  /// call (MoeConfig::router_projection; fp32 on the device, reruns not counted) into `host` (H),
  /// then clears the sum.  `host` is valid after the next fence of ctx's space.
  void takeStepInputSum(OpContext& ctx, double* host);
  /// \brief W <- W - (W Q) Q^T on the device for the stored router W and `basis` Q, k
  /// orthonormal vectors of H one after another (host, kept alive until the next fence of ctx's
  /// space): the rows made orthogonal to span(Q).
  void projectRouter(OpContext& ctx, const std::vector<double>& basis);

  struct State;  // workspace and the routing kept from forward for backward

 private:
  std::unique_ptr<State> state_member;
};

}  // namespace plm::model
