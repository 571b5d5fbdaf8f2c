// Task heads (model/task_head.hpp): logits against a plain host reference of Hugging Face's
// EsmClassificationHead / token Linear, every gradient (parameters and hidden states) against
// central finite differences of the summed loss (double), and the metrics against hand-worked
// values.  Sequences of length 1 and 2 (just <cls>, <cls><eos>: no residue to mean-pool) reach
// the empty-pool path.
#include "core/error.hpp"
#include "model/esm2.hpp"
#include "model/task_head.hpp"
#include "model_test_util.hpp"

#include <cmath>

namespace plm::model::test {
namespace {

HostView1<seqlen_t> cuSeqlens(const std::vector<int>& lengths) {
  HostView1<seqlen_t> cu("cu", lengths.size() + 1);
  for (std::size_t s = 0; s < lengths.size(); ++s) cu(s + 1) = cu(s) + lengths[s];
  return cu;
}

// Plain reference: HF EsmClassificationHead (x = h[:, 0]; dense; tanh; out_proj) or, with mean
// pooling, the residue mean; token heads: Linear per row.
std::vector<double> reference(const TaskHead<double>& head, const std::vector<double>& h, int hid,
                              const HostView1<seqlen_t>& cu) {
  const auto p = toHost(head.parameters());
  const int l = head.config().num_labels;
  auto linear = [&](const std::vector<double>& x, std::int64_t w, std::int64_t b, int out, int in) {
    std::vector<double> y(out);
    for (int o = 0; o < out; ++o) {
      y[o] = p[b + o];
      for (int i = 0; i < in; ++i) y[o] += p[w + std::int64_t(o) * in + i] * x[i];
    }
    return y;
  };
  const auto& t = head.tensors();
  std::vector<double> out;
  if (head.config().kind == TaskKind::TokenClassification) {
    for (std::size_t r = 0; r < h.size() / hid; ++r) {
      std::vector<double> x(h.begin() + r * hid, h.begin() + (r + 1) * hid);
      auto y = linear(x, t[0].offset, t[1].offset, l, hid);
      out.insert(out.end(), y.begin(), y.end());
    }
    return out;
  }
  for (std::size_t s = 0; s + 1 < cu.extent(0); ++s) {
    std::vector<double> x(hid, 0.0);
    int a = cu(s), b = cu(s) + 1;
    if (head.config().pooling == Pooling::Mean) a = cu(s) + 1, b = std::max(a, int(cu(s + 1)) - 1);
    for (int tok = a; tok < b; ++tok)
      for (int c = 0; c < hid; ++c) x[c] += h[tok * hid + c] / (b - a);
    auto z = linear(x, t[0].offset, t[1].offset, hid, hid);
    for (auto& v : z) v = std::tanh(v);
    auto y = linear(z, t[2].offset, t[3].offset, l, hid);
    out.insert(out.end(), y.begin(), y.end());
  }
  return out;
}

void checkHead(TaskKind kind, Pooling pooling, int labels) {
  const ExecSpace space;
  const int hid = 7;
  const std::vector<int> lengths = {5, 1, 9, 2, 4};
  const auto cu = cuSeqlens(lengths);
  const int tokens = cu(lengths.size());
  TaskConfig config{kind, labels, pooling};
  TaskHead<double> head(config, hid);
  head.initialize(3);
  fillNormal(head.parameters(), 11, 0.5);  // larger than 0.02 so tanh is not linear
  auto hidden = randomView<double>(tokens, hid, 5);
  const bool seq = sequenceLevel(kind);
  const int rows = seq ? int(lengths.size()) : tokens;
  std::vector<double> targets(rows);
  for (int r = 0; r < rows; ++r)
    targets[r] =
        kind == TaskKind::SequenceRegression ? 0.3 * r - 0.5 : (r % 3 == 1 ? -100 : r % labels);
  const std::string what =
      std::string(taskKindName(kind)) + (pooling == Pooling::Mean ? "/mean" : "");

  auto logits = toHost(head.forward(space, hidden, cu));
  const auto ref = reference(head, toHost(hidden), hid, cu);
  ASSERT_EQ(logits.size(), ref.size()) << what;
  for (std::size_t i = 0; i < ref.size(); ++i) EXPECT_NEAR(logits[i], ref[i], 1e-12) << what;

  auto loss = [&]() {
    return taskLoss(kind, toHost(head.forward(space, hidden, cu)), labels, targets, 1, nullptr).sum;
  };
  std::vector<double> dl;
  const auto l = taskLoss(kind, logits, labels, targets, 1.0, &dl);
  EXPECT_EQ(l.counted, kind == TaskKind::SequenceRegression ? rows : rows - (rows + 1) / 3) << what;
  View2<double> dlogits("dlogits", rows, labels);
  auto hdl = Kokkos::create_mirror_view(dlogits);
  for (int i = 0; i < rows * labels; ++i) hdl.data()[i] = dl[i];
  Kokkos::deep_copy(dlogits, hdl);
  View2<double> dhidden("dhidden", tokens, hid);
  head.zeroGradients();
  head.forward(space, hidden, cu);
  head.backward(space, hidden, dlogits, dhidden);
  Kokkos::fence();
  checkGradient(what + " params", head.parameters(), head.gradients(), loss);
  checkGradient(what + " hidden", flat(hidden), flat(dhidden), loss);
}

TEST(TaskHead, SequenceRegressionCls) { checkHead(TaskKind::SequenceRegression, Pooling::Cls, 1); }
TEST(TaskHead, SequenceRegressionMean) {
  checkHead(TaskKind::SequenceRegression, Pooling::Mean, 1);
}
TEST(TaskHead, SequenceClassification) {
  checkHead(TaskKind::SequenceClassification, Pooling::Cls, 3);
  checkHead(TaskKind::SequenceClassification, Pooling::Mean, 2);
}
TEST(TaskHead, TokenClassification) { checkHead(TaskKind::TokenClassification, Pooling::Cls, 3); }

TEST(TaskHead, HuggingFaceNames) {
  TaskHead<float> seq({TaskKind::SequenceClassification, 4, Pooling::Cls}, 8);
  ASSERT_EQ(seq.tensors().size(), 4u);
  EXPECT_EQ(seq.tensors()[0].name, "classifier.dense.weight");
  EXPECT_EQ(seq.tensors()[2].name, "classifier.out_proj.weight");
  EXPECT_EQ(seq.tensors()[2].shape, (std::vector<std::int64_t>{4, 8}));
  TaskHead<float> tok({TaskKind::TokenClassification, 3, Pooling::Cls}, 8);
  ASSERT_EQ(tok.tensors().size(), 2u);
  EXPECT_EQ(tok.tensors()[0].name, "classifier.weight");
  EXPECT_EQ(tok.tensors()[1].shape, (std::vector<std::int64_t>{3}));
}

TEST(TaskHead, RefusesInconsistentConfig) {
  auto message = [](TaskConfig c) {
    try {
      c.validate();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(message({TaskKind::SequenceRegression, 2, Pooling::Cls}).find("task.num_labels"),
            std::string::npos);
  EXPECT_NE(message({TaskKind::SequenceClassification, 1, Pooling::Cls}).find("at least 2"),
            std::string::npos);
  EXPECT_NE(message({TaskKind::TokenClassification, 3, Pooling::Mean}).find("task.pooling"),
            std::string::npos);
  EXPECT_THROW(parseTaskKind("regression"), Error);
}

TEST(TaskHead, Metrics) {
  // Monotone, reversed, and a hand-worked case with ties: ranks x (1, 2.5, 2.5, 4), y (1, 2, 3, 4)
  // give rho = 2.5 / sqrt(4.5 * 5).
  EXPECT_NEAR(spearman({1, 5, 9, 20}, {0, 1, 2, 3}), 1.0, 1e-15);
  EXPECT_NEAR(spearman({1, 5, 9, 20}, {3, 2, 1, 0}), -1.0, 1e-15);
  EXPECT_NEAR(spearman({1, 2, 2, 3}, {1, 2, 3, 4}), 4.5 / std::sqrt(5.0 * 4.5), 1e-12);
  EXPECT_EQ(spearman({1, 1, 1}, {1, 2, 3}), 0.0);
  // AUROC: perfect, inverted, and 3 of 4 positive/negative pairs ordered with one tie (3.5 / 4).
  EXPECT_NEAR(auroc({0.1, 0.2, 0.8, 0.9}, {0, 0, 1, 1}), 1.0, 1e-15);
  EXPECT_NEAR(auroc({0.9, 0.8, 0.2, 0.1}, {0, 0, 1, 1}), 0.0, 1e-15);
  EXPECT_NEAR(auroc({0.1, 0.5, 0.5, 0.9}, {0, 1, 0, 1}), 3.5 / 4, 1e-15);
  EXPECT_TRUE(std::isnan(auroc({0.1, 0.2}, {1, 1})));
  // Cross-entropy of uniform logits over 4 classes is log 4 per labelled row; -100 is skipped.
  const auto ce = taskLoss(TaskKind::SequenceClassification, std::vector<double>(12, 0.0), 4,
                           {0, -100, 3}, 1.0, nullptr);
  EXPECT_EQ(ce.counted, 2);
  EXPECT_NEAR(ce.sum, 2 * std::log(4.0), 1e-14);
  const auto mse = taskLoss(TaskKind::SequenceRegression, {1.0, 2.0}, 1, {0.5, 4.0}, 1.0, nullptr);
  EXPECT_NEAR(mse.sum, 0.25 + 4.0, 1e-14);
}

// The task head as the encoder's objective (Esm2::setHiddenHead), as train/finetune.cpp wires
// it: the head's loss on the hidden state, its gradient handed back to the encoder.
class HeadObjective : public HiddenHead<double> {
 public:
  explicit HeadObjective(TaskHead<double>& head) : head_member(head) {}
  double lossAndGradient(const data::MicroBatch& batch, const View2<double>& hidden,
                         double grad_scale, const View2<double>& dhidden) override {
    const ExecSpace space;
    const auto logits = toHost(head_member.forward(space, hidden, batch.cu_seqlens));
    std::vector<double> targets(batch.targets.data(), batch.targets.data() + batch.targets.size());
    std::vector<double> dlogits;
    const auto loss = taskLoss(head_member.config().kind, logits, head_member.config().num_labels,
                               targets, grad_scale, &dlogits);
    View2<double> d("dlogits", logits.size() / head_member.config().num_labels,
                    head_member.config().num_labels);
    auto hd = Kokkos::create_mirror_view(d);
    for (std::size_t i = 0; i < dlogits.size(); ++i) hd.data()[i] = dlogits[i];
    Kokkos::deep_copy(d, hd);
    head_member.backward(space, hidden, d, dhidden);
    return loss.sum;
  }

 private:
  TaskHead<double>& head_member;
};

// Every encoder parameter's gradient through a head against central differences of the head's
// loss (sequence regression and token classification, 2 layers, hidden 8), and the head's own
// gradients accumulated with grad_scale.  The LM head's tensors get no gradient.
void checkEncoderThroughHead(TaskKind kind, int labels) {
  Esm2Config c;
  c.num_layers = 2;
  c.hidden = 8;
  c.heads = 2;
  c.ffn = 16;
  Esm2<double> model(c);
  // Weights larger than the 0.02 initialisation, so every path carries a visible derivative.
  for (const auto& t : model.tensors()) {
    const bool gain = t.shape.size() == 1 && t.name.find("weight") != std::string::npos;
    fillNormal(View1<double>(model.parameters().data() + t.offset, t.size), 77 + t.offset,
               t.shape.size() == 2 ? 0.5 : 0.2, gain ? 1.0 : 0.0);
  }
  TaskConfig tc;
  tc.kind = kind;
  tc.num_labels = labels;
  TaskHead<double> head(tc, c.hidden);
  fillNormal(head.parameters(), 5, 0.5);
  auto batch = makeBatch({6, 1, 9, 4}, 11, 0.0);  // no masking: fine-tuning batches
  const std::vector<int> lengths = {6, 1, 9, 4};
  if (sequenceLevel(kind)) {
    batch.targets = HostView1<double>("targets", 4);
    for (int s = 0; s < 4; ++s) batch.targets(s) = 0.3 * s - 0.5;
    batch.targets(1) = std::nan("");  // an unlabelled sequence is skipped
  } else {
    batch.targets = HostView1<double>("targets", batch.numTokens());
    for (std::int64_t i = 0; i < batch.numTokens(); ++i)
      batch.targets(i) = double(i % (labels + 1)) - 1;
  }
  const double scale = 0.25;
  HeadObjective objective(head);
  model.setHiddenHead(&objective);
  model.zeroGradients();
  head.zeroGradients();
  const double loss = model.forwardBackward(batch, scale);
  model.setHiddenHead(nullptr);
  // The head's loss by a forward-only pass: the encoder's hidden state, then the head.
  auto headLossOf = [&] {
    ForwardOutputs<double> out;
    out.want_hidden = true;
    model.forward(batch, &out);
    const auto logits = toHost(head.forward(ExecSpace(), out.hidden, batch.cu_seqlens));
    std::vector<double> targets(batch.targets.data(), batch.targets.data() + batch.targets.size());
    return taskLoss(kind, logits, labels, targets, 1.0, nullptr).sum;
  };
  EXPECT_NEAR(loss, headLossOf(), 1e-12 * (1 + std::abs(loss)));
  // gradients() hold scale * d(loss)/d(theta): compare with the scaled loss.
  std::vector<TensorInfo> encoder;
  for (const auto& t : model.tensors())
    if (t.name.rfind("lm_head.", 0) == 0)
      for (double g : toHost(View1<double>(model.gradients().data() + t.offset, t.size)))
        ASSERT_EQ(g, 0.0) << t.name << ": the LM head is not part of a task objective";
  checkGradient(
      std::string("encoder through ") + taskKindName(kind), model.parameters(), model.gradients(),
      [&] { return scale * headLossOf(); }, 1e-8, 1e-5, 100000);
  checkGradient(
      std::string("head ") + taskKindName(kind), head.parameters(), head.gradients(),
      [&] { return scale * headLossOf(); }, 1e-8, 1e-5, 100000);
}

TEST(TaskHead, EncoderGradientThroughSequenceRegression) {
  checkEncoderThroughHead(TaskKind::SequenceRegression, 1);
}
TEST(TaskHead, EncoderGradientThroughTokenClassification) {
  checkEncoderThroughHead(TaskKind::TokenClassification, 3);
}

}  // namespace
}  // namespace plm::model::test
