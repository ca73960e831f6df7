// The combiners, written once for host and device, with TensorFlow's
// formulas (embedding_lookup_sparse): for a bag with ids i_k and weights w_k
//   sum   = sum_k w_k row(i_k)
//   mean  = sum / sum_k w_k            (zero when sum_k w_k == 0, as div_no_nan)
//   sqrtn = sum / sqrt(sum_k w_k^2)    (zero when that is 0)
// An empty bag gives zeros. The backward coefficient of occurrence k is
// d out / d row(i_k) = w_k / denominator.
#pragma once

#include <cmath>
#include <cstdint>

#include "host_device.h"

namespace embedcore::ops {

enum class CombinerKind : uint8_t { kSum = 0, kMean = 1, kSqrtn = 2, kNone = 3 };

/// The number the weighted sum is divided by; 0 means "output zeros".
EMBEDCORE_HD float CombinerDenominator(CombinerKind c, float sum_w, float sum_w2) {
  switch (c) {
    case CombinerKind::kMean:
      return sum_w;
    case CombinerKind::kSqrtn:
      return std::sqrt(sum_w2);
    default:
      return 1.0f;
  }
}

/// The combiner denominator of the bag of ids [begin, end) (1 for sum and
/// sequences), for every lookup and update kernel, host and device: its
/// weights summed in float32 in id order, as TensorFlow sums them. Without
/// weights, the count itself (mean: float(n); sqrtn: sqrt(n)), as PyTorch's
/// embedding_bag and TensorFlow's sparse_segment_mean divide: a float32 sum
/// of ones stops growing at 2**24 (below it the two are the same bits; a
/// sqrt correctly rounded in double is correctly rounded in float).
EMBEDCORE_HD float BagDenominator(CombinerKind c, int64_t begin, int64_t end, const float* weights) {
  if (c != CombinerKind::kMean && c != CombinerKind::kSqrtn) return 1.0f;
  if (weights == nullptr) {
    const int64_t n = end - begin;
    return c == CombinerKind::kMean ? float(n) : float(std::sqrt(double(n)));
  }
  float sum_w = 0.0f, sum_w2 = 0.0f;
  for (int64_t i = begin; i < end; ++i) {
    const float w = weights[i];
    sum_w += w;
    sum_w2 += w * w;
  }
  return CombinerDenominator(c, sum_w, sum_w2);
}

/// Turns the weighted sum `acc` of one bag into the combined row, in place.
EMBEDCORE_HD void FinishBag(CombinerKind c, float denominator, float* acc, int64_t dim) {
  if (c == CombinerKind::kSum) return;
  if (denominator == 0.0f) {
    for (int64_t d = 0; d < dim; ++d) acc[d] = 0.0f;
    return;
  }
  for (int64_t d = 0; d < dim; ++d) acc[d] = acc[d] / denominator;
}

/// Gradient coefficient of an occurrence with weight `w` in a bag.
EMBEDCORE_HD float BackwardCoefficient(CombinerKind c, float w, float denominator) {
  if (c == CombinerKind::kSum || c == CombinerKind::kNone) return w;
  return denominator == 0.0f ? 0.0f : w / denominator;
}

}  // namespace embedcore::ops
