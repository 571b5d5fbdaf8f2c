// The loader at 1, 2 and 4 ranks: the stream of micro-batches is the 1-rank stream dealt out
// j % world (checked against an in-process 1-rank loader), micro-batches respect the budget
// and hold exactly the dataset's sequences once per epoch, a cursor restores the stream,
// masking has the 15% / 80-10-10 statistics, single_pass ends, and corrupt datasets are refused
// with a message.
#include "data/loader.hpp"
#include "data/prep.hpp"
#include "data_testing.hpp"
#include "io/dataset.hpp"
#include "io/hdf5.hpp"

#include "core/error.hpp"

#include <algorithm>
#include <map>
#include <memory>
#include <set>

using namespace plm;
using namespace plm::testing;
using data::Cursor;
using data::Loader;
using data::LoaderOptions;
using data::MicroBatch;
namespace vocab = data::vocab;

namespace {

class LoaderTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir = new TempDir();
    std::mt19937_64 rng(21);
    auto records = randomRecords(rng, 300, "s", 200);
    for (int i = 0; i < 12; ++i)
      records.push_back({"long" + std::to_string(i), randomProtein(rng, 300 + 40 * i)});
    std::shuffle(records.begin(), records.end(), rng);
    writeFile(*dir / "in.fasta", fastaText(records, rng));
    data::PrepOptions o;
    o.inputs = {*dir / "in.fasta"};
    o.out_dir = dir->path();
    o.valid_fraction = 0;
    o.progress_seconds = 0;
    data::prepare(o, MPI_COMM_WORLD);
    io::DatasetReader reader(*dir / "train.h5");
    sequences = new std::vector<std::string>();
    for (std::int64_t i = 0; i < reader.numSequences(); ++i)
      sequences->push_back(reader.sequenceString(i));
  }
  static void TearDownTestSuite() {
    delete sequences;
    delete dir;
  }

  // Global options; the tests vary rank, world, prefetch.
  static LoaderOptions base() {
    LoaderOptions o;
    o.path = *dir / "train.h5";
    o.micro_batch_tokens = 512;
    o.micro_batches_per_step = 4;  // a multiple of 1, 2 and 4
    o.max_seq_len = 128;
    o.seed = 5;
    o.prefetch = 0;
    return o;
  }
  static LoaderOptions distributed(int prefetch = 2) {
    LoaderOptions o = base();
    o.rank = rank();
    o.world = world();
    o.prefetch = prefetch;
    return o;
  }

  static TempDir* dir;
  static std::vector<std::string>* sequences;
};
TempDir* LoaderTest::dir = nullptr;
std::vector<std::string>* LoaderTest::sequences = nullptr;

std::vector<std::int64_t> flatten(const MicroBatch& mb) {
  std::vector<std::int64_t> out = {mb.numTokens(), mb.numSequences(), mb.max_seqlen, mb.num_masked};
  for (std::int64_t t = 0; t < mb.numTokens(); ++t) out.push_back(mb.tokens(t));
  for (std::int64_t t = 0; t < mb.numTokens(); ++t) out.push_back(mb.labels(t));
  for (std::int64_t s = 0; s <= mb.numSequences(); ++s) out.push_back(mb.cu_seqlens(s));
  return out;
}

// The residues of sequence s of `mb` before masking (labels put back).
std::string original(const MicroBatch& mb, int s) {
  std::string out;
  for (int t = mb.cu_seqlens(s) + 1; t < mb.cu_seqlens(s + 1) - 1; ++t) {
    int id = mb.labels(t) != vocab::ignore_label ? mb.labels(t) : mb.tokens(t);
    out += id >= vocab::first_residue && id <= vocab::last_residue
               ? vocab::letters[id - vocab::first_residue]
               : '?';
  }
  return out;
}

}  // namespace

TEST_F(LoaderTest, StreamIsTheOneRankStreamDealtOutByRank) {
  Loader reference(base());
  Loader mine(distributed());
  EXPECT_EQ(mine.numSequences(), std::int64_t(sequences->size()));
  for (int step = 0; step < 50; ++step) {  // about two epochs
    auto all = reference.nextStep();
    auto local = mine.nextStep();
    ASSERT_EQ(all.size(), 4u);
    ASSERT_EQ(local.size(), size_t(4 / world()));
    for (size_t k = 0; k < local.size(); ++k)
      EXPECT_EQ(flatten(local[k]), flatten(all[k * world() + rank()]))
          << "step " << step << " micro-batch " << k;
    EXPECT_EQ(mine.cursor(), reference.cursor());
  }
  EXPECT_GE(reference.cursor().epoch, 1);
}

TEST_F(LoaderTest, MicroBatchesArePackedWithinBudgetAndEachEpochHoldsEverySequenceOnce) {
  LoaderOptions o = base();
  o.micro_batches_per_step = 1;
  Loader loader(o);
  std::multiset<std::string> whole, expected_whole;
  int cropped = 0, expected_cropped = 0;
  const std::int64_t window = 126;
  std::set<std::string> all(sequences->begin(), sequences->end());
  for (const auto& s : *sequences)
    (std::int64_t(s.size()) <= window ? (expected_whole.insert(s), 0) : ++expected_cropped);
  int steps = 0;
  while (loader.cursor() != Cursor{1, 0}) {
    ASSERT_LT(++steps, 10000);
    for (const auto& mb : loader.nextStep()) {
      ASSERT_GE(mb.numSequences(), 1);
      ASSERT_LE(mb.numTokens(), o.micro_batch_tokens);
      ASSERT_EQ(mb.cu_seqlens(0), 0);
      ASSERT_EQ(mb.cu_seqlens(mb.numSequences()), mb.numTokens());
      std::int32_t longest = 0;
      for (int s = 0; s < mb.numSequences(); ++s) {
        const int begin = mb.cu_seqlens(s), end = mb.cu_seqlens(s + 1);
        longest = std::max(longest, end - begin);
        ASSERT_LE(end - begin, o.max_seq_len);
        EXPECT_EQ(mb.tokens(begin), vocab::cls);
        EXPECT_EQ(mb.tokens(end - 1), vocab::eos);
        EXPECT_EQ(mb.labels(begin), vocab::ignore_label);
        EXPECT_EQ(mb.labels(end - 1), vocab::ignore_label);
        std::string residues = original(mb, s);
        if (all.count(residues)) {
          whole.insert(residues);
        } else {
          ++cropped;
          ASSERT_EQ(std::int64_t(residues.size()), window);
          bool inside =
              std::any_of(sequences->begin(), sequences->end(), [&](const std::string& q) {
                return q.size() > size_t(window) && q.find(residues) != std::string::npos;
              });
          EXPECT_TRUE(inside) << "a cropped window that is no window of a long sequence";
        }
      }
      EXPECT_EQ(mb.max_seqlen, longest);
      // The packing is greedy: the next sequence of the order did not fit (except at the epoch
      // end).
    }
  }
  EXPECT_EQ(whole, expected_whole);
  EXPECT_EQ(cropped, expected_cropped);
}

TEST_F(LoaderTest, SeekToACursorReproducesTheStream) {
  Loader first(distributed());
  for (int step = 0; step < 23; ++step) first.nextStep();  // ends inside an epoch
  const Cursor cursor = first.cursor();
  std::int64_t values[2] = {cursor.epoch, cursor.position}, minimum[2], maximum[2];
  MPI_Allreduce(values, minimum, 2, MPI_INT64_T, MPI_MIN, MPI_COMM_WORLD);
  MPI_Allreduce(values, maximum, 2, MPI_INT64_T, MPI_MAX, MPI_COMM_WORLD);
  EXPECT_EQ(minimum[0], maximum[0]);  // one cursor for all ranks
  EXPECT_EQ(minimum[1], maximum[1]);
  std::vector<std::vector<std::int64_t>> after;
  for (int step = 0; step < 15; ++step)  // crosses into the next epoch
    for (const auto& mb : first.nextStep()) after.push_back(flatten(mb));

  Loader resumed(distributed(3));
  resumed.seek(cursor);
  EXPECT_EQ(resumed.cursor(), cursor);
  std::vector<std::vector<std::int64_t>> again;
  for (int step = 0; step < 15; ++step)
    for (const auto& mb : resumed.nextStep()) again.push_back(flatten(mb));
  EXPECT_EQ(again, after);

  first.seek(cursor);  // seeking a loader whose prefetch thread is running
  std::vector<std::vector<std::int64_t>> third;
  for (int step = 0; step < 15; ++step)
    for (const auto& mb : first.nextStep()) third.push_back(flatten(mb));
  EXPECT_EQ(third, after);
}

TEST_F(LoaderTest, MaskingSelects15PercentOfResiduesSplit80_10_10) {
  Loader loader(base());
  std::int64_t residues = 0, selected = 0, masked = 0, replaced = 0, kept = 0,
               specials_selected = 0;
  for (int step = 0; step < 120; ++step) {
    for (const auto& mb : loader.nextStep()) {
      std::int64_t count = 0;
      for (int s = 0; s < mb.numSequences(); ++s) {
        for (int t = mb.cu_seqlens(s); t < mb.cu_seqlens(s + 1); ++t) {
          const bool special = t == mb.cu_seqlens(s) || t == mb.cu_seqlens(s + 1) - 1;
          if (mb.labels(t) == vocab::ignore_label) {
            if (!special) ++residues;
            continue;
          }
          ++count;
          if (special) {
            ++specials_selected;
            continue;
          }
          ++residues;
          ++selected;
          ASSERT_GE(mb.labels(t), vocab::first_residue);
          ASSERT_LE(mb.labels(t), vocab::last_residue);
          if (mb.tokens(t) == vocab::mask) {
            ++masked;
          } else if (mb.tokens(t) == mb.labels(t)) {
            ++kept;
          } else {
            ++replaced;
            ASSERT_GE(mb.tokens(t), vocab::first_residue);
            ASSERT_LE(mb.tokens(t), vocab::last_standard_aa);
          }
        }
      }
      EXPECT_EQ(count, mb.num_masked);
    }
  }
  ASSERT_GT(residues, 100000);
  EXPECT_EQ(specials_selected, 0);
  const double p = double(selected) / double(residues);
  EXPECT_NEAR(p, 0.15, 0.01);
  EXPECT_NEAR(double(masked) / double(selected), 0.8, 0.02);
  // A random standard amino acid equals the original 1 time in 20.
  EXPECT_NEAR(double(replaced) / double(selected), 0.1 * 19.0 / 20.0, 0.015);
  EXPECT_NEAR(double(kept) / double(selected), 0.1 + 0.1 / 20.0, 0.015);
}

TEST_F(LoaderTest, SinglePassVisitsEverySequenceInOrderWithFixedMaskingThenEnds) {
  LoaderOptions o = distributed();
  o.single_pass = true;
  o.max_seq_len = 1024;  // nothing cropped (the longest sequence has 740 residues)
  o.micro_batch_tokens = 2048;
  LoaderOptions one = base();
  one.single_pass = true;
  one.max_seq_len = 1024;
  one.micro_batch_tokens = 2048;
  Loader mine(o), reference(one), again(one);
  std::vector<std::string> visited;
  for (int step = 0;; ++step) {
    ASSERT_LT(step, 1000);
    auto all = reference.nextStep();
    auto repeat = again.nextStep();
    auto local = mine.nextStep();
    ASSERT_EQ(all.size(), repeat.size());
    for (size_t k = 0; k < all.size(); ++k) EXPECT_EQ(flatten(all[k]), flatten(repeat[k]));
    for (size_t k = 0; k < local.size(); ++k)
      EXPECT_EQ(flatten(local[k]), flatten(all[k * world() + rank()]));
    EXPECT_EQ(local.size(), all.size() / size_t(world()) +
                                (size_t(rank()) < all.size() % size_t(world()) ? 1 : 0));
    if (all.empty()) break;
    for (const auto& mb : all)
      for (int s = 0; s < mb.numSequences(); ++s) visited.push_back(original(mb, s));
  }
  EXPECT_EQ(visited, *sequences);
  EXPECT_TRUE(reference.nextStep().empty());  // stays at the end
  EXPECT_TRUE(mine.nextStep().empty());
  reference.seek({0, 0});
  EXPECT_FALSE(reference.nextStep().empty());
}

TEST_F(LoaderTest, OtherSeedsGiveOtherOrderAndMasks) {
  LoaderOptions o = base();
  Loader a(o);
  o.seed = 6;
  Loader b(o);
  EXPECT_NE(flatten(a.nextStep()[0]), flatten(b.nextStep()[0]));
}

TEST_F(LoaderTest, BadOptionsAreRefusedWithAMessage) {
  LoaderOptions o = base();
  o.world = 4;
  o.micro_batches_per_step = 2;
  try {
    Loader loader(o);
    ADD_FAILURE() << "accepted 2 micro-batches per step on 4 ranks";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("multiple of the number of ranks"), std::string::npos)
        << e.what();
  }
  EXPECT_EQ(data::microBatchesPerStep(16384, 8192, 4), 4);
  EXPECT_EQ(data::microBatchesPerStep(16384, 8192, 1), 2);
  EXPECT_EQ(data::microBatchesPerStep(20000, 8192, 2), 4);
  o = base();
  o.micro_batch_tokens = 2;
  EXPECT_THROW(Loader{o}, Error);
}

namespace {

// Rank 0 copies train.h5 to `path` and applies `change` to it with serial HDF5.
template <class Change>
void corruptCopy(const std::string& from, const std::string& path, Change change) {
  if (rank() == 0) {
    std::ofstream(path, std::ios::binary) << readFile(from);
    hid_t file = H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
    change(file);
    H5Fclose(file);
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

template <class T> void rewrite(hid_t file, const char* name, std::int64_t index, T value) {
  hid_t dataset = H5Dopen2(file, name, H5P_DEFAULT);
  hsize_t start = hsize_t(index), count = 1;
  hid_t space = H5Dget_space(dataset);
  H5Sselect_hyperslab(space, H5S_SELECT_SET, &start, nullptr, &count, nullptr);
  hid_t memory = H5Screate_simple(1, &count, nullptr);
  H5Dwrite(dataset, io::h5::nativeType<T>(), memory, space, H5P_DEFAULT, &value);
  H5Sclose(memory);
  H5Sclose(space);
  H5Dclose(dataset);
}

std::string loaderError(const LoaderOptions& o, bool read_all) {
  try {
    Loader loader(o);
    if (read_all)
      while (!loader.nextStep().empty()) {
      }
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

}  // namespace

TEST_F(LoaderTest, CorruptDatasetsAreRefusedWithWhatIsWrong) {
  const std::string good = *dir / "train.h5";
  struct Case {
    const char* name;
    std::function<void(hid_t)> change;
    bool read_all;  // token ids are checked as they are read
    std::string message;
  };
  const std::vector<Case> cases = {
      {"version", [](hid_t f) { io::h5::writeAttribute(f, "format_version", std::int64_t(99)); },
       false, "has format version 99"},
      {"format", [](hid_t f) { io::h5::writeAttribute(f, "format", std::string("something")); },
       false, "has format `something`"},
      {"unfinished", [](hid_t f) { H5Adelete(f, "format"); }, false, "was interrupted"},
      {"offsets", [](hid_t f) { rewrite<std::int64_t>(f, "offsets", 7, 1); }, false,
       "/offsets decreases at sequence"},
      {"end", [](hid_t f) { rewrite<std::int64_t>(f, "offsets", 0, 3); }, false,
       "/offsets[0] is 3"},
      {"token", [](hid_t f) { rewrite<std::uint8_t>(f, "tokens", 100, 40); }, true,
       "holds token id 40"},
      {"count", [](hid_t f) { io::h5::writeAttribute(f, "num_sequences", std::int64_t(5)); }, false,
       "/offsets does not have num_sequences + 1"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    const std::string path = *dir / (std::string("bad-") + c.name + ".h5");
    corruptCopy(good, path, c.change);
    // A bad token is met only by the rank whose micro-batch holds it: read as one rank.
    LoaderOptions o = c.read_all ? base() : distributed();
    o.path = path;
    o.single_pass = true;
    std::string message = loaderError(o, c.read_all);
    EXPECT_NE(message.find(c.message), std::string::npos) << message;
    EXPECT_NE(message.find(path), std::string::npos) << message;
    if (c.read_all) {
      try {
        io::DatasetReader(path).validateTokens();
        ADD_FAILURE() << "validateTokens accepted a bad token";
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find(c.message), std::string::npos) << e.what();
      }
    }
  }
  // A file cut short, and one that is not there.
  const std::string cut = *dir / "cut.h5";
  if (rank() == 0) std::ofstream(cut, std::ios::binary) << readFile(good).substr(0, 1000);
  MPI_Barrier(MPI_COMM_WORLD);
  LoaderOptions o = distributed();
  o.path = cut;
  EXPECT_NE(loaderError(o, false).find("is not a readable HDF5 file"), std::string::npos)
      << loaderError(o, false);
  o.path = *dir / "missing.h5";
  EXPECT_NE(loaderError(o, false).find("does not exist"), std::string::npos);
}
