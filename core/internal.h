// Private helpers shared by the core's translation units.
#pragma once

#include <cstddef>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <new>
#include <string>
#include <vector>

#include "embedcore/embedcore.h"
#include "shared_checks.h"
#include "thread_pool.h"

namespace embedcore::kernels {
struct RowAddress;
}  // namespace embedcore::kernels

namespace embedcore::internal {

/// `x` with the 9 significant digits that tell every float32 apart ("1e-46"
/// is not "0.000000"), for messages; a NaN is "nan", whatever its sign bit
/// (printf's "-nan"), as NumPy and Python print it.
inline std::string FormatFloat(double x) {
  if (std::isnan(x)) return "nan";
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.9g", x);
  return buf;
}

/// Zero-filled, 64-byte aligned memory. Large blocks come from mmap (pages
/// are zero until touched, and transparent huge pages are requested, which
/// cuts TLB misses of random row gathers); small ones from the heap.
/// OutOfMemory when it cannot be had. `lazy`: memory that stays zero until
/// written sparsely (a Zeros table, Adam's moments) is not accounted for
/// (MAP_NORESERVE), so a table larger than memory whose rows are touched
/// sparsely can be made; otherwise (memory that is filled at once) the
/// system refuses here, as malloc would, what it cannot give, rather than
/// killing the process while it is filled.
void* AllocateZeroed(size_t bytes, bool lazy);
void Free(void* p, size_t bytes);
/// Zeroes `bytes` of memory from AllocateZeroed(bytes, ...): a block from
/// mmap is handed back to the system (its pages read as zero again and take
/// no memory until written, as when it was made: zeroing a table larger than
/// memory, whose rows were touched sparsely, does not fill it); a heap block
/// is cleared.
void ZeroAllocated(void* p, size_t bytes);

/// Throws OutOfMemory("cannot allocate N bytes (X GiB)"), after "`what`: "
/// when given.
[[noreturn]] void ThrowOutOfMemory(size_t bytes, const std::string& what = "");

/// A per-thread buffer kept across calls (a step's sort), so that steps of
/// one size take no page faults. Past kKeptScratchBytes, a buffer that no
/// call has needed half of for kScratchIdle is given back by the next call
/// (Fit), so that one outsized batch does not hold its memory for the life
/// of the thread, while a large table stepped every iteration (among any
/// number of smaller ones stepped on the same thread) keeps its buffer. A
/// call that needed it counts until its end (Done): a step longer than
/// kScratchIdle gave its buffers back at the next one, and faulted them in
/// again every step.
constexpr size_t kKeptScratchBytes = size_t(64) << 20;
constexpr std::chrono::seconds kScratchIdle{2};

/// While one lives on a thread, no Fit on that thread gives a buffer back:
/// Table::ApplyGradientsMany reserves the buffers of several steps first.
inline int& ScratchHolds() {
  static thread_local int holds = 0;
  return holds;
}
struct HoldScratch {
  HoldScratch() { ++ScratchHolds(); }
  ~HoldScratch() { --ScratchHolds(); }
  HoldScratch(const HoldScratch&) = delete;
  HoldScratch& operator=(const HoldScratch&) = delete;
};

template <typename T>
struct Scratch {
  std::vector<T> v;
  std::chrono::steady_clock::time_point needed_at{};

  bool needed = false;  // by the call since Fit, until Done

  /// Before `v` is resized for a call of `n` items.
  void Fit(size_t n) {
    const auto now = std::chrono::steady_clock::now();
    needed = ScratchHolds() > 0 || v.capacity() * sizeof(T) <= kKeptScratchBytes || v.capacity() / 2 <= n;
    if (needed) {
      needed_at = now;
    } else if (now - needed_at > kScratchIdle) {
      Release();
      needed_at = now;
    }
  }
  /// At the end of the call that Fit was for (or of any call: one that did not Fit changes nothing).
  void Done() {
    if (needed) needed_at = std::chrono::steady_clock::now();
    needed = false;
  }
  /// After a call that could not allocate what it needed.
  void Release() { std::vector<T>().swap(v); }
};

/// bytes = a * b * c, or InvalidArgument naming `what` if it overflows.
size_t CheckedBytes(int64_t a, int64_t b, size_t c, const std::string& what);

/// Whether Initialize leaves the memory as it is (zero).
bool LeavesZero(const InitializerSpec& spec);
/// Fills [rows, dim] at `data` as elements (row0 + r, col0 + c) of a table
/// `full_dim` wide (row0 = col0 = 0, full_dim = dim for a whole table).
void Initialize(const InitializerSpec& spec, DType dtype, int64_t rows, int64_t dim, int64_t row0, int64_t col0,
                int64_t full_dim, void* data);
/// The value of element `index` (row * dim + col); the pure function behind Initialize.
float InitialValue(const InitializerSpec& spec, int64_t dim, uint64_t index);
/// The largest |z| of the engine's standard normal draws (Box-Muller at
/// Open01's smallest value, 2^-54): sqrt(108 ln 2), about 8.6524.
double LargestStandardNormal();
/// The largest magnitude of the values `spec` gives a table `dim` wide (its
/// full width), before rounding to the table's dtype: Constant |value|,
/// Uniform max(|low|, |high|), Normal |mean| + LargestStandardNormal() *
/// stddev, TruncatedNormal |mean| + 2 stddev (stddev 0: 1/sqrt(dim)).
double InitialBound(const InitializerSpec& spec, int64_t dim);

/// `batch` with the engine's own copy of its offsets. The ids, offsets and
/// weights are the caller's memory, read in place; validated offsets that a
/// caller's thread rewrote before the kernels read them could send the
/// kernels outside the arrays, so they are copied (num_bags + 1 values, a
/// small fraction of a lookup's reads) and the copy is validated and used.
/// (Ids are guarded where they are used instead: kernels::SafeRow.)
class StableBatch {
 public:
  explicit StableBatch(const Batch& batch) : batch_(batch) {
    CheckBatchCounts(batch);  // before offsets + num_bags + 1 is computed
    if (batch.offsets != nullptr && batch.num_bags >= 0) {
      try {
        offsets_.assign(batch.offsets, batch.offsets + batch.num_bags + 1);
      } catch (const std::bad_alloc&) {
        ThrowOutOfMemory(size_t(batch.num_bags + 1) * sizeof(int64_t),
                         "the engine's copy of the offsets of " + std::to_string(batch.num_bags) + " bags");
      }
      batch_.offsets = offsets_.data();
    }
  }
  StableBatch(const StableBatch&) = delete;
  StableBatch& operator=(const StableBatch&) = delete;
  const Batch& get() const { return batch_; }

 private:
  Batch batch_;
  std::vector<int64_t> offsets_;
};

/// Runs the lookup kernels over `values` (rows x dim of `dtype`); the batch
/// is already validated.
/// `rows`: the table's (an id outside it reads row 0: see kernels::SafeRow).
void RunLookup(const void* values, DType dtype, int64_t rows, int64_t dim, const Batch& batch,
               const OutputShape& shape, float* out);
/// RunLookup's output for part of the batch only, on the calling thread: ids [begin, end) of an
/// unpooled lookup without max_sequence_length (LookupOverIds), else bags [begin, end).
void RunLookupRange(const void* values, DType dtype, int64_t rows, int64_t dim, const Batch& batch,
                    const OutputShape& shape, float* out, int64_t begin, int64_t end);
/// RunLookupRange over rows given by their addresses: at[k] is the row of the batch's id k (`dim` elements
/// of `dtype`, or a uint8_rowwise row), wherever it is; the batch's ids are not read. Pooled output rows are
/// shape.out_stride floats apart (0: dim), so a lookup can pool a band of columns at a time.
void RunLookupRangeAt(const kernels::RowAddress* at, DType dtype, int64_t dim, const Batch& batch,
                      const OutputShape& shape, float* out, int64_t begin, int64_t end);
/// Whether RunLookupRange's range is over ids (else over bags).
inline bool LookupOverIds(const OutputShape& shape) {
  return shape.combiner == Combiner::kNone && shape.max_sequence_length == 0;
}

/// RadixSort's buffer of this thread (the sorted copy).
template <typename Item>
Scratch<Item>& RadixScratch() {
  static thread_local Scratch<Item> scratch;
  return scratch;
}

/// Stable LSD radix sort of `items` by their `key` member, keys < 2^key_bits.
/// Each pass counts and scatters contiguous chunks of the items on the
/// thread pool; chunk c's items of a digit land after those of the chunks
/// before it, so the sort stays stable, and its result (a stable sort's) is
/// the same for any number of threads.
template <typename Item>
void RadixSort(std::vector<Item>& items, int key_bits) {
  constexpr int kDigitBits = 11;
  constexpr size_t kBuckets = size_t(1) << kDigitBits;
  const int64_t n = int64_t(items.size());
  // Reused by every sort on this thread: a fresh multi-megabyte buffer per
  // call would be fresh pages, and page faults, every training step.
  Scratch<Item>& scratch = RadixScratch<Item>();
  scratch.Fit(items.size());
  if (n < 2) return;
  std::vector<Item>& tmp = scratch.v;
  tmp.resize(items.size());  // (a std::bad_alloc here: the caller names the step, see GroupOccurrences)
  const int chunks = std::max(1, NumChunks(n, int64_t(1) << 15));
  std::vector<size_t> count(size_t(chunks) * kBuckets);
  for (int shift = 0; shift < key_bits; shift += kDigitBits) {
    const Item* src = items.data();
    Item* dst = tmp.data();
    ParallelChunks(n, chunks, [&](int c, int64_t begin, int64_t end) {
      size_t* cnt = count.data() + size_t(c) * kBuckets;
      std::fill(cnt, cnt + kBuckets, 0);
      for (int64_t i = begin; i < end; ++i) ++cnt[(src[i].key >> shift) & (kBuckets - 1)];
    });
    size_t sum = 0;  // digit by digit, chunk by chunk: where each chunk's items of a digit start
    for (size_t d = 0; d < kBuckets; ++d)
      for (int c = 0; c < chunks; ++c) {
        size_t& x = count[size_t(c) * kBuckets + d];
        const size_t m = x;
        x = sum;
        sum += m;
      }
    ParallelChunks(n, chunks, [&](int c, int64_t begin, int64_t end) {
      size_t* at = count.data() + size_t(c) * kBuckets;
      for (int64_t i = begin; i < end; ++i) dst[at[(src[i].key >> shift) & (kBuckets - 1)]++] = src[i];
    });
    items.swap(tmp);
  }
}

/// (key, value) pairs, the simplest item RadixSort sorts.
struct KeyValue {
  uint64_t key;
  uint64_t value;
};

/// Host staging of device tables, per step (their initial values, a
/// checkpoint's save and load).
constexpr size_t kStagingBytes = size_t(16) << 20;

/// Runs fn(r0, n, staging) over rows [0, rows) of `row_bytes` each, in blocks
/// of n rows (at least one) that fit kStagingBytes: `staging` is a host buffer
/// of n rows, the same one each time, through which a device table's rows go.
template <typename Fn>
void ForEachStagingBlock(int64_t rows, size_t row_bytes, Fn&& fn) {
  const int64_t step = std::max<int64_t>(1, int64_t(kStagingBytes / row_bytes));
  std::vector<char> staging(size_t(std::min(step, std::max<int64_t>(rows, 1))) * row_bytes);
  for (int64_t r0 = 0; r0 < rows; r0 += step) fn(r0, std::min(step, rows - r0), staging.data());
}

}  // namespace embedcore::internal
