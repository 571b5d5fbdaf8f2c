// model.init_from (ckpt/init_from.hpp): a run started from another model's weights.  A 2-step
// tiny run writes model.h5 and is exported with `plm convert --to-hf`; a new run initialised
// from the plm file, the Hugging Face folder or the run's checkpoint directory holds exactly the
// source's weights at step 0 and its validation loss is `plm eval --model`'s of the source; at 2
// ranks the same holds with parallel.shard_degree 2 (FSDP shards) and with expert parallelism.
// Refusals name the tensor and both shapes; a partial load lists what was not loaded.
#include "tiny_run.hpp"

#include "ckpt/init_from.hpp"
#include "core/error.hpp"
#include "dist/process_groups.hpp"
#include "io/hdf5.hpp"
#include "io/hdf5_group.hpp"
#include "io/safetensors.hpp"
#include "model/hf_esm.hpp"
#include "model/model_file.hpp"
#include "train/step.hpp"

#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <string>
#include <vector>

namespace {

using plm::test::tinyDeck;

int worldSize() {
  int w = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &w);
  return w;
}

// Every tensor of a plm model file, by name (each rank reads the whole file alone).
std::map<std::string, std::vector<float>> readTensors(const std::string& path) {
  std::map<std::string, std::vector<float>> out;
  auto file = plm::io::h5::openFileSerial(path);
  plm::io::h5::Hid group(H5Gopen2(file, "model", H5P_DEFAULT));
  for (const auto& name : plm::io::h5::groupMembers(group)) {
    auto dataset = plm::io::h5::openDataset(group, name);
    const auto shape = plm::io::h5::datasetShape(dataset);
    std::int64_t n = 1;
    for (auto d : shape) n *= d;
    std::vector<float> v(std::size_t(n), 0.0f);
    plm::io::h5::readRows<float>(dataset, 0, shape.empty() ? 1 : shape[0], v.data(), true);
    out[name] = std::move(v);
  }
  return out;
}

// The trainer's fp32 master weights by tensor name (the tensors this rank holds), gathered
// from the shards in a sharded run (collective).
std::map<std::string, std::vector<float>> masters(plm::train::Trainer& t) {
  auto host = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), t.optimizer().master());
  std::map<std::string, std::vector<float>> out;
  for (const auto& info : t.model().tensors())
    out[info.name] =
        std::vector<float>(host.data() + info.offset, host.data() + info.offset + info.size);
  t.discardFullState();
  return out;
}

// `plm eval --model source` on the deck's validation set: a model loaded from the file.
plm::train::BatchStats evalSource(const Teuchos::ParameterList& deck, const std::string& source,
                                  MPI_Comm comm) {
  const int rank = plm::test::commRank(comm), world = plm::dist::commSize(comm);
  plm::model::Esm2<plm::param_t> model(plm::model::readModelConfig(source));
  plm::model::readModelInto(source, comm, model);
  const std::string valid = deck.sublist("data").get<std::string>("valid");
  plm::data::Loader loader(plm::train::evalLoaderOptions(deck, valid, rank, world));
  return plm::train::evaluate(plm::ExecSpace(), model, loader,
                              plm::train::evalMaxSteps(deck, world), comm);
}

std::string errorOf(const std::function<void()>& f) {
  try {
    f();
  } catch (const plm::Error& e) {
    EXPECT_TRUE(e.collective()) << e.what();
    return e.what();
  }
  return "(no error)";
}

struct Source {
  std::string dir, model, hf, ckpt;
};

// A 2-step tiny run (checkpoint at step 2) and its Hugging Face export, in `dir`.
Source makeSource(const std::string& dir, const std::vector<std::string>& extra = {}) {
  Source s;
  s.dir = dir;
  s.model = dir + "/source/model.h5";
  s.hf = dir + "/source_hf";
  s.ckpt = dir + "/source/ckpt";
  std::vector<std::string> overrides = {"train.steps=2", "checkpoint.every=2"};
  overrides.insert(overrides.end(), extra.begin(), extra.end());
  plm::test::trainRecords(tinyDeck(dir, "source", overrides), MPI_COMM_WORLD);
  plm::model::hf::convertToHf(s.model, s.hf, MPI_COMM_WORLD);
  MPI_Barrier(MPI_COMM_WORLD);
  return s;
}

void expectExactly(const std::map<std::string, std::vector<float>>& got,
                   const std::map<std::string, std::vector<float>>& want, const std::string& what) {
  for (const auto& [name, values] : got) {
    ASSERT_TRUE(want.count(name)) << what << ": " << name;
    EXPECT_EQ(values, want.at(name)) << what << ": " << name;
  }
}

TEST(InitFrom, PlmFileHfFolderAndCheckpointGiveTheSourceWeights) {
  const std::string dir = plm::test::sharedTempDir(MPI_COMM_WORLD, "init");
  plm::test::writeTinyDataset(dir + "/train.h5", 64, 9, MPI_COMM_WORLD);
  const Source s = makeSource(dir);
  const auto want = readTensors(s.model);
  std::vector<std::string> layouts = {"parallel.shard_degree=1"};
  if (worldSize() == 2) layouts.push_back("parallel.shard_degree=2");
  for (const auto& layout : layouts) {
    for (const std::string& from : {s.model, s.hf, s.ckpt, s.hf + "/model.safetensors"}) {
      const std::string what = layout + ", init_from " + from;
      auto deck = tinyDeck(dir, "b",
                           {layout, "model.init_from=" + from, "data.valid=" + dir + "/train.h5"});
      plm::train::Trainer t(deck, MPI_COMM_WORLD);
      const auto fresh = masters(t);
      EXPECT_NE(fresh.at("esm.embeddings.word_embeddings.weight"),
                want.at("esm.embeddings.word_embeddings.weight"));
      const auto report = plm::ckpt::initFrom(t, from);
      EXPECT_TRUE(report.not_loaded.empty()) << what;
      EXPECT_EQ(report.tensors_loaded, std::int64_t(want.size())) << what;
      expectExactly(masters(t), want, what);
      // Its first evaluation is the source model's, as `plm eval --model` computes it.
      const auto mine = t.validate();
      const auto theirs = evalSource(*deck, s.model, MPI_COMM_WORLD);
      EXPECT_GT(mine.masked, 0);
      EXPECT_EQ(mine.masked, theirs.masked) << what;
      EXPECT_EQ(mine.loss_sum, theirs.loss_sum) << what;
    }
  }
  // Through the checkpoint hooks: the first step starts from the source (its loss is the same
  // whichever file it came from), and a resumed run ignores init_from.
  auto first = [&](const std::string& run, const std::string& from) {
    return plm::test::trainRecords(
        tinyDeck(dir, run, {"train.steps=1", "checkpoint.every=1", "model.init_from=" + from}),
        MPI_COMM_WORLD);
  };
  const auto a = first("hooks_h5", s.model), b = first("hooks_hf", s.hf);
  const auto fresh = plm::test::trainRecords(
      tinyDeck(dir, "hooks_fresh", {"train.steps=1", "checkpoint.every=0"}), MPI_COMM_WORLD);
  ASSERT_EQ(a.size(), 1u);
  ASSERT_EQ(b.size(), 1u);
  EXPECT_EQ(a[0].loss, b[0].loss);
  EXPECT_NE(a[0].loss, fresh[0].loss);
  // Continuing hooks_h5 from its step-1 checkpoint: init_from would move the weights back.
  const auto resumed = plm::test::trainRecords(
      tinyDeck(dir, "hooks_h5", {"train.steps=2", "checkpoint.every=1", "model.init_from=" + s.hf}),
      MPI_COMM_WORLD);
  const auto straight = plm::test::trainRecords(
      tinyDeck(dir, "hooks_straight",
               {"train.steps=2", "checkpoint.every=0", "model.init_from=" + s.model}),
      MPI_COMM_WORLD);
  ASSERT_EQ(resumed.size(), 1u);
  ASSERT_EQ(straight.size(), 2u);
  EXPECT_EQ(resumed[0].step, 2);
  EXPECT_NEAR(resumed[0].loss, straight[1].loss, 1e-6 * std::abs(straight[1].loss));
  plm::test::removeSharedDir(MPI_COMM_WORLD, dir);
}

TEST(InitFrom, MismatchesAreRefusedNamingTheTensor) {
  const std::string dir = plm::test::sharedTempDir(MPI_COMM_WORLD, "init_refuse");
  plm::test::writeTinyDataset(dir + "/train.h5", 64, 9, MPI_COMM_WORLD);
  const Source s = makeSource(dir);
  auto refusal = [&](const std::vector<std::string>& overrides, const std::string& from) {
    plm::train::Trainer t(tinyDeck(dir, "r", overrides), MPI_COMM_WORLD);
    return errorOf([&] { plm::ckpt::initFrom(t, from); });
  };
  // Another width: the first tensor in model order, with both shapes.
  std::string e = refusal({"model.hidden=48", "model.ffn=96"}, s.model);
  EXPECT_NE(e.find("tensor \"esm.embeddings.word_embeddings.weight\" is (33, 32) in the source "
                   "but (33, 48) in the model"),
            std::string::npos)
      << e;
  EXPECT_EQ(e.find('\n'), std::string::npos) << e;
  e = refusal({"model.ffn=128"}, s.hf);
  EXPECT_NE(e.find("\"esm.encoder.layer.0.intermediate.dense.weight\" is (64, 32) in the source "
                   "but (128, 32)"),
            std::string::npos)
      << e;
  // Fewer layers: the source's extra layer is a name the model does not have.
  e = refusal({"model.layers=1"}, s.model);
  EXPECT_NE(e.find("tensor(s) the model does not have: \"esm.encoder.layer.1."), std::string::npos)
      << e;
  // Heads do not show in shapes.
  e = refusal({"model.heads=2"}, s.model);
  EXPECT_NE(e.find("has 4 attention heads, the model 2"), std::string::npos) << e;
  e = refusal({}, dir + "/nothing_here");
  EXPECT_NE(e.find("does not exist"), std::string::npos) << e;
  e = refusal({}, dir + "/train.h5");  // a dataset, not a model
  EXPECT_NE(e.find("not a plm model file"), std::string::npos) << e;
  plm::test::removeSharedDir(MPI_COMM_WORLD, dir);
}

TEST(InitFrom, PartialLoadsAreListed) {
  const std::string dir = plm::test::sharedTempDir(MPI_COMM_WORLD, "init_partial");
  plm::test::writeTinyDataset(dir + "/train.h5", 64, 9, MPI_COMM_WORLD);
  const Source s = makeSource(dir);
  const auto want = readTensors(s.model);
  // An encoder saved as transformers' EsmModel does: no "esm." prefix, no LM head.
  const std::string encoder = dir + "/encoder.safetensors";
  if (plm::test::commRank(MPI_COMM_WORLD) == 0) {
    std::vector<plm::io::safetensors::TensorOut> out;
    for (const auto& [name, values] : want)
      if (name.rfind("esm.", 0) == 0)
        out.push_back(
            {name.substr(4), plm::model::hf::Weights(s.hf).entry(name).shape, values.data()});
    plm::io::safetensors::write(encoder, out);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  // And a deeper model than the source: layer 2 is not in it.
  for (const auto& [from, overrides] :
       std::vector<std::pair<std::string, std::vector<std::string>>>{
           {encoder, {}}, {s.model, {"model.layers=3"}}}) {
    auto deck = tinyDeck(dir, "p", overrides);
    deck->sublist("model").set("init_from", from);
    plm::train::Trainer t(deck, MPI_COMM_WORLD);
    const auto fresh = masters(t);
    testing::internal::CaptureStderr();
    plm::ckpt::applyInitFrom(t);
    const std::string log = testing::internal::GetCapturedStderr();
    const auto got = masters(t);
    std::size_t kept = 0;
    for (const auto& [name, values] : got) {
      if (want.count(name) && (from != encoder || name.rfind("esm.", 0) == 0)) {
        EXPECT_EQ(values, want.at(name)) << from << ": " << name;
      } else {
        EXPECT_EQ(values, fresh.at(name)) << from << ": " << name << " keeps its initialisation";
        ++kept;
        if (plm::test::commRank(MPI_COMM_WORLD) == 0)
          EXPECT_NE(log.find(name), std::string::npos) << from << ": " << name << " not listed";
      }
    }
    EXPECT_GT(kept, 0u);
    if (plm::test::commRank(MPI_COMM_WORLD) == 0)
      EXPECT_NE(log.find("model.init_from: partial load: " + std::to_string(kept) + " tensor(s)"),
                std::string::npos)
          << log;
  }
  plm::test::removeSharedDir(MPI_COMM_WORLD, dir);
}

// Expert parallelism: each rank takes only the experts it holds.
TEST(InitFrom, ExpertParallelRanksTakeTheirExperts) {
  if (worldSize() != 2) GTEST_SKIP() << "expert parallelism over 2 ranks";
  if (plm::test::noCollectivesForDeviceMemory(MPI_COMM_WORLD))
    GTEST_SKIP() << "device memory over plain MPI (PLM_COMM_BACKEND=mpi)";
  const std::string dir = plm::test::sharedTempDir(MPI_COMM_WORLD, "init_moe");
  plm::test::writeTinyDataset(dir + "/train.h5", 64, 9, MPI_COMM_WORLD);
  const std::vector<std::string> moe = {"moe.experts=4", "moe.top_k=2", "moe.expert_ffn=32"};
  auto with = [&](std::vector<std::string> v, const std::vector<std::string>& more) {
    v.insert(v.end(), more.begin(), more.end());
    return v;
  };
  const Source s = makeSource(dir, moe);
  const auto want = readTensors(s.model);
  for (const std::string& from : {s.model, s.hf}) {
    plm::train::Trainer t(tinyDeck(dir, "e", with(moe, {"parallel.expert_degree=2"})),
                          MPI_COMM_WORLD);
    plm::ckpt::initFrom(t, from);
    const auto got = masters(t);
    EXPECT_LT(got.size(), want.size());  // this rank holds 2 of the 4 experts
    expectExactly(got, want, from);
  }
  plm::test::removeSharedDir(MPI_COMM_WORLD, dir);
}

}  // namespace
