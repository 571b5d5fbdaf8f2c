// The CUDA FP8 path of the GEMM dispatch points (ops.cpp: cast + cuBLASLt FP8 GEMM in Hopper's
// TN layout) against the portable emulation (fp8_gemm.hpp) on the same values: a Linear layer
// with bf16 x (T, in), W (out, in), bias and dY, per-tensor delayed and current scaling.  Both
// sides quantise the same numbers with the same scales, so they differ only by the order (and
// Hopper's FP8 accumulator) of the fp32 sums: 5e-4 norm-wise; a wrong scale, format or operand
// layout gives errors of 1e-2 and more.  Checks forward, dgrad, wgrad and the bias gradient.
#include "model/fp8_gemm.hpp"
#include "model/fp8_scaling.hpp"
#include "model/ops.hpp"

#include <gtest/gtest.h>

#if PLM_FP8_CUDA
#include "gpu/fp8.hpp"

#include <cuda_runtime.h>
#endif

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <utility>
#include <vector>

namespace {

using namespace plm::model;

#if PLM_FP8_CUDA
std::uint16_t toBf16(float x) {  // round to nearest even
  std::uint32_t u;
  std::memcpy(&u, &x, 4);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>(u >> 16);
}
float fromBf16(std::uint16_t b) {
  const std::uint32_t u = std::uint32_t(b) << 16;
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

// A bf16 device tensor and its fp32 twin (the same values), (rows, cols).
struct Pair {
  plm::View1<std::uint16_t> bf;
  plm::View2<float> f32;
  Mat mat() const {
    return Mat{bf.data(), DType::BF16, std::int64_t(f32.extent(0)), std::int64_t(f32.extent(1)),
               std::int64_t(f32.extent(1))};
  }
};

Pair random(std::int64_t rows, std::int64_t cols, float scale, std::mt19937& rng) {
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::vector<std::uint16_t> b(rows * cols);
  std::vector<float> f(rows * cols);
  for (std::size_t i = 0; i < b.size(); ++i) {
    b[i] = toBf16(n(rng) * scale);
    f[i] = fromBf16(b[i]);
  }
  Pair p{plm::View1<std::uint16_t>("bf", b.size()), plm::View2<float>("f32", rows, cols)};
  Kokkos::deep_copy(p.bf, Kokkos::View<std::uint16_t*, Kokkos::HostSpace>(b.data(), b.size()));
  Kokkos::deep_copy(
      p.f32, Kokkos::View<float**, Kokkos::LayoutRight, Kokkos::HostSpace>(f.data(), rows, cols));
  return p;
}

std::vector<float> host(const plm::View2<float>& v) {
  std::vector<float> out(v.size());
  Kokkos::deep_copy(Kokkos::View<float**, Kokkos::LayoutRight, Kokkos::HostSpace>(
                        out.data(), v.extent(0), v.extent(1)),
                    v);
  return out;
}

double normwise(const std::vector<float>& got, const std::vector<float>& want) {
  double d = 0, w = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    d += (double(got[i]) - want[i]) * (double(got[i]) - want[i]);
    w += double(want[i]) * want[i];
  }
  return std::sqrt(d / w);
}
#endif

TEST(Fp8GpuLinear, MatchesTheEmulation) {
#if !PLM_FP8_CUDA
  GTEST_SKIP() << "no FP8 kernels (gpu/fp8.hpp) in this build";
#else
  const std::int64_t T = 150, in = 256, out = 192;  // T not a multiple of 16: padded ld of X^T
  std::mt19937 rng(5);
  const Pair x = random(T, in, 1.5f, rng), w = random(out, in, 0.05f, rng);
  const Pair dy = random(T, out, 2e-3f, rng), b = random(1, out, 0.1f, rng);
  for (Fp8Recipe recipe : {Fp8Recipe::Delayed, Fp8Recipe::Current}) {
    Fp8Config c;
    c.recipe = recipe;
    Fp8Scaling scaling(c, 1);
    scaling.setRecording(true);
    if (recipe == Fp8Recipe::Delayed) {  // scales of a previous step
      for (int o = 0; o < 3; ++o)
        scaling.record(scaling.index(0, Fp8Gemm::FfnIn, Fp8Operand(o)), o == 0   ? 6.0f
                                                                        : o == 1 ? 0.2f
                                                                                 : 8e-3f);
      scaling.endStep(MPI_COMM_NULL);
    }
    // The CUDA side: device scales/amaxes, the weight's codes and transpose.
    Fp8GemmSlot slot{&scaling, 0, Fp8Gemm::FfnIn};
    constexpr int kS = Fp8GemmSlot::kScaleStride;  // the model's layout of device scales
    plm::View1<float> dev("scales", 6 * kS + 3);
    plm::View1<std::uint8_t> codes("codes", 2 * out * in);
    std::vector<float> hs(6 * kS, 1.0f);
    for (int o = 0; o < 3; ++o) {
      const int t = slot.index(Fp8Operand(o));
      hs[kS * (2 * o)] = scaling.scale(t);
      hs[kS * (2 * o + 1)] = scaling.scaleInv(t);
    }
    Kokkos::deep_copy(Kokkos::subview(dev, std::make_pair(0, 6 * kS)),
                      Kokkos::View<float*, Kokkos::HostSpace>(hs.data(), 6 * kS));
    slot.scales = dev.data();
    slot.amaxes = dev.data() + 6 * kS;
    slot.w_codes = codes.data();
    slot.wt_codes = codes.data() + out * in;
    OpContext ctx{plm::ExecSpace()};
    const auto stream = ctx.space().cuda_stream();
    plm::gpu::Fp8CastArgs a;
    a.rows = out;
    a.cols = in;
    a.in = w.bf.data();
    a.in_type = plm::gpu::DType::BF16;
    a.ld_in = in;
    a.out_type = plm::gpu::DType::E4M3;
    a.out = codes.data();
    a.ld_out = in;
    a.out_t = codes.data() + out * in;
    a.ld_out_t = out;
    a.scale_inv = slot.scaleInv(1);
    a.amax = slot.amaxes + 1;
    if (recipe == Fp8Recipe::Current) {
      plm::gpu::castFp8Current(stream, a, slot.scale(1));
    } else {
      a.scale = slot.scale(1);
      plm::gpu::castFp8(stream, a);
    }
    Mat wm = w.mat();
    wm.fp8 = &slot;
    plm::View2<float> y("y", T, out), dx("dx", T, in), dw("dw", out, in);
    plm::View1<float> db("db", out);
    const Vec bias{b.bf.data(), DType::BF16, out};
    linear(ctx, x.mat(), wm, bias, matOf(y));
    linearBackward(ctx, x.mat(), wm, dy.mat(), matOf(dx), false, matOf(dw), vecOf(db));
    Kokkos::fence();
    // The emulation on the fp32 twins, with the same scaling state.
    Fp8GemmSlot emu{&scaling, 0, Fp8Gemm::FfnIn};
    plm::View2<float> wq("wq", out, in), y2("y2", T, out), dx2("dx2", T, in), dw2("dw2", out, in);
    plm::View1<float> db2("db2", out);
    const plm::View1<float> b32(b.f32.data(), out);
    fp8QuantizeOperand(plm::ExecSpace(), emu, Fp8Operand::Weight, Fp8Blocks::Square, false, w.f32,
                       wq);
    fp8LinearForward(ctx, emu, x.f32, wq, b32, 0.0f, y2);
    fp8LinearBackward(ctx, emu, x.f32, wq, dy.f32, 0.0f, dx2, dw2, db2);
    Kokkos::fence();
    const char* name = fp8RecipeName(recipe);
    EXPECT_LT(normwise(host(y), host(y2)), 5e-4) << name << " forward";
    EXPECT_LT(normwise(host(dx), host(dx2)), 5e-4) << name << " dgrad";
    EXPECT_LT(normwise(host(dw), host(dw2)), 5e-4) << name << " wgrad";
    const plm::View2<float> db_2d(db.data(), 1, out), db2_2d(db2.data(), 1, out);
    EXPECT_LT(normwise(host(db_2d), host(db2_2d)), 1e-5) << name << " bias gradient";

    // The weight-gradient GEMM reads X^T kept from the forward's cast (ops.cpp): the same bits
    // as casting X again in the backward (a context that ran no forward), and a backward on
    // another x (same shape) casts that x instead of reading the kept copy.
    const Pair x_other = random(T, in, 0.7f, rng);
    auto backward = [&](OpContext& c, const Pair& xs) {
      plm::View2<float> dx_b("dx_b", T, in), dw_b("dw_b", out, in);
      plm::View1<float> db_b("db_b", out);
      linearBackward(c, xs.mat(), wm, dy.mat(), matOf(dx_b), false, matOf(dw_b), vecOf(db_b));
      Kokkos::fence();
      return std::make_pair(host(dx_b), host(dw_b));
    };
    {
      OpContext fresh{plm::ExecSpace()};
      const auto recast = backward(fresh, x);
      EXPECT_TRUE(recast.first == host(dx)) << name << " dgrad, rerun";
      EXPECT_TRUE(recast.second == host(dw)) << name << " wgrad from the kept X^T vs recast X";
      const auto other_fresh = backward(fresh, x_other);
      const auto other_kept = backward(ctx, x_other);
      EXPECT_TRUE(other_kept.second == other_fresh.second)
          << name << " a backward on another x read the kept X^T of the forward's x";
      EXPECT_FALSE(other_kept.second == recast.second) << name << " x_other made no difference";
    }
  }
#endif
}

}  // namespace
