#include "dist/process_groups.hpp"

#include "core/error.hpp"

#include <cstdint>
#include <string>

namespace plm::dist {

int commRank(MPI_Comm comm) {
  int rank = 0;
  PLM_CHECK_MPI(MPI_Comm_rank(comm, &rank));
  return rank;
}

int commSize(MPI_Comm comm) {
  int size = 1;
  PLM_CHECK_MPI(MPI_Comm_size(comm, &size));
  return size;
}

std::string broadcastString(std::string value, MPI_Comm comm, int root) {
  std::int64_t length = std::int64_t(value.size());
  PLM_CHECK_MPI(MPI_Bcast(&length, 1, MPI_INT64_T, root, comm));
  value.resize(std::size_t(length));
  if (length > 0) PLM_CHECK_MPI(MPI_Bcast(value.data(), int(length), MPI_CHAR, root, comm));
  return value;
}

ProcessGroups::ProcessGroups(MPI_Comm world, int shard_size, int context_size)
    : shard_size_member(shard_size), context_size_member(context_size) {
  const int size = commSize(world);
  if (shard_size < 1 || size % shard_size != 0)
    throw collectiveError("dist::ProcessGroups: shard size " + std::to_string(shard_size) +
                          " must be positive and divide the number of ranks (" +
                          std::to_string(size) + ")");
  if (context_size < 1 || size % context_size != 0)
    throw collectiveError("dist::ProcessGroups: context size " + std::to_string(context_size) +
                          " must be positive and divide the number of ranks (" +
                          std::to_string(size) + ")");
  PLM_CHECK_MPI(MPI_Comm_dup(world, &world_member));
  const int rank = commRank(world_member);
  PLM_CHECK_MPI(
      MPI_Comm_split_type(world_member, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node_member));
  PLM_CHECK_MPI(MPI_Comm_split(world_member, rank / shard_size, rank, &shard_member));
  PLM_CHECK_MPI(MPI_Comm_split(world_member, rank % shard_size, rank, &replicate_member));
  PLM_CHECK_MPI(MPI_Comm_split(world_member, rank / context_size, rank, &context_member));
}

ProcessGroups::~ProcessGroups() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) return;
  for (MPI_Comm* c :
       {&context_member, &replicate_member, &shard_member, &node_member, &world_member})
    if (*c != MPI_COMM_NULL) MPI_Comm_free(c);
}

}  // namespace plm::dist
