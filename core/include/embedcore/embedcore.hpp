// embedcore.hpp: a header-only C++ wrapper over the C ABI of libembedcore
// (<embedcore/c_api.h>): RAII handles and exceptions, nothing more. It
// compiles as C++11 and later, and links only the C ABI, so a program built
// with any C++ compiler or standard library can use any libembedcore build.
//
//   #include <embedcore/embedcore.hpp>
//   namespace ecs = embedcore::serving;
//
//   ecs::Checkpoint ckpt("/models/ctr");                  // memory-mapped, read-only
//   const int64_t item = ckpt.find_table("item");
//   std::vector<int64_t> ids = {3, 17, 17, 42}, offsets = {0, 3, 4};
//   std::vector<float> out = ckpt.lookup(item, ecs::Batch(ids, offsets));  // [2, dim], the table's combiner
//   ckpt.reload();                                        // a newer save into the same directory
//
// Every failure throws embedcore::serving::Error (a std::runtime_error), or a
// subclass named after the status: InvalidArgument, OutOfRange,
// CheckpointError, IoError, OutOfMemory (also when the vector a lookup
// returns cannot be allocated). Thread safety is the C API's: a Checkpoint may be
// used by any number of threads at once (lookups and reload()), and is
// destroyed (closed) when none uses it any more.
#pragma once

#include <cstddef>
#include <cstdint>
#include <new>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "embedcore/c_api.h"

namespace embedcore {
namespace serving {

// ---------------------------------------------------------------- errors
/// A failed call: what() is embedcore_last_error(), status() its code.
class Error : public std::runtime_error {
 public:
  Error(int status, const std::string& message) : std::runtime_error(message), status_(status) {}
  int status() const noexcept { return status_; }

 private:
  int status_;
};
/// EMBEDCORE_INVALID_ARGUMENT
class InvalidArgument : public Error {
 public:
  using Error::Error;
};
/// EMBEDCORE_OUT_OF_RANGE: an id, index or name that does not exist.
class OutOfRange : public Error {
 public:
  using Error::Error;
};
/// EMBEDCORE_CHECKPOINT_ERROR: missing, truncated, corrupt or mismatching.
class CheckpointError : public Error {
 public:
  using Error::Error;
};
/// EMBEDCORE_IO_ERROR
class IoError : public Error {
 public:
  using Error::Error;
};
/// EMBEDCORE_OUT_OF_MEMORY, and a lookup's output vector that cannot be allocated.
class OutOfMemory : public Error {
 public:
  using Error::Error;
};

/// Throws the exception of `status` with the calling thread's last error.
inline void Check(int status) {
  if (status == EMBEDCORE_OK) return;
  const std::string message = embedcore_last_error();
  switch (status) {
    case EMBEDCORE_INVALID_ARGUMENT:
      throw InvalidArgument(status, message);
    case EMBEDCORE_OUT_OF_RANGE:
      throw OutOfRange(status, message);
    case EMBEDCORE_CHECKPOINT_ERROR:
      throw CheckpointError(status, message);
    case EMBEDCORE_IO_ERROR:
      throw IoError(status, message);
    case EMBEDCORE_OUT_OF_MEMORY:
      throw OutOfMemory(status, message);
    default:
      throw Error(status, message);
  }
}

// ---------------------------------------------------------------- enums
enum class DType : int32_t {
  kFloat32 = EMBEDCORE_DTYPE_FLOAT32,
  kFloat16 = EMBEDCORE_DTYPE_FLOAT16,
  kBFloat16 = EMBEDCORE_DTYPE_BFLOAT16,
  kUInt8Rowwise = EMBEDCORE_DTYPE_UINT8_ROWWISE  ///< 8-bit row-wise quantized rows (format 1.4)
};
enum class Combiner : int32_t {
  kDefault = EMBEDCORE_COMBINER_DEFAULT,  ///< the table's, as saved
  kSum = EMBEDCORE_COMBINER_SUM,
  kMean = EMBEDCORE_COMBINER_MEAN,
  kSqrtn = EMBEDCORE_COMBINER_SQRTN,
  kNone = EMBEDCORE_COMBINER_NONE  ///< no pooling: the rows (sequence)
};
/// How a checkpoint's data checksums are verified (see embedcore_open).
enum class Verify { kLazy, kEager, kNone };

inline const char* DTypeName(DType d) {
  switch (d) {
    case DType::kFloat32:
      return "float32";
    case DType::kFloat16:
      return "float16";
    case DType::kBFloat16:
      return "bfloat16";
    case DType::kUInt8Rowwise:
      return "uint8_rowwise";
  }
  return "?";
}
inline const char* CombinerName(Combiner c) {
  switch (c) {
    case Combiner::kDefault:
      return "default";
    case Combiner::kSum:
      return "sum";
    case Combiner::kMean:
      return "mean";
    case Combiner::kSqrtn:
      return "sqrtn";
    case Combiner::kNone:
      return "none";
  }
  return "?";
}

// ---------------------------------------------------------------- library
/// The library's version ("0.1.0"); EMBEDCORE_VERSION_STRING is the headers'.
inline std::string Version() { return embedcore_version(); }
/// What the library holds, as JSON (see embedcore_build_info).
inline std::string BuildInfo() {
  const char* json = nullptr;
  Check(embedcore_build_info(&json));
  return json;
}
/// Threads one lookup may use (process-wide; results never depend on it).
inline void SetNumThreads(int n) { Check(embedcore_set_num_threads(n)); }
inline int GetNumThreads() {
  int n = 0;
  Check(embedcore_get_num_threads(&n));
  return n;
}

// ---------------------------------------------------------------- batches
/// A CSR batch: a view of the caller's arrays (nothing is copied; they must
/// outlive the lookup). Bag b holds ids[offsets[b] .. offsets[b+1]). A Batch
/// built from temporary vectors is valid only within that full expression:
/// `ckpt.lookup(t, Batch(std::vector<int64_t>{1, 2}, {0, 2}))` is fine, a
/// named `Batch b(std::vector<int64_t>{1, 2}, {0, 2});` dangles.
class Batch {
 public:
  Batch() : b_() {}
  Batch(const int64_t* ids, int64_t nnz, const int64_t* offsets, int64_t num_bags, const float* weights = nullptr)
      : b_() {
    Set(ids, EMBEDCORE_ID_INT64, nnz, offsets, num_bags, weights);
  }
  Batch(const int32_t* ids, int64_t nnz, const int64_t* offsets, int64_t num_bags, const float* weights = nullptr)
      : b_() {
    Set(ids, EMBEDCORE_ID_INT32, nnz, offsets, num_bags, weights);
  }
  /// From vectors: offsets holds num_bags + 1 values; weights is empty or one per id.
  Batch(const std::vector<int64_t>& ids, const std::vector<int64_t>& offsets,
        const std::vector<float>& weights = std::vector<float>())
      : b_() {
    SetVectors(ids.data(), EMBEDCORE_ID_INT64, ids.size(), offsets, weights);
  }
  Batch(const std::vector<int32_t>& ids, const std::vector<int64_t>& offsets,
        const std::vector<float>& weights = std::vector<float>())
      : b_() {
    SetVectors(ids.data(), EMBEDCORE_ID_INT32, ids.size(), offsets, weights);
  }

  int64_t nnz() const { return b_.nnz; }
  int64_t num_bags() const { return b_.num_bags; }
  const embedcore_batch* c_batch() const { return &b_; }

 private:
  void Set(const void* ids, int32_t id_type, int64_t nnz, const int64_t* offsets, int64_t num_bags,
           const float* weights) {
    b_.ids = ids;
    b_.id_type = id_type;
    b_.nnz = nnz;
    b_.offsets = offsets;
    b_.num_bags = num_bags;
    b_.weights = weights;
  }
  void SetVectors(const void* ids, int32_t id_type, size_t nnz, const std::vector<int64_t>& offsets,
                  const std::vector<float>& weights) {
    if (offsets.empty())
      throw InvalidArgument(EMBEDCORE_INVALID_ARGUMENT, "Batch: offsets must hold num_bags + 1 values");
    if (!weights.empty() && weights.size() != nnz)
      throw InvalidArgument(EMBEDCORE_INVALID_ARGUMENT, "Batch: weights must be empty or hold one value per id (" +
                                                            std::to_string(weights.size()) + " for " +
                                                            std::to_string(nnz) + " ids)");
    Set(ids, id_type, int64_t(nnz), offsets.data(), int64_t(offsets.size()) - 1,
        weights.empty() ? nullptr : weights.data());
  }

  embedcore_batch b_;
};

// ---------------------------------------------------------------- descriptions
struct TableInfo {
  std::string name;
  int64_t rows = 0;
  int64_t dim = 0;
  DType dtype = DType::kFloat32;          ///< how the values are stored
  Combiner combiner = Combiner::kMean;    ///< the table's default
};

struct FeatureInfo {
  std::string name;
  int64_t table = 0;                ///< index of the table it reads
  int64_t max_sequence_length = 0;  ///< 0: pooled; L > 0: [num_bags, L, dim]
};

// ---------------------------------------------------------------- checkpoint
/// A checkpoint opened for serving (embedcore_open); closed by the destructor.
/// Movable, not copyable.
class Checkpoint {
 public:
  explicit Checkpoint(const std::string& path, Verify verify = Verify::kLazy) : h_(nullptr) {
    Check(embedcore_open(CString(path, "Checkpoint: path"), Options(verify), &h_));
  }
  ~Checkpoint() {
    if (h_ != nullptr) embedcore_close(h_);
  }
  Checkpoint(Checkpoint&& other) noexcept : h_(other.h_) { other.h_ = nullptr; }
  Checkpoint& operator=(Checkpoint&& other) noexcept {
    if (this != &other) {
      if (h_ != nullptr) embedcore_close(h_);
      h_ = other.h_;
      other.h_ = nullptr;
    }
    return *this;
  }
  Checkpoint(const Checkpoint&) = delete;
  Checkpoint& operator=(const Checkpoint&) = delete;

  /// The C handle, for calls this wrapper does not cover (still owned here).
  embedcore_checkpoint* get() const { return h_; }

  /// Swaps to a newer checkpoint while other threads go on looking up: the
  /// same directory ("") or another one with the same tables (names in the
  /// same order, dims and combiners) and features (embedcore_reload in
  /// c_api.h). On error (an exception) the old checkpoint is still served.
  void reload(const std::string& path = std::string()) const {
    Check(embedcore_reload(Handle(), path.empty() ? nullptr : CString(path, "Checkpoint::reload: path"), nullptr));
  }
  void reload(const std::string& path, Verify verify) const {
    Check(embedcore_reload(Handle(), path.empty() ? nullptr : CString(path, "Checkpoint::reload: path"),
                           Options(verify)));
  }

  uint64_t generation() const {
    uint64_t g = 0;
    Check(embedcore_checkpoint_generation(Handle(), &g));
    return g;
  }

  int64_t num_tables() const {
    int64_t n = 0;
    Check(embedcore_num_tables(Handle(), &n));
    return n;
  }
  TableInfo table(int64_t index) const {
    embedcore_table_info c;
    Check(embedcore_describe_table(Handle(), index, &c));
    TableInfo t;
    t.name = c.name;
    t.rows = c.rows;
    t.dim = c.dim;
    t.dtype = DType(c.dtype);
    t.combiner = Combiner(c.combiner);
    return t;
  }
  std::vector<TableInfo> tables() const {
    std::vector<TableInfo> out;
    const int64_t n = num_tables();
    for (int64_t i = 0; i < n; ++i) out.push_back(table(i));
    return out;
  }
  /// Index of the table named `name`; throws OutOfRange if there is none.
  int64_t find_table(const std::string& name) const {
    int64_t i = -1;
    Check(embedcore_find_table(Handle(), CString(name, "Checkpoint::find_table: name"), &i));
    return i;
  }

  int64_t num_features() const {
    int64_t n = 0;
    Check(embedcore_num_features(Handle(), &n));
    return n;
  }
  FeatureInfo feature(int64_t index) const {
    embedcore_feature_info c;
    Check(embedcore_describe_feature(Handle(), index, &c));
    FeatureInfo f;
    f.name = c.name;
    f.table = c.table;
    f.max_sequence_length = c.max_sequence_length;
    return f;
  }
  std::vector<FeatureInfo> features() const {
    std::vector<FeatureInfo> out;
    const int64_t n = num_features();
    for (int64_t i = 0; i < n; ++i) out.push_back(feature(i));
    return out;
  }
  int64_t find_feature(const std::string& name) const {
    int64_t i = -1;
    Check(embedcore_find_feature(Handle(), CString(name, "Checkpoint::find_feature: name"), &i));
    return i;
  }

  /// Floats a lookup of `batch` in `table` writes.
  int64_t lookup_size(int64_t table, const Batch& batch, Combiner combiner = Combiner::kDefault,
                      int64_t max_sequence_length = 0) const {
    int64_t n = 0;
    Check(embedcore_lookup_size(Handle(), table, batch.c_batch(), int32_t(combiner), max_sequence_length, &n));
    return n;
  }
  /// Floats a lookup of `batch` for feature `feature` writes.
  int64_t feature_lookup_size(int64_t feature, const Batch& batch) const {
    const FeatureInfo f = this->feature(feature);
    return f.max_sequence_length > 0 ? lookup_size(f.table, batch, Combiner::kNone, f.max_sequence_length)
                                     : lookup_size(f.table, batch);
  }

  /// Looks up into the caller's buffer of `out_len` floats (see embedcore_lookup).
  void lookup(int64_t table, const Batch& batch, float* out, int64_t out_len, Combiner combiner = Combiner::kDefault,
              int64_t max_sequence_length = 0) const {
    Check(embedcore_lookup(Handle(), table, batch.c_batch(), int32_t(combiner), max_sequence_length, out, out_len));
  }
  /// Looks up into `out`, resized to the output's size (its memory reused).
  /// On error `out` is as it was, size and values, as the C call's buffer.
  void lookup(int64_t table, const Batch& batch, std::vector<float>& out, Combiner combiner = Combiner::kDefault,
              int64_t max_sequence_length = 0) const {
    const size_t n = size_t(lookup_size(table, batch, combiner, max_sequence_length));
    CheckOffsetsEnd(batch, "Checkpoint::lookup");
    const size_t before = out.size();
    // (Grown only: a shrink would drop values the error must leave.)
    if (n > before) Resize(out, n, "Checkpoint::lookup");
    try {
      lookup(table, batch, out.data(), int64_t(n), combiner, max_sequence_length);
    } catch (...) {
      out.resize(before);  // (the lookup wrote nothing: the first `before` values are the caller's)
      throw;
    }
    out.resize(n);
  }
  /// Returns a new vector: [num_bags, dim] pooled, [num_bags, L, dim] or [nnz, dim].
  std::vector<float> lookup(int64_t table, const Batch& batch, Combiner combiner = Combiner::kDefault,
                            int64_t max_sequence_length = 0) const {
    std::vector<float> out;
    lookup(table, batch, out, combiner, max_sequence_length);
    return out;
  }

  void lookup_feature(int64_t feature, const Batch& batch, float* out, int64_t out_len) const {
    Check(embedcore_lookup_feature(Handle(), feature, batch.c_batch(), out, out_len));
  }
  std::vector<float> lookup_feature(int64_t feature, const Batch& batch) const {
    std::vector<float> out;
    const size_t n = size_t(feature_lookup_size(feature, batch));
    CheckOffsetsEnd(batch, "Checkpoint::lookup_feature");
    Resize(out, n, "Checkpoint::lookup_feature");
    lookup_feature(feature, batch, out.data(), int64_t(out.size()));
    return out;
  }

 private:
  // The output's size comes from the batch's counts: offsets that do not end at nnz (a wrong nnz) are refused
  // before the output is allocated, as the lookup refuses them (a wrong nnz could ask for gigabytes first).
  static void CheckOffsetsEnd(const Batch& batch, const char* what) {
    const embedcore_batch* b = batch.c_batch();
    if (b->offsets == nullptr) return;  // (the lookup says so)
    const int64_t end = b->offsets[b->num_bags];
    if (end != b->nnz)
      throw InvalidArgument(EMBEDCORE_INVALID_ARGUMENT, std::string(what) + ": offsets must end at the number of "
                            "ids, " + std::to_string(b->nnz) + ", got offsets[" + std::to_string(b->num_bags) +
                            "] = " + std::to_string(end));
  }
  // `out` resized to the `n` floats of `what`'s output; a size the process
  // cannot allocate (or that no vector can hold) throws OutOfMemory, as every
  // failure throws an Error, and leaves `out` as it was.
  static void Resize(std::vector<float>& out, size_t n, const char* what) {
    try {
      out.resize(n);
      return;
    } catch (const std::bad_alloc&) {
    } catch (const std::length_error&) {
    }
    throw OutOfMemory(EMBEDCORE_OUT_OF_MEMORY, std::string(what) + ": its output of " + std::to_string(n) +
                                                     " floats cannot be allocated");
  }
  // `s` as the C string the call takes; a NUL character in it (which would
  // end the C string there: another path, another name) is refused.
  static const char* CString(const std::string& s, const char* what) {
    const size_t nul = s.find('\0');
    if (nul != std::string::npos)
      throw InvalidArgument(EMBEDCORE_INVALID_ARGUMENT, std::string(what) + ": holds a NUL character at byte " +
                                                            std::to_string(nul) + " (a C string would end there)");
    return s.c_str();
  }
  static const char* Options(Verify v) {
    switch (v) {
      case Verify::kLazy:
        return "{\"verify\": \"lazy\"}";
      case Verify::kEager:
        return "{\"verify\": \"eager\"}";
      case Verify::kNone:
        return "{\"verify\": \"none\"}";
    }
    return nullptr;
  }
  embedcore_checkpoint* Handle() const {
    if (h_ == nullptr) throw InvalidArgument(EMBEDCORE_INVALID_ARGUMENT, "Checkpoint: used after being moved from");
    return h_;
  }

  embedcore_checkpoint* h_;
};

}  // namespace serving
}  // namespace embedcore
