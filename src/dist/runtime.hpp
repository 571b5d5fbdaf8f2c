// MPI and Kokkos start-up for the node layout: one MPI rank per GPU (or per CPU process),
// the GPU chosen from the node-local rank.
#pragma once

#include "core/world.hpp"

#include <mpi.h>

#include <string>

namespace plm::dist {

/// \brief Initialises MPI (asking for MPI_THREAD_MULTIPLE, which the background checkpoint
/// writer needs; FUNNELED is enough for everything else) and Kokkos, and finalises both in
/// reverse.
/// On a CUDA build each rank takes device `local_rank % device_count`.
class Runtime {
 public:
  Runtime(int& argc, char**& argv);
  ~Runtime();
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;
};

using plm::worldRank;  // core/world.hpp: 0 of 1 while MPI is not up
using plm::worldSize;
/// \brief Rank within this node (MPI_COMM_TYPE_SHARED split).
int localRank();
int localSize();

/// \brief True when MPI granted MPI_THREAD_MULTIPLE (checkpoint.async needs it).
bool mpiThreadMultiple();

/// \brief A one-line description of MPI (library version) for `plm --version`.
std::string mpiVersion();

/// \brief True if every rank passes `ok`; used to turn a local check into a collective decision.
bool allTrue(bool ok, MPI_Comm comm = MPI_COMM_WORLD);

template <class T> MPI_Datatype mpiType();

}  // namespace plm::dist
