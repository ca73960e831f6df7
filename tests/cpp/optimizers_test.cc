// core/ops/optimizers.h: each update rule against its documented formula,
// evaluated independently in double, over random weights, gradients and
// slots; and the order of clip / decay / rule / clip in UpdateElement.
#include <cmath>
#include <random>

#include "ops/optimizers.h"
#include "test_util.h"

namespace ops = embedcore::ops;

namespace {

constexpr double kRel = 2e-5;   // float rounding of a few operations
constexpr double kAbs = 1e-6;

struct Sample {
  float w, g, s0, s1;
};

std::vector<Sample> Samples(uint32_t seed, int n, bool positive_s0) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> pos(0.05f, 2.0f);
  std::vector<Sample> out;
  for (int i = 0; i < n; ++i) {
    Sample s{normal(rng), normal(rng), positive_s0 ? pos(rng) : normal(rng) * 0.1f, normal(rng) * 0.1f};
    out.push_back(s);
  }
  // Edge cases: zero gradient, zero weight.
  out.push_back({0.0f, 0.0f, positive_s0 ? 0.1f : 0.0f, 0.0f});
  out.push_back({1.0f, 0.0f, positive_s0 ? 1.0f : 0.0f, 0.0f});
  out.push_back({0.0f, 1.0f, positive_s0 ? 0.1f : 0.0f, 0.0f});
  return out;
}

}  // namespace

EMBEDCORE_TEST(SgdRule) {
  const ops::SgdRule rule{0.25f};
  for (const Sample& s : Samples(1, 200, false)) {
    float w = s.w;
    rule(w, s.g, nullptr, nullptr);
    EMBEDCORE_EXPECT_BITS_EQ(w, s.w - 0.25f * s.g);  // one rounding each: exact in float
  }
}

EMBEDCORE_TEST(AdagradRule) {
  // epsilon is added outside the square root, torch.optim.Adagrad's
  // sqrt(a) + eps (0: TensorFlow's). With 0.1 and accumulators of 0.05..6,
  // sqrt(a + eps) would be off by up to a few percent: far beyond kRel.
  for (const float eps : {0.0f, 0.1f}) {
    const float lr = 0.1f;
    const ops::AdagradRule rule{lr, eps};
    for (const Sample& s : Samples(2, 500, true)) {
      float w = s.w, acc = s.s0;
      rule(w, s.g, &acc, nullptr);
      const double a = double(s.s0) + double(s.g) * s.g;
      EMBEDCORE_EXPECT_NEAR(acc, a, kRel, kAbs);
      EMBEDCORE_EXPECT_NEAR(w, s.w - lr * double(s.g) / (std::sqrt(a) + eps), kRel, kAbs);
    }
  }
}

EMBEDCORE_TEST(AdamRule) {
  for (bool inside : {true, false}) {
    const float lr = 0.01f, b1 = 0.9f, b2 = 0.999f, eps = 1e-3f;
    const ops::AdamRule rule{lr, b1, b2, eps, inside};
    for (const Sample& s : Samples(3, 500, true)) {
      float w = s.w, m = s.s1, v = s.s0;
      rule(w, s.g, &m, &v);
      const double mn = double(b1) * s.s1 + (1.0 - double(b1)) * s.g;
      const double vn = double(b2) * s.s0 + (1.0 - double(b2)) * double(s.g) * s.g;
      const double den = inside ? std::sqrt(vn + double(eps) * eps) : std::sqrt(vn) + eps;
      EMBEDCORE_EXPECT_NEAR(m, mn, kRel, kAbs);
      EMBEDCORE_EXPECT_NEAR(v, vn, kRel, kAbs);
      EMBEDCORE_EXPECT_NEAR(w, s.w - lr * mn / den, kRel, kAbs);
    }
  }
  // With zero slots the first step moves w by about lr * sign(g) (eps small).
  const ops::AdamRule rule{0.01f, 0.9f, 0.999f, 1e-7f, true};
  float w = 1.0f, m = 0.0f, v = 0.0f;
  rule(w, 2.0f, &m, &v);
  EMBEDCORE_EXPECT_NEAR(w, 1.0 - 0.01 * (0.1 * 2.0) / std::sqrt(0.001 * 4.0), kRel, kAbs);
}

namespace {
// FTRL-proximal as documented, in double; p = -learning_rate_power.
void FtrlReference(double lr, double lr_power, double l1, double l2, double beta, bool mul_lr, double& w,
                   double g, double& acc, double& lin) {
  const double p = -lr_power;
  const double an = acc + g * g;
  const double sigma = (std::pow(an, p) - std::pow(acc, p)) / lr;
  double q, l;
  if (!mul_lr) {
    l = lin + g - sigma * w;
    q = (std::pow(an, p) + beta) / lr + 2 * l2;
    w = std::fabs(l) > l1 ? ((l > 0 ? l1 : -l1) - l) / q : 0.0;
  } else {
    // l holds lr times the linear sum; so do l1 and the threshold.
    l = lin + lr * (g - sigma * w);
    q = (std::pow(an, p) + beta) / lr + 2 * l2;
    const double l1lr = l1 * lr;
    w = std::fabs(l) > l1lr ? ((l > 0 ? l1lr : -l1lr) - l) / (q * lr) : 0.0;
  }
  acc = an;
  lin = l;
}
}  // namespace

EMBEDCORE_TEST(FtrlRule) {
  struct Params {
    float lr, lr_power, l1, l2, beta;
    bool mul_lr;
  };
  const Params params[] = {
      {0.1f, -0.5f, 0.0f, 0.0f, 0.0f, false},  {0.1f, -0.5f, 0.01f, 0.1f, 0.0f, false},
      {0.05f, -0.5f, 0.001f, 0.01f, 0.5f, false}, {0.1f, -0.25f, 0.01f, 0.1f, 0.1f, false},
      {0.1f, 0.0f, 0.01f, 0.1f, 0.0f, false},  {0.1f, -0.5f, 0.01f, 0.1f, 0.2f, true},
      {0.2f, -0.3f, 0.001f, 0.0f, 0.0f, true},
  };
  for (const Params& p : params) {
    const ops::FtrlRule rule{p.lr, p.lr_power, p.l1, p.l2, p.beta, p.mul_lr};
    for (const Sample& s : Samples(4, 300, true)) {
      // Several steps on one element, the reference carried in double.
      float w = s.w, acc = s.s0, lin = s.s1;
      double rw = s.w, racc = s.s0, rlin = s.s1;
      std::mt19937 rng(uint32_t(s.s0 * 1e6f));
      std::normal_distribution<float> normal(0.0f, 1.0f);
      for (int step = 0; step < 3; ++step) {
        const float g = step == 0 ? s.g : normal(rng);
        rule(w, g, &acc, &lin);
        FtrlReference(p.lr, p.lr_power, p.l1, p.l2, p.beta, p.mul_lr, rw, g, racc, rlin);
        // Start each step from the float state so errors do not compound.
        EMBEDCORE_EXPECT_NEAR(acc, racc, kRel, kAbs);
        EMBEDCORE_EXPECT_NEAR(lin, rlin, 1e-4, 1e-5);
        EMBEDCORE_EXPECT_NEAR(w, rw, 1e-4, 1e-5);
        rw = w;
        racc = acc;
        rlin = lin;
      }
    }
  }
}

EMBEDCORE_TEST(FtrlL1ZeroesSmallLinears) {
  // |linear| <= l1 after the step gives w == 0 exactly.
  const ops::FtrlRule rule{0.1f, -0.5f, 10.0f, 0.0f, 0.0f, false};
  float w = 0.3f, acc = 0.1f, lin = 0.0f;
  rule(w, 0.5f, &acc, &lin);
  EMBEDCORE_EXPECT_BITS_EQ(w, 0.0f);
  EMBEDCORE_EXPECT_BITS_EQ(acc, 0.1f + 0.5f * 0.5f);
}

EMBEDCORE_TEST(UpdateElementOrder) {
  // clip(g) -> decay -> rule -> clip(w), with SGD so every step is visible.
  const ops::SgdRule sgd{1.0f};
  ops::StepConstants k;
  k.lr = 1.0f;
  float w = 1.0f;
  ops::UpdateElement(sgd, k, w, 0.25f, nullptr, nullptr);  // no options: plain SGD
  EMBEDCORE_EXPECT_BITS_EQ(w, 0.75f);

  k.clip_gradient = true;
  k.clip_gradient_min = -0.5f;
  k.clip_gradient_max = 0.5f;
  w = 1.0f;
  ops::UpdateElement(sgd, k, w, 3.0f, nullptr, nullptr);  // g clipped to 0.5
  EMBEDCORE_EXPECT_BITS_EQ(w, 0.5f);
  w = 1.0f;
  ops::UpdateElement(sgd, k, w, -3.0f, nullptr, nullptr);  // g clipped to -0.5
  EMBEDCORE_EXPECT_BITS_EQ(w, 1.5f);

  k.weight_decay = 0.5f;  // w = 1 - 0.5 * 1 = 0.5, then SGD with g = 0.25
  w = 1.0f;
  ops::UpdateElement(sgd, k, w, 0.25f, nullptr, nullptr);
  EMBEDCORE_EXPECT_BITS_EQ(w, 0.25f);

  k.clip_weight_min = true;
  k.weight_min = 0.4f;  // after the rule: 0.25 -> 0.4
  w = 1.0f;
  ops::UpdateElement(sgd, k, w, 0.25f, nullptr, nullptr);
  EMBEDCORE_EXPECT_BITS_EQ(w, 0.4f);

  k.clip_weight_min = false;
  k.clip_weight_max = true;
  k.weight_max = 0.1f;
  w = 1.0f;
  ops::UpdateElement(sgd, k, w, 0.25f, nullptr, nullptr);
  EMBEDCORE_EXPECT_BITS_EQ(w, 0.1f);

  // The clipped gradient is what reaches the slots.
  ops::StepConstants kc;
  kc.clip_gradient = true;
  kc.clip_gradient_min = -1.0f;
  kc.clip_gradient_max = 1.0f;
  const ops::AdagradRule adagrad{0.1f, 0.0f};
  float acc = 0.5f;
  w = 0.0f;
  ops::UpdateElement(adagrad, kc, w, 5.0f, &acc, nullptr);
  EMBEDCORE_EXPECT_BITS_EQ(acc, 1.5f);
}

EMBEDCORE_TEST(Clamp) {
  EMBEDCORE_EXPECT_BITS_EQ(ops::Clamp(5.0f, -1.0f, 1.0f), 1.0f);
  EMBEDCORE_EXPECT_BITS_EQ(ops::Clamp(-5.0f, -1.0f, 1.0f), -1.0f);
  EMBEDCORE_EXPECT_BITS_EQ(ops::Clamp(0.5f, -1.0f, 1.0f), 0.5f);
}
