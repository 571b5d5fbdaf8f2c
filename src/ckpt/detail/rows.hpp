// How a checkpoint's tensors are split over ranks on load (src/ckpt/checkpoint.cpp): rank r reads
// rows io::rowRange(rows, r, world) of every tensor and shareRows gives every rank all of them.
#pragma once

#include "model/esm2.hpp"

#include <mpi.h>

#include <cstdint>
#include <vector>

namespace plm::ckpt::detail {

/// \brief Collective: every rank holds its own rows of every tensor of the flat buffer `values`
/// (laid out as `tensors`); afterwards every rank holds all rows.  One MPI_Allgatherv per batch
/// of tensors of at most `batch_limit` floats in all (a larger tensor is a batch of its own), so
/// MPI's int counts and the staging buffer stay bounded.
void shareRows(const std::vector<model::TensorInfo>& tensors, float* values, MPI_Comm comm,
               std::int64_t batch_limit = std::int64_t(1) << 27);
/// \brief The same for 8-bit optimizer codes.
void shareRows(const std::vector<model::TensorInfo>& tensors, std::uint8_t* values, MPI_Comm comm,
               std::int64_t batch_limit = std::int64_t(1) << 27);

}  // namespace plm::ckpt::detail
