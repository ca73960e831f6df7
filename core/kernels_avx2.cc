// The AVX2 + F16C build of the lookup kernels, called only after a CPUID
// check. The target is switched on by a pragma after the includes, so shared
// inline functions (ops/half.h) keep their portable code, and everything
// compiled for AVX2 here has internal linkage: no AVX2 code can leak into the
// portable path through the linker.
#include <immintrin.h>

#include "kernels.h"
#include "ops/half.h"

#if defined(__x86_64__) && defined(__GNUC__)
#define EMBEDCORE_HAVE_AVX2_KERNELS 1
#pragma GCC push_options
#pragma GCC target("avx2,f16c")

namespace embedcore::kernels {
namespace {

// Eight floats from eight stored elements, and back (round to nearest even).
inline __m256 Load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 Load8(const ops::F16* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 Load8(const ops::BF16* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
inline void Store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void Store8(ops::F16* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}
inline void Store8(ops::BF16* p, __m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
  // NaN stays NaN (quiet), as ops::FloatToBFloat16 does.
  const __m256i abs = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
  const __m256i nan = _mm256_cmpgt_epi32(abs, _mm256_set1_epi32(0x7f800000));
  const __m256i qnan = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
  r = _mm256_blendv_epi8(r, qnan, nan);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}

template <typename T>
struct Avx2Rows {
  // Sums live in registers across a bag's ids: up to 16 vectors, 128
  // columns, a block. Float32 adds take the row from memory, so 16
  // accumulators fit the 16 registers; the 16-bit types' conversions spill a
  // few of them, which still beats a second pass over the rows (1.25x on
  // float16 rows of 128).
  static constexpr int kLanes = 8;
  static constexpr int kVectors = 16;

  template <int NV, typename I>
  static void Pool(float* out, const T* table, int64_t dim, int64_t c0, const I* ids, int64_t k0, int64_t k1,
                   const float* weights, int64_t pf_end, int64_t row_bytes) {
    __m256 s[NV];
#pragma GCC unroll 16
    for (int j = 0; j < NV; ++j) s[j] = _mm256_setzero_ps();
    if (weights == nullptr) {  // w = 1: 1 * x == x, so the sums are the same bits without the multiply
      for (int64_t k = k0; k < k1; ++k) {
        if (k + kPrefetchDistance < pf_end) PrefetchLines(table + int64_t(ids[k + kPrefetchDistance]) * dim, row_bytes);
        const T* row = table + int64_t(ids[k]) * dim + c0;
#pragma GCC unroll 16
        for (int j = 0; j < NV; ++j) s[j] = _mm256_add_ps(s[j], Load8(row + 8 * j));
      }
    } else {
      for (int64_t k = k0; k < k1; ++k) {
        if (k + kPrefetchDistance < pf_end) PrefetchLines(table + int64_t(ids[k + kPrefetchDistance]) * dim, row_bytes);
        const T* row = table + int64_t(ids[k]) * dim + c0;
        const __m256 w = _mm256_set1_ps(weights[k]);
#pragma GCC unroll 16
        for (int j = 0; j < NV; ++j) s[j] = _mm256_add_ps(s[j], _mm256_mul_ps(w, Load8(row + 8 * j)));
      }
    }
#pragma GCC unroll 16
    for (int j = 0; j < NV; ++j) _mm256_storeu_ps(out + 8 * j, s[j]);
  }
  static void Axpy(float* acc, const T* row, float w, int64_t dim) {
    const __m256 wv = _mm256_set1_ps(w);
    int64_t d = 0;
    for (; d + 8 <= dim; d += 8)
      _mm256_storeu_ps(acc + d, _mm256_add_ps(_mm256_loadu_ps(acc + d), _mm256_mul_ps(wv, Load8(row + d))));
    for (; d < dim; ++d) acc[d] += w * ops::ToFloat(row[d]);
  }
  static void Scale(float* out, const T* row, float w, int64_t dim) {
    const __m256 wv = _mm256_set1_ps(w);
    int64_t d = 0;
    for (; d + 8 <= dim; d += 8) _mm256_storeu_ps(out + d, _mm256_mul_ps(wv, Load8(row + d)));
    for (; d < dim; ++d) out[d] = w * ops::ToFloat(row[d]);
  }
  static void Load(const T* row, float* dst, int64_t dim) {
    int64_t d = 0;
    for (; d + 8 <= dim; d += 8) _mm256_storeu_ps(dst + d, Load8(row + d));
    for (; d < dim; ++d) dst[d] = ops::ToFloat(row[d]);
  }
  static void Store(T* row, const float* src, int64_t dim) {
    int64_t d = 0;
    for (; d + 8 <= dim; d += 8) Store8(row + d, _mm256_loadu_ps(src + d));
    for (; d < dim; ++d) row[d] = ops::FromFloat<T>(src[d]);
  }
};

#include "kernels_impl.h"

KernelSet Make() {
  KernelSet s{};
  s.name = "avx2+f16c";
  s.dtype[int(DType::kFloat32)] = MakeDTypeKernels<Avx2Rows<float>, float>();
  s.dtype[int(DType::kFloat16)] = MakeDTypeKernels<Avx2Rows<ops::F16>, ops::F16>();
  s.dtype[int(DType::kBFloat16)] = MakeDTypeKernels<Avx2Rows<ops::BF16>, ops::BF16>();
  return s;
}

}  // namespace

}  // namespace embedcore::kernels
#pragma GCC pop_options

namespace embedcore::kernels {
const KernelSet* Avx2Kernels() {
  static const KernelSet set = Make();
  return &set;
}
}  // namespace embedcore::kernels

#else
namespace embedcore::kernels {
const KernelSet* Avx2Kernels() { return nullptr; }
}  // namespace embedcore::kernels
#endif
