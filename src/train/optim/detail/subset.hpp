// Compact elementwise state over a subset of tensors (Adafactor's unfactored second moment,
// 8-bit AdamW's codes and its fp32 part): the local buffer concatenates this rank's pieces of the
// chosen tensors, the full layout (checkpoints) concatenates the whole tensors in table order.
#pragma once

#include "train/optim/optimizer.hpp"

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace plm::train::detail {

struct Subset {
  std::vector<model::TensorInfo> table;  // chosen tensors, offsets into the full buffer
  std::int64_t full_size = 0;
  std::vector<TensorPiece> pieces;        // tensor indexes `table`, local into the compact buffer
  std::vector<std::int64_t> param_local;  // per piece: its local offset in the parameter buffer
  std::vector<int> model_tensor;          // per piece: its index in layout.tensors
  std::int64_t local_size = 0;
};

/// \brief The tensors of `layout` for which `chosen` is true, laid out compactly.
Subset subsetOf(const ParamLayout& layout,
                const std::function<bool(const model::TensorInfo&)>& chosen);

/// \brief A state buffer over `subset` (fp32 or bytes), zero-initialised.
StateBuffer subsetBuffer(const std::string& name, const Subset& subset, bool bytes);

/// \brief An fp32 state buffer with the parameter buffer's own layout (every tensor at its
/// offset, padding included), zero-initialised: AdamW's and Lion's moments.
StateBuffer elementwiseBuffer(const std::string& name, const ParamLayout& layout);

/// \brief A device copy of a host table (segments, pieces) the kernels read.
template <class T>
Kokkos::View<T*, MemSpace> toDevice(const std::vector<T>& host, const std::string& label) {
  Kokkos::View<T*, MemSpace> d(label, host.size());
  auto h = Kokkos::create_mirror_view(d);
  for (std::size_t i = 0; i < host.size(); ++i) h(i) = host[i];
  Kokkos::deep_copy(d, h);
  return d;
}

}  // namespace plm::train::detail
