// Helpers shared by the CUDA files: error checks, the device guard, launch
// sizes, stream-ordered scratch memory and the on-device batch check.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <new>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "embedcore/embedcore.h"

namespace embedcore::cuda_impl {

/// Throws (naming `call`) unless err is cudaSuccess.
void Check(cudaError_t err, const char* call, const char* file, int line);
#define EC_CUDA(call) ::embedcore::cuda_impl::Check((call), #call, __FILE__, __LINE__)

/// Makes `device` current for a scope.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
};

inline unsigned GridFor(int64_t n, int block) {
  const int64_t blocks = (n + block - 1) / block;
  return unsigned(std::max<int64_t>(1, std::min<int64_t>(blocks, 65535 * 32)));
}

inline cudaStream_t AsStream(uintptr_t s) { return reinterpret_cast<cudaStream_t>(s); }

/// Allocates `bytes` for Scratch: stream-ordered (cudaMallocAsync) where the
/// device's memory pools work, else plain cudaMalloc (some virtualised
/// drivers refuse the pool calls); *pooled says which, for ReleaseScratch.
void* AllocateScratch(size_t bytes, cudaStream_t stream, bool* pooled);
/// Frees what AllocateScratch returned: on the stream (pooled), or after the
/// stream's work is done (cudaMalloc'ed memory).
void ReleaseScratch(void* p, cudaStream_t stream, bool pooled) noexcept;

/// Stream-ordered scratch memory, freed on the same stream.
template <typename T>
class Scratch {
 public:
  Scratch(size_t n, cudaStream_t stream) : stream_(stream) {
    p_ = static_cast<T*>(AllocateScratch(std::max<size_t>(n, 1) * sizeof(T), stream, &pooled_));
  }
  ~Scratch() { ReleaseScratch(p_, stream_, pooled_); }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  T* get() const { return p_; }

 private:
  T* p_ = nullptr;
  cudaStream_t stream_;
  bool pooled_ = true;
};

/// Throws InvalidArgument for a batch's bad pointers or negative lengths.
void CheckBatchPointers(const Batch& batch);

/// Throws what a device check of a batch found, as the CPU engine's
/// ValidateBatch does: InvalidArgument for malformed offsets, else OutOfRange
/// naming the id at `bad_position` (read back from the device; ~0: none).
void ThrowBatchProblem(const Batch& batch, int64_t rows, const std::string& table, bool bad_offsets,
                       unsigned long long bad_position);

/// Checks a device batch against `rows` on `stream` and throws, after the
/// kernel, OutOfRange / InvalidArgument as the CPU engine's ValidateBatch does.
void ValidateDeviceBatch(const Batch& batch, int64_t rows, const std::string& table, cudaStream_t stream);

}  // namespace embedcore::cuda_impl
