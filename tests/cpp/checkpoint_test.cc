// core/checkpoint/: save / load round trips (values, slots, step, every dtype
// and optimizer, casts), the checks on untrusted input (corrupt, truncated or
// missing files, forged manifests), atomic generations, and memory-mapped
// serving with lazy and eager verification.
#include <fcntl.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <memory>
#include <stdexcept>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "checkpoint/crc32c.h"
#include "checkpoint/format.h"
#include "checkpoint/manifest.h"
#include "embedcore/embedcore.h"
#include "fixtures.h"
#include "kernels.h"
#include "rowwise8.h"
#include "test_util.h"

using namespace embedcore;
namespace ck = embedcore::checkpoint;
namespace fs = std::filesystem;
using namespace embedcore_test;  // fixtures.h, test_util.h

namespace {

std::vector<uint8_t> RawValues(const Table& t) {
  const uint8_t* p = static_cast<const uint8_t*>(t.values());
  return std::vector<uint8_t>(p, p + t.value_bytes());
}

std::vector<float> Values(const Table& t) {
  std::vector<float> out(size_t(t.rows() * t.dim()));
  t.ReadValues(0, t.rows(), out.data());
  return out;
}

std::vector<float> SlotCopy(const Table& t, size_t i) {
  return std::vector<float>(t.slot(i), t.slot(i) + t.rows() * t.slot_dim());
}

struct TableState {
  std::vector<uint8_t> values;
  std::vector<std::vector<float>> slots;
  int64_t step;
  bool operator==(const TableState& o) const { return values == o.values && slots == o.slots && step == o.step; }
};
TableState StateOf(const Table& t) {
  TableState s{RawValues(t), {}, t.step()};
  for (size_t i = 0; i < t.num_slots(); ++i) s.slots.push_back(SlotCopy(t, i));
  return s;
}

const TableEntry& Entry(const CheckpointInfo& info, const std::string& name) {
  for (const TableEntry& e : info.tables)
    if (e.name == name) return e;
  throw std::runtime_error("no table " + name);
}

std::vector<std::string> DirNames(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

// Saves one small trained table and returns its checkpoint directory's info.
struct Saved {
  TempDir dir;
  std::string path;
  std::unique_ptr<Table> table;
  CheckpointInfo info;
};
std::unique_ptr<Saved> SaveOne(OptimizerSpec::Kind opt = OptimizerSpec::Kind::kAdagrad, int64_t rows = 50,
                               int64_t dim = 7) {
  auto s = std::make_unique<Saved>();
  s->path = s->dir.Sub("ckpt");
  s->table = std::make_unique<Table>(Spec("item", rows, dim, DType::kFloat32, opt, 3));
  Train(*s->table, 3, 1);
  SaveCheckpoint(s->path, {{s->table.get(), "{\"combiner\": \"mean\"}"}}, SaveOptions{});
  s->info = ReadCheckpointInfo(s->path);
  return s;
}

}  // namespace

// ------------------------------------------------------------ round trips
EMBEDCORE_TEST(RoundTripEveryDtypeAndOptimizer) {
  using K = OptimizerSpec::Kind;
  TempDir dir;
  const std::string path = dir.Sub("ckpt");
  std::vector<std::unique_ptr<Table>> tables;
  std::vector<TableToSave> to_save;
  const DType dtypes[] = {DType::kFloat32, DType::kFloat16, DType::kBFloat16};
  const K kinds[] = {K::kSGD, K::kAdagrad, K::kAdam, K::kFTRL, K::kRowwiseAdagrad};
  for (int d = 0; d < 3; ++d) {
    for (int k = 0; k < 5; ++k) {
      TableSpec spec = Spec("t" + std::to_string(d) + std::to_string(k), 30 + d * 7 + k, 5 + k, dtypes[d], kinds[k],
                            uint64_t(10 * d + k));
      spec.optimizer.has_clipvalue = k == 2;
      spec.optimizer.clip_gradient_min = -1.0f;
      spec.optimizer.clip_gradient_max = 2.0f;
      tables.push_back(std::make_unique<Table>(spec));
      Train(*tables.back(), 2 + k, uint32_t(d * 4 + k));
      to_save.push_back({tables.back().get(), "{\"i\": " + std::to_string(d * 4 + k) + "}"});
    }
  }
  SaveOptions opts;
  opts.metadata_json = "{\"kind\": \"table\", \"note\": \"round trip\"}";
  SaveCheckpoint(path, to_save, opts);

  const CheckpointInfo info = ReadCheckpointInfo(path);
  EMBEDCORE_EXPECT_EQ(info.format_major, 1);
  EMBEDCORE_EXPECT_EQ(info.format_minor, embedcore::kFormatMinor);
  EMBEDCORE_EXPECT_EQ(info.library_version, std::string(EMBEDCORE_VERSION_STRING));
  EMBEDCORE_EXPECT_EQ(info.generation, uint64_t(1));
  EMBEDCORE_EXPECT_EQ(info.tables.size(), tables.size());
  EMBEDCORE_EXPECT(info.metadata_json.find("round trip") != std::string::npos);
  EMBEDCORE_EXPECT_NO_THROW(VerifyCheckpoint(info, true));

  for (size_t i = 0; i < tables.size(); ++i) {
    const Table& src = *tables[i];
    const TableEntry& e = Entry(info, src.spec().name);
    EMBEDCORE_EXPECT_EQ(e.rows, src.rows());
    EMBEDCORE_EXPECT_EQ(e.dim, src.dim());
    EMBEDCORE_EXPECT(e.dtype == src.spec().dtype);
    EMBEDCORE_EXPECT(e.has_optimizer);
    EMBEDCORE_EXPECT(e.optimizer.kind == src.spec().optimizer.kind);
    EMBEDCORE_EXPECT_EQ(e.optimizer.has_clipvalue, src.spec().optimizer.has_clipvalue);
    EMBEDCORE_EXPECT_EQ(e.step, src.step());
    EMBEDCORE_EXPECT(e.slot_names == src.spec().optimizer.SlotNames());
    EMBEDCORE_EXPECT_EQ(e.initializer.seed, src.spec().initializer.seed);
    EMBEDCORE_EXPECT(e.config_json.find("\"i\"") != std::string::npos);

    // Into a fresh table with another initializer: everything comes back bit for bit.
    TableSpec spec = src.spec();
    spec.initializer.seed += 1000;
    Table dst(spec);
    EMBEDCORE_EXPECT(!(StateOf(dst) == StateOf(src)));
    LoadTable(info, e, dst, true);
    EMBEDCORE_EXPECT_MSG(StateOf(dst) == StateOf(src), "table " << src.spec().name);

    // Values only: slots and step stay as they were.
    Table values_only(spec);
    const TableState before = StateOf(values_only);
    LoadTable(info, e, values_only, false);
    EMBEDCORE_EXPECT(RawValues(values_only) == RawValues(src));
    EMBEDCORE_EXPECT_EQ(values_only.step(), before.step);
    for (size_t s = 0; s < values_only.num_slots(); ++s) EMBEDCORE_EXPECT(SlotCopy(values_only, s) == before.slots[s]);
  }
}

// A save of a table whose memory another thread rewrites meanwhile, outside
// the engine's lock (a PyTorch optimizer's in-place step through the weight's
// view), holds one of the values each element had, and its checksums are
// those of the bytes written: the checkpoint verifies and loads. (Each
// piece was written from the table, then checksummed from it again: bytes
// changed between the two failed verification, a save that said it succeeded.)
EMBEDCORE_TEST(ASaveOfMemoryRewrittenMeanwhileVerifies) {
  TempDir dir;
  Table t(Spec("live", int64_t(1) << 20, 8, DType::kFloat32, OptimizerSpec::Kind::kSGD, 1));
  uint32_t* words = static_cast<uint32_t*>(t.values());
  const size_t n = t.value_bytes() / sizeof(uint32_t);
  std::atomic<bool> stop{false};
  std::thread writer([&] {
    for (uint32_t x = 1; !stop.load(std::memory_order_relaxed); ++x)
      for (size_t i = 0; i < n; ++i) __atomic_store_n(&words[i], 0x3f800000u + ((x + uint32_t(i)) & 0xffffu), __ATOMIC_RELAXED);
  });
  for (int k = 0; k < 4; ++k) {
    const std::string path = dir.Sub("c" + std::to_string(k));
    SaveCheckpoint(path, {{&t, "{}"}}, SaveOptions{});
    EMBEDCORE_EXPECT_NO_THROW(VerifyCheckpoint(ReadCheckpointInfo(path), true));
  }
  stop = true;
  writer.join();
}

EMBEDCORE_TEST(LoadTableBlocksChecksEveryTableBeforeTheFirstCopy) {
  // Table "b" given an optimizer (SetOptimizer) after the caller checked it: LoadTableBlocks refuses the load
  // before it copies "a", which comes first; checked again, a load of both loads both.
  TempDir dir;
  const std::string path = dir.Sub("ckpt");
  Table a(Spec("a", 40, 3, DType::kFloat32, OptimizerSpec::Kind::kSGD, 1));
  Table b(Spec("b", 30, 2, DType::kFloat32, OptimizerSpec::Kind::kSGD, 2));
  SaveCheckpoint(path, {{&a, "{}"}, {&b, "{}"}}, SaveOptions{});
  const CheckpointInfo info = ReadCheckpointInfo(path);
  Table a2(Spec("a", 40, 3, DType::kFloat32, OptimizerSpec::Kind::kSGD, 3));
  Table b2(Spec("b", 30, 2, DType::kFloat32, OptimizerSpec::Kind::kSGD, 4));
  CheckLoadable(info, info.tables[0], a2, true);
  CheckLoadable(info, info.tables[1], b2, true);
  OptimizerSpec adagrad;
  adagrad.kind = OptimizerSpec::Kind::kAdagrad;
  b2.SetOptimizer(adagrad);
  const std::vector<float> before = Values(a2);
  LoadFiles files;
  EMBEDCORE_EXPECT_THROWS(LoadTableBlocks(info, {{&info.tables[0], &a2, -1, 0}, {&info.tables[1], &b2, -1, 0}}, true,
                                          files),
                          CheckpointError, "table 'b' was saved with optimizer slots none");
  EMBEDCORE_EXPECT(Values(a2) == before);
  // Values only: both load, whole tables (row_start -1) and a block alike.
  Table b3(Spec("b", 10, 2, DType::kFloat32, OptimizerSpec::Kind::kSGD, 5));
  LoadTableBlocks(info, {{&info.tables[0], &a2, -1, 0}, {&info.tables[1], &b3, 20, 0}}, false, files);
  EMBEDCORE_EXPECT(Values(a2) == Values(a));
  const std::vector<float> all_b = Values(b);
  EMBEDCORE_EXPECT(Values(b3) == std::vector<float>(all_b.begin() + 40, all_b.end()));  // rows [20, 30), 2 wide
  // A whole-table load checks the shape.
  EMBEDCORE_EXPECT_THROWS(LoadTableBlocks(info, {{&info.tables[1], &b3, -1, 0}}, false, files), CheckpointError,
                          "is 30 x 2, the target table 'b' is 10 x 2");
}

EMBEDCORE_TEST(ValuesOnlyExportAndCast) {
  TempDir dir;
  Table src(Spec("emb", 40, 9, DType::kFloat32, OptimizerSpec::Kind::kAdam, 5));
  Train(src, 2, 9);
  for (DType to : {DType::kFloat16, DType::kBFloat16}) {
    const std::string path = dir.Sub(std::string("export_") + DTypeName(to));
    SaveOptions opts;
    opts.include_optimizer = false;
    opts.cast_values = true;
    opts.values_dtype = to;
    SaveCheckpoint(path, {{&src, "{}"}}, opts);
    const CheckpointInfo info = ReadCheckpointInfo(path);
    const TableEntry& e = info.tables.at(0);
    EMBEDCORE_EXPECT(!e.has_optimizer);
    EMBEDCORE_EXPECT(e.slots.empty());
    EMBEDCORE_EXPECT(e.values.at(0).dtype == to);
    EMBEDCORE_EXPECT(e.dtype == DType::kFloat32);  // the table's dtype when saved
    // Loaded into a float32 table: the values rounded to `to` and back.
    Table f32(Spec("emb", 40, 9, DType::kFloat32, OptimizerSpec::Kind::kSGD, 6));
    LoadTable(info, e, f32, true);  // no optimizer state saved: values only
    std::vector<float> want(40 * 9), got(40 * 9);
    src.ReadValues(0, 40, want.data());
    f32.ReadValues(0, 40, got.data());
    Table rounded(Spec("emb", 40, 9, to, OptimizerSpec::Kind::kSGD, 6));
    rounded.AssignValues(0, 40, want.data());
    rounded.ReadValues(0, 40, want.data());
    int64_t diffs = 0;
    for (size_t i = 0; i < got.size(); ++i) diffs += embedcore_test::Bits(got[i]) != embedcore_test::Bits(want[i]);
    EMBEDCORE_EXPECT_EQ(diffs, int64_t(0));
    // And into a table of `to` itself: the same bits as a direct store.
    Table same(Spec("emb", 40, 9, to, OptimizerSpec::Kind::kSGD, 7));
    LoadTable(info, e, same, false);
    EMBEDCORE_EXPECT(RawValues(same) == RawValues(rounded));
    EMBEDCORE_EXPECT_EQ(f32.step(), int64_t(0));
  }
}

// Tables of any dtype are cast on export: 16-bit values widened to float32
// exactly (and loaded back into a table of their dtype bit for bit), bfloat16
// rounded to float16 where it fits, refused (naming the value) where not.
EMBEDCORE_TEST(SixteenBitTablesAreCastOnExport) {
  TempDir dir;
  SaveOptions widen;
  widen.include_optimizer = false;
  widen.cast_values = true;
  widen.values_dtype = DType::kFloat32;
  for (DType from : {DType::kFloat16, DType::kBFloat16}) {
    Table half(Spec("h", 50, 7, from, OptimizerSpec::Kind::kAdagrad, 1));
    Train(half, 2, 3);
    const std::string path = dir.Sub(std::string("wide_") + DTypeName(from));
    SaveCheckpoint(path, {{&half, "{}"}}, widen);
    const CheckpointInfo info = ReadCheckpointInfo(path);
    const FileEntry& f = info.tables.at(0).values.at(0);
    EMBEDCORE_EXPECT(f.dtype == DType::kFloat32);
    EMBEDCORE_EXPECT(info.tables.at(0).dtype == from);
    std::vector<float> held(50 * 7), stored(50 * 7);
    half.ReadValues(0, 50, held.data());
    const std::vector<char> raw = ReadFile(path + "/" + f.path);
    std::memcpy(stored.data(), raw.data() + ck::kDataOffset, stored.size() * 4);
    EMBEDCORE_EXPECT(stored == held);
    Table back(Spec("h", 50, 7, from, OptimizerSpec::Kind::kSGD, 9));
    LoadTable(info, info.tables.at(0), back, false);
    EMBEDCORE_EXPECT(RawValues(back) == RawValues(half));
    VerifyCheckpoint(info, true);
  }
  Table bf(Spec("b", 4, 3, DType::kBFloat16, OptimizerSpec::Kind::kSGD, 1));
  SaveOptions narrow = widen;
  narrow.values_dtype = DType::kFloat16;
  SaveCheckpoint(dir.Sub("bf_to_half"), {{&bf, "{}"}}, narrow);
  const std::vector<float> big = {1, 2, 3, 4, 5, 6, 7, 7e4f, 9, 10, 11, 12};
  bf.AssignValues(0, 4, big.data());
  EMBEDCORE_EXPECT_THROWS(SaveCheckpoint(dir.Sub("bf_to_half"), {{&bf, "{}"}}, narrow), InvalidArgument,
                          "table 'b' values hold 70144 at row 2, column 1, beyond the range of float16");
}

// A checkpoint holds finite values and slots only: a save that meets inf or
// NaN (values or a slot, stored as they are or cast, in a whole table or a
// shard) refuses, naming the first in the file by the table's row and column,
// and the directory keeps the checkpoint it had.
EMBEDCORE_TEST(ValuesThatAreNotFiniteFailTheSave) {
  TempDir dir;
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  Table good(Spec("t", 30000, 40, DType::kFloat32, OptimizerSpec::Kind::kAdagrad, 1));
  SaveCheckpoint(dir.Sub("c"), {{&good, "{}"}}, SaveOptions{});
  const std::vector<std::string> before = DirNames(dir.Sub("c"));
  const std::vector<char> manifest = ReadFile(dir.Sub("c") + "/MANIFEST");
  auto unchanged = [&] {
    EMBEDCORE_EXPECT(DirNames(dir.Sub("c")) == before);
    EMBEDCORE_EXPECT(ReadFile(dir.Sub("c") + "/MANIFEST") == manifest);
  };
  SaveOptions f16, rowwise8;
  f16.cast_values = rowwise8.cast_values = true;
  f16.values_dtype = DType::kFloat16;
  rowwise8.values_dtype = DType::kUInt8Rowwise;
  rowwise8.include_optimizer = false;
  const std::string tail = ": a checkpoint holds finite values only (a training step that diverged?)";
  for (DType dtype : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    for (float bad : {nan, inf, -inf}) {
      Table t(Spec("t", 30000, 40, dtype, OptimizerSpec::Kind::kAdagrad, 1));
      // Two values, in two blocks of 4 MiB (two threads) in float32, in two pieces of 256 KiB in 16 bits: the
      // first is named.
      char* v = static_cast<char*>(t.values());
      const size_t es = DTypeSize(dtype);
      auto poke = [&](int64_t row, int64_t col, float x) {
        kernels::ActiveKernels().dtype[int(dtype)].store(v + size_t(row * 40 + col) * es, &x, 1);
      };
      poke(29000, 1, bad);
      poke(1234, 37, bad);
      const std::string what = "table 't' values hold " + std::string(std::isnan(bad) ? "nan" : bad > 0 ? "inf" : "-inf") +
                               " at row 1234, column 37" + tail;
      EMBEDCORE_EXPECT_THROWS(SaveCheckpoint(dir.Sub("c"), {{&t, "{}"}}, SaveOptions{}), InvalidArgument, what);
      unchanged();
      for (const SaveOptions* cast : {&f16, &rowwise8}) {
        if (cast == &f16 && dtype == DType::kFloat16) continue;  // (no cast)
        EMBEDCORE_EXPECT_THROWS(SaveCheckpoint(dir.Sub("c"), {{&t, "{}"}}, *cast), InvalidArgument,
                                "at row 1234, column 37" + tail);
        unchanged();
      }
    }
  }
  // A slot: named by its name; values only, the save goes through.
  Table slot(Spec("t", 30000, 40, DType::kFloat32, OptimizerSpec::Kind::kAdagrad, 1));
  slot.slot(0)[77 * 40 + 5] = nan;
  EMBEDCORE_EXPECT_THROWS(SaveCheckpoint(dir.Sub("c"), {{&slot, "{}"}}, SaveOptions{}), InvalidArgument,
                          "table 't' accumulators hold nan at row 77, column 5" + tail);
  unchanged();
  SaveOptions values_only;
  values_only.include_optimizer = false;
  EMBEDCORE_EXPECT_NO_THROW(SaveCheckpoint(dir.Sub("v"), {{&slot, "{}"}}, values_only));
  // A shard's file names the whole table's row and column.
  TableSpec spec = Spec("t", 100, 6, DType::kFloat32, OptimizerSpec::Kind::kSGD, 1);
  spec.full_dim = 10;
  spec.shard_row_start = 500;
  spec.shard_col_start = 4;
  Table shard(spec);
  static_cast<float*>(shard.values())[30 * 6 + 2] = -inf;
  const uint64_t g = NextGeneration(dir.Sub("s"));
  EMBEDCORE_EXPECT_THROWS(WriteShardFiles(dir.Sub("s"), g, "t00000.", 3, shard, 500, 4, SaveOptions{}),
                          InvalidArgument, "table 't' values hold -inf at row 530, column 6" + tail);
}

// ------------------------------------------------------------ uint8_rowwise (format 1.4)
namespace {
std::vector<uint8_t> Payload(const std::string& dir, const FileEntry& f) {
  const std::vector<char> raw = ReadFile(dir + "/" + f.path);
  return std::vector<uint8_t>(raw.begin() + ck::kDataOffset, raw.end());
}
SaveOptions Rowwise8Export(bool include_optimizer = false) {
  SaveOptions o;
  o.include_optimizer = include_optimizer;
  o.cast_values = true;
  o.values_dtype = DType::kUInt8Rowwise;
  return o;
}
}  // namespace

EMBEDCORE_TEST(Rowwise8ExportLayoutAndRounding) {
  TempDir dir;
  // Rows whose codes are known: 0..255 step 1 (scale 1: the epsilon vanishes in 255 + 1e-8), a constant row
  // (codes 0, scale 0), a two-value row (0 and 255), ties of the rounding (half-way codes round to even).
  const int64_t dim = 256;
  Table t(Spec("q", 4, dim, DType::kFloat32, OptimizerSpec::Kind::kAdagrad, 1));
  std::vector<float> v(size_t(4 * dim));
  for (int64_t d = 0; d < dim; ++d) {
    v[size_t(d)] = float(d) - 100.0f;
    v[size_t(dim + d)] = 2.5f;
    v[size_t(2 * dim + d)] = d % 2 ? 3.0f : -1.0f;
    v[size_t(3 * dim + d)] = d == 0 ? 0.0f : (d == 1 ? 255.0f : float(d % 6) * 0.5f);  // scale 1: x.5 ties
  }
  t.AssignValues(0, 4, v.data());
  SaveCheckpoint(dir.Sub("c"), {{&t, "{}"}}, Rowwise8Export(true));
  const CheckpointInfo info = ReadCheckpointInfo(dir.Sub("c"));
  EMBEDCORE_EXPECT_EQ(info.format_major, 1);
  EMBEDCORE_EXPECT(info.format_minor >= 4);  // the dtype since 1.4
  EMBEDCORE_EXPECT_EQ(info.format_minor, embedcore::kFormatMinor);
  const FileEntry& f = info.tables.at(0).values.at(0);
  EMBEDCORE_EXPECT(f.dtype == DType::kUInt8Rowwise);
  EMBEDCORE_EXPECT(info.tables.at(0).dtype == DType::kFloat32);
  EMBEDCORE_EXPECT_EQ(f.bytes, uint64_t(4096 + 4 * (dim + 8)));
  EMBEDCORE_EXPECT_EQ(std::string(DTypeName(f.dtype)), std::string("uint8_rowwise"));
  const std::vector<char> raw = ReadFile(dir.Sub("c") + "/" + f.path);
  ck::FileHeader h;
  std::memcpy(&h, raw.data(), sizeof(h));
  EMBEDCORE_EXPECT_EQ(int(h.dtype), 3);
  EMBEDCORE_EXPECT_EQ(h.payload_bytes, uint64_t(4 * (dim + 8)));
  const std::vector<uint8_t> p = Payload(dir.Sub("c"), f);
  const int64_t rb = dim + 8;
  for (int64_t d = 0; d < dim; ++d) {
    EMBEDCORE_EXPECT_EQ(int(p[size_t(d)]), int(d));
    EMBEDCORE_EXPECT_EQ(int(p[size_t(rb + d)]), 0);
    EMBEDCORE_EXPECT_EQ(int(p[size_t(2 * rb + d)]), d % 2 ? 255 : 0);
    const float x = v[size_t(3 * dim + d)];
    EMBEDCORE_EXPECT_EQ(int(p[size_t(3 * rb + d)]), int(std::nearbyint(x)));  // 0.5 -> 0, 1.5 -> 2, 2.5 -> 2
  }
  EMBEDCORE_EXPECT_BITS_EQ(rowwise8::Scale(&p[0], dim), 1.0f);
  EMBEDCORE_EXPECT_BITS_EQ(rowwise8::Bias(&p[0], dim), -100.0f);
  EMBEDCORE_EXPECT_BITS_EQ(rowwise8::Scale(&p[size_t(rb)], dim), 0.0f);
  EMBEDCORE_EXPECT_BITS_EQ(rowwise8::Bias(&p[size_t(rb)], dim), 2.5f);
  EMBEDCORE_EXPECT_BITS_EQ(rowwise8::Scale(&p[size_t(2 * rb)], dim), 4.0f / 255.0f);
  EMBEDCORE_EXPECT_EQ(int(p[size_t(3 * rb + 3)]), 2);  // 1.5 rounds to even
  EMBEDCORE_EXPECT_EQ(int(p[size_t(3 * rb + 5)]), 2);  // 2.5 rounds to even
  // Slots stay float32; the whole checkpoint loads: values dequantized (one rounding), slots as saved.
  EMBEDCORE_EXPECT(info.tables.at(0).slots.at(0).at(0).dtype == DType::kFloat32);
  VerifyCheckpoint(info, true);
  for (DType to : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    Table back(Spec("q", 4, dim, to, OptimizerSpec::Kind::kAdagrad, 9));
    LoadTable(info, info.tables.at(0), back, true);
    std::vector<float> want(size_t(4 * dim)), got(size_t(4 * dim));
    for (int64_t r = 0; r < 4; ++r) rowwise8::DequantizeRow8(&p[size_t(r * rb)], dim, &want[size_t(r * dim)]);
    Table rounded(Spec("q", 4, dim, to, OptimizerSpec::Kind::kSGD, 9));
    rounded.AssignValues(0, 4, want.data());
    EMBEDCORE_EXPECT(RawValues(back) == RawValues(rounded));
    EMBEDCORE_EXPECT(SlotCopy(back, 0) == SlotCopy(t, 0));
  }
  // Served: values() are the stored rows; ReadValues dequantizes.
  const MappedCheckpoint m(dir.Sub("c"), MappedCheckpoint::Verify::kEager);
  EMBEDCORE_EXPECT(std::memcmp(m.values(0), p.data(), p.size()) == 0);
  std::vector<float> served(size_t(4 * dim));
  m.ReadValues(0, served.data());
  EMBEDCORE_EXPECT_BITS_EQ(served[5], -95.0f);
  EMBEDCORE_EXPECT_BITS_EQ(served[size_t(dim + 7)], 2.5f);
  EMBEDCORE_EXPECT_BITS_EQ(served[size_t(2 * dim + 1)], std::fmaf(255.0f, 4.0f / 255.0f, -1.0f));
}

EMBEDCORE_TEST(Rowwise8RefusalsChangeNothing) {
  TempDir dir;
  // Not a table dtype.
  EMBEDCORE_EXPECT_THROWS(Table(Spec("t", 4, 4, DType::kUInt8Rowwise, OptimizerSpec::Kind::kSGD, 1)), InvalidArgument,
                          "uint8_rowwise is an export format of checkpoints, not a table dtype");
  EMBEDCORE_EXPECT_THROWS(ParseDType("uint8_rowwise"), InvalidArgument, "not a table dtype");
  EMBEDCORE_EXPECT(ParseValuesDType("uint8_rowwise") == DType::kUInt8Rowwise);
  EMBEDCORE_EXPECT_THROWS(ParseValuesDType("int8"), InvalidArgument, "'uint8_rowwise', got 'int8'");
  Table t(Spec("t", 30, 5, DType::kFloat32, OptimizerSpec::Kind::kSGD, 1));
  SaveCheckpoint(dir.Sub("c"), {{&t, "{}"}}, Rowwise8Export());
  const std::vector<std::string> before = DirNames(dir.Sub("c"));
  const std::vector<char> manifest = ReadFile(dir.Sub("c") + "/MANIFEST");
  // A value that is not finite, a range beyond float32.
  Table bad(Spec("t", 30, 5, DType::kFloat32, OptimizerSpec::Kind::kSGD, 1));
  static_cast<float*>(bad.values())[17 * 5 + 2] = std::numeric_limits<float>::quiet_NaN();
  EMBEDCORE_EXPECT_THROWS(SaveCheckpoint(dir.Sub("c"), {{&bad, "{}"}}, Rowwise8Export()), InvalidArgument,
                          "table 't' values hold nan at row 17, column 2");
  static_cast<float*>(bad.values())[17 * 5 + 2] = 3e38f;
  static_cast<float*>(bad.values())[17 * 5 + 3] = -3e38f;
  EMBEDCORE_EXPECT_THROWS(SaveCheckpoint(dir.Sub("c"), {{&bad, "{}"}}, Rowwise8Export()), InvalidArgument,
                          "table 't' values row 17 spans a range (max - min) beyond float32");
  EMBEDCORE_EXPECT(DirNames(dir.Sub("c")) == before);
  EMBEDCORE_EXPECT(ReadFile(dir.Sub("c") + "/MANIFEST") == manifest);
  // A column shard: whole rows only.
  TableSpec shard = Spec("t", 30, 3, DType::kFloat32, OptimizerSpec::Kind::kSGD, 1);
  shard.full_dim = 5;
  shard.shard_col_start = 2;
  Table cols(shard);
  const uint64_t g = NextGeneration(dir.Sub("s"));
  EMBEDCORE_EXPECT_THROWS(WriteShardFiles(dir.Sub("s"), g, "t00000.", 1, cols, 0, 2, Rowwise8Export()),
                          InvalidArgument, "is a column shard (columns [2, 5) of 5)");
  // 16-bit tables quantize what they hold.
  Table half(Spec("h", 6, 9, DType::kFloat16, OptimizerSpec::Kind::kSGD, 4));
  SaveCheckpoint(dir.Sub("h"), {{&half, "{}"}}, Rowwise8Export());
  const CheckpointInfo info = ReadCheckpointInfo(dir.Sub("h"));
  const std::vector<uint8_t> p = Payload(dir.Sub("h"), info.tables.at(0).values.at(0));
  std::vector<float> held(6 * 9);
  half.ReadValues(0, 6, held.data());
  std::vector<uint8_t> want(6 * 17);
  for (int r = 0; r < 6; ++r) rowwise8::QuantizeRow8(&held[size_t(r * 9)], 9, &want[size_t(r * 17)]);
  EMBEDCORE_EXPECT(p == want);
}

EMBEDCORE_TEST(Rowwise8ForgedFilesAreRefused) {
  TempDir dir;
  Table t(Spec("t", 20, 4, DType::kFloat32, OptimizerSpec::Kind::kSGD, 2));
  SaveCheckpoint(dir.Sub("c"), {{&t, "{}"}}, Rowwise8Export());
  CheckpointInfo info = ReadCheckpointInfo(dir.Sub("c"));
  FileEntry& f = info.tables.at(0).values.at(0);
  // Row 9's scale made infinite, its checksum made to match: verify and load refuse it, naming the row.
  std::vector<char> raw = ReadFile(dir.Sub("c") + "/" + f.path);
  const float inf = std::numeric_limits<float>::infinity();
  std::memcpy(&raw[size_t(ck::kDataOffset + 9 * 12 + 4)], &inf, 4);
  WriteFile(dir.Sub("c") + "/" + f.path, raw);
  f.crc32c[0] = Crc32c(raw.data() + ck::kDataOffset, raw.size() - ck::kDataOffset);
  EMBEDCORE_EXPECT_THROWS(VerifyCheckpoint(info, false), CheckpointError, "uint8_rowwise row 9 has scale inf");
  Table target(Spec("t", 20, 4, DType::kFloat32, OptimizerSpec::Kind::kSGD, 5));
  const TableState before = StateOf(target);
  EMBEDCORE_EXPECT_THROWS(LoadTable(info, info.tables.at(0), target, false), CheckpointError, "row 9 has scale inf");
  EMBEDCORE_EXPECT(StateOf(target) == before);
  // A manifest that gives a uint8_rowwise file part of the columns is refused by the reader.
  CheckpointInfo wide = info;
  wide.tables.at(0).dim = 6;
  EMBEDCORE_EXPECT_THROWS(ck::ParseManifest("m", ck::BuildManifest(wide)), CheckpointError,
                          "a uint8_rowwise file holds whole rows");
}

EMBEDCORE_TEST(LoadConvertsBetweenDtypes) {
  TempDir dir;
  Table bf(Spec("x", 25, 6, DType::kBFloat16, OptimizerSpec::Kind::kSGD, 2));
  SaveCheckpoint(dir.Sub("c"), {{&bf, "{}"}}, SaveOptions{});
  const CheckpointInfo info = ReadCheckpointInfo(dir.Sub("c"));
  Table f32(Spec("x", 25, 6, DType::kFloat32, OptimizerSpec::Kind::kSGD, 3));
  LoadTable(info, info.tables[0], f32, true);
  std::vector<float> a(150), b(150);
  bf.ReadValues(0, 25, a.data());
  f32.ReadValues(0, 25, b.data());
  EMBEDCORE_EXPECT(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);  // bfloat16 -> float32 is exact
}

EMBEDCORE_TEST(LookupAfterLoadEqualsOriginal) {
  auto s = SaveOne(OptimizerSpec::Kind::kFTRL, 300, 16);
  TableSpec spec = s->table->spec();
  spec.initializer.seed = 99;
  Table dst(spec);
  LoadTable(s->info, s->info.tables[0], dst, true);
  std::vector<int64_t> ids = {0, 5, 299, 5, 17, 42, 42, 42};
  std::vector<int64_t> offsets = {0, 3, 3, 8};
  Batch b;
  b.ids = ids.data();
  b.nnz = int64_t(ids.size());
  b.offsets = offsets.data();
  b.num_bags = 3;
  std::vector<float> o1(3 * 16), o2(3 * 16);
  s->table->Lookup(b, OutputShape{Combiner::kSqrtn, 0}, o1.data());
  dst.Lookup(b, OutputShape{Combiner::kSqrtn, 0}, o2.data());
  EMBEDCORE_EXPECT(std::memcmp(o1.data(), o2.data(), o1.size() * sizeof(float)) == 0);
}

// ------------------------------------------------------------ what the loader refuses
EMBEDCORE_TEST(LoadRefusesMismatchedTables) {
  auto s = SaveOne(OptimizerSpec::Kind::kAdagrad, 50, 7);
  const TableEntry& e = s->info.tables[0];
  Table wrong_rows(Spec("item", 51, 7, DType::kFloat32, OptimizerSpec::Kind::kAdagrad, 1));
  EMBEDCORE_EXPECT_THROWS(LoadTable(s->info, e, wrong_rows, true), CheckpointError, "is 50 x 7");
  Table wrong_dim(Spec("item", 50, 8, DType::kFloat32, OptimizerSpec::Kind::kAdagrad, 1));
  EMBEDCORE_EXPECT_THROWS(CheckLoadable(s->info, e, wrong_dim, false), CheckpointError, "50 x 8");
  Table adam(Spec("item", 50, 7, DType::kFloat32, OptimizerSpec::Kind::kAdam, 1));
  const TableState before = StateOf(adam);
  EMBEDCORE_EXPECT_THROWS(LoadTable(s->info, e, adam, true), CheckpointError, "include_optimizer=False");
  EMBEDCORE_EXPECT(StateOf(adam) == before);
  EMBEDCORE_EXPECT_NO_THROW(LoadTable(s->info, e, adam, false));  // values only: fine
  EMBEDCORE_EXPECT(RawValues(adam) == RawValues(*s->table));
}

EMBEDCORE_TEST(CorruptPayloadLeavesTargetUnchanged) {
  auto s = SaveOne(OptimizerSpec::Kind::kAdam, 64, 8);
  const TableEntry& e = s->info.tables[0];
  Table dst(Spec("item", 64, 8, DType::kFloat32, OptimizerSpec::Kind::kAdam, 77));
  const TableState before = StateOf(dst);
  // A flipped byte in the values payload, then in a slot.
  const std::string values_file = s->path + "/" + e.values[0].path;
  FlipByte(values_file, ck::kDataOffset + 123);
  EMBEDCORE_EXPECT_THROWS(LoadTable(s->info, e, dst, true), CheckpointError, "checksum mismatch in block 0");
  EMBEDCORE_EXPECT_THROWS(VerifyCheckpoint(s->info, false), CheckpointError, e.values[0].path);
  EMBEDCORE_EXPECT(StateOf(dst) == before);
  FlipByte(values_file, ck::kDataOffset + 123);  // repaired
  EMBEDCORE_EXPECT_NO_THROW(VerifyCheckpoint(s->info, true));

  const std::string slot_file = s->path + "/" + e.slots[1][0].path;
  FlipByte(slot_file, ck::kDataOffset + 8 * 64 * 4 - 1);  // the last byte
  EMBEDCORE_EXPECT_THROWS(LoadTable(s->info, e, dst, true), CheckpointError, "checksum mismatch");
  EMBEDCORE_EXPECT(StateOf(dst) == before);
  EMBEDCORE_EXPECT_NO_THROW(LoadTable(s->info, e, dst, false));  // the values are fine
  EMBEDCORE_EXPECT_THROWS(VerifyTable(s->info, e, true, false), CheckpointError, e.slots[1][0].path);
  EMBEDCORE_EXPECT_NO_THROW(VerifyTable(s->info, e, false, false));
}

EMBEDCORE_TEST(CorruptHeadersAndPadding) {
  auto s = SaveOne();
  const TableEntry& e = s->info.tables[0];
  const std::string file = s->path + "/" + e.values[0].path;
  const std::vector<char> good = ReadFile(file);
  // Any header byte (the header checksum covers it), and the padding.
  for (uint64_t off : {uint64_t(0), uint64_t(9), uint64_t(21), uint64_t(30), uint64_t(57), uint64_t(62),
                       uint64_t(64), uint64_t(4095)}) {
    FlipByte(file, off);
    EMBEDCORE_EXPECT_THROWS(VerifyTable(s->info, e, false, false), CheckpointError, e.values[0].path);
    WriteFile(file, good);
  }
  EMBEDCORE_EXPECT_NO_THROW(VerifyTable(s->info, e, false, false));
}

EMBEDCORE_TEST(TruncatedAndMissingFiles) {
  auto s = SaveOne();
  const TableEntry& e = s->info.tables[0];
  const std::string file = s->path + "/" + e.values[0].path;
  const std::vector<char> good = ReadFile(file);
  WriteFile(file, std::vector<char>(good.begin(), good.end() - 1));
  EMBEDCORE_EXPECT_THROWS(ReadCheckpointInfo(s->path), CheckpointError, "(truncated)");
  EMBEDCORE_EXPECT_THROWS(VerifyTable(s->info, e, false, false), CheckpointError, "truncated");
  std::vector<char> longer = good;
  longer.push_back(0);
  WriteFile(file, longer);
  EMBEDCORE_EXPECT_THROWS(ReadCheckpointInfo(s->path), CheckpointError, "the manifest says");
  ::unlink(file.c_str());
  EMBEDCORE_EXPECT_THROWS(ReadCheckpointInfo(s->path), CheckpointError, "missing file");
  WriteFile(file, good);
  EMBEDCORE_EXPECT_NO_THROW(ReadCheckpointInfo(s->path));

  EMBEDCORE_EXPECT_THROWS(ReadCheckpointInfo(s->dir.Sub("nowhere")), CheckpointError, "no such checkpoint directory");
  EMBEDCORE_EXPECT_THROWS(ReadCheckpointInfo(file), CheckpointError, "not a checkpoint directory");
  const std::string empty = s->dir.Sub("empty");
  ::mkdir(empty.c_str(), 0755);
  EMBEDCORE_EXPECT_THROWS(ReadCheckpointInfo(empty), CheckpointError, "MANIFEST: missing file");
}

EMBEDCORE_TEST(CorruptManifest) {
  auto s = SaveOne();
  const std::string manifest = s->path + "/MANIFEST";
  const std::vector<char> good = ReadFile(manifest);
  FlipByte(manifest, 64 + 10);  // in the JSON
  EMBEDCORE_EXPECT_THROWS(ReadCheckpointInfo(s->path), CheckpointError, "checksum mismatch: the manifest is corrupt");
  WriteFile(manifest, good);
  FlipByte(manifest, 3);  // the magic
  EMBEDCORE_EXPECT_THROWS(ReadCheckpointInfo(s->path), CheckpointError, "wrong magic");
  WriteFile(manifest, good);
  FlipByte(manifest, 50);  // payload_bytes: caught by the header checksum
  EMBEDCORE_EXPECT_THROWS(ReadCheckpointInfo(s->path), CheckpointError, "header checksum mismatch");
  WriteFile(manifest, std::vector<char>(good.begin(), good.end() - 5));
  EMBEDCORE_EXPECT_THROWS(ReadCheckpointInfo(s->path), CheckpointError, "truncated");
  WriteFile(manifest, std::vector<char>(good.begin(), good.begin() + 20));
  EMBEDCORE_EXPECT_THROWS(ReadCheckpointInfo(s->path), CheckpointError, "truncated");
  WriteFile(manifest, {});
  EMBEDCORE_EXPECT_THROWS(ReadCheckpointInfo(s->path), CheckpointError, "truncated");

  // A newer major version, with a valid header checksum: refused by name.
  std::vector<char> newer = good;
  ck::FileHeader h;
  std::memcpy(&h, newer.data(), sizeof(h));
  h.format_major = 2;
  h.header_crc32c = ck::Crc32c(&h, 60);
  std::memcpy(newer.data(), &h, sizeof(h));
  WriteFile(manifest, newer);
  EMBEDCORE_EXPECT_THROWS(ReadCheckpointInfo(s->path), CheckpointError, "newer than this library reads");
  // A huge claimed size is refused before any allocation.
  std::memcpy(&h, good.data(), sizeof(h));
  h.payload_bytes = uint64_t(1) << 40;
  h.header_crc32c = ck::Crc32c(&h, 60);
  std::vector<char> huge = good;
  std::memcpy(huge.data(), &h, sizeof(h));
  WriteFile(manifest, huge);
  EMBEDCORE_EXPECT_THROWS(ReadCheckpointInfo(s->path), CheckpointError, "over the limit");
  WriteFile(manifest, good);
  EMBEDCORE_EXPECT_NO_THROW(ReadCheckpointInfo(s->path));
}

namespace {
std::string Replace(std::string s, const std::string& from, const std::string& to) {
  const size_t at = s.find(from);
  if (at == std::string::npos) throw std::runtime_error("manifest lacks " + from);
  return s.replace(at, from.size(), to);
}
}  // namespace

EMBEDCORE_TEST(ForgedManifestFields) {
  // ParseManifest sees the JSON as untrusted: every forged field is refused
  // with the field named.
  auto s = SaveOne(OptimizerSpec::Kind::kAdagrad, 50, 7);
  const std::string json = s->info.manifest_json;
  const std::string path = s->info.tables[0].values[0].path;
  EMBEDCORE_EXPECT_NO_THROW(ck::ParseManifest("M", json));
  struct Case {
    std::string from, to, expect;
  };
  const std::vector<Case> cases = {
      {"\"" + path + "\"", "\"../" + path + "\"", "not a plain file name"},
      {"\"" + path + "\"", "\"/etc/passwd\"", "not a plain file name"},
      {"\"" + path + "\"", "\"a/b.ecd\"", "not a plain file name"},
      {"\"" + path + "\"", "\"..\"", "not a plain file name"},
      {"\"" + path + "\"", "\"\"", "not a plain file name"},
      {"\"format\": \"embedcore.checkpoint\"", "\"format\": \"other\"", "manifest.format"},
      {"\"format_version\": [", "\"format_version\": [9, 0], \"x\": [", "newer than this library reads"},
      {"\"byte_order\": \"little\"", "\"byte_order\": \"big\"", "byte_order"},
      {"\"rows\": 50", "\"rows\": -50", "tables[0].rows"},
      {"\"rows\": 50", "\"rows\": 4611686018427387904", "too large"},
      {"\"dim\": 7", "\"dim\": \"7\"", "tables[0].dim must be an integer"},
      {"\"dtype\": \"float32\"", "\"dtype\": \"float64\"", "unknown dtype"},
      {"\"block_bytes\": 4194304", "\"block_bytes\": 4194303", "power of two"},
      {"\"block_bytes\": 4194304", "\"block_bytes\": 16", "block_bytes"},
      {"\"cols\": 7", "\"cols\": 8", "cols"},
      {"\"row_start\": 0", "\"row_start\": 1", "values[0].rows = 50 is outside [1, 49]"},
      {"\"row_start\": 0", "\"row_start\": 50", "values[0].row_start = 50 is outside [0, 49]"},
      {"\"kind\": \"adagrad\"", "\"kind\": 7", "optimizer.kind must be a string"},
      {"\"initial_accumulator_value\":", "\"initial_accumulator_value\": -1, \"x\":", "initial_accumulator_value"},
      {"\"step\": 3", "\"step\": -3", "step"},
      {"\"step\": 3", "\"step\": 4611686018427387905",
       "step = 4611686018427387905 is outside [0, 4611686018427387904]"},
      {"\"generation\": 1", "\"generation\": 1000000000000000000", "generation = 1000000000000000000 is outside"},
      {"\"generation\": 1", "\"generation\": 9223372036854775807", "generation = 9223372036854775807 is outside"},
      // Version numbers that do not fit the headers' 16 bits are refused, not truncated (2^32 + 1 would read as 1).
      {"\"format_version\": [", "\"format_version\": [4294967297, 0], \"x\": [", "format_version[0] = 4294967297"},
      {"\"format_version\": [", "\"format_version\": [1, 4294967298], \"x\": [", "format_version[1] = 4294967298"},
      {"\"format_version\": [", "\"format_version\": [1, -1], \"x\": [", "format_version[1] = -1"},
      // An empty file in the tiling: no writer makes one, and serving could not find rows by row_start.
      {"\"values\": [", "\"values\": [{\"path\": \"z.ecd\", \"bytes\": 4096, \"dtype\": \"float32\", \"row_start\": 0, "
                        "\"rows\": 0, \"cols\": 7, \"block_bytes\": 4096, \"crc32c\": []}, ",
       "values[0].rows = 0 is outside [1, 50]"},
      {"\"accumulators\"", "\"momenta\"", "slots"},
      {"\"generation\": 1", "\"generation\": 1.5", "generation must be an integer"},
      {"\"metadata\": {", "\"metadata\": [{", "JSON"},
      // A name given twice in one object: readers differ on which value holds (objects side by side may share
      // names, as every file entry has a "path").
      {"\"rows\": 50", "\"rows\": 50, \"rows\": 50", "the key \"rows\" twice in one object"},
      {"\"kind\": \"adagrad\"", "\"kind\": \"adagrad\", \"kind\": \"sgd\"", "the key \"kind\" twice"},
      {"\"generation\": 1", "\"generation\": 1, \"generation\": 2", "the key \"generation\" twice"},
  };
  for (const Case& c : cases) {
    std::string forged;
    try {
      forged = Replace(json, c.from, c.to);
    } catch (const std::exception& e) {
      embedcore_test::Fail(__FILE__, __LINE__, std::string("test setup: ") + e.what());
      continue;
    }
    EMBEDCORE_EXPECT_THROWS(ck::ParseManifest("M", forged), CheckpointError, c.expect);
  }
  // A long key given twice is quoted in part: 200 bytes and "...", cut before a UTF-8 character, not inside it.
  {
    // The quoted key is '"', 'k', 197 'a's, then the two bytes of "é" at 199 and 200: a cut at 200 would split
    // it, so it cuts at 199.
    const std::string key = "k" + std::string(197, 'a') + "\xC3\xA9" + std::string(100000, 'b');
    std::string message;
    try {
      ck::ParseManifest("M", Replace(json, "\"rows\": 50", "\"" + key + "\": 1, \"" + key + "\": 2, \"rows\": 50"));
    } catch (const CheckpointError& e) {
      message = e.what();
    }
    EMBEDCORE_EXPECT(message == "M: the manifest gives the key \"k" + std::string(197, 'a') + "... twice in one object");
  }
  // Not JSON at all, or not an object.
  EMBEDCORE_EXPECT_THROWS(ck::ParseManifest("M", "{"), CheckpointError, "not valid JSON");
  EMBEDCORE_EXPECT_THROWS(ck::ParseManifest("M", "[]"), CheckpointError, "M:");
  EMBEDCORE_EXPECT_THROWS(ck::ParseManifest("M", ""), CheckpointError, "not valid JSON");
  // A file's size that does not fit its shape.
  const std::string bytes = "\"bytes\": " + std::to_string(s->info.tables[0].values[0].bytes);
  EMBEDCORE_EXPECT_THROWS(ck::ParseManifest("M", Replace(json, bytes, "\"bytes\": 4096")), CheckpointError,
                          "does not fit");
  // More checksums than blocks.
  const std::string crc = "\"crc32c\": [";
  EMBEDCORE_EXPECT_THROWS(ck::ParseManifest("M", Replace(json, crc, crc + "1, ")), CheckpointError, "crc32c");
  // Two tables of one name: a load and a server would each pick one.
  CheckpointInfo twice = s->info;
  twice.tables.push_back(twice.tables[0]);
  EMBEDCORE_EXPECT_THROWS(ck::ParseManifest("M", ck::BuildManifest(twice)), CheckpointError,
                          "tables[1].name 'item' names two tables");
}

EMBEDCORE_TEST(NewerOptimizerReadsAsValuesOnly) {
  // A newer writer's optimizer: its values load, its state is refused by
  // name, its slot files stay listed (for verify), and it is never re-written.
  auto s = SaveOne(OptimizerSpec::Kind::kAdagrad, 50, 7);
  const std::string json =
      Replace(Replace(s->info.manifest_json, "\"kind\": \"adagrad\"", "\"kind\": \"lion\", \"new_option\": [1]"),
              "\"accumulators\"", "\"lion_m\"");
  const CheckpointInfo info = ck::ParseManifest("M", json);
  const TableEntry& e = info.tables[0];
  EMBEDCORE_EXPECT_EQ(e.unknown_optimizer, std::string("lion"));
  EMBEDCORE_EXPECT(!e.has_optimizer);
  EMBEDCORE_EXPECT(e.slot_names == std::vector<std::string>{"lion_m"});
  EMBEDCORE_EXPECT_EQ(e.slots.size(), size_t(1));
  EMBEDCORE_EXPECT_EQ(e.slots[0][0].cols, int64_t(7));
  Table dst(s->table->spec());
  EMBEDCORE_EXPECT_THROWS(CheckLoadable(s->info, e, dst, true), CheckpointError, "optimizer 'lion'");
  EMBEDCORE_EXPECT_THROWS(LoadTable(s->info, e, dst, true), CheckpointError, "include_optimizer=False");
  EMBEDCORE_EXPECT_EQ(dst.step(), int64_t(0));
  CheckpointInfo with_path = info;
  with_path.path = s->path;
  LoadTable(with_path, e, dst, false);
  for (int64_t i = 0; i < 50 * 7; ++i)
    EMBEDCORE_EXPECT_EQ(static_cast<const float*>(dst.values())[i], static_cast<const float*>(s->table->values())[i]);
  EMBEDCORE_EXPECT_THROWS(ck::BuildManifest(info), InvalidArgument, "'lion' is unknown to this version");
  // Its slots must still be arrays no wider than the table.
  const size_t slot = json.find("\"lion_m\"");
  const std::string wide = json.substr(0, slot) + Replace(json.substr(slot), "\"cols\": 7", "\"cols\": 8");
  EMBEDCORE_EXPECT_THROWS(ck::ParseManifest("M", wide), CheckpointError, "slots.lion_m[0].cols");
}

EMBEDCORE_TEST(ManifestRoundTrip) {
  auto s = SaveOne(OptimizerSpec::Kind::kFTRL, 20, 3);
  const CheckpointInfo again = ck::ParseManifest("M", ck::BuildManifest(s->info));
  EMBEDCORE_EXPECT_EQ(again.generation, s->info.generation);
  EMBEDCORE_EXPECT_EQ(again.tables.size(), size_t(1));
  const TableEntry &a = again.tables[0], &b = s->info.tables[0];
  EMBEDCORE_EXPECT_EQ(a.name, b.name);
  EMBEDCORE_EXPECT_EQ(a.values[0].crc32c.size(), b.values[0].crc32c.size());
  EMBEDCORE_EXPECT(a.values[0].crc32c == b.values[0].crc32c);
  EMBEDCORE_EXPECT(a.slot_names == b.slot_names);
  EMBEDCORE_EXPECT_EQ(a.optimizer.l1, b.optimizer.l1);
  EMBEDCORE_EXPECT_EQ(a.optimizer.learning_rate_power, b.optimizer.learning_rate_power);
  EMBEDCORE_EXPECT_EQ(a.config_json, b.config_json);
}

// Every OptimizerSpec field, for the round trip below: a field added to
// OptimizerSpec belongs here (and in docs/format.md's optimizer keys).
#define EMBEDCORE_OPTIMIZER_FIELDS(X)                                                                    \
  X(initial_accumulator_value) X(beta_1) X(beta_2) X(epsilon) X(adagrad_epsilon) X(lazy_adam)             \
  X(sum_inside_sqrt) X(bias_correction) X(learning_rate_power) X(l1) X(l2) X(beta)                        \
  X(multiply_linear_by_learning_rate) X(has_clip_weight_min) X(clip_weight_min) X(has_clip_weight_max)    \
  X(clip_weight_max) X(has_clipvalue) X(clip_gradient_min) X(clip_gradient_max) X(weight_decay_factor)   \
  X(multiply_weight_decay_factor_by_learning_rate)

EMBEDCORE_TEST(ManifestRoundTripsEveryOptimizerField) {
  // The manifest records every hyper-parameter of the update rule
  // (docs/format.md): what a load, a server or a save that keeps another
  // table's entries (Saver.dump_to_file) rebuilds the optimizer from. Each
  // field is set away from its default, for every kind, so a field written
  // but not read back (the reader keeping the default) is caught.
  OptimizerSpec set;
  set.initial_accumulator_value = 0.375f;
  set.beta_1 = 0.75f;
  set.beta_2 = 0.875f;
  set.epsilon = 1e-3f;
  set.adagrad_epsilon = 0.125f;
  set.lazy_adam = false;
  set.sum_inside_sqrt = false;
  set.bias_correction = true;
  set.learning_rate_power = -0.25f;
  set.l1 = 0.5f;
  set.l2 = 0.625f;
  set.beta = 1.5f;
  set.multiply_linear_by_learning_rate = true;
  set.has_clip_weight_min = true;
  set.clip_weight_min = -2.5f;
  set.has_clip_weight_max = true;
  set.clip_weight_max = 3.5f;
  set.has_clipvalue = true;
  set.clip_gradient_min = -0.75f;
  set.clip_gradient_max = 0.5f;
  set.weight_decay_factor = 0.0625f;
  set.multiply_weight_decay_factor_by_learning_rate = true;
  const OptimizerSpec defaults;
#define EMBEDCORE_EXPECT_NOT_DEFAULT(f) EMBEDCORE_EXPECT(set.f != defaults.f);
  EMBEDCORE_OPTIMIZER_FIELDS(EMBEDCORE_EXPECT_NOT_DEFAULT)
#undef EMBEDCORE_EXPECT_NOT_DEFAULT
  for (const auto kind : {OptimizerSpec::Kind::kSGD, OptimizerSpec::Kind::kAdagrad, OptimizerSpec::Kind::kAdam,
                          OptimizerSpec::Kind::kFTRL, OptimizerSpec::Kind::kRowwiseAdagrad}) {
    auto s = SaveOne(kind, 20, 3);
    CheckpointInfo info = s->info;
    OptimizerSpec& o = info.tables[0].optimizer;
    EMBEDCORE_EXPECT(o.kind == kind);
    o = set;
    o.kind = kind;
    const std::string json = ck::BuildManifest(info);
    // The documented keys, the flags with their values.
    for (const char* key : {"initial_accumulator_value", "beta_1", "beta_2", "epsilon", "adagrad_epsilon",
                            "lazy_adam", "sum_inside_sqrt", "bias_correction", "learning_rate_power", "l1", "l2",
                            "beta", "multiply_linear_by_learning_rate", "clip_weight_min", "clip_weight_max",
                            "clipvalue", "weight_decay_factor", "multiply_weight_decay_factor_by_learning_rate"})
      EMBEDCORE_EXPECT(json.find("\"" + std::string(key) + "\": ") != std::string::npos);
    for (const char* flag : {"\"lazy_adam\": false", "\"sum_inside_sqrt\": false", "\"bias_correction\": true",
                             "\"multiply_linear_by_learning_rate\": true",
                             "\"multiply_weight_decay_factor_by_learning_rate\": true"})
      EMBEDCORE_EXPECT(json.find(flag) != std::string::npos);
    const OptimizerSpec back = ck::ParseManifest("M", json).tables[0].optimizer;
    EMBEDCORE_EXPECT(back.kind == kind);
#define EMBEDCORE_EXPECT_READ_BACK(f) EMBEDCORE_EXPECT_EQ(back.f, o.f);
    EMBEDCORE_OPTIMIZER_FIELDS(EMBEDCORE_EXPECT_READ_BACK)
#undef EMBEDCORE_EXPECT_READ_BACK
  }
}
#undef EMBEDCORE_OPTIMIZER_FIELDS

// ------------------------------------------------------------ saving
EMBEDCORE_TEST(SaveArgumentErrors) {
  TempDir dir;
  Table a(Spec("same", 4, 2, DType::kFloat32, OptimizerSpec::Kind::kSGD, 1));
  Table b(Spec("same", 4, 2, DType::kFloat32, OptimizerSpec::Kind::kSGD, 2));
  EMBEDCORE_EXPECT_THROWS(SaveCheckpoint(dir.Sub("x"), {{&a, "{}"}, {&b, "{}"}}, SaveOptions{}), InvalidArgument,
                          "two tables are named 'same'");
  EMBEDCORE_EXPECT_THROWS(SaveCheckpoint(dir.Sub("x"), {{nullptr, "{}"}}, SaveOptions{}), InvalidArgument,
                          "null table");
  EMBEDCORE_EXPECT_THROWS(SaveCheckpoint(dir.Sub("x"), {{&a, "[1]"}}, SaveOptions{}), InvalidArgument,
                          "JSON object");
  SaveOptions bad_meta;
  bad_meta.metadata_json = "{not json";
  EMBEDCORE_EXPECT_THROWS(SaveCheckpoint(dir.Sub("x"), {{&a, "{}"}}, bad_meta), InvalidArgument, "metadata");
  EMBEDCORE_EXPECT(!fs::exists(dir.Sub("x")));  // refused before anything was written
  EMBEDCORE_EXPECT_THROWS(SaveCheckpoint(dir.Sub("no/such/parent"), {{&a, "{}"}}, SaveOptions{}), IoError, "mkdir");
  WriteFile(dir.Sub("file"), {'x'});
  EMBEDCORE_EXPECT_THROWS(SaveCheckpoint(dir.Sub("file"), {{&a, "{}"}}, SaveOptions{}), IoError, "not a directory");
  // An empty checkpoint is valid.
  EMBEDCORE_EXPECT_NO_THROW(SaveCheckpoint(dir.Sub("empty"), {}, SaveOptions{}));
  EMBEDCORE_EXPECT_EQ(ReadCheckpointInfo(dir.Sub("empty")).tables.size(), size_t(0));
}

// CheckManifestIsOurs tells before a save what its own check would say: a
// MANIFEST of another program (or not a regular file) refuses; nothing, a
// directory that is not there, or a manifest of ours (even a short one)
// passes.
EMBEDCORE_TEST(CheckManifestIsOursAgreesWithTheSave) {
  TempDir dir;
  Table a(Spec("a", 4, 2, DType::kFloat32, OptimizerSpec::Kind::kSGD, 1));
  EMBEDCORE_EXPECT_NO_THROW(CheckManifestIsOurs(dir.Sub("missing")));
  EMBEDCORE_EXPECT_NO_THROW(CheckManifestIsOurs(dir.path));
  SaveCheckpoint(dir.Sub("ours"), {{&a, "{}"}}, SaveOptions{});
  EMBEDCORE_EXPECT_NO_THROW(CheckManifestIsOurs(dir.Sub("ours")));
  fs::create_directories(dir.Sub("short"));
  WriteFile(dir.Sub("short/MANIFEST"), {'E', 'C'});  // a prefix of our magic: a save may replace it
  EMBEDCORE_EXPECT_NO_THROW(CheckManifestIsOurs(dir.Sub("short")));
  EMBEDCORE_EXPECT_NO_THROW(SaveCheckpoint(dir.Sub("short"), {{&a, "{}"}}, SaveOptions{}));
  fs::create_directories(dir.Sub("theirs"));
  WriteFile(dir.Sub("theirs/MANIFEST"), {'h', 'e', 'l', 'l', 'o', '\n'});
  EMBEDCORE_EXPECT_THROWS(CheckManifestIsOurs(dir.Sub("theirs")), CheckpointError,
                          "MANIFEST: not an embedcore manifest (another magic)");
  EMBEDCORE_EXPECT_THROWS(SaveCheckpoint(dir.Sub("theirs"), {{&a, "{}"}}, SaveOptions{}), CheckpointError,
                          "MANIFEST: not an embedcore manifest (another magic)");
  fs::create_directories(dir.Sub("dir/MANIFEST"));
  EMBEDCORE_EXPECT_THROWS(CheckManifestIsOurs(dir.Sub("dir")), CheckpointError, "not a regular file");
  EMBEDCORE_EXPECT(DirNames(dir.Sub("theirs")) == std::vector<std::string>{"MANIFEST"});
  // A MANIFEST that cannot be looked at is an error naming it and why, as the save's: not "nothing there".
  EMBEDCORE_EXPECT_THROWS(CheckManifestIsOurs(dir.Sub(std::string(300, 'n'))), IoError, "File name too long");
  fs::create_directories(dir.Sub("loop"));
  fs::create_symlink("MANIFEST", dir.Sub("loop/MANIFEST"));
  EMBEDCORE_EXPECT_THROWS(CheckManifestIsOurs(dir.Sub("loop")), IoError,
                          "loop/MANIFEST: Too many levels of symbolic links");
  EMBEDCORE_EXPECT_THROWS(SaveCheckpoint(dir.Sub("loop"), {{&a, "{}"}}, SaveOptions{}), IoError,
                          "Too many levels of symbolic links");
}

EMBEDCORE_TEST(SaveRefusesAStepTheReaderRefuses) {
  // A table past the step a manifest records: the save fails before it
  // writes anything, and the checkpoint already there stays as it was.
  auto s = SaveOne();
  const std::vector<std::string> before = DirNames(s->path);
  const std::vector<char> manifest = ReadFile(s->path + "/MANIFEST");
  s->table->set_step(ck::kMaxStep + 1);
  EMBEDCORE_EXPECT_THROWS(SaveCheckpoint(s->path, {{s->table.get(), "{}"}}, SaveOptions{}), InvalidArgument,
                          "a checkpoint records steps in [0, 4611686018427387904]");
  EMBEDCORE_EXPECT(DirNames(s->path) == before);
  EMBEDCORE_EXPECT(ReadFile(s->path + "/MANIFEST") == manifest);
  EMBEDCORE_EXPECT_NO_THROW(VerifyCheckpoint(ReadCheckpointInfo(s->path), false));
  // The last step a manifest records saves and loads.
  s->table->set_step(ck::kMaxStep);
  SaveCheckpoint(s->path, {{s->table.get(), "{}"}}, SaveOptions{});
  const CheckpointInfo saved = ReadCheckpointInfo(s->path);  // kept: the macro binds a reference to its argument
  EMBEDCORE_EXPECT_EQ(saved.tables[0].step, ck::kMaxStep);
  // A values-only export records no step.
  s->table->set_step(INT64_MAX);
  SaveOptions values_only;
  values_only.include_optimizer = false;
  EMBEDCORE_EXPECT_NO_THROW(SaveCheckpoint(s->path, {{s->table.get(), "{}"}}, values_only));
  // A manifest committed from outside (a sharded save) is checked the same way.
  CheckpointInfo info = ReadCheckpointInfo(s->path);
  info.tables[0].step = ck::kMaxStep + 1;
  EMBEDCORE_EXPECT_THROWS(CommitCheckpoint(s->path, ck::BuildManifest(info)), CheckpointError, "step");
  EMBEDCORE_EXPECT_NO_THROW(ReadCheckpointInfo(s->path));
}

EMBEDCORE_TEST(GenerationsReplaceAtomically) {
  TempDir dir;
  const std::string path = dir.Sub("ckpt");
  Table t(Spec("g", 30, 4, DType::kFloat32, OptimizerSpec::Kind::kAdagrad, 1));
  SaveCheckpoint(path, {{&t, "{}"}}, SaveOptions{});
  EMBEDCORE_EXPECT_EQ(ReadCheckpointInfo(path).generation, uint64_t(1));
  const std::vector<std::string> gen1 = DirNames(path);
  EMBEDCORE_EXPECT_EQ(gen1.size(), size_t(3));  // MANIFEST, values, accumulators

  // Leftovers of a save killed half-way (a later generation's data file and
  // temporary manifest) and a stranger's file: the old checkpoint still loads.
  const CheckpointInfo info1 = ReadCheckpointInfo(path);
  const std::string values1 = path + "/" + info1.tables[0].values[0].path;
  WriteFile(path + "/t00000.values.g000000000005.ecd", {'p', 'a', 'r', 't'});
  WriteFile(path + "/MANIFEST.tmp.g000000000005", {'x'});
  WriteFile(path + "/notes.txt", {'k', 'e', 'e', 'p'});
  EMBEDCORE_EXPECT_NO_THROW(VerifyCheckpoint(ReadCheckpointInfo(path), false));

  // The next save goes above every generation present and removes the rest.
  Train(t, 2, 3);
  SaveCheckpoint(path, {{&t, "{}"}}, SaveOptions{});
  const CheckpointInfo info2 = ReadCheckpointInfo(path);
  EMBEDCORE_EXPECT_EQ(info2.generation, uint64_t(6));
  EMBEDCORE_EXPECT(!fs::exists(values1));
  EMBEDCORE_EXPECT(!fs::exists(path + "/t00000.values.g000000000005.ecd"));
  EMBEDCORE_EXPECT(!fs::exists(path + "/MANIFEST.tmp.g000000000005"));
  EMBEDCORE_EXPECT(fs::exists(path + "/notes.txt"));  // not ours: never deleted
  EMBEDCORE_EXPECT_EQ(DirNames(path).size(), size_t(4));
  Table back(Spec("g", 30, 4, DType::kFloat32, OptimizerSpec::Kind::kAdagrad, 9));
  LoadTable(info2, info2.tables[0], back, true);
  EMBEDCORE_EXPECT(StateOf(back) == StateOf(t));

  // Fewer tables than before: the removed table's files go too.
  Table u(Spec("u", 3, 3, DType::kFloat32, OptimizerSpec::Kind::kSGD, 1));
  SaveCheckpoint(path, {{&u, "{}"}}, SaveOptions{});
  EMBEDCORE_EXPECT_EQ(ReadCheckpointInfo(path).generation, uint64_t(7));
  EMBEDCORE_EXPECT_EQ(DirNames(path).size(), size_t(3));  // MANIFEST, u's values, notes.txt
}

EMBEDCORE_TEST(RemoveGenerationFreesAFailedSaveOnly) {
  TempDir dir;
  const std::string path = dir.Sub("ckpt");
  Table t(Spec("g", 30, 4, DType::kFloat32, OptimizerSpec::Kind::kAdagrad, 1));
  SaveCheckpoint(path, {{&t, "{}"}}, SaveOptions{});
  const std::vector<std::string> live = DirNames(path);
  // The committed generation is the checkpoint: never removed.
  EMBEDCORE_EXPECT_EQ(RemoveGeneration(path, 1), 0);
  EMBEDCORE_EXPECT(DirNames(path) == live);

  // A failed save of generation 2 left a data file and a temporary manifest;
  // generation 3's file and a stranger's file are not its.
  WriteFile(path + "/t00000.values.g000000000002.ecd", {'p'});
  WriteFile(path + "/t00001.accumulators.s00003.g000000000002.ecd", {'p'});
  WriteFile(path + "/MANIFEST.tmp.g000000000002", {'x'});
  WriteFile(path + "/t00000.values.g000000000003.ecd", {'q'});
  WriteFile(path + "/notes.g000000000002.ecd", {'k'});
  EMBEDCORE_EXPECT_EQ(RemoveGeneration(path, 2), 3);
  EMBEDCORE_EXPECT(fs::exists(path + "/t00000.values.g000000000003.ecd"));
  EMBEDCORE_EXPECT(fs::exists(path + "/notes.g000000000002.ecd"));
  EMBEDCORE_EXPECT_EQ(DirNames(path).size(), live.size() + 2);
  EMBEDCORE_EXPECT_NO_THROW(VerifyCheckpoint(ReadCheckpointInfo(path), false));

  // An unreadable manifest may be the failed save's own (committed, then a
  // later step failed): nothing is removed. No directory: nothing to do.
  WriteFile(path + "/MANIFEST", {'?'});
  EMBEDCORE_EXPECT_EQ(RemoveGeneration(path, 3), 0);
  EMBEDCORE_EXPECT(fs::exists(path + "/t00000.values.g000000000003.ecd"));
  EMBEDCORE_EXPECT_EQ(RemoveGeneration(dir.Sub("missing"), 1), 0);
}

// ------------------------------------------------------------ serving
EMBEDCORE_TEST(MappedLookupsEqualTableLookups) {
  TempDir dir;
  const std::string path = dir.Sub("serve");
  Table a(Spec("a", 200, 12, DType::kFloat32, OptimizerSpec::Kind::kAdagrad, 1));
  Table b(Spec("b", 90, 5, DType::kFloat16, OptimizerSpec::Kind::kSGD, 2));
  Train(a, 2, 4);
  SaveCheckpoint(path, {{&a, "{}"}, {&b, "{}"}}, SaveOptions{});
  for (auto verify : {MappedCheckpoint::Verify::kNone, MappedCheckpoint::Verify::kLazy, MappedCheckpoint::Verify::kEager}) {
    MappedCheckpoint m(path, verify);
    EMBEDCORE_EXPECT_EQ(m.num_tables(), size_t(2));
    EMBEDCORE_EXPECT(std::memcmp(m.values(0), a.values(), a.value_bytes()) == 0);
    EMBEDCORE_EXPECT(std::memcmp(m.values(1), b.values(), b.value_bytes()) == 0);
    EMBEDCORE_EXPECT_EQ(reinterpret_cast<uintptr_t>(m.values(0)) % 4096, uintptr_t(0));  // page-aligned payload
    const std::vector<int64_t> ids = {0, 3, 89, 3, 7, 50};
    const std::vector<int64_t> offsets = {0, 2, 2, 6};
    for (size_t t = 0; t < 2; ++t) {
      const Table& src = t == 0 ? a : b;
      for (OutputShape shape : {OutputShape{Combiner::kMean, 0}, OutputShape{Combiner::kNone, 0},
                                OutputShape{Combiner::kNone, 3}}) {
        const size_t n = size_t(shape.OutputRows(MakeBatch(ids, offsets)) * src.dim());
        std::vector<float> want(n), got(n, -7.0f);
        src.Lookup(MakeBatch(ids, offsets), shape, want.data());
        m.Lookup(t, MakeBatch(ids, offsets), shape, got.data());
        EMBEDCORE_EXPECT(std::memcmp(want.data(), got.data(), n * sizeof(float)) == 0);
      }
    }
    // The same validation as a table's lookup.
    std::vector<float> out(12 * 3);
    EMBEDCORE_EXPECT_THROWS(m.Lookup(0, MakeBatch({200}, {0, 1}), OutputShape{}, out.data()), OutOfRange, "id 200");
    EMBEDCORE_EXPECT_THROWS(m.Lookup(1, MakeBatch({90}, {0, 1}), OutputShape{}, out.data()), OutOfRange, "table 'b'");
    EMBEDCORE_EXPECT_THROWS(m.Lookup(2, MakeBatch({0}, {0, 1}), OutputShape{}, out.data()), OutOfRange, "no table 2");
    EMBEDCORE_EXPECT_THROWS(m.Lookup(0, MakeBatch({0}, {0, 1}), OutputShape{}, nullptr), InvalidArgument, "out");
  }
}

EMBEDCORE_TEST(MappedCheckpointNeedsNoSlotFiles) {
  // Serving reads values only: a checkpoint copied to a serving host without
  // its slot files opens; reading it for a load of the slots says what is missing.
  TempDir dir;
  const std::string path = dir.Sub("serve");
  Table a(Spec("a", 200, 12, DType::kFloat32, OptimizerSpec::Kind::kAdagrad, 1));
  Train(a, 2, 4);
  SaveCheckpoint(path, {{&a, "{}"}}, SaveOptions{});
  const CheckpointInfo info = ReadCheckpointInfo(path);
  EMBEDCORE_EXPECT_EQ(info.tables[0].slots.size(), size_t(1));
  EMBEDCORE_EXPECT_EQ(::unlink((path + "/" + info.tables[0].slots[0][0].path).c_str()), 0);
  MappedCheckpoint m(path, MappedCheckpoint::Verify::kEager);
  EMBEDCORE_EXPECT(std::memcmp(m.values(0), a.values(), a.value_bytes()) == 0);
  EMBEDCORE_EXPECT_NO_THROW(ReadCheckpointInfo(path, /*slot_files=*/false));
  EMBEDCORE_EXPECT_THROWS(ReadCheckpointInfo(path), CheckpointError, "missing file");
}

EMBEDCORE_TEST(MappedVerification) {
  // 20000 x 64 float32 = 5 MB: two 4 MiB checksum blocks. Corrupt a row in
  // the second block: lazy serving refuses it and serves the first block;
  // eager refuses to open.
  TempDir dir;
  const std::string path = dir.Sub("serve");
  TableSpec spec = Spec("big", 20000, 64, DType::kFloat32, OptimizerSpec::Kind::kSGD, 4);
  Table t(spec);
  SaveCheckpoint(path, {{&t, "{}"}}, SaveOptions{});
  const CheckpointInfo info = ReadCheckpointInfo(path);
  EMBEDCORE_EXPECT_EQ(info.tables[0].values[0].crc32c.size(), size_t(2));
  const int64_t bad_row = 19000;  // byte 19000 * 256 > 4 MiB: block 1
  FlipByte(path + "/" + info.tables[0].values[0].path, ck::kDataOffset + uint64_t(bad_row) * 256 + 5);

  std::vector<float> out(64);
  {
    MappedCheckpoint lazy(path, MappedCheckpoint::Verify::kLazy);
    EMBEDCORE_EXPECT_NO_THROW(lazy.Lookup(0, MakeBatch({5}, {0, 1}), OutputShape{}, out.data()));
    EMBEDCORE_EXPECT_THROWS(lazy.Lookup(0, MakeBatch({bad_row}, {0, 1}), OutputShape{}, out.data()), CheckpointError,
                            "refusing to serve corrupt rows");
    // A bad block stays bad; a good one stays good.
    EMBEDCORE_EXPECT_THROWS(lazy.Lookup(0, MakeBatch({5, bad_row}, {0, 2}), OutputShape{}, out.data()), CheckpointError,
                            "block 1");
    EMBEDCORE_EXPECT_NO_THROW(lazy.Lookup(0, MakeBatch({16000}, {0, 1}), OutputShape{}, out.data()));
  }
  EMBEDCORE_EXPECT_THROWS((MappedCheckpoint{path, MappedCheckpoint::Verify::kEager}), CheckpointError, "block 1");
  {
    MappedCheckpoint none(path, MappedCheckpoint::Verify::kNone);  // trusts the file: serves what is there
    EMBEDCORE_EXPECT_NO_THROW(none.Lookup(0, MakeBatch({bad_row}, {0, 1}), OutputShape{}, out.data()));
  }
  // A data file whose header was damaged is refused on open, whatever the verification.
  FlipByte(path + "/" + info.tables[0].values[0].path, 30);
  EMBEDCORE_EXPECT_THROWS((MappedCheckpoint{path, MappedCheckpoint::Verify::kNone}), CheckpointError, "header");
}
