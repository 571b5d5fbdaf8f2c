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
  std::int64_t rows() const { return static_cast<std::int64_t>(row_token.size()); }
};

/// \brief Routes T tokens given their router logits (T, E, row-major) and the expert bias
/// (E, selection only; nullptr = none).
Routing route(const double* logits, int tokens, const MoeConfig& c, const double* bias);

/// \brief dlogits (T, E) = d/dlogits of [sum over kept slots of dgate * gate + aux_scale * aux
/// + z_scale * z] + (the probability gradient dprob (T, E), when given, through the softmax or
/// sigmoid), dgate (T k) given per slot (dropped slots ignored).
void routeBackward(const Routing& r, const MoeConfig& c, const double* logits, const double* dgate,
                   double aux_scale, double z_scale, double* dlogits,
                   const double* dprob = nullptr);

/// \brief The sequence-level balancing loss: the mean over the n sequences (offsets cu, n + 1)
/// of E * sum_e f_{e,s} P_{e,s}, f and P taken within sequence s.  With dprob (T, E), adds
/// scale * d(loss)/d(prob) there.
double sequenceAux(const Routing& r, const int* cu, int n, double scale, double* dprob);

/// Parameters of one MoE layer (weights in compute precision, gradients in the master type).
struct MoeWeights {
  Mat router;                            // (E, H), no bias
  Vec expert_bias;                       // (E) selection bias (bias_balance), else empty
  std::vector<DenseMlpWeights> experts;  // E x {(F_e, H), (F_e), (H, F_e), (H)}
  DenseMlpWeights shared;                // (S F_e, H) ...; empty without shared experts
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
  const MoeLayerStats& stats() const;
  void resetStats();
  /// \brief Adds rate * sign(mean - routed_e) to the expert bias, routed_e given over the
  /// whole step (all ranks).  Nothing without bias_balance.
  void balanceBias(OpContext& ctx, const std::vector<double>& routed);
  /// \brief The router input sums of the MoeStep::centring passes since the last call (then
  /// cleared).  In such a pass the layer routes with its router centred (centreRows) on that
  /// pass's own mean input, so that the layers after it see about the routing the centred router
  /// will give; the stored router is unchanged until centreRouter.
  RouterInputSums takeRouterInputSums();
  /// \brief Centres the stored router on `mean` (H), the mean router input (centreRows).
  void centreRouter(OpContext& ctx, const std::vector<double>& mean);

  struct State;  // workspace and the routing kept from forward for backward

 private:
  std::unique_ptr<State> state_member;
};

}  // namespace plm::model
