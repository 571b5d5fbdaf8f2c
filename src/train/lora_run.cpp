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
  // The adapter kernels (model/lora.hpp) are not yet part of the model's tensor table and
  // step, so a run with adapters would silently train the whole model: refuse it.
  throw collectiveError("lora.rank " + std::to_string(c.rank) +
                        ": LoRA adapters are not wired into training in this build; use "
                        "lora.rank: 0 (full fine-tuning, doc/finetune.md)");
}

}  // namespace plm::train
