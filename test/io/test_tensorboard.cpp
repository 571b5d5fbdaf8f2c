// TensorBoard event files (io/tensorboard.hpp): CRC-32C against its published check values,
// the TFRecord framing and its masked CRCs read back field by field, and the protobuf bytes of a
// scalar Event against a hand encoding.  test_train_metrics writes a real run's events, and
// validation/tb_read.py reads them back with the tensorboard package where it is installed.
#include "io/tensorboard.hpp"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <string>

namespace {

using namespace plm::io::tensorboard;

std::uint32_t u32(const std::string& s, std::size_t at) {
  std::uint32_t v = 0;
  std::memcpy(&v, s.data() + at, 4);
  return v;
}

TEST(Crc32c, PublishedCheckValues) {
  EXPECT_EQ(crc32c("", 0), 0u);
  EXPECT_EQ(crc32c("123456789", 9), 0xE3069283u);  // the CRC catalogue's check value
  // RFC 3720 (iSCSI) B.4: 32 bytes of zeros, of 0xff, ascending and descending.
  unsigned char b[32];
  std::memset(b, 0, 32);
  EXPECT_EQ(crc32c(b, 32), 0x8A9136AAu);
  std::memset(b, 0xff, 32);
  EXPECT_EQ(crc32c(b, 32), 0x62A8AB43u);
  for (int i = 0; i < 32; ++i) b[i] = static_cast<unsigned char>(i);
  EXPECT_EQ(crc32c(b, 32), 0x46DD794Eu);
  for (int i = 0; i < 32; ++i) b[i] = static_cast<unsigned char>(31 - i);
  EXPECT_EQ(crc32c(b, 32), 0x113FDB5Cu);
  // Continuing a CRC over a second piece equals the CRC of the whole.
  EXPECT_EQ(crc32c("56789", 5, crc32c("1234", 4)), 0xE3069283u);
}

TEST(Crc32c, MaskIsTfRecords) {
  const std::uint32_t crc = crc32c("123456789", 9);
  EXPECT_EQ(maskedCrc32c("123456789", 9), ((crc >> 15) | (crc << 17)) + 0xa282ead8u);
}

TEST(TfRecord, FramingReadsBack) {
  for (const std::string payload : {std::string(), std::string("x"), std::string(300, '\7')}) {
    const std::string r = tfRecord(payload);
    ASSERT_EQ(r.size(), 8 + 4 + payload.size() + 4);
    std::uint64_t length = 0;
    std::memcpy(&length, r.data(), 8);
    EXPECT_EQ(length, payload.size());
    EXPECT_EQ(u32(r, 8), maskedCrc32c(r.data(), 8));
    EXPECT_EQ(r.substr(12, payload.size()), payload);
    EXPECT_EQ(u32(r, 12 + payload.size()), maskedCrc32c(payload.data(), payload.size()));
  }
  // A flipped payload bit no longer matches the stored CRC.
  std::string r = tfRecord("abc");
  r[13] ^= 1;
  EXPECT_NE(u32(r, 15), maskedCrc32c(r.data() + 12, 3));
}

TEST(Event, ScalarBytesAsProtobufEncodesThem) {
  // Event{wall_time: 1.5, step: 300, summary{value{tag: "a", simple_value: 2}}}.
  const std::string e = scalarEvent(1.5, 300, {{"a", 2.0}});
  const unsigned char want[] = {0x09, 0,    0,    0,    0,
                                0,    0,    0xF8, 0x3F,         // field 1, fixed64: 1.5
                                0x10, 0xAC, 0x02,               // field 2, varint: 300
                                0x2A, 10,                       // field 5, 10 bytes: Summary
                                0x0A, 8,                        //   field 1, 8 bytes: Summary.Value
                                0x0A, 1,    'a',                //     tag "a"
                                0x15, 0,    0,    0,    0x40};  //     field 2, fixed32: 2.0f
  ASSERT_EQ(e.size(), sizeof want);
  EXPECT_EQ(std::memcmp(e.data(), want, sizeof want), 0);
  const std::string v = versionEvent(0.0);
  EXPECT_NE(v.find("\x1a\x0d"
                   "brain.Event:2"),
            std::string::npos);
}

}  // namespace
