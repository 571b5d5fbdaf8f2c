// Hand-made packed micro-batches for the training tests: deterministic random proteins with MLM
// labels, built without the loader so step-level tests depend only on the model.
#pragma once

#include "data/batch.hpp"

#include <cstdint>
#include <random>
#include <vector>

namespace plm::test {

/// One sequence: <cls> residues <eos> with its labels.
struct Sequence {
  std::vector<token_t> tokens;
  std::vector<std::int32_t> labels;
};

inline Sequence randomSequence(std::mt19937_64& gen, int min_residues, int max_residues) {
  std::uniform_int_distribution<int> length(min_residues, max_residues);
  std::uniform_int_distribution<int> residue(data::vocab::first_residue,
                                             data::vocab::last_standard_aa);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  Sequence s;
  const int n = length(gen);
  s.tokens.push_back(data::vocab::cls);
  s.labels.push_back(data::vocab::ignore_label);
  for (int i = 0; i < n; ++i) {
    const token_t t = static_cast<token_t>(residue(gen));
    if (u(gen) < 0.2) {
      s.tokens.push_back(u(gen) < 0.8 ? data::vocab::mask : t);
      s.labels.push_back(t);
    } else {
      s.tokens.push_back(t);
      s.labels.push_back(data::vocab::ignore_label);
    }
  }
  s.tokens.push_back(data::vocab::eos);
  s.labels.push_back(data::vocab::ignore_label);
  return s;
}

inline data::MicroBatch pack(const std::vector<Sequence>& seqs) {
  std::int64_t total = 0;
  for (const auto& s : seqs) total += static_cast<std::int64_t>(s.tokens.size());
  data::MicroBatch mb;
  mb.tokens = HostView1<token_t>("tokens", total);
  mb.labels = HostView1<std::int32_t>("labels", total);
  mb.cu_seqlens = HostView1<seqlen_t>("cu_seqlens", seqs.size() + 1);
  std::int64_t at = 0;
  for (std::size_t q = 0; q < seqs.size(); ++q) {
    mb.cu_seqlens(q) = static_cast<seqlen_t>(at);
    mb.max_seqlen =
        std::max<std::int32_t>(mb.max_seqlen, static_cast<std::int32_t>(seqs[q].tokens.size()));
    for (std::size_t i = 0; i < seqs[q].tokens.size(); ++i, ++at) {
      mb.tokens(at) = seqs[q].tokens[i];
      mb.labels(at) = seqs[q].labels[i];
      if (seqs[q].labels[i] != data::vocab::ignore_label) ++mb.num_masked;
    }
  }
  mb.cu_seqlens(seqs.size()) = static_cast<seqlen_t>(at);
  return mb;
}

/// The `count` global micro-batches of step `step`, each of `per_batch` sequences; a pure
/// function of (seed, step), so every rank builds the same global batch.
inline std::vector<data::MicroBatch> globalStep(std::uint64_t seed, int step, int count,
                                                int per_batch) {
  std::mt19937_64 gen(seed * 1000003ull + static_cast<std::uint64_t>(step));
  std::vector<data::MicroBatch> out;
  for (int j = 0; j < count; ++j) {
    std::vector<Sequence> seqs;
    for (int q = 0; q < per_batch; ++q) seqs.push_back(randomSequence(gen, 6, 40));
    out.push_back(pack(seqs));
  }
  return out;
}

}  // namespace plm::test
