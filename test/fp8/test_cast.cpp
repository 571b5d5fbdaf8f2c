// The FP8 casts (model/fp8.hpp): every code decoded against the format's definition, literal
// tables of exact values, and the encoder against a slow nearest-code search (ties to even,
// saturation, subnormals, NaN), on the host and through a Kokkos kernel.
#include "model/fp8.hpp"
#include "model/fp8_gemm.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

namespace {

using namespace plm::model::fp8;

// The format's definition, written independently of the decoder (double, ldexp).
double definedValue(Format f, int code) {
  const int mant_bits = f == Format::E4M3 ? 3 : 2, bias = f == Format::E4M3 ? 7 : 15;
  const int exp = (code & 0x7F) >> mant_bits, man = code & ((1 << mant_bits) - 1);
  const double sign = (code & 0x80) ? -1.0 : 1.0;
  if (exp == 0) return sign * std::ldexp(man, 1 - bias - mant_bits);
  return sign * std::ldexp((1 << mant_bits) + man, exp - bias - mant_bits);
}

bool isNanCode(Format f, int code) {
  return f == Format::E4M3 ? (code & 0x7F) == 0x7F : (code & 0x7F) > 0x7C;
}

// Slow reference: the finite code nearest to x (ties to the even code), saturating.
int nearestCode(Format f, float x) {
  if (std::isnan(x)) return 0x7F;
  const double fmax = maxOf(f);
  const int sign = std::signbit(x) ? 0x80 : 0;
  double a = std::fabs(double(x));
  if (a > fmax) return sign | (f == Format::E4M3 ? 0x7E : 0x7B);
  int best = 0;
  double best_d = std::numeric_limits<double>::infinity();
  for (int c = 0; c < 0x80; ++c) {
    if (isNanCode(f, c) || (f == Format::E5M2 && c == 0x7C)) continue;
    const double d = std::fabs(definedValue(f, c) - a);
    if (d < best_d || (d == best_d && (c & 1) == 0)) {
      best = c;
      best_d = d;
    }
  }
  return sign | best;
}

TEST(Fp8Cast, EveryE4M3CodeDecodes) {
  for (int c = 0; c < 256; ++c) {
    const float v = decodeE4M3(std::uint8_t(c));
    if ((c & 0x7F) == 0x7F) {
      EXPECT_TRUE(std::isnan(v)) << c;
      continue;
    }
    EXPECT_EQ(double(v), definedValue(Format::E4M3, c)) << "code " << c;
  }
}

TEST(Fp8Cast, EveryE5M2CodeDecodes) {
  for (int c = 0; c < 256; ++c) {
    const float v = decodeE5M2(std::uint8_t(c));
    if ((c & 0x7F) == 0x7C) {
      EXPECT_EQ(v, (c & 0x80) ? -INFINITY : INFINITY);
    } else if ((c & 0x7F) > 0x7C) {
      EXPECT_TRUE(std::isnan(v)) << c;
    } else {
      EXPECT_EQ(double(v), definedValue(Format::E5M2, c)) << "code " << c;
    }
  }
}

TEST(Fp8Cast, ExactValueTables) {
  struct Row {
    int code;
    double value;
  };
  // E4M3: smallest subnormal 2^-9, largest subnormal 7 * 2^-9, smallest normal 2^-6, one, max.
  for (const Row& r : std::vector<Row>{{0x00, 0.0},
                                       {0x01, 0.001953125},
                                       {0x07, 0.013671875},
                                       {0x08, 0.015625},
                                       {0x38, 1.0},
                                       {0x39, 1.125},
                                       {0x3F, 1.875},
                                       {0x40, 2.0},
                                       {0x77, 240.0},
                                       {0x7E, 448.0},
                                       {0xB8, -1.0},
                                       {0xFE, -448.0}}) {
    EXPECT_EQ(double(decodeE4M3(std::uint8_t(r.code))), r.value) << r.code;
    EXPECT_EQ(int(encodeE4M3(float(r.value))), r.code) << r.value;
  }
  // E5M2: smallest subnormal 2^-16, smallest normal 2^-14, one, max 57344.
  for (const Row& r : std::vector<Row>{{0x01, 1.52587890625e-05},
                                       {0x03, 4.57763671875e-05},
                                       {0x04, 6.103515625e-05},
                                       {0x3C, 1.0},
                                       {0x3D, 1.25},
                                       {0x7B, 57344.0},
                                       {0xBC, -1.0}}) {
    EXPECT_EQ(double(decodeE5M2(std::uint8_t(r.code))), r.value) << r.code;
    EXPECT_EQ(int(encodeE5M2(float(r.value))), r.code) << r.value;
  }
}

TEST(Fp8Cast, TiesSaturationSubnormalsNan) {
  // Ties to even: 1.0625 lies halfway between 1 (0x38) and 1.125 (0x39): even 0x38; 1.1875
  // between 1.125 and 1.25 (0x3A): even 0x3A.
  EXPECT_EQ(encodeE4M3(1.0625f), 0x38);
  EXPECT_EQ(encodeE4M3(1.1875f), 0x3A);
  EXPECT_EQ(encodeE4M3(std::nextafter(1.0625f, 2.0f)), 0x39);
  // Subnormal ties: 2^-10 (half the smallest subnormal) rounds to 0, 3 * 2^-10 to 2 * 2^-9.
  EXPECT_EQ(encodeE4M3(std::ldexp(1.0f, -10)), 0x00);
  EXPECT_EQ(encodeE4M3(std::nextafter(std::ldexp(1.0f, -10), 1.0f)), 0x01);
  EXPECT_EQ(encodeE4M3(3 * std::ldexp(1.0f, -10)), 0x02);
  // The largest subnormal rounding up carries into the smallest normal: 7.5 * 2^-9 -> 2^-6.
  EXPECT_EQ(encodeE4M3(7.5f * std::ldexp(1.0f, -9)), 0x08);
  EXPECT_EQ(encodeE5M2(3.5f * std::ldexp(1.0f, -16)), 0x04);
  // fp32 subnormals and the smallest normals are far below FP8: zero, sign kept.
  EXPECT_EQ(encodeE4M3(std::numeric_limits<float>::denorm_min()), 0x00);
  EXPECT_EQ(encodeE4M3(-std::numeric_limits<float>::min()), 0x80);
  EXPECT_EQ(encodeE4M3(-0.0f), 0x80);
  // Saturation (TE's SATFINITE): beyond max, the midpoint to the next binade, infinities.
  EXPECT_EQ(encodeE4M3(449.0f), 0x7E);
  EXPECT_EQ(encodeE4M3(464.0f), 0x7E);
  EXPECT_EQ(encodeE4M3(1e30f), 0x7E);
  EXPECT_EQ(encodeE4M3(INFINITY), 0x7E);
  EXPECT_EQ(encodeE4M3(-INFINITY), 0xFE);
  EXPECT_EQ(encodeE5M2(61440.0f), 0x7B);
  EXPECT_EQ(encodeE5M2(INFINITY), 0x7B);
  EXPECT_EQ(encodeE5M2(-1e38f), 0xFB);
  // NaN stays NaN through a round trip.
  EXPECT_TRUE(std::isnan(decodeE4M3(encodeE4M3(NAN))));
  EXPECT_TRUE(std::isnan(decodeE5M2(encodeE5M2(NAN))));
  EXPECT_TRUE(std::isnan(quantize(Format::E4M3, NAN, 2.0f, 0.5f)));
}

TEST(Fp8Cast, EveryCodeRoundTrips) {
  for (Format f : {Format::E4M3, Format::E5M2})
    for (int c = 0; c < 256; ++c) {
      if (isNanCode(f, c) || (f == Format::E5M2 && (c & 0x7F) == 0x7C)) continue;
      EXPECT_EQ(int(encode(f, decode(f, std::uint8_t(c)))), c);
    }
}

TEST(Fp8Cast, EncoderMatchesNearestCodeSearch) {
  std::mt19937 rng(1234);
  std::uniform_real_distribution<float> mant(1.0f, 2.0f);
  std::uniform_int_distribution<int> expo(-22, 18);
  for (Format f : {Format::E4M3, Format::E5M2}) {
    for (int i = 0; i < 40000; ++i) {
      float x = std::ldexp(mant(rng), expo(rng));
      if (i & 1) x = -x;
      ASSERT_EQ(int(encode(f, x)), nearestCode(f, x)) << "x = " << x;
    }
    // Every midpoint between neighbouring codes, and its neighbours one ulp away.
    for (int c = 0; c < 0x7E; ++c) {
      if (isNanCode(f, c + 1) || (f == Format::E5M2 && c + 1 >= 0x7C)) break;
      const float mid = float((definedValue(f, c) + definedValue(f, c + 1)) / 2);
      for (float x : {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e9f)})
        ASSERT_EQ(int(encode(f, x)), nearestCode(f, x)) << "x = " << x;
    }
  }
}

TEST(Fp8Cast, DeviceKernelMatchesHost) {
  const std::int64_t n = 4096;
  plm::View2<float> x("x", 64, n / 64), y("y", 64, n / 64);
  auto h = Kokkos::create_mirror_view(x);
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  for (std::int64_t i = 0; i < n; ++i)
    h.data()[i] = normal(rng) * std::ldexp(1.0f, int(i % 30) - 15);
  h.data()[5] = NAN;
  h.data()[6] = INFINITY;
  Kokkos::deep_copy(x, h);
  for (Format f : {Format::E4M3, Format::E5M2}) {
    plm::model::fp8QuantizeTensor(plm::ExecSpace(), x, y, f, 4.0f, 0.25f);
    auto hy = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), y);
    for (std::int64_t i = 0; i < n; ++i) {
      const float want = decode(f, std::uint8_t(nearestCode(f, h.data()[i] * 4.0f))) * 0.25f;
      if (std::isnan(want))
        EXPECT_TRUE(std::isnan(hy.data()[i]));
      else
        ASSERT_EQ(hy.data()[i], want) << i;
    }
  }
}

}  // namespace
