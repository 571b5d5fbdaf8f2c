#include "train/gradient_sync.hpp"

#include "core/error.hpp"

#include <algorithm>
#include <map>
#include <string>

namespace plm::train {

namespace {

// The encoder layer a tensor belongs to, or -1 (embeddings / head).
int layerOf(const std::string& name) {
  static const std::string prefix = "esm.encoder.layer.";
  if (name.compare(0, prefix.size(), prefix) != 0) return -1;
  return std::stoi(name.substr(prefix.size()));
}

}  // namespace

std::vector<dist::BufferRange> backwardOrderRanges(const std::vector<model::TensorInfo>& tensors,
                                                   std::int64_t buffer_size) {
  PLM_REQUIRE(!tensors.empty(), "train::backwardOrderRanges: empty tensor table");
  // Each group's [first offset, end of its last tensor); groups: -2 embeddings (before the
  // layers), 0..L-1 layers, L head (after the layers).
  std::map<int, dist::BufferRange> groups;
  int last_layer = -1;
  for (const auto& t : tensors) {
    int g = layerOf(t.name);
    if (g < 0) g = last_layer < 0 ? -2 : 1 << 30;  // before any layer, or after them
    last_layer = std::max(last_layer, layerOf(t.name));
    auto it = groups.find(g);
    if (it == groups.end()) {
      groups[g] = {t.offset, t.size};
    } else {
      const std::int64_t begin = std::min(it->second.offset, t.offset);
      const std::int64_t end = std::max(it->second.offset + it->second.count, t.offset + t.size);
      it->second = {begin, end - begin};
    }
  }
  // Groups in buffer order must not interleave; each then extends to the next one's start so
  // the padding between tensors is covered too.
  std::vector<std::pair<int, dist::BufferRange>> by_offset(groups.begin(), groups.end());
  std::sort(by_offset.begin(), by_offset.end(),
            [](const auto& a, const auto& b) { return a.second.offset < b.second.offset; });
  PLM_REQUIRE(by_offset.front().second.offset == 0,
              "train::backwardOrderRanges: the tensor table does not start at offset 0");
  for (std::size_t i = 0; i < by_offset.size(); ++i) {
    auto& r = by_offset[i].second;
    const std::int64_t next =
        i + 1 < by_offset.size() ? by_offset[i + 1].second.offset : buffer_size;
    PLM_REQUIRE(r.offset + r.count <= next,
                "train::backwardOrderRanges: the tensors of one layer are not contiguous in the "
                "flat buffer (group " +
                    std::to_string(by_offset[i].first) + ")");
    r.count = next - r.offset;
    groups[by_offset[i].first] = r;
  }
  std::vector<dist::BufferRange> order;
  for (auto it = groups.rbegin(); it != groups.rend(); ++it) order.push_back(it->second);
  return order;  // head (key 1<<30), layers descending, embeddings (key -2)
}

template <class P> GradientSync<P>::GradientSync(model::Esm2<P>& model, MPI_Comm comm,
                                                 dist::Backend backend, std::int64_t bucket_bytes)
    : comm_member(dist::makeCommunicator(comm, backend)) {
  View1<P> grads = model.gradients();
  ranges_member = backwardOrderRanges(model.tensors(), static_cast<std::int64_t>(grads.extent(0)));
  buckets_member =
      std::make_unique<dist::GradientBuckets<P>>(grads, ranges_member, *comm_member, bucket_bytes);
}

template <class P> void GradientSync<P>::readyAll(const ExecSpace& space) {
  for (const auto& r : ranges_member) buckets_member->ready(space, r.offset, r.count);
}

template class GradientSync<float>;
template class GradientSync<double>;

}  // namespace plm::train
