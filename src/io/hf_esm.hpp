// Hugging Face `EsmForMaskedLM` interoperability: config.json, the parameter table by Hugging
// Face name, and conversion between a Hugging Face model directory (config.json +
// model.safetensors, or a sharded model.safetensors.index.json) and a plm model file
// (io/model_file.hpp).  doc/interop.md describes the mapping and what is supported.
//
// Design choices: the parameter table here is the *external* contract (what a transformers
// directory holds), computed from the config alone, so converting needs no model instance and
// the model's own tensors() is tested against it.  Conversion is strict: every ESM-2 tensor must
// be present with its exact shape, a config that describes another architecture (ESM-1b's
// absolute positions or emb_layer_norm_before, ESMFold, another vocabulary) is refused with a
// message naming the key, and tensors that plm does not model are either known and reported
// (contact head, rotary/position buffers) or an error.  The contact head is kept in the plm
// file under /hf_extra so that --to-hf gives back what --from-hf read.
#pragma once

#include "io/json.hpp"
#include "model/esm2.hpp"

#include <mpi.h>

#include <string>
#include <vector>

namespace plm::io::hf {

/// \brief The Hugging Face EsmForMaskedLM parameters of `config` (without the tied
/// lm_head.decoder.weight and the non-parameter buffers), in state-dict order, with offsets of
/// one flat buffer and the AdamW decay flag (Linear weights only).
std::vector<model::TensorInfo> esmTensors(const model::Esm2Config& config);

/// \brief Esm2Config from a parsed config.json. Throws plm::Error naming `source` and the key
/// for anything plm does not support; `warnings` receives notes about accepted but ignored
/// settings (nonzero dropout, ...).
model::Esm2Config configFromJson(const json::Value& config, const std::string& source,
                                 std::vector<std::string>* warnings = nullptr);
/// \brief The config.json transformers expects for `config` (EsmConfig fields, architectures
/// ["EsmForMaskedLM"]).
json::Value configToJson(const model::Esm2Config& config);

/// What a conversion did, for the command to report.
struct ConvertSummary {
  model::Esm2Config config;
  std::int64_t num_parameters = 0;
  std::vector<std::string> source_dtypes;  // distinct dtypes read (F32, BF16, F16)
  std::vector<std::string> skipped;        // tensors not converted, with the reason
  std::vector<std::string> warnings;
};

/// \brief Collective over `comm`: reads `hf_dir` (config.json + model.safetensors or
/// model.safetensors.index.json) and writes the plm model file `out`.
ConvertSummary convertFromHf(const std::string& hf_dir, const std::string& out, MPI_Comm comm);

/// \brief Collective over `comm`: reads the plm model file (or checkpoint) `model_file` and
/// writes `out_dir`/config.json and `out_dir`/model.safetensors (F32, lm_head.decoder.weight
/// as a copy of the embedding) from rank 0, creating `out_dir` if needed.
ConvertSummary convertToHf(const std::string& model_file, const std::string& out_dir,
                           MPI_Comm comm);

}  // namespace plm::io::hf
