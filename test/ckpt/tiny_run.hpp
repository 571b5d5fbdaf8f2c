// Tiny checkpointed training runs for the checkpoint tests: a generated dataset of short random
// proteins, a 2-layer hidden-32 model and a deck that packs 4 micro-batches of <= 1024 tokens
// (the deck's minimum) per step; 4 is a multiple of 1, 2 and 4 ranks, so the global batch is the
// same on each.  64 sequences are about 2 micro-batches, so every step crosses an epoch boundary
// and the cursor's epoch is exercised too.
#pragma once

#include "ckpt/checkpoint.hpp"
#include "deck/deck.hpp"
#include "dist/communicator.hpp"
#include "dist/runtime.hpp"
#include "io/dataset.hpp"
#include "train/trainer.hpp"

#include <mpi.h>
#include <Kokkos_Core.hpp>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <vector>

namespace plm::test {

/// True when collectives over `comm` cannot run on the model's memory: device memory (a CUDA
/// build) while the backend chosen moves host memory only (PLM_COMM_BACKEND=mpi).  Ranks that
/// share a GPU (the single-GPU CUDA ctest at 2 or 4 ranks) get staged MPI and run; multi-rank
/// tests of sharded or expert-parallel training skip only where plain MPI was forced.
inline bool noCollectivesForDeviceMemory(MPI_Comm comm) {
  int size = 1;
  MPI_Comm_size(comm, &size);
  return size > 1 && !Kokkos::SpaceAccessibility<Kokkos::HostSpace, plm::MemSpace>::accessible &&
         plm::dist::defaultBackend(comm) == plm::dist::Backend::Mpi;
}

inline int commRank(MPI_Comm comm) {
  int r = 0;
  MPI_Comm_rank(comm, &r);
  return r;
}

/// A fresh directory shared by every rank of `comm` (rank 0 creates it).
inline std::string sharedTempDir(MPI_Comm comm, const std::string& tag) {
  std::string path;
  if (commRank(comm) == 0) {
    std::string pattern =
        (std::filesystem::temp_directory_path() / ("plm_ckpt_" + tag + "_XXXXXX")).string();
    if (!mkdtemp(pattern.data())) std::abort();
    path = pattern;
  }
  int length = int(path.size());
  MPI_Bcast(&length, 1, MPI_INT, 0, comm);
  path.resize(std::size_t(length));
  MPI_Bcast(path.data(), length, MPI_CHAR, 0, comm);
  return path;
}

/// Removes a sharedTempDir once every rank is done with it.
inline void removeSharedDir(MPI_Comm comm, const std::string& path) {
  MPI_Barrier(comm);
  if (commRank(comm) == 0 && !path.empty()) {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
}

/// Writes `count` random proteins (10..50 residues, seeded) as a plm dataset at `path` (rank 0).
inline void writeTinyDataset(const std::string& path, int count, std::uint64_t seed,
                             MPI_Comm comm) {
  if (commRank(comm) == 0) {
    std::mt19937_64 gen(seed);
    std::uniform_int_distribution<int> length(10, 50), residue(4, 23);
    io::SequenceShard shard;
    for (int i = 0; i < count; ++i) {
      const int n = length(gen);
      for (int k = 0; k < n; ++k) shard.tokens.push_back(std::uint8_t(residue(gen)));
      shard.lengths.push_back(n);
      shard.ids.push_back("seq" + std::to_string(i));
    }
    io::DatasetMetadata meta;
    meta.split = "train";
    meta.split_rule = "test";
    meta.plm_version = "test";
    meta.created_utc = "2026-01-01T00:00:00Z";
    io::writeDataset(path, MPI_COMM_SELF, shard, meta);
  }
  MPI_Barrier(comm);
}

/// The resolved deck of a tiny run in `dir`: data `dir`/train.h5, run dir `dir`/<run>,
/// checkpoints in `dir`/<run>/ckpt; `overrides` as `--set` gives them.
inline Teuchos::RCP<Teuchos::ParameterList> tinyDeck(
    const std::string& dir, const std::string& run,
    const std::vector<std::string>& overrides = {}) {
  std::ostringstream y;
  y << "model:\n  preset: custom\n  layers: 2\n  hidden: 32\n  heads: 4\n  ffn: 64\n"
    << "data:\n  train: " << dir << "/train.h5\n  valid: \"\"\n  tokens_per_batch: 4096\n"
    << "  micro_batch_tokens: 1024\n  max_seq_len: 40\n  seed: 7\n  prefetch: 1\n"
    << "optimizer:\n  lr: 3.0e-3\n  clip_grad_norm: 0.5\n"
    << "schedule:\n  warmup_steps: 2\n  decay: linear\n  decay_steps: 12\n"
    << "train:\n  steps: 6\n  log_every: 1\n  eval_every: 0\n  run_dir: " << dir << "/" << run
    << "\n  seed: 3\n"
    << "checkpoint:\n  dir: " << dir << "/" << run
    << "/ckpt\n  every: 3\n  keep: 3\n  resume: auto\n";
  return deck::resolve(*deck::readYamlString(y.str(), "tiny deck"), overrides);
}

/// Per-step losses of `metrics.jsonl` records of kind "train", as written (text, so equality is
/// bit-for-bit), keyed by step.
inline std::map<std::int64_t, std::string> metricsLosses(const std::string& path) {
  std::map<std::int64_t, std::string> out;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    if (line.find("\"kind\":\"train\"") == std::string::npos) continue;
    auto field = [&](const std::string& key) {
      const std::size_t at = line.find("\"" + key + "\":");
      const std::size_t start = at + key.size() + 3;
      return line.substr(start, line.find_first_of(",}", start) - start);
    };
    out[std::stoll(field("step"))] = field("loss");
  }
  return out;
}

/// Runs `body` on a communicator of world ranks 0..n-1; the others wait.
inline void onFirstRanks(int n, const std::function<void(MPI_Comm)>& body) {
  MPI_Comm sub = MPI_COMM_NULL;
  const int rank = dist::worldRank();
  MPI_Comm_split(MPI_COMM_WORLD, rank < n ? 0 : MPI_UNDEFINED, rank, &sub);
  if (sub != MPI_COMM_NULL) {
    body(sub);
    MPI_Comm_free(&sub);
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

/// One optimizer step of a run as the resume tests compare it.
struct StepRecord {
  std::int64_t step = 0, tokens = 0, masked = 0;
  double loss = 0;
};

/// Trains `deck` on `comm` with the checkpoint hooks installed; a record per step, and the
/// final data cursor if `final_cursor` is given.
inline std::vector<StepRecord> trainRecords(Teuchos::RCP<Teuchos::ParameterList> deck,
                                            MPI_Comm comm, data::Cursor* final_cursor = nullptr) {
  std::vector<StepRecord> records;
  train::Trainer t(deck, comm);
  train::Trainer::Hooks extra;
  extra.on_step = [&](train::Trainer& tr, const train::StepStats& s) {
    records.push_back({tr.state().step, s.tokens, s.masked, s.loss()});
  };
  ckpt::installHooks(t, extra);
  t.run();
  if (final_cursor) *final_cursor = t.state().cursor;
  return records;
}

/// The per-step losses of trainRecords.
inline std::vector<double> trainLosses(Teuchos::RCP<Teuchos::ParameterList> deck, MPI_Comm comm) {
  std::vector<double> losses;
  for (const auto& r : trainRecords(deck, comm)) losses.push_back(r.loss);
  return losses;
}

/// Thrown by a hook to stop a run as a kill would (after the step's checkpoint, if any).
struct Interrupted {};

}  // namespace plm::test
