// EmbedcoreSparseLookup and EmbedcoreRaggedLookup: tf.SparseTensor and
// tf.RaggedTensor lookups of an embedcore table as TensorFlow kernels, so
// that a tf.function runs them without a Python callback.
//
// Thin: it checks the shapes TensorFlow gives it, allocates the output and
// calls the engine through a C entry point of the embedcore module (its
// address set once by embedcore.adapters.tf._native through
// embedcore_tf_set_entry), which reads the input buffers in place and writes
// the output. The table is named by an integer handle of the engine's
// registry, never by a pointer. Built on first use against the installed
// TensorFlow (tf.sysconfig flags); see _native.py.
//
// Outputs: `output` [bags, dim] and `ok`. When the input needs the adapter's
// general path (indices out of order or with a row outside the dense shape,
// negative ids, ids out of range, an unusual shape), `ok` is false, `output` holds
// zeros (or no rows) and is not used: the adapter then runs that path
// (tf.cond), which prunes, reorders and raises TensorFlow's errors.
#include <atomic>
#include <cstdint>
#include <string>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace {

using tensorflow::int64;

// The engine's entry points, version 2 (bindings/native.cc: SparseSegmentLookup, RaggedLookup).
using SparseEntry = int (*)(int64_t handle, const int64_t* indices, int64_t nnz, const void* ids, int ids_int32,
                            int64_t bags, int combiner, float* out, int64_t dim, char* error, int64_t error_size);
using RaggedEntry = int (*)(int64_t handle, const void* ids, int ids_int32, int64_t nnz, const int64_t* splits,
                            int64_t bags, int combiner, float* out, int64_t dim, char* error, int64_t error_size);
constexpr int kAbiVersion = 2;
enum Status : int { kOk = 0, kGeneralPath = 1, kOutOfMemory = 2, kFailed = 3 };

std::atomic<SparseEntry> g_sparse{nullptr};
std::atomic<RaggedEntry> g_ragged{nullptr};

constexpr const char* kNotSet =
    "the op library was loaded without embedcore's engine; it is loaded by embedcore.adapters.tf";

// Sets `ok`, and the output from the entry's status: kOk and kGeneralPath
// (the output then holds zeros and is not used) are results, the rest errors.
void Finish(tensorflow::OpKernelContext* ctx, int status, const char* error, tensorflow::Tensor* out,
            tensorflow::Tensor* ok) {
  if (status == kOk) {
    ok->scalar<bool>()() = true;
  } else if (status == kGeneralPath) {
    out->flat<float>().setZero();  // not used (the general path's output is), but never uninitialised
  } else if (status == kOutOfMemory) {
    ctx->CtxFailure(tensorflow::errors::ResourceExhausted(error));
  } else {
    ctx->CtxFailure(tensorflow::errors::FailedPrecondition(error));
  }
}

// Both ops: `output` [?, dim] and the scalar `ok`.
absl::Status LookupShape(tensorflow::shape_inference::InferenceContext* c) {
  int64_t dim;
  TF_RETURN_IF_ERROR(c->GetAttr("dim", &dim));
  c->set_output(0, c->Matrix(c->UnknownDim(), dim));
  c->set_output(1, c->Scalar());
  return absl::OkStatus();
}

// Both kernels: the attributes, and `ok` allocated false.
class LookupKernel : public tensorflow::OpKernel {
 public:
  explicit LookupKernel(tensorflow::OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("handle", &handle_));
    OP_REQUIRES_OK(c, c->GetAttr("dim", &dim_));
    OP_REQUIRES_OK(c, c->GetAttr("combiner", &combiner_));
  }

 protected:
  tensorflow::Tensor* AllocateOk(tensorflow::OpKernelContext* ctx) {
    tensorflow::Tensor* ok = nullptr;
    const absl::Status status = ctx->allocate_output(1, tensorflow::TensorShape({}), &ok);
    if (!status.ok()) {
      ctx->CtxFailure(status);
      return nullptr;
    }
    ok->scalar<bool>()() = false;
    return ok;
  }
  // No rows: the input goes to the general path.
  void NoRows(tensorflow::OpKernelContext* ctx) const {
    ctx->set_output(0, tensorflow::Tensor(tensorflow::DT_FLOAT, tensorflow::TensorShape({0, dim_})));
  }

  int64_t handle_ = 0;
  int64_t dim_ = 0;
  int64_t combiner_ = 0;
};

}  // namespace

extern "C" __attribute__((visibility("default"))) int embedcore_tf_set_entry(void* sparse, void* ragged,
                                                                             int version) {
  if (version != kAbiVersion) return 1;
  g_sparse.store(reinterpret_cast<SparseEntry>(sparse));
  g_ragged.store(reinterpret_cast<RaggedEntry>(ragged));
  return 0;
}

REGISTER_OP("EmbedcoreSparseLookup")
    .Input("indices: int64")
    .Input("ids: Tid")
    .Input("dense_shape: int64")
    .Output("output: float")
    .Output("ok: bool")
    .Attr("Tid: {int32, int64}")
    .Attr("handle: int")
    .Attr("dim: int >= 1")
    .Attr("combiner: int >= 0")
    .SetIsStateful()  // reads a table that training changes: never constant-folded or merged
    .SetShapeFn(LookupShape);

template <typename Id>
class EmbedcoreSparseLookupOp : public LookupKernel {
 public:
  using LookupKernel::LookupKernel;

  void Compute(tensorflow::OpKernelContext* ctx) override {
    const tensorflow::Tensor& indices = ctx->input(0);
    const tensorflow::Tensor& ids = ctx->input(1);
    const tensorflow::Tensor& dense_shape = ctx->input(2);
    tensorflow::Tensor* ok = AllocateOk(ctx);
    if (ok == nullptr) return;
    // Rank 2, one index per id, and a dense shape whose size stays sane; anything else: the general path.
    int64_t bags = -1;
    if (indices.dims() == 2 && indices.dim_size(1) == 2 && ids.dims() == 1 &&
        ids.dim_size(0) == indices.dim_size(0) && dense_shape.dims() == 1 && dense_shape.dim_size(0) == 2) {
      const auto shape = dense_shape.flat<int64>();
      const int64_t rows = shape(0), width = shape(1);
      if (rows >= 0 && width >= 0 && (rows == 0 || width <= (int64_t(1) << 62) / rows) &&
          rows <= (int64_t(1) << 40) / dim_)
        bags = rows;
    }
    if (bags < 0) {
      NoRows(ctx);
      return;
    }
    const SparseEntry entry = g_sparse.load();
    OP_REQUIRES(ctx, entry != nullptr, tensorflow::errors::FailedPrecondition("EmbedcoreSparseLookup: ", kNotSet));
    tensorflow::Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, tensorflow::TensorShape({bags, dim_}), &out));
    char error[512] = {0};
    const int status =
        entry(handle_, reinterpret_cast<const int64_t*>(indices.flat<int64>().data()), indices.dim_size(0),
              ids.flat<Id>().data(), sizeof(Id) == 4, bags, int(combiner_), out->flat<float>().data(), dim_, error,
              int64_t(sizeof(error)));
    Finish(ctx, status, error, out, ok);
  }
};

REGISTER_KERNEL_BUILDER(
    Name("EmbedcoreSparseLookup").Device(tensorflow::DEVICE_CPU).TypeConstraint<int32_t>("Tid"),
    EmbedcoreSparseLookupOp<int32_t>);
REGISTER_KERNEL_BUILDER(
    Name("EmbedcoreSparseLookup").Device(tensorflow::DEVICE_CPU).TypeConstraint<int64_t>("Tid"),
    EmbedcoreSparseLookupOp<int64_t>);

// EmbedcoreRaggedLookup: a rank-2 tf.RaggedTensor's bags (values, row_splits)
// pooled by the engine in its own order (unsorted_segment_sum's); `ok` false
// when the engine refuses the input (row_splits that do not partition the
// values, ids out of range): the adapter's general path then reports it.
REGISTER_OP("EmbedcoreRaggedLookup")
    .Input("values: Tid")
    .Input("row_splits: Tsplits")
    .Output("output: float")
    .Output("ok: bool")
    .Attr("Tid: {int32, int64}")
    .Attr("Tsplits: {int32, int64}")
    .Attr("handle: int")
    .Attr("dim: int >= 1")
    .Attr("combiner: int >= 0")
    .SetIsStateful()
    .SetShapeFn(LookupShape);

template <typename Id, typename Split>
class EmbedcoreRaggedLookupOp : public LookupKernel {
 public:
  using LookupKernel::LookupKernel;

  void Compute(tensorflow::OpKernelContext* ctx) override {
    const tensorflow::Tensor& values = ctx->input(0);
    const tensorflow::Tensor& splits = ctx->input(1);
    tensorflow::Tensor* ok = AllocateOk(ctx);
    if (ok == nullptr) return;
    if (values.dims() != 1 || splits.dims() != 1 || splits.dim_size(0) < 1 ||
        splits.dim_size(0) - 1 > (int64_t(1) << 40) / dim_) {
      NoRows(ctx);
      return;
    }
    const RaggedEntry entry = g_ragged.load();
    OP_REQUIRES(ctx, entry != nullptr, tensorflow::errors::FailedPrecondition("EmbedcoreRaggedLookup: ", kNotSet));
    const int64_t bags = splits.dim_size(0) - 1;
    const int64_t* offsets = nullptr;
    tensorflow::Tensor wide;  // int32 row_splits, widened
    if (sizeof(Split) == 8) {
      offsets = reinterpret_cast<const int64_t*>(splits.flat<Split>().data());
    } else {
      OP_REQUIRES_OK(ctx, ctx->allocate_temp(tensorflow::DT_INT64, splits.shape(), &wide));
      const auto in = splits.flat<Split>();
      auto w = wide.flat<int64>();
      for (int64_t i = 0; i <= bags; ++i) w(i) = int64_t(in(i));
      offsets = reinterpret_cast<const int64_t*>(w.data());
    }
    tensorflow::Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, tensorflow::TensorShape({bags, dim_}), &out));
    char error[512] = {0};
    const int status = entry(handle_, values.flat<Id>().data(), sizeof(Id) == 4, values.dim_size(0), offsets, bags,
                             int(combiner_), out->flat<float>().data(), dim_, error, int64_t(sizeof(error)));
    Finish(ctx, status, error, out, ok);
  }
};

#define EMBEDCORE_RAGGED_KERNEL(Id, Split)                                                                 \
  REGISTER_KERNEL_BUILDER(Name("EmbedcoreRaggedLookup")                                                    \
                              .Device(tensorflow::DEVICE_CPU)                                              \
                              .TypeConstraint<Id>("Tid")                                                   \
                              .TypeConstraint<Split>("Tsplits"),                                           \
                          EmbedcoreRaggedLookupOp<Id, Split>)
EMBEDCORE_RAGGED_KERNEL(int32_t, int32_t);
EMBEDCORE_RAGGED_KERNEL(int32_t, int64_t);
EMBEDCORE_RAGGED_KERNEL(int64_t, int32_t);
EMBEDCORE_RAGGED_KERNEL(int64_t, int64_t);
