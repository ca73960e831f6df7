// Initial values as a pure function of (seed, element index): a counter-based
// generator (SplitMix64 finaliser over the index), so any thread may fill any
// row and the table is the same bit for bit whatever the thread count.
#include <algorithm>
#include <cfenv>
#include <cmath>

#include "internal.h"
#include "ops/half.h"
#include "thread_pool.h"

namespace embedcore::internal {
namespace {

inline uint64_t Mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Uniform in the open interval (0, 1), 53 random bits.
inline double Open01(uint64_t bits) { return (double(bits >> 11) + 0.5) * 0x1.0p-53; }

// A standard normal from two independent draws (Box-Muller).
inline double StandardNormal(uint64_t key, uint64_t draw) {
  const double u1 = Open01(Mix(key ^ Mix(2 * draw)));
  const double u2 = Open01(Mix(key ^ Mix(2 * draw + 1)));
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
}

// The next 16-bit float below `x` (toward -inf), in float16 or bfloat16 bits.
inline uint16_t StepDown(uint16_t bits) {
  if ((bits & 0x7fffu) == 0) return 0x8001u;  // +-0 -> the smallest negative subnormal
  return (bits & 0x8000u) ? uint16_t(bits + 1) : uint16_t(bits - 1);
}
inline float StepDown(float x) { return std::nextafter(x, -INFINITY); }
inline ops::F16 StepDown(ops::F16 x) { return ops::F16{StepDown(x.bits)}; }
inline ops::BF16 StepDown(ops::BF16 x) { return ops::BF16{StepDown(x.bits)}; }

// Fills a [rows, dim] block whose element (r, c) is element (row0 + r, col0 + c)
// of a table `full_dim` wide: a shard gets the values the whole table would have.
template <typename T>
void Fill(const InitializerSpec& spec, int64_t rows, int64_t dim, int64_t row0, int64_t col0, int64_t full_dim,
          T* data) {
  // Uniform draws from [low, high): rounding to the storage dtype may reach high.
  const bool bounded = spec.kind == InitializerSpec::Kind::kUniform && spec.b > spec.a;
  const float high = float(spec.b);
  ParallelFor(rows, std::max<int64_t>(1, 16384 / dim), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const uint64_t base = uint64_t(row0 + r) * uint64_t(full_dim) + uint64_t(col0);
      for (int64_t c = 0; c < dim; ++c) {
        T v = ops::FromFloat<T>(InitialValue(spec, full_dim, base + uint64_t(c)));
        if (bounded && ops::ToFloat(v) >= high) v = StepDown(v);
        data[r * dim + c] = v;
      }
    }
  });
}

}  // namespace

float InitialValue(const InitializerSpec& spec, int64_t dim, uint64_t index) {
  using Kind = InitializerSpec::Kind;
  const uint64_t key = Mix(spec.seed) ^ Mix(index * 0x632be59bd9b4e019ull + 1);
  switch (spec.kind) {
    case Kind::kZeros:
      return 0.0f;
    case Kind::kConstant:
      return float(spec.a);
    case Kind::kUniform: {
      // [low, high): rounding to float may reach `high`; step back below it.
      const float v = float(spec.a + (spec.b - spec.a) * Open01(Mix(key)));
      const float high = float(spec.b);
      return (v >= high && spec.b > spec.a) ? std::nextafter(high, -INFINITY) : v;
    }
    case Kind::kNormal: {
      const double stddev = spec.b > 0 ? spec.b : 1.0 / std::sqrt(double(dim));
      return float(spec.a + stddev * StandardNormal(key, 0));
    }
    case Kind::kTruncatedNormal: {
      // Redraw until within two standard deviations, as TensorFlow does.
      const double stddev = spec.b > 0 ? spec.b : 1.0 / std::sqrt(double(dim));
      for (uint64_t draw = 0;; ++draw) {
        const double z = StandardNormal(key, draw);
        if (z >= -2.0 && z <= 2.0) return float(spec.a + stddev * z);
      }
    }
  }
  return 0.0f;
}

double LargestStandardNormal() {
  // sqrt(-2 log(u1)) is largest at Open01's smallest value, 2^-54 (about
  // 8.6524), and |cos| <= 1: every draw of StandardNormal is within it, as
  // computed (sqrt and the product round monotonically).
  return std::sqrt(-2.0 * std::log(Open01(0)));
}

double InitialBound(const InitializerSpec& spec, int64_t dim) {
  using Kind = InitializerSpec::Kind;
  const double stddev = spec.b > 0 ? spec.b : 1.0 / std::sqrt(double(dim));
  switch (spec.kind) {
    case Kind::kZeros:
      return 0.0;
    case Kind::kConstant:
      return std::fabs(spec.a);
    case Kind::kUniform:
      return std::max(std::fabs(spec.a), std::fabs(spec.b));
    case Kind::kNormal:
      return std::fabs(spec.a) + stddev * LargestStandardNormal();
    case Kind::kTruncatedNormal:
      return std::fabs(spec.a) + stddev * 2.0;
  }
  return 0.0;
}

bool LeavesZero(const InitializerSpec& spec) {
  return spec.kind == InitializerSpec::Kind::kZeros ||
         (spec.kind == InitializerSpec::Kind::kConstant && spec.a == 0.0 && !std::signbit(spec.a));
}

void Initialize(const InitializerSpec& spec, DType dtype, int64_t rows, int64_t dim, int64_t row0, int64_t col0,
                int64_t full_dim, void* data) {
  if (LeavesZero(spec)) return;  // memory is already zero
  // Initial values are a function of (seed, index) alone: drawn in the default floating-point environment
  // (round to nearest, no flush to zero), whatever the caller's, which the pool's threads would take on.
  struct DefaultFloatEnvironment {
    std::fenv_t saved;
    DefaultFloatEnvironment() {
      std::fegetenv(&saved);
      std::fesetenv(FE_DFL_ENV);
    }
    ~DefaultFloatEnvironment() { std::fesetenv(&saved); }
  } environment;
  switch (dtype) {
    case DType::kFloat32:
      Fill(spec, rows, dim, row0, col0, full_dim, static_cast<float*>(data));
      break;
    case DType::kFloat16:
      Fill(spec, rows, dim, row0, col0, full_dim, static_cast<ops::F16*>(data));
      break;
    case DType::kBFloat16:
      Fill(spec, rows, dim, row0, col0, full_dim, static_cast<ops::BF16*>(data));
      break;
    case DType::kUInt8Rowwise:  // a checkpoint file's dtype only: Table refuses it before initializing
      break;
  }
}

}  // namespace embedcore::internal
