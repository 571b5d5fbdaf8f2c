// Logging: rank 0 by default, every rank (prefixed with its rank) when the user asks
// (`PLM_LOG_ALL_RANKS=1` or `--log-all-ranks`).
#pragma once

#include <string>

namespace plm::log {

enum class Level { debug = 0, info = 1, warn = 2 };

/// \brief Set once by the driver after MPI is up.
void configure(int rank, bool all_ranks, Level level = Level::info);
bool allRanks();
int rank();

/// \brief printf-style message to stdout (info/debug) or stderr (warn), flushed.
void info(const char* format, ...) __attribute__((format(printf, 1, 2)));
void debug(const char* format, ...) __attribute__((format(printf, 1, 2)));
void warn(const char* format, ...) __attribute__((format(printf, 1, 2)));

/// \brief Also appends what this rank prints to `path` (e.g. <run_dir>/train.log); an empty
/// path stops. Returns false (and keeps printing to the terminal) when the file cannot be opened.
bool teeTo(const std::string& path);

/// \brief Writes `line` (and a line break) to stderr and to the tee file, unprefixed: the one
/// line a failing job leaves (core/failure.hpp).
void fatalLine(const std::string& line);

/// \brief Printed by every rank regardless of the all-ranks switch (prefixed with the rank).
void every(const char* format, ...) __attribute__((format(printf, 1, 2)));

}  // namespace plm::log
