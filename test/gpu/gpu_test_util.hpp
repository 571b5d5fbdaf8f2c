// Small helpers for the GPU kernel tests: device buffers, bf16 rounding on the host, random
// inputs, relative errors.  References are computed on the host in double from the same
// bf16-rounded inputs the kernels see.
#pragma once

#include "core/error.hpp"
#include "gpu/device.hpp"

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

namespace plm::gpu::test {

inline std::uint16_t toBf16Bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);                     // round to nearest even
  return static_cast<std::uint16_t>(u >> 16);
}
inline float fromBf16Bits(std::uint16_t b) {
  std::uint32_t u = static_cast<std::uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float roundBf16(float f) { return fromBf16Bits(toBf16Bits(f)); }

template <class T> class DeviceBuffer {
 public:
  explicit DeviceBuffer(std::size_t n) : n_member(n) {
    PLM_CHECK_CUDA(cudaMalloc(&ptr_member, (n ? n : 1) * sizeof(T)));
  }
  explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size()) { upload(host); }
  ~DeviceBuffer() { cudaFree(ptr_member); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  T* get() const { return ptr_member; }
  std::size_t size() const { return n_member; }
  void upload(const std::vector<T>& host) {
    PLM_CHECK_CUDA(
        cudaMemcpy(ptr_member, host.data(), n_member * sizeof(T), cudaMemcpyHostToDevice));
  }
  std::vector<T> download() const {
    PLM_CHECK_CUDA(cudaDeviceSynchronize());
    std::vector<T> host(n_member);
    PLM_CHECK_CUDA(
        cudaMemcpy(host.data(), ptr_member, n_member * sizeof(T), cudaMemcpyDeviceToHost));
    return host;
  }
  /// NaN (0xff bytes) everywhere, so unwritten outputs cannot pass.
  void poison() { PLM_CHECK_CUDA(cudaMemset(ptr_member, 0xff, n_member * sizeof(T))); }

 private:
  T* ptr_member = nullptr;
  std::size_t n_member = 0;
};

/// bf16 device buffer from fp32 host values (rounded), and the rounded values back.
struct Bf16Tensor {
  std::vector<float> values;  // the rounded values the device holds
  DeviceBuffer<std::uint16_t> device;
  explicit Bf16Tensor(const std::vector<float>& v) : values(v.size()), device(v.size()) {
    std::vector<std::uint16_t> bits(v.size());
    for (std::size_t i = 0; i < v.size(); ++i) {
      bits[i] = toBf16Bits(v[i]);
      values[i] = fromBf16Bits(bits[i]);
    }
    device.upload(bits);
  }
  bf16* get() const { return reinterpret_cast<bf16*>(device.get()); }
};

inline std::vector<float> downloadBf16(const DeviceBuffer<std::uint16_t>& b) {
  auto bits = b.download();
  std::vector<float> out(bits.size());
  for (std::size_t i = 0; i < bits.size(); ++i) out[i] = fromBf16Bits(bits[i]);
  return out;
}

inline std::vector<float> randomNormal(std::size_t n, std::uint64_t seed, float stddev = 1.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.0f, stddev);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

/// ||out - ref|| / ||ref||; +inf when out holds a NaN or infinity.
template <class A, class B> double relError(const std::vector<A>& out, const std::vector<B>& ref) {
  double num = 0.0, den = 0.0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    double o = static_cast<double>(out[i]);
    if (!std::isfinite(o)) return std::numeric_limits<double>::infinity();
    double d = o - static_cast<double>(ref[i]);
    num += d * d;
    den += static_cast<double>(ref[i]) * static_cast<double>(ref[i]);
  }
  return std::sqrt(num / (den > 0 ? den : 1.0));
}

}  // namespace plm::gpu::test
