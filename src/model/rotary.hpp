// Rotary position embedding, rotate-half (NeoX) layout, as Hugging Face ESM applies it.
//
// For each head (columns [h*d, (h+1)*d) of a (T, H) view) and i < d/2, with angle
// theta = pos * inv_freq[i], inv_freq[i] = 1 / 10000^(2i/d):
//   out[i]       = x[i] cos - x[i + d/2] sin
//   out[i + d/2] = x[i + d/2] cos + x[i] sin
// Positions restart at 0 for every packed sequence.  ESM-2 multiplies q by head_dim^-0.5 BEFORE
// the rotation; `scale` folds that in.
// Accumulation rule: both directions transform in place (=).
#pragma once

#include "core/types.hpp"

namespace plm::model {

/// \brief cos/sin tables (positions, head_dim/2), computed in T the way PyTorch does in fp32
/// (inv_freq, then positions * inv_freq, then cos and sin).
template <class T> void rotaryTables(const ExecSpace& space, int head_dim,
                                     const View2<T>& cos_table, const View2<T>& sin_table);

/// \brief x = rotate(scale * x) per head; x (T, heads*head_dim), position (T).
template <class T>
void rotaryForward(const ExecSpace& space, const View2<T>& x, const View1<seqlen_t>& position,
                   int heads, const View2<T>& cos_table, const View2<T>& sin_table, T scale);

/// \brief dx = scale * rotate^T(dx) per head (the transpose rotates by -theta).
template <class T>
void rotaryBackward(const ExecSpace& space, const View2<T>& dx, const View1<seqlen_t>& position,
                    int heads, const View2<T>& cos_table, const View2<T>& sin_table, T scale);

}  // namespace plm::model
