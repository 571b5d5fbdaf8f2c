// model.init_from: the weights of another model as a run's starting point (init_from.hpp).
#include "ckpt/init_from.hpp"

#include "ckpt/checkpoint.hpp"
#include "ckpt/detail/agree.hpp"
#include "ckpt/detail/load.hpp"
#include "ckpt/detail/redistribute.hpp"
#include "ckpt/detail/rows.hpp"
#include "ckpt/detail/snapshot.hpp"
#include "core/log.hpp"
#include "dist/process_groups.hpp"
#include "io/hdf5.hpp"
#include "io/hdf5_group.hpp"
#include "io/json.hpp"
#include "model/hf_esm.hpp"
#include "model/model_file.hpp"
#include "train/fsdp.hpp"

#include <Kokkos_Core.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <set>
#include <type_traits>

namespace plm::ckpt {

namespace fs = std::filesystem;

namespace {

using dist::commRank;
using dist::commSize;

std::string shapeText(const std::vector<std::int64_t>& shape) {
  std::string s = "(";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + ")";
}

bool startsWith(const std::string& s, const std::string& prefix) {
  return s.compare(0, prefix.size(), prefix) == 0;
}

bool endsWith(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

std::string join(const std::vector<std::string>& items) {
  std::string out;
  for (const auto& s : items) out += (out.empty() ? "" : ", ") + s;
  return out;
}

// Why a source tensor that plm has no place for is left out, or "" when it is not one of the
// heads and buffers a model file normally holds (then it is a name mismatch).
std::string whyNotUsed(const std::string& name) {
  if (name == "lm_head.decoder.weight") return "the LM decoder, tied to the word embedding";
  if (endsWith(name, "rotary_embeddings.inv_freq") || name == "esm.embeddings.position_ids")
    return "a buffer plm computes";
  if (startsWith(name, "esm.contact_head.")) return "the contact head, unused by plm";
  if (startsWith(name, "esm.pooler.") || startsWith(name, "pooler."))
    return "a pooler, unused by plm";
  if (startsWith(name, "classifier.")) return "a task head, unused by plm";
  return "";
}

std::string configText(const model::Esm2Config& c) {
  std::string s = "layers " + std::to_string(c.num_layers) + ", hidden " +
                  std::to_string(c.hidden) + ", heads " + std::to_string(c.heads) + ", ffn " +
                  std::to_string(c.ffn);
  if (c.moe.enabled())
    s += ", moe.experts " + std::to_string(c.moe.experts) + ", moe.every " +
         std::to_string(c.moe.every) + ", moe.expert_ffn " + std::to_string(c.moe.expert_ffn);
  return s;
}

// A source of weights by the model's (Hugging Face) names.
struct Source {
  std::string path, kind;
  bool has_config = false;
  model::Esm2Config config;
  std::vector<std::string> warnings;
  std::vector<std::string> names;                           // model names, source order
  std::map<std::string, std::string> stored;                // model name -> name in the source
  std::map<std::string, std::vector<std::int64_t>> shapes;  // model name -> shape in the source
  std::unique_ptr<model::hf::Weights> hf;                   // Hugging Face
  io::h5::Hid file, group;                                  // plm (opened for reading)

  void add(const std::string& name, const std::string& in_source, std::vector<std::int64_t> shape) {
    names.push_back(name);
    stored[name] = in_source;
    shapes[name] = std::move(shape);
  }

  // Rows [first, first + count) of `name` into `out` (independent reads: ranks read their own).
  void readRows(const std::string& name, std::int64_t first, std::int64_t count, float* out) const {
    if (count == 0) return;
    if (hf) {
      const auto values = hf->readRows(stored.at(name), first, count);
      std::copy(values.begin(), values.end(), out);
    } else {
      io::h5::Hid dataset = io::h5::openDataset(group, stored.at(name));
      io::h5::readRows<float>(dataset, first, count, out, /*independent=*/true);
    }
  }
};

// What `path` is, and its tensors by name and shape (every rank alone; no data read).
Source describeSource(const std::string& path) {
  Source s;
  const fs::path p(path);
  std::error_code ec;
  if (!fs::exists(p, ec))
    throw Error("model.init_from: `" + path +
                "` does not exist; give a plm model file, a checkpoint (file or directory) or a "
                "Hugging Face model directory");
  std::string h5_path;
  bool hf = false;
  if (fs::is_directory(p, ec)) {
    if (fs::exists(p / "config.json") || fs::exists(p / "model.safetensors") ||
        fs::exists(p / "model.safetensors.index.json")) {
      hf = true;
    } else if (const auto listed = listCheckpoints(path); !listed.empty()) {
      h5_path = listed.back().path;  // a checkpoint directory: its newest checkpoint
    } else if (fs::exists(p / "model.h5")) {
      h5_path = (p / "model.h5").string();  // a run directory
    } else {
      throw Error("model.init_from: directory `" + path +
                  "` holds no config.json or model.safetensors (a Hugging Face model), no "
                  "step_*.h5 (a checkpoint directory) and no model.h5 (a run directory)");
    }
  } else {
    hf = endsWith(path, ".safetensors") || endsWith(path, ".safetensors.index.json");
    if (!hf) h5_path = path;
  }

  if (hf) {
    s.path = path;
    s.kind = "Hugging Face model";
    s.hf = std::make_unique<model::hf::Weights>(path);
    const fs::path config = (fs::is_directory(p, ec) ? p : p.parent_path()) / "config.json";
    if (fs::exists(config)) {
      s.config = model::hf::readConfigFile(config.string(), nullptr, /*any_esm_head=*/true);
      s.has_config = true;
    }
    const auto names = s.hf->names();
    // EsmModel (and a bare encoder) saves its tensors without the "esm." prefix.
    const bool bare = std::none_of(names.begin(), names.end(),
                                   [](const std::string& n) { return startsWith(n, "esm."); });
    for (const auto& n : names) {
      const bool encoder = startsWith(n, "embeddings.") || startsWith(n, "encoder.") ||
                           startsWith(n, "contact_head.");
      s.add(bare && encoder ? "esm." + n : n, n, s.hf->entry(n).shape);
    }
    return s;
  }
  s.path = h5_path;
  s.config = model::readModelConfig(h5_path);  // refuses a file that is not plm's
  s.has_config = true;
  io::h5::Hid file = io::h5::openFileSerial(h5_path);
  s.kind = io::h5::exists(file, "state") ? "plm checkpoint" : "plm model file";
  if (!io::h5::exists(file, "model"))
    throw Error("model.init_from: `" + h5_path + "` has no /model group");
  io::h5::Hid group(PLM_CHECK_H5(H5Gopen2(file, "model", H5P_DEFAULT)));
  for (const auto& name : io::h5::groupMembers(group)) {
    io::h5::Hid dataset = io::h5::openDataset(group, name);
    s.add(name, name, io::h5::datasetShape(dataset));
  }
  return s;
}

// The model's tensors the source has (loaded), refusals, and what is left out either way.
struct Match {
  std::set<std::string> loaded;
  InitReport report;
};

Match matchSource(const Source& source, const std::vector<model::TensorInfo>& whole,
                  const model::Esm2Config& mine) {
  Match m;
  auto& r = m.report;
  r.path = source.path;
  r.kind = source.kind;
  const std::string where = "model.init_from: `" + source.path + "`";
  const std::string theirs =
      source.has_config ? " (the source: " + configText(source.config) + ")" : "";
  if (source.has_config) {
    const auto& c = source.config;
    if (c.heads != mine.heads)
      throw Error(
          where + " has " + std::to_string(c.heads) + " attention heads, the model " +
          std::to_string(mine.heads) +
          " (heads do not show in tensor shapes); set model.heads: " + std::to_string(c.heads));
    if (c.token_dropout != mine.token_dropout)
      r.warnings.push_back(std::string("the source was built with token_dropout ") +
                           (c.token_dropout ? "true" : "false") + ", this model uses " +
                           (mine.token_dropout ? "true" : "false"));
    if (c.layer_norm_eps != mine.layer_norm_eps)
      r.warnings.push_back("the source's layer_norm_eps is " + std::to_string(c.layer_norm_eps) +
                           ", this model's " + std::to_string(mine.layer_norm_eps));
    if (c.moe.enabled() && mine.moe.enabled() &&
        (c.moe.top_k != mine.moe.top_k || c.moe.router != mine.moe.router ||
         c.moe.normalize_topk != mine.moe.normalize_topk))
      r.warnings.push_back("the source routes top-" + std::to_string(c.moe.top_k) + " with a " +
                           model::routerName(c.moe.router) + " router, this model top-" +
                           std::to_string(mine.moe.top_k) + " with a " +
                           model::routerName(mine.moe.router) + " router (moe.*)");
  } else {
    r.warnings.push_back(
        "the source has no config (a bare safetensors file): only names and "
        "shapes were checked, not the head count");
  }
  std::set<std::string> known;
  for (const auto& t : whole) {
    known.insert(t.name);
    auto it = source.shapes.find(t.name);
    if (it == source.shapes.end()) {
      r.not_loaded.push_back(t.name);
      continue;
    }
    if (it->second != t.shape)
      throw Error(where + ": tensor \"" + t.name + "\" is " + shapeText(it->second) +
                  " in the source but " + shapeText(t.shape) + " in the model" + theirs +
                  "; make the deck's model section match the source");
    m.loaded.insert(t.name);
    r.tensors_loaded += 1;
    r.parameters_loaded += t.size;
  }
  std::vector<std::string> unknown;
  for (const auto& name : source.names) {
    if (known.count(name)) continue;
    const std::string why = whyNotUsed(name);
    if (why.empty())
      unknown.push_back("\"" + source.stored.at(name) + "\" " + shapeText(source.shapes.at(name)));
    else
      r.not_used.push_back(source.stored.at(name) + " (" + why + ")");
  }
  if (!unknown.empty()) {
    std::vector<std::string> first(unknown.begin(),
                                   unknown.begin() + std::min<std::size_t>(unknown.size(), 4));
    throw Error(where + " holds " + std::to_string(unknown.size()) +
                " tensor(s) the model does not have: " + join(first) +
                (unknown.size() > first.size() ? ", ..." : "") + theirs +
                "; make the deck's model section match the source");
  }
  if (m.loaded.empty())
    throw Error(where + " shares no tensor with the model (" + std::to_string(whole.size()) +
                " tensors, e.g. \"" + whole.front().name + "\")");
  return m;
}

// Puts `values` (host, the optimizer's master layout) into `target` (device or host).
void putMaster(const View1<master_t>& target, const std::vector<float>& values) {
  auto host = Kokkos::create_mirror_view(Kokkos::HostSpace(), target);
  std::memcpy(host.data(), values.data(), values.size() * sizeof(float));
  Kokkos::deep_copy(target, host);
}

std::vector<float> hostCopy(const View1<master_t>& master) {
  auto host = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), master);
  return std::vector<float>(host.data(), host.data() + host.extent(0));
}

}  // namespace

InitReport initFrom(train::Trainer& trainer, const std::string& path) {
  static_assert(std::is_same_v<master_t, float>, "init_from reads fp32 masters");
  const MPI_Comm comm = trainer.comm();
  auto& model = trainer.model();
  const auto& config = model.config();
  const auto& placement = model.expertPlacement();
  const auto& tensors = model.tensors();
  Source source;
  Match match;
  detail::agree(comm, [&] {
    source = describeSource(path);
    match = matchSource(source, model::wholeTable(tensors, placement, config.moe.experts).tensors,
                        config);
  });
  const int rank = commRank(comm), world = commSize(comm);
  if (!source.hf) {
    io::h5::Hid file;
    detail::agree(comm, [&] { file = io::h5::openFile(source.path, comm); });
    source.file = std::move(file);
    source.group = io::h5::Hid(PLM_CHECK_H5(H5Gopen2(source.file, "model", H5P_DEFAULT)));
  }

  // Read this rank's rows of every loaded tensor, then share or redistribute them as a
  // checkpoint's /model is; the trainer changes only once every rank has read its part.
  const detail::StatePath state_path = detail::statePath(trainer);
  std::vector<float> values;
  if (state_path == detail::StatePath::FullLayout) {
    auto& optimizer = trainer.optimizer();
    values = hostCopy(optimizer.master());  // the model's own initialisation where not loaded
    const detail::HeldLayout held =
        detail::heldLayout(tensors, placement, config.moe.experts, rank, world);
    detail::agree(comm, [&] {
      for (std::size_t i = 0; i < held.tensors.size(); ++i)
        if (match.loaded.count(held.tensors[i].name) && held.rows.row_count[i] > 0)
          source.readRows(held.tensors[i].name, held.rows.first_row[i], held.rows.row_count[i],
                          values.data() + held.rows.at[i]);
    });
    detail::shareHeldRows(tensors, values.data(), placement, comm);
    putMaster(optimizer.master(), values);
    if (!optimizer.mastersAlias()) optimizer.syncParameters(ExecSpace());
  } else {
    train::Fsdp<param_t>& fsdp = *trainer.sharding();
    train::Optimizer<param_t>& optimizer = fsdp.optimizer();
    const MPI_Comm shard = fsdp.shardComm();
    const detail::RowsLayout rows = detail::compactRows(tensors, commRank(shard), commSize(shard));
    std::vector<float> compact(static_cast<std::size_t>(rows.size));
    detail::agree(comm, [&] {
      for (std::size_t i = 0; i < tensors.size(); ++i)
        if (match.loaded.count(tensors[i].name))
          source.readRows(tensors[i].name, rows.first_row[i], rows.row_count[i],
                          compact.data() + rows.at[i]);
    });
    // Only the loaded tensors move; the shards keep their initialisation elsewhere.
    auto loaded = [&](const detail::Segment& s) {
      return match.loaded.count(tensors[std::size_t(s.tensor)].name) > 0;
    };
    std::vector<detail::Segment> from, to;
    for (const auto& s : detail::rowSegments(rows))
      if (loaded(s)) from.push_back(s);
    for (const auto& s : detail::pieceSegments(optimizer.layout().pieces))
      if (loaded(s)) to.push_back(s);
    values = hostCopy(optimizer.master());
    detail::redistribute(shard, detail::tensorSizes(tensors), from, compact.data(), to,
                         values.data());
    trainer.discardFullState();
    putMaster(optimizer.master(), values);
    fsdp.restoredShards(ExecSpace());  // derived copies recast, gathered units stale
  }
  Kokkos::fence();
  return match.report;
}

void applyInitFrom(train::Trainer& trainer) {
  const std::string path = trainer.deck().sublist("model").get<std::string>("init_from");
  if (path.empty()) return;
  const InitReport r = initFrom(trainer, path);
  log::info(
      "model.init_from: loaded %lld of the model's tensors (%lld parameters) from %s (%s); the "
      "optimizer state, the schedule and the data stream start fresh",
      static_cast<long long>(r.tensors_loaded), static_cast<long long>(r.parameters_loaded),
      r.path.c_str(), r.kind.c_str());
  for (const auto& w : r.warnings) log::warn("model.init_from: %s", w.c_str());
  if (!r.not_loaded.empty())
    log::warn(
        "model.init_from: partial load: %zu tensor(s) of the model are not in the source and keep "
        "their initialisation (train.seed): %s",
        r.not_loaded.size(), join(r.not_loaded).c_str());
  if (!r.not_used.empty())
    log::info("model.init_from: not used from the source: %s", join(r.not_used).c_str());
  io::json::Value f = io::json::Value::object();
  f.set("path", r.path);
  f.set("kind", r.kind);
  f.set("tensors_loaded", r.tensors_loaded);
  f.set("parameters_loaded", r.parameters_loaded);
  f.set("tensors_not_loaded", static_cast<std::int64_t>(r.not_loaded.size()));
  trainer.logEvent("init_from", trainer.state().step, f);
}

}  // namespace plm::ckpt
