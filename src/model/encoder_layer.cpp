// EncoderLayer and DenseMlp (see encoder_layer.hpp for the accumulation rule).
#include "model/encoder_layer.hpp"

#include "core/error.hpp"
#include "core/trace.hpp"

namespace plm::model {

namespace {

// Context scratch slots of the FFN adapters' (T, F) terms (lora.cpp uses 48 and 49).
constexpr int scratch_ffn_add = 50, scratch_ffn_dact = 51;

Mat scratchLike(OpContext& ctx, int slot, const Mat& like) {
  return Mat{
      ctx.scratch(slot, static_cast<std::size_t>(like.rows * like.cols) * sizeOf(like.dtype)),
      like.dtype, like.rows, like.cols, like.cols};
}

}  // namespace

void FfnBlock::setLora(const LayerLora& lora) {
  if (lora.ffn_in.active() || lora.ffn_out.active())
    throw collectiveError(
        "lora.targets: ffn_in/ffn_out adapters are not implemented for this FFN block "
        "(Mixture-of-Experts layers); use attention targets (q,k,v,o)");
}

void DenseMlp::forward(OpContext& ctx, const Mat& h, const Mat& residual, const Mat& out,
                       LayerActs& saved) const {
  const auto& lo = lora_member;
  {
    PLM_TRACE("plm::gemm ffn_in fwd (+gelu)");
    Mat add;  // the adapter's term enters before the GELU
    if (lo.ffn_in.active()) {
      add = scratchLike(ctx, scratch_ffn_add, saved.pre);
      loraForward(ctx, lo.ffn_in, lo.scale, h, add, false);
    }
    linearGelu(ctx, h, w_member.w1, w_member.b1, saved.pre, saved.act, add);
  }
  PLM_TRACE("plm::gemm ffn_out fwd");
  linearResidual(ctx, saved.act, w_member.w2, w_member.b2, residual, out);
  if (lo.ffn_out.active()) loraForward(ctx, lo.ffn_out, lo.scale, saved.act, out);
}

void DenseMlp::backward(OpContext& ctx, const LayerActs& saved, const Mat& dout_c, const Mat& dh,
                        LayerScratch& scratch) const {
  const auto& lo = lora_member;
  if (lo.ffn_out.active()) {
    // The adapter's input gradient joins before dGELU, so the fused epilogue is split.
    PLM_TRACE("plm::gemm ffn_out bwd (lora)");
    const Mat dact = scratchLike(ctx, scratch_ffn_dact, saved.act);
    linearBackward(ctx, saved.act, w_member.w2, dout_c, dact, false, g_member.w2, g_member.b2);
    loraBackward(ctx, lo.ffn_out, lo.scale, saved.act, dout_c, dact);
    geluBackward(ctx, saved.pre, dact, scratch.dffn);
  } else {
    PLM_TRACE("plm::gemm ffn_out bwd (+dgelu)");
    linearBackwardGelu(ctx, saved.act, w_member.w2, dout_c, saved.pre, scratch.dffn, g_member.w2,
                       g_member.b2);
  }
  PLM_TRACE("plm::gemm ffn_in bwd");
  linearBackward(ctx, saved.ln2, w_member.w1, scratch.dffn, dh, false, g_member.w1, g_member.b1);
  if (lo.ffn_in.active()) loraBackward(ctx, lo.ffn_in, lo.scale, saved.ln2, scratch.dffn, dh);
}

void Relocation::operator()(QkvWeights& q) const {
  for (Mat* m : {&q.wq, &q.wk, &q.wv, &q.fused_w}) (*this)(*m);
  for (Vec* v : {&q.bq, &q.bk, &q.bv, &q.fused_b}) (*this)(*v);
}

void Relocation::operator()(QkvGrads& q) const {
  for (Mat* m : {&q.wq, &q.wk, &q.wv}) (*this)(*m);
  for (Vec* v : {&q.bq, &q.bk, &q.bv}) (*this)(*v);
}

void Relocation::operator()(DenseMlpWeights& w) const {
  (*this)(w.w1);
  (*this)(w.b1);
  (*this)(w.w2);
  (*this)(w.b2);
}

void Relocation::operator()(LayerLora& l) const {
  for (LoraAdapter* ad : l.adapters())
    for (Mat* m : {&ad->a, &ad->b, &ad->ga, &ad->gb}) (*this)(*m);
}

void DenseMlp::relocate(const Relocation& r) {
  r(w_member);
  r(g_member);
  r(lora_member);
}

EncoderLayer::EncoderLayer(const LayerShape& shape, const AttentionWeights& attention,
                           const AttentionGrads& attention_grads, const LayerNormParams& ln2,
                           const LayerNormParams& ln2_grads, std::unique_ptr<FfnBlock> ffn)
    : shape_member(shape),
      attn_member(attention),
      attn_grads_member(attention_grads),
      ln2_member(ln2),
      ln2_grads_member(ln2_grads),
      ffn_member(std::move(ffn)) {
  if (!ffn_member) throw Error("plm::model::EncoderLayer: no FFN block (a bug)");
}

void EncoderLayer::relocate(const Relocation& r) {
  auto& w = attn_member;
  auto& g = attn_grads_member;
  for (Vec* v : {&w.ln_g, &w.ln_b, &w.bo, &g.ln_g, &g.ln_b, &g.bo, &ln2_member.gamma,
                 &ln2_member.beta, &ln2_grads_member.gamma, &ln2_grads_member.beta})
    r(*v);
  r(w.wo);
  r(g.wo);
  r(w.qkv);
  r(g.qkv);
  r(lora_member);
  ffn_member->relocate(r);
}

void EncoderLayer::setLora(const LayerLora& lora) {
  lora_member = lora;
  ffn_member->setLora(lora);
}

void EncoderLayer::forward(OpContext& ctx, const DeviceBatch& b, const Mat& in, const Mat& out,
                           LayerActs& a, const Mat& cos_table, const Mat& sin_table) const {
  const auto& w = attn_member;
  layerNorm(ctx, in, w.ln_g, w.ln_b, shape_member.eps, a.ln1, a.mean1, a.rstd1);
  {
    PLM_TRACE("plm::gemm qkv fwd");
    qkvProjection(ctx, a.ln1, w.qkv, a.qkv);
    const auto& lo = lora_member;
    if (lo.q.active()) loraForward(ctx, lo.q, lo.scale, a.ln1, a.qkv.q);
    if (lo.k.active()) loraForward(ctx, lo.k, lo.scale, a.ln1, a.qkv.k);
    if (lo.v.active()) loraForward(ctx, lo.v, lo.scale, a.ln1, a.qkv.v);
  }
  {
    PLM_TRACE("plm::rotary");
    rotary(ctx, b, a.qkv.q, a.qkv.k, shape_member.heads, false, cos_table, sin_table);
  }
  attention(ctx, b, a.qkv, shape_member.heads, a.o, a.lse);
  {
    PLM_TRACE("plm::gemm attn_out fwd");
    linearResidual(ctx, a.o, w.wo, w.bo, in, a.xmid);
    if (lora_member.o.active()) loraForward(ctx, lora_member.o, lora_member.scale, a.o, a.xmid);
  }
  layerNorm(ctx, a.xmid, ln2_member.gamma, ln2_member.beta, shape_member.eps, a.ln2, a.mean2,
            a.rstd2);
  PLM_TRACE("plm::ffn fwd");
  ffn_member->forward(ctx, a.ln2, a.xmid, out, a);
}

void EncoderLayer::recomputeSelective(OpContext& ctx, const DeviceBatch& b, const Mat& in,
                                      LayerActs& a) const {
  // The GEMM outputs (q/k/v after rotary, xmid, pre, act) were kept; LayerNorm outputs and the
  // attention are recomputed from them.  Every kernel is deterministic, so the result is bitwise
  // what the forward produced.
  const auto& w = attn_member;
  layerNorm(ctx, in, w.ln_g, w.ln_b, shape_member.eps, a.ln1, a.mean1, a.rstd1);
  attention(ctx, b, a.qkv, shape_member.heads, a.o, a.lse);
  layerNorm(ctx, a.xmid, ln2_member.gamma, ln2_member.beta, shape_member.eps, a.ln2, a.mean2,
            a.rstd2);
}

void EncoderLayer::backward(OpContext& ctx, const DeviceBatch& b, const Mat& in, const LayerActs& a,
                            LayerScratch& s, const Mat& cos_table, const Mat& sin_table) const {
  const auto& w = attn_member;
  const auto& g = attn_grads_member;
  {
    PLM_TRACE("plm::ffn bwd");
    ffn_member->backward(ctx, a, s.dres_c, s.dln_c, s);
  }
  layerNormBackward(ctx, a.xmid, ln2_member.gamma, a.mean2, a.rstd2, s.dln_c, s.dres, true,
                    s.dres_c, ln2_grads_member.gamma, ln2_grads_member.beta);
  {
    PLM_TRACE("plm::gemm attn_out bwd");
    linearBackward(ctx, a.o, w.wo, s.dres_c, s.dout, false, g.wo, g.bo);
    if (lora_member.o.active())
      loraBackward(ctx, lora_member.o, lora_member.scale, a.o, s.dres_c, s.dout);
  }
  attentionBackward(ctx, b, a.qkv, a.o, a.lse, s.dout, shape_member.heads, s.delta, s.dqkv);
  {
    PLM_TRACE("plm::rotary bwd");
    rotary(ctx, b, s.dqkv.q, s.dqkv.k, shape_member.heads, true, cos_table, sin_table);
  }
  {
    PLM_TRACE("plm::gemm qkv bwd");
    qkvBackward(ctx, a.ln1, w.qkv, s.dqkv, s.dln, g.qkv);
    const auto& lo = lora_member;
    if (lo.q.active()) loraBackward(ctx, lo.q, lo.scale, a.ln1, s.dqkv.q, s.dln);
    if (lo.k.active()) loraBackward(ctx, lo.k, lo.scale, a.ln1, s.dqkv.k, s.dln);
    if (lo.v.active()) loraBackward(ctx, lo.v, lo.scale, a.ln1, s.dqkv.v, s.dln);
  }
  layerNormBackward(ctx, in, w.ln_g, a.mean1, a.rstd1, s.dln, s.dres, true, s.dres_c, g.ln_g,
                    g.ln_b);
}

}  // namespace plm::model
