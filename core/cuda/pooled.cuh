// The pooled lookup kernel (sum / mean / sqrtn), with the batch's check in it.
// A group of threads (a power of two, up to a warp) per bag; each thread owns
// VEC consecutive columns of the output row (16 bytes of table row where the
// dimension and the pointers allow, else one column) and adds them over the
// bag's rows in id order, 0 + w_0 r_0 + w_1 r_1 + ..., with no FMA contraction
// (-fmad=false), exactly as the CPU kernels do: the CPU engine's bits. BATCH
// rows' loads are issued before their adds (memory-level parallelism; the
// order of the adds is unchanged). lookup.cu instantiates it.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

#include "ops/combiners.h"
#include "ops/half.h"

namespace embedcore::cuda_impl {

/// What a pooled lookup found wrong, on the device: the first bag whose
/// offsets are malformed and the position of the first id out of range
/// (~0 where none). Set to all ones before the kernel.
struct PooledProblem {
  unsigned long long bad_bag;
  unsigned long long bad_position;
};

/// The columns each thread of a pooled lookup loads at once: 16 bytes of a
/// row, where the dimension and both pointers allow it, else one column.
template <typename T>
constexpr int kPackColumns = int(16 / sizeof(T));

/// VEC elements at `p`, in one load where they are 16 bytes (read-only path:
/// no kernel writes the table while a lookup reads it).
template <typename T, int VEC>
__device__ __forceinline__ void LoadColumns(const T* p, T (&v)[VEC]) {
  if constexpr (sizeof(T) * VEC == 16) {
    const uint4 raw = __ldg(reinterpret_cast<const uint4*>(p));
    memcpy(v, &raw, 16);
  } else {
#pragma unroll
    for (int e = 0; e < VEC; ++e) v[e] = p[e];
  }
}

template <int VEC>
__device__ __forceinline__ void StoreColumns(float* p, const float (&acc)[VEC]) {
  if constexpr (VEC % 4 == 0) {
#pragma unroll
    for (int e = 0; e < VEC; e += 4)
      reinterpret_cast<float4*>(p)[e / 4] = make_float4(acc[e], acc[e + 1], acc[e + 2], acc[e + 3]);
  } else {
#pragma unroll
    for (int e = 0; e < VEC; ++e) p[e] = acc[e];
  }
}

/// Bags [0, num_bags) of ids[offsets[b], offsets[b + 1]) into out[num_bags, dim].
/// Checks the batch as it goes (ValidateBatch's rules): a bag whose offsets
/// are malformed is skipped and named in `problem`, an id out of range is
/// read as zeros and its position named; the caller throws after the kernel.
/// Groups of 2^group_log2 threads; launch at most 1024 threads a block.
template <typename T, typename I, int VEC, int BATCH>
__global__ void PooledKernel(const T* __restrict__ table, int64_t rows, int64_t dim, const I* __restrict__ ids,
                             int64_t nnz, const int64_t* __restrict__ offsets, const float* __restrict__ weights,
                             int64_t num_bags, ops::CombinerKind combiner, int group_log2, float* __restrict__ out,
                             PooledProblem* problem) {
  const int group = 1 << group_log2;
  const int lane = int(threadIdx.x) & (group - 1);
  const int64_t step = (int64_t(gridDim.x) * blockDim.x) >> group_log2;
  for (int64_t b = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> group_log2; b < num_bags; b += step) {
    const int64_t k0 = offsets[b], k1 = offsets[b + 1];
    if (k0 < 0 || k1 < k0 || k1 > nnz || (b == 0 && k0 != 0) || (b == num_bags - 1 && k1 != nnz)) {
      if (lane == 0) atomicMin(&problem->bad_bag, (unsigned long long)b);
      continue;
    }
    const float denominator = ops::BagDenominator(combiner, k0, k1, weights);
    for (int64_t c = int64_t(lane) * VEC; c < dim; c += int64_t(group) * VEC) {
      float acc[VEC];
#pragma unroll
      for (int e = 0; e < VEC; ++e) acc[e] = 0.0f;
      for (int64_t k = k0; k < k1; k += BATCH) {
        const int n = k1 - k < BATCH ? int(k1 - k) : BATCH;
        T v[BATCH][VEC];
        float w[BATCH];
#pragma unroll
        for (int j = 0; j < BATCH; ++j) {
          if (j < n) {
            const int64_t id = int64_t(ids[k + j]);
            w[j] = weights ? weights[k + j] : 1.0f;
            if (id >= 0 && id < rows) {
              LoadColumns<T, VEC>(table + id * dim + c, v[j]);
            } else {
              atomicMin(&problem->bad_position, (unsigned long long)(k + j));
#pragma unroll
              for (int e = 0; e < VEC; ++e) v[j][e] = T{};
            }
          }
        }
#pragma unroll
        for (int j = 0; j < BATCH; ++j)
          if (j < n) {
#pragma unroll
            for (int e = 0; e < VEC; ++e) acc[e] += w[j] * ops::ToFloat(v[j][e]);
          }
      }
      if (combiner != ops::CombinerKind::kSum) {
#pragma unroll
        for (int e = 0; e < VEC; ++e) acc[e] = denominator == 0.0f ? 0.0f : acc[e] / denominator;
      }
      StoreColumns<VEC>(out + b * dim + c, acc);
    }
  }
}

/// log2 of the threads per bag: enough for one pass over the row's packs, at most a warp.
inline int PooledGroupLog2(int64_t dim, int vec) {
  const int64_t packs = (dim + vec - 1) / vec;
  int g = 0;
  while (g < 5 && (int64_t(1) << g) < packs) ++g;
  return g;
}

}  // namespace embedcore::cuda_impl
