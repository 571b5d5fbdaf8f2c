// Expert parallelism checked against one rank at the level of one forward/backward: each rank
// of the world runs its own micro-batch (rank 1 none at all) with the experts spread over every
// rank, and the gradients summed over the ranks are compared with one rank running all those
// micro-batches with every expert local.  Shared by the fp32/fp64 and bf16 tests
// (test_moe_expert_parallel.cpp) and the FP8 ones (test/fp8/test_moe.cpp).
#pragma once

#include "data/batch.hpp"
#include "dist/communicator.hpp"
#include "dist/runtime.hpp"
#include "model/esm2.hpp"
#include "model/fp8_scaling.hpp"

#include <gtest/gtest.h>
#include <mpi.h>
#include <Kokkos_Core.hpp>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

namespace plm::test {
/// A micro-batch of a few random proteins with MLM labels, different for each rank.
inline data::MicroBatch makeBatchForRank(int rank) {
  std::mt19937_64 gen(100 + rank);
  std::uniform_int_distribution<int> length(6, 30), residue(4, 23);
  std::uniform_real_distribution<double> u(0, 1);
  std::vector<token_t> tokens;
  std::vector<std::int32_t> labels;
  std::vector<seqlen_t> cu{0};
  std::int64_t masked = 0;
  int max_len = 0;
  for (int s = 0; s < 3; ++s) {
    const int n = length(gen);
    tokens.push_back(data::vocab::cls);
    labels.push_back(data::vocab::ignore_label);
    for (int i = 0; i < n; ++i) {
      const auto t = static_cast<token_t>(residue(gen));
      const bool pick = u(gen) < 0.25;
      tokens.push_back(pick ? data::vocab::mask : t);
      labels.push_back(pick ? t : data::vocab::ignore_label);
      masked += pick;
    }
    tokens.push_back(data::vocab::eos);
    labels.push_back(data::vocab::ignore_label);
    cu.push_back(static_cast<seqlen_t>(tokens.size()));
    max_len = std::max(max_len, n + 2);
  }
  data::MicroBatch b;
  b.tokens = HostView1<token_t>("tokens", tokens.size());
  b.labels = HostView1<std::int32_t>("labels", labels.size());
  b.cu_seqlens = HostView1<seqlen_t>("cu", cu.size());
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    b.tokens(i) = tokens[i];
    b.labels(i) = labels[i];
  }
  for (std::size_t i = 0; i < cu.size(); ++i) b.cu_seqlens(i) = cu[i];
  b.num_masked = masked;
  b.max_seqlen = max_len;
  return b;
}

/// Expert 0 never selected (its selection bias is -100) in every MoE layer (needs bias_balance).
template <class P> void silenceExpertZero(model::Esm2<P>& m) {
  for (int l = 0; l < m.config().num_layers; ++l) {
    if (!m.config().moe.isMoeLayer(l)) continue;
    const auto& t = m.tensor("esm.encoder.layer." + std::to_string(l) + ".moe.router.expert_bias");
    Kokkos::deep_copy(Kokkos::subview(m.parameters(), t.offset), P(-100));
  }
}

/// A 2-layer MoE model in fp32 masters for the float precisions (hidden 32, 4 heads; 4 experts
/// of width 32, a multiple of 16 as the GPU's FP8 GEMMs want, top-2, capacity factor 1.5, a
/// shared expert, bias balancing so an expert can be silenced).
inline model::Esm2Config floatMoeConfig(model::Precision precision) {
  model::Esm2Config c;
  c.num_layers = 2;
  c.hidden = 32;
  c.heads = 4;
  c.ffn = 64;
  c.precision = precision;
  c.fp8.amax_history = 4;
  c.moe.experts = 4;
  c.moe.top_k = 2;
  c.moe.expert_ffn = 32;
  c.moe.capacity_factor = 1.5;
  c.moe.shared_experts = 1;
  c.moe.bias_balance = true;
  return c;
}

/// How the ranks' summed gradients compare with one rank's.
struct GradientMatch {
  double max_diff = 0, max_abs = 0;  // largest |difference| and |reference| over every element
  double rel_l2 = 0;                 // ||sum - reference|| / ||reference||
  double loss = 0, ref_loss = 0;     // cross-entropy sums (all ranks, the reference)
  double expert_rows = 0;            // rows routed to expert 0 on this rank (0 when silenced)
};

/// \brief The experts of `config` spread over all world ranks (`comm`, a communicator of the
/// world) against one rank.  Rank 1 has no tokens; with `silence`, expert 0 gets none either.
/// With `calibrate` (FP8 delayed scaling) both first run one pass and end an FP8 step, so their
/// delayed scales are set from the same amaxes (the max over all micro-batches).
template <class P> GradientMatch expertParallelVsOneRank(const model::Esm2Config& config,
                                                         dist::Communicator* comm, bool silence,
                                                         bool calibrate) {
  const int world = dist::worldSize(), rank = dist::worldRank();
  std::vector<data::MicroBatch> batches;
  for (int r = 0; r < world; ++r)
    batches.push_back(r == 1 ? data::MicroBatch() : makeBatchForRank(r));
  auto pass = [](model::Esm2<P>& m, const std::vector<const data::MicroBatch*>& bs) {
    m.zeroGradients();
    double loss = 0;
    for (const auto* b : bs) loss += m.forwardBackward(*b, 1.0);
    return loss;
  };
  model::Esm2<P> ep(config, model::ExpertPlacement{world, rank});  // this rank's experts only
  ep.initialize(5);
  if (silence) silenceExpertZero(ep);
  ep.setExpertParallel(comm);
  if (calibrate) {
    pass(ep, {&batches[rank]});
    ep.endFp8Step(MPI_COMM_WORLD);
  }
  GradientMatch out;
  out.loss = pass(ep, {&batches[rank]});
  const auto stats = ep.moeStats();
  if (!stats.empty()) out.expert_rows = stats[0].routed[0];
  // Each rank's gradients by name in the whole model's layout (its experts only), summed.
  model::Esm2<P> single(config);
  auto g = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), ep.gradients());
  std::vector<double> sum(single.gradients().extent(0), 0.0);
  if (world > 1) EXPECT_LT(g.extent(0), sum.size()) << "the expert-parallel model holds all";
  for (const auto& t : ep.tensors()) {
    const auto& whole = single.tensor(t.name);
    for (std::int64_t i = 0; i < t.size; ++i) sum[whole.offset + i] = double(g(t.offset + i));
  }
  MPI_Allreduce(MPI_IN_PLACE, sum.data(), int(sum.size()), MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
  MPI_Allreduce(MPI_IN_PLACE, &out.loss, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);

  single.initialize(5);
  if (silence) silenceExpertZero(single);
  std::vector<const data::MicroBatch*> all;
  for (const auto& b : batches) all.push_back(&b);
  if (calibrate) {
    pass(single, all);
    single.endFp8Step(MPI_COMM_NULL);
  }
  out.ref_loss = pass(single, all);
  auto ref = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), single.gradients());
  double num = 0, den = 0;
  for (std::size_t i = 0; i < sum.size(); ++i) {
    const double d = double(ref(i)) - sum[i];
    out.max_abs = std::max(out.max_abs, std::abs(double(ref(i))));
    out.max_diff = std::max(out.max_diff, std::abs(d));
    num += d * d;
    den += double(ref(i)) * double(ref(i));
  }
  out.rel_l2 = den > 0 ? std::sqrt(num / den) : 0.0;
  return out;
}

}  // namespace plm::test
