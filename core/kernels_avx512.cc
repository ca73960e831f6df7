// The AVX-512 build of the row kernels (AVX-512F, BW and VL, with F16C for
// the 16-bit types; BW and VL for masked 16-bit loads of narrow rows),
// called only after a CPUID check: the AVX2 code with twice the
// vector width, so rows that are already in cache (hot ids) are added twice
// as fast. It computes the same float32 operations in the same order as the
// other sets (no FMA contraction; the 8-bit rows use explicit FMAs, as all
// sets do), so it gives the same bits. As in
// kernels_avx2.cc, the target is switched on after the includes and all code
// here has internal linkage.
#include "kernels.h"
#include "ops/half.h"

#if defined(__x86_64__) && defined(__GNUC__)
#if !defined(__clang__) && __GNUC__ < 13
// GCC 12's AVX-512 intrinsics pass a self-initialized "undefined" register: hundreds of false
// -Wmaybe-uninitialized warnings (https://gcc.gnu.org/bugzilla/show_bug.cgi?id=105593).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#include <immintrin.h>
#if defined(__clang__)  // (clang ignores the GCC pragmas: the same target as an attribute of each function)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx2,f16c,fma,prfchw"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,f16c,fma,prfchw")
#endif

namespace embedcore::kernels {
namespace {

// Sixteen floats: the vector primitives of SimdRows (kernels_simd.h).
struct Avx512 {
  using Reg = __m512;
  static constexpr int kLanes = 16;
  static Reg Zero() { return _mm512_setzero_ps(); }
  static Reg Set1(float f) { return _mm512_set1_ps(f); }
  static Reg Add(Reg a, Reg b) { return _mm512_add_ps(a, b); }
  static Reg Sub(Reg a, Reg b) { return _mm512_sub_ps(a, b); }
  static Reg Mul(Reg a, Reg b) { return _mm512_mul_ps(a, b); }
  static Reg Fma(Reg a, Reg b, Reg c) { return _mm512_fmadd_ps(a, b, c); }  // a * b + c, rounded once
  static Reg LoadF(const float* p) { return _mm512_loadu_ps(p); }
  static void StoreF(float* p, Reg v) { _mm512_storeu_ps(p, v); }
  static Reg Load(const float* p) { return _mm512_loadu_ps(p); }
  static Reg Load(const ops::F16* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static Reg Load(const ops::BF16* p) {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  }
  static constexpr bool kMaskedLoads = true;
  static __mmask16 MaskOf(int64_t n) { return __mmask16((1u << n) - 1u); }  // (0 <= n < 16)
  static Reg LoadMasked(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
  static Reg LoadMasked(const ops::F16* p, __mmask16 m) { return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p)); }
  static Reg LoadMasked(const ops::BF16* p, __mmask16 m) {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  }
  static void StoreMaskedF(float* p, Reg v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
  static float ToFloat(float x) { return x; }
  static float ToFloat(ops::F16 x) { return _cvtsh_ss(x.bits); }  // exact; a NaN made quiet, as ops::HalfToFloat
  static float ToFloat(ops::BF16 x) { return ops::ToFloat(x); }   // (a shift)
  static Reg LoadU8(const uint8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static void Store(float* p, Reg v) { _mm512_storeu_ps(p, v); }
  static void Store(ops::F16* p, Reg v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), Narrow<ops::F16>(v)); }
  static void Store(ops::BF16* p, Reg v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), Narrow<ops::BF16>(v)); }
  // Eight elements at once (the tails of rows that the optimizers widen to float32 and narrow back): a
  // float16 Adam step of 8 columns 5.4 -> 3.8 ms (as the AVX2 set's), where element by element it was 1.4x.
  // Not masked 16-lane loads: the row was just written by the update's 8-lane stores, which do not
  // forward to a wider load (those were no faster).
  static constexpr bool kHalfSteps = true;
  static void LoadHalf(const float* p, float* dst) { _mm256_storeu_ps(dst, _mm256_loadu_ps(p)); }
  static void LoadHalf(const ops::F16* p, float* dst) {
    _mm256_storeu_ps(dst, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static void LoadHalf(const ops::BF16* p, float* dst) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    _mm256_storeu_ps(dst, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
  }
  static void StoreHalf(float* p, const float* src) { _mm256_storeu_ps(p, _mm256_loadu_ps(src)); }
  static void StoreHalf(ops::F16* p, const float* src) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(_mm256_loadu_ps(src), _MM_FROUND_TO_NEAREST_INT));
  }
  static void StoreHalf(ops::BF16* p, const float* src) {
    const __m256i v = _mm256_castps_si256(_mm256_loadu_ps(src));  // zero-extended to 16 lanes: the same bits
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(Narrow<ops::BF16>(
                                                        _mm512_castsi512_ps(_mm512_zextsi256_si512(v)))));
  }

  // Sixteen floats as sixteen 16-bit elements of T, rounded to nearest, ties to even.
  template <typename T>
  static __m256i Narrow(Reg v) {
    if constexpr (std::is_same_v<T, ops::F16>) {
      return _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT);
    } else {
      const __m512i u = _mm512_castps_si512(v);
      const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
      __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
      // NaN stays NaN (quiet), as ops::FloatToBFloat16 does.
      const __m512i abs = _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff));
      const __mmask16 nan = _mm512_cmpgt_epi32_mask(abs, _mm512_set1_epi32(0x7f800000));
      const __m512i qnan = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
      r = _mm512_mask_blend_epi32(nan, r, qnan);
      return _mm512_cvtepi32_epi16(r);
    }
  }
};

#include "kernels_simd.h"

// Up to eight 16-float sums (128 columns) a block; 32 registers leave room
// for the 16-bit types' conversions.
template <typename T>
using Avx512Rows = SimdRows<T, Avx512, 8>;

#include "kernels_impl.h"

KernelSet Make() {
  KernelSet s{};
  s.name = "avx512";
  s.dtype[int(DType::kFloat32)] = MakeDTypeKernels<Avx512Rows<float>, float>();
  s.dtype[int(DType::kFloat16)] = MakeDTypeKernels<Avx512Rows<ops::F16>, ops::F16>();
  s.dtype[int(DType::kBFloat16)] = MakeDTypeKernels<Avx512Rows<ops::BF16>, ops::BF16>();
  s.rowwise8 = MakeRowwise8Kernels<Avx512Rows<float>>();
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
