// Exact resume on the same rank count: an uninterrupted run of 6 steps and a run stopped during
// step 5 (after the checkpoint of step 3, as a kill would stop it) and resumed to step 6 write
// the same metrics.jsonl losses, character for character, and the same final weights, bit for
// bit.  So does a run of 3 steps continued with train.steps raised to 6 (an allowed change: the
// schedule's decay_steps is explicit, so the learning rates do not move).
#include "tiny_run.hpp"

#include "dist/runtime.hpp"

#include <gtest/gtest.h>

#include <cstring>

namespace {

using plm::test::Interrupted;
using plm::test::tinyDeck;

std::vector<float> masterWeights(plm::train::Trainer& t) {
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), t.optimizer().master());
  return std::vector<float>(h.data(), h.data() + h.extent(0));
}

class Resume : public ::testing::Test {
 protected:
  void SetUp() override {
    dir = plm::test::sharedTempDir(MPI_COMM_WORLD, "resume");
    plm::test::writeTinyDataset(dir + "/train.h5", 64, 5, MPI_COMM_WORLD);
    plm::train::Trainer a(tinyDeck(dir, "a", {"checkpoint.every=0"}));
    plm::ckpt::installHooks(a);
    a.run();
    uninterrupted = masterWeights(a);
  }
  void TearDown() override { plm::test::removeSharedDir(MPI_COMM_WORLD, dir); }
  void expectSameAsUninterrupted(const std::string& run, plm::train::Trainer& resumed) {
    const std::vector<float> weights = masterWeights(resumed);
    ASSERT_EQ(weights.size(), uninterrupted.size());
    EXPECT_EQ(std::memcmp(weights.data(), uninterrupted.data(), weights.size() * sizeof(float)), 0)
        << "final weights differ";
    if (plm::dist::worldRank() != 0) return;
    const auto want = plm::test::metricsLosses(dir + "/a/metrics.jsonl");
    const auto got = plm::test::metricsLosses(dir + "/" + run + "/metrics.jsonl");
    ASSERT_EQ(want.size(), 6u);
    ASSERT_EQ(got.size(), want.size()) << "steps logged by the resumed run";
    for (const auto& [step, loss] : want) {
      ASSERT_TRUE(got.count(step)) << "step " << step;
      EXPECT_EQ(got.at(step), loss) << "loss of step " << step;
    }
    EXPECT_NE(want.at(1), want.at(6)) << "the run trained nothing";
    // Nothing but the losses of steps 1..6, once each (the interrupted run's records after its
    // checkpoint were cut and rewritten), besides the event records (start, checkpoint, resume).
    std::ifstream in(dir + "/" + run + "/metrics.jsonl");
    int lines = 0, resumes = 0;
    for (std::string line; std::getline(in, line);) {
      if (line.find("\"kind\":\"event\"") == std::string::npos) ++lines;
      if (line.find("\"event\":\"resume\"") != std::string::npos) ++resumes;
    }
    EXPECT_EQ(lines, 6);
    EXPECT_EQ(resumes, 1);
  }
  std::string dir;
  std::vector<float> uninterrupted;  // master weights after the uninterrupted run
};

TEST_F(Resume, KilledRunContinuesBitIdentically) {
  {
    plm::train::Trainer b(tinyDeck(dir, "b"));
    plm::train::Trainer::Hooks extra;
    extra.on_step = [](plm::train::Trainer& t, const plm::train::StepStats&) {
      if (t.state().step == 5) throw Interrupted{};
    };
    plm::ckpt::installHooks(b, extra);
    EXPECT_THROW(b.run(), Interrupted);
  }
  const auto listed = plm::ckpt::listCheckpoints(dir + "/b/ckpt");
  ASSERT_EQ(listed.size(), 1u);
  EXPECT_EQ(listed[0].step, 3);
  if (plm::dist::worldRank() == 0)  // steps 1..4 were logged before the "kill"
    EXPECT_EQ(plm::test::metricsLosses(dir + "/b/metrics.jsonl").size(), 4u);

  plm::train::Trainer resumed(tinyDeck(dir, "b"));
  std::vector<std::int64_t> steps_run;
  plm::train::Trainer::Hooks extra;
  extra.on_step = [&](plm::train::Trainer& t, const plm::train::StepStats&) {
    steps_run.push_back(t.state().step);
  };
  plm::ckpt::installHooks(resumed, extra);
  resumed.run();
  EXPECT_EQ(steps_run, (std::vector<std::int64_t>{4, 5, 6}));
  expectSameAsUninterrupted("b", resumed);
}

TEST_F(Resume, LongerRunContinuesBitIdentically) {
  {
    plm::train::Trainer c(tinyDeck(dir, "c", {"train.steps=3"}));
    plm::ckpt::installHooks(c);
    c.run();
  }
  plm::train::Trainer longer(tinyDeck(dir, "c", {"train.steps=6"}));
  plm::ckpt::installHooks(longer);
  longer.run();
  EXPECT_EQ(longer.state().step, 6);
  expectSameAsUninterrupted("c", longer);
}

TEST_F(Resume, NoneStartsFresh) {
  {
    plm::train::Trainer c(tinyDeck(dir, "d", {"train.steps=3"}));
    plm::ckpt::installHooks(c);
    c.run();
  }
  plm::train::Trainer fresh(
      tinyDeck(dir, "d", {"train.steps=2", "checkpoint.resume=none", "checkpoint.every=0"}));
  std::vector<std::int64_t> steps_run;
  plm::train::Trainer::Hooks extra;
  extra.on_step = [&](plm::train::Trainer& t, const plm::train::StepStats&) {
    steps_run.push_back(t.state().step);
  };
  plm::ckpt::installHooks(fresh, extra);
  fresh.run();
  EXPECT_EQ(steps_run, (std::vector<std::int64_t>{1, 2}));
}

}  // namespace
