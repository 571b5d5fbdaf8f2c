// The trainer tests' shared fixtures: a temporary directory every rank agrees on, and a dataset
// of proteins with learnable statistics (a skewed residue distribution and a repeated motif),
// so a tiny model, or a few adapters, have something to learn in a few dozen steps.
#pragma once

#include "dist/runtime.hpp"
#include "io/dataset.hpp"

#include <mpi.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

namespace plm::test {

/// A fresh directory under the system's temporary folder, `<prefix>XXXXXX`; rank 0 creates it
/// (empty name if it cannot).
inline std::string sharedTempDir(const char* prefix) {
  char name[256] = "";
  if (plm::dist::worldRank() == 0) {
    std::snprintf(name, sizeof name, "%s/%sXXXXXX",
                  std::filesystem::temp_directory_path().string().c_str(), prefix);
    if (!mkdtemp(name)) name[0] = '\0';
  }
  MPI_Bcast(name, sizeof name, MPI_CHAR, 0, MPI_COMM_WORLD);
  return name;
}

/// `count` proteins of 20-90 residues (motif on positions i % 20 < 7) written by rank 0 to `path`.
inline void writeMotifProteins(const std::string& path, int count, std::uint64_t seed) {
  if (plm::dist::worldRank() == 0) {
    std::mt19937_64 gen(seed);
    std::discrete_distribution<int> residue(
        {30, 20, 12, 9, 7, 5, 4, 3, 2, 2, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1});
    std::uniform_int_distribution<int> length(20, 90);
    const std::vector<std::uint8_t> motif = {4, 9, 13, 7, 4, 17, 21};
    plm::io::SequenceShard shard;
    for (int s = 0; s < count; ++s) {
      const int n = length(gen);
      for (int i = 0; i < n; ++i)
        shard.tokens.push_back(i % 20 < 7 ? motif[i % 20]
                                          : static_cast<std::uint8_t>(4 + residue(gen)));
      shard.lengths.push_back(n);
      shard.ids.push_back("seq" + std::to_string(s));
    }
    plm::io::DatasetMetadata meta;
    meta.split = "test";
    meta.split_rule = "generated";
    plm::io::writeDataset(path, MPI_COMM_SELF, shard, meta);
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

}  // namespace plm::test
