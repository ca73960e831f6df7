"""``EmbeddingBagCollection`` and ``EmbeddingCollection``: several tables and
the features that read them, shaped like TorchRec's modules of those names.

Each table is a child module (``embedding_bags.<table>`` /
``embeddings.<table>``: an adapter ``EmbeddingBag`` / ``Embedding``), so the
state dict keys are TorchRec's and a TorchRec state dict loads as is. Every
feature of a table is looked up with the others of that table, so a fused
optimizer applies exactly one update per table and step; a KeyedJaggedTensor
is looked up, and trained fused, by one engine call for all the tables
(``_ops.collection_lookup``) where that applies, else by one op per table;
an ``EmbeddingCollection``'s KJT rows come from one pass over the tables
(``_ops.collection_rows``) where no autograd is recorded.
"""
from __future__ import annotations

import functools
import inspect
import math
import numbers
import sys
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import Tensor, nn

import embedcore as ec
from embedcore import _embedcore
from embedcore.embedding import check_sharding_without_world

from . import _ops
from ._modules import (_MODES, Embedding, EmbeddingBag, _AdapterModule, _TableModule, _table_device, _torch_seed,
                       _check_strided, check_ids, check_weights, refuse_fx_proxy)

__all__ = ["EmbeddingBagConfig", "EmbeddingConfig", "EmbeddingBagCollection", "EmbeddingCollection"]


@dataclass
class EmbeddingConfig:
    """One table of an ``EmbeddingCollection`` (TorchRec's fields, plus
    embedcore's ``dtype``, ``initializer`` and ``optimizer``; pass the fields
    after ``name`` by keyword: their order is not TorchRec's).

    init: ``initializer`` (an ``embedcore.initializers`` initializer), else
    ``init_fn(weight)`` (a PyTorch in-place init), else uniform in
    ``[weight_init_min, weight_init_max]`` (default ``+-sqrt(1 / rows)``, as
    TorchRec) seeded from PyTorch's generator. ``optimizer`` overrides the
    collection's for this table. ``data_type`` (TorchRec's ``DataType``: FP32,
    FP16, BF16) sets the storage dtype when given, instead of ``dtype``
    (None: ``dtype``'s). ``init_fn`` not given is made TorchRec's default,
    ``partial(torch.nn.init.uniform_, a=weight_init_min, b=weight_init_max)``
    (the collections then draw those bounds in the engine, as before), so
    that code reading a config back finds a callable, as in TorchRec's.
    ``need_pos`` and TorchRec's other fields (``num_embeddings_post_pruning``,
    ``input_dim``, ``total_num_buckets``, ``use_virtual_table``, ...) are
    recorded, and not read, as by TorchRec's unsharded collections."""

    num_embeddings: int
    embedding_dim: int
    name: str = ""
    feature_names: List[str] = field(default_factory=list)
    dtype: Any = "float32"
    weight_init_min: Optional[float] = None
    weight_init_max: Optional[float] = None
    init_fn: Optional[Callable[[Tensor], Any]] = None
    initializer: Optional[ec.initializers.Initializer] = None
    optimizer: Optional[ec.optimizers.Optimizer] = None
    data_type: Any = None
    need_pos: bool = False
    num_embeddings_post_pruning: Optional[int] = None
    input_dim: Optional[int] = None
    total_num_buckets: Optional[int] = None
    use_virtual_table: bool = False
    virtual_table_eviction_policy: Any = None
    enable_embedding_update: bool = False
    stash_weights: bool = False

    def __post_init__(self) -> None:
        if self.init_fn is None:  # TorchRec's default, marked as such: drawn by the engine
            self.init_fn = _DefaultInit(torch.nn.init.uniform_, a=self.get_weight_init_min(),
                                        b=self.get_weight_init_max())

    def num_features(self) -> int:
        return len(self.feature_names)

    def get_weight_init_min(self) -> float:
        return -math.sqrt(1.0 / self.num_embeddings) if self.weight_init_min is None else self.weight_init_min

    def get_weight_init_max(self) -> float:
        return math.sqrt(1.0 / self.num_embeddings) if self.weight_init_max is None else self.weight_init_max


@dataclass
class EmbeddingBagConfig(EmbeddingConfig):
    """One table of an ``EmbeddingBagCollection``: ``EmbeddingConfig`` plus
    ``pooling`` ("sum", "mean", "sqrtn", or TorchRec's ``PoolingType``)."""

    pooling: Any = "sum"


# ------------------------------------------------------------------ configs
_TORCHREC_DTYPES = {"FP32": "float32", "FP16": "float16", "BF16": "bfloat16"}


class _DefaultInit(functools.partial):
    """The ``init_fn`` a config of this module gets when given none
    (TorchRec's ``partial(uniform_, a=.., b=..)``): the collections draw it
    in the engine (``ec.initializers.Uniform`` in the same bounds, seeded
    from PyTorch's generator), as they drew configs without one before."""


def _config_int(value, where: str) -> int:
    """A config's size as an int: Python's or NumPy's integers (not bool);
    TypeError otherwise (10.7 became 10, True 1)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{where} must be an int, got {value!r}")
    return int(value)


class _Spec:
    """A table config, ours or TorchRec's, normalised. Without `build` (a
    served table: its checkpoint has the values and their dtype), the dtype
    and initial values are not read (and PyTorch's generator not drawn)."""

    def __init__(self, cfg, pooled: bool, owner: str, build: bool = True):
        for attr in ("num_embeddings", "embedding_dim", "name"):
            if not hasattr(cfg, attr):
                raise TypeError(f"{owner}: tables must be EmbeddingBagConfig / EmbeddingConfig (embedcore's or "
                                f"TorchRec's), got {cfg!r}")
        if not cfg.name:
            raise ValueError(f"{owner}: every table needs a name, got {cfg!r}")
        self.config = cfg  # as given: what embedding_bag_configs() / embedding_configs() return, as TorchRec's
        self.name = cfg.name
        self.rows = _config_int(cfg.num_embeddings, f"{owner}: table '{cfg.name}' num_embeddings")
        self.dim = _config_int(cfg.embedding_dim, f"{owner}: table '{cfg.name}' embedding_dim")
        names = getattr(cfg, "feature_names", None)
        if isinstance(names, str):  # (list("user") is four features, u, s, e, r)
            raise TypeError(f"{owner}: table '{cfg.name}' feature_names must be a list of names, got {names!r} "
                            f"(feature_names=[{names!r}])")
        self.features = list(names or [cfg.name])
        if not getattr(cfg, "feature_names", None):
            try:  # as TorchRec's collections do: the config then names the feature its output is keyed by
                cfg.feature_names = [cfg.name]
            except AttributeError:  # (a frozen config)
                pass
        self.pooling = None
        if pooled:
            p = getattr(cfg, "pooling", "sum")
            p = str(getattr(p, "value", p)).lower()
            if p not in _MODES:
                raise ValueError(f"{owner}: table '{self.name}' has pooling {p!r}; use sum, mean or sqrtn "
                                 "(unpooled tables belong in an EmbeddingCollection)")
            self.pooling = p
        self.dtype = self.initializer = self.init_fn = self.optimizer = None
        if build:
            self._build_options(cfg, owner)

    def _build_options(self, cfg, owner: str) -> None:
        if getattr(cfg, "data_type", None) is not None:  # TorchRec's DataType
            v = getattr(cfg.data_type, "value", cfg.data_type)
            if v not in _TORCHREC_DTYPES:
                raise ValueError(f"{owner}: table '{self.name}' has data_type {cfg.data_type}; embedcore tables are "
                                 "FP32, FP16 or BF16")
            self.dtype = _TORCHREC_DTYPES[v]
        else:
            self.dtype = getattr(cfg, "dtype", "float32")
        self.initializer = getattr(cfg, "initializer", None)
        self.init_fn = None
        if self.initializer is None:
            self.init_fn = getattr(cfg, "init_fn", None)
            if self.init_fn is None or isinstance(self.init_fn, _DefaultInit):
                self.init_fn = None
                bound = math.sqrt(1.0 / self.rows)
                lo = cfg.weight_init_min if getattr(cfg, "weight_init_min", None) is not None else -bound
                hi = cfg.weight_init_max if getattr(cfg, "weight_init_max", None) is not None else bound
                self.initializer = ec.initializers.Uniform(lo, hi, seed=_torch_seed())
        self.optimizer = getattr(cfg, "optimizer", None)


def _uniform_of(init_fn) -> Optional[ec.initializers.Initializer]:
    """The engine's Uniform for an init_fn that is ``partial(torch.nn.init.uniform_, a=.., b=..)``
    (what TorchRec's configs put there when no init_fn is given), else None."""
    if not (isinstance(init_fn, functools.partial) and init_fn.func is torch.nn.init.uniform_ and not init_fn.args
            and set(init_fn.keywords) <= {"a", "b"}):
        return None
    return ec.initializers.Uniform(float(init_fn.keywords.get("a", 0.0)), float(init_fn.keywords.get("b", 1.0)),
                                   seed=_torch_seed())


def _check_optimizer_argument(optimizer, owner: str, torchrec_second: str) -> None:
    """A TypeError for an `optimizer` that is TorchRec's second positional argument (the collections take
    `optimizer` second, TorchRec's `is_weighted` / `device`)."""
    if optimizer is None or isinstance(optimizer, ec.optimizers.Optimizer):
        return
    raise TypeError(f"{owner}: the second argument is optimizer= (an embedcore.optimizers optimizer or None), got "
                    f"{optimizer!r}; TorchRec's second argument is {torchrec_second}: pass it by keyword "
                    f"({torchrec_second}=...)")


def _specs(tables, pooled: bool, owner: str, build: bool = True) -> List[_Spec]:
    specs = [_Spec(c, pooled, owner, build) for c in tables]
    if not specs:
        raise ValueError(f"{owner}: no tables given")
    names = [s.name for s in specs]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise ValueError(f"{owner}: duplicate table names {sorted(dup)}")
    return specs


def _embedding_names(specs: List[_Spec]) -> List[List[str]]:
    """Output names by table, as TorchRec's: the feature name, or
    ``feature@table`` for a feature that several tables read."""
    count: Dict[str, int] = {}
    for s in specs:
        for f in s.features:
            count[f] = count.get(f, 0) + 1
    return [[f if count[f] == 1 else f"{f}@{s.name}" for f in s.features] for s in specs]


# ------------------------------------------------------------------ inputs
def _jagged_module():
    """TorchRec's jagged-tensor module when TorchRec has been imported."""
    return sys.modules.get("torchrec.sparse.jagged_tensor")


def _is_kjt(x) -> bool:
    jt = _jagged_module()
    return jt is not None and isinstance(x, jt.KeyedJaggedTensor)


def _csr(x, where: str) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    """One pooled feature as (values, offsets with batch + 1 entries, weights)."""
    weights = lengths = None
    jt = _jagged_module()
    if isinstance(x, Tensor):
        check_ids(x, where)
        if x.dim() == 2:
            batch, length = x.shape
            values = x.reshape(-1)
            offsets = (torch.arange(0, batch * length + 1, length, dtype=torch.int64, device=x.device) if length
                       else torch.zeros(batch + 1, dtype=torch.int64, device=x.device))
        elif x.dim() == 1:
            values, offsets = x, torch.arange(x.shape[0] + 1, dtype=torch.int64, device=x.device)  # one id per bag
        else:
            raise ValueError(f"{where} must be 1-D (one id per bag) or 2-D (one bag per row), got {x.dim()}-D")
    elif jt is not None and isinstance(x, jt.JaggedTensor):
        values, offsets, weights = x.values(), _jagged_offsets(x, where), x.weights_or_none()
        lengths = x.lengths_or_none() if x.offsets_or_none() is None else None  # (checked as lengths, below)
    elif isinstance(x, dict):
        unknown = set(x) - {"values", "offsets", "lengths", "weights"}
        if unknown or "values" not in x or ("offsets" in x) == ("lengths" in x):
            raise ValueError(f"{where} must be a dict with 'values', one of 'offsets' / 'lengths', and optional "
                             f"'weights', got keys {sorted(x)}")
        values, weights = x["values"], x.get("weights")
        if "offsets" in x:
            offsets = x["offsets"]
        else:
            lengths = x["lengths"]
            check_ids(lengths, f"{where}['lengths']")
            if lengths.dim() != 1:
                raise ValueError(f"{where}['lengths'] must be 1-D (one length per bag), got shape "
                                 f"{tuple(lengths.shape)}")
            offsets = _offsets_of_lengths(lengths)
    elif isinstance(x, ec.Ragged):
        values, offsets = x.values, x.offsets
    elif isinstance(x, (tuple, list)) and len(x) in (2, 3):
        values, offsets = x[0], x[1]
        weights = x[2] if len(x) == 3 else None
    else:
        raise TypeError(f"{where} must be an id tensor, (values, offsets[, weights]), a dict of values / offsets "
                        f"or lengths / weights, ec.Ragged or a TorchRec JaggedTensor, got {type(x).__name__}")
    check_ids(values, f"{where} values")
    check_ids(offsets, f"{where} offsets")
    if values.dim() != 1 or offsets.dim() != 1:
        raise ValueError(f"{where}: values and offsets must be 1-D, got {values.dim()}-D and {offsets.dim()}-D")
    if offsets.shape[0] < 1:
        raise ValueError(f"{where}: offsets must hold batch + 1 values, got none")
    if weights is not None:
        check_weights(weights, values, f"{where} weights")
    # The data's checks (the lookup's errors would not name the feature), at run time under torch.compile too;
    # none for a tensor of ids, whose offsets are made here.
    if not isinstance(x, Tensor):
        try:
            values = _ops.checked_values(values, offsets if lengths is None else lengths, where, lengths is not None)
        except ValueError:
            # A JaggedTensor's offsets that TorchRec made from its int32 lengths (x.offsets() keeps them) wrap
            # around past 2**31: the lengths are named (looked at only then).
            given = x.lengths_or_none() if jt is not None and isinstance(x, jt.JaggedTensor) else None
            if lengths is None and given is not None and _ops.plain_eager([given]):
                _ops.checked_values(values, given, where, True)
            raise
    return values, offsets, weights


def _sequence_ids(features: dict, f: str, table: str, owner: str = "EmbeddingCollection") -> Tuple[Tensor, tuple]:
    """The ids of feature `f` (of `table`) for an EmbeddingCollection, flat,
    and the shape its output takes before the embedding dimension: the ids'
    own shape for a tensor, (nnz,) for a jagged input."""
    if f not in features:
        raise KeyError(f"{owner}: feature {f!r} of table '{table}' is missing from the input (it holds "
                       f"{sorted(features)})")
    x = features[f]
    if isinstance(x, Tensor):
        check_ids(x, f"features[{f!r}]")
        return x.reshape(-1), tuple(x.shape)
    v, _, _ = _csr(x, f"features[{f!r}]")  # (the offsets shape no output here, but _csr checked them)
    return v, (v.shape[0],)


def _jagged_offsets(x, where: str) -> Tensor:
    """The offsets of a KJT or JaggedTensor `x`: its own when it holds them,
    else made here from its lengths, in int64 (TorchRec's ``x.offsets()``
    sums int32 lengths in int32, which wraps around past 2**31, and has no
    kernel for int8, int16 or uint8 lengths, which TorchRec's collections
    take); lengths of another dtype raise ``TypeError`` naming it."""
    lengths = x.lengths_or_none() if x.offsets_or_none() is None else None
    if not isinstance(lengths, Tensor):
        return x.offsets()
    _check_strided(lengths, f"{where} lengths")
    if lengths.dtype not in (torch.int32, torch.int64, torch.int8, torch.int16, torch.uint8):
        raise TypeError(f"{where} lengths must be an int32 or int64 tensor (or int8, int16, uint8), got "
                        f"{lengths.dtype}")
    if lengths.dim() != 1:
        raise ValueError(f"{where} lengths must be 1-D (one length per bag), got shape {tuple(lengths.shape)}")
    return _offsets_of_lengths(lengths)


def _offsets_of_lengths(lengths: Tensor) -> Tensor:
    """The int64 offsets (a leading 0, then the running sum) of 1-D `lengths`, on their device."""
    return torch.cat([lengths.new_zeros(1, dtype=torch.int64), torch.cumsum(lengths, 0, dtype=torch.int64)])


def _lengths_agree(lengths: Tensor, offsets: Tensor) -> bool:
    """Whether a KJT's lengths are its offsets' differences: one engine pass
    for CPU tensors of int32 / int64 (three tensor ops over a batch-4096
    DLRM KJT's 106k entries cost 0.2 ms: a fifth of its lookup), else
    PyTorch's."""
    if (lengths.is_cpu and offsets.is_cpu and lengths.dtype in _INT_TYPES and offsets.dtype in _INT_TYPES
            and lengths.dim() == 1 and offsets.dim() == 1 and lengths.is_contiguous() and offsets.is_contiguous()):
        return _embedcore.lengths_agree(offsets.numpy(), lengths.numpy())
    return torch.equal(lengths.to(offsets.dtype), offsets[1:] - offsets[:-1])


_INT_TYPES = (torch.int32, torch.int64)


def _kjt_parts(kjt, features: Sequence[str], owner: str):
    """(values, offsets, weights, stride, {feature: key index}) of a KJT."""
    if getattr(kjt, "variable_stride_per_key", lambda: False)():
        raise NotImplementedError(f"{owner}: KeyedJaggedTensors with a variable batch size per feature are not "
                                  "supported")
    if getattr(kjt, "inverse_indices_or_none", lambda: None)() is not None:
        raise NotImplementedError(f"{owner}: KeyedJaggedTensors with inverse_indices (TorchRec's deduplicated "
                                  "batches, expanded after the lookup) are not supported; give the expanded batch")
    keys = kjt.keys()
    index = {k: i for i, k in enumerate(keys)}
    missing = [f for f in features if f not in index]
    if missing:
        raise KeyError(f"{owner}: the KeyedJaggedTensor lacks features {missing} (it holds {list(keys)})")
    values = kjt.values()
    check_ids(values, "KeyedJaggedTensor values")
    if values.dim() != 1:
        raise ValueError(f"{owner}: the KeyedJaggedTensor's values must be 1-D (one id per value), got shape "
                         f"{tuple(values.shape)}")
    given_lengths = kjt.lengths_or_none() if kjt.offsets_or_none() is not None else None  # beside its offsets
    if isinstance(given_lengths, Tensor):
        _check_strided(given_lengths, "KeyedJaggedTensor lengths")
    offsets = _jagged_offsets(kjt, "KeyedJaggedTensor")
    check_ids(offsets, "KeyedJaggedTensor offsets")
    stride = kjt.stride()
    if offsets.shape[0] - 1 != stride * len(keys):
        raise ValueError(f"{owner}: the KeyedJaggedTensor has {offsets.shape[0] - 1} bags for {len(keys)} keys; "
                         f"with batch size {stride} it needs {stride * len(keys)} (one per key and example)")
    where = f"{owner}: the KeyedJaggedTensor"
    try:
        checked = _ops.checked_values(values, offsets, where)  # (checked: the offsets the lookup reads)
    except ValueError as e:
        error = e
    else:
        # Lengths given beside good offsets must be theirs: TorchRec splits the values by the lengths, the
        # lookup reads the offsets (checked only then, a tensor op less: lengths alone make the offsets).
        if given_lengths is None or not _ops.plain_eager([given_lengths]) or _lengths_agree(given_lengths, offsets):
            return checked, offsets, kjt.weights_or_none(), stride, index
        _ops.checked_values(values, given_lengths, where, True)  # a negative length or a wrong total, named
        if given_lengths.shape[0] != offsets.shape[0] - 1:
            raise ValueError(f"{where} has {given_lengths.shape[0]} lengths and {offsets.shape[0] - 1} bags by its "
                             "offsets: the lengths and offsets of a KeyedJaggedTensor must describe the same bags")
        bad = int(torch.nonzero(given_lengths.to(offsets.dtype) != offsets[1:] - offsets[:-1])[0, 0])
        raise ValueError(f"{where}['lengths'][{bad}] = {int(given_lengths[bad])} disagrees with its offsets "
                         f"({int(offsets[bad])} to {int(offsets[bad + 1])}): the lengths and offsets of a "
                         "KeyedJaggedTensor must describe the same bags")
    # Bad lengths (a negative one, one past the values, or a total other than the values') are named as such
    # (looked for only then, a tensor op less).
    lengths = kjt.lengths_or_none()
    if lengths is not None and _ops.plain_eager([lengths]):
        _ops.checked_values(values, lengths, where, True)  # raises, naming the length or their total
    raise error


# ------------------------------------------------------------------ TorchRec's interface
def _name_the_feature(error: IndexError, table: str, rows: int, features: Sequence[str], ids: List[Tensor],
                      offsets: List[Tensor], segments: List[int]) -> IndexError:
    """The engine's out-of-range error of a table's lookup (which knows the
    table and the position, not the feature), naming the feature whose ids
    hold the first such id and its position in the caller's tensor (a KJT's
    values, or the feature's own ids): `segments` as ``_ops.lookup`` takes
    them, segment k's feature ``features[k]``. `error` itself where none
    is found (another error)."""
    for k in range(0, len(segments), 3):
        source, first, count = segments[k:k + 3]
        lo, hi = 0, int(ids[source].shape[0])
        if offsets and count != _ops.WHOLE:
            lo, hi = int(offsets[source][first]), int(offsets[source][first + count])
        window = ids[source][lo:hi]
        bad = torch.nonzero((window < 0) | (window >= rows)).flatten()
        if bad.shape[0]:
            in_kjt = len(ids) == 1 and (len(segments) > 3 or lo > 0)
            where = "the KeyedJaggedTensor's values" if in_kjt else f"features[{features[k // 3]!r}]'s ids"
            return IndexError(f"table '{table}', feature {features[k // 3]!r}: id {int(window[bad[0]])} at position "
                              f"{lo + int(bad[0])} of {where} is out of range [0, {rows})")
    return error


class _Interface:
    """``forward`` of every collection: a KJT (``_forward_kjt``) or a dict
    of features (``_forward_dict``), checked first by ``_check_input``."""

    def forward(self, features):
        kjt = _is_kjt(features)
        if not kjt:  # (a KJT is no FX Proxy, and refuse_fx_proxy looks into none)
            refuse_fx_proxy(self, features)
        if not kjt and not isinstance(features, dict):
            raise TypeError(f"{self._owner} takes a dict of features or a TorchRec KeyedJaggedTensor, got "
                            f"{type(features).__name__}")
        self._check_input(features)
        return self._forward_kjt(features) if kjt else self._forward_dict(features)


class _PooledInterface(_Interface):
    """``forward`` and TorchRec's accessors of the pooled collections
    (``EmbeddingBagCollection``, ``ServedEmbeddingBagCollection``): the inputs taken apart into sources
    and segments (as ``_ops.lookup`` takes them), each table looked up by
    ``_table_lookup(i, ids, offsets, weights, segments, combiner)`` (one
    output per segment), the outputs named and ordered as TorchRec's.
    Subclasses set ``_specs``, ``_names``, ``_dims``, ``_is_weighted`` and
    ``_check_input(features)`` (checks before any lookup)."""

    _owner = "EmbeddingBagCollection"

    def is_weighted(self) -> bool:
        return self._is_weighted

    def embedding_bag_configs(self) -> list:
        """The table configs as given (TorchRec's or this module's)."""
        return [s.config for s in self._specs]

    def _forward_dict(self, features: dict) -> Dict[str, Tensor]:
        out: Dict[str, Tensor] = {}
        for i, (spec, names) in enumerate(zip(self._specs, self._names)):
            ids, offsets, weights, segments = [], [], [], []
            for k, f in enumerate(spec.features):
                if f not in features:
                    raise KeyError(f"{self._owner}: feature {f!r} of table '{spec.name}' is missing from "
                                   f"the input (it holds {sorted(features)})")
                v, o, w = _csr(features[f], f"features[{f!r}]")
                ids.append(v)
                offsets.append(o)
                weights.append(w)
                segments.extend((k, 0, o.shape[0] - 1))
            if all(w is None for w in weights):
                weights = []
            else:
                weights = [w if w is not None else torch.ones(v.shape, dtype=torch.float32, device=v.device)
                           for v, w in zip(ids, weights)]
            out.update(zip(names, self._table_lookup(i, ids, offsets, weights, segments, _MODES[spec.pooling])))
        return out

    def _keys(self) -> List[str]:
        return [n for names in self._names for n in names]

    def _kjt_segments(self, kjt):
        """(values, offsets, weights, segments by table, combiners by table) of a KJT."""
        all_features = [f for s in self._specs for f in s.features]
        values, offsets, kjt_weights, stride, index = _kjt_parts(kjt, all_features, self._owner)
        weights: List[Tensor] = []
        if self._is_weighted:
            if kjt_weights is None:
                raise ValueError(f"{self._owner}(is_weighted=True) needs a KeyedJaggedTensor with weights")
            check_weights(kjt_weights, values, "KeyedJaggedTensor weights")
            weights = [kjt_weights]
        segments = [[x for f in spec.features for x in (0, index[f] * stride, stride)] for spec in self._specs]
        return values, offsets, weights, segments, [_MODES[spec.pooling] for spec in self._specs]

    def _forward_kjt(self, kjt):
        return self._lookup_kjt(*self._kjt_segments(kjt))

    def _lookup_kjt(self, values, offsets, weights, segments, combiners):
        """A ``KeyedTensor`` of each table's lookup of its segments of a KJT."""
        pooled: List[Tensor] = []
        for i, (segs, combiner) in enumerate(zip(segments, combiners)):
            pooled.extend(self._table_lookup(i, [values], [offsets], weights, segs, combiner))
        return _jagged_module().KeyedTensor(keys=self._keys(), length_per_key=self._dims,
                                            values=torch.cat(pooled, dim=1))


class _SequenceInterface(_Interface):
    """``forward`` and TorchRec's accessors of the unpooled collections (``EmbeddingCollection``,
    ``ServedEmbeddingCollection``), as ``_PooledInterface``'s (subclasses set
    ``_specs``, ``_names``, ``_need_indices``)."""

    _owner = "EmbeddingCollection"

    def embedding_configs(self) -> list:
        """The table configs as given (TorchRec's or this module's)."""
        return [s.config for s in self._specs]

    def need_indices(self) -> bool:
        return self._need_indices

    def embedding_names_by_table(self) -> List[List[str]]:
        """The output names of each table's features, in table order."""
        return [list(names) for names in self._names]

    def embedding_dim(self) -> int:
        """The tables' common dimension (TorchRec's collection has one)."""
        dims = sorted({s.dim for s in self._specs})
        if len(dims) != 1:
            raise ValueError(f"{self._owner}: the tables have dimensions {dims}, not one embedding_dim")
        return dims[0]

    def _forward_dict(self, features: dict) -> Dict[str, Tensor]:
        out: Dict[str, Tensor] = {}
        for i, (spec, names) in enumerate(zip(self._specs, self._names)):
            ids, shapes, segments = [], [], []
            for k, f in enumerate(spec.features):
                v, shape = _sequence_ids(features, f, spec.name, self._owner)
                ids.append(v)
                shapes.append(shape)
                segments.extend((k, 0, _ops.WHOLE))
            results = self._table_lookup(i, ids, [], [], segments, _ops.SEQUENCE)
            for name, r, shape in zip(names, results, shapes):
                out[name] = r.reshape(*shape, spec.dim)
        return out

    def _forward_kjt(self, kjt):
        jt = _jagged_module()
        all_features = [f for s in self._specs for f in s.features]
        values, offsets, _, stride, index = _kjt_parts(kjt, all_features, self._owner)
        lengths = kjt.lengths()
        out = {}
        # Every table's rows in one pass over the engine (no autograd, or fused training: one step of every
        # table in the backward), else one op per table: the same rows and steps, bit for bit.
        plan = self._row_tables()
        fused = None if plan is None else _ops.collection_rows(
            plan[0], values, offsets, [[index[f] * stride for f in spec.features] for spec in self._specs], stride,
            plan[1])
        for i, (spec, names) in enumerate(zip(self._specs, self._names)):
            if fused is not None:
                results = fused[i]
            else:
                segments: List[int] = []
                for f in spec.features:
                    segments.extend((0, index[f] * stride, stride))
                results = self._table_lookup(i, [values], [offsets], [], segments, _ops.SEQUENCE)
            for f, name, r in zip(spec.features, names, results):
                k = index[f]
                ids = None
                if self._need_indices:
                    ids = values[offsets[k * stride]:offsets[(k + 1) * stride]]
                out[name] = jt.JaggedTensor(values=r, lengths=lengths[k * stride:(k + 1) * stride], weights=ids)
        return out


class _Collection(_AdapterModule):
    def _check_input(self, features) -> None:
        pass  # (the lookups check what they take)

    @property
    def device(self) -> torch.device:
        """Where the tables live (TorchRec's ``device``)."""
        return self._device

    def _link_tables(self) -> None:
        """Each table module knows its collection (weakly), so that the first
        lookup that fuses a table from apply_optimizer_in_backward checks
        every pending table of the collection first: one refused, none
        fuses (``_TableModule._fuse_in_backward_optimizer``). A table keeps
        a link to each live collection it is in (a shallow copy shares the
        original's tables, and either may outlive the other)."""
        for m in self.modules():
            if isinstance(m, _TableModule):
                links = [r for r in m.__dict__.get("_collections", ()) if r() is not None and r() is not self]
                m.__dict__["_collections"] = links + [weakref.ref(self)]

    def __setstate__(self, state):
        super().__setstate__(state)
        self._link_tables()  # (a deep copy's or an unpickled collection's tables know it)

    def reset_parameters(self) -> None:
        """Initializes every table's values again, as TorchRec's: a config's
        ``init_fn`` is called on the table's weight again (new draws), an
        ``initializer`` gives the values the table had when built (it is
        seeded). Optimizer slots and step stay as they are."""
        for module, spec in zip(self._children_list(), self._specs):
            if spec.init_fn is not None:
                with torch.no_grad():
                    spec.init_fn(module.weight)
            else:
                module._table.reset_values()


class EmbeddingBagCollection(_PooledInterface, _Collection):
    """Pooled lookups of several tables, shaped like TorchRec's
    ``EmbeddingBagCollection``.

    tables: ``EmbeddingBagConfig`` (this module's or TorchRec's).
    optimizer: an ``embedcore.optimizers`` optimizer for fused training of
        every table whose config has none; None trains through PyTorch
        optimizers (``embedding_bags[t].weight.grad``, sparse unless
        ``sparse=False``).
    is_weighted: use a ``KeyedJaggedTensor``'s weights (TorchRec's flag);
        dict features use their weights whenever they have them.
    device: where the tables live ("cpu", or "cuda[:n]" in a CUDA build).
    sparse: the tables' gradients are sparse (``torch.optim.SGD`` /
        ``Adagrad`` / ``SparseAdam``), or dense with ``sparse=False``, as
        TorchRec's (``Adam``, ``clip_grad_norm_``).

    ``forward(features)``: a TorchRec ``KeyedJaggedTensor`` gives a
    ``KeyedTensor`` (as TorchRec); a dict ``{feature: input}`` gives a dict
    ``{name: [batch, dim] tensor}``. An input is ``(values, offsets[,
    weights])``, ``{"values", "offsets" or "lengths", "weights"}``,
    ``ec.Ragged``, a ``JaggedTensor``, a 2-D id tensor (one bag per row) or
    a 1-D one (one id per bag). Names are the feature names (``feature@table``
    for a feature read by several tables), in table order.

    ``world=`` (an ``embedcore.distributed.Comm``, e.g.
    ``embedcore.adapters.torch.distributed.init()``) and ``sharding=``
    ("table_wise", "row_wise", "column_wise", "auto" or a dict of them by
    table name) shard the tables over the ranks: every rank builds the
    module with the same arguments and calls it, and backward(), on its own
    part of the batch (``ShardedEmbeddingBagCollection``).
    """

    def __new__(cls, *args, world=None, sharding="auto", **kwargs):
        if cls is EmbeddingBagCollection and world is not None:
            from ._sharded import ShardedEmbeddingBagCollection

            cls = ShardedEmbeddingBagCollection
        return super().__new__(cls)

    def __init__(self, tables: Sequence, optimizer: Optional[ec.optimizers.Optimizer] = None,
                 is_weighted: bool = False, device=None, sparse: bool = True, *, world=None, sharding="auto"):
        if world is not None:
            raise TypeError(f"{type(self).__name__}: world= shards EmbeddingBagCollection itself, not a subclass")
        check_sharding_without_world(sharding, "EmbeddingBagCollection")
        super().__init__()
        owner = "EmbeddingBagCollection"
        _check_optimizer_argument(optimizer, owner, "is_weighted")
        self._specs = _specs(tables, True, owner)
        self._names = _embedding_names(self._specs)
        self._is_weighted = bool(is_weighted)
        self._device = torch.device(_table_device(device) or "cpu")
        self.embedding_bags = nn.ModuleDict()
        for s in self._specs:
            self.embedding_bags[s.name] = EmbeddingBag(
                s.rows, s.dim, mode=s.pooling, sparse=sparse, include_last_offset=True, device=device,
                dtype=s.dtype, optimizer=s.optimizer if s.optimizer is not None else optimizer,
                initializer=s.initializer, name=s.name, _init_fn=s.init_fn)
            self.embedding_bags[s.name]._name_features(s.features)
        self._dims = [s.dim for s, names in zip(self._specs, self._names) for _ in names]
        self._link_tables()

    def _children_list(self):
        return list(self._modules["embedding_bags"]._modules.values())  # (not nn.Module.__getattr__: every forward)

    def _table_lookup(self, i: int, ids: List[Tensor], offsets: List[Tensor], weights: List[Tensor],
                      segments: List[int], combiner: int) -> List[Tensor]:
        spec = self._specs[i]
        try:
            return self.embedding_bags[spec.name]._lookup(ids, offsets, weights, segments, combiner, True)
        except IndexError as e:
            raise _name_the_feature(e, spec.name, spec.rows, spec.features, ids, offsets, segments) from None

    def _forward_kjt(self, kjt):
        values, offsets, weights, segments, combiners = self._kjt_segments(kjt)
        # Every table in one engine call (each table's op otherwise: the same results, bit for bit).
        fused = _ops.collection_lookup(self._children_list(), values, offsets, weights, segments, combiners)
        if fused is None:
            return self._lookup_kjt(values, offsets, weights, segments, combiners)
        return _jagged_module().KeyedTensor(keys=self._keys(), length_per_key=self._dims, values=fused)


def _show_init_signature(cls) -> None:
    """`help()` / `inspect.signature` show __init__'s parameters, not those of
    the __new__ that picks the sharded class."""
    cls.__new__.__signature__ = inspect.signature(cls.__init__)  # on __new__, so instances keep their own


_show_init_signature(EmbeddingBagCollection)


class EmbeddingCollection(_SequenceInterface, _Collection):
    """Unpooled (sequence) lookups of several tables, shaped like TorchRec's
    ``EmbeddingCollection``: one embedding row per id.

    ``forward(features)``: a ``KeyedJaggedTensor`` gives ``{name:
    JaggedTensor(values=[ids, dim], lengths=...)}`` as TorchRec; a dict gives
    ``{name: tensor}``: ``[*ids.shape, dim]`` for an id tensor, ``[ids, dim]``
    for the values of a ``(values, offsets)`` / dict / ``JaggedTensor`` input.
    Other arguments as ``EmbeddingBagCollection`` (``world=`` and
    ``sharding=`` included: ``ShardedEmbeddingCollection``)."""

    def __new__(cls, *args, world=None, sharding="auto", **kwargs):
        if cls is EmbeddingCollection and world is not None:
            from ._sharded import ShardedEmbeddingCollection

            cls = ShardedEmbeddingCollection
        return super().__new__(cls)

    def __init__(self, tables: Sequence, optimizer: Optional[ec.optimizers.Optimizer] = None, device=None,
                 sparse: bool = True, need_indices: bool = False, *, world=None, sharding="auto",
                 use_gather_select: bool = False, use_gather_select_per_sharding: Optional[Dict[str, bool]] = None):
        if world is not None:
            raise TypeError(f"{type(self).__name__}: world= shards EmbeddingCollection itself, not a subclass")
        check_sharding_without_world(sharding, "EmbeddingCollection")
        super().__init__()
        # TorchRec's, for its sharded lookups: recorded, not read (one engine call gives the rows either way).
        self._use_gather_select = (bool(use_gather_select), use_gather_select_per_sharding)
        _check_optimizer_argument(optimizer, "EmbeddingCollection", "device")
        self._specs = _specs(tables, False, "EmbeddingCollection")
        self._names = _embedding_names(self._specs)
        self._need_indices = bool(need_indices)
        self._device = torch.device(_table_device(device) or "cpu")
        self.embeddings = nn.ModuleDict()
        for s in self._specs:
            self.embeddings[s.name] = Embedding(
                s.rows, s.dim, sparse=sparse, device=device, dtype=s.dtype,
                optimizer=s.optimizer if s.optimizer is not None else optimizer, initializer=s.initializer,
                name=s.name, _init_fn=s.init_fn)
            self.embeddings[s.name]._name_features(s.features)
        self._link_tables()

    def _children_list(self):
        return list(self.embeddings.values())

    def _row_tables(self) -> Optional[tuple]:
        """``(tables, trains)`` for ``_ops.collection_rows`` when every table is
        on the CPU and either records no autograd (its ``trains`` entry None)
        or trains fused (``(handle, anchor)``); else None (each table's op
        runs: gradients for PyTorch's optimizers)."""
        grad_on = torch.is_grad_enabled()
        tables, trains = [], []
        for m in self._children_list():
            anchor, mode = m._anchor_and_mode(stacklevel=5)  # (the checks of every lookup)
            if not anchor.is_cpu:
                return None
            trains.append(None)
            if grad_on and anchor.requires_grad:
                if mode != _ops.FUSED:
                    return None
                trains[-1] = (m._handle, anchor)
            tables.append(m._table)
        return tables, trains

    def _table_lookup(self, i: int, ids: List[Tensor], offsets: List[Tensor], weights: List[Tensor],
                      segments: List[int], combiner: int) -> List[Tensor]:
        spec = self._specs[i]
        try:
            return self.embeddings[spec.name]._lookup(ids, offsets, weights, segments, combiner, True)
        except IndexError as e:
            raise _name_the_feature(e, spec.name, spec.rows, spec.features, ids, offsets, segments) from None


_show_init_signature(EmbeddingCollection)
