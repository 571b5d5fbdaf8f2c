// model.init_from: start a run from the weights of another model (doc/finetune.md).
//
// The source is a plm model file (<run_dir>/model.h5, `plm convert --from-hf`), a plm
// checkpoint (a step_*.h5 file, or a checkpoint directory: its newest), or a Hugging Face ESM
// model (a directory with config.json and model.safetensors or a sharded index, an index file,
// or one .safetensors file).  Only the weights are taken: the optimizer state, the schedule and
// the data stream start fresh, so a new data.train is an ordinary run.
//
// Design choices:
//  - It is a load step after construction (the model is built and initialised from the deck
//    as always), run by the checkpoint hooks' on_start only when no checkpoint was resumed: a
//    requeued job continues from its own checkpoints, never from init_from again.
//  - It reuses the checkpoint load's layouts: every rank reads only its rows of each tensor
//    (model::rowRange; under expert parallelism only the experts it holds), then the rows are
//    shared (replicated and expert-parallel runs: detail::shareHeldRows) or moved into the
//    FSDP shards (detail::redistribute), exactly as a checkpoint's /model is.
//  - Matching is by Hugging Face name.  A tensor in both with another shape is refused (the
//    tensor and both shapes, one collective line); a source tensor the model does not have is
//    refused, except known heads and buffers (the tied decoder, rotary frequencies, the contact
//    head, a pooler or classifier), which are listed as not used; a model tensor the source lacks
//    keeps its initialisation and is listed in the log (a partial load: an encoder without the
//    LM head, fewer layers).  Heads do not show in any shape, so a source with a config
//    (plm file, config.json) must have the model's head count.
//  - Everything is read and checked before the trainer changes: a refused source leaves it as
//    constructed.
#pragma once

#include "train/trainer.hpp"

#include <cstdint>
#include <string>
#include <vector>

namespace plm::ckpt {

/// What model.init_from loaded (identical on every rank).
struct InitReport {
  std::string path;  // the file or directory read (a checkpoint directory: its newest file)
  std::string kind;  // "plm model file", "plm checkpoint", "Hugging Face model"
  std::int64_t tensors_loaded = 0, parameters_loaded = 0;
  std::vector<std::string> not_loaded;  // model tensors the source lacks (kept initialised)
  std::vector<std::string> not_used;    // source tensors the model has no place for, with why
  std::vector<std::string> warnings;    // config differences that do not show in shapes
};

/// \brief Collective over trainer.comm(): loads the weights of `path` into the trainer's
/// master weights (and compute copy), leaving the optimizer state, step and data cursor alone.
/// Throws a collective plm::Error (trainer unchanged) for a missing or unreadable source, a
/// shape or name mismatch, another head count, or a source sharing no tensor with the model.
InitReport initFrom(train::Trainer& trainer, const std::string& path);

/// \brief initFrom with model.init_from of the trainer's deck, logging the report; nothing when
/// the key is empty.  The checkpoint hooks call it when no checkpoint was resumed.
void applyInitFrom(train::Trainer& trainer);

}  // namespace plm::ckpt
