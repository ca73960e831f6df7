#include "crc32c.h"

#include <cstring>

#if defined(__x86_64__) && defined(__GNUC__)
#include <nmmintrin.h>
#endif

namespace embedcore::checkpoint {
namespace {

constexpr uint32_t kPoly = 0x82f63b78u;  // reflected Castagnoli polynomial

struct Tables {
  uint32_t t[8][256];
  Tables() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (kPoly & (0u - (c & 1u)));
      t[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; ++i)
      for (int s = 1; s < 8; ++s) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xffu];
  }
};

const Tables& GetTables() {
  static const Tables tables;
  return tables;
}

#if defined(__x86_64__) && defined(__GNUC__)
// The crc32 instruction takes 3 cycles but can start one per cycle, so one
// dependent chain uses a third of it. Long inputs therefore run three chains
// at once over three adjacent lanes of kLane bytes, then join them. The CRC
// register is linear over GF(2): running it from state r over n bytes gives
// Shift(r, n) ^ (the run from 0 over the same bytes), where Shift(r, n)
// advances r over n zero bytes. So lanes A|B|C join as
// Shift(Shift(a, kLane) ^ b, kLane) ^ c, and Shift(., kLane), linear too, is
// four table lookups (one per byte of r) built once from its values on the
// 32 basis vectors.
constexpr size_t kLane = 4096;

__attribute__((target("sse4.2"))) uint64_t RunZeros(uint64_t c, size_t n) {
  for (size_t i = 0; i < n; i += 8) c = _mm_crc32_u64(c, 0);
  return c;
}

struct LaneShift {
  uint32_t t[4][256];
  LaneShift() {
    uint32_t basis[32];
    for (int bit = 0; bit < 32; ++bit) basis[bit] = uint32_t(RunZeros(uint64_t(1) << bit, kLane));
    for (int byte = 0; byte < 4; ++byte)
      for (uint32_t v = 0; v < 256; ++v) {
        uint32_t r = 0;
        for (int bit = 0; bit < 8; ++bit)
          if (v & (1u << bit)) r ^= basis[8 * byte + bit];
        t[byte][v] = r;
      }
  }
  uint32_t operator()(uint32_t r) const {
    return t[0][r & 0xff] ^ t[1][(r >> 8) & 0xff] ^ t[2][(r >> 16) & 0xff] ^ t[3][r >> 24];
  }
};

const LaneShift& GetLaneShift() {
  static const LaneShift shift;
  return shift;
}

__attribute__((target("sse4.2"))) uint32_t Crc32cHardware(const void* data, size_t n, uint32_t crc) {
  const unsigned char* p = static_cast<const unsigned char*>(data);
  uint64_t c = ~crc;
  if (n >= 3 * kLane) {
    const LaneShift& shift = GetLaneShift();
    do {
      uint64_t c1 = 0, c2 = 0;
      for (size_t i = 0; i < kLane; i += 8) {
        uint64_t v0, v1, v2;
        std::memcpy(&v0, p + i, 8);
        std::memcpy(&v1, p + kLane + i, 8);
        std::memcpy(&v2, p + 2 * kLane + i, 8);
        c = _mm_crc32_u64(c, v0);
        c1 = _mm_crc32_u64(c1, v1);
        c2 = _mm_crc32_u64(c2, v2);
      }
      c = shift(shift(uint32_t(c)) ^ uint32_t(c1)) ^ uint32_t(c2);
      p += 3 * kLane;
      n -= 3 * kLane;
    } while (n >= 3 * kLane);
  }
  while (n >= 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    c = _mm_crc32_u64(c, v);
    p += 8;
    n -= 8;
  }
  uint32_t c32 = uint32_t(c);
  while (n--) c32 = _mm_crc32_u8(c32, *p++);
  return ~c32;
}

bool HaveSse42() {
  static const bool have = __builtin_cpu_supports("sse4.2");
  return have;
}
#endif

}  // namespace

uint32_t Crc32cPortable(const void* data, size_t n, uint32_t crc) {
  const Tables& t = GetTables();
  const unsigned char* p = static_cast<const unsigned char*>(data);
  uint32_t c = ~crc;
  while (n >= 8) {
    uint32_t lo, hi;
    std::memcpy(&lo, p, 4);
    std::memcpy(&hi, p + 4, 4);
    lo ^= c;  // little-endian load, as the checksum is defined over bytes
    c = t.t[7][lo & 0xff] ^ t.t[6][(lo >> 8) & 0xff] ^ t.t[5][(lo >> 16) & 0xff] ^ t.t[4][lo >> 24] ^
        t.t[3][hi & 0xff] ^ t.t[2][(hi >> 8) & 0xff] ^ t.t[1][(hi >> 16) & 0xff] ^ t.t[0][hi >> 24];
    p += 8;
    n -= 8;
  }
  while (n--) c = (c >> 8) ^ t.t[0][(c ^ *p++) & 0xff];
  return ~c;
}

uint32_t Crc32c(const void* data, size_t n, uint32_t crc) {
#if defined(__x86_64__) && defined(__GNUC__)
  if (HaveSse42()) return Crc32cHardware(data, n, crc);
#endif
  return Crc32cPortable(data, n, crc);
}

}  // namespace embedcore::checkpoint
