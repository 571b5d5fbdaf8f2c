// Synthetic packed micro-batches for GPU tests and benchmarks: real ESM-2 token structure
// (<cls> residues <eos>, 15% of residues labelled with the 80/10/10 mask rule) without a dataset.
#pragma once

#include "data/batch.hpp"

#include <cstdint>
#include <vector>

namespace plm::data {

/// \brief One packed micro-batch of sequences of these lengths (specials included), random
/// residues from `seed`.
MicroBatch syntheticBatch(const std::vector<int>& lengths, std::uint64_t seed);

/// \brief Sequence lengths with ESM-2's length distribution (exp(N(0,1) * 0.7 + ln 300) clamped
/// to [30, 1024], specials included) filling at most `budget` tokens.
std::vector<int> esmLikeLengths(std::int64_t budget, std::uint64_t seed);

}  // namespace plm::data
