// The MFU peak: where it comes from (printed), and that a run of the quickstart's model shape
// stays below it, so MFU is never above 100% because of a peak set too low.  A run's records:
// wall-clock time and per-device TFLOP/s in metrics.jsonl, the kernel keys in run/deck.yaml, and
// the TensorBoard event file (every record's CRCs; validation/tb_read.py reads it back with the
// tensorboard package, test_train_tensorboard_read).
#include "core/clock.hpp"
#include "deck/deck.hpp"
#include "dist/runtime.hpp"
#include "io/dataset.hpp"
#include "io/json.hpp"
#include "io/tensorboard.hpp"
#include "train/metrics.hpp"
#include "train/trainer.hpp"

#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
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
void writeProteins(const std::string& dir) {
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
}

TEST(Peak, QuickstartModelRunStaysBelowThePeak) {
  char name[256] = "";
  std::snprintf(name, sizeof name, "%s/plm_metrics_XXXXXX",
                fs::temp_directory_path().string().c_str());
  ASSERT_NE(mkdtemp(name), nullptr);
  const std::string dir = name;
  writeProteins(dir);
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

std::string readFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream all;
  all << in.rdbuf();
  return all.str();
}

// Three steps with an evaluation after step 2 and 3, TensorBoard on, and the kernel keys set
// away from their defaults (a CPU run computes the same whatever they say): the records carry
// the time, run/deck.yaml the keys, and tb/ one event file of valid records.  The run stays in
// PLM_TB_TEST_DIR for test_train_tensorboard_read.
TEST(Metrics, WallClockKernelKeysAndTensorBoard) {
  const std::string dir = PLM_TB_TEST_DIR;
  fs::remove_all(dir);
  fs::create_directories(dir);
  writeProteins(dir);
  std::ostringstream yaml;
  yaml << "model:\n  preset: custom\n  layers: 2\n  hidden: 64\n  heads: 4\n  ffn: 128\n"
       << "data:\n  train: " << dir << "/train.h5\n  valid: " << dir << "/valid.h5\n"
       << "  tokens_per_batch: 4096\n  micro_batch_tokens: 2048\n  max_seq_len: 256\n"
       << "  valid_tokens: 2048\n"
       << "train:\n  steps: 3\n  log_every: 1\n  eval_every: 2\n  run_dir: " << dir << "/run\n"
       << "  tensorboard: true\n  attention: flash\n  deterministic: false\n  profile: true\n"
       << "moe:\n  overlap: true\n  routing: host\n"
       << "fp8:\n  fused_cast: false\n"
       << "checkpoint:\n  every: 0\n  resume: none\n";
  const double before = plm::clock::unixSeconds();
  auto deck = plm::deck::resolve(*plm::deck::readYamlString(yaml.str(), "tensorboard deck"));
  plm::train::Trainer trainer(deck, MPI_COMM_WORLD);
  trainer.run();
  const double after = plm::clock::unixSeconds();

  std::ifstream in(dir + "/run/metrics.jsonl");
  std::string line;
  int train_records = 0, eval_records = 0;
  double last_wall = -1;
  while (std::getline(in, line)) {
    auto r = plm::io::json::parse(line, "metrics.jsonl");
    const std::string kind = r.at("kind").asString();
    if (kind == "event") {
      EXPECT_EQ(r.at("time").asString().size(), 20u) << line;
      continue;
    }
    (kind == "train" ? train_records : eval_records)++;
    const double unix_s = r.at("unix_s").asDouble(), wall = r.at("wall_s").asDouble();
    EXPECT_GE(unix_s, before) << line;
    EXPECT_LE(unix_s, after) << line;
    EXPECT_GE(wall, last_wall) << line;  // records in time order
    EXPECT_LE(wall, after - before + 1) << line;
    last_wall = wall;
    EXPECT_EQ(r.at("time").asString(), plm::clock::utcIso(unix_s)) << line;
    EXPECT_EQ(r.at("time").asString().back(), 'Z') << line;
    if (kind == "train") {
      EXPECT_DOUBLE_EQ(r.at("tflops_per_device").asDouble(),
                       r.at("tflops").asDouble() / plm::dist::worldSize())
          << line;
      EXPECT_FALSE(r.has("gpu_ms")) << "a CPU run has no GPU profile: " << line;
    }
  }
  EXPECT_EQ(train_records, 3);
  EXPECT_EQ(eval_records, 2);  // after step 2 and after the last step

  const std::string resolved = readFile(dir + "/run/deck.yaml");
  for (const char* key :
       {"  attention: flash\n", "  deterministic: false\n", "  profile: true\n",
        "  tensorboard: true\n", "  overlap: true\n", "  routing: host\n", "  fused_cast: false\n"})
    EXPECT_NE(resolved.find(key), std::string::npos) << key << " not in run/deck.yaml";

  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(dir + "/run/tb")) files.push_back(e.path());
  ASSERT_EQ(files.size(), 1u);
  EXPECT_EQ(files[0].filename().string().rfind("events.out.tfevents.", 0), 0u);
  const std::string events = readFile(files[0].string());
  int records = 0;
  std::size_t at = 0;
  while (at < events.size()) {
    ASSERT_LE(at + 12, events.size());
    std::uint64_t length = 0;
    std::uint32_t crc = 0;
    std::memcpy(&length, events.data() + at, 8);
    std::memcpy(&crc, events.data() + at + 8, 4);
    EXPECT_EQ(crc, plm::io::tensorboard::maskedCrc32c(events.data() + at, 8));
    ASSERT_LE(at + 12 + length + 4, events.size());
    std::memcpy(&crc, events.data() + at + 12 + length, 4);
    EXPECT_EQ(crc, plm::io::tensorboard::maskedCrc32c(events.data() + at + 12, length));
    if (records == 0)
      EXPECT_NE(events.substr(at + 12, length).find("brain.Event:2"), std::string::npos);
    at += 12 + length + 4;
    ++records;
  }
  EXPECT_EQ(records, 1 + 3 + 2);  // the version event, three train records, two evaluations
  EXPECT_NE(events.find("train/loss"), std::string::npos);
  EXPECT_NE(events.find("eval/valid_loss"), std::string::npos);
}

}  // namespace
