// plm plan's optimizer bytes (doc/plan.md, doc/optimizers.md) against the state each optimizer
// really allocates over a real model's flat buffer (Optimizer::stateBytes), for every kind, and
// the tensor table the planner uses against the model's own.
#include "model/esm2.hpp"
#include "plan/plan.hpp"
#include "train/fsdp.hpp"
#include "train/optim/optimizer.hpp"

#include <gtest/gtest.h>

namespace {

using namespace plm;

plan::Rates unitRates() {
  plan::Rates r;
  r.kind = "unit";
  r.memory_bytes = 1e12;
  r.gemm_tflops_fp32 = r.gemm_tflops_bf16 = r.gemm_tflops_fp8 = r.gemm_tflops_fp8_block = 1;
  r.attention_tflops = 1;
  r.layernorm_gbps = r.elementwise_gbps = r.optimizer_gbps = 1;
  r.fp8_cast_gbps = r.fp8_block_cast_gbps = 1;
  r.peak_tflops = 1;
  r.intra_node_gbps = r.inter_node_gbps = 1;
  r.ranks_per_node = 8;
  return r;
}

double optimizerItem(const plan::Plan& p) {
  for (const auto& i : p.memory)
    if (i.name.rfind("optimizer states", 0) == 0) return i.value;
  ADD_FAILURE() << "no optimizer item";
  return 0;
}

TEST(PlanOptimizers, BytesAsAllocated) {
  model::Esm2Config c;  // the quickstart shape
  c.num_layers = 4;
  c.hidden = 128;
  c.heads = 4;
  c.ffn = 512;
  model::Esm2<float> m(c);
  const auto table = model::tensorTable(c);
  ASSERT_EQ(table.size(), m.tensors().size());
  for (std::size_t i = 0; i < table.size(); ++i) {
    EXPECT_EQ(table[i].name, m.tensors()[i].name);
    EXPECT_EQ(table[i].offset, m.tensors()[i].offset);
  }
  EXPECT_EQ(plan::flatParameterCount(c), static_cast<std::int64_t>(m.parameters().extent(0)));
  double adamw = 0;
  for (auto kind : {train::OptimizerKind::AdamW, train::OptimizerKind::Lion,
                    train::OptimizerKind::Adafactor, train::OptimizerKind::AdamW8bit}) {
    plan::Input in;
    in.model = c;
    in.rates = unitRates();
    in.micro_batch_tokens = 1024;
    in.optimizer.kind = kind;
    auto opt = train::makeOptimizer<float>(
        in.optimizer, m.parameters(),
        train::wholeLayout(m.tensors(), static_cast<std::int64_t>(m.parameters().extent(0))));
    const double planned = optimizerItem(plan::makePlan(in));
    EXPECT_DOUBLE_EQ(planned, static_cast<double>(opt->stateBytes())) << train::optimizerName(kind);
    if (kind == train::OptimizerKind::AdamW) adamw = planned;
    if (kind == train::OptimizerKind::AdamW8bit)
      EXPECT_LE(planned, 0.65 * adamw) << "8-bit AdamW must save at least 35%";
    // Sharded 4 ways: what rank 0's optimizer allocates on its slices (the units' padding
    // to a multiple of 4 makes the slices a few elements longer than N / 4).
    in.layout.ranks_per_node = 4;
    in.layout.shard = 4;
    const auto units = train::planShardUnits(m.tensors(), m.parameters().extent(0), 4);
    const auto layout = train::shardParamLayout(m.tensors(), units, 0, c.hidden);
    View1<float> shard_params("shard", layout.local_size);
    auto sharded = train::makeOptimizer<float>(in.optimizer, shard_params, layout);
    EXPECT_NEAR(optimizerItem(plan::makePlan(in)), static_cast<double>(sharded->stateBytes()),
                1e-3 * planned)
        << train::optimizerName(kind) << " sharded";
  }
}

}  // namespace
