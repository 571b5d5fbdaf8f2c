// Hugging Face EsmForMaskedLM <-> plm model file.
#include "io/hf_esm.hpp"

#include "core/error.hpp"
#include "dist/process_groups.hpp"
#include "io/hdf5.hpp"
#include "io/model_file.hpp"
#include "io/safetensors.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <set>
#include <sstream>

namespace plm::io::hf {

namespace fs = std::filesystem;

namespace {

// The ESM-2 vocabulary in id order (doc/anchors.md §1), as config.json's optional vocab_list has
// it.
const std::vector<std::string>& esmVocabulary() {
  static const std::vector<std::string> tokens = {
      "<cls>", "<pad>", "<eos>", "<unk>", "L", "A", "G", "V", "S", "E",        "R",
      "T",     "I",     "D",     "P",     "K", "Q", "N", "F", "Y", "M",        "H",
      "W",     "C",     "X",     "B",     "U", "Z", "O", ".", "-", "<null_1>", "<mask>"};
  return tokens;
}

const char* extra_group = "hf_extra";
// The rotary frequencies of a Hugging Face source, kept once in /hf_extra under this name.
const char* inv_freq_name = "rotary_embeddings.inv_freq";

std::string readText(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error("cannot read `" + path + "`: " + std::strerror(errno));
  std::ostringstream os;
  os << in.rdbuf();
  return os.str();
}

std::string shapeText(const std::vector<std::int64_t>& shape) {
  std::string s = "(";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + ")";
}

// transformers 5 saves the LayerNorms named "LayerNorm" under their legacy (BERT/TF) names.
std::string canonicalName(const std::string& name) {
  auto replaceSuffix = [&](const std::string& from, const std::string& to) -> std::string {
    if (name.size() >= from.size() &&
        name.compare(name.size() - from.size(), from.size(), from) == 0)
      return name.substr(0, name.size() - from.size()) + to;
    return "";
  };
  std::string r = replaceSuffix("LayerNorm.gamma", "LayerNorm.weight");
  if (!r.empty()) return r;
  r = replaceSuffix("LayerNorm.beta", "LayerNorm.bias");
  if (!r.empty()) return r;
  return name;
}

bool endsWith(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

bool startsWith(const std::string& s, const std::string& prefix) {
  return s.compare(0, prefix.size(), prefix) == 0;
}

using dist::commRank;
// The safetensors files of a model directory and which file holds each tensor.
struct WeightFiles {
  std::vector<std::unique_ptr<safetensors::Reader>> readers;
  std::map<std::string, std::pair<std::size_t, std::string>>
      where;  // canonical name -> (reader, stored name)
};

WeightFiles openWeights(const fs::path& dir) {
  WeightFiles w;
  auto addReader = [&](const fs::path& file) {
    w.readers.push_back(std::make_unique<safetensors::Reader>(file.string()));
    const std::size_t index = w.readers.size() - 1;
    for (const auto& t : w.readers.back()->tensors()) {
      const std::string name = canonicalName(t.name);
      if (w.where.count(name))
        throw Error("`" + file.string() + "`: tensor \"" + t.name +
                    "\" appears twice in the model directory");
      w.where[name] = {index, t.name};
    }
  };
  const fs::path single = dir / "model.safetensors";
  const fs::path index = dir / "model.safetensors.index.json";
  if (fs::exists(single)) {
    addReader(single);
  } else if (fs::exists(index)) {
    json::Value root = json::parse(readText(index.string()), index.string());
    if (!root.has("weight_map") || !root.at("weight_map").isObject())
      throw Error("`" + index.string() + "` has no \"weight_map\" object");
    std::set<std::string> files;
    for (const auto& [name, file] : root.at("weight_map").members()) {
      (void)name;
      if (!file.isString())
        throw Error("`" + index.string() + "`: weight_map values must be file names");
      files.insert(file.asString());
    }
    for (const auto& file : files) addReader(dir / file);
  } else if (fs::exists(dir / "pytorch_model.bin")) {
    throw Error(
        "`" + dir.string() +
        "` has only pytorch_model.bin (a Python pickle), which plm does not read; re-save it as "
        "safetensors with transformers: "
        "EsmForMaskedLM.from_pretrained(DIR).save_pretrained(NEW_DIR)");
  } else {
    throw Error("`" + dir.string() +
                "` has neither model.safetensors nor model.safetensors.index.json");
  }
  return w;
}

}  // namespace

std::vector<model::TensorInfo> esmTensors(const model::Esm2Config& c) {
  std::vector<model::TensorInfo> t;
  std::int64_t offset = 0;
  auto add = [&](const std::string& name, std::vector<std::int64_t> shape, bool decay) {
    model::TensorInfo info;
    info.name = name;
    info.shape = std::move(shape);
    info.size = 1;
    for (auto d : info.shape) info.size *= d;
    info.offset = offset;
    info.weight_decay = decay;
    offset += info.size;
    t.push_back(std::move(info));
  };
  const std::int64_t H = c.hidden, F = c.ffn, V = c.vocab;
  add("esm.embeddings.word_embeddings.weight", {V, H}, false);
  for (int l = 0; l < c.num_layers; ++l) {
    const std::string p = "esm.encoder.layer." + std::to_string(l) + ".";
    for (const char* proj : {"query", "key", "value"}) {
      add(p + "attention.self." + proj + ".weight", {H, H}, true);
      add(p + "attention.self." + proj + ".bias", {H}, false);
    }
    add(p + "attention.output.dense.weight", {H, H}, true);
    add(p + "attention.output.dense.bias", {H}, false);
    add(p + "attention.LayerNorm.weight", {H}, false);
    add(p + "attention.LayerNorm.bias", {H}, false);
    add(p + "intermediate.dense.weight", {F, H}, true);
    add(p + "intermediate.dense.bias", {F}, false);
    add(p + "output.dense.weight", {H, F}, true);
    add(p + "output.dense.bias", {H}, false);
    add(p + "LayerNorm.weight", {H}, false);
    add(p + "LayerNorm.bias", {H}, false);
  }
  add("esm.encoder.emb_layer_norm_after.weight", {H}, false);
  add("esm.encoder.emb_layer_norm_after.bias", {H}, false);
  add("lm_head.bias", {V}, false);
  add("lm_head.dense.weight", {H, H}, true);
  add("lm_head.dense.bias", {H}, false);
  add("lm_head.layer_norm.weight", {H}, false);
  add("lm_head.layer_norm.bias", {H}, false);
  return t;
}

model::Esm2Config configFromJson(const json::Value& j, const std::string& source,
                                 std::vector<std::string>* warnings) {
  if (!j.isObject()) throw Error(source + ": config.json is not a JSON object");
  auto unsupported = [&](const std::string& key, const std::string& found, const std::string& why) {
    return Error(source + ": " + key + " = " + found + " is not supported: " + why);
  };
  auto text = [](const json::Value& v) { return json::write(v); };
  auto isSet = [&](const char* key) { return j.has(key) && !j.at(key).isNull(); };

  if (!j.has("model_type") || !j.at("model_type").isString() ||
      j.at("model_type").asString() != "esm")
    throw Error(source + ": model_type is " +
                (j.has("model_type") ? text(j.at("model_type")) : "missing") +
                "; plm converts Hugging Face ESM models (model_type \"esm\", EsmForMaskedLM)");
  if (isSet("architectures")) {
    bool masked_lm = false;
    std::string listed;
    for (const auto& a : j.at("architectures").items()) {
      listed += (listed.empty() ? "" : ", ") + (a.isString() ? a.asString() : text(a));
      if (a.isString() && a.asString() == "EsmForMaskedLM") masked_lm = true;
    }
    if (!masked_lm)
      throw unsupported("architectures", "[" + listed + "]",
                        "plm converts EsmForMaskedLM (ESM-2 with its language-model head) only");
  }
  if (isSet("is_folding_model") && j.at("is_folding_model").asBool())
    throw unsupported("is_folding_model", "true", "ESMFold is not an ESM-2 masked language model");
  if (isSet("is_decoder") && j.at("is_decoder").asBool())
    throw unsupported("is_decoder", "true", "ESM-2 is a bidirectional encoder");
  if (isSet("add_cross_attention") && j.at("add_cross_attention").asBool())
    throw unsupported("add_cross_attention", "true", "ESM-2 has no cross-attention");
  const std::string position =
      isSet("position_embedding_type") ? j.at("position_embedding_type").asString() : "absolute";
  if (position != "rotary")
    throw unsupported("position_embedding_type", "\"" + position + "\"",
                      "plm implements ESM-2's rotary positions (absolute positions are ESM-1b)");
  if (isSet("emb_layer_norm_before") && j.at("emb_layer_norm_before").asBool())
    throw unsupported("emb_layer_norm_before", "true",
                      "ESM-2 has no LayerNorm before the encoder (that is ESM-1b)");
  if (isSet("hidden_act") && j.at("hidden_act").asString() != "gelu")
    throw unsupported("hidden_act", text(j.at("hidden_act")),
                      "ESM-2 uses the exact (erf) GELU, \"gelu\"");
  if (isSet("tie_word_embeddings") && !j.at("tie_word_embeddings").asBool())
    throw unsupported("tie_word_embeddings", "false",
                      "plm ties the LM decoder to the word embedding, as ESM-2 does");
  if (isSet("rope_theta") && j.at("rope_theta").asDouble() != 10000.0)
    throw unsupported("rope_theta", text(j.at("rope_theta")), "ESM-2's rotary base is 10000");
  if (isSet("rope_scaling"))
    throw unsupported("rope_scaling", text(j.at("rope_scaling")),
                      "ESM-2 uses unscaled rotary positions");

  auto positiveInt = [&](const char* key) {
    if (!j.has(key)) throw Error(source + ": " + key + " is missing");
    const auto& v = j.at(key);
    if (!v.isInteger() || v.asInt() <= 0 || v.asInt() > (1 << 30))
      throw Error(source + ": " + key + " = " + text(v) + " must be a positive integer");
    return static_cast<int>(v.asInt());
  };
  model::Esm2Config c;
  c.vocab = positiveInt("vocab_size");
  if (c.vocab != 33)
    throw unsupported("vocab_size", std::to_string(c.vocab),
                      "ESM-2's vocabulary has 33 tokens (doc/anchors.md)");
  if (isSet("pad_token_id") && j.at("pad_token_id").asInt() != 1)
    throw unsupported("pad_token_id", text(j.at("pad_token_id")), "ESM-2's <pad> is token 1");
  if (isSet("mask_token_id") && j.at("mask_token_id").asInt() != 32)
    throw unsupported("mask_token_id", text(j.at("mask_token_id")), "ESM-2's <mask> is token 32");
  if (isSet("vocab_list")) {
    const auto& list = j.at("vocab_list").items();
    bool same = list.size() == esmVocabulary().size();
    for (std::size_t i = 0; same && i < list.size(); ++i)
      same = list[i].isString() && list[i].asString() == esmVocabulary()[i];
    if (!same)
      throw unsupported("vocab_list", "(a custom vocabulary)",
                        "plm uses the ESM-2 vocabulary in its order");
  }
  c.num_layers = positiveInt("num_hidden_layers");
  c.hidden = positiveInt("hidden_size");
  c.heads = positiveInt("num_attention_heads");
  c.ffn = positiveInt("intermediate_size");
  c.max_positions =
      j.has("max_position_embeddings") ? positiveInt("max_position_embeddings") : 1026;
  if (c.hidden % c.heads != 0 || (c.hidden / c.heads) % 2 != 0)
    throw Error(source + ": hidden_size " + std::to_string(c.hidden) +
                " must be a multiple of num_attention_heads " + std::to_string(c.heads) +
                " with an even head size (rotary)");
  c.layer_norm_eps =
      isSet("layer_norm_eps") ? j.at("layer_norm_eps").asDouble() : 1e-12;  // EsmConfig's default
  if (!(c.layer_norm_eps > 0)) throw Error(source + ": layer_norm_eps must be positive");
  // EsmConfig defaults token_dropout to false; ESM-2 checkpoints set it true.
  c.token_dropout = isSet("token_dropout") ? j.at("token_dropout").asBool() : false;
  for (const char* key : {"hidden_dropout_prob", "attention_probs_dropout_prob"}) {
    if (isSet(key) && j.at(key).asDouble() != 0.0 && warnings)
      warnings->push_back(std::string(key) + " = " + text(j.at(key)) +
                          " ignored: plm has no dropout (ESM-2 trains without it)");
  }
  if (!c.token_dropout && warnings)
    warnings->push_back(
        "token_dropout is false: plm will not rescale embeddings around <mask> tokens");
  return c;
}

json::Value configToJson(const model::Esm2Config& c) {
  json::Value j = json::Value::object();
  json::Value architectures = json::Value::array();
  architectures.push("EsmForMaskedLM");
  j.set("architectures", std::move(architectures));
  j.set("attention_probs_dropout_prob", 0.0);
  j.set("classifier_dropout", nullptr);
  j.set("emb_layer_norm_before", false);
  j.set("esmfold_config", nullptr);
  j.set("hidden_act", "gelu");
  j.set("hidden_dropout_prob", 0.0);
  j.set("hidden_size", c.hidden);
  j.set("initializer_range", 0.02);
  j.set("intermediate_size", c.ffn);
  j.set("is_folding_model", false);
  j.set("layer_norm_eps", c.layer_norm_eps);
  j.set("mask_token_id", 32);
  j.set("max_position_embeddings", c.max_positions);
  j.set("model_type", "esm");
  j.set("num_attention_heads", c.heads);
  j.set("num_hidden_layers", c.num_layers);
  j.set("pad_token_id", 1);
  j.set("position_embedding_type", "rotary");
  j.set("tie_word_embeddings", true);
  j.set("token_dropout", c.token_dropout);
  j.set("torch_dtype", "float32");
  j.set("use_cache", true);
  j.set("vocab_list", nullptr);
  j.set("vocab_size", c.vocab);
  return j;
}

ConvertSummary convertFromHf(const std::string& hf_dir, const std::string& out, MPI_Comm comm) {
  const fs::path dir(hf_dir);
  if (!fs::is_directory(dir))
    throw Error("`" + hf_dir +
                "` is not a directory; --from-hf takes a transformers model directory "
                "(config.json + model.safetensors)");
  const fs::path config_path = dir / "config.json";
  if (!fs::exists(config_path))
    throw Error("`" + config_path.string() +
                "` not found; --from-hf takes a transformers model directory "
                "(config.json + model.safetensors)");
  ConvertSummary summary;
  summary.config = configFromJson(json::parse(readText(config_path.string()), config_path.string()),
                                  config_path.string(), &summary.warnings);
  const auto tensors = esmTensors(summary.config);
  WeightFiles weights = openWeights(dir);
  auto describe = [&](const std::string& name) {
    const auto& [reader, stored] = weights.where.at(name);
    return "`" + weights.readers[reader]->path() + "` tensor \"" + stored + "\"";
  };
  auto entry = [&](const std::string& name) -> const safetensors::TensorEntry& {
    const auto& [reader, stored] = weights.where.at(name);
    return weights.readers[reader]->tensor(stored);
  };
  auto read = [&](const std::string& name) {
    const auto& [reader, stored] = weights.where.at(name);
    return weights.readers[reader]->readFloat(stored);
  };

  std::vector<float> values(std::size_t(tensors.back().offset + tensors.back().size));
  std::set<std::string> dtypes, used;
  for (const auto& t : tensors) {
    if (!weights.where.count(t.name))
      throw Error("`" + hf_dir + "` lacks the tensor \"" + t.name +
                  "\" that an EsmForMaskedLM with " + std::to_string(summary.config.num_layers) +
                  " layers has (incomplete or another architecture)");
    const auto& e = entry(t.name);
    if (e.shape != t.shape)
      throw Error(describe(t.name) + " has shape " + shapeText(e.shape) +
                  " but config.json implies " + shapeText(t.shape));
    auto data = read(t.name);
    std::copy(data.begin(), data.end(), values.begin() + t.offset);
    dtypes.insert(e.dtype);
    used.insert(t.name);
  }

  // Tensors that are not plm parameters: known ones are checked or kept, anything else is an error.
  std::vector<model::TensorInfo> extra_tensors;
  std::vector<float> extra_values;
  std::vector<std::string> unknown;
  const auto& embedding = tensors.front();
  auto addExtra = [&](const std::string& stored_as, const std::string& name) {
    model::TensorInfo info;
    info.name = stored_as;
    info.shape = entry(name).shape;
    info.size = entry(name).numel();
    info.offset = std::int64_t(extra_values.size());
    auto data = read(name);
    extra_values.insert(extra_values.end(), data.begin(), data.end());
    extra_tensors.push_back(info);
  };
  for (const auto& [name, location] : weights.where) {
    if (used.count(name)) continue;
    if (name == "lm_head.decoder.weight") {
      auto decoder = read(name);
      if (entry(name).shape != embedding.shape ||
          !std::equal(decoder.begin(), decoder.end(), values.begin() + embedding.offset))
        throw Error(describe(name) +
                    " differs from esm.embeddings.word_embeddings.weight; plm ties the decoder "
                    "to the embedding as ESM-2 does, so an untied model is not supported");
      summary.skipped.push_back(name +
                                " (tied to esm.embeddings.word_embeddings.weight, identical)");
    } else if (endsWith(name, "rotary_embeddings.inv_freq") &&
               entry(name).shape == std::vector<std::int64_t>{summary.config.headDim() / 2} &&
               !std::count_if(extra_tensors.begin(), extra_tensors.end(),
                              [](const model::TensorInfo& t) { return t.name == inv_freq_name; })) {
      // transformers uses the stored rotary frequencies rather than recomputing them, and
      // float32 pow differs by an ulp between libraries: keep them so --to-hf is bit-exact.
      addExtra(inv_freq_name, name);
      summary.skipped.push_back(name + " (rotary buffer plm computes itself; kept in /" +
                                extra_group + " for --to-hf)");
    } else if (endsWith(name, "rotary_embeddings.inv_freq") ||
               name == "esm.embeddings.position_ids") {
      summary.skipped.push_back(name + " (buffer plm computes itself)");
    } else if (startsWith(name, "esm.contact_head.")) {
      addExtra(name, name);
      summary.skipped.push_back(name + " (contact head, unused by plm; kept in /" + extra_group +
                                " for --to-hf)");
    } else {
      unknown.push_back(location.second);
    }
  }
  if (!unknown.empty()) {
    std::string list;
    for (std::size_t i = 0; i < unknown.size() && i < 5; ++i)
      list += (i ? ", " : "") + ("\"" + unknown[i] + "\"");
    if (unknown.size() > 5) list += ", ... (" + std::to_string(unknown.size()) + " in all)";
    throw Error("`" + hf_dir + "` holds tensors that EsmForMaskedLM does not have: " + list +
                "; plm converts plain ESM-2 masked language models only");
  }

  summary.num_parameters = std::int64_t(values.size());
  summary.source_dtypes.assign(dtypes.begin(), dtypes.end());
  ModelAttributes attributes;
  attributes.strings["source"] = fs::absolute(dir).string();
  attributes.strings["source_format"] = "huggingface-safetensors";
  std::string dtype_list;
  for (const auto& d : summary.source_dtypes) dtype_list += (dtype_list.empty() ? "" : ",") + d;
  attributes.strings["source_dtype"] = dtype_list;

  h5::Hid file = h5::createFile(out, comm);
  writeConfigAttributes(file, summary.config);
  writeExtraAttributes(file, attributes);
  writeTensorGroup(file, comm, "model", tensors, values.data());
  if (!extra_tensors.empty())
    writeTensorGroup(file, comm, extra_group, extra_tensors, extra_values.data());
  return summary;
}

ConvertSummary convertToHf(const std::string& model_file, const std::string& out_dir,
                           MPI_Comm comm) {
  ConvertSummary summary;
  summary.config = readModelConfig(model_file);
  if (summary.config.max_positions > 1026)
    summary.warnings.push_back(
        "max_position_embeddings = " + std::to_string(summary.config.max_positions) +
        " (model.max_positions) is written as is: EsmForMaskedLM with rotary positions accepts "
        "it, but ESM-2 tokenizers crop at model_max_length 1024 unless you raise it");
  if (summary.config.moe.enabled())
    throw collectiveError("plm convert --to-hf: `" + model_file +
                          "` is a Mixture-of-Experts model; Hugging Face's EsmForMaskedLM has no "
                          "MoE layers, so there is no HF export for MoE models (doc/model.md). "
                          "`plm eval` and `plm embed` read the plm file directly");
  const auto tensors = esmTensors(summary.config);
  std::vector<float> values(std::size_t(tensors.back().offset + tensors.back().size));
  readModelValues(model_file, comm, summary.config, tensors, values.data());
  summary.num_parameters = std::int64_t(values.size());

  // Tensors kept from a Hugging Face source (the contact head), read whole by every rank.
  std::vector<std::pair<safetensors::TensorOut, std::vector<float>>> extras;
  {
    h5::Hid file = h5::openFile(model_file, comm);
    if (h5::exists(file, extra_group)) {
      h5::Hid group(PLM_CHECK_H5(H5Gopen2(file, extra_group, H5P_DEFAULT)));
      H5G_info_t info;
      PLM_CHECK_H5(H5Gget_info(group, &info));
      for (hsize_t i = 0; i < info.nlinks; ++i) {
        ssize_t length = PLM_CHECK_H5(
            H5Lget_name_by_idx(group, ".", H5_INDEX_NAME, H5_ITER_INC, i, nullptr, 0, H5P_DEFAULT));
        std::string name(std::size_t(length) + 1, '\0');
        PLM_CHECK_H5(H5Lget_name_by_idx(group, ".", H5_INDEX_NAME, H5_ITER_INC, i, name.data(),
                                        name.size(), H5P_DEFAULT));
        name.resize(std::size_t(length));
        h5::Hid dataset = h5::openDataset(group, name);
        safetensors::TensorOut t;
        t.name = name;
        t.shape = h5::datasetShape(dataset);
        std::int64_t numel = 1;
        for (auto d : t.shape) numel *= d;
        std::vector<float> data(static_cast<std::size_t>(numel));
        h5::readRows<float>(dataset, 0, t.shape.empty() ? 1 : t.shape[0], data.data());
        extras.emplace_back(t, std::move(data));
      }
    }
  }
  if (commRank(comm) != 0) return summary;

  std::error_code error;
  fs::create_directories(out_dir, error);
  if (error || !fs::is_directory(out_dir))
    throw Error("cannot create the output directory `" + out_dir + "`: " + error.message());
  const fs::path dir(out_dir);
  {
    const std::string path = (dir / "config.json").string();
    std::ofstream os(path, std::ios::binary | std::ios::trunc);
    os << json::write(configToJson(summary.config), 2) << "\n";
    if (!os.good()) throw Error("writing `" + path + "` failed: " + std::strerror(errno));
  }
  std::vector<safetensors::TensorOut> out;
  for (const auto& t : tensors) out.push_back({t.name, t.shape, values.data() + t.offset});
  out.push_back(
      {"lm_head.decoder.weight", tensors.front().shape, values.data() + tensors.front().offset});
  // Rotary frequencies under the per-layer names of transformers 4 (transformers 5 maps them to
  // its shared buffer): the source's values if it had them, else 1/10000^(2i/d) in float32.
  const int half = summary.config.headDim() / 2;
  std::vector<float> inv_freq(static_cast<std::size_t>(half));
  for (int i = 0; i < half; ++i)
    inv_freq[std::size_t(i)] =
        1.0f / std::pow(10000.0f, float(2 * i) / float(summary.config.headDim()));
  for (auto& [t, data] : extras) {
    if (t.name == inv_freq_name) {
      if (data.size() == inv_freq.size()) inv_freq = data;
      continue;
    }
    t.data = data.data();
    out.push_back(t);
  }
  for (int l = 0; l < summary.config.num_layers; ++l)
    out.push_back(
        {"esm.encoder.layer." + std::to_string(l) + ".attention.self.rotary_embeddings.inv_freq",
         {half},
         inv_freq.data()});
  safetensors::write((dir / "model.safetensors").string(), out);
  return summary;
}

}  // namespace plm::io::hf
