// Linear layer y = x W^T + b with W stored as Hugging Face does, (out, in).
//
// Accumulation rule: parameter gradients (dW, db) accumulate (+=); the output y and the input
// gradient dx are beta-scaled (beta = 0 writes, beta = 1 adds, which is how the residual
// additions and the three q/k/v input gradients are folded in without extra passes).
#pragma once

#include "core/types.hpp"

namespace plm::model {

/// \brief y = beta * y + x W^T + b.  x (R, in), w (out, in), b (out), y (R, out).
template <class T> void linearForward(const ExecSpace& space, const View2<T>& x, const View2<T>& w,
                                      const View1<T>& b, T beta, const View2<T>& y);

/// \brief dx = dx_beta * dx + dy W (skipped if dx is empty); dw += dy^T x; db += sum_rows dy.
template <class T> void linearBackward(const ExecSpace& space, const View2<T>& x, const View2<T>& w,
                                       const View2<T>& dy, T dx_beta, const View2<T>& dx,
                                       const View2<T>& dw, const View1<T>& db);

/// \brief out(j) += sum_i a(i, j), summed in row order (deterministic).
template <class T>
void columnSumAccumulate(const ExecSpace& space, const View2<T>& a, const View1<T>& out);

}  // namespace plm::model
