// The task metrics of evaluateTask (train/finetune.hpp, what `plm eval --head` and the task_eval
// records report) against a plain reference computed here: each sequence run alone through the
// encoder and the head, then MSE, Spearman (Pearson of average ranks, by counting), accuracy,
// AUROC (by counting ordered positive/negative pairs) and per-residue accuracy written out
// longhand.  Random labels on a random tiny model: metrics away from their trivial values.
// At 1 and 2 ranks (each rank evaluates part of the set; the metrics are over all of it).
#include "data/batch.hpp"
#include "dist/runtime.hpp"
#include "io/dataset.hpp"
#include "model/esm2.hpp"
#include "model/task_head.hpp"
#include "train/finetune.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>

namespace {

using namespace plm;

constexpr int num_sequences = 37;

struct Set {
  std::vector<std::vector<std::uint8_t>> residues;  // token ids per sequence
  std::vector<double> regression;                   // per sequence
  std::vector<double> binary;                       // per sequence, class 0 or 1
  std::vector<std::vector<std::int8_t>> classes;    // per residue, -1 or 0..2
};

Set makeSet() {
  std::mt19937 rng(17);
  Set s;
  for (int i = 0; i < num_sequences; ++i) {
    const int len = 3 + int(rng() % 20);
    std::vector<std::uint8_t> r(len);
    std::vector<std::int8_t> c(len);
    for (int k = 0; k < len; ++k) {
      r[k] = std::uint8_t(4 + rng() % 20);
      c[k] = std::int8_t(int(rng() % 4) - 1);
    }
    s.residues.push_back(r);
    s.classes.push_back(c);
    s.regression.push_back(std::normal_distribution<double>(0.3, 1.0)(rng));
    s.binary.push_back(double(rng() % 2));
  }
  return s;
}

void writeSet(const Set& s, const std::string& path, bool binary) {
  io::SequenceShard shard;
  if (dist::worldRank() == 0)
    for (int i = 0; i < num_sequences; ++i) {
      shard.tokens.insert(shard.tokens.end(), s.residues[i].begin(), s.residues[i].end());
      shard.lengths.push_back(std::int64_t(s.residues[i].size()));
      shard.ids.push_back("seq" + std::to_string(i));
      shard.labels.push_back(binary ? s.binary[i] : s.regression[i]);
      shard.residue_labels.insert(shard.residue_labels.end(), s.classes[i].begin(),
                                  s.classes[i].end());
    }
  io::DatasetMetadata meta;
  meta.split = "valid";
  io::writeDataset(path, MPI_COMM_WORLD, shard, meta);
}

// The head's logits for one sequence alone (<cls> residues <eos>), as doubles.
std::vector<double> logitsOf(model::Esm2<float>& encoder, model::TaskHead<float>& head,
                             const std::vector<std::uint8_t>& residues) {
  const std::int64_t t = std::int64_t(residues.size()) + 2;
  data::MicroBatch mb;
  mb.tokens = HostView1<token_t>("tokens", t);
  mb.labels = HostView1<std::int32_t>("labels", t);
  mb.cu_seqlens = HostView1<seqlen_t>("cu", 2);
  Kokkos::deep_copy(mb.labels, data::vocab::ignore_label);
  mb.tokens(0) = data::vocab::cls;
  for (std::size_t k = 0; k < residues.size(); ++k) mb.tokens(k + 1) = residues[k];
  mb.tokens(t - 1) = data::vocab::eos;
  mb.cu_seqlens(1) = seqlen_t(t);
  mb.max_seqlen = std::int32_t(t);
  model::ForwardOutputs<float> out;
  out.want_hidden = true;
  encoder.forward(mb, &out);
  auto logits = Kokkos::create_mirror_view_and_copy(
      HostSpace(), head.forward(ExecSpace(), out.hidden, mb.cu_seqlens));
  return std::vector<double>(logits.data(), logits.data() + logits.size());
}

// 1-based average ranks by counting: 1 + #smaller + (#equal others) / 2.
std::vector<double> countRanks(const std::vector<double>& x) {
  std::vector<double> r(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) {
    double smaller = 0, equal = 0;
    for (std::size_t j = 0; j < x.size(); ++j) {
      smaller += x[j] < x[i];
      equal += j != i && x[j] == x[i];
    }
    r[i] = 1 + smaller + equal / 2;
  }
  return r;
}

double pearson(const std::vector<double>& a, const std::vector<double>& b) {
  double ma = 0, mb = 0;
  for (std::size_t i = 0; i < a.size(); ++i) ma += a[i] / a.size(), mb += b[i] / b.size();
  double sab = 0, saa = 0, sbb = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    sab += (a[i] - ma) * (b[i] - mb);
    saa += (a[i] - ma) * (a[i] - ma);
    sbb += (b[i] - mb) * (b[i] - mb);
  }
  return sab / std::sqrt(saa * sbb);
}

struct Fixture {
  model::Esm2Config config;
  std::unique_ptr<model::Esm2<float>> encoder;
  Set set = makeSet();
  Fixture() {
    config.num_layers = 2;
    config.hidden = 16;
    config.heads = 2;
    config.ffn = 32;
    encoder = std::make_unique<model::Esm2<float>>(config);
    encoder->initialize(3);
  }
  model::TaskHead<float> head(model::TaskKind kind, int labels) {
    model::TaskConfig c;
    c.kind = kind;
    c.num_labels = labels;
    model::TaskHead<float> h(c, config.hidden);
    h.initialize(9);
    // Larger than HF's 0.02 initialisation, so the predictions spread.
    auto p = Kokkos::create_mirror_view_and_copy(HostSpace(), h.parameters());
    std::mt19937 rng(4);
    for (std::size_t i = 0; i < p.size(); ++i)
      p(i) = float(std::normal_distribution<double>(0, 0.7)(rng));
    Kokkos::deep_copy(h.parameters(), p);
    return h;
  }
  data::LoaderOptions options(const std::string& path) const {
    data::LoaderOptions o;
    o.path = path;
    o.micro_batch_tokens = 64;
    o.micro_batches_per_step = dist::worldSize();
    o.rank = dist::worldRank();
    o.world = dist::worldSize();
    o.prefetch = 0;
    return o;
  }
};

TEST(TaskEval, SequenceRegressionMatchesPlainReference) {
  Fixture f;
  const std::string path = "task_eval_reg_np" + std::to_string(dist::worldSize()) + ".h5";
  writeSet(f.set, path, false);
  auto head = f.head(model::TaskKind::SequenceRegression, 1);
  const auto fields = train::evaluateTask(*f.encoder, head, f.options(path), MPI_COMM_WORLD);
  std::vector<double> pred;
  double mse = 0, mean = 0, var = 0;
  for (int i = 0; i < num_sequences; ++i) {
    pred.push_back(logitsOf(*f.encoder, head, f.set.residues[i])[0]);
    mse += std::pow(pred[i] - f.set.regression[i], 2) / num_sequences;
    mean += f.set.regression[i] / num_sequences;
  }
  for (double y : f.set.regression) var += (y - mean) * (y - mean) / num_sequences;
  const double rho = pearson(countRanks(pred), countRanks(f.set.regression));
  EXPECT_EQ(fields.at("labelled").asInt(), num_sequences);
  EXPECT_NEAR(fields.at("mse").asDouble(), mse, 1e-5 * mse);
  EXPECT_NEAR(fields.at("loss").asDouble(), mse, 1e-5 * mse);
  EXPECT_NEAR(fields.at("spearman").asDouble(), rho, 1e-6);
  EXPECT_NEAR(fields.at("baseline_mse").asDouble(), var, 1e-9 * var);
  EXPECT_GT(std::abs(rho), 0.05);  // not a degenerate prediction
}

TEST(TaskEval, SequenceClassificationMatchesPlainReference) {
  Fixture f;
  const std::string path = "task_eval_cls_np" + std::to_string(dist::worldSize()) + ".h5";
  writeSet(f.set, path, true);
  auto head = f.head(model::TaskKind::SequenceClassification, 2);
  const auto fields = train::evaluateTask(*f.encoder, head, f.options(path), MPI_COMM_WORLD);
  double loss = 0, correct = 0, ordered = 0, pairs = 0, ones = 0;
  std::vector<double> score;
  for (int i = 0; i < num_sequences; ++i) {
    const auto z = logitsOf(*f.encoder, head, f.set.residues[i]);
    const int y = int(f.set.binary[i]);
    const double m = std::max(z[0], z[1]);
    loss += m + std::log(std::exp(z[0] - m) + std::exp(z[1] - m)) - z[y];
    correct += (z[1] > z[0] ? 1 : 0) == y;
    score.push_back(z[1] - z[0]);
    ones += y;
  }
  for (int i = 0; i < num_sequences; ++i)
    for (int j = 0; j < num_sequences; ++j)
      if (f.set.binary[i] == 1 && f.set.binary[j] == 0) {
        pairs += 1;
        ordered += score[i] > score[j] ? 1.0 : (score[i] == score[j] ? 0.5 : 0.0);
      }
  EXPECT_NEAR(fields.at("loss").asDouble(), loss / num_sequences, 1e-5);
  EXPECT_NEAR(fields.at("accuracy").asDouble(), correct / num_sequences, 1e-12);
  EXPECT_NEAR(fields.at("auroc").asDouble(), ordered / pairs, 1e-12);
  EXPECT_NEAR(fields.at("baseline_accuracy").asDouble(),
              std::max(ones, num_sequences - ones) / num_sequences, 1e-12);
}

TEST(TaskEval, TokenClassificationMatchesPlainReference) {
  Fixture f;
  const std::string path = "task_eval_tok_np" + std::to_string(dist::worldSize()) + ".h5";
  writeSet(f.set, path, false);
  auto head = f.head(model::TaskKind::TokenClassification, 3);
  const auto fields = train::evaluateTask(*f.encoder, head, f.options(path), MPI_COMM_WORLD);
  double loss = 0, correct = 0, labelled = 0;
  std::vector<double> counts(3, 0);
  for (int i = 0; i < num_sequences; ++i) {
    const auto z = logitsOf(*f.encoder, head, f.set.residues[i]);
    for (std::size_t k = 0; k < f.set.classes[i].size(); ++k) {
      const int y = f.set.classes[i][k];
      if (y < 0) continue;
      const double* row = &z[(k + 1) * 3];  // token k + 1: after <cls>
      const double m = std::max({row[0], row[1], row[2]});
      loss +=
          m + std::log(std::exp(row[0] - m) + std::exp(row[1] - m) + std::exp(row[2] - m)) - row[y];
      correct += int(std::max_element(row, row + 3) - row) == y;
      labelled += 1;
      counts[y] += 1;
    }
  }
  EXPECT_EQ(double(fields.at("labelled").asInt()), labelled);
  EXPECT_NEAR(fields.at("loss").asDouble(), loss / labelled, 1e-5);
  EXPECT_NEAR(fields.at("accuracy").asDouble(), correct / labelled, 1e-12);
  EXPECT_NEAR(fields.at("baseline_accuracy").asDouble(),
              *std::max_element(counts.begin(), counts.end()) / labelled, 1e-12);
}

}  // namespace
