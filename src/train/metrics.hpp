// What the trainer reports besides the loss: FLOPs and MFU, memory in use, and the
// metrics.jsonl record log.
//
// Design choice: MFU uses model FLOPs (Esm2Config::trainFlopsPerToken, doc/flops.md), not the
// FLOPs actually executed, so activation recomputation lowers MFU instead of hiding its cost; the
// peak is per device (per rank) and comes from the deck (train.peak_tflops) or a built-in table
// (peakTflopsPerDevice) that says which nominal value it used.
#pragma once

#include "io/json.hpp"

#include <cstdint>
#include <fstream>
#include <string>

namespace plm::train {

struct PeakFlops {
  double tflops = 0.0;  // per device (per rank on the CPU)
  std::string source;   // how it was chosen, for the log
};

/// \brief The nominal peak per device: `deck_value` when > 0, else the built-in table for this
/// build and `precision` ("fp32", "bf16"): H100/H200 989 TFLOP/s bf16 dense, 494.7 TF32; on the
/// CPU the rank's share of the node's cores (`cores_per_rank`: the Serial backend runs on one,
/// the BLAS threads use the rest) at 32 fp32 FLOP/cycle (AVX2/AVX-512 FMA, 2 pipes) times the
/// clock /proc/cpuinfo reports.
PeakFlops peakTflopsPerDevice(double deck_value, const std::string& precision,
                              int cores_per_rank = 1);

/// \brief Memory in use by this rank: device memory in use on a GPU build, resident set size
/// (/proc/self/statm) on the CPU.
std::int64_t memoryInUse();

/// \brief "1.23 GiB", "512 MiB".
std::string formatBytes(double bytes);
/// \brief "1h02m", "5m12s", "42s".
std::string formatDuration(double seconds);

/// \brief Appends one compact JSON object per line to a file (rank 0 only opens it), flushed per
/// record so a killed run keeps every record written so far.
class MetricsLog {
 public:
  MetricsLog() = default;
  /// \brief Opens `path` for appending (a resumed run continues the same file).
  void open(const std::string& path);
  bool isOpen() const { return out_member.is_open(); }
  void write(const io::json::Value& record);

 private:
  std::ofstream out_member;
  std::string path_member;
};

}  // namespace plm::train
