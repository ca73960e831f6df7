// 8-bit row-wise quantization (checkpoint dtype uint8_rowwise, format 1.4):
// FBGEMM's "Fused8BitRowwise" layout and rounding (docs/format.md). A row of
// `dim` values is stored as `dim` uint8 codes, then its float32 scale and
// float32 bias (little-endian, unaligned): dim + 8 bytes.
//
//   min, max = the row's least and greatest value; range = max - min
//   scale = range / 255                    (float32 division)
//   bias  = min
//   code  = round_half_even((x - min) * (255 / (range + 1e-8)))   (float32)
//   value = scale * code + bias, rounded once (a fused multiply-add)
//
// Host code only. The lookup kernels (kernels_impl.h) dequantize inside the
// gather instead of through DequantizeRow8.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace embedcore::rowwise8 {

constexpr int64_t kExtraBytes = 8;  ///< the scale and bias after a row's codes
constexpr float kEpsilon = 1e-8f;   ///< added to the range for the codes' multiplier, as FBGEMM

inline float Scale(const uint8_t* row, int64_t dim) {
  float s;
  std::memcpy(&s, row + dim, 4);
  return s;
}
inline float Bias(const uint8_t* row, int64_t dim) {
  float b;
  std::memcpy(&b, row + dim + 4, 4);
  return b;
}

/// Why a row cannot be quantized, or nullptr: a value that is not finite,
/// or a range (max - min) or a dequantized maximum beyond float32.
/// `bad_col` gets the column of a non-finite value (-1 otherwise).
inline const char* RowProblem(const float* src, int64_t dim, int64_t* bad_col) {
  *bad_col = -1;
  float lo = src[0], hi = src[0];
  bool finite = true;
  for (int64_t d = 0; d < dim; ++d) {
    finite &= std::isfinite(src[d]);
    lo = src[d] < lo ? src[d] : lo;
    hi = src[d] > hi ? src[d] : hi;
  }
  if (!finite) {
    for (int64_t d = 0; d < dim; ++d)
      if (!std::isfinite(src[d])) {
        *bad_col = d;
        break;
      }
    return "is not finite";
  }
  const float range = hi - lo;
  const float scale = range / 255.0f;
  if (!std::isfinite(range) || !std::isfinite(std::fmaf(255.0f, scale, lo)) || !std::isfinite(scale * 255.0f + lo))
    return "spans a range (max - min) beyond float32";
  return nullptr;
}

/// Quantizes one row of `dim` finite float32 values (RowProblem gave
/// nullptr) into dim + 8 bytes at `dst`. The least value is the first one
/// that compares least (std::min_element's), so a row whose least values are
/// 0.0 and -0.0 takes the sign of the first.
inline void QuantizeRow8(const float* src, int64_t dim, uint8_t* dst) {
  float lo = src[0], hi = src[0];
  for (int64_t d = 1; d < dim; ++d) {
    if (src[d] < lo) lo = src[d];
    if (src[d] > hi) hi = src[d];
  }
  const float range = hi - lo;
  const float scale = range / 255.0f;
  const float inverse = 255.0f / (range + kEpsilon);
  for (int64_t d = 0; d < dim; ++d) {
    const float q = std::nearbyint((src[d] - lo) * inverse);  // the default mode: to nearest, ties to even
    dst[d] = uint8_t(q < 0.0f ? 0.0f : (q > 255.0f ? 255.0f : q));
  }
  std::memcpy(dst + dim, &scale, 4);
  std::memcpy(dst + dim + 4, &lo, 4);
}

/// Dequantizes one stored row into `dim` floats: scale * code + bias,
/// rounded once (FBGEMM's Fused8BitRowwiseQuantizedToFloat gives these bits).
inline void DequantizeRow8(const uint8_t* row, int64_t dim, float* dst) {
  const float s = Scale(row, dim), b = Bias(row, dim);
  for (int64_t d = 0; d < dim; ++d) dst[d] = std::fmaf(float(row[d]), s, b);
}

}  // namespace embedcore::rowwise8
