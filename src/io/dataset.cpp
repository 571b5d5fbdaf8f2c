#include "io/dataset.hpp"

#include "core/error.hpp"
#include "core/fault.hpp"
#include "core/vocab.hpp"
#include "dist/process_groups.hpp"
#include "io/hdf5.hpp"

#include <unistd.h>
#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <numeric>

namespace plm::io {

const std::vector<std::string>& vocabularyTokens() {
  static const std::vector<std::string> tokens = [] {
    std::vector<std::string> t = {"<cls>", "<pad>", "<eos>", "<unk>"};
    for (const char* c = vocab::letters; *c; ++c) t.emplace_back(1, *c);
    t.insert(t.end(), {".", "-", "<null_1>", "<mask>"});
    return t;
  }();
  return tokens;
}

void checkResidueIds(const std::string& path, std::int64_t sequence, const std::uint8_t* tokens,
                     std::int64_t n) {
  for (std::int64_t k = 0; k < n; ++k) {
    if (tokens[k] < vocab::first_residue || tokens[k] > vocab::last_residue)
      throw Error("dataset `" + path + "`: sequence " + std::to_string(sequence) +
                  " holds token id " + std::to_string(int(tokens[k])) + " at residue " +
                  std::to_string(k) + ", outside the residue ids " +
                  std::to_string(vocab::first_residue) + ".." +
                  std::to_string(vocab::last_residue) +
                  "; the file is corrupt or was not written by plm prep: rerun plm prep");
  }
}

namespace {

// Collective writes are split into rounds of at most this many rows per rank so that no MPI-IO
// call moves 2 GiB or more (a limit of several MPI-IO implementations): 8-byte rows make 1 GiB.
constexpr std::int64_t max_rows_per_write = std::int64_t(1) << 27;

template <class T> void writeInRounds(hid_t dataset, MPI_Comm comm, std::int64_t start,
                                      std::int64_t count, const T* data,
                                      std::int64_t fail_after_bytes = -1) {
  std::int64_t rounds = (count + max_rows_per_write - 1) / max_rows_per_write, max_rounds = 0;
  PLM_CHECK_MPI(MPI_Allreduce(&rounds, &max_rounds, 1, MPI_INT64_T, MPI_MAX, comm));
  // An empty dataset has no storage to write to (HDF5 refuses even an empty collective write).
  std::int64_t written = 0;
  for (std::int64_t round = 0; round < max_rounds; ++round) {
    std::int64_t n = std::min(max_rows_per_write, count - written);
    h5::writeRows<T>(dataset, start + written, n, data + written);
    written += n;
    if (fail_after_bytes >= 0) {
      std::int64_t global = 0, local = written * std::int64_t(sizeof(T));
      PLM_CHECK_MPI(MPI_Allreduce(&local, &global, 1, MPI_INT64_T, MPI_SUM, comm));
      if (global >= fail_after_bytes)
        throw Error("PLM_TEST_FAIL_AFTER_BYTES: dataset write stopped after " +
                        std::to_string(global) + " token bytes (test hook)",
                    true);
    }
  }
}

std::string describe(const std::string& path) { return "dataset `" + path + "`"; }

// Probing a file that may not be HDF5 is expected to fail: keep HDF5 from printing its error
// stack to stderr meanwhile (the plm::Error says what is wrong).
class QuietHdf5 {
 public:
  QuietHdf5() {
    H5Eget_auto2(H5E_DEFAULT, &function_member, &data_member);
    H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
  }
  ~QuietHdf5() { H5Eset_auto2(H5E_DEFAULT, function_member, data_member); }

 private:
  H5E_auto2_t function_member = nullptr;
  void* data_member = nullptr;
};

}  // namespace

void writeDataset(const std::string& path, MPI_Comm comm, const SequenceShard& local,
                  const DatasetMetadata& metadata) {
  const std::int64_t local_sequences = std::int64_t(local.lengths.size());
  const std::int64_t local_residues = std::int64_t(local.tokens.size());
  PLM_REQUIRE(std::int64_t(local.ids.size()) == local_sequences,
              "writeDataset: one id per sequence");
  PLM_REQUIRE(std::accumulate(local.lengths.begin(), local.lengths.end(), std::int64_t(0)) ==
                  local_residues,
              "writeDataset: lengths must add up to the tokens");
  const int rank = dist::commRank(comm), world = dist::commSize(comm);

  std::int64_t counts[2] = {local_sequences, local_residues}, starts[2] = {0, 0},
               totals[2] = {0, 0};
  PLM_CHECK_MPI(MPI_Exscan(counts, starts, 2, MPI_INT64_T, MPI_SUM, comm));
  if (rank == 0) starts[0] = starts[1] = 0;  // MPI_Exscan leaves rank 0's result undefined
  PLM_CHECK_MPI(MPI_Allreduce(counts, totals, 2, MPI_INT64_T, MPI_SUM, comm));
  const std::int64_t n = totals[0], residues = totals[1];

  h5::Hid file = h5::createFile(path, comm);
  {
    h5::Hid tokens = h5::createDataset<std::uint8_t>(file, "tokens", {residues});
    writeInRounds<std::uint8_t>(tokens, comm, starts[1], local_residues, local.tokens.data(),
                                fault::datasetFailAfterBytes());
  }
  {
    // Rank r writes offsets[start_r, start_r + n_r); the last rank adds offsets[n] = R.
    std::vector<std::int64_t> offsets(local_sequences + 1);
    offsets[0] = starts[1];
    for (std::int64_t i = 0; i < local_sequences; ++i)
      offsets[i + 1] = offsets[i] + local.lengths[i];
    std::int64_t rows = local_sequences + (rank == world - 1 ? 1 : 0);
    h5::Hid dataset = h5::createDataset<std::int64_t>(file, "offsets", {n + 1});
    writeInRounds<std::int64_t>(dataset, comm, starts[0], rows, offsets.data());
  }
  // Labels are all-or-none over the ranks: a rank with no sequences has none to give.
  int has[2] = {!local.labels.empty(), !local.residue_labels.empty()}, any[2] = {0, 0};
  PLM_CHECK_MPI(MPI_Allreduce(has, any, 2, MPI_INT, MPI_MAX, comm));
  if (any[0]) {
    PLM_REQUIRE(local.labels.size() == local.lengths.size(),
                "writeDataset: one label per sequence on every rank");
    h5::Hid dataset = h5::createDataset<double>(file, "labels", {n});
    writeInRounds<double>(dataset, comm, starts[0], local_sequences, local.labels.data());
  }
  if (any[1]) {
    PLM_REQUIRE(std::int64_t(local.residue_labels.size()) == local_residues,
                "writeDataset: one residue label per residue on every rank");
    h5::Hid dataset = h5::createDataset<std::int8_t>(file, "residue_labels", {residues});
    writeInRounds<std::int8_t>(dataset, comm, starts[1], local_residues,
                               local.residue_labels.data());
  }
  if (n > 0) {
    h5::writeStrings(file, "ids", comm, n, starts[0], local.ids);
  } else {  // nothing to write; the (empty) dataset still exists
    h5::Hid type(PLM_CHECK_H5(H5Tcopy(H5T_C_S1)));
    PLM_CHECK_H5(H5Tset_size(type, 1));
    hsize_t dims = 0;
    h5::Hid space(PLM_CHECK_H5(H5Screate_simple(1, &dims, nullptr)));
    h5::Hid ids(
        PLM_CHECK_H5(H5Dcreate2(file, "ids", type, space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT)));
  }

  std::vector<std::string> source_paths;
  std::vector<std::int64_t> source_sizes, source_crcs;
  for (const auto& s : metadata.sources) {
    source_paths.push_back(s.path);
    source_sizes.push_back(s.size);
    source_crcs.push_back(std::int64_t(s.crc32));
  }
  h5::writeAttribute(file, "vocabulary", vocabularyTokens());
  h5::writeAttribute(file, "num_sequences", n);
  h5::writeAttribute(file, "num_residues", residues);
  h5::writeAttribute(file, "split", metadata.split);
  h5::writeAttribute(file, "split_rule", metadata.split_rule);
  h5::writeAttribute(file, "valid_fraction", metadata.valid_fraction);
  h5::writeAttribute(file, "duplicates_removed", metadata.duplicates_removed);
  h5::writeAttribute(file, "skipped_records", metadata.skipped_records);
  h5::writeAttribute(file, "source_files", source_paths);
  h5::writeAttribute(file, "source_sizes", source_sizes);
  h5::writeAttribute(file, "source_crc32", source_crcs);
  h5::writeAttribute(file, "command_line", metadata.command_line);
  h5::writeAttribute(file, "plm_version", metadata.plm_version);
  h5::writeAttribute(file, "created_utc", metadata.created_utc);
  h5::writeAttribute(file, "format_version", dataset_format_version);
  h5::writeAttribute(file, "format", std::string(dataset_format));  // last: marks the file complete
  PLM_CHECK_H5(H5Fflush(file, H5F_SCOPE_GLOBAL));
}

struct DatasetReader::Impl {
  std::string path;
  h5::Hid file, tokens;
  DatasetMetadata metadata;
  std::vector<std::int64_t> offsets;  // (n+1)
  std::int64_t tokens_address = -1;
};

DatasetReader::DatasetReader(const std::string& path) : impl_member(std::make_unique<Impl>()) {
  Impl& d = *impl_member;
  d.path = path;
  const std::string where = describe(path);
  {
    QuietHdf5 quiet;
    if (access(path.c_str(), F_OK) != 0)
      throw Error(where + " does not exist (" + std::strerror(errno) +
                  "); run plm prep to make it");
    if (H5Fis_hdf5(path.c_str()) <= 0) {
      H5Eclear2(H5E_DEFAULT);
      throw Error(where + " is not a readable HDF5 file (truncated, or not HDF5?); rerun plm prep");
    }
    hid_t file = H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
    if (file < 0) {
      H5Eclear2(H5E_DEFAULT);
      throw Error(where + " is not a readable HDF5 file (truncated or damaged); rerun plm prep");
    }
    d.file = h5::Hid(file);
  }
  if (!h5::hasAttribute(d.file, "format"))
    throw Error(where +
                " has no `format` attribute: it is not a plm dataset, or a plm prep that "
                "wrote it was interrupted; rerun plm prep");
  auto& m = d.metadata;
  m.format = h5::readStringAttribute(d.file, "format");
  if (m.format != dataset_format)
    throw Error(where + " has format `" + m.format + "`, expected `" + dataset_format +
                "`; rerun plm prep");
  m.format_version = h5::readIntAttribute(d.file, "format_version");
  if (m.format_version != dataset_format_version)
    throw Error(where + " has format version " + std::to_string(m.format_version) +
                "; this plm reads version " + std::to_string(dataset_format_version) +
                ": rerun plm prep with this plm");
  if (h5::readStringArrayAttribute(d.file, "vocabulary") != vocabularyTokens())
    throw Error(where + " uses a different token vocabulary than ESM-2's; rerun plm prep");
  m.num_sequences = h5::readIntAttribute(d.file, "num_sequences");
  m.num_residues = h5::readIntAttribute(d.file, "num_residues");
  auto optionalString = [&](const char* name) {
    return h5::hasAttribute(d.file, name) ? h5::readStringAttribute(d.file, name) : std::string();
  };
  auto optionalInt = [&](const char* name) {
    return h5::hasAttribute(d.file, name) ? h5::readIntAttribute(d.file, name) : std::int64_t(0);
  };
  m.split = optionalString("split");
  m.split_rule = optionalString("split_rule");
  m.command_line = optionalString("command_line");
  m.plm_version = optionalString("plm_version");
  m.created_utc = optionalString("created_utc");
  m.duplicates_removed = optionalInt("duplicates_removed");
  m.skipped_records = optionalInt("skipped_records");
  if (h5::hasAttribute(d.file, "valid_fraction"))
    m.valid_fraction = h5::readDoubleAttribute(d.file, "valid_fraction");
  if (h5::hasAttribute(d.file, "source_files")) {
    auto paths = h5::readStringArrayAttribute(d.file, "source_files");
    auto sizes = h5::readIntArrayAttribute(d.file, "source_sizes");
    auto crcs = h5::readIntArrayAttribute(d.file, "source_crc32");
    for (size_t i = 0; i < paths.size(); ++i)
      m.sources.push_back({paths[i], i < sizes.size() ? sizes[i] : 0,
                           i < crcs.size() ? std::uint32_t(crcs[i]) : 0u});
  }

  const std::int64_t n = m.num_sequences, residues = m.num_residues;
  if (n < 0 || residues < 0)
    throw Error(where + " has negative sequence or residue counts; rerun plm prep");
  d.tokens = h5::openDataset(d.file, "tokens");
  h5::Hid offsets = h5::openDataset(d.file, "offsets");
  auto tokens_shape = h5::datasetShape(d.tokens);
  auto offsets_shape = h5::datasetShape(offsets);
  if (tokens_shape != std::vector<std::int64_t>{residues})
    throw Error(where + ": /tokens does not have num_residues = " + std::to_string(residues) +
                " elements; rerun plm prep");
  if (offsets_shape != std::vector<std::int64_t>{n + 1})
    throw Error(where + ": /offsets does not have num_sequences + 1 = " + std::to_string(n + 1) +
                " elements; rerun plm prep");
  {
    h5::Hid type(PLM_CHECK_H5(H5Dget_type(d.tokens)));
    if (H5Tget_class(type) != H5T_INTEGER || H5Tget_size(type) != 1)
      throw Error(where + ": /tokens is not an 8-bit integer dataset; rerun plm prep");
  }
  if (h5::exists(d.file, "ids") &&
      h5::datasetShape(h5::openDataset(d.file, "ids")) != std::vector<std::int64_t>{n})
    throw Error(where + ": /ids does not have num_sequences = " + std::to_string(n) +
                " elements; rerun plm prep");

  d.offsets.resize(n + 1);
  h5::readRows<std::int64_t>(offsets, 0, n + 1, d.offsets.data(), true);
  if (d.offsets[0] != 0)
    throw Error(where + ": /offsets[0] is " + std::to_string(d.offsets[0]) +
                ", not 0; rerun plm prep");
  for (std::int64_t i = 0; i < n; ++i) {
    if (d.offsets[i + 1] < d.offsets[i])
      throw Error(where + ": /offsets decreases at sequence " + std::to_string(i) + " (" +
                  std::to_string(d.offsets[i]) + " then " + std::to_string(d.offsets[i + 1]) +
                  "); the file is corrupt: rerun plm prep");
  }
  if (d.offsets[n] != residues)
    throw Error(where + ": /offsets ends at " + std::to_string(d.offsets[n]) +
                " but /tokens holds " + std::to_string(residues) +
                " residues; the file is corrupt: rerun plm prep");

  h5::Hid plist(PLM_CHECK_H5(H5Dget_create_plist(d.tokens)));
  if (H5Pget_layout(plist) == H5D_CONTIGUOUS && residues > 0) {
    haddr_t address = H5Dget_offset(d.tokens);
    if (address != HADDR_UNDEF) d.tokens_address = std::int64_t(address);
  }
  H5Eclear2(H5E_DEFAULT);
}

DatasetReader::~DatasetReader() = default;
DatasetReader::DatasetReader(DatasetReader&&) noexcept = default;
DatasetReader& DatasetReader::operator=(DatasetReader&&) noexcept = default;

const std::string& DatasetReader::path() const { return impl_member->path; }
std::int64_t DatasetReader::numSequences() const { return impl_member->metadata.num_sequences; }
std::int64_t DatasetReader::numResidues() const { return impl_member->metadata.num_residues; }
const std::vector<std::int64_t>& DatasetReader::offsets() const { return impl_member->offsets; }
const DatasetMetadata& DatasetReader::metadata() const { return impl_member->metadata; }
std::int64_t DatasetReader::tokensFileAddress() const { return impl_member->tokens_address; }

std::vector<std::uint8_t> DatasetReader::readTokens(std::int64_t first, std::int64_t count) const {
  const Impl& d = *impl_member;
  if (first < 0 || count < 0 || first + count > numSequences())
    throw Error(describe(d.path) + ": sequences [" + std::to_string(first) + ", " +
                std::to_string(first + count) + ") requested, the dataset has " +
                std::to_string(numSequences()));
  const std::int64_t begin = d.offsets[first], end = d.offsets[first + count];
  std::vector<std::uint8_t> out(end - begin);
  h5::readRows<std::uint8_t>(d.tokens, begin, end - begin, out.data(), true);
  for (std::int64_t i = first; i < first + count; ++i)
    checkResidueIds(d.path, i, out.data() + (d.offsets[i] - begin),
                    d.offsets[i + 1] - d.offsets[i]);
  return out;
}

std::vector<std::string> DatasetReader::readIds(std::int64_t first, std::int64_t count) const {
  return h5::readStrings(impl_member->file, "ids", first, count);
}

bool DatasetReader::hasLabels() const { return h5::exists(impl_member->file, "labels"); }

bool DatasetReader::hasResidueLabels() const {
  return h5::exists(impl_member->file, "residue_labels");
}

std::vector<double> DatasetReader::readLabels(std::int64_t first, std::int64_t count) const {
  const Impl& d = *impl_member;
  if (!hasLabels())
    throw Error(describe(d.path) + " has no per-sequence labels; make it with plm prep --labels");
  PLM_REQUIRE(first >= 0 && count >= 0 && first + count <= numSequences(),
              "readLabels: sequence range out of bounds");
  std::vector<double> out(count);
  h5::Hid dataset(PLM_CHECK_H5(H5Dopen2(d.file, "labels", H5P_DEFAULT)));
  h5::readRows<double>(dataset, first, count, out.data(), true);
  return out;
}

std::vector<std::int8_t> DatasetReader::readResidueLabels(std::int64_t first,
                                                          std::int64_t count) const {
  const Impl& d = *impl_member;
  if (!hasResidueLabels())
    throw Error(describe(d.path) +
                " has no per-residue labels; make it with plm prep --residue-labels");
  PLM_REQUIRE(first >= 0 && count >= 0 && first + count <= numSequences(),
              "readResidueLabels: sequence range out of bounds");
  const std::int64_t begin = d.offsets[first], end = d.offsets[first + count];
  std::vector<std::int8_t> out(end - begin);
  h5::Hid dataset(PLM_CHECK_H5(H5Dopen2(d.file, "residue_labels", H5P_DEFAULT)));
  h5::readRows<std::int8_t>(dataset, begin, end - begin, out.data(), true);
  return out;
}

std::string DatasetReader::sequenceString(std::int64_t i) const {
  auto tokens = readTokens(i, 1);
  std::string out(tokens.size(), '?');
  for (size_t k = 0; k < tokens.size(); ++k)
    out[k] = vocab::letters[tokens[k] - vocab::first_residue];
  return out;
}

void DatasetReader::validateTokens() const {
  const auto& offsets = impl_member->offsets;
  const std::int64_t n = numSequences(), block_residues = std::int64_t(1) << 26;
  std::int64_t first = 0;
  while (first < n) {
    std::int64_t last = first + 1;
    while (last < n && offsets[last + 1] - offsets[first] <= block_residues) ++last;
    readTokens(first, last - first);
    first = last;
  }
}

}  // namespace plm::io
