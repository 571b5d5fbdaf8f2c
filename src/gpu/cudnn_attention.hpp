// cuDNN's fused scaled-dot-product attention on packed (THD) batches, the second
// implementation behind the model's attention dispatch point beside the own flash attention
// (flash_attention.hpp, which stays as the reference and the fallback).
//
// Design: the cuDNN frontend's graph API (header-only, from the nvidia-cudnn-frontend wheel,
// scripts/get-cudnn-frontend.sh) over the cuDNN 9 library.  The packed tokens are described as
// a (batch, heads, seqlen, head_dim) tensor with per-sequence ragged offsets into the same
// (T, H, D) rows plm keeps (q, k, v inside the stacked qkv buffer, row stride 3 hidden), a
// padding mask from the sequence lengths, and the log-sum-exp as a ragged (T, H) fp32 tensor,
// the layout and meaning of FlashParams::lse, so either implementation's forward pairs with
// either backward.  A graph is built once per shape bucket (batch rounded up to 16 sequences,
// max seqlen to 128, heads, head_dim, strides) and cached; the padding sequences of a bucket
// have length 0.  The backward runs cuDNN's deterministic algorithm unless asked otherwise
// (its dQ accumulation otherwise uses float atomics: runs would differ bit for bit).
#pragma once

#include "gpu/flash_attention.hpp"

#include <memory>
#include <string>

namespace plm::gpu {

/// \brief True when this build carries cuDNN's attention (CUDA with cuDNN and its frontend).
bool cudnnAttentionAvailable();

/// \brief One cuDNN handle, its cached graphs, workspace and the per-call ragged metadata.
/// Not thread-safe; one per OpContext.
class CudnnAttention {
 public:
  explicit CudnnAttention(bool deterministic_backward = true);
  ~CudnnAttention();
  CudnnAttention(const CudnnAttention&) = delete;
  CudnnAttention& operator=(const CudnnAttention&) = delete;

  /// \brief O and lse from q, k, v (FlashParams' forward fields).  Returns false (and does
  /// nothing) when cuDNN supports no kernel for this shape; the caller then runs the own flash
  /// attention.  Throws plm::Error on a cuDNN failure at run time.
  bool forward(Stream stream, const FlashParams& p);
  /// \brief dq, dk, dv (written) from dout, q, k, v, o and lse; false when unsupported, which
  /// includes gradients whose row strides differ from q, k, v's (and dout's from o's).
  bool backward(Stream stream, const FlashParams& p);

  /// \brief Graphs built so far and bytes of workspace held (for logs and tests).
  int graphs() const;
  std::size_t workspaceBytes() const;
  /// \brief Why the last forward or backward returned false ("" after one that ran).
  const std::string& whyNot() const;

  /// \brief The most workspace one graph may ask for; a graph asking more is not run (the
  /// caller's own flash attention runs instead).  cuDNN 9's graphs for very long sequences ask
  /// for workspace growing with the square of the sequence (cuDNN 9 on an H200, 20 heads of 64,
  /// one 16,384-token sequence: the backward asks for 160 GiB; at context degree 2, 8,192-token
  /// blocks, it held 42 GiB beside plm's buffers), where the own flash kernels need O(tokens).
  static constexpr std::size_t kMaxWorkspaceBytes = std::size_t(4) << 30;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl;
};

}  // namespace plm::gpu
