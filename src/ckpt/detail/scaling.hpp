// The checkpoint's /scaling group: the FP8 scaling state (model/fp8_scaling.hpp), so a resumed
// FP8 run continues exactly (Megatron's NaN-after-resume and BioNeMo's diverging resumes came
// from amax histories that were not saved).
//
//   /scaling                 attribute precision ("fp32" | "bf16" | "fp8"); under fp8 also
//                            recipe, format, amax_history, amax_reduce, margin,
//                            first_layers_bf16, last_layers_bf16, wgrad, steps, layers,
//                            moe_layers, experts (absent before FP8 experts: 0)
//   /scaling/amax_history    float32 ((layers * 4 + moe_layers * experts * 2) * 3 operands,
//                            amax_history); row (layer * 4 + gemm) * 3 + operand, gemm in qkv,
//                            attention_out, ffn_in, ffn_out order, operand in input, weight,
//                            grad order; then the routed experts' rows
//                            (layers * 4 + (moe * experts + expert) * 2 + down) * 3 + operand,
//                            moe the MoE layer's ordinal, down 0 (up projection) or 1; an
//                            expert's rows are by global expert, so any parallel.expert_degree
//                            reads them; column 0 is the step in progress (0 after a step)
//   /scaling/scale           float32 (rows): the scales the next step uses
#pragma once

#include "model/esm2.hpp"

#include <hdf5.h>
#include <mpi.h>

#include <cstdint>
#include <string>
#include <vector>

namespace plm::ckpt::detail {

/// The scaling state of a model, detached from it (host copies).
struct ScalingState {
  model::Precision precision = model::Precision::Fp32;
  model::Fp8Config config;
  int layers = 0;
  int moe_layers = 0, experts = 0;  // the routed experts' slots (FP8 MoE)
  std::int64_t steps = 0;
  std::vector<float> histories, scales;
};

/// \brief The model's scaling state now (empty unless precision is fp8).
template <class P> ScalingState takeScaling(model::Esm2<P>& model);

/// \brief Collective over the file's communicator: writes /scaling (rank 0's rows; the state
/// is the same on every rank).
void writeScaling(hid_t file, const ScalingState& state, MPI_Comm comm);

/// \brief Collective: reads /scaling of `path` (a checkpoint written before FP8 existed has an
/// empty group: precision fp32).  Throws CorruptCheckpoint if it is damaged.
ScalingState readScaling(hid_t file, const std::string& path);

/// \brief Why `stored` cannot be restored into `model` (empty: it can): another recipe, format
/// or history length.  A checkpoint without FP8 state, or a run that is not fp8, is no refusal
/// (the state starts fresh or is dropped, with a note from restoreScaling).
template <class P> std::string scalingRefusal(const ScalingState& stored, model::Esm2<P>& model);

/// \brief Puts `stored` into the model's scaling state (after scalingRefusal said yes).
template <class P> void restoreScaling(const ScalingState& stored, model::Esm2<P>& model);

}  // namespace plm::ckpt::detail
