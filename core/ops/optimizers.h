// The optimizers' update rules, written once for the host loop and the CUDA
// kernel. Each functor updates one element: the weight `w` (float32), its
// summed gradient `g`, and up to two float32 slots. Semantics follow
// TensorFlow's TPU embedding optimizers (tf.tpu.experimental.embedding.*):
//
//   g  <- clip(g, clip_gradient_min, clip_gradient_max)      (clipvalue)
//   w  <- w - wd * w                                          (decoupled weight decay)
//   w  <- rule(w, g, slots)                                   (below)
//   w  <- clip(w, clip_weight_min, clip_weight_max)
//
// SGD:     w -= lr * g
// Adagrad: a += g^2;                 w -= lr * g / (sqrt(a) + eps)             slot: accumulators
//          (eps = 0 is TensorFlow's; PyTorch's torch.optim.Adagrad adds 1e-10)
// Row-wise Adagrad (FBGEMM's EXACT_ROWWISE_ADAGRAD, TorchRec's default):
//          a += sum_d(g_d^2) / dim (summed in column order);
//          w -= (lr / (sqrt(a) + eps)) * g                                      slot: row_accumulators, one per row
// Adam:    m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2
//          w -= lr_t * m / sqrt(v + eps^2)    (sum_inside_sqrt)
//          w -= lr_t * m / (sqrt(v) + eps)    (otherwise)                      slots: momenta, velocities
//          lr_t = lr, or lr * sqrt(1-b2^t) / (1-b1^t) with bias_correction (PyTorch's SparseAdam)
// FTRL:    a' = a + g^2;  sigma = (P(a') - P(a)) / lr;  l += g - sigma w     slots: accumulators, linears
//          q = (P(a') + beta) / lr + 2 l2;  w = |l| > l1 ? (sign(l) l1 - l) / q : 0
//          P(x) = x^(-learning_rate_power), sqrt(x) for the usual -0.5; with
//          multiply_linear_by_learning_rate, l holds lr times that sum)
#pragma once

#include <cmath>
#include <cstdint>

#include "host_device.h"

namespace embedcore::ops {

/// The per-step constants every rule shares.
struct StepConstants {
  float lr = 0.0f;
  float weight_decay = 0.0f;  ///< already multiplied by lr when asked to
  bool clip_gradient = false;
  float clip_gradient_min = 0.0f, clip_gradient_max = 0.0f;
  bool clip_weight_min = false, clip_weight_max = false;
  float weight_min = 0.0f, weight_max = 0.0f;
};

EMBEDCORE_HD float Clamp(float x, float lo, float hi) { return x < lo ? lo : (x > hi ? hi : x); }

/// A step with no gradient clipping, weight decay or weight clipping.
EMBEDCORE_HD bool PlainStep(const StepConstants& k) {
  return !k.clip_gradient && k.weight_decay == 0.0f && !k.clip_weight_min && !k.clip_weight_max;
}

/// Plain SGD on a float32 table applies a row's occurrences one at a time,
/// in input order: w = w - lr * (c * g) for each (coefficient c, gradient
/// row g). SGD is linear, so this is the step of the summed gradient; only
/// the rounding differs. It needs no sort: the host scans the batch once
/// (Table::ApplyGradients), the device keeps its sort and applies each
/// group's occurrences in order, with the same bits.
EMBEDCORE_HD float SgdInOrderElement(float w, float lr, float coefficient, float g) {
  return w - lr * (coefficient * g);
}

struct SgdRule {
  static constexpr int kSlots = 0;
  static constexpr bool kRowwise = false;  ///< one slot value per element
  float lr;
  EMBEDCORE_HD void operator()(float& w, float g, float*, float*) const { w = w - lr * g; }
};

struct AdagradRule {
  static constexpr int kSlots = 1;
  static constexpr bool kRowwise = false;  ///< one slot value per element
  float lr;
  float epsilon;  ///< added outside the square root; 0 for TensorFlow's Adagrad
  EMBEDCORE_HD void operator()(float& w, float g, float* acc, float*) const {
    const float a = *acc + g * g;
    *acc = a;
    w = w - lr * g / (std::sqrt(a) + epsilon);
  }
};

/// The rule's per-element part is w -= multiplier * g, with the row's
/// multiplier from Multiplier(): the row's slot and the mean of its squared
/// (clipped) gradient.
struct RowwiseAdagradRule {
  static constexpr int kSlots = 1;
  static constexpr bool kRowwise = true;  ///< one slot value per row
  float lr;
  float epsilon;  ///< added outside the square root (FBGEMM's eps)
  EMBEDCORE_HD float Multiplier(float* acc, float mean_square) const {
    const float a = *acc + mean_square;
    *acc = a;
    return lr / (std::sqrt(a) + epsilon);
  }
  // A zero gradient element does not move where lr / epsilon overflowed float32 (an accumulator of 0 with a
  // tiny epsilon), which FBGEMM's inf * 0 steps to NaN; every other step is w - multiplier * g, FBGEMM's bits.
  EMBEDCORE_HD float Step(float w, float g, float multiplier) const {
    return g == 0.0f && multiplier > 3.40282347e+38f ? w : w - multiplier * g;
  }
};

struct AdamRule {
  static constexpr int kSlots = 2;
  static constexpr bool kRowwise = false;  ///< one slot value per element
  float lr_t;  ///< learning rate, bias-corrected when asked
  float beta_1, beta_2, epsilon;
  bool sum_inside_sqrt;
  EMBEDCORE_HD void operator()(float& w, float g, float* m, float* v) const {
    const float mn = beta_1 * *m + (1.0f - beta_1) * g;
    const float vn = beta_2 * *v + (1.0f - beta_2) * (g * g);
    *m = mn;
    *v = vn;
    const float denom = sum_inside_sqrt ? std::sqrt(vn + epsilon * epsilon) : std::sqrt(vn) + epsilon;
    w = w - lr_t * mn / denom;
  }
};

struct FtrlRule {
  static constexpr int kSlots = 2;
  static constexpr bool kRowwise = false;  ///< one slot value per element
  float lr;
  float lr_power;  ///< learning_rate_power, usually -0.5
  float l1, l2, beta;
  bool multiply_linear_by_lr;
  EMBEDCORE_HD float PowNeg(float a) const {  // a^(-lr_power)
    return lr_power == -0.5f ? std::sqrt(a) : std::pow(a, -lr_power);
  }
  // l clipped to [-bound, bound], NaN kept: (ClipL1(l) - l) / q is 0 for |l| <= bound and shrinks l by the
  // bound otherwise, as TensorFlow's sparse FTRL kernel computes it (clip, subtract, divide), so that a NaN
  // linear (a NaN or infinite gradient) makes the weight NaN there too, not a silent 0.
  EMBEDCORE_HD static float ClipL1(float l, float bound) { return l > bound ? bound : (l < -bound ? -bound : l); }
  EMBEDCORE_HD void operator()(float& w, float g, float* acc, float* lin) const {
    const float a = *acc;
    const float an = a + g * g;
    const float pa = PowNeg(a), pn = PowNeg(an);
    float l = *lin;
    float wn;
    if (multiply_linear_by_lr) {
      l = l + lr * g - (pn - pa) * w;
      const float q = pn + beta + 2.0f * l2 * lr;
      const float l1lr = l1 * lr;
      wn = (ClipL1(l, l1lr) - l) / q;
    } else {
      l = l + g - (pn - pa) / lr * w;
      const float q = (pn + beta) / lr + 2.0f * l2;
      wn = (ClipL1(l, l1) - l) / q;
    }
    *acc = an;
    *lin = l;
    w = wn;
  }
};

// The steps around the rule, each a pure per-element function.
EMBEDCORE_HD float ClipGradient(const StepConstants& k, float g) {
  return Clamp(g, k.clip_gradient_min, k.clip_gradient_max);
}
EMBEDCORE_HD float DecayWeight(const StepConstants& k, float w) { return w - k.weight_decay * w; }
EMBEDCORE_HD float ClipWeightMin(const StepConstants& k, float w) { return w < k.weight_min ? k.weight_min : w; }
EMBEDCORE_HD float ClipWeightMax(const StepConstants& k, float w) { return w > k.weight_max ? k.weight_max : w; }

/// Clip the gradient, decay, apply `rule`, clip the weight: one element.
/// (The CPU loop applies the same four steps a row at a time, so that each
/// step vectorizes; every element sees them in this order either way.)
template <typename Rule>
EMBEDCORE_HD void UpdateElement(const Rule& rule, const StepConstants& k, float& w, float g, float* s0,
                                float* s1) {
  if (k.clip_gradient) g = ClipGradient(k, g);
  if (k.weight_decay != 0.0f) w = DecayWeight(k, w);
  rule(w, g, s0, s1);
  if (k.clip_weight_min) w = ClipWeightMin(k, w);
  if (k.clip_weight_max) w = ClipWeightMax(k, w);
}

/// A row-wise rule's step of one element, given its row's multiplier
/// (Rule::Multiplier) and its clipped gradient: decay, step, weight clipping.
template <typename Rule>
EMBEDCORE_HD float RowwiseElement(const Rule& rule, const StepConstants& k, float w, float g, float multiplier) {
  if (k.weight_decay != 0.0f) w = DecayWeight(k, w);
  w = rule.Step(w, g, multiplier);
  if (k.clip_weight_min) w = ClipWeightMin(k, w);
  if (k.clip_weight_max) w = ClipWeightMax(k, w);
  return w;
}

#if !defined(__CUDACC__)
/// UpdateElement over one row on the host, with the gradient of element d
/// given by `g(d)` (already clipped): decay, rule and weight clipping are
/// each their own loop, so that each vectorizes; every element still sees
/// the steps in UpdateElement's order.
/// A row-wise rule reads `g` twice (it must give the same values): for the
/// row's mean square, then for the step; its slot `s0` is the row's one value.
template <typename Rule, typename Gradient>
inline void UpdateRowFrom(const Rule& rule, const StepConstants& k, float* __restrict w, const Gradient& g,
                          float* __restrict s0, float* __restrict s1, int64_t dim) {
  float multiplier = 0.0f;
  if constexpr (Rule::kRowwise) {
    float sum_square = 0.0f;
    for (int64_t d = 0; d < dim; ++d) {
      const float gd = g(d);
      sum_square += gd * gd;
    }
    multiplier = rule.Multiplier(s0, sum_square / float(dim));
  }
  if (k.weight_decay != 0.0f)
    for (int64_t d = 0; d < dim; ++d) w[d] = DecayWeight(k, w[d]);
  if constexpr (Rule::kRowwise) {
    for (int64_t d = 0; d < dim; ++d) w[d] = rule.Step(w[d], g(d), multiplier);
  } else {
    for (int64_t d = 0; d < dim; ++d)
      rule(w[d], g(d), Rule::kSlots > 0 ? s0 + d : nullptr, Rule::kSlots > 1 ? s1 + d : nullptr);
  }
  if (k.clip_weight_min)
    for (int64_t d = 0; d < dim; ++d) w[d] = ClipWeightMin(k, w[d]);
  if (k.clip_weight_max)
    for (int64_t d = 0; d < dim; ++d) w[d] = ClipWeightMax(k, w[d]);
}

/// UpdateRowFrom with the gradient in an array; `g` is clipped in place.
template <typename Rule>
inline void UpdateRow(const Rule& rule, const StepConstants& k, float* __restrict w, float* __restrict g,
                      float* __restrict s0, float* __restrict s1, int64_t dim) {
  if (k.clip_gradient)
    for (int64_t d = 0; d < dim; ++d) g[d] = ClipGradient(k, g[d]);
  UpdateRowFrom(rule, k, w, [g](int64_t d) { return g[d]; }, s0, s1, dim);
}

/// UpdateRowFrom with the gradient coefficient * grad of one occurrence,
/// summed from zero (0 + c g, so -0 becomes +0 as in any sum), then clipped.
template <typename Rule>
inline void UpdateRowScaled(const Rule& rule, const StepConstants& k, float* __restrict w, float coefficient,
                            const float* __restrict grad, float* __restrict s0, float* __restrict s1, int64_t dim) {
  if (k.clip_gradient)
    UpdateRowFrom(rule, k, w, [&](int64_t d) { return ClipGradient(k, 0.0f + coefficient * grad[d]); }, s0, s1, dim);
  else
    UpdateRowFrom(rule, k, w, [&](int64_t d) { return 0.0f + coefficient * grad[d]; }, s0, s1, dim);
}
#endif

}  // namespace embedcore::ops
