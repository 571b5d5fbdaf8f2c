// `plm prep`: FASTA files to DIR/train.h5 and DIR/valid.h5, in parallel over MPI ranks.
//
// Pipeline (doc/data.md "prep"): every rank parses its byte range of the inputs (io/fasta.hpp)
// -> line numbers made absolute by an exclusive scan -> the invalid-input policy is applied
// collectively (error: the first problem in input order is every rank's error) -> each record's
// 128-bit content hash goes to the rank that owns that hash (MPI_Alltoallv), which keeps the
// first occurrence in input order and answers keep/drop -> the split is a function of the hash
// (or of the file, with --valid) -> collective writes to hidden temporary files, renamed when
// both are complete. Output order is input order, so the files do not depend on the rank count.
#pragma once

#include "io/fasta.hpp"

#include <mpi.h>

#include <array>
#include <cstdint>
#include <string>
#include <vector>

namespace plm::data {

struct PrepOptions {
  std::vector<std::string> inputs;        // FASTA files, plain or gzip (detected by content)
  std::vector<std::string> valid_inputs;  // --valid: these files are the validation set
  std::string out_dir;
  double valid_fraction = 0.01;  // used when valid_inputs is empty; 0 = no valid.h5
  io::fasta::Policy on_invalid = io::fasta::Policy::error;
  std::string command_line;       // recorded in the files
  double progress_seconds = 10;   // rank 0 logs progress this often (0 = never)
  bool allow_nucleotide = false;  // keep files made mostly of nucleotide-like records
  /// --labels: CSV with header `id,label`, one row per record id (a float for regression, a
  /// class index 0, 1, ... for classification); every kept record needs a row.
  std::string labels;
  /// --residue-labels: FASTA whose records are label strings keyed by the same ids, one
  /// character per residue: 0-9 = class 0-9, `.` or `-` = no label (doc/finetune.md).
  std::string residue_labels;
};

struct PrepReport {
  std::int64_t input_bytes = 0;  // bytes of the input files as stored
  std::int64_t fasta_bytes = 0;  // bytes of FASTA text parsed (after inflating gzip)
  std::int64_t records = 0;      // valid records read
  std::int64_t duplicates = 0;   // records dropped as exact duplicates
  std::int64_t skipped = 0;      // invalid records skipped (--on-invalid skip)
  std::array<std::int64_t, io::fasta::num_problems> skipped_by_problem{};
  std::int64_t nucleotide_records = 0;  // kept records that look like DNA/RNA (warned about)
  std::int64_t unnamed_records = 0;     // kept records given a generated identifier
  std::int64_t train_sequences = 0, train_residues = 0;
  std::int64_t valid_sequences = 0, valid_residues = 0;
  std::vector<std::string> outputs;  // files written
  double seconds = 0;
  double parse_seconds = 0, dedup_seconds = 0, write_seconds = 0;  // rank 0's phases
};

/// \brief Collective over `comm`. Throws a collective plm::Error for bad input under
/// Policy::error (the first problem in input order: "file:line: what; what to do").
PrepReport prepare(const PrepOptions& options, MPI_Comm comm);

/// What checkRecords found (identical on every rank).
struct RecordChecks {
  std::int64_t skipped = 0;  // invalid records left out (Policy::skip)
  std::array<std::int64_t, io::fasta::num_problems> skipped_by_problem{};
  std::int64_t nucleotide_records = 0;  // kept records that look like DNA/RNA (warned about)
  std::int64_t unnamed_records = 0;     // records given an identifier unnamed:FILE:LINE
};

/// \brief Collective over `comm`: prep's checks of parsed FASTA records, which every command
/// reading FASTA applies (`plm prep`, `plm embed`).  Invalid records stop with the first one's
/// file:line in input order (Policy::error) or are listed and counted (skip); a file whose
/// records are mostly nucleotide-like is refused unless `allow_nucleotide` (a few only warn); a
/// record with an empty identifier is named unnamed:FILE:LINE with a warning.  `files` are the
/// input paths by Segment::file; `line_base[f]` the lines of file f before this rank's part (0
/// for a rank that parsed whole files); `command` starts every message.  The ranks of `comm`
/// must have parsed disjoint parts of the inputs.
RecordChecks checkRecords(const std::string& command, const std::vector<std::string>& files,
                          const std::vector<std::int64_t>& line_base, io::fasta::Policy on_invalid,
                          bool allow_nucleotide, io::fasta::Parsed& parsed, MPI_Comm comm);

/// \brief The whole of input `path` as one segment, gzip recognised by its content as prep does;
/// a collective plm::Error (starting with `command`) if it cannot be read or is not a file.
io::fasta::Segment wholeFile(const std::string& path, const std::string& command);

}  // namespace plm::data
