// safetensors reader and writer; the format's rules follow the reference implementation
// (huggingface/safetensors): header at most 100 MB, byte ranges tile the data exactly.
#include "io/safetensors.hpp"

#include "core/error.hpp"
#include "io/json.hpp"

#include <sys/stat.h>
#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>

namespace plm::io::safetensors {

namespace {

constexpr std::int64_t max_header_bytes = 100'000'000;

struct FileCloser {
  void operator()(std::FILE* f) const {
    if (f) std::fclose(f);
  }
};
using File = std::unique_ptr<std::FILE, FileCloser>;

bool hostIsLittleEndian() {
  const std::uint16_t probe = 1;
  unsigned char first;
  std::memcpy(&first, &probe, 1);
  return first == 1;
}

File openForRead(const std::string& path) {
  File f(std::fopen(path.c_str(), "rb"));
  if (!f) throw Error("cannot open safetensors file `" + path + "`: " + std::strerror(errno));
  return f;
}

void readAt(std::FILE* f, const std::string& path, std::int64_t offset, void* out,
            std::size_t bytes) {
  if (fseeko(f, static_cast<off_t>(offset), SEEK_SET) != 0)
    throw Error("cannot seek in `" + path + "`: " + std::strerror(errno));
  if (bytes && std::fread(out, 1, bytes, f) != bytes)
    throw Error("`" + path + "` is truncated: could not read " + std::to_string(bytes) +
                " bytes at offset " + std::to_string(offset));
}

}  // namespace

std::int64_t TensorEntry::numel() const {
  std::int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

int dtypeSize(const std::string& dtype) {
  static const std::map<std::string, int> sizes = {
      {"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E4M3", 1}, {"F8_E5M2", 1},
      {"I16", 2},  {"U16", 2}, {"F16", 2}, {"BF16", 2},    {"I32", 4},
      {"U32", 4},  {"F32", 4}, {"I64", 8}, {"U64", 8},     {"F64", 8}};
  auto it = sizes.find(dtype);
  return it == sizes.end() ? 0 : it->second;
}

float bf16ToFloat(std::uint16_t bits) {
  std::uint32_t wide = std::uint32_t(bits) << 16;
  float value;
  std::memcpy(&value, &wide, sizeof value);
  return value;
}

float f16ToFloat(std::uint16_t bits) {
  const std::uint32_t sign = std::uint32_t(bits & 0x8000u) << 16;
  const std::uint32_t exponent = (bits >> 10) & 0x1Fu;
  std::uint32_t mantissa = bits & 0x3FFu;
  std::uint32_t out;
  if (exponent == 0x1F) {  // infinity or NaN (payload kept)
    out = sign | 0x7F800000u | (mantissa << 13);
  } else if (exponent != 0) {  // normal
    out = sign | ((exponent + 127 - 15) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {  // signed zero
    out = sign;
  } else {  // subnormal: value = mantissa * 2^-24; renormalise into an fp32 normal
    int shift = 0;
    while (!(mantissa & 0x400u)) {
      mantissa <<= 1;
      ++shift;
    }
    mantissa &= 0x3FFu;
    out = sign | (std::uint32_t(127 - 15 + 1 - shift) << 23) | (mantissa << 13);
  }
  float value;
  std::memcpy(&value, &out, sizeof value);
  return value;
}

std::uint16_t floatToBf16(float value) {
  std::uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  if ((bits & 0x7F800000u) == 0x7F800000u && (bits & 0x7FFFFFu))  // NaN: keep it quiet NaN
    return std::uint16_t((bits >> 16) | 0x40u);
  const std::uint32_t rounding = 0x7FFFu + ((bits >> 16) & 1u);
  return std::uint16_t((bits + rounding) >> 16);
}

Reader::Reader(const std::string& path) : path_member(path) {
  if (!hostIsLittleEndian()) throw Error("safetensors files are little-endian; this host is not");
  struct stat info;
  if (stat(path.c_str(), &info) != 0)
    throw Error("safetensors file `" + path + "` does not exist (" + std::strerror(errno) + ")");
  const std::int64_t file_size = info.st_size;
  if (file_size < 8)
    throw Error("`" + path + "` is not a safetensors file: " + std::to_string(file_size) +
                " bytes, shorter than the 8-byte header length");
  File f = openForRead(path);
  unsigned char length_bytes[8];
  readAt(f.get(), path, 0, length_bytes, 8);
  std::uint64_t header_length = 0;
  for (int i = 7; i >= 0; --i) header_length = (header_length << 8) | length_bytes[i];
  if (header_length > std::uint64_t(max_header_bytes) ||
      std::int64_t(header_length) > file_size - 8)
    throw Error("`" + path + "` is not a valid safetensors file: header length " +
                std::to_string(header_length) + " exceeds the file size " +
                std::to_string(file_size) + " (truncated or not safetensors)");
  std::string header(header_length, '\0');
  readAt(f.get(), path, 8, header.data(), header.size());
  data_start_member = 8 + std::int64_t(header_length);
  const std::int64_t data_bytes = file_size - data_start_member;

  json::Value root;
  try {
    root = json::parse(header, path + " (safetensors header)");
  } catch (const Error& e) {
    throw Error(std::string(e.what()) + "; the file is corrupt or not safetensors");
  }
  if (!root.isObject()) throw Error("`" + path + "`: safetensors header is not a JSON object");

  auto bad = [&](const std::string& name, const std::string& what) {
    return Error("`" + path + "`: safetensors header entry \"" + name + "\" " + what);
  };
  for (const auto& [name, entry] : root.members()) {
    if (name == "__metadata__") {
      if (!entry.isObject()) throw bad(name, "is not an object of strings");
      for (const auto& [key, value] : entry.members()) {
        if (!value.isString()) throw bad(name, "has a non-string value for \"" + key + "\"");
        metadata_member[key] = value.asString();
      }
      continue;
    }
    if (!entry.isObject() || !entry.has("dtype") || !entry.has("shape") ||
        !entry.has("data_offsets"))
      throw bad(name, "needs \"dtype\", \"shape\" and \"data_offsets\"");
    TensorEntry t;
    t.name = name;
    if (!entry.at("dtype").isString()) throw bad(name, "has a non-string dtype");
    t.dtype = entry.at("dtype").asString();
    const int element = dtypeSize(t.dtype);
    if (element == 0) throw bad(name, "has unknown dtype \"" + t.dtype + "\"");
    if (!entry.at("shape").isArray()) throw bad(name, "has a shape that is not an array");
    std::int64_t numel = 1;
    for (const auto& d : entry.at("shape").items()) {
      if (!d.isInteger() || d.asInt() < 0)
        throw bad(name, "has a shape entry that is not a non-negative integer");
      t.shape.push_back(d.asInt());
      if (d.asInt() != 0 && numel > (std::int64_t(1) << 56) / d.asInt())
        throw bad(name, "has an absurdly large shape");
      numel *= d.asInt();
    }
    const auto& offsets = entry.at("data_offsets");
    if (!offsets.isArray() || offsets.items().size() != 2 || !offsets.items()[0].isInteger() ||
        !offsets.items()[1].isInteger())
      throw bad(name, "has data_offsets that are not two integers");
    t.begin = offsets.items()[0].asInt();
    t.end = offsets.items()[1].asInt();
    if (t.begin < 0 || t.end < t.begin) throw bad(name, "has an invalid byte range");
    if (t.end - t.begin != numel * element)
      throw bad(name, "has " + std::to_string(t.end - t.begin) +
                          " bytes but its shape and dtype need " + std::to_string(numel * element));
    if (t.end > data_bytes)
      throw bad(name, "ends at byte " + std::to_string(t.end) + " of a data section of " +
                          std::to_string(data_bytes) + " bytes: the file is truncated");
    index_member[name] = tensors_member.size();
    tensors_member.push_back(std::move(t));
  }
  // The byte ranges must tile [0, data_bytes) exactly, as the reference implementation requires.
  std::vector<const TensorEntry*> sorted;
  for (const auto& t : tensors_member) sorted.push_back(&t);
  std::sort(sorted.begin(), sorted.end(), [](const TensorEntry* a, const TensorEntry* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
  });
  std::int64_t expected = 0;
  for (const auto* t : sorted) {
    if (t->begin != expected)
      throw Error("`" + path + "`: safetensors tensor \"" + t->name + "\" starts at byte " +
                  std::to_string(t->begin) + ", expected " + std::to_string(expected) +
                  " (overlapping or gapped data)");
    expected = t->end;
  }
  if (expected != data_bytes)
    throw Error("`" + path + "`: safetensors data section has " + std::to_string(data_bytes) +
                " bytes but the tensors cover " + std::to_string(expected) +
                " (trailing bytes or corrupt header)");
}

bool Reader::has(const std::string& name) const { return index_member.count(name) > 0; }

const TensorEntry& Reader::tensor(const std::string& name) const {
  auto it = index_member.find(name);
  if (it == index_member.end()) throw Error("`" + path_member + "` has no tensor \"" + name + "\"");
  return tensors_member[it->second];
}

std::vector<unsigned char> Reader::readRaw(const std::string& name) const {
  const TensorEntry& t = tensor(name);
  std::vector<unsigned char> bytes(std::size_t(t.end - t.begin));
  File f = openForRead(path_member);
  readAt(f.get(), path_member, data_start_member + t.begin, bytes.data(), bytes.size());
  return bytes;
}

std::vector<float> Reader::readFloat(const std::string& name) const {
  const TensorEntry& t = tensor(name);
  return readFloatRows(name, 0, t.shape.empty() ? 1 : t.shape[0]);
}

std::vector<float> Reader::readFloatRows(const std::string& name, std::int64_t first_row,
                                         std::int64_t row_count) const {
  const TensorEntry& t = tensor(name);
  const std::int64_t rows = t.shape.empty() ? 1 : t.shape[0];
  if (first_row < 0 || row_count < 0 || first_row + row_count > rows)
    throw Error("`" + path_member + "`: rows [" + std::to_string(first_row) + ", " +
                std::to_string(first_row + row_count) + ") of tensor \"" + name +
                "\" are outside its " + std::to_string(rows) + " rows");
  const int element = dtypeSize(t.dtype);
  if (t.dtype != "F32" && t.dtype != "BF16" && t.dtype != "F16" && t.dtype != "F64")
    throw Error("`" + path_member + "`: tensor \"" + name + "\" has dtype " + t.dtype +
                "; plm reads only floating tensors (F32, BF16, F16, F64) as parameters");
  const std::int64_t row_size = rows ? t.numel() / rows : 0;
  const std::size_t n = std::size_t(row_count * row_size);
  std::vector<unsigned char> bytes(n * std::size_t(element));
  File f = openForRead(path_member);
  readAt(f.get(), path_member, data_start_member + t.begin + first_row * row_size * element,
         bytes.data(), bytes.size());
  std::vector<float> out(n);
  if (t.dtype == "F32") {
    std::memcpy(out.data(), bytes.data(), n * sizeof(float));
  } else if (t.dtype == "BF16" || t.dtype == "F16") {
    const bool bf16 = t.dtype == "BF16";
    for (std::size_t i = 0; i < n; ++i) {
      std::uint16_t bits;
      std::memcpy(&bits, bytes.data() + 2 * i, 2);
      out[i] = bf16 ? bf16ToFloat(bits) : f16ToFloat(bits);
    }
  } else {
    for (std::size_t i = 0; i < n; ++i) {
      double d;
      std::memcpy(&d, bytes.data() + 8 * i, 8);
      out[i] = static_cast<float>(d);
    }
  }
  return out;
}

std::int64_t storedBytes(const std::vector<TensorOut>& tensors, const std::string& dtype) {
  std::int64_t bytes = 0;
  for (const auto& t : tensors) {
    std::int64_t numel = 1;
    for (auto d : t.shape) numel *= d;
    bytes += numel * dtypeSize(t.dtype.empty() ? dtype : t.dtype);
  }
  return bytes;
}

void write(const std::string& path, const std::vector<TensorOut>& tensors,
           const std::map<std::string, std::string>& metadata, const std::string& dtype) {
  if (!hostIsLittleEndian()) throw Error("safetensors files are little-endian; this host is not");
  auto dtypeOf = [&](const TensorOut& t) {
    const std::string& d = t.dtype.empty() ? dtype : t.dtype;
    if (d != "F32" && d != "BF16")
      throw Error("safetensors write `" + path + "`: dtype " + d + " is not written (F32, BF16)");
    return d;
  };
  json::Value header = json::Value::object();
  if (!metadata.empty()) {
    json::Value meta = json::Value::object();
    for (const auto& [key, value] : metadata) meta.set(key, value);
    header.set("__metadata__", std::move(meta));
  }
  std::int64_t offset = 0;
  for (const auto& t : tensors) {
    if (t.name == "__metadata__" || header.has(t.name))
      throw Error("safetensors write `" + path + "`: duplicate or reserved tensor name \"" +
                  t.name + "\"");
    std::int64_t numel = 1;
    json::Value shape = json::Value::array();
    for (auto d : t.shape) {
      numel *= d;
      shape.push(d);
    }
    json::Value entry = json::Value::object();
    const std::string d = dtypeOf(t);
    const std::int64_t element = dtypeSize(d);
    entry.set("dtype", d);
    entry.set("shape", std::move(shape));
    json::Value offsets = json::Value::array();
    offsets.push(offset);
    offsets.push(offset + numel * element);
    entry.set("data_offsets", std::move(offsets));
    header.set(t.name, std::move(entry));
    offset += numel * element;
  }
  std::string text = json::write(header);
  text.append((8 - text.size() % 8) % 8, ' ');

  File f(std::fopen(path.c_str(), "wb"));
  if (!f) throw Error("cannot create `" + path + "`: " + std::strerror(errno));
  auto put = [&](const void* data, std::size_t bytes) {
    if (bytes && std::fwrite(data, 1, bytes, f.get()) != bytes)
      throw Error("writing `" + path + "` failed: " + std::strerror(errno));
  };
  unsigned char length_bytes[8];
  std::uint64_t length = text.size();
  for (int i = 0; i < 8; ++i) length_bytes[i] = static_cast<unsigned char>(length >> (8 * i));
  put(length_bytes, 8);
  put(text.data(), text.size());
  std::vector<std::uint16_t> narrow;
  for (const auto& t : tensors) {
    std::int64_t numel = 1;
    for (auto d : t.shape) numel *= d;
    if (dtypeOf(t) == "F32") {
      put(t.data, std::size_t(numel) * sizeof(float));
      continue;
    }
    narrow.resize(std::size_t(numel));
    for (std::int64_t i = 0; i < numel; ++i) narrow[std::size_t(i)] = floatToBf16(t.data[i]);
    put(narrow.data(), narrow.size() * sizeof(std::uint16_t));
  }
  if (std::fclose(f.release()) != 0)
    throw Error("closing `" + path + "` failed: " + std::strerror(errno));
}

}  // namespace plm::io::safetensors
