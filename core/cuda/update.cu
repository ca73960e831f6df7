// Sparse updates on the GPU, deterministic and in the CPU engine's order:
// every occurrence (id, coefficient, gradient row) is keyed by id and
// radix-sorted stably (CUB), runs of equal ids become groups, and one block
// per group sums its gradients in input order (a thread per column, the
// occurrences staged a chunk at a time), then applies the optimizer rule of
// core/ops/ (the same functors as the CPU loop; row-wise Adagrad's row sum
// in the CPU loop's column order). With no FMA contraction, the
// result is the CPU engine's, bit for bit.
#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_run_length_encode.cuh>
#include <cub/device/device_scan.cuh>
#include <cuda_runtime.h>

#include <climits>
#include <cmath>

#include "cuda/cuda_impl.h"
#include "cuda/cuda_util.cuh"
#include "ops/combiners.h"
#include "ops/half.h"
#include "ops/optimizers.h"
#include "step_constants.h"

namespace embedcore::cuda_impl {
namespace {

// Occurrences of one part: key (the id, or `rows` for an id a truncated
// sequence dropped, which sorts last and is skipped), coefficient, and the
// offset of its gradient row in the part's grads.
template <typename I>
__global__ void CollectKernel(const I* ids, const int64_t* offsets, const float* weights, int64_t num_bags,
                              ops::CombinerKind combiner, int64_t len, int64_t dim, int64_t rows, const float* grads,
                              int64_t base, uint64_t* keys, int64_t* order, float* coefficient,
                              const float** grad_row) {
  for (int64_t b = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; b < num_bags; b += int64_t(gridDim.x) * blockDim.x) {
    const int64_t k0 = offsets[b], k1 = offsets[b + 1];
    const float denominator = ops::BagDenominator(combiner, k0, k1, weights);
    for (int64_t i = k0; i < k1; ++i) {
      const float w = weights ? weights[i] : 1.0f;
      int64_t g;
      bool kept = true;
      if (combiner != ops::CombinerKind::kNone) {
        g = b;
      } else if (len == 0) {
        g = i;
      } else {
        g = b * len + (i - k0);
        kept = i - k0 < len;
      }
      keys[base + i] = kept ? uint64_t(int64_t(ids[i])) : uint64_t(rows);
      order[base + i] = base + i;
      coefficient[base + i] = ops::BackwardCoefficient(combiner, w, denominator);
      grad_row[base + i] = kept ? grads + g * dim : nullptr;
    }
  }
}

template <typename T>
__device__ float Load(const T* p) {
  return ops::ToFloat(*p);
}

// Occurrences a block stages at a time (at most the smallest block, 32 threads).
constexpr int kStaged = 32;

// Calls f(coefficient, v) for each occurrence of a group, in input order,
// with v its gradient row's column d (none where d >= dim). The occurrences
// are staged kStaged at a time: their coefficients and gradient-row pointers
// go to shared memory (one load chain per thread, all in flight together),
// then each thread loads its column of the kStaged rows at once. A group of n
// occurrences waits on memory about n / kStaged times instead of 3 n (Zipf
// ids put 10^5 occurrences in the hottest group, which one block sums). Every
// thread of the block calls it: they meet at __syncthreads.
template <typename F>
__device__ void ForEachOccurrence(int64_t i0, int64_t i1, int64_t d, int64_t dim, const int64_t* order,
                                  const float* coefficient, const float* const* grad_row, F&& f) {
  __shared__ float staged_coefficient[kStaged];
  __shared__ const float* staged_row[kStaged];
  for (int64_t c0 = i0; c0 < i1; c0 += kStaged) {
    const int n = int(i1 - c0 < kStaged ? i1 - c0 : kStaged);
    __syncthreads();  // the previous chunk is consumed
    if (int(threadIdx.x) < n) {
      const int64_t o = order[c0 + threadIdx.x];
      staged_coefficient[threadIdx.x] = coefficient[o];
      staged_row[threadIdx.x] = grad_row[o];
    }
    __syncthreads();
    if (d < dim) {
      float v[kStaged];
#pragma unroll
      for (int j = 0; j < kStaged; ++j)
        if (j < n) v[j] = staged_row[j][d];
#pragma unroll
      for (int j = 0; j < kStaged; ++j)
        if (j < n) f(staged_coefficient[j], v[j]);
    }
  }
}

// One block per group: sum the group's gradients in input order, update the
// row. The additions are the same, in the same order, as the host's. With
// kInOrder (plain SGD on a float32 table) each occurrence is applied to the
// weight as it comes instead (ops::SgdInOrderElement), as the host does.
template <typename T, typename Rule, bool kInOrder>
__global__ void UpdateKernel(Rule rule, ops::StepConstants kc, T* values, float* s0, float* s1, int64_t dim,
                             int64_t rows, const uint64_t* group_key, const int64_t* group_start,
                             const int64_t* group_count, const int* num_groups, const int64_t* order,
                             const float* coefficient, const float* const* grad_row, uint8_t* touched) {
  for (int64_t g = blockIdx.x; g < *num_groups; g += gridDim.x) {
    const uint64_t key = group_key[g];
    if (key >= uint64_t(rows)) continue;  // dropped occurrences (the same key for the whole block)
    const int64_t row = int64_t(key);
    if (touched && threadIdx.x == 0) touched[row] = 1;
    const int64_t i0 = group_start[g], i1 = i0 + group_count[g];
    // Every thread runs every column block and chunk: they meet at __syncthreads.
    for (int64_t d0 = 0; d0 < dim; d0 += blockDim.x) {
      const int64_t d = d0 + threadIdx.x;
      float acc = 0.0f;
      float w_in_order = 0.0f;
      if constexpr (kInOrder) {
        if (d < dim) w_in_order = values[row * dim + d];
      }
      ForEachOccurrence(i0, i1, d, dim, order, coefficient, grad_row, [&](float c, float v) {
        if constexpr (kInOrder)
          w_in_order = ops::SgdInOrderElement(w_in_order, rule.lr, c, v);
        else
          acc += c * v;
      });
      if constexpr (kInOrder) {
        if (d < dim) values[row * dim + d] = w_in_order;
      } else if (d < dim) {
        const int64_t e = row * dim + d;
        float w = Load(values + e);
        ops::UpdateElement(rule, kc, w, acc, Rule::kSlots > 0 ? s0 + e : nullptr,
                           Rule::kSlots > 1 ? s1 + e : nullptr);
        values[e] = ops::FromFloat<T>(w);
      }
    }
  }
}

// The block size of the update kernels: at least kStaged, at most kMaxUpdateThreads.
constexpr int kMaxUpdateThreads = 128;

// Row-wise Adagrad, one block per group, in two passes over the group's
// summed (and clipped) gradient: the first adds its squares in column order
// (thread 0, as the host loop does) and updates the row's accumulator, the
// second steps each column with the row's multiplier. The gradient is summed
// again in the second pass, the same additions in the same order.
template <typename T>
__global__ void RowwiseUpdateKernel(ops::RowwiseAdagradRule rule, ops::StepConstants kc, T* values, float* acc_slot,
                                    int64_t dim, int64_t rows, const uint64_t* group_key, const int64_t* group_start,
                                    const int64_t* group_count, const int* num_groups, const int64_t* order,
                                    const float* coefficient, const float* const* grad_row) {
  __shared__ float squares[kMaxUpdateThreads];
  __shared__ float multiplier;
  auto column = [&](int64_t i0, int64_t i1, int64_t d) {
    float acc = 0.0f;
    ForEachOccurrence(i0, i1, d, dim, order, coefficient, grad_row, [&](float c, float v) { acc += c * v; });
    return kc.clip_gradient ? ops::ClipGradient(kc, acc) : acc;
  };
  for (int64_t g = blockIdx.x; g < *num_groups; g += gridDim.x) {
    const uint64_t key = group_key[g];
    if (key >= uint64_t(rows)) continue;  // dropped occurrences (the same key for the whole block)
    const int64_t row = int64_t(key);
    const int64_t i0 = group_start[g], i1 = i0 + group_count[g];
    float sum_square = 0.0f;  // thread 0's
    for (int64_t d0 = 0; d0 < dim; d0 += blockDim.x) {
      const int64_t d = d0 + threadIdx.x;
      const float gd = column(i0, i1, d);
      squares[threadIdx.x] = d < dim ? gd * gd : 0.0f;
      __syncthreads();
      if (threadIdx.x == 0) {
        const int64_t n = dim - d0 < int64_t(blockDim.x) ? dim - d0 : int64_t(blockDim.x);
        for (int64_t j = 0; j < n; ++j) sum_square += squares[j];
      }
      __syncthreads();  // squares consumed
    }
    if (threadIdx.x == 0) multiplier = rule.Multiplier(acc_slot + row, sum_square / float(dim));
    __syncthreads();
    const float m = multiplier;
    for (int64_t d0 = 0; d0 < dim; d0 += blockDim.x) {
      const int64_t d = d0 + threadIdx.x;
      const float gd = column(i0, i1, d);
      if (d < dim) {
        const int64_t e = row * dim + d;
        values[e] = ops::FromFloat<T>(ops::RowwiseElement(rule, kc, Load(values + e), gd, m));
      }
    }
    __syncthreads();  // every thread has read `multiplier` before the next group sets it
  }
}

// Non-lazy Adam: rows absent from the batch take a step with a zero gradient.
template <typename T, typename Rule>
__global__ void UntouchedKernel(Rule rule, ops::StepConstants kc, T* values, float* s0, float* s1, int64_t dim,
                                int64_t rows, const uint8_t* touched) {
  const int64_t n = rows * dim;
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < n; e += int64_t(gridDim.x) * blockDim.x) {
    if (touched[e / dim]) continue;
    float w = Load(values + e);
    ops::UpdateElement(rule, kc, w, 0.0f, s0 + e, s1 + e);
    values[e] = ops::FromFloat<T>(w);
  }
}

struct Groups {
  const uint64_t* key;
  const int64_t* start;
  const int64_t* count;
  const int* num;
  int64_t capacity;
};

template <typename T, typename Rule, bool kInOrder = false>
void Update(const Rule& rule, const ops::StepConstants& kc, const TableSpec& spec, void* values,
            const std::vector<float*>& slots, const Groups& groups, const int64_t* order, const float* coefficient,
            const float* const* grad_row, bool untouched_too, cudaStream_t s) {
  T* v = static_cast<T*>(values);
  float* s0 = Rule::kSlots > 0 ? slots[0] : nullptr;
  float* s1 = Rule::kSlots > 1 ? slots[1] : nullptr;
  const int threads = spec.dim >= 128 ? kMaxUpdateThreads : (spec.dim >= 64 ? 64 : 32);  // >= kStaged
  if constexpr (Rule::kRowwise) {
    if (groups.capacity > 0)
      RowwiseUpdateKernel<T><<<GridFor(groups.capacity, 1), threads, 0, s>>>(
          rule, kc, v, s0, spec.dim, spec.rows, groups.key, groups.start, groups.count, groups.num, order,
          coefficient, grad_row);
    EC_CUDA(cudaGetLastError());
  } else {
    Scratch<uint8_t> touched(untouched_too ? size_t(spec.rows) : 0, s);
    if (untouched_too) EC_CUDA(cudaMemsetAsync(touched.get(), 0, size_t(spec.rows), s));
    if (groups.capacity > 0)
      UpdateKernel<T, Rule, kInOrder><<<GridFor(groups.capacity, 1), threads, 0, s>>>(
          rule, kc, v, s0, s1, spec.dim, spec.rows, groups.key, groups.start, groups.count, groups.num, order,
          coefficient, grad_row, untouched_too ? touched.get() : nullptr);
    EC_CUDA(cudaGetLastError());
    if (untouched_too) {
      UntouchedKernel<T, Rule><<<GridFor(spec.rows * spec.dim, 256), 256, 0, s>>>(rule, kc, v, s0, s1, spec.dim,
                                                                                   spec.rows, touched.get());
      EC_CUDA(cudaGetLastError());
    }
  }
}

template <typename Rule>
void UpdateAnyType(const Rule& rule, const ops::StepConstants& kc, const TableSpec& spec, void* values,
                   const std::vector<float*>& slots, const Groups& groups, const int64_t* order,
                   const float* coefficient, const float* const* grad_row, bool untouched_too, cudaStream_t s) {
  switch (spec.dtype) {
    case DType::kFloat32:
      return Update<float>(rule, kc, spec, values, slots, groups, order, coefficient, grad_row, untouched_too, s);
    case DType::kFloat16:
      return Update<ops::F16>(rule, kc, spec, values, slots, groups, order, coefficient, grad_row, untouched_too, s);
    case DType::kBFloat16:
      return Update<ops::BF16>(rule, kc, spec, values, slots, groups, order, coefficient, grad_row, untouched_too, s);
    case DType::kUInt8Rowwise:  // a checkpoint file's dtype only, never a table's (Table refuses it)
      throw InvalidArgument("table '" + spec.name + "': uint8_rowwise is not a table dtype");
  }
}

int BitWidth(uint64_t x) {
  int bits = 1;
  while (bits < 64 && (x >> bits) != 0) ++bits;
  return bits;
}

}  // namespace

void ApplyGradients(const TableSpec& spec, void* values, const std::vector<float*>& slots, int64_t step,
                    const std::vector<GradientPart>& parts, float learning_rate, int device, uintptr_t stream) {
  DeviceGuard guard(device);
  const cudaStream_t s = AsStream(stream);
  for (const GradientPart& p : parts) {
    ValidateDeviceBatch(p.batch, spec.rows, spec.name, s);
    if (p.shape.OutputRows(p.batch) > 0 && p.grads == nullptr) throw InvalidArgument("grads: null pointer");
  }
  if (!std::isfinite(learning_rate))
    throw InvalidArgument("learning_rate must be finite, got " + std::to_string(learning_rate));

  int64_t total = 0;
  for (const GradientPart& p : parts) total += p.batch.nnz;
  if (total > int64_t(INT_MAX))  // CUB's run-length encoding counts in int
    throw InvalidArgument("apply_gradients on the GPU: " + std::to_string(total) +
                          " ids in one step, over 2^31 - 1: split the batch");
  Scratch<uint64_t> keys(size_t(total), s), keys_sorted(size_t(total), s);
  Scratch<int64_t> order(size_t(total), s), order_sorted(size_t(total), s);
  Scratch<float> coefficient(size_t(total), s);
  Scratch<const float*> grad_row(size_t(total), s);
  int64_t base = 0;
  for (const GradientPart& p : parts) {
    if (p.batch.num_bags > 0) {
      const auto c = ops::CombinerKind(p.shape.combiner);
      if (p.batch.id_type == IdType::kInt32)
        CollectKernel<<<GridFor(p.batch.num_bags, 128), 128, 0, s>>>(
            static_cast<const int32_t*>(p.batch.ids), p.batch.offsets, p.batch.weights, p.batch.num_bags, c,
            p.shape.max_sequence_length, spec.dim, spec.rows, p.grads, base, keys.get(), order.get(),
            coefficient.get(), grad_row.get());
      else
        CollectKernel<<<GridFor(p.batch.num_bags, 128), 128, 0, s>>>(
            static_cast<const int64_t*>(p.batch.ids), p.batch.offsets, p.batch.weights, p.batch.num_bags, c,
            p.shape.max_sequence_length, spec.dim, spec.rows, p.grads, base, keys.get(), order.get(),
            coefficient.get(), grad_row.get());
      EC_CUDA(cudaGetLastError());
    }
    base += p.batch.nnz;
  }

  // Stable sort by id (LSD radix: equal ids keep their input order), then runs.
  const int bits = BitWidth(uint64_t(spec.rows));  // `rows` itself marks dropped occurrences
  Scratch<uint64_t> group_key(size_t(total), s);
  Scratch<int64_t> group_count(size_t(total), s), group_start(size_t(total), s);
  Scratch<int> num_groups(1, s);
  EC_CUDA(cudaMemsetAsync(num_groups.get(), 0, sizeof(int), s));
  EC_CUDA(cudaMemsetAsync(group_count.get(), 0, size_t(std::max<int64_t>(total, 1)) * sizeof(int64_t), s));
  if (total > 0) {
    size_t sort_bytes = 0, rle_bytes = 0, scan_bytes = 0;
    EC_CUDA(cub::DeviceRadixSort::SortPairs(nullptr, sort_bytes, keys.get(), keys_sorted.get(), order.get(),
                                            order_sorted.get(), total, 0, bits, s));
    EC_CUDA(cub::DeviceRunLengthEncode::Encode(nullptr, rle_bytes, keys_sorted.get(), group_key.get(),
                                               group_count.get(), num_groups.get(), total, s));
    EC_CUDA(cub::DeviceScan::ExclusiveSum(nullptr, scan_bytes, group_count.get(), group_start.get(), total, s));
    Scratch<char> temp(std::max(sort_bytes, std::max(rle_bytes, scan_bytes)), s);
    EC_CUDA(cub::DeviceRadixSort::SortPairs(temp.get(), sort_bytes, keys.get(), keys_sorted.get(), order.get(),
                                            order_sorted.get(), total, 0, bits, s));
    EC_CUDA(cub::DeviceRunLengthEncode::Encode(temp.get(), rle_bytes, keys_sorted.get(), group_key.get(),
                                               group_count.get(), num_groups.get(), total, s));
    // Counts past the last run are never read: each group reads its own start and count.
    EC_CUDA(cub::DeviceScan::ExclusiveSum(temp.get(), scan_bytes, group_count.get(), group_start.get(), total, s));
  }
  const Groups groups{group_key.get(), group_start.get(), group_count.get(), num_groups.get(), total};

  const OptimizerSpec& o = spec.optimizer;
  const ops::StepConstants kc = internal::StepConstantsFor(o, learning_rate);
  const int64_t* ord = order_sorted.get();
  switch (o.kind) {
    case OptimizerSpec::Kind::kSGD:
      if (spec.dtype == DType::kFloat32 && ops::PlainStep(kc))  // as Table::ApplyGradients on the host
        Update<float, ops::SgdRule, true>(ops::SgdRule{learning_rate}, kc, spec, values, slots, groups, ord,
                                          coefficient.get(), grad_row.get(), false, s);
      else
        UpdateAnyType(ops::SgdRule{learning_rate}, kc, spec, values, slots, groups, ord, coefficient.get(),
                      grad_row.get(), false, s);
      break;
    case OptimizerSpec::Kind::kAdagrad:
      UpdateAnyType(ops::AdagradRule{learning_rate, o.adagrad_epsilon}, kc, spec, values, slots, groups, ord,
                    coefficient.get(), grad_row.get(), false, s);
      break;
    case OptimizerSpec::Kind::kRowwiseAdagrad:
      UpdateAnyType(ops::RowwiseAdagradRule{learning_rate, o.adagrad_epsilon}, kc, spec, values, slots, groups, ord,
                    coefficient.get(), grad_row.get(), false, s);
      break;
    case OptimizerSpec::Kind::kAdam: {
      UpdateAnyType(internal::AdamRuleFor(o, learning_rate, step), kc, spec, values, slots, groups, ord,
                    coefficient.get(), grad_row.get(), !o.lazy_adam, s);
      break;
    }
    case OptimizerSpec::Kind::kFTRL:
      UpdateAnyType(internal::FtrlRuleFor(o, learning_rate), kc, spec, values, slots, groups, ord,
                    coefficient.get(), grad_row.get(), false, s);
      break;
  }
  EC_CUDA(cudaStreamSynchronize(s));
}

}  // namespace embedcore::cuda_impl
