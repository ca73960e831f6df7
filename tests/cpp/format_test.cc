// core/checkpoint/format.h and crc32c.{h,cc}: the on-disk header layout is
// pinned (docs/format.md's table, field by field), and CRC-32C gives the
// standard check values, the same in its hardware and portable forms, at any
// length, alignment and split.
#include <cstddef>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "checkpoint/crc32c.h"
#include "checkpoint/format.h"
#include "embedcore/embedcore.h"
#include "test_util.h"

namespace ck = embedcore::checkpoint;

// The layout of docs/format.md, checked here independently of the
// static_asserts beside the struct.
static_assert(sizeof(ck::FileHeader) == 64, "header is 64 bytes");
static_assert(offsetof(ck::FileHeader, magic) == 0, "magic at 0");
static_assert(offsetof(ck::FileHeader, format_major) == 8, "format_major at 8");
static_assert(offsetof(ck::FileHeader, format_minor) == 10, "format_minor at 10");
static_assert(offsetof(ck::FileHeader, byte_order) == 12, "byte_order at 12");
static_assert(offsetof(ck::FileHeader, header_bytes) == 16, "header_bytes at 16");
static_assert(offsetof(ck::FileHeader, kind) == 20, "kind at 20");
static_assert(offsetof(ck::FileHeader, dtype) == 21, "dtype at 21");
static_assert(offsetof(ck::FileHeader, reserved) == 22, "reserved at 22");
static_assert(offsetof(ck::FileHeader, rows) == 24, "rows at 24");
static_assert(offsetof(ck::FileHeader, cols) == 32, "cols at 32");
static_assert(offsetof(ck::FileHeader, payload_offset) == 40, "payload_offset at 40");
static_assert(offsetof(ck::FileHeader, payload_bytes) == 48, "payload_bytes at 48");
static_assert(offsetof(ck::FileHeader, aux) == 56, "aux at 56");
static_assert(offsetof(ck::FileHeader, header_crc32c) == 60, "header_crc32c at 60");
static_assert(sizeof(ck::FileHeader::magic) == 8 && sizeof(ck::FileHeader::format_major) == 2 &&
                  sizeof(ck::FileHeader::byte_order) == 4 && sizeof(ck::FileHeader::kind) == 1 &&
                  sizeof(ck::FileHeader::rows) == 8 && sizeof(ck::FileHeader::aux) == 4,
              "field sizes as in docs/format.md");

EMBEDCORE_TEST(FormatConstants) {
  EMBEDCORE_EXPECT(std::memcmp(ck::kManifestMagic, "ECKPMANI", 8) == 0);
  EMBEDCORE_EXPECT(std::memcmp(ck::kDataMagic, "ECKPDATA", 8) == 0);
  EMBEDCORE_EXPECT_EQ(embedcore::kFormatMajor, 1);
  // 1.1: adagrad_epsilon; 1.2: col_start; 1.3: rowwise_adagrad; 1.4: the uint8_rowwise data file dtype;
  // 1.5: config.padding_idx
  EMBEDCORE_EXPECT_EQ(embedcore::kFormatMinor, 5);
  EMBEDCORE_EXPECT_EQ(int(embedcore::DType::kUInt8Rowwise), 3);  // the header's dtype code
  EMBEDCORE_EXPECT_EQ(embedcore::RowBytes(embedcore::DType::kUInt8Rowwise, 5), uint64_t(13));  // codes, scale, bias
  EMBEDCORE_EXPECT_EQ(embedcore::RowBytes(embedcore::DType::kFloat16, 5), uint64_t(10));
  EMBEDCORE_EXPECT_EQ(ck::kHeaderBytes, 64u);
  EMBEDCORE_EXPECT_EQ(ck::kDataOffset, uint64_t(4096));
  EMBEDCORE_EXPECT_EQ(ck::kBlockBytes, 4u << 20);
  EMBEDCORE_EXPECT_EQ(std::string(ck::kManifestName), std::string("MANIFEST"));
  // The byte order mark reads 04 03 02 01 on disk (little-endian).
  const uint32_t bom = ck::kByteOrderMark;
  unsigned char bytes[4];
  std::memcpy(bytes, &bom, 4);
  EMBEDCORE_EXPECT(bytes[0] == 4 && bytes[1] == 3 && bytes[2] == 2 && bytes[3] == 1);
  // DType codes of the header's dtype byte.
  EMBEDCORE_EXPECT_EQ(int(embedcore::DType::kFloat32), 0);
  EMBEDCORE_EXPECT_EQ(int(embedcore::DType::kFloat16), 1);
  EMBEDCORE_EXPECT_EQ(int(embedcore::DType::kBFloat16), 2);
  EMBEDCORE_EXPECT_EQ(int(ck::FileKind::kManifest), 0);
  EMBEDCORE_EXPECT_EQ(int(ck::FileKind::kData), 1);
}

EMBEDCORE_TEST(Crc32cKnownValues) {
  // The check value of the Castagnoli CRC, and RFC 3720 (iSCSI) vectors.
  const char* check = "123456789";
  EMBEDCORE_EXPECT_EQ(ck::Crc32c(check, 9), 0xE3069283u);
  EMBEDCORE_EXPECT_EQ(ck::Crc32cPortable(check, 9), 0xE3069283u);
  EMBEDCORE_EXPECT_EQ(ck::Crc32c("", 0), 0u);
  std::vector<unsigned char> zeros(32, 0), ones(32, 0xff), inc(32), dec(32);
  for (int i = 0; i < 32; ++i) {
    inc[size_t(i)] = uint8_t(i);
    dec[size_t(i)] = uint8_t(31 - i);
  }
  EMBEDCORE_EXPECT_EQ(ck::Crc32c(zeros.data(), 32), 0x8A9136AAu);
  EMBEDCORE_EXPECT_EQ(ck::Crc32c(ones.data(), 32), 0x62A8AB43u);
  EMBEDCORE_EXPECT_EQ(ck::Crc32c(inc.data(), 32), 0x46DD794Eu);
  EMBEDCORE_EXPECT_EQ(ck::Crc32c(dec.data(), 32), 0x113FDB5Cu);
  EMBEDCORE_EXPECT_EQ(ck::Crc32cPortable(zeros.data(), 32), 0x8A9136AAu);
  EMBEDCORE_EXPECT_EQ(ck::Crc32cPortable(dec.data(), 32), 0x113FDB5Cu);
  // The public one (embedcore.h), continuing a CRC over pieces.
  EMBEDCORE_EXPECT_EQ(embedcore::Crc32c(check, 9), 0xE3069283u);
  EMBEDCORE_EXPECT_EQ(embedcore::Crc32c(check + 4, 5, embedcore::Crc32c(check, 4)), 0xE3069283u);
}

EMBEDCORE_TEST(Crc32cHardwareEqualsPortable) {
  std::mt19937 rng(3);
  std::vector<unsigned char> data(70000);
  for (auto& c : data) c = uint8_t(rng());
  // Every length up to 300 at every alignment up to 8, then some long ones.
  for (size_t offset = 0; offset < 8; ++offset)
    for (size_t n = 0; n < 300; ++n)
      EMBEDCORE_EXPECT_EQ(ck::Crc32c(data.data() + offset, n), ck::Crc32cPortable(data.data() + offset, n));
  for (size_t n : {size_t(4095), size_t(4096), size_t(65537), size_t(69990)})
    EMBEDCORE_EXPECT_EQ(ck::Crc32c(data.data() + 3, n), ck::Crc32cPortable(data.data() + 3, n));
  // Around the three-lane path's stride (3 x 4096 bytes), from a running checksum too.
  for (size_t n : {size_t(12287), size_t(12288), size_t(12289), size_t(24576), size_t(24583), size_t(36871)})
    for (uint32_t start : {0u, 0xdeadbeefu})
      EMBEDCORE_EXPECT_EQ(ck::Crc32c(data.data() + 1, n, start), ck::Crc32cPortable(data.data() + 1, n, start));
}

EMBEDCORE_TEST(Crc32cExtends) {
  // crc(a + b) == crc(b, crc(a)), for any split, in both forms.
  std::mt19937 rng(4);
  std::vector<unsigned char> data(1000);
  for (auto& c : data) c = uint8_t(rng());
  const uint32_t whole = ck::Crc32c(data.data(), data.size());
  for (size_t split : {size_t(0), size_t(1), size_t(7), size_t(8), size_t(500), size_t(999), size_t(1000)}) {
    EMBEDCORE_EXPECT_EQ(ck::Crc32c(data.data() + split, data.size() - split, ck::Crc32c(data.data(), split)), whole);
    EMBEDCORE_EXPECT_EQ(
        ck::Crc32cPortable(data.data() + split, data.size() - split, ck::Crc32cPortable(data.data(), split)), whole);
  }
}

EMBEDCORE_TEST(Crc32cDetectsEveryOneBitFlip) {
  std::vector<unsigned char> data(256);
  for (size_t i = 0; i < data.size(); ++i) data[i] = uint8_t(i * 7);
  const uint32_t good = ck::Crc32c(data.data(), data.size());
  int64_t missed = 0;
  for (size_t i = 0; i < data.size(); ++i) {
    for (int bit = 0; bit < 8; ++bit) {
      data[i] ^= uint8_t(1 << bit);
      missed += ck::Crc32c(data.data(), data.size()) == good;
      data[i] ^= uint8_t(1 << bit);
    }
  }
  EMBEDCORE_EXPECT_EQ(missed, int64_t(0));
}
