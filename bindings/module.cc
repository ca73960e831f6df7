// The private native module `_embedcore`. The public API is the pure-Python
// package `embedcore`; nothing here is meant to be imported directly.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "bindings.h"
#include "embedcore/embedcore.h"

namespace nb = nanobind;
using namespace nb::literals;

NB_MODULE(_embedcore, m) {
  // Framework tensors that view a table (DLPack) may outlive it until
  // interpreter shutdown; that is not a leak worth a warning.
  nb::set_leak_warnings(false);
  // At exit, threads coming back from native work wait rather than being ended inside it (see ReleaseGil).
  nb::module_::import_("atexit").attr("register")(
      nb::cpp_function([] { embedcore::bindings::ReleaseGil::DrainBeforeExit(); }));
  nb::module_::import_("os").attr("register_at_fork")(
      "after_in_child"_a = nb::cpp_function([] { embedcore::bindings::ReleaseGil::ForgetInChild(); }));
  // InvalidArgument (std::invalid_argument) -> ValueError and OutOfRange
  // (std::out_of_range) -> IndexError come with nanobind; the rest are ours.
  nb::exception<embedcore::NotCompiled>(m, "NotCompiledError", PyExc_RuntimeError);
  nb::exception<embedcore::CheckpointError>(m, "CheckpointError", PyExc_ValueError);
  nb::exception<embedcore::OptimizerChanged>(m, "OptimizerChanged", PyExc_RuntimeError);
  // Ctrl-C while a checkpoint's lock is awaited raises KeyboardInterrupt then, not after the wait.
  embedcore::SetInterruptCheck(&embedcore::bindings::ReleaseGil::CheckSignals);
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const embedcore::Interrupted& e) {
      embedcore::bindings::ReleaseGil::RaiseInterrupted(e.what());
    } catch (const embedcore::TypeMismatch& e) {
      PyErr_SetString(PyExc_TypeError, e.what());
    } catch (const embedcore::IoError& e) {
      if (e.error_number() == 0) {
        PyErr_SetString(PyExc_OSError, e.what());
        return;
      }
      // OSError(errno, message) is the errno's subclass (FileNotFoundError for ENOENT, ...) with .errno set,
      // so code can tell a full disk from a missing directory without reading the message.
      PyObject* args = Py_BuildValue("(is)", e.error_number(), e.what());
      if (args != nullptr) {
        PyErr_SetObject(PyExc_OSError, args);
        Py_DECREF(args);
      }
    }
  });

  m.def("set_num_threads", &embedcore::SetNumThreads, "n"_a,
        "Sets the number of threads the kernels use; results never depend on it.");
  m.def("get_num_threads", &embedcore::GetNumThreads);
  m.def("build_info", [] {
    const embedcore::BuildInfo info = embedcore::GetBuildInfo();
    nb::dict d;
    d["version"] = info.version;
    d["cuda"] = info.cuda;
    d["cuda_architectures"] = info.cuda_architectures;
    d["cuda_devices"] = info.cuda_devices;
    d["nccl"] = info.nccl;
    d["mpi"] = info.mpi;
    d["simd"] = info.simd;
    d["compiler"] = info.compiler;
    return d;
  });
  m.attr("__version__") = EMBEDCORE_VERSION_STRING;
  embedcore::bindings::BindTable(m);
  embedcore::bindings::BindDistributed(m);
  embedcore::bindings::BindCheckpoint(m);
  embedcore::bindings::BindNative(m);
}
