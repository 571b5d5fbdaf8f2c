// LayerNorm over the last dimension (eps 1e-5 in ESM-2), one row per token.
//
// Accumulation rule: the forward writes y, mean and rstd (=); the backward ADDS the input
// gradient into dx (+=), because every LayerNorm in ESM-2 reads the residual stream, whose
// gradient already holds the skip path; dgamma and dbeta accumulate (+=).
#pragma once

#include "core/types.hpp"

namespace plm::model {

/// \brief y = (x - mean) * rstd * gamma + beta per row.  x, y (R, H); gamma, beta (H);
/// mean, rstd (R) saved for the backward.
template <class T> void layerNormForward(const ExecSpace& space, const View2<T>& x,
                                         const View1<T>& gamma, const View1<T>& beta, double eps,
                                         const View2<T>& y, const View1<T>& mean,
                                         const View1<T>& rstd);

/// \brief dx += dL/dx, dgamma += sum_rows dy * xhat, dbeta += sum_rows dy.
template <class T>
void layerNormBackward(const ExecSpace& space, const View2<T>& x, const View1<T>& gamma,
                       const View1<T>& mean, const View1<T>& rstd, const View2<T>& dy,
                       const View2<T>& dx, const View1<T>& dgamma, const View1<T>& dbeta);

}  // namespace plm::model
