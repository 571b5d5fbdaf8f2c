// Esm2<T>: parameter layout, workspace, and the forward/backward orchestration of the layers in
// this folder (embedding, layer_norm, linear, rotary, attention, gelu, cross_entropy).
//
// Accumulation rule: gradients() accumulates (+=) until zeroGradients(); activations are written.
// The residual-stream gradient dx is one (T, H) buffer updated in place from the loss down to
// the embedding: each LayerNorm backward adds its branch into it.
// The LM head runs only on rows that carry a label (about 15% of tokens) in training; forward()
// with want_logits runs it on every row.
// With recompute, only each block's input (the residual stream) is kept; the backward of block l
// first reruns its forward into one shared set of activations.  Every kernel is deterministic,
// so the gradients are bitwise those of the stored-activation path.
#include "model/esm2.hpp"

#include "core/error.hpp"
#include "model/attention.hpp"
#include "model/cross_entropy.hpp"
#include "model/embedding.hpp"
#include "model/gelu.hpp"
#include "model/layer_norm.hpp"
#include "model/linear.hpp"
#include "model/math.hpp"
#include "model/rotary.hpp"
#include "plm/plm_config.hpp"

#if PLM_HAVE_CUDA
#include "gpu/esm2_layout.hpp"
#endif

#include <cmath>
#include <memory>
#include <type_traits>
#include <unordered_map>

namespace plm::model {
namespace {

enum class InitKind { Normal, Zero, One };

struct TableEntry {
  TensorInfo info;
  InitKind init;
};

std::vector<TableEntry> buildTable(const Esm2Config& c) {
  std::vector<TableEntry> table;
  std::int64_t offset = 0;
  const std::int64_t h = c.hidden, f = c.ffn, v = c.vocab;
  auto add = [&](const std::string& name, std::vector<std::int64_t> shape, bool decay,
                 InitKind init) {
    TensorInfo t;
    t.name = name;
    t.shape = shape;
    t.size = 1;
    for (auto e : shape) t.size *= e;
    t.offset = offset;
    t.weight_decay = decay;
    // Keep every tensor 64-byte aligned in the flat buffer (vector loads, future sharding).
    offset += (t.size + 15) / 16 * 16;
    table.push_back({t, init});
  };
  auto linear = [&](const std::string& prefix, std::int64_t out, std::int64_t in) {
    add(prefix + ".weight", {out, in}, true, InitKind::Normal);
    add(prefix + ".bias", {out}, false, InitKind::Zero);
  };
  auto norm = [&](const std::string& prefix, std::int64_t n) {
    add(prefix + ".weight", {n}, false, InitKind::One);
    add(prefix + ".bias", {n}, false, InitKind::Zero);
  };
  add("esm.embeddings.word_embeddings.weight", {v, h}, false, InitKind::Normal);
  for (int l = 0; l < c.num_layers; ++l) {
    const std::string p = "esm.encoder.layer." + std::to_string(l) + ".";
    linear(p + "attention.self.query", h, h);
    linear(p + "attention.self.key", h, h);
    linear(p + "attention.self.value", h, h);
    linear(p + "attention.output.dense", h, h);
    norm(p + "attention.LayerNorm", h);
    linear(p + "intermediate.dense", f, h);
    linear(p + "output.dense", h, f);
    norm(p + "LayerNorm", h);
  }
  norm("esm.encoder.emb_layer_norm_after", h);
  linear("lm_head.dense", h, h);
  norm("lm_head.layer_norm", h);
  add("lm_head.bias", {v}, false, InitKind::Zero);
  return table;
}

std::int64_t bufferSize(const std::vector<TableEntry>& table) {
  const auto& last = table.back().info;
  return (last.offset + last.size + 15) / 16 * 16;
}

/// Carves typed views out of one grow-only arena; a first pass with base == nullptr measures.
template <class T> struct Carver {
  T* base = nullptr;
  std::int64_t used = 0;
  View2<T> take(std::int64_t rows, std::int64_t cols) {
    T* p = base ? base + used : nullptr;
    used += (rows * cols + 15) / 16 * 16;
    return p ? View2<T>(p, rows, cols) : View2<T>();
  }
  View1<T> take(std::int64_t n) {
    T* p = base ? base + used : nullptr;
    used += (n + 15) / 16 * 16;
    return p ? View1<T>(p, n) : View1<T>();
  }
};

template <class X> View1<X> growView(View1<X>& storage, std::int64_t n, const char* label) {
  if (static_cast<std::int64_t>(storage.extent(0)) < n)
    storage = View1<X>(Kokkos::view_alloc(Kokkos::WithoutInitializing, std::string(label)), n);
  return View1<X>(storage.data(), n);
}

}  // namespace

template <class T> struct Esm2<T>::Impl {
  struct LayerParams {
    View2<T> wq, wk, wv, wo;  // (H, H) each, (out, in)
    View1<T> bq, bk, bv, bo;  // (H) each
    View1<T> ln1_g, ln1_b;    // (H) pre-attention LayerNorm
    View2<T> w1;              // (F, H)
    View1<T> b1;              // (F)
    View2<T> w2;              // (H, F)
    View1<T> b2;              // (H)
    View1<T> ln2_g, ln2_b;    // (H) pre-FFN LayerNorm
  };
  struct Params {
    View2<T> embed;                   // (V, H) word embedding, also the tied decoder
    std::vector<LayerParams> layers;  // (L)
    View1<T> lnf_g, lnf_b;            // (H) emb_layer_norm_after
    View2<T> head_w;                  // (H, H) lm_head.dense
    View1<T> head_b;                  // (H)
    View1<T> head_ln_g, head_ln_b;    // (H) lm_head.layer_norm
    View1<T> head_bias;               // (V) lm_head.bias (decoder bias)
  };
  struct LayerActs {
    View2<T> ln1;           // (T, H) LN1 output
    View1<T> mean1, rstd1;  // (T)
    View2<T> q, k, v;       // (T, H) q scaled and rotated, k rotated
    View2<T> o;             // (T, H) attention output before the output projection
    View2<T> lse;           // (T, heads)
    View2<T> xmid;          // (T, H) residual after attention
    View2<T> ln2;           // (T, H) LN2 output
    View1<T> mean2, rstd2;  // (T)
    View2<T> pre;           // (T, F) FFN pre-activation
  };
  struct Work {
    std::int64_t tokens = 0, rows = 0;
    View1<token_t> tokens_d;          // (T)
    View1<std::int32_t> labels_d;     // (T)
    View1<seqlen_t> cu;               // (n+1)
    View1<seqlen_t> position;         // (T)
    View1<std::int64_t> head_rows;    // (M) token index of each LM-head row
    View1<std::int32_t> head_labels;  // (M)
    View1<T> mult;                    // (T) token-dropout multiplier
    std::vector<View2<T>> xs;         // (L+1) x (T, H) residual stream at block boundaries
    std::vector<LayerActs> acts;      // (L) stored, or (1) shared when recomputing / forward only
    View2<T> act;                     // (T, F) GELU output (scratch)
    View1<T> attention_work;          // (2 T H) head-transposed copies inside attention
    View2<T> hidden;                  // (T, H) last_hidden_state
    View1<T> meanf, rstdf;            // (T)
    View2<T> hg, h1, h1g, h2;         // (M, H) head: gathered hidden, dense, GELU, LayerNorm
    View1<T> meanh, rstdh;            // (M)
    View2<T> logits;                  // (M, V), becomes dlogits in place
    // backward only
    View2<T> dx, dln, dq, dk, dv, dout;  // (T, H)
    View2<T> delta;                      // (T, heads)
    View2<T> dffn;                       // (T, F)
    View2<T> dhidden;                    // (T, H)
    View2<T> dh2, dh1, dhg;              // (M, H)
  };

  Esm2Config config;
  std::vector<TensorInfo> tensors;
  std::vector<InitKind> init_kinds;
#if PLM_HAVE_CUDA
  std::unique_ptr<gpu::Esm2Bf16> bf16;  // set by setBf16Compute(true): the GPU bf16 step
#endif
  std::unordered_map<std::string, std::size_t> index;
  View1<T> params;  // (numParameters + alignment padding)
  View1<T> grads;   // same layout
  Params p, g;
  AttentionTiles tiles;
  View2<T> cos_table, sin_table;  // (positions, head_dim/2)
  // Grow-only storage behind the workspace views.
  View1<T> arena;
  View1<token_t> tokens_store;
  View1<std::int32_t> labels_store, head_labels_store;
  View1<seqlen_t> cu_store, position_store;
  View1<std::int64_t> rows_store;
  Work w;
  ExecSpace space;

  explicit Impl(const Esm2Config& c) : config(c) {
    config.validate();
    auto table = buildTable(config);
    for (auto& e : table) {
      index[e.info.name] = tensors.size();
      tensors.push_back(e.info);
      init_kinds.push_back(e.init);
    }
    const std::int64_t n = bufferSize(table);
    params = View1<T>("plm::model::parameters", n);
    grads = View1<T>("plm::model::gradients", n);
    p = bind(params);
    g = bind(grads);
  }

  View2<T> view2(const View1<T>& buf, const std::string& name) {
    const auto& t = tensors[index.at(name)];
    return View2<T>(buf.data() + t.offset, t.shape[0], t.shape[1]);
  }
  View1<T> view1(const View1<T>& buf, const std::string& name) {
    const auto& t = tensors[index.at(name)];
    return View1<T>(buf.data() + t.offset, t.shape[0]);
  }

  Params bind(const View1<T>& buf) {
    Params r;
    r.embed = view2(buf, "esm.embeddings.word_embeddings.weight");
    for (int l = 0; l < config.num_layers; ++l) {
      const std::string pre = "esm.encoder.layer." + std::to_string(l) + ".";
      LayerParams lp;
      lp.wq = view2(buf, pre + "attention.self.query.weight");
      lp.bq = view1(buf, pre + "attention.self.query.bias");
      lp.wk = view2(buf, pre + "attention.self.key.weight");
      lp.bk = view1(buf, pre + "attention.self.key.bias");
      lp.wv = view2(buf, pre + "attention.self.value.weight");
      lp.bv = view1(buf, pre + "attention.self.value.bias");
      lp.wo = view2(buf, pre + "attention.output.dense.weight");
      lp.bo = view1(buf, pre + "attention.output.dense.bias");
      lp.ln1_g = view1(buf, pre + "attention.LayerNorm.weight");
      lp.ln1_b = view1(buf, pre + "attention.LayerNorm.bias");
      lp.w1 = view2(buf, pre + "intermediate.dense.weight");
      lp.b1 = view1(buf, pre + "intermediate.dense.bias");
      lp.w2 = view2(buf, pre + "output.dense.weight");
      lp.b2 = view1(buf, pre + "output.dense.bias");
      lp.ln2_g = view1(buf, pre + "LayerNorm.weight");
      lp.ln2_b = view1(buf, pre + "LayerNorm.bias");
      r.layers.push_back(lp);
    }
    r.lnf_g = view1(buf, "esm.encoder.emb_layer_norm_after.weight");
    r.lnf_b = view1(buf, "esm.encoder.emb_layer_norm_after.bias");
    r.head_w = view2(buf, "lm_head.dense.weight");
    r.head_b = view1(buf, "lm_head.dense.bias");
    r.head_ln_g = view1(buf, "lm_head.layer_norm.weight");
    r.head_ln_b = view1(buf, "lm_head.layer_norm.bias");
    r.head_bias = view1(buf, "lm_head.bias");
    return r;
  }

  void ensureRotary(int max_len) {
    if (static_cast<int>(cos_table.extent(0)) >= max_len) return;
    const int positions = std::max(max_len, config.max_positions);
    const int half = config.headDim() / 2;
    cos_table = View2<T>("plm::model::rotary_cos", positions, half);
    sin_table = View2<T>("plm::model::rotary_sin", positions, half);
    rotaryTables(space, config.headDim(), cos_table, sin_table);
  }

  void carve(Carver<T>& c, std::int64_t t, std::int64_t m, bool backward) {
    const std::int64_t h = config.hidden, f = config.ffn, nh = config.heads, v = config.vocab;
    const int layers = config.num_layers;
    w.mult = c.take(t);
    w.xs.assign(layers + 1, View2<T>());
    for (auto& x : w.xs) x = c.take(t, h);
    const int n_acts = backward && !config.recompute ? layers : 1;
    w.acts.assign(n_acts, LayerActs());
    for (auto& a : w.acts) {
      a.ln1 = c.take(t, h);
      a.mean1 = c.take(t);
      a.rstd1 = c.take(t);
      a.q = c.take(t, h);
      a.k = c.take(t, h);
      a.v = c.take(t, h);
      a.o = c.take(t, h);
      a.lse = c.take(t, nh);
      a.xmid = c.take(t, h);
      a.ln2 = c.take(t, h);
      a.mean2 = c.take(t);
      a.rstd2 = c.take(t);
      a.pre = c.take(t, f);
    }
    w.act = c.take(t, f);
    w.attention_work = c.take(2 * t * h);
    w.hidden = c.take(t, h);
    w.meanf = c.take(t);
    w.rstdf = c.take(t);
    w.hg = c.take(m, h);
    w.h1 = c.take(m, h);
    w.h1g = c.take(m, h);
    w.h2 = c.take(m, h);
    w.meanh = c.take(m);
    w.rstdh = c.take(m);
    w.logits = c.take(m, v);
    if (backward) {
      w.dx = c.take(t, h);
      w.dln = c.take(t, h);
      w.dq = c.take(t, h);
      w.dk = c.take(t, h);
      w.dv = c.take(t, h);
      w.dout = c.take(t, h);
      w.delta = c.take(t, nh);
      w.dffn = c.take(t, f);
      w.dhidden = c.take(t, h);
      w.dh2 = c.take(m, h);
      w.dh1 = c.take(m, h);
      w.dhg = c.take(m, h);
    }
  }

  /// Copies the batch to the device, checks it, lays out the workspace, and lists the rows the
  /// LM head runs on (labelled rows, or all rows when all_rows).
  void prepare(const data::MicroBatch& batch, bool all_rows, bool backward) {
    const std::int64_t t = batch.numTokens();
    const int n = batch.numSequences();
    if (static_cast<std::int64_t>(batch.labels.extent(0)) != t)
      throw Error("plm::model: micro-batch has " + std::to_string(t) + " tokens but " +
                  std::to_string(batch.labels.extent(0)) + " labels (a loader bug)");
    if (n < 1 || batch.cu_seqlens(0) != 0 || batch.cu_seqlens(n) != t)
      throw Error("plm::model: micro-batch cu_seqlens must start at 0 and end at the token count " +
                  std::to_string(t) + " (a loader bug)");
    int max_len = 0;
    for (int s = 0; s < n; ++s) {  // metadata over sequences
      const int len = batch.cu_seqlens(s + 1) - batch.cu_seqlens(s);
      if (len <= 0)
        throw Error("plm::model: micro-batch sequence " + std::to_string(s) +
                    " is empty or cu_seqlens decreases (a loader bug)");
      max_len = std::max(max_len, len);
    }
    ensureRotary(max_len);
    w.tokens = t;
    w.tokens_d = growView(tokens_store, t, "plm::model::tokens");
    w.labels_d = growView(labels_store, t, "plm::model::labels");
    w.cu = growView(cu_store, n + 1, "plm::model::cu_seqlens");
    w.position = growView(position_store, t, "plm::model::position");
    Kokkos::deep_copy(space, w.tokens_d,
                      Kokkos::View<const token_t*, HostSpace>(batch.tokens.data(), t));
    Kokkos::deep_copy(space, w.labels_d,
                      Kokkos::View<const std::int32_t*, HostSpace>(batch.labels.data(), t));
    Kokkos::deep_copy(space, w.cu,
                      Kokkos::View<const seqlen_t*, HostSpace>(batch.cu_seqlens.data(), n + 1));

    // Validate ids on the device (one reduction) and count the labelled rows.
    auto tokens = w.tokens_d;
    auto labels = w.labels_d;
    const int vocab = config.vocab;
    std::int64_t bad = 0, labelled = 0;
    Kokkos::parallel_reduce(
        "plm::model::check_batch", Kokkos::RangePolicy<ExecSpace>(space, 0, t),
        KOKKOS_LAMBDA(const std::int64_t i, std::int64_t& nbad, std::int64_t& nlab) {
          const int tok = tokens(i);
          const std::int32_t lab = labels(i);
          nbad += (tok >= vocab) || (lab != data::vocab::ignore_label && (lab < 0 || lab >= vocab));
          nlab += lab != data::vocab::ignore_label;
        },
        bad, labelled);
    if (bad != 0)
      throw Error(
          "plm::model: micro-batch holds " + std::to_string(bad) +
          " token ids or labels outside the 33-token ESM-2 vocabulary (a data or loader bug)");
    const std::int64_t m = all_rows ? t : labelled;
    w.rows = m;
    w.head_rows = growView(rows_store, m, "plm::model::head_rows");
    w.head_labels = growView(head_labels_store, m, "plm::model::head_labels");
    auto rows = w.head_rows;
    auto head_labels = w.head_labels;
    Kokkos::parallel_scan(
        "plm::model::head_rows", Kokkos::RangePolicy<ExecSpace>(space, 0, t),
        KOKKOS_LAMBDA(const std::int64_t i, std::int64_t& offset, const bool final) {
          const bool take = all_rows || labels(i) != data::vocab::ignore_label;
          if (take && final) {
            rows(offset) = i;
            head_labels(offset) = labels(i);
          }
          offset += take ? 1 : 0;
        });

    Carver<T> measure;
    carve(measure, t, m, backward);
    if (static_cast<std::int64_t>(arena.extent(0)) < measure.used) {
      arena = View1<T>();  // free before allocating the larger arena
      arena = View1<T>(Kokkos::view_alloc(Kokkos::WithoutInitializing, "plm::model::workspace"),
                       measure.used);
    }
    Carver<T> cut{arena.data(), 0};
    carve(cut, t, m, backward);
    sequenceInfo(space, w.cu, w.tokens_d, config.token_dropout, data::vocab::mask, w.position,
                 w.mult);
  }

  LayerActs& actsFor(int layer) { return w.acts[w.acts.size() == 1 ? 0 : layer]; }

  void layerForward(int layer, const View2<T>& x_in, LayerActs& a, const View2<T>& x_out) {
    const auto& lp = p.layers[layer];
    const T scale = T(1) / std::sqrt(T(config.headDim()));
    const double eps = config.layer_norm_eps;
    layerNormForward(space, x_in, lp.ln1_g, lp.ln1_b, eps, a.ln1, a.mean1, a.rstd1);
    linearForward(space, a.ln1, lp.wq, lp.bq, T(0), a.q);
    rotaryForward(space, a.q, w.position, config.heads, cos_table, sin_table, scale);
    linearForward(space, a.ln1, lp.wk, lp.bk, T(0), a.k);
    rotaryForward(space, a.k, w.position, config.heads, cos_table, sin_table, T(1));
    linearForward(space, a.ln1, lp.wv, lp.bv, T(0), a.v);
    attentionForward(space, a.q, a.k, a.v, w.cu, config.heads, a.o, a.lse, tiles, w.attention_work);
    Kokkos::deep_copy(space, a.xmid, x_in);
    linearForward(space, a.o, lp.wo, lp.bo, T(1), a.xmid);
    layerNormForward(space, a.xmid, lp.ln2_g, lp.ln2_b, eps, a.ln2, a.mean2, a.rstd2);
    linearForward(space, a.ln2, lp.w1, lp.b1, T(0), a.pre);
    geluForward(space, a.pre, w.act);
    Kokkos::deep_copy(space, x_out, a.xmid);
    linearForward(space, w.act, lp.w2, lp.b2, T(1), x_out);
  }

  /// On entry w.dx = dL/d(block output); on exit dL/d(block input).
  void layerBackward(int layer, const View2<T>& x_in, LayerActs& a) {
    const auto& lp = p.layers[layer];
    auto& lg = g.layers[layer];
    const T scale = T(1) / std::sqrt(T(config.headDim()));
    geluForward(space, a.pre, w.act);
    linearBackward(space, w.act, lp.w2, w.dx, T(0), w.dffn, lg.w2, lg.b2);
    geluBackward(space, a.pre, w.dffn, w.dffn);
    linearBackward(space, a.ln2, lp.w1, w.dffn, T(0), w.dln, lg.w1, lg.b1);
    layerNormBackward(space, a.xmid, lp.ln2_g, a.mean2, a.rstd2, w.dln, w.dx, lg.ln2_g, lg.ln2_b);
    linearBackward(space, a.o, lp.wo, w.dx, T(0), w.dout, lg.wo, lg.bo);
    attentionBackward(space, a.q, a.k, a.v, a.o, a.lse, w.dout, w.cu, config.heads, w.delta, w.dq,
                      w.dk, w.dv, tiles, w.attention_work);
    rotaryBackward(space, w.dq, w.position, config.heads, cos_table, sin_table, scale);
    rotaryBackward(space, w.dk, w.position, config.heads, cos_table, sin_table, T(1));
    linearBackward(space, a.ln1, lp.wq, w.dq, T(0), w.dln, lg.wq, lg.bq);
    linearBackward(space, a.ln1, lp.wk, w.dk, T(1), w.dln, lg.wk, lg.bk);
    linearBackward(space, a.ln1, lp.wv, w.dv, T(1), w.dln, lg.wv, lg.bv);
    layerNormBackward(space, x_in, lp.ln1_g, a.mean1, a.rstd1, w.dln, w.dx, lg.ln1_g, lg.ln1_b);
  }

  /// Embedding, blocks, final LayerNorm, LM head and loss.  dlogits (scaled) replace logits in
  /// place when backward.
  double forwardPass(bool backward, double grad_scale) {
    const int layers = config.num_layers;
    embeddingForward(space, w.tokens_d, w.mult, p.embed, w.xs[0]);
    for (int l = 0; l < layers; ++l) layerForward(l, w.xs[l], actsFor(l), w.xs[l + 1]);
    layerNormForward(space, w.xs[layers], p.lnf_g, p.lnf_b, config.layer_norm_eps, w.hidden,
                     w.meanf, w.rstdf);
    auto rows = w.head_rows;
    auto hidden = w.hidden;
    auto hg = w.hg;
    const int h = config.hidden;
    Kokkos::parallel_for(
        "plm::model::head_gather", Kokkos::RangePolicy<ExecSpace>(space, 0, w.rows),
        KOKKOS_LAMBDA(const std::int64_t m) {
          for (int c = 0; c < h; ++c) hg(m, c) = hidden(rows(m), c);
        });
    linearForward(space, w.hg, p.head_w, p.head_b, T(0), w.h1);
    geluForward(space, w.h1, w.h1g);
    layerNormForward(space, w.h1g, p.head_ln_g, p.head_ln_b, config.layer_norm_eps, w.h2, w.meanh,
                     w.rstdh);
    linearForward(space, w.h2, p.embed, p.head_bias, T(0), w.logits);
    return crossEntropy(space, w.logits, w.head_labels, grad_scale,
                        backward ? w.logits : View2<T>());
  }

  void backwardPass() {
    const int layers = config.num_layers;
    // LM head (w.logits holds dlogits).
    linearBackward(space, w.h2, p.embed, w.logits, T(0), w.dh2, g.embed, g.head_bias);
    Kokkos::deep_copy(space, w.dh1, T(0));
    layerNormBackward(space, w.h1g, p.head_ln_g, w.meanh, w.rstdh, w.dh2, w.dh1, g.head_ln_g,
                      g.head_ln_b);
    geluBackward(space, w.h1, w.dh1, w.dh1);
    linearBackward(space, w.hg, p.head_w, w.dh1, T(0), w.dhg, g.head_w, g.head_b);
    Kokkos::deep_copy(space, w.dhidden, T(0));
    auto rows = w.head_rows;
    auto dhidden = w.dhidden;
    auto dhg = w.dhg;
    const int h = config.hidden;
    Kokkos::parallel_for(
        "plm::model::head_scatter", Kokkos::RangePolicy<ExecSpace>(space, 0, w.rows),
        KOKKOS_LAMBDA(const std::int64_t m) {  // rows are distinct: no conflicts
          for (int c = 0; c < h; ++c) dhidden(rows(m), c) = dhg(m, c);
        });
    Kokkos::deep_copy(space, w.dx, T(0));
    layerNormBackward(space, w.xs[layers], p.lnf_g, w.meanf, w.rstdf, w.dhidden, w.dx, g.lnf_g,
                      g.lnf_b);
    for (int l = layers - 1; l >= 0; --l) {
      if (config.recompute) layerForward(l, w.xs[l], w.acts[0], w.xs[l + 1]);
      layerBackward(l, w.xs[l], actsFor(l));
    }
    embeddingBackward(space, w.tokens_d, w.mult, w.dx, data::vocab::pad, g.embed);
  }
};

template <class T> Esm2<T>::Esm2(const Esm2Config& config) : impl_member(new Impl(config)) {}

template <class T> Esm2<T>::~Esm2() { delete impl_member; }

template <class T> const Esm2Config& Esm2<T>::config() const { return impl_member->config; }

template <class T> const std::vector<TensorInfo>& Esm2<T>::tensors() const {
  return impl_member->tensors;
}

template <class T> const TensorInfo& Esm2<T>::tensor(const std::string& name) const {
  auto it = impl_member->index.find(name);
  if (it == impl_member->index.end())
    throw Error("plm::model: no parameter named '" + name +
                "' in this ESM-2 (names are Hugging Face's, e.g. "
                "esm.encoder.layer.0.attention.self.query.weight)");
  return impl_member->tensors[it->second];
}

template <class T> View1<T> Esm2<T>::parameters() { return impl_member->params; }

template <class T> View1<T> Esm2<T>::gradients() { return impl_member->grads; }

template <class T> void Esm2<T>::initialize(std::uint64_t seed) {
  auto& im = *impl_member;
  Kokkos::deep_copy(im.space, im.params, T(0));  // also the alignment padding
  auto params = im.params;
  for (std::size_t i = 0; i < im.tensors.size(); ++i) {  // over tensors, not elements
    const auto& t = im.tensors[i];
    const int kind = static_cast<int>(im.init_kinds[i]);
    const std::int64_t offset = t.offset;
    const std::uint64_t stream = i;
    Kokkos::parallel_for(
        "plm::model::initialize", Kokkos::RangePolicy<ExecSpace>(im.space, 0, t.size),
        KOKKOS_LAMBDA(const std::int64_t e) {
          T value = 0;
          if (kind == static_cast<int>(InitKind::Normal))
            value = static_cast<T>(0.02 * math::normal(seed, stream, e));
          if (kind == static_cast<int>(InitKind::One)) value = T(1);
          params(offset + e) = value;
        });
  }
  auto pad_row = Kokkos::subview(im.p.embed, static_cast<int>(data::vocab::pad), Kokkos::ALL());
  Kokkos::deep_copy(im.space, pad_row, T(0));
  im.space.fence();
}

template <class T> void Esm2<T>::zeroGradients() {
  Kokkos::deep_copy(impl_member->space, impl_member->grads, T(0));
  impl_member->space.fence();
}

template <class T> void Esm2<T>::setBf16Compute(bool on) {
#if PLM_HAVE_CUDA
  if constexpr (std::is_same_v<T, float>) {
    impl_member->bf16 =
        on ? std::make_unique<gpu::Esm2Bf16>(gpu::esm2Shape(config()), gpu::esm2Offsets(*this))
           : nullptr;
    return;
  }
#endif
  if (on)
    throw collectiveError(
        "train.precision: bf16 runs on the CUDA build only (this build computes in fp32); set "
        "train.precision: fp32 or build with the `cuda` preset (doc/gpu.md)");
}

template <class T>
double Esm2<T>::forwardBackward(const data::MicroBatch& batch, double grad_scale) {
  if (batch.numTokens() == 0) return 0.0;  // a rank with no micro-batch this step
#if PLM_HAVE_CUDA
  if constexpr (std::is_same_v<T, float>) {
    if (impl_member->bf16) {
      impl_member->space.fence();
      return impl_member->bf16->forwardBackward(
          impl_member->space.cuda_stream(), impl_member->params.data(), impl_member->grads.data(),
          gpu::hostBatch(batch), grad_scale);
    }
  }
#endif
  Kokkos::Profiling::pushRegion("plm::model::forwardBackward");
  auto& im = *impl_member;
  im.prepare(batch, false, true);
  const double loss = im.forwardPass(true, grad_scale);
  im.backwardPass();
  im.space.fence();
  Kokkos::Profiling::popRegion();
  return loss;
}

template <class T>
double Esm2<T>::forward(const data::MicroBatch& batch, ForwardOutputs<T>* outputs) {
  auto& im = *impl_member;
  if (batch.numTokens() == 0) {
    if (outputs && outputs->want_logits)
      outputs->logits = View2<T>("plm::model::logits", 0, im.config.vocab);
    if (outputs && outputs->want_hidden)
      outputs->hidden = View2<T>("plm::model::hidden", 0, im.config.hidden);
    return 0.0;
  }
  Kokkos::Profiling::pushRegion("plm::model::forward");
  const bool all_rows = outputs && outputs->want_logits;
  im.prepare(batch, all_rows, false);
  const double loss = im.forwardPass(false, 1.0);
  if (outputs && outputs->want_logits) {
    outputs->logits = View2<T>("plm::model::logits", im.w.rows, im.config.vocab);
    Kokkos::deep_copy(im.space, outputs->logits, im.w.logits);
  }
  if (outputs && outputs->want_hidden) {
    outputs->hidden = View2<T>("plm::model::hidden", im.w.tokens, im.config.hidden);
    Kokkos::deep_copy(im.space, outputs->hidden, im.w.hidden);
  }
  im.space.fence();
  Kokkos::Profiling::popRegion();
  return loss;
}

template <class T> std::int64_t Esm2<T>::workspaceBytes() const {
  return static_cast<std::int64_t>(impl_member->arena.extent(0) * sizeof(T));
}

template class Esm2<float>;
template class Esm2<double>;

}  // namespace plm::model
