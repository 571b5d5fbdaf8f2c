// The checkpoint file and its checks: layout and contents against the trainer's buffers, a
// load that restores every piece of state, names and pruning, and each refusal: truncated file,
// damaged tensor bytes, an interrupted save, another model shape, another data stream, another
// dataset; allowed deck changes are sorted into harmless and training-relevant ones.
#include "tiny_run.hpp"

#include "ckpt/checkpoint.hpp"
#include "ckpt/detail/rows.hpp"
#include "dist/runtime.hpp"
#include "io/hdf5.hpp"
#include "model/model_file.hpp"

#include <gtest/gtest.h>

#include <fcntl.h>
#include <unistd.h>
#include <cstring>
#include <filesystem>

namespace {

namespace fs = std::filesystem;
namespace h5 = plm::io::h5;
using plm::test::tinyDeck;

std::vector<float> host(const plm::View1<float>& v) {
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), v);
  return std::vector<float>(h.data(), h.data() + h.extent(0));
}

bool sameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// Runs the tiny deck `run` for `steps` steps with checkpoints every `every` steps.
void trainTiny(const std::string& dir, const std::string& run, int steps, int every,
               std::vector<std::string> more = {}) {
  more.push_back("train.steps=" + std::to_string(steps));
  more.push_back("checkpoint.every=" + std::to_string(every));
  plm::train::Trainer t(tinyDeck(dir, run, more));
  plm::ckpt::installHooks(t);
  t.run();
}

// Rank 0 copies `from` to `to`, keeping `keep_bytes` bytes (all when negative).
void copyFile(const std::string& from, const std::string& to, std::int64_t keep_bytes = -1) {
  if (plm::dist::worldRank() == 0) {
    fs::copy_file(from, to, fs::copy_options::overwrite_existing);
    if (keep_bytes >= 0) fs::resize_file(to, std::uintmax_t(keep_bytes));
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

class Checkpoint : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir = plm::test::sharedTempDir(MPI_COMM_WORLD, "file");
    plm::test::writeTinyDataset(dir + "/train.h5", 64, 5, MPI_COMM_WORLD);
    trainTiny(dir, "base", 3, 3);  // checkpoint of step 3 at dir/base/ckpt/step_000003.h5
    good = dir + "/base/ckpt/step_000003.h5";
  }
  static void TearDownTestSuite() { plm::test::removeSharedDir(MPI_COMM_WORLD, dir); }
  static std::string dir, good;
};
std::string Checkpoint::dir, Checkpoint::good;

TEST(Names, PatternAndSteps) {
  EXPECT_EQ(plm::ckpt::fileName(123), "step_000123.h5");
  EXPECT_EQ(plm::ckpt::fileName(12345678), "step_12345678.h5");
  EXPECT_EQ(plm::ckpt::stepOfFileName("step_000123.h5"), 123);
  EXPECT_EQ(plm::ckpt::stepOfFileName("step_12345678.h5"), 12345678);
  EXPECT_EQ(plm::ckpt::stepOfFileName("step_000123.h5.tmp"), -1);
  EXPECT_EQ(plm::ckpt::stepOfFileName("step_00012.h5"), -1);
  EXPECT_EQ(plm::ckpt::stepOfFileName("step_0001x3.h5"), -1);
  EXPECT_EQ(plm::ckpt::stepOfFileName("model.h5"), -1);
}

TEST_F(Checkpoint, FileHoldsTheTrainersState) {
  plm::train::Trainer t(tinyDeck(dir, "layout", {"train.steps=2", "checkpoint.every=0"}));
  t.run();
  const auto report = plm::ckpt::save(t, dir + "/layout/ckpt");
  EXPECT_EQ(report.path, dir + "/layout/ckpt/step_000002.h5");
  EXPECT_EQ(std::int64_t(fs::file_size(report.path)), report.bytes);
  EXPECT_FALSE(fs::exists(report.path + ".tmp"));
  const std::int64_t n = t.optimizer().master().extent(0);
  EXPECT_GT(report.bytes, 3 * n * 4);

  // Read back with plain HDF5 on one rank: names, shapes, values, attributes.
  if (plm::dist::worldRank() == 0) {
    h5::Hid file = h5::openFileSerial(report.path);
    const auto master = host(t.optimizer().master()), m = host(t.optimizer().expAvg()),
               v = host(t.optimizer().expAvgSq());
    for (const auto& [group, values] :
         {std::pair{"model", &master}, std::pair{"optimizer/exp_avg", &m},
          std::pair{"optimizer/exp_avg_sq", &v}})
      for (const auto& info : t.model().tensors()) {
        h5::Hid ds = h5::openDataset(file, std::string(group) + "/" + info.name);
        ASSERT_EQ(h5::datasetShape(ds), info.shape) << info.name;
        std::vector<float> stored(info.size);
        h5::readRows<float>(ds, 0, info.shape[0], stored.data(), /*independent=*/true);
        EXPECT_EQ(
            std::memcmp(stored.data(), values->data() + info.offset, info.size * sizeof(float)), 0)
            << group << "/" << info.name;
        EXPECT_TRUE(h5::hasAttribute(ds, "crc32"));
      }
    EXPECT_TRUE(h5::exists(file, "scaling"));
    EXPECT_TRUE(h5::exists(file, "model/esm.embeddings.word_embeddings.weight"));
    h5::Hid s(H5Gopen2(file, "state", H5P_DEFAULT));
    EXPECT_EQ(h5::readStringAttribute(s, "format"), "plm-checkpoint");
    EXPECT_EQ(h5::readIntAttribute(s, "step"), 2);
    EXPECT_EQ(h5::readIntAttribute(s, "tokens_seen"), t.state().tokens_seen);
    EXPECT_EQ(h5::readIntAttribute(s, "cursor_position"), t.state().cursor.position);
    EXPECT_EQ(h5::readIntAttribute(s, "world_size"), plm::dist::worldSize());
    EXPECT_EQ(h5::readIntAttribute(s, "data_seed"), 7);
    EXPECT_NE(h5::readStringAttribute(s, "deck").find("micro_batch_tokens: 1024"),
              std::string::npos);
    h5::Hid o(H5Gopen2(file, "optimizer", H5P_DEFAULT));
    EXPECT_EQ(h5::readIntAttribute(o, "step"), 2);
    EXPECT_EQ(plm::model::readModelConfig(report.path).hidden, 32);  // also a plm model file
  }

  // A fresh trainer loads it back completely.
  plm::train::Trainer u(tinyDeck(dir, "layout", {"train.steps=4", "checkpoint.resume=none"}));
  EXPECT_FALSE(sameBits(host(u.optimizer().master()), host(t.optimizer().master())));
  const auto header = plm::ckpt::load(u, report.path);
  EXPECT_EQ(header.state.step, 2);
  EXPECT_TRUE(sameBits(host(u.optimizer().master()), host(t.optimizer().master())));
  EXPECT_TRUE(sameBits(host(u.model().parameters()), host(t.model().parameters())));
  EXPECT_TRUE(sameBits(host(u.optimizer().expAvg()), host(t.optimizer().expAvg())));
  EXPECT_TRUE(sameBits(host(u.optimizer().expAvgSq()), host(t.optimizer().expAvgSq())));
  EXPECT_EQ(u.optimizer().stepCount(), 2);
  EXPECT_EQ(u.state().step, 2);
  EXPECT_EQ(u.state().tokens_seen, t.state().tokens_seen);
  EXPECT_EQ(u.state().cursor, t.state().cursor);
  EXPECT_EQ(u.trainLoader().cursor(), t.state().cursor);
}

TEST_F(Checkpoint, KeepPrunesOldestAndOnlyCheckpoints) {
  trainTiny(dir, "prune", 5, 1, {"checkpoint.keep=2"});
  const auto listed = plm::ckpt::listCheckpoints(dir + "/prune/ckpt");
  ASSERT_EQ(listed.size(), 2u);
  EXPECT_EQ(listed[0].step, 4);
  EXPECT_EQ(listed[1].step, 5);

  const std::string d = dir + "/prune/ckpt";
  if (plm::dist::worldRank() == 0) {
    for (const char* name : {"notes.h5", "step_12.h5", "other.tmp", "step_000009.h5.tmp"})
      std::ofstream(d + "/" + name) << "x";
  }
  MPI_Barrier(MPI_COMM_WORLD);
  const auto removed = plm::ckpt::prune(d, 1, MPI_COMM_WORLD);
  ASSERT_EQ(removed.size(), 1u);
  EXPECT_EQ(fs::path(removed[0]).filename(), "step_000004.h5");
  const auto stale = plm::ckpt::removeTemporaries(d, MPI_COMM_WORLD);
  ASSERT_EQ(stale.size(), 1u);
  EXPECT_EQ(fs::path(stale[0]).filename(), "step_000009.h5.tmp");
  for (const char* name : {"notes.h5", "step_12.h5", "other.tmp", "step_000005.h5"})
    EXPECT_TRUE(fs::exists(d + "/" + name)) << name;
}

TEST_F(Checkpoint, KeepZeroKeepsAll) {
  trainTiny(dir, "keep_all", 5, 1, {"checkpoint.keep=0"});
  const auto listed = plm::ckpt::listCheckpoints(dir + "/keep_all/ckpt");
  ASSERT_EQ(listed.size(), 5u);  // checkpoint.keep: 0 (documented "keep all") deletes none
  EXPECT_EQ(listed.front().step, 1);
  EXPECT_EQ(listed.back().step, 5);
}

TEST_F(Checkpoint, TruncatedFileIsRefusedAndAutoFallsBack) {
  const std::string d = dir + "/trunc/ckpt";
  if (plm::dist::worldRank() == 0) fs::create_directories(d);
  copyFile(good, d + "/step_000003.h5");
  copyFile(good, d + "/step_000009.h5", std::int64_t(fs::file_size(good) / 2));
  EXPECT_THROW(plm::ckpt::readHeader(d + "/step_000009.h5"), plm::ckpt::CorruptCheckpoint);

  plm::train::Trainer t(tinyDeck(dir, "trunc", {"checkpoint.resume=" + d + "/step_000009.h5"}));
  try {
    plm::ckpt::resume(t);
    ADD_FAILURE() << "an explicit truncated checkpoint was accepted";
  } catch (const plm::ckpt::CorruptCheckpoint& e) {
    EXPECT_NE(std::string(e.what()).find("step_000009.h5"), std::string::npos) << e.what();
    EXPECT_TRUE(e.collective());
  }
  EXPECT_EQ(t.state().step, 0);

  plm::train::Trainer a(tinyDeck(dir, "trunc"));
  EXPECT_EQ(plm::ckpt::resume(a), d + "/step_000003.h5");
  EXPECT_EQ(a.state().step, 3);
}

TEST_F(Checkpoint, DamagedTensorBytesAreRefused) {
  const std::string d = dir + "/damaged/ckpt";
  if (plm::dist::worldRank() == 0) fs::create_directories(d);
  copyFile(good, d + "/step_000003.h5");
  const std::string name = "esm.encoder.layer.1.intermediate.dense.weight";
  if (plm::dist::worldRank() == 0) {
    haddr_t address;
    {
      h5::Hid file = h5::openFileSerial(d + "/step_000003.h5");
      h5::Hid ds = h5::openDataset(file, "optimizer/exp_avg_sq/" + name);
      address = H5Dget_offset(ds);
    }
    ASSERT_NE(address, HADDR_UNDEF);
    const int fd = ::open((d + "/step_000003.h5").c_str(), O_RDWR);
    ASSERT_GE(fd, 0);
    std::uint32_t word = 0;
    ASSERT_EQ(::pread(fd, &word, 4, off_t(address) + 100), 4);
    word ^= 0x00010000u;  // one flipped bit
    ASSERT_EQ(::pwrite(fd, &word, 4, off_t(address) + 100), 4);
    ::close(fd);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  plm::train::Trainer t(tinyDeck(dir, "damaged", {"checkpoint.resume=none"}));
  const auto before = host(t.optimizer().master());
  try {
    plm::ckpt::load(t, d + "/step_000003.h5");
    ADD_FAILURE() << "a damaged checkpoint was accepted";
  } catch (const plm::ckpt::CorruptCheckpoint& e) {
    EXPECT_NE(std::string(e.what()).find("exp_avg_sq/" + name), std::string::npos) << e.what();
  }
  EXPECT_TRUE(sameBits(before, host(t.optimizer().master())))
      << "a refused load changed the trainer";
  EXPECT_EQ(t.state().step, 0);
  // auto with nothing else usable refuses instead of silently starting over.
  plm::train::Trainer a(tinyDeck(dir, "damaged"));
  try {
    plm::ckpt::resume(a);
    ADD_FAILURE() << "resume: auto started over next to an unusable checkpoint";
  } catch (const plm::Error& e) {
    EXPECT_NE(std::string(e.what()).find("none is usable"), std::string::npos) << e.what();
  }
}

TEST_F(Checkpoint, ExplicitMissingPathIsRefused) {
  plm::train::Trainer t(tinyDeck(dir, "missing", {"checkpoint.resume=" + dir + "/nowhere.h5"}));
  try {
    plm::ckpt::resume(t);
    ADD_FAILURE() << "a missing checkpoint path was accepted";
  } catch (const plm::Error& e) {
    EXPECT_NE(std::string(e.what()).find("nowhere.h5"), std::string::npos) << e.what();
  }
}

// Loads `good` into a trainer built with `overrides`; returns the refusal text ("" if accepted).
std::string refusal(const std::string& dir, const std::string& good,
                    std::vector<std::string> overrides) {
  overrides.push_back("checkpoint.resume=" + good);
  plm::train::Trainer t(tinyDeck(dir, "refuse", overrides));
  try {
    plm::ckpt::resume(t);
  } catch (const plm::ckpt::CorruptCheckpoint& e) {
    return std::string("CORRUPT? ") + e.what();
  } catch (const plm::Error& e) {
    EXPECT_TRUE(e.collective());
    EXPECT_EQ(t.state().step, 0) << "a refused checkpoint was partly loaded";
    return e.what();
  }
  EXPECT_EQ(t.state().step, 3);
  return "";
}

TEST_F(Checkpoint, OtherModelShapeIsRefused) {
  const std::string why = refusal(dir, good, {"model.hidden=48", "model.ffn=96"});
  EXPECT_NE(why.find("model: the checkpoint holds layers 2, hidden 32"), std::string::npos) << why;
  EXPECT_NE(why.find("hidden 48"), std::string::npos) << why;
  EXPECT_NE(refusal(dir, good, {"model.layers=3"}).find("layers 3"), std::string::npos);
  // The same shape spelled differently is the same model.
  EXPECT_EQ(refusal(dir, good, {"model.recompute=layer"}), "");
}

TEST_F(Checkpoint, OtherDataStreamIsRefused) {
  std::string why = refusal(dir, good, {"data.seed=8"});
  EXPECT_NE(why.find("data.seed: 7 in the checkpoint, 8 now"), std::string::npos) << why;
  why = refusal(dir, good, {"data.mask_prob=0.2", "data.micro_batch_tokens=2048"});
  EXPECT_NE(why.find("data.mask_prob"), std::string::npos) << why;
  EXPECT_NE(why.find("data.micro_batch_tokens"), std::string::npos) << why;
  // Another dataset (a different sequence count), whatever its name.
  plm::test::writeTinyDataset(dir + "/other.h5", 65, 5, MPI_COMM_WORLD);
  why = refusal(dir, good, {"data.train=" + dir + "/other.h5"});
  EXPECT_NE(why.find("data.train: the checkpoint was trained on"), std::string::npos) << why;
  // The same dataset under another name is accepted.
  copyFile(dir + "/train.h5", dir + "/moved.h5");
  EXPECT_EQ(refusal(dir, good, {"data.train=" + dir + "/moved.h5"}), "");
}

TEST_F(Checkpoint, SafeChangesAreAccepted) {
  EXPECT_EQ(refusal(dir, good,
                    {"train.steps=20", "train.log_every=5", "train.eval_every=7",
                     "checkpoint.every=4", "checkpoint.keep=1", "optimizer.lr=1.0e-3",
                     "schedule.warmup_steps=5", "data.tokens_per_batch=8192"}),
            "");
}

TEST(DeckChanges, SortedIntoRefusedTrainingHarmless) {
  auto a = plm::deck::toYaml(*tinyDeck("/x", "r"));
  auto b = plm::deck::toYaml(*tinyDeck("/x", "r",
                                       {"train.steps=9", "optimizer.lr=1.0e-3", "data.seed=2",
                                        "checkpoint.keep=5", "data.prefetch=3"}));
  const auto c = plm::ckpt::compareDecks(a, b);
  auto keys = [](const std::vector<plm::ckpt::DeckChange>& v) {
    std::vector<std::string> k;
    for (const auto& x : v) k.push_back(x.key);
    return k;
  };
  EXPECT_EQ(keys(c.refused), (std::vector<std::string>{"data.seed"}));
  EXPECT_EQ(keys(c.training), (std::vector<std::string>{"optimizer.lr"}));
  EXPECT_EQ(keys(c.harmless),
            (std::vector<std::string>{"checkpoint.keep", "data.prefetch", "train.steps"}));
  ASSERT_EQ(c.refused.size(), 1u);
  EXPECT_EQ(c.refused[0].stored, "7");
  EXPECT_EQ(c.refused[0].current, "2");
  // With decay_steps 0 the schedule ends at train.steps, so a new length changes training.
  a = plm::deck::toYaml(*tinyDeck("/x", "r", {"schedule.decay_steps=0"}));
  b = plm::deck::toYaml(*tinyDeck("/x", "r", {"schedule.decay_steps=0", "train.steps=9"}));
  EXPECT_EQ(keys(plm::ckpt::compareDecks(a, b).training),
            (std::vector<std::string>{"train.steps"}));
  EXPECT_TRUE(plm::ckpt::compareDecks(a, a).harmless.empty());
}

// Loading shares each rank's rows with all; batch limits small enough that every batching case
// occurs: several tensors in one batch (a, b), a tensor larger than the limit alone (c), a tensor
// with fewer rows than ranks (d: one row, so at 2 ranks rank 0 owns none of it).
TEST(ShareRows, EveryRankGetsEveryRow) {
  std::vector<plm::model::TensorInfo> tensors = {
      {"a", {7, 3}, 0, 21}, {"b", {5}, 21, 5}, {"c", {40, 4}, 26, 160}, {"d", {1, 2}, 186, 2}};
  const int rank = plm::dist::worldRank(), world = plm::dist::worldSize();
  auto expected = [](std::size_t i) { return 0.5f + float(i); };
  for (std::int64_t limit : {std::int64_t(30), std::int64_t(1) << 27}) {
    std::vector<float> values(188, -1.0f);
    for (const auto& t : tensors) {  // this rank's rows only, as the reads leave them
      const std::int64_t rows = t.shape[0], row_size = t.size / rows;
      auto [first, last] = plm::model::rowRange(rows, rank, world);
      for (std::int64_t k = first * row_size; k < last * row_size; ++k)
        values[std::size_t(t.offset + k)] = expected(std::size_t(t.offset + k));
    }
    plm::ckpt::detail::shareRows(tensors, values.data(), MPI_COMM_WORLD, limit);
    for (std::size_t i = 0; i < values.size(); ++i)
      ASSERT_EQ(values[i], expected(i)) << "element " << i;
  }
}

TEST(Metrics, TruncatedAfterTheCheckpointStep) {
  if (plm::dist::worldRank() != 0) return;
  const std::string scratch = plm::test::sharedTempDir(MPI_COMM_SELF, "metrics");
  const std::string path = scratch + "/metrics.jsonl";
  std::ofstream(path) << "{\"kind\":\"train\",\"step\":1,\"loss\":3.5}\n"
                      << "{\"kind\":\"eval\",\"step\":2,\"valid_loss\":3.4}\n"
                      << "{\"kind\":\"train\",\"step\":2,\"loss\":3.4}\n"
                      << "{\"kind\":\"train\",\"step\":3,\"loss\":3.3}\n"
                      << "{\"kind\":\"train\",\"st";
  EXPECT_EQ(plm::ckpt::truncateMetrics(path, 2), 2);
  std::ifstream in(path);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(text,
            "{\"kind\":\"train\",\"step\":1,\"loss\":3.5}\n{\"kind\":\"eval\",\"step\":2,\"valid_"
            "loss\":3.4}\n"
            "{\"kind\":\"train\",\"step\":2,\"loss\":3.4}\n");
  EXPECT_EQ(plm::ckpt::truncateMetrics(path, 2), 0);
  plm::test::removeSharedDir(MPI_COMM_SELF, scratch);
}

}  // namespace
