// The backends behind dist::makeCommunicator.  The NCCL one lives in nccl_communicator.cu and
// the CUDA copier of staged MPI in cuda_copier.cu, which join plm_dist only on a CUDA build
// (PLM_HAVE_CUDA).
#pragma once

#include "dist/communicator.hpp"
#include "dist/staged_communicator.hpp"

#include <mpi.h>

#include <memory>

namespace plm::dist::detail {

std::unique_ptr<Communicator> makeMpiCommunicator(MPI_Comm comm);

/// Collective over `comm`; defined only on a CUDA build.
std::unique_ptr<Communicator> makeNcclCommunicator(MPI_Comm comm);
/// The CUDA DeviceCopier of staged MPI (cuda_copier.cu); defined only on a CUDA build.
std::shared_ptr<DeviceCopier> makeCudaCopier();
/// True when no two ranks of `comm` share a GPU (host name + PCI bus id); collective, CUDA only.
bool ranksOnDistinctGpus(MPI_Comm comm);

}  // namespace plm::dist::detail
