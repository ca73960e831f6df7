"""Input forms of a lookup and their conversion to the engine's CSR batch.

Arrays are taken through DLPack or the buffer protocol without a copy when
they are C-contiguous and of a supported dtype (ids int32/int64, weights
float32); anything else is converted once, here, with the argument named in
every error.
"""
from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from typing import Optional

import numpy as np

from . import _embedcore

__all__ = ["Ragged", "Sparse"]

_INT64_MAX = np.iinfo(np.int64).max
_INT64_MIN = np.iinfo(np.int64).min


class Ragged:
    """Bags in CSR form: bag ``b`` is ``values[offsets[b]:offsets[b + 1]]``.

    ``offsets`` has ``batch + 1`` elements, starts at 0 and ends at
    ``len(values)`` (TensorFlow's ``row_splits``)."""

    __slots__ = ("values", "offsets")

    def __init__(self, values, offsets):
        self.values = values
        self.offsets = offsets

    @classmethod
    def from_lengths(cls, values, lengths) -> "Ragged":
        """The batch whose bag ``i`` holds the next ``lengths[i]`` of
        `values` (TorchRec's lengths, ``tf.RaggedTensor.from_row_lengths``):
        offsets are the lengths' running sum from 0. ``ValueError`` for
        lengths that are negative or that add up past int64."""
        lengths = as_int_array(lengths, "lengths")
        if lengths.ndim != 1:
            raise ValueError(f"lengths must be 1-D, got shape {lengths.shape}")
        if lengths.size and lengths.min() < 0:
            k = int(np.argmax(lengths < 0))
            raise ValueError(f"lengths must be >= 0, got {int(lengths[k])} at position {k}")
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        wrapped = offsets[1:] < offsets[:-1]  # (lengths are >= 0: only a sum past int64 decreases)
        if wrapped.any():
            k = int(np.argmax(wrapped))
            raise ValueError(f"lengths add up to more than int64 holds (2**63 - 1) by position {k}")
        shape = np.shape(values)
        if shape and shape[0] != offsets[-1]:
            raise ValueError(f"lengths add up to {int(offsets[-1])}, but values has {shape[0]} elements")
        return cls(values, offsets)

    def __repr__(self) -> str:
        return f"Ragged(values={self.values!r}, offsets={self.offsets!r})"


class Sparse:
    """Bags in COO form, as a rank-2 ``tf.SparseTensor``: ``indices`` is
    ``[nnz, 2]`` (bag, position), ``values`` the ``nnz`` ids (or weights),
    and ``dense_shape`` the ``[batch, max_len]`` shape. (Higher ranks are
    refused: reshape them to ``[bags, positions]`` first, as
    ``tf.sparse.reshape`` does.)"""

    __slots__ = ("indices", "values", "dense_shape")

    def __init__(self, indices, values, dense_shape):
        self.indices = indices
        self.values = values
        self.dense_shape = dense_shape

    def __repr__(self) -> str:
        return f"Sparse(indices={self.indices!r}, values={self.values!r}, dense_shape={self.dense_shape!r})"


# ------------------------------------------------------------------ arrays
def to_numpy(x, where: str) -> np.ndarray:
    """A NumPy view of `x` (DLPack or buffer protocol), or a converted copy."""
    if isinstance(x, np.ndarray):  # a subclass (np.matrix keeps 2 dimensions through reshape): its plain array
        return x if type(x) is np.ndarray else np.asarray(x)
    torch = sys.modules.get("torch")  # (imported by the caller if x is its tensor; embedcore never imports it)
    if torch is not None and isinstance(x, torch.Tensor):  # a Parameter, a subclass too: read detached
        if _functorch_wrapped(torch, x):  # (its DLPack memory is not its values: functionalize's read garbage)
            raise TypeError(f"{where}: a tensor inside a torch.func transform (functionalize, vmap, grad) holds "
                            "no memory embedcore can read: call embedcore outside the transform, or through the "
                            "PyTorch adapter's modules (custom ops)")
        if x.requires_grad:
            x = x.detach()
        if x.dtype is torch.bfloat16:
            # DLPack and NumPy carry no bfloat16: widen it (exactly) in torch, on its device.
            return to_numpy(x.float(), where)
        if x.is_neg() or x.is_conj():  # (a lazy negation or conjugation, which DLPack and numpy() do not apply)
            x = x.resolve_conj().resolve_neg()
        if x.is_cpu:
            try:
                return x.numpy()  # the same view as DLPack's, in a quarter of its time (~0.5 us)
            except (TypeError, RuntimeError):  # (a dtype NumPy lacks, a fake or functional tensor: DLPack's way)
                pass
    tf_dtype = getattr(x, "dtype", None) if type(x).__module__.startswith("tensorflow") else None
    if getattr(tf_dtype, "is_quantized", False):  # (NumPy reads its raw ints: ids or values they are not)
        raise TypeError(f"{where} must be an array of numbers, got a TensorFlow tensor of the quantized dtype "
                        f"{tf_dtype.name}: dequantize it first (tf.quantization.dequantize)")
    if hasattr(x, "__dlpack__") and not isinstance(x, (list, tuple)) and not _tf_not_numeric(tf_dtype):
        try:
            return np.from_dlpack(x)
        except Exception:  # noqa: BLE001 - e.g. a device not NumPy's, or a dtype DLPack cannot carry
            pass  # (NumPy's conversion below gives the array, or the error that names it)
    try:
        return np.asarray(x)
    except Exception as e:  # noqa: BLE001 - report what could not be read, and where
        raise TypeError(f"{where} must be an array, got {type(x).__name__}: {e}") from None


def _functorch_wrapped(torch, x) -> bool:
    is_wrapped = getattr(getattr(torch._C, "_functorch", None), "is_functorch_wrapped_tensor", None)
    return bool(is_wrapped(x)) if is_wrapped is not None else False


def _tf_not_numeric(dtype) -> bool:
    """Whether `dtype` (a TensorFlow tensor's; None for other objects) is of
    strings, resources or variants: such a tensor's ``__dlpack__`` aborts
    the process (a CHECK in TensorFlow), so NumPy's conversion takes it (and
    the caller refuses its dtype)."""
    if dtype is None:
        return False
    return not any(getattr(dtype, k, False) for k in ("is_integer", "is_floating", "is_bool", "is_complex"))


def _is_bfloat16(dtype: np.dtype) -> bool:
    """ml_dtypes' bfloat16 (TensorFlow's and JAX's NumPy arrays): a dtype of kind 'V'."""
    return dtype.kind == "V" and dtype.name == "bfloat16" and dtype.itemsize == 2


def _python_ints(x, where: str, overflow: type = ValueError) -> Optional[np.ndarray]:
    """A list or tuple of ints (nested evenly) that NumPy did not make an
    integer array of (ints beyond int64 make an object array; an int64
    beside one in [2**63, 2**64), or NumPy int64 and uint64 scalars mixed,
    a float64 one): as int64 when they all fit, naming the first that does
    not otherwise (an `overflow` error); None when they are not all ints (a
    dtype error)."""
    if not isinstance(x, (list, tuple)):
        return None
    try:
        a = np.array(x, dtype=object)
    except ValueError:  # ragged
        return None
    flat = a.reshape(-1)
    if not all(isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)) for v in flat):
        return None
    for k, v in enumerate(flat):
        if not _INT64_MIN <= int(v) <= _INT64_MAX:
            raise overflow(f"{where}: value {int(v)} at position {k} does not fit in int64")
    return np.array([int(v) for v in flat], dtype=np.int64).reshape(a.shape)


def as_int_array(x, where: str, overflow: type = ValueError) -> np.ndarray:
    """int32 or int64, C-contiguous; other integer dtypes are converted. A
    value beyond int64 raises `overflow`: IndexError for ids (an id outside
    the table), ValueError for offsets, lengths, indices and shapes."""
    a = to_numpy(x, where)
    if a.dtype == np.int32 or a.dtype == np.int64:
        pass
    elif a.dtype.kind in "iu":
        if a.dtype == np.uint64 and a.size and int(a.max()) > _INT64_MAX:
            k = int(np.argmax(a > _INT64_MAX))
            raise overflow(f"{where}: value {int(a.flat[k])} at position {k} does not fit in int64")
        a = a.astype(np.int64)
    elif a.size == 0 and a.dtype.kind == "f" and not isinstance(x, np.ndarray):
        a = a.astype(np.int64)  # an empty Python list
    else:
        exact = _python_ints(x, where, overflow) if a.dtype.kind in "fO" else None
        if exact is None:
            raise TypeError(f"{where} must be an integer array (int32 or int64), got dtype {a.dtype}")
        a = exact
    return a if a.flags.c_contiguous else np.ascontiguousarray(a)  # (ascontiguousarray makes a 0-d array 1-d)


def as_offsets(x, where: str) -> np.ndarray:
    a = as_int_array(x, where)
    if a.ndim != 1:
        raise ValueError(f"{where} must be 1-D, got shape {a.shape}")
    if a.size == 0:
        raise ValueError(f"{where} must hold batch + 1 values starting at 0, got an empty array")
    return np.ascontiguousarray(a, dtype=np.int64)


def as_float32(x, where: str) -> np.ndarray:
    """float32, C-contiguous (weights, gradients, assigned values). Other
    float and integer dtypes (bfloat16 included) are converted; a finite
    value that float32 cannot hold (it would become inf) is refused."""
    a = to_numpy(x, where)
    if a.dtype == np.float32:  # the hot path (gradients, weights): nothing to convert or check
        return a if a.flags.c_contiguous and a.ndim > 0 else np.ascontiguousarray(a)  # (0-d made 1-d)
    if _is_bfloat16(a.dtype):
        return np.ascontiguousarray(a.astype(np.float32))  # exact: bfloat16 is float32's upper half
    if a.dtype.kind not in "fiu" or a.dtype == np.bool_:
        raise TypeError(f"{where} must be a float array, got dtype {a.dtype}")
    with np.errstate(over="ignore"):  # (checked below)
        w = np.ascontiguousarray(a, dtype=np.float32)
    if a.dtype.kind == "f" and a.dtype.itemsize > 4:
        inf = np.isinf(w)
        if inf.any():
            bad = (inf & np.isfinite(a)).reshape(-1)
            if bad.any():
                k = int(np.argmax(bad))
                at = f"position {k}" if a.ndim <= 1 else f"index {[int(i) for i in np.unravel_index(k, a.shape)]}"
                value = float(a.reshape(-1)[k])
                raise ValueError(f"{where}: value {value!r} at {at} is outside the float32 range "
                                 f"(it would become {'-' if value < 0 else ''}inf)")
    return w


as_weights = as_float32


# ------------------------------------------------------------------ batches
@dataclass
class Batch:
    """A lookup's input as the engine takes it, plus how to shape the output.

    ``kind`` is "ragged" (CSR), "dense" (a [batch, k] array; ``width`` = k) or
    "sparse" (COO; ``positions`` keeps each id's position in its bag)."""

    ids: np.ndarray
    offsets: np.ndarray
    weights: Optional[np.ndarray]
    kind: str
    width: int = 0
    positions: Optional[np.ndarray] = None  # sparse: position of each id in its bag
    indices: Optional[np.ndarray] = None  # sparse: the caller's coordinates (only for overlap checks)
    dense_positions: bool = False  # sparse: every bag's positions are 0, 1, 2, ... (the CSR batch says it all)
    order: Optional[np.ndarray] = None  # sparse, reordered row-major: ids[i] is the caller's values[order[i]]

    @property
    def num_bags(self) -> int:
        return len(self.offsets) - 1

    def owned(self) -> "Batch":
        """The batch with its own copies of the arrays (which may view the
        caller's): what a later ``apply_gradients`` reads cannot change."""
        copy = lambda a: None if a is None else a.copy()  # noqa: E731
        return Batch(copy(self.ids), copy(self.offsets), copy(self.weights), self.kind, self.width,
                     copy(self.positions), dense_positions=self.dense_positions, order=self.order)


_ID_POSITION = re.compile(r"(at position )(\d+)( of ids\b)")


def in_callers_terms(e: Exception, batch: Optional[Batch] = None, where: Optional[str] = None) -> Exception:
    """The engine's IndexError / ValueError `e` about a batch in the caller's
    terms: the position of a bad id in the caller's array (a Sparse batch
    not in row-major order is reordered before the engine sees it; a 2-D
    array's is its ``[row, column]``), and,
    with `where` (a feature), which input it was; `e` itself when nothing
    changes (subclasses such as CheckpointError are left as they are).
    Called from an ``except`` clause, so a call that succeeds pays nothing:
    ``raise in_callers_terms(e, batch) from None``."""
    if type(e) not in (IndexError, ValueError):
        return e
    message = str(e)
    m = _ID_POSITION.search(message) if batch is not None else None
    if m is not None:
        k = int(m.group(2))
        if batch.order is not None and k < len(batch.order):
            position = f"{m.group(1)}{int(batch.order[k])}"
        elif batch.kind == "dense" and batch.width and k < len(batch.ids):
            position = f"at index [{k // batch.width}, {k % batch.width}]"  # a 2-D array's element
        else:
            position = m.group(0)[: -len(m.group(3))]
        message = f"{message[:m.start()]}{position}{m.group(3)}{message[m.end():]}"
    if where is not None:
        message = f"{where}: {message}"
    return e if message == str(e) else type(e)(message)


def _dense_offsets(batch: int, k: int) -> np.ndarray:
    return np.arange(0, batch * k + 1, max(k, 1), dtype=np.int64)[: batch + 1] if k else np.zeros(batch + 1, np.int64)


def _sparse_parts(sp: Sparse, where: str):
    indices = as_int_array(sp.indices, f"{where}.indices")
    values = sp.values
    shape = as_int_array(sp.dense_shape, f"{where}.dense_shape")
    if indices.ndim != 2 or indices.shape[1] != 2:
        raise ValueError(f"{where}.indices must have shape [nnz, 2] (bag, position): Sparse input is rank 2, "
                         f"got {indices.shape} (reshape higher ranks to [bags, positions] first)")
    if shape.ndim != 1 or shape.shape[0] != indices.shape[1]:
        raise ValueError(f"{where}.dense_shape must have {indices.shape[1]} values, got shape {shape.shape}")
    if (shape < 0).any():
        raise ValueError(f"{where}.dense_shape must be non-negative, got {shape.tolist()}")
    return indices, values, shape


def _csr_of_coo(indices: np.ndarray, shape: np.ndarray, where: str):
    """(offsets, positions, row_major, dense_positions) of COO entries,
    checked against the dense shape in one native pass."""
    offsets, positions, bad, row_major, dense, entry = _embedcore.csr_from_coo(np.ascontiguousarray(indices),
                                                                               int(shape[0]), int(shape[1]))
    if bad >= 0:  # (the entry as the check read it: the caller's array may be changing)
        raise ValueError(f"{where}.indices[{bad}] = {list(entry)} is outside dense_shape {shape.tolist()}")
    return offsets, positions, row_major, dense


def make_batch(ids, offsets=None, weights=None, where: str = "ids") -> Batch:
    """Normalises every input form to a CSR `Batch`; validates shapes and dtypes."""
    wname = "weights" if where == "ids" else f"weights of {where}"
    for form in (Ragged, Sparse):
        if isinstance(weights, form) and not isinstance(ids, form):
            raise TypeError(f"{wname} is {form.__name__} but {where} is {type(ids).__name__}: "
                            f"give the weights in the form of the ids")
    if isinstance(ids, Ragged):
        return _ragged_batch(ids, offsets, weights, where, wname)
    if isinstance(ids, Sparse):
        return _sparse_batch(ids, offsets, weights, where, wname)
    a = as_int_array(ids, where, IndexError)
    if a.ndim == 0:
        raise ValueError(f"{where} must be 1-D (with offsets) or 2-D (one bag per row), got a scalar")
    if a.ndim == 2:
        return _dense_batch(a, offsets, weights, where, wname)
    if a.ndim != 1:
        raise ValueError(f"{where} must be 1-D (with offsets) or 2-D (one bag per row), got shape {a.shape}")
    return _csr_batch(a, offsets, weights, where, wname)


def _weights_like(weights, shape: tuple, wname: str, like: str) -> Optional[np.ndarray]:
    """The float32 weights (None when not given), one per id: of the ids'
    `shape` (`like` names the ids in the error)."""
    if weights is None:
        return None
    w = as_weights(weights, wname)
    if w.shape != shape:
        raise ValueError(f"{wname} must have shape {shape} like {like}, got {w.shape}")
    return w


def _ragged_batch(ids: Ragged, offsets, weights, where: str, wname: str) -> Batch:
    if offsets is not None:
        raise ValueError(f"{where} is Ragged: pass its offsets inside it, not as offsets=")
    values = as_int_array(ids.values, f"{where}.values", IndexError)
    if values.ndim != 1:
        raise ValueError(f"{where}.values must be 1-D, got shape {values.shape}")
    offs = as_offsets(ids.offsets, f"{where}.offsets")
    if isinstance(weights, Ragged):
        woffs = as_offsets(weights.offsets, f"{wname}.offsets")
        if not np.array_equal(woffs, offs):
            raise ValueError(f"{wname} must have the same offsets as {where}")
        weights = weights.values
    return Batch(values, offs, _weights_like(weights, values.shape, wname, where), "ragged")


def _sparse_batch(ids: Sparse, offsets, weights, where: str, wname: str) -> Batch:
    if offsets is not None:
        raise ValueError(f"{where} is Sparse: offsets= does not apply")
    indices, values, shape = _sparse_parts(ids, where)
    values = as_int_array(values, f"{where}.values", IndexError)
    if values.ndim != 1 or values.shape[0] != indices.shape[0]:
        raise ValueError(f"{where}.values must be 1-D with one id per index row, got shape {values.shape}")
    if isinstance(weights, Sparse):
        windices = as_int_array(weights.indices, f"{wname}.indices")
        if not np.array_equal(windices, indices):
            raise ValueError(f"{wname} must have the same indices as {where}")
        wshape = as_int_array(weights.dense_shape, f"{wname}.dense_shape")
        if not np.array_equal(wshape, shape):
            raise ValueError(f"{wname}.dense_shape {wshape.tolist()} differs from {where}.dense_shape "
                             f"{shape.tolist()}")
        weights = weights.values
    w = _weights_like(weights, values.shape, wname, f"{where}.values")
    # Bags are rows; within a row, ids keep the order of their positions.
    given = indices
    offs, positions, row_major, dense = _csr_of_coo(indices, shape, where)
    order = None
    if not row_major:  # a stable sort by (bag, position): a counting pass by bag, then each bag's positions
        order, positions, dense = _embedcore.coo_row_major_order(np.ascontiguousarray(indices), int(shape[0]),
                                                                 int(shape[1]), offs)
        values = values[order]
        w = None if w is None else w[order]
    return Batch(np.ascontiguousarray(values), offs, w, "sparse", width=int(shape[1]), positions=positions,
                 indices=given, dense_positions=dense, order=order)


def _dense_batch(a: np.ndarray, offsets, weights, where: str, wname: str) -> Batch:
    """A 2-D ``[batch, k]`` id array: one bag per row."""
    if offsets is not None:
        raise ValueError(f"{where} is 2-D (one bag per row): offsets= does not apply")
    batch, k = a.shape
    w = _weights_like(weights, a.shape, wname, where)
    return Batch(a.reshape(-1), _dense_offsets(batch, k), None if w is None else w.reshape(-1), "dense", width=k)


def _csr_batch(a: np.ndarray, offsets, weights, where: str, wname: str) -> Batch:
    """A 1-D id array with CSR offsets, or without (one id per bag)."""
    if offsets is None:
        offs = np.arange(a.shape[0] + 1, dtype=np.int64)  # one id per bag
    else:
        offs = as_offsets(offsets, "offsets")
    return Batch(a, offs, _weights_like(weights, a.shape, wname, where), "ragged")
