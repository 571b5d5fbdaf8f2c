// What this rank is doing right now, for the watchdog's report of a hang (train/watchdog.hpp).
//
// Design choice: one process-wide atomic pointer to a string literal.  Setting it costs one
// relaxed store, so the step may mark every collective it enters; the watchdog thread reads it
// only when it reports.  Names are literals (static storage), never built strings.
#pragma once

#include <atomic>

namespace plm::phase {

namespace detail {
inline std::atomic<const char*>& slot() {
  static std::atomic<const char*> current{"start-up"};
  return current;
}
}  // namespace detail

/// \brief Marks what this rank does from now on; `name` must be a string literal.
inline void set(const char* name) { detail::slot().store(name, std::memory_order_relaxed); }
/// \brief The last name set (any thread may ask).
inline const char* current() { return detail::slot().load(std::memory_order_relaxed); }

/// \brief Sets `name` for a scope and restores the previous phase when it ends.
class Scope {
 public:
  explicit Scope(const char* name) : previous_member(current()) { set(name); }
  ~Scope() { set(previous_member); }
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;

 private:
  const char* previous_member;
};

}  // namespace plm::phase
