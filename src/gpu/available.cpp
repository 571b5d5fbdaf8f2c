// Whether this build carries the CUDA kernels; the one gpu source compiled in every build.
#include "gpu/device.hpp"

#include "plm/plm_config.hpp"

namespace plm::gpu {

bool available() { return PLM_HAVE_CUDA != 0; }

}  // namespace plm::gpu
