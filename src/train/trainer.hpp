// The training driver behind `plm train`: builds the model, optimizer and loaders from a
// resolved deck, runs the optimizer steps, evaluates, logs and calls the checkpoint hooks.
//
// Design choice: the trainer owns no checkpoint format.  Everything a checkpoint needs is
// reachable from it (model(), optimizer() moments and master, state() with the loader cursor),
// and two hooks mark where the checkpoint module plugs in: on_start (restore, before the first
// step) and on_save (every checkpoint.every steps and after the last step).  Resuming is
// restore(state) plus loading the tensors; the loop then continues from state().step + 1.
#pragma once

#include "core/fault.hpp"
#include "core/types.hpp"
#include "data/loader.hpp"
#include "io/tensorboard.hpp"
#include "model/esm2.hpp"
#include "train/context_run.hpp"
#include "train/metrics.hpp"
#include "train/moe_run.hpp"
#include "train/optim/adamw.hpp"
#include "train/schedule.hpp"
#include "train/stability.hpp"
#include "train/step.hpp"
#include "train/watchdog.hpp"

#include <mpi.h>
#include <Teuchos_ParameterList.hpp>
#include <Teuchos_RCP.hpp>

#include <cstdint>
#include <functional>
#include <memory>
#include <set>
#include <string>

namespace plm::dist {
class ProcessGroups;
}

namespace plm::train {

template <class P> class Fsdp;

/// Where training stands; what a checkpoint's /state holds besides the tensors.
struct TrainState {
  std::int64_t step = 0;         // optimizer steps completed
  std::int64_t tokens_seen = 0;  // global tokens consumed (<cls>/<eos> included)
  data::Cursor cursor;           // train loader position of the next step
  std::uint64_t init_seed = 1;   // train.seed (model initialization)
  std::uint64_t data_seed = 1;   // data.seed (order, crops, masking)
};

/// \brief The ESM-2 shape a deck's model section asks for: the preset, with any nonzero explicit
/// size overriding it ("custom": all four sizes explicit).  Validated (collective plm::Error).
model::Esm2Config modelConfigFromDeck(const Teuchos::ParameterList& deck);

/// \brief Loader options for one evaluation pass over `path` with the deck's data section:
/// single pass, unshuffled, one micro-batch per rank per loader step, epoch-0 masking.
data::LoaderOptions evalLoaderOptions(const Teuchos::ParameterList& deck, const std::string& path,
                                      int rank, int world);
/// \brief Loader steps of an evaluation pass allowed by data.valid_tokens (0 = the whole pass):
/// ceil(valid_tokens / (micro_batch_tokens * world)), so at most about valid_tokens tokens.
std::int64_t evalMaxSteps(const Teuchos::ParameterList& deck, int world);

class Trainer {
 public:
  using Hook = std::function<void(Trainer&)>;
  /// `final_save` is true for the save after the last step.
  using SaveHook = std::function<void(Trainer&, bool final_save)>;
  using StepHook = std::function<void(Trainer&, const StepStats&)>;
  /// Returns true when it restored the trainer (e.g. from the newest checkpoint).
  using RollbackHook = std::function<bool(Trainer&)>;
  struct Hooks {
    Hook on_start;     // after construction, before the first step: restore a checkpoint here
    SaveHook on_save;  // after step s when checkpoint.every divides s, and after the last step
    StepHook on_step;  // after every optimizer step (tests, tools)
    Hook on_stop;      // a stop signal was agreed after state().step: save it (doc/operations.md)
    RollbackHook on_rollback;  // train.on_nonfinite: rollback: reload the newest checkpoint
  };

  /// How run() ended.
  enum class RunEnd { Completed, Stopped };

  /// \brief Builds everything from a resolved deck (deck::load / deck::resolve).  `comm` is the
  /// data-parallel group; the model is initialized from train.seed.
  explicit Trainer(Teuchos::RCP<const Teuchos::ParameterList> deck, MPI_Comm comm = MPI_COMM_WORLD);
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  void setHooks(Hooks hooks) { hooks_member = std::move(hooks); }

  /// \brief Runs steps state().step + 1 .. train.steps: logs every log_every steps, validates
  /// every eval_every steps and at the end, calls on_save every checkpoint.every steps and at
  /// the end.  Rank 0 writes <run_dir>/deck.yaml and appends to <run_dir>/metrics.jsonl; at the
  /// end the model is written to <run_dir>/model.h5 (a plm model file, model/model_file.hpp).
  /// Between steps, every rank agrees whether a stop signal arrived (train/preemption.hpp):
  /// then on_stop saves and run() returns Stopped (no model.h5).  A watchdog thread ends a hung
  /// step (train.step_timeout); non-finite steps follow train.on_nonfinite (train/stability.hpp).
  RunEnd run();

  /// \brief Validation loss over data.valid (at most data.valid_tokens tokens; deterministic
  /// masking).  Collective.  Returns zero counts when the deck has no validation set.
  BatchStats validate();

  /// \brief Sets the state after a restore and moves the train loader to state.cursor; the
  /// optimizer's step count (bias correction) becomes state.step.
  void restore(const TrainState& state);

  model::Esm2<param_t>& model() { return *model_member; }
  /// \brief The MoE side of the run: expert degree and the last step's routing (dense: empty).
  const MoeRun<param_t>& moe() const { return *moe_member; }
  /// \brief The full-layout optimizer state (unsharded runs: the optimizer itself).  Sharded
  /// runs (parallel.shard_degree > 1) allocate it here only on demand, gathered from the shards
  /// (then collective: every rank must call it), and release it once the shards have taken it
  /// back or at the next save; their checkpoints never call it (sharding()).
  Optimizer<param_t>& optimizer();
  const OptimizerOptions& optimizerOptions() const { return optimizer_options_member; }
  /// \brief Sharded runs: the sharding engine, whose shards checkpoints write and restore
  /// directly, without optimizer()'s full-layout copy (ckpt/detail/snapshot.hpp); else nullptr.
  Fsdp<param_t>* sharding() { return fsdp_member.get(); }
  /// \brief Sharded runs: drops the full-layout state, if any, once the shards were restored
  /// directly (it would otherwise be taken back into them).  No-op unsharded.
  void discardFullState();
  /// \brief The high-water mark of Kokkos allocations during this run's first step on this
  /// rank (train::AllocationTracker; -1 if not measured).
  std::int64_t firstStepPeak() const { return first_step_peak_member; }
  data::Loader& trainLoader() { return *train_loader_member; }
  const TrainState& state() const { return state_member; }
  const Teuchos::ParameterList& deck() const { return *deck_member; }
  MPI_Comm comm() const { return comm_member; }
  int rank() const { return rank_member; }
  int world() const { return world_member; }
  std::int64_t totalSteps() const { return total_steps_member; }
  std::int64_t checkpointEvery() const { return checkpoint_every_member; }
  const std::string& runDir() const { return run_dir_member; }
  const ScheduleOptions& schedule() const { return schedule_member; }
  /// Steps of this run whose update was dropped (non-finite, or skipped after a rollback).
  std::int64_t skippedSteps() const { return skipped_steps_member; }
  std::int64_t rollbacks() const { return rollbacks_member; }
  /// \brief Appends {"kind":"event","event":<event>,"step":<step>, ...fields} to metrics.jsonl
  /// (rank 0; a no-op before run() opened it).
  void logEvent(const std::string& event, std::int64_t step,
                io::json::Value fields = io::json::Value::object());

  /// \brief Writes the model to <run_dir>/model.h5 (collective; sharded runs gather it unit by
  /// unit), as run() does at its end.
  void writeFinalModel();

 private:
  void writeLayerProfile();
  void logStep(const StepStats& last, double interval_seconds);
  void logEval(const BatchStats& valid, double seconds);
  void logPlan();  // the run's plan: one log line and a "start" event (collective)
  bool handleNonfinite(std::int64_t step, const StepStats& st);  // true: rolled back
  void injectFaults(std::int64_t step, bool after_gradients);    // PLM_TEST_* (tests only)
  void setUpSharding(const Teuchos::ParameterList& deck);
  int shardDegree(const Teuchos::ParameterList& deck) const;  // parallel.shard_degree resolved
  void logStartup(double seconds);  // "start-up: model ready in ..." (collective)
  /// Runs `save` with the full-layout optimizer state in place (sharded runs gather it first).
  void fullStateForSave(const ExecSpace& space, const std::function<void()>& save);

  Teuchos::RCP<const Teuchos::ParameterList> deck_member;
  MPI_Comm comm_member;
  int rank_member = 0, world_member = 1;
  std::unique_ptr<model::Esm2<param_t>> model_member;
  OptimizerOptions optimizer_options_member;  // optimizer.name and its hyper-parameters
  std::unique_ptr<Optimizer<param_t>> optimizer_member;
  // parallel.shard_degree > 1: the sharding engine; optimizer_member then holds the
  // full-layout state only when optimizer() was asked for it, and is null otherwise.
  // FSDP beside expert parallelism: the shard group (the ranks holding the same experts) and
  // the replicate group (an expert group), freed after the engine (declared before it).
  struct OwnedComms {
    MPI_Comm shard = MPI_COMM_NULL, replicate = MPI_COMM_NULL;
    ~OwnedComms();
  };
  OwnedComms expert_groups_member;
  std::unique_ptr<dist::ProcessGroups> groups_member;
  std::unique_ptr<Fsdp<param_t>> fsdp_member;
  std::int64_t first_step_peak_member = -1;
  double startup_seconds_member = 0;  // construction until the model and optimizer are ready
  void releaseFullState();            // sharded: the shards took the full-layout state
  std::unique_ptr<MoeRun<param_t>> moe_member;  // expert parallelism, routing statistics
  std::unique_ptr<ContextRun> context_member;   // context parallelism (ring attention)
  std::unique_ptr<data::Loader> train_loader_member;
  std::unique_ptr<data::Loader> valid_loader_member;  // null without a validation set
  std::int64_t valid_max_steps_member = 0;            // 0 = the whole validation pass
  ScheduleOptions schedule_member;
  double clip_norm_member = 1.0;
  std::int64_t total_steps_member = 0, log_every_member = 10, eval_every_member = 0;
  std::int64_t checkpoint_every_member = 0;
  OnNonfinite on_nonfinite_member = OnNonfinite::Stop;
  WatchdogOptions watchdog_member;
  LossSpikeDetector spikes_member;
  std::set<std::int64_t> skip_batches_member;  // steps whose batch a rollback skips
  std::int64_t skipped_steps_member = 0, rollbacks_member = 0;
  // Test-only fault injection, read at construction (core/fault.hpp).
  std::set<std::int64_t> inject_nonfinite_member;
  fault::Stall inject_stall_member;
  fault::Fail inject_fail_member;
  std::string run_dir_member;
  PeakFlops peak_member;
  TrainState state_member;
  Hooks hooks_member;
  MetricsLog metrics_member;
  io::tensorboard::EventWriter tensorboard_member;  // train.tensorboard (rank 0)
  double start_unix_member = 0;                     // wall clock at construction

  // Running sums over the current log interval.
  struct Interval {
    std::int64_t steps = 0, tokens = 0, masked = 0;
    double loss_sum = 0.0, flops = 0.0, seconds = 0.0;
  } interval_member;
  double train_seconds_member = 0.0;  // optimizer-step time of this run (no evaluation)
  bool profile_member = false;        // train.profile: per-kind GPU time per progress line
  std::int64_t layer_profile_steps_member = -1;  // steps in profile_layers.tsv (-1: warm-up)
  std::int64_t steps_this_run_member = 0;
};

}  // namespace plm::train
