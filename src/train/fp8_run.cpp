#include "train/fp8_run.hpp"

namespace plm::train {

void applyFp8Section(const Teuchos::ParameterList& deck, model::Esm2Config& config) {
  if (config.precision != model::Precision::Fp8 || !deck.isSublist("fp8")) return;
  const auto& f = deck.sublist("fp8");
  auto& c = config.fp8;
  c.recipe = model::parseFp8Recipe(f.get<std::string>("recipe"));
  c.format = model::parseFp8Format(f.get<std::string>("format"));
  c.amax_history = f.get<int>("amax_history");
  c.amax_reduce = model::parseAmaxReduce(f.get<std::string>("amax_reduce"));
  c.margin = f.get<int>("margin");
  c.first_layers_bf16 = f.get<int>("first_layers_bf16");
  c.last_layers_bf16 = f.get<int>("last_layers_bf16");
  c.wgrad = model::parseFp8Wgrad(f.get<std::string>("wgrad"));
  c.fused_cast = f.get<bool>("fused_cast");
  c.validate(config.num_layers);
}

}  // namespace plm::train
