#include "data/synthetic.hpp"

#include <algorithm>
#include <cmath>
#include <random>

namespace plm::data {

MicroBatch syntheticBatch(const std::vector<int>& lengths, std::uint64_t seed) {
  std::int64_t total = 0;
  for (int l : lengths) total += l;
  MicroBatch b;
  b.tokens = HostView1<token_t>("plm::data::synthetic_tokens", total);
  b.labels = HostView1<std::int32_t>("plm::data::synthetic_labels", total);
  b.cu_seqlens = HostView1<seqlen_t>("plm::data::synthetic_cu", lengths.size() + 1);
  std::mt19937_64 rng(seed);
  std::int64_t t = 0;
  b.cu_seqlens(0) = 0;
  for (std::size_t s = 0; s < lengths.size(); ++s) {
    for (int i = 0; i < lengths[s]; ++i, ++t) {
      token_t tok = i == 0                ? vocab::cls
                    : i == lengths[s] - 1 ? vocab::eos
                                          : static_cast<token_t>(4 + rng() % 20);
      b.labels(t) = vocab::ignore_label;
      if (i > 0 && i < lengths[s] - 1 && rng() % 100 < 15) {
        b.labels(t) = tok;
        tok = rng() % 10 < 8 ? vocab::mask : static_cast<token_t>(4 + rng() % 20);
        ++b.num_masked;
      }
      b.tokens(t) = tok;
    }
    b.cu_seqlens(s + 1) = static_cast<seqlen_t>(t);
    b.max_seqlen = std::max(b.max_seqlen, lengths[s]);
  }
  return b;
}

std::vector<int> esmLikeLengths(std::int64_t budget, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> z(0.0, 1.0);
  std::vector<int> lengths;
  std::int64_t total = 0;
  while (true) {
    const int l = std::clamp(
        static_cast<int>(std::lround(std::exp(z(rng) * 0.7 + std::log(300.0)))), 30, 1024);
    if (total + l > budget) break;
    lengths.push_back(l);
    total += l;
  }
  return lengths;
}

}  // namespace plm::data
