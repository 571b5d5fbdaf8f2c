// Softmax cross-entropy of the LM head's logits, summed over rows whose label is not -100.
//
// Accumulation rule: dlogits is written (=), grad_scale * (softmax - onehot) on labelled rows and
// 0 on the others; it may alias logits (the training path overwrites logits in place).  The loss
// sum is accumulated in double (accum_t).
#pragma once

#include "core/types.hpp"

namespace plm::model {

/// \brief Returns sum over labelled rows of -log softmax(logits)[label].  logits (M, V),
/// labels (M).  If dlogits is non-empty it receives grad_scale * d(sum)/d(logits).
template <class T> double crossEntropy(const ExecSpace& space, const View2<T>& logits,
                                       const View1<std::int32_t>& labels, double grad_scale,
                                       const View2<T>& dlogits);

}  // namespace plm::model
