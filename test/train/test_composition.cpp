// The composition matrix (issue 27): sharded data parallelism (FSDP), expert parallelism,
// context parallelism and FP8 in pairs and triples, each trained by the trainer (`plm train`'s
// driver: deck, loader, model, step, checkpoint hooks) on every rank of the job (2 or 4) and
// compared with the 1-rank run of the same deck, one table row per layout:
//  - the per-step losses within 1e-5 relative (fp32: only the summation order differs) or, for
//    FP8, within doc/fp8.md's rank bound (1e-3 relative in the losses, delayed scaling: a
//    one-ulp difference from another summation order moves an operand to a neighbouring FP8
//    code now and then), and the per-step token and masked-token counts equal (the same data);
//  - layouts plm refuses are rows too: the refusal must be a collective error naming each part
//    of the combination (its deck keys); a refused row that starts to run fails, saying to flip
//    the row to a running one;
//  - resume across layouts: a run checkpointed at step 2 in layout A and resumed in layout B
//    continues with the uninterrupted one-rank losses.
// One tiny MoE model (tiny_run.hpp's 2-layer hidden-32 deck with 2 heads; 4 experts of width 16,
// top-2, a capacity cut, a shared expert, aux and z losses) serves every row, so the references
// are two one-rank runs (fp32 and fp8).  The router settings that change the whole model's rows
// after a step (bias balancing, centred start, projection) are off: sharded runs refuse or skip
// them (doc/parallelism.md), and the matrix compares layouts, not router options.
// PLM_COMPOSITION_PRECISION=bf16 (CUDA build) runs the fp32 rows in bf16; on the GPU both bf16
// and FP8 rows are held to 1e-2 (cuBLASLt may choose another kernel, another summation order,
// for another row count: the bound of the bf16 expert-parallel tests).
#include "../ckpt/tiny_run.hpp"

#include "core/error.hpp"
#include "dist/runtime.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace {

using plm::test::StepRecord;

constexpr int steps = 4;  // per run; resumed legs save after step `saved`
constexpr int saved = 2;
constexpr int all_ranks = 0;  // a degree meaning "every rank of the job"

/// The precision of the rows that are not FP8: fp32, or PLM_COMPOSITION_PRECISION (bf16).
std::string highPrecision() {
  const char* p = std::getenv("PLM_COMPOSITION_PRECISION");
  return p && *p ? p : "fp32";
}

struct Layout {
  int shard = 1, expert = 1, context = 1;
  bool fp8 = false;

  int degree(int d, int world) const { return d == all_ranks ? world : d; }
  std::string precision() const { return fp8 ? "fp8" : highPrecision(); }
  std::string name(int world) const {
    std::string out;
    auto add = [&](const char* what, int d) {
      if (degree(d, world) == 1) return;
      out +=
          (out.empty() ? "" : " x ") + std::string(what) + " " + std::to_string(degree(d, world));
    };
    add("shard", shard);
    add("expert", expert);
    add("context", context);
    return (out.empty() ? "data parallel" : out) + ", " + precision();
  }
  std::vector<std::string> settings(int world) const {
    return {"parallel.shard_degree=" + std::to_string(degree(shard, world)),
            "parallel.expert_degree=" + std::to_string(degree(expert, world)),
            "parallel.context_degree=" + std::to_string(degree(context, world)),
            "train.precision=" + precision()};
  }
  /// The deck words a refusal of this layout must name.
  std::vector<std::string> keys(int world) const {
    std::vector<std::string> out;
    if (degree(shard, world) > 1) out.push_back("shard_degree");
    if (degree(expert, world) > 1) out.push_back("expert_degree");
    if (degree(context, world) > 1) out.push_back("context_degree");
    if (fp8) out.push_back("fp8");
    return out;
  }
};

struct Row {
  const char* combination;
  Layout layout;
  int min_ranks;        // shard x expert needs shard x expert = the rank count with both > 1
  const char* refused;  // nullptr: runs; else why plm refuses it today (printed)
};

// The matrix.  To turn a refusal into a running row when plm implements it, set `refused` to
// nullptr (and add the layout to doc/parallelism.md's table).
const std::vector<Row>& matrix() {
  static const std::vector<Row> rows = {
      {"shard x expert", {2, 2, 1, false}, 4, nullptr},
      {"shard x context", {all_ranks, 1, 2, false}, 2, nullptr},
      {"expert x context", {1, all_ranks, 2, false}, 2, nullptr},
      {"fp8 x shard", {all_ranks, 1, 1, true}, 2, nullptr},
      {"fp8 x context", {1, 1, 2, true}, 2, nullptr},
      {"fp8 x expert", {1, all_ranks, 1, true}, 2, nullptr},
      {"shard x context x fp8", {all_ranks, 1, 2, true}, 2, nullptr},
      {"expert x context x fp8", {1, all_ranks, 2, true}, 2, nullptr},
      {"shard x expert x fp8", {2, 2, 1, true}, 4, nullptr},
      {"shard x expert x context", {2, 2, 2, false}, 4, nullptr},
  };
  return rows;
}

/// Checkpointed in `from` after step `saved`, resumed in `to`.
struct Resume {
  Layout from, to;
  int min_ranks;
};

const std::vector<Resume>& resumes() {
  static const std::vector<Resume> legs = {
      {{all_ranks, 1, 1, false}, {1, 2, 1, false}, 2},  // shard W -> expert 2
      {{1, 1, 2, false}, {1, 1, 1, false}, 2},          // context 2 -> data parallel
      {{2, 2, 1, false}, {1, 2, 2, false}, 4},          // shard 2 x expert 2 -> expert x context
      {{all_ranks, 1, 1, true}, {1, 1, 2, true}, 2},    // fp8: shard W -> context 2
  };
  return legs;
}

/// The MoE deck every row trains, with `layout`'s parallel keys and precision.
Teuchos::RCP<Teuchos::ParameterList> deckFor(const std::string& dir, const std::string& run,
                                             const Layout& layout, int world, int run_steps,
                                             int every) {
  std::vector<std::string> s = {"model.heads=2",  // head_dim 16, as the GPU's bf16 attention
                                "moe.experts=4",
                                "moe.top_k=2",
                                "moe.expert_ffn=16",
                                "moe.shared_experts=1",
                                "moe.dropless=false",
                                "moe.capacity_factor=1.0",
                                "moe.aux_loss=0.01",
                                "moe.z_loss=0.001",
                                "moe.bias_balance=false",
                                "moe.router_init=normal",
                                "moe.router_projection=false",
                                "fp8.recipe=delayed",
                                "fp8.amax_history=4",
                                "train.steps=" + std::to_string(run_steps),
                                "checkpoint.every=" + std::to_string(every)};
  for (auto& k : layout.settings(world)) s.push_back(k);
  return plm::test::tinyDeck(dir, run, s);
}

/// The bound on |loss - reference| / reference for `layout`'s precision (header comment).
double bound(const Layout& layout) {
  if (PLM_HAVE_CUDA && (layout.fp8 || highPrecision() != "fp32")) return 1e-2;
  return layout.fp8 ? 1e-3 : 1e-5;
}

/// Trains without checkpoints (rows) or with the checkpoint hooks (resumed legs).
std::vector<StepRecord> train(Teuchos::RCP<Teuchos::ParameterList> deck, MPI_Comm comm,
                              bool checkpoints) {
  if (checkpoints) return plm::test::trainRecords(deck, comm);
  std::vector<StepRecord> out;
  plm::train::Trainer t(deck, comm);
  plm::train::Trainer::Hooks hooks;
  hooks.on_step = [&](plm::train::Trainer& tr, const plm::train::StepStats& s) {
    out.push_back({tr.state().step, s.tokens, s.masked, s.loss()});
  };
  t.setHooks(hooks);
  t.run();
  return out;
}

/// The one-rank run of each precision, on every rank (rank 0 trains it, the others wait).
std::vector<StepRecord> reference(const std::string& dir, bool fp8) {
  std::vector<StepRecord> out(steps);
  plm::test::onFirstRanks(1, [&](MPI_Comm self) {
    Layout one;
    one.fp8 = fp8;
    out = train(deckFor(dir, fp8 ? "ref_fp8" : "ref", one, 1, steps, 0), self, false);
  });
  out.resize(steps);
  MPI_Bcast(out.data(), static_cast<int>(out.size() * sizeof(StepRecord)), MPI_BYTE, 0,
            MPI_COMM_WORLD);
  return out;
}

/// Largest relative loss difference against `ref` from step `first` on; counts must be equal.
double compare(const std::vector<StepRecord>& got, const std::vector<StepRecord>& ref,
               const std::string& what, std::size_t first = 0) {
  EXPECT_EQ(got.size() + first, ref.size()) << what;
  double worst = 0;
  for (std::size_t i = 0; i < got.size() && i + first < ref.size(); ++i) {
    const auto& r = ref[i + first];
    EXPECT_EQ(got[i].step, r.step) << what;
    EXPECT_EQ(got[i].tokens, r.tokens) << what << " step " << r.step << ": another batch";
    EXPECT_EQ(got[i].masked, r.masked) << what << " step " << r.step << ": other masks";
    const double rel = std::abs(got[i].loss - r.loss) / std::abs(r.loss);
    worst = std::max(worst, std::isfinite(rel) ? rel : 1e300);
  }
  return worst;
}

struct Line {
  std::string combination, layout, result;
  double diff = -1, bound = 0;
};

void print(int world, const std::vector<Line>& lines) {
  if (plm::dist::worldRank() != 0) return;
  std::printf("\ncomposition matrix at %d ranks (each against the 1-rank run, %d steps):\n", world,
              steps);
  std::printf("%-26s %-58s %-12s %-8s %s\n", "combination", "layout", "max rel diff", "bound",
              "result");
  for (const auto& l : lines) {
    char diff[32] = "-", b[32] = "-";
    if (l.diff >= 0) std::snprintf(diff, sizeof diff, "%.3g", l.diff);
    if (l.bound > 0) std::snprintf(b, sizeof b, "%.0e", l.bound);
    std::printf("%-26s %-58s %-12s %-8s %s\n", l.combination.c_str(), l.layout.c_str(), diff, b,
                l.result.c_str());
  }
  std::fflush(stdout);
}

class Composition : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir = plm::test::sharedTempDir(MPI_COMM_WORLD, "composition");
    plm::test::writeTinyDataset(dir + "/train.h5", 64, 9, MPI_COMM_WORLD);
    ref32 = reference(dir, false);
    ref8 = reference(dir, true);
  }
  static void TearDownTestSuite() { plm::test::removeSharedDir(MPI_COMM_WORLD, dir); }
  static std::string dir;
  static std::vector<StepRecord> ref32, ref8;
};
std::string Composition::dir;
std::vector<StepRecord> Composition::ref32, Composition::ref8;

bool skipped() { return plm::test::noCollectivesForDeviceMemory(MPI_COMM_WORLD); }

TEST_F(Composition, EveryPairAndTripleAgainstOneRank) {
  if (skipped()) GTEST_SKIP() << "device memory over plain MPI (PLM_COMM_BACKEND=mpi)";
  const int world = plm::dist::worldSize();
  if (world < 2) GTEST_SKIP() << "the matrix runs at 2 and 4 ranks";
  EXPECT_LT(ref32.back().loss, ref32.front().loss) << "the reference did not learn";
  std::vector<Line> lines;
  int n = 0;
  for (const Row& row : matrix()) {
    const Layout& l = row.layout;
    Line line{row.combination, l.name(world), ""};
    if (world < row.min_ranks || world % row.min_ranks != 0) {
      line.result = "needs " + std::to_string(row.min_ranks) + " ranks";
      lines.push_back(line);
      continue;
    }
    const std::string run = "row" + std::to_string(n++);
    std::vector<StepRecord> got;
    std::string message;
    bool collective = false;
    try {
      got = train(deckFor(dir, run, l, world, steps, 0), MPI_COMM_WORLD, false);
    } catch (const plm::Error& e) {
      message = e.what();
      collective = e.collective();
    }
    if (!message.empty()) {
      EXPECT_TRUE(row.refused) << row.combination << " was refused: " << message;
      EXPECT_TRUE(collective) << row.combination << ": not a collective error: " << message;
      for (const auto& key : l.keys(world))
        EXPECT_NE(message.find(key), std::string::npos)
            << row.combination << ": the refusal does not name " << key << ": " << message;
      line.result = row.refused ? std::string("refused as expected (") + row.refused + ")"
                                : "REFUSED: " + message;
      lines.push_back(line);
      continue;
    }
    line.bound = bound(l);
    line.diff = compare(got, l.fp8 ? ref8 : ref32, line.layout);
    EXPECT_LE(line.diff, line.bound) << line.layout;
    EXPECT_FALSE(row.refused) << row.combination
                              << " runs now: set its `refused` to nullptr in the matrix";
    line.result = row.refused               ? "RUNS (expected a refusal: flip the row)"
                  : line.diff <= line.bound ? "pass"
                                            : "FAIL";
    lines.push_back(line);
  }
  print(world, lines);
}

TEST_F(Composition, ResumesAcrossLayouts) {
  if (skipped()) GTEST_SKIP() << "device memory over plain MPI (PLM_COMM_BACKEND=mpi)";
  const int world = plm::dist::worldSize();
  if (world < 2) GTEST_SKIP() << "the matrix runs at 2 and 4 ranks";
  std::vector<Line> lines;
  int n = 0;
  for (const Resume& leg : resumes()) {
    Line line{"resume", leg.from.name(world) + " -> " + leg.to.name(world), ""};
    if (world < leg.min_ranks) {
      line.result = "needs " + std::to_string(leg.min_ranks) + " ranks";
      lines.push_back(line);
      continue;
    }
    const std::string run = "resume" + std::to_string(n++);
    const auto& ref = leg.from.fp8 ? ref8 : ref32;
    const auto first =
        train(deckFor(dir, run, leg.from, world, saved, saved), MPI_COMM_WORLD, true);
    ASSERT_EQ(plm::ckpt::listCheckpoints(dir + "/" + run + "/ckpt").size(), 1u) << line.layout;
    const auto second = train(deckFor(dir, run, leg.to, world, steps, saved), MPI_COMM_WORLD, true);
    line.bound = std::max(bound(leg.from), bound(leg.to));
    line.diff = std::max(compare(first, std::vector<StepRecord>(ref.begin(), ref.begin() + saved),
                                 line.layout + " (before the save)"),
                         compare(second, ref, line.layout + " (resumed)", saved));
    EXPECT_LE(line.diff, line.bound) << line.layout;
    line.result = line.diff <= line.bound ? "pass" : "FAIL";
    lines.push_back(line);
  }
  print(world, lines);
}

}  // namespace
