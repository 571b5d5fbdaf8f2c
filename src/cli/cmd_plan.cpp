// `plm plan DECK`: memory per rank and predicted step time of the deck's run, before launching
// it (src/plan, doc/plan.md).
#include "cli/args.hpp"
#include "cli/commands.hpp"
#include "core/error.hpp"
#include "deck/deck.hpp"
#include "dist/runtime.hpp"
#include "plan/plan.hpp"

#include <cstdio>
#include <cstdlib>

namespace plm::cli {

namespace {
Parser planParser() {
  Parser p("plm plan",
           "plm plan DECK [--gpus N] [--nodes M] [--gpu h100|h200|cpu] [--json] [options]\n"
           "plm plan --print-rates h100|h200|cpu",
           "Predicts, for the deck's model, precision, recomputation, micro-batch, accumulation "
           "and the parallel layout, the bytes per rank (parameters, gradients, optimizer "
           "states, activations by layer part, buffers) against the device's memory, the FLOPs "
           "per token (MFU and HFU), the step time and tokens/s, and what to change when it "
           "does not fit. Every figure names its formula (doc/plan.md). It reads the deck's "
           "model, moe, fp8, parallel, train and data sections (and --set); the flags below "
           "override them. Exit status: 0 when the run fits, 3 when it does not, 1 on an "
           "error.");
  p.option({"gpus", "N",
            "ranks (GPUs, or CPU ranks) per node (default: the fewest the deck's parallel "
            "degrees need, 1 for a plain deck)"});
  p.option({"nodes", "M", "nodes (default 1)"});
  p.option({"gpu", "KIND", "device rates table: h100 (default), h200 or cpu"});
  p.option({"rates", "FILE", "read the rates table from FILE (JSON; keys as --print-rates)"});
  p.option({"print-rates", "KIND", "print the built-in rates table KIND as JSON and exit"});
  p.option({"shard", "S",
            "shard parameters, gradients and optimizer states over S ranks (default: the "
            "deck's parallel.shard_degree)"});
  p.option({"context", "C",
            "split each micro-batch's tokens over C ranks (default: parallel.context_degree)"});
  p.option({"expert", "E",
            "split the routed experts over E ranks (mixture-of-experts models; default: "
            "parallel.expert_degree)"});
  p.option({"moe-load", "X",
            "MoE under expert parallelism: plan the fullest rank's expert rows at X times the "
            "balanced share (1 = balanced, up to E for collapsed routing; default: the capacity "
            "bound, or 2 when dropless)"});
  p.option({"precision", "P", "override train.precision: fp32, bf16 or fp8"});
  p.option({"seqlen", "S", "token-weighted mean sequence length (default min(460, max_seq_len))"});
  p.option({"inter-node-gbps", "X",
            "bus bandwidth between nodes per rank (its own NIC), GB/s; the table's "
            "inter_node_gbps by default (h100, h200: 45, a 400 Gb/s port per GPU)"});
  p.option({"json", "", "print the plan as JSON"});
  p.option(
      {"set", "SECTION.KEY=VALUE", "override a deck key, e.g. --set model.recompute=layer", true});
  return p;
}

void print(const std::string& text) {
  if (dist::worldRank() == 0) std::fputs(text.c_str(), stdout);
}

double number(const Args& args, const std::string& name, double fallback, double minimum) {
  if (!args.has(name)) return fallback;
  const std::string text = args.get(name);
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  if (end == text.c_str() || *end != '\0' || !(v >= minimum))
    throw collectiveError("plm plan: --" + name + " takes a number >= " + std::to_string(minimum) +
                          ", got `" + text + "`");
  return v;
}

int integer(const Args& args, const std::string& name, int fallback) {
  const double v = number(args, name, fallback, 1);
  if (v != static_cast<int>(v))
    throw collectiveError("plm plan: --" + name + " takes a whole number, got `" + args.get(name) +
                          "`");
  return static_cast<int>(v);
}
}  // namespace

int runPlan(const Argv& argv) {
  Parser parser = planParser();
  Args args = parser.parse(argv);
  if (args.has("help")) {
    print(parser.help());
    return 0;
  }
  if (args.has("print-rates")) {
    print(io::json::write(plan::ratesToJson(plan::builtinRates(args.get("print-rates"))), 2) +
          "\n");
    return 0;
  }
  if (args.positional().size() != 1)
    throw collectiveError("plm plan: give exactly one deck file; see `plm plan --help`");
  // The degree flags override the deck's parallel section (after any --set).
  std::vector<std::string> sets = args.all("set");
  if (args.has("shard")) {
    sets.push_back("parallel.shard_degree=" + std::to_string(integer(args, "shard", 1)));
    sets.push_back("parallel.replicate_degree=0");
  }
  if (args.has("context"))
    sets.push_back("parallel.context_degree=" + std::to_string(integer(args, "context", 1)));
  if (args.has("expert"))
    sets.push_back("parallel.expert_degree=" + std::to_string(integer(args, "expert", 1)));
  // --precision as the deck key, so that the fp8 section (recipe, format, wgrad) is read under
  // it as under train.precision; checked first for its own message.
  if (args.has("precision")) {
    plan::parseCompute(args.get("precision"));
    sets.push_back("train.precision=" + args.get("precision"));
  }
  auto deck = deck::load(args.positional()[0], sets);
  plan::Rates rates = plan::builtinRates(args.get("gpu", "h100"));
  if (args.has("rates")) rates = plan::readRates(args.get("rates"), rates);
  rates.inter_node_gbps = number(args, "inter-node-gbps", rates.inter_node_gbps, 1e-3);
  // Without --gpus, one node with as many ranks as the deck's parallel degrees need.
  const int ranks_per_node = integer(args, "gpus", plan::ranksForDeck(*deck));
  const int nodes = integer(args, "nodes", 1);
  if (rates.kind != "cpu" && ranks_per_node > rates.ranks_per_node)
    throw collectiveError("plm plan: --gpus " + std::to_string(ranks_per_node) +
                          " is more than the " + std::to_string(rates.ranks_per_node) +
                          " ranks per node of the `" + rates.kind +
                          "` table; use --nodes for more, or --rates with ranks_per_node");
  if (args.has("shard") || args.has("context")) {
    const int product = integer(args, "shard", 1) * integer(args, "context", 1);
    if ((ranks_per_node * nodes) % product != 0)
      throw collectiveError("plm plan: " + std::to_string(ranks_per_node * nodes) +
                            " ranks are not a multiple of --shard x --context (" +
                            std::to_string(product) + ")");
  }
  const plan::Layout layout = plan::layoutFromDeck(*deck, ranks_per_node, nodes);
  plan::Input in = plan::inputFromDeck(*deck, layout, rates);
  in.mean_seqlen = number(args, "seqlen", in.mean_seqlen, 1);
  in.moe_load = number(args, "moe-load", 0, 1);
  const plan::Plan p = plan::makePlan(in);
  if (args.has("json"))
    print(io::json::write(plan::planToJson(in, p), 2) + "\n");
  else
    print(plan::formatPlan(in, p));
  // A run that does not fit is a failure a script can see (doc/plan.md).
  return p.fits ? 0 : plan::exit_does_not_fit;
}

}  // namespace plm::cli
