// Writes one bf16 training step of a small ESM-2 for validation/gpu_parity_hf.py, which redoes it
// with Hugging Face EsmForMaskedLM in fp32 and compares loss and every gradient:
//   DIR/params.bin (fp32 flat), DIR/grads.bin (fp32 flat), DIR/batch.bin (int32: T, n, tokens[T],
//   labels[T], cu_seqlens[n+1]), DIR/meta.txt (shape, loss sum, grad scale, tensor table).
//
//   gpu_parity_dump DIR LAYERS HIDDEN HEADS FFN [seed]
#include "core/error.hpp"
#include "data/synthetic.hpp"
#include "dist/runtime.hpp"
#include "model/esm2.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <random>
#include <string>
#include <vector>

namespace {

using namespace plm;

void writeFile(const std::string& path, const void* data, std::size_t bytes) {
  std::ofstream f(path, std::ios::binary);
  f.write(static_cast<const char*>(data), static_cast<std::streamsize>(bytes));
  if (!f) throw Error("gpu_parity_dump: cannot write " + path);
}

int run(int argc, char** argv) {
  if (argc < 6) throw Error("usage: gpu_parity_dump DIR LAYERS HIDDEN HEADS FFN [seed]");
  const std::string dir = argv[1];
  model::Esm2Config c;
  c.num_layers = std::atoi(argv[2]);
  c.hidden = std::atoi(argv[3]);
  c.heads = std::atoi(argv[4]);
  c.ffn = std::atoi(argv[5]);
  const std::uint64_t seed = argc > 6 ? std::atoll(argv[6]) : 3;
  c.precision = model::Precision::Bf16;
  model::Esm2<float> m(c);
  m.initialize(seed);
  {  // biases and LayerNorm parameters away from 0/1 too, so their gradients are checked.
    auto p = m.parameters();
    const std::int64_t n = p.extent(0);
    Kokkos::parallel_for(
        "perturb", Kokkos::RangePolicy<ExecSpace>(0, n), KOKKOS_LAMBDA(const std::int64_t i) {
          std::uint32_t h = static_cast<std::uint32_t>(i) * 2654435761u;
          h ^= h >> 15;
          p(i) += 0.02f * ((h & 0xffff) / 32768.0f - 1.0f);
        });
  }

  // Packed batch: lengths 1..1024 (one of each extreme), ESM-2 tokens, 15% labelled.
  const std::vector<int> lengths{37, 1, 1024, 2, 300, 129, 64, 555};
  const data::MicroBatch batch = data::syntheticBatch(lengths, seed);
  const std::int64_t masked = batch.num_masked;
  std::vector<std::int32_t> tokens(batch.tokens.data(), batch.tokens.data() + batch.numTokens());
  std::vector<std::int32_t> labels(batch.labels.data(), batch.labels.data() + batch.numTokens());
  std::vector<std::int32_t> cu(batch.cu_seqlens.data(),
                               batch.cu_seqlens.data() + batch.numSequences() + 1);

  m.zeroGradients();
  const double scale = 1.0 / static_cast<double>(masked);
  const double loss = m.forwardBackward(batch, scale);
  auto params = Kokkos::create_mirror_view_and_copy(HostSpace(), m.parameters());
  auto grads = Kokkos::create_mirror_view_and_copy(HostSpace(), m.gradients());
  writeFile(dir + "/params.bin", params.data(), params.extent(0) * 4);
  writeFile(dir + "/grads.bin", grads.data(), grads.extent(0) * 4);
  std::vector<std::int32_t> b{static_cast<std::int32_t>(tokens.size()),
                              static_cast<std::int32_t>(lengths.size())};
  b.insert(b.end(), tokens.begin(), tokens.end());
  b.insert(b.end(), labels.begin(), labels.end());
  b.insert(b.end(), cu.begin(), cu.end());
  writeFile(dir + "/batch.bin", b.data(), b.size() * 4);
  std::ofstream meta(dir + "/meta.txt");
  meta << "layers " << c.num_layers << "\nhidden " << c.hidden << "\nheads " << c.heads << "\nffn "
       << c.ffn << "\nloss_sum " << loss << "\ngrad_scale " << scale << "\n";
  for (const auto& t : m.tensors()) {
    meta << "tensor " << t.name << " " << t.offset;
    for (auto e : t.shape) meta << " " << e;
    meta << "\n";
  }
  std::printf("gpu_parity_dump: %zu tokens, %ld labelled, loss %.6f (sum %.4f) -> %s\n",
              tokens.size(), long(masked), loss * scale, loss, dir.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  plm::dist::Runtime runtime(argc, argv);
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gpu_parity_dump: %s\n", e.what());
    return 1;
  }
}
