// Sharded checkpoints without a full-layout copy (doc/parallelism.md, "Checkpoints"):
//  - detail::redistribute moves tensor elements between a slice layout and the checkpoint's row
//    layout and back, for fp32, fp64 and 8-bit values, in one batch and in many (any rank count);
//    layouts that overlap are refused;
//  - a sharded run's file written by the shards path equals, dataset for dataset and bit for
//    bit (crc32 attributes included), the file the full-layout path writes from the same state,
//    for every optimizer kind, at shard = ranks and at 2 shard x 2 replicate; so do
//    asynchronous saves (checkpoint.async);
//  - the shards path's memory peak during a save stays below this rank's rows of the state plus
//    one group's staging, derived below, while the full-layout path allocates 12 N or more;
//  - a sharded checkpoint resumes on the same layout bit for bit (losses and weights) and on
//    other layouts to reduction-order rounding.
// Sharded training needs two ranks at least: at one rank only the redistribute tests run.
#include "tiny_run.hpp"

#include "ckpt/detail/redistribute.hpp"
#include "ckpt/detail/rows.hpp"
#include "ckpt/detail/snapshot.hpp"
#include "core/error.hpp"
#include "dist/runtime.hpp"
#include "io/hdf5.hpp"
#include "train/fsdp.hpp"
#include "train/memory_tracker.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>

namespace {

using plm::test::onFirstRanks;
using plm::test::tinyDeck;
namespace ckd = plm::ckpt::detail;
namespace h5 = plm::io::h5;

// Tensors chosen to reach every case of the row split: more rows than ranks, fewer rows than
// ranks (some ranks own none), a single row, a 3-d tensor, a column vector.
std::vector<plm::model::TensorInfo> testTensors() {
  std::vector<plm::model::TensorInfo> out;
  std::int64_t offset = 0;
  for (const auto& shape :
       std::vector<std::vector<std::int64_t>>{{5, 3}, {7}, {1, 4}, {2, 2, 3}, {13, 1}, {3, 11}}) {
    plm::model::TensorInfo t;
    t.name = "t" + std::to_string(out.size());
    t.shape = shape;
    t.size = 1;
    for (auto d : shape) t.size *= d;
    t.offset = offset;
    offset += t.size;
    out.push_back(t);
  }
  return out;
}

// Rank r's slice [r * n / world, (r + 1) * n / world) of the flat buffer, as segments.
std::vector<ckd::Segment> sliceSegments(const std::vector<plm::model::TensorInfo>& tensors,
                                        int rank, int world) {
  std::int64_t n = 0;
  for (const auto& t : tensors) n += t.size;
  const std::int64_t begin = n * rank / world, end = n * (rank + 1) / world;
  std::vector<ckd::Segment> out;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const auto& t = tensors[i];
    const std::int64_t a = std::max(begin, t.offset), b = std::min(end, t.offset + t.size);
    if (a < b) out.push_back({std::int64_t(i), a - t.offset, b - a, a - begin});
  }
  return out;
}

template <class T> T valueOf(std::int64_t tensor, std::int64_t element) {
  return static_cast<T>((tensor * 37 + element * 11) % 251);
}

template <class T> void roundTrip(std::int64_t batch_limit) {
  const int rank = plm::dist::worldRank(), world = plm::dist::worldSize();
  const auto tensors = testTensors();
  std::vector<std::int64_t> sizes;
  for (const auto& t : tensors) sizes.push_back(t.size);
  const auto slices = sliceSegments(tensors, rank, world);
  std::vector<T> shard;
  for (const auto& s : slices)
    for (std::int64_t i = 0; i < s.count; ++i) shard.push_back(valueOf<T>(s.tensor, s.start + i));
  const ckd::RowsLayout rows = ckd::compactRows(tensors, rank, world);
  std::vector<T> compact(std::size_t(rows.size), T(255));
  ckd::redistribute(MPI_COMM_WORLD, sizes, slices, shard.data(), ckd::rowSegments(rows),
                    compact.data(), batch_limit);
  for (std::size_t t = 0; t < tensors.size(); ++t)
    for (std::int64_t i = 0; i < rows.count(t); ++i)
      ASSERT_EQ(compact[std::size_t(rows.at[t] + i)], valueOf<T>(t, rows.start(t) + i))
          << "tensor " << t << " element " << rows.start(t) + i << " batch " << batch_limit;
  std::vector<T> back(shard.size(), T(255));
  ckd::redistribute(MPI_COMM_WORLD, sizes, ckd::rowSegments(rows), compact.data(), slices,
                    back.data(), batch_limit);
  EXPECT_EQ(back, shard) << "batch " << batch_limit;
}

TEST(Redistribute, SlicesToRowsAndBackForEveryType) {
  for (std::int64_t batch : {std::int64_t(1) << 27, std::int64_t(8), std::int64_t(1)}) {
    roundTrip<float>(batch);
    roundTrip<double>(batch);
    roundTrip<std::uint8_t>(batch);
  }
}

TEST(Redistribute, OverlappingSourcesAreRefused) {
  if (plm::dist::worldSize() == 1) GTEST_SKIP() << "one rank cannot overlap another";
  const auto tensors = testTensors();
  std::vector<std::int64_t> sizes;
  std::vector<ckd::Segment> everything;
  std::vector<float> values;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    sizes.push_back(tensors[i].size);
    everything.push_back({std::int64_t(i), 0, tensors[i].size, tensors[i].offset});
    values.resize(std::size_t(tensors[i].offset + tensors[i].size));
  }
  const auto rows = ckd::compactRows(tensors, plm::dist::worldRank(), plm::dist::worldSize());
  std::vector<float> out(std::size_t(rows.size));
  try {  // every rank claims every element: each receives its rows once per rank
    ckd::redistribute(MPI_COMM_WORLD, sizes, everything, values.data(), ckd::rowSegments(rows),
                      out.data());
    if (rows.size > 0) ADD_FAILURE() << "overlapping layouts were accepted";
  } catch (const plm::Error& e) {
    EXPECT_NE(std::string(e.what()).find("overlap or leave gaps"), std::string::npos) << e.what();
  }
}

// Every dataset of /model and /optimizer/* in `a` and `b`: same shape, same bytes, same crc32.
void expectSameTensors(const std::string& a, const std::string& b, const std::string& what) {
  h5::Hid fa = h5::openFileSerial(a), fb = h5::openFileSerial(b);
  std::vector<std::string> groups = {"model"};
  {
    h5::Hid o(H5Gopen2(fa, "optimizer", H5P_DEFAULT));
    std::string names = h5::readStringAttribute(o, "state");
    for (std::size_t at = 0; at <= names.size();) {
      const std::size_t end = std::min(names.find(',', at), names.size());
      groups.push_back("optimizer/" + names.substr(at, end - at));
      at = end + 1;
    }
  }
  std::int64_t datasets = 0, nonzero = 0;
  for (const auto& g : groups) {
    h5::Hid ga(H5Gopen2(fa, g.c_str(), H5P_DEFAULT));
    ASSERT_GE(ga.get(), 0) << what << ": " << g;
    H5G_info_t info;
    H5Gget_info(ga, &info);
    for (hsize_t i = 0; i < info.nlinks; ++i) {
      char name[512];
      H5Lget_name_by_idx(ga, ".", H5_INDEX_NAME, H5_ITER_INC, i, name, sizeof name, H5P_DEFAULT);
      const std::string path = g + "/" + name;
      h5::Hid da = h5::openDataset(fa, path), db = h5::openDataset(fb, path);
      ASSERT_EQ(h5::datasetShape(da), h5::datasetShape(db)) << what << ": " << path;
      h5::Hid type(H5Dget_type(da));
      const std::size_t element = H5Tget_size(type);
      std::int64_t n = 1;
      for (auto d : h5::datasetShape(da)) n *= d;
      std::vector<unsigned char> va(std::size_t(n) * element), vb(va.size(), 0xab);
      h5::Hid native(H5Tget_native_type(type, H5T_DIR_ASCEND));
      H5Dread(da, native, H5S_ALL, H5S_ALL, H5P_DEFAULT, va.data());
      H5Dread(db, native, H5S_ALL, H5S_ALL, H5P_DEFAULT, vb.data());
      EXPECT_TRUE(va == vb) << what << ": " << path << " differs";
      EXPECT_EQ(h5::readIntAttribute(da, "crc32"), h5::readIntAttribute(db, "crc32"))
          << what << ": " << path;
      for (auto c : va) nonzero += c != 0;
      ++datasets;
    }
  }
  EXPECT_GT(datasets, 20) << what;
  EXPECT_GT(nonzero, 0) << what << ": all zero, nothing was compared";
}

std::vector<std::string> kindOverrides(const std::string& kind) {
  return {"optimizer.name=" + kind, "optimizer.adafactor_beta1=0.9",
          "optimizer.adamw8bit_min_8bit_size=1000", "checkpoint.every=0"};
}

struct ShardLayout {
  int shard, replicate;
  std::string name() const { return "s" + std::to_string(shard) + "r" + std::to_string(replicate); }
};

std::vector<ShardLayout> shardedLayouts() {
  const int world = plm::dist::worldSize();
  std::vector<ShardLayout> out = {{world, 1}};
  if (world == 4) out.push_back({2, 2});
  return out;
}

TEST(ShardedSave, FileEqualsTheFullLayoutPathsBitForBit) {
  const int world = plm::dist::worldSize();
  if (world == 1) GTEST_SKIP() << "sharding needs two ranks at least";
  if (plm::test::noCollectivesForDeviceMemory(MPI_COMM_WORLD))
    GTEST_SKIP() << "ranks share a GPU: no NCCL, and MPI cannot take device memory";
  const std::string dir = plm::test::sharedTempDir(MPI_COMM_WORLD, "sharded_save");
  plm::test::writeTinyDataset(dir + "/train.h5", 64, 9, MPI_COMM_WORLD);
  for (const ShardLayout layout : shardedLayouts())
    for (const std::string kind : {"adamw", "lion", "adafactor", "adamw8bit"}) {
      const std::string run = kind + "_" + layout.name();
      auto overrides = kindOverrides(kind);
      overrides.push_back("train.steps=2");
      overrides.push_back("parallel.shard_degree=" + std::to_string(layout.shard));
      overrides.push_back("parallel.replicate_degree=" + std::to_string(layout.replicate));
      plm::train::Trainer t(tinyDeck(dir, run, overrides), MPI_COMM_WORLD);
      t.run();
      ASSERT_NE(t.sharding(), nullptr) << run;
      ASSERT_EQ(ckd::statePath(t), ckd::StatePath::Shards) << run;
      const auto shards = ckd::writeSnapshot(ckd::takeSnapshot(t, nullptr, ckd::StatePath::Shards),
                                             dir + "/" + run + "/shards", t.comm());
      const auto full =
          ckd::writeSnapshot(ckd::takeSnapshot(t, nullptr, ckd::StatePath::FullLayout),
                             dir + "/" + run + "/full", t.comm());
      t.discardFullState();
      if (plm::dist::worldRank() == 0) expectSameTensors(shards.path, full.path, run);
    }
  plm::test::removeSharedDir(MPI_COMM_WORLD, dir);
}

// checkpoint.async: the background saver snapshots the shards path's rows between steps and
// writes the same files as synchronous saves (MPI without MPI_THREAD_MULTIPLE saves
// synchronously, and the files are then trivially the same: the test still runs the path).
TEST(ShardedSave, AsynchronousSavesWriteTheSameFiles) {
  const int world = plm::dist::worldSize();
  if (world == 1) GTEST_SKIP() << "sharding needs two ranks at least";
  if (plm::test::noCollectivesForDeviceMemory(MPI_COMM_WORLD))
    GTEST_SKIP() << "ranks share a GPU: no NCCL, and MPI cannot take device memory";
  const std::string dir = plm::test::sharedTempDir(MPI_COMM_WORLD, "sharded_async");
  plm::test::writeTinyDataset(dir + "/train.h5", 64, 9, MPI_COMM_WORLD);
  for (const std::string mode : {"false", "true"}) {
    plm::train::Trainer t(
        tinyDeck(dir, "async_" + mode,
                 {"parallel.shard_degree=" + std::to_string(world), "checkpoint.async=" + mode}),
        MPI_COMM_WORLD);
    plm::ckpt::installHooks(t);
    t.run();
  }
  if (plm::dist::worldRank() == 0)
    for (const std::string step : {"step_000003.h5", "step_000006.h5"})
      expectSameTensors(dir + "/async_false/ckpt/" + step, dir + "/async_true/ckpt/" + step,
                        "async " + step);
  plm::test::removeSharedDir(MPI_COMM_WORLD, dir);
}

// The bound: the snapshot holds this rank's rows of master, exp_avg and exp_avg_sq (4 bytes
// each: 12 R bytes, R = compactRows(...).size, about N / ranks), and one redistribute batch
// stages at most this rank's shard of a group (send, L elements) and its rows of it (receive):
// 4 (L + R) bytes.  Nothing else is allocated; the full-layout path allocates the whole
// optimizer (master, both moments and the flags: 13 N bytes) on every rank.
TEST(ShardedSave, PeakMemoryIsThisRanksRowsNotTheFullLayout) {
  const int world = plm::dist::worldSize(), rank = plm::dist::worldRank();
  if (world == 1) GTEST_SKIP() << "sharding needs two ranks at least";
  if (plm::test::noCollectivesForDeviceMemory(MPI_COMM_WORLD))
    GTEST_SKIP() << "ranks share a GPU: no NCCL, and MPI cannot take device memory";
  const std::string dir = plm::test::sharedTempDir(MPI_COMM_WORLD, "sharded_memory");
  plm::test::writeTinyDataset(dir + "/train.h5", 64, 9, MPI_COMM_WORLD);
  for (const ShardLayout layout : shardedLayouts()) {
    auto overrides = kindOverrides("adamw");
    overrides.push_back("train.steps=1");
    overrides.push_back("parallel.shard_degree=" + std::to_string(layout.shard));
    overrides.push_back("parallel.replicate_degree=" + std::to_string(layout.replicate));
    plm::train::Trainer t(tinyDeck(dir, layout.name(), overrides), MPI_COMM_WORLD);
    t.run();  // the trainer counts its first step, then stops the tracker: count from here
    if (!plm::train::AllocationTracker::start()) GTEST_SKIP() << "a Kokkos tool owns the callbacks";
    const auto& tensors = t.model().tensors();
    std::int64_t n = 0;
    for (const auto& x : tensors) n += x.size;
    const std::int64_t rows = ckd::compactRows(tensors, rank, world).size;
    const std::int64_t local = t.sharding()->optimizer().master().extent(0);
    const std::int64_t bound = 4 * (3 * rows) + 4 * (local + rows);

    const std::int64_t base = plm::train::AllocationTracker::inUse();
    plm::train::AllocationTracker::resetPeak();
    plm::ckpt::save(t, dir + "/" + layout.name() + "/shards");
    const std::int64_t sharded = plm::train::AllocationTracker::peak() - base;
    EXPECT_EQ(plm::train::AllocationTracker::inUse(), base) << "the save left memory behind";

    plm::train::AllocationTracker::resetPeak();
    {
      const auto snap = ckd::takeSnapshot(t, nullptr, ckd::StatePath::FullLayout);
      ckd::writeSnapshot(snap, dir + "/" + layout.name() + "/full", t.comm());
    }
    t.discardFullState();
    const std::int64_t full = plm::train::AllocationTracker::peak() - base;

    EXPECT_GT(sharded, 4 * 3 * rows * 9 / 10) << layout.name() << ": the rows were not counted";
    EXPECT_LE(sharded, bound) << layout.name() << " rank " << rank;
    EXPECT_LT(sharded, 12 * n) << layout.name() << ": as large as the full-layout state";
    EXPECT_GE(full, 12 * n) << layout.name() << ": the full-layout path was not measured";
    std::printf(
        "[ memory ] %s rank %d: N = %lld parameters; save peak above training: shards path %lld "
        "bytes (bound %lld, %.2f N), full-layout path %lld bytes (%.2f N)\n",
        layout.name().c_str(), rank, static_cast<long long>(n), static_cast<long long>(sharded),
        static_cast<long long>(bound), double(sharded) / double(n), static_cast<long long>(full),
        double(full) / double(n));
    plm::train::AllocationTracker::stop();
  }
  plm::test::removeSharedDir(MPI_COMM_WORLD, dir);
}

std::vector<float> fullMaster(plm::train::Trainer& t) {
  auto host = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), t.optimizer().master());
  std::vector<float> out(host.data(), host.data() + host.extent(0));
  t.discardFullState();
  return out;
}

struct RunResult {
  std::map<std::int64_t, double> losses;
  std::vector<float> master;
};

RunResult train(const std::string& dir, const std::string& run, std::vector<std::string> overrides,
                MPI_Comm comm = MPI_COMM_WORLD) {
  RunResult out;
  plm::train::Trainer t(tinyDeck(dir, run, overrides), comm);
  plm::train::Trainer::Hooks extra;
  extra.on_step = [&](plm::train::Trainer& tr, const plm::train::StepStats& s) {
    out.losses[tr.state().step] = s.loss();
  };
  plm::ckpt::installHooks(t, extra);
  t.run();
  out.master = fullMaster(t);
  return out;
}

// A run checkpointed at step 3 continues to step 6 under another layout.  From shard = ranks:
// on its own layout it must equal the uninterrupted run bit for bit (losses and weights), on
// shard 1 (data parallelism) and, at 4 ranks, shard 2 x replicate 2 to 1e-5 relative.  From one
// rank to shard = ranks: the shards path loads a file written without sharding.
TEST(ShardedSave, ResumesExactlyOnItsLayoutAndCloselyOnOthers) {
  const int world = plm::dist::worldSize();
  if (world == 1) GTEST_SKIP() << "sharding needs two ranks at least";
  if (plm::test::noCollectivesForDeviceMemory(MPI_COMM_WORLD))
    GTEST_SKIP() << "ranks share a GPU: no NCCL, and MPI cannot take device memory";
  const std::string dir = plm::test::sharedTempDir(MPI_COMM_WORLD, "sharded_resume");
  plm::test::writeTinyDataset(dir + "/train.h5", 64, 9, MPI_COMM_WORLD);
  const std::string sharded = "parallel.shard_degree=" + std::to_string(world);
  const RunResult reference = train(dir, "reference", {sharded, "checkpoint.every=0"});
  ASSERT_EQ(reference.losses.size(), 6u);
  struct Case {
    int first_ranks;
    std::string first, second;
    bool exact;
  };
  std::vector<Case> cases = {{world, sharded, sharded, true},
                             {world, sharded, "parallel.shard_degree=1", false},
                             {1, "parallel.shard_degree=1", sharded, false}};
  if (world == 4) cases.push_back({world, sharded, "parallel.shard_degree=2", false});
  for (std::size_t k = 0; k < cases.size(); ++k) {
    const Case& c = cases[k];
    const std::string run = "resume" + std::to_string(k);
    const std::string what = std::to_string(c.first_ranks) + " rank(s) " + c.first + " -> " +
                             std::to_string(world) + " ranks " + c.second;
    RunResult first;
    onFirstRanks(c.first_ranks, [&](MPI_Comm comm) {
      first = train(dir, run, {c.first, "train.steps=3"}, comm);
    });
    const RunResult second = train(dir, run, {c.second, "train.steps=6"});
    if (plm::dist::worldRank() != 0) continue;  // rank 0 took part in both runs
    ASSERT_EQ(first.losses.size() + second.losses.size(), 6u) << what;
    for (std::int64_t step = 1; step <= 6; ++step) {
      const double got = step <= 3 ? first.losses.at(step) : second.losses.at(step);
      const double want = reference.losses.at(step);
      if (c.exact)
        EXPECT_EQ(got, want) << what << " step " << step;
      else
        EXPECT_LE(std::abs(got - want), 1e-5 * std::abs(want)) << what << " step " << step;
    }
    ASSERT_EQ(second.master.size(), reference.master.size());
    if (c.exact) {
      EXPECT_TRUE(second.master == reference.master) << what << ": other final weights";
    } else {
      double worst = 0, largest = 0;
      for (std::size_t i = 0; i < reference.master.size(); ++i) {
        worst = std::max(worst, double(std::abs(second.master[i] - reference.master[i])));
        largest = std::max(largest, double(std::abs(reference.master[i])));
      }
      EXPECT_LE(worst, 1e-4 * largest) << what;
    }
  }
  plm::test::removeSharedDir(MPI_COMM_WORLD, dir);
}

}  // namespace
