// Scalar math shared by the model's kernels: exp and erf that the compiler can vectorize, and a
// counter-based normal generator.
//
// Design choice: the float versions are polynomial approximations (relative error ~2e-7 for
// exp, absolute ~1.5e-7 for erf) written without library calls or branches, so loops over
// attention scores and FFN activations vectorize on the CPU; libm's expf/erff do not. The double
// versions call libm: double runs only in finite-difference checks, where exactness matters and
// speed does not.
#pragma once

#include <Kokkos_Core.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace plm::model::math {

// Kokkos' exact math functions moved from Kokkos::Experimental to Kokkos in 3.7 (and the old
// names are deprecated in 4): one alias keeps the model source valid for both.
#if KOKKOS_VERSION >= 30700
namespace libm = ::Kokkos;
#else
namespace libm = ::Kokkos::Experimental;
#endif

KOKKOS_INLINE_FUNCTION std::int32_t floatBits(float x) {
  std::int32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return bits;
}

KOKKOS_INLINE_FUNCTION float bitsFloat(std::int32_t bits) {
  float x;
  std::memcpy(&x, &bits, sizeof(x));
  return x;
}

KOKKOS_INLINE_FUNCTION float exp(float x) {
  // Cephes expf: x = n ln2 + r with |r| <= ln2/2, degree-5 polynomial for e^r, 2^n built in
  // the exponent bits.  The clamp to [-87, 88] and the rounding (1.5*2^23 trick) use integer
  // and arithmetic operations only: float compares may trap, which stops GCC from vectorizing
  // without -fno-trapping-math.  Inputs below -87 return ~1e-38, a softmax weight of zero.
  std::int32_t bits = floatBits(x);
  const std::int32_t magnitude = bits & 0x7fffffff;
  const std::int32_t limit = bits < 0 ? 0x42AE0000 /* 87.0f */ : 0x42B00000 /* 88.0f */;
  bits = magnitude > limit ? ((bits & static_cast<std::int32_t>(0x80000000u)) | limit) : bits;
  x = bitsFloat(bits);
  const float round_magic = 12582912.0f;
  const float n = (x * 1.44269504088896341f + round_magic) - round_magic;
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  const float r2 = r * r;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r2 + r + 1.0f;
  return p * bitsFloat((static_cast<std::int32_t>(n) + 127) << 23);
}

KOKKOS_INLINE_FUNCTION double exp(double x) { return libm::exp(x); }

KOKKOS_INLINE_FUNCTION float erf(float x) {
  // Abramowitz & Stegun 7.1.26 (|error| <= 1.5e-7) on |x|, sign restored from the bits (no
  // float compares, see exp).
  const std::int32_t bits = floatBits(x);
  const float ax = bitsFloat(bits & 0x7fffffff);
  const float t = 1.0f / (1.0f + 0.3275911f * ax);
  float y = 1.061405429f;
  y = y * t - 1.453152027f;
  y = y * t + 1.421413741f;
  y = y * t - 0.284496736f;
  y = y * t + 0.254829592f;
  y = 1.0f - y * t * exp(-ax * ax);
  return bitsFloat(floatBits(y) | (bits & static_cast<std::int32_t>(0x80000000u)));
}

KOKKOS_INLINE_FUNCTION double erf(double x) { return libm::erf(x); }

/// splitmix64: a stateless hash, so element i of a tensor gets the same random number on every
/// backend and thread count.
KOKKOS_INLINE_FUNCTION std::uint64_t hash64(std::uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

/// \brief Standard normal number for (seed, stream, index), by Box-Muller on two hashed uniforms.
KOKKOS_INLINE_FUNCTION double normal(std::uint64_t seed, std::uint64_t stream,
                                     std::uint64_t index) {
  const std::uint64_t base = hash64(seed ^ hash64(stream + 0x632BE59BD9B4E019ull));
  const std::uint64_t a = hash64(base + 2 * index);
  const std::uint64_t b = hash64(base + 2 * index + 1);
  const double u1 = (static_cast<double>(a >> 11) + 1.0) * (1.0 / 9007199254740993.0);  // (0, 1]
  const double u2 = static_cast<double>(b >> 11) * (1.0 / 9007199254740992.0);          // [0, 1)
  return libm::sqrt(-2.0 * libm::log(u1)) * libm::cos(6.283185307179586476925 * u2);
}

}  // namespace plm::model::math
