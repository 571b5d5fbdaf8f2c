// FP8 weights all-gathered as E4M3 codes on the CUDA path (train/fsdp.hpp, doc/parallelism.md
// "FP8 under sharding"), at shard = the world size (2 ranks; they may share one GPU: staged MPI):
//  - after one sharded forward (every unit gathered once) the model's code buffers hold, for
//    every FP8 GEMM weight, the codes, the transposed codes and the scale_inv (per tensor, or
//    both copies' 128x128 block scales with their padding) that one unsharded model casts from
//    the same weights, bit for bit, under delayed (non-trivial restored scales that saturate
//    the largest weights), current and block scaling, and with layer 0 kept in bf16 (its unit
//    gathered plainly beside the code wires);
//  - delayed scaling records the same weight amaxes (the histories and next scales after
//    endFp8Step equal one rank's);
//  - the gathers moved one byte per FP8 weight element (plus the units' fp32 LayerNorm, bias
//    and padding elements, each rank's part padded to the widest): the scales do not travel,
//    every rank derives them from the amaxes max-reduced over the shard group.
// The losses of sharded FP8 training against one rank are test_fp8_fsdp's (its CUDA bound).
#include "dist/process_groups.hpp"
#include "dist/runtime.hpp"
#include "gpu/fp8.hpp"
#include "model/esm2.hpp"
#include "train/fsdp.hpp"

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

namespace {

using plm::model::Esm2;
using plm::model::Esm2Config;
using plm::model::Fp8Recipe;

Esm2Config config(Fp8Recipe recipe, bool layer0_bf16) {
  Esm2Config c;
  c.num_layers = 3;
  c.hidden = 160;  // q/k/v stacked (480, 160): 4 x 2 blocks of 128, the edges partial
  c.heads = 10;
  c.ffn = 320;
  c.precision = plm::model::Precision::Fp8;
  c.fp8.recipe = recipe;
  c.fp8.amax_history = 4;
  c.fp8.first_layers_bf16 = layer0_bf16 ? 1 : 0;
  return c;
}

// Delayed scales that are no power of two and saturate the largest initial weights (0.02 normal:
// |w| > 448 / 6000 = 0.075 becomes +-448).
void restoreScales(Esm2<float>& m) {
  plm::model::Fp8Scaling& st = *m.fp8Scaling();
  std::vector<float> scales(st.scales().size());
  for (std::size_t t = 0; t < scales.size(); ++t) scales[t] = 6000.0f + 7.0f * float(t);
  st.restore(std::vector<float>(st.histories().size(), 0.0f), scales, 3);
}

template <class T> std::vector<T> download(const void* p, std::int64_t n) {
  std::vector<T> h(static_cast<std::size_t>(n));
  PLM_CHECK_CUDA(cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
  return h;
}

struct Codes {
  std::vector<std::uint8_t> w, wt;
  std::vector<float> s, st;  // scale_inv of the codes and of the transposed codes
};

std::vector<Codes> codesOf(Esm2<float>& m, bool block) {
  Kokkos::fence();
  std::vector<Codes> out;
  for (const auto& fw : m.fp8Weights()) {
    Codes c;
    const std::int64_t n = fw.rows * fw.cols;
    c.w = download<std::uint8_t>(fw.codes, n);
    c.wt = download<std::uint8_t>(fw.codes_t, n);
    if (block) {
      using plm::gpu::Fp8ScaleMode;
      const auto l = plm::gpu::blockScaleLayout(Fp8ScaleMode::Block128x128, fw.rows, fw.cols);
      const auto lt = plm::gpu::blockScaleLayout(Fp8ScaleMode::Block128x128, fw.cols, fw.rows);
      c.s = download<float>(plm::gpu::fp8BlockTensorScales(fw.codes, fw.rows, fw.cols), l.count);
      c.st =
          download<float>(plm::gpu::fp8BlockTensorScales(fw.codes_t, fw.cols, fw.rows), lt.count);
    } else {
      c.s = download<float>(fw.scale_inv, 1);
    }
    out.push_back(c);
  }
  return out;
}

std::int64_t differing(const std::vector<std::uint8_t>& a, const std::vector<std::uint8_t>& b) {
  std::int64_t n = 0;
  for (std::size_t i = 0; i < a.size(); ++i) n += a[i] != b[i];
  return n;
}

TEST(GpuFp8Fsdp, GatheredCodesEqualOneRanksCasts) {
  const int world = plm::dist::worldSize();
  if (world < 2) GTEST_SKIP() << "needs 2 or more ranks";
  for (int k = 0; k < 4; ++k) {
    const Fp8Recipe recipe = k == 1   ? Fp8Recipe::Current
                             : k == 2 ? Fp8Recipe::Block
                                      : Fp8Recipe::Delayed;
    const bool block = recipe == Fp8Recipe::Block;
    const Esm2Config c = config(recipe, k == 3);
    const std::string what =
        std::string(plm::model::fp8RecipeName(recipe)) + (k == 3 ? " (layer 0 bf16)" : "");

    Esm2<float> ref(c);
    ref.initialize(11);
    restoreScales(ref);
    ref.refreshComputeWeights();  // the unsharded casts from the whole bf16 copy
    const std::vector<Codes> want = codesOf(ref, block);
    ASSERT_EQ(want.size(), std::size_t(4 * (k == 3 ? 2 : 3))) << what;

    plm::dist::ProcessGroups groups(MPI_COMM_WORLD, world);
    Esm2<float> model(c, {}, plm::model::ModelBuffers::None);
    restoreScales(model);
    plm::train::FsdpOptions options;
    options.gather_bf16 = true;  // what gather_dtype: auto resolves to: the code wires ignore it
    plm::train::Fsdp<float> fsdp(model, groups.shard(), groups.replicate(),
                                 plm::train::AdamWOptions{}, options,
                                 plm::dist::defaultBackend(groups.shard()));
    fsdp.initialize(plm::ExecSpace(), 11);
    fsdp.forwardOnly(plm::ExecSpace(), nullptr);  // every unit gathered once, no data
    const std::vector<Codes> got = codesOf(model, block);
    ASSERT_EQ(got.size(), want.size()) << what;
    for (std::size_t w = 0; w < want.size(); ++w) {
      EXPECT_EQ(differing(got[w].w, want[w].w), 0) << what << ": codes of FP8 weight " << w;
      EXPECT_EQ(differing(got[w].wt, want[w].wt), 0) << what << ": W^T codes of weight " << w;
      EXPECT_EQ(got[w].s, want[w].s) << what << ": scale_inv of weight " << w;
      EXPECT_EQ(got[w].st, want[w].st) << what << ": W^T scale_inv of weight " << w;
    }

    if (recipe == Fp8Recipe::Delayed) {  // the weight amaxes recorded as one rank records them
      ref.endFp8Step(MPI_COMM_SELF);
      model.endFp8Step(MPI_COMM_WORLD);
      EXPECT_EQ(model.fp8Scaling()->histories(), ref.fp8Scaling()->histories()) << what;
      EXPECT_EQ(model.fp8Scaling()->scales(), ref.fp8Scaling()->scales()) << what;
    }

    // Bytes: each unit was gathered once; a layer with FP8 GEMMs moved its weights as codes.
    std::int64_t sum = 0;
    for (int u = 0; u < static_cast<int>(fsdp.units().size()); ++u) sum += fsdp.unitGatherBytes(u);
    EXPECT_EQ(fsdp.gatherBytes(), sum) << what;
    for (int l = 0; l < c.num_layers; ++l) {
      std::int64_t weights = 0, others = 0;
      const std::string pre = "esm.encoder.layer." + std::to_string(l) + ".";
      for (const auto& t : model.tensors())
        if (t.name.compare(0, pre.size(), pre) == 0)
          (t.shape.size() == 2 ? weights : others) += t.size;
      const int u = 1 + (c.num_layers - 1 - l);  // backward order: head, layers L-1..0, emb.
      const auto& unit = fsdp.units()[u];
      const std::int64_t padding = unit.slice * world - unit.count;
      const std::int64_t got_bytes = fsdp.unitGatherBytes(u) * world;
      if (!c.fp8.fp8Layer(l, c.num_layers)) {  // a bf16 layer: the plain bf16 gather
        EXPECT_EQ(got_bytes, 2 * (weights + others + padding)) << what << " layer " << l;
        continue;
      }
      EXPECT_GE(got_bytes, weights + 4 * (others + padding)) << what << " layer " << l;
      EXPECT_LE(got_bytes, weights + 4 * (others + padding) + world * (3 * others + 64))
          << what << " layer " << l;
      EXPECT_LT(100 * got_bytes, 55 * 2 * (weights + others + padding))
          << what << " layer " << l << ": about half of a bf16 gather";
    }
  }
}

}  // namespace
