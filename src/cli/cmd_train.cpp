// `plm train DECK [--set section.key=value]...`: resolves the deck and hands it to the trainer.
#include "ckpt/checkpoint.hpp"
#include "ckpt/init_from.hpp"
#include "cli/args.hpp"
#include "cli/commands.hpp"
#include "core/error.hpp"
#include "core/log.hpp"
#include "deck/deck.hpp"
#include "dist/runtime.hpp"
#include "plan/train_report.hpp"
#include "train/finetune.hpp"
#include "train/preemption.hpp"
#include "train/trainer.hpp"

#include <cstdio>
#include <filesystem>

namespace plm::cli {

namespace {
Parser trainParser() {
  Parser p(
      "plm train", "plm train DECK [--set section.key=value]...",
      "Trains the model the deck describes (doc/training.md): data-parallel over the MPI "
      "ranks, logging every train.log_every steps to the console and "
      "<train.run_dir>/metrics.jsonl, validating every train.eval_every steps. The "
      "resolved deck is written to <train.run_dir>/deck.yaml. On SIGTERM or SIGUSR1 it "
      "saves a checkpoint after the current step and exits with status 75 (requeue me); "
      "repeats of that stop count once, and a signal after the stop was acted on (never during "
      "a save) exits at once (doc/operations.md).");
  p.option({"set", "SECTION.KEY=VALUE", "override a deck key, e.g. --set train.steps=100", true});
  return p;
}
}  // namespace

int runTrain(const Argv& argv) {
  Parser parser = trainParser();
  Args args = parser.parse(argv);
  if (args.has("help")) {
    if (dist::worldRank() == 0) std::fputs(parser.help().c_str(), stdout);
    return 0;
  }
  if (args.positional().size() != 1)
    throw collectiveError("plm train: give exactly one deck file; see `plm train --help`");
  auto deck = deck::load(args.positional()[0], args.all("set"));
  log::configure(dist::worldRank(),
                 deck->sublist("train").get<bool>("log_all_ranks") || log::allRanks());
  // The log goes to <run_dir>/train.log as well as the terminal (appended: a resumed run goes on
  // in the same file). Rank 0 writes it, or each rank its own with --log-all-ranks.
  const std::string run_dir = deck->sublist("train").get<std::string>("run_dir");
  std::error_code ec;
  std::filesystem::create_directories(run_dir, ec);
  const std::string log_path =
      run_dir + (log::allRanks() ? "/train.rank" + std::to_string(dist::worldRank()) : "/train") +
      ".log";
  const bool writes_log = log::allRanks() || dist::worldRank() == 0;
  if (writes_log && !log::teeTo(log_path))
    log::warn("plm train: cannot write %s; logging to the terminal only", log_path.c_str());
  struct StopTee {
    ~StopTee() { log::teeTo(""); }
  } stop_tee;
  // SIGTERM / SIGUSR1 (batch systems before a kill): checkpoint at the next step boundary and
  // exit with train::exit_requeue, which jobscripts/ turn into a requeue (doc/operations.md).
  train::installStopSignals();
  train::Trainer trainer(deck);
  plan::logMemoryPlan(trainer);  // the bytes per rank; the first step's measured peak follows
  // checkpoint.resume on start, checkpoint.every saves (src/ckpt); the plan's prediction next to
  // the measured figures after the first steps (src/plan).
  if (deck->sublist("task").get<std::string>("kind") != "mlm") {
    // A task head on the (frozen) encoder: weights from model.init_from, then the head's loop.
    ckpt::applyInitFrom(trainer);
    train::trainTaskHead(trainer);
    return 0;
  }
  train::Trainer::Hooks extra;
  extra.on_step = plan::predictionReport();
  ckpt::installHooks(trainer, extra);
  return trainer.run() == train::Trainer::RunEnd::Stopped ? train::exit_requeue : 0;
}

}  // namespace plm::cli
