// The C ABI of libembedcore (embedcore/c_api.h) over the C++ engine.
//
// Every entry point is wrapped in EMBEDCORE_API_BEGIN / EMBEDCORE_API_END: a
// C++ exception never crosses the ABI; it becomes a status code and a message
// in the calling thread's last error. Arguments are validated here (null
// pointers, enums, alignment, output size with overflow-checked arithmetic)
// and by the engine (ids, offsets, checksums) before anything is written.
//
// Hot reload: a handle holds its snapshot (the mapped checkpoint and what was
// parsed from its manifest) in a std::shared_ptr, copied and swapped under the
// handle's own mutex. Each lookup takes its own reference for its whole
// duration, so it sees one checkpoint from start to end, and the old mapping
// is released (munmap) when the last lookup that holds it returns.
//
// Fork: a handler registered with pthread_atfork takes every handle's locks
// before a fork (waiting for reloads in progress) and releases them in the
// parent and in the child, so a child never starts with a lock held by a
// thread it does not have.
#include "embedcore/c_api.h"

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <filesystem>
#include <memory>
#include <mutex>
#include <new>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include <pthread.h>

#include "embedcore/embedcore.h"
#include "checkpoint/strict_json.h"
#include "shared_checks.h"

// The ABI's structs, pinned (a change is a new EMBEDCORE_C_ABI_VERSION).
static_assert(int(embedcore::DType::kFloat32) == EMBEDCORE_DTYPE_FLOAT32 &&
                  int(embedcore::DType::kFloat16) == EMBEDCORE_DTYPE_FLOAT16 &&
                  int(embedcore::DType::kBFloat16) == EMBEDCORE_DTYPE_BFLOAT16 &&
                  int(embedcore::DType::kUInt8Rowwise) == EMBEDCORE_DTYPE_UINT8_ROWWISE,
              "embedcore_dtype codes are the engine's DType codes (embedcore_describe_table copies them)");
static_assert(sizeof(embedcore_batch) == 48 && offsetof(embedcore_batch, nnz) == 24 &&
                  offsetof(embedcore_batch, num_bags) == 32 && offsetof(embedcore_batch, id_type) == 40 &&
                  offsetof(embedcore_batch, reserved) == 44,
              "embedcore_batch layout (ABI version 1)");
static_assert(sizeof(embedcore_table_info) == 32 && offsetof(embedcore_table_info, rows) == 8 &&
                  offsetof(embedcore_table_info, dtype) == 24 && offsetof(embedcore_table_info, combiner) == 28,
              "embedcore_table_info layout (ABI version 1)");
static_assert(sizeof(embedcore_feature_info) == 24 && offsetof(embedcore_feature_info, table) == 8 &&
                  offsetof(embedcore_feature_info, max_sequence_length) == 16,
              "embedcore_feature_info layout (ABI version 1)");

namespace {

using embedcore::Batch;
using embedcore::CheckpointError;
using embedcore::Combiner;
using embedcore::IdType;
using embedcore::InvalidArgument;
using embedcore::MappedCheckpoint;
using embedcore::OutputShape;
using Json = nlohmann::json;

thread_local std::string g_last_error;

// Appends `text` to `out` as valid UTF-8 (the header's promise for every
// string it returns): a byte that does not start or continue a well-formed
// sequence is written as \xNN (a message may quote the caller's bytes, such
// as an options string that is not UTF-8).
void AppendUtf8(std::string& out, const char* text) {
  const auto* p = reinterpret_cast<const unsigned char*>(text);
  while (*p != 0) {
    const unsigned char c = *p;
    size_t n = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : (c >> 3) == 0x1E ? 4 : 0;
    bool ok = n > 0 && !(n == 2 && c < 0xC2) && !(n == 4 && c > 0xF4);
    for (size_t k = 1; ok && k < n; ++k) ok = (p[k] & 0xC0) == 0x80;  // (stops at the NUL: not a continuation)
    if (ok && n == 3) ok = !(c == 0xE0 && p[1] < 0xA0) && !(c == 0xED && p[1] >= 0xA0);  // overlong, surrogates
    if (ok && n == 4) ok = !(c == 0xF0 && p[1] < 0x90) && !(c == 0xF4 && p[1] >= 0x90);  // overlong, > U+10FFFF
    if (ok) {
      out.append(reinterpret_cast<const char*>(p), n);
      p += n;
    } else {
      static const char kHex[] = "0123456789abcdef";
      out += "\\x";
      out += kHex[c >> 4];
      out += kHex[c & 0xF];
      ++p;
    }
  }
}

int SetLastError(int status, const char* function, const char* what) noexcept {
  try {
    g_last_error.assign(function);
    g_last_error.append(": ");
    AppendUtf8(g_last_error, what);
  } catch (...) {
    // Out of memory for the message itself: keep the status.
  }
  return status;
}

// Maps the exception being handled to a status code (most specific first).
int HandleException(const char* function) noexcept {
  try {
    throw;
  } catch (const embedcore::OutOfRange& e) {
    return SetLastError(EMBEDCORE_OUT_OF_RANGE, function, e.what());
  } catch (const embedcore::CheckpointError& e) {
    return SetLastError(EMBEDCORE_CHECKPOINT_ERROR, function, e.what());
  } catch (const embedcore::IoError& e) {
    return SetLastError(EMBEDCORE_IO_ERROR, function, e.what());
  } catch (const embedcore::InvalidArgument& e) {
    return SetLastError(EMBEDCORE_INVALID_ARGUMENT, function, e.what());
  } catch (const embedcore::TypeMismatch& e) {
    return SetLastError(EMBEDCORE_INVALID_ARGUMENT, function, e.what());
  } catch (const embedcore::OutOfMemory& e) {
    return SetLastError(EMBEDCORE_OUT_OF_MEMORY, function, e.what());
  } catch (const std::bad_alloc&) {
    return SetLastError(EMBEDCORE_OUT_OF_MEMORY, function, "out of memory");
  } catch (const Json::exception& e) {  // options that are not valid JSON
    return SetLastError(EMBEDCORE_INVALID_ARGUMENT, function, e.what());
  } catch (const std::invalid_argument& e) {
    return SetLastError(EMBEDCORE_INVALID_ARGUMENT, function, e.what());
  } catch (const std::out_of_range& e) {
    return SetLastError(EMBEDCORE_OUT_OF_RANGE, function, e.what());
  } catch (const std::exception& e) {
    return SetLastError(EMBEDCORE_INTERNAL_ERROR, function, e.what());
  } catch (...) {
    return SetLastError(EMBEDCORE_INTERNAL_ERROR, function, "unknown exception");
  }
}

#define EMBEDCORE_API_BEGIN()          \
  const char* const kFunction = __func__; \
  try {
#define EMBEDCORE_API_END()            \
  }                                    \
  catch (...) {                        \
    return HandleException(kFunction); \
  }                                    \
  return EMBEDCORE_OK;

template <typename T>
void RequireNotNull(const T* p, const char* name) {
  if (p == nullptr) throw InvalidArgument(std::string(name) + ": null pointer");
}

template <typename T>
void RequireAligned(const void* p, const char* name) {
  if (reinterpret_cast<uintptr_t>(p) % alignof(T) != 0)
    throw InvalidArgument(std::string(name) + ": not aligned to " + std::to_string(alignof(T)) + " bytes");
}

// A pointer the library reads or writes as a T (a struct, an out-parameter):
// not null and aligned, so a misaligned one is an error, not undefined behaviour.
template <typename T>
T* RequireObject(T* p, const char* name) {
  RequireNotNull(p, name);
  RequireAligned<T>(p, name);
  return p;
}

// A checkpoint path: not null, not empty.
std::string RequirePath(const char* path, const char* name) {
  RequireNotNull(path, name);
  if (*path == '\0') throw InvalidArgument(std::string(name) + ": empty string (a checkpoint directory is required)");
  return path;
}

// `path` made absolute against the working directory now, without resolving
// symlinks: embedcore_reload(ckpt, NULL, ...) re-opens the same directory even
// if the process changes its working directory, and a symlink that is
// re-pointed to a newer checkpoint is followed again.
std::string AbsolutePath(const std::string& path) {
  std::error_code ec;
  const std::filesystem::path abs = std::filesystem::absolute(path, ec);
  return ec ? path : abs.string();  // not lexically_normal: "link/.." is the link target's parent
}

int64_t MulChecked(int64_t a, int64_t b, const char* what) {
  int64_t r;
  if (__builtin_mul_overflow(a, b, &r))
    throw InvalidArgument(std::string(what) + ": " + std::to_string(a) + " x " + std::to_string(b) +
                          " overflows int64");
  return r;
}

// ---------------------------------------------------------------- options
// Options nest a level or two. Deeper nesting is refused while parsing, as
// the manifest's is (core/checkpoint/manifest.cc): dumping a value for a
// message recurses once per level, and 64 KiB of brackets overflowed the stack.
constexpr int kMaxOptionsDepth = 32;

// `text` cut to `max` bytes (at a UTF-8 character boundary) with "..." after:
// a message names the bad value or key, but need not repeat 64 KiB of it.
std::string Excerpt(std::string text, size_t max = 80) {
  std::string cut = text;
  if (text.size() > max) {
    while (max > 0 && (static_cast<unsigned char>(text[max]) & 0xC0) == 0x80) --max;
    cut = text.substr(0, max) + "...";
  }
  // A NUL character (JSON's \u0000) would end the C string of the message there.
  std::string out;
  for (char c : cut) {
    if (c == '\0') {
      out += "\\u0000";
    } else {
      out += c;
    }
  }
  return out;
}

// A JSON value for a message (depth-capped by the parse, so dump() is safe).
std::string Excerpt(const Json& value) {
  return Excerpt(value.dump(-1, ' ', false, Json::error_handler_t::replace));
}

MappedCheckpoint::Verify ParseVerify(const char* options_json, MappedCheckpoint::Verify fallback) {
  if (options_json == nullptr) return fallback;
  const size_t len = std::strlen(options_json);
  if (len > (size_t(1) << 16)) throw InvalidArgument("options_json: longer than 64 KiB");
  Json o;
  std::string repeated;
  try {
    repeated = embedcore::checkpoint::strict_json::Parse(options_json, options_json + len, kMaxOptionsDepth, [] {
      throw InvalidArgument("options_json: nests deeper than " + std::to_string(kMaxOptionsDepth) + " levels");
    }, &o);
  } catch (const Json::exception& e) {  // a syntax error, or a number beyond double (out_of_range)
    throw InvalidArgument(std::string("options_json: not valid JSON: ") + Excerpt(e.what(), 200));
  }
  // ({"verify": "eager", "verify": "none"} read as "none" before: which one was meant?)
  if (!repeated.empty()) throw InvalidArgument("options_json gives the key " + repeated + " twice");
  if (!o.is_object()) throw InvalidArgument("options_json must be a JSON object, got " + Excerpt(o));
  MappedCheckpoint::Verify verify = fallback;
  for (auto it = o.begin(); it != o.end(); ++it) {
    if (it.key() != "verify")
      throw InvalidArgument("options_json: unknown option '" + Excerpt(it.key()) + "' (known: verify)");
    const Json& v = it.value();
    if (v.is_boolean()) {
      verify = v.get<bool>() ? MappedCheckpoint::Verify::kLazy : MappedCheckpoint::Verify::kNone;
    } else if (v.is_string() && v.get<std::string>() == "lazy") {
      verify = MappedCheckpoint::Verify::kLazy;
    } else if (v.is_string() && v.get<std::string>() == "eager") {
      verify = MappedCheckpoint::Verify::kEager;
    } else if (v.is_string() && v.get<std::string>() == "none") {
      verify = MappedCheckpoint::Verify::kNone;
    } else {
      throw InvalidArgument("options_json: verify must be \"lazy\", \"eager\", \"none\", true or false, got " +
                            Excerpt(v));
    }
  }
  return verify;
}

// ---------------------------------------------------------------- snapshot
struct Feature {
  std::string name;
  int64_t table = 0;
  int64_t max_sequence_length = 0;
};

// One opened checkpoint, immutable once built; shared by the lookups that use it.
struct Snapshot {
  MappedCheckpoint mapped;
  std::vector<Combiner> combiners;  // per table: its config's combiner
  std::vector<Feature> features;

  Snapshot(const std::string& path, MappedCheckpoint::Verify verify) : mapped(path, verify) { Describe(); }

 private:
  // The tables' default combiners and the features, read as
  // embedcore.serving reads them; a malformed entry is a CheckpointError.
  void Describe() {
    const embedcore::CheckpointInfo& info = mapped.info();
    auto fail = [&](const std::string& what) -> void {
      throw CheckpointError(info.path + ": malformed table config or feature metadata in the manifest: " + what);
    };
    for (const embedcore::TableEntry& t : info.tables) {
      const Json config = Json::parse(t.config_json);
      std::string name = "mean";  // TableConfig's default, as embedcore.serving assumes
      if (config.is_object() && config.contains("combiner")) {
        if (!config["combiner"].is_string()) fail("table '" + t.name + "': combiner must be a string");
        name = config["combiner"].get<std::string>();
      }
      if (name == "sum") {
        combiners.push_back(Combiner::kSum);
      } else if (name == "mean") {
        combiners.push_back(Combiner::kMean);
      } else if (name == "sqrtn") {
        combiners.push_back(Combiner::kSqrtn);
      } else {
        fail("table '" + t.name + "': unknown combiner '" + name + "'");
      }
    }
    // As embedcore.serving: features when kind is "embedding" and features is
    // truthy (in Python's sense); then it must be a list.
    const Json meta = Json::parse(info.metadata_json);
    if (!meta.is_object() || !meta.contains("kind") || meta["kind"] != "embedding" || !meta.contains("features"))
      return;
    const Json& list = meta["features"];
    const bool truthy = !(list.is_null() || (list.is_boolean() && !list.get<bool>()) ||
                          (list.is_number() && list.get<double>() == 0.0) ||
                          (list.is_string() && list.get_ref<const std::string&>().empty()) ||
                          (list.is_structured() && list.empty()));
    if (!truthy) return;
    if (!list.is_array()) fail("metadata.features must be a list");
    for (size_t i = 0; i < list.size(); ++i) {
      const Json& f = list[i];
      const std::string where = "metadata.features[" + std::to_string(i) + "]";
      if (!f.is_object()) fail(where + " must be an object");
      Feature feature;
      if (!f.contains("name") || !f["name"].is_string()) fail(where + ".name must be a string");
      feature.name = f["name"].get<std::string>();
      if (!f.contains("table") || !f["table"].is_string()) fail(where + ".table must be a table name");
      const std::string table = f["table"].get<std::string>();
      feature.table = -1;
      for (size_t k = 0; k < info.tables.size(); ++k)
        if (info.tables[k].name == table) feature.table = int64_t(k);
      if (feature.table < 0) fail(where + ".table names no table of the checkpoint: '" + table + "'");
      if (!f.contains("max_sequence_length") || !f["max_sequence_length"].is_number_integer() ||
          f["max_sequence_length"].get<int64_t>() < 0)
        fail(where + ".max_sequence_length must be an integer >= 0");
      feature.max_sequence_length = f["max_sequence_length"].get<int64_t>();
      features.push_back(std::move(feature));
    }
  }
};

}  // namespace

// The handle. Names and dims never change over its life (a reload must keep
// them), so the strings handed out stay valid until embedcore_close.
struct embedcore_checkpoint {
  embedcore_checkpoint();  // registered for fork (see LockHandlesForFork)
  ~embedcore_checkpoint();
  embedcore_checkpoint(const embedcore_checkpoint&) = delete;
  embedcore_checkpoint& operator=(const embedcore_checkpoint&) = delete;

  // The mutex, not std::atomic_load / std::atomic_store: those lock a mutex of
  // libstdc++'s own pool, which a fork can leave locked in the child (by a
  // thread the child does not have) and which no fork handler can reach. It
  // is held only to copy or swap the pointer, never while a snapshot is
  // opened or destroyed, so lookups never wait for a reload.
  mutable std::mutex current_mutex;
  std::shared_ptr<const Snapshot> current;  // guarded by current_mutex
  std::mutex reload_mutex;                  // one reload at a time
  MappedCheckpoint::Verify verify = MappedCheckpoint::Verify::kLazy;  // guarded by reload_mutex
  std::string directory;  // absolute path of the served checkpoint, for reload(NULL); guarded by reload_mutex
  std::vector<std::string> table_names;
  std::vector<int64_t> table_dims;
  std::vector<std::string> feature_names;

  std::shared_ptr<const Snapshot> Acquire() const {
    std::lock_guard<std::mutex> lock(current_mutex);
    return current;
  }
  // Serves `next`; returns the snapshot it replaces, for the caller to
  // release outside the lock (releasing the last reference unmaps it).
  std::shared_ptr<const Snapshot> Swap(std::shared_ptr<const Snapshot> next) {
    std::lock_guard<std::mutex> lock(current_mutex);
    current.swap(next);
    return next;
  }
};

namespace {

// ---------------------------------------------------------------- fork
// A forked child has only the thread that forked. A handle's lock that
// another thread held at the fork (a lookup copying the current snapshot's
// pointer, a reload) would stay held in the child for ever, and the child's
// first call on the handle (or first reload) would hang. So fork() takes
// every live handle's locks, the reload lock first, which waits for a reload
// in progress to finish (the child then has the handle as a whole reload
// left it, never a half-assigned directory): the prepare handler locks them,
// the parent releases them after the fork, and so does the child, whose one
// thread is the one that took them. (Unlocked, not made anew in place as
// core/table.cc makes the tables' reader-writer locks: their unlock compares
// the writer's thread id, which is new in the child; a plain mutex's does
// not. ThreadSanitizer cannot see a mutex made anew, and reported every
// child of a single-threaded parent as locking these twice.) A reload takes
// the current lock under its reload lock, never the other way round, so the
// order here cannot deadlock with it.
struct LiveHandles {
  std::mutex mutex;
  std::set<embedcore_checkpoint*> handles;
};
LiveHandles& Live() {
  static LiveHandles* live = new LiveHandles;  // never destroyed: a fork may come during exit
  return *live;
}
void LockHandlesForFork() {
  Live().mutex.lock();
  for (embedcore_checkpoint* h : Live().handles) {
    h->reload_mutex.lock();
    h->current_mutex.lock();
  }
}
void UnlockHandlesInParent() {
  for (embedcore_checkpoint* h : Live().handles) {
    h->current_mutex.unlock();
    h->reload_mutex.unlock();
  }
  Live().mutex.unlock();
}
void UnlockHandlesInChild() {
  for (embedcore_checkpoint* h : Live().handles) {  // no other thread exists here
    h->current_mutex.unlock();
    h->reload_mutex.unlock();
  }
  Live().mutex.unlock();
}

}  // namespace

embedcore_checkpoint::embedcore_checkpoint() {
  static const bool registered =
      pthread_atfork(LockHandlesForFork, UnlockHandlesInParent, UnlockHandlesInChild) == 0;
  (void)registered;
  std::lock_guard<std::mutex> lock(Live().mutex);
  Live().handles.insert(this);
}

embedcore_checkpoint::~embedcore_checkpoint() {
  std::lock_guard<std::mutex> lock(Live().mutex);  // before the members (the locks) are destroyed
  Live().handles.erase(this);
}

namespace {

embedcore_checkpoint& Handle(embedcore_checkpoint* ckpt) {
  RequireNotNull(ckpt, "ckpt");
  return *ckpt;
}

int64_t CheckTable(const Snapshot& s, int64_t table) {
  const int64_t n = int64_t(s.mapped.num_tables());
  if (table < 0 || table >= n)
    throw embedcore::OutOfRange("table index " + std::to_string(table) + " is out of range [0, " + std::to_string(n) +
                                ")");
  return table;
}

int64_t CheckFeature(const Snapshot& s, int64_t feature) {
  const int64_t n = int64_t(s.features.size());
  if (feature < 0 || feature >= n)
    throw embedcore::OutOfRange("feature index " + std::to_string(feature) + " is out of range [0, " +
                                std::to_string(n) + ")" +
                                (n == 0 ? ": the checkpoint holds tables, not features" : ""));
  return feature;
}

// A reload must keep what callers may have cached: table names, order and
// dims, and the features.
void CheckCompatible(const embedcore_checkpoint& h, const Snapshot& next) {
  const embedcore::CheckpointInfo& info = next.mapped.info();
  const std::string where = info.path + " does not match the checkpoint being served: ";
  if (info.tables.size() != h.table_names.size())
    throw CheckpointError(where + "it has " + std::to_string(info.tables.size()) + " table(s), the served one " +
                          std::to_string(h.table_names.size()));
  for (size_t i = 0; i < info.tables.size(); ++i) {
    if (info.tables[i].name != h.table_names[i])
      throw CheckpointError(where + "table " + std::to_string(i) + " is '" + info.tables[i].name + "', was '" +
                            h.table_names[i] + "'");
    if (info.tables[i].dim != h.table_dims[i])
      throw CheckpointError(where + "table '" + h.table_names[i] + "' has dim " + std::to_string(info.tables[i].dim) +
                            ", was " + std::to_string(h.table_dims[i]));
  }
  const Snapshot& old = *h.Acquire();
  for (size_t i = 0; i < info.tables.size(); ++i)  // a caller's COMBINER_DEFAULT means the table's combiner
    if (next.combiners[i] != old.combiners[i])
      throw CheckpointError(where + "table '" + h.table_names[i] + "' has combiner " + CombinerName(next.combiners[i]) +
                            ", was " + CombinerName(old.combiners[i]));
  bool same = next.features.size() == old.features.size();
  for (size_t i = 0; same && i < next.features.size(); ++i)
    same = next.features[i].name == old.features[i].name && next.features[i].table == old.features[i].table &&
           next.features[i].max_sequence_length == old.features[i].max_sequence_length;
  if (!same) throw CheckpointError(where + "its features (names, tables or sequence lengths) differ");
}

// Refuses an output buffer that overlaps an input array.
void RequireDisjoint(const float* out, size_t out_bytes, const void* p, size_t bytes, const char* what) {
  if (p == nullptr || bytes == 0) return;
  const auto o = reinterpret_cast<uintptr_t>(out), q = reinterpret_cast<uintptr_t>(p);
  if (o < q + bytes && q < o + out_bytes)
    throw InvalidArgument(std::string("out overlaps ") + what + ": give the output a buffer of its own");
}

// The batch's counts: >= 0, and sizes that fit in int64. An array of more
// than kMaxBatchCount = INT64_MAX / 8 - 1 elements (the offsets' (num_bags +
// 1) x 8 bytes) cannot be in memory, and the sizes computed from such a count
// (to check overlaps, to copy the offsets) would overflow: refused as the
// engine refuses them (core/shared_checks.h), the fields named as the struct's.
void CheckCounts(const embedcore_batch* batch) {
  if (batch->nnz < 0) throw InvalidArgument("batch.nnz must be >= 0, got " + std::to_string(batch->nnz));
  if (batch->num_bags < 0) throw InvalidArgument("batch.num_bags must be >= 0, got " + std::to_string(batch->num_bags));
  embedcore::internal::CheckBatchCounts(batch->nnz, batch->num_bags, "batch.");
}

Batch ToBatch(const embedcore_batch* batch) {
  RequireObject(batch, "batch");
  Batch b;
  if (batch->id_type == EMBEDCORE_ID_INT32) {
    b.id_type = IdType::kInt32;
    RequireAligned<int32_t>(batch->ids, "batch.ids");
  } else if (batch->id_type == EMBEDCORE_ID_INT64) {
    b.id_type = IdType::kInt64;
    RequireAligned<int64_t>(batch->ids, "batch.ids");
  } else {
    throw InvalidArgument("batch.id_type must be EMBEDCORE_ID_INT32 (0) or EMBEDCORE_ID_INT64 (1), got " +
                          std::to_string(batch->id_type));
  }
  if (batch->reserved != 0) throw InvalidArgument("batch.reserved must be 0 (zero-initialize the struct)");
  CheckCounts(batch);
  if (batch->nnz > 0 && batch->ids == nullptr) throw InvalidArgument("batch.ids: null pointer");
  RequireNotNull(batch->offsets, "batch.offsets");
  RequireAligned<int64_t>(batch->offsets, "batch.offsets");
  RequireAligned<float>(batch->weights, "batch.weights");
  b.ids = batch->ids;
  b.nnz = batch->nnz;
  b.offsets = batch->offsets;
  b.num_bags = batch->num_bags;
  b.weights = batch->weights;
  return b;
}

OutputShape ToShape(const Snapshot& s, int64_t table, int32_t combiner, int64_t max_sequence_length) {
  OutputShape shape;
  if (combiner == EMBEDCORE_COMBINER_DEFAULT) {
    shape.combiner = s.combiners[size_t(table)];
  } else if (combiner >= EMBEDCORE_COMBINER_SUM && combiner <= EMBEDCORE_COMBINER_NONE) {
    shape.combiner = Combiner(combiner);
  } else {
    throw InvalidArgument("combiner must be an embedcore_combiner (-1..3), got " + std::to_string(combiner));
  }
  if (max_sequence_length < 0)
    throw InvalidArgument("max_sequence_length must be >= 0, got " + std::to_string(max_sequence_length));
  if (shape.combiner != Combiner::kNone && max_sequence_length != 0)
    throw InvalidArgument("max_sequence_length applies to EMBEDCORE_COMBINER_NONE only; got " +
                          std::to_string(max_sequence_length) + " for a pooled lookup");
  shape.max_sequence_length = max_sequence_length;
  return shape;
}

// Floats a lookup writes, overflow-checked (num_bags and nnz already checked
// by CheckCounts), their size in bytes included.
int64_t OutputFloats(const Snapshot& s, int64_t table, const Batch& b, const OutputShape& shape) {
  int64_t rows;
  if (shape.combiner != Combiner::kNone) {
    rows = b.num_bags;
  } else if (shape.max_sequence_length > 0) {
    rows = MulChecked(b.num_bags, shape.max_sequence_length, "output rows (num_bags x max_sequence_length)");
  } else {
    rows = b.nnz;
  }
  const int64_t floats = MulChecked(rows, s.mapped.info().tables[size_t(table)].dim, "output size (rows x dim)");
  MulChecked(floats, int64_t(sizeof(float)), "output bytes (floats x 4)");
  return floats;
}

void Lookup(const Snapshot& s, int64_t table, const embedcore_batch* batch, int32_t combiner,
            int64_t max_sequence_length, float* out, int64_t out_len) {
  CheckTable(s, table);
  const Batch b = ToBatch(batch);
  const OutputShape shape = ToShape(s, table, combiner, max_sequence_length);
  const int64_t need = OutputFloats(s, table, b, shape);
  if (out_len < need)
    throw InvalidArgument("out holds " + std::to_string(out_len) + " floats (out_len), the output needs " +
                          std::to_string(need));
  if (need > 0) RequireNotNull(out, "out");
  RequireAligned<float>(out, "out");
  if (need > 0) {  // the results would be computed from what was already written
    const size_t id_bytes = b.id_type == IdType::kInt32 ? 4 : 8;
    RequireDisjoint(out, size_t(need) * 4, b.ids, size_t(b.nnz) * id_bytes, "batch.ids");
    RequireDisjoint(out, size_t(need) * 4, b.offsets, size_t(b.num_bags + 1) * 8, "batch.offsets");
    RequireDisjoint(out, size_t(need) * 4, b.weights, b.weights ? size_t(b.nnz) * 4 : 0, "batch.weights");
  }
  s.mapped.Lookup(size_t(table), b, shape, out);  // validates ids and offsets before writing
}

}  // namespace

// ================================================================ the C ABI
extern "C" {

EMBEDCORE_C_API_EXPORT const char* embedcore_last_error(void) { return g_last_error.c_str(); }

EMBEDCORE_C_API_EXPORT const char* embedcore_version(void) { return EMBEDCORE_VERSION_STRING; }

EMBEDCORE_C_API_EXPORT int embedcore_build_info(const char** out_json) {
  EMBEDCORE_API_BEGIN();
  RequireObject(out_json, "out_json");
  static const std::string json = [] {
    const embedcore::BuildInfo b = embedcore::GetBuildInfo();
    Json j = Json::object();
    j["version"] = b.version;
    j["c_abi_version"] = EMBEDCORE_C_ABI_VERSION;
    j["format_version"] = {embedcore::kFormatMajor, embedcore::kFormatMinor};
    j["simd"] = b.simd;
    j["compiler"] = b.compiler;
    j["cuda"] = b.cuda;
    j["nccl"] = b.nccl;
    j["mpi"] = b.mpi;
    return j.dump();
  }();
  *out_json = json.c_str();
  EMBEDCORE_API_END();
}

EMBEDCORE_C_API_EXPORT int embedcore_set_num_threads(int num_threads) {
  EMBEDCORE_API_BEGIN();
  embedcore::SetNumThreads(num_threads);  // in [1, embedcore::kMaxThreads]
  EMBEDCORE_API_END();
}

EMBEDCORE_C_API_EXPORT int embedcore_get_num_threads(int* out) {
  EMBEDCORE_API_BEGIN();
  RequireObject(out, "out");
  *out = embedcore::GetNumThreads();
  EMBEDCORE_API_END();
}

EMBEDCORE_C_API_EXPORT int embedcore_open(const char* path, const char* options_json, embedcore_checkpoint** out) {
  EMBEDCORE_API_BEGIN();
  const std::string where = RequirePath(path, "path");
  RequireObject(out, "out");
  const MappedCheckpoint::Verify verify = ParseVerify(options_json, MappedCheckpoint::Verify::kLazy);
  auto handle = std::make_unique<embedcore_checkpoint>();
  handle->directory = AbsolutePath(where);
  auto snapshot = std::make_shared<const Snapshot>(where, verify);
  for (const embedcore::TableEntry& t : snapshot->mapped.info().tables) {
    handle->table_names.push_back(t.name);
    handle->table_dims.push_back(t.dim);
  }
  for (const Feature& f : snapshot->features) handle->feature_names.push_back(f.name);
  handle->verify = verify;
  handle->Swap(std::move(snapshot));
  *out = handle.release();
  EMBEDCORE_API_END();
}

EMBEDCORE_C_API_EXPORT int embedcore_reload(embedcore_checkpoint* ckpt, const char* path, const char* options_json) {
  EMBEDCORE_API_BEGIN();
  embedcore_checkpoint& h = Handle(ckpt);
  std::lock_guard<std::mutex> lock(h.reload_mutex);
  const MappedCheckpoint::Verify verify = ParseVerify(options_json, h.verify);
  // NULL: the directory served now, as an absolute path (the working
  // directory may have changed since it was opened).
  const std::string where = path != nullptr ? RequirePath(path, "path") : h.directory;
  std::string directory = path != nullptr ? AbsolutePath(where) : h.directory;
  auto next = std::make_shared<const Snapshot>(where, verify);
  CheckCompatible(h, *next);
  // Lookups running on the old snapshot keep their reference; the last one
  // to return releases it (and its mappings), here if none is running.
  h.Swap(std::move(next));
  h.verify = verify;
  h.directory = std::move(directory);
  EMBEDCORE_API_END();
}

EMBEDCORE_C_API_EXPORT int embedcore_close(embedcore_checkpoint* ckpt) {
  EMBEDCORE_API_BEGIN();
  delete ckpt;
  EMBEDCORE_API_END();
}

EMBEDCORE_C_API_EXPORT int embedcore_checkpoint_generation(embedcore_checkpoint* ckpt, uint64_t* out) {
  EMBEDCORE_API_BEGIN();
  embedcore_checkpoint& h = Handle(ckpt);
  RequireObject(out, "out");
  *out = h.Acquire()->mapped.info().generation;
  EMBEDCORE_API_END();
}

EMBEDCORE_C_API_EXPORT int embedcore_num_tables(embedcore_checkpoint* ckpt, int64_t* out) {
  EMBEDCORE_API_BEGIN();
  embedcore_checkpoint& h = Handle(ckpt);
  RequireObject(out, "out");
  *out = int64_t(h.table_names.size());
  EMBEDCORE_API_END();
}

EMBEDCORE_C_API_EXPORT int embedcore_describe_table(embedcore_checkpoint* ckpt, int64_t table,
                                                    embedcore_table_info* out) {
  EMBEDCORE_API_BEGIN();
  embedcore_checkpoint& h = Handle(ckpt);
  RequireObject(out, "out");
  const std::shared_ptr<const Snapshot> s = h.Acquire();
  CheckTable(*s, table);
  const embedcore::TableEntry& t = s->mapped.info().tables[size_t(table)];
  embedcore_table_info info;
  info.name = h.table_names[size_t(table)].c_str();
  info.rows = t.rows;
  info.dim = t.dim;
  info.dtype = int32_t(t.values.at(0).dtype);
  info.combiner = int32_t(s->combiners[size_t(table)]);
  *out = info;
  EMBEDCORE_API_END();
}

EMBEDCORE_C_API_EXPORT int embedcore_find_table(embedcore_checkpoint* ckpt, const char* name, int64_t* out) {
  EMBEDCORE_API_BEGIN();
  embedcore_checkpoint& h = Handle(ckpt);
  RequireNotNull(name, "name");
  RequireObject(out, "out");
  for (size_t i = 0; i < h.table_names.size(); ++i) {
    if (h.table_names[i] == name) {
      *out = int64_t(i);
      return EMBEDCORE_OK;
    }
  }
  throw embedcore::OutOfRange("no table named '" + Excerpt(std::string(name)) + "' in the checkpoint");
  EMBEDCORE_API_END();
}

EMBEDCORE_C_API_EXPORT int embedcore_num_features(embedcore_checkpoint* ckpt, int64_t* out) {
  EMBEDCORE_API_BEGIN();
  embedcore_checkpoint& h = Handle(ckpt);
  RequireObject(out, "out");
  *out = int64_t(h.feature_names.size());
  EMBEDCORE_API_END();
}

EMBEDCORE_C_API_EXPORT int embedcore_describe_feature(embedcore_checkpoint* ckpt, int64_t feature,
                                                  embedcore_feature_info* out) {
  EMBEDCORE_API_BEGIN();
  embedcore_checkpoint& h = Handle(ckpt);
  RequireObject(out, "out");
  const std::shared_ptr<const Snapshot> s = h.Acquire();
  const Feature& f = s->features[size_t(CheckFeature(*s, feature))];
  embedcore_feature_info info;
  info.name = h.feature_names[size_t(feature)].c_str();
  info.table = f.table;
  info.max_sequence_length = f.max_sequence_length;
  *out = info;
  EMBEDCORE_API_END();
}

EMBEDCORE_C_API_EXPORT int embedcore_find_feature(embedcore_checkpoint* ckpt, const char* name, int64_t* out) {
  EMBEDCORE_API_BEGIN();
  embedcore_checkpoint& h = Handle(ckpt);
  RequireNotNull(name, "name");
  RequireObject(out, "out");
  for (size_t i = 0; i < h.feature_names.size(); ++i) {
    if (h.feature_names[i] == name) {
      *out = int64_t(i);
      return EMBEDCORE_OK;
    }
  }
  throw embedcore::OutOfRange("no feature named '" + Excerpt(std::string(name)) + "' in the checkpoint" +
                              (h.feature_names.empty() ? " (it holds tables, not features)" : ""));
  EMBEDCORE_API_END();
}

EMBEDCORE_C_API_EXPORT int embedcore_lookup(embedcore_checkpoint* ckpt, int64_t table, const embedcore_batch* batch,
                                            int32_t combiner, int64_t max_sequence_length, float* out,
                                            int64_t out_len) {
  EMBEDCORE_API_BEGIN();
  const std::shared_ptr<const Snapshot> s = Handle(ckpt).Acquire();  // held for the whole lookup
  Lookup(*s, table, batch, combiner, max_sequence_length, out, out_len);
  EMBEDCORE_API_END();
}

EMBEDCORE_C_API_EXPORT int embedcore_lookup_feature(embedcore_checkpoint* ckpt, int64_t feature,
                                                    const embedcore_batch* batch, float* out, int64_t out_len) {
  EMBEDCORE_API_BEGIN();
  const std::shared_ptr<const Snapshot> s = Handle(ckpt).Acquire();
  const Feature& f = s->features[size_t(CheckFeature(*s, feature))];
  // As embedcore.serving: a sequence feature keeps its rows, padded to its
  // length; a pooled one uses its table's combiner.
  if (f.max_sequence_length > 0)
    Lookup(*s, f.table, batch, EMBEDCORE_COMBINER_NONE, f.max_sequence_length, out, out_len);
  else
    Lookup(*s, f.table, batch, EMBEDCORE_COMBINER_DEFAULT, 0, out, out_len);
  EMBEDCORE_API_END();
}

EMBEDCORE_C_API_EXPORT int embedcore_lookup_size(embedcore_checkpoint* ckpt, int64_t table,
                                                 const embedcore_batch* batch, int32_t combiner,
                                                 int64_t max_sequence_length, int64_t* out) {
  EMBEDCORE_API_BEGIN();
  RequireObject(out, "out");
  const std::shared_ptr<const Snapshot> s = Handle(ckpt).Acquire();
  CheckTable(*s, table);
  RequireObject(batch, "batch");
  CheckCounts(batch);
  Batch b;
  b.nnz = batch->nnz;
  b.num_bags = batch->num_bags;
  *out = OutputFloats(*s, table, b, ToShape(*s, table, combiner, max_sequence_length));
  EMBEDCORE_API_END();
}

}  // extern "C"
