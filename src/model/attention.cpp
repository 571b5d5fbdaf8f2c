// Accumulation rule: out, lse, dq, dk, dv written (=).
//
// One team per (tile, head).  Tiles of Q, K, V, dO are staged in team scratch (transposed where
// the product wants it, padded with zeros to whole 4x8 blocks), and every tile product runs
// through one register-blocked micro-kernel (4 rows x 8 columns of C held in registers across
// the reduction), which is what makes the CPU path fast; the team's threads split the blocks.
// Softmax statistics and the element-wise steps are per row.  A CUDA specialisation replaces
// this kernel at the same entry points.
#include "model/attention.hpp"

#include "core/error.hpp"
#include "model/detail/avx2.hpp"
#include "model/math.hpp"

#include <limits>
#include <type_traits>
#include <vector>

namespace plm::model {
namespace {

using Policy = Kokkos::TeamPolicy<ExecSpace>;
using Member = Policy::member_type;
template <class T> using Scratch =
    Kokkos::View<T*, ExecSpace::scratch_memory_space, Kokkos::MemoryTraits<Kokkos::Unmanaged>>;

/// (n_tiles, 4): sequence start, sequence end, tile start, sequence index; tiles of `block`
/// rows per sequence.
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
      flat.push_back(s);
    }
  const auto tiles = static_cast<std::int64_t>(flat.size() / 4);
  Kokkos::View<int**, Kokkos::LayoutRight, MemSpace> list(
      Kokkos::view_alloc(Kokkos::WithoutInitializing, "plm::model::attention_tiles"), tiles, 4);
  if (tiles > 0) {
    Kokkos::View<const int**, Kokkos::LayoutRight, HostSpace,
                 Kokkos::MemoryTraits<Kokkos::Unmanaged>>
        host(flat.data(), tiles, 4);
    Kokkos::deep_copy(list, host);
  }
  return list;
}

void checkTiles(const AttentionTiles& tiles) {
  if (tiles.queries <= 0 || tiles.keys <= 0)
    throw Error("plm::model::attention: tile sizes must be positive (a bug in the caller)");
}

constexpr int kRows = 4;  // micro-kernel rows of C
constexpr int kCols = 8;  // micro-kernel columns of C

KOKKOS_INLINE_FUNCTION int roundUp(int x, int m) { return (x + m - 1) / m * m; }

/// C[0:4][0:8] (=, or += when accumulate) sum_k A[0:4][k] B[k][0:8]; A(i, k) is
/// a[i * sa + k * sk] (sk = 1 row-major, sa = 1 a transposed operand), B and C row-major with
/// leading dimensions ldb, ldc.
template <class T>
KOKKOS_INLINE_FUNCTION void microKernel(int depth, const T* KOKKOS_RESTRICT a, int sa, int sk,
                                        const T* KOKKOS_RESTRICT b, int ldb, T* KOKKOS_RESTRICT c,
                                        int ldc, bool accumulate) {
  T acc[kRows][kCols];
  for (int i = 0; i < kRows; ++i)
    for (int u = 0; u < kCols; ++u) acc[i][u] = accumulate ? c[i * ldc + u] : T(0);
  for (int k = 0; k < depth; ++k) {
    const T* KOKKOS_RESTRICT bk = b + k * ldb;
    for (int i = 0; i < kRows; ++i) {
      const T ai = a[i * sa + k * sk];
      for (int u = 0; u < kCols; ++u) acc[i][u] += ai * bk[u];
    }
  }
  for (int i = 0; i < kRows; ++i)
    for (int u = 0; u < kCols; ++u) c[i * ldc + u] = acc[i][u];
}

#if defined(__GNUC__) && !defined(__CUDACC__)
// GCC vectorizes the plain loops above along the reduction instead of keeping the 4x8 block in
// registers (2.5x slower, measured); spelled with vector types it runs at the core's SIMD rate.
using Float4 = float __attribute__((vector_size(16)));

template <> inline void microKernel<float>(int depth, const float* KOKKOS_RESTRICT a, int sa,
                                           int sk, const float* KOKKOS_RESTRICT b, int ldb,
                                           float* KOKKOS_RESTRICT c, int ldc, bool accumulate) {
  Float4 acc[kRows][2];
  for (int i = 0; i < kRows; ++i)
    for (int u = 0; u < 2; ++u) {
      if (accumulate)
        __builtin_memcpy(&acc[i][u], c + i * ldc + 4 * u, sizeof(Float4));
      else
        acc[i][u] = Float4{0, 0, 0, 0};
    }
  for (int k = 0; k < depth; ++k) {
    Float4 b0, b1;
    __builtin_memcpy(&b0, b + k * ldb, sizeof(Float4));
    __builtin_memcpy(&b1, b + k * ldb + 4, sizeof(Float4));
    for (int i = 0; i < kRows; ++i) {
      const float ai = a[i * sa + k * sk];
      acc[i][0] += ai * b0;
      acc[i][1] += ai * b1;
    }
  }
  for (int i = 0; i < kRows; ++i)
    for (int u = 0; u < 2; ++u) __builtin_memcpy(c + i * ldc + 4 * u, &acc[i][u], sizeof(Float4));
}
#endif

#ifdef PLM_MODEL_HAVE_AVX2_PATH
#define PLM_MODEL_ATTENTION_AVX2 1
using detail::exp8;
using detail::haveAvx2;
using detail::hsum8;
/// The 8x8 AVX2+FMA variant (8 ymm accumulators), compiled for that target alone and chosen at
/// run time, so the binary still runs on any x86-64: about 2x the SSE2 kernel's rate.
__attribute__((target("avx2,fma"), noinline)) void microKernel8x8Avx2(
    int depth, const float* KOKKOS_RESTRICT a, int sa, int sk, const float* KOKKOS_RESTRICT b,
    int ldb, float* KOKKOS_RESTRICT c, int ldc, bool accumulate) {
  __m256 acc[8];
  for (int i = 0; i < 8; ++i)
    acc[i] = accumulate ? _mm256_loadu_ps(c + i * ldc) : _mm256_setzero_ps();
  for (int k = 0; k < depth; ++k) {
    const __m256 bk = _mm256_loadu_ps(b + k * ldb);
    for (int i = 0; i < 8; ++i)
      acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(a[i * sa + k * sk]), bk, acc[i]);
  }
  for (int i = 0; i < 8; ++i) _mm256_storeu_ps(c + i * ldc, acc[i]);
}

/// Forward softmax row step: returns the new max m, writes x = exp(x - m) and *sum = sum x.
__attribute__((target("avx2,fma"), noinline)) float softmaxRowAvx2(int n, float* x, float m_old,
                                                                   float* sum) {
  __m256 mx8 = _mm256_set1_ps(m_old);
  int i = 0;
  for (; i + 8 <= n; i += 8) mx8 = _mm256_max_ps(mx8, _mm256_loadu_ps(x + i));
  float mx = m_old;
  {
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, mx8);
    for (int u = 0; u < 8; ++u) mx = lanes[u] > mx ? lanes[u] : mx;
  }
  for (; i < n; ++i) mx = x[i] > mx ? x[i] : mx;
  const __m256 m8 = _mm256_set1_ps(mx);
  __m256 s8 = _mm256_setzero_ps();
  i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), m8));
    _mm256_storeu_ps(x + i, p);
    s8 = _mm256_add_ps(s8, p);
  }
  float s = hsum8(s8);
  for (; i < n; ++i) {
    x[i] = math::exp(x[i] - mx);
    s += x[i];
  }
  *sum = s;
  return mx;
}

/// Backward element-wise step: p = exp(s - lse), ds = p (dp - delta), in place.
__attribute__((target("avx2,fma"), noinline)) void probabilityGradAvx2(int n, float* p, float* ds,
                                                                       const float* lse,
                                                                       const float* delta) {
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 pv = exp8(_mm256_sub_ps(_mm256_loadu_ps(p + i), _mm256_loadu_ps(lse + i)));
    _mm256_storeu_ps(p + i, pv);
    _mm256_storeu_ps(ds + i, _mm256_mul_ps(pv, _mm256_sub_ps(_mm256_loadu_ps(ds + i),
                                                             _mm256_loadu_ps(delta + i))));
  }
  for (; i < n; ++i) {
    p[i] = math::exp(p[i] - lse[i]);
    ds[i] = p[i] * (ds[i] - delta[i]);
  }
}
#endif

/// C (rows x cols) (+)= A (rows x depth) B (depth x cols), on whole blocks of 4 (or 8) rows and
/// 8 columns: A needs roundUp(rows, 8) readable rows, B and C roundUp(cols, 8) readable
/// columns (zero padding; every scratch tile is allocated in multiples of 8).
/// A(i, k) = a[i * sa + k * sk].
template <class T> KOKKOS_INLINE_FUNCTION void teamGemm(const Member& team, int rows, int cols,
                                                        int depth, const T* a, int sa, int sk,
                                                        const T* b, int ldb, T* c, int ldc,
                                                        bool accumulate) {
  const int col_blocks = (cols + kCols - 1) / kCols;
#ifdef PLM_MODEL_ATTENTION_AVX2
  if constexpr (std::is_same_v<T, float>) {
    if (haveAvx2()) {
      const int row_blocks = (rows + 7) / 8;
      Kokkos::parallel_for(Kokkos::TeamThreadRange(team, row_blocks * col_blocks),
                           [&](const int idx) {
                             const int i = idx / col_blocks, j = idx % col_blocks;
                             microKernel8x8Avx2(depth, a + i * 8 * sa, sa, sk, b + j * kCols, ldb,
                                                c + i * 8 * ldc + j * kCols, ldc, accumulate);
                           });
      return;
    }
  }
#endif
  const int row_blocks = (rows + kRows - 1) / kRows;
  Kokkos::parallel_for(Kokkos::TeamThreadRange(team, row_blocks * col_blocks), [&](const int idx) {
    const int i = idx / col_blocks, j = idx % col_blocks;
    microKernel(depth, a + i * kRows * sa, sa, sk, b + j * kCols, ldb,
                c + i * kRows * ldc + j * kCols, ldc, accumulate);
  });
}

template <class T> KOKKOS_INLINE_FUNCTION T rowMax(int n, const T* KOKKOS_RESTRICT x, T start) {
  T mx = start;
  for (int i = 0; i < n; ++i) mx = x[i] > mx ? x[i] : mx;
  return mx;
}

/// Float max through order-preserving integer keys (a float compare may trap, which keeps GCC
/// from vectorizing; integer compares do not).
KOKKOS_INLINE_FUNCTION std::int32_t orderKey(std::int32_t bits) {
  return bits ^ ((bits >> 31) & 0x7fffffff);
}

template <>
KOKKOS_INLINE_FUNCTION float rowMax<float>(int n, const float* KOKKOS_RESTRICT x, float start) {
  std::int32_t best = orderKey(math::floatBits(start));
  for (int i = 0; i < n; ++i) {
    const std::int32_t key = orderKey(math::floatBits(x[i]));
    best = key > best ? key : best;
  }
  return math::bitsFloat(orderKey(best));
}

template <class T> KOKKOS_INLINE_FUNCTION T rowSum(int n, const T* KOKKOS_RESTRICT x) {
  T part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int i = 0;
  for (; i + 8 <= n; i += 8)
    for (int u = 0; u < 8; ++u) part[u] += x[i + u];
  for (; i < n; ++i) part[0] += x[i];
  return ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
}

/// Forward softmax row step: new max m = max(m_old, x), x = exp(x - m), returns m; *sum = sum x.
template <class T> KOKKOS_INLINE_FUNCTION T softmaxRow(int n, T* x, T m_old, T* sum) {
#ifdef PLM_MODEL_ATTENTION_AVX2
  if constexpr (std::is_same_v<T, float>)
    if (haveAvx2()) return softmaxRowAvx2(n, x, m_old, sum);
#endif
  const T mx = rowMax(n, x, m_old);
  for (int j = 0; j < n; ++j) x[j] = math::exp(x[j] - mx);
  *sum = rowSum(n, x);
  return mx;
}

/// Backward element-wise step on a row of scores s (becoming p) and of dp (becoming ds):
/// p = exp(s - lse), ds = p (dp - delta); lse and delta indexed like the row.
template <class T> KOKKOS_INLINE_FUNCTION void probabilityGrad(int n, T* KOKKOS_RESTRICT p,
                                                               T* KOKKOS_RESTRICT ds, const T* lse,
                                                               const T* delta) {
#ifdef PLM_MODEL_ATTENTION_AVX2
  if constexpr (std::is_same_v<T, float>)
    if (haveAvx2()) return probabilityGradAvx2(n, p, ds, lse, delta);
#endif
  for (int i = 0; i < n; ++i) {
    const T pi = math::exp(p[i] - lse[i]);
    p[i] = pi;
    ds[i] = pi * (ds[i] - delta[i]);
  }
}

/// Stages rows [row0, row0 + n) of head columns [hd, hd + d) of x into scratch, row-major
/// (rows_pad x ld, zero beyond n rows and d columns) and/or transposed (d x ld_t, zero beyond n
/// columns).  Either destination may be null.
template <class T> KOKKOS_INLINE_FUNCTION void stage(const Member& team, const View2<T>& x,
                                                     int row0, int n, int hd, int d, T* rows,
                                                     int rows_pad, int ld, T* trans, int ld_t) {
  if (rows)
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, rows_pad), [&](const int r) {
      T* KOKKOS_RESTRICT dst = rows + r * ld;
      int c = 0;
      if (r < n) {
        const T* KOKKOS_RESTRICT src = &x(row0 + r, hd);
        for (; c < d; ++c) dst[c] = src[c];
      }
      for (; c < ld; ++c) dst[c] = T(0);
    });
  if (trans)
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, ld_t), [&](const int r) {
      if (r < n) {
        const T* KOKKOS_RESTRICT src = &x(row0 + r, hd);
        for (int c = 0; c < d; ++c) trans[c * ld_t + r] = src[c];
      } else {
        for (int c = 0; c < d; ++c) trans[c * ld_t + r] = T(0);
      }
    });
}

/// Stages the transpose of rows [row0, row0 + n) of head columns [hd, hd + d) from a
/// head-transposed copy xt (element (t, col) at xt[col * tokens + t]) into trans (d x ld_t, zero
/// beyond n): contiguous copies instead of a strided transpose in every tile pair.
template <class T> KOKKOS_INLINE_FUNCTION void stageTransposed(const Member& team, const T* xt,
                                                               std::int64_t tokens, int row0, int n,
                                                               int hd, int d, T* trans, int ld_t) {
  Kokkos::parallel_for(Kokkos::TeamThreadRange(team, d), [&](const int c) {
    const T* KOKKOS_RESTRICT src = xt + (hd + c) * tokens + row0;
    T* KOKKOS_RESTRICT dst = trans + c * ld_t;
    int r = 0;
    for (; r < n; ++r) dst[r] = src[r];
    for (; r < ld_t; ++r) dst[r] = T(0);
  });
}

/// xt[col * T + t] = x(t, col): each head's columns become contiguous rows over tokens.
template <class T> void transposeColumns(const ExecSpace& space, const View2<T>& x, T* xt) {
  const auto tokens = static_cast<std::int64_t>(x.extent(0));
  const auto cols = static_cast<std::int64_t>(x.extent(1));
  constexpr std::int64_t block =
      32;  // tokens per thread: reads and writes both stay in cache lines
  Kokkos::parallel_for(
      "plm::model::attention_transpose", FlatPolicy(space, 0, (tokens + block - 1) / block),
      KOKKOS_LAMBDA(const std::int64_t b) {
        const std::int64_t t1 = (b + 1) * block < tokens ? (b + 1) * block : tokens;
        for (std::int64_t c = 0; c < cols; ++c)
          for (std::int64_t t = b * block; t < t1; ++t) xt[c * tokens + t] = x(t, c);
      });
}

/// Workspace of at least n elements: the caller's, or a fresh one.
template <class T> View1<T> workspaceOf(const View1<T>& given, std::int64_t n) {
  if (static_cast<std::int64_t>(given.extent(0)) >= n) return given;
  return View1<T>(Kokkos::view_alloc(Kokkos::WithoutInitializing, "plm::model::attention_work"), n);
}

}  // namespace

template <class T> void attentionForward(const ExecSpace& space, const View2<T>& q,
                                         const View2<T>& k, const View2<T>& v,
                                         const View1<seqlen_t>& cu_seqlens, int heads,
                                         const View2<T>& out, const View2<T>& lse,
                                         AttentionTiles tiles, const View1<T>& workspace) {
  attentionForward(space, q, k, v, cu_seqlens, cu_seqlens, heads, out, lse, tiles, workspace);
}

template <class T>
void attentionForward(const ExecSpace& space, const View2<T>& q, const View2<T>& k,
                      const View2<T>& v, const View1<seqlen_t>& cu_seqlens_q,
                      const View1<seqlen_t>& cu_seqlens_k, int heads, const View2<T>& out,
                      const View2<T>& lse, AttentionTiles tiles, const View1<T>& workspace) {
  checkTiles(tiles);
  const auto tokens = static_cast<std::int64_t>(k.extent(0));  // rows of the transposed keys
  auto work = workspaceOf(workspace, static_cast<std::int64_t>(k.size()));
  const T* k_t = work.data();
  transposeColumns(space, k, work.data());
  const int d = static_cast<int>(q.extent(1)) / heads;
  const int bq = tiles.queries, bk = tiles.keys;
  const int bqp = roundUp(bq, kCols), bkp = roundUp(bk, kCols), dp = roundUp(d, kCols);
  auto list = tileList(cu_seqlens_q, bq);
  const int n_tiles = static_cast<int>(list.extent(0));
  if (n_tiles == 0) return;
  const View1<seqlen_t> cu_k = cu_seqlens_k;
  const size_t scratch = Scratch<T>::shmem_size(bqp * d) + Scratch<T>::shmem_size(d * bkp) +
                         Scratch<T>::shmem_size(bqp * bkp) + Scratch<T>::shmem_size(bkp * dp) +
                         Scratch<T>::shmem_size(bqp * dp) + Scratch<T>::shmem_size(bqp) * 2;
  Policy policy(space, n_tiles * heads, Kokkos::AUTO);
  // Tiles live in fast team scratch (level 0) when they fit it (always on the CPU; 48 KB of
  // shared memory per team on CUDA), otherwise in level-1 scratch (device memory).
  const int level = scratch <= static_cast<size_t>(Policy::scratch_size_max(0)) ? 0 : 1;
  policy.set_scratch_size(level, Kokkos::PerTeam(scratch));
  const T lowest = Kokkos::reduction_identity<T>::max();
  const T minus_inf = -std::numeric_limits<T>::infinity();
  Kokkos::parallel_for(
      "plm::model::attention_forward", policy, KOKKOS_LAMBDA(const Member& team) {
        const int tile = team.league_rank() / heads, h = team.league_rank() % heads, hd = h * d;
        const int s1 = list(tile, 1), q0 = list(tile, 2), seq = list(tile, 3);
        const int nq = s1 - q0 < bq ? s1 - q0 : bq;
        const int k_begin = cu_k(seq), k_end = cu_k(seq + 1);
        T* qs = Scratch<T>(team.team_scratch(level), bqp * d).data();  // (bqp, d) queries
        T* kt = Scratch<T>(team.team_scratch(level), d * bkp).data();  // (d, bkp) keys, transposed
        T* sc =
            Scratch<T>(team.team_scratch(level), bqp * bkp).data();     // (bqp, bkp) scores, then p
        T* vs = Scratch<T>(team.team_scratch(level), bkp * dp).data();  // (bkp, dp) values
        T* acc =
            Scratch<T>(team.team_scratch(level), bqp * dp).data();  // (bqp, dp) unnormalised out
        T* m = Scratch<T>(team.team_scratch(level), bqp).data();    // (bqp) running max
        T* l = Scratch<T>(team.team_scratch(level), bqp).data();    // (bqp) running sum
        stage(team, q, q0, nq, hd, d, qs, bqp, d, static_cast<T*>(nullptr), 0);
        Kokkos::parallel_for(Kokkos::TeamThreadRange(team, bqp), [&](const int r) {
          m[r] = lowest;
          l[r] = 0;
          for (int c = 0; c < dp; ++c) acc[r * dp + c] = 0;
        });
        for (int k0 = k_begin; k0 < k_end; k0 += bk) {
          const int nk = k_end - k0 < bk ? k_end - k0 : bk;
          team.team_barrier();
          stageTransposed(team, k_t, tokens, k0, nk, hd, d, kt, bkp);
          stage(team, v, k0, nk, hd, d, vs, bkp, dp, static_cast<T*>(nullptr), 0);
          team.team_barrier();
          teamGemm(team, nq, nk, d, qs, d, 1, kt, bkp, sc, bkp, false);
          team.team_barrier();
          Kokkos::parallel_for(Kokkos::TeamThreadRange(team, nq), [&](const int r) {
            T* srow = sc + r * bkp;
            T sum = 0;
            const T mx = softmaxRow(nk, srow, m[r], &sum);
            const T corr = math::exp(m[r] - mx);
            l[r] = l[r] * corr + sum;
            m[r] = mx;
            for (int c = 0; c < dp; ++c) acc[r * dp + c] *= corr;
          });
          team.team_barrier();
          teamGemm(team, nq, d, nk, sc, bkp, 1, vs, dp, acc, dp, true);
        }
        team.team_barrier();
        Kokkos::parallel_for(Kokkos::TeamThreadRange(team, nq), [&](const int r) {
          // No key at all (a context-parallel block whose key chunk of this sequence is
          // empty): out 0 and lse -inf, the neutral element of the log-sum-exp merge.
          const T inv = l[r] > T(0) ? T(1) / l[r] : T(0);
          for (int c = 0; c < d; ++c) out(q0 + r, hd + c) = acc[r * dp + c] * inv;
          lse(q0 + r, h) = l[r] > T(0) ? m[r] + math::libm::log(l[r]) : minus_inf;
        });
      });
}

template <class T>
void attentionBackward(const ExecSpace& space, const View2<T>& q, const View2<T>& k,
                       const View2<T>& v, const View2<T>& out, const View2<T>& lse,
                       const View2<T>& dout, const View1<seqlen_t>& cu_seqlens, int heads,
                       const View2<T>& delta, const View2<T>& dq, const View2<T>& dk,
                       const View2<T>& dv, AttentionTiles tiles, const View1<T>& workspace) {
  attentionBackward(space, q, k, v, out, lse, dout, cu_seqlens, cu_seqlens, heads, delta, dq, dk,
                    dv, tiles, workspace);
}

template <class T>
void attentionBackward(const ExecSpace& space, const View2<T>& q, const View2<T>& k,
                       const View2<T>& v, const View2<T>& out, const View2<T>& lse,
                       const View2<T>& dout, const View1<seqlen_t>& cu_seqlens_q,
                       const View1<seqlen_t>& cu_seqlens_k, int heads, const View2<T>& delta,
                       const View2<T>& dq, const View2<T>& dk, const View2<T>& dv,
                       AttentionTiles tiles, const View1<T>& workspace) {
  checkTiles(tiles);
  const View1<seqlen_t> cu_q = cu_seqlens_q, cu_k = cu_seqlens_k;
  const int d = static_cast<int>(q.extent(1)) / heads;
  const int bq = tiles.queries, bk = tiles.keys;
  const int bqp = roundUp(bq, kCols), bkp = roundUp(bk, kCols), dp = roundUp(d, kCols);
  const auto tokens = static_cast<std::int64_t>(q.extent(0));
  Kokkos::parallel_for(
      "plm::model::attention_backward_delta", FlatPolicy(space, 0, tokens),
      KOKKOS_LAMBDA(const std::int64_t t) {
        for (int h = 0; h < heads; ++h) {
          T sum = 0;
          for (int c = 0; c < d; ++c) sum += dout(t, h * d + c) * out(t, h * d + c);
          delta(t, h) = sum;
        }
      });

  // One team per (sequence, head): the outer loop runs over key tiles (accumulating dK, dV in
  // scratch), the inner loop over query tiles; each (query tile, key tile) pair also yields
  // dS K, added to this sequence's rows of dq, which no other team touches.  So dQ needs no
  // atomics and no second pass, and the order of additions is fixed.
  const int n = static_cast<int>(cu_seqlens_q.extent(0)) - 1;
  if (n <= 0) return;
  auto work = workspaceOf(workspace, 2 * static_cast<std::int64_t>(q.size()));
  const T* q_t = work.data();
  const T* dout_t = work.data() + q.size();
  transposeColumns(space, q, work.data());
  transposeColumns(space, dout, work.data() + q.size());
  const size_t scratch =
      Scratch<T>::shmem_size(bkp * dp) * 2 + Scratch<T>::shmem_size(d * bqp) * 2 +
      Scratch<T>::shmem_size(bqp * dp) * 3 + Scratch<T>::shmem_size(bqp) * 2 +
      Scratch<T>::shmem_size(bkp * bqp) * 2 + Scratch<T>::shmem_size(bkp * dp) * 2;
  Policy policy(space, n * heads, Kokkos::AUTO);
  // Tiles live in fast team scratch (level 0) when they fit it (always on the CPU; 48 KB of
  // shared memory per team on CUDA), otherwise in level-1 scratch (device memory).
  const int level = scratch <= static_cast<size_t>(Policy::scratch_size_max(0)) ? 0 : 1;
  policy.set_scratch_size(level, Kokkos::PerTeam(scratch));
  Kokkos::parallel_for(
      "plm::model::attention_backward", policy, KOKKOS_LAMBDA(const Member& team) {
        const int seq = team.league_rank() / heads, h = team.league_rank() % heads, hd = h * d;
        const int s0 = cu_q(seq), s1 = cu_q(seq + 1);  // queries
        const int k_begin = cu_k(seq), k_end = cu_k(seq + 1);
        T* ks = Scratch<T>(team.team_scratch(level), bkp * dp).data();   // (bkp, dp)
        T* vs = Scratch<T>(team.team_scratch(level), bkp * dp).data();   // (bkp, dp)
        T* qt = Scratch<T>(team.team_scratch(level), d * bqp).data();    // (d, bqp)
        T* dot = Scratch<T>(team.team_scratch(level), d * bqp).data();   // (d, bqp)
        T* qs = Scratch<T>(team.team_scratch(level), bqp * dp).data();   // (bqp, dp)
        T* dos = Scratch<T>(team.team_scratch(level), bqp * dp).data();  // (bqp, dp)
        T* dq_t =
            Scratch<T>(team.team_scratch(level), bqp * dp).data();    // (bqp, dp) dS K of one pair
        T* lse_s = Scratch<T>(team.team_scratch(level), bqp).data();  // (bqp)
        T* delta_s = Scratch<T>(team.team_scratch(level), bqp).data();      // (bqp)
        T* pt = Scratch<T>(team.team_scratch(level), bkp * bqp).data();     // (bkp, bqp) P^T
        T* dst = Scratch<T>(team.team_scratch(level), bkp * bqp).data();    // (bkp, bqp) dS^T
        T* dk_acc = Scratch<T>(team.team_scratch(level), bkp * dp).data();  // (bkp, dp)
        T* dv_acc = Scratch<T>(team.team_scratch(level), bkp * dp).data();  // (bkp, dp)
        Kokkos::parallel_for(Kokkos::TeamThreadRange(team, s1 - s0), [&](const int r) {
          for (int c = 0; c < d; ++c) dq(s0 + r, hd + c) = 0;
        });
        for (int k0 = k_begin; k0 < k_end; k0 += bk) {
          const int nk = k_end - k0 < bk ? k_end - k0 : bk;
          team.team_barrier();
          stage(team, k, k0, nk, hd, d, ks, bkp, dp, static_cast<T*>(nullptr), 0);
          stage(team, v, k0, nk, hd, d, vs, bkp, dp, static_cast<T*>(nullptr), 0);
          Kokkos::parallel_for(Kokkos::TeamThreadRange(team, bkp * dp), [&](const int i) {
            dk_acc[i] = 0;
            dv_acc[i] = 0;
          });
          for (int q0 = s0; q0 < s1; q0 += bq) {
            const int nq = s1 - q0 < bq ? s1 - q0 : bq;
            team.team_barrier();
            stage(team, q, q0, nq, hd, d, qs, bqp, dp, static_cast<T*>(nullptr), 0);
            stage(team, dout, q0, nq, hd, d, dos, bqp, dp, static_cast<T*>(nullptr), 0);
            stageTransposed(team, q_t, tokens, q0, nq, hd, d, qt, bqp);
            stageTransposed(team, dout_t, tokens, q0, nq, hd, d, dot, bqp);
            Kokkos::parallel_for(Kokkos::TeamThreadRange(team, nq), [&](const int r) {
              lse_s[r] = lse(q0 + r, h);
              delta_s[r] = delta(q0 + r, h);
            });
            team.team_barrier();
            teamGemm(team, nk, nq, d, ks, dp, 1, qt, bqp, pt, bqp, false);    // S^T = K Q^T
            teamGemm(team, nk, nq, d, vs, dp, 1, dot, bqp, dst, bqp, false);  // dP^T = V dO^T
            team.team_barrier();
            Kokkos::parallel_for(Kokkos::TeamThreadRange(team, nk), [&](const int j) {
              probabilityGrad(nq, pt + j * bqp, dst + j * bqp, lse_s, delta_s);
            });
            team.team_barrier();
            teamGemm(team, nk, d, nq, pt, bqp, 1, dos, dp, dv_acc, dp, true);  // dV += P^T dO
            teamGemm(team, nk, d, nq, dst, bqp, 1, qs, dp, dk_acc, dp, true);  // dK += dS^T Q
            teamGemm(team, nq, d, nk, dst, 1, bqp, ks, dp, dq_t, dp, false);   // dS K
            team.team_barrier();
            Kokkos::parallel_for(Kokkos::TeamThreadRange(team, nq), [&](const int r) {
              for (int c = 0; c < d; ++c) dq(q0 + r, hd + c) += dq_t[r * dp + c];
            });
          }
          team.team_barrier();
          Kokkos::parallel_for(Kokkos::TeamThreadRange(team, nk), [&](const int j) {
            for (int c = 0; c < d; ++c) {
              dk(k0 + j, hd + c) = dk_acc[j * dp + c];
              dv(k0 + j, hd + c) = dv_acc[j * dp + c];
            }
          });
        }
      });
}

namespace {

/// (T, 2): the [start, end) of each token's sequence, and the longest sequence.
template <class T>
Kokkos::View<int**, Kokkos::LayoutRight, MemSpace> tokenBounds(const ExecSpace& space,
                                                               const View1<seqlen_t>& cu_seqlens,
                                                               std::int64_t tokens, int& max_len) {
  Kokkos::View<int**, Kokkos::LayoutRight, MemSpace> bounds("plm::model::attention_ref_bounds",
                                                            tokens, 2);
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
      Kokkos::MDRangePolicy<ExecSpace, Kokkos::Rank<2>>(space, {0, 0},
                                                        {std::int64_t(heads), tokens}),
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
        for (int j = s0; j < s1; ++j) sum += math::libm::exp(p(h, i, j - s0) - mx);
        const T lse_i = mx + math::libm::log(sum);
        for (int j = s0; j < s1; ++j) p(h, i, j - s0) = math::libm::exp(p(h, i, j - s0) - lse_i);
        lse(i, h) = lse_i;
      });
}

}  // namespace

template <class T> void attentionReferenceForward(const ExecSpace& space, const View2<T>& q,
                                                  const View2<T>& k, const View2<T>& v,
                                                  const View1<seqlen_t>& cu_seqlens, int heads,
                                                  const View2<T>& out, const View2<T>& lse) {
  const auto tokens = static_cast<std::int64_t>(q.extent(0));
  const int d = static_cast<int>(q.extent(1)) / heads;
  int max_len = 0;
  auto bounds = tokenBounds<T>(space, cu_seqlens, tokens, max_len);
  View3<T> p("plm::model::attention_ref_p", heads, tokens, max_len);
  referenceProbabilities(space, q, k, bounds, heads, p, lse);
  Kokkos::parallel_for(
      "plm::model::attention_ref_forward",
      Kokkos::MDRangePolicy<ExecSpace, Kokkos::Rank<2>>(space, {0, 0},
                                                        {std::int64_t(heads), tokens}),
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
      Kokkos::MDRangePolicy<ExecSpace, Kokkos::Rank<2>>(space, {0, 0},
                                                        {std::int64_t(heads), tokens}),
      KOKKOS_LAMBDA(const std::int64_t h, const std::int64_t i) {
        const int s0 = bounds(i, 0), s1 = bounds(i, 1);
        T dsum = 0;
        for (int j = s0; j < s1; ++j) {
          T dp = 0;
          for (int c = 0; c < d; ++c) dp += dout(i, h * d + c) * v(j, h * d + c);
          ds(h, i, j - s0) = dp;
          dsum += p(h, i, j - s0) * dp;
        }
        for (int j = s0; j < s1; ++j)
          ds(h, i, j - s0) = p(h, i, j - s0) * (ds(h, i, j - s0) - dsum);
        for (int c = 0; c < d; ++c) {
          T sum = 0;
          for (int j = s0; j < s1; ++j) sum += ds(h, i, j - s0) * k(j, h * d + c);
          dq(i, h * d + c) = sum;
        }
      });
  Kokkos::parallel_for(
      "plm::model::attention_ref_backward_dkdv",
      Kokkos::MDRangePolicy<ExecSpace, Kokkos::Rank<2>>(space, {0, 0},
                                                        {std::int64_t(heads), tokens}),
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

#define PLM_MODEL_ATTENTION_INSTANTIATE(T)                                                         \
  template void attentionForward<T>(const ExecSpace&, const View2<T>&, const View2<T>&,            \
                                    const View2<T>&, const View1<seqlen_t>&, int, const View2<T>&, \
                                    const View2<T>&, AttentionTiles, const View1<T>&);             \
  template void attentionBackward<T>(                                                              \
      const ExecSpace&, const View2<T>&, const View2<T>&, const View2<T>&, const View2<T>&,        \
      const View2<T>&, const View2<T>&, const View1<seqlen_t>&, int, const View2<T>&,              \
      const View2<T>&, const View2<T>&, const View2<T>&, AttentionTiles, const View1<T>&);         \
  template void attentionReferenceForward<T>(const ExecSpace&, const View2<T>&, const View2<T>&,   \
                                             const View2<T>&, const View1<seqlen_t>&, int,         \
                                             const View2<T>&, const View2<T>&);                    \
  template void attentionReferenceBackward<T>(                                                     \
      const ExecSpace&, const View2<T>&, const View2<T>&, const View2<T>&, const View2<T>&,        \
      const View1<seqlen_t>&, int, const View2<T>&, const View2<T>&, const View2<T>&);

PLM_MODEL_ATTENTION_INSTANTIATE(float)
PLM_MODEL_ATTENTION_INSTANTIATE(double)

#define PLM_MODEL_ATTENTION_VARLEN_INSTANTIATE(T)                                                  \
  template void attentionForward<T>(const ExecSpace&, const View2<T>&, const View2<T>&,            \
                                    const View2<T>&, const View1<seqlen_t>&,                       \
                                    const View1<seqlen_t>&, int, const View2<T>&, const View2<T>&, \
                                    AttentionTiles, const View1<T>&);                              \
  template void attentionBackward<T>(                                                              \
      const ExecSpace&, const View2<T>&, const View2<T>&, const View2<T>&, const View2<T>&,        \
      const View2<T>&, const View2<T>&, const View1<seqlen_t>&, const View1<seqlen_t>&, int,       \
      const View2<T>&, const View2<T>&, const View2<T>&, const View2<T>&, AttentionTiles,          \
      const View1<T>&);

PLM_MODEL_ATTENTION_VARLEN_INSTANTIATE(float)
PLM_MODEL_ATTENTION_VARLEN_INSTANTIATE(double)

}  // namespace plm::model
