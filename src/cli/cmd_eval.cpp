// `plm eval DECK [--set ...]`: masked-LM loss and perplexity of a model on a dataset, with the
// deck's masking (deterministic: epoch-0 masks of data.seed) and batching.
#include "cli/args.hpp"
#include "cli/commands.hpp"
#include "core/error.hpp"
#include "core/log.hpp"
#include "deck/deck.hpp"
#include "dist/runtime.hpp"
#include "train/step.hpp"
#include "train/trainer.hpp"

#include <chrono>
#include <cstdio>

namespace plm::cli {

namespace {
Parser evalParser() {
  Parser p("plm eval", "plm eval DECK [--data PATH] [--max-tokens N] [--set section.key=value]...",
           "Evaluates the deck's model on a dataset (default: data.valid) and prints the "
           "masked-token cross-entropy and perplexity. Without a model file the model is the "
           "deck's freshly initialised one (train.seed): the untrained baseline.");
  p.option({"data", "PATH", "dataset written by `plm prep` (default: data.valid of the deck)"});
  p.option({"max-tokens", "N", "evaluate at most about N tokens (default: data.valid_tokens, 0 = all)"});
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
  if (path.empty())
    throw collectiveError("plm eval: the deck has no data.valid; pass --data PATH");

  const int rank = dist::worldRank(), world = dist::worldSize();
  model::Esm2Config config = train::modelConfigFromDeck(*deck);
  model::Esm2<param_t> model(config);
  const int seed = deck->sublist("train").get<int>("seed");
  model.initialize(static_cast<std::uint64_t>(seed));
  log::info("eval: freshly initialised model (train.seed %d), %lld parameters: the untrained "
            "baseline",
            seed, static_cast<long long>(config.numParameters()));

  data::Loader loader(train::evalLoaderOptions(*deck, path, rank, world));
  const auto t0 = std::chrono::steady_clock::now();
  train::BatchStats s = train::evaluate(ExecSpace(), model, loader,
                                        train::evalMaxSteps(*deck, world), MPI_COMM_WORLD);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  log::info("eval %s: loss %.4f | ppl %.3f | %lld tokens, %lld masked, %lld sequences | %.1fs",
            path.c_str(), s.loss(), s.perplexity(), static_cast<long long>(s.tokens),
            static_cast<long long>(s.masked), static_cast<long long>(s.sequences), seconds);
  return 0;
}

}  // namespace plm::cli
