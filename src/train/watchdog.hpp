// The hang detector of a training run (doc/operations.md, "A hung job").
//
// Design choice: a thread per rank that owns nothing but a deadline.  The trainer arms it when a
// step (or an evaluation, or a checkpoint save) begins and disarms it when it ends; the step's
// code marks the phase or collective it enters (core/phase.hpp).  When the deadline passes, the
// rank prints one line -- rank, host, step, phase, how long -- waits a few seconds so that the
// other ranks, stuck in the same step, print theirs, and exits with exit_watchdog; the launcher
// (mpiexec, srun) then ends the job.  No collective is involved, so a hung collective cannot
// stop the report.  The same thread polls the communicators' asynchronous errors
// (dist/health.hpp: ncclCommGetAsyncError) and reports them the same way.
//
// The limit: train.step_timeout seconds when set; else 20 x the median step time of this run
// (the last 100 steps) once warm_up_steps steps have finished, and never less than 5 minutes;
// during warm-up (compilation, autotuning, NCCL set-up) 30 minutes.  Evaluations and saves get
// max(limit, 30 minutes).
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <thread>

namespace plm::train {

struct WatchdogOptions {
  double fixed_timeout = 0;  // seconds; 0 = automatic (see the file comment)
  double minimum_timeout = 300;
  double warm_up_timeout = 1800;
  double factor = 20;
  int warm_up_steps = 10;
  double grace = 3;  // seconds between the report and the exit (the other ranks report)
};

class Watchdog {
 public:
  Watchdog(WatchdogOptions options, int rank);
  ~Watchdog();
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  /// \brief Arms the deadline for `step`; `long_task` (evaluation, checkpoint save) gets
  /// max(limit, warm-up limit).  `what` is a string literal naming the task.
  void arm(std::int64_t step, const char* what, bool long_task = false);
  /// \brief Disarms; a finished step (long_task false) adds `seconds` to the median's window.
  void disarm(double seconds);
  /// \brief The limit the next step gets, in seconds.
  double stepLimit() const;

 private:
  void loop();
  [[noreturn]] void fail(const std::string& why);

  WatchdogOptions options_member;
  int rank_member;
  std::string host_member;
  mutable std::mutex mutex_member;
  std::condition_variable wake_member;
  bool stop_member = false;
  bool armed_member = false;
  std::int64_t step_member = 0;
  const char* what_member = "";
  bool counts_member = false;  // a step: its time joins the median's window
  double limit_member = 0;
  std::chrono::steady_clock::time_point start_member;
  std::deque<double> recent_member;  // step seconds, newest last (at most 100)
  std::int64_t finished_member = 0;
  std::thread thread_member;
};

}  // namespace plm::train
