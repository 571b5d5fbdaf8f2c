// Errors and the two fatal paths.
//
// A user can cause an error (bad deck key, bad FASTA, wrong checkpoint): throw plm::Error with
// one message that says what was wrong, where, and what to do.  The driver decides how the job
// ends:
//   - every rank reached the same error (deck validation, a file every rank reads): the error
//     is collective; rank 0 prints it and all ranks finalize cleanly (fatalAll);
//   - one rank failed alone (I/O on its shard, a CUDA fault, out of memory): it prints its rank
//     and reason, tells the other ranks (which may be blocked in a collective) and exits; they
//     follow within seconds without a line of their own (fatalOne, core/failure.hpp).
// The driver does not catch: an uncaught exception reaches failure::onTerminate with the stack
// intact, so no destructor waits for a rank that is gone.
// Foreign calls (CUDA, cuBLASLt, NCCL, MPI, HDF5, files) are wrapped in the PLM_CHECK_* macros,
// which name the call, its status and file:line.
#pragma once

#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <string>

namespace plm {

/// \brief An error with a message meant for the user.
/// `collective` says that every rank raises the same error at the same point, so the job can
/// finalize cleanly instead of aborting.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message, bool collective = false)
      : std::runtime_error(message), collective_member(collective) {}
  bool collective() const { return collective_member; }
  /// \brief Several ranks of a group raise the same error and one of them prints it: the others
  /// raise it quiet (they leave without a line of their own, core/failure.hpp).
  Error& quiet(bool yes = true) {
    quiet_member = yes;
    return *this;
  }
  bool isQuiet() const { return quiet_member; }

 private:
  bool collective_member;
  bool quiet_member = false;
};

/// \brief An error that every rank raises identically (e.g. deck validation).
inline Error collectiveError(const std::string& message) { return Error(message, true); }

/// \brief All ranks agree: rank 0 prints `message`, every rank finalizes MPI, exits with `code`.
[[noreturn]] void fatalAll(const std::string& message, int code = 1);

/// \brief This rank alone failed: prints rank and reason (one line), tells the other ranks,
/// exits with `code` (core/failure.hpp; no MPI_Abort and its banner).
[[noreturn]] void fatalOne(const std::string& message, int code = 1);

namespace detail {
[[noreturn]] void throwCallError(const char* api, const char* call, const std::string& status,
                                 const char* file, int line);
std::string mpiErrorString(int code);
std::string hdf5ErrorStack();
}  // namespace detail

}  // namespace plm

#define PLM_STRINGIFY_IMPL(x) #x
#define PLM_STRINGIFY(x) PLM_STRINGIFY_IMPL(x)

/// Throws plm::Error naming the failed call when `cond` is false.
#define PLM_REQUIRE(cond, message)                         \
  do {                                                     \
    if (!(cond)) throw ::plm::Error(std::string(message)); \
  } while (0)

#define PLM_CHECK_MPI(call)                                                                   \
  do {                                                                                        \
    int plm_status_ = (call);                                                                 \
    if (plm_status_ != MPI_SUCCESS)                                                           \
      ::plm::detail::throwCallError("MPI", #call, ::plm::detail::mpiErrorString(plm_status_), \
                                    __FILE__, __LINE__);                                      \
  } while (0)

/// HDF5 calls return a negative value (herr_t or hid_t) on failure.
#define PLM_CHECK_H5(call)                                                                    \
  ([&]() {                                                                                    \
    auto plm_status_ = (call);                                                                \
    if (plm_status_ < 0)                                                                      \
      ::plm::detail::throwCallError("HDF5", #call, ::plm::detail::hdf5ErrorStack(), __FILE__, \
                                    __LINE__);                                                \
    return plm_status_;                                                                       \
  }())

#define PLM_CHECK_CUDA(call)                                                                   \
  do {                                                                                         \
    cudaError_t plm_status_ = (call);                                                          \
    if (plm_status_ != cudaSuccess)                                                            \
      ::plm::detail::throwCallError(                                                           \
          "CUDA", #call,                                                                       \
          std::string(cudaGetErrorName(plm_status_)) + ": " + cudaGetErrorString(plm_status_), \
          __FILE__, __LINE__);                                                                 \
  } while (0)

#define PLM_CHECK_CUBLAS(call)                                                             \
  do {                                                                                     \
    cublasStatus_t plm_status_ = (call);                                                   \
    if (plm_status_ != CUBLAS_STATUS_SUCCESS)                                              \
      ::plm::detail::throwCallError("cuBLASLt", #call,                                     \
                                    std::string(cublasGetStatusName(plm_status_)) + ": " + \
                                        cublasGetStatusString(plm_status_),                \
                                    __FILE__, __LINE__);                                   \
  } while (0)

#define PLM_CHECK_NCCL(call)                                                                  \
  do {                                                                                        \
    ncclResult_t plm_status_ = (call);                                                        \
    if (plm_status_ != ncclSuccess)                                                           \
      ::plm::detail::throwCallError("NCCL", #call, ncclGetErrorString(plm_status_), __FILE__, \
                                    __LINE__);                                                \
  } while (0)

/// C library / file calls that return nonzero (or null) on failure and set errno.
#define PLM_CHECK_SYS(ok_expr, what)                                                           \
  do {                                                                                         \
    if (!(ok_expr))                                                                            \
      ::plm::detail::throwCallError("system", what, std::strerror(errno), __FILE__, __LINE__); \
  } while (0)
