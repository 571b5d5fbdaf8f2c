// Helpers shared by the model tests: random views, packed batches, and a central
// finite-difference checker that perturbs one element at a time through a device kernel (so the
// same tests run where memory is not host-accessible).
#pragma once

#include "core/types.hpp"
#include "data/batch.hpp"
#include "model/math.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <string>
#include <vector>

namespace plm::model::test {

template <class T>
void fillNormal(const View1<T>& v, std::uint64_t seed, double scale = 1.0, double shift = 0.0) {
  Kokkos::parallel_for(
      "plm::model::test::fill", Kokkos::RangePolicy<ExecSpace>(0, v.extent(0)),
      KOKKOS_LAMBDA(const std::int64_t i) {
        v(i) = static_cast<T>(shift + scale * math::normal(seed, 7, i));
      });
  Kokkos::fence();
}

template <class T> View1<T> flat(const View2<T>& v) { return View1<T>(v.data(), v.size()); }

template <class T> View2<T> randomView(std::int64_t r, std::int64_t c, std::uint64_t seed,
                                       double scale = 1.0, double shift = 0.0) {
  View2<T> v("plm::model::test::random", r, c);
  fillNormal(flat(v), seed, scale, shift);
  return v;
}

template <class T>
View1<T> randomVector(std::int64_t n, std::uint64_t seed, double scale = 1.0, double shift = 0.0) {
  View1<T> v("plm::model::test::random", n);
  fillNormal(v, seed, scale, shift);
  return v;
}

template <class T> std::vector<T> toHost(const View1<T>& v) {
  std::vector<T> out(v.extent(0));
  Kokkos::deep_copy(Kokkos::View<T*, HostSpace>(out.data(), out.size()), v);
  return out;
}

template <class T> std::vector<T> toHost(const View2<T>& v) { return toHost(flat(v)); }

template <class T> double dotViews(const View2<T>& a, const View2<T>& b) {
  auto x = toHost(a), y = toHost(b);
  double s = 0;
  for (std::size_t i = 0; i < x.size(); ++i) s += double(x[i]) * double(y[i]);
  return s;
}

template <class T> T getElement(const View1<T>& v, std::int64_t i) {
  T value;
  Kokkos::deep_copy(Kokkos::View<T, HostSpace>(&value), Kokkos::subview(v, i));
  return value;
}

template <class T> void addToElement(const View1<T>& v, std::int64_t i, T delta) {
  Kokkos::parallel_for(
      "plm::model::test::nudge", Kokkos::RangePolicy<ExecSpace>(0, 1),
      KOKKOS_LAMBDA(const int) { v(i) += delta; });
  Kokkos::fence();
}

/// Compares `grad` with central differences of `loss` with respect to `x`, at up to `max_checks`
/// evenly spread elements (all of them for small views).
inline void checkGradient(const std::string& what, const View1<double>& x,
                          const View1<double>& grad, const std::function<double()>& loss,
                          double atol = 1e-7, double rtol = 1e-5, std::int64_t max_checks = 400,
                          double eps = 1e-5) {
  const auto n = static_cast<std::int64_t>(x.extent(0));
  ASSERT_EQ(static_cast<std::int64_t>(grad.extent(0)), n) << what;
  const std::int64_t stride = n > max_checks ? (n + max_checks - 1) / max_checks : 1;
  int failures = 0;
  double max_abs = 0;
  for (std::int64_t i = 0; i < n; i += stride) {
    addToElement(x, i, eps);
    const double up = loss();
    addToElement(x, i, -2 * eps);
    const double down = loss();
    addToElement(x, i, eps);
    const double numeric = (up - down) / (2 * eps);
    const double analytic = getElement(grad, i);
    max_abs = std::max(max_abs, std::abs(numeric));
    if (std::abs(numeric - analytic) > atol + rtol * std::abs(numeric) && failures++ < 5)
      ADD_FAILURE() << what << "[" << i << "]: finite difference " << numeric << " vs analytic "
                    << analytic;
  }
  EXPECT_EQ(failures, 0) << what;
  EXPECT_GT(max_abs, 0.0) << what << ": every checked derivative is zero, the check proves nothing";
}

/// A packed batch: each sequence is <cls> residues <eos> (length 1 keeps just <cls>); about
/// `mask_rate` of the residues are labelled, most of those replaced by <mask>.
inline data::MicroBatch makeBatch(const std::vector<int>& lengths, std::uint64_t seed,
                                  double mask_rate = 0.3) {
  std::int64_t total = 0;
  for (int l : lengths) total += l;
  data::MicroBatch b;
  b.tokens = HostView1<token_t>("tokens", total);
  b.labels = HostView1<std::int32_t>("labels", total);
  b.cu_seqlens = HostView1<seqlen_t>("cu", lengths.size() + 1);
  std::int64_t t = 0;
  std::uint64_t counter = 0;
  auto uniform = [&]() {
    return double(math::hash64(seed * 1000003 + counter++) >> 11) / 9007199254740992.0;
  };
  for (std::size_t s = 0; s < lengths.size(); ++s) {
    b.cu_seqlens(s) = static_cast<seqlen_t>(t);
    const int len = lengths[s];
    for (int i = 0; i < len; ++i, ++t) {
      b.labels(t) = data::vocab::ignore_label;
      if (i == 0) {
        b.tokens(t) = data::vocab::cls;
      } else if (i == len - 1) {
        b.tokens(t) = data::vocab::eos;
      } else {
        const auto residue = static_cast<token_t>(4 + int(uniform() * 20));
        b.tokens(t) = residue;
        if (uniform() < mask_rate) {
          b.labels(t) = residue;
          const double u = uniform();
          b.tokens(t) = u < 0.8
                            ? data::vocab::mask
                            : (u < 0.9 ? static_cast<token_t>(4 + int(uniform() * 20)) : residue);
          ++b.num_masked;
        }
      }
      b.max_seqlen = std::max(b.max_seqlen, len);
    }
  }
  b.cu_seqlens(lengths.size()) = static_cast<seqlen_t>(t);
  return b;
}

}  // namespace plm::model::test
