// Hugging Face `EsmForMaskedLM` interoperability: config.json, the parameter table by Hugging
// Face name, and conversion between a Hugging Face model directory (config.json +
// model.safetensors, or a sharded model.safetensors.index.json) and a plm model file
// (model/model_file.hpp).  doc/interop.md describes the mapping and what is supported.
//
// Design choices: the names, shapes and state-dict order come from the tensor table's rows
// (model::tensorTable: TensorRow::name is the Hugging Face name, hf_order its position), so a
// tensor is added in one place and converting needs no model instance.  Conversion is strict: every
// ESM-2 tensor must be present with its exact shape, a config that describes another architecture
// (ESM-1b's absolute positions or emb_layer_norm_before, ESMFold, another vocabulary) is refused
// with a message naming the key, and tensors that plm does not model are either known and reported
// (contact head, rotary/position buffers) or an error.  The contact head is kept in the plm
// file under /hf_extra so that --to-hf gives back what --from-hf read.
#pragma once

#include "io/json.hpp"
#include "io/safetensors.hpp"
#include "model/esm2.hpp"

#include <mpi.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace plm::model::hf {

/// \brief The Hugging Face EsmForMaskedLM parameters of `config` (without the tied
/// lm_head.decoder.weight, the non-parameter buffers and LoRA adapters): the rows of
/// model::tensorTable(config) in state-dict order (TensorRow::hf_order), re-offset into one
/// unpadded flat buffer (the safetensors layout).
std::vector<model::TensorInfo> esmTensors(const model::Esm2Config& config);

/// model_type of the documented plm format for Mixture-of-Experts models (doc/interop.md):
/// EsmConfig's fields plus a "plm_moe" object, safetensors under plm's own tensor names.
inline constexpr const char* moe_model_type = "plm-esm2-moe";

/// \brief Esm2Config from a parsed config.json. Throws plm::Error naming `source` and the key
/// for anything plm does not support; `warnings` receives notes about accepted but ignored
/// settings (nonzero dropout, ...).  `any_esm_head`: accept any ESM architecture listed
/// (EsmModel, EsmForSequenceClassification, ...; model.init_from loads their encoder), not only
/// EsmForMaskedLM.
model::Esm2Config configFromJson(const io::json::Value& config, const std::string& source,
                                 std::vector<std::string>* warnings = nullptr,
                                 bool any_esm_head = false);
/// \brief configFromJson of the file `config_json` (a model directory's config.json).
model::Esm2Config readConfigFile(const std::string& config_json,
                                 std::vector<std::string>* warnings = nullptr,
                                 bool any_esm_head = false);
/// \brief The config.json transformers expects for `config` (EsmConfig fields, architectures
/// ["EsmForMaskedLM"]); an MoE model gets plm's format (moe_model_type).  `torch_dtype` names
/// the stored dtype ("float32", "bfloat16").
io::json::Value configToJson(const model::Esm2Config& config,
                             const std::string& torch_dtype = "float32");

/// \brief The tokenizer files of the ESM-2 vocabulary as transformers' EsmTokenizer reads them:
/// file name -> contents (vocab.txt, tokenizer_config.json, special_tokens_map.json).
/// `model_max_length` is the tokens a sequence may have (max_position_embeddings - 2).
std::map<std::string, std::string> tokenizerFiles(std::int64_t model_max_length);

/// \brief The tensors of a Hugging Face model by canonical name (transformers 5's legacy
/// LayerNorm gamma/beta read as weight/bias): a directory (model.safetensors or a sharded
/// model.safetensors.index.json), an index file, or one .safetensors file.  Tensors are read
/// one at a time, or a row range of one, so a large model is never held whole.
class Weights {
 public:
  /// \brief Opens and validates every file; throws plm::Error naming the file and the problem.
  explicit Weights(const std::string& path);
  std::vector<std::string> names() const;  // canonical names, sorted
  bool has(const std::string& name) const { return where_member.count(name) > 0; }
  const io::safetensors::TensorEntry& entry(const std::string& name) const;
  /// \brief "`file` tensor \"stored name\"", for messages.
  std::string describe(const std::string& name) const;
  std::vector<float> read(const std::string& name) const;
  /// \brief Rows [first_row, first_row + row_count) of dimension 0, widened to fp32.
  std::vector<float> readRows(const std::string& name, std::int64_t first_row,
                              std::int64_t row_count) const;

 private:
  std::vector<std::unique_ptr<io::safetensors::Reader>> readers_member;
  std::map<std::string, std::pair<std::size_t, std::string>> where_member;  // -> reader, stored
};

/// What a conversion did, for the command to report.
struct ConvertSummary {
  model::Esm2Config config;
  std::int64_t num_parameters = 0;
  std::vector<std::string> source_dtypes;  // distinct dtypes read (F32, BF16, F16)
  std::vector<std::string> skipped;        // tensors not converted, with the reason
  std::vector<std::string> warnings;
};

/// \brief Collective over `comm`: reads `hf_dir` (config.json + model.safetensors or
/// model.safetensors.index.json; an EsmForMaskedLM or plm's MoE format) and writes the plm
/// model file `out`.  Dense models are read in esmTensors' order; an MoE model in plm's format
/// under its own table (model::tensorTable, experts by name).
ConvertSummary convertFromHf(const std::string& hf_dir, const std::string& out, MPI_Comm comm);

/// How `--to-hf` stores the weights.
struct ExportOptions {
  std::string dtype = "F32";  // "F32" or "BF16" (rounded to nearest even)
  // Above this many bytes of tensor data the weights are split into
  // model-0000i-of-0000n.safetensors files with a model.safetensors.index.json, as
  // transformers' save_pretrained does (its default limit is 5 GB).
  std::int64_t max_shard_bytes = 5'000'000'000;
  // A task head written by `plm train` with task.kind set (<run_dir>/head.h5): its tensors
  // join the weights under their Hugging Face names and config.json names the matching class
  // (EsmForSequenceClassification / EsmForTokenClassification, num_labels, id2label, and
  // problem_type regression for one output).  Mean pooling has no Hugging Face class: refused.
  std::string head;
};

/// \brief "5GB", "500MB", "1.5GiB", "1000000" (bytes) -> bytes (as save_pretrained's
/// max_shard_size: GB = 10^9, GiB = 2^30); a plm::Error for anything else.
std::int64_t parseByteSize(const std::string& text);

/// \brief Collective over `comm`: reads the plm model file (or checkpoint) `model_file` and
/// writes, from rank 0, `out_dir`/config.json, the tokenizer files and the weights
/// (model.safetensors, or shards and model.safetensors.index.json above
/// options.max_shard_bytes; lm_head.decoder.weight as a copy of the embedding), creating
/// `out_dir` if needed.  A Mixture-of-Experts model is written in plm's documented format
/// (moe_model_type), which transformers does not load; a checkpoint's LoRA adapters are merged
/// into their weights (model::mergeLora).
ConvertSummary convertToHf(const std::string& model_file, const std::string& out_dir, MPI_Comm comm,
                           const ExportOptions& options = {});

}  // namespace plm::model::hf
