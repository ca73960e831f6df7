// On-disk structures of checkpoint format v1 (docs/format.md is the spec).
// Every file starts with this 64-byte little-endian header; its layout is
// pinned at compile time below and by tests/cpp/format_test.cc.
#pragma once

#include <cstddef>
#include <cstdint>

namespace embedcore::checkpoint {

constexpr char kManifestMagic[8] = {'E', 'C', 'K', 'P', 'M', 'A', 'N', 'I'};
constexpr char kDataMagic[8] = {'E', 'C', 'K', 'P', 'D', 'A', 'T', 'A'};
constexpr uint32_t kByteOrderMark = 0x01020304u;  // reads 04 03 02 01 on disk: little-endian
constexpr uint32_t kHeaderBytes = 64;
constexpr uint64_t kDataOffset = 4096;  // payload starts page-aligned, so serving maps it as is
constexpr uint32_t kBlockBytes = 4u << 20;  // checksum block of data payloads
constexpr uint32_t kMinBlockBytes = 4096, kMaxBlockBytes = 1u << 30;
constexpr uint64_t kMaxManifestBytes = 1ull << 28;  // 256 MiB of JSON is far beyond any real manifest
constexpr uint64_t kMaxGeneration = 999999999999999999ull;  // 18 digits: the most a file name carries
constexpr int64_t kMaxStep = int64_t(1) << 62;  // far from INT64_MAX: counting on from it never overflows
constexpr const char* kManifestName = "MANIFEST";

enum class FileKind : uint8_t { kManifest = 0, kData = 1 };

struct FileHeader {
  char magic[8];            ///< kManifestMagic or kDataMagic
  uint16_t format_major;    ///< 1
  uint16_t format_minor;    ///< the writer's minor version (kFormatMinor)
  uint32_t byte_order;      ///< kByteOrderMark
  uint32_t header_bytes;    ///< 64
  uint8_t kind;             ///< FileKind
  uint8_t dtype;            ///< data: DType code (0 float32, 1 float16, 2 bfloat16, 3 uint8_rowwise); manifest: 0
  uint16_t reserved;        ///< 0
  int64_t rows;             ///< data: rows in this file; manifest: 0
  int64_t cols;             ///< data: columns per row; manifest: 0
  uint64_t payload_offset;  ///< data: 4096; manifest: 64
  uint64_t payload_bytes;   ///< data: rows * RowBytes(dtype, cols); manifest: JSON length
  uint32_t aux;             ///< data: checksum block size; manifest: CRC-32C of the JSON
  uint32_t header_crc32c;   ///< CRC-32C of bytes [0, 60)
};

static_assert(sizeof(FileHeader) == 64, "FileHeader is 64 bytes on disk");
static_assert(offsetof(FileHeader, format_major) == 8);
static_assert(offsetof(FileHeader, byte_order) == 12);
static_assert(offsetof(FileHeader, header_bytes) == 16);
static_assert(offsetof(FileHeader, kind) == 20);
static_assert(offsetof(FileHeader, dtype) == 21);
static_assert(offsetof(FileHeader, rows) == 24);
static_assert(offsetof(FileHeader, cols) == 32);
static_assert(offsetof(FileHeader, payload_offset) == 40);
static_assert(offsetof(FileHeader, payload_bytes) == 48);
static_assert(offsetof(FileHeader, aux) == 56);
static_assert(offsetof(FileHeader, header_crc32c) == 60);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "embedcore checkpoints are little-endian; big-endian hosts need byte swapping here"
#endif

}  // namespace embedcore::checkpoint
