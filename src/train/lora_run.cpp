#include "train/lora_run.hpp"

#include "core/error.hpp"

#include <string>

namespace plm::train {

model::LoraConfig loraSection(const Teuchos::ParameterList& deck) {
  model::LoraConfig c;
  if (!deck.isSublist("lora")) return c;
  const auto& s = deck.sublist("lora");
  c.rank = s.get<int>("rank");
  if (!c.enabled()) return c;  // the rest of the section is not read
  c.alpha = s.get<double>("alpha");
  c.targets = model::parseLoraTargets(s.get<std::string>("targets"));
  c.dropout = s.get<double>("dropout");
  if (c.dropout != 0.0)
    throw collectiveError("lora.dropout " + std::to_string(c.dropout) +
                          ": adapter dropout is not implemented; use lora.dropout: 0");
  if (deck.isSublist("task")) {
    const auto& t = deck.sublist("task");
    if (t.get<std::string>("kind") != "mlm" && t.get<bool>("freeze_encoder"))
      throw collectiveError(
          "lora.rank " + std::to_string(c.rank) + " with task.kind " + t.get<std::string>("kind") +
          " and task.freeze_encoder: true: the adapters sit in the encoder, which then gets no "
          "gradient, so they would never train; set task.freeze_encoder: false (the base "
          "weights stay frozen, only the adapters and the head train) or lora.rank: 0");
  }
  return c;
}

}  // namespace plm::train
