// core/ops/combiners.h: the denominators, finishing a bag, and the backward
// coefficients, with TensorFlow's embedding_lookup_sparse formulas.
#include <cmath>
#include <limits>
#include <vector>

#include "embedcore/embedcore.h"
#include "ops/combiners.h"
#include "test_util.h"

namespace ops = embedcore::ops;
using ops::CombinerKind;

EMBEDCORE_TEST(CombinerKindMatchesPublicCombiner) {
  // table.cc casts embedcore::Combiner to ops::CombinerKind.
  EMBEDCORE_EXPECT_EQ(int(CombinerKind::kSum), int(embedcore::Combiner::kSum));
  EMBEDCORE_EXPECT_EQ(int(CombinerKind::kMean), int(embedcore::Combiner::kMean));
  EMBEDCORE_EXPECT_EQ(int(CombinerKind::kSqrtn), int(embedcore::Combiner::kSqrtn));
  EMBEDCORE_EXPECT_EQ(int(CombinerKind::kNone), int(embedcore::Combiner::kNone));
}

EMBEDCORE_TEST(Denominators) {
  EMBEDCORE_EXPECT_BITS_EQ(ops::CombinerDenominator(CombinerKind::kSum, 3.0f, 5.0f), 1.0f);
  EMBEDCORE_EXPECT_BITS_EQ(ops::CombinerDenominator(CombinerKind::kNone, 3.0f, 5.0f), 1.0f);
  EMBEDCORE_EXPECT_BITS_EQ(ops::CombinerDenominator(CombinerKind::kMean, 3.0f, 5.0f), 3.0f);
  EMBEDCORE_EXPECT_BITS_EQ(ops::CombinerDenominator(CombinerKind::kSqrtn, 3.0f, 5.0f), std::sqrt(5.0f));
  EMBEDCORE_EXPECT_BITS_EQ(ops::CombinerDenominator(CombinerKind::kMean, 0.0f, 0.0f), 0.0f);
  EMBEDCORE_EXPECT_BITS_EQ(ops::CombinerDenominator(CombinerKind::kSqrtn, 0.0f, 0.0f), 0.0f);
}

EMBEDCORE_TEST(FinishBag) {
  const std::vector<float> sum = {1.0f, -2.0f, 3.5f};
  std::vector<float> acc = sum;
  ops::FinishBag(CombinerKind::kSum, 7.0f, acc.data(), 3);  // sum ignores the denominator
  for (int d = 0; d < 3; ++d) EMBEDCORE_EXPECT_BITS_EQ(acc[d], sum[d]);
  acc = sum;
  ops::FinishBag(CombinerKind::kMean, 4.0f, acc.data(), 3);
  for (int d = 0; d < 3; ++d) EMBEDCORE_EXPECT_BITS_EQ(acc[d], sum[d] / 4.0f);
  acc = sum;
  ops::FinishBag(CombinerKind::kSqrtn, std::sqrt(3.0f), acc.data(), 3);
  for (int d = 0; d < 3; ++d) EMBEDCORE_EXPECT_BITS_EQ(acc[d], sum[d] / std::sqrt(3.0f));
  // A zero denominator gives zeros (div_no_nan), for mean and sqrtn alike.
  for (CombinerKind c : {CombinerKind::kMean, CombinerKind::kSqrtn}) {
    acc = sum;
    ops::FinishBag(c, 0.0f, acc.data(), 3);
    for (int d = 0; d < 3; ++d) EMBEDCORE_EXPECT_BITS_EQ(acc[d], 0.0f);
  }
  // Weights that cancel: mean's denominator is 0 and the bag gives zeros.
  acc = sum;
  ops::FinishBag(CombinerKind::kMean, ops::CombinerDenominator(CombinerKind::kMean, 1.0f + -1.0f, 2.0f),
                 acc.data(), 3);
  for (int d = 0; d < 3; ++d) EMBEDCORE_EXPECT_BITS_EQ(acc[d], 0.0f);
}

EMBEDCORE_TEST(BackwardCoefficients) {
  EMBEDCORE_EXPECT_BITS_EQ(ops::BackwardCoefficient(CombinerKind::kSum, 0.5f, 9.0f), 0.5f);
  EMBEDCORE_EXPECT_BITS_EQ(ops::BackwardCoefficient(CombinerKind::kNone, 0.5f, 9.0f), 0.5f);
  EMBEDCORE_EXPECT_BITS_EQ(ops::BackwardCoefficient(CombinerKind::kMean, 0.5f, 4.0f), 0.125f);
  EMBEDCORE_EXPECT_BITS_EQ(ops::BackwardCoefficient(CombinerKind::kSqrtn, 3.0f, std::sqrt(2.0f)),
                           3.0f / std::sqrt(2.0f));
  EMBEDCORE_EXPECT_BITS_EQ(ops::BackwardCoefficient(CombinerKind::kMean, 0.5f, 0.0f), 0.0f);
  EMBEDCORE_EXPECT_BITS_EQ(ops::BackwardCoefficient(CombinerKind::kSqrtn, 0.5f, 0.0f), 0.0f);
}

EMBEDCORE_TEST(BackwardIsTheDerivativeOfForward) {
  // d out[d] / d row_k[d] of a mean / sqrtn bag, by finite differences in
  // double, equals the coefficient.
  const std::vector<float> w = {0.5f, 2.0f, -0.75f};
  for (CombinerKind c : {CombinerKind::kSum, CombinerKind::kMean, CombinerKind::kSqrtn}) {
    float sw = 0, sw2 = 0;
    for (float x : w) {
      sw += x;
      sw2 += x * x;
    }
    const float den = ops::CombinerDenominator(c, sw, sw2);
    for (size_t k = 0; k < w.size(); ++k) {
      // out = sum_j w_j r_j / den is linear in r_k with slope w_k / den.
      const double slope = double(w[k]) / double(den);
      EMBEDCORE_EXPECT_NEAR(ops::BackwardCoefficient(c, w[k], den), slope, 1e-6, 0.0);
    }
  }
}
