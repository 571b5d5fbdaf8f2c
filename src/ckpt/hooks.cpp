// How `plm train` uses checkpoints: resume on start, save + prune on the trainer's save hook.
//
// Design choice: a resumed run should leave behind exactly what an uninterrupted run would
// have: the model and optimizer state, the data position and the metrics file.  So on resume
// metrics.jsonl is cut back to the checkpoint's step (records the interrupted run wrote after
// its last checkpoint are about to be written again), and stale .tmp files are removed.
#include "ckpt/checkpoint.hpp"

#include "ckpt/async.hpp"
#include "ckpt/detail/agree.hpp"
#include "ckpt/init_from.hpp"
#include "core/log.hpp"
#include "dist/process_groups.hpp"
#include "dist/runtime.hpp"
#include "io/json.hpp"

#include <unistd.h>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>

namespace plm::ckpt {

namespace fs = std::filesystem;

namespace {

using dist::commRank;
const Teuchos::ParameterList& checkpointSection(const train::Trainer& trainer) {
  return trainer.deck().sublist("checkpoint");
}

// Rank 0 lists, everybody gets the same list (the directory may change under a running job).
std::vector<Listed> agreedListing(const std::string& dir, MPI_Comm comm) {
  std::vector<Listed> listed;
  std::string text;
  if (commRank(comm) == 0)
    for (const auto& l : listCheckpoints(dir)) text += std::to_string(l.step) + " " + l.path + "\n";
  long long length = static_cast<long long>(text.size());
  PLM_CHECK_MPI(MPI_Bcast(&length, 1, MPI_LONG_LONG, 0, comm));
  text.resize(static_cast<std::size_t>(length));
  if (length > 0) PLM_CHECK_MPI(MPI_Bcast(text.data(), int(length), MPI_CHAR, 0, comm));
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    const std::size_t space = line.find(' ');
    listed.push_back({line.substr(space + 1), std::stoll(line.substr(0, space))});
  }
  return listed;
}

void reportResume(train::Trainer& trainer, const Header& h) {
  log::info(
      "checkpoint: resumed from %s: step %lld, %lld tokens seen, data cursor (epoch %lld, position "
      "%lld); saved by %lld rank(s), continuing on %d; written by plm %s (%s) at %s",
      h.path.c_str(), static_cast<long long>(h.state.step),
      static_cast<long long>(h.state.tokens_seen), static_cast<long long>(h.state.cursor.epoch),
      static_cast<long long>(h.state.cursor.position), static_cast<long long>(h.world_size),
      trainer.world(), h.plm_version.c_str(), h.git_revision.c_str(), h.created_utc.c_str());
  const int log_every = std::max(1, trainer.deck().sublist("train").get<int>("log_every"));
  io::json::Value f = io::json::Value::object();
  f.set("path", h.path);
  f.set("saved_by_ranks", h.world_size);
  f.set("tokens_seen", h.state.tokens_seen);
  if (h.state.step % log_every != 0)
    log::info(
        "checkpoint: step %lld is not a multiple of train.log_every (%d): the first record after "
        "the "
        "resume averages fewer steps than an uninterrupted run's",
        static_cast<long long>(h.state.step), log_every);
  if (commRank(trainer.comm()) == 0) {
    const std::string metrics = trainer.runDir() + "/metrics.jsonl";
    const std::int64_t removed = truncateMetrics(metrics, h.state.step);
    if (removed > 0)
      log::info(
          "checkpoint: removed %lld record(s) after step %lld from %s (the interrupted run wrote "
          "them "
          "after its last checkpoint; they are recomputed now)",
          static_cast<long long>(removed), static_cast<long long>(h.state.step), metrics.c_str());
  }
  trainer.logEvent("resume", h.state.step, f);  // after the cut, so it stays
}

}  // namespace

std::int64_t truncateMetrics(const std::string& metrics, std::int64_t step) {
  std::ifstream in(metrics, std::ios::binary);
  if (!in) return 0;
  std::ostringstream buffer;
  buffer << in.rdbuf();
  const std::string text = buffer.str();
  std::size_t at = 0, cut = std::string::npos;
  std::int64_t removed = 0;
  while (at < text.size()) {
    const std::size_t end = text.find('\n', at);
    bool keep = end != std::string::npos;  // a line cut short by a kill has no newline
    if (keep) {
      try {
        const io::json::Value record = io::json::parse(text.substr(at, end - at), metrics);
        if (record.has("step") && record.at("step").asInt() > step) keep = false;
      } catch (const std::exception&) {
        keep = false;
      }
    }
    if (!keep && cut == std::string::npos) cut = at;
    if (cut != std::string::npos) ++removed;
    if (end == std::string::npos) break;
    at = end + 1;
  }
  if (cut == std::string::npos) return 0;
  PLM_CHECK_SYS(::truncate(metrics.c_str(), static_cast<off_t>(cut)) == 0,
                ("truncate " + metrics).c_str());
  return removed;
}

std::string resume(train::Trainer& trainer) {
  const auto& c = checkpointSection(trainer);
  const std::string setting = c.get<std::string>("resume"), dir = c.get<std::string>("dir");
  const MPI_Comm comm = trainer.comm();
  for (const auto& stale : removeTemporaries(dir, comm))
    log::warn("checkpoint: removed %s, left by a save that was interrupted", stale.c_str());

  if (setting == "none") {
    const auto listed = agreedListing(dir, comm);
    if (!listed.empty())
      log::warn(
          "checkpoint.resume: none, but %s holds %zu checkpoint(s) up to step %lld; this run's "
          "saves "
          "replace files of the same step and checkpoint.keep prunes all of them by step",
          dir.c_str(), listed.size(), static_cast<long long>(listed.back().step));
    else
      log::info("checkpoint: starting a new run (checkpoint.resume: none)");
    return "";
  }

  if (setting != "auto") {
    detail::agree(comm, [&] {
      std::error_code ec;
      if (!fs::is_regular_file(setting, ec))
        throw Error("checkpoint.resume: `" + setting +
                    "` is not a file; give an existing checkpoint, `auto` (the newest in "
                    "checkpoint.dir) or "
                    "`none`");
    });
    const Header h = load(trainer, setting);
    reportResume(trainer, h);
    return setting;
  }

  const auto listed = agreedListing(dir, comm);
  if (listed.empty()) {
    log::info("checkpoint: no checkpoint in %s; starting a new run", dir.c_str());
    return "";
  }
  std::string skipped;
  for (auto it = listed.rbegin(); it != listed.rend(); ++it) {
    try {
      const Header h = load(trainer, it->path);
      reportResume(trainer, h);
      return it->path;
    } catch (const CorruptCheckpoint& e) {
      log::warn("checkpoint: skipping %s: %s", it->path.c_str(), e.what());
      skipped += std::string("\n  - ") + e.what();
    }
  }
  throw collectiveError("checkpoint.resume: auto found " + std::to_string(listed.size()) +
                        " checkpoint(s) in `" + dir + "` and none is usable:" + skipped +
                        "\nMove them away, or set checkpoint.resume: none to start over.");
}

namespace {

// The metrics.jsonl record of a save (rank 0 writes it).
void saveEvent(train::Trainer& trainer, std::int64_t step, const SaveReport& r, bool async) {
  io::json::Value f = io::json::Value::object();
  f.set("path", r.path);
  f.set("bytes", r.bytes);
  f.set("seconds", r.seconds);
  f.set("async", async);
  trainer.logEvent("checkpoint", step, f);
}

// What the hooks of one trainer share: the asynchronous saver (made at the first async save)
// and the step of the newest save, so a stop signal right after a save does not save twice.
struct HookState {
  std::unique_ptr<AsyncSaver> saver;
  std::int64_t saved_step = -1;
  bool warned_sync = false;

  // Waits for (or with `poll`, only looks at) the background save, and records a finished one.
  void settle(train::Trainer& trainer, bool poll = false) {
    if (!saver) return;
    if (poll)
      saver->poll();
    else
      saver->wait();
    if (auto done = saver->takeFinished()) saveEvent(trainer, done->step, done->report, true);
  }
};

void logSave(const SaveReport& r, std::int64_t step) {
  log::info(
      "checkpoint: step %lld saved to %s: %.1f MB in %.2f s (%.0f MB/s; host copy %.2f s, write "
      "%.2f s, flush/rename %.2f s)",
      static_cast<long long>(step), r.path.c_str(), double(r.bytes) / 1e6, r.seconds,
      r.megabytesPerSecond(), r.copy_seconds, r.write_seconds, r.sync_seconds);
}

// A synchronous save of the trainer's current step, after any background save finished.
SaveReport saveNow(train::Trainer& trainer, HookState& state) {
  const auto& c = checkpointSection(trainer);
  state.settle(trainer);
  const SaveReport r = save(trainer, c.get<std::string>("dir"));
  logSave(r, trainer.state().step);
  saveEvent(trainer, trainer.state().step, r, false);
  for (const auto& removed : prune(c.get<std::string>("dir"), c.get<int>("keep"), trainer.comm()))
    log::info("checkpoint: removed %s (checkpoint.keep: %d)", removed.c_str(), c.get<int>("keep"));
  state.saved_step = trainer.state().step;
  return r;
}

}  // namespace

bool rollback(train::Trainer& trainer) {
  const std::string dir = checkpointSection(trainer).get<std::string>("dir");
  for (const auto& stale : removeTemporaries(dir, trainer.comm()))
    log::warn("checkpoint: removed %s, left by a save that was interrupted", stale.c_str());
  const auto listed = agreedListing(dir, trainer.comm());
  for (auto it = listed.rbegin(); it != listed.rend(); ++it) {
    if (it->step >= trainer.state().step + 1) continue;  // not written by this history
    try {
      const Header h = load(trainer, it->path);
      reportResume(trainer, h);
      return true;
    } catch (const CorruptCheckpoint& e) {
      log::warn("checkpoint: skipping %s: %s", it->path.c_str(), e.what());
    }
  }
  return false;
}

train::Trainer::Hooks hooks(train::Trainer::Hooks extra) {
  auto state = std::make_shared<HookState>();
  train::Trainer::Hooks h;
  h.on_step = [state, user = extra.on_step](train::Trainer& trainer, const train::StepStats& st) {
    state->settle(trainer, true);  // logs a finished background save
    if (user) user(trainer, st);
  };
  h.on_start = [user = extra.on_start](train::Trainer& trainer) {
    // A resumed run continues from its own checkpoint; model.init_from starts a new one only.
    if (resume(trainer).empty()) applyInitFrom(trainer);
    if (user) user(trainer);
  };
  h.on_save = [state, user = extra.on_save](train::Trainer& trainer, bool final_save) {
    if (trainer.checkpointEvery() > 0) {
      const auto& c = checkpointSection(trainer);
      bool async = c.get<bool>("async") && !final_save;
      if (async && !dist::mpiThreadMultiple()) {
        if (!state->warned_sync)
          log::warn(
              "checkpoint.async: MPI did not grant MPI_THREAD_MULTIPLE, which the "
              "background writer needs; saving synchronously");
        state->warned_sync = true;
        async = false;
      }
      if (async) {
        if (!state->saver) state->saver = std::make_unique<AsyncSaver>(trainer.comm());
        state->settle(trainer);  // at most one save in flight
        const double held =
            state->saver->start(trainer, c.get<std::string>("dir"), c.get<int>("keep"));
        state->saved_step = trainer.state().step;
        log::info("checkpoint: step %lld: snapshot taken in %.3f s; writing it in the background",
                  static_cast<long long>(trainer.state().step), held);
      } else {
        saveNow(trainer, *state);
      }
    }
    if (final_save) state->settle(trainer);
    if (user) user(trainer, final_save);
  };
  h.on_stop = [state, user = extra.on_stop](train::Trainer& trainer) {
    state->settle(trainer);
    const std::string dir = checkpointSection(trainer).get<std::string>("dir");
    std::string path = (fs::path(dir) / fileName(trainer.state().step)).string();
    if (state->saved_step != trainer.state().step) path = saveNow(trainer, *state).path;
    log::info("checkpoint: the run stopped after step %lld; its checkpoint is %s",
              static_cast<long long>(trainer.state().step), path.c_str());
    if (user) user(trainer);
  };
  h.on_rollback = [state, user = extra.on_rollback](train::Trainer& trainer) {
    state->settle(trainer);
    const bool restored = rollback(trainer);
    if (user) user(trainer);
    return restored;
  };
  return h;
}

void installHooks(train::Trainer& trainer, train::Trainer::Hooks extra) {
  trainer.setHooks(hooks(std::move(extra)));
}

}  // namespace plm::ckpt
