// The context-parallel split (data/context_split.hpp): for C = 1..4 and sequence lengths from 1
// (shorter than 2C: empty chunks) to 8,192, the C shards together hold every token exactly
// once with its label and global position, rank r holds chunks r and 2C-1-r in that order,
// every rank's shard layout agrees with the shard it describes, per-rank token counts differ
// by at most 2 per sequence, the masked counts add up, and the whole-sequence statistics
// (length, <mask> count) are carried.
#include "../model/model_test_util.hpp"
#include "core/error.hpp"
#include "data/context_split.hpp"

#include <gtest/gtest.h>

#include <vector>

namespace {

using plm::data::contextChunk;
using plm::data::contextShard;
using plm::data::MicroBatch;

TEST(ContextSplit, ShardsCoverEveryTokenOnceWithGlobalPositions) {
  const std::vector<int> lengths = {1, 2, 3, 4, 5, 7, 8, 9, 16, 33, 8192, 6};
  const MicroBatch full = plm::model::test::makeBatch(lengths, 17, 0.3);
  for (int c = 1; c <= 4; ++c) {
    std::vector<int> seen(full.numTokens(), 0);
    std::int64_t masked = 0, tokens = 0;
    for (int r = 0; r < c; ++r) {
      const MicroBatch s = contextShard(full, c, r);
      ASSERT_TRUE(s.context);
      const auto& sh = *s.context;
      ASSERT_EQ(sh.degree, c);
      ASSERT_EQ(sh.rank, r);
      ASSERT_EQ(s.numSequences(), full.numSequences());
      ASSERT_EQ(static_cast<std::int64_t>(sh.positions.size()), s.numTokens());
      EXPECT_EQ(sh.max_seqlen, 8192);
      masked += s.num_masked;
      tokens += s.numTokens();
      for (int q = 0; q < full.numSequences(); ++q) {
        const int len = full.cu_seqlens(q + 1) - full.cu_seqlens(q);
        EXPECT_EQ(sh.seq_length[q], len);
        int mask_tokens = 0;
        for (int t = full.cu_seqlens(q); t < full.cu_seqlens(q + 1); ++t)
          mask_tokens += full.tokens(t) == plm::data::vocab::mask;
        EXPECT_EQ(sh.seq_masked[q], mask_tokens);
        // Every rank's layout row agrees with that rank's own shard.
        for (int other = 0; other < c; ++other) {
          const auto a = contextChunk(len, 2 * c, other);
          const auto b = contextChunk(len, 2 * c, 2 * c - 1 - other);
          const auto range = sh.shardOf(other, q);
          EXPECT_EQ(range.second - range.first, (a.second - a.first) + (b.second - b.first));
          // Balance: whole-number chunks differ by at most one token each.
          EXPECT_LE(std::abs((range.second - range.first) - 2 * len / (2 * c)), 2);
        }
        EXPECT_EQ(sh.shardOf(r, q).first, s.cu_seqlens(q));
        EXPECT_EQ(sh.shardOf(r, q).second, s.cu_seqlens(q + 1));
        // Chunk r first, then chunk 2C-1-r, positions ascending inside each.
        std::vector<int> expect;
        for (const int k : {r, 2 * c - 1 - r}) {
          const auto ch = contextChunk(len, 2 * c, k);
          for (auto p = ch.first; p < ch.second; ++p) expect.push_back(static_cast<int>(p));
        }
        ASSERT_EQ(static_cast<int>(expect.size()), s.cu_seqlens(q + 1) - s.cu_seqlens(q));
        for (std::size_t i = 0; i < expect.size(); ++i) {
          const int t = s.cu_seqlens(q) + static_cast<int>(i);
          const int p = sh.positions[t];
          EXPECT_EQ(p, expect[i]);
          const int g = full.cu_seqlens(q) + p;
          EXPECT_EQ(s.tokens(t), full.tokens(g));
          EXPECT_EQ(s.labels(t), full.labels(g));
          ++seen[g];
        }
      }
    }
    EXPECT_EQ(tokens, full.numTokens()) << "C = " << c;
    EXPECT_EQ(masked, full.num_masked) << "C = " << c;
    for (std::size_t g = 0; g < seen.size(); ++g) ASSERT_EQ(seen[g], 1) << "token " << g;
  }
}

TEST(ContextSplit, ShortSequencesLeaveSomeShardsEmpty) {
  // One token, four ranks: chunks 0..6 are empty, chunk 7 holds it, so rank 0 has the token
  // and ranks 1..3 a zero-length sequence (which the model then accepts).
  const MicroBatch full = plm::model::test::makeBatch({1}, 3);
  EXPECT_EQ(contextShard(full, 4, 0).numTokens(), 1);
  for (int r = 1; r < 4; ++r) {
    const MicroBatch s = contextShard(full, 4, r);
    EXPECT_EQ(s.numTokens(), 0);
    EXPECT_EQ(s.numSequences(), 1);
  }
}

TEST(ContextSplit, EmptyBatchesPassAndShardsAreNotSplitTwice) {
  const MicroBatch empty;
  EXPECT_FALSE(contextShard(empty, 2, 1).context);
  const MicroBatch full = plm::model::test::makeBatch({5, 9}, 4);
  const MicroBatch s = contextShard(full, 2, 0);
  EXPECT_THROW(contextShard(s, 2, 0), plm::Error);
  EXPECT_THROW(contextShard(full, 2, 2), plm::Error);
}

}  // namespace
