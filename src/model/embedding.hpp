// Word embedding with ESM-2 token dropout, over packed (THD) sequences.
//
// x[t] = E[token[t]] * mult[t], where mult[t] = 0 at <mask> and otherwise
// (1 - 0.15*0.8) / (1 - n_mask(s) / len(s)) for t's sequence s (Hugging Face's token dropout,
// applied in training and evaluation alike; THD has no padding, so len(s) counts every token of
// the sequence, specials included).  With token dropout off, mult = 1.
// Accumulation rule: x, position and mult are written (=); the embedding gradient accumulates
// (+=), except the padding row, which receives no gradient (PyTorch's padding_idx).
#pragma once

#include "core/types.hpp"

namespace plm::model {

/// \brief Per-token position inside its sequence (rotary restarts at 0) and token-dropout
/// multiplier.  cu_seqlens (n+1), tokens (T), position (T), mult (T).
template <class T> void sequenceInfo(const ExecSpace& space, const View1<seqlen_t>& cu_seqlens,
                                     const View1<token_t>& tokens, bool token_dropout,
                                     int mask_token, const View1<seqlen_t>& position,
                                     const View1<T>& mult);

/// \brief x (T, H) = weight(token) * mult.
template <class T> void embeddingForward(const ExecSpace& space, const View1<token_t>& tokens,
                                         const View1<T>& mult, const View2<T>& weight,
                                         const View2<T>& x);

/// \brief dweight(v) += sum over tokens t == v of mult[t] * dx[t], for every v but padding_idx.
template <class T> void embeddingBackward(const ExecSpace& space, const View1<token_t>& tokens,
                                          const View1<T>& mult, const View2<T>& dx, int padding_idx,
                                          const View2<T>& dweight);

}  // namespace plm::model
