// Adafactor (Shazeer & Stern 2018) with a given learning rate, as transformers.Adafactor
// computes it with relative_step=False (the paper's Algorithms 4 and 5 with update clipping and
// parameter scaling):
//   beta2_t = 1 - t^decay_rate;  G2 = g^2 + eps1
//   matrices (R, C): r = beta2_t r + (1 - beta2_t) mean_cols(G2)  (R)
//                    c = beta2_t c + (1 - beta2_t) mean_rows(G2)  (C)
//                    U = g * rsqrt(r_i / mean(r)) * rsqrt(c_j)
//   other tensors:   v = beta2_t v + (1 - beta2_t) G2;  U = g * rsqrt(v)
//   alpha = lr * (scale_parameter ? max(eps2, RMS(p_{t-1})) : 1), per tensor
//   u = alpha * U / max(1, RMS(U) / clip_threshold), per tensor
//   with beta1 > 0: m = beta1 m + (1 - beta1) u; u = m
//   p *= 1 - wd * alpha (decay mask); p -= u
//
// Sharding: the factors and every RMS are defined per whole tensor (global row and column
// indices), not per shard.  A slice adds its partial row sums, column sums and squared sums to
// host arrays that one MPI all-reduce over the shard group completes, so every rank holds the
// same factors and the result equals the unsharded one up to summation order (rows + columns +
// tensors doubles per reduction, two reductions a step).  The factors are Replicated state.
#pragma once

#include "train/optim/optimizer.hpp"

namespace plm::train {

/// \brief Whether Adafactor factors this tensor's second moment (two-dimensional tensors).
bool adafactorFactored(const model::TensorInfo& tensor);

namespace detail {
struct AdafactorPiece {
  std::int64_t local = 0, start = 0, count = 0;  // in the parameter buffer / the tensor
  std::int64_t rows = 1, cols = 1;               // factored tensors' shape
  std::int64_t row_base = 0, col_base = 0;       // into the row / column factors
  std::int64_t v_local = -1;                     // into exp_avg_sq (unfactored tensors)
  int tensor = 0;                                // index in the layout's table
  int factored = 0;
};
struct AdafactorChunk {  // <= chunk elements of one piece: one team
  std::int64_t begin = 0, count = 0;
  int piece = 0;
};
struct AdafactorRow {  // the part of one matrix row in this rank's piece
  std::int64_t begin = 0, count = 0, row = 0;
};
struct AdafactorCol {  // the part of one matrix column in this rank's piece (strided)
  std::int64_t first = 0, rows = 0, stride = 0, col = 0;
};
}  // namespace detail

template <class P> class Adafactor : public Optimizer<P> {
 public:
  Adafactor(View1<P> params, ParamLayout layout, const AdafactorOptions& options);

  OptimizerKind kind() const override { return OptimizerKind::Adafactor; }
  std::vector<StateBuffer> state() const override;
  std::map<std::string, double> attributes() const override;
  const AdafactorOptions& options() const { return options_member; }

  void update(const ExecSpace& space, View1<P> grads, double lr, double grad_scale) override;

 private:
  AdafactorOptions options_member;
  StateBuffer exp_avg_member;     // (N) first moment of the update, when beta1 > 0
  StateBuffer exp_avg_sq_member;  // (unfactored elements) second moment v
  StateBuffer row_member;         // (sum of rows of factored tensors) row factor r, replicated
  StateBuffer col_member;         // (sum of columns) column factor c, replicated
  std::vector<detail::AdafactorPiece> host_pieces_member;
  Kokkos::View<detail::AdafactorPiece*, MemSpace> pieces_member;  // (pieces)
  Kokkos::View<detail::AdafactorChunk*, MemSpace> chunks_member;  // (chunks)
  Kokkos::View<detail::AdafactorRow*, MemSpace> rows_member;      // (row segments)
  Kokkos::View<detail::AdafactorCol*, MemSpace> cols_member;      // (column segments)
  std::vector<int> chunk_piece_member;                            // (chunks) host copy
  std::vector<std::int64_t> row_index_member, col_index_member;   // segment -> factor index
  std::vector<double> row_divisor_member, col_divisor_member;     // (rows), (cols): C, R
  std::vector<int> row_tensor_member;                             // (rows) -> tensor index
};

}  // namespace plm::train
