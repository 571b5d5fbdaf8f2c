// Varlen (THD) flash attention, forward and backward, on the tensor cores (mma.sync bf16).
//
// Design: tokens of all sequences are packed into one stream; sequence s owns tokens
// [cu_seqlens[s], cu_seqlens[s+1]) and attends to itself only (non-causal).  The keys and values
// may be packed in a layout of their own (cu_seqlens_k: ring attention's blocks).  Q, K, V, O and
// their gradients are bf16 (T, H, D) rows with a row stride, so they can live inside a fused
// QKV buffer; the softmax statistics are fp32 and the T x T score matrix never exists.
// ESM-2 scales q by D^-1/2 before rotary, so the model passes softmax_scale = 1.
// Forward: one CTA per (64-query block, head, sequence), online softmax over 64-key blocks
// (double-buffered cp.async).  Backward runs two kernels instead of FA2's atomics: one per key
// block (dK, dV; recomputes P^T from the saved log-sum-exp) and one per query block (dQ;
// recomputes P and dP).  That is 7 matrix products instead of 5, traded for no fp32 atomics, no
// dQ accumulation buffer and no shared-memory transposes.  head_dim: any multiple of 8 up to 128
// (kernels exist for 16, 32, 64 and 128; a head_dim in between is zero-padded in shared memory,
// e.g. ESM-2 35M's 24 runs as 32).
// Small head_dim (<= 32, ESM-2 8M/35M/150M): the kernels are bound by the instructions they
// issue per score (ncu on an H200: issue slots 77-83% busy), not by the matrix products, so every
// kernel spends as few per score as it can: the score products start from a zero accumulator
// (no registers to clear), the exponentials are the hardware ex2 (flush-to-zero) of one FFMA,
// keys are masked only in a sequence's last key block, and the dK/dV kernel reads each lane's
// two log-sum-exp and delta values in one load.  The small-head_dim forward also takes the row
// maximum of the raw scores and keeps the row sums on the tensor cores (P times a column of
// ones: the sum of the bf16 P that weighs V).  At the 8M shape (65,536 tokens, 20 x 16) these
// took the forward from 0.50 to 0.41 ms and the backward from 1.26 to 1.04 ms.  A fused one-pass
// backward (P once per score, dQ accumulated in fp32 scratch) took 2.43 ms and was removed.
#pragma once

#include "gpu/device.hpp"

#include <cstdint>

namespace plm::gpu {

struct FlashParams {
  const bf16* q = nullptr;  // (T, H, D), row stride q_stride elements
  const bf16* k = nullptr;
  const bf16* v = nullptr;
  std::int64_t q_stride = 0, k_stride = 0, v_stride = 0;
  bf16* o = nullptr;  // (T, H, D), forward output
  std::int64_t o_stride = 0;
  float* lse = nullptr;  // (T, H) natural-log log-sum-exp of the scaled scores, forward output
  const std::int32_t* cu_seqlens = nullptr;  // device, (num_seqs + 1)
  int num_seqs = 0;
  int max_seqlen = 0;
  std::int64_t total_tokens = 0;
  // Keys and values in a layout of their own (ring attention: this rank's queries against
  // another rank's shard of the same sequences); nullptr = cu_seqlens.  A sequence without keys
  // gives o = 0 and lse = -inf (the empty part of a log-sum-exp merge) and zero gradients.
  const std::int32_t* cu_seqlens_k = nullptr;  // device, (num_seqs + 1)
  int max_seqlen_k = 0;
  int heads = 0;
  int head_dim = 0;  // multiple of 8, <= 128
  float softmax_scale = 1.0f;

  // Backward only.
  const bf16* dout = nullptr;  // (T, H, D)
  std::int64_t dout_stride = 0;
  bf16* dq = nullptr;  // (T, H, D), written
  bf16* dk = nullptr;
  bf16* dv = nullptr;
  std::int64_t dq_stride = 0, dk_stride = 0, dv_stride = 0;
  float* delta = nullptr;  // (T, H) scratch: rowsum(dO * O)

  // Which kernels run.  Auto: the small-head_dim forward for head_dim <= 32 (unless the
  // environment sets PLM_FLASH_LEGACY=1), the general kernels otherwise; the backward is always
  // the general one.  Legacy: the general forward at every head_dim.
  enum class Kernels { Auto, Legacy };
  Kernels kernels = Kernels::Auto;
};

/// \brief O = softmax(scale Q K^T) V per sequence, and its log-sum-exp.  Throws plm::Error for an
/// unsupported head_dim.
void flashAttentionForward(Stream stream, const FlashParams& p);

/// \brief dQ, dK, dV (written, not accumulated) from dO, with Q, K, V, O and lse of the forward.
void flashAttentionBackward(Stream stream, const FlashParams& p);

}  // namespace plm::gpu
