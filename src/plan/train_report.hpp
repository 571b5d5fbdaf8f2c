// `plm train` prints the plan's prediction next to the measured figures after its first steps
// (doc/plan.md, "Prediction against measurement").
#pragma once

#include "plan/plan.hpp"
#include "train/trainer.hpp"

namespace plm::plan {

/// \brief The device kind of this process's rates table: "cpu" in a CPU build, "h200" on a GPU
/// whose name says H200, otherwise "h100".
std::string deviceKind();

/// \brief A step hook for Trainer::Hooks::on_step: times steps 2..`window`+1 of the run, then
/// (collectively) measures the peak memory in use, plans the deck with the measured mean
/// sequence length and fill, logs prediction and measurement side by side on rank 0 and writes
/// both to <run_dir>/plan.json. Chains to `next` on every step.
train::Trainer::StepHook predictionReport(int window = 5, train::Trainer::StepHook next = {});

/// \brief The planner's input for `trainer`'s deck and rank layout (shard degree from the
/// deck's parallel section: shard, context and expert degrees) with this device's rates (PLM_RATES
/// replaces them).  Throws plm::Error when the rates file cannot be read.
Input inputOfRun(const train::Trainer& trainer);

/// \brief The fullest rank's MoE load (its experts' rows over the balanced share, averaged
/// over the MoE layers) from one step's routed slots per layer and expert summed over all ranks,
/// for expert groups of `degree` consecutive ranks; 0 when there is no expert parallelism.
double measuredMoeLoad(const std::vector<std::vector<double>>& routed, int experts, int degree);

/// \brief Logs (rank 0) the planned bytes per rank of `trainer`'s run: parameters, gradients,
/// optimizer state, gathered-layer buffers and activations at the configured micro-batch.
/// predictionReport then logs the measured peak of the first step against the same plan.
void logMemoryPlan(const train::Trainer& trainer);

}  // namespace plm::plan
