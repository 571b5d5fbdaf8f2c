// Blocking MPI reductions: the few scalars a training step sums over ranks (loss, masked-token
// and token counts), and a chunked in-place all-reduce of one View.
//
// The training step's gradient all-reduce no longer comes here: it goes through
// dist::GradientBuckets on a dist::Communicator (NCCL on GPUs, non-blocking MPI on CPUs).  The
// View all-reduce below stays as the blocking reference (test_train_gradient_sync compares the
// buckets with it); it fences the producing space, and stages device buffers through one host
// chunk, since MPI built without CUDA support (Debian's and Ubuntu's OpenMPI) faults on device
// pointers.  The MPI datatype comes from the element type (dist::mpiType).
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
/// \brief The element-wise max of a few host floats over the ranks of `comm` (in place).
void allreduceMax(std::vector<float>& values, MPI_Comm comm);

}  // namespace plm::dist
