// Shared by the tests of the C API (c_api_*_test.cc): checkpoints written with
// the C++ engine, the engine's own MappedCheckpoint as the reference the C
// ABI must match bit for bit (file surgery and temporary directories: fixtures.h).
//
// The tests link libembedcore (the shared library under test, of which only
// the embedcore_* C functions are visible) and the static core (to write
// checkpoints and compute references); the two copies of the engine share
// nothing.
#pragma once

#include <stdlib.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "embedcore/c_api.h"
#include "embedcore/embedcore.h"
#include "fixtures.h"
#include "test_util.h"

namespace c_api_test {

namespace fs = std::filesystem;
using namespace embedcore;

using embedcore_test::FlipByte;
using embedcore_test::ReadFile;
using embedcore_test::TempDir;
using embedcore_test::WriteFile;

// A table initialized uniformly in [-1, 1) from `seed`, for SGD.
inline TableSpec Spec(const std::string& name, int64_t rows, int64_t dim, DType dtype, uint64_t seed) {
  return embedcore_test::Spec(name, rows, dim, dtype, OptimizerSpec::Kind::kSGD, seed);
}

/// The model most tests serve, as embedcore.Embedding saves it: tables
/// user (float32, sum), item (bfloat16, mean) and query (float16, sqrtn), and
/// features user, item, history (item, a sequence of 5) and query. `seed`
/// changes every value (two seeds give two checkpoints of the same model);
/// `dims` and `features_json` let a test save a mismatching one.
struct ModelOptions {
  uint64_t seed = 1;
  int64_t user_rows = 50, item_rows = 300, query_rows = 40;
  int64_t user_dim = 16, item_dim = 8, query_dim = 12;
  std::string features_json =
      R"([{"name": "user", "table": "user", "max_sequence_length": 0},)"
      R"( {"name": "item", "table": "item", "max_sequence_length": 0},)"
      R"( {"name": "history", "table": "item", "max_sequence_length": 5},)"
      R"( {"name": "query", "table": "query", "max_sequence_length": 0}])";
  bool features = true;  ///< false: a checkpoint of tables ("kind": "table")
  bool include_optimizer = false;
  std::string user_combiner = "sum";
  int64_t item_padding_idx = -1;  ///< >= 0: item's config records it (a PyTorch module's padding_idx, format 1.5)
};

inline void SaveModel(const std::string& path, const ModelOptions& o = ModelOptions()) {
  Table user(Spec("user", o.user_rows, o.user_dim, DType::kFloat32, o.seed * 10 + 1));
  Table item(Spec("item", o.item_rows, o.item_dim, DType::kBFloat16, o.seed * 10 + 2));
  Table query(Spec("query", o.query_rows, o.query_dim, DType::kFloat16, o.seed * 10 + 3));
  SaveOptions options;
  options.include_optimizer = o.include_optimizer;
  options.metadata_json = o.features ? R"({"kind": "embedding", "features": )" + o.features_json + "}"
                                     : R"({"kind": "table"})";
  SaveCheckpoint(path,
                 {{&user, R"({"name": "user", "combiner": ")" + o.user_combiner + R"("})"},
                  {&item, o.item_padding_idx < 0 ? std::string(R"({"name": "item", "combiner": "mean"})")
                                                 : R"({"name": "item", "combiner": "mean", "padding_idx": )" +
                                                       std::to_string(o.item_padding_idx) + "}"},
                  {&query, R"({"name": "query", "combiner": "sqrtn"})"}},
                 options);
}

/// A CSR batch with the arrays it points to.
struct OwnedBatch {
  std::vector<int64_t> ids;
  std::vector<int32_t> ids32;
  std::vector<int64_t> offsets;
  std::vector<float> weights;

  /// `bags` bags of 0..max_bag random ids in [0, rows), weights in [0.25, 2].
  static OwnedBatch Random(std::mt19937_64& rng, int64_t rows, int64_t bags, int64_t max_bag) {
    OwnedBatch b;
    b.offsets.push_back(0);
    std::uniform_int_distribution<int64_t> len(0, max_bag), id(0, rows - 1);
    std::uniform_int_distribution<int> w(1, 8);
    for (int64_t i = 0; i < bags; ++i) {
      const int64_t n = len(rng);
      for (int64_t k = 0; k < n; ++k) {
        b.ids.push_back(id(rng));
        b.ids32.push_back(int32_t(b.ids.back()));
        b.weights.push_back(0.25f * float(w(rng)));
      }
      b.offsets.push_back(int64_t(b.ids.size()));
    }
    return b;
  }

  /// The C view; int32 ids with `int32`, the weights with `weighted`.
  embedcore_batch C(bool weighted = false, bool int32 = false) const {
    embedcore_batch c;
    std::memset(&c, 0, sizeof(c));
    c.ids = int32 ? static_cast<const void*>(ids32.data()) : static_cast<const void*>(ids.data());
    c.id_type = int32 ? EMBEDCORE_ID_INT32 : EMBEDCORE_ID_INT64;
    c.nnz = int64_t(ids.size());
    c.offsets = offsets.data();
    c.num_bags = int64_t(offsets.size()) - 1;
    c.weights = weighted ? weights.data() : nullptr;
    return c;
  }

  /// The engine's view, for the reference.
  Batch Engine(bool weighted = false, bool int32 = false) const {
    Batch b;
    b.id_type = int32 ? IdType::kInt32 : IdType::kInt64;
    b.ids = int32 ? static_cast<const void*>(ids32.data()) : static_cast<const void*>(ids.data());
    b.nnz = int64_t(ids.size());
    b.offsets = offsets.data();
    b.num_bags = int64_t(offsets.size()) - 1;
    b.weights = weighted ? weights.data() : nullptr;
    return b;
  }
};

/// The engine's lookup of the same checkpoint (the Python serving path runs
/// exactly this), the reference of the C ABI.
inline std::vector<float> Reference(const MappedCheckpoint& ref, size_t table, const Batch& batch, Combiner combiner,
                                    int64_t max_sequence_length = 0) {
  const OutputShape shape{combiner, max_sequence_length};
  std::vector<float> out(size_t(shape.OutputRows(batch) * ref.info().tables.at(table).dim));
  ref.Lookup(table, batch, shape, out.data());
  return out;
}

/// Bit-exact equality of two float vectors.
inline bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

/// The data file of table `table`'s values in the checkpoint at `path`.
inline std::string ValuesFile(const std::string& path, size_t table) {
  const CheckpointInfo info = ReadCheckpointInfo(path);
  return path + "/" + info.tables.at(table).values.at(0).path;
}

/// Status and message of a failing C call, for expectations.
struct Result {
  int status;
  std::string message;
};
inline Result Capture(int status) { return {status, status == EMBEDCORE_OK ? "" : embedcore_last_error()}; }

}  // namespace c_api_test

/// `call` returns `want_status` and the last error contains `want_text`.
#define EXPECT_C_ERROR(call, want_status, want_text)                                                        \
  do {                                                                                                      \
    const ::c_api_test::Result r_ = ::c_api_test::Capture(call);                                             \
    EMBEDCORE_EXPECT_MSG(r_.status == (want_status), #call " returned " << r_.status << " (" << r_.message   \
                                                                        << "), expected " #want_status);   \
    EMBEDCORE_EXPECT_MSG(r_.message.find(want_text) != std::string::npos,                                   \
                         #call ": message \"" << r_.message << "\" lacks \"" << (want_text) << "\"");      \
  } while (0)

#define EXPECT_C_OK(call)                                                                                   \
  do {                                                                                                      \
    const ::c_api_test::Result r_ = ::c_api_test::Capture(call);                                             \
    EMBEDCORE_EXPECT_MSG(r_.status == EMBEDCORE_OK, #call " failed with " << r_.status << ": " << r_.message); \
  } while (0)
