#include "io/tensorboard.hpp"

#include "core/clock.hpp"
#include "core/error.hpp"

#include <unistd.h>

#include <array>
#include <chrono>
#include <cstring>
#include <filesystem>

namespace plm::io::tensorboard {

namespace {

const std::array<std::uint32_t, 256>& crcTable() {
  static const std::array<std::uint32_t, 256> table = [] {
    std::array<std::uint32_t, 256> t{};
    for (std::uint32_t i = 0; i < 256; ++i) {
      std::uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  return table;
}

// Protobuf wire format: a key is (field << 3) | wire type; 0 varint, 1 fixed64, 2 bytes,
// 5 fixed32.
void varint(std::string& out, std::uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}
void key(std::string& out, int field, int wire) { varint(out, (std::uint64_t(field) << 3) | wire); }
template <class T> void little(std::string& out, T v) {
  char bytes[sizeof(T)];
  std::memcpy(bytes, &v, sizeof(T));  // plm runs on little-endian hosts (x86-64, aarch64)
  out.append(bytes, sizeof(T));
}
void bytesField(std::string& out, int field, const std::string& bytes) {
  key(out, field, 2);
  varint(out, bytes.size());
  out += bytes;
}
void header(std::string& out, double wall_time) {
  key(out, 1, 1);
  little(out, wall_time);
}

}  // namespace

std::uint32_t crc32c(const void* data, std::size_t size, std::uint32_t crc) {
  const auto& table = crcTable();
  const auto* p = static_cast<const unsigned char*>(data);
  crc = ~crc;
  for (std::size_t i = 0; i < size; ++i) crc = table[(crc ^ p[i]) & 0xff] ^ (crc >> 8);
  return ~crc;
}

std::uint32_t maskedCrc32c(const void* data, std::size_t size) {
  const std::uint32_t crc = crc32c(data, size);
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

std::string tfRecord(const std::string& payload) {
  std::string out;
  const std::uint64_t length = payload.size();
  little(out, length);
  little(out, maskedCrc32c(out.data(), sizeof(length)));
  out += payload;
  little(out, maskedCrc32c(payload.data(), payload.size()));
  return out;
}

std::string scalarEvent(double wall_time, std::int64_t step,
                        const std::vector<std::pair<std::string, double>>& scalars) {
  std::string summary;
  for (const auto& [tag, value] : scalars) {
    std::string v;
    bytesField(v, 1, tag);
    key(v, 2, 5);
    little(v, static_cast<float>(value));
    bytesField(summary, 1, v);
  }
  std::string event;
  header(event, wall_time);
  key(event, 2, 0);
  varint(event, static_cast<std::uint64_t>(step));
  bytesField(event, 5, summary);
  return event;
}

std::string versionEvent(double wall_time) {
  std::string event;
  header(event, wall_time);
  bytesField(event, 3, "brain.Event:2");
  return event;
}

void EventWriter::open(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  char host[256] = "localhost";
  gethostname(host, sizeof host - 1);
  const double t = clock::unixSeconds();
  path_member = dir + "/events.out.tfevents." + std::to_string(static_cast<long long>(t)) + "." +
                host + "." + std::to_string(static_cast<long long>(getpid()));
  out_member.open(path_member, std::ios::binary | std::ios::app);
  if (!out_member)
    throw Error("train.tensorboard: cannot create " + path_member +
                (ec ? " (" + ec.message() + ")" : std::string()) +
                "; check that train.run_dir is writable");
  record(versionEvent(t));
}

void EventWriter::scalars(std::int64_t step,
                          const std::vector<std::pair<std::string, double>>& values) {
  if (!out_member.is_open()) return;
  record(scalarEvent(clock::unixSeconds(), step, values));
}

void EventWriter::record(const std::string& payload) {
  out_member << tfRecord(payload);
  out_member.flush();
  if (!out_member) throw Error("writing " + path_member + " failed (disk full?)");
}

}  // namespace plm::io::tensorboard
