// FP8 against bf16 on the GEMMs of one ESM-2 650M encoder layer (hidden 1280, FFN 5120), for
// T tokens per micro-batch: each of the four Linear layers (QKV, attention out, FFN up, FFN
// down) in its three GEMMs (forward Y = X W^T, dgrad dX = dY W, wgrad dW += dY^T X in fp32), in
//   bf16       the layouts the bf16 model uses today (no transposed copies),
//   fp8 tensor per-tensor scales (delayed/current scaling): E4M3 forward with fast accumulation,
//              E5M2 gradients x E4M3 in the backward (the hybrid recipe), split accumulation,
//   fp8 block  1x128 activations/gradients x 128x128 weights, E4M3 both ways (Float8BlockScaling),
// then the FP8 cast kernels' bandwidth (bytes read + written, once each).  CUDA events, warm-up
// first, medians of 15; random data (never zeros).  Casts are timed separately, not in the GEMM
// columns: the training step pays them once per tensor, several GEMMs reuse each.
//
//   bench_gpu_fp8_gemm [T ...]      (default: 8192 16384)
#include "gpu/fp8.hpp"
#include "gpu/gemm.hpp"

#include "bench_util.hpp"
#include "core/error.hpp"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

namespace {

using namespace plm::gpu;

enum class Kind { Forward, Dgrad, Wgrad };
enum class Mode { Bf16, Fp8Tensor, Fp8Block };

// Operands for one GEMM in every mode: bf16 copies, FP8 codes (16-byte aligned rows) and scales.
struct GemmBench {
  std::int64_t m, n, k;
  Buffer a16, b16, d;       // bf16 A (as the bf16 model stores it), bf16 B, D (fp32-sized)
  Buffer a8, b8;            // FP8 (M,K), (N,K)
  Buffer a_scale, b_scale;  // per-tensor scale_inv or block scales (the larger)
  GemmBench(std::int64_t m_, std::int64_t n_, std::int64_t k_)
      : m(m_),
        n(n_),
        k(k_),
        a16(m * k * 2),
        b16(n * k * 2),
        d(m * n * 4),
        a8(m * k),
        b8(n * k),
        a_scale(4 *
                std::max<std::int64_t>(blockScaleLayout(Fp8ScaleMode::Block1x128, m, k).count, 1)),
        b_scale(4 * std::max(blockScaleLayout(Fp8ScaleMode::Block1x128, n, k).count,
                             blockScaleLayout(Fp8ScaleMode::Block128x128, n, k).count)) {
    PLM_CHECK_CUDA(cudaMemset(d.ptr, 0, m * n * 4));  // wgrad accumulates into it
  }
};

// Fills the FP8 operands through the cast kernels from random bf16 (so the codes and scales are
// what training would produce).
void prepare(GemmBench& g, Mode mode, Fp8ScaleMode b_block, DType a_type, DType b_type) {
  fill(g.a16, g.m * g.k, 1.0f, 1);
  fill(g.b16, g.n * g.k, 0.05f, 2);
  if (mode == Mode::Bf16) return;
  Buffer scale(4), amax(4);
  auto cast = [&](const Buffer& src, std::int64_t rows, const Buffer& dst, const Buffer& s, DType t,
                  Fp8ScaleMode sc) {
    if (mode == Mode::Fp8Tensor) {
      Fp8CastArgs c;
      c.rows = rows;
      c.cols = g.k;
      c.in = src.ptr;
      c.ld_in = g.k;
      c.out_type = t;
      c.out = dst.ptr;
      c.ld_out = g.k;
      c.amax = amax.as<float>();
      c.scale_inv = s.as<float>();
      castFp8Current(nullptr, c, scale.as<float>());
    } else {
      Fp8BlockCastArgs c;
      c.rows = rows;
      c.cols = g.k;
      c.in = src.ptr;
      c.ld_in = g.k;
      c.out_type = t;
      c.scaling = sc;
      c.out = dst.ptr;
      c.ld_out = g.k;
      c.scale_inv = s.as<float>();
      castFp8Block(nullptr, c);
    }
  };
  cast(g.a16, g.m, g.a8, g.a_scale, a_type, Fp8ScaleMode::Block1x128);
  cast(g.b16, g.n, g.b8, g.b_scale, b_type, b_block);
  PLM_CHECK_CUDA(cudaDeviceSynchronize());
}

// Times one GEMM; returns ms (negative when cuBLASLt refuses the combination).
double timeGemm(Gemm& gemm, GemmBench& g, Kind kind, Mode mode) {
  GemmArgs a;
  a.m = g.m;
  a.n = g.n;
  a.k = g.k;
  a.d = g.d.ptr;
  a.ldd = g.n;
  const bool wgrad = kind == Kind::Wgrad;
  a.d_type = wgrad ? DType::F32 : DType::BF16;
  a.beta = wgrad ? 1.0f : 0.0f;
  if (mode == Mode::Bf16) {
    // As the bf16 model lays them out: forward X (M,K) x W (N,K)^T; dgrad dY (M,K) x W (K,N);
    // wgrad dY^T x X with dY stored (K,M) and X stored (K,N).
    a.trans_a = wgrad;
    a.trans_b = kind == Kind::Forward;
    a.a = g.a16.ptr;
    a.lda = wgrad ? g.m : g.k;
    a.b = g.b16.ptr;
    a.ldb = kind == Kind::Forward ? g.k : g.n;
    prepare(g, mode, Fp8ScaleMode::Tensor, DType::E4M3, DType::E4M3);
  } else {
    const bool block = mode == Mode::Fp8Block;
    const DType grad = block ? DType::E4M3 : DType::E5M2;
    const DType a_type = kind == Kind::Forward ? DType::E4M3 : grad;
    const DType b_type = DType::E4M3;
    const Fp8ScaleMode b_scaling = !block  ? Fp8ScaleMode::Tensor
                                   : wgrad ? Fp8ScaleMode::Block1x128
                                           : Fp8ScaleMode::Block128x128;
    prepare(g, mode, b_scaling, a_type, b_type);
    a.trans_a = false;
    a.trans_b = true;
    a.a = g.a8.ptr;
    a.lda = g.k;
    a.b = g.b8.ptr;
    a.ldb = g.k;
    a.a_type = a_type;
    a.b_type = b_type;
    a.a_scale_inv = g.a_scale.as<float>();
    a.b_scale_inv = g.b_scale.as<float>();
    a.a_scaling = block ? Fp8ScaleMode::Block1x128 : Fp8ScaleMode::Tensor;
    a.b_scaling = b_scaling;
    a.fast_accum = !block && kind == Kind::Forward;
  }
  try {
    return medianMs([&] { gemm.run(nullptr, a); });
  } catch (const plm::Error& e) {
    std::printf("    (refused: %s)\n", e.what());
    return -1.0;
  }
}

void gemmTable(Gemm& gemm, std::int64_t T) {
  const std::int64_t C = 1280, F = 5120;
  struct Linear {
    const char* name;
    std::int64_t out, in;
  };
  const Linear linears[] = {
      {"qkv", 3 * C, C}, {"attn out", C, C}, {"ffn up", F, C}, {"ffn down", C, F}};
  std::printf(
      "\nT = %ld tokens: TFLOP/s (ms)      bf16                 fp8 tensor           "
      "fp8 block            tensor/bf16  block/bf16\n",
      long(T));
  double total[3] = {0, 0, 0};
  bool complete[3] = {true, true, true};
  double flops_total = 0;
  for (const Linear& l : linears) {
    for (Kind kind : {Kind::Forward, Kind::Dgrad, Kind::Wgrad}) {
      std::int64_t m = T, n = l.out, k = l.in;
      if (kind == Kind::Dgrad) n = l.in, k = l.out;
      if (kind == Kind::Wgrad) m = l.out, n = l.in, k = T;
      GemmBench g(m, n, k);
      const double flops = 2.0 * m * n * k;
      flops_total += flops;
      double ms[3];
      for (int mode = 0; mode < 3; ++mode) {
        ms[mode] = timeGemm(gemm, g, kind, static_cast<Mode>(mode));
        if (ms[mode] > 0)
          total[mode] += ms[mode];
        else
          complete[mode] = false;
      }
      char label[64];
      std::snprintf(label, sizeof label, "%s %s", l.name,
                    kind == Kind::Forward ? "fwd"
                    : kind == Kind::Dgrad ? "dgrad"
                                          : "wgrad");
      std::printf("  %-16s %5ld %5ld %5ld", label, long(m), long(n), long(k));
      for (double t : ms)
        if (t > 0)
          std::printf("  %7.1f (%7.3f)", flops / t / 1e9, t);
        else
          std::printf("  %17s", "refused");
      std::printf("  %8.2fx  %8.2fx\n", ms[1] > 0 ? ms[0] / ms[1] : 0.0,
                  ms[2] > 0 ? ms[0] / ms[2] : 0.0);
      std::fflush(stdout);
    }
  }
  std::printf("  %-34s", "layer total (12 GEMMs)");
  for (int mode = 0; mode < 3; ++mode)
    if (complete[mode])
      std::printf("  %7.1f (%7.3f)", flops_total / total[mode] / 1e9, total[mode]);
    else
      std::printf("  %17s", "incomplete");
  std::printf("  %8.2fx  %8.2fx\n", complete[1] ? total[0] / total[1] : 0.0,
              complete[2] ? total[0] / total[2] : 0.0);
  std::printf("RESULT fp8_gemm T=%ld layer_ms bf16=%.3f fp8_tensor=%.3f fp8_block=%.3f\n", long(T),
              total[0], complete[1] ? total[1] : -1.0, complete[2] ? total[2] : -1.0);
}

void castRow(const char* name, double ms, double bytes) {
  std::printf("  %-52s %8.3f ms  %7.0f GB/s\n", name, ms, bytes / ms / 1e6);
  std::fflush(stdout);
}

void castTable(std::int64_t T) {
  const std::int64_t C = 1280, F = 5120;
  std::printf("\nFP8 casts, T = %ld (GB/s = bytes read + written / time)\n", long(T));
  Buffer scale(4), scale_inv(4), amax(4), cur(4);
  const float one = 1.0f;
  PLM_CHECK_CUDA(cudaMemcpy(scale.ptr, &one, 4, cudaMemcpyHostToDevice));
  for (std::int64_t cols : {C, F}) {
    const std::int64_t rows = T;
    Buffer in(rows * cols * 2), out(rows * cols), out_t(rows * cols);
    fill(in, rows * cols, 3.0f, 9);
    const double n = static_cast<double>(rows * cols);
    Fp8CastArgs a;
    a.rows = rows;
    a.cols = cols;
    a.in = in.ptr;
    a.ld_in = cols;
    a.out_type = DType::E4M3;
    a.out = out.ptr;
    a.ld_out = cols;
    a.scale = scale.as<float>();
    a.scale_inv = scale_inv.as<float>();
    a.amax = amax.as<float>();
    char label[96];
    std::snprintf(label, sizeof label, "delayed bf16->e4m3 (%ld,%ld) + amax", long(rows),
                  long(cols));
    castRow(label, medianMs([&] { castFp8(nullptr, a); }), 3 * n);
    a.out_t = out_t.ptr;
    a.ld_out_t = rows;
    std::snprintf(label, sizeof label, "delayed bf16->e4m3 + transpose + amax (%ld,%ld)",
                  long(rows), long(cols));
    castRow(label, medianMs([&] { castFp8(nullptr, a); }), 4 * n);
    {
      // dY's cast in the backward: both copies, amax and the bias gradient (column sums).
      Buffer col_sum(cols * 4), work(fp8ColSumWorkspace(rows, cols));
      Fp8CastArgs d = a;
      d.out_type = DType::E5M2;
      d.col_sum = col_sum.as<float>();
      d.workspace = work.ptr;
      std::snprintf(label, sizeof label, "dY bf16->e5m2 + transpose + amax + dbias (%ld,%ld)",
                    long(rows), long(cols));
      castRow(label, medianMs([&] { castFp8(nullptr, d); }), 4 * n);
    }
    std::snprintf(label, sizeof label, "current (amax pass, cast) + transpose (%ld,%ld)",
                  long(rows), long(cols));
    castRow(label, medianMs([&] { castFp8Current(nullptr, a, cur.as<float>()); }), 6 * n);
    std::snprintf(label, sizeof label, "amax only (%ld,%ld)", long(rows), long(cols));
    castRow(label, medianMs([&] {
              amaxFp8(nullptr, in.ptr, DType::BF16, rows, cols, cols, amax.as<float>());
            }),
            2 * n);

    const auto lay = blockScaleLayout(Fp8ScaleMode::Block1x128, rows, cols);
    const auto lay_t = blockScaleLayout(Fp8ScaleMode::Block1x128, cols, rows);
    Buffer s(lay.count * 4), s_t(lay_t.count * 4);
    Fp8BlockCastArgs b;
    b.rows = rows;
    b.cols = cols;
    b.in = in.ptr;
    b.ld_in = cols;
    b.scaling = Fp8ScaleMode::Block1x128;
    b.out = out.ptr;
    b.ld_out = cols;
    b.scale_inv = s.as<float>();
    b.out_t = out_t.ptr;
    b.ld_out_t = rows;
    b.scale_inv_t = s_t.as<float>();
    std::snprintf(label, sizeof label, "block 1x128 + transposed 1x128 (%ld,%ld)", long(rows),
                  long(cols));
    castRow(label, medianMs([&] { castFp8Block(nullptr, b); }),
            4 * n + 4.0 * (lay.count + lay_t.count));
  }
  {
    // A weight: (F, C) with 128x128 blocks and its transposed copy, once per step.
    Buffer in(F * C * 2), out(F * C), out_t(F * C);
    fill(in, F * C, 0.05f, 10);
    const auto lay = blockScaleLayout(Fp8ScaleMode::Block128x128, F, C);
    const auto lay_t = blockScaleLayout(Fp8ScaleMode::Block128x128, C, F);
    Buffer s(lay.count * 4), s_t(lay_t.count * 4);
    Fp8BlockCastArgs b;
    b.rows = F;
    b.cols = C;
    b.in = in.ptr;
    b.ld_in = C;
    b.scaling = Fp8ScaleMode::Block128x128;
    b.out = out.ptr;
    b.ld_out = C;
    b.scale_inv = s.as<float>();
    b.out_t = out_t.ptr;
    b.ld_out_t = F;
    b.scale_inv_t = s_t.as<float>();
    castRow("weight block 128x128 + transpose (5120,1280)",
            medianMs([&] { castFp8Block(nullptr, b); }), 4.0 * F * C);
  }
}

}  // namespace

int main(int argc, char** argv) {
  try {
    std::vector<std::int64_t> tokens;
    for (int i = 1; i < argc; ++i) tokens.push_back(std::atoll(argv[i]));
    if (tokens.empty()) tokens = {8192, 16384};
    cudaDeviceProp prop{};
    PLM_CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
    std::printf("bench_gpu_fp8_gemm: %s, %d SMs; ESM-2 650M layer GEMMs (hidden 1280, ffn 5120)\n",
                prop.name, prop.multiProcessorCount);
    Gemm gemm;
    {
      GemmBench g(8192, 8192, 8192);
      const double flops = 2.0 * 8192 * 8192 * 8192;
      std::printf("ceiling 8192^3 TFLOP/s:");
      const char* names[] = {"bf16", "fp8 tensor fwd", "fp8 block fwd"};
      for (int mode = 0; mode < 3; ++mode) {
        double ms = timeGemm(gemm, g, Kind::Forward, static_cast<Mode>(mode));
        if (ms > 0) std::printf("  %s %.1f", names[mode], flops / ms / 1e9);
      }
      std::printf("\n");
    }
    for (std::int64_t T : tokens) gemmTable(gemm, T);
    for (std::int64_t T : tokens) castTable(T);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_gpu_fp8_gemm: %s\n", e.what());
    return 1;
  }
}
