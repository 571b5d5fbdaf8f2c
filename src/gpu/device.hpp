// The CUDA-specialised hot paths of plm, seen from the rest of the code.
//
// Design: every kernel here is plain CUDA over raw device pointers and a stream, declared with
// no CUDA header, so these declarations compile everywhere and the .cu files compile with nvcc
// alone (CI checks them without a CUDA Kokkos, PLM_CHECK_CUDA_SOURCES).  The model's dispatch
// points call them only when PLM_HAVE_CUDA and the execution space is Cuda, passing the
// instance's stream (`exec.cuda_stream()`).  Each kernel has a plain reference to compare
// with in test/gpu/; the ring-attention kernels are compared with the portable path in
// test/context/test_ring_bf16.cpp.  Tensors are row-major (C order), like the model's
// LayoutRight Views.
#pragma once

#include <cstdint>

struct CUstream_st;  // cudaStream_t is CUstream_st*

namespace plm::gpu {

using Stream = CUstream_st*;

/// bf16 as raw bits (the bit pattern of __nv_bfloat16), so host code needs no CUDA header.
struct bf16 {
  std::uint16_t bits;
};

/// \brief True when this build carries the CUDA kernels (PLM_HAVE_CUDA).
bool available();

/// \brief Streaming multiprocessors of the current device (cudaDevAttrMultiProcessorCount),
/// queried once per device and cached: what grid-stride kernels size their grids from.  CUDA
/// builds only (src/gpu/device.cu).
int multiprocessorCount();

}  // namespace plm::gpu
