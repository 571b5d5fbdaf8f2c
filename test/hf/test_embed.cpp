// `plm embed` against the transformers fixtures: mean-pooled embeddings and unmasked logits of
// the fixture's sequences, at 1 and 2 ranks, with micro-batches small enough to split the input;
// and the documented truncation of sequences longer than the model's context.
#include "cli/commands.hpp"
#include "data/batch.hpp"
#include "fixture.hpp"
#include "model/esm2.hpp"
#include "model/hf_esm.hpp"
#include "model/model_file.hpp"

#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <random>

namespace {

int rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

std::string tempPath(const std::string& name) {
  int world = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  return "test_hf_embed_np" + std::to_string(world) + "_" + name;
}

std::string letters(const std::vector<std::int32_t>& tokens, std::int32_t begin, std::int32_t end) {
  std::string s;
  for (std::int32_t t = begin; t < end; ++t)
    s += plm::data::vocab::letters[tokens[t] - plm::data::vocab::first_residue];
  return s;
}

void writeModel(const std::string& path, const plm::test::Fixture& f,
                const plm::model::Esm2Config& config) {
  const auto tensors = plm::model::hf::esmTensors(config);
  std::vector<float> values(std::size_t(tensors.back().offset + tensors.back().size));
  for (const auto& t : tensors)
    for (std::int64_t i = 0; i < t.size; ++i)
      values[std::size_t(t.offset + i)] = float(f.params.at(t.name).values[std::size_t(i)]);
  plm::model::writeModelFile(path, MPI_COMM_WORLD, config, tensors, values.data());
}

double maxRelative(const std::vector<float>& got, const std::vector<double>& want) {
  EXPECT_EQ(got.size(), want.size());
  double diff = 0, scale = 0;
  for (std::size_t i = 0; i < std::min(got.size(), want.size()); ++i) {
    diff = std::max(diff, std::abs(double(got[i]) - want[i]));
    scale = std::max(scale, std::abs(want[i]));
  }
  return diff / scale;
}

void removeAll(const std::vector<std::string>& paths) {
  MPI_Barrier(MPI_COMM_WORLD);
  if (rank() == 0)
    for (const auto& p : paths) std::remove(p.c_str());
}

}  // namespace

TEST(Embed, MatchesTransformers) {
  for (const auto& name : plm::test::fixtureNames()) {
    const auto f = plm::test::readFixture(plm::test::fixturePath(name));
    const std::string model = tempPath(name + "_model.h5"), fasta = tempPath(name + ".fasta"),
                      out = tempPath(name + "_out.h5");
    const std::size_t n = f.embed_cu_seqlens.size() - 1;
    if (rank() == 0) {
      std::ofstream os(fasta);
      for (std::size_t s = 0; s < n; ++s) {
        const std::string seq =
            letters(f.embed_tokens, f.embed_cu_seqlens[s] + 1, f.embed_cu_seqlens[s + 1] - 1);
        const std::size_t wrap = std::min<std::size_t>(7, seq.size());  // a record over two lines
        os << ">seq" << s << " a description\n"
           << seq.substr(0, wrap) << "\n"
           << seq.substr(wrap) << "\n";
      }
    }
    writeModel(model, f, f.config);
    ASSERT_EQ(plm::cli::runEmbed({"--checkpoint", model, "--fasta", fasta, "--out", out, "--logits",
                                  "--batch-tokens", "40"}),
              0);

    auto file = plm::io::h5::openFileSerial(out);
    std::vector<std::int64_t> shape;
    auto embeddings = plm::test::detail::readAll<float>(file, "embeddings", &shape);
    EXPECT_EQ(shape, (std::vector<std::int64_t>{std::int64_t(n), f.config.hidden}));
    const double embedding_error = maxRelative(embeddings, f.embed_embeddings.values);
    EXPECT_LE(embedding_error, 1e-5) << name;
    auto logits = plm::test::detail::readAll<float>(file, "logits", &shape);
    EXPECT_EQ(shape, (std::vector<std::int64_t>{std::int64_t(f.embed_tokens.size()), 33}));
    const double logits_error = maxRelative(logits, f.embed_logits.values);
    EXPECT_LE(logits_error, 1e-5) << name;
    auto offsets = plm::test::detail::readAll<std::int64_t>(file, "offsets");
    ASSERT_EQ(offsets.size(), n + 1);
    for (std::size_t s = 0; s <= n; ++s) EXPECT_EQ(offsets[s], f.embed_cu_seqlens[s]);
    auto ids = plm::io::h5::readStrings(file, "ids", 0, std::int64_t(n));
    for (std::size_t s = 0; s < n; ++s) EXPECT_EQ(ids[s], "seq" + std::to_string(s));
    auto lengths = plm::test::detail::readAll<std::int64_t>(file, "lengths");
    for (std::size_t s = 0; s < n; ++s)
      EXPECT_EQ(lengths[s], f.embed_cu_seqlens[s + 1] - f.embed_cu_seqlens[s] - 2);
    if (rank() == 0)
      std::printf(
          "[embed] %s: embeddings %.3e, logits %.3e (max relative error vs transformers float64)\n",
          name.c_str(), embedding_error, logits_error);
    file = plm::io::h5::Hid();
    removeAll({model, fasta, out});
  }
}

TEST(Embed, LongSequencesKeepTheirFirstResidues) {
  const auto f = plm::test::readFixture(plm::test::fixturePath("small"));
  auto config = f.config;
  config.max_positions = 12;  // 10 tokens: <cls> + 8 residues + <eos>
  const std::string model = tempPath("trunc_model.h5"), fasta = tempPath("trunc.fasta"),
                    out = tempPath("trunc_out.h5");
  const std::string long_seq = "MKTAYIAKQRQISFVK";  // 16 residues
  if (rank() == 0) {
    std::ofstream os(fasta);
    os << ">long\n" << long_seq << "\n>prefix\n" << long_seq.substr(0, 8) << "\n>short\nMKT\n";
  }
  writeModel(model, f, config);
  ASSERT_EQ(plm::cli::runEmbed({"--checkpoint", model, "--fasta", fasta, "--out", out, "--logits"}),
            0);
  auto file = plm::io::h5::openFileSerial(out);
  EXPECT_EQ(plm::io::h5::readIntAttribute(file, "num_truncated"), 1);
  EXPECT_EQ(plm::io::h5::readIntAttribute(file, "max_residues"), 8);
  auto lengths = plm::test::detail::readAll<std::int64_t>(file, "lengths");
  EXPECT_EQ(lengths, (std::vector<std::int64_t>{16, 8, 3}));
  auto offsets = plm::test::detail::readAll<std::int64_t>(file, "offsets");
  EXPECT_EQ(offsets, (std::vector<std::int64_t>{0, 10, 20, 25}));
  // The truncated sequence and its prefix are the same residues at two positions of one packed
  // batch. Equal in exact arithmetic, not bitwise: the BLAS kernel (OpenBLAS picks one per
  // processor) may block rows 0..9 and 10..19 differently and so sum in another order. fp32 sums
  // of a few dozen terms reordered differ by a few ulp (eps 6e-8); 1e-5 of the row's largest
  // magnitude allows ~100 ulp and still catches a single wrong residue or position by far.
  auto expectSameRow = [](const std::vector<float>& v, std::size_t a, std::size_t b, int n,
                          const char* what) {
    float scale = 0;
    for (int i = 0; i < n; ++i) scale = std::max(scale, std::abs(v[a + std::size_t(i)]));
    ASSERT_GT(scale, 0.0f) << what;
    for (int i = 0; i < n; ++i)
      ASSERT_NEAR(v[a + std::size_t(i)], v[b + std::size_t(i)], 1e-5f * scale) << what << " " << i;
  };
  auto embeddings = plm::test::detail::readAll<float>(file, "embeddings");
  const int h = config.hidden;
  expectSameRow(embeddings, 0, std::size_t(h), h, "embedding");  // long == its prefix
  auto logits = plm::test::detail::readAll<float>(file, "logits");
  expectSameRow(logits, 0, 10 * 33, 10 * 33, "logit");
  file = plm::io::h5::Hid();
  removeAll({model, fasta, out});
}

TEST(Embed, BadInputsAreRefused) {
  const std::string fasta = tempPath("bad.fasta");
  if (rank() == 0) {
    std::ofstream os(fasta);
    os << ">x\nMKT\n";
  }
  MPI_Barrier(MPI_COMM_WORLD);
  auto message = [&](const std::vector<std::string>& argv) {
    try {
      plm::cli::runEmbed(argv);
    } catch (const plm::Error& e) {
      EXPECT_TRUE(e.collective());
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(message({"--checkpoint", "missing.h5", "--fasta", fasta, "--out", "o.h5"})
                .find("does not exist"),
            std::string::npos);
  EXPECT_NE(message({"--fasta", fasta, "--out", "o.h5"})
                .find("--checkpoint, --fasta and --out are required"),
            std::string::npos);
  EXPECT_NE(message({"--checkpoint", fasta, "--fasta", fasta, "--out", "o.h5"})
                .find("not a readable HDF5 file"),
            std::string::npos);

  // An invalid record: its file and line, or left out with --on-invalid skip.
  const auto f = plm::test::readFixture(plm::test::fixturePath("small"));
  const std::string model = tempPath("bad_model.h5"), invalid = tempPath("invalid.fasta"),
                    out = tempPath("bad_out.h5");
  if (rank() == 0) {
    std::ofstream os(invalid);
    os << ">x\nMKT\n>y\nMK1Q\n>z\nAAG\n";
  }
  writeModel(model, f, f.config);
  const std::string error = message({"--checkpoint", model, "--fasta", invalid, "--out", out});
  EXPECT_NE(error.find(invalid + ":4:"), std::string::npos) << error;
  EXPECT_NE(
      message({"--checkpoint", model, "--fasta", invalid, "--out", out, "--on-invalid", "maybe"})
          .find("--on-invalid takes"),
      std::string::npos);
  ASSERT_EQ(plm::cli::runEmbed(
                {"--checkpoint", model, "--fasta", invalid, "--out", out, "--on-invalid", "skip"}),
            0);
  {
    auto file = plm::io::h5::openFileSerial(out);
    EXPECT_EQ(plm::io::h5::readStrings(file, "ids", 0, 2), (std::vector<std::string>{"x", "z"}));
  }
  removeAll({fasta, model, invalid, out});
}

// The input checks are plm prep's (data::checkRecords): a file made mostly of nucleotide-like
// records is refused unless --allow-nucleotide, an empty identifier is named after its header.
TEST(Embed, InputChecksArePrepChecks) {
  const auto f = plm::test::readFixture(plm::test::fixturePath("small"));
  const std::string model = tempPath("checks_model.h5"), dna = tempPath("dna.fasta"),
                    unnamed = tempPath("unnamed.fasta"), out = tempPath("checks_out.h5");
  if (rank() == 0) {
    std::ofstream(dna)
        << ">a\nACGTACGTACGTACGTACGTACGTAC\n>b\nMKTAYIAKQR\n>c\nGGCCAATTGGCCAATTGGCCAA\n";
    std::ofstream(unnamed) << ">first\nMKTAYIAKQR\n>\nMKVLAAGIV\n";
  }
  writeModel(model, f, f.config);
  std::string error;
  try {
    plm::cli::runEmbed({"--checkpoint", model, "--fasta", dna, "--out", out});
  } catch (const plm::Error& e) {
    EXPECT_TRUE(e.collective());
    error = e.what();
  }
  EXPECT_NE(error.find("plm embed: " + dna + ": 2 of its 3 record(s) look like nucleotide"),
            std::string::npos)
      << error;
  EXPECT_NE(error.find("--allow-nucleotide"), std::string::npos) << error;
  ASSERT_EQ(plm::cli::runEmbed(
                {"--checkpoint", model, "--fasta", dna, "--out", out, "--allow-nucleotide"}),
            0);
  ASSERT_EQ(plm::cli::runEmbed({"--checkpoint", model, "--fasta", unnamed, "--out", out}), 0);
  {
    auto file = plm::io::h5::openFileSerial(out);
    const std::string name = unnamed.substr(unnamed.find_last_of('/') + 1);
    EXPECT_EQ(plm::io::h5::readStrings(file, "ids", 0, 2),
              (std::vector<std::string>{"first", "unnamed:" + name + ":3"}));
  }
  removeAll({model, dna, unnamed, out});
}

// MoE inference is drop-less by default, so embeddings and logits do not depend on the batch
// size (--batch-tokens 3 puts each sequence in a micro-batch of its own) or the rank count (the
// np1 and np2 runs both equal that per-sequence reference); --set moe.dropless=false applies the
// model's capacity factor per micro-batch, which then changes the output.
TEST(Embed, MoeOutputDoesNotDependOnBatching) {
  plm::model::Esm2Config config;
  config.num_layers = 2;
  config.hidden = 32;
  config.heads = 4;
  config.ffn = 64;
  config.moe.experts = 4;
  config.moe.top_k = 2;
  config.moe.every = 1;
  config.moe.expert_ffn = 32;
  config.moe.capacity_factor = 1.0;  // trained with dropping
  const std::string model = tempPath("moe_model.h5"), fasta = tempPath("moe.fasta");
  {
    plm::model::Esm2<float> esm(config);
    esm.initialize(11);
    plm::model::writeModelFile(model, MPI_COMM_WORLD, esm);
  }
  if (rank() == 0) {
    std::mt19937 gen(5);
    std::uniform_int_distribution<int> length(8, 60), residue(0, 19);
    std::ofstream os(fasta);
    for (int i = 0; i < 12; ++i) {
      os << ">s" << i << "\n";
      const int n = length(gen);
      for (int k = 0; k < n; ++k) os << "LAGVSERTIDPKQNFYMHWC"[residue(gen)];
      os << "\n";
    }
  }
  MPI_Barrier(MPI_COMM_WORLD);
  auto embed = [&](const std::string& batch, const std::vector<std::string>& more) {
    const std::string out = tempPath("moe_out_" + batch + ".h5");
    std::vector<std::string> argv = {
        "--checkpoint", model, "--fasta", fasta, "--out", out, "--logits", "--batch-tokens", batch};
    argv.insert(argv.end(), more.begin(), more.end());
    EXPECT_EQ(plm::cli::runEmbed(argv), 0);
    auto file = plm::io::h5::openFileSerial(out);
    auto e = plm::test::detail::readAll<float>(file, "embeddings");
    auto l = plm::test::detail::readAll<float>(file, "logits");
    file = plm::io::h5::Hid();
    removeAll({out});
    e.insert(e.end(), l.begin(), l.end());
    return e;
  };
  auto maxDifference = [](const std::vector<float>& a, const std::vector<float>& b) {
    EXPECT_EQ(a.size(), b.size());
    double d = 0;
    for (std::size_t i = 0; i < std::min(a.size(), b.size()); ++i)
      d = std::max(d,
                   std::abs(double(a[i]) - double(b[i])) / std::max(1.0, std::abs(double(b[i]))));
    return d;
  };
  const auto reference = embed("3", {});
  for (const char* batch : {"64", "100000"}) {
    const double d = maxDifference(embed(batch, {}), reference);
    EXPECT_LE(d, 1e-6) << "--batch-tokens " << batch;
    if (rank() == 0) std::printf("[embed] MoE drop-less, --batch-tokens %s vs 3: %.2e\n", batch, d);
  }
  const auto capped_one = embed("3", {"--set", "moe.dropless=false"});
  const auto capped_all = embed("100000", {"--set", "moe.dropless=false"});
  EXPECT_GT(maxDifference(capped_all, capped_one), 1e-4)
      << "a capacity per micro-batch should drop slots of the large batch";
  EXPECT_GT(maxDifference(capped_all, reference), 1e-4);
  std::string error;
  try {
    embed("3", {"--set", "train.steps=3"});
  } catch (const plm::Error& e) {
    error = e.what();
  }
  EXPECT_NE(error.find("embed takes moe.dropless and moe.capacity_factor only"), std::string::npos)
      << error;
  removeAll({model, fasta});
}

// The rule `plm eval` and `plm embed` share (cli::inferenceRouting).
TEST(Embed, InferenceRoutingRule) {
  plm::model::Esm2Config config;
  config.moe.experts = 4;
  config.moe.capacity_factor = 1.5;  // what training used
  auto routed = [&](const std::vector<std::string>& sets) {
    plm::model::Esm2Config c = config;
    plm::cli::inferenceRouting(c, sets, "test");
    return c.moe.capacity_factor;
  };
  EXPECT_EQ(routed({}), 0.0);
  EXPECT_EQ(routed({"moe.dropless=true"}), 0.0);
  EXPECT_EQ(routed({"moe.capacity_factor=2.0"}), 0.0);  // only with dropless=false
  EXPECT_EQ(routed({"moe.dropless=false"}), 1.5);
  EXPECT_EQ(routed({"moe.dropless=false", "moe.capacity_factor=2.0"}), 2.0);
  config.moe.capacity_factor = 0;  // trained drop-less: the deck default
  EXPECT_EQ(routed({"moe.dropless=false"}), 1.25);
  EXPECT_THROW(routed({"moe.dropless=maybe"}), plm::Error);
  plm::model::Esm2Config dense;
  plm::cli::inferenceRouting(dense, {"moe.dropless=false"}, "test");
  EXPECT_FALSE(dense.moe.enabled());
}
