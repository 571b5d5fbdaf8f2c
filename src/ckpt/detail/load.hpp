// Pieces of the checkpoint load (src/ckpt/checkpoint.cpp) that model.init_from
// (src/ckpt/init_from.cpp) reuses to put weights from a file into a trainer at any rank count,
// sharded or holding part of the experts, without a second copy of that logic.
#pragma once

#include "ckpt/detail/redistribute.hpp"
#include "model/esm2.hpp"
#include "train/optim/optimizer.hpp"

#include <mpi.h>

#include <cstdint>
#include <vector>

namespace plm::ckpt::detail {

/// \brief The element count of each tensor (redistribute's tensor sizes).
std::vector<std::int64_t> tensorSizes(const std::vector<model::TensorInfo>& tensors);
/// \brief The segments of a shard's pieces (redistribute's description of the shard layout).
std::vector<Segment> pieceSegments(const std::vector<train::TensorPiece>& pieces);

/// \brief Collective over `comm`: after each rank put its rows of heldLayout(table, placement,
/// ...) into the full-layout buffer `values` (laid out as `table`, a rank's table), every rank
/// holds every tensor of its table whole: the tensors all ranks hold are shared over `comm`,
/// the routed experts over the ranks holding the same ones.
template <class T> void shareHeldRows(const std::vector<model::TensorInfo>& table, T* values,
                                      const model::ExpertPlacement& placement, MPI_Comm comm);

}  // namespace plm::ckpt::detail
