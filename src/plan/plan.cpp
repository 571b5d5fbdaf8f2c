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

using model::alignedElements;
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
  model::Esm2Config dense = c;  // one dense layer
  dense.num_layers = 1;
  dense.moe = model::MoeConfig{};
  std::int64_t n = 0;
  for (const auto& t : model::tensorTable(dense))
    if (t.group == model::TensorGroup::Layer) n += alignedElements(t.size);
  return n;
}

ParameterCounts parameterCounts(const model::Esm2Config& c, int expert_degree, bool fp8_gpu) {
  // Walks the model's own table (the tensors one rank of the expert group holds, in buffer
  // order) and its compute-copy packing (model::computeCopyElements, bind()'s rules in
  // src/model/esm2.cpp): the embedding, q/k/v stacked (weights, then biases, each run rounded
  // to 16), the attention output weight, every FFN's first weight and bias and second weight
  // (dense, routed and shared experts), a routed expert's second bias (its output is bf16), the
  // LM-head dense weight and bias; under fp8 on the GPU also the FP8 layers' attention output
  // bias and FFN second biases.  Routers, LayerNorms and the other biases stay in the master
  // buffer.
  model::ExpertPlacement held;
  if (c.moe.enabled() && expert_degree > 1) held = {expert_degree, 0};
  const auto table = model::tensorTable(c, held);
  const auto copy_of = model::computeCopyElements(table, c, fp8_gpu);
  ParameterCounts n;
  std::vector<std::int64_t> layer(c.num_layers, 0), copy(c.num_layers, 0);
  for (std::size_t i = 0; i < table.size(); ++i) {
    const auto& t = table[i];
    const std::int64_t size = alignedElements(t.size);
    n.flat += size;
    const bool expert = t.expert >= 0;
    if (expert) n.experts += size;
    const int l = t.layer;
    const std::int64_t packed = copy_of[i];
    n.compute += packed;
    if (expert) n.compute_experts += packed;
    if (l >= 0) {
      layer[l] += size;
      copy[l] += packed;
    } else if (t.group == model::TensorGroup::Embedding) {
      n.embed += size;
      n.compute_embed += packed;
    } else {
      n.head += size;
      n.compute_head += packed;
    }
  }
  for (int l = 0; l < c.num_layers; ++l) {
    n.layer_max = std::max(n.layer_max, layer[l]);
    n.compute_layer_max = std::max(n.compute_layer_max, copy[l]);
  }
  return n;
}

std::int64_t flatParameterCount(const model::Esm2Config& c) { return parameterCounts(c).flat; }

std::int64_t computeCopyCount(const model::Esm2Config& c) { return parameterCounts(c).compute; }

MoeBuffers moeBufferBytes(const model::Esm2Config& c, Compute compute, bool gpu, std::int64_t t,
                          int expert_degree, double load) {
  // The grow-only Views of MoeMlp::State (src/model/moe.cpp), sized as the forward and backward
  // of one micro-batch of t tokens grow them; each layer holds its own set.  View1<float>
  // storage: a bf16 buffer of n elements takes ceil(2 n / 4) floats.
  MoeBuffers b;
  const auto& m = c.moe;
  if (!m.enabled()) return b;
  for (int l = 0; l < c.num_layers; ++l) b.layers += m.isMoeLayer(l) ? 1 : 0;
  const std::int64_t h = c.hidden, e = m.experts, k = m.top_k, fe = m.expert_ffn;
  const std::int64_t sw = static_cast<std::int64_t>(m.shared_experts) * fe;
  const std::int64_t p = 4;  // the master type (Esm2<float>)
  const bool bf16_rows = compute == Compute::Bf16 || (compute == Compute::Fp8 && gpu);
  const std::int64_t cb = bf16_rows ? 2 : p;
  auto store = [&](std::int64_t elements, std::int64_t bytes) {
    return (elements * bytes + p - 1) / p * p;
  };
  const std::int64_t slots = t * k;
  const std::int64_t capacity =
      m.capacity_factor > 0
          ? static_cast<std::int64_t>(
                std::ceil(m.capacity_factor * static_cast<double>(slots) / static_cast<double>(e)))
          : 0;
  b.rows = capacity > 0 ? std::min(slots, e * capacity) : slots;
  const int ep = std::max(1, expert_degree);
  if (ep == 1) {
    b.expert_rows = b.rows;
  } else {
    double rows =
        std::min(static_cast<double>(ep), std::max(load, 0.0)) * static_cast<double>(b.rows);
    if (capacity > 0) rows = std::min(rows, static_cast<double>(e * capacity));
    b.expert_rows = static_cast<std::int64_t>(std::ceil(rows));
  }
  b.load = slots > 0 ? static_cast<double>(b.expert_rows) / static_cast<double>(slots) : 0;
  const std::int64_t r = b.rows, x = b.expert_rows;
  // Router logits and their gradient (master type); the gates and row maps: on the device
  // (bf16, no sequence-level loss) one routing workspace (gpu/moe.cu routeBuffers, 256-byte
  // carves), else the host routing's slot_row, slot_gate, row_token, row_gate and dgate.
  std::int64_t routing = 2 * store(t * e, p) + store(slots, p);  // logits, dlogits, dgate
  if (gpu && bf16_rows && m.seq_aux_loss == 0) {
    auto carve = [](std::int64_t n, std::int64_t bytes) { return round256(n * bytes); };
    const std::int64_t chunks = (slots + 255) / 256;
    routing += store(carve(t * e, 8) + carve(t, 8) + carve(2 * t, 8) + 6 * carve(slots, 4) +
                         carve(chunks * e, 8) + carve(3 * e, 8) + carve(e + 2, 8) + carve(e, 8),
                     1);
  } else {
    routing += store(slots, 4) + store(slots, p) + store(r, 4) + store(r, p);
  }
  // Token side: permuted rows and the expert outputs (forward), their gradients (backward);
  // bf16: the router's fp32 copy of the LayerNorm output and its input gradient, unless the
  // router (E x h fp32) fits 160 KiB of shared memory with h a multiple of 8: then the router's
  // kernels read the bf16 output itself and the combine forms the input gradient per element
  // (gpu::routerFitsShared).
  std::int64_t token = 4 * store(r * h, cb);
  if (bf16_rows && gpu && !(h % 8 == 0 && e * h * 4 <= (std::int64_t(160) << 10)))
    token += 2 * store(t * h, p);
  // Expert side: pre-activation, activation and the pre-activation's gradient at the rows the
  // experts compute; under expert parallelism also the received rows, their outputs, the staging
  // buffer of both exchanges, the gradients' received and returned rows, and the row maps.
  // SwiGLU experts: pre and its gradient 2 f_e wide (gate | up), act, and d(act) f_e wide.
  std::int64_t expert =
      m.swiglu() ? 2 * store(x * 2 * fe, cb) + 2 * store(x * fe, cb) : 3 * store(x * fe, cb);
  if (ep > 1) expert += 5 * store(x * h, cb) + 2 * store(x, 4);
  b.routing = b.layers * routing;
  b.token_side = b.layers * token;
  b.expert_side = b.layers * expert;
  b.shared = sw > 0 ? b.layers * 3 * store(t * sw, cb) : 0;
  return b;
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

// GEMMs outside the FP8 layers (the LM head, fp8.first/last_layers_bf16) run in bf16 under fp8.
double gemmRate(const Rates& r, Compute c, double k) {
  const double asymptote = c == Compute::Fp32 ? r.gemm_tflops_fp32 : r.gemm_tflops_bf16;
  return asymptote * 1e12 * k / (k + r.gemm_half_k);
}

double fp8GemmRate(const Rates& r, model::Fp8Recipe recipe, double k) {
  const double asymptote =
      recipe == model::Fp8Recipe::Block ? r.gemm_tflops_fp8_block : r.gemm_tflops_fp8;
  return asymptote * 1e12 * k / (k + r.gemm_half_k_fp8);
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
  const auto& moe = in.model.moe;
  if (l.expert != 1 && !moe.enabled())
    throw collectiveError("plan: expert degree " + std::to_string(l.expert) +
                          " needs a mixture-of-experts model (moe.experts or an MoE preset); "
                          "this one is dense: use --expert 1");
  if (l.expert != 1 && l.world() % l.expert != 0)
    throw collectiveError("plan: expert degree " + std::to_string(l.expert) +
                          " does not divide the " + std::to_string(l.world()) +
                          " ranks; choose a divisor of the rank count");
  if (l.expert != 1 && moe.experts % l.expert != 0)
    throw collectiveError("plan: expert degree " + std::to_string(l.expert) +
                          " does not divide moe.experts = " + std::to_string(moe.experts) +
                          "; choose a divisor of the expert count");
  if (in.moe_load < 0)
    throw collectiveError("plan: --moe-load must be positive (1 = balanced), got " +
                          std::to_string(in.moe_load));
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
// The load the MoE buffers and the all-to-all are planned at (Input::moe_load), and its source.
std::pair<double, std::string> moeLoad(const Input& in) {
  const auto& m = in.model.moe;
  const int ep = in.layout.expert;
  if (!m.enabled()) return {0.0, ""};
  if (ep == 1)
    return {1.0, "expert degree 1: every rank computes all its own rows (no load to state)"};
  if (in.moe_load > 0)
    return {std::min<double>(in.moe_load, ep),
            in.moe_load > ep ? "the stated load, capped at the expert degree (every row on one "
                               "rank)"
                             : "the stated load (--moe-load)"};
  if (m.capacity_factor > 0)
    return {std::min<double>(m.capacity_factor, ep),
            "the capacity bound (moe.capacity_factor; moe.dropless: false)"};
  return {std::min(2.0, static_cast<double>(ep)),
          "dropless default: 2x the balanced rows on the fullest rank; set --moe-load (up to "
          "the expert degree for collapsed routing)"};
}

// Memory per rank (doc/plan.md, "Memory").
void planMemory(const Input& in, Plan& p) {
  const auto& c = in.model;
  const Layout& l = in.layout;
  const bool gpu = in.rates.kind != "cpu";
  // The compute copy exists under bf16, and under fp8 on the GPU (the CPU emulates fp8 on the
  // fp32 masters).
  const bool bf16 = in.compute == Compute::Bf16 || (in.compute == Compute::Fp8 && gpu);
  const bool moe = c.moe.enabled();
  const ParameterCounts pc = parameterCounts(c, l.expert, in.compute == Compute::Fp8 && gpu);
  // The routed experts a rank holds (1 / expert of them, through the table) are part of their
  // layer's sharding unit like every other tensor: FSDP beside expert parallelism shards them
  // over the ranks holding the same experts (train::Fsdp, doc/parallelism.md).
  train::ShardSizes n;
  n.flat = pc.flat;
  n.layer_unit = pc.layer_max;
  n.embed_unit = pc.embed;
  n.head_unit = pc.head;
  n.layers = c.num_layers;
  train::FsdpMemory state = train::shardedMemory(
      n, l.shard, in.reshard_after_forward ? 2 : c.num_layers, false, 4, in.gather_bf16);
  const bool bf16_gathers = in.gather_bf16 && l.shard > 1;
  const std::string per_rank = !moe ? "N / shard" : "(N_dense + N_exp / expert) / shard";
  p.memory.push_back({bf16_gathers ? "parameters (fp32 masters, bf16 copy of the shard)"
                                   : "parameters (fp32 masters)",
                      double(state.params), (bf16_gathers ? "(4 + 2) " : "4 ") + per_rank});
  p.memory.push_back({"gradients (fp32)", double(state.grads), "4 " + per_rank});
  {
    // The optimizer's own byte count over the model's tensor table (what it allocates).
    static const std::map<train::OptimizerKind, std::pair<const char*, const char*>> text = {
        {train::OptimizerKind::AdamW, {"AdamW m, v, flags", "(4 + 4 + 1) "}},
        {train::OptimizerKind::Lion, {"Lion m, flags", "(4 + 1) "}},
        {train::OptimizerKind::Adafactor,
         {"Adafactor factors, v, flags",
          "4 (rows + cols of matrices) + (4 N_vectors + 1 N [+ 4 N with beta1]) / shard; "}},
        {train::OptimizerKind::AdamW8bit,
         {"8-bit AdamW codes, scales, flags",
          "(2 N_8bit + 8 N_fp32 + 1 N) / shard + 8 N_8bit / block; "}}};
    // Elementwise state divides over the shard group; per-tensor state is on every rank.
    model::ExpertPlacement held;
    if (moe && l.expert > 1) held = {l.expert, 0};
    auto table = model::tensorTable(c, held);
    const double bytes =
        static_cast<double>(train::optimizerStateBytes(in.optimizer, table, pc.flat, l.shard));
    const auto& t = text.at(in.optimizer.kind);
    p.memory.push_back({std::string("optimizer states (") + t.first + ")", bytes,
                        std::string(t.second) + per_rank});
  }
  if (bf16) {
    // Whole under data parallelism; under sharding only beside the gathered units
    // (train/fsdp.cpp: the embeddings, the head and the gathered layer slots, a layer's held
    // experts with it).
    const std::int64_t slots = in.reshard_after_forward ? 2 : c.num_layers;
    if (l.shard == 1)
      p.memory.push_back(
          {"compute copy of the GEMM weights (bf16)", 2.0 * static_cast<double>(pc.compute),
           moe ? "2 N_gemm (routed experts: those held, N_gemm_exp / expert)" : "2 N_gemm"});
    else
      p.memory.push_back({"compute copy of the gathered units (bf16)",
                          2.0 * static_cast<double>(pc.compute_embed + pc.compute_head +
                                                    slots * pc.compute_layer_max),
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
  if (moe) {
    const auto [load, source] = moeLoad(in);
    p.moe_load = load;
    p.moe_load_source = source;
    const MoeBuffers mb = moeBufferBytes(c, in.compute, gpu, t, l.expert, load);
    const std::string kept =
        " per MoE layer, x " + std::to_string(mb.layers) + " layers (each keeps its own)";
    const bool device_routing = gpu && bf16 && c.moe.seq_aux_loss == 0;
    p.memory.push_back(
        {"MoE: router logits, gates, row maps", double(mb.routing),
         std::string("t E 4 (logits) + t E 4 (gradient) + t k 4 (gate gradient) + ") +
             (device_routing ? "the device routing's workspace (t E 8 + 32 t + 24 t k)"
                             : "t k (4 + 4) + R (4 + 4) host routing maps") +
             kept});
    p.memory.push_back(
        {"MoE: permuted rows (token side)", double(mb.token_side),
         std::string("4 R h c (rows, expert outputs, their gradients)") +
             (bf16 && gpu ? " + 2 t h 4 where the router exceeds 160 KiB (its fp32 input, "
                            "its gradient)"
                          : "") +
             ", R = " + std::to_string(mb.rows) +
             (c.moe.capacity_factor > 0 ? " = min(t k, E capacity)" : " = t k (dropless)") + kept});
    p.memory.push_back(
        {"MoE: expert rows (FFN activations, gradient)", double(mb.expert_side),
         std::string(c.moe.swiglu() ? "6 X f_e c (SwiGLU: pre, its gradient 2 f_e)" : "3 X f_e c") +
             (l.expert > 1 ? " + 5 X h c (received rows, outputs, staging, gradients) + 8 X" : "") +
             ", X = " + std::to_string(mb.expert_rows) + " rows its experts compute" +
             (l.expert > 1 ? " = load " + fmt("%.2f", load) + " x t k" : " = R") + kept});
    if (mb.shared > 0)
      p.memory.push_back({"MoE: shared experts", double(mb.shared), "3 t S f_e c" + kept});
  }
  if (in.compute == Compute::Fp8) {
    // The FP8 layers' weight copies (src/model/esm2.cpp): on the GPU the E4M3 codes of each GEMM
    // weight and of its transpose; on the CPU emulation one quantised master-typed copy.  With
    // fp8.wgrad: fp8 the GPU forward keeps each GEMM input's X^T codes for the weight gradient
    // (src/model/ops.cpp), one byte per element of the four inputs (t x h three times, t x f).
    // An MoE layer's FFN GEMMs are its held experts' (and its shared experts'): codes of
    // 2 h f_e per held expert (3 h f_e for SwiGLU: the stacked [gate; up] and down), X^T codes
    // of its X expert rows (h + f_e wide: the up GEMM's input and the down GEMM's, either way).
    const std::int64_t h = c.hidden, f = c.ffn;
    std::int64_t weights = 0, xt = 0, widest = 0;  // widest: one layer's FP8 weights
    const std::int64_t fe = c.moe.expert_ffn, sw = std::int64_t(c.moe.shared_experts) * fe;
    const std::int64_t held_experts = moe ? c.moe.experts / l.expert : 0;
    const std::int64_t per_expert = (c.moe.swiglu() ? 3 : 2) * h * fe;
    const MoeBuffers rows =
        moe ? moeBufferBytes(c, in.compute, gpu, t, l.expert, moeLoad(in).first) : MoeBuffers();
    for (int layer = 0; layer < c.num_layers; ++layer) {
      if (!c.fp8.fp8Layer(layer, c.num_layers)) continue;
      const std::int64_t before = weights;
      if (c.moe.isMoeLayer(layer)) {
        weights += 4 * h * h + held_experts * per_expert + 2 * h * sw;
        xt += alignedElements(t) * 2 * h + alignedElements(rows.expert_rows) * (h + fe) +
              (sw > 0 ? alignedElements(t) * (h + sw) : 0);
      } else {
        weights += 4 * h * h + 2 * h * f;
        xt += alignedElements(t) * (3 * h + f);
      }
      widest = std::max(widest, weights - before);
    }
    const char* per_layer = !moe ? "L_fp8 (4 h^2 + 2 h f)"
                            : c.moe.swiglu()
                                ? "sum over FP8 layers of (4 h^2 + 2 h f, or 3 h f_e per held "
                                  "SwiGLU expert in an MoE layer)"
                                : "sum over FP8 layers of (4 h^2 + 2 h f, or 2 h f_e per held "
                                  "expert in an MoE layer)";
    if (l.shard > 1) {  // train::Fsdp's byte wires: 1 byte per FP8 weight element
      const int slots = in.reshard_after_forward ? 2 : c.num_layers;
      p.memory.push_back({"FP8 codes: the shard's, and one gathered layer per slot",
                          static_cast<double>(weights / l.shard + slots * widest),
                          std::string("(1 / shard) ") + per_layer + " + " + std::to_string(slots) +
                              " x one layer's, one byte each"});
    }
    if (in.rates.kind == "cpu") {
      p.memory.push_back({"FP8 quantised weight copy (CPU emulation)",
                          4.0 * static_cast<double>(weights), std::string("4 ") + per_layer});
    } else {
      p.memory.push_back({"FP8 weight codes (E4M3 and transposed)",
                          2.0 * static_cast<double>(weights), std::string("2 ") + per_layer});
      if (c.fp8.wgrad == model::Fp8Wgrad::Fp8)
        p.memory.push_back({"activations: FP8 X^T codes kept for the weight gradients",
                            static_cast<double>(xt),
                            moe ? "per FP8 layer pad16(t) (3 h + f); MoE layers pad16(t) 2 h + "
                                  "pad16(X) (h + f_e)"
                                : "L_fp8 pad16(t) (3 h + f)"});
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
  if (moe && l.expert > 1 && in.rates.kind != "cpu") {
    comm += 256.0 * 1024 * 1024;
    comm_formula += "; and the expert group's communicator";
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
// Matmul weights one token passes through in the encoder, router included (every layer's
// q/k/v/output and its FFN: dense 2hf, MoE h E + 2 h f_e (top_k + shared)).
double encoderMatmulWeights(const model::Esm2Config& c) {
  const double h = c.hidden;
  double w = 0;
  for (int l = 0; l < c.num_layers; ++l)
    w += 4 * h * h +
         (c.moe.isMoeLayer(l)
              ? h * c.moe.experts + c.moe.expertMatrices() * h * c.moe.expert_ffn * c.moe.top_k +
                    2 * h * c.moe.expert_ffn * c.moe.shared_experts
              : 2 * h * c.ffn);
  return w;
}

void planFlops(const Input& in, Plan& p) {
  const auto& c = in.model;
  const double h = c.hidden, L = c.num_layers, S = in.mean_seqlen;
  p.model_flops_per_token = c.trainFlopsPerToken(S);
  double extra = 0;
  if (c.recompute == model::Recompute::Layer)
    extra = 2 * encoderMatmulWeights(c) + 4 * L * h * S;  // every layer's forward again
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
  const bool moe = c.moe.enabled();
  const ParameterCounts pc = parameterCounts(c, l.expert, in.compute == Compute::Fp8);
  // MoE: the fullest rank's experts compute X = load x t k rows per layer (t k, its own rows,
  // at expert degree 1); the router runs on its t rows.
  double moe_layers = 0;
  for (int layer = 0; layer < c.num_layers; ++layer) moe_layers += c.moe.isMoeLayer(layer);
  const double k = moe ? c.moe.top_k : 0, fe = moe ? c.moe.expert_ffn : 0;
  const double load = moe ? (l.expert > 1 ? p.moe_load : 1.0) : 0;
  const double rows = load * k * t;  // expert rows of the fullest rank per MoE layer
  const double local_rows = k * t;   // rows a rank routes (and gets back) per MoE layer
  // Per micro-batch: dense layers' weights over t rows, MoE layers' attention and router over t
  // rows and experts over their rows.
  const double layer_flops =
      (L - moe_layers) * (4 * h * h + 2 * h * f) * t +
      moe_layers * ((4 * h * h + h * c.moe.experts + 2 * h * fe * c.moe.shared_experts) * t +
                    (moe ? c.moe.expertMatrices() : 2) * h * fe * rows);

  // fp8: the FP8 layers' GEMMs (a dense layer's four, an MoE layer's attention, experts and
  // shared experts; its router stays bf16) apart, with the elements their operand casts move:
  // the inputs X (forward) and the output gradients dY (backward), doc/fp8.md "Casts per
  // micro-batch".
  const bool fp8 = in.compute == Compute::Fp8;
  const double sw = moe ? c.moe.shared_experts * fe : 0;
  const double up = moe && c.moe.swiglu() ? 2 : 1;  // the expert up GEMM's width in f_e
  const double held_experts = moe ? static_cast<double>(c.moe.experts) / l.expert : 0;
  double fp8_flops = 0, fp8_x = 0, fp8_dy = 0, fp8_weights = 0;
  for (int layer = 0; fp8 && layer < c.num_layers; ++layer) {
    if (!c.fp8.fp8Layer(layer, c.num_layers)) continue;
    if (c.moe.isMoeLayer(layer)) {
      fp8_weights += 4 * h * h + 2 * h * sw + held_experts * c.moe.expertMatrices() * h * fe;
      fp8_flops += (4 * h * h + 2 * h * sw) * t + c.moe.expertMatrices() * h * fe * rows;
      fp8_x += 2 * h * t + (h + fe) * rows + (sw > 0 ? (h + sw) * t : 0);
      fp8_dy += 4 * h * t + (up * fe + h) * rows + (sw > 0 ? (sw + h) * t : 0);
    } else {
      fp8_weights += 4 * h * h + 2 * h * f;
      fp8_flops += (4 * h * h + 2 * h * f) * t;
      fp8_x += (3 * h + f) * t;
      fp8_dy += (5 * h + f) * t;
    }
  }
  // GEMMs: the encoder over t rows, the LM head over m rows; under fp8 the FP8 layers' part at
  // the FP8 rate.
  const double again = rc == model::Recompute::Layer ? 2 : 0;  // the layer's forward again
  const double bf16_flops = (6 + again) * (layer_flops - fp8_flops) + 6 * (h * h + V * h) * m;
  const double gemm = mb * bf16_flops / gemmRate(r, in.compute, h) +
                      mb * (6 + again) * fp8_flops / fp8GemmRate(r, c.fp8.recipe, h);
  const std::string fp8_rate = c.fp8.recipe == model::Fp8Recipe::Block
                                   ? "gemm_tflops_fp8_block k/(k + gemm_half_k_fp8)"
                                   : "gemm_tflops_fp8 k/(k + gemm_half_k_fp8)";
  p.time.push_back(
      {"GEMMs", gemm,
       !fp8 ? (moe ? "mb (6 W_t + 6 (h^2 + V h) m [+ 2 W_t layer]) / (gemm_tflops k/(k + "
                     "gemm_half_k)), k = h; W_t = dense layers (4h^2 + 2hf) t + MoE layers "
                     "((4h^2 + h E + 2 h f_e S) t + 2 h f_e X [3 h f_e X SwiGLU])"
                   : "mb (6 L (4h^2 + 2hf) t + 6 (h^2 + V h) m [+ 2 L (4h^2+2hf) t layer]) / "
                     "(gemm_tflops k/(k + gemm_half_k)), k = h")
            : (moe ? "mb (6 [+2 layer] W_fp8) / (" + fp8_rate +
                         ") + mb (6 [+2 layer] (W_t - W_fp8) + 6 (h^2 + V h) m) / "
                         "(gemm_tflops_bf16 k/(k + gemm_half_k)), k = h; W_t = dense layers "
                         "(4h^2 + 2hf) t + MoE layers ((4h^2 + h E + 2 h f_e S) t + 2 h f_e X "
                         "[3 h f_e X SwiGLU]), W_fp8 = its FP8 layers' part less the routers"
                   : "mb (6 [+2 layer] L_fp8 (4h^2 + 2hf) t) / (" + fp8_rate +
                         ") + mb (6 [+2 layer] (L - L_fp8) (4h^2 + 2hf) t + 6 (h^2 + V h) m) / "
                         "(gemm_tflops_bf16 k/(k + gemm_half_k)), k = h")});
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
  // FFN activations' elementwise traffic: dense layers over t rows of width f, MoE layers over
  // their expert rows (and shared experts over t rows) of width f_e.
  const double ffn_elems =
      (L - moe_layers) * t * f + moe_layers * (fe * rows + c.moe.shared_experts * fe * t);
  double elem_bytes = L * t * 4 * cb * h + 2 * cb * ffn_elems;
  if (rc == model::Recompute::Layer) elem_bytes += L * t * 2 * cb * h + cb * ffn_elems;
  // bf16: the compute copy is cast once per step (data parallelism), or beside every all-gather
  // of a unit under sharding (per micro-batch; again before the backward with resharding).
  double cast_bytes = bf16 ? 6.0 * static_cast<double>(pc.compute) : 0.0;
  if (l.shard > 1) cast_bytes *= mb * (in.reshard_after_forward ? 2 : 1);
  // fp8: the FP8 weights' codes and transposed codes, written once per step from the shard.
  cast_bytes += 2 * fp8_weights / l.shard;
  const double elementwise = (mb * elem_bytes + cast_bytes) / (r.elementwise_gbps * 1e9);
  p.time.push_back({"rotary, casts, epilogues", elementwise,
                    moe ? "(mb (L t 4 c h + 2 c F) + 6 N_gemm [bf16; x mb (x 2 resharding) "
                          "sharded] [+ 2 N_fp8 / shard fp8]) / elementwise_gbps, F = dense "
                          "layers t f + MoE layers (X + S t) f_e"
                        : "(mb L t (4 c h + 2 c f) + 6 N_gemm [bf16; x mb (x 2 resharding) "
                          "sharded] [+ 2 N_fp8 / shard fp8]) / elementwise_gbps"});
  double fp8_cast = 0;
  if (fp8) {
    // Bytes per element: bf16 read, code written (3), the transposed code for the FP8 weight
    // gradient (+1), current scaling's amax pass before the cast (+2).  Layer recomputation casts
    // the inputs again.
    const bool current = c.fp8.recipe == model::Fp8Recipe::Current;
    const bool block = c.fp8.recipe == model::Fp8Recipe::Block;
    const double b = 3 + (c.fp8.wgrad == model::Fp8Wgrad::Fp8 ? 1 : 0) + (current ? 2 : 0);
    const double elems = fp8_x * (rc == model::Recompute::Layer ? 2 : 1) + fp8_dy;
    fp8_cast = mb * b * elems / ((block ? r.fp8_block_cast_gbps : r.fp8_cast_gbps) * 1e9);
    p.time.push_back(
        {"FP8 casts", fp8_cast,
         fmt("mb %.0f (in + out [+ in layer]) / ", b) +
             (block ? "fp8_block_cast_gbps" : "fp8_cast_gbps") +
             "; in, out: elements of the FP8 GEMMs' inputs and output gradients, " +
             (moe ? "per FP8 layer in + out = dense t (8h + 2f), MoE 6 t h + X (2h + 2 f_e "
                    "[3 f_e SwiGLU]) [+ t (2h + 2 S f_e) shared]"
                  : "L_fp8 t (3h + f) and L_fp8 t (5h + f)") +
             "; bytes per element 3 + 1 (fp8.wgrad: fp8) + 2 (current scaling)"});
  }
  if (moe) {
    // Router input widening, gather into expert order, unpermute with the gates and their
    // backward passes; under expert parallelism the received rows' reorderings both ways.
    double bytes = t * h * (3 * cb + 24) + 7 * local_rows * h * cb;
    if (l.expert > 1) bytes += 8 * rows * h * cb;
    if (rc == model::Recompute::Layer) bytes *= 4.0 / 3.0;
    p.time.push_back({"MoE routing, permutation, combine",
                      mb * moe_layers * bytes / (r.elementwise_gbps * 1e9),
                      "mb L_moe (t h (3c + 24) + 7 t k h c [+ 8 X h c expert parallel]) / "
                      "elementwise_gbps"});
  }
  double launches = 20 * L + 20 + moe_layers * (12 + 4 * held_experts);
  if (rc == model::Recompute::Layer) launches += 8 * L;
  if (rc == model::Recompute::Selective) launches += 3 * L;
  const double launch = mb * launches * r.launch_us * 1e-6;
  p.time.push_back({"kernel launches", launch,
                    moe ? "mb (20 L + 20 + L_moe (12 + 4 E / expert) [+ 8 L layer, 3 L "
                          "selective]) launch_us"
                        : "mb (20 L + 20 [+ 8 L layer, 3 L selective]) launch_us"});
  // Parameters a rank holds: its shard of the table (the routed experts it holds included).
  const double held = static_cast<double>(pc.flat) / l.shard;
  const double optimizer = 36 * held / (r.optimizer_gbps * 1e9);
  p.time.push_back({"optimizer (AdamW, norm, zeroing)", optimizer,
                    moe ? "36 (N_dense + N_exp / expert) / shard / optimizer_gbps"
                        : "36 N / shard / optimizer_gbps"});

  // Communication: the bus bandwidth of a group within a node is the node's (NVLink); a group
  // spanning nodes moves its traffic between nodes over the NICs of its members on each node,
  // one per GPU (inter_node_gbps each), in parallel: min(intra, members per node x inter).  So
  // the all-reduce of plain data parallelism (8 members per node) and HSDP's all-reduce of
  // one shard per node (1 member, a shard of N / 8) take the same time.
  auto busbw = [&](int members_per_node, bool spans_nodes) {
    if (!spans_nodes) return r.intra_node_gbps * 1e9;
    return std::min(r.intra_node_gbps, std::max(1, members_per_node) * r.inter_node_gbps) * 1e9;
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
  const double backward_time = share * (gemm + attention + layernorm + fp8_cast) * 2.0 / 3.0 / mb;
  const int dp = l.dataParallel() / l.shard;  // replicas that all-reduce
  if (l.shard > 1) {
    const bool spans = l.shard > l.ranks_per_node;
    // The all-gathers move the fp32 masters (train/fsdp.cpp; bf16 casts beside them), twice
    // per micro-batch with resharding after forward.
    const double gathers = in.reshard_after_forward ? 2.0 : 1.0;
    const double ag =
        gathers * (l.shard - 1.0) / l.shard * (in.gather_bf16 ? 2 : 4) * held * l.shard;
    const double rs = (l.shard - 1.0) / l.shard * 4 * held * l.shard;
    const double per_mb = (ag + rs) / busbw(l.ranks_per_node, spans);
    comm += mb * per_mb;
    exposed += mb * std::max(per_mb / L, per_mb - 1.5 * backward_time);
    comm_formula =
        "shard: mb (2 [1 without resharding] (s-1)/s g N + (s-1)/s 4 N) / busbw, g = 2 with "
        "bf16 gathers, else 4";
  }
  if (dp > 1) {
    // The replicas of a rank's shard: one per shard group; shard groups within a node leave
    // ranks_per_node / shard of them on each node.
    const bool spans = l.nodes > 1 && dp > std::max(1, l.ranks_per_node / (l.shard * l.context));
    const int members =
        std::max(1, l.ranks_per_node / std::min(l.ranks_per_node, l.shard * l.context));
    // Beside expert parallelism the replicas are the expert groups, which hold other experts:
    // only the dense tensors' shard is all-reduced (train/fsdp.cpp, expert_pieces).
    const double reduced =
        moe && l.expert > 1 && l.shard > 1 ? static_cast<double>(pc.dense()) / l.shard : held;
    const double ar = 2 * (dp - 1.0) / dp * 4 * reduced / busbw(members, spans);
    comm += ar;
    exposed += std::max(ar / L, ar - backward_time);
    comm_formula = (l.shard > 1 ? comm_formula + "; " : std::string()) +
                   "all-reduce: 2 (r-1)/r 4 N / busbw, overlapped with the last backward";
  }
  if (l.context > 1) {
    const bool spans = l.context > l.ranks_per_node;
    const double kv = 3 * (l.context - 1.0) * t * 2 * h * cb * L / busbw(l.ranks_per_node, spans);
    comm += mb * kv;
    exposed += mb * kv / L;
    comm_formula += "; context: mb 3 (c-1) t 2 h c L / busbw";
  }
  if (moe && l.expert > 1) {
    // Four exchanges per MoE layer and micro-batch (rows to the experts and back, forward and
    // backward; two more when model.recompute: layer reruns the forward), not overlapped: the
    // fullest rank moves max(X, t k) (E_p - 1) / E_p rows of h elements each time.
    const bool spans = l.expert > l.ranks_per_node;
    const double exchanges = rc == model::Recompute::Layer ? 6 : 4;
    const double bytes =
        exchanges * std::max(rows, local_rows) * (l.expert - 1.0) / l.expert * h * cb;
    // Spanning nodes, each rank's rows to other nodes leave by its own NIC.
    const double a2a = mb * moe_layers * bytes / busbw(1, spans);
    p.time.push_back({"MoE all-to-all (exposed)", a2a,
                      fmt("mb L_moe %.0f max(X, t k) (E_p-1)/E_p h c / ", exchanges) +
                          (spans ? "inter_node_gbps" : "intra_node_gbps") +
                          fmt(", X = %.2f t k (the load)", p.moe_load)});
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
  // 1b. MoE: the smallest expert degree that fits (a divisor of the experts and the ranks).
  if (in.model.moe.enabled())
    for (int e = in.layout.expert + 1; e <= std::min(world, in.model.moe.experts); ++e) {
      if (world % e != 0 || in.model.moe.experts % e != 0) continue;
      Input t = in;
      t.layout.expert = e;
      if (totalWith(t) <= avail) {
        p.advice.push_back("split the experts over " + std::to_string(e) +
                           " ranks (parallel.expert_degree: " + std::to_string(e) + ", --expert " +
                           std::to_string(e) + ": " + bytesText(totalWith(t)) + " per rank)");
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
        in.model.moe.enabled()
            ? "nothing in reach fits: the model state alone exceeds the device; add ranks and "
              "split the experts over them (parallel.expert_degree, --expert) or shard, or "
              "choose a smaller model"
            : "nothing in reach fits: the model state alone exceeds the device; add ranks and "
              "shard over them, or choose a smaller model");
}

}  // namespace

Plan makePlan(const Input& in) {
  checkLayout(in);
  Plan p;
  planMemory(in, p);
  planFlops(in, p);
  planTime(in, p);
  planAdvice(in, p);
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
  if (in.layout.shard > 1 && in.compute == Compute::Fp8 && in.rates.kind != "cpu")
    p.notes.push_back(
        "fp8 with shard > 1 on the GPU all-gathers the FP8 weights as their E4M3 codes (one byte "
        "each); the gathered codes land in whole-model code buffers on every rank (the FP8 "
        "weight codes row; doc/parallelism.md)");
  if (in.model.moe.enabled()) {
    const auto& moe = in.model.moe;
    p.notes.push_back(
        fmt("MoE: %.0f experts of width %.0f, top-%.0f", moe.experts, moe.expert_ffn, moe.top_k) +
        (moe.capacity_factor > 0 ? fmt(", capacity factor %.2f", moe.capacity_factor)
                                 : std::string(", dropless")) +
        (in.layout.expert > 1
             ? fmt("; expert rows planned at load %.2f of the balanced t k: ", p.moe_load) +
                   p.moe_load_source
             : std::string("; expert degree 1: the load does not change the memory")));
    if (in.layout.expert > 1)
      p.notes.push_back(
          "the MoE all-to-all is timed at the link's bandwidth only; the per-layer exchange of "
          "the row counts (a host synchronisation) is not timed");
    if (in.layout.expert > 1 && in.layout.shard > 1 &&
        in.layout.shard * in.layout.expert != in.layout.world())
      p.notes.push_back(
          "plm train shards beside expert parallelism over the ranks holding the same experts, "
          "so shard_degree x expert_degree must equal the rank count (doc/parallelism.md)");
  }
  return p;
}

std::string bytesText(double bytes) {
  const double gib = 1024.0 * 1024 * 1024;
  if (std::fabs(bytes) >= gib) return fmt("%.2f GiB", bytes / gib);
  if (std::fabs(bytes) >= 1024.0 * 1024) return fmt("%.1f MiB", bytes / (1024.0 * 1024));
  return fmt("%.1f KiB", bytes / 1024.0);
}

}  // namespace plm::plan
