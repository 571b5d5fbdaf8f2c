#include "core/error.hpp"

#include "core/failure.hpp"

#include <hdf5.h>
#include <mpi.h>

#include <cstdio>
#include <cstdlib>
#include <sstream>

namespace plm {

void fatalAll(const std::string& message, int code) { failure::failAll(message, code); }

void fatalOne(const std::string& message, int code) { failure::failRank(message, code); }

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
