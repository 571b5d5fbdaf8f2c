// Real proteins for the MoE balance tests: the first records of Debian's mmseqs2-examples (the
// quickstart's data), cropped, masked and packed as the loader does.  Tests skip where the file
// is absent.
#pragma once

#include "core/vocab.hpp"
#include "data/batch.hpp"
#include "io/fasta.hpp"

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <random>
#include <vector>

namespace plm::model {

inline constexpr const char* proteins_path = "/usr/share/doc/mmseqs2/example-data/DB.fasta.gz";

/// Packed micro-batches of real proteins: the first records of the file, each cut to a window
/// of at most `max_len` - 2 residues (seeded start, as the loader crops), masked by ESM-2's
/// 15% / 80-10-10 rule, packed in file order into micro-batches of at most `micro_tokens`
/// tokens, `total` tokens in all.
inline std::vector<data::MicroBatch> realBatches(std::int64_t total, int max_len,
                                                 std::int64_t micro_tokens) {
  io::fasta::Parsed parsed;
  io::fasta::Segment seg;
  seg.path = proteins_path;
  seg.gzip = true;
  seg.file_size = static_cast<std::int64_t>(std::filesystem::file_size(proteins_path));
  seg.end = std::min<std::int64_t>(seg.file_size, 1 << 20);  // compressed bytes: ~3k records
  io::fasta::parseSegment(seg, io::fasta::Policy::skip, parsed);
  std::mt19937_64 rng(7);
  std::vector<std::vector<token_t>> seqs;
  std::int64_t at = 0, tokens = 0;
  for (std::int64_t len : parsed.lengths) {
    const std::int64_t w = std::min<std::int64_t>(len, max_len - 2);
    const std::int64_t start = len > w ? static_cast<std::int64_t>(rng() % (len - w + 1)) : 0;
    if (tokens + w + 2 > total) break;
    std::vector<token_t> s{vocab::cls};
    for (std::int64_t i = 0; i < w; ++i) s.push_back(parsed.tokens[at + start + i]);
    s.push_back(vocab::eos);
    tokens += static_cast<std::int64_t>(s.size());
    seqs.push_back(std::move(s));
    at += len;
  }
  std::vector<data::MicroBatch> out;
  for (std::size_t first = 0; first < seqs.size();) {
    std::size_t last = first;
    std::int64_t n = 0;
    while (last < seqs.size() && n + std::int64_t(seqs[last].size()) <= micro_tokens)
      n += static_cast<std::int64_t>(seqs[last++].size());
    data::MicroBatch b;
    b.tokens = HostView1<token_t>("tokens", n);
    b.labels = HostView1<std::int32_t>("labels", n);
    b.cu_seqlens = HostView1<seqlen_t>("cu", last - first + 1);
    std::int64_t t = 0;
    for (std::size_t q = first; q < last; ++q) {
      const auto& s = seqs[q];
      for (std::size_t i = 0; i < s.size(); ++i, ++t) {
        token_t tok = s[i];
        b.labels(t) = vocab::ignore_label;
        if (i > 0 && i + 1 < s.size() && rng() % 100 < 15) {
          b.labels(t) = tok;
          const auto r = rng() % 10;
          tok = r < 8 ? vocab::mask : r < 9 ? static_cast<token_t>(4 + rng() % 20) : tok;
          ++b.num_masked;
        }
        b.tokens(t) = tok;
      }
      b.cu_seqlens(q - first + 1) = static_cast<seqlen_t>(t);
      b.max_seqlen = std::max<std::int32_t>(b.max_seqlen, static_cast<std::int32_t>(s.size()));
    }
    out.push_back(b);
    first = last;
  }
  return out;
}

}  // namespace plm::model
