#include "core/error.hpp"

#include <hdf5.h>
#include <mpi.h>
#include <Kokkos_Core.hpp>

#include <cstdio>
#include <cstdlib>
#include <sstream>

namespace plm {

namespace {
int worldRank() {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (!initialized || finalized) return 0;
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  return rank;
}
}  // namespace

void fatalAll(const std::string& message, int code) {
  if (worldRank() == 0) {
    std::fprintf(stderr, "plm: error: %s\n", message.c_str());
    std::fflush(stderr);
  }
  if (Kokkos::is_initialized()) Kokkos::finalize();
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized) MPI_Finalize();
  std::exit(code);
}

void fatalOne(const std::string& message, int code) {
  std::fprintf(stderr, "plm: error on rank %d: %s\n", worldRank(), message.c_str());
  std::fflush(stderr);
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  int size = 1;
  if (initialized && !finalized) MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (initialized && !finalized && size > 1) MPI_Abort(MPI_COMM_WORLD, code);
  if (Kokkos::is_initialized()) Kokkos::finalize();
  if (initialized && !finalized) MPI_Finalize();
  std::exit(code);
}

namespace detail {

void throwCallError(const char* api, const char* call, const std::string& status, const char* file,
                    int line) {
  std::ostringstream os;
  os << api << " call failed: " << call << " -> " << status << " (" << file << ":" << line << ")";
  throw Error(os.str());
}

std::string mpiErrorString(int code) {
  char buffer[MPI_MAX_ERROR_STRING];
  int length = 0;
  if (MPI_Error_string(code, buffer, &length) != MPI_SUCCESS)
    return "MPI error " + std::to_string(code);
  return std::string(buffer, length);
}

namespace {
herr_t collectH5Error(unsigned n, const H5E_error2_t* err, void* data) {
  auto* out = static_cast<std::string*>(data);
  if (n > 0) *out += "; ";
  *out += err->func_name ? err->func_name : "?";
  *out += ": ";
  *out += err->desc ? err->desc : "";
  return 0;
}
}  // namespace

std::string hdf5ErrorStack() {
  std::string out;
  H5Ewalk2(H5E_DEFAULT, H5E_WALK_DOWNWARD, collectH5Error, &out);
  H5Eclear2(H5E_DEFAULT);
  return out.empty() ? std::string("HDF5 error") : out;
}

}  // namespace detail
}  // namespace plm
