// The HDF5 helpers at 1, 2 and 4 ranks: collective row writes from uneven (and empty) shares
// read back whole and in parts, every attribute kind, fixed-length string datasets, groups,
// and the messages for files that are missing or not HDF5.
#include "io/hdf5.hpp"

#include "core/error.hpp"

#include <gtest/gtest.h>
#include <mpi.h>

#include <unistd.h>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <numeric>
#include <string>
#include <vector>

using namespace plm;
namespace h5 = plm::io::h5;

namespace {

int rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}
int world() {
  int w = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &w);
  return w;
}

std::string sharedPath(const std::string& name) {
  char buffer[256] = {0};
  if (rank() == 0)
    std::snprintf(buffer, sizeof buffer, "/tmp/plm-test-hdf5-%d-%s", int(getpid()), name.c_str());
  MPI_Bcast(buffer, sizeof buffer, MPI_CHAR, 0, MPI_COMM_WORLD);
  return buffer;
}

// Rank r holds rows_of(r) rows; rank 1 holds none, so an empty share takes part too.
std::int64_t rowsOf(int r) { return r == 1 ? 0 : r + 2; }
std::int64_t startOf(int r) {
  std::int64_t s = 0;
  for (int q = 0; q < r; ++q) s += rowsOf(q);
  return s;
}
double valueAt(std::int64_t row, int column) { return 1000.0 * double(row) + column + 0.25; }

}  // namespace

TEST(Hdf5, RowsWrittenCollectivelyFromUnevenSharesReadBackExactly) {
  const std::string path = sharedPath("rows.h5");
  const std::int64_t total = startOf(world());
  const std::int64_t mine = rowsOf(rank()), start = startOf(rank());
  {
    h5::Hid file = h5::createFile(path, MPI_COMM_WORLD);
    std::vector<double> matrix(static_cast<size_t>(mine) * 3);
    std::vector<std::int64_t> ints(static_cast<size_t>(mine));
    std::vector<std::uint8_t> bytes(static_cast<size_t>(mine));
    for (std::int64_t i = 0; i < mine; ++i) {
      for (int c = 0; c < 3; ++c) matrix[size_t(i * 3 + c)] = valueAt(start + i, c);
      ints[size_t(i)] = -7 * (start + i);
      bytes[size_t(i)] = std::uint8_t((start + i) % 251);
    }
    h5::Hid m = h5::createDataset<double>(file, "group/matrix", {total, 3});
    h5::writeRows<double>(m, start, mine, matrix.data());
    h5::Hid v = h5::createDataset<std::int64_t>(file, "ints", {total}, {2});  // chunked
    h5::writeRows<std::int64_t>(v, start, mine, ints.data());
    h5::Hid b = h5::createDataset<std::uint8_t>(file, "bytes", {total});
    h5::writeRows<std::uint8_t>(b, start, mine, bytes.data(), /*independent=*/true);
  }
  h5::Hid file = h5::openFile(path, MPI_COMM_WORLD);
  EXPECT_TRUE(h5::exists(file, "group/matrix"));
  EXPECT_FALSE(h5::exists(file, "group/other"));
  EXPECT_FALSE(h5::exists(file, "missing/matrix"));
  h5::Hid m = h5::openDataset(file, "group/matrix");
  EXPECT_EQ(h5::datasetShape(m), (std::vector<std::int64_t>{total, 3}));
  std::vector<double> all(static_cast<size_t>(total) * 3);
  h5::readRows<double>(m, 0, total, all.data());
  for (std::int64_t i = 0; i < total; ++i)
    for (int c = 0; c < 3; ++c) EXPECT_EQ(all[size_t(i * 3 + c)], valueAt(i, c));
  // A part, different on every rank (collective with unequal selections).
  const std::int64_t first = rank() % total, count = std::min<std::int64_t>(2, total - first);
  std::vector<std::int64_t> part(static_cast<size_t>(count));
  h5::readRows<std::int64_t>(h5::openDataset(file, "ints"), first, count, part.data());
  for (std::int64_t i = 0; i < count; ++i) EXPECT_EQ(part[size_t(i)], -7 * (first + i));
  std::vector<std::uint8_t> bytes(static_cast<size_t>(total));
  h5::readRows<std::uint8_t>(h5::openDataset(file, "bytes"), 0, total, bytes.data(), true);
  for (std::int64_t i = 0; i < total; ++i) EXPECT_EQ(bytes[size_t(i)], std::uint8_t(i % 251));
  EXPECT_THROW(h5::readRows<double>(m, total - 1, 2, all.data()), Error);  // past the end
  file = h5::Hid();
  MPI_Barrier(MPI_COMM_WORLD);
  if (rank() == 0) std::remove(path.c_str());
}

TEST(Hdf5, EveryAttributeKindRoundTrips) {
  const std::string path = sharedPath("attributes.h5");
  {
    h5::Hid file = h5::createFile(path, MPI_COMM_WORLD);
    h5::writeAttribute(file, "text", std::string("plm-protein-dataset"));
    h5::writeAttribute(file, "empty_text", std::string());
    h5::writeAttribute(file, "int", std::int64_t(-42));
    h5::writeAttribute(file, "real", 0.1);
    h5::writeAttribute(file, "ints", std::vector<std::int64_t>{1, 2, 3000000000000});
    h5::writeAttribute(file, "no_ints", std::vector<std::int64_t>{});
    h5::writeAttribute(file, "reals", std::vector<double>{0.9, 0.98});
    h5::writeAttribute(file, "strings", std::vector<std::string>{"<cls>", "", "L", "a longer one"});
    h5::writeAttribute(file, "int", std::int64_t(7));  // overwrite
    h5::Hid group = h5::createGroup(file, "a/b/c");
    h5::writeAttribute(group, "where", std::string("nested"));
  }
  h5::Hid file = h5::openFile(path, MPI_COMM_WORLD);
  EXPECT_EQ(h5::readStringAttribute(file, "text"), "plm-protein-dataset");
  EXPECT_EQ(h5::readStringAttribute(file, "empty_text"), "");
  EXPECT_EQ(h5::readIntAttribute(file, "int"), 7);
  EXPECT_EQ(h5::readDoubleAttribute(file, "real"), 0.1);
  EXPECT_EQ(h5::readIntArrayAttribute(file, "ints"),
            (std::vector<std::int64_t>{1, 2, 3000000000000}));
  EXPECT_TRUE(h5::readIntArrayAttribute(file, "no_ints").empty());
  EXPECT_EQ(h5::readDoubleArrayAttribute(file, "reals"), (std::vector<double>{0.9, 0.98}));
  EXPECT_EQ(h5::readStringArrayAttribute(file, "strings"),
            (std::vector<std::string>{"<cls>", "", "L", "a longer one"}));
  EXPECT_TRUE(h5::hasAttribute(file, "int"));
  EXPECT_FALSE(h5::hasAttribute(file, "nope"));
  EXPECT_THROW(h5::readIntAttribute(file, "nope"), Error);
  EXPECT_EQ(h5::readStringAttribute(h5::Hid(H5Gopen2(file, "a/b/c", H5P_DEFAULT)), "where"),
            "nested");
  file = h5::Hid();
  MPI_Barrier(MPI_COMM_WORLD);
  if (rank() == 0) std::remove(path.c_str());
}

TEST(Hdf5, StringRowsFromEveryRankRoundTrip) {
  const std::string path = sharedPath("strings.h5");
  auto text = [](std::int64_t row) {
    return row % 3 == 0 ? std::string()
                        : "id_" + std::string(size_t(row % 7), 'x') + std::to_string(row);
  };
  const std::int64_t total = startOf(world()), mine = rowsOf(rank()), start = startOf(rank());
  {
    h5::Hid file = h5::createFile(path, MPI_COMM_WORLD);
    std::vector<std::string> rows;
    for (std::int64_t i = 0; i < mine; ++i) rows.push_back(text(start + i));
    h5::writeStrings(file, "ids", MPI_COMM_WORLD, total, start, rows);
  }
  h5::Hid file = h5::openFile(path, MPI_COMM_WORLD);
  auto all = h5::readStrings(file, "ids", 0, total);
  ASSERT_EQ(std::int64_t(all.size()), total);
  for (std::int64_t i = 0; i < total; ++i) EXPECT_EQ(all[size_t(i)], text(i));
  auto tail = h5::readStrings(file, "ids", total - 1, 1);
  EXPECT_EQ(tail, std::vector<std::string>{text(total - 1)});
  EXPECT_TRUE(h5::readStrings(file, "ids", 0, 0).empty());
  file = h5::Hid();
  MPI_Barrier(MPI_COMM_WORLD);
  if (rank() == 0) std::remove(path.c_str());
}

TEST(Hdf5, MissingAndForeignFilesGetAMessage) {
  const std::string missing = sharedPath("missing.h5"), foreign = sharedPath("foreign.txt");
  if (rank() == 0) std::ofstream(foreign) << ">not hdf5\nACDE\n";
  MPI_Barrier(MPI_COMM_WORLD);
  try {
    h5::openFile(missing, MPI_COMM_WORLD);
    ADD_FAILURE() << "opened a missing file";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("does not exist"), std::string::npos) << e.what();
  }
  try {
    h5::openFile(foreign, MPI_COMM_WORLD);
    ADD_FAILURE() << "opened a text file as HDF5";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("not a readable HDF5 file"), std::string::npos)
        << e.what();
  }
  MPI_Barrier(MPI_COMM_WORLD);
  if (rank() == 0) std::remove(foreign.c_str());
}

// h5py writes str attributes as variable-length UTF-8; plm must read those (a user's own
// dataset or checkpoint tooling), not only its own fixed-length ASCII.
TEST(Hdf5, VariableLengthUtf8AttributesAsH5pyWritesThem) {
  const std::string path = sharedPath("vlen.h5");
  const std::string text = "prot\xc3\xa9ine";  // "protéine" in UTF-8
  const char* texts[2] = {"<cls>", "\xce\xb1-helix"};
  if (rank() == 0) {
    h5::Hid file(H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT));
    h5::Hid type(H5Tcopy(H5T_C_S1));
    H5Tset_size(type, H5T_VARIABLE);
    H5Tset_cset(type, H5T_CSET_UTF8);
    h5::Hid scalar(H5Screate(H5S_SCALAR));
    h5::Hid attribute(H5Acreate2(file, "name", type, scalar, H5P_DEFAULT, H5P_DEFAULT));
    const char* pointer = text.c_str();
    ASSERT_GE(H5Awrite(attribute, type, &pointer), 0);
    hsize_t two = 2;
    h5::Hid list_space(H5Screate_simple(1, &two, nullptr));
    h5::Hid list(H5Acreate2(file, "names", type, list_space, H5P_DEFAULT, H5P_DEFAULT));
    ASSERT_GE(H5Awrite(list, type, texts), 0);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  h5::Hid file = h5::openFile(path, MPI_COMM_WORLD);
  EXPECT_EQ(h5::readStringAttribute(file, "name"), text);
  EXPECT_EQ(h5::readStringArrayAttribute(file, "names"),
            (std::vector<std::string>{texts[0], texts[1]}));
  file = h5::Hid();
  MPI_Barrier(MPI_COMM_WORLD);
  if (rank() == 0) std::remove(path.c_str());
}
