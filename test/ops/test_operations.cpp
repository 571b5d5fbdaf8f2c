// Cluster operations inside one process, on 1 and 2 ranks (test/ckpt/tiny_run.hpp's 6-step run):
//  - a stop signal (raised on rank 0 only) stops every rank after the same step with a
//    checkpoint, and the resumed run ends bit for bit where an uninterrupted run ends; a signal
//    right after a regular save does not save twice; a second signal exits at once;
//  - train.on_nonfinite with a NaN injected into a gradient (PLM_TEST_NONFINITE): stop names the
//    step and the tensor and leaves the previous step's weights; skip drops the step; rollback
//    reloads the newest checkpoint and ends with the same weights as skip;
//  - checkpoint.async writes the same checkpoints as synchronous saves, and resumes exactly;
//  - the watchdog ends a stalled step, or a communicator's asynchronous error, naming the rank,
//    the step and the phase.
#include "../ckpt/tiny_run.hpp"

#include "core/failure.hpp"
#include "core/phase.hpp"
#include "dist/health.hpp"
#include "dist/runtime.hpp"
#include "train/preemption.hpp"
#include "train/stability.hpp"
#include "train/watchdog.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <stdexcept>
#include <thread>

namespace {

namespace fs = std::filesystem;
using plm::test::tinyDeck;
using plm::train::Trainer;

std::vector<float> hostCopy(const plm::View1<float>& v) {
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), v);
  return std::vector<float>(h.data(), h.data() + h.extent(0));
}

bool sameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

int countEvents(const std::string& metrics, const std::string& event) {
  std::ifstream in(metrics);
  int n = 0;
  for (std::string line; std::getline(in, line);)
    if (line.find("\"event\":\"" + event + "\"") != std::string::npos) ++n;
  return n;
}

struct EnvGuard {
  std::string name;
  EnvGuard(const std::string& n, const std::string& value) : name(n) {
    setenv(n.c_str(), value.c_str(), 1);
  }
  ~EnvGuard() { unsetenv(name.c_str()); }
};

class Operations : public ::testing::Test {
 protected:
  void SetUp() override {
    dir = plm::test::sharedTempDir(MPI_COMM_WORLD, "ops");
    plm::test::writeTinyDataset(dir + "/train.h5", 64, 5, MPI_COMM_WORLD);
  }
  void TearDown() override { plm::test::removeSharedDir(MPI_COMM_WORLD, dir); }

  // The weights after a run of `run` with `overrides` (and hooks `extra`); its end in `end`.
  std::vector<float> train(const std::string& run, const std::vector<std::string>& overrides,
                           Trainer::Hooks extra = {}, Trainer::RunEnd* end = nullptr,
                           std::int64_t* skipped = nullptr, std::int64_t* rollbacks = nullptr) {
    Trainer t(tinyDeck(dir, run, overrides));
    plm::ckpt::installHooks(t, extra);
    const Trainer::RunEnd e = t.run();
    if (end) *end = e;
    if (skipped) *skipped = t.skippedSteps();
    if (rollbacks) *rollbacks = t.rollbacks();
    return hostCopy(t.optimizer().master());
  }
  std::string dir;
};

TEST_F(Operations, StopSignalCheckpointsAndTheResumedRunEqualsAnUninterruptedOne) {
  const auto uninterrupted = train("a", {"checkpoint.every=0"});
  plm::train::installStopSignals();
  plm::train::clearStopSignal();
  // Rank 0 alone is signalled during step 4 (not a checkpoint step: every 3): every rank stops.
  Trainer::Hooks extra;
  std::vector<std::int64_t> steps;
  extra.on_step = [&](Trainer& t, const plm::train::StepStats&) {
    steps.push_back(t.state().step);
    if (t.state().step == 4 && t.rank() == 0) {  // delivered twice, as under Slurm
      std::raise(SIGTERM);
      std::raise(SIGUSR1);
    }
  };
  Trainer::RunEnd end = Trainer::RunEnd::Completed;
  train("s", {}, extra, &end);
  plm::train::clearStopSignal();
  EXPECT_EQ(end, Trainer::RunEnd::Stopped);
  EXPECT_EQ(steps, (std::vector<std::int64_t>{1, 2, 3, 4}));
  const auto listed = plm::ckpt::listCheckpoints(dir + "/s/ckpt");
  ASSERT_EQ(listed.size(), 2u);
  EXPECT_EQ(listed.back().step, 4);
  EXPECT_FALSE(fs::exists(dir + "/s/model.h5")) << "a stopped run wrote the final model";
  if (plm::dist::worldRank() == 0)
    EXPECT_EQ(countEvents(dir + "/s/metrics.jsonl", "stop_signal"), 1);

  steps.clear();
  Trainer::Hooks record;
  record.on_step = [&](Trainer& t, const plm::train::StepStats&) {
    steps.push_back(t.state().step);
  };
  const auto resumed = train("s", {}, record, &end);
  EXPECT_EQ(end, Trainer::RunEnd::Completed);
  EXPECT_EQ(steps, (std::vector<std::int64_t>{5, 6}));
  EXPECT_TRUE(sameBits(resumed, uninterrupted)) << "the resumed run ends elsewhere";
  if (plm::dist::worldRank() == 0) {
    const auto want = plm::test::metricsLosses(dir + "/a/metrics.jsonl");
    const auto got = plm::test::metricsLosses(dir + "/s/metrics.jsonl");
    EXPECT_EQ(got, want);
  }
}

TEST_F(Operations, StopSignalRightAfterASaveDoesNotSaveTwice) {
  plm::train::installStopSignals();
  plm::train::clearStopSignal();
  const int last = plm::dist::worldSize() - 1;  // the highest rank alone this time
  Trainer::Hooks extra;
  extra.on_step = [&](Trainer& t, const plm::train::StepStats&) {
    if (t.state().step == 3 && t.rank() == last) std::raise(SIGTERM);
  };
  Trainer::RunEnd end = Trainer::RunEnd::Completed;
  train("t", {"checkpoint.async=true"}, extra, &end);
  plm::train::clearStopSignal();
  EXPECT_EQ(end, Trainer::RunEnd::Stopped);
  const auto listed = plm::ckpt::listCheckpoints(dir + "/t/ckpt");
  ASSERT_EQ(listed.size(), 1u);
  EXPECT_EQ(listed[0].step, 3);
  EXPECT_EQ(plm::ckpt::readHeader(listed[0].path).state.step, 3);
  if (plm::dist::worldRank() == 0)  // rank 0 writes what the signalled rank received
    EXPECT_EQ(
        countEvents(dir + "/t/metrics.jsonl", "stop_signal\",\"step\":3,\"signal\":\"SIGTERM"), 1);
}

// One stop delivered several times (Slurm: every task, srun, the job script's forwarded
// signal) is one stop: a further signal counts only once the trainer has acted on the first,
// never during a save, and with status 75 once the stop's checkpoint is complete.
TEST(StopSignals, RepeatsAreOneStopUntilActedOnAndNeverDuringASave) {
  GTEST_FLAG_SET(death_test_style, "fast");
  EXPECT_EXIT(
      {
        plm::train::installStopSignals();
        plm::train::clearStopSignal();
        std::raise(SIGTERM);
        std::raise(SIGUSR1);  // the same stop again: ignored
        std::raise(SIGTERM);
        if (plm::train::stopSignal() != SIGTERM) std::_Exit(3);
        {
          plm::train::SaveScope saving;
          plm::train::stopActedOn();
          std::raise(SIGUSR1);  // during the stop's save: ignored
        }
        std::raise(SIGUSR1);  // acted on, no save: exits at once
        std::_Exit(4);        // not reached
      },
      ::testing::ExitedWithCode(128 + SIGUSR1), "second stop signal: exiting at once");
  EXPECT_EXIT(
      {
        plm::train::installStopSignals();
        plm::train::clearStopSignal();
        std::raise(SIGUSR1);
        plm::train::stopActedOn();
        plm::train::stopSaved();
        std::raise(SIGTERM);  // the checkpoint is complete: requeue status at once
        std::_Exit(4);
      },
      ::testing::ExitedWithCode(plm::train::exit_requeue), "checkpoint is complete");
  EXPECT_EXIT(
      {
        plm::train::installStopSignals();
        plm::train::clearStopSignal();
        std::raise(SIGUSR1);
        std::raise(SIGUSR1);
        std::raise(SIGTERM);
        std::_Exit(plm::train::stopSignal() == SIGUSR1 ? 5 : 6);  // still running: one stop
      },
      ::testing::ExitedWithCode(5), "");
}

// What a failing rank prints (core/failure.hpp): one line; Kokkos' allocation failure (a real
// one, 1 PiB) as what did not fit, what to change and the run's plan.
TEST(Failure, MessagesAreOneLineAndOutOfMemorySaysWhatToChange) {
  std::exception_ptr oom;
  try {
    plm::View1<char> huge(
        Kokkos::view_alloc(Kokkos::WithoutInitializing, std::string("plm::test::huge")),
        std::size_t(1) << 50);
  } catch (...) {
    oom = std::current_exception();
  }
  ASSERT_TRUE(oom) << "a 1 PiB allocation succeeded";
  plm::failure::setPlanNote("planned for this run: 1.0 GiB of buffers per rank");
  const std::string m = plm::failure::describe(oom);
  plm::failure::setPlanNote("");
  EXPECT_EQ(m.find('\n'), std::string::npos) << m;
  for (const char* part : {"out of memory: ", "allocation `plm::test::huge` of ",
                           "data.micro_batch_tokens", "model.recompute", "parallel.shard_degree",
                           "planned for this run: 1.0 GiB of buffers per rank"})
    EXPECT_NE(m.find(part), std::string::npos) << part << " not in: " << m;
  EXPECT_EQ(m.find("Traceback"), std::string::npos) << m;
  EXPECT_EQ(plm::failure::describe(std::make_exception_ptr(
                plm::Error("what went wrong\n  where\nTraceback functionality not available\n"))),
            "what went wrong; where");
  EXPECT_EQ(plm::failure::describe(std::make_exception_ptr(std::runtime_error("a bug"))),
            "internal error: a bug");
}

TEST_F(Operations, NonfiniteStopNamesTheStepAndTheTensorAndKeepsTheWeights) {
  EnvGuard nan("PLM_TEST_NONFINITE", "4");
  Trainer t(tinyDeck(dir, "n", {"train.on_nonfinite=stop"}));
  std::vector<float> after3;
  Trainer::Hooks extra;
  extra.on_step = [&](Trainer& tr, const plm::train::StepStats&) {
    if (tr.state().step == 3) after3 = hostCopy(tr.optimizer().master());
  };
  plm::ckpt::installHooks(t, extra);
  const std::string tensor = t.model().tensors().at(2).name;
  try {
    t.run();
    FAIL() << "the injected NaN did not stop the run";
  } catch (const plm::Error& e) {
    EXPECT_TRUE(e.collective());
    const std::string m = e.what();
    EXPECT_NE(m.find("step 4"), std::string::npos) << m;
    EXPECT_NE(m.find("the gradient of " + tensor + " (1 non-finite"), std::string::npos) << m;
    EXPECT_NE(m.find("train.on_nonfinite"), std::string::npos) << m;
  }
  EXPECT_EQ(t.state().step, 3);
  EXPECT_TRUE(sameBits(hostCopy(t.optimizer().master()), after3))
      << "the non-finite step changed the weights";
}

TEST_F(Operations, NonfiniteSkipAndRollbackDropTheStepAndAgree) {
  const auto clean = train("clean", {"checkpoint.every=2"});
  EnvGuard nan("PLM_TEST_NONFINITE", "5");
  std::int64_t skipped = 0, rollbacks = 0;
  const auto skip = train("skip", {"checkpoint.every=2", "train.on_nonfinite=skip"}, {}, nullptr,
                          &skipped, &rollbacks);
  EXPECT_EQ(skipped, 1);
  EXPECT_EQ(rollbacks, 0);
  EXPECT_FALSE(sameBits(skip, clean)) << "the NaN step was applied or never injected";
  for (float w : skip) ASSERT_TRUE(std::isfinite(w));

  // Rollback: reload step 4, replay, skip step 5's batch.  Replay is deterministic, so the run
  // ends where skip ends; the checkpoint load is what is new.
  const auto rolled = train("roll", {"checkpoint.every=2", "train.on_nonfinite=rollback"}, {},
                            nullptr, &skipped, &rollbacks);
  EXPECT_EQ(skipped, 1);
  EXPECT_EQ(rollbacks, 1);
  EXPECT_TRUE(sameBits(rolled, skip)) << "rollback and skip end differently";
  if (plm::dist::worldRank() == 0) {
    EXPECT_EQ(countEvents(dir + "/skip/metrics.jsonl", "nonfinite"), 1);
    EXPECT_EQ(countEvents(dir + "/roll/metrics.jsonl", "rollback"), 1);
    auto a = plm::test::metricsLosses(dir + "/skip/metrics.jsonl");
    auto b = plm::test::metricsLosses(dir + "/roll/metrics.jsonl");
    EXPECT_EQ(a, b);
    EXPECT_EQ(a.at(5), "null") << "the skipped step reported a loss";
  }

  // No checkpoint to roll back to: the step is skipped instead.
  const auto none = train("rollnone", {"checkpoint.every=0", "train.on_nonfinite=rollback"}, {},
                          nullptr, &skipped, &rollbacks);
  EXPECT_EQ(skipped, 1);
  EXPECT_EQ(rollbacks, 0);
  EXPECT_TRUE(sameBits(none, skip));
}

TEST_F(Operations, AsyncSavesEqualSyncSavesAndResumeExactly) {
  const auto uninterrupted = train("sync", {"checkpoint.every=2"});
  const auto async = train("async", {"checkpoint.every=2", "checkpoint.async=true"});
  EXPECT_TRUE(sameBits(async, uninterrupted));
  const auto a = plm::ckpt::listCheckpoints(dir + "/sync/ckpt");
  const auto b = plm::ckpt::listCheckpoints(dir + "/async/ckpt");
  ASSERT_EQ(a.size(), 3u);
  ASSERT_EQ(b.size(), 3u);
  for (std::size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].step, b[i].step);
    // Loading checks every CRC; the loaded state must be the same bits.
    Trainer x(tinyDeck(dir, "x", {"checkpoint.resume=none"}));
    Trainer y(tinyDeck(dir, "y", {"checkpoint.resume=none"}));
    const auto ha = plm::ckpt::load(x, a[i].path);
    const auto hb = plm::ckpt::load(y, b[i].path);
    EXPECT_EQ(ha.state.step, hb.state.step);
    EXPECT_EQ(ha.state.tokens_seen, hb.state.tokens_seen);
    EXPECT_EQ(ha.state.cursor.epoch, hb.state.cursor.epoch);
    EXPECT_EQ(ha.state.cursor.position, hb.state.cursor.position);
    EXPECT_EQ(ha.optimizer_step, hb.optimizer_step);
    EXPECT_TRUE(sameBits(hostCopy(x.optimizer().master()), hostCopy(y.optimizer().master())));
    EXPECT_TRUE(sameBits(hostCopy(x.optimizer().expAvg()), hostCopy(y.optimizer().expAvg())));
    EXPECT_TRUE(sameBits(hostCopy(x.optimizer().expAvgSq()), hostCopy(y.optimizer().expAvgSq())));
  }

  // Interrupted during step 5 while the save of step 4 may still be in flight, then resumed.
  Trainer::Hooks extra;
  extra.on_step = [](Trainer& t, const plm::train::StepStats&) {
    if (t.state().step == 5) throw plm::test::Interrupted{};
  };
  try {
    train("ar", {"checkpoint.every=2", "checkpoint.async=true"}, extra);
  } catch (const plm::test::Interrupted&) {
  }
  EXPECT_EQ(plm::ckpt::listCheckpoints(dir + "/ar/ckpt").back().step, 4);
  const auto resumed = train("ar", {"checkpoint.every=2", "checkpoint.async=true"});
  EXPECT_TRUE(sameBits(resumed, uninterrupted));
}

TEST(Watchdog, AStalledStepEndsTheProcessNamingRankStepAndPhase) {
  GTEST_FLAG_SET(death_test_style, "fast");
  plm::train::WatchdogOptions options;
  options.fixed_timeout = 0.3;
  options.grace = 0;
  EXPECT_EXIT(
      {
        plm::train::Watchdog dog(options, 7);
        dog.arm(42, "step");
        plm::phase::set("a test phase");
        std::this_thread::sleep_for(std::chrono::seconds(20));
        std::_Exit(0);
      },
      ::testing::ExitedWithCode(plm::train::exit_watchdog),
      "plm watchdog: rank 7 on .*: step 42, in a test phase: step 42 has not finished after");
}

TEST(Watchdog, AnAsynchronousCommunicatorErrorEndsTheProcessTheSameWay) {
  // The NCCL communicator registers ncclCommGetAsyncError as such a check (dist/health.hpp).
  const int healthy = plm::dist::addHealthCheck([] { return std::string(); });
  EXPECT_EQ(plm::dist::pollHealth(), "");
  const int broken = plm::dist::addHealthCheck([] { return std::string("remote peer gone"); });
  EXPECT_EQ(plm::dist::pollHealth(), "remote peer gone");
  GTEST_FLAG_SET(death_test_style, "fast");
  plm::train::WatchdogOptions options;
  options.grace = 0;
  EXPECT_EXIT(
      {
        plm::train::Watchdog dog(options, 3);
        dog.arm(9, "step");
        plm::phase::set("gradient all-reduce (finish)");
        std::this_thread::sleep_for(std::chrono::seconds(20));
        std::_Exit(0);
      },
      ::testing::ExitedWithCode(plm::train::exit_watchdog),
      "plm watchdog: rank 3 on .*: step 9, in gradient all-reduce \\(finish\\): remote peer gone");
  plm::dist::removeHealthCheck(broken);
  plm::dist::removeHealthCheck(healthy);
  EXPECT_EQ(plm::dist::pollHealth(), "");
}

TEST(Watchdog, TheAutomaticLimitFollowsTheMedianStep) {
  plm::train::WatchdogOptions options;
  options.warm_up_steps = 3;
  options.minimum_timeout = 1;
  options.warm_up_timeout = 50;
  plm::train::Watchdog dog(options, 0);
  EXPECT_EQ(dog.stepLimit(), 50);  // warm-up
  for (double s : {0.1, 0.2, 0.3}) {
    dog.arm(1, "step");
    dog.disarm(s);
  }
  EXPECT_DOUBLE_EQ(dog.stepLimit(), 4.0);  // 20 x median 0.2
  dog.arm(4, "checkpoint save", true);
  dog.disarm(100);  // a save's time does not enter the median
  EXPECT_DOUBLE_EQ(dog.stepLimit(), 4.0);
  options.fixed_timeout = 7;
  plm::train::Watchdog fixed(options, 0);
  EXPECT_EQ(fixed.stepLimit(), 7);
}

TEST(LossSpikes, AJumpAboveTheRecentLossesIsFlaggedAndNoiseIsNot) {
  plm::train::LossSpikeDetector d(100, 20, 6.0);
  for (int i = 0; i < 50; ++i) EXPECT_FALSE(d.add(2.0 + 0.01 * ((i * 7) % 5))) << i;
  EXPECT_TRUE(d.add(3.0));
  EXPECT_FALSE(d.add(2.02));
  EXPECT_FALSE(d.add(std::nan("")));
}

}  // namespace
