"""``EmbeddingForServing``: TensorFlow's ``TPUEmbeddingForServing`` over
engine tables."""
from __future__ import annotations

import threading
import weakref
from typing import Any, Dict, List, Optional

import numpy as np
import tensorflow as tf
from tensorflow.python.trackable.base import SaveType

import embedcore as ec

from . import _checkpoint, _export
from ._config import Feature, TableSpec, features_of
from ._lookup import TableRef, lookup as _lookup

__all__ = ["EmbeddingForServing", "TableHandle"]

_AutoTrackable = tf.__internal__.tracking.AutoTrackable
_CHECKPOINT = SaveType.CHECKPOINT
# Held while a layer builds its tables: threads whose first calls come at once build them once (a build
# is once per layer: one lock for all of them).
_BUILD_LOCK = threading.Lock()


class TableHandle:
    """One table of ``embedding_tables`` (or one slot of ``variables``): the
    engine's table, with the parts of ``tf.Variable``'s interface that
    serving code uses (``numpy()``, ``read_value()``, ``assign()``,
    ``shape``, ``dtype``, ``name``). ``numpy()`` is a zero-copy read-only
    view of the engine's memory.

    While a SavedModel is exported (``tf.saved_model.save``, or inside
    ``export_mode()``), a table's handle reads, and converts to, the
    ``tf.Variable`` copy of the table that the export saves with the model,
    as the adapter's lookups do then, so that TensorFlow's own serving code
    over ``embedding_tables`` exports a model that loads without
    embedcore."""

    __array_priority__ = 100  # as tf.Variable's: numpy's operators defer to ours (ndarray + handle is a tensor)

    def __init__(self, table: ec.Table, slot: Optional[str] = None, owner=None):
        self.table = table
        self.slot = slot
        self._owner = owner  # the EmbeddingForServing whose table this is: its export variables

    @property
    def name(self) -> str:
        return self.table.name if self.slot is None else f"{self.table.name}/{self.slot}"

    @property
    def _shape(self) -> list:
        """[rows, dim]; a row-wise slot's [rows, 1]."""
        return [self.table.rows, self.table.dim if self.slot is None else self.table._native.slot_dim]

    @property
    def shape(self) -> tf.TensorShape:
        return tf.TensorShape(self._shape)

    @property
    def dtype(self) -> tf.DType:
        return tf.float32

    def numpy(self) -> np.ndarray:
        return self.table.values() if self.slot is None else self.table.slots()[self.slot]

    def __array__(self, dtype=None, copy=None):
        """NumPy 2's protocol: ``np.array(handle)`` / ``np.asarray(handle)``
        return a copy of the values (a snapshot, writable, as for a
        ``tf.Variable``); only ``copy=False`` returns the zero-copy read-only
        view of ``numpy()``, and raises ValueError (as NumPy does) when
        `dtype` would need a conversion."""
        v = self.numpy()
        if copy is False:
            if dtype is not None and np.dtype(dtype) != v.dtype:
                raise ValueError(f"'{self.name}': cannot convert the table's {v.dtype} values to {np.dtype(dtype)} "
                                 "without a copy (copy=False)")
            return v
        return np.array(v, dtype=dtype, copy=True)

    def read_value(self) -> tf.Tensor:
        """A tensor holding a copy of the values, as float32. Inside a
        graph it reads the values when the graph runs (a stateful
        ``tf.numpy_function``), as a variable's read does, not when it is
        traced (copying the whole table each time it runs). During an export
        it reads the table's exported variable instead."""
        if _export.in_export():
            return self._export_variable().read_value()
        if tf.executing_eagerly():
            return tf.constant(np.asarray(self.numpy(), np.float32))
        get = self._held_weakly()
        out = tf.numpy_function(lambda: np.array(get().numpy(), np.float32), [], tf.float32, stateful=True,
                                name=f"read_{self.table.name}")
        out.set_shape(self._shape)
        return out

    def _export_variable(self) -> tf.Variable:
        if self.slot is not None:
            raise ValueError(f"'{self.name}': an optimizer slot cannot be exported in a SavedModel (only the tables' "
                             "values are); read it outside the export")
        if self._owner is None:
            raise ValueError(f"'{self.name}': a TableHandle made without its EmbeddingForServing cannot be exported; "
                             "use the handles of its embedding_tables")
        return _export.variables(self._owner)[self.table.name]

    def __iter__(self):
        """Rows, as iterating a variable gives them (eagerly)."""
        return iter(self.read_value())

    value = read_value

    def assign(self, value, use_locking=None, name=None, read_value: bool = True) -> Optional["TableHandle"]:
        """Writes `value` into the table (or slot), as ``tf.Variable.assign``
        does: eagerly at once; inside a graph (``tf.function``) when the
        graph runs, each time (a stateful ``tf.numpy_function``). Returns the
        handle, or None with ``read_value=False``; `use_locking` and `name`
        are taken for ``tf.Variable``'s signature (the engine's writes are
        locked anyway)."""
        self._assign(value)
        return self if read_value else None

    def _assign(self, value) -> None:
        if isinstance(value, (tf.Tensor, tf.Variable)) and value.dtype != tf.float32:  # tf.Variable.assign's rule
            raise ValueError(f"cannot assign to '{self.name}': Tensor conversion requested dtype float32 for Tensor "
                             f"with dtype {value.dtype.name} (cast it first: tf.cast(value, tf.float32))")
        if not tf.executing_eagerly():
            value = tf.convert_to_tensor(value, tf.float32)
            if not value.shape.is_compatible_with(self._shape):
                raise ValueError(f"cannot assign a value of shape {value.shape.as_list()} to '{self.name}' of shape "
                                 f"{self._shape}")
            get = self._held_weakly()

            def write(v):
                get()._assign_numpy(v)
                return []

            tf.numpy_function(write, [value], [], stateful=True, name=f"assign_{self.table.name}")
            return
        self._assign_numpy(value.numpy() if hasattr(value, "numpy") else np.asarray(value))

    def _held_weakly(self):
        """What a graph's callback holds of this handle: a callable giving
        its equivalent when the graph runs, the table and owner held weakly
        (TensorFlow keeps a tf.function's callbacks for the life of the
        process: ``TableRef``)."""
        table, slot = TableRef(self.table), self.slot
        owner = None if self._owner is None else weakref.ref(self._owner)
        return lambda: TableHandle(table(), slot, None if owner is None else owner())

    def _assign_numpy(self, v) -> None:
        if list(v.shape) != self._shape:
            raise ValueError(f"cannot assign a value of shape {list(v.shape)} to '{self.name}' of shape "
                             f"{self._shape}")
        if self.slot is None:
            self.table.assign(v)
            if self._owner is not None:
                self._owner._export.clear()  # its export copies, if any, no longer hold these values
        else:
            self.table.assign_slot(self.slot, v)

    def __repr__(self) -> str:
        return f"<embedcore table '{self.name}' shape={self._shape} dtype=float32>"


# As for a tf.Variable: the handle converts to a tensor of its values (a copy; tf.convert_to_tensor, ops taking
# it), and TensorFlow's operators (table + 1.0, table[3], table @ w) apply to that tensor. == and != keep
# Python's identity meaning, and handles hash (each table has one handle: dict keys work), where TensorFlow's
# variables compare elementwise and are unhashable (use .ref() there).
tf.register_tensor_conversion_function(
    TableHandle, lambda v, dtype=None, name=None, as_ref=False: tf.convert_to_tensor(v.read_value(), dtype=dtype, name=name))


def _forward_operator(op: str):
    def method(self, *args):
        return getattr(tf.Tensor, op)(self.read_value(), *args)

    method.__name__ = op
    return method


for _op in tf.Tensor.OVERLOADABLE_OPERATORS - {"__eq__", "__ne__"}:
    setattr(TableHandle, _op, _forward_operator(_op))


class EmbeddingForServing(_AutoTrackable):
    """TensorFlow's ``TPUEmbeddingForServing`` with its tables in the engine.

    ``EmbeddingForServing(feature_config, optimizer=None)`` takes a nested
    structure of ``tf.tpu.experimental.embedding.FeatureConfig`` (or
    ``embedcore.FeatureConfig``) and an optional optimizer (TensorFlow's or
    embedcore's; it only decides which slots exist, for checkpoints).
    ``embedding(features, weights=None)`` / ``embedding_lookup`` look up
    dense, ``tf.SparseTensor`` and ``tf.RaggedTensor`` features with
    TensorFlow's semantics (pruning, empty bags, sequences, output shapes,
    errors), eagerly or inside ``tf.function``.

    Checkpoints: ``tf.train.Checkpoint(embedding=this).restore(path)``
    restores a checkpoint of TensorFlow's ``TPUEmbedding`` /
    ``TPUEmbeddingForServing`` (and saves one TensorFlow can read, with each
    table's optimizer step beside its values, so that training resumes);
    ``load_tf_checkpoint(path, into=this)`` does the same with bounded memory
    and also reads SparseCore-stacked tables. ``embedcore.save(path, this)``
    writes an embedcore checkpoint. ``tf.saved_model.save`` exports the
    lookup as TensorFlow ops (see ``docs/tensorflow.md``).
    """

    def __init__(self, feature_config, optimizer=None, experimental_sparsecore_restore_info=None):
        self._self_setattr_tracking = False  # our attributes are not checkpoint dependencies
        self._feature_config = feature_config
        features, specs = features_of(feature_config, optimizer, "EmbeddingForServing")
        self._features: Dict[str, Feature] = {f.path: f for f in features}
        self._specs: List[TableSpec] = specs
        self._table_config = [s.config for s in specs]
        self._optimizer = optimizer
        self._tables: Dict[str, ec.Table] = {}
        self._built = False
        self._children: Optional[Dict[str, Any]] = None
        self._ckpt_path: Optional[str] = None
        self._export = _export.ExportState()  # table copies for a SavedModel export

    # -------------------------------------------------------------- building
    def build(self) -> None:
        """Creates the engine tables (and their optimizer's slots)."""
        if self._built:
            return
        with _BUILD_LOCK:  # (threads whose first calls come at once: one set of tables, which every call reads)
            if not self._built:
                self._tables = {s.name: s.make_table() for s in self._specs}
                self._built = True

    def _maybe_build(self) -> None:
        if not self._built:
            with tf.init_scope():
                self.build()

    @property
    def feature_config(self):
        return self._feature_config

    @property
    def embedding_tables(self) -> Dict[Any, TableHandle]:
        """Each TableConfig of the feature config, mapped to its table."""
        self._maybe_build()
        return {s.config: self._handle(s.name, None) for s in self._specs}

    @property
    def variables(self) -> Dict[str, Dict[str, TableHandle]]:
        """By table name: ``{"parameters": table, <slot>: slot, ...}``."""
        self._maybe_build()
        out = {}
        for s in self._specs:
            t = self._tables[s.name]
            d = {slot: self._handle(s.name, slot) for slot in t.slot_names}
            d["parameters"] = self._handle(s.name, None)
            out[s.name] = d
        return out

    def _handle(self, name: str, slot: Optional[str]) -> TableHandle:
        """The one handle of a table (or of one of its slots): every access
        returns the same object, so that handles compare and hash as the
        same table."""
        handles = self.__dict__.setdefault("_handles", {})
        h = handles.get((name, slot))
        if h is None or h.table is not self._tables[name]:
            h = handles[(name, slot)] = TableHandle(self._tables[name], slot, owner=self)
        return h

    def _embedcore_features(self):
        """For ``embedcore.save``: the feature config and each feature's (name,
        table, max_sequence_length), in ``tf.nest`` order, so a checkpoint
        serves by feature (``embedcore.serving``, the C API's feature
        lookups, the PyTorch served collections) as an ``embedcore.Embedding``'s
        does. A feature's name is its ``FeatureConfig`` name, else its path in
        the config; the paths alone where two features share a name."""
        features = list(self._features.values())
        names = [f.name or f.path or f"feature_{i}" for i, f in enumerate(features)]
        if len(set(names)) < len(names):  # TensorFlow's feature names need not be unique; the paths are
            names = [f.path or f"feature_{i}" for i, f in enumerate(features)]
        return self._feature_config, [(n, f.table.name, f.max_sequence_length) for n, f in zip(names, features)]

    def _embedcore_tables(self) -> List[ec.Table]:
        self._maybe_build()
        return [self._tables[s.name] for s in self._specs]

    # -------------------------------------------------------------- lookup
    def __call__(self, features: Any, weights: Optional[Any] = None) -> Any:
        return self.embedding_lookup(features, weights)

    def embedding_lookup(self, features: Any, weights: Optional[Any] = None) -> Any:
        """Looks up a nested structure of features (a subset of the feature
        config's); returns the outputs in the structure of `features`."""
        self._maybe_build()
        if _export.in_export():
            return _export.lookup(self, features, weights)
        self._export.clear()
        return _lookup(features, weights, self._features, self._tables)

    # -------------------------------------------------------------- tf.train.Checkpoint and SavedModel
    def _trackable_children(self, save_type=_CHECKPOINT, **kwargs):
        self._maybe_build()
        if save_type == _CHECKPOINT:
            if self._children is None:
                children = {}
                for s in self._specs:
                    t = self._tables[s.name]
                    children[s.name] = _checkpoint.TableVariable(t)  # its values and step
                    for slot in t.slot_names:
                        children[f"{s.name}/{slot}"] = _checkpoint.EngineVariable(t, slot)
                self._children = children
            return dict(self._children)
        children = dict(super()._trackable_children(save_type, **kwargs))
        children.update(_export.variables(self, refresh=True))
        return children

    def _checkpoint_adapter(self, path: str):
        self._ckpt_path = path  # read the SparseCore layouts from it if stacked tables show up
        return super()._checkpoint_adapter(path)

    def _lookup_dependency(self, name, cached_dependencies=None):
        # A stacked variable of the checkpoint's SparseCore layouts first: a table alone in its stack gives
        # the stack its own name, and its padded variable is not the table's shape.
        if self._ckpt_path is not None:
            stacked, _, slot = name.partition("/")
            if stacked in {s.stacked for s in self._stacked_layouts().values()}:
                return _checkpoint.StackedSink(self, stacked, slot or None)
        found = super()._lookup_dependency(name, cached_dependencies)
        if found is None and self._children is not None:
            found = self._children.get(name)
        return found

    def _stacked_layouts(self) -> Dict[str, "_checkpoint.StackedTable"]:
        cache = getattr(self, "_layout_cache", None)
        if cache is None or cache[0] != self._ckpt_path:
            mine = {}
            try:
                for layouts in _checkpoint.TFCheckpoint(self._ckpt_path).all_layouts().values():
                    mine.update({n: s for n, s in layouts.items() if n in self._tables})
            except ValueError:
                pass
            cache = (self._ckpt_path, mine)
            self._layout_cache = cache
        return cache[1]

    def _restore_stacked(self, stacked: str, slot: Optional[str], value: np.ndarray) -> None:
        layouts = self._stacked_layouts()
        # Values are checked before any table changes: the whole stacked variable in one pass; only where that
        # finds a NaN or an infinity (in a table, or in padding) is each table un-stacked apart and checked.
        direct = slot is None and bool(np.isfinite(value).all())
        dests = {}
        for n, s in layouts.items():
            if s.stacked != stacked:
                continue
            t = self._tables[n]
            if direct:
                dests[n] = t._native.values_mut()
            elif slot is None or slot in t.slot_names:
                dests[n] = np.empty_like(t._native.values_mut() if slot is None
                                         else dict(t._native.slots_mut())[slot])  # checked before any table changes
        _checkpoint.unstack_array(layouts, stacked, value, dests)
        if direct:
            return
        for n, v in dests.items():
            if slot is None:
                problem = _checkpoint.values_problem(self._tables[n], v)
                if problem:
                    raise ValueError(f"stacked variable '{stacked}': table '{n}': {problem}")
            else:
                problem = _checkpoint.slot_value_problem(self._tables[n], slot, v)
                if problem:
                    raise ValueError(f"stacked variable '{stacked}': slot '{slot}' of table '{n}' {problem}")
        for n, v in dests.items():
            native = self._tables[n]._native
            (native.values_mut() if slot is None else dict(native.slots_mut())[slot])[...] = v

    def __repr__(self) -> str:
        return f"EmbeddingForServing(tables={[s.name for s in self._specs]}, features={list(self._features)})"

    def __copy__(self) -> "EmbeddingForServing":
        """A shallow copy: the same tables (as before ``__reduce_ex__`` below)."""
        new = type(self).__new__(type(self))
        new.__dict__.update(self.__dict__)
        return new

    def __reduce_ex__(self, protocol):
        raise TypeError("EmbeddingForServing cannot be pickled or deep-copied: "
                        "its tables live in the engine; keep them with tf.train.Checkpoint or the Saver, and build "
                        "a new one (a Keras Embedding(input_dim, output_dim) layer copies through its config)")
