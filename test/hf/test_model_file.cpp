// The plm model file: collective row-range writes at 1, 2 and 4 ranks read back exactly, config
// attributes round-trip, and mismatched or foreign files are refused with a clear message.
#include "core/error.hpp"
#include "io/hdf5.hpp"
#include "model/hf_esm.hpp"
#include "model/model_file.hpp"

#include <gtest/gtest.h>
#include <mpi.h>

#include <cmath>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

namespace io = plm::io;
namespace model = plm::model;
using plm::model::Esm2Config;

namespace {

int worldSize() {
  int size = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  return size;
}

std::string tempPath(const std::string& name) {
  return "test_hf_model_file_np" + std::to_string(worldSize()) + "_" + name + ".h5";
}

Esm2Config smallConfig() {
  Esm2Config c;
  c.num_layers = 2;
  c.hidden = 8;
  c.heads = 2;
  c.ffn = 12;
  c.max_positions = 130;
  c.layer_norm_eps = 1e-6;
  c.token_dropout = false;
  return c;
}

// Distinct, non-trivial values so a row written to the wrong place shows.
std::vector<float> patternValues(std::int64_t n) {
  std::vector<float> v(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i)
    v[std::size_t(i)] = float(std::sin(0.37 * double(i)) * (1.0 + double(i) / 7.0));
  return v;
}

std::string errorOf(const std::function<void()>& f) {
  try {
    f();
  } catch (const plm::Error& e) {
    return e.what();
  }
  return "";
}

void removeOnRankZero(const std::string& path) {
  MPI_Barrier(MPI_COMM_WORLD);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (rank == 0) std::remove(path.c_str());
}

}  // namespace

TEST(ModelFile, RowRangesTileEveryTensor) {
  for (std::int64_t rows : {0, 1, 3, 7, 33, 1280}) {
    for (int world : {1, 2, 3, 4, 8}) {
      std::int64_t next = 0;
      for (int r = 0; r < world; ++r) {
        auto [first, last] = model::rowRange(rows, r, world);
        EXPECT_EQ(first, next);
        EXPECT_LE(first, last);
        next = last;
      }
      EXPECT_EQ(next, rows);
    }
  }
}

TEST(ModelFile, WriteReadRoundTripIsExact) {
  const Esm2Config config = smallConfig();
  const auto tensors = model::hf::esmTensors(config);
  const auto values = patternValues(tensors.back().offset + tensors.back().size);
  model::ModelAttributes extra;
  extra.strings["source"] = "unit test";
  extra.integers["step"] = 42;
  extra.numbers["loss"] = 2.5;
  const std::string path = tempPath("roundtrip");
  model::writeModelFile(path, MPI_COMM_WORLD, config, tensors, values.data(), extra);

  Esm2Config back = model::readModelConfig(path);
  EXPECT_EQ(back.num_layers, config.num_layers);
  EXPECT_EQ(back.hidden, config.hidden);
  EXPECT_EQ(back.heads, config.heads);
  EXPECT_EQ(back.ffn, config.ffn);
  EXPECT_EQ(back.vocab, config.vocab);
  EXPECT_EQ(back.max_positions, config.max_positions);
  EXPECT_EQ(back.layer_norm_eps, config.layer_norm_eps);
  EXPECT_EQ(back.token_dropout, config.token_dropout);

  std::vector<float> read(values.size(), -1.0f);
  model::readModelValues(path, MPI_COMM_WORLD, config, tensors, read.data());
  EXPECT_EQ(read, values);

  {
    io::h5::Hid file = io::h5::openFileSerial(path);
    EXPECT_EQ(io::h5::readStringAttribute(file, "source"), "unit test");
    EXPECT_EQ(io::h5::readIntAttribute(file, "step"), 42);
    EXPECT_EQ(io::h5::readDoubleAttribute(file, "loss"), 2.5);
    EXPECT_EQ(io::h5::readStringAttribute(file, "architecture"), "EsmForMaskedLM");
    // Full Hugging Face shapes under /model.
    io::h5::Hid dataset =
        io::h5::openDataset(file, "model/esm.encoder.layer.1.intermediate.dense.weight");
    EXPECT_EQ(io::h5::datasetShape(dataset), (std::vector<std::int64_t>{12, 8}));
  }
  removeOnRankZero(path);
}

TEST(ModelFile, IndependentWritesGiveTheSameFile) {
  const Esm2Config config = smallConfig();
  const auto tensors = model::hf::esmTensors(config);
  const auto values = patternValues(tensors.back().offset + tensors.back().size);
  const std::string path = tempPath("independent");
  {
    io::h5::Hid file = io::h5::createFile(path, MPI_COMM_WORLD);
    model::writeConfigAttributes(file, config);
    model::writeTensorGroup(file, MPI_COMM_WORLD, "model", tensors, values.data(),
                            /*independent=*/true);
    model::writeTensorGroup(file, MPI_COMM_WORLD, "optimizer/exp_avg", tensors, values.data(),
                            true);
  }
  std::vector<float> read(values.size(), -1.0f);
  model::readModelValues(path, MPI_COMM_WORLD, config, tensors, read.data());
  EXPECT_EQ(read, values);
  {
    io::h5::Hid file = io::h5::openFile(path, MPI_COMM_WORLD);
    std::fill(read.begin(), read.end(), -1.0f);
    model::readTensorGroup(file, MPI_COMM_WORLD, "optimizer/exp_avg", tensors, read.data(), path);
    EXPECT_EQ(read, values);
  }
  removeOnRankZero(path);
}

TEST(ModelFile, MismatchesAreRefused) {
  const Esm2Config config = smallConfig();
  const auto tensors = model::hf::esmTensors(config);
  const auto values = patternValues(tensors.back().offset + tensors.back().size);
  const std::string path = tempPath("mismatch");
  model::writeModelFile(path, MPI_COMM_WORLD, config, tensors, values.data());
  std::vector<float> read(values.size());

  // Same tensor shapes, different head count: only the config can tell.
  Esm2Config heads = config;
  heads.heads = 4;
  std::string message =
      errorOf([&] { model::readModelValues(path, MPI_COMM_WORLD, heads, tensors, read.data()); });
  EXPECT_NE(message.find("heads 2"), std::string::npos) << message;

  // A model with a tensor the file lacks.
  auto more = tensors;
  more.push_back(more.back());
  more.back().name = "lm_head.extra";
  more.back().offset = 0;
  message =
      errorOf([&] { model::readModelValues(path, MPI_COMM_WORLD, config, more, read.data()); });
  EXPECT_NE(message.find("lacks /model/lm_head.extra"), std::string::npos) << message;

  // A file with a tensor the model lacks.
  auto fewer = tensors;
  fewer.pop_back();
  message =
      errorOf([&] { model::readModelValues(path, MPI_COMM_WORLD, config, fewer, read.data()); });
  EXPECT_NE(message.find("lm_head.layer_norm.bias is not a parameter"), std::string::npos)
      << message;

  // Same names, different shape.
  auto reshaped = tensors;
  reshaped[0].shape = {3, 11 * 8};
  message =
      errorOf([&] { model::readModelValues(path, MPI_COMM_WORLD, config, reshaped, read.data()); });
  EXPECT_NE(message.find("has shape (33, 8), the model expects (3, 88)"), std::string::npos)
      << message;
  removeOnRankZero(path);
}

TEST(ModelFile, ForeignFilesAreRefused) {
  const std::string path = tempPath("foreign");
  {
    io::h5::Hid file = io::h5::createFile(path, MPI_COMM_WORLD);
    io::h5::writeAttribute(file, "format", std::string("something-else"));
  }
  std::string message = errorOf([&] { model::readModelConfig(path); });
  EXPECT_NE(message.find("is not a plm model file"), std::string::npos) << message;
  EXPECT_NE(message.find("plm convert --from-hf"), std::string::npos) << message;
  {
    io::h5::Hid file = io::h5::createFile(path, MPI_COMM_WORLD);
    io::h5::writeAttribute(file, "format", std::string(model::model_format));
    io::h5::writeAttribute(file, "format_version", model::model_format_version + 1);
  }
  message = errorOf([&] { model::readModelConfig(path); });
  EXPECT_NE(message.find("newer than this plm"), std::string::npos) << message;
  removeOnRankZero(path);
  message = errorOf([&] { model::readModelConfig(path + ".missing"); });
  EXPECT_NE(message.find("does not exist"), std::string::npos) << message;
}
