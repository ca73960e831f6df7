"""``Embedding``: a Keras layer whose tables live in the engine and train
with ``model.fit``.

The forward pass is the serving lookup. The backward pass does not hand a
gradient to the Keras optimizer (the tables are not ``tf.Variable``\\ s):
``tf.custom_gradient`` receives the gradient of the layer's outputs and the
engine's optimizer applies the sparse update of every touched row, one step
per table per batch (the gradients of all features that share a table
summed). So that Keras asks for that gradient at all, the outputs are made to
depend on one scalar trainable weight (``embedcore_anchor``, always 0, whose
gradient is 0). In a graph that gradient is the output of the update op, so
the Keras optimizer's step on the anchor needs the update to run: no graph
optimization can prune it.
"""
from __future__ import annotations

import contextlib
import warnings
import weakref
from typing import Dict, List, Optional

import keras
import numpy as np
import tensorflow as tf

import embedcore as ec
from embedcore._inputs import make_batch
from embedcore.table import apply_gradients_many

from . import _export
from ._config import TfLearningRate
from ._lookup import Backward, TableRef, lookup as _lookup, unpack_bwd
from ._serving import EmbeddingForServing

__all__ = ["Embedding"]

_TF = tf.tpu.experimental.embedding


def _bag_gradients(dy: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """The rows of the output gradient `dy` (``[-1, dim]``) that are the
    bags' gradients: `dy` itself when they are all of its rows in order
    (dense ids, a sequence without padding: no copy of the gradient)."""
    n = rows.size
    if n == dy.shape[0] and (n == 0 or (rows[0] == 0 and rows[-1] == n - 1 and bool((rows[1:] > rows[:-1]).all()))):
        return dy  # (n increasing rows in [0, n) are 0 .. n - 1)
    return dy[rows]


def _joined(arrays: list) -> np.ndarray:
    return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)


def apply_numpy(tables: Dict[str, ec.Table], parts_by_table: Dict[str, list]) -> None:
    """One optimizer step per table, all or nothing (a step one table refuses
    changes none). Each part is ``(Backward, dy)``; its bags are
    concatenated into one batch, so that repeated ids (across features too)
    are summed before the update."""
    steps = []
    for name, parts in parts_by_table.items():
        table = tables[name]
        ids, offsets, weights, grads = [], [np.zeros(1, np.int64)], [], []
        base = 0
        any_w = any(b.weights is not None for b, _ in parts)
        for b, dy in parts:
            ids.append(b.ids)
            offsets.append(b.offsets[1:] + base)
            base += int(b.offsets[-1])
            if any_w:
                weights.append(b.weights if b.weights is not None else np.ones(b.ids.size, np.float32))
            grads.append(_bag_gradients(np.asarray(dy, np.float32).reshape(-1, table.dim), b.rows))
        # A batch without ids for this table (empty bags, every id pruned, no rows) is still one step, as in
        # embedcore.Embedding (the step of a schedule, Adam's non-lazy moments of every row).
        batch = make_batch(np.ascontiguousarray(_joined(ids)), np.concatenate(offsets),
                           _joined(weights) if any_w else None)
        where = f"the gradient of table '{name}'"
        steps.append((table, [table._gradient_part(batch, table.combiner, 0, _joined(grads), where)], [where]))
    if steps:
        apply_gradients_many(steps)


# Registered (as "embedcore>Embedding"), so that Keras finds the class by the name its configs record:
# copy.copy of the layer (which Keras makes from its config) and load_model without custom_objects.
@keras.saving.register_keras_serializable(package="embedcore")
class Embedding(keras.layers.Layer):
    """A Keras embedding layer over engine tables.

    Two ways to make one:

    - ``Embedding(input_dim, output_dim, optimizer=..., combiner="mean")``:
      one table of ``input_dim`` rows; dense ids are gathered
      (``ids.shape + [output_dim]``, like ``keras.layers.Embedding``),
      ``tf.SparseTensor`` / ``tf.RaggedTensor`` bags are pooled with
      `combiner`;
    - ``Embedding(feature_config=..., optimizer=...)``: a nested structure
      of ``tf.tpu.experimental.embedding.FeatureConfig`` (or embedcore's),
      looked up as ``TPUEmbedding`` does; the layer takes the features (and
      optional ``weights``) in that structure.

    optimizer: the engine optimizer of every table without its own (an
        ``embedcore.optimizers`` one or TensorFlow's ``SGD`` / ``Adagrad`` /
        ``Adam`` / ``FTRL``). The model's Keras optimizer does not touch the
        tables; in ``model.fit`` each batch's backward pass applies this
        optimizer's sparse update to the rows the batch looked up. A table
        without one does not train (a training call warns, once).
    """

    _warned_frozen = False  # (the warning of a training call when no table has an optimizer: once a layer)

    def __init__(self, input_dim: Optional[int] = None, output_dim: Optional[int] = None, *, feature_config=None,
                 optimizer=None, combiner: str = "mean", initializer=None, table_name: Optional[str] = None,
                 **kwargs):
        super().__init__(**kwargs)
        self.autocast = False  # (float weights= stay float32 under a mixed policy, as keras.layers.Embedding's)
        if feature_config is None:
            if input_dim is None or output_dim is None:
                raise ValueError("Embedding: give input_dim and output_dim, or feature_config=")
            dims = []
            for what, value in (("input_dim", input_dim), ("output_dim", output_dim)):
                # int() would truncate 2.5 to 2 (a table of other rows than asked), and accept "4" or True; a
                # whole float (10.0, in the config of a layer made with input_dim=vocab / 2) is its int.
                whole = isinstance(value, (float, np.floating)) and float(value).is_integer()
                if isinstance(value, bool) or not (isinstance(value, (int, np.integer)) or whole):
                    raise TypeError(f"Embedding: {what} must be an int, got {value!r}")
                dims.append(int(value))
            input_dim, output_dim = dims  # Python ints: get_config() stays JSON
            ours = isinstance(initializer, ec.initializers.Initializer)  # TensorFlow's config takes callables only
            table = _TF.TableConfig(vocabulary_size=int(input_dim), dim=int(output_dim),
                                    initializer=None if ours else initializer, combiner=combiner,
                                    name=table_name or (self.name + "_table"))
            if ours:
                table.initializer = initializer  # the engine draws it
            feature_config = _TF.FeatureConfig(table=table)
        elif input_dim is not None or output_dim is not None:
            raise ValueError("Embedding: give input_dim and output_dim, or feature_config=, not both")
        self._config_args = dict(input_dim=input_dim, output_dim=output_dim, combiner=combiner, table_name=table_name,
                                 optimizer=optimizer, initializer=initializer)
        self.embedding = EmbeddingForServing(feature_config, optimizer)
        self.supports_jit = False  # the lookup is a NumPy callback, which XLA cannot compile
        self._anchor = None

    def build(self, input_shape=None):
        self.embedding._maybe_build()  # in tf.init_scope: Keras builds a subclassed model's layers while tracing
        self._anchor = self.add_weight(name="embedcore_anchor", shape=(), initializer="zeros", trainable=True)
        self.built = True

    @property
    def embedding_tables(self):
        return self.embedding.embedding_tables

    def _embedcore_tables(self) -> List[ec.Table]:
        return self.embedding._embedcore_tables()

    def _embedcore_features(self):
        # The Embedding(input_dim, output_dim) form gathers dense ids as keras.layers.Embedding does, which no
        # served feature does: its checkpoint records the table alone.
        if self._config_args["input_dim"] is not None:
            return None
        return self.embedding._embedcore_features()

    def get_config(self):
        """Keras's config (``model.save``, ``keras.models.clone_model``) of
        an ``Embedding(input_dim, output_dim, ...)`` layer, with its
        optimizer and initializer (as JSON), so that ``from_config`` builds
        a layer that trains as this one does. An optimizer whose learning
        rate is a schedule (a callable), or an initializer that is neither
        embedcore's nor a Keras one, cannot be written: ValueError. Nor can
        a ``feature_config=`` layer's (ValueError), rather than a config
        that ``from_config`` could not build."""
        config = super().get_config()
        if self._config_args["input_dim"] is None:
            raise ValueError(f"Embedding layer {self.name!r}: a layer made with feature_config= has no Keras config "
                             "(model.save, clone_model): build it in code, and keep its tables with "
                             "tf.train.Checkpoint or embedcore.save")
        args = dict(self._config_args)
        args["optimizer"] = _optimizer_config(self.name, args["optimizer"])
        args["initializer"] = _initializer_config(self.name, args["initializer"])
        config.update(args)
        return config

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        where = f"Embedding.from_config ({config.get('name')!r})"
        config["optimizer"] = _optimizer_from_config(where, config.get("optimizer"))
        config["initializer"] = _initializer_from_config(where, config.get("initializer"))
        return cls(**config)

    def compute_output_spec(self, inputs, weights=None, training=None):
        """The outputs of symbolic (Keras functional) inputs. Keras's
        TensorFlow backend traces ``call`` with dense placeholders of ragged
        ``keras.Input``s, which would be gathered (``[batch, None, dim]``)
        rather than pooled (``[batch, dim]``, as ``call`` pools a
        ``tf.RaggedTensor``), and with which ragged weights were refused: the
        trace gets ragged placeholders for them."""
        ragged = lambda x: _RaggedPlaceholder(x) if isinstance(x, keras.KerasTensor) and x.ragged else x  # noqa: E731

        def traced(inputs, weights):
            made = lambda x: x.make() if isinstance(x, _RaggedPlaceholder) else x  # noqa: E731
            return self.call(tf.nest.map_structure(made, inputs), tf.nest.map_structure(made, weights), False)

        return keras.src.backend.compute_output_spec(traced, tf.nest.map_structure(ragged, inputs),
                                                     tf.nest.map_structure(ragged, weights))

    def call(self, inputs, weights=None, training=None):
        if self._config_args["input_dim"] is not None:
            inputs = _keras_ids(inputs)
        outputs = self._call(inputs, weights, training)
        if self.compute_dtype != "float32":  # (a mixed policy's, as keras.layers.Embedding casts its outputs)
            outputs = tf.nest.map_structure(lambda o: tf.cast(o, self.compute_dtype), outputs)
        return outputs

    def _call(self, inputs, weights, training):
        emb = self.embedding
        emb._maybe_build()
        if _export.in_export():
            if training is True and self.trainable and any(t.optimizer is not None for t in emb._tables.values()):
                # The export's lookups read constant copies of the tables: an exported training function would
                # train the rest of the model and leave the tables as they were, silently.
                raise ValueError(f"embedcore.adapters.tf.Embedding {self.name!r}: a training call "
                                 "(training=True) cannot be exported: the SavedModel's lookups read copies of "
                                 "the tables, which its training function could not update. Export serving "
                                 "functions only (training=False), and train with embedcore")
            return _export.lookup(emb, inputs, weights)
        emb._export.clear()
        trains = any(t.optimizer is not None for t in emb._tables.values())
        if training is True and not trains and self.trainable and not self._warned_frozen:  # (not a tensor's bool)
            # keras.layers.Embedding trains with the model's optimizer; this layer's tables train only with
            # an engine optimizer, and Keras's own warning ("Gradients do not exist") points at the loss.
            self._warned_frozen = True
            warnings.warn(f"embedcore.adapters.tf.Embedding {self.name!r}: no table has an optimizer, so training "
                          "does not change them (the model's Keras optimizer does not reach them): pass optimizer= "
                          "(an embedcore or TensorFlow SGD / Adagrad / Adam / FTRL), or set trainable=False",
                          stacklevel=2)
        if training is False or not trains or not self.trainable:
            # (Keras 3 keeps a frozen layer's anchor a trainable tf.Variable, so the tape would still ask it.)
            return _lookup(inputs, weights, emb._features, emb._tables)
        refusal = None
        replicas = tf.distribute.get_replica_context()
        if replicas is not None and replicas.num_replicas_in_sync > 1:
            # Each replica's backward would update the shared tables on its own, one after the other.
            refusal = (f"embedcore.adapters.tf.Embedding {self.name!r}: training with "
                       f"{replicas.num_replicas_in_sync} replicas in sync (tf.distribute) is not supported: each "
                       "replica would update the tables on its own, in turn; train with one replica and shard the "
                       "tables with embedcore.distributed instead")
        elif "mixed_float16" in {self.dtype_policy.name, keras.config.dtype_policy().name}:
            # compile() then wraps the Keras optimizer in a LossScaleOptimizer, which scales the loss and unscales
            # only the gradients it applies itself: the engine's update, in the backward pass, would be scaled.
            refusal = (f"embedcore.adapters.tf.Embedding {self.name!r}: training under the 'mixed_float16' dtype "
                       "policy is not supported (Keras's loss scaling would reach the engine's update unscaled); "
                       "train with the 'float32' or 'mixed_bfloat16' policy (no loss scaling)")
        else:
            model = _loss_scaling_caller()
            if model is not None:  # (a model's own 'mixed_float16' policy, or a LossScaleOptimizer given to compile)
                refusal = (f"embedcore.adapters.tf.Embedding {self.name!r}: training in model {model.name!r}, whose "
                           "optimizer is a LossScaleOptimizer (compile() makes one under a model's 'mixed_float16' "
                           f"policy; this model's is {model.dtype_policy.name!r}), is not supported: the loss scaling "
                           "would reach the engine's update unscaled; use the 'float32' or 'mixed_bfloat16' policy "
                           "(no loss scaling)")
        return _trainable_lookup(emb, inputs, weights, self._anchor, refusal)


def _keras_ids(x):
    """The ids of an ``Embedding(input_dim, output_dim)`` layer, as
    ``keras.layers.Embedding`` takes them: numbers of a dtype other than
    int32 / int64 (float32, a ``keras.Input``'s default; int8, uint16, ...)
    cast to int32; dense, sparse and ragged alike."""
    if isinstance(x, np.ndarray) and x.dtype.kind in "fiu":
        x = tf.convert_to_tensor(x)
    dtype = getattr(x, "dtype", None)
    if not isinstance(x, (tf.Tensor, tf.SparseTensor, tf.RaggedTensor)) or dtype in (tf.int32, tf.int64):
        return x
    if not (dtype.is_floating or dtype.is_integer) or dtype.is_quantized:
        return x  # (refused by the lookup, naming the dtype)
    if isinstance(x, tf.SparseTensor):
        return tf.SparseTensor(x.indices, tf.cast(x.values, tf.int32), x.dense_shape)
    if isinstance(x, tf.RaggedTensor):
        return x.with_flat_values(tf.cast(x.flat_values, tf.int32))
    return tf.cast(x, tf.int32)


class _RaggedPlaceholder:
    """A ragged ``keras.Input`` carried through Keras's conversion of
    symbolic inputs to placeholders (which makes them dense); ``make`` gives
    the ragged placeholder, in the graph Keras traces in."""

    def __init__(self, x):
        self.shape, self.dtype = tuple(x.shape), x.dtype
        self.ragged_rank = x.ragged_rank if x.ragged_rank is not None else len(self.shape) - 1

    def make(self) -> tf.RaggedTensor:
        rank = self.ragged_rank
        t = tf.compat.v1.placeholder(self.dtype, shape=(None,) + self.shape[rank + 1:])
        for _ in range(rank):
            t = tf.RaggedTensor.from_row_splits(t, tf.compat.v1.placeholder(tf.int64, shape=(None,)), validate=False)
        return t


def _loss_scaling_caller():
    """The Keras model whose call this is (the outermost layer called, which
    ``fit`` calls), when its compiled optimizer scales the loss (a
    ``LossScaleOptimizer``: what ``compile()`` makes under a model's own
    'mixed_float16' policy); else None. Keras 3 records the outermost layer
    of a call in its call context (``keras.src``: None where that moved)."""
    try:
        from keras.src.backend.common import global_state
    except ImportError:
        return None
    entry = getattr(global_state.get_global_attribute("current_call_ctx"), "entry_layer", None)
    optimizer = getattr(entry, "optimizer", None)
    return entry if isinstance(optimizer, keras.optimizers.LossScaleOptimizer) else None


def _trainable_lookup(emb: EmbeddingForServing, inputs, weights, anchor, refusal: Optional[str] = None):
    """The lookup, with a backward pass that applies the engine's update; with
    `refusal`, asking for that gradient raises NotImplementedError(refusal)
    before anything changes (the forward pass and inference still work)."""
    outputs, backward, weighted = _lookup(inputs, weights, emb._features, emb._tables, need_bwd=True)
    flat = tf.nest.flatten(outputs)
    a = tf.convert_to_tensor(anchor)
    n = len(flat)
    # The embedding, weakly: in a graph, tf.custom_gradient registers `grad` in TensorFlow's gradient registry,
    # which keeps it for the life of the process (the tables would stay after their model was gone).
    emb_ref = weakref.ref(emb)

    @tf.custom_gradient
    def attach(a_value, *args):
        outs, ws = args[:n], args[n:]

        def grad(*dys):
            if refusal is not None:
                raise NotImplementedError(refusal)
            # The per-id weights' gradients first, from the rows the forward read: the update changes them.
            wgrads = [None if dys[wg.output] is None else wg.gradient(dys[wg.output], w)
                      for wg, w in zip(weighted, ws)]
            owner = emb_ref()
            if owner is None:
                raise ValueError("the embedcore layer of this lookup no longer exists: its gradient cannot update "
                                 "its tables")
            with tf.control_dependencies([g for g in wgrads if g is not None] if not tf.executing_eagerly() else []):
                update = _apply(owner, backward, dys)
            if not update:  # eager: the update ran
                return [tf.zeros_like(a_value)] + [None] * len(outs) + wgrads
            # In a graph, the anchor's gradient (0) is the update's own output: a control dependency alone
            # was pruned by Grappler in some models (a Dense head trained with Adam), silently.
            zero = tf.ensure_shape(tf.cast(update[0], a_value.dtype), a_value.shape)
            return [zero] + [None] * len(outs) + wgrads

        return [tf.identity(o) for o in outs], grad

    return tf.nest.pack_sequence_as(outputs, attach(a, *flat, *(wg.w for wg in weighted)))


def _learning_rates(tables: Dict[str, ec.Table], names) -> list:
    """TensorFlow's learning-rate callables of these tables, each called once
    (as ``TPUEmbedding.apply_gradients`` calls each): ``[(rate value as a
    float64 tensor, [the tables' TfLearningRate])]``. In a graph the call's
    ops (reads of ``optimizer.iterations``, of a learning-rate variable) run
    in the step's order, before the variable writes that follow them (the
    Keras optimizer's ``iterations.assign_add``), and the update takes the
    value as an input, so it runs after them."""
    by_fn: Dict[int, tuple] = {}
    for name in names:
        opt = tables[name]._optimizer
        lr = opt.learning_rate if opt is not None else None
        if isinstance(lr, TfLearningRate):
            entry = by_fn.setdefault(id(lr.fn), (lr.fn, [], []))
            entry[1].append(lr)
            entry[2].append(f"'{name}'")
    out = []
    for fn, schedules, which in by_fn.values():
        try:
            value = tf.cast(tf.convert_to_tensor(fn(), dtype_hint=tf.float64), tf.float64)
        except Exception as e:
            if tf.executing_eagerly():
                raise
            raise TypeError(f"the learning rate {fn!r} of table {', '.join(which)} cannot be evaluated inside "
                            f"tf.function ({type(e).__name__}: {e}): as in TPUEmbedding, a learning-rate callable is "
                            "called as TensorFlow ops in the training step; make it return a tensor (e.g. lambda: "
                            "schedule(optimizer.iterations)), or train eagerly") from e
        if value.shape.rank not in (None, 0):
            raise ValueError(f"the learning rate {fn!r} of table {', '.join(which)} must return a scalar, got shape "
                             f"{value.shape}")
        out.append((value, schedules))
    return out


def _apply(emb: EmbeddingForServing, backward, dys) -> list:
    """Runs the engine update (eagerly, or as a stateful numpy_function)."""
    tables = emb._tables
    # A table without an engine optimizer stays as it is (a frozen one beside trained ones).
    items = [(f, b, dy) for (f, b), dy in zip(backward, dys)
             if dy is not None and tables[f.table.name].optimizer is not None]
    if not items:
        return []
    rates = _learning_rates(tables, list(dict.fromkeys(f.table.name for f, _, _ in items)))
    # What the callback holds: no graph tensors, and the tables weakly (TableRef: a graph keeps its callbacks).
    names = [f.table.name for f, _, _ in items]
    refs = {name: TableRef(tables[name]) for name in names}
    schedules_of = [schedules for _, schedules in rates]

    def run(*arrays):
        parts: Dict[str, list] = {}
        for i, name in enumerate(names):
            b = unpack_bwd(arrays[6 * i: 6 * i + 5])
            parts.setdefault(name, []).append((b, arrays[6 * i + 5]))
        with contextlib.ExitStack() as given:
            for schedules, value in zip(schedules_of, arrays[6 * len(names):]):
                for schedule in schedules:
                    given.enter_context(schedule.given(float(value)))
            apply_numpy({name: ref() for name, ref in refs.items()}, parts)
        return np.zeros((), np.float32)

    tensors = []
    for _, b, dy in items:
        tensors.extend(list(b) + [tf.convert_to_tensor(dy, tf.float32)])
    tensors.extend(value for value, _ in rates)
    if tf.executing_eagerly():
        run(*[t.numpy() for t in tensors])
        return []
    return [tf.numpy_function(run, tensors, tf.float32, name="embedcore_apply_gradients")]


# ------------------------------------------------------------------ get_config / from_config
def _optimizer_config(layer: str, opt) -> Optional[dict]:
    """`opt` (embedcore's or TensorFlow's, or None) as JSON: embedcore's
    optimizer with its options, as checkpoints record it."""
    from embedcore.checkpoint import _optimizer_json

    from ._config import optimizer_from_tf

    ours = optimizer_from_tf(opt)
    if ours is not None and callable(ours.learning_rate):
        raise ValueError(f"embedcore.adapters.tf.Embedding {layer!r}: get_config cannot write the optimizer "
                         f"{type(opt).__name__} whose learning rate is a schedule ({ours.learning_rate!r}, a "
                         "callable); a layer built from the config would not train as this one does. Give a float "
                         "learning rate, or rebuild the layer with its optimizer instead of from its config")
    return _optimizer_json(ours)


def _initializer_config(layer: str, init) -> Optional[dict]:
    """`init` as JSON: embedcore's ({"class": ..., options}) or Keras's
    (``keras.initializers.serialize``)."""
    if init is None:
        return None
    if isinstance(init, ec.initializers.Initializer):
        from embedcore.checkpoint import _initializer_json

        return _initializer_json(init)
    if isinstance(init, keras.initializers.Initializer):
        return {"keras": keras.initializers.serialize(init)}
    raise ValueError(f"embedcore.adapters.tf.Embedding {layer!r}: get_config cannot write the initializer {init!r} "
                     "(only embedcore and Keras initializers are serializable); a layer built from the config would "
                     "start from other values")


def _optimizer_from_config(where: str, d) -> Optional[ec.optimizers.Optimizer]:
    if d is None or isinstance(d, ec.optimizers.Optimizer):
        return d
    if not isinstance(d, dict) or not isinstance(d.get("class"), str):
        raise ValueError(f"{where}: optimizer must be an embedcore optimizer's config ({{'class': ..., options}}) "
                         f"or None, got {d!r}")
    d = dict(d)
    name = d.pop("class")
    kind = getattr(ec.optimizers, name, None)
    if not (isinstance(kind, type) and issubclass(kind, ec.optimizers.Optimizer)):
        raise ValueError(f"{where}: unknown optimizer class {name!r} (embedcore.optimizers has no such optimizer)")
    if d.get("learning_rate") is None or "learning_rate_schedule" in d:
        raise ValueError(f"{where}: optimizer {name} has no learning rate (a schedule cannot be restored)")
    try:
        return kind(**d)
    except TypeError as e:
        raise ValueError(f"{where}: bad options for optimizer {name}: {e}") from None


def _initializer_from_config(where: str, d):
    if d is None or not isinstance(d, dict):
        return d  # None, or an initializer object given directly
    if "keras" in d:
        return keras.initializers.deserialize(d["keras"])
    d = dict(d)
    name = d.pop("class", None)
    kind = getattr(ec.initializers, name, None) if isinstance(name, str) else None
    if not (isinstance(kind, type) and issubclass(kind, ec.initializers.Initializer)):
        raise ValueError(f"{where}: unknown initializer {name!r} (not an embedcore.initializers class)")
    try:
        return kind(**d)
    except TypeError as e:
        raise ValueError(f"{where}: bad options for initializer {name}: {e}") from None
