// The bf16 CUDA training step (plm::gpu::Esm2Bf16) against the model's own fp32 forward and
// backward (plm::model::Esm2<float>, portable Kokkos path on the same GPU), on the same
// parameters and packed batch: loss and every parameter gradient, at bf16 tolerance; and
// gradients accumulate (+=) across calls.
#include "gpu/esm2_layout.hpp"
#include "gpu_test_util.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <random>

namespace plm::gpu {
namespace {

data::MicroBatch makeBatch(const std::vector<int>& lengths, std::uint64_t seed) {
  std::int64_t total = 0;
  for (int l : lengths) total += l;
  data::MicroBatch b;
  b.tokens = HostView1<token_t>("tokens", total);
  b.labels = HostView1<std::int32_t>("labels", total);
  b.cu_seqlens = HostView1<seqlen_t>("cu", lengths.size() + 1);
  std::mt19937_64 rng(seed);
  std::int64_t t = 0;
  b.cu_seqlens(0) = 0;
  for (std::size_t s = 0; s < lengths.size(); ++s) {
    for (int i = 0; i < lengths[s]; ++i, ++t) {
      token_t tok = i == 0                ? data::vocab::cls
                    : i == lengths[s] - 1 ? data::vocab::eos
                                          : static_cast<token_t>(4 + rng() % 20);
      b.labels(t) = data::vocab::ignore_label;
      if (i > 0 && i < lengths[s] - 1 && rng() % 100 < 15) {
        b.labels(t) = tok;
        tok = rng() % 10 < 8 ? data::vocab::mask : static_cast<token_t>(4 + rng() % 20);
        ++b.num_masked;
      }
      b.tokens(t) = tok;
    }
    b.cu_seqlens(s + 1) = static_cast<seqlen_t>(t);
    b.max_seqlen = std::max(b.max_seqlen, lengths[s]);
  }
  return b;
}

std::vector<float> toHost(const View1<float>& v) {
  auto h = Kokkos::create_mirror_view_and_copy(HostSpace(), v);
  return std::vector<float>(h.data(), h.data() + h.extent(0));
}

void compare(model::Esm2Config c, const std::vector<int>& lengths) {
  model::Esm2<float> m(c);
  m.initialize(11);
  // Biases and LayerNorm parameters moved off 0 and 1 so their gradients are checked too.
  {
    auto p = m.parameters();
    Kokkos::parallel_for(
        "perturb", Kokkos::RangePolicy<ExecSpace>(0, p.extent(0)),
        KOKKOS_LAMBDA(const std::int64_t i) {
          std::uint32_t h = static_cast<std::uint32_t>(i) * 2654435761u;
          h ^= h >> 15;
          p(i) += 0.02f * ((h & 0xffff) / 32768.0f - 1.0f);
        });
  }
  auto batch = makeBatch(lengths, 5);
  ASSERT_GT(batch.num_masked, 0);
  const double scale = 1.0 / batch.num_masked;
  m.zeroGradients();
  const double loss_ref = m.forwardBackward(batch, scale);
  auto g_ref = toHost(m.gradients());

  m.zeroGradients();
  Kokkos::fence();
  Esm2Bf16 step(esm2Shape(c), esm2Offsets(m));
  Stream stream = Kokkos::Cuda().cuda_stream();
  const double loss = step.forwardBackward(stream, m.parameters().data(), m.gradients().data(),
                                           hostBatch(batch), scale);
  auto g = toHost(m.gradients());
  EXPECT_NEAR(loss, loss_ref, 2e-2 * std::abs(loss_ref)) << "loss";
  EXPECT_LT(test::relError(g, g_ref), 5e-2) << "all gradients";
  for (const auto& t : m.tensors()) {
    std::vector<float> a(g.begin() + t.offset, g.begin() + t.offset + t.size);
    std::vector<float> b(g_ref.begin() + t.offset, g_ref.begin() + t.offset + t.size);
    double err = test::relError(a, b);
    EXPECT_LT(err, 0.15) << t.name;
  }
  // A second micro-batch accumulates.
  step.forwardBackward(stream, m.parameters().data(), m.gradients().data(), hostBatch(batch),
                       scale);
  auto g2 = toHost(m.gradients());
  std::vector<double> twice(g_ref.size());
  for (std::size_t i = 0; i < g_ref.size(); ++i) twice[i] = 2.0 * g_ref[i];
  EXPECT_LT(test::relError(g2, twice), 5e-2) << "accumulation";
}

// Weights near the 0.02 initialisation: with weights scaled up 5x the attention turns nearly
// one-hot and bf16 gradients of the last layers drift 20-50% from fp32 (measured), which says
// more about bf16 than about this step.
TEST(Esm2Bf16Step, MatchesFp32ModelHeadDim64) {
  model::Esm2Config c;
  c.num_layers = 2;
  c.hidden = 128;
  c.heads = 2;
  c.ffn = 256;
  compare(c, {5, 130, 37, 300, 2, 64});
}

TEST(Esm2Bf16Step, MatchesFp32ModelHeadDim16) {
  model::Esm2Config c;
  c.num_layers = 3;
  c.hidden = 64;
  c.heads = 4;
  c.ffn = 128;
  compare(c, {1024, 3, 77});
}

}  // namespace
}  // namespace plm::gpu
