// Parity with Hugging Face transformers: plm's Esm2<float> and Esm2<double> against the float64
// fixtures of validation/make_parity_fixtures.py (random EsmForMaskedLM models, a packed batch
// of sequences of different lengths with MLM masking). Logits, last hidden state and loss must
// agree to 1e-5 relative in fp32; every parameter gradient to 1e-4 relative (norm of the
// difference over the norm of the reference, per tensor). The fixtures are float64 throughout
// (the script lifts transformers' few float32 internals to float64), so double must agree to
// rounding: 1e-12 (measured ~1e-15).
#include "fixture.hpp"
#include "model/esm2.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <set>

namespace {

using plm::test::Array;
using plm::test::Fixture;

struct Tolerances {
  double logits, loss, grads;
};

template <class T> Tolerances tolerances();
template <> Tolerances tolerances<float>() { return {1e-5, 1e-5, 1e-4}; }
template <> Tolerances tolerances<double>() { return {1e-12, 1e-12, 1e-11}; }

// max |a - b| / max |b|: relative to the tensor's scale, so entries near zero do not dominate.
template <class View> double maxRelative(const View& got, const Array& want) {
  auto host = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), got);
  EXPECT_EQ(std::size_t(host.size()), want.values.size());
  double diff = 0, scale = 0;
  const auto* data = host.data();
  for (std::size_t i = 0; i < want.values.size(); ++i) {
    diff = std::max(diff, std::abs(double(data[i]) - want.values[i]));
    scale = std::max(scale, std::abs(want.values[i]));
  }
  return diff / scale;
}

plm::data::MicroBatch makeBatch(const std::vector<std::int32_t>& tokens,
                                const std::vector<std::int32_t>& labels,
                                const std::vector<std::int32_t>& cu_seqlens) {
  plm::data::MicroBatch b;
  b.tokens = plm::HostView1<plm::token_t>("tokens", tokens.size());
  b.labels = plm::HostView1<std::int32_t>("labels", tokens.size());
  b.cu_seqlens = plm::HostView1<plm::seqlen_t>("cu_seqlens", cu_seqlens.size());
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    b.tokens(i) = plm::token_t(tokens[i]);
    b.labels(i) = labels.empty() ? plm::data::vocab::ignore_label : labels[i];
    if (b.labels(i) != plm::data::vocab::ignore_label) ++b.num_masked;
  }
  for (std::size_t s = 0; s < cu_seqlens.size(); ++s) {
    b.cu_seqlens(s) = cu_seqlens[s];
    if (s) b.max_seqlen = std::max(b.max_seqlen, cu_seqlens[s] - cu_seqlens[s - 1]);
  }
  return b;
}

template <class T> void loadParameters(plm::model::Esm2<T>& model, const Fixture& f) {
  const auto& tensors = model.tensors();
  std::set<std::string> names;
  auto host = Kokkos::create_mirror_view(Kokkos::HostSpace(), model.parameters());
  for (const auto& t : tensors) {
    names.insert(t.name);
    ASSERT_TRUE(f.params.count(t.name))
        << "model tensor " << t.name << " is not a transformers parameter";
    const Array& a = f.params.at(t.name);
    ASSERT_EQ(t.shape, a.shape) << t.name;
    for (std::int64_t i = 0; i < t.size; ++i) host(t.offset + i) = T(a.values[std::size_t(i)]);
  }
  for (const auto& [name, a] : f.params)
    EXPECT_TRUE(names.count(name)) << "transformers parameter " << name << " missing in plm";
  Kokkos::deep_copy(model.parameters(), host);
}

template <class T> void checkFixture(const std::string& name) {
  const Fixture f = plm::test::readFixture(plm::test::fixturePath(name));
  const Tolerances tol = tolerances<T>();
  const char* type = std::is_same<T, float>::value ? "float" : "double";
  plm::model::Esm2<T> model(f.config);
  loadParameters(model, f);
  if (::testing::Test::HasFatalFailure()) return;
  const auto batch = makeBatch(f.tokens, f.labels, f.cu_seqlens);
  ASSERT_EQ(batch.num_masked, f.num_masked);
  const double count = double(batch.num_masked);

  // Forward: logits, last_hidden_state, loss.
  plm::model::ForwardOutputs<T> out;
  out.want_logits = true;
  out.want_hidden = true;
  const double sum = model.forward(batch, &out);
  const double loss_error = std::abs(sum / count - f.loss) / std::abs(f.loss);
  const double logits_error = maxRelative(out.logits, f.logits);
  const double hidden_error = maxRelative(out.hidden, f.last_hidden_state);
  EXPECT_LE(loss_error, tol.loss) << name << " " << type;
  EXPECT_LE(logits_error, tol.logits) << name << " " << type;
  EXPECT_LE(hidden_error, tol.logits) << name << " " << type;

  // Backward: gradients of the mean loss (grad_scale = 1 / masked count).
  model.zeroGradients();
  const double sum_fb = model.forwardBackward(batch, 1.0 / count);
  EXPECT_LE(std::abs(sum_fb - sum) / std::abs(sum), tol.loss)
      << "forwardBackward and forward disagree";
  auto grads = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), model.gradients());
  double worst = 0;
  std::string worst_name;
  for (const auto& t : model.tensors()) {
    const Array& want = f.grads.at(t.name);
    double diff2 = 0, ref2 = 0;
    for (std::int64_t i = 0; i < t.size; ++i) {
      const double d = double(grads(t.offset + i)) - want.values[std::size_t(i)];
      diff2 += d * d;
      ref2 += want.values[std::size_t(i)] * want.values[std::size_t(i)];
    }
    const double error = std::sqrt(diff2 / ref2);
    EXPECT_LE(error, tol.grads) << name << " " << type << " gradient of " << t.name;
    if (error > worst) {
      worst = error;
      worst_name = t.name;
    }
  }
  std::printf(
      "[parity] %s %s (transformers %s): loss %.3e, logits %.3e, hidden %.3e, worst gradient %.3e "
      "(%s)\n",
      name.c_str(), type, f.transformers_version.c_str(), loss_error, logits_error, hidden_error,
      worst, worst_name.c_str());

  // The unmasked batch (what `plm embed` sees): logits without any <mask>.
  const auto clean = makeBatch(f.embed_tokens, {}, f.embed_cu_seqlens);
  plm::model::ForwardOutputs<T> clean_out;
  clean_out.want_logits = true;
  model.forward(clean, &clean_out);
  EXPECT_LE(maxRelative(clean_out.logits, f.embed_logits), tol.logits)
      << name << " " << type << " unmasked logits";
}

}  // namespace

TEST(HfParity, SmallFloat) { checkFixture<float>("small"); }
TEST(HfParity, SmallDouble) { checkFixture<double>("small"); }
TEST(HfParity, MultiheadFloat) { checkFixture<float>("multihead"); }
TEST(HfParity, MultiheadDouble) { checkFixture<double>("multihead"); }
