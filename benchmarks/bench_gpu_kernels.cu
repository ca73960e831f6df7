// Kernel-only timings of the GPU pooled lookup (core/cuda/pooled.cuh) on W1g
// (10,000,000 x 128 float32, 65,536 bags of 32 ids, sum; uniform and Zipf(1.05)
// ids): the rows in flight per thread (BATCH) and the threads per block, so
// that the choice in core/cuda/lookup.cu can be checked on another GPU. Each
// variant's output is compared bit for bit with the one-column kernel's.
//
//   nvcc -std=c++17 -O3 -fmad=false -arch=sm_90 -Icore -Icore/include \
//        benchmarks/bench_gpu_kernels.cu -o /tmp/bench_gpu_kernels && /tmp/bench_gpu_kernels
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdio>
#include <random>
#include <vector>

#include "cuda/pooled.cuh"

using namespace embedcore;
using namespace embedcore::cuda_impl;

#define CK(x)                                                                   \
  do {                                                                          \
    cudaError_t e = (x);                                                        \
    if (e != cudaSuccess) {                                                     \
      printf("CUDA error %s at %s:%d\n", cudaGetErrorString(e), __FILE__, __LINE__); \
      exit(1);                                                                  \
    }                                                                           \
  } while (0)

__global__ void Fill(float* p, int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    p[i] = float((i * 2654435761ull) % 1000) * 1e-3f - 0.5f;
}

template <typename F>
float Time(F f, int reps = 20) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  for (int i = 0; i < 3; ++i) f();
  CK(cudaDeviceSynchronize());
  std::vector<float> ms;
  for (int i = 0; i < reps; ++i) {
    CK(cudaEventRecord(a));
    f();
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    float t;
    CK(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

int main() {
  const int64_t rows = 10'000'000, dim = 128, bags = 65536, bag = 32, nnz = bags * bag;
  float* table;
  CK(cudaMalloc(&table, size_t(rows * dim) * 4));
  Fill<<<4096, 256>>>(table, rows * dim);
  const size_t copy_n = size_t(1) << 29;
  float *ca, *cb;
  CK(cudaMalloc(&ca, copy_n * 4));
  CK(cudaMalloc(&cb, copy_n * 4));
  const float copy_ms = Time([&] { CK(cudaMemcpyAsync(cb, ca, copy_n * 4, cudaMemcpyDeviceToDevice)); });
  const double copy_bw = 2.0 * copy_n * 4 / (copy_ms / 1e3);
  CK(cudaFree(ca));
  CK(cudaFree(cb));
  printf("copy %.3f ms -> %.0f GB/s\n", copy_ms, copy_bw / 1e9);

  std::mt19937_64 rng(1);
  std::vector<int64_t> uni(nnz), zipf(nnz), offs(bags + 1);
  for (auto& x : uni) x = int64_t(rng() % rows);
  {
    std::vector<double> cdf(rows);
    double s = 0;
    for (int64_t r = 0; r < rows; ++r) cdf[r] = (s += std::pow(double(r + 1), -1.05));
    std::uniform_real_distribution<double> u(0, s);
    for (auto& x : zipf) {
      int64_t r = std::lower_bound(cdf.begin(), cdf.end(), u(rng)) - cdf.begin();
      x = int64_t((uint64_t(std::min(r, rows - 1)) * 7919ull * 1000003ull) % uint64_t(rows));  // a fixed scatter
    }
  }
  for (int64_t b = 0; b <= bags; ++b) offs[b] = b * bag;
  int64_t *ids, *offsets;
  float *out, *ref;
  PooledProblem* prob;
  CK(cudaMalloc(&ids, nnz * 8));
  CK(cudaMalloc(&offsets, (bags + 1) * 8));
  CK(cudaMalloc(&out, bags * dim * 4));
  CK(cudaMalloc(&ref, bags * dim * 4));
  CK(cudaMalloc(&prob, sizeof(PooledProblem)));
  CK(cudaMemcpy(offsets, offs.data(), (bags + 1) * 8, cudaMemcpyHostToDevice));
  const double bytes = double(nnz) * dim * 4;
  std::vector<float> h_out(bags * dim), h_ref(bags * dim);
  for (int dist = 0; dist < 2; ++dist) {
    CK(cudaMemcpy(ids, dist ? zipf.data() : uni.data(), nnz * 8, cudaMemcpyHostToDevice));
    auto report = [&](const char* name, float ms) {
      CK(cudaMemcpy(h_out.data(), out, bags * dim * 4, cudaMemcpyDeviceToHost));
      const bool same = std::equal(h_out.begin(), h_out.end(), h_ref.begin(), [](float a, float b) {
        return std::memcmp(&a, &b, 4) == 0;
      });
      printf("%-8s %-34s %.3f ms  %5.0f GB/s  %3.0f%% of copy%s\n", dist ? "zipf" : "uniform", name, ms,
             bytes / (ms / 1e3) / 1e9, 100 * bytes / (ms / 1e3) / copy_bw, same ? "" : "  BITS DIFFER");
    };
    {  // the reference bits: the one-column kernel
      const int g = PooledGroupLog2(dim, 1);
      CK(cudaMemset(prob, 0xff, sizeof(PooledProblem)));
      PooledKernel<float, int64_t, 1, 8><<<unsigned((bags << g) / 256), 256>>>(
          table, rows, dim, ids, nnz, offsets, nullptr, bags, ops::CombinerKind::kSum, g, ref, prob);
      CK(cudaGetLastError());
      CK(cudaMemcpy(h_ref.data(), ref, bags * dim * 4, cudaMemcpyDeviceToHost));
    }
    auto run = [&](auto kernel, int vec, int threads, const char* name) {
      const int g = PooledGroupLog2(dim, vec);
      const unsigned blocks = unsigned((bags << g) / threads);
      const float ms = Time([&] {
        cudaMemsetAsync(prob, 0xff, sizeof(PooledProblem));
        kernel<<<blocks, threads>>>(table, rows, dim, ids, nnz, offsets, nullptr, bags, ops::CombinerKind::kSum, g,
                                    out, prob);
      });
      CK(cudaGetLastError());
      char label[64];
      snprintf(label, sizeof label, "%s, %d threads", name, threads);
      report(label, ms);
    };
    for (int threads : {128, 256, 512}) {
      run(PooledKernel<float, int64_t, 4, 4>, 4, threads, "16-byte packs, BATCH 4");
      run(PooledKernel<float, int64_t, 4, 8>, 4, threads, "16-byte packs, BATCH 8");
      run(PooledKernel<float, int64_t, 4, 16>, 4, threads, "16-byte packs, BATCH 16");
    }
    run(PooledKernel<float, int64_t, 1, 8>, 1, 256, "one column, BATCH 8");
  }
  return 0;
}
