// A packed (THD) micro-batch: the unit the loader produces and the model consumes.
//
// Sequences are concatenated into one token stream with no padding; sequence s occupies
// tokens [cu_seqlens[s], cu_seqlens[s+1]) and is `<cls>` + residues + `<eos>` (a cropped
// sequence is its random residue window, wrapped in `<cls>`/`<eos>` like any other; doc/data.md).
// Attention never crosses a boundary; rotary positions and token dropout restart per sequence.
#pragma once

#include "core/types.hpp"

#include <cstdint>
#include <vector>

namespace plm::data {

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

struct MicroBatch {
  HostView1<token_t> tokens;       // (T) input ids after MLM corruption
  HostView1<std::int32_t> labels;  // (T) original id at selected positions, -100 elsewhere
  HostView1<seqlen_t> cu_seqlens;  // (n+1) cumulative sequence starts, cu_seqlens[0] = 0
  std::int32_t max_seqlen = 0;     // longest sequence in this micro-batch
  std::int64_t num_masked = 0;     // positions with a label != -100

  std::int64_t numTokens() const { return static_cast<std::int64_t>(tokens.extent(0)); }
  std::int32_t numSequences() const {
    return cu_seqlens.extent(0) ? static_cast<std::int32_t>(cu_seqlens.extent(0)) - 1 : 0;
  }
};

}  // namespace plm::data
