// Accumulation rule: o, lse, dq, dk, dv written (=); the block partials merge into them.
#include "model/context_parallel.hpp"

#include "core/error.hpp"
#include "dist/communicator.hpp"
#include "dist/stream.hpp"
#include "model/attention.hpp"
#include "model/math.hpp"

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
        "plm::model::ring_attention_merge", Kokkos::RangePolicy<ExecSpace>(space, 0, out.extent(0)),
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
        "plm::model::ring_attention_accumulate", Kokkos::RangePolicy<ExecSpace>(space, 0, n),
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
  for (int j = 0; j < im.size; ++j) {
    const seqlen_t* src = rank_cu_seqlens.data() + row * j;
    if (static_cast<std::int64_t>(im.cu[j].extent(0)) != static_cast<std::int64_t>(row))
      im.cu[j] = View1<seqlen_t>("plm::model::ring_cu_seqlens", row);
    Kokkos::deep_copy(space, im.cu[j], Kokkos::View<const seqlen_t*, HostSpace>(src, row));
    im.tokens_of[j] = src[num_seqs];
  }
  space.fence();  // the host layout may be freed once this returns
}

namespace {
/// ops.cpp's portable() with the message a user of context parallelism needs (the deck keys).
template <class F> void ringPortable(DType d, const char* op, F&& f) {
  if (d == DType::F32)
    f(float{});
  else if (d == DType::F64)
    f(double{});
  else
    throw Error(std::string("plm::model::RingAttention::") + op +
                ": context parallelism (parallel.context_degree > 1) runs the portable attention "
                "only; use train.precision: fp32 with it (bf16 ring attention is not "
                "implemented)");
}
}  // namespace

void RingAttention::forward(OpContext& ctx, const Qkv& qkv, int heads, const Mat& o,
                            const Mat& lse) {
  Kokkos::Profiling::pushRegion("plm::model::RingAttention::forward");
  ringPortable(qkv.q.dtype, "forward",
               [&](auto t) { impl_member->forward<decltype(t)>(ctx, qkv, heads, o, lse); });
  Kokkos::Profiling::popRegion();
}

void RingAttention::backward(OpContext& ctx, const Qkv& qkv, const Mat& o, const Mat& lse,
                             const Mat& dout, int heads, const Mat& delta, const Qkv& dqkv) {
  Kokkos::Profiling::pushRegion("plm::model::RingAttention::backward");
  ringPortable(qkv.q.dtype, "backward", [&](auto t) {
    impl_member->backward<decltype(t)>(ctx, qkv, o, lse, dout, heads, delta, dqkv);
  });
  Kokkos::Profiling::popRegion();
}

}  // namespace plm::model
