// The host table: storage, validation, lookup and the sparse optimizer step.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <new>
#include <set>
#include <string>
#include <thread>
#include <utility>

#include <pthread.h>
#if defined(__x86_64__)
#include <cpuid.h>
#endif

#if defined(__SANITIZE_THREAD__)
#define EMBEDCORE_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define EMBEDCORE_TSAN 1
#endif
#endif
#ifdef EMBEDCORE_TSAN
#include <sanitizer/tsan_interface.h>
#endif

#include "embedcore/embedcore.h"
#include "checkpoint/format.h"
#include "cuda/cuda_impl.h"
#include "internal.h"
#include "shared_checks.h"
#include "kernels.h"
#include "ops/combiners.h"
#include "ops/optimizers.h"
#include "step_constants.h"
#include "thread_pool.h"

namespace embedcore {

// ---------------------------------------------------------------- small helpers
size_t DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return 4;
    case DType::kUInt8Rowwise:
      return 1;
    default:
      return 2;
  }
}

uint64_t RowBytes(DType dtype, int64_t cols) {
  return dtype == DType::kUInt8Rowwise ? uint64_t(cols) + 8 : uint64_t(cols) * DTypeSize(dtype);
}

const char* DTypeName(DType dtype) {
  switch (dtype) {
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

DType ParseDType(const std::string& name, const char* where) {
  if (name == "float32") return DType::kFloat32;
  if (name == "float16") return DType::kFloat16;
  if (name == "bfloat16") return DType::kBFloat16;
  throw InvalidArgument(std::string(where) + " must be 'float32', 'float16' or 'bfloat16', got '" + name + "'" +
                        (name == "uint8_rowwise" ? " (uint8_rowwise is an export format of checkpoints, "
                                                   "save(..., values_dtype='uint8_rowwise'), not a table dtype)"
                                                 : ""));
}

DType ParseValuesDType(const std::string& name, const char* where) {
  if (name == "uint8_rowwise") return DType::kUInt8Rowwise;
  if (name == "float32" || name == "float16" || name == "bfloat16") return ParseDType(name, where);
  throw InvalidArgument(std::string(where) + " must be 'float32', 'float16', 'bfloat16' or 'uint8_rowwise', got '" +
                        name + "'");
}

const char* CombinerName(Combiner c) {
  switch (c) {
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

std::vector<std::string> OptimizerSpec::SlotNames() const {
  switch (kind) {
    case Kind::kSGD:
      return {};
    case Kind::kAdagrad:
      return {"accumulators"};
    case Kind::kRowwiseAdagrad:
      return {"row_accumulators"};
    case Kind::kAdam:
      return {"momenta", "velocities"};
    case Kind::kFTRL:
      return {"accumulators", "linears"};
  }
  return {};
}

OptimizerSpec::SlotBound OptimizerSpec::SlotLowerBound(size_t i) const {
  SlotBound b;
  const std::vector<std::string> names = SlotNames();
  if (i >= names.size()) return b;
  if (names[i] == "accumulators" || names[i] == "row_accumulators") {
    b.bounded = true;
    // Where nothing else keeps the divisor from 0, at least the smallest normal float32: a subnormal
    // accumulator (or epsilon) is 0 where subnormals are flushed to zero (TensorFlow's kernel threads).
    if (kind == Kind::kFTRL) {
      b.minimum = std::numeric_limits<float>::min();
      b.reason = "FTRL divides by a power of the accumulator: 0 (or a subnormal, flushed to 0) makes a zero "
                 "gradient's step 0 / 0";
    } else if (adagrad_epsilon < std::numeric_limits<float>::min()) {
      b.minimum = std::numeric_limits<float>::min();
      b.reason = "with epsilon 0 (or subnormal, flushed to 0) the step divides by the accumulator's square root, "
                 "so 0 (or a subnormal) makes a zero gradient's step 0 / 0; an optimizer with a normal float32 "
                 "epsilon takes 0";
    } else {
      b.reason = "the step divides by its square root";
    }
  } else if (names[i] == "velocities") {
    b.bounded = true;
    b.reason = "the step divides by its square root";
  }
  return b;
}

std::string OptimizerSpec::SlotBound::Describe() const {
  return std::string(strict ? "> " : ">= ") + internal::FormatFloat(minimum) + " (" + reason + ")";
}

void OptimizerSpec::Validate(bool table) const {
  auto fail = [](const std::string& field, double v, const char* why) {
    throw InvalidArgument("optimizer " + field + " " + why + ", got " + internal::FormatFloat(v));
  };
  // Every option is a float32 the manifest records as a JSON number: none may be infinite or NaN.
  const std::pair<const char*, float> options[] = {
      {"initial_accumulator_value", initial_accumulator_value}, {"beta_1", beta_1}, {"beta_2", beta_2},
      {"epsilon", epsilon}, {"adagrad_epsilon", adagrad_epsilon}, {"learning_rate_power", learning_rate_power},
      {"l1_regularization_strength", l1}, {"l2_regularization_strength", l2}, {"beta", beta},
      {"clip_weight_min", has_clip_weight_min ? clip_weight_min : 0.0f},
      {"clip_weight_max", has_clip_weight_max ? clip_weight_max : 0.0f},
      {"clipvalue min", has_clipvalue ? clip_gradient_min : 0.0f},
      {"clipvalue max", has_clipvalue ? clip_gradient_max : 0.0f}, {"weight_decay_factor", weight_decay_factor}};
  for (const auto& [field, v] : options)
    if (!std::isfinite(v)) fail(field, v, "must be finite (within float32's range)");
  if (kind == Kind::kFTRL && !(initial_accumulator_value > 0.0f))
    fail("initial_accumulator_value", initial_accumulator_value, "must be > 0");
  if (kind == Kind::kAdagrad || kind == Kind::kRowwiseAdagrad) {
    if (!(adagrad_epsilon >= 0.0f) || !std::isfinite(adagrad_epsilon))
      fail("epsilon", adagrad_epsilon, "must be finite and >= 0");
    if (!(initial_accumulator_value > 0.0f) && !(initial_accumulator_value == 0.0f && adagrad_epsilon > 0.0f))
      fail("initial_accumulator_value", initial_accumulator_value, "must be > 0 (or 0 with epsilon > 0)");
  }
  if (table && (kind == Kind::kAdagrad || kind == Kind::kRowwiseAdagrad || kind == Kind::kFTRL)) {
    const SlotBound b = SlotLowerBound(0);  // the first accumulators must be within the slot's own domain
    if (!b.Admits(initial_accumulator_value))
      fail("initial_accumulator_value", initial_accumulator_value, ("must be " + b.Describe()).c_str());
  }
  if (kind == Kind::kAdam) {
    if (!(beta_1 >= 0.0f && beta_1 < 1.0f)) fail("beta_1", beta_1, "must be in [0, 1)");
    if (!(beta_2 >= 0.0f && beta_2 < 1.0f)) fail("beta_2", beta_2, "must be in [0, 1)");
    if (!(epsilon > 0.0f)) fail("epsilon", epsilon, "must be > 0");
  }
  if (kind == Kind::kFTRL) {
    if (!(learning_rate_power <= 0.0f)) fail("learning_rate_power", learning_rate_power, "must be <= 0");
    if (!(l1 >= 0.0f)) fail("l1_regularization_strength", l1, "must be >= 0");
    if (!(l2 >= 0.0f)) fail("l2_regularization_strength", l2, "must be >= 0");
    if (!(beta >= 0.0f)) fail("beta", beta, "must be >= 0");
  }
  if (has_clip_weight_min && has_clip_weight_max && clip_weight_min > clip_weight_max)
    fail("clip_weight_min", clip_weight_min, "must be <= clip_weight_max");
  if (has_clipvalue && !(clip_gradient_min <= clip_gradient_max))
    fail("clipvalue min", clip_gradient_min, "must be <= its max");
  if (!std::isfinite(weight_decay_factor) || weight_decay_factor < 0.0f)
    fail("weight_decay_factor", weight_decay_factor, "must be finite and >= 0");
}

void CheckOutStride(const OutputShape& shape, int64_t dim, bool device) {
  if (shape.out_stride == 0) return;
  if (device) throw InvalidArgument("out_stride: only lookups of host tables write strided outputs");
  if (shape.combiner == Combiner::kNone)
    throw InvalidArgument("out_stride: only pooled lookups write strided outputs (a sequence's rows are contiguous)");
  if (shape.out_stride < dim)
    throw InvalidArgument("out_stride must be 0 or at least the table's dim " + std::to_string(dim) + ", got " +
                          std::to_string(shape.out_stride));
}

int64_t OutputShape::OutputRows(const Batch& batch) const {
  if (combiner != Combiner::kNone) return batch.num_bags;
  if (max_sequence_length <= 0) return batch.nnz;
  int64_t rows = 0;
  if (__builtin_mul_overflow(batch.num_bags, max_sequence_length, &rows))
    throw InvalidArgument("max_sequence_length = " + std::to_string(max_sequence_length) + " with " +
                          std::to_string(batch.num_bags) + " bags: the output's row count overflows");
  return rows;
}

// ---------------------------------------------------------------- validation
namespace {

template <typename I>
void CheckIds(const I* ids, int64_t nnz, int64_t rows, const std::string& table) {
  const int chunks = NumChunks(nnz, 1 << 16);
  // Per chunk, the first bad position and the id read there (not read again: another thread may be rewriting
  // the ids, and the message must name what the check saw).
  std::vector<std::pair<int64_t, int64_t>> first_bad(std::max(chunks, 1), {-1, 0});
  ParallelChunks(nnz, chunks, [&](int c, int64_t k0, int64_t k1) {
    for (int64_t k = k0; k < k1; ++k) {
      const int64_t id = int64_t(ids[k]);
      if (id < 0 || id >= rows) {
        first_bad[c] = {k, id};
        return;
      }
    }
  });
  for (const auto& [k, id] : first_bad) {
    if (k < 0) continue;
    throw OutOfRange("table '" + table + "': id " + std::to_string(id) + " at position " + std::to_string(k) +
                     " of ids is out of range [0, " + std::to_string(rows) + ")");
  }
}

}  // namespace

void ValidateBatch(const Batch& batch, int64_t rows, const std::string& table) {
  if (batch.nnz < 0 || batch.num_bags < 0) throw InvalidArgument("ids: negative length");
  internal::CheckBatchCounts(batch);  // before off[batch.num_bags] is read
  if (batch.nnz > 0 && batch.ids == nullptr) throw InvalidArgument("ids: null pointer");
  if (batch.offsets == nullptr) throw InvalidArgument("offsets: null pointer");
  internal::CheckOffsets(batch.offsets, batch.num_bags, batch.nnz);
  if (batch.id_type == IdType::kInt32) {
    CheckIds(static_cast<const int32_t*>(batch.ids), batch.nnz, rows, table);
  } else {
    CheckIds(static_cast<const int64_t*>(batch.ids), batch.nnz, rows, table);
  }
}

// ---------------------------------------------------------------- table storage
void Table::BufferDeleter::operator()(void* p) const {
  if (device >= 0)
    cuda_impl::Free(p, device);
  else
    internal::Free(p, bytes);
}

namespace {
void CheckDevice(const TableSpec& spec) {
  if (spec.device < -1) throw InvalidArgument("table '" + spec.name + "': device must be -1 (host) or a CUDA device");
  if (spec.device < 0) return;
  if (!cuda_impl::kCompiled) cuda_impl::Allocate(0, 0);  // throws NotCompiled
  const int n = cuda_impl::DeviceCount();
  if (spec.device >= n)
    throw InvalidArgument("table '" + spec.name + "': no CUDA device cuda:" + std::to_string(spec.device) +
                          (n == 0 ? std::string(" (this machine has no CUDA device)")
                                  : " (this machine has " + std::to_string(n) + ")"));
}
}  // namespace

namespace {
// `v` as the table's dtype stores it (rounded to float16 / bfloat16).
float Stored(const TableSpec& spec, float v) {
  const auto& k = kernels::ActiveKernels().dtype[int(spec.dtype)];
  char stored[4];
  float back;
  k.store(stored, &v, 1);
  k.load(stored, &back, 1);
  return back;
}

const char* LargestFinite(DType dtype) {
  return dtype == DType::kFloat16 ? "65504" : dtype == DType::kBFloat16 ? "3.38953139e+38" : "3.40282347e+38";
}

// Row-wise Adagrad's accumulator belongs to the whole row: no column shard can hold it. A weight clip bound that
// rounds to infinity in the table's dtype on the side it binds (float16 clip_weight_min=1e5) would write infinity
// into every weight it clips: refused, as an initializer whose values would round to infinity.
void CheckOptimizerFits(const TableSpec& spec, const OptimizerSpec& o) {
  if (o.kind == OptimizerSpec::Kind::kRowwiseAdagrad && spec.dim != spec.full_dim)
    throw InvalidArgument("table '" + spec.name + "': row-wise Adagrad keeps one accumulator per whole row, so its "
                          "table cannot be a column shard (columns [" + std::to_string(spec.shard_col_start) + ", " +
                          std::to_string(spec.shard_col_start + spec.dim) + ") of " + std::to_string(spec.full_dim) +
                          "); shard it by rows or whole tables");
  const bool min_inf = o.has_clip_weight_min && std::isinf(Stored(spec, o.clip_weight_min)) && o.clip_weight_min > 0;
  const bool max_inf = o.has_clip_weight_max && std::isinf(Stored(spec, o.clip_weight_max)) && o.clip_weight_max < 0;
  if (min_inf || max_inf)
    throw InvalidArgument("table '" + spec.name + "': " + (min_inf ? "clip_weight_min " : "clip_weight_max ") +
                          internal::FormatFloat(min_inf ? o.clip_weight_min : o.clip_weight_max) +
                          " rounds to infinity in its dtype " + DTypeName(spec.dtype) + " (largest finite value " +
                          LargestFinite(spec.dtype) + "), so every weight it clips would be infinite; a table holds "
                          "finite values only: choose a bound within the dtype's range or a wider dtype");
}
}  // namespace

namespace {
// The initializer's values must be finite in the table's dtype (a table, and
// so a checkpoint, holds finite values only): refused when the largest
// magnitude it can give (internal::InitialBound) rounds to infinity there,
// e.g. float16 Constant(70000) or float32 Normal(0, 1e38).
void CheckInitializerFits(const TableSpec& spec) {
  using Kind = InitializerSpec::Kind;
  const InitializerSpec& init = spec.initializer;
  const double bound = internal::InitialBound(init, spec.full_dim);
  if (std::isfinite(Stored(spec, float(bound)))) return;
  const double stddev = init.b > 0 ? init.b : 1.0 / std::sqrt(double(spec.full_dim));
  std::string name, how;
  switch (init.kind) {
    case Kind::kZeros:
      name = "Zeros()";
      break;
    case Kind::kConstant:
      name = "Constant(value=" + internal::FormatFloat(init.a) + ")";
      how = "|value|";
      break;
    case Kind::kUniform:
      name = "Uniform(low=" + internal::FormatFloat(init.a) + ", high=" + internal::FormatFloat(init.b) + ")";
      how = "max(|low|, |high|)";
      break;
    case Kind::kNormal:
    case Kind::kTruncatedNormal:
      name = std::string(init.kind == Kind::kNormal ? "Normal" : "TruncatedNormal") +
             "(mean=" + internal::FormatFloat(init.a) + ", stddev=" + internal::FormatFloat(stddev) +
             (init.b > 0 ? ")" : " = 1/sqrt(dim))");
      how = init.kind == Kind::kNormal
                ? "|mean| + " + internal::FormatFloat(internal::LargestStandardNormal()) +
                      " stddev, the largest of its normal draws"
                : "|mean| + 2 stddev";
      break;
  }
  throw InvalidArgument("table '" + spec.name + "': initializer " + name + " gives values up to " +
                        internal::FormatFloat(bound) + " in magnitude (" + how + "), which round to infinity in its "
                        "dtype " + DTypeName(spec.dtype) + " (largest finite value " + LargestFinite(spec.dtype) +
                        "); a table holds finite values only: choose a smaller initializer or a wider dtype");
}
}  // namespace

Table::Table(TableSpec spec) : spec_(std::move(spec)), values_(nullptr, BufferDeleter{0, -1}) {
  if (spec_.rows < 1) throw InvalidArgument("table '" + spec_.name + "': rows must be >= 1, got " + std::to_string(spec_.rows));
  if (spec_.dim < 1) throw InvalidArgument("table '" + spec_.name + "': dim must be >= 1, got " + std::to_string(spec_.dim));
  if (!IsTableDType(spec_.dtype))
    throw InvalidArgument("table '" + spec_.name + "': dtype " + DTypeName(spec_.dtype) +
                          " is an export format of checkpoints, not a table dtype (float32, float16 or bfloat16)");
  spec_.optimizer.Validate();
  const size_t bytes = internal::CheckedBytes(spec_.rows, spec_.dim, DTypeSize(spec_.dtype), "table '" + spec_.name + "'");
  internal::CheckedBytes(spec_.rows, spec_.optimizer.SlotDim(spec_.dim), sizeof(float),
                         "table '" + spec_.name + "' slots");  // before any allocation (NewSlots checks it again)
  if (spec_.full_dim == 0) {
    spec_.full_dim = spec_.dim;
    spec_.shard_row_start = spec_.shard_col_start = 0;
  }
  if (spec_.shard_row_start < 0 || spec_.shard_col_start < 0 || spec_.shard_col_start + spec_.dim > spec_.full_dim)
    throw InvalidArgument("table '" + spec_.name + "': shard placement (row " + std::to_string(spec_.shard_row_start) +
                          ", column " + std::to_string(spec_.shard_col_start) + ", full dim " +
                          std::to_string(spec_.full_dim) + ") does not fit its dim " + std::to_string(spec_.dim));
  CheckOptimizerFits(spec_, spec_.optimizer);
  CheckInitializerFits(spec_);
  CheckDevice(spec_);
  const int dev = spec_.device;
  if (dev >= 0) {
    values_ = BufferPtr(cuda_impl::Allocate(bytes, dev), BufferDeleter{bytes, dev});
    InitializeValues(false);
  } else {
    try {  // a failed allocation names the table and the array
      values_ = BufferPtr(internal::AllocateZeroed(bytes, internal::LeavesZero(spec_.initializer)),
                          BufferDeleter{bytes, -1});
    } catch (const std::bad_alloc& e) {
      throw OutOfMemory("table '" + spec_.name + "': its " + DTypeName(spec_.dtype) + " values (" +
                        std::to_string(spec_.rows) + " x " + std::to_string(spec_.dim) + "): " + e.what());
    }
    InitializeValues(true);
  }
  slots_ = NewSlots(spec_.optimizer);
}

void Table::InitializeValues(bool zeroed) {
  const int dev = spec_.device;
  if (dev >= 0) {
    // On the device: initialised on the host a bounded piece at a time (the
    // same values as a host table), copied over.
    const size_t row_bytes = size_t(spec_.dim) * DTypeSize(spec_.dtype);
    internal::ForEachStagingBlock(spec_.rows, row_bytes, [&](int64_t r0, int64_t n, char* staging) {
      std::memset(staging, 0, size_t(n) * row_bytes);
      internal::Initialize(spec_.initializer, spec_.dtype, n, spec_.dim, spec_.shard_row_start + r0,
                           spec_.shard_col_start, spec_.full_dim, staging);
      cuda_impl::CopyToDevice(static_cast<char*>(values_.get()) + size_t(r0) * row_bytes, staging,
                              size_t(n) * row_bytes, dev);
    });
    return;
  }
  if (!zeroed && internal::LeavesZero(spec_.initializer)) {  // Initialize writes nothing for these
    internal::ZeroAllocated(values_.get(), size_t(spec_.rows) * size_t(spec_.dim) * DTypeSize(spec_.dtype));
    return;
  }
  internal::Initialize(spec_.initializer, spec_.dtype, spec_.rows, spec_.dim, spec_.shard_row_start,
                       spec_.shard_col_start, spec_.full_dim, values_.get());
}

void Table::ResetValues() {
  std::unique_lock<std::shared_mutex> lock(mutex_);
  InitializeValues(false);
}

// The slots of optimizer `o` for this table's rows, dim and device, at their
// initial values: Adagrad's and FTRL's accumulators (row-wise Adagrad's too)
// at initial_accumulator_value, the others 0.
std::vector<Table::FloatPtr> Table::NewSlots(const OptimizerSpec& o) const {
  const int64_t slot_dim = o.SlotDim(spec_.dim);
  const size_t slot_bytes = internal::CheckedBytes(spec_.rows, slot_dim, sizeof(float), "table '" + spec_.name + "' slots");
  const auto names = o.SlotNames();
  const int dev = spec_.device;
  std::vector<FloatPtr> slots;
  slots.reserve(names.size());  // no reallocation between an allocation and its owner
  for (const std::string& name : names) {
    const float v0 = o.initial_accumulator_value;
    const bool accumulator = name == "accumulators" || name == "row_accumulators";
    if (dev >= 0) {
      slots.emplace_back(static_cast<float*>(cuda_impl::Allocate(slot_bytes, dev)), BufferDeleter{slot_bytes, dev});
      if (accumulator) cuda_impl::Fill(slots.back().get(), spec_.rows * slot_dim, v0, dev);
      continue;
    }
    const bool filled = accumulator && (v0 != 0.0f || std::signbit(v0));  // else left as the zero pages
    try {
      slots.emplace_back(static_cast<float*>(internal::AllocateZeroed(slot_bytes, !filled)),
                         BufferDeleter{slot_bytes, -1});
    } catch (const std::bad_alloc& e) {
      throw OutOfMemory("table '" + spec_.name + "': its slot '" + name + "' (" + std::to_string(spec_.rows) + " x " +
                        std::to_string(slot_dim) + "): " + e.what());
    }
    if (filled) {
      float* s = slots.back().get();
      ParallelFor(spec_.rows * slot_dim, 1 << 16, [&](int64_t a, int64_t b) { std::fill(s + a, s + b, v0); });
    }
  }
  return slots;
}

int64_t Table::SetOptimizer(const OptimizerSpec& optimizer) {
  optimizer.Validate();
  CheckOptimizerFits(spec_, optimizer);
  // Views of a table's slots (slots(), slots_mut()) would dangle: only a table without slots takes another
  // optimizer. Checked before the allocation, and again under the lock (two calls may race).
  auto refuse_slots = [&] {
    if (!spec_.optimizer.SlotNames().empty())
      throw InvalidArgument("table '" + spec_.name + "': its optimizer keeps slots; set_optimizer replaces the "
                            "optimizer of a table without slots only (SGD, or none): copy the values into a new "
                            "table instead");
  };
  {
    std::shared_lock<std::shared_mutex> lock(mutex_);
    refuse_slots();
  }
  std::vector<FloatPtr> slots = NewSlots(optimizer);  // allocated first: running out of memory changes nothing
  // A pin is taken under the shared lock: none is taken while this holds the lock, and a step of several
  // tables that pinned this one (checked its optimizer) steps it before it unpins. While this waits, new pins
  // are refused (the steps read their rates again after it), so steps that keep coming cannot hold it off.
  struct Waiting {
    std::atomic<int>& setters;
    explicit Waiting(std::atomic<int>& s) : setters(s) { setters.fetch_add(1); }
    ~Waiting() { setters.fetch_sub(1); }
  } waiting(optimizer_setters_);
  std::unique_lock<std::shared_mutex> lock(mutex_);
  while (optimizer_pins_.load() > 0) {
    lock.unlock();
    std::this_thread::sleep_for(std::chrono::microseconds(50));
    lock.lock();
  }
  refuse_slots();
  spec_.optimizer = optimizer;
  slots_.swap(slots);
  step_ = 0;
  return ++optimizer_version_;
}

int64_t Table::optimizer_version() const {
  std::shared_lock<std::shared_mutex> lock(mutex_);
  return optimizer_version_;
}

namespace {
[[noreturn]] void ThrowOptimizerChanged(const TableSpec& spec, int64_t read, int64_t now) {
  throw OptimizerChanged("table '" + spec.name + "': its optimizer was replaced (version " + std::to_string(read) +
                         " -> " + std::to_string(now) + ") after this step read its learning rate; nothing changed");
}
}  // namespace

void Table::PinOptimizer(int64_t version) {
  std::shared_lock<std::shared_mutex> lock(mutex_);
  if (version != optimizer_version_) ThrowOptimizerChanged(spec_, version, optimizer_version_);
  if (optimizer_setters_.load() > 0)
    throw OptimizerChanged("table '" + spec_.name + "': its optimizer is being replaced (version " +
                           std::to_string(version) + "); nothing changed");
  optimizer_pins_.fetch_add(1);
}

void Table::UnpinOptimizer() noexcept { optimizer_pins_.fetch_sub(1); }

Table::~Table() = default;

// ---------------------------------------------------------------- fork
// A forked child has only the thread that forked. A table lock that another
// thread held at the fork (a lookup's, an update's) would stay held in the
// child for ever, and the child's next update of that table would hang. So
// fork() waits for the running lookups and updates of every live table: the
// prepare handler takes each table's lock exclusively, the parent releases
// them after the fork, and the child, where the locks record the parent's
// thread as their owner, makes them anew. The child's tables are then each
// as a whole call left them, never half-updated.
struct ForkHandlers {
  static void Prepare();
  static void Parent();
  static void Child();
};

namespace {
struct LiveTables {
  std::mutex mutex;
  std::set<const Table*> tables;
};
LiveTables& Live() {
  static LiveTables* live = new LiveTables;  // never destroyed: a fork may come during exit
  return *live;
}
}  // namespace

void ForkHandlers::Prepare() {
  Live().mutex.lock();
  for (const Table* t : Live().tables) t->mutex().lock();
}
void ForkHandlers::Parent() {
  for (const Table* t : Live().tables) t->mutex().unlock();
  Live().mutex.unlock();
}
namespace {
// A lock made anew in place over one the prepare handler held (unlocking it
// would not do: a reader-writer lock's unlock compares the writer's thread
// id, which is new in the child). ThreadSanitizer cannot see that (a
// std::mutex's constructor makes no call) and took the child's first lock of
// each for a second lock by the thread that held it: it is told that this
// thread released it, as the child's lock is free. (Without ThreadSanitizer:
// the placement new alone.)
template <typename Lock>
void RenewLock(Lock* lock) {
#ifdef EMBEDCORE_TSAN
  __tsan_mutex_pre_unlock(lock, 0);
  __tsan_mutex_post_unlock(lock, 0);
#endif
  new (lock) Lock;
}
}  // namespace

void ForkHandlers::Child() {
  for (const Table* t : Live().tables) {  // no other thread exists here: none holds a lock or a pin
    RenewLock(&t->mutex_);
    const_cast<Table*>(t)->optimizer_pins_.store(0);
    const_cast<Table*>(t)->optimizer_setters_.store(0);
  }
  RenewLock(&Live().mutex);
}

void Table::EnsureForkHandlers() {
  static const bool registered =
      pthread_atfork(ForkHandlers::Prepare, ForkHandlers::Parent, ForkHandlers::Child) == 0;
  (void)registered;
}

Table::ForkRegistration::ForkRegistration(const Table* t) : table(t) {
  EnsureForkHandlers();
  std::lock_guard<std::mutex> l(Live().mutex);
  Live().tables.insert(t);
}

Table::ForkRegistration::~ForkRegistration() {
  std::lock_guard<std::mutex> l(Live().mutex);
  Live().tables.erase(table);
}

size_t Table::value_bytes() const { return size_t(spec_.rows) * size_t(spec_.dim) * DTypeSize(spec_.dtype); }

namespace {
void CheckRowRange(const TableSpec& spec, int64_t start_row, int64_t n, const char* what) {
  if (start_row < 0 || n < 0 || start_row > spec.rows || n > spec.rows - start_row)
    throw OutOfRange("table '" + spec.name + "': " + what + " rows [" + std::to_string(start_row) + ", " +
                     (start_row > 0 && n > INT64_MAX - start_row  // (the end itself would overflow)
                          ? std::to_string(start_row) + " + " + std::to_string(n)
                          : std::to_string(start_row + n)) +
                     ") do not fit in [0, " + std::to_string(spec.rows) + ")");
}
}  // namespace

void Table::AssignValues(int64_t start_row, int64_t n, const float* src) {
  CheckRowRange(spec_, start_row, n, "assigned");
  std::unique_lock<std::shared_mutex> lock(mutex_);
  // A source that overlaps the rows it is written to (a view of the table's own rows, shifted) is copied
  // first, as NumPy's and PyTorch's assignments do: every row gets the source as it was before the call.
  const size_t es = DTypeSize(spec_.dtype);
  const size_t elements = size_t(n) * size_t(spec_.dim);
  const char* rows_at = static_cast<const char*>(values_.get()) + size_t(start_row) * size_t(spec_.dim) * es;
  std::vector<float> copy;
  if (spec_.device < 0 && internal::Overlaps(src, elements * sizeof(float), rows_at, elements * es)) {
    copy.assign(src, src + elements);
    src = copy.data();
  }
  const auto& k = kernels::ActiveKernels().dtype[int(spec_.dtype)];
  if (spec_.device >= 0) {  // rounded on the host, a bounded piece at a time
    const size_t row_bytes = size_t(spec_.dim) * es;
    internal::ForEachStagingBlock(n, row_bytes, [&](int64_t r0, int64_t m, char* staging) {
      k.store(staging, src + r0 * spec_.dim, m * spec_.dim);
      cuda_impl::CopyToDevice(static_cast<char*>(values_.get()) + size_t(start_row + r0) * row_bytes, staging,
                              size_t(m) * row_bytes, spec_.device);
    });
    return;
  }
  char* base = static_cast<char*>(values_.get());
  ParallelFor(n, 1024, [&](int64_t a, int64_t b) {
    for (int64_t r = a; r < b; ++r)
      k.store(base + size_t(start_row + r) * spec_.dim * es, src + r * spec_.dim, spec_.dim);
  });
}

void Table::AssignRaw(int64_t start_row, int64_t n, const void* src) {
  CheckRowRange(spec_, start_row, n, "assigned");
  std::unique_lock<std::shared_mutex> lock(mutex_);
  const size_t row_bytes = size_t(spec_.dim) * DTypeSize(spec_.dtype);
  char* dst = static_cast<char*>(values_.get()) + size_t(start_row) * row_bytes;
  if (spec_.device >= 0)
    cuda_impl::CopyToDevice(dst, src, size_t(n) * row_bytes, spec_.device);
  else
    std::memmove(dst, src, size_t(n) * row_bytes);  // the source may be the table's own rows, shifted
}

void Table::AssignSlot(size_t i, int64_t start_row, int64_t n, const float* src) {
  CheckRowRange(spec_, start_row, n, "assigned slot");
  std::unique_lock<std::shared_mutex> lock(mutex_);  // (set_optimizer may be giving the table its slots)
  if (i >= slots_.size()) throw OutOfRange("table '" + spec_.name + "' has no slot " + std::to_string(i));
  const int64_t cols = slot_dim();
  const int64_t total = n * cols;
  const OptimizerSpec::SlotBound bound = spec_.optimizer.SlotLowerBound(i);
  const std::string slot_name = spec_.optimizer.SlotNames()[i];
  auto admitted = [&](float v) { return std::isfinite(v) && bound.Admits(v); };
  // Every value checked where it is: a refusal names it and changes nothing.
  for (int64_t k = 0; k < total; ++k)
    if (!admitted(src[k]))
      throw InvalidArgument("table '" + spec_.name + "': slot " + slot_name + " values[" + std::to_string(k / cols) +
                            ", " + std::to_string(k % cols) + "] = " + internal::FormatFloat(src[k]) +
                            " (table row " + std::to_string(start_row + k / cols) + ") is not " +
                            (std::isfinite(src[k]) ? bound.Describe() : std::string("finite")));
  float* dst = slots_[i].get() + start_row * cols;
  // A source that is the slot's own rows, shifted, is copied first (every row gets the source as it was).
  std::vector<float> copy;
  if (spec_.device < 0 && internal::Overlaps(src, size_t(total) * sizeof(float), dst, size_t(total) * sizeof(float))) {
    copy.assign(src, src + total);
    src = copy.data();
  }
  // Then copied through a small block that is checked again: the caller's memory (a view the GIL does not
  // guard) may change during the call, and no value that the check did not see reaches the slot. One that
  // changed is refused there, the rows before it written (each a value that passed).
  constexpr int64_t kBlock = 1 << 14;
  std::vector<float> block(size_t(std::min(total, kBlock)));
  for (int64_t k0 = 0; k0 < total; k0 += kBlock) {
    const int64_t m = std::min(kBlock, total - k0);
    std::memcpy(block.data(), src + k0, size_t(m) * sizeof(float));
    int64_t good = 0;  // the block's values up to the first that changed into a refused one
    while (good < m && admitted(block[size_t(good)])) ++good;
    if (spec_.device >= 0)
      cuda_impl::CopyToDevice(dst + k0, block.data(), size_t(good) * sizeof(float), spec_.device);
    else
      std::memcpy(dst + k0, block.data(), size_t(good) * sizeof(float));
    if (good < m) {
      const int64_t k = k0 + good;
      throw InvalidArgument("table '" + spec_.name + "': slot " + slot_name + " values changed while assign_slot "
                            "read them (another thread wrote them): values[" + std::to_string(k / cols) + ", " +
                            std::to_string(k % cols) + "] (table row " + std::to_string(start_row + k / cols) +
                            ") is " + internal::FormatFloat(block[size_t(good)]) + " now; the values before it "
                            "are assigned, the rest not: assign again");
    }
  }
}

void Table::ReadValues(int64_t start_row, int64_t n, float* dst) const {
  CheckRowRange(spec_, start_row, n, "read");
  std::shared_lock<std::shared_mutex> lock(mutex_);
  const auto& k = kernels::ActiveKernels().dtype[int(spec_.dtype)];
  const size_t es = DTypeSize(spec_.dtype);
  const char* base = static_cast<const char*>(values_.get());
  if (spec_.device >= 0) {
    const size_t row_bytes = size_t(spec_.dim) * es;
    internal::ForEachStagingBlock(n, row_bytes, [&](int64_t r0, int64_t m, char* staging) {
      cuda_impl::CopyToHost(staging, base + size_t(start_row + r0) * row_bytes, size_t(m) * row_bytes, spec_.device);
      k.load(staging, dst + r0 * spec_.dim, m * spec_.dim);
    });
    return;
  }
  ParallelFor(n, 1024, [&](int64_t a, int64_t b) {
    for (int64_t r = a; r < b; ++r) k.load(base + size_t(start_row + r) * spec_.dim * es, dst + r * spec_.dim, spec_.dim);
  });
}

// ---------------------------------------------------------------- lookup
void Table::Lookup(const Batch& batch, const OutputShape& shape, float* out, uintptr_t stream) const {
  internal::CheckLookupSequenceLength(shape);
  CheckOutStride(shape, spec_.dim, spec_.device >= 0);
  if (spec_.device >= 0) {  // device pointers: checked on the device
    std::shared_lock<std::shared_mutex> lock(mutex_);
    cuda_impl::Lookup(values_.get(), spec_.dtype, spec_.rows, spec_.dim, spec_.name, batch, shape, out, spec_.device,
                      stream);
    return;
  }
  const internal::StableBatch stable(batch);
  ValidateBatch(stable.get(), spec_.rows, spec_.name);
  if (shape.OutputRows(batch) > 0 && out == nullptr) throw InvalidArgument("out: null pointer");
  std::shared_lock<std::shared_mutex> lock(mutex_);
  internal::RunLookup(values_.get(), spec_.dtype, spec_.rows, spec_.dim, stable.get(), shape, out);
}

void Table::LookupGrouped(const Batch& given, const int64_t* given_groups, int64_t num_groups, float* out) const {
  if (spec_.device >= 0) throw InvalidArgument("table '" + spec_.name + "': lookup_grouped takes host tables only");
  const internal::StableBatch stable(given);  // offsets and groups: the engine's copies (see StableBatch)
  const Batch& batch = stable.get();
  ValidateBatch(batch, spec_.rows, spec_.name);
  if (num_groups < 0) throw InvalidArgument("groups: negative count");
  if (given_groups == nullptr) throw InvalidArgument("groups: null pointer");
  const std::vector<int64_t> copy(given_groups, given_groups + num_groups + 1);
  const int64_t* groups = copy.data();
  if (groups[0] != 0) throw InvalidArgument("groups[0] must be 0, got " + std::to_string(groups[0]));
  for (int64_t g = 0; g < num_groups; ++g)
    if (groups[g + 1] < groups[g])
      throw InvalidArgument("groups must be non-decreasing: groups[" + std::to_string(g) + "] = " +
                            std::to_string(groups[g]) + " > groups[" + std::to_string(g + 1) +
                            "] = " + std::to_string(groups[g + 1]));
  if (groups[num_groups] != batch.num_bags)
    throw InvalidArgument("groups must end at the number of bags, " + std::to_string(batch.num_bags) +
                          ", got groups[" + std::to_string(num_groups) + "] = " + std::to_string(groups[num_groups]));
  if (num_groups > 0 && out == nullptr) throw InvalidArgument("out: null pointer");
  RunGrouped(batch, groups, num_groups, out);
}

void Table::RunGrouped(const Batch& batch, const int64_t* groups, int64_t num_groups, float* out) const {
  std::shared_lock<std::shared_mutex> lock(mutex_);
  kernels::LookupArgs a;
  a.table = values_.get();
  a.rows = spec_.rows;
  a.dim = spec_.dim;
  a.ids = batch.ids;
  a.nnz = batch.nnz;
  a.offsets = batch.offsets;
  a.weights = batch.weights;
  a.combiner = ops::CombinerKind::kSum;
  a.out = out;
  const auto fn = kernels::ActiveKernels().dtype[int(spec_.dtype)].grouped[batch.id_type == IdType::kInt32 ? 0 : 1];
  const int64_t per_group = num_groups > 0 ? std::max<int64_t>(1, batch.nnz / num_groups) : 1;
  ParallelFor(num_groups, std::max<int64_t>(1, 2048 / per_group), [&](int64_t g0, int64_t g1) { fn(a, groups, g0, g1); });
}

void Table::LookupSparseSegment(const Batch& given, Combiner combiner, float* out) const {
  if (spec_.device >= 0)
    throw InvalidArgument("table '" + spec_.name + "': lookup_sparse_segment takes host tables only");
  if (combiner == Combiner::kNone)
    throw InvalidArgument("lookup_sparse_segment pools bags: combiner must be sum, mean or sqrtn");
  if (given.weights != nullptr)
    throw InvalidArgument("lookup_sparse_segment takes no weights (TensorFlow adds weighted rows in another order)");
  const internal::StableBatch stable(given);  // the offsets: the engine's copy (see StableBatch)
  const Batch& batch = stable.get();
  ValidateBatch(batch, spec_.rows, spec_.name);
  if (batch.num_bags > 0 && out == nullptr) throw InvalidArgument("out: null pointer");
  // Each bag becomes a group of sub-bags: [0, r), then runs of 8.
  std::vector<int64_t> groups(size_t(batch.num_bags) + 1, 0), starts;
  starts.reserve(size_t(batch.num_bags + batch.nnz / 8 + 1));
  for (int64_t b = 0; b < batch.num_bags; ++b) {
    const int64_t begin = batch.offsets[b], n = batch.offsets[b + 1] - begin;
    starts.push_back(begin);
    if (n >= 10) {
      const int64_t r = n % 8 == 0 ? 8 : n % 8 == 1 ? 9 : n % 8;
      for (int64_t k = r; k < n; k += 8) starts.push_back(begin + k);
    }
    groups[size_t(b) + 1] = int64_t(starts.size());
  }
  starts.push_back(batch.nnz);
  Batch sub = batch;
  sub.offsets = starts.data();
  sub.num_bags = int64_t(starts.size()) - 1;
  RunGrouped(sub, groups.data(), batch.num_bags, out);
  if (combiner == Combiner::kSum) return;
  const int64_t dim = spec_.dim;
  ParallelFor(batch.num_bags, std::max<int64_t>(1, 16384 / dim), [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n = batch.offsets[b + 1] - batch.offsets[b];
      if (n == 0) continue;  // zeros (div_no_nan)
      // As TensorFlow: static_cast<float>(n), or of sqrt(double(n)) (which a float sqrt misses by an ulp
      // for some n above 2^24).
      const float den = combiner == Combiner::kMean ? float(n) : float(std::sqrt(double(n)));
      float* row = out + b * dim;
      if (n < 10) {
        const float scale = 1.0f / den;
        for (int64_t j = 0; j < dim; ++j) row[j] *= scale;
      } else {
        for (int64_t j = 0; j < dim; ++j) row[j] /= den;
      }
    }
  });
}

namespace internal {
namespace {
// The kernel that writes a lookup's output: over ids (unpooled rows) or bags (pooled, padded), with its args.
struct LookupKernel {
  kernels::LookupArgs args;
  kernels::BagsFn fn = nullptr;  // (RowsFn has the same signature: over ids)
  bool over_ids = false;
};

// `at`: the batch's rows by their addresses (at[k] is id k's row; `values` and the ids are not read).
LookupKernel MakeLookupKernel(const void* values, DType dtype, int64_t rows, int64_t dim, const Batch& batch,
                              const OutputShape& shape, float* out, const kernels::RowAddress* at = nullptr) {
  LookupKernel k;
  kernels::LookupArgs& a = k.args;
  a.table = values;
  a.rows = rows;
  a.dim = dim;
  a.ids = batch.ids;
  a.nnz = batch.nnz;
  a.offsets = batch.offsets;
  a.weights = batch.weights;
  a.combiner = ops::CombinerKind(shape.combiner);
  a.max_sequence_length = shape.max_sequence_length;
  a.out = out;
  a.out_stride = shape.out_stride;
  if (at) a.ids = at;
  const int it = at ? kernels::kRowAddresses : batch.id_type == IdType::kInt32 ? 0 : 1;
  kernels::RowsFn rows_fn;
  kernels::BagsFn padded_fn, pooled_fn;
  if (dtype == DType::kUInt8Rowwise) {  // a served checkpoint's 8-bit rows
    const auto& ks = kernels::ActiveKernels().rowwise8;
    rows_fn = ks.rows[it], padded_fn = ks.padded[it], pooled_fn = ks.pooled[it];
  } else {
    const auto& ks = kernels::ActiveKernels().dtype[int(dtype)];
    rows_fn = ks.rows[it], padded_fn = ks.padded[it], pooled_fn = ks.pooled[it];
  }
  k.over_ids = LookupOverIds(shape);
  k.fn = k.over_ids ? rows_fn : shape.combiner == Combiner::kNone ? padded_fn : pooled_fn;
  return k;
}
}  // namespace

void RunLookup(const void* values, DType dtype, int64_t rows, int64_t dim, const Batch& batch,
               const OutputShape& shape, float* out) {
  const LookupKernel k = MakeLookupKernel(values, dtype, rows, dim, batch, shape, out);
  if (k.over_ids) {
    ParallelFor(batch.nnz, 2048, [&](int64_t k0, int64_t k1) { k.fn(k.args, k0, k1); });
    return;
  }
  // Chunks of about 2048 ids keep the per-chunk overhead small.
  const int64_t per_bag = batch.num_bags > 0 ? std::max<int64_t>(1, batch.nnz / batch.num_bags) : 1;
  ParallelFor(batch.num_bags, std::max<int64_t>(1, 2048 / per_bag), [&](int64_t b0, int64_t b1) {
    k.fn(k.args, b0, b1);
  });
}

void RunLookupRange(const void* values, DType dtype, int64_t rows, int64_t dim, const Batch& batch,
                    const OutputShape& shape, float* out, int64_t begin, int64_t end) {
  const LookupKernel k = MakeLookupKernel(values, dtype, rows, dim, batch, shape, out);
  k.fn(k.args, begin, end);
}

void RunLookupRangeAt(const kernels::RowAddress* at, DType dtype, int64_t dim, const Batch& batch,
                      const OutputShape& shape, float* out, int64_t begin, int64_t end) {
  const LookupKernel k = MakeLookupKernel(nullptr, dtype, 0, dim, batch, shape, out, at);
  k.fn(k.args, begin, end);
}
}  // namespace internal

// ---------------------------------------------------------------- update
namespace {

using kernels::Occurrence;

// One optimizer step over the sorted occurrences: the groups (distinct ids)
// split over the threads; each row is updated by one thread.
template <typename Rule>
void UpdateGroups(const Rule& rule, const ops::StepConstants& kc, const TableSpec& spec, void* values,
                  const std::vector<float*>& slots, const std::vector<Occurrence>& sorted,
                  const std::vector<int64_t>& group_start, const kernels::DTypeKernels& k) {
  kernels::UpdateArgs a;
  a.values = values;
  for (size_t s = 0; s < slots.size() && s < 2; ++s) a.slots[s] = slots[s];
  a.dim = spec.dim;
  a.occurrences = sorted.data();
  a.group_start = group_start.data();
  a.constants = kc;
  const auto fn = k.Update(rule);
  ParallelFor(int64_t(group_start.size()) - 1, 256, [&](int64_t g0, int64_t g1) { fn(rule, a, g0, g1); });
}

// Non-lazy Adam: rows absent from the batch take a step with a zero gradient
// (clipped as UpdateRow clips any gradient). Float32 rows are updated in
// place, as UpdateGroups updates them; 16-bit rows through a float32 copy.
template <typename Rule>
void UpdateUntouched(const Rule& rule, const ops::StepConstants& kc, const TableSpec& spec, void* values,
                     const std::vector<float*>& slots, const std::vector<uint8_t>& touched,
                     const kernels::DTypeKernels& k) {
  const int64_t dim = spec.dim;
  const size_t es = DTypeSize(spec.dtype);
  const bool in_place = spec.dtype == DType::kFloat32;
  const float zero = kc.clip_gradient ? ops::ClipGradient(kc, 0.0f) : 0.0f;
  const auto gradient = [zero](int64_t) { return zero; };
  ParallelFor(spec.rows, 1024, [&](int64_t r0, int64_t r1) {
    std::vector<float> wide(in_place ? 0 : size_t(dim));
    for (int64_t row = r0; row < r1; ++row) {
      if (touched[row]) continue;
      char* stored = static_cast<char*>(values) + size_t(row) * dim * es;
      float* w = in_place ? reinterpret_cast<float*>(stored) : wide.data();
      if (!in_place) k.load(stored, w, dim);
      ops::UpdateRowFrom(rule, kc, w, gradient, slots[0] + row * dim, slots[1] + row * dim, dim);
      if (!in_place) k.store(stored, w, dim);
    }
  });
}

int BitWidth(uint64_t x) {
  int bits = 0;
  while (x) {
    ++bits;
    x >>= 1;
  }
  return bits;
}

inline float Denominator(Combiner c, int64_t begin, int64_t end, const float* wts) {
  return ops::BagDenominator(ops::CombinerKind(c), begin, end, wts);
}

// Plain SGD on a float32 table, in input order (ops::SgdInOrderElement): no
// sort. The rows split into one range per thread; each thread scans every
// part and updates the rows of its range. The ranges' scratch is allocated
// first, so that running out of memory changes nothing.
// Kept across calls on this thread (as the sorted path's keys): no page faults per step.
internal::Scratch<kernels::Occurrence>& InOrderScratch() {
  static thread_local internal::Scratch<kernels::Occurrence> scratch;
  return scratch;
}

// The row ranges ApplySgdInOrder splits a step into, and the widest part's ids.
struct InOrderPlan {
  int chunks;
  int64_t total, widest;
  size_t scratch_items() const { return chunks > 1 ? size_t(chunks) * size_t(widest) : 0; }
};

InOrderPlan PlanInOrder(const std::vector<GradientPart>& parts, const TableSpec& spec) {
  int64_t total = 0, widest = 0;
  for (const auto& p : parts) {
    total += p.batch.nnz;
    widest = std::max(widest, p.batch.nnz);
  }
  return {total * spec.dim >= (int64_t(1) << 16) ? NumChunks(spec.rows, 1) : 1, total, widest};
}

void ApplySgdInOrder(const std::vector<GradientPart>& parts, const TableSpec& spec, float* values, float lr,
                     const kernels::DTypeKernels& k) {
  const InOrderPlan plan = PlanInOrder(parts, spec);
  const int chunks = plan.chunks;
  const int64_t total = plan.total, widest = plan.widest;
  internal::Scratch<kernels::Occurrence>& scratch = InOrderScratch();
  const size_t n = plan.scratch_items();
  scratch.Fit(n);
  try {
    scratch.v.resize(n);
  } catch (const std::bad_alloc&) {
    internal::ThrowOutOfMemory(n * sizeof(kernels::Occurrence),
                               "table '" + spec.name + "': apply_gradients of " + std::to_string(total) + " ids");
  }
  kernels::Occurrence* room = scratch.v.data();  // (a thread_local named in the lambda is each worker's own)
  ParallelChunks(spec.rows, chunks, [&](int c, int64_t r0, int64_t r1) {
    for (const auto& p : parts) {
      if (p.batch.num_bags == 0) continue;
      kernels::InOrderArgs a;
      a.table = values;
      a.rows = spec.rows;
      a.dim = spec.dim;
      a.ids = p.batch.ids;
      a.offsets = p.batch.offsets;
      a.num_bags = p.batch.num_bags;
      a.weights = p.batch.weights;
      a.combiner = ops::CombinerKind(p.shape.combiner);
      a.max_sequence_length = p.shape.max_sequence_length;
      a.grads = p.grads;
      a.grads_stride = p.shape.out_stride;
      a.lr = lr;
      a.scratch = room + size_t(c) * size_t(widest);
      k.sgd_in_order[p.batch.id_type == IdType::kInt32 ? 0 : 1](a, r0, r1);
    }
  });
}

// Writes the occurrences of part `p` to `occ` in input order; returns how
// many (fewer than its ids when a padded sequence truncated bags). Pooled and
// flat parts, one occurrence per id, are collected by the thread pool.
template <typename I>
int64_t CollectOccurrences(const GradientPart& p, int64_t dim, Occurrence* occ) {
  const I* ids = static_cast<const I*>(p.batch.ids);
  const int64_t* off = p.batch.offsets;
  const float* wts = p.batch.weights;
  const Combiner c = p.shape.combiner;
  const int64_t len = p.shape.max_sequence_length;
  auto one = [&](int64_t i, float denominator, const float* grad) {
    const float w = wts ? wts[i] : 1.0f;
    return Occurrence{uint64_t(int64_t(ids[i])), grad, ops::BackwardCoefficient(ops::CombinerKind(c), w, denominator)};
  };
  if (c != Combiner::kNone || len == 0) {
    const int64_t per_bag = std::max<int64_t>(1, p.batch.nnz / std::max<int64_t>(1, p.batch.num_bags));
    const int64_t stride = p.shape.out_stride > 0 ? p.shape.out_stride : dim;  // (pooled only: CheckOutStride)
    ParallelFor(p.batch.num_bags, std::max<int64_t>(1, 4096 / per_bag), [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        const float denominator = Denominator(c, off[b], off[b + 1], wts);
        for (int64_t i = off[b]; i < off[b + 1]; ++i)
          occ[i] = one(i, denominator, c != Combiner::kNone ? p.grads + b * stride : p.grads + i * dim);
      }
    });
    return p.batch.nnz;
  }
  int64_t n = 0;
  for (int64_t b = 0; b < p.batch.num_bags; ++b) {
    const int64_t kept = std::min(off[b + 1] - off[b], len);  // the rest was truncated, not looked up
    for (int64_t j = 0; j < kept; ++j) occ[n++] = one(off[b] + j, 1.0f, p.grads + (b * len + j) * dim);
  }
  return n;
}

}  // namespace

void BagDenominators(const Batch& batch, Combiner combiner, float* out) {
  // Only the offsets and weights matter here; ids may be absent.
  if (batch.num_bags < 0 || batch.offsets == nullptr || batch.offsets[0] != 0 ||
      batch.offsets[batch.num_bags] != batch.nnz)
    throw InvalidArgument("bag_denominators: offsets must start at 0 and end at nnz");
  for (int64_t b = 0; b < batch.num_bags; ++b)
    if (batch.offsets[b + 1] < batch.offsets[b]) throw InvalidArgument("bag_denominators: offsets must be non-decreasing");
  if (batch.num_bags > 0 && out == nullptr) throw InvalidArgument("out: null pointer");
  for (int64_t b = 0; b < batch.num_bags; ++b)
    out[b] = Denominator(combiner, batch.offsets[b], batch.offsets[b + 1], batch.weights);
}

namespace {
// The step count stays within what a checkpoint records (and far from overflow).
void CheckStepCanGrow(const std::string& table, int64_t step) {
  if (step >= checkpoint::kMaxStep)
    throw InvalidArgument("table '" + table + "' is at step " + std::to_string(step) +
                          ", the last a checkpoint records (2^62): no further step");
}

// A step is checked before anything changes, on every path (ApplyGradients on
// the host or the device, ValidateStep, ApplyGradientsStaged), in one order:
// CheckStepShapes (each part's shape, as Lookup refuses them, then the step
// limit), then, for host arrays, each part's batch and grads (CheckPartArrays,
// on StableParts' copies where the step then runs), then CheckLearningRate.
// A device table's own batches, and then the rate, are checked on the device.
void CheckStepShapes(const std::vector<GradientPart>& parts, const TableSpec& spec, int64_t step) {
  for (const auto& p : parts) {
    internal::CheckMaxSequenceLength(p.shape.max_sequence_length);
    CheckOutStride(p.shape, spec.dim, spec.device >= 0);
  }
  CheckStepCanGrow(spec.name, step);
}

// One part's host arrays: its batch (ids, offsets, weights) and its grads.
void CheckPartArrays(const GradientPart& p, const TableSpec& spec) {
  ValidateBatch(p.batch, spec.rows, spec.name);
  if (p.shape.OutputRows(p.batch) > 0 && p.grads == nullptr) throw InvalidArgument("grads: null pointer");
}

void CheckLearningRate(float learning_rate) {
  if (!std::isfinite(learning_rate)) throw InvalidArgument("learning_rate must be finite, got " + std::to_string(learning_rate));
}

// A step's parts with the engine's copies of their offsets (see StableBatch),
// each checked (CheckPartArrays) in turn.
class StableParts {
 public:
  StableParts(const std::vector<GradientPart>& given, const TableSpec& spec) : parts_(given) {
    copies_.reserve(given.size());
    for (GradientPart& p : parts_) {
      copies_.push_back(std::make_unique<internal::StableBatch>(p.batch));
      p.batch = copies_.back()->get();
      CheckPartArrays(p, spec);
    }
  }
  const std::vector<GradientPart>& get() const { return parts_; }

 private:
  std::vector<GradientPart> parts_;
  std::vector<std::unique_ptr<internal::StableBatch>> copies_;
};
}  // namespace

void Table::ValidateStep(const std::vector<GradientPart>& parts, float learning_rate) const {
  CheckStepShapes(parts, spec_, step_);
  if (spec_.device < 0)  // device batches (device pointers) are checked on the device
    for (const auto& p : parts) CheckPartArrays(p, spec_);
  CheckLearningRate(learning_rate);
}

namespace {
// The slots' pointers, as the update kernels take them.
template <typename Owned>
std::vector<float*> SlotPointers(const std::vector<Owned>& slots) {
  std::vector<float*> out;
  for (auto& s : slots) out.push_back(s.get());
  return out;
}

// Whether this step is plain SGD on a float32 table (no clipping, no weight
// decay), which ApplySgdInOrder applies in input order with no sort.
bool StepsInOrder(const TableSpec& spec, float learning_rate) {
  return spec.optimizer.kind == OptimizerSpec::Kind::kSGD && spec.dtype == DType::kFloat32 &&
         ops::PlainStep(internal::StepConstantsFor(spec.optimizer, learning_rate));
}

// Every occurrence of a step's (validated) parts, keyed by id and sorted
// stably (input order within an id), and where each id's group starts (and,
// last, where the last ends). Both are kept across calls on this thread (see
// RadixSort): no page faults per step (internal::Scratch).
struct OccurrenceGroups {
  const std::vector<Occurrence>& sorted;
  const std::vector<int64_t>& group_start;
};

void SortOccurrences(const std::vector<GradientPart>& parts, const TableSpec& spec, int64_t total,
                     std::vector<Occurrence>& keys, std::vector<int64_t>& group_start) {
  keys.resize(size_t(total));
  int64_t used = 0;
  for (const auto& p : parts)
    used += p.batch.id_type == IdType::kInt32 ? CollectOccurrences<int32_t>(p, spec.dim, keys.data() + used)
                                              : CollectOccurrences<int64_t>(p, spec.dim, keys.data() + used);
  keys.resize(size_t(used));
  // The ids were validated, but are read in place: a caller's thread may have rewritten them since.
  // The keys are this step's own copy; refuse the step before any row changes if one is out of range.
  for (const Occurrence& o : keys)
    if (o.key >= uint64_t(spec.rows))
      throw InvalidArgument("table '" + spec.name + "': the ids changed while apply_gradients read them (id " +
                            std::to_string(int64_t(o.key)) + " is out of range [0, " + std::to_string(spec.rows) +
                            ")): another thread wrote the ids array during the call; nothing was changed");
  internal::RadixSort(keys, BitWidth(uint64_t(spec.rows - 1)));
  group_start.clear();
  for (size_t i = 0; i < keys.size(); ++i)
    if (i == 0 || keys[i].key != keys[i - 1].key) group_start.push_back(int64_t(i));
  group_start.push_back(int64_t(keys.size()));
}

// The sorted path's buffers of this thread (with RadixSort's), kept across calls.
internal::Scratch<Occurrence>& SortKeys() {
  static thread_local internal::Scratch<Occurrence> keys;
  return keys;
}
internal::Scratch<int64_t>& GroupStarts() {
  static thread_local internal::Scratch<int64_t> group_start;
  return group_start;
}
// Non-lazy Adam's flag per row (touched by the step or not).
internal::Scratch<uint8_t>& TouchedRows() {
  static thread_local internal::Scratch<uint8_t> touched;
  return touched;
}

// Ends a step's use of this thread's step buffers (internal::Scratch::Done), however the step ends.
struct StepBuffersInUse {
  StepBuffersInUse() = default;
  StepBuffersInUse(const StepBuffersInUse&) = delete;
  StepBuffersInUse& operator=(const StepBuffersInUse&) = delete;
  ~StepBuffersInUse() {
    InOrderScratch().Done();
    SortKeys().Done();
    internal::RadixScratch<Occurrence>().Done();
    GroupStarts().Done();
    TouchedRows().Done();
  }
};

OccurrenceGroups GroupOccurrences(const std::vector<GradientPart>& parts, const TableSpec& spec) {
  internal::Scratch<Occurrence>& keys = SortKeys();
  internal::Scratch<int64_t>& group_start = GroupStarts();
  int64_t total = 0;
  for (const auto& p : parts) total += p.batch.nnz;
  keys.Fit(size_t(total));
  group_start.Fit(size_t(total) + 1);
  try {
    SortOccurrences(parts, spec, total, keys.v, group_start.v);
  } catch (const std::bad_alloc& e) {  // the keys, the sort's copy of them or the group starts
    keys.Release();  // (a retry of a smaller batch should not find them held)
    group_start.Release();
    if (dynamic_cast<const OutOfMemory*>(&e) != nullptr) throw;
    internal::ThrowOutOfMemory(size_t(total) * (2 * sizeof(Occurrence) + sizeof(int64_t)),
                               "table '" + spec.name + "': apply_gradients of " + std::to_string(total) + " ids");
  }
  return {keys.v, group_start.v};
}

// One step of the table's optimizer (`step`: the table's step count) over the
// grouped occurrences, with the table's lock held.
void ApplyRule(const TableSpec& spec, float learning_rate, int64_t step, void* values,
               const std::vector<float*>& slots, const OccurrenceGroups& groups, const kernels::DTypeKernels& k) {
  const OptimizerSpec& o = spec.optimizer;  // (SetOptimizer only ever gives an SGD table slots: any path fits)
  const ops::StepConstants kc = internal::StepConstantsFor(o, learning_rate);
  const auto& keys = groups.sorted;
  const auto& group_start = groups.group_start;
  switch (o.kind) {
    case OptimizerSpec::Kind::kSGD:
      UpdateGroups(ops::SgdRule{learning_rate}, kc, spec, values, slots, keys, group_start, k);
      break;
    case OptimizerSpec::Kind::kAdagrad:
      UpdateGroups(ops::AdagradRule{learning_rate, o.adagrad_epsilon}, kc, spec, values, slots, keys, group_start, k);
      break;
    case OptimizerSpec::Kind::kRowwiseAdagrad:
      UpdateGroups(ops::RowwiseAdagradRule{learning_rate, o.adagrad_epsilon}, kc, spec, values, slots, keys,
                   group_start, k);
      break;
    case OptimizerSpec::Kind::kAdam: {
      const ops::AdamRule rule = internal::AdamRuleFor(o, learning_rate, step);
      internal::Scratch<uint8_t>& flags = TouchedRows();  // (allocated before any row changes)
      std::vector<uint8_t>& touched = flags.v;
      flags.Fit(o.lazy_adam ? 0 : size_t(spec.rows));
      try {
        touched.assign(o.lazy_adam ? 0 : size_t(spec.rows), 0);
      } catch (const std::bad_alloc&) {
        flags.Release();
        internal::ThrowOutOfMemory(size_t(spec.rows), "table '" + spec.name + "': apply_gradients of non-lazy Adam "
                                                      "(a flag per row, for the rows no id touched)");
      }
      UpdateGroups(rule, kc, spec, values, slots, keys, group_start, k);
      if (!o.lazy_adam) {
        for (size_t g = 0; g + 1 < group_start.size(); ++g) touched[keys[group_start[g]].key] = 1;
        UpdateUntouched(rule, kc, spec, values, slots, touched, k);
      }
      break;
    }
    case OptimizerSpec::Kind::kFTRL:
      UpdateGroups(internal::FtrlRuleFor(o, learning_rate), kc, spec, values, slots, keys, group_start, k);
      break;
  }
}
}  // namespace

namespace {
// A step's rate was read for the optimizer it steps (`given` >= 0: its version; -1: any).
void CheckOptimizerVersion(const TableSpec& spec, int64_t given, int64_t current) {
  if (given >= 0 && given != current) ThrowOptimizerChanged(spec, given, current);
}
}  // namespace

void Table::ApplyGradients(const std::vector<GradientPart>& given, float learning_rate, uintptr_t stream,
                           int64_t optimizer_version) {
  CheckStepShapes(given, spec_, step_);
  // Under each exclusive hold below, before anything changes: the rate was read for the optimizer that steps.
  auto check_version = [&] { CheckOptimizerVersion(spec_, optimizer_version, optimizer_version_); };
  if (spec_.device >= 0) {
    std::unique_lock<std::shared_mutex> lock(mutex_);
    check_version();
    cuda_impl::ApplyGradients(spec_, values_.get(), SlotPointers(slots_), step_, given, learning_rate, spec_.device,
                              stream);
    ++step_;
    return;
  }
  // Validate everything before touching anything: the offsets as the engine's copies (see StableBatch).
  const StableParts stable(given, spec_);
  CheckLearningRate(learning_rate);
  StepChecked(stable.get(), learning_rate, optimizer_version);
}

void Table::StepChecked(const std::vector<GradientPart>& parts, float learning_rate, int64_t optimizer_version) {
  auto check_version = [&] { CheckOptimizerVersion(spec_, optimizer_version, optimizer_version_); };
  const auto& k = kernels::ActiveKernels().dtype[int(spec_.dtype)];
  const StepBuffersInUse in_use;
  {  // The optimizer is read under the lock: SetOptimizer may replace it meanwhile.
    std::unique_lock<std::shared_mutex> lock(mutex_);
    check_version();
    if (StepsInOrder(spec_, learning_rate)) {
      ApplySgdInOrder(parts, spec_, static_cast<float*>(values_.get()), learning_rate, k);
      ++step_;
      return;
    }
  }
  const OccurrenceGroups groups = GroupOccurrences(parts, spec_);
  std::unique_lock<std::shared_mutex> lock(mutex_);
  check_version();
  ApplyRule(spec_, learning_rate, step_, values_.get(), SlotPointers(slots_), groups, k);
  ++step_;
}

namespace {
// Room for `n` items in a thread's buffer, kept (HoldScratch) until the steps that need it ran.
template <typename T>
void Reserve(internal::Scratch<T>& scratch, size_t n, const std::string& what) {
  try {
    scratch.v.reserve(n);
  } catch (const std::bad_alloc&) {
    scratch.Release();
    internal::ThrowOutOfMemory(n * sizeof(T), what);
  }
}
}  // namespace

void Table::ApplyGradientsMany(const std::vector<Step>& steps) {
  // Every step checked, and its offsets copied, before any table changes (as ApplyGradients does for one).
  std::vector<std::unique_ptr<StableParts>> stable;
  stable.reserve(steps.size());
  for (const Step& s : steps) {
    Table& t = *s.table;
    if (t.spec_.device >= 0) throw InvalidArgument("ApplyGradientsMany: table '" + t.spec_.name + "' is on a GPU");
    CheckStepShapes(*s.parts, t.spec_, t.step_);
    stable.push_back(std::make_unique<StableParts>(*s.parts, t.spec_));
    CheckLearningRate(s.learning_rate);
  }
  // This thread's step buffers, for the largest step of each kind: the steps below then allocate none of them.
  internal::HoldScratch hold;
  size_t keys = 0, in_order = 0, rows = 0;
  std::string keys_of, in_order_of, rows_of;
  for (size_t i = 0; i < steps.size(); ++i) {
    TableSpec spec;  // read under the table's lock: SetOptimizer may be replacing its optimizer meanwhile
    {
      std::shared_lock<std::shared_mutex> lock(steps[i].table->mutex_);
      spec = steps[i].table->spec_;
    }
    const std::vector<GradientPart>& parts = stable[i]->get();
    if (StepsInOrder(spec, steps[i].learning_rate)) {
      const size_t n = PlanInOrder(parts, spec).scratch_items();
      if (n > in_order) in_order = n, in_order_of = spec.name;
      continue;
    }
    size_t total = 0;
    for (const auto& p : parts) total += size_t(p.batch.nnz);
    if (total > keys) keys = total, keys_of = spec.name;
    if (spec.optimizer.kind == OptimizerSpec::Kind::kAdam && !spec.optimizer.lazy_adam && size_t(spec.rows) > rows)
      rows = size_t(spec.rows), rows_of = spec.name;
  }
  const std::string call = "apply_gradients of " + std::to_string(steps.size()) + " tables, before any steps: ";
  Reserve(InOrderScratch(), in_order, call + "table '" + in_order_of + "' (its in-order SGD's rows)");
  Reserve(SortKeys(), keys, call + "table '" + keys_of + "' (the keys of its sort)");
  Reserve(internal::RadixScratch<Occurrence>(), keys, call + "table '" + keys_of + "' (the sorted copy)");
  Reserve(GroupStarts(), keys + 1, call + "table '" + keys_of + "' (its groups)");
  Reserve(TouchedRows(), rows, call + "table '" + rows_of + "' (non-lazy Adam's flag per row)");
  for (size_t i = 0; i < steps.size(); ++i) steps[i].table->StepChecked(stable[i]->get(), steps[i].learning_rate, -1);
}

// ---------------------------------------------------------------- host arrays, any table
void Table::LookupStaged(const Batch& batch, const OutputShape& shape, float* out) const {
  if (spec_.device < 0) return Lookup(batch, shape, out);
  internal::CheckLookupSequenceLength(shape);
  CheckOutStride(shape, spec_.dim, true);
  const internal::StableBatch stable(batch);  // validated, then uploaded: the engine's copy of the offsets
  ValidateBatch(stable.get(), spec_.rows, spec_.name);
  if (shape.OutputRows(batch) > 0 && out == nullptr) throw InvalidArgument("out: null pointer");
  std::shared_lock<std::shared_mutex> lock(mutex_);
  cuda_impl::LookupFromHost(values_.get(), spec_.dtype, spec_.rows, spec_.dim, spec_.name, stable.get(), shape, out,
                            spec_.device);
}

void Table::ApplyGradientsStaged(const std::vector<GradientPart>& given, float learning_rate,
                                 int64_t optimizer_version) {
  if (spec_.device < 0) return ApplyGradients(given, learning_rate, 0, optimizer_version);
  CheckStepShapes(given, spec_, step_);
  const StableParts stable(given, spec_);  // validated, then uploaded: see StableBatch
  CheckLearningRate(learning_rate);
  std::unique_lock<std::shared_mutex> lock(mutex_);
  CheckOptimizerVersion(spec_, optimizer_version, optimizer_version_);
  cuda_impl::ApplyGradientsFromHost(spec_, values_.get(), SlotPointers(slots_), step_, stable.get(), learning_rate,
                                    spec_.device);
  ++step_;
}

// ---------------------------------------------------------------- build info
BuildInfo GetBuildInfo() {
  BuildInfo info;
  info.version = EMBEDCORE_VERSION_STRING;
  info.simd = kernels::ActiveKernels().name;
  info.cuda = cuda_impl::kCompiled;
#if defined(EMBEDCORE_CUDA_ARCHS)
  info.cuda_architectures = EMBEDCORE_CUDA_ARCHS;
#endif
  info.cuda_devices = cuda_impl::DeviceCount();
#if defined(EMBEDCORE_WITH_NCCL)
  info.nccl = true;
#endif
#if defined(__clang__)
  info.compiler = "clang " __clang_version__;
#elif defined(__GNUC__)
  info.compiler = "gcc " __VERSION__;
#endif
  return info;
}

namespace kernels {
bool CpuHasF16c() {
#if defined(__x86_64__)
  unsigned a = 0, b = 0, c = 0, d = 0;
  return __get_cpuid(1, &a, &b, &c, &d) != 0 && (c & bit_F16C) != 0;
#else
  return false;
#endif
}

const KernelSet& ActiveKernels() {
  static const KernelSet* active = [] {
    // A cap on the choice: generic, avx2 or avx512 (the best the CPU has, as when unset).
    const char* force = std::getenv("EMBEDCORE_KERNELS");
    const std::string cap = force != nullptr ? force : "";
    if (!cap.empty() && cap != "generic" && cap != "avx2" && cap != "avx512")
      throw InvalidArgument("EMBEDCORE_KERNELS must be generic, avx2 or avx512 (or unset), got '" + cap + "'");
    const bool generic = cap == "generic";
#if defined(__x86_64__)
    const bool avx2 =
        __builtin_cpu_supports("avx2") && CpuHasF16c() && __builtin_cpu_supports("fma");
    const bool want_avx2 = cap == "avx2";
    // The CPU first: building a kernel set runs code compiled for its instructions (SIGILL on a CPU without).
    if (!generic && !want_avx2 && avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && Avx512Kernels() != nullptr)
      return Avx512Kernels();
    if (!generic && avx2 && Avx2Kernels() != nullptr) return Avx2Kernels();
#endif
    return &GenericKernels();
  }();
  return *active;
}
}  // namespace kernels

}  // namespace embedcore
