// Task-head training (deck section `task`, kind other than mlm; doc/finetune.md).
//
// Design choice: the encoder is the trainer's model (built from the deck and loaded by
// model.init_from as for pre-training); with task.freeze_encoder it runs forward only, so it
// does no weight-gradient work and gets no update, and its optimizer state is never touched.
// The head (model/task_head.hpp) is a few replicated tensors: every rank holds all of them,
// its gradients are summed over the ranks with one MPI_Allreduce of the head buffer per step,
// and AdamW updates every rank's copy identically (data parallelism equals one rank up to the
// summation order).  The head's step runs through the portable Kokkos dispatch on every
// backend.
#pragma once

#include "io/json.hpp"
#include "model/head_file.hpp"
#include "model/task_head.hpp"
#include "train/trainer.hpp"

namespace plm::train {

/// \brief task.kind, task.num_labels and task.pooling of `deck`, validated (collective
/// plm::Error naming the key).
model::TaskConfig taskConfigFromDeck(const Teuchos::ParameterList& deck);

/// \brief The task a stored head was trained for (model::HeadData's attributes), validated.
model::TaskConfig taskConfigOf(const model::HeadData& data, const std::string& source);

/// \brief Copies a stored head into `head`: same task kind and labels, every tensor present
/// with its shape.  Throws plm::Error naming `source`, the tensor and both shapes otherwise.
void loadHead(model::TaskHead<param_t>& head, const model::HeadData& data,
              const std::string& source);

/// \brief Collective over `comm`: the task's loss and metrics of `encoder` + `head` over one
/// pass of the labelled dataset `options.path` (its targets set here from the task): "loss",
/// "labelled", and "mse", "spearman", "baseline_mse" (regression), "accuracy",
/// "baseline_accuracy" and, for two classes per sequence, "auroc" (classification).  The
/// encoder's whole parameters must be in place (sharded runs: gathered).
io::json::Value evaluateTask(model::Esm2<param_t>& encoder, model::TaskHead<param_t>& head,
                             data::LoaderOptions options, MPI_Comm comm);

/// \brief Collective over trainer.comm(): trains the deck's task head for train.steps steps on
/// data.train's labels, evaluates on data.valid every train.eval_every steps and at the end,
/// appends "task_step" / "task_eval" records to <run_dir>/metrics.jsonl and writes the head to
/// <run_dir>/head.h5 (the encoder beside it as model.h5).  task.freeze_encoder: false trains
/// the encoder through the head with the trainer's optimizer at optimizer.lr (plain or sharded
/// data parallelism), the head at task.head_lr.  Refuses (collective plm::Error) context
/// parallelism, MoE models and data without the labels the task needs.
void trainTaskHead(Trainer& trainer);

}  // namespace plm::train
