// CPU throughput of Esm2<float>::forwardBackward on synthetic packed micro-batches.
//
//   bench_model [preset|custom] [tokens] [steps] [layers hidden heads ffn] [none|layer|selective]
//   bench_model esm2_8m 16384 5
//   bench_model custom 16384 5 4 160 8 640
//
// Sequence lengths follow doc/anchors.md §6 (exp(N(0,1)*0.7 + ln 300) clamped to [30, 1024],
// specials included), 15% of residues labelled.  Prints tokens/s, achieved GFLOP/s (model FLOPs,
// Esm2Config::trainFlopsPerToken) and the time per kernel label (Kokkos Tools callbacks).
#include "dist/runtime.hpp"
#include "model/esm2.hpp"
#include "model/math.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <map>
#include <string>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;
std::map<std::string, double> g_seconds;
std::vector<std::pair<std::string, Clock::time_point>> g_open;
std::vector<std::string> g_regions;
std::vector<Clock::time_point> g_region_start;

void beginKernel(const char* name, std::uint32_t, std::uint64_t* id) {
  *id = g_open.size();
  g_open.emplace_back(name, Clock::now());
}
void endKernel(std::uint64_t id) {
  g_seconds[g_open[id].first] +=
      std::chrono::duration<double>(Clock::now() - g_open[id].second).count();
  g_open.pop_back();
}
void pushRegion(const char* name) {
  g_regions.push_back(name);
  g_region_start.push_back(Clock::now());
}
void popRegion() {
  if (g_regions.back().rfind("KokkosBlas", 0) == 0)
    g_seconds[g_regions.back()] +=
        std::chrono::duration<double>(Clock::now() - g_region_start.back()).count();
  g_regions.pop_back();
  g_region_start.pop_back();
}

plm::data::MicroBatch syntheticBatch(std::int64_t budget, std::uint64_t seed,
                                     double& weighted_len) {
  using namespace plm;
  std::vector<int> lengths;
  std::int64_t total = 0;
  for (std::uint64_t i = 0;; ++i) {
    int len = static_cast<int>(std::exp(model::math::normal(seed, 1, i) * 0.7 + std::log(300.0)));
    len = std::clamp(len, 30, 1024);
    if (total + len > budget) {
      len = static_cast<int>(budget - total);
      if (len < 3) break;
    }
    lengths.push_back(len);
    total += len;
  }
  data::MicroBatch b;
  b.tokens = HostView1<token_t>("tokens", total);
  b.labels = HostView1<std::int32_t>("labels", total);
  b.cu_seqlens = HostView1<seqlen_t>("cu", lengths.size() + 1);
  std::int64_t t = 0;
  double sq = 0;
  for (std::size_t s = 0; s < lengths.size(); ++s) {
    b.cu_seqlens(s) = static_cast<seqlen_t>(t);
    sq += double(lengths[s]) * lengths[s];
    b.max_seqlen = std::max(b.max_seqlen, lengths[s]);
    for (int i = 0; i < lengths[s]; ++i, ++t) {
      const std::uint64_t h = model::math::hash64(seed * 7919 + t);
      b.tokens(t) = i == 0 ? data::vocab::cls
                           : (i == lengths[s] - 1 ? data::vocab::eos : token_t(4 + h % 20));
      b.labels(t) = data::vocab::ignore_label;
      if (i > 0 && i < lengths[s] - 1 && (h >> 32) % 100 < 15) {
        b.labels(t) = b.tokens(t);
        b.tokens(t) = data::vocab::mask;
        ++b.num_masked;
      }
    }
  }
  b.cu_seqlens(lengths.size()) = static_cast<seqlen_t>(t);
  weighted_len = sq / double(total);
  return b;
}

}  // namespace

int main(int argc, char** argv) {
  plm::dist::Runtime runtime(argc, argv);
  using namespace plm;
  const std::string preset = argc > 1 ? argv[1] : "esm2_8m";
  const std::int64_t tokens = argc > 2 ? std::stoll(argv[2]) : 16384;
  const int steps = argc > 3 ? std::stoi(argv[3]) : 5;
  model::Esm2Config config;
  int next = 4;
  if (preset == "custom") {
    config.num_layers = std::stoi(argv[4]);
    config.hidden = std::stoi(argv[5]);
    config.heads = std::stoi(argv[6]);
    config.ffn = std::stoi(argv[7]);
    next = 8;
  } else {
    config = model::Esm2Config::preset(preset);
  }
  if (argc > next) config.recompute = model::parseRecompute(argv[next]);
  model::Esm2<float> net(config);
  net.initialize(1);
  double weighted_len = 0;
  auto batch = syntheticBatch(tokens, 42, weighted_len);
  net.zeroGradients();
  net.forwardBackward(batch, 1.0 / batch.num_masked);  // warm-up: workspace allocation
  Kokkos::Tools::Experimental::set_begin_parallel_for_callback(&beginKernel);
  Kokkos::Tools::Experimental::set_end_parallel_for_callback(&endKernel);
  Kokkos::Tools::Experimental::set_begin_parallel_reduce_callback(&beginKernel);
  Kokkos::Tools::Experimental::set_end_parallel_reduce_callback(&endKernel);
  Kokkos::Tools::Experimental::set_push_region_callback(&pushRegion);
  Kokkos::Tools::Experimental::set_pop_region_callback(&popRegion);
  const auto start = Clock::now();
  const std::clock_t cpu_start = std::clock();
  double loss = 0;
  for (int s = 0; s < steps; ++s) loss = net.forwardBackward(batch, 1.0 / batch.num_masked);
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  // Process CPU time (all threads): on a shared machine wall time overstates the cost.
  const double cpu_seconds = double(std::clock() - cpu_start) / CLOCKS_PER_SEC;
  const double tok_s = double(batch.numTokens()) * steps / seconds;
  const double flops = config.trainFlopsPerToken(weighted_len) * tok_s;
  std::printf("model %s layers=%d hidden=%d heads=%d ffn=%d recompute=%s params=%.2fM\n",
              preset.c_str(), config.num_layers, config.hidden, config.heads, config.ffn,
              model::recomputeName(config.recompute), config.numParameters() / 1e6);
  std::printf("micro-batch %lld tokens, %d sequences, weighted mean length %.0f, %lld labelled\n",
              (long long)batch.numTokens(), batch.numSequences(), weighted_len,
              (long long)batch.num_masked);
  std::printf(
      "forwardBackward: %.3f s/step, %.0f tokens/s, %.1f GFLOP/s (model FLOPs), loss/token %.3f, "
      "workspace %.0f MiB\n",
      seconds / steps, tok_s, flops / 1e9, loss / batch.num_masked,
      net.workspaceBytes() / 1048576.0);
  std::printf("cpu time: %.3f s/step, %.0f tokens per cpu-second\n", cpu_seconds / steps,
              double(batch.numTokens()) * steps / cpu_seconds);
  std::vector<std::pair<double, std::string>> sorted;
  for (auto& [name, sec] : g_seconds) sorted.emplace_back(sec, name);
  std::sort(sorted.rbegin(), sorted.rend());
  for (auto& [sec, name] : sorted)
    std::printf("  %6.1f%%  %8.4f s/step  %s\n", 100 * sec / seconds, sec / steps, name.c_str());
  return 0;
}
