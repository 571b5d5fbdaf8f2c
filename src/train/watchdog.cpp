#include "train/watchdog.hpp"

#include "core/phase.hpp"
#include "dist/health.hpp"
#include "train/preemption.hpp"

#include <unistd.h>
#include <algorithm>
#include <cstdio>
#include <vector>

namespace plm::train {

namespace {
double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}
}  // namespace

Watchdog::Watchdog(WatchdogOptions options, int rank) : options_member(options), rank_member(rank) {
  char host[256] = "unknown";
  if (::gethostname(host, sizeof host) != 0) std::snprintf(host, sizeof host, "unknown");
  host[sizeof host - 1] = '\0';
  host_member = host;
  thread_member = std::thread([this] { loop(); });
}

Watchdog::~Watchdog() {
  {
    std::lock_guard<std::mutex> lock(mutex_member);
    stop_member = true;
  }
  wake_member.notify_all();
  thread_member.join();
}

double Watchdog::stepLimit() const {
  std::lock_guard<std::mutex> lock(mutex_member);
  if (options_member.fixed_timeout > 0) return options_member.fixed_timeout;
  if (finished_member < options_member.warm_up_steps || recent_member.empty())
    return options_member.warm_up_timeout;
  const double m = median(std::vector<double>(recent_member.begin(), recent_member.end()));
  return std::max(options_member.minimum_timeout, options_member.factor * m);
}

void Watchdog::arm(std::int64_t step, const char* what, bool long_task) {
  const double limit = stepLimit();
  std::lock_guard<std::mutex> lock(mutex_member);
  armed_member = true;
  step_member = step;
  what_member = what;
  counts_member = !long_task;
  limit_member = long_task ? std::max(limit, options_member.warm_up_timeout) : limit;
  start_member = std::chrono::steady_clock::now();
}

void Watchdog::disarm(double seconds) {
  std::lock_guard<std::mutex> lock(mutex_member);
  if (armed_member && counts_member) {
    recent_member.push_back(seconds);
    if (recent_member.size() > 100) recent_member.pop_front();
    ++finished_member;
  }
  armed_member = false;
}

void Watchdog::loop() {
  std::unique_lock<std::mutex> lock(mutex_member);
  while (!stop_member) {
    // Poll often enough to catch a short test limit within a tenth of it, at most once a second.
    const double tick = std::clamp(0.1 * (armed_member ? limit_member : 10.0), 0.05, 1.0);
    wake_member.wait_for(lock, std::chrono::duration<double>(tick));
    if (stop_member) return;
    lock.unlock();
    const std::string problem = dist::pollHealth();
    lock.lock();
    if (!problem.empty()) fail(problem);
    if (!armed_member) continue;
    const double elapsed =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start_member).count();
    if (elapsed > limit_member) {
      char why[512];
      std::snprintf(why, sizeof why,
                    "%s %lld has not finished after %.1f s (limit %.1f s: train.step_timeout, or "
                    "20x the median step time and at least 5 minutes when it is 0)",
                    what_member, static_cast<long long>(step_member), elapsed, limit_member);
      fail(why);
    }
  }
}

void Watchdog::fail(const std::string& why) {
  std::fprintf(stderr,
               "plm watchdog: rank %d on %s: step %lld, in %s: %s; ending the job (exit %d)\n",
               rank_member, host_member.c_str(), static_cast<long long>(step_member),
               phase::current(), why.c_str(), exit_watchdog);
  std::fflush(stderr);
  std::fflush(stdout);
  // The other ranks are stuck in the same step: give their watchdogs time to report before the
  // launcher reacts to this exit and kills them.
  std::this_thread::sleep_for(std::chrono::duration<double>(options_member.grace));
  ::_exit(exit_watchdog);
}

}  // namespace plm::train
