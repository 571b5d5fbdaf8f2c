#include "train/memory_tracker.hpp"

#include <Kokkos_Core.hpp>

#include <algorithm>
#include <mutex>
#include <unordered_map>

namespace plm::train {
namespace {

struct State {
  std::mutex mutex;
  std::unordered_map<const void*, std::int64_t> live;  // allocation -> bytes
  std::int64_t in_use = 0;
  std::int64_t peak = 0;
  std::int64_t largest = 0;
  bool active = false;
};

State& state() {
  static State s;
  return s;
}

void onAllocate(Kokkos::Tools::SpaceHandle, const char*, const void* const ptr,
                const std::uint64_t size) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  s.live[ptr] = static_cast<std::int64_t>(size);
  s.in_use += static_cast<std::int64_t>(size);
  s.peak = std::max(s.peak, s.in_use);
  s.largest = std::max(s.largest, static_cast<std::int64_t>(size));
}

void onDeallocate(Kokkos::Tools::SpaceHandle, const char*, const void* const ptr,
                  const std::uint64_t) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  auto it = s.live.find(ptr);
  if (it == s.live.end()) return;
  s.in_use -= it->second;
  s.live.erase(it);
}

}  // namespace

bool AllocationTracker::start() {
  State& s = state();
  if (s.active) return true;
  if (Kokkos::Tools::profileLibraryLoaded()) return false;
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    s.live.clear();
    s.in_use = 0;
    s.peak = 0;
    s.largest = 0;
    s.active = true;
  }
  Kokkos::Tools::Experimental::set_allocate_data_callback(onAllocate);
  Kokkos::Tools::Experimental::set_deallocate_data_callback(onDeallocate);
  return true;
}

void AllocationTracker::stop() {
  State& s = state();
  if (!s.active) return;
  Kokkos::Tools::Experimental::set_allocate_data_callback(nullptr);
  Kokkos::Tools::Experimental::set_deallocate_data_callback(nullptr);
  std::lock_guard<std::mutex> lock(s.mutex);
  s.active = false;
  s.live.clear();
}

bool AllocationTracker::active() { return state().active; }

std::int64_t AllocationTracker::inUse() {
  std::lock_guard<std::mutex> lock(state().mutex);
  return state().in_use;
}

std::int64_t AllocationTracker::peak() {
  std::lock_guard<std::mutex> lock(state().mutex);
  return state().peak;
}

std::int64_t AllocationTracker::largest() {
  std::lock_guard<std::mutex> lock(state().mutex);
  return state().largest;
}

void AllocationTracker::resetPeak() {
  std::lock_guard<std::mutex> lock(state().mutex);
  state().peak = state().in_use;
  state().largest = 0;
}

}  // namespace plm::train
