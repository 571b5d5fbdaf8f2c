// bf16 ring attention on the GPU (model/context_parallel.hpp's CUDA ring; CUDA build, 2 or 4
// ranks, one GPU each over NCCL or sharing one through staged MPI): for every context group
// of the world, each shard's output, log-sum-exp, dQ, dK and dV, with q, k, v inside one fused
// (T, 3 hidden) bf16 buffer as the model keeps them, against
//  - one rank's bf16 attention over the whole packed batch (the attention dispatch point:
//    cuDNN or the own flash attention), and
//  - the fp32 ring (the portable reference) on the same bf16-rounded inputs,
// at head_dim 32 (the own flash attention) and 64 (cuDNN for the diagonal block where the build
// has it), for sequences of 1 to 1,000 tokens (empty shards and empty key blocks included).
// Tolerance: bf16 rounding (2e-2 of the largest value of each tensor).
#include "../gpu/gpu_test_util.hpp"
#include "../model/model_test_util.hpp"
#include "data/context_split.hpp"
#include "dist/communicator.hpp"
#include "dist/process_groups.hpp"
#include "dist/runtime.hpp"
#include "model/context_parallel.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

namespace {

using namespace plm;
using plm::gpu::test::fromBf16Bits;
using plm::gpu::test::toBf16Bits;

using Bits = std::uint16_t;
using HostMat = std::vector<float>;
using plm::model::DType;
using plm::model::Mat;

/// Host (rows, cols) -> device bf16 / fp32 views.
View2<Bits> bf16View(const HostMat& x, std::int64_t rows, std::int64_t cols) {
  std::vector<Bits> b(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) b[i] = toBf16Bits(x[i]);
  View2<Bits> v("plm::test::bf16", rows, cols);
  Kokkos::deep_copy(v, Kokkos::View<Bits**, Kokkos::LayoutRight, HostSpace>(b.data(), rows, cols));
  return v;
}
View2<float> floatView(const HostMat& x, std::int64_t rows, std::int64_t cols) {
  View2<float> v("plm::test::f32", rows, cols);
  Kokkos::deep_copy(
      v, Kokkos::View<const float**, Kokkos::LayoutRight, HostSpace>(x.data(), rows, cols));
  return v;
}

/// Columns [c0, c0 + n) of every row of a device (rows, ld) matrix, as floats.
HostMat columns(const Mat& m, std::int64_t c0, std::int64_t n) {
  const std::int64_t rows = m.rows, ld = m.ld;
  HostMat out(static_cast<std::size_t>(rows * n));
  if (m.dtype == DType::BF16) {
    std::vector<Bits> h(static_cast<std::size_t>(rows * ld));
    Kokkos::deep_copy(Kokkos::View<Bits*, HostSpace>(h.data(), h.size()),
                      View1<Bits>(static_cast<Bits*>(m.data), h.size()));
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t c = 0; c < n; ++c) out[r * n + c] = fromBf16Bits(h[r * ld + c0 + c]);
  } else {
    std::vector<float> h(static_cast<std::size_t>(rows * ld));
    Kokkos::deep_copy(Kokkos::View<float*, HostSpace>(h.data(), h.size()),
                      View1<float>(static_cast<float*>(m.data), h.size()));
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t c = 0; c < n; ++c) out[r * n + c] = h[r * ld + c0 + c];
  }
  return out;
}

/// Rows of a whole-batch host matrix (width w) for the tokens of `shard`, in its order.
HostMat shardRows(const HostMat& full, std::int64_t w, const data::MicroBatch& batch,
                  const data::MicroBatch& shard) {
  HostMat out(static_cast<std::size_t>(shard.numTokens() * w));
  for (int s = 0; s < shard.numSequences(); ++s)
    for (int t = shard.cu_seqlens(s); t < shard.cu_seqlens(s + 1); ++t) {
      const std::int64_t g = batch.cu_seqlens(s) + shard.context->positions[t];
      for (std::int64_t c = 0; c < w; ++c) out[t * w + c] = full[g * w + c];
    }
  return out;
}

double relDiff(const HostMat& got, const HostMat& ref) {
  double d = 0, scale = 0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    d = std::max(d, std::abs(double(got[i]) - double(ref[i])));
    scale = std::max(scale, std::abs(double(ref[i])));
  }
  return d / std::max(scale, 1e-30);
}

struct Result {
  HostMat o, lse, dq, dk, dv;
};

/// Attention of (q | k | v), forward and backward, through the ring when `ring` is given, else
/// the one-rank dispatch point: in bf16 held fused in one (T, 3h) buffer as the model keeps
/// them, in fp32 as three contiguous (T, h) matrices.
Result run(model::OpContext& ctx, const HostMat& qkv3, const HostMat& dout, std::int64_t t, int h,
           int heads, DType dtype, const data::MicroBatch& batch, model::RingAttention* ring) {
  const bool b16 = dtype == DType::BF16;
  View2<Bits> qkv_b, o_b, dout_b, g_b;
  View2<float> qkv_f, o_f, dout_f, g_f;
  View2<float> lse("plm::test::lse", t, heads), delta("plm::test::delta", t, heads);
  Mat qkv, o, dO, g;
  model::Qkv in, grads;
  if (b16) {
    qkv_b = bf16View(qkv3, t, 3 * h);
    dout_b = bf16View(dout, t, h);
    o_b = View2<Bits>("plm::test::o", t, h);
    g_b = View2<Bits>("plm::test::dqkv", t, 3 * h);
    qkv = Mat{qkv_b.data(), dtype, t, 3 * h, 3 * h};
    o = Mat{o_b.data(), dtype, t, h, h};
    dO = Mat{dout_b.data(), dtype, t, h, h};
    g = Mat{g_b.data(), dtype, t, 3 * h, 3 * h};
    in = {qkv.columns(0, h), qkv.columns(h, h), qkv.columns(2 * h, h)};
    grads = {g.columns(0, h), g.columns(h, h), g.columns(2 * h, h)};
  } else {
    // The fp32 model keeps q, k and v apart (only the bf16 compute copy is fused), and the
    // portable kernels take contiguous matrices: three (t, h) blocks one after the other.
    HostMat apart(qkv3.size());
    for (std::int64_t r = 0; r < t; ++r)
      for (int p = 0; p < 3; ++p)
        for (int c = 0; c < h; ++c) apart[(p * t + r) * h + c] = qkv3[r * 3 * h + p * h + c];
    qkv_f = floatView(apart, 3 * t, h);
    dout_f = floatView(dout, t, h);
    o_f = View2<float>("plm::test::o", t, h);
    g_f = View2<float>("plm::test::dqkv", 3 * t, h);
    o = model::matOf(o_f);
    dO = model::matOf(dout_f);
    auto part = [&](const View2<float>& v, int p) {
      return Mat{v.data() + p * t * h, DType::F32, t, h, h};
    };
    in = {part(qkv_f, 0), part(qkv_f, 1), part(qkv_f, 2)};
    grads = {part(g_f, 0), part(g_f, 1), part(g_f, 2)};
  }
  model::DeviceBatch b;
  b.tokens = t;
  b.num_seqs = batch.numSequences();
  b.cu_seqlens = View1<seqlen_t>("plm::test::cu", b.num_seqs + 1);
  Kokkos::deep_copy(b.cu_seqlens, Kokkos::View<const seqlen_t*, HostSpace>(batch.cu_seqlens.data(),
                                                                           b.num_seqs + 1));
  for (int s = 0; s < b.num_seqs; ++s)
    b.max_seqlen = std::max<int>(b.max_seqlen, batch.cu_seqlens(s + 1) - batch.cu_seqlens(s));
  b.ring = ring;
  if (ring) ring->setLayout(ctx.space(), batch.context->rank_cu_seqlens, b.num_seqs);
  model::attention(ctx, b, in, heads, o, model::matOf(lse));
  model::attentionBackward(ctx, b, in, o, model::matOf(lse), dO, heads, model::matOf(delta), grads);
  ctx.space().fence();
  Result r;
  r.o = columns(o, 0, h);
  r.lse = columns(model::matOf(lse), 0, heads);
  r.dq = b16 ? columns(g, 0, h) : columns(grads.q, 0, h);
  r.dk = b16 ? columns(g, h, h) : columns(grads.k, 0, h);
  r.dv = b16 ? columns(g, 2 * h, h) : columns(grads.v, 0, h);
  return r;
}

void ringMatches(MPI_Comm group, int head_dim, const std::string& what) {
  auto comm = dist::makeCommunicator(group, dist::defaultBackend(group));
  const int c = comm->size(), r = comm->rank();
  const int heads = 4, h = heads * head_dim;
  const data::MicroBatch batch =
      model::test::makeBatch({1, 2, 3, 5, 8, 17, 40, 129, 300, 7, 1000}, 11);
  const std::int64_t tokens = batch.numTokens();
  // Whole inputs, the same on every rank; q scaled by head_dim^-1/2 as ESM-2 does, and every
  // value rounded to bf16 so that both precisions see the same numbers.
  HostMat qkv3 = plm::gpu::test::randomNormal(static_cast<std::size_t>(tokens * 3 * h), 21);
  HostMat dout = plm::gpu::test::randomNormal(static_cast<std::size_t>(tokens * h), 22);
  for (std::int64_t t = 0; t < tokens; ++t)
    for (int e = 0; e < h; ++e) qkv3[t * 3 * h + e] /= std::sqrt(float(head_dim));
  for (auto& x : qkv3) x = plm::gpu::test::roundBf16(x);
  for (auto& x : dout) x = plm::gpu::test::roundBf16(x);

  const ExecSpace space;
  model::OpContext ctx(space);
  const Result whole = run(ctx, qkv3, dout, tokens, h, heads, DType::BF16, batch, nullptr);

  const data::MicroBatch shard = data::contextShard(batch, c, r);
  const std::int64_t local = shard.numTokens();
  const HostMat qkv_l = shardRows(qkv3, 3 * h, batch, shard);
  const HostMat dout_l = shardRows(dout, h, batch, shard);
  model::RingAttention ring(*comm);
  Result got, ref32;
  for (int pass = 0; pass < 2; ++pass)  // the second pass reuses the ring's buffers
    got = run(ctx, qkv_l, dout_l, local, h, heads, DType::BF16, shard, &ring);
  ref32 = run(ctx, qkv_l, dout_l, local, h, heads, DType::F32, shard, &ring);

  struct Check {
    const char* name;
    const HostMat &got, &whole, &fp32;
    std::int64_t width;
  };
  double worst_whole = 0, worst_fp32 = 0;
  for (const Check& ch :
       {Check{"out", got.o, whole.o, ref32.o, h},
        Check{"lse", got.lse, whole.lse, ref32.lse, heads},
        Check{"dq", got.dq, whole.dq, ref32.dq, h}, Check{"dk", got.dk, whole.dk, ref32.dk, h},
        Check{"dv", got.dv, whole.dv, ref32.dv, h}}) {
    if (local == 0) continue;
    const double a = relDiff(ch.got, shardRows(ch.whole, ch.width, batch, shard));
    const double b = relDiff(ch.got, ch.fp32);
    EXPECT_LE(a, 2e-2) << what << ": " << ch.name << " of rank " << r << " of " << c
                       << " against one rank's bf16 attention";
    EXPECT_LE(b, 2e-2) << what << ": " << ch.name << " of rank " << r << " of " << c
                       << " against the fp32 ring";
    worst_whole = std::max(worst_whole, a);
    worst_fp32 = std::max(worst_fp32, b);
  }
  std::vector<double> worst{worst_whole, worst_fp32};
  PLM_CHECK_MPI(MPI_Allreduce(MPI_IN_PLACE, worst.data(), 2, MPI_DOUBLE, MPI_MAX, group));
  if (r == 0)
    std::printf(
        "%s, context degree %d: bf16 ring vs one-rank bf16 %.3g, vs fp32 ring %.3g "
        "(of the largest value)\n",
        what.c_str(), c, worst[0], worst[1]);
}

TEST(ContextRingBf16, MatchesOneRankAndTheFp32Ring) {
  const int world = dist::worldSize();
  if (world < 2) GTEST_SKIP() << "a ring needs 2 ranks";
  for (int d : {32, 64}) {
    ringMatches(MPI_COMM_WORLD, d, "head_dim " + std::to_string(d));
    if (world == 4) {
      dist::ProcessGroups groups(MPI_COMM_WORLD, 1, 2);
      ringMatches(groups.context(), d, "head_dim " + std::to_string(d) + ", groups of 2");
    }
  }
}

}  // namespace
