// The planner's formulas (doc/plan.md): memory per rank, FLOPs per token, step time, advice.
// Each Item carries the formula it evaluates, so `plm plan` prints where every figure comes from.
#include "plan/plan.hpp"

#include "core/error.hpp"
#include "train/fsdp.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <map>

namespace plm::plan {

namespace {

std::int64_t round16(std::int64_t n) { return (n + 15) / 16 * 16; }
std::int64_t round256(std::int64_t bytes) { return (bytes + 255) / 256 * 256; }

std::string fmt(const char* format, double a, double b = 0, double c = 0, double d = 0) {
  char text[256];
  std::snprintf(text, sizeof text, format, a, b, c, d);
  return text;
}

// Bytes of one element by role (doc/plan.md, "Precision roles"): master and residual stream in
// fp32; compute copies and stored activations in the compute type; statistics (LayerNorm mean
// and 1/std, log-sum-exp) in fp32 under bf16 and in the master type under fp32.
struct Sizes {
  std::int64_t master = 4, compute = 4, stats = 4;
  bool fused_qkv = false;  // bf16: q, k, v in one (t, 3h) allocation
};

Sizes sizesOf(Compute c) {
  Sizes s;
  if (c != Compute::Fp32) {
    s.compute = 2;
    s.fused_qkv = true;
  }
  return s;
}

}  // namespace

Compute parseCompute(const std::string& name) {
  if (name == "fp32") return Compute::Fp32;
  if (name == "bf16") return Compute::Bf16;
  if (name == "fp8") return Compute::Fp8;
  throw collectiveError("plan: precision `" + name + "` is not one of fp32, bf16, fp8");
}

const char* computeName(Compute c) {
  switch (c) {
    case Compute::Fp32: return "fp32";
    case Compute::Bf16: return "bf16";
    case Compute::Fp8: return "fp8";
  }
  return "?";
}

std::int64_t layerParameterCount(const model::Esm2Config& c) {
  const std::int64_t h = c.hidden, f = c.ffn;
  return 4 * (round16(h * h) + round16(h)) + 2 * 2 * round16(h) + round16(f * h) + round16(f) +
         round16(h * f) + round16(h);
}

std::int64_t flatParameterCount(const model::Esm2Config& c) {
  const std::int64_t h = c.hidden, v = c.vocab;
  return round16(v * h) + c.num_layers * layerParameterCount(c) + 2 * round16(h) + round16(h * h) +
         round16(h) + 2 * round16(h) + round16(v);
}

// The bf16 compute copy of the GEMM weights (Esm2's packed copy, src/model/esm2.cpp bind()),
// per group: the embeddings, one layer, the head.
struct ComputeCopy {
  std::int64_t embed = 0, layer = 0, head = 0;
};
ComputeCopy computeCopyParts(const model::Esm2Config& c) {
  const std::int64_t h = c.hidden, f = c.ffn, v = c.vocab;
  ComputeCopy n;
  n.layer = round16(3 * h * h) + round16(3 * h) + round16(h * h) + round16(f * h) + round16(f) +
            round16(h * f);
  n.embed = round16(v * h);
  n.head = round16(h * h) + round16(h);
  return n;
}

std::int64_t computeCopyCount(const model::Esm2Config& c) {
  const ComputeCopy n = computeCopyParts(c);
  return n.embed + c.num_layers * n.layer + n.head;
}

Activations activationBytes(const model::Esm2Config& config, Compute compute, std::int64_t t,
                            std::int64_t m, bool backward) {
  // The same allocations, in the same sizes, as Esm2::Impl::carve (src/model/esm2.cpp): each
  // rounded up to 256 bytes.
  const Sizes s = sizesOf(compute);
  const std::int64_t h = config.hidden, f = config.ffn, nh = config.heads, v = config.vocab;
  const std::int64_t L = config.num_layers;
  auto mat = [](std::int64_t rows, std::int64_t cols, std::int64_t bytes) {
    return round256(rows * cols * bytes);
  };
  auto qkv = [&](std::int64_t rows) {
    return s.fused_qkv ? mat(rows, 3 * h, s.compute) : 3 * mat(rows, h, s.compute);
  };
  Activations a;
  a.residual = mat(t, 1, s.master) + (L + 1) * mat(t, h, s.master);
  const auto attention_full = mat(t, h, s.compute) + 2 * mat(t, 1, s.stats) + qkv(t) +
                              mat(t, h, s.compute) + mat(t, nh, s.stats);
  const auto mlp_full = mat(t, h, s.master) + mat(t, h, s.compute) + 2 * mat(t, 1, s.stats) +
                        2 * mat(t, f, s.compute);
  const model::Recompute mode = backward ? config.recompute : model::Recompute::Layer;
  if (mode == model::Recompute::None) {
    a.attention = L * attention_full;
    a.mlp = L * mlp_full;
  } else if (mode == model::Recompute::Layer) {
    a.attention = attention_full;
    a.mlp = mlp_full;
  } else {  // selective: GEMM outputs per layer, LayerNorm outputs and attention shared
    a.attention = mat(t, h, s.compute) + 2 * mat(t, 1, s.stats) + mat(t, h, s.compute) +
                  mat(t, nh, s.stats) + L * qkv(t);
    a.mlp = mat(t, h, s.compute) + 2 * mat(t, 1, s.stats) +
            L * (mat(t, h, s.master) + 2 * mat(t, f, s.compute));
  }
  const bool bf16 = compute != Compute::Fp32;
  const std::int64_t logits_ld = bf16 ? 40 : v;
  a.head = mat(t, h, s.compute) + 2 * mat(t, 1, s.stats) + 4 * mat(m, h, s.compute) +
           2 * mat(m, 1, s.stats) + mat(m, logits_ld, s.master) +
           (bf16 ? mat(m, logits_ld, s.compute) : 0);
  if (backward) {
    a.backward = mat(t, h, s.master) + (bf16 ? mat(t, h, s.compute) : 0) + mat(t, h, s.master) +
                 (bf16 ? mat(t, h, s.compute) : 0) + mat(t, h, s.compute) + qkv(t) +
                 mat(t, nh, s.stats) + mat(t, f, s.compute) + mat(t, h, s.compute) +
                 3 * mat(m, h, s.compute);
  }
  return a;
}

namespace {

double gemmRate(const Rates& r, Compute c, double k) {
  const double asymptote = c == Compute::Fp32   ? r.gemm_tflops_fp32
                           : c == Compute::Bf16 ? r.gemm_tflops_bf16
                                                : r.gemm_tflops_fp8;
  return asymptote * 1e12 * k / (k + r.gemm_half_k);
}

double attentionRate(const Rates& r, double head_dim) {
  return r.attention_tflops * 1e12 * head_dim / (head_dim + r.attention_half_head_dim);
}

void checkLayout(const Input& in) {
  const Layout& l = in.layout;
  auto positive = [](int v, const char* what) {
    if (v < 1)
      throw collectiveError(std::string("plan: ") + what + " must be at least 1, got " +
                            std::to_string(v));
  };
  positive(l.ranks_per_node, "--gpus (ranks per node)");
  positive(l.nodes, "--nodes");
  positive(l.shard, "--shard");
  positive(l.context, "--context");
  positive(l.expert, "--expert");
  if (l.world() % (l.shard * l.context) != 0)
    throw collectiveError("plan: " + std::to_string(l.world()) +
                          " ranks cannot be split into shard " + std::to_string(l.shard) +
                          " x context " + std::to_string(l.context) +
                          " groups; choose degrees whose product divides the rank count");
  if (l.expert != 1)
    throw collectiveError("plan: --expert " + std::to_string(l.expert) +
                          " needs a mixture-of-experts model; ESM-2 is dense (use --expert 1)");
  if (in.micro_batch_tokens < 1 || in.micro_batches < 1)
    throw collectiveError("plan: micro-batch tokens and micro-batches per step must be positive");
  if (in.micro_batch_tokens % l.context != 0)
    throw collectiveError("plan: data.micro_batch_tokens (" +
                          std::to_string(in.micro_batch_tokens) +
                          ") must be a multiple of --context " + std::to_string(l.context));
  if (!(in.rates.memory_bytes > 0) || !(in.rates.gemm_tflops_bf16 > 0))
    throw collectiveError("plan: the rates table `" + in.rates.kind +
                          "` has no memory size or GEMM rate; see doc/plan.md, \"Rates\"");
}

// Memory per rank (doc/plan.md, "Memory").
void planMemory(const Input& in, Plan& p) {
  const auto& c = in.model;
  const Layout& l = in.layout;
  const bool bf16 = in.compute != Compute::Fp32;
  // The model state: the same formula the sharding engine reports (train::shardedMemory).
  train::ShardSizes n;
  n.flat = flatParameterCount(c);
  n.layer_unit = layerParameterCount(c);
  n.embed_unit = round16(c.vocab * c.hidden);
  n.head_unit = n.flat - n.embed_unit - c.num_layers * n.layer_unit;
  n.layers = c.num_layers;
  const train::FsdpMemory state = train::shardedMemory(
      n, l.shard, in.reshard_after_forward ? 2 : c.num_layers, false, 4, in.gather_bf16);
  const bool bf16_gathers = in.gather_bf16 && l.shard > 1;
  p.memory.push_back({bf16_gathers ? "parameters (fp32 masters, bf16 copy of the shard)"
                                   : "parameters (fp32 masters)",
                      double(state.params), bf16_gathers ? "(4 + 2) N / shard" : "4 N / shard"});
  p.memory.push_back({"gradients (fp32)", double(state.grads), "4 N / shard"});
  {
    // The optimizer's own byte count over the model's tensor table (what it allocates).
    static const std::map<train::OptimizerKind, std::pair<const char*, const char*>> text = {
        {train::OptimizerKind::AdamW, {"AdamW m, v, flags", "(4 + 4 + 1) N / shard"}},
        {train::OptimizerKind::Lion, {"Lion m, flags", "(4 + 1) N / shard"}},
        {train::OptimizerKind::Adafactor,
         {"Adafactor factors, v, flags",
          "4 (rows + cols of matrices) + (4 N_vectors + 1 N [+ 4 N with beta1]) / shard"}},
        {train::OptimizerKind::AdamW8bit,
         {"8-bit AdamW codes, scales, flags",
          "(2 N_8bit + 8 N_fp32 + 1 N) / shard + 8 N_8bit / block"}}};
    // Elementwise state divides over the shard group; per-tensor state is on every rank.
    const double bytes = static_cast<double>(train::optimizerStateBytes(
        in.optimizer, model::tensorTable(c), flatParameterCount(c), l.shard));
    const auto& t = text.at(in.optimizer.kind);
    p.memory.push_back({std::string("optimizer states (") + t.first + ")", bytes, t.second});
  }
  if (bf16) {
    // Whole under data parallelism; under sharding only beside the gathered units
    // (train/fsdp.cpp: the embeddings, the head and the gathered layer slots).
    const ComputeCopy cc = computeCopyParts(c);
    const std::int64_t slots = in.reshard_after_forward ? 2 : c.num_layers;
    if (l.shard == 1)
      p.memory.push_back({"compute copy of the GEMM weights (bf16)",
                          2.0 * static_cast<double>(cc.embed + c.num_layers * cc.layer + cc.head),
                          "2 N_gemm"});
    else
      p.memory.push_back({"compute copy of the gathered units (bf16)",
                          2.0 * static_cast<double>(cc.embed + slots * cc.layer + cc.head),
                          in.reshard_after_forward
                              ? "2 (N_gemm_emb + 2 N_gemm_layer + N_gemm_head)"
                              : "2 (N_gemm_emb + L N_gemm_layer + N_gemm_head)"});
  }
  if (l.shard > 1) {
    p.memory.push_back({"gathered embeddings, head and layers (sharding)", double(state.gathered),
                        bf16_gathers ? "4 (2 (N_emb + N_head) + (2 gathered + 2 gradient) "
                                       "N_layer) + 2 (N_emb + N_head + 2 N_layer) bf16 staging"
                                     : "4 (2 (N_emb + N_head) + (2 gathered + 2 gradient) "
                                       "N_layer)"});
    p.memory.push_back({"reduce-scatter outputs (sharding)", double(state.staging),
                        "4 (2 N_layer + N_emb + N_head) / shard"});
  }
  const std::int64_t t = in.micro_batch_tokens / l.context;
  const auto m = static_cast<std::int64_t>(std::ceil(in.mask_prob * static_cast<double>(t)));
  const Activations a = activationBytes(c, in.compute, t, m, true);
  const std::string per = " (t = " + std::to_string(t) + " tokens, m = " + std::to_string(m) +
                          " LM-head rows; carve() in src/model/esm2.cpp)";
  p.memory.push_back(
      {"activations: residual stream", double(a.residual), "(L+1) t h 4 + t 4" + per});
  p.memory.push_back({"activations: attention", double(a.attention),
                      "per kept layer: t (2h + 3h + 2h) c + t nh 4 + 2 t 4"});
  p.memory.push_back(
      {"activations: MLP", double(a.mlp), "per kept layer: t h 4 + t h c + 2 t f c + 2 t 4"});
  p.memory.push_back({"activations: final LayerNorm and LM head", double(a.head),
                      "t h c + m (4 h c + 40 (4 + c))"});
  p.memory.push_back({"activations: backward scratch", double(a.backward),
                      "t (2 h 4 + 5 h c + 3 h c + f c) + t nh 4 + 3 m h c"});
  const double batch =
      20.0 * static_cast<double>(t) + 2.0 * 4 * c.max_positions * (c.headDim() / 2);
  p.memory.push_back({"batch and rotary tables", batch, "20 t + 2 x 4 P d/2"});
  if (in.compute == Compute::Fp8) {
    // The FP8 layers' weight copies (src/model/esm2.cpp): on the GPU the E4M3 codes of each GEMM
    // weight and of its transpose; on the CPU emulation one quantised master-typed copy.  With
    // fp8.wgrad: fp8 the GPU forward keeps each GEMM input's X^T codes for the weight gradient
    // (src/model/ops.cpp), one byte per element of the four inputs (t x h three times, t x f).
    std::int64_t fl = 0;
    for (int layer = 0; layer < c.num_layers; ++layer)
      fl += c.fp8.fp8Layer(layer, c.num_layers) ? 1 : 0;
    const std::int64_t h = c.hidden, f = c.ffn;
    const std::int64_t weights = 4 * h * h + 2 * h * f;
    if (in.rates.kind == "cpu") {
      p.memory.push_back({"FP8 quantised weight copy (CPU emulation)",
                          4.0 * static_cast<double>(fl * weights), "4 L_fp8 (4 h^2 + 2 h f)"});
    } else {
      p.memory.push_back({"FP8 weight codes (E4M3 and transposed)",
                          2.0 * static_cast<double>(fl * weights), "2 L_fp8 (4 h^2 + 2 h f)"});
      if (c.fp8.wgrad == model::Fp8Wgrad::Fp8)
        p.memory.push_back({"activations: FP8 X^T codes kept for the weight gradients",
                            static_cast<double>(fl * round16(t) * (3 * h + f)),
                            "L_fp8 pad16(t) (3 h + f)"});
    }
  }
  double comm = 0;
  std::string comm_formula = "none (one data-parallel rank, no sharding or context split)";
  if (l.dataParallel() > 1 || l.shard > 1 || l.context > 1) {
    comm = in.rates.kind == "cpu" ? 0.0 : 256.0 * 1024 * 1024;
    comm_formula = in.rates.kind == "cpu"
                       ? "0: the MPI backend reduces the gradient buffer in place (host memory)"
                       : "NCCL channel buffers, 256 MiB per communicator (measured figure)";
  }
  p.memory.push_back({"communication buffers", comm, comm_formula, false});
  p.memory.push_back(
      {"workspace and runtime (" + in.rates.kind + " table)", in.rates.reserved_bytes,
       in.rates.kind == "cpu" ? "reserved_gib: the process itself (MPI, Kokkos, OpenBLAS, HDF5)"
                              : "reserved_gib: CUDA context, cuBLASLt workspace, allocator slack",
       false});
  p.memory_total = 0;
  p.memory_allocated = 0;
  for (const auto& item : p.memory) {
    p.memory_total += item.value;
    if (item.allocated) p.memory_allocated += item.value;
  }
  p.memory_available = in.rates.memory_bytes;
  p.fits = p.memory_total <= p.memory_available;
}

// FLOPs per token (doc/flops.md, doc/plan.md "FLOPs").
void planFlops(const Input& in, Plan& p) {
  const auto& c = in.model;
  const double h = c.hidden, f = c.ffn, L = c.num_layers, S = in.mean_seqlen;
  p.model_flops_per_token = c.trainFlopsPerToken(S);
  double extra = 0;
  if (c.recompute == model::Recompute::Layer)
    extra = 2 * L * (4 * h * h + 2 * h * f) + 4 * L * h * S;  // every layer's forward again
  else if (c.recompute == model::Recompute::Selective)
    extra = 4 * L * h * S;  // the attention forward again
  p.hardware_flops_per_token = p.model_flops_per_token + extra;
}

// Step time (doc/plan.md, "Time").
void planTime(const Input& in, Plan& p) {
  const auto& c = in.model;
  const Rates& r = in.rates;
  const Layout& l = in.layout;
  const double h = c.hidden, f = c.ffn, L = c.num_layers, V = c.vocab, S = in.mean_seqlen;
  const double t = in.fill * static_cast<double>(in.micro_batch_tokens) / l.context;
  const double mb = static_cast<double>(in.micro_batches);
  const double m = in.mask_prob * t;
  const bool bf16 = in.compute != Compute::Fp32;
  const double cb = bf16 ? 2 : 4;
  const auto rc = c.recompute;
  const double layer_w = 4 * h * h + 2 * h * f;

  // GEMMs: the encoder over t rows, the LM head over m rows.
  double gemm_flops = 6 * L * layer_w * t + 6 * (h * h + V * h) * m;
  if (rc == model::Recompute::Layer) gemm_flops += 2 * L * layer_w * t;
  const double gemm = mb * gemm_flops / gemmRate(r, in.compute, h);
  p.time.push_back({"GEMMs", gemm,
                    "mb (6 L (4h^2 + 2hf) t + 6 (h^2 + V h) m [+ 2 L (4h^2+2hf) t layer]) / "
                    "(gemm_tflops k/(k + gemm_half_k)), k = h"});
  double attn_flops = 12 * L * h * S * t;
  if (rc != model::Recompute::None) attn_flops += 4 * L * h * S * t;
  const double attention = mb * attn_flops / attentionRate(r, c.headDim());
  p.time.push_back({"attention", attention,
                    "mb (12 [+4 recompute] L h S t) / (attention_tflops d/(d + half_d))"});
  // LayerNorm: forward reads 4h and writes c h per row; backward reads x, dy, the residual
  // gradient and writes it plus a compute copy: (12 + 2c) h.
  const double ln_rows = (2 * L + 1) * t + m;
  double ln_bytes = ln_rows * (4 + cb) * h + ln_rows * (12 + 2 * cb) * h;
  if (rc != model::Recompute::None) ln_bytes += 2 * L * t * (4 + cb) * h;
  const double layernorm = mb * ln_bytes / (r.layernorm_gbps * 1e9);
  p.time.push_back({"LayerNorm", layernorm,
                    "mb ((2L+1) t + m) ((4 + c) h + (12 + 2c) h) [+ 2 L t (4+c) h] / "
                    "layernorm_gbps"});
  double elem_bytes = L * t * (4 * cb * h + 2 * cb * f);
  if (rc == model::Recompute::Layer) elem_bytes += L * t * (2 * cb * h + cb * f);
  // bf16: the compute copy is cast once per step (data parallelism), or beside every all-gather
  // of a unit under sharding (per micro-batch; again before the backward with resharding).
  double cast_bytes = bf16 ? 6.0 * static_cast<double>(computeCopyCount(c)) : 0.0;
  if (l.shard > 1) cast_bytes *= mb * (in.reshard_after_forward ? 2 : 1);
  const double elementwise = (mb * elem_bytes + cast_bytes) / (r.elementwise_gbps * 1e9);
  p.time.push_back({"rotary, casts, epilogues", elementwise,
                    "(mb L t (4 c h + 2 c f) + 6 N_gemm [bf16; x mb (x 2 resharding) sharded]) / "
                    "elementwise_gbps"});
  double launches = 20 * L + 20;
  if (rc == model::Recompute::Layer) launches += 8 * L;
  if (rc == model::Recompute::Selective) launches += 3 * L;
  const double launch = mb * launches * r.launch_us * 1e-6;
  p.time.push_back(
      {"kernel launches", launch, "mb (20 L + 20 [+ 8 L layer, 3 L selective]) launch_us"});
  const double nb = static_cast<double>(flatParameterCount(c)) / l.shard;
  const double optimizer = 36 * nb / (r.optimizer_gbps * 1e9);
  p.time.push_back(
      {"optimizer (AdamW, norm, zeroing)", optimizer, "36 N / shard / optimizer_gbps"});

  // Communication: bus bandwidth between nodes when the group spans nodes.
  auto busbw = [&](int group, bool spans_nodes) {
    (void)group;
    return (spans_nodes ? r.inter_node_gbps : r.intra_node_gbps) * 1e9;
  };
  // More ranks on a node than the table's ranks_per_node (CPU cores) share them: every
  // compute term above slows by that factor.
  const double share =
      std::max(1.0, static_cast<double>(l.ranks_per_node) / std::max(1, r.ranks_per_node));
  if (share > 1) {
    for (auto& item : p.time) item.value *= share;
    p.notes.push_back(
        fmt("%.0f ranks per node share the table's %.0f (ranks_per_node, e.g. CPU cores): "
            "compute times x %.2f",
            l.ranks_per_node, r.ranks_per_node, share));
  }
  double comm = 0, exposed = 0;
  std::string comm_formula = "none";
  const double backward_time = share * (gemm + attention + layernorm) * 2.0 / 3.0 / mb;
  const int dp = l.dataParallel() / l.shard;  // replicas that all-reduce
  if (l.shard > 1) {
    const bool spans = l.shard > l.ranks_per_node;
    // The all-gathers move the fp32 masters (train/fsdp.cpp; bf16 casts beside them), twice
    // per micro-batch with resharding after forward.
    const double gathers = in.reshard_after_forward ? 2.0 : 1.0;
    const double ag = gathers * (l.shard - 1.0) / l.shard * (in.gather_bf16 ? 2 : 4) * nb * l.shard;
    const double rs = (l.shard - 1.0) / l.shard * 4 * nb * l.shard;
    const double per_mb = (ag + rs) / busbw(l.shard, spans);
    comm += mb * per_mb;
    exposed += mb * std::max(per_mb / L, per_mb - 1.5 * backward_time);
    comm_formula =
        "shard: mb (2 [1 without resharding] (s-1)/s g N + (s-1)/s 4 N) / busbw, g = 2 with "
        "bf16 gathers, else 4";
  }
  if (dp > 1) {
    const bool spans = l.nodes > 1;
    const double ar = 2 * (dp - 1.0) / dp * 4 * nb / busbw(dp, spans);
    comm += ar;
    exposed += std::max(ar / L, ar - backward_time);
    comm_formula = (l.shard > 1 ? comm_formula + "; " : std::string()) +
                   "all-reduce: 2 (r-1)/r 4 N / busbw, overlapped with the last backward";
  }
  if (l.context > 1) {
    const bool spans = l.context > l.ranks_per_node;
    const double kv = 3 * (l.context - 1.0) * t * 2 * h * cb * L / busbw(l.context, spans);
    comm += mb * kv;
    exposed += mb * kv / L;
    comm_formula += "; context: mb 3 (c-1) t 2 h c L / busbw";
  }
  p.time.push_back(
      {"communication (exposed)", exposed,
       comm_formula +
           (comm > 0 ? fmt(" (total %.3g s, hidden %.3g s)", comm, comm - exposed) : "")});
  p.step_seconds = 0;
  for (const auto& item : p.time) p.step_seconds += item.value;
  p.tokens_per_step = mb * t * l.context * l.dataParallel();
  p.tokens_per_s = p.step_seconds > 0 ? p.tokens_per_step / p.step_seconds : 0;
  const double peak = r.peak_tflops * 1e12 * l.world();
  p.mfu = peak > 0 ? p.model_flops_per_token * p.tokens_per_s / peak : 0;
  p.hfu = peak > 0 ? p.hardware_flops_per_token * p.tokens_per_s / peak : 0;
}

double totalWith(Input in) {
  Plan p;
  planMemory(in, p);
  return p.memory_total;
}

void planAdvice(const Input& in, Plan& p) {
  if (p.fits) return;
  const double avail = p.memory_available;
  const int world = in.layout.world();
  // 1. The smallest shard degree that fits (a divisor of world / context).
  for (int s = in.layout.shard + 1; s <= world / in.layout.context; ++s) {
    if ((world / in.layout.context) % s != 0) continue;
    Input t = in;
    t.layout.shard = s;
    if (totalWith(t) <= avail) {
      p.advice.push_back("shard parameters, gradients and optimizer states over " +
                         std::to_string(s) + " ranks (--shard " + std::to_string(s) + ": " +
                         bytesText(totalWith(t)) + " per rank)");
      break;
    }
  }
  // 2. Recomputation.
  for (auto rc : {model::Recompute::Selective, model::Recompute::Layer}) {
    if (in.model.recompute == rc) continue;
    Input t = in;
    t.model.recompute = rc;
    if (totalWith(t) <= avail) {
      p.advice.push_back(std::string("model.recompute: ") + model::recomputeName(rc) + " (" +
                         bytesText(totalWith(t)) + " per rank)");
      break;
    }
  }
  // 3. The largest micro-batch (halving) that fits; accumulation keeps the global batch.
  Input t = in;
  while (t.micro_batch_tokens >= 2 * 1024) {
    t.micro_batch_tokens /= 2;
    t.micro_batches *= 2;
    if (totalWith(t) <= avail) {
      p.advice.push_back("data.micro_batch_tokens: " + std::to_string(t.micro_batch_tokens) + " (" +
                         std::to_string(t.micro_batches) +
                         " micro-batches per rank and step keep data.tokens_per_batch; " +
                         bytesText(totalWith(t)) + " per rank)");
      break;
    }
  }
  if (p.advice.empty())
    p.advice.push_back(
        "nothing in reach fits: the model state alone exceeds the device; add ranks and shard "
        "over them, or choose a smaller model");
}

}  // namespace

Plan makePlan(const Input& in) {
  checkLayout(in);
  Plan p;
  planMemory(in, p);
  planFlops(in, p);
  planTime(in, p);
  planAdvice(in, p);
  if (in.compute == Compute::Fp8)
    p.notes.push_back(
        "fp8 is planned as bf16 storage plus the FP8 weight codes and kept X^T codes, with the "
        "table's fp8 GEMM rate for the GEMMs (the FP8 casts are not timed separately; "
        "doc/fp8.md)");
  // What plm itself refuses today (src/model/esm2.cpp): planned anyway, said plainly.
  if (in.compute != Compute::Fp32 && in.rates.kind == "cpu")
    p.notes.push_back("bf16 runs on the CUDA build only; the CPU build trains in fp32");
  if (in.compute != Compute::Fp32 && in.model.hidden > 5120)
    p.notes.push_back(
        "plm's bf16 LayerNorm kernels take hidden <= 5120 today: this model (hidden " +
        std::to_string(in.model.hidden) + ") is refused in bf16 until a wider kernel lands");
  if (in.compute == Compute::Fp32 && in.rates.kind != "cpu")
    p.notes.push_back(
        "fp32 on a GPU runs the portable Kokkos kernels (the reference path): slow by design");
  if (in.layout.shard > 1 && in.compute == Compute::Fp8)
    p.notes.push_back(
        "plm's sharding runs train.precision fp32 or bf16 (fp8 with shard > 1 is refused; "
        "doc/parallelism.md): these fp8 figures are the planned design's");
  return p;
}

std::string bytesText(double bytes) {
  const double gib = 1024.0 * 1024 * 1024;
  if (std::fabs(bytes) >= gib) return fmt("%.2f GiB", bytes / gib);
  if (std::fabs(bytes) >= 1024.0 * 1024) return fmt("%.1f MiB", bytes / (1024.0 * 1024));
  return fmt("%.1f KiB", bytes / 1024.0);
}

}  // namespace plm::plan
