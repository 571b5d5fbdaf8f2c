// Hugging Face directory <-> plm model file, without Python: the tensor table matches what
// transformers produced for the fixtures, F32 round trips are exact (HF -> plm -> HF -> plm),
// BF16/F16 sources decode, sharded directories read, and unsupported inputs are refused clearly.
#include "core/error.hpp"
#include "fixture.hpp"
#include "io/json.hpp"
#include "io/safetensors.hpp"
#include "model/hf_esm.hpp"
#include "model/model_file.hpp"

#include <gtest/gtest.h>
#include <mpi.h>

#include <unistd.h>
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <set>

namespace fs = std::filesystem;
namespace io = plm::io;
namespace model = plm::model;
namespace st = plm::io::safetensors;
namespace json = plm::io::json;
using plm::model::Esm2Config;

namespace {

struct HfTensor {
  std::string name;
  std::string dtype;  // F32, BF16, F16
  std::vector<std::int64_t> shape;
  std::vector<float> values;  // exactly representable in dtype
};

fs::path scratch(const std::string& name) {
  fs::path p = fs::current_path() / ("test_hf_convert_" + std::to_string(::getpid())) / name;
  fs::remove_all(p);
  fs::create_directories(p.parent_path());
  return p;
}

std::uint16_t floatToF16(float f) {  // exact for the values the tests use (normal f16 numbers)
  std::uint32_t bits;
  std::memcpy(&bits, &f, 4);
  const std::uint32_t sign = (bits >> 16) & 0x8000u;
  const int exponent = int((bits >> 23) & 0xFF) - 127 + 15;
  const std::uint32_t mantissa = (bits >> 13) & 0x3FFu;
  if (f == 0.0f) return std::uint16_t(sign);
  return std::uint16_t(sign | (std::uint32_t(exponent) << 10) | mantissa);
}

// Writes a safetensors file with mixed dtypes (plm's own writer is F32 only).
void writeSafetensors(const fs::path& path, const std::vector<HfTensor>& tensors) {
  json::Value header = json::Value::object();
  json::Value meta = json::Value::object();
  meta.set("format", "pt");
  header.set("__metadata__", meta);
  std::vector<unsigned char> data;
  for (const auto& t : tensors) {
    const std::int64_t begin = std::int64_t(data.size());
    for (float v : t.values) {
      if (t.dtype == "F32") {
        const unsigned char* p = reinterpret_cast<const unsigned char*>(&v);
        data.insert(data.end(), p, p + 4);
      } else {
        std::uint16_t b = t.dtype == "BF16" ? st::floatToBf16(v) : floatToF16(v);
        data.push_back(b & 0xFF);
        data.push_back(b >> 8);
      }
    }
    json::Value entry = json::Value::object();
    entry.set("dtype", t.dtype);
    json::Value shape = json::Value::array();
    for (auto d : t.shape) shape.push(d);
    entry.set("shape", shape);
    json::Value offsets = json::Value::array();
    offsets.push(begin);
    offsets.push(std::int64_t(data.size()));
    entry.set("data_offsets", offsets);
    header.set(t.name, entry);
  }
  std::string text = json::write(header);
  std::ofstream os(path, std::ios::binary | std::ios::trunc);
  std::uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) os.put(char((n >> (8 * i)) & 0xFF));
  os << text;
  os.write(reinterpret_cast<const char*>(data.data()), std::streamsize(data.size()));
}

void writeText(const fs::path& path, const std::string& text) {
  std::ofstream os(path, std::ios::binary | std::ios::trunc);
  os << text;
}

// The fixture's parameters as the tensors a transformers directory holds, including what plm
// does not model: the tied decoder copy, the contact head and the rotary buffers.
std::vector<HfTensor> fixtureTensors(const plm::test::Fixture& f, const std::string& dtype) {
  std::vector<HfTensor> out;
  auto round = [&](double v) {
    float x = float(v);
    if (dtype == "BF16") return st::bf16ToFloat(st::floatToBf16(x));
    return x;
  };
  for (const auto& [name, array] : f.params) {
    HfTensor t{name, dtype, array.shape, {}};
    for (double v : array.values) t.values.push_back(round(v));
    out.push_back(t);
  }
  HfTensor decoder = out.front();
  for (const auto& t : out)
    if (t.name == "esm.embeddings.word_embeddings.weight") decoder = t;
  decoder.name = "lm_head.decoder.weight";
  out.push_back(decoder);
  const int lh = f.config.num_layers * f.config.heads;
  HfTensor contact{"esm.contact_head.regression.weight", dtype, {1, lh}, {}};
  for (int i = 0; i < lh; ++i) contact.values.push_back(round(0.125 * (i + 1)));
  out.push_back(contact);
  out.push_back({"esm.contact_head.regression.bias", dtype, {1}, {round(-0.5)}});
  const int half = f.config.hidden / f.config.heads / 2;
  for (int l = 0; l < f.config.num_layers; ++l) {
    HfTensor inv{
        "esm.encoder.layer." + std::to_string(l) + ".attention.self.rotary_embeddings.inv_freq",
        "F32",
        {half},
        {}};
    for (int i = 0; i < half; ++i)
      inv.values.push_back(float(std::pow(10000.0, -2.0 * i / (2 * half))));
    out.push_back(inv);
  }
  return out;
}

void writeHfDir(const fs::path& dir, const Esm2Config& config,
                const std::vector<HfTensor>& tensors) {
  fs::create_directories(dir);
  writeText(dir / "config.json", json::write(model::hf::configToJson(config), 2));
  writeSafetensors(dir / "model.safetensors", tensors);
}

std::vector<float> readModel(const std::string& path, const Esm2Config& config) {
  const auto tensors = model::hf::esmTensors(config);
  std::vector<float> values(std::size_t(tensors.back().offset + tensors.back().size));
  model::readModelValues(path, MPI_COMM_WORLD, config, tensors, values.data());
  return values;
}

std::string errorOf(const std::function<void()>& f) {
  try {
    f();
  } catch (const plm::Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(Convert, TensorTableMatchesTransformers) {
  for (const auto& name : plm::test::fixtureNames()) {
    auto f = plm::test::readFixture(plm::test::fixturePath(name));
    const auto tensors = model::hf::esmTensors(f.config);
    ASSERT_EQ(tensors.size(), f.params.size()) << name;
    std::int64_t offset = 0;
    for (const auto& t : tensors) {
      ASSERT_TRUE(f.params.count(t.name)) << t.name;
      EXPECT_EQ(t.shape, f.params.at(t.name).shape) << t.name;
      EXPECT_EQ(t.offset, offset);
      offset += t.size;
      // AdamW decays Linear weights only (doc/anchors.md: not biases, LayerNorm, embeddings).
      const bool linear_weight =
          t.shape.size() == 2 && t.name.find("embeddings") == std::string::npos;
      EXPECT_EQ(t.weight_decay, linear_weight) << t.name;
    }
  }
}

TEST(Convert, ConfigJsonRoundTripAndFacebookConfig) {
  Esm2Config c;
  c.num_layers = 5;
  c.hidden = 24;
  c.heads = 3;
  c.ffn = 40;
  c.layer_norm_eps = 1e-5;
  c.max_positions = 1026;
  c.token_dropout = true;
  auto j = json::parse(json::write(model::hf::configToJson(c), 2));
  EXPECT_EQ(j.at("architectures").items().at(0).asString(), "EsmForMaskedLM");
  Esm2Config back = model::hf::configFromJson(j, "config.json");
  EXPECT_EQ(back.num_layers, 5);
  EXPECT_EQ(back.hidden, 24);
  EXPECT_EQ(back.heads, 3);
  EXPECT_EQ(back.ffn, 40);
  EXPECT_EQ(back.layer_norm_eps, 1e-5);
  EXPECT_TRUE(back.token_dropout);

  // facebook/esm2_t6_8M_UR50D's config.json as published.
  const char* facebook = R"({
    "architectures": ["EsmForMaskedLM"], "attention_probs_dropout_prob": 0.0, "classifier_dropout": null,
    "emb_layer_norm_before": false, "esmfold_config": null, "hidden_act": "gelu", "hidden_dropout_prob": 0.0,
    "hidden_size": 320, "initializer_range": 0.02, "intermediate_size": 1280, "is_folding_model": false,
    "layer_norm_eps": 1e-05, "mask_token_id": 32, "max_position_embeddings": 1026, "model_type": "esm",
    "num_attention_heads": 20, "num_hidden_layers": 6, "pad_token_id": 1, "position_embedding_type": "rotary",
    "token_dropout": true, "torch_dtype": "float32", "transformers_version": "4.25.0.dev0", "use_cache": true,
    "vocab_list": null, "vocab_size": 33})";
  std::vector<std::string> warnings;
  Esm2Config fb = model::hf::configFromJson(json::parse(facebook), "config.json", &warnings);
  EXPECT_EQ(fb.num_layers, 6);
  EXPECT_EQ(fb.hidden, 320);
  EXPECT_EQ(fb.heads, 20);
  EXPECT_EQ(fb.ffn, 1280);
  EXPECT_EQ(fb.max_positions, 1026);
  EXPECT_TRUE(warnings.empty());

  // Dropout is accepted with a warning; unsupported settings are refused naming the key.
  auto edited = [&](const std::string& key, const json::Value& v) {
    auto j2 = json::parse(facebook);
    j2.set(key, v);
    return j2;
  };
  warnings.clear();
  model::hf::configFromJson(edited("hidden_dropout_prob", 0.1), "config.json", &warnings);
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_NE(warnings[0].find("hidden_dropout_prob"), std::string::npos);
  struct Case {
    std::string key;
    json::Value value;
    std::string words;
  };
  json::Value classifier = json::Value::array();
  classifier.push("EsmForSequenceClassification");
  std::vector<Case> cases = {
      {"architectures", classifier,
       "architectures = [EsmForSequenceClassification] is not supported"},
      {"position_embedding_type", "absolute",
       "position_embedding_type = \"absolute\" is not supported"},
      {"emb_layer_norm_before", true, "emb_layer_norm_before = true is not supported"},
      {"vocab_size", 35, "vocab_size = 35 is not supported"},
      {"is_folding_model", true, "ESMFold"},
      {"hidden_act", "relu", "hidden_act"},
      {"tie_word_embeddings", false, "tie_word_embeddings"},
      {"model_type", "bert", "model_type is \"bert\""},
      {"num_attention_heads", 7, "multiple of num_attention_heads 7"},
      {"num_hidden_layers", 0, "num_hidden_layers = 0 must be a positive integer"},
      {"mask_token_id", 31, "mask_token_id"},
  };
  for (const auto& c2 : cases) {
    std::string message =
        errorOf([&] { model::hf::configFromJson(edited(c2.key, c2.value), "dir/config.json"); });
    EXPECT_NE(message.find(c2.words), std::string::npos) << c2.key << ": " << message;
    EXPECT_NE(message.find("dir/config.json"), std::string::npos) << message;
  }
}

TEST(Convert, F32RoundTripIsExact) {
  for (const auto& name : plm::test::fixtureNames()) {
    auto f = plm::test::readFixture(plm::test::fixturePath(name));
    auto hf = fixtureTensors(f, "F32");
    // transformers 5 writes the "LayerNorm" modules under their legacy names gamma/beta.
    for (auto& t : hf) {
      if (t.name == "esm.encoder.layer.0.LayerNorm.weight")
        t.name = "esm.encoder.layer.0.LayerNorm.gamma";
      if (t.name == "esm.encoder.layer.0.attention.LayerNorm.bias")
        t.name = "esm.encoder.layer.0.attention.LayerNorm.beta";
    }
    const fs::path dir = scratch(name + "_hf");
    writeHfDir(dir, f.config, hf);
    const std::string file1 = scratch(name + "_1.h5").string();
    auto summary = model::hf::convertFromHf(dir.string(), file1, MPI_COMM_WORLD);
    EXPECT_EQ(summary.source_dtypes, (std::vector<std::string>{"F32"}));
    EXPECT_EQ(summary.skipped.size(),
              3u + f.config.num_layers);  // decoder, contact head x2, inv_freq per layer

    // plm file == fixture parameters in fp32, by name.
    auto values = readModel(file1, f.config);
    for (const auto& t : model::hf::esmTensors(f.config)) {
      const auto& want = f.params.at(t.name).values;
      for (std::int64_t i = 0; i < t.size; ++i)
        ASSERT_EQ(values[std::size_t(t.offset + i)], float(want[std::size_t(i)]))
            << t.name << "[" << i << "]";
    }

    // plm -> HF: every tensor bit-identical, decoder = embedding, contact head given back.
    const fs::path out = scratch(name + "_back");
    model::hf::convertToHf(file1, out.string(), MPI_COMM_WORLD);
    st::Reader reader((out / "model.safetensors").string());
    for (const auto& t : hf) {
      if (t.name.find("inv_freq") != std::string::npos) continue;
      std::string stored = t.name;
      if (stored.size() > 6 && stored.substr(stored.size() - 6) == ".gamma")
        stored = stored.substr(0, stored.size() - 6) + ".weight";
      if (stored.size() > 5 && stored.substr(stored.size() - 5) == ".beta")
        stored = stored.substr(0, stored.size() - 5) + ".bias";
      ASSERT_TRUE(reader.has(stored)) << stored;
      EXPECT_EQ(reader.tensor(stored).shape, t.shape) << stored;
      EXPECT_EQ(reader.tensor(stored).dtype, "F32");
      EXPECT_EQ(reader.readFloat(stored), t.values) << stored;
    }
    // Rotary frequencies: the source's values, under every layer's name.
    for (const auto& t : hf)
      if (t.name.find("inv_freq") != std::string::npos)
        for (int l = 0; l < f.config.num_layers; ++l)
          EXPECT_EQ(reader.readFloat("esm.encoder.layer." + std::to_string(l) +
                                     ".attention.self.rotary_embeddings.inv_freq"),
                    t.values);
    EXPECT_EQ(reader.readFloat("lm_head.decoder.weight"),
              reader.readFloat("esm.embeddings.word_embeddings.weight"));
    auto config =
        model::hf::configFromJson(json::parse([&] {
                                    std::ifstream in(out / "config.json");
                                    return std::string(std::istreambuf_iterator<char>(in), {});
                                  }()),
                                  "config.json");
    EXPECT_EQ(config.num_layers, f.config.num_layers);
    EXPECT_EQ(config.heads, f.config.heads);
    EXPECT_EQ(config.layer_norm_eps, f.config.layer_norm_eps);

    // ... and back to plm: identical.
    const std::string file2 = scratch(name + "_2.h5").string();
    model::hf::convertFromHf(out.string(), file2, MPI_COMM_WORLD);
    EXPECT_EQ(readModel(file2, f.config), values);
  }
  fs::remove_all(scratch("").parent_path());
}

TEST(Convert, Bf16F16AndShardedSources) {
  auto f = plm::test::readFixture(plm::test::fixturePath("small"));
  const auto tensors = model::hf::esmTensors(f.config);

  // BF16: values are the fixture rounded to bf16.
  auto bf16 = fixtureTensors(f, "BF16");
  const fs::path dir = scratch("bf16");
  writeHfDir(dir, f.config, bf16);
  const std::string file = scratch("bf16.h5").string();
  auto summary = model::hf::convertFromHf(dir.string(), file, MPI_COMM_WORLD);
  EXPECT_EQ(summary.source_dtypes,
            (std::vector<std::string>{"BF16"}));  // of the parameters (inv_freq is F32)
  auto values = readModel(file, f.config);
  for (const auto& t : tensors) {
    const auto& want = f.params.at(t.name).values;
    for (std::int64_t i = 0; i < t.size; ++i) {
      float expected = st::bf16ToFloat(st::floatToBf16(float(want[std::size_t(i)])));
      ASSERT_EQ(values[std::size_t(t.offset + i)], expected) << t.name;
    }
  }

  // F16 with synthetic values that binary16 holds exactly; split over two shards with an index.
  std::mt19937 rng(3);
  std::uniform_int_distribution<int> mantissa(0, 1023), exponent(10, 17), sign(0, 1);
  std::vector<HfTensor> f16;
  for (const auto& t : tensors) {
    HfTensor h{t.name, "F16", t.shape, {}};
    for (std::int64_t i = 0; i < t.size; ++i)
      h.values.push_back(
          st::f16ToFloat(std::uint16_t((sign(rng) << 15) | (exponent(rng) << 10) | mantissa(rng))));
    f16.push_back(h);
  }
  const fs::path sharded = scratch("sharded");
  fs::create_directories(sharded);
  writeText(sharded / "config.json", json::write(model::hf::configToJson(f.config)));
  const std::size_t half = f16.size() / 2;
  writeSafetensors(sharded / "model-00001-of-00002.safetensors", {f16.begin(), f16.begin() + half});
  writeSafetensors(sharded / "model-00002-of-00002.safetensors", {f16.begin() + half, f16.end()});
  json::Value index = json::Value::object(), map = json::Value::object();
  for (std::size_t i = 0; i < f16.size(); ++i)
    map.set(f16[i].name,
            i < half ? "model-00001-of-00002.safetensors" : "model-00002-of-00002.safetensors");
  index.set("metadata", json::Value::object());
  index.set("weight_map", map);
  writeText(sharded / "model.safetensors.index.json", json::write(index));
  const std::string file16 = scratch("f16.h5").string();
  summary = model::hf::convertFromHf(sharded.string(), file16, MPI_COMM_WORLD);
  EXPECT_EQ(summary.source_dtypes, (std::vector<std::string>{"F16"}));
  values = readModel(file16, f.config);
  for (std::size_t k = 0; k < tensors.size(); ++k)
    for (std::int64_t i = 0; i < tensors[k].size; ++i)
      ASSERT_EQ(values[std::size_t(tensors[k].offset + i)], f16[k].values[std::size_t(i)])
          << tensors[k].name;
  fs::remove_all(scratch("").parent_path());
}

TEST(Convert, BadInputsSayWhatIsWrong) {
  auto f = plm::test::readFixture(plm::test::fixturePath("small"));
  const std::string out = scratch("bad.h5").string();
  auto convert = [&](const fs::path& dir) {
    return errorOf([&] { model::hf::convertFromHf(dir.string(), out, MPI_COMM_WORLD); });
  };
  auto base = fixtureTensors(f, "F32");
  auto expect = [](const std::string& message, const std::string& words) {
    EXPECT_NE(message.find(words), std::string::npos)
        << "expected \"" << words << "\" in: " << message;
  };

  expect(convert(scratch("nothing_here")), "is not a directory");
  fs::path dir = scratch("no_config");
  fs::create_directories(dir);
  expect(convert(dir), "config.json` not found");

  dir = scratch("no_weights");
  fs::create_directories(dir);
  writeText(dir / "config.json", json::write(model::hf::configToJson(f.config)));
  expect(convert(dir), "neither model.safetensors nor model.safetensors.index.json");
  writeText(dir / "pytorch_model.bin", "pickle");
  expect(convert(dir), "pytorch_model.bin (a Python pickle)");

  dir = scratch("missing_tensor");
  auto missing = base;
  missing.erase(missing.begin() + 3);
  writeHfDir(dir, f.config, missing);
  expect(convert(dir), "lacks the tensor \"" + base[3].name + "\"");

  dir = scratch("wrong_shape");
  auto wrong = base;
  for (auto& t : wrong)
    if (t.name == "lm_head.dense.weight") t.shape = {f.config.hidden / 2, f.config.hidden * 2};
  writeHfDir(dir, f.config, wrong);
  expect(convert(dir), "but config.json implies (16, 16)");

  dir = scratch("unknown_tensor");
  auto unknown = base;
  unknown.push_back({"classifier.dense.weight", "F32", {2, 2}, {1, 2, 3, 4}});
  writeHfDir(dir, f.config, unknown);
  expect(convert(dir),
         "\"classifier.dense.weight\"; plm converts plain ESM-2 masked language models only");

  dir = scratch("untied");
  auto untied = base;
  for (auto& t : untied)
    if (t.name == "lm_head.decoder.weight") t.values[5] += 1.0f;
  writeHfDir(dir, f.config, untied);
  expect(convert(dir), "untied model is not supported");

  dir = scratch("truncated");
  writeHfDir(dir, f.config, base);
  fs::resize_file(dir / "model.safetensors", fs::file_size(dir / "model.safetensors") - 10);
  expect(convert(dir), "truncated");

  dir = scratch("bad_config");
  writeHfDir(dir, f.config, base);
  writeText(dir / "config.json", "{\"model_type\": \"esm\",}");
  expect(convert(dir), "config.json: expected a string key at line 1");

  // --to-hf from something that is not a plm model file.
  expect(errorOf([&] {
           model::hf::convertToHf(plm::test::fixturePath("small"), scratch("x").string(),
                                  MPI_COMM_WORLD);
         }),
         "is not a plm model file");
  fs::remove_all(scratch("").parent_path());
}

namespace {
std::string readFile(const fs::path& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), {});
}
}  // namespace

// `--to-hf` for the Hub: the tokenizer files EsmTokenizer reads, bf16, shards with an index,
// every form read back by `--from-hf` (F32 bit-exact, bf16 as its rounding).
TEST(Convert, HubReadyExport) {
  auto f = plm::test::readFixture(plm::test::fixturePath("small"));
  const fs::path dir = scratch("hub_src");
  writeHfDir(dir, f.config, fixtureTensors(f, "F32"));
  const std::string source = scratch("hub_src.h5").string();
  model::hf::convertFromHf(dir.string(), source, MPI_COMM_WORLD);
  const auto values = readModel(source, f.config);

  // One F32 file, the tokenizer beside it.
  const fs::path plain = scratch("hub_plain");
  model::hf::convertToHf(source, plain.string(), MPI_COMM_WORLD);
  std::string vocab = readFile(plain / "vocab.txt");
  EXPECT_EQ(vocab.substr(0, 27), "<cls>\n<pad>\n<eos>\n<unk>\nL\nA");
  EXPECT_EQ(std::count(vocab.begin(), vocab.end(), '\n'), 33);
  EXPECT_EQ(vocab.substr(vocab.size() - 16), "<null_1>\n<mask>\n");
  auto tokenizer = json::parse(readFile(plain / "tokenizer_config.json"));
  EXPECT_EQ(tokenizer.at("tokenizer_class").asString(), "EsmTokenizer");
  EXPECT_EQ(tokenizer.at("model_max_length").asInt(), f.config.max_positions - 2);
  auto special = json::parse(readFile(plain / "special_tokens_map.json"));
  EXPECT_EQ(special.at("mask_token").asString(), "<mask>");
  EXPECT_EQ(special.at("cls_token").asString(), "<cls>");
  EXPECT_FALSE(fs::exists(plain / "model.safetensors.index.json"));

  // Shards: a limit below the model's size splits it; the index names every tensor's file.
  const fs::path sharded = scratch("hub_sharded");
  model::hf::ExportOptions small;
  small.max_shard_bytes = model::hf::parseByteSize("8KB");
  model::hf::convertToHf(source, sharded.string(), MPI_COMM_WORLD, small);
  EXPECT_FALSE(fs::exists(sharded / "model.safetensors"));
  auto index = json::parse(readFile(sharded / "model.safetensors.index.json"));
  std::set<std::string> files;
  std::int64_t bytes = 0;
  for (const auto& [name, file] : index.at("weight_map").members()) {
    files.insert(file.asString());
    EXPECT_TRUE(st::Reader((sharded / file.asString()).string()).has(name)) << name;
  }
  for (const auto& file : files) {
    const st::Reader shard((sharded / file).string());
    std::int64_t data = 0;
    for (const auto& t : shard.tensors()) data += t.end - t.begin;
    if (shard.tensors().size() > 1) EXPECT_LE(data, 8000) << file;  // one tensor may be larger
    bytes += data;
  }
  EXPECT_GT(files.size(), 2u);
  EXPECT_EQ(*files.begin(), "model-00001-of-" +
                                std::string(5 - std::to_string(files.size()).size(), '0') +
                                std::to_string(files.size()) + ".safetensors");
  EXPECT_EQ(index.at("metadata").at("total_size").asInt(), bytes);
  const std::string back = scratch("hub_sharded.h5").string();
  model::hf::convertFromHf(sharded.string(), back, MPI_COMM_WORLD);
  EXPECT_EQ(readModel(back, f.config), values);  // exact

  // bf16: half the size, every value the bf16 rounding of the fp32 one, read back exactly so.
  const fs::path bf16 = scratch("hub_bf16");
  model::hf::ExportOptions half;
  half.dtype = "BF16";
  model::hf::convertToHf(source, bf16.string(), MPI_COMM_WORLD, half);
  EXPECT_EQ(json::parse(readFile(bf16 / "config.json")).at("torch_dtype").asString(), "bfloat16");
  st::Reader reader((bf16 / "model.safetensors").string());
  EXPECT_EQ(reader.tensor("esm.embeddings.word_embeddings.weight").dtype, "BF16");
  EXPECT_EQ(reader.tensor("esm.encoder.layer.0.attention.self.rotary_embeddings.inv_freq").dtype,
            "F32");
  const std::string from_bf16 = scratch("hub_bf16.h5").string();
  model::hf::convertFromHf(bf16.string(), from_bf16, MPI_COMM_WORLD);
  const auto rounded = readModel(from_bf16, f.config);
  ASSERT_EQ(rounded.size(), values.size());
  bool changed = false;
  for (std::size_t i = 0; i < values.size(); ++i) {
    ASSERT_EQ(rounded[i], st::bf16ToFloat(st::floatToBf16(values[i]))) << i;
    changed = changed || rounded[i] != values[i];
  }
  EXPECT_TRUE(changed);

  EXPECT_EQ(model::hf::parseByteSize("5GB"), 5'000'000'000);
  EXPECT_EQ(model::hf::parseByteSize("2GiB"), 2147483648);
  EXPECT_EQ(model::hf::parseByteSize("1000"), 1000);
  EXPECT_THROW(model::hf::parseByteSize("lots"), plm::Error);
  EXPECT_THROW(model::hf::parseByteSize("5XB"), plm::Error);
  fs::remove_all(scratch("").parent_path());
}

// An MoE model goes out in plm's documented format (not EsmForMaskedLM) and comes back exactly.
TEST(Convert, MoeExportRoundTrip) {
  // GELU experts, then SwiGLU experts (gate_proj, up_proj, down_proj; no biases).
  for (const auto activation :
       {plm::model::ExpertActivation::Gelu, plm::model::ExpertActivation::Swiglu}) {
    const bool swiglu = activation == plm::model::ExpertActivation::Swiglu;
    Esm2Config config;
    config.num_layers = 2;
    config.hidden = 16;
    config.heads = 2;
    config.ffn = 32;
    config.moe.experts = 4;
    config.moe.top_k = 2;
    config.moe.every = 2;  // layer 0 dense, layer 1 MoE
    config.moe.expert_ffn = 8;
    config.moe.shared_experts = 1;
    config.moe.capacity_factor = 1.25;
    config.moe.bias_balance = true;
    config.moe.expert_activation = activation;
    const auto tensors = plm::model::tensorTable(config);
    std::vector<float> values(std::size_t(tensors.back().offset + tensors.back().size), 0.0f);
    std::mt19937 gen(3);
    std::normal_distribution<float> normal;
    for (const auto& t : tensors)
      for (std::int64_t i = 0; i < t.size; ++i) values[std::size_t(t.offset + i)] = normal(gen);
    const std::string source = scratch("moe.h5").string();
    model::writeModelFile(source, MPI_COMM_WORLD, config, tensors, values.data());

    const fs::path out = scratch("moe_hf");
    auto summary = model::hf::convertToHf(source, out.string(), MPI_COMM_WORLD);
    bool warned = false;
    for (const auto& w : summary.warnings)
      warned = warned || w.find("transformers has no ESM MoE class") != std::string::npos;
    EXPECT_TRUE(warned);
    auto j = json::parse(readFile(out / "config.json"));
    EXPECT_EQ(j.at("model_type").asString(), model::hf::moe_model_type);
    EXPECT_EQ(j.at("plm_moe").at("experts").asInt(), 4);
    EXPECT_EQ(j.at("plm_moe").at("router").asString(), "softmax");
    EXPECT_EQ(j.at("plm_moe").at("expert_activation").asString(), swiglu ? "swiglu" : "gelu");
    const st::Reader written((out / "model.safetensors").string());
    for (const char* name :
         {"output.dense.weight", "down_proj.weight", "gate_proj.weight", "up_proj.weight"}) {
      const bool swiglu_name = std::string(name).find("_proj") != std::string::npos;
      EXPECT_EQ(written.has(std::string("esm.encoder.layer.1.moe.experts.3.") + name),
                swiglu_name == swiglu)
          << name;
    }
    EXPECT_TRUE(fs::exists(out / "vocab.txt"));

    const std::string back = scratch("moe_back.h5").string();
    summary = model::hf::convertFromHf(out.string(), back, MPI_COMM_WORLD);
    const Esm2Config read = model::readModelConfig(back);
    EXPECT_EQ(read.moe.experts, 4);
    EXPECT_EQ(read.moe.every, 2);
    EXPECT_EQ(read.moe.expert_ffn, 8);
    EXPECT_EQ(read.moe.shared_experts, 1);
    EXPECT_EQ(read.moe.capacity_factor, 1.25);
    EXPECT_TRUE(read.moe.bias_balance);
    EXPECT_EQ(read.moe.expert_activation, activation);
    std::vector<float> again(values.size(), -1.0f);
    model::readModelValues(back, MPI_COMM_WORLD, read, tensors, again.data());
    for (const auto& t : tensors)
      for (std::int64_t i = 0; i < t.size; ++i)
        ASSERT_EQ(again[std::size_t(t.offset + i)], values[std::size_t(t.offset + i)]) << t.name;
    fs::remove_all(scratch("").parent_path());
  }
}
