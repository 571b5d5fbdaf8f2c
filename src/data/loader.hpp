// The streaming training loader: packed, masked micro-batches from a plm dataset (doc/data.md).
//
// Design choice: the global stream of micro-batches is a pure function of (dataset, seed,
// options other than rank/world). Every rank computes the same global packing from the
// sequence lengths it holds in memory (8 bytes per sequence) and materialises only its own
// micro-batches (global micro-batch j goes to rank j % world), so the stream is identical for
// any rank count and a single Cursor restores it exactly.
//   - order: epoch e visits sequences in a seeded permutation keyed by (seed, e) (a keyed
//     Feistel bijection: O(1) memory, random access for seek); single_pass visits 0..n-1;
//   - crop: a sequence with more than W = min(max_seq_len, micro_batch_tokens) - 2 residues is
//     cut to a random W-residue window keyed by (seed, epoch, sequence index), then wrapped in
//     <cls> ... <eos> like every other sequence;
//   - packing: greedy in visit order, a micro-batch takes sequences while its token count
//     (residues + 2 per sequence) stays <= micro_batch_tokens; it always holds at least one
//     sequence and never exceeds the budget; micro-batches never span an epoch boundary;
//   - masking: each residue position (specials never) is selected with probability mask_prob;
//     selected positions become <mask> (80%), a random standard amino acid, ids 4..23 (10%), or
//     stay (10%); labels hold the original id there and -100 elsewhere. Every draw comes from a
//     counter-based hash of (seed, epoch, sequence index, residue position), so it does not
//     depend on the rank count, prefetch depth or resume point (single_pass uses epoch 0).
// Token bytes are read with pread() at the /tokens dataset's file address (the dataset is
// contiguous and validated at open) by a background thread that keeps `prefetch` steps ready;
// HDF5 is not thread-safe here, so the thread never calls it, nor MPI, nor Kokkos.
#pragma once

#include "data/batch.hpp"

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace plm::data {

/// \brief Where the stream stands: the next step starts at `position` in epoch `epoch`'s visit
/// order. Taken at a step boundary; identical on every rank and for any rank count.
struct Cursor {
  std::int64_t epoch = 0, position = 0;
};

inline bool operator==(const Cursor& a, const Cursor& b) {
  return a.epoch == b.epoch && a.position == b.position;
}
inline bool operator!=(const Cursor& a, const Cursor& b) { return !(a == b); }

/// What a micro-batch carries besides tokens: masked-LM labels (pre-training), or the
/// dataset's fine-tuning labels (no masking then; /labels and /residue_labels are read into
/// memory at open, 8 bytes per sequence or 1 per residue).
enum class Targets { MaskedLm, Sequence, Residue };

struct LoaderOptions {
  std::string path;                         // a dataset written by `plm prep`
  std::int64_t micro_batch_tokens = 8192;   // packing budget of one micro-batch (>= 3)
  std::int64_t micro_batches_per_step = 2;  // global micro-batches per step; a multiple of world
  std::uint64_t seed = 1;
  double mask_prob = 0.15;
  int max_seq_len = 1024;  // tokens per sequence, <cls> and <eos> included
  int rank = 0, world = 1;
  int prefetch = 2;          // steps prepared ahead by the background thread
  bool shuffle = true;       // false: visit 0..n-1 every epoch
  bool single_pass = false;  // one unshuffled pass, masking of epoch 0, then end
  Targets targets = Targets::MaskedLm;
};

/// \brief The global micro-batches per step for a global token budget: ceil(tokens_per_batch /
/// micro_batch_tokens) rounded up to a multiple of `world` (every rank gets the same count).
std::int64_t microBatchesPerStep(std::int64_t tokens_per_batch, std::int64_t micro_batch_tokens,
                                 int world);

class Loader {
 public:
  /// \brief Opens and validates the dataset (throws plm::Error naming what is wrong). Not
  /// collective: each rank opens the file on its own.
  explicit Loader(const LoaderOptions& options);
  ~Loader();
  Loader(const Loader&) = delete;
  Loader& operator=(const Loader&) = delete;

  /// \brief This rank's micro-batches of the next global step (micro_batches_per_step / world
  /// of them while training). single_pass: at the end of the pass a rank gets fewer, then an
  /// empty vector (ranks may see the end one call apart: reduce after the loop, not inside it).
  std::vector<MicroBatch> nextStep();
  /// \brief The position of the next step (after the last nextStep()).
  Cursor cursor() const;
  /// \brief Restarts the stream at `cursor`; the steps that follow are exactly those that
  /// followed when cursor() returned it.
  void seek(const Cursor& cursor);

  std::int64_t numSequences() const;
  std::int64_t numResidues() const;
  const LoaderOptions& options() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_member;
};

}  // namespace plm::data
