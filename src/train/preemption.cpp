#include "train/preemption.hpp"

#include "core/error.hpp"
#include "core/failure.hpp"
#include "core/log.hpp"

#include <unistd.h>
#include <atomic>
#include <csignal>
#include <cstring>

namespace plm::train {

namespace {

volatile std::sig_atomic_t received_signal = 0;
volatile std::sig_atomic_t acted_on = 0;    // the trainer agreed on the stop
volatile std::sig_atomic_t stop_saved = 0;  // and its checkpoint is complete
volatile std::sig_atomic_t announce = 1;    // this rank prints the first signal
std::atomic<int> saving{0};                 // saves in progress (any thread)
static_assert(std::atomic<int>::is_always_lock_free, "the handler reads `saving`");
std::atomic<bool> installed{false};

// Only async-signal-safe calls here: write(2) and _exit(2).
void say(const char* text) {
  const ssize_t ignored = ::write(STDERR_FILENO, text, std::strlen(text));
  (void)ignored;
}

extern "C" void onStopSignal(int signal) {
  if (failure::ending()) ::_exit(failure::peerFailed() ? failure::peerStatus() : 1);
  if (received_signal == 0) {
    received_signal = signal;
    if (announce)  // one write: a line of its own beside the job script's
      say(signal == SIGTERM
              ? "plm: received SIGTERM: stopping after the current step with a checkpoint\n"
              : "plm: received SIGUSR1: stopping after the current step with a checkpoint\n");
    return;
  }
  // The same stop delivered again (every task, srun, the job script's trap), or a save that
  // must not be cut short.
  if (!acted_on || saving.load() > 0) return;
  if (stop_saved) {
    say("plm: another stop signal: the stop's checkpoint is complete; exiting now\n");
    ::_exit(exit_requeue);
  }
  say("plm: a second stop signal: exiting at once (the last complete checkpoint is kept)\n");
  ::_exit(128 + signal);
}

}  // namespace

void installStopSignals() {
  announce = log::rank() == 0 || log::allRanks();
  if (installed.exchange(true)) return;
  struct sigaction action;
  std::memset(&action, 0, sizeof action);
  action.sa_handler = onStopSignal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;  // a read or write interrupted by the signal goes on
  for (int signal : {SIGTERM, SIGUSR1})
    PLM_CHECK_SYS(::sigaction(signal, &action, nullptr) == 0, "sigaction");
}

int stopSignal() { return received_signal; }

int agreedStopSignal(MPI_Comm comm) {
  int local = received_signal, any = 0;
  PLM_CHECK_MPI(MPI_Allreduce(&local, &any, 1, MPI_INT, MPI_MAX, comm));
  return any;
}

void stopActedOn() { acted_on = 1; }

void stopSaved() { stop_saved = 1; }

SaveScope::SaveScope() { saving.fetch_add(1); }
SaveScope::~SaveScope() { saving.fetch_sub(1); }

void clearStopSignal() {
  received_signal = 0;
  acted_on = 0;
  stop_saved = 0;
}

const char* signalName(int signal) {
  switch (signal) {
    case SIGTERM: return "SIGTERM";
    case SIGUSR1: return "SIGUSR1";
    default: return "another rank's signal";
  }
}

}  // namespace plm::train
