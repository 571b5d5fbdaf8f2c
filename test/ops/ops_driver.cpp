// The plm executable as a batch system treats it: started under mpiexec on 2 ranks, then
// signalled, stalled or SIGKILLed, and restarted (test/ops/CMakeLists.txt runs each mode).
//
//   test_ops_driver MODE PLM MPIEXEC WORKDIR      MODE: signal | watchdog | kill_loop | failure
//
//  - signal: SIGUSR1 to one rank mid-run; mpiexec must exit with 75 (train::exit_requeue), the
//    newest checkpoint is the step it stopped after, and the restarted run ends with the same
//    checkpoint tensors and losses as an uninterrupted run.
//  - watchdog: rank 1 stalls in step 3 (PLM_TEST_STALL) with train.step_timeout 3 s; the job
//    must end with the watchdog's line from each rank (rank 1 in the injected stall, rank 0 in
//    the collective waiting for it), far sooner than the stall.
//  - failure: an exception and a real out-of-memory on rank 1 inside a step (PLM_TEST_FAIL), an
//    expert dispatch beyond moe.dispatch_budget_gib, and `plm embed --out` into a missing
//    directory: each job must end within seconds, non-zero, with exactly one error line that says
//    what and what to change, without the MPI_ABORT banner or stop-signal lines.
//  - kill_loop: SIGKILLs the job again and again -- at random times, just as a checkpoint's
//    .tmp file appears (a kill during a save), or one rank alone -- and restarts it each time
//    (checkpoint.resume: auto); after every kill each checkpoint in the directory must pass its
//    header and CRC checks; the final checkpoint and losses must equal an uninterrupted run's.
//
// It is not an MPI program: it only starts mpiexec, reads checkpoints with serial HDF5 and
// compares.  It prints what it did and how long it took.
#include "ckpt/checkpoint.hpp"

#include <hdf5.h>
#include <zlib.h>
#include <algorithm>

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

std::string plm_exe, mpiexec_exe, work;
int failures = 0;

#define CHECK(cond, ...)                                          \
  do {                                                            \
    if (!(cond)) {                                                \
      std::fprintf(stderr, "FAILED %s:%d: ", __FILE__, __LINE__); \
      std::fprintf(stderr, __VA_ARGS__);                          \
      std::fprintf(stderr, "\n");                                 \
      ++failures;                                                 \
    }                                                             \
  } while (0)

double seconds(Clock::time_point since) {
  return std::chrono::duration<double>(Clock::now() - since).count();
}

std::string slurp(const std::string& path) {
  std::ifstream in(path);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// Starts `args` with stdout and stderr to `log` (and extra environment entries); returns the pid.
pid_t spawn(const std::vector<std::string>& args, const std::string& log,
            const std::vector<std::string>& env = {}) {
  const pid_t pid = ::fork();
  if (pid < 0) {
    std::perror("fork");
    std::exit(2);
  }
  if (pid == 0) {
    const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ::dup2(fd, 1);
    ::dup2(fd, 2);
    for (const auto& e : env) ::putenv(const_cast<char*>(e.c_str()));
    std::vector<char*> argv;
    for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    ::execvp(argv[0], argv.data());
    std::perror("execvp");
    ::_exit(127);
  }
  return pid;
}

int waitFor(pid_t pid) {
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  return 128 + WTERMSIG(status);
}

// Processes whose parent chain leads to `root` (the ranks under mpiexec).
std::vector<pid_t> descendants(pid_t root) {
  std::map<pid_t, pid_t> parent;
  if (DIR* d = ::opendir("/proc")) {
    while (dirent* e = ::readdir(d)) {
      const pid_t pid = std::atoi(e->d_name);
      if (pid <= 0) continue;
      std::ifstream stat("/proc/" + std::string(e->d_name) + "/stat");
      std::string text;
      std::getline(stat, text);
      const std::size_t close = text.rfind(')');
      if (close == std::string::npos) continue;
      std::istringstream rest(text.substr(close + 2));
      char state;
      pid_t ppid = 0;
      rest >> state >> ppid;
      parent[pid] = ppid;
    }
    ::closedir(d);
  }
  std::vector<pid_t> out;
  for (const auto& [pid, ppid] : parent) {
    pid_t p = ppid;
    for (int depth = 0; p > 1 && depth < 16; ++depth) {
      if (p == root) {
        out.push_back(pid);
        break;
      }
      auto it = parent.find(p);
      p = it == parent.end() ? 0 : it->second;
    }
  }
  return out;
}

std::vector<pid_t> ranksOf(pid_t launcher) {
  std::vector<pid_t> ranks;
  for (pid_t p : descendants(launcher)) {
    const std::string cmd = slurp("/proc/" + std::to_string(p) + "/cmdline");
    if (cmd.find(plm_exe) != std::string::npos) ranks.push_back(p);
  }
  return ranks;
}

// The whole job dies at once, as when its node fails.
void killJob(pid_t launcher) {
  for (pid_t p : descendants(launcher)) ::kill(p, SIGKILL);
  ::kill(launcher, SIGKILL);
}

std::vector<std::string> trainArgs(const std::string& run, int steps) {
  return {mpiexec_exe,
          "-n",
          "2",
          "--oversubscribe",
          "--bind-to",
          "none",
          plm_exe,
          "train",
          work + "/deck.yaml",
          "--set",
          "train.run_dir=" + work + "/" + run,
          "--set",
          "checkpoint.dir=" + work + "/" + run + "/ckpt",
          "--set",
          "train.steps=" + std::to_string(steps)};
}

void setUp() {
  fs::remove_all(work);
  fs::create_directories(work);
  std::mt19937_64 gen(2024);
  std::uniform_int_distribution<int> length(20, 100), residue(0, 19);
  const char* amino = "ACDEFGHIKLMNPQRSTVWY";
  std::ofstream fasta(work + "/seqs.fasta");
  for (int i = 0; i < 160; ++i) {
    fasta << ">s" << i << "\n";
    const int n = length(gen);
    for (int k = 0; k < n; ++k) fasta << amino[residue(gen)];
    fasta << "\n";
  }
  fasta.close();
  const int rc = waitFor(spawn(
      {plm_exe, "prep", work + "/seqs.fasta", "--out", work + "/data", "--valid-fraction", "0"},
      work + "/prep.log"));
  if (rc != 0) {
    std::fprintf(stderr, "plm prep failed (%d):\n%s", rc, slurp(work + "/prep.log").c_str());
    std::exit(1);
  }
  std::ofstream deck(work + "/deck.yaml");
  deck << "model: {preset: custom, layers: 2, hidden: 32, heads: 4, ffn: 64}\n"
       << "data: {train: " << work << "/data/train.h5, valid: \"\", tokens_per_batch: 4096, "
       << "micro_batch_tokens: 1024, max_seq_len: 64, seed: 3, prefetch: 1}\n"
       << "optimizer: {lr: 3.0e-3}\n"
       << "schedule: {warmup_steps: 2, decay: linear, decay_steps: 150}\n"
       << "train: {steps: 20, log_every: 1, eval_every: 0, seed: 5, run_dir: run}\n"
       << "checkpoint: {dir: run/ckpt, every: 2, keep: 3, resume: auto}\n";
}

using Tensors = std::map<std::string, std::vector<float>>;

// Reads and checks one checkpoint with serial HDF5: the header (ckpt::readHeader) and every
// tensor's CRC-32.  Returns the tensors ("group/name"); an empty map and a failure if broken.
Tensors verifiedTensors(const std::string& path) {
  Tensors out;
  try {
    plm::ckpt::readHeader(path);
  } catch (const std::exception& e) {
    CHECK(false, "checkpoint %s: %s", path.c_str(), e.what());
    return out;
  }
  const hid_t file = H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  CHECK(file >= 0, "cannot open %s", path.c_str());
  if (file < 0) return out;
  for (const char* group : {"model", "optimizer/exp_avg", "optimizer/exp_avg_sq"}) {
    const hid_t g = H5Gopen2(file, group, H5P_DEFAULT);
    H5G_info_t info;
    H5Gget_info(g, &info);
    for (hsize_t i = 0; i < info.nlinks; ++i) {
      char name[512];
      H5Lget_name_by_idx(g, ".", H5_INDEX_NAME, H5_ITER_INC, i, name, sizeof name, H5P_DEFAULT);
      const hid_t d = H5Dopen2(g, name, H5P_DEFAULT);
      const hid_t space = H5Dget_space(d);
      std::vector<float> values(std::size_t(H5Sget_simple_extent_npoints(space)));
      const herr_t read =
          H5Dread(d, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, values.data());
      long long stored = -1;
      const hid_t a = H5Aopen(d, "crc32", H5P_DEFAULT);
      if (a >= 0) {
        H5Aread(a, H5T_NATIVE_LLONG, &stored);
        H5Aclose(a);
      }
      const unsigned long crc =
          crc32_z(crc32_z(0L, Z_NULL, 0), reinterpret_cast<const Bytef*>(values.data()),
                  values.size() * sizeof(float));
      CHECK(read >= 0 && stored == (long long)crc, "checkpoint %s: %s/%s fails its CRC",
            path.c_str(), group, name);
      out[std::string(group) + "/" + name] = std::move(values);
      H5Sclose(space);
      H5Dclose(d);
    }
    H5Gclose(g);
  }
  H5Fclose(file);
  return out;
}

int verifyAll(const std::string& dir) {
  int n = 0;
  for (const auto& l : plm::ckpt::listCheckpoints(dir)) {
    verifiedTensors(l.path);
    ++n;
  }
  return n;
}

std::map<std::int64_t, std::string> losses(const std::string& metrics) {
  std::map<std::int64_t, std::string> out;
  std::istringstream in(slurp(metrics));
  for (std::string line; std::getline(in, line);) {
    if (line.find("\"kind\":\"train\"") == std::string::npos) continue;
    auto field = [&](const std::string& key) {
      const std::size_t start = line.find("\"" + key + "\":") + key.size() + 3;
      return line.substr(start, line.find_first_of(",}", start) - start);
    };
    out[std::stoll(field("step"))] = field("loss");
  }
  return out;
}

void expectSameEnd(const std::string& run, const std::string& reference, int steps) {
  const std::string name = "/ckpt/" + plm::ckpt::fileName(steps);
  const Tensors want = verifiedTensors(work + "/" + reference + name);
  const Tensors got = verifiedTensors(work + "/" + run + name);
  CHECK(!want.empty() && want.size() == got.size(), "final checkpoints hold %zu and %zu tensors",
        want.size(), got.size());
  for (const auto& [key, values] : want) {
    auto it = got.find(key);
    CHECK(it != got.end() && it->second.size() == values.size() &&
              std::memcmp(it->second.data(), values.data(), values.size() * sizeof(float)) == 0,
          "%s differs from the uninterrupted run's", key.c_str());
  }
  const auto a = losses(work + "/" + reference + "/metrics.jsonl");
  const auto b = losses(work + "/" + run + "/metrics.jsonl");
  CHECK(int(a.size()) == steps && a == b, "losses differ (%zu and %zu steps logged)", a.size(),
        b.size());
}

int runToEnd(const std::string& run, int steps, const std::string& log) {
  return waitFor(spawn(trainArgs(run, steps), work + "/" + log));
}

// Waits until `path` holds at least `lines` lines (or the process ended); false on timeout.
bool waitForLines(const std::string& path, int lines, pid_t pid, double timeout) {
  const auto start = Clock::now();
  while (seconds(start) < timeout) {
    const std::string text = slurp(path);
    if (std::count(text.begin(), text.end(), '\n') >= lines) return true;
    int status = 0;
    if (::waitpid(pid, &status, WNOHANG) == pid) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return false;
}

void signalMode() {
  const int steps = 24;
  CHECK(runToEnd("reference", steps, "reference.log") == 0, "the reference run failed");
  const pid_t job = spawn(trainArgs("sig", steps), work + "/sig.log");
  const bool started = waitForLines(work + "/sig/metrics.jsonl", 5, job, 120);
  CHECK(started, "the run did not reach step 5");
  const auto ranks = ranksOf(job);
  CHECK(ranks.size() == 2, "found %zu rank processes", ranks.size());
  if (!ranks.empty()) ::kill(ranks.back(), SIGUSR1);  // one rank only: the others must follow
  const int rc = waitFor(job);
  const std::string log = slurp(work + "/sig.log");
  CHECK(rc == 75, "mpiexec exited with %d after SIGUSR1, not 75:\n%s", rc, log.c_str());
  const auto listed = plm::ckpt::listCheckpoints(work + "/sig/ckpt");
  CHECK(!listed.empty() && listed.back().step < steps, "no checkpoint before the end");
  CHECK(log.find("its checkpoint is") != std::string::npos, "the stop did not say where:\n%s",
        log.c_str());
  if (!listed.empty()) {
    const std::int64_t stopped = listed.back().step;
    CHECK(log.find("stopped after step " + std::to_string(stopped)) != std::string::npos,
          "the newest checkpoint (%lld) is not the step the run stopped after",
          static_cast<long long>(stopped));
    std::printf("signal: stopped after step %lld with exit 75\n", static_cast<long long>(stopped));
  }
  verifyAll(work + "/sig/ckpt");
  CHECK(runToEnd("sig", steps, "sig_resume.log") == 0, "the resumed run failed:\n%s",
        slurp(work + "/sig_resume.log").c_str());
  expectSameEnd("sig", "reference", steps);
}

void watchdogMode() {
  const auto start = Clock::now();
  auto args = trainArgs("hang", 10);
  args.push_back("--set");
  args.push_back("train.step_timeout=3");
  const int rc = waitFor(spawn(args, work + "/hang.log", {"PLM_TEST_STALL=3:120:1"}));
  const double took = seconds(start);
  const std::string log = slurp(work + "/hang.log");
  CHECK(rc != 0, "the stalled job exited with 0");
  CHECK(took < 60, "the stalled job took %.0f s to end (the stall is 120 s)", took);
  for (const char* line :
       {"plm watchdog: rank 1 on ", "plm watchdog: rank 0 on ", "step 3, in an injected stall",
        "step 3, in masked-token count all-reduce"})
    CHECK(log.find(line) != std::string::npos, "no `%s` in the output:\n%s", line, log.c_str());
  std::printf("watchdog: the job ended after %.1f s with exit status %d\n", took, rc);
}

// The lines of `text` that contain `what`.
int linesWith(const std::string& text, const std::string& what) {
  std::istringstream in(text);
  int n = 0;
  for (std::string line; std::getline(in, line);)
    if (line.find(what) != std::string::npos) ++n;
  return n;
}

// One failing job: it must end quickly, non-zero, with exactly one error line holding each of
// `expect`, and none of the noise a job used to end with.
void expectOneLine(const std::string& name, const std::vector<std::string>& args,
                   const std::vector<std::string>& env, const std::vector<std::string>& expect) {
  const auto start = Clock::now();
  const int rc = waitFor(spawn(args, work + "/" + name + ".log", env));
  const double took = seconds(start);
  std::string log = slurp(work + "/" + name + ".log");
  for (std::size_t at; (at = log.find(work)) != std::string::npos;)  // paths hold run names
    log.replace(at, work.size(), "WORK");
  CHECK(rc != 0, "%s: the job exited with 0:\n%s", name.c_str(), log.c_str());
  CHECK(took < 20, "%s: the job took %.1f s to end", name.c_str(), took);
  CHECK(linesWith(log, "error") == 1, "%s: %d lines say `error`, not one:\n%s", name.c_str(),
        linesWith(log, "error"), log.c_str());
  for (const auto& e : expect)
    CHECK(linesWith(log, e) == 1, "%s: no line with `%s`:\n%s", name.c_str(), e.c_str(),
          log.c_str());
  for (const char* noise : {"MPI_ABORT", "received SIGTERM", "Traceback", "HDF5-DIAG",
                            "stopping after the current step"})
    CHECK(log.find(noise) == std::string::npos, "%s: `%s` in the output:\n%s", name.c_str(), noise,
          log.c_str());
  std::printf("failure %s: ended in %.1f s with status %d\n", name.c_str(), took, rc);
}

void failureMode() {
  // An exception on rank 1 inside step 3, while rank 0 waits in the step's collectives.
  expectOneLine("exception", trainArgs("exception", 10), {"PLM_TEST_FAIL=3:1:error"},
                {"plm: error on rank 1: PLM_TEST_FAIL: an injected failure on rank 1 in step 3"});
  // A real allocation failure (1 PiB) on rank 1 inside step 3: what did not fit, what to change
  // and the run's plan.
  expectOneLine("oom", trainArgs("oom", 10), {"PLM_TEST_FAIL=3:1:oom"},
                {"plm: error on rank 1: out of memory: ", "`plm::test::injected_allocation` of ",
                 "data.micro_batch_tokens", "planned for this run: "});
  // Expert parallelism whose dispatch exceeds its budget: every rank stops at the first MoE
  // layer's count exchange, rank 0 says which rank and what to change.
  auto moe = trainArgs("moe", 10);
  for (const char* set : {"moe.experts=4", "moe.top_k=2", "moe.expert_ffn=16",
                          "parallel.expert_degree=2", "moe.dispatch_budget_gib=0.000001"}) {
    moe.push_back("--set");
    moe.push_back(set);
  }
  expectOneLine("moe_budget", moe, {},
                {"plm: error: moe: layer 0: expert rank ",
                 "moe.dispatch_budget_gib = ", "moe.capacity_factor"});
  // plm embed into a directory that does not exist.
  CHECK(runToEnd("model", 2, "model.log") == 0, "the run that writes a model failed:\n%s",
        slurp(work + "/model.log").c_str());
  expectOneLine("embed",
                {mpiexec_exe, "-n", "2", "--oversubscribe", "--bind-to", "none", plm_exe, "embed",
                 "--checkpoint", work + "/model/model.h5", "--fasta", work + "/seqs.fasta", "--out",
                 "/nonexistent/x.h5"},
                {},
                {"plm: error: plm embed: --out: cannot create `/nonexistent/x.h5`: the directory "
                 "`/nonexistent` does not exist"});
}

void killLoopMode() {
  const int steps = 120;
  const auto t0 = Clock::now();
  CHECK(runToEnd("reference", steps, "reference.log") == 0, "the reference run failed");
  std::mt19937_64 gen(std::random_device{}());
  const double reference_seconds = seconds(t0);
  std::printf("kill_loop: uninterrupted run of %d steps: %.1f s\n", steps, reference_seconds);
  int kills = 0, during_save = 0;
  const std::string ckpt = work + "/killed/ckpt";
  for (int attempt = 0; attempt < 60 && kills < 15; ++attempt) {
    // Every other attempt saves asynchronously (a kill then may hit the background writer).
    auto args = trainArgs("killed", steps);
    const bool async = attempt % 2 == 1;
    args.push_back("--set");
    args.push_back(async ? "checkpoint.async=true" : "checkpoint.async=false");
    const pid_t job = spawn(args, work + "/killed.log");
    const int how = attempt % 3;  // 0: random time, 1: during a save, 2: one rank only
    bool killed = false;
    if (how == 1) {
      // Watch for a save's temporary file and kill within 0-20 ms of its appearance.
      const auto start = Clock::now();
      std::uniform_int_distribution<int> delay(0, 20);
      while (seconds(start) < 60 && !killed) {
        int status = 0;
        if (::waitpid(job, &status, WNOHANG) == job) break;
        std::error_code ec;
        for (const auto& e : fs::directory_iterator(ckpt, ec))
          if (e.path().extension() == ".tmp") {
            std::this_thread::sleep_for(std::chrono::milliseconds(delay(gen)));
            killJob(job);
            killed = true;
            ++during_save;
            break;
          }
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
    } else {
      // Within the first 70% of an uninterrupted run (start-up included), however fast this
      // machine is today.
      std::uniform_real_distribution<double> when(0.3, std::max(1.0, 0.7 * reference_seconds));
      const auto start = Clock::now();
      const double at = when(gen);
      int status = 0;
      bool ended = false;
      while (seconds(start) < at)
        if (::waitpid(job, &status, WNOHANG) == job) {
          ended = true;
          break;
        } else {
          std::this_thread::sleep_for(std::chrono::milliseconds(5));
        }
      if (!ended) {
        const auto ranks = ranksOf(job);
        if (how == 2 && !ranks.empty())
          ::kill(ranks[std::uniform_int_distribution<std::size_t>(0, ranks.size() - 1)(gen)],
                 SIGKILL);
        else
          killJob(job);
        killed = true;
      } else {
        killed = false;
        waitFor(job);  // reaped above already; harmless
      }
    }
    const int rc = killed ? waitFor(job) : 0;
    // Nothing of the job may survive it (a rank left behind would write on).
    for (int i = 0; i < 200 && !descendants(job).empty(); ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    for (pid_t p : descendants(job)) ::kill(p, SIGKILL);
    const int good = verifyAll(ckpt);
    const auto listed = plm::ckpt::listCheckpoints(ckpt);
    std::printf(
        "kill_loop: attempt %d (%s, %s saves): %s, %d checkpoint(s) intact, newest step "
        "%lld\n",
        attempt,
        how == 0   ? "random time"
        : how == 1 ? "during a save"
                   : "one rank",
        async ? "async" : "sync",
        killed ? ("killed, launcher status " + std::to_string(rc)).c_str() : "finished", good,
        listed.empty() ? -1LL : static_cast<long long>(listed.back().step));
    if (killed) ++kills;
    if (!listed.empty() && listed.back().step == steps && !killed) {
      if (kills >= 10 && during_save >= 3) break;
      // The run reached its end before enough kills: start it again from nothing.
      std::error_code ec;
      fs::remove_all(work + "/killed", ec);
    }
  }
  CHECK(kills >= 10, "only %d kills", kills);
  CHECK(during_save >= 3, "only %d kills during a save", during_save);
  const int rc = runToEnd("killed", steps, "killed_final.log");
  CHECK(rc == 0, "the final resumed run failed (%d):\n%s", rc,
        slurp(work + "/killed_final.log").c_str());
  expectSameEnd("killed", "reference", steps);
  std::printf("kill_loop: %d kills (%d during a save) in %.1f s\n", kills, during_save,
              seconds(t0));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 5) {
    std::fprintf(stderr, "usage: %s signal|watchdog|kill_loop|failure PLM MPIEXEC WORKDIR\n",
                 argv[0]);
    return 2;
  }
  const std::string mode = argv[1];
  plm_exe = argv[2];
  mpiexec_exe = argv[3];
  work = argv[4];
  H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
  setUp();
  if (mode == "signal")
    signalMode();
  else if (mode == "watchdog")
    watchdogMode();
  else if (mode == "kill_loop")
    killLoopMode();
  else if (mode == "failure")
    failureMode();
  else
    return 2;
  if (failures) std::fprintf(stderr, "%d check(s) failed\n", failures);
  return failures ? 1 : 0;
}
