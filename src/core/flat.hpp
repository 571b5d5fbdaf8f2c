// Loops over buffer elements that may number more than 2^32.
//
// FlatPolicy (core/types.hpp) gives a range 64-bit bounds, but Kokkos 3.4's CUDA range kernels
// still form their first index (blockDim.y * blockIdx.x) and their stride (blockDim.y *
// gridDim.x) in 32-bit unsigned arithmetic.  Past 2^32 elements in one launch both wrap: the
// stride becomes the range's length modulo 2^32 and the kernel crawls for minutes or never ends
// (issue 28: a 15B model's buffers hold 1.5e10 elements; a shard of 2 holds 7.5e9).
// Kokkos::deep_copy(view, value) fills with the same kernel.  These helpers launch a range in
// pieces of at most kFlatChunk elements, each an ordinary FlatPolicy launch on the same
// execution space instance (so they stay in order without a fence); one piece when the range
// is short, which is the case for everything but whole-model buffers.
#pragma once

#include "core/types.hpp"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

namespace plm {

/// Largest number of elements one flat launch covers (2^31: index arithmetic inside the
/// launch stays far from the 32-bit wrap).
inline constexpr std::int64_t kFlatChunk = std::int64_t(1) << 31;

/// \brief Kokkos::parallel_for over elements [lo, hi) with a `std::int64_t` index, launched in
/// pieces of at most `chunk` (kFlatChunk; smaller only in tests) elements on `space`.
template <class Functor> void flatFor(const char* label, const ExecSpace& space, std::int64_t lo,
                                      std::int64_t hi, const Functor& f,
                                      std::int64_t chunk = kFlatChunk) {
  do {
    const std::int64_t end = std::min(hi, lo + chunk);
    Kokkos::parallel_for(label, FlatPolicy(space, lo, end), f);
    lo = end;
  } while (lo < hi);
}

/// \brief Kokkos::parallel_reduce over [lo, hi) into a sum `result` (a host scalar), in pieces
/// of at most kFlatChunk elements.  The result is complete on return, as with
/// Kokkos::parallel_reduce into a host scalar (each piece waits for its value).
template <class Functor, class Value>
std::enable_if_t<std::is_arithmetic_v<Value>> flatReduce(const char* label, const ExecSpace& space,
                                                         std::int64_t lo, std::int64_t hi,
                                                         const Functor& f, Value& result,
                                                         std::int64_t chunk = kFlatChunk) {
  result = Value(0);
  do {
    const std::int64_t end = std::min(hi, lo + chunk);
    Value piece = Value(0);
    Kokkos::parallel_reduce(label, FlatPolicy(space, lo, end), f, piece);
    result += piece;
    lo = end;
  } while (lo < hi);
}

/// \brief Kokkos::parallel_reduce over [lo, hi) with a Kokkos reducer on a host scalar
/// (Kokkos::Max, Min, ...), in pieces of at most kFlatChunk elements; the pieces' values are
/// joined with the reducer's own join.
template <class Functor, class Reducer>
std::enable_if_t<Kokkos::is_reducer_type<Reducer>::value> flatReduce(
    const char* label, const ExecSpace& space, std::int64_t lo, std::int64_t hi, const Functor& f,
    const Reducer& reducer, std::int64_t chunk = kFlatChunk) {
  using Value = typename Reducer::value_type;
  Value total;
  reducer.init(total);
  do {
    const std::int64_t end = std::min(hi, lo + chunk);
    Value piece;
    Kokkos::parallel_reduce(label, FlatPolicy(space, lo, end), f, Reducer(piece));
    reducer.join(total, piece);
    lo = end;
  } while (lo < hi);
  reducer.reference() = total;
}

namespace detail {
/// The fill's kernel body.  A named functor, not a lambda: an nvcc extended lambda inside this
/// header template is instantiated in every translation unit that fills, and a CUDA build linked
/// from several of them jumped to a null kernel address at the first fill past kFlatChunk.
template <class V> struct FlatFillFunctor {
  V* data;
  V value;
  KOKKOS_INLINE_FUNCTION void operator()(const std::int64_t i) const { data[i] = value; }
};
}  // namespace detail

/// \brief Sets every element of a contiguous 1-D view to `value` on `space` (what
/// Kokkos::deep_copy(space, view, value) does, in pieces of at most kFlatChunk elements).
template <class T, class... Props>
void flatFill(const ExecSpace& space, const Kokkos::View<T*, Props...>& view,
              const typename Kokkos::View<T*, Props...>::const_value_type& value,
              std::int64_t chunk = kFlatChunk) {
  const std::int64_t n = static_cast<std::int64_t>(view.extent(0));
#if defined(KOKKOS_ENABLE_CUDA)
  // Zero bits on the GPU: one memset on the space's stream, at the copy engines' rate (Kokkos
  // 3.4's fill kernel wrote the gradient buffer at 0.42 TB/s on an H200).
  if constexpr (std::is_same_v<ExecSpace, Kokkos::Cuda>) {
    using V = std::remove_const_t<T>;
    const V v(value), zero{};
    if (n > 0 && std::memcmp(&v, &zero, sizeof(V)) == 0) {
      if (cudaMemsetAsync(const_cast<V*>(view.data()), 0, static_cast<std::size_t>(n) * sizeof(V),
                          space.cuda_stream()) != cudaSuccess)
        Kokkos::abort("plm::flatFill: cudaMemsetAsync failed");
      return;
    }
  }
#endif
  if (n <= chunk) {
    Kokkos::deep_copy(space, view, value);
    return;
  }
  static_assert(
      Kokkos::SpaceAccessibility<ExecSpace,
                                 typename Kokkos::View<T*, Props...>::memory_space>::accessible,
      "flatFill: the view must live where ExecSpace runs");
  using V = std::remove_const_t<T>;
  flatFor("plm::flatFill", space, 0, n, detail::FlatFillFunctor<V>{view.data(), V(value)}, chunk);
}

/// \brief A zero-filled device view of n elements (what View1<T>(label, n) allocates: Kokkos
/// 3.4 zero-fills a new view with the same 32-bit range kernel, so a whole-model buffer of more
/// than 2^32 elements would never finish initialising).  Complete on return.
template <class T> View1<T> flatZeros(const std::string& label, std::int64_t n) {
  View1<T> view(Kokkos::view_alloc(Kokkos::WithoutInitializing, label), n);
  flatFill(ExecSpace(), view, T(0));
  ExecSpace().fence();
  return view;
}

}  // namespace plm
