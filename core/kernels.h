// Row kernels of the CPU engine: the lookup's pooled bags, flat and padded
// sequences and grouped bags, the optimizer step over rows grouped by id, and
// row conversions. Three builds of the same template code (kernels_impl.h):
// portable (kernels_generic.cc), AVX2+F16C (kernels_avx2.cc) and AVX-512
// (kernels_avx512.cc), the best one the CPU runs chosen once at run time. All
// compute the same float32 operations in the same order (no FMA
// contraction), so they give the same bits.
#pragma once

#include <cstdint>
#include <type_traits>
#include <vector>

#include "embedcore/embedcore.h"
#include "ops/combiners.h"
#include "ops/optimizers.h"
#include "rowwise8.h"

namespace embedcore::kernels {

/// How many ids ahead the lookup loops prefetch a row. 16 rather than 8:
/// on Zipf ids (rows mostly in L3) it hides more of the latency, 8-15%
/// faster here; uniform ids (DRAM) are the same either way. (8-bit
/// row-wise rows use this one.)
constexpr int64_t kPrefetchDistance = 16;

/// The same for rows of T: twice as many ids ahead for 16-bit rows, so that
/// about as many cache lines are on their way as for float32 rows of the
/// same dim (a random gather is bound by the lines in flight). A constant
/// of each loop's type, not a function of the row's width at run time:
/// that version (session 23) made float32 lookups slower even where it
/// chose 16. float32: 16.
template <typename T>
constexpr int64_t kPrefetchIds = sizeof(T) == 2 ? 2 * kPrefetchDistance : kPrefetchDistance;

/// Prefetches every cache line of `bytes` at `p` for reading, four lines per
/// loop trip: a loop of one prefetch per trip cost Zipf lookups (rows mostly
/// in cache, so the loop's own instructions show) 25% here. Always inlined:
/// GCC deletes calls it did not inline to a function that only prefetches.
/// With kWrite, for writing (PREFETCHW where the target has PRFCHW: the
/// line arrives owned; GCC emits a read prefetch elsewhere).
template <int kWrite = 0>
[[gnu::always_inline]] inline void PrefetchLines(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  int64_t off = 0;
  for (; off + 256 <= bytes; off += 256) {
    __builtin_prefetch(c + off, kWrite, 3);
    __builtin_prefetch(c + off + 64, kWrite, 3);
    __builtin_prefetch(c + off + 128, kWrite, 3);
    __builtin_prefetch(c + off + 192, kWrite, 3);
  }
  for (; off < bytes; off += 64) __builtin_prefetch(c + off, kWrite, 3);
}

/// Prefetches every cache line of an 8-bit row-wise row (`rb` = dim + 8
/// bytes at `row`, rarely aligned): from the line holding its first byte to
/// the one holding its last, where its scale and bias are (PrefetchLines
/// from `row` could stop a line short of them).
[[gnu::always_inline]] inline void PrefetchRowQ8(const uint8_t* row, int64_t rb) {
  const uintptr_t first = reinterpret_cast<uintptr_t>(row) & ~uintptr_t(63);
  PrefetchLines(reinterpret_cast<const void*>(first), int64_t(reinterpret_cast<uintptr_t>(row) + uintptr_t(rb) - first));
}

/// The row an id reads or writes: the id itself when it is in [0, rows),
/// else row 0. The ids were validated before the kernels run, but they are
/// the caller's memory, read in place: a caller's thread that rewrites them
/// meanwhile gets wrong rows, never an access outside the table. (A
/// compare and a conditional move per row: nothing beside its gather.)
template <typename I>
[[gnu::always_inline]] inline int64_t SafeRow(I id, int64_t rows) {
  return uint64_t(int64_t(id)) < uint64_t(rows) ? int64_t(id) : 0;
}

/// An "id" that is its row's address: the lookup kernels' third id type, for
/// a checkpoint served from several files (a sharded save), whose rows have
/// no common base. The kernels read `p` where they would read
/// table + id * stride; `rows` is unused.
struct RowAddress {
  const void* p;
};

/// Where the row of ids[k] starts: `table` + id * `stride` elements (the id
/// through SafeRow), or the address itself (RowAddress).
template <typename T, typename I>
[[gnu::always_inline]] inline const T* RowAt(const T* table, const I* ids, int64_t k, int64_t rows, int64_t stride) {
  if constexpr (std::is_same_v<I, RowAddress>)
    return static_cast<const T*>(ids[k].p);
  else
    return table + SafeRow(ids[k], rows) * stride;
}

/// The same for a prefetch, without SafeRow (a prefetch of any address is
/// harmless, and this one is a few instructions cheaper).
template <typename T, typename I>
[[gnu::always_inline]] inline const T* AheadAt(const T* table, const I* ids, int64_t k, int64_t stride) {
  if constexpr (std::is_same_v<I, RowAddress>)
    return static_cast<const T*>(ids[k].p);
  else
    return table + int64_t(ids[k]) * stride;
}

/// One lookup, as the kernels see it. `table` holds rows x dim elements of
/// the storage dtype; ids are already validated (and every row address is
/// taken through SafeRow); offsets are the engine's own (see StableBatch).
struct LookupArgs {
  const void* table = nullptr;
  int64_t rows = 0;
  int64_t dim = 0;
  const void* ids = nullptr;
  int64_t nnz = 0;
  const int64_t* offsets = nullptr;
  const float* weights = nullptr;  ///< null: all ones
  ops::CombinerKind combiner = ops::CombinerKind::kSum;
  int64_t max_sequence_length = 0;
  float* out = nullptr;
  int64_t out_stride = 0;  ///< pooled: floats from one output row to the next (0: dim)
};

/// Writes the output rows of bags [b0, b1) (pooled, or padded sequence).
using BagsFn = void (*)(const LookupArgs& a, int64_t b0, int64_t b1);
/// Writes output rows [g0, g1) of a grouped lookup: row g sums bags
/// groups[g] .. groups[g + 1] - 1 (see Table::LookupGrouped).
using GroupedFn = void (*)(const LookupArgs& a, const int64_t* groups, int64_t g0, int64_t g1);
/// Writes out[k] = w_k * row(ids[k]) for k in [k0, k1) (flat sequence).
using RowsFn = void (*)(const LookupArgs& a, int64_t k0, int64_t k1);
/// Converts `dim` elements of a stored row to float32 and back.
using LoadFn = void (*)(const void* row, float* dst, int64_t dim);
using StoreFn = void (*)(void* row, const float* src, int64_t dim);

/// How many groups (distinct ids) ahead the update prefetches rows and slots.
constexpr int64_t kUpdatePrefetchDistance = 8;

/// One occurrence of an id in a training batch: it adds coefficient * grad
/// (a row of dim floats) to the id's gradient.
struct Occurrence {
  uint64_t key;  ///< the id
  const float* grad;
  float coefficient;
};

/// One optimizer step, as the kernels see it: occurrences sorted by id
/// (stably: each id sums its gradients in input order), split into groups of
/// one id; ids are already validated.
struct UpdateArgs {
  void* values = nullptr;  ///< rows x dim of the storage dtype
  float* slots[2] = {nullptr, nullptr};
  int64_t dim = 0;
  const Occurrence* occurrences = nullptr;
  const int64_t* group_start = nullptr;  ///< group g is occurrences [group_start[g], group_start[g + 1])
  ops::StepConstants constants;
};

/// Updates the rows of groups [g0, g1): sums each group's gradient, then
/// applies ops::UpdateRow with `rule`.
template <typename Rule>
using UpdateFn = void (*)(const Rule& rule, const UpdateArgs& a, int64_t g0, int64_t g1);

/// One part of a plain SGD step on a float32 table, applied in input order
/// (ops::SgdInOrderElement): the batch and output shape it was looked up
/// with, and the gradient of that output; ids are already validated.
struct InOrderArgs {
  float* table = nullptr;
  int64_t rows = 0;
  int64_t dim = 0;
  const void* ids = nullptr;
  const int64_t* offsets = nullptr;  ///< num_bags + 1
  int64_t num_bags = 0;
  const float* weights = nullptr;  ///< null: all ones
  ops::CombinerKind combiner = ops::CombinerKind::kSum;
  int64_t max_sequence_length = 0;  ///< kNone: 0 flat rows, else padded bags
  const float* grads = nullptr;
  int64_t grads_stride = 0;  ///< pooled: floats from one gradient row to the next (0: dim)
  float lr = 0.0f;
  /// nnz occurrences of room, when the range is not every row (allocated
  /// by the caller before any row changes).
  Occurrence* scratch = nullptr;
};

/// Applies the occurrences of the rows in [r0, r1), in input order.
using InOrderFn = void (*)(const InOrderArgs& a, int64_t r0, int64_t r1);

/// The kernels for one storage dtype; indexed [id type] where it applies:
/// int32, int64, and for lookups RowAddress (kRowAddresses).
constexpr int kRowAddresses = 2;
struct DTypeKernels {
  BagsFn pooled[3];
  BagsFn padded[3];
  GroupedFn grouped[2];
  RowsFn rows[3];
  LoadFn load;
  StoreFn store;
  UpdateFn<ops::SgdRule> sgd;
  UpdateFn<ops::AdagradRule> adagrad;
  UpdateFn<ops::RowwiseAdagradRule> rowwise_adagrad;
  UpdateFn<ops::AdamRule> adam;
  UpdateFn<ops::FtrlRule> ftrl;
  InOrderFn sgd_in_order[2];  ///< float32 only (null for the 16-bit types)
  UpdateFn<ops::SgdRule> Update(const ops::SgdRule&) const { return sgd; }
  UpdateFn<ops::AdagradRule> Update(const ops::AdagradRule&) const { return adagrad; }
  UpdateFn<ops::RowwiseAdagradRule> Update(const ops::RowwiseAdagradRule&) const { return rowwise_adagrad; }
  UpdateFn<ops::AdamRule> Update(const ops::AdamRule&) const { return adam; }
  UpdateFn<ops::FtrlRule> Update(const ops::FtrlRule&) const { return ftrl; }
};
/// The lookup kernels of uint8_rowwise rows (a served checkpoint's values:
/// dim codes, then a float32 scale and bias; see rowwise8.h), dequantized
/// inside the gather: a pooled bag's column is sum_k (w_k * s_k) * q_k, from
/// zero in id order, plus sum_k w_k * b_k (from zero, in id order); a row on
/// its own (sequences) is (w * s) * q + w * b. Indexed [id type].
struct Rowwise8Kernels {
  BagsFn pooled[3];
  BagsFn padded[3];
  RowsFn rows[3];
};
struct KernelSet {
  const char* name;
  DTypeKernels dtype[3];  ///< indexed by DType (the table dtypes)
  Rowwise8Kernels rowwise8;
};

const KernelSet& GenericKernels();
/// Null when the build has no AVX2 path.
const KernelSet* Avx2Kernels();
/// Null when the build has no AVX-512 path.
const KernelSet* Avx512Kernels();
/// Whether the CPU has F16C (CPUID leaf 1, ECX bit 29; false off x86-64):
/// read from CPUID itself, as clang's __builtin_cpu_supports does not take
/// "f16c" (clang 14).
bool CpuHasF16c();
/// The best set this CPU runs (EMBEDCORE_KERNELS=generic or =avx2 caps the choice).
const KernelSet& ActiveKernels();

}  // namespace embedcore::kernels
