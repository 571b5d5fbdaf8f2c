// The dispatch point of a MoE layer's experts: their FFNs over contiguous row blocks (expert
// i's rows follow expert i-1's, the routing's permutation order).
//
// Paths: fp32 / fp64 and FP8 weights run the experts one after another through the ordinary
// dispatch points (linearGelu + linear forward; linearBackwardGelu + linearBackward backward);
// bf16 on CUDA asks src/gpu (gpu::chooseExpertGemm: the deck's moe.expert_gemm = auto | loop |
// grouped; Auto by the measured crossover, per direction) whether to run that loop of cuBLASLt
// calls or CUTLASS's grouped GEMM, one launch per GEMM for all experts (gpu/moe_grouped.hpp).
// Accumulation: weight and bias gradients accumulate (+=); pre, act, y, dpre and dx are
// written (=).
#pragma once

#include "model/encoder_layer.hpp"
#include "model/moe_config.hpp"
#include "model/ops.hpp"

#include <cstdint>
#include <vector>

namespace plm::model {

/// One expert's weights (its gradients for the backward, else nullptr) and its number of rows.
struct ExpertRows {
  const DenseMlpWeights* w = nullptr;
  const DenseMlpGrads* g = nullptr;
  std::int64_t rows = 0;
};

/// \brief For each expert's row block: pre = x W1^T + b1, act = gelu_tanh(pre),
/// y = act W2^T + b2.  x, y (sum rows, H); pre, act (sum rows, F).
/// SwiGLU experts (moe_config.hpp; no biases, W1 = [gate; up] (2F, H)): pre = x W1^T
/// (sum rows, 2F), act = silu(pre_gate) * pre_up (sum rows, F), y = act W2^T.  They run the loop
/// of ordinary dispatch points (cuBLASLt under bf16) with ops.hpp's swiglu kernels between, or
/// under bf16 on CUDA the grouped launches (gpu::groupedSwigluExpertForward) as GELU does.
void expertsForward(OpContext& ctx, const std::vector<ExpertRows>& experts, const Mat& x,
                    const Mat& pre, const Mat& act, const Mat& y,
                    ExpertGemmMode mode = ExpertGemmMode::Auto,
                    ExpertActivation activation = ExpertActivation::Gelu);

/// Row counts a device routing left on the device (CUDA; gpu::DeviceRows): expert i's rows[i]
/// rows start at row first[i]; `total` rows in all.
struct DeviceExpertRows {
  const std::int64_t* rows = nullptr;
  const std::int64_t* first = nullptr;
  std::int64_t total = 0;
};

/// \brief expertsForward for experts whose row counts only the device holds (a dropless device
/// routing), so the host need not wait for them: true when it ran (bf16 on CUDA where the
/// grouped GEMM applies and `mode` is not Loop; Auto takes it whatever the expert count, since
/// the loop would need the counts on the host), false when the caller must bring the counts to
/// the host and call expertsForward.  ExpertRows::rows are not read.
bool expertsForwardOnDevice(OpContext& ctx, const std::vector<ExpertRows>& experts,
                            const DeviceExpertRows& rows, const Mat& x, const Mat& pre,
                            const Mat& act, const Mat& y,
                            ExpertGemmMode mode = ExpertGemmMode::Auto,
                            ExpertActivation activation = ExpertActivation::Gelu);

/// \brief The experts' backward from dy (sum rows, H): dpre = (dy W2) gelu'(pre),
/// dx = dpre W1, and g->w2 += dy^T act, g->b2 += sum dy, g->w1 += dpre^T x, g->b1 += sum dpre.
/// SwiGLU: dact = dy W2 (in `dact`, sum rows x F), dpre (sum rows, 2F) = swigluBackward,
/// dx = dpre W1, g->w2 += dy^T act, g->w1 += dpre^T x.
void expertsBackward(OpContext& ctx, const std::vector<ExpertRows>& experts, const Mat& x,
                     const Mat& pre, const Mat& act, const Mat& dy, const Mat& dpre, const Mat& dx,
                     ExpertGemmMode mode = ExpertGemmMode::Auto,
                     ExpertActivation activation = ExpertActivation::Gelu, const Mat& dact = Mat{});

}  // namespace plm::model
