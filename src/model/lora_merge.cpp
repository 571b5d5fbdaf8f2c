// mergeLora: the plain model of an adapted one (esm2.hpp), on the host.
//
// Design choice: a host loop in double over each target's (out, in) weight: it runs once per
// export, costs r multiply-adds per weight element, and gives one result on every build.
#include "core/error.hpp"
#include "model/esm2.hpp"

#include <unordered_map>

namespace plm::model {

std::vector<float> mergeLora(const Esm2Config& config, const std::vector<TensorInfo>& tensors,
                             const float* values) {
  Esm2Config plain = config;
  plain.lora = LoraConfig{};
  const auto out_table = tensorTable(plain);
  std::unordered_map<std::string, const TensorInfo*> by_name;
  for (const auto& t : tensors) by_name[t.name] = &t;
  // The plain model's whole flat buffer, alignment padding included (Esm2::bufferElements).
  const std::int64_t n = (out_table.back().offset + out_table.back().size + 15) / 16 * 16;
  std::vector<float> out(std::size_t(n), 0.0f);
  const double s = config.lora.scale();
  for (const auto& t : out_table) {
    auto it = by_name.find(t.name);
    if (it == by_name.end() || it->second->size != t.size || it->second->offset < 0)
      throw Error("plm::model::mergeLora: tensor \"" + t.name +
                  "\" is missing from the adapted model's table (a bug)");
    const float* w = values + it->second->offset;
    float* dst = out.data() + t.offset;
    const std::string stem =
        t.name.size() > 7 && t.name.compare(t.name.size() - 7, 7, ".weight") == 0
            ? t.name.substr(0, t.name.size() - 7)
            : std::string();
    auto a_it = stem.empty() ? by_name.end() : by_name.find(stem + ".lora_A.weight");
    if (a_it == by_name.end()) {
      std::copy(w, w + t.size, dst);
      continue;
    }
    const TensorInfo& ta = *a_it->second;
    const TensorInfo& tb = *by_name.at(stem + ".lora_B.weight");
    const std::int64_t rows = t.shape[0], cols = t.shape[1], r = ta.shape[0];
    PLM_REQUIRE(ta.shape[1] == cols && tb.shape[0] == rows && tb.shape[1] == r,
                "plm::model::mergeLora: adapter shapes of " + t.name + " (a bug)");
    const float* a = values + ta.offset;
    const float* b = values + tb.offset;
    for (std::int64_t i = 0; i < rows; ++i)
      for (std::int64_t j = 0; j < cols; ++j) {
        double acc = 0.0;
        for (std::int64_t k = 0; k < r; ++k) acc += double(b[i * r + k]) * double(a[k * cols + j]);
        dst[i * cols + j] = static_cast<float>(double(w[i * cols + j]) + s * acc);
      }
  }
  return out;
}

}  // namespace plm::model
