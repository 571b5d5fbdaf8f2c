// Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"), as the authors'
// reference code (google/automl lion_pytorch.py) computes it:
//   p *= 1 - lr * wd                      (decoupled, on the decay mask)
//   p -= lr * sign(beta1 * m + (1 - beta1) * g)
//   m  = beta2 * m + (1 - beta2) * g
// One fp32 moment: 4 bytes a parameter instead of AdamW's 8.  The update has unit magnitude per
// element, so Lion wants a 3-10x smaller learning rate and a 3-10x larger weight decay than AdamW
// (the paper's advice; doc/optimizers.md).
#pragma once

#include "train/optim/optimizer.hpp"

namespace plm::train {

template <class P> class Lion : public Optimizer<P> {
 public:
  Lion(View1<P> params, ParamLayout layout, const LionOptions& options);

  OptimizerKind kind() const override { return OptimizerKind::Lion; }
  std::vector<StateBuffer> state() const override { return {exp_avg_member}; }
  std::map<std::string, double> attributes() const override;
  const LionOptions& options() const { return options_member; }
  void update(const ExecSpace& space, View1<P> grads, double lr, double grad_scale) override;

 private:
  LionOptions options_member;
  StateBuffer exp_avg_member;  // (N) the moment m
};

}  // namespace plm::train
