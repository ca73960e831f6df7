"""``EmbeddingBag`` and ``Embedding``: drop-ins for ``torch.nn.EmbeddingBag`` /
``torch.nn.Embedding`` over one embedcore table.

The table's values live in the engine; ``weight`` is an ``nn.Parameter`` that
views them (DLPack, no copy). Training either way:

- fused (``optimizer=`` an ``embedcore.optimizers`` optimizer): the engine's
  optimizer updates the touched rows inside ``backward()``; no gradient of
  the table is ever materialised;
- unfused (``optimizer=None``): ``weight.grad`` is a sparse COO tensor (or a
  dense one with ``sparse=False``), exactly as ``nn.EmbeddingBag`` gives it,
  for ``torch.optim.SGD`` / ``SparseAdam`` / ``Adagrad``, which update the
  engine's memory in place through ``weight``.
"""
from __future__ import annotations

import collections
import threading
import warnings
import weakref
from collections.abc import Mapping
from typing import List, Optional, Tuple

import numpy as np
import torch
import torch.fx
from torch import Tensor, nn

import embedcore as ec
from embedcore.table import _ROUNDS_TO_INF

from . import _ops, _optim

__all__ = ["EmbeddingBag", "Embedding", "tables_of"]

_FUSE_LOCK = threading.Lock()  # see _TableModule._fuse_in_backward_optimizer
_MODES = {"sum": _ops.SUM, "mean": _ops.MEAN, "sqrtn": _ops.SQRTN}
_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
           "float32": "float32", "float16": "float16", "bfloat16": "bfloat16", None: "float32"}


def _dtype_name(dtype) -> str:
    try:
        return _DTYPES[dtype]
    except (KeyError, TypeError):
        raise TypeError(f"dtype must be torch.float32, torch.float16 or torch.bfloat16, got {dtype!r}") from None


def _table_device(device) -> Optional[str]:
    """The engine's device for a module's `device` argument (None: PyTorch's
    default device, a ``with torch.device(...)`` block's included, as
    ``nn.EmbeddingBag`` takes it): None (CPU), or "cuda:N" in the CUDA
    build."""
    given = f"device={device!r}"
    if device is None:
        device = torch.get_default_device()
        given = f"PyTorch's default device ({device}: torch.set_default_device, or a `with torch.device(...)` block)"
    d = torch.device(device)
    if d.type == "cpu":
        return None
    if d.type != "cuda":
        raise NotImplementedError(f"{given}: embedcore tables live in CPU or CUDA memory")
    if not ec.build_info()["cuda"]:
        raise NotImplementedError(f"{given}: embedcore tables live in CPU memory in this build "
                                  "(CUDA tables come with embedcore's CUDA build: EMBEDCORE_CUDA=ON pip install .)")
    if d.index is not None:
        return f"cuda:{d.index}"
    return f"cuda:{torch.cuda.current_device() if torch.cuda.is_available() else 0}"  # PyTorch's current device


_DISTRIBUTED = torch.distributed.is_available()


def _replicated() -> bool:
    """Whether this process is one rank of several (torch.distributed).
    (Not while torch.compile traces: the caller checks.)"""
    return _DISTRIBUTED and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1


def _torch_seed() -> int:
    """A seed for the engine's initializer drawn from PyTorch's (CPU)
    generator, whatever the default device, so that ``torch.manual_seed``
    makes the initial values reproducible."""
    return int(torch.randint(0, 2**62, (1,), device="cpu").item())


_PLAIN = (Tensor, type(None))  # the types of an argument that holds no FX Proxy (refuse_fx_proxy)


def refuse_fx_proxy(module: nn.Module, *inputs) -> None:
    """FX symbolic tracing (``torch.fx.symbolic_trace``,
    ``torchrec.fx.symbolic_trace``) cannot go into a lookup, an engine call:
    ``TypeError`` saying so and how to trace the module as a leaf."""
    def proxies(x) -> bool:  # a collection's dict of features holds them one level down (tensors or tuples)
        if isinstance(x, dict):
            return any(proxies(v) for v in x.values())
        if isinstance(x, (tuple, list)):
            return any(proxies(v) for v in x)
        return isinstance(x, torch.fx.Proxy)

    if any(proxies(x) for x in inputs):
        name = type(module).__name__
        raise TypeError(f"{name}: FX symbolic tracing cannot trace into its lookup (an embedcore engine call; it got "
                        f"an fx Proxy as input): keep the module a leaf of the graph, "
                        f"torchrec.fx.symbolic_trace(model, leaf_modules=[{name!r}]) (or a torch.fx.Tracer whose "
                        "is_leaf_module returns True for it); torch.compile and torch.export trace it as it is")


def _check_strided(t: Tensor, where: str) -> None:
    """A sparse or nested tensor is refused by name; the engine reads a dense
    (torch.strided) one. A nested jagged tensor's parts are what it takes."""
    if t.is_nested:
        raise TypeError(f"{where} is a nested tensor: pass dense ones (a jagged tensor's .values() and .offsets() "
                        "are)")
    if t.layout != torch.strided:
        raise TypeError(f"{where} is a {t.layout} tensor: pass a dense (torch.strided) one (.to_dense())")


def check_ids(t, where: str) -> None:
    """Type, dtype and device checks of an id (or offset) tensor: metadata
    only, so they trace under ``torch.compile``."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{where} must be a torch.Tensor, got {type(t).__name__}")
    _check_strided(t, where)
    if t.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{where} must be an int32 or int64 tensor, got {t.dtype}")
    if not (t.is_cpu or t.is_cuda):
        raise NotImplementedError(f"{where} is on {t.device}: embedcore takes CPU or CUDA tensors")


def _pretrained_dtype(owner: str, embeddings: Tensor, kwargs: dict):
    """The table dtype of ``from_pretrained``: ``dtype=`` (popped from
    `kwargs`), else that of `embeddings`, which must then be a float tensor
    (as a PyTorch weight that trains) other than float64, which no table
    holds."""
    dtype = kwargs.pop("dtype", None)
    if isinstance(embeddings, Tensor):
        _check_strided(embeddings, f"{owner}.from_pretrained: embeddings")
    if dtype is None and not embeddings.is_floating_point():
        raise TypeError(f"{owner}.from_pretrained: embeddings must be a floating-point tensor, got {embeddings.dtype} "
                        "(or pass dtype=, the table's, to convert them)")
    if dtype is None and embeddings.dtype == torch.float64:
        raise TypeError(f"{owner}.from_pretrained: embeddings are torch.float64, which an embedcore table cannot "
                        "hold (float32, float16 or bfloat16): pass dtype=torch.float32 (the values rounded to it), "
                        "or embeddings.float()")
    return embeddings.dtype if dtype is None else dtype


def check_weights(w, ids: Tensor, where: str) -> None:
    if not isinstance(w, Tensor):
        raise TypeError(f"{where} must be a torch.Tensor, got {type(w).__name__}")
    _check_strided(w, where)
    if w.dtype != torch.float32:
        raise TypeError(f"{where} must be float32 (the engine weighs and pools in float32, whatever the table's "
                        f"dtype), got {w.dtype}")
    if w.device.type not in ("cpu", "cuda"):
        raise NotImplementedError(f"{where} is on {w.device}: embedcore takes CPU or CUDA tensors")
    if w.shape != ids.shape:
        raise ValueError(f"{where} must have the shape of the ids {tuple(ids.shape)}, got {tuple(w.shape)}")


class _RefusedBackward(torch.autograd.Function):
    """The identity, whose backward raises: outputs of a fused lookup made
    under float16 autocast. The backward reaches it before the lookup's own,
    which would apply the update, so nothing changes."""

    @staticmethod
    def forward(ctx, message: str, *outs):
        ctx.message = message
        return tuple(o.clone() for o in outs)  # (not views: the caller may change them in place)

    @staticmethod
    def backward(ctx, *grads):
        raise NotImplementedError(ctx.message)


def refuse_float16_backward(device_type: str, owner: str, outs: List[Tensor]) -> List[Tensor]:
    """`outs`, made so that a backward through them raises NotImplementedError
    when the lookup ran under float16 autocast: fused training applies the
    update in the backward pass, so a GradScaler's loss scale (float16 AMP's
    companion) would reach the table unscaled, and a step the scaler skips for
    inf / NaN would still be taken. A forward alone (inference, eval) works.
    Under torch.compile the refusal comes at the forward."""
    if not _ops.float16_autocast(device_type):
        return outs
    message = (f"{owner}: fused training under float16 autocast is not supported: the engine updates the table "
               "in the backward pass, where a GradScaler's loss scale cannot be undone; use bfloat16 autocast (no "
               "loss scaling), or train unfused (optimizer=None, sparse=True, with a torch.optim optimizer that "
               "the GradScaler unscales). Inference under float16 autocast works (no backward, or torch.no_grad())")
    if torch.compiler.is_compiling():
        raise NotImplementedError(message)
    return list(_RefusedBackward.apply(message, *outs))


def _copyable(src, dst) -> bool:
    """Whether ``copy_`` copies a dense tensor of dtype `src` into one of
    `dst` (it refuses quantized and bit-field dtypes, among others)."""
    if src in (torch.quint8, torch.qint8, torch.qint32, torch.quint4x2, torch.quint2x4):
        return False
    try:
        with warnings.catch_warnings():  # (complex to real warns of the imaginary part: copy_ will say so once)
            warnings.simplefilter("ignore")
            torch.empty(1, dtype=dst).copy_(torch.zeros(1, dtype=src))
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    return True


def _sharded(value) -> bool:
    """Whether `value` is TorchRec's / PyTorch's ``ShardedTensor`` (the
    state of a sharded module), which refuses most tensor calls."""
    return isinstance(value, Tensor) and hasattr(value, "local_shards")


def _unstorable(value: Tensor, dtype: str) -> Optional[str]:
    """Why a table of `dtype` cannot hold the weight `value` (``[index] =
    value is ...``), as ``Table.assign`` refuses it: a value that is not
    finite, or beyond the range of the dtype (it would round to infinity);
    None when it can."""
    if value.layout != torch.strided or value.is_nested or value.device.type == "meta" or value.numel() == 0:
        return None  # (refused, or nothing to check)
    v = value.real if value.is_complex() else value  # (copy_ takes the real part)
    limit = _ROUNDS_TO_INF.get(dtype, float.fromhex("0x1.ffffffp+127"))  # (float32's)
    if not v.is_floating_point():
        try:
            info = torch.iinfo(v.dtype)
        except TypeError:
            return None  # (bool fits; quantized and bit-field dtypes are refused)
        if -limit < info.min and info.max < limit:
            return None  # (every int of the dtype fits)
    src = v  # (its elements named)
    if v.dtype in _ops.NO_RANGE_KERNELS:  # (PyTorch's CPU has no aminmax or comparison for them)
        v = v.to(torch.float64 if v.dtype in (torch.uint32, torch.uint64) else torch.float32)
    lo, hi = torch.aminmax(v.detach().reshape(-1))  # one pass in the usual case (a NaN makes both NaN)
    if -limit < float(lo) and float(hi) < limit:
        return None
    if v.is_floating_point():
        bad = ~torch.isfinite(v)
        if bool(bad.any()):
            i = tuple(int(x) for x in torch.nonzero(bad)[0])
            return f"{list(i)} = {src[i].item()!r} is not finite"
    over = (v >= limit) | (v <= -limit)
    if bool(over.any()):
        i = tuple(int(x) for x in torch.nonzero(over)[0])
        return (f"{list(i)} = {src[i].item()!r} is beyond the range of the table's storage dtype {dtype} (it would "
                "round to infinity)")
    return None


class _NoFusedOptimizer(AttributeError):
    """A module without a fused optimizer has no ``fused_optimizer``
    attribute (``hasattr`` is False, as for TorchRec's modules); the
    module's ``__getattr__`` then raises the message."""


def refuse_script(module) -> NotImplementedError:
    """The error of ``torch.jit.script`` (which calls a module's
    ``__prepare_scriptable__`` first) of an adapter module: its lookups call
    the engine from Python, which TorchScript cannot compile (it failed deep
    in TorchScript's compiler, on the ``ec.Table`` annotation)."""
    return NotImplementedError(
        f"{type(module).__name__}: torch.jit.script is not supported (the lookups call the engine from Python); "
        "use torch.compile or torch.export, whose graphs hold the lookup as the custom op embedcore::lookup")


class _AdapterModule(nn.Module):
    """What every adapter module offers: its tables for ``ec.save`` /
    ``ec.load`` / ``ec.Saver``, and the fused optimizers' state."""

    def __getattr__(self, name: str):
        if name == "fused_optimizer":  # the property raised _NoFusedOptimizer: say why
            raise AttributeError(f"{type(self).__name__} has no fused_optimizer: none of its tables trains fused "
                                 "(give it an embedcore optimizer, or use apply_optimizer_in_backward)")
        return super().__getattr__(name)

    def __prepare_scriptable__(self):
        raise refuse_script(self)

    def _embedcore_tables(self) -> List[ec.Table]:
        return tables_of(self)

    @property
    def fused_optimizer(self):
        """The engine optimizers of this module's fused tables as a
        ``torch.optim.Optimizer`` (TorchRec's ``fused_optimizer``): its
        param groups carry each table's "lr" (learning-rate schedulers may
        change it); ``state_dict()`` holds the slots as zero-copy views.
        ``step()`` and ``zero_grad()`` do nothing: updates run in backward()."""
        from ._optim import FusedOptimizer

        fuse_pending(self)
        opt = self.__dict__.get("_fused_optimizer_cache")
        fused = [m for m in self.modules() if isinstance(m, _TableModule) and m.fused]
        if not fused:
            raise _NoFusedOptimizer
        if opt is None or [m for _, m in opt._entries] != fused:  # (a table fused since it was made)
            opt = FusedOptimizer(self)
            self.__dict__["_fused_optimizer_cache"] = opt
        return opt

    def optimizer_state_dict(self) -> dict:
        """The fused optimizers' state: ``{"state": {weight key: {"step",
        slot: tensor view}}, "param_groups": [...]}`` (empty when unfused)."""
        fuse_pending(self)
        if not any(isinstance(m, _TableModule) and m.fused for m in self.modules()):
            return {"state": {}, "param_groups": []}
        return self.fused_optimizer.state_dict()

    def load_optimizer_state_dict(self, state_dict: dict) -> None:
        """Loads slots, step counts and learning rates saved by
        ``optimizer_state_dict()`` (copied into the engine's memory)."""
        fuse_pending(self)
        if not any(isinstance(m, _TableModule) and m.fused for m in self.modules()):
            # What optimizer_state_dict() gives for it round-trips (nothing to load); any state is refused.
            if isinstance(state_dict, Mapping) and not state_dict.get("state") and not state_dict.get("param_groups"):
                return
            raise ValueError(f"{type(self).__name__} has no table trained fused (give it an embedcore optimizer): "
                             "it takes no optimizer state")
        self.fused_optimizer.load_state_dict(state_dict)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """``nn.Module.load_state_dict``, with every table's weight checked
        (present when `strict`, a dense tensor of the table's shape, with data,
        of a dtype ``copy_`` converts) before any table is
        written: PyTorch copies module by module and reports errors at the
        end, which would leave the tables loaded up to the bad one. With
        `strict`, unexpected keys are refused first too. Where a module has
        load_state_dict pre-hooks (a key migration: renamed keys, a grown
        vocabulary padded), they run first, as PyTorch runs them, and the
        tables are written once PyTorch's load has checked every key."""
        if any(m._load_state_dict_pre_hooks for m in self.modules()):
            return self._load_after_pre_hooks(state_dict, strict, assign)
        if strict:
            expected = self.state_dict(keep_vars=True)
            unexpected = [k for k in state_dict if k not in expected]
            if unexpected:
                keys = ", ".join(f'"{k}"' for k in unexpected)
                raise RuntimeError(f"Error(s) in loading state_dict for {type(self).__name__}: Unexpected key(s) in "
                                   f"state_dict: {keys}. (No table was changed.)")
        for name, m in self.named_modules():
            if not isinstance(m, _TableModule):
                continue
            key = f"{name}.weight" if name else "weight"
            if key not in state_dict:
                if strict:
                    raise RuntimeError(f'Error(s) in loading state_dict for {type(self).__name__}: Missing key(s) in '
                                       f'state_dict: "{key}". (No table was changed.)')
                continue
            problem = m._weight_problem(key, state_dict[key])
            if problem is not None:
                kind, message = problem
                if kind is ValueError:
                    raise ValueError(f"{type(self).__name__}.load_state_dict: {message}. (No table was changed.)")
                raise RuntimeError(f"Error(s) in loading state_dict for {type(self).__name__}: {message}. (No table "
                                   "was changed.)")
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    def _load_after_pre_hooks(self, state_dict, strict: bool, assign: bool):
        """``load_state_dict`` where pre-hooks must run first: PyTorch's load
        (hooks, key checks) with each table's weight checked after its hooks
        and recorded, not copied; the copies once the load has passed."""
        pending: list = []
        tables = [m for m in self.modules() if isinstance(m, _TableModule)]
        for m in tables:
            m.__dict__["_pending_load"] = pending
        try:
            result = super().load_state_dict(state_dict, strict=strict, assign=assign)
        finally:
            for m in tables:
                m.__dict__.pop("_pending_load", None)
        with torch.no_grad():
            for m, value in pending:
                m._parameters["weight"].copy_(value)
        return result

    def __getstate__(self):
        state = self.__dict__.copy()
        state.pop("_fused_optimizer_cache", None)
        state.pop("_collections", None)  # (weak references: the collection's __setstate__ makes them anew)
        return state


def _same_option(a, b) -> bool:
    """Whether two values of an optimizer option are the same (a tensor only as the same object)."""
    if a is b:
        return True
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return False
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_option(x, y) for x, y in zip(a, b))
    return a == b


class _TableModule(_AdapterModule):
    """One engine table; ``weight`` views its values."""

    _table: ec.Table

    def _create(self, name: str, num_embeddings: int, embedding_dim: int, dtype, initializer, optimizer,
                sparse: bool, padding_idx: Optional[int], weight: Optional[Tensor] = None, init_fn=None,
                device=None, combiner: str = "sum") -> None:
        """`combiner`: the table's own (what a checkpoint records and serving
        uses by default); the module passes its mode to every lookup."""
        table_device = _table_device(device)
        for what, v in (("num_embeddings", num_embeddings), ("embedding_dim", embedding_dim)):
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
                raise TypeError(f"{type(self).__name__}: {what} must be an int, got {v!r}")
            if v < 1:
                raise ValueError(f"{type(self).__name__}: {what} must be a positive int, got {v!r}")
        if optimizer is not None and not isinstance(optimizer, ec.optimizers.Optimizer):
            raise TypeError(f"{type(self).__name__}: optimizer must be an embedcore.optimizers optimizer (SGD, "
                            f"Adagrad, RowWiseAdagrad, Adam, FTRL) for fused training, or None, got {optimizer!r}")
        self.num_embeddings = int(num_embeddings)
        self.embedding_dim = int(embedding_dim)
        if padding_idx is not None:
            if isinstance(padding_idx, bool) or not isinstance(padding_idx, (int, np.integer)):
                raise TypeError(f"padding_idx must be an int, got {padding_idx!r}")
            if not -self.num_embeddings <= padding_idx < self.num_embeddings:
                raise ValueError(f"padding_idx must be within num_embeddings ({self.num_embeddings}), "
                                 f"got {padding_idx}")
            padding_idx = int(padding_idx) % self.num_embeddings
        self.padding_idx = padding_idx
        self.sparse = bool(sparse)
        if weight is not None and tuple(weight.shape) != (self.num_embeddings, self.embedding_dim):
            raise ValueError(f"_weight must have shape [{self.num_embeddings}, {self.embedding_dim}], "
                             f"got {tuple(weight.shape)}")
        if weight is not None:  # (as load_state_dict and Table.assign refuse it; lookups would return it)
            problem = _unstorable(weight, _dtype_name(dtype))
            if problem is not None:
                raise ValueError(f"{type(self).__name__}: the initial weight (_weight, from_pretrained's "
                                 f"embeddings){problem}")
        if weight is not None or init_fn is not None:
            initializer = ec.initializers.Zeros()
        elif initializer is None:
            initializer = ec.initializers.Normal(0.0, 1.0, seed=_torch_seed())  # nn.EmbeddingBag's N(0, 1)
        config = ec.TableConfig(name, self.num_embeddings, self.embedding_dim, _dtype_name(dtype), initializer,
                                optimizer, combiner)
        self._attach(ec.Table(config, device=table_device), requires_grad=True)
        with torch.no_grad():
            if weight is not None:
                self.weight.copy_(weight)
            elif init_fn is not None:
                init_fn(self.weight)
                problem = _unstorable(self.weight, "float32")  # (what it wrote, in the storage's dtype)
                if problem is not None:
                    raise ValueError(f"{type(self).__name__}: the weight its init_fn {init_fn!r} wrote{problem}: "
                                     "a table holds finite values only (lookups would return them, and a "
                                     "checkpoint refuses them)")
            if padding_idx is not None and weight is None:
                self.weight[padding_idx].fill_(0)

    def _record_padding(self) -> None:
        """Gives the table the module's current padding_idx, which checkpoints
        record (config.padding_idx), serving leaves out of pooled bags as this
        module does, and ``ec.load`` checks."""
        pad = self.__dict__.get("padding_idx")
        self._table._padding_idx = None if pad is None else int(pad) % self.num_embeddings

    def _engine_values(self) -> Tensor:
        """A tensor viewing the table's values in the engine's memory."""
        table = self._table
        values = torch.from_dlpack(table._native.values_mut() if table.device == "cpu"
                                   else table._native.device_values())
        if table.dtype == "bfloat16" and values.dtype != torch.bfloat16:
            values = values.view(torch.bfloat16)  # carried as its uint16 bits
        return values

    def _attach(self, table: ec.Table, requires_grad: bool, weight: Optional[nn.Parameter] = None) -> None:
        """The module's weight becomes a view of `table`'s values: a new
        Parameter, or `weight` itself with its values copied into the table
        (a copied module's: the Parameter that an optimizer copied in the same
        deepcopy or pickle holds)."""
        self._table = table
        self._record_padding()
        values = self._engine_values()
        if weight is None:
            weight = nn.Parameter(values, requires_grad=requires_grad)
        else:
            with torch.no_grad():
                values.copy_(weight)
            weight.data = values
        self.weight = weight
        self._values_ptr = values.data_ptr()
        self._training_state()

    def _training_state(self) -> None:
        """The slots' views, the anchors, the parameter group and the
        registration of the table's current optimizer (or of none); the
        group last, as another thread's lookup takes it to mean the rest is
        there."""
        table = self._table
        host = table.device == "cpu"
        self._slots = {n: torch.from_dlpack(v)
                       for n, v in (table._native.slots_mut() if host else table._native.device_slots())}
        fused = table.optimizer is not None
        # Fused training: autograd runs the backward through this one-element anchor;
        # its gradient is the output of the op that applies the update.
        self._anchor = torch.zeros(1, requires_grad=True, device=self.weight.device) if fused else None
        self._frozen_anchor = self._anchor.detach() if fused else None  # no gradient: no update
        group = None
        ib = self._in_backward_group() if fused else None
        if fused:
            group = {"params": [self.weight], "lr": table.learning_rate(), "table": table.name,
                     "optimizer": type(table.optimizer).__name__}
            if self.__dict__.get("_lr_decay"):  # an in-backward Adagrad's (_ops.fused_rate applies it)
                group["lr_decay"] = self._lr_decay
            if ib is not None:  # its rate rules from now on, with fused_optimizer's (_sync_in_backward)
                group["lr"] = ib["lr"]
                # What the engine's optimizer was made with (apply_optimizer_in_backward's kwargs over the
                # optimizer's defaults: its `defaults`), not the group's values now, which a scheduler or a hand
                # may have changed before this first lookup: such a change is refused at once.
                made = self._in_backward_defaults()
                self._ib_seen = (ib["lr"], {k: made.get(k, v) for k, v in ib.items() if k not in ("params", "lr")})
        # Registered while the module or an autograd graph of its lookups can use the table: the graph keeps
        # the anchors alive (the weight unfused; fused, the group holds the weight, and the anchors stand for it).
        holders = (self, self._anchor, self._frozen_anchor) if fused else (self, self.weight)
        sync = weakref.WeakMethod(self._sync_in_backward) if ib is not None else None
        self._handle = _ops.register(table, group, holders, sync=sync,
                                     anchors=(self._anchor,) if fused else (self.weight,),
                                     features=getattr(self, "_features", None))
        self._handle_t = _ops.handle_tensor(self._handle)  # (what the op takes: see handle_tensor)
        self._group = group
        if fused and self.weight.requires_grad:
            self._refuse_weight_gradients(self.weight)
        if fused:  # its group and slot views are of this optimizer: Table.set_optimizer refuses to replace it
            # while the registration lives (this module, or a graph of its lookups whose backward steps it)
            table._hold_optimizer(_ops._entry(self._handle), f"a PyTorch {type(self).__name__}")

    def _name_features(self, features) -> None:
        """The features a collection reads this table for (segment k: ``features[k]``), which an id out of
        range names where there are several; eagerly the collection names them itself, but a compiled
        collection's error is the op's."""
        self._features = list(features)
        _ops._entry(self._handle).features = self._features

    def _sync_in_backward(self, check: bool = True) -> None:
        """Before a fused step of a table fused from apply_optimizer_in_backward
        (TorchRec's recipe, whose schedulers step ``param._in_backward_optimizers``),
        and before ``fused_optimizer.state_dict()`` or a copy of the module:
        a rate set on that optimizer (by hand, by a scheduler, by its
        ``load_state_dict``, which replaces its groups) becomes the fused
        group's, and a rate set on ``fused_optimizer`` shows on it, so both
        optimizers show the one rate the steps use. Its other options are
        the engine optimizer's, made once: a change of one (a scheduler that
        cycles momentum or betas) raises ``ValueError`` rather than being
        ignored (with `check`; reads take the rate alone)."""
        if self._group is not None:  # (first: a rate set on the engine's optimizer, then the in-backward one's)
            _ops.adopt_optimizer_rate(_ops._entry(self._handle))
        ib, group = self._in_backward_group(), self._group
        if ib is None or group is None:
            return
        seen_lr, options = self._ib_seen
        for k, v in options.items() if check else ():
            now = ib.get(k, v)
            if not _same_option(now, v):
                raise ValueError(
                    f"{type(self).__name__}: table '{self._table.name}' trains fused with the engine's "
                    f"{type(self._table.optimizer).__name__}, made from apply_optimizer_in_backward's optimizer "
                    f"with {k}={v!r}; that optimizer's {k} is now {now!r}, which the engine's does not follow (only "
                    "its lr): keep it (a scheduler: cycle_momentum=False), or pass optimizer= an embedcore "
                    "optimizer")
        lr = ib["lr"]
        if not _same_option(lr, seen_lr):
            group["lr"] = lr  # set on the in-backward optimizer
        else:
            ib["lr"] = group["lr"]  # set on fused_optimizer, or on neither
        self._ib_seen = (group["lr"], options)

    def _in_backward_group(self) -> Optional[dict]:
        """The param group of the apply_optimizer_in_backward optimizer this
        table was fused from, or None."""
        if not self.__dict__.get("_from_in_backward"):
            return None
        groups = [g for opt in self.weight.__dict__.get("_in_backward_optimizers", ()) for g in opt.param_groups
                  if any(p is self.weight for p in g["params"])]
        return groups[0] if len(groups) == 1 else None

    def _in_backward_defaults(self) -> dict:
        """The options the apply_optimizer_in_backward optimizer was made with."""
        opts = self.weight.__dict__.get("_in_backward_optimizers", ())
        return dict(opts[0].defaults) if len(opts) == 1 else {}

    def _owner(self) -> str:
        """The module and its table, as errors name them."""
        return f"{type(self).__name__} (table '{self._table.name}')"

    def _fuse_in_backward_optimizer(self, weight: Tensor, whole: bool = True) -> bool:
        """Trains the table fused with the engine's equal of the optimizer
        that ``apply_optimizer_in_backward`` gave `weight` (TorchRec's way to
        ask for a fused optimizer), if it gave one: the table takes that
        optimizer (new slots, step 0) and lookups give the weight no
        gradient from then on, so the hook that would run the PyTorch
        optimizer does not fire; a gradient the weight gets otherwise
        (weight tying, a penalty on it), which neither optimizer would
        apply, raises in backward. True when the table trains fused.

        Not once PyTorch's optimizer has stepped the weight (a module that
        torch.compile traced before any eager call trains unfused, where the
        switch is not traceable): its state would be lost, so that optimizer
        goes on training the table.

        A table of a collection (`whole`) first checks the optimizer of
        every pending table of that collection (``check_pending``): where
        one is refused, none of them fuses, this one included. It fuses
        only itself: a sibling fuses at its own lookup (a graph traced
        before may still hold its weight unfused). Only until the table is
        fused: a fused table's lookups do not come here."""
        if self._group is not None:
            return True
        if _optim.stepped(weight):
            return False
        if whole:
            for ref in self.__dict__.get("_collections", ()):
                collection = ref()
                if collection is not None and any(m is self for m in collection.modules()):
                    check_pending(collection)  # (raises, naming the table, before any table changes)
                    break
        with _FUSE_LOCK:  # two threads' first lookups: one converts
            if self._group is not None:
                return True
            if _optim.stepped(weight):
                return False
            found = _optim.engine_optimizer(weight, self._owner())
            if found is None:
                return False
            optimizer, lr_decay = found
            # Under the table's step lock, which Table.set_optimizer takes: another thread's set_optimizer comes
            # after the table is marked fused (_training_state) and is refused, not in between.
            with self._table._schedule_lock():
                self._table.set_optimizer(optimizer)
                self._lr_decay = lr_decay  # (the group made below keeps it)
                self._from_in_backward = True  # before the group appears: another thread's lookup may see it
                self._training_state()  # the old registration stays for graphs made before (released with them)
            return True

    def _refuse_weight_gradients(self, weight: Tensor) -> None:
        """A fused table's weight gets no gradient from its lookups (theirs
        goes to the anchor, and the engine's optimizer steps on it); one it
        gets otherwise (weight tying, a penalty on the weight) neither that
        optimizer nor a dense one that leaves the weight out (docs/torch.md's
        recipe) would apply, so backward raises instead. Once per weight (a
        copied weight has no hooks); called by each trainable fused lookup,
        so a weight unfrozen later, or a copy's, has it too."""
        hooks = weight._backward_hooks
        if hooks and any(getattr(h, "_embedcore_refuses", False) for h in hooks.values()):
            return
        owner = weakref.ref(self)

        def refuse(grad):
            if grad is None:  # (compiled autograd may call the hook without one)
                return
            module = owner()
            if module is None:
                return
            table = module._table
            how, unfused = (("from apply_optimizer_in_backward", "sparse=False and no apply_optimizer_in_backward")
                            if module.__dict__.get("_from_in_backward") else ("optimizer=", "no optimizer="))
            raise RuntimeError(
                f"{type(module).__name__}: table '{table.name}' trains fused with the engine's "
                f"{type(table.optimizer).__name__} ({how}), which steps on its lookups' gradients; its weight got a "
                "gradient of its own (weight tying, or a penalty on the weight), which neither that optimizer nor "
                f"PyTorch's would apply. Keep the weight out of other terms of the loss, or train it unfused (pass "
                f"{unfused}, and give the weight to a PyTorch optimizer)")

        refuse._embedcore_refuses = True
        weight.register_hook(refuse)

    # ------------------------------------------------------------ lookup
    @property
    def fused(self) -> bool:
        """Whether the engine's optimizer trains this table inside backward()."""
        return self._group is not None

    @property
    def table(self) -> ec.Table:
        """The engine's table (lookups, checkpoints, serving)."""
        return self._table

    def _weight_param(self) -> Tensor:
        """The weight (not ``self.weight``, nn.Module's ``__getattr__``: a
        microsecond a call); NotImplementedError where a parametrization or
        pruning took it out of ``_parameters``."""
        weight = self._parameters.get("weight")
        if weight is None:
            raise NotImplementedError(
                f"{type(self).__name__}: its weight is under a parametrization (torch.nn.utils.parametrize, or "
                "torch.nn.utils.prune), which is not supported: the table lives in embedcore's memory, and the "
                "lookup reads it there, not through the parametrization")
        return weight

    def _anchor_and_mode(self, stacklevel: int = 3) -> Tuple[Tensor, int]:
        """The tensor that carries this call's autograd and the gradient mode
        (``_ops.FUSED`` / ``SPARSE`` / ``DENSE``), after the checks every
        lookup makes: the weight still views the table; fused training of
        replicas warns."""
        # (About a microsecond a call: 26 calls in a DLRM-shaped step. self.weight would be nn.Module's
        # __getattr__, a microsecond on its own.)
        weight = self._weight_param()
        compiling = torch.compiler.is_compiling()
        in_backward = False  # whether apply_optimizer_in_backward named an optimizer for the weight
        if not compiling:  # (neither data_ptr nor a tensor's __dict__ is traceable)
            if weight.data_ptr() != self._values_ptr:
                raise RuntimeError(f"{type(self).__name__}: weight no longer views the engine's table (its storage "
                                   "was replaced, e.g. by weight.data = ..., or the weight swapped for another "
                                   "tensor by torch.func.functional_call, which is not supported); the table and "
                                   "the module would disagree. Copy values in with weight.copy_() or "
                                   "load_state_dict")
            in_backward = "_optimizer_classes" in weight.__dict__
        if self._group is None:
            if not (in_backward and self._fuse_in_backward_optimizer(weight)):
                return weight, (_ops.SPARSE if self.sparse else _ops.DENSE)
        elif in_backward and not self.__dict__.get("_from_in_backward"):
            raise ValueError(f"{type(self).__name__}: table '{self._table.name}' trains with optimizer= "
                             f"{type(self._table.optimizer).__name__}, and apply_optimizer_in_backward named "
                             f"another for its weight; give one of them")
        if not (weight.requires_grad and torch.is_grad_enabled()):
            return self._frozen_anchor, _ops.FUSED
        if not compiling:
            self._refuse_weight_gradients(weight)
            # A rate the update cannot use raises now, before any backward: with dict inputs each table has its
            # own backward, and the others would step before this one's raised. (Not traced: a compiled graph
            # would guard on the rate's value, and recompile whenever a scheduler changed it; its backward
            # still checks.) A group's rate is checked again only once it is another object (a scheduler's).
            # (Only a float is remembered: a tensor rate may change in place.)
            self._sync_in_backward()
            group = self._group
            lr = None if group is None else group.get("lr")
            optimizer = self._table.optimizer
            cached = self.__dict__.get("_checked_lr")
            if cached is None or cached[0] is not lr or cached[1] is not optimizer:
                _ops.fused_rate(self._table, group)
                if type(lr) is float and not callable(optimizer.learning_rate):
                    self.__dict__["_checked_lr"] = (lr, optimizer)
        if not compiling and not self.__dict__.get("_warned_replicas") and _replicated():
            self._warned_replicas = True
            warnings.warn(
                f"{type(self).__name__}: fused training in a job of {torch.distributed.get_world_size()} ranks: "
                "each rank's engine updates its own copy of the table from its own gradients in the backward, "
                "and DistributedDataParallel does not synchronize it, so the copies drift apart. Shard the "
                "tables (world=, see docs/torch.md) or, under DDP, train unfused with sparse=False (a fused "
                "weight gets no gradient: DDP then needs find_unused_parameters=True, else it raises at the next "
                "iteration)",
                RuntimeWarning, stacklevel=stacklevel)
        return self._anchor, _ops.FUSED

    def _lookup(self, ids: List[Tensor], offsets: List[Tensor], weights: List[Tensor], segments: List[int],
                combiner: int, include_last_offset: bool) -> List[Tensor]:
        _ops.refuse_traced_bag_counts(type(self).__name__, segments)
        weight = self._weight_param()
        on_cpu = weight.is_cpu  # (cheaper than comparing devices: this runs on caches a lookup left cold)
        for group, what in ((ids, "ids"), (offsets, "offsets"), (weights, "per_sample_weights")):
            for t in group:
                if (not t.is_cpu) if on_cpu else (t.device != weight.device):
                    raise RuntimeError(f"Expected all tensors to be on the same device: the table of "
                                       f"{type(self).__name__} is on {weight.device}, {what} on {t.device}")
        anchor, mode = self._anchor_and_mode(stacklevel=4)
        pad = -1 if self.padding_idx is None else int(self.padding_idx) % self.num_embeddings  # (-1: the last row)
        # Eagerly, the op's body and autograd without the dispatcher (the same code and results).
        op = _ops.eager_lookup if _ops.plain_eager([anchor, *ids, *offsets, *weights]) else _ops.lookup
        step = _ops.needs_step(mode, weights)
        handle = self._handle if op is _ops.eager_lookup else self._handle_t  # (the op's: a tensor)
        outs = op(anchor, handle, self.embedding_dim, ids, offsets, weights, segments, combiner, pad,
                  include_last_offset, mode, step)
        outs = outs[:-1] if step else outs  # the step is for the backward
        if mode == _ops.FUSED and anchor is self._anchor:
            outs = refuse_float16_backward(weight.device.type, type(self).__name__, list(outs))
        return outs

    # ------------------------------------------------------------ state
    def _weight_problem(self, key: str, value) -> Optional[Tuple[type, str]]:
        """What makes `value` (the state dict's `key`) unfit for this table's
        weight, as (exception type, message), or None; copy_ would refuse it
        only after earlier tables were written."""
        if _sharded(value):  # (its layout attribute raises)
            return RuntimeError, (f"{key} is a {type(value).__name__} (a sharded module's state); a table's weight "
                                  "loads from one tensor: gather its shards into one first")
        if isinstance(value, Tensor) and (value.layout != torch.strided or value.is_nested):
            layout = "nested" if value.is_nested else str(value.layout)
            return RuntimeError, (f"{key} is a {layout} tensor; a table's weight loads from a dense (torch.strided) "
                                  "one (e.g. value.to_dense())")
        if not isinstance(value, Tensor):  # PyTorch's own words for it
            return RuntimeError, (f'While copying the parameter named "{key}", expected torch.Tensor or Tensor-like '
                                  f"object from checkpoint but received {type(value)}")
        weight = self._weight_param()
        if tuple(value.shape) != tuple(weight.shape):
            return RuntimeError, (f"size mismatch for {key}: copying a param with shape {tuple(value.shape)} from "
                                  f"checkpoint, the shape in current model is {tuple(weight.shape)}")
        if value.device.type == "meta":
            return RuntimeError, f"{key} is on the meta device (it holds no data)"
        if not _copyable(value.dtype, weight.dtype):
            return RuntimeError, (f"{key} has dtype {value.dtype}, which cannot be copied into the table's "
                                  f"{weight.dtype} weight{' (dequantize it first)' if value.is_quantized else ''}")
        problem = _unstorable(value, self._table.dtype)
        if problem is not None:
            return ValueError, f"{key}{problem}; Table.assign and ec.save refuse it too"
        return None

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # Always copy into the engine's memory: assigning would detach `weight` from the table.
        local_metadata = dict(local_metadata, assign_to_params_buffers=False)
        pending = self.__dict__.get("_pending_load")
        if pending is not None:  # (_load_after_pre_hooks) this module's hooks first, then the weight's checks
            hooks = self._load_state_dict_pre_hooks
            for hook in hooks.values():
                hook(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)
            key = prefix + "weight"
            if key in state_dict:
                problem = self._weight_problem(key, state_dict[key])
                if problem is not None:
                    error_msgs.append(problem[1])
                    return
                pending.append((self, state_dict[key]))
                state_dict[key] = self._weight_param()  # (copy_ of a tensor into itself: nothing written now)
            self._load_state_dict_pre_hooks = collections.OrderedDict()  # (they ran above)
            try:
                nn.Module._load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                                                unexpected_keys, error_msgs)
            finally:
                self._load_state_dict_pre_hooks = hooks
            return
        value = state_dict.get(prefix + "weight")
        if _sharded(value):
            error_msgs.append(f"{prefix}weight is a {type(value).__name__} (a sharded module's state); a table's "
                              "weight loads from one tensor: gather its shards into one first")
            return
        if isinstance(value, Tensor) and tuple(value.shape) == tuple(self.weight.shape):
            problem = _unstorable(value, self._table.dtype)  # (a model holding this module: PyTorch's order)
            if problem is not None:
                error_msgs.append(f"{prefix}weight{problem}; Table.assign and ec.save refuse it too")
                return
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def share_memory(self):
        # nn.Module.share_memory would move `weight` into new shared memory, cutting it off from the table.
        raise NotImplementedError(f"{type(self).__name__}: the table lives in embedcore's memory and cannot be "
                                  "moved to shared memory; share a checkpoint (ec.save / ec.serving.open) instead")

    def _apply(self, fn, recurse=True):
        if "_table" in self.__dict__:
            w = self.weight
            ptr = w.data_ptr()
            out = fn(w)
            if w.data_ptr() != ptr:  # fn moved the weight's storage in place (a parent's share_memory())
                w.data = self._engine_values()
                self.share_memory()  # raises, saying why
            if out is not w and (out.dtype != w.dtype or out.device != w.device):
                raise NotImplementedError(
                    f"{type(self).__name__}: the table lives in embedcore's memory ({w.dtype}, {w.device}) and cannot "
                    f"be converted to {out.dtype} on {out.device}; choose the dtype and device when creating the "
                    "module")
            if out is not w and out.data_ptr() != ptr:
                raise NotImplementedError(
                    f"{type(self).__name__}: the table lives in embedcore's memory and cannot be moved to new memory "
                    "(to_empty(), or a function that returns a copy); share or reload a checkpoint (ec.save / "
                    "ec.load / ec.serving.open) instead")
        return super()._apply(fn, recurse)

    def __getstate__(self):
        self._sync_in_backward(check=False)  # (the group's "lr" is the rate the next step uses)
        state = super().__getstate__()
        table = state.pop("_table")
        for k in ("_handle", "_handle_t", "_slots"):
            state.pop(k, None)
        slots = {k: v.detach().cpu().numpy().copy() for k, v in self._slots.items()}
        # The group's own keys too (a scheduler's "initial_lr", a user's), as a copy of a torch optimizer keeps them.
        group = None if self._group is None else {k: v for k, v in self._group.items() if k != "params"}
        state["_table_snapshot"] = (table.config, table.step, slots, None if self._group is None else self._group["lr"],
                                    table.device, group)
        return state

    def __setstate__(self, state):
        config, step, slots, lr, *rest = state.pop("_table_snapshot")
        device = rest[0] if rest else "cpu"  # (pickles from before GPU modules hold four items)
        group = rest[1] if len(rest) > 1 else None  # (and from before the group's keys, five)
        super().__setstate__(state)
        # A dict of parameters of its own: copy.copy(module)'s state shares the original's, whose weight
        # _attach would otherwise point at this copy's new table.
        self.__dict__["_parameters"] = type(self._parameters)(self._parameters)
        old = self._parameters["weight"]
        # The table's own initializer, though the values are copied over it: reset_parameters() and a
        # checkpoint's config need it.
        table = ec.Table(config, device=None if device == "cpu" else device)
        # A deep copy's (or an unpickled) Parameter stays the weight: a torch optimizer copied with the module (one
        # deepcopy or pickle of both) holds it in its param_groups and state; a new one left that optimizer
        # stepping an orphan. copy.copy's is the original's own weight, a view of the original's table: not that.
        shared = old.data_ptr() == self.__dict__.get("_values_ptr")
        self._attach(table, requires_grad=old.requires_grad, weight=None if shared else old)
        if shared:
            with torch.no_grad():
                self.weight.copy_(old)
        with torch.no_grad():
            for k, v in slots.items():
                if device == "cpu":
                    table.assign_slot(k, v)
                else:
                    self._slots[k].copy_(torch.from_numpy(v))
        table.step = step
        if group is not None and self._group is not None:
            self._group.update(group)
        if lr is not None:
            self._group["lr"] = lr


def fuse_pending(module: nn.Module) -> None:
    """Fuses, now, every table of `module` whose weight
    ``apply_optimizer_in_backward`` gave an optimizer (as its next lookup
    would), so that its optimizer state exists before the first step: to
    load a checkpoint's, or to hand to a learning-rate scheduler. An
    optimizer the engine does not have raises, naming its table, before
    any table changes."""
    for m, weight in check_pending(module):
        m._fuse_in_backward_optimizer(weight, whole=False)


def check_pending(module: nn.Module) -> list:
    """The tables of `module` that ``apply_optimizer_in_backward`` asked to
    fuse and that are not fused yet, as (module, weight); raises, naming
    the table, for one whose optimizer the engine does not have."""
    pending = []
    for m in module.modules():
        if isinstance(m, _TableModule) and m._group is None:
            weight = m._parameters["weight"]
            if "_optimizer_classes" in weight.__dict__:
                if not _optim.stepped(weight):
                    _optim.engine_optimizer(weight, m._owner())  # (raises for one the engine lacks)
                pending.append((m, weight))
    return pending


def tables_of(module: nn.Module) -> List[ec.Table]:
    """The embedcore tables of every adapter module inside `module`, for
    ``ec.save(path, tables_of(model))`` / ``ec.load(path, into=...)``. A
    checkpoint names its tables: two modules whose tables have one name (two
    ``EmbeddingBag`` made without ``name=`` are both "embedding_bag") raise
    ``ValueError`` naming both module paths. A table that
    ``apply_optimizer_in_backward`` asked to fuse is fused first (as its next
    lookup would, raising as it would for an optimizer the engine does not
    have), so that a load has its optimizer's slots to fill. A sharded
    collection inside `module` raises ``ValueError``: each rank holds a part
    of its tables, saved by ``ec.save(path, collection)`` on every rank."""
    from ._sharded import _Sharded  # (it imports this module)

    for path, m in module.named_modules():
        if isinstance(m, _Sharded):  # its tables are spread over the ranks: left out, the save would miss them
            raise ValueError(f"tables_of: {path or '(the model)'!r} is a {type(m).__name__}, whose tables each rank "
                             f"holds a part of: save and load it with ec.save(path, module) / ec.load(path, module) "
                             f"on every rank, apart from the other modules' tables")
    fuse_pending(module)
    tables, where = [], {}
    for path, m in module.named_modules():
        if isinstance(m, _TableModule):
            name = m._table.name
            if name in where:
                raise ValueError(f"tables_of: the modules {where[name] or '(the model)'!r} and {path!r} both hold a "
                                 f"table named {name!r}; a checkpoint names its tables: give the modules distinct "
                                 "names (name=...)")
            where[name] = path
            m._record_padding()
            tables.append(m._table)
    return tables


class EmbeddingBag(_TableModule):
    """A drop-in for ``torch.nn.EmbeddingBag`` over an embedcore table.

    The same arguments, forward forms (1-D ids with ``offsets``, 2-D ids of
    fixed-length bags, ``include_last_offset``, ``padding_idx``,
    ``per_sample_weights`` with ``mode="sum"``) and outputs, plus:

    mode: "sum", "mean" or "sqrtn" (``sum / sqrt(bag size)``); "max" is not
        supported.
    optimizer: an ``embedcore.optimizers`` optimizer to train fused (the
        update runs inside ``backward()``); None to train with a PyTorch
        optimizer through ``weight.grad`` (sparse with ``sparse=True``).
    initializer: an ``embedcore.initializers`` initializer (default: N(0, 1)
        as PyTorch's, seeded from PyTorch's generator).
    name: the table's name in embedcore checkpoints.

    ``max_norm`` and ``scale_grad_by_freq`` are not supported. The output is
    float32 (cast to ``dtype`` when that is float16 / bfloat16).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, max_norm: Optional[float] = None,
                 norm_type: float = 2.0, scale_grad_by_freq: bool = False, mode: str = "mean", sparse: bool = False,
                 _weight: Optional[Tensor] = None, include_last_offset: bool = False,
                 padding_idx: Optional[int] = None, device=None, dtype=None, *,
                 optimizer: Optional[ec.optimizers.Optimizer] = None,
                 initializer: Optional[ec.initializers.Initializer] = None, name: str = "embedding_bag",
                 _init_fn=None):
        super().__init__()
        if max_norm is not None:
            raise NotImplementedError("EmbeddingBag: max_norm is not supported by embedcore")
        if scale_grad_by_freq:
            raise NotImplementedError("EmbeddingBag: scale_grad_by_freq is not supported by embedcore")
        if mode == "max":
            raise NotImplementedError("EmbeddingBag: mode='max' is not supported by embedcore (sum, mean, sqrtn)")
        if mode not in _MODES:
            raise ValueError(f"EmbeddingBag: mode must be 'sum', 'mean' or 'sqrtn', got {mode!r}")
        self.mode = mode
        self.max_norm, self.norm_type, self.scale_grad_by_freq = None, norm_type, False
        self.include_last_offset = bool(include_last_offset)
        self._create(name, num_embeddings, embedding_dim, dtype, initializer, optimizer, sparse, padding_idx,
                     _weight, _init_fn, device, combiner=mode)

    @classmethod
    def from_pretrained(cls, embeddings: Tensor, freeze: bool = True, max_norm=None, norm_type: float = 2.0,
                        scale_grad_by_freq: bool = False, mode: str = "mean", sparse: bool = False,
                        include_last_offset: bool = False, padding_idx: Optional[int] = None,
                        **kwargs) -> "EmbeddingBag":
        """A table holding a copy of `embeddings` (``[rows, dim]``), as
        ``nn.EmbeddingBag.from_pretrained``; ``freeze`` stops its training."""
        if embeddings.dim() != 2:
            raise ValueError("Embeddings parameter is expected to be 2-dimensional")
        rows, dim = embeddings.shape
        if embeddings.device.type == "cuda":  # as nn.EmbeddingBag.from_pretrained, the table stays on its device
            kwargs.setdefault("device", embeddings.device)
        m = cls(rows, dim, max_norm, norm_type, scale_grad_by_freq, mode, sparse, embeddings, include_last_offset,
                padding_idx, dtype=_pretrained_dtype(cls.__name__, embeddings, kwargs), **kwargs)
        m.weight.requires_grad = not freeze
        return m

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.weight.normal_()
            if self.padding_idx is not None:
                self.weight[self.padding_idx].fill_(0)

    def forward(self, input: Tensor, offsets: Optional[Tensor] = None,
                per_sample_weights: Optional[Tensor] = None) -> Tensor:
        if not (type(input) is Tensor and type(offsets) in _PLAIN and type(per_sample_weights) in _PLAIN):
            refuse_fx_proxy(self, input, offsets, per_sample_weights)  # (an FX Proxy is no Tensor: none in plain ones)
        check_ids(input, "input")
        include_last = self.include_last_offset
        if input.dim() == 2:
            if offsets is not None:
                raise ValueError("if input is 2D, then offsets has to be None, as input is treated is a mini-batch "
                                 f"of fixed length sequences. However, found offsets of type {type(offsets)}")
            batch, length = input.shape
            ids = input.reshape(-1)
            offsets = (torch.arange(0, batch * length + 1, length, dtype=torch.int64, device=input.device) if length
                       else torch.zeros(batch + 1, dtype=torch.int64, device=input.device))
            include_last = True
        elif input.dim() == 1:
            if offsets is None:
                raise ValueError("offsets has to be a 1D Tensor but got None")
            check_ids(offsets, "offsets")
            if offsets.dim() != 1:
                raise ValueError("offsets has to be a 1D Tensor")
            ids = input
        else:
            raise ValueError(f"input has to be 1D or 2D Tensor, but got Tensor of dimension {input.dim()}")
        weights: List[Tensor] = []
        if per_sample_weights is not None:
            if self.mode != "sum":
                raise NotImplementedError(
                    "embedding_bag: per_sample_weights was not None. per_sample_weights is only supported for "
                    f"mode='sum' (got mode='{self.mode}')")
            check_weights(per_sample_weights, input, "per_sample_weights")
            weights = [per_sample_weights.reshape(-1)]
        if include_last and offsets.shape[0] < 1:
            raise ValueError("include_last_offset: number of offsets should be at least 1")
        bags = offsets.shape[0] - 1 if include_last else offsets.shape[0]
        out = self._lookup([ids], [offsets], weights, [0, 0, bags], _MODES[self.mode], include_last)[0]
        dtype = self._weight_param().dtype
        return out if dtype == torch.float32 else out.to(dtype)

    def extra_repr(self) -> str:
        s = f"{self.num_embeddings}, {self.embedding_dim}, mode={self.mode!r}"
        if self.padding_idx is not None:
            s += f", padding_idx={self.padding_idx}"
        if self.include_last_offset:
            s += ", include_last_offset=True"
        if self.weight.dtype != torch.float32:
            s += f", dtype={self.weight.dtype}"
        s += f", optimizer={self._table.optimizer!r}" if self.fused else f", sparse={self.sparse}"
        return s + f", table={self._table.name!r}"


class Embedding(_TableModule):
    """A drop-in for ``torch.nn.Embedding`` over an embedcore table: ids of
    any shape in, ``[*ids.shape, embedding_dim]`` float32 out. Training and
    extra arguments as ``EmbeddingBag``. With ``padding_idx`` the padding
    row is returned as stored (zero unless overwritten) and gets no update."""

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: Optional[int] = None,
                 max_norm: Optional[float] = None, norm_type: float = 2.0, scale_grad_by_freq: bool = False,
                 sparse: bool = False, _weight: Optional[Tensor] = None, _freeze: bool = False, device=None,
                 dtype=None, *, optimizer: Optional[ec.optimizers.Optimizer] = None,
                 initializer: Optional[ec.initializers.Initializer] = None, name: str = "embedding", _init_fn=None):
        super().__init__()
        if max_norm is not None:
            raise NotImplementedError("Embedding: max_norm is not supported by embedcore")
        if scale_grad_by_freq:
            raise NotImplementedError("Embedding: scale_grad_by_freq is not supported by embedcore")
        self.max_norm, self.norm_type, self.scale_grad_by_freq = None, norm_type, False
        self._create(name, num_embeddings, embedding_dim, dtype, initializer, optimizer, sparse, padding_idx,
                     _weight, _init_fn, device)
        if _freeze:
            self.weight.requires_grad = False

    @classmethod
    def from_pretrained(cls, embeddings: Tensor, freeze: bool = True, padding_idx: Optional[int] = None,
                        max_norm=None, norm_type: float = 2.0, scale_grad_by_freq: bool = False,
                        sparse: bool = False, **kwargs) -> "Embedding":
        if embeddings.dim() != 2:
            raise ValueError("Embeddings parameter is expected to be 2-dimensional")
        rows, dim = embeddings.shape
        if embeddings.device.type == "cuda":
            kwargs.setdefault("device", embeddings.device)
        return cls(rows, dim, padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse, embeddings, freeze,
                   dtype=_pretrained_dtype(cls.__name__, embeddings, kwargs), **kwargs)

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.weight.normal_()
            if self.padding_idx is not None:
                self.weight[self.padding_idx].fill_(0)

    def forward(self, input: Tensor) -> Tensor:
        if type(input) is not Tensor:
            refuse_fx_proxy(self, input)  # (an FX Proxy is no Tensor: none in a plain one)
        check_ids(input, "input")
        out = self._lookup([input.reshape(-1)], [], [], [0, 0, _ops.WHOLE], _ops.SEQUENCE, True)[0]
        out = out.reshape(*input.shape, self.embedding_dim)
        dtype = self._weight_param().dtype
        return out if dtype == torch.float32 else out.to(dtype)

    def extra_repr(self) -> str:
        s = f"{self.num_embeddings}, {self.embedding_dim}"
        if self.padding_idx is not None:
            s += f", padding_idx={self.padding_idx}"
        s += f", optimizer={self._table.optimizer!r}" if self.fused else f", sparse={self.sparse}"
        return s + f", table={self._table.name!r}"
