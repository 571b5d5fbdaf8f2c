// TensorBoard event files, written without TensorFlow or protobuf: what `plm train` writes to
// <run_dir>/tb/ under train.tensorboard: true.
//
// Design choice: the file is a TFRecord stream (each record: uint64 length, masked CRC-32C of
// the length, the bytes, masked CRC-32C of the bytes; little-endian) of tensorflow.Event
// messages, and the few protobuf fields an Event with scalar summaries needs are encoded here by
// hand (wall_time = 1 double, step = 2 varint, file_version = 3 string, summary = 5 message;
// Summary.value = 1 message; Summary.Value.tag = 1 string, simple_value = 2 float).  That is
// the whole format TensorBoard's scalar dashboard reads, so plm takes no new dependency.  The
// first record is the file_version "brain.Event:2" event, as TensorFlow's writer starts.
#pragma once

#include <cstdint>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

namespace plm::io::tensorboard {

/// \brief CRC-32C (Castagnoli, reflected polynomial 0x82F63B78) of `size` bytes, continuing
/// from `crc` (0 to start).
std::uint32_t crc32c(const void* data, std::size_t size, std::uint32_t crc = 0);
/// \brief The masked CRC TFRecord stores: ((crc >> 15) | (crc << 17)) + 0xa282ead8.
std::uint32_t maskedCrc32c(const void* data, std::size_t size);

/// \brief One TFRecord: length, its masked CRC, the bytes, their masked CRC.
std::string tfRecord(const std::string& payload);

/// \brief The protobuf encoding of an Event at `wall_time` (Unix seconds) and `step` holding
/// one scalar summary value per (tag, value) pair.
std::string scalarEvent(double wall_time, std::int64_t step,
                        const std::vector<std::pair<std::string, double>>& scalars);
/// \brief The protobuf encoding of the first Event of a file: file_version "brain.Event:2".
std::string versionEvent(double wall_time);

/// \brief Appends events to <dir>/events.out.tfevents.<unix seconds>.<host>.<pid> (the name
/// TensorBoard looks for); each write is flushed, so a killed run keeps what it logged.
class EventWriter {
 public:
  EventWriter() = default;
  /// \brief Creates `dir` if needed and opens a new event file there; throws plm::Error naming
  /// the path if it cannot.
  void open(const std::string& dir);
  bool isOpen() const { return out_member.is_open(); }
  const std::string& path() const { return path_member; }
  /// \brief Writes one event with these scalars at `step` (wall time: now).
  void scalars(std::int64_t step, const std::vector<std::pair<std::string, double>>& values);

 private:
  void record(const std::string& payload);
  std::ofstream out_member;
  std::string path_member;
};

}  // namespace plm::io::tensorboard
