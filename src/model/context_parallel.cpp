// Accumulation rule: o, lse, dq, dk, dv written (=); the block partials merge into them.
#include "model/context_parallel.hpp"

#include "core/error.hpp"
#include "dist/communicator.hpp"
#include "dist/stream.hpp"
#include "model/attention.hpp"
#include "model/math.hpp"
#include "plm/plm_config.hpp"

#if PLM_HAVE_CUDA
#include "gpu/flash_attention.hpp"
#include "gpu/ring_attention.hpp"
#endif

#include <algorithm>
#include <cstring>
#include <limits>
#include <string>

namespace plm::model {

struct RingAttention::Impl {
  dist::Communicator* comm = nullptr;
  int size = 1, rank = 0;
  int num_seqs = 0;
  std::vector<std::int64_t> tokens_of;  // (C) tokens of every rank's shard
  std::vector<int> longest;             // (C) longest sequence piece of every rank's shard
  std::vector<View1<seqlen_t>> cu;      // (C) x (n+1) every rank's shard cu_seqlens, device
  std::vector<View1<double>> slabs;     // grow-only device buffers, by slot
  // Host copies for a communicator that moves host memory while the model lives in device
  // memory (the MPI backend on a CUDA build whose ranks share a GPU).
  bool staged = false;
  std::vector<std::vector<double>> host_send, host_recv;

  /// One exchange in flight: the Work, and where a staged receive lands on the device.
  struct Pending {
    dist::Work work;
    void* device_recv = nullptr;
    std::size_t bytes = 0;
    int slot = -1;
  };

  template <class T> T* slab(int slot, std::int64_t count) {
    if (static_cast<int>(slabs.size()) <= slot) slabs.resize(slot + 1);
    const auto words =
        static_cast<std::size_t>((std::max<std::int64_t>(count, 1) * sizeof(T) + 7) / 8);
    if (slabs[slot].extent(0) < words) {
      slabs[slot] = View1<double>();
      slabs[slot] = View1<double>(
          Kokkos::view_alloc(Kokkos::WithoutInitializing, "plm::model::ring_buffer"), words);
    }
    return reinterpret_cast<T*>(slabs[slot].data());
  }

  int next() const { return (rank + 1) % size; }
  int prev() const { return (rank + size - 1) % size; }
  /// The rank whose K/V shard this rank holds at ring step i.
  int holder(int i) const { return ((rank - i) % size + size) % size; }

  /// Sends `ns` elements to the next rank, receives `nr` from the previous one (slot picks the
  /// host staging buffers).
  template <class T> Pending post(const ExecSpace& space, const T* send, std::int64_t ns, T* recv,
                                  std::int64_t nr, int slot) {
    Pending p;
    if (!staged) {
      if (!comm->deviceMemory()) space.fence();  // MPI reads what the kernels wrote
      p.work = comm->sendRecv(send, ns, next(), recv, nr, prev(), dist::streamOf(space));
      return p;
    }
    if (static_cast<int>(host_send.size()) <= slot) {
      host_send.resize(slot + 1);
      host_recv.resize(slot + 1);
    }
    auto& hs = host_send[slot];
    auto& hr = host_recv[slot];
    hs.resize(static_cast<std::size_t>((ns * sizeof(T) + 7) / 8) + 1);
    hr.resize(static_cast<std::size_t>((nr * sizeof(T) + 7) / 8) + 1);
    auto* hs_t = reinterpret_cast<T*>(hs.data());
    auto* hr_t = reinterpret_cast<T*>(hr.data());
    Kokkos::deep_copy(space, Kokkos::View<T*, HostSpace>(hs_t, ns),
                      View1<T>(const_cast<T*>(send), ns));
    space.fence();
    p.work = comm->sendRecv(hs_t, ns, next(), hr_t, nr, prev(), dist::Stream{});
    p.device_recv = recv;
    p.bytes = static_cast<std::size_t>(nr) * sizeof(T);
    p.slot = slot;
    return p;
  }

  template <class T> void wait(const ExecSpace& space, Pending& p) {
    p.work.wait(dist::streamOf(space));
    if (p.device_recv == nullptr) return;
    const auto n = static_cast<std::int64_t>(p.bytes / sizeof(T));
    Kokkos::deep_copy(
        space, View1<T>(static_cast<T*>(p.device_recv), n),
        Kokkos::View<T*, HostSpace>(reinterpret_cast<T*>(host_recv[p.slot].data()), n));
    p.device_recv = nullptr;
  }

  void checkLayout(std::int64_t tokens) const {
    if (cu.empty())
      throw Error("plm::model::RingAttention: no shard layout was set (a caller bug)");
    if (tokens != tokens_of[rank])
      throw Error("plm::model::RingAttention: " + std::to_string(tokens) +
                  " query tokens, but the layout gives this rank " +
                  std::to_string(tokens_of[rank]) + " (a caller bug)");
  }

  std::int64_t maxTokens() const { return *std::max_element(tokens_of.begin(), tokens_of.end()); }

  /// The K/V (or dK/dV) of one shard in one buffer: K rows first, then V rows.
  template <class T> void pack(const ExecSpace& space, const Mat& a, const Mat& b, T* dst) {
    const std::int64_t t = a.rows, h = a.cols;
    Kokkos::deep_copy(space, View2<T>(dst, t, h), a.view<T>());
    Kokkos::deep_copy(space, View2<T>(dst + t * h, t, h), b.view<T>());
  }

  template <class T>
  void forward(OpContext& ctx, const Qkv& qkv, int heads, const Mat& o, const Mat& lse) {
    const auto& space = ctx.space();
    const std::int64_t tq = qkv.q.rows, h = qkv.q.cols;
    checkLayout(tq);
    const std::int64_t tmax = maxTokens();
    T* kv[2] = {slab<T>(0, 2 * tmax * h), slab<T>(1, 2 * tmax * h)};
    pack<T>(space, qkv.k, qkv.v, kv[0]);
    View2<T> o_blk(slab<T>(2, tq * h), tq, h);
    View2<T> lse_blk(slab<T>(3, tq * heads), tq, heads);
    View1<T> work(slab<T>(4, tmax * h), tmax * h);
    const View2<T> q = qkv.q.view<T>(), out = o.view<T>(), l = lse.view<T>();
    for (int i = 0; i < size; ++i) {
      const int j = holder(i);
      const std::int64_t tj = tokens_of[j];
      Pending p = passOn(space, kv, i, h);
      const View2<T> kj(kv[i % 2], tj, h), vj(kv[i % 2] + tj * h, tj, h);
      if (i == 0) {
        attentionForward(space, q, kj, vj, cu[rank], cu[j], heads, out, l, ctx.tiles, work);
      } else {
        attentionForward(space, q, kj, vj, cu[rank], cu[j], heads, o_blk, lse_blk, ctx.tiles, work);
        merge(space, out, l, o_blk, lse_blk, heads);
      }
      wait<T>(space, p);
    }
  }

  /// Step i's K/V exchange (none after the last step): the shard held now goes to the next
  /// rank while the one for step i+1 arrives in the other buffer.
  template <class T> Pending passOn(const ExecSpace& space, T* const kv[2], int i, std::int64_t h) {
    if (i + 1 == size) return Pending{};
    return post(space, kv[i % 2], 2 * tokens_of[holder(i)] * h, kv[(i + 1) % 2],
                2 * tokens_of[holder(i + 1)] * h, 0);
  }

  /// (out, lse) <- the log-sum-exp merge of (out, lse) and (ob, lb); -inf is an empty part.
  template <class T> static void merge(const ExecSpace& space, const View2<T>& out,
                                       const View2<T>& lse, const View2<T>& ob, const View2<T>& lb,
                                       int heads) {
    const int d = static_cast<int>(out.extent(1)) / heads;
    const T minus_inf = -std::numeric_limits<T>::infinity();
    Kokkos::parallel_for(
        "plm::model::ring_attention_merge", FlatPolicy(space, 0, out.extent(0)),
        KOKKOS_LAMBDA(const std::int64_t t) {
          for (int hh = 0; hh < heads; ++hh) {
            const T a = lse(t, hh), b = lb(t, hh);
            if (b == minus_inf) continue;
            const T mx = a > b ? a : b;
            const T wa = a == minus_inf ? T(0) : math::libm::exp(a - mx);
            const T wb = math::libm::exp(b - mx);
            const T sum = wa + wb;
            const T ca = wa / sum, cb = wb / sum;
            for (int c = 0; c < d; ++c)
              out(t, hh * d + c) = ca * out(t, hh * d + c) + cb * ob(t, hh * d + c);
            lse(t, hh) = mx + math::libm::log(sum);
          }
        });
  }

  template <class T> static void add(const ExecSpace& space, T* dst, const T* src, std::int64_t n) {
    Kokkos::parallel_for(
        "plm::model::ring_attention_accumulate", FlatPolicy(space, 0, n),
        KOKKOS_LAMBDA(const std::int64_t e) { dst[e] += src[e]; });
  }

  template <class T> void backward(OpContext& ctx, const Qkv& qkv, const Mat& o, const Mat& lse,
                                   const Mat& dout, int heads, const Mat& delta, const Qkv& dqkv) {
    const auto& space = ctx.space();
    const std::int64_t tq = qkv.q.rows, h = qkv.q.cols;
    checkLayout(tq);
    const std::int64_t tmax = maxTokens();
    T* kv[2] = {slab<T>(0, 2 * tmax * h), slab<T>(1, 2 * tmax * h)};
    T* dkv[2] = {slab<T>(5, 2 * tmax * h), slab<T>(6, 2 * tmax * h)};
    pack<T>(space, qkv.k, qkv.v, kv[0]);
    View2<T> dq_blk(slab<T>(2, tq * h), tq, h);
    T* dkv_blk = slab<T>(7, 2 * tmax * h);
    const std::int64_t work_n = 2 * std::max(tq, tmax) * h;
    View1<T> work(slab<T>(4, work_n), work_n);
    const View2<T> q = qkv.q.view<T>(), out = o.view<T>(), l = lse.view<T>();
    const View2<T> dO = dout.view<T>(), dl = delta.view<T>(), dq = dqkv.q.view<T>();
    Pending grads;  // the dK/dV partials in flight
    for (int i = 0; i < size; ++i) {
      const int j = holder(i);
      const std::int64_t tj = tokens_of[j];
      Pending p = passOn(space, kv, i, h);
      const View2<T> kj(kv[i % 2], tj, h), vj(kv[i % 2] + tj * h, tj, h);
      const View2<T> dkj(dkv_blk, tj, h), dvj(dkv_blk + tj * h, tj, h);
      attentionBackward(space, q, kj, vj, out, l, dO, cu[rank], cu[j], heads, dl,
                        i == 0 ? dq : dq_blk, dkj, dvj, ctx.tiles, work);
      if (i > 0) add(space, dq.data(), dq_blk.data(), tq * h);
      T* acc = dkv[i % 2];
      if (i == 0) {
        Kokkos::deep_copy(space, View1<T>(acc, 2 * tj * h), View1<T>(dkv_blk, 2 * tj * h));
      } else {
        wait<T>(space, grads);  // rank r-1's partial sums of shard j, received into acc
        add(space, acc, dkv_blk, 2 * tj * h);
      }
      // After the last step the partials of this rank's own shard come home.
      grads = post(space, acc, 2 * tj * h, dkv[(i + 1) % 2], 2 * tokens_of[holder(i + 1)] * h, 1);
      wait<T>(space, p);
    }
    wait<T>(space, grads);
    const T* own = dkv[size % 2];
    Kokkos::deep_copy(space, dqkv.k.view<T>(), View2<T>(const_cast<T*>(own), tq, h));
    Kokkos::deep_copy(space, dqkv.v.view<T>(), View2<T>(const_cast<T*>(own) + tq * h, tq, h));
  }

#if PLM_HAVE_CUDA
  // bf16 on the GPU: the same ring, each block through the CUDA attention kernels (the
  // diagonal block as the dispatch point picks them, cuDNN or the own flash attention; the
  // others through the own flash attention with the key shard's layout), the K/V shards as
  // bf16 bits (half fp32's bytes), and what sums over the blocks in fp32 (gpu/ring_attention.hpp):
  // the running output and log-sum-exp, dQ, and the dK/dV partials that travel.
  using Bits = std::uint16_t;  // bf16 as raw bits (the communicator's BFloat16)

  static gpu::Stream gpuStream(const ExecSpace& space) {
    return static_cast<gpu::Stream>(dist::streamOf(space).handle);
  }
  static gpu::bf16* bf(void* p) { return static_cast<gpu::bf16*>(p); }
  static const gpu::bf16* bf(const void* p) { return static_cast<const gpu::bf16*>(p); }

  /// The flash parameters of this rank's queries against the K/V of rank j (k, v with row
  /// stride kv_stride; own_layout: j is this rank and the keys share the queries' layout).
  gpu::FlashParams block(const Qkv& qkv, int heads, int j, const void* k, const void* v,
                         std::int64_t kv_stride, bool own_layout) const {
    gpu::FlashParams fp;
    fp.q = bf(qkv.q.data);
    fp.q_stride = qkv.q.ld;
    fp.k = bf(k);
    fp.v = bf(v);
    fp.k_stride = fp.v_stride = kv_stride;
    fp.cu_seqlens = cu[rank].data();
    fp.num_seqs = num_seqs;
    fp.max_seqlen = longest[rank];
    fp.total_tokens = tokens_of[rank];
    if (!own_layout) {
      fp.cu_seqlens_k = cu[j].data();
      fp.max_seqlen_k = longest[j];
    }
    fp.heads = heads;
    fp.head_dim = static_cast<int>(qkv.q.cols / heads);
    fp.softmax_scale = 1.0f;  // ESM-2 scales q before rotary
    return fp;
  }

  void forwardBf16(OpContext& ctx, const Qkv& qkv, int heads, const Mat& o, const Mat& lse) {
    const auto& space = ctx.space();
    const gpu::Stream stream = gpuStream(space);
    const std::int64_t tq = qkv.q.rows, h = qkv.q.cols;
    checkLayout(tq);
    const std::int64_t tmax = maxTokens();
    Bits* kv[2] = {slab<Bits>(0, 2 * tmax * h), slab<Bits>(1, 2 * tmax * h)};
    gpu::ringPack(stream, bf(qkv.k.data), qkv.k.ld, bf(qkv.v.data), qkv.v.ld, tq,
                  static_cast<int>(h), bf(static_cast<void*>(kv[0])));
    float* acc = slab<float>(2, tq * h);
    Bits* o_blk = slab<Bits>(3, tq * h);
    float* lse_blk = slab<float>(4, tq * heads);
    float* l = static_cast<float*>(lse.data);  // (T, heads) fp32, contiguous
    const int d = static_cast<int>(h / heads);
    for (int i = 0; i < size; ++i) {
      const int j = holder(i);
      const std::int64_t tj = tokens_of[j];
      Pending p = passOn(space, kv, i, h);
      // The diagonal block reads K/V in place (the dispatch may pick cuDNN for it).
      gpu::FlashParams fp = i == 0 ? block(qkv, heads, j, qkv.k.data, qkv.v.data, qkv.k.ld, true)
                                   : block(qkv, heads, j, kv[i % 2], kv[i % 2] + tj * h, h, false);
      if (i == 0 && qkv.k.ld != qkv.v.ld)  // one stride for both (the fused layout has it)
        fp = block(qkv, heads, j, kv[0], kv[0] + tq * h, h, true);
      fp.o = bf(static_cast<void*>(o_blk));
      fp.o_stride = h;
      fp.lse = lse_blk;
      if (tq > 0) {
        bf16Attention(ctx, fp, false);
        gpu::ringMerge(stream, acc, l, bf(static_cast<const void*>(o_blk)), h, lse_blk, tq, heads,
                       d, i == 0);
      }
      wait<Bits>(space, p);
    }
    gpu::ringStore(stream, acc, bf(o.data), o.ld, tq, static_cast<int>(h));
  }

  void backwardBf16(OpContext& ctx, const Qkv& qkv, const Mat& o, const Mat& lse, const Mat& dout,
                    int heads, const Mat& delta, const Qkv& dqkv) {
    const auto& space = ctx.space();
    const gpu::Stream stream = gpuStream(space);
    const std::int64_t tq = qkv.q.rows, h = qkv.q.cols;
    const int w = static_cast<int>(h);
    checkLayout(tq);
    const std::int64_t tmax = maxTokens();
    Bits* kv[2] = {slab<Bits>(0, 2 * tmax * h), slab<Bits>(1, 2 * tmax * h)};
    float* dkv[2] = {slab<float>(5, 2 * tmax * h), slab<float>(6, 2 * tmax * h)};
    gpu::ringPack(stream, bf(qkv.k.data), qkv.k.ld, bf(qkv.v.data), qkv.v.ld, tq, w,
                  bf(static_cast<void*>(kv[0])));
    // The block's gradients: (T, 3h) laid out as qkv (dq | dk | dv, row stride 3h), so the
    // diagonal block's may go to cuDNN (its gradients' strides must be q, k, v's); the other
    // blocks' dK/dV (rows of shard j) contiguous in dkv_blk.
    Bits* g3 = slab<Bits>(2, tq * 3 * h);
    Bits* dkv_blk = slab<Bits>(7, 2 * tmax * h);
    float* dq_acc = slab<float>(3, tq * h);
    Pending grads;  // the dK/dV partials in flight
    for (int i = 0; i < size; ++i) {
      const int j = holder(i);
      const std::int64_t tj = tokens_of[j];
      Pending p = passOn(space, kv, i, h);
      const bool fused =
          i == 0 && qkv.q.ld == 3 * h && qkv.k.ld == qkv.q.ld && qkv.v.ld == qkv.q.ld;
      gpu::FlashParams fp = fused ? block(qkv, heads, j, qkv.k.data, qkv.v.data, qkv.k.ld, true)
                                  : block(qkv, heads, j, kv[i % 2], kv[i % 2] + tj * h, h, i == 0);
      fp.o = bf(o.data);
      fp.o_stride = o.ld;
      fp.lse = static_cast<float*>(lse.data);  // the global log-sum-exp
      fp.dout = bf(dout.data);
      fp.dout_stride = dout.ld;
      fp.delta = static_cast<float*>(delta.data);
      fp.dq = bf(static_cast<void*>(g3));
      fp.dq_stride = 3 * h;
      if (fused) {
        fp.dk = bf(static_cast<void*>(g3 + h));
        fp.dv = bf(static_cast<void*>(g3 + 2 * h));
        fp.dk_stride = fp.dv_stride = 3 * h;
      } else {
        fp.dk = bf(static_cast<void*>(dkv_blk));
        fp.dv = bf(static_cast<void*>(dkv_blk + tj * h));
        fp.dk_stride = fp.dv_stride = h;
      }
      if (tq > 0) {  // without queries every gradient of the block is zero
        bf16Attention(ctx, fp, true);
        gpu::ringAccumulate(stream, dq_acc, bf(static_cast<const void*>(g3)), 3 * h, tq, w, i == 0);
      }
      float* acc = dkv[i % 2];
      if (i == 0) {  // tj == tq: this rank's own shard
        if (fused) {
          gpu::ringAccumulate(stream, acc, bf(static_cast<const void*>(g3 + h)), 3 * h, tq, w,
                              true);
          gpu::ringAccumulate(stream, acc + tq * h, bf(static_cast<const void*>(g3 + 2 * h)), 3 * h,
                              tq, w, true);
        } else {
          gpu::ringAccumulate(stream, acc, bf(static_cast<const void*>(dkv_blk)), h, 2 * tq, w,
                              true);
        }
      } else {
        wait<float>(space, grads);  // rank r-1's partial sums of shard j, received into acc
        if (tq > 0)
          gpu::ringAccumulate(stream, acc, bf(static_cast<const void*>(dkv_blk)), h, 2 * tj, w,
                              false);
      }
      // After the last step the partials of this rank's own shard come home.
      grads = post(space, acc, 2 * tj * h, dkv[(i + 1) % 2], 2 * tokens_of[holder(i + 1)] * h, 1);
      wait<Bits>(space, p);
    }
    wait<float>(space, grads);
    const float* own = dkv[size % 2];
    gpu::ringStore(stream, dq_acc, bf(dqkv.q.data), dqkv.q.ld, tq, w);
    gpu::ringStore(stream, own, bf(dqkv.k.data), dqkv.k.ld, tq, w);
    gpu::ringStore(stream, own + tq * h, bf(dqkv.v.data), dqkv.v.ld, tq, w);
  }
#endif
};

RingAttention::RingAttention(dist::Communicator& comm) : impl_member(std::make_unique<Impl>()) {
  impl_member->comm = &comm;
  impl_member->size = comm.size();
  impl_member->rank = comm.rank();
  impl_member->staged =
      !comm.deviceMemory() && !Kokkos::SpaceAccessibility<HostSpace, MemSpace>::accessible;
}

RingAttention::~RingAttention() = default;

int RingAttention::degree() const { return impl_member->size; }
int RingAttention::rank() const { return impl_member->rank; }

void RingAttention::setLayout(const ExecSpace& space, const std::vector<seqlen_t>& rank_cu_seqlens,
                              int num_seqs) {
  auto& im = *impl_member;
  const auto row = static_cast<std::size_t>(num_seqs) + 1;
  if (num_seqs < 0 || rank_cu_seqlens.size() != row * static_cast<std::size_t>(im.size))
    throw Error("plm::model::RingAttention: the shard layout has " +
                std::to_string(rank_cu_seqlens.size()) + " entries for " + std::to_string(im.size) +
                " ranks and " + std::to_string(num_seqs) + " sequences (a caller bug)");
  im.num_seqs = num_seqs;
  im.cu.resize(im.size);
  im.tokens_of.resize(im.size);
  im.longest.resize(im.size);
  for (int j = 0; j < im.size; ++j) {
    const seqlen_t* src = rank_cu_seqlens.data() + row * j;
    if (static_cast<std::int64_t>(im.cu[j].extent(0)) != static_cast<std::int64_t>(row))
      im.cu[j] = View1<seqlen_t>("plm::model::ring_cu_seqlens", row);
    Kokkos::deep_copy(space, im.cu[j], Kokkos::View<const seqlen_t*, HostSpace>(src, row));
    im.tokens_of[j] = src[num_seqs];
    im.longest[j] = 0;
    for (int q = 0; q < num_seqs; ++q) im.longest[j] = std::max(im.longest[j], src[q + 1] - src[q]);
  }
  space.fence();  // the host layout may be freed once this returns
}

namespace {
/// ops.cpp's dispatch with the message a user of context parallelism needs (the deck keys):
/// fp32/fp64 run the portable ring, bf16 the CUDA one.
template <class F, class G> void ringDispatch(DType d, const char* op, F&& portable, G&& cuda) {
  if (d == DType::F32) return portable(float{});
  if (d == DType::F64) return portable(double{});
#if PLM_HAVE_CUDA
  if (d == DType::BF16) return cuda();
#else
  (void)cuda;
#endif
  throw Error(std::string("plm::model::RingAttention::") + op +
              ": context parallelism (parallel.context_degree > 1) runs fp32 or fp64 on the "
              "portable path and bf16 on the CUDA build; got " +
              dtypeName(d));
}
}  // namespace

void RingAttention::forward(OpContext& ctx, const Qkv& qkv, int heads, const Mat& o,
                            const Mat& lse) {
  Kokkos::Profiling::pushRegion("plm::model::RingAttention::forward");
  auto& im = *impl_member;
  ringDispatch(
      qkv.q.dtype, "forward", [&](auto t) { im.forward<decltype(t)>(ctx, qkv, heads, o, lse); },
      [&]() {
#if PLM_HAVE_CUDA
        im.forwardBf16(ctx, qkv, heads, o, lse);
#endif
      });
  Kokkos::Profiling::popRegion();
}

void RingAttention::backward(OpContext& ctx, const Qkv& qkv, const Mat& o, const Mat& lse,
                             const Mat& dout, int heads, const Mat& delta, const Qkv& dqkv) {
  Kokkos::Profiling::pushRegion("plm::model::RingAttention::backward");
  auto& im = *impl_member;
  ringDispatch(
      qkv.q.dtype, "backward",
      [&](auto t) { im.backward<decltype(t)>(ctx, qkv, o, lse, dout, heads, delta, dqkv); },
      [&]() {
#if PLM_HAVE_CUDA
        im.backwardBf16(ctx, qkv, o, lse, dout, heads, delta, dqkv);
#endif
      });
  Kokkos::Profiling::popRegion();
}

}  // namespace plm::model
