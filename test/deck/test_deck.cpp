// Deck validation: every error a user can cause is one line naming the key and what is allowed,
// the inputs/ decks and the XML/YAML forms agree, and doc/deck.md matches the schema.
#include "core/error.hpp"
#include "deck/deck.hpp"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>

namespace fs = std::filesystem;
using Teuchos::ParameterList;

namespace {

Teuchos::RCP<ParameterList> resolveYaml(const std::string& yaml,
                                        const std::vector<std::string>& overrides = {}) {
  return plm::deck::resolve(*plm::deck::readYamlString(yaml), overrides);
}

/// The message of the plm::Error that `f` throws; checks it is collective, one line and free
/// of Teuchos' internals.
std::string errorOf(const std::function<void()>& f) {
  try {
    f();
  } catch (const plm::Error& e) {
    std::string m = e.what();
    EXPECT_TRUE(e.collective()) << m;
    EXPECT_EQ(m.find('\n'), std::string::npos) << m;
    for (const char* noise : {"Teuchos", "Throw", ".cpp", "Parser was", "ANONYMOUS"})
      EXPECT_EQ(m.find(noise), std::string::npos) << noise << " in: " << m;
    return m;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "not a plm::Error: " << e.what();
    return "";
  }
  ADD_FAILURE() << "expected an error";
  return "";
}

std::string yamlError(const std::string& yaml, const std::vector<std::string>& overrides = {}) {
  return errorOf([&] { resolveYaml(yaml, overrides); });
}

#define EXPECT_HAS(text, part)                               \
  EXPECT_NE(std::string(text).find(part), std::string::npos) \
      << "missing `" << (part) << "` in: " << (text)

std::string writeTemp(const std::string& name, const std::string& text) {
  fs::path p = fs::path(testing::TempDir()) / name;
  std::ofstream(p) << text;
  return p.string();
}

std::string readFileText(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

TEST(DeckSchema, EveryKeyHasADefaultAndADoc) {
  auto schema = plm::deck::schema();
  int keys = 0;
  for (const char* section : {"model", "data", "optimizer", "schedule", "train", "checkpoint"}) {
    ASSERT_TRUE(schema->isSublist(section)) << section;
    const auto& s = schema->sublist(section);
    for (auto it = s.begin(); it != s.end(); ++it, ++keys)
      EXPECT_FALSE(s.entry(it).docString().empty()) << section << "." << s.name(it);
  }
  EXPECT_GE(keys, 30);
  EXPECT_DOUBLE_EQ(schema->sublist("optimizer").get<double>("lr"), 4e-4);
  EXPECT_EQ(schema->sublist("data").get<std::string>("train"), "data/train.h5");
  EXPECT_EQ(schema->sublist("checkpoint").get<std::string>("resume"), "auto");
}

TEST(DeckSchema, EmptyDeckResolvesToTheDefaults) {
  auto deck = resolveYaml("# nothing but a comment\n");
  EXPECT_TRUE(Teuchos::haveSameValues(*deck, *plm::deck::schema()));
  auto betas = deck->sublist("optimizer").get<Teuchos::Array<double>>("betas");
  ASSERT_EQ(betas.size(), 2);
  EXPECT_DOUBLE_EQ(betas[0], 0.9);
  EXPECT_DOUBLE_EQ(betas[1], 0.98);
}

TEST(DeckSchema, DefaultDeckIsCommentedAndReadsBackToTheDefaults) {
  std::string text = plm::deck::defaultsYaml();
  auto list = plm::deck::readYamlString(text);
  auto deck = plm::deck::resolve(*list);
  EXPECT_TRUE(Teuchos::haveSameValues(*deck, *plm::deck::schema()));
  // Every key is written out, each after a comment line.
  for (const char* section : {"model", "data", "optimizer", "schedule", "train", "checkpoint"}) {
    const auto& s = plm::deck::schema()->sublist(section);
    for (auto it = s.begin(); it != s.end(); ++it) {
      EXPECT_TRUE(list->sublist(section).isParameter(s.name(it))) << s.name(it);
      std::string line = "\n  " + s.name(it) + ": ";
      auto at = text.find(line);
      ASSERT_NE(at, std::string::npos) << line;
      auto prev = text.rfind('\n', at - 1);
      EXPECT_EQ(text.substr(prev + 1, 4), "  # ") << s.name(it);
    }
  }
}

TEST(DeckValidation, UnknownKeyNamesSectionAndSuggests) {
  std::string m = yamlError("optimizer: { lrr: 1.0e-3 }\n");
  EXPECT_HAS(m, "unknown key `lrr`");
  EXPECT_HAS(m, "section `optimizer`");
  EXPECT_HAS(m, "did you mean `lr`?");

  m = yamlError("schedule:\n  warmup_step: 10\n");
  EXPECT_HAS(m, "did you mean `warmup_steps`?");

  // Right key, wrong section.
  m = yamlError("optimizer: { warmup_steps: 10 }\n");
  EXPECT_HAS(m, "schedule.warmup_steps");
}

TEST(DeckValidation, UnknownSectionSuggests) {
  std::string m = yamlError("optimiser: { lr: 1.0e-3 }\n");
  EXPECT_HAS(m, "unknown section `optimiser`");
  EXPECT_HAS(m, "did you mean `optimizer`?");

  m = yamlError("lr: 1.0e-3\n");  // a key without its section
  EXPECT_HAS(m, "`lr` at the top level");
  EXPECT_HAS(m, "did you mean `optimizer.lr`?");

  m = yamlError("model: esm2_8m\n");
  EXPECT_HAS(m, "`model` is a section");
}

TEST(DeckValidation, WrongTypeNamesKeyValueAndWhatIsAllowed) {
  std::string m = yamlError("train: { steps: many }\n");
  EXPECT_HAS(m, "train.steps = many is not an integer");
  EXPECT_HAS(m, ">= 1");

  m = yamlError("optimizer: { lr: fast }\n");
  EXPECT_HAS(m, "optimizer.lr = fast is not a number");

  m = yamlError("train: { log_all_ranks: 3 }\n");
  EXPECT_HAS(m, "train.log_all_ranks = 3 is not true or false");

  m = yamlError("optimizer: { betas: [0.9] }\n");
  EXPECT_HAS(m, "optimizer.betas = [0.9] is not a list of two numbers");

  m = yamlError("train: { steps: 2.5 }\n");
  EXPECT_HAS(m, "train.steps = 2.5 is not an integer");

  m = yamlError("data: { train: 0.5 }\n");
  EXPECT_HAS(m, "data.train = 0.5 is not a string");

  m = yamlError("model: { layers: { a: 1 } }\n");
  EXPECT_HAS(m, "model.layers takes an integer");

  m = yamlError("data:\n  valid:\n");
  EXPECT_HAS(m, "data.valid has no value");
}

TEST(DeckValidation, OutOfRangeNamesTheRange) {
  struct Case {
    const char* yaml;
    const char* expected;
  };
  for (const Case& c : {
           Case{"optimizer: { lr: -1.0e-3 }",
                "optimizer.lr = -0.001 is out of range (allowed: > 0)"},
           Case{"optimizer: { lr: 0 }", "optimizer.lr = 0 is out of range (allowed: > 0)"},
           Case{"optimizer: { betas: [0.9, 1.0] }", "allowed: two numbers, each in [0, 1)"},
           Case{"data: { mask_prob: 1.0 }",
                "data.mask_prob = 1.0 is out of range (allowed: in (0, 1))"},
           Case{"data: { micro_batch_tokens: 512 }", "(allowed: >= 1024)"},
           Case{"data: { max_seq_len: 8 }", "(allowed: >= 16)"},
           Case{"train: { steps: 0 }", "train.steps = 0 is out of range (allowed: >= 1)"},
           Case{"schedule: { final_lr_ratio: 1.5 }", "(allowed: in [0, 1])"},
           Case{"checkpoint: { keep: -1 }", "checkpoint.keep = -1 is out of range (allowed: >= 0)"},
           Case{"data: { tokens_per_batch: 10000000000 }", "data.tokens_per_batch = 10000000000"},
       })
    EXPECT_HAS(yamlError(c.yaml), c.expected);
}

TEST(DeckValidation, EnumerationsListTheirValues) {
  std::string m = yamlError("train: { precision: fp16 }\n");
  EXPECT_HAS(m, "train.precision = fp16 is not allowed");
  EXPECT_HAS(m, "one of fp32, bf16");

  m = yamlError("schedule: { decay: cosin }\n");
  EXPECT_HAS(m, "did you mean `cosine`?");
  EXPECT_HAS(m, "one of linear, cosine, constant");

  m = yamlError("model: { preset: esm2_9m }\n");
  EXPECT_HAS(m,
             "esm2_8m, esm2_35m, esm2_150m, esm2_650m, esm2_3b, esm2_15b, "
             "esm2_moe_100m_a35m, esm2_moe_2b_a650m, aido_protein_16b, custom");

  m = yamlError("moe: { router: softmx }\n");
  EXPECT_HAS(m, "moe.router = softmx is not allowed");
  EXPECT_HAS(m, "one of softmax, sigmoid");
  m = yamlError("moe: { capacity_factor: 0 }\n");
  EXPECT_HAS(m, "moe.capacity_factor");
  m = yamlError("parallel: { expert_degree: 0 }\n");
  EXPECT_HAS(m, "parallel.expert_degree");
}

TEST(DeckValidation, IntegersAreAcceptedForReals) {
  auto deck = resolveYaml(
      "optimizer: { lr: 1, betas: [0, 0], clip_grad_norm: 2, weight_decay: 0 }\n"
      "train: { steps: 5e5, peak_tflops: 989 }\n");
  const auto& opt = deck->sublist("optimizer");
  EXPECT_EQ(opt.getEntry("lr").getAny().type(), typeid(double));
  EXPECT_DOUBLE_EQ(opt.get<double>("lr"), 1.0);
  EXPECT_DOUBLE_EQ(opt.get<double>("clip_grad_norm"), 2.0);
  auto betas = opt.get<Teuchos::Array<double>>("betas");
  EXPECT_DOUBLE_EQ(betas[0], 0.0);
  EXPECT_DOUBLE_EQ(betas[1], 0.0);
  // An integer written as a real with no fraction is an integer.
  EXPECT_EQ(deck->sublist("train").get<int>("steps"), 500000);
  EXPECT_DOUBLE_EQ(deck->sublist("train").get<double>("peak_tflops"), 989.0);
}

TEST(DeckValidation, CrossKeyRules) {
  std::string m = yamlError("model: { preset: custom, layers: 4, hidden: 128, heads: 4 }\n");
  EXPECT_HAS(m, "model.preset custom needs model.ffn");
  m = yamlError("model: { preset: custom, layers: 4, hidden: 128 }\n");
  EXPECT_HAS(m, "model.preset custom needs model.heads and model.ffn");

  m = yamlError("model: { preset: custom, layers: 4, hidden: 130, heads: 4, ffn: 512 }\n");
  EXPECT_HAS(m, "model.hidden = 130 is not a multiple of model.heads = 4");

  m = yamlError("model: { preset: custom, layers: 4, hidden: 132, heads: 4, ffn: 512 }\n");
  EXPECT_HAS(m, "= 33 is odd");

  // Overrides of a preset combine with its other sizes: esm2_8m has hidden 320.
  m = yamlError("model: { preset: esm2_8m, heads: 7 }\n");
  EXPECT_HAS(m, "model.hidden = 320 is not a multiple of model.heads = 7");
  EXPECT_NO_THROW(resolveYaml("model: { preset: esm2_8m, heads: 10 }\n"));

  m = yamlError("data: { tokens_per_batch: 4096, micro_batch_tokens: 8192 }\n");
  EXPECT_HAS(m, "data.tokens_per_batch = 4096 is smaller than data.micro_batch_tokens = 8192");

  m = yamlError("schedule: { warmup_steps: 100, decay_steps: 50 }\n");
  EXPECT_HAS(m, "schedule.decay_steps = 50");

  auto deck =
      resolveYaml("model: { preset: custom, layers: 4, hidden: 128, heads: 4, ffn: 512 }\n");
  EXPECT_EQ(deck->sublist("model").get<int>("hidden"), 128);
}

TEST(DeckOverrides, SetReplacesValuesWithTheSameValidation) {
  auto deck = resolveYaml("optimizer: { lr: 1.0e-3 }\n",
                          {"optimizer.lr=1e-4", "optimizer.betas=[0.8, 0.95]", "train.steps=20",
                           "model.recompute=selective", "data.valid="});
  EXPECT_DOUBLE_EQ(deck->sublist("optimizer").get<double>("lr"), 1e-4);
  EXPECT_DOUBLE_EQ(deck->sublist("optimizer").get<Teuchos::Array<double>>("betas")[0], 0.8);
  EXPECT_EQ(deck->sublist("train").get<int>("steps"), 20);
  EXPECT_EQ(deck->sublist("model").get<std::string>("recompute"), "selective");
  EXPECT_EQ(deck->sublist("data").get<std::string>("valid"), "");

  std::string m = yamlError("", {"optimizer.lrr=1"});
  EXPECT_HAS(m, "--set optimizer.lrr=1");
  EXPECT_HAS(m, "did you mean `lr`?");

  m = yamlError("", {"optimiser.lr=1"});
  EXPECT_HAS(m, "did you mean `optimizer`?");

  m = yamlError("", {"train.steps=abc"});
  EXPECT_HAS(m, "train.steps = abc is not an integer");

  m = yamlError("", {"optimizer.lr=-1"});
  EXPECT_HAS(m, "out of range (allowed: > 0)");

  m = yamlError("", {"lr=1e-4"});
  EXPECT_HAS(m, "did you mean `optimizer.lr`?");

  m = yamlError("", {"optimizer.lr"});
  EXPECT_HAS(m, "expected section.key=value");
}

TEST(DeckFiles, XmlAndYamlResolveToTheSameList) {
  const fs::path inputs = fs::path(PLM_SOURCE_DIR) / "inputs";
  auto from_yaml = plm::deck::load((inputs / "quickstart.yaml").string());
  auto from_xml = plm::deck::load((inputs / "quickstart.xml").string());
  EXPECT_TRUE(Teuchos::haveSameValues(*from_yaml, *from_xml));
  EXPECT_EQ(plm::deck::toYaml(*from_yaml), plm::deck::toYaml(*from_xml));
  // ... and the quickstart deck really differs from the defaults, so the test can fail.
  EXPECT_FALSE(Teuchos::haveSameValues(*from_yaml, *plm::deck::schema()));
}

TEST(DeckFiles, EveryInputDeckValidates) {
  int decks = 0;
  for (const auto& entry : fs::directory_iterator(fs::path(PLM_SOURCE_DIR) / "inputs")) {
    auto ext = entry.path().extension();
    if (ext != ".yaml" && ext != ".yml" && ext != ".xml") continue;
    EXPECT_NO_THROW(plm::deck::load(entry.path().string())) << entry.path();
    ++decks;
  }
  EXPECT_GE(decks, 8);  // six ESM-2 sizes and the quickstart in YAML and XML
}

TEST(DeckFiles, XmlValuesAreCheckedByTheKeyType) {
  const std::string head = "<ParameterList name=\"plm\"><ParameterList name=\"model\">";
  const std::string tail = "</ParameterList></ParameterList>";
  auto xml = [&](const std::string& body) { return head + body + tail; };
  auto list =
      plm::deck::readXmlString(xml("<Parameter name=\"layers\" type=\"int\" value=\"4\"/>"));
  EXPECT_EQ(plm::deck::resolve(*list)->sublist("model").get<int>("layers"), 4);

  // Teuchos itself would read this as 0; a deck error names it.
  std::string m = errorOf([&] {
    plm::deck::resolve(
        *plm::deck::readXmlString(xml("<Parameter name=\"layers\" type=\"int\" value=\"abc\"/>")));
  });
  EXPECT_HAS(m, "model.layers = abc is not an integer");

  m = errorOf([&] {
    plm::deck::readXmlString(
        xml("<Parameter name=\"layers\" type=\"int\" value=\"4\"/>"
            "<Parameter name=\"layers\" type=\"int\" value=\"5\"/>"));
  });
  EXPECT_HAS(m, "`model.layers` appears twice");

  m = errorOf([&] { plm::deck::readXmlString(head + "<Parameter name=\"x\""); });
  EXPECT_HAS(m, "not a valid XML deck");
}

TEST(DeckFiles, SyntaxErrorsAndFileProblemsAreOneLine) {
  std::string m =
      errorOf([] { plm::deck::readYamlString("model: { preset: esm2_8m\ndata: {}\n"); });
  EXPECT_HAS(m, "YAML syntax error");
  EXPECT_HAS(m, "line ");

  m = errorOf([] { plm::deck::readYamlString("model:\n  preset: esm2_8m\n  preset: esm2_35m\n"); });
  EXPECT_HAS(m, "`preset` appears twice");

  m = errorOf([] { plm::deck::load(writeTemp("deck.txt", "model: {}\n")); });
  EXPECT_HAS(m, "unknown deck format `.txt`");

  m = errorOf([] { plm::deck::load("/nonexistent/deck.yaml"); });
  EXPECT_HAS(m, "deck /nonexistent/deck.yaml: cannot open it");

  // Errors from a file name the file.
  m = errorOf([] { plm::deck::load(writeTemp("bad.yaml", "train: { steps: -3 }\n")); });
  EXPECT_HAS(m, "bad.yaml: train.steps = -3 is out of range");
}

TEST(DeckFiles, YamlWithAWrapperKeyOrDocumentMarkersReads) {
  auto a = resolveYaml("%YAML 1.1\n---\nANONYMOUS:\n  optimizer:\n    lr: 0.002\n...\n");
  EXPECT_DOUBLE_EQ(a->sublist("optimizer").get<double>("lr"), 0.002);
}

TEST(DeckFiles, ResolvedYamlRoundTrips) {
  auto deck = resolveYaml(
      "optimizer: { lr: 3.0e-4, betas: [0.9, 0.95] }\n"
      "data: { valid: \"\", seed: 7 }\n"
      "train: { run_dir: 'runs/a b: c, it''s' }\n"
      "checkpoint: { resume: '123' }\n");
  EXPECT_EQ(deck->sublist("train").get<std::string>("run_dir"), "runs/a b: c, it's");
  std::string path = (fs::path(testing::TempDir()) / "deck.yaml").string();
  plm::deck::writeResolved(*deck, path);
  auto again = plm::deck::load(path);
  EXPECT_TRUE(Teuchos::haveSameValues(*deck, *again)) << readFileText(path);
  EXPECT_EQ(again->sublist("checkpoint").get<std::string>("resume"), "123");
  EXPECT_EQ(again->sublist("data").get<std::string>("valid"), "");
  EXPECT_DOUBLE_EQ(again->sublist("optimizer").get<double>("lr"), 3e-4);
}

TEST(DeckDocs, ReferenceIsUpToDate) {
  const fs::path doc = fs::path(PLM_SOURCE_DIR) / "doc" / "deck.md";
  EXPECT_EQ(readFileText(doc), plm::deck::referenceMarkdown())
      << "doc/deck.md differs from the schema; regenerate it with: "
         "build/plm deck --markdown > doc/deck.md";
}

TEST(DeckDocs, ReferenceDocumentsEveryKey) {
  std::string md = plm::deck::referenceMarkdown();
  auto schema = plm::deck::schema();
  for (auto it = schema->begin(); it != schema->end(); ++it) {
    EXPECT_HAS(md, "## `" + schema->name(it) + "`");
    const auto& s = schema->sublist(schema->name(it));
    for (auto kt = s.begin(); kt != s.end(); ++kt) EXPECT_HAS(md, "| `" + s.name(kt) + "` |");
  }
}
