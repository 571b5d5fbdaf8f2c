// What one checkpoint save writes, detached from the trainer: the three fp32 buffers in host
// memory and every attribute.  save() takes a snapshot and writes it at once; the asynchronous
// saver (ckpt/async.hpp) takes it between steps into buffers of its own and writes it from a
// background thread while the trainer changes its state.
#pragma once

#include "ckpt/detail/scaling.hpp"
#include "core/types.hpp"
#include "model/esm2.hpp"
#include "train/adamw.hpp"
#include "train/trainer.hpp"

#include <mpi.h>
#include <Kokkos_Core.hpp>

#include <cstdint>
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

/// Buffers an asynchronous saver owns and reuses from save to save (allocated once).
struct SnapshotBuffers {
  PinnedBuffer master, exp_avg, exp_avg_sq;  // (n)
};

struct Snapshot {
  train::TrainState state;
  model::Esm2Config config;
  std::vector<model::TensorInfo> tensors;
  std::int64_t optimizer_step = 0;
  train::AdamWOptions optimizer_options;
  std::int64_t micro_batches_per_step = 0;
  std::string dataset_path;
  std::int64_t dataset_sequences = 0, dataset_residues = 0;
  std::string deck_yaml;
  ScalingState scaling;  // FP8 scaling state (/scaling)
  // Host copies (sync on a GPU), or the optimizer's own buffers (sync on the CPU): kept alive.
  HostBuffer host_master, host_exp_avg, host_exp_avg_sq;
  // What the writer reads: host_* or an asynchronous saver's buffers.
  const float* master = nullptr;
  const float* exp_avg = nullptr;
  const float* exp_avg_sq = nullptr;
  double copy_seconds = 0;
};

/// \brief The trainer's state now.  With `buffers` the three fp32 buffers are copied into them
/// (allocated on first use), so the trainer may go on; without, the host views of the
/// optimizer's buffers are used (no copy at all on the CPU).
Snapshot takeSnapshot(train::Trainer& trainer, SnapshotBuffers* buffers);

/// \brief Collective over `comm`: writes `snapshot` as checkpoint `dir`/fileName(step),
/// atomically (checkpoint.hpp).  Touches only the snapshot, host memory, HDF5 and `comm`, so it
/// may run on a background thread (with MPI_THREAD_MULTIPLE and a communicator of its own).
SaveReport writeSnapshot(const Snapshot& snapshot, const std::string& dir, MPI_Comm comm);

}  // namespace plm::ckpt::detail
