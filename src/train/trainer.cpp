#include "train/trainer.hpp"

#include "core/clock.hpp"
#include "core/error.hpp"
#include "core/flat.hpp"
#include "core/log.hpp"
#include "core/phase.hpp"
#include "deck/deck.hpp"
#include "dist/allreduce.hpp"
#include "dist/communicator.hpp"
#include "dist/process_groups.hpp"
#include "dist/runtime.hpp"
#if PLM_HAVE_CUDA
#include "gpu/gemm.hpp"
#endif
#include "model/model_file.hpp"
#include "plm/plm_config.hpp"
#include "train/blas_threads.hpp"
#include "train/fp8_run.hpp"
#include "train/fsdp.hpp"
#include "train/lora_run.hpp"
#include "train/memory_tracker.hpp"
#include "train/moe_run.hpp"
#include "train/optim/from_deck.hpp"
#include "train/preemption.hpp"

#include <Teuchos_Array.hpp>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <memory>
#include <sstream>
#include <thread>
#include <type_traits>

namespace plm::train {

namespace {

constexpr auto now = &clock::steadySeconds;

const Teuchos::ParameterList& section(const Teuchos::ParameterList& deck, const char* name) {
  if (!deck.isSublist(name))
    throw collectiveError(std::string("deck: section `") + name +
                          "` missing; load decks through deck::load/resolve");
  return deck.sublist(name);
}

}  // namespace

model::Esm2Config modelConfigFromDeck(const Teuchos::ParameterList& deck) {
  const auto& m = section(deck, "model");
  const std::string preset = m.get<std::string>("preset");
  model::Esm2Config config;
  const int layers = m.get<int>("layers"), hidden = m.get<int>("hidden");
  const int heads = m.get<int>("heads"), ffn = m.get<int>("ffn");
  if (preset == "custom") {
    if (layers <= 0 || hidden <= 0 || heads <= 0)
      throw collectiveError(
          "model.preset: custom needs model.layers, model.hidden and model.heads set (> 0); "
          "model.ffn defaults to 4*hidden");
    config.num_layers = layers;
    config.hidden = hidden;
    config.heads = heads;
    config.ffn = ffn > 0 ? ffn : 4 * hidden;
  } else {
    config = model::Esm2Config::preset(preset);
    if (layers > 0) config.num_layers = layers;
    if (hidden > 0) config.hidden = hidden;
    if (heads > 0) config.heads = heads;
    if (ffn > 0)
      config.ffn = ffn;
    else if (hidden > 0)
      config.ffn = 4 * hidden;
  }
  config.recompute = model::parseRecompute(m.get<std::string>("recompute"));
  config.max_positions = m.get<int>("max_positions");
  const int max_seq_len = section(deck, "data").get<int>("max_seq_len");
  if (max_seq_len > config.max_positions - 2)
    throw collectiveError("data.max_seq_len " + std::to_string(max_seq_len) +
                          " exceeds model.max_positions " + std::to_string(config.max_positions) +
                          " - 2; raise model.max_positions (rotary needs no table) or lower "
                          "data.max_seq_len");
  applyMoeSection(deck, config);
  const auto& t = section(deck, "train");
  config.precision = model::parsePrecision(t.get<std::string>("precision"));
  config.attention = model::parseAttentionKernel(t.get<std::string>("attention"));
  config.deterministic = t.get<bool>("deterministic");
  applyFp8Section(deck, config);
  config.lora = loraSection(deck);
  config.validate();
  return config;
}

data::LoaderOptions evalLoaderOptions(const Teuchos::ParameterList& deck, const std::string& path,
                                      int rank, int world) {
  const auto& d = section(deck, "data");
  data::LoaderOptions vo;
  vo.path = path;
  vo.micro_batch_tokens = d.get<int>("micro_batch_tokens");
  vo.micro_batches_per_step = world;
  vo.seed = static_cast<std::uint64_t>(d.get<int>("seed"));
  vo.mask_prob = d.get<double>("mask_prob");
  vo.max_seq_len = d.get<int>("max_seq_len");
  vo.rank = rank;
  vo.world = world;
  vo.prefetch = 1;
  vo.shuffle = false;
  vo.single_pass = true;
  return vo;
}

std::int64_t evalMaxSteps(const Teuchos::ParameterList& deck, int world) {
  const auto& d = section(deck, "data");
  const std::int64_t valid_tokens = d.get<int>("valid_tokens");
  const std::int64_t per_step = static_cast<std::int64_t>(d.get<int>("micro_batch_tokens")) * world;
  return valid_tokens > 0 ? (valid_tokens + per_step - 1) / per_step : 0;
}

Trainer::Trainer(Teuchos::RCP<const Teuchos::ParameterList> deck, MPI_Comm comm)
    : deck_member(deck), comm_member(comm) {
  rank_member = dist::commRank(comm);
  world_member = dist::commSize(comm);
  const auto& d = section(*deck, "data");
  const auto& o = section(*deck, "optimizer");
  const auto& s = section(*deck, "schedule");
  const auto& t = section(*deck, "train");
  const auto& c = section(*deck, "checkpoint");

  const std::string precision = t.get<std::string>("precision");
  if (precision != "fp32" && !std::is_same_v<param_t, float>)
    throw collectiveError("train.precision: " + precision + " is not available in this build");

  const double start = now();
  AllocationTracker::start();  // the first step's measured peak (doc/parallelism.md, Memory)
  const int blas_threads = limitBlasThreadsPerRank(dist::localSize());
  model::Esm2Config config = modelConfigFromDeck(*deck);
  // bf16: the model's dispatch points compute in bf16 on the CUDA build over the same fp32
  // masters (doc/gpu.md); other builds throw a collective error naming the fix.
  // Expert parallelism shards the routed experts: this rank holds its group position's only.
  // Sharding builds no whole-model buffer at all: each rank draws its own shards below
  // (doc/parallelism.md, "Start-up"); setUpSharding refuses the layouts that cannot shard.
  const model::ExpertPlacement experts = expertPlacement(*deck, config, comm);
  const bool shards = shardDegree(*deck) > 1;
  model_member = std::make_unique<model::Esm2<param_t>>(
      config, experts, shards ? model::ModelBuffers::None : model::ModelBuffers::Whole);
  state_member.init_seed = static_cast<std::uint64_t>(t.get<int>("seed"));
  state_member.data_seed = static_cast<std::uint64_t>(d.get<int>("seed"));
  if (!shards) model_member->initialize(state_member.init_seed);
  moe_member = std::make_unique<MoeRun<param_t>>(*deck, *model_member, comm);
  context_member = std::make_unique<ContextRun>(*deck, comm);  // loaders see its data ranks
  context_member->attach(*model_member);

  data::LoaderOptions lo;
  lo.path = d.get<std::string>("train");
  lo.micro_batch_tokens = d.get<int>("micro_batch_tokens");
  lo.micro_batches_per_step = data::microBatchesPerStep(
      d.get<int>("tokens_per_batch"), lo.micro_batch_tokens, context_member->dataSize());
  lo.seed = state_member.data_seed;
  lo.mask_prob = d.get<double>("mask_prob");
  lo.max_seq_len = d.get<int>("max_seq_len");
  lo.rank = context_member->dataRank();
  lo.world = context_member->dataSize();
  lo.prefetch = d.get<int>("prefetch");
  train_loader_member = std::make_unique<data::Loader>(lo);
  optimizer_options_member = optimizerOptionsFromDeck(o);
  clip_norm_member = o.get<double>("clip_grad_norm");
  setUpSharding(*deck);
  PLM_REQUIRE(shards == (fsdp_member != nullptr),
              "train: the model's buffers and the sharding layout disagree (a bug)");
  if (fsdp_member)  // each rank draws its slices of every tensor's own random stream
    fsdp_member->initialize(ExecSpace(), state_member.init_seed);
  // moe.router_init: centred: the routers start centred on the first step's router inputs (a
  // forward pass over that step, whose micro-batches step 1 then trains on). Sharded: the
  // passes gather unit by unit and each router is centred through the shards. Before the
  // optimizer takes the masters; a resumed run loads its routers after this.
  if (config.moe.enabled() && config.moe.router_init == model::RouterInit::Centred) {
    const data::Cursor start = train_loader_member->cursor();
    moe_member->centreRouters(*model_member, context_member->shard(train_loader_member->nextStep()),
                              fsdp_member.get());
    train_loader_member->seek(start);
  }
  if (!fsdp_member)  // sharded runs allocate the full-layout state only for checkpoints
    optimizer_member = makeOptimizer<param_t>(
        optimizer_options_member, model_member->parameters(),
        wholeLayout(model_member->tensors(), model_member->bufferElements(),
                    esm2FrozenRanges(model_member->tensors(), config.hidden)));
  logStartup(now() - start);

  total_steps_member = t.get<int>("steps");
  log_every_member = std::max(1, t.get<int>("log_every"));
  eval_every_member = t.get<int>("eval_every");
  checkpoint_every_member = c.get<int>("every");
  on_nonfinite_member = parseOnNonfinite(t.get<std::string>("on_nonfinite"));
  watchdog_member.fixed_timeout = t.get<double>("step_timeout");
  inject_nonfinite_member = fault::nonfiniteSteps();
  inject_stall_member = fault::stall();
  inject_fail_member = fault::fail();
  run_dir_member = t.get<std::string>("run_dir");
  start_unix_member = clock::unixSeconds();
#if PLM_HAVE_CUDA
  // Before the first GEMM is planned; rank 0 alone appends new choices to the file.
  if (t.get<bool>("gemm_autotune"))
    gpu::setGemmAutotune(true, run_dir_member + "/gemm_autotune.txt", rank_member == 0);
  gpu::setGemmSplit(gpu::parseGemmSplit(t.get<std::string>("gemm_split")));
#endif
  if (t.get<bool>("profile")) {
    profile_member = true;  // CUDA events around every launch of the training passes
    model_member->setProfiling(true);
  }
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  peak_member = peakTflopsPerDevice(t.get<double>("peak_tflops"), precision,
                                    std::max(1, cores / std::max(1, dist::localSize())));

  schedule_member.peak_lr = o.get<double>("lr");
  schedule_member.warmup_steps = s.get<int>("warmup_steps");
  schedule_member.decay = parseDecay(s.get<std::string>("decay"));
  schedule_member.final_lr_ratio = s.get<double>("final_lr_ratio");
  const int decay_steps = s.get<int>("decay_steps");
  schedule_member.decay_steps = decay_steps > 0 ? decay_steps : total_steps_member;

  const std::string valid = d.get<std::string>("valid");
  if (!valid.empty()) {
    valid_loader_member = std::make_unique<data::Loader>(
        evalLoaderOptions(*deck, valid, context_member->dataRank(), context_member->dataSize()));
    valid_max_steps_member = evalMaxSteps(*deck, context_member->dataSize());
  }

  log::info("model: ESM-2 %d layers, hidden %d, %d heads, ffn %d: %lld parameters%s",
            config.num_layers, config.hidden, config.heads, config.ffn,
            static_cast<long long>(config.numParameters()),
            config.recompute == model::Recompute::None
                ? ""
                : (std::string(" (") + model::recomputeName(config.recompute) +
                   " activation recomputation)")
                      .c_str());
  if (config.lora.enabled()) {
    std::int64_t adapter = 0, base = 0;
    for (const auto& t : model_member->tensors()) (t.lora ? adapter : base) += t.size;
    log::info(
        "lora: rank %d, alpha %g, targets %s: %lld adapter parameters train, the %lld of "
        "the base model are frozen; model.h5 is written merged",
        config.lora.rank, config.lora.alpha, model::loraTargetNames(config.lora.targets).c_str(),
        static_cast<long long>(adapter), static_cast<long long>(base));
  }
  {
    const Optimizer<param_t>& opt = fsdp_member ? fsdp_member->optimizer() : *optimizer_member;
    log::info("optimizer: %s, state %s on this rank (%.3g bytes per parameter)",
              optimizerName(optimizer_options_member.kind), formatBytes(opt.stateBytes()).c_str(),
              double(opt.stateBytes()) / double(opt.master().extent(0)));
  }
  log::info(
      "data: %s, %lld sequences, %lld residues; %lld micro-batches of <= %lld tokens per "
      "step over %d rank(s)",
      lo.path.c_str(), static_cast<long long>(train_loader_member->numSequences()),
      static_cast<long long>(train_loader_member->numResidues()),
      static_cast<long long>(lo.micro_batches_per_step),
      static_cast<long long>(lo.micro_batch_tokens), world_member);
  if (blas_threads > 0)
    log::info(
        "OpenBLAS: %d thread(s) per rank (%d rank(s) on this node; set OPENBLAS_NUM_THREADS "
        "to override)",
        blas_threads, dist::localSize());
  log::info("peak for MFU: %.4g TFLOP/s per rank (%s)", peak_member.tflops,
            peak_member.source.c_str());
}

Trainer::~Trainer() = default;

Trainer::OwnedComms::~OwnedComms() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) return;
  for (MPI_Comm* c : {&shard, &replicate})
    if (*c != MPI_COMM_NULL) MPI_Comm_free(c);
}

int Trainer::shardDegree(const Teuchos::ParameterList& deck) const {
  if (!deck.isSublist("parallel")) return 1;
  const auto& p = deck.sublist("parallel");
  return resolveLayout(p.get<int>("shard_degree"), p.get<int>("replicate_degree"), world_member,
                       dist::localSize())
      .shard;
}

void Trainer::logStartup(double seconds) {
  Kokkos::fence();
  startup_seconds_member = dist::allreduceMax(seconds, comm_member);
  const double host = dist::allreduceMax(static_cast<double>(hostPeakResident()), comm_member);
  const double device = dist::allreduceMax(static_cast<double>(memoryInUse()), comm_member);
  const double peak = dist::allreduceMax(
      static_cast<double>(AllocationTracker::active() ? AllocationTracker::peak() : -1),
      comm_member);
  const bool device_build = !Kokkos::SpaceAccessibility<Kokkos::HostSpace, MemSpace>::accessible;
  log::info(
      "start-up: model ready in %.1f s (%s); fullest rank: host peak %s, device %s in use, "
      "Kokkos allocations peak %s",
      startup_seconds_member,
      fsdp_member                                 ? "each rank drew only its shards"
      : model_member->expertPlacement().sharded() ? "each rank holds its own experts only"
                                                  : "every rank holds the whole model",
      formatBytes(host).c_str(), device_build ? formatBytes(device).c_str() : "n/a (CPU build)",
      peak >= 0 ? formatBytes(peak).c_str() : "not measured");
}

void Trainer::setUpSharding(const Teuchos::ParameterList& deck) {
  if (!deck.isSublist("parallel")) return;
  const auto& p = deck.sublist("parallel");
  const ParallelLayout layout = resolveLayout(
      p.get<int>("shard_degree"), p.get<int>("replicate_degree"), world_member, dist::localSize());
  if (p.get<std::string>("reduce_dtype") != "fp32")
    throw collectiveError("parallel.reduce_dtype: " + p.get<std::string>("reduce_dtype") +
                          " is not implemented yet; use fp32");
  if (layout.shard == 1) return;  // plain data parallelism: the gradient-bucket path
  const model::ExpertPlacement& held = model_member->expertPlacement();
  if (held.sharded()) {
    // FSDP beside expert parallelism: the shard group is the expert-data-parallel group (the
    // ranks holding the same experts), the replicas are the expert group.  So dense tensors are
    // sharded over S and replicated over E_p, routed experts sharded over S (doc/parallelism.md).
    const std::string what = "parallel.shard_degree " + std::to_string(layout.shard) +
                             " with parallel.expert_degree " + std::to_string(held.degree) +
                             " on " + std::to_string(world_member) + " ranks: ";
    if (layout.shard * held.degree != world_member)
      throw collectiveError(what +
                            "FSDP beside expert parallelism shards over the ranks holding the same "
                            "experts, so shard_degree x expert_degree must equal the rank count; "
                            "set shard_degree: " +
                            std::to_string(world_member / held.degree) +
                            " (and replicate_degree: 0)");
    PLM_CHECK_MPI(MPI_Comm_split(comm_member, held.rank, rank_member, &expert_groups_member.shard));
    PLM_CHECK_MPI(MPI_Comm_split(comm_member, rank_member / held.degree, rank_member,
                                 &expert_groups_member.replicate));
  } else {
    groups_member = std::make_unique<dist::ProcessGroups>(comm_member, layout.shard);
  }
  FsdpOptions fo;
  fo.reshard_after_forward = p.get<bool>("reshard_after_forward");
  // bf16 compute: the bf16 policy, and fp8 on the CUDA build (bf16 storage, FP8 GEMMs).
  const model::Precision precision = model_member->config().precision;
  fo.gather_bf16 = gatherInBf16(
      p.get<std::string>("gather_dtype"),
      precision == model::Precision::Bf16 || (PLM_FP8_CUDA && precision == model::Precision::Fp8));
  const MPI_Comm shard_comm = groups_member ? groups_member->shard() : expert_groups_member.shard;
  const MPI_Comm replicate_comm =
      groups_member ? groups_member->replicate() : expert_groups_member.replicate;
  fsdp_member = std::make_unique<Fsdp<param_t>>(*model_member, shard_comm, replicate_comm,
                                                optimizer_options_member, fo,
                                                dist::defaultBackend(shard_comm));
  const FsdpMemory mem = fsdp_member->plannedMemory();
  log::info(
      "parallel: shard %d x replicate %d; planned bytes per rank: parameters %s, gradients %s, "
      "optimizer %s (shards), gathered embeddings, head and layers %s, reduce-scatter "
      "outputs %s",
      layout.shard, layout.replicate, formatBytes(mem.params).c_str(),
      formatBytes(mem.grads).c_str(), formatBytes(mem.optimizer).c_str(),
      formatBytes(mem.gathered).c_str(), formatBytes(mem.staging).c_str());
}

Optimizer<param_t>& Trainer::optimizer() {
  if (!optimizer_member) {  // sharded: the full-layout state gathered from the shards
    std::int64_t n = 0;
    for (const auto& u : fsdp_member->units()) n = std::max(n, u.offset + u.count);
    optimizer_member = makeOptimizer<param_t>(
        optimizer_options_member, flatZeros<param_t>("plm::train::full_layout_master", n),
        wholeLayout(model_member->tensors(), n,
                    esm2FrozenRanges(model_member->tensors(), model_member->config().hidden)));
    fsdp_member->exportFull(ExecSpace(), *optimizer_member);
    optimizer_member->setStepCount(fsdp_member->optimizer().stepCount());
  }
  return *optimizer_member;
}

void Trainer::releaseFullState() {
  if (!fsdp_member || !optimizer_member) return;
  fsdp_member->importFull(ExecSpace(), *optimizer_member);
  optimizer_member.reset();
}

void Trainer::discardFullState() {
  if (fsdp_member) optimizer_member.reset();
}

void Trainer::restore(const TrainState& state) {
  state_member = state;
  train_loader_member->seek(state.cursor);
  // Sharded, with the shards restored directly: no full-layout state to allocate.
  (fsdp_member && !optimizer_member ? fsdp_member->optimizer() : optimizer())
      .setStepCount(state.step);
}

BatchStats Trainer::validate() {
  if (!valid_loader_member) return BatchStats{};
  // Sharded: unit by unit as in training (a 15B model does not fit gathered whole).
  CollectiveForward forward;
  if (fsdp_member)
    forward = [this](const data::MicroBatch* mb) {
      return fsdp_member->forwardOnly(ExecSpace(), mb);
    };
  return evaluate(ExecSpace(), *model_member, *valid_loader_member, valid_max_steps_member,
                  comm_member, forward);
}

Trainer::RunEnd Trainer::run() {
  if (rank_member == 0) {
    std::error_code ec;
    std::filesystem::create_directories(run_dir_member, ec);
    if (ec) throw Error("cannot create train.run_dir `" + run_dir_member + "`: " + ec.message());
    deck::writeResolved(*deck_member, run_dir_member + "/deck.yaml");
    metrics_member.open(run_dir_member + "/metrics.jsonl");
    if (section(*deck_member, "train").get<bool>("tensorboard"))
      tensorboard_member.open(run_dir_member + "/tb");
  }
  PLM_CHECK_MPI(MPI_Barrier(comm_member));
  if (hooks_member.on_start) hooks_member.on_start(*this);
  logPlan();
  releaseFullState();  // sharded: the (possibly restored) full-layout state becomes the shards
  AllocationTracker::resetPeak();

  const ExecSpace space;
  if (state_member.step >= total_steps_member)
    log::info("train: already at step %lld of %lld; nothing to do",
              static_cast<long long>(state_member.step),
              static_cast<long long>(total_steps_member));
  Watchdog watchdog(watchdog_member, rank_member);
  interval_member = Interval{};
  double t0 = now();
  while (state_member.step < total_steps_member) {
    const std::int64_t step = state_member.step + 1;
    watchdog.arm(step, "step");
    phase::set("data loader (next step)");
    std::vector<data::MicroBatch> local = context_member->shard(train_loader_member->nextStep());
    const double lr = learningRate(schedule_member, step);
    injectFaults(step, false);
    StepStats st;
    if (skip_batches_member.count(step)) {
      // The batch a rollback chose to skip: consumed, never trained on.
      static_cast<BatchStats&>(st) = countBatch(local, comm_member);
      st.lr = lr;
      st.applied = false;
      st.nonfinite = true;
      log::warn(
          "train: step %lld: skipping the batch that gave non-finite values before the "
          "rollback",
          static_cast<long long>(step));
    } else if (fsdp_member) {
      optimizer_member.reset();  // a full-layout state gathered before this step is stale now
      st = fsdp_member->step(space, local, lr, clip_norm_member, comm_member,
                             [&] { injectFaults(step, true); });
    } else {
      const BatchStats batch = accumulateGradients(space, *model_member, local, comm_member);
      injectFaults(step, true);
      st = finishStep(space, *model_member, *optimizer_member, batch, lr, clip_norm_member,
                      comm_member);
    }
    moe_member->afterStep(*model_member, fsdp_member.get());
    phase::set("between steps");
    if (steps_this_run_member == 0) {
      const double used = dist::allreduceMax(static_cast<double>(memoryInUse()), comm_member);
      const double acts =
          dist::allreduceMax(static_cast<double>(model_member->workspaceBytes()), comm_member);
      first_step_peak_member = AllocationTracker::active() ? AllocationTracker::peak() : -1;
      AllocationTracker::stop();
      const double peak =
          dist::allreduceMax(static_cast<double>(first_step_peak_member), comm_member);
      log::info(
          "memory: after the first step %s in use on the fullest rank (process), peak of the "
          "buffers (Kokkos allocations) %s, of which the activation workspace at this "
          "micro-batch size is %s",
          formatBytes(used).c_str(), peak >= 0 ? formatBytes(peak).c_str() : "not measured",
          formatBytes(acts).c_str());
    }
    const double t1 = now();
    watchdog.disarm(t1 - t0);
    if (st.nonfinite && !skip_batches_member.count(step) && handleNonfinite(step, st)) {
      interval_member = Interval{};
      t0 = now();
      continue;  // rolled back: state() is the checkpoint's
    }
    state_member.step = step;
    state_member.tokens_seen += st.tokens;
    state_member.cursor = train_loader_member->cursor();

    interval_member.steps += 1;
    interval_member.tokens += st.tokens;
    if (!st.nonfinite) {
      interval_member.masked += st.masked;
      interval_member.loss_sum += st.loss_sum;
    }
    interval_member.flops += model_member->config().trainFlopsPerToken(st.weightedSeqlen()) *
                             static_cast<double>(st.tokens);
    interval_member.seconds += t1 - t0;
    train_seconds_member += t1 - t0;
    steps_this_run_member += 1;
    if (!st.nonfinite && st.masked > 0) {
      const double loss = st.loss_sum / static_cast<double>(st.masked);
      const double mean = spikes_member.mean(), deviation = spikes_member.deviation();
      if (spikes_member.add(loss)) {
        log::warn(
            "train: loss spike at step %lld: %.4f against a recent mean of %.4f (standard "
            "deviation %.4f)",
            static_cast<long long>(step), loss, mean, deviation);
        io::json::Value f = io::json::Value::object();
        f.set("loss", loss);
        f.set("recent_mean", mean);
        f.set("recent_std", deviation);
        logEvent("loss_spike", step, f);
      }
    }
    if (hooks_member.on_step) hooks_member.on_step(*this, st);

    const bool last = step == total_steps_member;
    if (step % log_every_member == 0 || last) {
      logStep(st, interval_member.seconds);
      interval_member = Interval{};
    }
    if (valid_loader_member && eval_every_member > 0 && (step % eval_every_member == 0 || last)) {
      watchdog.arm(step, "evaluation after step", true);
      phase::set("evaluation");
      const double e0 = now();
      BatchStats v = validate();
      logEval(v, now() - e0);
      watchdog.disarm(0);
    }
    const bool saved =
        hooks_member.on_save &&
        ((checkpoint_every_member > 0 && step % checkpoint_every_member == 0) || last);
    if (saved) {
      watchdog.arm(step, "checkpoint save after step", true);
      phase::set("checkpoint save");
      SaveScope saving;  // a repeated stop signal does not cut the save short
      fullStateForSave(space, [&] { hooks_member.on_save(*this, last); });
      watchdog.disarm(0);
    }
    phase::set("stop-signal agreement all-reduce (MPI)");
    const int signal = last ? 0 : agreedStopSignal(comm_member);
    if (signal != 0) {
      SaveScope saving;  // from here a further signal may count, but not during the save
      stopActedOn();
      log::info("train: %s: stopping after step %lld of %lld", signalName(signal),
                static_cast<long long>(step), static_cast<long long>(total_steps_member));
      io::json::Value f = io::json::Value::object();
      f.set("signal", std::string(signalName(signal)));
      logEvent("stop_signal", step, f);
      watchdog.arm(step, "checkpoint save after a stop signal, step", true);
      phase::set("checkpoint save (stop signal)");
      if (hooks_member.on_stop) fullStateForSave(space, [&] { hooks_member.on_stop(*this); });
      stopSaved();
      watchdog.disarm(0);
      log::info(
          "train: stopped after step %lld; exit status %d asks the job script to requeue "
          "the job, which resumes from the checkpoint (checkpoint.resume: auto)",
          static_cast<long long>(step), exit_requeue);
      return RunEnd::Stopped;
    }
    t0 = now();  // evaluation and checkpoint time stay out of tokens/s
  }
  writeFinalModel();
  return RunEnd::Completed;
}

void Trainer::fullStateForSave(const ExecSpace& space, const std::function<void()>& save) {
  (void)space;
  // Sharded: a checkpoint that reads the full-layout state gathers it on demand (optimizer());
  // one that writes the shards directly never allocates it.  Either way it lasts one save.
  if (fsdp_member) optimizer_member.reset();
  save();
  if (fsdp_member) optimizer_member.reset();
}

void Trainer::logPlan() {
  const model::Esm2Config& c = model_member->config();
  const auto& lo = train_loader_member->options();
  const std::string sync =
      world_member == 1 ? std::string("none") : dist::nameOf(dist::defaultBackend(comm_member));
  const std::string precision = deck_member->sublist("train").get<std::string>("precision");
  const long long per_step = static_cast<long long>(lo.micro_batches_per_step) *
                             static_cast<long long>(lo.micro_batch_tokens);
  log::info(
      "train: plan: ESM-2 %d layers, hidden %d (%lld parameters), %s, recompute %s; up to %lld "
      "tokens per step (%lld micro-batches of <= %lld); data parallel over %d rank(s), gradient "
      "all-reduce %s; steps %lld..%lld; checkpoint every %lld step(s); on_nonfinite %s",
      c.num_layers, c.hidden, static_cast<long long>(c.numParameters()), precision.c_str(),
      model::recomputeName(c.recompute), per_step,
      static_cast<long long>(lo.micro_batches_per_step),
      static_cast<long long>(lo.micro_batch_tokens), world_member, sync.c_str(),
      static_cast<long long>(state_member.step + 1), static_cast<long long>(total_steps_member),
      static_cast<long long>(checkpoint_every_member), nameOf(on_nonfinite_member));
  io::json::Value f = io::json::Value::object();
  f.set("layers", c.num_layers);
  f.set("hidden", c.hidden);
  f.set("parameters", static_cast<std::int64_t>(c.numParameters()));
  f.set("precision", precision);
  f.set("recompute", std::string(model::recomputeName(c.recompute)));
  f.set("max_tokens_per_step", static_cast<std::int64_t>(per_step));
  f.set("micro_batches_per_step", static_cast<std::int64_t>(lo.micro_batches_per_step));
  f.set("ranks", world_member);
  f.set("gradient_all_reduce", sync);
  f.set("total_steps", total_steps_member);
  f.set("startup_seconds", startup_seconds_member);
  logEvent("start", state_member.step, f);
}

bool Trainer::handleNonfinite(std::int64_t step, const StepStats& st) {
  std::int64_t count = 0;
  // Sharded: each rank looks at its gradient shard (tensor pieces keep their names).
  std::string tensor =
      fsdp_member
          ? firstNonfiniteTensor(
                fsdp_member->shardGradients(),
                shardTensorTable(model_member->tensors(), fsdp_member->units(),
                                 fsdp_member->shardSize(), fsdp_member->shardRank()),
                &count)
          : firstNonfiniteTensor(model_member->gradients(), model_member->tensors(), &count);
  const std::string what =
      tensor.empty() ? std::string("the loss (the gradients are finite)")
                     : "the gradient of " + tensor + " (" + std::to_string(count) +
                           " non-finite value(s); the first such tensor in the tensor table)";
  char numbers[160];
  std::snprintf(numbers, sizeof numbers, "loss sum %g, gradient norm %g, lr %.3e", st.loss_sum,
                st.grad_norm, st.lr);
  io::json::Value f = io::json::Value::object();
  f.set("tensor", tensor.empty() ? std::string("loss") : tensor);
  f.set("policy", std::string(nameOf(on_nonfinite_member)));
  if (on_nonfinite_member == OnNonfinite::Stop)
    throw collectiveError(
        "train: step " + std::to_string(step) + ": " + what + " is not finite (" + numbers +
        "); the update was not applied, so the weights of step " + std::to_string(step - 1) +
        " are intact.  Lower optimizer.lr or raise schedule.warmup_steps, or set "
        "train.on_nonfinite: skip (drop such steps) or rollback (reload the newest checkpoint "
        "and skip this batch)");
  if (on_nonfinite_member == OnNonfinite::Rollback) {
    if (rollbacks_member >= 10)
      throw collectiveError("train: step " + std::to_string(step) + ": " + what +
                            " is not finite after 10 rollbacks in this run; the run is unstable: "
                            "lower optimizer.lr or raise schedule.warmup_steps");
    log::warn("train: step %lld: %s is not finite (%s); rolling back to the newest checkpoint",
              static_cast<long long>(step), what.c_str(), numbers);
    logEvent("nonfinite", step, f);
    if (hooks_member.on_rollback && hooks_member.on_rollback(*this)) {
      releaseFullState();  // sharded: the restored state becomes the shards
      skip_batches_member.insert(step);
      ++rollbacks_member;
      ++skipped_steps_member;
      io::json::Value r = io::json::Value::object();
      r.set("skip_step", step);
      logEvent("rollback", step, r);
      log::warn("train: rolled back to step %lld; the batch of step %lld will be skipped",
                static_cast<long long>(state_member.step), static_cast<long long>(step));
      return true;
    }
    log::warn("train: no checkpoint to roll back to; skipping the update of step %lld instead",
              static_cast<long long>(step));
  } else {
    log::warn(
        "train: step %lld: %s is not finite (%s); the update is skipped "
        "(train.on_nonfinite: skip)",
        static_cast<long long>(step), what.c_str(), numbers);
    logEvent("nonfinite", step, f);
  }
  ++skipped_steps_member;
  return false;
}

void Trainer::injectFaults(std::int64_t step, bool after_gradients) {
  if (!after_gradients && step == inject_stall_member.step &&
      (inject_stall_member.rank < 0 || inject_stall_member.rank == rank_member)) {
    phase::Scope in_phase("an injected stall (PLM_TEST_STALL)");
    std::this_thread::sleep_for(std::chrono::duration<double>(inject_stall_member.seconds));
  }
  if (after_gradients && step == inject_fail_member.step &&
      inject_fail_member.rank == rank_member) {
    // One rank fails inside the step while the others go on into its collectives.
    if (inject_fail_member.oom)  // a real allocation failure of 1 PiB, with Kokkos' own message
      View1<char> huge(Kokkos::view_alloc(Kokkos::WithoutInitializing,
                                          std::string("plm::test::injected_allocation")),
                       std::size_t(1) << 50);
    throw Error("PLM_TEST_FAIL: an injected failure on rank " + std::to_string(rank_member) +
                " in step " + std::to_string(step));
  }
  if (after_gradients && inject_nonfinite_member.count(step)) {
    // As a NaN produced on any rank looks after the gradient all-reduce: on every rank.
    if (fsdp_member) {  // sharded: the first element of every rank's gradient shard
      Kokkos::deep_copy(Kokkos::subview(fsdp_member->shardGradients(), std::make_pair(0, 1)),
                        std::numeric_limits<param_t>::quiet_NaN());
      Kokkos::fence();
      return;
    }
    const auto& tensors = model_member->tensors();
    const auto& target = tensors.at(tensors.size() > 2 ? 2 : 0);
    auto one = Kokkos::subview(model_member->gradients(),
                               std::make_pair(target.offset, target.offset + 1));
    Kokkos::deep_copy(one, std::numeric_limits<param_t>::quiet_NaN());
    Kokkos::fence();
  }
}

void Trainer::logEvent(const std::string& event, std::int64_t step, io::json::Value fields) {
  if (rank_member != 0 || !metrics_member.isOpen()) return;
  io::json::Value r = io::json::Value::object();
  r.set("kind", "event");
  r.set("event", event);
  r.set("step", step);
  for (const auto& [key, value] : fields.members()) r.set(key, value);
  r.set("time", clock::utcIso());
  metrics_member.write(r);
}

void Trainer::writeFinalModel() {
  // The trained weights as a plm model file (what `plm eval --model`, `plm embed` and
  // `plm convert --to-hf` read), independent of the checkpoint module's schedule.
  const std::string path = run_dir_member + "/model.h5";
  model::ModelAttributes extra;
  extra.integers["step"] = state_member.step;
  extra.integers["tokens_seen"] = state_member.tokens_seen;
  extra.strings["source"] = "plm train";
  if (model_member->config().lora.enabled()) {
    // LoRA: the adapters folded into their weights (W + (alpha / r) B A), so the file is a
    // plain model that every reader (and Hugging Face after convert) loads.
    const model::Esm2<param_t>& m = *model_member;
    static_assert(std::is_same_v<param_t, float>, "model files store fp32");
    std::vector<param_t> values(std::size_t(m.bufferElements()));
    if (fsdp_member) {
      fsdp_member->gatherRanges(ExecSpace(), {{0, m.bufferElements()}}, values.data());
    } else {
      auto host =
          Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), model_member->parameters());
      std::copy(host.data(), host.data() + values.size(), values.begin());
    }
    model::Esm2Config plain = m.config();
    plain.lora = model::LoraConfig{};
    const auto merged = model::mergeLora(m.config(), m.tensors(), values.data());
    extra.strings["lora"] = "merged: rank " + std::to_string(m.config().lora.rank) + ", alpha " +
                            std::to_string(m.config().lora.alpha) + ", targets " +
                            model::loraTargetNames(m.config().lora.targets);
    model::writeModelFile(path, comm_member, plain, model::tensorTable(plain), merged.data(),
                          extra);
  } else if (fsdp_member) {
    // Each rank writes its rows of every tensor; it gathers the model unit by unit and keeps
    // only those rows, so no whole-model buffer appears on the device or in host memory (the
    // host buffer is allocated, not initialised: only the rows' pages become resident).
    const model::Esm2<param_t>& m = *model_member;
    const auto rows = model::heldRows(m.tensors(), m.expertPlacement(), m.config().moe.experts,
                                      rank_member, world_member);
    std::vector<std::pair<std::int64_t, std::int64_t>> ranges;
    for (const auto& r : rows)
      if (r.tensor.offset >= 0 && r.row_count > 0)
        ranges.push_back({r.tensor.offset + r.first_row * r.rowSize(), r.row_count * r.rowSize()});
    std::unique_ptr<param_t[]> values(new param_t[std::size_t(m.bufferElements())]);
    fsdp_member->gatherRanges(ExecSpace(), ranges, values.get());
    static_assert(std::is_same_v<param_t, float>, "model files store fp32");
    model::writeModelFile(path, comm_member, m.config(), rows, values.get(), extra);
  } else {
    model::writeModelFile(path, comm_member, *model_member, extra);
  }
  log::info("train: wrote the model after step %lld to %s",
            static_cast<long long>(state_member.step), path.c_str());
}

namespace {
// A profile kind as a metrics.jsonl key and TensorBoard tag: "gemm (cuBLASLt)" -> "gemm",
// "moe dispatch" -> "moe_dispatch".
std::string metricName(std::string kind) {
  kind = kind.substr(0, kind.find(" ("));
  for (char& ch : kind)
    if (ch == ' ') ch = '_';
  return kind;
}

// JSON has no inf/NaN: a diverged value (ppl = exp(large loss)) is written as null.
io::json::Value number(double x) {
  return std::isfinite(x) ? io::json::Value(x) : io::json::Value();
}
}  // namespace

void Trainer::writeLayerProfile() {
  if (rank_member != 0 || layer_profile_steps_member <= 0) return;
  const auto table = model_member->context().layerProfile();
  if (table.layers.empty()) return;
  const std::string path = run_dir_member + "/profile_layers.tsv";
  std::FILE* f = std::fopen(path.c_str(), "w");
  if (!f) {
    log::warn("train.profile: cannot write %s", path.c_str());
    return;
  }
  const double steps = static_cast<double>(layer_profile_steps_member);
  std::fprintf(f,
               "# plm train.profile: GPU milliseconds per step on rank 0 by encoder layer and "
               "kind, mean of the %lld steps after the first progress interval (up to step "
               "%lld); layer \"outside\" = embedding, final LayerNorm, LM head, loss, optimizer\n",
               static_cast<long long>(layer_profile_steps_member),
               static_cast<long long>(state_member.step));
  std::fprintf(f, "layer");
  for (const auto& k : table.kinds) std::fprintf(f, "\t%s", metricName(k).c_str());
  std::fprintf(f, "\ttotal\n");
  for (std::size_t r = 0; r < table.layers.size(); ++r) {
    if (table.layers[r] < 0)
      std::fprintf(f, "outside");
    else
      std::fprintf(f, "%d", table.layers[r]);
    double total = 0;
    for (double ms : table.ms[r]) {
      std::fprintf(f, "\t%.3f", ms / steps);
      total += ms;
    }
    std::fprintf(f, "\t%.3f\n", total / steps);
  }
  std::fclose(f);
}

void Trainer::logStep(const StepStats& last, double seconds) {
  const Interval& in = interval_member;
  // An interval of skipped steps only has no loss (null in metrics.jsonl).
  const double loss = in.masked > 0 ? in.loss_sum / static_cast<double>(in.masked)
                                    : std::numeric_limits<double>::quiet_NaN();
  const double tokens_per_s = seconds > 0 ? static_cast<double>(in.tokens) / seconds : 0.0;
  const double tflops = seconds > 0 ? in.flops / seconds / 1e12 : 0.0;  // the whole job's
  const double tflops_per_device = tflops / std::max(1, world_member);  // MFU's numerator
  const double mfu = mfuOf(tflops, world_member, peak_member);
  const double mem = dist::allreduceMax(static_cast<double>(memoryInUse()), comm_member);
  const double per_step =
      steps_this_run_member > 0 ? train_seconds_member / steps_this_run_member : 0;
  const double eta = per_step * static_cast<double>(total_steps_member - state_member.step);
  const auto moe = moe_member->takeInterval();
  std::string profile;
  io::json::Value gpu_ms = io::json::Value::object();  // per kind, per step (metrics.jsonl)
  if (profile_member) {  // this rank's GPU time per kind over the interval (empty on a CPU)
    double total = 0;
    const auto kinds = model_member->profile();
    for (const auto& [kind, ms] : kinds) total += ms;
    const double steps = static_cast<double>(std::max<std::int64_t>(1, in.steps));
    for (const auto& [kind, ms] : kinds) {
      char part[96];
      std::snprintf(part, sizeof(part), "%s%s %.2f ms (%.0f%%)", profile.empty() ? "" : ", ",
                    kind.c_str(), ms / steps, 100 * ms / std::max(total, 1e-9));
      profile += part;
      gpu_ms.set(metricName(kind), ms / steps);
    }
    model_member->setProfiling(true);  // a new interval
    // The by-layer table leaves out the first interval (autotuning, cuDNN plans, first-touch
    // allocations) and is rewritten at every progress line, so a stopped run keeps it.
    if (layer_profile_steps_member < 0) {
      model_member->context().resetLayerProfile();
      layer_profile_steps_member = 0;
    } else {
      layer_profile_steps_member += in.steps;
      writeLayerProfile();
    }
  }
  if (rank_member != 0) return;
  if (!profile.empty()) log::info("profile: GPU time per step on rank 0: %s", profile.c_str());
  // tok/s is the job's; TFLOP/s is per device, as MFU is.
  log::info(
      "step %lld/%lld | loss %.4f | ppl %.3f | lr %.3e | grad-norm %.3f | %.0f tok/s | "
      "%.4g TFLOP/s per %s | MFU %.2f%% | mem %s | ETA %s%s",
      static_cast<long long>(state_member.step), static_cast<long long>(total_steps_member), loss,
      std::exp(loss), last.lr, last.grad_norm, tokens_per_s, tflops_per_device,
      PLM_HAVE_CUDA ? "GPU" : "rank", 100.0 * mfu, formatBytes(mem).c_str(),
      formatDuration(eta).c_str(), MoeRun<param_t>::progress(moe).c_str());
  const double unix_now = clock::unixSeconds();
  io::json::Value r = io::json::Value::object();
  r.set("kind", "train");
  r.set("step", state_member.step);
  r.set("loss", number(loss));
  r.set("ppl", number(std::exp(loss)));
  r.set("lr", last.lr);
  r.set("grad_norm", number(last.grad_norm));
  r.set("clip_factor", last.clip_factor);
  r.set("tokens", state_member.tokens_seen);
  r.set("interval_tokens", in.tokens);
  r.set("masked_tokens", in.masked);
  r.set("tokens_per_s", tokens_per_s);
  r.set("tflops", tflops);
  r.set("tflops_per_device", tflops_per_device);
  r.set("mfu", mfu);
  r.set("mem_bytes", mem);
  r.set("elapsed_s", train_seconds_member);
  r.set("eta_s", eta);
  r.set("time", clock::utcIso(unix_now));
  r.set("unix_s", unix_now);
  r.set("wall_s", unix_now - start_unix_member);
  if (!gpu_ms.members().empty()) r.set("gpu_ms", gpu_ms);
  MoeRun<param_t>::addMetrics(moe, r);
  metrics_member.write(r);
  if (tensorboard_member.isOpen()) {
    std::vector<std::pair<std::string, double>> scalars = {
        {"train/loss", loss},
        {"train/ppl", std::exp(loss)},
        {"train/lr", last.lr},
        {"train/grad_norm", last.grad_norm},
        {"perf/tokens_per_s", tokens_per_s},
        {"perf/tflops_per_device", tflops_per_device},
        {"perf/mfu", mfu},
        {"perf/mem_gib", mem / (1024.0 * 1024 * 1024)}};
    for (const auto& [kind, ms] : gpu_ms.members())
      scalars.push_back({"gpu_ms/" + kind, ms.asDouble()});
    tensorboard_member.scalars(state_member.step, scalars);
  }
}

void Trainer::logEval(const BatchStats& v, double seconds) {
  if (rank_member != 0) return;
  log::info("eval step %lld | valid loss %.4f | valid ppl %.3f | %lld tokens, %lld masked, %.1fs",
            static_cast<long long>(state_member.step), v.loss(), v.perplexity(),
            static_cast<long long>(v.tokens), static_cast<long long>(v.masked), seconds);
  io::json::Value r = io::json::Value::object();
  r.set("kind", "eval");
  r.set("step", state_member.step);
  r.set("valid_loss", number(v.loss()));
  r.set("valid_ppl", number(v.perplexity()));
  r.set("valid_tokens", v.tokens);
  r.set("valid_masked", v.masked);
  r.set("tokens", state_member.tokens_seen);
  r.set("eval_s", seconds);
  const double unix_now = clock::unixSeconds();
  r.set("time", clock::utcIso(unix_now));
  r.set("unix_s", unix_now);
  r.set("wall_s", unix_now - start_unix_member);
  metrics_member.write(r);
  if (tensorboard_member.isOpen())
    tensorboard_member.scalars(state_member.step,
                               {{"eval/valid_loss", v.loss()}, {"eval/valid_ppl", v.perplexity()}});
}

}  // namespace plm::train
