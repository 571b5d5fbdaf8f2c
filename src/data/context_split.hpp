// The context-parallel split of a packed micro-batch: C ranks share every micro-batch, each
// holding a shard of every sequence (doc/parallelism.md, "Context parallelism").
//
// Design choice: each sequence of length L is cut into 2C chunks, chunk k being the tokens
// [floor(k L / 2C), floor((k+1) L / 2C)); rank r holds chunks r and 2C-1-r, in that order, so a
// shard is a sub-sequence of every sequence (possibly empty: a sequence shorter than 2C leaves
// some chunks empty).  Attention is bidirectional, so a rank's queries of sequence s need every
// key of s: the shard keeps one cu_seqlens entry per sequence (zero-length allowed), and ring
// attention pairs a rank's shard of s with every other rank's shard of s, never another
// sequence.  The shard also carries what the model cannot recompute from its own tokens: the
// global position of each token (rotary), and each whole sequence's length and <mask> count
// (ESM-2's token-dropout scale is per sequence).  Labels stay with their tokens, so the MLM
// loss of a shard is a partial sum and the sum over the context group is the 1-rank loss.
#pragma once

#include "data/batch.hpp"

#include <cstdint>
#include <utility>
#include <vector>

namespace plm::data {

/// What a context-parallel shard of a micro-batch knows beyond its own tokens.
struct ContextShard {
  int degree = 1;                         // C, the ranks sharing the micro-batch
  int rank = 0;                           // this shard's rank in the context group
  std::int32_t max_seqlen = 0;            // longest whole sequence (rotary table size)
  std::vector<seqlen_t> rank_cu_seqlens;  // (C, n+1) row-major: every rank's shard cu_seqlens
  std::vector<seqlen_t> positions;        // (T_local) position of each token in its sequence
  std::vector<std::int32_t> seq_length;   // (n) whole-sequence lengths
  std::vector<std::int32_t> seq_masked;   // (n) <mask> tokens of each whole sequence
  std::int64_t labelled = 0;              // labelled tokens of the whole micro-batch

  int numSequences() const { return static_cast<int>(seq_length.size()); }
  /// \brief [begin, end) of rank `r`'s shard of sequence `s` in that rank's token stream.
  std::pair<seqlen_t, seqlen_t> shardOf(int r, int s) const {
    const std::size_t row = static_cast<std::size_t>(r) * (seq_length.size() + 1);
    return {rank_cu_seqlens[row + s], rank_cu_seqlens[row + s + 1]};
  }
};

/// \brief [begin, end) of chunk `k` of `chunks` of a sequence of `length` tokens.
inline std::pair<std::int64_t, std::int64_t> contextChunk(std::int64_t length, int chunks, int k) {
  return {k * length / chunks, (k + 1) * length / chunks};
}

/// \brief Rank `rank`'s shard of `full` for context degree `degree` (>= 1): chunks rank and
/// 2 degree - 1 - rank of every sequence, with labels, a cu_seqlens entry per sequence
/// (zero-length allowed), num_masked counting the shard's labels, and `context` set.  An empty
/// micro-batch (no tokens) is returned as it is.
MicroBatch contextShard(const MicroBatch& full, int degree, int rank);

/// \brief contextShard of every micro-batch.
std::vector<MicroBatch> contextShards(const std::vector<MicroBatch>& full, int degree, int rank);

}  // namespace plm::data
