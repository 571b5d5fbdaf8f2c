// safetensors: bf16/fp16 decoding against known bit patterns and an independent formula,
// F32 write/read round trips, and the messages for broken files.
#include "core/error.hpp"
#include "io/json.hpp"
#include "io/safetensors.hpp"

#include <gtest/gtest.h>

#include <unistd.h>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

namespace st = plm::io::safetensors;

namespace {

std::string tempPath(const std::string& name) {
  return "test_hf_safetensors_" + std::to_string(::getpid()) + "_" + name;
}

// A safetensors file built by hand: header text and data bytes exactly as given.
void writeRawFile(const std::string& path, const std::string& header,
                  const std::vector<unsigned char>& data) {
  std::ofstream os(path, std::ios::binary | std::ios::trunc);
  std::uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) os.put(char((n >> (8 * i)) & 0xFF));
  os << header;
  os.write(reinterpret_cast<const char*>(data.data()), std::streamsize(data.size()));
}

std::vector<unsigned char> bytesOf16(const std::vector<std::uint16_t>& values) {
  std::vector<unsigned char> out;
  for (auto v : values) {
    out.push_back(v & 0xFF);
    out.push_back(v >> 8);
  }
  return out;
}

std::string errorOf(const std::string& path) {
  try {
    st::Reader reader(path);
  } catch (const plm::Error& e) {
    return e.what();
  }
  return "";
}

// Independent reference for binary16: sign * 2^(e-15) * (1 + m/1024), subnormals 2^-14 * m/1024.
double f16Reference(std::uint16_t bits) {
  const int sign = bits >> 15, exponent = (bits >> 10) & 31, mantissa = bits & 1023;
  double magnitude;
  if (exponent == 31)
    magnitude = mantissa ? std::numeric_limits<double>::quiet_NaN() : INFINITY;
  else if (exponent == 0)
    magnitude = std::ldexp(double(mantissa), -24);
  else
    magnitude = std::ldexp(1024.0 + mantissa, exponent - 25);
  return sign ? -magnitude : magnitude;
}

}  // namespace

TEST(Safetensors, Bf16KnownPatterns) {
  EXPECT_EQ(st::bf16ToFloat(0x3F80), 1.0f);
  EXPECT_EQ(st::bf16ToFloat(0xC000), -2.0f);
  EXPECT_EQ(st::bf16ToFloat(0x4049), 3.140625f);
  EXPECT_EQ(st::bf16ToFloat(0x0001), std::ldexp(1.0f, -133));  // smallest subnormal
  EXPECT_EQ(st::bf16ToFloat(0x7F7F),
            std::ldexp(255.0f, 120));  // largest finite: (2 - 2^-7) * 2^127
  EXPECT_EQ(st::bf16ToFloat(0x7F80), INFINITY);
  EXPECT_EQ(st::bf16ToFloat(0xFF80), -INFINITY);
  EXPECT_TRUE(std::isnan(st::bf16ToFloat(0x7FC0)));
  EXPECT_TRUE(std::signbit(st::bf16ToFloat(0x8000)) && st::bf16ToFloat(0x8000) == 0.0f);
}

TEST(Safetensors, Bf16RoundsToNearestEven) {
  auto bits = [](float f) { return st::floatToBf16(f); };
  EXPECT_EQ(bits(1.0f), 0x3F80);
  EXPECT_EQ(bits(1.0f + std::ldexp(1.0f, -8)), 0x3F80);      // halfway, even below: down
  EXPECT_EQ(bits(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3F82);  // halfway, odd below: up
  EXPECT_EQ(bits(1.0f + std::ldexp(1.0f, -8) + std::ldexp(1.0f, -20)), 0x3F81);  // above halfway
  EXPECT_EQ(bits(-3.140625f), 0xC049);
  EXPECT_EQ(bits(INFINITY), 0x7F80);
  EXPECT_TRUE(std::isnan(st::bf16ToFloat(bits(std::nanf("")))));
  // Every bf16 value survives float -> bf16 -> float.
  for (std::uint32_t b = 0; b < 0x10000; ++b) {
    float f = st::bf16ToFloat(std::uint16_t(b));
    if (std::isnan(f)) continue;
    EXPECT_EQ(st::floatToBf16(f), b);
  }
}

TEST(Safetensors, F16KnownPatterns) {
  EXPECT_EQ(st::f16ToFloat(0x3C00), 1.0f);
  EXPECT_EQ(st::f16ToFloat(0xC000), -2.0f);
  EXPECT_EQ(st::f16ToFloat(0x7BFF), 65504.0f);
  EXPECT_EQ(st::f16ToFloat(0x3555), 0.333251953125f);
  EXPECT_EQ(st::f16ToFloat(0x0400), std::ldexp(1.0f, -14));     // smallest normal
  EXPECT_EQ(st::f16ToFloat(0x0001), std::ldexp(1.0f, -24));     // smallest subnormal
  EXPECT_EQ(st::f16ToFloat(0x03FF), std::ldexp(1023.0f, -24));  // largest subnormal
  EXPECT_EQ(st::f16ToFloat(0x7C00), INFINITY);
  EXPECT_EQ(st::f16ToFloat(0xFC00), -INFINITY);
  EXPECT_TRUE(std::isnan(st::f16ToFloat(0x7E00)));
  EXPECT_TRUE(std::signbit(st::f16ToFloat(0x8000)) && st::f16ToFloat(0x8000) == 0.0f);
}

TEST(Safetensors, F16AllPatternsMatchTheDefinition) {
  for (std::uint32_t b = 0; b < 0x10000; ++b) {
    const double want = f16Reference(std::uint16_t(b));
    const float got = st::f16ToFloat(std::uint16_t(b));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << b;
    } else {
      EXPECT_EQ(double(got), want) << "bits 0x" << std::hex << b;
      EXPECT_EQ(std::signbit(got), std::signbit(want)) << b;
    }
  }
}

TEST(Safetensors, F32WriteReadRoundTrip) {
  const std::string path = tempPath("roundtrip.safetensors");
  std::vector<float> a(6), b(5), scalar{-7.25f};
  for (std::size_t i = 0; i < a.size(); ++i) a[i] = std::ldexp(float(i) - 2.5f, int(i) * 9 - 20);
  for (std::size_t i = 0; i < b.size(); ++i) b[i] = std::nextafter(float(i), 100.0f);
  st::write(path,
            {{"w", {2, 3}, a.data()},
             {"empty", {0, 4}, nullptr},
             {"b", {5}, b.data()},
             {"s", {}, scalar.data()}},
            {{"format", "pt"}, {"note", "x\"y"}});
  st::Reader reader(path);
  ASSERT_EQ(reader.tensors().size(), 4u);
  EXPECT_EQ(reader.tensors()[0].name, "w");  // file order kept
  EXPECT_EQ(reader.metadata().at("format"), "pt");
  EXPECT_EQ(reader.metadata().at("note"), "x\"y");
  EXPECT_EQ(reader.tensor("w").shape, (std::vector<std::int64_t>{2, 3}));
  EXPECT_EQ(reader.tensor("w").dtype, "F32");
  EXPECT_EQ(reader.readFloat("w"), a);
  EXPECT_EQ(reader.readFloat("b"), b);
  EXPECT_TRUE(reader.readFloat("empty").empty());
  EXPECT_EQ(reader.readFloat("s"), scalar);
  EXPECT_FALSE(reader.has("nope"));
  EXPECT_THROW(reader.tensor("nope"), plm::Error);

  // The header is padded so the data starts 8-byte aligned.
  std::ifstream in(path, std::ios::binary);
  unsigned char length[8];
  in.read(reinterpret_cast<char*>(length), 8);
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | length[i];
  EXPECT_EQ(n % 8, 0u);
  std::remove(path.c_str());

  EXPECT_THROW(st::write(path, {{"x", {1}, scalar.data()}, {"x", {1}, scalar.data()}}), plm::Error);
  std::remove(path.c_str());
}

TEST(Safetensors, ReadsBf16F16AndF64) {
  const std::string path = tempPath("mixed.safetensors");
  std::vector<unsigned char> data =
      bytesOf16({0x3F80, 0xC049, 0x0001});          // bf16: 1, -3.140625, 2^-133
  auto half = bytesOf16({0x3C00, 0x0001, 0xFBFF});  // f16: 1, 2^-24, -65504
  data.insert(data.end(), half.begin(), half.end());
  double d[2] = {0.1, -1e300};
  const unsigned char* p = reinterpret_cast<const unsigned char*>(d);
  data.insert(data.end(), p, p + 16);
  std::vector<unsigned char> ids(16, 0);  // an I64 tensor (like position_ids)
  data.insert(data.end(), ids.begin(), ids.end());
  writeRawFile(path,
               R"({"a":{"dtype":"BF16","shape":[3],"data_offsets":[0,6]},)"
               R"("h":{"dtype":"F16","shape":[1,3],"data_offsets":[6,12]},)"
               R"("d":{"dtype":"F64","shape":[2],"data_offsets":[12,28]},)"
               R"("i":{"dtype":"I64","shape":[2],"data_offsets":[28,44]}})",
               data);
  st::Reader reader(path);
  EXPECT_EQ(reader.readFloat("a"), (std::vector<float>{1.0f, -3.140625f, std::ldexp(1.0f, -133)}));
  EXPECT_EQ(reader.readFloat("h"), (std::vector<float>{1.0f, std::ldexp(1.0f, -24), -65504.0f}));
  auto dd = reader.readFloat("d");
  EXPECT_EQ(dd[0], 0.1f);
  EXPECT_EQ(dd[1], -INFINITY);  // out of fp32 range
  try {
    reader.readFloat("i");
    FAIL();
  } catch (const plm::Error& e) {
    EXPECT_NE(std::string(e.what()).find("dtype I64"), std::string::npos) << e.what();
  }
  EXPECT_EQ(reader.readRaw("i").size(), 16u);
  std::remove(path.c_str());
}

TEST(Safetensors, BrokenFilesSayWhatIsWrong) {
  const std::string path = tempPath("bad.safetensors");
  auto expectError = [&](const std::string& header, std::vector<unsigned char> data,
                         const std::string& words) {
    writeRawFile(path, header, data);
    std::string message = errorOf(path);
    EXPECT_NE(message.find(words), std::string::npos)
        << "header " << header << "\nmessage: " << message;
    EXPECT_NE(message.find(path), std::string::npos) << message;
  };
  std::vector<unsigned char> eight(8, 0);
  const std::string good = R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  expectError(good, {0, 0, 0, 0}, "truncated");                      // data cut short
  expectError(good, std::vector<unsigned char>(12, 0), "trailing");  // extra bytes
  expectError(R"({"x":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", eight,
              "shape and dtype need 12");
  expectError(R"({"x":{"dtype":"Q7","shape":[2],"data_offsets":[0,8]}})", eight, "unknown dtype");
  expectError(R"({"x":{"dtype":"F32","shape":[2]}})", eight, "data_offsets");
  expectError(R"({"x":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", eight, "non-negative");
  expectError(R"({"x":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
              R"("y":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})",
              eight, "overlapping or gapped");
  expectError(R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},})", eight,
              "byte");  // bad JSON
  expectError(R"(["x"])", eight, "not a JSON object");

  // Header length beyond the file.
  {
    std::ofstream os(path, std::ios::binary | std::ios::trunc);
    unsigned char length[8] = {0xFF, 0xFF, 0, 0, 0, 0, 0, 0};
    os.write(reinterpret_cast<const char*>(length), 8);
    os << "{}";
  }
  EXPECT_NE(errorOf(path).find("exceeds the file size"), std::string::npos) << errorOf(path);
  {
    std::ofstream os(path, std::ios::binary | std::ios::trunc);
    os << "abc";
  }
  EXPECT_NE(errorOf(path).find("not a safetensors file"), std::string::npos) << errorOf(path);
  std::remove(path.c_str());
  EXPECT_NE(errorOf(path).find("does not exist"), std::string::npos) << errorOf(path);
}
