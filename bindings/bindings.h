// Shared by the binding files: array types at the boundary, the CSR batch
// built from them without copies, and engine-allocated NumPy outputs.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <thread>
#include <cstdint>
#include <algorithm>
#include <functional>
#include <optional>
#include <utility>
#include <string>
#include <vector>

#include "embedcore/embedcore.h"
#include "shared_checks.h"

namespace embedcore::bindings {

namespace nb = nanobind;

/// Releases the GIL for the scope, as nb::gil_scoped_release, but never lets
/// Python end the thread at the scope's end. A daemon thread that takes the
/// GIL back while the interpreter finalizes (the main thread has returned)
/// is ended by Python inside PyEval_RestoreThread: a pthread_exit unwinding
/// through a noexcept destructor, so std::terminate aborted the whole process
/// at exit. So at exit (DrainBeforeExit, an atexit hook, which runs before
/// finalization starts) the exiting thread waits for the threads already
/// taking the GIL back; after that, another thread that comes back from
/// native work waits here while the exit goes on: for good once
/// finalization has started (the exit ends the process, as it would have in
/// native code), or, if it has not started within 2 s (another atexit hook
/// may be joining this thread), takes the GIL back. The bound is long
/// because a thread blocked on the GIL when finalization starts is ended
/// there, and atexit hooks registered before embedcore's (which run after
/// it) may hold the GIL a while (100 ms was too short on a busy machine); a
/// thread that is ended there all the same (a hook held the GIL longer) is
/// parked rather than aborting the process (RestoreOrPark).
/// The exiting thread itself (a __del__ in the last collection) takes the
/// GIL back as usual.
class ReleaseGil {
 public:
  ReleaseGil() : state_(PyEval_SaveThread()) {}
  ~ReleaseGil() {
    restoring().fetch_add(1);  // seq_cst, as the hook's store and load: it sees us, or we see it
    if (exiting().load() && PyThread_get_thread_ident() != exit_thread().load()) {
      restoring().fetch_sub(1);
      for (int waited_ms = 0; waited_ms < kExitWaitMs || Finalizing(); ++waited_ms)
        std::this_thread::sleep_for(std::chrono::milliseconds(Finalizing() ? 1000 : 1));
      restoring().fetch_add(1);
    }
    RestoreOrPark(state_);
    restoring().fetch_sub(1);
  }
  ReleaseGil(const ReleaseGil&) = delete;
  ReleaseGil& operator=(const ReleaseGil&) = delete;

  /// The atexit hook (called with the GIL held): from now on other threads
  /// coming back from native work wait; those already taking the GIL back
  /// get it, and are waited for, before this returns.
  static void DrainBeforeExit() {
    exit_thread().store(PyThread_get_thread_ident());
    exiting().store(true);
    PyThreadState* state = PyEval_SaveThread();
    while (restoring().load() > 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    PyEval_RestoreThread(state);
  }

  /// The interrupt check of native waits (embedcore::SetInterruptCheck),
  /// called without the GIL from inside a ReleaseGil scope: takes the GIL
  /// back (as the destructor does, counted, so an exit waits for it; not
  /// once the exit has begun) and runs Python's signal handlers (on the main
  /// thread). True when one raised (Ctrl-C: KeyboardInterrupt): its error is
  /// kept for this thread, and RaiseInterrupted sets it once the wait has
  /// thrown embedcore::Interrupted back to the bindings.
  static bool CheckSignals() {
    restoring().fetch_add(1);
    if (exiting().load() || Finalizing()) {
      restoring().fetch_sub(1);
      return false;
    }
    const PyGILState_STATE gil = PyGILState_Ensure();
    bool raised = false;
    if (PyErr_CheckSignals() != 0) {
      PyObject *type, *value, *trace;
      PyErr_Fetch(&type, &value, &trace);
      PyErr_NormalizeException(&type, &value, &trace);
      Py_XDECREF(type);
      Py_XDECREF(trace);
      Py_XDECREF(pending());
      pending() = value;
      raised = true;
    }
    PyGILState_Release(gil);
    restoring().fetch_sub(1);
    return raised;
  }
  /// With the GIL: sets the error CheckSignals kept for this thread (what
  /// the signal handler raised: KeyboardInterrupt for Ctrl-C), or, if none
  /// was kept, KeyboardInterrupt(`message`).
  static void RaiseInterrupted(const char* message) {
    PyObject* error = pending();
    pending() = nullptr;
    if (error == nullptr) {
      PyErr_SetString(PyExc_KeyboardInterrupt, message);
      return;
    }
    PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(error)), error);
    Py_DECREF(error);
  }

  /// In a forked child (os.register_at_fork): the threads counted in the
  /// parent do not exist here, and the exit, if one was under way, is not
  /// this process's.
  static void ForgetInChild() {
    restoring().store(0);
    exiting().store(false);
    exit_thread().store(0);
  }

 private:
  static constexpr int kExitWaitMs = 2000;  // (in 1 ms sleeps: a little longer)

  /// PyEval_RestoreThread, from a function that may be unwound: if Python
  /// ends the thread in it (it was blocked on the GIL when finalization
  /// started: an atexit hook held the GIL past the wait above), pthread_exit's
  /// unwinding runs `parked`'s destructor before it reaches the noexcept
  /// ~ReleaseGil, which would call std::terminate and abort the exit; the
  /// destructor keeps the thread asleep instead, until the process exits
  /// (as Python 3.14 itself does with such threads).
  static void RestoreOrPark(PyThreadState* state) {
    struct Parked {
      bool restored = false;
      ~Parked() {
        while (!restored) std::this_thread::sleep_for(std::chrono::seconds(1));
      }
    } parked;
    PyEval_RestoreThread(state);
    parked.restored = true;
  }
  static PyObject*& pending() {  // this thread's error from CheckSignals, until RaiseInterrupted sets it
    thread_local PyObject* error = nullptr;
    return error;
  }
  static std::atomic<int>& restoring() {
    static std::atomic<int> n{0};
    return n;
  }
  static std::atomic<bool>& exiting() {
    static std::atomic<bool> e{false};
    return e;
  }
  static std::atomic<unsigned long>& exit_thread() {
    static std::atomic<unsigned long> t{0};
    return t;
  }
  static bool Finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
    return Py_IsFinalizing() != 0;
#else
    return _Py_IsFinalizing() != 0;
#endif
  }
  PyThreadState* state_;
};

void BindTable(nb::module_& m);
void BindCheckpoint(nb::module_& m);
void BindDistributed(nb::module_& m);
void BindNative(nb::module_& m);

using IdArray = nb::ndarray<nb::ro, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using OffsetArray = nb::ndarray<const int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using WeightArray = nb::ndarray<const float, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using FloatIn = nb::ndarray<const float, nb::c_contig, nb::device::cpu>;
using FloatOut = nb::ndarray<float, nb::c_contig, nb::device::cpu>;
using NumpyFloat = nb::ndarray<nb::numpy, float>;
using NumpyView = nb::ndarray<nb::numpy, nb::ro>;

/// A Batch over the arrays' memory (host or device alike: no element is read).
template <typename Ids, typename Offsets, typename Weights>
Batch MakeBatch(const Ids& ids, const Offsets& offsets, const std::optional<Weights>& weights) {
  Batch b;
  if (ids.dtype() == nb::dtype<int32_t>()) {
    b.id_type = IdType::kInt32;
  } else if (ids.dtype() == nb::dtype<int64_t>()) {
    b.id_type = IdType::kInt64;
  } else {
    throw TypeMismatch("ids must be int32 or int64");
  }
  b.ids = ids.data();
  b.nnz = int64_t(ids.shape(0));
  if (offsets.shape(0) < 1) throw InvalidArgument("offsets must hold at least one element (0)");
  b.offsets = offsets.data();
  b.num_bags = int64_t(offsets.shape(0)) - 1;
  if (weights) {
    if (int64_t(weights->shape(0)) != b.nnz)
      throw InvalidArgument("weights must have one value per id: len(weights) = " +
                            std::to_string(weights->shape(0)) + ", len(ids) = " + std::to_string(b.nnz));
    b.weights = weights->data();
  }
  return b;
}

/// One window of LookupWindows: `count` bags from bag `first` of the source, pooled with `combiner`
/// by a table of `dim` columns.
struct SourceWindow {
  int64_t dim, first, count;
  int combiner;
};

/// Pooled lookups of windows of one CSR source (a KeyedJaggedTensor's
/// features) into consecutive columns of one C-contiguous float32 `out`
/// ([bags, sum of the dims]): window i writes its dim_i columns after those
/// of the windows before it, by `lookup(i, window batch, shape, first
/// column)`. Shapes are checked before any lookup runs, and the lookups run
/// in one release of the GIL; a bad id leaves `out` partly written. (Table
/// and served tables alike: lookup_windows_into.)
void LookupWindows(const IdArray& ids, const OffsetArray& offsets, const std::optional<WeightArray>& weights,
                   const std::vector<SourceWindow>& windows, const FloatOut& out,
                   const std::function<void(size_t, const Batch&, const OutputShape&, float*)>& lookup);

// CUDA arrays (DLPack from PyTorch, CuPy, ...), for device tables.
using CudaIdArray = nb::ndarray<nb::ro, nb::ndim<1>, nb::c_contig, nb::device::cuda>;
using CudaOffsetArray = nb::ndarray<const int64_t, nb::ndim<1>, nb::c_contig, nb::device::cuda>;
using CudaWeightArray = nb::ndarray<const float, nb::ndim<1>, nb::c_contig, nb::device::cuda>;
using CudaFloatIn = nb::ndarray<const float, nb::c_contig, nb::device::cuda>;
using CudaFloatOut = nb::ndarray<float, nb::c_contig, nb::device::cuda>;

inline Combiner ToCombiner(int c) {
  if (c < 0 || c > 3) throw InvalidArgument("combiner code must be 0..3, got " + std::to_string(c));
  return Combiner(c);
}

/// The output's dimensions; InvalidArgument when its float count (or bytes)
/// overflows, naming `what` (a lookup's output, a step's grads).
inline std::vector<size_t> OutputDims(const Batch& b, const OutputShape& s, int64_t dim,
                                      const char* what = "the lookup's output") {
  std::vector<size_t> dims;
  if (s.combiner != Combiner::kNone)
    dims = {size_t(b.num_bags), size_t(dim)};
  else if (s.max_sequence_length > 0)
    dims = {size_t(b.num_bags), size_t(s.max_sequence_length), size_t(dim)};
  else
    dims = {size_t(b.nnz), size_t(dim)};
  size_t n = sizeof(float);
  for (size_t d : dims)
    if (__builtin_mul_overflow(n, d, &n) || n > size_t(INT64_MAX))
      throw InvalidArgument(std::string(what) + " (" + std::to_string(b.num_bags) + " bags, max_sequence_length " +
                            std::to_string(s.max_sequence_length) + ", dim " + std::to_string(dim) +
                            ") would not fit in memory: its size overflows");
  return dims;
}

/// The float count of OutputDims (checked the same way): what a lookup
/// writes, or a step's grads hold.
inline size_t OutputFloats(const Batch& b, const OutputShape& s, int64_t dim,
                           const char* what = "the lookup's output") {
  size_t n = 1;
  for (size_t d : OutputDims(b, s, dim, what)) n *= d;
  return n;
}

using internal::Overlaps;  // (core/shared_checks.h)

/// InvalidArgument when `out` (written by a lookup) shares memory with one of its inputs.
template <typename Ids, typename Offsets, typename Weights, typename Out>
void CheckNoAliasing(const Ids& ids, const Offsets& offsets, const std::optional<Weights>& weights, const Out& out) {
  const size_t out_bytes = out.size() * sizeof(float);
  auto check = [&](const void* p, size_t bytes, const char* what) {
    if (Overlaps(out.data(), out_bytes, p, bytes))
      throw InvalidArgument(std::string("out shares memory with ") + what + ": pass a separate output array");
  };
  check(ids.data(), ids.nbytes(), "ids");
  check(offsets.data(), offsets.nbytes(), "offsets");
  if (weights) check(weights->data(), weights->nbytes(), "weights");
}


/// The DLPack dtype of stored values (bfloat16 as uint16 bits: NumPy has no bfloat16).
inline nb::dlpack::dtype StorageDLType(DType d) {
  switch (d) {
    case DType::kFloat32:
      return nb::dtype<float>();
    case DType::kFloat16:
      return nb::dlpack::dtype{uint8_t(nb::dlpack::dtype_code::Float), 16, 1};
    case DType::kBFloat16:  // NumPy has no bfloat16: the raw bits, as uint16
      return nb::dtype<uint16_t>();
  }
  return nb::dtype<float>();
}

/// A new array of n `T` (uninitialised) for NumPy to own: the engine's result
/// memory (AllocateResult: huge pages for large blocks), freed with the
/// capsule, also when filling it throws.
template <typename T>
std::pair<T*, nb::capsule> NewResult(size_t n) {
  size_t bytes = 0;
  if (__builtin_mul_overflow(std::max<size_t>(n, 1), sizeof(T), &bytes))
    throw OutOfMemory("the result (" + std::to_string(n) + " values) cannot be allocated: its size overflows");
  T* p = nullptr;
  try {
    p = static_cast<T*>(AllocateResult(bytes));
  } catch (const std::bad_alloc& e) {
    throw OutOfMemory(std::string("the result (") + std::to_string(n) + " values): " + e.what());
  }
  return {p, nb::capsule(p, [](void* q) noexcept { FreeResult(q); })};
}

/// A lookup of host arrays by a table `dim` wide: its batch, its shape
/// (checked) and its output's dimensions; LookupNew's and LookupOut's start.
struct HostLookup {
  Batch batch;
  OutputShape shape;
  std::vector<size_t> dims;
};
inline HostLookup PrepareLookup(int64_t dim, const IdArray& ids, const OffsetArray& offsets,
                                const std::optional<WeightArray>& weights, int combiner, int64_t max_sequence_length) {
  HostLookup l{MakeBatch(ids, offsets, weights), OutputShape{ToCombiner(combiner), max_sequence_length}, {}};
  internal::CheckLookupSequenceLength(l.shape);
  l.dims = OutputDims(l.batch, l.shape, dim);
  return l;
}

/// Runs `lookup(batch, shape, out)` with the GIL released into a new array
/// that the engine allocated and NumPy owns.
template <typename F>
NumpyFloat LookupNew(int64_t dim, const IdArray& ids, const OffsetArray& offsets,
                     const std::optional<WeightArray>& weights, int combiner, int64_t max_sequence_length, F&& lookup) {
  const HostLookup l = PrepareLookup(dim, ids, offsets, weights, combiner, max_sequence_length);
  size_t n = 1;
  for (size_t d : l.dims) n *= d;
  auto [data, owner] = NewResult<float>(n);
  {
    ReleaseGil release;
    lookup(l.batch, l.shape, data);
  }
  return NumpyFloat(data, l.dims.size(), l.dims.data(), owner);
}

/// Like LookupNew, into the caller's C-contiguous float32 `out` of the right shape.
template <typename F>
void LookupOut(int64_t dim, const IdArray& ids, const OffsetArray& offsets, const std::optional<WeightArray>& weights,
               int combiner, int64_t max_sequence_length, const FloatOut& out, F&& lookup) {
  const HostLookup l = PrepareLookup(dim, ids, offsets, weights, combiner, max_sequence_length);
  CheckNoAliasing(ids, offsets, weights, out);
  bool same = out.ndim() == l.dims.size();
  for (size_t i = 0; same && i < l.dims.size(); ++i) same = out.shape(i) == l.dims[i];
  if (!same) {
    std::string want = "[";
    for (size_t i = 0; i < l.dims.size(); ++i) want += (i ? ", " : "") + std::to_string(l.dims[i]);
    throw InvalidArgument("out must have shape " + want + "]");
  }
  ReleaseGil release;
  lookup(l.batch, l.shape, out.data());
}

}  // namespace embedcore::bindings
