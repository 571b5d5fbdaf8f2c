#include "io/hdf5.hpp"
#include "io/hdf5_group.hpp"

#include <sys/stat.h>
#include <unistd.h>
#include <algorithm>
#include <cstring>

namespace plm::io::h5 {

void Hid::reset() {
  if (id_member < 0) return;
  switch (H5Iget_type(id_member)) {
    case H5I_FILE: H5Fclose(id_member); break;
    case H5I_GROUP: H5Gclose(id_member); break;
    case H5I_DATASET: H5Dclose(id_member); break;
    case H5I_DATASPACE: H5Sclose(id_member); break;
    case H5I_DATATYPE: H5Tclose(id_member); break;
    case H5I_ATTR: H5Aclose(id_member); break;
    case H5I_GENPROP_LST: H5Pclose(id_member); break;
    default: break;
  }
  id_member = -1;
}

template <> hid_t nativeType<float>() { return H5T_NATIVE_FLOAT; }
template <> hid_t nativeType<double>() { return H5T_NATIVE_DOUBLE; }
template <> hid_t nativeType<std::int8_t>() { return H5T_NATIVE_INT8; }
template <> hid_t nativeType<std::int16_t>() { return H5T_NATIVE_INT16; }
template <> hid_t nativeType<std::int32_t>() { return H5T_NATIVE_INT32; }
template <> hid_t nativeType<std::int64_t>() { return H5T_NATIVE_INT64; }
template <> hid_t nativeType<std::uint8_t>() { return H5T_NATIVE_UINT8; }
template <> hid_t nativeType<std::uint16_t>() { return H5T_NATIVE_UINT16; }
template <> hid_t nativeType<std::uint32_t>() { return H5T_NATIVE_UINT32; }
template <> hid_t nativeType<std::uint64_t>() { return H5T_NATIVE_UINT64; }

namespace {
Hid mpioAccess(MPI_Comm comm) {
  Hid fapl(PLM_CHECK_H5(H5Pcreate(H5P_FILE_ACCESS)));
  PLM_CHECK_H5(H5Pset_fapl_mpio(fapl, comm, MPI_INFO_NULL));
  return fapl;
}

Hid transferList(bool independent) {
  Hid dxpl(PLM_CHECK_H5(H5Pcreate(H5P_DATASET_XFER)));
  PLM_CHECK_H5(H5Pset_dxpl_mpio(dxpl, independent ? H5FD_MPIO_INDEPENDENT : H5FD_MPIO_COLLECTIVE));
  return dxpl;
}

// Selects rows [start, start+count) of `dataset` and the matching memory space.
std::pair<Hid, Hid> rowSelection(hid_t dataset, std::int64_t start, std::int64_t count) {
  Hid file_space(PLM_CHECK_H5(H5Dget_space(dataset)));
  int rank = PLM_CHECK_H5(H5Sget_simple_extent_ndims(file_space));
  std::vector<hsize_t> dims(rank);
  H5Sget_simple_extent_dims(file_space, dims.data(), nullptr);
  if (rank == 0 || start < 0 || count < 0 || hsize_t(start + count) > dims[0])
    throw Error("HDF5 row selection [" + std::to_string(start) + ", " +
                std::to_string(start + count) + ") is outside the dataset's " +
                (rank ? std::to_string(dims[0]) : "0") + " rows");
  std::vector<hsize_t> offset(rank, 0), extent(dims);
  offset[0] = hsize_t(start);
  extent[0] = hsize_t(count);
  if (count == 0) {
    PLM_CHECK_H5(H5Sselect_none(file_space));
  } else {
    PLM_CHECK_H5(H5Sselect_hyperslab(file_space, H5S_SELECT_SET, offset.data(), nullptr,
                                     extent.data(), nullptr));
  }
  std::vector<hsize_t> memory_dims(extent);
  if (count == 0) memory_dims[0] = 1;
  Hid memory_space(PLM_CHECK_H5(H5Screate_simple(rank, memory_dims.data(), nullptr)));
  if (count == 0) PLM_CHECK_H5(H5Sselect_none(memory_space));
  return {std::move(file_space), std::move(memory_space)};
}

Hid stringType(size_t length) {
  Hid type(PLM_CHECK_H5(H5Tcopy(H5T_C_S1)));
  PLM_CHECK_H5(H5Tset_size(type, std::max<size_t>(length, 1)));
  PLM_CHECK_H5(H5Tset_strpad(type, H5T_STR_NULLPAD));
  return type;
}
}  // namespace

void checkCreatable(const std::string& path) {
  const std::size_t slash = path.find_last_of('/');
  const std::string dir = slash == std::string::npos ? "."
                          : slash == 0               ? "/"
                                                     : path.substr(0, slash);
  struct stat info;
  if (stat(dir.c_str(), &info) != 0 || !S_ISDIR(info.st_mode))
    throw Error("cannot create `" + path + "`: the directory `" + dir +
                "` does not exist; create it or write somewhere else");
  if (access(dir.c_str(), W_OK | X_OK) != 0)
    throw Error("cannot create `" + path + "`: the directory `" + dir +
                "` is not writable by this user; write somewhere else");
}

Hid createFile(const std::string& path, MPI_Comm comm) {
  checkCreatable(path);
  Hid fapl = mpioAccess(comm);
  hid_t file = H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, fapl);
  if (file < 0)
    throw Error("cannot create HDF5 file `" + path + "`: " + detail::hdf5ErrorStack() +
                ". Check that the directory exists and is writable.");
  return Hid(file);
}

Hid openFile(const std::string& path, MPI_Comm comm, bool writable) {
  struct stat info;
  if (stat(path.c_str(), &info) != 0)
    throw Error("file `" + path + "` does not exist (" + std::strerror(errno) + ")");
#if H5_VERSION_GE(1, 12, 0)
  const htri_t readable = H5Fis_accessible(path.c_str(), H5P_DEFAULT);
#else
  const htri_t readable =
      H5Fis_hdf5(path.c_str());  // HDF5 1.10 (Debian 12) has no H5Fis_accessible
#endif
  if (readable <= 0) {
    H5Eclear2(H5E_DEFAULT);
    throw Error("`" + path + "` is not a readable HDF5 file (truncated or not HDF5?)");
  }
  Hid fapl = mpioAccess(comm);
  hid_t file = H5Fopen(path.c_str(), writable ? H5F_ACC_RDWR : H5F_ACC_RDONLY, fapl);
  if (file < 0) throw Error("cannot open HDF5 file `" + path + "`: " + detail::hdf5ErrorStack());
  return Hid(file);
}

Hid openFileSerial(const std::string& path) {
  struct stat info;
  if (stat(path.c_str(), &info) != 0)
    throw Error("file `" + path + "` does not exist (" + std::strerror(errno) + ")");
  hid_t file = H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  if (file < 0)
    throw Error("`" + path + "` is not a readable HDF5 file: " + detail::hdf5ErrorStack());
  return Hid(file);
}

std::vector<std::string> groupMembers(hid_t group) {
  H5G_info_t info;
  PLM_CHECK_H5(H5Gget_info(group, &info));
  std::vector<std::string> names;
  for (hsize_t i = 0; i < info.nlinks; ++i) {
    ssize_t length = PLM_CHECK_H5(
        H5Lget_name_by_idx(group, ".", H5_INDEX_NAME, H5_ITER_INC, i, nullptr, 0, H5P_DEFAULT));
    std::string name(std::size_t(length) + 1, '\0');
    PLM_CHECK_H5(H5Lget_name_by_idx(group, ".", H5_INDEX_NAME, H5_ITER_INC, i, name.data(),
                                    name.size(), H5P_DEFAULT));
    name.resize(std::size_t(length));
    names.push_back(name);
  }
  return names;
}

bool exists(hid_t location, const std::string& path) {
  // Check each component so that a missing parent does not raise an HDF5 error.
  size_t pos = 0;
  while (true) {
    size_t next = path.find('/', pos);
    std::string prefix = path.substr(0, next);
    if (!prefix.empty() && H5Lexists(location, prefix.c_str(), H5P_DEFAULT) <= 0) return false;
    if (next == std::string::npos) return true;
    pos = next + 1;
  }
}

Hid createGroup(hid_t location, const std::string& path) {
  Hid lcpl(PLM_CHECK_H5(H5Pcreate(H5P_LINK_CREATE)));
  PLM_CHECK_H5(H5Pset_create_intermediate_group(lcpl, 1));
  return Hid(PLM_CHECK_H5(H5Gcreate2(location, path.c_str(), lcpl, H5P_DEFAULT, H5P_DEFAULT)));
}

template <class T> Hid createDataset(hid_t location, const std::string& path,
                                     const std::vector<std::int64_t>& shape,
                                     const std::vector<std::int64_t>& chunk) {
  std::vector<hsize_t> dims(shape.begin(), shape.end());
  Hid space(PLM_CHECK_H5(H5Screate_simple(int(dims.size()), dims.data(), nullptr)));
  Hid lcpl(PLM_CHECK_H5(H5Pcreate(H5P_LINK_CREATE)));
  PLM_CHECK_H5(H5Pset_create_intermediate_group(lcpl, 1));
  Hid dcpl(PLM_CHECK_H5(H5Pcreate(H5P_DATASET_CREATE)));
  if (!chunk.empty()) {
    std::vector<hsize_t> chunk_dims(chunk.begin(), chunk.end());
    PLM_CHECK_H5(H5Pset_chunk(dcpl, int(chunk_dims.size()), chunk_dims.data()));
  }
  PLM_CHECK_H5(H5Pset_fill_time(dcpl, H5D_FILL_TIME_NEVER));
  return Hid(PLM_CHECK_H5(
      H5Dcreate2(location, path.c_str(), nativeType<T>(), space, lcpl, dcpl, H5P_DEFAULT)));
}

Hid openDataset(hid_t location, const std::string& path) {
  if (!exists(location, path)) throw Error("HDF5 dataset `" + path + "` is missing");
  return Hid(PLM_CHECK_H5(H5Dopen2(location, path.c_str(), H5P_DEFAULT)));
}

std::vector<std::int64_t> datasetShape(hid_t dataset) {
  Hid space(PLM_CHECK_H5(H5Dget_space(dataset)));
  int rank = PLM_CHECK_H5(H5Sget_simple_extent_ndims(space));
  std::vector<hsize_t> dims(rank);
  H5Sget_simple_extent_dims(space, dims.data(), nullptr);
  return std::vector<std::int64_t>(dims.begin(), dims.end());
}

template <class T> void writeRows(hid_t dataset, std::int64_t start, std::int64_t count,
                                  const T* data, bool independent) {
  auto [file_space, memory_space] = rowSelection(dataset, start, count);
  Hid dxpl = transferList(independent);
  T dummy{};
  PLM_CHECK_H5(
      H5Dwrite(dataset, nativeType<T>(), memory_space, file_space, dxpl, count ? data : &dummy));
}

template <class T>
void readRows(hid_t dataset, std::int64_t start, std::int64_t count, T* data, bool independent) {
  auto [file_space, memory_space] = rowSelection(dataset, start, count);
  Hid dxpl = transferList(independent);
  T dummy{};
  PLM_CHECK_H5(
      H5Dread(dataset, nativeType<T>(), memory_space, file_space, dxpl, count ? data : &dummy));
}

#define PLM_H5_INSTANTIATE(T)                                                                \
  template Hid createDataset<T>(hid_t, const std::string&, const std::vector<std::int64_t>&, \
                                const std::vector<std::int64_t>&);                           \
  template void writeRows<T>(hid_t, std::int64_t, std::int64_t, const T*, bool);             \
  template void readRows<T>(hid_t, std::int64_t, std::int64_t, T*, bool);
PLM_H5_INSTANTIATE(float)
PLM_H5_INSTANTIATE(double)
PLM_H5_INSTANTIATE(std::int8_t)
PLM_H5_INSTANTIATE(std::int16_t)
PLM_H5_INSTANTIATE(std::int32_t)
PLM_H5_INSTANTIATE(std::int64_t)
PLM_H5_INSTANTIATE(std::uint8_t)
PLM_H5_INSTANTIATE(std::uint16_t)
PLM_H5_INSTANTIATE(std::uint32_t)
PLM_H5_INSTANTIATE(std::uint64_t)
#undef PLM_H5_INSTANTIATE

namespace {
template <class T> void writeArrayAttribute(hid_t location, const std::string& name, hid_t type,
                                            const T* data, size_t n) {
  if (H5Aexists(location, name.c_str()) > 0) PLM_CHECK_H5(H5Adelete(location, name.c_str()));
  hsize_t dims = n;
  Hid space(n == 0 ? PLM_CHECK_H5(H5Screate(H5S_NULL))
                   : PLM_CHECK_H5(H5Screate_simple(1, &dims, nullptr)));
  Hid attribute(
      PLM_CHECK_H5(H5Acreate2(location, name.c_str(), type, space, H5P_DEFAULT, H5P_DEFAULT)));
  if (n) PLM_CHECK_H5(H5Awrite(attribute, type, data));
}

template <class T>
void writeScalarAttribute(hid_t location, const std::string& name, hid_t type, const T& value) {
  if (H5Aexists(location, name.c_str()) > 0) PLM_CHECK_H5(H5Adelete(location, name.c_str()));
  Hid space(PLM_CHECK_H5(H5Screate(H5S_SCALAR)));
  Hid attribute(
      PLM_CHECK_H5(H5Acreate2(location, name.c_str(), type, space, H5P_DEFAULT, H5P_DEFAULT)));
  PLM_CHECK_H5(H5Awrite(attribute, type, &value));
}

Hid openAttribute(hid_t location, const std::string& name) {
  if (H5Aexists(location, name.c_str()) <= 0)
    throw Error("HDF5 attribute `" + name + "` is missing");
  return Hid(PLM_CHECK_H5(H5Aopen(location, name.c_str(), H5P_DEFAULT)));
}

hssize_t attributeLength(hid_t attribute) {
  Hid space(PLM_CHECK_H5(H5Aget_space(attribute)));
  if (H5Sget_simple_extent_type(space) == H5S_NULL) return 0;
  return PLM_CHECK_H5(H5Sget_simple_extent_npoints(space));
}
}  // namespace

void writeAttribute(hid_t location, const std::string& name, const std::string& value) {
  Hid type = stringType(value.size());
  if (H5Aexists(location, name.c_str()) > 0) PLM_CHECK_H5(H5Adelete(location, name.c_str()));
  Hid space(PLM_CHECK_H5(H5Screate(H5S_SCALAR)));
  Hid attribute(
      PLM_CHECK_H5(H5Acreate2(location, name.c_str(), type, space, H5P_DEFAULT, H5P_DEFAULT)));
  std::string padded = value.empty() ? std::string(1, '\0') : value;
  PLM_CHECK_H5(H5Awrite(attribute, type, padded.data()));
}
void writeAttribute(hid_t location, const std::string& name, std::int64_t value) {
  writeScalarAttribute(location, name, H5T_NATIVE_INT64, value);
}
void writeAttribute(hid_t location, const std::string& name, double value) {
  writeScalarAttribute(location, name, H5T_NATIVE_DOUBLE, value);
}
void writeAttribute(hid_t location, const std::string& name,
                    const std::vector<std::int64_t>& value) {
  writeArrayAttribute(location, name, H5T_NATIVE_INT64, value.data(), value.size());
}
void writeAttribute(hid_t location, const std::string& name, const std::vector<double>& value) {
  writeArrayAttribute(location, name, H5T_NATIVE_DOUBLE, value.data(), value.size());
}
void writeAttribute(hid_t location, const std::string& name,
                    const std::vector<std::string>& value) {
  size_t width = 1;
  for (const auto& v : value) width = std::max(width, v.size());
  std::vector<char> packed(width * value.size(), '\0');
  for (size_t i = 0; i < value.size(); ++i)
    std::memcpy(packed.data() + i * width, value[i].data(), value[i].size());
  Hid type = stringType(width);
  writeArrayAttribute(location, name, type, packed.data(), value.size());
}

bool hasAttribute(hid_t location, const std::string& name) {
  return H5Aexists(location, name.c_str()) > 0;
}

std::string readStringAttribute(hid_t location, const std::string& name) {
  Hid attribute = openAttribute(location, name);
  Hid type(PLM_CHECK_H5(H5Aget_type(attribute)));
  if (H5Tget_class(type) != H5T_STRING)
    throw Error("HDF5 attribute `" + name + "` is not a string");
  if (H5Tis_variable_str(type) > 0) {
    char* text = nullptr;
    Hid memory_type(PLM_CHECK_H5(H5Tcopy(H5T_C_S1)));
    PLM_CHECK_H5(H5Tset_size(memory_type, H5T_VARIABLE));
    // h5py writes UTF-8 variable-length strings: the memory type must carry the same set.
    PLM_CHECK_H5(H5Tset_cset(memory_type, H5Tget_cset(type)));
    PLM_CHECK_H5(H5Aread(attribute, memory_type, &text));
    std::string out = text ? text : "";
    H5free_memory(text);
    return out;
  }
  size_t size = H5Tget_size(type);
  std::string buffer(size, '\0');
  PLM_CHECK_H5(H5Aread(attribute, type, buffer.data()));
  return std::string(buffer.c_str());
}

std::int64_t readIntAttribute(hid_t location, const std::string& name) {
  Hid attribute = openAttribute(location, name);
  std::int64_t value = 0;
  PLM_CHECK_H5(H5Aread(attribute, H5T_NATIVE_INT64, &value));
  return value;
}

double readDoubleAttribute(hid_t location, const std::string& name) {
  Hid attribute = openAttribute(location, name);
  double value = 0;
  PLM_CHECK_H5(H5Aread(attribute, H5T_NATIVE_DOUBLE, &value));
  return value;
}

std::vector<std::int64_t> readIntArrayAttribute(hid_t location, const std::string& name) {
  Hid attribute = openAttribute(location, name);
  std::vector<std::int64_t> out(attributeLength(attribute));
  if (!out.empty()) PLM_CHECK_H5(H5Aread(attribute, H5T_NATIVE_INT64, out.data()));
  return out;
}

std::vector<double> readDoubleArrayAttribute(hid_t location, const std::string& name) {
  Hid attribute = openAttribute(location, name);
  std::vector<double> out(attributeLength(attribute));
  if (!out.empty()) PLM_CHECK_H5(H5Aread(attribute, H5T_NATIVE_DOUBLE, out.data()));
  return out;
}

std::vector<std::string> readStringArrayAttribute(hid_t location, const std::string& name) {
  Hid attribute = openAttribute(location, name);
  Hid type(PLM_CHECK_H5(H5Aget_type(attribute)));
  hssize_t n = attributeLength(attribute);
  std::vector<std::string> out;
  if (n == 0) return out;
  if (H5Tis_variable_str(type) > 0) {
    std::vector<char*> texts(n, nullptr);
    Hid memory_type(PLM_CHECK_H5(H5Tcopy(H5T_C_S1)));
    PLM_CHECK_H5(H5Tset_size(memory_type, H5T_VARIABLE));
    PLM_CHECK_H5(H5Tset_cset(memory_type, H5Tget_cset(type)));
    PLM_CHECK_H5(H5Aread(attribute, memory_type, texts.data()));
    for (char* t : texts) {
      out.emplace_back(t ? t : "");
      H5free_memory(t);
    }
    return out;
  }
  size_t width = H5Tget_size(type);
  std::vector<char> buffer(width * n + 1, '\0');
  PLM_CHECK_H5(H5Aread(attribute, type, buffer.data()));
  for (hssize_t i = 0; i < n; ++i) {
    const char* begin = buffer.data() + i * width;
    out.emplace_back(begin, strnlen(begin, width));
  }
  return out;
}

void writeStrings(hid_t location, const std::string& path, MPI_Comm comm, std::int64_t global_count,
                  std::int64_t start, const std::vector<std::string>& rows) {
  std::int64_t local_width = 1, width = 1;
  for (const auto& r : rows)
    local_width = std::max<std::int64_t>(local_width, std::int64_t(r.size()));
  PLM_CHECK_MPI(MPI_Allreduce(&local_width, &width, 1, MPI_INT64_T, MPI_MAX, comm));
  Hid type = stringType(size_t(width));
  hsize_t dims = hsize_t(global_count);
  Hid space(PLM_CHECK_H5(H5Screate_simple(1, &dims, nullptr)));
  Hid lcpl(PLM_CHECK_H5(H5Pcreate(H5P_LINK_CREATE)));
  PLM_CHECK_H5(H5Pset_create_intermediate_group(lcpl, 1));
  Hid dataset(PLM_CHECK_H5(
      H5Dcreate2(location, path.c_str(), type, space, lcpl, H5P_DEFAULT, H5P_DEFAULT)));
  std::vector<char> packed(size_t(width) * std::max<size_t>(rows.size(), 1), '\0');
  for (size_t i = 0; i < rows.size(); ++i)
    std::memcpy(packed.data() + i * width, rows[i].data(), rows[i].size());
  auto [file_space, memory_space] = rowSelection(dataset, start, std::int64_t(rows.size()));
  Hid dxpl = transferList(false);
  PLM_CHECK_H5(H5Dwrite(dataset, type, memory_space, file_space, dxpl, packed.data()));
}

std::vector<std::string> readStrings(hid_t location, const std::string& path, std::int64_t start,
                                     std::int64_t count) {
  Hid dataset = openDataset(location, path);
  Hid type(PLM_CHECK_H5(H5Dget_type(dataset)));
  if (H5Tget_class(type) != H5T_STRING)
    throw Error("HDF5 dataset `" + path + "` does not hold strings");
  if (H5Tis_variable_str(type) > 0)
    throw Error("HDF5 dataset `" + path +
                "` holds variable-length strings; plm writes fixed-length ones");
  size_t width = H5Tget_size(type);
  std::vector<char> buffer(width * std::max<std::int64_t>(count, 1), '\0');
  auto [file_space, memory_space] = rowSelection(dataset, start, count);
  PLM_CHECK_H5(H5Dread(dataset, type, memory_space, file_space, H5P_DEFAULT, buffer.data()));
  std::vector<std::string> out;
  out.reserve(count);
  for (std::int64_t i = 0; i < count; ++i) {
    const char* begin = buffer.data() + i * width;
    out.emplace_back(begin, strnlen(begin, width));
  }
  return out;
}

}  // namespace plm::io::h5
