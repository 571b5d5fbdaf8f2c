// What a training run adds for context parallelism (parallel.context_degree = C): the layout
// checks, the context group and its communicator handed to the model, the data-parallel rank
// the loaders use, and the split of every micro-batch into this rank's shard.
//
// Design choice: the C ranks of a context group load the same micro-batches (the loaders see
// world / C data-parallel ranks) and each keeps its shard (data/context_split.hpp), so no
// token is sent twice; for the gradient sum every rank is a data-parallel rank, so the
// existing reductions (gradient buckets, FSDP) and the global masked-token count need no
// change: each rank contributes the partial sums of its shard.  Kept out of trainer.cpp.
#pragma once

#include "data/batch.hpp"
#include "model/esm2.hpp"

#include <mpi.h>
#include <Teuchos_ParameterList.hpp>

#include <memory>
#include <vector>

namespace plm::dist {
class Communicator;
class ProcessGroups;
}  // namespace plm::dist

namespace plm::train {

/// The deck's parallel degrees that context parallelism must fit with.
struct ContextLayoutInput {
  int context = 1;    // parallel.context_degree
  int world = 1;      // ranks of the job
  int shard = 1;      // resolved parallel.shard_degree
  int replicate = 1;  // resolved parallel.replicate_degree
  int expert = 1;     // parallel.expert_degree
};

/// \brief Throws a collective plm::Error naming the numbers when the context degree does not
/// fit: it must divide the world (the data-parallel groups are world / C).  Every precision
/// (the ring runs the portable attention in fp32, the CUDA kernels in bf16), MoE and expert
/// parallelism compose (the MoE layers reduce their routing over the context group).
void checkContextLayout(const ContextLayoutInput& in);

class ContextRun {
 public:
  /// \brief Collective over `comm`: reads parallel.context_degree (1 without the section),
  /// checks it, and with C > 1 builds the context group (C consecutive ranks) and its
  /// communicator.
  ContextRun(const Teuchos::ParameterList& deck, MPI_Comm comm);
  ~ContextRun();
  ContextRun(const ContextRun&) = delete;
  ContextRun& operator=(const ContextRun&) = delete;

  int degree() const { return degree_member; }
  /// \brief This rank in its context group.
  int rank() const { return rank_member; }
  /// \brief The data-parallel index and count the loaders see: world rank / C, world / C.
  int dataRank() const { return data_rank_member; }
  int dataSize() const { return data_size_member; }

  /// \brief Hands the context communicator to the model (nothing with C = 1).
  template <class P> void attach(model::Esm2<P>& model) const;
  /// \brief This rank's shards of the micro-batches its context group loaded (C = 1: as given).
  std::vector<data::MicroBatch> shard(std::vector<data::MicroBatch> local) const;

 private:
  int degree_member = 1;
  int rank_member = 0;
  int data_rank_member = 0;
  int data_size_member = 1;
  std::unique_ptr<dist::ProcessGroups> groups_member;
  std::unique_ptr<dist::Communicator> comm_member;
};

}  // namespace plm::train
