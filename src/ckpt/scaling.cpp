// The checkpoint's /scaling group (ckpt/detail/scaling.hpp).
#include "ckpt/detail/scaling.hpp"

#include "ckpt/checkpoint.hpp"
#include "core/log.hpp"
#include "dist/process_groups.hpp"
#include "io/hdf5.hpp"

namespace plm::ckpt::detail {

namespace h5 = io::h5;

template <class P> ScalingState takeScaling(model::Esm2<P>& model) {
  ScalingState s;
  s.precision = model.config().precision;
  if (const model::Fp8Scaling* f = model.fp8Scaling()) {
    s.config = f->config();
    s.layers = f->numLayers();
    s.moe_layers = f->numMoeLayers();
    s.experts = f->numExperts();
    s.steps = f->steps();
    s.histories = f->histories();
    s.scales = f->scales();
  }
  return s;
}

void writeScaling(hid_t file, const ScalingState& s, MPI_Comm comm) {
  h5::Hid g = h5::createGroup(file, "scaling");
  h5::writeAttribute(g, "precision", std::string(model::precisionName(s.precision)));
  if (s.precision != model::Precision::Fp8) return;
  const auto& c = s.config;
  h5::writeAttribute(g, "recipe", std::string(model::fp8RecipeName(c.recipe)));
  h5::writeAttribute(g, "format", std::string(model::fp8FormatName(c.format)));
  h5::writeAttribute(g, "amax_history", std::int64_t(c.amax_history));
  h5::writeAttribute(g, "amax_reduce", std::string(model::amaxReduceName(c.amax_reduce)));
  h5::writeAttribute(g, "margin", std::int64_t(c.margin));
  h5::writeAttribute(g, "first_layers_bf16", std::int64_t(c.first_layers_bf16));
  h5::writeAttribute(g, "last_layers_bf16", std::int64_t(c.last_layers_bf16));
  h5::writeAttribute(g, "wgrad", std::string(model::fp8WgradName(c.wgrad)));
  h5::writeAttribute(g, "steps", s.steps);
  h5::writeAttribute(g, "layers", std::int64_t(s.layers));
  h5::writeAttribute(g, "moe_layers", std::int64_t(s.moe_layers));
  h5::writeAttribute(g, "experts", std::int64_t(s.experts));
  const int rank = dist::commRank(comm);
  const std::int64_t rows = static_cast<std::int64_t>(s.scales.size());
  h5::Hid hist = h5::createDataset<float>(g, "amax_history", {rows, c.amax_history});
  h5::writeRows<float>(hist, 0, rank == 0 ? rows : 0, s.histories.data());
  h5::Hid scale = h5::createDataset<float>(g, "scale", {rows});
  h5::writeRows<float>(scale, 0, rank == 0 ? rows : 0, s.scales.data());
}

ScalingState readScaling(hid_t file, const std::string& path) {
  ScalingState s;
  try {
    if (!h5::exists(file, "scaling")) return s;
    h5::Hid g(PLM_CHECK_H5(H5Gopen2(file, "scaling", H5P_DEFAULT)));
    if (!h5::hasAttribute(g, "precision")) return s;  // written before FP8: the empty group
    s.precision = model::parsePrecision(h5::readStringAttribute(g, "precision"));
    if (s.precision != model::Precision::Fp8) return s;
    auto& c = s.config;
    c.recipe = model::parseFp8Recipe(h5::readStringAttribute(g, "recipe"));
    c.format = model::parseFp8Format(h5::readStringAttribute(g, "format"));
    c.amax_history = static_cast<int>(h5::readIntAttribute(g, "amax_history"));
    c.amax_reduce = model::parseAmaxReduce(h5::readStringAttribute(g, "amax_reduce"));
    c.margin = static_cast<int>(h5::readIntAttribute(g, "margin"));
    c.first_layers_bf16 = static_cast<int>(h5::readIntAttribute(g, "first_layers_bf16"));
    c.last_layers_bf16 = static_cast<int>(h5::readIntAttribute(g, "last_layers_bf16"));
    c.wgrad = model::parseFp8Wgrad(h5::readStringAttribute(g, "wgrad"));
    s.steps = h5::readIntAttribute(g, "steps");
    s.layers = static_cast<int>(h5::readIntAttribute(g, "layers"));
    if (h5::hasAttribute(g, "experts")) {  // written since FP8 experts
      s.moe_layers = static_cast<int>(h5::readIntAttribute(g, "moe_layers"));
      s.experts = static_cast<int>(h5::readIntAttribute(g, "experts"));
    }
    h5::Hid hist = h5::openDataset(g, "amax_history");
    h5::Hid scale = h5::openDataset(g, "scale");
    const auto hs = h5::datasetShape(hist), ss = h5::datasetShape(scale);
    const std::int64_t rows =
        (std::int64_t(s.layers) * model::fp8_gemms + std::int64_t(s.moe_layers) * s.experts * 2) *
        model::fp8_operands;
    if (hs.size() != 2 || hs[0] != rows || hs[1] != c.amax_history || ss.size() != 1 ||
        ss[0] != rows)
      throw CorruptCheckpoint("checkpoint `" + path +
                              "`: /scaling datasets do not have the shapes its attributes give");
    s.histories.resize(std::size_t(rows) * c.amax_history);
    s.scales.resize(rows);
    h5::readRows<float>(hist, 0, rows, s.histories.data());
    h5::readRows<float>(scale, 0, rows, s.scales.data());
  } catch (const CorruptCheckpoint&) {
    throw;
  } catch (const std::exception& e) {
    throw CorruptCheckpoint("checkpoint `" + path + "`: /scaling is unreadable: " + e.what());
  }
  return s;
}

template <class P> std::string scalingRefusal(const ScalingState& stored, model::Esm2<P>& model) {
  const model::Fp8Scaling* now = model.fp8Scaling();
  if (stored.precision != model::Precision::Fp8 || !now) return {};
  const auto& a = stored.config;
  const auto& b = now->config();
  auto differs = [](const char* key, const std::string& x, const std::string& y) {
    return std::string(key) + " was " + x + " when the checkpoint was written and is " + y +
           " now: the stored FP8 scaling state (/scaling) belongs to the other recipe; restore " +
           key + ", or resume with train.precision: bf16/fp32 (the state is then dropped)";
  };
  if (a.recipe != b.recipe)
    return differs("fp8.recipe", model::fp8RecipeName(a.recipe), model::fp8RecipeName(b.recipe));
  if (a.format != b.format)
    return differs("fp8.format", model::fp8FormatName(a.format), model::fp8FormatName(b.format));
  if (a.amax_history != b.amax_history)
    return differs("fp8.amax_history", std::to_string(a.amax_history),
                   std::to_string(b.amax_history));
  if (stored.layers != now->numLayers())
    return "/scaling holds " + std::to_string(stored.layers) + " layers, the model has " +
           std::to_string(now->numLayers());
  if (stored.moe_layers != now->numMoeLayers() || stored.experts != now->numExperts())
    return "/scaling holds FP8 slots for " + std::to_string(stored.moe_layers) + " MoE layers of " +
           std::to_string(stored.experts) + " experts, the model has " +
           std::to_string(now->numMoeLayers()) + " of " + std::to_string(now->numExperts()) +
           " (moe.experts or moe.every changed; parallel.expert_degree may change freely)";
  return {};
}

template <class P> void restoreScaling(const ScalingState& stored, model::Esm2<P>& model) {
  model::Fp8Scaling* now = model.fp8Scaling();
  if (!now) {
    if (stored.precision == model::Precision::Fp8)
      log::warn("checkpoint: its FP8 scaling state is dropped (train.precision is now %s)",
                model::precisionName(model.config().precision));
    return;
  }
  if (stored.precision != model::Precision::Fp8) {
    log::info("checkpoint: written under train.precision: %s; FP8 scaling starts fresh",
              model::precisionName(stored.precision));
    return;
  }
  model.restoreFp8Scaling(stored.histories, stored.scales, stored.steps);
}

template ScalingState takeScaling<float>(model::Esm2<float>&);
template std::string scalingRefusal<float>(const ScalingState&, model::Esm2<float>&);
template void restoreScaling<float>(const ScalingState&, model::Esm2<float>&);

}  // namespace plm::ckpt::detail
