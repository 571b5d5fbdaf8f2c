// The built-in rates tables (doc/plan.md, "Rates") and their JSON form.
//
// The tables are JSON text here, the same format `plm plan --rates FILE` reads and
// `plm plan --print-rates KIND` writes, so a table measured on a new machine is a file edit.
#include "plan/rates.hpp"

#include "core/error.hpp"

#include <fstream>
#include <map>
#include <sstream>

namespace plm::plan {

namespace {

// H100 80GB HBM3 (SXM), plm bf16 at 2492b5c, doc/performance.md "GPU: one model, every
// backend". Fitted, not datasheet: gemm_* from the 8192^3 ceiling (769.6) and the 650M split
// (160.5 ms for 94 TFLOP at h = 1280: 586 TFLOP/s); attention_* from the 650M split (50.1 ms
// at d = 64) and the 8M step (d = 16); layernorm from the 650M split (32.0 ms); elementwise
// from its "other fused" 12.2 ms; optimizer from AdamW over 651M parameters (2.62 TB/s).
// NVLink 4: NCCL all-reduce bus bandwidth on 8 H100 SXM.  Between nodes: one 400 Gb/s
// InfiniBand NDR port per GPU (the DGX/HGX H100 and H200 layout, 8 per node): 50 GB/s line
// rate, taken at 45 GB/s of NCCL bus bandwidth per rank (not measured here: no multi-node
// machine; `--inter-node-gbps` or a rates file replaces it).  FP8: the measured 8192^3 FP8
// ceiling (cuBLASLt E4M3 -> bf16, 1454 TFLOP/s, doc/anchors.md) as the asymptote, and the H200
// fit's half-rate K (3d5a9dc, FP8 dgrad without the dGELU epilogue) and block asymptote (same
// SMs and clocks); the casts at the H200's rates x 3.35/4.8 (HBM3).  The attention and
// LayerNorm rates are the 2492b5c fit's: the faster kernels since are not measured on an H100.
const char* kH100 = R"({
  "kind": "h100",
  "source": "fitted to doc/performance.md (H100, plm bf16, commit 2492b5c): 650M kernel split and 8M step",
  "memory_gib": 79.65,
  "reserved_gib": 0.55,
  "gemm_tflops_fp32": 0.25,
  "gemm_tflops_bf16": 770,
  "gemm_tflops_fp8": 1454,
  "gemm_tflops_fp8_block": 1180,
  "gemm_half_k": 402,
  "gemm_half_k_fp8": 380,
  "attention_tflops": 162,
  "attention_half_head_dim": 29.5,
  "layernorm_gbps": 1410,
  "elementwise_gbps": 2300,
  "fp8_cast_gbps": 1675,
  "fp8_block_cast_gbps": 1255,
  "optimizer_gbps": 2600,
  "launch_us": 5,
  "peak_tflops": 989,
  "intra_node_gbps": 360,
  "inter_node_gbps": 45,
  "ranks_per_node": 8
})";

// H200 (141 GB HBM3e, 4.8 TB/s): the H100's compute rates (same SMs and clocks) and the H100's
// memory-bound rates scaled by the HBM bandwidth ratio 4.8 / 3.35, except those fitted on one
// H200: the FP8 cast rates and the part of the step outside forward + backward (AdamW, gradient
// norm, zeroing: 36 bytes per parameter at 2.75 TB/s) to bench_gpu_train at 4bf21f5; FP8 GEMMs
// (gemm_half_k_fp8 380 under the 1454 asymptote: 1124 TFLOP/s at k = 1280, 1266 at 2560; block
// scaling's 1.23x slower), attention (190 TFLOP/s d/(d + 20): cuDNN at d = 64 and the own flash
// kernels at 16 and 24) and LayerNorm (2.9 TB/s) to `plm train` at 3d5a9dc (doc/plan.md,
// "Prediction against measurement": 650M bf16, FP8 delayed and block, 3B bf16 and FP8, 8M, 35M
// within -5% to +6% of their median tokens/s).  Links as the H100's (NVLink 4; one 400 Gb/s NDR
// port per GPU between nodes).
const char* kH200 = R"({
  "kind": "h200",
  "source": "H100 table with memory-bound rates x 4.8/3.35 (HBM3e); FP8 cast and optimizer rates fitted to bench_gpu_train on one H200 at commit 4bf21f5; FP8 GEMM, attention and LayerNorm rates to plm train at 3d5a9dc",
  "memory_gib": 139.8,
  "reserved_gib": 0.55,
  "gemm_tflops_fp32": 0.25,
  "gemm_tflops_bf16": 770,
  "gemm_tflops_fp8": 1454,
  "gemm_tflops_fp8_block": 1180,
  "gemm_half_k": 402,
  "gemm_half_k_fp8": 380,
  "attention_tflops": 190,
  "attention_half_head_dim": 20,
  "layernorm_gbps": 2900,
  "elementwise_gbps": 3300,
  "fp8_cast_gbps": 2400,
  "fp8_block_cast_gbps": 1800,
  "optimizer_gbps": 2750,
  "launch_us": 5,
  "peak_tflops": 989,
  "intra_node_gbps": 360,
  "inter_node_gbps": 45,
  "ranks_per_node": 8
})";

// One CPU rank (one core, fp32, OpenBLAS with one thread): the quickstart's 0.079-0.087
// TFLOP/s per rank and the start-up sgemm 512^3 (0.089), doc/performance.md "CPU training";
// reserved: the resident size of a `plm train` rank beyond its model buffers (MPI, Kokkos,
// OpenBLAS, HDF5): 39-46 MiB measured (quickstart deck and the scaling study's tiny model).
// fp8 is emulated in fp32 here: its GEMM and cast rates are the fp32 GEMM and elementwise ones.
const char* kCpu = R"({
  "kind": "cpu",
  "source": "development container (AMD EPYC, AVX-512), doc/performance.md CPU training; per rank = one core",
  "memory_gib": 8,
  "reserved_gib": 0.041,
  "gemm_tflops_fp32": 0.1,
  "gemm_tflops_bf16": 0.1,
  "gemm_tflops_fp8": 0.1,
  "gemm_tflops_fp8_block": 0.1,
  "gemm_half_k": 48,
  "gemm_half_k_fp8": 48,
  "attention_tflops": 0.03,
  "attention_half_head_dim": 16,
  "layernorm_gbps": 6,
  "elementwise_gbps": 6,
  "fp8_cast_gbps": 6,
  "fp8_block_cast_gbps": 6,
  "optimizer_gbps": 6,
  "launch_us": 2,
  "peak_tflops": 0.083,
  "intra_node_gbps": 5,
  "inter_node_gbps": 10,
  "ranks_per_node": 2
})";

const std::map<std::string, const char*>& tables() {
  static const std::map<std::string, const char*> t = {
      {"h100", kH100}, {"h200", kH200}, {"cpu", kCpu}};
  return t;
}

constexpr double kGiB = 1024.0 * 1024 * 1024;

}  // namespace

std::vector<std::string> builtinRateKinds() { return {"h100", "h200", "cpu"}; }

Rates ratesFromJson(const io::json::Value& v, const Rates& base, const std::string& where) {
  if (!v.isObject())
    throw collectiveError(where + ": a rates table is a JSON object (doc/plan.md, \"Rates\")");
  Rates r = base;
  static const std::map<std::string, double Rates::*> numbers = {
      {"gemm_tflops_fp32", &Rates::gemm_tflops_fp32},
      {"gemm_tflops_bf16", &Rates::gemm_tflops_bf16},
      {"gemm_tflops_fp8", &Rates::gemm_tflops_fp8},
      {"gemm_tflops_fp8_block", &Rates::gemm_tflops_fp8_block},
      {"gemm_half_k", &Rates::gemm_half_k},
      {"gemm_half_k_fp8", &Rates::gemm_half_k_fp8},
      {"attention_tflops", &Rates::attention_tflops},
      {"attention_half_head_dim", &Rates::attention_half_head_dim},
      {"layernorm_gbps", &Rates::layernorm_gbps},
      {"elementwise_gbps", &Rates::elementwise_gbps},
      {"fp8_cast_gbps", &Rates::fp8_cast_gbps},
      {"fp8_block_cast_gbps", &Rates::fp8_block_cast_gbps},
      {"optimizer_gbps", &Rates::optimizer_gbps},
      {"launch_us", &Rates::launch_us},
      {"peak_tflops", &Rates::peak_tflops},
      {"intra_node_gbps", &Rates::intra_node_gbps},
      {"inter_node_gbps", &Rates::inter_node_gbps},
  };
  for (const auto& [key, value] : v.members()) {
    auto number = [&]() {
      if (!value.isNumber()) throw collectiveError(where + ": `" + key + "` must be a number");
      const double x = value.asDouble();
      if (!(x >= 0)) throw collectiveError(where + ": `" + key + "` must be >= 0");
      return x;
    };
    if (key == "kind" || key == "source") {
      if (!value.isString()) throw collectiveError(where + ": `" + key + "` must be a string");
      (key == "kind" ? r.kind : r.source) = value.asString();
    } else if (key == "memory_gib") {
      r.memory_bytes = number() * kGiB;
    } else if (key == "reserved_gib") {
      r.reserved_bytes = number() * kGiB;
    } else if (key == "ranks_per_node") {
      r.ranks_per_node = static_cast<int>(number());
    } else if (auto it = numbers.find(key); it != numbers.end()) {
      r.*(it->second) = number();
    } else {
      throw collectiveError(where + ": unknown key `" + key +
                            "` (doc/plan.md, \"Rates\", lists the keys)");
    }
  }
  return r;
}

Rates builtinRates(const std::string& kind) {
  auto it = tables().find(kind);
  if (it == tables().end())
    throw collectiveError("plan: no rates table for device `" + kind +
                          "`; use h100, h200 or cpu, or give a table with --rates FILE");
  return ratesFromJson(io::json::parse(it->second, "built-in rates " + kind), Rates{},
                       "built-in rates " + kind);
}

Rates readRates(const std::string& path, const Rates& base) {
  std::ifstream in(path);
  if (!in)
    throw collectiveError("plan: cannot read the rates file `" + path +
                          "`; check the path (doc/plan.md, \"Rates\", shows the format)");
  std::stringstream text;
  text << in.rdbuf();
  return ratesFromJson(io::json::parse(text.str(), path), base, path);
}

io::json::Value ratesToJson(const Rates& r) {
  io::json::Value v = io::json::Value::object();
  v.set("kind", r.kind);
  v.set("source", r.source);
  v.set("memory_gib", r.memory_bytes / kGiB);
  v.set("reserved_gib", r.reserved_bytes / kGiB);
  v.set("gemm_tflops_fp32", r.gemm_tflops_fp32);
  v.set("gemm_tflops_bf16", r.gemm_tflops_bf16);
  v.set("gemm_tflops_fp8", r.gemm_tflops_fp8);
  v.set("gemm_tflops_fp8_block", r.gemm_tflops_fp8_block);
  v.set("gemm_half_k", r.gemm_half_k);
  v.set("gemm_half_k_fp8", r.gemm_half_k_fp8);
  v.set("attention_tflops", r.attention_tflops);
  v.set("attention_half_head_dim", r.attention_half_head_dim);
  v.set("layernorm_gbps", r.layernorm_gbps);
  v.set("elementwise_gbps", r.elementwise_gbps);
  v.set("fp8_cast_gbps", r.fp8_cast_gbps);
  v.set("fp8_block_cast_gbps", r.fp8_block_cast_gbps);
  v.set("optimizer_gbps", r.optimizer_gbps);
  v.set("launch_us", r.launch_us);
  v.set("peak_tflops", r.peak_tflops);
  v.set("intra_node_gbps", r.intra_node_gbps);
  v.set("inter_node_gbps", r.inter_node_gbps);
  v.set("ranks_per_node", r.ranks_per_node);
  return v;
}

}  // namespace plm::plan
