// Sharded checkpoints (format 1.2) in core/checkpoint/: WriteShardFiles +
// CommitCheckpoint of a table cut into column bands and row blocks, reloaded
// whole (LoadTable) and by blocks that straddle files (LoadTableBlock), with
// dtype conversion; ParseManifest's tiling rules for column bands;
// VerifyTableBlock's range; shard Tables' initial values (TableSpec
// shard_row_start / shard_col_start / full_dim); BagDenominators; and the
// removal of an old generation's shard files (and only ours) on commit.
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <fstream>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "checkpoint/format.h"
#include "checkpoint/manifest.h"
#include "embedcore/embedcore.h"
#include "fixtures.h"
#include "test_util.h"

using namespace embedcore;
namespace ck = embedcore::checkpoint;
namespace fs = std::filesystem;
using namespace embedcore_test;  // fixtures.h, test_util.h

namespace {

std::vector<std::string> DirNames(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}


// The raw bytes of block [r0, r0 + rows) x [c0, c0 + cols) of `t`'s values.
std::vector<uint8_t> BlockRaw(const Table& t, int64_t r0, int64_t rows, int64_t c0, int64_t cols) {
  const size_t es = DTypeSize(t.spec().dtype);
  const uint8_t* src = static_cast<const uint8_t*>(t.values());
  std::vector<uint8_t> out(size_t(rows * cols) * es);
  for (int64_t r = 0; r < rows; ++r)
    std::memcpy(out.data() + size_t(r * cols) * es, src + size_t((r0 + r) * t.dim() + c0) * es, size_t(cols) * es);
  return out;
}

// The same block of slot `i`, or of the values as float32.
std::vector<float> BlockSlot(const Table& t, size_t i, int64_t r0, int64_t rows, int64_t c0, int64_t cols) {
  std::vector<float> out(size_t(rows * cols));
  for (int64_t r = 0; r < rows; ++r)
    std::memcpy(out.data() + r * cols, t.slot(i) + (r0 + r) * t.dim() + c0, size_t(cols) * sizeof(float));
  return out;
}
std::vector<float> BlockFloat(const Table& t, int64_t r0, int64_t rows, int64_t c0, int64_t cols) {
  std::vector<float> whole(size_t(t.rows() * t.dim()));
  t.ReadValues(0, t.rows(), whole.data());
  std::vector<float> out(size_t(rows * cols));
  for (int64_t r = 0; r < rows; ++r)
    std::memcpy(out.data() + r * cols, whole.data() + (r0 + r) * t.dim() + c0, size_t(cols) * sizeof(float));
  return out;
}

std::vector<uint8_t> RawValues(const Table& t) { return BlockRaw(t, 0, t.rows(), 0, t.dim()); }
std::vector<float> Slot(const Table& t, size_t i) { return BlockSlot(t, i, 0, t.rows(), 0, t.dim()); }

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// A shard Table holding block [r0, +rows) x [c0, +cols) of `whole` (values, slots and step).
std::unique_ptr<Table> CutBlock(const Table& whole, int64_t r0, int64_t rows, int64_t c0, int64_t cols) {
  TableSpec s = whole.spec();
  s.rows = rows;
  s.dim = cols;
  s.initializer.kind = InitializerSpec::Kind::kZeros;
  auto t = std::make_unique<Table>(s);
  const std::vector<uint8_t> raw = BlockRaw(whole, r0, rows, c0, cols);
  t->AssignRaw(0, rows, raw.data());
  for (size_t i = 0; i < whole.num_slots(); ++i) {
    const std::vector<float> slot = BlockSlot(whole, i, r0, rows, c0, cols);
    t->AssignSlot(i, 0, rows, slot.data());
  }
  t->set_step(whole.step());
  return t;
}

struct Block {
  int64_t row_start, rows, col_start, cols;
};

// Column bands [0, 4) and [4, 10); band 0 cut at row 20, band 1 at row 35.
const std::vector<Block> kBlocks = {{0, 20, 0, 4}, {20, 30, 0, 4}, {0, 35, 4, 6}, {35, 15, 4, 6}};
constexpr int64_t kRows = 50, kDim = 10;

std::string ManifestJson(uint64_t generation, const std::vector<TableEntry>& tables) {
  std::string s = "{\"format\": \"embedcore.checkpoint\", \"format_version\": [1, 2], \"library_version\": \"test\", "
                  "\"byte_order\": \"little\", \"generation\": " +
                  std::to_string(generation) + ", \"tables\": [";
  for (size_t i = 0; i < tables.size(); ++i) s += (i ? ", " : "") + TableEntryJson(tables[i]);
  return s + "], \"metadata\": {}}";
}

// One table entry whose files are every part's files.
TableEntry Merge(const std::vector<TableEntry>& parts, int64_t rows, int64_t dim) {
  TableEntry e = parts.at(0);
  e.values.clear();
  for (auto& files : e.slots) files.clear();
  for (const TableEntry& p : parts) {
    e.values.insert(e.values.end(), p.values.begin(), p.values.end());
    for (size_t i = 0; i < p.slots.size(); ++i) e.slots[i].insert(e.slots[i].end(), p.slots[i].begin(), p.slots[i].end());
  }
  e.rows = rows;
  e.dim = dim;
  e.sharding_json = "{\"plan\": \"test\", \"world_size\": 4}";
  return e;
}

// Writes `whole` as the shard files of `blocks` at a new generation of `path`
// and commits them; returns the parts WriteShardFiles returned.
std::vector<TableEntry> SaveBlocks(const std::string& path, const Table& whole, const std::vector<Block>& blocks,
                                   uint64_t* generation = nullptr) {
  const uint64_t gen = NextGeneration(path);
  if (generation) *generation = gen;
  std::vector<TableEntry> parts;
  for (size_t i = 0; i < blocks.size(); ++i) {
    const Block& b = blocks[i];
    auto shard = CutBlock(whole, b.row_start, b.rows, b.col_start, b.cols);
    parts.push_back(WriteShardFiles(path, gen, "t00000.", int(i), *shard, b.row_start, b.col_start, SaveOptions{}));
  }
  CommitCheckpoint(path, ManifestJson(gen, {Merge(parts, whole.rows(), whole.dim())}));
  return parts;
}

// A float32 Adagrad table of kRows x kDim saved as the shard files of kBlocks
// into `path`: the checkpoint's info.
CheckpointInfo SaveAdagradBlocks(const std::string& path) {
  Table whole(Spec("w", kRows, kDim, DType::kFloat32, OptimizerSpec::Kind::kAdagrad, 5));
  SaveBlocks(path, whole, kBlocks);
  return ReadCheckpointInfo(path);
}

void FixSize(FileEntry& f) {
  const uint64_t payload = uint64_t(f.rows) * uint64_t(f.cols) * DTypeSize(f.dtype);
  f.bytes = ck::kDataOffset + payload;
  f.crc32c.assign(size_t((payload + f.block_bytes - 1) / f.block_bytes), 0);
}

}  // namespace

// ------------------------------------------------------------ write, commit, load
EMBEDCORE_TEST(ShardFilesOfColumnBandsAndRowBlocksReloadBitExact) {
  TempDir dir;
  const std::string path = dir.Sub("ckpt");
  for (DType dtype : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    Table whole(Spec("w", kRows, kDim, dtype, OptimizerSpec::Kind::kAdam, 5));
    Train(whole, 4, 11);
    uint64_t gen = 0;
    const std::vector<TableEntry> parts = SaveBlocks(path, whole, kBlocks, &gen);

    // Each shard's files: named after its shard index and the generation, at its place.
    char tag[64];
    for (size_t i = 0; i < parts.size(); ++i) {
      std::snprintf(tag, sizeof(tag), ".s%05zu.g%012llu.ecd", i, static_cast<unsigned long long>(gen));
      const TableEntry& p = parts[i];
      EMBEDCORE_EXPECT_EQ(p.values.size(), size_t(1));
      EMBEDCORE_EXPECT_EQ(p.values[0].path, std::string("t00000.values") + tag);
      EMBEDCORE_EXPECT_EQ(p.values[0].row_start, kBlocks[i].row_start);
      EMBEDCORE_EXPECT_EQ(p.values[0].rows, kBlocks[i].rows);
      EMBEDCORE_EXPECT_EQ(p.values[0].col_start, kBlocks[i].col_start);
      EMBEDCORE_EXPECT_EQ(p.values[0].cols, kBlocks[i].cols);
      EMBEDCORE_EXPECT_EQ(p.values[0].dtype, dtype);
      EMBEDCORE_EXPECT(p.slot_names == (std::vector<std::string>{"momenta", "velocities"}));
      EMBEDCORE_EXPECT_EQ(p.slots.at(1).at(0).path, std::string("t00000.velocities") + tag);
      EMBEDCORE_EXPECT_EQ(p.step, int64_t(4));
    }

    const CheckpointInfo info = ReadCheckpointInfo(path);
    EMBEDCORE_EXPECT_EQ(info.format_major, 1);
    EMBEDCORE_EXPECT_EQ(info.format_minor, embedcore::kFormatMinor);
    EMBEDCORE_EXPECT_EQ(info.generation, gen);
    const TableEntry& e = info.tables.at(0);
    EMBEDCORE_EXPECT_EQ(e.values.size(), size_t(4));
    EMBEDCORE_EXPECT(info.manifest_json.find("\"col_start\": 4") != std::string::npos);
    EMBEDCORE_EXPECT_NO_THROW(VerifyCheckpoint(info, true));

    // Whole, same dtype: bit for bit, slots and step too.
    Table back(Spec("w", kRows, kDim, dtype, OptimizerSpec::Kind::kAdam, 99));
    EMBEDCORE_EXPECT(RawValues(back) != RawValues(whole));
    LoadTable(info, e, back, true);
    EMBEDCORE_EXPECT(RawValues(back) == RawValues(whole));
    for (size_t s = 0; s < 2; ++s) EMBEDCORE_EXPECT(SameBits(Slot(back, s), Slot(whole, s)));
    EMBEDCORE_EXPECT_EQ(back.step(), int64_t(4));

    // Blocks that straddle files: every band and both row cuts, or one band's cut; all rows/columns.
    const std::vector<Block> reads = {{15, 25, 2, 6}, {18, 4, 0, 4},  {30, 10, 4, 6}, {0, kRows, 3, 2},
                                      {49, 1, 0, kDim}, {0, kRows, 0, kDim}, {19, 17, 0, kDim}, {7, 3, 9, 1}};
    for (const Block& r : reads) {
      TableSpec bs = Spec("w", r.rows, r.cols, dtype, OptimizerSpec::Kind::kAdam, 7);
      Table blk(bs);
      LoadTableBlock(info, e, blk, r.row_start, r.col_start, true);
      EMBEDCORE_EXPECT_MSG(RawValues(blk) == BlockRaw(whole, r.row_start, r.rows, r.col_start, r.cols),
                           "block rows " << r.row_start << "+" << r.rows << " cols " << r.col_start << "+" << r.cols);
      for (size_t s = 0; s < 2; ++s)
        EMBEDCORE_EXPECT(SameBits(Slot(blk, s), BlockSlot(whole, s, r.row_start, r.rows, r.col_start, r.cols)));
      EMBEDCORE_EXPECT_EQ(blk.step(), int64_t(4));

      // The same block as float32 (dtype conversion), values only: slots and step stay.
      Table f32(Spec("w", r.rows, r.cols, DType::kFloat32, OptimizerSpec::Kind::kAdam, 7));
      const std::vector<float> slot0 = Slot(f32, 0);
      LoadTableBlock(info, e, f32, r.row_start, r.col_start, false);
      std::vector<float> got(size_t(r.rows * r.cols));
      f32.ReadValues(0, r.rows, got.data());
      EMBEDCORE_EXPECT(SameBits(got, BlockFloat(whole, r.row_start, r.rows, r.col_start, r.cols)));
      EMBEDCORE_EXPECT(SameBits(Slot(f32, 0), slot0));
      EMBEDCORE_EXPECT_EQ(f32.step(), int64_t(0));
    }

    // Whole, into a float32 table: values converted exactly, slots and step loaded.
    Table wide(Spec("w", kRows, kDim, DType::kFloat32, OptimizerSpec::Kind::kAdam, 98));
    LoadTable(info, e, wide, true);
    std::vector<float> got(size_t(kRows * kDim));
    wide.ReadValues(0, kRows, got.data());
    EMBEDCORE_EXPECT(SameBits(got, BlockFloat(whole, 0, kRows, 0, kDim)));
    for (size_t s = 0; s < 2; ++s) EMBEDCORE_EXPECT(SameBits(Slot(wide, s), Slot(whole, s)));
    EMBEDCORE_EXPECT_EQ(wide.step(), int64_t(4));

    // A block that does not fit the table is refused, and the target is left alone.
    Table out(Spec("w", 10, 4, dtype, OptimizerSpec::Kind::kAdam, 3));
    const std::vector<uint8_t> before = RawValues(out);
    EMBEDCORE_EXPECT_THROWS(LoadTableBlock(info, e, out, 45, 0, true), CheckpointError, "no block");
    EMBEDCORE_EXPECT_THROWS(LoadTableBlock(info, e, out, 0, 7, true), CheckpointError, "no block");
    EMBEDCORE_EXPECT_THROWS(LoadTableBlock(info, e, out, -1, 0, true), CheckpointError, "no block");
    EMBEDCORE_EXPECT(RawValues(out) == before);
  }
}

EMBEDCORE_TEST(ServedShardFilesLookUpAsTheWholeTable) {
  // Row blocks and column bands served from their files: every output form equals the whole table's lookup
  // bit for bit, in batches of several chunks (about 512 ids each: one bag of 1,500 ids, many small ones,
  // empty ones), whatever the thread count; a lazy open checks the blocks a batch reads before any output.
  TempDir dir;
  const std::string path = dir.Sub("ckpt");
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    Table whole(Spec("w", kRows, kDim, dtype, OptimizerSpec::Kind::kSGD, 5));
    SaveBlocks(path, whole, kBlocks);
    std::mt19937_64 rng(7);
    std::vector<int64_t> ids, offsets = {0};
    std::vector<float> weights;
    for (int64_t b = 0; b < 400; ++b) {
      const int64_t n = b == 17 ? 1500 : b % 9 == 0 ? 0 : int64_t(rng() % 13);
      for (int64_t k = 0; k < n; ++k) {
        ids.push_back(int64_t(rng() % uint64_t(kRows)));
        weights.push_back(float(int64_t(rng() % 7)) * 0.25f - 0.5f);
      }
      offsets.push_back(int64_t(ids.size()));
    }
    for (int threads : {1, 2, 3}) {
      SetNumThreads(threads);
      for (auto verify : {MappedCheckpoint::Verify::kLazy, MappedCheckpoint::Verify::kEager}) {
        MappedCheckpoint m(path, verify);
        for (bool weighted : {false, true}) {
          Batch batch = MakeBatch(ids, offsets);
          if (weighted) batch.weights = weights.data();
          for (OutputShape shape : {OutputShape{Combiner::kSum, 0}, OutputShape{Combiner::kMean, 0},
                                    OutputShape{Combiner::kSqrtn, 0}, OutputShape{Combiner::kNone, 0},
                                    OutputShape{Combiner::kNone, 4}}) {
            if (weighted && shape.combiner == Combiner::kNone) continue;
            const size_t n = size_t(shape.OutputRows(batch) * kDim);
            std::vector<float> want(n), got(n, -7.0f);
            whole.Lookup(batch, shape, want.data());
            m.Lookup(0, batch, shape, got.data());
            EMBEDCORE_EXPECT_MSG(std::memcmp(want.data(), got.data(), n * sizeof(float)) == 0,
                                 "threads " << threads << " combiner " << int(shape.combiner) << " L "
                                            << shape.max_sequence_length << " weighted " << weighted);
          }
        }
      }
    }
    SetNumThreads(2);
    // A corrupt row in the second row block of the first band: a lazy open refuses every batch that reads it,
    // before writing any output, and serves the others.
    const CheckpointInfo info = ReadCheckpointInfo(path);
    const FileEntry* second = nullptr;
    for (const FileEntry& f : info.tables.at(0).values)
      if (f.row_start == 20 && f.col_start == 0) second = &f;
    EMBEDCORE_EXPECT(second != nullptr);
    FlipByte(path + "/" + second->path, ck::kDataOffset + 3);
    MappedCheckpoint lazy(path, MappedCheckpoint::Verify::kLazy);
    std::vector<int64_t> good(2000), bad(2000);
    for (size_t k = 0; k < good.size(); ++k) good[k] = int64_t(k % 20), bad[k] = int64_t(k % 20);
    bad.back() = 20;  // the corrupt block's first row, the last id
    std::vector<float> out(2000 * size_t(kDim), -7.0f);
    EMBEDCORE_EXPECT_THROWS(lazy.Lookup(0, MakeBatch(bad, {0, 1000, 2000}), OutputShape{Combiner::kNone, 0},
                                        out.data()), CheckpointError, "checksum");
    EMBEDCORE_EXPECT(std::all_of(out.begin(), out.end(), [](float x) { return x == -7.0f; }));
    EMBEDCORE_EXPECT_NO_THROW(lazy.Lookup(0, MakeBatch(good, {0, 1000, 2000}), OutputShape{}, out.data()));
    EMBEDCORE_EXPECT_THROWS((MappedCheckpoint{path, MappedCheckpoint::Verify::kEager}), CheckpointError, "checksum");
  }
}

EMBEDCORE_TEST(FloatSixteenShardFilesIntoAFloat32Table) {
  // A float32 table exported as float16 shard files (cast_values), loaded back as float32.
  TempDir dir;
  const std::string path = dir.Sub("ckpt");
  Table whole(Spec("w", kRows, kDim, DType::kFloat32, OptimizerSpec::Kind::kAdagrad, 5));
  Train(whole, 3, 2);
  SaveOptions export16;
  export16.cast_values = true;
  export16.values_dtype = DType::kFloat16;
  const uint64_t gen = NextGeneration(path);
  std::vector<TableEntry> parts;
  for (size_t i = 0; i < kBlocks.size(); ++i) {
    const Block& b = kBlocks[i];
    auto shard = CutBlock(whole, b.row_start, b.rows, b.col_start, b.cols);
    parts.push_back(WriteShardFiles(path, gen, "t00000.", int(i), *shard, b.row_start, b.col_start, export16));
    EMBEDCORE_EXPECT_EQ(parts.back().values[0].dtype, DType::kFloat16);
    EMBEDCORE_EXPECT_EQ(parts.back().values[0].bytes, uint64_t(4096 + b.rows * b.cols * 2));
  }
  CommitCheckpoint(path, ManifestJson(gen, {Merge(parts, kRows, kDim)}));
  const CheckpointInfo info = ReadCheckpointInfo(path);

  // Expected: each value rounded to float16 and back.
  Table half(Spec("w", kRows, kDim, DType::kFloat16, OptimizerSpec::Kind::kAdagrad, 5));
  std::vector<float> exact(size_t(kRows * kDim));
  whole.ReadValues(0, kRows, exact.data());
  half.AssignValues(0, kRows, exact.data());
  const std::vector<float> rounded = BlockFloat(half, 0, kRows, 0, kDim);
  EMBEDCORE_EXPECT(!SameBits(rounded, exact));  // the export did round

  Table back(Spec("w", kRows, kDim, DType::kFloat32, OptimizerSpec::Kind::kAdagrad, 9));
  LoadTable(info, info.tables[0], back, true);
  EMBEDCORE_EXPECT(SameBits(BlockFloat(back, 0, kRows, 0, kDim), rounded));
  EMBEDCORE_EXPECT(SameBits(Slot(back, 0), Slot(whole, 0)));
  Table blk(Spec("w", 30, 5, DType::kFloat32, OptimizerSpec::Kind::kAdagrad, 9));
  LoadTableBlock(info, info.tables[0], blk, 10, 2, true);
  EMBEDCORE_EXPECT(SameBits(BlockFloat(blk, 0, 30, 0, 5), BlockFloat(half, 10, 30, 2, 5)));
  // A float16 table takes the files' bits as they are.
  Table h(Spec("w", kRows, kDim, DType::kFloat16, OptimizerSpec::Kind::kAdagrad, 9));
  LoadTable(info, info.tables[0], h, false);
  EMBEDCORE_EXPECT(RawValues(h) == RawValues(half));
}

EMBEDCORE_TEST(AColumnBlockOfAFileCutShortAfterItsChecksIsACheckpointError) {
  // A block of some of a file's columns is read with pread: a file that another process truncates in place after
  // the manifest's size check (and any verification) was read through a mapping, and the copy ended the process
  // with SIGBUS. (Whole rows were read with pread already.)
  TempDir dir;
  const std::string path = dir.Sub("ckpt");
  const CheckpointInfo info = SaveAdagradBlocks(path);
  for (const FileEntry& f : info.tables[0].values)
    EMBEDCORE_EXPECT_EQ(::truncate((path + "/" + f.path).c_str(), 4096), 0);  // the header alone
  for (const Block& r : std::vector<Block>{{0, kRows, 3, 2}, {5, 10, 1, 2}, {40, 10, 5, 4}}) {
    Table blk(Spec("w", r.rows, r.cols, DType::kFloat32, OptimizerSpec::Kind::kAdagrad, 7));
    EMBEDCORE_EXPECT_THROWS(LoadTableBlock(info, info.tables[0], blk, r.row_start, r.col_start, false, false),
                            CheckpointError, "truncated");
  }
}

// ------------------------------------------------------------ manifest tiling rules
EMBEDCORE_TEST(ParseManifestChecksTheTilingOfColumnBands) {
  TempDir dir;
  const std::string path = dir.Sub("ckpt");
  const CheckpointInfo good = SaveAdagradBlocks(path);
  EMBEDCORE_EXPECT_NO_THROW(ck::ParseManifest("M", ck::BuildManifest(good)));

  // Files in any order tile the same table.
  {
    CheckpointInfo shuffled = good;
    std::reverse(shuffled.tables[0].values.begin(), shuffled.tables[0].values.end());
    std::rotate(shuffled.tables[0].slots[0].begin(), shuffled.tables[0].slots[0].begin() + 1,
                shuffled.tables[0].slots[0].end());
    EMBEDCORE_EXPECT_NO_THROW(ck::ParseManifest("M", ck::BuildManifest(shuffled)));
  }

  // The values files sorted: [0] rows 0+20 cols 0+4, [1] rows 20+30 cols 0+4, [2] rows 0+35 cols 4+6, [3] rows 35+15 cols 4+6.
  struct Case {
    const char* what;
    void (*forge)(std::vector<FileEntry>&);
    const char* expect;
  };
  const std::vector<Case> cases = {
      {"overlapping bands", [](std::vector<FileEntry>& v) { v[2].col_start = v[3].col_start = 3, v[2].cols = v[3].cols = 7; },
       "covers columns [3, 4) twice: file '"},
      {"a band that starts inside the last", [](std::vector<FileEntry>& v) { v[2].col_start = v[3].col_start = 2; },
       "covers columns [2, 4) twice"},
      {"a gap between bands", [](std::vector<FileEntry>& v) { v[2].col_start = v[3].col_start = 5, v[2].cols = v[3].cols = 5; },
       "covers no columns [4, 5): no file starts at column 4"},
      {"a missing last band", [](std::vector<FileEntry>& v) { v.resize(2); }, "covers columns [0, 4) of 10"},
      {"bands short of dim", [](std::vector<FileEntry>& v) { v[2].cols = v[3].cols = 5; }, "covers columns [0, 9) of 10"},
      {"different widths in one band", [](std::vector<FileEntry>& v) { v[3].cols = 5; }, "different widths"},
      {"col_start == dim", [](std::vector<FileEntry>& v) { v[3].col_start = 10, v[3].cols = 1; }, "col_start = 10 is outside"},
      {"col_start > dim", [](std::vector<FileEntry>& v) { v[3].col_start = 12, v[3].cols = 1; }, "col_start = 12 is outside"},
      {"cols past dim", [](std::vector<FileEntry>& v) { v[2].cols = v[3].cols = 7; }, "cols = 7 is outside [1, 6]"},
      {"a row gap in a band", [](std::vector<FileEntry>& v) { v[1].row_start = 21, v[1].rows = 29; },
       "covers no rows [20, 21) of columns [0, 4): no file starts at row 20"},
      {"overlapping rows in a band", [](std::vector<FileEntry>& v) { v[3].row_start = 30, v[3].rows = 20; },
       "covers rows [30, 35) of columns [4, 10) twice: file '"},
      {"a band short of the rows", [](std::vector<FileEntry>& v) { v[3].rows = 14; }, "covers rows [0, 49) of 50"},
      {"a file twice", [](std::vector<FileEntry>& v) { v.push_back(v[0]); }, "covers rows [0, 20) of columns [0, 4) twice"},
      // One file named for two row ranges (the tiling holds): one range's rows served and loaded as the other's.
      {"one file for two row ranges", [](std::vector<FileEntry>& v) { v[1].path = v[0].path; }, "which it names too"},
  };
  for (const Case& c : cases) {
    for (int array = 0; array < 2; ++array) {  // the values, then the slot
      CheckpointInfo forged = good;
      std::vector<FileEntry>& files = array == 0 ? forged.tables[0].values : forged.tables[0].slots[0];
      std::sort(files.begin(), files.end(), [](const FileEntry& a, const FileEntry& b) {
        return a.col_start != b.col_start ? a.col_start < b.col_start : a.row_start < b.row_start;
      });
      c.forge(files);
      for (FileEntry& f : files) FixSize(f);
      const std::string json = ck::BuildManifest(forged);
      bool threw = false;
      try {
        ck::ParseManifest("M", json);
      } catch (const CheckpointError& e) {
        threw = true;
        const std::string msg = e.what();
        EMBEDCORE_EXPECT_MSG(msg.find(c.expect) != std::string::npos, c.what << ": " << msg);
        EMBEDCORE_EXPECT_MSG(msg.find(array == 0 ? "tables[0].values" : "tables[0].slots.accumulators") !=
                                 std::string::npos,
                             c.what << ": " << msg);
      }
      EMBEDCORE_EXPECT_MSG(threw, c.what << " (" << (array == 0 ? "values" : "slot") << ") was accepted");
      // A commit of it is refused before anything changes.
      if (array == 0) {
        const std::vector<char> manifest = ReadFile(path + "/MANIFEST");
        EMBEDCORE_EXPECT_THROWS(CommitCheckpoint(path, json), CheckpointError, "");
        EMBEDCORE_EXPECT(ReadFile(path + "/MANIFEST") == manifest);
      }
    }
  }
  // A values file named as a slot's too (each file holds one piece of one array).
  {
    CheckpointInfo forged = good;
    forged.tables[0].slots[0][0].path = forged.tables[0].values[0].path;
    EMBEDCORE_EXPECT_THROWS(ck::ParseManifest("M", ck::BuildManifest(forged)), CheckpointError,
                            "which tables[0].values names too");
  }
  // A commit naming a file that is not there is refused too.
  CheckpointInfo missing = good;
  missing.tables[0].values[1].path = "t00000.values.s00009.g000000000001.ecd";
  EMBEDCORE_EXPECT_THROWS(CommitCheckpoint(path, ck::BuildManifest(missing)), CheckpointError, "missing file");
  EMBEDCORE_EXPECT_NO_THROW(VerifyCheckpoint(ReadCheckpointInfo(path), false));
}

// ------------------------------------------------------------ verification of a block
EMBEDCORE_TEST(VerifyTableBlockChecksOnlyTheRangeItReads) {
  // 4096 x 512 float32 is 8 MiB: two 4 MiB checksum blocks, rows [0, 2048) and [2048, 4096).
  TempDir dir;
  const std::string path = dir.Sub("ckpt");
  constexpr int64_t rows = 4096, dim = 512;
  Table whole(Spec("big", rows, dim, DType::kFloat32, OptimizerSpec::Kind::kSGD, 4));
  SaveBlocks(path, whole, {{0, rows, 0, 256}, {0, rows, 256, 256}});
  const CheckpointInfo info = ReadCheckpointInfo(path);
  const TableEntry& e = info.tables[0];
  const FileEntry& left = e.values[0].col_start == 0 ? e.values[0] : e.values[1];
  EMBEDCORE_EXPECT_EQ(left.crc32c.size(), size_t(1));  // 4 MiB: one block per band
  // One band over two checksum blocks: rewrite as full-width files instead.
  TempDir dir2;
  const std::string path2 = dir2.Sub("ckpt");
  SaveBlocks(path2, whole, {{0, rows, 0, dim}});
  const CheckpointInfo info2 = ReadCheckpointInfo(path2);
  const FileEntry& f = info2.tables[0].values.at(0);
  EMBEDCORE_EXPECT_EQ(f.crc32c.size(), size_t(2));
  const int64_t bad_row = 3000, bad_col = 300;
  FlipByte(path2 + "/" + f.path, ck::kDataOffset + uint64_t(bad_row * dim + bad_col) * 4 + 1);

  auto verify = [&](const CheckpointInfo& inf, int64_t r0, int64_t n, int64_t c0, int64_t cols) {
    Table blk(Spec("big", n, cols, DType::kFloat32, OptimizerSpec::Kind::kSGD, 1));
    VerifyTableBlock(inf, inf.tables[0], blk, r0, c0, true);
  };
  // Rows in the first checksum block only: not reported (and loads).
  EMBEDCORE_EXPECT_NO_THROW(verify(info2, 0, 1024, 0, dim));
  EMBEDCORE_EXPECT_NO_THROW(verify(info2, 2000, 48, 0, dim));
  EMBEDCORE_EXPECT_NO_THROW(verify(info2, 1000, 1000, 100, 400));
  {
    Table blk(Spec("big", 1024, dim, DType::kFloat32, OptimizerSpec::Kind::kSGD, 1));
    LoadTableBlock(info2, info2.tables[0], blk, 512, 0, true);
    EMBEDCORE_EXPECT(RawValues(blk) == BlockRaw(whole, 512, 1024, 0, dim));
  }
  // Rows that reach the corrupt checksum block: reported, naming the file and block 1.
  EMBEDCORE_EXPECT_THROWS(verify(info2, 2900, 200, 0, dim), CheckpointError, f.path + ": checksum mismatch in block 1");
  EMBEDCORE_EXPECT_THROWS(verify(info2, 2040, 16, 0, dim), CheckpointError, "block 1");
  EMBEDCORE_EXPECT_THROWS(verify(info2, bad_row, 1, bad_col, 1), CheckpointError, "block 1");
  EMBEDCORE_EXPECT_THROWS(verify(info2, 0, rows, 0, dim), CheckpointError, "block 1");
  {
    Table blk(Spec("big", 200, dim, DType::kFloat32, OptimizerSpec::Kind::kSGD, 1));
    const std::vector<uint8_t> before = RawValues(blk);
    EMBEDCORE_EXPECT_THROWS(LoadTableBlock(info2, info2.tables[0], blk, 2900, 0, true), CheckpointError, "block 1");
    EMBEDCORE_EXPECT(RawValues(blk) == before);
  }

  // Across files: a corrupt right band is not reported for a block of the left band.
  const FileEntry& right = e.values[0].col_start == 0 ? e.values[1] : e.values[0];
  FlipByte(path + "/" + right.path, ck::kDataOffset + 12345);
  EMBEDCORE_EXPECT_NO_THROW(verify(info, 0, rows, 0, 256));
  EMBEDCORE_EXPECT_THROWS(verify(info, 0, 1, 255, 2), CheckpointError, right.path);
  EMBEDCORE_EXPECT_THROWS(verify(info, 4000, 96, 256, 256), CheckpointError, right.path);
}

// A float32 value beyond float16's range fails the load of a float16 block
// that holds it (naming it), before the block changes; blocks without it load.
EMBEDCORE_TEST(ABlockOfANarrowerDtypeRefusesOnlyTheValuesItHolds) {
  TempDir dir;
  const std::string path = dir.Sub("ckpt");
  constexpr int64_t rows = 300, dim = 10;
  Table whole(Spec("w", rows, dim, DType::kFloat32, OptimizerSpec::Kind::kAdagrad, 3));
  Train(whole, 2, 5);
  std::vector<float> row(dim, 0.25f);
  row[6] = 70000.0f;
  whole.AssignValues(200, 1, row.data());
  SaveBlocks(path, whole, {{0, rows, 0, 5}, {0, rows, 5, 5}});
  CheckpointInfo info = ReadCheckpointInfo(path);
  // An infinity (no save writes one: a file of an older version, or forged, its checksum made to match): a
  // load that reads it refuses it, whatever the target's dtype.
  row[2] = -std::numeric_limits<float>::infinity();
  whole.AssignValues(200, 1, row.data());
  FileEntry& band = info.tables[0].values[0].col_start == 0 ? info.tables[0].values[0] : info.tables[0].values[1];
  std::vector<char> raw = ReadFile(path + "/" + band.path);
  std::memcpy(&raw[size_t(ck::kDataOffset + (200 * 5 + 2) * 4)], &row[2], 4);
  WriteFile(path + "/" + band.path, raw);
  band.crc32c.at(0) = Crc32c(raw.data() + ck::kDataOffset, raw.size() - ck::kDataOffset);
  auto block = [&](int64_t r0, int64_t n, int64_t c0, int64_t cols, DType dtype = DType::kFloat16) {
    auto t = std::make_unique<Table>(Spec("w", n, cols, dtype, OptimizerSpec::Kind::kAdagrad, 1));
    const std::vector<uint8_t> before = RawValues(*t);
    try {
      LoadTableBlock(info, info.tables[0], *t, r0, c0, true);
    } catch (...) {
      EMBEDCORE_EXPECT(RawValues(*t) == before);
      throw;
    }
    return t;
  };
  const std::string not_finite = "table 'w' values hold -inf at row 200, column 2: a checkpoint holds finite values only";
  EMBEDCORE_EXPECT_THROWS(block(0, rows, 0, dim), CheckpointError, not_finite);
  EMBEDCORE_EXPECT_THROWS(block(200, 1, 0, 3), CheckpointError, not_finite);
  EMBEDCORE_EXPECT_THROWS(block(0, rows, 0, dim, DType::kFloat32), CheckpointError, not_finite);
  EMBEDCORE_EXPECT_THROWS(block(0, rows, 3, 7), CheckpointError,
                          "table 'w' values hold 70000 at row 200, column 6, beyond the range of float16");
  EMBEDCORE_EXPECT_THROWS(block(150, 60, 6, 1), CheckpointError, "row 200, column 6");
  EMBEDCORE_EXPECT_THROWS(block(200, 1, 4, 3), CheckpointError, "row 200, column 6");
  // Rows or columns that miss both load.
  EMBEDCORE_EXPECT_NO_THROW(block(0, 200, 0, dim));
  EMBEDCORE_EXPECT_NO_THROW(block(201, 99, 0, dim));
  EMBEDCORE_EXPECT_NO_THROW(block(200, 1, 7, 3));
  auto left = block(100, 200, 3, 3);
  std::vector<float> got(size_t(200 * 3));
  left->ReadValues(0, 200, got.data());
  EMBEDCORE_EXPECT_EQ(got[100 * 3 + 2], 0.25f);
  // A float32 target takes 70000 as it is.
  row[2] = 0.25f;
  whole.AssignValues(200, 1, row.data());
  Table wide(Spec("w", rows, 5, DType::kFloat32, OptimizerSpec::Kind::kAdagrad, 1));
  LoadTableBlock(info, info.tables[0], wide, 0, 5, true);
  std::vector<float> mine(size_t(rows * 5)), theirs(size_t(rows) * dim);
  wide.ReadValues(0, rows, mine.data());
  whole.ReadValues(0, rows, theirs.data());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < 5; ++c) EMBEDCORE_EXPECT_EQ(mine[size_t(r * 5 + c)], theirs[size_t(r * dim + 5 + c)]);
}

// ------------------------------------------------------------ shard tables
EMBEDCORE_TEST(ShardTablesHoldTheWholeTablesInitialValues) {
  using K = InitializerSpec::Kind;
  constexpr int64_t rows = 37, dim = 11;
  const std::vector<Block> places = {{0, rows, 0, dim}, {5, 10, 3, 4}, {36, 1, 10, 1}, {0, rows, 7, 4},
                                     {12, 25, 0, dim}, {20, 3, 1, 9}};
  int checked = 0;
  for (DType dtype : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    for (K kind : {K::kUniform, K::kNormal, K::kTruncatedNormal, K::kConstant}) {
      TableSpec spec = Spec("w", rows, dim, dtype, OptimizerSpec::Kind::kFTRL, 77);
      spec.initializer.kind = kind;
      spec.initializer.a = kind == K::kUniform ? -0.5 : (kind == K::kConstant ? 0.25 : 0.0);
      spec.initializer.b = kind == K::kUniform ? 0.5 : 0.0;  // (truncated) normal: stddev 1/sqrt(dim)
      Table whole(spec);
      for (const Block& p : places) {
        TableSpec s = spec;
        s.rows = p.rows;
        s.dim = p.cols;
        s.shard_row_start = p.row_start;
        s.shard_col_start = p.col_start;
        s.full_dim = dim;
        Table shard(s);
        EMBEDCORE_EXPECT_MSG(RawValues(shard) == BlockRaw(whole, p.row_start, p.rows, p.col_start, p.cols),
                             "dtype " << DTypeName(dtype) << " initializer " << int(kind) << " at rows "
                                      << p.row_start << "+" << p.rows << " cols " << p.col_start << "+" << p.cols);
        for (size_t i = 0; i < whole.num_slots(); ++i)
          EMBEDCORE_EXPECT(SameBits(Slot(shard, i), BlockSlot(whole, i, p.row_start, p.rows, p.col_start, p.cols)));
        ++checked;
        // Not a shard: the same shape without a placement starts elsewhere (except constants).
        TableSpec plain = s;
        plain.shard_row_start = plain.shard_col_start = plain.full_dim = 0;
        Table unplaced(plain);
        if (kind != K::kConstant && (p.row_start != 0 || p.col_start != 0 || p.cols != dim))
          EMBEDCORE_EXPECT(RawValues(unplaced) != RawValues(shard));
      }
    }
  }
  EMBEDCORE_EXPECT_EQ(checked, 3 * 4 * 6);
  // Placements that do not fit.
  TableSpec s = Spec("w", 4, 4, DType::kFloat32, OptimizerSpec::Kind::kSGD, 1);
  s.full_dim = 6;
  s.shard_col_start = 3;
  EMBEDCORE_EXPECT_THROWS(Table{s}, InvalidArgument, "shard placement");
  s.shard_col_start = -1;
  EMBEDCORE_EXPECT_THROWS(Table{s}, InvalidArgument, "shard placement");
  s.shard_col_start = 0;
  s.shard_row_start = -5;
  EMBEDCORE_EXPECT_THROWS(Table{s}, InvalidArgument, "shard placement");
  s.shard_row_start = 0;
  s.full_dim = 3;
  EMBEDCORE_EXPECT_THROWS(Table{s}, InvalidArgument, "shard placement");
  s.full_dim = 6;
  s.shard_col_start = 2;
  EMBEDCORE_EXPECT_NO_THROW(Table{s});
}

// ------------------------------------------------------------ bag denominators
EMBEDCORE_TEST(BagDenominatorsAreTheSumAndNormOfTheWeights) {
  // Bags: {1, 2, 3}, {}, {0.5}, {-1, 1}, {0.1 x 7}, {3, 4}.
  const std::vector<float> w = {1, 2, 3, 0.5f, -1, 1, 0.1f, 0.1f, 0.1f, 0.1f, 0.1f, 0.1f, 0.1f, 3, 4};
  const std::vector<int64_t> offsets = {0, 3, 3, 4, 6, 13, 15};
  std::vector<int64_t> ids(w.size(), 0);
  Batch b;
  b.ids = ids.data();
  b.nnz = int64_t(w.size());
  b.offsets = offsets.data();
  b.num_bags = int64_t(offsets.size()) - 1;
  for (bool weighted : {true, false}) {
    b.weights = weighted ? w.data() : nullptr;
    std::vector<float> mean(6, -7.0f), sqrtn(6, -7.0f), sum(6, -7.0f), none(6, -7.0f);
    BagDenominators(b, Combiner::kMean, mean.data());
    BagDenominators(b, Combiner::kSqrtn, sqrtn.data());
    BagDenominators(b, Combiner::kSum, sum.data());
    BagDenominators(b, Combiner::kNone, none.data());
    for (int64_t k = 0; k < b.num_bags; ++k) {
      float sw = 0.0f, sw2 = 0.0f;  // in id order, as the kernels sum
      for (int64_t i = offsets[size_t(k)]; i < offsets[size_t(k) + 1]; ++i) {
        const float x = weighted ? w[size_t(i)] : 1.0f;
        sw += x;
        sw2 += x * x;
      }
      EMBEDCORE_EXPECT_BITS_EQ(mean[size_t(k)], sw);
      EMBEDCORE_EXPECT_BITS_EQ(sqrtn[size_t(k)], std::sqrt(sw2));
      EMBEDCORE_EXPECT_BITS_EQ(sum[size_t(k)], 1.0f);
      EMBEDCORE_EXPECT_BITS_EQ(none[size_t(k)], 1.0f);
    }
    // Spot values.
    EMBEDCORE_EXPECT_BITS_EQ(mean[0], weighted ? 6.0f : 3.0f);
    EMBEDCORE_EXPECT_BITS_EQ(mean[1], 0.0f);
    EMBEDCORE_EXPECT_BITS_EQ(sqrtn[5], weighted ? 5.0f : std::sqrt(2.0f));
    EMBEDCORE_EXPECT_BITS_EQ(mean[3], weighted ? 0.0f : 2.0f);
    EMBEDCORE_EXPECT_BITS_EQ(sqrtn[3], std::sqrt(2.0f));
  }
  // The lookup divides by the same number: a mean of a one-column table of ones is sum_w / denominator.
  {
    TableSpec s = Spec("ones", 1, 1, DType::kFloat32, OptimizerSpec::Kind::kSGD, 0);
    s.initializer.kind = InitializerSpec::Kind::kConstant;
    s.initializer.a = 1.0;
    Table ones(s);
    b.weights = w.data();
    for (Combiner c : {Combiner::kMean, Combiner::kSqrtn}) {
      std::vector<float> den(6), out(6);
      BagDenominators(b, c, den.data());
      OutputShape shape;
      shape.combiner = c;
      ones.Lookup(b, shape, out.data());
      for (int64_t k = 0; k < b.num_bags; ++k) {
        float sw = 0.0f;
        for (int64_t i = offsets[size_t(k)]; i < offsets[size_t(k) + 1]; ++i) sw += w[size_t(i)];
        if (den[size_t(k)] != 0.0f) EMBEDCORE_EXPECT_BITS_EQ(out[size_t(k)], sw / den[size_t(k)]);
      }
    }
  }
  // Malformed offsets.
  std::vector<float> out(6);
  const std::vector<int64_t> not_zero = {1, 3, 3, 4, 6, 13, 15}, decreasing = {0, 3, 2, 4, 6, 13, 15},
                             wrong_end = {0, 3, 3, 4, 6, 13, 14};
  for (const auto* o : {&not_zero, &decreasing, &wrong_end}) {
    b.offsets = o->data();
    EMBEDCORE_EXPECT_THROWS(BagDenominators(b, Combiner::kMean, out.data()), InvalidArgument, "bag_denominators");
  }
}

// ------------------------------------------------------------ generations and cleanup
EMBEDCORE_TEST(CommitRemovesOldShardFilesAndKeepsUserFiles) {
  TempDir dir;
  const std::string path = dir.Sub("ckpt");
  Table whole(Spec("w", kRows, kDim, DType::kFloat16, OptimizerSpec::Kind::kAdagrad, 5));
  uint64_t g1 = 0;
  SaveBlocks(path, whole, kBlocks, &g1);
  EMBEDCORE_EXPECT_EQ(g1, uint64_t(1));
  const std::vector<std::string> first = DirNames(path);
  EMBEDCORE_EXPECT_EQ(first.size(), size_t(1 + 4 * 2));  // MANIFEST, values and accumulators of 4 shards

  // Files that are not ours (by name) and a failed later generation's shard file and temporary manifest.
  const std::vector<std::string> users = {
      "notes.txt",
      "t00000.values.s00001.g000000000001.ecd.bak",
      "t00000.values.s1.g000000000001.ecd",
      "t00000.values.s000001.g000000000001.ecd",
      "t00000.Values.s00001.g000000000001.ecd",
      "t00000.values.s00001.g1.ecd",
      "x00000.values.s00001.g000000000001.ecd",
      "t00000.val-ues.s00001.g000000000001.ecd",
  };
  for (const std::string& u : users) WriteFile(path + "/" + u, {'u'});
  WriteFile(path + "/t00001.values.s00003.g000000000007.ecd", {'p'});
  WriteFile(path + "/MANIFEST.tmp.g000000000007", {'p'});
  EMBEDCORE_EXPECT_NO_THROW(VerifyCheckpoint(ReadCheckpointInfo(path), false));  // leftovers do not matter

  // The next generation goes above every one present, and its commit removes ours only.
  Train(whole, 2, 4);
  uint64_t g2 = 0;
  SaveBlocks(path, whole, {{0, 25, 0, 3}, {25, 25, 0, 3}, {0, kRows, 3, 7}}, &g2);
  EMBEDCORE_EXPECT_EQ(g2, uint64_t(8));
  std::vector<std::string> expected = users;
  expected.push_back("MANIFEST");
  for (int s = 0; s < 3; ++s)
    for (const char* array : {"values", "accumulators"}) {
      char name[96];
      std::snprintf(name, sizeof(name), "t00000.%s.s%05d.g000000000008.ecd", array, s);
      expected.push_back(name);
    }
  std::sort(expected.begin(), expected.end());
  EMBEDCORE_EXPECT(DirNames(path) == expected);
  for (const std::string& old : first)
    if (old != "MANIFEST") EMBEDCORE_EXPECT_MSG(!fs::exists(path + "/" + old), old << " was kept");
  for (const std::string& u : users) EMBEDCORE_EXPECT_MSG(ReadFile(path + "/" + u) == std::vector<char>{'u'}, u);

  const CheckpointInfo info = ReadCheckpointInfo(path);
  Table back(Spec("w", kRows, kDim, DType::kFloat16, OptimizerSpec::Kind::kAdagrad, 6));
  LoadTable(info, info.tables[0], back, true);
  EMBEDCORE_EXPECT(RawValues(back) == RawValues(whole));
  EMBEDCORE_EXPECT(SameBits(Slot(back, 0), Slot(whole, 0)));
  EMBEDCORE_EXPECT_EQ(back.step(), int64_t(2));

  // NextGeneration sees shard-tagged names too; shard indices over 99999 are refused.
  WriteFile(path + "/t00000.values.s00000.g000000000041.ecd", {'p'});
  EMBEDCORE_EXPECT_EQ(NextGeneration(path), uint64_t(42));
  EMBEDCORE_EXPECT_THROWS(WriteShardFiles(path, 42, "t00000.", 100000, whole, 0, 0, SaveOptions{}), InvalidArgument,
                          "shard index");
  // The last index the names hold is written, committed and read back.
  const TableEntry last = WriteShardFiles(path, 42, "t00000.", 99999, whole, 0, 0, SaveOptions{});
  EMBEDCORE_EXPECT_MSG(last.values[0].path == "t00000.values.s99999.g000000000042.ecd", last.values[0].path);
  CommitCheckpoint(path, ManifestJson(42, {Merge({last}, kRows, kDim)}));
  const CheckpointInfo at_last = ReadCheckpointInfo(path);
  Table back_last(Spec("w", kRows, kDim, DType::kFloat16, OptimizerSpec::Kind::kAdagrad, 6));
  LoadTable(at_last, at_last.tables[0], back_last, true);
  EMBEDCORE_EXPECT(RawValues(back_last) == RawValues(whole));
  EMBEDCORE_EXPECT(SameBits(Slot(back_last, 0), Slot(whole, 0)));
}

// GenerationClaim: distinct generations for saves at once, the claim file
// exclusive and flock'ed; a commit keeps a held claim's files and removes a
// released one's. CheckpointLock: shared locks coexist; none off a directory.
EMBEDCORE_TEST(ClaimsKeepSavesInProgressApart) {
  TempDir dir;
  const std::string path = dir.Sub("ckpt");
  GenerationClaim a(path), b(path);  // creates the directory
  EMBEDCORE_EXPECT_EQ(a.generation(), uint64_t(1));
  EMBEDCORE_EXPECT_EQ(b.generation(), uint64_t(2));
  EMBEDCORE_EXPECT(fs::is_regular_file(path + "/MANIFEST.tmp.g000000000001"));
  WriteFile(path + "/t00000.values.g000000000001.ecd", {'a'});
  WriteFile(path + "/t00000.values.g000000000002.ecd", {'b'});
  b.Release();  // a save that died: its claim is no longer locked

  Table t(Spec("w", 8, 4, DType::kFloat32, OptimizerSpec::Kind::kSGD, 1));
  SaveCheckpoint(path, {{&t, "{}"}}, SaveOptions{});
  EMBEDCORE_EXPECT_EQ(ReadCheckpointInfo(path).generation, uint64_t(3));
  EMBEDCORE_EXPECT(fs::exists(path + "/t00000.values.g000000000001.ecd"));  // a's save is in progress
  EMBEDCORE_EXPECT(fs::exists(path + "/MANIFEST.tmp.g000000000001"));
  EMBEDCORE_EXPECT(!fs::exists(path + "/t00000.values.g000000000002.ecd"));  // b's is not
  EMBEDCORE_EXPECT(!fs::exists(path + "/MANIFEST.tmp.g000000000002"));
  a.Release();
  SaveCheckpoint(path, {{&t, "{}"}}, SaveOptions{});
  EMBEDCORE_EXPECT(!fs::exists(path + "/t00000.values.g000000000001.ecd"));

  CheckpointLock r1(path, false), r2(path, false);
  EMBEDCORE_EXPECT(r1.held() && r2.held());
  EMBEDCORE_EXPECT(!CheckpointLock(dir.Sub("missing"), false).held());
  EMBEDCORE_EXPECT_THROWS(GenerationClaim(path + "/MANIFEST"), IoError, "not a directory");
}
