// core/table.cc through the public API (embedcore.h): lookups against a naive
// reference (bit-exact: the reference does the same float operations in the
// documented order), optimizer steps against two references (the ops functors
// applied per element, bit-exact, and the documented formulas in double,
// within rounding), validation that leaves the table unchanged, thread-count
// independence and concurrent lookups during updates.
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include "embedcore/embedcore.h"
#include "internal.h"
#include "ops/half.h"
#include "ops/optimizers.h"
#include "fixtures.h"
#include "test_util.h"

using namespace embedcore;
namespace ops = embedcore::ops;
using embedcore_test::Bits;

namespace {

// ------------------------------------------------------------ helpers
TableSpec MakeSpec(int64_t rows, int64_t dim, DType dtype = DType::kFloat32,
                   OptimizerSpec::Kind opt = OptimizerSpec::Kind::kSGD, uint64_t seed = 1) {
  return embedcore_test::Spec("t", rows, dim, dtype, opt, seed);
}

float StoredToFloat(DType dt, const void* base, int64_t i) {
  switch (dt) {
    case DType::kFloat32:
      return static_cast<const float*>(base)[i];
    case DType::kFloat16:
      return ops::HalfToFloat(static_cast<const uint16_t*>(base)[i]);
    case DType::kBFloat16:
      return ops::BFloat16ToFloat(static_cast<const uint16_t*>(base)[i]);
    case DType::kUInt8Rowwise:  // (no trainable table stores it)
      break;
  }
  return 0.0f;
}

float RoundToStorage(DType dt, float v) {
  switch (dt) {
    case DType::kFloat32:
      return v;
    case DType::kFloat16:
      return ops::HalfToFloat(ops::FloatToHalf(v));
    case DType::kBFloat16:
      return ops::BFloat16ToFloat(ops::FloatToBFloat16(v));
    case DType::kUInt8Rowwise:  // (no trainable table stores it)
      break;
  }
  return v;
}

// The float value of every stored element, straight from the raw storage.
std::vector<float> Values(const Table& t) {
  std::vector<float> v(size_t(t.rows() * t.dim()));
  for (int64_t i = 0; i < t.rows() * t.dim(); ++i) v[size_t(i)] = StoredToFloat(t.spec().dtype, t.values(), i);
  return v;
}

// Everything an update may change, for "unchanged" and "identical" checks.
struct Snapshot {
  std::vector<uint8_t> values;
  std::vector<std::vector<float>> slots;
  int64_t step;
  bool operator==(const Snapshot& o) const { return values == o.values && slots == o.slots && step == o.step; }
};

Snapshot Take(Table& t) {
  Snapshot s;
  const uint8_t* v = static_cast<const uint8_t*>(t.values());
  s.values.assign(v, v + t.value_bytes());
  for (size_t i = 0; i < t.num_slots(); ++i) {
    const float* p = t.slot(i);
    s.slots.emplace_back(p, p + t.rows() * t.slot_dim());
  }
  s.step = t.step();
  return s;
}

// A batch that owns its arrays.
struct HostBatch {
  std::vector<int64_t> ids;
  std::vector<int32_t> ids32;
  std::vector<int64_t> offsets{0};
  std::vector<float> weights;
  bool weighted = false;
  bool int32 = false;

  void AddBag(const std::vector<int64_t>& bag, const std::vector<float>& w = {}) {
    for (size_t i = 0; i < bag.size(); ++i) {
      ids.push_back(bag[i]);
      ids32.push_back(int32_t(bag[i]));
      weights.push_back(w.empty() ? 1.0f : w[i]);
    }
    offsets.push_back(int64_t(ids.size()));
  }
  int64_t bags() const { return int64_t(offsets.size()) - 1; }
  Batch View() const {
    Batch b;
    b.id_type = int32 ? IdType::kInt32 : IdType::kInt64;
    b.ids = int32 ? static_cast<const void*>(ids32.data()) : static_cast<const void*>(ids.data());
    b.nnz = int64_t(ids.size());
    b.offsets = offsets.data();
    b.num_bags = bags();
    b.weights = weighted ? weights.data() : nullptr;
    return b;
  }
};

// Random bags of 0..max_len ids; half the ids come from a few hot rows, so
// repeats (within and across bags) are common.
HostBatch RandomBatch(std::mt19937& rng, int64_t bags, int64_t max_len, int64_t rows, bool weighted, bool int32) {
  HostBatch b;
  b.weighted = weighted;
  b.int32 = int32;
  std::uniform_int_distribution<int64_t> len(0, max_len), any(0, rows - 1), hot(0, std::min<int64_t>(rows, 5) - 1);
  std::uniform_real_distribution<float> w(-1.5f, 2.0f);
  for (int64_t i = 0; i < bags; ++i) {
    std::vector<int64_t> bag;
    std::vector<float> ws;
    const int64_t n = len(rng);
    for (int64_t k = 0; k < n; ++k) {
      bag.push_back(rng() % 2 ? hot(rng) : any(rng));
      ws.push_back(w(rng));
    }
    b.AddBag(bag, ws);
  }
  return b;
}

// ------------------------------------------------------------ lookup reference
std::vector<float> RefLookup(const Table& t, const HostBatch& hb, const OutputShape& shape) {
  const std::vector<float> v = Values(t);
  const int64_t dim = t.dim();
  const Batch b = hb.View();
  std::vector<float> out(size_t(shape.OutputRows(b) * dim), 0.0f);
  auto w_of = [&](int64_t k) { return hb.weighted ? hb.weights[size_t(k)] : 1.0f; };
  for (int64_t bag = 0; bag < hb.bags(); ++bag) {
    const int64_t begin = hb.offsets[size_t(bag)], end = hb.offsets[size_t(bag) + 1];
    if (shape.combiner == Combiner::kNone) {
      for (int64_t k = begin; k < end; ++k) {
        const int64_t j = k - begin;
        int64_t out_row;
        if (shape.max_sequence_length == 0) {
          out_row = k;
        } else {
          if (j >= shape.max_sequence_length) break;
          out_row = bag * shape.max_sequence_length + j;
        }
        for (int64_t d = 0; d < dim; ++d)
          out[size_t(out_row * dim + d)] = w_of(k) * v[size_t(hb.ids[size_t(k)] * dim + d)];
      }
      continue;
    }
    float* acc = &out[size_t(bag * dim)];
    float sw = 0.0f, sw2 = 0.0f;
    for (int64_t k = begin; k < end; ++k) {
      for (int64_t d = 0; d < dim; ++d) acc[d] += w_of(k) * v[size_t(hb.ids[size_t(k)] * dim + d)];
      sw += w_of(k);
      sw2 += w_of(k) * w_of(k);
    }
    if (shape.combiner == Combiner::kSum) continue;
    const float den = shape.combiner == Combiner::kMean ? sw : std::sqrt(sw2);
    for (int64_t d = 0; d < dim; ++d) acc[d] = den == 0.0f ? 0.0f : acc[d] / den;
  }
  return out;
}

int64_t CountBitDiffs(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return -1;
  int64_t n = 0;
  for (size_t i = 0; i < a.size(); ++i) n += Bits(a[i]) != Bits(b[i]);
  return n;
}

// ------------------------------------------------------------ update references
// One part of a step, owning its gradient.
struct HostPart {
  HostBatch batch;
  OutputShape shape;
  std::vector<float> grads;
  GradientPart View() const { return GradientPart{batch.View(), shape, grads.data()}; }
};

HostPart RandomPart(std::mt19937& rng, const Table& t, Combiner c, int64_t max_len, bool weighted, bool int32) {
  HostPart p;
  p.batch = RandomBatch(rng, 17, 6, t.rows(), weighted, int32);
  p.shape.combiner = c;
  p.shape.max_sequence_length = max_len;
  std::normal_distribution<float> normal(0.0f, 1.0f);
  p.grads.resize(size_t(p.shape.OutputRows(p.batch.View()) * t.dim()));
  for (float& g : p.grads) g = normal(rng);
  return p;
}

// The summed gradient of every touched id: the coefficient of each
// occurrence times its gradient row, added in occurrence order (parts in
// order, then ids in order), starting from 0.
// Calls fn(id, coefficient, gradient row) for every occurrence of `parts`
// that was looked up, in occurrence order (parts in order, then ids in order).
template <typename Fn>
void ForEachOccurrence(const std::vector<HostPart>& parts, int64_t dim, const Fn& fn) {
  for (const HostPart& p : parts) {
    const HostBatch& hb = p.batch;
    for (int64_t bag = 0; bag < hb.bags(); ++bag) {
      const int64_t begin = hb.offsets[size_t(bag)], end = hb.offsets[size_t(bag) + 1];
      float sw = 0.0f, sw2 = 0.0f;
      for (int64_t k = begin; k < end; ++k) {
        const float w = hb.weighted ? hb.weights[size_t(k)] : 1.0f;
        sw += w;
        sw2 += w * w;
      }
      const Combiner c = p.shape.combiner;
      const float den = c == Combiner::kMean ? sw : c == Combiner::kSqrtn ? std::sqrt(sw2) : 1.0f;
      for (int64_t k = begin; k < end; ++k) {
        const float w = hb.weighted ? hb.weights[size_t(k)] : 1.0f;
        const float coef = (c == Combiner::kSum || c == Combiner::kNone) ? w : (den == 0.0f ? 0.0f : w / den);
        const float* g;
        if (c != Combiner::kNone) {
          g = &p.grads[size_t(bag * dim)];
        } else if (p.shape.max_sequence_length == 0) {
          g = &p.grads[size_t(k * dim)];
        } else {
          const int64_t j = k - begin;
          if (j >= p.shape.max_sequence_length) break;  // truncated: never looked up
          g = &p.grads[size_t((bag * p.shape.max_sequence_length + j) * dim)];
        }
        fn(hb.ids[size_t(k)], coef, g);
      }
    }
  }
}

std::map<int64_t, std::vector<float>> SummedGradients(const std::vector<HostPart>& parts, int64_t dim) {
  std::map<int64_t, std::vector<float>> sums;
  ForEachOccurrence(parts, dim, [&](int64_t id, float coef, const float* g) {
    std::vector<float>& s = sums.try_emplace(id, std::vector<float>(size_t(dim), 0.0f)).first->second;
    for (int64_t d = 0; d < dim; ++d) s[size_t(d)] += coef * g[d];
  });
  return sums;
}

// The table's float state.
struct State {
  std::vector<float> w;
  std::vector<std::vector<float>> slots;
};

State StateOf(Table& t) {
  State s{Values(t), {}};
  for (size_t i = 0; i < t.num_slots(); ++i) s.slots.emplace_back(t.slot(i), t.slot(i) + t.rows() * t.slot_dim());
  return s;
}

ops::StepConstants Constants(const OptimizerSpec& o, float lr) {
  ops::StepConstants k;
  k.lr = lr;
  k.weight_decay = o.multiply_weight_decay_factor_by_learning_rate ? o.weight_decay_factor * lr : o.weight_decay_factor;
  k.clip_gradient = o.has_clipvalue;
  k.clip_gradient_min = o.clip_gradient_min;
  k.clip_gradient_max = o.clip_gradient_max;
  k.clip_weight_min = o.has_clip_weight_min;
  k.weight_min = o.clip_weight_min;
  k.clip_weight_max = o.has_clip_weight_max;
  k.weight_max = o.clip_weight_max;
  return k;
}

// Reference 1: the ops functors applied element by element (bit-exact).
template <typename Rule>
void ApplyRule(const Rule& rule, const ops::StepConstants& k, DType dt, int64_t dim, State& s, int64_t row,
               const float* g) {
  for (int64_t d = 0; d < dim; ++d) {
    const size_t i = size_t(row * dim + d);
    float* s0 = Rule::kSlots > 0 ? &s.slots[0][i] : nullptr;
    float* s1 = Rule::kSlots > 1 ? &s.slots[1][i] : nullptr;
    float w = s.w[i];
    ops::UpdateElement(rule, k, w, g ? g[d] : 0.0f, s0, s1);
    s.w[i] = RoundToStorage(dt, w);
  }
}

void FunctorStep(const TableSpec& spec, int64_t step_before, const std::map<int64_t, std::vector<float>>& sums,
                 float lr, State& s) {
  const OptimizerSpec& o = spec.optimizer;
  const ops::StepConstants k = Constants(o, lr);
  auto each = [&](const auto& rule) {
    for (const auto& [row, g] : sums) ApplyRule(rule, k, spec.dtype, spec.dim, s, row, g.data());
  };
  switch (o.kind) {
    case OptimizerSpec::Kind::kSGD:
      each(ops::SgdRule{lr});
      break;
    case OptimizerSpec::Kind::kAdagrad:
      each(ops::AdagradRule{lr, o.adagrad_epsilon});
      break;
    case OptimizerSpec::Kind::kRowwiseAdagrad: {
      // The row's clipped gradient squared and summed in column order, then each element.
      const ops::RowwiseAdagradRule rule{lr, o.adagrad_epsilon};
      for (const auto& [row, g] : sums) {
        std::vector<float> clipped(g);
        if (k.clip_gradient)
          for (float& x : clipped) x = ops::ClipGradient(k, x);
        float sum_square = 0.0f;
        for (float x : clipped) sum_square += x * x;
        const float m = rule.Multiplier(&s.slots[0][size_t(row)], sum_square / float(spec.dim));
        for (int64_t d = 0; d < spec.dim; ++d) {
          float& w = s.w[size_t(row * spec.dim + d)];
          w = RoundToStorage(spec.dtype, ops::RowwiseElement(rule, k, w, clipped[size_t(d)], m));
        }
      }
      break;
    }
    case OptimizerSpec::Kind::kAdam: {
      float lr_t = lr;
      if (o.bias_correction) {
        const double t = double(step_before + 1);
        lr_t = float(double(lr) * std::sqrt(1.0 - std::pow(double(o.beta_2), t)) / (1.0 - std::pow(double(o.beta_1), t)));
      }
      const ops::AdamRule rule{lr_t, o.beta_1, o.beta_2, o.epsilon, o.sum_inside_sqrt};
      each(rule);
      if (!o.lazy_adam)
        for (int64_t row = 0; row < spec.rows; ++row)
          if (!sums.count(row)) ApplyRule(rule, k, spec.dtype, spec.dim, s, row, nullptr);
      break;
    }
    case OptimizerSpec::Kind::kFTRL:
      each(ops::FtrlRule{lr, o.learning_rate_power, o.l1, o.l2, o.beta, o.multiply_linear_by_learning_rate});
      break;
  }
}

// Plain SGD on a float32 table applies each occurrence in turn instead of
// the summed gradient (ops::SgdInOrderElement; only the rounding differs).
bool InOrderSgd(const TableSpec& spec) {
  const OptimizerSpec& o = spec.optimizer;
  return o.kind == OptimizerSpec::Kind::kSGD && spec.dtype == DType::kFloat32 && !o.has_clipvalue &&
         o.weight_decay_factor == 0.0f && !o.has_clip_weight_min && !o.has_clip_weight_max;
}

// Reference 2: the formulas documented in ops/optimizers.h, in double.
void FormulaElement(const OptimizerSpec& o, double lr, int64_t t, double& w, double g, double& s0, double& s1) {
  if (o.has_clipvalue) g = std::min(std::max(g, double(o.clip_gradient_min)), double(o.clip_gradient_max));
  const double wd = o.multiply_weight_decay_factor_by_learning_rate ? double(o.weight_decay_factor) * lr
                                                                    : double(o.weight_decay_factor);
  w -= wd * w;
  switch (o.kind) {
    case OptimizerSpec::Kind::kSGD:
      w -= lr * g;
      break;
    case OptimizerSpec::Kind::kAdagrad:
      s0 += g * g;
      w -= lr * g / std::sqrt(s0);
      break;
    case OptimizerSpec::Kind::kRowwiseAdagrad:  // s0: the row's accumulator, already updated (CheckFormulas)
      w -= lr / (std::sqrt(s0) + double(o.adagrad_epsilon)) * g;
      break;
    case OptimizerSpec::Kind::kAdam: {
      const double b1 = o.beta_1, b2 = o.beta_2, eps = o.epsilon;
      s0 = b1 * s0 + (1 - b1) * g;
      s1 = b2 * s1 + (1 - b2) * g * g;
      const double lr_t = o.bias_correction ? lr * std::sqrt(1 - std::pow(b2, double(t))) / (1 - std::pow(b1, double(t))) : lr;
      w -= lr_t * s0 / (o.sum_inside_sqrt ? std::sqrt(s1 + eps * eps) : std::sqrt(s1) + eps);
      break;
    }
    case OptimizerSpec::Kind::kFTRL: {
      const double p = -double(o.learning_rate_power);
      const double an = s0 + g * g;
      const double sigma = (std::pow(an, p) - std::pow(s0, p)) / lr;
      const double q = (std::pow(an, p) + o.beta) / lr + 2 * double(o.l2);
      if (o.multiply_linear_by_learning_rate) {
        s1 += lr * (g - sigma * w);
        const double l1 = double(o.l1) * lr;
        w = std::fabs(s1) > l1 ? ((s1 > 0 ? l1 : -l1) - s1) / (q * lr) : 0.0;
      } else {
        s1 += g - sigma * w;
        const double l1 = o.l1;
        w = std::fabs(s1) > l1 ? ((s1 > 0 ? l1 : -l1) - s1) / q : 0.0;
      }
      s0 = an;
      break;
    }
  }
  if (o.has_clip_weight_min && w < o.clip_weight_min) w = o.clip_weight_min;
  if (o.has_clip_weight_max && w > o.clip_weight_max) w = o.clip_weight_max;
}

// Checks the table's state after a step against the formulas applied to the
// state before it; returns the number of elements out of tolerance.
int64_t CheckFormulas(const TableSpec& spec, int64_t step_before, const State& before, const State& after,
                      const std::map<int64_t, std::vector<float>>& sums, float lr, const std::string& what) {
  const OptimizerSpec& o = spec.optimizer;
  const double rel = spec.dtype == DType::kFloat32 ? 1e-4 : spec.dtype == DType::kFloat16 ? 2e-3 : 1e-2;
  const double abs = spec.dtype == DType::kFloat32 ? 1e-5 : 1e-4;
  // FTRL's linear is a difference of terms much larger than itself: its
  // float rounding is relative to those terms, not to the result.
  const double slot_abs = o.kind == OptimizerSpec::Kind::kFTRL ? 1e-5 : 1e-6;
  int64_t bad = 0;
  for (int64_t row = 0; row < spec.rows; ++row) {
    const auto it = sums.find(row);
    const bool touched = it != sums.end();
    const bool moves = touched || (o.kind == OptimizerSpec::Kind::kAdam && !o.lazy_adam);
    // Row-wise Adagrad: the row's accumulator gains the mean of its clipped squared gradient.
    const bool rowwise = o.kind == OptimizerSpec::Kind::kRowwiseAdagrad;
    double row_acc = rowwise ? before.slots[0][size_t(row)] : 0.0;
    if (rowwise && touched) {
      double sum_square = 0.0;
      for (float x : it->second) {
        const double g = o.has_clipvalue ? std::min(std::max(double(x), double(o.clip_gradient_min)),
                                                    double(o.clip_gradient_max))
                                         : double(x);
        sum_square += g * g;
      }
      row_acc += sum_square / double(spec.dim);
    }
    for (int64_t d = 0; d < spec.dim; ++d) {
      const size_t i = size_t(row * spec.dim + d);
      const size_t si = rowwise ? size_t(row) : i;  // a row-wise slot holds one value per row
      double w = before.w[i];
      double s0 = rowwise ? row_acc : before.slots.size() > 0 ? before.slots[0][si] : 0.0;
      double s1 = before.slots.size() > 1 ? before.slots[1][si] : 0.0;
      if (moves) FormulaElement(o, lr, step_before + 1, w, touched ? it->second[size_t(d)] : 0.0, s0, s1);
      bool ok = embedcore_test::Near(after.w[i], w, rel, abs);
      if (before.slots.size() > 0) ok = ok && embedcore_test::Near(after.slots[0][si], s0, 1e-4, slot_abs);
      if (before.slots.size() > 1) ok = ok && embedcore_test::Near(after.slots[1][si], s1, 1e-4, slot_abs);
      if (!ok && ++bad <= 3)
        embedcore_test::Fail(__FILE__, __LINE__,
                             what + ": row " + std::to_string(row) + " col " + std::to_string(d) + ": w " +
                                 embedcore_test::Show(after.w[i]) + " vs formula " + embedcore_test::Show(w) +
                                 "; slots " + (after.slots.size() > 0 ? embedcore_test::Show(after.slots[0][si]) : "") +
                                 " vs " + embedcore_test::Show(s0) + ", " +
                                 (after.slots.size() > 1 ? embedcore_test::Show(after.slots[1][si]) : "") + " vs " +
                                 embedcore_test::Show(s1));
    }
  }
  return bad;
}

// Runs `steps` random steps on a table built from `spec` and checks each
// against both references.
void CheckOptimizer(const TableSpec& spec, const std::string& what, uint32_t seed, int steps = 3) {
  std::mt19937 rng(seed);
  Table t(spec);
  for (int step = 0; step < steps; ++step) {
    // Two parts (two lookups of this table) in varied forms.
    std::vector<HostPart> parts;
    const Combiner pooled[] = {Combiner::kSum, Combiner::kMean, Combiner::kSqrtn};
    parts.push_back(RandomPart(rng, t, pooled[step % 3], 0, step % 2 == 0, step % 2 == 1));
    parts.push_back(step % 2 == 0 ? RandomPart(rng, t, Combiner::kNone, 0, true, false)
                                  : RandomPart(rng, t, Combiner::kNone, 3, true, true));
    const float lr = 0.05f * float(step + 1);
    const std::map<int64_t, std::vector<float>> sums = SummedGradients(parts, spec.dim);

    const State before = StateOf(t);
    State expected = before;
    const int64_t step_before = t.step();
    if (InOrderSgd(spec)) {  // each occurrence in turn (ops::SgdInOrderElement)
      ForEachOccurrence(parts, spec.dim, [&](int64_t id, float coef, const float* g) {
        for (int64_t d = 0; d < spec.dim; ++d) {
          float& w = expected.w[size_t(id * spec.dim + d)];
          w = w - lr * (coef * g[d]);
        }
      });
    } else {
      FunctorStep(spec, step_before, sums, lr, expected);
    }

    std::vector<GradientPart> views;
    for (const HostPart& p : parts) views.push_back(p.View());
    t.ApplyGradients(views, lr);
    EMBEDCORE_EXPECT_EQ(t.step(), step_before + 1);

    const State after = StateOf(t);
    const std::string label = what + " step " + std::to_string(step);
    EMBEDCORE_EXPECT_MSG(CountBitDiffs(after.w, expected.w) == 0,
                         label << ": values differ from the functor reference in "
                               << CountBitDiffs(after.w, expected.w) << " elements");
    for (size_t i = 0; i < after.slots.size(); ++i)
      EMBEDCORE_EXPECT_MSG(CountBitDiffs(after.slots[i], expected.slots[i]) == 0,
                           label << ": slot " << i << " differs from the functor reference");
    EMBEDCORE_EXPECT_EQ(CheckFormulas(spec, step_before, before, after, sums, lr, label), int64_t(0));
  }
}

constexpr DType kDTypes[] = {DType::kFloat32, DType::kFloat16, DType::kBFloat16};

}  // namespace

// ------------------------------------------------------------ names and specs
EMBEDCORE_TEST(DTypeAndCombinerNames) {
  EMBEDCORE_EXPECT_EQ(DTypeSize(DType::kFloat32), size_t(4));
  EMBEDCORE_EXPECT_EQ(DTypeSize(DType::kFloat16), size_t(2));
  EMBEDCORE_EXPECT_EQ(DTypeSize(DType::kBFloat16), size_t(2));
  for (DType d : kDTypes) EMBEDCORE_EXPECT(ParseDType(DTypeName(d)) == d);
  EMBEDCORE_EXPECT_EQ(std::string(DTypeName(DType::kBFloat16)), std::string("bfloat16"));
  EMBEDCORE_EXPECT_THROWS(ParseDType("float64", "TableConfig.dtype"), InvalidArgument, "TableConfig.dtype");
  EMBEDCORE_EXPECT_THROWS(ParseDType("Float32"), InvalidArgument, "'Float32'");
  EMBEDCORE_EXPECT_EQ(std::string(CombinerName(Combiner::kSum)), std::string("sum"));
  EMBEDCORE_EXPECT_EQ(std::string(CombinerName(Combiner::kMean)), std::string("mean"));
  EMBEDCORE_EXPECT_EQ(std::string(CombinerName(Combiner::kSqrtn)), std::string("sqrtn"));
  EMBEDCORE_EXPECT_EQ(std::string(CombinerName(Combiner::kNone)), std::string("none"));
}

EMBEDCORE_TEST(SlotNamesAndInitialSlots) {
  using K = OptimizerSpec::Kind;
  const std::vector<std::vector<std::string>> names = {
      {}, {"accumulators"}, {"momenta", "velocities"}, {"accumulators", "linears"}};
  const K kinds[] = {K::kSGD, K::kAdagrad, K::kAdam, K::kFTRL};
  for (int i = 0; i < 4; ++i) {
    TableSpec spec = MakeSpec(5, 3, DType::kFloat32, kinds[i]);
    spec.optimizer.initial_accumulator_value = 0.25f;
    EMBEDCORE_EXPECT(spec.optimizer.SlotNames() == names[size_t(i)]);
    Table t(spec);
    EMBEDCORE_EXPECT_EQ(t.num_slots(), names[size_t(i)].size());
    for (size_t s = 0; s < t.num_slots(); ++s) {
      const float want = names[size_t(i)][s] == "accumulators" ? 0.25f : 0.0f;
      for (int64_t e = 0; e < 15; ++e) EMBEDCORE_EXPECT_BITS_EQ(t.slot(s)[e], want);
    }
    EMBEDCORE_EXPECT_EQ(t.step(), int64_t(0));
  }
}

EMBEDCORE_TEST(ConstructorValidation) {
  EMBEDCORE_EXPECT_THROWS(Table(MakeSpec(0, 4)), InvalidArgument, "rows must be >= 1");
  EMBEDCORE_EXPECT_THROWS(Table(MakeSpec(4, 0)), InvalidArgument, "dim must be >= 1");
  EMBEDCORE_EXPECT_THROWS(Table(MakeSpec(-3, 4)), InvalidArgument, "rows");
  // rows * dim * 4 bytes overflows: refused before any allocation.
  EMBEDCORE_EXPECT_THROWS(Table(MakeSpec(int64_t(1) << 40, int64_t(1) << 30)), InvalidArgument, "overflows");

  using K = OptimizerSpec::Kind;
  struct Bad {
    K kind;
    void (*set)(OptimizerSpec&);
    const char* field;
  };
  const Bad bad[] = {
      {K::kAdagrad, [](OptimizerSpec& o) { o.initial_accumulator_value = 0.0f; }, "initial_accumulator_value"},
      {K::kFTRL, [](OptimizerSpec& o) { o.initial_accumulator_value = -1.0f; }, "initial_accumulator_value"},
      {K::kAdam, [](OptimizerSpec& o) { o.beta_1 = 1.0f; }, "beta_1"},
      {K::kAdam, [](OptimizerSpec& o) { o.beta_2 = -0.1f; }, "beta_2"},
      {K::kAdam, [](OptimizerSpec& o) { o.epsilon = 0.0f; }, "epsilon"},
      {K::kFTRL, [](OptimizerSpec& o) { o.learning_rate_power = 0.5f; }, "learning_rate_power"},
      {K::kFTRL, [](OptimizerSpec& o) { o.l1 = -1.0f; }, "l1"},
      {K::kFTRL, [](OptimizerSpec& o) { o.l2 = -1.0f; }, "l2"},
      {K::kFTRL, [](OptimizerSpec& o) { o.beta = -1.0f; }, "beta"},
      {K::kSGD,
       [](OptimizerSpec& o) {
         o.has_clip_weight_min = o.has_clip_weight_max = true;
         o.clip_weight_min = 1.0f;
         o.clip_weight_max = 0.0f;
       },
       "clip_weight_min"},
      {K::kSGD,
       [](OptimizerSpec& o) {
         o.has_clipvalue = true;
         o.clip_gradient_min = 1.0f;
         o.clip_gradient_max = -1.0f;
       },
       "clipvalue"},
      {K::kSGD, [](OptimizerSpec& o) { o.weight_decay_factor = -0.1f; }, "weight_decay_factor"},
      {K::kSGD, [](OptimizerSpec& o) { o.weight_decay_factor = std::nanf(""); }, "weight_decay_factor"},
      // Whatever the optimizer, no option may be infinite: a manifest could not record it.
      {K::kSGD, [](OptimizerSpec& o) { o.l2 = INFINITY; }, "l2_regularization_strength must be finite"},
      {K::kFTRL, [](OptimizerSpec& o) { o.learning_rate_power = -INFINITY; }, "learning_rate_power must be finite"},
      {K::kSGD,
       [](OptimizerSpec& o) {
         o.has_clipvalue = true;
         o.clip_gradient_min = -INFINITY;
         o.clip_gradient_max = INFINITY;
       },
       "clipvalue min must be finite (within float32's range), got -inf"},
      {K::kAdagrad, [](OptimizerSpec& o) { o.initial_accumulator_value = static_cast<float>(1e-46); }, "got 0"},
  };
  for (const Bad& b : bad) {
    TableSpec spec = MakeSpec(4, 4, DType::kFloat32, b.kind);
    b.set(spec.optimizer);
    EMBEDCORE_EXPECT_THROWS(spec.optimizer.Validate(), InvalidArgument, b.field);
    EMBEDCORE_EXPECT_THROWS(Table{spec}, InvalidArgument, b.field);
  }
  // Options of other optimizers are not checked: SGD ignores Adam's betas.
  TableSpec ok = MakeSpec(4, 4, DType::kFloat32, K::kSGD);
  ok.optimizer.beta_1 = 7.0f;
  EMBEDCORE_EXPECT_NO_THROW(Table{ok});
}

// An initializer whose values could round to infinity in the table's dtype
// is refused (a table, and its checkpoint, holds finite values only): by the
// largest magnitude it can give, Normal's from the largest draw of its
// Box-Muller (Open01's smallest value, 2^-54).
EMBEDCORE_TEST(InitializersBeyondTheDtypeAreRefused) {
  using K = InitializerSpec::Kind;
  EMBEDCORE_EXPECT_NEAR(internal::LargestStandardNormal(), std::sqrt(108.0 * std::log(2.0)), 1e-15, 0.0);  // 8.6522
  auto spec = [](DType dtype, K kind, double a, double b, int64_t dim = 4) {
    TableSpec s = MakeSpec(64, dim, dtype);
    s.initializer.kind = kind;
    s.initializer.a = a;
    s.initializer.b = b;
    return s;
  };
  struct Case {
    DType dtype;
    K kind;
    double a, b;
    const char* message;  // nullptr: accepted
  };
  const double z = internal::LargestStandardNormal();
  const Case cases[] = {
      {DType::kFloat16, K::kConstant, 70000, 0,
       "table 't': initializer Constant(value=70000) gives values up to 70000 in magnitude (|value|), which round "
       "to infinity in its dtype float16 (largest finite value 65504)"},
      {DType::kFloat16, K::kConstant, -65520, 0, "Constant(value=-65520)"},  // the tie rounds to infinity
      {DType::kFloat16, K::kConstant, -65519.99, 0, nullptr},                 // rounds to -65504
      {DType::kBFloat16, K::kConstant, 70000, 0, nullptr},
      {DType::kFloat32, K::kConstant, 1e300, 0, "Constant(value=1e+300) gives values up to 1e+300"},
      {DType::kFloat16, K::kUniform, -1e5, 1e5, "Uniform(low=-100000, high=100000) gives values up to 100000 in "
                                                "magnitude (max(|low|, |high|))"},
      {DType::kFloat16, K::kUniform, -70000, 1, "Uniform(low=-70000, high=1)"},
      {DType::kFloat16, K::kUniform, -65504, 65504, nullptr},
      {DType::kFloat32, K::kNormal, 0, 1e38,
       "Normal(mean=0, stddev=1e+38) gives values up to 8.65216132e+38 in magnitude (|mean| + 8.65216132 stddev, "
       "the largest of its normal draws), which round to infinity in its dtype float32"},
      {DType::kFloat32, K::kNormal, 0, 3.4e38 / z, nullptr},
      {DType::kFloat32, K::kNormal, 0, 3.41e38 / z, "Normal(mean=0, stddev="},
      {DType::kFloat16, K::kNormal, 65000, 61, "|mean| + 8.65216132 stddev"},  // 65527.8: infinity (from 65520 on)
      {DType::kFloat16, K::kNormal, 65000, 60, nullptr},                          // 65519.1 rounds to 65504
      {DType::kFloat16, K::kNormal, 65516, 0, "Normal(mean=65516, stddev=0.5 = 1/sqrt(dim))"},  // dim 4: 65520.3
      {DType::kFloat16, K::kTruncatedNormal, 65000, 300, "TruncatedNormal(mean=65000, stddev=300) gives values up to "
                                                         "65600 in magnitude (|mean| + 2 stddev)"},
      {DType::kFloat16, K::kTruncatedNormal, -65000, 250, nullptr},
      {DType::kBFloat16, K::kTruncatedNormal, 0, 1.7e38, "bfloat16 (largest finite value 3.38953139e+38)"},
      {DType::kFloat32, K::kZeros, 0, 0, nullptr},
  };
  for (const Case& c : cases) {
    const TableSpec s = spec(c.dtype, c.kind, c.a, c.b);
    if (c.message == nullptr) {
      Table t(s);  // every value finite
      std::vector<float> v(size_t(64 * 4));
      t.ReadValues(0, 64, v.data());
      for (float x : v) EMBEDCORE_EXPECT(std::isfinite(x));
    } else {
      EMBEDCORE_EXPECT_THROWS(Table{s}, InvalidArgument, c.message);
    }
  }
  // The default stddev is of the whole table's width, as its values are: a column shard 2 wide of a table
  // 100 wide draws with stddev 0.1 (65519.87 rounds to 65504), a table 2 wide with 0.707 (65525.1: infinity).
  TableSpec shard = spec(DType::kFloat16, K::kNormal, 65519, 0, 2);
  shard.full_dim = 100;
  shard.shard_col_start = 10;
  EMBEDCORE_EXPECT_NO_THROW(Table{shard});
  EMBEDCORE_EXPECT_THROWS(Table{spec(DType::kFloat16, K::kNormal, 65519, 0, 2)}, InvalidArgument,
                          "Normal(mean=65519, stddev=0.707106781 = 1/sqrt(dim))");
  shard.initializer.a = 65519.2;  // 65520.07: infinity
  EMBEDCORE_EXPECT_THROWS(Table{shard}, InvalidArgument, "Normal(mean=65519.2, stddev=0.1 = 1/sqrt(dim))");
}

EMBEDCORE_TEST(AnOutOfRangeIdIsNamedAsTheCheckReadIt) {
  // Another thread flips one id between out of range and in range while batches are checked: each refusal
  // names the out-of-range value the check read (it read the id again for the message, which could then be
  // in range: "id 1 ... is out of range [0, 1000)").
  const int64_t rows = 1000, n = int64_t(1) << 18, at = n - 1;
  std::vector<int64_t> ids(size_t(n), 1), offsets = {0, n};
  std::atomic<bool> stop{false};
  std::thread writer([&] {
    while (!stop.load(std::memory_order_relaxed)) {
      __atomic_store_n(&ids[size_t(at)], rows + 7, __ATOMIC_RELAXED);
      __atomic_store_n(&ids[size_t(at)], int64_t(1), __ATOMIC_RELAXED);
    }
  });
  int refused = 0;
  for (int i = 0; i < 400; ++i) {
    try {
      ValidateBatch(embedcore_test::MakeBatch(ids, offsets), rows, "t");
    } catch (const OutOfRange& e) {
      ++refused;
      EMBEDCORE_EXPECT_EQ(std::string(e.what()), "table 't': id 1007 at position " + std::to_string(at) +
                                                     " of ids is out of range [0, 1000)");
    }
  }
  stop = true;
  writer.join();
  EMBEDCORE_EXPECT(refused > 0);  // (the writer ran during the checks)
}

EMBEDCORE_TEST(OutputRows) {
  HostBatch hb;
  hb.AddBag({1, 2, 3});
  hb.AddBag({});
  hb.AddBag({4});
  const Batch b = hb.View();
  EMBEDCORE_EXPECT_EQ((OutputShape{Combiner::kSum, 0}.OutputRows(b)), int64_t(3));
  EMBEDCORE_EXPECT_EQ((OutputShape{Combiner::kMean, 7}.OutputRows(b)), int64_t(3));  // L ignored when pooled
  EMBEDCORE_EXPECT_EQ((OutputShape{Combiner::kNone, 0}.OutputRows(b)), int64_t(4));
  EMBEDCORE_EXPECT_EQ((OutputShape{Combiner::kNone, 5}.OutputRows(b)), int64_t(15));
}

EMBEDCORE_TEST(BuildInfo) {
  const embedcore::BuildInfo info = GetBuildInfo();
  EMBEDCORE_EXPECT_EQ(info.version, std::string(EMBEDCORE_VERSION_STRING));
  EMBEDCORE_EXPECT(!info.cuda);
  EMBEDCORE_EXPECT(!info.simd.empty());
  EMBEDCORE_EXPECT(!info.compiler.empty());
}

// ------------------------------------------------------------ lookup
EMBEDCORE_TEST(LookupPooledMatchesReference) {
  std::mt19937 rng(1);
  for (DType dt : kDTypes) {
    for (int64_t dim : {1, 8, 13, 64}) {
      Table t(MakeSpec(300, dim, dt));
      for (bool weighted : {false, true}) {
        for (bool int32 : {false, true}) {
          HostBatch hb = RandomBatch(rng, 50, 9, t.rows(), weighted, int32);
          hb.AddBag({});  // an empty bag at the end as well
          for (Combiner c : {Combiner::kSum, Combiner::kMean, Combiner::kSqrtn}) {
            const OutputShape shape{c, 0};
            std::vector<float> out(size_t(hb.bags() * dim), -7.0f);
            t.Lookup(hb.View(), shape, out.data());
            EMBEDCORE_EXPECT_MSG(CountBitDiffs(out, RefLookup(t, hb, shape)) == 0,
                                 DTypeName(dt) << " dim " << dim << " " << CombinerName(c)
                                               << (weighted ? " weighted" : "") << (int32 ? " int32" : " int64"));
            // Empty bags give zeros.
            for (int64_t b = 0; b < hb.bags(); ++b)
              if (hb.offsets[size_t(b)] == hb.offsets[size_t(b) + 1])
                for (int64_t d = 0; d < dim; ++d) EMBEDCORE_EXPECT_BITS_EQ(out[size_t(b * dim + d)], 0.0f);
          }
        }
      }
    }
  }
}

EMBEDCORE_TEST(PooledLookupWritesItsColumnsOfAWiderOutput) {
  // out_stride: each bag's row lands at out + b * stride, the same bits as a
  // contiguous lookup, and no other column is written.
  std::mt19937 rng(7);
  for (DType dt : kDTypes) {
    for (int64_t dim : {1, 8, 13, 64}) {
      Table t(MakeSpec(200, dim, dt));
      const HostBatch hb = RandomBatch(rng, 40, 9, t.rows(), true, false);
      for (Combiner c : {Combiner::kSum, Combiner::kMean, Combiner::kSqrtn}) {
        const int64_t stride = dim + 5, col = 3;
        std::vector<float> wide(size_t(hb.bags() * stride + col), -7.0f), want(size_t(hb.bags() * dim));
        t.Lookup(hb.View(), OutputShape{c, 0, stride}, wide.data() + col);
        t.Lookup(hb.View(), OutputShape{c, 0}, want.data());
        int64_t diffs = 0, touched = 0;
        for (int64_t b = 0; b < hb.bags(); ++b)
          for (int64_t j = 0; j < stride; ++j) {
            const float v = wide[size_t(b * stride + col + j)];
            if (j < dim) diffs += Bits(v) != Bits(want[size_t(b * dim + j)]);
            else touched += v != -7.0f;
          }
        for (int64_t j = 0; j < col; ++j) touched += wide[size_t(j)] != -7.0f;
        EMBEDCORE_EXPECT_MSG(diffs == 0 && touched == 0, DTypeName(dt) << " dim " << dim << " " << CombinerName(c)
                                                                       << ": " << diffs << " differ, " << touched
                                                                       << " written outside");
      }
    }
  }
  Table t(MakeSpec(10, 4));
  HostBatch hb;
  hb.AddBag({1, 2});
  std::vector<float> out(16, 0.0f);
  EMBEDCORE_EXPECT_THROWS(t.Lookup(hb.View(), OutputShape{Combiner::kSum, 0, 3}, out.data()), InvalidArgument,
                          "out_stride must be 0 or at least the table's dim 4, got 3");
  EMBEDCORE_EXPECT_THROWS(t.Lookup(hb.View(), OutputShape{Combiner::kNone, 0, 8}, out.data()), InvalidArgument,
                          "only pooled lookups");
  EMBEDCORE_EXPECT_THROWS(t.Lookup(hb.View(), OutputShape{Combiner::kSum, 0, -1}, out.data()), InvalidArgument,
                          "out_stride must be 0 or at least");
}

EMBEDCORE_TEST(LookupSequencesMatchReference) {
  std::mt19937 rng(2);
  for (DType dt : kDTypes) {
    Table t(MakeSpec(100, 11, dt));
    for (bool weighted : {false, true}) {
      const HostBatch hb = RandomBatch(rng, 30, 8, t.rows(), weighted, false);
      for (int64_t len : {0, 1, 5, 8, 20}) {
        const OutputShape shape{Combiner::kNone, len};
        std::vector<float> out(size_t(shape.OutputRows(hb.View()) * t.dim()), -7.0f);
        t.Lookup(hb.View(), shape, out.data());
        EMBEDCORE_EXPECT_MSG(CountBitDiffs(out, RefLookup(t, hb, shape)) == 0,
                             DTypeName(dt) << " L " << len << (weighted ? " weighted" : ""));
      }
    }
  }
}

EMBEDCORE_TEST(LookupOfEmptyBatches) {
  Table t(MakeSpec(10, 4));
  HostBatch none;  // zero bags
  EMBEDCORE_EXPECT_NO_THROW(t.Lookup(none.View(), OutputShape{Combiner::kSum, 0}, nullptr));
  EMBEDCORE_EXPECT_NO_THROW(t.Lookup(none.View(), OutputShape{Combiner::kNone, 0}, nullptr));
  EMBEDCORE_EXPECT_NO_THROW(t.Lookup(none.View(), OutputShape{Combiner::kNone, 3}, nullptr));
  HostBatch empty_bags;
  empty_bags.AddBag({});
  empty_bags.AddBag({});
  std::vector<float> out(2 * 4, -7.0f);
  t.Lookup(empty_bags.View(), OutputShape{Combiner::kMean, 0}, out.data());
  for (float v : out) EMBEDCORE_EXPECT_BITS_EQ(v, 0.0f);
  EMBEDCORE_EXPECT_NO_THROW(t.Lookup(empty_bags.View(), OutputShape{Combiner::kNone, 0}, nullptr));  // [0, dim]
}

EMBEDCORE_TEST(LookupGroupedEqualsLookupThenAdds) {
  // Through the table (validation, threads): row g = bag sums of its group added in order.
  std::mt19937 rng(31);
  for (bool int32 : {false, true}) {
    Table t(MakeSpec(300, 24));
    const HostBatch hb = RandomBatch(rng, 3000, 7, 300, true, int32);
    std::vector<int64_t> groups{0};
    while (groups.back() < 3000) groups.push_back(std::min<int64_t>(3000, groups.back() + int64_t(rng() % 6)));
    const int64_t ng = int64_t(groups.size()) - 1;
    std::vector<float> bags(3000 * 24), want(size_t(ng) * 24, 0.0f), got(size_t(ng) * 24, -7.0f);
    t.Lookup(hb.View(), OutputShape{Combiner::kSum, 0}, bags.data());
    for (int64_t g = 0; g < ng; ++g)
      for (int64_t k = groups[size_t(g)]; k < groups[size_t(g) + 1]; ++k)
        for (int64_t d = 0; d < 24; ++d) {
          float& o = want[size_t(g * 24 + d)];
          o = k == groups[size_t(g)] ? bags[size_t(k * 24 + d)] : o + bags[size_t(k * 24 + d)];
        }
    SetNumThreads(2);
    t.LookupGrouped(hb.View(), groups.data(), ng, got.data());
    SetNumThreads(1);
    for (size_t i = 0; i < got.size(); ++i) EMBEDCORE_EXPECT_BITS_EQ(got[i], want[i]);
  }
}

EMBEDCORE_TEST(LookupSparseSegmentAddsAndDividesAsTensorFlow) {
  // Every bag length 0..41 (below 10, n % 8 == 0 and 1, the rest), written out
  // in TensorFlow's order: rows [0, r), then groups of 8 each summed from zero.
  std::mt19937 rng(41);
  Table t(MakeSpec(200, 11));
  const std::vector<float> w = Values(t);
  for (bool int32 : {false, true}) {
    HostBatch hb;
    hb.int32 = int32;
    for (int64_t n = 41; n >= 0; --n) {
      std::vector<int64_t> bag(static_cast<size_t>(n), 0);
      for (auto& id : bag) id = int64_t(rng() % 200);
      hb.AddBag(bag);
    }
    for (Combiner c : {Combiner::kSum, Combiner::kMean, Combiner::kSqrtn}) {
      std::vector<float> got(size_t(hb.bags()) * 11, -5.0f);
      SetNumThreads(3);
      t.LookupSparseSegment(hb.View(), c, got.data());
      SetNumThreads(1);
      for (int64_t b = 0; b < hb.bags(); ++b) {
        const int64_t begin = hb.offsets[size_t(b)], n = hb.offsets[size_t(b) + 1] - begin;
        const int64_t r = n < 10 ? n : n % 8 == 0 ? 8 : n % 8 == 1 ? 9 : n % 8;
        for (int64_t d = 0; d < 11; ++d) {
          auto row = [&](int64_t k) { return w[size_t(hb.ids[size_t(begin + k)] * 11 + d)]; };
          float acc = 0.0f;
          for (int64_t k = 0; k < r; ++k) acc = k == 0 ? row(k) : acc + row(k);
          for (int64_t g = r; g < n; g += 8) {
            float part = row(g);
            for (int64_t k = g + 1; k < g + 8; ++k) part += row(k);
            acc += part;
          }
          if (c != Combiner::kSum && n > 0) {
            const float den = c == Combiner::kMean ? float(n) : float(std::sqrt(double(n)));
            acc = n < 10 ? acc * (1.0f / den) : acc / den;
          }
          EMBEDCORE_EXPECT_BITS_EQ(got[size_t(b * 11 + d)], acc);
        }
      }
    }
  }
  // Weights, unpooled output and a bad id are refused.
  HostBatch hb;
  hb.AddBag({1, 2}, {0.5f, 2.0f});
  hb.weighted = true;
  std::vector<float> out(11);
  EMBEDCORE_EXPECT_THROWS(t.LookupSparseSegment(hb.View(), Combiner::kSum, out.data()), InvalidArgument, "weights");
  hb.weighted = false;
  EMBEDCORE_EXPECT_THROWS(t.LookupSparseSegment(hb.View(), Combiner::kNone, out.data()), InvalidArgument, "combiner");
  hb.ids[1] = 200;
  EMBEDCORE_EXPECT_THROWS(t.LookupSparseSegment(hb.View(), Combiner::kSum, out.data()), OutOfRange, "200");
}

EMBEDCORE_TEST(StagedCallsOnAHostTableAreTheDirectOnes) {
  // LookupStaged / ApplyGradientsStaged take host arrays for a table anywhere;
  // a host table runs the ordinary calls (a device one: tests/python/test_cuda.py).
  std::mt19937 rng(37);
  Table a(MakeSpec(60, 9, DType::kFloat32, OptimizerSpec::Kind::kAdagrad)),
      b(MakeSpec(60, 9, DType::kFloat32, OptimizerSpec::Kind::kAdagrad));
  for (int step = 0; step < 3; ++step) {
    const HostPart part = RandomPart(rng, a, Combiner::kMean, 0, true, step == 1);
    const int64_t n = part.shape.OutputRows(part.batch.View()) * a.dim();
    std::vector<float> got(size_t(n), -3.0f), want(size_t(n), -4.0f);
    a.Lookup(part.batch.View(), part.shape, want.data());
    b.LookupStaged(part.batch.View(), part.shape, got.data());
    for (size_t i = 0; i < got.size(); ++i) EMBEDCORE_EXPECT_BITS_EQ(got[i], want[i]);
    a.ApplyGradients({part.View()}, 0.1f);
    b.ApplyGradientsStaged({part.View()}, 0.1f);
  }
  EMBEDCORE_EXPECT(Values(a) == Values(b));
  EMBEDCORE_EXPECT_EQ(b.step(), 3);
  // The same validation: a bad id changes nothing.
  HostPart bad = RandomPart(rng, a, Combiner::kSum, 0, false, false);
  EMBEDCORE_EXPECT(!bad.batch.ids.empty());
  if (!bad.batch.ids.empty()) bad.batch.ids[0] = 60;
  const std::vector<float> before = Values(b);
  bool threw = false;
  try {
    b.ApplyGradientsStaged({bad.View()}, 0.1f);
  } catch (const OutOfRange&) {
    threw = true;
  }
  EMBEDCORE_EXPECT(threw);
  EMBEDCORE_EXPECT(Values(b) == before);
}

EMBEDCORE_TEST(LookupGroupedValidation) {
  Table t(MakeSpec(10, 4));
  HostBatch hb;
  hb.AddBag({1, 2});
  hb.AddBag({});
  hb.AddBag({3});
  std::vector<float> out(3 * 4, -7.0f);
  const std::vector<float> sentinel = out;
  const int64_t ends_short[] = {0, 2}, decreasing[] = {0, 2, 1, 3}, late_start[] = {1, 3}, good[] = {0, 2, 3};
  EMBEDCORE_EXPECT_THROWS(t.LookupGrouped(hb.View(), ends_short, 1, out.data()), InvalidArgument,
                          "groups must end at the number of bags, 3, got groups[1] = 2");
  EMBEDCORE_EXPECT_THROWS(t.LookupGrouped(hb.View(), decreasing, 3, out.data()), InvalidArgument,
                          "groups[1] = 2 > groups[2] = 1");
  EMBEDCORE_EXPECT_THROWS(t.LookupGrouped(hb.View(), late_start, 1, out.data()), InvalidArgument,
                          "groups[0] must be 0, got 1");
  EMBEDCORE_EXPECT_THROWS(t.LookupGrouped(hb.View(), good, -1, out.data()), InvalidArgument, "negative");
  EMBEDCORE_EXPECT_THROWS(t.LookupGrouped(hb.View(), nullptr, 2, out.data()), InvalidArgument, "null");
  EMBEDCORE_EXPECT_THROWS(t.LookupGrouped(hb.View(), good, 2, nullptr), InvalidArgument, "out: null");
  HostBatch bad = hb;
  bad.ids[1] = 10;
  EMBEDCORE_EXPECT_THROWS(t.LookupGrouped(bad.View(), good, 2, out.data()), OutOfRange, "id 10 at position 1");
  EMBEDCORE_EXPECT(out == sentinel);  // nothing written
  t.LookupGrouped(hb.View(), good, 2, out.data());
  EMBEDCORE_EXPECT(out != sentinel);
}

EMBEDCORE_TEST(LookupValidation) {
  Table t(MakeSpec(10, 4));
  const std::vector<float> sentinel(4 * 4, -7.0f);
  std::vector<float> out = sentinel;
  const OutputShape sum{Combiner::kSum, 0};

  HostBatch hb;
  hb.AddBag({1, 2});
  hb.AddBag({10});  // == rows
  EMBEDCORE_EXPECT_THROWS(t.Lookup(hb.View(), sum, out.data()), OutOfRange, "id 10 at position 2");
  EMBEDCORE_EXPECT_THROWS(t.Lookup(hb.View(), sum, out.data()), OutOfRange, "table 't'");
  EMBEDCORE_EXPECT_THROWS(t.Lookup(hb.View(), sum, out.data()), OutOfRange, "[0, 10)");
  hb.int32 = true;
  EMBEDCORE_EXPECT_THROWS(t.Lookup(hb.View(), sum, out.data()), OutOfRange, "id 10");
  EMBEDCORE_EXPECT(out == sentinel);  // nothing written

  HostBatch neg;
  neg.AddBag({3, -1});
  EMBEDCORE_EXPECT_THROWS(t.Lookup(neg.View(), sum, out.data()), OutOfRange, "id -1 at position 1");
  HostBatch big;
  big.AddBag({int64_t(1) << 40});  // does not fit int32 either: only int64 can say it
  EMBEDCORE_EXPECT_THROWS(t.Lookup(big.View(), sum, out.data()), OutOfRange, "1099511627776");

  // A large batch with one bad id deep inside (the parallel check).
  HostBatch many;
  std::vector<int64_t> ids(200000, 3);
  ids[123456] = 99;
  many.AddBag(ids);
  std::vector<float> one(4);
  EMBEDCORE_EXPECT_THROWS(t.Lookup(many.View(), sum, one.data()), OutOfRange, "id 99 at position 123456");

  // Malformed offsets.
  HostBatch ok;
  ok.AddBag({1, 2});
  ok.AddBag({3});
  Batch b = ok.View();
  const int64_t bad_start[] = {1, 2, 3};
  b.offsets = bad_start;
  EMBEDCORE_EXPECT_THROWS(t.Lookup(b, sum, out.data()), InvalidArgument, "offsets[0] must be 0");
  const int64_t decreasing[] = {0, 2, 1};
  b.offsets = decreasing;
  EMBEDCORE_EXPECT_THROWS(t.Lookup(b, sum, out.data()), InvalidArgument, "non-decreasing");
  const int64_t short_end[] = {0, 1, 2};
  b.offsets = short_end;
  EMBEDCORE_EXPECT_THROWS(t.Lookup(b, sum, out.data()), InvalidArgument, "must end at the number of ids, 3");
  b.offsets = nullptr;
  EMBEDCORE_EXPECT_THROWS(t.Lookup(b, sum, out.data()), InvalidArgument, "offsets: null");
  b = ok.View();
  b.ids = nullptr;
  EMBEDCORE_EXPECT_THROWS(t.Lookup(b, sum, out.data()), InvalidArgument, "ids: null");
  b = ok.View();
  b.nnz = -1;
  EMBEDCORE_EXPECT_THROWS(t.Lookup(b, sum, out.data()), InvalidArgument, "negative");
  EMBEDCORE_EXPECT_THROWS(t.Lookup(ok.View(), sum, nullptr), InvalidArgument, "out: null");
  EMBEDCORE_EXPECT_THROWS(t.Lookup(ok.View(), (OutputShape{Combiner::kNone, -1}), out.data()), InvalidArgument,
                          "max_sequence_length");
  EMBEDCORE_EXPECT(out == sentinel);
  // ValidateBatch is public too.
  EMBEDCORE_EXPECT_THROWS(ValidateBatch(hb.View(), 10, "named"), OutOfRange, "table 'named'");
  EMBEDCORE_EXPECT_NO_THROW(ValidateBatch(ok.View(), 10, "named"));
  // Counts that no array can have are refused before any pointer is computed
  // from them: offsets + num_bags + 1 overflowed (INT64_MAX) or wrapped round
  // to a pointer inside the array (2^61 x 8 bytes), then offsets were read far
  // past their end.
  for (const int64_t n : {INT64_MAX, int64_t(1) << 61, internal::kMaxBatchCount + 1}) {
    b = ok.View();
    b.num_bags = n;
    const std::string bags = "num_bags = " + std::to_string(n) + " is a size that overflows int64";
    EMBEDCORE_EXPECT_THROWS(t.Lookup(b, (OutputShape{Combiner::kNone, 0}), out.data()), InvalidArgument, bags);
    EMBEDCORE_EXPECT_THROWS(t.Lookup(b, sum, out.data()), InvalidArgument, bags);
    EMBEDCORE_EXPECT_THROWS(ValidateBatch(b, 10, "named"), InvalidArgument, bags);
    b = ok.View();
    b.nnz = n;
    const std::string ids = "nnz = " + std::to_string(n) + " is a size that overflows int64";
    EMBEDCORE_EXPECT_THROWS(t.Lookup(b, (OutputShape{Combiner::kNone, 0}), out.data()), InvalidArgument, ids);
    EMBEDCORE_EXPECT_THROWS(ValidateBatch(b, 10, "named"), InvalidArgument, ids);
  }
  EMBEDCORE_EXPECT(out == sentinel);
}

// ------------------------------------------------------------ updates
EMBEDCORE_TEST(SgdMatchesReferences) {
  for (DType dt : kDTypes) CheckOptimizer(MakeSpec(40, 9, dt, OptimizerSpec::Kind::kSGD), std::string("SGD ") + DTypeName(dt), 10);
}

EMBEDCORE_TEST(AdagradMatchesReferences) {
  for (DType dt : kDTypes) {
    TableSpec spec = MakeSpec(40, 9, dt, OptimizerSpec::Kind::kAdagrad);
    spec.optimizer.initial_accumulator_value = 0.3f;
    CheckOptimizer(spec, std::string("Adagrad ") + DTypeName(dt), 11);
  }
}

EMBEDCORE_TEST(RowwiseAdagradMatchesReferences) {
  for (DType dt : kDTypes) {
    for (float eps : {0.0f, 1e-8f, 0.5f}) {
      TableSpec spec = MakeSpec(40, 9, dt, OptimizerSpec::Kind::kRowwiseAdagrad);
      spec.optimizer.initial_accumulator_value = 0.3f;
      spec.optimizer.adagrad_epsilon = eps;
      CheckOptimizer(spec, std::string("row-wise Adagrad ") + DTypeName(dt) + " eps " + std::to_string(eps), 15);
    }
  }
  // Wide rows: the tail past the kernels' whole vectors, and a row of several column blocks.
  CheckOptimizer(MakeSpec(20, 133, DType::kFloat32, OptimizerSpec::Kind::kRowwiseAdagrad), "row-wise dim 133", 16);
}

// The slots' domains: accumulators and velocities are square-rooted (>= 0);
// an accumulator of 0 where nothing is added to its root (Adagrad with
// epsilon 0, FTRL) makes a zero gradient's step 0 / 0, so it must be > 0.
// AssignSlot refuses a value outside them and changes nothing.
EMBEDCORE_TEST(AssignSlotKeepsSlotsInTheOptimizersDomain) {
  struct Case {
    OptimizerSpec::Kind kind;
    float adagrad_epsilon;
    size_t slot;
    float refused, accepted;
    const char* message;
  };
  const Case cases[] = {
      {OptimizerSpec::Kind::kAdagrad, 0.0f, 0, 0.0f, 1e-30f,
       "slot accumulators values[1, 0] = 0 (table row 2) is not >= 1.17549435e-38"},
      // A subnormal accumulator (or epsilon) is 0 where subnormals are flushed to zero.
      {OptimizerSpec::Kind::kAdagrad, 1e-40f, 0, 1e-40f, 1.17549435e-38f, "is not >= 1.17549435e-38"},
      {OptimizerSpec::Kind::kAdagrad, 1e-10f, 0, -1e-30f, 0.0f, "is not >= 0"},
      {OptimizerSpec::Kind::kRowwiseAdagrad, 0.0f, 0, 0.0f, 1.0f,
       "slot row_accumulators values[1, 0] = 0 (table row 2)"},
      {OptimizerSpec::Kind::kRowwiseAdagrad, 1e-8f, 0, -2.0f, 0.0f, "is not >= 0"},
      {OptimizerSpec::Kind::kFTRL, 1e-10f, 0, 0.0f, 1e-30f, "FTRL divides by a power of the accumulator"},
      {OptimizerSpec::Kind::kFTRL, 1e-10f, 0, 1e-40f, 1.17549435e-38f, "or a subnormal, flushed to 0"},
      // linears: any value
      {OptimizerSpec::Kind::kFTRL, 0.0f, 1, std::nanf(""), -5.0f, "slot linears values[1, 0] = nan (table row 2)"},
      {OptimizerSpec::Kind::kAdam, 0.0f, 1, -1.0f, 0.0f, "slot velocities values[1, 0] = -1 (table row 2) is not >= 0"},
      // momenta: any value
      {OptimizerSpec::Kind::kAdam, 0.0f, 0, INFINITY, -3.0f, "slot momenta values[1, 0] = inf (table row 2)"},
  };
  for (const Case& c : cases) {
    TableSpec spec = MakeSpec(6, 4, DType::kFloat32, c.kind);
    spec.optimizer.adagrad_epsilon = c.adagrad_epsilon;
    Table t(spec);
    const int64_t cols = t.slot_dim();
    std::vector<float> src(size_t(2 * cols), 0.5f);
    src[size_t(std::min<int64_t>(4, 2 * cols - 1))] = c.refused;
    const Snapshot before = Take(t);
    EMBEDCORE_EXPECT_THROWS(t.AssignSlot(c.slot, 1, 2, src.data()), InvalidArgument,
                            c.message);
    EMBEDCORE_EXPECT(Take(t) == before);
    src[size_t(std::min<int64_t>(4, 2 * cols - 1))] = c.accepted;
    EMBEDCORE_EXPECT_NO_THROW(t.AssignSlot(c.slot, 1, 2, src.data()));
    const OptimizerSpec::SlotBound b = spec.optimizer.SlotLowerBound(c.slot);
    EMBEDCORE_EXPECT(b.Admits(c.accepted) && !(b.bounded && b.Admits(c.refused)));
  }
  EMBEDCORE_EXPECT(!OptimizerSpec{}.SlotLowerBound(0).bounded);  // SGD has no slots
}

// Another thread flips one source value between good and NaN during AssignSlots: no NaN reaches the slot
// (it checked the caller's memory, then copied from it again); a call that saw the NaN is refused.
EMBEDCORE_TEST(AssignSlotWritesTheValuesItChecked) {
  Table t(MakeSpec(4096, 64, DType::kFloat32, OptimizerSpec::Kind::kAdagrad));
  const int64_t n = 4096 * 64;
  std::vector<float> src(size_t(n), 0.5f);
  float* flip = &src[0];  // (checked first, copied first: the whole check between the two reads)
  std::atomic<bool> stop{false};
  std::thread writer([&] {  // each value held ~20 us, a fraction of a call's check
    auto hold = [] {
      const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(20);
      while (std::chrono::steady_clock::now() < until) {
      }
    };
    while (!stop.load(std::memory_order_relaxed)) {
      __atomic_store_n(reinterpret_cast<uint32_t*>(flip), 0x7fc00000u, __ATOMIC_RELAXED);  // NaN
      hold();
      __atomic_store_n(reinterpret_cast<uint32_t*>(flip), 0x3f000000u, __ATOMIC_RELAXED);  // 0.5
      hold();
    }
  });
  for (int i = 0; i < 300; ++i) {
    try {
      t.AssignSlot(0, 0, 4096, src.data());
    } catch (const InvalidArgument&) {  // (it saw the NaN)
    }
    EMBEDCORE_EXPECT(!std::isnan(t.slot(0)[0]));
  }
  stop = true;
  writer.join();
  // (Here about 1 call in 3 was accepted, as the scheduler ran the writer; before the fix, a NaN got in.)
}

// A source that is the table's own rows, shifted, assigns them as they were before the call (NumPy's
// `a[2:7] = a[0:5]`), with rows enough for several parallel chunks.
EMBEDCORE_TEST(AssignFromTheTablesOwnShiftedRows) {
  for (DType dt : {DType::kFloat32, DType::kFloat16}) {
    Table t(MakeSpec(5000, 3, dt, OptimizerSpec::Kind::kAdagrad));
    std::vector<float> rows(5000 * 3);
    for (size_t i = 0; i < rows.size(); ++i) rows[i] = float(i % 1000);
    t.AssignValues(0, 5000, rows.data());
    for (size_t i = 0; i < rows.size(); ++i) t.slot(0)[i] = float(i % 1000) + 1.0f;
    std::vector<float> before(5000 * 3), after(5000 * 3);
    t.ReadValues(0, 5000, before.data());
    const std::vector<float> slot_before(t.slot(0), t.slot(0) + 5000 * 3);
    if (dt == DType::kFloat32) {
      t.AssignValues(1, 4999, static_cast<const float*>(t.values()));  // every row one down
    } else {
      t.AssignRaw(1, 4999, t.values());
    }
    t.AssignSlot(0, 0, 4999, t.slot(0) + 3);  // every slot row one up
    t.ReadValues(0, 5000, after.data());
    for (int64_t r = 1; r < 5000; ++r)
      for (int64_t c = 0; c < 3; ++c) {
        EMBEDCORE_EXPECT_BITS_EQ(after[size_t(r * 3 + c)], before[size_t((r - 1) * 3 + c)]);
        EMBEDCORE_EXPECT_BITS_EQ(t.slot(0)[(r - 1) * 3 + c], slot_before[size_t(r * 3 + c)]);
      }
  }
  // A slot's rows one down, over several of AssignSlot's copy blocks (16K floats): each row gets its row above
  // as it was before the call.
  Table t(MakeSpec(20000, 3, DType::kFloat32, OptimizerSpec::Kind::kAdagrad));
  for (int64_t i = 0; i < 20000 * 3; ++i) t.slot(0)[i] = float(i) + 1.0f;
  t.AssignSlot(0, 1, 19999, t.slot(0));
  for (int64_t i = 3; i < 20000 * 3; ++i) EMBEDCORE_EXPECT_BITS_EQ(t.slot(0)[i], float(i - 3) + 1.0f);
}

EMBEDCORE_TEST(RowwiseAdagradSlotIsOneColumn) {
  TableSpec spec = MakeSpec(12, 7, DType::kFloat32, OptimizerSpec::Kind::kRowwiseAdagrad);
  spec.optimizer.initial_accumulator_value = 0.25f;
  Table t(spec);
  EMBEDCORE_EXPECT_EQ(t.slot_dim(), int64_t(1));
  EMBEDCORE_EXPECT(t.spec().optimizer.SlotNames() == std::vector<std::string>{"row_accumulators"});
  for (int64_t r = 0; r < 12; ++r) EMBEDCORE_EXPECT_BITS_EQ(t.slot(0)[r], 0.25f);
  const float src[2] = {1.5f, 2.5f};
  t.AssignSlot(0, 10, 2, src);
  EMBEDCORE_EXPECT_BITS_EQ(t.slot(0)[9], 0.25f);
  EMBEDCORE_EXPECT_BITS_EQ(t.slot(0)[10], 1.5f);
  EMBEDCORE_EXPECT_BITS_EQ(t.slot(0)[11], 2.5f);
  // A column shard cannot hold a whole row's accumulator.
  TableSpec shard = spec;
  shard.full_dim = 14;
  shard.shard_col_start = 7;
  EMBEDCORE_EXPECT_THROWS(Table{shard}, InvalidArgument, "cannot be a column shard");
  shard.shard_col_start = 0;
  shard.full_dim = 7;
  shard.shard_row_start = 100;  // a row shard can
  EMBEDCORE_EXPECT_NO_THROW(Table{shard});
  // As Adagrad: an accumulator from 0 needs epsilon > 0.
  spec.optimizer.initial_accumulator_value = 0.0f;
  spec.optimizer.adagrad_epsilon = 0.0f;
  EMBEDCORE_EXPECT_THROWS(Table{spec}, InvalidArgument, "initial_accumulator_value");
}

EMBEDCORE_TEST(SetOptimizerKeepsValuesAndStartsFreshSlots) {
  Table t(MakeSpec(20, 6, DType::kFloat32, OptimizerSpec::Kind::kSGD));
  embedcore_test::Train(t, 2, 3);  // values and step away from their initial values
  const std::vector<float> values = Values(t);
  OptimizerSpec rowwise;
  rowwise.kind = OptimizerSpec::Kind::kRowwiseAdagrad;
  rowwise.initial_accumulator_value = 0.75f;
  t.SetOptimizer(rowwise);
  EMBEDCORE_EXPECT(Values(t) == values);
  EMBEDCORE_EXPECT_EQ(t.step(), int64_t(0));
  EMBEDCORE_EXPECT_EQ(t.num_slots(), size_t(1));
  EMBEDCORE_EXPECT_EQ(t.slot_dim(), int64_t(1));
  for (int64_t r = 0; r < 20; ++r) EMBEDCORE_EXPECT_BITS_EQ(t.slot(0)[r], 0.75f);
  // It trains as a table built with it.
  TableSpec spec = MakeSpec(20, 6, DType::kFloat32, OptimizerSpec::Kind::kRowwiseAdagrad);
  spec.optimizer = rowwise;
  Table fresh(spec);
  std::vector<float> v32(values);
  fresh.AssignRaw(0, 20, v32.data());
  embedcore_test::Train(t, 2, 9);
  embedcore_test::Train(fresh, 2, 9);
  EMBEDCORE_EXPECT(Take(t) == Take(fresh));
  // Refused before anything changes: a table with slots (pointers to them would dangle), an invalid
  // optimizer, row-wise slots on a column shard.
  const Snapshot before = Take(t);
  const float* slot = t.slot(0);
  EMBEDCORE_EXPECT_THROWS(t.SetOptimizer(OptimizerSpec{}), InvalidArgument, "keeps slots");
  EMBEDCORE_EXPECT(Take(t) == before);
  EMBEDCORE_EXPECT(t.slot(0) == slot);
  Table plain(MakeSpec(20, 6, DType::kFloat32, OptimizerSpec::Kind::kSGD));
  const Snapshot plain_before = Take(plain);
  OptimizerSpec bad;
  bad.kind = OptimizerSpec::Kind::kAdam;
  bad.beta_1 = 1.5f;
  EMBEDCORE_EXPECT_THROWS(plain.SetOptimizer(bad), InvalidArgument, "beta_1");
  EMBEDCORE_EXPECT(Take(plain) == plain_before);
  TableSpec shard_spec = MakeSpec(20, 3, DType::kFloat32, OptimizerSpec::Kind::kSGD);
  shard_spec.full_dim = 6;
  shard_spec.shard_col_start = 3;
  Table shard(shard_spec);
  EMBEDCORE_EXPECT_THROWS(shard.SetOptimizer(rowwise), InvalidArgument, "cannot be a column shard");
  EMBEDCORE_EXPECT_EQ(shard.num_slots(), size_t(0));
}

EMBEDCORE_TEST(ApplyGradientsManyStepsEachTableAsApplyGradients) {
  // Several tables' steps in one call (an Embedding's): the same bits as each table's own ApplyGradients, for
  // every kind of step (sorted Adagrad and non-lazy Adam, in-order SGD), the largest step's buffers reserved
  // first; a bad id in the last table's parts changes no table.
  std::mt19937 rng(41);
  auto make = [](OptimizerSpec::Kind kind, int64_t rows) {
    TableSpec spec = MakeSpec(rows, 5, DType::kFloat32, kind);
    spec.optimizer.lazy_adam = false;
    return spec;
  };
  const std::vector<TableSpec> specs = {make(OptimizerSpec::Kind::kAdagrad, 40),
                                        make(OptimizerSpec::Kind::kSGD, 30),
                                        make(OptimizerSpec::Kind::kAdam, 50)};
  std::vector<std::unique_ptr<Table>> many, one;
  for (const TableSpec& spec : specs) {
    many.push_back(std::make_unique<Table>(spec));
    one.push_back(std::make_unique<Table>(spec));
  }
  for (int step = 0; step < 3; ++step) {
    std::vector<HostPart> parts;
    for (auto& t : many) parts.push_back(RandomPart(rng, *t, Combiner::kMean, 0, step == 1, step == 2));
    std::vector<std::vector<GradientPart>> views(parts.size());
    std::vector<Table::Step> steps;
    for (size_t i = 0; i < parts.size(); ++i) {
      views[i] = {parts[i].View()};
      steps.push_back({many[i].get(), &views[i], 0.1f});
      one[i]->ApplyGradients(views[i], 0.1f);
    }
    Table::ApplyGradientsMany(steps);
  }
  for (size_t i = 0; i < many.size(); ++i) {
    EMBEDCORE_EXPECT(Take(*many[i]) == Take(*one[i]));
    EMBEDCORE_EXPECT_EQ(many[i]->step(), int64_t(3));
  }
  std::vector<HostPart> parts;
  for (auto& t : many) parts.push_back(RandomPart(rng, *t, Combiner::kSum, 0, false, false));
  if (!parts.back().batch.ids.empty()) parts.back().batch.ids.back() = 50;  // past the last table's rows
  std::vector<std::vector<GradientPart>> views(parts.size());
  std::vector<Table::Step> steps;
  for (size_t i = 0; i < parts.size(); ++i) {
    views[i] = {parts[i].View()};
    steps.push_back({many[i].get(), &views[i], 0.1f});
  }
  std::vector<Snapshot> before;
  for (auto& t : many) before.push_back(Take(*t));
  EMBEDCORE_EXPECT_THROWS(Table::ApplyGradientsMany(steps), OutOfRange, "id 50");
  for (size_t i = 0; i < many.size(); ++i) EMBEDCORE_EXPECT(Take(*many[i]) == before[i]);
}

EMBEDCORE_TEST(ApplyGradientsManyBesideSetOptimizer) {
  // Steps of several tables on one thread while another replaces a table's optimizer (SGD with and without
  // gradient clipping, both without slots): each step runs under one optimizer or the other, and with these
  // gradients (inside the clip) both give the same rows. (Under ThreadSanitizer this checks that the steps'
  // planning reads each table's optimizer under its lock: SetOptimizer rewrites it under its own.)
  Table t(MakeSpec(100, 8, DType::kFloat32, OptimizerSpec::Kind::kSGD));
  std::vector<float> before(100 * 8);
  t.ReadValues(0, 100, before.data());
  std::vector<int64_t> ids = {1, 2, 3}, offsets = {0, 1, 2, 3};
  std::vector<float> grads(3 * 8, 0.5f);
  GradientPart p;
  p.batch = embedcore_test::MakeBatch(ids, offsets);
  p.grads = grads.data();
  std::vector<GradientPart> parts{p};
  std::atomic<bool> stop(false);
  std::atomic<int64_t> steps(0);
  std::thread stepper([&] {
    while (!stop.load()) {
      Table::ApplyGradientsMany({{&t, &parts, 0.125f}});
      steps.fetch_add(1);
    }
  });
  for (int i = 0; i < 400; ++i) {
    OptimizerSpec o;
    o.kind = OptimizerSpec::Kind::kSGD;
    o.has_clipvalue = i % 2 == 0;
    o.clip_gradient_min = -1.0f;
    o.clip_gradient_max = 1.0f;
    t.SetOptimizer(o);
  }
  while (steps.load() < 50) std::this_thread::yield();
  stop.store(true);
  stepper.join();
  std::vector<float> after(100 * 8);  // (the step count is not compared: SetOptimizer starts it at 0 again)
  t.ReadValues(0, 100, after.data());
  const float moved = float(steps.load()) * 0.0625f;  // 0.125 * 0.5 per step, exact in float32 here
  for (int64_t r = 0; r < 100; ++r)
    for (int64_t c = 0; c < 8; ++c) {
      const float want = (r >= 1 && r <= 3) ? before[size_t(r * 8 + c)] - moved : before[size_t(r * 8 + c)];
      EMBEDCORE_EXPECT_NEAR(after[size_t(r * 8 + c)], want, 1e-4, 1e-3);
    }
}

EMBEDCORE_TEST(StepsNamingAReplacedOptimizerChangeNothing) {
  // A caller reads a step's learning rate for the optimizer of one version; once SetOptimizer replaced it,
  // the step (and a pin of a several-table step) is refused and nothing changes.
  Table t(MakeSpec(10, 4, DType::kFloat32, OptimizerSpec::Kind::kSGD));
  EMBEDCORE_EXPECT_EQ(t.optimizer_version(), int64_t(0));
  std::vector<int64_t> ids = {3, 3, 7}, offsets = {0, 2, 3};
  std::vector<float> grads(2 * 4, 1.0f);
  GradientPart p;
  p.batch = embedcore_test::MakeBatch(ids, offsets);
  p.grads = grads.data();
  t.ApplyGradients({p}, 0.1f, 0, 0);  // the version it has: steps
  EMBEDCORE_EXPECT_EQ(t.step(), int64_t(1));
  OptimizerSpec adagrad;
  adagrad.kind = OptimizerSpec::Kind::kAdagrad;
  EMBEDCORE_EXPECT_EQ(t.SetOptimizer(adagrad), int64_t(1));
  EMBEDCORE_EXPECT_EQ(t.optimizer_version(), int64_t(1));
  const Snapshot before = Take(t);
  EMBEDCORE_EXPECT_THROWS(t.ApplyGradients({p}, 0.1f, 0, 0), OptimizerChanged, "version 0 -> 1");
  EMBEDCORE_EXPECT_THROWS(t.PinOptimizer(0), OptimizerChanged, "table 't'");
  EMBEDCORE_EXPECT(Take(t) == before);
  t.ApplyGradients({p}, 0.1f, 0, 1);
  t.ApplyGradients({p}, 0.1f);  // -1: any optimizer
  EMBEDCORE_EXPECT_EQ(t.step(), int64_t(2));

  // A pin holds SetOptimizer off until it is released.
  Table u(MakeSpec(10, 4, DType::kFloat32, OptimizerSpec::Kind::kSGD));
  u.PinOptimizer(0);
  u.PinOptimizer(0);  // (pins count)
  std::atomic<bool> set{false};
  std::thread setter([&] {
    u.SetOptimizer(adagrad);
    set = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EMBEDCORE_EXPECT(!set.load());
  // While it waits no new pin is taken (steps that keep coming would hold it off): refused, nothing held.
  // (Tried until the setter waits: on a loaded machine its thread may start late.)
  std::string refused;
  for (int i = 0; i < 10000 && refused.empty(); ++i) {
    try {
      u.PinOptimizer(0);
      u.UnpinOptimizer();
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    } catch (const OptimizerChanged& e) {
      refused = e.what();
    }
  }
  EMBEDCORE_EXPECT_MSG(refused.find("its optimizer is being replaced") != std::string::npos, refused);
  EMBEDCORE_EXPECT(!set.load());
  u.UnpinOptimizer();
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EMBEDCORE_EXPECT(!set.load());
  u.UnpinOptimizer();
  setter.join();
  EMBEDCORE_EXPECT(set.load());
  EMBEDCORE_EXPECT_EQ(u.optimizer_version(), int64_t(1));
  EMBEDCORE_EXPECT_EQ(u.num_slots(), size_t(1));

  // A forked child holds none of the pins its parent's threads held: its SetOptimizer does not wait for them.
  Table w(MakeSpec(10, 4, DType::kFloat32, OptimizerSpec::Kind::kSGD));
  w.PinOptimizer(0);
  const pid_t pid = ::fork();
  if (pid == 0) {
    w.SetOptimizer(adagrad);
    ::_exit(w.optimizer_version() == 1 ? 0 : 1);
  }
  EMBEDCORE_EXPECT(pid > 0);
  int status = 0;
  for (int i = 0; i < 500 && ::waitpid(pid, &status, WNOHANG) == 0; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  if (::waitpid(pid, &status, WNOHANG) == 0) {  // still waiting for the parent's pin after 5 s
    ::kill(pid, SIGKILL);
    ::waitpid(pid, &status, 0);
    embedcore_test::Fail(__FILE__, __LINE__, "the child's SetOptimizer waited for a pin of its parent");
  } else {
    EMBEDCORE_EXPECT(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  }
  w.UnpinOptimizer();
}

EMBEDCORE_TEST(AdamMatchesReferences) {
  for (DType dt : kDTypes) {
    for (int variant = 0; variant < 4; ++variant) {
      TableSpec spec = MakeSpec(40, 9, dt, OptimizerSpec::Kind::kAdam);
      spec.optimizer.epsilon = 1e-3f;
      spec.optimizer.lazy_adam = variant != 1;          // variant 1: non-lazy, untouched rows decay too
      spec.optimizer.sum_inside_sqrt = variant != 2;    // variant 2: m / (sqrt(v) + eps)
      spec.optimizer.bias_correction = variant >= 2;    // variants 2, 3: PyTorch's SparseAdam step
      CheckOptimizer(spec, std::string("Adam ") + DTypeName(dt) + " variant " + std::to_string(variant), 12, 4);
    }
  }
}

EMBEDCORE_TEST(FtrlMatchesReferences) {
  for (DType dt : kDTypes) {
    for (int variant = 0; variant < 3; ++variant) {
      TableSpec spec = MakeSpec(40, 9, dt, OptimizerSpec::Kind::kFTRL);
      spec.optimizer.initial_accumulator_value = 0.5f;
      spec.optimizer.l1 = 0.001f;
      spec.optimizer.l2 = 0.01f;
      spec.optimizer.beta = variant == 1 ? 0.5f : 0.0f;
      spec.optimizer.learning_rate_power = variant == 1 ? -0.25f : -0.5f;
      spec.optimizer.multiply_linear_by_learning_rate = variant == 2;
      CheckOptimizer(spec, std::string("FTRL ") + DTypeName(dt) + " variant " + std::to_string(variant), 13);
    }
  }
}

EMBEDCORE_TEST(CommonOptionsMatchReferences) {
  // Gradient clipping, weight decay (plain and times lr) and weight clipping
  // on every optimizer.
  using K = OptimizerSpec::Kind;
  for (K kind : {K::kSGD, K::kAdagrad, K::kRowwiseAdagrad, K::kAdam, K::kFTRL}) {
    for (bool decay_times_lr : {false, true}) {
      TableSpec spec = MakeSpec(30, 5, DType::kFloat32, kind);
      OptimizerSpec& o = spec.optimizer;
      o.has_clipvalue = true;
      o.clip_gradient_min = -0.4f;
      o.clip_gradient_max = 0.3f;
      o.weight_decay_factor = 0.1f;
      o.multiply_weight_decay_factor_by_learning_rate = decay_times_lr;
      o.has_clip_weight_min = true;
      o.clip_weight_min = -0.6f;
      o.has_clip_weight_max = true;
      o.clip_weight_max = 0.7f;
      if (kind == K::kAdam) o.lazy_adam = false;
      CheckOptimizer(spec, "options kind " + std::to_string(int(kind)) + (decay_times_lr ? " wd*lr" : " wd"), 14);
    }
  }
}

EMBEDCORE_TEST(NonLazyAdamClipsTheZeroGradientOfUntouchedRows) {
  // The rows a non-lazy Adam step does not touch take a zero gradient,
  // clipped as any other: with a clip range that excludes 0, its nearer bound.
  // Float32 rows are updated in place, 16-bit ones through a float32 copy;
  // every row and slot as the functor reference, bit for bit.
  for (DType dt : kDTypes) {
    for (float lo : {0.05f, -0.3f}) {
      TableSpec spec = MakeSpec(40, 9, dt, OptimizerSpec::Kind::kAdam);
      spec.optimizer.lazy_adam = false;
      spec.optimizer.has_clipvalue = true;
      spec.optimizer.clip_gradient_min = lo;
      spec.optimizer.clip_gradient_max = lo + 0.25f;  // [0.05, 0.3] or [-0.3, -0.05]
      CheckOptimizer(spec, std::string("non-lazy Adam, clip from ") + std::to_string(lo) + " " + DTypeName(dt), 15);
    }
  }
}

EMBEDCORE_TEST(PooledGradientsReadWithTheOutputsStride) {
  // A pooled part's gradient rows out_stride floats apart (a table's columns
  // of a wider gradient) give the step of the same rows packed, bit for bit:
  // the in-order SGD path and the sorted path (Adagrad), threads or not.
  std::mt19937 rng(11);
  for (OptimizerSpec::Kind opt : {OptimizerSpec::Kind::kSGD, OptimizerSpec::Kind::kAdagrad}) {
    for (int64_t dim : {1, 8, 21}) {
      Table packed(MakeSpec(60, dim, DType::kFloat32, opt)), strided(MakeSpec(60, dim, DType::kFloat32, opt));
      for (Combiner c : {Combiner::kSum, Combiner::kMean}) {
        HostPart p = RandomPart(rng, packed, c, 0, true, false);
        const int64_t rows = p.batch.bags(), stride = dim + 7, col = 2;
        std::vector<float> wide(size_t(rows * stride + col), std::nanf(""));  // NaN wherever a step must not read
        for (int64_t b = 0; b < rows; ++b)
          std::memcpy(&wide[size_t(b * stride + col)], &p.grads[size_t(b * dim)], size_t(dim) * sizeof(float));
        packed.ApplyGradients({p.View()}, 0.1f);
        strided.ApplyGradients({GradientPart{p.batch.View(), OutputShape{c, 0, stride}, wide.data() + col}}, 0.1f);
        EMBEDCORE_EXPECT_MSG(CountBitDiffs(Values(packed), Values(strided)) == 0,
                             "dim " << dim << " " << CombinerName(c) << " opt " << int(opt));
        for (size_t s = 0; s < packed.num_slots(); ++s)
          EMBEDCORE_EXPECT(std::memcmp(packed.slot(s), strided.slot(s), size_t(60 * dim) * sizeof(float)) == 0);
      }
    }
  }
  Table t(MakeSpec(10, 4));
  HostPart seq;
  seq.batch.AddBag({1, 2});
  seq.grads.assign(8, 1.0f);
  const std::vector<float> before = Values(t);
  EMBEDCORE_EXPECT_THROWS(t.ApplyGradients({GradientPart{seq.batch.View(), OutputShape{Combiner::kNone, 0, 8},
                                                        seq.grads.data()}}, 0.1f),
                          InvalidArgument, "only pooled lookups");
  EMBEDCORE_EXPECT_THROWS(t.ApplyGradients({GradientPart{seq.batch.View(), OutputShape{Combiner::kSum, 0, 2},
                                                        seq.grads.data()}}, 0.1f),
                          InvalidArgument, "out_stride must be 0 or at least");
  EMBEDCORE_EXPECT(CountBitDiffs(before, Values(t)) == 0 && t.step() == 0);
}

EMBEDCORE_TEST(RepeatedIdsAreSummedBeforeOneUpdate) {
  // Adagrad is not additive: three updates with g1, g2, g3 differ from one
  // update with g1 + g2 + g3. The table must do the latter.
  TableSpec spec = MakeSpec(4, 1, DType::kFloat32, OptimizerSpec::Kind::kAdagrad);
  spec.initializer.kind = InitializerSpec::Kind::kConstant;
  spec.initializer.a = 1.0;
  spec.optimizer.initial_accumulator_value = 0.1f;
  Table t(spec);
  HostPart p;
  p.batch.AddBag({2});
  p.batch.AddBag({2});
  p.batch.AddBag({0});
  p.batch.AddBag({2});
  p.shape = OutputShape{Combiner::kSum, 0};
  p.grads = {0.5f, 0.25f, 1.0f, -0.125f};
  t.ApplyGradients({p.View()}, 0.1f);
  const std::vector<float> v = Values(t);
  const float g = 0.5f + 0.25f + -0.125f;
  const float acc = 0.1f + g * g;
  EMBEDCORE_EXPECT_BITS_EQ(t.slot(0)[2], acc);
  EMBEDCORE_EXPECT_BITS_EQ(v[2], 1.0f - 0.1f * g / std::sqrt(acc));
  EMBEDCORE_EXPECT_BITS_EQ(t.slot(0)[0], 0.1f + 1.0f);
  EMBEDCORE_EXPECT_BITS_EQ(v[1], 1.0f);  // untouched rows stay
  EMBEDCORE_EXPECT_BITS_EQ(v[3], 1.0f);
  EMBEDCORE_EXPECT_BITS_EQ(t.slot(0)[1], 0.1f);

  // Across parts too: the same id in two lookups is one update.
  Table t2(spec);
  HostPart a, b;
  a.batch.AddBag({2, 2});
  a.shape = OutputShape{Combiner::kMean, 0};  // each occurrence gets g / 2
  a.grads = {0.5f};
  b.batch.AddBag({2});
  b.shape = OutputShape{Combiner::kNone, 0};
  b.grads = {0.25f};
  t2.ApplyGradients({a.View(), b.View()}, 0.1f);
  const float g2 = (0.0f + 0.5f * 0.5f + 0.5f * 0.5f) + 0.25f;
  EMBEDCORE_EXPECT_BITS_EQ(t2.slot(0)[2], 0.1f + g2 * g2);
  EMBEDCORE_EXPECT_EQ(t2.step(), int64_t(1));
}

EMBEDCORE_TEST(TruncatedSequenceIdsGetNoGradient) {
  TableSpec spec = MakeSpec(6, 2);
  spec.initializer.kind = InitializerSpec::Kind::kZeros;
  Table t(spec);
  HostPart p;
  p.batch.AddBag({1, 2, 3});  // L = 2: id 3 was never looked up
  p.shape = OutputShape{Combiner::kNone, 2};
  p.grads = {1, 1, 1, 1};
  t.ApplyGradients({p.View()}, 1.0f);
  const std::vector<float> v = Values(t);
  EMBEDCORE_EXPECT_BITS_EQ(v[2], -1.0f);
  EMBEDCORE_EXPECT_BITS_EQ(v[4], -1.0f);
  EMBEDCORE_EXPECT_BITS_EQ(v[6], 0.0f);
}

EMBEDCORE_TEST(EmptyUpdatesCountAsSteps) {
  Table t(MakeSpec(5, 3, DType::kFloat32, OptimizerSpec::Kind::kAdagrad));
  const Snapshot before = Take(t);
  t.ApplyGradients({}, 0.1f);
  HostPart empty;
  empty.batch.AddBag({});
  empty.shape = OutputShape{Combiner::kSum, 0};
  empty.grads = {0, 0, 0};
  t.ApplyGradients({empty.View()}, 0.1f);
  Snapshot after = Take(t);
  EMBEDCORE_EXPECT_EQ(after.step, int64_t(2));
  after.step = before.step;
  EMBEDCORE_EXPECT(after == before);
  t.set_step(41);
  EMBEDCORE_EXPECT_EQ(t.step(), int64_t(41));
}

EMBEDCORE_TEST(UpdateValidationLeavesTableUnchanged) {
  using K = OptimizerSpec::Kind;
  // float32 too: plain SGD on it takes its own path (no sort).
  for (auto [kind, dtype] : {std::pair{K::kSGD, DType::kFloat16}, std::pair{K::kSGD, DType::kFloat32},
                             std::pair{K::kAdagrad, DType::kFloat16}, std::pair{K::kAdam, DType::kFloat16},
                             std::pair{K::kFTRL, DType::kFloat16}}) {
    TableSpec spec = MakeSpec(10, 3, dtype, kind);
    spec.optimizer.lazy_adam = false;  // a non-lazy step would touch every row
    Table t(spec);
    std::mt19937 rng(3);
    HostPart good = RandomPart(rng, t, Combiner::kSum, 0, true, false);
    const Snapshot before = Take(t);

    HostPart bad_id = good;
    bad_id.batch.AddBag({10});
    bad_id.grads.resize(bad_id.grads.size() + 3, 1.0f);
    EMBEDCORE_EXPECT_THROWS(t.ApplyGradients({good.View(), bad_id.View()}, 0.1f), OutOfRange, "id 10");
    EMBEDCORE_EXPECT(Take(t) == before);

    HostPart bad_offsets = good;
    bad_offsets.batch.offsets.back() += 1;
    EMBEDCORE_EXPECT_THROWS(t.ApplyGradients({good.View(), bad_offsets.View()}, 0.1f), InvalidArgument, "offsets");
    EMBEDCORE_EXPECT(Take(t) == before);

    GradientPart no_grads = good.View();
    no_grads.grads = nullptr;
    EMBEDCORE_EXPECT_THROWS(t.ApplyGradients({good.View(), no_grads}, 0.1f), InvalidArgument, "grads: null");
    EMBEDCORE_EXPECT(Take(t) == before);

    for (float lr : {std::nanf(""), std::numeric_limits<float>::infinity()})
      EMBEDCORE_EXPECT_THROWS(t.ApplyGradients({good.View()}, lr), InvalidArgument, "learning_rate");
    EMBEDCORE_EXPECT(Take(t) == before);

    GradientPart negative_length = good.View();  // refused as Lookup refuses it
    negative_length.shape = OutputShape{Combiner::kNone, -1};
    EMBEDCORE_EXPECT_THROWS(t.ApplyGradients({good.View(), negative_length}, 0.1f), InvalidArgument,
                            "max_sequence_length must be >= 0, got -1");
    EMBEDCORE_EXPECT(Take(t) == before);

    // And the table still works.
    EMBEDCORE_EXPECT_NO_THROW(t.ApplyGradients({good.View()}, 0.1f));
    EMBEDCORE_EXPECT_EQ(t.step(), int64_t(1));
  }
}

// ------------------------------------------------------------ assign / read
EMBEDCORE_TEST(AssignAndReadValues) {
  for (DType dt : kDTypes) {
    Table t(MakeSpec(6, 3, dt, OptimizerSpec::Kind::kAdam));
    const std::vector<float> src = {0.1f, -2.5f, 1e-6f, 3.0f, 65504.0f, -0.0f};
    t.AssignValues(2, 2, src.data());
    std::vector<float> got(6);
    t.ReadValues(2, 2, got.data());
    for (size_t i = 0; i < 6; ++i) EMBEDCORE_EXPECT_BITS_EQ(got[i], RoundToStorage(dt, src[i]));
    const std::vector<float> v = Values(t);
    for (size_t i = 0; i < 6; ++i) EMBEDCORE_EXPECT_BITS_EQ(v[6 + i], got[i]);

    // Raw bytes of rows 2..3 copied to rows 4..5.
    std::vector<uint8_t> raw(static_cast<const uint8_t*>(t.values()) + 2 * 3 * DTypeSize(dt),
                             static_cast<const uint8_t*>(t.values()) + 4 * 3 * DTypeSize(dt));
    t.AssignRaw(4, 2, raw.data());
    t.ReadValues(4, 2, got.data());
    for (size_t i = 0; i < 6; ++i) EMBEDCORE_EXPECT_BITS_EQ(got[i], RoundToStorage(dt, src[i]));

    const std::vector<float> slot = {1, 2, 3};
    t.AssignSlot(1, 5, 1, slot.data());
    for (int d = 0; d < 3; ++d) EMBEDCORE_EXPECT_BITS_EQ(t.slot(1)[15 + d], slot[size_t(d)]);

    // Ranges: [start, start + n) must fit in [0, rows); n = 0 at the end is fine.
    const Snapshot before = Take(t);
    EMBEDCORE_EXPECT_THROWS(t.AssignValues(5, 2, src.data()), OutOfRange, "rows [5, 7)");
    EMBEDCORE_EXPECT_THROWS(t.AssignValues(-1, 1, src.data()), OutOfRange, "do not fit");
    EMBEDCORE_EXPECT_THROWS(t.AssignRaw(0, 7, raw.data()), OutOfRange, "do not fit");
    EMBEDCORE_EXPECT_THROWS(t.AssignSlot(0, 6, 1, slot.data()), OutOfRange, "do not fit");
    EMBEDCORE_EXPECT_THROWS(t.AssignSlot(2, 0, 1, slot.data()), OutOfRange, "no slot 2");
    const std::vector<float> nan = {1, std::nanf(""), 3};
    EMBEDCORE_EXPECT_THROWS(t.AssignSlot(0, 0, 1, nan.data()), InvalidArgument,
                            "values[0, 1] = nan (table row 0) is not finite");
    EMBEDCORE_EXPECT_THROWS(t.ReadValues(0, -1, got.data()), OutOfRange, "do not fit");
    EMBEDCORE_EXPECT_THROWS(t.ReadValues(int64_t(1) << 62, 1, got.data()), OutOfRange, "do not fit");
    EMBEDCORE_EXPECT_NO_THROW(t.AssignValues(6, 0, src.data()));
    EMBEDCORE_EXPECT_NO_THROW(t.ReadValues(6, 0, got.data()));
    EMBEDCORE_EXPECT(Take(t) == before);
  }
}

// ------------------------------------------------------------ threads
EMBEDCORE_TEST(ResultsDoNotDependOnThreadCount) {
  // Big enough that every loop splits into many chunks.
  struct Run {
    std::vector<float> pooled, flat;
    std::vector<Snapshot> states;
  };
  const int saved = GetNumThreads();
  std::vector<Run> runs;
  for (int threads : {1, 2, 4, 3}) {
    SetNumThreads(threads);
    EMBEDCORE_EXPECT_EQ(GetNumThreads(), threads);
    std::mt19937 rng(4242);  // the same data for every thread count
    Run run;
    // Plain SGD on float32 runs its own path (no sort; each thread scans the
    // batch for its rows); with weight decay, SGD takes the sorted path.
    const std::pair<OptimizerSpec::Kind, DType> kinds[] = {
        {OptimizerSpec::Kind::kAdagrad, DType::kBFloat16}, {OptimizerSpec::Kind::kFTRL, DType::kBFloat16},
        {OptimizerSpec::Kind::kAdam, DType::kBFloat16},    {OptimizerSpec::Kind::kSGD, DType::kFloat32},
        {OptimizerSpec::Kind::kSGD, DType::kFloat32}};
    for (size_t v = 0; v < std::size(kinds); ++v) {
      TableSpec spec = MakeSpec(3000, 24, kinds[v].second, kinds[v].first, 9);
      spec.initializer.kind = InitializerSpec::Kind::kTruncatedNormal;
      spec.initializer.b = 0.0;
      spec.optimizer.lazy_adam = false;
      if (v == 4) spec.optimizer.weight_decay_factor = 0.01f;
      Table t(spec);
      for (int step = 0; step < 2; ++step) {
        HostPart p;
        p.batch = RandomBatch(rng, 6000, 12, t.rows(), true, step == 1);
        p.shape = OutputShape{Combiner::kSqrtn, 0};
        std::vector<float> out(size_t(p.batch.bags() * t.dim()));
        t.Lookup(p.batch.View(), p.shape, out.data());
        run.pooled.insert(run.pooled.end(), out.begin(), out.end());
        std::vector<float> flat(p.batch.ids.size() * size_t(t.dim()));
        t.Lookup(p.batch.View(), OutputShape{Combiner::kNone, 0}, flat.data());
        run.flat.insert(run.flat.end(), flat.begin(), flat.end());
        p.grads = out;  // any gradient will do; the same for every thread count
        t.ApplyGradients({p.View()}, 0.05f);
      }
      run.states.push_back(Take(t));
    }
    runs.push_back(std::move(run));
  }
  SetNumThreads(saved);
  for (size_t i = 1; i < runs.size(); ++i) {
    EMBEDCORE_EXPECT_EQ(CountBitDiffs(runs[i].pooled, runs[0].pooled), int64_t(0));
    EMBEDCORE_EXPECT_EQ(CountBitDiffs(runs[i].flat, runs[0].flat), int64_t(0));
    for (size_t s = 0; s < runs[0].states.size(); ++s)
      EMBEDCORE_EXPECT_MSG(runs[i].states[s] == runs[0].states[s], "run " << i << " table " << s);
  }
}

EMBEDCORE_TEST(ConcurrentLookupsNeverSeeHalfUpdatedRows) {
  // Every element of a row gets the same update, so a row read while an
  // update ran half-way would hold two different values.
  const int64_t rows = 512, dim = 64;
  TableSpec spec = MakeSpec(rows, dim);
  spec.initializer.kind = InitializerSpec::Kind::kConstant;
  spec.initializer.a = 1.0;
  Table t(spec);
  HostPart p;
  for (int64_t r = 0; r < rows; ++r) p.batch.AddBag({r});
  p.shape = OutputShape{Combiner::kNone, 0};
  p.grads.resize(size_t(rows * dim));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t d = 0; d < dim; ++d) p.grads[size_t(r * dim + d)] = 0.001f * float(r + 1);

  std::atomic<bool> done{false};
  std::atomic<int64_t> torn{0}, lookups{0};
  auto reader = [&] {
    std::vector<float> out(size_t(rows * dim));
    while (!done.load()) {
      t.Lookup(p.batch.View(), p.shape, out.data());
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t d = 1; d < dim; ++d)
          if (Bits(out[size_t(r * dim + d)]) != Bits(out[size_t(r * dim)])) {
            ++torn;
            break;
          }
      ++lookups;
    }
  };
  std::vector<std::thread> readers;
  for (int i = 0; i < 3; ++i) readers.emplace_back(reader);
  for (int step = 0; step < 40; ++step) t.ApplyGradients({p.View()}, 0.5f);
  while (lookups.load() < 3) std::this_thread::yield();  // at least some overlap, however slow
  done = true;
  for (auto& th : readers) th.join();
  EMBEDCORE_EXPECT_EQ(torn.load(), int64_t(0));
  EMBEDCORE_EXPECT_EQ(t.step(), int64_t(40));
  // And the final values are 40 SGD steps.
  const std::vector<float> v = Values(t);
  for (int64_t r = 0; r < rows; ++r) {
    float w = 1.0f;
    for (int s = 0; s < 40; ++s) w = w - 0.5f * (0.001f * float(r + 1));
    EMBEDCORE_EXPECT_BITS_EQ(v[size_t(r * dim)], w);
  }
}

EMBEDCORE_TEST(ConcurrentStepsOfOneTableAreEachCounted) {
  // Steps from several threads take the table in turn; the step count (read
  // by each step's checks before it takes the table, and by step() meanwhile)
  // counts every one, and no update is lost. Built with ThreadSanitizer, this
  // is the test that shows the count is read without a race.
  for (OptimizerSpec::Kind opt : {OptimizerSpec::Kind::kSGD, OptimizerSpec::Kind::kAdagrad}) {
    TableSpec spec = MakeSpec(8, 4, DType::kFloat32, opt);
    spec.initializer.kind = InitializerSpec::Kind::kZeros;
    Table t(spec);
    HostPart p;
    p.batch.AddBag({3, 3});  // a repeated id: the sorted (grouped) path as well as SGD's in-order one
    p.shape = OutputShape{Combiner::kSum, 0};
    p.grads.assign(4, 0.25f);
    std::atomic<bool> done{false};
    std::atomic<int64_t> went_back{0};
    std::thread watcher([&] {
      int64_t last = 0;
      while (!done.load()) {
        const int64_t now = t.step();
        if (now < last) ++went_back;
        last = now;
      }
    });
    std::vector<std::thread> steppers;
    for (int i = 0; i < 4; ++i)
      steppers.emplace_back([&] {
        for (int s = 0; s < 50; ++s) t.ApplyGradients({p.View()}, opt == OptimizerSpec::Kind::kSGD ? 1.0f : 0.1f);
      });
    for (auto& th : steppers) th.join();
    done = true;
    watcher.join();
    EMBEDCORE_EXPECT_EQ(t.step(), int64_t(200));
    EMBEDCORE_EXPECT_EQ(went_back.load(), int64_t(0));
    if (opt == OptimizerSpec::Kind::kSGD) {  // 200 steps of -0.5 each (two occurrences of 0.25): exact in float32
      const std::vector<float> v = Values(t);
      EMBEDCORE_EXPECT_BITS_EQ(v[3 * 4], -100.0f);
      EMBEDCORE_EXPECT_BITS_EQ(v[0], 0.0f);
    }
  }
}
