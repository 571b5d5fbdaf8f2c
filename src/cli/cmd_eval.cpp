// `plm eval DECK [--set ...]`: masked-LM loss and perplexity of a model on a dataset, with the
// deck's masking (deterministic: epoch-0 masks of data.seed) and batching.
#include "cli/args.hpp"
#include "cli/commands.hpp"
#include "core/error.hpp"
#include "core/log.hpp"
#include "deck/deck.hpp"
#include "dist/runtime.hpp"
#include "model/head_file.hpp"
#include "model/model_file.hpp"
#include "train/finetune.hpp"
#include "train/fp8_run.hpp"
#include "train/step.hpp"
#include "train/trainer.hpp"

#include <chrono>
#include <cstdio>
#include <memory>

namespace plm::cli {

namespace {
Parser evalParser() {
  Parser p("plm eval",
           "plm eval DECK [--model FILE] [--head HEAD.h5] [--data PATH] [--max-tokens N] "
           "[--set section.key=value]...",
           "Evaluates a model on a dataset (default: data.valid of the deck) and prints the "
           "masked-token cross-entropy and perplexity, with the deck's batching and masking "
           "(deterministic: the epoch-0 masks of data.seed). --model takes a plm model file or "
           "checkpoint (e.g. <train.run_dir>/model.h5 written at the end of `plm train`, or the "
           "output of `plm convert --from-hf`); its shape overrides the deck's model section. "
           "Without --model the deck's freshly initialised model (train.seed) is evaluated: "
           "the untrained baseline. With --head (a head.h5 from plm train with task.kind set, or a "
           "model file converted from a classification folder), the task's loss and metrics on the "
           "dataset's labels instead (doc/finetune.md).");
  p.option({"model", "FILE", "plm model file or checkpoint to evaluate"});
  p.option({"head", "HEAD.h5",
            "evaluate this task head on the model: loss, mse/spearman (regression), "
            "accuracy/auroc (classification), per-residue accuracy (tokens), on a labelled "
            "dataset (plm prep --labels / --residue-labels)"});
  p.option({"data", "PATH", "dataset written by `plm prep` (default: data.valid of the deck)"});
  p.option(
      {"max-tokens", "N", "evaluate at most about N tokens (default: data.valid_tokens, 0 = all)"});
  p.option({"set", "SECTION.KEY=VALUE", "override a deck key", true});
  return p;
}
}  // namespace

int runEval(const Argv& argv) {
  Parser parser = evalParser();
  Args args = parser.parse(argv);
  if (args.has("help")) {
    if (dist::worldRank() == 0) std::fputs(parser.help().c_str(), stdout);
    return 0;
  }
  if (args.positional().size() != 1)
    throw collectiveError("plm eval: give exactly one deck file; see `plm eval --help`");
  std::vector<std::string> overrides = args.all("set");
  if (args.has("max-tokens")) overrides.push_back("data.valid_tokens=" + args.get("max-tokens"));
  auto deck = deck::load(args.positional()[0], overrides);
  const std::string path = args.get("data", deck->sublist("data").get<std::string>("valid"));
  if (path.empty()) throw collectiveError("plm eval: the deck has no data.valid; pass --data PATH");

  const int rank = dist::worldRank(), world = dist::worldSize();
  const std::string model_path = args.get("model");
  // Files every rank can check: a missing or unreadable one is one collective line, not an abort.
  model::Esm2Config config;
  if (model_path.empty())
    config = train::modelConfigFromDeck(*deck);
  else
    onEveryRank(
        "plm eval: --model: ", [&] { config = model::readModelConfig(model_path); },
        MPI_COMM_WORLD);
  std::unique_ptr<data::Loader> loader;
  onEveryRank(
      "plm eval: ",
      [&] {
        loader = std::make_unique<data::Loader>(train::evalLoaderOptions(*deck, path, rank, world));
      },
      MPI_COMM_WORLD);
  // Drop-less MoE routing unless --set moe.dropless=false (doc/interop.md); a model file's
  // routing settings are the training run's, so the deck's would otherwise never apply.
  inferenceRouting(config, args.all("set"), "plm eval");
  // Evaluation computes in the deck's precision (bf16 on the CUDA build runs the fast path).
  config.precision = model::parsePrecision(deck->sublist("train").get<std::string>("precision"));
  train::applyFp8Section(*deck, config);
  if (config.precision == model::Precision::Fp8 && config.fp8.recipe == model::Fp8Recipe::Delayed) {
    // A model file has no amax history: evaluate with the scales of the tensors themselves.
    config.fp8.recipe = model::Fp8Recipe::Current;
    log::info("eval: fp8 delayed scaling has no state outside a training run; current scaling");
  }
  model::Esm2<param_t> model(config);
  if (model_path.empty()) {
    const int seed = deck->sublist("train").get<int>("seed");
    model.initialize(static_cast<std::uint64_t>(seed));
    log::info(
        "eval: freshly initialised model (train.seed %d), %lld parameters: the untrained "
        "baseline (pass --model FILE to evaluate a trained one)",
        seed, static_cast<long long>(config.numParameters()));
  } else {
    onEveryRank(
        "plm eval: --model: ", [&] { model::readModelInto(model_path, MPI_COMM_WORLD, model); },
        MPI_COMM_WORLD);
    log::info("eval: model %s (%d layers, hidden %d), %lld parameters", model_path.c_str(),
              config.num_layers, config.hidden, static_cast<long long>(config.numParameters()));
  }

  if (args.has("head")) {
    const std::string head_path = args.get("head");
    model::HeadData data;
    model::TaskConfig task;
    onEveryRank(
        "plm eval: --head: ",
        [&] {
          data = model::readHead(head_path, MPI_COMM_WORLD);
          task = train::taskConfigOf(data, head_path);
        },
        MPI_COMM_WORLD);
    model::TaskHead<param_t> head(task, config.hidden);
    onEveryRank(
        "plm eval: --head: ", [&] { train::loadHead(head, data, head_path); }, MPI_COMM_WORLD);
    const auto t0 = std::chrono::steady_clock::now();
    io::json::Value fields;
    onEveryRank(
        "plm eval: ",
        [&] {  // a dataset without the task's labels is refused by the loader on every rank
          auto options = train::evalLoaderOptions(*deck, path, rank, world);
          fields = train::evaluateTask(model, head, options, MPI_COMM_WORLD);
        },
        MPI_COMM_WORLD);
    std::string text;
    char buf[64];
    for (const auto& [key, value] : fields.members()) {
      if (key == "labelled") continue;
      std::snprintf(buf, sizeof buf, " %s %.6g", key.c_str(), value.asDouble());
      text += buf;
    }
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    log::info("task eval %s (%s, %lld labelled rows):%s | %.1fs", path.c_str(),
              data.task_kind.c_str(), static_cast<long long>(fields.at("labelled").asInt()),
              text.c_str(), seconds);
    return 0;
  }

  const auto t0 = std::chrono::steady_clock::now();
  train::BatchStats s = train::evaluate(ExecSpace(), model, *loader,
                                        train::evalMaxSteps(*deck, world), MPI_COMM_WORLD);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  log::info("eval %s: loss %.4f | ppl %.3f | %lld tokens, %lld masked, %lld sequences | %.1fs",
            path.c_str(), s.loss(), s.perplexity(), static_cast<long long>(s.tokens),
            static_cast<long long>(s.masked), static_cast<long long>(s.sequences), seconds);
  return 0;
}

}  // namespace plm::cli
