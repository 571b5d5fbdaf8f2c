// Named ranges for timeline tools: an NVTX range (Nsight Systems shows it on the host thread
// and, with --cuda-trace, projects it onto the kernels launched inside) where the build has NVTX
// (CUDA builds: the header-only nvtx3 of the CUDA toolkit, PLM_HAVE_NVTX), nothing otherwise.
// With no tool attached nvtx3's push and pop are a test of a null function pointer, so the
// ranges stay in release builds.  Names are static strings or built once; a layer's range is
// "plm::layer 12" and the operations inside it are "plm::<what>" (doc/performance.md).
#pragma once

#include "plm/plm_config.hpp"

#if PLM_HAVE_NVTX
#include <nvtx3/nvToolsExt.h>
#endif

#include <string>

namespace plm::trace {

/// \brief An NVTX range from construction to destruction (scoped, so it always pops).
class Scope {
 public:
  explicit Scope(const char* name) {
#if PLM_HAVE_NVTX
    nvtxRangePushA(name);
#else
    (void)name;
#endif
  }
  explicit Scope(const std::string& name) : Scope(name.c_str()) {}
  ~Scope() {
#if PLM_HAVE_NVTX
    nvtxRangePop();
#endif
  }
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;
};

/// \brief "plm::layer <l>" for layer l, built once per layer index (no allocation per call).
inline const char* layerName(int l) {
  static thread_local std::string names[256];
  if (l < 0 || l >= 256) return "plm::layer";
  std::string& s = names[l];
  if (s.empty()) s = "plm::layer " + std::to_string(l);
  return s.c_str();
}

}  // namespace plm::trace

#define PLM_TRACE_CAT2(a, b) a##b
#define PLM_TRACE_CAT(a, b) PLM_TRACE_CAT2(a, b)
/// \brief An NVTX range named `name` from here to the end of the enclosing block.
#define PLM_TRACE(name) ::plm::trace::Scope PLM_TRACE_CAT(plm_trace_scope_, __LINE__)(name)
