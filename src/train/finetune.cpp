// The task-head loop: frozen encoder forward -> head forward -> loss on the host -> head
// backward -> one all-reduce of the head gradients -> AdamW on the head (host, fp64 moments).
#include "train/finetune.hpp"

#include "core/clock.hpp"
#include "core/error.hpp"
#include "core/log.hpp"
#include "data/loader.hpp"
#include "dist/process_groups.hpp"
#include "io/dataset.hpp"
#include "io/hdf5.hpp"
#include "model/head_file.hpp"
#include "model/model_file.hpp"
#include "train/fsdp.hpp"
#include "train/metrics.hpp"
#include "train/schedule.hpp"
#include "train/step.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

namespace plm::train {

model::TaskConfig taskConfigFromDeck(const Teuchos::ParameterList& deck) {
  const auto& t = deck.sublist("task");
  model::TaskConfig c;
  c.kind = model::parseTaskKind(t.get<std::string>("kind"));
  c.num_labels = t.get<int>("num_labels");
  c.pooling = model::parsePooling(t.get<std::string>("pooling"));
  c.validate();
  return c;
}

namespace {

using model::TaskKind;

/// Everything a pass over labelled micro-batches yields, summed over ranks by finish().
struct TaskStats {
  double loss_sum = 0;
  std::int64_t counted = 0;
  std::vector<double> scores;  // regression: prediction; 2 classes: logit difference
  std::vector<double> targets;
  std::int64_t correct = 0;                // classification
  std::vector<std::int64_t> class_counts;  // labelled rows per class
};

/// Host copy of a (rows, L) view as doubles.
template <class T> std::vector<double> toHostDoubles(const View2<T>& v) {
  auto h = Kokkos::create_mirror_view_and_copy(HostSpace(), v);
  return std::vector<double>(h.data(), h.data() + h.size());
}

std::vector<double> targetsOf(const data::MicroBatch& mb) {
  return std::vector<double>(mb.targets.data(), mb.targets.data() + mb.targets.extent(0));
}

/// The head's loss on one micro-batch's last hidden state, added to `stats` with the metric
/// inputs.  With `dhidden_scale` > 0 the head's gradients accumulate dhidden_scale * d(loss
/// sum)/d(head), and dhidden (when not empty) receives that of the hidden state.  Returns the
/// loss sum.
template <class T> double headLoss(model::TaskHead<T>& head, const data::MicroBatch& mb,
                                   const View2<T>& hidden, double dhidden_scale,
                                   const View2<T>& dhidden, TaskStats& stats) {
  const ExecSpace space;
  const auto logits_view = head.forward(space, hidden, mb.cu_seqlens);
  const auto logits = toHostDoubles(logits_view);
  const auto targets = targetsOf(mb);
  const int l = head.config().num_labels;
  const bool backward = dhidden_scale > 0;
  std::vector<double> dlogits;
  const auto loss = model::taskLoss(head.config().kind, logits, l, targets, dhidden_scale,
                                    backward ? &dlogits : nullptr);
  stats.loss_sum += loss.sum;
  stats.counted += loss.counted;
  for (std::size_t r = 0; r < targets.size(); ++r) {
    const double* z = &logits[r * l];
    if (head.config().kind == TaskKind::SequenceRegression) {
      if (std::isnan(targets[r])) continue;
      stats.scores.push_back(z[0]);
      stats.targets.push_back(targets[r]);
      continue;
    }
    if (targets[r] < 0) continue;
    if (stats.class_counts.empty()) stats.class_counts.assign(l, 0);
    ++stats.class_counts[int(targets[r])];
    const int best = int(std::max_element(z, z + l) - z);
    stats.correct += best == int(targets[r]);
    if (l == 2) {
      stats.scores.push_back(z[1] - z[0]);
      stats.targets.push_back(targets[r]);
    }
  }
  if (!backward) return loss.sum;
  View2<T> d("plm::train::task_dlogits", logits_view.extent(0), logits_view.extent(1));
  auto hd = Kokkos::create_mirror_view(d);
  for (std::size_t i = 0; i < dlogits.size(); ++i) hd.data()[i] = T(dlogits[i]);
  Kokkos::deep_copy(d, hd);
  head.backward(space, hidden, d, dhidden);
  Kokkos::fence();
  return loss.sum;
}

/// One micro-batch through the (frozen) encoder and the head; with `backward` the head's
/// gradients accumulate d(loss sum)/d(head).
template <class T> void headPass(model::Esm2<T>& encoder, model::TaskHead<T>& head,
                                 const data::MicroBatch& mb, bool backward, TaskStats& stats) {
  if (mb.numTokens() == 0) return;
  model::ForwardOutputs<T> out;
  out.want_hidden = true;
  encoder.forward(mb, &out);
  headLoss(head, mb, out.hidden, backward ? 1.0 : 0.0, View2<T>(), stats);
}

/// The head as the encoder's objective (task.freeze_encoder: false): Esm2::forwardBackward
/// hands it the hidden state and backpropagates the gradient it returns through the encoder.
template <class T> class HeadObjective : public model::HiddenHead<T> {
 public:
  HeadObjective(model::TaskHead<T>& head, TaskStats& stats)
      : head_member(head), stats_member(stats) {}
  double lossAndGradient(const data::MicroBatch& batch, const View2<T>& hidden, double grad_scale,
                         const View2<T>& dhidden) override {
    return headLoss(head_member, batch, hidden, grad_scale, dhidden, stats_member);
  }

 private:
  model::TaskHead<T>& head_member;
  TaskStats& stats_member;
};

/// Rows of `mb` the task's loss counts (what taskLoss counts): labelled sequences or residues.
std::int64_t labelledRows(const data::MicroBatch& mb, TaskKind kind) {
  std::int64_t n = 0;
  for (std::size_t i = 0; i < mb.targets.extent(0); ++i)
    n += kind == TaskKind::SequenceRegression ? !std::isnan(mb.targets(i)) : mb.targets(i) >= 0;
  return n;
}

/// Sums over the ranks; gathers the metric inputs (validation sets are small).
void finish(TaskStats& s, int num_labels, MPI_Comm comm) {
  double sums[2] = {s.loss_sum, 0};
  std::int64_t counts[2] = {s.counted, s.correct};
  PLM_CHECK_MPI(MPI_Allreduce(MPI_IN_PLACE, sums, 1, MPI_DOUBLE, MPI_SUM, comm));
  PLM_CHECK_MPI(MPI_Allreduce(MPI_IN_PLACE, counts, 2, MPI_INT64_T, MPI_SUM, comm));
  s.loss_sum = sums[0];
  s.counted = counts[0];
  s.correct = counts[1];
  s.class_counts.resize(num_labels, 0);
  PLM_CHECK_MPI(
      MPI_Allreduce(MPI_IN_PLACE, s.class_counts.data(), num_labels, MPI_INT64_T, MPI_SUM, comm));
  const int world = dist::commSize(comm);
  int n = int(s.scores.size());
  std::vector<int> sizes(world), displs(world, 0);
  PLM_CHECK_MPI(MPI_Allgather(&n, 1, MPI_INT, sizes.data(), 1, MPI_INT, comm));
  for (int r = 1; r < world; ++r) displs[r] = displs[r - 1] + sizes[r - 1];
  const int total = displs[world - 1] + sizes[world - 1];
  for (auto* v : {&s.scores, &s.targets}) {
    std::vector<double> all(total);
    PLM_CHECK_MPI(MPI_Allgatherv(v->data(), n, MPI_DOUBLE, all.data(), sizes.data(), displs.data(),
                                 MPI_DOUBLE, comm));
    *v = std::move(all);
  }
}

/// The record fields of a finished pass: loss, and spearman / accuracy / auroc by task.
io::json::Value metricFields(const TaskStats& s, TaskKind kind, int num_labels) {
  io::json::Value f = io::json::Value::object();
  const double loss = s.counted ? s.loss_sum / double(s.counted) : 0.0;
  f.set("loss", loss);
  f.set("labelled", s.counted);
  if (kind == TaskKind::SequenceRegression) {
    f.set("mse", loss);
    f.set("spearman", model::spearman(s.scores, s.targets));
    // The trivial baseline: predicting the targets' own mean (their variance).
    double mean = 0, var = 0;
    for (double y : s.targets) mean += y / double(std::max<std::size_t>(1, s.targets.size()));
    for (double y : s.targets) var += (y - mean) * (y - mean);
    f.set("baseline_mse", var / double(std::max<std::size_t>(1, s.targets.size())));
  } else {
    f.set("accuracy", s.counted ? double(s.correct) / double(s.counted) : 0.0);
    // The trivial baseline: always the most frequent class of these rows.
    std::int64_t most = 0;
    for (int c = 0; c < num_labels; ++c)
      most = std::max(most, c < int(s.class_counts.size()) ? s.class_counts[c] : 0);
    f.set("baseline_accuracy", s.counted ? double(most) / double(s.counted) : 0.0);
    if (num_labels == 2 && kind == TaskKind::SequenceClassification) {
      std::vector<int> positive(s.targets.size());
      for (std::size_t i = 0; i < positive.size(); ++i) positive[i] = s.targets[i] > 0.5;
      const double a = model::auroc(s.scores, positive);
      if (std::isfinite(a)) f.set("auroc", a);
    }
  }
  return f;
}

std::string describe(const io::json::Value& f) {
  std::string out;
  char buf[64];
  for (const auto& [key, value] : f.members()) {
    if (key == "labelled") continue;
    std::snprintf(buf, sizeof buf, " %s %.4f", key.c_str(), value.asDouble());
    out += buf;
  }
  return out;
}

data::LoaderOptions loaderOptions(const Trainer& trainer, const std::string& path,
                                  data::Targets targets, bool single_pass) {
  const auto& d = trainer.deck().sublist("data");
  data::LoaderOptions o;
  o.path = path;
  o.micro_batch_tokens = d.get<int>("micro_batch_tokens");
  o.micro_batches_per_step = single_pass
                                 ? trainer.world()
                                 : data::microBatchesPerStep(d.get<int>("tokens_per_batch"),
                                                             o.micro_batch_tokens, trainer.world());
  o.seed = static_cast<std::uint64_t>(d.get<int>("seed"));
  o.max_seq_len = d.get<int>("max_seq_len");
  o.rank = trainer.rank();
  o.world = trainer.world();
  o.shuffle = !single_pass;
  o.single_pass = single_pass;
  o.prefetch = single_pass ? 0 : d.get<int>("prefetch");
  o.targets = targets;
  return o;
}

/// Every rank reads the same labels, so the refusal is collective.
void checkLabels(const std::string& path, const model::TaskConfig& config) {
  io::DatasetReader reader(path);
  const std::string task = std::string("task.kind ") + model::taskKindName(config.kind);
  if (config.kind == TaskKind::TokenClassification) {
    if (!reader.hasResidueLabels())
      throw collectiveError(task + ": dataset `" + path +
                            "` has no per-residue labels; make it with plm prep --residue-labels");
    const auto labels = reader.readResidueLabels(0, reader.numSequences());
    for (std::size_t i = 0; i < labels.size(); ++i)
      if (labels[i] >= config.num_labels) {
        const auto& off = reader.offsets();
        const auto seq =
            std::upper_bound(off.begin(), off.end(), std::int64_t(i)) - off.begin() - 1;
        throw collectiveError(task + ": residue " + std::to_string(std::int64_t(i) - off[seq] + 1) +
                              " of `" + reader.readIds(seq, 1)[0] + "` in `" + path +
                              "` has class " + std::to_string(labels[i]) + ", task.num_labels is " +
                              std::to_string(config.num_labels) + "; raise task.num_labels");
      }
    return;
  }
  if (!reader.hasLabels())
    throw collectiveError(task + ": dataset `" + path +
                          "` has no per-sequence labels; make it with plm prep --labels CSV");
  if (config.kind != TaskKind::SequenceClassification) return;
  const auto labels = reader.readLabels(0, reader.numSequences());
  for (std::size_t i = 0; i < labels.size(); ++i)
    if (labels[i] < 0 || labels[i] >= config.num_labels || labels[i] != std::floor(labels[i]))
      throw collectiveError(task + ": sequence `" + reader.readIds(std::int64_t(i), 1)[0] +
                            "` in `" + path + "` has label " + std::to_string(labels[i]) +
                            ", not a class in [0, " + std::to_string(config.num_labels) +
                            "); give class indices 0.." + std::to_string(config.num_labels - 1) +
                            " or set task.num_labels");
}

template <class T> TaskStats evaluatePass(model::Esm2<T>& encoder, model::TaskHead<T>& head,
                                          const data::LoaderOptions& options, MPI_Comm comm) {
  data::Loader loader(options);
  TaskStats stats;
  while (true) {
    auto local = loader.nextStep();
    if (local.empty()) break;
    for (const auto& mb : local) headPass(encoder, head, mb, false, stats);
  }
  finish(stats, head.config().num_labels, comm);
  return stats;
}

template <class T> TaskStats evaluate(Trainer& trainer, model::TaskHead<T>& head,
                                      const std::string& path, data::Targets targets) {
  return evaluatePass(trainer.model(), head, loaderOptions(trainer, path, targets, true),
                      trainer.comm());
}

/// <run_dir>/task_logits.tsv (rank 0): the first sequences of `path` (at most 32), whole and
/// unmasked, one per line: id, sequence, then the head's logits (sequence tasks: num_labels;
/// token tasks: every token's, <cls> and <eos> included, row after row).  What
/// validation/hf_head_parity.py compares with transformers.
template <class T>
void writeLogits(Trainer& trainer, model::TaskHead<T>& head, const std::string& path) {
  if (trainer.rank() != 0) return;
  io::DatasetReader reader(path);
  const std::int64_t n = std::min<std::int64_t>(32, reader.numSequences());
  std::FILE* f = std::fopen((trainer.runDir() + "/task_logits.tsv").c_str(), "w");
  if (!f) {
    log::warn("task: cannot write %s/task_logits.tsv", trainer.runDir().c_str());
    return;
  }
  const int max_len = trainer.model().config().max_positions - 2;
  for (std::int64_t i = 0; i < n; ++i) {
    const std::string seq = reader.sequenceString(i);
    if (std::int64_t(seq.size()) > max_len) continue;
    const auto residues = reader.readTokens(i, 1);
    const std::int64_t t = std::int64_t(residues.size()) + 2;
    data::MicroBatch mb;
    mb.tokens = HostView1<token_t>("plm::train::logit_tokens", t);
    mb.labels = HostView1<std::int32_t>("plm::train::logit_labels", t);
    mb.cu_seqlens = HostView1<seqlen_t>("plm::train::logit_cu", 2);
    Kokkos::deep_copy(mb.labels, vocab::ignore_label);
    mb.tokens(0) = vocab::cls;
    for (std::size_t k = 0; k < residues.size(); ++k) mb.tokens(k + 1) = residues[k];
    mb.tokens(t - 1) = vocab::eos;
    mb.cu_seqlens(1) = seqlen_t(t);
    mb.max_seqlen = std::int32_t(t);
    model::ForwardOutputs<T> out;
    out.want_hidden = true;
    trainer.model().forward(mb, &out);
    const auto logits = toHostDoubles(head.forward(ExecSpace(), out.hidden, mb.cu_seqlens));
    std::fprintf(f, "%s\t%s\t", reader.readIds(i, 1)[0].c_str(), seq.c_str());
    for (std::size_t k = 0; k < logits.size(); ++k)
      std::fprintf(f, k ? " %.9g" : "%.9g", logits[k]);
    std::fprintf(f, "\n");
  }
  std::fclose(f);
}

}  // namespace

model::TaskConfig taskConfigOf(const model::HeadData& data, const std::string& source) {
  model::TaskConfig c;
  try {
    c.kind = model::parseTaskKind(data.task_kind);
    c.num_labels = int(data.num_labels);
    c.pooling = model::parsePooling(data.pooling);
    c.validate();
  } catch (const Error& e) {
    throw Error("`" + source + "`: " + e.what());
  }
  if (c.kind == TaskKind::Mlm) throw Error("`" + source + "`: task_kind mlm is not a task head");
  return c;
}

void loadHead(model::TaskHead<param_t>& head, const model::HeadData& data,
              const std::string& source) {
  const auto& c = head.config();
  if (data.task_kind != model::taskKindName(c.kind) || data.num_labels != c.num_labels ||
      data.pooling != (c.pooling == model::Pooling::Cls ? "cls" : "mean"))
    throw Error("`" + source + "` holds a " + data.task_kind + " head with " +
                std::to_string(data.num_labels) + " label(s) and " + data.pooling +
                " pooling, the task is " + model::taskKindName(c.kind) + " with " +
                std::to_string(c.num_labels) + " and " +
                (c.pooling == model::Pooling::Cls ? "cls" : "mean") +
                "; make the task section match the head");
  auto host = Kokkos::create_mirror_view(head.parameters());
  for (const auto& t : head.tensors()) {
    const auto it = std::find(data.names.begin(), data.names.end(), t.name);
    if (it == data.names.end()) throw Error("`" + source + "` lacks the head tensor " + t.name);
    const std::size_t i = std::size_t(it - data.names.begin());
    if (data.shapes[i] != t.shape) {
      auto text = [](const std::vector<std::int64_t>& s) {
        std::string out = "(";
        for (std::size_t k = 0; k < s.size(); ++k) out += (k ? ", " : "") + std::to_string(s[k]);
        return out + ")";
      };
      throw Error("`" + source + "`: head tensor " + t.name + " is " + text(data.shapes[i]) +
                  " in the file but " + text(t.shape) +
                  " for the model (hidden size or label count differ)");
    }
    std::copy(data.values[i].begin(), data.values[i].end(), host.data() + t.offset);
  }
  Kokkos::deep_copy(head.parameters(), host);
}

io::json::Value evaluateTask(model::Esm2<param_t>& encoder, model::TaskHead<param_t>& head,
                             data::LoaderOptions options, MPI_Comm comm) {
  options.targets = head.config().kind == TaskKind::TokenClassification ? data::Targets::Residue
                                                                        : data::Targets::Sequence;
  options.single_pass = true;
  options.shuffle = false;
  const auto stats = evaluatePass(encoder, head, options, comm);
  return metricFields(stats, head.config().kind, head.config().num_labels);
}

void trainTaskHead(Trainer& trainer) {
  const auto& deck = trainer.deck();
  const model::TaskConfig config = taskConfigFromDeck(deck);
  const auto& t = deck.sublist("task");
  const bool frozen = t.get<bool>("freeze_encoder");
  if (trainer.model().contextDegree() > 1 || trainer.model().config().moe.experts > 0)
    throw collectiveError("task." + std::string(model::taskKindName(config.kind)) +
                          ": task heads run on a dense model with data parallelism (plain or "
                          "sharded); set parallel.context_degree to 1");
  const data::Targets targets = config.kind == TaskKind::TokenClassification
                                    ? data::Targets::Residue
                                    : data::Targets::Sequence;
  auto& encoder = trainer.model();
  model::TaskHead<param_t> head(config, encoder.config().hidden);
  head.initialize(trainer.state().init_seed);
  const std::string init_head = t.get<std::string>("init_head");
  if (!init_head.empty()) {
    try {  // every rank reads the same file: the same outcome everywhere
      loadHead(head, model::readHead(init_head, trainer.comm()), init_head);
    } catch (const Error& e) {
      throw collectiveError(std::string("task.init_head: ") + e.what());
    }
    log::info("task: head from %s", init_head.c_str());
  }
  const ExecSpace space;
  // Sharded runs: the whole encoder for the forward-only passes (evaluation, the frozen
  // encoder); the next sharded step frees it again.
  auto wholeEncoder = [&] {
    if (trainer.sharding()) trainer.sharding()->gatherAll(space);
  };

  const auto& d = deck.sublist("data");
  checkLabels(d.get<std::string>("train"), config);
  if (!d.get<std::string>("valid").empty()) checkLabels(d.get<std::string>("valid"), config);
  const auto& tr = deck.sublist("train");
  data::Loader loader(loaderOptions(trainer, d.get<std::string>("train"), targets, false));
  const std::string valid = d.get<std::string>("valid");
  const std::int64_t steps = tr.get<int>("steps");
  const int log_every = std::max(1, tr.get<int>("log_every"));
  const int eval_every = tr.get<int>("eval_every");
  ScheduleOptions schedule = trainer.schedule();  // the encoder's: optimizer.lr
  ScheduleOptions head_schedule = schedule;
  head_schedule.peak_lr = t.get<double>("head_lr");
  const double clip_norm = deck.sublist("optimizer").get<double>("clip_grad_norm");
  const auto& adamw = trainer.optimizerOptions().adamw;  // the head's AdamW: optimizer.betas ...
  const double beta1 = adamw.beta1, beta2 = adamw.beta2, eps = adamw.eps;
  const double decay = adamw.weight_decay;

  MetricsLog metrics;
  if (trainer.rank() == 0) metrics.open(trainer.runDir() + "/metrics.jsonl");
  auto record = [&](const char* kind, std::int64_t step, io::json::Value fields) {
    if (trainer.rank() != 0) return;
    fields.set("kind", kind);
    fields.set("step", step);
    fields.set("task", model::taskKindName(config.kind));
    fields.set("time", clock::utcIso());
    metrics.write(fields);
  };
  auto runEval = [&](std::int64_t step) {
    if (valid.empty()) return;
    wholeEncoder();
    const auto stats = evaluate(trainer, head, valid, targets);
    const auto f = metricFields(stats, config.kind, config.num_labels);
    log::info("task eval step %lld:%s", (long long)step, describe(f).c_str());
    record("task_eval", step, f);
  };

  const auto n = static_cast<std::size_t>(head.parameters().extent(0));
  std::vector<double> m1(n, 0.0), m2(n, 0.0);
  auto params = Kokkos::create_mirror_view_and_copy(HostSpace(), head.parameters());
  // Weight decay on the two Linear weights only, as the encoder's mask does.
  std::vector<char> decays(n, 0);
  for (const auto& ht : head.tensors())
    if (ht.shape.size() == 2)
      std::fill(decays.begin() + ht.offset, decays.begin() + ht.offset + ht.shape[0] * ht.shape[1],
                1);
  log::info("task %s: head of %zu parameters (%s pooling) on a %s encoder, %lld steps",
            model::taskKindName(config.kind), n,
            config.pooling == model::Pooling::Cls ? "cls" : "mean", frozen ? "frozen" : "trainable",
            (long long)steps);
  if (frozen) wholeEncoder();
  const double start = clock::unixSeconds();
  std::int64_t tokens = 0, head_steps = 0;
  for (std::int64_t step = 1; step <= steps; ++step) {
    head.zeroGradients();
    TaskStats stats;
    std::vector<data::MicroBatch> local = loader.nextStep();
    for (const auto& mb : local) tokens += mb.numTokens();
    double inv = 1.0;  // what turns the head's accumulated gradient into that of the mean loss
    StepStats st;
    if (frozen) {
      for (const auto& mb : local) headPass(encoder, head, mb, true, stats);
    } else {
      // The encoder's step as in pre-training (trainStep / Fsdp::step: gradient all-reduce or
      // reduce-scatter, clipping by optimizer.clip_grad_norm, the encoder's optimizer at
      // optimizer.lr), with the head's loss in place of the LM head's: the labelled rows are
      // the step's count, so grad_scale = 1 / (global labelled rows) reaches the head too.
      for (auto& mb : local) mb.num_masked = labelledRows(mb, config.kind);
      HeadObjective<param_t> objective(head, stats);
      encoder.setHiddenHead(&objective);
      struct Unset {
        model::Esm2<param_t>& m;
        ~Unset() { m.setHiddenHead(nullptr); }
      } unset{encoder};
      const double lr = learningRate(schedule, step - 1);
      if (trainer.sharding()) {
        st = trainer.sharding()->step(space, local, lr, clip_norm, trainer.comm());
      } else {
        st = trainStep(space, encoder, trainer.optimizer(), local, lr, clip_norm, trainer.comm());
      }
    }
    finish(stats, head.config().num_labels, trainer.comm());
    if (frozen) inv = stats.counted ? 1.0 / double(stats.counted) : 0.0;
    auto grads = Kokkos::create_mirror_view_and_copy(HostSpace(), head.gradients());
    std::vector<double> g(grads.data(), grads.data() + n);
    PLM_CHECK_MPI(
        MPI_Allreduce(MPI_IN_PLACE, g.data(), int(n), MPI_DOUBLE, MPI_SUM, trainer.comm()));
    const double lr = learningRate(head_schedule, step - 1);
    if (!frozen && !st.applied) {
      // Every rank sees the same (all-reduced) outcome: the head skips the step with the encoder.
      log::warn(
          "task step %lld: no labelled row or a non-finite loss or gradient; the step is "
          "skipped (encoder and head)",
          (long long)step);
    } else {
      ++head_steps;
      const double c1 = 1 - std::pow(beta1, double(head_steps));
      const double c2 = 1 - std::pow(beta2, double(head_steps));
      for (std::size_t i = 0; i < n; ++i) {
        const double gi = g[i] * inv;
        m1[i] = beta1 * m1[i] + (1 - beta1) * gi;
        m2[i] = beta2 * m2[i] + (1 - beta2) * gi * gi;
        double p = params(i);
        if (decays[i]) p -= lr * decay * p;
        p -= lr * (m1[i] / c1) / (std::sqrt(m2[i] / c2) + eps);
        params(i) = param_t(p);
      }
      Kokkos::deep_copy(head.parameters(), params);
    }
    if (step % log_every == 0 || step == steps) {
      auto f = metricFields(stats, config.kind, config.num_labels);
      f.set("lr", lr);
      if (!frozen) {
        f.set("encoder_lr", st.lr);
        f.set("grad_norm", st.grad_norm);
      }
      double all_tokens = double(tokens);
      PLM_CHECK_MPI(
          MPI_Allreduce(MPI_IN_PLACE, &all_tokens, 1, MPI_DOUBLE, MPI_SUM, trainer.comm()));
      f.set("tokens_per_s", all_tokens / std::max(1e-9, clock::unixSeconds() - start));
      log::info("task step %lld/%lld:%s", (long long)step, (long long)steps, describe(f).c_str());
      record("task_step", step, f);
    }
    if (eval_every > 0 && step % eval_every == 0 && step != steps) runEval(step);
  }
  runEval(steps);

  wholeEncoder();
  writeLogits(trainer, head, valid.empty() ? d.get<std::string>("train") : valid);

  // The head beside the encoder's model.h5: /head/<HF name> (fp32) and the task attributes.
  std::vector<float> values(params.data(), params.data() + n);
  const std::string path = trainer.runDir() + "/head.h5";
  {
    model::HeadData data;
    data.task_kind = model::taskKindName(config.kind);
    data.num_labels = config.num_labels;
    data.pooling = config.pooling == model::Pooling::Cls ? "cls" : "mean";
    for (const auto& ht : head.tensors()) {
      std::int64_t size = 1;
      for (auto dim : ht.shape) size *= dim;
      data.names.push_back(ht.name);
      data.shapes.push_back(ht.shape);
      data.values.emplace_back(values.begin() + ht.offset, values.begin() + ht.offset + size);
    }
    io::h5::Hid file = io::h5::createFile(path, trainer.comm());
    model::writeHead(file, trainer.comm(), data);
  }
  // The encoder beside it (trained or as loaded), so `plm convert --to-hf run/model.h5 --head
  // run/head.h5` exports the pair without the init source.
  trainer.writeFinalModel();
  log::info("task: wrote %s and %s/model.h5", path.c_str(), trainer.runDir().c_str());
}

}  // namespace plm::train
