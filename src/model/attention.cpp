// Accumulation rule: out, lse, dq, dk, dv written (=).
// One team per (tile, head); within a team one thread per query row (forward, dQ pass) or per
// key row (dK/dV pass); tiles of K/V (or Q/dO) are staged in team scratch, also transposed so
// the inner loops run over contiguous memory and vectorize.
#include "model/attention.hpp"

#include "core/error.hpp"
#include "model/math.hpp"

#include <vector>

namespace plm::model {
namespace {

using Policy = Kokkos::TeamPolicy<ExecSpace>;
using Member = Policy::member_type;
template <class T>
using Scratch = Kokkos::View<T*, ExecSpace::scratch_memory_space, Kokkos::MemoryTraits<Kokkos::Unmanaged>>;

/// (n_tiles, 3): sequence start, sequence end, tile start; tiles of `block` rows per sequence.
Kokkos::View<int**, Kokkos::LayoutRight, MemSpace> tileList(const View1<seqlen_t>& cu_seqlens,
                                                            int block) {
  auto cu = Kokkos::create_mirror_view_and_copy(HostSpace(), cu_seqlens);
  const int n = static_cast<int>(cu.extent(0)) - 1;
  std::vector<int> flat;  // metadata over sequences, not tensor elements
  for (int s = 0; s < n; ++s)
    for (int t0 = cu(s); t0 < cu(s + 1); t0 += block) {
      flat.push_back(cu(s));
      flat.push_back(cu(s + 1));
      flat.push_back(t0);
    }
  const auto tiles = static_cast<std::int64_t>(flat.size() / 3);
  Kokkos::View<int**, Kokkos::LayoutRight, MemSpace> list(
      Kokkos::view_alloc(Kokkos::WithoutInitializing, "plm::model::attention_tiles"), tiles, 3);
  if (tiles > 0) {
    Kokkos::View<const int**, Kokkos::LayoutRight, HostSpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>>
        host(flat.data(), tiles, 3);
    Kokkos::deep_copy(list, host);
  }
  return list;
}

void checkTiles(const AttentionTiles& tiles) {
  if (tiles.queries <= 0 || tiles.keys <= 0)
    throw Error("plm::model::attention: tile sizes must be positive (a bug in the caller)");
}

}  // namespace

template <class T>
void attentionForward(const ExecSpace& space, const View2<T>& q, const View2<T>& k,
                      const View2<T>& v, const View1<seqlen_t>& cu_seqlens, int heads,
                      const View2<T>& out, const View2<T>& lse, AttentionTiles tiles) {
  checkTiles(tiles);
  const int d = static_cast<int>(q.extent(1)) / heads;
  const int bq = tiles.queries, bk = tiles.keys;
  auto list = tileList(cu_seqlens, bq);
  const int n_tiles = static_cast<int>(list.extent(0));
  if (n_tiles == 0) return;
  const size_t scratch = Scratch<T>::shmem_size(d * bk) * 2 + Scratch<T>::shmem_size(bq * d) +
                         Scratch<T>::shmem_size(bq * bk) + Scratch<T>::shmem_size(bq) * 2;
  Policy policy(space, n_tiles * heads, Kokkos::AUTO);
  policy.set_scratch_size(0, Kokkos::PerTeam(scratch));
  const T lowest = Kokkos::reduction_identity<T>::max();
  Kokkos::parallel_for(
      "plm::model::attention_forward", policy, KOKKOS_LAMBDA(const Member& team) {
        const int tile = team.league_rank() / heads, h = team.league_rank() % heads, hd = h * d;
        const int s1 = list(tile, 1), q0 = list(tile, 2), s0 = list(tile, 0);
        const int nq = s1 - q0 < bq ? s1 - q0 : bq;
        T* kt = Scratch<T>(team.team_scratch(0), d * bk).data();  // (d, bk)
        T* vs = Scratch<T>(team.team_scratch(0), bk * d).data();  // (bk, d)
        T* acc = Scratch<T>(team.team_scratch(0), bq * d).data();  // (bq, d)
        T* sc = Scratch<T>(team.team_scratch(0), bq * bk).data();  // (bq, bk)
        T* m = Scratch<T>(team.team_scratch(0), bq).data();        // (bq) running max
        T* l = Scratch<T>(team.team_scratch(0), bq).data();        // (bq) running sum
        Kokkos::parallel_for(Kokkos::TeamThreadRange(team, nq), [&](const int r) {
          m[r] = lowest;
          l[r] = 0;
          for (int c = 0; c < d; ++c) acc[r * d + c] = 0;
        });
        for (int k0 = s0; k0 < s1; k0 += bk) {
          const int nk = s1 - k0 < bk ? s1 - k0 : bk;
          team.team_barrier();
          Kokkos::parallel_for(Kokkos::TeamThreadRange(team, nk * d), [&](const int idx) {
            const int j = idx / d, c = idx % d;
            kt[c * bk + j] = k(k0 + j, hd + c);
            vs[j * d + c] = v(k0 + j, hd + c);
          });
          team.team_barrier();
          Kokkos::parallel_for(Kokkos::TeamThreadRange(team, nq), [&](const int r) {
            T* srow = sc + r * bk;
            for (int j = 0; j < nk; ++j) srow[j] = 0;
            const T* qrow = &q(q0 + r, hd);
            for (int c = 0; c < d; ++c) {
              const T qc = qrow[c];
              const T* ktr = kt + c * bk;
              for (int j = 0; j < nk; ++j) srow[j] += qc * ktr[j];
            }
            T mx = m[r];
            for (int j = 0; j < nk; ++j) mx = srow[j] > mx ? srow[j] : mx;
            for (int j = 0; j < nk; ++j) srow[j] = math::exp(srow[j] - mx);
            T sum = 0;
            for (int j = 0; j < nk; ++j) sum += srow[j];
            const T corr = math::exp(m[r] - mx);
            l[r] = l[r] * corr + sum;
            m[r] = mx;
            T* arow = acc + r * d;
            for (int c = 0; c < d; ++c) arow[c] *= corr;
            for (int j = 0; j < nk; ++j) {
              const T p = srow[j];
              const T* vr = vs + j * d;
              for (int c = 0; c < d; ++c) arow[c] += p * vr[c];
            }
          });
        }
        Kokkos::parallel_for(Kokkos::TeamThreadRange(team, nq), [&](const int r) {
          const T inv = T(1) / l[r];
          for (int c = 0; c < d; ++c) out(q0 + r, hd + c) = acc[r * d + c] * inv;
          lse(q0 + r, h) = m[r] + Kokkos::Experimental::log(l[r]);
        });
      });
}

template <class T>
void attentionBackward(const ExecSpace& space, const View2<T>& q, const View2<T>& k,
                       const View2<T>& v, const View2<T>& out, const View2<T>& lse,
                       const View2<T>& dout, const View1<seqlen_t>& cu_seqlens, int heads,
                       const View2<T>& delta, const View2<T>& dq, const View2<T>& dk,
                       const View2<T>& dv, AttentionTiles tiles) {
  checkTiles(tiles);
  const int d = static_cast<int>(q.extent(1)) / heads;
  const int bq = tiles.queries, bk = tiles.keys;
  const auto tokens = static_cast<std::int64_t>(q.extent(0));
  Kokkos::parallel_for(
      "plm::model::attention_backward_delta", Kokkos::RangePolicy<ExecSpace>(space, 0, tokens),
      KOKKOS_LAMBDA(const std::int64_t t) {
        for (int h = 0; h < heads; ++h) {
          T sum = 0;
          for (int c = 0; c < d; ++c) sum += dout(t, h * d + c) * out(t, h * d + c);
          delta(t, h) = sum;
        }
      });

  // Pass 1: one team per (key tile, head) accumulates dK and dV over the sequence's query tiles.
  {
    auto list = tileList(cu_seqlens, bk);
    const int n_tiles = static_cast<int>(list.extent(0));
    if (n_tiles == 0) return;
    const size_t scratch = Scratch<T>::shmem_size(bq * d) * 4 + Scratch<T>::shmem_size(bq) * 2 +
                           Scratch<T>::shmem_size(bk * bq) * 2 + Scratch<T>::shmem_size(bk * d) * 2;
    Policy policy(space, n_tiles * heads, Kokkos::AUTO);
    policy.set_scratch_size(0, Kokkos::PerTeam(scratch));
    Kokkos::parallel_for(
        "plm::model::attention_backward_dkdv", policy, KOKKOS_LAMBDA(const Member& team) {
          const int tile = team.league_rank() / heads, h = team.league_rank() % heads, hd = h * d;
          const int s0 = list(tile, 0), s1 = list(tile, 1), k0 = list(tile, 2);
          const int nk = s1 - k0 < bk ? s1 - k0 : bk;
          T* qs = Scratch<T>(team.team_scratch(0), bq * d).data();     // (bq, d)
          T* qt = Scratch<T>(team.team_scratch(0), bq * d).data();     // (d, bq)
          T* dos = Scratch<T>(team.team_scratch(0), bq * d).data();    // (bq, d)
          T* dot = Scratch<T>(team.team_scratch(0), bq * d).data();    // (d, bq)
          T* lse_s = Scratch<T>(team.team_scratch(0), bq).data();      // (bq)
          T* delta_s = Scratch<T>(team.team_scratch(0), bq).data();    // (bq)
          T* pm = Scratch<T>(team.team_scratch(0), bk * bq).data();    // (bk, bq) probabilities
          T* dsm = Scratch<T>(team.team_scratch(0), bk * bq).data();   // (bk, bq) score gradients
          T* dk_acc = Scratch<T>(team.team_scratch(0), bk * d).data(); // (bk, d)
          T* dv_acc = Scratch<T>(team.team_scratch(0), bk * d).data(); // (bk, d)
          Kokkos::parallel_for(Kokkos::TeamThreadRange(team, nk), [&](const int j) {
            for (int c = 0; c < d; ++c) dk_acc[j * d + c] = dv_acc[j * d + c] = 0;
          });
          for (int q0 = s0; q0 < s1; q0 += bq) {
            const int nq = s1 - q0 < bq ? s1 - q0 : bq;
            team.team_barrier();
            Kokkos::parallel_for(Kokkos::TeamThreadRange(team, nq * d), [&](const int idx) {
              const int r = idx / d, c = idx % d;
              const T qv = q(q0 + r, hd + c), ov = dout(q0 + r, hd + c);
              qs[r * d + c] = qv;
              qt[c * bq + r] = qv;
              dos[r * d + c] = ov;
              dot[c * bq + r] = ov;
            });
            Kokkos::parallel_for(Kokkos::TeamThreadRange(team, nq), [&](const int r) {
              lse_s[r] = lse(q0 + r, h);
              delta_s[r] = delta(q0 + r, h);
            });
            team.team_barrier();
            Kokkos::parallel_for(Kokkos::TeamThreadRange(team, nk), [&](const int j) {
              T* prow = pm + j * bq;
              T* dsrow = dsm + j * bq;
              for (int r = 0; r < nq; ++r) prow[r] = dsrow[r] = 0;
              const T* krow = &k(k0 + j, hd);
              const T* vrow = &v(k0 + j, hd);
              for (int c = 0; c < d; ++c) {
                const T kc = krow[c], vc = vrow[c];
                const T* qtr = qt + c * bq;
                const T* dotr = dot + c * bq;
                for (int r = 0; r < nq; ++r) {
                  prow[r] += kc * qtr[r];
                  dsrow[r] += vc * dotr[r];
                }
              }
              for (int r = 0; r < nq; ++r) prow[r] = math::exp(prow[r] - lse_s[r]);
              for (int r = 0; r < nq; ++r) dsrow[r] = prow[r] * (dsrow[r] - delta_s[r]);
              T* dvr = dv_acc + j * d;
              T* dkr = dk_acc + j * d;
              for (int r = 0; r < nq; ++r) {
                const T p = prow[r], ds = dsrow[r];
                const T* dor = dos + r * d;
                const T* qr = qs + r * d;
                for (int c = 0; c < d; ++c) {
                  dvr[c] += p * dor[c];
                  dkr[c] += ds * qr[c];
                }
              }
            });
          }
          team.team_barrier();
          Kokkos::parallel_for(Kokkos::TeamThreadRange(team, nk), [&](const int j) {
            for (int c = 0; c < d; ++c) {
              dk(k0 + j, hd + c) = dk_acc[j * d + c];
              dv(k0 + j, hd + c) = dv_acc[j * d + c];
            }
          });
        });
  }

  // Pass 2: one team per (query tile, head) accumulates dQ over the sequence's key tiles.
  {
    auto list = tileList(cu_seqlens, bq);
    const int n_tiles = static_cast<int>(list.extent(0));
    const size_t scratch = Scratch<T>::shmem_size(d * bk) * 3 + Scratch<T>::shmem_size(bq * bk) * 2 +
                           Scratch<T>::shmem_size(bq * d);
    Policy policy(space, n_tiles * heads, Kokkos::AUTO);
    policy.set_scratch_size(0, Kokkos::PerTeam(scratch));
    Kokkos::parallel_for(
        "plm::model::attention_backward_dq", policy, KOKKOS_LAMBDA(const Member& team) {
          const int tile = team.league_rank() / heads, h = team.league_rank() % heads, hd = h * d;
          const int s0 = list(tile, 0), s1 = list(tile, 1), q0 = list(tile, 2);
          const int nq = s1 - q0 < bq ? s1 - q0 : bq;
          T* kt = Scratch<T>(team.team_scratch(0), d * bk).data();     // (d, bk)
          T* vt = Scratch<T>(team.team_scratch(0), d * bk).data();     // (d, bk)
          T* ks = Scratch<T>(team.team_scratch(0), bk * d).data();     // (bk, d)
          T* sm = Scratch<T>(team.team_scratch(0), bq * bk).data();    // (bq, bk) probabilities
          T* dsm = Scratch<T>(team.team_scratch(0), bq * bk).data();   // (bq, bk) score gradients
          T* dq_acc = Scratch<T>(team.team_scratch(0), bq * d).data(); // (bq, d)
          Kokkos::parallel_for(Kokkos::TeamThreadRange(team, nq), [&](const int r) {
            for (int c = 0; c < d; ++c) dq_acc[r * d + c] = 0;
          });
          for (int k0 = s0; k0 < s1; k0 += bk) {
            const int nk = s1 - k0 < bk ? s1 - k0 : bk;
            team.team_barrier();
            Kokkos::parallel_for(Kokkos::TeamThreadRange(team, nk * d), [&](const int idx) {
              const int j = idx / d, c = idx % d;
              const T kv = k(k0 + j, hd + c);
              kt[c * bk + j] = kv;
              ks[j * d + c] = kv;
              vt[c * bk + j] = v(k0 + j, hd + c);
            });
            team.team_barrier();
            Kokkos::parallel_for(Kokkos::TeamThreadRange(team, nq), [&](const int r) {
              T* srow = sm + r * bk;
              T* dsrow = dsm + r * bk;
              for (int j = 0; j < nk; ++j) srow[j] = dsrow[j] = 0;
              const T* qrow = &q(q0 + r, hd);
              const T* dorow = &dout(q0 + r, hd);
              for (int c = 0; c < d; ++c) {
                const T qc = qrow[c], oc = dorow[c];
                const T* ktr = kt + c * bk;
                const T* vtr = vt + c * bk;
                for (int j = 0; j < nk; ++j) {
                  srow[j] += qc * ktr[j];
                  dsrow[j] += oc * vtr[j];
                }
              }
              const T lse_r = lse(q0 + r, h), delta_r = delta(q0 + r, h);
              for (int j = 0; j < nk; ++j) {
                const T p = math::exp(srow[j] - lse_r);
                dsrow[j] = p * (dsrow[j] - delta_r);
              }
              T* dqr = dq_acc + r * d;
              for (int j = 0; j < nk; ++j) {
                const T ds = dsrow[j];
                const T* ksr = ks + j * d;
                for (int c = 0; c < d; ++c) dqr[c] += ds * ksr[c];
              }
            });
          }
          team.team_barrier();
          Kokkos::parallel_for(Kokkos::TeamThreadRange(team, nq), [&](const int r) {
            for (int c = 0; c < d; ++c) dq(q0 + r, hd + c) = dq_acc[r * d + c];
          });
        });
  }
}

namespace {

/// (T, 2): the [start, end) of each token's sequence, and the longest sequence.
template <class T>
Kokkos::View<int**, Kokkos::LayoutRight, MemSpace> tokenBounds(const ExecSpace& space,
                                                               const View1<seqlen_t>& cu_seqlens,
                                                               std::int64_t tokens, int& max_len) {
  Kokkos::View<int**, Kokkos::LayoutRight, MemSpace> bounds("plm::model::attention_ref_bounds", tokens, 2);
  const int n = static_cast<int>(cu_seqlens.extent(0)) - 1;
  max_len = 0;
  if (n <= 0) return bounds;
  Kokkos::parallel_reduce(
      "plm::model::attention_ref_bounds", Kokkos::RangePolicy<ExecSpace>(space, 0, n),
      KOKKOS_LAMBDA(const int s, int& mx) {
        for (int t = cu_seqlens(s); t < cu_seqlens(s + 1); ++t) {
          bounds(t, 0) = cu_seqlens(s);
          bounds(t, 1) = cu_seqlens(s + 1);
        }
        const int len = cu_seqlens(s + 1) - cu_seqlens(s);
        mx = len > mx ? len : mx;
      },
      Kokkos::Max<int>(max_len));
  return bounds;
}

/// Probabilities P(h, i, j - start) for every query i, and lse (T, heads).
template <class T>
void referenceProbabilities(const ExecSpace& space, const View2<T>& q, const View2<T>& k,
                            const Kokkos::View<int**, Kokkos::LayoutRight, MemSpace>& bounds,
                            int heads, const View3<T>& p, const View2<T>& lse) {
  const int d = static_cast<int>(q.extent(1)) / heads;
  const auto tokens = static_cast<std::int64_t>(q.extent(0));
  Kokkos::parallel_for(
      "plm::model::attention_ref_scores",
      Kokkos::MDRangePolicy<ExecSpace, Kokkos::Rank<2>>(space, {0, 0}, {std::int64_t(heads), tokens}),
      KOKKOS_LAMBDA(const std::int64_t h, const std::int64_t i) {
        const int s0 = bounds(i, 0), s1 = bounds(i, 1);
        T mx = Kokkos::reduction_identity<T>::max();
        for (int j = s0; j < s1; ++j) {
          T s = 0;
          for (int c = 0; c < d; ++c) s += q(i, h * d + c) * k(j, h * d + c);
          p(h, i, j - s0) = s;
          mx = s > mx ? s : mx;
        }
        T sum = 0;
        for (int j = s0; j < s1; ++j) sum += Kokkos::Experimental::exp(p(h, i, j - s0) - mx);
        const T lse_i = mx + Kokkos::Experimental::log(sum);
        for (int j = s0; j < s1; ++j) p(h, i, j - s0) = Kokkos::Experimental::exp(p(h, i, j - s0) - lse_i);
        lse(i, h) = lse_i;
      });
}

}  // namespace

template <class T>
void attentionReferenceForward(const ExecSpace& space, const View2<T>& q, const View2<T>& k,
                               const View2<T>& v, const View1<seqlen_t>& cu_seqlens, int heads,
                               const View2<T>& out, const View2<T>& lse) {
  const auto tokens = static_cast<std::int64_t>(q.extent(0));
  const int d = static_cast<int>(q.extent(1)) / heads;
  int max_len = 0;
  auto bounds = tokenBounds<T>(space, cu_seqlens, tokens, max_len);
  View3<T> p("plm::model::attention_ref_p", heads, tokens, max_len);
  referenceProbabilities(space, q, k, bounds, heads, p, lse);
  Kokkos::parallel_for(
      "plm::model::attention_ref_forward",
      Kokkos::MDRangePolicy<ExecSpace, Kokkos::Rank<2>>(space, {0, 0}, {std::int64_t(heads), tokens}),
      KOKKOS_LAMBDA(const std::int64_t h, const std::int64_t i) {
        const int s0 = bounds(i, 0), s1 = bounds(i, 1);
        for (int c = 0; c < d; ++c) {
          T sum = 0;
          for (int j = s0; j < s1; ++j) sum += p(h, i, j - s0) * v(j, h * d + c);
          out(i, h * d + c) = sum;
        }
      });
}

template <class T>
void attentionReferenceBackward(const ExecSpace& space, const View2<T>& q, const View2<T>& k,
                                const View2<T>& v, const View2<T>& dout,
                                const View1<seqlen_t>& cu_seqlens, int heads, const View2<T>& dq,
                                const View2<T>& dk, const View2<T>& dv) {
  const auto tokens = static_cast<std::int64_t>(q.extent(0));
  const int d = static_cast<int>(q.extent(1)) / heads;
  int max_len = 0;
  auto bounds = tokenBounds<T>(space, cu_seqlens, tokens, max_len);
  View3<T> p("plm::model::attention_ref_p", heads, tokens, max_len);
  View3<T> ds("plm::model::attention_ref_ds", heads, tokens, max_len);
  View2<T> lse("plm::model::attention_ref_lse", tokens, heads);
  referenceProbabilities(space, q, k, bounds, heads, p, lse);
  Kokkos::parallel_for(
      "plm::model::attention_ref_backward_dq",
      Kokkos::MDRangePolicy<ExecSpace, Kokkos::Rank<2>>(space, {0, 0}, {std::int64_t(heads), tokens}),
      KOKKOS_LAMBDA(const std::int64_t h, const std::int64_t i) {
        const int s0 = bounds(i, 0), s1 = bounds(i, 1);
        T dsum = 0;
        for (int j = s0; j < s1; ++j) {
          T dp = 0;
          for (int c = 0; c < d; ++c) dp += dout(i, h * d + c) * v(j, h * d + c);
          ds(h, i, j - s0) = dp;
          dsum += p(h, i, j - s0) * dp;
        }
        for (int j = s0; j < s1; ++j) ds(h, i, j - s0) = p(h, i, j - s0) * (ds(h, i, j - s0) - dsum);
        for (int c = 0; c < d; ++c) {
          T sum = 0;
          for (int j = s0; j < s1; ++j) sum += ds(h, i, j - s0) * k(j, h * d + c);
          dq(i, h * d + c) = sum;
        }
      });
  Kokkos::parallel_for(
      "plm::model::attention_ref_backward_dkdv",
      Kokkos::MDRangePolicy<ExecSpace, Kokkos::Rank<2>>(space, {0, 0}, {std::int64_t(heads), tokens}),
      KOKKOS_LAMBDA(const std::int64_t h, const std::int64_t j) {
        const int s0 = bounds(j, 0), s1 = bounds(j, 1);
        for (int c = 0; c < d; ++c) {
          T sk = 0, sv = 0;
          for (int i = s0; i < s1; ++i) {
            sk += ds(h, i, j - s0) * q(i, h * d + c);
            sv += p(h, i, j - s0) * dout(i, h * d + c);
          }
          dk(j, h * d + c) = sk;
          dv(j, h * d + c) = sv;
        }
      });
}

#define PLM_MODEL_ATTENTION_INSTANTIATE(T)                                                       \
  template void attentionForward<T>(const ExecSpace&, const View2<T>&, const View2<T>&,          \
                                    const View2<T>&, const View1<seqlen_t>&, int,                \
                                    const View2<T>&, const View2<T>&, AttentionTiles);           \
  template void attentionBackward<T>(const ExecSpace&, const View2<T>&, const View2<T>&,         \
                                     const View2<T>&, const View2<T>&, const View2<T>&,          \
                                     const View2<T>&, const View1<seqlen_t>&, int,               \
                                     const View2<T>&, const View2<T>&, const View2<T>&,          \
                                     const View2<T>&, AttentionTiles);                           \
  template void attentionReferenceForward<T>(const ExecSpace&, const View2<T>&, const View2<T>&, \
                                             const View2<T>&, const View1<seqlen_t>&, int,       \
                                             const View2<T>&, const View2<T>&);                  \
  template void attentionReferenceBackward<T>(const ExecSpace&, const View2<T>&,                 \
                                              const View2<T>&, const View2<T>&, const View2<T>&, \
                                              const View1<seqlen_t>&, int, const View2<T>&,      \
                                              const View2<T>&, const View2<T>&);

PLM_MODEL_ATTENTION_INSTANTIATE(float)
PLM_MODEL_ATTENTION_INSTANTIATE(double)

}  // namespace plm::model
