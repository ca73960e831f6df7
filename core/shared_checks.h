// Checks shared by the core and the bindings (header-only: the bindings,
// which see only the public header otherwise, include it too).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "embedcore/embedcore.h"

namespace embedcore::internal {

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
