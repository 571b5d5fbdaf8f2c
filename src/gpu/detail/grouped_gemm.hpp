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

/// The CTA tile and kernel schedule (PLM_MOE_GROUPED_TILE names in brackets):
///   Small = 128x128x64 cooperative in 1x2 clusters ("128"),
///   Large = 256x128x64 cooperative in 2x1 clusters ("256"),
///   Wide  = 128x256x64 cooperative in 2x1 clusters ("128x256"; Dgrad and Wgrad only),
///   Ping  = 128x128x64 pingpong in 1x2 clusters ("pp128"; Dgrad and Wgrad only).
enum class GroupedTile { Small, Large, Wide, Ping };
constexpr int kGroupedTiles = 4;

/// \brief The PLM_MOE_GROUPED_TILE name of `tile` ("128", "256", "128x256", "pp128").
inline const char* groupedTileName(GroupedTile tile) {
  constexpr const char* names[kGroupedTiles] = {"128", "256", "128x256", "pp128"};
  return names[static_cast<int>(tile)];
}

/// \brief True when `tile` is built for `layout` (Wide and Ping: the backward layouts only).
inline bool groupedTileBuilt(GroupedLayout layout, GroupedTile tile) {
  return layout != GroupedLayout::Forward || tile == GroupedTile::Small ||
         tile == GroupedTile::Large;
}

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

/// \brief True when this build holds the CUTLASS kernels (PLM_HAVE_CUTLASS).
bool groupedCompiled();

/// \brief Device workspace bytes groupedRun needs for `groups` groups of `layout` (argument
/// arrays and CUTLASS's own workspace), any tile.
std::size_t groupedWorkspaceBytes(GroupedLayout layout, int groups);

/// \brief Enqueues all groups in one kernel launch on `stream`: the argument arrays are written
/// on the device by a setup kernel whose parameter holds the problems (no host copy, no sync).
/// Groups must have m, n, k > 0; pointers 16-byte aligned; n, k and the leading dimensions
/// multiples of 8.  `beta` applies to Wgrad only (1 accumulates into D).
void groupedRun(Stream stream, GroupedLayout layout, GroupedTile tile,
                const GroupedProblem* problems, int groups, float beta, void* workspace,
                std::size_t workspace_bytes);

}  // namespace plm::gpu::detail
