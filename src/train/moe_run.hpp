// What a training run adds for Mixture-of-Experts models: the `moe` and `parallel` deck
// sections, the expert-parallel communicator, and per-step routing statistics (reduced over all
// ranks) that feed the aux-loss-free bias update, the progress line and metrics.jsonl.
//
// Design choice: kept out of trainer.cpp so the dense trainer reads as before; the trainer calls
// afterStep() once per optimizer step and asks for progress()/metrics() when it logs.
#pragma once

#include "io/json.hpp"
#include "model/esm2.hpp"

#include <mpi.h>
#include <Teuchos_ParameterList.hpp>

#include <memory>
#include <string>
#include <vector>

namespace plm::dist {
class ProcessGroups;
}

namespace plm::train {

template <class P> class Fsdp;

/// \brief Fills config.moe from the deck's `moe` section over the preset's values (0 = the
/// preset's, then the section's defaults: top_k 2, every 1, expert_ffn = ffn / top_k).
void applyMoeSection(const Teuchos::ParameterList& deck, model::Esm2Config& config);

/// \brief Collective checks of parallel.expert_degree against `config` and `comm`'s ranks, and
/// this rank's expert placement: the degree consecutive ranks of an expert group
/// (dist::ProcessGroups' shard groups) hold the experts in rank order, so rank r holds the
/// experts of position r % degree (model::ExpertPlacement).
model::ExpertPlacement expertPlacement(const Teuchos::ParameterList& deck,
                                       const model::Esm2Config& config, MPI_Comm comm);

/// The routing statistics of one MoE layer over an interval, reduced over all ranks.
struct MoeLayerSummary {
  int layer = 0;
  double load_min = 0, load_mean = 0, load_max = 0;  // slots routed per expert per step
  double dropped_fraction = 0, aux = 0, z = 0, entropy = 0;
};

template <class P> class MoeRun {
 public:
  /// Collective over `comm`: builds the expert-parallel group (parallel.expert_degree
  /// consecutive ranks) and hands it to the model, which must have been built with
  /// expertPlacement(deck, config, comm).
  MoeRun(const Teuchos::ParameterList& deck, model::Esm2<P>& model, MPI_Comm comm);
  ~MoeRun();

  /// \brief Collective: moe.router_init: centred (nothing otherwise, or for a dense model):
  /// centres the routers on the router inputs of `first_step`, this rank's micro-batches of the
  /// first training step (Esm2::centreRouters), and logs what it removed.  `sharded` (FSDP):
  /// the passes are its gathered forwards (every rank runs as many) and each router is read
  /// from the shards, centred and written back (the same arithmetic as one rank's).
  void centreRouters(model::Esm2<P>& model, const std::vector<data::MicroBatch>& first_step,
                     Fsdp<P>* sharded = nullptr);
  /// \brief Collective: reduces this step's routing statistics over all ranks, applies the
  /// bias_balance update (`sharded`: to the selection biases' pieces in the master shards, so
  /// every rank holding a piece adds the same numbers) and, with moe.router_projection where
  /// the model holds its masters (not under sharding), the router projection
  /// (Esm2::projectRouters), and adds the statistics to the interval.
  void afterStep(model::Esm2<P>& model, Fsdp<P>* sharded = nullptr);
  /// \brief The interval's statistics per MoE layer (then starts a new interval).
  std::vector<MoeLayerSummary> takeInterval();
  /// \brief Compact: worst max/mean load over layers, mean dropped fraction, aux loss.
  static std::string progress(const std::vector<MoeLayerSummary>& layers);
  /// \brief Full: one object per layer under "moe".
  static void addMetrics(const std::vector<MoeLayerSummary>& layers, io::json::Value& record);
  int expertDegree() const { return degree_member; }
  /// \brief The last step's slots routed to each expert, per MoE layer, summed over all ranks
  /// and micro-batches (empty before the first step or for a dense model); the plan's
  /// first-step report derives the fullest rank's load from it (src/plan/train_report.cpp).
  const std::vector<std::vector<double>>& lastRouted() const { return last_routed_member; }

 private:
  MPI_Comm comm_member;
  int degree_member = 1;
  std::unique_ptr<dist::ProcessGroups> groups_member;
  std::unique_ptr<dist::Communicator> expert_comm_member;
  std::vector<model::MoeLayerStats> interval_member;
  std::vector<std::vector<double>> last_routed_member;
  int steps_member = 0;
};

}  // namespace plm::train
