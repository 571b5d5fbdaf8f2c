// Asynchronous health checks of the communicators (NCCL's ncclCommGetAsyncError), polled by
// the trainer's watchdog thread (train/watchdog.hpp).
//
// Design choice: a registry rather than a pointer to each communicator, so the watchdog needs
// to know nothing of the backends: a communicator that can fail asynchronously registers a check
// when it is built and removes it when it is destroyed; the registry's mutex is held while a
// check runs, so a communicator is never destroyed under a running check.
#pragma once

#include <functional>
#include <string>

namespace plm::dist {

/// Returns "" while healthy, else what went wrong (e.g. the NCCL error string).  Must be safe to
/// call from another thread than the one using the communicator.
using HealthCheck = std::function<std::string()>;

/// \brief Registers `check`; returns its id for removeHealthCheck.
int addHealthCheck(HealthCheck check);
/// \brief Removes a check (waits for a running poll to finish).
void removeHealthCheck(int id);
/// \brief Runs every registered check; the first problem found, or "".
std::string pollHealth();

}  // namespace plm::dist
