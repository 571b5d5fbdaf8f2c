// Host vectors <-> device views for the optimizer tests.
#pragma once

#include "core/types.hpp"

#include <vector>

namespace plm::test {

template <class T> View1<T> toView(const std::vector<T>& v) {
  View1<T> d("test", v.size());
  auto h = Kokkos::create_mirror_view(d);
  for (std::size_t i = 0; i < v.size(); ++i) h(i) = v[i];
  Kokkos::deep_copy(d, h);
  return d;
}

template <class T> std::vector<T> fromView(View1<T> d) {
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), d);
  return std::vector<T>(h.data(), h.data() + h.extent(0));
}

}  // namespace plm::test
