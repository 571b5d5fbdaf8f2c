// AVX2+FMA building blocks for the CPU fast paths of the model's float kernels.
//
// Compiled for that target only (function attributes), chosen at run time by haveAvx2(), so the
// binary still runs on any x86-64 and the portable loops remain the reference.  Only included
// by host-only code paths (never seen by nvcc).
#pragma once

#if defined(__GNUC__) && !defined(__CUDACC__) && defined(__x86_64__)
#define PLM_MODEL_HAVE_AVX2_PATH 1

#include <immintrin.h>

namespace plm::model::detail {

inline bool haveAvx2() {
  static const bool have = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return have;
}

/// exp on 8 lanes: the Cephes polynomial of math::exp, with FMA.
__attribute__((target("avx2,fma"))) inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.0f)), _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  const __m256 r2 = _mm256_mul_ps(r, r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_add_ps(_mm256_fmadd_ps(p, r2, r), _mm256_set1_ps(1.0f));
  const __m256i e =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/// erf on 8 lanes: Abramowitz & Stegun 7.1.26 as math::erf.
__attribute__((target("avx2,fma"))) inline __m256 erf8(__m256 x) {
  const __m256 sign = _mm256_and_ps(x, _mm256_set1_ps(-0.0f));
  const __m256 ax = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x);
  const __m256 t = _mm256_div_ps(
      _mm256_set1_ps(1.0f), _mm256_fmadd_ps(_mm256_set1_ps(0.3275911f), ax, _mm256_set1_ps(1.0f)));
  __m256 y = _mm256_set1_ps(1.061405429f);
  y = _mm256_fmadd_ps(y, t, _mm256_set1_ps(-1.453152027f));
  y = _mm256_fmadd_ps(y, t, _mm256_set1_ps(1.421413741f));
  y = _mm256_fmadd_ps(y, t, _mm256_set1_ps(-0.284496736f));
  y = _mm256_fmadd_ps(y, t, _mm256_set1_ps(0.254829592f));
  const __m256 e = exp8(_mm256_mul_ps(_mm256_sub_ps(_mm256_setzero_ps(), ax), ax));
  y = _mm256_fnmadd_ps(_mm256_mul_ps(y, t), e, _mm256_set1_ps(1.0f));
  return _mm256_or_ps(y, sign);
}

__attribute__((target("avx2,fma"))) inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

}  // namespace plm::model::detail

#endif
