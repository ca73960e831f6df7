// Host arrays for a device table. The sharded algorithm routes ids on the
// host, then serves and updates its GPU shards with host batches: each array
// is copied to device scratch, the device Lookup / ApplyGradients run on the
// default stream, and a lookup's output is copied back before returning.
#include <cuda_runtime.h>

#include <memory>
#include <vector>

#include "cuda/cuda_impl.h"
#include "cuda/cuda_util.cuh"

namespace embedcore::cuda_impl {
namespace {

// `bytes` of host memory copied into new device scratch (ordered on `s`).
std::unique_ptr<Scratch<char>> Stage(const void* src, size_t bytes, cudaStream_t s) {
  auto dst = std::make_unique<Scratch<char>>(bytes, s);
  if (bytes > 0) EC_CUDA(cudaMemcpyAsync(dst->get(), src, bytes, cudaMemcpyHostToDevice, s));
  return dst;
}

// One host batch's arrays in device memory, and the Batch that points at them.
struct DeviceBatch {
  DeviceBatch(const Batch& host, cudaStream_t s) : batch(host) {
    const size_t id_bytes = size_t(host.nnz) * (host.id_type == IdType::kInt32 ? 4 : 8);
    ids = Stage(host.ids, id_bytes, s);
    offsets = Stage(host.offsets, size_t(host.num_bags + 1) * sizeof(int64_t), s);
    batch.ids = ids->get();
    batch.offsets = reinterpret_cast<const int64_t*>(offsets->get());
    if (host.weights != nullptr) {
      weights = Stage(host.weights, size_t(host.nnz) * sizeof(float), s);
      batch.weights = reinterpret_cast<const float*>(weights->get());
    }
  }
  Batch batch;
  std::unique_ptr<Scratch<char>> ids, offsets, weights;
};

}  // namespace

void LookupFromHost(const void* table, DType dtype, int64_t rows, int64_t dim, const std::string& name,
                    const Batch& batch, const OutputShape& shape, float* out, int device) {
  DeviceGuard guard(device);
  const cudaStream_t s = nullptr;  // the legacy default stream
  // As CopyToHost: no kernel on a non-blocking stream still writes these rows.
  EC_CUDA(cudaDeviceSynchronize());
  const DeviceBatch staged(batch, s);
  const size_t out_bytes = size_t(shape.OutputRows(batch)) * size_t(dim) * sizeof(float);
  Scratch<char> device_out(out_bytes, s);
  Lookup(table, dtype, rows, dim, name, staged.batch, shape, reinterpret_cast<float*>(device_out.get()), device, 0);
  if (out_bytes > 0) EC_CUDA(cudaMemcpy(out, device_out.get(), out_bytes, cudaMemcpyDeviceToHost));
}

void ApplyGradientsFromHost(const TableSpec& spec, void* values, const std::vector<float*>& slots, int64_t step,
                            const std::vector<GradientPart>& parts, float learning_rate, int device) {
  DeviceGuard guard(device);
  const cudaStream_t s = nullptr;
  EC_CUDA(cudaDeviceSynchronize());
  std::vector<std::unique_ptr<DeviceBatch>> batches;
  std::vector<std::unique_ptr<Scratch<char>>> grads;
  std::vector<GradientPart> on_device;
  for (const GradientPart& p : parts) {
    batches.push_back(std::make_unique<DeviceBatch>(p.batch, s));
    const size_t grad_bytes = size_t(p.shape.OutputRows(p.batch)) * size_t(spec.dim) * sizeof(float);
    grads.push_back(Stage(p.grads, grad_bytes, s));
    GradientPart d = p;
    d.batch = batches.back()->batch;
    d.grads = reinterpret_cast<const float*>(grads.back()->get());
    on_device.push_back(d);
  }
  // Synchronizes its stream before returning; the scratch is freed after.
  ApplyGradients(spec, values, slots, step, on_device, learning_rate, device, 0);
}

}  // namespace embedcore::cuda_impl
