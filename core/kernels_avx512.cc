// The AVX-512 build of the row kernels (AVX-512F, with F16C for the 16-bit
// types), called only after a CPUID check: the AVX2 code with twice the
// vector width, so rows that are already in cache (hot ids) are added twice
// as fast. It computes the same float32 operations in the same order as the
// other sets (no FMA contraction), so it gives the same bits. As in
// kernels_avx2.cc, the target is switched on after the includes and all code
// here has internal linkage.
#include <immintrin.h>

#include "kernels.h"
#include "ops/half.h"

#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx2,f16c")

namespace embedcore::kernels {
namespace {

// Sixteen floats from sixteen stored elements, and back (round to nearest even).
inline __m512 Load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 Load16(const ops::F16* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 Load16(const ops::BF16* p) {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
inline void Store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void Store16(ops::F16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}
inline void Store16(ops::BF16* p, __m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
  // NaN stays NaN (quiet), as ops::FloatToBFloat16 does.
  const __m512i abs = _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff));
  const __mmask16 nan = _mm512_cmpgt_epi32_mask(abs, _mm512_set1_epi32(0x7f800000));
  const __m512i qnan = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  r = _mm512_mask_blend_epi32(nan, r, qnan);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
}

template <typename T>
struct Avx512Rows {
  // Up to eight 16-float sums in registers across a bag's ids: 128 columns a block.
  static constexpr int kLanes = 16;
  static constexpr int kVectors = 8;

  template <int NV, typename I>
  static void Pool(float* out, const T* table, int64_t dim, int64_t c0, const I* ids, int64_t k0, int64_t k1,
                   const float* weights, int64_t pf_end, int64_t row_bytes) {
    __m512 s[NV];
#pragma GCC unroll 16
    for (int j = 0; j < NV; ++j) s[j] = _mm512_setzero_ps();
    if (weights == nullptr) {  // w = 1: 1 * x == x, so the sums are the same bits without the multiply
      for (int64_t k = k0; k < k1; ++k) {
        if (k + kPrefetchDistance < pf_end) PrefetchLines(table + int64_t(ids[k + kPrefetchDistance]) * dim, row_bytes);
        const T* row = table + int64_t(ids[k]) * dim + c0;
#pragma GCC unroll 16
        for (int j = 0; j < NV; ++j) s[j] = _mm512_add_ps(s[j], Load16(row + 16 * j));
      }
    } else {
      for (int64_t k = k0; k < k1; ++k) {
        if (k + kPrefetchDistance < pf_end) PrefetchLines(table + int64_t(ids[k + kPrefetchDistance]) * dim, row_bytes);
        const T* row = table + int64_t(ids[k]) * dim + c0;
        const __m512 w = _mm512_set1_ps(weights[k]);
#pragma GCC unroll 16
        for (int j = 0; j < NV; ++j) s[j] = _mm512_add_ps(s[j], _mm512_mul_ps(w, Load16(row + 16 * j)));
      }
    }
#pragma GCC unroll 16
    for (int j = 0; j < NV; ++j) _mm512_storeu_ps(out + 16 * j, s[j]);
  }
  static void Axpy(float* acc, const T* row, float w, int64_t dim) {
    const __m512 wv = _mm512_set1_ps(w);
    int64_t d = 0;
    for (; d + 16 <= dim; d += 16)
      _mm512_storeu_ps(acc + d, _mm512_add_ps(_mm512_loadu_ps(acc + d), _mm512_mul_ps(wv, Load16(row + d))));
    for (; d < dim; ++d) acc[d] += w * ops::ToFloat(row[d]);
  }
  static void Scale(float* out, const T* row, float w, int64_t dim) {
    const __m512 wv = _mm512_set1_ps(w);
    int64_t d = 0;
    for (; d + 16 <= dim; d += 16) _mm512_storeu_ps(out + d, _mm512_mul_ps(wv, Load16(row + d)));
    for (; d < dim; ++d) out[d] = w * ops::ToFloat(row[d]);
  }
  static void Load(const T* row, float* dst, int64_t dim) {
    int64_t d = 0;
    for (; d + 16 <= dim; d += 16) _mm512_storeu_ps(dst + d, Load16(row + d));
    for (; d < dim; ++d) dst[d] = ops::ToFloat(row[d]);
  }
  static void Store(T* row, const float* src, int64_t dim) {
    int64_t d = 0;
    for (; d + 16 <= dim; d += 16) Store16(row + d, _mm512_loadu_ps(src + d));
    for (; d < dim; ++d) row[d] = ops::FromFloat<T>(src[d]);
  }
};

#include "kernels_impl.h"

KernelSet Make() {
  KernelSet s{};
  s.name = "avx512";
  s.dtype[int(DType::kFloat32)] = MakeDTypeKernels<Avx512Rows<float>, float>();
  s.dtype[int(DType::kFloat16)] = MakeDTypeKernels<Avx512Rows<ops::F16>, ops::F16>();
  s.dtype[int(DType::kBFloat16)] = MakeDTypeKernels<Avx512Rows<ops::BF16>, ops::BF16>();
  return s;
}

}  // namespace
}  // namespace embedcore::kernels
#pragma GCC pop_options

namespace embedcore::kernels {
const KernelSet* Avx512Kernels() {
  static const KernelSet set = Make();
  return &set;
}
}  // namespace embedcore::kernels

#else
namespace embedcore::kernels {
const KernelSet* Avx512Kernels() { return nullptr; }
}  // namespace embedcore::kernels
#endif
