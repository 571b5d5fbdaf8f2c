// MoeMlp and the routing reference (see moe.hpp for the design and the accumulation rule).
#include "model/moe.hpp"

#include "core/error.hpp"
#include "core/trace.hpp"
#include "dist/runtime.hpp"
#include "dist/stream.hpp"
#include "model/gemm.hpp"
#include "model/moe_experts.hpp"
#include "plm/plm_config.hpp"

#if PLM_HAVE_CUDA
#include "gpu/moe.hpp"
#include "gpu/moe_grouped.hpp"
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <numeric>
#include <type_traits>

namespace plm::model {

// ---- configuration ---------------------------------------------------------------------------

void MoeConfig::validate(int hidden) const {
  if (!enabled()) return;
  auto fail = [](const std::string& what) {
    throw collectiveError("moe: " + what + " (doc/model.md, Mixture of Experts)");
  };
  if (top_k < 1 || top_k > experts)
    fail("top_k = " + std::to_string(top_k) +
         " must be in [1, experts = " + std::to_string(experts) + "]");
  if (every < 1) fail("every must be >= 1, got " + std::to_string(every));
  if (expert_ffn < 1)
    fail("expert_ffn must be positive, got " + std::to_string(expert_ffn) +
         " (set moe.expert_ffn or use an esm2_moe_* preset)");
  if (shared_experts < 0) fail("shared_experts must be >= 0");
  if (capacity_factor < 0) fail("capacity_factor must be >= 0 (0 = dropless)");
  if (aux_loss < 0 || z_loss < 0 || seq_aux_loss < 0)
    fail("aux_loss, seq_aux_loss and z_loss must be >= 0");
  if (bias_balance && !(bias_rate > 0)) fail("bias_rate must be positive with bias_balance");
  if (expert_activation == ExpertActivation::Swiglu &&
      (static_cast<std::int64_t>(expert_ffn) * hidden) % 16 != 0)
    fail("expert_activation swiglu needs expert_ffn x hidden (" + std::to_string(expert_ffn) +
         " x " + std::to_string(hidden) +
         ") to be a multiple of 16 (gate and up are stored as one "
         "matrix)");
  if (hidden <= 0) fail("the model width must be positive");
}

// ---- routing (host reference) ----------------------------------------------------------------

std::int64_t expertCapacity(const MoeConfig& c, std::int64_t tokens) {
  return c.capacity_factor > 0 ? static_cast<std::int64_t>(std::ceil(c.capacity_factor * tokens *
                                                                     c.top_k / double(c.experts)))
                               : 0;
}

Routing route(const double* logits, int tokens, const MoeConfig& c, const double* bias) {
  Routing r = selectExperts(logits, tokens, c, bias);
  cutCapacity(r, expertCapacity(c, tokens));
  return r;
}

Routing selectExperts(const double* logits, int tokens, const MoeConfig& c, const double* bias) {
  Routing r;
  const int e_n = c.experts, k = c.top_k;
  r.tokens = tokens;
  r.experts = e_n;
  r.top_k = k;
  r.prob.assign(static_cast<std::size_t>(tokens) * e_n, 0.0);
  r.lse.assign(tokens, 0.0);
  r.expert.assign(static_cast<std::size_t>(tokens) * k, 0);
  r.gate.assign(static_cast<std::size_t>(tokens) * k, 0.0);
  r.row.assign(static_cast<std::size_t>(tokens) * k, -1);
  r.routed.assign(e_n, 0);
  r.kept.assign(e_n, 0);
  r.total_routed.assign(e_n, 0);
  if (tokens == 0) return r;
  std::vector<int> order(e_n);
  std::vector<double> score(e_n);
  for (int t = 0; t < tokens; ++t) {
    const double* l = logits + static_cast<std::size_t>(t) * e_n;
    double* p = &r.prob[static_cast<std::size_t>(t) * e_n];
    const double m = *std::max_element(l, l + e_n);
    double s = 0;
    for (int e = 0; e < e_n; ++e) s += std::exp(l[e] - m);
    r.lse[t] = m + std::log(s);
    double total = 0;
    for (int e = 0; e < e_n; ++e) {
      p[e] =
          c.router == RouterKind::Softmax ? std::exp(l[e] - m) / s : 1.0 / (1.0 + std::exp(-l[e]));
      total += p[e];
    }
    double h = 0;
    for (int e = 0; e < e_n; ++e) {
      const double q = p[e] / total;
      if (q > 0) h -= q * std::log(q);
    }
    r.entropy += h;
    for (int e = 0; e < e_n; ++e) score[e] = p[e] + (bias ? bias[e] : 0.0);
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int a, int b) {
      return score[a] > score[b] || (score[a] == score[b] && a < b);
    });
    double sel = 0;
    for (int j = 0; j < k; ++j) sel += p[order[j]];
    for (int j = 0; j < k; ++j) {
      const int e = order[j];
      r.expert[static_cast<std::size_t>(t) * k + j] = e;
      r.gate[static_cast<std::size_t>(t) * k + j] = c.normalize_topk ? p[e] / sel : p[e];
      ++r.routed[e];
    }
  }
  r.entropy /= tokens;
  // Load-balancing loss from the routing before the capacity cut (counting after it
  // under-reports the overload the loss is meant to remove).
  for (int e = 0; e < e_n; ++e) {
    double mean_p = 0;
    for (int t = 0; t < tokens; ++t) mean_p += r.prob[static_cast<std::size_t>(t) * e_n + e];
    mean_p /= tokens;
    r.aux += e_n * (static_cast<double>(r.routed[e]) / (static_cast<double>(tokens) * k)) * mean_p;
  }
  for (int t = 0; t < tokens; ++t) r.z += r.lse[t] * r.lse[t];
  r.z /= tokens;
  r.total_tokens = tokens;
  r.total_routed = r.routed;
  return r;
}

void cutCapacity(Routing& r, std::int64_t capacity, const std::vector<CutStart>& starts) {
  // Capacity cut in token order, then the stable permutation: expert-major, token order within.
  // `seen` counts the micro-batch's slots of each expert before the slot in hand.
  const int e_n = r.experts, k = r.top_k;
  r.capacity = capacity;
  r.kept.assign(e_n, 0);
  r.dropped = 0;
  const std::size_t slots = static_cast<std::size_t>(r.tokens) * k;
  r.row.assign(slots, -1);
  std::vector<char> keep(slots, 0);
  std::vector<std::int64_t> seen(e_n, 0);
  std::size_t next_start = 0;
  for (std::size_t s = 0; s < slots; ++s) {
    if (s % k == 0)
      while (next_start < starts.size() &&
             starts[next_start].token == static_cast<std::int64_t>(s / k))
        seen = starts[next_start++].before;
    const int e = r.expert[s];
    if (capacity == 0 || seen[e] < capacity) {
      keep[s] = 1;
      ++r.kept[e];
    } else {
      ++r.dropped;
    }
    ++seen[e];
  }
  std::vector<std::int64_t> next(e_n, 0);
  for (int e = 1; e < e_n; ++e) next[e] = next[e - 1] + r.kept[e - 1];
  const std::int64_t rows = next[e_n - 1] + r.kept[e_n - 1];
  r.row_token.assign(rows, 0);
  r.row_gate.assign(rows, 0.0);
  for (std::size_t s = 0; s < slots; ++s) {
    if (!keep[s]) continue;
    const std::int64_t p = next[r.expert[s]]++;
    r.row[s] = static_cast<int>(p);
    r.row_token[p] = static_cast<int>(s / k);
    r.row_gate[p] = r.gate[s];
  }
}

std::vector<double> sequenceLoad(const Routing& r, const int* cu, int n) {
  const int e_n = r.experts, k = r.top_k;
  const std::size_t w = 2 * static_cast<std::size_t>(e_n) + 1;
  std::vector<double> load(static_cast<std::size_t>(std::max(n, 0)) * w, 0.0);
  for (int q = 0; q < n; ++q) {
    double* l = &load[q * w];
    for (int t = cu[q]; t < cu[q + 1]; ++t) {
      for (int j = 0; j < k; ++j) l[r.expert[static_cast<std::size_t>(t) * k + j]] += 1.0;
      for (int e = 0; e < e_n; ++e) l[e_n + e] += r.prob[static_cast<std::size_t>(t) * e_n + e];
    }
    l[2 * e_n] = std::max(cu[q + 1] - cu[q], 0);
  }
  return load;
}

double sequenceAux(const Routing& r, const int* cu, int n, double scale, double* dprob,
                   const double* load) {
  const int e_n = r.experts, k = r.top_k;
  if (n <= 0 || (r.tokens == 0 && !load)) return 0.0;
  std::vector<double> own;
  if (!load) {
    own = sequenceLoad(r, cu, n);
    load = own.data();
  }
  const std::size_t w = 2 * static_cast<std::size_t>(e_n) + 1;
  double total = 0;
  std::vector<double> f(e_n);
  for (int q = 0; q < n; ++q) {
    const double* l = load + q * w;
    const double len = l[2 * e_n];
    if (len <= 0) continue;
    for (int e = 0; e < e_n; ++e) {
      f[e] = l[e] / (len * k);
      total += e_n * f[e] * (l[e_n + e] / len);
    }
    if (dprob)
      for (int t = cu[q]; t < cu[q + 1]; ++t)
        for (int e = 0; e < e_n; ++e)
          dprob[static_cast<std::size_t>(t) * e_n + e] += scale * e_n * f[e] / len / n;
  }
  return total / n;
}

template <class T> void centreRows(std::vector<T>& w, int experts, const std::vector<double>& m) {
  const std::size_t h = m.size();
  double norm2 = 0;
  for (double v : m) norm2 += v * v;
  if (!(norm2 > 0)) return;
  for (int e = 0; e < experts; ++e) {
    T* row = w.data() + static_cast<std::size_t>(e) * h;
    double along = 0;
    for (std::size_t i = 0; i < h; ++i) along += static_cast<double>(row[i]) * m[i];
    along /= norm2;
    for (std::size_t i = 0; i < h; ++i)
      row[i] = static_cast<T>(static_cast<double>(row[i]) - along * m[i]);
  }
}

template void centreRows<float>(std::vector<float>&, int, const std::vector<double>&);
template void centreRows<double>(std::vector<double>&, int, const std::vector<double>&);

void routeBackward(const Routing& r, const MoeConfig& c, const double* logits, const double* dgate,
                   double aux_scale, double z_scale, double* dlogits, const double* dprob) {
  const int e_n = r.experts, k = r.top_k, tokens = r.tokens;
  if (tokens == 0) return;
  std::vector<double> dp(e_n), aux_dp(e_n);
  const double total = static_cast<double>(r.total_tokens);  // the losses' tokens
  for (int e = 0; e < e_n; ++e)
    aux_dp[e] = aux_scale * e_n * (static_cast<double>(r.total_routed[e]) / (total * k)) / total;
  for (int t = 0; t < tokens; ++t) {
    const double* p = &r.prob[static_cast<std::size_t>(t) * e_n];
    const double* l = logits + static_cast<std::size_t>(t) * e_n;
    double* dl = dlogits + static_cast<std::size_t>(t) * e_n;
    for (int e = 0; e < e_n; ++e)
      dp[e] = aux_dp[e] + (dprob ? dprob[static_cast<std::size_t>(t) * e_n + e] : 0.0);
    const std::size_t s0 = static_cast<std::size_t>(t) * k;
    if (c.normalize_topk) {
      double sel = 0, inner = 0;
      for (int j = 0; j < k; ++j) sel += p[r.expert[s0 + j]];
      for (int j = 0; j < k; ++j)
        if (r.row[s0 + j] >= 0) inner += dgate[s0 + j] * r.gate[s0 + j];
      for (int j = 0; j < k; ++j) {
        const double dg = r.row[s0 + j] >= 0 ? dgate[s0 + j] : 0.0;
        dp[r.expert[s0 + j]] += (dg - inner) / sel;
      }
    } else {
      for (int j = 0; j < k; ++j)
        if (r.row[s0 + j] >= 0) dp[r.expert[s0 + j]] += dgate[s0 + j];
    }
    if (c.router == RouterKind::Softmax) {
      double dot = 0;
      for (int e = 0; e < e_n; ++e) dot += p[e] * dp[e];
      for (int e = 0; e < e_n; ++e) dl[e] = p[e] * (dp[e] - dot);
    } else {
      for (int e = 0; e < e_n; ++e) dl[e] = dp[e] * p[e] * (1.0 - p[e]);
    }
    if (z_scale != 0)
      for (int e = 0; e < e_n; ++e)
        dl[e] += z_scale * 2.0 * r.lse[t] * std::exp(l[e] - r.lse[t]) / total;
  }
}

// ---- the block -------------------------------------------------------------------------------

namespace {

template <class T> View1<T> grow(View1<T>& storage, std::int64_t n, const char* label) {
  if (static_cast<std::int64_t>(storage.extent(0)) < n)
    storage = View1<T>(Kokkos::view_alloc(Kokkos::WithoutInitializing, std::string(label)), n);
  return View1<T>(storage.data(), n);
}

template <class T>
Mat rowsOf(const View1<T>& buf, std::int64_t first, std::int64_t rows, std::int64_t cols) {
  return Mat{buf.data() + first * cols, dtypeOf<T>(), rows, cols, cols};
}

/// Rows [first, first + rows) of a (., cols) matrix of element type `dtype` kept in storage of
/// T (a bf16 activation takes half a float's room).
template <class T> Mat rowsAs(const View1<T>& buf, DType dtype, std::int64_t first,
                              std::int64_t rows, std::int64_t cols) {
  char* base = reinterpret_cast<char*>(buf.data()) + first * cols * sizeOf(dtype);
  return Mat{base, dtype, rows, cols, cols};
}

#if PLM_HAVE_CUDA
gpu::bf16* bf16Data(const Mat& m) {
  if (m.dtype != DType::BF16 || m.ld != m.cols)
    throw Error("plm::model::MoeMlp: expected a contiguous bf16 matrix, got " +
                std::string(dtypeName(m.dtype)) + " (a bug)");
  return static_cast<gpu::bf16*>(m.data);
}
#endif

/// Bytes free in the memory space the model's buffers live in (the GPU's, or the host's
/// MemAvailable); 0 when unknown.
std::int64_t freeBytes() {
#if defined(KOKKOS_ENABLE_CUDA)
  std::size_t free_bytes = 0, total_bytes = 0;
  if (cudaMemGetInfo(&free_bytes, &total_bytes) == cudaSuccess)
    return static_cast<std::int64_t>(free_bytes);
  return 0;
#else
  std::ifstream in("/proc/meminfo");
  std::string key;
  std::int64_t kib = 0;
  std::string unit;
  while (in >> key >> kib >> unit)
    if (key == "MemAvailable:") return kib * 1024;
  return 0;
#endif
}

/// Storage of T for n elements of `dtype`.
template <class T>
View1<T> growAs(View1<T>& storage, std::int64_t n, DType dtype, const char* label) {
  const std::int64_t bytes = n * static_cast<std::int64_t>(sizeOf(dtype));
  return grow(storage, (bytes + std::int64_t(sizeof(T)) - 1) / std::int64_t(sizeof(T)), label);
}

/// A host vector copied into grow-only device storage, ordered on `space`'s stream (no global
/// fence).  A pageable source is staged before the copy call returns, so `host` may go after it.
template <class X> View1<X> toDevice(const ExecSpace& space, View1<X>& storage,
                                     const std::vector<X>& host, const char* label) {
  auto v = grow(storage, static_cast<std::int64_t>(host.size()), label);
  Kokkos::deep_copy(space, v, Kokkos::View<const X*, HostSpace>(host.data(), host.size()));
  return v;
}
/// As above, with a global fence before and after (Kokkos' deep_copy without a space).
template <class X>
View1<X> toDevice(View1<X>& storage, const std::vector<X>& host, const char* label) {
  auto v = grow(storage, static_cast<std::int64_t>(host.size()), label);
  Kokkos::deep_copy(v, Kokkos::View<const X*, HostSpace>(host.data(), host.size()));
  return v;
}

}  // namespace

template <class T> struct MoeMlp<T>::State {
  int layer = 0;
  MoeConfig c;
  int hidden = 0;
  MoeWeights w, g;
  MoeStep* step = nullptr;
  ExpertParallel ep;
  MoeLayerStats stats;

  // Kept from forward for backward.
  std::int64_t tokens = 0;
  Routing routing;
  std::vector<double> logits_host;  // (T, E)
  // Expert parallelism: rows this rank sends to / receives from each rank of the group, the
  // local experts' row counts and the expert-major <-> source-major maps of received rows.
  std::vector<std::int64_t> send_rows, recv_rows;
  std::vector<std::int64_t> local_rows;  // (E / E_p)
  int first_expert = 0, local_experts = 0;
  std::int64_t expert_rows = 0;  // rows this rank computes
  // Self rows first (moe.overlap: true, off by default; not with FP8 experts): this rank's own rows
  // of its own experts skip the exchange (zero counts to and from self) and are computed in place,
  // from the local permuted buffer's contiguous block [self_at, self_at + self_n), while the other
  // ranks' rows travel; the expert side then holds [self rows | exchanged rows], both expert-major.
  // Off (or at expert degree 1): self_n = 0 and every row goes through the exchange.
  std::int64_t self_at = 0, self_n = 0, exchanged = 0;
  std::vector<std::int64_t> self_rows, exchanged_rows;  // (E / E_p) per expert
  std::vector<std::int64_t> local_at, recv_at;  // row offsets per rank: local buffer, received

  // Device workspace (grow-only storage, exact-size views).
  View1<T> logits_s, dlogits_s, slot_gate_s, row_gate_s, dgate_s;
  View1<std::int32_t> slot_row_s, row_token_s, to_expert_s, to_source_s;
  View1<T> xperm_s, y_s, dy_s, dx_s;  // local permuted rows (R, H)
  View1<T> recv_s, xexp_s, pre_s, act_s, yexp_s, dpre_s, dyexp_s, dxexp_s;  // expert side
  View1<T> spre_s, sact_s, sdpre_s;  // shared experts (T, S F_e)
  View1<T> dact_s;                   // SwiGLU experts: d(act) (expert rows, F_e)
  View1<T> logits, slot_gate, row_gate, xperm, y, xexp, pre, act, yexp, spre, sact;
  View1<std::int32_t> slot_row, row_token, to_expert, to_source;

  // Compute precision of the expert activations: the master type on the portable path, bf16
  // on the CUDA path (train.precision: bf16; the router and the gates stay in the master type).
  DType cdt = dtypeOf<T>();
  View1<T> hf_s, dhr_s;         // the router's fp32 copy of a bf16 h, its input gradient (T, H)
  const void* hf_of = nullptr;  // the bf16 h that hf_s holds widened (rows x cols)
  std::int64_t hf_rows = 0, hf_cols = 0;

  // Esm2::centreRouters: the router input summed over its passes, and the router centred on one
  // pass's own mean input (E, H) with which that pass routes.
  RouterInputSums input_sums;
  View1<double> input_sum_s;
  View1<T> centred_s;
  // moe.router_projection: the router input summed over the step's training forwards (H, in
  // the master type: fp32 under bf16), a column of ones for that GEMV, the unit mean (also the
  // sum widened on its way to the host) and W u of the projection.
  View1<T> step_sum_s, ones_s;
  View1<double> unit_s, wu_s;
  // moe.router_projection in a training pass: the router projected off this micro-batch's own
  // mean input (E, H), with which the pass routes and its backward runs (route_w); the
  // micro-batch's column sum s (H) and [W s / |s|^2 (E) | |s|^2], which the backward reuses.
  View1<T> batch_sum_s, batch_w_s;
  View1<double> batch_wu_s;
  View2<T> route_w;
  // The projection's backward (projectionBackward): X s and G (W s) / |s|^2 (T), X^T of the
  // latter and the input gradient every token shares (H), G^T X s (E), a dot product (1).
  View1<T> proj_xs_s, proj_gw_s, proj_xg_s, proj_gx_s, proj_vf_s;
  View1<double> proj_v_s, proj_dot_s;
  bool step_sum_live = false;  // step_sum_s holds sums not yet taken
  // The bf16 CUDA router (fastRouter): the forward's logits and, under the projection, X s
  // (proj_xs_s) straight from the bf16 h (no fp32 copy); the backward's dW and X^T (G W s)
  // likewise (gpu::routerOuter, its workspace here).
  bool router_bf16 = false;
  View1<T> outer_ws_s, colsum_ws_s;

  std::int64_t rows = 0;                // permuted rows of the pass (kept slots)
  std::int64_t permuted_rows = -1;      // rows permuted before the counts arrived, else -1
  bool routed_on_device = false;        // this pass's routing ran on the device (bf16 path)
  std::vector<double> device_prob_sum;  // (E) the device routing's probability sums
  double device_lse2_sum = 0;
  std::vector<double> seq_load;  // a context shard's whole-sequence loads (sequenceAux), else empty
  // A forward whose experts ran from the device routing's own counts (runExpertsOnDevice) left
  // its summary on the way: settle() takes it when the host first needs it (the backward, the
  // next pass, the statistics), and adds then what the forward would have added to `pending`
  // (nullptr: nothing, a rerun forward).
  bool route_pending = false;
  MoeStep* pending = nullptr;
  bool pending_training = false;
  double pending_weight = 0;
  View1<std::int64_t> counts_send_s, counts_recv_s;  // plan(): the count exchange's buffers
#if PLM_HAVE_CUDA
  gpu::RouteArgs route_args;
  gpu::RouteBuffers route_bufs;
  View1<T> route_ws_s;
  std::unique_ptr<gpu::RouteReadback> readback;  // the summary's pinned landing place
#endif

  bool bf16() const { return cdt == DType::BF16; }

  /// The bf16 path routes on the device unless the sequence-level loss needs the host's
  /// per-token data, or moe.routing: host asks for the reference.
  bool deviceRouting() const {
    if (!std::is_same_v<T, float> || !bf16() || c.seq_aux_loss > 0 || c.host_routing) return false;
    // A context shard's capacity cut counts the other shards' slots (cutCapacity's starts).
    return !(step && step->context && c.capacity_factor > 0);
  }

  /// Starts routing the logits of this pass on the device: the permutation's device arrays are
  /// ready on the stream when this returns, the summary (counts, losses) for the host is on its
  /// way (routeDeviceFinish).  Nothing waits here, so what the layer launches next (the
  /// permutation of a dropless routing, the count exchange) overlaps the host's wait.
  void routeDeviceStart(OpContext& ctx, std::int64_t t_n) {
    PLM_TRACE("plm::moe route");
    settle();  // the readback is about to be reused
#if PLM_HAVE_CUDA
    const int e_n = c.experts, k = c.top_k;
    gpu::RouteArgs& a = route_args;
    a.tokens = t_n;
    a.experts = e_n;
    a.top_k = k;
    a.softmax = c.router == RouterKind::Softmax;
    a.normalize_topk = c.normalize_topk;
    a.capacity = c.capacity_factor > 0
                     ? static_cast<std::int64_t>(
                           std::ceil(c.capacity_factor * t_n * k / static_cast<double>(e_n)))
                     : 0;
    a.logits = reinterpret_cast<const float*>(logits.data());
    a.bias = w.expert_bias.empty() ? nullptr : w.expert_bias.template ptr<float>();
    const std::size_t bytes = gpu::routeWorkspaceBytes(t_n, e_n, k);
    View1<T> ws = grow(route_ws_s, static_cast<std::int64_t>((bytes + sizeof(T) - 1) / sizeof(T)),
                       "plm::model::moe::route_workspace");
    route_bufs = gpu::routeBuffers(ws.data(), t_n, e_n, k);
    if (!readback) readback = std::make_unique<gpu::RouteReadback>();
    gpu::routeOnDeviceAsync(ctx.space().cuda_stream(), a, route_bufs, *readback);
    const std::int64_t slots = t_n * k;
    slot_row = View1<std::int32_t>(route_bufs.slot_row, slots);
    slot_gate = View1<T>(reinterpret_cast<T*>(route_bufs.gate), slots);
    row_token = View1<std::int32_t>(route_bufs.row_token, slots);
    row_gate = View1<T>(reinterpret_cast<T*>(route_bufs.row_gate), slots);
    routed_on_device = true;
#else
    (void)ctx;
    (void)t_n;
#endif
  }

  /// Waits for the summary of routeDeviceStart (an event: the work queued after it keeps
  /// running) and fills `routing` and the statistics the host keeps.
  void routeDeviceFinish() {
    PLM_TRACE("plm::moe route wait");
#if PLM_HAVE_CUDA
    const int e_n = c.experts, k = c.top_k;
    const std::int64_t t_n = route_args.tokens;
    const gpu::RouteSummary sum = gpu::routeSummary(*readback);
    Routing& r = routing;
    r = Routing();
    r.tokens = static_cast<int>(t_n);
    r.experts = e_n;
    r.top_k = k;
    r.routed = sum.routed;
    r.kept = sum.kept;
    r.total_tokens = t_n;
    r.total_routed = sum.routed;
    device_prob_sum = sum.prob_sum;
    device_lse2_sum = sum.lse2_sum;
    r.capacity = route_args.capacity;
    rows = 0;
    for (int e = 0; e < e_n; ++e) {
      rows += r.kept[e];
      r.dropped += r.routed[e] - r.kept[e];
    }
    if (t_n > 0) {
      for (int e = 0; e < e_n; ++e)
        r.aux += e_n * (static_cast<double>(r.routed[e]) / (static_cast<double>(t_n) * k)) *
                 (sum.prob_sum[e] / t_n);
      r.z = sum.lse2_sum / t_n;
      r.entropy = sum.entropy_sum / t_n;
    }
    if (permuted_rows >= 0 && permuted_rows != rows)
      throw Error("plm::model::MoeMlp: layer " + std::to_string(layer) + " permuted " +
                  std::to_string(permuted_rows) +
                  " rows before its counts arrived, the counts say " + std::to_string(rows) +
                  " (a bug)");
#endif
  }
  /// What a forward adds to the step once its routing is known: the router losses to the
  /// objective (a context shard its token share) and, in training, the statistics.
  void account(MoeStep& st, bool training, double loss_weight, std::int64_t t_n, double seq_aux) {
    const Routing& r = routing;
    const double share = !st.context ? 1.0
                         : r.total_tokens > 0
                             ? static_cast<double>(t_n) / static_cast<double>(r.total_tokens)
                             : 0.0;
    st.objective +=
        share * loss_weight * (c.aux_loss * r.aux + c.z_loss * r.z + c.seq_aux_loss * seq_aux);
    if (!training) return;
    for (int e = 0; e < c.experts; ++e) stats.routed[e] += static_cast<double>(r.routed[e]);
    stats.slots += static_cast<double>(t_n * c.top_k);
    stats.dropped += static_cast<double>(r.dropped);
    stats.aux += r.aux * t_n;
    stats.z += r.z * t_n;
    stats.entropy += r.entropy * t_n;
    stats.tokens += static_cast<double>(t_n);
  }

  /// Takes a pending routing summary (see route_pending): the host's routing, the local row
  /// counts and what the forward left to account.  Nothing when none is pending.
  void settle() {
    if (!route_pending) return;
    route_pending = false;
    routeDeviceFinish();
    seq_load.clear();
    local_rows = routing.kept;
    if (pending) account(*pending, pending_training, pending_weight, tokens, 0.0);
    pending = nullptr;
  }

  /// The experts' forward of a dropless device routing on one rank straight from the routing's
  /// device counts (model::expertsForwardOnDevice), so the host does not wait for them: true
  /// when it ran (the summary is then settled later), false when the counts must come first.
  bool runExpertsOnDevice(OpContext& ctx, std::int64_t n) {
#if PLM_HAVE_CUDA
    const std::int64_t fe = c.expert_ffn, fp = c.swiglu() ? 2 * fe : fe;
    pre = growAs(pre_s, n * fp, cdt, "plm::model::moe::pre");
    act = growAs(act_s, n * fe, cdt, "plm::model::moe::act");
    const DeviceExpertRows d{route_bufs.counts + c.experts, route_bufs.counts + 2 * c.experts, n};
    if (!expertsForwardOnDevice(ctx, blocks(std::vector<std::int64_t>(local_experts, 0), false), d,
                                rowsAs(xperm, cdt, 0, n, hidden), rowsAs(pre, cdt, 0, n, fp),
                                rowsAs(act, cdt, 0, n, fe), rowsAs(y, cdt, 0, n, hidden),
                                c.expert_gemm, c.expert_activation))
      return false;
    rows = n;
    expert_rows = n;
    self_n = 0;
    exchanged = n;
    xexp = xperm;
    yexp = y;
    return true;
#else
    (void)ctx;
    (void)n;
    return false;
#endif
  }

  /// The first n rows of the permutation (rows grouped by expert, token order within an expert:
  /// stable) gathered from h into xperm; y sized to match.
  void permute(OpContext& ctx, const Mat& h, std::int64_t n) {
    xperm = growAs(xperm_s, n * hidden, cdt, "plm::model::moe::xperm");
    y = growAs(y_s, n * hidden, cdt, "plm::model::moe::y");
    if (n > 0) gatherRows(ctx, h, row_token, rowsAs(xperm, cdt, 0, n, hidden), OpKind::Route);
  }
  bool distributed() const { return ep.comm != nullptr && ep.comm->size() > 1; }
  /// The router the last forward routed with (its backward's), else the stored one.
  View2<T> routeWeights() const {
    return route_w.data() != nullptr ? route_w : w.router.template view<T>();
  }

  /// The router (E, H) as host values.
  std::vector<T> routerToHost(const ExecSpace& space) const {
    std::vector<T> host(static_cast<std::size_t>(c.experts) * hidden);
    Kokkos::deep_copy(space, HostView2<T>(host.data(), c.experts, hidden),
                      w.router.template view<T>());
    space.fence();
    return host;
  }

  /// Adds the column sums of this pass's router input, which batchProjectedRouter has just
  /// taken (batch_sum_s, H), to step_sum_s, in the master type (fp32 under bf16).
  void addStepInputSum(OpContext& ctx, std::int64_t cols) {
    const auto& space = ctx.space();
    if (step_sum_s.extent(0) != static_cast<std::size_t>(cols)) {
      step_sum_s = View1<T>("plm::model::moe::step_input_sum", cols);
      step_sum_live = false;
    }
    const View1<T> sum = step_sum_s, batch(batch_sum_s.data(), cols);
    const bool live = step_sum_live;
    Kokkos::parallel_for(
        "plm::model::moe::step_input_sum", FlatPolicy(space, 0, cols),
        KOKKOS_LAMBDA(const std::int64_t i) { sum(i) = (live ? sum(i) : T(0)) + batch(i); });
    step_sum_live = true;
  }

  /// moe.router_projection, a training pass: the router with every row made orthogonal to this
  /// micro-batch's mean router input m (W - (W m) m^T / |m|^2, on the device), so that the
  /// logits ignore the part all tokens share even when the last updates moved it away from the
  /// stored router's null direction (the stored router is projected after the step).
  View2<T> batchProjectedRouter(OpContext& ctx, const View2<T>& x) {
    const auto& space = ctx.space();
    const std::int64_t rows = x.extent(0), cols = x.extent(1);
    if (ones_s.extent(0) < static_cast<std::size_t>(rows)) {
      ones_s =
          View1<T>(Kokkos::view_alloc(Kokkos::WithoutInitializing, "plm::model::moe::ones"), rows);
      Kokkos::deep_copy(space, ones_s, T(1));
    }
    View1<T> m = grow(batch_sum_s, cols, "plm::model::moe::batch_input_sum");
    gemm(space, Trans::T, Trans::N, T(1), x, View2<T>(ones_s.data(), rows, 1), T(0),
         View2<T>(m.data(), cols, 1));
    return projectedOn(ctx, m);
  }

  /// The router projected off the mean of this micro-batch's inputs, m their column sum (H,
  /// batch_sum_s): W - (W m) m^T / |m|^2, and W m / |m|^2 with |m|^2 kept for the backward.
  View2<T> projectedOn(OpContext& ctx, const View1<T>& m) {
    const auto& space = ctx.space();
    const std::int64_t cols = m.extent(0), e_n = c.experts;
    View1<T> wb = grow(batch_w_s, e_n * cols, "plm::model::moe::batch_router");
    View1<double> wm = grow(batch_wu_s, e_n + 1, "plm::model::moe::batch_router_times_mean");
    const View2<T> w = this->w.router.template view<T>();
    // One team per expert, its threads over the width (a serial loop per expert left all but
    // e_n threads of the device idle: 40 us a layer, measured on an H200).
    using Team = Kokkos::TeamPolicy<ExecSpace>;
    Kokkos::parallel_for(
        "plm::model::moe::batch_router_dot_mean", Team(space, e_n, Kokkos::AUTO),
        KOKKOS_LAMBDA(const Team::member_type& team) {
          const std::int64_t e = team.league_rank();
          double n2 = 0, d = 0;
          Kokkos::parallel_reduce(
              Kokkos::TeamThreadRange(team, cols),
              [&](const std::int64_t i, double& acc) {
                const double mi = static_cast<double>(m(i));
                acc += mi * mi;
              },
              n2);
          Kokkos::parallel_reduce(
              Kokkos::TeamThreadRange(team, cols),
              [&](const std::int64_t i, double& acc) {
                acc += static_cast<double>(w(e, i)) * static_cast<double>(m(i));
              },
              d);
          Kokkos::single(Kokkos::PerTeam(team), [&] {
            wm(e) = n2 > 0 ? d / n2 : 0.0;
            if (e == 0) wm(e_n) = n2;
          });
        });
    Kokkos::parallel_for(
        "plm::model::moe::batch_router_project",
        Kokkos::RangePolicy<ExecSpace>(space, 0, e_n * cols), KOKKOS_LAMBDA(const std::int64_t ei) {
          const std::int64_t e = ei / cols, i = ei % cols;
          wb(ei) = static_cast<T>(static_cast<double>(w(e, i)) - wm(e) * static_cast<double>(m(i)));
        });
    return View2<T>(wb.data(), e_n, cols);
  }

  /// The backward of batchProjectedRouter's logits L = X W'^T, W' = W P, P = I - s s^T / |s|^2,
  /// with s the column sum of X (T, H) over the micro-batch, through P's dependence on X as well
  /// (doc/model.md "Router initialisation").  Given G = dL (T, E): writing L = X W^T -
  /// (X u)(W u)^T with u = s / |s|, the loss's gradient along u is
  /// -(X^T G W u + W^T G^T X u), and ds/dx_t = I with du/ds = P / |s| gives every token the same
  /// extra input gradient v = -P (X^T G (W s) / |s|^2 + W^T G^T (X s) / |s|^2), added to
  /// `dx` (T, H); and dW = G^T X P, so (G^T X s)(s^T) / |s|^2 is taken off dW (the caller added
  /// G^T X).  All on the device; sums in the master type, scalars in double.
  ///
  /// With `dx` empty the correction is not applied but returned (H, in the master type), for a
  /// caller that subtracts it where it forms the input gradient (gpu::RouterInputGradient).
  View1<T> projectionBackward(OpContext& ctx, const View2<T>& x, const View2<T>& dl,
                              const View2<T>& dx) {
    const auto& space = ctx.space();
    const std::int64_t t_n = x.extent(0), cols = x.extent(1);
    const View1<T> sum(batch_sum_s.data(), cols);
    View1<T> xs = grow(proj_xs_s, t_n, "plm::model::moe::projection_xs");
    gemm(space, Trans::N, Trans::N, T(1), x, View2<T>(sum.data(), cols, 1), T(0),
         View2<T>(xs.data(), t_n, 1));
    const View1<T> gw = projectionGw(ctx, dl);
    View1<T> xg = grow(proj_xg_s, cols, "plm::model::moe::projection_xg");
    gemm(space, Trans::T, Trans::N, T(1), x, View2<T>(gw.data(), t_n, 1), T(0),
         View2<T>(xg.data(), cols, 1));
    return projectionBackwardFrom(ctx, dl, xs, xg, dx);
  }

  /// G (W s) / |s|^2 per token (T, proj_gw_s) for G = dl.
  View1<T> projectionGw(OpContext& ctx, const View2<T>& dl) {
    const std::int64_t t_n = dl.extent(0), e_n = c.experts;
    const View1<double> wm(batch_wu_s.data(), e_n + 1);
    View1<T> gw = grow(proj_gw_s, t_n, "plm::model::moe::projection_gw");
    Kokkos::parallel_for(
        "plm::model::moe::projection_g_wm", FlatPolicy(ctx.space(), 0, t_n),
        KOKKOS_LAMBDA(const std::int64_t t) {
          double acc = 0;
          for (std::int64_t e = 0; e < e_n; ++e) acc += static_cast<double>(dl(t, e)) * wm(e);
          gw(t) = static_cast<T>(acc);
        });
    return gw;
  }

  /// projectionBackward from X s (xs, T) and X^T (G W s / |s|^2) (xg, H) already formed.
  View1<T> projectionBackwardFrom(OpContext& ctx, const View2<T>& dl, const View1<T>& xs,
                                  const View1<T>& xg, const View2<T>& dx) {
    const auto& space = ctx.space();
    const std::int64_t t_n = dl.extent(0), cols = xg.extent(0), e_n = c.experts;
    const View1<T> sum(batch_sum_s.data(), cols);
    const View1<double> wm(batch_wu_s.data(), e_n + 1);  // W s / |s|^2, then |s|^2
    View1<T> gx = grow(proj_gx_s, e_n, "plm::model::moe::projection_gx");
    View1<double> v = grow(proj_v_s, cols, "plm::model::moe::projection_v");
    View1<double> dot = grow(proj_dot_s, 1, "plm::model::moe::projection_dot");
    gemm(space, Trans::T, Trans::N, T(1), dl, View2<T>(xs.data(), t_n, 1), T(0),
         View2<T>(gx.data(), e_n, 1));
    const View2<T> w = this->w.router.template view<T>();
    Kokkos::parallel_for(
        "plm::model::moe::projection_y", FlatPolicy(space, 0, cols),
        KOKKOS_LAMBDA(const std::int64_t i) {
          const double n2 = wm(e_n);
          double acc = 0;
          for (std::int64_t e = 0; e < e_n; ++e)
            acc += static_cast<double>(w(e, i)) * static_cast<double>(gx(e));
          v(i) = n2 > 0 ? static_cast<double>(xg(i)) + acc / n2 : 0.0;
        });
    Kokkos::parallel_reduce(
        "plm::model::moe::projection_dot", FlatPolicy(space, 0, cols),
        KOKKOS_LAMBDA(const std::int64_t i, double& acc) {
          acc += static_cast<double>(sum(i)) * v(i);
        },
        Kokkos::View<double, MemSpace>(dot.data()));
    // v becomes the correction every token's input gradient loses (H), then one team per token
    // subtracts it (this backward's kernels took 0.2 ms a layer at 16,384 tokens on an H200
    // with the correction formed per element, behind a 64-bit index division).
    Kokkos::parallel_for(
        "plm::model::moe::projection_p", FlatPolicy(space, 0, cols),
        KOKKOS_LAMBDA(const std::int64_t i) {
          const double n2 = wm(e_n);
          v(i) = n2 > 0 ? v(i) - static_cast<double>(sum(i)) * dot(0) / n2 : 0.0;
        });
    View1<T> vf;
    if (dx.data() != nullptr) {
      using Team = Kokkos::TeamPolicy<ExecSpace>;
      Kokkos::parallel_for(
          "plm::model::moe::projection_dx", Team(space, t_n, Kokkos::AUTO),
          KOKKOS_LAMBDA(const Team::member_type& team) {
            const std::int64_t t = team.league_rank();
            Kokkos::parallel_for(Kokkos::TeamThreadRange(team, cols), [&](const std::int64_t i) {
              dx(t, i) = static_cast<T>(static_cast<double>(dx(t, i)) - v(i));
            });
          });
    } else {
      vf = grow(proj_vf_s, cols, "plm::model::moe::projection_v_master");
      const View1<T> out = vf;
      Kokkos::parallel_for(
          "plm::model::moe::projection_v_master", FlatPolicy(space, 0, cols),
          KOKKOS_LAMBDA(const std::int64_t i) { out(i) = static_cast<T>(v(i)); });
    }
    const View2<T> dw = g.router.template view<T>();
    Kokkos::parallel_for(
        "plm::model::moe::projection_dw", FlatPolicy(space, 0, e_n * cols),
        KOKKOS_LAMBDA(const std::int64_t ei) {
          const std::int64_t e = ei / cols, i = ei % cols;
          const double n2 = wm(e_n);
          if (n2 > 0)
            dw(e, i) =
                static_cast<T>(static_cast<double>(dw(e, i)) -
                               static_cast<double>(gx(e)) * static_cast<double>(sum(i)) / n2);
        });
    return vf;
  }

  /// A MoeStep::centring pass: adds the router input x (T, H) to input_sums and returns the
  /// router centred on x's own mean, with which this pass routes (MoeMlp::takeRouterInputSums).
  View2<T> centringRouter(OpContext& ctx, const View2<T>& x) {
    const auto& space = ctx.space();
    const std::int64_t rows = x.extent(0), cols = x.extent(1);
    View1<double> sum = grow(input_sum_s, cols, "plm::model::moe::input_sum");
    Kokkos::parallel_for(
        "plm::model::moe::input_sum", FlatPolicy(space, 0, cols),
        KOKKOS_LAMBDA(const std::int64_t i) {
          double acc = 0;
          for (std::int64_t t = 0; t < rows; ++t) acc += static_cast<double>(x(t, i));
          sum(i) = acc;
        });
    double power = 0;
    Kokkos::parallel_reduce(
        "plm::model::moe::input_power", FlatPolicy(space, 0, rows * cols),
        KOKKOS_LAMBDA(const std::int64_t i, double& acc) {
          const double v = static_cast<double>(x(i / cols, i % cols));
          acc += v * v;
        },
        power);
    std::vector<double> mean(cols);
    Kokkos::deep_copy(space, HostView1<double>(mean.data(), cols), sum);
    space.fence();
    RouterInputSums& in = input_sums;
    if (in.sum.empty()) in.sum.assign(cols, 0.0);
    for (std::int64_t i = 0; i < cols; ++i) in.sum[i] += mean[i];
    in.tokens += static_cast<double>(rows);
    in.power += power;
    std::vector<T> router = routerToHost(space);
    centreRows(router, c.experts, mean);  // the direction of this pass's sum is its mean's
    View1<T> centred = toDevice(centred_s, router, "plm::model::moe::centred_router");
    space.fence();
    return View2<T>(centred.data(), c.experts, hidden);
  }

  /// Sums `v` over the context group (host values; through a device buffer for NCCL).
  static void sumOverGroup(OpContext& ctx, dist::Communicator& comm, std::vector<double>& v) {
    const auto n = static_cast<std::int64_t>(v.size());
    if (!comm.deviceMemory()) {
      comm.allReduceSum(v.data(), n).wait({});
      return;
    }
    View1<double> d(Kokkos::view_alloc(Kokkos::WithoutInitializing, "plm::model::moe::context_sum"),
                    v.size());
    const Kokkos::View<double*, HostSpace> h(v.data(), v.size());
    Kokkos::deep_copy(ctx.space(), d, h);
    const auto stream = dist::streamOf(ctx.space());
    comm.allReduceSum(d.data(), n, stream).wait(stream);
    Kokkos::deep_copy(ctx.space(), h, d);
    ctx.space().fence();
  }

  /// A context shard's routing made the whole micro-batch's (moe.hpp, "Context parallelism"):
  /// one sum over the group of [routed (E) | probability sums (E) | lse^2 sum | tokens |
  /// per-sequence loads (seq aux loss) | routed per piece of the micro-batch (capacity cut)],
  /// then the totals and losses of `r`, `seq_load`, and the capacity and the starts of this
  /// shard's cut (host routing only).
  void reduceOverContext(OpContext& ctx, Routing& r, std::int64_t* capacity,
                         std::vector<CutStart>* starts) {
    const MoeContext& cp = *step->context;
    const int e_n = c.experts, k = c.top_k;
    const std::int64_t t_n = r.tokens;
    std::vector<double> v(2 * static_cast<std::size_t>(e_n) + 2, 0.0);
    for (int e = 0; e < e_n; ++e) v[e] = static_cast<double>(r.routed[e]);
    if (routed_on_device) {
      for (int e = 0; e < e_n; ++e) v[e_n + e] = device_prob_sum[e];
      v[2 * e_n] = device_lse2_sum;
    } else {
      for (std::int64_t t = 0; t < t_n; ++t) {
        for (int e = 0; e < e_n; ++e) v[e_n + e] += r.prob[static_cast<std::size_t>(t) * e_n + e];
        v[2 * e_n] += r.lse[t] * r.lse[t];
      }
    }
    v[2 * e_n + 1] = static_cast<double>(t_n);
    const std::size_t seq_at = v.size();
    const bool seq = c.seq_aux_loss > 0 && step->cu_seqlens && !step->cu_seqlens->empty();
    if (seq) {
      const auto load =
          sequenceLoad(r, step->cu_seqlens->data(), static_cast<int>(step->cu_seqlens->size()) - 1);
      v.insert(v.end(), load.begin(), load.end());
    }
    const std::size_t cut_at = v.size();
    if (starts && c.capacity_factor > 0) {
      v.resize(cut_at + static_cast<std::size_t>(cp.segments) * e_n, 0.0);
      for (const auto& run : cp.runs)
        for (std::int64_t t = run.begin; t < run.end; ++t)
          for (int j = 0; j < k; ++j)
            v[cut_at + static_cast<std::size_t>(run.segment) * e_n +
              r.expert[static_cast<std::size_t>(t) * k + j]] += 1.0;
    }
    sumOverGroup(ctx, *cp.comm, v);
    r.total_tokens = static_cast<std::int64_t>(v[2 * e_n + 1]);
    for (int e = 0; e < e_n; ++e) r.total_routed[e] = static_cast<std::int64_t>(v[e]);
    const double total = static_cast<double>(r.total_tokens);
    r.aux = r.z = 0;
    if (r.total_tokens > 0) {
      for (int e = 0; e < e_n; ++e) r.aux += e_n * (v[e] / (total * k)) * (v[e_n + e] / total);
      r.z = v[2 * e_n] / total;
    }
    seq_load.assign(v.begin() + seq_at, v.begin() + cut_at);
    if (!starts) return;
    *capacity = expertCapacity(c, r.total_tokens);
    starts->clear();
    if (*capacity == 0) return;
    std::vector<std::int64_t> before(e_n, 0);  // slots of the pieces before segment `at`
    int at = 0;
    for (const auto& run : cp.runs) {  // runs follow the micro-batch's order within a shard
      for (; at < run.segment; ++at)
        for (int e = 0; e < e_n; ++e)
          before[e] +=
              static_cast<std::int64_t>(v[cut_at + static_cast<std::size_t>(at) * e_n + e]);
      starts->push_back(CutStart{run.begin, before});
    }
  }

  /// Whether the router reads the bf16 h directly on the GPU (gpu::routerLogits / routerOuter):
  /// the bf16 CUDA path, a contiguous 16-byte aligned h, a router that fits a block's shared
  /// memory, and not a centring pass (which routes with its own centred router).
  bool fastRouter(const Mat& h) const {
#if PLM_HAVE_CUDA
    if constexpr (std::is_same_v<T, float>)
      return bf16() && h.dtype == DType::BF16 && h.ld == h.cols &&
             reinterpret_cast<std::uintptr_t>(h.data) % 16 == 0 &&
             gpu::routerFitsShared(static_cast<int>(h.cols), c.experts) &&
             !(step && step->centring);
#endif
    (void)h;
    return false;
  }

#if PLM_HAVE_CUDA
  /// The column sum of the bf16 h (H, fp32, into batch_sum_s): gpu::expertBiasGradient's fixed
  /// order over one block of rows.
  View1<T> inputColumnSum(OpContext& ctx, const Mat& h) {
    const std::int64_t cols = h.cols;
    View1<T> m = grow(batch_sum_s, cols, "plm::model::moe::batch_input_sum");
    const std::size_t bytes = gpu::expertBiasGradientWorkspaceBytes(1, static_cast<int>(cols));
    View1<T> ws = grow(colsum_ws_s, static_cast<std::int64_t>((bytes + sizeof(T) - 1) / sizeof(T)),
                       "plm::model::moe::column_sum_workspace");
    if constexpr (std::is_same_v<T, float>) {
      PLM_CHECK_CUDA(cudaMemsetAsync(m.data(), 0, cols * sizeof(T), ctx.space().cuda_stream()));
      gpu::expertBiasGradient(ctx.space().cuda_stream(), std::vector<float*>{m.data()},
                              std::vector<std::int64_t>{h.rows}, bf16Data(h),
                              static_cast<int>(cols), ws.data(), bytes);
    }
    return m;
  }
#endif

  /// The router's input in the master type: h itself, or its widened copy when h is bf16.  The
  /// forward always widens; the backward (`again`) reuses the forward's copy when h is the
  /// forward's input (the saved LN2 output, as the rest of this state presumes), which saves
  /// one read of h and one write of its fp32 copy per backward.
  View2<T> routerInput(OpContext& ctx, const Mat& h, bool again = false) {
    if (h.dtype == dtypeOf<T>()) return h.template view<T>();
    const bool same = again && hf_of == h.data && hf_rows == h.rows && hf_cols == h.cols;
    View1<T> hf = same ? hf_s : grow(hf_s, h.rows * h.cols, "plm::model::moe::router_input");
    const Mat dst = rowsOf(hf, 0, h.rows, h.cols);
    if (!same) {
      copyToMaster(ctx, h, dst);
      hf_of = h.data;
      hf_rows = h.rows;
      hf_cols = h.cols;
    }
    return dst.template view<T>();
  }
  std::int64_t sharedWidth() const {
    return static_cast<std::int64_t>(c.shared_experts) * c.expert_ffn;
  }

  /// Starts sending rows (H wide; `send_counts[q]` rows at row `send_at[q]` of `send` go to
  /// rank q) and receiving theirs (`recv_counts[q]` rows at row `recv_at[q]` of `recv`).  MPI
  /// moves host memory after a fence, NCCL and staged MPI order on the stream: NCCL runs on the
  /// communicator's own stream, so the compute stream is free until finishExchange.  Rows are
  /// in the compute precision: bf16 rows move as bf16 (half fp32's bytes).  Both buffers stay
  /// untouched (send: unwritten, recv: unread) until finishExchange.
  dist::Work startExchange(OpContext& ctx, const View1<T>& send,
                           const std::vector<std::int64_t>& send_counts,
                           const std::vector<std::int64_t>& send_at, const View1<T>& recv,
                           const std::vector<std::int64_t>& recv_counts,
                           const std::vector<std::int64_t>& recv_at) const {
    PLM_TRACE("plm::moe all-to-all start");
    const int n = ep.comm->size();
    const dist::DataType type = bf16() ? dist::DataType::BFloat16 : dist::DataTypeOf<T>::value;
    std::vector<std::int64_t> sc(n), so(n), rc(n), ro(n);
    for (int q = 0; q < n; ++q) {
      sc[q] = send_counts[q] * hidden;
      rc[q] = recv_counts[q] * hidden;
      so[q] = send_at[q] * hidden;
      ro[q] = recv_at[q] * hidden;
    }
    ctx.mark(OpKind::Other);  // profiling: what came before is not the exchange
    if (!ep.comm->deviceMemory()) ctx.space().fence();
    return ep.comm->allToAllV(send.data(), sc, so, recv.data(), rc, ro, type,
                              dist::streamOf(ctx.space()));
  }

  /// Waits for an exchange; profiling counts the compute stream's exposed wait as Dispatch.
  void finishExchange(OpContext& ctx, dist::Work& work) const {
    PLM_TRACE("plm::moe all-to-all wait");
    const auto stream = dist::streamOf(ctx.space());
    ctx.mark(OpKind::Other);
    work.wait(stream);
    ctx.mark(OpKind::Dispatch);
  }

  /// Whether this rank's experts carry FP8 slots.  Those take no split: an FP8 GEMM's forward
  /// keeps one quantised copy of its input per weight for the backward (ops.cpp), so a second
  /// call on the same expert (self rows, then received rows) would overwrite the first's.
  /// Every rank agrees (the slots follow the deck), so the collectives still match.
  bool fp8Experts() const {
    for (int i = 0; i < local_experts; ++i) {
      const auto& e = w.experts[first_expert + i];
      if (e.w1.fp8 || e.w2.fp8) return true;
    }
    return false;
  }

  /// Bytes of the expert-side buffers per received row: recv, xexp, yexp, dyexp, dxexp (H each)
  /// and pre, act, dpre (F_e each; SwiGLU: pre and dpre 2 F_e, and dact F_e), in the compute
  /// precision.
  std::int64_t expertRowBytes() const {
    const std::int64_t f = c.swiglu() ? 6 * std::int64_t(c.expert_ffn) : 3 * c.expert_ffn;
    return static_cast<std::int64_t>(sizeOf(cdt)) * (5 * std::int64_t(hidden) + f);
  }

  /// What this rank's expert-side buffers of this layer may take: moe.dispatch_budget_gib, or
  /// what they hold now plus 90% of the memory free in their space.
  std::int64_t dispatchLimit() const {
    if (c.dispatch_budget_bytes > 0) return static_cast<std::int64_t>(c.dispatch_budget_bytes);
    std::int64_t held = 0;
    for (const View1<T>* v :
         {&recv_s, &xexp_s, &yexp_s, &pre_s, &act_s, &dpre_s, &dyexp_s, &dxexp_s, &dact_s})
      held += static_cast<std::int64_t>(v->extent(0) * sizeof(T));
    const std::int64_t free_bytes = freeBytes();
    if (free_bytes <= 0) return std::numeric_limits<std::int64_t>::max();  // unknown: no check
    return held + static_cast<std::int64_t>(0.9 * static_cast<double>(free_bytes));
  }

  /// Every rank's kept counts per expert and limit are known to all (State::plan), so every rank
  /// of the group reaches the same verdict: a rank whose received rows do not fit its limit ends
  /// the job on all of them at once, with one line, instead of running out of memory alone.
  void checkDispatchBudget(const std::vector<std::int64_t>& all, std::int64_t width) const {
    const int n = ep.comm->size();
    const std::int64_t row_bytes = expertRowBytes();
    int worst = -1;
    double worst_ratio = 1.0;
    std::int64_t total = 0;
    std::vector<std::int64_t> received(n, 0);
    for (int r = 0; r < n; ++r) {
      for (int q = 0; q < n; ++q)
        for (int i = 0; i < local_experts; ++i)
          received[r] += all[static_cast<std::size_t>(q * width + r * local_experts + i)];
      total += received[r];
      const double limit = static_cast<double>(all[static_cast<std::size_t>(limitAt(r, width))]);
      const double ratio = static_cast<double>(received[r] * row_bytes) / std::max(limit, 1.0);
      if (ratio > worst_ratio) {
        worst = r;
        worst_ratio = ratio;
      }
    }
    if (worst < 0) return;
    const double gib = 1024.0 * 1024.0 * 1024.0;
    const double balanced = static_cast<double>(total) / n;
    char number[64];
    std::snprintf(number, sizeof number, "%.3g GiB",
                  static_cast<double>(all[static_cast<std::size_t>(limitAt(worst, width))]) / gib);
    const std::string limit = c.dispatch_budget_bytes > 0
                                  ? "moe.dispatch_budget_gib = " + std::string(number)
                                  : "the " + std::string(number) +
                                        " it may take (90% of its free memory with what the "
                                        "layer holds; moe.dispatch_budget_gib: 0)";
    char text[1024];
    std::snprintf(
        text, sizeof text,
        "moe: layer %d: expert rank %d of %d would receive %lld token rows for its %d expert(s), "
        "%.1fx the balanced %.0f; its dispatch buffers would need %.3g GiB against %s. "
        "Bound or spread the load: moe.dropless: false with moe.capacity_factor (e.g. 1.25), a "
        "larger parallel.expert_degree, a smaller data.micro_batch_tokens, or a larger "
        "moe.dispatch_budget_gib if the memory is there",
        layer, worst, n, static_cast<long long>(received[worst]), local_experts,
        balanced > 0 ? static_cast<double>(received[worst]) / balanced : 0.0, balanced,
        static_cast<double>(received[worst] * row_bytes) / gib, limit.c_str());
    if (n == dist::worldSize()) throw collectiveError(text);
    // A group smaller than the job: its first rank speaks, the others leave quietly.
    throw Error(text).quiet(ep.comm->rank() != 0);
  }
  static std::int64_t limitAt(int r, std::int64_t width) { return r * width + width - 1; }

  /// Counts first: every rank learns every rank's rows per expert (an all-gather of the kept
  /// counts and each rank's dispatch limit), so each knows what it receives and the budget check
  /// is the same on all; then the maps between the received (source-major) and the expert-major
  /// row order.  With `kept_on_device` (the device routing's kept counts, E, NCCL) this rank's
  /// counts go from there into the exchange without the host seeing them first, and the one
  /// wait on the stream that ends the exchange also lands routeDeviceStart's summary: the layer
  /// synchronises with the host once.  The count buffers are kept (no allocation per layer).
  void plan(OpContext& ctx, const std::int64_t* kept_on_device = nullptr) {
    const int n = ep.comm->size();
    const std::int64_t width = c.experts + 1;  // kept counts per expert, then the dispatch limit
    std::vector<std::int64_t> mine(static_cast<std::size_t>(width), 0);
    if (!kept_on_device) std::copy(routing.kept.begin(), routing.kept.end(), mine.begin());
    mine.back() = dispatchLimit();
    std::vector<std::int64_t> all(static_cast<std::size_t>(n * width));
    const auto& space = ctx.space();
    if (ep.comm->deviceMemory()) {  // NCCL moves device buffers only
      View1<std::int64_t> d_send = grow(counts_send_s, width, "plm::model::moe::counts");
      View1<std::int64_t> d_recv =
          grow(counts_recv_s, static_cast<std::int64_t>(all.size()), "plm::model::moe::counts");
      Kokkos::deep_copy(space, d_send,
                        Kokkos::View<const std::int64_t*, HostSpace>(mine.data(), mine.size()));
#if PLM_HAVE_CUDA
      if (kept_on_device)
        PLM_CHECK_CUDA(cudaMemcpyAsync(d_send.data(), kept_on_device,
                                       c.experts * sizeof(std::int64_t), cudaMemcpyDeviceToDevice,
                                       space.cuda_stream()));
#endif
      const auto stream = dist::streamOf(space);
      ep.comm->allGather(d_send.data(), d_recv.data(), width, stream).wait(stream);
      Kokkos::deep_copy(space, Kokkos::View<std::int64_t*, HostSpace>(all.data(), all.size()),
                        d_recv);
      space.fence();
    } else {
      if (kept_on_device)
        throw Error("plm::model::MoeMlp: device counts need a device-memory expert group (a bug)");
      ep.comm->allGather(mine.data(), all.data(), width, dist::Stream{}).wait({});
    }
    checkDispatchBudget(all, width);
    const int me = ep.comm->rank();
    const std::vector<std::int64_t> counts(all.begin() + me * width,
                                           all.begin() + me * width + c.experts);
    std::vector<std::int64_t> got(static_cast<std::size_t>(n) * local_experts);
    for (int q = 0; q < n; ++q)
      for (int i = 0; i < local_experts; ++i)
        got[static_cast<std::size_t>(q) * local_experts + i] =
            all[static_cast<std::size_t>(q * width + ep.comm->rank() * local_experts + i)];
    const bool split = c.overlap && !fp8Experts();
    send_rows.assign(n, 0);
    recv_rows.assign(n, 0);
    local_rows.assign(local_experts, 0);
    self_rows.assign(local_experts, 0);
    for (int q = 0; q < n; ++q)
      for (int i = 0; i < local_experts; ++i) {
        send_rows[q] += counts[static_cast<std::size_t>(q) * local_experts + i];
        recv_rows[q] += got[static_cast<std::size_t>(q) * local_experts + i];
        local_rows[i] += got[static_cast<std::size_t>(q) * local_experts + i];
      }
    expert_rows = std::accumulate(recv_rows.begin(), recv_rows.end(), std::int64_t(0));
    local_at.assign(n, 0);
    for (int q = 1; q < n; ++q) local_at[q] = local_at[q - 1] + send_rows[q - 1];
    self_at = local_at[me];
    self_n = 0;
    if (split) {  // the self block stays: zero counts to and from self
      self_n = send_rows[me];
      for (int i = 0; i < local_experts; ++i)
        self_rows[i] = got[static_cast<std::size_t>(me) * local_experts + i];
      send_rows[me] = recv_rows[me] = 0;
    }
    exchanged = expert_rows - self_n;
    exchanged_rows.assign(local_experts, 0);
    for (int i = 0; i < local_experts; ++i) exchanged_rows[i] = local_rows[i] - self_rows[i];
    recv_at.assign(n, 0);
    for (int q = 1; q < n; ++q) recv_at[q] = recv_at[q - 1] + recv_rows[q - 1];
    // Exchanged rows expert-major with source order inside an expert (a deterministic layout).
    std::vector<std::int32_t> to_e(exchanged), to_s(exchanged);
    std::vector<std::int64_t> src_at(recv_at), exp_at(local_experts, 0);
    for (int i = 1; i < local_experts; ++i) exp_at[i] = exp_at[i - 1] + exchanged_rows[i - 1];
    for (int q = 0; q < n; ++q) {
      if (split && q == me) continue;
      for (int i = 0; i < local_experts; ++i)
        for (std::int64_t m = 0; m < got[static_cast<std::size_t>(q) * local_experts + i]; ++m) {
          const std::int64_t src = src_at[q]++, dst = exp_at[i]++;
          to_e[dst] = static_cast<std::int32_t>(src);
          to_s[src] = static_cast<std::int32_t>(dst);
        }
    }
    to_expert = toDevice(space, to_expert_s, to_e, "plm::model::moe::to_expert");
    to_source = toDevice(space, to_source_s, to_s, "plm::model::moe::to_source");
  }

  /// The experts of this rank with `rows[i]` rows each (and their gradients when asked).
  std::vector<ExpertRows> blocks(const std::vector<std::int64_t>& rows, bool grads) const {
    std::vector<ExpertRows> b(local_experts);
    for (int i = 0; i < local_experts; ++i)
      b[i] = {&w.experts[first_expert + i], grads ? &g.experts[first_expert + i] : nullptr,
              rows[i]};
    return b;
  }

  /// Starts moving the exchanged rows (local permuted order) to the experts' ranks.
  dist::Work startToExperts(OpContext& ctx, const View1<T>& local) {
    PLM_TRACE("plm::moe dispatch");
    View1<T> recv = growAs(recv_s, exchanged * hidden, cdt, "plm::model::moe::recv");
    return startExchange(ctx, local, send_rows, local_at, recv, recv_rows, recv_at);
  }

  /// Waits for them and lays them out expert-major in `at_experts` (exchanged rows).
  void finishToExperts(OpContext& ctx, dist::Work& work, const View1<T>& at_experts) {
    finishExchange(ctx, work);
    if (exchanged > 0)
      gatherRows(ctx, rowsAs(recv_s, cdt, 0, exchanged, hidden), to_expert,
                 rowsAs(at_experts, cdt, 0, exchanged, hidden));
  }

  /// The exchanged rows' results (expert-major) back to the ranks that routed them (their
  /// local order); the self block of `local` is left as it is.
  void fromExperts(OpContext& ctx, const View1<T>& at_experts, const View1<T>& local) {
    PLM_TRACE("plm::moe combine");
    View1<T> send = growAs(recv_s, exchanged * hidden, cdt, "plm::model::moe::recv");
    if (exchanged > 0)
      gatherRows(ctx, rowsAs(at_experts, cdt, 0, exchanged, hidden), to_source,
                 rowsAs(send, cdt, 0, exchanged, hidden));
    dist::Work work = startExchange(ctx, send, recv_rows, recv_at, local, send_rows, local_at);
    finishExchange(ctx, work);
  }
};

template <class T>
MoeMlp<T>::MoeMlp(int layer, const MoeConfig& config, int hidden, const MoeWeights& weights,
                  const MoeWeights& grads, MoeStep* step)
    : state_member(new State()) {
  auto& s = *state_member;
  s.layer = layer;
  s.c = config;
  s.hidden = hidden;
  s.w = weights;
  s.g = grads;
  s.step = step;
  s.stats.layer = layer;
  s.stats.routed.assign(config.experts, 0.0);
  s.local_experts = config.experts;
  if (static_cast<int>(weights.experts.size()) != config.experts)
    throw Error("plm::model::MoeMlp: expert tensors do not match moe.experts (a bug)");
  if (weights.router.dtype != dtypeOf<T>())
    throw Error("plm::model::MoeMlp: the router must be in the master type (a bug)");
  // The compute type of the experts this rank holds (the first one's; all share it).
  const auto held = std::find_if(weights.experts.begin(), weights.experts.end(),
                                 [](const DenseMlpWeights& e) { return e.w1.rows > 0; });
  s.cdt = held != weights.experts.end() ? held->w1.dtype : dtypeOf<T>();
  if (s.bf16()) {
#if PLM_HAVE_CUDA
    if (!std::is_same_v<T, float>)
      throw Error("plm::model::MoeMlp: bf16 experts need fp32 masters (a bug)");
    if (hidden % 8 != 0 || config.expert_ffn % 8 != 0)
      throw collectiveError("train.precision: bf16 with moe needs model.hidden (" +
                            std::to_string(hidden) + ") and moe.expert_ffn (" +
                            std::to_string(config.expert_ffn) +
                            ") to be multiples of 8 (cuBLASLt alignment of each expert's rows)");
#else
    throw collectiveError("train.precision: bf16 runs on the CUDA build only");
#endif
  }
}

template <class T> MoeMlp<T>::~MoeMlp() = default;

template <class T> void MoeMlp<T>::setExpertParallel(const ExpertParallel& ep) {
  auto& s = *state_member;
  const int n = ep.comm ? ep.comm->size() : 1;
  if (s.c.experts % n != 0)
    throw collectiveError("parallel.expert_degree = " + std::to_string(n) +
                          " must divide moe.experts = " + std::to_string(s.c.experts));
  if (n > 1 && !ep.comm->deviceMemory() &&
      !Kokkos::SpaceAccessibility<HostSpace, ExecSpace::memory_space>::accessible)
    throw collectiveError(
        "parallel.expert_degree: the expert all-to-all needs a device-memory backend when the "
        "model lives in GPU memory, NCCL (one GPU per rank) or staged MPI (ranks sharing a "
        "GPU); this group got plain MPI: unset PLM_COMM_BACKEND or set it to auto, nccl or "
        "mpi-staged");
  const int local = s.c.experts / n, first = (ep.comm ? ep.comm->rank() : 0) * local;
  for (int e = 0; e < s.c.experts; ++e)
    if ((e >= first && e < first + local) && s.w.experts[e].w1.rows == 0)
      throw Error("plm::model::MoeMlp: expert " + std::to_string(e) + " of layer " +
                  std::to_string(s.layer) +
                  " is computed on this rank but not held by it (the model's expert placement "
                  "does not match the expert group; a bug)");
  s.ep = ep;
  s.local_experts = local;
  s.first_expert = first;
}

template <class T> void MoeMlp<T>::relocate(const Relocation& r) {
  for (MoeWeights* m : {&state_member->w, &state_member->g}) {
    r(m->router);
    r(m->expert_bias);
    for (auto& e : m->experts) r(e);
    r(m->shared);
  }
}

template <class T> const MoeLayerStats& MoeMlp<T>::stats() const {
  state_member->settle();
  return state_member->stats;
}

template <class T> void MoeMlp<T>::settle() const { state_member->settle(); }

template <class T> void MoeMlp<T>::resetStats() {
  state_member->settle();
  auto& st = state_member->stats;
  const int layer = st.layer;
  const std::size_t e = st.routed.size();
  st = MoeLayerStats();
  st.layer = layer;
  st.routed.assign(e, 0.0);
}

template <class T> void MoeMlp<T>::forward(OpContext& ctx, const Mat& h, const Mat& residual,
                                           const Mat& out, LayerActs& /*saved*/) const {
  auto& s = *state_member;
  const auto& space = ctx.space();
  const auto& c = s.c;
  const std::int64_t t_n = h.rows, hid = s.hidden, e_n = c.experts, k = c.top_k;
  const std::int64_t fe = c.expert_ffn, fp = c.swiglu() ? 2 * fe : fe;  // act, pre widths
  const DType cdt = s.cdt;
  s.tokens = t_n;

  // Router logits in the master type (fp32 under bf16: the bf16 LN2 output is widened first),
  // then the routing on the host.
  s.logits = grow(s.logits_s, t_n * e_n, "plm::model::moe::logits");
  s.router_bf16 = s.fastRouter(h);
  if (t_n > 0) {
    const bool projecting = c.router_projection && s.step && s.step->training && !s.step->centring;
    if (s.router_bf16) {
#if PLM_HAVE_CUDA
      if constexpr (std::is_same_v<T, float>) {
        // From the bf16 h itself: the column sum, the projected router, then the logits and
        // X s (for the projection's backward) in one pass.  An fp32 copy of h left by a
        // centring pass (Esm2::centreRouters routes with the portable kernels) is freed.
        if (s.hf_s.data() != nullptr) {
          s.hf_s = View1<T>();
          s.hf_of = nullptr;
        }
        const View1<T> m = projecting ? s.inputColumnSum(ctx, h) : View1<T>();
        const View2<T> router = projecting ? s.projectedOn(ctx, m) : s.w.router.template view<T>();
        s.route_w = projecting ? router : View2<T>();
        T* xs =
            projecting ? grow(s.proj_xs_s, t_n, "plm::model::moe::projection_xs").data() : nullptr;
        gpu::routerLogits(space.cuda_stream(), bf16Data(h), t_n, static_cast<int>(hid),
                          router.data(), static_cast<int>(e_n), projecting ? m.data() : nullptr,
                          s.logits.data(), xs);
      }
#endif
    } else {
      const View2<T> x = s.routerInput(ctx, h);
      const View2<T> router = s.step && s.step->centring ? s.centringRouter(ctx, x)
                              : projecting               ? s.batchProjectedRouter(ctx, x)
                                                         : s.w.router.template view<T>();
      s.route_w = projecting ? router : View2<T>();  // the stored router may move (relocate)
      gemm(space, Trans::N, Trans::T, T(1), x, router, T(0), View2<T>(s.logits.data(), t_n, e_n));
    }
    if (projecting && !s.step->recomputing) s.addStepInputSum(ctx, hid);
  }
  s.routed_on_device = false;
  s.permuted_rows = -1;
  bool planned = false, experts_done = false;
  if (s.deviceRouting()) {
    // The host waits for the routing's counts once per layer, while the GPU works: a dropless
    // routing keeps all t k slots, so the permutation is queued before the wait; under expert
    // parallelism over NCCL the count exchange is, and its wait is the layer's only one.
    ctx.mark(OpKind::Other);  // the router's input and GEMM
    s.routeDeviceStart(ctx, t_n);
    ctx.mark(OpKind::Route);
    const bool dropless = expertCapacity(c, t_n) == 0;  // routeDeviceStart's capacity
    if (dropless) {
      s.permute(ctx, h, t_n * k);
      s.permuted_rows = t_n * k;
    }
    // On one rank a dropless routing's experts run from its device counts and the host takes
    // the summary later (settle).  The count exchange straight from the device counts
    // (plan(ctx, counts)) is not used: on one GPU with staged ranks it read counts that were
    // not yet there (test_ckpt_moe_expert_parallel np2, 2026-11-29); the exchange runs after
    // the summary, from the host's counts.
    experts_done = dropless && !s.distributed() && !(s.step && s.step->context) &&
                   s.runExpertsOnDevice(ctx, t_n * k);
    if (experts_done) {
      s.route_pending = true;
    } else {
      s.routeDeviceFinish();
      if (!planned) ctx.mark(OpKind::Route);  // the GPU's idle time while the host waited
      s.seq_load.clear();
      if (s.step && s.step->context) s.reduceOverContext(ctx, s.routing, nullptr, nullptr);
    }
  } else {
    std::vector<T> host(t_n * e_n);
    Kokkos::deep_copy(space, Kokkos::View<T*, HostSpace>(host.data(), host.size()), s.logits);
    std::vector<double> bias;
    if (!s.w.expert_bias.empty()) {
      std::vector<T> b(e_n);
      Kokkos::deep_copy(space, Kokkos::View<T*, HostSpace>(b.data(), e_n),
                        s.w.expert_bias.template view<T>());
      space.fence();
      bias.assign(b.begin(), b.end());
    }
    space.fence();
    s.logits_host.assign(host.begin(), host.end());
    const double* b = bias.empty() ? nullptr : bias.data();
    if (s.step && s.step->context) {  // the cut and the losses over the whole micro-batch
      s.routing = selectExperts(s.logits_host.data(), static_cast<int>(t_n), c, b);
      std::int64_t capacity = 0;
      std::vector<CutStart> starts;
      s.reduceOverContext(ctx, s.routing, &capacity, &starts);
      cutCapacity(s.routing, capacity, starts);
    } else {
      s.routing = route(s.logits_host.data(), static_cast<int>(t_n), c, b);
      s.seq_load.clear();
    }
    const Routing& hr = s.routing;
    s.rows = hr.rows();
    std::vector<std::int32_t> slot_row(hr.row.begin(), hr.row.end());
    std::vector<T> slot_gate(hr.gate.begin(), hr.gate.end());
    std::vector<std::int32_t> row_token(hr.row_token.begin(), hr.row_token.end());
    std::vector<T> row_gate(hr.row_gate.begin(), hr.row_gate.end());
    s.slot_row = toDevice(s.slot_row_s, slot_row, "plm::model::moe::slot_row");
    s.slot_gate = toDevice(s.slot_gate_s, slot_gate, "plm::model::moe::slot_gate");
    s.row_token = toDevice(s.row_token_s, row_token, "plm::model::moe::row_token");
    s.row_gate = toDevice(s.row_gate_s, row_gate, "plm::model::moe::row_gate");
  }
  const Routing& r = s.routing;
  const std::int64_t rows = s.rows;

  // Permute: rows grouped by expert, token order within an expert (stable).
  if (s.permuted_rows < 0) s.permute(ctx, h, rows);

  // The experts through their dispatch point (model/moe_experts.hpp: one after another, or on
  // CUDA with bf16 one grouped launch per GEMM), the pre-activation kept for backward.
  if (s.distributed()) {
    // This rank's experts' rows from the group: the self rows computed in place while the
    // other ranks' rows travel, then those (State::self_n; expert side [self | exchanged]).
    if (!planned) {
      ctx.mark(OpKind::Other);
      s.plan(ctx);  // the counts' exchange, with a host synchronisation
      ctx.mark(OpKind::DispatchCounts);
    }
    const std::int64_t sn = s.self_n, xn = s.exchanged;
    s.xexp = growAs(s.xexp_s, xn * hid, cdt, "plm::model::moe::xexp");
    s.yexp = growAs(s.yexp_s, xn * hid, cdt, "plm::model::moe::yexp");
    s.pre = growAs(s.pre_s, s.expert_rows * fp, cdt, "plm::model::moe::pre");
    s.act = growAs(s.act_s, s.expert_rows * fe, cdt, "plm::model::moe::act");
    dist::Work work = s.startToExperts(ctx, s.xperm);
    if (sn > 0)
      expertsForward(ctx, s.blocks(s.self_rows, false), rowsAs(s.xperm, cdt, s.self_at, sn, hid),
                     rowsAs(s.pre, cdt, 0, sn, fp), rowsAs(s.act, cdt, 0, sn, fe),
                     rowsAs(s.y, cdt, s.self_at, sn, hid), c.expert_gemm, c.expert_activation);
    s.finishToExperts(ctx, work, s.xexp);
    if (xn > 0)
      expertsForward(ctx, s.blocks(s.exchanged_rows, false), rowsAs(s.xexp, cdt, 0, xn, hid),
                     rowsAs(s.pre, cdt, sn, xn, fp), rowsAs(s.act, cdt, sn, xn, fe),
                     rowsAs(s.yexp, cdt, 0, xn, hid), c.expert_gemm, c.expert_activation);
    s.fromExperts(ctx, s.yexp, s.y);
  } else if (!experts_done) {
    s.expert_rows = rows;
    s.local_rows = r.kept;
    s.self_n = 0;
    s.exchanged = rows;
    s.xexp = s.xperm;
    s.yexp = s.y;
    s.pre = growAs(s.pre_s, rows * fp, cdt, "plm::model::moe::pre");
    s.act = growAs(s.act_s, rows * fe, cdt, "plm::model::moe::act");
    expertsForward(ctx, s.blocks(s.local_rows, false), rowsAs(s.xexp, cdt, 0, rows, hid),
                   rowsAs(s.pre, cdt, 0, rows, fp), rowsAs(s.act, cdt, 0, rows, fe),
                   rowsAs(s.yexp, cdt, 0, rows, hid), c.expert_gemm, c.expert_activation);
  }

  // Unpermute with the gates, in a fixed slot order per token (deterministic).
  if (s.bf16()) {
#if PLM_HAVE_CUDA
    if constexpr (std::is_same_v<T, float>)
      gpu::moeUnpermute(space.cuda_stream(), reinterpret_cast<const gpu::bf16*>(s.y.data()),
                        s.slot_row.data(), s.slot_gate.data(), residual.template ptr<float>(),
                        out.template ptr<float>(), t_n, static_cast<int>(k), static_cast<int>(hid));
    ctx.mark(OpKind::Route);
#endif
  } else {
    auto in = residual.template view<T>();
    auto dst = out.template view<T>();
    auto y = s.y;
    auto srow = s.slot_row;
    auto sgate = s.slot_gate;
    Kokkos::parallel_for(
        "plm::model::moe::unpermute", FlatPolicy(space, 0, t_n),
        KOKKOS_LAMBDA(const std::int64_t t) {
          for (std::int64_t col = 0; col < hid; ++col) {
            T acc = 0;
            for (std::int64_t j = 0; j < k; ++j) {
              const std::int32_t p = srow(t * k + j);
              if (p >= 0) acc += sgate(t * k + j) * y(p * hid + col);
            }
            dst(t, col) = in(t, col) + acc;
          }
        });
  }
  if (c.shared_experts > 0 && t_n > 0) {
    const std::int64_t sw = s.sharedWidth();
    s.spre = growAs(s.spre_s, t_n * sw, cdt, "plm::model::moe::shared_pre");
    s.sact = growAs(s.sact_s, t_n * sw, cdt, "plm::model::moe::shared_act");
    linearGelu(ctx, h, s.w.shared.w1, s.w.shared.b1, rowsAs(s.spre, cdt, 0, t_n, sw),
               rowsAs(s.sact, cdt, 0, t_n, sw));
    linearResidual(ctx, rowsAs(s.sact, cdt, 0, t_n, sw), s.w.shared.w2, s.w.shared.b2, out, out);
  }

  if (s.step && !s.step->recomputing) {
    if (s.route_pending) {
      s.pending = s.step;
      s.pending_training = s.step->training;
      s.pending_weight = s.step->loss_weight;
    } else {
      double seq_aux = 0;
      if (c.seq_aux_loss > 0 && s.step->cu_seqlens && !s.step->cu_seqlens->empty())
        seq_aux = sequenceAux(r, s.step->cu_seqlens->data(),
                              static_cast<int>(s.step->cu_seqlens->size()) - 1, 0.0, nullptr,
                              s.seq_load.empty() ? nullptr : s.seq_load.data());
      s.account(*s.step, s.step->training, s.step->loss_weight, t_n, seq_aux);
    }
  }
}

template <class T> void MoeMlp<T>::backward(OpContext& ctx, const LayerActs& saved,
                                            const Mat& dout_c, const Mat& dh,
                                            LayerScratch& /*scratch*/) const {
  auto& s = *state_member;
  const auto& space = ctx.space();
  const auto& c = s.c;
  s.settle();
  const Routing& r = s.routing;
  const std::int64_t t_n = s.tokens, hid = s.hidden, e_n = c.experts, k = c.top_k;
  const std::int64_t fe = c.expert_ffn, fp = c.swiglu() ? 2 * fe : fe, rows = s.rows;
  const DType cdt = s.cdt;
  const Mat& h = saved.ln2;

  // dgate per slot = dout(t) . y(row); dy(row) = gate * dout(t).
  View1<T> dgate = grow(s.dgate_s, t_n * k, "plm::model::moe::dgate");
  View1<T> dy = growAs(s.dy_s, rows * hid, cdt, "plm::model::moe::dy");
  if (s.bf16()) {
#if PLM_HAVE_CUDA
    if constexpr (std::is_same_v<T, float>) {
      ctx.mark(OpKind::Other);
      gpu::moeUnpermuteBackward(space.cuda_stream(), bf16Data(dout_c),
                                reinterpret_cast<const gpu::bf16*>(s.y.data()), s.slot_row.data(),
                                s.slot_gate.data(), reinterpret_cast<gpu::bf16*>(dy.data()),
                                dgate.data(), t_n, static_cast<int>(k), static_cast<int>(hid));
      ctx.mark(OpKind::Route);
    }
#endif
  } else {
    auto dout = dout_c.template view<T>();
    auto y = s.y;
    auto srow = s.slot_row;
    Kokkos::parallel_for(
        "plm::model::moe::dgate", FlatPolicy(space, 0, t_n * k),
        KOKKOS_LAMBDA(const std::int64_t slot) {
          const std::int32_t p = srow(slot);
          T acc = 0;
          if (p >= 0)
            for (std::int64_t col = 0; col < hid; ++col)
              acc += dout(slot / k, col) * y(p * hid + col);
          dgate(slot) = acc;
        });
    auto rtok = s.row_token;
    auto rgate = s.row_gate;
    Kokkos::parallel_for(
        "plm::model::moe::permute_grad", FlatPolicy(space, 0, rows),
        KOKKOS_LAMBDA(const std::int64_t p) {
          const std::int64_t t = rtok(p);
          for (std::int64_t col = 0; col < hid; ++col) dy(p * hid + col) = rgate(p) * dout(t, col);
        });
  }

  // Expert backward on this rank's experts: per expert the weight gradient (and the bias
  // gradient) and the input gradient, GELU's derivative from the kept pre-activation.  With
  // self rows first, the self rows' dy is computed in place while the others' dy travels; the
  // weight gradients accumulate self rows then exchanged rows (a fixed order: deterministic).
  View1<T> dx = growAs(s.dx_s, rows * hid, cdt, "plm::model::moe::dx");
  View1<T> dpre = growAs(s.dpre_s, s.expert_rows * fp, cdt, "plm::model::moe::dpre");
  View1<T> dact;  // SwiGLU experts only
  if (c.swiglu()) dact = growAs(s.dact_s, s.expert_rows * fe, cdt, "plm::model::moe::dact");
  auto dactRows = [&](std::int64_t first, std::int64_t n) {
    return c.swiglu() ? rowsAs(dact, cdt, first, n, fe) : Mat{};
  };
  if (s.distributed()) {
    const std::int64_t sn = s.self_n, xn = s.exchanged;
    View1<T> dyexp = growAs(s.dyexp_s, xn * hid, cdt, "plm::model::moe::dyexp");
    View1<T> dxexp = growAs(s.dxexp_s, xn * hid, cdt, "plm::model::moe::dxexp");
    dist::Work work = s.startToExperts(ctx, dy);
    if (sn > 0)
      expertsBackward(ctx, s.blocks(s.self_rows, true), rowsAs(s.xperm, cdt, s.self_at, sn, hid),
                      rowsAs(s.pre, cdt, 0, sn, fp), rowsAs(s.act, cdt, 0, sn, fe),
                      rowsAs(dy, cdt, s.self_at, sn, hid), rowsAs(dpre, cdt, 0, sn, fp),
                      rowsAs(dx, cdt, s.self_at, sn, hid), c.expert_gemm, c.expert_activation,
                      dactRows(0, sn));
    s.finishToExperts(ctx, work, dyexp);
    if (xn > 0)
      expertsBackward(ctx, s.blocks(s.exchanged_rows, true), rowsAs(s.xexp, cdt, 0, xn, hid),
                      rowsAs(s.pre, cdt, sn, xn, fp), rowsAs(s.act, cdt, sn, xn, fe),
                      rowsAs(dyexp, cdt, 0, xn, hid), rowsAs(dpre, cdt, sn, xn, fp),
                      rowsAs(dxexp, cdt, 0, xn, hid), c.expert_gemm, c.expert_activation,
                      dactRows(sn, xn));
    s.fromExperts(ctx, dxexp, dx);
  } else {
    expertsBackward(ctx, s.blocks(s.local_rows, true), rowsAs(s.xexp, cdt, 0, rows, hid),
                    rowsAs(s.pre, cdt, 0, rows, fp), rowsAs(s.act, cdt, 0, rows, fe),
                    rowsAs(dy, cdt, 0, rows, hid), rowsAs(dpre, cdt, 0, rows, fp),
                    rowsAs(dx, cdt, 0, rows, hid), c.expert_gemm, c.expert_activation,
                    dactRows(0, rows));
  }

  // Router: gates, aux and z losses to the logits (on the device when it routed, else on the
  // host), then dWr += dlogits^T h and the input gradient dlogits Wr (added to dh below).
  const double weight = s.step ? s.step->grad_scale * s.step->loss_weight : 0.0;
  View1<T> dlogits;
  if (s.routed_on_device) {
#if PLM_HAVE_CUDA
    dlogits = grow(s.dlogits_s, t_n * e_n, "plm::model::moe::dlogits");
    // The losses average over total_tokens (the whole micro-batch under context parallelism);
    // the kernel divides the z term by this pass's tokens.
    const double total = static_cast<double>(std::max<std::int64_t>(r.total_tokens, 1));
    std::vector<double> aux_dp(e_n, 0.0);
    for (int e = 0; e < e_n; ++e)
      aux_dp[e] = weight * c.aux_loss * e_n *
                  (static_cast<double>(r.total_routed[e]) / (total * k)) / total;
    gpu::routeBackwardOnDevice(space.cuda_stream(), s.route_args, s.route_bufs,
                               reinterpret_cast<const float*>(dgate.data()), aux_dp,
                               weight * c.z_loss * static_cast<double>(t_n) / total,
                               reinterpret_cast<float*>(dlogits.data()));
    ctx.mark(OpKind::Route);
#endif
  } else {
    std::vector<T> dgate_t(t_n * k);
    Kokkos::deep_copy(space, Kokkos::View<T*, HostSpace>(dgate_t.data(), dgate_t.size()), dgate);
    space.fence();
    std::vector<double> dg(dgate_t.begin(), dgate_t.end()), dl(t_n * e_n, 0.0);
    std::vector<double> dprob;
    if (c.seq_aux_loss > 0 && s.step && s.step->cu_seqlens && !s.step->cu_seqlens->empty()) {
      dprob.assign(t_n * e_n, 0.0);
      sequenceAux(r, s.step->cu_seqlens->data(), static_cast<int>(s.step->cu_seqlens->size()) - 1,
                  weight * c.seq_aux_loss, dprob.data(),
                  s.seq_load.empty() ? nullptr : s.seq_load.data());
    }
    routeBackward(r, c, s.logits_host.data(), dg.data(), weight * c.aux_loss, weight * c.z_loss,
                  dl.data(), dprob.empty() ? nullptr : dprob.data());
    std::vector<T> dl_t(dl.begin(), dl.end());
    dlogits = toDevice(s.dlogits_s, dl_t, "plm::model::moe::dlogits");
  }
  View2<T> dl2(dlogits.data(), t_n, e_n);

  if (s.bf16()) {
    // dh (bf16) = sum over a token's kept slots of dx + dlogits Wr, the router part in fp32.
#if PLM_HAVE_CUDA
    if constexpr (std::is_same_v<T, float>) {
      const View2<T> wr = s.routeWeights();
      const bool projected = s.route_w.data() != nullptr;
      // The router's input gradient dl Wr (minus the projection's correction) is formed inside
      // the combine where the router fits a block's shared memory (no (T, H) fp32 buffer
      // written and read back), else by a GEMM into one.
      const bool in_combine = gpu::moeCombineTakesRouter(
          static_cast<int>(hid), static_cast<int>(e_n), {dx.data(), bf16Data(dh)});
      View1<T> dhr, v;
      if (!in_combine) dhr = grow(s.dhr_s, t_n * hid, "plm::model::moe::dh_router");
      if (t_n > 0) {
        const View2<T> dhr2 = in_combine ? View2<T>() : View2<T>(dhr.data(), t_n, hid);
        if (!in_combine) gemm(space, Trans::N, Trans::N, T(1), dl2, wr, T(0), dhr2);
        if (s.router_bf16) {
          // dW += G^T h and, under the projection, X^T (G W s / |s|^2) in one pass over the
          // bf16 h; X s came from the forward.
          const View1<T> gw = projected ? s.projectionGw(ctx, dl2) : View1<T>();
          const View1<T> xg =
              projected ? grow(s.proj_xg_s, hid, "plm::model::moe::projection_xg") : View1<T>();
          const std::size_t bytes =
              gpu::routerOuterWorkspaceBytes(t_n, static_cast<int>(hid), static_cast<int>(e_n));
          View1<T> ws =
              grow(s.outer_ws_s, static_cast<std::int64_t>((bytes + sizeof(T) - 1) / sizeof(T)),
                   "plm::model::moe::router_outer_workspace");
          gpu::routerOuter(space.cuda_stream(), bf16Data(h), dl2.data(), t_n, static_cast<int>(hid),
                           static_cast<int>(e_n), gw.data(), s.g.router.template view<T>().data(),
                           xg.data(), ws.data(), bytes);
          if (projected)
            v = s.projectionBackwardFrom(ctx, dl2, View1<T>(s.proj_xs_s.data(), t_n), xg, dhr2);
        } else {
          gemm(space, Trans::T, Trans::N, T(1), dl2, s.routerInput(ctx, h, true), T(1),
               s.g.router.template view<T>());
          if (projected) v = s.projectionBackward(ctx, s.routerInput(ctx, h, true), dl2, dhr2);
        }
      }
      ctx.mark(OpKind::Other);  // the router's GEMMs
      if (in_combine)
        gpu::moeCombineGradient(
            space.cuda_stream(), reinterpret_cast<const gpu::bf16*>(dx.data()), s.slot_row.data(),
            bf16Data(dh), t_n, static_cast<int>(k), static_cast<int>(hid),
            gpu::RouterInputGradient{dl2.data(), wr.data(), v.data(), static_cast<int>(e_n)});
      else
        gpu::moeCombineGradient(space.cuda_stream(), reinterpret_cast<const gpu::bf16*>(dx.data()),
                                s.slot_row.data(), bf16Data(dh), t_n, static_cast<int>(k),
                                static_cast<int>(hid), dhr.data());
      ctx.mark(OpKind::Route);
    }
#endif
  } else {
    // dh = sum over a token's kept slots of their input gradients (fixed order).
    auto dst = dh.template view<T>();
    auto srow = s.slot_row;
    Kokkos::parallel_for(
        "plm::model::moe::unpermute_grad", FlatPolicy(space, 0, t_n),
        KOKKOS_LAMBDA(const std::int64_t t) {
          for (std::int64_t col = 0; col < hid; ++col) {
            T acc = 0;
            for (std::int64_t j = 0; j < k; ++j) {
              const std::int32_t p = srow(t * k + j);
              if (p >= 0) acc += dx(p * hid + col);
            }
            dst(t, col) = acc;
          }
        });
    if (t_n > 0) {
      gemm(space, Trans::N, Trans::N, T(1), dl2, s.routeWeights(), T(1), dh.template view<T>());
      gemm(space, Trans::T, Trans::N, T(1), dl2, h.template view<T>(), T(1),
           s.g.router.template view<T>());
      if (s.route_w.data() != nullptr)
        s.projectionBackward(ctx, h.template view<T>(), dl2, dh.template view<T>());
    }
  }

  if (c.shared_experts > 0 && t_n > 0) {
    const std::int64_t sw = s.sharedWidth();
    View1<T> sdpre = growAs(s.sdpre_s, t_n * sw, cdt, "plm::model::moe::shared_dpre");
    linearBackwardGelu(ctx, rowsAs(s.sact, cdt, 0, t_n, sw), s.w.shared.w2, dout_c,
                       rowsAs(s.spre, cdt, 0, t_n, sw), rowsAs(sdpre, cdt, 0, t_n, sw),
                       s.g.shared.w2, s.g.shared.b2);
    linearBackward(ctx, h, s.w.shared.w1, rowsAs(sdpre, cdt, 0, t_n, sw), dh, true, s.g.shared.w1,
                   s.g.shared.b1);
  }
}

std::vector<double> biasBalanceStep(const MoeConfig& c, const std::vector<double>& routed) {
  PLM_REQUIRE(static_cast<int>(routed.size()) == c.experts,
              "plm::model::biasBalanceStep: one routed count per expert (a bug)");
  const double mean = std::accumulate(routed.begin(), routed.end(), 0.0) / c.experts;
  std::vector<double> out(routed.size());
  for (std::size_t e = 0; e < routed.size(); ++e) {
    const double diff = mean - routed[e];
    const double step = c.bias_update == BiasUpdate::Proportional ? (mean > 0 ? diff / mean : 0.0)
                                                                  : (diff > 0   ? 1.0
                                                                     : diff < 0 ? -1.0
                                                                                : 0.0);
    out[e] = c.bias_rate * step;
  }
  return out;
}

template <class T> void MoeMlp<T>::balanceBias(OpContext& ctx, const std::vector<double>& routed) {
  auto& s = *state_member;
  if (!s.c.bias_balance || s.w.expert_bias.empty()) return;
  const int e_n = s.c.experts;
  const std::vector<double> step = biasBalanceStep(s.c, routed);
  std::vector<T> b(e_n);
  auto dev = s.w.expert_bias.template view<T>();
  Kokkos::deep_copy(ctx.space(), Kokkos::View<T*, HostSpace>(b.data(), e_n), dev);
  ctx.space().fence();
  for (int e = 0; e < e_n; ++e) b[e] += static_cast<T>(step[e]);
  Kokkos::deep_copy(ctx.space(), dev, Kokkos::View<const T*, HostSpace>(b.data(), e_n));
  ctx.space().fence();
}

template <class T> RouterInputSums MoeMlp<T>::takeRouterInputSums() {
  RouterInputSums out = std::move(state_member->input_sums);
  state_member->input_sums = RouterInputSums();
  if (out.sum.empty()) out.sum.assign(state_member->hidden, 0.0);
  return out;
}

template <class T> void MoeMlp<T>::centreRouter(OpContext& ctx, const std::vector<double>& mean) {
  auto& s = *state_member;
  PLM_REQUIRE(static_cast<int>(mean.size()) == s.hidden,
              "plm::model::MoeMlp::centreRouter: the mean input must have the model's width");
  std::vector<T> router = s.routerToHost(ctx.space());
  centreRows(router, s.c.experts, mean);
  Kokkos::deep_copy(ctx.space(), s.w.router.template view<T>(),
                    HostView2<const T>(router.data(), s.c.experts, s.hidden));
  ctx.space().fence();
}

template <class T> void MoeMlp<T>::takeStepInputSum(OpContext& ctx, double* host) {
  auto& s = *state_member;
  const auto& space = ctx.space();
  const std::int64_t h = s.hidden;
  if (!s.step_sum_live) {
    std::fill(host, host + h, 0.0);
    return;
  }
  // Widened to double on the device, then one copy back (the caller fences once for all layers).
  View1<double> wide = grow(s.unit_s, h, "plm::model::moe::unit_mean");
  const View1<T> sum = s.step_sum_s;
  Kokkos::parallel_for(
      "plm::model::moe::widen_step_sum", Kokkos::RangePolicy<ExecSpace>(space, 0, h),
      KOKKOS_LAMBDA(const std::int64_t i) { wide(i) = static_cast<double>(sum(i)); });
  Kokkos::deep_copy(space, Kokkos::View<double*, HostSpace>(host, h), wide);
  s.step_sum_live = false;
}

template <class T> void MoeMlp<T>::projectRouter(OpContext& ctx, const std::vector<double>& basis) {
  auto& s = *state_member;
  const std::int64_t h = s.hidden, e_n = s.c.experts;
  PLM_REQUIRE(
      h > 0 && basis.size() % static_cast<std::size_t>(h) == 0,
      "plm::model::MoeMlp::projectRouter: the basis must hold vectors of the model's width");
  const std::int64_t k_n = static_cast<std::int64_t>(basis.size()) / h;
  if (k_n == 0) return;
  const auto& space = ctx.space();
  View1<double> q = grow(s.unit_s, k_n * h, "plm::model::moe::unit_mean");
  Kokkos::deep_copy(space, q, Kokkos::View<const double*, HostSpace>(basis.data(), k_n * h));
  View1<double> wq = grow(s.wu_s, e_n * k_n, "plm::model::moe::router_times_mean");
  const View2<T> w = s.w.router.template view<T>();
  using Team = Kokkos::TeamPolicy<ExecSpace>;
  Kokkos::parallel_for(
      "plm::model::moe::router_dot_mean", Team(space, e_n * k_n, Kokkos::AUTO),
      KOKKOS_LAMBDA(const Team::member_type& team) {
        const std::int64_t ek = team.league_rank(), e = ek / k_n, k = ek % k_n;
        double acc = 0;
        Kokkos::parallel_reduce(
            Kokkos::TeamThreadRange(team, h),
            [&](const std::int64_t i, double& a) {
              a += static_cast<double>(w(e, i)) * q(k * h + i);
            },
            acc);
        Kokkos::single(Kokkos::PerTeam(team), [&] { wq(ek) = acc; });
      });
  Kokkos::parallel_for(
      "plm::model::moe::router_project", Kokkos::RangePolicy<ExecSpace>(space, 0, e_n * h),
      KOKKOS_LAMBDA(const std::int64_t ei) {
        const std::int64_t e = ei / h, i = ei % h;
        double v = static_cast<double>(w(e, i));
        for (std::int64_t k = 0; k < k_n; ++k) v -= wq(e * k_n + k) * q(k * h + i);
        w(e, i) = static_cast<T>(v);
      });
}

template class MoeMlp<float>;
template class MoeMlp<double>;

}  // namespace plm::model
