// Resume on a different rank count, inside one 4-rank job: the first N ranks (a sub-communicator)
// train 3 steps and checkpoint, then the first M ranks resume it for 3 more, for (N, M) in
// (2, 1), (1, 4), (4, 2).  Each continued run must see exactly the uninterrupted run's data
// (per-step token and masked-token counts equal, the cursor equal) and reach its losses to
// reduction-order rounding (1e-5 relative; the reference runs on all 4 ranks).
#include "tiny_run.hpp"

#include "dist/runtime.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <functional>

namespace {

using plm::test::onFirstRanks;
using plm::test::tinyDeck;
using plm::test::trainRecords;
using Record = plm::test::StepRecord;

TEST(RankChange, ResumesOnAnyRankCount) {
  ASSERT_EQ(plm::dist::worldSize(), 4) << "this test runs at 4 ranks";
  const std::string dir = plm::test::sharedTempDir(MPI_COMM_WORLD, "ranks");
  plm::test::writeTinyDataset(dir + "/train.h5", 64, 9, MPI_COMM_WORLD);
  plm::data::Cursor reference_cursor;
  const auto reference = trainRecords(tinyDeck(dir, "reference", {"checkpoint.every=0"}),
                                      MPI_COMM_WORLD, &reference_cursor);
  ASSERT_EQ(reference.size(), 6u);

  for (auto [n, m] : {std::pair{2, 1}, std::pair{1, 4}, std::pair{4, 2}}) {
    const std::string run = "n" + std::to_string(n) + "m" + std::to_string(m);
    std::vector<Record> got;
    plm::data::Cursor cursor;
    onFirstRanks(
        n, [&](MPI_Comm comm) { got = trainRecords(tinyDeck(dir, run, {"train.steps=3"}), comm); });
    const auto listed = plm::ckpt::listCheckpoints(dir + "/" + run + "/ckpt");
    ASSERT_EQ(listed.size(), 1u) << run;
    onFirstRanks(m, [&](MPI_Comm comm) {
      auto more = trainRecords(tinyDeck(dir, run, {"train.steps=6"}), comm, &cursor);
      got.insert(got.end(), more.begin(), more.end());
    });
    if (plm::dist::worldRank() != 0) continue;  // rank 0 took part in every run
    ASSERT_EQ(got.size(), reference.size()) << run;
    for (std::size_t i = 0; i < got.size(); ++i) {
      EXPECT_EQ(got[i].step, reference[i].step) << run;
      EXPECT_EQ(got[i].tokens, reference[i].tokens)
          << run << " step " << got[i].step << ": another batch";
      EXPECT_EQ(got[i].masked, reference[i].masked)
          << run << " step " << got[i].step << ": other masks";
      EXPECT_LE(std::abs(got[i].loss - reference[i].loss), 1e-5 * std::abs(reference[i].loss))
          << run << " step " << got[i].step << ": " << got[i].loss << " vs " << reference[i].loss;
    }
    EXPECT_EQ(cursor, reference_cursor) << run;
  }
  plm::test::removeSharedDir(MPI_COMM_WORLD, dir);
}

}  // namespace
