#include "data/prep.hpp"

#include "core/clock.hpp"
#include "core/error.hpp"
#include "core/fault.hpp"
#include "core/log.hpp"
#include "data/random.hpp"
#include "dist/process_groups.hpp"
#include "io/dataset.hpp"
#include "plm/plm_config.hpp"

#include <zlib.h>

#include <sys/stat.h>
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <numeric>
#include <unordered_map>

namespace plm::data {

namespace {

using io::fasta::Issue;
using io::fasta::Parsed;
using io::fasta::Policy;
using io::fasta::Segment;
using Clock = std::chrono::steady_clock;

struct InputFile {
  std::string path;
  std::int64_t size = 0;
  bool gzip = false;
  bool valid = false;  // a --valid file
};

std::vector<InputFile> describeInputs(const PrepOptions& options) {
  std::vector<InputFile> files;
  auto add = [&](const std::string& path, bool valid) {
    const Segment whole = wholeFile(path, "plm prep");
    files.push_back(InputFile{path, whole.file_size, whole.gzip, valid});
  };
  // --valid files first: with equal content, the earlier record is the one kept, so a sequence
  // in the validation file is never also trained on.
  for (const auto& p : options.valid_inputs) add(p, true);
  for (const auto& p : options.inputs) add(p, false);
  return files;
}

// Rank r owns bytes [r*T/W, (r+1)*T/W) of the inputs laid end to end.
std::vector<Segment> segmentsOf(const std::vector<InputFile>& files, int rank, int world) {
  std::int64_t total = 0;
  for (const auto& f : files) total += f.size;
  auto bound = [&](int r) { return std::int64_t((static_cast<__int128>(total) * r) / world); };
  const std::int64_t begin = bound(rank), end = bound(rank + 1);
  std::vector<Segment> segments;
  std::int64_t file_start = 0;
  for (size_t i = 0; i < files.size(); ++i) {
    const std::int64_t b = std::max(begin, file_start),
                       e = std::min(end, file_start + files[i].size);
    if (b < e)
      segments.push_back(
          {int(i), files[i].path, files[i].gzip, files[i].size, b - file_start, e - file_start});
    file_start += files[i].size;
  }
  return segments;
}

// Every rank's strings, in rank order, on every rank.
std::vector<std::string> allgatherStrings(const std::vector<std::string>& local, MPI_Comm comm) {
  const int world = dist::commSize(comm);
  std::string packed;
  for (const auto& s : local) packed.append(s).push_back('\0');
  int size = int(packed.size());
  std::vector<int> sizes(world), displs(world, 0);
  PLM_CHECK_MPI(MPI_Allgather(&size, 1, MPI_INT, sizes.data(), 1, MPI_INT, comm));
  for (int r = 1; r < world; ++r) displs[r] = displs[r - 1] + sizes[r - 1];
  std::string all(size_t(displs[world - 1] + sizes[world - 1]), '\0');
  PLM_CHECK_MPI(MPI_Allgatherv(packed.data(), size, MPI_CHAR, all.data(), sizes.data(),
                               displs.data(), MPI_CHAR, comm));
  std::vector<std::string> out;
  size_t start = 0;
  for (size_t k = 0; k < all.size(); ++k) {
    if (all[k] == '\0') {
      out.emplace_back(all, start, k - start);
      start = k + 1;
    }
  }
  return out;
}

// Exact duplicates: each hash goes to owner rank hash.hi % world, which keeps the record with
// the smallest input order among equal hashes. Returns a keep flag per local record.
std::vector<char> findFirstOccurrences(const std::vector<random::Hash128>& hashes,
                                       const std::vector<std::uint64_t>& order, MPI_Comm comm) {
  const int world = dist::commSize(comm);
  const size_t n = hashes.size();
  std::vector<int> send_counts(world, 0), send_displs(world, 0), recv_counts(world),
      recv_displs(world, 0);
  std::vector<int> owner(n);
  for (size_t i = 0; i < n; ++i) {
    owner[i] = int(hashes[i].hi % std::uint64_t(world));
    ++send_counts[owner[i]];
  }
  for (int r = 1; r < world; ++r) send_displs[r] = send_displs[r - 1] + send_counts[r - 1];
  std::vector<std::uint64_t> send(3 * n);
  std::vector<size_t> slot(n);  // where record i went in the send buffer
  {
    std::vector<int> fill(send_displs);
    for (size_t i = 0; i < n; ++i) {
      size_t s = size_t(fill[owner[i]]++);
      slot[i] = s;
      send[3 * s] = hashes[i].lo;
      send[3 * s + 1] = hashes[i].hi;
      send[3 * s + 2] = order[i];
    }
  }
  PLM_CHECK_MPI(MPI_Alltoall(send_counts.data(), 1, MPI_INT, recv_counts.data(), 1, MPI_INT, comm));
  for (int r = 1; r < world; ++r) recv_displs[r] = recv_displs[r - 1] + recv_counts[r - 1];
  const size_t received = size_t(recv_displs[world - 1] + recv_counts[world - 1]);
  std::vector<std::uint64_t> recv(3 * received);
  auto times3 = [](std::vector<int> v) {
    for (auto& x : v) x *= 3;
    return v;
  };
  PLM_CHECK_MPI(MPI_Alltoallv(send.data(), times3(send_counts).data(), times3(send_displs).data(),
                              MPI_UINT64_T, recv.data(), times3(recv_counts).data(),
                              times3(recv_displs).data(), MPI_UINT64_T, comm));
  std::vector<size_t> sorted(received);
  std::iota(sorted.begin(), sorted.end(), size_t(0));
  std::sort(sorted.begin(), sorted.end(), [&](size_t a, size_t b) {
    for (int k : {1, 0, 2})
      if (recv[3 * a + k] != recv[3 * b + k]) return recv[3 * a + k] < recv[3 * b + k];
    return false;
  });
  std::vector<char> keep_received(received, 0);
  for (size_t k = 0; k < received; ++k) {
    size_t i = sorted[k];
    bool first = k == 0 || recv[3 * i] != recv[3 * sorted[k - 1]] ||
                 recv[3 * i + 1] != recv[3 * sorted[k - 1] + 1];
    keep_received[i] = first ? 1 : 0;
  }
  std::vector<char> keep_sent(n);
  PLM_CHECK_MPI(MPI_Alltoallv(keep_received.data(), recv_counts.data(), recv_displs.data(),
                              MPI_CHAR, keep_sent.data(), send_counts.data(), send_displs.data(),
                              MPI_CHAR, comm));
  std::vector<char> keep(n);
  for (size_t i = 0; i < n; ++i) keep[i] = keep_sent[slot[i]];
  return keep;
}

void removeQuietly(const std::string& path) { std::remove(path.c_str()); }

// Valid records that are probably a mistake. Nucleotide sequences (every letter of A C G T U N
// is an amino-acid letter too) get a warning, and an error where they are most of a file's
// records unless --allow-nucleotide; a header with no identifier gets one made from its place
// ("unnamed:FILE:LINE", the same at any rank count) and a warning. Collective.
void checkNotices(const std::string& command, const std::vector<std::string>& files,
                  const std::vector<std::int64_t>& line_base, bool allow_nucleotide, Parsed& parsed,
                  RecordChecks& report, MPI_Comm comm) {
  const int rank = dist::commRank(comm);
  const std::size_t num_files = files.size();
  // Per file: records, nucleotide-like records; then the number of unnamed records.
  std::vector<std::int64_t> local(2 * num_files + 1, 0), global(2 * num_files + 1, 0);
  for (std::uint64_t order : parsed.order) ++local[order >> 44];
  for (const auto& n : parsed.nucleotide) ++local[num_files + std::size_t(n.file)];
  local[2 * num_files] = std::int64_t(parsed.unnamed.size());
  PLM_CHECK_MPI(
      MPI_Allreduce(local.data(), global.data(), int(local.size()), MPI_INT64_T, MPI_SUM, comm));
  auto line = [&](const io::fasta::Notice& n) {
    return n.line_is_local ? n.line + line_base[std::size_t(n.file)] + 1 : n.line;
  };
  auto where = [&](const io::fasta::Notice& n) {
    return files[std::size_t(n.file)] + ":" + std::to_string(line(n));
  };
  // The first notice in input order over all ranks, as "path:line: record `id`".
  auto first = [&](const std::vector<io::fasta::Notice>& notices) {
    std::vector<std::string> mine;
    if (!notices.empty()) {
      char key[64];
      std::snprintf(key, sizeof key, "%08d%020lld", notices.front().file,
                    static_cast<long long>(line(notices.front())));
      mine.push_back(std::string(key) + where(notices.front()) + ": record `" +
                     parsed.ids[notices.front().record] + "`");
    }
    auto all = allgatherStrings(mine, comm);
    return *std::min_element(all.begin(), all.end());
  };

  std::int64_t nucleotide = 0;
  for (std::size_t f = 0; f < num_files; ++f) nucleotide += global[num_files + f];
  if (nucleotide > 0) {
    const std::string example = first(parsed.nucleotide).substr(28);
    const std::string what =
        "record(s) look like nucleotide sequences (at least " +
        std::to_string(io::fasta::nucleotide_percent) + "% A, C, G, T/U, N and at least " +
        std::to_string(io::fasta::nucleotide_min_length) + " long), the first at " + example;
    for (std::size_t f = 0; f < num_files; ++f) {
      const std::int64_t records = global[f], like = global[num_files + f];
      if (like > 0 && 2 * like > records && !allow_nucleotide)
        throw collectiveError(command + ": " + files[f] + ": " + std::to_string(like) + " of its " +
                              std::to_string(records) + " " + what +
                              ": plm models protein sequences; translate them first, or pass "
                              "--allow-nucleotide to keep them as protein");
    }
    if (rank == 0)
      log::warn("%s: %lld %s; they are kept as protein", command.c_str(),
                static_cast<long long>(nucleotide), what.c_str());
  }
  report.nucleotide_records = nucleotide;

  const std::int64_t unnamed = global[2 * num_files];
  if (unnamed > 0) {
    const std::string example = first(parsed.unnamed).substr(28);
    for (const auto& n : parsed.unnamed) {
      const std::string path = files[std::size_t(n.file)];
      parsed.ids[n.record] =
          "unnamed:" + path.substr(path.find_last_of('/') + 1) + ":" + std::to_string(line(n));
    }
    if (rank == 0)
      log::warn(
          "%s: %lld record(s) have an empty identifier ('>' alone), the first at %s; each "
          "is named unnamed:FILE:LINE after its header",
          command.c_str(), static_cast<long long>(unnamed), example.c_str());
  }
  report.unnamed_records = unnamed;
}

}  // namespace

RecordChecks checkRecords(const std::string& command, const std::vector<std::string>& files,
                          const std::vector<std::int64_t>& line_base, Policy on_invalid,
                          bool allow_nucleotide, Parsed& parsed, MPI_Comm comm) {
  const int rank = dist::commRank(comm);
  for (auto& issue : parsed.issues) {
    if (issue.line_is_local) issue.line += line_base[issue.file] + 1;
    issue.line_is_local = false;
  }
  std::array<std::int64_t, io::fasta::num_problems> counts{};
  PLM_CHECK_MPI(MPI_Allreduce(parsed.issue_counts.data(), counts.data(), io::fasta::num_problems,
                              MPI_INT64_T, MPI_SUM, comm));
  std::int64_t total_issues = std::accumulate(counts.begin(), counts.end(), std::int64_t(0));

  if (total_issues > 0) {
    std::vector<std::string> lines;
    for (const auto& issue : parsed.issues) {
      char key[64];
      std::snprintf(key, sizeof key, "%08d%020lld", issue.file, static_cast<long long>(issue.line));
      lines.push_back(std::string(key) + issue.message());
    }
    auto all = allgatherStrings(lines, comm);
    std::sort(all.begin(), all.end());
    if (on_invalid == Policy::error) throw collectiveError(command + ": " + all.front().substr(28));
    if (rank == 0) {
      for (const auto& line : all)
        log::warn("%s: skipped: %s", command.c_str(), line.substr(28).c_str());
      std::string summary;
      for (int p = 0; p < io::fasta::num_problems; ++p)
        if (counts[p])
          summary += std::string(summary.empty() ? "" : ", ") + std::to_string(counts[p]) + " " +
                     io::fasta::problemName(io::fasta::Problem(p));
      log::warn(
          "%s: skipped %lld invalid record(s) (%s)%s", command.c_str(),
          static_cast<long long>(total_issues), summary.c_str(),
          all.size() < size_t(total_issues) ? "; the first of each rank are listed above" : "");
    }
  }
  RecordChecks report;
  report.skipped = total_issues;
  report.skipped_by_problem = counts;
  checkNotices(command, files, line_base, allow_nucleotide, parsed, report, comm);
  return report;
}

io::fasta::Segment wholeFile(const std::string& path, const std::string& command) {
  struct stat info;
  if (stat(path.c_str(), &info) != 0)
    throw collectiveError(command + ": input `" + path + "` cannot be read (" +
                          std::strerror(errno) + "); check the path");
  if (!S_ISREG(info.st_mode))
    throw collectiveError(command + ": input `" + path + "` is not a regular file");
  Segment s;
  s.path = path;
  s.file_size = std::int64_t(info.st_size);
  s.begin = 0;
  s.end = s.file_size;
  if (FILE* stream = std::fopen(path.c_str(), "rb")) {
    unsigned char magic[2] = {0, 0};
    size_t n = std::fread(magic, 1, 2, stream);
    std::fclose(stream);
    s.gzip = n == 2 && magic[0] == 0x1f && magic[1] == 0x8b;
  }
  return s;
}

/// Every rank's first problem, agreed on: the lowest rank's message is everyone's error.
void agreeOnError(const std::string& mine, MPI_Comm comm) {
  const int rank = dist::commRank(comm);
  int flag = mine.empty() ? INT32_MAX : 0, first = INT32_MAX;
  if (flag == 0) flag = rank;
  PLM_CHECK_MPI(MPI_Allreduce(&flag, &first, 1, MPI_INT, MPI_MIN, comm));
  if (first == INT32_MAX) return;
  throw collectiveError(dist::broadcastString(mine, comm, first));
}

std::string trimmed(std::string s) {
  while (!s.empty() && (s.back() == '\r' || s.back() == ' ' || s.back() == '\t')) s.pop_back();
  std::size_t b = 0;
  while (b < s.size() && (s[b] == ' ' || s[b] == '\t')) ++b;
  return s.substr(b);
}

/// --labels and --residue-labels: read on every rank (they are small next to the FASTA), looked
/// up by the kept records' ids.  Refuses a missing id, a duplicate id, a bad value and a
/// residue string whose length is not the sequence's, naming the file, line and id.
void attachLabels(const PrepOptions& options, io::SequenceShard& train, io::SequenceShard& valid,
                  MPI_Comm comm) {
  std::string problem;
  if (!options.labels.empty()) {
    std::unordered_map<std::string, double> table;
    std::FILE* f = std::fopen(options.labels.c_str(), "rb");
    if (!f) {
      problem = "plm prep: --labels `" + options.labels + "` cannot be read (" +
                std::strerror(errno) + ")";
    } else {
      char* line = nullptr;
      std::size_t cap = 0;
      std::int64_t number = 0;
      while (problem.empty() && getline(&line, &cap, f) > 0) {
        ++number;
        std::string text = trimmed(line);
        while (!text.empty() && text.back() == '\n')
          text = trimmed(text.substr(0, text.size() - 1));
        if (text.empty()) continue;
        const auto comma = text.find(',');
        const std::string where = options.labels + ":" + std::to_string(number);
        if (number == 1) {
          if (comma == std::string::npos || trimmed(text.substr(0, comma)) != "id" ||
              trimmed(text.substr(comma + 1)) != "label")
            problem = "plm prep: " + where + ": the first line must be the header `id,label`";
          continue;
        }
        if (comma == std::string::npos) {
          problem = "plm prep: " + where + ": expected `id,label`, got `" + text + "`";
          break;
        }
        const std::string id = trimmed(text.substr(0, comma)),
                          value = trimmed(text.substr(comma + 1));
        char* end = nullptr;
        const double x = std::strtod(value.c_str(), &end);
        if (value.empty() || *end != '\0' || !std::isfinite(x))
          problem = "plm prep: " + where + ": label `" + value + "` of id `" + id +
                    "` is not a finite number";
        else if (!table.emplace(id, x).second)
          problem = "plm prep: " + where + ": id `" + id + "` has a second label";
      }
      std::free(line);
      std::fclose(f);
    }
    for (auto* shard : {&train, &valid}) {
      shard->labels.clear();
      for (const auto& id : shard->ids) {
        if (!problem.empty()) break;
        const auto it = table.find(id);
        if (it == table.end())
          problem = "plm prep: record `" + id + "` has no row in --labels `" + options.labels +
                    "`; add one (every kept record needs a label)";
        else
          shard->labels.push_back(it->second);
      }
    }
  }
  if (problem.empty() && !options.residue_labels.empty()) {
    std::unordered_map<std::string, std::string> table;
    std::FILE* f = std::fopen(options.residue_labels.c_str(), "rb");
    if (!f) {
      problem = "plm prep: --residue-labels `" + options.residue_labels + "` cannot be read (" +
                std::strerror(errno) + ")";
    } else {
      char* line = nullptr;
      std::size_t cap = 0;
      std::string id;
      std::int64_t number = 0;
      while (problem.empty() && getline(&line, &cap, f) > 0) {
        ++number;
        std::string text = trimmed(line);
        while (!text.empty() && text.back() == '\n')
          text = trimmed(text.substr(0, text.size() - 1));
        if (text.empty()) continue;
        if (text[0] == '>') {
          id = text.substr(1, text.find_first_of(" \t") == std::string::npos
                                  ? std::string::npos
                                  : text.find_first_of(" \t") - 1);
          if (!table.emplace(id, std::string()).second)
            problem = "plm prep: " + options.residue_labels + ":" + std::to_string(number) +
                      ": id `" + id + "` appears twice";
          continue;
        }
        if (id.empty()) {
          problem = "plm prep: " + options.residue_labels + ":" + std::to_string(number) +
                    ": label text before the first `>id` line";
          break;
        }
        for (char c : text)
          if (!((c >= '0' && c <= '9') || c == '.' || c == '-')) {
            problem = "plm prep: " + options.residue_labels + ":" + std::to_string(number) +
                      ": character `" + std::string(1, c) + "` in the labels of `" + id +
                      "`; use 0-9 (class) or . / - (no label)";
            break;
          }
        table[id] += text;
      }
      std::free(line);
      std::fclose(f);
    }
    for (auto* shard : {&train, &valid}) {
      shard->residue_labels.clear();
      for (std::size_t i = 0; i < shard->ids.size() && problem.empty(); ++i) {
        const auto& id = shard->ids[i];
        const auto length = std::size_t(shard->lengths[i]);
        const auto it = table.find(id);
        if (it == table.end()) {
          problem = "plm prep: record `" + id + "` has no entry in --residue-labels `" +
                    options.residue_labels + "`; add `>" + id + "` and its label string";
        } else if (it->second.size() != length) {
          problem = "plm prep: record `" + id + "`: " + std::to_string(it->second.size()) +
                    " residue labels in `" + options.residue_labels + "` for a sequence of " +
                    std::to_string(length) + " residues; give one character per residue";
        } else {
          for (char c : it->second)
            shard->residue_labels.push_back(c >= '0' && c <= '9' ? std::int8_t(c - '0')
                                                                 : std::int8_t(-1));
        }
      }
    }
  }
  agreeOnError(problem, comm);
}

PrepReport prepare(const PrepOptions& options, MPI_Comm comm) {
  const auto start_time = Clock::now();
  const int rank = dist::commRank(comm), world = dist::commSize(comm);
  if (options.inputs.empty())
    throw collectiveError("plm prep: no FASTA input given; usage: plm prep INPUT... --out DIR");
  if (options.out_dir.empty()) throw collectiveError("plm prep: --out DIR is required");
  if (!(options.valid_fraction >= 0 && options.valid_fraction < 1))
    throw collectiveError("plm prep: --valid-fraction must be in [0, 1), got " +
                          std::to_string(options.valid_fraction));

  const auto files = describeInputs(options);
  const int num_files = int(files.size());
  PrepReport report;
  for (const auto& f : files) report.input_bytes += f.size;
  const bool by_file = !options.valid_inputs.empty();
  const bool write_valid = by_file || options.valid_fraction > 0;

  // 1. Parse this rank's segments, in input order.
  const auto segments = segmentsOf(files, rank, world);
  std::int64_t my_bytes = 0;
  for (const auto& s : segments) my_bytes += s.end - s.begin;
  Parsed parsed;
  std::vector<std::int64_t> newlines(num_files, 0);
  std::int64_t bytes_done = 0, fasta_bytes = 0;
  auto last_report = Clock::now();
  auto progress = [&](std::int64_t bytes) {
    bytes_done += bytes;
    if (rank != 0 || options.progress_seconds <= 0) return;
    auto now = Clock::now();
    if (std::chrono::duration<double>(now - last_report).count() < options.progress_seconds) return;
    last_report = now;
    double seconds = std::chrono::duration<double>(now - start_time).count();
    log::info(
        "plm prep: rank 0 has read %.0f%% of its share; %.1f MB/s per rank, about %.1f MB/s over "
        "%d ranks",
        100.0 * double(std::min(bytes_done, my_bytes)) /
            double(std::max<std::int64_t>(my_bytes, 1)),
        double(bytes_done) / seconds / 1e6, double(bytes_done) / seconds / 1e6 * world, world);
  };
  for (const auto& s : segments) {
    auto stats = io::fasta::parseSegment(s, options.on_invalid, parsed, progress);
    newlines[s.file] += stats.newlines_in_range;
    fasta_bytes += s.gzip ? stats.bytes_inflated : s.end - s.begin;
    if (parsed.stopped) break;
  }

  auto phase_start = Clock::now();
  auto lap = [&phase_start] {
    auto now = Clock::now();
    double seconds = std::chrono::duration<double>(now - phase_start).count();
    phase_start = now;
    return seconds;
  };
  report.parse_seconds = std::chrono::duration<double>(phase_start - start_time).count();

  // 2. Absolute line numbers: lines before this rank's part of each plain file.
  std::vector<std::int64_t> line_base(num_files, 0);
  PLM_CHECK_MPI(
      MPI_Exscan(newlines.data(), line_base.data(), num_files, MPI_INT64_T, MPI_SUM, comm));
  if (rank == 0) std::fill(line_base.begin(), line_base.end(), 0);

  // 3. The invalid-input policy and the notices, decided together.
  std::vector<std::string> paths;
  for (const auto& f : files) paths.push_back(f.path);
  const RecordChecks checks = checkRecords("plm prep", paths, line_base, options.on_invalid,
                                           options.allow_nucleotide, parsed, comm);
  report.skipped = checks.skipped;
  report.skipped_by_problem = checks.skipped_by_problem;
  report.nucleotide_records = checks.nucleotide_records;
  report.unnamed_records = checks.unnamed_records;

  // 4. Exact duplicates, across all ranks.
  const size_t n = parsed.lengths.size();
  std::vector<random::Hash128> hashes(n);
  {
    std::int64_t offset = 0;
    for (size_t i = 0; i < n; ++i) {
      hashes[i] = random::contentHash(parsed.tokens.data() + offset, size_t(parsed.lengths[i]));
      offset += parsed.lengths[i];
    }
  }
  const auto keep = findFirstOccurrences(hashes, parsed.order, comm);

  // 5. Split and shard, in input order.
  io::SequenceShard train, valid;
  {
    std::int64_t offset = 0;
    for (size_t i = 0; i < n; ++i) {
      const std::int64_t length = parsed.lengths[i];
      if (keep[i]) {
        bool is_valid = by_file ? files[parsed.order[i] >> 44].valid
                                : random::splitDraw(hashes[i]) < options.valid_fraction;
        auto& shard = is_valid ? valid : train;
        shard.tokens.insert(shard.tokens.end(), parsed.tokens.begin() + offset,
                            parsed.tokens.begin() + offset + length);
        shard.lengths.push_back(length);
        shard.ids.push_back(std::move(parsed.ids[i]));
      }
      offset += length;
    }
    parsed = Parsed();  // release the parse buffers before writing
  }
  attachLabels(options, train, valid, comm);
  std::int64_t local[6] = {std::int64_t(n),
                           std::int64_t(n) - std::int64_t(std::count(keep.begin(), keep.end(), 1)),
                           fasta_bytes,
                           0,
                           0,
                           0};
  std::int64_t global[6] = {0, 0, 0, 0, 0, 0};
  PLM_CHECK_MPI(MPI_Allreduce(local, global, 3, MPI_INT64_T, MPI_SUM, comm));
  report.records = global[0];
  report.duplicates = global[1];
  report.fasta_bytes = global[2];

  report.dedup_seconds = lap();

  // A run with nothing to train on is an error, so a pipeline stops here and not at `plm train`.
  {
    std::int64_t local_train = std::int64_t(train.lengths.size()), total_train = 0;
    PLM_CHECK_MPI(MPI_Allreduce(&local_train, &total_train, 1, MPI_INT64_T, MPI_SUM, comm));
    if (total_train == 0) {
      std::string reason;
      if (report.records == 0 && report.skipped > 0)
        reason = "every record was invalid and skipped (" + std::to_string(report.skipped) +
                 " skipped; the warnings above list them)";
      else if (report.records == 0)
        reason = "the input holds no FASTA record (empty file?)";
      else
        reason = "all " + std::to_string(report.records - report.duplicates) +
                 " distinct sequences went to the validation set" +
                 (by_file ? " (every input is a --valid file)" : "; lower --valid-fraction");
      throw collectiveError("plm prep: no training sequence: " + reason + "; nothing written");
    }
  }

  // 6. Checksums of the inputs: CRC-32 of each rank's byte range, combined in rank order.
  std::vector<std::uint32_t> crcs(size_t(num_files) * world, 0), my_crcs(num_files, 0);
  for (const auto& s : segments) my_crcs[s.file] = io::fasta::fileCrc32(s.path, s.begin, s.end);
  PLM_CHECK_MPI(MPI_Allgather(my_crcs.data(), num_files, MPI_UINT32_T, crcs.data(), num_files,
                              MPI_UINT32_T, comm));
  io::DatasetMetadata metadata;
  for (int f = 0; f < num_files; ++f) {
    uLong crc = crc32(0L, Z_NULL, 0);
    for (int r = 0; r < world; ++r) {
      for (const auto& s : segmentsOf(files, r, world))
        if (s.file == f) crc = crc32_combine(crc, crcs[size_t(r) * num_files + f], s.end - s.begin);
    }
    metadata.sources.push_back({files[f].path, files[f].size, std::uint32_t(crc)});
  }
  metadata.valid_fraction = by_file ? 0.0 : options.valid_fraction;
  metadata.duplicates_removed = report.duplicates;
  metadata.skipped_records = report.skipped;
  metadata.command_line = options.command_line;
  metadata.plm_version = std::string(PLM_VERSION_STRING) + " (git " + PLM_GIT_REVISION + ")";
  metadata.created_utc = dist::broadcastString(rank == 0 ? clock::utcIso() : std::string(), comm);
  const std::string hash_rule = "h = plm-hash128 v1 of the residue ids (doc/data.md)";
  const std::string rule =
      by_file ? "valid = the records of the --valid files; exact duplicates removed, a copy in "
                "the --valid files wins"
              : "valid iff unit(keyed(h.lo, h.hi, 6)) < valid_fraction; " + hash_rule;

  // 7. Write both splits under temporary names, then rename.
  const std::string dir = options.out_dir;
  if (rank == 0) {
    std::string partial;
    for (size_t k = 0; k <= dir.size(); ++k) {
      if (k == dir.size() || dir[k] == '/') {
        partial = dir.substr(0, k);
        if (!partial.empty()) ::mkdir(partial.c_str(), 0775);
      }
    }
  }
  struct stat dir_info;
  bool dir_ok = rank != 0 || (stat(dir.c_str(), &dir_info) == 0 && S_ISDIR(dir_info.st_mode));
  PLM_CHECK_MPI(MPI_Bcast(&dir_ok, 1, MPI_CXX_BOOL, 0, comm));
  if (!dir_ok) throw collectiveError("plm prep: cannot create the output directory `" + dir + "`");
  PLM_CHECK_MPI(MPI_Barrier(comm));

  struct Output {
    std::string name;
    io::SequenceShard* shard;
  };
  std::vector<Output> outputs = {{"train", &train}};
  if (write_valid) outputs.push_back({"valid", &valid});
  auto temporary = [&](const std::string& name) { return dir + "/." + name + ".h5.tmp"; };
  try {
    for (const auto& out : outputs) {
      metadata.split = out.name;
      metadata.split_rule = out.name == "train" ? "train = not valid: " + rule : rule;
      io::writeDataset(temporary(out.name), comm, *out.shard, metadata);
    }
  } catch (...) {
    // A crash leaves the temporary files behind (never a train.h5); an error removes them.
    // The test hook imitates the crash.
    if (rank == 0 && fault::datasetFailAfterBytes() < 0)
      for (const auto& out : outputs) removeQuietly(temporary(out.name));
    throw;
  }
  PLM_CHECK_MPI(MPI_Barrier(comm));
  if (rank == 0) {
    for (const auto& out : outputs) {
      std::string final_path = dir + "/" + out.name + ".h5";
      PLM_CHECK_SYS(std::rename(temporary(out.name).c_str(), final_path.c_str()) == 0,
                    ("rename " + temporary(out.name) + " -> " + final_path).c_str());
    }
    if (!write_valid) removeQuietly(dir + "/valid.h5");  // a stale split from an earlier run
  }
  PLM_CHECK_MPI(MPI_Barrier(comm));
  report.write_seconds = lap();
  for (const auto& out : outputs) report.outputs.push_back(dir + "/" + out.name + ".h5");

  std::int64_t sizes[4] = {std::int64_t(train.lengths.size()), std::int64_t(train.tokens.size()),
                           std::int64_t(valid.lengths.size()), std::int64_t(valid.tokens.size())};
  std::int64_t totals[4];
  PLM_CHECK_MPI(MPI_Allreduce(sizes, totals, 4, MPI_INT64_T, MPI_SUM, comm));
  report.train_sequences = totals[0];
  report.train_residues = totals[1];
  report.valid_sequences = totals[2];
  report.valid_residues = totals[3];
  report.seconds = std::chrono::duration<double>(Clock::now() - start_time).count();
  return report;
}

}  // namespace plm::data
