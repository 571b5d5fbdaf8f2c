// Stopping a run cleanly when the batch system asks (doc/operations.md).
//
// Design choice: a signal handler may do almost nothing safely, so it only records the signal;
// the trainer looks at the record between steps, where every rank takes part in one small
// all-reduce (agreedStopSignal) so that all of them stop after the same step, write one checkpoint
// together and exit with exit_requeue.  A rank that got no signal (a batch system that signals
// one process, a `kill` by hand) stops with the others.  A second signal means "now": the
// handler exits the process at once (128 + signal, as a shell reports a death by signal), and
// the last complete checkpoint is what a restart resumes from.
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
/// recorded (stopSignal) and announced on stderr; a second one exits the process at once with
/// status 128 + signal.
void installStopSignals();

/// \brief The first stop signal this process received (SIGTERM, SIGUSR1), 0 if none.
int stopSignal();

/// \brief Collective over `comm`: the stop signal any rank has received (the largest signal
/// number when they differ), 0 when none has, the same on every rank.  One MPI_Allreduce of one
/// int: called once per step boundary.
int agreedStopSignal(MPI_Comm comm);

/// \brief Forgets a received signal (tests run several trainings in one process).
void clearStopSignal();

/// \brief "SIGTERM", "SIGUSR1", or "a stop signal".
const char* signalName(int signal);

}  // namespace plm::train
