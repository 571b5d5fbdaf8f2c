// The process groups of one job, as MPI communicators built once from the world communicator.
//
// Design choice: a group is an MPI_Comm (owned here, freed with the object); a Communicator
// for it is made where it is needed (makeCommunicator(group, backend)), since the backend
// depends on where the data lives.  Replicate and shard groups follow the hybrid-sharded
// layout: `shard_size` consecutive world ranks form a shard group (one model copy sharded over
// them), and the ranks holding the same shard across copies form a replicate group.  With
// shard_size 1 (plain data parallelism) the shard group is the rank itself and the replicate
// group is the world.  The context group (context parallelism) is `context_size` consecutive
// world ranks that share every micro-batch; for the gradient sum they are data-parallel ranks
// like any other, so they sit inside the shard/replicate layout rather than beside it.
#pragma once

#include <mpi.h>

#include <string>

namespace plm::dist {

/// \brief Rank of this process in `comm` (checked).
int commRank(MPI_Comm comm);
/// \brief Number of ranks in `comm` (checked).
int commSize(MPI_Comm comm);
/// \brief Collective over `comm`: `root`'s `value` on every rank.
std::string broadcastString(std::string value, MPI_Comm comm, int root = 0);

class ProcessGroups {
 public:
  /// \brief Collective over `world`.  `shard_size` and `context_size` must divide the world
  /// size (else a collective plm::Error naming the numbers).
  explicit ProcessGroups(MPI_Comm world, int shard_size = 1, int context_size = 1);
  ~ProcessGroups();
  ProcessGroups(const ProcessGroups&) = delete;
  ProcessGroups& operator=(const ProcessGroups&) = delete;

  MPI_Comm world() const { return world_member; }
  /// \brief The ranks on this node (MPI_Comm_split_type, MPI_COMM_TYPE_SHARED).
  MPI_Comm node() const { return node_member; }
  /// \brief The `shard_size` consecutive world ranks that share one sharded model copy.
  MPI_Comm shard() const { return shard_member; }
  /// \brief The ranks holding the same shard, one per model copy (gradient all-reduce).
  MPI_Comm replicate() const { return replicate_member; }
  int shardSize() const { return shard_size_member; }
  /// \brief The `context_size` consecutive world ranks that share every micro-batch, each
  /// holding a shard of its sequences (ring attention); the rank itself with context_size 1.
  MPI_Comm context() const { return context_member; }
  int contextSize() const { return context_size_member; }

 private:
  MPI_Comm world_member = MPI_COMM_NULL;  // a duplicate of the caller's world
  MPI_Comm node_member = MPI_COMM_NULL;
  MPI_Comm shard_member = MPI_COMM_NULL;
  MPI_Comm replicate_member = MPI_COMM_NULL;
  MPI_Comm context_member = MPI_COMM_NULL;
  int shard_size_member = 1;
  int context_size_member = 1;
};

}  // namespace plm::dist
