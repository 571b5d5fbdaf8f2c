// cuBLASLt GEMM plans cached per shape, and the plain reference kernel they are checked against.
// Row-major D(M,N) = op(A) op(B) is run as column-major D^T(N,M) = op(B)^T op(A)^T: cuBLASLt's
// "A" is our B and its "B" is our A, its m is our N and its n our M.  For FP8 that makes our
// (A (M,K), B (N,K)) cuBLASLt's TN case, the only one Hopper's FP8 kernels offer, and our B's
// scales cuBLASLt's A scales.
#include "gpu/gemm.hpp"

#include "core/error.hpp"
#include "core/log.hpp"
#include "gpu/fp8.hpp"

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

namespace plm::gpu {

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
  // amax_d asked for and cuBLASLt's AMAX_D_POINTER refused (it is documented for FP8 D only):
  // max |D| then comes from a pass over D.
  bool amax_by_pass = false;
};

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
    int index = 0;
    double heuristic_ms = -1, tuned_ms = -1;
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

std::string tuneKey(const GemmArgs& g, const std::string& device) {
  std::ostringstream k;
  k << "m=" << g.m << ",n=" << g.n << ",k=" << g.k << ",ta=" << g.trans_a << ",tb=" << g.trans_b
    << ",lda=" << g.lda << ",ldb=" << g.ldb << ",ldd=" << g.ldd << ",ldc=" << (g.c ? g.ldc : -1)
    << ",ldaux=" << g.ldaux << ",beta=" << (g.beta != 0.0f) << ",a=" << typeName(g.a_type)
    << ",b=" << typeName(g.b_type) << ",d=" << typeName(g.d_type)
    << ",epi=" << static_cast<int>(g.epilogue) << ",lt=" << cublasLtGetVersion()
    << ",dev=" << device;
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
      cached ? " (from the cache file)"
             : (" of " + std::to_string(candidates) + " candidates").c_str());
}

void loadTuneFile(TuneState& s) {
  if (s.file.empty()) return;
  std::ifstream in(s.file);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    std::istringstream fields(line);
    std::string key;
    TuneState::Choice c;
    if (fields >> key >> c.index >> c.heuristic_ms >> c.tuned_ms && c.index >= 0)
      s.choices[key] = c;
  }
}

void appendTuneFile(const TuneState& s, const std::string& key, const TuneState::Choice& c) {
  if (s.file.empty() || !s.write) return;
  std::ofstream out(s.file, std::ios::app);
  if (!out) {
    log::warn("gemm autotune: cannot append to %s; tuned choices stay in memory", s.file.c_str());
    return;
  }
  out << key << ' ' << c.index << ' ' << c.heuristic_ms << ' ' << c.tuned_ms << '\n';
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

}  // namespace

struct Gemm::Impl {
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;
  std::size_t workspace_bytes = 0;
  std::map<PlanKey, Plan> plans;

  std::string device = deviceTag();

  // The heuristic's candidates for plan p (bf16), best first; empty when it has none.
  std::vector<cublasLtMatmulHeuristicResult_t> candidates(const Plan& p, int count) {
    cublasLtMatmulPreference_t pref = nullptr;
    PLM_CHECK_CUBLAS(cublasLtMatmulPreferenceCreate(&pref));
    PLM_CHECK_CUBLAS(cublasLtMatmulPreferenceSetAttribute(
        pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_bytes, sizeof(workspace_bytes)));
    std::vector<cublasLtMatmulHeuristicResult_t> results(std::max(count, 1));
    int found = 0;
    cublasStatus_t status =
        cublasLtMatmulAlgoGetHeuristic(handle, p.desc, p.a, p.b, p.c, p.d, pref,
                                       static_cast<int>(results.size()), results.data(), &found);
    cublasLtMatmulPreferenceDestroy(pref);
    if (status != CUBLAS_STATUS_SUCCESS) found = 0;
    results.resize(found);
    return results;
  }

  // Times every candidate on scratch outputs (mean of 5 launches after one warm-up; -1 when
  // cuBLASLt refuses it at launch).  Empty when scratch memory ran out.  Leaves the stream idle.
  std::vector<double> timeCandidates(const Plan& p, const GemmArgs& g, Stream stream,
                                     const std::vector<cublasLtMatmulHeuristicResult_t>& algos) {
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
      auto launch = [&] {
        return cublasLtMatmul(handle, p.desc, &t.alpha, t.b, p.a, t.a, p.b, &t.beta,
                              t.c ? t.c : t.d, p.c, t.d, p.d, &algos[i].algo, workspace,
                              workspace_bytes, stream);
      };
      if (launch() != CUBLAS_STATUS_SUCCESS) continue;
      PLM_CHECK_CUDA(cudaEventRecord(start, stream));
      bool ok = true;
      for (int r = 0; r < reps && ok; ++r) ok = launch() == CUBLAS_STATUS_SUCCESS;
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

  // train.gemm_autotune: replaces the heuristic's first choice in p by the cached or the
  // fastest candidate.  Inside a CUDA graph capture (no timing possible) p keeps the first.
  void autotune(Plan& p, const GemmArgs& g, Stream stream) {
    TuneState& s = tuneState();
    std::lock_guard<std::mutex> lock(s.mutex);
    const auto algos = candidates(p, s.candidates);
    if (algos.empty()) return;
    const std::string key = tuneKey(g, device);
    auto it = s.choices.find(key);
    if (it != s.choices.end()) {
      if (it->second.index < static_cast<int>(algos.size())) p.algo = algos[it->second.index].algo;
      if (s.logged.insert(key).second)
        logChoice(g, it->second, static_cast<int>(algos.size()), true);
      return;
    }
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
    for (std::size_t i = 0; i < ms.size(); ++i)
      if (ms[i] > 0 && (c.tuned_ms < 0 || ms[i] < c.tuned_ms)) {
        c.tuned_ms = ms[i];
        c.index = static_cast<int>(i);
      }
    if (c.tuned_ms < 0) return;  // nothing ran: keep the first choice, tune no more
    p.algo = algos[c.index].algo;
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
    if (p.fp8) {
      // The heuristic otherwise assumes 256-byte aligned operands and may choose a kernel that
      // refuses (CUBLAS_STATUS_NOT_SUPPORTED) the model's operands at launch: activations and
      // outputs are slices of workspaces, aligned to 16 bytes (FP8's requirement), not 256.
      const std::uint32_t align = 16;
      for (auto attr :
           {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
            CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES})
        PLM_CHECK_CUBLAS(cublasLtMatmulPreferenceSetAttribute(pref, attr, &align, sizeof(align)));
    }
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
    if (!p.fp8 && tuneState().on) autotune(p, g, stream);
    return plans.emplace(key, p).first->second;
  }

  ~Impl() {
    for (auto& [key, p] : plans) {
      cublasLtMatrixLayoutDestroy(p.a);
      cublasLtMatrixLayoutDestroy(p.b);
      cublasLtMatrixLayoutDestroy(p.c);
      cublasLtMatrixLayoutDestroy(p.d);
      cublasLtMatmulDescDestroy(p.desc);
    }
    if (workspace) cudaFree(workspace);
    if (handle) cublasLtDestroy(handle);
  }
};

Gemm::Gemm(std::size_t workspace_bytes) : impl_member(std::make_unique<Impl>()) {
  PLM_CHECK_CUBLAS(cublasLtCreate(&impl_member->handle));
  impl_member->workspace_bytes = workspace_bytes;
  PLM_CHECK_CUDA(cudaMalloc(&impl_member->workspace, workspace_bytes));
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
  if (p.fp8) {
    setScalePointers(p, g);
    if (g.amax_d && !p.amax_by_pass)
      PLM_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_AMAX_D_POINTER,
                                                      &g.amax_d, sizeof(g.amax_d)));
  }
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
  if (g.m == 0 || g.n == 0 || isFp8(g.a_type) || isFp8(g.b_type)) return r;
  Plan& p = impl_member->plan(g, stream);
  const int count = std::max(tuneState().candidates, 1);
  const auto algos = impl_member->candidates(p, count);
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
