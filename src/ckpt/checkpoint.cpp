// Checkpoint files: atomic collective save, header, checked load, listing and pruning.
#include "ckpt/checkpoint.hpp"

#include "ckpt/detail/agree.hpp"
#include "ckpt/detail/rows.hpp"
#include "ckpt/detail/snapshot.hpp"
#include "core/log.hpp"
#include "deck/deck.hpp"
#include "dist/process_groups.hpp"
#include "io/hdf5.hpp"
#include "io/model_file.hpp"
#include "plm/plm_config.hpp"

#include <zlib.h>
#include <Kokkos_Core.hpp>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <future>
#include <type_traits>

namespace plm::ckpt {

static_assert(std::is_same_v<master_t, float>,
              "checkpoints store master weights and moments as fp32 (io::writeTensorGroup)");

namespace fs = std::filesystem;
namespace h5 = io::h5;

namespace {

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

using dist::commRank;
using dist::commSize;
std::string utcNow() {
  std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buffer[32];
  std::strftime(buffer, sizeof buffer, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buffer;
}

std::string broadcastString(std::string value, MPI_Comm comm) {
  long long length = static_cast<long long>(value.size());
  PLM_CHECK_MPI(MPI_Bcast(&length, 1, MPI_LONG_LONG, 0, comm));
  value.resize(static_cast<std::size_t>(length));
  if (length > 0) PLM_CHECK_MPI(MPI_Bcast(value.data(), int(length), MPI_CHAR, 0, comm));
  return value;
}

// The fault hook behind the crash tests: PLM_CKPT_FAIL_AT=<step>:<phase> makes every rank
// _exit(86) at that point of the save of that step, as a kill would (nothing flushed, no
// destructors).  Phases: model (after /model), optimizer (after the first /optimizer state group),
// flush (file complete and flushed, not yet renamed).
void failPoint(std::int64_t step, const char* phase) {
  static const char* spec = std::getenv("PLM_CKPT_FAIL_AT");
  if (!spec || !*spec) return;
  const std::string want = std::to_string(step) + ":" + phase;
  if (want != spec) return;
  std::fprintf(stderr, "plm: PLM_CKPT_FAIL_AT=%s: exiting in the middle of a checkpoint save\n",
               spec);
  std::fflush(stderr);
  ::_exit(86);
}

// CRC-32 of this rank's rows (io::rowRange) of every tensor of a flat buffer, with their byte
// counts: (crc, length) pairs, one per tensor.  Touches only host memory and zlib, so it may
// run on a helper thread while HDF5 writes the same (read-only) buffer.
template <class T>
std::vector<std::uint64_t> localChecksums(const std::vector<model::TensorInfo>& tensors,
                                          const T* values, int rank, int world) {
  std::vector<std::uint64_t> local(2 * tensors.size());
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const auto& t = tensors[i];
    const std::int64_t rows = t.shape.empty() ? 1 : t.shape[0];
    const std::int64_t row_size = rows ? t.size / rows : 0;
    auto [first, last] = io::rowRange(rows, rank, world);
    const auto* bytes = reinterpret_cast<const Bytef*>(values + t.offset + first * row_size);
    const std::uint64_t length = std::uint64_t((last - first) * row_size) * sizeof(T);
    local[2 * i] = crc32_z(crc32_z(0L, Z_NULL, 0), bytes, length);
    local[2 * i + 1] = length;
  }
  return local;
}

// Joins every rank's pieces in rank order (crc32_combine): the CRC-32 of each whole tensor,
// identical for any rank count.
std::vector<std::uint32_t> combineChecksums(const std::vector<std::uint64_t>& local,
                                            MPI_Comm comm) {
  const int world = commSize(comm);
  const std::size_t n = local.size() / 2;
  std::vector<std::uint64_t> all(local.size() * std::size_t(world));
  PLM_CHECK_MPI(MPI_Allgather(local.data(), int(2 * n), MPI_UINT64_T, all.data(), int(2 * n),
                              MPI_UINT64_T, comm));
  std::vector<std::uint32_t> out(n);
  for (std::size_t i = 0; i < n; ++i) {
    uLong crc = uLong(all[2 * i]);
    for (int r = 1; r < world; ++r) {
      const std::size_t at = 2 * n * std::size_t(r) + 2 * i;
      crc = crc32_combine64(crc, uLong(all[at]), z_off64_t(all[at + 1]));
    }
    out[i] = std::uint32_t(crc);
  }
  return out;
}

template <class T>
std::vector<std::uint32_t> checksums(const std::vector<model::TensorInfo>& tensors, const T* values,
                                     MPI_Comm comm) {
  return combineChecksums(localChecksums(tensors, values, commRank(comm), commSize(comm)), comm);
}

void writeChecksums(hid_t file, const std::string& group,
                    const std::vector<model::TensorInfo>& tensors,
                    const std::vector<std::uint32_t>& crcs) {
  h5::Hid g(PLM_CHECK_H5(H5Gopen2(file, group.c_str(), H5P_DEFAULT)));
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    h5::Hid dataset = h5::openDataset(g, tensors[i].name);
    h5::writeAttribute(dataset, "crc32", std::int64_t(crcs[i]));
  }
}

// io::writeTensorGroup for 8-bit codes: this rank's rows of every tensor, at full shape.
void writeGroup(hid_t file, MPI_Comm comm, const std::string& group,
                const std::vector<model::TensorInfo>& tensors, const std::uint8_t* values,
                bool independent) {
  const int rank = commRank(comm), world = commSize(comm);
  h5::Hid g = h5::exists(file, group)
                  ? h5::Hid(PLM_CHECK_H5(H5Gopen2(file, group.c_str(), H5P_DEFAULT)))
                  : h5::createGroup(file, group);
  for (const auto& t : tensors) {
    h5::Hid dataset = h5::createDataset<std::uint8_t>(g, t.name, t.shape);
    const std::int64_t rows = t.shape.empty() ? 1 : t.shape[0];
    const std::int64_t row_size = rows ? t.size / rows : 0;
    auto [first, last] = io::rowRange(rows, rank, world);
    if (independent && last == first) continue;
    h5::writeRows<std::uint8_t>(dataset, first, last - first, values + t.offset + first * row_size,
                                independent);
  }
}

// Reads `group` into `values` on every rank.  Each rank reads only its own rows (independent
// transfers, so the file is read once whatever the rank count), checks them against the stored
// CRC-32s (joined over ranks), and only then are the rows shared.  The group must hold exactly
// the model's tensors at their shapes.  Any failure is a CorruptCheckpoint on every rank.
template <class T> void readGroup(hid_t file, MPI_Comm comm, const std::string& group,
                                  const std::vector<model::TensorInfo>& tensors, T* values,
                                  const std::string& path) {
  const int rank = commRank(comm), world = commSize(comm);
  std::vector<std::int64_t> stored(tensors.size());
  detail::agree(comm, [&] {
    try {
      if (!h5::exists(file, group))
        throw CorruptCheckpoint("checkpoint `" + path + "` has no /" + group);
      h5::Hid g(PLM_CHECK_H5(H5Gopen2(file, group.c_str(), H5P_DEFAULT)));
      H5G_info_t info;
      PLM_CHECK_H5(H5Gget_info(g, &info));
      for (std::size_t i = 0; i < tensors.size(); ++i) {
        const auto& t = tensors[i];
        if (!h5::exists(g, t.name))
          throw CorruptCheckpoint("checkpoint `" + path + "` lacks /" + group + "/" + t.name);
        h5::Hid dataset = h5::openDataset(g, t.name);
        if (h5::datasetShape(dataset) != t.shape)
          throw CorruptCheckpoint("checkpoint `" + path + "`: /" + group + "/" + t.name +
                                  " does not have the shape its /model config implies");
        if (!h5::hasAttribute(dataset, "crc32"))
          throw CorruptCheckpoint(
              "checkpoint `" + path + "`: /" + group + "/" + t.name +
              " has no crc32 attribute (incomplete file or not written by plm)");
        stored[i] = h5::readIntAttribute(dataset, "crc32");
        const std::int64_t rows = t.shape.empty() ? 1 : t.shape[0];
        const std::int64_t row_size = rows ? t.size / rows : 0;
        auto [first, last] = io::rowRange(rows, rank, world);
        if (last > first)
          h5::readRows<T>(dataset, first, last - first, values + t.offset + first * row_size,
                          /*independent=*/true);
      }
      if (info.nlinks != tensors.size())
        throw CorruptCheckpoint("checkpoint `" + path + "`: /" + group + " holds " +
                                std::to_string(info.nlinks) + " entries, the model has " +
                                std::to_string(tensors.size()) + " tensors");
    } catch (const CorruptCheckpoint&) {
      throw;
    } catch (const std::exception& e) {
      throw CorruptCheckpoint("checkpoint `" + path + "` cannot be read: " + e.what());
    }
  });
  const auto crcs = checksums(tensors, values, comm);  // this rank's rows, joined over ranks
  for (std::size_t i = 0; i < tensors.size(); ++i)
    if (std::int64_t(crcs[i]) != stored[i])
      throw CorruptCheckpoint("checkpoint `" + path + "` is damaged: /" + group + "/" +
                                  tensors[i].name + " does not match its checksum (crc32 " +
                                  std::to_string(stored[i]) + " stored, " +
                                  std::to_string(crcs[i]) + " read)",
                              true);
  detail::shareRows(tensors, values, comm);
}

void fsyncPath(const std::string& path, bool directory) {
  const int fd = ::open(path.c_str(), (directory ? O_RDONLY | O_DIRECTORY : O_RDONLY) | O_CLOEXEC);
  PLM_CHECK_SYS(fd >= 0, ("open " + path).c_str());
  const int status = ::fsync(fd);
  const int saved = errno;
  ::close(fd);
  errno = saved;
  PLM_CHECK_SYS(status == 0, ("fsync " + path).c_str());
}

std::vector<std::string> removeFiles(const std::vector<std::string>& paths, const char* what) {
  std::vector<std::string> removed;
  for (const auto& p : paths) {
    std::error_code ec;
    if (fs::remove(p, ec)) {
      removed.push_back(p);
    } else if (ec) {
      log::warn("checkpoint: cannot remove %s %s: %s", what, p.c_str(), ec.message().c_str());
    }
  }
  return removed;
}

std::vector<std::string> broadcastList(std::vector<std::string> list, MPI_Comm comm) {
  std::string joined;
  for (const auto& s : list) joined += s + '\n';
  joined = broadcastString(joined, comm);
  list.clear();
  std::size_t at = 0;
  while (at < joined.size()) {
    const std::size_t end = joined.find('\n', at);
    list.push_back(joined.substr(at, end - at));
    at = end + 1;
  }
  return list;
}

}  // namespace

namespace {
template <class T> MPI_Datatype mpiType();
template <> MPI_Datatype mpiType<float>() { return MPI_FLOAT; }
template <> MPI_Datatype mpiType<std::uint8_t>() { return MPI_UINT8_T; }

template <class T> void shareRowsOf(const std::vector<model::TensorInfo>& tensors, T* values,
                                    MPI_Comm comm, std::int64_t batch_limit) {
  const int rank = commRank(comm), world = commSize(comm);
  if (world == 1) return;
  auto rowsOf = [&](const model::TensorInfo& t, int r) {
    const std::int64_t rows = t.shape.empty() ? 1 : t.shape[0];
    const std::int64_t row_size = rows ? t.size / rows : 0;
    auto [first, last] = io::rowRange(rows, r, world);
    return std::pair{first * row_size, (last - first) * row_size};  // (element offset, count)
  };
  std::size_t begin = 0;
  std::vector<T> send, receive;
  while (begin < tensors.size()) {
    std::size_t end = begin;
    std::int64_t total = 0;
    while (end < tensors.size() && (end == begin || total + tensors[end].size <= batch_limit))
      total += tensors[end++].size;
    std::vector<int> counts(world, 0), displacements(world, 0);
    for (int r = 0; r < world; ++r) {
      for (std::size_t i = begin; i < end; ++i) counts[r] += int(rowsOf(tensors[i], r).second);
      if (r > 0) displacements[r] = displacements[r - 1] + counts[r - 1];
    }
    send.resize(std::size_t(counts[rank]));
    std::size_t at = 0;
    for (std::size_t i = begin; i < end; ++i) {
      auto [offset, count] = rowsOf(tensors[i], rank);
      std::memcpy(send.data() + at, values + tensors[i].offset + offset,
                  std::size_t(count) * sizeof(T));
      at += std::size_t(count);
    }
    receive.resize(std::size_t(total));
    PLM_CHECK_MPI(MPI_Allgatherv(send.data(), counts[rank], mpiType<T>(), receive.data(),
                                 counts.data(), displacements.data(), mpiType<T>(), comm));
    for (int r = 0; r < world; ++r) {
      std::size_t from = std::size_t(displacements[r]);
      for (std::size_t i = begin; i < end; ++i) {
        auto [offset, count] = rowsOf(tensors[i], r);
        std::memcpy(values + tensors[i].offset + offset, receive.data() + from,
                    std::size_t(count) * sizeof(T));
        from += std::size_t(count);
      }
    }
    begin = end;
  }
}
}  // namespace

void detail::shareRows(const std::vector<model::TensorInfo>& tensors, float* values, MPI_Comm comm,
                       std::int64_t batch_limit) {
  shareRowsOf(tensors, values, comm, batch_limit);
}

void detail::shareRows(const std::vector<model::TensorInfo>& tensors, std::uint8_t* values,
                       MPI_Comm comm, std::int64_t batch_limit) {
  shareRowsOf(tensors, values, comm, batch_limit);
}

std::string fileName(std::int64_t step) {
  char buffer[40];
  std::snprintf(buffer, sizeof buffer, "step_%06lld.h5", static_cast<long long>(step));
  return buffer;
}

std::int64_t stepOfFileName(const std::string& name) {
  const std::string prefix = "step_", suffix = ".h5";
  if (name.size() < prefix.size() + 6 + suffix.size() ||
      name.compare(0, prefix.size(), prefix) != 0 ||
      name.compare(name.size() - suffix.size(), suffix.size(), suffix) != 0)
    return -1;
  const std::string digits =
      name.substr(prefix.size(), name.size() - prefix.size() - suffix.size());
  if (digits.size() > 18 ||
      !std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; }))
    return -1;
  return std::stoll(digits);
}

std::vector<Listed> listCheckpoints(const std::string& dir) {
  std::vector<Listed> out;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return out;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    if (!entry.is_regular_file(ec)) continue;
    const std::int64_t step = stepOfFileName(entry.path().filename().string());
    if (step >= 0) out.push_back({entry.path().string(), step});
  }
  std::sort(out.begin(), out.end(),
            [](const Listed& a, const Listed& b) { return a.step < b.step; });
  return out;
}

detail::Snapshot detail::takeSnapshot(train::Trainer& trainer, SnapshotBuffers* buffers) {
  Snapshot snap;
  auto& optimizer = trainer.optimizer();
  auto& model = trainer.model();
  auto& loader = trainer.trainLoader();
  snap.state = trainer.state();
  snap.config = model.config();
  snap.tensors = model.tensors();
  snap.optimizer_step = optimizer.stepCount();
  snap.optimizer_kind = train::optimizerName(optimizer.kind());
  snap.optimizer_attributes = optimizer.attributes();
  snap.micro_batches_per_step = loader.options().micro_batches_per_step;
  snap.dataset_path = loader.options().path;
  snap.dataset_sequences = loader.numSequences();
  snap.dataset_residues = loader.numResidues();
  snap.deck_yaml = deck::toYaml(trainer.deck());
  snap.scaling = detail::takeScaling(model);
  const double start = now();
  // With `buffers`: copies into the saver's pinned buffers (reused from save to save); without:
  // the host views of the optimizer's buffers (on the CPU the buffers themselves, no copy).
  auto pinned = [](auto& to, const auto& from, const std::string& label) {
    using V = std::decay_t<decltype(to)>;
    if (to.extent(0) != from.extent(0))
      to = V(Kokkos::view_alloc(Kokkos::WithoutInitializing, label), from.extent(0));
    Kokkos::deep_copy(to, from);
    return static_cast<const void*>(to.data());
  };
  if (buffers) {
    snap.master = static_cast<const float*>(
        pinned(buffers->master, optimizer.master(), "plm::ckpt::snapshot_master"));
  } else {
    snap.host_master = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), optimizer.master());
    snap.master = snap.host_master.data();
  }
  for (const auto& b : optimizer.state()) {
    detail::SnapshotState st;
    st.name = b.name;
    st.bytes = b.isBytes();
    st.table = b.table;
    const std::string label = "plm::ckpt::snapshot_" + b.name;
    if (buffers && st.bytes) {
      st.data = pinned(buffers->bytes[b.name], b.u8, label);
    } else if (buffers) {
      st.data = pinned(buffers->floats[b.name], b.f32, label);
    } else if (st.bytes) {
      st.host_u8 = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), b.u8);
      st.data = st.host_u8.data();
    } else {
      st.host_f32 = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), b.f32);
      st.data = st.host_f32.data();
    }
    snap.optimizer_state.push_back(std::move(st));
  }
  Kokkos::fence();
  snap.copy_seconds = now() - start;
  return snap;
}

SaveReport save(train::Trainer& trainer, const std::string& dir) {
  const double t0 = now();
  const detail::Snapshot snap = detail::takeSnapshot(trainer, nullptr);
  SaveReport report = detail::writeSnapshot(snap, dir, trainer.comm());
  report.seconds = now() - t0;
  return report;
}

SaveReport detail::writeSnapshot(const Snapshot& snap, const std::string& dir, MPI_Comm comm) {
  const int rank = commRank(comm), world = commSize(comm);
  const double t0 = now();
  detail::agree(comm, [&] {
    if (rank != 0) return;
    std::error_code ec;
    fs::create_directories(dir, ec);
    if (ec) throw Error("checkpoint.dir `" + dir + "` cannot be created: " + ec.message());
  });

  const train::TrainState& state = snap.state;
  SaveReport report;
  report.path = (fs::path(dir) / fileName(state.step)).string();
  const std::string temporary = report.path + ".tmp";
  const auto& tensors = snap.tensors;
  report.copy_seconds = snap.copy_seconds;
  const double t1 = now();

  const std::string created = broadcastString(rank == 0 ? utcNow() : std::string(), comm);
  // Independent data transfers: each rank's rows are one contiguous range of the file, so
  // collective two-phase I/O buys nothing, and its per-tensor synchronisation made 2-rank saves
  // 5x slower on the dev machine (doc/performance.md).
  constexpr bool independent_transfers = true;
  // The checksums of this rank's rows are computed on a helper thread while HDF5 writes.
  struct Group {
    std::string name;
    const std::vector<model::TensorInfo>* table;
    const void* data;
    bool bytes;
  };
  std::vector<Group> groups = {{"model", &tensors, snap.master, false}};
  for (const auto& st : snap.optimizer_state)
    groups.push_back({"optimizer/" + st.name, &st.table, st.data, st.bytes});
  auto crc_pending = std::async(std::launch::async, [&groups, rank, world] {
    std::vector<std::vector<std::uint64_t>> out;
    for (const auto& g : groups)
      out.push_back(
          g.bytes ? localChecksums(*g.table, static_cast<const std::uint8_t*>(g.data), rank, world)
                  : localChecksums(*g.table, static_cast<const float*>(g.data), rank, world));
    return out;
  });
  {
    h5::Hid file = h5::createFile(temporary, comm);
    io::writeConfigAttributes(file, snap.config);
    io::ModelAttributes extra;
    extra.strings["plm_version"] = PLM_VERSION_STRING;
    extra.strings["source"] = "plm train checkpoint";
    extra.integers["step"] = state.step;
    extra.integers["tokens_seen"] = state.tokens_seen;
    io::writeExtraAttributes(file, extra);

    io::writeTensorGroup(file, comm, "model", tensors, snap.master, independent_transfers);
    failPoint(state.step, "model");
    {
      h5::Hid g = h5::createGroup(file, "optimizer");
      h5::writeAttribute(g, "kind", snap.optimizer_kind);
      h5::writeAttribute(
          g, "name", snap.optimizer_kind == "adamw" ? std::string("AdamW") : snap.optimizer_kind);
      h5::writeAttribute(g, "step", snap.optimizer_step);
      std::string names;
      for (const auto& st : snap.optimizer_state) names += (names.empty() ? "" : ",") + st.name;
      h5::writeAttribute(g, "state", names);
      for (const auto& [key, value] : snap.optimizer_attributes) h5::writeAttribute(g, key, value);
    }
    for (std::size_t i = 1; i < groups.size(); ++i) {
      const Group& g = groups[i];
      if (g.bytes)
        writeGroup(file, comm, g.name, *g.table, static_cast<const std::uint8_t*>(g.data),
                   independent_transfers);
      else
        io::writeTensorGroup(file, comm, g.name, *g.table, static_cast<const float*>(g.data),
                             independent_transfers);
      if (i == 1) failPoint(state.step, "optimizer");
    }
    const auto local = crc_pending.get();
    for (std::size_t g = 0; g < groups.size(); ++g)
      writeChecksums(file, groups[g].name, *groups[g].table, combineChecksums(local[g], comm));
    detail::writeScaling(file, snap.scaling, comm);

    h5::Hid s = h5::createGroup(file, "state");
    h5::writeAttribute(s, "format_version", checkpoint_format_version);
    h5::writeAttribute(s, "step", state.step);
    h5::writeAttribute(s, "tokens_seen", state.tokens_seen);
    h5::writeAttribute(s, "cursor_epoch", state.cursor.epoch);
    h5::writeAttribute(s, "cursor_position", state.cursor.position);
    h5::writeAttribute(s, "init_seed", std::int64_t(state.init_seed));
    h5::writeAttribute(s, "data_seed", std::int64_t(state.data_seed));
    h5::writeAttribute(s, "world_size", std::int64_t(world));
    h5::writeAttribute(s, "micro_batches_per_step", snap.micro_batches_per_step);
    h5::writeAttribute(s, "dataset_path", snap.dataset_path);
    h5::writeAttribute(s, "dataset_sequences", snap.dataset_sequences);
    h5::writeAttribute(s, "dataset_residues", snap.dataset_residues);
    h5::writeAttribute(s, "deck", snap.deck_yaml);
    h5::writeAttribute(s, "plm_version", std::string(PLM_VERSION_STRING));
    h5::writeAttribute(s, "git_revision", std::string(PLM_GIT_REVISION));
    h5::writeAttribute(s, "created_utc", created);
    // Last: a file without it was cut short and is never loaded.
    h5::writeAttribute(s, "format", std::string(checkpoint_format));
    report.write_seconds = now() - t1;
    PLM_CHECK_H5(H5Fflush(file, H5F_SCOPE_GLOBAL));
    failPoint(state.step, "flush");
  }
  PLM_CHECK_MPI(MPI_Barrier(comm));  // every rank has closed the file
  std::int64_t bytes = 0;
  detail::agree(comm, [&] {
    if (rank != 0) return;
    fsyncPath(temporary, false);
    PLM_CHECK_SYS(std::rename(temporary.c_str(), report.path.c_str()) == 0,
                  ("rename " + temporary + " -> " + report.path).c_str());
    fsyncPath(dir, true);
    struct stat info;
    PLM_CHECK_SYS(::stat(report.path.c_str(), &info) == 0, ("stat " + report.path).c_str());
    bytes = info.st_size;
  });
  PLM_CHECK_MPI(MPI_Bcast(&bytes, 1, MPI_INT64_T, 0, comm));
  report.bytes = bytes;
  const double t2 = now();
  report.seconds = t2 - t0 + snap.copy_seconds;
  report.sync_seconds = t2 - t1 - report.write_seconds;
  return report;
}

std::vector<std::string> prune(const std::string& dir, int keep, MPI_Comm comm) {
  std::vector<std::string> removed;
  if (keep <= 0) return removed;
  if (commRank(comm) == 0) {
    auto listed = listCheckpoints(dir);
    std::vector<std::string> victims;
    for (std::size_t i = 0; i + std::size_t(keep) < listed.size(); ++i)
      victims.push_back(listed[i].path);
    removed = removeFiles(victims, "old checkpoint");
    if (!removed.empty()) fsyncPath(dir, true);
  }
  return broadcastList(removed, comm);
}

std::vector<std::string> removeTemporaries(const std::string& dir, MPI_Comm comm) {
  std::vector<std::string> removed;
  if (commRank(comm) == 0) {
    std::vector<std::string> victims;
    std::error_code ec;
    if (fs::is_directory(dir, ec))
      for (const auto& entry : fs::directory_iterator(dir, ec)) {
        const std::string name = entry.path().filename().string();
        const std::string suffix = ".tmp";
        if (name.size() > suffix.size() &&
            name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0 &&
            stepOfFileName(name.substr(0, name.size() - suffix.size())) >= 0)
          victims.push_back(entry.path().string());
      }
    removed = removeFiles(victims, "interrupted checkpoint");
  }
  return broadcastList(removed, comm);
}

namespace {
struct NewerFormat : Error {
  using Error::Error;
};
}  // namespace

Header readHeader(const std::string& path) {
  Header h;
  h.path = path;
  try {
    h5::Hid file = h5::openFileSerial(path);
    if (!h5::exists(file, "state"))
      throw CorruptCheckpoint("`" + path + "` is not a plm checkpoint (no /state group)");
    h5::Hid s(PLM_CHECK_H5(H5Gopen2(file, "state", H5P_DEFAULT)));
    if (!h5::hasAttribute(s, "format"))
      throw CorruptCheckpoint("checkpoint `" + path +
                              "` is incomplete (its save was interrupted: /state has no "
                              "`format` attribute)");
    const std::string format = h5::readStringAttribute(s, "format");
    if (format != checkpoint_format)
      throw CorruptCheckpoint("`" + path + "` is not a plm checkpoint (/state format is \"" +
                              format + "\")");
    h.format_version = h5::readIntAttribute(s, "format_version");
    if (h.format_version > checkpoint_format_version)
      throw NewerFormat("checkpoint `" + path + "` has format version " +
                        std::to_string(h.format_version) + ", newer than this plm understands (" +
                        std::to_string(checkpoint_format_version) +
                        "); resume it with a newer plm");
    h.config = io::readConfigAttributes(file, path);
    h.state.step = h5::readIntAttribute(s, "step");
    h.state.tokens_seen = h5::readIntAttribute(s, "tokens_seen");
    h.state.cursor.epoch = h5::readIntAttribute(s, "cursor_epoch");
    h.state.cursor.position = h5::readIntAttribute(s, "cursor_position");
    h.state.init_seed = std::uint64_t(h5::readIntAttribute(s, "init_seed"));
    h.state.data_seed = std::uint64_t(h5::readIntAttribute(s, "data_seed"));
    h.world_size = h5::readIntAttribute(s, "world_size");
    h.micro_batches_per_step = h5::readIntAttribute(s, "micro_batches_per_step");
    h.dataset_path = h5::readStringAttribute(s, "dataset_path");
    h.dataset_sequences = h5::readIntAttribute(s, "dataset_sequences");
    h.dataset_residues = h5::readIntAttribute(s, "dataset_residues");
    h.deck_yaml = h5::readStringAttribute(s, "deck");
    h.plm_version = h5::readStringAttribute(s, "plm_version");
    h.git_revision = h5::readStringAttribute(s, "git_revision");
    h.created_utc = h5::readStringAttribute(s, "created_utc");
    if (!h5::exists(file, "optimizer") || !h5::exists(file, "model"))
      throw CorruptCheckpoint("checkpoint `" + path + "` lacks /model or /optimizer");
    h5::Hid o(PLM_CHECK_H5(H5Gopen2(file, "optimizer", H5P_DEFAULT)));
    h.optimizer_step = h5::readIntAttribute(o, "step");
    // Files from before optimizer.name hold AdamW state and no `kind`.
    h.optimizer_kind =
        h5::hasAttribute(o, "kind") ? h5::readStringAttribute(o, "kind") : std::string("adamw");
  } catch (const CorruptCheckpoint&) {
    throw;
  } catch (const NewerFormat&) {
    throw;
  } catch (const std::exception& e) {
    throw CorruptCheckpoint("checkpoint `" + path +
                            "` is unreadable (truncated or damaged?): " + e.what());
  }
  return h;
}

Header load(train::Trainer& trainer, const std::string& path) {
  const MPI_Comm comm = trainer.comm();
  Header header;
  detail::agree(comm, [&] { header = readHeader(path); });

  DeckChanges changes;
  const auto reasons = incompatibilities(header, trainer, &changes);
  if (!reasons.empty()) {
    std::string message = "checkpoint `" + path + "` (step " + std::to_string(header.state.step) +
                          ") does not fit this run:";
    for (const auto& r : reasons) message += "\n  - " + r;
    message +=
        "\nRestore those settings (the checkpoint's deck is its /state `deck` attribute; "
        "validation/ckpt_ls.py --deck prints it), or start a new run with checkpoint.resume: none "
        "or another checkpoint.dir.";
    throw collectiveError(message);
  }

  auto& optimizer = trainer.optimizer();
  const auto& tensors = trainer.model().tensors();
  const std::size_t n = optimizer.master().extent(0);
  std::vector<float> master(n);
  const auto buffers = optimizer.state();
  std::vector<std::vector<float>> floats(buffers.size());
  std::vector<std::vector<std::uint8_t>> bytes(buffers.size());
  h5::Hid file;
  detail::agree(comm, [&] {
    try {
      file = h5::openFile(path, comm);
    } catch (const std::exception& e) {
      throw CorruptCheckpoint("checkpoint `" + path + "` cannot be opened: " + e.what());
    }
  });
  readGroup(file, comm, "model", tensors, master.data(), path);
  for (std::size_t i = 0; i < buffers.size(); ++i) {
    const auto& b = buffers[i];
    const std::string group = "optimizer/" + b.name;
    if (b.isBytes()) {
      bytes[i].assign(b.u8.extent(0), 0);
      readGroup(file, comm, group, b.table, bytes[i].data(), path);
    } else {
      floats[i].assign(b.f32.extent(0), 0.0f);
      readGroup(file, comm, group, b.table, floats[i].data(), path);
    }
  }
  detail::ScalingState scaling;
  detail::agree(comm, [&] { scaling = detail::readScaling(file, path); });
  file.reset();
  if (const std::string why = detail::scalingRefusal(scaling, trainer.model()); !why.empty())
    throw collectiveError("checkpoint `" + path + "` (step " + std::to_string(header.state.step) +
                          ") does not fit this run: " + why);

  // Everything checked: only now does the trainer change.
  auto put = [](const auto& target, const auto& values) {
    auto host = Kokkos::create_mirror_view(Kokkos::HostSpace(), target);
    std::memcpy(host.data(), values.data(), values.size() * sizeof(values[0]));
    Kokkos::deep_copy(target, host);
  };
  put(optimizer.master(), master);
  for (std::size_t i = 0; i < buffers.size(); ++i) {
    if (buffers[i].isBytes())
      put(buffers[i].u8, bytes[i]);
    else
      put(buffers[i].f32, floats[i]);
  }
  if (!optimizer.mastersAlias()) optimizer.syncParameters(ExecSpace());
  Kokkos::fence();
  trainer.restore(header.state);
  optimizer.setStepCount(header.optimizer_step);
  detail::restoreScaling(scaling, trainer.model());

  for (const auto& c : changes.harmless)
    log::info("checkpoint: deck change allowed: %s: %s -> %s", c.key.c_str(), c.stored.c_str(),
              c.current.c_str());
  for (const auto& c : changes.training)
    log::warn(
        "checkpoint: deck change allowed, but training continues differently from the original "
        "run: "
        "%s: %s -> %s",
        c.key.c_str(), c.stored.c_str(), c.current.c_str());
  const std::int64_t mbps = trainer.trainLoader().options().micro_batches_per_step;
  if (mbps != header.micro_batches_per_step)
    log::warn(
        "checkpoint: a step now takes %lld micro-batches instead of %lld (data.tokens_per_batch / "
        "data.micro_batch_tokens, rounded up to a multiple of the %d rank(s)): the data order "
        "continues, "
        "but the steps differ from the original run's",
        static_cast<long long>(mbps), static_cast<long long>(header.micro_batches_per_step),
        trainer.world());
  return header;
}

}  // namespace plm::ckpt
