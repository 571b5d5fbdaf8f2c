// Checkpoint save and load bandwidth for a preset's full training state (fp32 master weights and
// both Adam moments), next to the raw bandwidth of the same file system (each rank writes and
// fsyncs its share of the same bytes with plain write(2)): doc/performance.md records it.
//
//   mpiexec -n R bench_ckpt [preset] [repeats] [dir]
//   bench_ckpt esm2_35m 3 /tmp/plm_bench_ckpt
//
// The trainer is built as `plm train` builds it (a 64-sequence dataset is generated in dir), its
// moments are filled with nonzero values, and ckpt::save / ckpt::load run `repeats` times.
#include "ckpt/checkpoint.hpp"
#include "core/log.hpp"
#include "deck/deck.hpp"
#include "dist/runtime.hpp"
#include "io/dataset.hpp"

#include <fcntl.h>
#include <unistd.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <random>
#include <sstream>
#include <string>
#include <vector>

namespace {

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Each rank writes `bytes / world` bytes to its own file and fsyncs it; returns the wall time.
double rawWrite(const std::string& dir, std::int64_t bytes, int rank, int world) {
  const std::int64_t share = bytes / world;
  std::vector<char> block(8 << 20, 1);
  const std::string path = dir + "/raw." + std::to_string(rank);
  MPI_Barrier(MPI_COMM_WORLD);
  const double t0 = now();
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  for (std::int64_t done = 0; done < share;) {
    const std::int64_t n = std::min<std::int64_t>(std::int64_t(block.size()), share - done);
    if (::write(fd, block.data(), size_t(n)) != n) std::abort();
    done += n;
  }
  ::fsync(fd);
  ::close(fd);
  MPI_Barrier(MPI_COMM_WORLD);
  const double t = now() - t0;
  std::filesystem::remove(path);
  return t;
}

}  // namespace

int main(int argc, char** argv) {
  plm::dist::Runtime runtime(argc, argv);
  const std::string preset = argc > 1 ? argv[1] : "esm2_8m";
  const int repeats = argc > 2 ? std::atoi(argv[2]) : 3;
  const std::string dir = argc > 3 ? argv[3] : "/tmp/plm_bench_ckpt";
  const int rank = plm::dist::worldRank(), world = plm::dist::worldSize();
  plm::log::configure(rank, false);
  try {
    if (rank == 0) {
      std::filesystem::remove_all(dir);
      std::filesystem::create_directories(dir);
      std::mt19937_64 gen(1);
      std::uniform_int_distribution<int> length(50, 500), residue(4, 23);
      plm::io::SequenceShard shard;
      for (int i = 0; i < 64; ++i) {
        const int n = length(gen);
        for (int k = 0; k < n; ++k) shard.tokens.push_back(std::uint8_t(residue(gen)));
        shard.lengths.push_back(n);
        shard.ids.push_back("s" + std::to_string(i));
      }
      plm::io::DatasetMetadata meta;
      meta.split = "train";
      plm::io::writeDataset(dir + "/train.h5", MPI_COMM_SELF, shard, meta);
    }
    MPI_Barrier(MPI_COMM_WORLD);
    std::ostringstream y;
    y << "model:\n  preset: " << preset << "\ndata:\n  train: " << dir
      << "/train.h5\n  valid: \"\"\n"
      << "train:\n  run_dir: " << dir << "/run\ncheckpoint:\n  dir: " << dir
      << "/ckpt\n  resume: none\n";
    auto deck = plm::deck::resolve(*plm::deck::readYamlString(y.str(), "bench deck"));
    plm::train::Trainer trainer(deck);
    Kokkos::deep_copy(trainer.optimizer().expAvg(), 1.0e-3f);
    Kokkos::deep_copy(trainer.optimizer().expAvgSq(), 1.0e-6f);

    std::int64_t bytes = 0;
    for (int r = 0; r < repeats; ++r) {
      const auto s = plm::ckpt::save(trainer, dir + "/ckpt");
      bytes = s.bytes;
      const double l0 = now();
      plm::ckpt::load(trainer, s.path);
      const double load_s = now() - l0;
      if (rank == 0)
        std::printf(
            "save %d: %.1f MB in %.3f s = %.0f MB/s (host copy %.3f s, write %.3f s, flush+rename "
            "%.3f s); "
            "load %.3f s = %.0f MB/s\n",
            r + 1, double(s.bytes) / 1e6, s.seconds, s.megabytesPerSecond(), s.copy_seconds,
            s.write_seconds, s.sync_seconds, load_s, double(s.bytes) / load_s / 1e6);
      std::fflush(stdout);
    }
    for (int r = 0; r < repeats; ++r) {
      const double t = rawWrite(dir, bytes, rank, world);
      if (rank == 0)
        std::printf("raw write+fsync of the same bytes (%d file(s)): %.3f s = %.0f MB/s\n", world,
                    t, double(bytes) / t / 1e6);
    }
    if (rank == 0) std::filesystem::remove_all(dir);
  } catch (const plm::Error& e) {
    plm::fatalOne(e.what());
  }
  return 0;
}
