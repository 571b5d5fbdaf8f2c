// The FP8 cast kernels (src/gpu/fp8.cu) on the activation and gradient shapes of ESM-2 650M
// (T x 1280, 3840, 5120) and 3B (T x 2560, 7680, 10240) at T = 24,576 tokens, against a
// device-to-device copy of the same bytes measured in the same run:
//   fwd        castFp8 bf16 -> E4M3, codes + transposed codes (tokens padded to 16), amax
//   bwd        castFp8 bf16 -> E5M2, codes + transposed codes, amax, bias gradient (dY)
//   gelu       castFp8 with gelu (the FFN's GELU output cast from the pre-activation)
//   current    castFp8Current: amax pass, scale, cast with the transposed codes
//   amax       amaxFp8 alone
//   block      castFp8Block 1x128 + transposed 1x128 (X; with the bias gradient: dY)
//   block_gelu castFp8Block with gelu, split_tail layout
// GB/s = bytes read + written once each / time (scale arrays and column-sum partials left
// out: under 2% of the bytes).  CUDA events, warm-up first, medians of 15; random data.
//
//   bench_gpu_fp8_cast [T]      (default 24576)
#include "gpu/fp8.hpp"

#include "bench_util.hpp"
#include "core/error.hpp"

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <vector>

namespace {

using namespace plm::gpu;

struct Row {
  const char* kind;
  double ms, bytes;
};

// One (T, cols) tensor: every cast the training step runs on a tensor of that shape.
void castShape(const char* model, std::int64_t T, std::int64_t cols) {
  const std::int64_t ld_t = (T + 15) / 16 * 16;
  const double n = static_cast<double>(T) * static_cast<double>(cols);
  Buffer in(T * cols * 2), out(T * cols), out_t(cols * ld_t);
  Buffer scale(256), scale_inv(256), amax(256), cur(256), col_sum(cols * 4);
  Buffer work(fp8ColSumWorkspace(T, cols));
  fill(in, static_cast<std::size_t>(T * cols), 3.0f, static_cast<unsigned>(cols));
  const float one = 1.0f;
  PLM_CHECK_CUDA(cudaMemcpy(scale.ptr, &one, 4, cudaMemcpyHostToDevice));
  PLM_CHECK_CUDA(cudaMemset(amax.ptr, 0, 4));

  // The copy: 2n bytes read and 2n written, as many as the casts move.
  Buffer copy_dst(T * cols * 2);
  const double copy_ms = copyMs(copy_dst, in, T * cols * 2);
  const double copy_gbs = 4 * n / copy_ms / 1e6;

  std::vector<Row> rows;
  Fp8CastArgs a;
  a.rows = T;
  a.cols = cols;
  a.in = in.ptr;
  a.ld_in = cols;
  a.out_type = DType::E4M3;
  a.out = out.ptr;
  a.ld_out = cols;
  a.out_t = out_t.ptr;
  a.ld_out_t = ld_t;
  a.scale = scale.as<float>();
  a.scale_inv = scale_inv.as<float>();
  a.amax = amax.as<float>();
  a.amax_accumulate = true;  // delayed scaling max-accumulates over the micro-batches
  rows.push_back({"fwd", medianMs([&] { castFp8(nullptr, a); }), 4 * n});
  {
    Fp8CastArgs d = a;
    d.out_type = DType::E5M2;
    d.col_sum = col_sum.as<float>();
    d.workspace = work.ptr;
    rows.push_back({"bwd", medianMs([&] { castFp8(nullptr, d); }), 4 * n});
  }
  {
    Fp8CastArgs g = a;
    g.gelu = true;
    rows.push_back({"gelu", medianMs([&] { castFp8(nullptr, g); }), 4 * n});
  }
  {
    Fp8CastArgs c = a;
    c.amax_accumulate = false;
    rows.push_back(
        {"current", medianMs([&] { castFp8Current(nullptr, c, cur.as<float>()); }), 6 * n});
  }
  rows.push_back({"amax", medianMs([&] {
                    amaxFp8(nullptr, in.ptr, DType::BF16, T, cols, cols, amax.as<float>(), true);
                  }),
                  2 * n});
  {
    const BlockTailSplit split = blockTailSplit(T, cols);
    const auto lay_t = blockScaleLayout(Fp8ScaleMode::Block1x128, cols, T);
    Buffer codes(split.rows * cols), s(split.count * 4), s_t(lay_t.count * 4);
    Fp8BlockCastArgs b;
    b.rows = T;
    b.cols = cols;
    b.in = in.ptr;
    b.ld_in = cols;
    b.scaling = Fp8ScaleMode::Block1x128;
    b.out = codes.ptr;
    b.ld_out = cols;
    b.scale_inv = s.as<float>();
    b.out_t = out_t.ptr;
    b.ld_out_t = ld_t;
    b.scale_inv_t = s_t.as<float>();
    b.amax = amax.as<float>();
    b.amax_accumulate = true;
    b.split_tail = true;
    rows.push_back({"block", medianMs([&] { castFp8Block(nullptr, b); }), 4 * n});
    Fp8BlockCastArgs d = b;
    d.col_sum = col_sum.as<float>();
    d.workspace = work.ptr;
    rows.push_back({"block_dbias", medianMs([&] { castFp8Block(nullptr, d); }), 4 * n});
    Fp8BlockCastArgs g = b;
    g.gelu = true;
    rows.push_back({"block_gelu", medianMs([&] { castFp8Block(nullptr, g); }), 4 * n});
  }

  std::printf("\n%s (%ld, %ld): copy %.3f ms, %.0f GB/s\n", model, long(T), long(cols), copy_ms,
              copy_gbs);
  for (const Row& r : rows) {
    const double gbs = r.bytes / r.ms / 1e6;
    std::printf("  %-12s %8.3f ms  %6.0f GB/s  %5.1f%% of copy\n", r.kind, r.ms, gbs,
                100.0 * gbs / copy_gbs);
    std::printf("RESULT fp8_cast model=%s T=%ld cols=%ld kind=%s ms=%.4f gbs=%.0f pct_copy=%.1f\n",
                model, long(T), long(cols), r.kind, r.ms, gbs, 100.0 * gbs / copy_gbs);
  }
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const std::int64_t T = argc > 1 ? std::atoll(argv[1]) : 24576;
    if (T <= 0) {
      std::fprintf(stderr, "bench_gpu_fp8_cast: T must be a positive token count (got %s)\n",
                   argv[1]);
      return 2;
    }
    cudaDeviceProp prop{};
    PLM_CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
    std::printf("bench_gpu_fp8_cast: %s, %d SMs, T = %ld tokens\n", prop.name,
                prop.multiProcessorCount, long(T));
    const std::int64_t shapes_650m[] = {1280, 3840, 5120};
    const std::int64_t shapes_3b[] = {2560, 7680, 10240};
    for (std::int64_t c : shapes_650m) castShape("650m", T, c);
    for (std::int64_t c : shapes_3b) castShape("3b", T, c);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_gpu_fp8_cast: %s\n", e.what());
    return 1;
  }
}
