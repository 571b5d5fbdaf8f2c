// Checkpoints: one parallel HDF5 file per save, atomic, checked, resumable on any rank count
// (doc/checkpoints.md).
//
//   /                       the plm model file attributes (format "plm-esm2", config;
//   model/model_file.hpp),
//                           so a checkpoint is also a model file (`plm eval --model`, `plm
//                           convert`)
//   /model/<HF name>        fp32 master weights at the full Hugging Face shape
//   /optimizer              attributes: kind (optimizer.name), name, step, state (the buffer
//                           names), the kind's hyper-parameters (beta1, beta2, eps, ...)
//   /optimizer/<buffer>/<HF name>   each state buffer of the kind (doc/optimizers.md): AdamW's
//                           exp_avg and exp_avg_sq at the tensors' shapes; Lion's exp_avg;
//                           Adafactor's exp_avg_sq_row (rows), exp_avg_sq_col (columns),
//                           exp_avg_sq (unfactored tensors), exp_avg with beta1; 8-bit AdamW's
//                           uint8 exp_avg(_sq)_codes, their fp32 block scales exp_avg(_sq)_absmax
//                           (blocks), exp_avg(_sq)_fp32 (the fp32-state tensors), quantile maps
//   /scaling                FP8 scaling state: amax histories and scales (detail/scaling.hpp)
//   /state                  attributes: format "plm-checkpoint", format_version, step, tokens_seen,
//                           cursor_epoch, cursor_position, init_seed, data_seed, world_size,
//                           micro_batches_per_step, dataset_path, dataset_sequences,
//                           dataset_residues, deck (resolved YAML), plm_version, git_revision,
//                           created_utc
//   every tensor carries `crc32`: zlib CRC-32 of its bytes (fp32 or uint8) in row-major order.
//
// Design choices:
//  - Atomic: the file is written as step_<step>.h5.tmp in checkpoint.dir, flushed (MPI_File_sync
//    on every rank), closed and fsynced; only then does rank 0 rename it to step_<step>.h5 and
//    fsync the directory.  A kill at any point leaves either no new name or a complete file, and
//    /state's `format` attribute is written last, so a file that lacks it is never taken.
//  - Each rank writes its own rows of every tensor (the model file's layout and row split,
//    model::rowRange; independent transfers, since a rank's rows are one contiguous range)
//    straight from the host view of the optimizer's buffers: on the CPU that view IS the buffer
//    (no copy at all), on a GPU it is one device-to-host copy per buffer.  Nothing else passes
//    over the bytes except the CRC, which each rank computes over its own rows only
//    (crc32_combine joins them, so neither the checksum nor the file depends on the rank
//    count), on a helper thread while HDF5 writes, so it adds no time when the write is the
//    slower of the two.
//  - Sharded runs (parallel.shard_degree > 1) build no full-layout state: each rank's rows move
//    between the shards and the file by an all-to-all-v inside its shard group
//    (detail/snapshot.hpp, detail/redistribute.hpp); the file is the same.
//  - Loading reads each rank's rows once, verifies their CRCs, all-gathers them into host
//    buffers (sharded: moves them into the shards instead), and only then touches the trainer: a
//    corrupt checkpoint leaves the trainer as it was, and `resume: auto` falls back to the previous
//    one.  Every check ends the same way on every rank (one agreed, collective error), so no rank
//    is left waiting in a collective.
//  - What may differ between the checkpoint and the resuming run is decided key by key
//    (compareDecks): the model shape and the meaning of the data stream must match; run length,
//    logging, evaluation, checkpoint cadence, optimizer and schedule settings may change and are
//    reported.
#pragma once

#include "core/error.hpp"
#include "model/esm2.hpp"
#include "train/trainer.hpp"

#include <mpi.h>

#include <cstdint>
#include <string>
#include <vector>

namespace plm::ckpt {

inline constexpr const char* checkpoint_format = "plm-checkpoint";
inline constexpr std::int64_t checkpoint_format_version = 1;

/// \brief A checkpoint that cannot be used as stored: truncated, damaged, incomplete, not a plm
/// checkpoint.  `resume: auto` skips such a file and tries the previous one; every other error
/// (a refusal) ends the run.
class CorruptCheckpoint : public Error {
 public:
  explicit CorruptCheckpoint(const std::string& message, bool collective = false)
      : Error(message, collective) {}
};

/// \brief "step_000123.h5" (at least six digits, more when the step needs them).
std::string fileName(std::int64_t step);
/// \brief The step of a checkpoint file name ("step_000123.h5" -> 123), -1 for any other name
/// (a .tmp file, a user's file).
std::int64_t stepOfFileName(const std::string& name);

struct Listed {
  std::string path;
  std::int64_t step = 0;
};
/// \brief The checkpoint files of `dir` (names matching fileName's pattern), oldest step first.
/// An absent directory lists nothing.
std::vector<Listed> listCheckpoints(const std::string& dir);

/// What one save cost (identical on every rank).
struct SaveReport {
  std::string path;
  std::int64_t bytes = 0;    // size of the file on disk
  double copy_seconds = 0;   // device -> host (0 on the CPU: the host view is the buffer)
  double write_seconds = 0;  // create, tensors, checksums, attributes
  double sync_seconds = 0;   // flush, fsync, close, rename, directory fsync
  double seconds =
      0;  // the whole save, from the first rank arriving (includes waiting for the rest)
  double megabytesPerSecond() const { return seconds > 0 ? double(bytes) / seconds / 1e6 : 0.0; }
};

/// \brief Collective over trainer.comm(): writes the trainer's state as checkpoint
/// `dir`/fileName(step), atomically (see the file comment), creating `dir` if needed.
SaveReport save(train::Trainer& trainer, const std::string& dir);

/// \brief Collective: rank 0 deletes the oldest checkpoint files of `dir` beyond the newest
/// `keep` (keep <= 0 keeps all).  Only names matching fileName's pattern are touched.  Returns
/// the removed paths (on every rank).
std::vector<std::string> prune(const std::string& dir, int keep, MPI_Comm comm);

/// \brief Collective: rank 0 removes `step_*.h5.tmp` files left in `dir` by an interrupted save.
std::vector<std::string> removeTemporaries(const std::string& dir, MPI_Comm comm);

/// What a checkpoint's attributes say, read without its tensors.
struct Header {
  std::string path;
  std::int64_t format_version = 0;
  model::Esm2Config config;
  train::TrainState state;
  std::int64_t optimizer_step = 0;
  std::string optimizer_kind;  // optimizer.name of the run that wrote it
  std::int64_t world_size = 0;
  std::int64_t micro_batches_per_step = 0;
  std::string dataset_path;
  std::int64_t dataset_sequences = 0, dataset_residues = 0;
  std::string deck_yaml;
  std::string plm_version, git_revision, created_utc;
};

/// \brief Reads and checks the header of `path` (one rank alone, serial HDF5).  Throws
/// CorruptCheckpoint naming the file and what is wrong with it.
Header readHeader(const std::string& path);

/// One deck key whose value differs between the checkpoint and the resuming run.
struct DeckChange {
  std::string key;              // "section.key"
  std::string stored, current;  // values as YAML text ("(absent)" when missing)
};

/// The deck keys that differ, sorted into what resuming refuses and what it allows.
struct DeckChanges {
  std::vector<DeckChange> refused;   // would change the model or the meaning of the data stream
  std::vector<DeckChange> training;  // allowed, but the run's optimization differs from here on
  std::vector<DeckChange> harmless;  // allowed: length, logging, evaluation, checkpoints, paths
};

/// \brief Compares two resolved decks in deck::toYaml form key by key.  Model keys are left to
/// the model-shape comparison (a preset and the same explicit sizes are the same model) and
/// data.train to the dataset identity check; they are listed as harmless when they differ.
DeckChanges compareDecks(const std::string& stored_yaml, const std::string& current_yaml);

/// \brief Every reason the trainer cannot continue from `header` (model shape, dataset, refused
/// deck keys), one line each; empty when it can.  `changes` receives the deck comparison.
std::vector<std::string> incompatibilities(const Header& header, train::Trainer& trainer,
                                           DeckChanges* changes = nullptr);

/// \brief Collective: loads `path` into the trainer (master weights, moments, optimizer step,
/// TrainState with the loader cursor).  Throws a collective CorruptCheckpoint if the file is
/// unusable, a collective plm::Error listing every difference if it does not fit the run; in
/// both cases the trainer is unchanged.  Reports allowed deck changes in the log.
Header load(train::Trainer& trainer, const std::string& path);

/// \brief Collective: applies checkpoint.resume for the trainer: "none" starts fresh, "auto"
/// loads the newest usable checkpoint of checkpoint.dir (corrupt ones are reported and skipped,
/// stale .tmp files removed), a path is loaded or refused.  Returns the path loaded, or "".
std::string resume(train::Trainer& trainer);

/// \brief Rank 0: cuts `metrics` (a metrics.jsonl) after the last record with step <= `step`
/// (and any partial line), so a resumed run appends to exactly what an uninterrupted run would
/// have written.  Returns the records removed.  A missing file is left alone.
std::int64_t truncateMetrics(const std::string& metrics, std::int64_t step);

/// \brief Collective: train.on_nonfinite: rollback: loads the newest usable checkpoint of
/// checkpoint.dir older than the step in progress (corrupt ones skipped) and cuts metrics.jsonl
/// back to it.  False when there is none (the trainer is unchanged).
bool rollback(train::Trainer& trainer);

/// \brief The trainer hooks of a checkpointed run: on_start resumes (resume()), on_save saves
/// to checkpoint.dir (checkpoint.async: from a background thread; the final save always waits),
/// logs the cost and prunes to checkpoint.keep; on_stop (a stop signal) saves the current step
/// unless it was just saved; on_rollback calls rollback().  `extra`'s hooks run after these.
train::Trainer::Hooks hooks(train::Trainer::Hooks extra = {});
/// \brief trainer.setHooks(hooks(extra)).
void installHooks(train::Trainer& trainer, train::Trainer::Hooks extra = {});

}  // namespace plm::ckpt
