// OpenBLAS threads per MPI rank.
//
// Design choice: the CPU build's GEMMs go to the system BLAS (OpenBLAS, pthreads), which by
// default starts one busy-waiting thread per core in EVERY rank; with one rank per core that
// oversubscribes the node and halves throughput.  Unless the user set OPENBLAS_NUM_THREADS (or
// OMP_NUM_THREADS), each rank gets cores / ranks-on-this-node threads.  Found by symbol at run
// time, so a non-OpenBLAS BLAS (or none) is left alone.
#pragma once

namespace plm::train {

/// \brief Returns the thread count set, or 0 when nothing was changed.
int limitBlasThreadsPerRank(int ranks_on_node);

}  // namespace plm::train
