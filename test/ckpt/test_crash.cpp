// A save killed half-way (test/ckpt/CMakeLists.txt chains two runs of this program as ctest
// fixtures, in the directory PLM_CKPT_TEST_DIR, once per fault phase):
//  - Crash.Run trains with checkpoints every 2 steps and PLM_CKPT_FAIL_AT=4:<phase>, so every
//    rank _exits in the middle of the save of step 4 (ctest checks that it did): after writing
//    /model (phase optimizer: half of the moments written) or after the complete file was
//    flushed but before its rename (phase flush);
//  - Crash.Check then finds the checkpoint of step 2 intact, step_000004.h5.tmp left behind
//    (unusable when cut short), and a resumed run that ignores and removes it and ends with the
//    same metrics.jsonl losses as an uninterrupted run.
#include "tiny_run.hpp"

#include "dist/runtime.hpp"

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>

namespace {

namespace fs = std::filesystem;
using plm::test::tinyDeck;

std::string testDir() {
  const char* d = std::getenv("PLM_CKPT_TEST_DIR");
  return d ? d : "";
}

TEST(Crash, Run) {
  const std::string dir = testDir();
  if (dir.empty()) GTEST_SKIP() << "run by ctest with PLM_CKPT_TEST_DIR set";
  if (plm::dist::worldRank() == 0) {
    fs::remove_all(dir);
    fs::create_directories(dir);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  plm::test::writeTinyDataset(dir + "/train.h5", 64, 11, MPI_COMM_WORLD);
  {
    plm::train::Trainer reference(tinyDeck(dir, "reference", {"checkpoint.every=0"}));
    plm::ckpt::installHooks(reference);
    reference.run();
  }
  plm::train::Trainer t(tinyDeck(dir, "crash", {"checkpoint.every=2"}));
  plm::ckpt::installHooks(t);
  t.run();
  FAIL() << "the run should have been killed in the save of step 4 (PLM_CKPT_FAIL_AT="
         << (std::getenv("PLM_CKPT_FAIL_AT") ? std::getenv("PLM_CKPT_FAIL_AT") : "unset") << ")";
}

TEST(Crash, Check) {
  const std::string dir = testDir();
  if (dir.empty()) GTEST_SKIP() << "run by ctest with PLM_CKPT_TEST_DIR set";
  const std::string ckpt = dir + "/crash/ckpt";
  const auto listed = plm::ckpt::listCheckpoints(ckpt);
  ASSERT_EQ(listed.size(), 1u);
  EXPECT_EQ(listed[0].step, 2);
  ASSERT_TRUE(fs::exists(ckpt + "/step_000004.h5.tmp")) << "the killed save left no temporary file";
  EXPECT_EQ(plm::ckpt::readHeader(listed[0].path).state.step, 2);
  const char* phase = std::getenv("PLM_CKPT_TEST_PHASE");
  if (phase && std::string(phase) == "flush")  // complete, yet never taken: it was not renamed
    EXPECT_EQ(plm::ckpt::readHeader(ckpt + "/step_000004.h5.tmp").state.step, 4);
  else
    EXPECT_THROW(plm::ckpt::readHeader(ckpt + "/step_000004.h5.tmp"), plm::ckpt::CorruptCheckpoint);
  MPI_Barrier(MPI_COMM_WORLD);

  plm::train::Trainer t(tinyDeck(dir, "crash", {"checkpoint.every=2"}));
  std::vector<std::int64_t> steps_run;
  plm::train::Trainer::Hooks extra;
  extra.on_step = [&](plm::train::Trainer& tr, const plm::train::StepStats&) {
    steps_run.push_back(tr.state().step);
  };
  plm::ckpt::installHooks(t, extra);
  t.run();
  EXPECT_EQ(steps_run, (std::vector<std::int64_t>{3, 4, 5, 6}));
  EXPECT_FALSE(fs::exists(ckpt + "/step_000004.h5.tmp"));
  const auto after = plm::ckpt::listCheckpoints(ckpt);
  ASSERT_EQ(after.size(), 3u);
  EXPECT_EQ(after.back().step, 6);
  if (plm::dist::worldRank() == 0) {
    const auto want = plm::test::metricsLosses(dir + "/reference/metrics.jsonl");
    const auto got = plm::test::metricsLosses(dir + "/crash/metrics.jsonl");
    ASSERT_EQ(want.size(), 6u);
    EXPECT_EQ(got, want);
  }
}

}  // namespace
