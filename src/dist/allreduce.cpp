#include "dist/allreduce.hpp"

#include "core/error.hpp"
#include "dist/runtime.hpp"

#include <algorithm>
#include <utility>

namespace plm::dist {

template <class T> void allreduceSum(const ExecSpace& space, View1<T> data, MPI_Comm comm,
                                     std::int64_t chunk_elements) {
  space.fence();
  int size = 1;
  PLM_CHECK_MPI(MPI_Comm_size(comm, &size));
  if (size == 1) return;
  PLM_REQUIRE(chunk_elements > 0, "allreduceSum: chunk_elements must be positive");
  const std::int64_t n = static_cast<std::int64_t>(data.extent(0));
  // MPI may not read device memory (an MPI built without CUDA support faults on it), so device
  // buffers go through one host chunk; host-accessible memory is reduced where it lies.
  constexpr bool host_accessible =
      Kokkos::SpaceAccessibility<Kokkos::HostSpace, typename View1<T>::memory_space>::accessible;
  HostView1<T> staging;
  if (!host_accessible)
    staging = HostView1<T>(Kokkos::view_alloc(Kokkos::WithoutInitializing, "plm::dist::staging"),
                           std::min(chunk_elements, n));
  for (std::int64_t start = 0; start < n; start += chunk_elements) {
    const int count = static_cast<int>(std::min(chunk_elements, n - start));
    if (host_accessible) {
      PLM_CHECK_MPI(
          MPI_Allreduce(MPI_IN_PLACE, data.data() + start, count, mpiType<T>(), MPI_SUM, comm));
      continue;
    }
    const auto range = std::make_pair(start, start + count);
    auto chunk = Kokkos::subview(data, range);
    auto host = Kokkos::subview(staging, std::make_pair(std::int64_t(0), std::int64_t(count)));
    Kokkos::deep_copy(host, chunk);
    PLM_CHECK_MPI(MPI_Allreduce(MPI_IN_PLACE, host.data(), count, mpiType<T>(), MPI_SUM, comm));
    Kokkos::deep_copy(chunk, host);
  }
}

void allreduceSum(std::vector<double>& values, MPI_Comm comm) {
  if (values.empty()) return;
  PLM_CHECK_MPI(MPI_Allreduce(MPI_IN_PLACE, values.data(), static_cast<int>(values.size()),
                              MPI_DOUBLE, MPI_SUM, comm));
}

void allreduceSum(std::vector<std::int64_t>& values, MPI_Comm comm) {
  if (values.empty()) return;
  PLM_CHECK_MPI(MPI_Allreduce(MPI_IN_PLACE, values.data(), static_cast<int>(values.size()),
                              MPI_INT64_T, MPI_SUM, comm));
}

double allreduceSum(double value, MPI_Comm comm) {
  PLM_CHECK_MPI(MPI_Allreduce(MPI_IN_PLACE, &value, 1, MPI_DOUBLE, MPI_SUM, comm));
  return value;
}

std::int64_t allreduceSum(std::int64_t value, MPI_Comm comm) {
  PLM_CHECK_MPI(MPI_Allreduce(MPI_IN_PLACE, &value, 1, MPI_INT64_T, MPI_SUM, comm));
  return value;
}

double allreduceMax(double value, MPI_Comm comm) {
  PLM_CHECK_MPI(MPI_Allreduce(MPI_IN_PLACE, &value, 1, MPI_DOUBLE, MPI_MAX, comm));
  return value;
}

void allreduceMax(std::vector<float>& values, MPI_Comm comm) {
  if (values.empty()) return;
  PLM_CHECK_MPI(MPI_Allreduce(MPI_IN_PLACE, values.data(), static_cast<int>(values.size()),
                              MPI_FLOAT, MPI_MAX, comm));
}

template void allreduceSum<float>(const ExecSpace&, View1<float>, MPI_Comm, std::int64_t);
template void allreduceSum<double>(const ExecSpace&, View1<double>, MPI_Comm, std::int64_t);

}  // namespace plm::dist
