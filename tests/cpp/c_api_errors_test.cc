// core/c_api/c_api.cc: bad input through the C ABI. Null pointers, ids out of
// range, offsets that do not fit, misaligned arrays, output buffers that are
// too small, unknown enums and options, and checkpoints that are missing,
// truncated, corrupt or of a newer format: each returns its status with a
// message that says what is wrong, never crashes, and never writes to the
// caller's buffer (outputs here are heap blocks of the exact size, so
// AddressSanitizer sees any write past them).
#include <pthread.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "c_api_fixtures.h"
#include "checkpoint/crc32c.h"
#include "checkpoint/format.h"

using namespace c_api_test;

namespace {

struct Served {
  TempDir dir;
  embedcore_checkpoint* h = nullptr;
  Served() {
    SaveModel(dir.Sub("m"));
    if (embedcore_open(dir.Sub("m").c_str(), nullptr, &h) != EMBEDCORE_OK)
      throw std::runtime_error(embedcore_last_error());
  }
  ~Served() { embedcore_close(h); }
};

// A heap output of exactly n floats filled with a canary, to check that a
// failed call wrote nothing.
struct Canary {
  std::unique_ptr<float[]> data;
  int64_t n;
  explicit Canary(int64_t count) : data(new float[size_t(count > 0 ? count : 1)]), n(count) {
    for (int64_t i = 0; i < n; ++i) data[size_t(i)] = -12345.0f;
  }
  bool Untouched() const {
    for (int64_t i = 0; i < n; ++i)
      if (data[size_t(i)] != -12345.0f) return false;
    return true;
  }
};

// user (table 0): 50 rows x 16.
OwnedBatch Good() {
  OwnedBatch b;
  b.ids = {1, 2, 3, 49};
  b.ids32 = {1, 2, 3, 49};
  b.offsets = {0, 2, 4};
  b.weights = {1, 1, 1, 1};
  return b;
}

std::string Open(const std::string& path, const char* options, int* status) {
  embedcore_checkpoint* h = nullptr;
  *status = embedcore_open(path.c_str(), options, &h);
  const std::string message = *status == EMBEDCORE_OK ? "" : embedcore_last_error();
  if (*status != EMBEDCORE_OK) EMBEDCORE_EXPECT(h == nullptr);  // out is untouched on error
  embedcore_close(h);
  return message;
}

#define EXPECT_OPEN_ERROR(path, options, want_status, want_text)                                         \
  do {                                                                                                    \
    int s_ = -1;                                                                                          \
    const std::string m_ = Open(path, options, &s_);                                                      \
    EMBEDCORE_EXPECT_MSG(s_ == (want_status), "open returned " << s_ << " (" << m_ << "), expected " #want_status); \
    EMBEDCORE_EXPECT_MSG(m_.find(want_text) != std::string::npos,                                        \
                         "message \"" << m_ << "\" lacks \"" << (want_text) << "\"");                     \
  } while (0)

}  // namespace

EMBEDCORE_TEST(NullPointers) {
  Served s;
  embedcore_checkpoint* h = nullptr;
  EXPECT_C_ERROR(embedcore_open(nullptr, nullptr, &h), EMBEDCORE_INVALID_ARGUMENT, "embedcore_open: path: null pointer");
  EXPECT_C_ERROR(embedcore_open(s.dir.Sub("m").c_str(), nullptr, nullptr), EMBEDCORE_INVALID_ARGUMENT,
                 "out: null pointer");
  EMBEDCORE_EXPECT(h == nullptr);
  EXPECT_C_ERROR(embedcore_build_info(nullptr), EMBEDCORE_INVALID_ARGUMENT, "out_json: null pointer");
  EXPECT_C_ERROR(embedcore_get_num_threads(nullptr), EMBEDCORE_INVALID_ARGUMENT, "out: null pointer");
  int64_t n = 0;
  uint64_t g = 0;
  embedcore_table_info ti;
  embedcore_feature_info fi;
  EXPECT_C_ERROR(embedcore_num_tables(nullptr, &n), EMBEDCORE_INVALID_ARGUMENT, "ckpt: null pointer");
  EXPECT_C_ERROR(embedcore_num_tables(s.h, nullptr), EMBEDCORE_INVALID_ARGUMENT, "out: null pointer");
  EXPECT_C_ERROR(embedcore_num_features(nullptr, &n), EMBEDCORE_INVALID_ARGUMENT, "ckpt: null pointer");
  EXPECT_C_ERROR(embedcore_num_features(s.h, nullptr), EMBEDCORE_INVALID_ARGUMENT, "out: null pointer");
  EXPECT_C_ERROR(embedcore_checkpoint_generation(nullptr, &g), EMBEDCORE_INVALID_ARGUMENT, "ckpt: null pointer");
  EXPECT_C_ERROR(embedcore_checkpoint_generation(s.h, nullptr), EMBEDCORE_INVALID_ARGUMENT, "out: null pointer");
  EXPECT_C_ERROR(embedcore_describe_table(nullptr, 0, &ti), EMBEDCORE_INVALID_ARGUMENT, "ckpt: null pointer");
  EXPECT_C_ERROR(embedcore_describe_table(s.h, 0, nullptr), EMBEDCORE_INVALID_ARGUMENT, "out: null pointer");
  EXPECT_C_ERROR(embedcore_describe_feature(nullptr, 0, &fi), EMBEDCORE_INVALID_ARGUMENT, "ckpt: null pointer");
  EXPECT_C_ERROR(embedcore_describe_feature(s.h, 0, nullptr), EMBEDCORE_INVALID_ARGUMENT, "out: null pointer");
  EXPECT_C_ERROR(embedcore_find_table(s.h, nullptr, &n), EMBEDCORE_INVALID_ARGUMENT, "name: null pointer");
  EXPECT_C_ERROR(embedcore_find_table(s.h, "user", nullptr), EMBEDCORE_INVALID_ARGUMENT, "out: null pointer");
  EXPECT_C_ERROR(embedcore_find_feature(s.h, nullptr, &n), EMBEDCORE_INVALID_ARGUMENT, "name: null pointer");
  EXPECT_C_ERROR(embedcore_reload(nullptr, nullptr, nullptr), EMBEDCORE_INVALID_ARGUMENT, "ckpt: null pointer");
  // An empty path names no directory (it used to read "embedcore_open: : no such checkpoint directory").
  EXPECT_C_ERROR(embedcore_open("", nullptr, &h), EMBEDCORE_INVALID_ARGUMENT,
                 "embedcore_open: path: empty string (a checkpoint directory is required)");
  EMBEDCORE_EXPECT(h == nullptr);
  EXPECT_C_ERROR(embedcore_reload(s.h, "", nullptr), EMBEDCORE_INVALID_ARGUMENT, "embedcore_reload: path: empty string");
  EXPECT_C_OK(embedcore_close(nullptr));

  const OwnedBatch good = Good();
  const embedcore_batch c = good.C();
  Canary out(2 * 16);
  EXPECT_C_ERROR(embedcore_lookup(nullptr, 0, &c, EMBEDCORE_COMBINER_SUM, 0, out.data.get(), out.n),
                 EMBEDCORE_INVALID_ARGUMENT, "ckpt: null pointer");
  EXPECT_C_ERROR(embedcore_lookup(s.h, 0, nullptr, EMBEDCORE_COMBINER_SUM, 0, out.data.get(), out.n),
                 EMBEDCORE_INVALID_ARGUMENT, "batch: null pointer");
  EXPECT_C_ERROR(embedcore_lookup(s.h, 0, &c, EMBEDCORE_COMBINER_SUM, 0, nullptr, out.n), EMBEDCORE_INVALID_ARGUMENT,
                 "embedcore_lookup: out: null pointer");
  embedcore_batch no_ids = c;
  no_ids.ids = nullptr;
  EXPECT_C_ERROR(embedcore_lookup(s.h, 0, &no_ids, EMBEDCORE_COMBINER_SUM, 0, out.data.get(), out.n),
                 EMBEDCORE_INVALID_ARGUMENT, "batch.ids: null pointer");
  embedcore_batch no_offsets = c;
  no_offsets.offsets = nullptr;
  EXPECT_C_ERROR(embedcore_lookup(s.h, 0, &no_offsets, EMBEDCORE_COMBINER_SUM, 0, out.data.get(), out.n),
                 EMBEDCORE_INVALID_ARGUMENT, "batch.offsets: null pointer");
  EXPECT_C_ERROR(embedcore_lookup_feature(s.h, 0, nullptr, out.data.get(), out.n), EMBEDCORE_INVALID_ARGUMENT,
                 "batch: null pointer");
  EXPECT_C_ERROR(embedcore_lookup_feature(s.h, 0, &c, nullptr, out.n), EMBEDCORE_INVALID_ARGUMENT, "out: null pointer");
  EXPECT_C_ERROR(embedcore_lookup_size(s.h, 0, nullptr, EMBEDCORE_COMBINER_SUM, 0, &n), EMBEDCORE_INVALID_ARGUMENT,
                 "batch: null pointer");
  EXPECT_C_ERROR(embedcore_lookup_size(s.h, 0, &c, EMBEDCORE_COMBINER_SUM, 0, nullptr), EMBEDCORE_INVALID_ARGUMENT,
                 "out: null pointer");
  EMBEDCORE_EXPECT(out.Untouched());
}

EMBEDCORE_TEST(IdsOutOfRange) {
  Served s;
  for (int int32 = 0; int32 < 2; ++int32) {
    for (int64_t bad : {int64_t(50), int64_t(-1), int64_t(1000000), int64_t(-2147483648LL)}) {
      OwnedBatch b = Good();
      b.ids[2] = bad;
      b.ids32[2] = int32_t(bad);
      const embedcore_batch c = b.C(false, int32);
      Canary out(2 * 16);
      EXPECT_C_ERROR(embedcore_lookup(s.h, 0, &c, EMBEDCORE_COMBINER_SUM, 0, out.data.get(), out.n),
                     EMBEDCORE_OUT_OF_RANGE,
                     "table 'user': id " + std::to_string(bad) + " at position 2 of ids is out of range [0, 50)");
      EMBEDCORE_EXPECT(out.Untouched());
      Canary seq(4 * 16);
      EXPECT_C_ERROR(embedcore_lookup(s.h, 0, &c, EMBEDCORE_COMBINER_NONE, 0, seq.data.get(), seq.n),
                     EMBEDCORE_OUT_OF_RANGE, "out of range [0, 50)");
      EMBEDCORE_EXPECT(seq.Untouched());
      Canary feature(2 * 16);  // feature 0 reads user
      EXPECT_C_ERROR(embedcore_lookup_feature(s.h, 0, &c, feature.data.get(), feature.n), EMBEDCORE_OUT_OF_RANGE,
                     "out of range [0, 50)");
      EMBEDCORE_EXPECT(feature.Untouched());
    }
  }
}

EMBEDCORE_TEST(OffsetsThatDoNotFit) {
  Served s;
  struct Case {
    std::vector<int64_t> offsets;
    const char* message;
  } cases[] = {
      {{1, 2, 4}, "offsets[0] must be 0, got 1"},
      {{0, 3, 2, 4}, "offsets must be non-decreasing: offsets[1] = 3 > offsets[2] = 2"},
      {{0, 2, 3}, "offsets must end at the number of ids, 4, got offsets[2] = 3"},
      {{0, 2, 5}, "offsets must end at the number of ids, 4, got offsets[2] = 5"},
      {{0, -1, 4}, "non-decreasing"},
      {{0, 9, 4}, "non-decreasing"},
  };
  for (const Case& k : cases) {
    OwnedBatch b = Good();
    b.offsets = k.offsets;
    const embedcore_batch c = b.C();
    Canary out(c.num_bags * 16);
    EXPECT_C_ERROR(embedcore_lookup(s.h, 0, &c, EMBEDCORE_COMBINER_SUM, 0, out.data.get(), out.n),
                   EMBEDCORE_INVALID_ARGUMENT, k.message);
    EMBEDCORE_EXPECT(out.Untouched());
    // Sequences read the offsets too.
    Canary seq(c.num_bags * 3 * 16);
    EXPECT_C_ERROR(embedcore_lookup(s.h, 0, &c, EMBEDCORE_COMBINER_NONE, 3, seq.data.get(), seq.n),
                   EMBEDCORE_INVALID_ARGUMENT, k.message);
    EMBEDCORE_EXPECT(seq.Untouched());
  }
  // Counts that are negative or do not fit.
  const OwnedBatch good = Good();
  Canary out(2 * 16);
  embedcore_batch c = good.C();
  c.nnz = -1;
  EXPECT_C_ERROR(embedcore_lookup(s.h, 0, &c, EMBEDCORE_COMBINER_SUM, 0, out.data.get(), out.n),
                 EMBEDCORE_INVALID_ARGUMENT, "batch.nnz must be >= 0, got -1");
  c = good.C();
  c.num_bags = -3;
  EXPECT_C_ERROR(embedcore_lookup(s.h, 0, &c, EMBEDCORE_COMBINER_SUM, 0, out.data.get(), out.n),
                 EMBEDCORE_INVALID_ARGUMENT, "batch.num_bags must be >= 0, got -3");
  // An output that does not fit in int64: refused before any offset is read.
  c = good.C();
  c.num_bags = int64_t(1) << 40;
  EXPECT_C_ERROR(embedcore_lookup(s.h, 0, &c, EMBEDCORE_COMBINER_NONE, int64_t(1) << 30, out.data.get(), out.n),
                 EMBEDCORE_INVALID_ARGUMENT, "overflows int64");
  c.num_bags = int64_t(1) << 60;
  EXPECT_C_ERROR(embedcore_lookup(s.h, 0, &c, EMBEDCORE_COMBINER_SUM, 0, out.data.get(), out.n),
                 EMBEDCORE_INVALID_ARGUMENT, "overflows int64");
  int64_t n = 0;
  EXPECT_C_ERROR(embedcore_lookup_size(s.h, 0, &c, EMBEDCORE_COMBINER_SUM, 0, &n), EMBEDCORE_INVALID_ARGUMENT,
                 "overflows int64");
  // Counts whose arrays cannot exist, even for an unpooled lookup, whose
  // output does not depend on num_bags: refused before any pointer is
  // computed from them (offsets + num_bags + 1 overflowed, or wrapped round
  // into the array, and the offsets were read far past their end).
  Canary rows(4 * 16);  // room for the unpooled output, [nnz, dim]
  for (const int64_t bags : {INT64_MAX, int64_t(1) << 61, INT64_MAX / 8}) {
    c = good.C();
    c.num_bags = bags;
    const std::string what = "batch.num_bags = " + std::to_string(bags) + " is a size that overflows int64";
    EXPECT_C_ERROR(embedcore_lookup(s.h, 0, &c, EMBEDCORE_COMBINER_NONE, 0, rows.data.get(), rows.n),
                   EMBEDCORE_INVALID_ARGUMENT, what);
    EXPECT_C_ERROR(embedcore_lookup_feature(s.h, 0, &c, out.data.get(), out.n), EMBEDCORE_INVALID_ARGUMENT, what);
    EXPECT_C_ERROR(embedcore_lookup_size(s.h, 0, &c, EMBEDCORE_COMBINER_NONE, 0, &n), EMBEDCORE_INVALID_ARGUMENT,
                   what);
    c = good.C();
    c.nnz = bags;
    EXPECT_C_ERROR(embedcore_lookup(s.h, 0, &c, EMBEDCORE_COMBINER_SUM, 0, out.data.get(), out.n),
                   EMBEDCORE_INVALID_ARGUMENT, "batch.nnz = " + std::to_string(bags) + " is a size that overflows");
  }
  // An output whose floats fit in int64 but whose bytes do not.
  c = good.C();
  c.nnz = int64_t(1) << 58;  // x 16 (user's dim) = 2^62 floats, 2^64 bytes
  EXPECT_C_ERROR(embedcore_lookup_size(s.h, 0, &c, EMBEDCORE_COMBINER_NONE, 0, &n), EMBEDCORE_INVALID_ARGUMENT,
                 "output bytes (floats x 4): 4611686018427387904 x 4 overflows int64");
  EMBEDCORE_EXPECT(out.Untouched() && rows.Untouched());
}

EMBEDCORE_TEST(OutputBufferTooSmall) {
  Served s;
  const OwnedBatch good = Good();
  const embedcore_batch c = good.C();
  Canary short_by_one(2 * 16 - 1);
  EXPECT_C_ERROR(embedcore_lookup(s.h, 0, &c, EMBEDCORE_COMBINER_SUM, 0, short_by_one.data.get(), short_by_one.n),
                 EMBEDCORE_INVALID_ARGUMENT, "out holds 31 floats (out_len), the output needs 32");
  EMBEDCORE_EXPECT(short_by_one.Untouched());
  Canary seq(2 * 5 * 16 - 1);
  EXPECT_C_ERROR(embedcore_lookup(s.h, 0, &c, EMBEDCORE_COMBINER_NONE, 5, seq.data.get(), seq.n),
                 EMBEDCORE_INVALID_ARGUMENT, "the output needs 160");
  EMBEDCORE_EXPECT(seq.Untouched());
  Canary feature(2 * 5 * 8 - 1);  // feature 2: history, item rows padded to 5
  EXPECT_C_ERROR(embedcore_lookup_feature(s.h, 2, &c, feature.data.get(), feature.n), EMBEDCORE_INVALID_ARGUMENT,
                 "the output needs 80");
  EMBEDCORE_EXPECT(feature.Untouched());
  EXPECT_C_ERROR(embedcore_lookup(s.h, 0, &c, EMBEDCORE_COMBINER_SUM, 0, short_by_one.data.get(), -5),
                 EMBEDCORE_INVALID_ARGUMENT, "out holds -5 floats");
  // The exact size works.
  Canary exact(2 * 16);
  EXPECT_C_OK(embedcore_lookup(s.h, 0, &c, EMBEDCORE_COMBINER_SUM, 0, exact.data.get(), exact.n));
}

EMBEDCORE_TEST(OutputOverlappingAnInput) {
  Served s;
  OwnedBatch good = Good();
  // One buffer for the output and an input (a reused scratch area): refused, nothing written.
  std::vector<float> scratch(64, -12345.0f);
  embedcore_batch c = good.C();
  c.weights = scratch.data() + 30;  // the output is scratch[0, 32)
  std::copy(good.weights.begin(), good.weights.end(), scratch.begin() + 30);
  EXPECT_C_ERROR(embedcore_lookup(s.h, 0, &c, EMBEDCORE_COMBINER_SUM, 0, scratch.data(), 32),
                 EMBEDCORE_INVALID_ARGUMENT, "out overlaps batch.weights");
  for (int i = 0; i < 30; ++i) EMBEDCORE_EXPECT_EQ(scratch[size_t(i)], -12345.0f);
  std::vector<int64_t> ids_and_out(64, 0);
  c = good.C();
  std::copy(good.ids.begin(), good.ids.end(), ids_and_out.begin());
  c.ids = ids_and_out.data();
  EXPECT_C_ERROR(embedcore_lookup(s.h, 0, &c, EMBEDCORE_COMBINER_SUM, 0,
                                  reinterpret_cast<float*>(ids_and_out.data() + 2), 32),
                 EMBEDCORE_INVALID_ARGUMENT, "out overlaps batch.ids");
  // Adjacent buffers are fine.
  c = good.C();
  c.weights = scratch.data() + 32;
  EXPECT_C_OK(embedcore_lookup(s.h, 0, &c, EMBEDCORE_COMBINER_SUM, 0, scratch.data(), 32));
}

EMBEDCORE_TEST(BadEnumsAndFields) {
  Served s;
  const OwnedBatch good = Good();
  Canary out(4 * 3 * 16);
  embedcore_batch c = good.C();
  for (int32_t combiner : {-2, 4, 100}) {
    EXPECT_C_ERROR(embedcore_lookup(s.h, 0, &c, combiner, 0, out.data.get(), out.n), EMBEDCORE_INVALID_ARGUMENT,
                   "combiner must be an embedcore_combiner (-1..3), got " + std::to_string(combiner));
  }
  EXPECT_C_ERROR(embedcore_lookup(s.h, 0, &c, EMBEDCORE_COMBINER_NONE, -1, out.data.get(), out.n),
                 EMBEDCORE_INVALID_ARGUMENT, "max_sequence_length must be >= 0, got -1");
  EXPECT_C_ERROR(embedcore_lookup(s.h, 0, &c, EMBEDCORE_COMBINER_SUM, 3, out.data.get(), out.n),
                 EMBEDCORE_INVALID_ARGUMENT, "max_sequence_length applies to EMBEDCORE_COMBINER_NONE only");
  c.id_type = 2;
  EXPECT_C_ERROR(embedcore_lookup(s.h, 0, &c, EMBEDCORE_COMBINER_SUM, 0, out.data.get(), out.n),
                 EMBEDCORE_INVALID_ARGUMENT,
                 "batch.id_type must be EMBEDCORE_ID_INT32 (0) or EMBEDCORE_ID_INT64 (1), got 2");
  c = good.C();
  c.reserved = 1;
  EXPECT_C_ERROR(embedcore_lookup(s.h, 0, &c, EMBEDCORE_COMBINER_SUM, 0, out.data.get(), out.n),
                 EMBEDCORE_INVALID_ARGUMENT, "batch.reserved must be 0");
  c = good.C();
  for (int64_t table : {int64_t(-1), int64_t(3), int64_t(1) << 40}) {
    EXPECT_C_ERROR(embedcore_lookup(s.h, table, &c, EMBEDCORE_COMBINER_SUM, 0, out.data.get(), out.n),
                   EMBEDCORE_OUT_OF_RANGE, "table index " + std::to_string(table) + " is out of range [0, 3)");
    embedcore_table_info ti;
    EXPECT_C_ERROR(embedcore_describe_table(s.h, table, &ti), EMBEDCORE_OUT_OF_RANGE, "is out of range [0, 3)");
  }
  for (int64_t feature : {int64_t(-1), int64_t(4)}) {
    EXPECT_C_ERROR(embedcore_lookup_feature(s.h, feature, &c, out.data.get(), out.n), EMBEDCORE_OUT_OF_RANGE,
                   "feature index " + std::to_string(feature) + " is out of range [0, 4)");
    embedcore_feature_info fi;
    EXPECT_C_ERROR(embedcore_describe_feature(s.h, feature, &fi), EMBEDCORE_OUT_OF_RANGE, "is out of range [0, 4)");
  }
  int64_t index = -7;
  EXPECT_C_ERROR(embedcore_find_table(s.h, "users", &index), EMBEDCORE_OUT_OF_RANGE, "no table named 'users'");
  EXPECT_C_ERROR(embedcore_find_feature(s.h, "", &index), EMBEDCORE_OUT_OF_RANGE, "no feature named ''");
  const std::string long_name(100000, 'x');  // quoted in part
  EXPECT_C_ERROR(embedcore_find_table(s.h, long_name.c_str(), &index), EMBEDCORE_OUT_OF_RANGE,
                 "no table named '" + std::string(80, 'x') + "...' in the checkpoint");
  EMBEDCORE_EXPECT(std::string(embedcore_last_error()).size() < 200);
  EMBEDCORE_EXPECT_EQ(index, -7);
  EMBEDCORE_EXPECT(out.Untouched());
}

EMBEDCORE_TEST(MisalignedArrays) {
  Served s;
  const OwnedBatch good = Good();
  // Copies at an odd address inside a byte buffer.
  std::vector<char> raw(1024);
  char* odd = raw.data() + 1;
  std::memcpy(odd, good.ids.data(), good.ids.size() * 8);
  Canary out(2 * 16 + 1);
  embedcore_batch c = good.C();
  c.ids = odd;
  EXPECT_C_ERROR(embedcore_lookup(s.h, 0, &c, EMBEDCORE_COMBINER_SUM, 0, out.data.get(), out.n),
                 EMBEDCORE_INVALID_ARGUMENT, "batch.ids: not aligned to 8 bytes");
  c = good.C(false, true);
  c.ids = odd + 1;  // int32 ids need 4 bytes
  EXPECT_C_ERROR(embedcore_lookup(s.h, 0, &c, EMBEDCORE_COMBINER_SUM, 0, out.data.get(), out.n),
                 EMBEDCORE_INVALID_ARGUMENT, "batch.ids: not aligned to 4 bytes");
  c = good.C();
  std::memcpy(odd + 100, good.offsets.data(), good.offsets.size() * 8);
  c.offsets = reinterpret_cast<const int64_t*>(odd + 100);
  EXPECT_C_ERROR(embedcore_lookup(s.h, 0, &c, EMBEDCORE_COMBINER_SUM, 0, out.data.get(), out.n),
                 EMBEDCORE_INVALID_ARGUMENT, "batch.offsets: not aligned to 8 bytes");
  c = good.C(true);
  c.weights = reinterpret_cast<const float*>(odd + 200);
  EXPECT_C_ERROR(embedcore_lookup(s.h, 0, &c, EMBEDCORE_COMBINER_SUM, 0, out.data.get(), out.n),
                 EMBEDCORE_INVALID_ARGUMENT, "batch.weights: not aligned to 4 bytes");
  c = good.C();
  float* misaligned_out = reinterpret_cast<float*>(reinterpret_cast<char*>(out.data.get()) + 2);
  EXPECT_C_ERROR(embedcore_lookup(s.h, 0, &c, EMBEDCORE_COMBINER_SUM, 0, misaligned_out, 2 * 16),
                 EMBEDCORE_INVALID_ARGUMENT, "out: not aligned to 4 bytes");
  EMBEDCORE_EXPECT(out.Untouched());
}

// The batch and the out-parameters are read and written as typed objects:
// misaligned, they are an error like a misaligned array, not undefined
// behaviour (UndefinedBehaviorSanitizer stopped on the first of these).
EMBEDCORE_TEST(MisalignedStructsAndOutParameters) {
  Served s;
  const OwnedBatch good = Good();
  const embedcore_batch c = good.C();
  alignas(16) static char raw[4096];
  char* odd = raw + 1;
  std::memcpy(odd, &c, sizeof(c));
  const embedcore_batch* batch = reinterpret_cast<const embedcore_batch*>(odd);
  Canary out(2 * 16);
  EXPECT_C_ERROR(embedcore_lookup(s.h, 0, batch, EMBEDCORE_COMBINER_SUM, 0, out.data.get(), out.n),
                 EMBEDCORE_INVALID_ARGUMENT, "embedcore_lookup: batch: not aligned to 8 bytes");
  EXPECT_C_ERROR(embedcore_lookup_feature(s.h, 0, batch, out.data.get(), out.n), EMBEDCORE_INVALID_ARGUMENT,
                 "embedcore_lookup_feature: batch: not aligned to 8 bytes");
  EMBEDCORE_EXPECT(out.Untouched());
  int64_t n = -1;
  EXPECT_C_ERROR(embedcore_lookup_size(s.h, 0, batch, EMBEDCORE_COMBINER_SUM, 0, &n), EMBEDCORE_INVALID_ARGUMENT,
                 "embedcore_lookup_size: batch: not aligned to 8 bytes");
  EMBEDCORE_EXPECT_EQ(n, -1);
  char* out8 = raw + 1024 + 4;  // 4-aligned, not 8-aligned
  EXPECT_C_ERROR(embedcore_lookup_size(s.h, 0, &c, EMBEDCORE_COMBINER_SUM, 0, reinterpret_cast<int64_t*>(out8)),
                 EMBEDCORE_INVALID_ARGUMENT, "embedcore_lookup_size: out: not aligned to 8 bytes");
  EXPECT_C_ERROR(embedcore_num_tables(s.h, reinterpret_cast<int64_t*>(out8)), EMBEDCORE_INVALID_ARGUMENT,
                 "embedcore_num_tables: out: not aligned to 8 bytes");
  EXPECT_C_ERROR(embedcore_num_features(s.h, reinterpret_cast<int64_t*>(out8)), EMBEDCORE_INVALID_ARGUMENT,
                 "embedcore_num_features: out: not aligned to 8 bytes");
  EXPECT_C_ERROR(embedcore_find_table(s.h, "user", reinterpret_cast<int64_t*>(out8)), EMBEDCORE_INVALID_ARGUMENT,
                 "embedcore_find_table: out: not aligned to 8 bytes");
  EXPECT_C_ERROR(embedcore_find_feature(s.h, "user", reinterpret_cast<int64_t*>(out8)), EMBEDCORE_INVALID_ARGUMENT,
                 "embedcore_find_feature: out: not aligned to 8 bytes");
  EXPECT_C_ERROR(embedcore_checkpoint_generation(s.h, reinterpret_cast<uint64_t*>(out8)), EMBEDCORE_INVALID_ARGUMENT,
                 "embedcore_checkpoint_generation: out: not aligned to 8 bytes");
  EXPECT_C_ERROR(embedcore_describe_table(s.h, 0, reinterpret_cast<embedcore_table_info*>(out8)),
                 EMBEDCORE_INVALID_ARGUMENT, "embedcore_describe_table: out: not aligned to 8 bytes");
  EXPECT_C_ERROR(embedcore_describe_feature(s.h, 0, reinterpret_cast<embedcore_feature_info*>(out8)),
                 EMBEDCORE_INVALID_ARGUMENT, "embedcore_describe_feature: out: not aligned to 8 bytes");
  EXPECT_C_ERROR(embedcore_build_info(reinterpret_cast<const char**>(out8)), EMBEDCORE_INVALID_ARGUMENT,
                 "embedcore_build_info: out_json: not aligned to 8 bytes");
  EXPECT_C_ERROR(embedcore_get_num_threads(reinterpret_cast<int*>(raw + 2048 + 2)), EMBEDCORE_INVALID_ARGUMENT,
                 "embedcore_get_num_threads: out: not aligned to 4 bytes");
  embedcore_checkpoint** handle_out = reinterpret_cast<embedcore_checkpoint**>(out8);
  EXPECT_C_ERROR(embedcore_open(s.dir.Sub("m").c_str(), nullptr, handle_out), EMBEDCORE_INVALID_ARGUMENT,
                 "embedcore_open: out: not aligned to 8 bytes");
  for (size_t i = 1024; i < 1024 + 64; ++i) EMBEDCORE_EXPECT(raw[i] == 0);  // nothing written
}

EMBEDCORE_TEST(BadOptions) {
  Served s;
  const std::string path = s.dir.Sub("m");
  EXPECT_OPEN_ERROR(path, "{\"verify\": \"sometimes\"}", EMBEDCORE_INVALID_ARGUMENT,
                    "verify must be \"lazy\", \"eager\", \"none\", true or false, got \"sometimes\"");
  EXPECT_OPEN_ERROR(path, "{\"verfy\": \"lazy\"}", EMBEDCORE_INVALID_ARGUMENT, "unknown option 'verfy' (known: verify)");
  EXPECT_OPEN_ERROR(path, "[1, 2]", EMBEDCORE_INVALID_ARGUMENT, "options_json must be a JSON object");
  // A key given twice: which one was meant? (The last won: {"verify": "eager", "verify": "none"} verified nothing.)
  EXPECT_OPEN_ERROR(path, "{\"verify\": \"eager\", \"verify\": \"none\"}", EMBEDCORE_INVALID_ARGUMENT,
                    "embedcore_open: options_json gives the key \"verify\" twice");
  EXPECT_C_ERROR(embedcore_reload(s.h, nullptr, "{\"verify\": true, \"verify\": true}"), EMBEDCORE_INVALID_ARGUMENT,
                 "embedcore_reload: options_json gives the key \"verify\" twice");
  // The message names the argument (it used to be nlohmann's alone: "embedcore_open: [json.exception...").
  EXPECT_OPEN_ERROR(path, "{\"verify\": ", EMBEDCORE_INVALID_ARGUMENT,
                    "embedcore_open: options_json: not valid JSON: [json.exception.parse_error");
  EXPECT_OPEN_ERROR(path, "", EMBEDCORE_INVALID_ARGUMENT, "options_json: not valid JSON");
  EXPECT_OPEN_ERROR(path, "{\"verify\": 1e999}", EMBEDCORE_INVALID_ARGUMENT,
                    "embedcore_open: options_json: not valid JSON: [json.exception.out_of_range");
  EXPECT_C_ERROR(embedcore_reload(s.h, nullptr, "{verify: 1}"), EMBEDCORE_INVALID_ARGUMENT,
                 "embedcore_reload: options_json: not valid JSON");
  const std::string huge(70000, ' ');
  EXPECT_OPEN_ERROR(path, huge.c_str(), EMBEDCORE_INVALID_ARGUMENT, "longer than 64 KiB");
  EXPECT_C_ERROR(embedcore_reload(s.h, nullptr, "{\"verify\": 3}"), EMBEDCORE_INVALID_ARGUMENT, "got 3");
  // The messages are UTF-8, as the header promises, whatever bytes they quote (nlohmann's quoted them as given),
  // and a key holding \u0000 is quoted whole (its NUL ended the message there).
  int status = -1;
  std::string m = Open(path, "{\"verify\": \"\xff\"}", &status);
  EMBEDCORE_EXPECT(status == EMBEDCORE_INVALID_ARGUMENT);
  EMBEDCORE_EXPECT_MSG(m.find("\\xff") != std::string::npos && m.find('\xff') == std::string::npos, m);
  m = Open(path, "{\"\xc3\": 1}", &status);
  EMBEDCORE_EXPECT_MSG(m.find("\\xc3") != std::string::npos && m.find('\xc3') == std::string::npos, m);
  EXPECT_OPEN_ERROR(path, "{\"ver\\u0000ify\": 1}", EMBEDCORE_INVALID_ARGUMENT, "unknown option 'ver\\u0000ify'");
  EXPECT_OPEN_ERROR(path, "{\"v\\u00e9rify\": 1}", EMBEDCORE_INVALID_ARGUMENT, "unknown option 'v\xc3\xa9rify'");
}

namespace {

// embedcore_open on a thread of its own with a 256 KiB stack (a server's
// request threads may have small ones): its status and message.
struct SmallStackOpen {
  std::string path, options, message;
  int status = -1;
  static void* Run(void* self) {
    auto* o = static_cast<SmallStackOpen*>(self);
    embedcore_checkpoint* h = nullptr;
    o->status = embedcore_open(o->path.c_str(), o->options.c_str(), &h);
    o->message = o->status == EMBEDCORE_OK ? "" : embedcore_last_error();
    embedcore_close(h);
    return nullptr;
  }
  SmallStackOpen(std::string p, std::string opts) : path(std::move(p)), options(std::move(opts)) {
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, 256 << 10);
    pthread_t t;
    if (pthread_create(&t, &attr, Run, this) != 0) throw std::runtime_error("pthread_create failed");
    pthread_join(t, nullptr);
    pthread_attr_destroy(&attr);
  }
};

std::string Nested(const std::string& open, const std::string& close, int depth) {
  std::string s = "{\"verify\": ";
  for (int i = 0; i < depth; ++i) s += open;
  for (int i = 0; i < depth; ++i) s += close;
  return s + "}";
}

}  // namespace

// Options nested deeply (well under the 64 KiB limit) are refused while they
// are parsed, before a message dumps them (which recursed once per level and
// overflowed the stack), and a message quotes at most a short excerpt of a
// long bad value or key.
EMBEDCORE_TEST(DeepOrLongOptions) {
  Served s;
  const std::string path = s.dir.Sub("m");
  const struct {
    const char *open, *close;
    int depth;
  } nested[] = {{"[", "]", 33}, {"[", "]", 8000}, {"[", "]", 32000}, {"{\"a\": ", "}", 33}, {"{\"a\": ", "}", 9000}};
  for (const auto& n : nested) {
    const std::string options = Nested(n.open, n.close, n.depth);
    EMBEDCORE_EXPECT(options.size() <= size_t(1) << 16);
    const SmallStackOpen o(path, options);
    EMBEDCORE_EXPECT_MSG(o.status == EMBEDCORE_INVALID_ARGUMENT, n.open << " x " << n.depth << ": " << o.status);
    EMBEDCORE_EXPECT_MSG(o.message == "embedcore_open: options_json: nests deeper than 32 levels",
                         n.open << " x " << n.depth << ": " << o.message);
  }
  // At the limit: parsed, and refused as a value.
  const SmallStackOpen at_limit(path, Nested("[", "]", 32));
  EMBEDCORE_EXPECT_EQ(at_limit.status, EMBEDCORE_INVALID_ARGUMENT);
  EMBEDCORE_EXPECT_MSG(at_limit.message.find("true or false, got [[[[") != std::string::npos, at_limit.message);

  const std::string x(60000, 'x');
  const std::pair<std::string, std::string> cases[] = {
      {"{\"verify\": \"" + x + "\"}", "verify must be \"lazy\", \"eager\", \"none\", true or false, got \"xxxx"},
      {"{\"" + x + "\": 1}", "unknown option 'xxxx"},
      {"{\"verify\": \"" + x, "options_json: not valid JSON"},  // unterminated: nlohmann quotes what it read
      {"[\"" + x + "\"]", "options_json must be a JSON object, got [\"xxxx"},
  };
  for (const auto& c : cases) {
    int status = -1;
    const std::string m = Open(path, c.first.c_str(), &status);
    EMBEDCORE_EXPECT_EQ(status, EMBEDCORE_INVALID_ARGUMENT);
    EMBEDCORE_EXPECT_MSG(m.size() < 400 && m.find(c.second) != std::string::npos,
                         m.size() << " bytes: " << m.substr(0, 300));
  }
  std::string wide = "{\"verify\": [1";
  for (int i = 0; i < 20000; ++i) wide += ",1";
  wide += "]}";
  int status = -1;
  const std::string m = Open(path, wide.c_str(), &status);
  EMBEDCORE_EXPECT_EQ(status, EMBEDCORE_INVALID_ARGUMENT);
  EMBEDCORE_EXPECT_MSG(m.size() < 400 && m.find("got [1,1,1,") != std::string::npos,
                       m.size() << " bytes: " << m.substr(0, 300));
  EMBEDCORE_EXPECT_MSG(m.size() > 3 && m.compare(m.size() - 3, 3, "...") == 0, m.substr(0, 300));  // cut short
}

EMBEDCORE_TEST(MissingOrNotACheckpoint) {
  TempDir dir;
  EXPECT_OPEN_ERROR(dir.Sub("nothing"), nullptr, EMBEDCORE_CHECKPOINT_ERROR, "no such checkpoint directory");
  WriteFile(dir.Sub("file"), {'x'});
  EXPECT_OPEN_ERROR(dir.Sub("file"), nullptr, EMBEDCORE_CHECKPOINT_ERROR, "not a checkpoint directory");
  fs::create_directory(dir.Sub("empty"));
  int status = -1;
  const std::string message = Open(dir.Sub("empty"), nullptr, &status);
  EMBEDCORE_EXPECT_MSG(status == EMBEDCORE_CHECKPOINT_ERROR || status == EMBEDCORE_IO_ERROR, status << ": " << message);
  EMBEDCORE_EXPECT_MSG(message.find("MANIFEST") != std::string::npos, message);
}

// Runs `check` (true: as expected; else it says why on stderr) as a user
// the directories' modes apply to: root in a child process that first gives
// up root for uid and gid 65534 ("nobody"), any other user in this process.
template <typename F>
bool AsUnprivileged(F check) {
  if (::geteuid() != 0) return check();
  const pid_t pid = ::fork();
  if (pid < 0) return false;
  if (pid == 0) {
    if (::setgid(65534) != 0 || ::setuid(65534) != 0) ::_exit(3);
    ::_exit(check() ? 0 : 1);
  }
  int wstatus = 0;
  while (::waitpid(pid, &wstatus, 0) < 0 && errno == EINTR) {
  }
  return WIFEXITED(wstatus) && WEXITSTATUS(wstatus) == 0;
}

bool OpenFailsWith(const std::string& path, int want_status, const std::string& want_text) {
  embedcore_checkpoint* h = nullptr;
  const int status = embedcore_open(path.c_str(), "{\"verify\": \"none\"}", &h);
  const std::string message = status == EMBEDCORE_OK ? "" : embedcore_last_error();
  embedcore_close(h);
  if (status == want_status && message.find(want_text) != std::string::npos) return true;
  std::fprintf(stderr, "open(%s): status %d (%s), expected %d with \"%s\"\n", path.c_str(), status,
               message.c_str(), want_status, want_text.c_str());
  return false;
}

// A directory its reader may search but not read (mode 711) cannot be locked
// against a commit removing the files it maps: refused with the system's
// error, not served unlocked. A directory under one it may not search, and a
// path the system cannot resolve (a symlink loop), say so too, not "no such
// checkpoint directory".
EMBEDCORE_TEST(DirectoriesTheReaderMayNotRead) {
  TempDir dir;
  EMBEDCORE_EXPECT(::chmod(dir.path.c_str(), 0755) == 0);
  SaveModel(dir.Sub("search_only"));
  EMBEDCORE_EXPECT(::chmod(dir.Sub("search_only").c_str(), 0111) == 0);  // (0711 for others than its owner)
  EMBEDCORE_EXPECT(::mkdir(dir.Sub("closed").c_str(), 0700) == 0);
  SaveModel(dir.Sub("closed/m"));
  EMBEDCORE_EXPECT(::chmod(dir.Sub("closed").c_str(), 0) == 0);
  EMBEDCORE_EXPECT(AsUnprivileged([&] {
    return OpenFailsWith(dir.Sub("search_only"), EMBEDCORE_IO_ERROR,
                         dir.Sub("search_only") + ": cannot open the directory to lock it: Permission denied") &&
           OpenFailsWith(dir.Sub("closed/m"), EMBEDCORE_IO_ERROR, "Permission denied");
  }));
  EMBEDCORE_EXPECT(::symlink("loop", dir.Sub("loop").c_str()) == 0);
  EMBEDCORE_EXPECT(OpenFailsWith(dir.Sub("loop"), EMBEDCORE_IO_ERROR, std::strerror(ELOOP)));

  // A save into a directory it may write but not read (0300) could not list
  // what it wrote to remove it after its commit failed: refused up front.
  EMBEDCORE_EXPECT(::mkdir(dir.Sub("shared").c_str(), 0777) == 0 && ::chmod(dir.Sub("shared").c_str(), 0777) == 0);
  const std::string drop = dir.Sub("shared/drop");
  EMBEDCORE_EXPECT(AsUnprivileged([&] {
    if (::mkdir(drop.c_str(), 0300) != 0 || ::chmod(drop.c_str(), 0300) != 0) return false;
    try {
      SaveModel(drop);
    } catch (const embedcore::IoError& e) {
      if (std::string(e.what()).find(drop + ": cannot open the directory: Permission denied") != std::string::npos)
        return true;
      std::fprintf(stderr, "save: %s\n", e.what());
      return false;
    }
    std::fprintf(stderr, "the save into a 0300 directory succeeded\n");
    return false;
  }));
  EMBEDCORE_EXPECT(::chmod(drop.c_str(), 0700) == 0);
  EMBEDCORE_EXPECT(std::filesystem::is_empty(drop));  // nothing written
  for (const char* sub : {"search_only", "closed"}) EMBEDCORE_EXPECT(::chmod(dir.Sub(sub).c_str(), 0755) == 0);
}

EMBEDCORE_TEST(TruncatedCheckpoint) {
  TempDir dir;
  SaveModel(dir.Sub("m"));
  const std::string values = ValuesFile(dir.Sub("m"), 0);
  std::vector<char> bytes = ReadFile(values);
  bytes.resize(bytes.size() - 100);
  WriteFile(values, bytes);
  EXPECT_OPEN_ERROR(dir.Sub("m"), nullptr, EMBEDCORE_CHECKPOINT_ERROR, "(truncated)");
  // Truncated to nothing, and a truncated manifest.
  WriteFile(values, {});
  EXPECT_OPEN_ERROR(dir.Sub("m"), "{\"verify\": \"none\"}", EMBEDCORE_CHECKPOINT_ERROR, "size 0 bytes");
  SaveModel(dir.Sub("n"));
  std::vector<char> manifest = ReadFile(dir.Sub("n/MANIFEST"));
  manifest.resize(manifest.size() / 2);
  WriteFile(dir.Sub("n/MANIFEST"), manifest);
  EXPECT_OPEN_ERROR(dir.Sub("n"), nullptr, EMBEDCORE_CHECKPOINT_ERROR, "truncated");
  WriteFile(dir.Sub("n/MANIFEST"), {'E', 'C'});
  EXPECT_OPEN_ERROR(dir.Sub("n"), nullptr, EMBEDCORE_CHECKPOINT_ERROR, "truncated (2 bytes)");
}

EMBEDCORE_TEST(CorruptManifestAndHeaders) {
  TempDir dir;
  SaveModel(dir.Sub("m"));
  FlipByte(dir.Sub("m/MANIFEST"), 200);  // in the JSON
  EXPECT_OPEN_ERROR(dir.Sub("m"), nullptr, EMBEDCORE_CHECKPOINT_ERROR, "checksum mismatch: the manifest is corrupt");
  SaveModel(dir.Sub("h"));
  FlipByte(ValuesFile(dir.Sub("h"), 1), 30);  // the data file's header (rows)
  EXPECT_OPEN_ERROR(dir.Sub("h"), "{\"verify\": \"none\"}", EMBEDCORE_CHECKPOINT_ERROR, "header checksum mismatch");
  SaveModel(dir.Sub("p"));
  FlipByte(ValuesFile(dir.Sub("p"), 1), 1000);  // header padding
  EXPECT_OPEN_ERROR(dir.Sub("p"), nullptr, EMBEDCORE_CHECKPOINT_ERROR, "header padding is not zero");
}

EMBEDCORE_TEST(NewerFormatIsRefused) {
  TempDir dir;
  SaveModel(dir.Sub("m"));
  std::vector<char> manifest = ReadFile(dir.Sub("m/MANIFEST"));
  embedcore::checkpoint::FileHeader h;
  std::memcpy(&h, manifest.data(), sizeof(h));
  h.format_major = 2;
  h.header_crc32c = embedcore::checkpoint::Crc32c(&h, 60);
  std::memcpy(manifest.data(), &h, sizeof(h));
  WriteFile(dir.Sub("m/MANIFEST"), manifest);
  EXPECT_OPEN_ERROR(dir.Sub("m"), nullptr, EMBEDCORE_CHECKPOINT_ERROR,
                    "format version 2." + std::to_string(h.format_minor) +
                        " is newer than this library reads (1.x); upgrade embedcore");
}

// A flipped byte of the values: lazily found by the lookup that touches its
// block (and every later one: the block is never served), eagerly on open,
// not at all without verification. true and false stand for "lazy" and
// "none" (c_api.h), as in Python.
EMBEDCORE_TEST(CorruptValues) {
  TempDir dir;
  SaveModel(dir.Sub("m"));
  FlipByte(ValuesFile(dir.Sub("m"), 0), 4096 + 16 * 4 * 3 + 5);  // user row 3
  const OwnedBatch good = Good();                                 // touches row 3
  const embedcore_batch c = good.C();

  for (const char* options : {"{\"verify\": \"lazy\"}", "{\"verify\": true}", static_cast<const char*>(nullptr)}) {
    embedcore_checkpoint* lazy = nullptr;
    EXPECT_C_OK(embedcore_open(dir.Sub("m").c_str(), options, &lazy));  // not eager: opens
    for (int attempt = 0; attempt < 2; ++attempt) {
      Canary out(2 * 16);
      EXPECT_C_ERROR(embedcore_lookup(lazy, 0, &c, EMBEDCORE_COMBINER_SUM, 0, out.data.get(), out.n),
                     EMBEDCORE_CHECKPOINT_ERROR,
                     "checksum mismatch in block 0 (bytes 4096..): refusing to serve corrupt rows");
      EMBEDCORE_EXPECT(out.Untouched());
    }
    // The other tables are intact and served.
    OwnedBatch item = Good();
    const embedcore_batch ci = item.C();
    Canary item_out(2 * 8);
    EXPECT_C_OK(embedcore_lookup(lazy, 1, &ci, EMBEDCORE_COMBINER_SUM, 0, item_out.data.get(), item_out.n));
    EXPECT_C_OK(embedcore_close(lazy));
  }

  EXPECT_OPEN_ERROR(dir.Sub("m"), "{\"verify\": \"eager\"}", EMBEDCORE_CHECKPOINT_ERROR, "checksum mismatch in block 0");

  // "none" and false: the corrupt row is served, with the bits the file holds.
  const MappedCheckpoint unchecked(dir.Sub("m"), MappedCheckpoint::Verify::kNone);
  const std::vector<float> want = Reference(unchecked, 0, good.Engine(), Combiner::kSum);
  for (const char* options : {"{\"verify\": \"none\"}", "{\"verify\": false}"}) {
    embedcore_checkpoint* none = nullptr;
    EXPECT_C_OK(embedcore_open(dir.Sub("m").c_str(), options, &none));
    std::vector<float> out(2 * 16);
    EXPECT_C_OK(embedcore_lookup(none, 0, &c, EMBEDCORE_COMBINER_SUM, 0, out.data(), int64_t(out.size())));
    EMBEDCORE_EXPECT_MSG(SameBits(out, want), options);
    EXPECT_C_OK(embedcore_close(none));
  }
}

EMBEDCORE_TEST(MalformedFeatureMetadata) {
  TempDir dir;
  struct Case {
    const char* features;
    const char* message;
  } cases[] = {
      {R"([{"name": "x", "table": "nope", "max_sequence_length": 0}])", "names no table of the checkpoint: 'nope'"},
      {R"([{"name": "x", "table": "user", "max_sequence_length": -1}])", "max_sequence_length must be an integer >= 0"},
      {R"([{"name": "x", "table": "user", "max_sequence_length": true}])", "max_sequence_length must be an integer"},
      {R"([{"name": "x", "table": "user", "max_sequence_length": 1.5}])", "max_sequence_length must be an integer"},
      {R"([{"name": 3, "table": "user", "max_sequence_length": 0}])", ".name must be a string"},
      {R"([{"table": "user", "max_sequence_length": 0}])", ".name must be a string"},
      {R"([7])", "metadata.features[0] must be an object"},
      {R"({"a": 1})", "metadata.features must be a list"},
  };
  int i = 0;
  for (const Case& k : cases) {
    ModelOptions o;
    o.features_json = k.features;
    const std::string path = dir.Sub("m" + std::to_string(i++));
    SaveModel(path, o);
    EXPECT_OPEN_ERROR(path, nullptr, EMBEDCORE_CHECKPOINT_ERROR, k.message);
  }
  // Empty or absent features: a checkpoint of tables, as embedcore.serving reads it.
  for (const char* features : {"[]", "null", "{}", "0", "false", "\"\""}) {
    ModelOptions o;
    o.features_json = features;
    const std::string path = dir.Sub("m" + std::to_string(i++));
    SaveModel(path, o);
    embedcore_checkpoint* h = nullptr;
    EXPECT_C_OK(embedcore_open(path.c_str(), nullptr, &h));
    int64_t n = -1;
    EXPECT_C_OK(embedcore_num_features(h, &n));
    EMBEDCORE_EXPECT_EQ(n, 0);
    embedcore_close(h);
  }
}

// A reload that fails leaves the old checkpoint served, unchanged.
EMBEDCORE_TEST(FailedReloadKeepsServing) {
  Served s;
  const OwnedBatch good = Good();
  const embedcore_batch c = good.C();
  std::vector<float> before(2 * 16), after(2 * 16);
  EXPECT_C_OK(embedcore_lookup(s.h, 0, &c, EMBEDCORE_COMBINER_SUM, 0, before.data(), 32));
  uint64_t g0 = 0, g1 = 0;
  EXPECT_C_OK(embedcore_checkpoint_generation(s.h, &g0));

  EXPECT_C_ERROR(embedcore_reload(s.h, s.dir.Sub("missing").c_str(), nullptr), EMBEDCORE_CHECKPOINT_ERROR,
                 "embedcore_reload: " + s.dir.Sub("missing") + ": no such checkpoint directory");
  ModelOptions other_dim;
  other_dim.item_dim = 4;
  SaveModel(s.dir.Sub("dim"), other_dim);
  EXPECT_C_ERROR(embedcore_reload(s.h, s.dir.Sub("dim").c_str(), nullptr), EMBEDCORE_CHECKPOINT_ERROR,
                 "does not match the checkpoint being served: table 'item' has dim 4, was 8");
  ModelOptions mean_user;  // a caller's EMBEDCORE_COMBINER_DEFAULT would change meaning
  mean_user.user_combiner = "mean";
  SaveModel(s.dir.Sub("combiner"), mean_user);
  EXPECT_C_ERROR(embedcore_reload(s.h, s.dir.Sub("combiner").c_str(), nullptr), EMBEDCORE_CHECKPOINT_ERROR,
                 "does not match the checkpoint being served: table 'user' has combiner mean, was sum");
  ModelOptions tables_only;
  tables_only.features = false;
  SaveModel(s.dir.Sub("tables"), tables_only);
  EXPECT_C_ERROR(embedcore_reload(s.h, s.dir.Sub("tables").c_str(), nullptr), EMBEDCORE_CHECKPOINT_ERROR,
                 "its features (names, tables or sequence lengths) differ");
  ModelOptions longer;
  longer.features_json = R"([{"name": "user", "table": "user", "max_sequence_length": 0},)"
                         R"( {"name": "item", "table": "item", "max_sequence_length": 0},)"
                         R"( {"name": "history", "table": "item", "max_sequence_length": 6},)"
                         R"( {"name": "query", "table": "query", "max_sequence_length": 0}])";
  SaveModel(s.dir.Sub("longer"), longer);
  EXPECT_C_ERROR(embedcore_reload(s.h, s.dir.Sub("longer").c_str(), nullptr), EMBEDCORE_CHECKPOINT_ERROR,
                 "features (names, tables or sequence lengths) differ");
  {
    TempDir other;
    Table t(Spec("user", 50, 16, DType::kFloat32, 1));
    SaveCheckpoint(other.Sub("one"), {{&t, "{}"}}, SaveOptions());
    EXPECT_C_ERROR(embedcore_reload(s.h, other.Sub("one").c_str(), nullptr), EMBEDCORE_CHECKPOINT_ERROR,
                   "it has 1 table(s), the served one 3");
  }
  SaveModel(s.dir.Sub("corrupt"));
  FlipByte(s.dir.Sub("corrupt/MANIFEST"), 100);
  EXPECT_C_ERROR(embedcore_reload(s.h, s.dir.Sub("corrupt").c_str(), nullptr), EMBEDCORE_CHECKPOINT_ERROR,
                 "the manifest is corrupt");

  EXPECT_C_OK(embedcore_checkpoint_generation(s.h, &g1));
  EMBEDCORE_EXPECT_EQ(g1, g0);
  EXPECT_C_OK(embedcore_lookup(s.h, 0, &c, EMBEDCORE_COMBINER_SUM, 0, after.data(), 32));
  EMBEDCORE_EXPECT(SameBits(before, after));
  // More rows, another dtype: a compatible newer model.
  ModelOptions grown;
  grown.user_rows = 80;
  grown.seed = 2;
  SaveModel(s.dir.Sub("grown"), grown);
  EXPECT_C_OK(embedcore_reload(s.h, s.dir.Sub("grown").c_str(), nullptr));
  embedcore_table_info ti;
  EXPECT_C_OK(embedcore_describe_table(s.h, 0, &ti));
  EMBEDCORE_EXPECT_EQ(ti.rows, 80);
}

// options_json NULL keeps the handle's options (c_api.h): the verify mode of
// the last open or reload that named one, not the open's nor the default.
// A reload that did not remember its mode (the open's "none" kept) swapped in
// a checkpoint with a corrupt block after a reload with {"verify": "eager"}.
EMBEDCORE_TEST(ReloadWithNullOptionsKeepsTheLastVerify) {
  TempDir dir;
  ModelOptions a, b;
  a.seed = 1;
  b.seed = 2;
  SaveModel(dir.Sub("a"), a);
  SaveModel(dir.Sub("b"), b);
  SaveModel(dir.Sub("corrupt"), b);
  FlipByte(ValuesFile(dir.Sub("corrupt"), 0), 4096 + 16 * 4 * 3 + 5);  // user row 3, in block 0
  const OwnedBatch good = Good();                                       // touches row 3
  const embedcore_batch c = good.C();
  const MappedCheckpoint ref_a(dir.Sub("a"), MappedCheckpoint::Verify::kLazy);
  const MappedCheckpoint ref_b(dir.Sub("b"), MappedCheckpoint::Verify::kLazy);
  const MappedCheckpoint ref_corrupt(dir.Sub("corrupt"), MappedCheckpoint::Verify::kNone);
  const std::vector<float> want_a = Reference(ref_a, 0, good.Engine(), Combiner::kSum);
  const std::vector<float> want_b = Reference(ref_b, 0, good.Engine(), Combiner::kSum);
  const std::vector<float> want_corrupt = Reference(ref_corrupt, 0, good.Engine(), Combiner::kSum);
  std::vector<float> out(2 * 16);
  const auto lookup = [&](embedcore_checkpoint* h) {
    return embedcore_lookup(h, 0, &c, EMBEDCORE_COMBINER_SUM, 0, out.data(), int64_t(out.size()));
  };

  embedcore_checkpoint* h = nullptr;
  EXPECT_C_OK(embedcore_open(dir.Sub("a").c_str(), "{\"verify\": \"none\"}", &h));
  // "eager" from here on: the corrupt checkpoint is refused, B still served.
  EXPECT_C_OK(embedcore_reload(h, dir.Sub("b").c_str(), "{\"verify\": \"eager\"}"));
  EXPECT_C_ERROR(embedcore_reload(h, dir.Sub("corrupt").c_str(), nullptr), EMBEDCORE_CHECKPOINT_ERROR,
                 "checksum mismatch in block 0");
  EXPECT_C_OK(lookup(h));
  EMBEDCORE_EXPECT(SameBits(out, want_b));
  // Still "eager" after a reload(NULL, NULL) of B.
  EXPECT_C_OK(embedcore_reload(h, nullptr, nullptr));
  EXPECT_C_ERROR(embedcore_reload(h, dir.Sub("corrupt").c_str(), nullptr), EMBEDCORE_CHECKPOINT_ERROR,
                 "checksum mismatch in block 0");
  EXPECT_C_OK(lookup(h));
  EMBEDCORE_EXPECT(SameBits(out, want_b));

  // "lazy" (true) from here on: the corrupt checkpoint is swapped in, its corrupt block refused.
  EXPECT_C_OK(embedcore_reload(h, dir.Sub("a").c_str(), "{\"verify\": true}"));
  EXPECT_C_OK(lookup(h));
  EMBEDCORE_EXPECT(SameBits(out, want_a));
  EXPECT_C_OK(embedcore_reload(h, dir.Sub("corrupt").c_str(), nullptr));
  EXPECT_C_ERROR(lookup(h), EMBEDCORE_CHECKPOINT_ERROR, "checksum mismatch in block 0");

  // "none" (false) from here on: the corrupt rows are served as the file holds them.
  EXPECT_C_OK(embedcore_reload(h, dir.Sub("a").c_str(), "{\"verify\": false}"));
  EXPECT_C_OK(embedcore_reload(h, dir.Sub("corrupt").c_str(), nullptr));
  EXPECT_C_OK(lookup(h));
  EMBEDCORE_EXPECT(SameBits(out, want_corrupt));
  EXPECT_C_OK(embedcore_close(h));
}
