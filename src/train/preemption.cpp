#include "train/preemption.hpp"

#include "core/error.hpp"

#include <unistd.h>
#include <atomic>
#include <csignal>
#include <cstring>

namespace plm::train {

namespace {

volatile std::sig_atomic_t received_signal = 0;
std::atomic<bool> installed{false};

// Only async-signal-safe calls here: write(2) and _exit(2).
void say(const char* text) {
  const ssize_t ignored = ::write(STDERR_FILENO, text, std::strlen(text));
  (void)ignored;
}

extern "C" void onStopSignal(int signal) {
  if (received_signal != 0) {
    say("plm: a second stop signal: exiting at once (the last complete checkpoint is kept)\n");
    ::_exit(128 + signal);
  }
  received_signal = signal;
  say(signal == SIGTERM ? "plm: received SIGTERM" : "plm: received SIGUSR1");
  say(": stopping after the current step with a checkpoint (a second signal exits at once)\n");
}

}  // namespace

void installStopSignals() {
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

void clearStopSignal() { received_signal = 0; }

const char* signalName(int signal) {
  switch (signal) {
    case SIGTERM: return "SIGTERM";
    case SIGUSR1: return "SIGUSR1";
    default: return "another rank's signal";
  }
}

}  // namespace plm::train
