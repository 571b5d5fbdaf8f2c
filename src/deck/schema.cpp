// The deck schema: every key plm reads from an input deck, its type, default, allowed values and
// documentation. Adding a key here is the whole job: validation, `plm deck --defaults`, the
// resolved deck in the run directory and doc/deck.md all follow from this table.
#include "deck/deck.hpp"
#include "deck/detail/keys.hpp"

#include <Teuchos_StandardParameterEntryValidators.hpp>

#include <cmath>
#include <sstream>

namespace plm::deck {

namespace detail {

namespace {
Range atLeast(double x) { return Range{x, std::numeric_limits<double>::infinity(), false, false}; }
Range above(double x) { return Range{x, std::numeric_limits<double>::infinity(), true, false}; }
Range interval(double lo, double hi, bool lo_open, bool hi_open) {
  return Range{lo, hi, lo_open, hi_open};
}
Range any() { return Range{}; }

std::string number(double x) {
  std::ostringstream os;
  os << x;
  return os.str();
}
}  // namespace

bool Range::contains(double x) const {
  if (std::isnan(x)) return false;
  if (min_open ? !(x > min) : !(x >= min)) return false;
  if (max_open ? !(x < max) : !(x <= max)) return false;
  return true;
}

std::string Range::describe() const {
  bool has_min = min > -std::numeric_limits<double>::infinity();
  bool has_max = max < std::numeric_limits<double>::infinity();
  if (has_min && has_max)
    return std::string("in ") + (min_open ? "(" : "[") + number(min) + ", " + number(max) +
           (max_open ? ")" : "]");
  if (has_min) return (min_open ? "> " : ">= ") + number(min);
  if (has_max) return (max_open ? "< " : "<= ") + number(max);
  return "any";
}

const char* kindName(Kind kind) {
  switch (kind) {
    case Kind::integer: return "int";
    case Kind::real: return "real";
    case Kind::boolean: return "bool";
    case Kind::text: return "string";
    case Kind::real_pair: return "[real, real]";
  }
  return "?";
}

const std::vector<SectionSpec>& sections() {
  static const std::vector<SectionSpec> table = {
      {"model", "The network: an ESM-2 size by name, or explicit sizes with `preset: custom`."},
      {"data", "Datasets written by `plm prep`, batching and masking."},
      {"optimizer",
       "AdamW, Lion, Adafactor or 8-bit AdamW (decoupled weight decay on the same "
       "mask) with global gradient-norm clipping."},
      {"schedule", "Learning rate: linear warm-up, then decay to a fraction of optimizer.lr."},
      {"train", "The training run: length, logging, evaluation, precision, run directory."},
      {"checkpoint", "Checkpoints (one HDF5 file each) and resuming."},
      {"moe",
       "Mixture-of-Experts FFN layers (doc/model.md): experts = 0 keeps the dense ESM-2, "
       "unless model.preset is an MoE preset."},
      {"fp8",
       "FP8 training (train.precision: fp8, doc/fp8.md): Transformer Engine's scaling recipes "
       "for the four GEMMs of each encoder layer."},
      {"task",
       "What the run trains: masked-LM pre-training (mlm), or a task head on the encoder "
       "(doc/finetune.md) with labels from `plm prep --labels / --residue-labels`."},
      {"parallel",
       "How ranks split the work beyond data parallelism: sharded data parallelism (FSDP/HSDP, "
       "doc/parallelism.md) and expert parallelism."},
      {"lora",
       "LoRA adapters for fine-tuning (doc/finetune.md): rank = 0 trains the whole model; "
       "rank > 0 trains only the adapters (the base is frozen) and the run's model.h5 is merged."},
  };
  return table;
}

const std::vector<KeySpec>& keys() {
  using K = Kind;
  // One key per entry (clang-format would put every field on its own line).
  // clang-format off
  static const std::vector<KeySpec> table = {
      // model
      {"model", "preset", K::text, "esm2_8m",
       "ESM-2 size (8M to 15B parameters, layers/hidden/heads/ffn as published), or custom to "
       "give layers, hidden, heads and ffn explicitly.",
       any(), {"esm2_8m", "esm2_35m", "esm2_150m", "esm2_650m", "esm2_3b", "esm2_15b",
               "esm2_moe_100m_a35m", "esm2_moe_2b_a650m", "aido_protein_16b", "custom"}},
      {"model", "layers", K::integer, "0",
       "Transformer blocks; 0 = the preset's. Required with preset custom.", atLeast(0), {}},
      {"model", "hidden", K::integer, "0",
       "Model width; 0 = the preset's. Must be a multiple of heads with an even head size "
       "(rotary embeddings rotate pairs).",
       atLeast(0), {}},
      {"model", "heads", K::integer, "0", "Attention heads; 0 = the preset's.", atLeast(0), {}},
      {"model", "ffn", K::integer, "0",
       "Feed-forward width (ESM-2 uses 4 x hidden); 0 = the preset's.", atLeast(0), {}},
      {"model", "max_positions", K::integer, "1026",
       "Longest sequence the model accepts, in tokens plus 2 (Hugging Face's "
       "max_position_embeddings; ESM-2's is 1026). Rotary embeddings need no table, so larger "
       "values only lift the limit on data.max_seq_len (<= max_positions - 2).",
       atLeast(3), {}},
      {"model", "recompute", K::text, "none",
       "Activation recomputation: none keeps every layer's activations; layer keeps only each "
       "layer's input and reruns its forward before its backward; selective keeps the GEMM "
       "outputs and recomputes LayerNorm and attention. Less memory for more compute; the "
       "gradients are bitwise the same.",
       any(), {"none", "layer", "selective"}},
      {"model", "init_from", K::text, "",
       "Start from the weights of another model: a plm model file, a checkpoint (file, or a "
       "checkpoint directory: its newest), or a Hugging Face ESM directory or safetensors file. "
       "Weights only: the optimizer, schedule and data stream start fresh (a new data.train is "
       "fine). The model section must describe the source (a shape or name mismatch is refused "
       "naming the tensor); model tensors the source lacks keep their initialisation and are "
       "listed in the log. Ignored when checkpoint.resume continues a run (doc/finetune.md).",
       any(), {}},
      // data
      {"data", "train", K::text, "data/train.h5",
       "Training set written by `plm prep` (parallel HDF5).", any(), {}, true},
      {"data", "valid", K::text, "data/valid.h5",
       "Validation set written by `plm prep`; \"\" = no validation.", any(), {}},
      {"data", "tokens_per_batch", K::integer, "16384",
       "Tokens per optimizer step over all ranks (ESM-2 used about 2M); a step accumulates "
       "gradients over tokens_per_batch / micro_batch_tokens packed micro-batches.",
       atLeast(1024), {}},
      {"data", "micro_batch_tokens", K::integer, "8192",
       "Token budget of one packed micro-batch (whole sequences, no padding); bounds activation "
       "memory.",
       atLeast(1024), {}},
      {"data", "seed", K::integer, "1",
       "Seed of the data order (a new permutation each epoch) and of the masking.", atLeast(0), {}},
      {"data", "mask_prob", K::real, "0.15",
       "Fraction of residues selected for the masked-LM loss (of those 80% become <mask>, 10% a "
       "random residue, 10% stay).",
       interval(0, 1, true, true), {}},
      {"data", "max_seq_len", K::integer, "1024",
       "Longest sequence in tokens, <cls> and <eos> included; longer ones are cropped to a random "
       "window. At most model.max_positions - 2 (ESM-2: 1024).",
       atLeast(16), {}},
      {"data", "prefetch", K::integer, "2",
       "Batches prepared ahead of the training step (0 = none).", atLeast(0), {}},
      {"data", "valid_tokens", K::integer, "0",
       "At most this many validation tokens per evaluation (0 = the whole validation set).",
       atLeast(0), {}},
      // optimizer
      {"optimizer", "name", K::text, "adamw",
       "adamw, lion (one moment), adafactor (factored second moment) or adamw8bit (block-wise "
       "8-bit moments); doc/optimizers.md.",
       any(), {"adamw", "lion", "adafactor", "adamw8bit"}},
      {"optimizer", "lr", K::real, "4.0e-4",
       "Peak learning rate (ESM-2: 4e-4, 1.6e-4 for 15B; Lion wants 3-10x less than AdamW).",
       above(0), {}},
      {"optimizer", "betas", K::real_pair, "[0.9, 0.98]", "AdamW and adamw8bit beta1 and beta2.",
       interval(0, 1, false, true), {}},
      {"optimizer", "eps", K::real, "1.0e-8", "AdamW and adamw8bit epsilon.", above(0), {}},
      {"optimizer", "lion_betas", K::real_pair, "[0.9, 0.99]",
       "Lion beta1 (update interpolation) and beta2 (moment decay) (Chen et al. 2023).",
       interval(0, 1, false, true), {}},
      {"optimizer", "adafactor_beta1", K::real, "0.0",
       "Adafactor first moment of the update (0 = none, the paper's default).",
       interval(0, 1, false, true), {}},
      {"optimizer", "adafactor_decay_rate", K::real, "-0.8",
       "Adafactor second-moment decay: beta2_t = 1 - t^decay_rate.", interval(-1, 0, false, true),
       {}},
      {"optimizer", "adafactor_eps", K::real_pair, "[1.0e-30, 1.0e-3]",
       "Adafactor eps1 (added to g^2) and eps2 (floor of the parameter scale RMS(p)).", above(0),
       {}},
      {"optimizer", "adafactor_clip_threshold", K::real, "1.0",
       "Adafactor update clipping d: the update is divided by max(1, RMS(update) / d).",
       above(0), {}},
      {"optimizer", "adafactor_scale_parameter", K::boolean, "true",
       "Adafactor step = lr x max(eps2, RMS(p)) per tensor (relative step stays off: lr is given).",
       any(), {}},
      {"optimizer", "adamw8bit_block_size", K::integer, "2048",
       "adamw8bit: elements per quantisation block, each with its own scale (bitsandbytes: 2048).",
       atLeast(1), {}},
      {"optimizer", "adamw8bit_min_8bit_size", K::integer, "4096",
       "adamw8bit: tensors with fewer elements (and the word embedding) keep fp32 moments.",
       atLeast(0), {}},
      {"optimizer", "weight_decay", K::real, "0.01",
       "Decoupled weight decay (not applied to biases, LayerNorm and embeddings).", atLeast(0), {}},
      {"optimizer", "clip_grad_norm", K::real, "1.0",
       "Clip the global gradient L2 norm to this value (0 = no clipping).", atLeast(0), {}},
      // schedule
      {"schedule", "warmup_steps", K::integer, "2000",
       "Steps of linear warm-up from 0 to optimizer.lr.", atLeast(0), {}},
      {"schedule", "decay", K::text, "linear",
       "Shape after warm-up: linear or cosine down to final_lr_ratio x lr at decay_steps, or "
       "constant.",
       any(), {"linear", "cosine", "constant"}},
      {"schedule", "final_lr_ratio", K::real, "0.1",
       "Learning rate at the end of the decay as a fraction of optimizer.lr (ESM-2: 0.1).",
       interval(0, 1, false, false), {}},
      {"schedule", "decay_steps", K::integer, "0",
       "Step at which the decay reaches its end (0 = train.steps); the rate stays there after.",
       atLeast(0), {}},
      // train
      {"train", "steps", K::integer, "1000", "Optimizer steps (ESM-2: 500k).", atLeast(1), {}},
      {"train", "log_every", K::integer, "10",
       "Log loss, learning rate, gradient norm and throughput every this many steps.", atLeast(1),
       {}},
      {"train", "eval_every", K::integer, "200",
       "Evaluate on data.valid every this many steps and after the last one (0 = never).",
       atLeast(0), {}},
      {"train", "precision", K::text, "fp32",
       "Arithmetic of the training step: fp32, bf16 (bfloat16 compute, fp32 master weights), or "
       "fp8 (the encoder layers' GEMMs in FP8 with the recipe of section fp8; doc/fp8.md).",
       any(), {"fp32", "bf16", "fp8"}},
      {"train", "run_dir", K::text, "run",
       "Directory for the training log, metrics and the resolved deck (deck.yaml).", any(), {},
       true},
      {"train", "seed", K::integer, "1", "Seed of the model initialisation.", atLeast(0), {}},
      {"train", "peak_tflops", K::real, "0",
       "Peak TFLOP/s of one device, for the MFU figure (0 = plm's table of known GPUs; on CPUs "
       "the larger of the vector-width x max-clock peak and a measured sgemm).",
       atLeast(0), {}},
      {"train", "log_all_ranks", K::boolean, "false",
       "Every rank logs, prefixed with its rank (same as the --log-all-ranks option).", any(), {}},
      {"train", "on_nonfinite", K::text, "stop",
       "A step whose loss or gradient is NaN or infinite is never applied; then: stop = end the "
       "run naming the step and the first non-finite tensor, skip = drop the step and go on, "
       "rollback = reload the newest checkpoint and skip that step's batch (doc/operations.md).",
       any(), {"skip", "stop", "rollback"}},
      {"train", "step_timeout", K::real, "0",
       "Seconds a step may take before the watchdog reports every rank's phase and ends the job "
       "(exit 124); 0 = 20 x the median step time once 10 steps ran, at least 300 s (1800 s "
       "before that, and for evaluations and checkpoint saves).",
       atLeast(0), {}},
      {"train", "attention", K::text, "auto",
       "Kernels of bf16/fp8 attention on the GPU: cudnn = cuDNN's fused attention both ways, "
       "cudnn-fwd = cuDNN forward with plm's flash backward, flash = plm's flash attention both "
       "ways (also the fallback for shapes cuDNN lacks), auto = the faster by head size as "
       "measured (doc/gpu.md). fp32 and CPU runs use the portable kernels whatever this says.",
       any(), {"auto", "cudnn", "cudnn-fwd", "flash"}},
      {"train", "deterministic", K::boolean, "true",
       "Bitwise-reproducible backward kernels. false lets cuDNN's attention backward accumulate "
       "dQ with float atomics: about 2% faster at 650M on an H100 (doc/gpu.md), but two runs "
       "of the same deck no longer agree bit for bit.",
       any(), {}},
      {"train", "profile", K::boolean, "false",
       "Time every GPU launch of the training passes by kind (GEMM, attention, LayerNorm, FP8 "
       "casts, MoE dispatch, other) with CUDA events: a line before each progress line, a "
       "gpu_ms object in each metrics.jsonl step record, and <run_dir>/profile_layers.tsv, the "
       "same per encoder layer (mean per step after the first progress interval). Costs a "
       "little speed; GPU runs only.",
       any(), {}},
      {"train", "gemm_autotune", K::boolean, "false",
       "Time up to 8 of cuBLASLt's candidate algorithms for each bf16 and FP8 GEMM shape on its "
       "first call (on scratch outputs; token counts by size bucket, so packed batches are "
       "tuned once) and keep the fastest that agrees with cuBLASLt's first choice; choices are "
       "logged (\"gemm autotune:\" lines) and kept in <run_dir>/gemm_autotune.txt, read by the "
       "next run in that directory so it skips the timing. Off by default: timing noise can "
       "pick a different algorithm in a fresh run directory, so two such runs need not agree "
       "bit for bit. Measured on one H200 (doc/performance.md): 650M bf16 1.008x, FP8 1.006x, "
       "8M 1.027x, 35M 1.003x the untuned run (18-24 tunings in 20-30 steps). GPU runs only.",
       any(), {}},
      {"train", "gemm_split", K::text, "streamk",
       "How the bf16 GEMMs whose output has too few tiles to keep every SM busy (the weight "
       "gradients, K = tokens) are spread over the GPU: off = cuBLASLt's choice; splitk = K "
       "split by cuBLASLt where a cost model expects it 10% faster; streamk = CUTLASS's "
       "stream-K kernel (builds with CUTLASS) for the weight gradients whose last wave of tiles "
       "is under 90% full, splitk's rule for the rest. Under train.gemm_autotune the split "
       "variants and the stream-K kernel are timed with the other candidates instead. Partial "
       "sums are added in a fixed order: runs stay bitwise reproducible, but differ from off in "
       "the last bits. GPU runs only (doc/gpu.md).",
       any(), {"off", "splitk", "streamk"}},
      {"train", "tensorboard", K::boolean, "false",
       "Also write the step and evaluation metrics as TensorBoard scalars to "
       "<run_dir>/tb/events.out.tfevents.* (rank 0; no TensorBoard needed to write them).",
       any(), {}},
      // parallel
      {"parallel", "shard_degree", K::integer, "1",
       "Ranks each parameter, its gradient and its AdamW state are sharded over (consecutive "
       "ranks). 1 = plain data parallelism (every rank holds the whole model); 0 = all ranks of "
       "a node. shard_degree x replicate_degree must equal the rank count.",
       atLeast(0), {}},
      {"parallel", "replicate_degree", K::integer, "0",
       "Copies of the sharded model (gradient shards are all-reduced across them); 0 = the "
       "rest, rank count / shard_degree.",
       atLeast(0), {}},
      {"parallel", "reshard_after_forward", K::boolean, "true",
       "Free a layer's gathered parameters after its forward and all-gather them again before "
       "its backward (less memory, one more all-gather per layer); false keeps them to the "
       "backward.",
       any(), {}},
      {"parallel", "gather_dtype", K::text, "auto",
       "Element type of the parameter all-gathers under sharding: bf16 moves bf16 copies of the "
       "shards (half the bytes; the layers then compute on bf16-rounded parameters, LayerNorm "
       "and biases included, as FSDP2's param_dtype does); fp32 moves the fp32 masters; auto = "
       "bf16 under train.precision: bf16 (and fp8 on the GPU), else fp32.  Under fp8 on the "
       "portable path the FP8 GEMM weights move as their E4M3 codes (1 byte) and the rest in "
       "fp32; bf16 is refused there.",
       any(), {"auto", "fp32", "bf16"}},
      {"parallel", "reduce_dtype", K::text, "fp32",
       "Element type of the gradient reduce-scatter. Only fp32 is implemented; bf16 is "
       "reserved and refused.",
       any(), {"fp32", "bf16"}},
      // moe
      {"moe", "experts", K::integer, "0",
       "Experts per MoE layer; 0 = the preset's (none for the dense ESM-2 presets).", atLeast(0), {}},
      {"moe", "top_k", K::integer, "0",
       "Experts each token is routed to; 0 = the preset's, else 2.", atLeast(0), {}},
      {"moe", "every", K::integer, "0",
       "Layer l is an MoE layer when (l + 1) % every == 0, the others dense; 0 = the preset's, "
       "else 1 (every layer).", atLeast(0), {}},
      {"moe", "expert_ffn", K::integer, "0",
       "FFN width of one expert; 0 = the preset's, else model.ffn / top_k (the dense model's "
       "active FLOPs).", atLeast(0), {}},
      {"moe", "shared_experts", K::integer, "0",
       "Always-on experts of width expert_ffn added to every token (DeepSeek style).", atLeast(0),
       {}},
      {"moe", "router", K::text, "softmax",
       "Router probabilities: softmax over experts, or an independent sigmoid per expert.",
       any(), {"softmax", "sigmoid"}},
      {"moe", "router_dtype", K::text, "fp32",
       "Arithmetic of the router GEMM and the routing (fp32 whatever train.precision is).", any(),
       {"fp32"}},
      {"moe", "normalize_topk", K::boolean, "true",
       "Divide the top-k gate weights by their sum.", any(), {}},
      {"moe", "dropless", K::boolean, "true",
       "Every routed slot is computed; false = each expert takes at most capacity_factor x "
       "tokens x top_k / experts slots per micro-batch, in token order, and the rest pass "
       "through the residual only.", any(), {}},
      {"moe", "capacity_factor", K::real, "1.25",
       "Expert capacity as a multiple of the balanced load (used when dropless is false).",
       above(0), {}},
      {"moe", "aux_loss", K::real, "0.01",
       "Coefficient of the Switch/GShard load-balancing loss experts x sum_e f_e P_e over the "
       "micro-batch (f_e counted before the capacity cut); 0 = off.", atLeast(0), {}},
      {"moe", "seq_aux_loss", K::real, "0",
       "Coefficient of the sequence-level balancing loss (DeepSeek-V3): the same loss within each "
       "sequence, averaged over the micro-batch's sequences; 0 = off.",
       atLeast(0), {}},
      {"moe", "z_loss", K::real, "0",
       "Coefficient of the router z-loss mean(logsumexp(logits)^2) (1e-3 is common); 0 = off.",
       atLeast(0), {}},
      {"moe", "bias_balance", K::boolean, "false",
       "Aux-loss-free balancing (DeepSeek-V3): a per-expert bias, used only to select experts, "
       "moves by bias_rate toward the mean load after every step.", any(), {}},
      {"moe", "bias_rate", K::real, "0.001", "Step of the bias_balance update.", above(0), {}},
      {"moe", "bias_update", K::text, "sign",
       "The bias_balance rule, with load_e the slots expert e took over the step and mean their "
       "mean: sign = bias_rate x sign(mean - load_e) (DeepSeek-V3); proportional = bias_rate x "
       "(mean - load_e) / mean (doc/model.md, Aux-loss-free balancing).",
       any(), {"sign", "proportional"}},
      {"moe", "dispatch_budget_gib", K::real, "0",
       "Expert parallelism: the most memory (GiB) one rank's expert-side buffers of one MoE "
       "layer may take (the rows it receives, their GELU pre-activation and activation kept for "
       "backward, and the backward's buffers); 0 = 90% of what the device (or host) has free "
       "when the layer runs, plus what the layer already holds. Checked on every micro-batch "
       "from the received counts, which every rank of the expert group knows: beyond it the job "
       "stops at once on every rank with one line naming the layer, the rank and its load "
       "(doc/operations.md).",
       atLeast(0), {}},
      {"moe", "router_init", K::text, "centred",
       "How the routers start: normal = N(0, 0.02) like every weight; centred = that draw with "
       "each router's rows made orthogonal to its layer's mean input over the first step's "
       "micro-batches (one forward pass before step 1 of a fresh run), so the component all "
       "tokens share at initialisation (most of it at hidden 1280 and up) does not send every "
       "token to the same experts (doc/model.md, Router initialisation).",
       any(), {"centred", "normal"}},
      {"moe", "router_projection", K::boolean, "true",
       "After every optimizer step, make each router's rows orthogonal to that step's mean router "
       "input (summed over the step's tokens on every rank): W <- W - (W m) m^T / |m|^2.  The "
       "early updates otherwise move every row along the input all tokens share, which adds one "
       "logit offset per expert to every token and sends most tokens to the same experts "
       "(doc/model.md, Router initialisation).  Not applied under parallel.shard_degree > 1.",
       any(), {}},
      {"moe", "router_projection_means", K::integer, "1",
       "With router_projection: the routers are kept orthogonal to the mean router inputs of "
       "this many most recent steps (their span), since the shared input also moves along the "
       "direction the updates take from step to step.  Above 1 the earlier means are not "
       "checkpointed: a resumed run then differs from an uninterrupted one.",
       atLeast(1), {}},
      {"moe", "expert_gemm", K::text, "auto",
       "How the experts' GEMMs run under train.precision bf16 on the GPU: loop = one cuBLASLt "
       "call per expert (bias and GELU fused), grouped = one CUTLASS SM90 grouped GEMM launch per "
       "GEMM for all experts (Hopper; needs the CUTLASS build), auto = by the crossover measured "
       "on the H100 (doc/performance.md).",
       any(), {"auto", "loop", "grouped"}},
      {"moe", "expert_activation", K::text, "auto",
       "The routed experts' FFN: gelu = ESM-2's MLP (intermediate.dense + bias, GELU, "
       "output.dense + bias); swiglu = down_proj(silu(gate_proj x) * up_proj x) without biases "
       "(the Mixtral / Qwen / AIDO.Protein form: three matrices per expert); auto = the preset's "
       "(swiglu for aido_protein_16b, gelu otherwise). Shared experts stay GELU. SwiGLU experts "
       "take moe.expert_gemm (loop or grouped) like GELU ones, and train.precision: fp8 "
       "(doc/fp8.md \"Experts\"; doc/model.md).",
       any(), {"auto", "gelu", "swiglu"}},
      {"moe", "overlap", K::boolean, "false",
       "Under expert parallelism, compute a rank's own rows of its own experts while the other "
       "rows travel, instead of sending every row through the all-to-all. Measured 2-6% slower "
       "on 2 GPUs over NVLink (doc/model.md); may pay where the all-to-all is slow.",
       any(), {}},
      {"moe", "routing", K::text, "device",
       "Where the bf16 GPU path routes tokens: device (top-k, counts and losses on the GPU), or "
       "host (the CPU reference: the logits travel to the host). fp32/fp64 runs and "
       "moe.seq_aux_loss > 0 always route on the host.",
       any(), {"device", "host"}},
      {"parallel", "context_degree", K::integer, "1",
       "Context parallelism: this many consecutive ranks share every micro-batch, each holding "
       "2 of the 2 x context_degree chunks of every sequence; attention runs as ring attention "
       "(doc/parallelism.md). Must divide the rank count; the ranks count as data-parallel ranks "
       "for the gradient sum. fp32 runs the portable ring, bf16 the CUDA attention kernels per "
       "block; MoE routing statistics, losses and capacities are reduced over the group.",
       atLeast(1), {}},
      {"parallel", "expert_degree", K::integer, "1",
       "Expert parallelism: this many consecutive ranks share the experts of each MoE layer "
       "(experts / expert_degree each), tokens travel by all-to-all. Must divide the world size "
       "and moe.experts.", atLeast(1), {}},
      // fp8
      {"fp8", "recipe", K::text, "delayed",
       "Scaling: delayed (per-tensor amax history of previous steps), current (the tensor's own "
       "amax) or block (1x128 / 128x128 blocks, power-of-two scales, E4M3 both ways).", any(),
       {"delayed", "current", "block"}},
      {"fp8", "format", K::text, "hybrid",
       "hybrid = E4M3 forward, E5M2 gradients; e4m3 = E4M3 both ways (block always uses e4m3).",
       any(), {"hybrid", "e4m3"}},
      {"fp8", "amax_history", K::integer, "1024",
       "Steps of amax history per tensor (delayed scaling).", atLeast(1), {}},
      {"fp8", "amax_reduce", K::text, "max",
       "Amax a delayed scale is computed from: the history's max or its most recent entry.",
       any(), {"max", "most_recent"}},
      {"fp8", "margin", K::integer, "0",
       "Delayed scales are (fp8_max / amax) / 2^margin.", interval(0, 32, false, false), {}},
      {"fp8", "first_layers_bf16", K::integer, "0",
       "This many first encoder layers keep their GEMMs in high precision.", atLeast(0), {}},
      {"fp8", "last_layers_bf16", K::integer, "0",
       "This many last encoder layers keep their GEMMs in high precision.", atLeast(0), {}},
      {"fp8", "wgrad", K::text, "fp8",
       "Weight-gradient GEMMs: fp8 operands, or the unquantised (bf16 on the GPU, fp32 on the "
       "CPU) ones.", any(), {"fp8", "bf16"}},
      {"fp8", "fused_cast", K::boolean, "true",
       "On the GPU under delayed and block scaling, LayerNorm and the GELU pass write the E4M3 "
       "codes for the FP8 GEMM that reads their output; false = a separate cast pass (slower; "
       "doc/fp8.md).", any(), {}},
      // lora
      {"lora", "rank", K::integer, "0",
       "Adapter rank r; 0 = no adapters. A target y = x W^T + b becomes y + (alpha / r) "
       "(x A^T) B^T with A (r, in) kaiming-uniform and B (out, r) zero, so step 0 is the base "
       "model exactly (PEFT's LoRA).", atLeast(0), {}},
      {"lora", "alpha", K::real, "8",
       "Adapter scale numerator: the update is multiplied by alpha / rank.", above(0), {}},
      {"lora", "targets", K::text, "q,k,v,o",
       "Comma-separated linear layers of every encoder layer that get an adapter: any of q, k, "
       "v (attention projections), o (attention output), ffn_in, ffn_out.", any(), {}},
      {"lora", "dropout", K::real, "0",
       "Dropout on the adapter input. Only 0 is implemented; other values are refused.",
       interval(0, 1, false, true), {}},
      // task
      {"task", "kind", K::text, "mlm",
       "mlm = masked-LM pre-training; sequence_regression (MSE, Spearman; /labels), "
       "sequence_classification (cross-entropy, accuracy, AUROC for 2 classes; /labels) and "
       "token_classification (per-residue cross-entropy and accuracy; /residue_labels) train "
       "the Hugging Face EsmForSequenceClassification / EsmForTokenClassification head.",
       any(), {"mlm", "sequence_regression", "sequence_classification", "token_classification"}},
      {"task", "num_labels", K::integer, "1",
       "Outputs of the head: 1 for regression, the number of classes for classification.",
       atLeast(1), {}},
      {"task", "pooling", K::text, "cls",
       "Sequence tasks: cls = the <cls> token's hidden state (Hugging Face's head); mean = the "
       "mean over the sequence's residues (plm only; not exportable to Hugging Face).",
       any(), {"cls", "mean"}},
      {"task", "freeze_encoder", K::boolean, "true",
       "true = train the head only: the encoder runs forward only and gets no update. false = "
       "fine-tune the encoder through the head (the head's loss backpropagated into every "
       "encoder tensor but the LM head's), with the optimizer section at optimizer.lr, under "
       "plain or sharded data parallelism.", any(), {}},
      {"task", "head_lr", K::real, "0.001",
       "Peak learning rate of the head (AdamW, the schedule section's warm-up and decay); the "
       "encoder uses optimizer.lr.", above(0), {}},
      {"task", "init_head", K::text, "",
       "Start the head from this file instead of a fresh one: a head.h5 written by plm train, "
       "or a model file from plm convert --from-hf of an EsmForSequenceClassification / "
       "EsmForTokenClassification folder. Its task kind, num_labels, pooling and hidden size "
       "must match.", any(), {}},
      // checkpoint
      {"checkpoint", "dir", K::text, "run/ckpt", "Directory of the checkpoint files.", any(), {},
       true},
      {"checkpoint", "every", K::integer, "200",
       "Write a checkpoint every this many steps (0 = never).", atLeast(0), {}},
      {"checkpoint", "keep", K::integer, "3",
       "How many of the newest checkpoints to keep; older ones are deleted (0 = keep all).",
       atLeast(0), {}},
      {"checkpoint", "resume", K::text, "auto",
       "auto = continue from the newest checkpoint in dir if there is one, none = start fresh, "
       "anything else = the path of the checkpoint to continue from.",
       any(), {}, true},
      {"checkpoint", "async", K::boolean, "false",
       "Copy the state to host memory between steps and write the file from a background "
       "thread while training goes on (at most one save in flight; same file, same checks).",
       any(), {}},
  };
  // clang-format on
  return table;
}

const SectionSpec* findSection(const std::string& name) {
  for (const auto& s : sections())
    if (s.name == name) return &s;
  return nullptr;
}

const KeySpec* findKey(const std::string& section, const std::string& name) {
  for (const auto& k : keys())
    if (k.section == section && k.name == name) return &k;
  return nullptr;
}

const std::vector<std::string>& rules() {
  static const std::vector<std::string> table = {
      "model.preset custom needs layers, hidden, heads and ffn (all >= 1).",
      "hidden must be a multiple of heads, and the head size hidden / heads must be even.",
      "data.tokens_per_batch >= data.micro_batch_tokens >= data.max_seq_len.",
      "schedule.decay_steps is 0 or >= schedule.warmup_steps.",
      "moe.top_k <= moe.experts; parallel.expert_degree divides moe.experts and the world size.",
      "fp8.first_layers_bf16 + fp8.last_layers_bf16 <= the model's layers.",
      "data.max_seq_len <= model.max_positions - 2; parallel.context_degree divides the world "
      "size.",
  };
  return table;
}

bool presetShape(const std::string& name, PresetShape& shape) {
  struct Named {
    const char* name;
    PresetShape shape;
  };
  static const Named table[] = {
      {"esm2_8m", {6, 320, 20, 1280}},
      {"esm2_35m", {12, 480, 20, 1920}},
      {"esm2_150m", {30, 640, 20, 2560}},
      {"esm2_650m", {33, 1280, 20, 5120}},
      {"esm2_3b", {36, 2560, 40, 10240}},
      {"esm2_15b", {48, 5120, 40, 20480}},
      // MoE presets: the dense shape; the experts come from the model's preset table.
      {"esm2_moe_100m_a35m", {12, 480, 20, 1920}},
      {"esm2_moe_2b_a650m", {33, 1280, 20, 5120}},
      {"aido_protein_16b", {36, 2304, 36, 7680}},
  };
  for (const auto& n : table)
    if (name == n.name) {
      shape = n.shape;
      return true;
    }
  return false;
}

}  // namespace detail

using detail::keys;
using detail::sections;

Teuchos::RCP<const Teuchos::ParameterList> schema() {
  static Teuchos::RCP<const Teuchos::ParameterList> built = [] {
    auto list = Teuchos::rcp(new Teuchos::ParameterList("plm deck"));
    for (const auto& s : sections()) list->sublist(s.name, false, s.doc);
    for (const auto& k : keys()) {
      auto& section = list->sublist(k.section);
      detail::setFromText(section, k, k.default_text, "schema");
      if (!k.choices.empty()) {
        Teuchos::Array<std::string> values(k.choices.begin(), k.choices.end());
        section.getEntry(k.name).setValidator(Teuchos::rcp(new Teuchos::StringValidator(values)));
      }
    }
    return Teuchos::RCP<const Teuchos::ParameterList>(list);
  }();
  return built;
}

namespace {

std::string allowed(const detail::KeySpec& k) {
  if (!k.choices.empty()) {
    std::string s = "one of ";
    for (size_t i = 0; i < k.choices.size(); ++i) s += (i ? ", " : "") + k.choices[i];
    return s;
  }
  if (k.kind == detail::Kind::real_pair) return "each " + k.range.describe();
  if (k.range.bounded()) return k.range.describe();
  if (k.nonempty) return "not empty";
  return "";
}

/// Comment lines of at most `width` columns, each starting with `indent` + "# ".
std::string comment(const std::string& text, const std::string& indent, size_t width = 100) {
  std::istringstream words(text);
  std::string word, line, out;
  while (words >> word) {
    if (!line.empty() && indent.size() + 2 + line.size() + 1 + word.size() > width) {
      out += indent + "# " + line + "\n";
      line.clear();
    }
    line += (line.empty() ? "" : " ") + word;
  }
  if (!line.empty()) out += indent + "# " + line + "\n";
  return out;
}

std::string markdownCell(std::string s) {
  std::string out;
  for (char c : s) out += (c == '|') ? std::string("\\|") : std::string(1, c);
  return out;
}

std::string shownDefault(const detail::KeySpec& k) {
  return k.default_text.empty() ? std::string("\"\"") : k.default_text;
}

}  // namespace

std::string defaultsYaml() {
  std::ostringstream os;
  os << "# plm input deck: every key at its default value (`plm deck --defaults`).\n"
        "# A deck is YAML (.yaml, .yml) or Teuchos XML (.xml). Leave out any key to take its\n"
        "# default; override one on the command line with --set section.key=value.\n"
        "# doc/deck.md is the full reference, including the rules between keys.\n";
  for (const auto& s : sections()) {
    os << "\n" << comment(s.doc, "") << s.name << ":\n";
    for (const auto& k : keys()) {
      if (k.section != s.name) continue;
      std::string a = allowed(k);
      os << comment(k.doc + (a.empty() ? "" : " Allowed: " + a + "."), "  ");
      os << "  " << k.name << ": " << (k.default_text.empty() ? "\"\"" : k.default_text) << "\n";
    }
  }
  return os.str();
}

std::string referenceMarkdown() {
  std::ostringstream os;
  os << "# Input deck reference\n\n"
        "<!-- Generated from src/deck/schema.cpp by `plm deck --markdown`; the test "
        "test_deck (DeckDocs.ReferenceIsUpToDate) fails when this file and the schema differ. "
        "Regenerate with: build/plm deck --markdown > doc/deck.md -->\n\n"
        "A deck is a Teuchos ParameterList written as plain YAML (`.yaml`, `.yml`) or Teuchos "
        "XML (`.xml`): one section per heading below, each a map of keys. Every key is optional "
        "and takes the default shown; an unknown key, a value of the wrong type or one outside "
        "the allowed range is an error that names the key and what is allowed. Integers are "
        "accepted where a real is expected.\n\n"
        "```yaml\n"
        "model:      { preset: esm2_8m }\n"
        "data:       { train: data/train.h5, valid: data/valid.h5, tokens_per_batch: 16384 }\n"
        "optimizer:  { lr: 4.0e-4, betas: [0.9, 0.98], weight_decay: 0.01 }\n"
        "schedule:   { warmup_steps: 2000, decay: linear, final_lr_ratio: 0.1 }\n"
        "train:      { steps: 1000, eval_every: 200, run_dir: run }\n"
        "checkpoint: { dir: run/ckpt, every: 200, keep: 3, resume: auto }\n"
        "```\n\n"
        "- `plm deck --defaults` prints a complete deck with every default and its documentation.\n"
        "- `plm deck --check DECK [--set section.key=value]...` validates a deck and prints it "
        "resolved (defaults filled in).\n"
        "- `plm train DECK --set optimizer.lr=1e-4` overrides any key from the command line, "
        "with the same validation; the resolved deck is written to `<train.run_dir>/deck.yaml`.\n"
        "- In XML, each key is `<Parameter name=\"lr\" type=\"double\" value=\"4e-4\"/>` inside "
        "`<ParameterList name=\"optimizer\">`; the value is read as the key's type below.\n";
  for (const auto& s : sections()) {
    os << "\n## `" << s.name << "`\n\n" << s.doc << "\n\n";
    os << "| key | type | default | allowed | meaning |\n|---|---|---|---|---|\n";
    for (const auto& k : keys()) {
      if (k.section != s.name) continue;
      os << "| `" << k.name << "` | " << markdownCell(detail::kindName(k.kind)) << " | `"
         << shownDefault(k) << "` | " << markdownCell(allowed(k)) << " | " << markdownCell(k.doc)
         << " |\n";
    }
  }
  os << "\n## Rules between keys\n\n";
  for (const auto& r : detail::rules()) os << "- " << r << "\n";
  os << "\n## Model presets\n\n| preset | layers | hidden | heads | ffn | head size |\n"
        "|---|---|---|---|---|---|\n";
  for (const auto& name : detail::findKey("model", "preset")->choices) {
    detail::PresetShape p{};
    if (!detail::presetShape(name, p)) continue;
    os << "| `" << name << "` | " << p.layers << " | " << p.hidden << " | " << p.heads << " | "
       << p.ffn << " | " << p.hidden / p.heads << " |\n";
  }
  return os.str();
}

}  // namespace plm::deck
