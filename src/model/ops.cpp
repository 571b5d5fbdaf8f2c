// The dispatch points (ops.hpp): portable Kokkos kernels for fp32/fp64 handles, the CUDA
// specialisations of src/gpu/ for bf16 handles.
//
// GEMMs on the CUDA path are written in row-major terms (gpu/gemm.hpp): a Linear layer
// y = x W^T + b is (T, out) = (T, in) (out, in)^T; its input gradient is dy W and its weight
// gradient dy^T x, with the bias gradient from the same GEMM's BGRADB epilogue (written to
// scratch and added, since the epilogue overwrites).  Residual adds ride on the GEMM's C operand,
// bias and GELU on its epilogue.
#include "model/ops.hpp"

#include "core/error.hpp"
#include "core/log.hpp"
#include "core/trace.hpp"
#include "model/context_parallel.hpp"
#include "model/cross_entropy.hpp"
#include "model/embedding.hpp"
#include "model/fp8_gemm.hpp"
#include "model/gelu.hpp"
#include "model/gemm.hpp"
#include "model/layer_norm.hpp"
#include "model/linear.hpp"
#include "model/rotary.hpp"
#include "model/tensor_table.hpp"
#include "plm/plm_config.hpp"

#if PLM_HAVE_CUDA
#include "gpu/cudnn_attention.hpp"
#if PLM_FP8_CUDA
#include "gpu/fp8.hpp"
#endif
#include "gpu/flash_attention.hpp"
#include "gpu/fused.hpp"
#include "gpu/gemm.hpp"
#include "gpu/layer_norm.hpp"
#include "gpu/ring_attention.hpp"

#include <cuda_runtime.h>
#endif

#include <array>
#include <cmath>
#include <cstdlib>
#include <map>
#include <string>
#include <unordered_map>

namespace plm::model {

// ---- handles -------------------------------------------------------------------------------

std::size_t sizeOf(DType d) { return d == DType::F64 ? 8 : d == DType::F32 ? 4 : 2; }

const char* dtypeName(DType d) {
  return d == DType::F64 ? "fp64" : d == DType::F32 ? "fp32" : "bf16";
}

namespace {

template <class E> DType tagOf() {
  if constexpr (std::is_same_v<E, float>) return DType::F32;
  if constexpr (std::is_same_v<E, double>) return DType::F64;
  return DType::BF16;
}

void expect(DType have, DType want, const char* what) {
  if (have != want)
    throw Error(std::string("plm::model: ") + what + " is " + dtypeName(have) + ", expected " +
                dtypeName(want) + " (a bug in the orchestration)");
}

}  // namespace

Mat Mat::columns(std::int64_t first, std::int64_t count) const {
  Mat m = *this;
  m.data = static_cast<char*>(data) + first * static_cast<std::int64_t>(sizeOf(dtype));
  m.cols = count;
  return m;
}

template <class E> E* Mat::ptr() const {
  expect(dtype, tagOf<E>(), "a matrix");
  return static_cast<E*>(data);
}

template <class E> View2<E> Mat::view() const {
  expect(dtype, tagOf<E>(), "a matrix");
  if (ld != cols)
    throw Error("plm::model: a strided matrix reached a portable kernel (a bug in the layout)");
  return View2<E>(static_cast<E*>(data), rows, cols);
}

template <class E> E* Vec::ptr() const {
  expect(dtype, tagOf<E>(), "a vector");
  return static_cast<E*>(data);
}

template <class E> View1<E> Vec::view() const {
  if (data == nullptr) return View1<E>();  // an absent bias (SwiGLU experts)
  expect(dtype, tagOf<E>(), "a vector");
  return View1<E>(static_cast<E*>(data), n);
}

template View2<float> Mat::view<float>() const;
template View2<double> Mat::view<double>() const;
template View1<float> Vec::view<float>() const;
template View1<double> Vec::view<double>() const;
template float* Mat::ptr<float>() const;
template double* Mat::ptr<double>() const;
template float* Vec::ptr<float>() const;
template double* Vec::ptr<double>() const;

bool Qkv::fused() const {
  const auto step = static_cast<std::int64_t>(q.cols * sizeOf(q.dtype));
  return q.ld == 3 * q.cols && static_cast<char*>(k.data) == static_cast<char*>(q.data) + step &&
         static_cast<char*>(v.data) == static_cast<char*>(q.data) + 2 * step;
}

Precision parsePrecision(const std::string& name) {
  if (name == "fp32") return Precision::Fp32;
  if (name == "bf16") return Precision::Bf16;
  if (name == "fp8") return Precision::Fp8;
  throw collectiveError(
      "precision '" + name +
      "' is not one of fp32, bf16, fp8 (train.precision in a deck, --precision of plm embed)");
}

const char* precisionName(Precision p) {
  return p == Precision::Bf16 ? "bf16" : p == Precision::Fp8 ? "fp8" : "fp32";
}

Recompute parseRecompute(const std::string& name) {
  if (name == "none" || name == "false") return Recompute::None;
  if (name == "layer" || name == "true") return Recompute::Layer;
  if (name == "selective") return Recompute::Selective;
  throw collectiveError("model.recompute: '" + name +
                        "' is not a recomputation mode; use none, layer or selective");
}

const char* recomputeName(Recompute r) {
  return r == Recompute::Layer ? "layer" : r == Recompute::Selective ? "selective" : "none";
}

AttentionKernel parseAttentionKernel(const std::string& name) {
  if (name == "cudnn") return AttentionKernel::Cudnn;
  if (name == "cudnn-fwd") return AttentionKernel::CudnnForward;
  if (name == "flash") return AttentionKernel::Flash;
  if (name == "auto") return AttentionKernel::Auto;
  throw Error("attention kernel '" + name + "' is not one of auto, cudnn, cudnn-fwd, flash");
}

const char* attentionKernelName(AttentionKernel k) {
  return k == AttentionKernel::Cudnn          ? "cudnn"
         : k == AttentionKernel::CudnnForward ? "cudnn-fwd"
         : k == AttentionKernel::Flash        ? "flash"
                                              : "auto";
}

// ---- context -------------------------------------------------------------------------------

#if PLM_HAVE_CUDA
// The FP8 casts of activations and gradients are timed as a kind of their own, after the four
// public ones (kept out of ops.hpp's OpKind so that adding it recompiled nothing else).
constexpr int kFp8CastKind = static_cast<int>(OpKind::Count);
constexpr int kProfileKinds = kFp8CastKind + 1;

#if PLM_FP8_CUDA
/// An FP8 GEMM operand on the device: codes (row stride ld) and their scale_inv (one device
/// scalar, or the block scales of `scaling`).
struct Fp8Operand8 {
  const void* codes = nullptr;
  std::int64_t ld = 0;
  gpu::DType type = gpu::DType::E4M3;
  const float* scale_inv = nullptr;
  gpu::Fp8ScaleMode scaling = gpu::Fp8ScaleMode::Tensor;
  // A Block1x128 A operand whose rows are not a multiple of 8 (castFp8Block's split_tail): the
  // body's rows (the 8-row tail's codes follow them) and the tail's scales; -1: no tail.
  std::int64_t body = -1;
  const float* tail_scale_inv = nullptr;
};
#endif

struct OpContext::Cuda {
  gpu::Gemm gemm;
  std::unique_ptr<gpu::CudnnAttention> cudnn;  // built on first use
  bool cudnn_fallback_noted = false;
  double* loss = nullptr;  // device accumulator of crossEntropy
  bool profiling = false;
  std::vector<cudaEvent_t> events;
  std::vector<int> kinds;
  std::vector<int> layer_at;  // the layer each mark's interval belongs to (-1: outside the layers)
  std::size_t marks = 0;
  int layer = -1;
  double totals[kProfileKinds] = {};
  std::map<int, std::array<double, kProfileKinds>> by_layer;  // since resetLayerProfile
#if PLM_FP8_CUDA
  // The E4M3 transposed input X^T (in, T padded to 16) of each FP8 GEMM, written by the
  // forward's cast in the pass that writes X's codes and read by the weight-gradient GEMM, so
  // the backward does not cast X again.  `x` (data, rows, cols, ld) names the activation it was
  // cast from; a forward that does not keep it (evaluation) clears `valid`.  Grow-only.
  struct Fp8Kept {
    const void* x = nullptr;
    std::int64_t rows = 0, cols = 0, ld = 0;
    void* codes = nullptr;
    float* scales = nullptr;  // block scaling: X^T's 1x128 scale_inv, inside the codes' buffer
    std::size_t bytes = 0;
    bool valid = false;
    bool x_written = true;  // false: x's bf16 values were never written (fused GELU cast)
  };
  std::unordered_map<const Fp8GemmSlot*, Fp8Kept> fp8_kept;
  // An FP8 GEMM input cast by its producer: a LayerNorm (keyed by its gamma; delayed scaling)
  // or the FFN-in GEMM's GELU (keyed by that GEMM's slot; delayed and block scaling).
  // `fp8_reader_of` says which FP8 GEMM read the producer's output last time (learned by that
  // GEMM's forward from `last_producer`, the output of the op just before it), so that the producer
  // knows the scale and where the codes go; `fp8_precast` holds the codes waiting for that GEMM's
  // forward (consumed by it, dropped by any other FP8 forward, which reuses their scratch slot).
  // fp8.fused_cast: false turns it off.
  struct Producer {
    const void* y = nullptr;
    const void* id = nullptr;
  } last_producer;
  std::unordered_map<const void*, const Fp8GemmSlot*> fp8_reader_of;
  struct Fp8Precast {
    const Fp8GemmSlot* slot = nullptr;
    const void* x = nullptr;
    std::int64_t rows = 0, cols = 0, ld = 0;
    Fp8Operand8 codes;      // the GEMM's A operand as the producer cast it
    bool x_written = true;  // false: the bf16 x does not exist (only these codes and X^T)
  } fp8_precast;
#endif

  Cuda() {
    PLM_CHECK_CUDA(cudaMalloc(&loss, sizeof(double)));
    PLM_CHECK_CUDA(cudaMemset(loss, 0, sizeof(double)));  // crossEntropy may run before beginLoss
  }
  ~Cuda() {
    for (auto e : events) cudaEventDestroy(e);
    cudaFree(loss);
#if PLM_FP8_CUDA
    for (auto& kept : fp8_kept) cudaFree(kept.second.codes);
#endif
  }
  void collect() {
    if (marks < 2) return;
    PLM_CHECK_CUDA(cudaEventSynchronize(events[marks - 1]));
    for (std::size_t i = 1; i < marks; ++i) {
      float ms = 0;
      PLM_CHECK_CUDA(cudaEventElapsedTime(&ms, events[i - 1], events[i]));
      totals[kinds[i]] += ms;
      by_layer[layer_at[i]][kinds[i]] += ms;
    }
    // The next call starts a fresh interval: host time between calls is not any kernel's.
    marks = 0;
  }
};
#else
struct OpContext::Cuda {};
#endif

OpContext::OpContext(const ExecSpace& space) : space_member(space) {}

OpContext::~OpContext() = default;

OpContext::Cuda& OpContext::cuda() {
  if (!cuda_member) cuda_member = std::make_unique<Cuda>();
  return *cuda_member;
}

void* OpContext::scratch(int slot, std::size_t bytes) {
  if (static_cast<int>(scratch_member.size()) <= slot) scratch_member.resize(slot + 1);
  auto& s = scratch_member[slot];
  const std::size_t n = (bytes + sizeof(double) - 1) / sizeof(double);
  if (s.extent(0) < n) {
    s = View1<double>();
    s = View1<double>(Kokkos::view_alloc(Kokkos::WithoutInitializing, "plm::model::op_scratch"), n);
  }
  return s.data();
}

void OpContext::beginLoss() {
  host_loss = 0.0;
#if PLM_HAVE_CUDA
  if (cuda_member)
    PLM_CHECK_CUDA(
        cudaMemsetAsync(cuda_member->loss, 0, sizeof(double), space_member.cuda_stream()));
  mark(OpKind::Other);  // with profiling: the start of this call's first interval
#endif
}

double OpContext::endLoss() {
  double total = host_loss;
#if PLM_HAVE_CUDA
  if (cuda_member) {
    double device = 0.0;
    PLM_CHECK_CUDA(cudaMemcpyAsync(&device, cuda_member->loss, sizeof(double),
                                   cudaMemcpyDeviceToHost, space_member.cuda_stream()));
    PLM_CHECK_CUDA(cudaStreamSynchronize(space_member.cuda_stream()));
    if (cuda_member->profiling) cuda_member->collect();
    total += device;
  }
#endif
  return total;
}

void OpContext::forgetFp8Readers(const void* begin, std::size_t bytes) {
#if PLM_FP8_CUDA
  if (!cuda_member) return;
  auto& readers = cuda_member->fp8_reader_of;
  const auto* lo = static_cast<const char*>(begin);
  for (auto it = readers.begin(); it != readers.end();) {
    const auto* key = static_cast<const char*>(it->first);
    it = key >= lo && key < lo + bytes ? readers.erase(it) : std::next(it);
  }
#else
  (void)begin;
  (void)bytes;
#endif
}

void OpContext::setProfiling(bool on) {
#if PLM_HAVE_CUDA
  auto& c = cuda();
  c.profiling = on;
  c.marks = 0;
  for (double& t : c.totals) t = 0;
#else
  (void)on;
#endif
}

#if PLM_HAVE_CUDA
namespace {
constexpr const char* kProfileNames[] = {"gemm (cuBLASLt)", "attention",    "layernorm",
                                         "other fused",     "moe dispatch", "moe counts",
                                         "moe route",       "fp8 cast"};
static_assert(sizeof(kProfileNames) / sizeof(kProfileNames[0]) == kProfileKinds, "a name per kind");
}  // namespace
#endif

std::vector<std::pair<std::string, double>> OpContext::profile() {
  std::vector<std::pair<std::string, double>> out;
#if PLM_HAVE_CUDA
  auto& c = cuda();
  c.collect();
  for (int k = 0; k < kProfileKinds; ++k)  // the MoE and FP8 kinds only when they ran
    if (k <= static_cast<int>(OpKind::Other) || c.totals[k] > 0)
      out.emplace_back(kProfileNames[k], c.totals[k]);
#endif
  return out;
}

void OpContext::setProfileLayer([[maybe_unused]] int layer) {
#if PLM_HAVE_CUDA
  if (!cuda_member || !cuda_member->profiling || cuda_member->layer == layer) return;
  // Close the interval: kernels launched since the last mark (ops that do not mark) stay with
  // the layer that launched them, as "other fused".
  if (cuda_member->marks > 0) mark(OpKind::Other);
  cuda_member->layer = layer;
#endif
}

OpContext::LayerProfile OpContext::layerProfile() {
  LayerProfile out;
#if PLM_HAVE_CUDA
  auto& c = cuda();
  c.collect();
  bool ran[kProfileKinds] = {};
  for (const auto& [layer, ms] : c.by_layer)
    for (int k = 0; k < kProfileKinds; ++k) ran[k] = ran[k] || ms[k] > 0;
  std::vector<int> kinds;
  for (int k = 0; k < kProfileKinds; ++k)
    if (k <= static_cast<int>(OpKind::Other) || ran[k]) {
      kinds.push_back(k);
      out.kinds.emplace_back(kProfileNames[k]);
    }
  for (const auto& [layer, ms] : c.by_layer) {
    out.layers.push_back(layer);
    std::vector<double> row;
    for (int k : kinds) row.push_back(ms[k]);
    out.ms.push_back(std::move(row));
  }
#endif
  return out;
}

void OpContext::resetLayerProfile() {
#if PLM_HAVE_CUDA
  if (cuda_member) cuda_member->by_layer.clear();
#endif
}

void OpContext::mark(OpKind kind) {
#if PLM_HAVE_CUDA
#if PLM_FP8_CUDA
  // A producer's output is linked to the FP8 GEMM that reads it only by the very next op.
  if (cuda_member) cuda_member->last_producer = {};
#endif
  if (!cuda_member || !cuda_member->profiling) return;
  auto& c = *cuda_member;
  if (c.marks == c.events.size()) {
    cudaEvent_t e;
    PLM_CHECK_CUDA(cudaEventCreate(&e));
    c.events.push_back(e);
    c.kinds.push_back(0);
    c.layer_at.push_back(-1);
  }
  PLM_CHECK_CUDA(cudaEventRecord(c.events[c.marks], space_member.cuda_stream()));
  c.layer_at[c.marks] = c.layer;
  c.kinds[c.marks++] = static_cast<int>(kind);
#else
  (void)kind;
#endif
}

// ---- helpers -------------------------------------------------------------------------------

namespace {

bool isBf16(const Mat& m) { return m.dtype == DType::BF16; }

/// Calls f(T{}) with the portable element type of `d`.
template <class F> void portable(DType d, const char* op, F&& f) {
  if (d == DType::F32)
    f(float{});
  else if (d == DType::F64)
    f(double{});
  else
    throw Error(std::string("plm::model::") + op +
                ": bf16 compute needs the CUDA build (train.precision: bf16, doc/gpu.md)");
}

#if PLM_HAVE_CUDA
using gpu::bf16;

gpu::Stream streamOf(OpContext& ctx) { return ctx.space().cuda_stream(); }

template <class E> const E* cptr(const Mat& m) {
  expect(m.dtype, tagOf<E>(), "a matrix");
  return static_cast<const E*>(m.data);
}
template <class E> E* mptr(const Mat& m) {
  expect(m.dtype, tagOf<E>(), "a matrix");
  return static_cast<E*>(m.data);
}
template <class E> E* vptr(const Vec& v) {
  expect(v.dtype, tagOf<E>(), "a vector");
  return static_cast<E*>(v.data);
}

gpu::DType gemmType(DType d) {
  if (d == DType::F64) throw Error("plm::model: fp64 output on the bf16 GEMM path (a bug)");
  return d == DType::BF16 ? gpu::DType::BF16 : gpu::DType::F32;
}

struct Mm {
  bool ta = false, tb = false;
  std::int64_t m = 0, n = 0, k = 0;
  const void* a = nullptr;
  std::int64_t lda = 0;
  const void* b = nullptr;
  std::int64_t ldb = 0;
  const Mat* d = nullptr;
  float alpha = 1.0f;
  float beta = 0.0f;
  gpu::Epilogue epilogue = gpu::Epilogue::None;
  const void* bias = nullptr;
  void* aux = nullptr;
  std::int64_t ldaux = 0;
  void* bias_grad = nullptr;
  const void* c = nullptr;
  std::int64_t ldc = 0;
#if PLM_FP8_CUDA
  gpu::DType a_type = gpu::DType::BF16, b_type = gpu::DType::BF16;  // FP8: both E4M3/E5M2
  const float* a_scale_inv = nullptr;
  const float* b_scale_inv = nullptr;
  gpu::Fp8ScaleMode a_scaling = gpu::Fp8ScaleMode::Tensor, b_scaling = gpu::Fp8ScaleMode::Tensor;
#endif
};

void runGemm(OpContext& ctx, const Mm& x) {
  gpu::GemmArgs g;
  g.trans_a = x.ta;
  g.trans_b = x.tb;
  g.m = x.m;
  g.n = x.n;
  g.k = x.k;
  g.a = x.a;
  g.lda = x.lda;
  g.b = x.b;
  g.ldb = x.ldb;
  g.d = x.d->data;
  g.ldd = x.d->ld;
  g.d_type = gemmType(x.d->dtype);
  g.alpha = x.alpha;
  g.beta = x.beta;
  g.epilogue = x.epilogue;
  g.bias = x.bias;
  g.aux = x.aux;
  g.ldaux = x.ldaux;
  g.bias_grad = x.bias_grad;
  g.c = x.c;
  g.ldc = x.ldc;
#if PLM_FP8_CUDA
  g.a_type = x.a_type;
  g.b_type = x.b_type;
  g.a_scale_inv = x.a_scale_inv;
  g.b_scale_inv = x.b_scale_inv;
  g.a_scaling = x.a_scaling;
  g.b_scaling = x.b_scaling;
#endif
  ctx.cuda().gemm.run(streamOf(ctx), g);
  ctx.mark(OpKind::Gemm);
}

/// y (rows, out) = x W^T (+ epilogue).
Mm forwardGemm(const Mat& x, const Mat& w, const Mat& y) {
  Mm m;
  m.tb = true;
  m.m = x.rows;
  m.n = w.rows;
  m.k = x.cols;
  m.a = cptr<bf16>(x);
  m.lda = x.ld;
  m.b = cptr<bf16>(w);
  m.ldb = w.ld;
  m.d = &y;
  return m;
}

/// dw (out, in) = beta dw + dy^T x with db (out) += column sums of dy, through the BGRADB
/// epilogue.
void weightGradient(OpContext& ctx, const Mat& x, const Mat& dy, const Mat& dw, float* db,
                    float beta = 1.0f) {
  const std::int64_t out = dy.cols, in = x.cols;
  auto* bias_scratch = static_cast<float*>(ctx.scratch(0, (out + 64) * sizeof(float)));
  Mm m;
  m.ta = true;
  m.m = out;
  m.n = in;
  m.k = dy.rows;
  m.a = cptr<bf16>(dy);
  m.lda = dy.ld;
  m.b = cptr<bf16>(x);
  m.ldb = x.ld;
  m.d = &dw;
  m.beta = beta;
  m.epilogue = db ? gpu::Epilogue::BGradA : gpu::Epilogue::None;  // no bias: SwiGLU experts
  m.bias_grad = db ? bias_scratch : nullptr;
  runGemm(ctx, m);
  if (db) gpu::addInto(streamOf(ctx), db, bias_scratch, out);
  ctx.mark(OpKind::Other);
}

/// The output side of an input-gradient GEMM: dx (beta 1 when accumulating), the epilogue and
/// its aux (bf16 and FP8 dgrad alike).
void setInputGradientOutput(Mm& m, const Mat& dx, bool accumulate, gpu::Epilogue epilogue,
                            const Mat* aux) {
  m.d = &dx;
  m.beta = accumulate ? 1.0f : 0.0f;
  m.epilogue = epilogue;
  if (aux) {
    m.aux = aux->data;
    m.ldaux = aux->ld;
  }
}

/// dx = (accumulate ? dx : 0) + dy W, with an optional epilogue reading `aux`.
void inputGradient(OpContext& ctx, const Mat& dy, const Mat& w, const Mat& dx, bool accumulate,
                   gpu::Epilogue epilogue = gpu::Epilogue::None, const Mat* aux = nullptr) {
  Mm m;
  m.m = dy.rows;
  m.n = w.cols;
  m.k = dy.cols;
  m.a = cptr<bf16>(dy);
  m.lda = dy.ld;
  m.b = cptr<bf16>(w);
  m.ldb = w.ld;
  setInputGradientOutput(m, dx, accumulate, epilogue, aux);
  runGemm(ctx, m);
}

#if PLM_FP8_CUDA
// ---- FP8 GEMMs on the CUDA path (train.precision: fp8; doc/fp8.md) -------------------------
// The weight's E4M3 codes and their transpose were cast once per step (esm2.cpp).  Per call and
// per micro-batch, each Linear layer casts (doc/fp8.md, "Casts per micro-batch"):
//  - forward: X (T,in) -> E4M3 codes (scratch slot 20) and, in the same pass, X^T (in, T padded
//    to 16) into the GEMM's kept buffer (OpContext::Cuda::fp8_kept), which its weight-gradient
//    GEMM reads: X is cast once per forward, never again in the backward;
//  - backward: dY (T,out) -> E5M2 (hybrid) codes and dY^T (out, T padded) in one pass with its
//    amax and the bias gradient (column sums of the unquantised dY), shared by dgrad and wgrad.
// The scale is the slot's device scale (delayed: uploaded from Fp8Scaling each step, amax
// max-accumulated for its endStep) or the tensor's own amax (current).  The GEMMs run in
// Hopper's TN layout (gpu/fp8.hpp's table): forward A = X (T,in), B = W (out,in); dgrad A = dY
// (T,out), B = W^T (in,out); wgrad A = dY^T (out,T), B = X^T (in,T).

std::int64_t pad16(std::int64_t n) { return alignedElements(n); }

gpu::DType gpuFormat(fp8::Format f) {
  return f == fp8::Format::E4M3 ? gpu::DType::E4M3 : gpu::DType::E5M2;
}

void markFp8Cast(OpContext& ctx) { ctx.mark(static_cast<OpKind>(kFp8CastKind)); }

/// Zeroes the padding columns [rows, pad16(rows)) of transposed codes (cols, pad16(rows)): the
/// weight-gradient GEMM's K runs over the padded tokens; the cast writes the rest.
void zeroTokenPadding(OpContext& ctx, void* codes_t, std::int64_t rows, std::int64_t cols) {
  const std::int64_t ld = pad16(rows);
  if (ld != rows)
    PLM_CHECK_CUDA(cudaMemset2DAsync(
        static_cast<std::uint8_t*>(codes_t) + rows, static_cast<std::size_t>(ld), 0,
        static_cast<std::size_t>(ld - rows), static_cast<std::size_t>(cols), streamOf(ctx)));
}

bool blockScaling(const Fp8GemmSlot& s) { return s.scaling->config().recipe == Fp8Recipe::Block; }

/// Copies `rows` rows of `cols` elements of `bytes` each between row-strided device matrices.
void copyRows(OpContext& ctx, void* dst, std::int64_t ld_dst, const void* src, std::int64_t ld_src,
              std::int64_t rows, std::int64_t cols, std::size_t bytes) {
  PLM_CHECK_CUDA(cudaMemcpy2DAsync(
      dst, static_cast<std::size_t>(ld_dst) * bytes, src, static_cast<std::size_t>(ld_src) * bytes,
      static_cast<std::size_t>(cols) * bytes, static_cast<std::size_t>(rows),
      cudaMemcpyDeviceToDevice, streamOf(ctx)));
}

/// Runs the FP8 GEMM m whose A operand is `a`.  cuBLASLt's block-scaled GEMM wants M (the
/// tokens) in multiples of 8; where a 1x128 A was cast with a tail (rows not a multiple of 8),
/// the body's rows run as one GEMM straight into D (and C, aux), and the tail as an 8-row GEMM
/// on the tail's codes (zero rows past M) into scratch, of which the real rows are copied into
/// D (and the GELU's aux): C's tail rows (the residual, or D itself when accumulating) and a
/// dGELU's aux rows are copied in first.
void runFp8Gemm(OpContext& ctx, const Mm& m, const Fp8Operand8& a) {
  if (a.body < 0) return runGemm(ctx, m);
  const std::int64_t body = a.body, tail = m.m - body;
  PLM_REQUIRE(tail > 0 && tail < 8,
              "plm::model: an FP8 block tail of " + std::to_string(tail) + " rows (a bug)");
  if (body > 0) {
    Mm b = m;
    b.m = body;
    runGemm(ctx, b);
  }
  const Mat& d = *m.d;
  const std::size_t es = d.dtype == DType::BF16 ? 2 : 4;
  const Mat dt{ctx.scratch(36, 8 * static_cast<std::size_t>(m.n) * es), d.dtype, 8, m.n, m.n};
  auto row = [](const void* p, std::int64_t r, std::int64_t ld, std::size_t bytes) {
    return static_cast<const std::uint8_t*>(p) + static_cast<std::size_t>(r * ld) * bytes;
  };
  Mm t = m;
  t.m = 8;
  t.a = row(m.a, body, m.lda, 1);
  t.a_scale_inv = a.tail_scale_inv;
  t.d = &dt;
  if (m.beta != 0.0f) {
    copyRows(ctx, dt.data, dt.ld, m.c ? row(m.c, body, m.ldc, es) : row(d.data, body, d.ld, es),
             m.c ? m.ldc : d.ld, tail, m.n, es);
    t.c = nullptr;
    t.ldc = 0;
  }
  if (m.aux) {
    t.aux = ctx.scratch(37, 8 * static_cast<std::size_t>(m.n) * 2);
    t.ldaux = m.n;
    if (m.epilogue == gpu::Epilogue::DGelu)
      copyRows(ctx, t.aux, t.ldaux, row(m.aux, body, m.ldaux, 2), m.ldaux, tail, m.n, 2);
  }
  runGemm(ctx, t);
  copyRows(ctx, const_cast<std::uint8_t*>(row(d.data, body, d.ld, es)), d.ld, dt.data, dt.ld, tail,
           m.n, es);
  if (m.aux && m.epilogue == gpu::Epilogue::BiasGeluAux)
    copyRows(ctx, const_cast<std::uint8_t*>(row(m.aux, body, m.ldaux, 2)), m.ldaux, t.aux, t.ldaux,
             tail, m.n, 2);
  ctx.mark(OpKind::Other);
}

/// Where castOperand puts an operand's codes, and what else its pass does.
struct CastTo {
  Fp8Operand8* direct = nullptr;      // (rows, cols) codes, into scratch `scratch_base`
  Fp8Operand8* transposed = nullptr;  // (cols, rows padded to 16) codes
  float* col_sum = nullptr;           // += column sums of x (a bias gradient)
  int scratch_base = 20;
  void* transposed_at = nullptr;          // the transposed codes go here (the kept X^T) when given
  float* transposed_scales_at = nullptr;  // block scaling: and their scales here
  bool gelu = false;                      // x is a GELU's pre-activation: gelu(x) is what is cast
  void* gelu_out = nullptr;  // with gelu: bf16 gelu(x) also written here (optional, ld = cols)
};

/// The fields castFp8's and castFp8Block's arguments share: the bf16 input x and the outputs.
template <class Args> void castInputOf(Args& a, const Mat& x, const CastTo& to) {
  a.rows = x.rows;
  a.cols = x.cols;
  a.in = cptr<bf16>(x);
  a.in_type = gpu::DType::BF16;
  a.ld_in = x.ld;
  a.gelu = to.gelu;
  a.gelu_out = to.gelu_out;
  a.ld_gelu_out = x.cols;
}

/// Casts bf16 operand `o` of the slot's GEMM, x (rows, cols), with the slot's recipe: per-tensor
/// scales (delayed: the slot's device scale, its amax max-accumulated while recording; current:
/// the tensor's own amax first) or 1x128 blocks (block: E4M3, power-of-two scales; `direct`
/// with a zero-padded 8-row tail where rows is not a multiple of 8, runFp8Gemm's tail GEMM;
/// `transposed` with its own 1x128 blocks along the tokens).  The transposed copy's token
/// columns are zero-padded to 16: the weight-gradient GEMM's K runs over the padded tokens, as
/// FP8 GEMMs want K and leading dimensions in multiples of 16; the cast writes the rest.
void castOperand(OpContext& ctx, const Fp8GemmSlot& s, Fp8Operand o, const Mat& x,
                 const CastTo& to) {
  const Fp8Scaling& st = *s.scaling;
  const int k = static_cast<int>(o);
  const int base = to.scratch_base;
  if (to.direct) ctx.cuda().fp8_precast = {};  // its codes live in the scratch this may overwrite
  auto codes = [&](int slot, std::int64_t rows, std::int64_t ld) {
    return ctx.scratch(slot, static_cast<std::size_t>(rows * ld));
  };
  auto transposedCodes = [&] {
    void* t = to.transposed_at ? to.transposed_at : codes(base + 1, x.cols, pad16(x.rows));
    zeroTokenPadding(ctx, t, x.rows, x.cols);
    return t;
  };
  auto colSum = [&](auto& a) {
    if (!to.col_sum) return;
    a.col_sum = to.col_sum;
    a.col_sum_accumulate = true;
    a.workspace = ctx.scratch(base + 2, gpu::fp8ColSumWorkspace(x.rows, x.cols));
  };
  if (blockScaling(s)) {
    constexpr auto vec = gpu::Fp8ScaleMode::Block1x128;
    gpu::Fp8BlockCastArgs a;
    castInputOf(a, x, to);
    a.out_type = gpu::DType::E4M3;  // E4M3 both ways under block scaling
    a.scaling = vec;
    if (to.direct) {
      const gpu::BlockTailSplit split = gpu::blockTailSplit(x.rows, x.cols);
      a.ld_out = pad16(x.cols);
      a.out = codes(base, split.rows, a.ld_out);
      a.scale_inv = static_cast<float*>(
          ctx.scratch(base + 10, static_cast<std::size_t>(split.count) * sizeof(float)));
      a.split_tail = split.split();
      *to.direct = {a.out, a.ld_out, a.out_type, a.scale_inv, vec};
      if (split.split()) {
        to.direct->body = split.body;
        to.direct->tail_scale_inv = a.scale_inv + split.tail_scales;
      }
    }
    if (to.transposed) {
      a.ld_out_t = pad16(x.rows);
      a.out_t = transposedCodes();
      a.scale_inv_t =
          to.transposed_scales_at
              ? to.transposed_scales_at
              : static_cast<float*>(ctx.scratch(
                    base + 11,
                    static_cast<std::size_t>(gpu::blockScaleLayout(vec, x.cols, x.rows).count) *
                        sizeof(float)));
      *to.transposed = {a.out_t, a.ld_out_t, a.out_type, a.scale_inv_t, vec};
    }
    colSum(a);
    gpu::castFp8Block(streamOf(ctx), a);
    markFp8Cast(ctx);
    return;
  }
  gpu::Fp8CastArgs a;
  castInputOf(a, x, to);
  a.out_type = gpuFormat(st.format(o));
  if (to.direct) {
    a.ld_out = pad16(x.cols);
    a.out = codes(base, x.rows, a.ld_out);
    *to.direct = {a.out, a.ld_out, a.out_type, s.scaleInv(k)};
  }
  if (to.transposed) {
    a.ld_out_t = pad16(x.rows);
    a.out_t = transposedCodes();
    *to.transposed = {a.out_t, a.ld_out_t, a.out_type, s.scaleInv(k)};
  }
  colSum(a);
  a.scale_inv = s.scaleInv(k);
  if (st.config().recipe == Fp8Recipe::Current) {
    a.amax = s.amaxes + k;
    gpu::castFp8Current(streamOf(ctx), a, s.scale(k));
  } else {
    a.scale = s.scale(k);
    if (st.recording()) {
      a.amax = s.amaxes + k;
      a.amax_accumulate = true;
    }
    gpu::castFp8(streamOf(ctx), a);
  }
  markFp8Cast(ctx);
}

/// The slot's kept X^T buffer, grown to hold x's transpose and named after x; nullptr (and the
/// old one invalidated) where no weight-gradient GEMM will read it: evaluation passes (not
/// recording) and wgrad: bf16.
void* keepTransposedInput(OpContext& ctx, const Fp8GemmSlot& s, const Mat& x) {
  auto& kept = ctx.cuda().fp8_kept[&s];
  kept.valid = false;
  if (!s.scaling->recording() || s.scaling->config().wgrad != Fp8Wgrad::Fp8) return nullptr;
  const bool block = blockScaling(s);
  const auto bytes =
      block ? gpu::fp8BlockTensorBytes(gpu::Fp8ScaleMode::Block1x128, x.cols, pad16(x.rows))
            : static_cast<std::size_t>(x.cols * pad16(x.rows));
  if (kept.bytes < bytes) {
    PLM_CHECK_CUDA(cudaFree(kept.codes));  // cudaFree synchronises: only while growing
    kept.codes = nullptr;
    kept.bytes = 0;
    PLM_CHECK_CUDA(cudaMalloc(&kept.codes, bytes));
    kept.bytes = bytes;
  }
  kept.scales = block ? gpu::fp8BlockTensorScales(kept.codes, x.cols, pad16(x.rows)) : nullptr;
  kept.x = x.data;
  kept.rows = x.rows;
  kept.cols = x.cols;
  kept.ld = x.ld;
  kept.valid = true;
  kept.x_written = true;
  return kept.codes;
}

/// The kept X^T of the slot's last forward if it was cast from this very x; nullptr otherwise.
const void* keptTransposedInput(OpContext& ctx, const Fp8GemmSlot& s, const Mat& x) {
  const auto& all = ctx.cuda().fp8_kept;
  const auto it = all.find(&s);
  if (it == all.end()) return nullptr;
  const auto& kept = it->second;
  const bool same = kept.valid && kept.x == x.data && kept.rows == x.rows && kept.cols == x.cols &&
                    kept.ld == x.ld;
  if (!same && kept.x == x.data && !kept.x_written)
    throw Error(
        "plm::model: an FP8 weight-gradient GEMM needs X^T of a GELU output whose bf16 values were "
        "never written (its cast was fused into the GELU) and whose kept X^T is gone (a bug); "
        "fp8.fused_cast: false avoids it");
  return same ? kept.codes : nullptr;
}

void setFp8(Mm& m, const Fp8Operand8& a, const Fp8Operand8& b) {
  m.a = a.codes;
  m.lda = a.ld;
  m.a_type = a.type;
  m.a_scale_inv = a.scale_inv;
  m.b = b.codes;
  m.ldb = b.ld;
  m.b_type = b.type;
  m.b_scale_inv = b.scale_inv;
  m.a_scaling = a.scaling;
  m.b_scaling = b.scaling;
}

/// The weight's codes as the B operand: W (out, in) for the forward, W^T (in, out) for dgrad.
/// Under block scaling each copy carries its 128x128 scale_inv after its codes
/// (gpu::fp8BlockTensorScales; esm2.cpp's bindFp8Cuda lays them out so).
Fp8Operand8 weightCodes(const Fp8GemmSlot& s, const Mat& w, bool transposed) {
  const int k = static_cast<int>(Fp8Operand::Weight);
  const void* codes = transposed ? s.wt_codes : s.w_codes;
  const std::int64_t rows = transposed ? w.cols : w.rows, cols = transposed ? w.rows : w.cols;
  if (blockScaling(s))
    return {codes, cols, gpu::DType::E4M3, gpu::fp8BlockTensorScales(codes, rows, cols),
            gpu::Fp8ScaleMode::Block128x128};
  return {codes, cols, gpu::DType::E4M3, s.scaleInv(k)};
}

/// fp8.fused_cast: the producers (LayerNorm, the GELU pass) cast for the FP8 GEMM that reads
/// their output.
bool fusedFp8Cast(const Fp8GemmSlot& s) { return s.scaling->config().fused_cast; }

/// The FP8 GEMM that read the output of producer `id` last time, if the producer should cast
/// for it (delayed and block scaling: the scales do not need the whole tensor's amax first);
/// nullptr otherwise.
const Fp8GemmSlot* fp8ReaderOf(OpContext& ctx, const void* id) {
  const auto& all = ctx.cuda().fp8_reader_of;
  const auto it = all.find(id);
  if (it == all.end() || !fusedFp8Cast(*it->second) ||
      it->second->scaling->config().recipe == Fp8Recipe::Current)
    return nullptr;
  return it->second;
}

/// Names y as the output of producer `id` for the op that follows (after the producer's mark).
void noteFp8Producer(OpContext& ctx, const Mat& y, const void* id) {
  ctx.cuda().last_producer = {y.data, id};
}

/// The LayerNorm y = LN(x; gamma, beta) with, where an FP8 GEMM read the output of this
/// LayerNorm (these gamma) before and scales by delayed scaling, that GEMM's input cast fused
/// in: E4M3 codes into the forward's scratch, X^T into the kept buffer, the amax; the codes are
/// left in `fp8_precast` for that GEMM's forward.  false: nothing ran (the plain LayerNorm does).
template <class TX> bool layerNormFp8Cuda(OpContext& ctx, const TX* x, const Vec& gamma,
                                          const Vec& beta, double eps, const Mat& y,
                                          const Vec& mean, const Vec& rstd) {
  const Fp8GemmSlot* reader = fp8ReaderOf(ctx, gamma.data);
  if (!reader || y.ld != y.cols) return false;
  const Fp8GemmSlot& s = *reader;
  const Fp8Scaling& st = *s.scaling;
  if (st.config().recipe != Fp8Recipe::Delayed) return false;
  const int k = static_cast<int>(Fp8Operand::Input);
  gpu::LayerNormFp8Args q;
  q.out_type = gpuFormat(st.format(Fp8Operand::Input));
  q.ld_codes = pad16(y.cols);
  q.codes = ctx.scratch(20, static_cast<std::size_t>(y.rows * q.ld_codes));
  if (void* kept = keepTransposedInput(ctx, s, y)) {
    q.codes_t = kept;
    q.ld_codes_t = pad16(y.rows);
    zeroTokenPadding(ctx, kept, y.rows, y.cols);
  }
  q.scale = s.scale(k);
  q.scale_inv = s.scaleInv(k);
  if (st.recording()) {
    q.amax = s.amaxes + k;
    q.amax_accumulate = true;
  }
  gpu::layerNormForwardFp8(streamOf(ctx), x, vptr<float>(gamma), vptr<float>(beta), mptr<bf16>(y),
                           vptr<float>(mean), vptr<float>(rstd), y.rows, static_cast<int>(y.cols),
                           static_cast<float>(eps), q);
  const Fp8Operand8 codes{q.codes, q.ld_codes, q.out_type, s.scaleInv(k)};
  ctx.cuda().fp8_precast = {&s, y.data, y.rows, y.cols, y.ld, codes, true};
  return true;
}

/// y = x W^T + bias (+ epilogue / residual C) with FP8 operands; the bias is bf16.  In training,
/// x's transposed codes are kept for the weight-gradient GEMM.  Where the LayerNorm that wrote
/// x cast it already (layerNormFp8Cuda), its codes are used.
void fp8ForwardCuda(OpContext& ctx, const Mat& x, const Mat& w, const Vec& b, const Mat& y,
                    gpu::Epilogue epilogue, const Mat* aux, const Mat* residual) {
  const Fp8GemmSlot& s = *w.fp8;
  auto& c = ctx.cuda();
  if (c.last_producer.y && c.last_producer.y == x.data) c.fp8_reader_of[c.last_producer.id] = &s;
  const auto pre = c.fp8_precast;
  c.fp8_precast = {};
  Fp8Operand8 xq, xq_t;
  const bool precast = pre.slot == &s && pre.x == x.data && pre.rows == x.rows &&
                       pre.cols == x.cols && pre.ld == x.ld;
  if (!precast && pre.x == x.data && !pre.x_written)
    throw Error(
        "plm::model: an FP8 GEMM reads a GELU output whose bf16 values were never written (its "
        "cast was fused into the GELU for another GEMM; a bug); fp8.fused_cast: false avoids it");
  if (precast) {
    xq = pre.codes;
  } else {
    CastTo to;
    to.direct = &xq;
    to.transposed_at = keepTransposedInput(ctx, s, x);
    if (to.transposed_at) {
      to.transposed = &xq_t;
      to.transposed_scales_at = c.fp8_kept[&s].scales;
    }
    castOperand(ctx, s, Fp8Operand::Input, x, to);
  }
  Mm m;
  m.tb = true;
  m.m = x.rows;
  m.n = w.rows;
  m.k = x.cols;
  setFp8(m, xq, weightCodes(s, w, false));
  m.d = &y;
  if (b.empty()) {  // no bias: SwiGLU experts
    PLM_REQUIRE(epilogue == gpu::Epilogue::Bias,
                "plm::model: an FP8 GEMM epilogue without its bias (a bug)");
    m.epilogue = gpu::Epilogue::None;
  } else {
    expect(b.dtype, DType::BF16, "the bias of an FP8 GEMM (cuBLASLt takes it in bf16)");
    m.epilogue = epilogue;
    m.bias = b.data;
  }
  if (aux) {
    m.aux = aux->data;
    m.ldaux = aux->ld;
  }
  if (residual) {
    m.beta = 1.0f;
    m.c = residual->data;
    m.ldc = residual->ld;
  }
  runFp8Gemm(ctx, m, xq);
}

/// pre = x W^T + b, y = gelu(pre) with FP8 operands.  Where the FP8 GEMM that reads y is known
/// (delayed and block scaling), the GEMM writes only pre (Bias epilogue) and one pass applies
/// the GELU and casts y for that GEMM with its recipe: codes, X^T (kept), amax (delayed) or
/// block scales (block); y's bf16 values are then written only where no kept X^T stands in for
/// them (evaluation, wgrad: bf16).  Otherwise (the first micro-batch, current scaling) y is
/// written in bf16 and its reader casts it: by the GEMM's GELU+aux epilogue, or by the Bias
/// epilogue and one GELU pass under block scaling (cuBLASLt's GELU_AUX_BIAS is not known to take
/// block scales; test_gpu_fp8 checked Bias and dGELU) and under delayed scaling with fused casts
/// (the fused pass takes the GELU of the bf16 pre-activation, the epilogue of the fp32 one: a
/// bf16 rounding apart, so a resumed run's first micro-batch would leave the uninterrupted run;
/// test_fp8_moe's ResumesExactlyAndAtAnotherDegree on CUDA caught it).
void fp8LinearGeluCuda(OpContext& ctx, const Mat& x, const Mat& w, const Vec& b, const Mat& pre,
                       const Mat& y) {
  const Fp8GemmSlot* reader = fp8ReaderOf(ctx, w.fp8);
  const bool contiguous = y.ld == y.cols && pre.ld == pre.cols;
  if (!reader || !contiguous) {
    const bool gelu_pass =
        blockScaling(*w.fp8) || (contiguous && fusedFp8Cast(*w.fp8) &&
                                 w.fp8->scaling->config().recipe == Fp8Recipe::Delayed);
    if (gelu_pass) {
      fp8ForwardCuda(ctx, x, w, b, pre, gpu::Epilogue::Bias, nullptr, nullptr);
      gpu::Fp8CastArgs a;
      a.rows = pre.rows;
      a.cols = pre.cols;
      a.in = cptr<bf16>(pre);
      a.in_type = gpu::DType::BF16;
      a.ld_in = pre.ld;
      a.scale = w.fp8->scale(static_cast<int>(Fp8Operand::Input));  // read, unused: no codes
      a.gelu = true;
      a.gelu_out = mptr<bf16>(y);
      a.ld_gelu_out = y.ld;
      gpu::castFp8(streamOf(ctx), a);
      ctx.mark(OpKind::Other);
    } else {
      fp8ForwardCuda(ctx, x, w, b, y, gpu::Epilogue::BiasGeluAux, &pre, nullptr);
    }
    noteFp8Producer(ctx, y, w.fp8);
    return;
  }
  fp8ForwardCuda(ctx, x, w, b, pre, gpu::Epilogue::Bias, nullptr, nullptr);
  const Fp8GemmSlot& s = *reader;
  Fp8Operand8 codes, codes_t;
  CastTo to;
  to.direct = &codes;
  to.gelu = true;
  to.transposed_at = keepTransposedInput(ctx, s, y);
  if (to.transposed_at) {
    to.transposed = &codes_t;
    to.transposed_scales_at = ctx.cuda().fp8_kept[&s].scales;
  } else {
    to.gelu_out = y.data;
  }
  castOperand(ctx, s, Fp8Operand::Input, pre, to);  // clears fp8_precast
  // The kept X^T and the codes are named after y, the GEMM's input, not pre.
  if (to.transposed_at) ctx.cuda().fp8_kept[&s].x_written = false;
  ctx.cuda().fp8_precast = {&s, y.data, y.rows, y.cols, y.ld, codes, !to.transposed_at};
  noteFp8Producer(ctx, y, w.fp8);
}

/// dx = (accumulate ? dx : 0) + dY W (epilogue dGELU with aux = pre), dW (+)= dY^T X (fp32,
/// beta = dw_beta), db += column sums of dY.  wgrad: bf16 runs the bf16 weight-gradient GEMM.
/// X^T comes from the forward (kept) when it was cast from this x, else it is cast here.
void fp8BackwardCuda(OpContext& ctx, const Mat& x, const Mat& w, const Mat& dy, const Mat& dx,
                     bool accumulate, const Mat& dw, float dw_beta, float* db,
                     gpu::Epilogue epilogue = gpu::Epilogue::None, const Mat* aux = nullptr) {
  const Fp8GemmSlot& s = *w.fp8;
  const bool fp8_wgrad = s.scaling->config().wgrad == Fp8Wgrad::Fp8;
  const bool block = blockScaling(s);
  Fp8Operand8 dyq, dyq_t;
  CastTo to;
  to.direct = &dyq;
  if (fp8_wgrad) {
    to.transposed = &dyq_t;
    to.col_sum = db;
  }
  castOperand(ctx, s, Fp8Operand::Grad, dy, to);
  if (!dx.empty()) {
    Mm m;
    m.tb = true;
    m.m = dy.rows;
    m.n = w.cols;
    m.k = dy.cols;
    setFp8(m, dyq, weightCodes(s, w, true));
    // cuBLASLt's FP8 GEMM with the dGELU epilogue ran 2.5x slower than the bf16 one on an H200
    // (1.14-1.18 against 0.42-0.46 ms for 650M's FFN at 24k tokens, every FP8 recipe): the plain
    // FP8 GEMM, then dGELU in a pass over its bf16 output.
    const bool dgelu_pass = epilogue == gpu::Epilogue::DGelu && !accumulate && aux &&
                            aux->ld == aux->cols && dx.ld == dx.cols;
    PLM_REQUIRE(!dgelu_pass || (aux->rows == dx.rows && aux->cols == dx.cols),
                "plm::model: the dGELU pre-activation's shape is not dX's (a bug in the layout)");
    setInputGradientOutput(m, dx, accumulate, dgelu_pass ? gpu::Epilogue::None : epilogue,
                           dgelu_pass ? nullptr : aux);
    runFp8Gemm(ctx, m, dyq);
    if (dgelu_pass) geluBackward(ctx, *aux, dx, dx);
  }
  if (!fp8_wgrad) {  // high precision: the bf16 GEMM, the bias gradient from its epilogue
    weightGradient(ctx, x, dy, dw, db, dw_beta);
    return;
  }
  Fp8Operand8 xq_t;
  if (const void* kept = keptTransposedInput(ctx, s, x)) {
    const int k = static_cast<int>(Fp8Operand::Input);
    xq_t = {kept, pad16(x.rows), gpuFormat(s.scaling->format(Fp8Operand::Input)), s.scaleInv(k)};
    if (block) {
      xq_t.scale_inv = ctx.cuda().fp8_kept[&s].scales;
      xq_t.scaling = gpu::Fp8ScaleMode::Block1x128;
    }
  } else {
    CastTo to;
    to.transposed = &xq_t;
    to.scratch_base = 24;
    castOperand(ctx, s, Fp8Operand::Input, x, to);
  }
  Mm m;
  m.tb = true;
  m.m = dy.cols;
  m.n = x.cols;
  m.k = pad16(dy.rows);  // the zero-padded tokens add nothing
  setFp8(m, dyq_t, xq_t);
  m.d = &dw;
  m.beta = dw_beta;
  runGemm(ctx, m);
}
#endif

/// The kernels that run for this head_dim.  Auto, measured on the H100 (doc/performance.md,
/// 2026-11-25): cuDNN both ways from head_dim 64 (esm2_650m +3%), the own flash attention below
/// (esm2_8m/35m/150m, head_dim 16/24/32: cuDNN 9-30% slower end to end).
AttentionKernel resolveAttention(const OpContext& ctx, int head_dim) {
  if (ctx.attention_kernel != AttentionKernel::Auto) return ctx.attention_kernel;
  return head_dim >= 64 && gpu::cudnnAttentionAvailable() ? AttentionKernel::Cudnn
                                                          : AttentionKernel::Flash;
}

/// Runs one direction of cuDNN's attention; false (after a one-time note) where this build has
/// no cuDNN or cuDNN has no kernel for the shape, and the caller runs the own flash attention.
/// Both write lse with the same meaning (natural log-sum-exp of the scaled scores, (T, heads)),
/// so a cuDNN forward pairs with a flash backward.
bool cudnnAttention(OpContext& ctx, const gpu::FlashParams& fp, bool backward) {
  auto& c = ctx.cuda();
  auto fallback = [&](const std::string& why) {
    if (!c.cudnn_fallback_noted)
      log::warn("attention: %s; the own flash attention runs instead", why.c_str());
    c.cudnn_fallback_noted = true;
    return false;
  };
  if (!gpu::cudnnAttentionAvailable()) return fallback("this build has no cuDNN attention");
  if (!c.cudnn) c.cudnn = std::make_unique<gpu::CudnnAttention>(ctx.deterministic);
  const bool ran =
      backward ? c.cudnn->backward(streamOf(ctx), fp) : c.cudnn->forward(streamOf(ctx), fp);
  if (!ran) return fallback(c.cudnn->whyNot());
  return true;
}

/// The parameters both flash-attention directions share: the batch, q/k/v, o and lse.
gpu::FlashParams flashParams(const DeviceBatch& b, const Qkv& qkv, int heads, const Mat& o,
                             const Mat& lse) {
  gpu::FlashParams fp;
  fp.cu_seqlens = b.cu_seqlens.data();
  fp.num_seqs = b.num_seqs;
  fp.max_seqlen = b.max_seqlen;
  fp.total_tokens = b.tokens;
  fp.heads = heads;
  fp.head_dim = static_cast<int>(qkv.q.cols / heads);
  fp.softmax_scale = 1.0f;  // ESM-2 scales q before rotary
  fp.q = cptr<bf16>(qkv.q);
  fp.k = cptr<bf16>(qkv.k);
  fp.v = cptr<bf16>(qkv.v);
  fp.q_stride = qkv.q.ld;
  fp.k_stride = qkv.k.ld;
  fp.v_stride = qkv.v.ld;
  fp.o = mptr<bf16>(o);
  fp.o_stride = o.ld;
  fp.lse = mptr<float>(lse);
  return fp;
}
#endif

[[noreturn]] void noCuda(const char* op) {
  throw Error(std::string("plm::model::") + op +
              ": bf16 compute needs the CUDA build (train.precision: bf16, doc/gpu.md)");
}

template <class T> void gatherRowsPortable(const ExecSpace& space, const View2<T>& src,
                                           const View1<std::int32_t>& rows, const View2<T>& dst) {
  const int cols = static_cast<int>(dst.extent(1));
  Kokkos::parallel_for(
      "plm::model::gather_rows", FlatPolicy(space, 0, dst.extent(0)),
      KOKKOS_LAMBDA(const std::int64_t m) {
        for (int c = 0; c < cols; ++c) dst(m, c) = src(rows(m), c);
      });
}

template <class T> void scatterRowsPortable(const ExecSpace& space, const View2<T>& src,
                                            const View1<std::int32_t>& rows, const View2<T>& dst) {
  Kokkos::deep_copy(space, dst, T(0));
  const int cols = static_cast<int>(src.extent(1));
  Kokkos::parallel_for(
      "plm::model::scatter_rows", FlatPolicy(space, 0, src.extent(0)),
      KOKKOS_LAMBDA(const std::int64_t m) {  // rows are distinct: no conflicts
        for (int c = 0; c < cols; ++c) dst(rows(m), c) = src(m, c);
      });
}

template <class T, class S> void copyStridedPortable(const ExecSpace& space, const S* src,
                                                     std::int64_t ld, const View2<T>& dst) {
  const int cols = static_cast<int>(dst.extent(1));
  Kokkos::parallel_for(
      "plm::model::copy_rows", FlatPolicy(space, 0, dst.extent(0)),
      KOKKOS_LAMBDA(const std::int64_t r) {
        for (int c = 0; c < cols; ++c) dst(r, c) = static_cast<T>(src[r * ld + c]);
      });
}

/// y = beta y + x W^T + b on the portable path: the FP8 emulation when the weight carries an
/// FP8 slot, the plain linear layer otherwise.
template <class T> void portableLinear(OpContext& ctx, const Mat& x, const Mat& w, const Vec& b,
                                       T beta, const Mat& y) {
  if (w.fp8)
    fp8LinearForward(ctx, *w.fp8, x.view<T>(), w.view<T>(), b.view<T>(), beta, y.view<T>());
  else
    linearForward(ctx.space(), x.view<T>(), w.view<T>(), b.view<T>(), beta, y.view<T>());
}

/// The backward of portableLinear: dx = dx_beta dx + dy W (dx may be empty), dW, db +=.
template <class T> void portableLinearBackward(OpContext& ctx, const Mat& x, const Mat& w,
                                               const Mat& dy, T dx_beta, const Mat& dx,
                                               const Mat& dw, const Vec& db) {
  const View2<T> dxv = dx.empty() ? View2<T>() : dx.view<T>();
  if (w.fp8)
    fp8LinearBackward(ctx, *w.fp8, x.view<T>(), w.view<T>(), dy.view<T>(), dx_beta, dxv,
                      dw.view<T>(), db.view<T>());
  else
    model::linearBackward(ctx.space(), x.view<T>(), w.view<T>(), dy.view<T>(), dx_beta, dxv,
                          dw.view<T>(), db.view<T>());
}

/// The q/k/v backward under FP8 on the portable path: one GEMM's worth of operands, as the
/// stacked (3H, H) weight of the GPU path sees them, so current and block scaling quantise the
/// (T, 3H) output gradient as one tensor.  The compute copy stacks wq, wk, wv (esm2.cpp).
template <class T> void fp8QkvBackward(OpContext& ctx, const Mat& x, const QkvWeights& w,
                                       const Qkv& d, const Mat& dx, const QkvGrads& g) {
  const std::int64_t rows = d.q.rows, h = d.q.cols;
  const auto& space = ctx.space();
  const auto step = static_cast<std::ptrdiff_t>(h * h);
  if (w.wk.data != w.wq.ptr<T>() + step || w.wv.data != w.wq.ptr<T>() + 2 * step)
    throw Error("plm::model::qkvBackward: FP8 q/k/v weights are not stacked (a bug in esm2.cpp)");
  const View2<T> dall(static_cast<T*>(ctx.scratch(11, sizeof(T) * rows * 3 * h)), rows, 3 * h);
  const View2<T> gw(static_cast<T*>(ctx.scratch(12, sizeof(T) * 3 * h * h)), 3 * h, h);
  const View1<T> gb(static_cast<T*>(ctx.scratch(13, sizeof(T) * 3 * h)), 3 * h);
  const View2<T> dq = d.q.view<T>(), dk = d.k.view<T>(), dv = d.v.view<T>();
  Kokkos::parallel_for(
      "plm::model::fp8_stack_qkv_grad", FlatPolicy(space, 0, rows),
      KOKKOS_LAMBDA(const std::int64_t r) {
        for (std::int64_t c = 0; c < h; ++c) {
          dall(r, c) = dq(r, c);
          dall(r, h + c) = dk(r, c);
          dall(r, 2 * h + c) = dv(r, c);
        }
      });
  Kokkos::deep_copy(space, gw, T(0));
  Kokkos::deep_copy(space, gb, T(0));
  const View2<T> wall(w.wq.ptr<T>(), 3 * h, h);
  fp8LinearBackward(ctx, *w.wq.fp8, x.view<T>(), wall, dall, T(0), dx.view<T>(), gw, gb);
  const View2<T> gq = g.wq.view<T>(), gk = g.wk.view<T>(), gv = g.wv.view<T>();
  const View1<T> bq = g.bq.view<T>(), bk = g.bk.view<T>(), bv = g.bv.view<T>();
  Kokkos::parallel_for(
      "plm::model::fp8_unstack_qkv_grad", FlatPolicy(space, 0, h),
      KOKKOS_LAMBDA(const std::int64_t r) {
        for (std::int64_t c = 0; c < h; ++c) {
          gq(r, c) += gw(r, c);
          gk(r, c) += gw(h + r, c);
          gv(r, c) += gw(2 * h + r, c);
        }
        bq(r) += gb(r);
        bk(r) += gb(h + r);
        bv(r) += gb(2 * h + r);
      });
}

/// The portable attention's head-transposed copies: 2 T H elements, grow-only scratch.
template <class T>
View1<T> attentionWorkspace(OpContext& ctx, const DeviceBatch& b, const Qkv& qkv) {
  const std::int64_t n = 2 * b.tokens * qkv.q.cols;
  return View1<T>(static_cast<T*>(ctx.scratch(3, sizeof(T) * n)), n);
}

}  // namespace

AttentionKernel attentionKernelFor(const OpContext& ctx, int head_dim) {
#if PLM_HAVE_CUDA
  return resolveAttention(ctx, head_dim);
#else
  (void)head_dim;  // the portable attention: no kernel choice
  return ctx.attention_kernel;
#endif
}

// ---- embedding -----------------------------------------------------------------------------

void embedding(OpContext& ctx, const DeviceBatch& b, const Mat& weight, const Mat& x) {
  PLM_TRACE("plm::embedding");
  if (isBf16(weight)) {
#if PLM_HAVE_CUDA
    // A context shard's token-dropout scale follows the whole sequences (b.mult), which the
    // kernel, counting within cu_seqlens, cannot see: plain rows, then scaled.
    const bool shard_dropout = b.ring != nullptr && b.token_dropout;
    gpu::embeddingForward(streamOf(ctx), b.ids.data(), cptr<bf16>(weight), mptr<float>(x),
                          b.cu_seqlens.data(), b.num_seqs, static_cast<int>(x.cols), b.mask_id,
                          b.token_dropout && !shard_dropout);
    if (shard_dropout)
      gpu::scaleRows(streamOf(ctx), mptr<float>(x), b.mult.ptr<float>(), x.rows,
                     static_cast<int>(x.cols));
    ctx.mark(OpKind::Other);
    return;
#else
    noCuda("embedding");
#endif
  }
  portable(weight.dtype, "embedding", [&](auto t) {
    using T = decltype(t);
    embeddingForward(ctx.space(), b.ids, b.mult.view<T>(), weight.view<T>(), x.view<T>());
  });
}

void embeddingBackward(OpContext& ctx, const DeviceBatch& b, const Mat& dx, const Mat& dweight) {
  PLM_TRACE("plm::embedding bwd");
  if (isBf16(dx)) {
#if PLM_HAVE_CUDA
    const int vocab = static_cast<int>(dweight.rows), cols = static_cast<int>(dweight.cols);
    void* work = ctx.scratch(4, gpu::embeddingBackwardWorkspace(b.num_seqs, vocab, cols));
    const bf16* dout = cptr<bf16>(dx);
    const bool shard_dropout = b.ring != nullptr && b.token_dropout;  // as in embedding()
    View1<std::uint16_t> scaled;
    if (shard_dropout) {
      scaled = View1<std::uint16_t>(
          Kokkos::view_alloc(Kokkos::WithoutInitializing, "plm::model::shard_dropout_dx"),
          dx.rows * dx.cols);
      if (dx.ld != dx.cols) throw Error("plm::model::embeddingBackward: strided bf16 (a bug)");
      gpu::scaleRows(streamOf(ctx), dout, b.mult.ptr<float>(),
                     reinterpret_cast<bf16*>(scaled.data()), dx.rows, cols);
      dout = reinterpret_cast<const bf16*>(scaled.data());
    }
    gpu::embeddingBackward(streamOf(ctx), b.ids.data(), dout, mptr<float>(dweight),
                           b.cu_seqlens.data(), b.num_seqs, vocab, cols, b.mask_id,
                           b.token_dropout && !shard_dropout, b.pad_id, work);
    if (shard_dropout) ctx.space().fence();  // `scaled` goes at the end of this scope
    ctx.mark(OpKind::Other);
    return;
#else
    noCuda("embeddingBackward");
#endif
  }
  portable(dx.dtype, "embeddingBackward", [&](auto t) {
    using T = decltype(t);
    model::embeddingBackward(ctx.space(), b.ids, b.mult.view<T>(), dx.view<T>(), b.pad_id,
                             dweight.view<T>());
  });
}

// ---- LayerNorm -----------------------------------------------------------------------------

void layerNorm(OpContext& ctx, const Mat& x, const Vec& gamma, const Vec& beta, double eps,
               const Mat& y, const Vec& mean, const Vec& rstd) {
  PLM_TRACE("plm::layernorm");
  if (isBf16(y)) {
#if PLM_HAVE_CUDA
    const auto st = streamOf(ctx);
    const int cols = static_cast<int>(x.cols);
#if PLM_FP8_CUDA
    if (isBf16(x) ? layerNormFp8Cuda(ctx, cptr<bf16>(x), gamma, beta, eps, y, mean, rstd)
                  : layerNormFp8Cuda(ctx, cptr<float>(x), gamma, beta, eps, y, mean, rstd)) {
      ctx.mark(OpKind::LayerNorm);
      noteFp8Producer(ctx, y, gamma.data);
      return;
    }
#endif
    if (isBf16(x))
      gpu::layerNormForward(st, cptr<bf16>(x), vptr<float>(gamma), vptr<float>(beta), mptr<bf16>(y),
                            vptr<float>(mean), vptr<float>(rstd), x.rows, cols,
                            static_cast<float>(eps));
    else
      gpu::layerNormForward(st, cptr<float>(x), vptr<float>(gamma), vptr<float>(beta),
                            mptr<bf16>(y), vptr<float>(mean), vptr<float>(rstd), x.rows, cols,
                            static_cast<float>(eps));
    ctx.mark(OpKind::LayerNorm);
#if PLM_FP8_CUDA
    noteFp8Producer(ctx, y, gamma.data);
#endif
    return;
#else
    noCuda("layerNorm");
#endif
  }
  portable(y.dtype, "layerNorm", [&](auto t) {
    using T = decltype(t);
    layerNormForward(ctx.space(), x.view<T>(), gamma.view<T>(), beta.view<T>(), eps, y.view<T>(),
                     mean.view<T>(), rstd.view<T>());
  });
}

void layerNormBackward(OpContext& ctx, const Mat& x, const Vec& gamma, const Vec& mean,
                       const Vec& rstd, const Mat& dy, const Mat& dres, bool accumulate,
                       const Mat& dx, const Vec& dgamma, const Vec& dbeta) {
  PLM_TRACE("plm::layernorm bwd");
  if (isBf16(dx)) {
#if PLM_HAVE_CUDA
    const auto st = streamOf(ctx);
    const int cols = static_cast<int>(x.cols);
    void* work = ctx.scratch(1, gpu::layerNormBackwardWorkspace(x.rows, cols));
    float* res = dres.empty() ? nullptr : mptr<float>(dres);
    auto call = [&](auto* xp, auto* dyp) {
      gpu::layerNormBackward(st, dyp, xp, vptr<float>(gamma), vptr<float>(mean), vptr<float>(rstd),
                             res, accumulate, mptr<bf16>(dx), vptr<float>(dgamma),
                             vptr<float>(dbeta), x.rows, cols, work);
    };
    if (isBf16(x)) {
      if (isBf16(dy))
        call(cptr<bf16>(x), cptr<bf16>(dy));
      else
        call(cptr<bf16>(x), cptr<float>(dy));
    } else {
      if (isBf16(dy))
        call(cptr<float>(x), cptr<bf16>(dy));
      else
        call(cptr<float>(x), cptr<float>(dy));
    }
    ctx.mark(OpKind::LayerNorm);
    return;
#else
    noCuda("layerNormBackward");
#endif
  }
  if (!dres.empty() && dres.data != dx.data)
    throw Error(
        "plm::model::layerNormBackward: on the portable path the residual gradient is "
        "its own compute copy (a bug in the layout)");
  portable(dx.dtype, "layerNormBackward", [&](auto t) {
    using T = decltype(t);
    const View2<T> target = dx.view<T>();
    if (!accumulate || dres.empty()) Kokkos::deep_copy(ctx.space(), target, T(0));
    model::layerNormBackward(ctx.space(), x.view<T>(), gamma.view<T>(), mean.view<T>(),
                             rstd.view<T>(), dy.view<T>(), target, dgamma.view<T>(),
                             dbeta.view<T>());
  });
}

// ---- Linear layers -------------------------------------------------------------------------

void linear(OpContext& ctx, const Mat& x, const Mat& w, const Vec& b, const Mat& y) {
  if (isBf16(x)) {
#if PLM_HAVE_CUDA
#if PLM_FP8_CUDA
    if (w.fp8) return fp8ForwardCuda(ctx, x, w, b, y, gpu::Epilogue::Bias, nullptr, nullptr);
#endif
    Mm m = forwardGemm(x, w, y);
    if (!b.empty()) {  // no bias: SwiGLU experts
      expect(b.dtype, y.dtype, "a bias (cuBLASLt takes it in the output's type)");
      m.epilogue = gpu::Epilogue::Bias;
      m.bias = b.data;
    }
    runGemm(ctx, m);
    return;
#else
    noCuda("linear");
#endif
  }
  portable(x.dtype, "linear", [&](auto t) {
    using T = decltype(t);
    portableLinear<T>(ctx, x, w, b, T(0), y);
  });
}

void linearResidual(OpContext& ctx, const Mat& x, const Mat& w, const Vec& b, const Mat& residual,
                    const Mat& y) {
  if (isBf16(x)) {
#if PLM_HAVE_CUDA
#if PLM_FP8_CUDA
    if (w.fp8) return fp8ForwardCuda(ctx, x, w, b, y, gpu::Epilogue::Bias, nullptr, &residual);
#endif
    Mm m = forwardGemm(x, w, y);
    expect(b.dtype, y.dtype, "a bias (cuBLASLt takes it in the output's type)");
    m.epilogue = gpu::Epilogue::Bias;
    m.bias = b.data;
    m.beta = 1.0f;
    m.c = residual.data;
    m.ldc = residual.ld;
    runGemm(ctx, m);
    return;
#else
    noCuda("linearResidual");
#endif
  }
  portable(x.dtype, "linearResidual", [&](auto t) {
    using T = decltype(t);
    const View2<T> out = y.view<T>();
    if (residual.data != y.data) Kokkos::deep_copy(ctx.space(), out, residual.view<T>());
    portableLinear<T>(ctx, x, w, b, T(1), y);
  });
}

void linearGelu(OpContext& ctx, const Mat& x, const Mat& w, const Vec& b, const Mat& pre,
                const Mat& y, const Mat& add) {
  if (isBf16(x)) {
#if PLM_HAVE_CUDA
#if PLM_FP8_CUDA
    if (w.fp8) {
      PLM_REQUIRE(add.empty(), "plm::model::linearGelu: an added term under fp8 (a bug)");
      return fp8LinearGeluCuda(ctx, x, w, b, pre, y);
    }
#endif
    Mm m = forwardGemm(x, w, y);
    expect(b.dtype, y.dtype, "a bias (cuBLASLt takes it in the output's type)");
    m.epilogue = gpu::Epilogue::BiasGeluAux;
    m.bias = b.data;
    m.aux = pre.data;
    m.ldaux = pre.ld;
    if (!add.empty()) {  // gelu(x W^T + b + add): C enters before the epilogue
      expect(add.dtype, y.dtype, "the added term");
      m.beta = 1.0f;
      m.c = add.data;
      m.ldc = add.ld;
    }
    runGemm(ctx, m);
    return;
#else
    noCuda("linearGelu");
#endif
  }
  portable(x.dtype, "linearGelu", [&](auto t) {
    using T = decltype(t);
    if (!add.empty()) Kokkos::deep_copy(ctx.space(), pre.view<T>(), add.view<T>());
    portableLinear<T>(ctx, x, w, b, add.empty() ? T(0) : T(1), pre);
    geluForward(ctx.space(), pre.view<T>(), y.view<T>());
  });
}

void matmul(OpContext& ctx, bool trans_a, bool trans_b, double alpha, const Mat& a, const Mat& b,
            double beta, const Mat& c) {
  const std::int64_t m = trans_a ? a.cols : a.rows, k = trans_a ? a.rows : a.cols;
  const std::int64_t n = trans_b ? b.rows : b.cols, kb = trans_b ? b.cols : b.rows;
  if (m != c.rows || n != c.cols || k != kb)
    throw Error("plm::model::matmul: shapes (" + std::to_string(a.rows) + ", " +
                std::to_string(a.cols) + ")" + (trans_a ? "^T" : "") + " x (" +
                std::to_string(b.rows) + ", " + std::to_string(b.cols) + ")" +
                (trans_b ? "^T" : "") + " -> (" + std::to_string(c.rows) + ", " +
                std::to_string(c.cols) + ") do not match (a bug)");
  if (isBf16(a)) {
#if PLM_HAVE_CUDA
    Mm mm;
    mm.ta = trans_a;
    mm.tb = trans_b;
    mm.m = m;
    mm.n = n;
    mm.k = k;
    mm.a = cptr<bf16>(a);
    mm.lda = a.ld;
    mm.b = cptr<bf16>(b);
    mm.ldb = b.ld;
    mm.d = &c;
    mm.alpha = static_cast<float>(alpha);
    mm.beta = static_cast<float>(beta);
    runGemm(ctx, mm);
    return;
#else
    noCuda("matmul");
#endif
  }
  portable(a.dtype, "matmul", [&](auto t) {
    using T = decltype(t);
    gemm(ctx.space(), trans_a ? Trans::T : Trans::N, trans_b ? Trans::T : Trans::N, T(alpha),
         a.view<T>(), b.view<T>(), T(beta), c.view<T>());
  });
}

void linearBackward(OpContext& ctx, const Mat& x, const Mat& w, const Mat& dy, const Mat& dx,
                    bool dx_accumulate, const Mat& dw, const Vec& db) {
  if (isBf16(dy)) {
#if PLM_HAVE_CUDA
#if PLM_FP8_CUDA
    if (w.fp8) return fp8BackwardCuda(ctx, x, w, dy, dx, dx_accumulate, dw, 1.0f, vptr<float>(db));
#endif
    weightGradient(ctx, x, dy, dw, vptr<float>(db));
    if (!dx.empty()) inputGradient(ctx, dy, w, dx, dx_accumulate);
    return;
#else
    noCuda("linearBackward");
#endif
  }
  portable(dy.dtype, "linearBackward", [&](auto t) {
    using T = decltype(t);
    portableLinearBackward<T>(ctx, x, w, dy, dx_accumulate ? T(1) : T(0), dx, dw, db);
  });
}

void linearBackwardGelu(OpContext& ctx, const Mat& x, const Mat& w, const Mat& dy, const Mat& pre,
                        const Mat& dpre, const Mat& dw, const Vec& db) {
  if (isBf16(dy)) {
#if PLM_HAVE_CUDA
#if PLM_FP8_CUDA
    if (w.fp8)
      return fp8BackwardCuda(ctx, x, w, dy, dpre, false, dw, 1.0f, vptr<float>(db),
                             gpu::Epilogue::DGelu, &pre);
#endif
    weightGradient(ctx, x, dy, dw, vptr<float>(db));
    inputGradient(ctx, dy, w, dpre, false, gpu::Epilogue::DGelu, &pre);
    return;
#else
    noCuda("linearBackwardGelu");
#endif
  }
  portable(dy.dtype, "linearBackwardGelu", [&](auto t) {
    using T = decltype(t);
    portableLinearBackward<T>(ctx, x, w, dy, T(0), dpre, dw, db);
    model::geluBackward(ctx.space(), pre.view<T>(), dpre.view<T>(), dpre.view<T>());
  });
}

void geluBackward(OpContext& ctx, const Mat& pre, const Mat& dy, const Mat& dx) {
  PLM_TRACE("plm::gelu bwd");
  if (isBf16(dy)) {
#if PLM_HAVE_CUDA
    if (pre.ld != pre.cols || dy.ld != dy.cols || dx.ld != dx.cols)
      throw Error("plm::model::geluBackward: strided operands (a bug in the layout)");
    gpu::geluTanhBackward(streamOf(ctx), cptr<bf16>(dy), cptr<bf16>(pre), mptr<bf16>(dx),
                          dy.rows * dy.cols);
    ctx.mark(OpKind::Other);
    return;
#else
    noCuda("geluBackward");
#endif
  }
  portable(dy.dtype, "geluBackward", [&](auto t) {
    using T = decltype(t);
    model::geluBackward(ctx.space(), pre.view<T>(), dy.view<T>(), dx.view<T>());
  });
}

namespace {
template <class T> void portableSwiglu(OpContext& ctx, const Mat& pre, const Mat& act,
                                       const Mat* dact, const Mat* dpre) {
  const View2<T> p = pre.view<T>();
  const std::int64_t f = pre.cols / 2;
  if (!dact) {
    const View2<T> a = act.view<T>();
    Kokkos::parallel_for(
        "plm::model::swiglu",
        Kokkos::MDRangePolicy<ExecSpace, Kokkos::Rank<2>>(ctx.space(), {0, 0}, {pre.rows, f}),
        KOKKOS_LAMBDA(const std::int64_t r, const std::int64_t c) {
          const T g = p(r, c);
          a(r, c) = g / (T(1) + Kokkos::Experimental::exp(-g)) * p(r, f + c);
        });
    return;
  }
  const View2<T> da = dact->view<T>(), dp = dpre->view<T>();
  Kokkos::parallel_for(
      "plm::model::swiglu_backward",
      Kokkos::MDRangePolicy<ExecSpace, Kokkos::Rank<2>>(ctx.space(), {0, 0}, {pre.rows, f}),
      KOKKOS_LAMBDA(const std::int64_t r, const std::int64_t c) {
        const T g = p(r, c), u = p(r, f + c), d = da(r, c);
        const T sg = T(1) / (T(1) + Kokkos::Experimental::exp(-g));
        dp(r, c) = d * u * sg * (T(1) + g * (T(1) - sg));
        dp(r, f + c) = d * g * sg;
      });
}
}  // namespace

void swigluForward(OpContext& ctx, const Mat& pre, const Mat& act) {
  if (pre.cols != 2 * act.cols || pre.rows != act.rows)
    throw Error("plm::model::swigluForward: pre must be (R, 2F) for act (R, F) (a bug)");
  if (isBf16(pre)) {
#if PLM_HAVE_CUDA
    if (pre.ld != pre.cols || act.ld != act.cols)
      throw Error("plm::model::swigluForward: strided operands (a bug in the layout)");
    gpu::swigluForward(streamOf(ctx), cptr<bf16>(pre), mptr<bf16>(act), act.rows,
                       static_cast<int>(act.cols));
    ctx.mark(OpKind::Other);
    return;
#else
    noCuda("swigluForward");
#endif
  }
  portable(pre.dtype, "swigluForward", [&](auto t) {
    using T = decltype(t);
    portableSwiglu<T>(ctx, pre, act, nullptr, nullptr);
  });
}

void swigluBackward(OpContext& ctx, const Mat& pre, const Mat& dact, const Mat& dpre) {
  if (pre.cols != 2 * dact.cols || dpre.cols != pre.cols || pre.rows != dact.rows)
    throw Error("plm::model::swigluBackward: pre, dpre must be (R, 2F) for dact (R, F) (a bug)");
  if (isBf16(pre)) {
#if PLM_HAVE_CUDA
    if (pre.ld != pre.cols || dact.ld != dact.cols || dpre.ld != dpre.cols)
      throw Error("plm::model::swigluBackward: strided operands (a bug in the layout)");
    gpu::swigluBackward(streamOf(ctx), cptr<bf16>(pre), cptr<bf16>(dact), mptr<bf16>(dpre),
                        dact.rows, static_cast<int>(dact.cols));
    ctx.mark(OpKind::Other);
    return;
#else
    noCuda("swigluBackward");
#endif
  }
  portable(pre.dtype, "swigluBackward", [&](auto t) {
    using T = decltype(t);
    portableSwiglu<T>(ctx, pre, Mat{}, &dact, &dpre);
  });
}

// ---- attention block -----------------------------------------------------------------------

void qkvProjection(OpContext& ctx, const Mat& x, const QkvWeights& w, const Qkv& out) {
  if (!w.fused_w.empty()) {
    if (!out.fused())
      throw Error("plm::model::qkvProjection: stacked weights need a fused q/k/v buffer (a bug)");
    Mat all = out.q;
    all.cols = 3 * out.q.cols;
    linear(ctx, x, w.fused_w, w.fused_b, all);
    return;
  }
  linear(ctx, x, w.wq, w.bq, out.q);
  linear(ctx, x, w.wk, w.bk, out.k);
  linear(ctx, x, w.wv, w.bv, out.v);
}

void qkvBackward(OpContext& ctx, const Mat& x, const QkvWeights& w, const Qkv& d, const Mat& dx,
                 const QkvGrads& g) {
  if (!w.fused_w.empty()) {
#if PLM_HAVE_CUDA
    if (!d.fused())
      throw Error("plm::model::qkvBackward: stacked weights need a fused q/k/v gradient (a bug)");
    // One (3H, H) weight-gradient GEMM for q, k and v, then added into their three tensors.
    const std::int64_t h = d.q.cols;
    auto* grad = static_cast<float*>(ctx.scratch(2, (3 * h * h + 3 * h + 64) * sizeof(float)));
    Mat dall = d.q;
    dall.cols = 3 * h;
    Mat gw{grad, DType::F32, 3 * h, h, h};
#if PLM_FP8_CUDA
    if (w.fused_w.fp8) {
      // One FP8 (3H, H) GEMM pair: the weight gradient written (=) into the scratch, the bias
      // gradient summed into it from the cast of dq|dk|dv, then added as below.
      PLM_CHECK_CUDA(cudaMemsetAsync(grad + 3 * h * h, 0, 3 * h * sizeof(float), streamOf(ctx)));
      fp8BackwardCuda(ctx, x, w.fused_w, dall, dx, false, gw, 0.0f, grad + 3 * h * h);
      const auto st = streamOf(ctx);
      const Mat* gws[3] = {&g.wq, &g.wk, &g.wv};
      const Vec* gbs[3] = {&g.bq, &g.bk, &g.bv};
      for (int part = 0; part < 3; ++part) {
        gpu::addInto(st, mptr<float>(*gws[part]), grad + part * h * h, h * h);
        gpu::addInto(st, vptr<float>(*gbs[part]), grad + 3 * h * h + part * h, h);
      }
      ctx.mark(OpKind::Other);
      return;
    }
#endif
    Mm m;
    m.ta = true;
    m.m = 3 * h;
    m.n = h;
    m.k = dall.rows;
    m.a = cptr<bf16>(dall);
    m.lda = dall.ld;
    m.b = cptr<bf16>(x);
    m.ldb = x.ld;
    m.d = &gw;
    m.epilogue = gpu::Epilogue::BGradA;
    m.bias_grad = grad + 3 * h * h;
    runGemm(ctx, m);
    const auto st = streamOf(ctx);
    const Mat* gws[3] = {&g.wq, &g.wk, &g.wv};
    const Vec* gbs[3] = {&g.bq, &g.bk, &g.bv};
    for (int part = 0; part < 3; ++part) {
      gpu::addInto(st, mptr<float>(*gws[part]), grad + part * h * h, h * h);
      gpu::addInto(st, vptr<float>(*gbs[part]), grad + 3 * h * h + part * h, h);
    }
    ctx.mark(OpKind::Other);
    inputGradient(ctx, dall, w.fused_w, dx, false);
    return;
#else
    noCuda("qkvBackward");
#endif
  }
  if (w.wq.fp8) {
    portable(d.q.dtype, "qkvBackward", [&](auto t) {
      using T = decltype(t);
      fp8QkvBackward<T>(ctx, x, w, d, dx, g);
    });
    return;
  }
  linearBackward(ctx, x, w.wq, d.q, dx, false, g.wq, g.bq);
  linearBackward(ctx, x, w.wk, d.k, dx, true, g.wk, g.bk);
  linearBackward(ctx, x, w.wv, d.v, dx, true, g.wv, g.bv);
}

void rotary(OpContext& ctx, const DeviceBatch& b, const Mat& q, const Mat& k, int heads,
            bool inverse, const Mat& cos_table, const Mat& sin_table) {
  const int head_dim = static_cast<int>(q.cols / heads);
  if (isBf16(q)) {
#if PLM_HAVE_CUDA
    const float q_scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
    gpu::rotary(streamOf(ctx), mptr<bf16>(q), q.ld, mptr<bf16>(k), k.ld, b.position.data(),
                b.tokens, heads, head_dim, inverse, q_scale);
    ctx.mark(OpKind::Other);
    return;
#else
    noCuda("rotary");
#endif
  }
  portable(q.dtype, "rotary", [&](auto t) {
    using T = decltype(t);
    const T q_scale = T(1) / std::sqrt(T(head_dim));
    const auto cs = cos_table.view<T>();
    const auto sn = sin_table.view<T>();
    if (inverse) {
      rotaryBackward(ctx.space(), q.view<T>(), b.position, heads, cs, sn, q_scale);
      rotaryBackward(ctx.space(), k.view<T>(), b.position, heads, cs, sn, T(1));
    } else {
      rotaryForward(ctx.space(), q.view<T>(), b.position, heads, cs, sn, q_scale);
      rotaryForward(ctx.space(), k.view<T>(), b.position, heads, cs, sn, T(1));
    }
  });
}

#if PLM_HAVE_CUDA
void bf16Attention(OpContext& ctx, const gpu::FlashParams& fp, bool backward) {
  const AttentionKernel k = resolveAttention(ctx, fp.head_dim);
  const bool cudnn = fp.cu_seqlens_k == nullptr &&
                     (backward ? k == AttentionKernel::Cudnn : k != AttentionKernel::Flash);
  if (!cudnn || !cudnnAttention(ctx, fp, backward)) {
    if (backward)
      gpu::flashAttentionBackward(streamOf(ctx), fp);
    else
      gpu::flashAttentionForward(streamOf(ctx), fp);
  }
  ctx.mark(OpKind::Attention);
}
#endif

void attention(OpContext& ctx, const DeviceBatch& b, const Qkv& qkv, int heads, const Mat& o,
               const Mat& lse) {
  PLM_TRACE("plm::attention");
  if (b.ring) return b.ring->forward(ctx, qkv, heads, o, lse);  // context parallelism
  if (isBf16(qkv.q)) {
#if PLM_HAVE_CUDA
    const gpu::FlashParams fp = flashParams(b, qkv, heads, o, lse);
    if (resolveAttention(ctx, fp.head_dim) == AttentionKernel::Flash ||
        !cudnnAttention(ctx, fp, false))
      gpu::flashAttentionForward(streamOf(ctx), fp);
    ctx.mark(OpKind::Attention);
    return;
#else
    noCuda("attention");
#endif
  }
  portable(qkv.q.dtype, "attention", [&](auto t) {
    using T = decltype(t);
    attentionForward(ctx.space(), qkv.q.view<T>(), qkv.k.view<T>(), qkv.v.view<T>(), b.cu_seqlens,
                     heads, o.view<T>(), lse.view<T>(), ctx.tiles,
                     attentionWorkspace<T>(ctx, b, qkv));
  });
}

void attentionBackward(OpContext& ctx, const DeviceBatch& b, const Qkv& qkv, const Mat& o,
                       const Mat& lse, const Mat& dout, int heads, const Mat& delta,
                       const Qkv& dqkv) {
  PLM_TRACE("plm::attention bwd");
  if (b.ring) return b.ring->backward(ctx, qkv, o, lse, dout, heads, delta, dqkv);
  if (isBf16(qkv.q)) {
#if PLM_HAVE_CUDA
    gpu::FlashParams fp = flashParams(b, qkv, heads, o, lse);
    fp.dout = cptr<bf16>(dout);
    fp.dout_stride = dout.ld;
    fp.dq = mptr<bf16>(dqkv.q);
    fp.dk = mptr<bf16>(dqkv.k);
    fp.dv = mptr<bf16>(dqkv.v);
    fp.dq_stride = dqkv.q.ld;
    fp.dk_stride = dqkv.k.ld;
    fp.dv_stride = dqkv.v.ld;
    fp.delta = mptr<float>(delta);
    if (resolveAttention(ctx, fp.head_dim) != AttentionKernel::Cudnn ||
        !cudnnAttention(ctx, fp, true))
      gpu::flashAttentionBackward(streamOf(ctx), fp);
    ctx.mark(OpKind::Attention);
    return;
#else
    noCuda("attentionBackward");
#endif
  }
  portable(qkv.q.dtype, "attentionBackward", [&](auto t) {
    using T = decltype(t);
    model::attentionBackward(ctx.space(), qkv.q.view<T>(), qkv.k.view<T>(), qkv.v.view<T>(),
                             o.view<T>(), lse.view<T>(), dout.view<T>(), b.cu_seqlens, heads,
                             delta.view<T>(), dqkv.q.view<T>(), dqkv.k.view<T>(), dqkv.v.view<T>(),
                             ctx.tiles, attentionWorkspace<T>(ctx, b, qkv));
  });
}

// ---- LM head rows and loss -----------------------------------------------------------------

void gatherRows(OpContext& ctx, const Mat& src, const View1<std::int32_t>& rows, const Mat& dst,
                OpKind kind) {
  if (isBf16(src)) {
#if PLM_HAVE_CUDA
    gpu::gatherRows(streamOf(ctx), cptr<bf16>(src), rows.data(), mptr<bf16>(dst), dst.rows,
                    static_cast<int>(dst.cols));
    ctx.mark(kind);
    return;
#else
    noCuda("gatherRows");
#endif
  }
  (void)kind;  // the portable path is not profiled
  portable(src.dtype, "gatherRows", [&](auto t) {
    using T = decltype(t);
    gatherRowsPortable(ctx.space(), src.view<T>(), rows, dst.view<T>());
  });
}

void scatterRows(OpContext& ctx, const Mat& src, const View1<std::int32_t>& rows, const Mat& dst) {
  if (isBf16(src)) {
#if PLM_HAVE_CUDA
    PLM_CHECK_CUDA(
        cudaMemsetAsync(dst.data, 0, dst.rows * dst.ld * sizeOf(dst.dtype), streamOf(ctx)));
    gpu::scatterRows(streamOf(ctx), cptr<bf16>(src), rows.data(), mptr<bf16>(dst), src.rows,
                     static_cast<int>(src.cols));
    ctx.mark(OpKind::Other);
    return;
#else
    noCuda("scatterRows");
#endif
  }
  portable(src.dtype, "scatterRows", [&](auto t) {
    using T = decltype(t);
    scatterRowsPortable(ctx.space(), src.view<T>(), rows, dst.view<T>());
  });
}

void crossEntropy(OpContext& ctx, const Mat& logits, const View1<std::int32_t>& labels,
                  double grad_scale, const Mat& dlogits) {
  PLM_TRACE("plm::cross_entropy");
  if (isBf16(dlogits)) {
#if PLM_HAVE_CUDA
    gpu::crossEntropy(streamOf(ctx), cptr<float>(logits), labels.data(), mptr<bf16>(dlogits),
                      ctx.cuda().loss, logits.rows, static_cast<int>(logits.cols),
                      static_cast<float>(grad_scale), static_cast<int>(logits.ld));
    ctx.mark(OpKind::Other);
    return;
#else
    noCuda("crossEntropy");
#endif
  }
  portable(logits.dtype, "crossEntropy", [&](auto t) {
    using T = decltype(t);
    ctx.host_loss += model::crossEntropy(ctx.space(), logits.view<T>(), labels, grad_scale,
                                         dlogits.empty() ? View2<T>() : dlogits.view<T>());
  });
}

void copyToMaster(OpContext& ctx, const Mat& src, const Mat& dst) {
  portable(dst.dtype, "copyToMaster", [&](auto t) {
    using T = decltype(t);
    const View2<T> out = dst.view<T>();
    if (src.dtype == dst.dtype) {
      copyStridedPortable(ctx.space(), static_cast<const T*>(src.data), src.ld, out);
    } else if (isBf16(src)) {
#if PLM_HAVE_CUDA
      if constexpr (std::is_same_v<T, float>) {
        if (src.ld != src.cols) throw Error("plm::model::copyToMaster: strided bf16 (a bug)");
        gpu::castToFloat(streamOf(ctx), cptr<bf16>(src), out.data(), src.rows * src.cols);
        return;
      }
#endif
      noCuda("copyToMaster");
    } else {
      throw Error("plm::model::copyToMaster: element types differ (a bug)");
    }
  });
}

void copyFromMaster(OpContext& ctx, const Mat& src, const Mat& dst) {
  if (src.ld != src.cols || dst.ld != dst.cols || src.rows != dst.rows || src.cols != dst.cols)
    throw Error("plm::model::copyFromMaster: shapes or strides differ (a bug)");
  if (isBf16(dst)) {
#if PLM_HAVE_CUDA
    // One chunk (src offset, dst offset, count) of the packed-copy cast.
    Kokkos::View<std::int64_t[3], Kokkos::HostSpace> host("plm::model::cast_chunk_host");
    host(0) = 0, host(1) = 0, host(2) = src.rows * src.cols;
    Kokkos::View<std::int64_t[3], MemSpace> chunk("plm::model::cast_chunk");
    Kokkos::deep_copy(ctx.space(), chunk, host);
    gpu::castChunks(streamOf(ctx), cptr<float>(src), mptr<bf16>(dst), chunk.data(), 1);
    ctx.mark(OpKind::Other);
    ctx.space().fence();  // `chunk` is freed on return
    return;
#else
    noCuda("copyFromMaster");
#endif
  }
  if (src.dtype != dst.dtype)
    throw Error("plm::model::copyFromMaster: element types differ (a bug)");
  portable(dst.dtype, "copyFromMaster", [&](auto t) {
    using T = decltype(t);
    copyStridedPortable(ctx.space(), static_cast<const T*>(src.data), src.ld, dst.view<T>());
  });
}

}  // namespace plm::model
