#include "dist/health.hpp"

#include <map>
#include <mutex>

namespace plm::dist {

namespace {
struct Registry {
  std::mutex mutex;
  std::map<int, HealthCheck> checks;
  int next = 1;
};
Registry& registry() {
  static Registry r;
  return r;
}
}  // namespace

int addHealthCheck(HealthCheck check) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  const int id = r.next++;
  r.checks.emplace(id, std::move(check));
  return id;
}

void removeHealthCheck(int id) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.checks.erase(id);
}

std::string pollHealth() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  for (const auto& [id, check] : r.checks) {
    std::string problem = check();
    if (!problem.empty()) return problem;
  }
  return "";
}

}  // namespace plm::dist
