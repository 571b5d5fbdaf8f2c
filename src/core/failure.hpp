// How a job ends when one rank fails: one line, every rank gone within seconds.
//
// Design choice: a rank that fails alone cannot reach the others through the collectives they
// are blocked in, and MPI_Abort prints a banner of its own and makes the launcher SIGTERM every
// rank (which plm train would announce as a stop signal).  So each process keeps one receive
// posted on a private duplicate of MPI_COMM_WORLD, polled by a small thread: the failing rank
// prints its one line, sends it to every other rank there and leaves with _exit; a rank that
// receives it knows the job is failing and that the line is printed, keeps quiet (its stop-signal
// handler too) and leaves on its own after a short grace if the launcher has not ended it first.
// No destructor runs on this path: unwinding would close parallel files, free NCCL communicators
// and join save threads, each of which may wait for the rank that failed.
//
// The channel needs MPI_THREAD_MULTIPLE and more than one rank; without them a failing rank still
// prints one line and exits, and the launcher ends the others.
#pragma once

#include <exception>
#include <string>

namespace plm::failure {

/// \brief Opens the channel over MPI_COMM_WORLD (collective; dist::Runtime calls it after
/// MPI_Init when the thread level allows it).  `grace_seconds`: how long a rank told of a peer's
/// failure waits for the launcher before it exits by itself.
void start(double grace_seconds = 3.0);

/// \brief Closes the channel (before MPI_Finalize; idempotent, local).
void stop();

/// \brief Whether another rank has reported its failure to this one (async-signal-safe).
bool peerFailed();

/// \brief The exit status a reported failure asked for (1 when none was reported).
int peerStatus();

/// \brief Whether this process is ending on a failure, its own or a peer's (async-signal-safe):
/// a stop signal then is the launcher ending the job, not a request to checkpoint.
bool ending();

/// \brief One line from an exception's message: line breaks become "; ", Kokkos' traceback
/// note is dropped, and a Kokkos allocation failure becomes an out-of-memory message that names
/// the label, the size and what to change (and the run's memory plan, see setPlanNote).
std::string describe(const std::exception_ptr& error);

/// \brief What the run planned per rank, quoted by out-of-memory messages ("the plan for this
/// run: 41.2 GiB per rank").  Empty: none.
void setPlanNote(const std::string& note);

/// \brief This rank failed alone: unless a peer's failure was reported first (then this one is
/// taken for its consequence and stays quiet), prints "plm: error on rank R: message" (the
/// lowest of several ranks failing at once speaks), tells the other ranks, and exits with
/// `code` without unwinding.
/// `quiet`: another rank prints the same error; this one only leaves (after a peer's report,
/// or two seconds).
[[noreturn]] void failRank(const std::string& message, int code = 1, bool quiet = false);

/// \brief Every rank reached the same error: rank 0 prints it, every rank finalizes MPI and
/// exits with `code` (without unwinding).  Rank 0 also tells the others as failRank does, and a
/// finalize that does not return within 30 s (a rank that raised it alone: a bug) exits anyway.
[[noreturn]] void failAll(const std::string& message, int code = 1);

/// \brief std::terminate handler that routes an exception nobody caught to failAll (a
/// collective plm::Error) or failRank (anything else).  Uncaught, the exception leaves the stack
/// as it was (the Itanium ABI unwinds only towards a handler), so nothing is destroyed first.
[[noreturn]] void onTerminate();

}  // namespace plm::failure
