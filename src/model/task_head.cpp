// Accumulation rule: parameter gradients accumulate (+=); logits, the pooled states and dhidden
// are written (=).  The head is a few (n, H) x (H, H) products per micro-batch, so it runs the
// portable Kokkos linear layers (model/linear.hpp) in T on every backend.
#include "model/task_head.hpp"

#include "core/error.hpp"
#include "model/linear.hpp"
#include "model/math.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

namespace plm::model {

TaskKind parseTaskKind(const std::string& text) {
  for (TaskKind k : {TaskKind::Mlm, TaskKind::SequenceRegression, TaskKind::SequenceClassification,
                     TaskKind::TokenClassification})
    if (text == taskKindName(k)) return k;
  throw collectiveError("task.kind: unknown value '" + text +
                        "'; use mlm, sequence_regression, sequence_classification or "
                        "token_classification");
}

const char* taskKindName(TaskKind kind) {
  switch (kind) {
    case TaskKind::Mlm: return "mlm";
    case TaskKind::SequenceRegression: return "sequence_regression";
    case TaskKind::SequenceClassification: return "sequence_classification";
    case TaskKind::TokenClassification: return "token_classification";
  }
  return "?";
}

Pooling parsePooling(const std::string& text) {
  if (text == "cls") return Pooling::Cls;
  if (text == "mean") return Pooling::Mean;
  throw collectiveError("task.pooling: unknown value '" + text + "'; use cls or mean");
}

void TaskConfig::validate() const {
  if (kind == TaskKind::SequenceRegression && num_labels != 1)
    throw collectiveError("task.num_labels = " + std::to_string(num_labels) +
                          " with task.kind sequence_regression: a regression head has one output; "
                          "set task.num_labels: 1");
  if ((kind == TaskKind::SequenceClassification || kind == TaskKind::TokenClassification) &&
      num_labels < 2)
    throw collectiveError("task.num_labels = " + std::to_string(num_labels) + " with task.kind " +
                          taskKindName(kind) + ": give the number of classes (at least 2)");
  if (kind == TaskKind::TokenClassification && pooling != Pooling::Cls)
    throw collectiveError(
        "task.pooling: mean with task.kind token_classification: a per-token head pools "
        "nothing; leave task.pooling at cls");
}

template <class T> TaskHead<T>::TaskHead(const TaskConfig& config, int hidden)
    : config_member(config), hidden_member(hidden) {
  config.validate();
  const std::int64_t h = hidden, l = config.num_labels;
  if (sequenceLevel(config.kind))
    tensors_member = {{"classifier.dense.weight", {h, h}, 0},
                      {"classifier.dense.bias", {h}, 0},
                      {"classifier.out_proj.weight", {l, h}, 0},
                      {"classifier.out_proj.bias", {l}, 0}};
  else if (config.kind == TaskKind::TokenClassification)
    tensors_member = {{"classifier.weight", {l, h}, 0}, {"classifier.bias", {l}, 0}};
  std::int64_t offset = 0;
  for (auto& t : tensors_member) {
    t.offset = offset;
    std::int64_t n = 1;
    for (auto d : t.shape) n *= d;
    offset += n;
  }
  params_member = View1<T>("plm::model::task_head::params", offset);
  grads_member = View1<T>("plm::model::task_head::grads", offset);
}

template <class T> View2<T> TaskHead<T>::weight(int i) const {
  const auto& t = tensors_member[i];
  return View2<T>(params_member.data() + t.offset, t.shape[0], t.shape[1]);
}
template <class T> View1<T> TaskHead<T>::bias(int i) const {
  const auto& t = tensors_member[i];
  return View1<T>(params_member.data() + t.offset, t.shape[0]);
}
template <class T> View2<T> TaskHead<T>::weightGrad(int i) const {
  const auto& t = tensors_member[i];
  return View2<T>(grads_member.data() + t.offset, t.shape[0], t.shape[1]);
}
template <class T> View1<T> TaskHead<T>::biasGrad(int i) const {
  const auto& t = tensors_member[i];
  return View1<T>(grads_member.data() + t.offset, t.shape[0]);
}

template <class T> void TaskHead<T>::initialize(std::uint64_t seed) {
  auto host = Kokkos::create_mirror_view(params_member);
  for (std::size_t i = 0; i < tensors_member.size(); ++i) {
    const auto& t = tensors_member[i];
    const bool is_weight = t.shape.size() == 2;
    const std::int64_t n = is_weight ? t.shape[0] * t.shape[1] : t.shape[0];
    for (std::int64_t e = 0; e < n; ++e)
      host(t.offset + e) = is_weight ? T(0.02 * math::normal(seed, 0x7A5Cull + i, e)) : T(0);
  }
  Kokkos::deep_copy(params_member, host);
  zeroGradients();
}

template <class T> void TaskHead<T>::zeroGradients() { Kokkos::deep_copy(grads_member, T(0)); }

template <class T> View2<T> TaskHead<T>::forward(const ExecSpace& space, const View2<T>& hidden,
                                                 const HostView1<seqlen_t>& cu_seqlens) {
  const std::int64_t h = hidden_member, l = config_member.num_labels;
  if (config_member.kind == TaskKind::TokenClassification) {
    const auto rows = static_cast<std::int64_t>(hidden.extent(0));
    logits_member = View2<T>("plm::model::task_head::logits", rows, l);
    linearForward(space, hidden, weight(0), bias(1), T(0), logits_member);
    return logits_member;
  }
  const std::int64_t n = cu_seqlens.extent(0) ? std::int64_t(cu_seqlens.extent(0)) - 1 : 0;
  auto starts = Kokkos::View<std::int64_t*, HostSpace>("starts", n);
  auto ends = Kokkos::View<std::int64_t*, HostSpace>("ends", n);
  for (std::int64_t s = 0; s < n; ++s) {
    const std::int64_t a = cu_seqlens(s), b = cu_seqlens(s + 1);
    if (config_member.pooling == Pooling::Cls) {
      starts(s) = a, ends(s) = a + 1;  // the <cls> token
    } else {
      starts(s) = a + 1, ends(s) = std::max(a + 1, b - 1);  // residues only
    }
  }
  starts_member = View1<std::int64_t>("plm::model::task_head::starts", n);
  ends_member = View1<std::int64_t>("plm::model::task_head::ends", n);
  Kokkos::deep_copy(starts_member, starts);
  Kokkos::deep_copy(ends_member, ends);
  pooled_member = View2<T>("plm::model::task_head::pooled", n, h);
  act_member = View2<T>("plm::model::task_head::act", n, h);
  logits_member = View2<T>("plm::model::task_head::logits", n, l);
  auto st = starts_member, en = ends_member;
  auto pooled = pooled_member;
  Kokkos::parallel_for(
      "plm::model::task_head::pool", Kokkos::RangePolicy<ExecSpace>(space, 0, n * h),
      KOKKOS_LAMBDA(const std::int64_t i) {
        const std::int64_t s = i / h, c = i % h;
        T acc = 0;
        for (std::int64_t t = st(s); t < en(s); ++t) acc += hidden(t, c);
        const std::int64_t cnt = en(s) - st(s);
        pooled(s, c) = cnt > 0 ? acc / T(cnt) : T(0);
      });
  auto act = act_member;
  linearForward(space, pooled, weight(0), bias(1), T(0), act);
  Kokkos::parallel_for(
      "plm::model::task_head::tanh", Kokkos::RangePolicy<ExecSpace>(space, 0, n * h),
      KOKKOS_LAMBDA(const std::int64_t i) {
        act(i / h, i % h) = math::libm::tanh(act(i / h, i % h));
      });
  linearForward(space, act, weight(2), bias(3), T(0), logits_member);
  return logits_member;
}

template <class T> void TaskHead<T>::backward(const ExecSpace& space, const View2<T>& hidden,
                                              const View2<T>& dlogits, const View2<T>& dhidden) {
  const std::int64_t h = hidden_member;
  if (config_member.kind == TaskKind::TokenClassification) {
    linearBackward(space, hidden, weight(0), dlogits, T(0), dhidden, weightGrad(0), biasGrad(1));
    return;
  }
  const auto n = static_cast<std::int64_t>(act_member.extent(0));
  View2<T> dact("plm::model::task_head::dact", n, h);
  linearBackward(space, act_member, weight(2), dlogits, T(0), dact, weightGrad(2), biasGrad(3));
  auto act = act_member;
  Kokkos::parallel_for(
      "plm::model::task_head::dtanh", Kokkos::RangePolicy<ExecSpace>(space, 0, n * h),
      KOKKOS_LAMBDA(const std::int64_t i) {
        const T a = act(i / h, i % h);
        dact(i / h, i % h) *= T(1) - a * a;
      });
  View2<T> dpooled;
  if (dhidden.extent(0)) dpooled = View2<T>("plm::model::task_head::dpooled", n, h);
  linearBackward(space, pooled_member, weight(0), dact, T(0), dpooled, weightGrad(0), biasGrad(1));
  if (!dhidden.extent(0)) return;
  Kokkos::deep_copy(space, dhidden, T(0));
  auto st = starts_member, en = ends_member;
  Kokkos::parallel_for(
      "plm::model::task_head::unpool", Kokkos::RangePolicy<ExecSpace>(space, 0, n * h),
      KOKKOS_LAMBDA(const std::int64_t i) {
        const std::int64_t s = i / h, c = i % h;
        const std::int64_t cnt = en(s) - st(s);
        for (std::int64_t t = st(s); t < en(s); ++t) dhidden(t, c) = dpooled(s, c) / T(cnt);
      });
}

TaskLoss taskLoss(TaskKind kind, const std::vector<double>& logits, int num_labels,
                  const std::vector<double>& targets, double scale, std::vector<double>* dlogits) {
  TaskLoss out;
  const std::size_t rows = targets.size();
  PLM_REQUIRE(logits.size() == rows * std::size_t(num_labels), "taskLoss: logits/targets sizes");
  if (dlogits) dlogits->assign(logits.size(), 0.0);
  for (std::size_t r = 0; r < rows; ++r) {
    const double* z = &logits[r * num_labels];
    if (kind == TaskKind::SequenceRegression) {
      if (std::isnan(targets[r])) continue;
      const double d = z[0] - targets[r];
      out.sum += d * d;
      ++out.counted;
      if (dlogits) (*dlogits)[r] = scale * 2 * d;
      continue;
    }
    if (targets[r] < 0) continue;  // -100: no label at this position
    const int y = static_cast<int>(targets[r]);
    PLM_REQUIRE(y < num_labels, "taskLoss: class " + std::to_string(y) + " >= num_labels " +
                                    std::to_string(num_labels));
    const double m = *std::max_element(z, z + num_labels);
    double se = 0;
    for (int c = 0; c < num_labels; ++c) se += std::exp(z[c] - m);
    const double lse = m + std::log(se);
    out.sum += lse - z[y];
    ++out.counted;
    if (dlogits)
      for (int c = 0; c < num_labels; ++c)
        (*dlogits)[r * num_labels + c] = scale * (std::exp(z[c] - lse) - (c == y ? 1.0 : 0.0));
  }
  return out;
}

namespace {
std::vector<double> ranks(const std::vector<double>& x) {
  std::vector<std::size_t> order(x.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](auto a, auto b) { return x[a] < x[b]; });
  std::vector<double> r(x.size());
  for (std::size_t i = 0; i < order.size();) {
    std::size_t j = i;
    while (j + 1 < order.size() && x[order[j + 1]] == x[order[i]]) ++j;
    for (std::size_t k = i; k <= j; ++k) r[order[k]] = 0.5 * double(i + j) + 1;
    i = j + 1;
  }
  return r;
}
}  // namespace

double spearman(const std::vector<double>& x, const std::vector<double>& y) {
  PLM_REQUIRE(x.size() == y.size(), "spearman: sizes differ");
  const auto rx = ranks(x), ry = ranks(y);
  const double n = double(x.size());
  if (n < 2) return 0;
  double mx = 0, my = 0;
  for (std::size_t i = 0; i < x.size(); ++i) mx += rx[i], my += ry[i];
  mx /= n, my /= n;
  double sxy = 0, sxx = 0, syy = 0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    sxy += (rx[i] - mx) * (ry[i] - my);
    sxx += (rx[i] - mx) * (rx[i] - mx);
    syy += (ry[i] - my) * (ry[i] - my);
  }
  return sxx > 0 && syy > 0 ? sxy / std::sqrt(sxx * syy) : 0.0;
}

double auroc(const std::vector<double>& score, const std::vector<int>& positive) {
  PLM_REQUIRE(score.size() == positive.size(), "auroc: sizes differ");
  const auto r = ranks(score);
  double pos = 0, rank_sum = 0;
  for (std::size_t i = 0; i < r.size(); ++i)
    if (positive[i]) pos += 1, rank_sum += r[i];
  const double neg = double(r.size()) - pos;
  if (pos == 0 || neg == 0) return std::numeric_limits<double>::quiet_NaN();
  return (rank_sum - pos * (pos + 1) / 2) / (pos * neg);
}

template class TaskHead<float>;
template class TaskHead<double>;

}  // namespace plm::model
