// cuBLASLt GEMM plans cached per shape, and the plain reference kernel they are checked against.
// Row-major D(M,N) = op(A) op(B) is run as column-major D^T(N,M) = op(B)^T op(A)^T: cuBLASLt's
// "A" is our B and its "B" is our A, its m is our N and its n our M.  For FP8 that makes our
// (A (M,K), B (N,K)) cuBLASLt's TN case, the only one Hopper's FP8 kernels offer, and our B's
// scales cuBLASLt's A scales.
#include "gpu/gemm.hpp"

#include "core/error.hpp"
#include "core/log.hpp"
#include "gpu/detail/streamk_gemm.hpp"
#include "gpu/fp8.hpp"
#include "gpu/moe_grouped.hpp"

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

namespace plm::gpu {

#if !PLM_HAVE_CUTLASS
namespace detail {
bool streamKCompiled() { return false; }
bool streamKSupports(const StreamKProblem&) { return false; }
std::size_t streamKWorkspaceBytes(const StreamKProblem&) { return 0; }
void streamKRun(Stream, const StreamKProblem&, void*, std::size_t) {
  throw Error(
      "plm::gpu: the CUTLASS stream-K GEMM is not in this build (CUTLASS was not found when it "
      "was configured: run scripts/get-cutlass.sh and reconfigure)");
}
}  // namespace detail
#endif

namespace {

cudaDataType_t cudaType(DType t) {
  switch (t) {
    case DType::BF16: return CUDA_R_16BF;
    case DType::F32: return CUDA_R_32F;
    case DType::E4M3: return CUDA_R_8F_E4M3;
    case DType::E5M2: return CUDA_R_8F_E5M2;
  }
  return CUDA_R_32F;
}

bool isFp8(DType t) { return t == DType::E4M3 || t == DType::E5M2; }

const char* typeName(DType t) {
  switch (t) {
    case DType::BF16: return "bf16";
    case DType::F32: return "fp32";
    case DType::E4M3: return "e4m3";
    case DType::E5M2: return "e5m2";
  }
  return "?";
}

cublasLtMatmulMatrixScale_t ltScaleMode(Fp8ScaleMode s) {
  switch (s) {
    case Fp8ScaleMode::Tensor: return CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
    case Fp8ScaleMode::Block1x128: return CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    case Fp8ScaleMode::Block128x128: return CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
  }
  return CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
}

// What an FP8 call must satisfy; one message per mistake, naming the fix.
void checkFp8(const GemmArgs& g) {
  const std::string where = "plm::gpu::Gemm (FP8, M=" + std::to_string(g.m) +
                            " N=" + std::to_string(g.n) + " K=" + std::to_string(g.k) + "): ";
  if (!isFp8(g.a_type) || !isFp8(g.b_type))
    throw Error(where + "A is " + typeName(g.a_type) + " and B " + typeName(g.b_type) +
                "; cuBLASLt takes FP8 operands only in pairs: cast both to FP8 (fp8.hpp)");
  if (g.a_type == DType::E5M2 && g.b_type == DType::E5M2)
    throw Error(where +
                "E5M2 x E5M2 is not offered by Hopper; keep one operand E4M3 (the "
                "hybrid recipe: E4M3 weights/activations, E5M2 gradients)");
  if (g.trans_a || !g.trans_b)
    throw Error(where +
                "FP8 needs A stored (M,K) and B stored (N,K) (trans_a = false, "
                "trans_b = true); write the transposed copy in the cast (out_t)");
  if (g.d_type != DType::BF16 && g.d_type != DType::F32)
    throw Error(where + "D must be bf16 or fp32");
  if (!g.a_scale_inv || !g.b_scale_inv)
    throw Error(where +
                "a_scale_inv and b_scale_inv are required (device pointers the casts "
                "wrote)");
  const bool a_block = g.a_scaling != Fp8ScaleMode::Tensor;
  const bool b_block = g.b_scaling != Fp8ScaleMode::Tensor;
  if (a_block != b_block)
    throw Error(where + "per-tensor and block scaling cannot be mixed in one GEMM");
  if (g.a_scaling == Fp8ScaleMode::Block128x128 && g.b_scaling == Fp8ScaleMode::Block128x128)
    throw Error(where +
                "cuBLASLt offers no 128x128 x 128x128 block scaling; give the "
                "activation or gradient operand 1x128 blocks");
  if (a_block && g.fast_accum)
    throw Error(where + "fast accumulation is not allowed with block scaling");
  // Transformer Engine's observed requirements for block-scaled cuBLASLt GEMMs.
  if (a_block && (g.n % 8 != 0 || (g.a_scaling == Fp8ScaleMode::Block1x128 && g.m % 8 != 0)))
    throw Error(where +
                "block-scaled FP8 GEMMs need N (and M with 1x128 blocks on A) to be "
                "multiples of 8; pad the token count");
  if (g.lda % 16 != 0 || g.ldb % 16 != 0)
    throw Error(where + "FP8 leading dimensions must be multiples of 16 (lda=" +
                std::to_string(g.lda) + ", ldb=" + std::to_string(g.ldb) + ")");
}

cublasLtEpilogue_t ltEpilogue(Epilogue e) {
  switch (e) {
    case Epilogue::None: return CUBLASLT_EPILOGUE_DEFAULT;
    case Epilogue::Bias: return CUBLASLT_EPILOGUE_BIAS;
    case Epilogue::BiasGeluAux: return CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
    case Epilogue::DGelu: return CUBLASLT_EPILOGUE_DGELU;
    case Epilogue::BGradA: return CUBLASLT_EPILOGUE_BGRADB;
  }
  return CUBLASLT_EPILOGUE_DEFAULT;
}

using PlanKey = std::tuple<bool, bool, std::int64_t, std::int64_t, std::int64_t, std::int64_t,
                           std::int64_t, std::int64_t, int, int, std::int64_t, std::int64_t, bool,
                           int /* a_type */, int /* b_type */, int /* a_scaling */,
                           int /* b_scaling */, bool /* fast_accum */, bool /* amax_d */>;

struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr, d = nullptr;  // cuBLASLt's
  cublasLtMatmulAlgo_t algo{};
  bool fp8 = false;
  // Split-K of a BGradA call where cuBLASLt offers the split only without the epilogue: the
  // GEMM runs on plain_desc (same GEMM, no epilogue) and biasGradPass writes the bias gradient.
  cublasLtMatmulDesc_t plain_desc = nullptr;
  bool bias_pass = false;
  int splits = 1;
  bool streamk = false;  // CUTLASS's stream-K kernel instead of cuBLASLt
  // amax_d asked for and cuBLASLt's AMAX_D_POINTER refused (it is documented for FP8 D only):
  // max |D| then comes from a pass over D.
  bool amax_by_pass = false;
};

// FP8 plans: the heuristic otherwise assumes 256-byte aligned operands and may choose a kernel
// that refuses (CUBLAS_STATUS_NOT_SUPPORTED) the model's operands at launch: activations and
// outputs are slices of workspaces, aligned to 16 bytes (FP8's requirement), not 256.
void askFp8Alignment(cublasLtMatmulPreference_t pref) {
  const std::uint32_t align = 16;
  for (auto attr :
       {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES})
    PLM_CHECK_CUBLAS(cublasLtMatmulPreferenceSetAttribute(pref, attr, &align, sizeof(align)));
}

// A split-K kernel of the heuristic whose reduction runs in the output type would sum partial
// products rounded to bf16, so outputs other than fp32 keep their partial sums in the compute
// type (fp32) or in place.
void keepPartialSumsInFp32(cublasLtMatmulPreference_t pref, cublasLtMatrixLayout_t d) {
  std::uint32_t type = 0;
  std::size_t written = 0;
  PLM_CHECK_CUBLAS(cublasLtMatrixLayoutGetAttribute(d, CUBLASLT_MATRIX_LAYOUT_TYPE, &type,
                                                    sizeof(type), &written));
  if (type == static_cast<std::uint32_t>(CUDA_R_32F)) return;
  const std::uint32_t mask = CUBLASLT_REDUCTION_SCHEME_MASK &
                             ~static_cast<std::uint32_t>(CUBLASLT_REDUCTION_SCHEME_OUTPUT_TYPE);
  PLM_CHECK_CUBLAS(cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &mask, sizeof(mask)));
}

// cuBLASLt's A is our B: its scales are our B's.
void setScalePointers(Plan& p, const GemmArgs& g) {
  PLM_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
                                                  &g.b_scale_inv, sizeof(g.b_scale_inv)));
  PLM_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
                                                  &g.a_scale_inv, sizeof(g.a_scale_inv)));
}

// ---- autotuning (train.gemm_autotune) ------------------------------------------------------
// A tuned choice is stored as its index in the heuristic's candidate list, which is a pure
// function of the shape, cuBLASLt version and device (all in the key): no opaque algorithm bytes
// go to the file, and an index past a shorter list falls back to the first choice.
struct TuneState {
  std::mutex mutex;
  bool on = false;
  bool write = true;
  int candidates = 8;
  std::string file;
  struct Choice {
    int index = 0;  // in the candidate list of the shape it was tuned on (logged)
    double heuristic_ms = -1, tuned_ms = -1;
    // What was chosen, run again for every shape of the same bucket (cuBLASLt checks that the
    // algorithm takes the shape): the algorithm and plm's variant flags.
    cublasLtMatmulAlgo_t algo{};
    int splits = 1;
    bool bias_pass = false, streamk = false;
  };
  std::map<std::string, Choice> choices;  // read from the file and tuned in this process
  std::set<std::string> logged;
};

TuneState& tuneState() {
  static TuneState state;
  return state;
}

std::size_t typeBytes(DType t) { return t == DType::F32 ? 4 : t == DType::BF16 ? 2 : 1; }

std::string deviceTag() {
  int device = 0;
  cudaDeviceProp prop{};
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaGetDeviceProperties(&prop, device) != cudaSuccess) {
    cudaGetLastError();
    return "unknown";
  }
  std::string name = prop.name;
  for (char& c : name)
    if (c == ' ' || c == ',') c = '_';
  return name + "/sm" + std::to_string(prop.major * 10 + prop.minor);
}

// A token count's bucket in the autotune's key: with packed batches M (forward, dgrad, the LM
// head's masked rows) and K (weight gradients) change with every micro-batch (65,391, 65,536,
// ...), so a key by the exact size tuned again at every step.  Sizes from 1,024 up share a key
// per eighth of their power of two (rounded up: 65,391 -> 65,536, 3,771 -> 3,840); smaller ones
// keep their own.
std::string tuneSize(std::int64_t x) {
  if (x < 1024) return std::to_string(x);
  std::int64_t pow2 = 1024;
  while (pow2 * 2 <= x) pow2 *= 2;
  const std::int64_t step = pow2 / 8;
  return "~" + std::to_string((x + step - 1) / step * step);
}

// A leading dimension in the key: by the same buckets, with its alignment (FP8 operands stored
// (M, K) or (N, K) have ld = K padded to 16, which changes with every micro-batch as K does; a
// bucket's choice is checked against each exact call anyway, storedTakes).
std::string tuneLd(std::int64_t ld) {
  return tuneSize(ld) + (ld % 16 == 0 ? "" : ld % 8 == 0 ? "/8" : "/u");
}

std::string tuneKey(const GemmArgs& g, const std::string& device) {
  std::ostringstream k;
  k << "m=" << tuneSize(g.m) << ",n=" << g.n << ",k=" << tuneSize(g.k) << ",ta=" << g.trans_a
    << ",tb=" << g.trans_b << ",lda=" << tuneLd(g.lda) << ",ldb=" << tuneLd(g.ldb)
    << ",ldd=" << tuneLd(g.ldd) << ",ldc=" << (g.c ? tuneLd(g.ldc) : "-1")
    << ",ldaux=" << tuneLd(g.ldaux) << ",beta=" << (g.beta != 0.0f) << ",a=" << typeName(g.a_type)
    << ",b=" << typeName(g.b_type) << ",d=" << typeName(g.d_type)
    << ",epi=" << static_cast<int>(g.epilogue) << ",as=" << static_cast<int>(g.a_scaling)
    << ",bs=" << static_cast<int>(g.b_scaling) << ",fast=" << g.fast_accum
    << ",lt=" << cublasLtGetVersion() << ",dev=" << device;
  return k.str();
}

const char* epilogueName(Epilogue e) {
  switch (e) {
    case Epilogue::None: return "none";
    case Epilogue::Bias: return "bias";
    case Epilogue::BiasGeluAux: return "bias+gelu";
    case Epilogue::DGelu: return "dgelu";
    case Epilogue::BGradA: return "bgrad";
  }
  return "?";
}

void logChoice(const GemmArgs& g, const TuneState::Choice& c, int candidates, bool cached) {
  log::info(
      "gemm autotune: M=%lld N=%lld K=%lld %c%c %s->%s epilogue %s: heuristic #0 %.4f ms, "
      "tuned #%d %.4f ms (%.2fx)%s",
      static_cast<long long>(g.m), static_cast<long long>(g.n), static_cast<long long>(g.k),
      g.trans_a ? 'T' : 'N', g.trans_b ? 'T' : 'N', typeName(g.a_type), typeName(g.d_type),
      epilogueName(g.epilogue), c.heuristic_ms, c.index, c.tuned_ms,
      c.tuned_ms > 0 ? c.heuristic_ms / c.tuned_ms : 0.0,
      cached ? " (chosen before for this size bucket)"
             : (" of " + std::to_string(candidates) + " candidates").c_str());
}

// One line per key: key, index, heuristic ms, tuned ms, splits, bias pass, stream-K, then the
// algorithm's words (cublasLtMatmulAlgo_t::data).  Lines of an older form are skipped: their
// shape is tuned again.
void loadTuneFile(TuneState& s) {
  if (s.file.empty()) return;
  std::ifstream in(s.file);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    std::istringstream fields(line);
    std::string key;
    TuneState::Choice c;
    int bias_pass = 0, streamk = 0;
    if (!(fields >> key >> c.index >> c.heuristic_ms >> c.tuned_ms >> c.splits >> bias_pass >>
          streamk) ||
        c.index < 0)
      continue;
    c.bias_pass = bias_pass != 0;
    c.streamk = streamk != 0;
    bool ok = true;
    for (std::uint64_t& w : c.algo.data) ok = ok && static_cast<bool>(fields >> w);
    if (ok) s.choices[key] = c;
  }
}

void appendTuneFile(const TuneState& s, const std::string& key, const TuneState::Choice& c) {
  if (s.file.empty() || !s.write) return;
  std::ofstream out(s.file, std::ios::app);
  if (!out) {
    log::warn("gemm autotune: cannot append to %s; tuned choices stay in memory", s.file.c_str());
    return;
  }
  out << key << ' ' << c.index << ' ' << c.heuristic_ms << ' ' << c.tuned_ms << ' ' << c.splits
      << ' ' << c.bias_pass << ' ' << c.streamk;
  for (std::uint64_t w : c.algo.data) out << ' ' << w;
  out << '\n';
}

// Device buffers the timed launches write instead of the caller's outputs.
struct Scratch {
  std::vector<void*> ptrs;
  bool ok = true;
  void* get(std::size_t bytes) {
    void* p = nullptr;
    if (cudaMalloc(&p, std::max<std::size_t>(bytes, 16)) != cudaSuccess) {
      cudaGetLastError();  // clear it: running out here only means no tuning
      ok = false;
      return nullptr;
    }
    ptrs.push_back(p);
    return p;
  }
  ~Scratch() {
    for (void* p : ptrs) cudaFree(p);
  }
};

// ---- split-K and stream-K (train.gemm_split) ----------------------------------------------------
struct SplitKState {
  std::atomic<GemmSplit> mode{GemmSplit::Off};
  std::atomic<int> force{0};
  std::atomic<bool> streamk_allowed{true};
};

SplitKState& splitKState() {
  static SplitKState state;
  return state;
}

// Split counts tried as variants (autotune, benchmark) and by the rule.
constexpr int kSplitCounts[] = {2, 3, 4, 5, 6, 8, 12, 16};
// A part shorter than this along K spends more on its epilogue than it saves.
constexpr std::int64_t kMinSplitK = 512;
// Bytes after the cuBLASLt workspace that hold biasGradPass's per-chunk partial sums (kept
// apart: cuBLASLt's INPLACE reduction keeps its ordering counters in its workspace).
constexpr std::size_t kBiasPartialBytes = 4u << 20;

// Split-K applies to bf16 GEMMs with no epilogue or the bias gradient one (the weight
// gradients); the forward and dgrad GEMMs have M = tokens and fill the device already.
// Split GEMMs write fp32 and carry no epilogue (a BGradA call splits without it, its bias
// gradient from the separate pass), and split K only in parts of equal length (K a multiple of
// the count).  On an H200 (cuBLASLt 13.1), 4 and 8 parts of K = 4099 and 4 parts of K = 2051
// left out the last K mod 4 = 3 rows of the product (the error norm was sqrt(3 / K) of D's,
// test_gpu_gemm), with or without the epilogue, where 2, 3 and 7 parts were right.
bool splitEligible(const GemmArgs& g) {
  return !isFp8(g.a_type) && !isFp8(g.b_type) && g.d_type == DType::F32 &&
         (g.epilogue == Epilogue::None || g.epilogue == Epilogue::BGradA) && g.k >= 2;
}

// K in `splits` parts of equal length (splitEligible's rule; 1 part always).
bool equalParts(const GemmArgs& g, int splits) { return splits <= 1 || g.k % splits == 0; }

int smCount() {
  int device = 0, sms = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    cudaGetLastError();
    return 132;
  }
  return std::max(sms, 1);
}

// cuBLASLt's tile (rows along its m = our N, columns along its n = our M) for the common
// Hopper tiles; 128x128 when the algorithm does not say or names another.
void tileShape(const cublasLtMatmulAlgo_t& algo, int& rows, int& cols) {
  std::uint32_t id = CUBLASLT_MATMUL_TILE_UNDEFINED;
  std::size_t written = 0;
  if (cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_TILE_ID, &id, sizeof(id),
                                           &written) != CUBLAS_STATUS_SUCCESS)
    id = CUBLASLT_MATMUL_TILE_UNDEFINED;
  rows = cols = 128;
  switch (id) {
    case CUBLASLT_MATMUL_TILE_64x64: rows = 64, cols = 64; break;
    case CUBLASLT_MATMUL_TILE_64x128: rows = 64, cols = 128; break;
    case CUBLASLT_MATMUL_TILE_128x64: rows = 128, cols = 64; break;
    case CUBLASLT_MATMUL_TILE_64x256: rows = 64, cols = 256; break;
    case CUBLASLT_MATMUL_TILE_256x64: rows = 256, cols = 64; break;
    case CUBLASLT_MATMUL_TILE_128x256: rows = 128, cols = 256; break;
    case CUBLASLT_MATMUL_TILE_256x128: rows = 256, cols = 128; break;
    case CUBLASLT_MATMUL_TILE_128x192: rows = 128, cols = 192; break;
    case CUBLASLT_MATMUL_TILE_192x128: rows = 192, cols = 128; break;
    case CUBLASLT_MATMUL_TILE_128x96: rows = 128, cols = 96; break;
    case CUBLASLT_MATMUL_TILE_96x128: rows = 96, cols = 128; break;
    case CUBLASLT_MATMUL_TILE_128x160: rows = 128, cols = 160; break;
    case CUBLASLT_MATMUL_TILE_160x128: rows = 160, cols = 128; break;
    case CUBLASLT_MATMUL_TILE_256x256: rows = 256, cols = 256; break;
    default: break;
  }
}

// The rule: time of the GEMM with K in s parts, in units of one tile's full-K main loop,
// = waves(s) * (1/s + e): waves of tiles*s work units over the SMs, each a 1/s share of K plus
// the epilogue's read-modify-write of an fp32 tile (every part adds into D in turn).  e is that
// epilogue over the full-K main loop: (8 bytes per element / per-SM bandwidth) over (2 K flops
// per element / per-SM bf16 rate); Hopper's ratio of the two rates is about 208 flop/byte,
// hence e = 4 * 208 / K.  Returns the s of least time, 1 unless it saves at least 10%.
int ruleSplits(std::int64_t tiles, std::int64_t k, int sms) {
  const double e = 832.0 / static_cast<double>(k);
  auto cost = [&](int s) {
    const double waves = std::ceil(static_cast<double>(tiles * s) / sms);
    return waves * (1.0 / s + e);
  };
  int best = 1;
  double best_cost = cost(1);
  for (int s : kSplitCounts) {
    if (k / s < kMinSplitK) break;
    if (cost(s) < best_cost) best = s, best_cost = cost(s);
  }
  return best_cost < 0.9 * cost(1) ? best : 1;
}

// The bias gradient of a BGradA call run without its epilogue: bias_grad[m] = sum over the K
// rows of dY stored (K, M) of column m, written (=) as the epilogue writes it.  It is the MoE
// layer's fixed-order column sum (expertBiasGradient, one "expert" of K rows; bitwise
// reproducible), which reads dY 16 bytes at a time: it takes op(A) stored (K, M) unpadded
// (lda = M), M a multiple of 8 and a 16-byte aligned A.  Other calls keep the epilogue.
bool biasPassTakes(const GemmArgs& g) {
  return g.trans_a && g.lda == g.m && g.m % 8 == 0 &&
         reinterpret_cast<std::uintptr_t>(g.a) % 16 == 0 &&
         expertBiasGradientWorkspaceBytes(
             1, static_cast<int>(std::min<std::int64_t>(g.m, 1 << 30))) <= kBiasPartialBytes;
}

void biasGradPass(Stream stream, const GemmArgs& g, void* scratch) {
  PLM_CHECK_CUDA(cudaMemsetAsync(g.bias_grad, 0, static_cast<std::size_t>(g.m) * 4, stream));
  expertBiasGradient(stream, {static_cast<float*>(g.bias_grad)}, {g.k},
                     static_cast<const bf16*>(g.a), static_cast<int>(g.m), scratch,
                     kBiasPartialBytes);
}

// max |x - y| over a (rows, cols) matrix of `type` with leading dimension ld, into *out (the
// bits of a non-negative float, so unsigned atomicMax orders them); y == nullptr: max |x|.
__global__ void maxAbsDiffKernel(const void* x, const void* y, DType type, std::int64_t rows,
                                 std::int64_t cols, std::int64_t ld, unsigned* out) {
  const std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
  if (i >= rows * cols) return;
  const std::int64_t at = (i / cols) * ld + i % cols;
  auto load = [&](const void* p) {
    return type == DType::BF16 ? __bfloat162float(static_cast<const __nv_bfloat16*>(p)[at])
                               : static_cast<const float*>(p)[at];
  };
  const float d = y ? fabsf(load(x) - load(y)) : fabsf(load(x));
  atomicMax(out, __float_as_uint(d));
}

double maxAbsDiff(Stream stream, const void* x, const void* y, DType type, std::int64_t rows,
                  std::int64_t cols, std::int64_t ld, unsigned* scratch) {
  PLM_CHECK_CUDA(cudaMemsetAsync(scratch, 0, sizeof(unsigned), stream));
  const std::int64_t n = rows * cols;
  maxAbsDiffKernel<<<static_cast<unsigned>((n + 255) / 256), 256, 0, stream>>>(x, y, type, rows,
                                                                               cols, ld, scratch);
  PLM_CHECK_CUDA(cudaGetLastError());
  unsigned bits = 0;
  PLM_CHECK_CUDA(cudaMemcpyAsync(&bits, scratch, sizeof(bits), cudaMemcpyDeviceToHost, stream));
  PLM_CHECK_CUDA(cudaStreamSynchronize(stream));
  float v;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
}

// Candidates run once each on scratch outputs from the caller's D (copied in as C when
// accumulating, else zeros) and compared with a reference run: the autotune's check that a
// candidate computes the same product, and the split-K report's differences.
class CandidateRun {
 public:
  explicit CandidateRun(const GemmArgs& g)
      : g_(g), t_(g), d_bytes_(static_cast<std::size_t>(g.m) * g.ldd * typeBytes(g.d_type)) {
    d_ref_ = scratch_.get(d_bytes_);
    bias_ref_ = scratch_.get(static_cast<std::size_t>(g.m) * 4);
    t_.d = scratch_.get(d_bytes_);
    t_.bias_grad = scratch_.get(static_cast<std::size_t>(g.m) * 4);
    if (g.epilogue == Epilogue::BiasGeluAux)  // an output (DGelu reads the caller's)
      t_.aux = scratch_.get(static_cast<std::size_t>(g.m) * g.ldaux * 2);
    bits_ = static_cast<unsigned*>(scratch_.get(sizeof(unsigned)));
  }
  bool ok() const { return scratch_.ok; }
  /// Points `desc`'s epilogue at the runs' buffers (the bias read from the caller's; the bias
  /// gradient and a written aux into scratch; DGelu's aux, an input, the caller's): the
  /// pointers a timing left there may be freed.
  void bind(cublasLtMatmulDesc_t desc) const {
    if (g_.epilogue == Epilogue::Bias || g_.epilogue == Epilogue::BiasGeluAux)
      PLM_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                      &t_.bias, sizeof(t_.bias)));
    if (g_.epilogue == Epilogue::BGradA)
      PLM_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                      &t_.bias_grad, sizeof(t_.bias_grad)));
    if (g_.epilogue == Epilogue::BiasGeluAux || g_.epilogue == Epilogue::DGelu)
      PLM_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(
          desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &t_.aux, sizeof(t_.aux)));
  }
  /// The arguments every run uses (scratch D and bias gradient).
  const GemmArgs& args() const { return t_; }
  /// One run of `launch(args())` (true when it launched) from the caller's start.
  template <class Launch> bool run(Stream stream, Launch&& launch) {
    if (g_.beta != 0.0f && !g_.c)
      PLM_CHECK_CUDA(cudaMemcpyAsync(t_.d, g_.d, d_bytes_, cudaMemcpyDeviceToDevice, stream));
    else
      PLM_CHECK_CUDA(cudaMemsetAsync(t_.d, 0, d_bytes_, stream));
    PLM_CHECK_CUDA(cudaMemsetAsync(t_.bias_grad, 0, static_cast<std::size_t>(g_.m) * 4, stream));
    return launch(t_);
  }
  /// The last run's outputs become the reference; returns max |D|.
  double keepAsReference(Stream stream) {
    PLM_CHECK_CUDA(cudaMemcpyAsync(d_ref_, t_.d, d_bytes_, cudaMemcpyDeviceToDevice, stream));
    PLM_CHECK_CUDA(cudaMemcpyAsync(bias_ref_, t_.bias_grad, static_cast<std::size_t>(g_.m) * 4,
                                   cudaMemcpyDeviceToDevice, stream));
    bias_max_ = g_.epilogue == Epilogue::BGradA
                    ? maxAbsDiff(stream, bias_ref_, nullptr, DType::F32, 1, g_.m, g_.m, bits_)
                    : 0.0;
    return maxAbsDiff(stream, d_ref_, nullptr, g_.d_type, g_.m, g_.n, g_.ldd, bits_);
  }
  /// max |D - reference| of the last run.
  double diff(Stream stream) {
    return maxAbsDiff(stream, t_.d, d_ref_, g_.d_type, g_.m, g_.n, g_.ldd, bits_);
  }
  /// max |bias gradient - reference| of the last run (0 without the BGradA epilogue).
  double biasDiff(Stream stream) {
    return g_.epilogue == Epilogue::BGradA
               ? maxAbsDiff(stream, t_.bias_grad, bias_ref_, DType::F32, 1, g_.m, g_.m, bits_)
               : 0.0;
  }
  double biasMax() const { return bias_max_; }

 private:
  GemmArgs g_, t_;
  std::size_t d_bytes_;
  Scratch scratch_;
  void *d_ref_ = nullptr, *bias_ref_ = nullptr;
  unsigned* bits_ = nullptr;
  double bias_max_ = 0;
};

// One algorithm the plan may run: the heuristic's, or a split-K variant of one of them.
struct Candidate {
  cublasLtMatmulAlgo_t algo{};
  int splits = 1;
  bool bias_pass = false;  // on plain_desc, with biasGradPass
  bool streamk = false;    // CUTLASS's stream-K kernel (gemm_streamk_sm90a.cu), with biasGradPass
  int base = 0;            // index in the heuristic's list it came from
};

// The weight-gradient layout the CUTLASS stream-K kernel takes: D (fp32) = alpha A^T B + beta C.
detail::StreamKProblem streamKProblem(const GemmArgs& g) {
  detail::StreamKProblem p;
  p.m = g.m;
  p.n = g.n;
  p.k = g.k;
  p.a = g.a;
  p.lda = g.lda;
  p.b = g.b;
  p.ldb = g.ldb;
  p.d = static_cast<float*>(g.d);
  p.ldd = g.ldd;
  p.c = static_cast<const float*>(g.c ? g.c : g.d);
  p.ldc = g.c ? g.ldc : g.ldd;
  p.alpha = g.alpha;
  p.beta = g.beta;
  return p;
}

bool streamKEligible(const GemmArgs& g) {
  return splitKState().streamk_allowed && detail::streamKCompiled() && splitEligible(g) &&
         (g.epilogue != Epilogue::BGradA || biasPassTakes(g)) && g.trans_a && !g.trans_b &&
         g.d_type == DType::F32 && detail::streamKSupports(streamKProblem(g));
}

}  // namespace

struct Gemm::Impl {
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;
  std::size_t workspace_bytes = 0;
  std::map<PlanKey, Plan> plans;

  std::string device = deviceTag();
  int sms = smCount();

  // CUTLASS stream-K's own workspace (it clears its flags there before each kernel), grown on
  // first use; never during a CUDA graph capture.
  void* streamk_workspace = nullptr;
  std::size_t streamk_bytes = 0;

  bool streamKWorkspace(std::size_t bytes, Stream stream) {
    if (bytes <= streamk_bytes) return true;
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(stream, &capture) != cudaSuccess ||
        capture != cudaStreamCaptureStatusNone) {
      cudaGetLastError();
      return false;
    }
    PLM_CHECK_CUDA(cudaDeviceSynchronize());  // the old one may still be in use
    if (streamk_workspace) cudaFree(streamk_workspace);
    streamk_workspace = nullptr;
    streamk_bytes = 0;
    if (cudaMalloc(&streamk_workspace, bytes) != cudaSuccess) {
      cudaGetLastError();
      streamk_workspace = nullptr;
      return false;
    }
    streamk_bytes = bytes;
    return true;
  }

  // The stream-K candidate for g where the kernel is built and takes it; false otherwise.
  bool streamKOf(const GemmArgs& g, Stream stream, Candidate& out) {
    if (!streamKEligible(g)) return false;
    if (!streamKWorkspace(
            std::max<std::size_t>(detail::streamKWorkspaceBytes(streamKProblem(g)), 256), stream))
      return false;
    out = Candidate{};
    out.streamk = true;
    return true;
  }

  void* biasPartials() { return static_cast<char*>(workspace) + workspace_bytes; }

  // The heuristic's algorithms for plan p's layouts under desc (bf16), best first; empty when
  // it has none.
  std::vector<Candidate> heuristic(const Plan& p, cublasLtMatmulDesc_t desc, int count,
                                   bool bias_pass = false) {
    cublasLtMatmulPreference_t pref = nullptr;
    PLM_CHECK_CUBLAS(cublasLtMatmulPreferenceCreate(&pref));
    PLM_CHECK_CUBLAS(cublasLtMatmulPreferenceSetAttribute(
        pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_bytes, sizeof(workspace_bytes)));
    keepPartialSumsInFp32(pref, p.d);
    if (p.fp8) askFp8Alignment(pref);  // the autotune's candidates take the plan's operands too
    std::vector<cublasLtMatmulHeuristicResult_t> results(std::max(count, 1));
    int found = 0;
    cublasStatus_t status =
        cublasLtMatmulAlgoGetHeuristic(handle, desc, p.a, p.b, p.c, p.d, pref,
                                       static_cast<int>(results.size()), results.data(), &found);
    cublasLtMatmulPreferenceDestroy(pref);
    if (status != CUBLAS_STATUS_SUCCESS) found = 0;
    std::vector<Candidate> out;
    for (int i = 0; i < found; ++i) {
      Candidate c;
      c.algo = results[i].algo;
      c.bias_pass = bias_pass;
      c.base = i;
      std::int32_t splits = 1;
      std::size_t written = 0;
      if (cublasLtMatmulAlgoConfigGetAttribute(&c.algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splits,
                                               sizeof(splits), &written) == CUBLAS_STATUS_SUCCESS)
        c.splits = std::max(1, static_cast<int>(splits));
      out.push_back(c);
    }
    return out;
  }

  // The heuristic's candidates for plan p (bf16), best first.
  std::vector<Candidate> candidates(const Plan& p, int count) {
    return heuristic(p, p.desc, count);
  }

  // The same bf16 GEMM as p.desc without its epilogue (BGradA plans whose split-K variants
  // cuBLASLt offers only without it), made on first use.
  cublasLtMatmulDesc_t plainDesc(Plan& p, const GemmArgs& g) {
    if (p.plain_desc) return p.plain_desc;
    PLM_CHECK_CUBLAS(cublasLtMatmulDescCreate(&p.plain_desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    cublasOperation_t op_lt_a = g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
    cublasOperation_t op_lt_b = g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
    PLM_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(p.plain_desc, CUBLASLT_MATMUL_DESC_TRANSA,
                                                    &op_lt_a, sizeof(op_lt_a)));
    PLM_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(p.plain_desc, CUBLASLT_MATMUL_DESC_TRANSB,
                                                    &op_lt_b, sizeof(op_lt_b)));
    return p.plain_desc;
  }

  // c with K in `splits` parts and a deterministic reduction cuBLASLt accepts for its
  // descriptor: INPLACE for fp32 D (the parts add into D in a fixed order kept by counters in
  // the workspace; a bf16 D would round each part), else COMPUTE_TYPE (fp32 parts in the
  // workspace, summed by a separate kernel).  False when the algorithm cannot split, refuses
  // both, or needs more workspace than there is.
  bool withSplits(const Plan& p, const GemmArgs& g, Candidate& c, int splits) {
    if (!equalParts(g, splits)) return false;
    std::int32_t support = 0;
    std::uint32_t mask = 0;
    std::size_t written = 0;
    if (cublasLtMatmulAlgoCapGetAttribute(&c.algo, CUBLASLT_ALGO_CAP_SPLITK_SUPPORT, &support,
                                          sizeof(support), &written) != CUBLAS_STATUS_SUCCESS ||
        support == 0)
      return false;
    if (cublasLtMatmulAlgoCapGetAttribute(&c.algo, CUBLASLT_ALGO_CAP_REDUCTION_SCHEME_MASK, &mask,
                                          sizeof(mask), &written) != CUBLAS_STATUS_SUCCESS)
      return false;
    const cublasLtMatmulDesc_t desc = c.bias_pass ? p.plain_desc : p.desc;
    std::vector<std::uint32_t> schemes;
    if (g.d_type == DType::F32) schemes.push_back(CUBLASLT_REDUCTION_SCHEME_INPLACE);
    schemes.push_back(CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE);
    for (std::uint32_t scheme : schemes) {
      if ((mask & scheme) == 0) continue;
      cublasLtMatmulAlgo_t algo = c.algo;
      const std::int32_t s = splits;
      if (cublasLtMatmulAlgoConfigSetAttribute(&algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &s,
                                               sizeof(s)) != CUBLAS_STATUS_SUCCESS ||
          cublasLtMatmulAlgoConfigSetAttribute(&algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME,
                                               &scheme, sizeof(scheme)) != CUBLAS_STATUS_SUCCESS)
        continue;
      cublasLtMatmulHeuristicResult_t check{};
      if (cublasLtMatmulAlgoCheck(handle, desc, p.a, p.b, p.c, p.d, &algo, &check) !=
              CUBLAS_STATUS_SUCCESS ||
          check.workspaceSize > workspace_bytes)
        continue;
      c.algo = algo;
      c.splits = splits;
      return true;
    }
    return false;
  }

  // The first of the heuristic's first `bases` candidates that takes `splits` parts (with the
  // plan's epilogue, else for BGradA without it and a bias pass); false when none does.
  bool splitOf(Plan& p, const GemmArgs& g, int splits, int bases, Candidate& out) {
    const bool plain = g.epilogue == Epilogue::BGradA;
    if (plain && !biasPassTakes(g)) return false;
    const cublasLtMatmulDesc_t desc = plain ? plainDesc(p, g) : p.desc;
    for (Candidate c : heuristic(p, desc, bases, plain))
      if (withSplits(p, g, c, splits)) {
        out = c;
        return true;
      }
    return false;
  }

  // The rule's choice (setGemmSplit): the forced split count; else under StreamK the stream-K
  // kernel where heuristic #0's tiles fill their last wave below 90%; else ruleSplits over
  // those tiles.  False when it says no split or nothing takes it.
  bool ruleChoice(Plan& p, const GemmArgs& g, Candidate& out, Stream stream = nullptr) {
    if (!splitEligible(g)) return false;
    int splits = splitKState().force.load();
    if (splits <= 1) {
      const auto first = heuristic(p, p.desc, 1);
      if (first.empty()) return false;
      int rows = 128, cols = 128;
      tileShape(first[0].algo, rows, cols);
      const std::int64_t tiles = ((g.n + rows - 1) / rows) * ((g.m + cols - 1) / cols);
      const std::int64_t waves = (tiles + sms - 1) / sms;
      if (splitKState().mode == GemmSplit::StreamK && tiles < 0.9 * waves * sms &&
          streamKOf(g, stream, out))
        return true;
      if (first[0].splits > 1) return false;  // it splits already
      splits = ruleSplits(tiles, g.k, sms);
    }
    if (splits <= 1) return false;
    return splitOf(p, g, splits, 8, out);
  }

  // Split-K variants for the autotune and the benchmark: each split count of kSplitCounts that
  // leaves K/s >= kMinSplitK, from each of the heuristic's first `bases` candidates that takes
  // it (for BGradA without the epilogue only where none takes it with), then CUTLASS's
  // stream-K kernel where it takes the call.
  std::vector<Candidate> splitVariants(Plan& p, const GemmArgs& g, int bases, Stream stream) {
    std::vector<Candidate> out;
    if (!splitEligible(g)) return out;
    const bool plain = g.epilogue == Epilogue::BGradA;
    const auto bases_list = plain && !biasPassTakes(g)
                                ? std::vector<Candidate>{}
                                : heuristic(p, plain ? plainDesc(p, g) : p.desc, bases, plain);
    for (int s : kSplitCounts) {
      if (g.k / s < kMinSplitK) break;
      for (Candidate c : bases_list)
        if (withSplits(p, g, c, s)) out.push_back(c);
    }
    Candidate streamk;  // last: the split variants keep their indices where it is not built
    if (streamKOf(g, stream, streamk)) out.push_back(streamk);
    return out;
  }

  // Everything the autotune times: the heuristic's list, then with split-K on the rule's
  // choice and the split variants.  A pure function of the shape, library and device.
  std::vector<Candidate> tuneCandidates(Plan& p, const GemmArgs& g, int count, Stream stream) {
    std::vector<Candidate> all = candidates(p, count);
    if (splitKState().mode == GemmSplit::Off || all.empty()) return all;
    Candidate rule;
    if (ruleChoice(p, g, rule, stream)) all.push_back(rule);
    for (const Candidate& c : splitVariants(p, g, 4, stream)) all.push_back(c);
    return all;
  }

  cublasStatus_t launch(const Plan& p, const GemmArgs& t, const Candidate& c, Stream stream) {
    if (c.streamk) {
      const detail::StreamKProblem sk = streamKProblem(t);
      if (detail::streamKWorkspaceBytes(sk) > streamk_bytes || !detail::streamKSupports(sk))
        return CUBLAS_STATUS_NOT_SUPPORTED;
      detail::streamKRun(stream, sk, streamk_workspace, streamk_bytes);
      if (t.epilogue == Epilogue::BGradA) biasGradPass(stream, t, biasPartials());
      return CUBLAS_STATUS_SUCCESS;
    }
    const cublasStatus_t status = cublasLtMatmul(
        handle, c.bias_pass ? p.plain_desc : p.desc, &t.alpha, t.b, p.a, t.a, p.b, &t.beta,
        t.c ? t.c : t.d, p.c, t.d, p.d, &c.algo, workspace, workspace_bytes, stream);
    if (status == CUBLAS_STATUS_SUCCESS && c.bias_pass && t.epilogue == Epilogue::BGradA)
      biasGradPass(stream, t, biasPartials());
    return status;
  }

  // Times every candidate on scratch outputs (mean of 5 launches after one warm-up; -1 when
  // cuBLASLt refuses it at launch).  Empty when scratch memory ran out.  Leaves the stream idle.
  std::vector<double> timeCandidates(const Plan& p, const GemmArgs& g, Stream stream,
                                     const std::vector<Candidate>& algos) {
    Scratch scratch;
    GemmArgs t = g;
    t.d = scratch.get(static_cast<std::size_t>(g.m) * g.ldd * typeBytes(g.d_type));
    if (g.beta != 0.0f && !g.c && t.d)
      PLM_CHECK_CUDA(cudaMemsetAsync(
          t.d, 0, static_cast<std::size_t>(g.m) * g.ldd * typeBytes(g.d_type), stream));
    if (g.epilogue == Epilogue::BiasGeluAux)
      t.aux = scratch.get(static_cast<std::size_t>(g.m) * g.ldaux * 2);
    if (g.epilogue == Epilogue::BGradA)
      t.bias_grad = scratch.get(static_cast<std::size_t>(g.m) * 4);
    if (!scratch.ok) return {};
    if (g.epilogue == Epilogue::Bias || g.epilogue == Epilogue::BiasGeluAux)
      PLM_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                      &t.bias, sizeof(t.bias)));
    if (g.epilogue == Epilogue::BGradA)
      PLM_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                      &t.bias_grad, sizeof(t.bias_grad)));
    if (g.epilogue == Epilogue::BiasGeluAux || g.epilogue == Epilogue::DGelu)
      PLM_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(
          p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &t.aux, sizeof(t.aux)));
    cudaEvent_t start, stop;
    PLM_CHECK_CUDA(cudaEventCreate(&start));
    PLM_CHECK_CUDA(cudaEventCreate(&stop));
    std::vector<double> ms(algos.size(), -1.0);
    const int reps = 5;
    for (std::size_t i = 0; i < algos.size(); ++i) {
      // Equal parts only, the heuristic's own split candidates included; the first stays the
      // reference.
      if (i > 0 && !equalParts(g, algos[i].splits)) continue;
      if (launch(p, t, algos[i], stream) != CUBLAS_STATUS_SUCCESS) continue;
      PLM_CHECK_CUDA(cudaEventRecord(start, stream));
      bool ok = true;
      for (int r = 0; r < reps && ok; ++r)
        ok = launch(p, t, algos[i], stream) == CUBLAS_STATUS_SUCCESS;
      PLM_CHECK_CUDA(cudaEventRecord(stop, stream));
      PLM_CHECK_CUDA(cudaEventSynchronize(stop));
      float elapsed = 0;
      PLM_CHECK_CUDA(cudaEventElapsedTime(&elapsed, start, stop));
      if (ok) ms[i] = elapsed / reps;
    }
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
    PLM_CHECK_CUDA(cudaStreamSynchronize(stream));  // scratch is freed on return
    return ms;
  }

  // A stored choice as a candidate for plan p's shape when it takes it (cuBLASLt's check, the
  // stream-K kernel's own), else false.
  bool storedTakes(Plan& p, const GemmArgs& g, const TuneState::Choice& c, Stream stream,
                   Candidate& out) {
    if (c.streamk) return streamKOf(g, stream, out);
    if (c.bias_pass && (g.epilogue != Epilogue::BGradA || !biasPassTakes(g))) return false;
    if (!equalParts(g, c.splits)) return false;
    const cublasLtMatmulDesc_t desc = c.bias_pass ? plainDesc(p, g) : p.desc;
    cublasLtMatmulHeuristicResult_t check{};
    if (cublasLtMatmulAlgoCheck(handle, desc, p.a, p.b, p.c, p.d, &c.algo, &check) !=
            CUBLAS_STATUS_SUCCESS ||
        check.workspaceSize > workspace_bytes)
      return false;
    out = Candidate{};
    out.algo = c.algo;
    out.splits = c.splits;
    out.bias_pass = c.bias_pass;
    return true;
  }

  void choose(Plan& p, const Candidate& c) {
    p.algo = c.algo;
    p.bias_pass = c.bias_pass;
    p.splits = c.splits;
    p.streamk = c.streamk;
  }

  // The fastest candidate (by `ms`) whose output agrees with heuristic #0's, or -1 when none
  // ran.  Each is checked once from the caller's D: a split-K or epilogue variant that computes
  // something else (a cuBLASLt split-K candidate accumulating into fp32 D with the bias-gradient
  // epilogue did, on an H200 with CUDA 13) is logged and passed over.  Agreement: max |D - D0|
  // within 2% of max |D0| for bf16 D (a rounding or two apart), 0.1% for fp32 D, the same for
  // the bias gradient.  Leaves the stream idle.
  int agreeingFastest(const Plan& p, const GemmArgs& g, Stream stream,
                      const std::vector<Candidate>& algos, const std::vector<double>& ms) {
    std::vector<int> order;
    for (std::size_t i = 0; i < ms.size(); ++i)
      if (ms[i] > 0) order.push_back(static_cast<int>(i));
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return ms[a] < ms[b]; });
    if (order.empty() || order.front() == 0) return order.empty() ? -1 : 0;
    CandidateRun check(g);
    if (!check.ok()) return ms[0] > 0 ? 0 : -1;  // no memory to check: the heuristic's choice
    check.bind(p.desc);
    auto runOnce = [&](int i) {
      return check.run(stream, [&](const GemmArgs& a) {
        return launch(p, a, algos[i], stream) == CUBLAS_STATUS_SUCCESS;
      });
    };
    if (ms[0] <= 0 || !runOnce(0)) return order.front();  // no reference: trust the timing
    const double d_max = check.keepAsReference(stream);
    const double tol = g.d_type == DType::F32 ? 1e-3 : 2e-2;
    for (int i : order) {
      if (i == 0) return 0;
      if (!runOnce(i)) continue;
      const double dd = check.diff(stream), db = check.biasDiff(stream);
      if (dd <= tol * d_max && db <= 1e-3 * check.biasMax()) return i;
      log::warn(
          "gemm autotune: M=%lld N=%lld K=%lld candidate #%d (%d splits%s) differs from "
          "the heuristic's first choice by %.3g in D (max |D| %.3g), %.3g in the bias "
          "gradient; passed over",
          static_cast<long long>(g.m), static_cast<long long>(g.n), static_cast<long long>(g.k), i,
          algos[i].splits, algos[i].streamk ? ", stream-K" : "", dd, d_max, db);
    }
    return 0;
  }

  // train.gemm_autotune: replaces the heuristic's first choice in p by the cached or the
  // fastest candidate.  Inside a CUDA graph capture (no timing possible) p keeps the first.
  void autotune(Plan& p, const GemmArgs& g, Stream stream) {
    TuneState& s = tuneState();
    std::lock_guard<std::mutex> lock(s.mutex);
    // Split-K adds variants after the heuristic's list: an index means another algorithm then.
    std::string key = tuneKey(g, device);
    if (splitKState().mode != GemmSplit::Off)
      key += ",split=" + std::to_string(static_cast<int>(splitKState().mode.load())) + "/" +
             std::to_string(splitKState().force.load());
    auto it = s.choices.find(key);
    if (it != s.choices.end()) {
      // Tuned on this bucket: the same algorithm where it takes this shape, else this shape is
      // tuned itself (and becomes the bucket's choice).
      Candidate stored;
      if (storedTakes(p, g, it->second, stream, stored)) {
        choose(p, stored);
        if (s.logged.insert(key).second) logChoice(g, it->second, 0, true);
        return;
      }
      // The bucket's choice splits K in parts this K does not divide into equal ones: the
      // heuristic's choice for this size rather than a tuning at every new token count.
      if (!equalParts(g, it->second.splits)) return;
    }
    const auto algos = tuneCandidates(p, g, s.candidates, stream);
    if (algos.empty()) return;
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(stream, &capture) != cudaSuccess ||
        capture != cudaStreamCaptureStatusNone) {
      cudaGetLastError();
      return;
    }
    const std::vector<double> ms = timeCandidates(p, g, stream, algos);
    if (ms.empty()) {
      if (s.logged.insert(key).second)
        log::warn(
            "gemm autotune: no device memory for scratch outputs (M=%lld N=%lld K=%lld); "
            "the heuristic's choice stays",
            static_cast<long long>(g.m), static_cast<long long>(g.n), static_cast<long long>(g.k));
      return;
    }
    TuneState::Choice c;
    c.heuristic_ms = ms[0];
    const int index = agreeingFastest(p, g, stream, algos, ms);
    if (index < 0) return;  // nothing ran: keep the first choice, tune no more
    c.index = index;
    c.tuned_ms = ms[index];
    c.algo = algos[index].algo;
    c.splits = algos[index].splits;
    c.bias_pass = algos[index].bias_pass;
    c.streamk = algos[index].streamk;
    choose(p, algos[c.index]);
    s.choices[key] = c;
    appendTuneFile(s, key, c);
    s.logged.insert(key);
    logChoice(g, c, static_cast<int>(algos.size()), false);
  }

  Plan& plan(const GemmArgs& g, Stream stream = nullptr) {
    PlanKey key{g.trans_a,
                g.trans_b,
                g.m,
                g.n,
                g.k,
                g.lda,
                g.ldb,
                g.ldd,
                static_cast<int>(g.d_type),
                static_cast<int>(g.epilogue),
                g.c ? g.ldc : -1,
                g.ldaux,
                g.beta != 0.0f,
                static_cast<int>(g.a_type),
                static_cast<int>(g.b_type),
                static_cast<int>(g.a_scaling),
                static_cast<int>(g.b_scaling),
                g.fast_accum,
                g.amax_d != nullptr};
    auto it = plans.find(key);
    if (it != plans.end()) return it->second;

    Plan p;
    p.fp8 = isFp8(g.a_type) || isFp8(g.b_type);
    if (p.fp8) checkFp8(g);
    PLM_CHECK_CUBLAS(cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    // Our B becomes cuBLASLt's A: stored row-major (K,N) = column-major (N,K) = what D^T needs.
    cublasOperation_t op_lt_a = g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
    cublasOperation_t op_lt_b = g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
    PLM_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_lt_a,
                                                    sizeof(op_lt_a)));
    PLM_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_lt_b,
                                                    sizeof(op_lt_b)));
    cublasLtEpilogue_t epi = ltEpilogue(g.epilogue);
    PLM_CHECK_CUBLAS(
        cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi)));
    if (g.epilogue == Epilogue::BiasGeluAux || g.epilogue == Epilogue::DGelu) {
      std::int64_t ld = g.ldaux;
      PLM_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD,
                                                      &ld, sizeof(ld)));
    }
    // Column-major layouts (rows, cols, ld) of the stored matrices.
    std::uint64_t a_rows = g.trans_b ? g.k : g.n, a_cols = g.trans_b ? g.n : g.k;
    std::uint64_t b_rows = g.trans_a ? g.m : g.k, b_cols = g.trans_a ? g.k : g.m;
    if (p.fp8) {
      // cuBLASLt's A is our B: its scales are our B's.
      cublasLtMatmulMatrixScale_t mode_lt_a = ltScaleMode(g.b_scaling);
      cublasLtMatmulMatrixScale_t mode_lt_b = ltScaleMode(g.a_scaling);
      PLM_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE,
                                                      &mode_lt_a, sizeof(mode_lt_a)));
      PLM_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE,
                                                      &mode_lt_b, sizeof(mode_lt_b)));
      setScalePointers(p, g);
      std::int8_t fast = g.fast_accum ? 1 : 0;
      PLM_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM,
                                                      &fast, sizeof(fast)));
      if (g.epilogue == Epilogue::Bias || g.epilogue == Epilogue::BiasGeluAux) {
        cudaDataType_t bias_type = CUDA_R_16BF;
        PLM_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE,
                                                        &bias_type, sizeof(bias_type)));
      }
      if (g.epilogue == Epilogue::BiasGeluAux || g.epilogue == Epilogue::DGelu) {
        // Stated, not left to the default (D's type): FP8 kernels have their own rules for it.
        cudaDataType_t aux_type = CUDA_R_16BF;
        PLM_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(
            p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE, &aux_type, sizeof(aux_type)));
      }
      if (g.amax_d) {
        PLM_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_AMAX_D_POINTER,
                                                        &g.amax_d, sizeof(g.amax_d)));
      }
    } else if (g.a_type != DType::BF16 || g.b_type != DType::BF16) {
      throw Error("plm::gpu::Gemm: A and B must both be bf16 or both FP8 (got " +
                  std::string(typeName(g.a_type)) + " and " + typeName(g.b_type) + ")");
    }
    PLM_CHECK_CUBLAS(cublasLtMatrixLayoutCreate(&p.a, cudaType(g.b_type), a_rows, a_cols, g.ldb));
    PLM_CHECK_CUBLAS(cublasLtMatrixLayoutCreate(&p.b, cudaType(g.a_type), b_rows, b_cols, g.lda));
    PLM_CHECK_CUBLAS(cublasLtMatrixLayoutCreate(&p.d, cudaType(g.d_type), g.n, g.m, g.ldd));
    PLM_CHECK_CUBLAS(
        cublasLtMatrixLayoutCreate(&p.c, cudaType(g.d_type), g.n, g.m, g.c ? g.ldc : g.ldd));

    cublasLtMatmulPreference_t pref = nullptr;
    PLM_CHECK_CUBLAS(cublasLtMatmulPreferenceCreate(&pref));
    PLM_CHECK_CUBLAS(cublasLtMatmulPreferenceSetAttribute(
        pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_bytes, sizeof(workspace_bytes)));
    keepPartialSumsInFp32(pref, p.d);
    if (p.fp8) askFp8Alignment(pref);
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(handle, p.desc, p.a, p.b, p.c, p.d, pref,
                                                           1, &result, &found);
    if (p.fp8 && g.amax_d && (status != CUBLAS_STATUS_SUCCESS || found == 0)) {
      // No kernel computes amax of a non-FP8 D here: take it from a pass over D instead.
      void* none = nullptr;
      PLM_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_AMAX_D_POINTER,
                                                      &none, sizeof(none)));
      p.amax_by_pass = true;
      status = cublasLtMatmulAlgoGetHeuristic(handle, p.desc, p.a, p.b, p.c, p.d, pref, 1, &result,
                                              &found);
    }
    cublasLtMatmulPreferenceDestroy(pref);
    if (status != CUBLAS_STATUS_SUCCESS || found == 0)
      throw Error("plm::gpu::Gemm: cuBLASLt has no algorithm for M=" + std::to_string(g.m) +
                  " N=" + std::to_string(g.n) + " K=" + std::to_string(g.k) + " A " +
                  typeName(g.a_type) + " B " + typeName(g.b_type) + " D " + typeName(g.d_type) +
                  " epilogue " + std::to_string(static_cast<int>(g.epilogue)) + " scaling " +
                  std::to_string(static_cast<int>(g.a_scaling)) + "/" +
                  std::to_string(static_cast<int>(g.b_scaling)) + " (cuBLAS status " +
                  std::to_string(static_cast<int>(status)) +
                  "); check leading dimensions (multiples of 8, 16 for FP8) and the epilogue's "
                  "data types");
    p.algo = result.algo;
    Candidate rule;
    if (tuneState().on)
      autotune(p, g, stream);  // FP8 too: its scale pointers are set; it has no split variants
    else if (!p.fp8 && splitKState().mode != GemmSplit::Off && ruleChoice(p, g, rule, stream))
      choose(p, rule);
    return plans.emplace(key, p).first->second;
  }

  ~Impl() {
    for (auto& [key, p] : plans) {
      cublasLtMatrixLayoutDestroy(p.a);
      cublasLtMatrixLayoutDestroy(p.b);
      cublasLtMatrixLayoutDestroy(p.c);
      cublasLtMatrixLayoutDestroy(p.d);
      cublasLtMatmulDescDestroy(p.desc);
      if (p.plain_desc) cublasLtMatmulDescDestroy(p.plain_desc);
    }
    if (workspace) cudaFree(workspace);
    if (streamk_workspace) cudaFree(streamk_workspace);
    if (handle) cublasLtDestroy(handle);
  }
};

Gemm::Gemm(std::size_t workspace_bytes) : impl_member(std::make_unique<Impl>()) {
  PLM_CHECK_CUBLAS(cublasLtCreate(&impl_member->handle));
  impl_member->workspace_bytes = workspace_bytes;
  // The bias pass's partial sums follow the part cuBLASLt is given.
  PLM_CHECK_CUDA(cudaMalloc(&impl_member->workspace, workspace_bytes + kBiasPartialBytes));
}

Gemm::~Gemm() = default;

std::size_t Gemm::numPlans() const { return impl_member->plans.size(); }

void Gemm::run(Stream stream, const GemmArgs& g) {
  if (g.m == 0 || g.n == 0) return;
  Plan& p = impl_member->plan(g, stream);
  if (g.epilogue == Epilogue::Bias || g.epilogue == Epilogue::BiasGeluAux) {
    PLM_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                    &g.bias, sizeof(g.bias)));
  }
  if (g.epilogue == Epilogue::BGradA) {
    PLM_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                    &g.bias_grad, sizeof(g.bias_grad)));
  }
  if (g.epilogue == Epilogue::BiasGeluAux || g.epilogue == Epilogue::DGelu) {
    PLM_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(
        p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &g.aux, sizeof(g.aux)));
  }
  if (!p.fp8) {
    Candidate c;
    c.algo = p.algo;
    c.splits = p.splits;
    c.bias_pass = p.bias_pass;
    c.streamk = p.streamk;
    PLM_CHECK_CUBLAS(impl_member->launch(p, g, c, stream));
    return;
  }
  setScalePointers(p, g);
  if (g.amax_d && !p.amax_by_pass)
    PLM_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_AMAX_D_POINTER,
                                                    &g.amax_d, sizeof(g.amax_d)));
  cublasStatus_t status = cublasLtMatmul(
      impl_member->handle, p.desc, &g.alpha, g.b, p.a, g.a, p.b, &g.beta, g.c ? g.c : g.d, p.c, g.d,
      p.d, &p.algo, impl_member->workspace, impl_member->workspace_bytes, stream);
  if (status != CUBLAS_STATUS_SUCCESS && p.fp8 && g.amax_d && !p.amax_by_pass) {
    // AMAX_D_POINTER is refused at launch for unsupported type combinations: drop it for this
    // plan and take max |D| from a pass over D.
    void* none = nullptr;
    PLM_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_AMAX_D_POINTER,
                                                    &none, sizeof(none)));
    p.amax_by_pass = true;
    status = cublasLtMatmul(impl_member->handle, p.desc, &g.alpha, g.b, p.a, g.a, p.b, &g.beta,
                            g.c ? g.c : g.d, p.c, g.d, p.d, &p.algo, impl_member->workspace,
                            impl_member->workspace_bytes, stream);
  }
  PLM_CHECK_CUBLAS(status);
  if (p.fp8 && g.amax_d && p.amax_by_pass)
    amaxFp8(stream, g.d, g.d_type, g.m, g.n, g.ldd, g.amax_d, false);
}

Gemm::TuneResult Gemm::tune(Stream stream, const GemmArgs& g) {
  TuneResult r;
  if (g.m == 0 || g.n == 0) return r;
  Plan& p = impl_member->plan(g, stream);
  const int count = std::max(tuneState().candidates, 1);
  const auto algos = impl_member->tuneCandidates(p, g, count, stream);
  r.candidates = static_cast<int>(algos.size());
  const std::vector<double> ms = impl_member->timeCandidates(p, g, stream, algos);
  if (ms.empty()) return r;
  r.heuristic_ms = ms[0];
  for (std::size_t i = 0; i < ms.size(); ++i)
    if (ms[i] > 0 && (r.tuned_ms < 0 || ms[i] < r.tuned_ms)) {
      r.tuned_ms = ms[i];
      r.tuned_index = static_cast<int>(i);
    }
  return r;
}

void setGemmAutotune(bool on, const std::string& cache_file, bool write_cache, int candidates) {
  TuneState& s = tuneState();
  std::lock_guard<std::mutex> lock(s.mutex);
  s.on = on;
  s.file = cache_file;
  s.write = write_cache;
  s.candidates = std::max(candidates, 1);
  s.choices.clear();  // the file's choices, not an earlier setting's
  s.logged.clear();
  if (on) loadTuneFile(s);
}

bool gemmAutotune() { return tuneState().on; }

GemmSplit parseGemmSplit(const std::string& name) {
  if (name == "off") return GemmSplit::Off;
  if (name == "splitk") return GemmSplit::SplitK;
  if (name == "streamk") return GemmSplit::StreamK;
  throw Error("train.gemm_split: `" + name + "` is not one of off, splitk, streamk");
}

void setGemmSplit(GemmSplit mode, int force_splits) {
  splitKState().mode = mode;
  splitKState().force = mode != GemmSplit::Off ? force_splits : 0;
}

GemmSplit gemmSplit() { return splitKState().mode; }

bool gemmStreamKCompiled() { return detail::streamKCompiled(); }

void setGemmStreamKAllowed(bool allowed) { splitKState().streamk_allowed = allowed; }

Gemm::PlanInfo Gemm::planInfo(Stream stream, const GemmArgs& args) {
  PlanInfo info;
  if (args.m == 0 || args.n == 0) return info;
  const Plan& p = impl_member->plan(args, stream);
  info.splits = p.splits;
  info.bias_pass = p.bias_pass;
  info.streamk = p.streamk;
  return info;
}

Gemm::SplitKReport Gemm::splitKReport(Stream stream, const GemmArgs& g) {
  SplitKReport report;
  if (g.m == 0 || g.n == 0 || isFp8(g.a_type) || isFp8(g.b_type)) return report;
  Impl& impl = *impl_member;
  Plan& p = impl.plan(g, stream);
  std::vector<Candidate> algos = impl.heuristic(p, p.desc, 1);
  if (algos.empty()) return report;
  std::vector<bool> rule_flag = {false};
  Candidate rule;
  if (impl.ruleChoice(p, g, rule, stream)) {
    algos.push_back(rule);
    rule_flag.push_back(true);
  }
  for (const Candidate& c : impl.splitVariants(p, g, 4, stream)) {
    algos.push_back(c);
    rule_flag.push_back(false);
  }
  const std::vector<double> ms = impl.timeCandidates(p, g, stream, algos);
  if (ms.empty()) return report;

  // Differences: each candidate once from the caller's D (as C when accumulating) against
  // heuristic #0 run the same way.
  CandidateRun check(g);
  if (!check.ok()) return report;
  check.bind(p.desc);
  auto runOnce = [&](const Candidate& c) {
    return check.run(stream, [&](const GemmArgs& a) {
      return impl.launch(p, a, c, stream) == CUBLAS_STATUS_SUCCESS;
    });
  };
  if (!runOnce(algos[0])) return report;
  report.ref_max = check.keepAsReference(stream);
  // Rows: heuristic #0, the rule's choice, then the fastest variant of each split count.
  std::map<int, std::size_t> fastest;  // split count -> index of its fastest variant
  for (std::size_t i = 1; i < algos.size(); ++i) {
    if (rule_flag[i]) continue;
    const int key = algos[i].streamk ? 0 : algos[i].splits;  // stream-K: a row of its own
    auto it = fastest.find(key);
    if (it == fastest.end())
      fastest[key] = i;
    else if (ms[i] > 0 && (ms[it->second] <= 0 || ms[i] < ms[it->second]))
      it->second = i;
  }
  std::vector<std::size_t> shown = {0};
  for (std::size_t i = 1; i < algos.size(); ++i)
    if (rule_flag[i]) shown.push_back(i);
  for (const auto& [splits, i] : fastest) shown.push_back(i);
  for (std::size_t i : shown) {
    SplitKRow row;
    row.splits = algos[i].splits;
    row.rule = rule_flag[i];
    row.bias_pass = algos[i].bias_pass;
    row.streamk = algos[i].streamk;
    row.base = algos[i].base;
    row.ms = ms[i];
    if (ms[i] > 0 && runOnce(algos[i])) {
      row.max_diff = check.diff(stream);
      row.max_bias_diff = check.biasDiff(stream);
    }
    report.rows.push_back(row);
  }
  PLM_CHECK_CUDA(cudaStreamSynchronize(stream));  // scratch is freed on return
  return report;
}

bool Gemm::amaxFromCublas(const GemmArgs& args) {
  if (!args.amax_d) return false;
  return !impl_member->plan(args).amax_by_pass;
}

// ---------------------------------------------------------------------------------------------
// Reference

namespace {

__device__ float geluTanh(float x) {
  const float c = 0.7978845608028654f;  // sqrt(2/pi)
  return 0.5f * x * (1.0f + tanhf(c * (x + 0.044715f * x * x * x)));
}

__device__ float geluTanhGrad(float x) {
  const float c = 0.7978845608028654f;
  float t = tanhf(c * (x + 0.044715f * x * x * x));
  return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * c * (1.0f + 3.0f * 0.044715f * x * x);
}

__device__ float loadBf16(const void* p, std::int64_t i) {
  return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
}

__device__ float load(const void* p, DType t, std::int64_t i) {
  return t == DType::BF16 ? loadBf16(p, i) : static_cast<const float*>(p)[i];
}

__device__ void store(void* p, DType t, std::int64_t i, float v) {
  if (t == DType::BF16)
    static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16(v);
  else
    static_cast<float*>(p)[i] = v;
}

// An operand element as the GEMM sees it: bf16, or an FP8 code times its scale_inv (element
// (row, k) of an operand stored (rows, K); FP8 operands are always stored that way).
__device__ float loadOperand(const void* p, DType t, std::int64_t i, const float* scale_inv,
                             Fp8ScaleMode scaling, std::int64_t row, std::int64_t k,
                             std::int64_t rows, std::int64_t kdim) {
  if (t == DType::BF16) return loadBf16(p, i);
  const __nv_fp8_storage_t code = static_cast<const std::uint8_t*>(p)[i];
  const float x =
      __half2float(__half(__nv_cvt_fp8_to_halfraw(code, t == DType::E4M3 ? __NV_E4M3 : __NV_E5M2)));
  if (scaling == Fp8ScaleMode::Tensor) return x * scale_inv[0];
  if (scaling == Fp8ScaleMode::Block1x128) {
    const std::int64_t ld = (rows + 3) / 4 * 4;
    return x * scale_inv[(k / 128) * ld + row];
  }
  const std::int64_t ld = ((kdim + 127) / 128 + 3) / 4 * 4;
  return x * scale_inv[(row / 128) * ld + k / 128];
}

__global__ void gemmReferenceKernel(GemmArgs g) {
  std::int64_t idx = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
  if (idx >= g.m * g.n) return;
  std::int64_t m = idx / g.n, n = idx % g.n;
  float acc = 0.0f;
  for (std::int64_t k = 0; k < g.k; ++k) {
    float a = loadOperand(g.a, g.a_type, g.trans_a ? k * g.lda + m : m * g.lda + k, g.a_scale_inv,
                          g.a_scaling, m, k, g.m, g.k);
    float b = loadOperand(g.b, g.b_type, g.trans_b ? n * g.ldb + k : k * g.ldb + n, g.b_scale_inv,
                          g.b_scaling, n, k, g.n, g.k);
    acc += a * b;
  }
  float v = g.alpha * acc;
  if (g.beta != 0.0f)
    v += g.beta * (g.c ? load(g.c, g.d_type, m * g.ldc + n) : load(g.d, g.d_type, m * g.ldd + n));
  const bool fp8 = g.a_type != DType::BF16;
  const DType bias_type = fp8 ? DType::BF16 : g.d_type;
  if (g.epilogue == Epilogue::Bias) v += load(g.bias, bias_type, n);
  if (g.epilogue == Epilogue::BiasGeluAux) {
    v += load(g.bias, bias_type, n);
    static_cast<__nv_bfloat16*>(g.aux)[m * g.ldaux + n] = __float2bfloat16(v);
    v = geluTanh(v);
  }
  if (g.epilogue == Epilogue::DGelu) v *= geluTanhGrad(loadBf16(g.aux, m * g.ldaux + n));
  store(g.d, g.d_type, m * g.ldd + n, v);
  if (g.amax_d) {
    const float stored = load(g.d, g.d_type, m * g.ldd + n);
    atomicMax(reinterpret_cast<unsigned*>(g.amax_d), __float_as_uint(stored) & 0x7fffffffu);
  }
}

// BGradA: bias_grad[m] = sum over k of op(A)[m][k].
__global__ void biasGradRowsOfAKernel(GemmArgs g) {
  std::int64_t m = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
  if (m >= g.m) return;
  float sum = 0.0f;
  for (std::int64_t k = 0; k < g.k; ++k)
    sum += loadOperand(g.a, g.a_type, g.trans_a ? k * g.lda + m : m * g.lda + k, g.a_scale_inv,
                       g.a_scaling, m, k, g.m, g.k);
  static_cast<float*>(g.bias_grad)[m] = sum;
}

}  // namespace

void gemmReference(Stream stream, const GemmArgs& g) {
  if (g.m == 0 || g.n == 0) return;
  const int threads = 256;
  if (g.epilogue == Epilogue::BGradA) {
    biasGradRowsOfAKernel<<<static_cast<unsigned>((g.m + threads - 1) / threads), threads, 0,
                            stream>>>(g);
    PLM_CHECK_CUDA(cudaGetLastError());
  }
  if (g.amax_d) PLM_CHECK_CUDA(cudaMemsetAsync(g.amax_d, 0, sizeof(float), stream));
  std::int64_t total = g.m * g.n;
  gemmReferenceKernel<<<static_cast<unsigned>((total + threads - 1) / threads), threads, 0,
                        stream>>>(g);
  PLM_CHECK_CUDA(cudaGetLastError());
}

}  // namespace plm::gpu
