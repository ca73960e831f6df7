// core/include/embedcore/embedcore.hpp: the header-only C++ wrapper over the
// C ABI. RAII (a handle is closed once, moves transfer it), exceptions of the
// status's type with the library's message, and results equal to the C calls.
#include <random>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "c_api_fixtures.h"
#include "embedcore/embedcore.hpp"

using namespace c_api_test;
namespace ecs = embedcore::serving;

static_assert(!std::is_copy_constructible<ecs::Checkpoint>::value, "a Checkpoint owns its handle");
static_assert(std::is_nothrow_move_constructible<ecs::Checkpoint>::value, "and moves it");
static_assert(std::is_base_of<std::runtime_error, ecs::Error>::value, "errors are runtime_errors");
static_assert(std::is_base_of<ecs::Error, ecs::CheckpointError>::value, "of the status's type");

EMBEDCORE_TEST(LibraryCalls) {
  EMBEDCORE_EXPECT_EQ(ecs::Version(), std::string(EMBEDCORE_VERSION_STRING));
  EMBEDCORE_EXPECT(ecs::BuildInfo().find("\"c_abi_version\":1") != std::string::npos);
  const int before = ecs::GetNumThreads();
  ecs::SetNumThreads(2);
  EMBEDCORE_EXPECT_EQ(ecs::GetNumThreads(), 2);
  EMBEDCORE_EXPECT_THROWS(ecs::SetNumThreads(-1), ecs::InvalidArgument, "embedcore_set_num_threads: num_threads");
  ecs::SetNumThreads(before);
}

EMBEDCORE_TEST(DescribeAndLookUp) {
  TempDir dir;
  SaveModel(dir.Sub("m"));
  const ecs::Checkpoint ckpt(dir.Sub("m"));
  const std::vector<ecs::TableInfo> tables = ckpt.tables();
  EMBEDCORE_EXPECT_EQ(tables.size(), size_t(3));
  EMBEDCORE_EXPECT_EQ(tables[1].name, std::string("item"));
  EMBEDCORE_EXPECT_EQ(tables[1].rows, 300);
  EMBEDCORE_EXPECT_EQ(tables[1].dim, 8);
  EMBEDCORE_EXPECT(tables[1].dtype == ecs::DType::kBFloat16);
  EMBEDCORE_EXPECT(tables[1].combiner == ecs::Combiner::kMean);
  EMBEDCORE_EXPECT_EQ(std::string(ecs::DTypeName(tables[2].dtype)), std::string("float16"));
  EMBEDCORE_EXPECT_EQ(std::string(ecs::CombinerName(tables[2].combiner)), std::string("sqrtn"));
  const std::vector<ecs::FeatureInfo> features = ckpt.features();
  EMBEDCORE_EXPECT_EQ(features.size(), size_t(4));
  EMBEDCORE_EXPECT_EQ(features[2].name, std::string("history"));
  EMBEDCORE_EXPECT_EQ(features[2].max_sequence_length, 5);
  EMBEDCORE_EXPECT_EQ(ckpt.find_table("query"), 2);
  EMBEDCORE_EXPECT_EQ(ckpt.find_feature("history"), 2);
  EMBEDCORE_EXPECT_EQ(ckpt.generation(), uint64_t(1));

  const MappedCheckpoint ref(dir.Sub("m"), MappedCheckpoint::Verify::kLazy);
  std::mt19937_64 rng(2);
  const OwnedBatch b = OwnedBatch::Random(rng, 40, 9, 6);
  const ecs::Batch weighted(b.ids, b.offsets, b.weights), plain32(b.ids32, b.offsets);
  EMBEDCORE_EXPECT_EQ(weighted.num_bags(), 9);
  EMBEDCORE_EXPECT(SameBits(ckpt.lookup(0, weighted), Reference(ref, 0, b.Engine(true), Combiner::kSum)));
  EMBEDCORE_EXPECT(SameBits(ckpt.lookup(2, plain32, ecs::Combiner::kMean),
                            Reference(ref, 2, b.Engine(false, true), Combiner::kMean)));
  EMBEDCORE_EXPECT(SameBits(ckpt.lookup(1, weighted, ecs::Combiner::kNone, 4),
                            Reference(ref, 1, b.Engine(true), Combiner::kNone, 4)));
  EMBEDCORE_EXPECT(SameBits(ckpt.lookup_feature(2, weighted), Reference(ref, 1, b.Engine(true), Combiner::kNone, 5)));
  EMBEDCORE_EXPECT_EQ(ckpt.feature_lookup_size(2, weighted), 9 * 5 * 8);
  // Into a caller's buffer, and into a vector that is resized.
  std::vector<float> out(9 * 16);
  ckpt.lookup(0, ecs::Batch(b.ids.data(), int64_t(b.ids.size()), b.offsets.data(), 9), out.data(), int64_t(out.size()),
              ecs::Combiner::kSqrtn);
  EMBEDCORE_EXPECT(SameBits(out, Reference(ref, 0, b.Engine(), Combiner::kSqrtn)));
  std::vector<float> resized;
  ckpt.lookup(0, weighted, resized);
  EMBEDCORE_EXPECT_EQ(resized.size(), size_t(9 * 16));
  EMBEDCORE_EXPECT(ckpt.get() != nullptr);
}

EMBEDCORE_TEST(ErrorsAreTypedExceptions) {
  TempDir dir;
  SaveModel(dir.Sub("m"));
  EMBEDCORE_EXPECT_THROWS(ecs::Checkpoint(dir.Sub("missing")), ecs::CheckpointError, "no such checkpoint directory");
  try {
    ecs::Checkpoint bad(dir.Sub("missing"));
  } catch (const ecs::Error& e) {
    EMBEDCORE_EXPECT_EQ(e.status(), int(EMBEDCORE_CHECKPOINT_ERROR));
  }
  const ecs::Checkpoint ckpt(dir.Sub("m"), ecs::Verify::kEager);
  OwnedBatch b;
  b.ids = {0, 50};
  b.offsets = {0, 2};
  EMBEDCORE_EXPECT_THROWS(ckpt.lookup(0, ecs::Batch(b.ids, b.offsets)), ecs::OutOfRange,
                          "embedcore_lookup: table 'user': id 50 at position 1 of ids is out of range [0, 50)");
  EMBEDCORE_EXPECT_THROWS(ckpt.find_table("nope"), ecs::OutOfRange, "no table named 'nope'");
  EMBEDCORE_EXPECT_THROWS(ckpt.table(9), ecs::OutOfRange, "table index 9");
  EMBEDCORE_EXPECT_THROWS(ckpt.lookup(0, ecs::Batch(b.ids, b.offsets, {1.0f})), ecs::InvalidArgument,
                          "weights must be empty or hold one value per id (1 for 2 ids)");
  EMBEDCORE_EXPECT_THROWS(ckpt.lookup(0, ecs::Batch(b.ids, std::vector<int64_t>())), ecs::InvalidArgument,
                          "offsets must hold num_bags + 1 values");
  std::vector<float> small(3);
  EMBEDCORE_EXPECT_THROWS(ckpt.lookup(0, ecs::Batch(std::vector<int64_t>{1}, std::vector<int64_t>{0, 1}), small.data(),
                                      3),
                          ecs::InvalidArgument, "out holds 3 floats");
  EMBEDCORE_EXPECT_THROWS(ckpt.reload(dir.Sub("missing")), ecs::CheckpointError, "embedcore_reload");
  {  // A wrong nnz (2 ids, offsets ending at 2): refused as the lookup refuses it, before an output sized by it
     // (2^40 rows of [nnz, dim]: OutOfMemory) is allocated.
    const std::vector<int64_t> ids = {0, 1}, offsets = {0, 2};
    const ecs::Batch wrong(ids.data(), int64_t(1) << 40, offsets.data(), 1);
    EMBEDCORE_EXPECT_THROWS(ckpt.lookup(0, wrong, ecs::Combiner::kNone), ecs::InvalidArgument,
                            "Checkpoint::lookup: offsets must end at the number of ids, 1099511627776, got "
                            "offsets[1] = 2");
    EMBEDCORE_EXPECT_THROWS(ckpt.lookup_feature(0, wrong), ecs::InvalidArgument,
                            "Checkpoint::lookup_feature: offsets must end at the number of ids");
  }
  // An output no machine can hold (2 bags of L rows: 2^60 floats) is an Error too, not the std::bad_alloc that a
  // server's catch of ecs::Error would miss (std::terminate); the vector is unchanged. (Not under AddressSanitizer,
  // whose operator new never throws: it reports the failed allocation and ends the process.)
#if !defined(__SANITIZE_ADDRESS__)
  {
    const int64_t dim = ckpt.table(0).dim, L = (int64_t(1) << 59) / dim;
    std::vector<float> out(5, 7.0f);
    const std::vector<int64_t> ids = {0, 1}, offsets = {0, 1, 2};
    EMBEDCORE_EXPECT_THROWS(ckpt.lookup(0, ecs::Batch(ids, offsets), out, ecs::Combiner::kNone, L), ecs::OutOfMemory,
                            "Checkpoint::lookup: its output of ");
    EMBEDCORE_EXPECT_EQ(out.size(), size_t(5));
    EMBEDCORE_EXPECT_THROWS(ckpt.lookup(0, ecs::Batch(ids, offsets), ecs::Combiner::kNone, L), ecs::OutOfMemory,
                            "floats cannot be allocated");
  }
#endif

  // A failed lookup into a vector leaves it as it was, size and values (it was resized first: a server reusing
  // its buffer then held zeros of the size of a request that failed).
  for (size_t before : {size_t(4), size_t(100)}) {
    std::vector<float> out(before, 7.0f);
    EMBEDCORE_EXPECT_THROWS(ckpt.lookup(0, ecs::Batch(b.ids, b.offsets), out), ecs::OutOfRange, "id 50");
    EMBEDCORE_EXPECT_EQ(out.size(), before);
    size_t changed = 0;
    for (float v : out) changed += v != 7.0f;
    EMBEDCORE_EXPECT_EQ(changed, size_t(0));
    b.ids = {0, 49};
    ckpt.lookup(0, ecs::Batch(b.ids, b.offsets), out);  // and a good one resizes it
    EMBEDCORE_EXPECT_EQ(out.size(), size_t(ckpt.table(0).dim));
    EMBEDCORE_EXPECT(SameBits(out, ckpt.lookup(0, ecs::Batch(b.ids, b.offsets))));
    b.ids = {0, 50};
  }
  // A NUL character in a path or name would end the C string there (another checkpoint, another table): refused.
  const std::string nul_path = dir.Sub("m") + std::string("\0/elsewhere", 11);
  EMBEDCORE_EXPECT_THROWS(ecs::Checkpoint{nul_path}, ecs::InvalidArgument, "Checkpoint: path: holds a NUL");
  EMBEDCORE_EXPECT_THROWS(ckpt.reload(nul_path), ecs::InvalidArgument, "Checkpoint::reload: path: holds a NUL");
  EMBEDCORE_EXPECT_THROWS(ckpt.find_table(std::string("user\0x", 6)), ecs::InvalidArgument,
                          "find_table: name: holds a NUL character at byte 4");
  EMBEDCORE_EXPECT_THROWS(ckpt.find_feature(std::string("user\0x", 6)), ecs::InvalidArgument,
                          "find_feature: name: holds a NUL character at byte 4");
}

EMBEDCORE_TEST(MovesTransferTheHandle) {
  TempDir dir;
  SaveModel(dir.Sub("m"));
  ModelOptions other;
  other.seed = 3;
  SaveModel(dir.Sub("n"), other);
  ecs::Checkpoint a(dir.Sub("m"));
  embedcore_checkpoint* raw = a.get();
  ecs::Checkpoint b(std::move(a));
  EMBEDCORE_EXPECT(b.get() == raw);
  EMBEDCORE_EXPECT(a.get() == nullptr);  // NOLINT(bugprone-use-after-move): the moved-from state is specified
  EMBEDCORE_EXPECT_THROWS(a.num_tables(), ecs::InvalidArgument, "used after being moved from");
  ecs::Checkpoint c(dir.Sub("n"));
  c = std::move(b);  // closes c's own handle (AddressSanitizer: no leak), takes b's
  EMBEDCORE_EXPECT(c.get() == raw);
  EMBEDCORE_EXPECT_EQ(c.num_tables(), 3);
  c.reload(dir.Sub("n"));
  c.reload();  // the same directory again
  c.reload("", ecs::Verify::kNone);
  EMBEDCORE_EXPECT_EQ(c.num_features(), 4);
}

// A checkpoint of 8-bit row-wise values (format 1.4) through embedcore.hpp: its dtype, and the engine's lookups.
EMBEDCORE_TEST(Uint8RowwiseTables) {
  TempDir dir;
  Table t(Spec("q", 40, 12, DType::kFloat32, 3));
  SaveOptions options;
  options.cast_values = true;
  options.values_dtype = DType::kUInt8Rowwise;
  SaveCheckpoint(dir.Sub("q"), {{&t, R"({"name": "q", "combiner": "sqrtn"})"}}, options);
  const ecs::Checkpoint ckpt(dir.Sub("q"));
  EMBEDCORE_EXPECT(ckpt.tables().at(0).dtype == ecs::DType::kUInt8Rowwise);
  EMBEDCORE_EXPECT_EQ(std::string(ecs::DTypeName(ckpt.tables().at(0).dtype)), std::string("uint8_rowwise"));
  const MappedCheckpoint ref(dir.Sub("q"), MappedCheckpoint::Verify::kLazy);
  std::mt19937_64 rng(5);
  const OwnedBatch b = OwnedBatch::Random(rng, 40, 7, 6);
  const ecs::Batch weighted(b.ids.data(), int64_t(b.ids.size()), b.offsets.data(), int64_t(b.offsets.size()) - 1,
                            b.weights.data());
  EMBEDCORE_EXPECT(SameBits(ckpt.lookup(0, weighted), Reference(ref, 0, b.Engine(true), Combiner::kSqrtn)));
}
