// FP8 checkpoints: the scaling state (amax histories and scales, /scaling) is saved and
// restored, so a run of train.precision: fp8 stopped after its step-3 checkpoint and resumed
// ends bitwise where the uninterrupted run ends (weights and scaling state); resuming that
// checkpoint under another recipe is refused with a message naming the key.
#include "../ckpt/tiny_run.hpp"

#include "dist/runtime.hpp"
#include "io/hdf5.hpp"
#include "model/fp8_scaling.hpp"

#include <gtest/gtest.h>

#include <cstring>

namespace {

using plm::test::Interrupted;
using plm::test::tinyDeck;

std::vector<float> masterWeights(plm::train::Trainer& t) {
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), t.optimizer().master());
  return std::vector<float>(h.data(), h.data() + h.extent(0));
}

const std::vector<std::string> fp8 = {"train.precision=fp8", "fp8.amax_history=4"};

std::vector<std::string> with(std::vector<std::string> a, const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

class Fp8Resume : public ::testing::Test {
 protected:
  void SetUp() override {
    if (PLM_HAVE_CUDA && !PLM_FP8_CUDA) GTEST_SKIP() << "no FP8 kernels in this CUDA build";
    dir = plm::test::sharedTempDir(MPI_COMM_WORLD, "fp8resume");
    plm::test::writeTinyDataset(dir + "/train.h5", 64, 5, MPI_COMM_WORLD);
  }
  void TearDown() override { plm::test::removeSharedDir(MPI_COMM_WORLD, dir); }
  std::string dir;
};

TEST_F(Fp8Resume, KilledRunContinuesBitIdentically) {
  std::vector<float> weights_a, hist_a, scales_a;
  {
    plm::train::Trainer a(tinyDeck(dir, "a", with(fp8, {"checkpoint.every=0"})));
    plm::ckpt::installHooks(a);
    a.run();
    weights_a = masterWeights(a);
    hist_a = a.model().fp8Scaling()->histories();
    scales_a = a.model().fp8Scaling()->scales();
  }
  {
    plm::train::Trainer b(tinyDeck(dir, "b", fp8));
    plm::train::Trainer::Hooks extra;
    extra.on_step = [](plm::train::Trainer& t, const plm::train::StepStats&) {
      if (t.state().step == 5) throw Interrupted{};
    };
    plm::ckpt::installHooks(b, extra);
    EXPECT_THROW(b.run(), Interrupted);
  }
  // The checkpoint's /scaling group holds the state of step 3: scales set by 3 steps.
  const auto listed = plm::ckpt::listCheckpoints(dir + "/b/ckpt");
  ASSERT_EQ(listed.size(), 1u);
  ASSERT_EQ(listed[0].step, 3);
  if (plm::dist::worldRank() == 0) {
    namespace h5 = plm::io::h5;
    h5::Hid file = h5::openFileSerial(listed[0].path);
    h5::Hid g(H5Gopen2(file, "scaling", H5P_DEFAULT));
    EXPECT_EQ(h5::readStringAttribute(g, "recipe"), "delayed");
    EXPECT_EQ(h5::readIntAttribute(g, "steps"), 3);
    h5::Hid scale = h5::openDataset(g, "scale");
    const auto shape = h5::datasetShape(scale);
    ASSERT_EQ(shape.size(), 1u);
    EXPECT_EQ(shape[0], 2 * 4 * 3);
    std::vector<float> s(shape[0]);
    h5::readRows<float>(scale, 0, shape[0], s.data(), true);
    int set = 0;
    for (float v : s) set += v != 1.0f;
    EXPECT_EQ(set, 2 * 4 * 3) << "every operand's scale was set by the first steps";
  }
  plm::train::Trainer c(tinyDeck(dir, "b", fp8));
  plm::ckpt::installHooks(c);
  c.run();
  const auto weights_c = masterWeights(c);
  ASSERT_EQ(weights_c.size(), weights_a.size());
  EXPECT_EQ(std::memcmp(weights_c.data(), weights_a.data(), weights_a.size() * sizeof(float)), 0)
      << "final weights differ from the uninterrupted FP8 run";
  EXPECT_EQ(c.model().fp8Scaling()->histories(), hist_a);
  EXPECT_EQ(c.model().fp8Scaling()->scales(), scales_a);
  EXPECT_EQ(c.model().fp8Scaling()->steps(), 6);
  if (plm::dist::worldRank() == 0) {
    const auto want = plm::test::metricsLosses(dir + "/a/metrics.jsonl");
    const auto got = plm::test::metricsLosses(dir + "/b/metrics.jsonl");
    EXPECT_EQ(got, want);
  }
}

TEST_F(Fp8Resume, AnotherRecipeIsRefused) {
  {
    plm::train::Trainer b(tinyDeck(dir, "b", with(fp8, {"train.steps=3"})));
    plm::ckpt::installHooks(b);
    b.run();
  }
  std::string message;
  try {
    plm::train::Trainer c(tinyDeck(dir, "b", with(fp8, {"fp8.recipe=block"})));
    plm::ckpt::installHooks(c);
    c.run();
  } catch (const std::exception& e) {
    message = e.what();
  }
  EXPECT_NE(message.find("fp8.recipe was delayed"), std::string::npos) << message;
  EXPECT_NE(message.find("is block now"), std::string::npos) << message;
  // fp32 may resume it (the FP8 state is dropped with a warning).
  plm::train::Trainer d(tinyDeck(dir, "b", {"train.steps=4"}));
  plm::ckpt::installHooks(d);
  EXPECT_NO_THROW(d.run());
  EXPECT_EQ(d.state().step, 4);
}

}  // namespace
