// The bf16 GEMMs of one ESM-2 encoder layer (hidden C, FFN F, T tokens per micro-batch) in the
// bf16 model's layouts and epilogues, as bench_gpu_gemm_tune and bench_gpu_gemm_sk time them:
// each Linear (QKV, attention out, FFN up, FFN down) as forward Y = X W^T + b (GELU fused into
// FFN up), dgrad dX = dY W (dGELU fused into FFN down's) and wgrad dW += dY^T X in fp32 with the
// bias gradient; and the random device operands of one GEMM.
#pragma once

#include "gpu/gemm.hpp"

#include "bench_util.hpp"

#include <cstdint>
#include <string>
#include <vector>

namespace {

struct LayerGemm {
  std::string label;        // e.g. "ffn up fwd"
  plm::gpu::GemmArgs args;  // shape, layout, output type, beta and epilogue; no operands
};

/// The layer's 12 GEMMs, Linear by Linear: forward, dgrad, wgrad.
std::vector<LayerGemm> layerGemms(std::int64_t C, std::int64_t F, std::int64_t T) {
  using namespace plm::gpu;
  enum class Kind { Forward, Dgrad, Wgrad };
  struct Linear {
    const char* name;
    std::int64_t out, in;
    bool gelu_out;  // FFN up: GELU fused into the forward
    bool gelu_in;   // FFN down: its dgrad carries the dGELU of FFN up's output
  };
  const Linear linears[] = {{"qkv", 3 * C, C, false, false},
                            {"attn out", C, C, false, false},
                            {"ffn up", F, C, true, false},
                            {"ffn down", C, F, false, true}};
  std::vector<LayerGemm> gemms;
  for (const Linear& l : linears)
    for (Kind kind : {Kind::Forward, Kind::Dgrad, Kind::Wgrad}) {
      GemmArgs a;
      const bool wgrad = kind == Kind::Wgrad;
      a.m = T, a.n = l.out, a.k = l.in;
      if (kind == Kind::Dgrad) a.n = l.in, a.k = l.out;
      if (wgrad) a.m = l.out, a.n = l.in, a.k = T;
      // X (T,in) x W (out,in)^T; dY (T,out) x W (out,in); dY^T X with dY stored (T,out) and X
      // stored (T,in).
      a.trans_a = wgrad;
      a.trans_b = kind == Kind::Forward;
      a.lda = wgrad ? a.m : a.k;
      a.ldb = kind == Kind::Forward ? a.k : a.n;
      a.d_type = wgrad ? DType::F32 : DType::BF16;
      a.beta = wgrad ? 1.0f : 0.0f;
      a.epilogue = kind == Kind::Forward ? (l.gelu_out ? Epilogue::BiasGeluAux : Epilogue::Bias)
                   : kind == Kind::Dgrad ? (l.gelu_in ? Epilogue::DGelu : Epilogue::None)
                                         : Epilogue::BGradA;
      const char* suffix = kind == Kind::Forward ? " fwd" : wgrad ? " wgrad" : " dgrad";
      gemms.push_back({std::string(l.name) + suffix, a});
    }
  return gemms;
}

/// A GEMM's device operands, random (never zeros), bound into its arguments: A, B, bias and aux
/// (bf16), D (room for fp32; its contents are the caller's to set) and the bias gradient.
struct GemmOperands {
  Buffer A, B, D, bias, aux, bgrad;
  explicit GemmOperands(plm::gpu::GemmArgs& a)
      : A(a.m * a.k * 2),
        B(a.n * a.k * 2),
        D(a.m * a.n * 4),
        bias(a.n * 4),
        aux(a.m * a.n * 2),
        bgrad(a.m * 4) {
    fill(A, a.m * a.k, 1.0f, 1);
    fill(B, a.n * a.k, 0.05f, 2);
    fill(bias, a.n, 0.1f, 3);
    fill(aux, a.m * a.n, 1.0f, 4);
    a.a = A.ptr;
    a.b = B.ptr;
    a.d = D.ptr;
    a.ldd = a.n;
    a.bias = bias.ptr;
    a.aux = aux.ptr;
    a.ldaux = a.n;
    a.bias_grad = bgrad.ptr;
  }
};

}  // namespace
