"""``embedcore.Embedding``: a collection of tables looked up by named
features, shaped like TensorFlow's ``TPUEmbedding``."""
from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Dict, List, Optional

from . import _device, _embedcore, _nest
from . import optimizers as _opt
from ._inputs import Batch, in_callers_terms, make_batch
from .config import FeatureConfig, TableConfig, _check_utf8
from .table import Table, apply_gradients_many

__all__ = ["Embedding"]


class FeatureLookup:
    """Looks up a nested structure of features; the base of ``Embedding`` and
    of a served checkpoint. Subclasses set ``_feature_config``, ``_features``,
    ``_feature_names`` and implement ``_table(feature)``."""

    def _wheres(self, kind: str) -> List[str]:
        """Each feature's input (`kind`: "features", "grads") as errors name
        it: by its path in the structure the caller passes
        (``features['user/clicks']``), and by its name too where that differs
        (a FeatureConfig's ``name=``: ``features['slot_a'] (feature
        'clicks')``); a lone top-level feature, and the features of a
        top-level list or tuple (positions, not keys), by their names."""
        cached = self.__dict__.get("_wheres_of")
        if cached is None or cached[0] is not self._feature_config:
            keyed = isinstance(self._feature_config, Mapping)
            paths = [path if keyed else "" for path, _ in _nest.flatten_with_paths(self._feature_config)]
            cached = (self._feature_config, {})
            for path, name in zip(paths, self._feature_names):
                for k in ("features", "grads"):
                    cached[1].setdefault(k, []).append(f"{k}[{(path or name)!r}]" +
                                                       (f" (feature {name!r})" if path and path != name else ""))
            self.__dict__["_wheres_of"] = cached
        return cached[1][kind]

    def _combiner(self, f: FeatureConfig) -> Optional[str]:
        return None if f.max_sequence_length > 0 else f.table.combiner

    def __call__(self, features, weights=None):
        return self.lookup(features, weights)

    def lookup(self, features, weights=None):
        flat_inputs = _nest.flatten_up_to(self._feature_config, features, "features")
        flat_weights = ([None] * len(flat_inputs) if weights is None
                        else _nest.flatten_up_to(self._feature_config, weights, "weights"))
        if getattr(self, "_device", -1) >= 0:
            return _nest.pack_like(self._feature_config, features, self._cuda_lookup(flat_inputs, flat_weights))
        batches: List[Batch] = []
        for where, x, w in zip(self._wheres("features"), flat_inputs, flat_weights):
            batches.append(make_batch(x, None, w, where=where))
        outputs = []
        for where, f, b in zip(self._wheres("features"), self._features, batches):
            # The engine's errors (a bad id, bad offsets) name the feature: features may share a table.
            try:
                outputs.append(self._table(f)._lookup_batch(b, self._combiner(f), f.max_sequence_length))
            except (IndexError, ValueError) as e:
                raise in_callers_terms(e, b, where) from None
        # Kept for apply_gradients, as copies: the caller may reuse its id buffers before the step.
        # A lookup that cannot train keeps nothing (a served request's ids are freed with it).
        self._last = [b.owned() for b in batches] if self._trains else None
        return _nest.pack_like(self._feature_config, features, outputs)  # (the caller's types, as TensorFlow's)

    def embedding_lookup(self, features, weights=None):
        """``lookup``, by TensorFlow's name for it (``TPUEmbedding.embedding_lookup``)."""
        return self.lookup(features, weights)  # (a subclass's own lookup, with its checks)


def check_sharding_without_world(sharding, owner: str) -> None:
    """A ``sharding=`` other than the default given without ``world=``
    shards nothing: TypeError (it was taken and ignored, a misspelt plan
    too)."""
    if not (sharding is None or (isinstance(sharding, str) and sharding == "auto")):  # (None: make_plan's auto)
        raise TypeError(f"{owner}: sharding={sharding!r} applies over ranks: pass world= too (an "
                        "embedcore.distributed Comm), or leave sharding out")


class Embedding(FeatureLookup):
    """Tables and the features that read them.

    feature_config: a nested dict / list / tuple of ``FeatureConfig``; several
        features may share a ``TableConfig``. A feature's name (a checkpoint
        records it, and the C API finds features by it) is its FeatureConfig's
        ``name``, else its path in the structure (``"user/clicks"``); the
        paths where two features would share a name. Errors name a feature's
        input by its path in a dict (``features['slot_a'] (feature
        'clicks')``), by its name in a top-level list.
    optimizer: the optimizer of every table whose config has none.

    ``emb(features, weights=None)`` looks up every feature (the same nested
    structure of inputs, each in any form ``Table.lookup`` takes) and returns
    the outputs in that structure, as the caller gave it (a namedtuple, an
    OrderedDict or a defaultdict stays one, as ``tf.nest.pack_sequence_as``
    packs TensorFlow's outputs; a served checkpoint's call too):
    ``[batch, dim]`` for pooled features and
    ``[batch, max_sequence_length, dim]`` for sequence features.
    ``emb.apply_gradients(grads)`` takes the gradients of the last outputs, in
    their structure, and applies one optimizer step per table, the gradients
    of all features that share a table summed together. Everything is checked
    before any table changes (gradients that view a table the step updates
    are refused: pass a copy). "Last" is the embedding's last lookup from any
    thread, as ``TPUEmbedding``'s (a framework may run the lookup and the
    step on different threads: ``tf.numpy_function``, PyTorch's backward): a
    lookup that must not be stepped, such as an evaluation from another
    thread while this one trains, goes through the tables themselves
    (``emb.embedding_tables[config].lookup(...)``) or a served checkpoint.

    ``world=`` (a communicator from ``embedcore.distributed``) and
    ``sharding=`` ("table_wise", "row_wise", "column_wise", "auto", or a dict
    of them by table name) make a sharded embedding: every rank builds it with
    the same arguments, holds its shards of the tables, and calls it with its
    own part of the batch (see ``embedcore.distributed``).

    ``device="cuda:N"`` (the CUDA build) keeps every table in GPU memory; its
    inputs, outputs and gradients are then CUDA tensors (PyTorch or CuPy).
    With ``world=``, it keeps this rank's shards there, and the inputs,
    outputs and gradients stay host arrays (the sharded algorithm routes ids
    on the host).
    """

    def __new__(cls, feature_config=None, optimizer=None, *, world=None, sharding="auto", device=None):
        if cls is Embedding and world is not None:
            from .distributed._embedding import ShardedEmbedding

            return super().__new__(ShardedEmbedding)
        return super().__new__(cls)

    def __init__(self, feature_config, optimizer: Optional[_opt.Optimizer] = None, *, world=None, sharding="auto",
                 device=None):
        if world is not None:
            raise TypeError("Embedding: world= makes a sharded embedding (embedcore.distributed)")
        check_sharding_without_world(sharding, "Embedding")
        self._device = _device.parse_device(device, "Embedding")
        if optimizer is not None and not isinstance(optimizer, _opt.Optimizer):
            raise TypeError(f"Embedding: optimizer must be an embedcore.optimizers.Optimizer, got {optimizer!r}")
        flat = _nest.flatten_with_paths(feature_config)
        if not flat:
            raise ValueError("Embedding: feature_config holds no FeatureConfig")
        for path, f in flat:
            if not isinstance(f, FeatureConfig):
                raise TypeError(f"Embedding: feature_config at {path or 'the top level'} must be a FeatureConfig, "
                                f"got {f!r}")
        self._feature_config = feature_config
        self._features: List[FeatureConfig] = [f for _, f in flat]
        # A feature's name (the checkpoint's, which the C API finds features by): its FeatureConfig's name, else its
        # path in the structure; the paths alone where two features would share a name (one FeatureConfig at two
        # places, or a name= equal to another feature's name or path), as the TensorFlow adapter's layer names them.
        names = [f.name or path or f"feature_{i}" for i, (path, f) in enumerate(flat)]
        if len(set(names)) < len(names):
            names = [path or f"feature_{i}" for i, (path, _) in enumerate(flat)]
            twice = sorted({n for n in names if names.count(n) > 1})
            if twice:  # ('a/b' is both the key "a/b" and the key "b" under "a")
                raise ValueError(f"Embedding: two features have the path {twice[0]!r} (a key with '/' in it names "
                                 "the same path as nested keys), and their names are not unique either: rename a "
                                 "key, or give the features unique FeatureConfig names, so that each name (the "
                                 "checkpoint's, which serving and the C API find features by) is one feature")
        self._feature_names = names
        for name in self._feature_names:  # a name from the structure's keys, as a FeatureConfig's name is checked
            _check_utf8(f"Embedding: feature {name!r}", name)
        self._optimizer = optimizer

        # Tables in order of first use; unnamed ones become table_<i>, as TensorFlow names them.
        configs: List[TableConfig] = list({id(f.table): f.table for f in self._features}.values())
        self._effective: Dict[TableConfig, TableConfig] = {}  # with names and the optimizer filled in
        names = set()
        for i, cfg in enumerate(configs):
            name = cfg.name if cfg.name is not None else f"table_{i}"
            if name in names:
                raise ValueError(f"Embedding: two tables are named {name!r}; table names must be unique")
            names.add(name)
            # (an unnamed table's default initializer is seeded by the name it gets here)
            init = None if cfg.name is None and getattr(cfg, "_default_initializer", False) else cfg.initializer
            self._effective[cfg] = TableConfig(name, cfg.rows, cfg.dim, cfg.dtype, init,
                                               cfg.optimizer if cfg.optimizer is not None else optimizer, cfg.combiner)
        self._build_tables()
        self._last = None  # (batches) of the last lookup, for apply_gradients

    def _build_tables(self) -> None:
        device = None if getattr(self, "_device", -1) < 0 else f"cuda:{self._device}"
        self._tables: Dict[TableConfig, Table] = {cfg: Table(eff, device=device)
                                                  for cfg, eff in self._effective.items()}

    def _cuda_lookup(self, flat_inputs, flat_weights):
        """Every feature's lookup on the GPU (CUDA tensors in and out)."""
        outputs, parts, trains = [], [], self._trains
        for where, f, x, w in zip(self._wheres("features"), self._features, flat_inputs, flat_weights):
            table = self._tables[f.table]
            ids, offsets, weights, ref, _ = _device.cuda_batch(table._device, x, None, w, where=where)
            combiner = self._combiner(f)
            length = 0 if combiner is not None else f.max_sequence_length
            try:  # normalised once: flat ids with offsets (no width, as a second cuda_batch would find)
                outputs.append(table._cuda_lookup_batch((ids, offsets, weights, ref, None), combiner, length))
            except (IndexError, ValueError) as e:
                raise in_callers_terms(e, where=where) from None
            if trains:  # copies, as the host lookups keep: the caller may refill its id buffers before the step
                parts.append((_device.owned(ids), _device.owned(offsets), _device.owned(weights), combiner, length))
        self._last = parts if trains else None
        return outputs  # (flat: lookup packs them)

    @property
    def _trains(self) -> bool:
        """Whether a lookup keeps its batches for apply_gradients: whether a
        table has an optimizer (``Table.set_optimizer`` may give one later)."""
        return any(t.optimizer is not None for t in self._tables.values())

    @property
    def embedding_tables(self) -> Dict[TableConfig, Table]:
        """Each TableConfig of the feature config, mapped to its Table."""
        return dict(self._tables)

    @property
    def feature_config(self):
        """The feature config as given (a FeatureConfig, or a nested structure of them)."""
        return self._feature_config

    @property
    def optimizer(self) -> Optional[_opt.Optimizer]:
        """The optimizer given for tables without their own (None: none)."""
        return self._optimizer

    def __repr__(self) -> str:
        tables = [cfg.name for cfg in self._effective.values()]
        extra = getattr(self, "_repr_extra", lambda: "")()
        return (f"{type(self).__name__}(features={self._feature_names}, tables={tables}, "
                f"optimizer={self._optimizer!r}{extra})")

    def _table(self, f: FeatureConfig) -> Table:
        return self._tables[f.table]

    def apply_gradients(self, grads) -> None:
        """One optimizer step per table from the gradients of the last lookup."""
        if self._last is None:
            if not self._trains:
                raise ValueError("Embedding.apply_gradients: no table has an optimizer (give the TableConfigs or "
                                 "the Embedding one)")
            raise ValueError("Embedding.apply_gradients: call the embedding on a batch first")
        flat_grads = _nest.flatten_up_to(self._feature_config, grads, "grads")
        if self._device >= 0:
            cuda_parts: Dict[TableConfig, list] = {}
            for name, f, (ids, offsets, weights, combiner, length), g in zip(
                    self._wheres("grads"), self._features, self._last, flat_grads):
                table = self._table(f)
                if table.optimizer is None:
                    raise ValueError(f"Embedding.apply_gradients: table '{table.name}' has no optimizer")
                cuda_parts.setdefault(f.table, []).append(
                    table._cuda_part_batch((ids, offsets, weights, ids, None), combiner, length, g))
            for cfg in cuda_parts:  # a rate no table can take (a schedule's), or a table at the last step a
                self._tables[cfg].learning_rate()  # checkpoint records, is refused before any table steps
                self._tables[cfg]._check_step_can_grow()
            for cfg, table_parts in cuda_parts.items():
                self._tables[cfg]._cuda_apply(table_parts)  # (reads the rate again, under the table's step lock)
            return
        parts: Dict[TableConfig, list] = {}
        names: Dict[TableConfig, list] = {}
        for where, f, b, g in zip(self._wheres("grads"), self._features, self._last, flat_grads):
            table = self._table(f)
            if table.optimizer is None:
                raise ValueError(f"Embedding.apply_gradients: table '{table.name}' has no optimizer "
                                 "(give its TableConfig or the Embedding one)")
            part = table._gradient_part(b, self._combiner(f), f.max_sequence_length, g, where=where)
            parts.setdefault(f.table, []).append(part)
            names.setdefault(f.table, []).append(where)
        # Every check above, then every table's (apply_gradients_many), before any table changes.
        apply_gradients_many([(self._tables[cfg], table_parts, names[cfg]) for cfg, table_parts in parts.items()])


# help() / inspect.signature show __init__'s parameters (feature_config required), not those of the __new__ that
# picks the sharded class; set on __new__, so that instances keep their own (__call__'s).
Embedding.__new__.__signature__ = inspect.signature(Embedding.__init__)
