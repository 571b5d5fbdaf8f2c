// plm::gpu::Esm2Bf16's view of plm::model::Esm2: the shape and the offset of every named
// tensor in the flat parameter buffer, read from the model's tensor table (header only, so
// plm_gpu needs no link dependency on plm_model).
#pragma once

#include "gpu/esm2_step.hpp"
#include "model/esm2.hpp"

#include <string>

namespace plm::gpu {

inline Esm2Shape esm2Shape(const model::Esm2Config& c) {
  Esm2Shape s;
  s.layers = c.num_layers;
  s.hidden = c.hidden;
  s.heads = c.heads;
  s.ffn = c.ffn;
  s.vocab = c.vocab;
  s.eps = static_cast<float>(c.layer_norm_eps);
  s.token_dropout = c.token_dropout;
  return s;
}

template <class Model> Esm2Offsets esm2Offsets(const Model& model) {
  auto at = [&](const std::string& name) { return model.tensor(name).offset; };
  Esm2Offsets o;
  o.embed = at("esm.embeddings.word_embeddings.weight");
  for (int l = 0; l < model.config().num_layers; ++l) {
    const std::string p = "esm.encoder.layer." + std::to_string(l) + ".";
    Esm2Offsets::Layer L{};
    L.wq = at(p + "attention.self.query.weight");
    L.bq = at(p + "attention.self.query.bias");
    L.wk = at(p + "attention.self.key.weight");
    L.bk = at(p + "attention.self.key.bias");
    L.wv = at(p + "attention.self.value.weight");
    L.bv = at(p + "attention.self.value.bias");
    L.wo = at(p + "attention.output.dense.weight");
    L.bo = at(p + "attention.output.dense.bias");
    L.ln1_g = at(p + "attention.LayerNorm.weight");
    L.ln1_b = at(p + "attention.LayerNorm.bias");
    L.w1 = at(p + "intermediate.dense.weight");
    L.b1 = at(p + "intermediate.dense.bias");
    L.w2 = at(p + "output.dense.weight");
    L.b2 = at(p + "output.dense.bias");
    L.ln2_g = at(p + "LayerNorm.weight");
    L.ln2_b = at(p + "LayerNorm.bias");
    o.layers.push_back(L);
  }
  o.lnf_g = at("esm.encoder.emb_layer_norm_after.weight");
  o.lnf_b = at("esm.encoder.emb_layer_norm_after.bias");
  o.head_w = at("lm_head.dense.weight");
  o.head_b = at("lm_head.dense.bias");
  o.head_ln_g = at("lm_head.layer_norm.weight");
  o.head_ln_b = at("lm_head.layer_norm.bias");
  o.head_bias = at("lm_head.bias");
  return o;
}

/// \brief The arrays of a packed micro-batch, for Esm2Bf16::forwardBackward.
inline HostBatch hostBatch(const data::MicroBatch& b) {
  HostBatch h;
  h.tokens = b.tokens.data();
  h.labels = b.labels.data();
  h.cu_seqlens = b.cu_seqlens.data();
  h.num_tokens = b.numTokens();
  h.num_seqs = b.numSequences();
  h.max_seqlen = b.max_seqlen;
  return h;
}

}  // namespace plm::gpu
