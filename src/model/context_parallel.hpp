// Ring attention: the attention of a context-parallel shard (data/context_split.hpp) over the C
// ranks of a context group, at the attention dispatch point (ops.hpp's attention and
// attentionBackward call it when the batch carries a ring).
//
// Design choice (doc/parallelism.md, "Context parallelism"): the K/V shards travel around the
// ring, the queries stay.  Forward: at step i (0..C-1) rank r holds the K/V shard of rank
// j = (r - i) mod C, posts the non-blocking send of it to r+1 and the receive of the next one
// from r-1, runs the portable varlen attention of its queries against that block (queries of
// sequence s against rank j's keys of sequence s: the two cu_seqlens keep every pair inside
// its sequence) and merges the block's output into the running one with the log-sum-exp rule
//     lse = log(e^lse_a + e^lse_b),  o = e^(lse_a - lse) o_a + e^(lse_b - lse) o_b,
// then waits for the exchange.  Backward: with the final o and lse, each block pair's gradient
// is exact on its own (P = exp(S - lse), D = rowsum(dO o)), so dQ sums the C blocks locally, and
// dK/dV of a shard accumulate as that shard travels: the partial sums follow the K/V one step
// behind and arrive home after C steps.  The K/V exchange of the next step and the dK/dV
// exchange of the last overlap the block's computation.
//
// Precision: fp32/fp64 run the portable varlen attention per block (the reference); bf16 on the
// CUDA build runs the CUDA attention kernels per block (the diagonal block through the dispatch
// point's choice, cuDNN or the own flash attention; the others through the own flash attention
// with the key shard's cu_seqlens), K/V travel as bf16, and the merged output, dQ and the
// travelling dK/dV partial sums are kept in fp32 (gpu/ring_attention.hpp), rounded to bf16 once.
//
// Accumulation rule: o, lse, dq, dk, dv are written (=), as by the one-rank attention.
#pragma once

#include "model/ops.hpp"

#include <memory>
#include <vector>

namespace plm::dist {
class Communicator;
}

namespace plm::model {

class RingAttention {
 public:
  /// \brief A ring over the ranks of `comm` (not owned), in rank order.
  explicit RingAttention(dist::Communicator& comm);
  ~RingAttention();
  RingAttention(const RingAttention&) = delete;
  RingAttention& operator=(const RingAttention&) = delete;

  int degree() const;
  int rank() const;

  /// \brief The shard layout of the passes that follow: `rank_cu_seqlens` is (C, n+1)
  /// row-major, the cu_seqlens of every rank's shard (ContextShard::rank_cu_seqlens).
  void setLayout(const ExecSpace& space, const std::vector<seqlen_t>& rank_cu_seqlens,
                 int num_seqs);

  /// \brief o, lse of this rank's queries against every rank's keys (collective over the ring).
  void forward(OpContext& ctx, const Qkv& qkv, int heads, const Mat& o, const Mat& lse);
  /// \brief dq, dk, dv of this rank's shard from dout (collective over the ring); delta is
  /// scratch (T, heads).
  void backward(OpContext& ctx, const Qkv& qkv, const Mat& o, const Mat& lse, const Mat& dout,
                int heads, const Mat& delta, const Qkv& dqkv);

  struct Impl;  // public only for nvcc's extended lambdas; defined in context_parallel.cpp

 private:
  std::unique_ptr<Impl> impl_member;
};

}  // namespace plm::model
