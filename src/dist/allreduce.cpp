#include "dist/allreduce.hpp"

#include "core/error.hpp"
#include "dist/runtime.hpp"

#include <algorithm>

namespace plm::dist {

template <class T> void allreduceSum(const ExecSpace& space, View1<T> data, MPI_Comm comm,
                                     std::int64_t chunk_elements) {
  space.fence();
  int size = 1;
  PLM_CHECK_MPI(MPI_Comm_size(comm, &size));
  if (size == 1) return;
  PLM_REQUIRE(chunk_elements > 0, "allreduceSum: chunk_elements must be positive");
  const std::int64_t n = static_cast<std::int64_t>(data.extent(0));
  for (std::int64_t start = 0; start < n; start += chunk_elements) {
    const int count = static_cast<int>(std::min(chunk_elements, n - start));
    PLM_CHECK_MPI(
        MPI_Allreduce(MPI_IN_PLACE, data.data() + start, count, mpiType<T>(), MPI_SUM, comm));
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

template void allreduceSum<float>(const ExecSpace&, View1<float>, MPI_Comm, std::int64_t);
template void allreduceSum<double>(const ExecSpace&, View1<double>, MPI_Comm, std::int64_t);

}  // namespace plm::dist
