"""The adapter's TensorFlow kernels (``native/sparse_lookup_op.cc``):
``tf.SparseTensor`` and ``tf.RaggedTensor`` lookups inside ``tf.function``
without a Python callback.

TensorFlow's C++ API is not stable across its releases, so the kernels are
not shipped compiled: they are built on first use against the TensorFlow in this
process (``tf.sysconfig`` flags, the C++ compiler ``$CXX`` or ``c++``; about
10 s), cached under ``$EMBEDCORE_CACHE_DIR`` (default
``$XDG_CACHE_HOME/embedcore`` or ``~/.cache/embedcore``) by a key of its
source, TensorFlow's version and flags and the compiler, and loaded with
``tf.load_op_library``. The kernels only convert: the engine's entry points
(``_embedcore.native_entry_points``) do the work, on tables named by
handles of the engine's registry.

``EMBEDCORE_TF_OP`` chooses, when a lookup is traced: ``auto`` (the
default: build them, or warn once and use the ``tf.numpy_function`` path when
that fails, e.g. no compiler), ``off`` (never), ``required`` (raise
``NativeOpError`` when they cannot be built); another value raises
``ValueError``.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
import weakref

import tensorflow as tf
from absl import logging

from embedcore import _embedcore

__all__ = ["sparse_lookup_op", "ragged_lookup_op", "handle_of", "NativeOpError"]

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "native", "sparse_lookup_op.cc")
_ABI_VERSION = 2  # the entry points' version the kernels are written for

_lock = threading.Lock()
_loaded = None  # the op module, False when it cannot be had, None before the first try
_handles: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


class NativeOpError(RuntimeError):
    """The kernel could not be built or loaded (``EMBEDCORE_TF_OP=required``)."""

    # AutoGraph re-raises an error from inside a tf.function as its own type only when it can build one from
    # a message: for a class whose __init__ is Exception's (or a few builtins), else it raises a StagingError.
    __init__ = Exception.__init__


def _mode() -> str:
    """EMBEDCORE_TF_OP, read when a lookup is traced (a bad value raises ValueError there)."""
    mode = os.environ.get("EMBEDCORE_TF_OP", "auto").strip().lower() or "auto"
    if mode not in ("auto", "off", "required"):
        raise ValueError(f"EMBEDCORE_TF_OP must be auto, off or required, got {mode!r}")
    return mode


def cache_dir() -> str:
    base = os.environ.get("EMBEDCORE_CACHE_DIR")
    if not base:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        base = os.path.join(xdg, "embedcore")
    return base


def _compiler() -> str:
    return os.environ.get("CXX") or "c++"


def _build(rebuild: bool = False) -> str:
    """Builds the kernel (or finds it built, unless `rebuild`); returns the library's path."""
    cxx = _compiler()
    if shutil.which(cxx) is None:
        raise NativeOpError(f"no C++ compiler '{cxx}' (set CXX) to build embedcore's TensorFlow kernel")
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60).stdout
    cflags, lflags = tf.sysconfig.get_compile_flags(), tf.sysconfig.get_link_flags()
    with open(SOURCE, "rb") as f:
        source = f.read()
    key = hashlib.sha256(b"\0".join([source, tf.__version__.encode(), " ".join(cflags + lflags).encode(),
                                     cxx.encode(), version.encode()])).hexdigest()[:20]
    directory = cache_dir()
    path = os.path.join(directory, f"tf_sparse_lookup_op-{key}.so")
    if os.path.exists(path) and not rebuild:
        return path
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=directory)
    os.close(fd)
    try:
        cmd = [cxx, "-shared", "-fPIC", "-O2", "-fvisibility=hidden", *cflags, SOURCE, "-o", tmp, *lflags]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if res.returncode != 0:
            raise NativeOpError(f"building embedcore's TensorFlow kernel failed ({' '.join(cmd)}):\n"
                                + res.stderr[-4000:])
        os.replace(tmp, path)  # atomic: a concurrent build of the same key writes the same bytes
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def _load():
    path = _build()
    try:
        module = tf.load_op_library(path)
    except Exception:  # noqa: BLE001 - a damaged cached library: built again, once
        path = _build(rebuild=True)
        module = tf.load_op_library(path)
    entry = _embedcore.native_entry_points()
    if entry["version"] != _ABI_VERSION:
        raise NativeOpError(f"embedcore's entry points are version {entry['version']}, the kernel's "
                            f"{_ABI_VERSION}")
    set_entry = ctypes.CDLL(path).embedcore_tf_set_entry  # the same loaded library
    set_entry.argtypes, set_entry.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int], ctypes.c_int
    if set_entry(ctypes.c_void_p(entry["sparse_segment_lookup"]), ctypes.c_void_p(entry["ragged_lookup"]),
                 _ABI_VERSION) != 0:
        raise NativeOpError("embedcore's TensorFlow kernel refused the engine's entry point version")
    return module


def sparse_lookup_op():
    """The op function ``embedcore_sparse_lookup``, or None when
    ``EMBEDCORE_TF_OP=off`` or (``auto``) the kernels cannot be built."""
    module = _module()
    return module.embedcore_sparse_lookup if module else None


def ragged_lookup_op():
    """The op function ``embedcore_ragged_lookup``, or None (as above)."""
    module = _module()
    return module.embedcore_ragged_lookup if module else None


def _module():
    global _loaded
    mode = _mode()
    if mode == "off":
        return None
    with _lock:
        if _loaded is None:
            try:
                _loaded = _load()
            except Exception as e:  # noqa: BLE001 - any failure to build or load: the Python path
                if mode == "required":
                    raise NativeOpError(f"EMBEDCORE_TF_OP=required: {e}") from e
                logging.warning("embedcore: TensorFlow kernels unavailable, SparseTensor and RaggedTensor lookups "
                                "in tf.function run through tf.numpy_function: %s", e)
                _loaded = False
        elif _loaded is False and mode == "required":
            raise NativeOpError("EMBEDCORE_TF_OP=required, but embedcore's TensorFlow kernel failed to build "
                                "earlier in this process")
    return _loaded or None


def handle_of(table) -> int:
    """The engine registry's handle of an ``embedcore.Table`` (registered on
    first use, unregistered when the table is collected; a graph that still
    names it then fails with FailedPreconditionError instead of reading
    freed memory)."""
    with _lock:
        handle = _handles.get(table)
        if handle is None:
            native = table._native
            handle = _embedcore.register_native_table(native, native)
            _handles[table] = handle
            weakref.finalize(table, _embedcore.unregister_native_table, handle)
        return handle
