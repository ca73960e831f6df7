"""The sharded collections: ``EmbeddingBagCollection(..., world=comm,
sharding=...)`` and ``EmbeddingCollection(..., world=comm, sharding=...)``.

Thin: the tables are one sharded ``ec.Embedding`` (one feature per table
and feature, in the collection's order), which does the all-to-all lookup
and the sharded update; this module converts the tensors and wires
autograd. With ``device="cuda"`` the shards live in GPU memory; the
algorithm routes ids on the host, so CUDA inputs are copied to the host and
the outputs come back on the module's device. The forward pass looks up this rank's part of the batch; the
backward pass hands the outputs' gradients to ``apply_gradients``, which
updates every rank's shards (the fused optimizer's step runs inside
``backward()``, as for the unsharded collections). Both are collective:
every rank calls them, in the same order.
"""
from __future__ import annotations

import ast
import os
import re
import sys
import warnings
import weakref
from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import Tensor

import embedcore as ec
from embedcore.checkpoint import _optimizer_json
from embedcore.distributed import Comm
from embedcore.distributed._comm import agree, collective, one_thread

from ._collection import (EmbeddingBagCollection, EmbeddingCollection, _csr, _embedding_names, _is_kjt,
                          _jagged_module, _kjt_parts, _sequence_ids, _specs, _uniform_of)
from ._modules import _NoFusedOptimizer, _table_device, check_weights, refuse_float16_backward, refuse_fx_proxy
from . import _ops
from ._ops import _check_offsets

__all__ = ["ShardedEmbeddingBagCollection", "ShardedEmbeddingCollection"]


# ------------------------------------------------------------------ inputs
def _np(t: Tensor) -> np.ndarray:
    """The host array the sharded algorithm routes: a view of a CPU tensor, a
    copy of a CUDA one (the module checked its device)."""
    return _ops._np(t.cpu())


def _checked_offsets(off: np.ndarray, n_ids: int, where: str) -> np.ndarray:
    """Offsets as int64, checked as the unsharded collections check them."""
    off = off.astype(np.int64, copy=False)
    if off.size:
        _check_offsets(off, n_ids, where, appended=False)
    return off


def _ragged(values: Tensor, offsets: Tensor, weights: Optional[Tensor], where: str):
    """(ec.Ragged, weights array or None) of one feature: the ids up to the
    last offset (ids after it belong to no bag, as ``include_last_offset``)."""
    ids = _np(values)
    off = _checked_offsets(_np(offsets), ids.shape[0], f"{where} offsets")
    n = int(off[-1])
    w = None if weights is None else _np(weights)[:n]
    return ec.Ragged(ids[:n], off), w


def _kjt_feature(values: np.ndarray, offsets: np.ndarray, weights: Optional[np.ndarray], k: int, stride: int):
    """Feature `k` of a KJT (arrays already checked) as (ec.Ragged, weights)."""
    off = offsets[k * stride:(k + 1) * stride + 1]
    lo, hi = int(off[0]), int(off[-1])
    w = None if weights is None else weights[lo:hi]
    return ec.Ragged(values[lo:hi], off - lo), w


def _kjt_arrays(kjt, features: Sequence[str], owner: str):
    values, offsets, weights, stride, index = _kjt_parts(kjt, features, owner)
    ids = _np(values)
    off = _checked_offsets(_np(offsets), ids.shape[0], "KeyedJaggedTensor offsets")
    return ids, off, weights, stride, index


# ------------------------------------------------------------------ autograd
# By module: (forward call, weak reference to its autograd node) of its training forwards (kept off the module,
# which then copies and pickles as before).
_NODES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


class _ShardedLookup(torch.autograd.Function):
    """Forward: the sharded lookup of this rank's features. Backward: the
    sharded update from the outputs' gradients (collective)."""

    @staticmethod
    def forward(ctx, anchor, module, inputs, weights):
        outs = module._embedding(inputs, weights)
        ctx.module = module
        ctx.call = module._calls
        module._remember_node(ctx)  # (ctx is the autograd node: see backward)
        # Host tensors: the caller moves them to the module's device. Were they
        # CUDA tensors, this backward would run on autograd's one thread for
        # that GPU, where ranks sharing a process (run_local) would wait for
        # each other in the collective update forever.
        return tuple(torch.from_numpy(o) for o in outs)

    @staticmethod
    def backward(ctx, *grads):
        module = ctx.module
        if ctx.call != module._calls:
            raise RuntimeError(f"{type(module).__name__}: backward() of an earlier forward pass; a sharded "
                               "collection updates from its last forward pass only, so call backward() before "
                               "the next forward (on every rank)")
        # An earlier forward's node that this same backward pass will reach (gradient accumulation: the losses
        # of two forward passes summed) would raise above once this one had updated the tables: refused here,
        # before any change. Autograd runs the later node first.
        will_run = getattr(torch._C, "_will_engine_execute_node", None)
        for node in module._earlier_nodes(ctx):
            if will_run is not None and will_run(node):
                raise RuntimeError(f"{type(module).__name__}: one backward() through two of its forward passes "
                                   "(the losses of several micro-batches summed); a sharded collection updates "
                                   "from its last forward pass only, so call backward() after each forward (on "
                                   "every rank). No table was changed")
        # Autograd gives zeros for outputs that did not reach the loss.
        with one_thread(module._world, "backward"):
            module._embedding.apply_gradients([_ops._np(g.contiguous()) for g in grads])
        return torch.zeros(1), None, None, None


_TABLE_FIELDS = ("name", "num_embeddings", "embedding_dim", "dtype", "pooling", "feature_names", "optimizer")


def _table_difference(r: int, theirs: Optional[list], m: int, mine: Optional[list]) -> str:
    """Where rank `r`'s tables (``_build``'s description: a tuple of
    ``_TABLE_FIELDS`` a table) first differ from rank `m`'s: the table, the
    field and both values (all of both descriptions named a collection of
    many tables in thousands of characters)."""
    if theirs is None or mine is None:
        count = lambda d: "no" if d is None else len(d)  # noqa: E731
        return f"rank {r} has {count(theirs)} tables, rank {m} {count(mine)}"
    for i, (x, y) in enumerate(zip(theirs, mine)):
        for field, u, v in zip(_TABLE_FIELDS, x, y):
            if u != v:
                which = f"'{y[0]}'" if field != "name" else f"#{i}"
                return f"table {which} {field}: rank {r} has {u!r}, rank {m} has {v!r}"
    return (f"rank {r} has {len(theirs)} tables {[x[0] for x in theirs]}, rank {m} has {len(mine)} "
            f"{[y[0] for y in mine]}")


def _caller_stacklevel() -> int:
    """The ``stacklevel`` with which the function calling this one warns at
    the first frame outside PyTorch and embedcore (the user's module call)."""
    inside = (os.path.dirname(torch.__file__), os.path.dirname(ec.__file__), os.path.dirname(__file__))
    frame, level = sys._getframe(2), 2
    while frame is not None and frame.f_code.co_filename.startswith(inside):
        frame, level = frame.f_back, level + 1
    return level


# ------------------------------------------------------------------ modules
class _Sharded:
    """What both sharded collections share: one sharded ``ec.Embedding``."""

    _owner = ""

    def _build(self, specs, optimizer, device, world, sharding, pooled: bool) -> None:
        shard_device = _table_device(device)  # None (CPU) or "cuda:N"
        self._device = torch.device(shard_device or "cpu")
        if not isinstance(world, Comm):
            raise TypeError(f"{self._owner}: world must be an embedcore.distributed.Comm (e.g. "
                            f"embedcore.adapters.torch.distributed.init()), got {world!r}")
        if optimizer is not None and not isinstance(optimizer, ec.optimizers.Optimizer):
            raise TypeError(f"{self._owner}: optimizer must be an embedcore.optimizers optimizer, got {optimizer!r}")
        with one_thread(world, f"{self._owner}()"):
            self._build_over(specs, optimizer, shard_device, world, sharding)

    def _build_over(self, specs, optimizer, shard_device, world, sharding) -> None:
        # Every rank must build the same tables; the initial values are rank 0's (whose default
        # seeds come from its PyTorch generator), so a rank's generator state does not matter.
        error = None
        desc = None
        try:
            for s in specs:
                if s.initializer is None:  # TorchRec's configs always hold an init_fn: uniform_ in their bounds
                    s.initializer = _uniform_of(s.init_fn)
                if s.initializer is None:
                    raise NotImplementedError(f"{self._owner}: table '{s.name}' has init_fn, which needs the whole "
                                              "table on one rank; give it an initializer= (embedcore.initializers) "
                                              "or weight_init_min / weight_init_max")
            opts = [s.optimizer if s.optimizer is not None else optimizer for s in specs]
            if any(o is None for o in opts) and any(o is not None for o in opts):
                raise ValueError(f"{self._owner}: a sharded collection trains every table or none; give every "
                                 "table an optimizer (or the collection's optimizer=), or none for lookups only")
            desc = [(s.name, s.rows, s.dim, s.dtype, s.pooling, s.features, _optimizer_json(o))
                    for s, o in zip(specs, opts)]
        except Exception as e:  # noqa: BLE001 - every rank must hear of it
            error = e
        # The module's own arguments that change what a rank computes (whether its KJT's weights are pooled,
        # whether its outputs carry the ids) are compared too; device may differ (each rank its own GPU).
        args = {k: getattr(self, f"_{k}") for k in ("is_weighted", "need_indices") if hasattr(self, f"_{k}")}
        everyone = agree(world, error, (desc, args, [s.initializer for s in specs]), step=f"{self._owner}(): construction")
        for r, (d, a, _) in enumerate(everyone):
            if a != args:
                k = next(k for k in args if a.get(k) != args[k])
                raise ValueError(f"{self._owner}: rank {r} built the collection with {k}={a.get(k)!r}, rank "
                                 f"{world.rank} with {k}={args[k]!r}; every rank must build the collection with "
                                 "the same arguments")
            if d != desc:
                raise ValueError(f"{self._owner}: rank {r} built different tables than rank {world.rank}: "
                                 f"{_table_difference(r, d, world.rank, desc)}; every rank must build the "
                                 "collection with the same arguments")
        initializers = everyone[0][2]
        tables = [ec.TableConfig(s.name, s.rows, s.dim, s.dtype, init, o, s.pooling or "sum")
                  for s, init, o in zip(specs, initializers, opts)]
        self._feature_configs = [ec.FeatureConfig(t, name=n) for t, names in zip(tables, self._names) for n in names]
        self._embedding = ec.Embedding(self._feature_configs, world=world, sharding=sharding, device=shard_device)
        # The engine's features are the outputs ('feature@table' where tables share a
        # feature); errors name the caller's feature.
        self._feature_of = {n: f for s, names in zip(specs, self._names) for f, n in zip(s.features, names)}
        terms = weakref.WeakMethod(self._in_callers_terms)  # (no cycle: the module goes when its last user does)
        self._embedding._caller_terms = lambda e: e if terms() is None else terms()(e)
        self._world = world
        self._trainable = opts[0] is not None
        self._warned_untrained = False  # the first training-mode call of an untrained module warns
        self._anchor = torch.zeros(1, requires_grad=True)  # carries autograd to the sharded update
        self._calls = 0

    # ------------------------------------------------------------ properties
    @property
    def world(self) -> Comm:
        return self._world

    @property
    def embedding(self):
        """The sharded ``ec.Embedding`` underneath (``plan``, ``local_shards``)."""
        return self._embedding

    @property
    def plan(self):
        """Which rank holds which rows and columns of each table."""
        return self._embedding.plan

    @property
    def fused_optimizer(self):
        # An AttributeError (hasattr() is False: there is none), whose message nn.Module.__getattr__ would
        # replace with its own: the property's own error is raised from __getattr__ below.
        raise _NoFusedOptimizer

    def __getattr__(self, name: str):
        if name == "fused_optimizer":
            raise AttributeError(f"{self._owner}: a sharded collection has no fused_optimizer object; its "
                                 "optimizers update the shards inside backward(), with the learning rates of the "
                                 "embedcore optimizers (a callable learning_rate(step) for a schedule)")
        return super().__getattr__(name)

    def requires_grad_(self, requires_grad: bool = True):
        """``requires_grad_(False)`` freezes the tables (lookups no longer
        train; every rank must freeze alike, as every rank calls backward()),
        as it freezes the unsharded module's weights. The module holds no
        parameters, so a parent's ``requires_grad_`` or a loop over
        ``parameters()`` does not reach it: call this on the module itself."""
        self._anchor.requires_grad_(requires_grad)
        return super().requires_grad_(requires_grad)

    def reset_parameters(self) -> None:
        """Initializes this rank's shards again: each gets its block of the
        values its table had when built (the initializers are seeded, so
        the ranks agree without communicating). Slots and step stay."""
        for table in self._embedding._local.values():
            table.reset_values()

    def optimizer_state_dict(self) -> dict:
        raise NotImplementedError(f"{self._owner}: the optimizer state of a sharded collection is saved with "
                                  "ec.save(path, module) (collective)")

    def extra_repr(self) -> str:
        kinds = ", ".join(f"{n}: {t.kind}" for n, t in self._embedding.plan.tables.items())
        return f"world={self._world!r}, sharding={{{kinds}}}"

    # ------------------------------------------------------------ checkpoints (collective)
    def _embedcore_tables(self):
        raise TypeError(f"{self._owner}: a sharded collection has no whole tables on one rank; use "
                        "ec.save(path, module) / ec.load(path, into=module) on every rank")

    def _sharded_save(self, path, include_optimizer: bool, values_dtype, keep: bool = False):
        # Tables only, as the unsharded collections' saves: the engine's features here are the module's
        # internal ones ('feature@table' names, sequences as pooled rows), which serving would misread.
        return self._embedding._sharded_save(path, include_optimizer, values_dtype, keep, {"kind": "table"})

    def _sharded_load(self, path, include_optimizer: bool):
        return self._embedding._sharded_load(path, include_optimizer)

    # ------------------------------------------------------------ lookup
    def _out(self, a: np.ndarray) -> Tensor:
        """An output of the engine (host memory) on the module's device."""
        t = torch.from_numpy(a)
        return t if self._device.type == "cpu" else t.to(self._device)

    def _check_device(self, tensors, where: str) -> None:
        for t in tensors:
            if t is not None and t.device != self._device:
                raise RuntimeError(f"Expected all tensors to be on the same device: the shards of {self._owner} "
                                   f"are on {self._device}, {where} on {t.device}")

    # A collective step of host work: torch.compile runs it eagerly (a graph break), as it does any opaque call.
    @torch.compiler.disable
    @collective("forward")
    def forward(self, features):
        self._kjt_starts = {}  # (a KeyedJaggedTensor's are noted by _parse; None outside forward)
        try:
            refuse_fx_proxy(self, features)
            inputs, weights, finish = self._parse(features)
        except Exception as e:  # noqa: BLE001 - every rank must hear of it, or the others wait in the lookup
            agree(self._world, e, step=self._embedding.step_name("lookup: requests"))  # pairs with the lookup's
            # first agree on the others; raises e
            raise
        try:
            return finish(self._lookup(inputs, weights))
        finally:  # the positions belong to this call's KeyedJaggedTensor only (not to module.embedding's calls)
            self._kjt_starts = None

    def _note_kjt_starts(self, offsets: np.ndarray, keys: List[int], stride: int) -> None:
        """Where each feature's ids start in the KeyedJaggedTensor's values(),
        by the engine's feature names, for errors in the caller's terms."""
        self._kjt_starts = {c.name: int(offsets[k * stride]) for c, k in zip(self._feature_configs, keys)}

    _ID_AT = re.compile(r"^features\[(.+?)\]: id (-?\d+) at position (\d+) ")  # (the adapter's ids are 1-D)

    def _in_callers_terms(self, e: Exception) -> Exception:
        """A bad id's error naming the caller's feature (not the engine's
        'feature@table' output) and, for a KeyedJaggedTensor, the position in
        its values() (docs/torch.md), where the sharded lookup names the
        position in its feature; `e` itself otherwise. The sharded lookup
        applies it before the other ranks hear of the error (``_caller_terms``)."""
        m = self._ID_AT.match(str(e)) if isinstance(e, IndexError) else None
        if m is None or self._kjt_starts is None:  # (module.embedding's own calls name its features)
            return e
        try:
            name = ast.literal_eval(m.group(1))
        except (ValueError, SyntaxError):
            return e
        if name not in self._feature_of:
            return e
        message = str(e)
        position = m.group(3)
        if name in self._kjt_starts:
            position = f"{int(position) + self._kjt_starts[name]} of the KeyedJaggedTensor's values()"
        return IndexError(f"features[{self._feature_of[name]!r}]: id {m.group(2)} at position {position} "
                          f"{message[m.end():]}")

    def _remember_node(self, node) -> None:
        """Keeps (by weak reference) the autograd node of a training forward,
        for the backward of a later one to find it (``_earlier_nodes``)."""
        nodes = [(c, r) for c, r in _NODES.get(self, []) if r() is not None]
        nodes.append((node.call, weakref.ref(node)))
        _NODES[self] = nodes

    def _earlier_nodes(self, node) -> list:
        """The autograd nodes of the training forwards before `node`'s still
        alive (their graphs not freed)."""
        return [n for c, r in _NODES.get(self, []) if c < node.call for n in (r(),) if n is not None]

    def _lookup(self, inputs: list, weights: list) -> List[Tensor]:
        """One collective lookup of every feature; outputs carry autograd to
        the sharded update when the tables train and grad is enabled."""
        self._calls += 1
        if (not self._trainable and self.training and torch.is_grad_enabled() and self._anchor.requires_grad
                and not self._warned_untrained):  # (not once frozen by requires_grad_(False))
            self._warned_untrained = True
            warnings.warn(
                f"{type(self).__name__} was built without an optimizer, so its tables do not train: it holds no "
                "parameters, which PyTorch optimizers and apply_optimizer_in_backward would reach. Pass "
                "optimizer= (an embedcore.optimizers optimizer) to train them; for lookups only, call it in eval() "
                "or under torch.no_grad()", RuntimeWarning, stacklevel=_caller_stacklevel())
        if not (self._trainable and self._anchor.requires_grad and torch.is_grad_enabled()):
            return [self._out(o) for o in self._embedding(inputs, weights)]
        outs = _ShardedLookup.apply(self._anchor, self, inputs, weights)
        outs = [o if self._device.type == "cpu" else o.to(self._device) for o in outs]
        return refuse_float16_backward(self._device.type, type(self).__name__, outs)


class ShardedEmbeddingBagCollection(_Sharded, EmbeddingBagCollection):
    """``EmbeddingBagCollection(tables, optimizer, world=comm, sharding=...)``.

    Built on every rank with the same arguments. ``forward`` takes this
    rank's features (dict or KeyedJaggedTensor, as the unsharded module) and
    returns this rank's pooled outputs; ``backward()`` applies the sharded
    update. Both are collective.
    """

    _owner = "EmbeddingBagCollection"

    def __init__(self, tables: Sequence, optimizer: Optional[ec.optimizers.Optimizer] = None,
                 is_weighted: bool = False, device=None, sparse: bool = True, *, world=None, sharding="auto"):
        super(EmbeddingBagCollection, self).__init__()
        self._specs = _specs(tables, True, self._owner)
        self._names = _embedding_names(self._specs)
        self._is_weighted = bool(is_weighted)
        self._dims = [s.dim for s, names in zip(self._specs, self._names) for _ in names]
        self._build(self._specs, optimizer, device, world, sharding, True)

    def _parse(self, features):
        """(inputs, weights, finish): the engine's inputs of this rank, and
        what turns the lookup's outputs into the module's."""
        names = [n for names in self._names for n in names]
        inputs, weights = [], []
        if _is_kjt(features):
            all_features = [f for s in self._specs for f in s.features]
            self._check_device([features.values(), features.offsets_or_none(), features.lengths_or_none(),
                                features.weights_or_none()], "the KeyedJaggedTensor")
            ids, off, kjt_weights, stride, index = _kjt_arrays(features, all_features, self._owner)
            w = None
            if self._is_weighted:
                if kjt_weights is None:
                    raise ValueError("EmbeddingBagCollection(is_weighted=True) needs a KeyedJaggedTensor with weights")
                check_weights(kjt_weights, features.values(), "KeyedJaggedTensor weights")
                self._check_weights([kjt_weights])
                w = _np(kjt_weights)
            for s in self._specs:
                for f in s.features:
                    r, fw = _kjt_feature(ids, off, w, index[f], stride)
                    inputs.append(r)
                    weights.append(fw)
            self._note_kjt_starts(off, [index[f] for s in self._specs for f in s.features], stride)
            return inputs, weights, lambda outs: _jagged_module().KeyedTensor(
                keys=names, length_per_key=self._dims, values=torch.cat(outs, dim=1))
        if not isinstance(features, dict):
            raise TypeError("EmbeddingBagCollection takes a dict of features or a TorchRec KeyedJaggedTensor, got "
                            f"{type(features).__name__}")
        given = []
        for s in self._specs:
            for f in s.features:
                if f not in features:
                    raise KeyError(f"EmbeddingBagCollection: feature {f!r} of table '{s.name}' is missing from "
                                   f"the input (it holds {sorted(features)})")
                v, o, w = _csr(features[f], f"features[{f!r}]")
                self._check_device([v, o, w], f"features[{f!r}]")
                r, fw = _ragged(v, o, w, f"features[{f!r}]")
                inputs.append(r)
                weights.append(fw)
                given.append(w)
        self._check_weights(given)
        return inputs, weights, lambda outs: dict(zip(names, outs))

    def _check_weights(self, weights) -> None:
        if torch.is_grad_enabled() and any(w is not None and w.requires_grad for w in weights):
            raise NotImplementedError(f"{self._owner}: weights that require grad are not supported by a sharded "
                                      "collection (its update is the tables' only gradient)")


class ShardedEmbeddingCollection(_Sharded, EmbeddingCollection):
    """``EmbeddingCollection(tables, optimizer, world=comm, sharding=...)``:
    one row per id of this rank's features, as the unsharded module;
    collective. Each id is looked up as a bag of one (a sum of one row is the
    row itself), so the sharded lookup and update are the pooled ones."""

    _owner = "EmbeddingCollection"

    def __init__(self, tables: Sequence, optimizer: Optional[ec.optimizers.Optimizer] = None, device=None,
                 sparse: bool = True, need_indices: bool = False, *, world=None, sharding="auto"):
        super(EmbeddingCollection, self).__init__()
        self._specs = _specs(tables, False, self._owner)
        self._names = _embedding_names(self._specs)
        self._need_indices = bool(need_indices)
        self._build(self._specs, optimizer, device, world, sharding, False)

    @staticmethod
    def _singletons(ids: np.ndarray):
        return ec.Ragged(ids, np.arange(ids.shape[0] + 1, dtype=np.int64)), None

    def _parse(self, features):
        """(inputs, weights, finish), as ShardedEmbeddingBagCollection._parse."""
        inputs, weights = [], []
        if _is_kjt(features):
            jt = _jagged_module()
            all_features = [f for s in self._specs for f in s.features]
            self._check_device([features.values(), features.offsets_or_none(), features.lengths_or_none()],
                               "the KeyedJaggedTensor")
            ids, off, _, stride, index = _kjt_arrays(features, all_features, self._owner)
            lengths = features.lengths()
            keys: List[Tuple[str, int, Tensor]] = []
            for s, names in zip(self._specs, self._names):
                for f, name in zip(s.features, names):
                    k = index[f]
                    r, _ = _kjt_feature(ids, off, None, k, stride)
                    inputs.append(self._singletons(np.asarray(r.values))[0])
                    weights.append(None)
                    keys.append((name, k, np.asarray(r.values) if self._need_indices else None))
            self._note_kjt_starts(off, [k for _, k, _ in keys], stride)
            def finish(outs):
                return {name: jt.JaggedTensor(values=r, lengths=lengths[k * stride:(k + 1) * stride],
                                              weights=None if v is None else self._out(v.copy()))
                        for (name, k, v), r in zip(keys, outs)}

            return inputs, weights, finish
        if not isinstance(features, dict):
            raise TypeError("EmbeddingCollection takes a dict of features or a TorchRec KeyedJaggedTensor, got "
                            f"{type(features).__name__}")
        shapes = []
        names_out = []
        for s, names in zip(self._specs, self._names):
            for f, name in zip(s.features, names):
                v, shape = _sequence_ids(features, f, s.name)
                self._check_device([v], f"features[{f!r}]")
                r, w = self._singletons(_np(v))
                inputs.append(r)
                weights.append(w)
                shapes.append(shape + (s.dim,))
                names_out.append(name)
        return inputs, weights, lambda outs: {name: o.reshape(shape)
                                              for name, o, shape in zip(names_out, outs, shapes)}
