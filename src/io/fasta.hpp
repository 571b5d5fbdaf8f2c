// FASTA parsing for `plm prep`: one rank's share of a plain or gzip file (doc/data.md).
//
// Design choice: work is split by bytes, never by records, so no rank reads the whole input.
// A record belongs to the rank whose byte range holds its '>' (a header at the start of a
// line); a rank skips the tail of the previous rank's record at its range start and reads past
// its range end to finish its last record. Gzip cannot be entered mid-stream, so every rank
// whose range overlaps a .gz file inflates it from the start (stopping after its range) and
// owns the headers produced while its range of the *compressed* bytes was being consumed:
// that assignment is identical on every rank because every rank runs the same inflate calls.
// Line numbers of a plain file are counted from the range start and made absolute later
// (an exclusive scan of the ranges' newline counts); gzip line numbers are absolute.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace plm::io::fasta {

enum class Policy { error, skip };

enum class Problem : int {
  sequence_before_header = 0,
  empty_sequence = 1,
  invalid_character = 2,
  truncated_gzip = 3,
  corrupt_gzip = 4,
};
constexpr int num_problems = 5;
/// \brief A short name for summaries ("empty sequence").
const char* problemName(Problem problem);

/// \brief One invalid-input case. `line` is relative to the segment start until
/// Segment-local lines are made absolute (line_is_local).
struct Issue {
  Problem problem;
  int file = 0;
  std::int64_t line = 0;
  bool line_is_local = false;
  std::string path;
  std::string detail;  // what is wrong and what to do, without the "path:line: " prefix
  /// \brief "path:line: detail".
  std::string message() const;
};

/// \brief The part of one input file a rank owns.
struct Segment {
  int file = 0;  // index among the inputs (orders records across files)
  std::string path;
  bool gzip = false;
  std::int64_t file_size = 0;       // bytes on disk
  std::int64_t begin = 0, end = 0;  // owned bytes of the file as stored (compressed for gzip)
};

/// \brief A valid record worth a warning (a nucleotide-like sequence, an empty identifier), with
/// its header line (segment-local until made absolute, like Issue::line).
struct Notice {
  int file = 0;
  std::int64_t line = 0;
  bool line_is_local = false;
  std::size_t record = 0;  // index among Parsed's records
};

/// \brief A record at least this long whose residues are at least nucleotide_percent % A, C, G,
/// T, U or N (either case) is probably DNA or RNA read as protein (all are amino-acid letters).
constexpr std::int64_t nucleotide_min_length = 20;
constexpr std::int64_t nucleotide_percent = 90;

/// \brief Everything one rank parsed, in input order.
struct Parsed {
  std::vector<std::uint8_t> tokens;   // residue ids, all records concatenated
  std::vector<std::int64_t> lengths;  // (n) residues per record
  std::vector<std::string> ids;       // (n) first word of the header
  std::vector<std::uint64_t> order;   // (n) (file << 44) | byte position of the header
  std::vector<Issue> issues;          // the first few issues, in input order
  std::array<std::int64_t, num_problems> issue_counts{};
  bool stopped = false;            // Policy::error met an issue: parsing ended there
  std::vector<Notice> nucleotide;  // records that look like nucleotides, in input order
  std::vector<Notice> unnamed;     // records whose header has no identifier (id left empty)
};

/// \brief Whether `length` residue ids look like a nucleotide sequence (see nucleotide_percent).
bool looksLikeNucleotides(const std::uint8_t* residues, std::int64_t length);

/// \brief Totals of one segment for the caller's bookkeeping.
struct SegmentStats {
  std::int64_t newlines_in_range = 0;  // '\n' bytes in [begin, end) (plain files)
  std::int64_t bytes_read = 0;         // bytes read from disk
  std::int64_t bytes_inflated = 0;     // decompressed bytes this rank owns (gzip)
};

/// \brief Issues kept per rank (all are counted).
constexpr size_t max_kept_issues = 20;

/// \brief Parses the records `segment` owns into `out`. `progress(bytes)` is called with
/// increments of bytes read. Throws plm::Error for I/O failures (missing file, read error).
SegmentStats parseSegment(const Segment& segment, Policy policy, Parsed& out,
                          const std::function<void(std::int64_t)>& progress = {});

/// \brief zlib CRC-32 of bytes [begin, end) of `path`.
std::uint32_t fileCrc32(const std::string& path, std::int64_t begin, std::int64_t end);

/// \brief Residue id (4..28) of an amino-acid letter in either case, 0 for whitespace ('\r'
/// included), -1 for anything else.
int residueId(unsigned char c);

}  // namespace plm::io::fasta
