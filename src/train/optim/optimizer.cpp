#include "train/optim/optimizer.hpp"

#include "core/error.hpp"
#include "core/flat.hpp"
#include "core/vocab.hpp"
#include "dist/process_groups.hpp"
#include "train/optim/adafactor.hpp"
#include "train/optim/adamw.hpp"
#include "train/optim/adamw8bit.hpp"
#include "train/optim/detail/subset.hpp"
#include "train/optim/lion.hpp"

#include <algorithm>
#include <cstring>
#include <type_traits>

namespace plm::train {

namespace {
// Up to this many frozen ranges, maskGradients zeroes them one launch each.
constexpr std::size_t kFewFrozenRanges = 8;
}  // namespace

std::vector<FrozenRange> esm2FrozenRanges(const std::vector<model::TensorInfo>& tensors,
                                          int hidden) {
  if (std::any_of(tensors.begin(), tensors.end(),
                  [](const model::TensorInfo& t) { return t.lora; })) {
    // LoRA fine-tuning: every base tensor is frozen whole, only the adapters train.
    std::vector<FrozenRange> frozen;
    for (const auto& t : tensors)
      if (!t.lora && t.offset >= 0) frozen.push_back({t.offset, t.size});
    return frozen;
  }
  for (const auto& t : tensors) {
    if (t.name == "esm.embeddings.word_embeddings.weight")
      return {FrozenRange{t.offset + static_cast<std::int64_t>(vocab::pad) * hidden, hidden}};
  }
  throw Error("optimizer: the model has no tensor esm.embeddings.word_embeddings.weight");
}

const char* optimizerName(OptimizerKind kind) {
  switch (kind) {
    case OptimizerKind::AdamW: return "adamw";
    case OptimizerKind::Lion: return "lion";
    case OptimizerKind::Adafactor: return "adafactor";
    case OptimizerKind::AdamW8bit: return "adamw8bit";
  }
  return "?";
}

OptimizerKind parseOptimizerKind(const std::string& name) {
  for (auto k : {OptimizerKind::AdamW, OptimizerKind::Lion, OptimizerKind::Adafactor,
                 OptimizerKind::AdamW8bit})
    if (name == optimizerName(k)) return k;
  throw collectiveError("optimizer.name: `" + name +
                        "` is not an optimizer; choose adamw, lion, adafactor or adamw8bit");
}

ParamLayout wholeLayout(const std::vector<model::TensorInfo>& tensors, std::int64_t buffer_size,
                        const std::vector<FrozenRange>& frozen) {
  ParamLayout l;
  l.tensors = tensors;
  l.local_size = buffer_size;
  l.frozen = frozen;
  for (std::size_t t = 0; t < tensors.size(); ++t)
    l.pieces.push_back({static_cast<int>(t), tensors[t].offset, 0, tensors[t].size});
  std::sort(l.pieces.begin(), l.pieces.end(),
            [](const TensorPiece& a, const TensorPiece& b) { return a.local < b.local; });
  return l;
}

namespace detail {

Subset subsetOf(const ParamLayout& layout,
                const std::function<bool(const model::TensorInfo&)>& chosen) {
  Subset s;
  std::vector<int> index(layout.tensors.size(), -1);
  for (std::size_t t = 0; t < layout.tensors.size(); ++t) {
    if (!chosen(layout.tensors[t])) continue;
    model::TensorInfo info = layout.tensors[t];
    info.offset = s.full_size;
    s.full_size += info.size;
    index[t] = static_cast<int>(s.table.size());
    s.table.push_back(info);
  }
  for (const auto& p : layout.pieces) {
    if (index[p.tensor] < 0) continue;
    s.pieces.push_back({index[p.tensor], s.local_size, p.start, p.count});
    s.param_local.push_back(p.local);
    s.model_tensor.push_back(p.tensor);
    s.local_size += p.count;
  }
  return s;
}

StateBuffer subsetBuffer(const std::string& name, const Subset& subset, bool bytes) {
  StateBuffer b;
  b.name = name;
  b.layout = StateBuffer::Layout::Pieces;
  b.table = subset.table;
  b.full_size = subset.full_size;
  b.pieces = subset.pieces;
  if (bytes)
    b.u8 = flatZeros<std::uint8_t>("plm::train::optim::" + name, subset.local_size);
  else
    b.f32 = flatZeros<master_t>("plm::train::optim::" + name, subset.local_size);
  return b;
}

StateBuffer elementwiseBuffer(const std::string& name, const ParamLayout& layout) {
  StateBuffer b;
  b.name = name;
  b.layout = StateBuffer::Layout::Pieces;
  b.table = layout.tensors;
  for (const auto& t : layout.tensors) b.full_size = std::max(b.full_size, t.offset + t.size);
  b.pieces = layout.pieces;  // same offsets as the parameters
  b.f32 = flatZeros<master_t>("plm::train::optim::" + name, layout.local_size);
  return b;
}

// A free function: CUDA extended lambdas may not live in constructors.
template <class To, class From>
void castCopy(const ExecSpace& space, View1<To> to, View1<From> from, const char* label) {
  plm::flatFor(
      label, space, 0, to.extent(0),
      KOKKOS_LAMBDA(const std::int64_t i) { to(i) = static_cast<To>(from(i)); });
}

}  // namespace detail

template <class P> Optimizer<P>::Optimizer(View1<P> params, ParamLayout layout)
    : params_member(params), layout_member(std::move(layout)) {
  const std::int64_t n = static_cast<std::int64_t>(params.extent(0));
  PLM_REQUIRE(n == layout_member.local_size, "optimizer: the parameter buffer has " +
                                                 std::to_string(n) + " elements, its layout " +
                                                 std::to_string(layout_member.local_size));
  if constexpr (std::is_same_v<P, master_t>) {
    master_member = params;
    aliased_member = true;
  } else {
    master_member =
        View1<master_t>(Kokkos::view_alloc(Kokkos::WithoutInitializing, "plm::train::master"), n);
    detail::castCopy(ExecSpace(), master_member, params, "plm::train::masterFromParams");
  }
  // Flags are built on the host once per run (a tensor table, not a tensor loop).
  HostView1<std::uint8_t> flags("plm::train::flags_host", n);
  for (const auto& p : layout_member.pieces) {
    const auto& t = layout_member.tensors[p.tensor];
    PLM_REQUIRE(p.local >= 0 && p.local + p.count <= n,
                "optimizer: tensor " + t.name + " lies outside the parameter buffer");
    if (!t.weight_decay) continue;
    for (std::int64_t i = p.local; i < p.local + p.count; ++i) flags(i) |= decay_flag;
  }
  for (const auto& r : layout_member.frozen) {
    PLM_REQUIRE(r.offset >= 0 && r.offset + r.size <= n, "optimizer: frozen range out of bounds");
    for (std::int64_t i = r.offset; i < r.offset + r.size; ++i) flags(i) = frozen_flag;
  }
  flags_member = flatZeros<std::uint8_t>("plm::train::flags", n);
  Kokkos::deep_copy(flags_member, flags);
}

template <class P> Optimizer<P>::~Optimizer() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (shard_member != MPI_COMM_NULL && !finalized) MPI_Comm_free(&shard_member);
}

template <class P> void Optimizer<P>::setShardGroup(MPI_Comm shard) {
  if (shard_member != MPI_COMM_NULL) MPI_Comm_free(&shard_member);
  shard_member = MPI_COMM_NULL;
  if (shard == MPI_COMM_NULL) return;
  if (dist::commSize(shard) > 1) PLM_CHECK_MPI(MPI_Comm_dup(shard, &shard_member));
}

template <class P> void Optimizer<P>::shardSum(std::vector<double>& values) const {
  if (shard_member == MPI_COMM_NULL || values.empty()) return;
  PLM_CHECK_MPI(MPI_Allreduce(MPI_IN_PLACE, values.data(), static_cast<int>(values.size()),
                              MPI_DOUBLE, MPI_SUM, shard_member));
}

template <class P> void Optimizer<P>::shardMax(std::vector<float>& values) const {
  if (shard_member == MPI_COMM_NULL || values.empty()) return;
  PLM_CHECK_MPI(MPI_Allreduce(MPI_IN_PLACE, values.data(), static_cast<int>(values.size()),
                              MPI_FLOAT, MPI_MAX, shard_member));
}

template <class P> void Optimizer<P>::maskGradients(const ExecSpace& space, View1<P> grads) const {
  // A few frozen ranges (the <pad> embedding row of every run) are zeroed range by range; a
  // pass over every gradient and flag took as long as AdamW's update (ncu, one H200).  Many
  // ranges (LoRA freezes every base tensor) take the one flag pass.
  const auto& frozen = layout_member.frozen;
  if (frozen.size() <= kFewFrozenRanges) {
    for (const auto& r : frozen)
      Kokkos::deep_copy(space, Kokkos::subview(grads, std::make_pair(r.offset, r.offset + r.size)),
                        P(0));
    return;
  }
  auto flags = flags_member;
  plm::flatFor(
      "plm::train::maskGradients", space, 0, grads.extent(0), KOKKOS_LAMBDA(const std::int64_t i) {
        if (flags(i) & frozen_flag) grads(i) = P(0);
      });
}

template <class P>
void Optimizer<P>::step(const ExecSpace& space, View1<P> grads, double lr, double grad_scale) {
  PLM_REQUIRE(grads.extent(0) == master_member.extent(0),
              std::string("optimizer ") + optimizerName(kind()) +
                  ": gradient and parameter buffers differ in length");
  ++step_member;
  update(space, grads, lr, grad_scale);
  syncParameters(space);
}

template <class P> void Optimizer<P>::syncParameters(const ExecSpace& space) {
  if (aliased_member) return;
  detail::castCopy(space, params_member, master_member, "plm::train::paramsFromMaster");
}

template <class P> View1<master_t> Optimizer<P>::stateF32(const std::string& name) const {
  for (const auto& b : state())
    if (b.name == name && !b.isBytes()) return b.f32;
  throw Error(std::string("optimizer ") + optimizerName(kind()) + " has no fp32 state `" + name +
              "`");
}

template <class P> std::int64_t Optimizer<P>::stateBytes() const {
  std::int64_t bytes = static_cast<std::int64_t>(flags_member.extent(0));
  for (const auto& b : state()) bytes += b.bytes();
  if (!aliased_member)
    bytes += static_cast<std::int64_t>(master_member.extent(0) * sizeof(master_t));
  return bytes;
}

template <class P> std::unique_ptr<Optimizer<P>> makeOptimizer(const OptimizerOptions& options,
                                                               View1<P> params,
                                                               ParamLayout layout) {
  switch (options.kind) {
    case OptimizerKind::AdamW:
      return std::make_unique<AdamW<P>>(params, std::move(layout), options.adamw);
    case OptimizerKind::Lion:
      return std::make_unique<Lion<P>>(params, std::move(layout), options.lion);
    case OptimizerKind::Adafactor:
      return std::make_unique<Adafactor<P>>(params, std::move(layout), options.adafactor);
    case OptimizerKind::AdamW8bit:
      return std::make_unique<AdamW8bit<P>>(params, std::move(layout), options.adamw8bit);
  }
  throw Error("makeOptimizer: unknown kind");
}

namespace {

const StateBuffer& findBuffer(const std::vector<StateBuffer>& buffers, const std::string& name,
                              OptimizerKind kind) {
  for (const auto& b : buffers)
    if (b.name == name) return b;
  throw Error(std::string("optimizer ") + optimizerName(kind) + ": no state buffer `" + name +
              "` to move (the two optimizers differ)");
}

template <class T> void exportPieces(const StateBuffer& from, View1<T> from_view,
                                     const StateBuffer& to, View1<T> to_view, MPI_Comm shard,
                                     MPI_Datatype type) {
  auto local = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), from_view);
  HostView1<T> full("plm::train::optim::export", to_view.extent(0));
  for (const auto& p : from.pieces)
    std::memcpy(full.data() + to.table[p.tensor].offset + p.start, local.data() + p.local,
                p.count * sizeof(T));
  // Each element has exactly one owner; the others add zeros, so the sum is exact.
  // MPI counts are int: a 15B model's state buffer (1.5e10 elements) goes in chunks.
  constexpr std::int64_t chunk = std::int64_t(1) << 30;
  const auto n = static_cast<std::int64_t>(full.extent(0));
  if (shard != MPI_COMM_NULL)
    for (std::int64_t start = 0; start < n; start += chunk)
      PLM_CHECK_MPI(MPI_Allreduce(MPI_IN_PLACE, full.data() + start,
                                  static_cast<int>(std::min(chunk, n - start)), type, MPI_SUM,
                                  shard));
  Kokkos::deep_copy(to_view, full);
}

template <class T> void importPieces(const StateBuffer& from, View1<T> from_view,
                                     const StateBuffer& to, View1<T> to_view) {
  auto full = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), from_view);
  auto local = Kokkos::create_mirror_view(Kokkos::HostSpace(), to_view);
  Kokkos::deep_copy(local, T(0));
  for (const auto& p : to.pieces)
    std::memcpy(local.data() + p.local, full.data() + from.table[p.tensor].offset + p.start,
                p.count * sizeof(T));
  Kokkos::deep_copy(to_view, local);
}

}  // namespace

template <class P> void exportState(const Optimizer<P>& from, Optimizer<P>& to, MPI_Comm shard) {
  PLM_REQUIRE(from.kind() == to.kind(), "exportState: optimizers of different kinds");
  const auto to_buffers = to.state();
  for (const auto& f : from.state()) {
    const StateBuffer& t = findBuffer(to_buffers, f.name, to.kind());
    if (f.layout == StateBuffer::Layout::Replicated) {
      if (f.isBytes())
        Kokkos::deep_copy(t.u8, f.u8);
      else
        Kokkos::deep_copy(t.f32, f.f32);
    } else if (f.isBytes()) {
      exportPieces(f, f.u8, t, t.u8, shard, MPI_UINT8_T);
    } else {
      exportPieces(f, f.f32, t, t.f32, shard, MPI_FLOAT);
    }
  }
  Kokkos::fence();
}

template <class P> void importState(const Optimizer<P>& from, Optimizer<P>& to) {
  PLM_REQUIRE(from.kind() == to.kind(), "importState: optimizers of different kinds");
  const auto from_buffers = from.state();
  for (const auto& t : to.state()) {
    const StateBuffer& f = findBuffer(from_buffers, t.name, from.kind());
    if (t.layout == StateBuffer::Layout::Replicated) {
      if (t.isBytes())
        Kokkos::deep_copy(t.u8, f.u8);
      else
        Kokkos::deep_copy(t.f32, f.f32);
    } else if (t.isBytes()) {
      importPieces(f, f.u8, t, t.u8);
    } else {
      importPieces(f, f.f32, t, t.f32);
    }
  }
  Kokkos::fence();
}

std::int64_t optimizerStateBytes(const OptimizerOptions& options,
                                 const std::vector<model::TensorInfo>& tensors,
                                 std::int64_t buffer_size, int shard) {
  std::int64_t split = buffer_size;  // flags; then every elementwise buffer
  std::int64_t replicated = 0;
  const std::int64_t f = sizeof(master_t);
  switch (options.kind) {
    case OptimizerKind::AdamW: split += 2 * f * buffer_size; break;
    case OptimizerKind::Lion: split += f * buffer_size; break;
    case OptimizerKind::Adafactor:
      if (options.adafactor.beta1 > 0) split += f * buffer_size;
      for (const auto& t : tensors) {
        if (adafactorFactored(t))
          replicated += f * (t.shape[0] + t.shape[1]);
        else
          split += f * t.size;
      }
      break;
    case OptimizerKind::AdamW8bit:
      replicated += 2 * 256 * f;  // the two quantile maps
      for (const auto& t : tensors) {
        if (adamw8bitQuantised(options.adamw8bit, t)) {
          const std::int64_t blocks =
              (t.size + options.adamw8bit.block_size - 1) / options.adamw8bit.block_size;
          split += 2 * t.size;
          replicated += 2 * f * blocks;
        } else {
          split += 2 * f * t.size;
        }
      }
      break;
  }
  const std::int64_t s = std::max(1, shard);
  return (split + s - 1) / s + replicated;
}

double optimizerBytesPerParameter(const OptimizerOptions& options,
                                  const std::vector<model::TensorInfo>& tensors) {
  std::int64_t params = 0, buffer = 0;
  for (const auto& t : tensors) {
    params += t.size;
    buffer = std::max(buffer, t.offset + t.size);
  }
  return params ? double(optimizerStateBytes(options, tensors, buffer)) / double(params) : 0.0;
}

#define PLM_OPTIMIZER_INSTANTIATE(P)                                                         \
  template class Optimizer<P>;                                                               \
  template std::unique_ptr<Optimizer<P>> makeOptimizer<P>(const OptimizerOptions&, View1<P>, \
                                                          ParamLayout);                      \
  template void exportState<P>(const Optimizer<P>&, Optimizer<P>&, MPI_Comm);                \
  template void importState<P>(const Optimizer<P>&, Optimizer<P>&);
PLM_OPTIMIZER_INSTANTIATE(float)
PLM_OPTIMIZER_INSTANTIATE(double)
#undef PLM_OPTIMIZER_INSTANTIATE

}  // namespace plm::train
