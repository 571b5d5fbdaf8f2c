// Checkpoints of every optimizer (doc/optimizers.md, doc/checkpoints.md):
//  - each kind's state is stored by name under /optimizer with its kind; a fresh trainer loads
//    master, every state buffer and the step count bit for bit; 8-bit AdamW's moments are
//    stored as uint8 codes with fp32 block scales;
//  - resuming with another optimizer is refused with a message naming both, the trainer
//    unchanged;
//  - at 4 ranks: a run of 8-bit AdamW (and of Adafactor) sharded over 2 ranks saves, and 4 ranks
//    sharded 4 ways (and 1 rank) resume it; the continued losses match the uninterrupted run's
//    to 1e-5 (the quantised state is the same whatever the layout).
#include "tiny_run.hpp"

#include "dist/communicator.hpp"
#include "dist/runtime.hpp"
#include "io/hdf5.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <functional>

namespace {

using plm::test::onFirstRanks;
using plm::test::tinyDeck;
using plm::test::trainLosses;
namespace h5 = plm::io::h5;

template <class T> std::vector<T> host(const plm::View1<T>& v) {
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), v);
  return std::vector<T>(h.data(), h.data() + h.extent(0));
}

TEST(OptimizerCheckpoint, EveryKindRoundTripsAndOthersAreRefused) {
  const std::string dir = plm::test::sharedTempDir(MPI_COMM_WORLD, "optim");
  plm::test::writeTinyDataset(dir + "/train.h5", 64, 9, MPI_COMM_WORLD);
  for (const std::string kind : {"adamw", "lion", "adafactor", "adamw8bit"}) {
    plm::train::Trainer t(
        tinyDeck(dir, kind,
                 {"optimizer.name=" + kind, "train.steps=2", "checkpoint.every=0",
                  "optimizer.adafactor_beta1=0.9", "optimizer.adamw8bit_min_8bit_size=1000"}));
    t.run();
    const auto report = plm::ckpt::save(t, dir + "/" + kind + "/ckpt");
    if (plm::dist::worldRank() == 0) {
      h5::Hid file = h5::openFileSerial(report.path);
      h5::Hid o(H5Gopen2(file, "optimizer", H5P_DEFAULT));
      EXPECT_EQ(h5::readStringAttribute(o, "kind"), kind);
      EXPECT_EQ(h5::readIntAttribute(o, "step"), 2);
      for (const auto& b : t.optimizer().state())
        EXPECT_TRUE(h5::exists(file, "optimizer/" + b.name)) << kind << " " << b.name;
      if (kind == "adamw8bit") {
        h5::Hid codes = h5::openDataset(
            file, "optimizer/exp_avg_codes/esm.encoder.layer.0.intermediate.dense.weight");
        h5::Hid type(H5Dget_type(codes));
        EXPECT_EQ(H5Tget_size(type), 1u);  // stored quantised
        EXPECT_EQ(h5::datasetShape(codes), (std::vector<std::int64_t>{64, 32}));
        h5::Hid scales = h5::openDataset(
            file, "optimizer/exp_avg_absmax/esm.encoder.layer.0.intermediate.dense.weight");
        EXPECT_EQ(h5::datasetShape(scales), (std::vector<std::int64_t>{1}));  // 2048 / 2048
        EXPECT_TRUE(
            h5::exists(file, "optimizer/exp_avg_fp32/esm.embeddings.word_embeddings.weight"));
      }
      if (kind == "adafactor")
        EXPECT_EQ(h5::datasetShape(h5::openDataset(
                      file, "optimizer/exp_avg_sq_row/esm.encoder.layer.1.output.dense.weight")),
                  (std::vector<std::int64_t>{32}));
    }
    // A fresh trainer of the same kind takes all of it back.
    plm::train::Trainer u(
        tinyDeck(dir, kind + "_again",
                 {"optimizer.name=" + kind, "checkpoint.resume=none",
                  "optimizer.adafactor_beta1=0.9", "optimizer.adamw8bit_min_8bit_size=1000"}));
    plm::ckpt::load(u, report.path);
    EXPECT_EQ(host(u.optimizer().master()), host(t.optimizer().master())) << kind;
    const auto a = t.optimizer().state(), b = u.optimizer().state();
    ASSERT_EQ(a.size(), b.size());
    for (std::size_t i = 0; i < a.size(); ++i) {
      if (a[i].isBytes())
        EXPECT_EQ(host(a[i].u8), host(b[i].u8)) << kind << " " << a[i].name;
      else
        EXPECT_EQ(host(a[i].f32), host(b[i].f32)) << kind << " " << a[i].name;
    }
    EXPECT_EQ(u.optimizer().stepCount(), 2);

    // Another optimizer is refused, naming both, and the trainer stays as it was.
    const std::string other = kind == "lion" ? "adamw8bit" : "lion";
    plm::train::Trainer w(
        tinyDeck(dir, kind + "_other", {"optimizer.name=" + other, "checkpoint.resume=none"}));
    const auto before = host(w.optimizer().master());
    try {
      plm::ckpt::load(w, report.path);
      ADD_FAILURE() << kind << " state loaded into " << other;
    } catch (const plm::Error& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find("optimizer.name: the checkpoint holds " + kind +
                       " state, this run asks for " + other),
                std::string::npos)
          << m;
    }
    EXPECT_EQ(host(w.optimizer().master()), before);
  }
  plm::test::removeSharedDir(MPI_COMM_WORLD, dir);
}

TEST(OptimizerCheckpoint, ShardedStateResumesOnOtherRankCounts) {
  if (plm::dist::worldSize() != 4) GTEST_SKIP() << "runs at 4 ranks";
  if (!Kokkos::SpaceAccessibility<Kokkos::HostSpace, plm::MemSpace>::accessible &&
      plm::dist::defaultBackend(MPI_COMM_WORLD) == plm::dist::Backend::Mpi)
    GTEST_SKIP() << "device memory over plain MPI (PLM_COMM_BACKEND=mpi)";
  const std::string dir = plm::test::sharedTempDir(MPI_COMM_WORLD, "optim_ranks");
  plm::test::writeTinyDataset(dir + "/train.h5", 64, 9, MPI_COMM_WORLD);
  for (const std::string kind : {"adamw8bit", "adafactor"}) {
    const std::vector<std::string> common = {"optimizer.name=" + kind,
                                             "optimizer.adamw8bit_min_8bit_size=1000",
                                             "optimizer.adamw8bit_block_size=256"};
    auto with = [&](std::vector<std::string> more) {
      more.insert(more.end(), common.begin(), common.end());
      return more;
    };
    const auto reference =
        trainLosses(tinyDeck(dir, kind + "_ref", with({"checkpoint.every=0"})), MPI_COMM_WORLD);
    ASSERT_EQ(reference.size(), 6u);
    for (auto [n, m] : {std::pair{2, 4}, std::pair{4, 1}}) {
      const std::string run = kind + "_n" + std::to_string(n) + "m" + std::to_string(m);
      onFirstRanks(n, [&](MPI_Comm comm) {
        trainLosses(tinyDeck(dir, run,
                             with({"train.steps=3", "parallel.shard_degree=" + std::to_string(n)})),
                    comm);
      });
      std::vector<double> resumed;
      onFirstRanks(m, [&](MPI_Comm comm) {
        resumed = trainLosses(
            tinyDeck(dir, run, with({"parallel.shard_degree=" + std::to_string(m)})), comm);
      });
      if (plm::dist::worldRank() >= m) continue;
      ASSERT_EQ(resumed.size(), 3u) << run;
      for (int s = 0; s < 3; ++s)
        EXPECT_NEAR(resumed[s], reference[3 + s], 1e-5 * reference[3 + s])
            << run << " step " << 4 + s;
    }
  }
  plm::test::removeSharedDir(MPI_COMM_WORLD, dir);
}

}  // namespace
