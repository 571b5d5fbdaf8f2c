// AdamW (Loshchilov & Hutter) over the model's flat parameter buffer, as torch.optim.AdamW
// computes it: decoupled weight decay p *= 1 - lr*wd, then p -= lr * m_hat / (sqrt(v_hat) + eps)
// with bias-corrected moments.  One of the optimizers behind train::Optimizer
// (train/optim/optimizer.hpp, doc/optimizers.md).
//
// Design choices:
//  - One kernel over the whole flat buffer; which elements decay and which never move is the
//    per-element flag array of the Optimizer base (no decay on biases, LayerNorm, embedding; the
//    embedding's padding row, whose gradient is zeroed, stays exactly 0).
//  - Master weights and both moments are master_t (fp32), laid out like the parameter buffer.
//  - Gradient clipping costs no extra pass over the parameters: the global norm is one
//    parallel_reduce in double (after the data-parallel all-reduce), and the clip factor is
//    folded into the step as a gradient scale.
#pragma once

#include "core/types.hpp"
#include "model/esm2.hpp"
#include "train/optim/optimizer.hpp"

#include <cstdint>
#include <vector>

namespace plm::train {

/// \brief sqrt(sum g^2) over a (local, already reduced) gradient buffer, accumulated in double.
template <class G> double globalNorm(const ExecSpace& space, View1<G> grads);

/// \brief The clipping factor min(1, max_norm / (norm + 1e-6)) (torch.nn.utils.clip_grad_norm_);
/// 1 when max_norm <= 0 (clipping off).
double clipFactor(double norm, double max_norm);

template <class P> class AdamW : public Optimizer<P> {
 public:
  /// `params`: the model's flat parameter buffer (compute precision P); `tensors` its table.
  AdamW(View1<P> params, const std::vector<model::TensorInfo>& tensors, const AdamWOptions& options,
        const std::vector<FrozenRange>& frozen = {});
  /// `params` laid out as `layout` (a shard of the model under FSDP).
  AdamW(View1<P> params, ParamLayout layout, const AdamWOptions& options);

  OptimizerKind kind() const override { return OptimizerKind::AdamW; }
  std::vector<StateBuffer> state() const override { return {exp_avg_member, exp_avg_sq_member}; }
  std::map<std::string, double> attributes() const override;
  const AdamWOptions& options() const { return options_member; }
  void update(const ExecSpace& space, View1<P> grads, double lr, double grad_scale) override;

 private:
  AdamWOptions options_member;
  StateBuffer exp_avg_member;     // (N) first moment m
  StateBuffer exp_avg_sq_member;  // (N) second moment v
};

}  // namespace plm::train
