"""``Saver``: SOK's ``sok.Saver`` calls on the adapter's tables, writing
embedcore checkpoints; usable eagerly and inside ``tf.function``."""
from __future__ import annotations

import os
from typing import Callable, List, Sequence

import numpy as np
import tensorflow as tf

import embedcore as ec

__all__ = ["Saver"]


def _target(var):
    """What embedcore's Saver takes: a Table, or an object with tables."""
    table = getattr(var, "table", None)  # a TableHandle of embedding_tables
    if isinstance(table, ec.Table) and getattr(var, "slot", None) is None:
        return table
    if isinstance(var, (list, tuple)):
        return [_target(v) for v in var]  # tables and embedding_tables handles, in any mix
    return var


def _filepath(x):
    """`filepath` checked now: a string tensor as it is (read when the call
    runs), a ``str``, ``bytes`` or ``os.PathLike`` as a ``str``; anything
    else is a TypeError (``str()`` of it would name a directory)."""
    if isinstance(x, (tf.Tensor, tf.Variable)):
        if x.dtype != tf.string or x.shape.rank not in (None, 0):
            raise TypeError(f"filepath must be a string (a directory), got a {x.dtype.name} tensor of shape "
                            f"{x.shape}")
        return x
    if isinstance(x, np.ndarray) and x.ndim == 0 and x.dtype.kind in "SUO":
        x = x.item()
    if isinstance(x, (str, bytes, os.PathLike)):
        path = os.fspath(x)
        return path.decode() if isinstance(path, bytes) else path
    raise TypeError(f"filepath must be a string (a directory), got {type(x).__name__}: {x!r}")


def _text(x) -> str:
    """A path as the call runs: a ``str``, or a string tensor's bytes."""
    if isinstance(x, np.ndarray):
        x = x.item()
    return x.decode() if isinstance(x, bytes) else x


def _run(fn: Callable, tensors: Sequence, name: str) -> tf.Tensor:
    """Runs ``fn(*arrays)`` now (eagerly) or when the graph runs (a stateful
    ``tf.numpy_function``); returns a string tensor "OK". Eagerly its errors
    raise as they are; in a graph every error (an OSError too) raises as
    ``InvalidArgumentError``."""
    if tf.executing_eagerly():
        fn(*[t.numpy() if hasattr(t, "numpy") else t for t in tensors])
        return tf.constant("OK")

    def run(*arrays):
        try:
            fn(*arrays)
        except OSError as e:
            # TensorFlow turns a callback's ValueError into InvalidArgumentError (as for every other failure here),
            # but an OSError into UnknownError: raise it as the ValueError, keeping its message (the file).
            raise ValueError(f"{type(e).__name__}: {e}") from e
        return np.array(b"OK", dtype=object)

    out = tf.numpy_function(run, [tf.convert_to_tensor(t) for t in tensors], tf.string, name=name)
    out.set_shape([])
    return out


class Saver:
    """SOK's ``Saver`` over embedcore checkpoints.

    The parameters are SOK's, by position and by name. ``embedding_variable``
    is the adapter's Keras ``Embedding``, an ``EmbeddingForServing``, one
    table of their ``embedding_tables``, an ``embedcore.Table`` or a list of
    tables. ``filepath`` is a directory: an embedcore checkpoint (see
    ``docs/format.md``), written atomically. Each call returns the string
    tensor ``"OK"`` and raises on failure; inside ``tf.function`` it runs
    when the function runs. ``dump_to_file`` keeps the other tables already
    saved in ``filepath`` (see ``embedcore.Saver.dump_to_file``), so
    variables can be dumped into one directory in turn."""

    def dump_to_file(self, embedding_variable, filepath) -> tf.Tensor:
        target, filepath = _target(embedding_variable), _filepath(filepath)
        return _run(lambda path: ec.Saver().dump_to_file(target, _text(path)), [filepath], "embedcore_dump")

    def restore_from_file(self, embedding_variable, filepath, include_optimizer: bool = True) -> tf.Tensor:
        """Restores `embedding_variable`'s tables from `filepath`, with their optimizer
        state; ``include_optimizer=False`` restores the values alone (as SOK
        1.x does), into a table of any optimizer."""
        target, filepath = _target(embedding_variable), _filepath(filepath)
        if isinstance(include_optimizer, (tf.Tensor, tf.Variable)):  # (a tf.function's argument: its value then)
            return _run(lambda path, flag: ec.Saver().restore_from_file(target, _text(path), include_optimizer=flag),
                        [filepath, include_optimizer], "embedcore_restore")
        return _run(lambda path: ec.Saver().restore_from_file(target, _text(path), include_optimizer=include_optimizer),
                    [filepath], "embedcore_restore")

    def load_embedding_values(self, embedding_variable, tensors) -> tf.Tensor:
        """Fills one table with `tensors` (a ``[rows, dim]`` tensor, or a
        list / tuple of ``[n_i, dim]`` tensors stacked along rows, as SOK
        does)."""
        target = _target(embedding_variable)
        parts: List = list(tensors) if isinstance(tensors, (list, tuple)) else [tensors]
        if not parts:
            raise ValueError("load_embedding_values: no tensors given")
        return _run(lambda *arrays: ec.Saver().load_embedding_values(target, list(arrays)), parts,
                    "embedcore_load_embedding_values")
