// Measured memory: the bytes of every Kokkos allocation (any memory space: host on the CPU
// build, device and pinned host on CUDA), in use and at the high-water mark.  The model's
// buffers, the shards, the optimizer state, the gathered layers and the activation workspace
// are all Kokkos Views, so this is the measured counterpart of `plm plan`'s memory table
// (doc/plan.md), without the process's own overhead that the resident set size carries.
//
// Design choice: Kokkos Tools' allocation callbacks, installed only when no Kokkos tool
// library is loaded (it owns the callbacks): then active() is false and callers fall back to
// train::memoryInUse().  Frees of allocations made before start() are ignored.
#pragma once

#include <cstdint>

namespace plm::train {

class AllocationTracker {
 public:
  /// \brief Starts counting (idempotent); false when a Kokkos tool library owns the callbacks.
  static bool start();
  /// \brief Stops counting (the callbacks are removed; no cost per allocation afterwards).
  static void stop();
  static bool active();
  /// \brief Bytes allocated since start() and not yet freed.
  static std::int64_t inUse();
  /// \brief The largest inUse() since start() or the last resetPeak().
  static std::int64_t peak();
  /// \brief The largest single allocation since start() or the last resetPeak() (a whole-model
  /// buffer shows here even when freed at once).
  static std::int64_t largest();
  static void resetPeak();
};

}  // namespace plm::train
