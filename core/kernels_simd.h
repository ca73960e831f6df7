// The vector row policy of kernels_impl.h, written once over a vector type V
// that supplies, as static inline members:
//   Reg, kLanes                 the register type and its floats
//   Zero(), Set1(f), Add(a, b), Sub(a, b), Mul(a, b)
//   LoadF(const float*), StoreF(float*, r)
//   Load(const T*), Store(T*, r) for T in float, F16, BF16: kLanes stored
//       elements as floats, and back (round to nearest, ties to even)
//   LoadU8(const uint8_t*): kLanes bytes as floats (uint8_rowwise codes)
//   ToFloat(x) for x of float, F16, BF16: one stored element as a float
//   kMaskedLoads; where true, MaskOf(n), LoadMasked(const T*, mask) for T
//       in float, F16, BF16 (the first n elements, the others 0, nothing
//       read past them) and StoreMaskedF(float*, r, mask)
//   kHalfSteps; where true, LoadHalf(const T*, float*) and StoreHalf(T*,
//       const float*): kLanes / 2 elements as floats, and back
// Included by kernels_avx2.cc and kernels_avx512.cc after their target
// pragma, inside an anonymous namespace, so each ISA gets its own code.

// Sums of up to kMaxVectors vectors stay in registers across a bag's ids.
template <typename T, typename V, int kMaxVectors>
struct SimdRows {
  static constexpr int kLanes = V::kLanes;
  static constexpr int kVectors = kMaxVectors;
  using Reg = typename V::Reg;

  template <int NV, typename I>
  static void Pool(float* out, const T* table, int64_t rows, int64_t dim, int64_t c0, const I* ids, int64_t k0,
                   int64_t k1, const float* weights, int64_t pf_end, int64_t row_bytes) {
    Reg s[NV];
#pragma GCC unroll 16
    for (int j = 0; j < NV; ++j) s[j] = V::Zero();
    if (weights == nullptr) {  // w = 1: 1 * x == x, so the sums are the same bits without the multiply
      for (int64_t k = k0; k < k1; ++k) {
        if (k + kPrefetchIds<T> < pf_end) PrefetchLines(AheadAt(table, ids, k + kPrefetchIds<T>, dim), row_bytes);
        const T* row = RowAt(table, ids, k, rows, dim) + c0;
#pragma GCC unroll 16
        for (int j = 0; j < NV; ++j) s[j] = V::Add(s[j], V::Load(row + kLanes * j));
      }
    } else {
      for (int64_t k = k0; k < k1; ++k) {
        if (k + kPrefetchIds<T> < pf_end) PrefetchLines(AheadAt(table, ids, k + kPrefetchIds<T>, dim), row_bytes);
        const T* row = RowAt(table, ids, k, rows, dim) + c0;
        const Reg w = V::Set1(weights[k]);
#pragma GCC unroll 16
        for (int j = 0; j < NV; ++j) s[j] = V::Add(s[j], V::Mul(w, V::Load(row + kLanes * j)));
      }
    }
#pragma GCC unroll 16
    for (int j = 0; j < NV; ++j) V::StoreF(out + kLanes * j, s[j]);
  }

  // A group of bags [p0, p1) (p1 > p0), for the NV * kLanes columns from c0:
  // out[c] = ((s_p0 + s_p0+1) + ...) + s_p1-1, each bag's sum s_p pooled
  // from zero as Pool pools it; every sum stays in registers.
  template <int NV, typename I>
  static void PoolGroup(float* out, const T* table, int64_t rows, int64_t dim, int64_t c0, const I* ids,
                        const int64_t* offsets, int64_t p0, int64_t p1, const float* weights, int64_t pf_end,
                        int64_t row_bytes) {
    Reg acc[NV], s[NV];
#pragma GCC unroll 16
    for (int j = 0; j < NV; ++j) acc[j] = V::Zero();  // (set from the first bag; zeroed so that no compiler doubts it)
    for (int64_t p = p0; p < p1; ++p) {
#pragma GCC unroll 16
      for (int j = 0; j < NV; ++j) s[j] = V::Zero();
      for (int64_t k = offsets[p]; k < offsets[p + 1]; ++k) {
        if (k + kPrefetchIds<T> < pf_end) PrefetchLines(AheadAt(table, ids, k + kPrefetchIds<T>, dim), row_bytes);
        const T* row = RowAt(table, ids, k, rows, dim) + c0;
        if (weights == nullptr) {
#pragma GCC unroll 16
          for (int j = 0; j < NV; ++j) s[j] = V::Add(s[j], V::Load(row + kLanes * j));
        } else {
          const Reg w = V::Set1(weights[k]);
#pragma GCC unroll 16
          for (int j = 0; j < NV; ++j) s[j] = V::Add(s[j], V::Mul(w, V::Load(row + kLanes * j)));
        }
      }
#pragma GCC unroll 16
      for (int j = 0; j < NV; ++j) acc[j] = p == p0 ? s[j] : V::Add(acc[j], s[j]);
    }
#pragma GCC unroll 16
    for (int j = 0; j < NV; ++j) V::StoreF(out + kLanes * j, acc[j]);
  }

  // One element (a row narrower than a vector, a row's tail): ops::ToFloat's value, float16 by F16C (the
  // portable conversion's branches cost a narrow float16 table 4x a float32 one's time).
  static float ToFloat(T x) { return V::ToFloat(x); }

  // The n < kLanes columns from c0 of rows k0..k1 (kernels_impl.h) of a 16-bit table, 2 or more of them,
  // where V has masked loads (AVX-512: 8 float16 columns are one load and one conversion, where they were
  // 8 of each: 0.80 -> 0.47 ms for a table of 8 columns, 1.5 -> 0.90 for 40, a tail of 8); false else
  // (float32 rows, and single columns, were as fast or faster in the scalar loops). The same additions in
  // the same order as those loops.
  template <typename I>
  static bool PoolMasked(float* out, const T* table, int64_t rows, int64_t dim, int64_t c0, int64_t n, const I* ids,
                         int64_t k0, int64_t k1, const float* weights, int64_t pf_end, int64_t row_bytes) {
    if constexpr (V::kMaskedLoads && sizeof(T) == 2) {
      if (n < 2) return false;
      const auto mask = V::MaskOf(n);
      Reg s = V::Zero();
      for (int64_t k = k0; k < k1; ++k) {
        if (k + kPrefetchIds<T> < pf_end) PrefetchLines(AheadAt(table, ids, k + kPrefetchIds<T>, dim), row_bytes);
        const Reg x = V::LoadMasked(RowAt(table, ids, k, rows, dim) + c0, mask);
        s = weights == nullptr ? V::Add(s, x) : V::Add(s, V::Mul(V::Set1(weights[k]), x));  // (1 * x == x)
      }
      V::StoreMaskedF(out, s, mask);
      return true;
    } else {
      return false;
    }
  }

  static void Axpy(float* acc, const T* row, float w, int64_t dim) {
    const Reg wv = V::Set1(w);
    int64_t d = 0;
    for (; d + kLanes <= dim; d += kLanes) V::StoreF(acc + d, V::Add(V::LoadF(acc + d), V::Mul(wv, V::Load(row + d))));
    for (; d < dim; ++d) acc[d] += w * V::ToFloat(row[d]);
  }
  static void Scale(float* out, const T* row, float w, int64_t dim) {
    const Reg wv = V::Set1(w);
    int64_t d = 0;
    for (; d + kLanes <= dim; d += kLanes) V::StoreF(out + d, V::Mul(wv, V::Load(row + d)));
    for (; d < dim; ++d) out[d] = w * V::ToFloat(row[d]);
  }
  // w[d] = w[d] - lr * (c * g[d]) (ops::SgdInOrderElement); float32 rows only.
  static void SubScaled(float* w, const float* g, float c, float lr, int64_t dim) {
    const Reg cv = V::Set1(c), lrv = V::Set1(lr);
    int64_t d = 0;
    for (; d + kLanes <= dim; d += kLanes)
      V::StoreF(w + d, V::Sub(V::LoadF(w + d), V::Mul(lrv, V::Mul(cv, V::LoadF(g + d)))));
    for (; d < dim; ++d) w[d] = ops::SgdInOrderElement(w[d], lr, c, g[d]);
  }
  // uint8_rowwise rows (rows of dim + 8 bytes; see Rowwise8Kernels): for the
  // NV * kLanes columns from c0, out[c] = fma(w_k s_k, q_k[c0 + c], out[c] + w_k b_k)
  // over k in id order, from 0.
  template <int NV, typename I>
  static void PoolQ8(float* out, const uint8_t* table, int64_t rows, int64_t dim, int64_t c0, const I* ids,
                     int64_t k0, int64_t k1, const float* weights, int64_t pf_end) {
    const int64_t rb = dim + rowwise8::kExtraBytes;
    Reg s[NV];
#pragma GCC unroll 16
    for (int j = 0; j < NV; ++j) s[j] = V::Zero();
    for (int64_t k = k0; k < k1; ++k) {
      if (k + kPrefetchDistance < pf_end) PrefetchRowQ8(AheadAt(table, ids, k + kPrefetchDistance, rb), rb);
      const uint8_t* row = RowAt(table, ids, k, rows, rb);
      const float w = weights ? weights[k] : 1.0f;
      const Reg a = V::Set1(w * rowwise8::Scale(row, dim)), b = V::Set1(w * rowwise8::Bias(row, dim));
      row += c0;
#pragma GCC unroll 16
      for (int j = 0; j < NV; ++j) s[j] = V::Fma(a, V::LoadU8(row + kLanes * j), V::Add(s[j], b));
    }
#pragma GCC unroll 16
    for (int j = 0; j < NV; ++j) V::StoreF(out + kLanes * j, s[j]);
  }
  // out[d] = fma(a, q[d], c)
  static void ScaleQ8(float* out, const uint8_t* q, float a, float c, int64_t dim) {
    const Reg av = V::Set1(a), cv = V::Set1(c);
    int64_t d = 0;
    for (; d + kLanes <= dim; d += kLanes) V::StoreF(out + d, V::Fma(av, V::LoadU8(q + d), cv));
    for (; d < dim; ++d) out[d] = std::fma(a, float(q[d]), c);
  }
  // A row as floats and back (the optimizers' rows of 16-bit tables), with a half-width step for a tail
  // where V has one: element by element, a float16 row of 8 columns took the AVX-512 set's Adam step 1.4x
  // the AVX2 set's time. The same bits either way (F16C and the bfloat16 shifts round as ops::FromFloat).
  static void Load(const T* row, float* dst, int64_t dim) {
    int64_t d = 0;
    for (; d + kLanes <= dim; d += kLanes) V::StoreF(dst + d, V::Load(row + d));
    if constexpr (V::kHalfSteps) {
      if (d + kLanes / 2 <= dim) {
        V::LoadHalf(row + d, dst + d);
        d += kLanes / 2;
      }
    }
    for (; d < dim; ++d) dst[d] = V::ToFloat(row[d]);
  }
  static void Store(T* row, const float* src, int64_t dim) {
    int64_t d = 0;
    for (; d + kLanes <= dim; d += kLanes) V::Store(row + d, V::LoadF(src + d));
    if constexpr (V::kHalfSteps) {
      if (d + kLanes / 2 <= dim) {
        V::StoreHalf(row + d, src + d);
        d += kLanes / 2;
      }
    }
    for (; d < dim; ++d) row[d] = ops::FromFloat<T>(src[d]);
  }
};
