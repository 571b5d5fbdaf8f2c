#include "io/fasta.hpp"

#include "core/error.hpp"
#include "core/vocab.hpp"

#include <zlib.h>

#include <fcntl.h>
#include <unistd.h>
#include <algorithm>
#include <cstdlib>
#include <cstring>

namespace plm::io::fasta {

const char* problemName(Problem problem) {
  switch (problem) {
    case Problem::sequence_before_header: return "sequence before the first header";
    case Problem::empty_sequence: return "empty sequence";
    case Problem::invalid_character: return "character outside the alphabet";
    case Problem::truncated_gzip: return "truncated gzip";
    case Problem::corrupt_gzip: return "corrupt gzip";
  }
  return "?";
}

std::string Issue::message() const { return path + ":" + std::to_string(line) + ": " + detail; }

namespace {

struct IdTable {
  signed char id[256];
  IdTable() {
    std::fill(std::begin(id), std::end(id), static_cast<signed char>(-1));
    for (int k = 0; vocab::letters[k]; ++k) {
      unsigned char c = static_cast<unsigned char>(vocab::letters[k]);
      id[c] = static_cast<signed char>(vocab::first_residue + k);
      id[c + ('a' - 'A')] = id[c];
    }
    for (unsigned char c : {' ', '\t', '\r', '\v', '\f'}) id[c] = 0;
  }
};
const IdTable id_table;

constexpr size_t read_block = size_t(8) << 20;

// Owns a file descriptor; reads with pread so that several readers never share a position.
class InputFile {
 public:
  explicit InputFile(const std::string& path) : path_member(path) {
    fd_member = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd_member < 0)
      throw Error("cannot open FASTA input `" + path + "`: " + std::strerror(errno) +
                  "; check the path");
  }
  ~InputFile() {
    if (fd_member >= 0) ::close(fd_member);
  }
  InputFile(const InputFile&) = delete;
  InputFile& operator=(const InputFile&) = delete;
  size_t read(char* buffer, size_t n, std::int64_t position) const {
    size_t got = 0;
    while (got < n) {
      ssize_t r = ::pread(fd_member, buffer + got, n - got, position + std::int64_t(got));
      if (r < 0 && errno == EINTR) continue;
      if (r < 0) throw Error("cannot read `" + path_member + "`: " + std::strerror(errno));
      if (r == 0) break;
      got += size_t(r);
    }
    return got;
  }

 private:
  std::string path_member;
  int fd_member = -1;
};

std::string printable(unsigned char c) {
  if (c >= 0x21 && c < 0x7f) return std::string("'") + char(c) + "'";
  char text[8];
  std::snprintf(text, sizeof text, "0x%02x", c);
  return text;
}

// Turns lines into records under the invalid-input policy.
class RecordBuilder {
 public:
  RecordBuilder(const Segment& segment, Policy policy, Parsed& out, bool local_lines,
                bool owns_start)
      : segment_member(segment),
        policy_member(policy),
        out_member(out),
        local_lines_member(local_lines),
        owning_member(owns_start) {}

  bool owning() const { return owning_member; }

  void header(const char* p, size_t n, std::int64_t line, std::int64_t position, bool owned) {
    closeRecord();
    orphan_run_member = false;
    owning_member = owned;
    if (!owned) return;
    in_record_member = true;
    bad_member = false;
    star_line_member = -1;
    record_line_member = line;
    record_position_member = position;
    record_start_member = out_member.tokens.size();
    size_t k = 1;
    while (k < n && (p[k] == ' ' || p[k] == '\t')) ++k;
    size_t e = k;
    while (e < n && !std::isspace(static_cast<unsigned char>(p[e]))) ++e;
    record_id_member.assign(p + k, e - k);
  }

  void sequence(const char* p, size_t n, std::int64_t line) {
    if (!in_record_member) {
      if (!owning_member || orphan_run_member) return;
      for (size_t k = 0; k < n; ++k) {
        if (id_table.id[static_cast<unsigned char>(p[k])] != 0) {
          orphan_run_member = true;
          issue(Problem::sequence_before_header, line,
                "sequence data before the first '>' header line (is this a FASTA file?); add a "
                "header "
                "line, or pass --on-invalid skip to drop these lines");
          return;
        }
      }
      return;
    }
    if (bad_member) return;
    // Residues are written through a pointer into room made for the whole line (the hot loop).
    auto& tokens = out_member.tokens;
    const size_t base = tokens.size();
    tokens.resize(base + n);
    std::uint8_t* out = tokens.data() + base;
    size_t m = 0;
    for (size_t k = 0; k < n; ++k) {
      const unsigned char c = static_cast<unsigned char>(p[k]);
      const int id = id_table.id[c];
      if (id > 0) {
        if (star_line_member >= 0) {
          markBad(star_line_member, star_column_member, '*', " ('*' may only end a sequence)");
          break;
        }
        out[m++] = static_cast<std::uint8_t>(id);
      } else if (id < 0) {
        if (c == '*' && star_line_member < 0) {
          star_line_member = line;
          star_column_member = std::int64_t(k) + 1;
          continue;
        }
        markBad(line, std::int64_t(k) + 1, c,
                c == '-' || c == '.' ? " (an alignment gap: give unaligned sequences)" : "");
        break;
      }
    }
    tokens.resize(base + m);
  }

  // The input ended (or was cut): close the record in progress.
  void finish() { closeRecord(); }

  void streamError(Problem problem, std::int64_t line, const std::string& detail) {
    if (!owning_member) return;
    if (in_record_member) {
      out_member.tokens.resize(record_start_member);
      in_record_member = false;
    }
    issue(problem, line, detail);
  }

 private:
  void markBad(std::int64_t line, std::int64_t column, unsigned char c, const char* note) {
    bad_member = true;
    bad_line_member = line;
    bad_detail_member =
        "record `" + record_id_member + "` has the character " + printable(c) + " at column " +
        std::to_string(column) + ", which is not an amino-acid letter of the ESM-2 alphabet (" +
        vocab::letters + ", either case, one optional final '*')" + note +
        "; fix or remove the record, or pass --on-invalid skip to drop such records";
  }

  void closeRecord() {
    if (!in_record_member) return;
    in_record_member = false;
    auto& tokens = out_member.tokens;
    if (bad_member) {
      tokens.resize(record_start_member);
      issue(Problem::invalid_character, bad_line_member, bad_detail_member);
      return;
    }
    if (tokens.size() == record_start_member) {
      issue(Problem::empty_sequence, record_line_member,
            "record `" + record_id_member +
                "` has no residues; remove it, or pass --on-invalid skip to drop empty records");
      return;
    }
    const std::int64_t length = std::int64_t(tokens.size() - record_start_member);
    const Notice notice{segment_member.file, record_line_member, local_lines_member,
                        out_member.lengths.size()};
    if (looksLikeNucleotides(tokens.data() + record_start_member, length))
      out_member.nucleotide.push_back(notice);
    if (record_id_member.empty()) out_member.unnamed.push_back(notice);
    out_member.lengths.push_back(length);
    out_member.ids.push_back(record_id_member);
    out_member.order.push_back((std::uint64_t(segment_member.file) << 44) |
                               std::uint64_t(record_position_member));
  }

  void issue(Problem problem, std::int64_t line, const std::string& detail) {
    ++out_member.issue_counts[int(problem)];
    if (out_member.issues.size() < max_kept_issues)
      out_member.issues.push_back(
          {problem, segment_member.file, line, local_lines_member, segment_member.path, detail});
    if (policy_member == Policy::error) out_member.stopped = true;
  }

  const Segment& segment_member;
  Policy policy_member;
  Parsed& out_member;
  bool local_lines_member;
  bool owning_member;              // the current line belongs to this rank
  bool orphan_run_member = false;  // a run of sequence lines before any header was reported
  bool in_record_member = false;
  bool bad_member = false;
  std::int64_t bad_line_member = 0;
  std::string bad_detail_member;
  std::int64_t star_line_member = -1, star_column_member = 0;
  std::int64_t record_line_member = 0, record_position_member = 0;
  size_t record_start_member = 0;
  std::string record_id_member;
};

// Splits a byte stream into lines, carrying a partial line across blocks. Calls
// handle(line, length, line_start_position, line_start_tag, line_index) for every line;
// handle returns false to stop.
template <class Handle> class LineSplitter {
 public:
  LineSplitter(std::int64_t first_position, Handle handle)
      : next_position_member(first_position), handle_member(std::move(handle)) {}

  // Returns false once handle asked to stop.
  bool feed(const char* data, size_t n, std::int64_t tag) {
    size_t k = 0;
    while (k < n) {
      const char* nl = static_cast<const char*>(std::memchr(data + k, '\n', n - k));
      size_t stop = nl ? size_t(nl - data) : n;
      if (!nl) {
        if (carry_member.empty()) carry_tag_member = tag;
        carry_member.append(data + k, stop - k);
        return true;
      }
      bool go;
      if (carry_member.empty()) {
        go = emit(data + k, stop - k, tag);
      } else {
        carry_member.append(data + k, stop - k);
        go = emit(carry_member.data(), carry_member.size(), carry_tag_member);
        carry_member.clear();
      }
      if (!go) return false;
      k = stop + 1;
    }
    return true;
  }

  // The last line when the input does not end with '\n'.
  bool finish() {
    if (carry_member.empty()) return true;
    bool go = emit(carry_member.data(), carry_member.size(), carry_tag_member);
    carry_member.clear();
    return go;
  }

  std::int64_t lines() const { return lines_member; }

 private:
  bool emit(const char* line, size_t n, std::int64_t tag) {
    std::int64_t position = next_position_member;
    next_position_member += std::int64_t(n) + 1;
    return handle_member(line, n, position, tag, lines_member++);
  }

  std::int64_t next_position_member;
  std::int64_t lines_member = 0;  // lines completed so far
  std::string carry_member;
  std::int64_t carry_tag_member = 0;
  Handle handle_member;
};

SegmentStats parsePlain(const Segment& s, Policy policy, Parsed& out,
                        const std::function<void(std::int64_t)>& progress) {
  SegmentStats stats;
  InputFile file(s.path);
  bool skip_partial = false;
  if (s.begin > 0) {
    char previous = 0;
    file.read(&previous, 1, s.begin - 1);
    skip_partial = previous != '\n';
  }
  RecordBuilder builder(s, policy, out, /*local_lines=*/true, /*owns_start=*/s.begin == 0);
  auto handle = [&](const char* line, size_t n, std::int64_t position, std::int64_t,
                    std::int64_t index) {
    if (skip_partial) {  // the tail of the previous rank's line
      skip_partial = false;
      return true;
    }
    if (n > 0 && line[0] == '>') {
      if (position >= s.end) return false;  // the next rank's record
      builder.header(line, n, index, position, true);
    } else if (n > 0 && line[0] == ';') {
      // an old-style FASTA comment line
    } else {
      builder.sequence(line, n, index);
    }
    return !out.stopped;
  };
  LineSplitter<decltype(handle)> splitter(s.begin, handle);
  std::vector<char> buffer(read_block);
  std::int64_t position = s.begin;
  bool go = true;
  while (go && position < s.file_size) {
    size_t n =
        file.read(buffer.data(), size_t(std::min<std::int64_t>(read_block, s.file_size - position)),
                  position);
    if (n == 0) break;
    stats.bytes_read += std::int64_t(n);
    if (position < s.end) {
      size_t in_range = size_t(std::min<std::int64_t>(std::int64_t(n), s.end - position));
      stats.newlines_in_range += std::count(buffer.data(), buffer.data() + in_range, '\n');
    }
    go = splitter.feed(buffer.data(), n, 0);
    position += std::int64_t(n);
    if (progress) progress(std::int64_t(n));
  }
  if (go) splitter.finish();
  builder.finish();
  return stats;
}

SegmentStats parseGzip(const Segment& s, Policy policy, Parsed& out,
                       const std::function<void(std::int64_t)>& progress) {
  SegmentStats stats;
  InputFile file(s.path);
  z_stream z{};
  if (inflateInit2(&z, 15 + 32) != Z_OK) throw Error("zlib: inflateInit2 failed");
  struct Closer {
    z_stream* z;
    ~Closer() { inflateEnd(z); }
  } closer{&z};

  RecordBuilder builder(s, policy, out, /*local_lines=*/false, /*owns_start=*/s.begin == 0);
  auto handle = [&](const char* line, size_t n, std::int64_t position, std::int64_t tag,
                    std::int64_t index) {
    if (n > 0 && line[0] == '>') {
      if (tag >= s.end) return false;
      builder.header(line, n, index + 1, position, tag >= s.begin);
    } else if (n > 0 && line[0] == ';') {
    } else {
      builder.sequence(line, n, index + 1);
    }
    return !out.stopped;
  };
  LineSplitter<decltype(handle)> splitter(0, handle);
  // The compressed bytes fed per call set the granularity at which ranks share a gzip file.
  // PLM_PREP_GZIP_CHUNK (bytes) overrides it so that tests can split small files.
  size_t chunk = size_t(1) << 20;
  if (const char* knob = std::getenv("PLM_PREP_GZIP_CHUNK"))
    chunk = std::max<size_t>(64, size_t(std::atoll(knob)));
  std::vector<char> input(chunk), output(read_block);
  std::int64_t read_position = 0;  // compressed bytes read from the file
  bool eof = false, go = true;
  while (go) {
    if (z.avail_in == 0 && !eof) {
      size_t n = file.read(input.data(), input.size(), read_position);
      if (n == 0) eof = true;
      read_position += std::int64_t(n);
      stats.bytes_read += std::int64_t(n);
      if (progress) progress(std::int64_t(n));
      z.next_in = reinterpret_cast<Bytef*>(input.data());
      z.avail_in = uInt(n);
    }
    // The compressed position that owns this call's output: bytes consumed before the call.
    std::int64_t tag =
        std::min<std::int64_t>(read_position - std::int64_t(z.avail_in), s.file_size - 1);
    z.next_out = reinterpret_cast<Bytef*>(output.data());
    z.avail_out = uInt(output.size());
    int rc = inflate(&z, Z_NO_FLUSH);
    size_t produced = output.size() - z.avail_out;
    if (tag >= s.begin && tag < s.end) stats.bytes_inflated += std::int64_t(produced);
    if (produced) go = splitter.feed(output.data(), produced, tag);
    if (!go) break;
    if (rc == Z_STREAM_END) {
      if (z.avail_in == 0 && !eof) {  // is another gzip member next?
        size_t n = file.read(input.data(), input.size(), read_position);
        read_position += std::int64_t(n);
        stats.bytes_read += std::int64_t(n);
        if (n == 0) eof = true;
        z.next_in = reinterpret_cast<Bytef*>(input.data());
        z.avail_in = uInt(n);
      }
      if (z.avail_in == 0) {
        if (splitter.finish()) builder.finish();
        return stats;
      }
      inflateReset(&z);
      continue;
    }
    if (rc == Z_OK) continue;
    if (rc == Z_BUF_ERROR && !(eof && z.avail_in == 0)) continue;
    // The stream cannot go on: cut short, or damaged.
    splitter.finish();
    std::int64_t line = splitter.lines();
    if (rc == Z_BUF_ERROR) {
      builder.streamError(
          Problem::truncated_gzip, line,
          "the gzip stream ends early, after this line (the file is truncated: an interrupted "
          "download or copy?); re-download or recompress it, or pass --on-invalid skip to keep "
          "the complete records before the cut");
    } else {
      builder.streamError(
          Problem::corrupt_gzip, line,
          std::string("the gzip data is damaged after this line (zlib: ") +
              (z.msg ? z.msg : "error") +
              "); re-download or recompress the file, or pass --on-invalid skip to keep the "
              "complete records before the damage");
    }
    builder.finish();
    return stats;
  }
  builder.finish();
  return stats;
}

}  // namespace

int residueId(unsigned char c) { return id_table.id[c]; }

bool looksLikeNucleotides(const std::uint8_t* residues, std::int64_t length) {
  if (length < nucleotide_min_length) return false;
  static const auto is_nucleotide = [] {
    std::array<bool, 256> table{};
    for (unsigned char c : {'A', 'C', 'G', 'T', 'U', 'N'})
      table[std::size_t(id_table.id[c])] = true;
    return table;
  }();
  // Stops at the first residue that makes the fraction unreachable: a protein costs a few dozen
  // look-ups, not a pass over its residues.
  const std::int64_t allowed = length * (100 - nucleotide_percent) / 100;
  std::int64_t others = 0;
  for (std::int64_t k = 0; k < length; ++k)
    if (!is_nucleotide[residues[k]] && ++others > allowed) return false;
  return true;
}

SegmentStats parseSegment(const Segment& segment, Policy policy, Parsed& out,
                          const std::function<void(std::int64_t)>& progress) {
  if (segment.begin >= segment.end) return {};
  return segment.gzip ? parseGzip(segment, policy, out, progress)
                      : parsePlain(segment, policy, out, progress);
}

std::uint32_t fileCrc32(const std::string& path, std::int64_t begin, std::int64_t end) {
  uLong crc = crc32(0L, Z_NULL, 0);
  if (begin >= end) return std::uint32_t(crc);
  InputFile file(path);
  std::vector<char> buffer(read_block);
  for (std::int64_t position = begin; position < end;) {
    size_t n = file.read(buffer.data(), size_t(std::min<std::int64_t>(read_block, end - position)),
                         position);
    if (n == 0)
      throw Error("`" + path + "` is shorter than expected (was it modified during plm prep?)");
    crc = crc32(crc, reinterpret_cast<const Bytef*>(buffer.data()), uInt(n));
    position += std::int64_t(n);
  }
  return std::uint32_t(crc);
}

}  // namespace plm::io::fasta
