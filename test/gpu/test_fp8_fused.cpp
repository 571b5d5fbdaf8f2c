// The FP8 casts fused into their producers under block scaling (src/gpu/fp8.cu,
// castFp8Block's gelu): the pass that applies the FFN's GELU to the pre-activation writes the
// 1x128 codes (with split_tail's 8-row tail), the X^T codes (1x128 along the tokens) and both
// scale arrays itself.  Reference: the separate path it replaces, the GELU pass (castFp8 with
// gelu, bf16 output) followed by castFp8Block on that output.  Everything must agree bit for
// bit: codes, transposed codes, scale_inv arrays (padding included), the amax, and the bf16
// GELU output where the fused pass also writes it.  Token counts T = 150 (a tail of 6 rows, a
// partial 128-token block), 5 (tail only: no body) and 256 (whole blocks, no tail); widths 320
// (a partial 128-column block) and 1280 (ESM-2 650M's hidden).
#include "gpu/fp8.hpp"
#include "gpu_test_util.hpp"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace plm::gpu {
namespace {

using test::DeviceBuffer;

std::int64_t pad16(std::int64_t n) { return (n + 15) / 16 * 16; }

// The outputs of one block cast of a (rows, cols) operand, poisoned before the cast so that an
// unwritten byte cannot pass.
struct BlockOut {
  std::int64_t rows, cols, ld_t;
  BlockTailSplit split;
  DeviceBuffer<std::uint8_t> codes, codes_t;
  DeviceBuffer<float> scales, scales_t, amax;
  DeviceBuffer<std::uint16_t> gelu;
  BlockOut(std::int64_t r, std::int64_t c)
      : rows(r),
        cols(c),
        ld_t(pad16(r)),
        split(blockTailSplit(r, c)),
        codes(split.rows * c),
        codes_t(c * pad16(r)),
        scales(split.count),
        scales_t(blockScaleLayout(Fp8ScaleMode::Block1x128, c, r).count),
        amax(1),
        gelu(r * c) {
    codes.poison();
    codes_t.poison();
    scales.poison();
    scales_t.poison();
    gelu.poison();
  }
  Fp8BlockCastArgs args(const void* in) const {
    Fp8BlockCastArgs a;
    a.rows = rows;
    a.cols = cols;
    a.in = in;
    a.in_type = DType::BF16;
    a.ld_in = cols;
    a.out_type = DType::E4M3;
    a.scaling = Fp8ScaleMode::Block1x128;
    a.out = codes.get();
    a.ld_out = cols;
    a.scale_inv = scales.get();
    a.split_tail = true;
    a.out_t = codes_t.get();
    a.ld_out_t = ld_t;
    a.scale_inv_t = scales_t.get();
    a.amax = amax.get();
    return a;
  }
};

// The transposed codes row by row, without the token padding (written by neither cast: ops.cpp
// zeroes it separately).
std::vector<std::uint8_t> transposedWithoutPadding(const BlockOut& o) {
  const std::vector<std::uint8_t> all = o.codes_t.download();
  std::vector<std::uint8_t> got;
  for (std::int64_t c = 0; c < o.cols; ++c)
    got.insert(got.end(), all.begin() + c * o.ld_t, all.begin() + c * o.ld_t + o.rows);
  return got;
}

// Bit patterns of fp32 values: the scale arrays are compared bit for bit, and with a tail the
// slots between the body's scales and the tail's (tail_scales is rounded up to 64) are written by
// neither cast, so they keep the poison (NaN), which a float comparison would call different.
std::vector<std::uint32_t> bitsOf(const std::vector<float>& v) {
  std::vector<std::uint32_t> b(v.size());
  std::memcpy(b.data(), v.data(), v.size() * sizeof(float));
  return b;
}

struct FusedCase {
  std::int64_t rows, cols;
};

class Fp8FusedGelu : public ::testing::TestWithParam<FusedCase> {};

TEST_P(Fp8FusedGelu, BitwiseTheSeparateCast) {
  const FusedCase c = GetParam();
  const std::string what = "T=" + std::to_string(c.rows) + " cols=" + std::to_string(c.cols);
  // Spread 2.5: the GELU's negative tail, its near-linear part, and block amaxes of several
  // binades (so the power-of-two scales differ between blocks).
  std::vector<float> host = test::randomNormal(c.rows * c.cols, 7 + c.rows, 2.5f);
  for (std::int64_t r = 0; r < c.rows; r += 3)  // rows of another magnitude: other row scales
    for (std::int64_t k = 0; k < c.cols; ++k) host[r * c.cols + k] *= 0.01f;
  const test::Bf16Tensor pre(host);

  // Separate: the GELU pass writes bf16 g, the block cast reads it.
  BlockOut sep(c.rows, c.cols);
  {
    DeviceBuffer<float> scale(std::vector<float>{1.0f});
    Fp8CastArgs g;
    g.rows = c.rows;
    g.cols = c.cols;
    g.in = pre.get();
    g.in_type = DType::BF16;
    g.ld_in = c.cols;
    g.scale = scale.get();
    g.gelu = true;
    g.gelu_out = sep.gelu.get();
    g.ld_gelu_out = c.cols;
    castFp8(nullptr, g);
    castFp8Block(nullptr, sep.args(sep.gelu.get()));
  }
  // Fused: one pass from the pre-activation, with and without the bf16 output.
  BlockOut fused(c.rows, c.cols), bare(c.rows, c.cols);
  {
    Fp8BlockCastArgs a = fused.args(pre.get());
    a.gelu = true;
    a.gelu_out = fused.gelu.get();
    a.ld_gelu_out = c.cols;
    castFp8Block(nullptr, a);
    Fp8BlockCastArgs b = bare.args(pre.get());
    b.gelu = true;
    castFp8Block(nullptr, b);
  }
  const std::vector<std::uint8_t> codes = sep.codes.download(),
                                  codes_t = transposedWithoutPadding(sep);
  const std::vector<std::uint32_t> scales = bitsOf(sep.scales.download()),
                                   scales_t = bitsOf(sep.scales_t.download());
  EXPECT_TRUE(fused.gelu.download() == sep.gelu.download()) << what << ": bf16 GELU output";
  for (const BlockOut* o : {&fused, &bare}) {
    const std::string w = what + (o == &bare ? " (no bf16 output)" : "");
    EXPECT_TRUE(o->codes.download() == codes) << w << ": 1x128 codes (tail rows included)";
    EXPECT_TRUE(transposedWithoutPadding(*o) == codes_t) << w << ": X^T codes";
    EXPECT_TRUE(bitsOf(o->scales.download()) == scales) << w << ": 1x128 scale_inv (body, tail)";
    EXPECT_TRUE(bitsOf(o->scales_t.download()) == scales_t) << w << ": X^T scale_inv";
    EXPECT_EQ(o->amax.download()[0], sep.amax.download()[0]) << w << ": amax";
  }
  // A test that can fail: the codes are not those of the pre-activation itself.
  BlockOut raw(c.rows, c.cols);
  castFp8Block(nullptr, raw.args(pre.get()));
  EXPECT_FALSE(raw.codes.download() == codes) << what << ": the GELU changed nothing";
}

INSTANTIATE_TEST_SUITE_P(Shapes, Fp8FusedGelu,
                         ::testing::Values(FusedCase{150, 320}, FusedCase{5, 320},
                                           FusedCase{256, 320}, FusedCase{150, 1280},
                                           FusedCase{5, 1280}, FusedCase{256, 1280}),
                         [](const ::testing::TestParamInfo<FusedCase>& i) {
                           return "T" + std::to_string(i.param.rows) + "_cols" +
                                  std::to_string(i.param.cols);
                         });

TEST(Fp8FusedGelu, RefusesGeluOutputWithoutGelu) {
  BlockOut o(8, 128);
  DeviceBuffer<std::uint16_t> in(8 * 128);
  Fp8BlockCastArgs a = o.args(in.get());
  a.gelu_out = o.gelu.get();
  a.ld_gelu_out = 128;
  EXPECT_THROW(castFp8Block(nullptr, a), Error);  // gelu_out without gelu
  a.gelu = true;
  a.ld_gelu_out = 64;
  EXPECT_THROW(castFp8Block(nullptr, a), Error);  // row stride below cols
}

}  // namespace
}  // namespace plm::gpu
