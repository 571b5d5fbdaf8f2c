// Time as plm measures it: Unix seconds and ISO 8601 UTC as files record them, and monotonic
// seconds for durations.
#pragma once

#include <chrono>
#include <ctime>
#include <string>

namespace plm::clock {

/// \brief Seconds since the Unix epoch, now (system clock, sub-second resolution).
inline double unixSeconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

/// \brief Seconds on the monotonic clock (steady_clock), for durations: differences only.
inline double steadySeconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

/// \brief "2026-11-28T08:09:42Z" for `seconds` since the epoch (default: now).
inline std::string utcIso(double seconds = unixSeconds()) {
  const std::time_t t = static_cast<std::time_t>(seconds);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buffer[32];
  std::strftime(buffer, sizeof buffer, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buffer;
}

}  // namespace plm::clock
