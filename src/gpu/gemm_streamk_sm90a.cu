// CUTLASS's SM90 GEMM with the stream-K tile scheduler for the weight gradients
// dW = alpha dY^T X + beta dW (fp32 D and C, bf16 operands, fp32 accumulation).  These GEMMs have
// a small output (a few hundred 128x128 tiles for 132 SMs) and a long K (the tokens): a
// data-parallel kernel leaves SMs idle in its last wave, stream-K hands every SM an equal share
// of the K iterations of all tiles and reduces the partial tiles through the workspace.  The
// reduction is CUTLASS's deterministic one (the partial sums of a tile are added in the order
// of their K ranges), so results repeat bit for bit.
//
// Compiled for sm_90a alone (wgmma), only where the CUTLASS headers were found (gpu.cmake), as
// CUDA with nvcc directly, like moe_grouped_sm90a.cu.  One instantiation, to bound the compile.
#include "gpu/detail/streamk_gemm.hpp"

#include "core/error.hpp"

#include <cuda_runtime.h>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/thread/linear_combination.h"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/gemm/kernel/tile_scheduler.hpp"

#include <cstdint>
#include <string>
#include <type_traits>

namespace plm::gpu::detail {
namespace {

using namespace cute;

// A (M,K) stored (K,M): column-major, M contiguous.  B in CUTLASS's (N,K) view of X stored
// (K,N): N contiguous, the RowMajor tag.  D and C (M,N) row-major fp32.
struct WgradStreamK {
  using ElementAB = cutlass::bfloat16_t;
  using Acc = float;
  using LayoutA = cutlass::layout::ColumnMajor;
  using LayoutB = cutlass::layout::RowMajor;
  using LayoutD = cutlass::layout::RowMajor;
  static constexpr int kAlignAB = 8;
  static constexpr int kAlignD = 4;
  using TileShape = Shape<_128, _128, _64>;
  using ClusterShape = Shape<_1, _2, _1>;
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, Acc, Acc, float, LayoutD, kAlignD, float,
      LayoutD, kAlignD, cutlass::epilogue::TmaWarpSpecializedCooperative,
      cutlass::epilogue::fusion::LinearCombination<float, Acc>>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementAB, LayoutA, kAlignAB, ElementAB,
      LayoutB, kAlignAB, Acc, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename Epilogue::SharedStorage))>,
      cutlass::gemm::KernelTmaWarpSpecializedCooperative>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue,
                                                      cutlass::gemm::StreamKScheduler>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::StrideA;
  using StrideB = typename Kernel::StrideB;
  using StrideC = typename Kernel::StrideC;
  using StrideD = typename Kernel::StrideD;
};

/// A packed stride with its one run-time leading dimension set (the batch stride stays 0).
template <class S> S strideOf(std::int64_t ld) {
  S s{};
  if constexpr (std::is_same_v<std::decay_t<decltype(get<0>(s))>, std::int64_t>)
    get<0>(s) = ld;
  else
    get<1>(s) = ld;
  return s;
}

int smCount() {
  static const int sms = [] {
    int device = 0;
    PLM_CHECK_CUDA(cudaGetDevice(&device));
    return cutlass::KernelHardwareInfo::query_device_multiprocessor_count(device);
  }();
  return sms;
}

using K = WgradStreamK;

typename K::Gemm::Arguments argumentsOf(const StreamKProblem& p) {
  int device = 0;
  PLM_CHECK_CUDA(cudaGetDevice(&device));
  cutlass::KernelHardwareInfo hw;
  hw.device_id = device;
  hw.sm_count = smCount();
  typename K::Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {static_cast<int>(p.m), static_cast<int>(p.n), static_cast<int>(p.k), 1},
      {static_cast<const K::ElementAB*>(p.a), strideOf<K::StrideA>(p.lda),
       static_cast<const K::ElementAB*>(p.b), strideOf<K::StrideB>(p.ldb)},
      {{p.alpha, p.beta}, p.c, strideOf<K::StrideC>(p.ldc), p.d, strideOf<K::StrideD>(p.ldd)},
      hw};
  using Scheduler = typename K::Kernel::TileScheduler;
  args.scheduler.reduction_mode = Scheduler::ReductionMode::Deterministic;
  args.scheduler.decomposition_mode = Scheduler::DecompositionMode::StreamK;
  return args;
}

bool aligned(const StreamKProblem& p) {
  auto ok = [](const void* ptr) { return reinterpret_cast<std::uintptr_t>(ptr) % 16 == 0; };
  return p.m > 0 && p.n > 0 && p.k > 0 && p.m % 8 == 0 && p.n % 8 == 0 && p.lda % 8 == 0 &&
         p.ldb % 8 == 0 && p.ldc % 4 == 0 && p.ldd % 4 == 0 && p.m <= INT32_MAX &&
         p.n <= INT32_MAX && p.k <= INT32_MAX && ok(p.a) && ok(p.b) && ok(p.c) && ok(p.d);
}

}  // namespace

bool streamKCompiled() { return true; }

bool streamKSupports(const StreamKProblem& p) {
  if (!aligned(p)) return false;
  return K::Gemm::can_implement(argumentsOf(p)) == cutlass::Status::kSuccess;
}

std::size_t streamKWorkspaceBytes(const StreamKProblem& p) {
  if (!aligned(p)) return 0;
  return K::Gemm::get_workspace_size(argumentsOf(p));
}

void streamKRun(Stream stream, const StreamKProblem& p, void* workspace,
                std::size_t workspace_bytes) {
  const auto args = argumentsOf(p);
  const std::size_t need = K::Gemm::get_workspace_size(args);
  if (!aligned(p) || workspace_bytes < need)
    throw Error("plm::gpu::streamKRun: M=" + std::to_string(p.m) + " N=" + std::to_string(p.n) +
                " K=" + std::to_string(p.k) + " unaligned or workspace of " +
                std::to_string(workspace_bytes) + " bytes for " + std::to_string(need) +
                " (a bug in the caller: ask streamKSupports and streamKWorkspaceBytes)");
  typename K::Gemm gemm;
  cutlass::Status s = gemm.can_implement(args);
  if (s == cutlass::Status::kSuccess) s = gemm.initialize(args, workspace, stream);
  if (s == cutlass::Status::kSuccess) s = gemm.run(stream);
  if (s != cutlass::Status::kSuccess)
    throw Error(std::string("plm::gpu::streamKRun: CUTLASS failed: ") + cutlassGetStatusString(s));
  PLM_CHECK_CUDA(cudaGetLastError());
}

}  // namespace plm::gpu::detail
