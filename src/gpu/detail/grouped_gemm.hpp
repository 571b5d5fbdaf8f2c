// The interface between the plm-facing grouped expert GEMMs (gpu/moe_grouped.cu) and the one
// translation unit that instantiates CUTLASS's SM90 grouped GEMM (gpu/moe_grouped_sm90a.cu,
// compiled for sm_90a alone and only where the CUTLASS headers were found).  No CUTLASS type
// crosses it.
#pragma once

#include "gpu/device.hpp"

#include <cstddef>
#include <cstdint>

namespace plm::gpu::detail {

/// The three operand layouts of an expert FFN's GEMMs (row-major storage throughout):
///   Forward: D (m,n) bf16 = A (m,k) B^T, B stored (n,k)         (x W1^T, act W2^T)
///   Dgrad:   D (m,n) bf16 = A (m,k) B,   B stored (k,n)         (dy W2, dpre W1)
///   Wgrad:   D (m,n) fp32 = A^T B + beta D, A stored (k,m), B stored (k,n)  (dy^T act, dpre^T x)
enum class GroupedLayout { Forward, Dgrad, Wgrad };
constexpr int kGroupedLayouts = 3;

/// The CTA tile: Small = 128x128x64 in 1x2 clusters, Large = 256x128x64 in 2x1 clusters.
enum class GroupedTile { Small, Large };

/// One group (one expert): sizes, device pointers and row strides (elements) as stored.
struct GroupedProblem {
  int m = 0, n = 0, k = 0;
  const void* a = nullptr;
  std::int64_t lda = 0;
  const void* b = nullptr;
  std::int64_t ldb = 0;
  void* d = nullptr;
  std::int64_t ldd = 0;
};

/// Most groups of one launch (the device routing's expert limit).
constexpr int kMaxGroups = 256;

/// The groups of one activation-GEMM launch (Forward or Dgrad layout) with their row counts
/// on the device, as a dropless routing leaves them, so the host never waits for them: group g
/// computes rows[g] rows (device value; 0 computes nothing) from A = a + first[g] lda and
/// B = b[g] into D = d + first[g] ldd.
struct DeviceRowGroups {
  int groups = 0, n = 0, k = 0;
  const std::int64_t* rows = nullptr;   // (groups) device
  const std::int64_t* first = nullptr;  // (groups) device
  const void* a = nullptr;
  std::int64_t lda = 0;
  const void* b[kMaxGroups] = {};
  std::int64_t ldb = 0;
  void* d = nullptr;
  std::int64_t ldd = 0;
};

/// \brief True when this build holds the CUTLASS kernels (PLM_HAVE_CUTLASS).
bool groupedCompiled();

/// \brief Device workspace bytes groupedRun needs for `groups` groups of `layout` (argument
/// arrays and CUTLASS's own workspace), either tile.
std::size_t groupedWorkspaceBytes(GroupedLayout layout, int groups);

/// \brief Enqueues all groups in one kernel launch on `stream`: the argument arrays are written
/// on the device by a setup kernel whose parameter holds the problems (no host copy, no sync).
/// Groups must have m, n, k > 0; pointers 16-byte aligned; n, k and the leading dimensions
/// multiples of 8.  `beta` applies to Wgrad only (1 accumulates into D).
void groupedRun(Stream stream, GroupedLayout layout, GroupedTile tile,
                const GroupedProblem* problems, int groups, float beta, void* workspace,
                std::size_t workspace_bytes);

/// \brief As groupedRun for the groups of `g` (Forward or Dgrad layout): the setup kernel reads
/// the row counts on the device and CUTLASS sees no host shapes (its persistent grid is one CTA
/// per SM), so nothing waits for the counts.
void groupedRunDeviceRows(Stream stream, GroupedLayout layout, GroupedTile tile,
                          const DeviceRowGroups& g, void* workspace, std::size_t workspace_bytes);
}  // namespace plm::gpu::detail
