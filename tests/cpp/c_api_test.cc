// core/c_api/c_api.cc, core/include/embedcore/c_api.h: the C ABI of
// libembedcore. Opening, describing tables and features, and every kind of
// lookup (pooled with each combiner, weighted or not, sequences flat and
// padded, int32 and int64 ids, every storage dtype), each compared bit for bit
// with the engine's MappedCheckpoint, which the Python serving path runs.
#include <atomic>
#include <cmath>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "c_api_fixtures.h"

using namespace c_api_test;

namespace {

// An open handle, closed at the end of the scope.
struct Handle {
  embedcore_checkpoint* h = nullptr;
  explicit Handle(const std::string& path, const char* options = nullptr) {
    if (embedcore_open(path.c_str(), options, &h) != EMBEDCORE_OK)
      throw std::runtime_error(std::string("embedcore_open: ") + embedcore_last_error());
  }
  ~Handle() { embedcore_close(h); }
};

std::vector<float> CLookup(embedcore_checkpoint* h, int64_t table, const embedcore_batch& b, int32_t combiner,
                           int64_t max_len = 0) {
  int64_t n = -1;
  if (embedcore_lookup_size(h, table, &b, combiner, max_len, &n) != EMBEDCORE_OK)
    throw std::runtime_error(std::string("embedcore_lookup_size: ") + embedcore_last_error());
  std::vector<float> out(static_cast<size_t>(n));
  if (embedcore_lookup(h, table, &b, combiner, max_len, out.data(), n) != EMBEDCORE_OK)
    throw std::runtime_error(std::string("embedcore_lookup: ") + embedcore_last_error());
  return out;
}

}  // namespace

EMBEDCORE_TEST(VersionAndBuildInfo) {
  EMBEDCORE_EXPECT_EQ(std::string(embedcore_version()), std::string(EMBEDCORE_VERSION_STRING));
  const char* json = nullptr;
  EXPECT_C_OK(embedcore_build_info(&json));
  EMBEDCORE_EXPECT(json != nullptr);
  const std::string info = json;
  EMBEDCORE_EXPECT_MSG(info.find("\"c_abi_version\":1") != std::string::npos, info);
  EMBEDCORE_EXPECT_MSG(info.find("\"version\":\"" EMBEDCORE_VERSION_STRING "\"") != std::string::npos, info);
  const std::string format = "\"format_version\":[" + std::to_string(kFormatMajor) + "," +
                             std::to_string(kFormatMinor) + "]";
  EMBEDCORE_EXPECT_MSG(info.find(format) != std::string::npos, info);
  EMBEDCORE_EXPECT_MSG(info.find("\"simd\":") != std::string::npos, info);
  // Static storage: the same pointer every time.
  const char* again = nullptr;
  EXPECT_C_OK(embedcore_build_info(&again));
  EMBEDCORE_EXPECT(again == json);
}

EMBEDCORE_TEST(NumThreads) {
  int before = 0;
  EXPECT_C_OK(embedcore_get_num_threads(&before));
  EMBEDCORE_EXPECT_GE(before, 1);
  EXPECT_C_OK(embedcore_set_num_threads(3));
  int n = 0;
  EXPECT_C_OK(embedcore_get_num_threads(&n));
  EMBEDCORE_EXPECT_EQ(n, 3);
  EXPECT_C_ERROR(embedcore_set_num_threads(0), EMBEDCORE_INVALID_ARGUMENT, "num_threads must be >= 1, got 0");
  // A garbage count is refused, not obeyed: the pool would try to start
  // 2^31 threads and, when one fails to start, hang (or abort) the process.
  EXPECT_C_ERROR(embedcore_set_num_threads(2147483647), EMBEDCORE_INVALID_ARGUMENT,
                 "embedcore_set_num_threads: num_threads must be <= 4096");
  EXPECT_C_ERROR(embedcore_set_num_threads(4097), EMBEDCORE_INVALID_ARGUMENT, "got 4097");
  EXPECT_C_OK(embedcore_get_num_threads(&n));
  EMBEDCORE_EXPECT_EQ(n, 3);
  EXPECT_C_OK(embedcore_set_num_threads(before));
}

EMBEDCORE_TEST(OpenDescribesTablesAndFeatures) {
  TempDir dir;
  SaveModel(dir.Sub("m"));
  Handle h(dir.Sub("m"));
  int64_t n = -1;
  EXPECT_C_OK(embedcore_num_tables(h.h, &n));
  EMBEDCORE_EXPECT_EQ(n, 3);
  struct Want {
    const char* name;
    int64_t rows, dim;
    int32_t dtype, combiner;
  } want[] = {{"user", 50, 16, EMBEDCORE_DTYPE_FLOAT32, EMBEDCORE_COMBINER_SUM},
              {"item", 300, 8, EMBEDCORE_DTYPE_BFLOAT16, EMBEDCORE_COMBINER_MEAN},
              {"query", 40, 12, EMBEDCORE_DTYPE_FLOAT16, EMBEDCORE_COMBINER_SQRTN}};
  for (int64_t t = 0; t < 3; ++t) {
    embedcore_table_info info;
    EXPECT_C_OK(embedcore_describe_table(h.h, t, &info));
    EMBEDCORE_EXPECT_EQ(std::string(info.name), std::string(want[t].name));
    EMBEDCORE_EXPECT_EQ(info.rows, want[t].rows);
    EMBEDCORE_EXPECT_EQ(info.dim, want[t].dim);
    EMBEDCORE_EXPECT_EQ(info.dtype, want[t].dtype);
    EMBEDCORE_EXPECT_EQ(info.combiner, want[t].combiner);
    int64_t found = -1;
    EXPECT_C_OK(embedcore_find_table(h.h, want[t].name, &found));
    EMBEDCORE_EXPECT_EQ(found, t);
  }
  EXPECT_C_OK(embedcore_num_features(h.h, &n));
  EMBEDCORE_EXPECT_EQ(n, 4);
  const char* names[] = {"user", "item", "history", "query"};
  const int64_t tables[] = {0, 1, 1, 2}, lengths[] = {0, 0, 5, 0};
  for (int64_t f = 0; f < 4; ++f) {
    embedcore_feature_info info;
    EXPECT_C_OK(embedcore_describe_feature(h.h, f, &info));
    EMBEDCORE_EXPECT_EQ(std::string(info.name), std::string(names[f]));
    EMBEDCORE_EXPECT_EQ(info.table, tables[f]);
    EMBEDCORE_EXPECT_EQ(info.max_sequence_length, lengths[f]);
    int64_t found = -1;
    EXPECT_C_OK(embedcore_find_feature(h.h, names[f], &found));
    EMBEDCORE_EXPECT_EQ(found, f);
  }
  uint64_t generation = 0;
  EXPECT_C_OK(embedcore_checkpoint_generation(h.h, &generation));
  EMBEDCORE_EXPECT_EQ(generation, ReadCheckpointInfo(dir.Sub("m")).generation);
}

EMBEDCORE_TEST(TablesOnlyCheckpointHasNoFeatures) {
  TempDir dir;
  ModelOptions o;
  o.features = false;
  o.include_optimizer = true;  // slots in the checkpoint are simply not served
  SaveModel(dir.Sub("m"), o);
  Handle h(dir.Sub("m"));
  int64_t n = -1;
  EXPECT_C_OK(embedcore_num_features(h.h, &n));
  EMBEDCORE_EXPECT_EQ(n, 0);
  OwnedBatch b;
  b.offsets = {0};
  const embedcore_batch c = b.C();
  EXPECT_C_ERROR(embedcore_lookup_feature(h.h, 0, &c, nullptr, 0), EMBEDCORE_OUT_OF_RANGE, "holds tables, not features");
  int64_t found = -1;
  EXPECT_C_ERROR(embedcore_find_feature(h.h, "user", &found), EMBEDCORE_OUT_OF_RANGE, "no feature named 'user'");
  EMBEDCORE_EXPECT_EQ(found, -1);  // untouched on error
}

// Every combiner, weighted or not, sequences flat and padded, int32 and int64
// ids, for every storage dtype: the C ABI gives the engine's bits.
EMBEDCORE_TEST(LookupsMatchTheEngineBitForBit) {
  TempDir dir;
  SaveModel(dir.Sub("m"));
  Handle h(dir.Sub("m"));
  const MappedCheckpoint ref(dir.Sub("m"), MappedCheckpoint::Verify::kLazy);
  std::mt19937_64 rng(7);
  int compared = 0;
  for (size_t t = 0; t < 3; ++t) {
    const int64_t rows = ref.info().tables[t].rows;
    for (int trial = 0; trial < 4; ++trial) {
      const OwnedBatch b = OwnedBatch::Random(rng, rows, 1 + trial * 7, trial == 3 ? 40 : 6);
      for (int weighted = 0; weighted < 2; ++weighted) {
        for (int int32 = 0; int32 < 2; ++int32) {
          const embedcore_batch c = b.C(weighted, int32);
          const Batch e = b.Engine(weighted, int32);
          const struct {
            int32_t code;
            Combiner engine;
            int64_t length;
          } cases[] = {{EMBEDCORE_COMBINER_SUM, Combiner::kSum, 0},   {EMBEDCORE_COMBINER_MEAN, Combiner::kMean, 0},
                       {EMBEDCORE_COMBINER_SQRTN, Combiner::kSqrtn, 0}, {EMBEDCORE_COMBINER_NONE, Combiner::kNone, 0},
                       {EMBEDCORE_COMBINER_NONE, Combiner::kNone, 1},   {EMBEDCORE_COMBINER_NONE, Combiner::kNone, 5}};
          for (const auto& k : cases) {
            const std::vector<float> got = CLookup(h.h, int64_t(t), c, k.code, k.length);
            const std::vector<float> want = Reference(ref, t, e, k.engine, k.length);
            EMBEDCORE_EXPECT_MSG(SameBits(got, want), "table " << t << " combiner " << k.code << " length "
                                                               << k.length << " weighted " << weighted << " int32 "
                                                               << int32);
            ++compared;
          }
        }
      }
    }
  }
  EMBEDCORE_EXPECT_EQ(compared, 3 * 4 * 2 * 2 * 6);
}

// An independent check of the arithmetic: a float32 sum in the kernels' order.
EMBEDCORE_TEST(WeightedSumOfFloat32Rows) {
  TempDir dir;
  SaveModel(dir.Sub("m"));
  Handle h(dir.Sub("m"));
  const MappedCheckpoint ref(dir.Sub("m"), MappedCheckpoint::Verify::kNone);
  const float* values = static_cast<const float*>(ref.values(0));  // user: 50 x 16 float32
  OwnedBatch b;
  b.ids = {3, 49, 3, 0};
  b.offsets = {0, 3, 3, 4};
  b.weights = {0.5f, 2.0f, -1.0f, 1.5f};
  const std::vector<float> got = CLookup(h.h, 0, b.C(true), EMBEDCORE_COMBINER_SUM);
  EMBEDCORE_EXPECT_EQ(got.size(), size_t(3 * 16));
  for (int d = 0; d < 16; ++d) {
    float s = 0.0f;
    for (int k = 0; k < 3; ++k) s += b.weights[size_t(k)] * values[b.ids[size_t(k)] * 16 + d];
    EMBEDCORE_EXPECT_NEAR(got[size_t(d)], s, 1e-6, 1e-6);
    EMBEDCORE_EXPECT_BITS_EQ(got[size_t(16 + d)], 0.0f);  // the empty bag
    EMBEDCORE_EXPECT_BITS_EQ(got[size_t(32 + d)], 1.5f * values[d]);
  }
}

EMBEDCORE_TEST(DefaultCombinerIsTheTables) {
  TempDir dir;
  SaveModel(dir.Sub("m"));
  Handle h(dir.Sub("m"));
  std::mt19937_64 rng(3);
  const int32_t own[] = {EMBEDCORE_COMBINER_SUM, EMBEDCORE_COMBINER_MEAN, EMBEDCORE_COMBINER_SQRTN};
  for (int64_t t = 0; t < 3; ++t) {
    const OwnedBatch b = OwnedBatch::Random(rng, 40, 9, 5);
    EMBEDCORE_EXPECT(SameBits(CLookup(h.h, t, b.C(true), EMBEDCORE_COMBINER_DEFAULT),
                              CLookup(h.h, t, b.C(true), own[t])));
  }
}

EMBEDCORE_TEST(FeatureLookupsAreTheServedCheckpoints) {
  TempDir dir;
  SaveModel(dir.Sub("m"));
  Handle h(dir.Sub("m"));
  const MappedCheckpoint ref(dir.Sub("m"), MappedCheckpoint::Verify::kLazy);
  std::mt19937_64 rng(11);
  // user: pooled sum; item: pooled mean; history: item rows padded to 5; query: pooled sqrtn.
  const struct {
    size_t table;
    Combiner combiner;
    int64_t length;
  } want[] = {{0, Combiner::kSum, 0}, {1, Combiner::kMean, 0}, {1, Combiner::kNone, 5}, {2, Combiner::kSqrtn, 0}};
  for (int64_t f = 0; f < 4; ++f) {
    const OwnedBatch b = OwnedBatch::Random(rng, 40, 13, 8);
    for (int weighted = 0; weighted < 2; ++weighted) {
      const embedcore_batch c = b.C(weighted);
      const std::vector<float> expected =
          Reference(ref, want[f].table, b.Engine(weighted), want[f].combiner, want[f].length);
      std::vector<float> got(expected.size() + 1, 7.0f);
      EXPECT_C_OK(embedcore_lookup_feature(h.h, f, &c, got.data(), int64_t(got.size())));
      EMBEDCORE_EXPECT_BITS_EQ(got.back(), 7.0f);  // a larger buffer: only the output is written
      got.pop_back();
      EMBEDCORE_EXPECT_MSG(SameBits(got, expected), "feature " << f << " weighted " << weighted);
    }
  }
}

// A table whose config has a padding_idx (a PyTorch module's): its pooled lookups, table and feature, leave
// the padding id out of the bags (torch.nn.EmbeddingBag), which equals the same checkpoint without it looked
// up on the bags without the padding ids; per-id and sequence lookups give its row (torch.nn.Embedding).
EMBEDCORE_TEST(PaddingIdxIsLeftOutOfPooledBags) {
  TempDir dir;
  ModelOptions padded;
  padded.item_padding_idx = 7;
  SaveModel(dir.Sub("padded"), padded);
  SaveModel(dir.Sub("plain"));  // the same values
  const CheckpointInfo padded_info = ReadCheckpointInfo(dir.Sub("padded"));
  const CheckpointInfo plain_info = ReadCheckpointInfo(dir.Sub("plain"));
  EMBEDCORE_EXPECT_EQ(padded_info.tables.at(1).padding_idx, 7);
  EMBEDCORE_EXPECT_EQ(padded_info.tables.at(0).padding_idx, -1);
  EMBEDCORE_EXPECT_EQ(plain_info.tables.at(1).padding_idx, -1);
  Handle h(dir.Sub("padded"));
  const MappedCheckpoint ref(dir.Sub("plain"), MappedCheckpoint::Verify::kLazy);
  std::mt19937_64 rng(5);
  for (int trial = 0; trial < 6; ++trial) {
    OwnedBatch b = OwnedBatch::Random(rng, 40, 3 + trial * 5, 8);
    for (size_t k = 0; k < b.ids.size(); k += 3) b.ids[k] = b.ids32[k] = 7;
    if (b.offsets.size() > 2 && trial % 2 == 0) {  // a bag of padding ids only: zeros
      for (int64_t k = b.offsets[1]; k < b.offsets[2]; ++k) b.ids[size_t(k)] = b.ids32[size_t(k)] = 7;
    }
    OwnedBatch kept;  // the bags without the padding ids
    kept.offsets.push_back(0);
    for (size_t bag = 0; bag + 1 < b.offsets.size(); ++bag) {
      for (int64_t k = b.offsets[bag]; k < b.offsets[bag + 1]; ++k) {
        if (b.ids[size_t(k)] == 7) continue;
        kept.ids.push_back(b.ids[size_t(k)]);
        kept.ids32.push_back(b.ids32[size_t(k)]);
        kept.weights.push_back(b.weights[size_t(k)]);
      }
      kept.offsets.push_back(int64_t(kept.ids.size()));
    }
    for (int weighted = 0; weighted < 2; ++weighted) {
      for (int int32 = 0; int32 < 2; ++int32) {
        const embedcore_batch c = b.C(weighted, int32);
        const struct {
          int32_t code;
          Combiner engine;
        } pooled[] = {{EMBEDCORE_COMBINER_SUM, Combiner::kSum},
                      {EMBEDCORE_COMBINER_MEAN, Combiner::kMean},
                      {EMBEDCORE_COMBINER_SQRTN, Combiner::kSqrtn},
                      {EMBEDCORE_COMBINER_DEFAULT, Combiner::kMean}};
        for (const auto& k : pooled)
          EMBEDCORE_EXPECT_MSG(SameBits(CLookup(h.h, 1, c, k.code), Reference(ref, 1, kept.Engine(weighted, int32),
                                                                              k.engine)),
                               "trial " << trial << " combiner " << k.code << " weighted " << weighted);
        for (const int64_t length : {int64_t(0), int64_t(5)})
          EMBEDCORE_EXPECT(SameBits(CLookup(h.h, 1, c, EMBEDCORE_COMBINER_NONE, length),
                                    Reference(ref, 1, b.Engine(weighted, int32), Combiner::kNone, length)));
        // The other tables have none: every id pooled.
        EMBEDCORE_EXPECT(SameBits(CLookup(h.h, 0, c, EMBEDCORE_COMBINER_SUM),
                                  Reference(ref, 0, b.Engine(weighted, int32), Combiner::kSum)));
        // Features: item (pooled mean) leaves it out; history (item, a sequence of 5) gives its row.
        for (const auto& [feature, want] :
             {std::make_pair(int64_t(1), Reference(ref, 1, kept.Engine(weighted, int32), Combiner::kMean)),
              std::make_pair(int64_t(2), Reference(ref, 1, b.Engine(weighted, int32), Combiner::kNone, 5))}) {
          std::vector<float> got(want.size());
          EXPECT_C_OK(embedcore_lookup_feature(h.h, feature, &c, got.data(), int64_t(got.size())));
          EMBEDCORE_EXPECT_MSG(SameBits(got, want), "feature " << feature << " trial " << trial);
        }
      }
    }
  }
}

// A padding_idx outside [0, rows), or not an integer, is a malformed manifest.
EMBEDCORE_TEST(MalformedPaddingIdxIsRefused) {
  TempDir dir;
  ModelOptions bad;
  bad.item_padding_idx = 300;  // item has 300 rows
  bool refused = false;
  try {
    SaveModel(dir.Sub("m"), bad);  // the writer checks its manifest as a reader would
  } catch (const std::exception& e) {
    refused = std::string(e.what()).find("tables[1].config.padding_idx") != std::string::npos;
  }
  EMBEDCORE_EXPECT(refused);
}

EMBEDCORE_TEST(LookupSize) {
  TempDir dir;
  SaveModel(dir.Sub("m"));
  Handle h(dir.Sub("m"));
  embedcore_batch b;
  std::memset(&b, 0, sizeof(b));
  b.num_bags = 7;
  b.nnz = 20;
  int64_t n = 0;
  EXPECT_C_OK(embedcore_lookup_size(h.h, 0, &b, EMBEDCORE_COMBINER_SUM, 0, &n));
  EMBEDCORE_EXPECT_EQ(n, 7 * 16);
  EXPECT_C_OK(embedcore_lookup_size(h.h, 0, &b, EMBEDCORE_COMBINER_DEFAULT, 0, &n));
  EMBEDCORE_EXPECT_EQ(n, 7 * 16);
  EXPECT_C_OK(embedcore_lookup_size(h.h, 1, &b, EMBEDCORE_COMBINER_NONE, 0, &n));
  EMBEDCORE_EXPECT_EQ(n, 20 * 8);
  EXPECT_C_OK(embedcore_lookup_size(h.h, 2, &b, EMBEDCORE_COMBINER_NONE, 3, &n));
  EMBEDCORE_EXPECT_EQ(n, 7 * 3 * 12);
}

EMBEDCORE_TEST(EmptyBatches) {
  TempDir dir;
  SaveModel(dir.Sub("m"));
  Handle h(dir.Sub("m"));
  OwnedBatch none;
  none.offsets = {0};
  const embedcore_batch c = none.C();
  EXPECT_C_OK(embedcore_lookup(h.h, 0, &c, EMBEDCORE_COMBINER_SUM, 0, nullptr, 0));  // nothing to write
  OwnedBatch empty_bags;
  empty_bags.offsets = {0, 0, 0};
  const embedcore_batch e = empty_bags.C();
  std::vector<float> out(2 * 16, 5.0f);
  EXPECT_C_OK(embedcore_lookup(h.h, 0, &e, EMBEDCORE_COMBINER_MEAN, 0, out.data(), int64_t(out.size())));
  for (float v : out) EMBEDCORE_EXPECT_BITS_EQ(v, 0.0f);
  EXPECT_C_OK(embedcore_lookup(h.h, 0, &e, EMBEDCORE_COMBINER_NONE, 0, nullptr, 0));  // [0, dim]
}

EMBEDCORE_TEST(VerifyOptions) {
  TempDir dir;
  SaveModel(dir.Sub("m"));
  for (const char* options : {"{}", "{\"verify\": \"lazy\"}", "{\"verify\": \"eager\"}", "{\"verify\": \"none\"}",
                              "{\"verify\": true}", "{\"verify\": false}", " { } "}) {
    embedcore_checkpoint* h = nullptr;
    EXPECT_C_OK(embedcore_open(dir.Sub("m").c_str(), options, &h));
    EMBEDCORE_EXPECT(h != nullptr);
    EXPECT_C_OK(embedcore_close(h));
  }
}

// The last error belongs to the thread whose call failed.
EMBEDCORE_TEST(LastErrorIsPerThread) {
  TempDir dir;
  SaveModel(dir.Sub("m"));
  Handle h(dir.Sub("m"));
  int64_t found = -1;
  EXPECT_C_ERROR(embedcore_find_table(h.h, "nope", &found), EMBEDCORE_OUT_OF_RANGE, "no table named 'nope'");
  std::string other;
  std::thread t([&] {
    other = embedcore_last_error();
    int64_t n = 0;
    embedcore_num_tables(h.h, &n);
    embedcore_find_table(h.h, "elsewhere", &n);
  });
  t.join();
  EMBEDCORE_EXPECT_EQ(other, std::string(""));
  EMBEDCORE_EXPECT_MSG(std::string(embedcore_last_error()).find("'nope'") != std::string::npos,
                       embedcore_last_error());
  // A successful call leaves it as it was.
  int64_t n = 0;
  EXPECT_C_OK(embedcore_num_tables(h.h, &n));
  EMBEDCORE_EXPECT(std::string(embedcore_last_error()).find("'nope'") != std::string::npos);
}

// Lookups from many threads on one handle agree with one thread's.
EMBEDCORE_TEST(ConcurrentLookups) {
  TempDir dir;
  SaveModel(dir.Sub("m"));
  Handle h(dir.Sub("m"));
  std::mt19937_64 rng(5);
  std::vector<OwnedBatch> batches;
  std::vector<std::vector<float>> expected;
  for (int i = 0; i < 8; ++i) {
    batches.push_back(OwnedBatch::Random(rng, 50, 64, 16));
    expected.push_back(CLookup(h.h, 0, batches.back().C(true), EMBEDCORE_COMBINER_SQRTN));
  }
  std::atomic<int> wrong(0);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 200; ++i) {
        const size_t k = size_t((i + t) % 8);
        if (!SameBits(CLookup(h.h, 0, batches[k].C(true), EMBEDCORE_COMBINER_SQRTN), expected[k])) ++wrong;
      }
    });
  }
  for (auto& t : threads) t.join();
  EMBEDCORE_EXPECT_EQ(wrong.load(), 0);
}

// A checkpoint exported with 8-bit row-wise values (format 1.4) serves through the C ABI: the table says
// EMBEDCORE_DTYPE_UINT8_ROWWISE, and every lookup is the kernels' arithmetic on the stored codes, scales and
// biases, spelled out here: a pooled column (0 + sum (w s) q) + (0 + sum w b), a row alone (w s) q + w b.
// A reload swaps in another such checkpoint (or a float32 one) while the handle serves.
EMBEDCORE_TEST(Uint8RowwiseCheckpointsServeAndReload) {
  TempDir dir;
  SaveOptions q8;
  q8.cast_values = true;
  q8.values_dtype = DType::kUInt8Rowwise;
  q8.include_optimizer = false;
  auto save = [&](const std::string& path, uint64_t seed, const SaveOptions& options) {
    Table a(Spec("a", 70, 19, DType::kFloat32, seed));
    Table b(Spec("b", 30, 64, DType::kFloat16, seed + 1));
    SaveCheckpoint(path, {{&a, R"({"name": "a", "combiner": "sum"})"}, {&b, R"({"name": "b", "combiner": "mean"})"}},
                   options);
  };
  save(dir.Sub("m"), 1, q8);
  Handle h(dir.Sub("m"));
  auto check = [&](const std::string& path) {
    const MappedCheckpoint ref(path, MappedCheckpoint::Verify::kNone);
    std::mt19937_64 rng(11);
    for (int64_t t = 0; t < 2; ++t) {
      embedcore_table_info info;
      EMBEDCORE_EXPECT_EQ(embedcore_describe_table(h.h, t, &info), EMBEDCORE_OK);
      EMBEDCORE_EXPECT_EQ(info.dtype, int32_t(EMBEDCORE_DTYPE_UINT8_ROWWISE));
      const int64_t dim = info.dim, rb = dim + 8;
      const uint8_t* rows = static_cast<const uint8_t*>(ref.values(size_t(t)));
      auto scale = [&](int64_t id) { float s; std::memcpy(&s, rows + id * rb + dim, 4); return s; };
      auto bias = [&](int64_t id) { float s; std::memcpy(&s, rows + id * rb + dim + 4, 4); return s; };
      const OwnedBatch b = OwnedBatch::Random(rng, info.rows, 9, 7);
      for (int weighted = 0; weighted < 2; ++weighted) {
        for (int int32 = 0; int32 < 2; ++int32) {
          const std::vector<float> sum = CLookup(h.h, t, b.C(weighted, int32), EMBEDCORE_COMBINER_SUM);
          const std::vector<float> flat = CLookup(h.h, t, b.C(weighted, int32), EMBEDCORE_COMBINER_NONE);
          for (size_t bag = 0; bag + 1 < b.offsets.size(); ++bag) {
            for (int64_t d = 0; d < dim; ++d) {
              float acc = 0.0f;  // FBGEMM's 8-bit bag: fma(w * scale, code, acc + w * bias), id after id
              for (int64_t k = b.offsets[bag]; k < b.offsets[bag + 1]; ++k) {
                const float w = weighted ? b.weights[size_t(k)] : 1.0f;
                const int64_t id = b.ids[size_t(k)];
                acc = std::fma(w * scale(id), float(rows[id * rb + d]), acc + w * bias(id));
                EMBEDCORE_EXPECT_BITS_EQ(flat[size_t(k * dim + d)],
                                         std::fma(w * scale(id), float(rows[id * rb + d]), w * bias(id)));
              }
              EMBEDCORE_EXPECT_BITS_EQ(sum[bag * size_t(dim) + size_t(d)], acc);
            }
          }
          for (int32_t c : {EMBEDCORE_COMBINER_MEAN, EMBEDCORE_COMBINER_SQRTN, EMBEDCORE_COMBINER_NONE}) {
            const Combiner e = c == EMBEDCORE_COMBINER_MEAN ? Combiner::kMean
                               : c == EMBEDCORE_COMBINER_SQRTN ? Combiner::kSqrtn : Combiner::kNone;
            EMBEDCORE_EXPECT(SameBits(CLookup(h.h, t, b.C(weighted, int32), c, c == EMBEDCORE_COMBINER_NONE ? 3 : 0),
                                      Reference(ref, size_t(t), b.Engine(weighted, int32), e,
                                                c == EMBEDCORE_COMBINER_NONE ? 3 : 0)));
          }
        }
      }
    }
  };
  check(dir.Sub("m"));
  save(dir.Sub("m2"), 7, q8);
  EMBEDCORE_EXPECT_EQ(embedcore_reload(h.h, dir.Sub("m2").c_str(), nullptr), EMBEDCORE_OK);
  check(dir.Sub("m2"));
  save(dir.Sub("f32"), 7, SaveOptions{});  // the storage dtype may change on reload
  EMBEDCORE_EXPECT_EQ(embedcore_reload(h.h, dir.Sub("f32").c_str(), nullptr), EMBEDCORE_OK);
  embedcore_table_info info;
  EMBEDCORE_EXPECT_EQ(embedcore_describe_table(h.h, 1, &info), EMBEDCORE_OK);
  EMBEDCORE_EXPECT_EQ(info.dtype, int32_t(EMBEDCORE_DTYPE_FLOAT16));
}
