// embedcore: the public C++ API of the embedding engine.
//
// A Table holds `rows x dim` values in one storage dtype (float32, float16 or
// bfloat16) plus the optimizer's float32 slot variables. Lookups take a batch
// in CSR form (ids, offsets, optional per-id weights) and write float32 rows;
// updates take the gradient of a lookup's output and apply the table's
// optimizer to the touched rows only.
//
// Every pointer in this header points to host memory. Arrays are C-contiguous.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <shared_mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "embedcore/version.h"

namespace embedcore {

// ---------------------------------------------------------------- errors
/// A caller's argument is malformed (maps to Python's ValueError).
class InvalidArgument : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};
/// An id or index is outside its valid range (maps to Python's IndexError).
class OutOfRange : public std::out_of_range {
 public:
  using std::out_of_range::out_of_range;
};
/// An argument has the wrong type or dtype (maps to Python's TypeError).
class TypeMismatch : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};
/// A checkpoint is missing, truncated, corrupt or inconsistent; the message
/// names the file and what is wrong (maps to embedcore.CheckpointError, a
/// ValueError).
class CheckpointError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};
/// An operating-system call on a file failed (maps to OSError, with its errno,
/// so to FileNotFoundError, PermissionError, ... as Python's own calls do): a
/// full disk, a missing directory, no permission. The message names the file
/// and call.
class IoError : public std::runtime_error {
 public:
  /// error_number: the failed call's errno (0 where there is none).
  explicit IoError(const std::string& what, int error_number = 0)
      : std::runtime_error(what), error_number_(error_number) {}
  int error_number() const noexcept { return error_number_; }

 private:
  int error_number_;
};
/// Memory for a table, a slot or a result cannot be allocated (maps to
/// MemoryError); the message says what and how many bytes. A std::bad_alloc,
/// so code that catches that catches this too.
class OutOfMemory : public std::bad_alloc {
 public:
  explicit OutOfMemory(const std::string& what) : what_(std::make_shared<const std::string>(what)) {}
  const char* what() const noexcept override { return what_->c_str(); }

 private:
  std::shared_ptr<const std::string> what_;  // shared: copying an exception must not throw
};
/// The feature was not compiled into this build (e.g. CUDA).
class NotCompiled : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};
/// A wait that the host's interrupt check stopped (SetInterruptCheck): a
/// CheckpointLock waiting for another's lock when Ctrl-C came.
class Interrupted : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};
/// A step's learning rate was read for an optimizer that Table::SetOptimizer
/// has replaced since (the step named the optimizer_version it read the
/// rate under): nothing changed; read the rate again and step.
class OptimizerChanged : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// ---------------------------------------------------------------- dtypes
/// Storage dtype of a table's values (float32, float16, bfloat16), or of a
/// checkpoint's values files, which may also be kUInt8Rowwise (format 1.4):
/// FBGEMM's fused 8-bit row-wise quantization, each row `cols` uint8 codes
/// then a float32 scale and a float32 bias (value = scale * code + bias). It
/// is an export format only, never a table's dtype (Table refuses it).
/// Arithmetic is always float32.
enum class DType : uint8_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2, kUInt8Rowwise = 3 };
/// Integer type of a lookup's ids.
enum class IdType : uint8_t { kInt32 = 0, kInt64 = 1 };

/// Size in bytes of one element of `dtype` (kUInt8Rowwise: 1, its codes;
/// its rows also hold 8 bytes of scale and bias: see RowBytes).
size_t DTypeSize(DType dtype);
/// Bytes of one stored row of `cols` values of `dtype`: cols * DTypeSize,
/// or cols + 8 for kUInt8Rowwise.
uint64_t RowBytes(DType dtype, int64_t cols);
/// Whether a table may hold `dtype` (float32, float16, bfloat16).
inline bool IsTableDType(DType dtype) { return dtype != DType::kUInt8Rowwise; }
/// "float32", "float16", "bfloat16" or "uint8_rowwise".
const char* DTypeName(DType dtype);
/// Parses a table dtype name; throws InvalidArgument naming `where` otherwise.
DType ParseDType(const std::string& name, const char* where = "dtype");
/// Parses the dtype of an export's values files (a table dtype or
/// "uint8_rowwise"); throws InvalidArgument naming `where` otherwise.
DType ParseValuesDType(const std::string& name, const char* where = "values_dtype");

/// How the rows of one bag become one output row.
/// kNone keeps the rows (sequence features).
enum class Combiner : uint8_t { kSum = 0, kMean = 1, kSqrtn = 2, kNone = 3 };
const char* CombinerName(Combiner c);

// ---------------------------------------------------------------- specs
/// How a table's values are initialised. Every element is a pure function of
/// (seed, element index), so the same seed gives the same table bit for bit
/// whatever the thread count.
struct InitializerSpec {
  enum class Kind : uint8_t { kZeros, kConstant, kUniform, kNormal, kTruncatedNormal };
  Kind kind = Kind::kTruncatedNormal;
  double a = 0.0;   ///< Constant: value; Uniform: low; (Truncated)Normal: mean
  double b = 0.0;   ///< Uniform: high; (Truncated)Normal: stddev (0 = 1/sqrt(dim))
  uint64_t seed = 0;
};

/// The optimizer of a table, with TensorFlow TPU-embedding semantics.
struct OptimizerSpec {
  /// kRowwiseAdagrad: FBGEMM's EXACT_ROWWISE_ADAGRAD (TorchRec's default):
  /// one accumulator per row, a += mean(g^2) over the row's columns.
  enum class Kind : uint8_t { kSGD = 0, kAdagrad = 1, kAdam = 2, kFTRL = 3, kRowwiseAdagrad = 4 };
  Kind kind = Kind::kSGD;
  float initial_accumulator_value = 0.1f;  ///< Adagrad, row-wise Adagrad, FTRL
  float beta_1 = 0.9f;                     ///< Adam
  float beta_2 = 0.999f;                   ///< Adam
  float epsilon = 1e-7f;                   ///< Adam
  float adagrad_epsilon = 0.0f;            ///< (row-wise) Adagrad: added outside the sqrt (PyTorch's eps)
  bool lazy_adam = true;        ///< Adam: false also decays untouched rows
  bool sum_inside_sqrt = true;  ///< Adam: m/sqrt(v+eps^2) instead of m/(sqrt(v)+eps)
  bool bias_correction = false; ///< Adam: PyTorch's bias-corrected step (SparseAdam)
  float learning_rate_power = -0.5f;       ///< FTRL
  float l1 = 0.0f;                         ///< FTRL l1 regularization strength
  float l2 = 0.0f;                         ///< FTRL l2 regularization strength
  float beta = 0.0f;                       ///< FTRL beta
  bool multiply_linear_by_learning_rate = false;  ///< FTRL
  bool has_clip_weight_min = false;
  float clip_weight_min = 0.0f;  ///< weights clipped after the update
  bool has_clip_weight_max = false;
  float clip_weight_max = 0.0f;
  bool has_clipvalue = false;
  float clip_gradient_min = 0.0f;  ///< summed gradients clipped before the update
  float clip_gradient_max = 0.0f;
  float weight_decay_factor = 0.0f;  ///< decoupled: w -= wd * w before the update
  bool multiply_weight_decay_factor_by_learning_rate = false;

  /// Names of the slot variables, TensorFlow's: accumulators, momenta,
  /// velocities, linears; row-wise Adagrad's row_accumulators.
  std::vector<std::string> SlotNames() const;
  /// Columns of each slot for a table of `dim` columns: 1 for row-wise
  /// Adagrad (one float per row), `dim` for the others.
  int64_t SlotDim(int64_t dim) const { return kind == Kind::kRowwiseAdagrad ? 1 : dim; }
  /// The least value slot `i` may hold, the update's domain: accumulators
  /// and velocities are square-rooted (>= 0), and an accumulator of 0 makes
  /// a zero gradient 0 / 0 where nothing is added to its root (Adagrad with
  /// an epsilon of 0 or subnormal, FTRL): there they must be at least the
  /// smallest normal float32 (a subnormal is 0 where subnormals are flushed
  /// to zero), as initial_accumulator_value.
  struct SlotBound {
    bool bounded = false;  ///< false: any value (momenta, linears)
    float minimum = 0.0f;
    bool strict = false;  ///< true: > minimum, else >= minimum
    const char* reason = "";  ///< why, for messages
    /// Whether `v` is within the bound (NaN is not).
    bool Admits(float v) const { return !bounded || (strict ? v > minimum : v >= minimum); }
    /// "> 0 (why)", ">= 0 (why)", ">= 1.17549435e-38 (why)".
    std::string Describe() const;
  };
  SlotBound SlotLowerBound(size_t i) const;
  /// Throws InvalidArgument naming the field when a value is impossible.
  /// `table`: the optimizer of a table, whose first accumulators must also
  /// be within SlotLowerBound; false for a checkpoint's record of one, which
  /// earlier versions allowed down to > 0 (or 0 with epsilon > 0).
  void Validate(bool table = true) const;
};

struct TableSpec {
  std::string name;
  int64_t rows = 0;
  int64_t dim = 0;
  DType dtype = DType::kFloat32;
  InitializerSpec initializer;
  OptimizerSpec optimizer;
  /// When this table is one shard of a larger logical table (sharding): the
  /// shard's first row and column there and the logical table's dim. The
  /// shard's initial values are then those of the same elements of the whole
  /// table. full_dim 0 means "not a shard".
  int64_t shard_row_start = 0;
  int64_t shard_col_start = 0;
  int64_t full_dim = 0;
  /// Where values and slots live: -1 host memory, d >= 0 CUDA device d (the
  /// CUDA build only; elsewhere NotCompiled).
  int device = -1;
};

// ---------------------------------------------------------------- batches
/// A batch of bags in CSR form: bag b holds ids[offsets[b] .. offsets[b+1]).
/// All pointers are host memory; `weights` may be null (all ones).
struct Batch {
  IdType id_type = IdType::kInt64;
  const void* ids = nullptr;       ///< [nnz] int32 or int64
  int64_t nnz = 0;
  const int64_t* offsets = nullptr;  ///< [num_bags + 1], offsets[0] == 0, offsets[num_bags] == nnz
  int64_t num_bags = 0;
  const float* weights = nullptr;  ///< [nnz] or null
};

/// Output layout of a lookup, and the matching layout of its gradient.
struct OutputShape {
  Combiner combiner = Combiner::kSum;
  /// Only for kNone: 0 gives [nnz, dim]; L > 0 gives [num_bags, L, dim]
  /// (bags truncated or zero-padded to L).
  int64_t max_sequence_length = 0;
  /// Pooled outputs of host tables: floats from one output row to the next
  /// (0: dim; else at least dim), so that a lookup writes its columns of a
  /// wider output, e.g. one feature's of a collection's concatenated outputs.
  int64_t out_stride = 0;
  /// Number of float rows of `dim` the output holds.
  int64_t OutputRows(const Batch& batch) const;
};

/// Throws InvalidArgument unless `shape.out_stride` is 0, or at least `dim`
/// for a pooled lookup of a host table (`device`: a device table's).
void CheckOutStride(const OutputShape& shape, int64_t dim, bool device);

/// One lookup's worth of gradient: the batch that was looked up, how, and the
/// gradient of its output ([OutputRows, dim] float32; a pooled part's rows
/// shape.out_stride floats apart when that is set, as its strided output).
struct GradientPart {
  Batch batch;
  OutputShape shape;
  const float* grads = nullptr;
};

/// Validates a batch against a table of `rows` rows; throws OutOfRange for an
/// id outside [0, rows) (naming `table`, the id and its position) and
/// InvalidArgument for malformed offsets, or an nnz or num_bags above
/// INT64_MAX / 8 - 1 (no array is that large), refused before the offsets are read.
void ValidateBatch(const Batch& batch, int64_t rows, const std::string& table);

/// The number each bag's weighted sum is divided by under `combiner` (sum_w
/// for mean, sqrt(sum_w^2) for sqrtn, the count n and sqrt(n) without
/// weights, 1 for sum and none), computed exactly as
/// the lookup and update kernels compute it; writes `num_bags` floats. A
/// row-wise shard's owner sees only part of a bag, so the bag's owner divides.
void BagDenominators(const Batch& batch, Combiner combiner, float* out);

/// What CsrFromCoo found: the first entry outside the dense shape (-1 if
/// none; the outputs are then incomplete), whether the entries are in
/// row-major order (by bag, then position; repeats allowed), and whether they
/// are and each bag's positions are 0, 1, 2, ... in order (a padded dense
/// batch's: the CSR batch then says everything the COO one does).
struct CooCheck {
  int64_t first_bad = -1;
  int64_t bad_bag = 0, bad_position = 0;  ///< that entry as the check read it (the caller may be rewriting it)
  bool row_major = true;
  bool dense_positions = true;
};

/// Bags in COO form, as a rank-2 SparseTensor holds them: entry k is at
/// (bag, position) = (indices[2k], indices[2k + 1]), of `index_type`. In one
/// pass, checks every entry against [0, bags) x [0, width), counts each bag's
/// entries into `offsets` ([bags + 1], the CSR form of entries in row-major
/// order) and copies the positions to `positions` ([nnz]; may be null).
CooCheck CsrFromCoo(const void* indices, IdType index_type, int64_t nnz, int64_t bags, int64_t width,
                    int64_t* offsets, int64_t* positions);

/// The row-major order of COO entries that CsrFromCoo checked (all inside
/// the dense shape) and counted into `offsets`: writes `order` ([nnz]) so
/// that entry order[i] is the i-th by (bag, position), entries of equal bag
/// and position in their given order (a stable sort; a counting pass by
/// bag, then each bag's entries by position), and `positions` ([nnz]) the
/// entries' positions in that order. Returns whether each bag's positions
/// are then 0, 1, 2, ... (CooCheck::dense_positions of the sorted entries).
bool CooRowMajorOrder(const void* indices, IdType index_type, int64_t nnz, int64_t bags, int64_t width,
                      const int64_t* offsets, int64_t* order, int64_t* positions);

// ---------------------------------------------------------------- result memory
/// Host memory for results handed to callers (the Python bindings' NumPy
/// outputs), 64-byte aligned and not initialised. Blocks from 256 KiB are
/// mapped, on transparent huge pages where the system gives them (one page
/// fault per 2 MiB rather than per 4 KiB: a [4096, 32, 128] float32 sequence
/// output, 42 -> 9 ms here), and FreeResult keeps freed blocks of up to 32
/// MiB (64 MiB and 64 blocks in all, the newest) for the next results: a
/// loop's outputs reuse them, with no page faults (malloc's heap, which
/// glibc trims and grows again, faulted every output in afresh). Free with
/// FreeResult. Throws std::bad_alloc.
void* AllocateResult(size_t bytes);
void FreeResult(void* p) noexcept;

// ---------------------------------------------------------------- threads
/// The most threads SetNumThreads takes (the pool starts them all at once).
constexpr int kMaxThreads = 4096;
/// Sets the number of threads the kernels use, in [1, kMaxThreads]. Results never depend on it.
/// The caller works alongside n - 1 pool threads. On Linux, while the creating thread may run on at
/// least two CPUs and at least n, the pool keeps its threads off the caller's CPU (their affinity:
/// the creating thread's CPUs but the caller's one, updated at most every 10 ms), and gives them
/// that whole set back for good once someone else changes a pool thread's affinity. Pool threads
/// spin after a job (a quarter of their time in it, 100 us to 1 ms) and the caller for the last
/// chunks (up to 1 ms) before sleeping; $EMBEDCORE_SPIN_US, read when the pool starts, lowers that
/// limit (microseconds; 0: no spinning).
void SetNumThreads(int n);
int GetNumThreads();

// ---------------------------------------------------------------- table
/// An embedding table in host memory, or on a CUDA device (spec.device >= 0).
///
/// Thread safety: any number of concurrent Lookup calls; ApplyGradients and
/// the Assign* calls take the table exclusively, so a lookup never sees a
/// half-updated row.
class Table {
 public:
  /// Allocates and initialises the values and slots. Throws InvalidArgument
  /// for an impossible spec.
  explicit Table(TableSpec spec);
  ~Table();
  Table(const Table&) = delete;
  Table& operator=(const Table&) = delete;

  const TableSpec& spec() const { return spec_; }
  int64_t rows() const { return spec_.rows; }
  int64_t dim() const { return spec_.dim; }

  /// Looks up `batch` and writes [shape.OutputRows(batch), dim] float32 to `out`.
  /// For a device table every pointer of `batch` and `out` is device memory
  /// and the work runs on the CUDA stream `stream` (0: the default stream).
  void Lookup(const Batch& batch, const OutputShape& shape, float* out, uintptr_t stream = 0) const;

  /// Sums groups of bags (host tables): each bag of `batch` is summed from
  /// zero in id order, as a kSum lookup sums it, and output row g is the sum
  /// of bags groups[g] .. groups[g + 1] - 1, added in order (the first taken
  /// as it is; an empty group gives zeros). `groups` holds num_groups + 1
  /// non-decreasing bag indices from 0 to batch.num_bags; `out` is
  /// [num_groups, dim] float32. It reproduces, bit for bit, kernels that add
  /// a bag's rows in groups (TensorFlow's sparse_segment_sum).
  void LookupGrouped(const Batch& batch, const int64_t* groups, int64_t num_groups, float* out) const;

  /// Pools each bag of `batch` (no weights; host tables) with `combiner`
  /// (sum, mean or sqrtn) as TensorFlow's CPU sparse_segment_sum / _mean /
  /// _sqrt_n do, bit for bit: a bag of n >= 10 ids adds its first r rows (r
  /// = n % 8, or 8 when that is 0, or 9 when it is 1) and then the sum of
  /// each following group of 8, each group summed in order (LookupGrouped);
  /// mean and sqrtn then multiply a bag of fewer than 10 ids by 1 / n (1 /
  /// sqrt(n)) and divide a longer one by n (sqrt(n)); an empty bag gives
  /// zeros. `out` is [num_bags, dim] float32. A tf.SparseTensor lookup
  /// (safe_embedding_lookup_sparse) runs these kernels.
  void LookupSparseSegment(const Batch& batch, Combiner combiner, float* out) const;

  /// Applies one optimizer step from the gradients of one or more lookups.
  /// The gradients of every occurrence of an id (across all parts) are summed
  /// in a fixed order before one update of that row, so the result does not
  /// depend on the thread count. Plain SGD (no clipping, no weight decay) on
  /// a float32 table applies the occurrences one at a time in input order
  /// instead, w = w - lr * (c * g) each, with no sort: the same step, rounded
  /// per occurrence, and the same bits on CPU and GPU whatever the thread
  /// count. `learning_rate` is this step's rate.
  /// Validates everything before changing anything.
  /// `optimizer_version` >= 0: the optimizer_version() under which the
  /// caller read `learning_rate` (from its own record of the optimizer);
  /// when SetOptimizer has replaced the optimizer since, the step throws
  /// OptimizerChanged and changes nothing, so no step applies one
  /// optimizer's rate under another's rule. -1: any optimizer.
  void ApplyGradients(const std::vector<GradientPart>& parts, float learning_rate, uintptr_t stream = 0,
                      int64_t optimizer_version = -1);

  /// One step of each of several host tables (`parts` at `learning_rate`),
  /// in order, as ApplyGradients of each (same checks, same results), but
  /// with what every step allocates (its copies of the offsets; this
  /// thread's sort, in-order SGD and row-flag buffers, sized for the
  /// largest step) allocated before the first table changes: running out of
  /// memory (OutOfMemory, naming the table) changes no table. (An
  /// Embedding's step: its tables change all or none.)
  struct Step {
    Table* table;
    const std::vector<GradientPart>* parts;
    float learning_rate;
  };
  static void ApplyGradientsMany(const std::vector<Step>& steps);

  /// Throws what ApplyGradients(parts, learning_rate) throws before it
  /// changes anything (shapes, strides, the step limit, the rate; of a host
  /// table's parts also ids, offsets and grads: a device table's batches are
  /// checked on the device), so that a caller stepping several tables can
  /// check them all first. (Ids another thread rewrites in between are
  /// caught by the step itself, after earlier tables stepped.)
  void ValidateStep(const std::vector<GradientPart>& parts, float learning_rate) const;

  /// Lookup and ApplyGradients of host arrays on a table anywhere: a host
  /// table runs them as above; a device table checks the batch on the host,
  /// copies it (and the gradients) to device memory, runs there and copies
  /// the output back. The sharded algorithm, which routes ids on the host,
  /// serves and updates its GPU shards with these.
  void LookupStaged(const Batch& batch, const OutputShape& shape, float* out) const;
  void ApplyGradientsStaged(const std::vector<GradientPart>& parts, float learning_rate,
                            int64_t optimizer_version = -1);

  /// -1 for a host table, else its CUDA device.
  int device() const { return spec_.device; }

  /// Raw storage of the values: rows * dim elements of spec().dtype (device
  /// memory for a device table).
  void* values() { return values_.get(); }
  const void* values() const { return values_.get(); }
  size_t value_bytes() const;
  /// Slot `i` (in OptimizerSpec::SlotNames() order), rows * slot_dim() float32.
  float* slot(size_t i) { return slots_.at(i).get(); }
  const float* slot(size_t i) const { return slots_.at(i).get(); }
  size_t num_slots() const { return slots_.size(); }
  /// Columns of each slot: 1 for row-wise Adagrad, dim() otherwise.
  int64_t slot_dim() const { return spec_.optimizer.SlotDim(spec_.dim); }

  /// Overwrites rows [start_row, start_row + n) from float32 `src` ([n, dim]),
  /// rounding to the storage dtype. Here and in AssignRaw / AssignSlot, `src`
  /// may be the table's own rows (shifted): each row gets `src` as it was
  /// before the call, as NumPy's slice assignment.
  void AssignValues(int64_t start_row, int64_t n, const float* src);
  /// Overwrites rows from `src` that already holds the storage dtype.
  void AssignRaw(int64_t start_row, int64_t n, const void* src);
  /// Overwrites rows of slot `i` from float32 `src` ([n, slot_dim()]):
  /// finite values within the slot's OptimizerSpec::SlotLowerBound, else
  /// InvalidArgument naming the first other one, and nothing changes.
  void AssignSlot(size_t i, int64_t start_row, int64_t n, const float* src);
  /// Copies rows [start_row, start_row + n) as float32 into `dst`.
  void ReadValues(int64_t start_row, int64_t n, float* dst) const;

  /// Number of optimizer steps applied so far (part of the optimizer state).
  /// Atomic: the step checks read it before they take the table, while
  /// another thread's step may be counting it.
  int64_t step() const { return step_.load(std::memory_order_relaxed); }
  void set_step(int64_t step) { step_.store(step, std::memory_order_relaxed); }
  /// Replaces the optimizer of a table without slots (SGD): new slots at
  /// their initial values, step 0; the values stay. Waits for running calls
  /// and for pins (PinOptimizer). Throws InvalidArgument for a table whose
  /// optimizer has slots (pointers to them, slot(i), would dangle) or an
  /// impossible optimizer, and OutOfMemory, before anything changes.
  /// Returns the new optimizer_version().
  int64_t SetOptimizer(const OptimizerSpec& optimizer);
  /// How many times SetOptimizer replaced the optimizer (0 at first).
  int64_t optimizer_version() const;
  /// For a step of several tables that checks every table before it steps
  /// any (all or none): throws OptimizerChanged when the optimizer is no
  /// longer `version`, or a SetOptimizer waits to replace it (nothing
  /// changes), else holds it, SetOptimizer waiting, until UnpinOptimizer.
  /// Each pin needs one UnpinOptimizer.
  void PinOptimizer(int64_t version);
  void UnpinOptimizer() noexcept;
  /// Fills the values with the initializer again (the values the table was
  /// made with), in one exclusive hold of the lock; slots and step stay.
  void ResetValues();

  /// Guards values and slots: shared for readers, exclusive for writers.
  std::shared_mutex& mutex() const { return mutex_; }

  /// Registers (once) the fork handlers that take every live table's lock
  /// before a fork() (see table.cc). A lock taken before a table's, for as
  /// long as a table lock is held (the native op registry's), must register
  /// its own handlers after calling this, so that fork takes it first.
  static void EnsureForkHandlers();

 private:
  // ApplyGradients of a host table from here on: `parts` are the engine's copies, checked.
  void StepChecked(const std::vector<GradientPart>& parts, float learning_rate, int64_t optimizer_version);
  // LookupGrouped on a validated batch and groups.
  void RunGrouped(const Batch& batch, const int64_t* groups, int64_t num_groups, float* out) const;

  struct BufferDeleter {
    size_t bytes;
    int device;
    void operator()(void* p) const;
  };
  using BufferPtr = std::unique_ptr<void, BufferDeleter>;
  using FloatPtr = std::unique_ptr<float, BufferDeleter>;
  std::vector<FloatPtr> NewSlots(const OptimizerSpec& optimizer) const;
  // Writes the initializer's values into values_ (zeroed: its memory is zero already).
  void InitializeValues(bool zeroed);

  // Lists the table, for its life, among those fork() waits for (table.cc):
  // a child process never starts with a table lock another thread held.
  struct ForkRegistration {
    explicit ForkRegistration(const Table* table);
    ~ForkRegistration();
    ForkRegistration(const ForkRegistration&) = delete;
    ForkRegistration& operator=(const ForkRegistration&) = delete;
    const Table* table;
  };

  TableSpec spec_;
  BufferPtr values_;
  std::vector<FloatPtr> slots_;
  std::atomic<int64_t> step_{0};
  int64_t optimizer_version_ = 0;       // guarded by mutex_
  std::atomic<int> optimizer_pins_{0};     // PinOptimizer's holds: SetOptimizer waits for none
  std::atomic<int> optimizer_setters_{0};  // SetOptimizer calls waiting for pins: no new pin is taken
  mutable std::shared_mutex mutex_;
  friend struct ForkHandlers;  // (table.cc: renews the locks and pins in a forked child)
  ForkRegistration fork_registration_{this};  // last: listed once mutex_ exists, removed before it goes
};

// ---------------------------------------------------------------- nccl
/// The transport of the `nccl` communicator (embedcore.distributed): NCCL,
/// loaded at run time from `library` (a path or soname; "" for
/// libnccl.so.2), one rank per process and GPU. The CUDA build with NCCL
/// headers only; elsewhere every call throws NotCompiled.
class NcclTransport {
 public:
  /// A new unique id (NCCL_UNIQUE_ID_BYTES bytes) for rank 0 to share.
  static std::string UniqueId(const std::string& library);
  NcclTransport(const std::string& library, const std::string& unique_id, int size, int rank, int device);
  ~NcclTransport();
  NcclTransport(const NcclTransport&) = delete;
  NcclTransport& operator=(const NcclTransport&) = delete;
  int size() const;
  int rank() const;
  int device() const;
  /// Sends send_bytes[p] bytes to each peer p and receives recv_bytes[p] from
  /// each, packed in rank order; device buffers, on `stream`, returns when done.
  void AllToAllV(const void* send, const std::vector<uint64_t>& send_bytes, void* recv,
                 const std::vector<uint64_t>& recv_bytes, uintptr_t stream);
  /// The same with host buffers, staged through device memory.
  void AllToAllVHost(const void* send, const std::vector<uint64_t>& send_bytes, void* recv,
                     const std::vector<uint64_t>& recv_bytes);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// ---------------------------------------------------------------- checkpoints
/// The checkpoint format version this library writes; it reads every older
/// major version and refuses newer ones. See docs/format.md.
constexpr int kFormatMajor = 1;
constexpr int kFormatMinor = 5;

struct SaveOptions {
  bool include_optimizer = true;  ///< slots and step; false: values only (a serving export)
  bool cast_values = false;       ///< store the values as `values_dtype`
  /// With cast_values, from a table of any dtype: float32 (16-bit values
  /// widened exactly), float16 / bfloat16 (rounded; a value beyond the
  /// dtype's range fails the save), or kUInt8Rowwise (whole rows only: no
  /// column shard).
  DType values_dtype = DType::kFloat32;
  std::string metadata_json = "{}";  ///< a JSON object kept verbatim as "metadata"
};

/// One table to save, with a JSON object kept verbatim as its "config".
struct TableToSave {
  const Table* table = nullptr;
  std::string config_json = "{}";
};

/// Saves `tables` into the directory `path`, atomically: data files are
/// written under new names and fsynced, then the manifest is replaced by a
/// rename. A save killed at any moment leaves the previous checkpoint at
/// `path` loadable; files of older generations are removed afterwards.
/// Each table is read under its shared lock (lookups go on meanwhile).
/// A checkpoint holds finite values and slots only: a value or slot that is
/// inf or NaN (a training step that diverged) throws InvalidArgument naming
/// the table, the array, the value and its row and column; as on any other
/// failure, the save's files are removed and the checkpoint at `path` stays
/// as it was.
void SaveCheckpoint(const std::string& path, const std::vector<TableToSave>& tables, const SaveOptions& options);

/// One data file of a checkpoint: rows [row_start, row_start + rows) and
/// columns [col_start, col_start + cols) of a table, as listed in the manifest.
struct FileEntry {
  std::string path;  ///< a plain file name inside the checkpoint directory
  uint64_t bytes = 0;
  DType dtype = DType::kFloat32;
  int64_t row_start = 0;
  int64_t rows = 0;
  int64_t col_start = 0;  ///< since format 1.2 (column-wise shards); 0 before
  int64_t cols = 0;
  uint32_t block_bytes = 0;
  std::vector<uint32_t> crc32c;  ///< one per block of the payload
};

/// A table as a checkpoint's manifest describes it.
struct TableEntry {
  std::string name;
  int64_t rows = 0;
  int64_t dim = 0;
  DType dtype = DType::kFloat32;  ///< the table's dtype when saved
  bool has_optimizer = false;
  OptimizerSpec optimizer;
  /// The kind of an optimizer this reader does not know (a newer writer's):
  /// then has_optimizer is false, `slot_names` / `slots` list its slot files
  /// (read as arrays of some width, for verifying), and a load of its
  /// optimizer state is refused; its values load, serve and verify.
  std::string unknown_optimizer;
  int64_t step = 0;
  InitializerSpec initializer;
  /// An initializer this reader does not know (a newer writer's kind), as
  /// written; `initializer` is then the default. Informational: no read uses
  /// it, and a rewrite of the entry (reshard, a Saver that keeps the table)
  /// writes it back as it was.
  std::string unknown_initializer_json;
  std::vector<FileEntry> values;
  std::vector<std::string> slot_names;
  std::vector<std::vector<FileEntry>> slots;  ///< per slot name
  std::string config_json;  ///< as given to SaveCheckpoint
  std::string sharding_json;
  /// `config.padding_idx` (format 1.5, optional; -1 when absent or null): an
  /// id that pooled served lookups leave out of their bags, as
  /// torch.nn.EmbeddingBag's padding_idx (MappedCheckpoint::Lookup).
  int64_t padding_idx = -1;
};

/// A parsed, validated manifest.
struct CheckpointInfo {
  std::string path;
  int format_major = 0, format_minor = 0;
  std::string library_version;
  uint64_t generation = 0;
  std::vector<TableEntry> tables;
  std::string metadata_json;
  std::string manifest_json;  ///< the whole manifest, for inspection
};

/// The data files of one load, opened once by its verification and kept
/// open for its copy (so the copy reads the bytes verified, even if a file
/// is removed or replaced meanwhile), and the identity each had then
/// (device, inode, size, modification and change times). The process keeps
/// at most 256 descriptors for loads, and a quarter of its limit: past
/// that, the copy opens a file again and refuses one that is not the file
/// verified. Thread-safe, but Close() (or the destructor) must not run
/// while a load reads through it.
class LoadFiles {
 public:
  LoadFiles();
  ~LoadFiles();
  LoadFiles(const LoadFiles&) = delete;
  LoadFiles& operator=(const LoadFiles&) = delete;
  void Close() noexcept;
  /// Throws CheckpointError when a file seen is no longer the one verified
  /// (removed, replaced, or rewritten in place): a load calls it before it
  /// changes any table, so such a change fails it with nothing changed.
  void CheckUnchanged() const;
  struct Impl;

 private:
  friend struct LoadFilesAccess;
  std::unique_ptr<Impl> impl_;
};

/// Reads and validates the manifest of the checkpoint at `path` and checks
/// that every data file exists with the size the manifest states (without
/// `slot_files`, only the values files: a read of values alone, a load
/// without the optimizer or serving, does not need the slots). Reads no
/// values. Throws CheckpointError naming the file and what is wrong.
CheckpointInfo ReadCheckpointInfo(const std::string& path, bool slot_files = true);

/// Throws CheckpointError when `path` holds a MANIFEST that is not an
/// embedcore manifest (another program's file, or not a regular file): a save
/// there refuses, since it would replace it. Nothing there, an embedcore
/// manifest (whole, corrupt or short) or no directory at all: returns. So a
/// command can tell before it works that its save would refuse. A MANIFEST
/// that cannot be looked at (EACCES, ENAMETOOLONG, a link in a loop, EIO)
/// throws IoError, as the save would.
void CheckManifestIsOurs(const std::string& path);

/// Checks that `entry` fits `table` (shape, optimizer slots when
/// `load_optimizer`); throws CheckpointError otherwise. Reads nothing.
void CheckLoadable(const CheckpointInfo& info, const TableEntry& entry, const Table& table, bool load_optimizer);

/// Loads `entry` (from `info`) into `table`. With `verify` (the default),
/// every checksum is verified before the table changes, so a corrupt
/// checkpoint leaves it untouched; pass false only after VerifyTable.
/// Values are converted when the dtypes differ (uint8_rowwise files:
/// dequantized, scale * code + bias rounded once, then to the table's
/// dtype); a finite value that the table's narrower dtype would make
/// infinite (a float32 beyond float16's range), or a uint8_rowwise row whose
/// scale or bias is not finite, throws CheckpointError naming it, before the
/// table changes. With `load_optimizer`, slots
/// and step are loaded too (the optimizers must match).
void LoadTable(const CheckpointInfo& info, const TableEntry& entry, Table& table, bool load_optimizer,
               bool verify = true);

/// Called on the calling thread with a count of bytes just processed.
using ProgressFn = std::function<void(uint64_t bytes)>;

/// Verifies every checksum of one table's files (values, and slots when
/// `include_slots`); with `check_finite`, also that every number is finite
/// (in the same pass, on each piece as it is checksummed). `progress`, when
/// set, is called after each part (up to 64 MiB) with its bytes: they add up
/// to the payload bytes of the files.
void VerifyTable(const CheckpointInfo& info, const TableEntry& entry, bool include_slots, bool check_finite,
                 const ProgressFn& progress = {});

/// VerifyTable for every table, slots included. Throws CheckpointError.
void VerifyCheckpoint(const CheckpointInfo& info, bool check_finite);

/// A checkpoint directory's lock: flock(2) on the directory itself. A commit
/// holds it exclusive for its rename of MANIFEST and its removal of the other
/// generations' files (milliseconds); loads, verification and opening for
/// serving hold it shared while they read (serving: until its files are
/// mapped). So commits run one at a time, a commit never removes a file that
/// a load is reading (it waits for the load), and a read waits at most for a
/// commit. Blocks until granted. Takes no lock when `path` is not a directory
/// (the call that follows reports that) or the filesystem has no flock (some
/// network filesystems); throws IoError (its errno) when the directory is
/// there but cannot be opened (EACCES, EIO, EMFILE, ...), Interrupted when
/// the interrupt check (SetInterruptCheck) stops its wait. Not reentrant.
/// Called when a signal interrupts a CheckpointLock's wait for a lock
/// another holds (a save's commit waiting for a load, a load for a commit):
/// true stops the wait, which throws Interrupted, nothing changed. The Python
/// bindings set one that runs Python's signal handlers (Ctrl-C raises
/// KeyboardInterrupt, not after the wait). nullptr, the default: the wait
/// lasts until the lock is granted.
using InterruptCheck = bool (*)();
void SetInterruptCheck(InterruptCheck check) noexcept;

class CheckpointLock {
 public:
  CheckpointLock(const std::string& path, bool exclusive);
  ~CheckpointLock();
  CheckpointLock(const CheckpointLock&) = delete;
  CheckpointLock& operator=(const CheckpointLock&) = delete;
  bool held() const { return fd_ >= 0; }
  void Release() noexcept;

 private:
  int fd_ = -1;
};

/// A save's claim on its generation in `path` (created when missing): the
/// temporary manifest `MANIFEST.tmp.g<generation>`, created exclusively and
/// flock'ed until Release() or destruction, and checked again once made: a
/// generation above every one present (a commit meanwhile may have made the
/// one first picked live), so no live file is overwritten; two saves into one
/// directory get different ones. A commit removes no file of a generation whose claim is
/// held: saves running at once all complete, and the last commit is the
/// checkpoint. A CheckpointError when `path`/MANIFEST is not an embedcore
/// manifest (the save would replace it).
class GenerationClaim {
 public:
  explicit GenerationClaim(const std::string& path);
  ~GenerationClaim();
  GenerationClaim(const GenerationClaim&) = delete;
  GenerationClaim& operator=(const GenerationClaim&) = delete;
  uint64_t generation() const { return generation_; }
  void Release() noexcept;

 private:
  int fd_ = -1;
  uint64_t generation_ = 0;
};

// Sharded checkpoints: every rank writes its own shards' files, one rank
// commits the manifest that names them all (see docs/format.md). Rank 0 holds
// a GenerationClaim from the start of the save to the end of its commit.

/// Creates the directory `path` if needed and returns a generation above
/// every one present there (in its manifest or in any file name).
uint64_t NextGeneration(const std::string& path);

/// Writes the data files of `shard`, which holds rows [row_start, ..) and
/// columns [col_start, ..) of its logical table, under names starting with
/// `prefix` (`t<5 digits>.`) and tagged with shard number `shard_index` and
/// `generation`, and fsyncs them. Returns their entries (values, and the slots
/// and step when options.include_optimizer) for the manifest; names no manifest.
/// A value or slot that is not finite throws InvalidArgument (as
/// SaveCheckpoint), naming the row and column of the logical table; the
/// caller removes what the save wrote (RemoveGeneration).
TableEntry WriteShardFiles(const std::string& path, uint64_t generation, const std::string& prefix, int shard_index,
                           const Table& shard, int64_t row_start, int64_t col_start, const SaveOptions& options);

/// The manifest JSON object of `entry` (a table of `tables` in docs/format.md).
std::string TableEntryJson(const TableEntry& entry);

/// CRC-32C (Castagnoli) of `n` bytes, continuing `crc` (0 to start): the
/// checksum of the format's files (docs/format.md), and of TensorFlow's
/// checkpoints. Uses the CPU's instruction where it has one.
uint32_t Crc32c(const void* data, size_t n, uint32_t crc = 0);

/// After a failed save into `path`: removes the files of `generation` there
/// (data files and a temporary manifest) unless `path`/MANIFEST is of that
/// generation (the commit happened before the failure; then it is the
/// checkpoint) or cannot be read (it may be). Best effort: never throws;
/// returns how many files it removed, the claim file last. Call it while
/// holding the generation's GenerationClaim, and from one process only: a
/// late removal could hit a later save that claimed the generation again.
/// SaveCheckpoint calls it itself; a sharded save on rank 0 (which holds the
/// claim) when the shard-files step failed on any rank or its commit failed.
int RemoveGeneration(const std::string& path, uint64_t generation) noexcept;

/// Validates the manifest `manifest_json` (as a reader would), checks that
/// every file it names is in `path` with its size, then writes it as
/// `path`/MANIFEST atomically and removes the files of other generations.
void CommitCheckpoint(const std::string& path, const std::string& manifest_json);

/// Loads the block of `entry` that `table` holds: rows [row_start, row_start +
/// table.rows()) and columns [col_start, col_start + table.dim()), reading only
/// the byte ranges of the files that overlap it. Like LoadTable, verifies the
/// checksums of everything it reads before `table` changes, and that its
/// slot values are in the domain of `table`'s optimizer
/// (OptimizerSpec::SlotLowerBound); `slot_domain` false skips that check,
/// for copies that keep the state as it is stored (reshard, a save that
/// keeps another table).
///
/// The data files are opened by the verification and the same descriptors
/// read by the copy (through `files` when given, so a VerifyTableBlock
/// before it and this load with verify=false read one set): a file removed or
/// replaced meanwhile changes nothing. An I/O error of the copy itself (a
/// failing disk) leaves the table partly loaded: it is raised (its type
/// kept) with a message that says so and that the table must be loaded again.
void LoadTableBlock(const CheckpointInfo& info, const TableEntry& entry, Table& table, int64_t row_start,
                    int64_t col_start, bool load_optimizer, bool verify = true, bool slot_domain = true,
                    LoadFiles* files = nullptr);

/// One block of a LoadTableBlocks: `entry` into `table`, the whole table
/// where row_start < 0 (its shape must be the entry's), else the block
/// [row_start, row_start + rows) x [col_start, col_start + dim) of `entry`.
struct BlockLoad {
  const TableEntry* entry;
  Table* table;
  int64_t row_start;
  int64_t col_start;
};

/// Loads `blocks`, verified before (VerifyTableBlock through `files`), as
/// one: every target table is locked and every check made again under the
/// locks before the first copy, so a Table::SetOptimizer since the
/// verification refuses the load with no table of this call changed. Each
/// table is let go once its blocks are copied. An error names the tables
/// loaded before it, then `again` (what it means for the other ranks of a
/// sharded load).
void LoadTableBlocks(const CheckpointInfo& info, const std::vector<BlockLoad>& blocks, bool load_optimizer,
                     LoadFiles& files, const std::string& again = "");

/// The checks and checksum verification of LoadTableBlock (the dtype range
/// check included), without loading:
/// a sharded load verifies every rank's blocks before any rank changes.
/// With `files`, the files it verified stay open there for the load.
void VerifyTableBlock(const CheckpointInfo& info, const TableEntry& entry, const Table& table, int64_t row_start,
                      int64_t col_start, bool load_optimizer, bool slot_domain = true, LoadFiles* files = nullptr);

/// A checkpoint opened read-only for serving: each table's values files are
/// memory-mapped (opening reads no values; processes share the pages). With
/// lazy verification each 4 MiB block is checksummed the first time a lookup
/// touches it, and a block that fails is reported, never served.
class MappedCheckpoint {
 public:
  enum class Verify : uint8_t { kNone = 0, kLazy = 1, kEager = 2 };
  MappedCheckpoint(const std::string& path, Verify verify);
  ~MappedCheckpoint();
  MappedCheckpoint(const MappedCheckpoint&) = delete;
  MappedCheckpoint& operator=(const MappedCheckpoint&) = delete;

  const CheckpointInfo& info() const { return info_; }
  size_t num_tables() const { return tables_.size(); }
  /// Thread-safe; same contract as Table::Lookup. A table whose config has a
  /// `padding_idx` (TableEntry::padding_idx) leaves that id out of pooled
  /// bags (sum, mean, sqrtn: out of the sums and of the denominators, its
  /// weight ignored), as torch.nn.EmbeddingBag does; unpooled lookups
  /// (Combiner::kNone) give its row, as torch.nn.Embedding does. With
  /// `keep_padding`, pooled bags keep it too, as any other id (the sums of
  /// ids that share a position of a sparse sequence lookup).
  void Lookup(size_t table, const Batch& batch, const OutputShape& shape, float* out,
              bool keep_padding = false) const;
  /// Pointer to the mapped values of `table` (rows x dim of its stored
  /// dtype; uint8_rowwise: rows of dim + 8 bytes); a table saved in several
  /// files (sharded) has none: CheckpointError.
  /// Unless opened with Verify::kNone, every block not yet checked is checked
  /// first (in parallel), and a corrupt one throws CheckpointError.
  const void* values(size_t table) const;
  /// Writes the values of `table` as float32 to `out` ([rows, dim]): each
  /// value converted from its stored dtype (uint8_rowwise: scale * code +
  /// bias rounded once, as FBGEMM's Fused8BitRowwiseQuantizedToFloat); the
  /// blocks checked as values() checks them. Any table, sharded or not.
  void ReadValues(size_t table, float* out) const;

 private:
  struct Mapped;       // one mapped data file
  struct MappedTable;  // a table's files
  CheckpointInfo info_;
  std::vector<std::unique_ptr<MappedTable>> tables_;
  bool lazy_ = false;  ///< opened with Verify::kLazy: blocks are checked as lookups first touch them
};

/// What this build contains: version, format versions, compiled features.
struct BuildInfo {
  std::string version;
  bool cuda = false;                ///< the CUDA kernels are compiled in
  std::string cuda_architectures;   ///< e.g. "80;90" (CUDA build)
  int cuda_devices = 0;             ///< devices the CUDA runtime sees now (0 without CUDA)
  bool nccl = false;
  bool mpi = false;  ///< always false: the library has no MPI (Python's distributed backend uses mpi4py)
  std::string simd;  ///< kernels selected at run time: "avx512", "avx2+f16c" or "generic"
  std::string compiler;
};
BuildInfo GetBuildInfo();

}  // namespace embedcore
