// Checks shared by the core and the bindings (header-only: the bindings,
// which see only the public header otherwise, include it too).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "embedcore/embedcore.h"

namespace embedcore::internal {

/// True when the byte ranges [a, a + a_bytes) and [b, b + b_bytes) share a byte.
inline bool Overlaps(const void* a, size_t a_bytes, const void* b, size_t b_bytes) {
  const auto x = reinterpret_cast<uintptr_t>(a), y = reinterpret_cast<uintptr_t>(b);
  return a_bytes > 0 && b_bytes > 0 && x < y + b_bytes && y < x + a_bytes;
}

/// The most ids (nnz) or bags (num_bags) a batch may hold: its arrays' sizes
/// in bytes, (num_bags + 1) x 8 for the offsets and nnz x 8 for int64 ids,
/// then fit in int64. No array in memory is that large, and a count above it
/// would overflow the arithmetic on the arrays (offsets + num_bags + 1 wraps
/// the pointer), so it is refused before any.
constexpr int64_t kMaxBatchCount = INT64_MAX / 8 - 1;

/// InvalidArgument naming nnz or num_bags if above kMaxBatchCount (negative
/// counts are the caller's to refuse: ValidateBatch's in the engine).
/// `prefix` is put before their names: "batch." for the C API's embedcore_batch.
inline void CheckBatchCounts(int64_t nnz, int64_t num_bags, const char* prefix = "") {
  if (nnz > kMaxBatchCount)
    throw InvalidArgument(prefix + ("nnz = " + std::to_string(nnz)) + " is a size that overflows int64 (nnz x 8 " +
                          "bytes of ids); at most " + std::to_string(kMaxBatchCount));
  if (num_bags > kMaxBatchCount)
    throw InvalidArgument(prefix + ("num_bags = " + std::to_string(num_bags)) + " is a size that overflows int64 " +
                          "((num_bags + 1) x 8 bytes of offsets); at most " + std::to_string(kMaxBatchCount));
}
inline void CheckBatchCounts(const Batch& batch) { CheckBatchCounts(batch.nnz, batch.num_bags); }

/// InvalidArgument naming the first of a batch's offsets[0 .. num_bags] (in
/// host memory) that breaks its rules: start at 0, never decrease, end at nnz.
inline void CheckOffsets(const int64_t* off, int64_t num_bags, int64_t nnz) {
  if (off[0] != 0) throw InvalidArgument("offsets[0] must be 0, got " + std::to_string(off[0]));
  for (int64_t b = 0; b < num_bags; ++b) {
    if (off[b + 1] < off[b])
      throw InvalidArgument("offsets must be non-decreasing: offsets[" + std::to_string(b) + "] = " +
                            std::to_string(off[b]) + " > offsets[" + std::to_string(b + 1) +
                            "] = " + std::to_string(off[b + 1]));
  }
  if (off[num_bags] != nnz)
    throw InvalidArgument("offsets must end at the number of ids, " + std::to_string(nnz) + ", got offsets[" +
                          std::to_string(num_bags) + "] = " + std::to_string(off[num_bags]));
}

/// InvalidArgument for a negative max_sequence_length (a gradient part's, whatever its combiner).
inline void CheckMaxSequenceLength(int64_t max_sequence_length) {
  if (max_sequence_length < 0)
    throw InvalidArgument("max_sequence_length must be >= 0, got " + std::to_string(max_sequence_length));
}

/// The same for a lookup, which reads max_sequence_length only for sequences (combiner none).
inline void CheckLookupSequenceLength(const OutputShape& shape) {
  if (shape.combiner == Combiner::kNone) CheckMaxSequenceLength(shape.max_sequence_length);
}

}  // namespace embedcore::internal
