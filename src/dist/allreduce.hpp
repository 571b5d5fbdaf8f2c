// Data-parallel reductions: the gradient all-reduce over one flat buffer and the few scalars a
// training step sums over ranks (loss, masked-token and token counts).
//
// Design choice: gradients are reduced in place, in fixed-size chunks, so no second buffer of
// the model's size is needed and each MPI call stays far below the int count limit.  The
// producing execution space is fenced before MPI touches the memory.  The MPI datatype comes
// from the element type (dist::mpiType), so a bf16/fp32 gradient role changes nothing here.
// Device buffers are staged through one host chunk: MPI built without CUDA support (Debian's
// and Ubuntu's OpenMPI) faults on device pointers; NCCL is the fast path still to come.
#pragma once

#include "core/types.hpp"

#include <mpi.h>

#include <cstdint>
#include <vector>

namespace plm::dist {

/// Elements per MPI_Allreduce call of allreduceSum (64 MiB of fp32).
constexpr std::int64_t allreduce_chunk_elements = std::int64_t(1) << 24;

/// \brief Sums `data` over the ranks of `comm`, in place, in chunks of `chunk_elements`.
/// Every rank must pass a buffer of the same length.  Fences `space` first.
template <class T> void allreduceSum(const ExecSpace& space, View1<T> data, MPI_Comm comm,
                                     std::int64_t chunk_elements = allreduce_chunk_elements);

/// \brief Sums a few host scalars over the ranks of `comm` in one call (in place).
void allreduceSum(std::vector<double>& values, MPI_Comm comm);
void allreduceSum(std::vector<std::int64_t>& values, MPI_Comm comm);
double allreduceSum(double value, MPI_Comm comm);
std::int64_t allreduceSum(std::int64_t value, MPI_Comm comm);
double allreduceMax(double value, MPI_Comm comm);

}  // namespace plm::dist
