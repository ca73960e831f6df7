// Private helpers shared by the core's translation units.
#pragma once

#include <cstddef>
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
void Initialize(const InitializerSpec& spec, DType dtype, int64_t rows, int64_t dim, void* data);
/// The value of element `index` (row * dim + col); the pure function behind Initialize.
float InitialValue(const InitializerSpec& spec, int64_t dim, uint64_t index);

/// Runs the lookup kernels over `values` (rows x dim of `dtype`); the batch
/// is already validated.
void RunLookup(const void* values, DType dtype, int64_t dim, const Batch& batch, const OutputShape& shape, float* out);

/// Stable LSD radix sort of (key, value) pairs by key, keys < 2^key_bits.
struct KeyValue {
  uint64_t key;
  uint64_t value;
};
void RadixSort(std::vector<KeyValue>& items, int key_bits);

}  // namespace embedcore::internal
