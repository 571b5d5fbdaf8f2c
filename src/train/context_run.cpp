#include "train/context_run.hpp"

#include "core/error.hpp"
#include "core/log.hpp"
#include "data/context_split.hpp"
#include "dist/communicator.hpp"
#include "dist/process_groups.hpp"
#include "dist/runtime.hpp"
#include "train/fsdp.hpp"

#include <string>

namespace plm::train {

void checkContextLayout(const ContextLayoutInput& in) {
  const std::string c = "parallel.context_degree " + std::to_string(in.context);
  if (in.context < 1) throw collectiveError(c + " must be at least 1");
  if (in.world % in.context != 0)
    throw collectiveError(
        c + " does not divide the " + std::to_string(in.world) +
        " ranks of this job (shard_degree " + std::to_string(in.shard) + " x replicate_degree " +
        std::to_string(in.replicate) + ", expert_degree " + std::to_string(in.expert) +
        "): the job runs world / context_degree data-parallel groups of context_degree ranks; "
        "choose a divisor of the rank count");
}

ContextRun::ContextRun(const Teuchos::ParameterList& deck, MPI_Comm comm) {
  const int world = dist::commSize(comm);
  data_size_member = world;
  data_rank_member = dist::commRank(comm);
  if (!deck.isSublist("parallel")) return;
  const auto& p = deck.sublist("parallel");
  ContextLayoutInput in;
  in.context = p.get<int>("context_degree");
  in.world = world;
  const ParallelLayout layout = resolveLayout(
      p.get<int>("shard_degree"), p.get<int>("replicate_degree"), world, dist::localSize());
  in.shard = layout.shard;
  in.replicate = layout.replicate;
  in.expert = p.get<int>("expert_degree");
  checkContextLayout(in);
  degree_member = in.context;
  if (degree_member == 1) return;
  groups_member = std::make_unique<dist::ProcessGroups>(comm, 1, degree_member);
  comm_member = dist::makeCommunicator(groups_member->context(),
                                       dist::defaultBackend(groups_member->context()));
  rank_member = comm_member->rank();
  data_rank_member /= degree_member;
  data_size_member /= degree_member;
  log::info("parallel: context degree %d (ring attention over %s), %d data-parallel group(s)",
            degree_member, dist::nameOf(comm_member->backend()), data_size_member);
}

ContextRun::~ContextRun() = default;

template <class P> void ContextRun::attach(model::Esm2<P>& model) const {
  if (comm_member) model.setContextParallel(comm_member.get());
}

std::vector<data::MicroBatch> ContextRun::shard(std::vector<data::MicroBatch> local) const {
  if (degree_member == 1) return local;
  return data::contextShards(local, degree_member, rank_member);
}

template void ContextRun::attach<float>(model::Esm2<float>&) const;
template void ContextRun::attach<double>(model::Esm2<double>&) const;

}  // namespace plm::train
