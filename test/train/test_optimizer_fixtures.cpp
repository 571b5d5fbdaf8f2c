// plm's optimizers against their published implementations' values: the fixtures that
// validation/optimizer_fixtures.py writes with torch.optim.AdamW, the Lion authors' reference
// step and transformers.Adafactor (test/train/data/optimizer_fixtures.json).  The same starting
// parameters, gradients and learning rates go through plm's kernels; the parameters after 5 steps
// must agree to 1e-5 relative.  Skipped, saying so, where the fixture file has not been made
// (the machine that made this test had no torch; doc/optimizers.md).
#include "io/json.hpp"
#include "train/optim/optimizer.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <sstream>

namespace {

using namespace plm;

TEST(OptimizerFixtures, MatchPublishedImplementations) {
  const std::string path = std::string(PLM_TEST_DATA_DIR) + "/data/optimizer_fixtures.json";
  std::ifstream in(path);
  if (!in)
    GTEST_SKIP() << path << " not made: run validation/optimizer_fixtures.py where torch is "
                 << "installed";
  std::stringstream text;
  text << in.rdbuf();
  const io::json::Value f = io::json::parse(text.str(), path);
  std::vector<model::TensorInfo> tensors;
  std::int64_t size = 0;
  for (const auto& t : f.at("tensors").items()) {
    model::TensorInfo info;
    info.name = t.at("name").asString();
    info.size = 1;
    for (const auto& d : t.at("shape").items()) {
      info.shape.push_back(d.asInt());
      info.size *= d.asInt();
    }
    info.offset = size;
    info.weight_decay = t.at("decay").asBool();
    size += info.size;
    tensors.push_back(info);
  }
  auto flat = [&](const io::json::Value& by_name) {
    std::vector<float> v(size);
    for (const auto& t : tensors) {
      const auto& items = by_name.at(t.name).items();
      for (std::int64_t i = 0; i < t.size; ++i) v[t.offset + i] = float(items[i].asDouble());
    }
    return v;
  };
  auto toView = [](const std::vector<float>& v) {
    View1<float> d("fixture", v.size());
    auto h = Kokkos::create_mirror_view(d);
    for (std::size_t i = 0; i < v.size(); ++i) h(i) = v[i];
    Kokkos::deep_copy(d, h);
    return d;
  };
  for (const auto& c : f.at("cases").items()) {
    const std::string kind = c.at("kind").asString();
    const auto& o = c.at("options");
    train::OptimizerOptions options;
    options.kind = train::parseOptimizerKind(kind);
    if (kind == "adamw") {
      options.adamw = {o.at("beta1").asDouble(), o.at("beta2").asDouble(), o.at("eps").asDouble(),
                       o.at("weight_decay").asDouble()};
    } else if (kind == "lion") {
      options.lion = {o.at("beta1").asDouble(), o.at("beta2").asDouble(),
                      o.at("weight_decay").asDouble()};
    } else if (kind == "adafactor") {
      auto& a = options.adafactor;
      a.eps1 = o.at("eps1").asDouble();
      a.eps2 = o.at("eps2").asDouble();
      a.clip_threshold = o.at("clip_threshold").asDouble();
      a.decay_rate = o.at("decay_rate").asDouble();
      a.weight_decay = o.at("weight_decay").asDouble();
      a.scale_parameter = o.at("scale_parameter").asBool();
    }
    View1<float> params = toView(flat(f.at("params0")));
    auto opt = train::makeOptimizer<float>(options, params, train::wholeLayout(tensors, size));
    const auto& lrs = f.at("lrs").items();
    const auto& grads = f.at("grads").items();
    for (std::size_t s = 0; s < grads.size(); ++s)
      opt->step(ExecSpace(), toView(flat(grads[s])), lrs[s].asDouble());
    const auto want = flat(c.at("params"));
    auto got = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), params);
    for (std::int64_t i = 0; i < size; ++i)
      EXPECT_NEAR(got(i), want[i], 1e-5 * std::max(1.0f, std::abs(want[i]))) << kind << " " << i;
  }
}

}  // namespace
