// The elementwise pieces of bf16 ring attention (model/context_parallel.hpp) around the flash
// attention kernels: packing a shard's K and V for the ring, the log-sum-exp merge of block
// outputs, and the fp32 accumulators of the gradients.
//
// Design: the blocks' attention runs in bf16 on the tensor cores (flash_attention.hpp, with a
// key layout of its own per block), but what is summed over the C blocks is kept in fp32: the
// running output and its log-sum-exp, dQ, and the dK/dV partial sums that travel the ring, so
// degree C rounds to bf16 once, as one rank's attention does.  Tensors are row-major (T, width)
// with a row stride where they live inside the fused qkv buffers.
#pragma once

#include "gpu/device.hpp"

#include <cstdint>

namespace plm::gpu {

/// \brief dst (2 T, width), contiguous = [K rows; V rows] of a shard (strided sources).
void ringPack(Stream stream, const bf16* k, std::int64_t k_stride, const bf16* v,
              std::int64_t v_stride, std::int64_t tokens, int width, bf16* dst);

/// \brief The log-sum-exp merge of a block into the running output: with first, acc = o_blk,
/// lse = lse_blk; else lse' = log(e^lse + e^lse_blk), acc = e^(lse - lse') acc + e^(lse_blk -
/// lse') o_blk.  acc (T, heads head_dim) fp32, lse and lse_blk (T, heads) fp32 (natural log;
/// -inf = an empty part), o_blk (T, heads head_dim) bf16 with row stride o_stride.
void ringMerge(Stream stream, float* acc, float* lse, const bf16* o_blk, std::int64_t o_stride,
               const float* lse_blk, std::int64_t tokens, int heads, int head_dim, bool first);

/// \brief acc (rows, width) fp32, contiguous: = src (first) or += src; src bf16 with row stride.
void ringAccumulate(Stream stream, float* acc, const bf16* src, std::int64_t src_stride,
                    std::int64_t rows, int width, bool first);

/// \brief acc (rows, width) fp32 += src (rows, width) fp32, both contiguous.
void ringAdd(Stream stream, float* acc, const float* src, std::int64_t rows, int width);

/// \brief dst (rows, width) bf16 with row stride = src (rows, width) fp32, contiguous.
void ringStore(Stream stream, const float* src, bf16* dst, std::int64_t dst_stride,
               std::int64_t rows, int width);

/// \brief x (rows, cols) fp32 *= mult (rows): a context shard's token-dropout scale, which
/// follows the whole sequences (the embedding kernels' own scale sees only the shard).
void scaleRows(Stream stream, float* x, const float* mult, std::int64_t rows, int cols);

/// \brief dst (rows, cols) bf16 = src (rows, cols) bf16 * mult (rows), contiguous.
void scaleRows(Stream stream, const bf16* src, const float* mult, bf16* dst, std::int64_t rows,
               int cols);

}  // namespace plm::gpu
