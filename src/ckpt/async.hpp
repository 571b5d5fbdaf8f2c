// checkpoint.async: saves written by a background thread while training goes on
// (doc/checkpoints.md, "Asynchronous saves"; doc/operations.md).
//
// Design choice: the training step only pays for a copy of the three fp32 buffers into host
// memory (pinned on a GPU, allocated once and reused), taken between steps; everything after it
// -- the HDF5 file, the CRCs, the flush, the atomic rename, the pruning -- is the same code as a
// synchronous save (detail::writeSnapshot), run on a thread of its own over a communicator of
// its own (an MPI_Comm_dup, so its collectives never meet the training's; MPI must grant
// MPI_THREAD_MULTIPLE).  At most one save is in flight: the next one, the final one, a stop
// signal's and a rollback first wait for it.  A kill during a background write leaves what a
// kill during a synchronous one leaves: the previous checkpoints and a .tmp file.  HDF5 is
// not thread-safe here, so nothing else may call HDF5 while a write is in flight: the trainer's
// loaders read the dataset's tokens with pread (plm prep datasets), and every other HDF5 use
// (loads, the final model file) comes after wait().
#pragma once

#include "ckpt/checkpoint.hpp"
#include "ckpt/detail/snapshot.hpp"

#include <mpi.h>

#include <atomic>
#include <exception>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace plm::ckpt {

class AsyncSaver {
 public:
  /// \brief Collective over `comm`: duplicates it for the writer.
  explicit AsyncSaver(MPI_Comm comm);
  /// \brief Waits for a save in flight (errors are logged, not thrown) and frees the duplicate.
  ~AsyncSaver();
  AsyncSaver(const AsyncSaver&) = delete;
  AsyncSaver& operator=(const AsyncSaver&) = delete;

  /// \brief Waits for the previous save, snapshots the trainer into the saver's host buffers
  /// and starts writing `dir`/fileName(step) (then pruning to `keep`) in the background.
  /// Returns the seconds the trainer was held (the wait and the copy).
  double start(train::Trainer& trainer, const std::string& dir, int keep);
  /// \brief Blocks until no save is in flight; logs the finished save; rethrows its error.
  void wait();
  /// \brief Like wait() when the save in flight has finished; never blocks.
  void poll();
  bool inFlight() const { return thread_member.joinable(); }

  /// A save that finished since the last call (wait/poll joined it): its step and report.
  struct Finished {
    std::int64_t step = -1;
    SaveReport report;
  };
  /// \brief The save wait() or poll() completed since the last call, if any.
  std::optional<Finished> takeFinished() { return std::exchange(finished_member, std::nullopt); }

 private:
  void join();

  MPI_Comm comm_member = MPI_COMM_NULL;
  detail::SnapshotBuffers buffers_member;
  detail::Snapshot snapshot_member;
  std::thread thread_member;
  std::atomic<bool> done_member{false};
  std::exception_ptr error_member;
  SaveReport report_member;
  std::vector<std::string> pruned_member;
  int keep_member = 0;
  std::optional<Finished> finished_member;
};

}  // namespace plm::ckpt
