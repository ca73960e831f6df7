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
