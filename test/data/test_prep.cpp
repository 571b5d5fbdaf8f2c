// plm prep at 1, 2 and 4 ranks: exact round trip of real-world FASTA (plain and gzip, split
// across ranks mid-record), every invalid-input case under both policies, duplicates, the
// split rule, and interrupted writes.
#include "data/prep.hpp"
#include "data/random.hpp"
#include "data_testing.hpp"
#include "io/dataset.hpp"

#include "core/error.hpp"

#include <algorithm>
#include <map>
#include <set>

using namespace plm;
using namespace plm::testing;
using io::fasta::Policy;
using io::fasta::Problem;

namespace {

data::PrepOptions options(const std::vector<std::string>& inputs, const std::string& out,
                          double fraction = 0) {
  data::PrepOptions o;
  o.inputs = inputs;
  o.out_dir = out;
  o.valid_fraction = fraction;
  o.command_line = "test";
  o.progress_seconds = 0;
  return o;
}

std::vector<Record> readDataset(const std::string& path) {
  io::DatasetReader reader(path);
  std::vector<Record> out;
  auto ids = reader.readIds(0, reader.numSequences());
  for (std::int64_t i = 0; i < reader.numSequences(); ++i)
    out.push_back({ids[i], reader.sequenceString(i)});
  return out;
}

// The message of the collective plm::Error that prepare() throws.
std::string prepError(const data::PrepOptions& o) {
  try {
    data::prepare(o, MPI_COMM_WORLD);
  } catch (const Error& e) {
    EXPECT_TRUE(e.collective()) << e.what();
    return e.what();
  }
  ADD_FAILURE() << "plm prep accepted invalid input";
  return "";
}

int linesIn(const std::string& text) { return int(std::count(text.begin(), text.end(), '\n')); }

// Small gzip chunks, so that even small .gz files are shared among the ranks.
struct SmallGzipChunks {
  SmallGzipChunks() { setenv("PLM_PREP_GZIP_CHUNK", "512", 1); }
  ~SmallGzipChunks() { unsetenv("PLM_PREP_GZIP_CHUNK"); }
};

}  // namespace

TEST(Prep, RoundTripIsExactForPlainAndGzipAtAnyRankCount) {
  SmallGzipChunks small;
  TempDir dir;
  std::mt19937_64 rng(7);
  auto first = randomRecords(rng, 150, "p");
  auto second = randomRecords(rng, 120, "g");
  writeFile(dir / "a.fasta", fastaText(first, rng));
  writeFile(dir / "b.fa.gz", fastaText(second, rng), true);
  auto report =
      data::prepare(options({dir / "a.fasta", dir / "b.fa.gz"}, dir / "out"), MPI_COMM_WORLD);
  EXPECT_EQ(report.records, 270);
  EXPECT_EQ(report.duplicates, 0);
  EXPECT_EQ(report.skipped, 0);
  EXPECT_FALSE(fileExists(dir / "out/valid.h5"));  // fraction 0: train only
  auto got = readDataset(dir / "out/train.h5");
  auto expected = first;
  expected.insert(expected.end(), second.begin(), second.end());
  ASSERT_EQ(got.size(), expected.size());
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i].id, expected[i].id) << i;
    EXPECT_EQ(got[i].residues, expected[i].residues) << i;
  }
  io::DatasetReader reader(dir / "out/train.h5");
  const auto& m = reader.metadata();
  EXPECT_EQ(m.format, "plm-protein-dataset");
  EXPECT_EQ(m.sources.size(), 2u);
  const std::string bytes = readFile(dir / "b.fa.gz");
  EXPECT_EQ(m.sources[1].size, std::int64_t(bytes.size()));
  EXPECT_EQ(m.sources[1].crc32, std::uint32_t(crc32(0, reinterpret_cast<const Bytef*>(bytes.data()),
                                                    uInt(bytes.size()))));
  EXPECT_EQ(m.command_line, "test");
  reader.validateTokens();
}

TEST(Prep, EdgeFormattingWithoutFinalNewlineAndComments) {
  TempDir dir;
  writeFile(dir / "e.fasta", "\n\n>a desc\r\nac\r\n\r\nDE*\r\n;comment\n>b\n  MK LV\t\n>c\nxbuzo");
  data::prepare(options({dir / "e.fasta"}, dir / "out"), MPI_COMM_WORLD);
  auto got = readDataset(dir / "out/train.h5");
  ASSERT_EQ(got.size(), 3u);
  EXPECT_EQ(got[0].id, "a");
  EXPECT_EQ(got[0].residues, "ACDE");
  EXPECT_EQ(got[1].residues, "MKLV");
  EXPECT_EQ(got[2].residues, "XBUZO");
}

// Each invalid case: 200 good records, then the bad one, then more good ones, so that at 2 and
// 4 ranks the problem lies in another rank's range and its line number must be made absolute.
struct InvalidCase {
  const char* name;
  std::string bad;  // FASTA text of the bad part
  int bad_line;     // line within `bad` that the message names (1-based)
  Problem problem;
  std::string message;  // expected text after "file:line: "
};

TEST(Prep, EveryInvalidInputCaseHasItsMessageUnderBothPolicies) {
  const std::vector<InvalidCase> cases = {
      {"empty", ">empty1 nothing here\n", 1, Problem::empty_sequence,
       "record `empty1` has no residues; remove it"},
      {"character", ">bad1\nACDEF\nGHJKL\n", 3, Problem::invalid_character,
       "record `bad1` has the character 'J' at column 3, which is not an amino-acid letter"},
      {"star", ">bad2\nAC*DE\n", 2, Problem::invalid_character,
       "record `bad2` has the character '*' at column 3"},
      {"gap", ">bad3\nAC-DE\n", 2, Problem::invalid_character,
       "record `bad3` has the character '-' at column 3, which is not an amino-acid letter of the "
       "ESM-2 "
       "alphabet (LAGVSERTIDPKQNFYMHWCXBUZO, either case, one optional final '*') (an alignment "
       "gap: give "
       "unaligned sequences)"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    TempDir dir;
    std::mt19937_64 rng(11);
    auto before = randomRecords(rng, 200, "x", 300), after = randomRecords(rng, 50, "y", 300);
    std::string head = fastaText(before, rng);
    std::string text = head + c.bad + fastaText(after, rng);
    writeFile(dir / "in.fasta", text);
    const int line = linesIn(head) + c.bad_line;
    auto o = options({dir / "in.fasta"}, dir / "out");
    std::string message = prepError(o);
    const std::string expected =
        "plm prep: " + (dir / "in.fasta") + ":" + std::to_string(line) + ": " + c.message;
    EXPECT_EQ(message.rfind(expected, 0), 0u) << message << "\nexpected to start with\n"
                                              << expected;
    EXPECT_NE(message.find("--on-invalid skip"), std::string::npos) << message;
    EXPECT_FALSE(fileExists(dir / "out/train.h5"));

    o.on_invalid = Policy::skip;
    auto report = data::prepare(o, MPI_COMM_WORLD);
    EXPECT_EQ(report.skipped, 1);
    EXPECT_EQ(report.skipped_by_problem[int(c.problem)], 1);
    EXPECT_EQ(report.records, 250);
    io::DatasetReader reader(dir / "out/train.h5");
    EXPECT_EQ(reader.numSequences(), 250);
    EXPECT_EQ(reader.metadata().skipped_records, 1);
  }
}

TEST(Prep, SequenceBeforeHeaderIsReportedAtItsLine) {
  TempDir dir;
  writeFile(dir / "in.fasta", "\nMKV\nLL\n>a\nAC\n");
  std::string message = prepError(options({dir / "in.fasta"}, dir / "out"));
  EXPECT_NE(message.find(dir / "in.fasta:2: sequence data before the first '>' header line"),
            std::string::npos)
      << message;
  auto o = options({dir / "in.fasta"}, dir / "out");
  o.on_invalid = Policy::skip;
  auto report = data::prepare(o, MPI_COMM_WORLD);
  EXPECT_EQ(report.skipped_by_problem[int(Problem::sequence_before_header)], 1);
  EXPECT_EQ(readDataset(dir / "out/train.h5").size(), 1u);
}

TEST(Prep, TruncatedGzipIsReportedAndSkipKeepsTheCompleteRecords) {
  SmallGzipChunks small;
  TempDir dir;
  std::mt19937_64 rng(5);
  auto records = randomRecords(rng, 200, "t", 400);
  std::string text = fastaText(records, rng);
  writeFile(dir / "full.gz", text, true);
  std::string bytes = readFile(dir / "full.gz");
  writeFile(dir / "cut.gz", bytes.substr(0, bytes.size() * 2 / 3));
  std::string message = prepError(options({dir / "cut.gz"}, dir / "out"));
  EXPECT_NE(message.find(dir / "cut.gz:"), std::string::npos) << message;
  EXPECT_NE(message.find("the gzip stream ends early"), std::string::npos) << message;

  auto o = options({dir / "cut.gz"}, dir / "out");
  o.on_invalid = Policy::skip;
  auto report = data::prepare(o, MPI_COMM_WORLD);
  EXPECT_EQ(report.skipped_by_problem[int(Problem::truncated_gzip)], 1);
  EXPECT_EQ(report.skipped, 1);
  auto got = readDataset(dir / "out/train.h5");
  ASSERT_GT(got.size(), 50u);
  ASSERT_LT(got.size(), records.size());
  for (size_t i = 0; i < got.size(); ++i) EXPECT_EQ(got[i].residues, records[i].residues) << i;
}

TEST(Prep, ExactDuplicatesAreRemovedAcrossFilesKeepingTheFirst) {
  TempDir dir;
  std::mt19937_64 rng(3);
  auto a = randomRecords(rng, 100, "a", 200);
  auto b = randomRecords(rng, 100, "b", 200);
  // b repeats 30 of a's sequences (in another style) and 10 of its own.
  for (int i = 0; i < 30; ++i) b[size_t(3 * i)].residues = a[size_t(i)].residues;
  for (int i = 0; i < 10; ++i) b[size_t(91 + i % 9)].residues = b[size_t(1 + 3 * i)].residues;
  writeFile(dir / "a.fasta", fastaText(a, rng));
  writeFile(dir / "b.fasta", fastaText(b, rng));
  std::vector<Record> expected;
  std::set<std::string> seen;
  for (const auto* list : {&a, &b})
    for (const auto& r : *list)
      if (seen.insert(r.residues).second) expected.push_back(r);
  auto report =
      data::prepare(options({dir / "a.fasta", dir / "b.fasta"}, dir / "out"), MPI_COMM_WORLD);
  EXPECT_EQ(report.duplicates, std::int64_t(200 - expected.size()));
  auto got = readDataset(dir / "out/train.h5");
  ASSERT_EQ(got.size(), expected.size());
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i].id, expected[i].id);
    EXPECT_EQ(got[i].residues, expected[i].residues);
  }
  EXPECT_EQ(io::DatasetReader(dir / "out/train.h5").metadata().duplicates_removed,
            report.duplicates);
}

TEST(Prep, SplitIsAFunctionOfContentNotOfRankCountOrInputOrder) {
  TempDir dir;
  std::mt19937_64 rng(9);
  auto a = randomRecords(rng, 300, "a", 150), b = randomRecords(rng, 300, "b", 150);
  writeFile(dir / "a.fasta", fastaText(a, rng));
  writeFile(dir / "b.fasta", fastaText(b, rng));
  const double fraction = 0.2;
  std::set<std::string> expected_valid, expected_train;
  for (const auto* list : {&a, &b})
    for (const auto& r : *list) {
      std::vector<std::uint8_t> ids;
      for (char c : r.residues)
        ids.push_back(std::uint8_t(io::fasta::residueId(static_cast<unsigned char>(c))));
      bool valid =
          data::random::splitDraw(data::random::contentHash(ids.data(), ids.size())) < fraction;
      (valid ? expected_valid : expected_train).insert(r.residues);
    }
  ASSERT_GT(expected_valid.size(), 60u);
  ASSERT_LT(expected_valid.size(), 180u);
  for (const auto& order : {std::vector<std::string>{dir / "a.fasta", dir / "b.fasta"},
                            std::vector<std::string>{dir / "b.fasta", dir / "a.fasta"}}) {
    auto report = data::prepare(options(order, dir / "out", fraction), MPI_COMM_WORLD);
    EXPECT_EQ(report.valid_sequences, std::int64_t(expected_valid.size()));
    std::set<std::string> valid, train;
    for (const auto& r : readDataset(dir / "out/valid.h5")) valid.insert(r.residues);
    for (const auto& r : readDataset(dir / "out/train.h5")) train.insert(r.residues);
    EXPECT_EQ(valid, expected_valid);
    EXPECT_EQ(train, expected_train);
  }
}

TEST(Prep, ValidFileIsTheValidationSetAndWinsOverTrainCopies) {
  TempDir dir;
  std::mt19937_64 rng(4);
  auto train = randomRecords(rng, 60, "t", 100), valid = randomRecords(rng, 20, "v", 100);
  train[5].residues = valid[3].residues;
  writeFile(dir / "t.fasta", fastaText(train, rng));
  writeFile(dir / "v.fasta", fastaText(valid, rng));
  auto o = options({dir / "t.fasta"}, dir / "out");
  o.valid_inputs = {dir / "v.fasta"};
  auto report = data::prepare(o, MPI_COMM_WORLD);
  EXPECT_EQ(report.valid_sequences, 20);
  EXPECT_EQ(report.train_sequences, 59);
  EXPECT_EQ(report.duplicates, 1);
  auto got = readDataset(dir / "out/valid.h5");
  for (size_t i = 0; i < got.size(); ++i) EXPECT_EQ(got[i].residues, valid[i].residues);
}

TEST(Prep, InterruptedWriteLeavesNoValidLookingFile) {
  TempDir dir;
  std::mt19937_64 rng(8);
  writeFile(dir / "in.fasta", fastaText(randomRecords(rng, 100, "s"), rng));
  setenv("PLM_TEST_FAIL_AFTER_BYTES", "1", 1);
  std::string message = prepError(options({dir / "in.fasta"}, dir / "out", 0.1));
  unsetenv("PLM_TEST_FAIL_AFTER_BYTES");
  EXPECT_NE(message.find("PLM_TEST_FAIL_AFTER_BYTES"), std::string::npos) << message;
  EXPECT_FALSE(fileExists(dir / "out/train.h5"));
  EXPECT_FALSE(fileExists(dir / "out/valid.h5"));
  // What a killed prep leaves behind is hidden, and no reader accepts it.
  ASSERT_TRUE(fileExists(dir / "out/.train.h5.tmp"));
  try {
    io::DatasetReader reader(dir / "out/.train.h5.tmp");
    ADD_FAILURE() << "a partial dataset was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("interrupted"), std::string::npos) << e.what();
  }
  // A later complete run replaces it.
  data::prepare(options({dir / "in.fasta"}, dir / "out", 0.1), MPI_COMM_WORLD);
  EXPECT_TRUE(fileExists(dir / "out/train.h5"));
  EXPECT_FALSE(fileExists(dir / "out/.train.h5.tmp"));
}

TEST(Prep, MissingInputIsACollectiveErrorNamingTheFile) {
  TempDir dir;
  std::string message = prepError(options({dir / "nope.fasta"}, dir / "out"));
  EXPECT_NE(message.find("nope.fasta"), std::string::npos) << message;
}

TEST(Prep, EmptyInputGivesEmptyButValidFiles) {
  TempDir dir;
  writeFile(dir / "empty.fasta", "");
  writeFile(dir / "one.fasta", ">only\nMKV\n");
  // A fraction so small that the one record is a training sequence: valid.h5 is the empty file.
  auto report = data::prepare(options({dir / "empty.fasta", dir / "one.fasta"}, dir / "out", 1e-12),
                              MPI_COMM_WORLD);
  EXPECT_EQ(report.records, 1);
  io::DatasetReader train(dir / "out/train.h5"), valid(dir / "out/valid.h5");
  EXPECT_EQ(train.numSequences() + valid.numSequences(), 1);
  const auto& empty = train.numSequences() == 0 ? train : valid;
  EXPECT_EQ(empty.numResidues(), 0);
  EXPECT_EQ(empty.offsets(), std::vector<std::int64_t>{0});
  EXPECT_TRUE(empty.readIds(0, 0).empty());
  empty.validateTokens();
}

TEST(Prep, NoTrainingSequenceIsAnErrorNamingTheReason) {
  TempDir dir;
  writeFile(dir / "empty.fasta", "");
  std::string message = prepError(options({dir / "empty.fasta"}, dir / "out"));
  EXPECT_NE(message.find("plm prep: no training sequence: the input holds no FASTA record"),
            std::string::npos)
      << message;
  EXPECT_FALSE(fileExists(dir / "out/train.h5"));

  writeFile(dir / "bad.fasta", ">a\nMKJ\n>b\nAC-DE\n");
  auto o = options({dir / "bad.fasta"}, dir / "out");
  o.on_invalid = Policy::skip;
  message = prepError(o);
  EXPECT_NE(message.find("no training sequence: every record was invalid and skipped (2 skipped"),
            std::string::npos)
      << message;
  EXPECT_FALSE(fileExists(dir / "out/train.h5"));

  writeFile(dir / "good.fasta", ">a\nMKV\n");
  o = options({dir / "good.fasta"}, dir / "out");
  o.valid_inputs = {dir / "good.fasta"};
  message = prepError(o);
  EXPECT_NE(message.find("all 1 distinct sequences went to the validation set"), std::string::npos)
      << message;
}

TEST(Prep, NucleotideLikeRecordsAreDetectedAtTheThreshold) {
  auto ids = [](const std::string& letters) {
    std::vector<std::uint8_t> out;
    for (char c : letters) out.push_back(std::uint8_t(io::fasta::residueId((unsigned char)c)));
    return out;
  };
  auto looks = [&](const std::string& letters) {
    auto v = ids(letters);
    return io::fasta::looksLikeNucleotides(v.data(), std::int64_t(v.size()));
  };
  EXPECT_TRUE(looks("atgatcgatcgtacgtagcn"));                // 20 long, all nucleotide letters
  EXPECT_TRUE(looks("AUGAUCGAUCGUACGUAGCN"));                // RNA, upper case
  EXPECT_FALSE(looks("atgatcgatcgtacgtagc"));                // 19: too short to tell
  EXPECT_TRUE(looks("ACGTACGTACGTACGTACMK"));                // 18 of 20: 90%
  EXPECT_FALSE(looks("ACGTACGTACGTACGTAMKW"));               // 17 of 20: 85%
  EXPECT_FALSE(looks("MKTAYIAKQRQISFVKSHFSRQLEERLGLIEVQ"));  // a protein
}

TEST(Prep, NucleotideRecordsWarnAndMostlyNucleotideFilesAreRefused) {
  TempDir dir;
  std::mt19937_64 rng(3);
  const std::string dna = "atgatcgatcgtacgtagcatgcatgcaatgc";
  // A protein file with one DNA record: kept, counted (and warned about).
  auto records = randomRecords(rng, 60, "p", 200);
  records.insert(records.begin() + 40, Record{"dna1", dna});
  std::string text;
  int dna_line = 0;
  for (const auto& r : records) {
    if (r.id == "dna1") dna_line = linesIn(text) + 1;
    text += ">" + r.id + "\n" + r.residues + "\n";
  }
  writeFile(dir / "mixed.fasta", text);
  auto report = data::prepare(options({dir / "mixed.fasta"}, dir / "out"), MPI_COMM_WORLD);
  EXPECT_EQ(report.nucleotide_records, 1);
  EXPECT_EQ(report.records, 61);

  // A file of mostly nucleotide records: refused with the count and the first record, unless
  // --allow-nucleotide. A protein file beside it changes nothing: the check is per file.
  writeFile(dir / "genes.fasta", ">p1\nMKTAYIAKQRQISFVK\n>g1\n" + dna + "\n>g2\n" + dna +
                                     "aa\n>g3\nACGU\n" + dna + "\n");
  auto o = options({dir / "mixed.fasta", dir / "genes.fasta"}, dir / "out2");
  std::string message = prepError(o);
  EXPECT_NE(message.find("plm prep: " + (dir / "genes.fasta") +
                         ": 3 of its 4 record(s) look like "
                         "nucleotide sequences"),
            std::string::npos)
      << message;
  EXPECT_NE(message.find("the first at " + (dir / "mixed.fasta") + ":" + std::to_string(dna_line) +
                         ": record `dna1`"),
            std::string::npos)
      << message;
  EXPECT_NE(message.find("--allow-nucleotide"), std::string::npos) << message;
  EXPECT_FALSE(fileExists(dir / "out2/train.h5"));
  o.allow_nucleotide = true;
  report = data::prepare(o, MPI_COMM_WORLD);
  EXPECT_EQ(report.nucleotide_records, 4);
  EXPECT_EQ(report.records, 65);
}

TEST(Prep, EmptyIdentifierGetsAnIdFromItsPlaceAtAnyRankCount) {
  TempDir dir;
  std::mt19937_64 rng(4);
  const std::string head = fastaText(randomRecords(rng, 100, "a", 300), rng);
  const int line = linesIn(head) + 1;
  writeFile(dir / "in.fasta", head + ">\nMKVLAAGIW\n> \nMKVLAAGIWQ\n");
  auto report = data::prepare(options({dir / "in.fasta"}, dir / "out"), MPI_COMM_WORLD);
  EXPECT_EQ(report.unnamed_records, 2);
  std::set<std::string> ids;
  for (const auto& r : readDataset(dir / "out/train.h5")) ids.insert(r.id);
  EXPECT_TRUE(ids.count("unnamed:in.fasta:" + std::to_string(line))) << line;
  EXPECT_TRUE(ids.count("unnamed:in.fasta:" + std::to_string(line + 2))) << line + 2;
  EXPECT_FALSE(ids.count(""));
}
