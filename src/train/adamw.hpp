// AdamW (Loshchilov & Hutter) over the model's flat parameter buffer, as torch.optim.AdamW
// computes it: decoupled weight decay p *= 1 - lr*wd, then p -= lr * m_hat / (sqrt(v_hat) + eps)
// with bias-corrected moments.
//
// Design choices:
//  - One kernel over the whole flat buffer; which elements decay and which never move is a
//    per-element flag array built once from TensorInfo::weight_decay (no decay on biases,
//    LayerNorm, embedding) and the frozen ranges (the embedding's padding row, whose gradient
//    is zeroed so it stays exactly 0).
//  - Master weights and both moments are master_t (fp32).  When the model computes in master_t
//    (the CPU build) the master IS the model's parameter buffer (an alias, no copy); otherwise
//    (bf16 compute on the GPU) the optimizer keeps its own fp32 master and writes the compute
//    copy as a cast of it after each step (syncParameters).
//  - Gradient clipping costs no extra pass over the parameters: the global norm is one
//    parallel_reduce in double (after the data-parallel all-reduce), and the clip factor is
//    folded into the step as a gradient scale.
#pragma once

#include "core/types.hpp"
#include "model/esm2.hpp"

#include <cstdint>
#include <vector>

namespace plm::train {

struct AdamWOptions {
  double beta1 = 0.9;
  double beta2 = 0.98;
  double eps = 1e-8;
  double weight_decay = 0.01;
};

/// Elements [offset, offset + size) of the flat buffer that never change.
struct FrozenRange {
  std::int64_t offset = 0;
  std::int64_t size = 0;
};

/// \brief The frozen ranges of an ESM-2 model: the word embedding's `<pad>` row.
std::vector<FrozenRange> esm2FrozenRanges(const std::vector<model::TensorInfo>& tensors,
                                          int hidden);

/// \brief sqrt(sum g^2) over a (local, already reduced) gradient buffer, accumulated in double.
template <class G> double globalNorm(const ExecSpace& space, View1<G> grads);

/// \brief The clipping factor min(1, max_norm / (norm + 1e-6)) (torch.nn.utils.clip_grad_norm_);
/// 1 when max_norm <= 0 (clipping off).
double clipFactor(double norm, double max_norm);

template <class P> class AdamW {
 public:
  /// `params`: the model's flat parameter buffer (compute precision P); `tensors` its table.
  AdamW(View1<P> params, const std::vector<model::TensorInfo>& tensors, const AdamWOptions& options,
        const std::vector<FrozenRange>& frozen = {});

  /// \brief Zeroes the gradient of frozen elements (call before the norm).
  void maskGradients(const ExecSpace& space, View1<P> grads) const;

  /// \brief One update with learning rate `lr`, using `grad_scale * grads` as the gradient
  /// (grad_scale carries the clipping factor).  Increments stepCount() first (bias correction
  /// uses the new count).
  void step(const ExecSpace& space, View1<P> grads, double lr, double grad_scale = 1.0);

  /// \brief Writes the compute parameters as a cast of the master (no-op when they alias).
  void syncParameters(const ExecSpace& space);

  // Optimizer state, for checkpoints: same layout as the model's flat buffer.
  View1<master_t> master() const { return master_member; }
  View1<master_t> expAvg() const { return exp_avg_member; }
  View1<master_t> expAvgSq() const { return exp_avg_sq_member; }
  std::int64_t stepCount() const { return step_member; }
  void setStepCount(std::int64_t step) { step_member = step; }
  const AdamWOptions& options() const { return options_member; }
  bool mastersAlias() const { return aliased_member; }

  // Per-element flags.
  static constexpr std::uint8_t decay_flag = 1;
  static constexpr std::uint8_t frozen_flag = 2;
  View1<std::uint8_t> flags() const { return flags_member; }

 private:
  AdamWOptions options_member;
  View1<P> params_member;          // (N) compute parameters (the model's buffer)
  View1<master_t> master_member;   // (N) fp32 master weights (alias of params when P == master_t)
  View1<master_t> exp_avg_member;  // (N) first moment m
  View1<master_t> exp_avg_sq_member;  // (N) second moment v
  View1<std::uint8_t> flags_member;   // (N) decay_flag | frozen_flag
  std::int64_t step_member = 0;
  bool aliased_member = false;
};

}  // namespace plm::train
