// How a checkpoint's tensors are split over ranks (src/ckpt/checkpoint.cpp): rank r of `world`
// writes, and reads, rows model::rowRange(rows, r, world) of every tensor.  Those rows lie either
// inside a full flat buffer (the full-layout path) or back to back in a compact buffer of this
// rank's rows only (the sharded path, filled from the shards by detail::redistribute).
#pragma once

#include "ckpt/detail/redistribute.hpp"
#include "model/esm2.hpp"

#include <mpi.h>

#include <cstdint>
#include <vector>

namespace plm::ckpt::detail {

/// Where this rank's rows of every tensor of a table lie in a host buffer.
struct RowsLayout {
  int rank = 0, world = 1;              // the row split (model::rowRange)
  std::vector<std::int64_t> first_row;  // per tensor: its first row of this rank
  std::vector<std::int64_t> row_count;  // per tensor: rows of this rank
  std::vector<std::int64_t> row_size;   // per tensor: elements per row
  std::vector<std::int64_t> at;         // per tensor: buffer offset of its first own element
  std::int64_t size = 0;                // compact: elements of the buffer (all rows)

  std::int64_t count(std::size_t i) const { return row_count[i] * row_size[i]; }
  std::int64_t start(std::size_t i) const { return first_row[i] * row_size[i]; }
};

/// \brief The rows inside the full flat buffer laid out as `tensors` (at = offset + first row).
RowsLayout fullRows(const std::vector<model::TensorInfo>& tensors, int rank, int world);
/// \brief The rows back to back in table order, in a buffer of `size` elements.
RowsLayout compactRows(const std::vector<model::TensorInfo>& tensors, int rank, int world);
/// A table as the file stores it for ranks holding part of the experts, with this rank's rows.
struct HeldLayout {
  std::vector<model::TensorInfo> tensors;  // every tensor of the whole model (model::heldRows)
  RowsLayout rows;  // where this rank's rows of each lie in the full-layout buffer of `table`
};
/// \brief model::heldRows of `table` (a rank's table, or an optimizer state's derived from it) as
/// a rows layout into the full-layout buffer laid out as `table`.  For a placement holding
/// every expert: `table` itself and fullRows(table, rank, world).
HeldLayout heldLayout(const std::vector<model::TensorInfo>& table,
                      const model::ExpertPlacement& placement, int experts, int rank, int world);

/// \brief The segments of a rows layout (redistribute's description of it).
std::vector<Segment> rowSegments(const RowsLayout& rows);

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
