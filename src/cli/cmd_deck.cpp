// `plm deck`: the schema's three printed forms (commented defaults, Markdown reference) and a
// checker that prints a deck resolved, so a user can see exactly what `plm train` would run.
#include "cli/args.hpp"
#include "cli/commands.hpp"
#include "core/error.hpp"
#include "core/log.hpp"
#include "deck/deck.hpp"
#include "dist/runtime.hpp"
#include "train/trainer.hpp"

#include <cstdio>

namespace plm::cli {

namespace {
Parser deckParser() {
  Parser p("plm deck",
           "plm deck --defaults | --markdown | --check DECK [--set section.key=value]...",
           "Prints the complete default deck with a comment per key (--defaults), the deck "
           "reference in Markdown that doc/deck.md holds (--markdown), or checks a YAML/XML deck "
           "and prints it resolved, defaults filled in (--check; exit 1 with one message if it "
           "is invalid).");
  p.option({"defaults", "", "print every key with its default and documentation"});
  p.option({"markdown", "", "print the deck reference (doc/deck.md) in Markdown"});
  p.option({"check", "DECK", "validate DECK (.yaml, .yml or .xml) and print it resolved"});
  p.option({"set", "SECTION.KEY=VALUE", "override a key of the checked deck", true});
  return p;
}

void print(const std::string& text) {
  if (dist::worldRank() == 0) std::fputs(text.c_str(), stdout);
}

/// The model section as `plm train` builds the model: a preset's sizes (and an MoE preset's
/// experts) written in place of the zeros that mean "the preset's", which give the same model
/// when read back.
void fillModelSizes(Teuchos::ParameterList& deck, const model::Esm2Config& c) {
  auto& m = deck.sublist("model");
  m.set("layers", c.num_layers);
  m.set("hidden", c.hidden);
  m.set("heads", c.heads);
  m.set("ffn", c.ffn);
  if (!c.moe.enabled()) return;
  auto& moe = deck.sublist("moe");
  moe.set("experts", c.moe.experts);
  moe.set("top_k", c.moe.top_k);
  moe.set("every", c.moe.every);
  moe.set("expert_ffn", c.moe.expert_ffn);
  moe.set("expert_activation", std::string(model::expertActivationName(c.moe.expert_activation)));
}

std::string parameterCount(std::int64_t n) {
  char text[32];
  if (n >= 1000000000)
    std::snprintf(text, sizeof text, "%.2fB", n / 1e9);
  else
    std::snprintf(text, sizeof text, "%.1fM", n / 1e6);
  return text;
}
}  // namespace

int runDeck(const Argv& argv) {
  Parser parser = deckParser();
  Args args = parser.parse(argv);
  if (args.has("help")) {
    print(parser.help());
    return 0;
  }
  int modes = int(args.has("defaults")) + int(args.has("markdown")) + int(args.has("check"));
  if (modes != 1 || !args.positional().empty())
    throw collectiveError(
        "plm deck: give exactly one of --defaults, --markdown or --check DECK; "
        "see `plm deck --help`");
  if (args.has("set") && !args.has("check"))
    throw collectiveError("plm deck: --set applies to --check DECK");
  if (args.has("defaults")) {
    print(deck::defaultsYaml());
  } else if (args.has("markdown")) {
    print(deck::referenceMarkdown());
  } else {
    auto resolved = deck::load(args.get("check"), args.all("set"));
    const model::Esm2Config config = train::modelConfigFromDeck(*resolved);
    fillModelSizes(*resolved, config);
    log::info("# %s: valid; resolved with every default and the preset's sizes filled in",
              args.get("check").c_str());
    std::string sizes = "# model: " + resolved->sublist("model").get<std::string>("preset") + ", " +
                        parameterCount(config.numParameters()) + " parameters";
    if (config.moe.enabled())
      sizes += " (" + parameterCount(config.activeParameters()) + " active per token)";
    print(sizes + "\n" + deck::toYaml(*resolved));
  }
  return 0;
}

}  // namespace plm::cli
