// Test fault hooks: the environment variables through which the crash, stall and non-finite
// tests make plm fail on purpose.  They are read here and nowhere else (doc/environment.md lists
// them).  The trainer reads its hooks when it is built (a test process may build several
// trainers, each with its own setting); the checkpoint hook is read once.
//
// Design choice: the hooks stay environment variables, not deck keys, because a test must be
// able to break a run without changing what the run writes to run/deck.yaml.
#pragma once

#include <cstdint>
#include <set>
#include <string>

namespace plm::fault {

/// \brief PLM_CKPT_FAIL_AT=<step>:<phase>: every rank _exit(86)s at that point of the save of
/// that step, as a kill would (nothing flushed, no destructors).  Phases: model (after /model),
/// optimizer (after the first /optimizer state group), flush (file complete and flushed, not
/// yet renamed).
void checkpointFailPoint(std::int64_t step, const char* phase);

/// \brief PLM_TEST_NONFINITE=<step>[,<step>...]: the steps whose gradient gets a NaN.
std::set<std::int64_t> nonfiniteSteps();

/// \brief PLM_TEST_STALL=<step>:<seconds>[:<rank>]: that rank (every rank when none is given)
/// sleeps before that step's forward pass.  step is -1 when unset.
struct Stall {
  std::int64_t step = -1;
  double seconds = 0;
  int rank = -1;
};
Stall stall();

/// \brief PLM_TEST_FAIL=<step>:<rank>:error|oom: that rank throws (error) or makes a real 1 PiB
/// allocation (oom) inside that step, after its gradients, while the others go on into the
/// step's collectives.  step is -1 when unset; a malformed value is a collective error.
struct Fail {
  std::int64_t step = -1;
  int rank = 0;
  bool oom = false;
};
Fail fail();

/// \brief PLM_TEST_FAIL_AFTER_BYTES=N: a dataset write stops, on every rank at the same round,
/// once N token bytes are in the file, as a kill would.  -1 when unset.
std::int64_t datasetFailAfterBytes();

}  // namespace plm::fault
