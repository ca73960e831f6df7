// Private helpers shared by the core's translation units.
#pragma once

#include <cstddef>
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "embedcore/embedcore.h"

namespace embedcore::internal {

/// Zero-filled, 64-byte aligned memory. Large blocks come from mmap (pages
/// are zero until touched, and transparent huge pages are requested, which
/// cuts TLB misses of random row gathers); small ones from the heap.
void* AllocateZeroed(size_t bytes);
void Free(void* p, size_t bytes);

/// bytes = a * b * c, or InvalidArgument naming `what` if it overflows.
size_t CheckedBytes(int64_t a, int64_t b, size_t c, const std::string& what);

/// Fills rows * dim elements of `dtype` at `data` (already zero).
/// Fills [rows, dim] at `data` as elements (row0 + r, col0 + c) of a table
/// `full_dim` wide (row0 = col0 = 0, full_dim = dim for a whole table).
void Initialize(const InitializerSpec& spec, DType dtype, int64_t rows, int64_t dim, int64_t row0, int64_t col0,
                int64_t full_dim, void* data);
/// The value of element `index` (row * dim + col); the pure function behind Initialize.
float InitialValue(const InitializerSpec& spec, int64_t dim, uint64_t index);

/// Runs the lookup kernels over `values` (rows x dim of `dtype`); the batch
/// is already validated.
void RunLookup(const void* values, DType dtype, int64_t dim, const Batch& batch, const OutputShape& shape, float* out);

/// Stable LSD radix sort of `items` by their `key` member, keys < 2^key_bits.
template <typename Item>
void RadixSort(std::vector<Item>& items, int key_bits) {
  constexpr int kDigitBits = 11;
  constexpr size_t kBuckets = size_t(1) << kDigitBits;
  if (items.size() < 2) return;
  // Reused by every sort on this thread: a fresh multi-megabyte buffer per
  // call would be fresh pages, and page faults, every training step.
  static thread_local std::vector<Item> tmp;
  tmp.resize(items.size());
  std::vector<size_t> count(kBuckets);
  for (int shift = 0; shift < key_bits; shift += kDigitBits) {
    std::fill(count.begin(), count.end(), 0);
    for (const Item& it : items) ++count[(it.key >> shift) & (kBuckets - 1)];
    size_t sum = 0;
    for (size_t& c : count) {
      const size_t n = c;
      c = sum;
      sum += n;
    }
    for (const Item& it : items) tmp[count[(it.key >> shift) & (kBuckets - 1)]++] = it;
    items.swap(tmp);
  }
}

/// (key, value) pairs, the simplest item RadixSort sorts.
struct KeyValue {
  uint64_t key;
  uint64_t value;
};

}  // namespace embedcore::internal
