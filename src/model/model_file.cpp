// plm model file: config attributes + /model/<HF name> tensors written by row ranges.
#include "model/model_file.hpp"

#include "core/error.hpp"
#include "dist/process_groups.hpp"
#include "io/hdf5_group.hpp"

#include <set>

namespace plm::model {

namespace h5 = io::h5;

namespace {

std::string shapeText(const std::vector<std::int64_t>& shape) {
  std::string s = "(";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + ")";
}

using dist::commRank;
using dist::commSize;
}  // namespace

void writeConfigAttributes(hid_t location, const model::Esm2Config& config) {
  h5::writeAttribute(location, "format", std::string(model_format));
  h5::writeAttribute(location, "format_version", model_format_version);
  h5::writeAttribute(location, "architecture", std::string("EsmForMaskedLM"));
  h5::writeAttribute(location, "num_layers", std::int64_t(config.num_layers));
  h5::writeAttribute(location, "hidden", std::int64_t(config.hidden));
  h5::writeAttribute(location, "heads", std::int64_t(config.heads));
  h5::writeAttribute(location, "ffn", std::int64_t(config.ffn));
  h5::writeAttribute(location, "vocab", std::int64_t(config.vocab));
  h5::writeAttribute(location, "max_positions", std::int64_t(config.max_positions));
  h5::writeAttribute(location, "layer_norm_eps", config.layer_norm_eps);
  h5::writeAttribute(location, "token_dropout", std::int64_t(config.token_dropout ? 1 : 0));
  if (config.lora.enabled()) {  // a checkpoint's adapters (model files store merged weights)
    h5::writeAttribute(location, "lora_rank", std::int64_t(config.lora.rank));
    h5::writeAttribute(location, "lora_alpha", config.lora.alpha);
    h5::writeAttribute(location, "lora_targets", model::loraTargetNames(config.lora.targets));
  }
  const auto& moe = config.moe;
  if (!moe.enabled()) return;  // dense files carry no MoE attribute at all
  h5::writeAttribute(location, "moe_experts", std::int64_t(moe.experts));
  h5::writeAttribute(location, "moe_top_k", std::int64_t(moe.top_k));
  h5::writeAttribute(location, "moe_every", std::int64_t(moe.every));
  h5::writeAttribute(location, "moe_expert_ffn", std::int64_t(moe.expert_ffn));
  h5::writeAttribute(location, "moe_shared_experts", std::int64_t(moe.shared_experts));
  h5::writeAttribute(location, "moe_router", std::string(model::routerName(moe.router)));
  h5::writeAttribute(location, "moe_normalize_topk", std::int64_t(moe.normalize_topk ? 1 : 0));
  h5::writeAttribute(location, "moe_capacity_factor", moe.capacity_factor);
  h5::writeAttribute(location, "moe_aux_loss", moe.aux_loss);
  h5::writeAttribute(location, "moe_z_loss", moe.z_loss);
  h5::writeAttribute(location, "moe_seq_aux_loss", moe.seq_aux_loss);
  h5::writeAttribute(location, "moe_bias_balance", std::int64_t(moe.bias_balance ? 1 : 0));
  h5::writeAttribute(location, "moe_bias_rate", moe.bias_rate);
  h5::writeAttribute(location, "moe_expert_activation",
                     std::string(model::expertActivationName(moe.expert_activation)));
}

void writeExtraAttributes(hid_t location, const ModelAttributes& extra) {
  for (const auto& [key, value] : extra.strings) h5::writeAttribute(location, key, value);
  for (const auto& [key, value] : extra.integers) h5::writeAttribute(location, key, value);
  for (const auto& [key, value] : extra.numbers) h5::writeAttribute(location, key, value);
}

model::Esm2Config readConfigAttributes(hid_t location, const std::string& path) {
  if (!h5::hasAttribute(location, "format") ||
      h5::readStringAttribute(location, "format") != model_format)
    throw Error("`" + path + "` is not a plm model file (no attribute format = \"" + model_format +
                "\"); convert a Hugging Face model with `plm convert --from-hf DIR --out FILE.h5`");
  const std::int64_t version = h5::readIntAttribute(location, "format_version");
  if (version > model_format_version)
    throw Error("`" + path + "` has model format version " + std::to_string(version) +
                ", newer than this plm (" + std::to_string(model_format_version) +
                "); use a newer plm");
  model::Esm2Config config;
  auto readInt = [&](const char* name) {
    if (!h5::hasAttribute(location, name))
      throw Error("`" + path + "` lacks the model attribute `" + name +
                  "` (incomplete or damaged file)");
    return static_cast<int>(h5::readIntAttribute(location, name));
  };
  config.num_layers = readInt("num_layers");
  config.hidden = readInt("hidden");
  config.heads = readInt("heads");
  config.ffn = readInt("ffn");
  config.vocab = readInt("vocab");
  config.max_positions = readInt("max_positions");
  config.token_dropout = readInt("token_dropout") != 0;
  config.layer_norm_eps = h5::readDoubleAttribute(location, "layer_norm_eps");
  if (h5::hasAttribute(location, "lora_rank")) {  // a checkpoint with LoRA adapters
    config.lora.rank = readInt("lora_rank");
    config.lora.alpha = h5::readDoubleAttribute(location, "lora_alpha");
    config.lora.targets =
        model::parseLoraTargets(h5::readStringAttribute(location, "lora_targets"));
  }
  if (h5::hasAttribute(location, "moe_experts")) {  // a Mixture-of-Experts model (doc/model.md)
    auto& moe = config.moe;
    moe.experts = readInt("moe_experts");
    moe.top_k = readInt("moe_top_k");
    moe.every = readInt("moe_every");
    moe.expert_ffn = readInt("moe_expert_ffn");
    moe.shared_experts = readInt("moe_shared_experts");
    moe.router = model::parseRouter(h5::readStringAttribute(location, "moe_router"));
    moe.normalize_topk = readInt("moe_normalize_topk") != 0;
    moe.capacity_factor = h5::readDoubleAttribute(location, "moe_capacity_factor");
    moe.aux_loss = h5::readDoubleAttribute(location, "moe_aux_loss");
    moe.z_loss = h5::readDoubleAttribute(location, "moe_z_loss");
    if (h5::hasAttribute(location, "moe_seq_aux_loss"))
      moe.seq_aux_loss = h5::readDoubleAttribute(location, "moe_seq_aux_loss");
    moe.bias_balance = readInt("moe_bias_balance") != 0;
    moe.bias_rate = h5::readDoubleAttribute(location, "moe_bias_rate");
    if (h5::hasAttribute(location, "moe_expert_activation"))  // absent: GELU experts
      moe.expert_activation =
          model::parseExpertActivation(h5::readStringAttribute(location, "moe_expert_activation"));
  }
  return config;
}

std::pair<std::int64_t, std::int64_t> rowRange(std::int64_t rows, int rank, int world) {
  return {rows * rank / world, rows * (rank + 1) / world};
}

void writeTensorRows(hid_t file, const std::string& group,
                     const std::vector<model::TensorRows>& rows, const float* values,
                     bool independent) {
  h5::Hid g = h5::exists(file, group)
                  ? h5::Hid(PLM_CHECK_H5(H5Gopen2(file, group.c_str(), H5P_DEFAULT)))
                  : h5::createGroup(file, group);
  for (const auto& r : rows) {
    h5::Hid dataset = h5::createDataset<float>(g, r.tensor.name, r.tensor.shape);
    if (independent && r.row_count == 0) continue;  // nothing to write, no collective to join
    const float* from =
        r.row_count > 0 ? values + r.tensor.offset + r.first_row * r.rowSize() : values;
    h5::writeRows<float>(dataset, r.first_row, r.row_count, from, independent);
  }
}

void writeTensorGroup(hid_t file, MPI_Comm comm, const std::string& group,
                      const std::vector<model::TensorInfo>& tensors, const float* values,
                      bool independent) {
  const int rank = commRank(comm), world = commSize(comm);
  std::vector<model::TensorRows> rows;
  for (const auto& t : tensors) {
    auto [first, last] = rowRange(t.shape.empty() ? 1 : t.shape[0], rank, world);
    rows.push_back({t, first, last - first});
  }
  writeTensorRows(file, group, rows, values, independent);
}

void readTensorGroup(hid_t file, MPI_Comm /*comm*/, const std::string& group,
                     const std::vector<model::TensorInfo>& tensors, float* values,
                     const std::string& path) {
  if (!h5::exists(file, group))
    throw Error("`" + path + "` has no group /" + group + " (not a plm model file?)");
  h5::Hid g(PLM_CHECK_H5(H5Gopen2(file, group.c_str(), H5P_DEFAULT)));
  std::set<std::string> known;
  for (const auto& t : tensors) {
    known.insert(t.name);
    if (!h5::exists(g, t.name))
      throw Error("`" + path + "` lacks /" + group + "/" + t.name +
                  "; the file was written for another model configuration or is incomplete");
    h5::Hid dataset = h5::openDataset(g, t.name);
    auto shape = h5::datasetShape(dataset);
    if (shape != t.shape)
      throw Error("`" + path + "`: /" + group + "/" + t.name + " has shape " + shapeText(shape) +
                  ", the model expects " + shapeText(t.shape));
  }
  for (const auto& name : h5::groupMembers(g))
    if (!known.count(name))
      throw Error("`" + path + "`: /" + group + "/" + name +
                  " is not a parameter of this model (another architecture or configuration?)");
  for (const auto& t : tensors) {
    h5::Hid dataset = h5::openDataset(g, t.name);
    const std::int64_t rows = t.shape.empty() ? 1 : t.shape[0];
    h5::readRows<float>(dataset, 0, rows, values + t.offset);
  }
}

void writeModelFile(const std::string& path, MPI_Comm comm, const model::Esm2Config& config,
                    const std::vector<model::TensorInfo>& tensors, const float* values,
                    const ModelAttributes& extra) {
  h5::Hid file = h5::createFile(path, comm);
  writeConfigAttributes(file, config);
  writeExtraAttributes(file, extra);
  writeTensorGroup(file, comm, "model", tensors, values);
}

void writeModelFile(const std::string& path, MPI_Comm comm, const model::Esm2Config& config,
                    const std::vector<model::TensorRows>& rows, const float* values,
                    const ModelAttributes& extra) {
  h5::Hid file = h5::createFile(path, comm);
  writeConfigAttributes(file, config);
  writeExtraAttributes(file, extra);
  writeTensorRows(file, "model", rows, values);
}

model::Esm2Config readModelConfig(const std::string& path) {
  h5::Hid file = h5::openFileSerial(path);
  return readConfigAttributes(file, path);
}

void readModelValues(const std::string& path, MPI_Comm comm, const model::Esm2Config& config,
                     const std::vector<model::TensorInfo>& tensors, float* values) {
  h5::Hid file = h5::openFile(path, comm);
  model::Esm2Config stored = readConfigAttributes(file, path);
  if (stored.num_layers != config.num_layers || stored.hidden != config.hidden ||
      stored.heads != config.heads || stored.ffn != config.ffn || stored.vocab != config.vocab)
    throw Error("`" + path + "` holds a model with layers " + std::to_string(stored.num_layers) +
                ", hidden " + std::to_string(stored.hidden) + ", heads " +
                std::to_string(stored.heads) + ", ffn " + std::to_string(stored.ffn) + ", vocab " +
                std::to_string(stored.vocab) + "; the model being loaded has layers " +
                std::to_string(config.num_layers) + ", hidden " + std::to_string(config.hidden) +
                ", heads " + std::to_string(config.heads) + ", ffn " + std::to_string(config.ffn) +
                ", vocab " + std::to_string(config.vocab) +
                " (build the model from readModelConfig(file))");
  readTensorGroup(file, comm, "model", tensors, values, path);
}

}  // namespace plm::model
