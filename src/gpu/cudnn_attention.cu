// cuDNN's fused attention on packed batches (see cudnn_attention.hpp for the design).
#include "gpu/cudnn_attention.hpp"

#include "core/error.hpp"

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#if PLM_HAVE_CUDNN
#include <cudnn_frontend.h>

#include <cstdio>
#include <limits>
#include <map>
#include <unordered_map>
#endif

namespace plm::gpu {

#if !PLM_HAVE_CUDNN

bool cudnnAttentionAvailable() { return false; }

struct CudnnAttention::Impl {};
CudnnAttention::CudnnAttention(bool) {
  throw Error(
      "cuDNN attention: this build of plm has no cuDNN (configure with the cuDNN "
      "frontend headers, scripts/get-cudnn-frontend.sh, and a CUDA Kokkos)");
}
CudnnAttention::~CudnnAttention() = default;
bool CudnnAttention::forward(Stream, const FlashParams&) { return false; }
bool CudnnAttention::backward(Stream, const FlashParams&) { return false; }
int CudnnAttention::graphs() const { return 0; }
std::size_t CudnnAttention::workspaceBytes() const { return 0; }
const std::string& CudnnAttention::whyNot() const {
  static const std::string none = "this build has no cuDNN attention";
  return none;
}

#else

namespace fe = cudnn_frontend;

namespace {

// The nine tensors with per-sequence offsets; each gets its own ragged-offset array because
// each has its own row stride (q, k, v share 3 hidden under the fused layout, but need not).
enum Role : int { kQ, kK, kV, kO, kStats, kDO, kDQ, kDK, kDV, kRoles };
// Tensor uids: a role's tensor is 1 + role, its ragged offsets 20 + role; sequence lengths 40.
constexpr std::int64_t tensorUid(int role) { return 1 + role; }
constexpr std::int64_t offsetUid(int role) { return 20 + role; }
constexpr std::int64_t kSeqLenUid = 40;

struct RowStrides {
  std::int64_t s[kRoles];
};

/// seqlen[i] = length of sequence i (0 for the bucket's padding sequences); offsets of role r at
/// [r (b + 1) + i] = first token of sequence i times the role's row stride, in elements.
__global__ void raggedMetadataKernel(const std::int32_t* __restrict__ cu_seqlens, int num_seqs,
                                     int bucket, RowStrides strides, std::int32_t* seqlen,
                                     std::int32_t* offsets) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i > bucket) return;
  const std::int64_t first = cu_seqlens[i < num_seqs ? i : num_seqs];
  if (i < bucket) seqlen[i] = i < num_seqs ? cu_seqlens[i + 1] - cu_seqlens[i] : 0;
  for (int r = 0; r < kRoles; ++r)
    offsets[r * (bucket + 1) + i] = static_cast<std::int32_t>(first * strides.s[r]);
}

int roundUp(int x, int m) { return (x + m - 1) / m * m; }

void checkCudnn(cudnnStatus_t s, const char* what) {
  if (s != CUDNN_STATUS_SUCCESS)
    throw Error(std::string("cuDNN attention: ") + what + ": " + cudnnGetErrorString(s));
}

}  // namespace

bool cudnnAttentionAvailable() { return true; }

struct CudnnAttention::Impl {
  bool deterministic = true;
  cudnnHandle_t handle = nullptr;
  // nullptr: cuDNN has no kernel for this key (remembered so the fallback costs one try).
  std::map<std::string, std::shared_ptr<fe::graph::Graph>> graphs;
  void* workspace = nullptr;
  std::size_t workspace_bytes = 0;
  std::int32_t* meta = nullptr;  // seqlen (bucket) + offsets (kRoles (bucket + 1))
  std::size_t meta_count = 0;
  std::string why_not;  // the last refusal's reason

  ~Impl() {
    if (workspace) cudaFree(workspace);
    if (meta) cudaFree(meta);
    if (handle) cudnnDestroy(handle);
  }

  static RowStrides strides(const FlashParams& p) {
    RowStrides r{};
    r.s[kQ] = p.q_stride;
    r.s[kK] = p.k_stride;
    r.s[kV] = p.v_stride;
    r.s[kO] = p.o_stride;
    r.s[kStats] = p.heads;
    r.s[kDO] = p.dout_stride;
    r.s[kDQ] = p.dq_stride;
    r.s[kDK] = p.dk_stride;
    r.s[kDV] = p.dv_stride;
    return r;
  }

  static std::string key(bool backward, int bucket, int seq, const FlashParams& p) {
    const RowStrides r = strides(p);
    char buf[256];
    std::snprintf(
        buf, sizeof buf,
        "%c b%d s%d h%d d%d q%lld k%lld v%lld o%lld do%lld dq%lld dk%lld "
        "dv%lld sc%a",
        backward ? 'B' : 'F', bucket, seq, p.heads, p.head_dim, static_cast<long long>(r.s[kQ]),
        static_cast<long long>(r.s[kK]), static_cast<long long>(r.s[kV]),
        static_cast<long long>(r.s[kO]), backward ? static_cast<long long>(r.s[kDO]) : 0LL,
        backward ? static_cast<long long>(r.s[kDQ]) : 0LL,
        backward ? static_cast<long long>(r.s[kDK]) : 0LL,
        backward ? static_cast<long long>(r.s[kDV]) : 0LL, static_cast<double>(p.softmax_scale));
    return buf;
  }

  std::shared_ptr<fe::graph::Graph> build(bool backward, int b, int s, const FlashParams& p) {
    using fe::graph::Tensor_attributes;
    const std::int64_t h = p.heads, d = p.head_dim;
    auto g = std::make_shared<fe::graph::Graph>();
    g->set_io_data_type(fe::DataType_t::BFLOAT16)
        .set_intermediate_data_type(fe::DataType_t::FLOAT)
        .set_compute_data_type(fe::DataType_t::FLOAT);
    const RowStrides rs = strides(p);
    auto offsets = [&](int role, const char* name) {
      return g->tensor(Tensor_attributes()
                           .set_name(name)
                           .set_uid(offsetUid(role))
                           .set_data_type(fe::DataType_t::INT32)
                           .set_dim({b + 1, 1, 1, 1})
                           .set_stride({1, 1, 1, 1}));
    };
    // (b, h, s, d) over (T, h, d) rows of stride rs: token t of sequence i at offset_i + t rs.
    auto thd = [&](Tensor_attributes& a, int role, const char* name) -> Tensor_attributes& {
      return a.set_name(name)
          .set_uid(tensorUid(role))
          .set_dim({b, h, s, d})
          .set_stride({s * rs.s[role], d, rs.s[role], 1})
          .set_ragged_offset(offsets(role, (std::string(name) + "_offsets").c_str()));
    };
    auto input = [&](int role, const char* name) {
      Tensor_attributes a;
      thd(a, role, name);
      return g->tensor(a);
    };
    auto seqlen = g->tensor(Tensor_attributes()
                                .set_name("seqlen")
                                .set_uid(kSeqLenUid)
                                .set_data_type(fe::DataType_t::INT32)
                                .set_dim({b, 1, 1, 1})
                                .set_stride({1, 1, 1, 1}));
    auto q = input(kQ, "q"), k = input(kK, "k"), v = input(kV, "v");
    auto setStats = [&](Tensor_attributes& a) {
      a.set_name("lse")
          .set_uid(tensorUid(kStats))
          .set_data_type(fe::DataType_t::FLOAT)
          .set_dim({b, h, s, 1})
          .set_stride({s * h, 1, h, 1})
          .set_ragged_offset(offsets(kStats, "lse_offsets"));
    };
    if (!backward) {
      auto opts = fe::graph::SDPA_attributes()
                      .set_name("attention")
                      .set_generate_stats(true)
                      .set_attn_scale(p.softmax_scale)
                      .set_padding_mask(true)
                      .set_seq_len_q(seqlen)
                      .set_seq_len_kv(seqlen);
      auto [o, stats] = g->sdpa(q, k, v, opts);
      thd(o->set_output(true), kO, "o");
      setStats(stats->set_output(true));
    } else {
      auto o = input(kO, "o"), dout = input(kDO, "dout");
      Tensor_attributes sa;
      setStats(sa);
      auto stats = g->tensor(sa);
      auto opts = fe::graph::SDPA_backward_attributes()
                      .set_name("attention_backward")
                      .set_attn_scale(p.softmax_scale)
                      .set_padding_mask(true)
                      .set_seq_len_q(seqlen)
                      .set_seq_len_kv(seqlen)
                      .set_deterministic_algorithm(deterministic);
      auto [dq, dk, dv] = g->sdpa_backward(q, k, v, o, dout, stats, opts);
      thd(dq->set_output(true), kDQ, "dq");
      thd(dk->set_output(true), kDK, "dk");
      thd(dv->set_output(true), kDV, "dv");
    }
    if (!g->validate().is_good() || !g->build_operation_graph(handle).is_good() ||
        !g->create_execution_plans({fe::HeurMode_t::A}).is_good() ||
        !g->check_support(handle).is_good() || !g->build_plans(handle).is_good())
      return nullptr;
    return g;
  }

  bool run(bool backward, Stream stream, const FlashParams& p) {
    why_not.clear();
    if (p.total_tokens == 0 || p.num_seqs == 0) return true;
    const std::string shape = std::string(backward ? "backward" : "forward") +
                              " kernel for head_dim " + std::to_string(p.head_dim) + ", " +
                              std::to_string(p.heads) + " heads";
    auto refuse = [&](const std::string& why) {
      why_not = why;
      return false;
    };
    // Measured on cuDNN 9.14 (H100): the backward writes dK and dV at the ragged offsets of K and
    // V whatever offsets dK and dV are given, so a gradient whose row stride differs from its
    // input's (not plm's stacked qkv layout) would be written out of place: not run here.
    if (backward && (p.dq_stride != p.q_stride || p.dk_stride != p.k_stride ||
                     p.dv_stride != p.v_stride || p.dout_stride != p.o_stride))
      return refuse("cuDNN's backward needs gradient row strides equal to its inputs'");
    const int bucket = roundUp(p.num_seqs, 16);
    const int seq = roundUp(p.max_seqlen, 128);
    // Ragged offsets are int32 elements: the largest must fit.
    const RowStrides rs = strides(p);
    for (int r = 0; r < kRoles; ++r)
      if (p.total_tokens * rs.s[r] > std::numeric_limits<std::int32_t>::max())
        return refuse("cuDNN's ragged offsets (int32) do not reach " +
                      std::to_string(p.total_tokens) + " tokens");
    const std::string k = key(backward, bucket, seq, p);
    auto it = graphs.find(k);
    if (it == graphs.end()) it = graphs.emplace(k, build(backward, bucket, seq, p)).first;
    const auto& g = it->second;
    if (!g) return refuse("cuDNN has no " + shape);

    std::int64_t ws = 0;
    if (!g->get_workspace_size(ws).is_good())
      throw Error("cuDNN attention: no workspace size for graph " + k);
    if (static_cast<std::size_t>(ws) > kMaxWorkspaceBytes)
      return refuse("cuDNN's " + shape + " asks for " +
                    std::to_string(ws / (std::int64_t(1) << 20)) + " MiB of workspace at " +
                    std::to_string(p.max_seqlen) + "-token sequences (over " +
                    std::to_string(kMaxWorkspaceBytes >> 20) + " MiB)");
    const std::size_t need_meta = bucket + std::size_t(kRoles) * (bucket + 1);
    if (static_cast<std::size_t>(ws) > workspace_bytes || need_meta > meta_count) {
      PLM_CHECK_CUDA(cudaStreamSynchronize(stream));  // buffers may be in use by earlier calls
      if (static_cast<std::size_t>(ws) > workspace_bytes) {
        if (workspace) PLM_CHECK_CUDA(cudaFree(workspace));
        workspace = nullptr;
        PLM_CHECK_CUDA(cudaMalloc(&workspace, ws));
        workspace_bytes = ws;
      }
      if (need_meta > meta_count) {
        if (meta) PLM_CHECK_CUDA(cudaFree(meta));
        meta = nullptr;
        PLM_CHECK_CUDA(cudaMalloc(&meta, need_meta * sizeof(std::int32_t)));
        meta_count = need_meta;
      }
    }
    std::int32_t* seqlen = meta;
    std::int32_t* offs = meta + bucket;
    raggedMetadataKernel<<<(bucket + 1 + 127) / 128, 128, 0, stream>>>(p.cu_seqlens, p.num_seqs,
                                                                       bucket, rs, seqlen, offs);
    PLM_CHECK_CUDA(cudaGetLastError());

    std::unordered_map<std::int64_t, void*> pack;
    pack[kSeqLenUid] = seqlen;
    auto bind = [&](int role, const void* ptr) {
      pack[tensorUid(role)] = const_cast<void*>(ptr);
      pack[offsetUid(role)] = offs + std::size_t(role) * (bucket + 1);
    };
    bind(kQ, p.q);
    bind(kK, p.k);
    bind(kV, p.v);
    bind(kO, p.o);
    bind(kStats, p.lse);
    if (backward) {
      bind(kDO, p.dout);
      bind(kDQ, p.dq);
      bind(kDK, p.dk);
      bind(kDV, p.dv);
    }
    checkCudnn(cudnnSetStream(handle, stream), "cudnnSetStream");
    auto status = g->execute(handle, pack, workspace);
    if (!status.is_good())
      throw Error("cuDNN attention: execute failed (" + k + "): " + status.get_message());
    return true;
  }
};

CudnnAttention::CudnnAttention(bool deterministic_backward) : impl(std::make_unique<Impl>()) {
  impl->deterministic = deterministic_backward;
  checkCudnn(cudnnCreate(&impl->handle), "cudnnCreate");
}
CudnnAttention::~CudnnAttention() = default;

bool CudnnAttention::forward(Stream stream, const FlashParams& p) {
  return impl->run(false, stream, p);
}
bool CudnnAttention::backward(Stream stream, const FlashParams& p) {
  return impl->run(true, stream, p);
}
int CudnnAttention::graphs() const {
  int n = 0;
  for (const auto& [k, g] : impl->graphs) n += g != nullptr;
  return n;
}
std::size_t CudnnAttention::workspaceBytes() const { return impl->workspace_bytes; }
const std::string& CudnnAttention::whyNot() const { return impl->why_not; }

#endif

}  // namespace plm::gpu
