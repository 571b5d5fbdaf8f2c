// The deck's `fp8` section into the model's FP8 recipe (doc/fp8.md).
#pragma once

#include "model/esm2.hpp"

#include <Teuchos_ParameterList.hpp>

namespace plm::train {

/// \brief Reads section `fp8` into config.fp8 when train.precision is fp8 (checked against the
/// model's layer count: a collective plm::Error naming the key otherwise).
void applyFp8Section(const Teuchos::ParameterList& deck, model::Esm2Config& config);

}  // namespace plm::train
