// GELU, the exact erf form ESM-2 uses: gelu(x) = x/2 (1 + erf(x / sqrt 2)).
//
// Accumulation rule: outputs are written (=); geluBackward may run in place (dx aliasing dy),
// which is how the FFN backward reuses one (T, ffn) buffer.
#pragma once

#include "core/types.hpp"

namespace plm::model {

/// \brief y = gelu(x) elementwise; x, y (R, C), may alias.
template <class T> void geluForward(const ExecSpace& space, const View2<T>& x, const View2<T>& y);

/// \brief dx = dy * gelu'(x) elementwise; dx may alias dy.
template <class T> void geluBackward(const ExecSpace& space, const View2<T>& x, const View2<T>& dy,
                                     const View2<T>& dx);

}  // namespace plm::model
