// The AVX2 + F16C (+ FMA, for the 8-bit rows) build of the row kernels, called only after a CPUID
// check. The target is switched on by a pragma after the includes, so shared
// inline functions (ops/half.h) keep their portable code, and everything
// compiled for AVX2 here has internal linkage: no AVX2 code can leak into the
// portable path through the linker.
#include "kernels.h"
#include "ops/half.h"

#if defined(__x86_64__) && defined(__GNUC__)
#define EMBEDCORE_HAVE_AVX2_KERNELS 1
#include <immintrin.h>
#if defined(__clang__)  // (clang ignores the GCC pragmas: the same target as an attribute of each function)
#pragma clang attribute push(__attribute__((target("avx2,f16c,fma"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,f16c,fma")
#endif

namespace embedcore::kernels {
namespace {

// Eight floats: the vector primitives of SimdRows (kernels_simd.h).
struct Avx2 {
  using Reg = __m256;
  static constexpr int kLanes = 8;
  static Reg Zero() { return _mm256_setzero_ps(); }
  static Reg Set1(float f) { return _mm256_set1_ps(f); }
  static Reg Add(Reg a, Reg b) { return _mm256_add_ps(a, b); }
  static Reg Sub(Reg a, Reg b) { return _mm256_sub_ps(a, b); }
  static Reg Mul(Reg a, Reg b) { return _mm256_mul_ps(a, b); }
  static Reg Fma(Reg a, Reg b, Reg c) { return _mm256_fmadd_ps(a, b, c); }  // a * b + c, rounded once
  static Reg LoadF(const float* p) { return _mm256_loadu_ps(p); }
  static void StoreF(float* p, Reg v) { _mm256_storeu_ps(p, v); }
  static Reg Load(const float* p) { return _mm256_loadu_ps(p); }
  static Reg Load(const ops::F16* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static Reg Load(const ops::BF16* p) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
  static constexpr bool kMaskedLoads = false;  // (no masked 16-bit loads before AVX-512BW)
  static constexpr bool kHalfSteps = false;
  static float ToFloat(float x) { return x; }
  static float ToFloat(ops::F16 x) { return _cvtsh_ss(x.bits); }  // exact; a NaN made quiet, as ops::HalfToFloat
  static float ToFloat(ops::BF16 x) { return ops::ToFloat(x); }   // (a shift)
  static Reg LoadU8(const uint8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static void Store(float* p, Reg v) { _mm256_storeu_ps(p, v); }
  static void Store(ops::F16* p, Reg v) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  }
  static void Store(ops::BF16* p, Reg v) {
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
};

#include "kernels_simd.h"

// Up to 16 vectors (128 columns) a block. Float32 adds take the row from
// memory, so 16 accumulators fit the 16 registers; the 16-bit types'
// conversions spill a few of them, which still beats a second pass over the
// rows (1.25x on float16 rows of 128).
template <typename T>
using Avx2Rows = SimdRows<T, Avx2, 16>;

#include "kernels_impl.h"

KernelSet Make() {
  KernelSet s{};
  s.name = "avx2+f16c";
  s.dtype[int(DType::kFloat32)] = MakeDTypeKernels<Avx2Rows<float>, float>();
  s.dtype[int(DType::kFloat16)] = MakeDTypeKernels<Avx2Rows<ops::F16>, ops::F16>();
  s.dtype[int(DType::kBFloat16)] = MakeDTypeKernels<Avx2Rows<ops::BF16>, ops::BF16>();
  s.rowwise8 = MakeRowwise8Kernels<Avx2Rows<float>>();
  return s;
}

}  // namespace

}  // namespace embedcore::kernels
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

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
