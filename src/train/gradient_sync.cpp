#include "train/gradient_sync.hpp"

#include "core/error.hpp"
#include "dist/process_groups.hpp"

#include <algorithm>
#include <map>
#include <string>

namespace plm::train {

std::vector<dist::BufferRange> backwardOrderRanges(const std::vector<model::TensorInfo>& tensors,
                                                   std::int64_t buffer_size) {
  PLM_REQUIRE(!tensors.empty(), "train::backwardOrderRanges: empty tensor table");
  // Each group's [first offset, end of its last tensor); groups: -2 embeddings (before the
  // layers), 0..L-1 layers, L head (after the layers).
  std::map<int, dist::BufferRange> groups;
  for (const auto& t : tensors) {
    const int g = t.group == model::TensorGroup::Layer       ? t.layer
                  : t.group == model::TensorGroup::Embedding ? -2
                                                             : 1 << 30;
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
  // Each range less the experts' run inside it (a layer's routed experts are one run); a model
  // holding every expert reduces them with the rest, so its ranges are whole.
  const model::ExpertPlacement& held = model.expertPlacement();
  const auto runs = held.sharded() ? model::expertRuns(model.tensors())
                                   : std::vector<std::pair<std::int64_t, std::int64_t>>();
  std::vector<dist::BufferRange> dense_order;
  for (const auto& r : ranges_member) {
    std::vector<dist::BufferRange> pieces;
    int inside = -1;
    std::int64_t at = r.offset;
    for (std::size_t i = 0; i < runs.size(); ++i) {
      const auto [offset, count] = runs[i];
      if (offset < r.offset || offset + count > r.offset + r.count) continue;
      PLM_REQUIRE(inside < 0, "train::GradientSync: two expert runs in one range (a bug)");
      inside = static_cast<int>(expert_runs_member.size());
      expert_runs_member.push_back({offset, count});
      if (offset > at) pieces.push_back({at, offset - at});
      at = offset + count;
    }
    if (r.offset + r.count > at) pieces.push_back({at, r.offset + r.count - at});
    dense_order.insert(dense_order.end(), pieces.begin(), pieces.end());
    pieces_member.push_back(std::move(pieces));
    expert_run_member.push_back(inside);
  }
  PLM_REQUIRE(expert_runs_member.size() == runs.size(),
              "train::GradientSync: an expert run crosses a layer range (a bug)");
  buckets_member =
      std::make_unique<dist::GradientBuckets<P>>(grads, dense_order, *comm_member, bucket_bytes);
  if (runs.empty()) return;
  const int rank = dist::commRank(comm);
  PLM_CHECK_MPI(MPI_Comm_split(comm, held.rank, rank, &expert_data_member));
  if (dist::commSize(expert_data_member) > 1) {
    expert_comm_member = dist::makeCommunicator(expert_data_member, backend);
    expert_buckets_member = std::make_unique<dist::GradientBuckets<P>>(
        grads, expert_runs_member, *expert_comm_member, bucket_bytes);
  }
}

template <class P> GradientSync<P>::~GradientSync() {
  expert_buckets_member.reset();
  expert_comm_member.reset();
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (expert_data_member != MPI_COMM_NULL && !finalized) MPI_Comm_free(&expert_data_member);
}

template <class P> void GradientSync<P>::ready(const ExecSpace& space, int index) {
  for (const auto& p : pieces_member.at(static_cast<std::size_t>(index)))
    buckets_member->ready(space, p.offset, p.count);
  const int run = expert_run_member[static_cast<std::size_t>(index)];
  if (run >= 0 && expert_buckets_member) {
    const auto& r = expert_runs_member[static_cast<std::size_t>(run)];
    expert_buckets_member->ready(space, r.offset, r.count);
  }
}

template <class P> void GradientSync<P>::readyAll(const ExecSpace& space) {
  for (std::size_t i = 0; i < ranges_member.size(); ++i) ready(space, static_cast<int>(i));
}

template <class P> void GradientSync<P>::finish(const ExecSpace& space) {
  buckets_member->finish(space);
  if (expert_buckets_member) expert_buckets_member->finish(space);
}

template class GradientSync<float>;
template class GradientSync<double>;

}  // namespace plm::train
