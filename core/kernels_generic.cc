// The portable build of the lookup kernels: plain loops the compiler may
// vectorize for the baseline instruction set.
#include "kernels.h"
#include "ops/half.h"

namespace embedcore::kernels {
namespace {

template <typename T>
struct ScalarRows {
  // Blocks of up to 4 "vectors" of 4 columns, summed in a local array the
  // compiler may keep in registers.
  static constexpr int kLanes = 4;
  static constexpr int kVectors = 4;
  static float ToFloat(T x) { return ops::ToFloat(x); }
  template <typename I>
  static bool PoolMasked(float*, const T*, int64_t, int64_t, int64_t, int64_t, const I*, int64_t, int64_t,
                         const float*, int64_t, int64_t) {
    return false;  // (no masked loads: the scalar loops)
  }
  template <int NV, typename I>
  static void Pool(float* out, const T* table, int64_t rows, int64_t dim, int64_t c0, const I* ids, int64_t k0,
                   int64_t k1, const float* weights, int64_t pf_end, int64_t row_bytes) {
    constexpr int64_t kCols = int64_t(NV) * kLanes;
    float acc[kCols] = {};
    for (int64_t k = k0; k < k1; ++k) {
      if (k + kPrefetchIds<T> < pf_end) PrefetchLines(AheadAt(table, ids, k + kPrefetchIds<T>, dim), row_bytes);
      const T* row = RowAt(table, ids, k, rows, dim) + c0;
      const float w = weights ? weights[k] : 1.0f;
      for (int64_t d = 0; d < kCols; ++d) acc[d] += w * ops::ToFloat(row[d]);
    }
    for (int64_t d = 0; d < kCols; ++d) out[d] = acc[d];
  }
  template <int NV, typename I>
  static void PoolGroup(float* out, const T* table, int64_t rows, int64_t dim, int64_t c0, const I* ids,
                        const int64_t* offsets, int64_t p0, int64_t p1, const float* weights, int64_t pf_end,
                        int64_t row_bytes) {
    constexpr int64_t kCols = int64_t(NV) * kLanes;
    float acc[kCols] = {}, s[kCols];  // (acc is set from the first bag; zeroed so that no compiler doubts it)
    for (int64_t p = p0; p < p1; ++p) {
      Pool<NV>(s, table, rows, dim, c0, ids, offsets[p], offsets[p + 1], weights, pf_end, row_bytes);
      for (int64_t d = 0; d < kCols; ++d) acc[d] = p == p0 ? s[d] : acc[d] + s[d];
    }
    for (int64_t d = 0; d < kCols; ++d) out[d] = acc[d];
  }
  static void Axpy(float* acc, const T* row, float w, int64_t dim) {
    for (int64_t d = 0; d < dim; ++d) acc[d] += w * ops::ToFloat(row[d]);
  }
  static void Scale(float* out, const T* row, float w, int64_t dim) {
    for (int64_t d = 0; d < dim; ++d) out[d] = w * ops::ToFloat(row[d]);
  }
  static void SubScaled(float* w, const float* g, float c, float lr, int64_t dim) {
    for (int64_t d = 0; d < dim; ++d) w[d] = ops::SgdInOrderElement(w[d], lr, c, g[d]);
  }
  // uint8_rowwise rows: as SimdRows::PoolQ8 and ScaleQ8, the same operations.
  template <int NV, typename I>
  static void PoolQ8(float* out, const uint8_t* table, int64_t rows, int64_t dim, int64_t c0, const I* ids,
                     int64_t k0, int64_t k1, const float* weights, int64_t pf_end) {
    constexpr int64_t kCols = int64_t(NV) * kLanes;
    const int64_t rb = dim + rowwise8::kExtraBytes;
    float acc[kCols] = {};
    for (int64_t k = k0; k < k1; ++k) {
      if (k + kPrefetchDistance < pf_end) PrefetchRowQ8(AheadAt(table, ids, k + kPrefetchDistance, rb), rb);
      const uint8_t* row = RowAt(table, ids, k, rows, rb);
      const float w = weights ? weights[k] : 1.0f;
      const float a = w * rowwise8::Scale(row, dim), b = w * rowwise8::Bias(row, dim);
      for (int64_t d = 0; d < kCols; ++d) acc[d] = std::fma(a, float(row[c0 + d]), acc[d] + b);
    }
    for (int64_t d = 0; d < kCols; ++d) out[d] = acc[d];
  }
  static void ScaleQ8(float* out, const uint8_t* q, float a, float c, int64_t dim) {
    for (int64_t d = 0; d < dim; ++d) out[d] = std::fma(a, float(q[d]), c);
  }
  static void Load(const T* row, float* dst, int64_t dim) {
    for (int64_t d = 0; d < dim; ++d) dst[d] = ops::ToFloat(row[d]);
  }
  static void Store(T* row, const float* src, int64_t dim) {
    for (int64_t d = 0; d < dim; ++d) row[d] = ops::FromFloat<T>(src[d]);
  }
};

#include "kernels_impl.h"

KernelSet Make() {
  KernelSet s;
  s.name = "generic";
  s.dtype[int(DType::kFloat32)] = MakeDTypeKernels<ScalarRows<float>, float>();
  s.dtype[int(DType::kFloat16)] = MakeDTypeKernels<ScalarRows<ops::F16>, ops::F16>();
  s.dtype[int(DType::kBFloat16)] = MakeDTypeKernels<ScalarRows<ops::BF16>, ops::BF16>();
  s.rowwise8 = MakeRowwise8Kernels<ScalarRows<float>>();
  return s;
}

}  // namespace

const KernelSet& GenericKernels() {
  static const KernelSet set = Make();
  return set;
}

}  // namespace embedcore::kernels
