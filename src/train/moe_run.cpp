#include "train/moe_run.hpp"

#include "core/error.hpp"
#include "core/log.hpp"
#include "dist/allreduce.hpp"
#include "dist/communicator.hpp"
#include "dist/process_groups.hpp"
#include "model/moe.hpp"
#include "train/fsdp.hpp"
#include "train/step.hpp"

#include <algorithm>
#include <cstdio>

namespace plm::train {

namespace {
// Unique parameters of the model's table (the decoder is tied to the embedding).
template <class P> std::int64_t heldParameters(const model::Esm2<P>& model) {
  std::int64_t n = 0;
  for (const auto& t : model.tensors()) n += t.size;
  return n;
}
}  // namespace

void applyMoeSection(const Teuchos::ParameterList& deck, model::Esm2Config& config) {
  if (!deck.isSublist("moe")) return;
  const auto& m = deck.sublist("moe");
  auto& c = config.moe;
  const int experts = m.get<int>("experts");
  if (experts > 0) c.experts = experts;
  if (!c.enabled()) return;  // dense: the rest of the section is not read
  const int top_k = m.get<int>("top_k"), every = m.get<int>("every");
  const int expert_ffn = m.get<int>("expert_ffn");
  if (top_k > 0) c.top_k = top_k;
  if (every > 0) c.every = every;
  if (expert_ffn > 0)
    c.expert_ffn = expert_ffn;
  else if (c.expert_ffn == 0)
    c.expert_ffn = std::max(1, config.ffn / c.top_k);
  c.shared_experts = m.get<int>("shared_experts");
  c.router = model::parseRouter(m.get<std::string>("router"));
  c.normalize_topk = m.get<bool>("normalize_topk");
  c.capacity_factor = m.get<bool>("dropless") ? 0.0 : m.get<double>("capacity_factor");
  c.aux_loss = m.get<double>("aux_loss");
  c.z_loss = m.get<double>("z_loss");
  c.seq_aux_loss = m.get<double>("seq_aux_loss");
  c.bias_balance = m.get<bool>("bias_balance");
  c.bias_rate = m.get<double>("bias_rate");
  c.bias_update = model::parseBiasUpdate(m.get<std::string>("bias_update"));
  c.router_init = model::parseRouterInit(m.get<std::string>("router_init"));
  c.router_projection = m.get<bool>("router_projection");
  c.router_projection_means = m.get<int>("router_projection_means");
  // Under context parallelism a rank sees part of each sequence, so the per-micro-batch mean
  // the training pass projects the router off would differ from one rank's: not applied there.
  if (deck.isSublist("parallel") && deck.sublist("parallel").isParameter("context_degree") &&
      deck.sublist("parallel").get<int>("context_degree") > 1)
    c.router_projection = false;
  c.expert_gemm = model::parseExpertGemm(m.get<std::string>("expert_gemm"));
  const auto activation = m.get<std::string>("expert_activation");
  if (activation != "auto")  // auto: the preset's (swiglu for aido_protein_16b), else gelu
    c.expert_activation = model::parseExpertActivation(activation);
  c.dispatch_budget_bytes = m.get<double>("dispatch_budget_gib") * 1024.0 * 1024.0 * 1024.0;
  c.overlap = m.get<bool>("overlap");
  c.host_routing = m.get<std::string>("routing") == "host";
}

model::ExpertPlacement expertPlacement(const Teuchos::ParameterList& deck,
                                       const model::Esm2Config& config, MPI_Comm comm) {
  const auto& moe = config.moe;
  const int degree =
      deck.isSublist("parallel") ? deck.sublist("parallel").get<int>("expert_degree") : 1;
  const int world = dist::commSize(comm);
  if (degree < 1)
    throw collectiveError("parallel.expert_degree = " + std::to_string(degree) +
                          " must be at least 1");
  if (degree > 1 && !moe.enabled())
    throw collectiveError("parallel.expert_degree = " + std::to_string(degree) +
                          " needs a Mixture-of-Experts model (set moe.experts or an MoE preset)");
  if (world % degree != 0)
    throw collectiveError("parallel.expert_degree = " + std::to_string(degree) +
                          " must divide the number of ranks (" + std::to_string(world) + ")");
  if (moe.enabled() && moe.experts % degree != 0)
    throw collectiveError("parallel.expert_degree = " + std::to_string(degree) +
                          " must divide moe.experts = " + std::to_string(moe.experts));
  return model::ExpertPlacement{degree, dist::commRank(comm) % degree};
}

template <class P>
MoeRun<P>::MoeRun(const Teuchos::ParameterList& deck, model::Esm2<P>& model, MPI_Comm comm)
    : comm_member(comm) {
  const auto& moe = model.config().moe;
  degree_member = expertPlacement(deck, model.config(), comm).degree;
  if (model.expertPlacement().degree != degree_member)
    throw Error("plm::train::MoeRun: the model was built for expert degree " +
                std::to_string(model.expertPlacement().degree) + " (a bug)");
  if (degree_member > 1) {
    groups_member = std::make_unique<dist::ProcessGroups>(comm, degree_member);
    expert_comm_member = dist::makeCommunicator(groups_member->shard(),
                                                dist::defaultBackend(groups_member->shard()));
    model.setExpertParallel(expert_comm_member.get());
  }
  if (moe.enabled()) {
    const auto& cfg = model.config();
    int moe_layers = 0;
    for (int l = 0; l < cfg.num_layers; ++l) moe_layers += moe.isMoeLayer(l) ? 1 : 0;
    log::info(
        "moe: %d of %d layers with %d experts of ffn %d (+%d shared), top-%d %s router%s, %s; "
        "%lld parameters, %lld active per token; expert degree %d (%lld parameters held "
        "per rank)",
        moe_layers, cfg.num_layers, moe.experts, moe.expert_ffn, moe.shared_experts, moe.top_k,
        model::routerName(moe.router), moe.normalize_topk ? " (normalised)" : "",
        moe.capacity_factor > 0 ? ("capacity factor " + std::to_string(moe.capacity_factor)).c_str()
                                : "dropless",
        static_cast<long long>(cfg.numParameters()), static_cast<long long>(cfg.activeParameters()),
        degree_member, static_cast<long long>(heldParameters(model)));
  }
  for (const auto& s : model.moeStats()) {
    model::MoeLayerStats z;
    z.layer = s.layer;
    z.routed.assign(s.routed.size(), 0.0);
    interval_member.push_back(z);
  }
}

template <class P> MoeRun<P>::~MoeRun() = default;

template <class P> void MoeRun<P>::centreRouters(model::Esm2<P>& model,
                                                 const std::vector<data::MicroBatch>& first_step,
                                                 Fsdp<P>* sharded) {
  const auto& moe = model.config().moe;
  if (!moe.enabled() || moe.router_init != model::RouterInit::Centred) return;
  // Collective passes (expert parallelism, FSDP's gathers): as many on every rank, empty ones
  // first.
  const std::vector<data::MicroBatch> batches = model.expertParallel() || sharded != nullptr
                                                    ? padForExperts(first_step, comm_member)
                                                    : first_step;
  std::vector<model::RouterCentring> layers;
  if (sharded == nullptr) {
    layers = model.centreRouters(batches, comm_member);
  } else {
    const ExecSpace space;
    layers = model.routerInputMeans(batches, comm_member, [&](const data::MicroBatch& mb) {
      sharded->forwardOnly(space, &mb);
    });
    for (const auto& l : layers) {
      if (l.mean.empty()) continue;  // the same on every rank: the sums are all-reduced
      const auto& router =
          model.tensor("esm.encoder.layer." + std::to_string(l.layer) + ".moe.router.weight");
      std::vector<P> rows = sharded->readParameters(space, router.offset, router.size);
      model::centreRows(rows, moe.experts, l.mean);
      sharded->writeParameters(space, router.offset, rows);
    }
  }
  if (layers.empty()) return;
  double least = 1, most = 0;
  for (const auto& l : layers) {
    least = std::min(least, l.mean_share);
    most = std::max(most, l.mean_share);
  }
  log::info(
      "moe: routers centred on the first step's %.0f tokens (moe.router_init: centred); the "
      "mean router input held %.0f-%.0f%% of its power over the %zu MoE layers",
      layers.front().tokens, 100 * least, 100 * most, layers.size());
}

template <class P> void MoeRun<P>::afterStep(model::Esm2<P>& model, Fsdp<P>* sharded) {
  auto stats = model.moeStats();
  model.resetMoeStats();
  if (stats.empty()) return;
  std::vector<double> flat;
  for (const auto& s : stats) {
    flat.insert(flat.end(), s.routed.begin(), s.routed.end());
    flat.insert(flat.end(), {s.slots, s.dropped, s.aux, s.z, s.entropy, s.tokens});
  }
  dist::allreduceSum(flat, comm_member);
  std::size_t at = 0;
  std::vector<std::vector<double>> routed;
  for (std::size_t i = 0; i < stats.size(); ++i) {
    auto& s = stats[i];
    for (auto& r : s.routed) r = flat[at++];
    s.slots = flat[at++];
    s.dropped = flat[at++];
    s.aux = flat[at++];
    s.z = flat[at++];
    s.entropy = flat[at++];
    s.tokens = flat[at++];
    routed.push_back(s.routed);
    auto& acc = interval_member[i];
    for (std::size_t e = 0; e < s.routed.size(); ++e) acc.routed[e] += s.routed[e];
    acc.slots += s.slots;
    acc.dropped += s.dropped;
    acc.aux += s.aux;
    acc.z += s.z;
    acc.entropy += s.entropy;
    acc.tokens += s.tokens;
  }
  steps_member += 1;
  last_routed_member = routed;
  const auto& moe = model.config().moe;
  if (moe.bias_balance && sharded == nullptr) model.balanceExpertBias(routed);
  if (moe.bias_balance && sharded != nullptr)
    for (std::size_t i = 0; i < stats.size(); ++i) {
      const auto& bias = model.tensor("esm.encoder.layer." + std::to_string(stats[i].layer) +
                                      ".moe.router.expert_bias");
      sharded->addToParameters(ExecSpace(), bias.offset, model::biasBalanceStep(moe, routed[i]));
    }
  if (moe.router_projection && sharded == nullptr) model.projectRouters(comm_member);
}

template <class P> std::vector<MoeLayerSummary> MoeRun<P>::takeInterval() {
  std::vector<MoeLayerSummary> out;
  const double steps = std::max(1, steps_member);
  for (auto& acc : interval_member) {
    MoeLayerSummary s;
    s.layer = acc.layer;
    if (!acc.routed.empty()) {
      s.load_min = *std::min_element(acc.routed.begin(), acc.routed.end()) / steps;
      s.load_max = *std::max_element(acc.routed.begin(), acc.routed.end()) / steps;
      double sum = 0;
      for (double r : acc.routed) sum += r;
      s.load_mean = sum / static_cast<double>(acc.routed.size()) / steps;
    }
    const double tokens = std::max(1.0, acc.tokens);
    s.dropped_fraction = acc.slots > 0 ? acc.dropped / acc.slots : 0.0;
    s.aux = acc.aux / tokens;
    s.z = acc.z / tokens;
    s.entropy = acc.entropy / tokens;
    out.push_back(s);
    const int layer = acc.layer;
    const std::size_t e = acc.routed.size();
    acc = model::MoeLayerStats();
    acc.layer = layer;
    acc.routed.assign(e, 0.0);
  }
  steps_member = 0;
  return out;
}

template <class P> std::string MoeRun<P>::progress(const std::vector<MoeLayerSummary>& layers) {
  if (layers.empty()) return "";
  double worst = 0, dropped = 0, aux = 0, entropy = 0;
  for (const auto& s : layers) {
    if (s.load_mean > 0) worst = std::max(worst, s.load_max / s.load_mean);
    dropped += s.dropped_fraction;
    aux += s.aux;
    entropy += s.entropy;
  }
  const double n = static_cast<double>(layers.size());
  char text[160];
  std::snprintf(text, sizeof(text), " | moe load max/mean %.2f | drop %.2f%% | aux %.4f | H %.3f",
                worst, 100.0 * dropped / n, aux / n, entropy / n);
  return text;
}

template <class P>
void MoeRun<P>::addMetrics(const std::vector<MoeLayerSummary>& layers, io::json::Value& record) {
  if (layers.empty()) return;
  io::json::Value all = io::json::Value::array();
  for (const auto& s : layers) {
    io::json::Value l = io::json::Value::object();
    l.set("layer", s.layer);
    l.set("tokens_per_expert_min", s.load_min);
    l.set("tokens_per_expert_mean", s.load_mean);
    l.set("tokens_per_expert_max", s.load_max);
    l.set("dropped_fraction", s.dropped_fraction);
    l.set("aux_loss", s.aux);
    l.set("z_loss", s.z);
    l.set("router_entropy", s.entropy);
    all.push(l);
  }
  record.set("moe", all);
}

template class MoeRun<float>;
template class MoeRun<double>;

}  // namespace plm::train
