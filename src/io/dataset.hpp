// The packed protein dataset (`plm prep` writes it, the loader reads it); doc/data.md.
//
// One HDF5 file per split, readable by any HDF5 tool or h5py without plm:
//   /tokens   uint8 (R)     ESM-2 token ids of the residues (4..28), no special tokens
//   /offsets  int64 (n+1)   sequence i is tokens[offsets[i] : offsets[i+1]]
//   /ids      string (n)    FASTA identifiers (first word of the header), fixed length
//   /labels          float64 (n)  optional (`plm prep --labels`): one label per sequence, a
//                                 value (regression) or a class index (classification)
//   /residue_labels  int8 (R)     optional (`plm prep --residue-labels`): one class per residue,
//                                 aligned with /tokens; -1 = no label at that residue
//   attributes on `/`: format, format_version, vocabulary, num_sequences, num_residues, split,
//   split_rule, valid_fraction, duplicates_removed, skipped_records, source_files,
//   source_sizes, source_crc32, command_line, plm_version, created_utc.
// Design choice: /tokens is contiguous (never chunked or compressed) so a reader can fetch any
// sequence with one byte-range read at a known file address, from any thread; `format` is the
// last attribute written, so a file cut short by a crash never carries it and never validates.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace plm::io {

inline constexpr const char* dataset_format = "plm-protein-dataset";
inline constexpr std::int64_t dataset_format_version = 1;

/// \brief The 33 ESM-2 tokens in id order, as stored in the `vocabulary` attribute.
const std::vector<std::string>& vocabularyTokens();

struct SourceFile {
  std::string path;
  std::int64_t size = 0;    // bytes on disk (compressed size for .gz)
  std::uint32_t crc32 = 0;  // zlib CRC-32 of the file's bytes as stored
};

/// \brief Everything in the file's attributes except the counts, which the writer derives.
struct DatasetMetadata {
  std::string split;       // "train" or "valid"
  std::string split_rule;  // how sequences were assigned to this split
  double valid_fraction = 0;
  std::int64_t duplicates_removed = 0;
  std::int64_t skipped_records = 0;
  std::vector<SourceFile> sources;
  std::string command_line;
  std::string plm_version;
  std::string created_utc;
  // Filled by the reader:
  std::string format;
  std::int64_t format_version = 0;
  std::int64_t num_sequences = 0, num_residues = 0;
};

/// \brief One rank's consecutive run of sequences, in output order.
struct SequenceShard {
  std::vector<std::uint8_t> tokens;         // residue ids of all sequences, concatenated
  std::vector<std::int64_t> lengths;        // residues per sequence
  std::vector<std::string> ids;             // one per sequence
  std::vector<double> labels;               // one per sequence, or empty (no /labels)
  std::vector<std::int8_t> residue_labels;  // one per residue (-1 = none), or empty
};

/// \brief Collective over `comm`: writes `path` with rank r's shard after those of ranks < r.
/// Every rank passes the same metadata. Creates (truncates) `path`; callers that want an atomic
/// result write a temporary name and rename it (plm prep does).
void writeDataset(const std::string& path, MPI_Comm comm, const SequenceShard& local,
                  const DatasetMetadata& metadata);

/// \brief Opens a dataset on one rank (serial HDF5) and validates its header and offsets:
/// format name and version, vocabulary, dataset shapes, counts, offsets starting at 0,
/// monotone and ending at the token count. Token ids are validated as they are read (and all at
/// once by validateTokens()). Every failure is a plm::Error naming the file and the problem.
class DatasetReader {
 public:
  explicit DatasetReader(const std::string& path);
  ~DatasetReader();
  DatasetReader(DatasetReader&&) noexcept;
  DatasetReader& operator=(DatasetReader&&) noexcept;

  const std::string& path() const;
  std::int64_t numSequences() const;
  std::int64_t numResidues() const;
  const std::vector<std::int64_t>& offsets() const;  // (n+1)
  const DatasetMetadata& metadata() const;
  /// \brief File address of /tokens' first byte (contiguous layout), or -1 when the tokens are
  /// chunked or empty (then only readTokens() can read them).
  std::int64_t tokensFileAddress() const;

  /// \brief Residue ids of sequences [first, first+count), concatenated, validated.
  std::vector<std::uint8_t> readTokens(std::int64_t first, std::int64_t count) const;
  std::vector<std::string> readIds(std::int64_t first, std::int64_t count) const;
  /// \brief Whether the file carries /labels (per sequence) and /residue_labels (per residue).
  bool hasLabels() const;
  bool hasResidueLabels() const;
  /// \brief /labels of sequences [first, first+count); a plm::Error naming the file without it.
  std::vector<double> readLabels(std::int64_t first, std::int64_t count) const;
  /// \brief /residue_labels of sequences [first, first+count), concatenated as readTokens().
  std::vector<std::int8_t> readResidueLabels(std::int64_t first, std::int64_t count) const;
  /// \brief Sequence i as letters (for tests and tools).
  std::string sequenceString(std::int64_t i) const;
  /// \brief Reads every token (in blocks) and checks it is a residue id.
  void validateTokens() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_member;
};

/// \brief Throws plm::Error unless every id in tokens[0, n) is a residue id (4..28); names the
/// dataset `path`, sequence `sequence` and the residue position.
void checkResidueIds(const std::string& path, std::int64_t sequence, const std::uint8_t* tokens,
                     std::int64_t n);

}  // namespace plm::io
