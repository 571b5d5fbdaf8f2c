// The tensor table: every parameter tensor of an ESM-2 model (dense, MoE, SwiGLU experts), one
// row each, with everything a consumer needs to know about it.  Binding (esm2.cpp), the Hugging
// Face mapping (model/hf_esm.cpp), the planner, parameter counts, gradient buckets, FSDP groups and
// checkpoint expert rows read these rows; none of them parses a tensor's name for its layer or
// expert, or restates the padding rule.
//
// Design choice: a row is also the entry of every table derived from it (an optimizer state's,
// a checkpoint's), so TensorInfo is the row type: a consumer handed any table still reads the
// attributes, and a derived entry (copied, then re-offset or re-shaped) keeps them.
#pragma once

#include "model/moe_config.hpp"

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace plm::model {

struct Esm2Config;

/// \brief `elements` rounded up to a multiple of 16: the alignment of every tensor in the flat
/// buffers and of every run of the packed compute copy (64 bytes of fp32, 32 of bf16), and the
/// leading dimension of FP8 operands (cuBLASLt wants 16-element rows).
constexpr std::int64_t alignedElements(std::int64_t elements) { return (elements + 15) / 16 * 16; }

/// How Esm2::initialize draws a tensor (LoraA: PEFT's kaiming-uniform, bound 1/sqrt(in)).
enum class InitKind : std::uint8_t { Normal, Zero, One, LoraA };

/// The part of the model a tensor belongs to; with TensorRow::layer, the group a sharded model
/// places as one (Esm2::placeRange) and the data-parallel gradient buckets follow.
enum class TensorGroup : std::uint8_t { Embedding, Layer, Head };

/// Where the bf16 policy reads a tensor from (Esm2's bind()): the fp32 masters, or its own run
/// of the packed compute copy (alignedElements of its size), or one run shared with the layer's
/// other q/k/v weights (or biases), stacked as (3H, H) (or 3H).
enum class ComputeCopy : std::uint8_t {
  Master,     // LayerNorms, routers, biases added into the fp32 residual stream
  Packed,     // GEMM weights, biases of bf16-output GEMMs
  PackedFp8,  // the masters, but packed in an FP8 layer on the GPU (the FP8 GEMMs' bf16 bias)
  QkvWeight,  // stacked with the layer's other q/k/v weights
  QkvBias,    // stacked with the layer's other q/k/v biases
};

/// One tensor of the flat parameter (and gradient) buffer.
struct TensorRow {
  std::string name;  // Hugging Face name, e.g. "esm.encoder.layer.0.attention.self.query.weight"
                     // (MoE tensors: plm's documented names, doc/interop.md)
  std::vector<std::int64_t> shape;  // Hugging Face shape (Linear weights are (out, in))
  std::int64_t offset = 0;          // into parameters() / gradients()
  std::int64_t size = 0;            // product of shape
  bool weight_decay = false;        // AdamW decays this tensor (not biases, LayerNorm, embedding)
  TensorGroup group = TensorGroup::Head;
  int layer = -1;   // encoder layer (group Layer), else -1
  int expert = -1;  // the routed expert it belongs to, else -1 (router, shared experts, dense)
  InitKind init = InitKind::Normal;
  std::uint64_t stream = 0;  // its random stream: its index in the whole model's table (LoRA
                             // adapters: 2^40 + their index among the adapters, so the base
                             // tensors draw the same values with or without adapters)
  bool trained = true;       // by gradients (false: the router's balancing bias)
  bool lora = false;         // a LoRA adapter (model/lora.hpp): trains while the base is frozen
  int hf_order = -1;         // its position in transformers' state dict (the model's own order
                             // but lm_head.bias, which the LM head lists before its modules);
                             // -1 for LoRA adapters (merged into their weight on export)
  ComputeCopy copy = ComputeCopy::Master;
  int fp8_gemm = -1;  // the Fp8Gemm whose weight it is (in an FP8 layer), -1 for none

  /// \brief Its placeRange group of a model with `layers` layers: 0..layers-1 the encoder
  /// layers, layers the embeddings, layers + 1 the head.
  int placeGroup(int layers) const {
    return group == TensorGroup::Layer       ? layer
           : group == TensorGroup::Embedding ? layers
                                             : layers + 1;
  }
};
/// The name every consumer already uses for a row (and for an entry derived from one).
using TensorInfo = TensorRow;

/// \brief The tensor table of a model with `config`, without allocating it (planner, optimizer
/// memory): the same entries and offsets as Esm2::tensors() of a model built with `experts`
/// (only the routed experts it holds; the default holds all).  Rows are in buffer order, each
/// at an alignedElements offset; a routed expert the placement does not hold takes no row but
/// keeps its random stream (so every placement draws the same values).
std::vector<TensorRow> tensorTable(const Esm2Config& config, const ExpertPlacement& experts = {});

/// \brief Elements of the flat buffer holding `table` (alignment padding included).
std::int64_t tableElements(const std::vector<TensorRow>& table);

/// \brief The bf16 compute-copy elements each row of `table` takes (bind()'s packing): its
/// alignedElements size when packed, 0 in the masters; a layer's stacked q/k/v weights (and
/// biases) take one aligned run, charged to the first of them.  `fp8_gpu`: FP8 layers on the
/// GPU, whose PackedFp8 rows are packed too.
std::vector<std::int64_t> computeCopyElements(const std::vector<TensorRow>& table,
                                              const Esm2Config& config, bool fp8_gpu);

/// A rank's table with the routed experts it does not hold put back, as files store the model.
struct WholeTable {
  std::vector<TensorInfo> tensors;  // whole-model order; offset into the rank's buffer, or -1
  std::vector<int> local;           // per entry: its index in the rank's table, -1 = not held
};
/// \brief `table` (a rank's tensor table, or one derived from it entry by entry, such as an
/// optimizer state's) with the experts `placement` does not hold inserted where they belong,
/// named by global expert and shaped as the held ones (all experts of a layer have one shape).
/// Identity for a placement that holds every expert.  Throws plm::Error if the held experts'
/// entries are not one contiguous run of equal sets per layer (a bug).
WholeTable wholeTable(const std::vector<TensorInfo>& table, const ExpertPlacement& placement,
                      int experts);
/// One tensor as a file stores it, and the rows of it (dimension 0) one rank writes and reads.
struct TensorRows {
  TensorInfo tensor;  // whole-model name and shape; offset into the rank's buffer, or -1
  std::int64_t first_row = 0, row_count = 0;
  std::int64_t rowSize() const {
    const std::int64_t rows = tensor.shape.empty() ? 1 : tensor.shape[0];
    return rows ? tensor.size / rows : 0;
  }
};
/// \brief The tensors a file stores for ranks holding `placement`'s experts, from rank `rank`'s
/// `table` (wholeTable), with the rows rank `rank` of `world` writes and reads: a tensor every
/// rank holds is split over all ranks (model::rowRange(rows, rank, world)); a routed expert's
/// tensor over the world / degree ranks holding it (the rank / degree-th of them, in rank
/// order); another rank's expert not at all.
std::vector<TensorRows> heldRows(const std::vector<TensorInfo>& table,
                                 const ExpertPlacement& placement, int experts, int rank,
                                 int world);
/// \brief [offset, offset + count) runs of the flat buffer holding routed experts' tensors, one
/// per MoE layer (alignment padding between them included), in buffer order.
std::vector<std::pair<std::int64_t, std::int64_t>> expertRuns(const std::vector<TensorInfo>& table);

}  // namespace plm::model
