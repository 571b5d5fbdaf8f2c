// What the trainer reports besides the loss: FLOPs and MFU, memory in use, and the
// metrics.jsonl record log.
//
// Design choice: MFU uses model FLOPs (Esm2Config::trainFlopsPerToken, doc/flops.md), not the
// FLOPs actually executed, so activation recomputation lowers MFU instead of hiding its cost; the
// peak is per device (per rank) and comes from the deck (train.peak_tflops) or a built-in table
// or measured peak (peakTflopsPerDevice) that says where it came from; MFU never exceeds 100%.
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

/// \brief The peak per device: `deck_value` when > 0, else for this build and `precision`
/// ("fp32", "bf16"): H100/H200 989 TFLOP/s bf16 dense, 494.7 TF32; on the CPU the larger of the
/// nominal peak of the rank's share of the node's cores (`cores_per_rank`) at two FMA pipes of
/// the widest vector unit (AVX-512 64, AVX2 32 fp32 FLOP/cycle) times the highest clock the
/// system shows, and measuredCpuSgemmTflops(). `source` says which and how, for the log.
PeakFlops peakTflopsPerDevice(double deck_value, const std::string& precision,
                              int cores_per_rank = 1);

/// \brief fp32 TFLOP/s of this rank's best 512^3 sgemm through model::gemm (measured once per
/// process, about 0.1 s): what the BLAS really reaches here, turbo and all.
double measuredCpuSgemmTflops();

/// \brief MFU of `tflops` (all devices) against `peak` per device, never above 1: a rate above
/// the peak means the peak is wrong, so it is raised to the rate (warned once, source updated).
double mfuOf(double tflops, int devices, PeakFlops& peak);

/// \brief Memory in use by this rank: device memory in use on a GPU build, resident set size
/// (/proc/self/statm) on the CPU.
std::int64_t memoryInUse();
/// \brief The high-water mark of this process's resident set size (VmHWM of
/// /proc/self/status; 0 where it cannot be read): host memory, on every build.
std::int64_t hostPeakResident();

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
