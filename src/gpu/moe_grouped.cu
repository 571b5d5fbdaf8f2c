// Grouped expert GEMMs (see moe_grouped.hpp for the design): the plm-facing half.  The CUTLASS
// kernels live in moe_grouped_sm90a.cu; without CUTLASS this file supplies their "not built"
// answers so the loop stays the only path.
#include "gpu/moe_grouped.hpp"

#include "core/error.hpp"
#include "gpu/detail/grouped_gemm.hpp"
#include "gpu/fused.hpp"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <numeric>

namespace plm::gpu {

#if !PLM_HAVE_CUTLASS
namespace detail {
bool groupedCompiled() { return false; }
std::size_t groupedWorkspaceBytes(GroupedLayout, int) { return 0; }
void groupedRun(Stream, GroupedLayout, GroupedTile, const GroupedProblem*, int, float, void*,
                std::size_t) {
  throw Error(
      "plm::gpu: the grouped expert GEMM is not in this build (CUTLASS was not found when it "
      "was configured: run scripts/get-cutlass.sh and reconfigure, or set moe.expert_gemm: loop)");
}
void groupedRunDeviceRows(Stream stream, GroupedLayout, GroupedTile, const DeviceRowGroups& g,
                          void*, std::size_t) {
  groupedRun(stream, GroupedLayout::Forward, GroupedTile::Small, nullptr, g.groups, 0.0f, nullptr,
             0);
}
}  // namespace detail
#endif

namespace {

using bfloat = __nv_bfloat16;
using detail::GroupedLayout;
using detail::GroupedProblem;
using detail::kMaxGroups;

/// Per-expert row blocks and one pointer each, as a kernel parameter (at most kMaxGroups).
struct RowBlocks {
  int groups = 0;
  std::int64_t offset[kMaxGroups + 1];
  const void* ptr[kMaxGroups];
};

RowBlocks rowBlocks(const std::vector<std::int64_t>& rows, const void* const* ptrs,
                    const char* what) {
  if (rows.size() > std::size_t(kMaxGroups))
    throw Error(std::string("plm::gpu::") + what + ": " + std::to_string(rows.size()) +
                " experts (at most " + std::to_string(kMaxGroups) + "; a bug in the caller)");
  RowBlocks b;
  b.groups = static_cast<int>(rows.size());
  b.offset[0] = 0;
  for (int e = 0; e < b.groups; ++e) {
    b.offset[e + 1] = b.offset[e] + rows[e];
    b.ptr[e] = ptrs[e];
  }
  return b;
}

std::int64_t maxRows(const std::vector<std::int64_t>& rows) {
  return rows.empty() ? 0 : *std::max_element(rows.begin(), rows.end());
}

__device__ __forceinline__ float geluTanh(float x) {
  const float c = 0.7978845608028654f;  // sqrt(2/pi), as gemm.cu's reference
  return 0.5f * x * (1.0f + tanhf(c * (x + 0.044715f * x * x * x)));
}

/// pre(at..at+8) += bias(c..c+8) (bf16 rounded) and, unless act is nullptr, act = gelu_tanh(pre).
__device__ __forceinline__ void biasGelu8(bfloat* pre, bfloat* act, std::int64_t at,
                                          const bfloat* bias, int c) {
  uint4 p = *reinterpret_cast<const uint4*>(pre + at);
  auto* pv = reinterpret_cast<__nv_bfloat162*>(&p);
  uint4 a;
  auto* av = reinterpret_cast<__nv_bfloat162*>(&a);
  for (int j = 0; j < 4; ++j) {
    // The bias is read element by element: a parameter slice need not be 16-byte aligned.
    const float2 x = __bfloat1622float2(pv[j]);
    const float v0 = x.x + __bfloat162float(bias[c + 2 * j]);
    const float v1 = x.y + __bfloat162float(bias[c + 2 * j + 1]);
    pv[j] = __floats2bfloat162_rn(v0, v1);
    av[j] = __floats2bfloat162_rn(geluTanh(v0), geluTanh(v1));
  }
  *reinterpret_cast<uint4*>(pre + at) = p;
  if (act) *reinterpret_cast<uint4*>(act + at) = a;
}

/// Eight bf16 (16 bytes) per thread; blockIdx.y is the expert.
__global__ void biasGeluKernel(RowBlocks blocks, bfloat* pre, bfloat* act, int cols) {
  const int e = blockIdx.y;
  const std::int64_t first = blocks.offset[e], n = (blocks.offset[e + 1] - first) * cols / 8;
  const auto* bias = static_cast<const bfloat*>(blocks.ptr[e]);
  const int vec_cols = cols / 8;
  for (std::int64_t i = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; i < n;
       i += std::int64_t(gridDim.x) * blockDim.x)
    biasGelu8(pre, act, first * cols + i * 8, bias, static_cast<int>(i % vec_cols) * 8);
}

/// The per-expert biases of a launch whose row blocks only the device knows.
struct ExpertBiases {
  int groups = 0;
  const void* ptr[kMaxGroups];
};

/// As biasGeluKernel over all `total` rows, each row's expert found from the first rows on the
/// device (the last expert whose block starts at or before it: empty experts share their start
/// with the next expert).
__global__ void biasGeluRowsKernel(ExpertBiases biases, const std::int64_t* first,
                                   std::int64_t total, bfloat* pre, bfloat* act, int cols) {
  __shared__ std::int64_t start[kMaxGroups];
  for (int e = threadIdx.x; e < biases.groups; e += blockDim.x) start[e] = first[e];
  __syncthreads();
  const int vec_cols = cols / 8;
  const std::int64_t n = total * vec_cols;
  for (std::int64_t i = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; i < n;
       i += std::int64_t(gridDim.x) * blockDim.x) {
    const std::int64_t row = i / vec_cols;
    int lo = 0, hi = biases.groups - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (start[mid] <= row)
        lo = mid;
      else
        hi = mid - 1;
    }
    biasGelu8(pre, act, i * 8, static_cast<const bfloat*>(biases.ptr[lo]),
              static_cast<int>(i % vec_cols) * 8);
  }
}

/// d = d * gelu_tanh'(p) for 8 bf16 (fused.cu's geluTanhBackward), rounded to bf16.
__device__ __forceinline__ void geluBackward8(uint4& d, const uint4& p) {
  const float c = 0.7978845608028654f;  // sqrt(2 / pi)
  auto* dv = reinterpret_cast<__nv_bfloat162*>(&d);
  const auto* pv = reinterpret_cast<const __nv_bfloat162*>(&p);
  for (int j = 0; j < 4; ++j) {
    const float2 g = __bfloat1622float2(dv[j]), x2 = __bfloat1622float2(pv[j]);
    float out[2];
    const float xs[2] = {x2.x, x2.y}, gs[2] = {g.x, g.y};
    for (int h = 0; h < 2; ++h) {
      const float x = xs[h], t = tanhf(c * (x + 0.044715f * x * x * x));
      out[h] = gs[h] * (0.5f * (1.0f + t) +
                        0.5f * x * (1.0f - t * t) * c * (1.0f + 3.0f * 0.044715f * x * x));
    }
    dv[j] = __floats2bfloat162_rn(out[0], out[1]);
  }
}

// Bias gradients, in two launches with an order fixed by the shape alone (bitwise
// reproducible, no atomics).  1: block (column tile, expert, row slice) sums kSumCols columns of
// one slice of the expert's rows: kSumRowLanes row lanes (one warp each, 512 contiguous bytes of
// a row per load) take every kSumRowLanes-th row with kSumUnroll rows in flight per thread, added
// in row order; a fixed tree adds the lanes; the slice's sums go to a scratch row.  2: per
// expert and column, the slices' sums are added in slice order onto db.  The row slices give
// the launch enough blocks to fill the GPU: at 650M-like with 8 experts the two sums read 2.3
// TB/s on the H100 against 1.6 TB/s for one block per column tile and expert
// (validation/gpu_logs/moeperf_h100).  A launch of few column tiles and experts (a dense layer's
// bias, one "expert") takes more slices, up to kSumFillBlocks blocks in all: at ESM-2 8M's
// 320 columns 16 slices made 32 blocks, which read 0.4 TB/s.
constexpr int kSumThreads = 256;
constexpr int kSumColLanes = 32;                          // a warp: 32 x 8 bf16 of one row
constexpr int kSumCols = kSumColLanes * 8;                // 256 columns per block
constexpr int kSumRowLanes = kSumThreads / kSumColLanes;  // 8
constexpr int kSumUnroll = 4;
constexpr int kSumMinSlices = 16;            // row slices per expert allowed whatever the shape
constexpr int kSumMaxSlices = 256;           // and at most
constexpr int kSumFillBlocks = 528;          // blocks a launch aims at (4 per SM of an H100)
constexpr std::int64_t kSumSliceRows = 256;  // rows per slice, at least (but for the last)

/// The most row slices per expert a launch of `experts` experts and `cols` columns takes.
int maxSumSlices(int experts, int cols) {
  const int blocks = std::max(1, experts) * std::max(1, (cols + kSumCols - 1) / kSumCols);
  return std::clamp((kSumFillBlocks + blocks - 1) / blocks, kSumMinSlices, kSumMaxSlices);
}

/// The row slices per expert for a launch whose largest expert has `most` rows.
int sumSlices(std::int64_t most, int experts, int cols) {
  return static_cast<int>(std::clamp<std::int64_t>((most + kSumSliceRows - 1) / kSumSliceRows, 1,
                                                   maxSumSlices(experts, cols)));
}

/// Block (column tile, expert, slice); cols % 8 == 0; partial holds (experts x slices) rows of
/// cols floats.  kGelu: the rows read are dact, turned into dpre = dact * gelu_tanh'(pre)
/// (written to out, in place allowed) before they are summed, so the backward's dGELU and its b1
/// gradient take one pass.
template <bool kGelu> __global__ void __launch_bounds__(kSumThreads)
    biasGradKernel(RowBlocks blocks, int slices, const bfloat* d, const bfloat* pre, bfloat* out,
                   int cols, float* partial) {
  __shared__ float part[kSumRowLanes][kSumCols + 1];
  const int e = blockIdx.y, slice = blockIdx.z, lane = threadIdx.x / kSumColLanes,
            cl = threadIdx.x % kSumColLanes;
  const std::int64_t begin = blocks.offset[e], end = blocks.offset[e + 1];
  if (end == begin) return;  // nothing to add: the second launch leaves this expert alone
  const std::int64_t per = (end - begin + slices - 1) / slices;
  const std::int64_t first = begin + slice * per < end ? begin + slice * per : end,
                     last = first + per < end ? first + per : end;
  const int c = blockIdx.x * kSumCols + cl * 8;
  float s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  auto at = [&](std::int64_t r) { return r * cols + c; };
  auto read = [](const bfloat* p) { return *reinterpret_cast<const uint4*>(p); };
  // dGELU (kGelu) and the sum of one row's 8 values; `out` may alias d, so every load of an
  // unrolled step is issued before its stores.
  auto add = [&](uint4 v, const uint4& p, std::int64_t r) {
    if constexpr (kGelu) {
      geluBackward8(v, p);
      *reinterpret_cast<uint4*>(out + at(r)) = v;
    }
    const auto* h = reinterpret_cast<const __nv_bfloat162*>(&v);
    for (int j = 0; j < 4; ++j) {
      const float2 f = __bfloat1622float2(h[j]);
      s[2 * j] += f.x;
      s[2 * j + 1] += f.y;
    }
  };
  if (c < cols) {
    std::int64_t r = first + lane;
    for (; r + (kSumUnroll - 1) * kSumRowLanes < last; r += kSumUnroll * kSumRowLanes) {
      uint4 v[kSumUnroll], p[kSumUnroll] = {};
      for (int u = 0; u < kSumUnroll; ++u) {
        v[u] = read(d + at(r + u * kSumRowLanes));
        if constexpr (kGelu) p[u] = read(pre + at(r + u * kSumRowLanes));
      }
      for (int u = 0; u < kSumUnroll; ++u) add(v[u], p[u], r + u * kSumRowLanes);
    }
    for (; r < last; r += kSumRowLanes) {
      uint4 p{};
      if constexpr (kGelu) p = read(pre + at(r));
      add(read(d + at(r)), p, r);
    }
  }
  for (int j = 0; j < 8; ++j) part[lane][cl * 8 + j] = s[j];
  __syncthreads();
  for (int half = kSumRowLanes / 2; half > 0; half /= 2) {
    for (int i = threadIdx.x; i < half * kSumCols; i += kSumThreads)
      part[i / kSumCols][i % kSumCols] += part[i / kSumCols + half][i % kSumCols];
    __syncthreads();
  }
  float* row = partial + (std::int64_t(e) * slices + slice) * cols;
  for (int i = threadIdx.x; i < kSumCols; i += kSumThreads) {
    const int col = blockIdx.x * kSumCols + i;
    if (col < cols) row[col] = part[0][i];
  }
}

/// db[e][col] += the sum of expert e's slice sums in slice order (experts with rows only).
__global__ void biasGradFinishKernel(RowBlocks blocks, int slices, const float* partial, int cols) {
  const int e = blockIdx.y, col = blockIdx.x * blockDim.x + threadIdx.x;
  if (col >= cols || blocks.offset[e + 1] == blocks.offset[e]) return;
  const float* p = partial + std::int64_t(e) * slices * cols + col;
  float sum = 0.0f;
  for (int k = 0; k < slices; ++k) sum += p[std::int64_t(k) * cols];
  static_cast<float*>(const_cast<void*>(blocks.ptr[e]))[col] += sum;
}

void checkCols(int cols, const char* what) {
  if (cols % 8 != 0)
    throw Error(std::string("plm::gpu::") + what + ": " + std::to_string(cols) +
                " columns (the grouped expert path needs multiples of 8; a bug in the caller)");
}

/// The groups of experts with rows, each a problem of `layout`.
template <class Make>
std::vector<GroupedProblem> problemsOf(const std::vector<std::int64_t>& rows, Make make) {
  std::vector<GroupedProblem> out;
  std::int64_t at = 0;
  for (std::size_t e = 0; e < rows.size(); ++e) {
    if (rows[e] > 0) out.push_back(make(e, at, rows[e]));
    at += rows[e];
  }
  return out;
}

// GroupedTiles' defaults: forward 128x128, dgrad 256x128, wgrad 128x128, the best of the four
// dgrad x wgrad pairs at the 650M-like and the 64-expert training layers (H200,
// validation/gpu_logs/moe70_h200: wgrad 256x128 lost 0.19-0.45 ms, dgrad 256x128 gained
// 0.02-0.04 ms per backward).
GroupedTiles& tilesInUse() {
  static GroupedTiles tiles;
  return tiles;
}

detail::GroupedTile tileOf(int rows) {
  return rows == 256 ? detail::GroupedTile::Large : detail::GroupedTile::Small;
}

/// The CTA tile of a `layout` launch.
detail::GroupedTile groupedTile(GroupedLayout layout) {
  const GroupedTiles& t = tilesInUse();
  switch (layout) {
    case GroupedLayout::Forward: return tileOf(t.forward);
    case GroupedLayout::Dgrad: return tileOf(t.dgrad);
    case GroupedLayout::Wgrad: return tileOf(t.wgrad);
  }
  return detail::GroupedTile::Small;
}

/// The grouped GEMMs' part of the workspace: one argument block per layout.
std::size_t gemmWorkspaceBytes(int experts) {
  std::size_t per = 0;
  for (int l = 0; l < detail::kGroupedLayouts; ++l)
    per = std::max(per, detail::groupedWorkspaceBytes(static_cast<GroupedLayout>(l), experts));
  return (per + 255) / 256 * 256 * detail::kGroupedLayouts;
}

/// The workspace of a layer's grouped calls: the GEMMs' argument blocks first, then the bias
/// gradients' scratch; too small a workspace is a bug in the caller.
void checkWorkspace(std::size_t bytes, int experts, int hidden, int ffn, const char* what) {
  const std::size_t need = groupedExpertWorkspaceBytes(experts, hidden, ffn);
  if (bytes < need)
    throw Error(std::string("plm::gpu::") + what + ": workspace of " + std::to_string(bytes) +
                " bytes, " + std::to_string(need) +
                " needed (a bug: size it with groupedExpertWorkspaceBytes)");
}

/// One grouped launch; the workspace holds one argument block per layout (checkWorkspace), so
/// the launches of one layer can queue back to back.
void runGrouped(Stream stream, GroupedLayout layout, const std::vector<GroupedProblem>& p,
                float beta, void* workspace, int experts) {
  const std::size_t per = gemmWorkspaceBytes(experts) / detail::kGroupedLayouts;
  detail::groupedRun(stream, layout, groupedTile(layout), p.data(), static_cast<int>(p.size()),
                     beta, static_cast<char*>(workspace) + per * static_cast<int>(layout), per);
}

/// The activation GEMM (Forward or Dgrad layout) of every expert with rows: its row block of
/// d (rows, n) from its row block of a (rows, k) and its weight `w` (row stride ldb as stored).
std::vector<GroupedProblem> activationProblems(const std::vector<std::int64_t>& rows, int n, int k,
                                               const bf16* a,
                                               const std::vector<ExpertWeights>& experts,
                                               const bf16* ExpertWeights::*w, std::int64_t ldb,
                                               bf16* d) {
  return problemsOf(rows, [&](std::size_t e, std::int64_t at, std::int64_t m) {
    return GroupedProblem{static_cast<int>(m), n,   k,          a + at * k, k,
                          experts[e].*w,       ldb, d + at * n, n};
  });
}

/// As runGrouped for groups whose rows only the device knows.
void runGroupedDeviceRows(Stream stream, GroupedLayout layout, const detail::DeviceRowGroups& g,
                          void* workspace) {
  const std::size_t per = gemmWorkspaceBytes(g.groups) / detail::kGroupedLayouts;
  detail::groupedRunDeviceRows(stream, layout, groupedTile(layout), g,
                               static_cast<char*>(workspace) + per * static_cast<int>(layout), per);
}

/// activationProblems with the row blocks on the device (`rows`).
detail::DeviceRowGroups activationRowGroups(const DeviceRows& rows, int n, int k, const bf16* a,
                                            const std::vector<ExpertWeights>& experts,
                                            const bf16* ExpertWeights::*w, std::int64_t ldb,
                                            bf16* d) {
  detail::DeviceRowGroups g;
  g.groups = static_cast<int>(experts.size());
  g.n = n;
  g.k = k;
  g.rows = rows.rows;
  g.first = rows.first;
  g.a = a;
  g.lda = k;
  for (int e = 0; e < g.groups; ++e) g.b[e] = experts[e].*w;
  g.ldb = ldb;
  g.d = d;
  g.ldd = n;
  return g;
}

/// The weight-gradient GEMM (Wgrad layout) of every expert with rows: its gradient `dw` (m, n)
/// += a^T b over its row blocks of a (rows, m) and b (rows, n).
std::vector<GroupedProblem> weightProblems(const std::vector<std::int64_t>& rows, int m, int n,
                                           const bf16* a, const bf16* b,
                                           const std::vector<ExpertGrads>& grads,
                                           float* ExpertGrads::*dw) {
  return problemsOf(rows, [&](std::size_t e, std::int64_t at, std::int64_t k) {
    return GroupedProblem{m, n, static_cast<int>(k), a + at * m, m, b + at * n, n, grads[e].*dw, n};
  });
}

/// The checks every grouped expert call makes (grads: nullptr in a forward).
void checkCall(const char* what, const std::vector<std::int64_t>& rows,
               const std::vector<ExpertWeights>& experts, const std::vector<ExpertGrads>* grads,
               int hidden, int ffn, std::size_t workspace_bytes) {
  if (!grads && rows.size() != experts.size())
    throw Error(std::string("plm::gpu::") + what + ": " + std::to_string(rows.size()) +
                " row counts for " + std::to_string(experts.size()) + " experts (a bug)");
  if (grads && (rows.size() != experts.size() || grads->size() != experts.size()))
    throw Error(std::string("plm::gpu::") + what + ": " + std::to_string(rows.size()) +
                " row counts and " + std::to_string(grads->size()) + " gradients for " +
                std::to_string(experts.size()) + " experts (a bug)");
  checkCols(hidden, what);
  checkCols(ffn, what);
  checkWorkspace(workspace_bytes, static_cast<int>(experts.size()), hidden, ffn, what);
}

/// checkCall's checks for a forward whose rows are on the device.
void checkDeviceCall(const char* what, const DeviceRows& rows,
                     const std::vector<ExpertWeights>& experts, int hidden, int ffn,
                     std::size_t workspace_bytes) {
  if (experts.size() > std::size_t(kMaxGroups) || (rows.total > 0 && (!rows.rows || !rows.first)))
    throw Error(std::string("plm::gpu::") + what + ": " + std::to_string(experts.size()) +
                " experts (at most " + std::to_string(kMaxGroups) +
                ") or no device row counts (a bug in the caller)");
  checkCols(hidden, what);
  checkCols(ffn, what);
  checkWorkspace(workspace_bytes, static_cast<int>(experts.size()), hidden, ffn, what);
}

}  // namespace

ExpertGemm parseExpertGemm(const std::string& value, const std::string& where) {
  if (value == "auto") return ExpertGemm::Auto;
  if (value == "loop") return ExpertGemm::Loop;
  if (value == "grouped") return ExpertGemm::Grouped;
  throw Error(where + ": '" + value + "' is not an expert GEMM mode; use auto, loop or grouped");
}

void setGroupedTiles(const GroupedTiles& tiles) {
  for (int rows : {tiles.forward, tiles.dgrad, tiles.wgrad})
    if (rows != 128 && rows != 256)
      throw Error("plm::gpu::setGroupedTiles: a grouped GEMM tile of " + std::to_string(rows) +
                  " rows; use 128 or 256");
  tilesInUse() = tiles;
}

GroupedTiles groupedTiles() { return tilesInUse(); }

bool groupedExpertGemmAvailable() {
  static const bool ok = [] {
    if (!detail::groupedCompiled()) return false;
    int device = 0, major = 0, minor = 0;
    if (cudaGetDevice(&device) != cudaSuccess) return false;
    PLM_CHECK_CUDA(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    PLM_CHECK_CUDA(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
    return major == 9 && minor == 0;  // sm_90a code runs on sm_90 only
  }();
  return ok;
}

ExpertGemm chooseExpertGemm(ExpertGemm asked, int experts, int hidden, int ffn, bool backward) {
  const bool shapes_ok = experts <= kMaxGroups && hidden % 8 == 0 && ffn % 8 == 0;
  if (asked == ExpertGemm::Grouped) {
    if (!groupedExpertGemmAvailable())
      throw Error(
          "plm::gpu: the grouped expert GEMM was asked for (moe.expert_gemm: grouped) but " +
          std::string(detail::groupedCompiled() ? "this GPU is not an sm_90 (Hopper) device"
                                                : "this build has no CUTLASS "
                                                  "(scripts/get-cutlass.sh, then reconfigure)") +
          "; use moe.expert_gemm: loop or auto");
    if (!shapes_ok)
      throw Error(
          "plm::gpu: the grouped expert GEMM needs hidden and expert ffn multiples of 8 "
          "and at most " +
          std::to_string(kMaxGroups) + " experts (got " + std::to_string(experts) + " x " +
          std::to_string(ffn) + ", hidden " + std::to_string(hidden) +
          "); use moe.expert_gemm: loop or auto");
    return ExpertGemm::Grouped;
  }
  if (asked == ExpertGemm::Loop || !shapes_ok || !groupedExpertGemmAvailable())
    return ExpertGemm::Loop;
  // The crossover measured on one H100 (doc/performance.md "MoE grouped GEMM", training layer
  // forward and backward apart): one launch wins once the experts are many (a per-expert GEMM
  // too small to fill the GPU); forward, cuBLASLt's fused bias + GELU epilogue beats the grouped
  // GEMM's extra passes at 8 experts; backward (five launches per expert in the loop, four
  // grouped ones in all) grouped wins up to the 650M-like experts, the loop at AIDO-like ones.
  if (experts >= 16) return ExpertGemm::Grouped;
  const std::int64_t weight = std::int64_t(hidden) * ffn;
  return backward && weight <= (std::int64_t(8) << 20) ? ExpertGemm::Grouped : ExpertGemm::Loop;
}

std::size_t groupedExpertWorkspaceBytes(int experts, int hidden, int ffn) {
  return gemmWorkspaceBytes(experts) + std::max(expertBiasGradientWorkspaceBytes(experts, hidden),
                                                expertBiasGradientWorkspaceBytes(experts, ffn));
}

void expertBiasGelu(Stream stream, const std::vector<const bf16*>& bias,
                    const std::vector<std::int64_t>& rows, bf16* pre, bf16* act, int cols) {
  checkCols(cols, "expertBiasGelu");
  const std::int64_t most = maxRows(rows);
  if (most == 0) return;
  const RowBlocks b =
      rowBlocks(rows, reinterpret_cast<const void* const*>(bias.data()), "expertBiasGelu");
  const std::int64_t per_block = 256;
  const unsigned gx = static_cast<unsigned>(
      std::min<std::int64_t>((most * cols / 8 + per_block - 1) / per_block, 1024));
  biasGeluKernel<<<dim3(gx, b.groups), per_block, 0, stream>>>(
      b, reinterpret_cast<bfloat*>(pre), reinterpret_cast<bfloat*>(act), cols);
  PLM_CHECK_CUDA(cudaGetLastError());
}

/// The bias-gradient launches (kGelu: see biasGradKernel); `scratch` holds
/// expertBiasGradientWorkspaceBytes(rows.size(), cols).
template <bool kGelu> void biasGradient(Stream stream, const std::vector<float*>& db,
                                        const std::vector<std::int64_t>& rows, const bf16* d,
                                        const bf16* pre, bf16* out, int cols, void* scratch,
                                        std::size_t scratch_bytes) {
  checkCols(cols, "expertBiasGradient");
  const std::int64_t most = maxRows(rows);
  if (most == 0) return;
  const int e_n = static_cast<int>(rows.size());
  if (scratch_bytes < expertBiasGradientWorkspaceBytes(e_n, cols))
    throw Error("plm::gpu::expertBiasGradient: workspace of " + std::to_string(scratch_bytes) +
                " bytes, " + std::to_string(expertBiasGradientWorkspaceBytes(e_n, cols)) +
                " needed (a bug: size it with expertBiasGradientWorkspaceBytes)");
  const RowBlocks b =
      rowBlocks(rows, reinterpret_cast<const void* const*>(db.data()), "expertBiasGradient");
  const int slices = sumSlices(most, e_n, cols);
  auto* partial = static_cast<float*>(scratch);
  biasGradKernel<kGelu>
      <<<dim3((cols + kSumCols - 1) / kSumCols, b.groups, slices), kSumThreads, 0, stream>>>(
          b, slices, reinterpret_cast<const bfloat*>(d), reinterpret_cast<const bfloat*>(pre),
          reinterpret_cast<bfloat*>(out), cols, partial);
  PLM_CHECK_CUDA(cudaGetLastError());
  biasGradFinishKernel<<<dim3((cols + 255) / 256, b.groups), 256, 0, stream>>>(b, slices, partial,
                                                                               cols);
  PLM_CHECK_CUDA(cudaGetLastError());
}

std::size_t expertBiasGradientWorkspaceBytes(int experts, int cols) {
  return (std::size_t(experts) * maxSumSlices(experts, cols) * std::max(cols, 0) * sizeof(float) +
          255) /
         256 * 256;
}

void expertBiasGradient(Stream stream, const std::vector<float*>& db,
                        const std::vector<std::int64_t>& rows, const bf16* d, int cols,
                        void* workspace, std::size_t workspace_bytes) {
  biasGradient<false>(stream, db, rows, d, nullptr, nullptr, cols, workspace, workspace_bytes);
}

void groupedExpertForward(Stream stream, const std::vector<ExpertWeights>& experts,
                          const std::vector<std::int64_t>& rows, const bf16* x, bf16* pre,
                          bf16* act, bf16* y, int hidden, int ffn, void* workspace,
                          std::size_t workspace_bytes) {
  checkCall("groupedExpertForward", rows, experts, nullptr, hidden, ffn, workspace_bytes);
  const int e_n = static_cast<int>(experts.size());
  const auto up =
      activationProblems(rows, ffn, hidden, x, experts, &ExpertWeights::w1, hidden, pre);
  if (up.empty()) return;
  runGrouped(stream, GroupedLayout::Forward, up, 0.0f, workspace, e_n);
  std::vector<const bf16*> b1(e_n), b2(e_n);
  for (int e = 0; e < e_n; ++e) {
    b1[e] = experts[e].b1;
    b2[e] = experts[e].b2;
  }
  expertBiasGelu(stream, b1, rows, pre, act, ffn);
  runGrouped(stream, GroupedLayout::Forward,
             activationProblems(rows, hidden, ffn, act, experts, &ExpertWeights::w2, ffn, y), 0.0f,
             workspace, e_n);
  expertBiasGelu(stream, b2, rows, y, nullptr, hidden);
}

void expertBiasGelu(Stream stream, const std::vector<const bf16*>& bias, const DeviceRows& rows,
                    bf16* pre, bf16* act, int cols) {
  checkCols(cols, "expertBiasGelu");
  if (rows.total == 0 || bias.empty()) return;
  if (bias.size() > std::size_t(kMaxGroups))
    throw Error("plm::gpu::expertBiasGelu: " + std::to_string(bias.size()) + " experts (at most " +
                std::to_string(kMaxGroups) + "; a bug in the caller)");
  ExpertBiases b;
  b.groups = static_cast<int>(bias.size());
  for (int e = 0; e < b.groups; ++e) b.ptr[e] = bias[e];
  const std::int64_t per_block = 256;
  const unsigned gx = static_cast<unsigned>(
      std::min<std::int64_t>((rows.total * cols / 8 + per_block - 1) / per_block, 4096));
  biasGeluRowsKernel<<<gx, per_block, 0, stream>>>(b, rows.first, rows.total,
                                                   reinterpret_cast<bfloat*>(pre),
                                                   reinterpret_cast<bfloat*>(act), cols);
  PLM_CHECK_CUDA(cudaGetLastError());
}

void groupedExpertForward(Stream stream, const std::vector<ExpertWeights>& experts,
                          const DeviceRows& rows, const bf16* x, bf16* pre, bf16* act, bf16* y,
                          int hidden, int ffn, void* workspace, std::size_t workspace_bytes) {
  checkDeviceCall("groupedExpertForward", rows, experts, hidden, ffn, workspace_bytes);
  if (rows.total == 0 || experts.empty()) return;
  const int e_n = static_cast<int>(experts.size());
  runGroupedDeviceRows(
      stream, GroupedLayout::Forward,
      activationRowGroups(rows, ffn, hidden, x, experts, &ExpertWeights::w1, hidden, pre),
      workspace);
  std::vector<const bf16*> b1(e_n), b2(e_n);
  for (int e = 0; e < e_n; ++e) {
    b1[e] = experts[e].b1;
    b2[e] = experts[e].b2;
  }
  expertBiasGelu(stream, b1, rows, pre, act, ffn);
  runGroupedDeviceRows(
      stream, GroupedLayout::Forward,
      activationRowGroups(rows, hidden, ffn, act, experts, &ExpertWeights::w2, ffn, y), workspace);
  expertBiasGelu(stream, b2, rows, y, nullptr, hidden);
}

void groupedExpertBackward(Stream stream, const std::vector<ExpertWeights>& experts,
                           const std::vector<ExpertGrads>& grads,
                           const std::vector<std::int64_t>& rows, const bf16* x, const bf16* pre,
                           const bf16* act, const bf16* dy, bf16* dpre, bf16* dx, int hidden,
                           int ffn, void* workspace, std::size_t workspace_bytes) {
  checkCall("groupedExpertBackward", rows, experts, &grads, hidden, ffn, workspace_bytes);
  const int e_n = static_cast<int>(experts.size());
  void* scratch = static_cast<char*>(workspace) + gemmWorkspaceBytes(e_n);
  const std::size_t scratch_bytes = workspace_bytes - gemmWorkspaceBytes(e_n);
  std::vector<float*> db1(e_n), db2(e_n);
  for (int e = 0; e < e_n; ++e) {
    db1[e] = grads[e].b1;
    db2[e] = grads[e].b2;
  }
  // dact = dy W2 (into dpre), then dpre = dact * gelu'(pre) in place with db1 += sum dpre in
  // the same pass.
  const auto dact =
      activationProblems(rows, ffn, hidden, dy, experts, &ExpertWeights::w2, ffn, dpre);
  if (dact.empty()) return;
  runGrouped(stream, GroupedLayout::Dgrad, dact, 0.0f, workspace, e_n);
  biasGradient<true>(stream, db1, rows, dpre, pre, dpre, ffn, scratch, scratch_bytes);
  // dW2 (hidden, ffn) += dy^T act; dW1 (ffn, hidden) += dpre^T x.
  runGrouped(stream, GroupedLayout::Wgrad,
             weightProblems(rows, hidden, ffn, dy, act, grads, &ExpertGrads::w2), 1.0f, workspace,
             e_n);
  runGrouped(stream, GroupedLayout::Wgrad,
             weightProblems(rows, ffn, hidden, dpre, x, grads, &ExpertGrads::w1), 1.0f, workspace,
             e_n);
  expertBiasGradient(stream, db2, rows, dy, hidden, scratch, scratch_bytes);
  // dx = dpre W1.
  runGrouped(stream, GroupedLayout::Dgrad,
             activationProblems(rows, hidden, ffn, dpre, experts, &ExpertWeights::w1, hidden, dx),
             0.0f, workspace, e_n);
}

void groupedSwigluExpertForward(Stream stream, const std::vector<ExpertWeights>& experts,
                                const std::vector<std::int64_t>& rows, const bf16* x, bf16* pre,
                                bf16* act, bf16* y, int hidden, int ffn, void* workspace,
                                std::size_t workspace_bytes) {
  checkCall("groupedSwigluExpertForward", rows, experts, nullptr, hidden, ffn, workspace_bytes);
  const int e_n = static_cast<int>(experts.size());
  const int wide = 2 * ffn;  // [gate | up]
  const auto up =
      activationProblems(rows, wide, hidden, x, experts, &ExpertWeights::w1, hidden, pre);
  if (up.empty()) return;
  runGrouped(stream, GroupedLayout::Forward, up, 0.0f, workspace, e_n);
  const std::int64_t total = std::accumulate(rows.begin(), rows.end(), std::int64_t(0));
  swigluForward(stream, pre, act, total, ffn);
  runGrouped(stream, GroupedLayout::Forward,
             activationProblems(rows, hidden, ffn, act, experts, &ExpertWeights::w2, ffn, y), 0.0f,
             workspace, e_n);
}

void groupedSwigluExpertForward(Stream stream, const std::vector<ExpertWeights>& experts,
                                const DeviceRows& rows, const bf16* x, bf16* pre, bf16* act,
                                bf16* y, int hidden, int ffn, void* workspace,
                                std::size_t workspace_bytes) {
  checkDeviceCall("groupedSwigluExpertForward", rows, experts, hidden, ffn, workspace_bytes);
  if (rows.total == 0 || experts.empty()) return;
  runGroupedDeviceRows(
      stream, GroupedLayout::Forward,
      activationRowGroups(rows, 2 * ffn, hidden, x, experts, &ExpertWeights::w1, hidden, pre),
      workspace);
  swigluForward(stream, pre, act, rows.total, ffn);
  runGroupedDeviceRows(
      stream, GroupedLayout::Forward,
      activationRowGroups(rows, hidden, ffn, act, experts, &ExpertWeights::w2, ffn, y), workspace);
}

void groupedSwigluExpertBackward(Stream stream, const std::vector<ExpertWeights>& experts,
                                 const std::vector<ExpertGrads>& grads,
                                 const std::vector<std::int64_t>& rows, const bf16* x,
                                 const bf16* pre, const bf16* act, const bf16* dy, bf16* dact,
                                 bf16* dpre, bf16* dx, int hidden, int ffn, void* workspace,
                                 std::size_t workspace_bytes) {
  checkCall("groupedSwigluExpertBackward", rows, experts, &grads, hidden, ffn, workspace_bytes);
  const int e_n = static_cast<int>(experts.size());
  const int wide = 2 * ffn;
  // dact = dy W2, then dpre = [dact * up * silu'(gate) | dact * silu(gate)] in one pass.
  const auto dactp =
      activationProblems(rows, ffn, hidden, dy, experts, &ExpertWeights::w2, ffn, dact);
  if (dactp.empty()) return;
  runGrouped(stream, GroupedLayout::Dgrad, dactp, 0.0f, workspace, e_n);
  const std::int64_t total = std::accumulate(rows.begin(), rows.end(), std::int64_t(0));
  swigluBackward(stream, pre, dact, dpre, total, ffn);
  // dW2 (hidden, ffn) += dy^T act; dW1 (2 ffn, hidden) += dpre^T x.
  runGrouped(stream, GroupedLayout::Wgrad,
             weightProblems(rows, hidden, ffn, dy, act, grads, &ExpertGrads::w2), 1.0f, workspace,
             e_n);
  runGrouped(stream, GroupedLayout::Wgrad,
             weightProblems(rows, wide, hidden, dpre, x, grads, &ExpertGrads::w1), 1.0f, workspace,
             e_n);
  // dx = dpre W1 (W1 stored (2 ffn, hidden)).
  runGrouped(stream, GroupedLayout::Dgrad,
             activationProblems(rows, hidden, wide, dpre, experts, &ExpertWeights::w1, hidden, dx),
             0.0f, workspace, e_n);
}

}  // namespace plm::gpu
