// Checkpoint files: atomic collective save, header, checked load, listing and pruning.
#include "ckpt/checkpoint.hpp"

#include "ckpt/detail/agree.hpp"
#include "ckpt/detail/load.hpp"
#include "ckpt/detail/redistribute.hpp"
#include "ckpt/detail/rows.hpp"
#include "ckpt/detail/snapshot.hpp"
#include "core/clock.hpp"
#include "core/fault.hpp"
#include "core/log.hpp"
#include "deck/deck.hpp"
#include "dist/process_groups.hpp"
#include "io/hdf5.hpp"
#include "model/model_file.hpp"
#include "plm/plm_config.hpp"
#include "train/fsdp.hpp"

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
#include <functional>
#include <future>
#include <memory>
#include <type_traits>

namespace plm::ckpt {

static_assert(std::is_same_v<master_t, float>,
              "checkpoints store master weights and moments as fp32 (model::writeTensorGroup)");

namespace fs = std::filesystem;
namespace h5 = io::h5;

namespace {

using dist::broadcastString;
using dist::commRank;
using dist::commSize;

// CRC-32 of this rank's rows of every tensor (where `rows` says they lie in `values`), with
// their byte counts: (crc, length) pairs, one per tensor.  Touches only host memory and zlib,
// so it may run on a helper thread while HDF5 writes the same (read-only) buffer.
template <class T>
std::vector<std::uint64_t> localChecksums(const std::vector<model::TensorInfo>& tensors,
                                          const T* values, const detail::RowsLayout& rows) {
  std::vector<std::uint64_t> local(2 * tensors.size());
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const auto* bytes = reinterpret_cast<const Bytef*>(values + rows.at[i]);
    const std::uint64_t length = std::uint64_t(rows.count(i)) * sizeof(T);
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

void writeChecksums(hid_t file, const std::string& group,
                    const std::vector<model::TensorInfo>& tensors,
                    const std::vector<std::uint32_t>& crcs) {
  h5::Hid g(PLM_CHECK_H5(H5Gopen2(file, group.c_str(), H5P_DEFAULT)));
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    h5::Hid dataset = h5::openDataset(g, tensors[i].name);
    h5::writeAttribute(dataset, "crc32", std::int64_t(crcs[i]));
  }
}

// model::writeTensorGroup from per-tensor rows (fp32 or 8-bit codes): creates `group`/<name> at
// full shape for every tensor (collective) and writes this rank's rows of each from where
// `rows` says they lie in `values` (a full-layout buffer or a compact one of these rows only).
template <class T> void writeRowsGroup(hid_t file, const std::string& group,
                                       const std::vector<model::TensorInfo>& tensors,
                                       const T* values, const detail::RowsLayout& rows,
                                       bool independent) {
  h5::Hid g = h5::exists(file, group)
                  ? h5::Hid(PLM_CHECK_H5(H5Gopen2(file, group.c_str(), H5P_DEFAULT)))
                  : h5::createGroup(file, group);
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    h5::Hid dataset = h5::createDataset<T>(g, tensors[i].name, tensors[i].shape);
    if (independent && rows.row_count[i] == 0) continue;  // nothing to write, no collective
    h5::writeRows<T>(dataset, rows.first_row[i], rows.row_count[i], values + rows.at[i],
                     independent);
  }
}

// Reads this rank's rows of `group` (the split `rows` describes, into where it says they lie
// in `values`; independent transfers, so the ranks of `crc_comm` read the file once), checks
// them against the stored CRC-32s (the pieces joined over `crc_comm`, whose ranks are the
// split's), and leaves sharing them to the caller.  The group must hold exactly the model's
// tensors at their shapes.  Any failure is a CorruptCheckpoint on every rank of `comm`.
template <class T> void readGroup(hid_t file, MPI_Comm comm, MPI_Comm crc_comm,
                                  const std::string& group,
                                  const std::vector<model::TensorInfo>& tensors, T* values,
                                  const detail::RowsLayout& rows, const std::string& path) {
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
        if (rows.row_count[i] > 0)
          h5::readRows<T>(dataset, rows.first_row[i], rows.row_count[i], values + rows.at[i],
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
  // This rank's rows, joined over the ranks of the split; every rank of `comm` agrees.
  const auto crcs = combineChecksums(localChecksums(tensors, values, rows), crc_comm);
  detail::agree(comm, [&] {
    for (std::size_t i = 0; i < tensors.size(); ++i)
      if (std::int64_t(crcs[i]) != stored[i])
        throw CorruptCheckpoint("checkpoint `" + path + "` is damaged: /" + group + "/" +
                                tensors[i].name + " does not match its checksum (crc32 " +
                                std::to_string(stored[i]) + " stored, " + std::to_string(crcs[i]) +
                                " read)");
  });
}

// The full-layout read: this rank's rows of the split over `comm`, checked, then shared so
// that every rank holds every tensor whole in `values`.
template <class T> void readWholeGroup(hid_t file, MPI_Comm comm, const std::string& group,
                                       const std::vector<model::TensorInfo>& tensors, T* values,
                                       const std::string& path) {
  readGroup(file, comm, comm, group, tensors, values,
            detail::fullRows(tensors, commRank(comm), commSize(comm)), path);
  detail::shareRows(tensors, values, comm);
}

// readWholeGroup for a model holding `placement`'s experts: this rank's rows of heldLayout,
// checked, then shared: the tensors every rank holds over `comm`, the held experts' over the
// ranks holding them (the expert-data-parallel group).
template <class T> void readHeldGroup(hid_t file, MPI_Comm comm, const std::string& group,
                                      const std::vector<model::TensorInfo>& table, T* values,
                                      const model::ExpertPlacement& placement, int experts,
                                      const std::string& path) {
  if (!placement.sharded()) return readWholeGroup(file, comm, group, table, values, path);
  const int rank = commRank(comm);
  const detail::HeldLayout held =
      detail::heldLayout(table, placement, experts, rank, commSize(comm));
  readGroup(file, comm, comm, group, held.tensors, values, held.rows, path);
  detail::shareHeldRows(table, values, placement, comm);
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

template <class T> void shareRowsOf(const std::vector<model::TensorInfo>& tensors, T* values,
                                    MPI_Comm comm, std::int64_t batch_limit) {
  const int rank = commRank(comm), world = commSize(comm);
  if (world == 1) return;
  auto rowsOf = [&](const model::TensorInfo& t, int r) {
    const std::int64_t rows = t.shape.empty() ? 1 : t.shape[0];
    const std::int64_t row_size = rows ? t.size / rows : 0;
    auto [first, last] = model::rowRange(rows, r, world);
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
    PLM_CHECK_MPI(MPI_Allgatherv(send.data(), counts[rank], detail::mpiTypeOf<T>(), receive.data(),
                                 counts.data(), displacements.data(), detail::mpiTypeOf<T>(),
                                 comm));
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

namespace {
detail::RowsLayout rowsOf(const std::vector<model::TensorInfo>& tensors, int rank, int world,
                          bool compact) {
  detail::RowsLayout r;
  r.rank = rank;
  r.world = world;
  for (const auto& t : tensors) {
    const std::int64_t rows = t.shape.empty() ? 1 : t.shape[0];
    const std::int64_t row_size = rows ? t.size / rows : 0;
    auto [first, last] = model::rowRange(rows, rank, world);
    r.first_row.push_back(first);
    r.row_count.push_back(last - first);
    r.row_size.push_back(row_size);
    r.at.push_back(compact ? r.size : t.offset + first * row_size);
    r.size += (last - first) * row_size;
  }
  return r;
}
}  // namespace

detail::RowsLayout detail::fullRows(const std::vector<model::TensorInfo>& tensors, int rank,
                                    int world) {
  return rowsOf(tensors, rank, world, false);
}

detail::HeldLayout detail::heldLayout(const std::vector<model::TensorInfo>& table,
                                      const model::ExpertPlacement& placement, int experts,
                                      int rank, int world) {
  HeldLayout out;
  out.rows.rank = rank;
  out.rows.world = world;
  for (const auto& r : model::heldRows(table, placement, experts, rank, world)) {
    out.tensors.push_back(r.tensor);
    out.rows.first_row.push_back(r.first_row);
    out.rows.row_count.push_back(r.row_count);
    out.rows.row_size.push_back(r.rowSize());
    out.rows.at.push_back(r.row_count > 0 ? r.tensor.offset + r.first_row * r.rowSize() : 0);
    out.rows.size += r.row_count * r.rowSize();
  }
  return out;
}

detail::RowsLayout detail::compactRows(const std::vector<model::TensorInfo>& tensors, int rank,
                                       int world) {
  return rowsOf(tensors, rank, world, true);
}

std::vector<detail::Segment> detail::rowSegments(const RowsLayout& rows) {
  std::vector<Segment> out;
  for (std::size_t i = 0; i < rows.at.size(); ++i)
    if (rows.row_count[i] > 0)
      out.push_back({std::int64_t(i), rows.start(i), rows.count(i), rows.at[i]});
  return out;
}

void detail::shareRows(const std::vector<model::TensorInfo>& tensors, float* values, MPI_Comm comm,
                       std::int64_t batch_limit) {
  shareRowsOf(tensors, values, comm, batch_limit);
}

void detail::shareRows(const std::vector<model::TensorInfo>& tensors, std::uint8_t* values,
                       MPI_Comm comm, std::int64_t batch_limit) {
  shareRowsOf(tensors, values, comm, batch_limit);
}

std::vector<std::int64_t> detail::tensorSizes(const std::vector<model::TensorInfo>& tensors) {
  std::vector<std::int64_t> sizes;
  for (const auto& t : tensors) sizes.push_back(t.size);
  return sizes;
}

std::vector<detail::Segment> detail::pieceSegments(const std::vector<train::TensorPiece>& pieces) {
  std::vector<detail::Segment> out;
  for (const auto& p : pieces) out.push_back({p.tensor, p.start, p.count, p.local});
  return out;
}

template <class T> void detail::shareHeldRows(const std::vector<model::TensorInfo>& table,
                                              T* values, const model::ExpertPlacement& placement,
                                              MPI_Comm comm) {
  if (!placement.sharded()) return shareRows(table, values, comm);
  std::vector<model::TensorInfo> dense, routed;
  for (const auto& t : table) (t.expert >= 0 ? routed : dense).push_back(t);
  shareRows(dense, values, comm);
  MPI_Comm holders = MPI_COMM_NULL;
  PLM_CHECK_MPI(MPI_Comm_split(comm, placement.rank, commRank(comm), &holders));
  shareRows(routed, values, holders);
  PLM_CHECK_MPI(MPI_Comm_free(&holders));
}
template void detail::shareHeldRows<float>(const std::vector<model::TensorInfo>&, float*,
                                           const model::ExpertPlacement&, MPI_Comm);
template void detail::shareHeldRows<std::uint8_t>(const std::vector<model::TensorInfo>&,
                                                  std::uint8_t*, const model::ExpertPlacement&,
                                                  MPI_Comm);

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

namespace {

// One optimizer state buffer's entry of a snapshot, before its data: name, kind, tensor table and
// the rows this rank writes (in the full layout or compacted).
detail::SnapshotState stateHeader(const train::StateBuffer& b, detail::RowsLayout rows) {
  detail::SnapshotState st;
  st.name = b.name;
  st.bytes = b.isBytes();
  st.table = b.table;
  st.rows = std::move(rows);
  return st;
}

// The full-layout path: the whole-model optimizer's buffers (gathered from the shards by
// Trainer::optimizer() in a sharded run), each rank's rows read where they lie in them.
void fullLayoutSnapshot(train::Trainer& trainer, detail::SnapshotBuffers* buffers,
                        detail::Snapshot& snap) {
  auto& optimizer = trainer.optimizer();
  const int rank = commRank(trainer.comm()), world = commSize(trainer.comm());
  snap.optimizer_step = optimizer.stepCount();
  snap.optimizer_attributes = optimizer.attributes();
  // Expert parallelism: the file holds every expert; each rank writes rows of those it holds.
  const model::ExpertPlacement& held = trainer.model().expertPlacement();
  const int experts = snap.config.moe.experts;
  detail::HeldLayout master = detail::heldLayout(snap.tensors, held, experts, rank, world);
  snap.tensors = std::move(master.tensors);
  snap.master_rows = std::move(master.rows);
  const double start = clock::steadySeconds();
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
    detail::HeldLayout layout = detail::heldLayout(b.table, held, experts, rank, world);
    detail::SnapshotState st = stateHeader(b, std::move(layout.rows));
    st.table = std::move(layout.tensors);
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
  snap.copy_seconds = clock::steadySeconds() - start;
}

using detail::pieceSegments;
using detail::tensorSizes;

// The sharded path: no full-layout state.  Each group's rows of this rank come out of its shard
// group's shards (redistribute over the shard group: every element of this rank's rows has
// exactly one owner there) into a compact buffer; replicated state is copied from this rank's
// own whole copy.  Host mirrors of the shards are the shards themselves on the CPU.
void shardedSnapshot(train::Trainer& trainer, detail::Snapshot& snap) {
  train::Fsdp<param_t>& fsdp = *trainer.sharding();
  const train::Optimizer<param_t>& optimizer = fsdp.optimizer();
  const MPI_Comm shard = fsdp.shardComm();
  const int rank = commRank(trainer.comm()), world = commSize(trainer.comm());
  snap.optimizer_step = optimizer.stepCount();
  snap.optimizer_attributes = optimizer.attributes();
  const double start = clock::steadySeconds();

  snap.master_rows = detail::compactRows(snap.tensors, rank, world);
  snap.host_master = detail::HostBuffer(
      Kokkos::view_alloc(Kokkos::WithoutInitializing, "plm::ckpt::snapshot_master_rows"),
      snap.master_rows.size);
  {
    const auto master =
        Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), optimizer.master());
    detail::redistribute(shard, tensorSizes(snap.tensors), pieceSegments(optimizer.layout().pieces),
                         master.data(), detail::rowSegments(snap.master_rows),
                         snap.host_master.data());
  }
  snap.master = snap.host_master.data();

  for (const auto& b : optimizer.state()) {
    detail::SnapshotState st = stateHeader(b, detail::compactRows(b.table, rank, world));
    auto fill = [&](const auto& from, auto& rows_buffer) {
      using V = std::decay_t<decltype(rows_buffer)>;
      rows_buffer =
          V(Kokkos::view_alloc(Kokkos::WithoutInitializing, "plm::ckpt::snapshot_rows_" + b.name),
            st.rows.size);
      const auto local = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), from);
      if (b.layout == train::StateBuffer::Layout::Pieces) {
        detail::redistribute(shard, tensorSizes(b.table), pieceSegments(b.pieces), local.data(),
                             detail::rowSegments(st.rows), rows_buffer.data());
      } else {  // replicated: this rank's whole copy holds its rows
        const detail::RowsLayout whole = detail::fullRows(b.table, rank, world);
        for (std::size_t i = 0; i < b.table.size(); ++i)
          std::memcpy(rows_buffer.data() + st.rows.at[i], local.data() + whole.at[i],
                      std::size_t(st.rows.count(i)) * sizeof(local(0)));
      }
      st.data = rows_buffer.data();
    };
    if (st.bytes)
      fill(b.u8, st.host_u8);
    else
      fill(b.f32, st.host_f32);
    snap.optimizer_state.push_back(std::move(st));
  }
  Kokkos::fence();
  snap.copy_seconds = clock::steadySeconds() - start;
}

}  // namespace

const char* detail::statePathName(StatePath path) {
  return path == StatePath::Shards ? "shards" : "full layout";
}

detail::StatePath detail::statePath(train::Trainer& trainer) {
  // Every optimizer kind's state is either elementwise in the shard layout (moved by
  // redistribute) or replicated per whole tensor (written from each rank's copy), so every
  // sharded run saves and loads its shards directly.  A kind with state of neither layout would
  // return FullLayout here.
  // FSDP beside expert parallelism: the shard group holds one expert-group position, whose
  // full layout (the dense tensors and its experts) is what expert parallelism writes; the
  // shards path's row moves assume every shard group holds the whole model.
  if (trainer.sharding() == nullptr || trainer.model().expertPlacement().sharded())
    return StatePath::FullLayout;
  return StatePath::Shards;
}

detail::Snapshot detail::takeSnapshot(train::Trainer& trainer, SnapshotBuffers* buffers) {
  return takeSnapshot(trainer, buffers, statePath(trainer));
}

detail::Snapshot detail::takeSnapshot(train::Trainer& trainer, SnapshotBuffers* buffers,
                                      StatePath path) {
  PLM_REQUIRE(path == StatePath::FullLayout || trainer.sharding() != nullptr,
              "ckpt::takeSnapshot: the shards path needs a sharded run");
  Snapshot snap;
  auto& model = trainer.model();
  auto& loader = trainer.trainLoader();
  snap.state = trainer.state();
  snap.config = model.config();
  snap.tensors = model.tensors();
  snap.optimizer_kind = train::optimizerName(trainer.optimizerOptions().kind);
  snap.micro_batches_per_step = loader.options().micro_batches_per_step;
  snap.dataset_path = loader.options().path;
  snap.dataset_sequences = loader.numSequences();
  snap.dataset_residues = loader.numResidues();
  snap.deck_yaml = deck::toYaml(trainer.deck());
  snap.scaling = detail::takeScaling(model);
  static bool told = false;  // once per process
  if (!told && trainer.sharding() != nullptr) {
    told = true;
    log::info("checkpoint: sharded run: saves and loads take the %s path (%s)", statePathName(path),
              path == StatePath::Shards
                  ? "each rank's rows move between the shards and the file by all-to-all-v in its "
                    "shard group; no full-layout copy of the state"
                  : "the full-layout state is gathered for each save: 12 bytes per parameter for "
                    "AdamW on every rank");
  }
  if (path == StatePath::Shards)
    shardedSnapshot(trainer, snap);
  else
    fullLayoutSnapshot(trainer, buffers, snap);
  return snap;
}

SaveReport save(train::Trainer& trainer, const std::string& dir) {
  const double t0 = clock::steadySeconds();
  const detail::Snapshot snap = detail::takeSnapshot(trainer, nullptr);
  SaveReport report = detail::writeSnapshot(snap, dir, trainer.comm());
  report.seconds = clock::steadySeconds() - t0;
  return report;
}

SaveReport detail::writeSnapshot(const Snapshot& snap, const std::string& dir, MPI_Comm comm) {
  const int rank = commRank(comm), world = commSize(comm);
  const double t0 = clock::steadySeconds();
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
  const double t1 = clock::steadySeconds();

  const std::string created = broadcastString(rank == 0 ? clock::utcIso() : std::string(), comm);
  // Independent data transfers: each rank's rows are one contiguous range of the file, so
  // collective two-phase I/O buys nothing, and its per-tensor synchronisation made 2-rank saves
  // 5x slower on the dev machine (doc/performance.md).
  constexpr bool independent_transfers = true;
  // The checksums of this rank's rows are computed on a helper thread while HDF5 writes.
  struct Group {
    std::string name;
    const std::vector<model::TensorInfo>* table;
    const void* data;
    const detail::RowsLayout* rows;  // where this rank's rows lie in `data`
    bool bytes;
  };
  std::vector<Group> groups = {{"model", &tensors, snap.master, &snap.master_rows, false}};
  for (const auto& st : snap.optimizer_state)
    groups.push_back({"optimizer/" + st.name, &st.table, st.data, &st.rows, st.bytes});
  for (const auto& g : groups)
    PLM_REQUIRE(g.rows->rank == rank && g.rows->world == world,
                "ckpt::writeSnapshot: the snapshot was taken for rank " +
                    std::to_string(g.rows->rank) + " of " + std::to_string(g.rows->world) +
                    ", the communicator is rank " + std::to_string(rank) + " of " +
                    std::to_string(world));
  auto crc_pending = std::async(std::launch::async, [&groups] {
    std::vector<std::vector<std::uint64_t>> out;
    for (const auto& g : groups)
      out.push_back(
          g.bytes ? localChecksums(*g.table, static_cast<const std::uint8_t*>(g.data), *g.rows)
                  : localChecksums(*g.table, static_cast<const float*>(g.data), *g.rows));
    return out;
  });
  {
    h5::Hid file = h5::createFile(temporary, comm);
    model::writeConfigAttributes(file, snap.config);
    model::ModelAttributes extra;
    extra.strings["plm_version"] = PLM_VERSION_STRING;
    extra.strings["source"] = "plm train checkpoint";
    extra.integers["step"] = state.step;
    extra.integers["tokens_seen"] = state.tokens_seen;
    model::writeExtraAttributes(file, extra);

    writeRowsGroup(file, "model", tensors, snap.master, snap.master_rows, independent_transfers);
    fault::checkpointFailPoint(state.step, "model");
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
        writeRowsGroup(file, g.name, *g.table, static_cast<const std::uint8_t*>(g.data), *g.rows,
                       independent_transfers);
      else
        writeRowsGroup(file, g.name, *g.table, static_cast<const float*>(g.data), *g.rows,
                       independent_transfers);
      if (i == 1) fault::checkpointFailPoint(state.step, "optimizer");
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
    report.write_seconds = clock::steadySeconds() - t1;
    PLM_CHECK_H5(H5Fflush(file, H5F_SCOPE_GLOBAL));
    fault::checkpointFailPoint(state.step, "flush");
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
  const double t2 = clock::steadySeconds();
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
    h.config = model::readConfigAttributes(file, path);
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

namespace {

// The full-layout load: every rank reads its rows of the split over the trainer's ranks, checks
// them and all-gathers the rest, into host buffers of the whole-model optimizer's shape
// (Trainer::optimizer(); a sharded run then takes its slices from it: releaseFullState).
std::function<void()> readFullLayout(train::Trainer& trainer, hid_t file, const std::string& path) {
  const MPI_Comm comm = trainer.comm();
  auto& optimizer = trainer.optimizer();
  const auto& tensors = trainer.model().tensors();
  struct Read {
    std::vector<float> master;
    std::vector<train::StateBuffer> buffers;
    std::vector<std::vector<float>> floats;
    std::vector<std::vector<std::uint8_t>> bytes;
  };
  auto read = std::make_shared<Read>();
  read->master.assign(optimizer.master().extent(0), 0.0f);
  read->buffers = optimizer.state();
  read->floats.resize(read->buffers.size());
  read->bytes.resize(read->buffers.size());
  const model::ExpertPlacement& held = trainer.model().expertPlacement();
  const int experts = trainer.model().config().moe.experts;
  readHeldGroup(file, comm, "model", tensors, read->master.data(), held, experts, path);
  for (std::size_t i = 0; i < read->buffers.size(); ++i) {
    const auto& b = read->buffers[i];
    const std::string group = "optimizer/" + b.name;
    if (b.isBytes()) {
      read->bytes[i].assign(b.u8.extent(0), 0);
      readHeldGroup(file, comm, group, b.table, read->bytes[i].data(), held, experts, path);
    } else {
      read->floats[i].assign(b.f32.extent(0), 0.0f);
      readHeldGroup(file, comm, group, b.table, read->floats[i].data(), held, experts, path);
    }
  }
  return [read, &optimizer] {
    auto put = [](const auto& target, const auto& values) {
      auto host = Kokkos::create_mirror_view(Kokkos::HostSpace(), target);
      std::memcpy(host.data(), values.data(), values.size() * sizeof(values[0]));
      Kokkos::deep_copy(target, host);
    };
    put(optimizer.master(), read->master);
    for (std::size_t i = 0; i < read->buffers.size(); ++i) {
      if (read->buffers[i].isBytes())
        put(read->buffers[i].u8, read->bytes[i]);
      else
        put(read->buffers[i].f32, read->floats[i]);
    }
    if (!optimizer.mastersAlias()) optimizer.syncParameters(ExecSpace());
    Kokkos::fence();
  };
}

// The sharded load: no full-layout state.  Rank s of each shard group (of S) reads rows
// model::rowRange(rows, s, S) of every tensor into a compact buffer (so each shard group reads
// the file once) and checks them (CRC pieces joined over the shard group); applying moves them
// into the shards with the inverse redistribute.  Replicated state is read the same way and
// all-gathered in the shard group (it is per whole tensor and small).
std::function<void()> readShards(train::Trainer& trainer, hid_t file, const std::string& path) {
  const MPI_Comm comm = trainer.comm();
  train::Fsdp<param_t>& fsdp = *trainer.sharding();
  train::Optimizer<param_t>& optimizer = fsdp.optimizer();
  const MPI_Comm shard = fsdp.shardComm();
  const int s = commRank(shard), shards = commSize(shard);
  const auto& tensors = trainer.model().tensors();
  struct Group {
    train::StateBuffer buffer;  // the shard's buffer (unset for the master)
    detail::RowsLayout rows;
    detail::HostBuffer f32;  // compact rows, or the whole replicated buffer
    Kokkos::View<std::uint8_t*, Kokkos::HostSpace> u8;
  };
  auto groups = std::make_shared<std::vector<Group>>();
  auto readInto = [&](Group& g, const std::string& name,
                      const std::vector<model::TensorInfo>& table, bool bytes, bool replicated,
                      std::int64_t whole) {
    g.rows =
        replicated ? detail::fullRows(table, s, shards) : detail::compactRows(table, s, shards);
    const std::int64_t n = replicated ? whole : g.rows.size;
    const std::string label = "plm::ckpt::load_rows_" + name;
    if (bytes) {
      g.u8 = decltype(g.u8)(label, n);
      readGroup(file, comm, shard, name, table, g.u8.data(), g.rows, path);
      if (replicated) detail::shareRows(table, g.u8.data(), shard);
    } else {
      g.f32 = detail::HostBuffer(label, n);
      readGroup(file, comm, shard, name, table, g.f32.data(), g.rows, path);
      if (replicated) detail::shareRows(table, g.f32.data(), shard);
    }
  };
  groups->emplace_back();
  readInto(groups->back(), "model", tensors, false, false, 0);
  for (const auto& b : optimizer.state()) {
    groups->emplace_back();
    groups->back().buffer = b;
    readInto(groups->back(), "optimizer/" + b.name, b.table, b.isBytes(),
             b.layout == train::StateBuffer::Layout::Replicated, b.full_size);
  }
  return [groups, &trainer, &fsdp, &optimizer, shard, tensors] {
    trainer.discardFullState();  // an older full-layout copy must not be taken back
    // Padding elements of the shards stay 0, as importFull leaves them.
    auto put = [&](const auto& target, const auto& compact,
                   const std::vector<model::TensorInfo>& table,
                   const std::vector<train::TensorPiece>& pieces, const detail::RowsLayout& rows,
                   bool replicated) {
      auto host = Kokkos::create_mirror_view(Kokkos::HostSpace(), target);
      if (replicated) {
        std::memcpy(host.data(), compact.data(), host.extent(0) * sizeof(host(0)));
      } else {
        Kokkos::deep_copy(host, 0);
        detail::redistribute(shard, tensorSizes(table), detail::rowSegments(rows), compact.data(),
                             pieceSegments(pieces), host.data());
      }
      Kokkos::deep_copy(target, host);
    };
    const Group& m = groups->front();
    put(optimizer.master(), m.f32, tensors, optimizer.layout().pieces, m.rows, false);
    for (std::size_t i = 1; i < groups->size(); ++i) {
      const Group& g = (*groups)[i];
      const bool replicated = g.buffer.layout == train::StateBuffer::Layout::Replicated;
      if (g.buffer.isBytes())
        put(g.buffer.u8, g.u8, g.buffer.table, g.buffer.pieces, g.rows, replicated);
      else
        put(g.buffer.f32, g.f32, g.buffer.table, g.buffer.pieces, g.rows, replicated);
    }
    fsdp.restoredShards(ExecSpace());  // derived copies recast, gathered units stale
    Kokkos::fence();
  };
}

}  // namespace

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

  h5::Hid file;
  detail::agree(comm, [&] {
    try {
      file = h5::openFile(path, comm);
    } catch (const std::exception& e) {
      throw CorruptCheckpoint("checkpoint `" + path + "` cannot be opened: " + e.what());
    }
  });
  // Reads and checks every tensor group; what it returns puts them into the trainer.
  const detail::StatePath state_path = detail::statePath(trainer);
  const std::function<void()> apply = state_path == detail::StatePath::Shards
                                          ? readShards(trainer, file, path)
                                          : readFullLayout(trainer, file, path);
  detail::ScalingState scaling;
  detail::agree(comm, [&] { scaling = detail::readScaling(file, path); });
  file.reset();
  if (const std::string why = detail::scalingRefusal(scaling, trainer.model()); !why.empty())
    throw collectiveError("checkpoint `" + path + "` (step " + std::to_string(header.state.step) +
                          ") does not fit this run: " + why);

  // Everything checked: only now does the trainer change.
  apply();
  trainer.restore(header.state);
  (state_path == detail::StatePath::Shards ? trainer.sharding()->optimizer() : trainer.optimizer())
      .setStepCount(header.optimizer_step);
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
