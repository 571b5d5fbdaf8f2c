#include "train/stability.hpp"

#include "core/error.hpp"

#include <Kokkos_Core.hpp>

#include <cmath>

namespace plm::train {

OnNonfinite parseOnNonfinite(const std::string& text) {
  if (text == "skip") return OnNonfinite::Skip;
  if (text == "stop") return OnNonfinite::Stop;
  if (text == "rollback") return OnNonfinite::Rollback;
  throw collectiveError("train.on_nonfinite: `" + text + "`; use skip, stop or rollback");
}

const char* nameOf(OnNonfinite mode) {
  switch (mode) {
    case OnNonfinite::Skip: return "skip";
    case OnNonfinite::Stop: return "stop";
    case OnNonfinite::Rollback: return "rollback";
  }
  return "?";
}

template <class P> std::string firstNonfiniteTensor(const View1<P>& values,
                                                    const std::vector<model::TensorInfo>& tensors,
                                                    std::int64_t* count) {
  auto host = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), values);
  for (const auto& t : tensors) {
    std::int64_t bad = 0;
    for (std::int64_t i = 0; i < t.size; ++i)
      if (!std::isfinite(static_cast<double>(host(t.offset + i)))) ++bad;
    if (bad > 0) {
      if (count) *count = bad;
      return t.name;
    }
  }
  if (count) *count = 0;
  return "";
}

template std::string firstNonfiniteTensor<float>(const View1<float>&,
                                                 const std::vector<model::TensorInfo>&,
                                                 std::int64_t*);
template std::string firstNonfiniteTensor<double>(const View1<double>&,
                                                  const std::vector<model::TensorInfo>&,
                                                  std::int64_t*);

double LossSpikeDetector::mean() const {
  double s = 0;
  for (double x : recent_member) s += x;
  return recent_member.empty() ? 0.0 : s / double(recent_member.size());
}

double LossSpikeDetector::deviation() const {
  if (recent_member.size() < 2) return 0.0;
  const double m = mean();
  double s = 0;
  for (double x : recent_member) s += (x - m) * (x - m);
  return std::sqrt(s / double(recent_member.size() - 1));
}

bool LossSpikeDetector::add(double loss) {
  if (!std::isfinite(loss)) return false;
  bool spike = false;
  if (int(recent_member.size()) >= min_history_member) {
    const double m = mean();
    spike = loss > m + sigmas_member * deviation() && loss > 1.1 * m;
  }
  recent_member.push_back(loss);
  if (int(recent_member.size()) > window_member) recent_member.pop_front();
  return spike;
}

}  // namespace plm::train
