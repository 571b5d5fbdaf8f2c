// cuBLASLt GEMMs (every epilogue, transposes, fp32 accumulation into existing values) against
// the plain reference kernel, and the reference against a host double computation; the same
// with autotuning on (the timed candidates must leave the call's outputs, the accumulated ones
// included, as one run of the chosen algorithm writes them) and with choices read back from the
// cache file; split-K and stream-K (train.gemm_split) on weight-gradient-like shapes against a host
// double reference.
#include "gpu/gemm.hpp"
#include "gpu_test_util.hpp"

#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <memory>
#include <string>

namespace plm::gpu {
namespace {

using test::Bf16Tensor;
using test::DeviceBuffer;

struct Case {
  const char* name;
  bool trans_a, trans_b;
  std::int64_t m, n, k;
  Epilogue epilogue;
  DType d_type;
  float beta;
};

class GemmTest : public ::testing::TestWithParam<Case> {};

void checkCase(const Case& c) {
  std::uint64_t seed = 1000 + c.m + 7 * c.n + 13 * c.k + static_cast<int>(c.epilogue);
  std::int64_t a_rows = c.trans_a ? c.k : c.m, a_cols = c.trans_a ? c.m : c.k;
  std::int64_t b_rows = c.trans_b ? c.n : c.k, b_cols = c.trans_b ? c.k : c.n;
  Bf16Tensor a(test::randomNormal(a_rows * a_cols, seed));
  Bf16Tensor b(test::randomNormal(b_rows * b_cols, seed + 1));
  Bf16Tensor aux_in(test::randomNormal(c.m * c.n, seed + 2));
  std::vector<float> bias_values = test::randomNormal(c.n, seed + 3);
  Bf16Tensor bias16(bias_values);
  DeviceBuffer<float> bias32(bias_values);
  std::vector<float> d0 = test::randomNormal(c.m * c.n, seed + 4);

  GemmArgs g;
  g.trans_a = c.trans_a;
  g.trans_b = c.trans_b;
  g.m = c.m;
  g.n = c.n;
  g.k = c.k;
  g.a = a.get();
  g.lda = a_cols;
  g.b = b.get();
  g.ldb = b_cols;
  g.ldd = c.n;
  g.d_type = c.d_type;
  g.beta = c.beta;
  g.alpha = 0.75f;
  g.epilogue = c.epilogue;
  g.bias = c.d_type == DType::F32 ? static_cast<const void*>(bias32.get())
                                  : static_cast<const void*>(bias16.get());
  g.ldaux = c.n;

  std::int64_t bias_grad_len = c.epilogue == Epilogue::BGradA ? c.m : c.n;
  auto run = [&](bool reference, std::vector<float>& d_out, std::vector<float>& aux_out,
                 std::vector<float>& bgrad_out) {
    DeviceBuffer<float> d32(c.m * c.n);
    DeviceBuffer<std::uint16_t> d16(c.m * c.n);
    DeviceBuffer<std::uint16_t> aux(c.m * c.n);
    DeviceBuffer<float> bgrad(bias_grad_len);
    if (c.beta != 0.0f) {
      d32.upload(d0);
      Bf16Tensor tmp(d0);
      PLM_CHECK_CUDA(cudaMemcpy(d16.get(), tmp.get(), c.m * c.n * 2, cudaMemcpyDeviceToDevice));
    } else {
      d32.poison();
      d16.poison();
    }
    if (c.epilogue == Epilogue::DGelu)
      PLM_CHECK_CUDA(cudaMemcpy(aux.get(), aux_in.get(), c.m * c.n * 2, cudaMemcpyDeviceToDevice));
    else
      aux.poison();
    bgrad.poison();
    g.d = c.d_type == DType::F32 ? static_cast<void*>(d32.get()) : static_cast<void*>(d16.get());
    g.aux = aux.get();
    g.bias_grad = bgrad.get();
    if (reference) {
      gemmReference(nullptr, g);
    } else {
      Gemm gemm;
      if (c.beta == 0.0f) gemm.run(nullptr, g);  // twice: the second run uses the cached plan
      gemm.run(nullptr, g);
      EXPECT_EQ(gemm.numPlans(), 1u);
    }
    d_out = c.d_type == DType::F32 ? d32.download() : test::downloadBf16(d16);
    aux_out = test::downloadBf16(aux);
    bgrad_out = bgrad.download();
  };
  std::vector<float> d_lt, aux_lt, bg_lt, d_ref, aux_ref, bg_ref;
  run(false, d_lt, aux_lt, bg_lt);
  run(true, d_ref, aux_ref, bg_ref);

  double tol = c.d_type == DType::F32 ? 1e-4 : 1e-2;
  EXPECT_LT(test::relError(d_lt, d_ref), tol) << c.name;
  if (c.epilogue == Epilogue::BiasGeluAux) EXPECT_LT(test::relError(aux_lt, aux_ref), 1e-2);
  if (c.epilogue == Epilogue::BGradA) EXPECT_LT(test::relError(bg_lt, bg_ref), 1e-3) << c.name;

  // The reference itself against the host, in double, for the plain product.
  if (c.epilogue == Epilogue::None || c.epilogue == Epilogue::Bias) {
    std::vector<double> host(c.m * c.n);
    std::vector<float> bias_host = c.d_type == DType::F32 ? bias_values : bias16.values;
    for (std::int64_t i = 0; i < c.m; ++i)
      for (std::int64_t j = 0; j < c.n; ++j) {
        double s = 0.0;
        for (std::int64_t k = 0; k < c.k; ++k) {
          double x = a.values[c.trans_a ? k * a_cols + i : i * a_cols + k];
          double y = b.values[c.trans_b ? j * b_cols + k : k * b_cols + j];
          s += x * y;
        }
        s *= g.alpha;
        if (c.beta != 0.0f)
          s += c.beta *
               (c.d_type == DType::F32 ? d0[i * c.n + j] : test::roundBf16(d0[i * c.n + j]));
        if (c.epilogue == Epilogue::Bias) s += bias_host[j];
        host[i * c.n + j] = s;
      }
    EXPECT_LT(test::relError(d_ref, host), c.d_type == DType::F32 ? 1e-5 : 1e-2) << c.name;
  }
}

TEST_P(GemmTest, MatchesReference) { checkCase(GetParam()); }

TEST_P(GemmTest, AutotunedMatchesReference) {
  const std::string file =
      ::testing::TempDir() + "plm_gemm_autotune_" + std::string(GetParam().name) + ".txt";
  std::remove(file.c_str());
  setGemmAutotune(true, file);
  checkCase(GetParam());  // timed: the choice is appended to the file
  std::ifstream in(file);
  std::string line;
  int lines = 0;
  while (std::getline(in, line)) ++lines;
  EXPECT_EQ(lines, 1) << "one tuned shape, one line in " << file;
  setGemmAutotune(true, file);  // read back: the process's choices come from the file now
  checkCase(GetParam());
  setGemmAutotune(false);
  std::remove(file.c_str());
}

int lineCount(const std::string& file) {
  std::ifstream in(file);
  std::string line;
  int lines = 0;
  while (std::getline(in, line)) ++lines;
  return lines;
}

TEST(GemmAutotune, SizesOfOneBucketShareTheirChoice) {
  // Packed batches change M with every micro-batch.  9,000 and 9,100 rows share the size
  // bucket ~9,216: the second shape runs the first one's algorithm without timing (no new
  // line); 4,000 rows (bucket ~4,096) are tuned anew.
  const std::string file = ::testing::TempDir() + "plm_gemm_autotune_bucket.txt";
  std::remove(file.c_str());
  setGemmAutotune(true, file);
  Case c{"bucket", false, true, 9000, 256, 128, Epilogue::Bias, DType::BF16, 0.0f};
  checkCase(c);
  EXPECT_EQ(lineCount(file), 1);
  c.m = 9100;
  checkCase(c);
  EXPECT_EQ(lineCount(file), 1) << "9,100 rows should reuse the choice tuned at 9,000";
  c.m = 4000;
  checkCase(c);
  EXPECT_EQ(lineCount(file), 2) << "4,000 rows have a key of their own";
  setGemmAutotune(true, file);  // read back: the choices come from the file
  c.m = 9050;
  checkCase(c);
  EXPECT_EQ(lineCount(file), 2);
  setGemmAutotune(false);
  std::remove(file.c_str());
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, GemmTest,
    ::testing::Values(
        Case{"linear_fwd_bias", false, true, 300, 192, 136, Epilogue::Bias, DType::BF16, 0.0f},
        Case{"ffn_up_gelu_aux", false, true, 256, 512, 128, Epilogue::BiasGeluAux, DType::BF16,
             0.0f},
        Case{"ffn_dgelu", false, false, 256, 512, 128, Epilogue::DGelu, DType::BF16, 0.0f},
        Case{"weight_grad_bgrad_accumulate", true, false, 192, 136, 300, Epilogue::BGradA,
             DType::F32, 1.0f},
        Case{"plain_fp32", false, false, 64, 40, 520, Epilogue::None, DType::F32, 0.0f},
        Case{"plain_bf16_accumulate", true, true, 72, 88, 96, Epilogue::None, DType::BF16, 1.0f}),
    [](const ::testing::TestParamInfo<Case>& info) { return std::string(info.param.name); });

// ---- split-K and stream-K (train.gemm_split) ----------------------------------------------
// Weight-gradient-like shapes (dW = alpha dY^T X + beta dW, K = tokens long against a small
// output) with K split in a forced number of parts, by the rule, among the autotune's variants
// and by CUTLASS's stream-K kernel, against a host double reference: the bias gradient from the
// separate pass, fp32 outputs, and a bf16 output, which must run unsplit; K in parts of equal
// length only (a K that the count does not divide runs unsplit: cuBLASLt left out its remainder).

struct SplitCase {
  const char* name;
  bool trans_a;
  std::int64_t m, n, k;
  Epilogue epilogue;
  DType d_type;
  float beta;
};

struct SplitResult {
  std::vector<float> d, bias_grad;
  Gemm::PlanInfo info;
};

class GemmSplitKTest : public ::testing::TestWithParam<SplitCase> {
 protected:
  void SetUp() override {
    const SplitCase& c = GetParam();
    const std::uint64_t seed = 77 + c.m + 3 * c.n + 5 * c.k;
    a_rows = c.trans_a ? c.k : c.m;
    a_cols = c.trans_a ? c.m : c.k;
    a = std::make_unique<Bf16Tensor>(test::randomNormal(a_rows * a_cols, seed));
    b = std::make_unique<Bf16Tensor>(test::randomNormal(c.k * c.n, seed + 1));
    d0 = test::randomNormal(c.m * c.n, seed + 2);
    if (c.d_type == DType::BF16)
      for (float& v : d0) v = test::roundBf16(v);
    // Host reference in double from the bf16 values the device holds.
    ref.assign(c.m * c.n, 0.0);
    ref_bias.assign(c.m, 0.0);
    for (std::int64_t i = 0; i < c.m; ++i) {
      for (std::int64_t k = 0; k < c.k; ++k) {
        const double x = a->values[c.trans_a ? k * a_cols + i : i * a_cols + k];
        ref_bias[i] += x;
        for (std::int64_t j = 0; j < c.n; ++j) ref[i * c.n + j] += x * b->values[k * c.n + j];
      }
      for (std::int64_t j = 0; j < c.n; ++j)
        ref[i * c.n + j] = alpha * ref[i * c.n + j] + c.beta * d0[i * c.n + j];
    }
  }

  SplitResult run() {
    const SplitCase& c = GetParam();
    DeviceBuffer<float> d32(c.m * c.n), bgrad(c.m);
    DeviceBuffer<std::uint16_t> d16(c.m * c.n);
    d32.upload(d0);
    Bf16Tensor d0_16(d0);
    PLM_CHECK_CUDA(cudaMemcpy(d16.get(), d0_16.get(), c.m * c.n * 2, cudaMemcpyDeviceToDevice));
    bgrad.poison();
    GemmArgs g;
    g.trans_a = c.trans_a;
    g.m = c.m;
    g.n = c.n;
    g.k = c.k;
    g.a = a->get();
    g.lda = a_cols;
    g.b = b->get();
    g.ldb = c.n;
    g.d = c.d_type == DType::F32 ? static_cast<void*>(d32.get()) : static_cast<void*>(d16.get());
    g.ldd = c.n;
    g.d_type = c.d_type;
    g.alpha = alpha;
    g.beta = c.beta;
    g.epilogue = c.epilogue;
    g.bias_grad = bgrad.get();
    Gemm gemm;  // a fresh plan cache: the current split-K setting applies
    SplitResult r;
    r.info = gemm.planInfo(nullptr, g);
    gemm.run(nullptr, g);
    PLM_CHECK_CUDA(cudaDeviceSynchronize());
    r.d = c.d_type == DType::F32 ? d32.download() : test::downloadBf16(d16);
    if (c.epilogue == Epilogue::BGradA) r.bias_grad = bgrad.download();
    return r;
  }

  void expectMatches(const SplitResult& r, const std::string& what) {
    const SplitCase& c = GetParam();
    EXPECT_LT(test::relError(r.d, ref), c.d_type == DType::F32 ? 1e-4 : 1e-2) << what;
    if (c.epilogue == Epilogue::BGradA) {
      EXPECT_LT(test::relError(r.bias_grad, ref_bias), 1e-4) << what;
    }
  }

  const float alpha = 0.75f;
  std::int64_t a_rows = 0, a_cols = 0;
  std::unique_ptr<Bf16Tensor> a, b;
  std::vector<float> d0;
  std::vector<double> ref, ref_bias;
};

TEST_P(GemmSplitKTest, ForcedSplitsMatchDoubleReference) {
  const SplitCase& c = GetParam();
  int split_runs = 0;
  for (int splits : {2, 3, 4, 5, 7, 8}) {
    setGemmSplit(GemmSplit::SplitK, splits);
    const SplitResult r = run();
    const SplitResult again = run();
    setGemmSplit(GemmSplit::Off);
    const std::string what = std::string(c.name) + " forced " + std::to_string(splits) +
                             " splits, ran " + std::to_string(r.info.splits) +
                             (r.info.bias_pass ? " with the bias pass" : "");
    expectMatches(r, what);
    EXPECT_EQ(r.d, again.d) << what << ": two runs differ (the reduction order must be fixed)";
    EXPECT_EQ(r.bias_grad, again.bias_grad) << what;
    // cuBLASLt may decline a split count; what it runs is either unsplit or exactly the count,
    // and only a count that divides K.
    EXPECT_TRUE(r.info.splits == 1 || r.info.splits == splits) << what;
    if (c.k % splits != 0) {
      EXPECT_EQ(r.info.splits, 1) << what;
    }
    // A split GEMM writes fp32 and carries no epilogue (gemm.cu, splitEligible).
    if (c.d_type != DType::F32) {
      EXPECT_EQ(r.info.splits, 1) << what;
    }
    if (c.epilogue == Epilogue::BGradA && r.info.splits > 1) {
      EXPECT_TRUE(r.info.bias_pass) << what;
    }
    if (r.info.splits > 1) ++split_runs;
    std::printf("  %s\n", what.c_str());
  }
  // The plain fp32 weight-gradient layout is what split-K is for: cuBLASLt must take it.
  if (c.epilogue == Epilogue::None && c.d_type == DType::F32 && c.trans_a) {
    EXPECT_GT(split_runs, 0) << c.name << ": no forced split count was accepted";
  }
}

// CUTLASS's stream-K kernel where built: the weight-gradient layout with an fp32 output only.
TEST_P(GemmSplitKTest, StreamKMatchesDoubleReference) {
  const SplitCase& c = GetParam();
  setGemmSplit(GemmSplit::StreamK);
  const SplitResult r = run();
  const SplitResult again = run();
  setGemmSplit(GemmSplit::Off);
  const bool takes = gemmStreamKCompiled() && c.trans_a && c.d_type == DType::F32;
  const std::string what =
      std::string(c.name) + " forced stream-K, ran " + (r.info.streamk ? "stream-K" : "cuBLASLt");
  std::printf("  %s\n", what.c_str());
  EXPECT_EQ(r.info.streamk, takes) << what;
  expectMatches(r, what);
  EXPECT_EQ(r.d, again.d) << what << ": two runs differ (the reduction order must be fixed)";
  EXPECT_EQ(r.bias_grad, again.bias_grad) << what;
}

TEST_P(GemmSplitKTest, RuleAndAutotuneMatchDoubleReference) {
  const SplitCase& c = GetParam();
  setGemmSplit(GemmSplit::SplitK);
  const SplitResult rule = run();
  expectMatches(rule,
                std::string(c.name) + " rule, " + std::to_string(rule.info.splits) + " splits");
  setGemmAutotune(true);  // memory only: the split variants are timed with the heuristic's list
  const SplitResult tuned = run();
  setGemmAutotune(false);
  setGemmSplit(GemmSplit::Off);
  expectMatches(
      tuned, std::string(c.name) + " autotuned, " + std::to_string(tuned.info.splits) + " splits");
  const SplitResult off = run();
  expectMatches(off, std::string(c.name) + " split-K off");
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, GemmSplitKTest,
    ::testing::Values(
        // dW (136, 96) += dY^T X over 4104 tokens, bias gradient of dY's columns.
        SplitCase{"wgrad_bgrad_accumulate", true, 136, 96, 4104, Epilogue::BGradA, DType::F32,
                  1.0f},
        SplitCase{"wgrad_fp32_write", true, 64, 200, 3000, Epilogue::None, DType::F32, 0.0f},
        SplitCase{"wgrad_bf16_accumulate", true, 72, 88, 2051, Epilogue::None, DType::BF16, 1.0f},
        SplitCase{"nn_fp32_accumulate", false, 40, 56, 1040, Epilogue::None, DType::F32, 1.0f}),
    [](const ::testing::TestParamInfo<SplitCase>& info) { return std::string(info.param.name); });

// K around a multiple of 16 (the tokens of a packed micro-batch take any value), every split
// count: a split runs only where the count divides K, and then gives the unsplit GEMM's D to
// fp32 rounding (cuBLASLt's 4- and 8-part splits of K = 4099 dropped the last 3 rows).
TEST(GemmSplitK, EveryCountMatchesUnsplitAcrossK) {
  const std::int64_t m = 136, n = 96;
  int split_runs = 0;
  for (std::int64_t k = 4096; k <= 4105; ++k) {
    Bf16Tensor a(test::randomNormal(k * m, 5 + k)), b(test::randomNormal(k * n, 6 + k));
    const std::vector<float> d0 = test::randomNormal(m * n, 7 + k);
    auto run = [&](GemmSplit mode, int splits, Gemm::PlanInfo& info) {
      DeviceBuffer<float> d(d0);
      GemmArgs g;
      g.trans_a = true;
      g.m = m;
      g.n = n;
      g.k = k;
      g.a = a.get();
      g.lda = m;
      g.b = b.get();
      g.ldb = n;
      g.d = d.get();
      g.ldd = n;
      g.d_type = DType::F32;
      g.beta = 1.0f;
      setGemmSplit(mode, splits);
      Gemm gemm;
      info = gemm.planInfo(nullptr, g);
      gemm.run(nullptr, g);
      setGemmSplit(GemmSplit::Off);
      PLM_CHECK_CUDA(cudaDeviceSynchronize());
      return d.download();
    };
    Gemm::PlanInfo info;
    const std::vector<float> unsplit = run(GemmSplit::Off, 0, info);
    for (int splits : {2, 3, 4, 5, 6, 8, 12, 16}) {
      const std::vector<float> d = run(GemmSplit::SplitK, splits, info);
      const std::string what = "K " + std::to_string(k) + ", " + std::to_string(splits) +
                               " parts asked, " + std::to_string(info.splits) + " ran";
      if (k % splits != 0) {
        EXPECT_EQ(info.splits, 1) << what;
      }
      if (info.splits > 1) ++split_runs;
      EXPECT_LT(test::relError(d, unsplit), 1e-5) << what;
    }
  }
  EXPECT_GT(split_runs, 0) << "cuBLASLt took no split count at any K";
}

}  // namespace
}  // namespace plm::gpu
