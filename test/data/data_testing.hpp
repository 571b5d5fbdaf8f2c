// Helpers for the data tests: a temporary directory shared by all ranks, FASTA writers, and
// random protein sequences. Rank 0 writes files; every helper that touches the file system ends
// with a barrier so every rank sees the result.
#pragma once

#include "data/batch.hpp"

#include <gtest/gtest.h>
#include <mpi.h>
#include <zlib.h>

#include <unistd.h>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <random>
#include <string>
#include <vector>

namespace plm::testing {

inline int rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}
inline int world() {
  int w = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &w);
  return w;
}

/// A fresh directory, the same path on every rank, removed (shallowly) at scope exit.
class TempDir {
 public:
  TempDir() {
    if (rank() == 0) {
      char pattern[] = "/tmp/plm-test-data-XXXXXX";
      if (!mkdtemp(pattern)) std::abort();
      path_member = pattern;
    }
    int size = int(path_member.size());
    MPI_Bcast(&size, 1, MPI_INT, 0, MPI_COMM_WORLD);
    path_member.resize(size_t(size));
    MPI_Bcast(path_member.data(), size, MPI_CHAR, 0, MPI_COMM_WORLD);
  }
  ~TempDir() {
    MPI_Barrier(MPI_COMM_WORLD);
    if (rank() == 0) std::system(("rm -rf '" + path_member + "'").c_str());
  }
  const std::string& path() const { return path_member; }
  std::string operator/(const std::string& name) const { return path_member + "/" + name; }

 private:
  std::string path_member;
};

/// Rank 0 writes `text` to `path` (gzip-compressed when `gzip`); then every rank continues.
inline void writeFile(const std::string& path, const std::string& text, bool gzip = false) {
  if (rank() == 0) {
    if (gzip) {
      gzFile out = gzopen(path.c_str(), "wb6");
      gzwrite(out, text.data(), unsigned(text.size()));
      gzclose(out);
    } else {
      std::ofstream(path, std::ios::binary) << text;
    }
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

inline std::string readFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

inline bool fileExists(const std::string& path) { return access(path.c_str(), F_OK) == 0; }

/// A protein of `length` residues over the 25 letters, standard amino acids mostly.
inline std::string randomProtein(std::mt19937_64& rng, int length) {
  const std::string standard = "LAGVSERTIDPKQNFYMHWC", rare = "XBUZO";
  std::string s(size_t(length), 'A');
  for (auto& c : s)
    c = rng() % 50 == 0 ? rare[rng() % rare.size()] : standard[rng() % standard.size()];
  return s;
}

struct Record {
  std::string id, residues;  // residues in upper case, as the dataset holds them
};

/// FASTA text for `records` in a random real-world style per record: wrapped at 60/80 or not,
/// CRLF or LF, blank lines, lowercase runs, a final '*', a description after the id.
/// `lines` (optional) receives the 1-based line of each header.
inline std::string fastaText(const std::vector<Record>& records, std::mt19937_64& rng,
                             std::vector<int>* lines = nullptr) {
  std::string text;
  int line = 1;
  for (const auto& r : records) {
    const char* eol = rng() % 4 == 0 ? "\r\n" : "\n";
    if (lines) lines->push_back(line);
    text += ">" + r.id + (rng() % 2 ? " some description OS=Homo sapiens" : "") + eol;
    ++line;
    std::string body = r.residues;
    for (auto& c : body)
      if (rng() % 7 == 0) c = char(std::tolower(c));
    if (rng() % 3 == 0) body += '*';
    size_t width = std::vector<size_t>{60, 80, 1000000}[rng() % 3];
    for (size_t k = 0; k < body.size(); k += width) {
      text += body.substr(k, width) + eol;
      ++line;
    }
    if (rng() % 5 == 0) {
      text += eol;
      ++line;
    }
  }
  return text;
}

inline std::vector<Record> randomRecords(std::mt19937_64& rng, int n, const std::string& prefix,
                                         int max_length = 700) {
  std::vector<Record> out;
  for (int i = 0; i < n; ++i)
    out.push_back({prefix + std::to_string(i),
                   randomProtein(rng, 1 + int(rng() % std::uint64_t(max_length)))});
  return out;
}

inline std::string lettersOf(const std::vector<std::uint8_t>& ids) {
  std::string s;
  for (auto id : ids) s += data::vocab::letters[id - data::vocab::first_residue];
  return s;
}

}  // namespace plm::testing
