// `plm train` with parallel.context_degree, end to end on a generated dataset (the real loader,
// deck, model, trainer), at 2 and 4 ranks: with context degree 2 (and 4 at 4 ranks) the
// per-step training losses and the final validation loss equal those of the same deck on one
// rank (MPI_COMM_SELF, context degree 1) to 1e-5 relative, with sequences up to 300 tokens and
// model.max_positions 302 (beyond nothing ESM-2 needs, but exercising the key); the deck
// refusals name the numbers.
#include "core/error.hpp"
#include "deck/deck.hpp"
#include "dist/runtime.hpp"
#include "io/dataset.hpp"
#include "train/trainer.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <random>
#include <sstream>
#include <string>
#include <vector>

namespace {

namespace fs = std::filesystem;

std::string dir;

/// Random proteins of 1 to 298 residues (rank 0 writes, every rank waits).  Unlike
/// test_trainer's learnable 20..90-residue proteins, the lengths start at 1 so that short
/// sequences leave context shards empty.
void writeDataset(const std::string& path, int count, std::uint64_t seed) {
  if (plm::dist::worldRank() == 0) {
    std::mt19937_64 gen(seed);
    std::uniform_int_distribution<int> residue(4, 23), length(1, 298);
    plm::io::SequenceShard shard;
    for (int s = 0; s < count; ++s) {
      const int n = length(gen);
      for (int i = 0; i < n; ++i) shard.tokens.push_back(static_cast<std::uint8_t>(residue(gen)));
      shard.lengths.push_back(n);
      shard.ids.push_back("p" + std::to_string(s));
    }
    plm::io::DatasetMetadata meta;
    meta.split = "test";
    meta.split_rule = "generated";
    plm::io::writeDataset(path, MPI_COMM_SELF, shard, meta);
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

Teuchos::RCP<Teuchos::ParameterList> deck(const std::string& run, int context) {
  std::ostringstream yaml;
  yaml << "model:\n  preset: custom\n  layers: 2\n  hidden: 16\n  heads: 2\n  ffn: 32\n"
       << "  max_positions: 302\n"
       << "data:\n  train: " << dir << "/train.h5\n  valid: " << dir << "/valid.h5\n"
       << "  tokens_per_batch: 4096\n  micro_batch_tokens: 1024\n  max_seq_len: 300\n"
       << "optimizer:\n  lr: 5.0e-3\n"
       << "schedule:\n  warmup_steps: 1\n"
       << "train:\n  steps: 6\n  log_every: 3\n  eval_every: 0\n"
       << "  run_dir: " << dir << "/" << run << "\n"
       << "checkpoint:\n  every: 0\n  resume: none\n"
       << "parallel:\n  context_degree: " << context << "\n";
  return plm::deck::resolve(*plm::deck::readYamlString(yaml.str(), "test deck"));
}

struct TrainResult {
  std::vector<double> losses;
  double valid = 0;
};

TrainResult train(const Teuchos::RCP<Teuchos::ParameterList>& d, MPI_Comm comm) {
  plm::train::Trainer trainer(d, comm);
  TrainResult r;
  plm::train::Trainer::Hooks hooks;
  hooks.on_step = [&](plm::train::Trainer&, const plm::train::StepStats& s) {
    r.losses.push_back(s.loss());
  };
  trainer.setHooks(hooks);
  trainer.run();
  r.valid = trainer.validate().loss();
  return r;
}

class ContextTrainer : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    char name[256] = "";
    if (plm::dist::worldRank() == 0) {
      std::snprintf(name, sizeof name, "%s/plm_context_XXXXXX",
                    fs::temp_directory_path().string().c_str());
      if (!mkdtemp(name)) name[0] = '\0';
    }
    MPI_Bcast(name, sizeof name, MPI_CHAR, 0, MPI_COMM_WORLD);
    dir = name;
    ASSERT_FALSE(dir.empty());
    writeDataset(dir + "/train.h5", 200, 1);
    writeDataset(dir + "/valid.h5", 20, 2);
  }
  static void TearDownTestSuite() {
    MPI_Barrier(MPI_COMM_WORLD);
    if (plm::dist::worldRank() == 0) fs::remove_all(dir);
  }
};

TEST_F(ContextTrainer, LossesEqualOneRank) {
  const int world = plm::dist::worldSize();
  if (world < 2) GTEST_SKIP() << "context degree > 1 needs 2 ranks";
  TrainResult ref;
  if (plm::dist::worldRank() == 0) ref = train(deck("run_self", 1), MPI_COMM_SELF);
  for (int c = 2; c <= world; c *= 2) {
    const TrainResult got = train(deck("run_c" + std::to_string(c), c), MPI_COMM_WORLD);
    int ok = 1;
    if (plm::dist::worldRank() == 0) {
      EXPECT_EQ(got.losses.size(), ref.losses.size());
      for (std::size_t s = 0; s < ref.losses.size() && s < got.losses.size(); ++s) {
        const double rel = std::abs(got.losses[s] - ref.losses[s]) / std::abs(ref.losses[s]);
        EXPECT_LE(rel, 1e-5) << "context degree " << c << ", step " << s + 1;
        ok &= rel <= 1e-5;
      }
      EXPECT_NEAR(got.valid, ref.valid, 1e-5 * ref.valid) << "context degree " << c;
      EXPECT_LT(ref.losses.back(), ref.losses.front());
      std::printf(
          "trainer, context degree %d on %d ranks: losses %.6f .. %.6f, valid %.6f (one "
          "rank %.6f .. %.6f, valid %.6f)\n",
          c, world, got.losses.front(), got.losses.back(), got.valid, ref.losses.front(),
          ref.losses.back(), ref.valid);
    }
    MPI_Bcast(&ok, 1, MPI_INT, 0, MPI_COMM_WORLD);
    EXPECT_EQ(ok, 1);
  }
}

TEST_F(ContextTrainer, DeckRefusalsNameTheNumbers) {
  auto message = [](const Teuchos::RCP<Teuchos::ParameterList>& d) -> std::string {
    try {
      plm::train::Trainer trainer(d, MPI_COMM_WORLD);
    } catch (const plm::Error& e) {
      return e.what();
    }
    return "";
  };
  const int world = plm::dist::worldSize();
  const std::string bad = message(deck("run_bad", world + 1));
  EXPECT_NE(bad.find("context_degree " + std::to_string(world + 1)), std::string::npos) << bad;
  EXPECT_NE(bad.find(std::to_string(world) + " ranks"), std::string::npos) << bad;
  auto d = deck("run_len", 1);
  d->sublist("model").set("max_positions", 100);
  const std::string len = message(d);
  EXPECT_NE(len.find("data.max_seq_len 300"), std::string::npos) << len;
  EXPECT_NE(len.find("model.max_positions 100"), std::string::npos) << len;
}

}  // namespace
