// Ring attention (model/context_parallel.hpp) against whole attention, at 1, 2 and 4 ranks:
//  - the communicator's point-to-point sendRecv around a ring, with counts that differ per rank
//    and are zero for some;
//  - for context groups of every size the world allows (the world, and pairs at 4 ranks), the
//    C shards of a packed batch with sequences from 1 token (shorter than 2C: empty chunks) to
//    a few hundred get, for their rows, the output, log-sum-exp, dQ, dK and dV of the plain
//    reference attention over the whole batch (double to 1e-10; float to 1e-5), with tiny
//    tiles so blocks cross tile boundaries;
//  - the cross-attention kernel alone: queries with no key get out 0 and lse -inf.
#include "../model/model_test_util.hpp"
#include "core/error.hpp"
#include "data/context_split.hpp"
#include "dist/communicator.hpp"
#include "dist/process_groups.hpp"
#include "dist/runtime.hpp"
#include "model/attention.hpp"
#include "model/context_parallel.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <vector>

namespace {

using namespace plm;
using model::test::randomView;
using model::test::toHost;

TEST(ContextRing, SendRecvAroundARing) {
  auto comm = dist::makeCommunicator(MPI_COMM_WORLD, dist::Backend::Mpi);
  const int p = comm->size(), r = comm->rank();
  const int next = (r + 1) % p, prev = (r + p - 1) % p;
  // Rank q sends q % 3 elements (zero for some ranks) of value 100 q + i.
  std::vector<double> send(r % 3), recv(prev % 3, -1.0);
  for (std::size_t i = 0; i < send.size(); ++i) send[i] = 100.0 * r + i;
  comm->sendRecv(send.data(), static_cast<std::int64_t>(send.size()), next, recv.data(),
                 static_cast<std::int64_t>(recv.size()), prev)
      .wait();
  for (std::size_t i = 0; i < recv.size(); ++i) EXPECT_EQ(recv[i], 100.0 * prev + i);
  // Two exchanges in flight between the same pair complete in the order they were posted.
  std::vector<std::int32_t> a = {r}, b = {r + 1000}, ra = {-1}, rb = {-1};
  auto w1 = comm->sendRecv(a.data(), 1, next, ra.data(), 1, prev);
  auto w2 = comm->sendRecv(b.data(), 1, next, rb.data(), 1, prev);
  w2.wait();
  w1.wait();
  EXPECT_EQ(ra[0], prev);
  EXPECT_EQ(rb[0], prev + 1000);
  EXPECT_THROW(comm->sendRecv(a.data(), 1, p, ra.data(), 1, prev), plm::Error);
}

/// Rows of `full` (global token order) for the tokens of `shard`, in the shard's order.
template <class T> View2<T> shardRows(const View2<T>& full, const data::MicroBatch& batch,
                                      const data::MicroBatch& shard) {
  const auto h = static_cast<std::int64_t>(full.extent(1));
  auto src = toHost(full);
  std::vector<T> out(static_cast<std::size_t>(shard.numTokens() * h));
  for (int s = 0; s < shard.numSequences(); ++s)
    for (int t = shard.cu_seqlens(s); t < shard.cu_seqlens(s + 1); ++t) {
      const std::int64_t g = batch.cu_seqlens(s) + shard.context->positions[t];
      for (std::int64_t c = 0; c < h; ++c) out[t * h + c] = src[g * h + c];
    }
  View2<T> v("plm::test::shard_rows", shard.numTokens(), h);
  Kokkos::deep_copy(
      v, Kokkos::View<T**, Kokkos::LayoutRight, HostSpace>(out.data(), shard.numTokens(), h));
  return v;
}

template <class T> double maxDiff(const View2<T>& a, const View2<T>& b, double* scale) {
  auto x = toHost(a), y = toHost(b);
  double d = 0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    d = std::max(d, std::abs(double(x[i]) - double(y[i])));
    *scale = std::max(*scale, std::abs(double(y[i])));
  }
  return d;
}

template <class T> void ringMatchesWhole(MPI_Comm group, double tol, const std::string& what) {
  // NCCL where every rank has its own GPU, else MPI (staged through the host on a GPU build).
  auto comm = dist::makeCommunicator(group, dist::defaultBackend(group));
  const int c = comm->size(), r = comm->rank();
  const int heads = 2, d = 6, h = heads * d;
  const data::MicroBatch batch = model::test::makeBatch({1, 2, 3, 5, 8, 17, 40, 129, 300, 7}, 5);
  const std::int64_t tokens = batch.numTokens();
  // The same whole tensors on every rank (seeded), the reference computed whole.
  auto q = randomView<T>(tokens, h, 1), k = randomView<T>(tokens, h, 2);
  auto v = randomView<T>(tokens, h, 3), dout = randomView<T>(tokens, h, 4);
  View1<seqlen_t> cu("cu", batch.numSequences() + 1);
  Kokkos::deep_copy(cu, batch.cu_seqlens);
  View2<T> o_ref("o", tokens, h), lse_ref("lse", tokens, heads);
  View2<T> dq_ref("dq", tokens, h), dk_ref("dk", tokens, h), dv_ref("dv", tokens, h);
  const ExecSpace space;
  model::attentionReferenceForward(space, q, k, v, cu, heads, o_ref, lse_ref);
  model::attentionReferenceBackward(space, q, k, v, dout, cu, heads, dq_ref, dk_ref, dv_ref);

  const data::MicroBatch shard = data::contextShard(batch, c, r);
  const std::int64_t local = shard.numTokens();
  auto ql = shardRows(q, batch, shard), kl = shardRows(k, batch, shard);
  auto vl = shardRows(v, batch, shard), dl = shardRows(dout, batch, shard);
  View2<T> o("o", local, h), lse("lse", local, heads), delta("delta", local, heads);
  View2<T> dq("dq", local, h), dk("dk", local, h), dv("dv", local, h);
  model::OpContext ctx(space);
  ctx.tiles = model::AttentionTiles{4, 8};  // blocks cross tile boundaries
  model::RingAttention ring(*comm);
  ring.setLayout(space, shard.context->rank_cu_seqlens, shard.numSequences());
  const model::Qkv qkv{model::matOf(ql), model::matOf(kl), model::matOf(vl)};
  // Twice: the second pass reuses the ring's buffers.
  for (int pass = 0; pass < 2; ++pass) {
    ring.forward(ctx, qkv, heads, model::matOf(o), model::matOf(lse));
    ring.backward(ctx, qkv, model::matOf(o), model::matOf(lse), model::matOf(dl), heads,
                  model::matOf(delta),
                  model::Qkv{model::matOf(dq), model::matOf(dk), model::matOf(dv)});
    space.fence();
    struct Check {
      const char* name;
      View2<T> got, whole;
    };
    for (const Check& ch :
         {Check{"out", o, o_ref}, Check{"lse", lse, lse_ref}, Check{"dq", dq, dq_ref},
          Check{"dk", dk, dk_ref}, Check{"dv", dv, dv_ref}}) {
      double scale = 0;
      const double diff = maxDiff(ch.got, shardRows(ch.whole, batch, shard), &scale);
      EXPECT_LE(diff, tol * (1 + scale))
          << what << ": " << ch.name << " of rank " << r << " of " << c << " (pass " << pass << ")";
    }
  }
}

TEST(ContextRing, RingAttentionMatchesWholeAttention) {
  const int world = dist::worldSize();
  ringMatchesWhole<double>(MPI_COMM_WORLD, 1e-10, "double, context group = world");
  ringMatchesWhole<float>(MPI_COMM_WORLD, 1e-5, "float, context group = world");
  if (world == 4) {  // two context groups of 2 ranks side by side
    dist::ProcessGroups groups(MPI_COMM_WORLD, 1, 2);
    ringMatchesWhole<double>(groups.context(), 1e-10, "double, context groups of 2");
  }
}

TEST(ContextRing, CrossAttentionWithoutKeysIsNeutral) {
  // Sequence 0 has queries but no keys, sequence 1 has both: out 0 and lse -inf for the first.
  const ExecSpace space;
  const int heads = 1, h = 4;
  auto q = randomView<double>(3, h, 7), k = randomView<double>(2, h, 8);
  auto v = randomView<double>(2, h, 9);
  View1<seqlen_t> cu_q("cu_q", 3), cu_k("cu_k", 3);
  auto hq = Kokkos::create_mirror_view(cu_q), hk = Kokkos::create_mirror_view(cu_k);
  hq(0) = 0, hq(1) = 1, hq(2) = 3;
  hk(0) = 0, hk(1) = 0, hk(2) = 2;
  Kokkos::deep_copy(cu_q, hq);
  Kokkos::deep_copy(cu_k, hk);
  View2<double> o("o", 3, h), lse("lse", 3, heads);
  model::attentionForward(space, q, k, v, cu_q, cu_k, heads, o, lse);
  auto ho = toHost(o), hl = toHost(lse);
  for (int c = 0; c < h; ++c) EXPECT_EQ(ho[c], 0.0);
  EXPECT_EQ(hl[0], -std::numeric_limits<double>::infinity());
  EXPECT_TRUE(std::isfinite(hl[1]) && std::isfinite(hl[2]));
}

}  // namespace
