// The model's dispatch points: every operation the ESM-2 orchestration performs, one function
// each, choosing the implementation by execution space and precision policy.
//
// Design: tensors cross this boundary as typed handles (Mat, Vec: device pointer, element type,
// shape, row stride), so one orchestration (esm2.cpp, encoder_layer.cpp) drives every backend.
//   - fp32 / fp64 (the CPU reference, and fp32 on CUDA): the portable Kokkos kernels of this
//     folder (linear.hpp, layer_norm.hpp, attention.hpp, ...), exactly as they were called before
//     the dispatch points existed, so CPU results are unchanged bit for bit.
//   - bf16 (CUDA build, Esm2<float>): the CUDA specialisations in src/gpu/ (cuBLASLt GEMMs with
//     bias / GELU / dGELU / bias-gradient epilogues, tensor-core varlen flash attention, fused
//     LayerNorm, rotary, embedding and cross-entropy), on the execution space's stream.
// A dispatch point reads the element type of its handles: bf16 activations select the CUDA path;
// the residual stream, its gradient and every parameter gradient stay in the master type.
// Accumulation rules are those of the portable kernels: parameter gradients accumulate (+=),
// activations are written (=) unless a function says otherwise.
#pragma once

#include "core/types.hpp"
#include "model/attention.hpp"

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace plm::gpu {
struct FlashParams;  // gpu/flash_attention.hpp
}

namespace plm::model {

struct Fp8GemmSlot;  // fp8_scaling.hpp

/// Element types of model tensors.  Not merged with gpu::DType (GEMM operands, FP8 included;
/// gpu/ headers stay free of Kokkos) or dist::DataType (what a collective moves, integers
/// included): each lists exactly what its API accepts, so an unsupported type does not compile.
enum class DType : std::uint8_t { F32, F64, BF16 };

std::size_t sizeOf(DType d);
const char* dtypeName(DType d);
template <class E> constexpr DType dtypeOf() {
  static_assert(std::is_same_v<E, float> || std::is_same_v<E, double>, "fp32 or fp64");
  return std::is_same_v<E, float> ? DType::F32 : DType::F64;
}

/// A row-major matrix in the execution space's memory: rows x cols, row stride ld elements.
struct Mat {
  void* data = nullptr;
  DType dtype = DType::F32;
  std::int64_t rows = 0, cols = 0, ld = 0;
  /// Set on a GEMM weight under the FP8 policy (train.precision: fp8): the weight is the
  /// quantised compute copy and the GEMM's other operands are quantised too (fp8_gemm.hpp).
  const Fp8GemmSlot* fp8 = nullptr;

  bool empty() const { return data == nullptr; }
  /// \brief Columns [first, first + count) of every row (same ld).
  Mat columns(std::int64_t first, std::int64_t count) const;
  /// \brief The pointer as E*; throws plm::Error if the element type is not E.
  template <class E> E* ptr() const;
  /// \brief An unmanaged LayoutRight view; requires ld == cols.
  template <class E> View2<E> view() const;
};

/// A vector in the execution space's memory.
struct Vec {
  void* data = nullptr;
  DType dtype = DType::F32;
  std::int64_t n = 0;

  bool empty() const { return data == nullptr; }
  template <class E> E* ptr() const;
  template <class E> View1<E> view() const;
};

template <class E> Mat matOf(const View2<E>& v) {
  return Mat{v.data(), dtypeOf<E>(), static_cast<std::int64_t>(v.extent(0)),
             static_cast<std::int64_t>(v.extent(1)), static_cast<std::int64_t>(v.extent(1))};
}
template <class E> Vec vecOf(const View1<E>& v) {
  return Vec{v.data(), dtypeOf<E>(), static_cast<std::int64_t>(v.extent(0))};
}

/// The arithmetic of the model's compute: `train.precision` in the deck.  Master parameters,
/// gradients, the residual stream and the optimizer stay in the model's scalar type (fp32).
/// Fp8: the four GEMMs of each encoder layer (outside fp8's bf16 ranges) in FP8 with the
/// scaling recipe of Esm2Config::fp8, everything else as Fp32 (the portable emulation,
/// fp8_gemm.hpp; doc/fp8.md).
enum class Precision { Fp32, Bf16, Fp8 };
Precision parsePrecision(const std::string& name);  // "fp32" | "bf16" | "fp8"; else collective
const char* precisionName(Precision p);

/// What the backward pass recomputes instead of keeping (`model.recompute` in the deck).
///  - None: every layer's activations are kept.
///  - Layer: only the residual stream at layer boundaries is kept; each layer's forward reruns
///    before its backward.
///  - Selective: the GEMM outputs (q/k/v, the attention output projection's result, the FFN
///    pre-activation and its GELU from the same GEMM) are kept; LayerNorm outputs and the
///    attention itself (softmax, output and log-sum-exp) are recomputed.
enum class Recompute { None, Layer, Selective };
Recompute parseRecompute(const std::string& name);  // "none" | "layer" | "selective"
const char* recomputeName(Recompute r);

class RingAttention;  // model/context_parallel.hpp

/// The packed micro-batch on the device, as every dispatch point sees it.
struct DeviceBatch {
  std::int64_t tokens = 0;
  int num_seqs = 0;
  int max_seqlen = 0;
  View1<token_t> ids;          // (T)
  View1<seqlen_t> cu_seqlens;  // (n+1)
  View1<seqlen_t> position;    // (T) position inside its sequence
  Vec mult;                    // (T) token-dropout multiplier (master type)
  bool token_dropout = true;
  int mask_id = 32, pad_id = 1;
  /// Set for a context-parallel shard: attention runs over the ring (position then holds the
  /// global positions, and sequences may be empty).
  RingAttention* ring = nullptr;
};

/// q, k, v of one attention call, (T, hidden) each; under the fused layout slices of one
/// (T, 3 hidden) buffer (ld = 3 hidden).
struct Qkv {
  Mat q, k, v;
  bool fused() const;  // k and v follow q inside one row
};

/// The q/k/v projection's weights in compute precision: separate (out, in) matrices, or the
/// bf16 copy stacked as one (3H, H) matrix and (3H) bias (fused_w / fused_b set).
struct QkvWeights {
  Mat wq, wk, wv;
  Vec bq, bk, bv;
  Mat fused_w;
  Vec fused_b;
};

/// Their gradients, always the separate master-type tensors of the flat gradient buffer.
struct QkvGrads {
  Mat wq, wk, wv;
  Vec bq, bk, bv;
};

/// \brief Which CUDA kernels run bf16 attention: cuDNN's fused attention both ways, cuDNN's
/// forward with the own flash backward, the own flash attention both ways (the reference, and
/// the fallback for shapes cuDNN has no kernel for), or Auto: the faster by head_dim as measured
/// (doc/gpu.md).  The deck key train.attention sets it.
enum class AttentionKernel { Auto, Cudnn, CudnnForward, Flash };
AttentionKernel parseAttentionKernel(const std::string& name);
const char* attentionKernelName(AttentionKernel k);
class OpContext;
/// \brief The kernels bf16 attention runs at this head_dim (Auto resolved; CUDA build).
AttentionKernel attentionKernelFor(const OpContext& ctx, int head_dim);

/// Per-kind timing of the launches of a stream (CUDA events); see Esm2::setProfiling.
/// What a launch's time counts as under profiling (OpContext::setProfiling).  Dispatch: the
/// MoE layers' row all-to-alls between the ranks of an expert group (with their waits);
/// DispatchCounts: their per-expert row counts' exchange, which the host waits for.  Route: the
/// MoE layers' own token movement at any expert degree (the routing kernels, the permutation,
/// the gate-weighted unpermute and their backward, and the GPU's idle time while the host waits
/// for the routing's counts).
enum class OpKind { Gemm, Attention, LayerNorm, Other, Dispatch, DispatchCounts, Route, Count };

/// \brief Where operations run: the execution space instance, the attention tiles of the
/// portable kernels, and the state of the CUDA path (cuBLASLt handle and plan cache, grow-only
/// scratch, per-kind CUDA-event timing, the loss accumulator on the device).
class OpContext {
 public:
  explicit OpContext(const ExecSpace& space);
  ~OpContext();
  OpContext(const OpContext&) = delete;
  OpContext& operator=(const OpContext&) = delete;

  const ExecSpace& space() const { return space_member; }
  /// Tile sizes of the portable attention (tests shrink them to cross tile boundaries).
  AttentionTiles tiles;
  /// The bf16 attention kernels (train.attention; Esm2 sets it from Esm2Config::attention).
  AttentionKernel attention_kernel = AttentionKernel::Auto;
  /// Bitwise-reproducible backward kernels (cuDNN's deterministic attention backward); false
  /// lets cuDNN accumulate dQ with float atomics (train.deterministic: false).
  bool deterministic = true;

  /// \brief Zeroes the loss accumulator that crossEntropy adds to.
  void beginLoss();
  /// \brief The sum crossEntropy accumulated since beginLoss (waits for the stream).
  double endLoss();

  /// \brief Time every launch by kind with CUDA events (bf16 path only; costs a little speed).
  void setProfiling(bool on);
  /// \brief Forgets which FP8 GEMM read the output of the producers keyed by an address in
  /// [begin, begin + bytes) (a LayerNorm's gamma): parameters placed there now belong to
  /// another layer (sharded data parallelism moves layers between slots).  CUDA fp8 only.
  void forgetFp8Readers(const void* begin, std::size_t bytes);
  /// \brief Milliseconds per kind since setProfiling(true), as (name, ms).
  std::vector<std::pair<std::string, double>> profile();
  /// \brief With profiling: the encoder layer the following launches belong to (-1: the
  /// embedding, the head, the loss, the optimizer).  Closes the current interval, so kernels
  /// of ops that do not mark stay with the layer that launched them.
  void setProfileLayer(int layer);
  /// \brief GPU milliseconds per (layer, kind) accumulated since resetLayerProfile(): one row
  /// per layer index met, ascending (-1 first), columns the kinds that ran.
  struct LayerProfile {
    std::vector<std::string> kinds;
    std::vector<int> layers;
    std::vector<std::vector<double>> ms;  // [row][kind]
  };
  LayerProfile layerProfile();
  void resetLayerProfile();

 public:  // for ops.cpp
  struct Cuda;
  Cuda& cuda();
  void mark(OpKind kind);
  /// Grow-only device scratch of at least `bytes`, valid until the next call with `slot`.
  void* scratch(int slot, std::size_t bytes);
  double host_loss = 0.0;

 private:
  ExecSpace space_member;
  std::unique_ptr<Cuda> cuda_member;
  std::vector<View1<double>> scratch_member;
};

// ---- the dispatch points -------------------------------------------------------------------

/// \brief x (T, H; master type) = embedding rows of the ids, with ESM-2 token dropout.
void embedding(OpContext& ctx, const DeviceBatch& b, const Mat& weight, const Mat& x);
/// \brief dweight += the embedding gradient from dx (compute precision), except the padding row.
void embeddingBackward(OpContext& ctx, const DeviceBatch& b, const Mat& dx, const Mat& dweight);

/// \brief y = LayerNorm(x) per row (y in compute precision); saves mean and rstd.
void layerNorm(OpContext& ctx, const Mat& x, const Vec& gamma, const Vec& beta, double eps,
               const Mat& y, const Vec& mean, const Vec& rstd);
/// \brief Backward of layerNorm given dy; dgamma, dbeta +=.  With `dres` (the residual-stream
/// gradient, master type): dres = (accumulate ? dres : 0) + dL/dx and dx receives its compute
/// copy (dx may be dres itself).  Without: dx = dL/dx.
void layerNormBackward(OpContext& ctx, const Mat& x, const Vec& gamma, const Vec& mean,
                       const Vec& rstd, const Mat& dy, const Mat& dres, bool accumulate,
                       const Mat& dx, const Vec& dgamma, const Vec& dbeta);

/// \brief y = x W^T + b (W (out, in)).
void linear(OpContext& ctx, const Mat& x, const Mat& w, const Vec& b, const Mat& y);
/// \brief y = residual + x W^T + b (y and residual in the master type; y may be residual).
void linearResidual(OpContext& ctx, const Mat& x, const Mat& w, const Vec& b, const Mat& residual,
                    const Mat& y);
/// \brief pre = x W^T + b (+ add, (rows, out) in pre's type, when given), y = gelu(pre) (erf
/// form on the portable path, cuBLASLt's tanh form on the bf16 path: doc/gpu.md).
void linearGelu(OpContext& ctx, const Mat& x, const Mat& w, const Vec& b, const Mat& pre,
                const Mat& y, const Mat& add = Mat{});
/// \brief c = alpha op(a) op(b) + beta c, a plain GEMM on model tensors (LoRA adapters): bf16
/// a and b with a bf16 or fp32 c on the bf16 path (leading dimensions multiples of 8); one
/// element type and ld == cols on the portable path (model/gemm.hpp).
void matmul(OpContext& ctx, bool trans_a, bool trans_b, double alpha, const Mat& a, const Mat& b,
            double beta, const Mat& c);
/// \brief dx = (dx_accumulate ? dx : 0) + dy W (skipped when dx is empty); dw += dy^T x;
/// db += column sums of dy.
void linearBackward(OpContext& ctx, const Mat& x, const Mat& w, const Mat& dy, const Mat& dx,
                    bool dx_accumulate, const Mat& dw, const Vec& db);
/// \brief The backward of y = linear(gelu(pre)) to pre: dpre = (dy W) * gelu'(pre); dw += dy^T x;
/// db += column sums of dy (x = gelu(pre), kept from the forward).
void linearBackwardGelu(OpContext& ctx, const Mat& x, const Mat& w, const Mat& dy, const Mat& pre,
                        const Mat& dpre, const Mat& dw, const Vec& db);
/// \brief dx = dy * gelu'(pre) (dx may be dy).
void geluBackward(OpContext& ctx, const Mat& pre, const Mat& dy, const Mat& dx);
/// \brief SwiGLU: pre (R, 2F) holds [gate | up] per row, act (R, F) = silu(gate) * up.
void swigluForward(OpContext& ctx, const Mat& pre, const Mat& act);
/// \brief Its backward in one pass: dpre (R, 2F) = [dact up silu'(gate) | dact silu(gate)].
void swigluBackward(OpContext& ctx, const Mat& pre, const Mat& dact, const Mat& dpre);

/// \brief q, k, v = x Wq^T + bq, ... (one stacked GEMM under the fused layout).
void qkvProjection(OpContext& ctx, const Mat& x, const QkvWeights& w, const Qkv& out);
/// \brief dx = dq Wq + dk Wk + dv Wv (written); the six parameter gradients +=.
void qkvBackward(OpContext& ctx, const Mat& x, const QkvWeights& w, const Qkv& d, const Mat& dx,
                 const QkvGrads& g);

/// \brief Rotary embedding of q (also scaled by head_dim^-1/2, computed in the tensors' own
/// arithmetic) and k in place; `inverse` applies the transpose (backward).  cos/sin tables
/// (positions, head_dim / 2) serve the portable path.
void rotary(OpContext& ctx, const DeviceBatch& b, const Mat& q, const Mat& k, int heads,
            bool inverse, const Mat& cos_table, const Mat& sin_table);

/// \brief o = softmax(q k^T) v within each sequence, per head; lse (T, heads).
void attention(OpContext& ctx, const DeviceBatch& b, const Qkv& qkv, int heads, const Mat& o,
               const Mat& lse);
/// \brief dq, dk, dv (written) from dout; delta (T, heads) is scratch.
void attentionBackward(OpContext& ctx, const DeviceBatch& b, const Qkv& qkv, const Mat& o,
                       const Mat& lse, const Mat& dout, int heads, const Mat& delta,
                       const Qkv& dqkv);
/// \brief One bf16 attention call as the dispatch point runs it (CUDA build only): cuDNN or the
/// own flash attention (attentionKernelFor), the own flash attention when the keys have a layout
/// of their own (fp.cu_seqlens_k; cuDNN's graphs here take one layout).  Ring attention's blocks.
void bf16Attention(OpContext& ctx, const gpu::FlashParams& fp, bool backward);

/// \brief dst(r) = src(rows(r)).
/// `kind`: what its time counts as under profiling.
void gatherRows(OpContext& ctx, const Mat& src, const View1<std::int32_t>& rows, const Mat& dst,
                OpKind kind = OpKind::Other);
/// \brief dst = 0, then dst(rows(r)) = src(r) (rows distinct).
void scatterRows(OpContext& ctx, const Mat& src, const View1<std::int32_t>& rows, const Mat& dst);

/// \brief Adds the sum over rows of -log softmax(logits)[label] to the context's loss
/// accumulator; with dlogits, writes grad_scale * (softmax - onehot) there (may alias logits).
void crossEntropy(OpContext& ctx, const Mat& logits, const View1<std::int32_t>& labels,
                  double grad_scale, const Mat& dlogits);

/// \brief dst (master type, ld == cols) = src, any element type and row stride.
void copyToMaster(OpContext& ctx, const Mat& src, const Mat& dst);
/// \brief dst (compute precision, ld == cols) = src (master type, ld == cols): the inverse of
/// copyToMaster (rounds to bf16 under the bf16 policy).
void copyFromMaster(OpContext& ctx, const Mat& src, const Mat& dst);

}  // namespace plm::model
