// What a training run reads for LoRA fine-tuning: the deck's `lora` section (doc/finetune.md).
//
// Design choice: kept out of trainer.cpp (as moe_run.hpp is) so the dense trainer reads as
// before; the adapter kernels are model/lora.hpp.
#pragma once

#include "model/lora.hpp"

#include <Teuchos_ParameterList.hpp>

namespace plm::train {

/// \brief The deck's `lora` section (absent: no adapters).  Throws a collective plm::Error for
/// a bad target name or a dropout other than 0.
model::LoraConfig loraSection(const Teuchos::ParameterList& deck);

}  // namespace plm::train
