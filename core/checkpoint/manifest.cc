// The manifest: JSON inside a checksummed binary envelope. Parsing treats
// every byte as untrusted: bounded sizes, strict types, overflow-checked
// arithmetic, safe file names. Every error names the file and the field.
#include <dirent.h>

#include <algorithm>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "checkpoint/crc32c.h"
#include "checkpoint/file_io.h"
#include "checkpoint/format.h"
#include "checkpoint/manifest.h"
#include "checkpoint/strict_json.h"
#include "internal.h"

namespace embedcore::checkpoint {

using Json = nlohmann::ordered_json;

constexpr int kMaxJsonDepth = 32;

namespace {

const char* OptimizerKindName(OptimizerSpec::Kind k) {
  switch (k) {
    case OptimizerSpec::Kind::kSGD:
      return "sgd";
    case OptimizerSpec::Kind::kAdagrad:
      return "adagrad";
    case OptimizerSpec::Kind::kRowwiseAdagrad:
      return "rowwise_adagrad";  // since format 1.3
    case OptimizerSpec::Kind::kAdam:
      return "adam";
    case OptimizerSpec::Kind::kFTRL:
      return "ftrl";
  }
  return "?";
}

const char* InitializerKindName(InitializerSpec::Kind k) {
  switch (k) {
    case InitializerSpec::Kind::kZeros:
      return "zeros";
    case InitializerSpec::Kind::kConstant:
      return "constant";
    case InitializerSpec::Kind::kUniform:
      return "uniform";
    case InitializerSpec::Kind::kNormal:
      return "normal";
    case InitializerSpec::Kind::kTruncatedNormal:
      return "truncated_normal";
  }
  return "?";
}

// Typed access to untrusted JSON; errors carry the manifest path and field.
class Reader {
 public:
  explicit Reader(std::string file) : file_(std::move(file)) {}
  [[noreturn]] void Fail(const std::string& where, const std::string& what) const {
    throw CheckpointError(file_ + ": " + where + " " + what);
  }
  const Json& Get(const Json& obj, const char* key, const std::string& where) const {
    if (!obj.is_object()) Fail(where, "must be an object");
    auto it = obj.find(key);
    if (it == obj.end()) Fail(where + "." + key, "is missing");
    return *it;
  }
  int64_t Int(const Json& obj, const char* key, const std::string& where, int64_t lo, int64_t hi) const {
    return IntValue(Get(obj, key, where), where + "." + key, lo, hi);
  }
  // The integer `v` (the field `field`), which must lie in [lo, hi].
  int64_t IntValue(const Json& v, const std::string& field, int64_t lo, int64_t hi) const {
    if (!v.is_number_integer()) Fail(field, "must be an integer");
    int64_t x;
    if (v.is_number_unsigned()) {
      const uint64_t u = v.get<uint64_t>();
      if (u > uint64_t(INT64_MAX)) Fail(field, "is out of range");
      x = int64_t(u);
    } else {
      x = v.get<int64_t>();
    }
    if (x < lo || x > hi)
      Fail(field, "= " + std::to_string(x) + " is outside [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
    return x;
  }
  double Number(const Json& obj, const char* key, const std::string& where) const {
    const Json& v = Get(obj, key, where);
    if (!v.is_number()) Fail(where + "." + key, "must be a number");
    return v.get<double>();
  }
  bool Bool(const Json& obj, const char* key, const std::string& where) const {
    const Json& v = Get(obj, key, where);
    if (!v.is_boolean()) Fail(where + "." + key, "must be true or false");
    return v.get<bool>();
  }
  std::string String(const Json& obj, const char* key, const std::string& where) const {
    const Json& v = Get(obj, key, where);
    if (!v.is_string()) Fail(where + "." + key, "must be a string");
    return v.get<std::string>();
  }
  const Json& Array(const Json& obj, const char* key, const std::string& where, size_t max_len) const {
    const Json& v = Get(obj, key, where);
    if (!v.is_array()) Fail(where + "." + key, "must be an array");
    if (v.size() > max_len) Fail(where + "." + key, "has too many entries (" + std::to_string(v.size()) + ")");
    return v;
  }

 private:
  std::string file_;
};

// A table's dtype (the manifest's table "dtype"), or with `file` a data
// file's, which may also be uint8_rowwise (since 1.4).
DType ParseStoredDType(const Reader& r, const std::string& s, const std::string& where, bool file = false) {
  if (s == "float32") return DType::kFloat32;
  if (s == "float16") return DType::kFloat16;
  if (s == "bfloat16") return DType::kBFloat16;
  if (s == "uint8_rowwise" && file) return DType::kUInt8Rowwise;
  r.Fail(where, "has unknown dtype '" + s + "'");
}

void CheckFileName(const std::string& name, const std::string& where, const Reader& r) {
  const bool bad = name.empty() || name == "." || name == ".." || name.size() > 255 ||
                   name.find('/') != std::string::npos || name.find('\\') != std::string::npos ||
                   name.find('\0') != std::string::npos || name.rfind("..", 0) == 0;
  if (bad) r.Fail(where, "'" + name + "' is not a plain file name inside the checkpoint (absolute, '..', '/' or '\\')");
}

Json FileEntryJson(const FileEntry& f) {
  Json j;
  j["path"] = f.path;
  j["bytes"] = f.bytes;
  j["dtype"] = DTypeName(f.dtype);
  j["row_start"] = f.row_start;
  j["rows"] = f.rows;
  if (f.col_start != 0) j["col_start"] = f.col_start;  // 1.2: column-wise shards only
  j["cols"] = f.cols;
  j["block_bytes"] = f.block_bytes;
  j["crc32c"] = f.crc32c;
  return j;
}

FileEntry ParseFileEntry(const Reader& r, const Json& j, const std::string& where, int64_t table_rows,
                         int64_t dim) {
  FileEntry f;
  f.path = r.String(j, "path", where);
  CheckFileName(f.path, where + ".path", r);
  f.dtype = ParseStoredDType(r, r.String(j, "dtype", where), where + ".dtype", /*file=*/true);
  // Every file holds at least one row: no writer makes an empty one, and
  // serving finds a row's file by its row_start.
  f.row_start = r.Int(j, "row_start", where, 0, table_rows - 1);
  f.rows = r.Int(j, "rows", where, 1, table_rows - f.row_start);
  // A file holds all columns unless it is a column-wise shard (format 1.2).
  f.col_start = j.is_object() && j.contains("col_start") ? r.Int(j, "col_start", where, 0, dim - 1) : 0;
  f.cols = r.Int(j, "cols", where, 1, dim - f.col_start);
  f.block_bytes = uint32_t(r.Int(j, "block_bytes", where, kMinBlockBytes, kMaxBlockBytes));
  if (f.block_bytes & (f.block_bytes - 1)) r.Fail(where + ".block_bytes", "must be a power of two");
  // uint8_rowwise: whole rows only, each a scale and bias for all its columns (format 1.4).
  if (f.dtype == DType::kUInt8Rowwise && (f.col_start != 0 || f.cols != dim))
    r.Fail(where, "is uint8_rowwise with columns [" + std::to_string(f.col_start) + ", " +
                      std::to_string(f.col_start + f.cols) + ") of " + std::to_string(dim) +
                      "; a uint8_rowwise file holds whole rows (col_start 0, cols = dim)");
  // No overflow: rows, cols bounded by the table's checked size (rows * dim * 4 bytes, and
  // rows * (cols + 8) <= rows * cols * 9 for a uint8_rowwise file, which the check below bounds).
  if (f.dtype == DType::kUInt8Rowwise &&
      (unsigned __int128)uint64_t(f.rows) * (uint64_t(f.cols) + 8) > (unsigned __int128)INT64_MAX)
    r.Fail(where, "has rows x (cols + 8) too large to address");
  const uint64_t payload = PayloadBytes(f);
  f.bytes = uint64_t(r.Int(j, "bytes", where, 0, INT64_MAX));
  if (f.bytes != kDataOffset + payload)
    r.Fail(where + ".bytes", "= " + std::to_string(f.bytes) + " does not fit " + std::to_string(f.rows) + " x " +
                                 std::to_string(f.cols) + " " + DTypeName(f.dtype) + " (expected " +
                                 std::to_string(kDataOffset + payload) + ")");
  const uint64_t blocks = (payload + f.block_bytes - 1) / f.block_bytes;
  const Json& crcs = r.Array(j, "crc32c", where, size_t(blocks));
  if (crcs.size() != blocks)
    r.Fail(where + ".crc32c", "has " + std::to_string(crcs.size()) + " checksums for " + std::to_string(blocks) +
                                  " blocks");
  f.crc32c.reserve(crcs.size());
  for (const Json& c : crcs) {
    if (!c.is_number_unsigned() || c.get<uint64_t>() > 0xffffffffull) r.Fail(where + ".crc32c", "holds a non-CRC value");
    f.crc32c.push_back(uint32_t(c.get<uint64_t>()));
  }
  return f;
}

// The files of one array (values or a slot) must tile the [rows, dim] array
// exactly once: their column ranges form bands that cover [0, dim) without
// overlap, and within each band the files cover rows [0, rows) once.
void CheckCoverage(const Reader& r, std::vector<FileEntry>& files, int64_t rows, int64_t dim, const std::string& where) {
  std::sort(files.begin(), files.end(), [](const FileEntry& a, const FileEntry& b) {
    return a.col_start != b.col_start ? a.col_start < b.col_start : a.row_start < b.row_start;
  });
  int64_t next_col = 0;
  for (size_t i = 0; i < files.size();) {
    const int64_t c0 = files[i].col_start, cols = files[i].cols;
    if (c0 > next_col)
      r.Fail(where, "covers no columns [" + std::to_string(next_col) + ", " + std::to_string(c0) + "): no file starts "
                    "at column " + std::to_string(next_col));
    if (c0 < next_col)
      r.Fail(where, "covers columns [" + std::to_string(c0) + ", " + std::to_string(next_col) + ") twice: file '" +
                        files[i].path + "' starts at column " + std::to_string(c0) + ", inside the band before it");
    int64_t next = 0;
    for (; i < files.size() && files[i].col_start == c0; ++i) {
      const FileEntry& f = files[i];
      if (f.cols != cols)
        r.Fail(where, "holds files of different widths starting at column " + std::to_string(c0));
      const std::string band = " of columns [" + std::to_string(c0) + ", " + std::to_string(c0 + cols) + ")";
      if (f.row_start > next)
        r.Fail(where, "covers no rows [" + std::to_string(next) + ", " + std::to_string(f.row_start) + ")" + band +
                          ": no file starts at row " + std::to_string(next));
      if (f.row_start < next)
        r.Fail(where, "covers rows [" + std::to_string(f.row_start) + ", " + std::to_string(next) + ")" + band +
                          " twice: file '" + f.path + "' starts at row " + std::to_string(f.row_start) +
                          ", inside the file before it");
      next = f.row_start + f.rows;
    }
    if (next != rows) r.Fail(where, "covers rows [0, " + std::to_string(next) + ") of " + std::to_string(rows));
    next_col = c0 + cols;
  }
  if (next_col != dim)
    r.Fail(where, "covers columns [0, " + std::to_string(next_col) + ") of " + std::to_string(dim));
}

Json OptimizerJson(const OptimizerSpec& o) {
  Json j;
  j["kind"] = OptimizerKindName(o.kind);
  j["initial_accumulator_value"] = o.initial_accumulator_value;
  j["beta_1"] = o.beta_1;
  j["beta_2"] = o.beta_2;
  j["epsilon"] = o.epsilon;
  j["adagrad_epsilon"] = o.adagrad_epsilon;  // since format 1.1
  j["lazy_adam"] = o.lazy_adam;
  j["sum_inside_sqrt"] = o.sum_inside_sqrt;
  j["bias_correction"] = o.bias_correction;
  j["learning_rate_power"] = o.learning_rate_power;
  j["l1"] = o.l1;
  j["l2"] = o.l2;
  j["beta"] = o.beta;
  j["multiply_linear_by_learning_rate"] = o.multiply_linear_by_learning_rate;
  j["clip_weight_min"] = o.has_clip_weight_min ? Json(o.clip_weight_min) : Json(nullptr);
  j["clip_weight_max"] = o.has_clip_weight_max ? Json(o.clip_weight_max) : Json(nullptr);
  j["clipvalue"] = o.has_clipvalue ? Json::array({o.clip_gradient_min, o.clip_gradient_max}) : Json(nullptr);
  j["weight_decay_factor"] = o.weight_decay_factor;
  j["multiply_weight_decay_factor_by_learning_rate"] = o.multiply_weight_decay_factor_by_learning_rate;
  return j;
}

bool IsKnownOptimizer(const Reader& r, const Json& j, const std::string& where) {
  const std::string kind = r.String(j, "kind", where);
  return kind == "sgd" || kind == "adagrad" || kind == "rowwise_adagrad" || kind == "adam" || kind == "ftrl";
}

// The slots of an optimizer this reader does not know: each an array of
// [rows, width] float32 files, at most as wide as the table, that tile it.
void ParseUnknownSlots(const Reader& r, const Json& slots, TableEntry* t, const std::string& where) {
  if (slots.size() > 64) r.Fail(where, "lists more than 64 slots");
  for (auto it = slots.begin(); it != slots.end(); ++it) {
    const std::string slot_where = where + "." + it.key();
    if (!it->is_array() || it->empty() || it->size() > (1u << 20)) r.Fail(slot_where, "must be a non-empty array");
    std::vector<FileEntry> files;
    int64_t width = 0;
    for (size_t k = 0; k < it->size(); ++k) {
      FileEntry f = ParseFileEntry(r, (*it)[k], slot_where + "[" + std::to_string(k) + "]", t->rows, t->dim);
      if (f.dtype != DType::kFloat32) r.Fail(slot_where, "must be float32");
      width = std::max(width, f.col_start + f.cols);
      files.push_back(std::move(f));
    }
    CheckCoverage(r, files, t->rows, width, slot_where);
    t->slot_names.push_back(it.key());
    t->slots.push_back(std::move(files));
  }
}

OptimizerSpec ParseOptimizer(const Reader& r, const Json& j, const std::string& where) {
  OptimizerSpec o;
  const std::string kind = r.String(j, "kind", where);
  if (kind == "sgd") o.kind = OptimizerSpec::Kind::kSGD;
  else if (kind == "adagrad") o.kind = OptimizerSpec::Kind::kAdagrad;
  else if (kind == "rowwise_adagrad") o.kind = OptimizerSpec::Kind::kRowwiseAdagrad;  // 1.3
  else if (kind == "adam") o.kind = OptimizerSpec::Kind::kAdam;
  else if (kind == "ftrl") o.kind = OptimizerSpec::Kind::kFTRL;
  else r.Fail(where + ".kind", "is an unknown optimizer '" + kind + "'");
  o.initial_accumulator_value = float(r.Number(j, "initial_accumulator_value", where));
  o.beta_1 = float(r.Number(j, "beta_1", where));
  o.beta_2 = float(r.Number(j, "beta_2", where));
  o.epsilon = float(r.Number(j, "epsilon", where));
  if (j.contains("adagrad_epsilon")) o.adagrad_epsilon = float(r.Number(j, "adagrad_epsilon", where));  // 1.1
  o.lazy_adam = r.Bool(j, "lazy_adam", where);
  o.sum_inside_sqrt = r.Bool(j, "sum_inside_sqrt", where);
  o.bias_correction = r.Bool(j, "bias_correction", where);
  o.learning_rate_power = float(r.Number(j, "learning_rate_power", where));
  o.l1 = float(r.Number(j, "l1", where));
  o.l2 = float(r.Number(j, "l2", where));
  o.beta = float(r.Number(j, "beta", where));
  o.multiply_linear_by_learning_rate = r.Bool(j, "multiply_linear_by_learning_rate", where);
  const Json& wmin = r.Get(j, "clip_weight_min", where);
  if (!wmin.is_null()) o.has_clip_weight_min = true, o.clip_weight_min = float(r.Number(j, "clip_weight_min", where));
  const Json& wmax = r.Get(j, "clip_weight_max", where);
  if (!wmax.is_null()) o.has_clip_weight_max = true, o.clip_weight_max = float(r.Number(j, "clip_weight_max", where));
  const Json& cv = r.Get(j, "clipvalue", where);
  if (!cv.is_null()) {
    if (!cv.is_array() || cv.size() != 2 || !cv[0].is_number() || !cv[1].is_number())
      r.Fail(where + ".clipvalue", "must be null or [min, max]");
    o.has_clipvalue = true;
    o.clip_gradient_min = cv[0].get<float>();
    o.clip_gradient_max = cv[1].get<float>();
  }
  o.weight_decay_factor = float(r.Number(j, "weight_decay_factor", where));
  o.multiply_weight_decay_factor_by_learning_rate = r.Bool(j, "multiply_weight_decay_factor_by_learning_rate", where);
  try {
    o.Validate(/*table=*/false);  // a record: what earlier versions allowed still reads
  } catch (const InvalidArgument& e) {
    r.Fail(where, e.what());
  }
  return o;
}

Json InitializerJson(const InitializerSpec& s) {
  Json j;
  j["kind"] = InitializerKindName(s.kind);
  j["a"] = s.a;
  j["b"] = s.b;
  j["seed"] = s.seed;
  return j;
}

bool IsKnownInitializer(const Reader& r, const Json& j, const std::string& where) {
  const std::string kind = r.String(j, "kind", where);
  return kind == "zeros" || kind == "constant" || kind == "uniform" || kind == "normal" || kind == "truncated_normal";
}

InitializerSpec ParseInitializer(const Reader& r, const Json& j, const std::string& where) {
  InitializerSpec s;
  const std::string kind = r.String(j, "kind", where);
  if (kind == "zeros") s.kind = InitializerSpec::Kind::kZeros;
  else if (kind == "constant") s.kind = InitializerSpec::Kind::kConstant;
  else if (kind == "uniform") s.kind = InitializerSpec::Kind::kUniform;
  else if (kind == "normal") s.kind = InitializerSpec::Kind::kNormal;
  else if (kind == "truncated_normal") s.kind = InitializerSpec::Kind::kTruncatedNormal;
  else r.Fail(where + ".kind", "is an unknown initializer '" + kind + "'");
  s.a = r.Number(j, "a", where);
  s.b = r.Number(j, "b", where);
  const Json& seed = r.Get(j, "seed", where);
  if (!seed.is_number_unsigned() && !(seed.is_number_integer() && seed.get<int64_t>() >= 0))
    r.Fail(where + ".seed", "must be a non-negative integer");
  s.seed = seed.get<uint64_t>();
  return s;
}

Json ParseObject(const std::string& text, const std::string& what) {
  Json j;
  try {
    j = Json::parse(text);
  } catch (const Json::exception& e) {
    throw InvalidArgument(what + " is not valid JSON: " + e.what());
  }
  if (!j.is_object()) throw InvalidArgument(what + " must be a JSON object");
  return j;
}

}  // namespace

static Json TableJson(const TableEntry& t) {
  if (!t.unknown_optimizer.empty())  // never written as something else
    throw InvalidArgument("table '" + t.name + "': its optimizer '" + t.unknown_optimizer +
                          "' is unknown to this version; it cannot be saved");
  Json tj;
  tj["name"] = t.name;
  tj["rows"] = t.rows;
  tj["dim"] = t.dim;
  tj["dtype"] = DTypeName(t.dtype);
  tj["initializer"] = t.unknown_initializer_json.empty() ? InitializerJson(t.initializer)
                                                         : Json::parse(t.unknown_initializer_json);
  tj["optimizer"] = t.has_optimizer ? OptimizerJson(t.optimizer) : Json(nullptr);
  tj["step"] = t.step;
  tj["sharding"] = ParseObject(t.sharding_json, "sharding");
  Json values = Json::array();
  for (const FileEntry& f : t.values) values.push_back(FileEntryJson(f));
  tj["values"] = values;
  Json slots = Json::object();
  for (size_t i = 0; i < t.slot_names.size(); ++i) {
    Json files = Json::array();
    for (const FileEntry& f : t.slots[i]) files.push_back(FileEntryJson(f));
    slots[t.slot_names[i]] = files;
  }
  tj["slots"] = slots;
  tj["config"] = ParseObject(t.config_json, "table config");
  return tj;
}

uint64_t PayloadBytes(const FileEntry& f) { return uint64_t(f.rows) * RowBytes(f.dtype, f.cols); }

std::string BuildManifest(const CheckpointInfo& info) {
  Json m;
  m["format"] = "embedcore.checkpoint";
  m["format_version"] = Json::array({kFormatMajor, kFormatMinor});
  m["library_version"] = EMBEDCORE_VERSION_STRING;
  m["byte_order"] = "little";
  m["generation"] = info.generation;
  Json tables = Json::array();
  for (const TableEntry& t : info.tables) {
    Json tj = TableJson(t);
    tables.push_back(tj);
  }
  m["tables"] = tables;
  m["metadata"] = ParseObject(info.metadata_json, "metadata");
  return m.dump(1);
}

namespace {
// True when `s` is well-formed UTF-8 (no overlong forms, surrogates or values past U+10FFFF).
bool IsUtf8(const std::string& s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  for (size_t i = 0; i < n;) {
    const unsigned char c = p[i];
    size_t len;
    uint32_t cp;
    if (c < 0x80) {
      ++i;
      continue;
    } else if ((c & 0xe0) == 0xc0) {
      len = 2, cp = c & 0x1f;
    } else if ((c & 0xf0) == 0xe0) {
      len = 3, cp = c & 0x0f;
    } else if ((c & 0xf8) == 0xf0) {
      len = 4, cp = c & 0x07;
    } else {
      return false;
    }
    if (i + len > n) return false;
    for (size_t k = 1; k < len; ++k) {
      if ((p[i + k] & 0xc0) != 0x80) return false;
      cp = (cp << 6) | (p[i + k] & 0x3f);
    }
    static const uint32_t kMin[5] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < kMin[len] || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return false;
    i += len;
  }
  return true;
}
}  // namespace

CheckpointInfo ParseManifest(const std::string& file, const std::string& text) {
  Reader r(file);
  if (!IsUtf8(text)) throw CheckpointError(file + ": the manifest is not valid UTF-8");
  // A byte-order mark: the parser skips one, Python's json (the CLI, reshard, serving's metadata) does not.
  if (text.compare(0, 3, "\xEF\xBB\xBF") == 0)
    throw CheckpointError(file + ": the manifest starts with a byte-order mark (not JSON text as written)");
  // JSON text has no raw NUL (a string holds one as \u0000); the parser would stop at one.
  if (text.find('\0') != std::string::npos)
    throw CheckpointError(file + ": the manifest holds a NUL byte at " + std::to_string(text.find('\0')) +
                          " (not JSON text)");
  Json m;
  std::string repeated;
  try {
    // A real manifest nests a few levels; refuse deep nesting before it costs stack or time.
    repeated = strict_json::Parse(text.data(), text.data() + text.size(), kMaxJsonDepth, [&] {
      throw CheckpointError(file + ": the manifest nests deeper than " + std::to_string(kMaxJsonDepth) + " levels");
    }, &m);
  } catch (const Json::exception& e) {
    throw CheckpointError(file + ": the manifest is not valid JSON (" + e.what() + ")");
  }
  if (!repeated.empty())
    throw CheckpointError(file + ": the manifest gives the key " + repeated + " twice in one object");
  CheckpointInfo info;
  if (r.String(m, "format", "manifest") != "embedcore.checkpoint") r.Fail("manifest.format", "is not embedcore.checkpoint");
  const Json& version = r.Array(m, "format_version", "manifest", 2);
  if (version.size() != 2 || !version[0].is_number_integer() || !version[1].is_number_integer())
    r.Fail("manifest.format_version", "must be [major, minor]");
  info.format_major = int(r.IntValue(version[0], "manifest.format_version[0]", 0, 0xffff));  // u16 in the headers
  info.format_minor = int(r.IntValue(version[1], "manifest.format_version[1]", 0, 0xffff));
  if (info.format_major > kFormatMajor)
    r.Fail("manifest.format_version", std::to_string(info.format_major) + "." + std::to_string(info.format_minor) +
                                          " is newer than this library reads (" + std::to_string(kFormatMajor) +
                                          ".x); upgrade embedcore");
  if (info.format_major < 1) r.Fail("manifest.format_version", "is not a released format version");
  if (r.String(m, "byte_order", "manifest") != "little") r.Fail("manifest.byte_order", "must be 'little'");
  info.library_version = r.String(m, "library_version", "manifest");
  info.generation = uint64_t(r.Int(m, "generation", "manifest", 0, int64_t(kMaxGeneration)));
  const Json& tables = r.Array(m, "tables", "manifest", 1 << 20);
  std::set<std::string> names;
  for (size_t i = 0; i < tables.size(); ++i) {
    const Json& tj = tables[i];
    const std::string where = "tables[" + std::to_string(i) + "]";
    TableEntry t;
    t.name = r.String(tj, "name", where);
    if (!names.insert(t.name).second)
      r.Fail(where + ".name", "'" + t.name + "' names two tables; names must be unique");
    t.rows = r.Int(tj, "rows", where, 1, INT64_MAX);
    t.dim = r.Int(tj, "dim", where, 1, INT64_MAX);
    t.dtype = ParseStoredDType(r, r.String(tj, "dtype", where), where + ".dtype");
    try {
      internal::CheckedBytes(t.rows, t.dim, sizeof(float), t.name);
    } catch (const InvalidArgument&) {
      r.Fail(where, "has rows x dim too large to address");
    }
    const Json& init = r.Get(tj, "initializer", where);
    if (!init.is_object()) r.Fail(where + ".initializer", "must be an object");
    if (IsKnownInitializer(r, init, where + ".initializer"))
      t.initializer = ParseInitializer(r, init, where + ".initializer");
    else  // a newer writer's: how the table was first filled, which no read uses; kept as written
      t.unknown_initializer_json = init.dump();
    const Json& opt = r.Get(tj, "optimizer", where);
    t.has_optimizer = !opt.is_null();
    if (t.has_optimizer && !IsKnownOptimizer(r, opt, where + ".optimizer")) {
      // A newer writer's optimizer: the values stay readable (serving, values-only loads, verify).
      t.has_optimizer = false;
      t.unknown_optimizer = r.String(opt, "kind", where + ".optimizer");
    }
    if (t.has_optimizer) t.optimizer = ParseOptimizer(r, opt, where + ".optimizer");
    t.step = r.Int(tj, "step", where, 0, kMaxStep);
    const Json& sharding = r.Get(tj, "sharding", where);
    if (!sharding.is_object()) r.Fail(where + ".sharding", "must be an object");
    t.sharding_json = sharding.dump();
    const Json& values = r.Array(tj, "values", where, 1 << 20);
    for (size_t k = 0; k < values.size(); ++k)
      t.values.push_back(ParseFileEntry(r, values[k], where + ".values[" + std::to_string(k) + "]", t.rows, t.dim));
    CheckCoverage(r, t.values, t.rows, t.dim, where + ".values");
    const Json& slots = r.Get(tj, "slots", where);
    if (!slots.is_object()) r.Fail(where + ".slots", "must be an object");
    if (!t.unknown_optimizer.empty()) {
      ParseUnknownSlots(r, slots, &t, where + ".slots");
    } else if (const std::vector<std::string> expected =
                   t.has_optimizer ? t.optimizer.SlotNames() : std::vector<std::string>{};
               !slots.empty() || t.has_optimizer) {
      if (slots.size() != expected.size()) r.Fail(where + ".slots", "do not match the optimizer's slots");
      for (const std::string& name : expected) {
        auto it = slots.find(name);
        if (it == slots.end()) r.Fail(where + ".slots", "lack '" + name + "'");
        if (!it->is_array() || it->size() > (1u << 20)) r.Fail(where + ".slots." + name, "must be an array");
        std::vector<FileEntry> files;
        const int64_t slot_dim = t.optimizer.SlotDim(t.dim);  // [rows, 1] for row-wise Adagrad
        for (size_t k = 0; k < it->size(); ++k) {
          FileEntry f = ParseFileEntry(r, (*it)[k], where + ".slots." + name + "[" + std::to_string(k) + "]", t.rows,
                                       slot_dim);
          if (f.dtype != DType::kFloat32) r.Fail(where + ".slots." + name, "must be float32");
          files.push_back(std::move(f));
        }
        CheckCoverage(r, files, t.rows, slot_dim, where + ".slots." + name);
        t.slot_names.push_back(name);
        t.slots.push_back(std::move(files));
      }
    }
    const Json& config = r.Get(tj, "config", where);
    if (!config.is_object()) r.Fail(where + ".config", "must be an object");
    t.config_json = config.dump();
    // Since 1.5: a PyTorch module's padding_idx, which serving leaves out of pooled bags.
    if (auto it = config.find("padding_idx"); it != config.end() && !it->is_null())
      t.padding_idx = r.IntValue(*it, where + ".config.padding_idx", 0, t.rows - 1);
    info.tables.push_back(std::move(t));
  }
  // Each data file holds one piece of one array (its header names no rows): a file named twice served and
  // loaded one piece's rows as another's, and verified.
  std::map<std::string, std::string> named;  // path -> the array that names it
  for (size_t i = 0; i < info.tables.size(); ++i) {
    const TableEntry& t = info.tables[i];
    const std::string where = "tables[" + std::to_string(i) + "]";
    auto claim = [&](const std::vector<FileEntry>& files, const std::string& array) {
      for (const FileEntry& f : files) {
        const auto [it, fresh] = named.emplace(f.path, array);
        if (!fresh)
          r.Fail(array, "names file '" + f.path + "', which " + (it->second == array ? "it" : it->second) +
                            " names too: each file holds one piece of one array");
      }
    };
    claim(t.values, where + ".values");
    for (size_t s = 0; s < t.slots.size(); ++s) claim(t.slots[s], where + ".slots." + t.slot_names[s]);
  }
  const Json& metadata = r.Get(m, "metadata", "manifest");
  if (!metadata.is_object()) r.Fail("manifest.metadata", "must be an object");
  info.metadata_json = metadata.dump();
  info.manifest_json = text;  // as written: a re-indented dump of a wide, deep manifest could be many times larger
  return info;
}

void ValidateJsonObject(const std::string& text, const std::string& what) { ParseObject(text, what); }

std::string TableEntryJson(const TableEntry& t) { return TableJson(t).dump(); }

}  // namespace embedcore::checkpoint
