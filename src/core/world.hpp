// This process's place in MPI_COMM_WORLD, defined once for every layer: core's fatal paths,
// which may run before MPI_Init or after MPI_Finalize, and everything above (dist re-exports
// these as dist::worldRank / dist::worldSize).  The calls are unchecked on purpose: a fatal path
// asking for its rank must not throw.
#pragma once

#include <mpi.h>

namespace plm {

/// \brief True between MPI_Init and MPI_Finalize.
inline bool mpiUp() {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  return initialized && !finalized;
}

/// \brief Rank in MPI_COMM_WORLD; 0 while MPI is not up.
inline int worldRank() {
  int rank = 0;
  if (mpiUp()) MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  return rank;
}

/// \brief Ranks in MPI_COMM_WORLD; 1 while MPI is not up.
inline int worldSize() {
  int size = 1;
  if (mpiUp()) MPI_Comm_size(MPI_COMM_WORLD, &size);
  return size;
}

}  // namespace plm
