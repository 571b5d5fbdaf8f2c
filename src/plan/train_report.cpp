#include "plan/train_report.hpp"

#include "core/clock.hpp"
#include "core/error.hpp"
#include "core/failure.hpp"
#include "core/log.hpp"
#include "dist/allreduce.hpp"
#include "dist/runtime.hpp"
#include "plan/plan.hpp"
#include "plm/plm_config.hpp"
#include "train/fsdp.hpp"
#include "train/metrics.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <thread>

#if PLM_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace plm::plan {

std::string deviceKind() {
#if PLM_HAVE_CUDA
  int device = 0;
  cudaDeviceProp prop{};
  if (cudaGetDevice(&device) == cudaSuccess &&
      cudaGetDeviceProperties(&prop, device) == cudaSuccess &&
      std::string(prop.name).find("H200") != std::string::npos)
    return "h200";
  return "h100";
#else
  return "cpu";
#endif
}

namespace {
struct Window {
  int seen = 0;
  double t0 = 0;
  std::int64_t tokens = 0;
  double sum_sq = 0;
  bool done = false;
};

}  // namespace

Input inputOfRun(const train::Trainer& trainer) {
  int ranks_per_node = std::max(1, dist::localSize());
  int nodes = std::max(1, trainer.world() / ranks_per_node);
  if (ranks_per_node * nodes != trainer.world()) {
    ranks_per_node = trainer.world();
    nodes = 1;
  }
  // The deck's parallel degrees (shard, context, expert) over this job's ranks: the layout the
  // trainer built.
  const Layout layout = layoutFromDeck(trainer.deck(), ranks_per_node, nodes);
  Rates rates = builtinRates(deviceKind());
  // A measured table (plm bench rates --out FILE) replaces the built-in one.
  if (const char* path = std::getenv("PLM_RATES"); path && *path) rates = readRates(path, rates);
  // CPU ranks share the node's cores (the planner slows them when oversubscribed); GPUs are
  // one per rank.
  rates.ranks_per_node = rates.kind == "cpu"
                             ? static_cast<int>(std::max(1u, std::thread::hardware_concurrency()))
                             : std::max(rates.ranks_per_node, layout.ranks_per_node);
  return inputFromDeck(trainer.deck(), layout, rates);
}

double measuredMoeLoad(const std::vector<std::vector<double>>& routed, int experts, int degree) {
  // Rank position q of every expert group holds experts [q E/E_p, (q+1) E/E_p); its rows over
  // the balanced share are E_p sum_{e of q} routed_e / sum_e routed_e per layer.  The buffers
  // grow with the sum over layers, so the fullest position's mean over the layers.
  if (routed.empty() || degree <= 1 || experts % degree != 0) return 0;
  const int per = experts / degree;
  double worst = 0;
  for (int q = 0; q < degree; ++q) {
    double sum = 0;
    for (const auto& layer : routed) {
      double all = 0, mine = 0;
      for (int e = 0; e < static_cast<int>(layer.size()); ++e) {
        all += layer[e];
        if (e / per == q) mine += layer[e];
      }
      sum += all > 0 ? degree * mine / all : 1.0;
    }
    worst = std::max(worst, sum / static_cast<double>(routed.size()));
  }
  return worst;
}

void logMemoryPlan(const train::Trainer& trainer) {
  Plan p;
  try {
    p = makePlan(inputOfRun(trainer));
  } catch (const Error& e) {
    if (trainer.rank() == 0) log::warn("plan: no memory plan: %s", e.what());
    return;
  }
  // An out-of-memory message quotes it (core/failure.hpp).
  char load[64] = "";
  if (p.moe_load > 0 && inputOfRun(trainer).layout.expert > 1)
    std::snprintf(load, sizeof load, " (MoE expert rows at load %.2f)", p.moe_load);
  failure::setPlanNote("planned for this run: " + bytesText(p.memory_allocated) +
                       " of buffers per rank" + load);
  if (trainer.rank() != 0) return;
  std::string items;
  for (const auto& item : p.memory)
    if (item.allocated) items += "; " + item.name + " " + bytesText(item.value);
  log::info("memory: planned per rank %s of buffers (%s in all with the runtime)%s",
            bytesText(p.memory_allocated).c_str(), bytesText(p.memory_total).c_str(),
            items.c_str());
  if (p.moe_load > 0 && !p.moe_load_source.empty())
    log::info("memory: MoE expert rows planned at load %.2f: %s", p.moe_load,
              p.moe_load_source.c_str());
}

train::Trainer::StepHook predictionReport(int window, train::Trainer::StepHook next) {
  auto w = std::make_shared<Window>();
  return [w, window, next](train::Trainer& trainer, const train::StepStats& st) {
    if (next) next(trainer, st);
    if (w->done) return;
    w->seen += 1;
    if (w->seen == 1) {  // the first step pays for allocations and warm-up
      // Its measured peak of the buffers against the plan (collective); MoE under expert
      // parallelism: planned at the load this step's routing put on the fullest rank.
      const double peak =
          dist::allreduceMax(static_cast<double>(trainer.firstStepPeak()), trainer.comm());
      double planned = 0, load = 0;
      try {
        Input in = inputOfRun(trainer);
        load = measuredMoeLoad(trainer.moe().lastRouted(), in.model.moe.experts, in.layout.expert);
        if (load > 0) in.moe_load = std::max(1.0, load);
        planned = makePlan(in).memory_allocated;
      } catch (const Error&) {
      }
      char at_load[64] = "";
      if (load > 0) std::snprintf(at_load, sizeof at_load, " at the measured MoE load %.2f", load);
      if (trainer.rank() == 0 && peak > 0 && planned > 0)
        log::info(
            "memory: first step peak of the buffers %s on the fullest rank, planned %s "
            "(%+.1f%%%s; plm plan, doc/plan.md)",
            bytesText(peak).c_str(), bytesText(planned).c_str(), 100 * (planned / peak - 1),
            at_load);
      w->t0 = clock::steadySeconds();
      return;
    }
    w->tokens += st.tokens;
    w->sum_sq += st.sum_sq_seqlen;
    const bool last = trainer.state().step >= trainer.totalSteps();
    if (w->seen < window + 1 && !last) return;
    w->done = true;
    const double seconds = clock::steadySeconds() - w->t0;
    const double mem =
        dist::allreduceMax(static_cast<double>(train::memoryInUse()), trainer.comm());
    const double steps = w->seen - 1;
    Rates rates;
    Input in;
    Plan p;
    Layout layout;
    double load = 0;  // MoE under expert parallelism: the last step's load on the fullest rank
    try {
      in = inputOfRun(trainer);
      rates = in.rates;
      layout = in.layout;
      load = measuredMoeLoad(trainer.moe().lastRouted(), in.model.moe.experts, layout.expert);
      if (load > 0) in.moe_load = std::max(1.0, load);
      if (w->tokens > 0) {
        in.mean_seqlen = w->sum_sq / static_cast<double>(w->tokens);
        in.fill = static_cast<double>(w->tokens) /
                  (steps * static_cast<double>(in.micro_batch_tokens * in.micro_batches) *
                   layout.dataParallel());
      }
      p = makePlan(in);
    } catch (const Error& e) {
      if (trainer.rank() == 0) log::warn("plan: no prediction: %s", e.what());
      return;
    }
    const double measured_tps = seconds > 0 ? static_cast<double>(w->tokens) / seconds : 0;
    if (trainer.rank() != 0) return;
    char at_load[64] = "";
    if (load > 0) std::snprintf(at_load, sizeof at_load, ", MoE load %.2f", load);
    log::info(
        "plan vs measured (steps 2-%d): %.0f tok/s predicted, %.0f measured (%+.1f%%); "
        "memory per rank %s predicted, %s measured (%+.1f%%); S = %.0f, fill %.2f%s, %s rates "
        "(plm plan, doc/plan.md)",
        w->seen, p.tokens_per_s, measured_tps,
        measured_tps > 0 ? 100 * (p.tokens_per_s / measured_tps - 1) : 0.0,
        bytesText(p.memory_total).c_str(), bytesText(mem).c_str(),
        mem > 0 ? 100 * (p.memory_total / mem - 1) : 0.0, in.mean_seqlen, in.fill, at_load,
        rates.kind.c_str());
    io::json::Value v = planToJson(in, p);
    io::json::Value measured = io::json::Value::object();
    measured.set("steps", steps);
    measured.set("seconds", seconds);
    measured.set("tokens", w->tokens);
    measured.set("tokens_per_s", measured_tps);
    measured.set("mem_bytes", mem);
    v.set("measured", measured);
    std::ofstream out(trainer.runDir() + "/plan.json");
    out << io::json::write(v, 2) << "\n";
    if (!out) log::warn("plan: cannot write %s/plan.json", trainer.runDir().c_str());
  };
}

}  // namespace plm::plan
