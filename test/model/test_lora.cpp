// LoRA adapter kernels (model/lora.hpp): the merged weight gives the unmerged output, B = 0 is
// the base linear bit for bit, gradients of A, B and x by central finite differences (double),
// PEFT's initialisation bound, and the targets parser.  Shapes are small and odd (r = 3 between
// the other sizes) so no dimension is a multiple of a block.
#include "core/error.hpp"
#include "model/linear.hpp"
#include "model/lora.hpp"
#include "model_test_util.hpp"

#include <algorithm>

namespace plm::model::test {
namespace {

constexpr int rows = 11, in = 13, out = 7, rank = 3;

// y = x W^T + b + s (x A^T) B^T through linearForward + loraForward.
template <class T> View2<T> adapted(const View2<T>& x, const View2<T>& w, const View1<T>& b,
                                    const View2<T>& a, const View2<T>& bb, T s) {
  const ExecSpace space;
  View2<T> y("y", x.extent(0), w.extent(0));
  View2<T> tmp("tmp", x.extent(0), a.extent(0));
  linearForward(space, x, w, b, T(0), y);
  loraForward(space, x, a, bb, s, tmp, y);
  Kokkos::fence();
  return y;
}

TEST(ModelLora, MergedWeightGivesTheUnmergedOutput) {
  const ExecSpace space;
  using T = float;
  auto x = randomView<T>(rows, in, 1);
  auto w = randomView<T>(out, in, 2, 0.3);
  auto b = randomVector<T>(out, 3, 0.1);
  auto a = randomView<T>(rank, in, 4, 0.3);
  auto bb = randomView<T>(out, rank, 5, 0.3);
  const T s = T(16.0 / rank);
  auto y_lora = toHost(adapted(x, w, b, a, bb, s));
  loraMerge(space, w, a, bb, s);
  View2<T> y("y", rows, out);
  linearForward(space, x, w, b, T(0), y);
  auto y_merged = toHost(y);
  for (std::size_t i = 0; i < y_lora.size(); ++i)
    EXPECT_NEAR(y_lora[i], y_merged[i], 1e-6 * (1 + std::abs(y_merged[i]))) << i;
  // The adapter must move the output away from the base one, or the comparison proves nothing.
  double delta = 0;
  auto w0 = randomView<T>(out, in, 2, 0.3);
  View2<T> y0("y0", rows, out);
  linearForward(space, x, w0, b, T(0), y0);
  auto y_base = toHost(y0);
  for (std::size_t i = 0; i < y_base.size(); ++i)
    delta = std::max(delta, double(std::abs(y_base[i] - y_lora[i])));
  EXPECT_GT(delta, 0.1);
}

TEST(ModelLora, ZeroBIsTheBaseLinearExactly) {
  const ExecSpace space;
  using T = float;
  auto x = randomView<T>(rows, in, 1);
  auto w = randomView<T>(out, in, 2, 0.3);
  auto b = randomVector<T>(out, 3, 0.1);
  View2<T> a("a", rank, in);
  loraInitA(space, a, 42, 9);
  View2<T> bb("b", out, rank);  // zero, as initialised
  auto y_lora = toHost(adapted(x, w, b, a, bb, T(2)));
  View2<T> y("y", rows, out);
  linearForward(space, x, w, b, T(0), y);
  auto y_base = toHost(y);
  for (std::size_t i = 0; i < y_base.size(); ++i) ASSERT_EQ(y_lora[i], y_base[i]) << i;
}

TEST(ModelLora, GradientsMatchFiniteDifferences) {
  const ExecSpace space;
  using T = double;
  auto x = randomView<T>(rows, in, 1);
  auto w = randomView<T>(out, in, 2, 0.3);
  auto b = randomVector<T>(out, 3, 0.1);
  auto a = randomView<T>(rank, in, 4, 0.3);
  auto bb = randomView<T>(out, rank, 5, 0.3);
  auto dy = randomView<T>(rows, out, 6);
  const T s = 2.5;
  // loss = <dy, y>, so dL/dy = dy.
  auto loss = [&] { return dotViews(adapted(x, w, b, a, bb, s), dy); };
  View2<T> tmp("tmp", rows, rank), dtmp("dtmp", rows, rank);
  View2<T> dx("dx", rows, in), da("da", rank, in), db("db", out, rank);
  View2<T> dw("dw", out, in);
  View1<T> dbias("dbias", out);
  linearBackward(space, x, w, dy, T(0), dx, dw, dbias);
  // tmp left stale on purpose: recompute_tmp must refill it.
  Kokkos::deep_copy(tmp, T(7));
  loraBackward(space, x, a, bb, s, tmp, true, dy, dtmp, dx, da, db);
  Kokkos::fence();
  checkGradient("dA", flat(a), flat(da), loss);
  checkGradient("dB", flat(bb), flat(db), loss);
  checkGradient("dx", flat(x), flat(dx), loss);
  // Accumulation: a second backward doubles dA and dB.
  auto da1 = toHost(da);
  loraBackward(space, x, a, bb, s, tmp, false, dy, dtmp, View2<T>(), da, db);
  auto da2 = toHost(da);
  for (std::size_t i = 0; i < da1.size(); ++i) EXPECT_NEAR(da2[i], 2 * da1[i], 1e-12);
}

TEST(ModelLora, InitialisationIsPeftsKaimingUniform) {
  const ExecSpace space;
  const int fan_in = 320;
  View2<double> a("a", 8, fan_in), a2("a2", 8, fan_in), other("other", 8, fan_in);
  loraInitA(space, a, 1, 5);
  loraInitA(space, a2, 1, 5);
  loraInitA(space, other, 1, 6);
  auto v = toHost(a), v2 = toHost(a2), w = toHost(other);
  const double bound = 1.0 / std::sqrt(double(fan_in));
  double lo = 1, hi = -1, sum = 0, sq = 0;
  for (double e : v) {
    lo = std::min(lo, e);
    hi = std::max(hi, e);
    sum += e;
    sq += e * e;
  }
  const double n = double(v.size());
  EXPECT_GE(lo, -bound);
  EXPECT_LT(hi, bound);
  EXPECT_LT(lo, -0.9 * bound);  // spans the interval
  EXPECT_GT(hi, 0.9 * bound);
  EXPECT_NEAR(sum / n, 0.0, 4 * bound / std::sqrt(3 * n));
  EXPECT_NEAR(sq / n, bound * bound / 3, 0.1 * bound * bound / 3);  // variance of U(-c, c)
  EXPECT_EQ(v, v2);                                                 // deterministic
  EXPECT_NE(v, w);                                                  // streams differ
}

TEST(ModelLora, TargetsParse) {
  EXPECT_EQ(parseLoraTargets("q,k,v,o"), unsigned(lora_q | lora_k | lora_v | lora_o));
  EXPECT_EQ(parseLoraTargets(" ffn_in , ffn_out"), unsigned(lora_ffn_in | lora_ffn_out));
  EXPECT_EQ(loraTargetNames(parseLoraTargets("v,q")), "q,v");
  EXPECT_THROW(parseLoraTargets("q,query"), Error);
  EXPECT_THROW(parseLoraTargets(" , "), Error);
  LoraConfig c;
  c.rank = 4;
  c.alpha = 16;
  EXPECT_DOUBLE_EQ(c.scale(), 4.0);
  EXPECT_TRUE(c.has(lora_q));
  EXPECT_FALSE(c.has(lora_ffn_in));
}

}  // namespace
}  // namespace plm::model::test
