// Checkpoints of sharded runs (parallel.shard_degree > 1) resume on any layout, inside one
// 4-rank job: the first N ranks train 3 steps under layout A and checkpoint, then the first M
// ranks resume under layout B for 3 more: shard 4 -> shard 2 (x replicate 1), shard 4 -> one
// rank, 2 shard x 2 replicate -> shard 4.  Each continued run must see exactly the uninterrupted
// data-parallel run's data (token and masked counts per step, final cursor) and reach its losses
// to 1e-5 relative; the reference is plain data parallelism on all 4 ranks.
#include "tiny_run.hpp"

#include "core/error.hpp"
#include "dist/runtime.hpp"
#include "model/model_file.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <functional>
#include <vector>

namespace {

using plm::test::onFirstRanks;
using plm::test::tinyDeck;
using plm::test::trainRecords;
using Record = plm::test::StepRecord;

struct Layout {
  int ranks, shard;
  std::string name() const { return std::to_string(ranks) + "r_s" + std::to_string(shard); }
  std::vector<std::string> deck(const std::string& steps) const {
    return {"train.steps=" + steps, "parallel.shard_degree=" + std::to_string(shard)};
  }
};

TEST(FsdpResume, ShardedCheckpointResumesOnAnyLayout) {
  if (plm::test::noCollectivesForDeviceMemory(MPI_COMM_WORLD))
    GTEST_SKIP() << "device memory over plain MPI (PLM_COMM_BACKEND=mpi)";
  if (plm::dist::worldSize() != 4) GTEST_SKIP() << "this test runs at 4 ranks";
  const std::string dir = plm::test::sharedTempDir(MPI_COMM_WORLD, "fsdp");
  plm::test::writeTinyDataset(dir + "/train.h5", 64, 9, MPI_COMM_WORLD);
  plm::data::Cursor reference_cursor;
  const auto reference = trainRecords(tinyDeck(dir, "reference", {"checkpoint.every=0"}),
                                      MPI_COMM_WORLD, &reference_cursor);
  ASSERT_EQ(reference.size(), 6u);

  for (auto [a, b] : {std::pair{Layout{4, 4}, Layout{2, 2}}, std::pair{Layout{4, 4}, Layout{1, 1}},
                      std::pair{Layout{4, 2}, Layout{4, 4}}}) {
    const std::string run = a.name() + "_to_" + b.name();
    std::vector<Record> got;
    plm::data::Cursor cursor;
    onFirstRanks(a.ranks,
                 [&](MPI_Comm comm) { got = trainRecords(tinyDeck(dir, run, a.deck("3")), comm); });
    ASSERT_EQ(plm::ckpt::listCheckpoints(dir + "/" + run + "/ckpt").size(), 1u) << run;
    onFirstRanks(b.ranks, [&](MPI_Comm comm) {
      auto more = trainRecords(tinyDeck(dir, run, b.deck("6")), comm, &cursor);
      got.insert(got.end(), more.begin(), more.end());
    });
    if (plm::dist::worldRank() != 0) continue;  // rank 0 took part in every run
    ASSERT_EQ(got.size(), reference.size()) << run;
    for (std::size_t i = 0; i < got.size(); ++i) {
      EXPECT_EQ(got[i].step, reference[i].step) << run;
      EXPECT_EQ(got[i].tokens, reference[i].tokens) << run << " step " << got[i].step;
      EXPECT_EQ(got[i].masked, reference[i].masked) << run << " step " << got[i].step;
      EXPECT_LE(std::abs(got[i].loss - reference[i].loss), 1e-5 * std::abs(reference[i].loss))
          << run << " step " << got[i].step << ": " << got[i].loss << " vs " << reference[i].loss;
    }
    EXPECT_EQ(cursor, reference_cursor) << run;
  }
  plm::test::removeSharedDir(MPI_COMM_WORLD, dir);
}

// parallel.gather_dtype: bf16 at shard = ranks: the all-gathers move the shards' bf16 copies,
// so a resume must recast them from the restored masters.  3 + 3 steps equal 6 uninterrupted
// (a stale bf16 copy after the restore would train the next steps on other weights).
TEST(FsdpResume, Bf16GathersResumeExactly) {
  if (plm::test::noCollectivesForDeviceMemory(MPI_COMM_WORLD))
    GTEST_SKIP() << "device memory over plain MPI (PLM_COMM_BACKEND=mpi)";
  const int world = plm::dist::worldSize();
  if (world < 2) GTEST_SKIP() << "sharding needs two ranks";
  const std::string dir = plm::test::sharedTempDir(MPI_COMM_WORLD, "fsdp_bf16");
  plm::test::writeTinyDataset(dir + "/train.h5", 64, 9, MPI_COMM_WORLD);
  const std::vector<std::string> common = {"parallel.shard_degree=" + std::to_string(world),
                                           "parallel.gather_dtype=bf16"};
  auto with = [&](std::vector<std::string> extra) {
    extra.insert(extra.end(), common.begin(), common.end());
    return extra;
  };
  const auto reference = trainRecords(
      tinyDeck(dir, "reference", with({"checkpoint.every=0", "train.steps=6"})), MPI_COMM_WORLD);
  auto got = trainRecords(tinyDeck(dir, "resumed", with({"train.steps=3"})), MPI_COMM_WORLD);
  const auto more = trainRecords(tinyDeck(dir, "resumed", with({"train.steps=6"})), MPI_COMM_WORLD);
  got.insert(got.end(), more.begin(), more.end());
  ASSERT_EQ(got.size(), reference.size());
  for (std::size_t i = 0; i < got.size(); ++i)
    EXPECT_LE(std::abs(got[i].loss - reference[i].loss), 1e-6 * std::abs(reference[i].loss))
        << "step " << got[i].step << ": " << got[i].loss << " vs " << reference[i].loss;
  plm::test::removeSharedDir(MPI_COMM_WORLD, dir);
}

// A non-finite gradient under sharding (PLM_TEST_NONFINITE: NaN in every rank's gradient
// shard at step 5) is not applied; `skip` drops the step, `rollback` reloads the checkpoint of
// step 4 into the shards, replays and skips step 5's batch: both end with the same losses and
// weights (gathered from the shards), all finite, and differ from the clean run.
TEST(FsdpResume, NonfiniteStepSkipsOrRollsBackOnShards) {
  const int world = plm::dist::worldSize();
  const std::string dir = plm::test::sharedTempDir(MPI_COMM_WORLD, "fsdp_nan");
  plm::test::writeTinyDataset(dir + "/train.h5", 64, 9, MPI_COMM_WORLD);
  const std::string shard = "parallel.shard_degree=" + std::to_string(world);
  auto run = [&](const std::string& name, std::vector<std::string> overrides, std::int64_t* skipped,
                 std::int64_t* rollbacks) {
    overrides.push_back(shard);
    overrides.push_back("checkpoint.every=2");
    plm::train::Trainer t(tinyDeck(dir, name, overrides), MPI_COMM_WORLD);
    plm::ckpt::installHooks(t, {});
    t.run();
    *skipped = t.skippedSteps();
    *rollbacks = t.rollbacks();
    auto host = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), t.optimizer().master());
    return std::vector<float>(host.data(), host.data() + host.extent(0));
  };
  std::int64_t skipped = 0, rollbacks = 0;
  const auto clean = run("clean", {}, &skipped, &rollbacks);
  setenv("PLM_TEST_NONFINITE", "5", 1);
  const auto skip = run("skip", {"train.on_nonfinite=skip"}, &skipped, &rollbacks);
  EXPECT_EQ(skipped, 1);
  const auto rolled = run("roll", {"train.on_nonfinite=rollback"}, &skipped, &rollbacks);
  unsetenv("PLM_TEST_NONFINITE");
  EXPECT_EQ(skipped, 1);
  EXPECT_EQ(rollbacks, 1);
  ASSERT_EQ(skip.size(), clean.size());
  ASSERT_EQ(rolled.size(), clean.size());
  double differs = 0, worst = 0, largest = 0;
  for (std::size_t i = 0; i < clean.size(); ++i) {
    ASSERT_TRUE(std::isfinite(skip[i]) && std::isfinite(rolled[i])) << "element " << i;
    differs = std::max(differs, double(std::abs(skip[i] - clean[i])));
    worst = std::max(worst, double(std::abs(skip[i] - rolled[i])));
    largest = std::max(largest, double(std::abs(clean[i])));
  }
  EXPECT_GT(differs, 0.0) << "the NaN step was applied or never injected";
  EXPECT_LE(worst, 1e-6 * largest) << "rollback and skip end differently";
  if (plm::dist::worldRank() == 0) {
    const auto a = plm::test::metricsLosses(dir + "/skip/metrics.jsonl");
    const auto b = plm::test::metricsLosses(dir + "/roll/metrics.jsonl");
    EXPECT_EQ(a, b);
    EXPECT_EQ(a.at(5), "null") << "the skipped step reported a loss";
  }
  plm::test::removeSharedDir(MPI_COMM_WORLD, dir);
}

// A sharded run starts from shards each rank draws itself and ends by writing model.h5 from
// them, each rank its rows, gathered unit by unit (no whole-model buffer): the file equals that
// of the same run under plain data parallelism (one whole model per rank) to 1e-5 of the
// largest parameter, and the first step's loss is the same (the same initial parameters).
TEST(FsdpResume, ShardedStartAndModelFileEqualDataParallel) {
  if (plm::test::noCollectivesForDeviceMemory(MPI_COMM_WORLD))
    GTEST_SKIP() << "device memory over plain MPI (PLM_COMM_BACKEND=mpi)";
  const int world = plm::dist::worldSize();
  if (world < 2) GTEST_SKIP() << "sharding needs two ranks";
  const std::string dir = plm::test::sharedTempDir(MPI_COMM_WORLD, "fsdp_file");
  plm::test::writeTinyDataset(dir + "/train.h5", 64, 9, MPI_COMM_WORLD);
  const auto dp =
      trainRecords(tinyDeck(dir, "dp", {"checkpoint.every=0", "train.steps=2"}), MPI_COMM_WORLD);
  const auto sharded = trainRecords(tinyDeck(dir, "sharded",
                                             {"checkpoint.every=0", "train.steps=2",
                                              "parallel.shard_degree=" + std::to_string(world)}),
                                    MPI_COMM_WORLD);
  ASSERT_EQ(dp.size(), 2u);
  ASSERT_EQ(sharded.size(), 2u);
  EXPECT_LE(std::abs(sharded[0].loss - dp[0].loss), 1e-6 * std::abs(dp[0].loss))
      << "the sharded start differs from the whole model's";
  const plm::model::Esm2Config config = plm::model::readModelConfig(dir + "/dp/model.h5");
  const auto tensors = plm::model::tensorTable(config);
  const std::int64_t n = tensors.back().offset + tensors.back().size;
  std::vector<float> a(std::size_t(n), 0.0f), b(std::size_t(n), 0.0f);
  plm::model::readModelValues(dir + "/dp/model.h5", MPI_COMM_WORLD, config, tensors, a.data());
  plm::model::readModelValues(dir + "/sharded/model.h5", MPI_COMM_WORLD, config, tensors, b.data());
  double worst = 0, largest = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    worst = std::max(worst, double(std::abs(a[i] - b[i])));
    largest = std::max(largest, double(std::abs(a[i])));
  }
  EXPECT_GT(largest, 0.0);
  EXPECT_LE(worst, 1e-5 * largest) << "the sharded model file differs";
  plm::test::removeSharedDir(MPI_COMM_WORLD, dir);
}

// A layout that does not multiply to the rank count stops the trainer with both numbers named.
TEST(FsdpResume, BadLayoutIsRefusedWithBothNumbers) {
  const int world = plm::dist::worldSize();
  const std::string dir = plm::test::sharedTempDir(MPI_COMM_WORLD, "fsdp_bad");
  plm::test::writeTinyDataset(dir + "/train.h5", 16, 9, MPI_COMM_WORLD);
  const std::vector<std::string> bad = {"parallel.shard_degree=2",
                                        "parallel.replicate_degree=" + std::to_string(world + 1)};
  try {
    plm::train::Trainer t(tinyDeck(dir, "bad", bad), MPI_COMM_WORLD);
    ADD_FAILURE() << "an impossible layout was accepted";
  } catch (const plm::Error& e) {
    const std::string m = e.what();
    if (world % 2 == 0) {
      EXPECT_NE(m.find("shard_degree 2 x replicate_degree " + std::to_string(world + 1)),
                std::string::npos)
          << m;
      EXPECT_NE(m.find("the job has " + std::to_string(world) + " ranks"), std::string::npos) << m;
    } else {
      EXPECT_NE(m.find("parallel.shard_degree: 2"), std::string::npos) << m;
    }
  }
  plm::test::removeSharedDir(MPI_COMM_WORLD, dir);
}

}  // namespace
