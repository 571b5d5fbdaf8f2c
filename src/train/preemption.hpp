// Stopping a run cleanly when the batch system asks (doc/operations.md).
//
// Design choice: a signal handler may do almost nothing safely, so it only records the signal;
// the trainer looks at the record between steps, where every rank takes part in one small
// all-reduce (agreedStopSignal) so that all of them stop after the same step, write one checkpoint
// together and exit with exit_requeue.  A rank that got no signal (a batch system that signals
// one process, a `kill` by hand) stops with the others.
// One stop is often delivered several times: Slurm signals every task and srun, and the job
// script's trap forwards the signal to srun again.  So a further signal is taken as the same stop
// until the trainer has acted on the first (the step-boundary agreement), and never while a
// checkpoint is being written (SaveScope); after that it means "now": the handler exits at once
// (128 + signal, as a shell reports a death by signal; exit_requeue once the stop's checkpoint is
// complete), and the last complete checkpoint is what a restart resumes from.  When the process
// is ending on an error (its own or a peer's, core/failure.hpp), a signal is the launcher ending
// the job: the handler exits quietly.
#pragma once

#include <mpi.h>

namespace plm::train {

/// Exit status of `plm train` after a signal-triggered stop: the checkpoint of the last step is
/// written and the job should be requeued (jobscripts/ turn it into `scontrol requeue` or
/// `qrerun`).  75 is sysexits' EX_TEMPFAIL ("try again later").
inline constexpr int exit_requeue = 75;
/// Exit status when the watchdog ends a hung run (train.step_timeout) or NCCL reports an
/// asynchronous error; 124 is what timeout(1) returns.
inline constexpr int exit_watchdog = 124;

/// \brief Installs the handlers of SIGTERM and SIGUSR1 (idempotent): the first one received is
/// recorded (stopSignal) and announced on stderr (by rank 0, or every rank with
/// --log-all-ranks); another one before stopActedOn, or during a SaveScope, is the same stop;
/// after them it exits the process at once (status 128 + signal; exit_requeue after
/// stopSaved).
void installStopSignals();

/// \brief The trainer has agreed on the stop and is saving: a further signal may now count.
void stopActedOn();

/// \brief The stop's checkpoint is complete: a further signal exits with exit_requeue.
void stopSaved();

/// \brief While one lives (any thread), a checkpoint is being written: signals after the first
/// are ignored, so a repeated delivery never cuts a save short.
class SaveScope {
 public:
  SaveScope();
  ~SaveScope();
  SaveScope(const SaveScope&) = delete;
  SaveScope& operator=(const SaveScope&) = delete;
};

/// \brief The first stop signal this process received (SIGTERM, SIGUSR1), 0 if none.
int stopSignal();

/// \brief Collective over `comm`: the stop signal any rank has received (the largest signal
/// number when they differ), 0 when none has, the same on every rank.  One MPI_Allreduce of one
/// int: called once per step boundary.
int agreedStopSignal(MPI_Comm comm);

/// \brief Forgets a received signal and the stop's progress (tests run several trainings in
/// one process).
void clearStopSignal();

/// \brief "SIGTERM", "SIGUSR1", or "a stop signal".
const char* signalName(int signal);

}  // namespace plm::train
