// The safetensors format (Hugging Face): an 8-byte little-endian header length N, N bytes of
// JSON header `{"<name>": {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]}, ...,
// "__metadata__": {"<key>": "<string>"}}`, then the raw little-endian tensor bytes, offsets
// relative to the end of the header.
//
// Design choices: the reader validates the whole header up front the way the reference
// implementation does (known dtypes, byte ranges that match the shapes, tile the data buffer
// exactly with no gaps or overlaps, fit in the file), so a truncated or corrupt file fails with
// one message before any tensor is used.  Tensors are then read one at a time by seeking, so a
// multi-GB file is never held in memory whole.  Floating tensors are widened to fp32 on read
// (F32, F16, BF16, F64); plm writes F32 (its parameters and master weights are fp32) or,
// for a smaller export, BF16 rounded to nearest even.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace plm::io::safetensors {

/// \brief One tensor of a safetensors file, as its header describes it.
struct TensorEntry {
  std::string name;
  std::string dtype;  // "F32", "BF16", "F16", "F64", "I64", ... (as in the file)
  std::vector<std::int64_t> shape;
  std::int64_t begin = 0, end = 0;  // byte range within the data section
  std::int64_t numel() const;
};

/// \brief Bytes per element of a safetensors dtype name; 0 if the name is unknown.
int dtypeSize(const std::string& dtype);

/// \brief bfloat16 / IEEE binary16 bit patterns to fp32 (exact; NaN, infinities and
/// subnormals kept) and fp32 to bfloat16 with round-to-nearest-even.
float bf16ToFloat(std::uint16_t bits);
float f16ToFloat(std::uint16_t bits);
std::uint16_t floatToBf16(float value);

class Reader {
 public:
  /// \brief Opens `path` and validates its header; throws plm::Error naming the file and the
  /// problem (missing, truncated, bad JSON, inconsistent offsets).
  explicit Reader(const std::string& path);

  const std::string& path() const { return path_member; }
  const std::vector<TensorEntry>& tensors() const { return tensors_member; }  // file order
  const std::map<std::string, std::string>& metadata() const { return metadata_member; }
  bool has(const std::string& name) const;
  /// \brief The entry for `name`; throws plm::Error if the file has no such tensor.
  const TensorEntry& tensor(const std::string& name) const;

  /// \brief Reads a floating tensor (F32, F16, BF16, F64), widened (or for F64 rounded) to fp32.
  std::vector<float> readFloat(const std::string& name) const;
  /// \brief readFloat of rows [first_row, first_row + row_count) of dimension 0 only (a rank's
  /// part of a tensor); seeks to them, so nothing else of the tensor is read.
  std::vector<float> readFloatRows(const std::string& name, std::int64_t first_row,
                                   std::int64_t row_count) const;
  /// \brief The raw bytes of a tensor, as stored.
  std::vector<unsigned char> readRaw(const std::string& name) const;

 private:
  std::string path_member;
  std::int64_t data_start_member = 0;  // 8 + header length
  std::vector<TensorEntry> tensors_member;
  std::map<std::string, std::size_t> index_member;
  std::map<std::string, std::string> metadata_member;
};

/// A tensor to write: fp32 data of `shape` (row-major), `numel(shape)` values at `data`.
struct TensorOut {
  std::string name;
  std::vector<std::int64_t> shape;
  const float* data = nullptr;
  std::string dtype;  // "F32" or "BF16"; empty = the file's dtype (write's `dtype`)
};

/// \brief Writes a safetensors file of `dtype` "F32" or "BF16" (fp32 data rounded to nearest
/// even; a tensor's own dtype, if set, wins; tensors in the given order, header padded with spaces
/// to a multiple of 8 bytes so the data is aligned). Throws plm::Error on I/O failure or a
/// duplicate name.
void write(const std::string& path, const std::vector<TensorOut>& tensors,
           const std::map<std::string, std::string>& metadata = {{"format", "pt"}},
           const std::string& dtype = "F32");
/// \brief The data bytes `tensors` take in `dtype` (for splitting a model into shards).
std::int64_t storedBytes(const std::vector<TensorOut>& tensors, const std::string& dtype);

}  // namespace plm::io::safetensors
