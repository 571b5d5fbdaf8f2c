// 8-bit AdamW (Dettmers, Lewis, Shleifer, Zettlemoyer 2022, "8-bit Optimizers via Block-wise
// Quantization"), as bitsandbytes' blockwise AdamW8bit stores its state:
//  - both moments quantised to 8 bits per element in blocks of `block_size` (2048) consecutive
//    elements of a tensor, each block with its own fp32 absolute maximum (the block scale);
//  - the codes index bitsandbytes' dynamic-tree maps (create_dynamic_map): the signed map for m,
//    the unsigned map for v (v >= 0, so its 8 bits all go to magnitude);
//  - a step dequantises (code value * old scale), runs the AdamW update in fp32 on the
//    dequantised moments, takes each block's new absolute maximum and quantises again to the
//    nearest code; the parameter update uses the fp32 moments before requantisation;
//  - the word embedding (bitsandbytes' StableEmbedding) and tensors under min_8bit_size (4096)
//    elements keep fp32 moments, as bitsandbytes does.
// The update is torch.optim.AdamW's (decay first, then the bias-corrected step), so with exact
// moments it is AdamW's; bitsandbytes applies the decay after the step (a second-order
// difference in lr * wd).
//
// Sharding: blocks are numbered per whole tensor.  A slice's partial block maxima are completed
// by one MPI max-all-reduce over the shard group (one float per block and moment, 1/1024 of the
// gradient bytes), so every rank quantises a block with the same scale, and the result is the
// unsharded one bit for bit.  The block scales are Replicated state; the codes are elementwise.
#pragma once

#include "train/optim/optimizer.hpp"

#include <array>

namespace plm::train {

/// \brief bitsandbytes' create_dynamic_map(signed, max_exponent_bits=7, total_bits=8): 256
/// sorted code values in [-1, 1] (signed) or [0, 1] (unsigned), computed in double.
std::array<float, 256> dynamicQuantileMap(bool is_signed);
/// \brief The code of the map value nearest to x (ties go to the lower code).
std::uint8_t quantizeNearest(const std::array<float, 256>& map, float x);
/// \brief Whether 8-bit AdamW quantises this tensor's moments.
bool adamw8bitQuantised(const AdamW8bitOptions& options, const model::TensorInfo& tensor);

namespace detail {
struct QuantSegment {                 // the part of one block in this rank's slice: one team
  std::int64_t begin = 0, count = 0;  // in the parameter buffer
  std::int64_t code = 0;              // into the code buffers
  std::int64_t block = 0;             // into the block scales
};
struct Fp32Segment {  // <= block_size elements of an fp32-state tensor: one team
  std::int64_t begin = 0, count = 0, state = 0;
};
}  // namespace detail

template <class P> class AdamW8bit : public Optimizer<P> {
 public:
  AdamW8bit(View1<P> params, ParamLayout layout, const AdamW8bitOptions& options);

  OptimizerKind kind() const override { return OptimizerKind::AdamW8bit; }
  std::vector<StateBuffer> state() const override;
  std::map<std::string, double> attributes() const override;
  const AdamW8bitOptions& options() const { return options_member; }
  void update(const ExecSpace& space, View1<P> grads, double lr, double grad_scale) override;

 private:
  AdamW8bitOptions options_member;
  StateBuffer m_codes_member, v_codes_member;    // (quantised elements) uint8 codes
  StateBuffer m_absmax_member, v_absmax_member;  // (blocks of the model) scales, replicated
  StateBuffer m_fp32_member, v_fp32_member;      // (other elements) fp32 moments
  StateBuffer m_map_member, v_map_member;        // (256) code values, signed / unsigned
  Kokkos::View<detail::QuantSegment*, MemSpace> quant_member;  // (segments)
  Kokkos::View<detail::Fp32Segment*, MemSpace> fp32_member;    // (segments)
  std::vector<std::int64_t> segment_block_member;              // host copy of block indices
};

}  // namespace plm::train
