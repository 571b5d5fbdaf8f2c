// FP8 training's scaling recipes and their state (Transformer Engine semantics, doc/fp8.md).
//
// Every encoder layer outside the deck's bf16 ranges runs its four GEMMs (QKV, attention output,
// FFN in, FFN out) in FP8; each GEMM has three operands: the input activation (E4M3), the
// weight (E4M3) and the output gradient (E5M2 under `hybrid`, E4M3 under `e4m3` and always
// under block scaling).  In a Mixture-of-Experts layer the FFN slots serve the shared experts,
// and each routed expert has two GEMMs of its own (up = FFN in, down = FFN out), with slots per
// (MoE layer, global expert), after the dense ones: an expert's state is the same on every rank
// (the amax reduction spans them all), whichever rank computes it, so it does not depend on
// parallel.expert_degree.
//  - Delayed: one amax history per operand (length amax_history); the current step's amax is
//    history[0] (the max over every cast of the step, all micro-batches); at the end of the step
//    the current amaxes of all operands are reduced over the data-parallel group in ONE
//    all-reduce (MAX), the scale for the next step is computed from the history and the history
//    rolls.  Scales are constant during a step.
//  - Current: the scale comes from the tensor's own amax at the cast; no state.
//  - Block: 1x128 blocks (activations, gradients; along the GEMM's inner dimension) and 128x128
//    blocks (weights), power-of-two scales, E4M3 both ways; no state.
// Design choice: the state is a few host arrays (operands x history), not device data: the CPU
// emulation reads a scale per GEMM call, and the all-reduce and the checkpoint want host memory.
#pragma once

#include "model/fp8.hpp"
#include "plm/plm_config.hpp"

#include <mpi.h>

#include <cstdint>
#include <string>
#include <vector>

// The CUDA build runs FP8 GEMMs through the kernels of src/gpu/fp8.hpp where they exist.
#if PLM_HAVE_CUDA && __has_include("gpu/fp8.hpp")
#define PLM_FP8_CUDA 1
#else
#define PLM_FP8_CUDA 0
#endif

namespace plm::model {

enum class Fp8Recipe : std::uint8_t { Delayed, Current, Block };
/// Hybrid: E4M3 forward, E5M2 gradients; E4M3: E4M3 both ways.
enum class Fp8Format : std::uint8_t { Hybrid, E4M3 };
/// What the delayed scale is computed from: the history's max, or its most recent entry.
enum class AmaxReduce : std::uint8_t { Max, MostRecent };
/// The weight-gradient GEMM's operands: FP8 (as the forward's) or the unquantised tensors.
enum class Fp8Wgrad : std::uint8_t { Fp8, Bf16 };

Fp8Recipe parseFp8Recipe(const std::string& name);  // collective plm::Error on a bad name
Fp8Format parseFp8Format(const std::string& name);
AmaxReduce parseAmaxReduce(const std::string& name);
Fp8Wgrad parseFp8Wgrad(const std::string& name);
const char* fp8RecipeName(Fp8Recipe r);
const char* fp8FormatName(Fp8Format f);
const char* amaxReduceName(AmaxReduce r);
const char* fp8WgradName(Fp8Wgrad w);

/// The deck's `fp8` section.
struct Fp8Config {
  Fp8Recipe recipe = Fp8Recipe::Delayed;
  Fp8Format format = Fp8Format::Hybrid;
  int amax_history = 1024;
  AmaxReduce amax_reduce = AmaxReduce::Max;
  int margin = 0;
  int first_layers_bf16 = 0;  // the first and last layers keep their GEMMs in high precision
  int last_layers_bf16 = 0;
  Fp8Wgrad wgrad = Fp8Wgrad::Fp8;
  // fp8.fused_cast: on the GPU, LayerNorm and the GELU pass write the E4M3 codes of the FP8 GEMM
  // that reads their output (delayed and block scaling); false = a separate cast pass.
  bool fused_cast = true;

  /// \brief True when layer `layer` of `num_layers` runs its GEMMs in FP8.
  bool fp8Layer(int layer, int num_layers) const {
    return layer >= first_layers_bf16 && layer < num_layers - last_layers_bf16;
  }
  /// \brief The format of output gradients (E5M2 under hybrid per-tensor recipes).
  fp8::Format gradFormat() const {
    return recipe != Fp8Recipe::Block && format == Fp8Format::Hybrid ? fp8::Format::E5M2
                                                                     : fp8::Format::E4M3;
  }
  /// \brief Throws a collective plm::Error naming the deck key if a value is out of range.
  void validate(int num_layers) const;
};

/// The four FP8 GEMMs of an encoder layer and the three operands of each.
enum class Fp8Gemm : std::uint8_t { Qkv, AttnOut, FfnIn, FfnOut };
enum class Fp8Operand : std::uint8_t { Input, Weight, Grad };
inline constexpr int fp8_gemms = 4;
inline constexpr int fp8_operands = 3;
const char* fp8GemmName(Fp8Gemm g);
const char* fp8OperandName(Fp8Operand o);

/// \brief Transformer Engine's delayed scale: (fp8_max / amax) / 2^margin; an amax that is 0 or
/// not finite keeps `previous`; a quotient that overflows fp32 becomes FLT_MAX.
float delayedScale(float amax, float fp8_max, int margin, float previous);
/// \brief The per-tensor scale of current scaling: fp8_max / amax (1 when amax is 0 or not
/// finite; FLT_MAX on overflow).
float currentScale(float amax, float fp8_max);
/// \brief Block scaling's power-of-two scale: the largest 2^k with amax * 2^k <= fp8_max (1 when
/// amax is 0 or not finite).
float powerOfTwoScale(float amax, float fp8_max);

/// \brief The scaling state of every FP8 GEMM operand of the model: layers x 4 GEMMs x 3, then
/// MoE layers x experts x 2 GEMMs (up, down) x 3.
class Fp8Scaling {
 public:
  /// `moe_layers`: the MoE layers in increasing order, each with `experts` routed experts.
  Fp8Scaling(const Fp8Config& config, int num_layers, const std::vector<int>& moe_layers = {},
             int experts = 0);

  const Fp8Config& config() const { return config_member; }
  int numLayers() const { return layers_member; }
  int numMoeLayers() const { return static_cast<int>(moe_layers_member.size()); }
  int numExperts() const { return experts_member; }
  /// Number of operands (the bf16 layers' stay at their initial state).
  int numTensors() const {
    return (layers_member * fp8_gemms + numMoeLayers() * experts_member * 2) * fp8_operands;
  }
  int index(int layer, Fp8Gemm g, Fp8Operand o) const {
    return (layer * fp8_gemms + static_cast<int>(g)) * fp8_operands + static_cast<int>(o);
  }
  /// \brief The operand of routed expert `expert`'s GEMM `g` (FfnIn = up, FfnOut = down) in MoE
  /// layer `layer`; plm::Error for a layer that is not an MoE layer or another GEMM.
  int expertIndex(int layer, int expert, Fp8Gemm g, Fp8Operand o) const;
  /// \brief The format an operand is cast to.
  fp8::Format format(Fp8Operand o) const {
    return o == Fp8Operand::Grad ? config_member.gradFormat() : fp8::Format::E4M3;
  }

  /// \brief The delayed scale of operand `t` for this step, and its inverse (fp32 1/scale).
  float scale(int t) const { return scale_member[t]; }
  float scaleInv(int t) const { return scale_inv_member[t]; }
  /// \brief The amax of operand `t` so far this step (history[0]).
  float currentAmax(int t) const { return history_member[std::size_t(t) * hist()]; }

  /// \brief history[0] of operand `t` = max(history[0], amax); a NaN or infinite amax is kept
  /// as +inf (non-finite: the next scale update keeps the scale).  Activation and gradient
  /// amaxes are taken only while recording() (training passes, not evaluation).
  void record(int t, float amax);
  bool recording() const { return recording_member; }
  void setRecording(bool on) { recording_member = on; }

  /// \brief Collective over `comm` (MPI_COMM_NULL or one rank: local only): the end of a
  /// training step under delayed scaling.  Reduces every operand's current amax over the
  /// ranks in one all-reduce (MAX), computes the next scales from the histories, and rolls
  /// them (history[0] starts the next step at 0).  Nothing under current and block scaling.
  void endStep(MPI_Comm comm);
  std::int64_t steps() const { return steps_member; }

  /// \brief The whole state, for checkpoints: histories (numTensors x amax_history, row t is
  /// operand t, column 0 the current step), scales (numTensors), steps taken.
  const std::vector<float>& histories() const { return history_member; }
  const std::vector<float>& scales() const { return scale_member; }
  /// \brief Replaces the state (sizes checked); scale inverses are recomputed.
  void restore(const std::vector<float>& histories, const std::vector<float>& scales,
               std::int64_t steps);

 private:
  std::size_t hist() const { return static_cast<std::size_t>(config_member.amax_history); }

  Fp8Config config_member;
  int layers_member = 0;
  std::vector<int> moe_layers_member;
  int experts_member = 0;
  std::vector<float> history_member;  // (tensors, amax_history)
  std::vector<float> scale_member;    // (tensors)
  std::vector<float> scale_inv_member;
  std::int64_t steps_member = 0;
  bool recording_member = false;
};

/// \brief What a GEMM weight handle (Mat::fp8) carries under the FP8 policy: which GEMM of
/// which layer it belongs to, so a dispatch point finds the scaling of its three operands.
struct Fp8GemmSlot {
  Fp8Scaling* scaling = nullptr;
  int layer = 0;
  Fp8Gemm gemm = Fp8Gemm::Qkv;
  int expert = -1;  // a routed expert's GEMM (gemm FfnIn = up, FfnOut = down); -1: dense
  // The CUDA path (bf16 storage): this GEMM's device data, set by the model.
  const void* w_codes = nullptr;   // (out, in) E4M3 copy of the weight, row stride in
  const void* wt_codes = nullptr;  // (in, out) its transpose, row stride out
  float* scales = nullptr;         // device: per operand (input, weight, grad) scale, scale_inv
  float* amaxes = nullptr;         // device: per operand, this step's amax (delayed)

  int index(Fp8Operand o) const {
    return expert < 0 ? scaling->index(layer, gemm, o)
                      : scaling->expertIndex(layer, expert, gemm, o);
  }
  /// Floats between two device scales: cuBLASLt reads the scale_inv of an operand through
  /// A/B_SCALE_POINTER, and 4-byte neighbours were refused (NOT_SUPPORTED) on the H100; each
  /// scale gets its own 256-byte line, as a separate allocation would.
  static constexpr int kScaleStride = 64;
  float* scale(int operand) const { return scales + kScaleStride * (2 * operand); }
  float* scaleInv(int operand) const { return scales + kScaleStride * (2 * operand + 1); }
};

}  // namespace plm::model
