// The MFU peak: where it comes from (printed), and that a run of the quickstart's model shape
// stays below it, so MFU is never above 100% because of a peak set too low.
#include "deck/deck.hpp"
#include "dist/runtime.hpp"
#include "io/dataset.hpp"
#include "io/json.hpp"
#include "train/metrics.hpp"
#include "train/trainer.hpp"

#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>

namespace {

namespace fs = std::filesystem;
using plm::train::PeakFlops;

TEST(Peak, DeckValueWinsAndTheCpuPeakSaysWhereItComesFrom) {
  const PeakFlops deck = plm::train::peakTflopsPerDevice(12.5, "fp32", 4);
  EXPECT_EQ(deck.tflops, 12.5);
  EXPECT_EQ(deck.source, "train.peak_tflops");
#if !defined(KOKKOS_ENABLE_CUDA)
  const double measured = plm::train::measuredCpuSgemmTflops();
  EXPECT_GT(measured, 0.0);
  const PeakFlops one = plm::train::peakTflopsPerDevice(0, "fp32", 1);
  const PeakFlops two = plm::train::peakTflopsPerDevice(0, "fp32", 2);
  EXPECT_GE(one.tflops, measured) << one.source;  // never below what the BLAS reaches here
  EXPECT_GE(two.tflops, one.tflops);
  for (const char* part :
       {"nominal 1 core(s) x ", " fp32 FLOP/cycle (", " MHz (", "measured sgemm 512^3 at start = "})
    EXPECT_NE(one.source.find(part), std::string::npos) << one.source;
  std::printf("peak for MFU on this machine, 1 core: %.4g TFLOP/s (%s)\n", one.tflops,
              one.source.c_str());
#endif
}

TEST(Peak, MfuIsNeverAboveOneAndATooLowPeakIsRaised) {
  PeakFlops peak{2.0, "test"};
  EXPECT_DOUBLE_EQ(plm::train::mfuOf(1.0, 1, peak), 0.5);
  EXPECT_DOUBLE_EQ(plm::train::mfuOf(2.0, 2, peak), 0.5);  // per device: 1 of 2
  EXPECT_EQ(peak.tflops, 2.0);
  EXPECT_DOUBLE_EQ(plm::train::mfuOf(6.0, 2, peak), 1.0);  // 3 per device > 2
  EXPECT_EQ(peak.tflops, 3.0);
  EXPECT_NE(peak.source.find("raised"), std::string::npos);
  EXPECT_DOUBLE_EQ(plm::train::mfuOf(1.5, 1, peak), 0.5);
}

// A few steps of the quickstart's model (inputs/quickstart.yaml: 4 layers, hidden 128, 4 heads,
// ffn 512, 8192 tokens per step in micro-batches of 4096) on generated proteins: the TFLOP/s the
// trainer reports stay at or below the peak it printed, without the raise of mfuOf.
TEST(Peak, QuickstartModelRunStaysBelowThePeak) {
  char name[256] = "";
  std::snprintf(name, sizeof name, "%s/plm_metrics_XXXXXX",
                fs::temp_directory_path().string().c_str());
  ASSERT_NE(mkdtemp(name), nullptr);
  const std::string dir = name;
  std::mt19937_64 gen(3);
  for (const char* split : {"train", "valid"}) {
    plm::io::SequenceShard shard;
    for (int s = 0; s < 300; ++s) {
      const int n = 60 + int(gen() % 300);
      for (int i = 0; i < n; ++i) shard.tokens.push_back(std::uint8_t(4 + gen() % 20));
      shard.lengths.push_back(n);
      shard.ids.push_back("seq" + std::to_string(s));
    }
    plm::io::DatasetMetadata meta;
    meta.split = split;
    meta.split_rule = "generated";
    plm::io::writeDataset(dir + "/" + split + ".h5", MPI_COMM_SELF, shard, meta);
  }
  std::ostringstream yaml;
  yaml << "model:\n  preset: custom\n  layers: 4\n  hidden: 128\n  heads: 4\n  ffn: 512\n"
       << "data:\n  train: " << dir << "/train.h5\n  valid: " << dir << "/valid.h5\n"
       << "  tokens_per_batch: 8192\n  micro_batch_tokens: 4096\n  max_seq_len: 256\n"
       << "train:\n  steps: 4\n  log_every: 1\n  eval_every: 0\n  run_dir: " << dir << "/run\n"
       << "checkpoint:\n  every: 0\n  resume: none\n";
  auto deck = plm::deck::resolve(*plm::deck::readYamlString(yaml.str(), "quickstart-like deck"));
  plm::train::Trainer trainer(deck, MPI_COMM_WORLD);
  trainer.run();
  std::ifstream in(dir + "/run/metrics.jsonl");
  std::string line;
  int train_records = 0, eval_records = 0;
  while (std::getline(in, line)) {
    auto r = plm::io::json::parse(line, "metrics.jsonl");
    if (r.at("kind").asString() == "eval") ++eval_records;
    if (r.at("kind").asString() != "train") continue;
    ++train_records;
    const double mfu = r.at("mfu").asDouble();
    EXPECT_GT(mfu, 0.0) << line;
    EXPECT_LT(mfu, 1.0) << line << ": the step ran at or above the peak, which was raised";
  }
  EXPECT_EQ(train_records, 4);
  EXPECT_EQ(eval_records, 0);  // train.eval_every: 0 means never, not even after the last step
  fs::remove_all(dir);
}

}  // namespace
