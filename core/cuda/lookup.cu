// Lookups on the GPU. One block per bag, one thread per column: each thread
// adds its column of the bag's rows in id order, 0 + w_0 r_0 + w_1 r_1 + ...,
// with no FMA contraction (-fmad=false), exactly as the CPU kernels do, so a
// GPU table gives the CPU engine's bits.
#include <cuda_runtime.h>

#include "cuda/cuda_impl.h"
#include "cuda/cuda_util.cuh"
#include "ops/combiners.h"
#include "ops/half.h"

namespace embedcore::cuda_impl {
namespace {

constexpr int kBatch = 8;  // rows whose loads are in flight at once per thread

template <typename I>
__global__ void CheckBatchKernel(const I* ids, int64_t nnz, const int64_t* offsets, int64_t num_bags, int64_t rows,
                                 unsigned long long* bad_position, int* bad_offsets) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t k = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; k < nnz; k += stride) {
    const int64_t id = int64_t(ids[k]);
    if (id < 0 || id >= rows) atomicMin(bad_position, (unsigned long long)k);
  }
  for (int64_t b = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; b < num_bags; b += stride)
    if (offsets[b + 1] < offsets[b]) atomicExch(bad_offsets, 1);
  if (blockIdx.x == 0 && threadIdx.x == 0 && (offsets[0] != 0 || offsets[num_bags] != nnz)) atomicExch(bad_offsets, 1);
}

template <typename T, typename I>
__global__ void PooledKernel(const T* table, int64_t dim, const I* ids, const int64_t* offsets, const float* weights,
                             int64_t num_bags, ops::CombinerKind combiner, float* out) {
  for (int64_t b = blockIdx.x; b < num_bags; b += gridDim.x) {
    const int64_t k0 = offsets[b], k1 = offsets[b + 1];
    const float denominator = ops::BagDenominator(combiner, k0, k1, weights);
    for (int64_t d = threadIdx.x; d < dim; d += blockDim.x) {
      // Eight rows' loads are issued before their adds (memory-level
      // parallelism); the adds stay in id order, so the bits do not change.
      float acc = 0.0f;
      for (int64_t k = k0; k < k1; k += kBatch) {
        const int n = k1 - k < kBatch ? int(k1 - k) : kBatch;
        float v[kBatch];
#pragma unroll
        for (int j = 0; j < kBatch; ++j)
          if (j < n) v[j] = ops::ToFloat(table[int64_t(ids[k + j]) * dim + d]);
#pragma unroll
        for (int j = 0; j < kBatch; ++j)
          if (j < n) acc += (weights ? weights[k + j] : 1.0f) * v[j];
      }
      if (combiner != ops::CombinerKind::kSum) acc = denominator == 0.0f ? 0.0f : acc / denominator;
      out[b * dim + d] = acc;
    }
  }
}

// Sequence rows: [nnz, dim] (len == 0) or [bags, len, dim], zero-padded.
template <typename T, typename I>
__global__ void SequenceKernel(const T* table, int64_t dim, const I* ids, const int64_t* offsets, const float* weights,
                               int64_t num_bags, int64_t nnz, int64_t len, float* out) {
  const int64_t out_rows = len == 0 ? nnz : num_bags * len;
  for (int64_t r = blockIdx.x; r < out_rows; r += gridDim.x) {
    int64_t k = r;
    if (len > 0) {
      const int64_t b = r / len, j = r % len;
      k = offsets[b] + j < offsets[b + 1] ? offsets[b] + j : -1;
    }
    for (int64_t d = threadIdx.x; d < dim; d += blockDim.x)
      out[r * dim + d] = k < 0 ? 0.0f : (weights ? weights[k] : 1.0f) * ops::ToFloat(table[int64_t(ids[k]) * dim + d]);
  }
}

template <typename T, typename I>
void Launch(const void* table, int64_t dim, const Batch& batch, const OutputShape& shape, float* out, cudaStream_t s) {
  const int threads = dim >= 128 ? 128 : (dim >= 64 ? 64 : 32);
  const T* t = static_cast<const T*>(table);
  const I* ids = static_cast<const I*>(batch.ids);
  if (shape.combiner != Combiner::kNone) {
    if (batch.num_bags == 0) return;
    PooledKernel<T, I><<<GridFor(batch.num_bags, 1), threads, 0, s>>>(
        t, dim, ids, batch.offsets, batch.weights, batch.num_bags, ops::CombinerKind(shape.combiner), out);
  } else {
    const int64_t rows = shape.OutputRows(batch);
    if (rows == 0) return;
    SequenceKernel<T, I><<<GridFor(rows, 1), threads, 0, s>>>(t, dim, ids, batch.offsets, batch.weights,
                                                               batch.num_bags, batch.nnz, shape.max_sequence_length,
                                                               out);
  }
  EC_CUDA(cudaGetLastError());
}

}  // namespace

void ValidateDeviceBatch(const Batch& batch, int64_t rows, const std::string& table, cudaStream_t stream) {
  if (batch.nnz < 0 || batch.num_bags < 0) throw InvalidArgument("ids: negative length");
  if (batch.nnz > 0 && batch.ids == nullptr) throw InvalidArgument("ids: null pointer");
  if (batch.offsets == nullptr) throw InvalidArgument("offsets: null pointer");
  struct Flags {
    unsigned long long bad_position;
    int bad_offsets;
  };
  Scratch<Flags> flags(1, stream);
  const Flags init{~0ull, 0};
  EC_CUDA(cudaMemcpyAsync(flags.get(), &init, sizeof(init), cudaMemcpyHostToDevice, stream));
  const int64_t n = std::max(batch.nnz, batch.num_bags + 1);
  if (batch.id_type == IdType::kInt32)
    CheckBatchKernel<<<GridFor(n, 256), 256, 0, stream>>>(static_cast<const int32_t*>(batch.ids), batch.nnz,
                                                          batch.offsets, batch.num_bags, rows,
                                                          &flags.get()->bad_position, &flags.get()->bad_offsets);
  else
    CheckBatchKernel<<<GridFor(n, 256), 256, 0, stream>>>(static_cast<const int64_t*>(batch.ids), batch.nnz,
                                                          batch.offsets, batch.num_bags, rows,
                                                          &flags.get()->bad_position, &flags.get()->bad_offsets);
  EC_CUDA(cudaGetLastError());
  Flags found;
  EC_CUDA(cudaMemcpyAsync(&found, flags.get(), sizeof(found), cudaMemcpyDeviceToHost, stream));
  EC_CUDA(cudaStreamSynchronize(stream));
  if (found.bad_offsets)
    throw InvalidArgument("offsets must start at 0, be non-decreasing and end at the number of ids, " +
                          std::to_string(batch.nnz));
  if (found.bad_position != ~0ull) {
    const int64_t k = int64_t(found.bad_position);
    int64_t id = 0;
    if (batch.id_type == IdType::kInt32) {
      int32_t v;
      EC_CUDA(cudaMemcpy(&v, static_cast<const int32_t*>(batch.ids) + k, sizeof(v), cudaMemcpyDeviceToHost));
      id = v;
    } else {
      EC_CUDA(cudaMemcpy(&id, static_cast<const int64_t*>(batch.ids) + k, sizeof(id), cudaMemcpyDeviceToHost));
    }
    throw OutOfRange("table '" + table + "': id " + std::to_string(id) + " at position " + std::to_string(k) +
                     " of ids is out of range [0, " + std::to_string(rows) + ")");
  }
}

void Lookup(const void* table, DType dtype, int64_t rows, int64_t dim, const std::string& name, const Batch& batch,
            const OutputShape& shape, float* out, int device, uintptr_t stream) {
  DeviceGuard guard(device);
  const cudaStream_t s = AsStream(stream);
  ValidateDeviceBatch(batch, rows, name, s);
  if (shape.OutputRows(batch) > 0 && out == nullptr) throw InvalidArgument("out: null pointer");
  const bool i32 = batch.id_type == IdType::kInt32;
  switch (dtype) {
    case DType::kFloat32:
      i32 ? Launch<float, int32_t>(table, dim, batch, shape, out, s) : Launch<float, int64_t>(table, dim, batch, shape, out, s);
      break;
    case DType::kFloat16:
      i32 ? Launch<ops::F16, int32_t>(table, dim, batch, shape, out, s)
          : Launch<ops::F16, int64_t>(table, dim, batch, shape, out, s);
      break;
    case DType::kBFloat16:
      i32 ? Launch<ops::BF16, int32_t>(table, dim, batch, shape, out, s)
          : Launch<ops::BF16, int64_t>(table, dim, batch, shape, out, s);
      break;
    case DType::kUInt8Rowwise:  // a checkpoint file's dtype only (served on the host), never a table's
      throw InvalidArgument("table '" + name + "': uint8_rowwise values have no device lookup (serve them on the CPU)");
  }
  EC_CUDA(cudaStreamSynchronize(s));
}

}  // namespace embedcore::cuda_impl
