// Accumulation rule: x, position, mult written (=); dweight accumulates (+=), padding row never.
#include "model/embedding.hpp"

namespace plm::model {

template <class T> void sequenceInfo(const ExecSpace& space, const View1<seqlen_t>& cu_seqlens,
                                     const View1<token_t>& tokens, bool token_dropout,
                                     int mask_token, const View1<seqlen_t>& position,
                                     const View1<T>& mult) {
  const int n = static_cast<int>(cu_seqlens.extent(0)) - 1;
  if (n <= 0) return;
  Kokkos::parallel_for(
      "plm::model::sequence_info", Kokkos::RangePolicy<ExecSpace>(space, 0, n),
      KOKKOS_LAMBDA(const int s) {
        const seqlen_t begin = cu_seqlens(s), end = cu_seqlens(s + 1);
        int masked = 0;
        for (seqlen_t t = begin; t < end; ++t) masked += tokens(t) == mask_token ? 1 : 0;
        const T observed = T(masked) / T(end - begin);
        // A sequence made only of <mask> has nothing left to scale (Hugging Face divides by 0).
        const T scale = masked == end - begin ? T(0) : T(1.0 - 0.15 * 0.8) / (T(1) - observed);
        for (seqlen_t t = begin; t < end; ++t) {
          position(t) = t - begin;
          mult(t) = !token_dropout ? T(1) : (tokens(t) == mask_token ? T(0) : scale);
        }
      });
}

template <class T> void embeddingForward(const ExecSpace& space, const View1<token_t>& tokens,
                                         const View1<T>& mult, const View2<T>& weight,
                                         const View2<T>& x) {
  const auto n = static_cast<std::int64_t>(x.extent(0));
  const int h = static_cast<int>(x.extent(1));
  Kokkos::parallel_for(
      "plm::model::embedding_forward", FlatPolicy(space, 0, n),
      KOKKOS_LAMBDA(const std::int64_t t) {
        const T* w = &weight(tokens(t), 0);
        const T m = mult(t);
        T* row = &x(t, 0);
        for (int c = 0; c < h; ++c) row[c] = w[c] * m;
      });
}

template <class T> void embeddingBackward(const ExecSpace& space, const View1<token_t>& tokens,
                                          const View1<T>& mult, const View2<T>& dx, int padding_idx,
                                          const View2<T>& dweight) {
  // One thread per vocabulary row gathers its tokens in order: no atomics, deterministic.
  const int vocab = static_cast<int>(dweight.extent(0));
  const int h = static_cast<int>(dweight.extent(1));
  const auto n = static_cast<std::int64_t>(dx.extent(0));
  Kokkos::parallel_for(
      "plm::model::embedding_backward", Kokkos::RangePolicy<ExecSpace>(space, 0, vocab),
      KOKKOS_LAMBDA(const int v) {
        if (v == padding_idx) return;
        T* w = &dweight(v, 0);
        for (std::int64_t t = 0; t < n; ++t) {
          if (tokens(t) != v) continue;
          const T m = mult(t);
          const T* row = &dx(t, 0);
          for (int c = 0; c < h; ++c) w[c] += m * row[c];
        }
      });
}

#define PLM_MODEL_EMBEDDING_INSTANTIATE(T)                                                       \
  template void sequenceInfo<T>(const ExecSpace&, const View1<seqlen_t>&, const View1<token_t>&, \
                                bool, int, const View1<seqlen_t>&, const View1<T>&);             \
  template void embeddingForward<T>(const ExecSpace&, const View1<token_t>&, const View1<T>&,    \
                                    const View2<T>&, const View2<T>&);                           \
  template void embeddingBackward<T>(const ExecSpace&, const View1<token_t>&, const View1<T>&,   \
                                     const View2<T>&, int, const View2<T>&);

PLM_MODEL_EMBEDDING_INSTANTIATE(float)
PLM_MODEL_EMBEDDING_INSTANTIATE(double)

}  // namespace plm::model
