// The planner's input from a deck, and its two printed forms (table and JSON).
#include "core/error.hpp"
#include "data/loader.hpp"
#include "plan/plan.hpp"
#include "train/fsdp.hpp"
#include "train/optim/from_deck.hpp"
#include "train/trainer.hpp"

#include <algorithm>
#include <cstdarg>
#include <cstdio>
#include <numeric>
#include <sstream>

namespace plm::plan {

namespace {

std::string line(const char* format, ...) __attribute__((format(printf, 1, 2)));
std::string line(const char* format, ...) {
  char text[512];
  va_list args;
  va_start(args, format);
  std::vsnprintf(text, sizeof text, format, args);
  va_end(args);
  return text;
}

std::string seconds(double s) {
  if (s >= 1) return line("%.3f s", s);
  if (s >= 1e-3) return line("%.2f ms", s * 1e3);
  return line("%.1f us", s * 1e6);
}

std::string count(double x) {
  if (x >= 1e12) return line("%.3g T", x / 1e12);
  if (x >= 1e9) return line("%.3g G", x / 1e9);
  if (x >= 1e6) return line("%.3g M", x / 1e6);
  if (x >= 1e3) return line("%.3g k", x / 1e3);
  return line("%.3g", x);
}

}  // namespace

Layout layoutFromDeck(const Teuchos::ParameterList& deck, int ranks_per_node, int nodes) {
  Layout l;
  l.ranks_per_node = ranks_per_node;
  l.nodes = nodes;
  if (!deck.isSublist("parallel")) return l;
  const auto& par = deck.sublist("parallel");
  const int world = l.world();
  l.context = par.get<int>("context_degree");
  l.expert = par.get<int>("expert_degree");
  if (l.context > 1) {
    if (world % l.context != 0)
      throw collectiveError("plan: parallel.context_degree " + std::to_string(l.context) +
                            " does not divide the " + std::to_string(world) +
                            " ranks; give --gpus/--nodes for a multiple of it, or --context");
    // The shard groups live inside the ranks of one context position.
    const int shard = par.get<int>("shard_degree");
    l.shard = shard > 0 ? shard : std::max(1, std::min(ranks_per_node, world) / l.context);
  } else {
    l.shard = train::resolveLayout(par.get<int>("shard_degree"), par.get<int>("replicate_degree"),
                                   world, ranks_per_node)
                  .shard;
  }
  return l;
}

int ranksForDeck(const Teuchos::ParameterList& deck) {
  if (!deck.isSublist("parallel")) return 1;
  const auto& par = deck.sublist("parallel");
  const int shard = std::max(1, par.get<int>("shard_degree"));
  const int a = shard * std::max(1, par.get<int>("context_degree"));
  const int b = std::max(1, par.get<int>("expert_degree"));
  const int replicate = par.get<int>("replicate_degree");
  const int lcm = a / std::gcd(a, b) * b;
  // An explicit replicate degree fixes the rank count with the shard degree.
  return replicate > 0 && par.get<int>("shard_degree") > 0
             ? std::max(lcm, shard * replicate * std::max(1, par.get<int>("context_degree")))
             : lcm;
}

Input inputFromDeck(const Teuchos::ParameterList& deck, const Layout& layout, const Rates& rates) {
  Input in;
  in.model = train::modelConfigFromDeck(deck);
  in.compute = parseCompute(deck.sublist("train").get<std::string>("precision"));
  const auto& d = deck.sublist("data");
  in.micro_batch_tokens = d.get<int>("micro_batch_tokens");
  in.micro_batches = data::microBatchesPerStep(d.get<int>("tokens_per_batch"),
                                               in.micro_batch_tokens, layout.dataParallel()) /
                     std::max(1, layout.dataParallel());
  in.mask_prob = d.get<double>("mask_prob");
  // The token-weighted mean length of UniRef-like data (doc/plan.md): 460, less when crops are
  // shorter.
  in.mean_seqlen = std::min(460.0, static_cast<double>(d.get<int>("max_seq_len")));
  in.layout = layout;
  in.rates = rates;
  in.optimizer = train::optimizerOptionsFromDeck(deck.sublist("optimizer"));
  if (deck.isSublist("parallel"))
    in.reshard_after_forward = deck.sublist("parallel").get<bool>("reshard_after_forward");
  in.gather_bf16 = train::gatherInBf16(
      deck.isSublist("parallel") ? deck.sublist("parallel").get<std::string>("gather_dtype")
                                 : std::string("auto"),
      in.compute == Compute::Bf16);
  return in;
}

std::string formatPlan(const Input& in, const Plan& p) {
  std::ostringstream os;
  const auto& c = in.model;
  const Layout& l = in.layout;
  os << line(
      "plm plan: ESM-2 %d layers, hidden %d, %d heads, ffn %d: %lld parameters; %s, "
      "recompute %s\n",
      c.num_layers, c.hidden, c.heads, c.ffn, static_cast<long long>(c.numParameters()),
      computeName(in.compute), model::recomputeName(c.recompute));
  if (c.moe.enabled())
    os << line(
        "  MoE: %d %s experts of width %d, top-%d, every %d layer(s), %d shared; %s; %lld "
        "active parameters per token\n",
        c.moe.experts, model::expertActivationName(c.moe.expert_activation), c.moe.expert_ffn,
        c.moe.top_k, c.moe.every, c.moe.shared_experts,
        c.moe.capacity_factor > 0 ? line("capacity factor %.2f", c.moe.capacity_factor).c_str()
                                  : "dropless",
        static_cast<long long>(c.activeParameters()));
  os << line(
      "  layout: %d rank(s) = %d node(s) x %d; shard %d, context %d, replicate %d, "
      "expert %d; device %s\n",
      l.world(), l.nodes, l.ranks_per_node, l.shard, l.context, l.replicate(), l.expert,
      in.rates.kind.c_str());
  os << line(
      "  batch: %lld tokens per micro-batch, %lld micro-batch(es) per rank and step, "
      "token-weighted mean length S = %.0f, LM head on %.0f%% of rows\n",
      static_cast<long long>(in.micro_batch_tokens), static_cast<long long>(in.micro_batches),
      in.mean_seqlen, 100 * in.mask_prob);
  os << "\nmemory per rank                                   bytes        formula (doc/plan.md)\n";
  for (const auto& item : p.memory)
    os << line("  %-46s %12s  %s\n", item.name.c_str(), bytesText(item.value).c_str(),
               item.formula.c_str());
  os << line("  %-46s %12s  of %s: %s (%.0f%%)\n", "total", bytesText(p.memory_total).c_str(),
             bytesText(p.memory_available).c_str(), p.fits ? "fits" : "DOES NOT FIT",
             100 * p.memory_total / p.memory_available);
  os << "\nFLOPs per token\n";
  os << line("  model (MFU)      %s  6 W + 12 L h S (doc/flops.md)\n",
             count(p.model_flops_per_token).c_str());
  os << line("  hardware (HFU)   %s  model + recomputed forward (doc/plan.md)\n",
             count(p.hardware_flops_per_token).c_str());
  os << "\ntime per optimizer step (per rank)\n";
  for (const auto& item : p.time)
    os << line("  %-34s %10s  %s\n", item.name.c_str(), seconds(item.value).c_str(),
               item.formula.c_str());
  os << line("  %-34s %10s\n", "step", seconds(p.step_seconds).c_str());
  os << line(
      "\npredicted: %s tokens/s (%s per rank), %s tokens per step; MFU %.1f%%, HFU "
      "%.1f%% of %.4g TFLOP/s per rank\n",
      count(p.tokens_per_s).c_str(), count(p.tokens_per_s / l.world()).c_str(),
      count(p.tokens_per_step).c_str(), 100 * p.mfu, 100 * p.hfu, in.rates.peak_tflops);
  os << "rates: " << in.rates.kind << " (" << in.rates.source << ")\n";
  for (const auto& n : p.notes) os << "note: " << n << "\n";
  if (!p.fits) {
    os << "\nit does not fit; each of these would:\n";
    for (const auto& a : p.advice) os << "  - " << a << "\n";
  }
  return os.str();
}

io::json::Value planToJson(const Input& in, const Plan& p) {
  using io::json::Value;
  Value v = Value::object();
  Value model = Value::object();
  model.set("layers", in.model.num_layers);
  model.set("hidden", in.model.hidden);
  model.set("heads", in.model.heads);
  model.set("ffn", in.model.ffn);
  model.set("parameters", in.model.numParameters());
  model.set("precision", computeName(in.compute));
  model.set("recompute", model::recomputeName(in.model.recompute));
  if (in.model.moe.enabled()) {
    Value moe = Value::object();
    moe.set("experts", in.model.moe.experts);
    moe.set("top_k", in.model.moe.top_k);
    moe.set("expert_ffn", in.model.moe.expert_ffn);
    moe.set("expert_activation",
            std::string(model::expertActivationName(in.model.moe.expert_activation)));
    moe.set("every", in.model.moe.every);
    moe.set("shared_experts", in.model.moe.shared_experts);
    moe.set("dropless", in.model.moe.capacity_factor == 0);
    moe.set("capacity_factor", in.model.moe.capacity_factor);
    moe.set("load", p.moe_load);
    moe.set("load_source", p.moe_load_source);
    moe.set("active_parameters", in.model.activeParameters());
    model.set("moe", moe);
  }
  v.set("model", model);
  Value layout = Value::object();
  layout.set("ranks", in.layout.world());
  layout.set("nodes", in.layout.nodes);
  layout.set("ranks_per_node", in.layout.ranks_per_node);
  layout.set("shard", in.layout.shard);
  layout.set("context", in.layout.context);
  layout.set("replicate", in.layout.replicate());
  layout.set("expert", in.layout.expert);
  v.set("layout", layout);
  Value batch = Value::object();
  batch.set("micro_batch_tokens", in.micro_batch_tokens);
  batch.set("micro_batches_per_rank", in.micro_batches);
  batch.set("mean_seqlen", in.mean_seqlen);
  batch.set("mask_prob", in.mask_prob);
  batch.set("fill", in.fill);
  v.set("batch", batch);
  auto items = [](const std::vector<Item>& list) {
    Value a = Value::array();
    for (const auto& item : list) {
      Value e = Value::object();
      e.set("name", item.name);
      e.set("value", item.value);
      e.set("formula", item.formula);
      a.push(e);
    }
    return a;
  };
  Value memory = Value::object();
  memory.set("items", items(p.memory));
  memory.set("total_bytes", p.memory_total);
  memory.set("available_bytes", p.memory_available);
  memory.set("fits", p.fits);
  v.set("memory", memory);
  Value flops = Value::object();
  flops.set("model_per_token", p.model_flops_per_token);
  flops.set("hardware_per_token", p.hardware_flops_per_token);
  v.set("flops", flops);
  Value time = Value::object();
  time.set("items", items(p.time));
  time.set("step_s", p.step_seconds);
  time.set("tokens_per_step", p.tokens_per_step);
  time.set("tokens_per_s", p.tokens_per_s);
  time.set("tokens_per_s_per_rank", p.tokens_per_s / in.layout.world());
  time.set("mfu", p.mfu);
  time.set("hfu", p.hfu);
  v.set("time", time);
  v.set("rates", ratesToJson(in.rates));
  Value notes = Value::array();
  for (const auto& n : p.notes) notes.push(n);
  v.set("notes", notes);
  Value advice = Value::array();
  for (const auto& a : p.advice) advice.push(a);
  v.set("advice", advice);
  return v;
}

}  // namespace plm::plan
