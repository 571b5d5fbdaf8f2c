// Task heads for fine-tuning (deck section `task`, doc/finetune.md): Hugging Face's
// EsmForSequenceClassification head (EsmClassificationHead: h[<cls>] -> dense(H, H) -> tanh ->
// out_proj(H, num_labels)) and EsmForTokenClassification's (Linear(H, num_labels) per token),
// on the encoder's last_hidden_state (after emb_layer_norm_after) of a packed (THD) micro-batch.
// Dropout is not applied (HF's eval mode).  Mean pooling (plm's extra) averages a sequence's
// residue tokens, <cls> and <eos> excluded.
//
// Accumulation rule: parameter gradients accumulate (+=) until zeroGradients(); logits and the
// hidden-state gradient are written (=).  Losses are sums (not means), as Esm2's cross-entropy
// is, so the trainer normalises by the global count of labelled rows.
#pragma once

#include "core/types.hpp"

#include <cstdint>
#include <string>
#include <vector>

namespace plm::model {

enum class TaskKind { Mlm, SequenceRegression, SequenceClassification, TokenClassification };
enum class Pooling { Cls, Mean };

/// \brief "mlm", "sequence_regression", ... (the deck's spelling); throws plm::Error otherwise.
TaskKind parseTaskKind(const std::string& text);
const char* taskKindName(TaskKind kind);
Pooling parsePooling(const std::string& text);
inline bool sequenceLevel(TaskKind kind) {
  return kind == TaskKind::SequenceRegression || kind == TaskKind::SequenceClassification;
}

struct TaskConfig {
  TaskKind kind = TaskKind::Mlm;
  int num_labels = 1;  // outputs of the head (1 for regression)
  Pooling pooling = Pooling::Cls;
  /// \brief Throws a plm::Error naming the key for an inconsistent setting (regression with
  /// num_labels != 1, classification with fewer than 2 classes, mean pooling for tokens).
  void validate() const;
};

/// One head tensor: its Hugging Face name and shape, and where it sits in the head's buffer.
struct HeadTensor {
  std::string name;
  std::vector<std::int64_t> shape;
  std::int64_t offset = 0;
};

template <class T> class TaskHead {
 public:
  TaskHead(const TaskConfig& config, int hidden);
  const TaskConfig& config() const { return config_member; }
  const std::vector<HeadTensor>& tensors() const { return tensors_member; }
  View1<T> parameters() const { return params_member; }  // (elements of all tensors)
  View1<T> gradients() const { return grads_member; }    // same layout
  /// \brief HF's _init_weights: Linear weights normal(0, 0.02), biases 0.
  void initialize(std::uint64_t seed);
  void zeroGradients();

  /// \brief Logits (rows, num_labels): rows = sequences (sequence tasks) or tokens.
  /// `hidden` (T, H); `cu_seqlens` (n+1) on the host.  Keeps what backward needs.
  View2<T> forward(const ExecSpace& space, const View2<T>& hidden,
                   const HostView1<seqlen_t>& cu_seqlens);
  /// \brief gradients += d/dparams of sum(dlogits . logits); dhidden (T, H) written when not
  /// empty (zero where the head reads nothing).  After forward() on the same inputs.
  void backward(const ExecSpace& space, const View2<T>& hidden, const View2<T>& dlogits,
                const View2<T>& dhidden);

 private:
  TaskConfig config_member;
  int hidden_member;
  std::vector<HeadTensor> tensors_member;
  View1<T> params_member, grads_member;
  View1<std::int64_t> starts_member, ends_member;  // (n) pooled token range per sequence
  View2<T> pooled_member;                          // (n, H) pooled hidden states
  View2<T> act_member;                             // (n, H) tanh(dense(pooled))
  View2<T> logits_member;                          // (rows, L)
  View2<T> weight(int i) const;
  View1<T> bias(int i) const;
  View2<T> weightGrad(int i) const;
  View1<T> biasGrad(int i) const;
};

/// Loss of one micro-batch's logits (host, double).  `targets`: per row, a value (regression)
/// or a class (classification; -100 = no label, skipped).  Returns the summed loss and writes
/// dlogits = scale * dloss/dlogits; `counted` = rows with a label.
struct TaskLoss {
  double sum = 0;
  std::int64_t counted = 0;
};
TaskLoss taskLoss(TaskKind kind, const std::vector<double>& logits, int num_labels,
                  const std::vector<double>& targets, double scale, std::vector<double>* dlogits);

/// Spearman's rank correlation (average ranks for ties); 0 when either side is constant.
double spearman(const std::vector<double>& x, const std::vector<double>& y);
/// Area under the ROC curve of `score` for `positive` (Mann-Whitney U, ties count half); NaN
/// without both classes.
double auroc(const std::vector<double>& score, const std::vector<int>& positive);

}  // namespace plm::model
