#include "core/failure.hpp"

#include "core/error.hpp"
#include "core/log.hpp"
#include "core/world.hpp"

#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <new>
#include <thread>
#include <vector>

namespace plm::failure {

namespace {

using Clock = std::chrono::steady_clock;

constexpr int channel_tag = 7301;
constexpr int message_bytes = 2048;

MPI_Comm channel = MPI_COMM_NULL;
MPI_Request posted = MPI_REQUEST_NULL;
char inbox[message_bytes];
std::thread monitor;
std::atomic<bool> stopping{false};
double grace_seconds = 3.0;
volatile std::sig_atomic_t peer_failed = 0;
volatile std::sig_atomic_t peer_status = 1;
volatile std::sig_atomic_t self_failing = 0;
std::atomic<bool> fatal_taken{false};
std::mutex note_mutex;
std::string plan_note;

void pause(double seconds) { std::this_thread::sleep_for(std::chrono::duration<double>(seconds)); }

[[noreturn]] void leave(int code) {
  std::fflush(nullptr);
  ::_exit(code);
}

// The monitor: waits for a peer's report; after it, gives the launcher `grace_seconds` to end
// this process (its stop-signal handler stays quiet meanwhile), then ends it itself.
void watch() {
  while (!stopping.load()) {
    int done = 0;
    if (MPI_Test(&posted, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS) return;
    if (done) {
      inbox[message_bytes - 1] = 0;
      const int code = std::atoi(inbox);
      peer_status = code > 0 && code < 256 ? code : 1;
      peer_failed = 1;
      break;
    }
    pause(0.02);
  }
  if (!peer_failed) return;
  const auto until = Clock::now() + std::chrono::duration<double>(grace_seconds);
  while (!stopping.load() && Clock::now() < until) pause(0.02);
  if (stopping.load()) return;
  leave(peer_status);
}

// Sends "<code> <message>" to every other rank; waits at most a second for the sends.
void notifyPeers(const std::string& message, int code) {
  if (channel == MPI_COMM_NULL) return;
  static std::string out;
  out = std::to_string(code) + " " + message;
  if (out.size() >= message_bytes) out.resize(message_bytes - 1);
  const int me = worldRank(), n = worldSize();
  std::vector<MPI_Request> sends;
  for (int q = 0; q < n; ++q) {
    if (q == me) continue;
    MPI_Request r;
    if (MPI_Isend(out.c_str(), static_cast<int>(out.size()) + 1, MPI_CHAR, q, channel_tag, channel,
                  &r) == MPI_SUCCESS)
      sends.push_back(r);
  }
  const auto until = Clock::now() + std::chrono::seconds(1);
  int done = 0;
  while (!done && Clock::now() < until) {
    if (MPI_Testall(static_cast<int>(sends.size()), sends.data(), &done, MPI_STATUSES_IGNORE) !=
        MPI_SUCCESS)
      break;
    if (!done) pause(0.005);
  }
}

std::string trimmed(std::string s) {
  while (!s.empty() && (s.back() == ' ' || s.back() == ';' || s.back() == '.' || s.back() == '\n' ||
                        s.back() == '\t'))
    s.pop_back();
  std::size_t start = 0;
  while (start < s.size() && (s[start] == ' ' || s[start] == '\n')) ++start;
  return s.substr(start);
}

std::string oneLine(const std::string& text) {
  std::string out;
  std::size_t at = 0;
  while (at <= text.size()) {
    std::size_t end = text.find('\n', at);
    if (end == std::string::npos) end = text.size();
    std::string line = trimmed(text.substr(at, end - at));
    if (!line.empty() && line.find("Traceback functionality not available") == std::string::npos)
      out += (out.empty() ? "" : "; ") + line;
    at = end + 1;
  }
  std::string squeezed;
  for (char c : out)
    if (!(c == ' ' && !squeezed.empty() && squeezed.back() == ' ')) squeezed += c;
  return squeezed;
}

std::string between(const std::string& text, const std::string& open, const std::string& close) {
  const std::size_t a = text.find(open);
  if (a == std::string::npos) return "";
  const std::size_t b = text.find(close, a + open.size());
  if (b == std::string::npos) return "";
  return text.substr(a + open.size(), b - a - open.size());
}

std::string advice() {
  std::string note;
  {
    std::lock_guard<std::mutex> lock(note_mutex);
    note = plan_note;
  }
  return "lower data.micro_batch_tokens, set model.recompute: layer (or selective), or spread "
         "the model over more ranks (parallel.shard_degree; parallel.expert_degree for MoE)" +
         (note.empty() ? std::string("") : "; " + note) +
         "; `plm plan DECK` gives the bytes per rank";
}

// Kokkos' allocation failure ("Kokkos failed to allocate memory for label "X".  Allocation
// using MemorySpace named "Cuda" failed with the following error:  Allocation of size 28.18 G
// failed, likely due to insufficient memory. ...") as what did not fit and what to change.
std::string outOfMemory(const std::string& text) {
  const std::string label = between(text, "for label \"", "\"");
  std::string size = between(text, "Allocation of size ", " failed");
  const std::string space = between(text, "MemorySpace named \"", "\"");
  if (size.empty()) size = "an unknown size";
  return "out of memory: " + (space.empty() ? std::string("an") : "the " + space) +
         " allocation `" + label + "` of " + size + " did not fit; " + advice();
}

}  // namespace

void start(double grace) {
  if (channel != MPI_COMM_NULL || !mpiUp() || worldSize() < 2) return;
  int provided = MPI_THREAD_SINGLE;
  MPI_Query_thread(&provided);
  if (provided < MPI_THREAD_MULTIPLE) return;
  grace_seconds = grace;
  PLM_CHECK_MPI(MPI_Comm_dup(MPI_COMM_WORLD, &channel));
  PLM_CHECK_MPI(
      MPI_Irecv(inbox, message_bytes, MPI_CHAR, MPI_ANY_SOURCE, channel_tag, channel, &posted));
  stopping = false;
  monitor = std::thread(watch);
}

void stop() {
  if (channel == MPI_COMM_NULL) return;
  stopping = true;
  if (monitor.joinable()) monitor.join();
  if (posted != MPI_REQUEST_NULL && mpiUp()) {
    MPI_Cancel(&posted);
    MPI_Wait(&posted, MPI_STATUS_IGNORE);
  }
  channel = MPI_COMM_NULL;  // freed by MPI_Finalize (MPI_Comm_free would be a collective)
}

bool peerFailed() { return peer_failed != 0; }
int peerStatus() { return peer_status; }
bool ending() { return peer_failed != 0 || self_failing != 0; }

void setPlanNote(const std::string& note) {
  std::lock_guard<std::mutex> lock(note_mutex);
  plan_note = note;
}

std::string describe(const std::exception_ptr& error) {
  if (!error) return "internal error: the program ended without an exception to report (a bug)";
  std::string text;
  bool internal = false;
  try {
    std::rethrow_exception(error);
  } catch (const Error& e) {
    text = e.what();
  } catch (const std::bad_alloc&) {
    return "out of host memory (std::bad_alloc); " + advice();
  } catch (const std::exception& e) {
    text = e.what();
    internal = true;
  } catch (...) {
    return "internal error: an exception of unknown type";
  }
  if (text.find("failed to allocate memory for label") != std::string::npos)
    return outOfMemory(text);
  std::string line = oneLine(text);
  if (line.find("cudaErrorMemoryAllocation") != std::string::npos ||
      line.find("CUBLAS_STATUS_ALLOC_FAILED") != std::string::npos ||
      line.find("ncclSystemError") != std::string::npos)
    line += "; if the GPU is out of memory: " + advice();
  return internal ? "internal error: " + line : line;
}

void failRank(const std::string& message, int code, bool quiet) {
  self_failing = 1;
  if (fatal_taken.exchange(true)) {  // another thread of this rank is already ending it
    pause(10);
    leave(code);
  }
  const bool channel_open = channel != MPI_COMM_NULL;
  // Ranks that fail at once (the same bad file on every rank) print one line: the lowest
  // speaks, a higher rank waits a little for its report.
  if (channel_open && !peer_failed) {
    const auto until = Clock::now() + std::chrono::milliseconds(100 * std::min(worldRank(), 4));
    while (!peer_failed && Clock::now() < until) pause(0.01);
  }
  if (peer_failed) leave(code);  // a consequence of the failure a peer has reported
  if (quiet) {  // the rank that prints it tells the others; the launcher then ends the job
    const auto until = Clock::now() + std::chrono::seconds(2);
    while (!peer_failed && Clock::now() < until) pause(0.01);
    leave(code);
  }
  const int n = worldSize();
  log::fatalLine(n > 1 ? "plm: error on rank " + std::to_string(worldRank()) + ": " + message
                       : "plm: error: " + message);
  if (channel_open) {
    notifyPeers(message, code);
    pause(0.2);  // the peers take it in before the launcher signals them
  }
  leave(code);
}

void failAll(const std::string& message, int code) {
  self_failing = 1;
  if (fatal_taken.exchange(true)) {
    pause(10);
    leave(code);
  }
  if (worldRank() == 0) {
    log::fatalLine("plm: error: " + message);
    notifyPeers(message, code);
  }
  stop();
  std::thread([code] {
    pause(30);
    leave(code);
  }).detach();
  std::fflush(nullptr);
  if (mpiUp()) MPI_Finalize();
  leave(code);
}

void onTerminate() {
  const std::exception_ptr error = std::current_exception();
  bool collective = false, quiet = false;
  if (error) {
    try {
      std::rethrow_exception(error);
    } catch (const Error& e) {
      collective = e.collective();
      quiet = e.isQuiet();
    } catch (...) {
    }
  }
  const std::string message = describe(error);
  if (collective) failAll(message);
  failRank(message, 1, quiet);
}

}  // namespace plm::failure
