// One ESM-2 encoder layer (pre-LN): x + Attention(LN1(x)), then + FFN(LN2(.)), written once over
// the dispatch points of ops.hpp, so it runs on every backend and precision.
//
// Accumulation rule: activations are written (=); parameter gradients accumulate (+=); the
// residual-stream gradient is one buffer updated in place: backward receives dL/d(layer output)
// in it and leaves dL/d(layer input) there.
// The FFN is a replaceable block (FfnBlock): DenseMlp is ESM-2's; a Mixture-of-Experts block
// takes its place without touching the layer or the orchestration.  Parameters are views into
// the model's flat buffers (compute-precision copy for the forward, master-type gradients).
// LoRA adapters (setLora, model/lora.hpp) add s (x A^T) B^T to a projection's output: q, k, v
// before rotary, the attention output into the residual stream, the FFN input before its GELU
// (linearGelu's added term) and the FFN output; their backward joins the same gradients.
#pragma once

#include "model/lora.hpp"
#include "model/ops.hpp"

#include <cstddef>
#include <memory>

namespace plm::model {

/// The tensors one layer keeps from forward for backward, (T, ...) each.  Under recomputation
/// some of them point into storage shared by all layers (see Recompute in ops.hpp).
struct LayerActs {
  Mat ln1;           // (T, H) LayerNorm 1 output, compute precision
  Vec mean1, rstd1;  // (T)
  Qkv qkv;           // (T, H) x3: q scaled and rotated, k rotated, v
  Mat o;             // (T, H) attention output before the output projection
  Mat lse;           // (T, heads) log-sum-exp of each score row
  Mat xmid;          // (T, H) residual stream after attention (master type)
  Mat ln2;           // (T, H) LayerNorm 2 output
  Vec mean2, rstd2;  // (T)
  Mat pre;           // (T, F) FFN pre-activation (DenseMlp)
  Mat act;           // (T, F) its GELU (DenseMlp)
};

/// Scratch shared by every layer's backward, (T, ...) each.
struct LayerScratch {
  Mat dres;    // (T, H) residual-stream gradient, master type
  Mat dres_c;  // (T, H) its compute-precision copy (dres itself on the portable path)
  Mat dln;     // (T, H) gradient into LayerNorm 1 (master type: the q/k/v input gradient)
  Mat dln_c;   // (T, H) gradient into LayerNorm 2 (compute precision)
  Mat dout;    // (T, H) gradient of the attention output
  Qkv dqkv;    // (T, H) x3
  Mat delta;   // (T, heads)
  Mat dffn;    // (T, F) FFN pre-activation gradient
};

struct AttentionWeights {
  Vec ln_g, ln_b;  // LayerNorm 1 (master type)
  QkvWeights qkv;
  Mat wo;  // (H, H)
  Vec bo;  // (H), in the output projection's result type (master)
};

struct AttentionGrads {
  Vec ln_g, ln_b;
  QkvGrads qkv;
  Mat wo;
  Vec bo;
};

struct LayerNormParams {
  Vec gamma, beta;  // (H), master type
};

struct DenseMlpWeights {
  Mat w1;  // (F, H)
  Vec b1;  // (F), compute precision
  Mat w2;  // (H, F)
  Vec b2;  // (H), master type
};

using DenseMlpGrads = DenseMlpWeights;

/// Moves parameter handles: a handle whose data lies in [from, from + bytes) is re-pointed at
/// the same place relative to `to`; any other handle is left alone.  Sharded data parallelism
/// (train/fsdp.hpp) re-points a layer's views at the buffer its all-gather filled.
struct Relocation {
  const char* from = nullptr;
  std::size_t bytes = 0;
  char* to = nullptr;
  void operator()(Mat& m) const { move(m.data); }
  void operator()(Vec& v) const { move(v.data); }
  void operator()(QkvWeights& q) const;
  void operator()(QkvGrads& q) const;
  void operator()(DenseMlpWeights& w) const;
  void operator()(LayerLora& l) const;

 private:
  void move(void*& data) const {
    const char* p = static_cast<const char*>(data);
    if (p != nullptr && p >= from && p < from + bytes) data = to + (p - from);
  }
};

/// \brief The FFN slot of a layer: out = residual + FFN(h), h = LN2 output.
class FfnBlock {
 public:
  virtual ~FfnBlock() = default;
  /// \brief Applies `r` to every parameter and gradient handle of the block.
  virtual void relocate(const Relocation& r) = 0;
  virtual void forward(OpContext& ctx, const Mat& h, const Mat& residual, const Mat& out,
                       LayerActs& saved) const = 0;
  /// \brief dh (written) from dout_c, the compute copy of dL/d(out); parameter gradients +=.
  virtual void backward(OpContext& ctx, const LayerActs& saved, const Mat& dout_c, const Mat& dh,
                        LayerScratch& scratch) const = 0;
  /// \brief The layer's LoRA adapters; a block without adapter support refuses active FFN ones.
  virtual void setLora(const LayerLora& lora);
};

/// ESM-2's FFN: W2 gelu(W1 h + b1) + b2.
class DenseMlp : public FfnBlock {
 public:
  DenseMlp(const DenseMlpWeights& weights, const DenseMlpGrads& grads)
      : w_member(weights), g_member(grads) {}
  void forward(OpContext& ctx, const Mat& h, const Mat& residual, const Mat& out,
               LayerActs& saved) const override;
  void backward(OpContext& ctx, const LayerActs& saved, const Mat& dout_c, const Mat& dh,
                LayerScratch& scratch) const override;
  void relocate(const Relocation& r) override;
  void setLora(const LayerLora& lora) override { lora_member = lora; }

 private:
  DenseMlpWeights w_member;
  DenseMlpGrads g_member;
  LayerLora lora_member;  // ffn_in, ffn_out adapters when active
};

struct LayerShape {
  int heads = 0;
  double eps = 1e-5;
};

/// \brief One encoder layer.  forward(in -> out) saves what backward needs in `saved`;
/// recomputeSelective() refills what Recompute::Selective drops (the layer mode reruns
/// forward); backward() turns scratch.dres from dL/d(out) into dL/d(in) and accumulates the
/// parameter gradients.
class EncoderLayer {
 public:
  EncoderLayer(const LayerShape& shape, const AttentionWeights& attention,
               const AttentionGrads& attention_grads, const LayerNormParams& ln2,
               const LayerNormParams& ln2_grads, std::unique_ptr<FfnBlock> ffn);

  void forward(OpContext& ctx, const DeviceBatch& b, const Mat& in, const Mat& out,
               LayerActs& saved, const Mat& cos_table, const Mat& sin_table) const;
  void recomputeSelective(OpContext& ctx, const DeviceBatch& b, const Mat& in,
                          LayerActs& saved) const;
  void backward(OpContext& ctx, const DeviceBatch& b, const Mat& in, const LayerActs& saved,
                LayerScratch& scratch, const Mat& cos_table, const Mat& sin_table) const;
  /// \brief Applies `r` to every parameter and gradient handle of the layer (FFN block too).
  void relocate(const Relocation& r);
  /// \brief LoRA adapters on the layer's projections (model/lora.hpp); none by default.
  void setLora(const LayerLora& lora);

 private:
  LayerShape shape_member;
  AttentionWeights attn_member;
  AttentionGrads attn_grads_member;
  LayerNormParams ln2_member;  // LayerNorm 2 before the FFN block
  LayerNormParams ln2_grads_member;
  std::unique_ptr<FfnBlock> ffn_member;
  LayerLora lora_member;
};

}  // namespace plm::model
