// Reads a Hugging Face parity fixture (validation/make_parity_fixtures.py) for the tests.
#pragma once

#include "io/hdf5.hpp"
#include "model/esm2.hpp"

#include <cstdlib>
#include <map>
#include <string>
#include <vector>

namespace plm::test {

struct Array {
  std::vector<std::int64_t> shape;
  std::vector<double> values;
};

struct Fixture {
  std::string path;
  model::Esm2Config config;
  double loss = 0;
  std::int64_t num_masked = 0;
  std::string transformers_version;
  std::map<std::string, Array> params, grads;  // by Hugging Face name
  std::vector<std::int32_t> tokens, labels, cu_seqlens;
  Array logits, last_hidden_state;
  std::vector<std::int32_t> embed_tokens, embed_cu_seqlens;
  Array embed_logits, embed_embeddings;
};

/// test/fixtures of the source tree, or $PLM_FIXTURE_DIR (a packaged test run elsewhere).
inline std::string fixtureDir() {
  const char* dir = std::getenv("PLM_FIXTURE_DIR");
  return dir && *dir ? std::string(dir) : std::string(PLM_TEST_DATA_DIR) + "/../fixtures";
}
inline std::vector<std::string> fixtureNames() { return {"small", "multihead"}; }
inline std::string fixturePath(const std::string& name) {
  return fixtureDir() + "/esm_parity_" + name + ".h5";
}

namespace detail {
inline std::vector<std::string> children(hid_t group) {
  H5G_info_t info;
  H5Gget_info(group, &info);
  std::vector<std::string> names;
  for (hsize_t i = 0; i < info.nlinks; ++i) {
    char buffer[512];
    H5Lget_name_by_idx(group, ".", H5_INDEX_NAME, H5_ITER_INC, i, buffer, sizeof buffer,
                       H5P_DEFAULT);
    names.emplace_back(buffer);
  }
  return names;
}

template <class T> std::vector<T> readAll(hid_t file, const std::string& path,
                                          std::vector<std::int64_t>* shape = nullptr) {
  io::h5::Hid dataset = io::h5::openDataset(file, path);
  auto dims = io::h5::datasetShape(dataset);
  std::int64_t n = 1;
  for (auto d : dims) n *= d;
  std::vector<T> values(static_cast<std::size_t>(n));
  io::h5::readRows<T>(dataset, 0, dims.empty() ? 1 : dims[0], values.data(), true);
  if (shape) *shape = dims;
  return values;
}

inline Array readArray(hid_t file, const std::string& path) {
  Array a;
  a.values = readAll<double>(file, path, &a.shape);
  return a;
}
}  // namespace detail

inline Fixture readFixture(const std::string& path) {
  Fixture f;
  f.path = path;
  io::h5::Hid file = io::h5::openFileSerial(path);
  f.config.num_layers = int(io::h5::readIntAttribute(file, "num_layers"));
  f.config.hidden = int(io::h5::readIntAttribute(file, "hidden"));
  f.config.heads = int(io::h5::readIntAttribute(file, "heads"));
  f.config.ffn = int(io::h5::readIntAttribute(file, "ffn"));
  f.config.vocab = int(io::h5::readIntAttribute(file, "vocab"));
  f.config.max_positions = int(io::h5::readIntAttribute(file, "max_positions"));
  f.config.layer_norm_eps = io::h5::readDoubleAttribute(file, "layer_norm_eps");
  f.config.token_dropout = io::h5::readIntAttribute(file, "token_dropout") != 0;
  f.loss = io::h5::readDoubleAttribute(file, "loss");
  f.num_masked = io::h5::readIntAttribute(file, "num_masked");
  f.transformers_version = io::h5::readStringAttribute(file, "transformers_version");
  for (const char* group : {"params", "grads"}) {
    io::h5::Hid g(H5Gopen2(file, group, H5P_DEFAULT));
    auto& target = std::string(group) == "params" ? f.params : f.grads;
    for (const auto& name : detail::children(g))
      target[name] = detail::readArray(file, std::string(group) + "/" + name);
  }
  f.tokens = detail::readAll<std::int32_t>(file, "batch/tokens");
  f.labels = detail::readAll<std::int32_t>(file, "batch/labels");
  f.cu_seqlens = detail::readAll<std::int32_t>(file, "batch/cu_seqlens");
  f.logits = detail::readArray(file, "logits");
  f.last_hidden_state = detail::readArray(file, "last_hidden_state");
  f.embed_tokens = detail::readAll<std::int32_t>(file, "embed/tokens");
  f.embed_cu_seqlens = detail::readAll<std::int32_t>(file, "embed/cu_seqlens");
  f.embed_logits = detail::readArray(file, "embed/logits");
  f.embed_embeddings = detail::readArray(file, "embed/embeddings");
  return f;
}

}  // namespace plm::test
