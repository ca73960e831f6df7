"""SavedModel export: the lookup lowered to TensorFlow's own ops.

While ``tf.saved_model.save`` traces a model's functions (TensorFlow's
"save context"), the adapter's lookups do not call the engine: they become
TensorFlow's serving lookup (``serving_embedding_lookup``, the code of
``TPUEmbeddingForServing``) over ``tf.Variable`` copies of the tables,
which are saved with the model. The SavedModel then needs nothing but
TensorFlow: it loads in a process that never imports embedcore, in
TensorFlow Serving, or from C++, and gives TensorFlow's outputs, which the
adapter matches (``sum`` bit for bit).

Why not the adapter's own kernel (``_native.py``), which lookups run in
``tf.function``: a compiled op is tied to the ABI of one TensorFlow build
(the C++ API is not stable), must be shipped and loaded
(``tf.load_op_library``) wherever the model is served, and TensorFlow
Serving would need a custom build. Lowering costs a copy of the tables at
export and TensorFlow's speed in the exported model, but it is exactly
TensorFlow's behaviour and runs everywhere TensorFlow does.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Dict

import numpy as np
import tensorflow as tf
from tensorflow.python.ops import resource_variable_ops
from tensorflow.python.saved_model import save_context
from tensorflow.python.tpu.tpu_embedding_for_serving import cpu_embedding_lookup

from ._lookup import flatten_inputs

__all__ = ["in_export", "export_mode", "ExportState", "variables", "lookup"]


_mode = threading.local()


class _ModeToken:
    """An ``export_mode()`` block, active until it exits."""

    def __init__(self):
        self.active = True


def in_export() -> bool:
    """True while ``tf.saved_model.save`` traces functions, or inside
    ``export_mode()``."""
    return save_context.in_save_context() or getattr(_mode, "depth", 0) > 0


@contextlib.contextmanager
def export_mode():
    """Lookups traced inside this block are lowered to TensorFlow's ops, as
    during ``tf.saved_model.save``. For exporters that trace their functions
    before saving them, such as Keras' ``model.export(path)`` /
    ``ExportArchive``::

        with embedcore.adapters.tf.export_mode():
            model.export(path)
    """
    token = _ModeToken()
    _mode.depth = getattr(_mode, "depth", 0) + 1
    _mode.tokens = getattr(_mode, "tokens", []) + [token]
    try:
        yield
    finally:
        token.active = False
        _mode.tokens = _mode.tokens[:-1]
        _mode.depth -= 1


class ExportState:
    """The ``tf.Variable`` copies of an object's tables for an export. They
    are made when the export first needs them and refreshed from the engine
    (assigned, the same variables) each time the exporter lists the object's
    children (once per save), the first time each ``export_mode()`` block
    uses them, and whenever a lookup has run the engine since the last copy
    (``clear()`` marks them stale).

    Once a ``tf.saved_model.save`` has used them they are kept: TensorFlow
    keeps the functions it traced for a save (they capture the copies) and
    uses them again in the next save of the same object, which would fail on
    deleted variables, or (on another thread, during a save) on variables
    the SavedModel does not track. Copies used only inside ``export_mode()``
    are dropped at the next lookup that runs the engine after every such
    block has exited. ``lock`` serializes making, refreshing and dropping
    them."""

    def __init__(self):
        self.vars: Dict[str, tf.Variable] = {}
        self.kept = False  # a tf.saved_model.save used the copies
        self.stale = False  # the engine may have changed since the copies were made or refreshed
        self.modes = []  # the export_mode() blocks that used them (pruned of exited ones by clear())
        self.lock = threading.RLock()

    def hold(self) -> bool:
        """Records that the current export uses the copies; True when an
        ``export_mode()`` block uses them for the first time."""
        if save_context.in_save_context():
            self.kept = True
        token = (getattr(_mode, "tokens", None) or [None])[-1]
        if token is not None and all(t is not token for t in self.modes):
            self.modes.append(token)
            return True
        return False

    def clear(self) -> None:
        """Called by each lookup that runs the engine (and each update of a
        table through its handle): drops the copies when no save keeps them
        and no ``export_mode()`` block that used them is still open;
        otherwise marks them stale, to be refreshed at their next use."""
        if not self.vars or (self.kept and self.stale and not self.modes):
            return  # nothing to drop, prune or mark (the common case while serving after a save)
        with self.lock:
            self.modes = [t for t in self.modes if t.active]
            if not self.kept and not self.modes:
                self.vars = {}
                self.stale = False
            else:
                self.stale = True


def variables(owner, refresh: bool = False) -> Dict[str, tf.Variable]:
    """The tables of `owner` as variables. Variables made earlier are
    refreshed with the tables' current values (assigned: the same variables,
    which functions traced earlier capture) when `refresh`, when the engine
    may have changed since (a lookup ran it), or at the first use in an
    ``export_mode()`` block."""
    state: ExportState = owner._export
    tables = owner._embedcore_tables()
    with state.lock, tf.init_scope():
        new_block = state.hold()
        if not state.vars:
            # Made while a tf.function is traced for the save; constructing the ResourceVariable class itself
            # (not tf.Variable) skips the function's variable-creator scope, which refuses new variables after
            # its first trace. The SavedModel tracks them as children of `owner`.
            state.vars = {t.name: resource_variable_ops.ResourceVariable(t.values(), trainable=False, name=t.name)
                          for t in tables}
        elif refresh or new_block or state.stale:
            for t in tables:
                state.vars[t.name].assign(t.values())
        state.stale = False
        return dict(state.vars)


class _TableShim:
    """What ``cpu_embedding_lookup`` reads of a TableConfig."""

    def __init__(self, spec):
        self.name, self.dim, self.combiner, self.vocabulary_size = spec.name, spec.dim, spec.combiner, spec.rows


class _FeatureShim:
    """What ``cpu_embedding_lookup`` reads of a FeatureConfig."""

    def __init__(self, f, table):
        self.table = table
        self.max_sequence_length = f.max_sequence_length
        self.validate_weights_and_indices = f.validate
        self.output_shape = tf.TensorShape(None if f.output_shape is None else list(f.output_shape))
        self.name = f.name


@tf.autograph.experimental.do_not_convert  # plain TensorFlow ops: AutoGraph has nothing to convert here
def lookup(owner, features, weights):
    """The lookup as TensorFlow ops on the export variables."""
    tables = variables(owner)
    shims = {}
    by_name = {}
    for path, f in owner._features.items():
        if f.table.name not in by_name:
            by_name[f.table.name] = _TableShim(f.table)
        shims[path] = _FeatureShim(f, by_name[f.table.name])
    flat_inputs, flat_weights = flatten_inputs(features, weights, shims.keys())
    outputs = []
    for (path, inp), w in zip(flat_inputs, flat_weights):
        shim = shims[path]
        var = tables[shim.table.name]
        if isinstance(inp, tf.RaggedTensor) and shim.output_shape.rank is not None and inp.shape.rank == 2:
            outputs.append(_ragged_with_output_shape(var, inp, w, shim))
        else:
            # (keyed by the feature's path, which TensorFlow's errors name: it named "" for a bare tensor)
            outputs.append(cpu_embedding_lookup({path: inp}, {path: w}, {shim.table: var}, {path: shim})[path])
    return tf.nest.pack_sequence_as(features, outputs)


def _ragged_pooled(var, inp, w, combiner):
    # TensorFlow's _ragged_embedding_lookup_with_reduce, op for op, but for the denominator of a bag without
    # weights: its count (float(n), sqrt(n)), as the engine divides (ops::BagDenominator); TensorFlow's float32
    # sum of ones is the same number below 2**24 ids and stops growing there.
    unweighted = w is None
    if unweighted:
        w = tf.ones_like(inp, dtype=tf.float32)
    w = tf.expand_dims(w, axis=2)
    out = tf.reduce_sum(tf.nn.embedding_lookup(var, inp) * w, axis=1)
    if combiner not in ("mean", "sqrtn"):
        return out
    if unweighted:
        n = tf.expand_dims(tf.cast(inp.row_lengths(), tf.float64), 1)
        return tf.math.divide_no_nan(out, tf.cast(n if combiner == "mean" else tf.sqrt(n), tf.float32))
    if combiner == "mean":
        return tf.math.divide_no_nan(out, tf.reduce_sum(w, axis=1))
    return tf.math.divide_no_nan(out, tf.sqrt(tf.reduce_sum(w * w, axis=1)))


def _ragged_with_output_shape(var, inp, w, shim):
    """TensorFlow's ragged lookup with ``output_shape`` (which, in TensorFlow
    2.21, works eagerly only: it branches in Python on a tensor), with the
    branch taken on the batch size at run time when it is not static."""
    shape = list(shim.output_shape.as_list())
    if None in shape:  # as TensorFlow's own lookup (and the adapter's) refuses it
        raise ValueError(f"Cannot convert a partially known TensorShape {tuple(shape)} to a Tensor.")
    wanted = int(np.prod(shape)) if shape else 1
    dim = shim.table.dim
    final = shape + [dim]

    def pooled():
        return tf.reshape(_ragged_pooled(var, inp, w, shim.table.combiner), final)

    def sequence(batch):
        rows = tf.nn.embedding_lookup(var, inp).to_tensor(shape=[batch, wanted // batch, dim])
        return tf.reshape(rows, final)

    batch = inp.shape[0]
    if batch is not None:
        if wanted == batch:
            return pooled()
        if batch and wanted > batch and wanted % batch == 0:
            return sequence(batch)
        raise ValueError("Output shape set in the FeatureConfig should be the factor of the input data batch size. "
                         f"But instead got output shape {tuple(shape)}, input data batch size {batch}")
    n = tf.cast(inp.nrows(), tf.int64)
    w64 = tf.constant(wanted, tf.int64)
    ok = tf.logical_or(tf.equal(n, w64),
                       tf.logical_and(tf.greater(n, 0),
                                      tf.logical_and(tf.less(n, w64), tf.equal(tf.math.floormod(w64, n), 0))))
    check = tf.debugging.Assert(ok, ["Output shape set in the FeatureConfig should be the factor of the input data "
                                     "batch size; output shape", shape, "batch size", n])
    with tf.control_dependencies([check]):
        return tf.cond(tf.equal(n, w64), pooled,
                       lambda: tf.reshape(tf.nn.embedding_lookup(var, inp).to_tensor(
                           shape=tf.stack([n, w64 // tf.maximum(n, 1), tf.constant(dim, tf.int64)])), final))
