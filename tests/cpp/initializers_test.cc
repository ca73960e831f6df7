// core/initializers.cc: every element a pure function of (seed, index), so
// tables are identical whatever the thread count; values in range; the
// distributions roughly right; dtype rounding of the same values.
#include <cfenv>
#include <cmath>
#include <cstring>
#include <vector>

#include "embedcore/embedcore.h"
#include "internal.h"
#include "ops/half.h"
#include "test_util.h"

using namespace embedcore;
using embedcore_test::Bits;
using Kind = InitializerSpec::Kind;

namespace {

InitializerSpec Spec(Kind kind, double a, double b, uint64_t seed) {
  InitializerSpec s;
  s.kind = kind;
  s.a = a;
  s.b = b;
  s.seed = seed;
  return s;
}

std::vector<float> Fill(const InitializerSpec& spec, int64_t rows, int64_t dim) {
  std::vector<float> v(size_t(rows * dim), 0.0f);
  internal::Initialize(spec, DType::kFloat32, rows, dim, 0, 0, dim, v.data());
  return v;
}

struct Moments {
  double mean, stddev, min, max;
};
Moments Stats(const std::vector<float>& v) {
  double s = 0, s2 = 0, lo = INFINITY, hi = -INFINITY;
  for (float x : v) {
    s += x;
    s2 += double(x) * x;
    lo = std::fmin(lo, x);
    hi = std::fmax(hi, x);
  }
  const double n = double(v.size()), mean = s / n;
  return {mean, std::sqrt(s2 / n - mean * mean), lo, hi};
}

struct RestoreThreads {
  int saved = GetNumThreads();
  ~RestoreThreads() { SetNumThreads(saved); }
};

}  // namespace

EMBEDCORE_TEST(DeterministicAndPure) {
  for (Kind kind : {Kind::kUniform, Kind::kNormal, Kind::kTruncatedNormal}) {
    const InitializerSpec spec = Spec(kind, 0.0, 0.5, 1234);
    const std::vector<float> a = Fill(spec, 200, 17), b = Fill(spec, 200, 17);
    EMBEDCORE_EXPECT(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
    // Every element is InitialValue(spec, dim, index).
    int64_t wrong = 0;
    for (int64_t i = 0; i < 200 * 17; ++i) wrong += Bits(a[size_t(i)]) != Bits(internal::InitialValue(spec, 17, uint64_t(i)));
    EMBEDCORE_EXPECT_EQ(wrong, int64_t(0));
    // The first rows do not depend on how many rows follow.
    const std::vector<float> c = Fill(spec, 50, 17);
    EMBEDCORE_EXPECT(std::memcmp(a.data(), c.data(), c.size() * sizeof(float)) == 0);
    // Another seed gives other values.
    const std::vector<float> d = Fill(Spec(kind, 0.0, 0.5, 1235), 200, 17);
    int64_t same = 0;
    for (size_t i = 0; i < a.size(); ++i) same += Bits(a[i]) == Bits(d[i]);
    EMBEDCORE_EXPECT_LT(same, int64_t(10));
  }
}

EMBEDCORE_TEST(ThreadCountIndependent) {
  RestoreThreads restore;
  std::vector<std::vector<uint8_t>> tables;
  for (int threads : {1, 2, 4}) {
    SetNumThreads(threads);
    for (DType dt : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
      TableSpec spec;
      spec.name = "init";
      spec.rows = 20000;
      spec.dim = 8;
      spec.dtype = dt;
      spec.initializer = Spec(Kind::kTruncatedNormal, 0.1, 0.0, 77);
      Table t(spec);
      const uint8_t* p = static_cast<const uint8_t*>(t.values());
      tables.emplace_back(p, p + t.value_bytes());
    }
  }
  for (size_t i = 3; i < tables.size(); ++i) EMBEDCORE_EXPECT(tables[i] == tables[i % 3]);
}

EMBEDCORE_TEST(IndependentOfTheCallersFloatingPointEnvironment) {
  // A caller rounding toward zero (fesetround; the pool's threads take on the caller's mode) or flushing
  // subnormals drew other values (half of them differed); the caller's environment is left as it was.
  RestoreThreads restore;
  SetNumThreads(2);
  auto draw = [](DType dt, Kind kind) {
    TableSpec spec;
    spec.name = "init";
    spec.rows = 4000;
    spec.dim = 4;
    spec.dtype = dt;
    spec.initializer = Spec(kind, kind == Kind::kUniform ? -0.05 : 0.0, kind == Kind::kUniform ? 0.05 : 1e-38, 1);
    Table t(spec);
    const uint8_t* p = static_cast<const uint8_t*>(t.values());
    return std::vector<uint8_t>(p, p + t.value_bytes());
  };
  for (DType dt : {DType::kFloat32, DType::kFloat16})
  for (Kind kind : {Kind::kNormal, Kind::kUniform, Kind::kTruncatedNormal}) {
    const std::vector<uint8_t> want = draw(dt, kind);
    for (int mode : {FE_TOWARDZERO, FE_UPWARD, FE_DOWNWARD}) {
      std::fesetround(mode);
      const std::vector<uint8_t> got = draw(dt, kind);
      EMBEDCORE_EXPECT_EQ(std::fegetround(), mode);
      std::fesetround(FE_TONEAREST);
      EMBEDCORE_EXPECT(got == want);
    }
  }
}

EMBEDCORE_TEST(StorageDtypesRoundTheSameValues) {
  const InitializerSpec spec = Spec(Kind::kNormal, 0.0, 2.0, 5);
  std::vector<uint16_t> half(300), bf(300);
  internal::Initialize(spec, DType::kFloat16, 30, 10, 0, 0, 10, half.data());
  internal::Initialize(spec, DType::kBFloat16, 30, 10, 0, 0, 10, bf.data());
  for (int64_t i = 0; i < 300; ++i) {
    const float v = internal::InitialValue(spec, 10, uint64_t(i));
    EMBEDCORE_EXPECT_EQ(half[size_t(i)], ops::FloatToHalf(v));
    EMBEDCORE_EXPECT_EQ(bf[size_t(i)], ops::FloatToBFloat16(v));
  }
}

EMBEDCORE_TEST(ZerosAndConstant) {
  const std::vector<float> z = Fill(Spec(Kind::kZeros, 5.0, 5.0, 1), 10, 10);
  for (float v : z) EMBEDCORE_EXPECT_BITS_EQ(v, 0.0f);
  const std::vector<float> c = Fill(Spec(Kind::kConstant, 0.375, 0.0, 1), 10, 10);
  for (float v : c) EMBEDCORE_EXPECT_BITS_EQ(v, 0.375f);
  const std::vector<float> nz = Fill(Spec(Kind::kConstant, -0.0, 0.0, 1), 3, 3);
  for (float v : nz) EMBEDCORE_EXPECT_BITS_EQ(v, -0.0f);  // the sign of -0.0 is kept
  // Through a table, whose memory starts at zero.
  TableSpec spec;
  spec.name = "c";
  spec.rows = 4;
  spec.dim = 3;
  spec.dtype = DType::kFloat16;
  spec.initializer = Spec(Kind::kConstant, -1.5, 0.0, 0);
  Table t(spec);
  for (int i = 0; i < 12; ++i) EMBEDCORE_EXPECT_EQ(static_cast<const uint16_t*>(t.values())[i], uint16_t(0xbe00));
}

EMBEDCORE_TEST(UniformRangeAndMoments) {
  const std::vector<float> v = Fill(Spec(Kind::kUniform, -0.25, 0.75, 3), 1000, 100);
  const Moments m = Stats(v);
  EMBEDCORE_EXPECT_GE(m.min, -0.25);
  EMBEDCORE_EXPECT_LE(m.max, 0.75);
  EMBEDCORE_EXPECT_NEAR(m.mean, 0.25, 0.0, 0.01);
  EMBEDCORE_EXPECT_NEAR(m.stddev, 1.0 / std::sqrt(12.0), 0.02, 0.0);
  EMBEDCORE_EXPECT_LT(m.min, -0.24);  // reaches both ends
  EMBEDCORE_EXPECT_GE(m.max, 0.74);
}

EMBEDCORE_TEST(NormalMoments) {
  const std::vector<float> v = Fill(Spec(Kind::kNormal, 1.0, 0.5, 4), 1000, 100);
  const Moments m = Stats(v);
  EMBEDCORE_EXPECT_NEAR(m.mean, 1.0, 0.0, 0.01);
  EMBEDCORE_EXPECT_NEAR(m.stddev, 0.5, 0.02, 0.0);
  EMBEDCORE_EXPECT_LT(m.min, 1.0 - 3 * 0.5);  // not truncated: 1e5 draws reach beyond 3 sigma
  EMBEDCORE_EXPECT_GE(m.max, 1.0 + 3 * 0.5);
  // stddev 0 means 1 / sqrt(dim).
  const Moments d = Stats(Fill(Spec(Kind::kNormal, 0.0, 0.0, 4), 2000, 64));
  EMBEDCORE_EXPECT_NEAR(d.stddev, 1.0 / 8.0, 0.02, 0.0);
}

EMBEDCORE_TEST(TruncatedNormalWithinTwoStddev) {
  const double mean = -0.5, sd = 0.2;
  const std::vector<float> v = Fill(Spec(Kind::kTruncatedNormal, mean, sd, 6), 1000, 100);
  const Moments m = Stats(v);
  EMBEDCORE_EXPECT_GE(m.min, float(mean - 2 * sd));
  EMBEDCORE_EXPECT_LE(m.max, float(mean + 2 * sd));
  EMBEDCORE_EXPECT_NEAR(m.mean, mean, 0.0, 0.005);
  // The standard normal truncated to [-2, 2] has stddev 0.8796.
  EMBEDCORE_EXPECT_NEAR(m.stddev, 0.8796 * sd, 0.02, 0.0);
  // Default stddev 1 / sqrt(dim): within 2 / sqrt(dim).
  const Moments d = Stats(Fill(Spec(Kind::kTruncatedNormal, 0.0, 0.0, 6), 1000, 16));
  EMBEDCORE_EXPECT_GE(d.min, -0.5);
  EMBEDCORE_EXPECT_LE(d.max, 0.5);
  EMBEDCORE_EXPECT_NEAR(d.stddev, 0.8796 / 4.0, 0.02, 0.0);
}

EMBEDCORE_TEST(NeighbouringElementsAreIndependent) {
  // A counter-based generator can correlate neighbours; check lag-1 and
  // lag-dim correlations of a uniform table are near 0.
  const int64_t rows = 2000, dim = 50;
  const std::vector<float> v = Fill(Spec(Kind::kUniform, -1.0, 1.0, 8), rows, dim);
  for (int64_t lag : {int64_t(1), dim}) {
    double s = 0;
    for (size_t i = 0; i + size_t(lag) < v.size(); ++i) s += double(v[i]) * v[i + size_t(lag)];
    const double corr = s / double(v.size() - size_t(lag)) / (1.0 / 3.0);
    EMBEDCORE_EXPECT_NEAR(corr, 0.0, 0.0, 0.02);
  }
}
