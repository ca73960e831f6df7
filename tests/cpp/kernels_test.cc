// core/kernels*.{h,cc}: the generic, AVX2+F16C and AVX-512 kernel sets give the
// same bits for pooled, padded and flat lookups, for every storage dtype and
// id type, on random data, and both equal a scalar reference written in the
// documented order of float operations; row load/store agree too, and so does
// the optimizer step over rows grouped by id, for every rule.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <sys/mman.h>
#include <unistd.h>

#include "embedcore/embedcore.h"
#include "kernels.h"
#include "ops/combiners.h"
#include "ops/half.h"
#include "ops/optimizers.h"
#include "test_util.h"

using namespace embedcore;
namespace ops = embedcore::ops;
using embedcore_test::Bits;

namespace {

bool CpuHasAvx2() {
#if defined(__x86_64__) && defined(__GNUC__)
  return __builtin_cpu_supports("avx2") && kernels::CpuHasF16c();
#else
  return false;
#endif
}

bool CpuHasAvx512() {
#if defined(__x86_64__) && defined(__GNUC__)
  return CpuHasAvx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl");
#else
  return false;
#endif
}

// A table of `rows x dim` elements of `dtype`, as raw bytes, with the float
// value of every element beside it.
struct RawTable {
  DType dtype;
  int64_t rows, dim;
  std::vector<uint8_t> bytes;
  std::vector<float> values;  // what the stored elements are worth
};

RawTable MakeTable(DType dtype, int64_t rows, int64_t dim, std::mt19937& rng) {
  RawTable t{dtype, rows, dim, std::vector<uint8_t>(size_t(rows * dim) * DTypeSize(dtype)),
             std::vector<float>(size_t(rows * dim))};
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int64_t i = 0; i < rows * dim; ++i) {
    const float f = normal(rng);
    switch (dtype) {
      case DType::kFloat32:
        std::memcpy(&t.bytes[size_t(i) * 4], &f, 4);
        t.values[size_t(i)] = f;
        break;
      case DType::kFloat16: {
        const uint16_t h = ops::FloatToHalf(f);
        std::memcpy(&t.bytes[size_t(i) * 2], &h, 2);
        t.values[size_t(i)] = ops::HalfToFloat(h);
        break;
      }
      case DType::kBFloat16: {
        const uint16_t h = ops::FloatToBFloat16(f);
        std::memcpy(&t.bytes[size_t(i) * 2], &h, 2);
        t.values[size_t(i)] = ops::BFloat16ToFloat(h);
        break;
      }
      case DType::kUInt8Rowwise:  // no table dtype: MakeRowwise8Table
        break;
    }
  }
  return t;
}

// A random CSR batch: bag lengths 0..max_len (empty bags included).
struct RandomBatch {
  std::vector<int32_t> ids32;
  std::vector<int64_t> ids64;
  std::vector<int64_t> offsets;
  std::vector<float> weights;
  int64_t nnz() const { return int64_t(ids64.size()); }
  int64_t bags() const { return int64_t(offsets.size()) - 1; }
};

RandomBatch MakeBatch(int64_t bags, int64_t max_len, int64_t rows, std::mt19937& rng) {
  RandomBatch b;
  std::uniform_int_distribution<int64_t> len(0, max_len), id(0, rows - 1);
  std::uniform_real_distribution<float> w(-2.0f, 2.0f);
  b.offsets.push_back(0);
  for (int64_t i = 0; i < bags; ++i) {
    const int64_t n = len(rng);
    for (int64_t k = 0; k < n; ++k) {
      const int64_t x = id(rng);
      b.ids64.push_back(x);
      b.ids32.push_back(int32_t(x));
      b.weights.push_back(w(rng));
    }
    b.offsets.push_back(int64_t(b.ids64.size()));
  }
  return b;
}

kernels::LookupArgs Args(const RawTable& t, const RandomBatch& b, int id_type, bool weighted,
                         ops::CombinerKind c, int64_t max_len, float* out) {
  kernels::LookupArgs a;
  a.table = t.bytes.data();
  a.rows = t.rows;
  a.dim = t.dim;
  a.ids = id_type == 0 ? static_cast<const void*>(b.ids32.data()) : static_cast<const void*>(b.ids64.data());
  a.nnz = b.nnz();
  a.offsets = b.offsets.data();
  a.weights = weighted ? b.weights.data() : nullptr;
  a.combiner = c;
  a.max_sequence_length = max_len;
  a.out = out;
  return a;
}

// ------------------------------------------------------------ references
// Pooled: acc = 0; acc[d] += w_k * row_k[d] in id order; then / denominator.
std::vector<float> RefPooled(const RawTable& t, const RandomBatch& b, bool weighted, ops::CombinerKind c) {
  const int64_t dim = t.dim;
  std::vector<float> out(size_t(b.bags() * dim));
  for (int64_t bag = 0; bag < b.bags(); ++bag) {
    float* acc = &out[size_t(bag * dim)];
    float sw = 0.0f, sw2 = 0.0f;
    for (int64_t k = b.offsets[bag]; k < b.offsets[bag + 1]; ++k) {
      const float w = weighted ? b.weights[k] : 1.0f;
      const float* row = &t.values[size_t(b.ids64[k] * dim)];
      for (int64_t d = 0; d < dim; ++d) acc[d] += w * row[d];
      sw += w;
      sw2 += w * w;
    }
    float den = 1.0f;
    if (c == ops::CombinerKind::kMean) den = sw;
    if (c == ops::CombinerKind::kSqrtn) den = std::sqrt(sw2);
    if (c == ops::CombinerKind::kSum) continue;
    for (int64_t d = 0; d < dim; ++d) acc[d] = den == 0.0f ? 0.0f : acc[d] / den;
  }
  return out;
}

// Flat: out[k] = w_k * row_k.
std::vector<float> RefFlat(const RawTable& t, const RandomBatch& b, bool weighted) {
  const int64_t dim = t.dim;
  std::vector<float> out(size_t(b.nnz() * dim));
  for (int64_t k = 0; k < b.nnz(); ++k) {
    const float w = weighted ? b.weights[k] : 1.0f;
    for (int64_t d = 0; d < dim; ++d) out[size_t(k * dim + d)] = w * t.values[size_t(b.ids64[k] * dim + d)];
  }
  return out;
}

// Padded: [bags, L, dim], bag truncated or zero-padded to L.
std::vector<float> RefPadded(const RawTable& t, const RandomBatch& b, bool weighted, int64_t len) {
  const int64_t dim = t.dim;
  std::vector<float> out(size_t(b.bags() * len * dim), 0.0f);
  for (int64_t bag = 0; bag < b.bags(); ++bag) {
    for (int64_t j = 0; j < len && b.offsets[bag] + j < b.offsets[bag + 1]; ++j) {
      const int64_t k = b.offsets[bag] + j;
      const float w = weighted ? b.weights[k] : 1.0f;
      for (int64_t d = 0; d < dim; ++d)
        out[size_t((bag * len + j) * dim + d)] = w * t.values[size_t(b.ids64[k] * dim + d)];
    }
  }
  return out;
}

// Counts the elements whose bits differ; reports the first few.
int64_t CompareBits(const std::vector<float>& got, const std::vector<float>& want, const std::string& what) {
  int64_t bad = 0;
  if (got.size() != want.size()) {
    embedcore_test::Fail(__FILE__, __LINE__, what + ": sizes differ");
    return 1;
  }
  for (size_t i = 0; i < got.size(); ++i) {
    if (Bits(got[i]) != Bits(want[i])) {
      if (++bad <= 3)
        embedcore_test::Fail(__FILE__, __LINE__,
                             what + ": element " + std::to_string(i) + " is " + embedcore_test::Show(got[i]) +
                                 ", want " + embedcore_test::Show(want[i]));
    }
  }
  return bad;
}

const char* DName(DType d) { return DTypeName(d); }

std::vector<const kernels::KernelSet*> KernelSets() {
  std::vector<const kernels::KernelSet*> sets = {&kernels::GenericKernels()};
  // The CPU first: a kernel set is built by code compiled for its instructions.
  if (CpuHasAvx2() && kernels::Avx2Kernels() != nullptr) sets.push_back(kernels::Avx2Kernels());
  if (CpuHasAvx512() && kernels::Avx512Kernels() != nullptr) sets.push_back(kernels::Avx512Kernels());
  return sets;
}

constexpr DType kDTypes[] = {DType::kFloat32, DType::kFloat16, DType::kBFloat16};
// Widths below, at and around the 8-float vectors, and a wide one.
// Each kernel set's tight loop (PooledBagsOfVectors) takes 1-8 whole vectors and a tail: AVX-512 dims 16-143,
// AVX2 8-71, generic 4-19; the rest take the general column blocks.
constexpr int64_t kDims[] = {1, 3, 7, 8, 9, 16, 17, 24, 32, 33, 48, 64, 80, 128, 130, 143, 144};

}  // namespace

EMBEDCORE_TEST(KernelSetsAvailable) {
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
  // The engine reads F16C from CPUID itself (clang's builtin does not take "f16c"): as GCC's builtin says.
  EMBEDCORE_EXPECT_EQ(kernels::CpuHasF16c(), bool(__builtin_cpu_supports("f16c")));
#endif
  EMBEDCORE_EXPECT_EQ(std::string(kernels::GenericKernels().name), std::string("generic"));
  if (CpuHasAvx2() && kernels::Avx2Kernels() != nullptr) {
    EMBEDCORE_EXPECT_EQ(std::string(kernels::Avx2Kernels()->name), std::string("avx2+f16c"));
  }
  if (CpuHasAvx512() && kernels::Avx512Kernels() != nullptr) {
    EMBEDCORE_EXPECT_EQ(std::string(kernels::Avx512Kernels()->name), std::string("avx512"));
  }
  const std::string active = kernels::ActiveKernels().name;
  const char* force = std::getenv("EMBEDCORE_KERNELS");
  const std::string cap = force != nullptr ? force : "";
  if (cap == "generic") {
    EMBEDCORE_EXPECT_EQ(active, std::string("generic"));
  } else if (CpuHasAvx512() && kernels::Avx512Kernels() != nullptr && cap != "avx2") {
    EMBEDCORE_EXPECT_EQ(active, std::string("avx512"));
  } else if (CpuHasAvx2() && kernels::Avx2Kernels() != nullptr) {
    EMBEDCORE_EXPECT_EQ(active, std::string("avx2+f16c"));
  }
  EMBEDCORE_EXPECT_EQ(GetBuildInfo().simd, active);
  if (KernelSets().size() < 3)
    std::printf("  (this CPU runs %zu of the 3 kernel sets: only those are checked against the reference)\n",
                KernelSets().size());
}

EMBEDCORE_TEST(PooledEqualsReferenceAndAcrossSets) {
  std::mt19937 rng(2024);
  const auto sets = KernelSets();
  for (DType dt : kDTypes) {
    for (int64_t dim : kDims) {
      const RawTable t = MakeTable(dt, 97, dim, rng);
      const RandomBatch b = MakeBatch(40, 12, t.rows, rng);
      for (ops::CombinerKind c : {ops::CombinerKind::kSum, ops::CombinerKind::kMean, ops::CombinerKind::kSqrtn}) {
        for (bool weighted : {false, true}) {
          const std::vector<float> want = RefPooled(t, b, weighted, c);
          for (const kernels::KernelSet* set : sets) {
            for (int it = 0; it < 2; ++it) {
              std::vector<float> got(want.size(), -7.0f);
              const auto a = Args(t, b, it, weighted, c, 0, got.data());
              // In two calls over bag ranges, as ParallelFor splits them.
              set->dtype[int(dt)].pooled[it](a, 0, b.bags() / 3);
              set->dtype[int(dt)].pooled[it](a, b.bags() / 3, b.bags());
              CompareBits(got, want,
                          std::string(set->name) + " pooled " + DName(dt) + " dim " + std::to_string(dim) +
                              " combiner " + std::to_string(int(c)) + (weighted ? " weighted" : "") +
                              (it ? " int64" : " int32"));
            }
          }
        }
      }
    }
  }
}

namespace {
// A uint8_rowwise table (rows of dim codes, a float32 scale and bias), as
// rowwise8::QuantizeRow8 makes it from random rows of varied scale and offset.
RawTable MakeRowwise8Table(int64_t rows, int64_t dim, std::mt19937& rng) {
  RawTable t{DType::kUInt8Rowwise, rows, dim, std::vector<uint8_t>(size_t(rows * (dim + 8))), {}};
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> scale(0.01f, 20.0f), offset(-5.0f, 5.0f);
  std::vector<float> row(static_cast<size_t>(dim));
  for (int64_t r = 0; r < rows; ++r) {
    const float s = scale(rng), o = offset(rng);
    for (float& x : row) x = s * normal(rng) + o;
    rowwise8::QuantizeRow8(row.data(), dim, &t.bytes[size_t(r * (dim + 8))]);
  }
  return t;
}

// The kernels' arithmetic (FBGEMM's 8-bit bags), spelled out: a pooled column starts at 0 and takes
// acc = fma(a_k, q_k, acc + c_k) with a_k = w_k * scale_k and c_k = w_k * bias_k, in id order, then / the
// denominator; a row alone is fma(a, q, c).
std::vector<float> RefRowwise8(const RawTable& t, const RandomBatch& b, bool weighted, ops::CombinerKind c,
                               int64_t len) {
  const int64_t dim = t.dim, rb = dim + 8;
  auto row = [&](int64_t k) { return &t.bytes[size_t(b.ids64[k] * rb)]; };
  auto w_of = [&](int64_t k) { return weighted ? b.weights[k] : 1.0f; };
  auto one = [&](int64_t k, float* out) {
    const float a = w_of(k) * rowwise8::Scale(row(k), dim), cc = w_of(k) * rowwise8::Bias(row(k), dim);
    for (int64_t d = 0; d < dim; ++d) out[d] = std::fma(a, float(row(k)[d]), cc);
  };
  if (c == ops::CombinerKind::kNone) {
    if (len == 0) {
      std::vector<float> out(size_t(b.nnz() * dim));
      for (int64_t k = 0; k < b.nnz(); ++k) one(k, &out[size_t(k * dim)]);
      return out;
    }
    std::vector<float> out(size_t(b.bags() * len * dim), 0.0f);
    for (int64_t bag = 0; bag < b.bags(); ++bag)
      for (int64_t j = 0; j < len && b.offsets[bag] + j < b.offsets[bag + 1]; ++j)
        one(b.offsets[bag] + j, &out[size_t((bag * len + j) * dim)]);
    return out;
  }
  std::vector<float> out(size_t(b.bags() * dim));
  for (int64_t bag = 0; bag < b.bags(); ++bag) {
    float* acc = &out[size_t(bag * dim)];
    float sw = 0.0f, sw2 = 0.0f;
    for (int64_t k = b.offsets[bag]; k < b.offsets[bag + 1]; ++k) {
      const float w = w_of(k), a = w * rowwise8::Scale(row(k), dim), cc = w * rowwise8::Bias(row(k), dim);
      for (int64_t d = 0; d < dim; ++d) acc[d] = std::fma(a, float(row(k)[d]), acc[d] + cc);
      sw += w;
      sw2 += w * w;
    }
    if (c == ops::CombinerKind::kSum) continue;
    const float den = c == ops::CombinerKind::kMean ? sw : std::sqrt(sw2);
    for (int64_t d = 0; d < dim; ++d) acc[d] = den == 0.0f ? 0.0f : acc[d] / den;
  }
  return out;
}
}  // namespace

// Every kernel set's 8-bit row-wise lookups (served uint8_rowwise checkpoints) give the reference's bits.
EMBEDCORE_TEST(Rowwise8LookupsEqualReferenceAndAcrossSets) {
  std::mt19937 rng(88);
  for (int64_t dim : kDims) {
    const RawTable t = MakeRowwise8Table(61, dim, rng);
    const RandomBatch b = MakeBatch(37, 11, t.rows, rng);
    for (const kernels::KernelSet* set : KernelSets()) {
      for (int it = 0; it < 2; ++it) {
        for (bool weighted : {false, true}) {
          const std::string what = std::string(set->name) + " rowwise8 dim " + std::to_string(dim) +
                                   (weighted ? " weighted" : "") + (it ? " int64" : " int32");
          for (ops::CombinerKind c : {ops::CombinerKind::kSum, ops::CombinerKind::kMean, ops::CombinerKind::kSqrtn}) {
            const std::vector<float> want = RefRowwise8(t, b, weighted, c, 0);
            std::vector<float> got(want.size(), -7.0f);
            const auto a = Args(t, b, it, weighted, c, 0, got.data());
            set->rowwise8.pooled[it](a, 0, b.bags() / 3);  // in two calls, as ParallelFor splits them
            set->rowwise8.pooled[it](a, b.bags() / 3, b.bags());
            CompareBits(got, want, what + " pooled " + std::to_string(int(c)));
          }
          const std::vector<float> flat = RefRowwise8(t, b, weighted, ops::CombinerKind::kNone, 0);
          std::vector<float> got(flat.size(), -7.0f);
          set->rowwise8.rows[it](Args(t, b, it, weighted, ops::CombinerKind::kNone, 0, got.data()), 0, b.nnz());
          CompareBits(got, flat, what + " rows");
          const std::vector<float> padded = RefRowwise8(t, b, weighted, ops::CombinerKind::kNone, 4);
          std::vector<float> got_padded(padded.size(), -7.0f);
          set->rowwise8.padded[it](Args(t, b, it, weighted, ops::CombinerKind::kNone, 4, got_padded.data()), 0,
                                   b.bags());
          CompareBits(got_padded, padded, what + " padded");
        }
      }
    }
  }
}

// A pooled output's rows strided apart (a collection's concatenated outputs), and ids outside the table read row 0.
EMBEDCORE_TEST(Rowwise8StridedOutputsAndOutsideIds) {
  std::mt19937 rng(5);
  for (int64_t dim : {int64_t(3), int64_t(16), int64_t(130)}) {
    const RawTable t = MakeRowwise8Table(13, dim, rng);
    RandomBatch b = MakeBatch(9, 6, t.rows, rng);
    RandomBatch zeros = b;
    for (size_t k = 0; k < b.ids64.size(); k += 2) {
      b.ids64[k] = k % 4 == 0 ? (int64_t(1) << 40) : -5;
      b.ids32[k] = k % 4 == 0 ? (1 << 30) : -5;
      zeros.ids64[k] = zeros.ids32[k] = 0;
    }
    const std::vector<float> want = RefRowwise8(t, zeros, true, ops::CombinerKind::kMean, 0);
    for (const kernels::KernelSet* set : KernelSets()) {
      for (int it = 0; it < 2; ++it) {
        const int64_t stride = dim + 5;
        std::vector<float> wide(size_t(b.bags() * stride), -3.0f);
        auto a = Args(t, b, it, true, ops::CombinerKind::kMean, 0, wide.data());
        a.out_stride = stride;
        set->rowwise8.pooled[it](a, 0, b.bags());
        std::vector<float> got;
        for (int64_t bag = 0; bag < b.bags(); ++bag) {
          got.insert(got.end(), wide.begin() + bag * stride, wide.begin() + bag * stride + dim);
          for (int64_t d = dim; d < stride; ++d) EMBEDCORE_EXPECT_BITS_EQ(wide[size_t(bag * stride + d)], -3.0f);
        }
        CompareBits(got, want, std::string(set->name) + " rowwise8 strided, outside ids, dim " + std::to_string(dim));
      }
    }
  }
}

namespace {
// Band [c0, c0 + cols) of every row of `t` (uint8_rowwise: whole rows), each row copied to a place of its own
// (rows of no common base, as the files of a sharded checkpoint map them), and the batch's ids as those rows'
// addresses (kernels::RowAddress).
struct ScatteredBand {
  std::vector<std::vector<uint8_t>> rows;
  std::vector<kernels::RowAddress> at;
};

ScatteredBand Scatter(const RawTable& t, const RandomBatch& b, int64_t c0, int64_t cols) {
  const size_t es = t.dtype == DType::kUInt8Rowwise ? 1 : DTypeSize(t.dtype);
  const size_t stored = t.dtype == DType::kUInt8Rowwise ? size_t(t.dim + 8) : size_t(t.dim) * es;
  const size_t band = t.dtype == DType::kUInt8Rowwise ? stored : size_t(cols) * es;
  ScatteredBand s;
  for (int64_t r = 0; r < t.rows; ++r) {
    const uint8_t* row = &t.bytes[size_t(r) * stored] + size_t(c0) * es;
    s.rows.emplace_back(row, row + band);
  }
  for (int64_t k = 0; k < b.nnz(); ++k) s.at.push_back({s.rows[size_t(b.ids64[k])].data()});
  return s;
}
}  // namespace

// Rows given by their addresses (a checkpoint served from several files) give the id kernels' bits: pooled,
// flat and padded rows of every dtype and of uint8_rowwise, and pooled bags a band of columns at a time into
// the whole output (out_stride), whatever the split of the columns.
EMBEDCORE_TEST(RowAddressLookupsEqualIdLookups) {
  std::mt19937 rng(35);
  for (int64_t dim : kDims) {
    const RandomBatch b = MakeBatch(23, 9, 29, rng);
    std::vector<RawTable> tables;
    for (DType dt : kDTypes) tables.push_back(MakeTable(dt, 29, dim, rng));
    tables.push_back(MakeRowwise8Table(29, dim, rng));
    for (const RawTable& t : tables) {
      const bool q8 = t.dtype == DType::kUInt8Rowwise;
      for (const kernels::KernelSet* set : KernelSets()) {
        const kernels::BagsFn* pooled = q8 ? set->rowwise8.pooled : set->dtype[int(t.dtype)].pooled;
        const kernels::BagsFn* padded = q8 ? set->rowwise8.padded : set->dtype[int(t.dtype)].padded;
        const kernels::RowsFn* rows = q8 ? set->rowwise8.rows : set->dtype[int(t.dtype)].rows;
        const std::string what = std::string(set->name) + " " + DName(t.dtype) + " dim " + std::to_string(dim);
        const ScatteredBand whole = Scatter(t, b, 0, dim);
        for (bool weighted : {false, true}) {
          for (ops::CombinerKind c : {ops::CombinerKind::kSum, ops::CombinerKind::kMean, ops::CombinerKind::kSqrtn}) {
            std::vector<float> want(size_t(b.bags() * dim)), got(want.size(), -7.0f);
            pooled[1](Args(t, b, 1, weighted, c, 0, want.data()), 0, b.bags());
            auto a = Args(t, b, 1, weighted, c, 0, got.data());
            a.ids = whole.at.data();
            a.table = nullptr;
            pooled[kernels::kRowAddresses](a, 0, b.bags() / 2);
            pooled[kernels::kRowAddresses](a, b.bags() / 2, b.bags());
            CompareBits(got, want, what + " pooled by address " + std::to_string(int(c)));
            // Bands of columns (a column-wise save), each pooled into its columns of the whole output.
            for (int64_t split : {int64_t(1), dim / 2, dim - 1}) {
              if (q8 || split <= 0 || split >= dim) continue;  // (8-bit rows are stored whole: one band)
              std::vector<float> banded(want.size(), -7.0f);
              for (const auto& [c0, cols] : {std::pair<int64_t, int64_t>{0, split}, {split, dim - split}}) {
                const ScatteredBand band = Scatter(t, b, c0, cols);
                auto ab = Args(t, b, 1, weighted, c, 0, banded.data() + c0);
                ab.ids = band.at.data();
                ab.table = nullptr;
                ab.dim = cols;
                ab.out_stride = dim;
                pooled[kernels::kRowAddresses](ab, 0, b.bags());
              }
              CompareBits(banded, want, what + " pooled by address in bands split at " + std::to_string(split));
            }
          }
          std::vector<float> want(size_t(b.nnz() * dim)), got(want.size(), -7.0f);
          rows[1](Args(t, b, 1, weighted, ops::CombinerKind::kNone, 0, want.data()), 0, b.nnz());
          auto a = Args(t, b, 1, weighted, ops::CombinerKind::kNone, 0, got.data());
          a.ids = whole.at.data();
          rows[kernels::kRowAddresses](a, 0, b.nnz());
          CompareBits(got, want, what + " rows by address");
          std::vector<float> want_padded(size_t(b.bags() * 4 * dim), -7.0f), got_padded(want_padded.size(), -7.0f);
          padded[1](Args(t, b, 1, weighted, ops::CombinerKind::kNone, 4, want_padded.data()), 0, b.bags());
          auto ap = Args(t, b, 1, weighted, ops::CombinerKind::kNone, 4, got_padded.data());
          ap.ids = whole.at.data();
          padded[kernels::kRowAddresses](ap, 0, b.bags());
          CompareBits(got_padded, want_padded, what + " padded by address");
        }
      }
    }
  }
}

// A table whose last row ends where its memory ends, an inaccessible page after it: every kernel set reads
// no byte past a row (the AVX-512 set's masked loads of 16-bit rows narrower than a vector, and of a row's
// last columns, load only the row's elements), and gives the generic set's bits.
EMBEDCORE_TEST(RowsEndingAtAnInaccessiblePageAreReadWithinThemselves) {
  const size_t page = size_t(::sysconf(_SC_PAGESIZE));
  void* map = ::mmap(nullptr, 2 * page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  EMBEDCORE_EXPECT(map != MAP_FAILED);
  if (map == MAP_FAILED) return;
  const bool guarded = ::mprotect(static_cast<char*>(map) + page, page, PROT_NONE) == 0;
  EMBEDCORE_EXPECT(guarded);
  if (!guarded) return;
  std::mt19937 rng(12);
  for (DType dt : {DType::kFloat16, DType::kBFloat16}) {
    for (int64_t dim : {int64_t(2), int64_t(3), int64_t(8), int64_t(15), int64_t(17), int64_t(20), int64_t(40),
                        int64_t(150)}) {
      const RawTable t = MakeTable(dt, 5, dim, rng);
      char* end = static_cast<char*>(map) + page;  // the table's last byte is the page's
      char* at = end - t.bytes.size();
      std::memcpy(at, t.bytes.data(), t.bytes.size());
      const RandomBatch b = MakeBatch(6, 5, t.rows, rng);
      std::vector<float> want(size_t(b.bags() * dim));
      auto a = Args(t, b, 1, true, ops::CombinerKind::kSum, 0, want.data());
      kernels::GenericKernels().dtype[int(dt)].pooled[1](a, 0, b.bags());
      a.table = at;
      for (const kernels::KernelSet* set : KernelSets()) {
        std::vector<float> got(want.size(), -7.0f);
        a.out = got.data();
        set->dtype[int(dt)].pooled[1](a, 0, b.bags());
        CompareBits(got, want, std::string(set->name) + " " + DName(dt) + " dim " + std::to_string(dim) +
                                   " at the end of its memory");
      }
    }
  }
  ::munmap(map, 2 * page);
}

EMBEDCORE_TEST(IdsOutsideTheTableReadRowZero) {
  // The kernels take each row's address through SafeRow: an id that left
  // [0, rows) after validation (a caller's thread rewrote it) reads row 0,
  // never memory outside the table.
  std::mt19937 rng(7);
  for (DType dt : kDTypes) {
    for (int64_t dim : kDims) {
      const RawTable t = MakeTable(dt, 13, dim, rng);
      RandomBatch b = MakeBatch(6, 9, t.rows, rng);
      RandomBatch zeros = b;
      for (size_t k = 0; k < b.ids64.size(); k += 2) {
        b.ids64[k] = k % 4 == 0 ? (int64_t(1) << 40) : -5;
        b.ids32[k] = k % 4 == 0 ? (1 << 30) : -5;
        zeros.ids64[k] = zeros.ids32[k] = 0;
      }
      for (const kernels::KernelSet* set : KernelSets()) {
        for (int it = 0; it < 2; ++it) {
          std::vector<float> got(size_t(b.bags() * dim)), want(got.size());
          set->dtype[int(dt)].pooled[it](Args(t, b, it, true, ops::CombinerKind::kMean, 0, got.data()), 0, b.bags());
          set->dtype[int(dt)].pooled[it](Args(t, zeros, it, true, ops::CombinerKind::kMean, 0, want.data()), 0,
                                         zeros.bags());
          CompareBits(got, want, std::string(set->name) + " outside ids " + DName(dt) + " dim " + std::to_string(dim));
          std::vector<float> rows(size_t(b.nnz() * dim)), want_rows(rows.size());
          set->dtype[int(dt)].rows[it](Args(t, b, it, false, ops::CombinerKind::kSum, 0, rows.data()), 0, b.nnz());
          set->dtype[int(dt)].rows[it](Args(t, zeros, it, false, ops::CombinerKind::kSum, 0, want_rows.data()), 0,
                                       zeros.nnz());
          CompareBits(rows, want_rows, std::string(set->name) + " outside ids, rows " + DName(dt));
          std::vector<float> padded(size_t(b.bags() * 4 * dim)), want_padded(padded.size());
          set->dtype[int(dt)].padded[it](Args(t, b, it, true, ops::CombinerKind::kSum, 4, padded.data()), 0, b.bags());
          set->dtype[int(dt)].padded[it](Args(t, zeros, it, true, ops::CombinerKind::kSum, 4, want_padded.data()), 0,
                                         zeros.bags());
          CompareBits(padded, want_padded, std::string(set->name) + " outside ids, padded " + DName(dt));
          const std::vector<int64_t> groups = {0, 2, b.bags()};
          std::vector<float> grouped(size_t(2 * dim)), want_grouped(grouped.size());
          set->dtype[int(dt)].grouped[it](Args(t, b, it, true, ops::CombinerKind::kSum, 0, grouped.data()),
                                          groups.data(), 0, 2);
          set->dtype[int(dt)].grouped[it](Args(t, zeros, it, true, ops::CombinerKind::kSum, 0, want_grouped.data()),
                                          groups.data(), 0, 2);
          CompareBits(grouped, want_grouped, std::string(set->name) + " outside ids, grouped " + DName(dt));
        }
      }
    }
  }
}

EMBEDCORE_TEST(GroupedEqualsReferenceAndAcrossSets) {
  // Output row g = the reference sum of bag groups[g], then + each later bag
  // of the group in order; empty groups are zeros.
  std::mt19937 rng(515);
  const auto sets = KernelSets();
  for (DType dt : kDTypes) {
    for (int64_t dim : kDims) {
      const RawTable t = MakeTable(dt, 61, dim, rng);
      const RandomBatch b = MakeBatch(45, 12, t.rows, rng);
      std::vector<int64_t> groups{0};
      while (groups.back() < b.bags()) groups.push_back(std::min<int64_t>(b.bags(), groups.back() + int64_t(rng() % 5)));
      const int64_t ng = int64_t(groups.size()) - 1;
      for (bool weighted : {false, true}) {
        const std::vector<float> bags = RefPooled(t, b, weighted, ops::CombinerKind::kSum);
        std::vector<float> want(size_t(ng * dim), 0.0f);
        for (int64_t g = 0; g < ng; ++g)
          for (int64_t k = groups[size_t(g)]; k < groups[size_t(g) + 1]; ++k)
            for (int64_t d = 0; d < dim; ++d) {
              float& o = want[size_t(g * dim + d)];
              o = k == groups[size_t(g)] ? bags[size_t(k * dim + d)] : o + bags[size_t(k * dim + d)];
            }
        for (const kernels::KernelSet* set : sets) {
          for (int it = 0; it < 2; ++it) {
            std::vector<float> got(want.size(), -7.0f);
            const auto a = Args(t, b, it, weighted, ops::CombinerKind::kSum, 0, got.data());
            set->dtype[int(dt)].grouped[it](a, groups.data(), 0, ng / 2);
            set->dtype[int(dt)].grouped[it](a, groups.data(), ng / 2, ng);
            CompareBits(got, want,
                        std::string(set->name) + " grouped " + DName(dt) + " dim " + std::to_string(dim) +
                            (weighted ? " weighted" : "") + (it ? " int64" : " int32"));
          }
        }
      }
    }
  }
}

EMBEDCORE_TEST(FlatEqualsReferenceAndAcrossSets) {
  std::mt19937 rng(77);
  for (DType dt : kDTypes) {
    for (int64_t dim : kDims) {
      const RawTable t = MakeTable(dt, 50, dim, rng);
      const RandomBatch b = MakeBatch(30, 6, t.rows, rng);
      for (bool weighted : {false, true}) {
        const std::vector<float> want = RefFlat(t, b, weighted);
        for (const kernels::KernelSet* set : KernelSets()) {
          for (int it = 0; it < 2; ++it) {
            std::vector<float> got(want.size(), -7.0f);
            const auto a = Args(t, b, it, weighted, ops::CombinerKind::kNone, 0, got.data());
            set->dtype[int(dt)].rows[it](a, 0, b.nnz() / 2);
            set->dtype[int(dt)].rows[it](a, b.nnz() / 2, b.nnz());
            CompareBits(got, want, std::string(set->name) + " flat " + DName(dt) + " dim " + std::to_string(dim));
          }
        }
      }
    }
  }
}

EMBEDCORE_TEST(PaddedEqualsReferenceAndAcrossSets) {
  std::mt19937 rng(31337);
  for (DType dt : kDTypes) {
    for (int64_t dim : kDims) {
      const RawTable t = MakeTable(dt, 64, dim, rng);
      const RandomBatch b = MakeBatch(25, 9, t.rows, rng);
      for (int64_t len : {1, 4, 9, 12}) {  // truncating, padding, both
        for (bool weighted : {false, true}) {
          const std::vector<float> want = RefPadded(t, b, weighted, len);
          for (const kernels::KernelSet* set : KernelSets()) {
            for (int it = 0; it < 2; ++it) {
              std::vector<float> got(want.size(), -7.0f);  // padding must be written, not assumed
              const auto a = Args(t, b, it, weighted, ops::CombinerKind::kNone, len, got.data());
              set->dtype[int(dt)].padded[it](a, 0, 10);
              set->dtype[int(dt)].padded[it](a, 10, b.bags());
              CompareBits(got, want,
                          std::string(set->name) + " padded " + DName(dt) + " dim " + std::to_string(dim) +
                              " L " + std::to_string(len));
            }
          }
        }
      }
    }
  }
}

EMBEDCORE_TEST(EmptyBatchAndEmptyBags) {
  std::mt19937 rng(5);
  for (const kernels::KernelSet* set : KernelSets()) {
    for (DType dt : kDTypes) {
      const RawTable t = MakeTable(dt, 4, 9, rng);
      RandomBatch b;
      b.offsets = std::vector<int64_t>(4, 0);  // three empty bags
      for (ops::CombinerKind c : {ops::CombinerKind::kSum, ops::CombinerKind::kMean, ops::CombinerKind::kSqrtn}) {
        std::vector<float> got(3 * 9, -7.0f);
        const auto a = Args(t, b, 1, false, c, 0, got.data());
        set->dtype[int(dt)].pooled[1](a, 0, 3);
        for (float v : got) EMBEDCORE_EXPECT_BITS_EQ(v, 0.0f);
      }
      std::vector<float> padded(3 * 2 * 9, -7.0f);
      const auto a = Args(t, b, 1, false, ops::CombinerKind::kNone, 2, padded.data());
      set->dtype[int(dt)].padded[1](a, 0, 3);
      for (float v : padded) EMBEDCORE_EXPECT_BITS_EQ(v, 0.0f);
      set->dtype[int(dt)].rows[1](a, 0, 0);  // nothing to do, nothing touched
    }
  }
}

EMBEDCORE_TEST(ZeroWeightsGiveZeroMeanAndSqrtn) {
  std::mt19937 rng(8);
  const RawTable t = MakeTable(DType::kFloat32, 10, 12, rng);
  RandomBatch b;
  b.ids64 = std::vector<int64_t>{1, 2, 3};
  b.ids32 = std::vector<int32_t>{1, 2, 3};
  b.offsets = std::vector<int64_t>{0, 2, 3};
  b.weights = std::vector<float>{1.0f, -1.0f, 0.0f};  // bag 0: sum of weights 0; bag 1: all weights 0
  for (const kernels::KernelSet* set : KernelSets()) {
    std::vector<float> got(2 * 12, -7.0f);
    set->dtype[0].pooled[1](Args(t, b, 1, true, ops::CombinerKind::kMean, 0, got.data()), 0, 2);
    for (float v : got) EMBEDCORE_EXPECT_BITS_EQ(v, 0.0f);
    std::fill(got.begin(), got.end(), -7.0f);
    set->dtype[0].pooled[1](Args(t, b, 1, true, ops::CombinerKind::kSqrtn, 0, got.data()), 0, 2);
    for (int d = 0; d < 12; ++d) EMBEDCORE_EXPECT_NE(got[d], 0.0f);  // sqrt(2) != 0: a real row
    for (int d = 12; d < 24; ++d) EMBEDCORE_EXPECT_BITS_EQ(got[d], 0.0f);
  }
}

EMBEDCORE_TEST(LoadStoreAgreeAcrossSets) {
  // Random finite floats, specials, ties and subnormals: store, then load,
  // through every set, equals the scalar conversions of ops/half.h.
  std::mt19937 rng(11);
  std::vector<float> src;
  std::normal_distribution<float> normal(0.0f, 100.0f);
  for (int i = 0; i < 4000; ++i) src.push_back(normal(rng));
  for (int i = 0; i < 4000; ++i) {
    const float f = ops::BitsFloat(uint32_t(rng()));
    if (!std::isnan(f)) src.push_back(f);
  }
  const float specials[] = {0.0f, -0.0f, 1.0f + 0x1p-11f, 1.0f + 0x1p-8f, 65504.0f, 65520.0f, -65520.0f,
                            0x1p-24f, 0x1p-25f, 3 * 0x1p-25f, 1023.5f * 0x1p-24f, 1e-30f, -1e-30f,
                            std::numeric_limits<float>::max(), std::numeric_limits<float>::denorm_min(),
                            std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity()};
  for (float f : specials) src.push_back(f);
  while (src.size() % 16 != 11) src.push_back(0.5f);
  // Tails after the last full vector of 8 (AVX2) or 16 (AVX-512) lanes: 3, and 8 + 3 or 3 (its half-width step);
  // the arrays rotated so that the specials, which end 11 before the end, pass through each tail.
  const std::vector<float> original = src;
  for (const int64_t n : {int64_t(src.size()), int64_t(src.size()) - 8}) {
    for (const size_t rotation : {0, 11, 17}) {
      src = original;
      std::rotate(src.rbegin(), src.rbegin() + std::ptrdiff_t(rotation), src.rend());  // (to the right)
      for (const kernels::KernelSet* set : KernelSets()) {
        for (DType dt : kDTypes) {
          std::vector<uint8_t> stored(size_t(n) * DTypeSize(dt));
          set->dtype[int(dt)].store(stored.data(), src.data(), n);
          std::vector<float> loaded(static_cast<size_t>(n));
          set->dtype[int(dt)].load(stored.data(), loaded.data(), n);
          int64_t bad = 0;
          for (int64_t i = 0; i < n; ++i) {
            float want = src[size_t(i)];
            if (dt == DType::kFloat16) want = ops::HalfToFloat(ops::FloatToHalf(want));
            if (dt == DType::kBFloat16) want = ops::BFloat16ToFloat(ops::FloatToBFloat16(want));
            if (Bits(loaded[size_t(i)]) != Bits(want) && ++bad <= 3)
              embedcore_test::Fail(__FILE__, __LINE__,
                                   std::string(set->name) + " " + DName(dt) + " store/load of " +
                                       embedcore_test::Show(src[size_t(i)]) + " gave " +
                                       embedcore_test::Show(loaded[size_t(i)]) + ", want " +
                                       embedcore_test::Show(want));
          }
        }
      }
    }
  }
}

EMBEDCORE_TEST(LoadAllHalfAndBFloat16Patterns) {
  // Every 16-bit pattern, NaNs included, loads to the same float bits in every set.
  std::vector<uint16_t> all(65536);
  for (uint32_t i = 0; i < 65536; ++i) all[i] = uint16_t(i);
  for (const kernels::KernelSet* set : KernelSets()) {
    std::vector<float> f16(65536), bf16(65536);
    set->dtype[int(DType::kFloat16)].load(all.data(), f16.data(), 65536);
    set->dtype[int(DType::kBFloat16)].load(all.data(), bf16.data(), 65536);
    for (uint32_t i = 0; i < 65536; ++i) {
      const bool half_nan = (i & 0x7c00) == 0x7c00 && (i & 0x3ff) != 0;
      if (half_nan) EMBEDCORE_EXPECT(std::isnan(f16[i]));
      EMBEDCORE_EXPECT_BITS_EQ(f16[i], ops::HalfToFloat(uint16_t(i)));
      EMBEDCORE_EXPECT_BITS_EQ(bf16[i], ops::BFloat16ToFloat(uint16_t(i)));
    }
  }
}

EMBEDCORE_TEST(StoreNaNStaysNaN) {
  // NaN never becomes inf or a number, and keeps its sign, in every set and
  // at every position (vector body and scalar tail).
  std::vector<float> src(11);
  for (size_t i = 0; i < src.size(); ++i)
    src[i] = ops::BitsFloat((i % 2 ? 0xff800000u : 0x7f800000u) | uint32_t(1u << (i % 23)));
  for (const kernels::KernelSet* set : KernelSets()) {
    for (DType dt : {DType::kFloat16, DType::kBFloat16}) {
      std::vector<uint16_t> stored(src.size());
      set->dtype[int(dt)].store(stored.data(), src.data(), int64_t(src.size()));
      for (size_t i = 0; i < src.size(); ++i) {
        const uint16_t h = stored[i];
        const bool nan = dt == DType::kFloat16 ? ((h & 0x7c00) == 0x7c00 && (h & 0x3ff) != 0)
                                               : ((h & 0x7f80) == 0x7f80 && (h & 0x7f) != 0);
        EMBEDCORE_EXPECT_MSG(nan, set->name << " " << DName(dt) << " element " << i << " stored as 0x" << std::hex
                                            << h);
        EMBEDCORE_EXPECT_EQ(bool(h & 0x8000), bool(i % 2));
        // Same bits as the scalar conversion, vector body and tail alike.
        const uint16_t scalar = dt == DType::kFloat16 ? ops::FloatToHalf(src[i]) : ops::FloatToBFloat16(src[i]);
        EMBEDCORE_EXPECT_EQ(h, scalar);
      }
    }
  }
}

EMBEDCORE_TEST(StoreBFloat16BitsEqualScalarForNaNs) {
  // The vector bfloat16 stores quiet NaNs exactly as ops::FloatToBFloat16 does.
  std::vector<float> src;
  for (uint32_t payload : {0x1u, 0x10000u, 0x200000u, 0x400000u, 0x7fffffu, 0x12345u, 0x3f0000u, 0x5a5a5au})
    for (uint32_t sign : {0u, 0x80000000u}) src.push_back(ops::BitsFloat(sign | 0x7f800000u | payload));
  for (const kernels::KernelSet* set : KernelSets()) {
    std::vector<uint16_t> stored(src.size());
    set->dtype[int(DType::kBFloat16)].store(stored.data(), src.data(), int64_t(src.size()));
    for (size_t i = 0; i < src.size(); ++i) EMBEDCORE_EXPECT_EQ(stored[i], ops::FloatToBFloat16(src[i]));
  }
}

namespace {

// The reference step: each group's gradient summed from zero in occurrence
// order, then ops::UpdateElement on every element, through float32.
template <typename Rule>
void RefUpdate(const Rule& rule, const ops::StepConstants& kc, RawTable& t, std::vector<float>* slots,
               const std::vector<kernels::Occurrence>& occ, const std::vector<int64_t>& start) {
  const int64_t dim = t.dim;
  for (size_t g = 0; g + 1 < start.size(); ++g) {
    const int64_t r = int64_t(occ[size_t(start[g])].key);
    for (int64_t d = 0; d < dim; ++d) {
      float sum = 0.0f;
      for (int64_t i = start[g]; i < start[g + 1]; ++i) sum += occ[size_t(i)].coefficient * occ[size_t(i)].grad[d];
      float w = t.values[size_t(r * dim + d)];
      ops::UpdateElement(rule, kc, w, sum, Rule::kSlots > 0 ? &slots[0][size_t(r * dim + d)] : nullptr,
                         Rule::kSlots > 1 ? &slots[1][size_t(r * dim + d)] : nullptr);
      if (t.dtype == DType::kFloat16) w = ops::HalfToFloat(ops::FloatToHalf(w));
      if (t.dtype == DType::kBFloat16) w = ops::BFloat16ToFloat(ops::FloatToBFloat16(w));
      t.values[size_t(r * dim + d)] = w;
    }
  }
}

template <typename Rule>
void CheckUpdate(const Rule& rule, const char* rule_name, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> positive(0.1f, 1.0f);
  const int64_t rows = 29, n = 90;
  for (DType dt : kDTypes) {
    for (int64_t dim : kDims) {
      // Clipping and decay off, then all on.
      for (bool extras : {false, true}) {
        ops::StepConstants kc;
        kc.lr = 0.05f;
        if (extras) {
          kc.weight_decay = 0.01f;
          kc.clip_gradient = true;
          kc.clip_gradient_min = -0.7f;
          kc.clip_gradient_max = 0.6f;
          kc.clip_weight_min = kc.clip_weight_max = true;
          kc.weight_min = -1.5f;
          kc.weight_max = 1.2f;
        }
        const RawTable start_table = MakeTable(dt, rows, dim, rng);
        std::vector<float> slot_init[2];
        for (auto& s : slot_init) {
          s.resize(size_t(rows * dim));
          for (float& v : s) v = positive(rng);  // accumulators must be positive
        }
        // n occurrences of ids with repeats (a few rows many times), sorted stably by id.
        std::vector<float> grads(size_t(n * dim));
        for (float& v : grads) v = normal(rng);
        std::vector<kernels::Occurrence> occ;
        for (int64_t i = 0; i < n; ++i)
          occ.push_back({uint64_t(rng() % 4 == 0 ? rng() % 3 : rng() % uint32_t(rows)), grads.data() + i * dim,
                         normal(rng)});
        std::stable_sort(occ.begin(), occ.end(), [](const auto& a, const auto& b) { return a.key < b.key; });
        std::vector<int64_t> start;
        for (size_t i = 0; i < occ.size(); ++i)
          if (i == 0 || occ[i].key != occ[i - 1].key) start.push_back(int64_t(i));
        start.push_back(int64_t(occ.size()));
        const int64_t groups = int64_t(start.size()) - 1;

        RawTable want = start_table;
        std::vector<float> want_slots[2] = {slot_init[0], slot_init[1]};
        RefUpdate(rule, kc, want, want_slots, occ, start);
        for (const kernels::KernelSet* set : KernelSets()) {
          RawTable got = start_table;
          std::vector<float> got_slots[2] = {slot_init[0], slot_init[1]};
          kernels::UpdateArgs a;
          a.values = got.bytes.data();
          a.slots[0] = got_slots[0].data();
          a.slots[1] = got_slots[1].data();
          a.dim = dim;
          a.occurrences = occ.data();
          a.group_start = start.data();
          a.constants = kc;
          // In two calls over group ranges, as ParallelFor splits them.
          const auto fn = set->dtype[int(dt)].Update(rule);
          fn(rule, a, 0, groups / 2);
          fn(rule, a, groups / 2, groups);
          std::vector<float> values(size_t(rows * dim));
          set->dtype[int(dt)].load(got.bytes.data(), values.data(), rows * dim);
          const std::string what = std::string(set->name) + " " + rule_name + " " + DName(dt) + " dim " +
                                   std::to_string(dim) + (extras ? " with clipping and decay" : "");
          CompareBits(values, want.values, what + " values");
          for (int s = 0; s < Rule::kSlots; ++s) CompareBits(got_slots[s], want_slots[s], what + " slot " + std::to_string(s));
        }
      }
    }
  }
}

}  // namespace

EMBEDCORE_TEST(UpdateEqualsReferenceAndAcrossSets) {
  std::mt19937 rng(77);
  CheckUpdate(ops::SgdRule{0.05f}, "sgd", rng);
  CheckUpdate(ops::AdagradRule{0.05f, 0.0f}, "adagrad", rng);
  CheckUpdate(ops::AdagradRule{0.05f, 1e-10f}, "adagrad eps", rng);
  CheckUpdate(ops::AdamRule{0.05f, 0.9f, 0.999f, 1e-7f, true}, "adam", rng);
  CheckUpdate(ops::AdamRule{0.05f, 0.9f, 0.999f, 1e-7f, false}, "adam eps outside", rng);
  CheckUpdate(ops::FtrlRule{0.05f, -0.5f, 0.01f, 0.02f, 0.1f, false}, "ftrl", rng);
  CheckUpdate(ops::FtrlRule{0.05f, -0.5f, 0.01f, 0.02f, 0.1f, true}, "ftrl lr-linear", rng);
  CheckUpdate(ops::FtrlRule{0.05f, -0.3f, 0.0f, 0.0f, 0.0f, false}, "ftrl power -0.3", rng);
}
