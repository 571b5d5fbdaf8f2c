#include "train/metrics.hpp"

#include "core/error.hpp"

#include <Kokkos_Core.hpp>

#include <unistd.h>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>

#if defined(KOKKOS_ENABLE_CUDA)
#include <cuda_runtime.h>
#endif

namespace plm::train {

namespace {

// The first "cpu MHz" of /proc/cpuinfo, 0 when unknown.
double cpuMhz() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("cpu MHz", 0) == 0) {
      auto colon = line.find(':');
      if (colon != std::string::npos) return std::atof(line.c_str() + colon + 1);
    }
  }
  return 0.0;
}

}  // namespace

PeakFlops peakTflopsPerDevice(double deck_value, const std::string& precision, int cores_per_rank) {
  if (deck_value > 0) return {deck_value, "train.peak_tflops"};
#if defined(KOKKOS_ENABLE_CUDA)
  cudaDeviceProp prop;
  int device = 0;
  if (cudaGetDevice(&device) == cudaSuccess &&
      cudaGetDeviceProperties(&prop, device) == cudaSuccess) {
    const std::string name = prop.name;
    if (name.find("H100") != std::string::npos || name.find("H200") != std::string::npos) {
      if (precision == "fp32") return {494.7, name + " TF32 dense (nominal)"};
      return {989.0, name + " BF16 dense (nominal)"};
    }
    return {989.0, name + ": unknown GPU, H100 BF16 989 assumed; set train.peak_tflops"};
  }
  return {989.0, "H100 BF16 989 assumed; set train.peak_tflops"};
#else
  (void)precision;
  double mhz = cpuMhz();
  if (mhz <= 0) mhz = 2500.0;
  const int cores = cores_per_rank > 0 ? cores_per_rank : 1;
  const double tflops = cores * 32.0 * mhz * 1e6 / 1e12;
  char text[160];
  std::snprintf(text, sizeof text,
                "%d CPU core(s) per rank x 32 fp32 FLOP/cycle x %.0f MHz (nominal)", cores, mhz);
  return {tflops, text};
#endif
}

std::int64_t memoryInUse() {
#if defined(KOKKOS_ENABLE_CUDA)
  std::size_t free_bytes = 0, total_bytes = 0;
  if (cudaMemGetInfo(&free_bytes, &total_bytes) == cudaSuccess)
    return static_cast<std::int64_t>(total_bytes - free_bytes);
  return 0;
#else
  std::ifstream in("/proc/self/statm");
  std::int64_t size_pages = 0, resident_pages = 0;
  if (!(in >> size_pages >> resident_pages)) return 0;
  return resident_pages * static_cast<std::int64_t>(sysconf(_SC_PAGESIZE));
#endif
}

std::string formatBytes(double bytes) {
  char text[32];
  if (bytes >= 1024.0 * 1024 * 1024)
    std::snprintf(text, sizeof text, "%.2f GiB", bytes / (1024.0 * 1024 * 1024));
  else
    std::snprintf(text, sizeof text, "%.0f MiB", bytes / (1024.0 * 1024));
  return text;
}

std::string formatDuration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  const long s = std::lround(seconds);
  char text[32];
  if (s >= 3600)
    std::snprintf(text, sizeof text, "%ldh%02ldm", s / 3600, (s % 3600) / 60);
  else if (s >= 60)
    std::snprintf(text, sizeof text, "%ldm%02lds", s / 60, s % 60);
  else
    std::snprintf(text, sizeof text, "%lds", s);
  return text;
}

void MetricsLog::open(const std::string& path) {
  path_member = path;
  out_member.open(path, std::ios::app);
  if (!out_member)
    throw Error("cannot open " + path + " for appending; check train.run_dir is writable");
}

void MetricsLog::write(const io::json::Value& record) {
  if (!out_member.is_open()) return;
  out_member << io::json::write(record) << '\n';
  out_member.flush();
  if (!out_member) throw Error("writing " + path_member + " failed (disk full?)");
}

}  // namespace plm::train
