// The backends behind dist::makeCommunicator.  The NCCL one lives in nccl_communicator.cu,
// which joins plm_dist only on a CUDA build (PLM_HAVE_CUDA).
#pragma once

#include "dist/communicator.hpp"

#include <mpi.h>

#include <memory>

namespace plm::dist::detail {

std::unique_ptr<Communicator> makeMpiCommunicator(MPI_Comm comm);

/// Collective over `comm`; defined only on a CUDA build.
std::unique_ptr<Communicator> makeNcclCommunicator(MPI_Comm comm);
/// True when no two ranks of `comm` share a GPU (host name + PCI bus id); collective, CUDA only.
bool ranksOnDistinctGpus(MPI_Comm comm);

}  // namespace plm::dist::detail
