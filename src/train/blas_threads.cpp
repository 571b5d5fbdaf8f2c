#include "train/blas_threads.hpp"

#include <dlfcn.h>

#include <algorithm>
#include <cstdlib>
#include <thread>

namespace plm::train {

int limitBlasThreadsPerRank(int ranks_on_node) {
  if (std::getenv("OPENBLAS_NUM_THREADS") || std::getenv("OMP_NUM_THREADS")) return 0;
  using SetThreads = void (*)(int);
  auto set = reinterpret_cast<SetThreads>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"));
  if (!set) return 0;
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const int threads = std::max(1, cores / std::max(1, ranks_on_node));
  set(threads);
  return threads;
}

}  // namespace plm::train
