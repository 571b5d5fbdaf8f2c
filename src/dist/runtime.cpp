#include "dist/runtime.hpp"

#include "core/error.hpp"
#include "core/failure.hpp"
#include "core/log.hpp"

#include <hdf5.h>
#include <Kokkos_Core.hpp>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace plm::dist {

namespace {
int local_rank_state = 0;
int local_size_state = 1;
int thread_level_state = MPI_THREAD_SINGLE;
}  // namespace

Runtime::Runtime(int& argc, char**& argv) {
  int provided = 0;
  PLM_CHECK_MPI(MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided));
  thread_level_state = provided;
  MPI_Comm local;
  PLM_CHECK_MPI(
      MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &local));
  PLM_CHECK_MPI(MPI_Comm_rank(local, &local_rank_state));
  PLM_CHECK_MPI(MPI_Comm_size(local, &local_size_state));
  PLM_CHECK_MPI(MPI_Comm_free(&local));
  log::configure(worldRank(), false);
  // HDF5 failures are reported through PLM_CHECK_H5 (which walks the error stack into one
  // message); HDF5's own automatic printing would spill the raw stack onto stderr.
  H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
  // A rank that fails alone tells the others through this channel (core/failure.hpp).
  failure::start();

  int device = -1;
#if defined(KOKKOS_ENABLE_CUDA)
  // Spread ranks over the devices this process sees (one per rank when CUDA_VISIBLE_DEVICES
  // is set per rank by the job script).
  int count = 0;
  if (cudaGetDeviceCount(&count) == cudaSuccess && count > 0) device = local_rank_state % count;
  if (device < 0) {
    // Kokkos would abort (status 134) without saying why: say what, where and what to do, in
    // one line for the job (the lowest rank speaks, core/failure.hpp).
    const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
    failure::failRank(
        "this is a CUDA build of plm and rank " + std::to_string(worldRank()) +
        " (node-local rank " + std::to_string(local_rank_state) +
        ") sees no GPU (CUDA_VISIBLE_DEVICES=" + (visible ? visible : "(unset)") +
        "). Give every rank a GPU (the job scripts set CUDA_VISIBLE_DEVICES from the "
        "node-local rank: start as many ranks per node as the node has GPUs), or run a CPU "
        "build of plm.");
  }
#endif
#if KOKKOS_VERSION >= 30700
  Kokkos::InitializationSettings settings;
  if (device >= 0) settings.set_device_id(device);
  Kokkos::initialize(settings);
#else
  Kokkos::InitArguments args;
  args.device_id = device;
  Kokkos::initialize(args);
#endif
}

Runtime::~Runtime() {
  failure::stop();
  if (Kokkos::is_initialized()) Kokkos::finalize();
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();
}

int localRank() { return local_rank_state; }
bool mpiThreadMultiple() { return thread_level_state == MPI_THREAD_MULTIPLE; }
int localSize() { return local_size_state; }

std::string mpiVersion() {
  char buffer[MPI_MAX_LIBRARY_VERSION_STRING];
  int length = 0;
  MPI_Get_library_version(buffer, &length);
  std::string s(buffer, length);
  auto cut = s.find_first_of(",\n");
  return cut == std::string::npos ? s : s.substr(0, cut);
}

bool allTrue(bool ok, MPI_Comm comm) {
  int local = ok ? 1 : 0, global = 0;
  PLM_CHECK_MPI(MPI_Allreduce(&local, &global, 1, MPI_INT, MPI_MIN, comm));
  return global == 1;
}

template <> MPI_Datatype mpiType<float>() { return MPI_FLOAT; }
template <> MPI_Datatype mpiType<double>() { return MPI_DOUBLE; }
template <> MPI_Datatype mpiType<std::int32_t>() { return MPI_INT32_T; }
template <> MPI_Datatype mpiType<std::int64_t>() { return MPI_INT64_T; }
template <> MPI_Datatype mpiType<std::uint8_t>() { return MPI_UINT8_T; }
template <> MPI_Datatype mpiType<std::uint64_t>() { return MPI_UINT64_T; }

}  // namespace plm::dist
