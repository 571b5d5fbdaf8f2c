// CUDA kernels of the Mixture-of-Experts block (doc/model.md "Mixture of Experts"): the fused
// gate-weighted unpermute (with the residual add), its backward (gate gradients and the
// permuted output gradient in one pass), the combine of the permuted input gradient, and the
// experts' GEMMs over contiguous row blocks through cuBLASLt.
//
// Design: the routing (top-k, capacity, the stable permutation) stays the host reference of
// model/moe.cpp; these kernels consume its index arrays.  Permuting the tokens is gatherRows
// (gpu/fused.hpp).  Every reduction runs in a fixed order (one warp per token, slots in order),
// so results are deterministic; where hidden is a multiple of 8 and the rows 16-byte aligned,
// each lane moves 16 bytes at a time (setMoeScalarKernels(true) forces the scalar kernels, for
// tests).  bf16 activations, fp32 gates and residual stream (the bf16
// policy of the model).  The expert GEMMs are a loop of cuBLASLt calls, one up (bias + GELU,
// pre-activation kept) and one down (bias) per expert with rows; experts without rows launch
// nothing (moe_grouped.hpp has the grouped launches).  Plain references are in
// test/gpu/test_moe.cpp.
#pragma once

#include "gpu/device.hpp"
#include "gpu/gemm.hpp"

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <vector>

namespace plm::gpu {

/// \brief out(t) = residual(t) + sum over j < k with slot_row[t k + j] >= 0 of
/// slot_gate[t k + j] * y(slot_row[t k + j]); y (rows, hidden) bf16; residual, out (T, hidden)
/// fp32 (out may be residual).
void moeUnpermute(Stream stream, const bf16* y, const std::int32_t* slot_row,
                  const float* slot_gate, const float* residual, float* out, std::int64_t tokens,
                  int k, int hidden);

/// \brief For every kept slot (t, j) with row p: dy(p) = gate * dout(t) (bf16) and
/// dgate[t k + j] = dout(t) . y(p) (fp32); dropped slots get dgate 0.
void moeUnpermuteBackward(Stream stream, const bf16* dout, const bf16* y,
                          const std::int32_t* slot_row, const float* slot_gate, bf16* dy,
                          float* dgate, std::int64_t tokens, int k, int hidden);

/// \brief dh(t) = add(t) + sum over the kept slots of token t of dx(row) (fp32 sum, bf16 out);
/// add (tokens, hidden) fp32 is the router's input gradient, nullptr = 0.
void moeCombineGradient(Stream stream, const bf16* dx, const std::int32_t* slot_row, bf16* dh,
                        std::int64_t tokens, int k, int hidden, const float* add = nullptr);

/// The router's input gradient of a token, formed where the combine needs it instead of in a
/// (tokens, hidden) fp32 buffer: r(t) = dl(t) W - v, dl (tokens, experts) fp32 the logits'
/// gradient, W (experts, hidden) fp32 the router the pass routed with, v (hidden) fp32 the
/// projection's per-column correction or nullptr (device pointers).
struct RouterInputGradient {
  const float* dl = nullptr;
  const float* w = nullptr;
  const float* v = nullptr;
  int experts = 0;
};

/// \brief Whether moeCombineGradient with a RouterInputGradient takes this shape (hidden a
/// multiple of 8, 16-byte aligned rows, the router (experts x hidden fp32) in one block's shared
/// memory); where not, form the router's part apart and pass it as `add`.
bool moeCombineTakesRouter(int hidden, int experts, std::initializer_list<const void*> ptrs);
/// \brief dh(t) = r(t) + sum over the kept slots of token t of dx(row), r(t) = sum over e (in
/// order) of dl(t, e) W(e) then minus v (fp32; the same order as forming r in a buffer first),
/// bf16 out.  Throws plm::Error where moeCombineTakesRouter is false.
void moeCombineGradient(Stream stream, const bf16* dx, const std::int32_t* slot_row, bf16* dh,
                        std::int64_t tokens, int k, int hidden, const RouterInputGradient& router);

/// The router's fp32 products with its bf16 input h (tokens, hidden), read as bf16 (no fp32 copy
/// of h): exact products of the widened values, fp32 sums in an order fixed by the shape.  They
/// take a router whose (experts x hidden) fp32 fits a block's shared memory, hidden a multiple of
/// 8 and 16-byte aligned rows (routerFitsShared).
bool routerFitsShared(int hidden, int experts);
/// \brief logits (tokens, experts) = h W^T and, where s != nullptr, hs (tokens) = h s.
void routerLogits(Stream stream, const bf16* h, std::int64_t tokens, int hidden, const float* w,
                  int experts, const float* s, float* logits, float* hs);
/// \brief Workspace bytes routerOuter needs for `tokens` rows.
std::size_t routerOuterWorkspaceBytes(std::int64_t tokens, int hidden, int experts);
/// \brief dw (experts, hidden) += sum over t of g(t, e) h(t) and, where gs != nullptr,
/// xg (hidden) = sum over t of gs(t) h(t) (written); g (tokens, experts) fp32.
void routerOuter(Stream stream, const bf16* h, const float* g, std::int64_t tokens, int hidden,
                 int experts, const float* gs, float* dw, float* xg, void* workspace,
                 std::size_t workspace_bytes);

/// One expert's bf16 weights (device pointers): W1 (ffn, hidden), b1 (ffn), W2 (hidden, ffn),
/// b2 (hidden).
struct ExpertWeights {
  const bf16* w1 = nullptr;
  const bf16* b1 = nullptr;
  const bf16* w2 = nullptr;
  const bf16* b2 = nullptr;
};

/// \brief For each expert e with rows[e] > 0, on its block of rows (experts back to back):
/// pre = x W1^T + b1, act = gelu_tanh(pre), y = act W2^T + b2.  x, y (sum rows, hidden),
/// pre, act (sum rows, ffn), bf16; hidden and ffn multiples of 8.
void expertFfnForward(Gemm& gemm, Stream stream, const std::vector<ExpertWeights>& experts,
                      const std::vector<std::int64_t>& rows, const bf16* x, bf16* pre, bf16* act,
                      bf16* y, int hidden, int ffn);

/// The routing of T tokens on the device (the bf16 training path): the same decisions as the host
/// reference model::route (computed in double from the fp32 logits, top-k by descending score
/// with ties to the lower expert, the capacity cut in slot order, the stable expert-major
/// permutation), without moving the logits to the host.  Device buffers, owned by the caller
/// through DeviceRouting::reserve.  Up to kMaxRouteExperts experts.
constexpr int kMaxRouteExperts = 256;

struct RouteArgs {
  std::int64_t tokens = 0;
  int experts = 0, top_k = 0;
  bool softmax = true, normalize_topk = true;
  std::int64_t capacity = 0;      // per expert; 0 = dropless
  const float* logits = nullptr;  // (T, E)
  const float* bias = nullptr;    // (E) selection bias or nullptr
};

/// Device outputs and scratch of one routing (pointers into one allocation the caller sizes
/// with routeWorkspaceBytes).
struct RouteBuffers {
  double* prob = nullptr;            // (T, E) probabilities
  double* lse = nullptr;             // (T) log-sum-exp of the logits
  double* token_stats = nullptr;     // (T, 2) lse^2 and the router entropy per token
  std::int32_t* expert = nullptr;    // (T k) chosen expert per slot
  float* gate = nullptr;             // (T k) gate per slot
  std::int32_t* slot_row = nullptr;  // (T k) permuted row or -1 (dropped)
  std::int32_t* rank = nullptr;      // (T k) scratch: rank within its chunk, then within its expert
  std::int32_t* row_token = nullptr;    // (T k) token of each row (the first `rows` entries)
  float* row_gate = nullptr;            // (T k) gate of each row
  std::int64_t* chunk_count = nullptr;  // (chunks, E) scratch
  std::int64_t* counts = nullptr;       // (3 E) routed, kept and first row of each expert
  double* sums = nullptr;  // (E + 2) sum of probabilities per expert, of lse^2, entropy
};

/// \brief Bytes of device workspace routeOnDevice needs for `tokens` tokens.
std::size_t routeWorkspaceBytes(std::int64_t tokens, int experts, int top_k);
/// \brief Splits a workspace of routeWorkspaceBytes into the buffers.
RouteBuffers routeBuffers(void* workspace, std::int64_t tokens, int experts, int top_k);

/// What the host needs from a device routing (one copy of 4 E + 2 numbers).
struct RouteSummary {
  std::vector<std::int64_t> routed, kept;  // (E) slots per expert before / after the cut
  std::vector<double> prob_sum;            // (E) sum over tokens of the probabilities
  double lse2_sum = 0, entropy_sum = 0;    // sums over tokens
};

/// \brief Tests: true makes the unpermute and combine kernels of this process take their scalar
/// form even where the 16-byte one applies (default false).
void setMoeScalarKernels(bool scalar);

/// Pinned host memory a routing's summary is copied into, and the event that says it has
/// landed: routeOnDeviceAsync leaves the stream running, so work launched after it (the
/// permutation of a dropless routing, whose row count t k is known) overlaps the host's wait in
/// routeSummary.  One per MoE layer; not copyable.
class RouteReadback {
 public:
  RouteReadback();
  ~RouteReadback();
  RouteReadback(const RouteReadback&) = delete;
  RouteReadback& operator=(const RouteReadback&) = delete;
  struct Impl;

 private:
  friend void routeOnDeviceAsync(Stream, const RouteArgs&, const RouteBuffers&, RouteReadback&);
  friend RouteSummary routeSummary(RouteReadback&);
  Impl* impl_member;
};

/// \brief Launches the routing on `stream` and the copy of its summary into `rb` (no wait).
void routeOnDeviceAsync(Stream stream, const RouteArgs& a, const RouteBuffers& b,
                        RouteReadback& rb);
/// \brief Waits for the summary of the last routeOnDeviceAsync into `rb` (an event, not the
/// whole stream) and returns it.
RouteSummary routeSummary(RouteReadback& rb);

/// \brief Routes on `stream` and returns the summary (routeOnDeviceAsync, then routeSummary).
RouteSummary routeOnDevice(Stream stream, const RouteArgs& a, const RouteBuffers& b);

/// \brief The router's logit gradient on the device, as model::routeBackward without the
/// sequence-level loss: dlogits (T, E) fp32 from the per-slot gate gradients dgate (T k, fp32,
/// dropped slots ignored), aux_dp (E) = aux_scale d(aux)/d(P_e) per token, and z_scale.
/// aux_dp travels as a kernel parameter (no host-to-device copy, nothing waits).
void routeBackwardOnDevice(Stream stream, const RouteArgs& a, const RouteBuffers& b,
                           const float* dgate, const std::vector<double>& aux_dp, double z_scale,
                           float* dlogits);

}  // namespace plm::gpu
