// The two FP8 formats of Hopper tensor cores (OCP FP8, as NVIDIA and Transformer Engine use
// them), encoded and decoded exactly on host and device:
//   E4M3 ("fn"): 1 sign, 4 exponent (bias 7), 3 mantissa bits; max 448; S.1111.111 is NaN, there
//                is no infinity; subnormals down to 2^-9.
//   E5M2:        1 sign, 5 exponent (bias 15), 2 mantissa bits; max 57344; exponent 11111 is
//                infinity (mantissa 0) or NaN; subnormals down to 2^-16.
//
// Design choice: the cast is Transformer Engine's saturating one (`__NV_SATFINITE`): round to
// nearest, ties to even, on the exact binary value; anything beyond ±max, infinities included,
// becomes ±max; NaN stays NaN.  It is written with integer operations on the fp32 bit pattern
// only (no libm, no rounding mode), so a Kokkos kernel on any backend and the host produce the
// same code for the same input, which is what makes the CPU emulation the GPU's reference.
#pragma once

#include <Kokkos_Core.hpp>

#include <cstdint>

namespace plm::model::fp8 {

/// \brief An FP8 element format.
enum class Format : std::uint8_t { E4M3, E5M2 };

/// The largest finite value of each format.
inline constexpr float e4m3_max = 448.0f;
inline constexpr float e5m2_max = 57344.0f;

KOKKOS_INLINE_FUNCTION constexpr float maxOf(Format f) {
  return f == Format::E4M3 ? e4m3_max : e5m2_max;
}

namespace detail {

// Type punning through a union: supported by GCC, Clang and nvcc on host and device (Kokkos 3.4
// has no bit_cast).
union Bits {
  float f;
  std::uint32_t u;
};

KOKKOS_INLINE_FUNCTION std::uint32_t bitsOf(float x) {
  Bits b;
  b.f = x;
  return b.u;
}

KOKKOS_INLINE_FUNCTION float floatOf(std::uint32_t u) {
  Bits b;
  b.u = u;
  return b.f;
}

/// 2^k as a normal fp32 (-126 <= k <= 127).
KOKKOS_INLINE_FUNCTION float pow2(int k) {
  return floatOf(static_cast<std::uint32_t>(k + 127) << 23);
}

/// Encodes with `mant` mantissa bits, exponent bias `bias`, largest finite magnitude code
/// `max_code` (7 bits) and NaN code `nan_code`.
KOKKOS_INLINE_FUNCTION std::uint8_t encode(float x, int mant, int bias, std::uint8_t max_code,
                                           std::uint8_t nan_code, float max_value) {
  const std::uint32_t u = bitsOf(x);
  const std::uint8_t sign = static_cast<std::uint8_t>((u >> 24) & 0x80u);
  const std::uint32_t exp_f = (u >> 23) & 0xFFu;
  const std::uint32_t man_f = u & 0x7FFFFFu;
  if (exp_f == 0xFFu && man_f != 0) return static_cast<std::uint8_t>(sign | nan_code);
  const float a = floatOf(u & 0x7FFFFFFFu);
  if (a > max_value) return static_cast<std::uint8_t>(sign | max_code);  // saturate (inf too)
  if (exp_f == 0) return sign;  // fp32 zero or subnormal: far below every FP8 subnormal
  const int e = static_cast<int>(exp_f) - 127;
  const int emin = 1 - bias;
  const std::uint32_t sig = man_f | 0x800000u;  // 24 significant bits, value sig * 2^(e-23)
  // Keep `mant` bits after the leading one (normal), or fewer below the normal range.
  const int shift = 23 - mant + (e < emin ? emin - e : 0);
  if (shift > 24) return sign;  // below half the smallest subnormal: rounds to zero
  std::uint32_t q = sig >> shift;
  const std::uint32_t rem = sig & ((1u << shift) - 1u);
  const std::uint32_t half = 1u << (shift - 1);
  if (rem > half || (rem == half && (q & 1u))) ++q;  // ties to even
  // A subnormal's code is its mantissa; a rounding carry into 2^mant lands on the smallest
  // normal, and a normal's carry into the next binade on the next exponent, both by addition.
  const std::uint32_t code =
      e < emin ? q : (static_cast<std::uint32_t>(e + bias) << mant) + (q - (1u << mant));
  return static_cast<std::uint8_t>(sign | (code > max_code ? max_code : code));
}

}  // namespace detail

/// \brief The E4M3 code nearest to x (ties to even), saturated to ±448; NaN stays NaN (0x7F).
KOKKOS_INLINE_FUNCTION std::uint8_t encodeE4M3(float x) {
  return detail::encode(x, 3, 7, 0x7E, 0x7F, e4m3_max);
}

/// \brief The E5M2 code nearest to x (ties to even), saturated to ±57344 (infinities too); NaN
/// stays NaN (0x7F).
KOKKOS_INLINE_FUNCTION std::uint8_t encodeE5M2(float x) {
  return detail::encode(x, 2, 15, 0x7B, 0x7F, e5m2_max);
}

/// \brief The value of an E4M3 code (exact in fp32).
KOKKOS_INLINE_FUNCTION float decodeE4M3(std::uint8_t c) {
  const float sign = (c & 0x80) ? -1.0f : 1.0f;
  const int exp = (c >> 3) & 0xF, man = c & 0x7;
  if (exp == 0xF && man == 0x7) return detail::floatOf(0x7FC00000u);  // NaN
  if (exp == 0) return sign * static_cast<float>(man) * detail::pow2(-9);
  return sign * static_cast<float>(8 + man) * detail::pow2(exp - 7 - 3);
}

/// \brief The value of an E5M2 code (exact in fp32).
KOKKOS_INLINE_FUNCTION float decodeE5M2(std::uint8_t c) {
  const float sign = (c & 0x80) ? -1.0f : 1.0f;
  const int exp = (c >> 2) & 0x1F, man = c & 0x3;
  if (exp == 0x1F)
    return man == 0 ? sign * detail::floatOf(0x7F800000u) : detail::floatOf(0x7FC00000u);
  if (exp == 0) return sign * static_cast<float>(man) * detail::pow2(-16);
  return sign * static_cast<float>(4 + man) * detail::pow2(exp - 15 - 2);
}

KOKKOS_INLINE_FUNCTION std::uint8_t encode(Format f, float x) {
  return f == Format::E4M3 ? encodeE4M3(x) : encodeE5M2(x);
}

KOKKOS_INLINE_FUNCTION float decode(Format f, std::uint8_t c) {
  return f == Format::E4M3 ? decodeE4M3(c) : decodeE5M2(c);
}

/// \brief What an FP8 GEMM sees of x: decode(encode(x * scale)) * scale_inv, with both products
/// in fp32 as Transformer Engine's cast and cuBLASLt's A/B_SCALE (scale_inv) apply them.
KOKKOS_INLINE_FUNCTION float quantize(Format f, float x, float scale, float scale_inv) {
  return decode(f, encode(f, x * scale)) * scale_inv;
}

}  // namespace plm::model::fp8
