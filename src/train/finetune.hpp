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

#include "model/task_head.hpp"
#include "train/trainer.hpp"

namespace plm::train {

/// \brief task.kind, task.num_labels and task.pooling of `deck`, validated (collective
/// plm::Error naming the key).
model::TaskConfig taskConfigFromDeck(const Teuchos::ParameterList& deck);

/// \brief Collective over trainer.comm(): trains the deck's task head for train.steps steps on
/// data.train's labels, evaluates on data.valid every train.eval_every steps and at the end,
/// appends "task_step" / "task_eval" records to <run_dir>/metrics.jsonl and writes the head to
/// <run_dir>/head.h5.  Refuses (collective plm::Error) an unfrozen encoder, sharded or
/// context-parallel layouts, and data without the labels the task needs.
void trainTaskHead(Trainer& trainer);

}  // namespace plm::train
