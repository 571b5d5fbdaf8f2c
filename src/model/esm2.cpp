// Esm2<T>: the tensor table, the compute copy of the parameters, the activation workspace, and
// THE forward/backward orchestration: embedding + token dropout, L encoder layers
// (encoder_layer.hpp), final LayerNorm, LM head on labelled rows, cross-entropy.  Every operation
// is a dispatch point of ops.hpp, so this one sequence runs fp32 on the CPU, fp32 and bf16 on
// CUDA (doc/architecture.md draws one step).
//
// Accumulation rule: gradients() accumulates (+=) until zeroGradients(); activations are written.
// The residual-stream gradient is one (T, H) buffer updated in place from the loss down to the
// embedding: each LayerNorm backward adds its branch into it.
// The LM head runs only on rows that carry a label (about 15% of tokens) in training; forward()
// with want_logits runs it on every row.
// Precision policy: under bf16 the GEMM weights are read from a packed bf16 copy of the fp32
// masters (q/k/v stacked into one (3H, H) matrix), refreshed once per optimizer step; LayerNorm
// parameters and the biases of fp32-output GEMMs are read from the masters.  Activations are bf16
// except the residual stream and its gradient (fp32); statistics are fp32.
// Under fp8 the four GEMMs of each FP8 layer read their weights from a quantised fp32 copy
// (q/k/v stacked (3H, H)), refreshed once per optimizer step like the bf16 copy, whose handles
// carry the GEMM's FP8 slot (Mat::fp8): the dispatch points then emulate the FP8 GEMM
// (fp8_gemm.hpp).  Everything else computes as under fp32.
// LoRA (Esm2Config::lora, model/lora.hpp): A and B of every target are table rows at the end of
// their layer (so in its group, its slice of the compute copy and its sharded unit), bound like
// GEMM weights; the layer adds their products at its projections (encoder_layer.cpp).
// Recomputation (Recompute in ops.hpp) changes only what is kept; every kernel is deterministic,
// so the gradients are bitwise those of the stored-activation path on each backend.
#include "model/esm2.hpp"

#include "core/error.hpp"
#include "core/flat.hpp"
#include "core/trace.hpp"
#include "data/context_split.hpp"
#include "dist/allreduce.hpp"
#include "dist/communicator.hpp"
#include "model/context_parallel.hpp"
#include "model/embedding.hpp"
#include "model/encoder_layer.hpp"
#include "model/fp8_gemm.hpp"
#include "model/math.hpp"
#include "model/moe.hpp"
#include "model/rotary.hpp"
#include "plm/plm_config.hpp"

#if PLM_HAVE_CUDA
#include "gpu/fused.hpp"
#endif
#if PLM_FP8_CUDA
#include "gpu/fp8.hpp"
#endif

#include <sys/mman.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <type_traits>
#include <unordered_map>

namespace plm::model {
namespace {

/// Carves typed handles out of one grow-only byte arena; a first pass with base == nullptr
/// measures.
struct Carver {
  char* base = nullptr;
  std::size_t used = 0;
  void* take(std::size_t bytes) {
    void* p = base ? base + used : nullptr;
    used += (bytes + 255) / 256 * 256;
    return p;
  }
  Mat mat(std::int64_t rows, std::int64_t cols, DType d, std::int64_t ld = 0) {
    if (ld == 0) ld = cols;
    return Mat{take(static_cast<std::size_t>(rows * ld) * sizeOf(d)), d, rows, cols, ld};
  }
  Vec vec(std::int64_t n, DType d) {
    return Vec{take(static_cast<std::size_t>(n) * sizeOf(d)), d, n};
  }
  Qkv qkv(std::int64_t rows, std::int64_t h, DType d, bool fused) {
    if (!fused) return Qkv{mat(rows, h, d), mat(rows, h, d), mat(rows, h, d)};
    Mat all = mat(rows, 3 * h, d);
    return Qkv{all.columns(0, h), all.columns(h, h), all.columns(2 * h, h)};
  }
};

template <class X> View1<X> growView(View1<X>& storage, std::int64_t n, const char* label) {
  if (static_cast<std::int64_t>(storage.extent(0)) < n)
    storage = View1<X>(Kokkos::view_alloc(Kokkos::WithoutInitializing, std::string(label)), n);
  return View1<X>(storage.data(), n);
}

/// An address range taken from the process without memory behind it (PROT_NONE, no swap
/// reserved): every access faults.  The views of a model that holds no whole buffer point here
/// until they are placed (Esm2::placeRange), so they have distinct addresses to move from, and
/// a read before placement crashes instead of reading another buffer.
class ReservedRange {
 public:
  ReservedRange() = default;
  explicit ReservedRange(std::size_t bytes) : bytes_member(std::max<std::size_t>(bytes, 1)) {
    void* p =
        mmap(nullptr, bytes_member, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED)
      throw Error("plm::model: cannot reserve " + std::to_string(bytes_member) +
                  " bytes of address space for the views of an unplaced model (ulimit -v?)");
    base_member = static_cast<char*>(p);
  }
  ~ReservedRange() {
    if (base_member) munmap(base_member, bytes_member);
  }
  ReservedRange(const ReservedRange&) = delete;
  ReservedRange& operator=(const ReservedRange&) = delete;
  ReservedRange& operator=(ReservedRange&& o) noexcept {
    std::swap(base_member, o.base_member);
    std::swap(bytes_member, o.bytes_member);
    return *this;
  }
  char* base() const { return base_member; }

 private:
  char* base_member = nullptr;
  std::size_t bytes_member = 0;
};

constexpr int kLogitsLdBf16 = 40;  // vocab 33 padded to 16-byte bf16 rows for cuBLASLt

}  // namespace

template <class T> struct Esm2<T>::Impl {
  /// The non-layer tensors, in compute precision (weights) or the master type (gradients).
  struct Outer {
    Mat embed;                 // (V, H) word embedding, also the tied decoder
    Vec lnf_g, lnf_b;          // (H) emb_layer_norm_after
    Mat head_w;                // (H, H) lm_head.dense
    Vec head_b;                // (H)
    Vec head_ln_g, head_ln_b;  // (H) lm_head.layer_norm
    Vec head_bias;             // (V) lm_head.bias (decoder bias)
  };
  struct Work {
    DeviceBatch batch;
    std::int64_t rows = 0;            // LM-head rows
    std::int64_t labelled = 0;        // rows with a label (the router losses' weight)
    View1<std::int32_t> head_rows;    // (M) token index of each LM-head row
    View1<std::int32_t> head_labels;  // (M)
    std::vector<Mat> xs;              // (L+1) x (T, H) residual stream at layer boundaries
    std::vector<LayerActs> acts;      // (L), or (1) shared (layer recompute, forward only)
    LayerScratch scratch;             // backward only
    Mat hidden;                       // (T, H) last_hidden_state (compute precision)
    Vec meanf, rstdf;                 // (T)
    Mat hg, h1, h1g, h2;              // (M, H) head: gathered hidden, dense, GELU, LayerNorm
    Vec meanh, rstdh;                 // (M)
    Mat logits;                       // (M, V) master type (row stride padded under bf16)
    Mat dlogits;                      // (M, V) compute precision (logits itself on the CPU)
    Mat dhidden, dh2, dh1, dhg;       // backward: (T, H), (M, H) x3
  };

  Esm2Config config;
  std::vector<TensorInfo> tensors;  // the tensor table (tensor_table.hpp) of the held experts
  ExpertPlacement held;             // the routed experts this rank holds
  std::unordered_map<std::string, std::size_t> index;
  View1<T> params;  // (numParameters + alignment padding)
  View1<T> grads;   // same layout
  bool bf16 = false;
  DType master = dtypeOf<T>(), compute = dtypeOf<T>(), stats = dtypeOf<T>();
  // bf16 policy: packed compute copy of the GEMM weights, refreshed by one cast launch over
  // (src offset, dst offset, count) chunks.
  View1<std::uint16_t> packed;
  View1<std::int64_t> chunks;
  int num_chunks = 0;
  std::vector<std::int64_t> packed_seg;  // (master offset, copy offset, count) per tensor
  std::int64_t packed_elements = 0;
  Outer pw, pg;  // compute weights, gradients
  // fp8 policy: the scaling state, one slot per (layer, GEMM), and the quantised weight copy
  // (fp8_weights) refreshed from the masters: (master offset, copy offset, count) segments
  // gathered per GEMM weight (q, k, v stacked), quantised as one tensor each.
  std::unique_ptr<Fp8Scaling> fp8_scaling;
  std::vector<Fp8GemmSlot> fp8_slots;  // (layers * 4 + moe layers * experts * 2)
  View1<T> fp8_weights;
  struct Fp8Weight {
    const Fp8GemmSlot* slot;
    std::int64_t at, rows, cols;     // in fp8_weights
    std::vector<std::int64_t> from;  // master offsets of its stacked parts
  };
  std::vector<Fp8Weight> fp8_list;
  // fp8 on the CUDA path: the packed bf16 weights of the FP8 GEMMs (cast to E4M3 codes and
  // their transposes once per step) and the device scales (slots x 3 operands x [scale,
  // scale_inv]) and amaxes (slots x 3).
  std::vector<std::pair<Fp8GemmSlot*, Mat>> fp8_cuda_weights;
  // Where each one's bf16 values are: its group (placeRange) and its offset in the packed copy
  // (bf16 elements), so the casts read the group's compute copy wherever it is placed now.
  std::vector<std::pair<int, std::int64_t>> fp8_cuda_at;
  View1<std::uint8_t> fp8_codes;
  View1<float> fp8_dev_scales, fp8_dev_amax;
  std::vector<float> fp8_host;  // staging of the uploads and downloads
  std::vector<EncoderLayer> layers;
  OpContext ctx;
  View2<T> cos_table, sin_table;  // (positions, head_dim/2)
  LayerHooks* hooks = nullptr;
  HiddenHead<T>* hidden_head = nullptr;  // replaces the LM head in forwardBackward
  MoeStep moe_step;                      // read by every MoE layer during a pass
  bool centring = false;                 // passes of centreRouters (MoeStep::centring)
  bool expert_parallel = false;          // setExpertParallel with more than one rank
  std::vector<int> host_cu;              // the pass's sequence offsets (sequence-level aux loss)
  std::vector<MoeMlp<T>*> moe_blocks;    // the MoE layers' FFN blocks (owned by `layers`)
  // projectRouters: per MoE layer the unit mean router inputs of the last steps, newest first.
  std::vector<std::vector<std::vector<double>>> router_means;
  std::unique_ptr<RingAttention> ring;  // context parallelism (setContextParallel), else null
  dist::Communicator* context_comm = nullptr;  // its group (not owned)
  MoeContext moe_context;                      // the MoE layers' view of the pass's shard
  // Grow-only storage behind the workspace handles.
  View1<double> arena;
  View1<token_t> tokens_store;
  View1<std::int32_t> labels_store, head_labels_store, rows_store;
  View1<seqlen_t> cu_store, position_store;
  View1<std::int32_t> labels_d;
  Work w;
  // placeRange: groups 0..L-1 the layers, L the embeddings, L+1 the head; each one's flat
  // range of tensors and where its views point now (nullptr: into params / grads).
  // bf16 policy: the group's compute copy is [clo, chi) of `packed` while at home (compute
  // nullptr), else at `compute`; `chunks` (device, num_chunks) are its cast segments (master
  // offset from lo, copy offset from clo, count).
  struct Place {
    std::int64_t lo = -1, hi = -1;
    T* params = nullptr;
    T* grads = nullptr;
    std::uint16_t* compute = nullptr;
    std::int64_t clo = 0, chi = 0;
    View1<std::int64_t> chunks;
    int num_chunks = 0;
  };
  std::vector<Place> places;
  std::int64_t buffer_elements = 0;  // of the whole buffers, also while they are freed
  // Where views "at home" point while a whole buffer is not held: params, grads, packed.
  ReservedRange home_range[3];

  char* reservedHome(int which, std::int64_t bytes) {
    if (!home_range[which].base()) home_range[which] = ReservedRange(std::size_t(bytes));
    return home_range[which].base();
  }
  T* paramsHome() {
    return params.extent(0) > 0
               ? params.data()
               : reinterpret_cast<T*>(reservedHome(0, buffer_elements * std::int64_t(sizeof(T))));
  }
  T* gradsHome() {
    return grads.extent(0) > 0
               ? grads.data()
               : reinterpret_cast<T*>(reservedHome(1, buffer_elements * std::int64_t(sizeof(T))));
  }
  std::uint16_t* packedHome() {
    return packed.extent(0) > 0
               ? packed.data()
               : reinterpret_cast<std::uint16_t*>(reservedHome(2, packed_elements * 2));
  }

  Impl(const Esm2Config& c, const ExpertPlacement& experts, ModelBuffers buffers)
      : config(c), held(experts), ctx(ExecSpace()) {
    config.validate();
    ctx.attention_kernel = config.attention;
    ctx.deterministic = config.deterministic;
    const bool whole_buffers = buffers == ModelBuffers::Whole;
    if (held.degree < 1 || held.rank < 0 || held.rank >= held.degree ||
        (held.sharded() && (!config.moe.enabled() || config.moe.experts % held.degree != 0)))
      throw collectiveError("parallel.expert_degree = " + std::to_string(held.degree) +
                            " must divide moe.experts = " + std::to_string(config.moe.experts) +
                            " of an MoE model (expert rank " + std::to_string(held.rank) + ")");
    // fp8 on the CUDA build: the bf16 policy with the FP8 GEMMs of gpu/fp8.hpp.
    bf16 =
        config.precision == Precision::Bf16 || (PLM_FP8_CUDA && config.precision == Precision::Fp8);
    if (bf16) {
#if PLM_HAVE_CUDA
      if (!std::is_same_v<T, float>)
        throw collectiveError("plm::model: bf16 compute runs on fp32 masters (Esm2<float>) only");
      if (config.hidden % 16 != 0 || config.ffn % 16 != 0)
        throw collectiveError("train.precision: bf16 needs model.hidden (" +
                              std::to_string(config.hidden) + ") and model.ffn (" +
                              std::to_string(config.ffn) +
                              ") to be multiples of 16 (cuBLASLt alignment)");
      if (config.hidden > 5120)
        throw collectiveError(
            "train.precision: bf16 supports model.hidden up to 5120 (the LayerNorm kernels); "
            "this model has " +
            std::to_string(config.hidden));
      compute = DType::BF16;
      stats = DType::F32;
      ctx.cuda();  // the cuBLASLt handle and the device loss accumulator, before the first call
#else
      throw collectiveError(
          "train.precision: bf16 runs on the CUDA build only (this build computes in fp32); set "
          "train.precision: fp32 or build with the `cuda` preset (doc/gpu.md)");
#endif
    }
    if (config.precision == Precision::Fp8) {
#if PLM_HAVE_CUDA && !PLM_FP8_CUDA
      throw collectiveError(
          "train.precision: fp8 needs the FP8 kernels of src/gpu/fp8.hpp, which this CUDA build "
          "lacks (doc/fp8.md); use train.precision: bf16 on the GPU or run fp8 on a CPU build");
#endif
      if (bf16 && config.moe.enabled() && config.moe.expert_ffn % 16 != 0)
        throw collectiveError("train.precision: fp8 with moe on the GPU needs moe.expert_ffn (" +
                              std::to_string(config.moe.expert_ffn) +
                              ") to be a multiple of 16 (the FP8 GEMMs' inner dimension)");
      // Dense slots (layers x 4), then two per routed expert of each MoE layer (up, down; a
      // SwiGLU expert's up is its stacked [gate; up] GEMM); a MoE layer's FFN slots serve its
      // shared experts.
      std::vector<int> moe_layers;
      for (int l = 0; l < config.num_layers; ++l)
        if (config.moe.isMoeLayer(l)) moe_layers.push_back(l);
      fp8_scaling = std::make_unique<Fp8Scaling>(config.fp8, config.num_layers, moe_layers,
                                                 config.moe.experts);
      fp8_slots.resize(std::size_t(config.num_layers) * fp8_gemms +
                       moe_layers.size() * std::size_t(config.moe.experts) * 2);
      for (int l = 0; l < config.num_layers; ++l)
        for (int g = 0; g < fp8_gemms; ++g)
          fp8_slots[l * fp8_gemms + g] = {fp8_scaling.get(), l, static_cast<Fp8Gemm>(g)};
      std::size_t at = std::size_t(config.num_layers) * fp8_gemms;
      for (int l : moe_layers)
        for (int e = 0; e < config.moe.experts; ++e)
          for (Fp8Gemm g : {Fp8Gemm::FfnIn, Fp8Gemm::FfnOut})
            fp8_slots[at++] = {fp8_scaling.get(), l, g, e};
    }
    if (config.lora.enabled() && config.precision == Precision::Fp8)
      throw collectiveError("lora.rank " + std::to_string(config.lora.rank) +
                            ": LoRA adapters under train.precision fp8 are not implemented; use "
                            "train.precision bf16 or fp32");
    if (config.lora.enabled() && bf16 && config.lora.rank % 8 != 0)
      throw collectiveError("lora.rank " + std::to_string(config.lora.rank) +
                            ": under train.precision bf16 the rank must be a multiple of 8 "
                            "(cuBLASLt alignment of the (out, r) B matrices); use 8, 16, 32, ...");
    tensors = tensorTable(config, held);
    for (std::size_t i = 0; i < tensors.size(); ++i) index[tensors[i].name] = i;
    const std::int64_t n = tableElements(tensors);
    buffer_elements = n;
    if (whole_buffers) {
      params = flatZeros<T>("plm::model::parameters", n);
      grads = flatZeros<T>("plm::model::gradients", n);
    }
    bind(whole_buffers);
    places.assign(config.num_layers + 2, Place());
    for (const auto& t : tensors) {
      Place& p = places[t.placeGroup(config.num_layers)];
      p.lo = p.lo < 0 ? t.offset : std::min(p.lo, t.offset);
      p.hi = std::max(p.hi, t.offset + t.size);
    }
    if (bf16) bindGroupCasts();
  }

  /// The group whose flat range starts in [offset, offset + count) and ends inside it.
  int groupStartingIn(std::int64_t offset, std::int64_t count) const {
    for (int g = 0; g < static_cast<int>(places.size()); ++g) {
      const auto& p = places[g];
      if (p.lo < offset || p.lo >= offset + count) continue;
      PLM_REQUIRE(p.hi <= offset + count, "plm::model::placeRange: [" + std::to_string(offset) +
                                              ", +" + std::to_string(count) +
                                              ") cuts a group of tensors in two");
      return g;
    }
    throw Error("plm::model::placeRange: no group of tensors starts in [" + std::to_string(offset) +
                ", +" + std::to_string(count) + ") (a bug)");
  }

  int groupAt(std::int64_t offset) const {
    for (int g = 0; g < static_cast<int>(places.size()); ++g)
      if (places[g].lo <= offset && offset < places[g].hi) return g;
    throw Error("plm::model: no group of tensors holds offset " + std::to_string(offset) +
                " (a bug)");
  }

  /// bf16: each group's cast segments and its contiguous range of the packed copy (bind()
  /// packs the embeddings, then layer by layer, then the head), so a group's compute copy can
  /// live outside `packed` (sharded data parallelism) and be cast from wherever its masters are.
  void bindGroupCasts() {
    const int groups = static_cast<int>(places.size());
    std::vector<std::vector<std::int64_t>> seg(groups);
    for (Place& p : places) p.clo = p.chi = -1;
    for (std::size_t i = 0; i < packed_seg.size(); i += 3) {
      Place& p = places[groupAt(packed_seg[i])];
      const std::int64_t d = packed_seg[i + 1], end = d + alignedElements(packed_seg[i + 2]);
      p.clo = p.clo < 0 ? d : std::min(p.clo, d);
      p.chi = std::max(p.chi, end);
      seg[&p - places.data()].insert(seg[&p - places.data()].end(),
                                     {packed_seg[i], d, packed_seg[i + 2]});
    }
    for (int g = 0; g < groups; ++g) {
      Place& p = places[g];
      if (p.clo < 0) p.clo = p.chi = 0;
      for (int q = 0; q < groups; ++q)  // the ranges must not interleave
        PLM_REQUIRE(q == g || places[q].clo < 0 || places[q].chi <= p.clo ||
                        places[q].clo >= p.chi || p.clo == p.chi,
                    "plm::model: the packed bf16 copy interleaves two groups (a bug)");
      std::vector<std::int64_t> host;
      constexpr std::int64_t kChunk = 16384;
      for (std::size_t i = 0; i < seg[g].size(); i += 3)
        for (std::int64_t o = 0; o < seg[g][i + 2]; o += kChunk)
          host.insert(host.end(), {seg[g][i] - p.lo + o, seg[g][i + 1] - p.clo + o,
                                   std::min(kChunk, seg[g][i + 2] - o)});
      p.num_chunks = static_cast<int>(host.size() / 3);
      p.chunks = View1<std::int64_t>("plm::model::group_compute_chunks", host.size());
      Kokkos::deep_copy(p.chunks,
                        Kokkos::View<const std::int64_t*, HostSpace>(host.data(), host.size()));
    }
    for (auto& [group, at] : fp8_cuda_at) {
      group = -1;
      for (int g = 0; g < groups && group < 0; ++g)
        if (places[g].clo <= at && at < places[g].chi) group = g;
      PLM_REQUIRE(group >= 0, "plm::model: an FP8 weight outside every group's copy (a bug)");
    }
  }

  /// CUDA fp8: the bf16 values of FP8 weight i, in its group's compute copy where it is now.
  const void* fp8CudaData(std::size_t i) {
    const auto [g, at] = fp8_cuda_at[i];
    const Place& p = places[g];
    const std::uint16_t* base = p.compute ? p.compute : packedHome() + p.clo;
    return base + (at - p.clo);
  }

  bool anyPlaced() const {
    for (const Place& p : places)
      if (p.params != nullptr || p.compute != nullptr) return true;
    return false;
  }

  /// bf16: group g's compute copy cast from where its masters are now.
  void refreshGroup(int g, bool cast_fp8 = true) {
#if PLM_HAVE_CUDA
    if constexpr (std::is_same_v<T, float>) {
      const Place& p = places[g];
      const T* src = p.params ? p.params : paramsHome() + p.lo;
      std::uint16_t* dst = p.compute ? p.compute : packedHome() + p.clo;
      gpu::castChunks(ctx.space().cuda_stream(), src, reinterpret_cast<gpu::bf16*>(dst),
                      p.chunks.data(), p.num_chunks);
      ctx.mark(OpKind::Other);
#if PLM_FP8_CUDA
      if (fp8_scaling && cast_fp8) castFp8Weights(g);  // the group's codes from its bf16 copy
#endif
    }
#else
    (void)g;
#endif
    (void)cast_fp8;
  }

  /// Moves group g's views from where they point now to `to_params` / `to_grads` (and, bf16,
  /// its compute copy's views to `to_compute`; nullptr: home).
  void place(int g, T* to_params, T* to_grads, std::uint16_t* to_compute = nullptr) {
    Place& p = places[g];
    if (bf16) {
      const auto cbytes = static_cast<std::size_t>(p.chi - p.clo) * 2;
      char* home = reinterpret_cast<char*>(packedHome() + p.clo);
      const Relocation rc{p.compute ? reinterpret_cast<const char*>(p.compute) : home, cbytes,
                          to_compute ? reinterpret_cast<char*>(to_compute) : home};
      p.compute = to_compute;
      relocateGroup(g, rc);
    }
    const std::size_t bytes = static_cast<std::size_t>(p.hi - p.lo) * sizeof(T);
    T* from_params = p.params ? p.params : paramsHome() + p.lo;
    T* from_grads = p.grads ? p.grads : gradsHome() + p.lo;
    const Relocation rp{reinterpret_cast<const char*>(from_params), bytes,
                        reinterpret_cast<char*>(to_params ? to_params : paramsHome() + p.lo)};
    const Relocation rg{reinterpret_cast<const char*>(from_grads), bytes,
                        reinterpret_cast<char*>(to_grads ? to_grads : gradsHome() + p.lo)};
    p.params = to_params;
    p.grads = to_grads;
    for (const Relocation& r : {rp, rg}) relocateGroup(g, r);
    // CUDA fp8: a LayerNorm's fused cast is keyed by its gamma's address, which another
    // layer's gamma may have held in this buffer (layer slots are reused).
    ctx.forgetFp8Readers(rp.to, bytes);
  }

  void relocateGroup(int g, const Relocation& r) {
    if (g < config.num_layers) {
      layers[g].relocate(r);
    } else if (g == config.num_layers) {
      r(pw.embed);
      r(pg.embed);
    } else {
      for (Outer* o : {&pw, &pg}) {
        for (Vec* v :
             {&o->lnf_g, &o->lnf_b, &o->head_b, &o->head_ln_g, &o->head_ln_b, &o->head_bias})
          r(*v);
        r(o->head_w);
      }
    }
  }

  const TensorInfo& info(const std::string& name) const { return tensors[index.at(name)]; }
  /// A model holding part of the experts computes only inside its expert group.
  void requireHeldExperts() const {
    if (params.extent(0) == 0)  // no whole buffer: every group must read placed views
      for (const Place& p : places)
        PLM_REQUIRE(p.params != nullptr,
                    "plm::model: a pass on a model without its whole parameter buffer, with a "
                    "group of tensors not placed (Esm2::placeRange; a bug)");
    if (held.sharded() && !expert_parallel)
      throw Error("plm::model: this model holds the experts of rank " + std::to_string(held.rank) +
                  " of " + std::to_string(held.degree) +
                  " only; give it its expert group (setExpertParallel) before a pass (a bug)");
  }
  // fp8_slots[i] is the GEMM whose operands are scaling tensors 3i, 3i + 1, 3i + 2.
  Fp8GemmSlot* denseSlot(int layer, Fp8Gemm g) {
    return &fp8_slots[fp8_scaling->index(layer, g, Fp8Operand::Input) / fp8_operands];
  }
  /// Routed expert `e`'s up (FfnIn) or down (FfnOut) GEMM in MoE layer `layer`.
  Fp8GemmSlot* expertSlot(int layer, int e, Fp8Gemm g) {
    return &fp8_slots[fp8_scaling->expertIndex(layer, e, g, Fp8Operand::Input) / fp8_operands];
  }
  /// The FFNs of an MoE layer that own FP8 GEMMs: its routed experts, then its shared experts.
  static std::vector<DenseMlpWeights*> moeMlps(MoeWeights& m) {
    std::vector<DenseMlpWeights*> out;
    for (auto& e : m.experts)
      if (e.w1.rows > 0) out.push_back(&e);  // held by this rank
    if (!m.shared.w1.empty()) out.push_back(&m.shared);
    return out;
  }
  Mat masterMat(T* base, const std::string& name) {
    const auto& t = info(name);
    return Mat{base + t.offset, master, t.shape[0], t.shape[1], t.shape[1]};
  }
  Vec masterVec(T* base, const std::string& name) {
    const auto& t = info(name);
    return Vec{base + t.offset, master, t.shape[0]};
  }

  /// Lays out the packed bf16 copy (bf16 policy) and binds every handle: weights to the compute
  /// copy or the masters, gradients to the gradient buffer.
  void bind(bool whole_buffers) {
    T* const P = paramsHome();
    T* const G = gradsHome();
    std::vector<std::int64_t> seg;  // src offset, dst offset, count
    std::int64_t dst = 0;
    struct Pending {
      std::string name;
      std::int64_t at;
    };
    auto pack = [&](const std::string& name) {
      const auto& t = info(name);
      PLM_REQUIRE(t.copy == ComputeCopy::Packed || t.copy == ComputeCopy::PackedFp8,
                  "plm::model: the tensor table keeps " + name + " out of the packed copy (a bug)");
      seg.insert(seg.end(), {t.offset, dst, t.size});
      const std::int64_t at = dst;
      dst += alignedElements(t.size);
      return at;
    };
    // bf16 handles refer to offsets until the packed buffer exists.
    auto weight = [&](const std::string& name) -> Mat {
      if (!bf16) return masterMat(P, name);
      const auto& t = info(name);
      return Mat{reinterpret_cast<void*>(pack(name)), DType::BF16, t.shape[0], t.shape[1],
                 t.shape[1]};
    };
    auto bias = [&](const std::string& name) -> Vec {  // bias of a bf16-output GEMM
      if (!bf16) return masterVec(P, name);
      return Vec{reinterpret_cast<void*>(pack(name)), DType::BF16, info(name).shape[0]};
    };
    auto stacked = [&](const std::string& p, Mat& fw, Vec& fb) {
      const std::int64_t h = config.hidden;
      const std::int64_t w_at = dst;  // q, k, v weights back to back: (3H, H)
      for (const char* part : {"query", "key", "value"}) {
        const auto& t = info(p + part + ".weight");
        PLM_REQUIRE(t.copy == ComputeCopy::QkvWeight,
                    "plm::model: " + t.name + " not stacked (a bug)");
        seg.insert(seg.end(), {t.offset, dst, t.size});
        dst += t.size;
      }
      dst = alignedElements(dst);
      const std::int64_t b_at = dst;
      for (const char* part : {"query", "key", "value"}) {
        const auto& t = info(p + part + ".bias");
        PLM_REQUIRE(t.copy == ComputeCopy::QkvBias,
                    "plm::model: " + t.name + " not stacked (a bug)");
        seg.insert(seg.end(), {t.offset, dst, t.size});
        dst += t.size;
      }
      dst = alignedElements(dst);
      fw = Mat{reinterpret_cast<void*>(w_at), DType::BF16, 3 * h, h, h};
      fb = Vec{reinterpret_cast<void*>(b_at), DType::BF16, 3 * h};
    };

    pw.embed = weight("esm.embeddings.word_embeddings.weight");
    pg.embed = masterMat(G, "esm.embeddings.word_embeddings.weight");
    std::vector<AttentionWeights> aw(config.num_layers);
    std::vector<AttentionGrads> ag(config.num_layers);
    std::vector<DenseMlpWeights> mw(config.num_layers);
    std::vector<DenseMlpGrads> mg(config.num_layers);
    std::vector<LayerNormParams> ln2(config.num_layers), ln2g(config.num_layers);
    std::vector<MoeWeights> moe_w(config.num_layers), moe_g(config.num_layers);
    std::vector<LayerLora> lw(config.num_layers);
    // fp8 weights refer to offsets into fp8_weights until it exists.
    std::int64_t fp8_at = 0;
    fp8_list.clear();
    auto fp8Weight = [&](Fp8GemmSlot* slot, const std::vector<std::string>& names) -> Mat {
      Fp8Weight fw{slot, fp8_at, 0, 0, {}};
      for (const auto& name : names) {
        const auto& t = info(name);
        fw.from.push_back(t.offset);
        fw.rows += t.shape[0];
        fw.cols = t.shape[1];
      }
      fp8_list.push_back(fw);
      fp8_at += fw.rows * fw.cols;
      return Mat{reinterpret_cast<void*>(fw.at), master, fw.rows, fw.cols, fw.cols, fw.slot};
    };
    // MoE layers: the router in the master type; under bf16 the experts' packed bf16 copies
    // (an expert's output is bf16, so its b2 too; the shared experts add into the fp32 stream).
    // Under fp8 (an FP8 layer) the expert and shared-expert weights carry their slots: the
    // quantised copy on the CPU, the packed bf16 copy (and bf16 biases) on CUDA.
    auto bindMoe = [&](int l, const std::string& p, MoeWeights& mwt, MoeWeights& mgt) {
      const bool fp8 = fp8_scaling && config.fp8.fp8Layer(l, config.num_layers);
      auto dense = [&](const std::string& x, DenseMlpWeights& dw, DenseMlpWeights& dg,
                       Fp8GemmSlot* up, Fp8GemmSlot* down) {
        const bool shared = x == p + "shared_experts.";
        if (!shared && config.moe.swiglu()) {
          // [gate; up] as one (2 F_e, H) matrix: adjacent in the masters (tensorTable) and, under
          // bf16, packed back to back.
          const auto& gate = info(x + "gate_proj.weight");
          const auto& upw = info(x + "up_proj.weight");
          PLM_REQUIRE(upw.offset == gate.offset + gate.size,
                      "plm::model: SwiGLU gate_proj and up_proj not adjacent (a bug)");
          // Under fp8 the stacked matrix is one FP8 GEMM weight with one scale, as the dense
          // layers' stacked q/k/v: the CPU quantises a copy of both halves, CUDA casts the packed
          // bf16 pair (bindFp8Cuda) as one (2 F_e, H) tensor.
          dw.w1 = fp8 && !bf16 ? fp8Weight(up, {x + "gate_proj.weight", x + "up_proj.weight"})
                               : weight(x + "gate_proj.weight");
          if (bf16) {
            const Mat up_at = weight(x + "up_proj.weight");
            PLM_REQUIRE(reinterpret_cast<std::int64_t>(up_at.data) ==
                            reinterpret_cast<std::int64_t>(dw.w1.data) + gate.size,
                        "plm::model: SwiGLU gate_proj and up_proj not packed back to back (a bug)");
          }
          dw.w1.rows = 2 * gate.shape[0];
          dw.w2 = fp8 && !bf16 ? fp8Weight(down, {x + "down_proj.weight"})
                               : weight(x + "down_proj.weight");
          dw.b1 = Vec{};
          dw.b2 = Vec{};
          if (fp8 && bf16) {
            dw.w1.fp8 = up;
            dw.w2.fp8 = down;
          }
          dg.w1 = masterMat(G, x + "gate_proj.weight");
          dg.w1.rows = 2 * gate.shape[0];
          dg.w2 = masterMat(G, x + "down_proj.weight");
          dg.b1 = Vec{};
          dg.b2 = Vec{};
          return;
        }
        dw.w1 = fp8 && !bf16 ? fp8Weight(up, {x + "intermediate.dense.weight"})
                             : weight(x + "intermediate.dense.weight");
        dw.b1 = bias(x + "intermediate.dense.bias");
        dw.w2 = fp8 && !bf16 ? fp8Weight(down, {x + "output.dense.weight"})
                             : weight(x + "output.dense.weight");
        dw.b2 = shared && !(fp8 && bf16) ? masterVec(P, x + "output.dense.bias")
                                         : bias(x + "output.dense.bias");
        if (fp8 && bf16) {
          dw.w1.fp8 = up;
          dw.w2.fp8 = down;
        }
        dg.w1 = masterMat(G, x + "intermediate.dense.weight");
        dg.b1 = masterVec(G, x + "intermediate.dense.bias");
        dg.w2 = masterMat(G, x + "output.dense.weight");
        dg.b2 = masterVec(G, x + "output.dense.bias");
      };
      mwt.router = masterMat(P, p + "router.weight");
      mgt.router = masterMat(G, p + "router.weight");
      if (config.moe.bias_balance) mwt.expert_bias = masterVec(P, p + "router.expert_bias");
      mwt.experts.resize(config.moe.experts);  // other ranks' experts stay empty (rows 0)
      mgt.experts.resize(config.moe.experts);
      for (int e = 0; e < config.moe.experts; ++e)
        if (held.holds(e, config.moe.experts))
          dense(p + "experts." + std::to_string(e) + ".", mwt.experts[e], mgt.experts[e],
                fp8 ? expertSlot(l, e, Fp8Gemm::FfnIn) : nullptr,
                fp8 ? expertSlot(l, e, Fp8Gemm::FfnOut) : nullptr);
      if (config.moe.shared_experts > 0)
        dense(p + "shared_experts.", mwt.shared, mgt.shared,
              fp8 ? denseSlot(l, Fp8Gemm::FfnIn) : nullptr,
              fp8 ? denseSlot(l, Fp8Gemm::FfnOut) : nullptr);
    };
    for (int l = 0; l < config.num_layers; ++l) {
      const std::string pre = "esm.encoder.layer." + std::to_string(l) + ".";
      const std::string self = pre + "attention.self.";
      auto& a = aw[l];
      if (bf16) {
        stacked(self, a.qkv.fused_w, a.qkv.fused_b);
      } else {
        a.qkv.wq = masterMat(P, self + "query.weight");
        a.qkv.wk = masterMat(P, self + "key.weight");
        a.qkv.wv = masterMat(P, self + "value.weight");
        a.qkv.bq = masterVec(P, self + "query.bias");
        a.qkv.bk = masterVec(P, self + "key.bias");
        a.qkv.bv = masterVec(P, self + "value.bias");
      }
      a.wo = weight(pre + "attention.output.dense.weight");
      a.bo = masterVec(P, pre + "attention.output.dense.bias");
      a.ln_g = masterVec(P, pre + "attention.LayerNorm.weight");
      a.ln_b = masterVec(P, pre + "attention.LayerNorm.bias");
      auto& g = ag[l];
      g.qkv.wq = masterMat(G, self + "query.weight");
      g.qkv.wk = masterMat(G, self + "key.weight");
      g.qkv.wv = masterMat(G, self + "value.weight");
      g.qkv.bq = masterVec(G, self + "query.bias");
      g.qkv.bk = masterVec(G, self + "key.bias");
      g.qkv.bv = masterVec(G, self + "value.bias");
      g.wo = masterMat(G, pre + "attention.output.dense.weight");
      g.bo = masterVec(G, pre + "attention.output.dense.bias");
      g.ln_g = masterVec(G, pre + "attention.LayerNorm.weight");
      g.ln_b = masterVec(G, pre + "attention.LayerNorm.bias");
      if (config.moe.isMoeLayer(l)) {
        bindMoe(l, pre + "moe.", moe_w[l], moe_g[l]);
      } else {
        mw[l].w1 = weight(pre + "intermediate.dense.weight");
        mw[l].b1 = bias(pre + "intermediate.dense.bias");
        mw[l].w2 = weight(pre + "output.dense.weight");
        mw[l].b2 = masterVec(P, pre + "output.dense.bias");
        mg[l].w1 = masterMat(G, pre + "intermediate.dense.weight");
        mg[l].b1 = masterVec(G, pre + "intermediate.dense.bias");
        mg[l].w2 = masterMat(G, pre + "output.dense.weight");
        mg[l].b2 = masterVec(G, pre + "output.dense.bias");
      }
      if (fp8_scaling && bf16 && config.fp8.fp8Layer(l, config.num_layers)) {
        // CUDA: the packed bf16 weights carry the slot; FP8 GEMMs take bf16 biases.
        a.qkv.fused_w.fp8 = denseSlot(l, Fp8Gemm::Qkv);
        a.wo.fp8 = denseSlot(l, Fp8Gemm::AttnOut);
        a.bo = bias(pre + "attention.output.dense.bias");
        if (!config.moe.isMoeLayer(l)) {  // an MoE layer's FFN slots went to its shared experts
          mw[l].w1.fp8 = denseSlot(l, Fp8Gemm::FfnIn);
          mw[l].w2.fp8 = denseSlot(l, Fp8Gemm::FfnOut);
          mw[l].b2 = bias(pre + "output.dense.bias");
        }
      } else if (fp8_scaling && config.fp8.fp8Layer(l, config.num_layers)) {
        const Mat qkv =
            fp8Weight(denseSlot(l, Fp8Gemm::Qkv),
                      {self + "query.weight", self + "key.weight", self + "value.weight"});
        const std::int64_t h = config.hidden;
        Mat* parts[3] = {&a.qkv.wq, &a.qkv.wk, &a.qkv.wv};
        for (int i = 0; i < 3; ++i) {  // rows [i H, (i + 1) H) of the stacked copy
          *parts[i] = qkv;
          parts[i]->rows = h;
          parts[i]->data =
              reinterpret_cast<void*>(reinterpret_cast<std::intptr_t>(qkv.data) + i * h * h);
        }
        a.wo = fp8Weight(denseSlot(l, Fp8Gemm::AttnOut), {pre + "attention.output.dense.weight"});
        if (!config.moe.isMoeLayer(l)) {
          mw[l].w1 = fp8Weight(denseSlot(l, Fp8Gemm::FfnIn), {pre + "intermediate.dense.weight"});
          mw[l].w2 = fp8Weight(denseSlot(l, Fp8Gemm::FfnOut), {pre + "output.dense.weight"});
        }
      }
      ln2[l] = {masterVec(P, pre + "LayerNorm.weight"), masterVec(P, pre + "LayerNorm.bias")};
      ln2g[l] = {masterVec(G, pre + "LayerNorm.weight"), masterVec(G, pre + "LayerNorm.bias")};
      lw[l].scale = config.lora.scale();
      auto adapter = [&](LoraAdapter& ad, const std::string& prefix) {
        if (!index.count(prefix + ".lora_A.weight")) return;  // not a target here
        ad.a = weight(prefix + ".lora_A.weight");
        ad.b = weight(prefix + ".lora_B.weight");
        ad.ga = masterMat(G, prefix + ".lora_A.weight");
        ad.gb = masterMat(G, prefix + ".lora_B.weight");
      };
      adapter(lw[l].q, self + "query");
      adapter(lw[l].k, self + "key");
      adapter(lw[l].v, self + "value");
      adapter(lw[l].o, pre + "attention.output.dense");
      adapter(lw[l].ffn_in, pre + "intermediate.dense");
      adapter(lw[l].ffn_out, pre + "output.dense");
    }
    pw.head_w = weight("lm_head.dense.weight");
    pw.head_b = bias("lm_head.dense.bias");
    for (Outer* o : {&pw, &pg}) {
      T* buf = o == &pw ? P : G;
      o->lnf_g = masterVec(buf, "esm.encoder.emb_layer_norm_after.weight");
      o->lnf_b = masterVec(buf, "esm.encoder.emb_layer_norm_after.bias");
      o->head_ln_g = masterVec(buf, "lm_head.layer_norm.weight");
      o->head_ln_b = masterVec(buf, "lm_head.layer_norm.bias");
      o->head_bias = masterVec(buf, "lm_head.bias");
    }
    pg.head_w = masterMat(G, "lm_head.dense.weight");
    pg.head_b = masterVec(G, "lm_head.dense.bias");

    if (bf16) {
      packed_elements = dst;
      if (whole_buffers)
        packed = flatZeros<std::uint16_t>("plm::model::compute_weights", packed_elements);
      auto* base = reinterpret_cast<char*>(packedHome());
      auto rebase = [&](auto& h) {
        if (h.dtype == DType::BF16) h.data = base + 2 * reinterpret_cast<std::intptr_t>(h.data);
      };
      auto rebaseMlp = [&](DenseMlpWeights& e) {
        rebase(e.w1);
        rebase(e.b1);
        rebase(e.w2);
        rebase(e.b2);
      };
      rebase(pw.embed);
      rebase(pw.head_w);
      rebase(pw.head_b);
      for (int l = 0; l < config.num_layers; ++l) {
        rebase(aw[l].qkv.fused_w);
        rebase(aw[l].qkv.fused_b);
        rebase(aw[l].wo);
        rebase(aw[l].bo);  // bf16 only for an FP8 layer
        for (LoraAdapter* ad : lw[l].adapters()) {
          rebase(ad->a);
          rebase(ad->b);
        }
        if (config.moe.isMoeLayer(l)) {
          rebaseMlp(moe_w[l].shared);
          for (auto& e : moe_w[l].experts)
            if (e.w1.rows > 0) rebaseMlp(e);  // held by this rank
          continue;
        }
        rebase(mw[l].w1);
        rebase(mw[l].b1);
        rebase(mw[l].w2);
        rebase(mw[l].b2);
      }
      std::vector<std::int64_t> host_chunks;
      constexpr std::int64_t kChunk = 16384;
      for (std::size_t i = 0; i < seg.size(); i += 3)
        for (std::int64_t o = 0; o < seg[i + 2]; o += kChunk)
          host_chunks.insert(host_chunks.end(),
                             {seg[i] + o, seg[i + 1] + o, std::min(kChunk, seg[i + 2] - o)});
      num_chunks = static_cast<int>(host_chunks.size() / 3);
      packed_seg = seg;
      chunks = View1<std::int64_t>("plm::model::compute_chunks", host_chunks.size());
      Kokkos::deep_copy(chunks, Kokkos::View<const std::int64_t*, HostSpace>(host_chunks.data(),
                                                                             host_chunks.size()));
      if (fp8_scaling) bindFp8Cuda(aw, mw, moe_w);
    }

    if (fp8_scaling && !bf16) {
      fp8_weights = View1<T>("plm::model::fp8_weights", fp8_at);
      auto rebase = [&](Mat& m) {
        if (m.fp8) m.data = fp8_weights.data() + reinterpret_cast<std::intptr_t>(m.data);
      };
      for (int l = 0; l < config.num_layers; ++l) {
        rebase(aw[l].qkv.wq);
        rebase(aw[l].qkv.wk);
        rebase(aw[l].qkv.wv);
        rebase(aw[l].wo);
        rebase(mw[l].w1);
        rebase(mw[l].w2);
        for (DenseMlpWeights* e : moeMlps(moe_w[l])) {
          rebase(e->w1);
          rebase(e->w2);
        }
      }
    }

    LayerShape shape;
    shape.heads = config.heads;
    shape.eps = config.layer_norm_eps;
    layers.clear();
    layers.reserve(config.num_layers);
    moe_blocks.clear();
    for (int l = 0; l < config.num_layers; ++l) {
      std::unique_ptr<FfnBlock> ffn;
      if (config.moe.isMoeLayer(l)) {
        auto block = std::make_unique<MoeMlp<T>>(l, config.moe, config.hidden, moe_w[l], moe_g[l],
                                                 &moe_step);
        moe_blocks.push_back(block.get());
        ffn = std::move(block);
      } else {
        ffn = std::make_unique<DenseMlp>(mw[l], mg[l]);
      }
      layers.emplace_back(shape, aw[l], ag[l], ln2[l], ln2g[l], std::move(ffn));
      if (config.lora.enabled()) layers.back().setLora(lw[l]);
    }
  }

  void refreshCompute() {
    if (fp8_scaling && !bf16) refreshFp8();
    if (!bf16) return;
    if (anyPlaced()) {  // groups live in outside buffers: one cast per group
#if PLM_FP8_CUDA
      if (fp8_scaling) uploadFp8Scales();
#endif
      for (int g = 0; g < static_cast<int>(places.size()); ++g) refreshGroup(g);
      return;
    }
#if PLM_HAVE_CUDA
    if constexpr (std::is_same_v<T, float>) {
      gpu::castChunks(ctx.space().cuda_stream(), params.data(),
                      reinterpret_cast<gpu::bf16*>(packed.data()), chunks.data(), num_chunks);
      ctx.mark(OpKind::Other);
    }
#endif
#if PLM_FP8_CUDA
    if (fp8_scaling) refreshFp8Cuda();
#endif
  }

  /// CUDA fp8: device scales and amaxes per slot, E4M3 codes of each FP8 weight and of its
  /// transpose (256-byte aligned), pointed to by the slots.
  void bindFp8Cuda(const std::vector<AttentionWeights>& aw, const std::vector<DenseMlpWeights>& mw,
                   std::vector<MoeWeights>& moe_w) {
    fp8_cuda_weights.clear();
    fp8_cuda_at.clear();
    for (int l = 0; l < config.num_layers; ++l) {
      if (!config.fp8.fp8Layer(l, config.num_layers)) continue;
      std::vector<const Mat*> gemms = {&aw[l].qkv.fused_w, &aw[l].wo};
      if (config.moe.isMoeLayer(l)) {
        for (const DenseMlpWeights* e : moeMlps(moe_w[l]))
          gemms.insert(gemms.end(), {&e->w1, &e->w2});
      } else {
        gemms.insert(gemms.end(), {&mw[l].w1, &mw[l].w2});
      }
      for (const Mat* m : gemms) {
        fp8_cuda_weights.emplace_back(const_cast<Fp8GemmSlot*>(m->fp8), *m);
        fp8_cuda_at.emplace_back(-1, static_cast<const std::uint16_t*>(m->data) - packedHome());
      }
    }
    auto padded = [](std::int64_t n) { return (n + 255) / 256 * 256; };
    // Block scaling: each copy's 128x128 scale_inv follows its codes (ops.cpp reads them there).
    auto copy = [&](std::int64_t rows, std::int64_t cols) {
#if PLM_FP8_CUDA
      if (config.fp8.recipe == Fp8Recipe::Block)
        return padded(static_cast<std::int64_t>(
            gpu::fp8BlockTensorBytes(gpu::Fp8ScaleMode::Block128x128, rows, cols)));
#endif
      return padded(rows * cols);
    };
    std::int64_t bytes = 0;
    std::vector<std::int64_t> at;
    for (const auto& w : fp8_cuda_weights) {
      at.push_back(bytes);
      bytes += copy(w.second.rows, w.second.cols) + copy(w.second.cols, w.second.rows);
    }
    fp8_codes = View1<std::uint8_t>("plm::model::fp8_codes", bytes);
    const std::int64_t slots = static_cast<std::int64_t>(fp8_slots.size());
    fp8_dev_scales = View1<float>("plm::model::fp8_scales", slots * 6 * Fp8GemmSlot::kScaleStride);
    fp8_dev_amax = View1<float>("plm::model::fp8_amax", slots * 3);
    Kokkos::deep_copy(fp8_dev_scales, 1.0f);
    for (std::int64_t i = 0; i < slots; ++i) {
      fp8_slots[i].scales = fp8_dev_scales.data() + 6 * Fp8GemmSlot::kScaleStride * i;
      fp8_slots[i].amaxes = fp8_dev_amax.data() + 3 * i;
    }
    for (std::size_t i = 0; i < fp8_cuda_weights.size(); ++i) {
      Fp8GemmSlot* slot = fp8_cuda_weights[i].first;
      const Mat& m = fp8_cuda_weights[i].second;
      slot->w_codes = fp8_codes.data() + at[i];
      slot->wt_codes = fp8_codes.data() + at[i] + copy(m.rows, m.cols);
    }
  }

#if PLM_FP8_CUDA
  /// CUDA fp8, once per step: this step's delayed scales to the device, then every FP8
  /// weight's codes (and transpose) from the fresh bf16 copy, its amax recorded.
  void refreshFp8Cuda() {
    uploadFp8Scales();
    castFp8Weights(-1);
  }

  /// CUDA fp8: this step's delayed scales to the device (once per step, before the casts).
  void uploadFp8Scales() {
    const auto stream = ctx.space().cuda_stream();
    const Fp8Scaling& st = *fp8_scaling;
    const int slots = static_cast<int>(fp8_slots.size());
    fp8_host.assign(std::size_t(slots) * 6 * Fp8GemmSlot::kScaleStride, 1.0f);
    for (int i = 0; i < slots; ++i)
      for (int o = 0; o < fp8_operands; ++o) {
        const int t = fp8_slots[i].index(static_cast<Fp8Operand>(o));
        fp8_host[Fp8GemmSlot::kScaleStride * (6 * i + 2 * o)] = st.scale(t);
        fp8_host[Fp8GemmSlot::kScaleStride * (6 * i + 2 * o + 1)] = st.scaleInv(t);
      }
    PLM_CHECK_CUDA(cudaMemcpyAsync(fp8_dev_scales.data(), fp8_host.data(),
                                   fp8_host.size() * sizeof(float), cudaMemcpyHostToDevice,
                                   stream));
    PLM_CHECK_CUDA(cudaStreamSynchronize(stream));  // fp8_host is pageable and reused
  }

  /// CUDA fp8: the E4M3 codes (and transposed codes) of group g's FP8 weights (-1: all) from
  /// their bf16 copy, with the uploaded scales; delayed scaling max-accumulates the amaxes
  /// (a weight cast twice in a step, e.g. gathered again for its backward, records the same).
  void castFp8Weights(int group) {
    const auto stream = ctx.space().cuda_stream();
    const Fp8Scaling& st = *fp8_scaling;
    const int w = static_cast<int>(Fp8Operand::Weight);
    for (std::size_t i = 0; i < fp8_cuda_weights.size(); ++i) {
      if (group >= 0 && fp8_cuda_at[i].first != group) continue;
      Fp8GemmSlot* slot = fp8_cuda_weights[i].first;
      Mat m = fp8_cuda_weights[i].second;
      m.data = const_cast<void*>(fp8CudaData(i));
      if (st.config().recipe == Fp8Recipe::Block) {  // 128x128 blocks, the scales after the codes
        gpu::Fp8BlockCastArgs a;
        a.rows = m.rows;
        a.cols = m.cols;
        a.in = m.data;
        a.in_type = gpu::DType::BF16;
        a.ld_in = m.ld;
        a.out_type = gpu::DType::E4M3;
        a.scaling = gpu::Fp8ScaleMode::Block128x128;
        a.out = const_cast<void*>(slot->w_codes);
        a.ld_out = m.cols;
        a.scale_inv = gpu::fp8BlockTensorScales(a.out, m.rows, m.cols);
        a.out_t = const_cast<void*>(slot->wt_codes);
        a.ld_out_t = m.rows;
        a.scale_inv_t = gpu::fp8BlockTensorScales(a.out_t, m.cols, m.rows);
        gpu::castFp8Block(stream, a);
        continue;
      }
      gpu::Fp8CastArgs a;
      a.rows = m.rows;
      a.cols = m.cols;
      a.in = m.data;
      a.in_type = gpu::DType::BF16;
      a.ld_in = m.ld;
      a.out_type = gpu::DType::E4M3;
      a.out = const_cast<void*>(slot->w_codes);
      a.ld_out = m.cols;
      a.out_t = const_cast<void*>(slot->wt_codes);
      a.ld_out_t = m.rows;
      a.scale_inv = slot->scaleInv(w);
      a.amax = slot->amaxes + w;
      if (st.config().recipe == Fp8Recipe::Current) {
        gpu::castFp8Current(stream, a, slot->scale(w));
      } else {
        a.scale = slot->scale(w);
        a.amax_accumulate = true;
        gpu::castFp8(stream, a);
      }
    }
    ctx.mark(OpKind::Other);
  }
#endif

  /// The end of a training step under fp8: the device amaxes (CUDA) into the host state, then
  /// Fp8Scaling::endStep (one all-reduce).
  void endFp8Step(MPI_Comm comm) {
#if PLM_FP8_CUDA
    if (bf16 && config.fp8.recipe == Fp8Recipe::Delayed) {
      const auto stream = ctx.space().cuda_stream();
      fp8_host.assign(fp8_dev_amax.extent(0), 0.0f);
      PLM_CHECK_CUDA(cudaMemcpyAsync(fp8_host.data(), fp8_dev_amax.data(),
                                     fp8_host.size() * sizeof(float), cudaMemcpyDeviceToHost,
                                     stream));
      PLM_CHECK_CUDA(cudaStreamSynchronize(stream));
      PLM_CHECK_CUDA(
          cudaMemsetAsync(fp8_dev_amax.data(), 0, fp8_host.size() * sizeof(float), stream));
      for (std::size_t i = 0; i < fp8_slots.size(); ++i)
        for (int o = 0; o < fp8_operands; ++o)
          fp8_scaling->record(fp8_slots[i].index(static_cast<Fp8Operand>(o)), fp8_host[3 * i + o]);
    }
#endif
    fp8_scaling->endStep(comm);
  }

  /// The quantised weight copy from the masters: each GEMM's weight (q, k, v as one) is
  /// gathered and quantised as one tensor; under delayed scaling its amax is recorded for the
  /// step (recording it twice in one step, e.g. by an evaluation, changes nothing: it is a max).
  void refreshFp8() {
    // Sharded (no whole masters): the engine decodes each gathered unit's codes into the copy.
    if (params.extent(0) == 0) return;
    const auto& space = ctx.space();
    for (const auto& fw : fp8_list) {
      const std::int64_t part = (fw.rows / static_cast<std::int64_t>(fw.from.size())) * fw.cols;
      for (std::size_t i = 0; i < fw.from.size(); ++i) {
        const auto src = Kokkos::subview(params, std::make_pair(fw.from[i], fw.from[i] + part));
        const std::int64_t at = fw.at + static_cast<std::int64_t>(i) * part;
        Kokkos::deep_copy(space, Kokkos::subview(fp8_weights, std::make_pair(at, at + part)), src);
      }
      const View2<T> w(fp8_weights.data() + fw.at, fw.rows, fw.cols);
      fp8QuantizeOperand(space, *fw.slot, Fp8Operand::Weight, Fp8Blocks::Square, true, w, w);
    }
  }

  void ensureRotary(int max_len) {
    if (static_cast<int>(cos_table.extent(0)) >= max_len) return;
    const int positions = std::max(max_len, config.max_positions);
    const int half = config.headDim() / 2;
    cos_table = View2<T>("plm::model::rotary_cos", positions, half);
    sin_table = View2<T>("plm::model::rotary_sin", positions, half);
    rotaryTables(ctx.space(), config.headDim(), cos_table, sin_table);
  }

  LayerActs fullActs(Carver& c, std::int64_t t) {
    const std::int64_t h = config.hidden, f = config.ffn, nh = config.heads;
    LayerActs a;
    a.ln1 = c.mat(t, h, compute);
    a.mean1 = c.vec(t, stats);
    a.rstd1 = c.vec(t, stats);
    a.qkv = c.qkv(t, h, compute, bf16);
    a.o = c.mat(t, h, compute);
    a.lse = c.mat(t, nh, stats);
    a.xmid = c.mat(t, h, master);
    a.ln2 = c.mat(t, h, compute);
    a.mean2 = c.vec(t, stats);
    a.rstd2 = c.vec(t, stats);
    a.pre = c.mat(t, f, compute);
    a.act = c.mat(t, f, compute);
    return a;
  }

  void carve(Carver& c, std::int64_t t, std::int64_t m, bool backward) {
    const std::int64_t h = config.hidden, f = config.ffn, nh = config.heads, v = config.vocab;
    const int layers_n = config.num_layers;
    w.batch.mult = c.vec(t, master);
    w.xs.assign(layers_n + 1, Mat());
    for (auto& x : w.xs) x = c.mat(t, h, master);
    const Recompute mode = backward ? config.recompute : Recompute::Layer;
    if (mode == Recompute::None) {
      w.acts.clear();
      for (int l = 0; l < layers_n; ++l) w.acts.push_back(fullActs(c, t));
    } else if (mode == Recompute::Layer) {
      w.acts.assign(1, fullActs(c, t));
    } else {  // Selective: GEMM outputs per layer, the rest shared
      LayerActs shared;
      shared.ln1 = c.mat(t, h, compute);
      shared.mean1 = c.vec(t, stats);
      shared.rstd1 = c.vec(t, stats);
      shared.o = c.mat(t, h, compute);
      shared.lse = c.mat(t, nh, stats);
      shared.ln2 = c.mat(t, h, compute);
      shared.mean2 = c.vec(t, stats);
      shared.rstd2 = c.vec(t, stats);
      w.acts.assign(layers_n, shared);
      for (auto& a : w.acts) {
        a.qkv = c.qkv(t, h, compute, bf16);
        a.xmid = c.mat(t, h, master);
        a.pre = c.mat(t, f, compute);
        a.act = c.mat(t, f, compute);
      }
    }
    w.hidden = c.mat(t, h, compute);
    w.meanf = c.vec(t, stats);
    w.rstdf = c.vec(t, stats);
    w.hg = c.mat(m, h, compute);
    w.h1 = c.mat(m, h, compute);
    w.h1g = c.mat(m, h, compute);
    w.h2 = c.mat(m, h, compute);
    w.meanh = c.vec(m, stats);
    w.rstdh = c.vec(m, stats);
    w.logits = c.mat(m, v, master, bf16 ? kLogitsLdBf16 : v);
    // The portable cross-entropy writes dlogits over the logits; the bf16 one writes a bf16 copy,
    // also in a forward-only pass.
    w.dlogits = bf16 ? c.mat(m, v, compute, kLogitsLdBf16) : backward ? w.logits : Mat();
    w.scratch = LayerScratch();
    w.dhidden = w.dh2 = w.dh1 = w.dhg = Mat();
    if (backward) {
      auto& s = w.scratch;
      s.dres = c.mat(t, h, master);
      s.dres_c = bf16 ? c.mat(t, h, compute) : s.dres;
      s.dln = c.mat(t, h, master);
      s.dln_c = bf16 ? c.mat(t, h, compute) : s.dln;
      s.dout = c.mat(t, h, compute);
      s.dqkv = c.qkv(t, h, compute, bf16);
      s.delta = c.mat(t, nh, stats);
      s.dffn = c.mat(t, f, compute);
      w.dhidden = c.mat(t, h, compute);
      w.dh2 = c.mat(m, h, compute);
      w.dh1 = c.mat(m, h, compute);
      w.dhg = c.mat(m, h, compute);
    }
  }

  /// Copies the batch to the device, checks it, lays out the workspace, and lists the rows the
  /// LM head runs on (labelled rows, or all rows when all_rows).
  void prepare(const data::MicroBatch& batch, bool all_rows, bool backward) {
    const std::int64_t t = batch.numTokens();
    const int n = batch.numSequences();
    if (static_cast<std::int64_t>(batch.labels.extent(0)) != t)
      throw Error("plm::model: micro-batch has " + std::to_string(t) + " tokens but " +
                  std::to_string(batch.labels.extent(0)) + " labels (a loader bug)");
    if (n < 1 || batch.cu_seqlens(0) != 0 || batch.cu_seqlens(n) != t)
      throw Error("plm::model: micro-batch cu_seqlens must start at 0 and end at the token count " +
                  std::to_string(t) + " (a loader bug)");
    const data::ContextShard* shard = batch.context.get();
    checkShard(shard, n);
    int max_len = 0;
    for (int s = 0; s < n; ++s) {  // metadata over sequences
      const int len = batch.cu_seqlens(s + 1) - batch.cu_seqlens(s);
      if (len < 0 || (len == 0 && !shard))  // a context shard of a short sequence may be empty
        throw Error("plm::model: micro-batch sequence " + std::to_string(s) +
                    " is empty or cu_seqlens decreases (a loader bug)");
      max_len = std::max(max_len, len);
    }
    ensureRotary(shard ? std::max<int>(max_len, shard->max_seqlen) : max_len);
    host_cu.assign(batch.cu_seqlens.data(), batch.cu_seqlens.data() + n + 1);
    auto& b = w.batch;
    b.tokens = t;
    b.num_seqs = n;
    b.max_seqlen = max_len;
    b.token_dropout = config.token_dropout;
    b.mask_id = data::vocab::mask;
    b.pad_id = data::vocab::pad;
    b.ids = growView(tokens_store, t, "plm::model::tokens");
    labels_d = growView(labels_store, t, "plm::model::labels");
    b.cu_seqlens = growView(cu_store, n + 1, "plm::model::cu_seqlens");
    b.position = growView(position_store, t, "plm::model::position");
    const auto& space = ctx.space();
    Kokkos::deep_copy(space, b.ids,
                      Kokkos::View<const token_t*, HostSpace>(batch.tokens.data(), t));
    Kokkos::deep_copy(space, labels_d,
                      Kokkos::View<const std::int32_t*, HostSpace>(batch.labels.data(), t));
    Kokkos::deep_copy(space, b.cu_seqlens,
                      Kokkos::View<const seqlen_t*, HostSpace>(batch.cu_seqlens.data(), n + 1));

    // Validate ids on the device (one reduction) and count the labelled rows.
    auto tokens = b.ids;
    auto labels = labels_d;
    const int vocab = config.vocab;
    std::int64_t bad = 0, labelled = 0;
    Kokkos::parallel_reduce(
        "plm::model::check_batch", FlatPolicy(space, 0, t),
        KOKKOS_LAMBDA(const std::int64_t i, std::int64_t& nbad, std::int64_t& nlab) {
          const int tok = tokens(i);
          const std::int32_t lab = labels(i);
          nbad += (tok >= vocab) || (lab != data::vocab::ignore_label && (lab < 0 || lab >= vocab));
          nlab += lab != data::vocab::ignore_label;
        },
        bad, labelled);
    if (bad != 0)
      throw Error(
          "plm::model: micro-batch holds " + std::to_string(bad) +
          " token ids or labels outside the 33-token ESM-2 vocabulary (a data or loader bug)");
    const std::int64_t m = all_rows ? t : labelled;
    w.rows = m;
    w.labelled = labelled;
    w.head_rows = growView(rows_store, m, "plm::model::head_rows");
    w.head_labels = growView(head_labels_store, m, "plm::model::head_labels");
    auto rows = w.head_rows;
    auto head_labels = w.head_labels;
    Kokkos::parallel_scan(
        "plm::model::head_rows", FlatPolicy(space, 0, t),
        KOKKOS_LAMBDA(const std::int64_t i, std::int64_t& offset, const bool final) {
          const bool take = all_rows || labels(i) != data::vocab::ignore_label;
          if (take && final) {
            rows(offset) = static_cast<std::int32_t>(i);
            head_labels(offset) = labels(i);
          }
          offset += take ? 1 : 0;
        });

    Carver measure;
    carve(measure, t, m, backward);
    const std::size_t words = (measure.used + sizeof(double) - 1) / sizeof(double);
    if (arena.extent(0) < words) {
      arena = View1<double>();  // free before allocating the larger arena
      arena = View1<double>(
          Kokkos::view_alloc(Kokkos::WithoutInitializing, "plm::model::workspace"), words);
    }
    Carver cut{reinterpret_cast<char*>(arena.data()), 0};
    carve(cut, t, m, backward);
    sequenceInfo(space, b.cu_seqlens, b.ids, config.token_dropout, data::vocab::mask, b.position,
                 b.mult.template view<T>());
    b.ring = nullptr;
    if (shard) shardInfo(batch, *shard);
  }

  /// A context shard must come from this model's context group.
  void checkShard(const data::ContextShard* shard, int n) const {
    if (!shard) return;
    if (!ring || ring->degree() != shard->degree || ring->rank() != shard->rank)
      throw Error(
          "plm::model: a context-parallel shard (rank " + std::to_string(shard->rank) + " of " +
          std::to_string(shard->degree) + ") reached a model whose context " + "group is " +
          (ring ? "rank " + std::to_string(ring->rank()) + " of " + std::to_string(ring->degree())
                : std::string("not set")) +
          "; call setContextParallel with the context group's communicator (a caller "
          "bug)");
    if (shard->numSequences() != n)
      throw Error("plm::model: a context shard lists " + std::to_string(shard->numSequences()) +
                  " sequences for a micro-batch of " + std::to_string(n) + " (a loader bug)");
  }

  /// What a shard cannot compute from its own tokens: global positions (rotary), and the
  /// token-dropout scale of each whole sequence (sequenceInfo's formula, on the whole counts).
  void shardInfo(const data::MicroBatch& batch, const data::ContextShard& shard) {
    const std::int64_t t = batch.numTokens();
    const int n = batch.numSequences();
    auto& b = w.batch;
    const auto& space = ctx.space();
    std::vector<T> mult(static_cast<std::size_t>(t));  // per token, host metadata
    for (int s = 0; s < n; ++s) {
      const int len = shard.seq_length[s], masked = shard.seq_masked[s];
      const T observed = T(masked) / T(len);
      const T scale = masked == len ? T(0) : T(1.0 - 0.15 * 0.8) / (T(1) - observed);
      for (seqlen_t i = batch.cu_seqlens(s); i < batch.cu_seqlens(s + 1); ++i)
        mult[i] =
            !config.token_dropout ? T(1) : (batch.tokens(i) == data::vocab::mask ? T(0) : scale);
    }
    Kokkos::deep_copy(space, b.position,
                      Kokkos::View<const seqlen_t*, HostSpace>(shard.positions.data(), t));
    Kokkos::deep_copy(space, b.mult.template view<T>(),
                      Kokkos::View<const T*, HostSpace>(mult.data(), t));
    ring->setLayout(space, shard.rank_cu_seqlens, n);  // fences: `mult` may go
    b.ring = ring.get();
    if (moe_blocks.empty()) return;
    // The micro-batch in token order is the pieces (sequence s, chunk c) at s 2C + c; this
    // shard holds chunks rank and 2C - 1 - rank of each sequence (data/context_split.hpp).
    const int chunks = 2 * shard.degree;
    moe_context.comm = context_comm;
    moe_context.segments = n * chunks;
    moe_context.runs.clear();
    for (int s = 0; s < n; ++s) {
      std::int64_t at = batch.cu_seqlens(s);
      for (const int c : {shard.rank, chunks - 1 - shard.rank}) {
        const auto [first, last] = data::contextChunk(shard.seq_length[s], chunks, c);
        moe_context.runs.push_back(MoeContext::Run{s * chunks + c, at, at + (last - first)});
        at += last - first;
      }
    }
  }

  /// `context`: the pass is a context shard (its MoE layers reduce over the group).
  /// Takes every MoE layer's pending routing summary (MoeMlp::settle).
  void settleMoe() const {
    for (const auto* block : moe_blocks) block->settle();
  }

  void beginMoe(double loss_weight, double grad_scale, bool training, bool context = false) {
    settleMoe();  // the last pass's router losses belong to its objective
    moe_step.context = context && !moe_blocks.empty() ? &moe_context : nullptr;
    moe_step.cu_seqlens = host_cu.empty() ? nullptr : &host_cu;
    moe_step.loss_weight = loss_weight;
    moe_step.grad_scale = grad_scale;
    moe_step.objective = 0;
    moe_step.training = training;
    moe_step.recomputing = false;
    moe_step.centring = centring;
  }

  /// A rank without tokens under expert parallelism still serves its experts: every MoE layer
  /// runs on zero rows, in the order of the collectives of a rank with tokens.
  void idleMoePass(bool backward) {
    if (!expert_parallel || moe_blocks.empty()) return;
    // Zero rows in each tensor's own type, as a pass with tokens hands them over: the LN2
    // output and the gradients in the compute precision (bf16 on the bf16 and FP8 paths, whose
    // kernels refuse another type), the residual stream in the master type.
    const std::int64_t h = config.hidden;
    const Mat none{nullptr, compute, 0, h, h};
    const Mat stream{nullptr, master, 0, h, h};
    LayerActs acts;
    acts.ln2 = none;
    LayerScratch scratch;
    // The layer hooks fire as in a pass with tokens (FSDP gathers each layer's weights, the
    // experts' included, and reduce-scatters its gradients in the same order on every rank).
    std::vector<MoeMlp<T>*> block_of(config.num_layers, nullptr);
    for (auto* block : moe_blocks) block_of[block->stats().layer] = block;
    for (int l = 0; l < config.num_layers; ++l) {
      if (hooks) hooks->beforeForward(l);
      if (block_of[l]) block_of[l]->forward(ctx, none, stream, stream, acts);
    }
    if (!backward) return;
    for (int l = config.num_layers - 1; l >= 0; --l) {
      if (hooks) hooks->beforeBackward(l);
      if (config.recompute != Recompute::None && hooks) hooks->beforeForward(l);
      if (block_of[l] && config.recompute == Recompute::Layer) {
        moe_step.recomputing = true;
        block_of[l]->forward(ctx, none, stream, stream, acts);
        moe_step.recomputing = false;
      }
      if (block_of[l]) block_of[l]->backward(ctx, acts, none, none, scratch);
      if (hooks) hooks->afterBackward(l);
    }
    if (hooks) hooks->afterModelBackward();
  }

  LayerActs& actsFor(int layer) { return w.acts[w.acts.size() == 1 ? 0 : layer]; }

  Mat cosMat() const { return matOf(cos_table); }
  Mat sinMat() const { return matOf(sin_table); }

  /// Embedding, layers, final LayerNorm, LM head and loss (into the context's accumulator).
  void forwardPass(bool backward, double grad_scale) {
    const int layers_n = config.num_layers;
    const auto& b = w.batch;
    embedding(ctx, b, pw.embed, w.xs[0]);
    for (int l = 0; l < layers_n; ++l) {
      if (hooks) hooks->beforeForward(l);
      PLM_TRACE(trace::layerName(l));
      ctx.setProfileLayer(l);
      layers[l].forward(ctx, b, w.xs[l], w.xs[l + 1], actsFor(l), cosMat(), sinMat());
    }
    ctx.setProfileLayer(-1);
    layerNorm(ctx, w.xs[layers_n], pw.lnf_g, pw.lnf_b, config.layer_norm_eps, w.hidden, w.meanf,
              w.rstdf);
    if (w.rows == 0 || (backward && hidden_head)) return;
    PLM_TRACE("plm::lm_head fwd");
    gatherRows(ctx, w.hidden, w.head_rows, w.hg);
    linearGelu(ctx, w.hg, pw.head_w, pw.head_b, w.h1, w.h1g);
    layerNorm(ctx, w.h1g, pw.head_ln_g, pw.head_ln_b, config.layer_norm_eps, w.h2, w.meanh,
              w.rstdh);
    linear(ctx, w.h2, pw.embed, pw.head_bias, w.logits);
    crossEntropy(ctx, w.logits, w.head_labels, backward ? grad_scale : 1.0, w.dlogits);
  }

  /// The hidden head's loss on w.hidden (after a backward forwardPass): its sum, and its
  /// gradient in w.dhidden (compute precision), where backwardPass starts from.
  double headGradient(const data::MicroBatch& batch, double grad_scale) {
    const std::int64_t t = w.batch.tokens, h = config.hidden;
    View2<T> hidden(Kokkos::view_alloc(Kokkos::WithoutInitializing, "plm::model::head_hidden"), t,
                    h);
    View2<T> dhidden("plm::model::head_dhidden", t, h);
    copyToMaster(ctx, w.hidden, matOf(hidden));
    ctx.space().fence();
    const double loss = hidden_head->lossAndGradient(batch, hidden, grad_scale, dhidden);
    copyFromMaster(ctx, matOf(dhidden), w.dhidden);
    ctx.space().fence();  // dhidden is freed on return
    return loss;
  }

  void backwardPass() {
    const int layers_n = config.num_layers;
    const auto& b = w.batch;
    auto& s = w.scratch;
    if (w.rows > 0 && !hidden_head) {  // LM head (w.dlogits holds dlogits)
      PLM_TRACE("plm::lm_head bwd");
      linearBackward(ctx, w.h2, pw.embed, w.dlogits, w.dh2, false, pg.embed, pg.head_bias);
      layerNormBackward(ctx, w.h1g, pw.head_ln_g, w.meanh, w.rstdh, w.dh2, Mat(), false, w.dh1,
                        pg.head_ln_g, pg.head_ln_b);
      geluBackward(ctx, w.h1, w.dh1, w.dh1);
      linearBackward(ctx, w.hg, pw.head_w, w.dh1, w.dhg, false, pg.head_w, pg.head_b);
    }
    if (!hidden_head) scatterRows(ctx, w.dhg, w.head_rows, w.dhidden);  // else: headGradient
    layerNormBackward(ctx, w.xs[layers_n], pw.lnf_g, w.meanf, w.rstdf, w.dhidden, s.dres, false,
                      s.dres_c, pg.lnf_g, pg.lnf_b);
    for (int l = layers_n - 1; l >= 0; --l) {
      if (hooks) hooks->beforeBackward(l);
      PLM_TRACE(trace::layerName(l));
      ctx.setProfileLayer(l);
      LayerActs& a = actsFor(l);
      if (config.recompute == Recompute::Layer) {
        if (hooks) hooks->beforeForward(l);
        moe_step.recomputing = true;
        layers[l].forward(ctx, b, w.xs[l], w.xs[l + 1], a, cosMat(), sinMat());
        moe_step.recomputing = false;
      } else if (config.recompute == Recompute::Selective) {
        if (hooks) hooks->beforeForward(l);  // the recomputation reads the layer's LayerNorms
        layers[l].recomputeSelective(ctx, b, w.xs[l], a);
      }
      layers[l].backward(ctx, b, w.xs[l], a, s, cosMat(), sinMat());
      if (hooks) hooks->afterBackward(l);
    }
    ctx.setProfileLayer(-1);
    embeddingBackward(ctx, b, s.dres_c, pg.embed);
    if (hooks) hooks->afterModelBackward();
  }
};

template <class T>
Esm2<T>::Esm2(const Esm2Config& config, const ExpertPlacement& experts, ModelBuffers buffers)
    : impl_member(new Impl(config, experts, buffers)) {}

template <class T> Esm2<T>::~Esm2() { delete impl_member; }

template <class T> const Esm2Config& Esm2<T>::config() const { return impl_member->config; }

template <class T> const std::vector<TensorInfo>& Esm2<T>::tensors() const {
  return impl_member->tensors;
}

template <class T> const TensorInfo& Esm2<T>::tensor(const std::string& name) const {
  auto it = impl_member->index.find(name);
  if (it == impl_member->index.end())
    throw Error("plm::model: no parameter named '" + name +
                "' in this ESM-2 (names are Hugging Face's, e.g. "
                "esm.encoder.layer.0.attention.self.query.weight)");
  return impl_member->tensors[it->second];
}

template <class T> View1<T> Esm2<T>::parameters() { return impl_member->params; }

template <class T> View1<T> Esm2<T>::gradients() { return impl_member->grads; }

template <class T> void Esm2<T>::initialize(std::uint64_t seed) {
  auto& im = *impl_member;
  PLM_REQUIRE(static_cast<std::int64_t>(im.params.extent(0)) == im.buffer_elements,
              "plm::model::initialize: the whole parameter buffer is not held (sharded training "
              "draws its shards with initializeRange)");
  initializeRange(seed, 0, im.buffer_elements, im.params.data());
  im.ctx.space().fence();
}

template <class T> void Esm2<T>::initializeRange(std::uint64_t seed, std::int64_t offset,
                                                 std::int64_t count, T* out) const {
  const auto& im = *impl_member;
  PLM_REQUIRE(offset >= 0 && count >= 0 && offset + count <= im.buffer_elements,
              "plm::model::initializeRange: [" + std::to_string(offset) + ", +" +
                  std::to_string(count) + ") is outside the parameter buffer of " +
                  std::to_string(im.buffer_elements) + " elements (a bug)");
  const auto& space = im.ctx.space();
  flatFill(space, View1<T>(out, count), T(0));  // also the alignment padding
  // The <pad> row of the embedding stays zero (it is frozen: train::esm2FrozenRanges).
  const auto& embed = im.info("esm.embeddings.word_embeddings.weight");
  const std::int64_t pad_lo = embed.offset + std::int64_t(data::vocab::pad) * embed.shape[1];
  const std::int64_t pad_hi = pad_lo + embed.shape[1];
  for (std::size_t i = 0; i < im.tensors.size(); ++i) {  // over tensors, not elements
    const auto& t = im.tensors[i];
    const std::int64_t lo = std::max(offset, t.offset);
    const std::int64_t hi = std::min(offset + count, t.offset + t.size);
    if (lo >= hi || t.init == InitKind::Zero) continue;
    const int kind = static_cast<int>(t.init);
    const std::int64_t first = t.offset;    // element e of the tensor is buffer element first + e
    const std::uint64_t stream = t.stream;  // any placement draws the same values
    const double lora_bound =
        t.shape.size() == 2 ? 1.0 / std::sqrt(static_cast<double>(t.shape[1])) : 0.0;
    plm::flatFor(
        "plm::model::initialize", space, lo, hi, KOKKOS_LAMBDA(const std::int64_t g) {
          // Counter-based (math::normal hashes seed, stream and index): element e of a tensor
          // has one value whichever range of the buffer is drawn.
          T value = 0;
          if (kind == static_cast<int>(InitKind::Normal) && (g < pad_lo || g >= pad_hi))
            value = static_cast<T>(0.02 * math::normal(seed, stream, g - first));
          if (kind == static_cast<int>(InitKind::One)) value = T(1);
          if (kind == static_cast<int>(InitKind::LoraA))
            value = static_cast<T>(loraUniform(seed, stream, g - first, lora_bound));
          out[g - offset] = value;
        });
  }
}

template <class T> std::int64_t Esm2<T>::bufferElements() const {
  return impl_member->buffer_elements;
}

template <class T> void Esm2<T>::zeroGradients() {
  flatFill(impl_member->ctx.space(), impl_member->grads, T(0));
  impl_member->ctx.space().fence();
}

template <class T> void Esm2<T>::refreshComputeWeights() { impl_member->refreshCompute(); }

template <class T> Fp8Scaling* Esm2<T>::fp8Scaling() { return impl_member->fp8_scaling.get(); }

template <class T> void Esm2<T>::beginFp8Step() {
#if PLM_FP8_CUDA
  auto& im = *impl_member;
  if (im.fp8_scaling && im.bf16) im.uploadFp8Scales();
#endif
}

template <class T> std::vector<typename Esm2<T>::Fp8WeightCopy> Esm2<T>::fp8Weights() {
  auto& im = *impl_member;
  std::vector<Fp8WeightCopy> out;
  if (!im.fp8_scaling) return out;
  if (!im.bf16) {
    for (const auto& fw : im.fp8_list)
      out.push_back({fw.slot->index(Fp8Operand::Weight), fw.rows, fw.cols, fw.from,
                     im.fp8_weights.data() + fw.at});
    return out;
  }
  // CUDA: each weight's packed bf16 range [at, at + rows * cols) holds its master tensors back
  // to back (q, k, v for the stacked QKV weight): the packing segments give their offsets.
  const int w = static_cast<int>(Fp8Operand::Weight);
  for (std::size_t i = 0; i < im.fp8_cuda_weights.size(); ++i) {
    const Fp8GemmSlot* slot = im.fp8_cuda_weights[i].first;
    const Mat& m = im.fp8_cuda_weights[i].second;
    const std::int64_t at = im.fp8_cuda_at[i].second, n = m.rows * m.cols;
    Fp8WeightCopy c;
    c.operand = slot->index(Fp8Operand::Weight);
    c.rows = m.rows;
    c.cols = m.cols;
    std::int64_t covered = 0, part = 0;
    for (std::size_t k = 0; k < im.packed_seg.size(); k += 3) {
      const std::int64_t d = im.packed_seg[k + 1], len = im.packed_seg[k + 2];
      if (d < at || d >= at + n) continue;
      PLM_REQUIRE(d == at + covered && (part == 0 || len == part),
                  "plm::model: an FP8 weight's packed parts are not back to back (a bug)");
      c.from.push_back(im.packed_seg[k]);
      part = len;
      covered += len;
    }
    PLM_REQUIRE(covered == n && m.ld == m.cols,
                "plm::model: an FP8 weight's packed parts do not cover it (a bug)");
    c.codes = static_cast<std::uint8_t*>(const_cast<void*>(slot->w_codes));
    c.codes_t = static_cast<std::uint8_t*>(const_cast<void*>(slot->wt_codes));
    c.scale_inv = slot->scaleInv(w);
    out.push_back(c);
  }
  return out;
}

template <class T> void Esm2<T>::endFp8Step(MPI_Comm comm) {
  if (impl_member->fp8_scaling) impl_member->endFp8Step(comm);
}

template <class T> void Esm2<T>::restoreFp8Scaling(const std::vector<float>& histories,
                                                   const std::vector<float>& scales,
                                                   std::int64_t steps) {
  auto& im = *impl_member;
  if (!im.fp8_scaling) return;
  im.fp8_scaling->restore(histories, scales, steps);
#if PLM_FP8_CUDA
  // Without this, a resumed delayed-scaling run took the largest amax of the initial weights'
  // cast into its first step's history (test_fp8_moe ResumesExactlyAndAtAnotherDegree).
  if (im.fp8_dev_amax.extent(0) > 0) {
    const auto stream = im.ctx.space().cuda_stream();
    PLM_CHECK_CUDA(cudaMemsetAsync(im.fp8_dev_amax.data(), 0,
                                   im.fp8_dev_amax.extent(0) * sizeof(float), stream));
    PLM_CHECK_CUDA(cudaStreamSynchronize(stream));
  }
#endif
}

template <class T> double Esm2<T>::forwardBackward(const data::MicroBatch& batch, double grad_scale,
                                                   bool refresh_weights) {
  auto& im = *impl_member;
  im.requireHeldExperts();
  // A context shard without tokens still runs the pass: its ring steps pass the others' K/V on.
  if (batch.numTokens() == 0 && !batch.context) {  // a rank with no micro-batch this step
    im.host_cu.clear();
    im.beginMoe(0.0, grad_scale, true);
    // Its experts still compute other ranks' rows: with the compute copy of this step, and
    // (fp8) recording their amaxes as a training pass.
    if (im.expert_parallel) {
      if (im.fp8_scaling) im.fp8_scaling->setRecording(true);
      if (refresh_weights) im.refreshCompute();
    }
    im.idleMoePass(true);
    return 0.0;
  }
  Kokkos::Profiling::pushRegion("plm::model::forwardBackward");
  im.prepare(batch, false, true);
  // The router losses weigh a micro-batch by its labelled tokens, all of them on a shard.
  im.beginMoe(static_cast<double>(batch.context ? batch.context->labelled : im.w.labelled),
              grad_scale, true, batch.context != nullptr);
  if (im.fp8_scaling) im.fp8_scaling->setRecording(true);  // training passes set the amaxes
  im.ctx.beginLoss();
  if (refresh_weights) im.refreshCompute();
  im.forwardPass(true, grad_scale);
  const double head_loss = im.hidden_head ? im.headGradient(batch, grad_scale) : 0.0;
  im.backwardPass();
  const double loss = im.ctx.endLoss() + head_loss;
  im.ctx.space().fence();
  Kokkos::Profiling::popRegion();
  return loss;
}

template <class T> double Esm2<T>::forward(const data::MicroBatch& batch,
                                           ForwardOutputs<T>* outputs, bool refresh_weights) {
  auto& im = *impl_member;
  im.requireHeldExperts();
  if (batch.numTokens() == 0 && !batch.context) {
    im.host_cu.clear();
    im.beginMoe(0.0, 0.0, false);
    if (im.expert_parallel) {  // as in forwardBackward
      if (im.fp8_scaling) im.fp8_scaling->setRecording(false);
      if (refresh_weights) im.refreshCompute();
    }
    im.idleMoePass(false);
    if (outputs && outputs->want_logits)
      outputs->logits = View2<T>("plm::model::logits", 0, im.config.vocab);
    if (outputs && outputs->want_hidden)
      outputs->hidden = View2<T>("plm::model::hidden", 0, im.config.hidden);
    return 0.0;
  }
  Kokkos::Profiling::pushRegion("plm::model::forward");
  const bool all_rows = outputs && outputs->want_logits;
  im.prepare(batch, all_rows, false);
  im.beginMoe(static_cast<double>(batch.context ? batch.context->labelled : im.w.labelled), 0.0,
              outputs && outputs->moe_stats, batch.context != nullptr);
  if (im.fp8_scaling) im.fp8_scaling->setRecording(false);
  im.ctx.beginLoss();
  if (refresh_weights) im.refreshCompute();
  im.forwardPass(false, 1.0);
  const double loss = im.ctx.endLoss();
  if (outputs && outputs->want_logits) {
    outputs->logits = View2<T>("plm::model::logits", im.w.rows, im.config.vocab);
    copyToMaster(im.ctx, im.w.logits, matOf(outputs->logits));
  }
  if (outputs && outputs->want_hidden) {
    outputs->hidden = View2<T>("plm::model::hidden", im.w.batch.tokens, im.config.hidden);
    copyToMaster(im.ctx, im.w.hidden, matOf(outputs->hidden));
  }
  im.ctx.space().fence();
  Kokkos::Profiling::popRegion();
  return loss;
}

template <class T> std::int64_t Esm2<T>::workspaceBytes() const {
  return static_cast<std::int64_t>(impl_member->arena.extent(0) * sizeof(double));
}

template <class T> std::pair<std::int64_t, std::int64_t> Esm2<T>::layerRange(int layer) const {
  const auto& im = *impl_member;
  if (layer < 0 || layer >= im.config.num_layers)
    throw Error("plm::model: layer " + std::to_string(layer) + " out of range (a bug)");
  std::int64_t lo = -1, hi = -1;
  for (const auto& t : im.tensors)
    if (t.group == TensorGroup::Layer && t.layer == layer) {
      lo = lo < 0 ? t.offset : std::min(lo, t.offset);
      hi = std::max(hi, t.offset + t.size);
    }
  return {lo, hi - lo};
}

template <class T> void Esm2<T>::placeRange(std::int64_t offset, std::int64_t count, T* params,
                                            T* grads, std::uint16_t* compute) {
  auto& im = *impl_member;
  const int g = im.groupStartingIn(offset, count);
  PLM_REQUIRE(im.bf16 || compute == nullptr,
              "plm::model::placeRange: a compute copy is given but the policy has none");
  im.place(g, params, grads, compute);
}

template <class T>
std::int64_t Esm2<T>::computeElements(std::int64_t offset, std::int64_t count) const {
  const auto& im = *impl_member;
  if (!im.bf16) return 0;
  const auto& p = im.places[im.groupStartingIn(offset, count)];
  return p.chi - p.clo;
}

template <class T>
void Esm2<T>::refreshComputeRange(std::int64_t offset, std::int64_t count, bool cast_fp8) {
  auto& im = *impl_member;
  if (!im.bf16) return;
  im.refreshGroup(im.groupStartingIn(offset, count), cast_fp8);
}

template <class T> void Esm2<T>::holdWholeBuffers(bool params, bool grads) {
  auto& im = *impl_member;
  auto hold = [&](View1<T>& buf, bool want, T* Impl::Place::*where, const char* label) {
    if (want == (buf.extent(0) > 0)) return;
    if (want) {
      buf = flatZeros<T>(std::string(label), im.buffer_elements);
      return;
    }
    for (const auto& p : im.places)
      PLM_REQUIRE(p.*where != nullptr, std::string("plm::model::holdWholeBuffers: a group's "
                                                   "views still point into ") +
                                           label);
    buf = View1<T>();
  };
  hold(im.params, params, &Impl::Place::params, "plm::model::parameters");
  hold(im.grads, grads, &Impl::Place::grads, "plm::model::gradients");
  // bf16: the packed compute copy goes and comes with the masters.
  if (im.bf16 && params != (im.packed.extent(0) > 0)) {
    if (params) {
      im.packed = flatZeros<std::uint16_t>("plm::model::compute_weights", im.packed_elements);
    } else {
      for (const auto& p : im.places)
        PLM_REQUIRE(p.compute != nullptr || p.chi == p.clo,
                    "plm::model::holdWholeBuffers: a group's compute views still point into "
                    "plm::model::compute_weights");
      im.packed = View1<std::uint16_t>();
    }
  }
}

template <class T> double Esm2<T>::routerLoss() const {
  impl_member->settleMoe();
  return impl_member->moe_step.objective;
}

template <class T> std::vector<MoeLayerStats> Esm2<T>::moeStats() const {
  std::vector<MoeLayerStats> out;
  for (const auto* block : impl_member->moe_blocks) out.push_back(block->stats());
  return out;
}

template <class T> void Esm2<T>::resetMoeStats() {
  for (auto* block : impl_member->moe_blocks) block->resetStats();
}

template <class T> void Esm2<T>::balanceExpertBias(const std::vector<std::vector<double>>& routed) {
  auto& im = *impl_member;
  if (routed.size() != im.moe_blocks.size())
    throw Error("plm::model: balanceExpertBias got " + std::to_string(routed.size()) +
                " layers of counts for " + std::to_string(im.moe_blocks.size()) +
                " MoE layers (a bug)");
  for (std::size_t i = 0; i < routed.size(); ++i) im.moe_blocks[i]->balanceBias(im.ctx, routed[i]);
}

template <class T>
std::vector<RouterCentring> Esm2<T>::centreRouters(const std::vector<data::MicroBatch>& batches,
                                                   MPI_Comm comm) {
  auto& im = *impl_member;
  std::vector<RouterCentring> out = routerInputMeans(batches, comm);
  for (std::size_t i = 0; i < out.size(); ++i)
    if (!out[i].mean.empty()) im.moe_blocks[i]->centreRouter(im.ctx, out[i].mean);
  return out;
}

template <class T> std::vector<RouterCentring> Esm2<T>::routerInputMeans(
    const std::vector<data::MicroBatch>& batches, MPI_Comm comm,
    const std::function<void(const data::MicroBatch&)>& pass) {
  auto& im = *impl_member;
  if (im.moe_blocks.empty()) return {};
  for (auto* block : im.moe_blocks) block->takeRouterInputSums();  // nothing from before
  struct Off {  // the flag goes down on every path out (a collective error included)
    bool& on;
    ~Off() { on = false; }
  } off{im.centring};
  im.centring = true;
  for (const auto& batch : batches) {
    if (pass)
      pass(batch);
    else
      forward(batch);
  }
  im.centring = false;
  // Per layer: the input sum (H), the tokens and the power, summed over all ranks in one go.
  const std::size_t h = static_cast<std::size_t>(im.config.hidden), per = h + 2;
  std::vector<double> flat;
  flat.reserve(im.moe_blocks.size() * per);
  for (auto* block : im.moe_blocks) {
    RouterInputSums in = block->takeRouterInputSums();
    flat.insert(flat.end(), in.sum.begin(), in.sum.end());
    flat.push_back(in.tokens);
    flat.push_back(in.power);
  }
  dist::allreduceSum(flat, comm);
  std::vector<RouterCentring> out;
  for (std::size_t i = 0; i < im.moe_blocks.size(); ++i) {
    const double* at = flat.data() + i * per;
    RouterCentring r;
    r.layer = im.moe_blocks[i]->stats().layer;
    r.tokens = at[h];
    if (r.tokens > 0) {
      std::vector<double> mean(at, at + h);
      double norm2 = 0;
      for (double& v : mean) {
        v /= r.tokens;
        norm2 += v * v;
      }
      r.mean_share = at[h + 1] > 0 ? norm2 / (at[h + 1] / r.tokens) : 0.0;
      r.mean = std::move(mean);
    }
    out.push_back(r);
  }
  return out;
}

template <class T> void Esm2<T>::projectRouters(MPI_Comm comm) {
  auto& im = *impl_member;
  if (im.moe_blocks.empty()) return;
  const std::size_t h = static_cast<std::size_t>(im.config.hidden);
  const std::size_t keep =
      static_cast<std::size_t>(std::max(1, im.config.moe.router_projection_means));
  std::vector<double> flat(im.moe_blocks.size() * h);
  for (std::size_t i = 0; i < im.moe_blocks.size(); ++i)
    im.moe_blocks[i]->takeStepInputSum(im.ctx, flat.data() + i * h);
  im.ctx.space().fence();
  dist::allreduceSum(flat, comm);
  im.router_means.resize(im.moe_blocks.size());
  std::vector<std::vector<double>> bases(im.moe_blocks.size());
  for (std::size_t i = 0; i < im.moe_blocks.size(); ++i) {
    const double* m = flat.data() + i * h;
    double norm2 = 0;
    for (std::size_t k = 0; k < h; ++k) norm2 += m[k] * m[k];
    if (!(norm2 > 0) || !std::isfinite(norm2)) continue;
    auto& means = im.router_means[i];  // this step's unit mean first, then earlier steps'
    means.insert(means.begin(), std::vector<double>(m, m + h));
    for (double& v : means.front()) v /= std::sqrt(norm2);
    if (means.size() > keep) means.resize(keep);
    // Gram-Schmidt (twice, for orthogonality in double) over the kept means; a mean that adds
    // less than 1e-3 of its norm outside the others' span adds no direction.
    auto& q = bases[i];
    for (const auto& u : means) {
      std::vector<double> v = u;
      const std::size_t k_n = q.size() / h;
      for (int pass = 0; pass < 2; ++pass)
        for (std::size_t k = 0; k < k_n; ++k) {
          double d = 0;
          for (std::size_t x = 0; x < h; ++x) d += q[k * h + x] * v[x];
          for (std::size_t x = 0; x < h; ++x) v[x] -= d * q[k * h + x];
        }
      double n2 = 0;
      for (double x : v) n2 += x * x;
      if (n2 < 1e-6) continue;
      for (double& x : v) x /= std::sqrt(n2);
      q.insert(q.end(), v.begin(), v.end());
    }
    im.moe_blocks[i]->projectRouter(im.ctx, q);
  }
  im.ctx.space().fence();
}

template <class T> void Esm2<T>::setExpertParallel(dist::Communicator* comm) {
  auto& im = *impl_member;
  const int size = comm ? comm->size() : 1, rank = comm ? comm->rank() : 0;
  if (im.held.sharded() && (size != im.held.degree || rank != im.held.rank))
    throw Error("plm::model::setExpertParallel: the model holds the experts of rank " +
                std::to_string(im.held.rank) + " of " + std::to_string(im.held.degree) +
                "; the expert group has this rank at " + std::to_string(rank) + " of " +
                std::to_string(size) + " (a bug)");
  for (auto* block : im.moe_blocks) block->setExpertParallel(ExpertParallel{comm});
  im.expert_parallel = comm != nullptr && comm->size() > 1;
}

template <class T> bool Esm2<T>::expertParallel() const { return impl_member->expert_parallel; }

template <class T> const ExpertPlacement& Esm2<T>::expertPlacement() const {
  return impl_member->held;
}

template <class T> void Esm2<T>::setContextParallel(dist::Communicator* comm) {
  auto& im = *impl_member;
  im.ring = comm != nullptr ? std::make_unique<RingAttention>(*comm) : nullptr;
  im.context_comm = comm;
}

template <class T> int Esm2<T>::contextDegree() const {
  return impl_member->ring ? impl_member->ring->degree() : 1;
}

template <class T> int Esm2<T>::contextRank() const {
  return impl_member->ring ? impl_member->ring->rank() : 0;
}

template <class T> void Esm2<T>::setHooks(LayerHooks* hooks) { impl_member->hooks = hooks; }

template <class T> void Esm2<T>::setHiddenHead(HiddenHead<T>* head) {
  PLM_REQUIRE(!head || (impl_member->config.moe.experts == 0 && !impl_member->ring),
              "plm::model::setHiddenHead: a hidden-state head runs on a dense model without "
              "context parallelism (a caller bug)");
  impl_member->hidden_head = head;
}

template <class T> void Esm2<T>::setProfiling(bool on) { impl_member->ctx.setProfiling(on); }

template <class T> std::vector<std::pair<std::string, double>> Esm2<T>::profile() {
  return impl_member->ctx.profile();
}

template <class T> OpContext& Esm2<T>::context() { return impl_member->ctx; }

template class Esm2<float>;
template class Esm2<double>;

}  // namespace plm::model
