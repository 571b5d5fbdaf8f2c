// Per-device rates the planner predicts step time from (doc/plan.md, "Rates"): one small JSON
// table per device kind. The tables for h100, h200 and cpu ship in the repository
// (src/plan/rates/*.json, compiled in); `plm plan --rates FILE` reads another one, e.g. one
// measured on a new machine.
//
// Design choice: every rate is an *effective* figure of plm's own kernels (measured with
// `bench_gpu` / `bench_gpu_train` or `plm bench`), not a datasheet peak, so the prediction is
// what plm achieves, and the datasheet peak is kept apart for MFU.
#pragma once

#include "io/json.hpp"

#include <string>
#include <vector>

namespace plm::plan {

struct Rates {
  std::string kind;           // "h100", "h200", "cpu", or the name in a rates file
  std::string source;         // where the figures come from (commit, document section)
  double memory_bytes = 0;    // device memory per rank (cpu: memory a rank may use)
  double reserved_bytes = 0;  // context, library workspaces, allocator slack per rank
  // GEMMs: effective TFLOP/s of a square-ish GEMM of inner size k is
  //   gemm_tflops * k / (k + gemm_half_k)  (half the asymptote at k = gemm_half_k);
  // FP8 GEMMs saturate later (gemm_half_k_fp8), those of fp8.recipe: block at a lower
  // asymptote (gemm_tflops_fp8_block: 128-element scales in the GEMM's main loop).
  double gemm_tflops_fp32 = 0, gemm_tflops_bf16 = 0, gemm_tflops_fp8 = 0;
  double gemm_tflops_fp8_block = 0;
  double gemm_half_k = 0, gemm_half_k_fp8 = 0;
  // Attention (scores and weighted sum, forward + backward, model FLOPs 12 h S per token and
  // layer): attention_tflops * d / (d + attention_half_head_dim) at head dimension d.
  double attention_tflops = 0;
  double attention_half_head_dim = 0;
  double layernorm_gbps = 0;    // LayerNorm forward and backward traffic
  double elementwise_gbps = 0;  // rotary, weight casts, fused bias/GELU epilogues
  // The FP8 GEMMs' operand casts (X and dY to E4M3/E5M2 codes, doc/fp8.md "Casts per
  // micro-batch"): per-tensor scaling (delayed, current) and 128-element block scaling.
  double fp8_cast_gbps = 0, fp8_block_cast_gbps = 0;
  double optimizer_gbps = 0;  // AdamW, gradient norm, gradient zeroing
  double launch_us = 0;       // fixed cost per kernel launch (or per op on the CPU)
  double peak_tflops = 0;     // datasheet peak of the compute precision, for MFU only
  // Collectives: bus bandwidth (NCCL's busbw) per rank within a node and between nodes.
  double intra_node_gbps = 0;
  double inter_node_gbps = 0;
  int ranks_per_node = 1;  // GPUs (or CPU ranks) per node when --nodes is not given
};

/// \brief The built-in table of `kind` ("h100", "h200", "cpu"); throws a collective plm::Error
/// naming the kinds otherwise.
Rates builtinRates(const std::string& kind);
std::vector<std::string> builtinRateKinds();

/// \brief Reads a rates table from a JSON file (the format of src/plan/rates/*.json); missing
/// keys keep the values of `base`. Throws plm::Error naming the file and the key on bad input.
Rates readRates(const std::string& path, const Rates& base);
Rates ratesFromJson(const io::json::Value& v, const Rates& base, const std::string& where);
io::json::Value ratesToJson(const Rates& r);

}  // namespace plm::plan
