#include "train/optim/from_deck.hpp"

#include "core/error.hpp"

#include <Teuchos_Array.hpp>

namespace plm::train {

namespace {
std::pair<double, double> pair(const Teuchos::ParameterList& o, const char* key) {
  const auto v = o.get<Teuchos::Array<double>>(key);
  if (v.size() != 2)
    throw collectiveError(std::string("optimizer.") + key + ": give two values [a, b]");
  return {v[0], v[1]};
}
}  // namespace

OptimizerOptions optimizerOptionsFromDeck(const Teuchos::ParameterList& o) {
  OptimizerOptions out;
  out.kind = parseOptimizerKind(o.get<std::string>("name"));
  const double wd = o.get<double>("weight_decay");
  std::tie(out.adamw.beta1, out.adamw.beta2) = pair(o, "betas");
  out.adamw.eps = o.get<double>("eps");
  out.adamw.weight_decay = wd;
  std::tie(out.lion.beta1, out.lion.beta2) = pair(o, "lion_betas");
  out.lion.weight_decay = wd;
  auto& a = out.adafactor;
  a.beta1 = o.get<double>("adafactor_beta1");
  a.decay_rate = o.get<double>("adafactor_decay_rate");
  std::tie(a.eps1, a.eps2) = pair(o, "adafactor_eps");
  a.clip_threshold = o.get<double>("adafactor_clip_threshold");
  a.scale_parameter = o.get<bool>("adafactor_scale_parameter");
  a.weight_decay = wd;
  auto& q = out.adamw8bit;
  q.beta1 = out.adamw.beta1;
  q.beta2 = out.adamw.beta2;
  q.eps = out.adamw.eps;
  q.weight_decay = wd;
  q.block_size = o.get<int>("adamw8bit_block_size");
  q.min_8bit_size = o.get<int>("adamw8bit_min_8bit_size");
  return out;
}

}  // namespace plm::train
