// Esm2::placeRange and holdWholeBuffers, which sharded data parallelism (train/fsdp.hpp) uses to
// compute on gathered buffers: a model whose every group of tensors (embeddings, each layer,
// the head) is placed in separate buffers and whose whole buffers are freed gives bitwise the
// loss of the unplaced model and writes bitwise its gradients into the placed gradient buffers;
// moving a layer to another buffer between passes keeps that; both for the dense ESM-2 and an
// MoE model (the FFN block's handles move too), with every recomputation mode.  Misuse (a range
// cutting a group, freeing a buffer a group still points into) throws.
#include "core/error.hpp"
#include "model/esm2.hpp"
#include "model_test_util.hpp"

#include <gtest/gtest.h>

#include <vector>

namespace {

using namespace plm;
using model::Esm2;
using model::Esm2Config;

Esm2Config dense() {
  Esm2Config c;
  c.num_layers = 3;
  c.hidden = 16;
  c.heads = 2;
  c.ffn = 24;
  return c;
}

Esm2Config moe() {
  Esm2Config c = dense();
  c.moe.experts = 4;
  c.moe.top_k = 2;
  c.moe.every = 2;
  c.moe.expert_ffn = 8;
  c.moe.shared_experts = 1;
  c.moe.aux_loss = 0.05;
  c.moe.z_loss = 0.01;
  return c;
}

struct Group {
  std::int64_t offset, count;
  View1<double> params, grads;
};

// Embeddings, layers, head: every group copied into buffers of its own (from the whole buffer,
// or drawn with initializeRange(seed) where the model holds none).
std::vector<Group> placeAll(Esm2<double>& m, std::uint64_t seed = 0) {
  const std::int64_t n = m.bufferElements();
  const int layers = m.config().num_layers;
  std::vector<std::pair<std::int64_t, std::int64_t>> ranges = {{0, m.layerRange(0).first}};
  for (int l = 0; l < layers; ++l) ranges.push_back(m.layerRange(l));
  const auto last = m.layerRange(layers - 1);
  ranges.push_back({last.first + last.second, n - last.first - last.second});
  std::vector<Group> out;
  for (auto [offset, count] : ranges) {
    Group g{offset, count, View1<double>("params", count), View1<double>("grads", count)};
    if (m.parameters().extent(0) > 0)
      Kokkos::deep_copy(g.params,
                        Kokkos::subview(m.parameters(), std::make_pair(offset, offset + count)));
    else
      m.initializeRange(seed, offset, count, g.params.data());
    m.placeRange(offset, count, g.params.data(), g.grads.data());
    out.push_back(g);
  }
  return out;
}

void expectSame(const char* what, const View1<double>& want, const View1<double>& got) {
  const auto a = model::test::toHost(want), b = model::test::toHost(got);
  ASSERT_EQ(a.size(), b.size()) << what;
  for (std::size_t i = 0; i < a.size(); ++i) ASSERT_EQ(a[i], b[i]) << what << ", element " << i;
}

// `drawn`: the placed model is built without whole buffers (ModelBuffers::None, as sharded
// training builds it) and its groups are drawn by initializeRange; a pass before they are
// placed throws.
void placedMatchesWhole(Esm2Config c, bool drawn = false) {
  const auto batch = model::test::makeBatch({9, 14, 6}, 5);
  Esm2<double> whole(c),
      placed(c, {}, drawn ? model::ModelBuffers::None : model::ModelBuffers::Whole);
  whole.initialize(21);
  EXPECT_EQ(placed.bufferElements(), whole.bufferElements());
  if (drawn) {
    EXPECT_EQ(placed.parameters().extent(0), 0u);
    EXPECT_THROW(placed.forwardBackward(batch, 0.25), Error);  // its views lead nowhere yet
  } else {
    placed.initialize(21);
  }
  auto groups = placeAll(placed, 21);
  placed.holdWholeBuffers(false, false);
  EXPECT_EQ(placed.parameters().extent(0), 0u);
  for (int pass = 0; pass < 2; ++pass) {
    whole.zeroGradients();
    for (auto& g : groups) Kokkos::deep_copy(g.grads, 0.0);
    const double want = whole.forwardBackward(batch, 0.25);
    const double got = placed.forwardBackward(batch, 0.25);
    EXPECT_EQ(want, got) << "pass " << pass;
    for (const auto& g : groups)
      expectSame("gradient",
                 Kokkos::subview(whole.gradients(), std::make_pair(g.offset, g.offset + g.count)),
                 g.grads);
    // Move layer 1 to fresh buffers (as a gathered layer moves between slots).
    Group& l1 = groups[2];
    Group moved{l1.offset, l1.count, View1<double>("params2", l1.count),
                View1<double>("grads2", l1.count)};
    Kokkos::deep_copy(moved.params, l1.params);
    Kokkos::deep_copy(l1.params, std::numeric_limits<double>::quiet_NaN());  // the old slot
    placed.placeRange(moved.offset, moved.count, moved.params.data(), moved.grads.data());
    l1 = moved;
  }
}

TEST(Placement, PlacedGroupsComputeBitwiseAsTheWholeBuffer) {
  for (auto mode : {model::Recompute::None, model::Recompute::Layer, model::Recompute::Selective}) {
    Esm2Config c = dense();
    c.recompute = mode;
    placedMatchesWhole(c);
  }
}

TEST(Placement, MoeBlocksMoveWithTheirLayer) { placedMatchesWhole(moe()); }

TEST(Placement, ModelWithoutWholeBuffersDrawsItsGroupsAsInitialize) {
  placedMatchesWhole(dense(), true);
  placedMatchesWhole(moe(), true);
}

// Expert parallelism builds only the experts a rank holds: its buffer is smaller than the
// whole model's and each held tensor (a held expert under its global name, every dense tensor)
// has bitwise the whole model's initial values, from its own stream.
TEST(Placement, HeldExpertsDrawTheWholeModelsValues) {
  Esm2<double> whole(moe());
  whole.initialize(21);
  const auto all = model::test::toHost(whole.parameters());
  for (int r = 0; r < 2; ++r) {
    Esm2<double> part(moe(), model::ExpertPlacement{2, r});
    part.initialize(21);
    EXPECT_LT(part.bufferElements(), whole.bufferElements());
    const auto mine = model::test::toHost(part.parameters());
    int experts = 0;
    for (const auto& t : part.tensors()) {
      experts += t.expert >= 0 ? 1 : 0;
      const auto& w = whole.tensor(t.name);
      ASSERT_EQ(w.size, t.size) << t.name;
      for (std::int64_t i = 0; i < t.size; ++i)
        ASSERT_EQ(mine[t.offset + i], all[w.offset + i]) << t.name << " element " << i;
    }
    EXPECT_GT(experts, 0);
  }
}

TEST(Placement, MisuseThrows) {
  Esm2<double> m(dense());
  const auto l0 = m.layerRange(0);
  View1<double> p("p", l0.second), g("g", l0.second);
  EXPECT_THROW(m.placeRange(l0.first, l0.second / 2, p.data(), g.data()), Error);
  m.placeRange(l0.first, l0.second, p.data(), g.data());
  EXPECT_THROW(m.holdWholeBuffers(false, true), Error);  // other groups still point there
  m.placeRange(l0.first, l0.second, nullptr, nullptr);   // back into the whole buffers
  m.initialize(1);
}

}  // namespace
