// Accumulation rule: in place (=) in both directions.
#include "model/rotary.hpp"

#include "model/math.hpp"

namespace plm::model {

template <class T> void rotaryTables(const ExecSpace& space, int head_dim,
                                     const View2<T>& cos_table, const View2<T>& sin_table) {
  const auto positions = static_cast<std::int64_t>(cos_table.extent(0));
  const int half = head_dim / 2;
  Kokkos::parallel_for(
      "plm::model::rotary_tables",
      Kokkos::MDRangePolicy<ExecSpace, Kokkos::Rank<2>>(space, {0, 0},
                                                        {positions, std::int64_t(half)}),
      KOKKOS_LAMBDA(const std::int64_t p, const std::int64_t i) {
        const T inv_freq = T(1) / math::libm::pow(T(10000), T(2 * i) / T(head_dim));
        const T angle = T(p) * inv_freq;
        cos_table(p, i) = math::libm::cos(angle);
        sin_table(p, i) = math::libm::sin(angle);
      });
}

namespace {

template <class T> void rotate(const char* label, const ExecSpace& space, const View2<T>& x,
                               const View1<seqlen_t>& position, int heads,
                               const View2<T>& cos_table, const View2<T>& sin_table, T scale,
                               T direction) {
  const auto tokens = static_cast<std::int64_t>(x.extent(0));
  const int head_dim = static_cast<int>(x.extent(1)) / heads;
  const int half = head_dim / 2;
  Kokkos::parallel_for(
      label, FlatPolicy(space, 0, tokens), KOKKOS_LAMBDA(const std::int64_t t) {
        const seqlen_t p = position(t);
        const T* cs = &cos_table(p, 0);
        const T* sn = &sin_table(p, 0);
        for (int h = 0; h < heads; ++h) {
          T* row = &x(t, h * head_dim);
          for (int i = 0; i < half; ++i) {
            const T a = scale * row[i], b = scale * row[i + half];
            const T s = direction * sn[i];
            row[i] = a * cs[i] - b * s;
            row[i + half] = b * cs[i] + a * s;
          }
        }
      });
}

}  // namespace

template <class T>
void rotaryForward(const ExecSpace& space, const View2<T>& x, const View1<seqlen_t>& position,
                   int heads, const View2<T>& cos_table, const View2<T>& sin_table, T scale) {
  rotate("plm::model::rotary_forward", space, x, position, heads, cos_table, sin_table, scale,
         T(1));
}

template <class T>
void rotaryBackward(const ExecSpace& space, const View2<T>& dx, const View1<seqlen_t>& position,
                    int heads, const View2<T>& cos_table, const View2<T>& sin_table, T scale) {
  rotate("plm::model::rotary_backward", space, dx, position, heads, cos_table, sin_table, scale,
         T(-1));
}

#define PLM_MODEL_ROTARY_INSTANTIATE(T)                                                           \
  template void rotaryTables<T>(const ExecSpace&, int, const View2<T>&, const View2<T>&);         \
  template void rotaryForward<T>(const ExecSpace&, const View2<T>&, const View1<seqlen_t>&, int,  \
                                 const View2<T>&, const View2<T>&, T);                            \
  template void rotaryBackward<T>(const ExecSpace&, const View2<T>&, const View1<seqlen_t>&, int, \
                                  const View2<T>&, const View2<T>&, T);

PLM_MODEL_ROTARY_INSTANTIATE(float)
PLM_MODEL_ROTARY_INSTANTIATE(double)

}  // namespace plm::model
