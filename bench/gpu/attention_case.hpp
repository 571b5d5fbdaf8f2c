// One varlen attention problem for the GPU benchmarks (bench_gpu, bench_gpu_attention): random
// q, k, v in one interleaved (T, 3, H, D) buffer as the model stores them, random dO, and every
// FlashParams field set for sequences of the given lengths (softmax scale D^-1/2).
#pragma once

#include "gpu/flash_attention.hpp"

#include "bench_util.hpp"
#include "core/error.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

std::vector<std::int32_t> prefixSums(const std::vector<int>& lengths) {
  std::vector<std::int32_t> cu{0};
  for (int l : lengths) cu.push_back(cu.back() + l);
  return cu;
}

struct AttentionCase {
  std::vector<std::int32_t> cu;  // (sequences + 1) offsets
  std::int64_t tokens, row_elems;
  std::size_t n;      // tokens x heads x head_dim
  double sum_sq = 0;  // sum of L^2 over the sequences
  // dq (3n when the gradients are interleaved like q, k, v, as cuDNN's backward needs; else n),
  // dk and dv (n each when apart, unused otherwise).
  Buffer qkv, o, dout, dq, dk, dv, lse, delta, cu_dev;
  plm::gpu::FlashParams p;

  AttentionCase(const std::vector<int>& lengths, int heads, int dim, bool interleaved_grads)
      : cu(prefixSums(lengths)),
        tokens(cu.back()),
        row_elems(std::int64_t(heads) * dim),
        n(tokens * row_elems),
        qkv(n * 3 * 2),
        o(n * 2),
        dout(n * 2),
        dq((interleaved_grads ? 3 : 1) * n * 2),
        dk(interleaved_grads ? 0 : n * 2),
        dv(interleaved_grads ? 0 : n * 2),
        lse(tokens * heads * 4),
        delta(tokens * heads * 4),
        cu_dev(cu.size() * 4) {
    using plm::gpu::bf16;
    for (int l : lengths) sum_sq += double(l) * l;
    fill(qkv, n * 3, 1.0f, 5);
    fill(dout, n, 1.0f, 6);
    PLM_CHECK_CUDA(cudaMemcpy(cu_dev.ptr, cu.data(), cu.size() * 4, cudaMemcpyHostToDevice));
    p.q = qkv.as<bf16>();
    p.k = qkv.as<bf16>() + row_elems;
    p.v = qkv.as<bf16>() + 2 * row_elems;
    p.q_stride = p.k_stride = p.v_stride = 3 * row_elems;
    p.o = o.as<bf16>();
    p.o_stride = row_elems;
    p.lse = lse.as<float>();
    p.cu_seqlens = cu_dev.as<std::int32_t>();
    p.num_seqs = static_cast<int>(lengths.size());
    p.max_seqlen = *std::max_element(lengths.begin(), lengths.end());
    p.total_tokens = tokens;
    p.heads = heads;
    p.head_dim = dim;
    p.softmax_scale = 1.0f / std::sqrt(float(dim));
    p.dout = dout.as<bf16>();
    p.dout_stride = row_elems;
    if (interleaved_grads) {
      p.dq = dq.as<bf16>();
      p.dk = dq.as<bf16>() + row_elems;
      p.dv = dq.as<bf16>() + 2 * row_elems;
      p.dq_stride = p.dk_stride = p.dv_stride = 3 * row_elems;
    } else {
      p.dq = dq.as<bf16>();
      p.dk = dk.as<bf16>();
      p.dv = dv.as<bf16>();
      p.dq_stride = p.dk_stride = p.dv_stride = row_elems;
    }
    p.delta = delta.as<float>();
  }
};

}  // namespace
