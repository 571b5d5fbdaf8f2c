// Accumulation rule: none; a shard is a fresh copy of its tokens, labels and metadata.
#include "data/context_split.hpp"

#include "core/error.hpp"

#include <algorithm>
#include <string>

namespace plm::data {

MicroBatch contextShard(const MicroBatch& full, int degree, int rank) {
  if (degree < 1 || rank < 0 || rank >= degree)
    throw Error("data::contextShard: rank " + std::to_string(rank) + " of context degree " +
                std::to_string(degree) + " (a caller bug)");
  if (full.context)
    throw Error("data::contextShard: the micro-batch is already a context shard (a caller bug)");
  if (full.numTokens() == 0) return full;
  const int n = full.numSequences();
  const int chunks = 2 * degree;
  auto shard = std::make_shared<ContextShard>();
  shard->degree = degree;
  shard->rank = rank;
  shard->rank_cu_seqlens.assign(static_cast<std::size_t>(degree) * (n + 1), 0);
  shard->seq_length.resize(n);
  shard->seq_masked.assign(n, 0);
  for (int s = 0; s < n; ++s) {  // metadata over sequences
    const seqlen_t begin = full.cu_seqlens(s), end = full.cu_seqlens(s + 1);
    const std::int64_t len = end - begin;
    shard->seq_length[s] = static_cast<std::int32_t>(len);
    shard->max_seqlen = std::max(shard->max_seqlen, static_cast<std::int32_t>(len));
    for (seqlen_t t = begin; t < end; ++t) {
      shard->seq_masked[s] += full.tokens(t) == vocab::mask;
      shard->labelled += full.labels(t) != vocab::ignore_label;
    }
    for (int r = 0; r < degree; ++r) {
      const auto a = contextChunk(len, chunks, r);
      const auto b = contextChunk(len, chunks, chunks - 1 - r);
      seqlen_t* cu = &shard->rank_cu_seqlens[static_cast<std::size_t>(r) * (n + 1)];
      cu[s + 1] = cu[s] + static_cast<seqlen_t>((a.second - a.first) + (b.second - b.first));
    }
  }
  const seqlen_t* cu = &shard->rank_cu_seqlens[static_cast<std::size_t>(rank) * (n + 1)];
  const std::int64_t local = cu[n];
  MicroBatch out;
  out.tokens = HostView1<token_t>("plm::data::context_tokens", local);
  out.labels = HostView1<std::int32_t>("plm::data::context_labels", local);
  out.cu_seqlens = HostView1<seqlen_t>("plm::data::context_cu_seqlens", n + 1);
  shard->positions.resize(local);
  std::int64_t t = 0;
  for (int s = 0; s <= n; ++s) out.cu_seqlens(s) = cu[s];
  for (int s = 0; s < n; ++s) {
    const seqlen_t begin = full.cu_seqlens(s);
    const std::int64_t len = full.cu_seqlens(s + 1) - begin;
    for (const int k : {rank, chunks - 1 - rank}) {
      const auto c = contextChunk(len, chunks, k);
      for (std::int64_t p = c.first; p < c.second; ++p, ++t) {
        out.tokens(t) = full.tokens(begin + p);
        out.labels(t) = full.labels(begin + p);
        shard->positions[t] = static_cast<seqlen_t>(p);
        out.num_masked += out.labels(t) != vocab::ignore_label;
        out.max_seqlen = std::max(out.max_seqlen, cu[s + 1] - cu[s]);
      }
    }
  }
  out.context = std::move(shard);
  return out;
}

std::vector<MicroBatch> contextShards(const std::vector<MicroBatch>& full, int degree, int rank) {
  std::vector<MicroBatch> out;
  out.reserve(full.size());
  for (const auto& mb : full) out.push_back(contextShard(mb, degree, rank));
  return out;
}

}  // namespace plm::data
