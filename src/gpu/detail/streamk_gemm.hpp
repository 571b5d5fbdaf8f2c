// The interface between gpu::Gemm (gemm.cu) and the one translation unit that instantiates
// CUTLASS's SM90 stream-K GEMM for the weight gradients (gpu/gemm_streamk_sm90a.cu, compiled
// for sm_90a alone and only where the CUTLASS headers were found).  No CUTLASS type crosses it.
#pragma once

#include "gpu/device.hpp"

#include <cstddef>
#include <cstdint>

namespace plm::gpu::detail {

/// One weight-gradient GEMM, row-major storage throughout:
///   D (m,n) fp32 = alpha A^T B + beta C,  A stored (k,m) bf16, B stored (k,n) bf16,
///   C fp32 (c == d accumulates in place).
struct StreamKProblem {
  std::int64_t m = 0, n = 0, k = 0;
  const void* a = nullptr;
  std::int64_t lda = 0;
  const void* b = nullptr;
  std::int64_t ldb = 0;
  const float* c = nullptr;
  std::int64_t ldc = 0;
  float* d = nullptr;
  std::int64_t ldd = 0;
  float alpha = 1.0f, beta = 0.0f;
};

/// \brief True when this build holds the CUTLASS stream-K kernel (PLM_HAVE_CUTLASS).
bool streamKCompiled();

/// \brief Whether the kernel takes `p` (alignment: m, n and the leading dimensions multiples
/// of 8 for bf16 and 4 for fp32, k > 0) and the device workspace bytes it needs (0 when not).
std::size_t streamKWorkspaceBytes(const StreamKProblem& p);
bool streamKSupports(const StreamKProblem& p);

/// \brief Enqueues D = alpha A^T B + beta C on `stream`: CUTLASS's warp-specialised persistent
/// cooperative kernel (TMA, wgmma, 128x128x64 tiles, 1x2 clusters) over the stream-K tile
/// scheduler, partial tiles reduced in the deterministic (turnstile) order.  `workspace` holds
/// streamKWorkspaceBytes(p) bytes; CUTLASS clears what it needs of it before the kernel.
void streamKRun(Stream stream, const StreamKProblem& p, void* workspace,
                std::size_t workspace_bytes);

}  // namespace plm::gpu::detail
