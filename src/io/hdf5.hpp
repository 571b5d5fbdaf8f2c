// Thin, checked HDF5 helpers shared by datasets and checkpoints.
//
// Every HDF5 call goes through PLM_CHECK_H5; handles are RAII (Hid) so an error thrown mid-write
// never leaks a file handle.  Files are opened with the MPI-IO driver on a communicator:
// metadata calls (create group / dataset / attribute) are collective, data transfers can be
// collective (the default) or independent.
#pragma once

#include "core/error.hpp"

#include <hdf5.h>
#include <mpi.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace plm::io::h5 {

/// \brief Owns an hid_t and closes it with the right H5*close for its type.
class Hid {
 public:
  Hid() = default;
  explicit Hid(hid_t id) : id_member(id) {}
  ~Hid() { reset(); }
  Hid(Hid&& other) noexcept : id_member(std::exchange(other.id_member, -1)) {}
  Hid& operator=(Hid&& other) noexcept {
    if (this != &other) {
      reset();
      id_member = std::exchange(other.id_member, -1);
    }
    return *this;
  }
  Hid(const Hid&) = delete;
  Hid& operator=(const Hid&) = delete;
  hid_t get() const { return id_member; }
  operator hid_t() const { return id_member; }
  bool valid() const { return id_member >= 0; }
  void reset();

 private:
  hid_t id_member = -1;
};

template <class T>
hid_t nativeType();  // H5T_NATIVE_* for float, double, int8..int64, uint8..uint64

/// \brief Throws a one-line plm::Error when `path`'s directory is missing or not writable.
void checkCreatable(const std::string& path);
/// \brief Create (truncate) `path` for parallel access on `comm` (checkCreatable first).
Hid createFile(const std::string& path, MPI_Comm comm);
/// \brief Open `path` read-only (or read-write) for parallel access on `comm`; a clear plm::Error
/// if it does not exist or is not HDF5.
Hid openFile(const std::string& path, MPI_Comm comm, bool writable = false);
/// \brief Open `path` read-only with the serial (sec2) driver, for one rank alone.
Hid openFileSerial(const std::string& path);

bool exists(hid_t location, const std::string& path);
/// \brief Create a group (and its parents, like "a/b/c").
Hid createGroup(hid_t location, const std::string& path);

/// \brief Create a dataset of `shape` with element type T (chunked when `chunk` is nonempty).
template <class T> Hid createDataset(hid_t location, const std::string& path,
                                     const std::vector<std::int64_t>& shape,
                                     const std::vector<std::int64_t>& chunk = {});
Hid openDataset(hid_t location, const std::string& path);
std::vector<std::int64_t> datasetShape(hid_t dataset);

/// \brief Write `count` rows starting at `start` along dimension 0 of a dataset (every other
/// dimension whole) from `data`. Collective unless `independent`. `count` may be 0 (a rank
/// with nothing to write still takes part in a collective write).
template <class T> void writeRows(hid_t dataset, std::int64_t start, std::int64_t count,
                                  const T* data, bool independent = false);
/// \brief Read rows [start, start+count) along dimension 0 into `data`.
template <class T> void readRows(hid_t dataset, std::int64_t start, std::int64_t count, T* data,
                                 bool independent = false);

/// Attributes on a file, group or dataset.
void writeAttribute(hid_t location, const std::string& name, const std::string& value);
void writeAttribute(hid_t location, const std::string& name, std::int64_t value);
void writeAttribute(hid_t location, const std::string& name, double value);
void writeAttribute(hid_t location, const std::string& name,
                    const std::vector<std::int64_t>& value);
void writeAttribute(hid_t location, const std::string& name, const std::vector<double>& value);
void writeAttribute(hid_t location, const std::string& name, const std::vector<std::string>& value);
bool hasAttribute(hid_t location, const std::string& name);
std::string readStringAttribute(hid_t location, const std::string& name);
std::int64_t readIntAttribute(hid_t location, const std::string& name);
double readDoubleAttribute(hid_t location, const std::string& name);
std::vector<std::int64_t> readIntArrayAttribute(hid_t location, const std::string& name);
std::vector<double> readDoubleArrayAttribute(hid_t location, const std::string& name);
std::vector<std::string> readStringArrayAttribute(hid_t location, const std::string& name);

/// \brief A string dataset (e.g. FASTA identifiers) written collectively: rank r passes its
/// rows, which land at [start, start + rows.size()). Parallel HDF5 cannot write variable-length
/// data, so strings are fixed-length (the longest over all ranks), NUL-padded.
void writeStrings(hid_t location, const std::string& path, MPI_Comm comm, std::int64_t global_count,
                  std::int64_t start, const std::vector<std::string>& rows);
std::vector<std::string> readStrings(hid_t location, const std::string& path, std::int64_t start,
                                     std::int64_t count);

}  // namespace plm::io::h5
