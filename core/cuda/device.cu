// Device memory and the CUDA error check: every failing CUDA call becomes an
// embedcore exception that names the call.
#include <cuda_runtime.h>

#include <atomic>
#include <mutex>
#include <new>
#include <string>
#include <utility>
#include <vector>

#include "cuda/cuda_impl.h"
#include "cuda/cuda_util.cuh"

namespace embedcore::cuda_impl {

void Check(cudaError_t err, const char* call, const char* file, int line) {
  if (err == cudaSuccess) return;
  cudaGetLastError();  // clear a sticky launch error so the next call can run
  throw std::runtime_error(std::string("CUDA error in ") + call + " (" + file + ":" + std::to_string(line) +
                           "): " + cudaGetErrorName(err) + ": " + cudaGetErrorString(err));
}

DeviceGuard::DeviceGuard(int device) {
  EC_CUDA(cudaGetDevice(&previous_));
  if (device != previous_) EC_CUDA(cudaSetDevice(device));
}
DeviceGuard::~DeviceGuard() { cudaSetDevice(previous_); }

namespace {
// Cleared for good once cudaMallocAsync fails for a reason other than memory.
std::atomic<bool> pools_work{true};

// Scratch comes from a memory pool of embedcore's own on each device, which keeps the memory freed into it
// (release threshold: all of it), as PyTorch's caching allocator does. The device's default pool gives its
// free memory back at every synchronisation, and the next call maps it again: on an H200 that took 70 to
// 160 us of each lookup's 350 (W1g). nullptr where no pool could be made: the default pool then.
cudaMemPool_t ScratchPool(int device) {
  static std::mutex mutex;
  static std::vector<std::pair<int, cudaMemPool_t>> pools;  // never destroyed: the driver frees them at exit
  std::lock_guard<std::mutex> lock(mutex);
  for (const auto& [d, pool] : pools)
    if (d == device) return pool;
  cudaMemPoolProps props = {};
  props.allocType = cudaMemAllocationTypePinned;
  props.location.type = cudaMemLocationTypeDevice;
  props.location.id = device;
  cudaMemPool_t pool = nullptr;
  if (cudaMemPoolCreate(&pool, &props) == cudaSuccess) {
    uint64_t keep_all = ~uint64_t(0);  // (the attribute is a cuuint64_t, 64 bits)
    if (cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep_all) != cudaSuccess) {
      cudaMemPoolDestroy(pool);
      pool = nullptr;
    }
  } else {
    pool = nullptr;
  }
  cudaGetLastError();  // (a refused pool call leaves no error for the next call)
  pools.emplace_back(device, pool);
  return pool;
}
}  // namespace

void* AllocateScratch(size_t bytes, cudaStream_t stream, bool* pooled) {
  void* p = nullptr;
  if (pools_work.load(std::memory_order_relaxed)) {
    int device = 0;
    EC_CUDA(cudaGetDevice(&device));
    const cudaMemPool_t pool = ScratchPool(device);
    const cudaError_t err =
        pool ? cudaMallocFromPoolAsync(&p, bytes, pool, stream) : cudaMallocAsync(&p, bytes, stream);
    if (err == cudaSuccess) {
      *pooled = true;
      return p;
    }
    cudaGetLastError();
    if (err == cudaErrorMemoryAllocation)
      throw OutOfMemory("cudaMallocAsync: cannot allocate " + std::to_string(bytes) + " bytes of scratch on the GPU");
    // Pools unsupported (a driver or device without them): cudaMalloc from now on. Any other error (a sticky
    // one from another kernel, a bad stream) is the call's, not the pools'.
    if (err != cudaErrorNotSupported) EC_CUDA(err);
    pools_work.store(false, std::memory_order_relaxed);
  }
  *pooled = false;
  const cudaError_t err = cudaMalloc(&p, bytes);
  if (err == cudaErrorMemoryAllocation) {
    cudaGetLastError();
    throw OutOfMemory("cudaMalloc: cannot allocate " + std::to_string(bytes) + " bytes of scratch on the GPU");
  }
  EC_CUDA(err);
  return p;
}

void ReleaseScratch(void* p, cudaStream_t stream, bool pooled) noexcept {
  if (p == nullptr) return;
  if (pooled) {
    cudaFreeAsync(p, stream);
    return;
  }
  cudaStreamSynchronize(stream);  // kernels queued on the stream may still use it
  cudaFree(p);
}

int DeviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;  // no driver or no device: the CPU engine still works
  }
  return n;
}

void* Allocate(size_t bytes, int device) {
  DeviceGuard guard(device);
  void* p = nullptr;
  if (bytes == 0) bytes = 1;
  const cudaError_t err = cudaMalloc(&p, bytes);
  if (err == cudaErrorMemoryAllocation) {
    cudaGetLastError();
    throw OutOfMemory("cudaMalloc: cannot allocate " + std::to_string(bytes) + " bytes on GPU " +
                      std::to_string(device));
  }
  EC_CUDA(err);
  try {
    EC_CUDA(cudaMemset(p, 0, bytes));
    // Memsets and pageable copies run on the legacy stream, which a caller's
    // non-blocking stream does not wait for: finish them before returning.
    EC_CUDA(cudaDeviceSynchronize());
  } catch (...) {
    cudaFree(p);  // (not leaked when the memset or a pending error fails the call)
    throw;
  }
  return p;
}

void Free(void* p, int device) noexcept {
  if (p == nullptr) return;
  int previous = 0;
  cudaGetDevice(&previous);
  cudaSetDevice(device);
  cudaFree(p);
  cudaSetDevice(previous);
}

void CopyToHost(void* dst, const void* src, size_t bytes, int device) {
  DeviceGuard guard(device);
  // cudaMemcpy runs on the legacy stream, which does not wait for work on a
  // non-blocking stream (every torch.cuda.Stream(), CuPy's too) that may
  // still write these rows through a DLPack view: finish all of it first.
  EC_CUDA(cudaDeviceSynchronize());
  EC_CUDA(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost));
}

void CopyToDevice(void* dst, const void* src, size_t bytes, int device) {
  DeviceGuard guard(device);
  EC_CUDA(cudaDeviceSynchronize());  // as in CopyToHost: no kernel on another stream still reads these rows
  EC_CUDA(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
  EC_CUDA(cudaDeviceSynchronize());  // a pageable copy may return before the DMA lands
}

namespace {
__global__ void FillKernel(float* p, int64_t n, float value) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    p[i] = value;
}
}  // namespace

void Fill(float* p, int64_t n, float value, int device) {
  if (n == 0) return;
  DeviceGuard guard(device);
  FillKernel<<<GridFor(n, 256), 256>>>(p, n, value);
  EC_CUDA(cudaGetLastError());
  EC_CUDA(cudaDeviceSynchronize());
}

}  // namespace embedcore::cuda_impl
