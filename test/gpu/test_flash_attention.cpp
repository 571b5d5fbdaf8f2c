// Varlen attention forward and backward against a host double reference, on random ragged
// batches with sequences of length 1 and 1024 among them, head_dim 16..128, with Q, K, V read
// from one interleaved QKV buffer (row strides) as the model stores them: the own flash
// attention, cuDNN's fused attention (both directions, deterministic backward bitwise equal on
// a rerun) and cuDNN's forward paired with the flash backward (their lse must agree); the flash
// kernels also as the general (legacy) set explicitly (the default dispatch runs the
// small-head_dim forward at head_dim <= 32), with empty sequences, and their backward bitwise
// equal on a rerun.
#include "gpu/cudnn_attention.hpp"
#include "gpu/flash_attention.hpp"
#include "gpu_test_util.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>

namespace plm::gpu {
namespace {

using test::Bf16Tensor;
using test::DeviceBuffer;

struct Reference {
  std::vector<double> o, lse, dq, dk, dv;
};

// Host double reference over the rounded inputs, packed (T, H, D) contiguous per tensor.
Reference reference(const std::vector<std::int32_t>& cu, int heads, int dim, float scale,
                    const std::vector<float>& q, const std::vector<float>& k,
                    const std::vector<float>& v, const std::vector<float>& dout) {
  std::int64_t tokens = cu.back();
  Reference r;
  r.o.assign(tokens * heads * dim, 0.0);
  r.lse.assign(tokens * heads, 0.0);
  r.dq = r.o;
  r.dk = r.o;
  r.dv = r.o;
  auto at = [&](std::int64_t t, int h, int d) { return (t * heads + h) * dim + d; };
  for (std::size_t s = 0; s + 1 < cu.size(); ++s) {
    int start = cu[s], len = cu[s + 1] - cu[s];
    std::vector<double> p(static_cast<std::size_t>(len) * len), dp(p.size());
    for (int h = 0; h < heads; ++h) {
      for (int i = 0; i < len; ++i) {
        double mx = -1e300;
        for (int j = 0; j < len; ++j) {
          double x = 0.0;
          for (int d = 0; d < dim; ++d)
            x += double(q[at(start + i, h, d)]) * k[at(start + j, h, d)];
          p[i * len + j] = x * scale;
          mx = std::max(mx, p[i * len + j]);
        }
        double sum = 0.0;
        for (int j = 0; j < len; ++j) sum += std::exp(p[i * len + j] - mx);
        r.lse[(start + i) * heads + h] = mx + std::log(sum);
        for (int j = 0; j < len; ++j) p[i * len + j] = std::exp(p[i * len + j] - mx) / sum;
        for (int d = 0; d < dim; ++d) {
          double o = 0.0;
          for (int j = 0; j < len; ++j) o += p[i * len + j] * v[at(start + j, h, d)];
          r.o[at(start + i, h, d)] = o;
        }
      }
      for (int i = 0; i < len; ++i) {
        // delta from the rounded output the kernel saw is within bf16 noise of this one.
        double delta = 0.0;
        for (int d = 0; d < dim; ++d)
          delta += double(dout[at(start + i, h, d)]) * r.o[at(start + i, h, d)];
        for (int j = 0; j < len; ++j) {
          double x = 0.0;
          for (int d = 0; d < dim; ++d)
            x += double(dout[at(start + i, h, d)]) * v[at(start + j, h, d)];
          dp[i * len + j] = p[i * len + j] * (x - delta);  // dS
        }
      }
      for (int i = 0; i < len; ++i)
        for (int j = 0; j < len; ++j) {
          double ds = dp[i * len + j] * scale, pij = p[i * len + j];
          for (int d = 0; d < dim; ++d) {
            r.dq[at(start + i, h, d)] += ds * k[at(start + j, h, d)];
            r.dk[at(start + j, h, d)] += ds * q[at(start + i, h, d)];
            r.dv[at(start + j, h, d)] += pij * dout[at(start + i, h, d)];
          }
        }
    }
  }
  return r;
}

struct AttnCase {
  int head_dim;
  int heads;
  std::vector<int> lengths;
  std::uint64_t seed;
};

// Flash: the default dispatch (the small-head_dim forward at head_dim <= 32); FlashLegacy: the
// general kernels.
enum class Impl { Flash, Cudnn, CudnnForward, FlashLegacy };

bool isFlash(Impl i) { return i == Impl::Flash || i == Impl::FlashLegacy; }

CudnnAttention& cudnn() {
  static CudnnAttention a(/*deterministic_backward=*/true);
  return a;
}

void checkCase(const AttnCase& c, Impl impl = Impl::Flash) {
  // Above head_dim 32 the default dispatch is the general kernels, which Flash tests.
  if (impl == Impl::FlashLegacy && c.head_dim > 32) return;
  std::vector<std::int32_t> cu{0};
  for (int len : c.lengths) cu.push_back(cu.back() + len);
  std::int64_t tokens = cu.back();
  int H = c.heads, D = c.head_dim;
  std::int64_t row = static_cast<std::int64_t>(H) * D;
  float scale = 1.0f;  // ESM-2: q is scaled before rotary
  // q pre-scaled like the model's, so scores have a realistic spread.
  auto qv = test::randomNormal(tokens * row, c.seed, 1.0f / std::sqrt(float(D)) * 1.5f);
  auto kv = test::randomNormal(tokens * row, c.seed + 1);
  auto vv = test::randomNormal(tokens * row, c.seed + 2);
  auto dov = test::randomNormal(tokens * row, c.seed + 3);
  // Interleaved QKV (T, 3, H, D), as the fused projection writes it.
  std::vector<float> qkv(tokens * 3 * row);
  for (std::int64_t t = 0; t < tokens; ++t)
    for (std::int64_t i = 0; i < row; ++i) {
      qkv[t * 3 * row + i] = qv[t * row + i];
      qkv[t * 3 * row + row + i] = kv[t * row + i];
      qkv[t * 3 * row + 2 * row + i] = vv[t * row + i];
    }
  Bf16Tensor qkv_dev(qkv), dout_dev(dov);
  for (std::int64_t t = 0; t < tokens; ++t)
    for (std::int64_t i = 0; i < row; ++i) {
      qv[t * row + i] = qkv_dev.values[t * 3 * row + i];
      kv[t * row + i] = qkv_dev.values[t * 3 * row + row + i];
      vv[t * row + i] = qkv_dev.values[t * 3 * row + 2 * row + i];
    }
  Reference ref = reference(cu, H, D, scale, qv, kv, vv, dout_dev.values);

  DeviceBuffer<std::int32_t> cu_dev(cu);
  DeviceBuffer<std::uint16_t> o(tokens * row), dq(tokens * row), dk(tokens * row), dv(tokens * row);
  // The model's layout: dq, dk, dv stacked in one (T, 3 hidden) buffer like q, k, v.
  DeviceBuffer<std::uint16_t> dqkv(tokens * 3 * row);
  DeviceBuffer<float> lse(tokens * H), delta(tokens * H);
  for (auto* b : {&o, &dq, &dk, &dv}) b->poison();
  lse.poison();

  FlashParams p;
  p.q = qkv_dev.get();
  p.k = qkv_dev.get() + row;
  p.v = qkv_dev.get() + 2 * row;
  p.q_stride = p.k_stride = p.v_stride = 3 * row;
  p.o = reinterpret_cast<bf16*>(o.get());
  p.o_stride = row;
  p.lse = lse.get();
  p.cu_seqlens = cu_dev.get();
  p.num_seqs = static_cast<int>(c.lengths.size());
  p.max_seqlen = *std::max_element(c.lengths.begin(), c.lengths.end());
  p.total_tokens = tokens;
  p.heads = H;
  p.head_dim = D;
  p.softmax_scale = scale;
  p.dout = dout_dev.get();
  p.dout_stride = row;
  p.dq = reinterpret_cast<bf16*>(dq.get());
  p.dk = reinterpret_cast<bf16*>(dk.get());
  p.dv = reinterpret_cast<bf16*>(dv.get());
  p.dq_stride = p.dk_stride = p.dv_stride = row;
  p.delta = delta.get();
  if (impl == Impl::FlashLegacy) p.kernels = FlashParams::Kernels::Legacy;
  if (isFlash(impl)) {
    flashAttentionForward(nullptr, p);
  } else {
    ASSERT_TRUE(cudnn().forward(nullptr, p)) << "cuDNN has no forward for head_dim " << D;
  }
  if (impl == Impl::Cudnn) {
    // Separate gradient buffers (row strides unlike q, k, v's) are refused, not mis-written.
    EXPECT_FALSE(cudnn().backward(nullptr, p));
    EXPECT_NE(cudnn().whyNot().find("row strides"), std::string::npos) << cudnn().whyNot();
    FlashParams s = p;
    s.dq = reinterpret_cast<bf16*>(dqkv.get());
    s.dk = s.dq + row;
    s.dv = s.dq + 2 * row;
    s.dq_stride = s.dk_stride = s.dv_stride = 3 * row;
    dqkv.poison();
    ASSERT_TRUE(cudnn().backward(nullptr, s)) << "cuDNN has no backward for head_dim " << D;
    PLM_CHECK_CUDA(cudaDeviceSynchronize());
    // Unstack into dq, dk, dv for the checks below.
    for (int g = 0; g < 3; ++g)
      PLM_CHECK_CUDA(cudaMemcpy2D((g == 0   ? dq
                                   : g == 1 ? dk
                                            : dv)
                                      .get(),
                                  row * 2, dqkv.get() + g * row, 3 * row * 2, row * 2, tokens,
                                  cudaMemcpyDeviceToDevice));
  } else {
    flashAttentionBackward(nullptr, p);
  }
  PLM_CHECK_CUDA(cudaDeviceSynchronize());
  if (isFlash(impl)) {  // the flash backward is deterministic: a rerun is bitwise equal
    auto first_dq = dq.download(), first_dk = dk.download(), first_dv = dv.download();
    for (auto* b : {&dq, &dk, &dv}) b->poison();
    flashAttentionBackward(nullptr, p);
    PLM_CHECK_CUDA(cudaDeviceSynchronize());
    EXPECT_TRUE(dq.download() == first_dq && dk.download() == first_dk && dv.download() == first_dv)
        << "flash backward not bitwise reproducible, head_dim " << D;
  }
  if (impl == Impl::Cudnn) {  // the deterministic backward: a rerun is bitwise equal
    auto first = dqkv.download();
    dqkv.poison();
    FlashParams s = p;
    s.dq = reinterpret_cast<bf16*>(dqkv.get());
    s.dk = s.dq + row;
    s.dv = s.dq + 2 * row;
    s.dq_stride = s.dk_stride = s.dv_stride = 3 * row;
    ASSERT_TRUE(cudnn().backward(nullptr, s));
    PLM_CHECK_CUDA(cudaDeviceSynchronize());
    EXPECT_TRUE(dqkv.download() == first)
        << "cuDNN backward not bitwise reproducible, head_dim " << D;
  }

  auto o_h = test::downloadBf16(o);
  auto lse_h = lse.download();
  double lse_err = 0.0;
  for (std::size_t i = 0; i < lse_h.size(); ++i)
    lse_err = std::max(lse_err, std::isfinite(lse_h[i]) ? std::abs(lse_h[i] - ref.lse[i]) : 1e30);
  EXPECT_LT(test::relError(o_h, ref.o), 1e-2) << "O, head_dim " << D;
  EXPECT_LT(lse_err, 2e-3) << "lse, head_dim " << D;
  EXPECT_LT(test::relError(test::downloadBf16(dq), ref.dq), 2e-2) << "dQ, head_dim " << D;
  EXPECT_LT(test::relError(test::downloadBf16(dk), ref.dk), 2e-2) << "dK, head_dim " << D;
  EXPECT_LT(test::relError(test::downloadBf16(dv), ref.dv), 2e-2) << "dV, head_dim " << D;

  // Length-1 sequences: the output is exactly V (softmax over one key), dK is zero.
  for (std::size_t s = 0; s < c.lengths.size(); ++s) {
    if (c.lengths[s] != 1) continue;
    std::int64_t t = cu[s];
    for (std::int64_t i = 0; i < row; ++i) EXPECT_NEAR(o_h[t * row + i], vv[t * row + i], 1e-2);
  }
}

class Attention : public ::testing::TestWithParam<Impl> {
 protected:
  void SetUp() override {
    if (!isFlash(GetParam()) && !cudnnAttentionAvailable())
      GTEST_SKIP() << "this build has no cuDNN attention";
  }
};

TEST_P(Attention, RaggedBatchHeadDim64) {
  checkCase({64, 3, {1, 1024, 37, 64, 65, 1, 200, 129, 7, 300}, 11}, GetParam());
}

TEST_P(Attention, RaggedBatchHeadDim128) {
  checkCase({128, 2, {513, 1, 1024, 31, 96, 2, 250}, 23}, GetParam());
}

TEST_P(Attention, RandomLengths) {
  std::mt19937 rng(5);
  std::uniform_int_distribution<int> len(1, 1024);
  std::vector<int> lengths;
  for (int i = 0; i < 6; ++i) lengths.push_back(len(rng));
  checkCase({64, 2, lengths, 31}, GetParam());
  checkCase({128, 1, lengths, 37}, GetParam());
}

TEST_P(Attention, SmallHeadDimsOfEsm2Presets) {
  // esm2_8m: 16, esm2_35m: 24 (zero-padded to 32 inside the flash kernels), esm2_150m: 32.
  checkCase({16, 3, {1, 130, 1024, 64}, 41}, GetParam());
  checkCase({24, 2, {77, 1, 300, 1024}, 43}, GetParam());
  checkCase({32, 2, {5, 640, 1}, 47}, GetParam());
}

TEST_P(Attention, SmallHeadDimsEmptyAndManySequences) {
  // Empty sequences among short and long ones; a realistic mix of many lengths (the 8M/35M
  // shapes: 20 heads in the model, fewer here to keep the host reference quick).
  if (GetParam() == Impl::Cudnn || GetParam() == Impl::CudnnForward)
    GTEST_SKIP() << "cuDNN attention buckets do not take empty sequences";
  checkCase({16, 2, {0, 1, 65, 0, 1024, 2, 0}, 61}, GetParam());
  checkCase({24, 2, {3, 0, 511, 64, 1}, 67}, GetParam());
  std::mt19937 rng(13);
  std::uniform_int_distribution<int> len(1, 400);
  std::vector<int> lengths;
  for (int i = 0; i < 30; ++i) lengths.push_back(len(rng));
  lengths.push_back(1024);
  checkCase({16, 4, lengths, 71}, GetParam());
  checkCase({32, 2, lengths, 73}, GetParam());
}

TEST_P(Attention, ManySequencesAcrossBatchBuckets) {
  // cuDNN graphs are cached per bucket of 16 sequences: 17 and 40 sequences use padded buckets.
  std::mt19937 rng(9);
  std::uniform_int_distribution<int> len(1, 300);
  for (int n : {17, 40}) {
    std::vector<int> lengths;
    for (int i = 0; i < n; ++i) lengths.push_back(len(rng));
    checkCase({64, 2, lengths, 53u + n}, GetParam());
  }
}

INSTANTIATE_TEST_SUITE_P(Kernels, Attention,
                         ::testing::Values(Impl::Flash, Impl::Cudnn, Impl::CudnnForward,
                                           Impl::FlashLegacy),
                         [](const ::testing::TestParamInfo<Impl>& i) {
                           switch (i.param) {
                             case Impl::Flash: return std::string("Flash");
                             case Impl::Cudnn: return std::string("Cudnn");
                             case Impl::CudnnForward:
                               return std::string("CudnnForwardFlashBackward");
                             case Impl::FlashLegacy: return std::string("FlashLegacy");
                           }
                           return std::string("Unknown");
                         });

// One 16,384-token sequence at ESM-2 650M's attention shape (20 heads of 64), both directions
// through cuDNN: a graph whose workspace would pass CudnnAttention::kMaxWorkspaceBytes is not
// run (false, with the reason) so the caller's own flash attention runs; what is held never
// passes the bound.  Where cuDNN runs it, the output is finite and its lse agrees with the own
// flash forward's.
TEST(CudnnAttention, LongSequenceWorkspaceStaysBounded) {
  if (!cudnnAttentionAvailable()) GTEST_SKIP() << "no cuDNN attention in this build";
  const int H = 20, D = 64, T = 16384;
  const std::int64_t row = std::int64_t(H) * D;
  std::vector<std::uint16_t> qkv(std::size_t(T) * 3 * row), dout(std::size_t(T) * row);
  std::uint64_t x = 12345;
  auto next = [&] {  // small values: bf16 of a uniform in [-0.5, 0.5)
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    const float f = static_cast<float>((x >> 40) & 0xFFFF) / 65536.0f - 0.5f;
    std::uint32_t b;
    std::memcpy(&b, &f, 4);
    return static_cast<std::uint16_t>(b >> 16);
  };
  for (auto& v : qkv) v = next();
  for (auto& v : dout) v = next();
  DeviceBuffer<std::uint16_t> qkv_dev(qkv), dout_dev(dout), o(std::size_t(T) * row),
      o_flash(std::size_t(T) * row), dqkv(std::size_t(T) * 3 * row);
  DeviceBuffer<float> lse(std::size_t(T) * H), lse_flash(std::size_t(T) * H),
      delta(std::size_t(T) * H);
  DeviceBuffer<std::int32_t> cu(std::vector<std::int32_t>{0, T});
  FlashParams p;
  p.q = reinterpret_cast<const bf16*>(qkv_dev.get());
  p.k = p.q + row;
  p.v = p.q + 2 * row;
  p.q_stride = p.k_stride = p.v_stride = 3 * row;
  p.o = reinterpret_cast<bf16*>(o.get());
  p.o_stride = row;
  p.lse = lse.get();
  p.cu_seqlens = cu.get();
  p.num_seqs = 1;
  p.max_seqlen = T;
  p.total_tokens = T;
  p.heads = H;
  p.head_dim = D;
  p.softmax_scale = 0.125f;
  p.dout = reinterpret_cast<const bf16*>(dout_dev.get());
  p.dout_stride = row;
  p.dq = reinterpret_cast<bf16*>(dqkv.get());
  p.dk = p.dq + row;
  p.dv = p.dq + 2 * row;
  p.dq_stride = p.dk_stride = p.dv_stride = 3 * row;
  p.delta = delta.get();
  CudnnAttention a(/*deterministic_backward=*/true);
  const bool fwd = a.forward(nullptr, p);
  if (!fwd) EXPECT_NE(a.whyNot().find("workspace"), std::string::npos) << a.whyNot();
  EXPECT_LE(a.workspaceBytes(), CudnnAttention::kMaxWorkspaceBytes);
  const bool bwd = a.backward(nullptr, p);
  if (!bwd) EXPECT_NE(a.whyNot().find("workspace"), std::string::npos) << a.whyNot();
  EXPECT_LE(a.workspaceBytes(), CudnnAttention::kMaxWorkspaceBytes);
  std::printf(
      "cuDNN at one %d-token sequence: forward %s, backward %s; workspace held %zu MiB%s%s\n", T,
      fwd ? "ran" : "refused", bwd ? "ran" : "refused", a.workspaceBytes() >> 20,
      a.whyNot().empty() ? "" : "; ", a.whyNot().c_str());
  if (fwd) {
    FlashParams f = p;
    f.o = reinterpret_cast<bf16*>(o_flash.get());
    f.lse = lse_flash.get();
    flashAttentionForward(nullptr, f);
    const auto l1 = lse.download(), l2 = lse_flash.download();
    double worst = 0;
    for (std::size_t i = 0; i < l1.size(); ++i) {
      ASSERT_TRUE(std::isfinite(l1[i])) << i;
      worst = std::max(worst, std::abs(double(l1[i]) - l2[i]));
    }
    EXPECT_LT(worst, 1e-2) << "cuDNN's lse against the own flash forward's";
  }
}

TEST(FlashAttention, RejectsUnsupportedHeadDim) {
  FlashParams p;
  p.head_dim = 20;
  EXPECT_THROW(flashAttentionForward(nullptr, p), Error);
}

}  // namespace
}  // namespace plm::gpu
