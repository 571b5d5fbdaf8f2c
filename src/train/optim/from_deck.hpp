// The deck's optimizer section as OptimizerOptions (doc/deck.md, doc/optimizers.md).
#pragma once

#include "train/optim/optimizer.hpp"

#include <Teuchos_ParameterList.hpp>

namespace plm::train {

/// \brief optimizer.name and every kind's hyper-parameters from a resolved `optimizer` section;
/// weight_decay is shared by all kinds, betas and eps by adamw and adamw8bit.
OptimizerOptions optimizerOptionsFromDeck(const Teuchos::ParameterList& optimizer);

}  // namespace plm::train
