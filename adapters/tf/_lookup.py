"""TensorFlow's CPU serving lookup (``TPUEmbeddingForServing.embedding_lookup``,
``tf.tpu.experimental.embedding.serving_embedding_lookup``) over engine tables.

Each feature is looked up by one engine call (or a few, see
``_pooling.py``), run eagerly on NumPy views of the input tensors, or inside
a graph through ``tf.numpy_function`` (unweighted rank-2 SparseTensor and
pooled RaggedTensor input first through the adapter's own kernels,
``_native.py``, which hand what they cannot take to that path). ``numpy_function`` rather than
``py_function``: its callback gets NumPy views of the input buffers and
returns arrays, with no eager-tensor round trip, which is all the engine
needs (CPU tensors; the gradient is given by ``tf.custom_gradient``, so the
op needs none). A ``ValueError`` raised in the callback reaches the caller as
``InvalidArgumentError``, as TensorFlow's own kernels report bad ids, and a
``MemoryError`` as ``ResourceExhaustedError``, as they report running out of
memory; eagerly we raise these ``tf.errors`` ourselves.

The checks done while tracing (structure, types, weights) are TensorFlow's,
in its order, with its exception types and messages.
"""
from __future__ import annotations

import weakref
from typing import Dict, Optional, Sequence

import numpy as np
import tensorflow as tf
from tensorflow.python.eager import record  # should_record_backprop: whether a tape watches a tensor
from tensorflow.python.util import nest  # flatten_with_joined_string_paths: the paths TensorFlow matches features by
from absl import logging

from embedcore import Sparse, _embedcore
from embedcore.table import _COMBINER_CODE  # the engine's Combiner codes, for the kernels

from . import _native
from ._config import Feature
from ._pooling import EIGEN4, GROUPED8, SEQUENTIAL, InvalidArgument, bad_id_error, engine_lookup, pooled

__all__ = ["lookup", "Backward"]

_INT_IDS = (tf.int32, tf.int64)


class Backward:
    """What the gradient of one feature's output needs: the CSR batch that
    was pooled (``ids``, ``offsets``, ``weights``), and for each of its bags
    the row of the flattened output gradient ``[-1, dim]`` that is its
    gradient (gathered and sequence outputs become bags of one id);
    ``positions``: each pooled id's position among the caller's weights
    (None: the same positions), for the weights' gradient."""

    __slots__ = ("ids", "offsets", "weights", "rows", "positions")

    def __init__(self, ids, offsets, weights, rows, positions=None):
        self.ids, self.offsets, self.weights, self.rows = ids, offsets, weights, rows
        self.positions = positions


def weights_gradient(table, combiner: str, order: str, bwd: Backward, dy: np.ndarray, n: int) -> np.ndarray:
    """The gradient of the pooled output with respect to the caller's `n`
    per-id weights, from the output's gradient `dy` ``[-1, dim]``, as
    TensorFlow's ops differentiate ``segment_sum(w * rows)`` (sum), divided
    by ``segment_sum(w)`` (mean) or ``sqrt(segment_sum(w * w))`` (sqrtn):
    ``row . g`` for sum, ``(row . g - out . g * s) / D`` otherwise (``s``: 1
    for mean, ``w / D`` for sqrtn; 0 where ``D`` is 0, as ``div_no_nan``).
    Pruned ids' weights (TensorFlow's safe lookup drops them) get 0."""
    ids, offsets, w = bwd.ids, bwd.offsets, bwd.weights
    out = np.zeros(n, np.float32)
    if not ids.size or w is None:  # (None: a sequence, which ignores the weights)
        return out
    bag = np.repeat(np.arange(offsets.size - 1, dtype=np.int64), np.diff(offsets))
    g = dy[bwd.rows[bag]]
    dots = np.einsum("ij,ij->i", engine_lookup(table, ids, None, None, None), g)
    if combiner != "sum":
        pooled_out = pooled(table, ids, offsets, w, combiner, order)
        total = np.bincount(bag, w if combiner == "mean" else w * w, offsets.size - 1).astype(np.float32)
        den = (total if combiner == "mean" else np.sqrt(total))[bag]
        scale = np.float32(1) if combiner == "mean" else np.divide(w, den, out=np.zeros_like(w), where=den != 0)
        dots = np.divide(dots - np.einsum("ij,ij->i", pooled_out[bag], g) * scale, den, out=np.zeros_like(dots),
                         where=den != 0)
    np.add.at(out, bwd.positions if bwd.positions is not None else np.arange(ids.size), dots)
    return out


def _bags_of_one(ids: np.ndarray, rows: np.ndarray) -> Backward:
    return Backward(ids, np.arange(ids.size + 1, dtype=np.int64), None, rows)


# ------------------------------------------------------------------ NumPy side, one function per input form
def dense_numpy(table, ids: np.ndarray, need_bwd: bool):
    flat = np.ascontiguousarray(ids.reshape(-1))
    out = engine_lookup(table, flat, None, None, None, shape=ids.shape).reshape(ids.shape + (table.dim,))
    return out, (_bags_of_one(flat, np.arange(flat.size, dtype=np.int64)) if need_bwd else None)


def sparse_numpy(f: Feature, table, indices, ids, dense_shape, weights, safe: bool, sequence: bool, need_bwd: bool):
    dim = table.dim
    positions = None  # each pooled id's position among the weights, where that changes
    if weights is not None and weights.shape[0] != ids.shape[0]:
        if weights.shape[0] == 1 and not safe and not sequence and f.table.combiner == "sum" and dense_shape.size == 2:
            # Rank 2, fast path: embedding_lookup_sparse multiplies the gathered rows by the weights' values,
            # broadcasting one value over them all (a count TensorFlow checks only where the shapes are known
            # when tracing). Rank > 2 gathers the weights by position first, and fails as below.
            weights = np.broadcast_to(weights, ids.shape)
            positions = np.zeros(ids.shape, np.int64)  # (one weight for every id)
        else:
            raise InvalidArgument(f"feature {f.label}: weights have {weights.shape[0]} values, ids {ids.shape[0]}")
    if sequence:
        # sparse_slice to [batch, L], then scatter_nd: duplicate positions add up, from zero in input order,
        # as the engine's Sparse sequence lookup adds them (one native call).
        length = f.max_sequence_length
        row, col, ids, batch = _sequence_positions(indices, ids, dense_shape, length)
        ids = np.ascontiguousarray(ids)
        try:
            out = table.lookup(Sparse(np.stack([row, col], 1), ids, np.array([batch, length], np.int64)),
                               combiner=None, max_sequence_length=length)
        except IndexError as e:
            raise bad_id_error(table, ids, None, str(e)) from None
        return out, (_bags_of_one(ids, row * length + col) if need_bwd else None)

    offsets = _clean_rank2_offsets(indices, ids, dense_shape) if safe and weights is None else None
    if offsets is not None:  # nothing to prune, reorder or refuse: the engine's one pass gave the bags
        rows = None
        out_shape = (int(dense_shape[0]), dim)
    elif safe:
        # safe_embedding_lookup_sparse: rows are the leading dims flattened; ids < 0 pruned, and weights <= 0
        # for mean and sqrtn; bags left empty give zeros.
        rows = _reshaped_rows(indices, dense_shape)
        nbags = int(np.prod(dense_shape[:-1], dtype=np.int64))
        if ids.size != rows.size:  # sparse_retain gathers the indices at the kept values' positions
            extra = np.flatnonzero(ids[rows.size:] >= 0)
            if extra.size:
                k = int(np.count_nonzero(ids[:rows.size] >= 0))
                raise InvalidArgument(f"indices[{k}] = {rows.size + int(extra[0])} is not in [0, {rows.size})")
            n = min(ids.size, rows.size)
            rows, ids, weights = rows[:n], ids[:n], None if weights is None else weights[:n]
        if weights is not None and positions is None:
            positions = np.arange(ids.size, dtype=np.int64)
        valid = ids >= 0
        if weights is not None and f.table.combiner != "sum":
            valid &= weights > 0
        if not valid.all():
            rows, ids = rows[valid], ids[valid]
            if weights is not None:
                weights, positions = weights[valid], positions[valid]
        bad = (rows < 0) | (rows >= nbags)  # sparse_fill_empty_rows, before any id is looked up
        if bad.any():
            k = int(np.argmax(bad))
            raise InvalidArgument(f"indices({k}, 0) is invalid: {int(rows[k])} >= {nbags}")
        if rows.size > 1 and (np.diff(rows) < 0).any():  # sparse_fill_empty_rows groups by row, stably
            order = np.argsort(rows, kind="stable")
            rows, ids = rows[order], ids[order]
            if weights is not None:
                weights, positions = weights[order], positions[order]
        out_shape = tuple(int(d) for d in dense_shape[:-1]) + (dim,)
    else:
        # embedding_lookup_sparse: the first index is the bag; bags after the last non-empty one are dropped.
        if indices.ndim != 2 or indices.shape[1] == 0:  # indices[:, 0]
            raise InvalidArgument(f"Index out of range using input dim 1; input has only {indices.ndim} dims"
                                  if indices.ndim < 2 else "slice index 0 of dimension 1 out of bounds.")
        try:
            rows = _segment_ids(indices[:, 0], ids, weights is not None)
        except InvalidArgument:
            if ((ids < 0) | (ids >= table.rows)).any():  # TensorFlow gathers the ids first
                raise bad_id_error(table, ids) from None
            raise
        nbags = int(rows[-1]) + 1 if rows.size else 0
        out_shape = (nbags, dim)
    if offsets is None:
        offsets = np.zeros(nbags + 1, np.int64)
        if rows.size:
            np.cumsum(np.bincount(rows, minlength=nbags), out=offsets[1:])
    nbags = offsets.shape[0] - 1
    ids = np.ascontiguousarray(ids)
    weights = None if weights is None else np.ascontiguousarray(weights, dtype=np.float32)
    out = pooled(table, ids, offsets, weights, f.table.combiner, GROUPED8 if weights is None else EIGEN4)
    bwd = Backward(ids, offsets, weights, np.arange(nbags, dtype=np.int64), positions) if need_bwd else None
    return out.reshape(out_shape), bwd


def _clean_rank2_offsets(indices, ids, dense_shape) -> Optional[np.ndarray]:
    """The CSR offsets of the common safe-path input, or None: rank 2, one
    index per id, no negative id (nothing pruned), every index inside
    [0, bags) x [0, 2^62) and in row-major order (nothing reordered or
    refused). One native pass (``csr_from_coo``) instead of the general
    path's NumPy passes, which handle (and word the errors of) the rest."""
    if (indices.ndim != 2 or indices.shape[1] != 2 or dense_shape.shape != (2,) or ids.ndim != 1
            or indices.shape[0] != ids.shape[0] or indices.dtype != np.int64 or dense_shape[0] < 0):
        return None
    _check_dense_shape(dense_shape)  # as the general path checks it first
    if ids.size and int(ids.min()) < 0:
        return None
    offsets, _, first_bad, row_major, _, _ = _embedcore.csr_from_coo(np.ascontiguousarray(indices),
                                                                     int(dense_shape[0]), 1 << 62)
    return offsets if first_bad < 0 and row_major else None


# TensorFlow's checks of a SparseTensor's indices, in its order and with its messages, done before anything is
# allocated by the size an index gives.
def _sequence_positions(indices, ids, dense_shape, length: int):
    """``sparse_slice(sp, [0, 0], [batch, length])``: the kept entries'
    rows and columns in the output, their ids, and the batch size. TensorFlow takes the batch size from ``tf.shape(sp)``, an
    int32: ``dense_shape[0]`` wrapped to 32 bits (2**32 + 2 gives 2, 2**31
    an error)."""
    if indices.ndim != 2:
        raise InvalidArgument(f"Sparse indices must be rank 2 but is rank {indices.ndim}")
    nnz, rank = indices.shape
    if ids.size != nnz:
        raise InvalidArgument(f"Number of elements in indices ({nnz}) and values ({ids.size}) do not match")
    if dense_shape.size != rank:
        raise InvalidArgument(f"Index rank ({rank}) and shape rank ({dense_shape.size}) do not match")
    if rank != 2:
        raise InvalidArgument(f"Expected start to be a vector of length {rank} but got length 2")
    _check_dense_shape(dense_shape)
    batch = int(np.int64(dense_shape[0]).astype(np.int32))
    if batch < 0:
        raise InvalidArgument(f"Expected a non-negative size, got {batch}")
    row, col = indices[:, 0], indices[:, 1]
    keep = (row >= 0) & (row < batch) & (col >= 0) & (col < length)
    if not keep.all():
        row, col, ids = row[keep], col[keep], ids[keep]
    return row, col, ids, batch


def _check_dense_shape(dense_shape) -> None:
    """TensorFlow's ``TensorShape::BuildTensorShape`` of a SparseTensor's
    dense shape (``sparse_reshape`` and ``sparse_slice`` build one first):
    every dimension >= 0 and their product, taken in order, an int64."""
    n = 1
    for d in (int(x) for x in dense_shape):
        if d < 0:
            raise InvalidArgument(f"Expected shape dimensions to be non-negative, got {d}")
        p = n * d  # MultiplyWithoutOverflow: -1 past 2**64, else the product as int64
        r = -1 if p >= 1 << 64 else (p - (1 << 64) if p >= 1 << 63 else p)
        if r < 0:
            raise InvalidArgument(f"Encountered overflow when multiplying {n} with {d}, result: {r}")
        n = r


def _reshaped_rows(indices, dense_shape) -> np.ndarray:
    """Each entry's row after ``sparse_reshape`` to ``[prod(dense_shape[:-1]),
    dense_shape[-1]]`` (the identity for rank 2): the row-major offset
    divided by the last dimension, rounded toward zero, as in C++."""
    if indices.ndim != 2:
        raise InvalidArgument("Input must be a matrix.")
    nnz, rank = indices.shape
    if rank != dense_shape.size:
        raise InvalidArgument("Input tensor rank must match input shape length.")
    _check_dense_shape(dense_shape)
    if rank == 2:
        return indices[:, 0]
    last = int(dense_shape[-1])
    lead = int(np.prod(dense_shape[:-1], dtype=np.int64))
    if nnz and lead * last == 0:
        raise InvalidArgument(f"Input tensor has {nnz} non zero elements but input shape "
                              f"([{','.join(str(int(d)) for d in dense_shape)}]) or output shape ([{lead},{last}]) "
                              "is empty")
    strides = np.append(np.cumprod(dense_shape[:0:-1])[::-1], 1).astype(np.int64)
    offset = (indices * strides).sum(axis=1)
    rows = offset // last
    rows[(rows < 0) & (rows * last != offset)] += 1
    return rows


_INT32_MAX = 2**31 - 1


def _segment_ids(rows, ids, weighted: bool) -> np.ndarray:
    """The segment ids of ``embedding_lookup_sparse`` (the first index),
    checked as ``sparse_segment_sum`` does, or as ``segment_sum`` (weighted)
    does, which takes them as int32."""
    if rows.size != ids.size:
        raise InvalidArgument("segment_ids should be the same size as dimension 0 of input." if weighted else
                              "segment_ids and indices should have same size.")
    if weighted:
        rows = rows.astype(np.int32).astype(np.int64)
    if not rows.size:
        return rows
    last = int(rows[-1])
    if not weighted and last >= _INT32_MAX:
        raise InvalidArgument(f"Last segment id must be < kintmax, got {last} limit {_INT32_MAX}")
    if last < 0:
        raise InvalidArgument("segment ids must be >= 0")
    # Segment by segment: the next segment's id must be larger, then this one's must be >= 0.
    dec = np.flatnonzero(rows[1:] < rows[:-1])
    neg = np.flatnonzero(rows < 0)
    if neg.size:
        n = int(neg[0])
        end = n + int(np.argmax(rows[n:] != rows[n]))  # the segment after it (the last id is >= 0)
        if not dec.size or dec[0] + 1 > end:
            raise InvalidArgument(f"Segment id {int(rows[n])} out of range [0, {last + 1}), possibly because "
                                  "'segment_ids' input is not sorted.")
    if dec.size:
        raise InvalidArgument("segment ids are not increasing")
    return rows


def ragged_numpy(f: Feature, table, values, splits, wvalues, wsplits, need_bwd: bool):
    dim = table.dim
    batch = splits.size - 1
    offsets = np.ascontiguousarray(splits, dtype=np.int64)
    ids = np.ascontiguousarray(values)
    length = 0
    reshape = None
    if f.output_shape is not None:
        wanted = int(np.prod(f.output_shape)) if f.output_shape else 1
        reshape = tuple(f.output_shape) + (dim,)
        if wanted == batch:
            length = 0
        elif batch and wanted > batch and wanted % batch == 0:
            length = wanted // batch  # a sequence: weights and combiner are ignored, as TensorFlow does
        elif batch == 0 and wanted > 0:
            raise InvalidArgument("Integer division by zero")  # TensorFlow's wanted % batch
        else:
            raise InvalidArgument(_output_shape_message(f, batch))
    elif f.max_sequence_length > 0:
        length = f.max_sequence_length
    if length:
        out = engine_lookup(table, ids, offsets, None, None, max_sequence_length=length)
        bwd = None
        if need_bwd:
            lengths = np.diff(offsets)
            bag = np.repeat(np.arange(batch, dtype=np.int64), lengths)
            j = np.arange(ids.size, dtype=np.int64) - offsets[:-1][bag]
            keep = j < length
            bwd = _bags_of_one(np.ascontiguousarray(ids[keep]), bag[keep] * length + j[keep])
    else:
        if wvalues is not None and (wsplits.shape != splits.shape or not np.array_equal(wsplits, splits)
                                    or wvalues.shape != values.shape):
            raise InvalidArgument(f"feature {f.label}: the weights' row partition differs from the ids' "
                                  "(Condition x == y did not hold)")
        w = None if wvalues is None else np.ascontiguousarray(wvalues, dtype=np.float32)
        out = pooled(table, ids, offsets, w, f.table.combiner, SEQUENTIAL)
        bwd = Backward(ids, offsets, w, np.arange(batch, dtype=np.int64)) if need_bwd else None
    return (out.reshape(reshape) if reshape is not None else out), bwd


def _output_shape_message(f: Feature, batch) -> str:
    return ("Output shape set in the FeatureConfig should be the factor of the input data batch size. But instead "
            f"got output shape {tuple(f.output_shape)}, input data batch size {batch}")


# ------------------------------------------------------------------ running a NumPy function eagerly or in a graph
_BWD_DTYPES = [tf.int64, tf.int64, tf.float32, tf.int64, tf.bool]


def _pack_bwd(bwd: Backward) -> list:
    has_w = bwd.weights is not None
    w = bwd.weights if has_w else np.zeros(0, np.float32)
    return [np.ascontiguousarray(bwd.ids, dtype=np.int64), bwd.offsets.astype(np.int64, copy=False), w,
            np.ascontiguousarray(bwd.rows, dtype=np.int64), np.array(has_w)]


def unpack_bwd(arrays) -> Backward:
    ids, offsets, w, rows, has_w = arrays
    return Backward(ids, offsets, w if bool(has_w) else None, rows)


def _call(fn, tensors: Sequence, need_bwd: bool, label: str):
    """Runs ``fn(*arrays) -> (out, Backward or None)`` on the tensors' values:
    eagerly, or as a ``tf.numpy_function`` in a graph. Returns the output
    tensor and, when `need_bwd`, the backward tensors."""
    if tf.executing_eagerly():
        arrays = [None if t is None else t.numpy() for t in tensors]
        try:
            out, bwd = fn(*arrays)
        except ValueError as e:  # InvalidArgument, or NumPy's: as tf.numpy_function reports them in a graph
            raise tf.errors.InvalidArgumentError(None, None, str(e)) from None
        except MemoryError as e:  # as tf.numpy_function reports it, and TensorFlow's kernels their OOM
            raise tf.errors.ResourceExhaustedError(None, None, f"{type(e).__name__}: {e}") from None
        out_t = tf.convert_to_tensor(out)
        if not need_bwd:
            return out_t, None
        return out_t, [tf.convert_to_tensor(a) for a in _pack_bwd(bwd)]

    present = [t for t in tensors if t is not None]
    where = [t is not None for t in tensors]

    def run(*arrays):
        it = iter(arrays)
        full = [next(it) if p else None for p in where]
        out, bwd = fn(*full)
        return [out] + (_pack_bwd(bwd) if need_bwd else [])

    dtypes = [tf.float32] + (_BWD_DTYPES if need_bwd else [])
    res = tf.numpy_function(run, present, dtypes, name=f"embedcore_lookup_{_op_name(label)}")
    return res[0], (res[1:] if need_bwd else None)


class TableRef:
    """A table as a graph's callback holds it: weakly. TensorFlow keeps the
    callable of every ``tf.numpy_function`` as long as the outermost graph,
    which for a ``tf.function`` (a Keras ``fit``) is the process's own: a
    callback holding its table would keep the table (values and slots)
    after the layer and model are gone. Called, the table; once it is
    gone, ``ValueError`` (the graph's ``InvalidArgumentError``), as the
    native kernels' handle does (``_native.handle_of``)."""

    __slots__ = ("_ref", "_name")

    def __init__(self, table):
        self._ref = weakref.ref(table)
        self._name = table.name

    def __call__(self):
        table = self._ref()
        if table is None:
            raise ValueError(f"table '{self._name}' no longer exists (its layer or model was deleted): a graph that "
                             "looks it up cannot run")
        return table


def _op_name(label: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in label)[:64] or "feature"


class WeightsGradient:
    """How to differentiate one pooled output with respect to its per-id
    weights' values `w` (a tensor): ``gradient(dy)`` runs ``grad_fn(*arrays
    of tensors, w, dy) -> dL/dw`` (NumPy, eagerly or as a
    ``tf.numpy_function``), `dy` the output's gradient. `output`: the
    output's position among the lookup's flattened outputs."""

    __slots__ = ("output", "w", "tensors", "grad_fn", "dim", "label")

    def __init__(self, w, tensors, grad_fn, dim: int, label: str):
        self.output = -1
        self.w, self.tensors, self.grad_fn, self.dim, self.label = w, list(tensors), grad_fn, dim, label

    def gradient(self, dy: tf.Tensor, w: Optional[tf.Tensor] = None) -> tf.Tensor:
        w = self.w if w is None else w
        dy = tf.reshape(tf.cast(dy, tf.float32), [-1, self.dim])
        if tf.executing_eagerly():
            g = tf.convert_to_tensor(self.grad_fn(*(t.numpy() for t in self.tensors), w.numpy(), dy.numpy()))
        else:
            g = tf.numpy_function(self.grad_fn, [*self.tensors, w, dy], tf.float32,
                                  name=f"embedcore_weights_grad_{_op_name(self.label)}")
        return tf.cast(tf.reshape(g, tf.shape(w)), w.dtype)


def _with_weights_gradient(out: tf.Tensor, wg: WeightsGradient, trained: Optional[list]) -> tf.Tensor:
    """`out` with its gradient with respect to the weights, as TensorFlow's
    lookup has one; or, with `trained` (a training lookup, whose backward
    updates the tables), `wg` recorded there for that backward to run first,
    from the rows as this lookup read them. Only where a gradient tape
    watches the weights (a trainable weighting): weights that are data (a
    dataset's, the common case) cost nothing (their gradient would cost a
    second lookup of the bags every training step)."""
    if not record.should_record_backprop([wg.w]):
        return out
    if trained is not None:
        trained.append(wg)
        return out

    @tf.custom_gradient
    def attach(w):
        return tf.identity(out), lambda dy: wg.gradient(dy, w)

    return attach(wg.w)


# ------------------------------------------------------------------ TensorFlow side: TensorFlow's checks, then the call
def flatten_inputs(inputs, weights, keys):
    """The (path, input) pairs of `inputs` and their weights (None each when
    `weights` is None), with TensorFlow's checks: the same structure, and no
    path that is not a feature of `keys`."""
    flat_inputs = nest.flatten_with_joined_string_paths(inputs)
    flat_weights = [None] * len(flat_inputs)
    if weights is not None:
        tf.nest.assert_same_structure(inputs, weights)
        flat_weights = tf.nest.flatten(weights)
    input_keys = {key for key, _ in flat_inputs}
    if not input_keys.issubset(keys):
        raise ValueError("Inputs are not a subset of feature_config. Inputs keys are {}, but feature_config keys "
                         "are {}".format(input_keys, keys))
    return flat_inputs, flat_weights


@tf.autograph.experimental.do_not_convert  # plain TensorFlow ops: AutoGraph has nothing to convert here
def lookup(inputs, weights, features: Dict[str, Feature], tables: Dict[str, object], need_bwd: bool = False):
    """``cpu_embedding_lookup`` over engine tables. Returns the outputs in
    the structure of `inputs`, differentiable with respect to their per-id
    weights as TensorFlow's; when `need_bwd` (a training lookup), also a list
    of ``(feature, backward tensors)`` and one of ``WeightsGradient`` (the
    weighted outputs': the caller's backward runs them, before it updates
    the tables)."""
    flat_inputs, flat_weights = flatten_inputs(inputs, weights, features.keys())
    outputs = []
    backward = []
    trained = [] if need_bwd else None
    for (path, inp), weight in zip(flat_inputs, flat_weights):
        f = features[path]
        table = tables[f.table.name]
        if weight is not None:
            if isinstance(inp, tf.Tensor):
                raise ValueError("Weight specified for {}, but input is dense.".format(path))
            elif type(weight) is not type(inp):
                raise ValueError("Weight for {} is of type {} but it does not match type of the input which is "
                                 "{}.".format(path, type(weight), type(inp)))
            elif f.max_sequence_length > 0:
                raise ValueError("Weight specified for {}, but this is a sequence feature.".format(path))
        if isinstance(inp, tf.Tensor):
            if f.max_sequence_length > 0:
                raise ValueError("Feature {} is a sequence feature but a dense tensor was passed.".format(path))
            out, bwd = _dense(f, table, inp, need_bwd)
        elif isinstance(inp, tf.SparseTensor):
            out, bwd = _sparse(f, table, inp, weight, need_bwd, trained)
        elif isinstance(inp, tf.RaggedTensor):
            out, bwd = _ragged(f, table, inp, weight, need_bwd, trained)
        else:
            raise ValueError("Input {} is type {}. Tensor, SparseTensor or RaggedTensor expected.".format(
                path, type(inp)))
        if trained and trained[-1].output < 0:
            trained[-1].output = len(outputs)
        outputs.append(out)
        if need_bwd:
            backward.append((f, bwd))
    packed = tf.nest.pack_sequence_as(inputs, outputs)
    return (packed, backward, trained) if need_bwd else packed


def _check_int_ids(ids: tf.Tensor, where: str) -> None:
    if ids.dtype not in _INT_IDS:
        msg = f"Value for attr 'Tindices' of {ids.dtype.name} is not in the list of allowed values: int32, int64"
        if tf.executing_eagerly():
            raise tf.errors.InvalidArgumentError(None, None, msg)
        raise TypeError(msg)


def _dense(f: Feature, table, ids: tf.Tensor, need_bwd: bool):
    _check_int_ids(ids, f.label)
    ref = TableRef(table)
    out, bwd = _call(lambda a: dense_numpy(ref(), a, need_bwd), [ids], need_bwd, f.label)
    out.set_shape(ids.shape.concatenate([table.dim]))
    return out, bwd


def _sparse(f: Feature, table, sp: tf.SparseTensor, weights: Optional[tf.SparseTensor], need_bwd: bool,
            trained: Optional[list] = None):
    rank = sp.shape.rank
    sequence = f.output_shape is None and f.max_sequence_length > 0 and (rank is None or rank == 2)
    if not sequence and f.max_sequence_length > 0:
        logging.warning("max_sequence_length setting will be ignored because the rank of the input tensor is %d "
                        "which is not 2.", rank)
    safe = not (not f.validate and rank is not None and rank <= 2)
    if sequence and sp.values.dtype == tf.int16:  # TensorFlow gathers a sequence's rows, and tf.gather takes int16
        sp = tf.SparseTensor(sp.indices, tf.cast(sp.values, tf.int32), sp.dense_shape)
    elif safe and not sequence and sp.values.dtype in (tf.string, tf.bool) and tf.executing_eagerly():
        # TensorFlow's `ids >= 0`, eagerly
        raise TypeError(f"Cannot convert 0 to EagerTensor of dtype {sp.values.dtype.name}")
    _check_int_ids(sp.values, f.label)
    wvalues = None
    if weights is not None:
        # TensorFlow checks the shapes it knows while tracing (SparseTensor(ids.indices, weights.values, ...)).
        if not sequence:
            sp.values.shape.assert_is_compatible_with(weights.values.shape)
            if not safe:
                sp.indices.shape.assert_is_compatible_with(weights.indices.shape)
                sp.dense_shape.shape.assert_is_compatible_with(weights.dense_shape.shape)
            if safe and weights.values.dtype != tf.float32:
                raise ValueError(f"Incompatible type conversion requested to type {weights.values.dtype.name} for "
                                 f"the float32 table '{table.name}' (feature {f.label})")
        wvalues = weights.values if weights.values.dtype == tf.float32 else tf.cast(weights.values, tf.float32)

    ref = TableRef(table)

    def fn(indices, ids, dense_shape, w):
        return sparse_numpy(f, ref(), indices, ids, dense_shape, w, safe, sequence, need_bwd)

    op = None
    if safe and not sequence and rank == 2 and weights is None and not need_bwd and not tf.executing_eagerly():
        op = _native.sparse_lookup_op()
    if op is not None:
        # The kernel pools what needs nothing else; the rest takes the general path, as before.
        fast, ok = op(sp.indices, sp.values, sp.dense_shape, handle=_native.handle_of(table), dim=table.dim,
                      combiner=_COMBINER_CODE[f.table.combiner], name=f"embedcore_lookup_{_op_name(f.label)}")
        out = tf.cond(ok, lambda: fast,
                      lambda: _call(fn, [sp.indices, sp.values, sp.dense_shape, None], False, f.label)[0])
        out.set_shape([None, table.dim])
        return out, None
    out, bwd = _call(fn, [sp.indices, sp.values, sp.dense_shape, wvalues], need_bwd, f.label)
    if wvalues is not None and not sequence:
        def weights_grad(indices, ids, dense_shape, w, dy):
            _, b = sparse_numpy(f, ref(), indices, ids, dense_shape, w, safe, False, True)
            return weights_gradient(ref(), f.table.combiner, EIGEN4, b, dy, w.shape[0])

        out = _with_weights_gradient(out, WeightsGradient(wvalues, [sp.indices, sp.values, sp.dense_shape],
                                                          weights_grad, table.dim, f.label), trained)
    if sequence:
        out.set_shape([None, f.max_sequence_length, table.dim])
    elif not safe:
        out.set_shape([None, table.dim])
    elif rank is not None:  # TensorFlow knows the rank, not the sizes
        out.set_shape([None] * (rank - 1) + [table.dim])
    return out, bwd


def _ragged(f: Feature, table, rt: tf.RaggedTensor, weights: Optional[tf.RaggedTensor], need_bwd: bool,
            trained: Optional[list] = None):
    if rt.shape.rank != 2:
        raise ValueError("Only rank 2 ragged tensor is supported, but got rank {}".format(rt.shape.rank))
    if rt.values.dtype not in _INT_IDS:
        raise ValueError(f"The values contained by the inputs have type {rt.values.dtype!r} and cannot be processed. "
                         "All values should be indices, either of type `int32` or `int64`")
    batch = rt.shape[0]
    if f.output_shape is not None and None in f.output_shape:
        raise ValueError(f"Cannot convert a partially known TensorShape {tuple(f.output_shape)} to a Tensor.")
    pooled_out = f.output_shape is None and f.max_sequence_length == 0
    if f.output_shape is not None and batch is not None:
        wanted = int(np.prod(f.output_shape)) if f.output_shape else 1
        pooled_out = wanted == batch
        if not (pooled_out or (wanted > batch and batch and wanted % batch == 0) or batch == 0):
            raise ValueError(_output_shape_message(f, batch))  # (batch 0: wanted % 0 fails when run)
        if not pooled_out:
            weights = None  # a sequence (or an error): TensorFlow ignores the weights
    wvalues = wsplits = None
    if weights is not None:
        if weights.values.dtype != tf.float32 and (pooled_out or f.output_shape is not None):
            msg = (f"cannot compute Mul as input #1(zero-based) was expected to be a float tensor but is a "
                   f"{weights.values.dtype.name} tensor")
            if tf.executing_eagerly():
                raise tf.errors.InvalidArgumentError(None, None, msg)
            raise TypeError(msg)
        if weights.shape.rank != 2:  # TensorFlow's ids * weights fails its row-partition assertion when run
            raise tf.errors.InvalidArgumentError(None, None, f"feature {f.label}: weights of rank "
                                                 f"{weights.shape.rank} for ids of rank 2 (Condition x == y did "
                                                 "not hold)")
        wvalues, wsplits = weights.values, weights.row_splits
        if wsplits.dtype != rt.row_splits.dtype:
            if pooled_out:  # ids * weights
                raise ValueError("Input RaggedTensors have mismatched row_splits dtypes; use "
                                 "RaggedTensor.with_row_splits_dtype() to convert them to compatible dtypes.")
            wsplits = tf.cast(wsplits, rt.row_splits.dtype)

    ref = TableRef(table)

    def fn(values, splits, wv, ws):
        return ragged_numpy(f, ref(), values, splits, wv, ws, need_bwd)

    op = None
    if (f.output_shape is None and f.max_sequence_length == 0 and wvalues is None and not need_bwd
            and not tf.executing_eagerly()):
        op = _native.ragged_lookup_op()
    if op is not None:
        # The kernel pools a valid batch; anything the engine refuses takes the general path, as before.
        fast, ok = op(rt.values, rt.row_splits, handle=_native.handle_of(table), dim=table.dim,
                      combiner=_COMBINER_CODE[f.table.combiner], name=f"embedcore_lookup_{_op_name(f.label)}")
        out = tf.cond(ok, lambda: fast, lambda: _call(fn, [rt.values, rt.row_splits, None, None], False, f.label)[0])
        out.set_shape([batch, table.dim])
        return out, None
    out, bwd = _call(fn, [rt.values, rt.row_splits, wvalues, wsplits], need_bwd, f.label)
    if wvalues is not None:
        def weights_grad(values, splits, ws, w, dy):
            _, b = ragged_numpy(f, ref(), values, splits, w, ws, True)
            return weights_gradient(ref(), f.table.combiner, SEQUENTIAL, b, dy, w.shape[0])

        out = _with_weights_gradient(out, WeightsGradient(wvalues, [rt.values, rt.row_splits, wsplits],
                                                          weights_grad, table.dim, f.label), trained)
    if f.output_shape is not None:
        out.set_shape(list(f.output_shape) + [table.dim])
    elif f.max_sequence_length > 0:
        out.set_shape([batch, f.max_sequence_length, table.dim])
    else:
        out.set_shape([batch, table.dim])
    return out, bwd
