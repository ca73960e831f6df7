// The GPU side of the engine, as the CPU files see it: plain C++ types only
// (no CUDA header), so table.cc and checkpoint.cc call it the same way in
// every build. The CUDA build implements it in core/cuda/*.cu; without CUDA
// the inline stubs below throw NotCompiled (STYLE habit 7).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "embedcore/embedcore.h"

namespace embedcore::cuda_impl {

#if defined(EMBEDCORE_WITH_CUDA)
constexpr bool kCompiled = true;
/// Devices the runtime sees (0 when there is no GPU or no driver).
int DeviceCount();
/// `bytes` of zeroed memory on `device`.
void* Allocate(size_t bytes, int device);
void Free(void* p, int device) noexcept;
void CopyToHost(void* dst, const void* src, size_t bytes, int device);
void CopyToDevice(void* dst, const void* src, size_t bytes, int device);
void Fill(float* p, int64_t n, float value, int device);
/// Table::Lookup on the device: every pointer of `batch` and `out` is device
/// memory; runs on `stream` (0: the default stream) and returns once the
/// output is ready there. Ids are checked on the device; a bad one throws
/// OutOfRange after the kernel, naming it.
void Lookup(const void* table, DType dtype, int64_t rows, int64_t dim, const std::string& name, const Batch& batch,
            const OutputShape& shape, float* out, int device, uintptr_t stream);
/// Table::ApplyGradients on the device (same semantics, same order of
/// additions, so the same bits as the CPU engine).
void ApplyGradients(const TableSpec& spec, void* values, const std::vector<float*>& slots, int64_t step,
                    const std::vector<GradientPart>& parts, float learning_rate, int device, uintptr_t stream);
/// Lookup and ApplyGradients of host arrays (already checked on the host):
/// copied to device scratch, run on the default stream, the output copied
/// back to host memory before returning.
void LookupFromHost(const void* table, DType dtype, int64_t rows, int64_t dim, const std::string& name,
                    const Batch& batch, const OutputShape& shape, float* out, int device);
void ApplyGradientsFromHost(const TableSpec& spec, void* values, const std::vector<float*>& slots, int64_t step,
                            const std::vector<GradientPart>& parts, float learning_rate, int device);
#else
constexpr bool kCompiled = false;
[[noreturn]] inline void NotBuilt() {
  throw NotCompiled("this embedcore was built without CUDA: rebuild with EMBEDCORE_CUDA=ON for GPU tables");
}
inline int DeviceCount() { return 0; }
inline void* Allocate(size_t, int) { NotBuilt(); }
inline void Free(void*, int) noexcept {}
inline void CopyToHost(void*, const void*, size_t, int) { NotBuilt(); }
inline void CopyToDevice(void*, const void*, size_t, int) { NotBuilt(); }
inline void Fill(float*, int64_t, float, int) { NotBuilt(); }
inline void Lookup(const void*, DType, int64_t, int64_t, const std::string&, const Batch&, const OutputShape&, float*,
                   int, uintptr_t) {
  NotBuilt();
}
inline void ApplyGradients(const TableSpec&, void*, const std::vector<float*>&, int64_t,
                           const std::vector<GradientPart>&, float, int, uintptr_t) {
  NotBuilt();
}
inline void LookupFromHost(const void*, DType, int64_t, int64_t, const std::string&, const Batch&,
                           const OutputShape&, float*, int) {
  NotBuilt();
}
inline void ApplyGradientsFromHost(const TableSpec&, void*, const std::vector<float*>&, int64_t,
                                   const std::vector<GradientPart>&, float, int) {
  NotBuilt();
}
#endif

}  // namespace embedcore::cuda_impl
