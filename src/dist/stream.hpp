// The bridge from a Kokkos execution-space instance to dist::Stream (kept out of
// communicator.hpp so that header, and the NCCL backend, need no Kokkos).
#pragma once

#include "core/types.hpp"
#include "dist/communicator.hpp"

#include <type_traits>

namespace plm::dist {

/// \brief The stream `space` launches on: its cudaStream_t on CUDA, null on host spaces.
inline Stream streamOf([[maybe_unused]] const ExecSpace& space) {
#if defined(KOKKOS_ENABLE_CUDA)
  if constexpr (std::is_same_v<ExecSpace, Kokkos::Cuda>) return Stream{space.cuda_stream()};
#endif
  return Stream{};
}

}  // namespace plm::dist
