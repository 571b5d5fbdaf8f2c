// Flash attention against the plain reference (forward and backward), against finite
// differences, and for sequence isolation.  Ragged lengths include 1, exact tile multiples and
// lengths just past a tile boundary; several tile shapes (1x1 up to one tile per sequence) make
// every online-softmax rescaling path run.
#include "model/attention.hpp"
#include "model_test_util.hpp"

namespace plm::model::test {
namespace {

View1<seqlen_t> cuSeqlens(const std::vector<int>& lengths) {
  std::vector<seqlen_t> cu = {0};
  for (int l : lengths) cu.push_back(cu.back() + l);
  View1<seqlen_t> d("cu", cu.size());
  Kokkos::deep_copy(d, Kokkos::View<const seqlen_t*, HostSpace>(cu.data(), cu.size()));
  return d;
}

int total(const std::vector<int>& lengths) {
  int t = 0;
  for (int l : lengths) t += l;
  return t;
}

template <class T> void compareFlashWithReference(const std::vector<int>& lengths, int heads, int d,
                                                  AttentionTiles tiles, double tol) {
  const ExecSpace space;
  const int t = total(lengths), h = heads * d;
  auto cu = cuSeqlens(lengths);
  auto q = randomView<T>(t, h, 1, 0.7), k = randomView<T>(t, h, 2, 0.7), v = randomView<T>(t, h, 3);
  auto dout = randomView<T>(t, h, 4);
  View2<T> out("out", t, h), lse("lse", t, heads), out_ref("out_ref", t, h),
      lse_ref("lse_ref", t, heads);
  attentionForward(space, q, k, v, cu, heads, out, lse, tiles);
  attentionReferenceForward(space, q, k, v, cu, heads, out_ref, lse_ref);
  View2<T> dq("dq", t, h), dk("dk", t, h), dv("dv", t, h), delta("delta", t, heads);
  View2<T> dq_ref("dq_ref", t, h), dk_ref("dk_ref", t, h), dv_ref("dv_ref", t, h);
  attentionBackward(space, q, k, v, out, lse, dout, cu, heads, delta, dq, dk, dv, tiles);
  attentionReferenceBackward(space, q, k, v, dout, cu, heads, dq_ref, dk_ref, dv_ref);
  const std::string where =
      "tiles " + std::to_string(tiles.queries) + "x" + std::to_string(tiles.keys);
  auto expectClose = [&](const View2<T>& a, const View2<T>& b, const char* name) {
    auto x = toHost(a), y = toHost(b);
    for (std::size_t i = 0; i < x.size(); ++i)
      ASSERT_NEAR(x[i], y[i], tol * (1 + std::abs(double(y[i]))))
          << name << "[" << i << "] " << where;
  };
  expectClose(out, out_ref, "out");
  expectClose(lse, lse_ref, "lse");
  expectClose(dq, dq_ref, "dq");
  expectClose(dk, dk_ref, "dk");
  expectClose(dv, dv_ref, "dv");
}

const std::vector<int> kLengths = {1, 5, 9, 4, 13, 8, 1};

TEST(ModelAttention, FlashMatchesReferenceDouble) {
  for (AttentionTiles tiles : {AttentionTiles{1, 1}, AttentionTiles{4, 3}, AttentionTiles{2, 8},
                               AttentionTiles{4, 4}, AttentionTiles{64, 64}})
    compareFlashWithReference<double>(kLengths, 2, 6, tiles, 1e-12);
}

TEST(ModelAttention, FlashMatchesReferenceFloat) {
  for (AttentionTiles tiles : {AttentionTiles{3, 5}, AttentionTiles{64, 64}})
    compareFlashWithReference<float>(kLengths, 3, 8, tiles, 2e-5);
}

TEST(ModelAttention, LongerSequencesManyTiles) {
  compareFlashWithReference<double>({70, 1, 129, 64}, 2, 4, AttentionTiles{16, 32}, 1e-12);
  compareFlashWithReference<float>({70, 1, 129, 64}, 2, 16, AttentionTiles{64, 64}, 2e-5);
}

TEST(ModelAttention, GradientsMatchFiniteDifferences) {
  const ExecSpace space;
  const std::vector<int> lengths = {1, 5, 9};
  const int heads = 2, d = 4, t = total(lengths), h = heads * d;
  const AttentionTiles tiles{4, 3};
  auto cu = cuSeqlens(lengths);
  auto q = randomView<double>(t, h, 11), k = randomView<double>(t, h, 12),
       v = randomView<double>(t, h, 13);
  auto r = randomView<double>(t, h, 14);
  View2<double> out("out", t, h), lse("lse", t, heads);
  auto loss = [&]() {
    attentionForward(space, q, k, v, cu, heads, out, lse, tiles);
    return dotViews(out, r);
  };
  loss();
  View2<double> dq("dq", t, h), dk("dk", t, h), dv("dv", t, h), delta("delta", t, heads);
  attentionBackward(space, q, k, v, out, lse, r, cu, heads, delta, dq, dk, dv, tiles);
  checkGradient("attention dq", flat(q), flat(dq), loss);
  checkGradient("attention dk", flat(k), flat(dk), loss);
  checkGradient("attention dv", flat(v), flat(dv), loss);
}

TEST(ModelAttention, NeverCrossesSequenceBoundaries) {
  const ExecSpace space;
  const std::vector<int> lengths = {6, 1, 7, 5};
  const int heads = 2, d = 4, t = total(lengths), h = heads * d;
  const AttentionTiles tiles{4, 4};  // tiles straddle the boundaries of the packed stream
  auto cu = cuSeqlens(lengths);
  auto q = randomView<double>(t, h, 21), k = randomView<double>(t, h, 22),
       v = randomView<double>(t, h, 23);
  View2<double> out1("out1", t, h), out2("out2", t, h), lse("lse", t, heads);
  attentionForward(space, q, k, v, cu, heads, out1, lse, tiles);
  // Perturb every q, k, v of the third sequence (tokens 7..13).
  for (int i = 7 * h; i < 14 * h; ++i) {
    addToElement(flat(q), i, 0.5);
    addToElement(flat(k), i, -0.3);
    addToElement(flat(v), i, 0.9);
  }
  attentionForward(space, q, k, v, cu, heads, out2, lse, tiles);
  auto a = toHost(out1), b = toHost(out2);
  for (int tok = 0; tok < t; ++tok)
    for (int c = 0; c < h; ++c) {
      if (tok >= 7 && tok < 14)
        EXPECT_NE(a[tok * h + c], b[tok * h + c]) << "token " << tok;
      else
        EXPECT_EQ(a[tok * h + c], b[tok * h + c]) << "token " << tok << " saw another sequence";
    }
  // A sequence of length 1 attends only to itself: its output is its own v.
  auto vv = toHost(v);
  for (int c = 0; c < h; ++c) EXPECT_NEAR(b[6 * h + c], vv[6 * h + c], 1e-15);
}

}  // namespace
}  // namespace plm::model::test
