#include "core/log.hpp"

#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace plm::log {

namespace {
int rank_state = 0;
bool all_ranks_state = false;
Level level_state = Level::info;
FILE* tee_state = nullptr;

void emit(FILE* stream, const char* tag, const char* format, va_list args, bool force) {
  if (!force && !all_ranks_state && rank_state != 0) return;
  for (FILE* out : {stream, tee_state}) {
    if (!out) continue;
    va_list copy;
    va_copy(copy, args);
    if (all_ranks_state || force) std::fprintf(out, "[rank %d] ", rank_state);
    if (tag) std::fputs(tag, out);
    std::vfprintf(out, format, copy);
    std::fputc('\n', out);
    std::fflush(out);
    va_end(copy);
  }
}
}  // namespace

void configure(int rank, bool all_ranks, Level level) {
  rank_state = rank;
  const char* env = std::getenv("PLM_LOG_ALL_RANKS");
  all_ranks_state = all_ranks || (env && std::strcmp(env, "0") != 0 && *env);
  level_state = level;
}
bool allRanks() { return all_ranks_state; }
bool teeTo(const std::string& path) {
  if (tee_state) std::fclose(tee_state);
  tee_state = path.empty() ? nullptr : std::fopen(path.c_str(), "a");
  return path.empty() || tee_state;
}
int rank() { return rank_state; }
void fatalLine(const std::string& line) {
  for (FILE* out : {stderr, tee_state}) {
    if (!out) continue;
    std::fprintf(out, "%s\n", line.c_str());
    std::fflush(out);
  }
}

void info(const char* format, ...) {
  if (level_state > Level::info) return;
  va_list args;
  va_start(args, format);
  emit(stdout, nullptr, format, args, false);
  va_end(args);
}
void debug(const char* format, ...) {
  if (level_state > Level::debug) return;
  va_list args;
  va_start(args, format);
  emit(stdout, "debug: ", format, args, false);
  va_end(args);
}
void warn(const char* format, ...) {
  va_list args;
  va_start(args, format);
  emit(stderr, "warning: ", format, args, false);
  va_end(args);
}
void every(const char* format, ...) {
  va_list args;
  va_start(args, format);
  emit(stdout, nullptr, format, args, true);
  va_end(args);
}

}  // namespace plm::log
