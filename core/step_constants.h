// The per-step constants of an optimizer step, from its spec: shared by the
// CPU update (table.cc) and the GPU one (cuda/update.cu), so both take the
// same step.
#pragma once

#include <cmath>

#include "embedcore/embedcore.h"
#include "ops/optimizers.h"

namespace embedcore::internal {

inline ops::StepConstants StepConstantsFor(const OptimizerSpec& o, float learning_rate) {
  ops::StepConstants kc;
  kc.lr = learning_rate;
  kc.weight_decay = o.multiply_weight_decay_factor_by_learning_rate ? o.weight_decay_factor * learning_rate
                                                                   : o.weight_decay_factor;
  kc.clip_gradient = o.has_clipvalue;
  kc.clip_gradient_min = o.clip_gradient_min;
  kc.clip_gradient_max = o.clip_gradient_max;
  kc.clip_weight_min = o.has_clip_weight_min;
  kc.weight_min = o.clip_weight_min;
  kc.clip_weight_max = o.has_clip_weight_max;
  kc.weight_max = o.clip_weight_max;
  return kc;
}

/// Adam's rule for the step after `step` steps (bias-corrected rate when asked).
inline ops::AdamRule AdamRuleFor(const OptimizerSpec& o, float learning_rate, int64_t step) {
  float lr_t = learning_rate;
  if (o.bias_correction) {
    const double t = double(step + 1);
    lr_t = float(double(learning_rate) * std::sqrt(1.0 - std::pow(double(o.beta_2), t)) /
                 (1.0 - std::pow(double(o.beta_1), t)));
  }
  return ops::AdamRule{lr_t, o.beta_1, o.beta_2, o.epsilon, o.sum_inside_sqrt};
}

inline ops::FtrlRule FtrlRuleFor(const OptimizerSpec& o, float learning_rate) {
  return ops::FtrlRule{learning_rate, o.learning_rate_power, o.l1, o.l2, o.beta, o.multiply_linear_by_learning_rate};
}

}  // namespace embedcore::internal
