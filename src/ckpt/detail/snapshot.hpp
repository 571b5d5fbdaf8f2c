// What one checkpoint save writes, detached from the trainer: this rank's rows of the fp32
// masters and of every optimizer state buffer (fp32 or 8-bit codes, by name) in host memory, and
// every attribute.  save() takes a snapshot and writes it at once; the asynchronous saver
// (ckpt/async.hpp) takes it between steps and writes it from a background thread while the
// trainer changes its state.
//
// Two paths fill it, and statePath() alone chooses:
//  - FullLayout: the whole-model optimizer (Trainer::optimizer(); a sharded run gathers it from
//    the shards for the save: 12 N bytes for AdamW), whose host view the writer reads each
//    rank's rows from (on the CPU without a copy).
//  - Shards (parallel.shard_degree > 1): no full-layout state at all.  Each rank's rows of each
//    group are moved out of the shards of its own shard group by one all-to-all-v per batch of
//    tensors (detail::redistribute) into a compact buffer of those rows only (4 N / world bytes
//    per fp32 group); per-tensor replicated state (Adafactor's factors, 8-bit block scales) is
//    identical on every rank, so each rank copies its rows of it.
#pragma once

#include "ckpt/detail/rows.hpp"
#include "ckpt/detail/scaling.hpp"
#include "core/types.hpp"
#include "model/esm2.hpp"
#include "train/optim/optimizer.hpp"
#include "train/trainer.hpp"

#include <mpi.h>
#include <Kokkos_Core.hpp>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace plm::ckpt::detail {

#if defined(KOKKOS_ENABLE_CUDA)
using PinnedSpace = Kokkos::CudaHostPinnedSpace;  // device -> host copies at full PCIe speed
#else
using PinnedSpace = Kokkos::HostSpace;
#endif
using HostBuffer = Kokkos::View<float*, Kokkos::HostSpace>;
using PinnedBuffer = Kokkos::View<float*, PinnedSpace>;
using PinnedBytes = Kokkos::View<std::uint8_t*, PinnedSpace>;

/// Buffers an asynchronous saver owns and reuses from save to save (allocated once).
struct SnapshotBuffers {
  PinnedBuffer master;                         // (n)
  std::map<std::string, PinnedBuffer> floats;  // optimizer state by name
  std::map<std::string, PinnedBytes> bytes;
};

/// One optimizer state buffer in host memory, as /optimizer/<name> stores it.
struct SnapshotState {
  std::string name;
  bool bytes = false;                    // uint8 codes, else fp32
  std::vector<model::TensorInfo> table;  // datasets: name, full shape, offset into `data`
  RowsLayout rows;                       // where this rank's rows of each dataset lie in `data`
  Kokkos::View<float*, Kokkos::HostSpace> host_f32;  // kept alive (synchronous saves)
  Kokkos::View<std::uint8_t*, Kokkos::HostSpace> host_u8;
  const void* data = nullptr;
};

struct Snapshot {
  train::TrainState state;
  model::Esm2Config config;
  std::vector<model::TensorInfo> tensors;
  std::int64_t optimizer_step = 0;
  std::string optimizer_kind;                          // optimizer.name
  std::map<std::string, double> optimizer_attributes;  // its hyper-parameters
  std::vector<SnapshotState> optimizer_state;
  std::int64_t micro_batches_per_step = 0;
  std::string dataset_path;
  std::int64_t dataset_sequences = 0, dataset_residues = 0;
  std::string deck_yaml;
  ScalingState scaling;  // FP8 scaling state (/scaling)
  // Host copies (sync on a GPU), or the optimizer's own buffers (sync on the CPU): kept alive.
  HostBuffer host_master;
  // What the writer reads: host_master or an asynchronous saver's buffer.
  const float* master = nullptr;
  RowsLayout master_rows;  // where this rank's rows of each tensor lie in `master`
  double copy_seconds = 0;
};

/// How a save or a load moves the optimizer state (see the file comment).
enum class StatePath { FullLayout, Shards };

/// \brief THE choice of path for `trainer`: Shards for every sharded run (every optimizer kind:
/// elementwise state moves with redistribute, replicated state is written from each rank's
/// own copy), FullLayout otherwise (data parallelism: the optimizer's buffers are whole).
StatePath statePath(train::Trainer& trainer);
const char* statePathName(StatePath path);

/// \brief The trainer's state now.  FullLayout: with `buffers` the master and state buffers are
/// copied into them (allocated on first use), so the trainer may go on; without, the host views
/// of the optimizer's buffers are used (no copy at all on the CPU).  Shards: compact buffers of
/// this rank's rows, allocated per save (`buffers` unused).  Collective over trainer.comm().
Snapshot takeSnapshot(train::Trainer& trainer, SnapshotBuffers* buffers);
/// \brief takeSnapshot along `path` (tests compare the two paths; Shards needs a sharded run).
Snapshot takeSnapshot(train::Trainer& trainer, SnapshotBuffers* buffers, StatePath path);

/// \brief Collective over `comm`: writes `snapshot` as checkpoint `dir`/fileName(step),
/// atomically (checkpoint.hpp).  Touches only the snapshot, host memory, HDF5 and `comm`, so it
/// may run on a background thread (with MPI_THREAD_MULTIPLE and a communicator of its own).
SaveReport writeSnapshot(const Snapshot& snapshot, const std::string& dir, MPI_Comm comm);

}  // namespace plm::ckpt::detail
