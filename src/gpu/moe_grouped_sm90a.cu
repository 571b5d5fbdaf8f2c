// CUTLASS's SM90 grouped GEMM (TMA + wgmma, warp-specialised cooperative kernel over a
// persistent grouped tile scheduler) for the experts' GEMMs of a MoE layer: all experts of one
// GEMM in one launch.  bf16 operands, fp32 accumulation; bf16 output (Forward, Dgrad) or fp32
// output accumulated in place (Wgrad).  The per-group argument arrays (problem shapes, pointers,
// strides) are written on the device by a small setup kernel that takes the problems as its
// parameter, so a launch needs no host-to-device copy and no synchronisation.
//
// Compiled for sm_90a alone (wgmma and the TMA descriptor updates the ptr-array kernels need
// are sm_90a instructions), only where the CUTLASS headers were found (gpu.cmake), as CUDA
// with nvcc directly: Kokkos' nvcc_wrapper fixes one -arch for every file.
#include "gpu/detail/grouped_gemm.hpp"

#include "core/error.hpp"

#include <cuda_runtime.h>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/thread/linear_combination.h"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"

#include <algorithm>
#include <string>
#include <type_traits>
#include <vector>

namespace plm::gpu::detail {
namespace {

using namespace cute;
using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;  // (M,N,K) per group
using Shape3 = ProblemShape::UnderlyingProblemShape;

/// One grouped GEMM: A and B layouts in CUTLASS's terms (B is (K,N): ColumnMajor = stored
/// (N,K) row-major), D row-major of ElementD, C = D when it has a type (Wgrad's beta).
/// Cooperative kernel; two tile configurations (the two usual bf16 choices on the H100):
/// 128x128x64 in 1x2 clusters (Small) and 256x128x64 in 2x1 clusters (Large, fewer tiles for
/// large experts, more waste on ragged row blocks).
template <class LayoutA, class LayoutB, class ElementD, class ElementC, class TileShape_,
          class ClusterShape_>
struct GroupedKernel {
  using ElementAB = cutlass::bfloat16_t;
  using Acc = float;
  using LayoutD = cutlass::layout::RowMajor;
  static constexpr int kAlignAB = 8;
  static constexpr int kAlignD = 16 / sizeof(ElementD);
  static constexpr int kAlignC = std::is_void_v<ElementC> ? kAlignD : 16 / int(sizeof(float));
  using TileShape = TileShape_;
  using ClusterShape = ClusterShape_;
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, Acc, Acc, ElementC, LayoutD*, kAlignC,
      ElementD, LayoutD*, kAlignD, cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative,
      cutlass::epilogue::fusion::LinearCombination<ElementD, Acc>>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementAB, LayoutA*, kAlignAB, ElementAB,
      LayoutB*, kAlignAB, Acc, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename Epilogue::SharedStorage))>,
      cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideC = typename Kernel::InternalStrideC;
  using StrideD = typename Kernel::InternalStrideD;
  using CPtr = std::conditional_t<std::is_void_v<ElementC>, const void*, const ElementC*>;
};

struct Small {
  using Tile = Shape<_128, _128, _64>;
  using Cluster = Shape<_1, _2, _1>;
};
struct Large {
  using Tile = Shape<_256, _128, _64>;
  using Cluster = Shape<_2, _1, _1>;
};

template <class C> using ForwardKernel =
    GroupedKernel<cutlass::layout::RowMajor, cutlass::layout::ColumnMajor, cutlass::bfloat16_t,
                  void, typename C::Tile, typename C::Cluster>;
template <class C> using DgradKernel =
    GroupedKernel<cutlass::layout::RowMajor, cutlass::layout::RowMajor, cutlass::bfloat16_t, void,
                  typename C::Tile, typename C::Cluster>;
template <class C> using WgradKernel =
    GroupedKernel<cutlass::layout::ColumnMajor, cutlass::layout::RowMajor, float, float,
                  typename C::Tile, typename C::Cluster>;

/// A packed stride with its one run-time entry (the leading dimension) set.
template <class S> __host__ __device__ S strideOf(std::int64_t ld) {
  S s{};
  if constexpr (std::is_same_v<std::decay_t<decltype(get<0>(s))>, std::int64_t>)
    get<0>(s) = ld;
  else
    get<1>(s) = ld;
  return s;
}

struct SetupArgs {
  int groups = 0;
  GroupedProblem p[kMaxGroups];
};

/// The device argument arrays of one launch, carved from the workspace.
template <class K> struct DeviceArrays {
  Shape3* shapes;
  const typename K::ElementAB** a;
  const typename K::ElementAB** b;
  typename K::CPtr* c;
  typename K::Gemm::EpilogueOutputOp::ElementOutput** d;
  typename K::StrideA* sa;
  typename K::StrideB* sb;
  typename K::StrideC* sc;
  typename K::StrideD* sd;
  void* cutlass_workspace;
};

template <class X> X* carve(char*& at, int n) {
  X* p = reinterpret_cast<X*>(at);
  at += (std::size_t(n) * sizeof(X) + 255) / 256 * 256;
  return p;
}

template <class K> DeviceArrays<K> arraysOf(void* workspace, int groups) {
  char* at = static_cast<char*>(workspace);
  DeviceArrays<K> d;
  d.shapes = carve<Shape3>(at, groups);
  d.a = carve<const typename K::ElementAB*>(at, groups);
  d.b = carve<const typename K::ElementAB*>(at, groups);
  d.c = carve<typename K::CPtr>(at, groups);
  d.d = carve<typename K::Gemm::EpilogueOutputOp::ElementOutput*>(at, groups);
  d.sa = carve<typename K::StrideA>(at, groups);
  d.sb = carve<typename K::StrideB>(at, groups);
  d.sc = carve<typename K::StrideC>(at, groups);
  d.sd = carve<typename K::StrideD>(at, groups);
  d.cutlass_workspace = at;
  return d;
}

template <class K> __global__ void setupKernel(SetupArgs args, DeviceArrays<K> d) {
  const int g = blockIdx.x * blockDim.x + threadIdx.x;
  if (g >= args.groups) return;
  const GroupedProblem& p = args.p[g];
  d.shapes[g] = Shape3{p.m, p.n, p.k};
  d.a[g] = static_cast<const typename K::ElementAB*>(p.a);
  d.b[g] = static_cast<const typename K::ElementAB*>(p.b);
  using D = typename K::Gemm::EpilogueOutputOp::ElementOutput;
  d.d[g] = static_cast<D*>(p.d);
  d.c[g] = static_cast<typename K::CPtr>(p.d);  // C = D (read only when beta != 0)
  d.sa[g] = strideOf<typename K::StrideA>(p.lda);
  d.sb[g] = strideOf<typename K::StrideB>(p.ldb);
  d.sc[g] = strideOf<typename K::StrideC>(p.ldd);
  d.sd[g] = strideOf<typename K::StrideD>(p.ldd);
}

/// The argument arrays of a DeviceRowGroups launch: the row counts and first rows read here.
template <class K> __global__ void setupRowsKernel(DeviceRowGroups g, DeviceArrays<K> d) {
  const int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= g.groups) return;
  using AB = typename K::ElementAB;
  using D = typename K::Gemm::EpilogueOutputOp::ElementOutput;
  const std::int64_t at = g.first[e];
  d.shapes[e] = Shape3{static_cast<int>(g.rows[e]), g.n, g.k};
  d.a[e] = static_cast<const AB*>(g.a) + at * g.lda;
  d.b[e] = static_cast<const AB*>(g.b[e]);
  d.d[e] = static_cast<D*>(g.d) + at * g.ldd;
  d.c[e] = static_cast<typename K::CPtr>(static_cast<D*>(g.d) + at * g.ldd);
  d.sa[e] = strideOf<typename K::StrideA>(g.lda);
  d.sb[e] = strideOf<typename K::StrideB>(g.ldb);
  d.sc[e] = strideOf<typename K::StrideC>(g.ldd);
  d.sd[e] = strideOf<typename K::StrideD>(g.ldd);
}

int smCount() {
  static const int count = [] {
    int device = 0;
    PLM_CHECK_CUDA(cudaGetDevice(&device));
    return cutlass::KernelHardwareInfo::query_device_multiprocessor_count(device);
  }();
  return count;
}

template <class K> typename K::Gemm::Arguments argumentsOf(const DeviceArrays<K>& d, int groups,
                                                           const Shape3* host_shapes, float beta) {
  cutlass::KernelHardwareInfo hw;
  PLM_CHECK_CUDA(cudaGetDevice(&hw.device_id));
  hw.sm_count = smCount();
  typename K::Gemm::Arguments args;
  decltype(args.epilogue.thread) fusion{};
  fusion.alpha = 1.0f;
  fusion.beta = beta;
  fusion.alpha_ptr = nullptr;
  fusion.beta_ptr = nullptr;
  fusion.alpha_ptr_array = nullptr;
  fusion.beta_ptr_array = nullptr;
  fusion.dAlpha = {_0{}, _0{}, 0};
  fusion.dBeta = {_0{}, _0{}, 0};
  const typename K::Gemm::ElementC** c_ptr = nullptr;
  if constexpr (!std::is_void_v<typename K::Gemm::ElementC>) c_ptr = d.c;
  args = typename K::Gemm::Arguments{cutlass::gemm::GemmUniversalMode::kGrouped,
                                     {groups, d.shapes, host_shapes},
                                     {d.a, d.sa, d.b, d.sb},
                                     {fusion, c_ptr, d.sc, d.d, d.sd},
                                     hw};
  return args;
}

template <class K> std::size_t workspaceBytes(int groups) {
  DeviceArrays<K> d = arraysOf<K>(nullptr, groups);
  const auto args = argumentsOf<K>(d, groups, nullptr, 0.0f);
  return reinterpret_cast<std::size_t>(d.cutlass_workspace) + K::Gemm::get_workspace_size(args) +
         256;
}

const char* statusName(cutlass::Status s) { return cutlassGetStatusString(s); }

void checkWorkspaceOf(std::size_t have, std::size_t need, const char* what) {
  if (have < need)
    throw Error(std::string("plm::gpu::groupedRun(") + what + "): workspace of " +
                std::to_string(have) + " bytes, " + std::to_string(need) +
                " needed (a bug in the caller)");
}

/// CUTLASS's half of a launch whose argument arrays `d` are queued: host_shapes (or nullptr:
/// shapes on the device only) lets CUTLASS check the problems and size its grid.
template <class K> void launch(Stream stream, const DeviceArrays<K>& d, int groups,
                               const Shape3* host_shapes, float beta, const char* what) {
  const auto args = argumentsOf<K>(d, groups, host_shapes, beta);
  typename K::Gemm gemm;
  cutlass::Status s = gemm.can_implement(args);
  if (s != cutlass::Status::kSuccess)
    throw Error(std::string("plm::gpu::groupedRun(") + what + "): CUTLASS cannot run these " +
                std::to_string(groups) + " problems (" + statusName(s) +
                "; n, k and leading dimensions must be multiples of 8)");
  s = gemm.initialize(args, d.cutlass_workspace, stream);
  if (s == cutlass::Status::kSuccess) s = gemm.run(stream);
  if (s != cutlass::Status::kSuccess)
    throw Error(std::string("plm::gpu::groupedRun(") + what +
                "): CUTLASS failed: " + statusName(s));
  PLM_CHECK_CUDA(cudaGetLastError());
}

template <class K> void runKernel(Stream stream, const GroupedProblem* problems, int groups,
                                  float beta, void* workspace, std::size_t bytes,
                                  const char* what) {
  checkWorkspaceOf(bytes, workspaceBytes<K>(groups), what);
  SetupArgs setup;
  setup.groups = groups;
  std::vector<Shape3> host(groups);
  for (int g = 0; g < groups; ++g) {
    setup.p[g] = problems[g];
    host[g] = Shape3{problems[g].m, problems[g].n, problems[g].k};
  }
  DeviceArrays<K> d = arraysOf<K>(workspace, groups);
  setupKernel<K><<<(groups + 127) / 128, 128, 0, stream>>>(setup, d);
  PLM_CHECK_CUDA(cudaGetLastError());
  launch<K>(stream, d, groups, host.data(), beta, what);
}

template <class K> void runKernelDeviceRows(Stream stream, const DeviceRowGroups& g,
                                            void* workspace, std::size_t bytes, const char* what) {
  checkWorkspaceOf(bytes, workspaceBytes<K>(g.groups), what);
  DeviceArrays<K> d = arraysOf<K>(workspace, g.groups);
  setupRowsKernel<K><<<(g.groups + 127) / 128, 128, 0, stream>>>(g, d);
  PLM_CHECK_CUDA(cudaGetLastError());
  launch<K>(stream, d, g.groups, nullptr, 0.0f, what);
}

}  // namespace

bool groupedCompiled() { return true; }

std::size_t groupedWorkspaceBytes(GroupedLayout layout, int groups) {
  switch (layout) {
    case GroupedLayout::Forward:
      return std::max(workspaceBytes<ForwardKernel<Small>>(groups),
                      workspaceBytes<ForwardKernel<Large>>(groups));
    case GroupedLayout::Dgrad:
      return std::max(workspaceBytes<DgradKernel<Small>>(groups),
                      workspaceBytes<DgradKernel<Large>>(groups));
    case GroupedLayout::Wgrad:
      return std::max(workspaceBytes<WgradKernel<Small>>(groups),
                      workspaceBytes<WgradKernel<Large>>(groups));
  }
  return 0;
}

void groupedRun(Stream stream, GroupedLayout layout, GroupedTile tile,
                const GroupedProblem* problems, int groups, float beta, void* workspace,
                std::size_t workspace_bytes) {
  if (groups == 0) return;
  if (groups < 0 || groups > kMaxGroups)
    throw Error("plm::gpu::groupedRun: " + std::to_string(groups) + " groups (at most " +
                std::to_string(kMaxGroups) + "; a bug in the caller)");
  const bool large = tile == GroupedTile::Large;
  auto run = [&](auto small_kernel, auto large_kernel, float b, const char* what) {
    using S = decltype(small_kernel);
    using L = decltype(large_kernel);
    if (large)
      runKernel<L>(stream, problems, groups, b, workspace, workspace_bytes, what);
    else
      runKernel<S>(stream, problems, groups, b, workspace, workspace_bytes, what);
  };
  switch (layout) {
    case GroupedLayout::Forward:
      return run(ForwardKernel<Small>{}, ForwardKernel<Large>{}, 0.0f, "forward");
    case GroupedLayout::Dgrad:
      return run(DgradKernel<Small>{}, DgradKernel<Large>{}, 0.0f, "dgrad");
    case GroupedLayout::Wgrad:
      return run(WgradKernel<Small>{}, WgradKernel<Large>{}, beta, "wgrad");
  }
}

void groupedRunDeviceRows(Stream stream, GroupedLayout layout, GroupedTile tile,
                          const DeviceRowGroups& g, void* workspace, std::size_t workspace_bytes) {
  if (g.groups == 0) return;
  if (g.groups < 0 || g.groups > kMaxGroups || layout == GroupedLayout::Wgrad)
    throw Error("plm::gpu::groupedRunDeviceRows: " + std::to_string(g.groups) +
                " groups of layout " + std::to_string(static_cast<int>(layout)) + " (at most " +
                std::to_string(kMaxGroups) + ", Forward or Dgrad; a bug in the caller)");
  const bool large = tile == GroupedTile::Large;
  if (layout == GroupedLayout::Forward) {
    if (large)
      runKernelDeviceRows<ForwardKernel<Large>>(stream, g, workspace, workspace_bytes, "forward");
    else
      runKernelDeviceRows<ForwardKernel<Small>>(stream, g, workspace, workspace_bytes, "forward");
  } else if (large) {
    runKernelDeviceRows<DgradKernel<Large>>(stream, g, workspace, workspace_bytes, "dgrad");
  } else {
    runKernelDeviceRows<DgradKernel<Small>>(stream, g, workspace, workspace_bytes, "dgrad");
  }
}

}  // namespace plm::gpu::detail
