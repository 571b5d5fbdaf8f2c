#include "train/optim/adafactor.hpp"

#include "core/error.hpp"
#include "core/flat.hpp"
#include "train/optim/detail/subset.hpp"

#include <algorithm>
#include <cmath>

namespace plm::train {

namespace {
#if KOKKOS_VERSION >= 30700
using Kokkos::sqrt;
#else
using Kokkos::Experimental::sqrt;
#endif

constexpr std::int64_t chunk_elements = 4096;  // one team's share of a piece

template <class T> std::vector<T> toHost(const View1<T>& d) {
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), d);
  return std::vector<T>(h.data(), h.data() + h.extent(0));
}

}  // namespace

bool adafactorFactored(const model::TensorInfo& tensor) { return tensor.shape.size() == 2; }

template <class P>
Adafactor<P>::Adafactor(View1<P> params, ParamLayout layout, const AdafactorOptions& options)
    : Optimizer<P>(params, std::move(layout)), options_member(options) {
  const ParamLayout& l = this->layout_member;
  if (options.beta1 > 0) exp_avg_member = detail::elementwiseBuffer("exp_avg", l);
  const detail::Subset unfactored =
      detail::subsetOf(l, [](const model::TensorInfo& t) { return !adafactorFactored(t); });
  exp_avg_sq_member = detail::subsetBuffer("exp_avg_sq", unfactored, false);

  // Row and column factors of every factored tensor of the model (global coordinates).
  std::vector<std::int64_t> row_base(l.tensors.size(), -1), col_base(l.tensors.size(), -1);
  row_member.name = "exp_avg_sq_row";
  col_member.name = "exp_avg_sq_col";
  row_member.layout = col_member.layout = StateBuffer::Layout::Replicated;
  for (std::size_t t = 0; t < l.tensors.size(); ++t) {
    const auto& info = l.tensors[t];
    if (!adafactorFactored(info)) continue;
    model::TensorInfo r = info, c = info;
    r.shape = {info.shape[0]};
    r.size = info.shape[0];
    r.offset = row_base[t] = row_member.full_size;
    c.shape = {info.shape[1]};
    c.size = info.shape[1];
    c.offset = col_base[t] = col_member.full_size;
    row_member.table.push_back(r);
    col_member.table.push_back(c);
    row_member.full_size += r.size;
    col_member.full_size += c.size;
    row_divisor_member.insert(row_divisor_member.end(), r.size, double(info.shape[1]));
    row_tensor_member.insert(row_tensor_member.end(), r.size, static_cast<int>(t));
    col_divisor_member.insert(col_divisor_member.end(), c.size, double(info.shape[0]));
  }
  row_member.f32 = View1<master_t>("plm::train::optim::exp_avg_sq_row", row_member.full_size);
  col_member.f32 = View1<master_t>("plm::train::optim::exp_avg_sq_col", col_member.full_size);

  // Pieces, chunks and row / column segments of this rank's slice.
  std::vector<detail::AdafactorChunk> chunks;
  std::vector<detail::AdafactorRow> rows;
  std::vector<detail::AdafactorCol> cols;
  std::size_t next_unfactored = 0;
  for (std::size_t i = 0; i < l.pieces.size(); ++i) {
    const TensorPiece& p = l.pieces[i];
    const auto& info = l.tensors[p.tensor];
    detail::AdafactorPiece a;
    a.local = p.local;
    a.start = p.start;
    a.count = p.count;
    a.tensor = p.tensor;
    a.factored = adafactorFactored(info) ? 1 : 0;
    if (a.factored) {
      a.rows = info.shape[0];
      a.cols = info.shape[1];
      a.row_base = row_base[p.tensor];
      a.col_base = col_base[p.tensor];
      const std::int64_t b = p.start, e = p.start + p.count, C = a.cols;
      for (std::int64_t r = b / C; r <= (e - 1) / C && p.count > 0; ++r) {
        const std::int64_t lo = std::max(b, r * C), hi = std::min(e, (r + 1) * C);
        rows.push_back({p.local + (lo - b), hi - lo, a.row_base + r});
      }
      for (std::int64_t j = 0; j < C && p.count > 0; ++j) {
        const std::int64_t first = b / C + (b % C > j ? 1 : 0);
        const std::int64_t last = (e - 1) / C - ((e - 1) % C < j ? 1 : 0);
        if (last >= first)
          cols.push_back({p.local + (first * C + j - b), last - first + 1, C, a.col_base + j});
      }
    } else {
      PLM_REQUIRE(next_unfactored < unfactored.pieces.size() &&
                      unfactored.param_local[next_unfactored] == p.local,
                  "Adafactor: unfactored pieces out of order");
      a.v_local = unfactored.pieces[next_unfactored++].local;
    }
    for (std::int64_t c = 0; c < p.count; c += chunk_elements)
      chunks.push_back({p.local + c, std::min(chunk_elements, p.count - c), static_cast<int>(i)});
    host_pieces_member.push_back(a);
  }
  for (const auto& c : chunks) chunk_piece_member.push_back(c.piece);
  for (const auto& r : rows) row_index_member.push_back(r.row);
  for (const auto& c : cols) col_index_member.push_back(c.col);
  pieces_member = detail::toDevice(host_pieces_member, "plm::train::adafactor::pieces");
  chunks_member = detail::toDevice(chunks, "plm::train::adafactor::chunks");
  rows_member = detail::toDevice(rows, "plm::train::adafactor::rows");
  cols_member = detail::toDevice(cols, "plm::train::adafactor::cols");
}

template <class P> std::vector<StateBuffer> Adafactor<P>::state() const {
  std::vector<StateBuffer> out;
  if (options_member.beta1 > 0) out.push_back(exp_avg_member);
  out.push_back(exp_avg_sq_member);
  out.push_back(row_member);
  out.push_back(col_member);
  return out;
}

template <class P> std::map<std::string, double> Adafactor<P>::attributes() const {
  const auto& o = options_member;
  return {{"beta1", o.beta1},
          {"decay_rate", o.decay_rate},
          {"eps1", o.eps1},
          {"eps2", o.eps2},
          {"clip_threshold", o.clip_threshold},
          {"scale_parameter", o.scale_parameter ? 1.0 : 0.0},
          {"weight_decay", o.weight_decay}};
}

template <class P>
void Adafactor<P>::update(const ExecSpace& space, View1<P> grads, double lr, double grad_scale) {
  using Team = Kokkos::TeamPolicy<ExecSpace>::member_type;
  const auto& o = options_member;
  const ParamLayout& l = this->layout_member;
  const std::size_t num_tensors = l.tensors.size();
  const double t = static_cast<double>(this->step_member);
  const double beta2t = 1.0 - std::pow(t, o.decay_rate);
  const master_t scale = static_cast<master_t>(grad_scale);
  const master_t eps1 = static_cast<master_t>(o.eps1);
  auto master = this->master_member;
  auto pieces = pieces_member;
  auto chunks = chunks_member;
  const auto nchunks = static_cast<int>(chunks.extent(0));

  // 1. Partial sums: p^2 per chunk, g^2 + eps1 per row segment and per column segment.
  View1<double> chunk_sum("plm::train::adafactor::chunk_sum", nchunks);
  View1<double> row_sum("plm::train::adafactor::row_sum", rows_member.extent(0));
  View1<double> col_sum("plm::train::adafactor::col_sum", cols_member.extent(0));
  Kokkos::parallel_for(
      "plm::train::adafactor::paramSquares",
      Kokkos::TeamPolicy<ExecSpace>(space, nchunks, Kokkos::AUTO), KOKKOS_LAMBDA(const Team& team) {
        const auto c = chunks(team.league_rank());
        double sum = 0.0;
        Kokkos::parallel_reduce(
            Kokkos::TeamThreadRange(team, c.count),
            [&](const std::int64_t k, double& acc) {
              const double x = static_cast<double>(master(c.begin + k));
              acc += x * x;
            },
            sum);
        Kokkos::single(Kokkos::PerTeam(team), [&] { chunk_sum(team.league_rank()) = sum; });
      });
  auto rows = rows_member;
  Kokkos::parallel_for(
      "plm::train::adafactor::rowSums",
      Kokkos::TeamPolicy<ExecSpace>(space, static_cast<int>(rows.extent(0)), Kokkos::AUTO),
      KOKKOS_LAMBDA(const Team& team) {
        const auto r = rows(team.league_rank());
        double sum = 0.0;
        Kokkos::parallel_reduce(
            Kokkos::TeamThreadRange(team, r.count),
            [&](const std::int64_t k, double& acc) {
              const master_t g = static_cast<master_t>(grads(r.begin + k)) * scale;
              acc += static_cast<double>(g * g + eps1);
            },
            sum);
        Kokkos::single(Kokkos::PerTeam(team), [&] { row_sum(team.league_rank()) = sum; });
      });
  auto cols = cols_member;
  plm::flatFor(
      "plm::train::adafactor::colSums", space, 0, cols.extent(0),
      KOKKOS_LAMBDA(const std::int64_t s) {
        const auto c = cols(s);
        double sum = 0.0;
        for (std::int64_t r = 0; r < c.rows; ++r) {
          const master_t g = static_cast<master_t>(grads(c.first + r * c.stride)) * scale;
          sum += static_cast<double>(g * g + eps1);
        }
        col_sum(s) = sum;
      });

  // 2. One all-reduce completes them over the shard group: [tensors | rows | columns].
  const std::size_t nrows = row_divisor_member.size(), ncols = col_divisor_member.size();
  std::vector<double> sums(num_tensors + nrows + ncols, 0.0);
  {
    const auto cs = toHost(chunk_sum), rs = toHost(row_sum), ks = toHost(col_sum);
    for (std::size_t c = 0; c < cs.size(); ++c)
      sums[host_pieces_member[chunk_piece_member[c]].tensor] += cs[c];
    for (std::size_t s = 0; s < rs.size(); ++s) sums[num_tensors + row_index_member[s]] += rs[s];
    for (std::size_t s = 0; s < ks.size(); ++s)
      sums[num_tensors + nrows + col_index_member[s]] += ks[s];
  }
  this->shardSum(sums);

  // 3. The factors' moving averages (replicated: every rank computes the same) and each
  //    factored tensor's mean row factor; the step size alpha of each tensor.
  auto row_host = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), row_member.f32);
  auto col_host = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), col_member.f32);
  std::vector<double> row_total(num_tensors, 0.0);
  for (std::size_t i = 0; i < nrows; ++i) {
    const double mean = sums[num_tensors + i] / row_divisor_member[i];
    row_host(i) = static_cast<master_t>(beta2t * row_host(i) + (1.0 - beta2t) * mean);
    row_total[row_tensor_member[i]] += row_host(i);
  }
  for (std::size_t j = 0; j < ncols; ++j) {
    const double mean = sums[num_tensors + nrows + j] / col_divisor_member[j];
    col_host(j) = static_cast<master_t>(beta2t * col_host(j) + (1.0 - beta2t) * mean);
  }
  Kokkos::deep_copy(row_member.f32, row_host);
  Kokkos::deep_copy(col_member.f32, col_host);
  std::vector<double> alpha(num_tensors), row_mean(num_tensors, 1.0);
  for (std::size_t i = 0; i < num_tensors; ++i) {
    const auto& info = l.tensors[i];
    const double rms = std::sqrt(sums[i] / static_cast<double>(info.size));
    alpha[i] = lr * (o.scale_parameter ? std::max(o.eps2, rms) : 1.0);
    if (adafactorFactored(info)) row_mean[i] = row_total[i] / static_cast<double>(info.shape[0]);
  }
  View1<master_t> mean_dev("plm::train::adafactor::row_mean", num_tensors);
  {
    auto h = Kokkos::create_mirror_view(mean_dev);
    for (std::size_t i = 0; i < num_tensors; ++i) h(i) = static_cast<master_t>(row_mean[i]);
    Kokkos::deep_copy(mean_dev, h);
  }

  // 4. v for unfactored elements; U = g / sqrt(V) and its squared sum per chunk.
  auto v = exp_avg_sq_member.f32;
  auto rf = row_member.f32;
  auto cf = col_member.f32;
  const master_t b2 = static_cast<master_t>(beta2t);
  const master_t one_minus_b2 = static_cast<master_t>(1.0 - beta2t);
  // U for element k of chunk c (v already updated).
  auto unscaled = KOKKOS_LAMBDA(const detail::AdafactorPiece& p, const std::int64_t i,
                                const master_t g, const master_t mean) {
    if (p.factored) {
      const std::int64_t e = p.start + (i - p.local);
      const std::int64_t r = e / p.cols, j = e % p.cols;
      return g / sqrt(rf(p.row_base + r) / mean) / sqrt(cf(p.col_base + j));
    }
    return g / sqrt(v(p.v_local + (i - p.local)));
  };
  Kokkos::parallel_for(
      "plm::train::adafactor::updateSquares",
      Kokkos::TeamPolicy<ExecSpace>(space, nchunks, Kokkos::AUTO), KOKKOS_LAMBDA(const Team& team) {
        const auto c = chunks(team.league_rank());
        const auto p = pieces(c.piece);
        const master_t mean = mean_dev(p.tensor);
        double sum = 0.0;
        Kokkos::parallel_reduce(
            Kokkos::TeamThreadRange(team, c.count),
            [&](const std::int64_t k, double& acc) {
              const std::int64_t i = c.begin + k;
              const master_t g = static_cast<master_t>(grads(i)) * scale;
              if (!p.factored) {
                const std::int64_t vi = p.v_local + (i - p.local);
                v(vi) = b2 * v(vi) + one_minus_b2 * (g * g + eps1);
              }
              const double u = static_cast<double>(unscaled(p, i, g, mean));
              acc += u * u;
            },
            sum);
        Kokkos::single(Kokkos::PerTeam(team), [&] { chunk_sum(team.league_rank()) = sum; });
      });
  std::vector<double> usq(num_tensors, 0.0);
  {
    const auto cs = toHost(chunk_sum);
    for (std::size_t c = 0; c < cs.size(); ++c)
      usq[host_pieces_member[chunk_piece_member[c]].tensor] += cs[c];
  }
  this->shardSum(usq);

  // 5. The update: clipped, scaled by alpha, optionally averaged; decoupled decay.
  View1<master_t> coef_dev("plm::train::adafactor::coef", num_tensors);
  View1<master_t> decay_dev("plm::train::adafactor::decay", num_tensors);
  {
    auto ch = Kokkos::create_mirror_view(coef_dev);
    auto dh = Kokkos::create_mirror_view(decay_dev);
    for (std::size_t i = 0; i < num_tensors; ++i) {
      const double rms = std::sqrt(usq[i] / static_cast<double>(l.tensors[i].size));
      ch(i) = static_cast<master_t>(alpha[i] / std::max(1.0, rms / o.clip_threshold));
      dh(i) = static_cast<master_t>(1.0 - o.weight_decay * alpha[i]);
    }
    Kokkos::deep_copy(coef_dev, ch);
    Kokkos::deep_copy(decay_dev, dh);
  }
  const bool momentum = o.beta1 > 0;
  auto m = exp_avg_member.f32;
  const master_t b1 = static_cast<master_t>(o.beta1);
  const master_t one_minus_b1 = static_cast<master_t>(1.0 - o.beta1);
  auto flags = this->flags_member;
  constexpr std::uint8_t decay_flag = Optimizer<P>::decay_flag;
  constexpr std::uint8_t frozen_flag = Optimizer<P>::frozen_flag;
  Kokkos::parallel_for(
      "plm::train::adafactor::apply", Kokkos::TeamPolicy<ExecSpace>(space, nchunks, Kokkos::AUTO),
      KOKKOS_LAMBDA(const Team& team) {
        const auto c = chunks(team.league_rank());
        const auto p = pieces(c.piece);
        const master_t mean = mean_dev(p.tensor);
        const master_t coef = coef_dev(p.tensor);
        const master_t decay = decay_dev(p.tensor);
        Kokkos::parallel_for(Kokkos::TeamThreadRange(team, c.count), [&](const std::int64_t k) {
          const std::int64_t i = c.begin + k;
          const std::uint8_t f = flags(i);
          if (f & frozen_flag) return;
          const master_t g = static_cast<master_t>(grads(i)) * scale;
          master_t u = coef * unscaled(p, i, g, mean);
          if (momentum) {
            u = b1 * m(i) + one_minus_b1 * u;
            m(i) = u;
          }
          master_t x = master(i);
          if (f & decay_flag) x *= decay;
          master(i) = x - u;
        });
      });
}

template class Adafactor<float>;
template class Adafactor<double>;

}  // namespace plm::train
