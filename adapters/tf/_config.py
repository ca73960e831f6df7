"""TensorFlow's TPU-embedding configs, optimizers and initializers, read
into embedcore's.

A feature config may hold ``tf.tpu.experimental.embedding.FeatureConfig`` /
``TableConfig`` objects, embedcore's ``FeatureConfig`` / ``TableConfig``, or
both. Each feature becomes a :class:`Feature` and each table a
:class:`TableSpec`; the engine's ``Table`` is made from the spec.
"""
from __future__ import annotations

import contextlib
import math
import threading
import warnings
import zlib
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import tensorflow as tf
from tensorflow.python.eager import context  # eager_mode: an initializer's values inside a TF1-style graph
from tensorflow.python.util import nest  # flatten_with_joined_string_paths: the paths TensorFlow matches features by

import embedcore as ec

__all__ = ["Feature", "TableSpec", "features_of", "optimizer_from_tf", "initializer_from_tf"]

_TF = tf.tpu.experimental.embedding
_TfOptimizer = _TF.SGD.__mro__[1]  # tpu_embedding_v2_utils._Optimizer, the base of TensorFlow's optimizers
_FLOAT32_MAX = float(np.finfo(np.float32).max)


# ------------------------------------------------------------------ optimizers
def optimizer_from_tf(opt) -> Optional[ec.optimizers.Optimizer]:
    """embedcore's optimizer for a ``tf.tpu.experimental.embedding`` one
    (SGD, Adagrad, Adam, FTRL), or `opt` itself when it is embedcore's.

    Raises ``NotImplementedError`` for optimizers the engine does not have
    (AdagradMomentum, CustomOptimizer) and for a ``slot_variable_creation_fn``."""
    if opt is None or isinstance(opt, ec.optimizers.Optimizer):
        return opt
    if not isinstance(opt, _TfOptimizer):
        raise ValueError(f"{type(opt)} is an unsupported optimizer class. Please pass an instance of one of the "
                         "optimizer classes under tf.tpu.experimental.embedding or embedcore.optimizers.")
    if getattr(opt, "slot_variable_creation_fn", None) is not None:
        raise NotImplementedError(f"{type(opt).__name__}: slot_variable_creation_fn is not supported by embedcore, "
                                  "whose engine makes the slots (from the optimizer's initial_accumulator_value, "
                                  "Adam's at 0); set their values after building with Table.assign_slot")
    common = {}
    lr = opt.learning_rate
    common["learning_rate"] = _schedule(lr) if callable(lr) else float(lr)
    if opt.clip_weight_min is not None:
        common["clip_weight_min"] = float(opt.clip_weight_min)
    if opt.clip_weight_max is not None:
        common["clip_weight_max"] = float(opt.clip_weight_max)
    if opt.weight_decay_factor:
        common["weight_decay_factor"] = float(opt.weight_decay_factor)
        common["multiply_weight_decay_factor_by_learning_rate"] = bool(
            opt.multiply_weight_decay_factor_by_learning_rate)
    lo, hi = opt.clip_gradient_min, opt.clip_gradient_max
    if lo is not None or hi is not None:
        common["clipvalue"] = (-_FLOAT32_MAX if lo is None else float(lo), _FLOAT32_MAX if hi is None else float(hi))
    if type(opt) is _TF.SGD:
        return ec.optimizers.SGD(**common)
    if type(opt) is _TF.Adagrad:
        return ec.optimizers.Adagrad(initial_accumulator_value=opt.initial_accumulator_value, **common)
    if type(opt) is _TF.Adam:
        return ec.optimizers.Adam(beta_1=opt.beta_1, beta_2=opt.beta_2, epsilon=opt.epsilon,
                                  lazy_adam=bool(opt.lazy_adam), sum_inside_sqrt=bool(opt.sum_inside_sqrt),
                                  bias_correction=False, **common)
    if type(opt) is _TF.FTRL:
        return ec.optimizers.FTRL(learning_rate_power=opt.learning_rate_power,
                                  l1_regularization_strength=opt.l1_regularization_strength,
                                  l2_regularization_strength=opt.l2_regularization_strength, beta=opt.beta,
                                  initial_accumulator_value=opt.initial_accumulator_value,
                                  multiply_linear_by_learning_rate=bool(opt.multiply_linear_by_learning_rate),
                                  **common)
    raise NotImplementedError(f"embedcore has no {type(opt).__name__} optimizer (it has SGD, Adagrad, Adam and FTRL)")


class TfLearningRate:
    """TensorFlow's learning rate, a callable of no argument, as embedcore's
    ``lr(step)``. The Keras layer evaluates ``fn()`` in the training step,
    as TensorFlow ops before the update (as ``TPUEmbedding.apply_gradients``
    does), and hands the value to the update with :meth:`given`; anywhere
    else ``fn()`` is called when the rate is asked for."""

    def __init__(self, fn: Callable[[], Any]):
        self.fn = fn
        self.__qualname__ = getattr(fn, "__qualname__", "tf_learning_rate")  # a checkpoint's schedule name
        self._given = threading.local()  # this thread's update's value, from the step's graph

    def __call__(self, step: int) -> float:
        v = getattr(self._given, "value", None)
        if v is None:
            v = self.fn()
        return float(v.numpy() if hasattr(v, "numpy") else v)

    @contextlib.contextmanager
    def given(self, value: float):
        self._given.value = value
        try:
            yield
        finally:
            self._given.value = None

    def __deepcopy__(self, memo) -> "TfLearningRate":
        # A copy of an optimizer (or a TableConfig) holding it: the same callable, as deepcopy shared the
        # function before (a thread's given value is no state to copy).
        return TfLearningRate(self.fn)

    def __reduce__(self):
        return TfLearningRate, (self.fn,)

    def __repr__(self) -> str:
        return f"TfLearningRate({self.fn!r})"


_schedule = TfLearningRate


# ------------------------------------------------------------------ initializers
def _seeded(init) -> bool:
    """Whether a Keras / TensorFlow initializer was given a seed: an int, or
    a ``keras.random.SeedGenerator`` (whose values it reproduces too). Keras
    3 keeps the seed it was given in ``_init_seed``: its ``seed`` is a
    random one when none was given, which its config does not keep (so a
    rebuilt layer would start elsewhere)."""
    given = vars(init).get("_init_seed", getattr(init, "seed", None)) if hasattr(init, "__dict__") else \
        getattr(init, "seed", None)
    return given is not None


def initializer_from_tf(init, name: str, dim: int) -> Tuple[Optional[ec.initializers.Initializer], Optional[Callable]]:
    """(embedcore initializer, None) when the engine can draw the values
    itself, else (None, callable) to call for the whole table.

    Seeded TensorFlow initializers are called, so that the table starts
    with exactly the values TensorFlow would give it; unseeded random ones
    (whose values TensorFlow does not reproduce either) are drawn by the
    engine with a seed derived from the table name."""
    if init is None:
        return ec.initializers.TruncatedNormal(0.0, 1.0 / math.sqrt(dim), seed=_name_seed(name)), None
    if isinstance(init, ec.initializers.Initializer):
        return init, None
    cls = type(init).__name__
    if cls == "Zeros":
        return ec.initializers.Zeros(), None
    if cls == "Ones":
        return ec.initializers.Constant(1.0), None
    if cls == "Constant" and np.ndim(getattr(init, "value", None)) == 0:
        return ec.initializers.Constant(float(init.value)), None
    if not _seeded(init) and hasattr(init, "seed"):
        seed = _name_seed(name)
        if cls == "TruncatedNormal" and hasattr(init, "stddev"):
            return ec.initializers.TruncatedNormal(float(init.mean), float(init.stddev), seed=seed), None
        if cls == "RandomNormal" and hasattr(init, "stddev"):
            return ec.initializers.Normal(float(init.mean), float(init.stddev), seed=seed), None
        if cls == "RandomUniform" and hasattr(init, "minval"):
            return ec.initializers.Uniform(float(init.minval), float(init.maxval), seed=seed), None
    if not callable(init):
        raise ValueError(f"table '{name}': initializer must be callable, got {init!r}")
    return None, init


def _name_seed(name: str) -> int:
    return zlib.crc32(name.encode()) & 0x7FFFFFFF


# ------------------------------------------------------------------ tables and features
class TableSpec:
    """One table as the adapter sees it: the user's config object (the key
    of ``embedding_tables``), its resolved name, shape, combiner and
    optimizer."""

    def __init__(self, config, name: str, rows: int, dim: int, combiner: str, optimizer, initializer, init_fn,
                 is_tf: bool, tf_optimizer=None):
        self.config = config
        self.name = name
        self.rows = rows
        self.dim = dim
        self.combiner = combiner
        self.optimizer = optimizer  # embedcore's, or None
        self.initializer = initializer  # embedcore's, or None when init_fn is set
        self.init_fn = init_fn
        self.is_tf = is_tf
        self.tf_optimizer = tf_optimizer

    def make_table(self) -> ec.Table:
        cfg = ec.TableConfig(self.name, self.rows, self.dim, "float32",
                             self.initializer or ec.initializers.Zeros(), self.optimizer, self.combiner)
        table = ec.Table(cfg)
        if self.init_fn is not None:
            table.assign(self._initial_values())
            table._reset_with = self._initial_values  # (reset_values: the callable's values again, not zeros)
        return table

    def _initial_values(self) -> np.ndarray:
        """The values of `init_fn` for the whole table. Eagerly, also when
        the table is first built inside a traced function (a subclassed
        Keras model's first model.fit step, a first call inside
        tf.function): there the initializer's output would be a symbolic
        tensor, which has no values to copy into the table."""
        with tf.init_scope(), contextlib.ExitStack() as scope:
            if not tf.executing_eagerly():  # a TF1-style graph (tf.Graph().as_default()): no eager outside it
                scope.enter_context(context.eager_mode())
            value = self.init_fn((self.rows, self.dim), dtype=tf.float32)
        return np.asarray(value.numpy() if hasattr(value, "numpy") else value, dtype=np.float32)

    def __repr__(self) -> str:
        return f"TableSpec({self.name!r}, {self.rows}x{self.dim}, combiner={self.combiner!r})"


class Feature:
    """One feature: its path in the feature config (``tf.nest``'s joined
    string path), table, and TensorFlow's per-feature options."""

    def __init__(self, path: str, table: TableSpec, max_sequence_length: int, validate: bool,
                 output_shape: Optional[Tuple[Optional[int], ...]], name: Optional[str]):
        self.path = path
        self.table = table
        self.max_sequence_length = max_sequence_length
        self.validate = validate
        self.output_shape = output_shape  # None when not set
        self.name = name

    @property
    def label(self) -> str:
        return self.path


def _is_tf_feature(f) -> bool:
    return isinstance(f, _TF.FeatureConfig)


def _is_ec_feature(f) -> bool:
    return isinstance(f, ec.FeatureConfig)


def features_of(feature_config, optimizer, owner: str) -> Tuple[List[Feature], List[TableSpec]]:
    """The features of a nested feature config, in ``tf.nest`` order, and
    their tables in order of first use.

    As TensorFlow's ``TPUEmbeddingBase`` does, an unnamed TensorFlow
    ``TableConfig`` is named ``table_<i>`` (its index in that order) and one
    without an optimizer gets `optimizer`, on the config object itself.
    embedcore's configs are not changed (embedcore's ``Embedding`` does not
    change them either)."""
    flat = nest.flatten_with_joined_string_paths(feature_config)
    if not flat:
        raise ValueError(f"{owner}: feature_config holds no FeatureConfig")
    for path, f in flat:
        if not (_is_tf_feature(f) or _is_ec_feature(f)):
            raise ValueError(f"{owner}: feature_config at {path or 'the top level'} must be a "
                             f"tf.tpu.experimental.embedding.FeatureConfig or embedcore.FeatureConfig, got {f!r}")
    configs: List[Any] = []
    for _, f in flat:
        if not any(f.table is c for c in configs):
            configs.append(f.table)
    if optimizer is not None and not isinstance(optimizer, (ec.optimizers.Optimizer, _TfOptimizer)):
        raise ValueError(f"{type(optimizer)} is an unsupported optimizer class. Please pass an instance of one of "
                         "the optimizer classes under tf.tpu.experimental.embedding or embedcore.optimizers.")
    specs: Dict[int, TableSpec] = {}
    names: List[str] = []
    for i, cfg in enumerate(configs):
        if isinstance(cfg, _TF.TableConfig):
            if cfg.optimizer is None and not isinstance(optimizer, ec.optimizers.Optimizer):
                cfg.optimizer = optimizer  # TensorFlow sets it on the config, so do we
            if cfg.name is None:
                cfg.name = f"table_{i}"
            if not isinstance(cfg.combiner, str):
                raise NotImplementedError(f"table '{cfg.name}': custom combiners are not supported by embedcore")
            if cfg.dtype != tf.float32:
                raise NotImplementedError(f"table '{cfg.name}': only float32 tables are supported, got {cfg.dtype}")
            opt = _table_optimizer(cfg.optimizer if cfg.optimizer is not None else optimizer, cfg.name)
            init, init_fn = initializer_from_tf(cfg.initializer, cfg.name, cfg.dim)
            spec = TableSpec(cfg, cfg.name, int(cfg.vocabulary_size), int(cfg.dim), cfg.combiner, opt, init, init_fn,
                             True, cfg.optimizer)
        else:
            name = cfg.name if cfg.name is not None else f"table_{i}"
            opt = cfg.optimizer if cfg.optimizer is not None else _table_optimizer(optimizer, name)
            spec = TableSpec(cfg, name, cfg.rows, cfg.dim, cfg.combiner, opt, cfg.initializer, None, False)
            if cfg.dtype != "float32":
                raise NotImplementedError(f"table '{name}': the TensorFlow adapter serves float32 tables only, "
                                          f"got {cfg.dtype}")
        if spec.name in names:
            raise ValueError(f"Tables must have a unique name. Multiple tables with name {spec.name} found.")
        names.append(spec.name)
        specs[id(cfg)] = spec
    from ._checkpoint import SLOT_NAMES

    for name in names:  # the adapter's checkpoints key a table's slot "<table>/<slot>": one key for two variables
        base, sep, slot = name.rpartition("/")
        if sep and slot in SLOT_NAMES and base in names:
            raise ValueError(f"table '{name}' is named as table '{base}''s {slot} slot, which checkpoints of the "
                             f"adapter (tf.train.Checkpoint) key '{name}': one of them would be lost; rename one "
                             "of the tables")
    features = []
    for path, f in flat:
        spec = specs[id(f.table)]
        if _is_tf_feature(f):
            shape = f.output_shape
            # Unknown sizes stay None: TensorFlow ignores output_shape for dense and sparse input and
            # refuses a partly known one for ragged input (_lookup._ragged).
            out = tuple(None if d is None else int(d) for d in shape.as_list()) if shape.rank is not None else None
            features.append(Feature(path, spec, int(f.max_sequence_length), bool(f.validate_weights_and_indices),
                                    out, f.name))
        else:
            features.append(Feature(path, spec, int(f.max_sequence_length), True, None, f.name))
    return features, [specs[id(c)] for c in configs]


_warned: set = set()


def _table_optimizer(tf_opt, name: str):
    try:
        return optimizer_from_tf(tf_opt)
    except NotImplementedError as e:
        key = (name, type(tf_opt).__name__)
        if key not in _warned:
            _warned.add(key)
            warnings.warn(f"{e}; table '{name}' is created without an optimizer: it serves and restores its "
                          "values, but not this optimizer's slots, and cannot train", stacklevel=4)
        return None
