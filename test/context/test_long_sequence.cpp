// A 16,384-token single sequence trains at context degree 2 on CPUs (2 ranks): a small ESM-2
// (1 layer, hidden 16) whose one sequence is 16 times ESM-2's 1,024-token limit.  The first
// step's loss equals the one-rank forward of the whole sequence (1e-4 relative, fp32), three
// AdamW steps on it lower the loss, and both ranks end with the same parameters.
#include "../model/model_test_util.hpp"
#include "data/context_split.hpp"
#include "dist/communicator.hpp"
#include "dist/runtime.hpp"
#include "train/step.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <vector>

namespace {

using namespace plm;

TEST(ContextLongSequence, Trains16384TokensAtContextDegree2) {
  if (dist::worldSize() != 2) GTEST_SKIP() << "runs at 2 ranks";
  model::Esm2Config c;
  c.num_layers = 1;
  c.hidden = 16;
  c.heads = 2;
  c.ffn = 32;
  c.max_positions = 16386;
  const data::MicroBatch batch = model::test::makeBatch({16384}, 31, 0.15);
  ASSERT_EQ(batch.numTokens(), 16384);

  double whole = 0;
  if (dist::worldRank() == 0) {  // the one-rank loss of the whole sequence, forward only
    model::Esm2<float> ref(c);
    ref.initialize(5);
    whole = ref.forward(batch) / static_cast<double>(batch.num_masked);
  }
  MPI_Bcast(&whole, 1, MPI_DOUBLE, 0, MPI_COMM_WORLD);

  auto comm = dist::makeCommunicator(MPI_COMM_WORLD, dist::defaultBackend(MPI_COMM_WORLD));
  model::Esm2<float> m(c);
  m.initialize(5);
  m.setContextParallel(comm.get());
  train::AdamW<float> opt(m.parameters(), m.tensors(), train::AdamWOptions{},
                          train::esm2FrozenRanges(m.tensors(), c.hidden));
  std::vector<double> losses;
  for (int step = 0; step < 3; ++step) {
    const auto st = train::trainStep(ExecSpace(), m, opt, {batch}, 1e-2, 1.0, MPI_COMM_WORLD);
    ASSERT_TRUE(st.applied);
    EXPECT_EQ(st.tokens, 16384);
    EXPECT_EQ(st.sequences, 1);
    losses.push_back(st.loss());
  }
  EXPECT_NEAR(losses[0], whole, 1e-4 * whole);
  EXPECT_LT(losses[2], losses[0]);
  if (dist::worldRank() == 0)
    std::printf("16,384-token sequence, context degree 2: losses %.6f %.6f %.6f (one rank %.6f)\n",
                losses[0], losses[1], losses[2], whole);
  auto p = model::test::toHost(m.parameters());
  std::vector<float> p0(p.begin(), p.end());
  MPI_Bcast(p0.data(), static_cast<int>(p0.size()), MPI_FLOAT, 0, MPI_COMM_WORLD);
  for (std::size_t i = 0; i < p.size(); ++i) ASSERT_EQ(p[i], p0[i]) << "parameter " << i;
}

}  // namespace
