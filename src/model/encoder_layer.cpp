// EncoderLayer and DenseMlp (see encoder_layer.hpp for the accumulation rule).
#include "model/encoder_layer.hpp"

#include "core/error.hpp"
#include "core/trace.hpp"

namespace plm::model {

void DenseMlp::forward(OpContext& ctx, const Mat& h, const Mat& residual, const Mat& out,
                       LayerActs& saved) const {
  {
    PLM_TRACE("plm::gemm ffn_in fwd (+gelu)");
    linearGelu(ctx, h, w_member.w1, w_member.b1, saved.pre, saved.act);
  }
  PLM_TRACE("plm::gemm ffn_out fwd");
  linearResidual(ctx, saved.act, w_member.w2, w_member.b2, residual, out);
}

void DenseMlp::backward(OpContext& ctx, const LayerActs& saved, const Mat& dout_c, const Mat& dh,
                        LayerScratch& scratch) const {
  {
    PLM_TRACE("plm::gemm ffn_out bwd (+dgelu)");
    linearBackwardGelu(ctx, saved.act, w_member.w2, dout_c, saved.pre, scratch.dffn, g_member.w2,
                       g_member.b2);
  }
  PLM_TRACE("plm::gemm ffn_in bwd");
  linearBackward(ctx, saved.ln2, w_member.w1, scratch.dffn, dh, false, g_member.w1, g_member.b1);
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

void DenseMlp::relocate(const Relocation& r) {
  r(w_member);
  r(g_member);
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
  ffn_member->relocate(r);
}

void EncoderLayer::forward(OpContext& ctx, const DeviceBatch& b, const Mat& in, const Mat& out,
                           LayerActs& a, const Mat& cos_table, const Mat& sin_table) const {
  const auto& w = attn_member;
  layerNorm(ctx, in, w.ln_g, w.ln_b, shape_member.eps, a.ln1, a.mean1, a.rstd1);
  {
    PLM_TRACE("plm::gemm qkv fwd");
    qkvProjection(ctx, a.ln1, w.qkv, a.qkv);
  }
  {
    PLM_TRACE("plm::rotary");
    rotary(ctx, b, a.qkv.q, a.qkv.k, shape_member.heads, false, cos_table, sin_table);
  }
  attention(ctx, b, a.qkv, shape_member.heads, a.o, a.lse);
  {
    PLM_TRACE("plm::gemm attn_out fwd");
    linearResidual(ctx, a.o, w.wo, w.bo, in, a.xmid);
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
  }
  attentionBackward(ctx, b, a.qkv, a.o, a.lse, s.dout, shape_member.heads, s.delta, s.dqkv);
  {
    PLM_TRACE("plm::rotary bwd");
    rotary(ctx, b, s.dqkv.q, s.dqkv.k, shape_member.heads, true, cos_table, sin_table);
  }
  {
    PLM_TRACE("plm::gemm qkv bwd");
    qkvBackward(ctx, a.ln1, w.qkv, s.dqkv, s.dln, g.qkv);
  }
  layerNormBackward(ctx, in, w.ln_g, a.mean1, a.rstd1, s.dln, s.dres, true, s.dres_c, g.ln_g,
                    g.ln_b);
}

}  // namespace plm::model
