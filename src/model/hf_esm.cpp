// Hugging Face EsmForMaskedLM <-> plm model file.
#include "model/hf_esm.hpp"

#include "core/error.hpp"
#include "dist/process_groups.hpp"
#include "io/hdf5.hpp"
#include "io/hdf5_group.hpp"
#include "io/safetensors.hpp"
#include "model/head_file.hpp"
#include "model/model_file.hpp"
#include "model/tensor_table.hpp"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <set>
#include <sstream>

namespace plm::model::hf {

namespace h5 = io::h5;
namespace json = io::json;
namespace safetensors = io::safetensors;

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

// The ESM-2 architectures whose tensors are ESM-2's encoder (model.init_from loads it from any).
bool isEsmArchitecture(const std::string& name) {
  return name == "EsmForMaskedLM" || name == "EsmModel" || name == "EsmForSequenceClassification" ||
         name == "EsmForTokenClassification";
}

}  // namespace

Weights::Weights(const std::string& path) {
  const fs::path p(path);
  auto addReader = [&](const fs::path& file) {
    readers_member.push_back(std::make_unique<safetensors::Reader>(file.string()));
    const std::size_t index = readers_member.size() - 1;
    for (const auto& t : readers_member.back()->tensors()) {
      const std::string name = canonicalName(t.name);
      if (where_member.count(name))
        throw Error("`" + file.string() + "`: tensor \"" + t.name +
                    "\" appears twice in the model directory");
      where_member[name] = {index, t.name};
    }
  };
  auto addIndex = [&](const fs::path& index) {
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
    for (const auto& file : files) addReader(index.parent_path() / file);
  };
  if (!fs::is_directory(p)) {
    if (!fs::exists(p)) throw Error("`" + path + "` does not exist");
    if (endsWith(path, ".json"))
      addIndex(p);
    else
      addReader(p);
    return;
  }
  const fs::path single = p / "model.safetensors";
  const fs::path index = p / "model.safetensors.index.json";
  if (fs::exists(single)) {
    addReader(single);
  } else if (fs::exists(index)) {
    addIndex(index);
  } else if (fs::exists(p / "pytorch_model.bin")) {
    throw Error(
        "`" + path +
        "` has only pytorch_model.bin (a Python pickle), which plm does not read; re-save it as "
        "safetensors with transformers: "
        "EsmForMaskedLM.from_pretrained(DIR).save_pretrained(NEW_DIR)");
  } else {
    throw Error("`" + path + "` has neither model.safetensors nor model.safetensors.index.json");
  }
}

std::vector<std::string> Weights::names() const {
  std::vector<std::string> out;
  for (const auto& [name, where] : where_member) out.push_back(name);
  return out;
}

const safetensors::TensorEntry& Weights::entry(const std::string& name) const {
  const auto& [reader, stored] = where_member.at(name);
  return readers_member[reader]->tensor(stored);
}

std::string Weights::describe(const std::string& name) const {
  const auto& [reader, stored] = where_member.at(name);
  return "`" + readers_member[reader]->path() + "` tensor \"" + stored + "\"";
}

std::vector<float> Weights::read(const std::string& name) const {
  const auto& [reader, stored] = where_member.at(name);
  return readers_member[reader]->readFloat(stored);
}

std::vector<float> Weights::readRows(const std::string& name, std::int64_t first_row,
                                     std::int64_t row_count) const {
  const auto& [reader, stored] = where_member.at(name);
  return readers_member[reader]->readFloatRows(stored, first_row, row_count);
}

std::int64_t parseByteSize(const std::string& text) {
  std::size_t used = 0;
  double value = 0;
  try {
    value = std::stod(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  std::string unit = text.substr(used);
  for (auto& ch : unit) ch = char(std::toupper(static_cast<unsigned char>(ch)));
  static const std::map<std::string, double> units = {{"", 1},
                                                      {"B", 1},
                                                      {"KB", 1e3},
                                                      {"MB", 1e6},
                                                      {"GB", 1e9},
                                                      {"TB", 1e12},
                                                      {"KIB", 1024.0},
                                                      {"MIB", 1048576.0},
                                                      {"GIB", 1073741824.0},
                                                      {"TIB", 1099511627776.0}};
  auto it = units.find(unit);
  if (used == 0 || it == units.end() || !(value > 0))
    throw Error("`" + text + "` is not a size; write e.g. 5GB, 500MB, 2GiB or a byte count");
  return static_cast<std::int64_t>(value * it->second);
}

std::map<std::string, std::string> tokenizerFiles(std::int64_t model_max_length) {
  std::map<std::string, std::string> files;
  std::string vocab;
  for (const auto& token : esmVocabulary()) vocab += token + "\n";
  files["vocab.txt"] = vocab;
  json::Value special = json::Value::object();
  special.set("cls_token", "<cls>");
  special.set("eos_token", "<eos>");
  special.set("mask_token", "<mask>");
  special.set("pad_token", "<pad>");
  special.set("unk_token", "<unk>");
  files["special_tokens_map.json"] = json::write(special, 2) + "\n";
  json::Value config = special;
  config.set("clean_up_tokenization_spaces", true);
  config.set("model_max_length", model_max_length);
  config.set("tokenizer_class", "EsmTokenizer");
  files["tokenizer_config.json"] = json::write(config, 2) + "\n";
  return files;
}

std::vector<model::TensorInfo> esmTensors(const model::Esm2Config& config) {
  model::Esm2Config plain = config;
  plain.lora = model::LoraConfig{};  // adapters have no Hugging Face position
  std::vector<model::TensorInfo> t = model::tensorTable(plain);
  std::sort(t.begin(), t.end(), [](const model::TensorInfo& a, const model::TensorInfo& b) {
    return a.hf_order < b.hf_order;
  });
  std::int64_t offset = 0;
  for (auto& info : t) {
    info.offset = offset;
    offset += info.size;
  }
  return t;
}

model::Esm2Config configFromJson(const json::Value& j, const std::string& source,
                                 std::vector<std::string>* warnings, bool any_esm_head) {
  if (!j.isObject()) throw Error(source + ": config.json is not a JSON object");
  auto unsupported = [&](const std::string& key, const std::string& found, const std::string& why) {
    return Error(source + ": " + key + " = " + found + " is not supported: " + why);
  };
  auto text = [](const json::Value& v) { return json::write(v); };
  auto isSet = [&](const char* key) { return j.has(key) && !j.at(key).isNull(); };

  const bool moe = j.has("model_type") && j.at("model_type").isString() &&
                   j.at("model_type").asString() == moe_model_type;
  if (!moe && (!j.has("model_type") || !j.at("model_type").isString() ||
               j.at("model_type").asString() != "esm"))
    throw Error(source + ": model_type is " +
                (j.has("model_type") ? text(j.at("model_type")) : "missing") +
                "; plm converts Hugging Face ESM models (model_type \"esm\", EsmForMaskedLM) and "
                "its own MoE export (model_type \"" +
                moe_model_type + "\")");
  if (isSet("architectures") && !moe) {
    bool masked_lm = false;
    std::string listed;
    for (const auto& a : j.at("architectures").items()) {
      listed += (listed.empty() ? "" : ", ") + (a.isString() ? a.asString() : text(a));
      if (a.isString() &&
          (a.asString() == "EsmForMaskedLM" || (any_esm_head && isEsmArchitecture(a.asString()))))
        masked_lm = true;
    }
    if (!masked_lm)
      throw unsupported("architectures", "[" + listed + "]",
                        any_esm_head
                            ? "model.init_from reads the ESM-2 encoder of EsmForMaskedLM, "
                              "EsmModel, EsmForSequenceClassification or EsmForTokenClassification"
                            : "plm converts EsmForMaskedLM (ESM-2 with its language-model head) "
                              "only");
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
  if (moe) {
    if (!j.has("plm_moe") || !j.at("plm_moe").isObject())
      throw Error(source + ": model_type \"" + moe_model_type + "\" needs a \"plm_moe\" object");
    const json::Value& m = j.at("plm_moe");
    auto field = [&](const char* key) -> const json::Value& {
      if (!m.has(key)) throw Error(source + ": plm_moe." + key + " is missing");
      return m.at(key);
    };
    auto& e = c.moe;
    e.experts = static_cast<int>(field("experts").asInt());
    e.top_k = static_cast<int>(field("top_k").asInt());
    e.every = static_cast<int>(field("every").asInt());
    e.expert_ffn = static_cast<int>(field("expert_ffn").asInt());
    e.shared_experts = static_cast<int>(field("shared_experts").asInt());
    e.router = model::parseRouter(field("router").asString());
    e.normalize_topk = field("normalize_topk").asBool();
    e.capacity_factor = field("capacity_factor").asDouble();
    e.aux_loss = field("aux_loss").asDouble();
    e.z_loss = field("z_loss").asDouble();
    e.seq_aux_loss = field("seq_aux_loss").asDouble();
    e.bias_balance = field("bias_balance").asBool();
    e.bias_rate = field("bias_rate").asDouble();
    // Absent in exports made before SwiGLU experts existed: those are GELU.
    if (m.has("expert_activation"))
      e.expert_activation = model::parseExpertActivation(m.at("expert_activation").asString());
    // The model's own checks (MoeConfig::validate) run when the model is built from the file.
    if (e.experts <= 0 || e.top_k <= 0 || e.top_k > e.experts || e.every <= 0 || e.expert_ffn <= 0)
      throw Error(source +
                  ": plm_moe needs experts > 0, 0 < top_k <= experts, every > 0 and "
                  "expert_ffn > 0");
  }
  return c;
}

model::Esm2Config readConfigFile(const std::string& config_json, std::vector<std::string>* warnings,
                                 bool any_esm_head) {
  return configFromJson(json::parse(readText(config_json), config_json), config_json, warnings,
                        any_esm_head);
}

json::Value configToJson(const model::Esm2Config& c, const std::string& torch_dtype) {
  json::Value j = json::Value::object();
  json::Value architectures = json::Value::array();
  architectures.push(c.moe.enabled() ? "PlmEsmMoeForMaskedLM" : "EsmForMaskedLM");
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
  j.set("model_type", c.moe.enabled() ? moe_model_type : "esm");
  j.set("num_attention_heads", c.heads);
  j.set("num_hidden_layers", c.num_layers);
  j.set("pad_token_id", 1);
  j.set("position_embedding_type", "rotary");
  j.set("tie_word_embeddings", true);
  j.set("token_dropout", c.token_dropout);
  j.set("torch_dtype", torch_dtype);
  j.set("use_cache", true);
  j.set("vocab_list", nullptr);
  j.set("vocab_size", c.vocab);
  if (c.moe.enabled()) {
    const auto& e = c.moe;
    json::Value m = json::Value::object();
    m.set("experts", e.experts);
    m.set("top_k", e.top_k);
    m.set("every", e.every);
    m.set("expert_ffn", e.expert_ffn);
    m.set("shared_experts", e.shared_experts);
    m.set("router", model::routerName(e.router));
    m.set("normalize_topk", e.normalize_topk);
    m.set("capacity_factor", e.capacity_factor);
    m.set("aux_loss", e.aux_loss);
    m.set("z_loss", e.z_loss);
    m.set("seq_aux_loss", e.seq_aux_loss);
    m.set("bias_balance", e.bias_balance);
    m.set("bias_rate", e.bias_rate);
    m.set("expert_activation", model::expertActivationName(e.expert_activation));
    j.set("plm_moe", std::move(m));
    j.set("plm_format",
          "plm's Mixture-of-Experts export, not loadable by transformers: "
          "doc/interop.md");
  }
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
  // EsmForSequenceClassification / EsmForTokenClassification folders are read too: their
  // classifier becomes the model file's /head (model/head_file.hpp).
  summary.config = readConfigFile(config_path.string(), &summary.warnings, true);
  const json::Value config_json = json::parse(readText(config_path.string()), config_path.string());
  std::string head_kind;  // empty: no task head
  if (config_json.has("architectures") && config_json.at("architectures").isArray())
    for (const auto& a : config_json.at("architectures").items()) {
      if (!a.isString()) continue;
      if (a.asString() == "EsmForTokenClassification") head_kind = "token_classification";
      if (a.asString() == "EsmForSequenceClassification") head_kind = "sequence_classification";
    }
  if (head_kind.empty()) {
    bool masked_lm = !config_json.has("architectures") || summary.config.moe.enabled();
    if (!masked_lm)
      for (const auto& a : config_json.at("architectures").items())
        masked_lm = masked_lm || (a.isString() && a.asString() == "EsmForMaskedLM");
    if (!masked_lm)
      throw Error(config_path.string() +
                  ": architectures names no EsmForMaskedLM, EsmForSequenceClassification or "
                  "EsmForTokenClassification; plm convert reads those (model.init_from also "
                  "reads an EsmModel's encoder)");
  }
  // An MoE model in plm's format is stored under plm's own table (doc/interop.md).
  const auto tensors =
      summary.config.moe.enabled() ? tensorTable(summary.config) : esmTensors(summary.config);
  const Weights weights(hf_dir);
  auto describe = [&](const std::string& name) { return weights.describe(name); };
  auto entry = [&](const std::string& name) -> const safetensors::TensorEntry& {
    return weights.entry(name);
  };
  auto read = [&](const std::string& name) { return weights.read(name); };

  std::vector<float> values(std::size_t(tensors.back().offset + tensors.back().size));
  std::set<std::string> dtypes, used;
  for (const auto& t : tensors) {
    if (!head_kind.empty() && startsWith(t.name, "lm_head.") && !weights.has(t.name)) {
      // A classification model has no LM head: an untrained one (zero dense layer and bias,
      // LayerNorm 1/0) keeps the file a whole plm model; its masked-LM output means nothing.
      const float fill = endsWith(t.name, "layer_norm.weight") ? 1.0f : 0.0f;
      std::fill(values.begin() + t.offset, values.begin() + t.offset + t.size, fill);
      used.insert(t.name);
      if (t.name == "lm_head.bias")
        summary.warnings.push_back(
            "the source has no LM head (a classification model): lm_head.* are written untrained "
            "(zero weights, LayerNorm 1/0), so its masked-LM loss is meaningless until trained");
      continue;
    }
    if (!weights.has(t.name))
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
  HeadData head;
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
  for (const auto& name : weights.names()) {
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
    } else if (!head_kind.empty() && startsWith(name, "classifier.")) {
      head.names.push_back(name);
      head.shapes.push_back(entry(name).shape);
      head.values.push_back(read(name));
    } else if (startsWith(name, "esm.contact_head.")) {
      addExtra(name, name);
      summary.skipped.push_back(name + " (contact head, unused by plm; kept in /" + extra_group +
                                " for --to-hf)");
    } else {
      unknown.push_back(name);
    }
  }
  if (!unknown.empty()) {
    std::string list;
    for (std::size_t i = 0; i < unknown.size() && i < 5; ++i)
      list += (i ? ", " : "") + ("\"" + unknown[i] + "\"");
    if (unknown.size() > 5) list += ", ... (" + std::to_string(unknown.size()) + " in all)";
    throw Error("`" + hf_dir + "` holds tensors that EsmForMaskedLM does not have: " + list +
                "; plm converts plain ESM-2 masked language models only (and the classifier of an "
                "EsmForSequenceClassification / EsmForTokenClassification folder)");
  }

  if (!head_kind.empty()) {
    // The head's task from its class and config: one output (or problem_type regression) is
    // a regression; the label count is the output layer's rows.
    const bool token = head_kind == "token_classification";
    const std::vector<std::string> want =
        token ? std::vector<std::string>{"classifier.weight", "classifier.bias"}
              : std::vector<std::string>{"classifier.dense.weight", "classifier.dense.bias",
                                         "classifier.out_proj.weight", "classifier.out_proj.bias"};
    for (const auto& name : want)
      if (std::find(head.names.begin(), head.names.end(), name) == head.names.end())
        throw Error("`" + hf_dir + "` lacks the tensor \"" + name + "\" of its " +
                    (token ? "EsmForTokenClassification" : "EsmForSequenceClassification") +
                    " head");
    for (const auto& name : head.names)
      if (std::find(want.begin(), want.end(), name) == want.end()) unknown.push_back(name);
    const std::size_t out = std::size_t(
        std::find(head.names.begin(), head.names.end(), want[token ? 0 : 2]) - head.names.begin());
    head.num_labels = head.shapes[out].front();
    const bool regression =
        !token && (head.num_labels == 1 ||
                   (config_json.has("problem_type") && config_json.at("problem_type").isString() &&
                    config_json.at("problem_type").asString() == "regression"));
    head.task_kind = regression ? "sequence_regression" : head_kind;
    head.pooling = "cls";
    for (std::size_t i = 0; i < head.names.size(); ++i)
      if (head.shapes[i].size() == 2 && head.shapes[i][1] != summary.config.hidden)
        throw Error(describe(head.names[i]) + " has shape " + shapeText(head.shapes[i]) +
                    " but the model's hidden size is " + std::to_string(summary.config.hidden));
  }
  if (!unknown.empty() && !head_kind.empty()) {
    std::string list;
    for (const auto& u : unknown) list += (list.empty() ? "" : ", ") + ("\"" + u + "\"");
    throw Error("`" + hf_dir + "` holds tensors that its ESM class does not have: " + list);
  }

  summary.num_parameters = 0;
  for (const auto& t : tensors) summary.num_parameters += t.size;
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
  if (!head.names.empty()) {
    writeHead(file, comm, head);
    summary.warnings.push_back("the " + head.task_kind + " head (" +
                               std::to_string(head.num_labels) +
                               " label(s)) is stored in the model file's /head group: "
                               "task.init_head, plm eval --head and plm convert --to-hf read it");
  }
  return summary;
}

ConvertSummary convertToHf(const std::string& model_file, const std::string& out_dir, MPI_Comm comm,
                           const ExportOptions& options) {
  if (options.dtype != "F32" && options.dtype != "BF16")
    throw Error("--dtype " + options.dtype + ": the export is written as fp32 or bf16");
  if (options.max_shard_bytes <= 0) throw Error("--max-shard-size must be positive");
  ConvertSummary summary;
  summary.config = readModelConfig(model_file);
  const bool moe = summary.config.moe.enabled();
  // The tokenizer written beside the weights takes the model's whole context.
  const std::int64_t max_tokens = summary.config.max_positions - 2;
  if (summary.config.max_positions != 1026)
    summary.warnings.push_back(
        "max_position_embeddings = " + std::to_string(summary.config.max_positions) +
        " (model.max_positions): tokenizer_config.json's model_max_length is " +
        std::to_string(max_tokens) + " (ESM-2's tokenizers say 1024)");
  if (moe)
    summary.warnings.push_back(
        "a Mixture-of-Experts model is written in plm's format (model_type \"" +
        std::string(moe_model_type) +
        "\", plm's tensor names; doc/interop.md): transformers has no ESM MoE class and does not "
        "load it; `plm convert --from-hf` reads it back");
  const model::Esm2Config stored = summary.config;
  if (stored.lora.enabled()) {  // a checkpoint of a LoRA run: exported merged, as plain ESM-2
    if (moe)
      throw Error("plm convert --to-hf: `" + model_file +
                  "` holds LoRA adapters on a Mixture-of-Experts model, which the export does not "
                  "merge; export the run's model.h5 (written merged) instead");
    summary.config.lora = model::LoraConfig{};
    summary.warnings.push_back("LoRA adapters (rank " + std::to_string(stored.lora.rank) +
                               ", alpha " + std::to_string(stored.lora.alpha) + ", targets " +
                               model::loraTargetNames(stored.lora.targets) +
                               ") merged into their weights: W + (alpha / rank) B A");
  }
  // Dense models: the Hugging Face table; MoE: plm's own (experts by name).
  const auto tensors = moe ? tensorTable(summary.config) : esmTensors(summary.config);
  std::vector<float> values(std::size_t(tensors.back().offset + tensors.back().size));
  if (stored.lora.enabled()) {
    const auto adapted = tensorTable(stored);
    std::vector<float> raw(std::size_t(adapted.back().offset + adapted.back().size));
    readModelValues(model_file, comm, stored, adapted, raw.data());
    const auto merged = mergeLora(stored, adapted, raw.data());
    std::map<std::string, std::int64_t> at;
    for (const auto& t : tensorTable(summary.config)) at[t.name] = t.offset;
    for (const auto& t : tensors)
      std::copy_n(merged.data() + at.at(t.name), t.size, values.data() + t.offset);
  } else {
    readModelValues(model_file, comm, summary.config, tensors, values.data());
  }
  summary.num_parameters = 0;
  for (const auto& t : tensors) summary.num_parameters += t.size;

  // Tensors kept from a Hugging Face source (the contact head), read whole by every rank.
  std::vector<std::pair<safetensors::TensorOut, std::vector<float>>> extras;
  {
    h5::Hid file = h5::openFile(model_file, comm);
    if (h5::exists(file, extra_group)) {
      h5::Hid group(PLM_CHECK_H5(H5Gopen2(file, extra_group, H5P_DEFAULT)));
      for (const auto& name : h5::groupMembers(group)) {
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
  // The task head (options.head), read whole by every rank: /head/<name> and its attributes.
  std::vector<std::pair<safetensors::TensorOut, std::vector<float>>> head_tensors;
  std::string head_kind, head_pooling;
  std::int64_t head_labels = 0;
  // Without --head, a head stored in the model file itself (convert --from-hf of a
  // classification folder) comes along.
  const std::string head_path =
      !options.head.empty() ? options.head : (hasHead(model_file, comm) ? model_file : "");
  if (!head_path.empty()) {
    HeadData head;
    try {
      head = readHead(head_path, comm);
    } catch (const Error& e) {
      throw collectiveError(std::string("--head: ") + e.what());
    }
    head_kind = head.task_kind;
    head_pooling = head.pooling;
    head_labels = head.num_labels;
    if (head_pooling != "cls" && head_kind != "token_classification")
      throw collectiveError(
          "--head `" + head_path + "`: the head pools with `" + head_pooling +
          "`; Hugging Face's EsmForSequenceClassification reads the <cls> token only, so a "
          "mean-pooled head cannot be exported (train it with task.pooling: cls)");
    for (std::size_t i = 0; i < head.names.size(); ++i) {
      safetensors::TensorOut t;
      t.name = head.names[i];
      t.shape = head.shapes[i];
      if (t.shape.size() == 2 && t.shape.back() != summary.config.hidden)
        throw collectiveError("--head `" + head_path + "`: tensor " + t.name +
                              " reads hidden size " + std::to_string(t.shape.back()) +
                              ", the model's is " + std::to_string(summary.config.hidden));
      head_tensors.emplace_back(t, std::move(head.values[i]));
    }
  }
  if (commRank(comm) != 0) return summary;

  std::error_code error;
  fs::create_directories(out_dir, error);
  if (error || !fs::is_directory(out_dir))
    throw Error("cannot create the output directory `" + out_dir + "`: " + error.message());
  const fs::path dir(out_dir);
  auto writeText = [&](const std::string& name, const std::string& text) {
    const std::string path = (dir / name).string();
    std::ofstream os(path, std::ios::binary | std::ios::trunc);
    os << text;
    if (!os.good()) throw Error("writing `" + path + "` failed: " + std::strerror(errno));
  };
  const std::string torch_dtype = options.dtype == "BF16" ? "bfloat16" : "float32";
  json::Value config_json = configToJson(summary.config, torch_dtype);
  if (!head_kind.empty()) {
    json::Value architectures = json::Value::array();
    architectures.push(head_kind == "token_classification" ? "EsmForTokenClassification"
                                                           : "EsmForSequenceClassification");
    config_json.set("architectures", std::move(architectures));
    json::Value id2label = json::Value::object(), label2id = json::Value::object();
    for (std::int64_t i = 0; i < head_labels; ++i) {
      id2label.set(std::to_string(i), "LABEL_" + std::to_string(i));
      label2id.set("LABEL_" + std::to_string(i), i);
    }
    config_json.set("id2label", std::move(id2label));
    config_json.set("label2id", std::move(label2id));
    if (head_kind == "sequence_regression") config_json.set("problem_type", "regression");
    if (head_kind == "sequence_classification")
      config_json.set("problem_type", "single_label_classification");
  }
  writeText("config.json", json::write(config_json, 2) + "\n");
  for (const auto& [name, text] : tokenizerFiles(max_tokens)) writeText(name, text);

  std::vector<safetensors::TensorOut> out;
  for (const auto& t : tensors) out.push_back({t.name, t.shape, values.data() + t.offset, ""});
  out.push_back({"lm_head.decoder.weight", tensors.front().shape,
                 values.data() + tensors.front().offset, ""});
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
  for (auto& [t, data] : head_tensors) {
    t.data = data.data();
    out.push_back(t);
  }
  if (!moe)  // plm's format stores no buffers
    for (int l = 0; l < summary.config.num_layers; ++l)
      out.push_back(
          {"esm.encoder.layer." + std::to_string(l) + ".attention.self.rotary_embeddings.inv_freq",
           {half},
           inv_freq.data(),
           "F32"});

  // One file up to the limit; above it, shards of whole tensors in order (save_pretrained's
  // layout: model-00001-of-0000n.safetensors and an index mapping each tensor to its file).
  // bf16: the rotary frequencies stay F32 (they are buffers transformers uses as stored).
  const std::map<std::string, std::string> metadata = {{"format", "pt"}};
  std::vector<std::vector<safetensors::TensorOut>> shards(1);
  std::int64_t shard_bytes = 0, total_bytes = 0;
  for (const auto& t : out) {
    const std::int64_t bytes = safetensors::storedBytes({t}, options.dtype);
    if (!shards.back().empty() && shard_bytes + bytes > options.max_shard_bytes) {
      shards.emplace_back();
      shard_bytes = 0;
    }
    shards.back().push_back(t);
    shard_bytes += bytes;
    total_bytes += bytes;
  }
  std::error_code ignored;
  if (shards.size() == 1) {
    fs::remove(dir / "model.safetensors.index.json", ignored);  // a stale index would win
    safetensors::write((dir / "model.safetensors").string(), out, metadata, options.dtype);
    return summary;
  }
  fs::remove(dir / "model.safetensors", ignored);  // transformers prefers it over the index
  json::Value weight_map = json::Value::object();
  const std::size_t n = shards.size();
  auto shardName = [n](std::size_t i) {
    char name[64];
    std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", i + 1, n);
    return std::string(name);
  };
  for (std::size_t i = 0; i < n; ++i) {
    safetensors::write((dir / shardName(i)).string(), shards[i], metadata, options.dtype);
    for (const auto& t : shards[i]) weight_map.set(t.name, shardName(i));
  }
  json::Value index = json::Value::object();
  json::Value meta = json::Value::object();
  meta.set("total_size", total_bytes);
  index.set("metadata", std::move(meta));
  index.set("weight_map", std::move(weight_map));
  writeText("model.safetensors.index.json", json::write(index, 2) + "\n");
  summary.warnings.push_back("weights split into " + std::to_string(n) +
                             " files above --max-shard-size (" +
                             std::to_string(options.max_shard_bytes) + " bytes)");
  return summary;
}

}  // namespace plm::model::hf
