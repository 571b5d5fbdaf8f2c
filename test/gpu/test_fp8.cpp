// FP8 casts and GEMMs (src/gpu/fp8.cu, gemm.cu) against host references.
//
// The host encoder is deliberately written another way than the kernels: it decodes all 256
// codes of a format and picks the nearest finite one by binary search over the (monotone)
// non-negative codes, ties to the even code, saturating beyond the largest.  Casts must match it
// bit for bit (NaN by class: the hardware's NaN code is printed, not asserted), their amaxes
// exactly, their scale factors bit for bit.  GEMMs are compared with an fp64 product of the
// same FP8 codes times the same scale_inv values the GEMM reads (so only the accumulation
// differs), through the three GEMMs of a Linear layer in the layouts the casts produce.
#include "gpu/fp8.hpp"
#include "gpu/gemm.hpp"
#include "gpu/layer_norm.hpp"
#include "gpu_test_util.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdio>
#include <limits>
#include <string>

namespace plm::gpu {
namespace {

using test::DeviceBuffer;

// ---------------------------------------------------------------------------------------------
// Host reference

struct Fp8Table {
  DType format;
  std::vector<double> value;     // value of each code 0..255 (NaN where NaN, inf where inf)
  std::uint8_t max_code;         // largest finite positive code
  std::vector<double> positive;  // value of codes 0..max_code (increasing)

  explicit Fp8Table(DType f) : format(f), value(256) {
    const bool e4m3 = f == DType::E4M3;
    const int mant = e4m3 ? 3 : 2, bias = e4m3 ? 7 : 15;
    for (int c = 0; c < 256; ++c) {
      const int sign = c >> 7, exp = (c >> mant) & (e4m3 ? 0xF : 0x1F), man = c & ((1 << mant) - 1);
      double v;
      if (e4m3 && exp == 0xF && man == 7)
        v = std::numeric_limits<double>::quiet_NaN();
      else if (!e4m3 && exp == 0x1F)
        v = man == 0 ? std::numeric_limits<double>::infinity()
                     : std::numeric_limits<double>::quiet_NaN();
      else if (exp == 0)
        v = std::ldexp(static_cast<double>(man), 1 - bias - mant);
      else
        v = std::ldexp(static_cast<double>((1 << mant) + man), exp - bias - mant);
      value[c] = sign ? -v : v;
    }
    max_code = e4m3 ? 0x7E : 0x7B;
    positive.assign(value.begin(), value.begin() + max_code + 1);
  }
  bool isNan(std::uint8_t c) const { return std::isnan(value[c]); }

  // Nearest code, ties to even, saturating; NaN -> 0x7F.
  std::uint8_t encode(float x) const {
    if (std::isnan(x)) return 0x7F;
    const std::uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
    const double a = std::fabs(static_cast<double>(x));
    if (a >= positive.back()) return sign | max_code;
    auto it = std::lower_bound(positive.begin(), positive.end(), a);
    std::size_t hi = it - positive.begin();
    if (positive[hi] == a) return sign | static_cast<std::uint8_t>(hi);
    const std::size_t lo = hi - 1;
    const double dlo = a - positive[lo], dhi = positive[hi] - a;
    std::size_t pick = dlo < dhi ? lo : dhi < dlo ? hi : (lo % 2 == 0 ? lo : hi);
    return sign | static_cast<std::uint8_t>(pick);
  }
  double decode(std::uint8_t c) const { return value[c]; }
};

const Fp8Table& table(DType f) {
  static const Fp8Table e4m3(DType::E4M3), e5m2(DType::E5M2);
  return f == DType::E4M3 ? e4m3 : e5m2;
}

float hostFp8Max(DType f) { return f == DType::E4M3 ? 448.0f : 57344.0f; }

// Transformer Engine's power-of-two block scale (fp8.hpp).
float hostPow2Scale(float amax, DType f) {
  if (amax == 0.0f || !std::isfinite(amax)) return 1.0f;
  const float s = hostFp8Max(f) / amax;
  if (std::isinf(s)) return 0x1p127f;
  std::uint32_t u;
  std::memcpy(&u, &s, 4);
  u &= 0xff800000u;
  float r;
  std::memcpy(&r, &u, 4);
  return r;
}

std::string name(DType t) {
  return t == DType::E4M3 ? "e4m3" : t == DType::E5M2 ? "e5m2" : t == DType::BF16 ? "bf16" : "f32";
}

// An input tensor on the device in bf16 or fp32, with the exact values it holds on the host.
struct Input {
  std::vector<float> values;  // (rows, ld) as the device holds them (rounded to bf16 if bf16)
  DeviceBuffer<std::uint16_t> bf16;
  DeviceBuffer<float> f32;
  DType type;
  Input(const std::vector<float>& v, DType t) : values(v), bf16(v.size()), f32(v.size()), type(t) {
    if (t == DType::BF16) {
      std::vector<std::uint16_t> bits(v.size());
      for (std::size_t i = 0; i < v.size(); ++i) {
        bits[i] = test::toBf16Bits(v[i]);
        values[i] = test::fromBf16Bits(bits[i]);
      }
      bf16.upload(bits);
    } else {
      f32.upload(v);
    }
  }
  const void* get() const {
    return type == DType::BF16 ? static_cast<const void*>(bf16.get())
                               : static_cast<const void*>(f32.get());
  }
};

float downloadScalar(const DeviceBuffer<float>& b) { return b.download()[0]; }

// Column sums (over rows) of a (rows, cols) tensor with row stride ld, in double.
std::vector<double> columnSums(const std::vector<float>& v, std::int64_t rows, std::int64_t cols,
                               std::int64_t ld) {
  std::vector<double> s(cols, 0.0);
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c) s[c] += v[r * ld + c];
  return s;
}

// The column sums as the casts add them up in fp32 (a fixed order, fp8.hpp), so that they can be
// compared bit for bit: a tile of `tile_rows` rows is split into runs of rows, each summed in
// order from +0, then the runs in order; per-tensor casts: 64-row tiles, 16 runs (run k: rows
// k, k + 16, k + 32, k + 48); block casts: 128-row tiles, 8 runs (run w: rows 16w..16w+15).
// Rows past the tensor add +0.  The tiles' partials are then added as the cast's final pass
// does: 16 contiguous ranges of tiles, each in order from +0, then the ranges in order.
std::vector<float> exactColumnSums(const std::vector<float>& v, std::int64_t rows,
                                   std::int64_t cols, std::int64_t ld, bool block) {
  const std::int64_t tile_rows = block ? 128 : 64, runs = block ? 8 : 16;
  const std::int64_t per_run = tile_rows / runs, tiles = (rows + tile_rows - 1) / tile_rows;
  auto at = [&](std::int64_t r, std::int64_t c) { return r < rows ? v[r * ld + c] : 0.0f; };
  std::vector<float> out(cols);
  for (std::int64_t c = 0; c < cols; ++c) {
    std::vector<float> partial(tiles);
    for (std::int64_t t = 0; t < tiles; ++t) {
      float tile_sum = 0.0f;
      for (std::int64_t k = 0; k < runs; ++k) {
        float run = 0.0f;
        for (std::int64_t i = 0; i < per_run; ++i)
          run += at(t * tile_rows + (block ? k * per_run + i : k + runs * i), c);
        tile_sum += run;
      }
      partial[t] = tile_sum;
    }
    const std::int64_t parts = 16, per = (tiles + parts - 1) / parts;
    float total = 0.0f;
    for (std::int64_t k = 0; k < parts; ++k) {
      float part = 0.0f;
      for (std::int64_t t = k * per; t < std::min(tiles, (k + 1) * per); ++t) part += partial[t];
      total += part;
    }
    out[c] = total;
  }
  return out;
}

float maxAbs(const std::vector<float>& v, std::int64_t rows, std::int64_t cols, std::int64_t ld) {
  float m = 0.0f;
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c) m = std::max(m, std::fabs(v[r * ld + c]));
  return m;
}

// Codes of a (rows, cols) cast with per-tensor scale, compared bit for bit with the host.
void expectCodes(const std::vector<std::uint8_t>& got, std::int64_t ld_got, bool transposed,
                 const std::vector<float>& in, std::int64_t rows, std::int64_t cols,
                 std::int64_t ld_in, DType f, float scale, const std::string& what) {
  const Fp8Table& t = table(f);
  int bad = 0;
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c) {
      const std::uint8_t want = t.encode(in[r * ld_in + c] * scale);
      const std::uint8_t have = transposed ? got[c * ld_got + r] : got[r * ld_got + c];
      const bool ok = t.isNan(want) ? t.isNan(have) : have == want;
      if (!ok && ++bad <= 5)
        ADD_FAILURE() << what << ": (" << r << "," << c << ") x=" << in[r * ld_in + c]
                      << " scale=" << scale << " code 0x" << std::hex << int(have) << " expected 0x"
                      << int(want) << std::dec;
    }
  EXPECT_EQ(bad, 0) << what;
}

// ---------------------------------------------------------------------------------------------
// Casts

// Every code's value, every midpoint between neighbours (ties to even), one ulp either side of
// the midpoints, the saturation boundary, beyond it, infinities, zeros, fp32 subnormals: scale 1,
// bit for bit.  The same values in bf16 where bf16 holds them exactly (all of these do except
// the one-ulp neighbours, which bf16 rounds; they are checked against what bf16 holds).
TEST(Fp8Cast, ExactValueTable) {
  for (DType f : {DType::E4M3, DType::E5M2}) {
    const Fp8Table& t = table(f);
    std::vector<float> v;
    for (std::size_t i = 0; i < t.positive.size(); ++i) {
      const float a = static_cast<float>(t.positive[i]);
      v.push_back(a);
      v.push_back(-a);
      if (i + 1 < t.positive.size()) {
        const float mid = static_cast<float>((t.positive[i] + t.positive[i + 1]) / 2);
        v.push_back(mid);
        v.push_back(-mid);
        v.push_back(std::nextafter(mid, 0.0f));
        v.push_back(std::nextafter(mid, 1e30f));
      }
    }
    const float mx = hostFp8Max(f);
    for (float x : {mx * 1.0625f, std::nextafter(mx, 1e30f), mx * 2.0f, 1e30f, -1e30f,
                    std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                    0.0f, -0.0f, 1e-40f, -1e-40f, std::numeric_limits<float>::min()})
      v.push_back(x);
    // Half the smallest subnormal rounds to 0 (tie to even), just above it to the subnormal.
    const float half_min = static_cast<float>(t.positive[1] / 2);
    v.push_back(half_min);
    v.push_back(std::nextafter(half_min, 1.0f));
    const std::int64_t cols = static_cast<std::int64_t>(v.size());
    for (DType in_type : {DType::F32, DType::BF16}) {
      Input in(v, in_type);
      DeviceBuffer<std::uint8_t> out(cols), out_t(cols);
      DeviceBuffer<float> scale(std::vector<float>{1.0f}), scale_inv(1), amax(1);
      out.poison();
      out_t.poison();
      Fp8CastArgs a;
      a.rows = 1;
      a.cols = cols;
      a.in = in.get();
      a.in_type = in_type;
      a.ld_in = cols;
      a.out_type = f;
      a.out = out.get();
      a.ld_out = cols;
      a.out_t = out_t.get();
      a.ld_out_t = 1;
      a.scale = scale.get();
      a.scale_inv = scale_inv.get();
      a.amax = amax.get();
      castFp8(nullptr, a);
      const std::string what = "table " + name(f) + " from " + name(in_type);
      expectCodes(out.download(), cols, false, in.values, 1, cols, cols, f, 1.0f, what);
      expectCodes(out_t.download(), 1, true, in.values, 1, cols, cols, f, 1.0f, what + " (t)");
      EXPECT_EQ(downloadScalar(scale_inv), 1.0f);
      EXPECT_EQ(downloadScalar(amax), std::numeric_limits<float>::infinity()) << what;
    }
  }
}

// NaN stays NaN and makes the amax NaN (so a non-finite tensor shows in its amax).
TEST(Fp8Cast, NanPropagates) {
  for (DType f : {DType::E4M3, DType::E5M2}) {
    std::vector<float> v = {1.0f, std::numeric_limits<float>::quiet_NaN(), -2.0f,
                            -std::numeric_limits<float>::quiet_NaN()};
    Input in(v, DType::F32);
    DeviceBuffer<std::uint8_t> out(4);
    DeviceBuffer<float> scale(std::vector<float>{1.0f}), amax(1);
    Fp8CastArgs a;
    a.rows = 1;
    a.cols = 4;
    a.in = in.get();
    a.in_type = DType::F32;
    a.ld_in = 4;
    a.out_type = f;
    a.out = out.get();
    a.ld_out = 4;
    a.scale = scale.get();
    a.amax = amax.get();
    castFp8(nullptr, a);
    auto codes = out.download();
    EXPECT_TRUE(table(f).isNan(codes[1])) << name(f);
    EXPECT_TRUE(table(f).isNan(codes[3])) << name(f);
    EXPECT_EQ(codes[0], table(f).encode(1.0f));
    EXPECT_EQ(codes[2], table(f).encode(-2.0f));
    std::printf("[ info ] %s NaN codes from +NaN/-NaN: 0x%02x 0x%02x\n", name(f).c_str(), codes[1],
                codes[3]);
    EXPECT_TRUE(std::isnan(downloadScalar(amax))) << name(f);
  }
}

struct CastCase {
  std::int64_t rows, cols, ld_pad;  // ld_in = cols + ld_pad
  DType in_type, out_type;
  bool transpose, rowwise;  // which copies are written
  // The training layouts: codes with row stride cols, the transposed codes with their rows (the
  // tokens) padded to 16 (the kernel's 8- and 16-code stores); else odd strides (cols + 16,
  // rows + 8).
  bool training_layout = false;
};

std::string castName(const ::testing::TestParamInfo<CastCase>& i) {
  const CastCase& c = i.param;
  return std::to_string(c.rows) + "x" + std::to_string(c.cols) + "_" + name(c.in_type) + "_" +
         name(c.out_type) + (c.rowwise ? "_rows" : "") + (c.transpose ? "_t" : "") +
         (c.training_layout ? "_pad16" : "");
}

class Fp8CastShapes : public ::testing::TestWithParam<CastCase> {};

// Delayed scaling (the scale read from the device), then current scaling, then the amax
// accumulated over two tensors; shapes that are not multiples of the 64x128 tile or of 8 or 16
// (the byte-wise edge paths), a row stride wider than the row; the column sums bit for bit in
// the cast's order.
TEST_P(Fp8CastShapes, PerTensorDelayedAndCurrent) {
  const CastCase c = GetParam();
  const std::int64_t ld_in = c.cols + c.ld_pad;
  const std::int64_t ld_out = c.training_layout ? c.cols : c.cols + 16;
  const std::int64_t ld_t = c.training_layout ? (c.rows + 15) / 16 * 16 : c.rows + 8;
  std::vector<float> host = test::randomNormal(c.rows * ld_in, 77 + c.rows + c.cols, 3.0f);
  Input in(host, c.in_type);
  DeviceBuffer<std::uint8_t> out(c.rows * ld_out), out_t(c.cols * ld_t);
  const float delayed = 37.3f;  // not a power of two: x * scale rounds in fp32 like the host
  DeviceBuffer<float> scale(std::vector<float>{delayed}), scale_inv(1), amax(1);
  out.poison();
  out_t.poison();
  Fp8CastArgs a;
  a.rows = c.rows;
  a.cols = c.cols;
  a.in = in.get();
  a.in_type = c.in_type;
  a.ld_in = ld_in;
  a.out_type = c.out_type;
  a.out = c.rowwise ? out.get() : nullptr;
  a.ld_out = ld_out;
  a.out_t = c.transpose ? out_t.get() : nullptr;
  a.ld_out_t = ld_t;
  a.scale = scale.get();
  a.scale_inv = scale_inv.get();
  a.amax = amax.get();
  // The bias gradient's column sums, fused (e.g. of dY); poisoned first.
  DeviceBuffer<float> col_sum(c.cols);
  DeviceBuffer<std::uint8_t> work(fp8ColSumWorkspace(c.rows, c.cols));
  col_sum.poison();
  a.col_sum = col_sum.get();
  a.workspace = work.get();
  castFp8(nullptr, a);
  const float amax_host = maxAbs(in.values, c.rows, c.cols, ld_in);
  const std::vector<double> sums = columnSums(in.values, c.rows, c.cols, ld_in);
  const std::vector<float> sums_dev = col_sum.download();
  EXPECT_LT(test::relError(sums_dev, sums), 1e-5);
  EXPECT_EQ(sums_dev, exactColumnSums(in.values, c.rows, c.cols, ld_in, false));
  EXPECT_EQ(downloadScalar(amax), amax_host);
  EXPECT_EQ(downloadScalar(scale_inv), 1.0f / delayed);
  if (c.rowwise)
    expectCodes(out.download(), ld_out, false, in.values, c.rows, c.cols, ld_in, c.out_type,
                delayed, "delayed");
  if (c.transpose)
    expectCodes(out_t.download(), ld_t, true, in.values, c.rows, c.cols, ld_in, c.out_type, delayed,
                "delayed (t)");

  // Current scaling with a margin of 1.
  DeviceBuffer<float> cur_scale(1);
  out.poison();
  out_t.poison();
  castFp8Current(nullptr, a, cur_scale.get(), 1);
  const float want_scale = std::ldexp(hostFp8Max(c.out_type) / amax_host, -1);
  EXPECT_EQ(downloadScalar(cur_scale), want_scale);
  EXPECT_EQ(downloadScalar(scale_inv), 1.0f / want_scale);
  EXPECT_EQ(downloadScalar(amax), amax_host);
  EXPECT_EQ(col_sum.download(), sums_dev);  // the same order of summation: the same bits
  if (c.rowwise)
    expectCodes(out.download(), ld_out, false, in.values, c.rows, c.cols, ld_in, c.out_type,
                want_scale, "current");
  if (c.transpose)
    expectCodes(out_t.download(), ld_t, true, in.values, c.rows, c.cols, ld_in, c.out_type,
                want_scale, "current (t)");

  // amax accumulated over this tensor and a larger one, and amaxFp8 alone.
  std::vector<float> big = host;
  big[0] = 1000.0f;
  Input in2(big, c.in_type);
  a.amax_accumulate = true;
  a.col_sum_accumulate = true;
  a.in = in2.get();
  castFp8(nullptr, a);
  EXPECT_EQ(downloadScalar(amax), std::max(amax_host, in2.values[0]));
  std::vector<double> sums2 = columnSums(in2.values, c.rows, c.cols, ld_in);
  for (std::int64_t j = 0; j < c.cols; ++j) sums2[j] += sums[j];
  EXPECT_LT(test::relError(col_sum.download(), sums2), 1e-5);
  amaxFp8(nullptr, in.get(), c.in_type, c.rows, c.cols, ld_in, amax.get());
  EXPECT_EQ(downloadScalar(amax), amax_host);
  amaxFp8(nullptr, in2.get(), c.in_type, c.rows, c.cols, ld_in, amax.get(), true);
  EXPECT_EQ(downloadScalar(amax), std::max(amax_host, in2.values[0]));
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, Fp8CastShapes,
    ::testing::Values(CastCase{1, 1, 0, DType::F32, DType::E4M3, true, true},
                      CastCase{3, 5, 3, DType::BF16, DType::E5M2, true, true},
                      CastCase{67, 130, 6, DType::BF16, DType::E4M3, true, true},
                      CastCase{128, 256, 0, DType::BF16, DType::E4M3, true, true},
                      CastCase{256, 320, 8, DType::F32, DType::E5M2, true, true},
                      CastCase{200, 96, 0, DType::BF16, DType::E5M2, true, false},
                      CastCase{96, 200, 0, DType::F32, DType::E4M3, false, true},
                      CastCase{5, 3, 0, DType::BF16, DType::E4M3, true, true},
                      // Strides of 4 mod 8 (ld_in 132, ld_out 148, ld_t 76): the 8-byte loads
                      // and 4-code stores between the vector and the byte-wise paths.
                      CastCase{68, 132, 0, DType::BF16, DType::E5M2, true, true},
                      // The training layouts: T = 150 (not a multiple of 8, 16 or 64) x 1280,
                      // full row tiles in E5M2 (dY), fp32 with a partial column tile, and more
                      // tiles than the grid has blocks (each block casts several).
                      CastCase{150, 1280, 0, DType::BF16, DType::E4M3, true, true, true},
                      CastCase{256, 384, 0, DType::BF16, DType::E5M2, true, true, true},
                      CastCase{77, 200, 4, DType::F32, DType::E4M3, true, true, true},
                      CastCase{4100, 1280, 0, DType::BF16, DType::E5M2, true, true, true}),
    castName);

// amaxFp8 over contiguous tensors of every length class (16-byte chunks, the 1-7 elements after
// the last chunk, unaligned starts that take the strided path), the largest |x| placed first,
// in the middle and last: exact.
TEST(Fp8Cast, AmaxFindsEveryElement) {
  for (DType t : {DType::BF16, DType::F32}) {
    for (std::int64_t n : {1, 7, 8, 9, 4099, 1 << 20}) {
      for (std::int64_t offset : {0, 1}) {
        for (std::int64_t where : {std::int64_t(0), n / 2, n - 1}) {
          std::vector<float> host = test::randomNormal(n + offset, 13 + n + where, 1.0f);
          host[offset + where] = -1000.0f;
          Input in(host, t);
          const std::size_t bytes = t == DType::BF16 ? 2 : 4;
          const void* p = static_cast<const std::uint8_t*>(in.get()) + offset * bytes;
          DeviceBuffer<float> amax(1);
          amaxFp8(nullptr, p, t, 1, n, n, amax.get());
          EXPECT_EQ(downloadScalar(amax), 1000.0f)
              << name(t) << " n=" << n << " offset=" << offset << " at " << where;
          const std::int64_t rows = n % 3 == 0 ? 3 : 1;  // the same elements as (rows, n / rows)
          amaxFp8(nullptr, p, t, rows, n / rows, n / rows, amax.get());
          EXPECT_EQ(downloadScalar(amax), 1000.0f) << name(t) << " n=" << n << " (rows)";
        }
      }
    }
  }
}

TEST(Fp8Cast, ScaleFromAmaxEdgeCases) {
  // amax, margin, format -> expected scale
  struct Row {
    float amax;
    int margin;
    DType f;
    float scale;
  };
  const std::vector<Row> rows = {
      {0.0f, 0, DType::E4M3, 1.0f},
      {std::numeric_limits<float>::infinity(), 0, DType::E4M3, 1.0f},
      {std::numeric_limits<float>::quiet_NaN(), 0, DType::E5M2, 1.0f},
      {1e-45f, 0, DType::E5M2, FLT_MAX},  // 57344 / 1e-45 overflows
      {3.5f, 0, DType::E4M3, 448.0f / 3.5f},
      {3.5f, 2, DType::E4M3, 448.0f / 3.5f / 4.0f},
      {1000.0f, 0, DType::E5M2, 57344.0f / 1000.0f},
  };
  for (const Row& r : rows) {
    DeviceBuffer<float> amax(std::vector<float>{r.amax}), scale(1), scale_inv(1);
    scaleFromAmax(nullptr, amax.get(), r.f, r.margin, scale.get(), scale_inv.get());
    EXPECT_EQ(downloadScalar(scale), r.scale) << "amax " << r.amax << " margin " << r.margin;
    EXPECT_EQ(downloadScalar(scale_inv), 1.0f / r.scale);
  }
}

TEST(Fp8Cast, RefusesBadArguments) {
  Fp8CastArgs a;
  a.in_type = DType::E4M3;
  EXPECT_THROW(castFp8(nullptr, a), Error);
  a.in_type = DType::BF16;
  a.out_type = DType::BF16;
  EXPECT_THROW(castFp8(nullptr, a), Error);
  a.out_type = DType::E4M3;
  EXPECT_THROW(castFp8(nullptr, a), Error);  // no scale
  Fp8BlockCastArgs b;
  b.scaling = Fp8ScaleMode::Tensor;
  EXPECT_THROW(castFp8Block(nullptr, b), Error);
  b.scaling = Fp8ScaleMode::Block1x128;
  b.out = reinterpret_cast<void*>(16);  // no scale_inv
  EXPECT_THROW(castFp8Block(nullptr, b), Error);
  a.scale = reinterpret_cast<const float*>(16);
  a.rows = a.cols = 8;
  a.col_sum = reinterpret_cast<float*>(16);  // no workspace
  EXPECT_THROW(castFp8(nullptr, a), Error);
}

// Block scales on the host: for a (rows, k) operand, scale of each element's block.
struct HostBlock {
  std::vector<float> scale_inv;  // in blockScaleLayout's layout, padding 1
  std::vector<float> scale;      // per element (rows, k)
};

HostBlock hostBlockScales(const std::vector<float>& x, std::int64_t rows, std::int64_t k,
                          bool transposed_view, std::int64_t ld, Fp8ScaleMode s, DType f) {
  // Element (r, kk) of the operand is x[kk * ld + r] when transposed_view, else x[r * ld + kk].
  auto at = [&](std::int64_t r, std::int64_t kk) {
    return transposed_view ? x[kk * ld + r] : x[r * ld + kk];
  };
  const BlockScaleLayout layout = blockScaleLayout(s, rows, k);
  HostBlock h{std::vector<float>(layout.count, 1.0f), std::vector<float>(rows * k)};
  const std::int64_t kb = (k + 127) / 128, rb = (rows + 127) / 128;
  if (s == Fp8ScaleMode::Block1x128) {
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t b = 0; b < kb; ++b) {
        float m = 0.0f;
        for (std::int64_t kk = b * 128; kk < std::min(k, b * 128 + 128); ++kk)
          m = std::max(m, std::fabs(at(r, kk)));
        const float sc = hostPow2Scale(m, f);
        h.scale_inv[b * layout.ld + r] = 1.0f / sc;
        for (std::int64_t kk = b * 128; kk < std::min(k, b * 128 + 128); ++kk)
          h.scale[r * k + kk] = sc;
      }
  } else {
    for (std::int64_t br = 0; br < rb; ++br)
      for (std::int64_t b = 0; b < kb; ++b) {
        float m = 0.0f;
        for (std::int64_t r = br * 128; r < std::min(rows, br * 128 + 128); ++r)
          for (std::int64_t kk = b * 128; kk < std::min(k, b * 128 + 128); ++kk)
            m = std::max(m, std::fabs(at(r, kk)));
        const float sc = hostPow2Scale(m, f);
        h.scale_inv[br * layout.ld + b] = 1.0f / sc;
        for (std::int64_t r = br * 128; r < std::min(rows, br * 128 + 128); ++r)
          for (std::int64_t kk = b * 128; kk < std::min(k, b * 128 + 128); ++kk)
            h.scale[r * k + kk] = sc;
      }
  }
  return h;
}

struct BlockCase {
  std::int64_t rows, cols;
  DType in_type, out_type;
  Fp8ScaleMode scaling;
};

class Fp8BlockCast : public ::testing::TestWithParam<BlockCase> {};

// Both copies, bit for bit, and their scale_inv arrays (padding included) exactly.  Rows of
// the input get very different magnitudes so the blocks' scales differ.
TEST_P(Fp8BlockCast, MatchesHost) {
  const BlockCase c = GetParam();
  const std::int64_t ld_in = c.cols + 8, ld_out = c.cols + 16, ld_t = c.rows + 16;
  std::vector<float> host = test::randomNormal(c.rows * ld_in, 5 + c.rows * c.cols);
  for (std::int64_t r = 0; r < c.rows; ++r)
    for (std::int64_t j = 0; j < ld_in; ++j)
      host[r * ld_in + j] *= std::ldexp(1.0f, static_cast<int>((r * 7 + j / 50) % 23) - 11);
  host[0] = 0.0f;
  if (c.rows > 200) {  // an all-zero 1x128 block (scale 1)
    for (std::int64_t j = 0; j < std::min<std::int64_t>(128, c.cols); ++j)
      host[130 * ld_in + j] = 0.0f;
  }
  Input in(host, c.in_type);
  const BlockScaleLayout lay = blockScaleLayout(c.scaling, c.rows, c.cols);
  const BlockScaleLayout lay_t = blockScaleLayout(c.scaling, c.cols, c.rows);
  DeviceBuffer<std::uint8_t> out(c.rows * ld_out), out_t(c.cols * ld_t);
  DeviceBuffer<float> s(lay.count), s_t(lay_t.count), amax(1);
  out.poison();
  out_t.poison();
  s.poison();
  s_t.poison();
  Fp8BlockCastArgs a;
  a.rows = c.rows;
  a.cols = c.cols;
  a.in = in.get();
  a.in_type = c.in_type;
  a.ld_in = ld_in;
  a.out_type = c.out_type;
  a.scaling = c.scaling;
  a.out = out.get();
  a.ld_out = ld_out;
  a.scale_inv = s.get();
  a.out_t = out_t.get();
  a.ld_out_t = ld_t;
  a.scale_inv_t = s_t.get();
  a.amax = amax.get();
  DeviceBuffer<float> col_sum(c.cols);
  DeviceBuffer<std::uint8_t> work(fp8ColSumWorkspace(c.rows, c.cols));
  col_sum.poison();
  a.col_sum = col_sum.get();
  a.workspace = work.get();
  castFp8Block(nullptr, a);
  const std::vector<float> sums_dev = col_sum.download();
  EXPECT_LT(test::relError(sums_dev, columnSums(in.values, c.rows, c.cols, ld_in)), 1e-5);
  EXPECT_EQ(sums_dev, exactColumnSums(in.values, c.rows, c.cols, ld_in, true));

  const HostBlock hb =
      hostBlockScales(in.values, c.rows, c.cols, false, ld_in, c.scaling, c.out_type);
  const HostBlock hb_t =
      hostBlockScales(in.values, c.cols, c.rows, true, ld_in, c.scaling, c.out_type);
  EXPECT_EQ(s.download(), hb.scale_inv);
  EXPECT_EQ(s_t.download(), hb_t.scale_inv);
  EXPECT_EQ(downloadScalar(amax), maxAbs(in.values, c.rows, c.cols, ld_in));
  const Fp8Table& t = table(c.out_type);
  const auto codes = out.download(), codes_t = out_t.download();
  int bad = 0, bad_t = 0;
  for (std::int64_t r = 0; r < c.rows; ++r)
    for (std::int64_t j = 0; j < c.cols; ++j) {
      const float x = in.values[r * ld_in + j];
      if (codes[r * ld_out + j] != t.encode(x * hb.scale[r * c.cols + j])) ++bad;
      if (codes_t[j * ld_t + r] != t.encode(x * hb_t.scale[j * c.rows + r])) ++bad_t;
    }
  EXPECT_EQ(bad, 0);
  EXPECT_EQ(bad_t, 0);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, Fp8BlockCast,
    ::testing::Values(BlockCase{256, 384, DType::BF16, DType::E4M3, Fp8ScaleMode::Block1x128},
                      BlockCase{256, 384, DType::BF16, DType::E4M3, Fp8ScaleMode::Block128x128},
                      BlockCase{200, 300, DType::F32, DType::E4M3, Fp8ScaleMode::Block1x128},
                      BlockCase{200, 300, DType::F32, DType::E4M3, Fp8ScaleMode::Block128x128},
                      BlockCase{130, 9, DType::BF16, DType::E5M2, Fp8ScaleMode::Block1x128},
                      BlockCase{5, 700, DType::BF16, DType::E5M2, Fp8ScaleMode::Block128x128}),
    [](const ::testing::TestParamInfo<BlockCase>& i) {
      return std::to_string(i.param.rows) + "x" + std::to_string(i.param.cols) + "_" +
             name(i.param.in_type) + "_" + name(i.param.out_type) +
             (i.param.scaling == Fp8ScaleMode::Block1x128 ? "_1x128" : "_128x128");
    });

// ---------------------------------------------------------------------------------------------
// GEMMs

// One FP8 operand on the device, stored (rows, k) with row stride ld, with its scale_inv and the
// exact value of every element as the GEMM sees it (code value times scale_inv).
struct Operand {
  std::int64_t rows = 0, k = 0, ld = 0;
  DType type = DType::E4M3;
  Fp8ScaleMode scaling = Fp8ScaleMode::Tensor;
  std::unique_ptr<DeviceBuffer<std::uint8_t>> codes;
  std::unique_ptr<DeviceBuffer<float>> scale_inv;
  std::vector<double> value;  // (rows, k)
};

// Casts a bf16 (src_rows, src_cols) tensor and returns the operand the GEMM needs: the tensor
// itself (transposed = false: rows = src_rows, k = src_cols) or its transposed copy.
Operand makeOperand(const Input& src, std::int64_t src_rows, std::int64_t src_cols, bool transposed,
                    DType type, Fp8ScaleMode scaling, float per_tensor_scale) {
  Operand o;
  o.rows = transposed ? src_cols : src_rows;
  o.k = transposed ? src_rows : src_cols;
  o.ld = (o.k + 15) / 16 * 16;
  o.type = type;
  o.scaling = scaling;
  o.codes = std::make_unique<DeviceBuffer<std::uint8_t>>(o.rows * o.ld);
  const BlockScaleLayout lay = scaling == Fp8ScaleMode::Tensor
                                   ? BlockScaleLayout{1, 1}
                                   : blockScaleLayout(scaling, o.rows, o.k);
  o.scale_inv = std::make_unique<DeviceBuffer<float>>(lay.count);
  if (scaling == Fp8ScaleMode::Tensor) {
    DeviceBuffer<float> scale(std::vector<float>{per_tensor_scale});
    Fp8CastArgs a;
    a.rows = src_rows;
    a.cols = src_cols;
    a.in = src.get();
    a.in_type = src.type;
    a.ld_in = src_cols;
    a.out_type = type;
    (transposed ? a.out_t : a.out) = o.codes->get();
    (transposed ? a.ld_out_t : a.ld_out) = o.ld;
    a.scale = scale.get();
    a.scale_inv = o.scale_inv->get();
    castFp8(nullptr, a);
    PLM_CHECK_CUDA(cudaDeviceSynchronize());
  } else {
    // Only the copy the GEMM needs (a 1x128 transposed copy has its own blocks along its rows).
    Fp8BlockCastArgs a;
    a.rows = src_rows;
    a.cols = src_cols;
    a.in = src.get();
    a.in_type = src.type;
    a.ld_in = src_cols;
    a.out_type = type;
    a.scaling = scaling;
    if (transposed) {
      a.out_t = o.codes->get();
      a.ld_out_t = o.ld;
      a.scale_inv_t = o.scale_inv->get();
    } else {
      a.out = o.codes->get();
      a.ld_out = o.ld;
      a.scale_inv = o.scale_inv->get();
    }
    castFp8Block(nullptr, a);
  }
  const auto codes = o.codes->download();
  const auto sinv = o.scale_inv->download();
  const Fp8Table& t = table(type);
  o.value.resize(o.rows * o.k);
  for (std::int64_t r = 0; r < o.rows; ++r)
    for (std::int64_t kk = 0; kk < o.k; ++kk) {
      double s;
      if (scaling == Fp8ScaleMode::Tensor)
        s = sinv[0];
      else if (scaling == Fp8ScaleMode::Block1x128)
        s = sinv[(kk / 128) * lay.ld + r];
      else
        s = sinv[(r / 128) * lay.ld + kk / 128];
      o.value[r * o.k + kk] = t.decode(codes[r * o.ld + kk]) * s;
    }
  return o;
}

enum class LinearGemm { Forward, Dgrad, Wgrad };

struct GemmCase {
  const char* name;
  LinearGemm which;
  DType x_type, grad_type;          // FP8 formats of activations/weights and of gradients
  Fp8ScaleMode activation_scaling;  // Tensor or Block1x128 (weights: Tensor or Block128x128)
  DType d_type;
  Epilogue epilogue;  // None, Bias, BiasGeluAux (forward), DGelu (dgrad)
  bool accumulate, amax_d, fast_accum;
  bool optional = false;      // a combination cuBLASLt may not offer: skipped (with its message) if
                              // refused, checked like the others if it runs
  std::int64_t tokens = 384;  // T: wgrad's K (384 = 3 blocks of 128; 336 ends in a partial one)
};

double geluTanh(double x) {
  const double c = std::sqrt(2.0 / M_PI);
  return 0.5 * x * (1.0 + std::tanh(c * (x + 0.044715 * x * x * x)));
}
double geluTanhGrad(double x) {
  const double c = std::sqrt(2.0 / M_PI);
  const double t = std::tanh(c * (x + 0.044715 * x * x * x));
  return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * c * (1.0 + 3.0 * 0.044715 * x * x);
}

class Fp8Gemm : public ::testing::TestWithParam<GemmCase> {};

// A Linear layer Y (T,out) = X (T,in) W^T with W (out,in), and its gradients: every GEMM from
// the casts' outputs as the model will wire them, against fp64 of the same FP8 values; the GPU
// reference kernel against the same; and the result against the unquantised bf16 product
// (loosely: FP8's own rounding) so that self-consistent but wrong scales cannot pass.
TEST_P(Fp8Gemm, LinearLayerLayout) {
  const GemmCase c = GetParam();
  const std::int64_t T = c.tokens, in_f = 256, out_f = 640;
  const bool block = c.activation_scaling != Fp8ScaleMode::Tensor;
  const Fp8ScaleMode w_scaling = block ? Fp8ScaleMode::Block128x128 : Fp8ScaleMode::Tensor;
  Input x(test::randomNormal(T * in_f, 11, 2.0f), DType::BF16);
  Input w(test::randomNormal(out_f * in_f, 12, 0.05f), DType::BF16);
  Input dy(test::randomNormal(T * out_f, 13, 1e-3f), DType::BF16);
  const std::vector<float> bias_values = test::randomNormal(out_f, 14);
  test::Bf16Tensor bias(bias_values);

  // Per-tensor scales as delayed scaling would have them: fp8_max / amax, rounded down a bit.
  auto tensorScale = [](const Input& t, DType f) {
    float m = 0.0f;
    for (float v : t.values) m = std::max(m, std::fabs(v));
    return hostFp8Max(f) / m * 0.75f;
  };
  Operand A, B;
  std::int64_t M = 0, N = 0, K = 0;
  const std::vector<float>* exact_a = nullptr;  // unquantised, for the loose check
  const std::vector<float>* exact_b = nullptr;
  bool exact_a_t = false, exact_b_t = false;
  switch (c.which) {
    case LinearGemm::Forward:  // Y = X W^T: A = X (T,in), B = W (out,in)
      M = T, N = out_f, K = in_f;
      A = makeOperand(x, T, in_f, false, c.x_type, c.activation_scaling, tensorScale(x, c.x_type));
      B = makeOperand(w, out_f, in_f, false, c.x_type, w_scaling, tensorScale(w, c.x_type));
      exact_a = &x.values, exact_b = &w.values;
      break;
    case LinearGemm::Dgrad:  // dX = dY W: A = dY (T,out), B = W^T (in,out)
      M = T, N = in_f, K = out_f;
      A = makeOperand(dy, T, out_f, false, c.grad_type, c.activation_scaling,
                      tensorScale(dy, c.grad_type));
      B = makeOperand(w, out_f, in_f, true, c.x_type, w_scaling, tensorScale(w, c.x_type));
      exact_a = &dy.values, exact_b = &w.values, exact_b_t = true;
      break;
    case LinearGemm::Wgrad:  // dW = dY^T X: A = dY^T (out,T), B = X^T (in,T)
      M = out_f, N = in_f, K = T;
      A = makeOperand(dy, T, out_f, true, c.grad_type, c.activation_scaling,
                      tensorScale(dy, c.grad_type));
      B = makeOperand(x, T, in_f, true, c.x_type, c.activation_scaling, tensorScale(x, c.x_type));
      exact_a = &dy.values, exact_b = &x.values, exact_a_t = exact_b_t = true;
      break;
  }
  ASSERT_EQ(A.k, K);
  ASSERT_EQ(B.k, K);

  const std::vector<float> d0 = test::randomNormal(M * N, 15);
  GemmArgs g;
  g.trans_a = false;
  g.trans_b = true;
  g.m = M;
  g.n = N;
  g.k = K;
  g.a = A.codes->get();
  g.lda = A.ld;
  g.a_type = A.type;
  g.b = B.codes->get();
  g.ldb = B.ld;
  g.b_type = B.type;
  g.a_scale_inv = A.scale_inv->get();
  g.b_scale_inv = B.scale_inv->get();
  g.a_scaling = A.scaling;
  g.b_scaling = B.scaling;
  g.ldd = N;
  g.d_type = c.d_type;
  g.alpha = 1.0f;
  g.beta = c.accumulate ? 1.0f : 0.0f;
  g.epilogue = c.epilogue;
  g.bias = bias.get();
  g.ldaux = N;
  g.fast_accum = c.fast_accum;
  test::Bf16Tensor aux_in(test::randomNormal(M * N, 16));  // DGelu's pre-activation

  std::string refused;
  auto run = [&](bool reference, std::vector<float>& d_out, std::vector<float>& aux_out,
                 float& amax_out, bool& by_cublas) {
    DeviceBuffer<float> d32(M * N);
    DeviceBuffer<std::uint16_t> d16(M * N), aux(M * N);
    DeviceBuffer<float> amax(1);
    if (c.epilogue == Epilogue::DGelu)
      PLM_CHECK_CUDA(cudaMemcpy(aux.get(), aux_in.get(), M * N * 2, cudaMemcpyDeviceToDevice));
    else
      aux.poison();
    g.aux = aux.get();
    if (c.accumulate) {
      d32.upload(d0);
      test::Bf16Tensor tmp(d0);
      PLM_CHECK_CUDA(cudaMemcpy(d16.get(), tmp.get(), M * N * 2, cudaMemcpyDeviceToDevice));
    } else {
      d32.poison();
      d16.poison();
    }
    amax.poison();
    g.d = c.d_type == DType::F32 ? static_cast<void*>(d32.get()) : static_cast<void*>(d16.get());
    g.amax_d = c.amax_d ? amax.get() : nullptr;
    if (reference) {
      gemmReference(nullptr, g);
    } else {
      Gemm gemm;
      try {
        gemm.run(nullptr, g);
      } catch (const Error& e) {
        if (!c.optional) throw;
        refused = e.what();
        return;
      }
      if (c.amax_d) by_cublas = gemm.amaxFromCublas(g);
      EXPECT_EQ(gemm.numPlans(), 1u);
    }
    d_out = c.d_type == DType::F32 ? d32.download() : test::downloadBf16(d16);
    aux_out = test::downloadBf16(aux);
    amax_out = c.amax_d ? amax.download()[0] : 0.0f;
  };
  std::vector<float> d_lt, d_ref, aux_lt, aux_ref;
  float amax_lt = 0, amax_ref = 0;
  bool by_cublas = false, unused = false;
  run(false, d_lt, aux_lt, amax_lt, by_cublas);
  if (!refused.empty()) GTEST_SKIP() << c.name << ": cuBLASLt refuses it here: " << refused;
  run(true, d_ref, aux_ref, amax_ref, unused);

  // fp64 from the same FP8 values.
  std::vector<double> host(M * N), exact(M * N), aux_host(M * N);
  for (std::int64_t i = 0; i < M; ++i)
    for (std::int64_t j = 0; j < N; ++j) {
      double s = 0.0, e = 0.0;
      for (std::int64_t kk = 0; kk < K; ++kk) {
        s += A.value[i * K + kk] * B.value[j * K + kk];
        const double ea = exact_a_t ? (*exact_a)[kk * M + i] : (*exact_a)[i * K + kk];
        const double eb = exact_b_t ? (*exact_b)[kk * N + j] : (*exact_b)[j * K + kk];
        e += ea * eb;
      }
      double extra = 0.0;
      if (c.accumulate)
        extra += c.d_type == DType::F32 ? d0[i * N + j] : test::roundBf16(d0[i * N + j]);
      if (c.epilogue == Epilogue::Bias || c.epilogue == Epilogue::BiasGeluAux)
        extra += test::roundBf16(bias_values[j]);
      host[i * N + j] = s + extra;
      exact[i * N + j] = e + extra;
      if (c.epilogue == Epilogue::BiasGeluAux) {
        aux_host[i * N + j] = host[i * N + j];
        host[i * N + j] = geluTanh(host[i * N + j]);
        exact[i * N + j] = geluTanh(exact[i * N + j]);
      }
      if (c.epilogue == Epilogue::DGelu) {
        const double d = geluTanhGrad(aux_in.values[i * N + j]);
        host[i * N + j] *= d;
        exact[i * N + j] *= d;
      }
    }
  if (c.epilogue == Epilogue::BiasGeluAux) {
    EXPECT_LT(test::relError(aux_lt, aux_host), 1e-2) << c.name << " (aux)";
    EXPECT_LT(test::relError(aux_ref, aux_host), 1e-2) << c.name << " (reference aux)";
  }
  const double tol = c.d_type == DType::BF16 ? 1e-2 : c.fast_accum ? 2e-3 : 2e-4;
  const double err = test::relError(d_lt, host);
  std::printf(
      "[ info ] %s: cuBLASLt vs fp64 of the FP8 values %.3g, reference kernel %.3g, vs "
      "unquantised %.3g%s\n",
      c.name, err, test::relError(d_ref, host), test::relError(d_lt, exact),
      c.amax_d ? (by_cublas ? " (amax_d by cuBLASLt)" : " (amax_d by a pass over D)") : "");
  EXPECT_LT(err, tol) << c.name;
  EXPECT_LT(test::relError(d_ref, host), c.d_type == DType::BF16 ? 1e-2 : 1e-5) << c.name;
  // FP8 rounding of both operands: RMS ~2.7% (E4M3) and ~5.4% (E5M2) relative per element, so
  // ~4% and ~6% for the product; scales that are wrong (a layout mismatch) give O(1).
  const bool e5m2 = A.type == DType::E5M2 || B.type == DType::E5M2;
  EXPECT_LT(test::relError(d_lt, exact), e5m2 ? 0.2 : 0.1) << c.name;
  if (c.amax_d) {
    const float want = maxAbs(d_lt, M, N, N);
    if (by_cublas)
      EXPECT_NEAR(amax_lt, want, want * 8e-3) << c.name;  // before D's rounding to bf16
    else
      EXPECT_EQ(amax_lt, want) << c.name;
    EXPECT_EQ(amax_ref, maxAbs(d_ref, M, N, N)) << c.name;
  }

  // The same GEMM under train.gemm_autotune (memory only): the fastest of cuBLASLt's candidates
  // that agrees with its first choice, within the same bound of the fp64 product.
  setGemmAutotune(true);
  std::vector<float> d_tuned, aux_tuned;
  float amax_tuned = 0;
  bool tuned_by_cublas = false;
  run(false, d_tuned, aux_tuned, amax_tuned, tuned_by_cublas);
  setGemmAutotune(false);
  EXPECT_LT(test::relError(d_tuned, host), tol) << c.name << " (autotuned)";
  if (c.amax_d) {
    const float want = maxAbs(d_tuned, M, N, N);
    EXPECT_NEAR(amax_tuned, want, tuned_by_cublas ? want * 8e-3 : 0.0) << c.name << " (autotuned)";
  }
}

constexpr DType E4 = DType::E4M3, E5 = DType::E5M2, BF = DType::BF16, F32 = DType::F32;
constexpr Fp8ScaleMode PT = Fp8ScaleMode::Tensor, B1 = Fp8ScaleMode::Block1x128;

INSTANTIATE_TEST_SUITE_P(
    Layouts, Fp8Gemm,
    ::testing::Values(
        // Per-tensor (delayed/current scaling), E4M3 x E4M3 and the hybrid E5M2 gradients.
        GemmCase{"fwd_e4m3_bias_bf16", LinearGemm::Forward, E4, E4, PT, BF, Epilogue::Bias, false,
                 false, false},
        GemmCase{"fwd_e4m3_fastaccum_amax", LinearGemm::Forward, E4, E4, PT, BF, Epilogue::Bias,
                 false, true, true},
        GemmCase{"dgrad_e4m3", LinearGemm::Dgrad, E4, E4, PT, BF, Epilogue::None, false, false,
                 false},
        GemmCase{"dgrad_e5m2_grad_residual_f32", LinearGemm::Dgrad, E4, E5, PT, F32, Epilogue::None,
                 true, false, false},
        GemmCase{"wgrad_e4m3_accumulate_f32", LinearGemm::Wgrad, E4, E4, PT, F32, Epilogue::None,
                 true, false, false},
        GemmCase{"wgrad_e5m2_grad_f32", LinearGemm::Wgrad, E4, E5, PT, F32, Epilogue::None, false,
                 true, false},
        // The FFN's fused epilogues in FP8 (FFN up: bias + GELU keeping the pre-activation;
        // FFN down's dgrad times GELU'): used if cuBLASLt offers them.
        GemmCase{"fwd_e4m3_bias_gelu_aux", LinearGemm::Forward, E4, E4, PT, BF,
                 Epilogue::BiasGeluAux, false, false, false, true},
        GemmCase{"dgrad_e5m2_dgelu", LinearGemm::Dgrad, E4, E5, PT, BF, Epilogue::DGelu, false,
                 false, false, true},
        // Block scaling: 1x128 activations/gradients, 128x128 weights.
        GemmCase{"block_fwd_e4m3_bf16", LinearGemm::Forward, E4, E4, B1, BF, Epilogue::None, false,
                 false, false},
        GemmCase{"block_fwd_e4m3_f32_amax", LinearGemm::Forward, E4, E4, B1, F32, Epilogue::None,
                 false, true, false},
        GemmCase{"block_fwd_e4m3_bias", LinearGemm::Forward, E4, E4, B1, BF, Epilogue::Bias, false,
                 false, false, true},
        GemmCase{"block_dgrad_e4m3", LinearGemm::Dgrad, E4, E4, B1, BF, Epilogue::None, false,
                 false, false},
        GemmCase{"block_dgrad_e5m2_grad", LinearGemm::Dgrad, E4, E5, B1, BF, Epilogue::None, false,
                 false, false},
        GemmCase{"block_dgrad_e4m3_dgelu", LinearGemm::Dgrad, E4, E4, B1, BF, Epilogue::DGelu,
                 false, false, false, true},
        GemmCase{"block_wgrad_e4m3_accumulate_f32", LinearGemm::Wgrad, E4, E4, B1, F32,
                 Epilogue::None, true, false, false},
        GemmCase{"block_wgrad_e5m2_grad_f32", LinearGemm::Wgrad, E4, E5, B1, F32, Epilogue::None,
                 false, false, false},
        // T = 336 tokens (a multiple of 16 as FP8 needs, not of 128): the forward's M and
        // the weight gradient's K end in partial blocks.
        GemmCase{"partial_fwd_e4m3", LinearGemm::Forward, E4, E4, PT, BF, Epilogue::Bias, false,
                 false, false, false, 336},
        GemmCase{"partial_wgrad_e5m2_f32", LinearGemm::Wgrad, E4, E5, PT, F32, Epilogue::None, true,
                 false, false, false, 336},
        GemmCase{"partial_block_fwd_e4m3", LinearGemm::Forward, E4, E4, B1, BF, Epilogue::None,
                 false, false, false, true, 336},
        GemmCase{"partial_block_wgrad_e4m3_f32", LinearGemm::Wgrad, E4, E4, B1, F32, Epilogue::None,
                 true, false, false, true, 336}),
    [](const ::testing::TestParamInfo<GemmCase>& info) { return std::string(info.param.name); });

TEST(Fp8GemmArgs, RefusesWhatHopperCannotDo) {
  Gemm gemm;
  GemmArgs g;
  g.m = g.n = g.k = 64;
  g.lda = g.ldb = g.ldd = 64;
  g.trans_b = true;
  g.a_type = DType::E5M2;
  g.b_type = DType::E5M2;
  float* fake = reinterpret_cast<float*>(256);
  g.a_scale_inv = g.b_scale_inv = fake;
  auto message = [&] {
    try {
      gemm.run(nullptr, g);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message().find("E5M2 x E5M2"), std::string::npos) << message();
  g.a_type = DType::E4M3;
  g.trans_b = false;
  EXPECT_NE(message().find("trans_b = true"), std::string::npos) << message();
  g.trans_b = true;
  g.b_type = DType::BF16;
  EXPECT_NE(message().find("in pairs"), std::string::npos) << message();
  g.b_type = DType::E4M3;
  g.a_scaling = Fp8ScaleMode::Block1x128;
  EXPECT_NE(message().find("cannot be mixed"), std::string::npos) << message();
  g.b_scaling = Fp8ScaleMode::Block128x128;
  g.a_scaling = Fp8ScaleMode::Block128x128;
  EXPECT_NE(message().find("128x128 x 128x128"), std::string::npos) << message();
  g.a_scaling = Fp8ScaleMode::Block1x128;
  g.fast_accum = true;
  EXPECT_NE(message().find("fast accumulation"), std::string::npos) << message();
  g.fast_accum = false;
  g.a_scale_inv = nullptr;
  EXPECT_NE(message().find("a_scale_inv"), std::string::npos) << message();
  EXPECT_EQ(gemm.numPlans(), 0u);
}

// The GELU applied in the cast (Fp8CastArgs::gelu, the FFN's GELU output cast in one pass from
// the pre-activation): g = bf16(gelu_tanh(pre)) against the host's fp64 GELU within one bf16 ulp
// (2^-7 |g|) plus the fp32 tanh form's cancellation in the negative tail: 0.5 x (1 + tanh(.))
// with tanh near -1 loses the low bits of 1 + t, an absolute error of a few fp32 ulps of 1
// times |x| / 2 (2^-21 |x| allows 8; the H100 run of 2026-11-25 missed 2^-7 |g| alone by ~1e-9
// at x = -5.06 and gave -0 for gelu(-7) = -2.3e-15, as cuBLASLt's epilogue does).  The codes and
// transposed codes bit for bit against the host encoder on the g the kernel wrote, the amax
// exactly max |g|, the column sums of g bit for bit; without gelu_out the same codes.  70 x 200:
// partial 64x64 tiles and a row stride (200) that allows the 4-code stores but not all columns.
TEST(Fp8Cast, GeluOfThePreActivation) {
  const std::int64_t rows = 70, cols = 200, ld_t = 80;
  for (DType f : {DType::E4M3, DType::E5M2}) {
    std::vector<float> host = test::randomNormal(rows * cols, 91, 2.5f);
    Input pre(host, DType::BF16);
    DeviceBuffer<std::uint16_t> g(rows * cols);
    DeviceBuffer<std::uint8_t> out(rows * cols), out_t(cols * ld_t);
    const float sv = f == DType::E4M3 ? 150.0f : 2000.0f;  // saturates the largest
    DeviceBuffer<float> scale(std::vector<float>{sv}), scale_inv(1), amax(1);
    g.poison();
    out.poison();
    out_t.poison();
    Fp8CastArgs a;
    a.rows = rows;
    a.cols = cols;
    a.in = pre.get();
    a.in_type = DType::BF16;
    a.ld_in = cols;
    a.out_type = f;
    a.out = out.get();
    a.ld_out = cols;
    a.out_t = out_t.get();
    a.ld_out_t = ld_t;
    a.scale = scale.get();
    a.scale_inv = scale_inv.get();
    a.amax = amax.get();
    a.gelu = true;
    a.gelu_out = g.get();
    a.ld_gelu_out = cols;
    DeviceBuffer<float> col_sum(cols);  // of g, in the cast's order
    DeviceBuffer<std::uint8_t> work(fp8ColSumWorkspace(rows, cols));
    col_sum.poison();
    a.col_sum = col_sum.get();
    a.workspace = work.get();
    castFp8(nullptr, a);
    const std::vector<float> gv = test::downloadBf16(g);
    EXPECT_EQ(col_sum.download(), exactColumnSums(gv, rows, cols, cols, false)) << name(f);
    a.col_sum = nullptr;
    int far = 0;
    for (std::int64_t i = 0; i < rows * cols; ++i) {
      const double x = pre.values[i];
      const double want =
          0.5 * x * (1.0 + std::tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)));
      const double tol = std::fabs(want) * 0x1p-7 + std::fabs(x) * 0x1p-21;
      if (std::fabs(gv[i] - want) > tol && ++far <= 5)
        ADD_FAILURE() << "gelu(" << x << ") = " << gv[i] << ", fp64 " << want;
    }
    EXPECT_EQ(far, 0);
    const std::string what = "gelu cast " + name(f);
    expectCodes(out.download(), cols, false, gv, rows, cols, cols, f, sv, what);
    expectCodes(out_t.download(), ld_t, true, gv, rows, cols, cols, f, sv, what + " transposed");
    EXPECT_EQ(downloadScalar(amax), maxAbs(gv, rows, cols, cols)) << what;
    EXPECT_EQ(downloadScalar(scale_inv), 1.0f / sv) << what;
    const std::vector<std::uint8_t> codes = out.download();
    out.poison();
    a.gelu_out = nullptr;
    a.out_t = nullptr;
    castFp8(nullptr, a);
    EXPECT_EQ(out.download(), codes) << what << ": without the bf16 output";
    a.gelu_out = g.get();
    a.gelu = false;
    EXPECT_THROW(castFp8(nullptr, a), Error);  // gelu_out without gelu
    a.gelu = true;
    DeviceBuffer<float> cur(1);
    EXPECT_THROW(castFp8Current(nullptr, a, cur.get()), Error);
  }
}

// ---------------------------------------------------------------------------------------------
// The LayerNorm with its output's cast fused in (layerNormForwardFp8)

struct LnCase {
  std::int64_t rows;
  int cols;
  DType in_type;
  DType out_type;
};

class Fp8LayerNorm : public ::testing::TestWithParam<LnCase> {};

// The bf16 output, mean and rstd bit for bit as the plain LayerNorm writes them; the codes and
// the transposed codes bit for bit against the host encoder on that bf16 output times the
// scale; the amax exactly (written, then max-accumulated); scale_inv = 1 / scale; the transposed
// copy's columns from `rows` on untouched.  Rows not a multiple of the 32-row block nor of 4 (the
// byte-wise tail of the transposed store), 1 row, hidden 64 to 5120 (the tiles of one warp per
// row and of 2 and 4 warps per row), 66 (not a multiple of 4: the pair kernels), and a scale that
// saturates the largest values.
TEST_P(Fp8LayerNorm, MatchesPlainLayerNormAndHostCodes) {
  const LnCase c = GetParam();
  const std::int64_t n = c.rows * c.cols;
  std::vector<float> xh = test::randomNormal(n, 11 + c.rows + c.cols, 2.0f);
  for (std::int64_t i = 0; i < n; i += 7) xh[i] += 1.5f;  // non-zero means
  Input x(xh, c.in_type);
  std::vector<float> gh = test::randomNormal(c.cols, 5, 0.5f), bh = test::randomNormal(c.cols, 6);
  for (float& g : gh) g += 1.0f;
  DeviceBuffer<float> gamma(gh), beta(bh);
  DeviceBuffer<std::uint16_t> y_ref(n), y(n);
  DeviceBuffer<float> mean_ref(c.rows), rstd_ref(c.rows), mean(c.rows), rstd(c.rows);
  const float eps = 1e-5f;
  auto plain = [&](auto* xp) {
    layerNormForward(nullptr, xp, gamma.get(), beta.get(), reinterpret_cast<bf16*>(y_ref.get()),
                     mean_ref.get(), rstd_ref.get(), c.rows, c.cols, eps);
  };
  const bool bf16_in = c.in_type == DType::BF16;
  if (bf16_in)
    plain(reinterpret_cast<const bf16*>(x.get()));
  else
    plain(static_cast<const float*>(x.get()));

  const std::int64_t ld = c.cols + 16, ld_t = (c.rows + 3) / 4 * 4 + 8;
  DeviceBuffer<std::uint8_t> codes(c.rows * ld), codes_t(c.cols * ld_t);
  PLM_CHECK_CUDA(cudaMemset(codes_t.get(), 0xab, c.cols * ld_t));
  codes.poison();
  y.poison();
  // 3.7 * |y| reaches past 448 in the tails of the E4M3 cases: saturation is exercised.
  const float scale_value = c.out_type == DType::E4M3 ? 61.3f : 3.7f;
  DeviceBuffer<float> scale(std::vector<float>{scale_value}), scale_inv(1), amax(1);
  scale_inv.poison();
  amax.poison();
  LayerNormFp8Args q;
  q.out_type = c.out_type;
  q.codes = codes.get();
  q.ld_codes = ld;
  q.codes_t = codes_t.get();
  q.ld_codes_t = ld_t;
  q.scale = scale.get();
  q.scale_inv = scale_inv.get();
  q.amax = amax.get();
  auto fused = [&](auto* xp, bf16* yp) {
    layerNormForwardFp8(nullptr, xp, gamma.get(), beta.get(), yp, mean.get(), rstd.get(), c.rows,
                        c.cols, eps, q);
  };
  auto run = [&](bf16* yp) {
    if (bf16_in)
      fused(reinterpret_cast<const bf16*>(x.get()), yp);
    else
      fused(static_cast<const float*>(x.get()), yp);
  };
  run(reinterpret_cast<bf16*>(y.get()));
  const std::string what = "rows " + std::to_string(c.rows) + " cols " + std::to_string(c.cols) +
                           " " + name(c.in_type) + " -> " + name(c.out_type);
  EXPECT_EQ(y.download(), y_ref.download()) << what << ": bf16 output";
  EXPECT_EQ(mean.download(), mean_ref.download()) << what;
  EXPECT_EQ(rstd.download(), rstd_ref.download()) << what;
  const std::vector<float> yv = test::downloadBf16(y_ref);
  expectCodes(codes.download(), ld, false, yv, c.rows, c.cols, c.cols, c.out_type, scale_value,
              what + " codes");
  const std::vector<std::uint8_t> t = codes_t.download();
  expectCodes(t, ld_t, true, yv, c.rows, c.cols, c.cols, c.out_type, scale_value,
              what + " transposed codes");
  int touched = 0;
  for (std::int64_t cc = 0; cc < c.cols; ++cc)
    for (std::int64_t r = c.rows; r < ld_t; ++r) touched += t[cc * ld_t + r] != 0xab;
  EXPECT_EQ(touched, 0) << what << ": columns of the transposed copy past rows were written";
  const float want_amax = maxAbs(yv, c.rows, c.cols, c.cols);
  EXPECT_EQ(downloadScalar(amax), want_amax) << what;
  EXPECT_EQ(downloadScalar(scale_inv), 1.0f / scale_value) << what;
  int saturated = 0;
  for (float v : yv) saturated += std::fabs(v * scale_value) > hostFp8Max(c.out_type);
  if (c.out_type == DType::E4M3 && c.rows * c.cols >= 4096)
    EXPECT_GT(saturated, 0) << what << ": the case should reach saturation";

  // Accumulating amax: a larger value stays, and no bf16 output (y = nullptr) changes nothing.
  const float big = 1e6f;
  amax.upload(std::vector<float>{big});
  q.amax_accumulate = true;
  q.codes_t = nullptr;
  codes.poison();
  run(nullptr);
  EXPECT_EQ(downloadScalar(amax), big) << what;
  expectCodes(codes.download(), ld, false, yv, c.rows, c.cols, c.cols, c.out_type, scale_value,
              what + " codes without the bf16 output");
  amax.upload(std::vector<float>{0.0f});
  run(nullptr);
  EXPECT_EQ(downloadScalar(amax), want_amax) << what << ": accumulated from 0";
}

INSTANTIATE_TEST_SUITE_P(Shapes, Fp8LayerNorm,
                         ::testing::Values(LnCase{1, 64, DType::BF16, DType::E4M3},
                                           LnCase{37, 320, DType::F32, DType::E4M3},
                                           LnCase{70, 1280, DType::BF16, DType::E4M3},
                                           LnCase{130, 1280, DType::F32, DType::E5M2},
                                           LnCase{96, 640, DType::F32, DType::E4M3},
                                           LnCase{41, 480, DType::BF16, DType::E4M3},
                                           LnCase{45, 2560, DType::F32, DType::E4M3},
                                           LnCase{67, 5120, DType::BF16, DType::E5M2},
                                           LnCase{50, 66, DType::F32, DType::E4M3}));

TEST(Fp8LayerNorm, RefusesBadArguments) {
  DeviceBuffer<float> x(64), gamma(32), beta(32), mean(2), rstd(2), scale(1);
  DeviceBuffer<std::uint8_t> codes(256);
  LayerNormFp8Args q;
  q.codes = codes.get();
  q.ld_codes = 32;
  auto call = [&] {
    layerNormForwardFp8(nullptr, x.get(), gamma.get(), beta.get(), nullptr, mean.get(), rstd.get(),
                        2, 32, 1e-5f, q);
  };
  EXPECT_THROW(call(), Error);  // no scale
  q.scale = scale.get();
  q.out_type = DType::BF16;
  EXPECT_THROW(call(), Error);
  q.out_type = DType::E4M3;
  q.codes_t = codes.get();
  q.ld_codes_t = 6;  // not a multiple of 4
  EXPECT_THROW(call(), Error);
  q.ld_codes_t = 8;
  EXPECT_NO_THROW(call());
}

}  // namespace
}  // namespace plm::gpu
