// Byte-range ownership in the FASTA parser: cutting a file into ranges at *every* byte position
// and parsing the ranges separately gives exactly the records of the whole file, with the same
// absolute line numbers for problems, for plain and gzip input.
#include "io/fasta.hpp"

#include <gtest/gtest.h>
#include <zlib.h>

#include <unistd.h>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

using namespace plm::io::fasta;

namespace {

const std::string text =
    ">a one\nACDEFGHIKL\nMNPQRSTVWY\n\n>b\r\nxbuzo*\r\n>c "
    "empty\n>d\nAC\nDE\nFG\n;comment\n>e\nAJC\n"
    ">f\nmkv\n>g\nACD*EF\n>h last\nWWWW";

std::string temporary(const std::string& name) {
  return "/tmp/plm-test-fasta-" + std::to_string(getpid()) + "-" + name;
}

struct Result {
  std::vector<std::string> ids;
  std::vector<std::int64_t> lengths;
  std::vector<std::uint8_t> tokens;
  std::vector<std::uint64_t> order;
  std::vector<std::pair<int, std::int64_t>> problems;  // (problem, absolute line)
  bool operator==(const Result& o) const {
    return ids == o.ids && lengths == o.lengths && tokens == o.tokens && order == o.order &&
           problems == o.problems;
  }
};

// Parses `path` as consecutive segments cut at `cuts`, fixing local lines the way prep does.
Result parseCut(const std::string& path, bool gzip, std::int64_t size,
                const std::vector<std::int64_t>& cuts) {
  Parsed parsed;
  std::vector<std::int64_t> bounds = {0};
  bounds.insert(bounds.end(), cuts.begin(), cuts.end());
  bounds.push_back(size);
  std::int64_t lines_before = 0;
  for (size_t k = 0; k + 1 < bounds.size(); ++k) {
    Parsed part;
    Segment s{0, path, gzip, size, bounds[k], bounds[k + 1]};
    auto stats = parseSegment(s, Policy::skip, part);
    for (auto& issue : part.issues)
      if (issue.line_is_local) issue.line += lines_before + 1;
    lines_before += stats.newlines_in_range;
    std::int64_t offset = 0;
    for (size_t i = 0; i < part.lengths.size(); ++i) offset += part.lengths[i];
    parsed.tokens.insert(parsed.tokens.end(), part.tokens.begin(), part.tokens.end());
    parsed.lengths.insert(parsed.lengths.end(), part.lengths.begin(), part.lengths.end());
    parsed.ids.insert(parsed.ids.end(), part.ids.begin(), part.ids.end());
    parsed.order.insert(parsed.order.end(), part.order.begin(), part.order.end());
    parsed.issues.insert(parsed.issues.end(), part.issues.begin(), part.issues.end());
  }
  Result r{parsed.ids, parsed.lengths, parsed.tokens, parsed.order, {}};
  for (const auto& issue : parsed.issues) r.problems.push_back({int(issue.problem), issue.line});
  return r;
}

}  // namespace

TEST(Fasta, WholeFileRecordsAndProblems) {
  const std::string path = temporary("whole.fasta");
  std::ofstream(path, std::ios::binary) << text;
  Result whole = parseCut(path, false, std::int64_t(text.size()), {});
  EXPECT_EQ(whole.ids, (std::vector<std::string>{"a", "b", "d", "f", "h"}));
  EXPECT_EQ(whole.lengths, (std::vector<std::int64_t>{20, 5, 6, 3, 4}));
  // c is empty (line 7), e has 'J' (line 14), g has an inner '*' (line 18).
  EXPECT_EQ(whole.problems,
            (std::vector<std::pair<int, std::int64_t>>{{int(Problem::empty_sequence), 7},
                                                       {int(Problem::invalid_character), 14},
                                                       {int(Problem::invalid_character), 18}}));
  EXPECT_EQ(residueId('l'), 4);
  EXPECT_EQ(residueId('O'), 28);
  EXPECT_EQ(residueId('\r'), 0);
  EXPECT_EQ(residueId('J'), -1);
  std::remove(path.c_str());
}

TEST(Fasta, EveryCutOfAPlainFileGivesTheWholeFileResult) {
  const std::string path = temporary("cut.fasta");
  std::ofstream(path, std::ios::binary) << text;
  const std::int64_t size = std::int64_t(text.size());
  Result whole = parseCut(path, false, size, {});
  for (std::int64_t a = 1; a < size; ++a) {
    ASSERT_TRUE(parseCut(path, false, size, {a}) == whole) << "cut at " << a;
    std::int64_t b = std::min(size - 1, a + 1 + a % 13);
    if (b > a)
      ASSERT_TRUE(parseCut(path, false, size, {a, b}) == whole) << "cuts at " << a << ", " << b;
  }
  std::remove(path.c_str());
}

TEST(Fasta, EveryCutOfAGzipFileGivesTheWholeFileResult) {
  setenv("PLM_PREP_GZIP_CHUNK", "64", 1);
  std::string big;
  for (int k = 0; k < 5; ++k) big += text + "\n";  // 15 problems: all kept (max_kept_issues)
  const std::string path = temporary("cut.fasta.gz");
  gzFile out = gzopen(path.c_str(), "wb1");
  gzwrite(out, big.data(), unsigned(big.size()));
  gzclose(out);
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  const std::int64_t size = std::int64_t(in.tellg());
  Result whole = parseCut(path, true, size, {});
  EXPECT_EQ(whole.ids.size(), 25u);
  ASSERT_EQ(whole.problems.size(), 15u);
  const std::int64_t lines_per_copy = std::count(text.begin(), text.end(), '\n') + 1;
  EXPECT_EQ(whole.problems.back().second,
            4 * lines_per_copy + 18);  // line numbers run on through the file
  for (std::int64_t a = 1; a < size; a += 7)
    ASSERT_TRUE(parseCut(path, true, size, {a}) == whole) << "cut at " << a;
  unsetenv("PLM_PREP_GZIP_CHUNK");
  std::remove(path.c_str());
}
