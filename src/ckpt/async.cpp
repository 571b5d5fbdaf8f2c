#include "ckpt/async.hpp"

#include "core/clock.hpp"
#include "core/log.hpp"
#include "train/preemption.hpp"

#include <chrono>

namespace plm::ckpt {

AsyncSaver::AsyncSaver(MPI_Comm comm) { PLM_CHECK_MPI(MPI_Comm_dup(comm, &comm_member)); }

AsyncSaver::~AsyncSaver() {
  try {
    wait();
  } catch (const std::exception& e) {
    log::warn("checkpoint: the background save failed: %s", e.what());
  }
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized && comm_member != MPI_COMM_NULL) MPI_Comm_free(&comm_member);
}

double AsyncSaver::start(train::Trainer& trainer, const std::string& dir, int keep) {
  const double t0 = clock::steadySeconds();
  wait();
  snapshot_member = detail::takeSnapshot(trainer, &buffers_member);
  keep_member = keep;
  done_member = false;
  error_member = nullptr;
  thread_member = std::thread([this, dir] {
    const train::SaveScope saving;  // a repeated stop signal does not cut the write short
    try {
      report_member = detail::writeSnapshot(snapshot_member, dir, comm_member);
      pruned_member = prune(dir, keep_member, comm_member);
    } catch (...) {
      error_member = std::current_exception();
    }
    done_member = true;
  });
  return clock::steadySeconds() - t0;
}

void AsyncSaver::join() {
  thread_member.join();
  if (error_member) {
    std::exception_ptr e = error_member;
    error_member = nullptr;
    std::rethrow_exception(e);
  }
  const SaveReport& r = report_member;
  finished_member = Finished{snapshot_member.state.step, r};
  log::info(
      "checkpoint: step %lld saved to %s in the background: %.1f MB in %.2f s (%.0f MB/s; "
      "snapshot %.2f s, write %.2f s, flush/rename %.2f s)",
      static_cast<long long>(snapshot_member.state.step), r.path.c_str(), double(r.bytes) / 1e6,
      r.seconds, r.megabytesPerSecond(), r.copy_seconds, r.write_seconds, r.sync_seconds);
  for (const auto& removed : pruned_member)
    log::info("checkpoint: removed %s (checkpoint.keep: %d)", removed.c_str(), keep_member);
  pruned_member.clear();
}

void AsyncSaver::wait() {
  if (thread_member.joinable()) join();
}

void AsyncSaver::poll() {
  if (thread_member.joinable() && done_member) join();
}

}  // namespace plm::ckpt
