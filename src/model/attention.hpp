// Multi-head self-attention over packed (THD) sequences, flash-attention style.
//
// q, k, v, out are (T, heads*head_dim) with head h in columns [h*d, (h+1)*d); q arrives already
// scaled by head_dim^-0.5 and rotated, so scores are plain q.k.  A token attends to every token
// of its own sequence [cu_seqlens[s], cu_seqlens[s+1]) and nothing else (ESM-2 is bidirectional).
//
// Forward: tiles of queries x keys inside each sequence with a running max and sum (online
// softmax); nothing of size T x T or S x S exists.  It saves lse = logsumexp of each (token, head)
// score row.  Backward recomputes probabilities per tile from lse, with D = rowsum(dO * O), in
// two deterministic passes: one over key tiles (dK, dV), one over query tiles (dQ), so no atomics
// and results independent of the thread count (one more recomputation of q.k than FA-2).
//
// Accumulation rule: out, lse, dq, dk, dv are written (=).
#pragma once

#include "core/types.hpp"

namespace plm::model {

/// Tile sizes (queries, keys); 64 x 128 measured fastest on the CPU.  Tests use tiny tiles to
/// cross tile boundaries.
struct AttentionTiles {
  int queries = 64;
  int keys = 128;
};

/// \brief out = softmax(q k^T) v per sequence and head; lse (T, heads).
/// cu_seqlens is (n+1) on the device.  workspace: at least T*H elements (a head-transposed copy
/// of k); allocated here when smaller.
template <class T>
void attentionForward(const ExecSpace& space, const View2<T>& q, const View2<T>& k,
                      const View2<T>& v, const View1<seqlen_t>& cu_seqlens, int heads,
                      const View2<T>& out, const View2<T>& lse, AttentionTiles tiles = {},
                      const View1<T>& workspace = View1<T>());

/// \brief dq, dk, dv from dout; delta (T, heads) is workspace (it receives rowsum(dO * O)), as is
/// `workspace` (at least 2*T*H elements, head-transposed q and dout; allocated here when smaller).
template <class T>
void attentionBackward(const ExecSpace& space, const View2<T>& q, const View2<T>& k,
                       const View2<T>& v, const View2<T>& out, const View2<T>& lse,
                       const View2<T>& dout, const View1<seqlen_t>& cu_seqlens, int heads,
                       const View2<T>& delta, const View2<T>& dq, const View2<T>& dk,
                       const View2<T>& dv, AttentionTiles tiles = {},
                       const View1<T>& workspace = View1<T>());

/// \brief The same over two token sets: query i of sequence s attends to the keys
/// [cu_seqlens_k[s], cu_seqlens_k[s+1]) of k and v (rows may differ from q's), as a block pair
/// of ring attention (model/context_parallel.hpp) needs.  A query whose sequence has no key
/// gets out = 0 and lse = -inf (neutral in the log-sum-exp merge).  workspace: k.size().
template <class T>
void attentionForward(const ExecSpace& space, const View2<T>& q, const View2<T>& k,
                      const View2<T>& v, const View1<seqlen_t>& cu_seqlens_q,
                      const View1<seqlen_t>& cu_seqlens_k, int heads, const View2<T>& out,
                      const View2<T>& lse, AttentionTiles tiles = {},
                      const View1<T>& workspace = View1<T>());

/// \brief Backward of one block pair given the final out and lse of the queries (merged over
/// every key block): dq from these keys only, dk and dv of these keys from these queries only
/// (all written).  workspace: 2 * q.size().
template <class T>
void attentionBackward(const ExecSpace& space, const View2<T>& q, const View2<T>& k,
                       const View2<T>& v, const View2<T>& out, const View2<T>& lse,
                       const View2<T>& dout, const View1<seqlen_t>& cu_seqlens_q,
                       const View1<seqlen_t>& cu_seqlens_k, int heads, const View2<T>& delta,
                       const View2<T>& dq, const View2<T>& dk, const View2<T>& dv,
                       AttentionTiles tiles = {}, const View1<T>& workspace = View1<T>());

/// \brief Plain reference: materialises each sequence's score matrix.  Tests only.
template <class T> void attentionReferenceForward(const ExecSpace& space, const View2<T>& q,
                                                  const View2<T>& k, const View2<T>& v,
                                                  const View1<seqlen_t>& cu_seqlens, int heads,
                                                  const View2<T>& out, const View2<T>& lse);

/// \brief Plain reference backward (D computed as sum_j P dP, not from O).  Tests only.
template <class T>
void attentionReferenceBackward(const ExecSpace& space, const View2<T>& q, const View2<T>& k,
                                const View2<T>& v, const View2<T>& dout,
                                const View1<seqlen_t>& cu_seqlens, int heads, const View2<T>& dq,
                                const View2<T>& dk, const View2<T>& dv);

}  // namespace plm::model
