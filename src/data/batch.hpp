// A packed (THD) micro-batch: the unit the loader produces and the model consumes.
//
// Sequences are concatenated into one token stream with no padding; sequence s occupies
// tokens [cu_seqlens[s], cu_seqlens[s+1]) and is `<cls>` + residues + `<eos>` (a cropped
// sequence is its random residue window, wrapped in `<cls>`/`<eos>` like any other; doc/data.md).
// Attention never crosses a boundary; rotary positions and token dropout restart per sequence.
#pragma once

#include "core/types.hpp"
#include "core/vocab.hpp"

#include <cstdint>
#include <memory>
#include <vector>

namespace plm::data {

/// The ESM-2 vocabulary lives in core (io and model use it too); data::vocab names it here.
namespace vocab = plm::vocab;

struct ContextShard;  // data/context_split.hpp

struct MicroBatch {
  HostView1<token_t> tokens;       // (T) input ids after MLM corruption
  HostView1<std::int32_t> labels;  // (T) original id at selected positions, -100 elsewhere
  HostView1<seqlen_t> cu_seqlens;  // (n+1) cumulative sequence starts, cu_seqlens[0] = 0
  std::int32_t max_seqlen = 0;     // longest sequence in this micro-batch
  std::int64_t num_masked = 0;     // positions with a label != -100
  /// Fine-tuning targets (LoaderOptions::targets), empty for masked-LM training: per sequence
  /// (n) the /labels value, or per token (T) the /residue_labels class, -100 at <cls>, <eos>
  /// and unlabelled residues.  Such batches carry no MLM corruption.
  HostView1<double> targets;
  /// Set on a context-parallel shard (data/context_split.hpp): then sequences may be empty, and
  /// positions and token dropout follow the whole sequences, not this shard's tokens.
  std::shared_ptr<const ContextShard> context;

  std::int64_t numTokens() const { return static_cast<std::int64_t>(tokens.extent(0)); }
  std::int32_t numSequences() const {
    return cu_seqlens.extent(0) ? static_cast<std::int32_t>(cu_seqlens.extent(0)) - 1 : 0;
  }
};

}  // namespace plm::data
