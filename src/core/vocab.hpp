// The ESM-2 vocabulary: token ids and residue letters, shared by the readers (io), the loader
// (data) and the model, so none of them reaches up into another for it.
#pragma once

#include "core/types.hpp"

#include <cstdint>

namespace plm {

/// ESM-2 vocabulary (doc/anchors.md §1), ids 0..32.
namespace vocab {
constexpr int size = 33;
constexpr token_t cls = 0, pad = 1, eos = 2, unk = 3, mask = 32;
// Token ids in order: <cls> <pad> <eos> <unk> L A G V S E R T I D P K Q N F Y M H W C X B U Z O
// . - <null_1> <mask>.  Residue letters are ids 4..28; the 20 standard amino acids are 4..23
// (MLM's "random token" is drawn from these).
constexpr int first_residue = 4;                                     // L
constexpr int last_residue = 28;                                     // O
constexpr int last_standard_aa = 23;                                 // C
inline constexpr const char* letters = "LAGVSERTIDPKQNFYMHWCXBUZO";  // ids 4..28
constexpr std::int32_t ignore_label = -100;
}  // namespace vocab

}  // namespace plm
