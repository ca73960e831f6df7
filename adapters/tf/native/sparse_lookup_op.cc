// EmbedcoreSparseLookup: a tf.SparseTensor lookup of an embedcore table as a
// TensorFlow kernel, so that a tf.function runs it without a Python callback.
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
// general path (indices out of order or outside the dense shape, negative
// ids, ids out of range, an unusual shape), `ok` is false, `output` holds
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

// The engine's entry point, version 1 (bindings/native.cc: SparseSegmentLookup).
using Entry = int (*)(int64_t handle, const int64_t* indices, int64_t nnz, const void* ids, int ids_int32,
                      int64_t bags, int combiner, float* out, int64_t dim, char* error, int64_t error_size);
constexpr int kAbiVersion = 1;
enum Status : int { kOk = 0, kGeneralPath = 1, kOutOfMemory = 2, kFailed = 3 };

std::atomic<Entry> g_entry{nullptr};

}  // namespace

extern "C" __attribute__((visibility("default"))) int embedcore_tf_set_entry(void* entry, int version) {
  if (version != kAbiVersion) return 1;
  g_entry.store(reinterpret_cast<Entry>(entry));
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
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
      int64_t dim;
      TF_RETURN_IF_ERROR(c->GetAttr("dim", &dim));
      c->set_output(0, c->Matrix(c->UnknownDim(), dim));
      c->set_output(1, c->Scalar());
      return absl::OkStatus();
    });

template <typename Id>
class EmbedcoreSparseLookupOp : public tensorflow::OpKernel {
 public:
  explicit EmbedcoreSparseLookupOp(tensorflow::OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("handle", &handle_));
    OP_REQUIRES_OK(c, c->GetAttr("dim", &dim_));
    OP_REQUIRES_OK(c, c->GetAttr("combiner", &combiner_));
  }

  void Compute(tensorflow::OpKernelContext* ctx) override {
    const tensorflow::Tensor& indices = ctx->input(0);
    const tensorflow::Tensor& ids = ctx->input(1);
    const tensorflow::Tensor& dense_shape = ctx->input(2);
    tensorflow::Tensor* ok = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, tensorflow::TensorShape({}), &ok));
    ok->scalar<bool>()() = false;
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
    const tensorflow::Tensor none(tensorflow::DT_FLOAT, tensorflow::TensorShape({0, dim_}));
    if (bags < 0) {
      ctx->set_output(0, none);
      return;
    }
    const Entry entry = g_entry.load();
    OP_REQUIRES(ctx, entry != nullptr,
                tensorflow::errors::FailedPrecondition(
                    "EmbedcoreSparseLookup: the op library was loaded without embedcore's engine; "
                    "it is loaded by embedcore.adapters.tf"));
    tensorflow::Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, tensorflow::TensorShape({bags, dim_}), &out));
    char error[512] = {0};
    const int status =
        entry(handle_, reinterpret_cast<const int64_t*>(indices.flat<int64>().data()), indices.dim_size(0),
              ids.flat<Id>().data(), sizeof(Id) == 4, bags, int(combiner_), out->flat<float>().data(), dim_, error,
              int64_t(sizeof(error)));
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

 private:
  int64_t handle_ = 0;
  int64_t dim_ = 0;
  int64_t combiner_ = 0;
};

REGISTER_KERNEL_BUILDER(
    Name("EmbedcoreSparseLookup").Device(tensorflow::DEVICE_CPU).TypeConstraint<int32_t>("Tid"),
    EmbedcoreSparseLookupOp<int32_t>);
REGISTER_KERNEL_BUILDER(
    Name("EmbedcoreSparseLookup").Device(tensorflow::DEVICE_CPU).TypeConstraint<int64_t>("Tid"),
    EmbedcoreSparseLookupOp<int64_t>);
