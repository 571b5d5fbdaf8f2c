#include "train/optim/adamw8bit.hpp"

#include "core/error.hpp"
#include "core/flat.hpp"
#include "train/optim/detail/adam_math.hpp"
#include "train/optim/detail/subset.hpp"

#include <algorithm>
#include <cmath>

namespace plm::train {

namespace {
#if KOKKOS_VERSION >= 30700
using Kokkos::fabs;
#else
using Kokkos::Experimental::fabs;
#endif

// Nearest code by binary search over the sorted map (device and host).
KOKKOS_INLINE_FUNCTION std::uint8_t nearestCode(const float* map, float x) {
  int lo = 0, hi = 255;  // map[lo] <= x < map[hi] once x is inside the range
  if (x <= map[0]) return 0;
  if (x >= map[255]) return 255;
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (map[mid] <= x)
      lo = mid;
    else
      hi = mid;
  }
  return static_cast<std::uint8_t>(x - map[lo] <= map[hi] - x ? lo : hi);
}

StateBuffer replicated(const std::string& name, std::vector<model::TensorInfo> table,
                       std::int64_t size) {
  StateBuffer b;
  b.name = name;
  b.layout = StateBuffer::Layout::Replicated;
  b.table = std::move(table);
  b.full_size = size;
  b.f32 = flatZeros<master_t>("plm::train::optim::" + name, size);
  return b;
}

}  // namespace

std::array<float, 256> dynamicQuantileMap(bool is_signed) {
  // bitsandbytes.functional.create_dynamic_map: non_sign_bits is total_bits - 1 for both maps,
  // so no "additional items" and 2^i (signed) or 2^(i+1) (unsigned) means per decade i.
  constexpr int max_exponent_bits = 7, non_sign_bits = 7;
  std::vector<double> data;
  for (int i = 0; i < max_exponent_bits; ++i) {
    const int items = is_signed ? (1 << (i + non_sign_bits - max_exponent_bits)) + 1
                                : (1 << (i + non_sign_bits - max_exponent_bits + 1)) + 1;
    const double decade = std::pow(10.0, -(max_exponent_bits - 1) + i);
    for (int k = 0; k + 1 < items; ++k) {
      const double b0 = 0.1 + 0.9 * k / (items - 1), b1 = 0.1 + 0.9 * (k + 1) / (items - 1);
      data.push_back(decade * (b0 + b1) / 2.0);
      if (is_signed) data.push_back(-decade * (b0 + b1) / 2.0);
    }
  }
  data.push_back(0.0);
  data.push_back(1.0);
  PLM_REQUIRE(data.size() == 256, "dynamicQuantileMap: " + std::to_string(data.size()) + " codes");
  std::sort(data.begin(), data.end());
  std::array<float, 256> map;
  for (int i = 0; i < 256; ++i) map[i] = static_cast<float>(data[i]);
  return map;
}

std::uint8_t quantizeNearest(const std::array<float, 256>& map, float x) {
  return nearestCode(map.data(), x);
}

bool adamw8bitQuantised(const AdamW8bitOptions& options, const model::TensorInfo& tensor) {
  return tensor.size >= options.min_8bit_size && tensor.name != options.fp32_tensor;
}

template <class P>
AdamW8bit<P>::AdamW8bit(View1<P> params, ParamLayout layout, const AdamW8bitOptions& options)
    : Optimizer<P>(params, std::move(layout)), options_member(options) {
  PLM_REQUIRE(options.block_size >= 1, "optimizer.adamw8bit_block_size must be positive");
  const ParamLayout& l = this->layout_member;
  const auto quantised = detail::subsetOf(
      l, [&](const model::TensorInfo& t) { return adamw8bitQuantised(options, t); });
  const auto fp32 = detail::subsetOf(
      l, [&](const model::TensorInfo& t) { return !adamw8bitQuantised(options, t); });
  m_codes_member = detail::subsetBuffer("exp_avg_codes", quantised, true);
  v_codes_member = detail::subsetBuffer("exp_avg_sq_codes", quantised, true);
  m_fp32_member = detail::subsetBuffer("exp_avg_fp32", fp32, false);
  v_fp32_member = detail::subsetBuffer("exp_avg_sq_fp32", fp32, false);

  // Block scales of every quantised tensor of the model, numbered per whole tensor.
  const std::int64_t B = options.block_size;
  std::vector<model::TensorInfo> scales;
  std::vector<std::int64_t> block_base(quantised.table.size());
  std::int64_t blocks = 0;
  for (std::size_t t = 0; t < quantised.table.size(); ++t) {
    model::TensorInfo s = quantised.table[t];
    s.size = (s.size + B - 1) / B;
    s.shape = {s.size};
    s.offset = block_base[t] = blocks;
    blocks += s.size;
    scales.push_back(s);
  }
  m_absmax_member = replicated("exp_avg_absmax", scales, blocks);
  v_absmax_member = replicated("exp_avg_sq_absmax", scales, blocks);
  model::TensorInfo map_info;
  map_info.name = "map";
  map_info.shape = {256};
  map_info.size = 256;
  m_map_member = replicated("quantile_map_signed", {map_info}, 256);
  v_map_member = replicated("quantile_map_unsigned", {map_info}, 256);
  for (auto [buffer, is_signed] : {std::pair{&m_map_member, true}, {&v_map_member, false}}) {
    const auto map = dynamicQuantileMap(is_signed);
    auto h = Kokkos::create_mirror_view(buffer->f32);
    for (int i = 0; i < 256; ++i) h(i) = map[i];
    Kokkos::deep_copy(buffer->f32, h);
  }
  // Zero moments: the code of 0.0 in each map (the scales start at 0, so any code reads 0).
  Kokkos::deep_copy(m_codes_member.u8, quantizeNearest(dynamicQuantileMap(true), 0.0f));
  Kokkos::deep_copy(v_codes_member.u8, quantizeNearest(dynamicQuantileMap(false), 0.0f));

  std::vector<detail::QuantSegment> quant;
  for (std::size_t i = 0; i < quantised.pieces.size(); ++i) {
    const TensorPiece& p = quantised.pieces[i];
    const std::int64_t end = p.start + p.count;
    for (std::int64_t b = p.start / B; b * B < end && p.count > 0; ++b) {
      const std::int64_t lo = std::max(p.start, b * B), hi = std::min(end, (b + 1) * B);
      quant.push_back({quantised.param_local[i] + (lo - p.start), hi - lo, p.local + (lo - p.start),
                       block_base[p.tensor] + b});
      segment_block_member.push_back(block_base[p.tensor] + b);
    }
  }
  std::vector<detail::Fp32Segment> plain;
  for (std::size_t i = 0; i < fp32.pieces.size(); ++i) {
    const TensorPiece& p = fp32.pieces[i];
    for (std::int64_t c = 0; c < p.count; c += B)
      plain.push_back({fp32.param_local[i] + c, std::min(B, p.count - c), p.local + c});
  }
  quant_member = detail::toDevice(quant, "plm::train::adamw8bit::segments");
  fp32_member = detail::toDevice(plain, "plm::train::adamw8bit::fp32_segments");
}

template <class P> std::vector<StateBuffer> AdamW8bit<P>::state() const {
  return {m_codes_member, v_codes_member, m_absmax_member, v_absmax_member,
          m_fp32_member,  v_fp32_member,  m_map_member,    v_map_member};
}

template <class P> std::map<std::string, double> AdamW8bit<P>::attributes() const {
  const auto& o = options_member;
  return {{"beta1", o.beta1},
          {"beta2", o.beta2},
          {"eps", o.eps},
          {"weight_decay", o.weight_decay},
          {"block_size", double(o.block_size)},
          {"min_8bit_size", double(o.min_8bit_size)}};
}

template <class P>
void AdamW8bit<P>::update(const ExecSpace& space, View1<P> grads, double lr, double grad_scale) {
  using Team = Kokkos::TeamPolicy<ExecSpace>::member_type;
  const auto& o = options_member;
  const detail::AdamStep a(o.beta1, o.beta2, o.eps, o.weight_decay, lr,
                           static_cast<double>(this->step_member), grad_scale);
  constexpr std::uint8_t decay_flag = Optimizer<P>::decay_flag;
  constexpr std::uint8_t frozen_flag = Optimizer<P>::frozen_flag;
  auto master = this->master_member;
  auto flags = this->flags_member;

  // fp32 part: AdamW as it is.
  {
    auto segs = fp32_member;
    auto m = m_fp32_member.f32;
    auto v = v_fp32_member.f32;
    Kokkos::parallel_for(
        "plm::train::adamw8bit::fp32",
        Kokkos::TeamPolicy<ExecSpace>(space, static_cast<int>(segs.extent(0)), Kokkos::AUTO),
        KOKKOS_LAMBDA(const Team& team) {
          const auto s = segs(team.league_rank());
          Kokkos::parallel_for(Kokkos::TeamThreadRange(team, s.count), [&](const std::int64_t k) {
            const std::int64_t i = s.begin + k, j = s.state + k;
            const std::uint8_t f = flags(i);
            if (f & frozen_flag) return;
            master_t mi = m(j), vi = v(j);
            a.moments(static_cast<master_t>(grads(i)), mi, vi);
            m(j) = mi;
            v(j) = vi;
            master(i) = a.apply(master(i), f & decay_flag, mi, vi);
          });
        });
  }
  const auto nseg = static_cast<int>(quant_member.extent(0));
  if (nseg == 0) return;

  // Pass 1: the new moments' absolute maximum per block (this rank's part of it).
  auto segs = quant_member;
  auto mc = m_codes_member.u8;
  auto vc = v_codes_member.u8;
  auto m_abs = m_absmax_member.f32;
  auto v_abs = v_absmax_member.f32;
  auto m_map = m_map_member.f32;
  auto v_map = v_map_member.f32;
  View1<master_t> m_part("plm::train::adamw8bit::m_max", nseg);
  View1<master_t> v_part("plm::train::adamw8bit::v_max", nseg);
  Kokkos::parallel_for(
      "plm::train::adamw8bit::blockMax", Kokkos::TeamPolicy<ExecSpace>(space, nseg, Kokkos::AUTO),
      KOKKOS_LAMBDA(const Team& team) {
        const auto s = segs(team.league_rank());
        const master_t ma = m_abs(s.block), va = v_abs(s.block);
        master_t m_max = 0, v_max = 0;
        Kokkos::parallel_reduce(
            Kokkos::TeamThreadRange(team, s.count),
            [&](const std::int64_t k, master_t& acc) {
              master_t mi = m_map(mc(s.code + k)) * ma, vi = 0;
              a.moments(static_cast<master_t>(grads(s.begin + k)), mi, vi);
              if (fabs(mi) > acc) acc = fabs(mi);
            },
            Kokkos::Max<master_t>(m_max));
        Kokkos::parallel_reduce(
            Kokkos::TeamThreadRange(team, s.count),
            [&](const std::int64_t k, master_t& acc) {
              master_t mi = 0, vi = v_map(vc(s.code + k)) * va;
              a.moments(static_cast<master_t>(grads(s.begin + k)), mi, vi);
              if (vi > acc) acc = vi;
            },
            Kokkos::Max<master_t>(v_max));
        Kokkos::single(Kokkos::PerTeam(team), [&] {
          m_part(team.league_rank()) = m_max;
          v_part(team.league_rank()) = v_max;
        });
      });

  // Complete the maxima over the shard group (blocks are numbered per whole tensor).
  const auto blocks = static_cast<std::size_t>(m_abs.extent(0));
  std::vector<float> maxima(2 * blocks, 0.0f);
  {
    auto mh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), m_part);
    auto vh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), v_part);
    for (int s = 0; s < nseg; ++s) {
      const auto b = static_cast<std::size_t>(segment_block_member[s]);
      maxima[b] = std::max(maxima[b], mh(s));
      maxima[blocks + b] = std::max(maxima[blocks + b], vh(s));
    }
  }
  this->shardMax(maxima);
  View1<master_t> new_abs("plm::train::adamw8bit::new_absmax", 2 * blocks);
  {
    auto h = Kokkos::create_mirror_view(new_abs);
    std::copy(maxima.begin(), maxima.end(), h.data());
    Kokkos::deep_copy(new_abs, h);
  }

  // Pass 2: the same moments again, the parameter update, and the codes under the new scales.
  Kokkos::parallel_for(
      "plm::train::adamw8bit::apply", Kokkos::TeamPolicy<ExecSpace>(space, nseg, Kokkos::AUTO),
      KOKKOS_LAMBDA(const Team& team) {
        const auto s = segs(team.league_rank());
        const master_t ma = m_abs(s.block), va = v_abs(s.block);
        const master_t m_new = new_abs(s.block), v_new = new_abs(blocks + s.block);
        Kokkos::parallel_for(Kokkos::TeamThreadRange(team, s.count), [&](const std::int64_t k) {
          const std::int64_t i = s.begin + k, c = s.code + k;
          master_t mi = m_map(mc(c)) * ma, vi = v_map(vc(c)) * va;
          a.moments(static_cast<master_t>(grads(i)), mi, vi);
          const std::uint8_t f = flags(i);
          if (!(f & frozen_flag)) master(i) = a.apply(master(i), f & decay_flag, mi, vi);
          mc(c) = nearestCode(m_map.data(), m_new > 0 ? mi / m_new : master_t(0));
          vc(c) = nearestCode(v_map.data(), v_new > 0 ? vi / v_new : master_t(0));
        });
      });
  Kokkos::deep_copy(space, m_abs, Kokkos::subview(new_abs, std::make_pair(std::size_t(0), blocks)));
  Kokkos::deep_copy(space, v_abs, Kokkos::subview(new_abs, std::make_pair(blocks, 2 * blocks)));
}

template class AdamW8bit<float>;
template class AdamW8bit<double>;

}  // namespace plm::train
