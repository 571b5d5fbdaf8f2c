// Whole-buffer kernels on a buffer of more than 2^32 elements (issue 28: a 15B model's FSDP
// shard holds 7.5e9 elements per rank, its buffer 1.5e10).  Kokkos' default RangePolicy index
// on CUDA is `unsigned int`, so a range over such a buffer wraps at 2^32: the end of the buffer
// is skipped, or global offsets land 2^32 elements early (an illegal address).  Each kernel
// runs once over the whole buffer and elements at its start, around 2^31 and 2^32 and at its
// end are compared with a host reference of those elements.
//
// The inputs make every optimizer's first step the same closed form: the gradient is the
// parameter (one buffer, which also keeps AdamW within 56 GB), every element is +-0.5, no weight
// decay, Adafactor without parameter scaling.  Then AdamW, 8-bit AdamW and Lion move each element
// by lr * sign(g), and Adafactor too (its factored second moment is g^2 everywhere, RMS(U) = 1).
// A frozen range at the end of the buffer is masked to zero and must stay there.
//
// Kokkos 3.4's CUDA range kernel also forms its first index and stride in 32-bit arithmetic, so
// one launch over more than 2^32 elements wraps its stride and never ends: every whole-buffer
// loop, fill and allocation goes through core/flat.hpp (launches of at most 2^31 elements).
//
// PLM_LARGE_INDEX_ROWS sets the rows of the (rows, 4096) tensor: the default, 2^20 + 3, is past
// 2^32 elements (the GPU test); the CPU build runs the same checks on a small buffer.
#include "core/flat.hpp"
#include "train/fsdp.hpp"
#include "train/optim/adamw.hpp"
#include "train/optim/optimizer.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <string>
#include <type_traits>
#include <vector>

namespace {

using plm::FlatPolicy;
using plm::View1;
using plm::train::OptimizerKind;

constexpr std::int64_t cols = 4096;
constexpr double lr = 0.01;

std::int64_t rows() {
  if (const char* s = std::getenv("PLM_LARGE_INDEX_ROWS")) return std::stoll(s);
  return (std::int64_t(1) << 20) + 3;
}

KOKKOS_INLINE_FUNCTION float initial(std::int64_t i) {
  const std::uint64_t h = static_cast<std::uint64_t>(i) * 0x9E3779B97F4A7C15ull;
  return (h >> 40) & 1 ? 0.5f : -0.5f;
}

// The elements compared: the start, both sides of 2^31 and 2^32 where the buffer has them,
// and the last three rows (the frozen one among them).
std::vector<std::int64_t> probes(std::int64_t n) {
  std::vector<std::int64_t> at;
  const std::int64_t w = 2048, b31 = std::int64_t(1) << 31, b32 = std::int64_t(1) << 32;
  const std::pair<std::int64_t, std::int64_t> windows[] = {
      {0, 2 * w}, {b31 - w, 2 * w}, {b32 - w, 2 * w}, {n - 3 * cols, 3 * cols}};  // frozen row
  for (const auto& [c, len] : windows)
    for (std::int64_t i = std::max<std::int64_t>(c, 0); i < std::min(c + len, n); ++i)
      if (at.empty() || i > at.back()) at.push_back(i);
  return at;
}

std::vector<float> valuesAt(const View1<float>& v, const std::vector<std::int64_t>& at) {
  std::vector<float> out;
  std::int64_t lo = 0;
  while (lo < static_cast<std::int64_t>(at.size())) {
    std::int64_t hi = lo;
    while (hi + 1 < static_cast<std::int64_t>(at.size()) && at[hi + 1] == at[hi] + 1) ++hi;
    auto part = Kokkos::subview(v, std::make_pair(at[lo], at[hi] + 1));
    auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), part);
    for (std::size_t k = 0; k < h.extent(0); ++k) out.push_back(h(k));
    lo = hi + 1;
  }
  return out;
}

struct Buffer {
  std::int64_t n = rows() * cols;
  View1<float> params{Kokkos::view_alloc(Kokkos::WithoutInitializing, "test::large_index"), n};
  plm::train::ParamLayout layout;
  // One whole row, so Adafactor's other row factors stay those of +-0.5 everywhere.
  std::int64_t frozen_lo = n - 2 * cols, frozen_hi = n - cols;

  Buffer() {
    plm::model::TensorInfo t;
    t.name = "esm.encoder.layer.0.intermediate.dense.weight";
    t.shape = {rows(), cols};
    t.size = n;
    layout = plm::train::wholeLayout({t}, n, {{frozen_lo, frozen_hi - frozen_lo}});
  }
  void fill() {
    auto p = params;
    plm::flatFor(
        "test::large_index::fill", plm::ExecSpace(), 0, n,
        KOKKOS_LAMBDA(const std::int64_t i) { p(i) = initial(i); });
    Kokkos::fence();
  }
};

class LargeIndex : public ::testing::TestWithParam<OptimizerKind> {};

TEST_P(LargeIndex, MaskNormAndFirstStep) {
  Buffer b;
  b.fill();
  plm::train::OptimizerOptions o;
  o.kind = GetParam();
  o.adamw.weight_decay = o.lion.weight_decay = o.adamw8bit.weight_decay = 0;
  o.adafactor.weight_decay = 0;
  o.adafactor.scale_parameter = false;
  const plm::ExecSpace space;
  auto opt = plm::train::makeOptimizer<float>(o, b.params, b.layout);
  opt->maskGradients(space, b.params);
  const double norm = plm::train::globalNorm(space, b.params);
  const double frozen = static_cast<double>(b.frozen_hi - b.frozen_lo);
  EXPECT_NEAR(norm, 0.5 * std::sqrt(static_cast<double>(b.n) - frozen), 1e-9 * norm)
      << "the norm missed part of the " << b.n << " elements";
  opt->step(space, b.params, lr);
  Kokkos::fence();

  const auto at = probes(b.n);
  const auto got = valuesAt(b.params, at);
  ASSERT_EQ(got.size(), at.size());
  int bad = 0;
  for (std::size_t k = 0; k < at.size() && bad < 5; ++k) {
    const std::int64_t i = at[k];
    const bool is_frozen = i >= b.frozen_lo && i < b.frozen_hi;
    const double w = initial(i);
    const double want = is_frozen ? 0.0 : w - lr * (w > 0 ? 1.0 : -1.0);
    // 1% of a step: the frozen zeros move Adafactor's column factors by 1/rows (1.7e-5 on the
    // CPU's 300 rows); a skipped or misplaced element is off by a whole step (1e-2).
    if (std::abs(got[k] - want) > 1e-4) {
      ADD_FAILURE() << plm::train::optimizerName(o.kind) << ": element " << i << " of " << b.n
                    << " is " << got[k] << ", expected " << want;
      ++bad;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Optimizers, LargeIndex,
                         ::testing::Values(OptimizerKind::AdamW, OptimizerKind::AdamW8bit,
                                           OptimizerKind::Lion, OptimizerKind::Adafactor),
                         [](const auto& info) {
                           return std::string(plm::train::optimizerName(info.param));
                         });

// A free function: CUDA extended lambdas may not live in a test body (a private member).
void halfWidthRoundTrip(View1<float> p, View1<std::uint16_t> half, std::int64_t n) {
  plm::flatFor(
      "test::large_index::to_half", plm::ExecSpace(), 0, n, KOKKOS_LAMBDA(const std::int64_t i) {
        half(i) = static_cast<std::uint16_t>(p(i) > 0 ? 1 + (i & 0x3ff) : 2048 + (i & 0x3ff));
      });
  plm::flatFor(
      "test::large_index::from_half", plm::ExecSpace(), 0, n,
      KOKKOS_LAMBDA(const std::int64_t i) { p(i) = static_cast<float>(half(i)); });
  Kokkos::fence();
}

// The piecewise launches themselves (core/flat.hpp), with pieces of 7 elements so that the CPU
// build exercises the piece boundaries: every element of [lo, hi) is visited exactly once, the
// sum and the maximum join across pieces, and a fill reaches every element.
void flatPieces(View1<int> hits, View1<float> fill, std::int64_t lo, std::int64_t hi, double& sum,
                int& max) {
  plm::flatFor(
      "test::large_index::hits", plm::ExecSpace(), lo, hi,
      KOKKOS_LAMBDA(const std::int64_t i) { hits(i) += 1; }, 7);
  plm::flatReduce(
      "test::large_index::sum", plm::ExecSpace(), lo, hi,
      KOKKOS_LAMBDA(const std::int64_t i, double& acc) { acc += static_cast<double>(i); }, sum, 7);
  plm::flatReduce(
      "test::large_index::max", plm::ExecSpace(), lo, hi,
      KOKKOS_LAMBDA(const std::int64_t i, int& acc) {
        const int v = static_cast<int>((i * 37) % 101);
        if (v > acc) acc = v;
      },
      Kokkos::Max<int>(max), 7);
  plm::flatFill(plm::ExecSpace(), fill, 2.5f, 7);
  Kokkos::fence();
}

TEST(LargeIndex, FlatPiecesCoverTheRangeOnce) {
  const std::int64_t n = 1000, lo = 3, hi = 998;
  View1<int> hits("hits", n);
  View1<float> fill("fill", n);
  double sum = -1.0;
  int max = -1;
  flatPieces(hits, fill, lo, hi, sum, max);
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), hits);
  auto f = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), fill);
  double want_sum = 0.0;
  int want_max = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    const bool inside = i >= lo && i < hi;
    EXPECT_EQ(h(i), inside ? 1 : 0) << "element " << i;
    EXPECT_EQ(f(i), 2.5f) << "element " << i;
    if (inside) {
      want_sum += static_cast<double>(i);
      want_max = std::max(want_max, static_cast<int>((i * 37) % 101));
    }
  }
  EXPECT_EQ(sum, want_sum);
  EXPECT_EQ(max, want_max);
  // flatZeros: a zero-filled buffer, whatever the allocator left there.
  const View1<float> z = plm::flatZeros<float>("zeros", n);
  auto hz = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), z);
  for (std::int64_t i = 0; i < n; ++i) ASSERT_EQ(hz(i), 0.0f) << "element " << i;
}

// The fp32 -> bf16-width cast pattern of the compute copy and a plain copy, over the whole
// buffer: a second buffer of 16-bit values (8.6 GB).
TEST(LargeIndex, HalfWidthCopy) {
  Buffer b;
  b.fill();
  View1<std::uint16_t> half(Kokkos::view_alloc(Kokkos::WithoutInitializing, "test::half"), b.n);
  halfWidthRoundTrip(b.params, half, b.n);
  const auto at = probes(b.n);
  const auto got = valuesAt(b.params, at);
  for (std::size_t k = 0; k < at.size(); ++k) {
    const std::int64_t i = at[k];
    const float want = initial(i) > 0 ? 1 + (i & 0x3ff) : 2048 + (i & 0x3ff);
    ASSERT_EQ(got[k], want) << "element " << i << " of " << b.n;
  }
}

// The index arithmetic of esm2_15b at shard 2, without allocating: its buffer (1.5e10 elements)
// and each rank's shard (7.5e9) are past 2^32.  The units tile the buffer, the two ranks' pieces
// cover every tensor element once, and a range over the last tensor's global offsets (what
// Esm2::initializeRange launches) keeps its ends.
TEST(LargeIndex, Esm2_15bShardArithmetic) {
  const auto config = plm::model::Esm2Config::preset("esm2_15b");
  const auto tensors = plm::model::tensorTable(config);
  const std::int64_t buffer = tensors.back().offset + tensors.back().size;
  ASSERT_GT(buffer, std::int64_t(3) << 32);
  const int shard = 2;
  const auto units = plm::train::planShardUnits(tensors, buffer, shard);
  std::int64_t covered = 0, local = 0;
  for (const auto& u : units) {
    EXPECT_EQ(u.local, local);
    EXPECT_GE(u.slice * shard, u.count);
    EXPECT_LT(u.slice * shard, u.count + shard);
    local += u.slice;
    covered += u.count;
  }
  EXPECT_EQ(covered, buffer);
  EXPECT_GT(local, std::int64_t(1) << 32) << "a 15B shard is past 2^32 elements";
  std::int64_t elements = 0, pieces_total = 0;
  for (const auto& t : tensors) elements += t.size;
  for (int rank = 0; rank < shard; ++rank) {
    const auto layout = plm::train::shardParamLayout(tensors, units, rank, config.hidden);
    EXPECT_EQ(layout.local_size, local);
    for (const auto& p : layout.pieces) {
      ASSERT_GE(p.local, 0);
      ASSERT_LE(p.local + p.count, layout.local_size);
      ASSERT_LE(p.start + p.count, tensors[p.tensor].size);
      pieces_total += p.count;
    }
  }
  EXPECT_EQ(pieces_total, elements);
  const auto& last = tensors.back();
  const FlatPolicy range(plm::ExecSpace(), last.offset, last.offset + last.size);
  EXPECT_EQ(static_cast<std::int64_t>(range.begin()), last.offset);
  EXPECT_EQ(static_cast<std::int64_t>(range.end()), last.offset + last.size);
  static_assert(sizeof(FlatPolicy::index_type) == 8 && std::is_signed_v<FlatPolicy::index_type>);
}

}  // namespace
