#include "train/metrics.hpp"

#include "core/error.hpp"
#include "core/log.hpp"
#include "model/gemm.hpp"

#include <Kokkos_Core.hpp>

#include <unistd.h>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <utility>

#if defined(KOKKOS_ENABLE_CUDA)
#include <cuda_runtime.h>
#endif

namespace plm::train {

namespace {

// fp32 FLOP per cycle of one core: two FMA pipes of the widest vector unit (the most any of
// these cores has; a one-pipe part is overestimated, which can only lower MFU, never raise it).
struct VectorUnit {
  int flops_per_cycle;
  const char* name;
};
VectorUnit vectorUnit() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) return {64, "AVX-512"};
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return {32, "AVX2+FMA"};
  if (__builtin_cpu_supports("avx")) return {16, "AVX"};
  return {8, "SSE"};
#elif defined(__aarch64__)
  return {32, "NEON/SVE, 4 x 128-bit FMA pipes"};
#else
  return {32, "unknown vector unit"};
#endif
}

// The highest clock this processor may run at, in MHz, and where it was read: cpufreq's maximum
// (turbo included) where the kernel exposes it, else the largest "cpu MHz" of /proc/cpuinfo
// (a VM often shows only the nominal clock there: the measured peak then decides).
std::pair<double, std::string> maxClockMhz() {
  std::ifstream freq("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq");
  double khz = 0;
  if (freq >> khz && khz > 0) return {khz / 1000.0, "max clock, cpufreq"};
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  double mhz = 0;
  while (std::getline(in, line)) {
    if (line.rfind("cpu MHz", 0) == 0) {
      auto colon = line.find(':');
      if (colon != std::string::npos) mhz = std::max(mhz, std::atof(line.c_str() + colon + 1));
    }
  }
  if (mhz > 0) return {mhz, "/proc/cpuinfo clock, turbo not visible"};
  return {2500.0, "clock unknown, 2500 MHz assumed"};
}

}  // namespace

double measuredCpuSgemmTflops() {
  // Once per process: the best of repeated 512^3 sgemm calls over about 0.1 s, through the same
  // gemm (and BLAS threads) the model uses.
  static const double measured = [] {
    const int n = 512;
    View2<float> a("plm::train::peak_a", n, n), b("plm::train::peak_b", n, n),
        c("plm::train::peak_c", n, n);
    Kokkos::deep_copy(a, 0.5f);
    Kokkos::deep_copy(b, 0.25f);
    const ExecSpace space;
    auto call = [&] {
      const auto t0 = std::chrono::steady_clock::now();
      model::gemm(space, model::Trans::N, model::Trans::N, 1.0f, a, b, 0.0f, c);
      space.fence();
      return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    };
    call();  // warm-up: threads started, pages touched
    double best = 1e30, total = 0;
    for (int k = 0; k < 50 && total < 0.1; ++k) {
      const double t = call();
      best = std::min(best, t);
      total += t;
    }
    return 2.0 * n * double(n) * n / best / 1e12;
  }();
  return measured;
}

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
  const auto [mhz, clock_source] = maxClockMhz();
  const VectorUnit unit = vectorUnit();
  const int cores = cores_per_rank > 0 ? cores_per_rank : 1;
  const double nominal = cores * double(unit.flops_per_cycle) * mhz * 1e6 / 1e12;
  const double measured = measuredCpuSgemmTflops();
  char text[320];
  std::snprintf(text, sizeof text,
                "%s: nominal %d core(s) x %d fp32 FLOP/cycle (%s) x %.0f MHz (%s) = %.4g, "
                "measured sgemm 512^3 at start = %.4g",
                measured > nominal ? "measured" : "nominal", cores, unit.flops_per_cycle, unit.name,
                mhz, clock_source.c_str(), nominal, measured);
  return {std::max(nominal, measured), text};
#endif
}

double mfuOf(double tflops, int devices, PeakFlops& peak) {
  const double per_device = tflops / std::max(1, devices);
  if (peak.tflops <= 0) return 0.0;
  if (per_device > peak.tflops) {
    log::warn(
        "MFU: %.4g TFLOP/s per rank is above the peak %.4g (%s): the peak is too low; "
        "it is raised to the rate seen (set train.peak_tflops to the real one)",
        per_device, peak.tflops, peak.source.c_str());
    peak.tflops = per_device;
    peak.source = "raised to the rate seen in training";
  }
  return per_device / peak.tflops;
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

std::int64_t hostPeakResident() {
  std::ifstream in("/proc/self/status");
  for (std::string line; std::getline(in, line);)
    if (line.compare(0, 6, "VmHWM:") == 0) return std::atoll(line.c_str() + 6) * 1024;  // kB
  return 0;
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
