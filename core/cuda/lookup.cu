// Lookups on the GPU: pooled bags (cuda/pooled.cuh, which checks the batch
// in the same kernel) and sequences (checked first, then one block per output
// row, one thread per column). Both give the CPU engine's bits.
#include <cuda_runtime.h>

#include <vector>

#include "cuda/cuda_impl.h"
#include "cuda/cuda_util.cuh"
#include "cuda/pooled.cuh"
#include "ops/combiners.h"
#include "ops/half.h"
#include "shared_checks.h"

namespace embedcore::cuda_impl {
namespace {

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

constexpr int kPooledThreads = 128;
constexpr int kPooledBatch = 4;  // rows whose loads are in flight at once per thread (W1g on an H200: 4 > 8 > 16)

/// The pooled lookup: one kernel that also checks the batch, then one copy of what it found back to the host.
template <typename T, typename I>
void PooledLookup(const T* table, int64_t rows, int64_t dim, const std::string& name, const Batch& batch,
                  Combiner combiner, float* out, cudaStream_t s) {
  Scratch<PooledProblem> problem(1, s);
  EC_CUDA(cudaMemsetAsync(problem.get(), 0xff, sizeof(PooledProblem), s));  // "none" in both fields
  const bool packs = dim % kPackColumns<T> == 0 && reinterpret_cast<uintptr_t>(table) % 16 == 0 &&
                     reinterpret_cast<uintptr_t>(out) % 16 == 0;
  const int vec = packs ? kPackColumns<T> : 1;
  const int group_log2 = PooledGroupLog2(dim, vec);
  const unsigned blocks = GridFor(batch.num_bags << group_log2, kPooledThreads);
  const I* ids = static_cast<const I*>(batch.ids);
  const auto c = ops::CombinerKind(combiner);
  if (packs)
    PooledKernel<T, I, kPackColumns<T>, kPooledBatch><<<blocks, kPooledThreads, 0, s>>>(
        table, rows, dim, ids, batch.nnz, batch.offsets, batch.weights, batch.num_bags, c, group_log2, out,
        problem.get());
  else
    PooledKernel<T, I, 1, kPooledBatch><<<blocks, kPooledThreads, 0, s>>>(
        table, rows, dim, ids, batch.nnz, batch.offsets, batch.weights, batch.num_bags, c, group_log2, out,
        problem.get());
  EC_CUDA(cudaGetLastError());
  PooledProblem found;
  EC_CUDA(cudaMemcpyAsync(&found, problem.get(), sizeof(found), cudaMemcpyDeviceToHost, s));
  EC_CUDA(cudaStreamSynchronize(s));
  ThrowBatchProblem(batch, rows, name, found.bad_bag != ~0ull, found.bad_position);
}

template <typename T, typename I>
void Launch(const void* table, int64_t rows, int64_t dim, const std::string& name, const Batch& batch,
            const OutputShape& shape, float* out, cudaStream_t s) {
  const T* t = static_cast<const T*>(table);
  if (shape.combiner != Combiner::kNone && batch.num_bags > 0)
    return PooledLookup<T, I>(t, rows, dim, name, batch, shape.combiner, out, s);
  ValidateDeviceBatch(batch, rows, name, s);
  const int64_t out_rows = shape.OutputRows(batch);
  if (out_rows > 0) {
    const int threads = dim >= 128 ? 128 : (dim >= 64 ? 64 : 32);
    SequenceKernel<T, I><<<GridFor(out_rows, 1), threads, 0, s>>>(t, dim, static_cast<const I*>(batch.ids),
                                                                   batch.offsets, batch.weights, batch.num_bags,
                                                                   batch.nnz, shape.max_sequence_length, out);
    EC_CUDA(cudaGetLastError());
  }
  EC_CUDA(cudaStreamSynchronize(s));
}

}  // namespace

void ThrowBatchProblem(const Batch& batch, int64_t rows, const std::string& table, bool bad_offsets,
                       unsigned long long bad_position) {
  if (bad_offsets) {  // named as the CPU engine names it, from a host copy of the offsets
    std::vector<int64_t> off(size_t(batch.num_bags + 1));
    EC_CUDA(cudaMemcpy(off.data(), batch.offsets, off.size() * sizeof(int64_t), cudaMemcpyDeviceToHost));
    internal::CheckOffsets(off.data(), batch.num_bags, batch.nnz);
    throw InvalidArgument("offsets changed while the lookup read them: they must start at 0, be non-decreasing and "
                          "end at the number of ids, " + std::to_string(batch.nnz));
  }
  if (bad_position == ~0ull) return;
  const int64_t k = int64_t(bad_position);
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

void CheckBatchPointers(const Batch& batch) {
  if (batch.nnz < 0 || batch.num_bags < 0) throw InvalidArgument("ids: negative length");
  if (batch.nnz > 0 && batch.ids == nullptr) throw InvalidArgument("ids: null pointer");
  if (batch.offsets == nullptr) throw InvalidArgument("offsets: null pointer");
}

void ValidateDeviceBatch(const Batch& batch, int64_t rows, const std::string& table, cudaStream_t stream) {
  CheckBatchPointers(batch);
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
  ThrowBatchProblem(batch, rows, table, found.bad_offsets != 0, found.bad_position);
}

void Lookup(const void* table, DType dtype, int64_t rows, int64_t dim, const std::string& name, const Batch& batch,
            const OutputShape& shape, float* out, int device, uintptr_t stream) {
  DeviceGuard guard(device);
  const cudaStream_t s = AsStream(stream);
  CheckBatchPointers(batch);
  if (shape.OutputRows(batch) > 0 && out == nullptr) throw InvalidArgument("out: null pointer");
  const bool i32 = batch.id_type == IdType::kInt32;
  switch (dtype) {
    case DType::kFloat32:
      return i32 ? Launch<float, int32_t>(table, rows, dim, name, batch, shape, out, s)
                 : Launch<float, int64_t>(table, rows, dim, name, batch, shape, out, s);
    case DType::kFloat16:
      return i32 ? Launch<ops::F16, int32_t>(table, rows, dim, name, batch, shape, out, s)
                 : Launch<ops::F16, int64_t>(table, rows, dim, name, batch, shape, out, s);
    case DType::kBFloat16:
      return i32 ? Launch<ops::BF16, int32_t>(table, rows, dim, name, batch, shape, out, s)
                 : Launch<ops::BF16, int64_t>(table, rows, dim, name, batch, shape, out, s);
    case DType::kUInt8Rowwise:  // a checkpoint file's dtype only (served on the host), never a table's
      throw InvalidArgument("table '" + name + "': uint8_rowwise values have no device lookup (serve them on the CPU)");
  }
}

}  // namespace embedcore::cuda_impl
