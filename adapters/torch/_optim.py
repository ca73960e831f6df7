"""``FusedOptimizer``: the engine optimizers of fused tables, shaped like
TorchRec's ``fused_optimizer`` (a ``torch.optim.Optimizer``); and the engine
optimizer equal to the one ``apply_optimizer_in_backward`` gives a weight."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

import embedcore as ec
from embedcore.table import slot_problem

from . import _ops

__all__ = ["FusedOptimizer"]

# The in-backward optimizers the engine has, by qualified class name: (its
# default learning rate, the engine optimizer from the learning rate and the
# remaining keyword arguments). Each updates only the rows with a nonzero
# gradient, as the engine does; options that would change that, or that the
# engine lacks, are refused (_options).
_IN_BACKWARD = {
    "torch.optim.sgd.SGD": (1e-3, lambda lr, o: ec.optimizers.SGD(lr)),
    "torch.optim.adagrad.Adagrad": (1e-2, lambda lr, o: ec.optimizers.Adagrad(
        lr, initial_accumulator_value=o.pop("initial_accumulator_value", 0.0), epsilon=o.pop("eps", 1e-10))),
    "torchrec.optim.rowwise_adagrad.RowWiseAdagrad": (1e-2, lambda lr, o: ec.optimizers.RowWiseAdagrad(
        lr, initial_accumulator_value=o.pop("initial_accumulator_value", 0.0), epsilon=o.pop("eps", 1e-10))),
    "torch.optim.sparse_adam.SparseAdam": (1e-3, lambda lr, o: ec.optimizers.Adam(
        lr, *_betas(o.pop("betas", (0.9, 0.999))), epsilon=o.pop("eps", 1e-8), bias_correction=True,
        sum_inside_sqrt=False)),
}
# Options that change nothing at these values; None: at any value (implementation switches, and
# dampening, which does nothing without momentum).
_NEUTRAL = {"momentum": 0, "dampening": None, "nesterov": False, "weight_decay": 0, "maximize": False,
            "foreach": None, "differentiable": None, "fused": None, "capturable": None}


def _betas(betas) -> Tuple[float, float]:
    b1, b2 = betas
    return float(b1), float(b2)


def stepped(param: torch.Tensor) -> bool:
    """Whether an optimizer ``apply_optimizer_in_backward`` gave `param` has
    taken a step (its state counts one; Adagrad makes its state, at step 0,
    when it is made; SGD keeps none, and has none to lose)."""
    return any(float(st.get("step", 0)) > 0 for opt in param.__dict__.get("_in_backward_optimizers", ())
               for st in opt.state.values())


def engine_optimizer(param: torch.Tensor, owner: str) -> Optional[Tuple[ec.optimizers.Optimizer, float]]:
    """The engine optimizer equal to the one that
    ``torch.distributed.optim._apply_optimizer_in_backward`` (TorchRec's
    ``apply_optimizer_in_backward``) recorded on `param`, and its Adagrad
    ``lr_decay`` (0 without one; the param group keeps it, as PyTorch's
    does, and ``_ops.fused_rate`` applies it to the group's current "lr"),
    or None when it recorded none. NotImplementedError, naming it, for an
    optimizer or an option the engine does not have."""
    classes = param.__dict__.get("_optimizer_classes")
    if not classes:
        return None
    kwargs_list = param.__dict__.get("_optimizer_kwargs") or [{}]
    if len(classes) != 1:
        raise NotImplementedError(f"{owner}: apply_optimizer_in_backward gave the weight {len(classes)} optimizers "
                                  f"({[c.__name__ for c in classes]}); the engine trains a table with one")
    cls = classes[0]
    name = f"{cls.__module__}.{cls.__qualname__}"
    if name not in _IN_BACKWARD:
        raise NotImplementedError(
            f"{owner}: apply_optimizer_in_backward({cls.__name__}, ...) has no engine equivalent; the engine fuses "
            "torch.optim.SGD, torch.optim.Adagrad, torch.optim.SparseAdam and torchrec.optim.RowWiseAdagrad "
            "(or pass optimizer= an embedcore.optimizers optimizer)")
    options = dict(kwargs_list[0])
    default_lr, make = _IN_BACKWARD[name]
    lr = float(options.pop("lr", default_lr))
    lr_decay = float(options.pop("lr_decay", 0.0))
    optimizer = make(lr, options)
    changed = {k: v for k, v in options.items()
               if k not in _NEUTRAL or (_NEUTRAL[k] is not None and v != _NEUTRAL[k])}
    if changed:
        raise NotImplementedError(f"{owner}: apply_optimizer_in_backward({cls.__name__}, ...) with {changed}: the "
                                  "engine's optimizer has no such option (weight_decay, for one, would move every "
                                  "row at every step); pass optimizer= an embedcore.optimizers optimizer instead")
    optimizer.learning_rate_at(0)  # a rate float32 cannot hold raises here, before the table changes
    return optimizer, lr_decay


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the memory spans of tensors `a` and `b` overlap (whichever
    tensors own the memory)."""
    if a.device != b.device or a.numel() == 0 or b.numel() == 0:
        return False

    def span(t):  # (strides are never negative)
        last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
        return t.data_ptr(), t.data_ptr() + t.element_size() * (last + 1)

    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


# Other names a slot goes by: PyTorch's optimizers and FBGEMM / TorchRec's
# ("momentum1" / "momentum2": the optimizer's first / second slot); "sum" is
# torch.optim.Adagrad's accumulators and torchrec.optim.RowWiseAdagrad's
# row accumulators ([rows, 1]).
_ALIASES = {"sum": ("accumulators", "row_accumulators"), "exp_avg": ("momenta",), "exp_avg_sq": ("velocities",)}


class FusedOptimizer(torch.optim.Optimizer):
    """The optimizers of the fused tables in `module`.

    Updates happen inside ``backward()``; ``step()`` and ``zero_grad()`` do
    nothing, so the object can sit beside a dense optimizer in a training
    loop. One param group per table, with its ``"lr"``: a float learning
    rate set here (by hand or by a ``torch.optim.lr_scheduler``) is the one
    the next update uses (decayed as PyTorch's Adagrad decays it when the
    group has an in-backward Adagrad's ``"lr_decay"``); a schedule given to
    the embedcore optimizer as a callable rules instead, and ``"lr"`` then
    shows its next value.

    ``state_dict()``: ``{"state": {"<module path>.weight": {"step": int64
    tensor, "<slot>": [rows, dim] float32 view of the engine's slot ([rows,
    1] for row-wise Adagrad)}},
    "param_groups": [{"params": [key], "lr": ..., "table": name, "optimizer":
    class name}]}``. ``load_state_dict`` copies slots into the engine and
    accepts PyTorch's slot names (``sum``, ``exp_avg``, ``exp_avg_sq``;
    ``sum`` is also TorchRec's ``RowWiseAdagrad``'s ``[rows, 1]`` state) and
    TorchRec's (``momentum1``, ``momentum2``, or its fused modules'
    ``momentum_1``, ``momentum_2``, also prefixed by the table name;
    row-wise Adagrad's ``[rows]`` ``momentum1`` too), under the weight's key
    or, as TorchRec's fused modules key it, a key it ends with
    (``"<table>.weight"``).
    """

    def __init__(self, module: nn.Module):
        from ._modules import _TableModule, fuse_pending

        fuse_pending(module)  # the tables apply_optimizer_in_backward asked to fuse, before their first lookup

        self._entries: List[Tuple[str, _TableModule]] = []
        for prefix, m in module.named_modules():
            if isinstance(m, _TableModule) and m.fused:
                self._entries.append((f"{prefix}.weight" if prefix else "weight", m))
        if not self._entries:
            raise ValueError(f"{type(module).__name__} has no table trained fused (give it an embedcore optimizer)")
        super().__init__([m._group for _, m in self._entries], {})  # (through add_param_group, once per table)
        self._built = True

    def __getstate__(self) -> dict:
        # torch.optim.Optimizer keeps only defaults, state and param_groups: a copy (copy.copy, deepcopy,
        # pickle) had no tables. A deep copy or pickle copies the modules too (each an independent table, its
        # param group the copied group), as deepcopy of a model and its optimizer together does.
        return {**super().__getstate__(), "_entries": self._entries, "_built": True}

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        # The groups are the tables' own: a copied module makes a group of its own for its new table.
        self.param_groups = [m._group for _, m in self._entries]

    def add_param_group(self, param_group: dict) -> None:
        """Refused once built (``NotImplementedError``, as TorchRec's
        ``KeyedOptimizer``): the groups are the fused tables', and a group
        added here would never be stepped nor saved. Give a table an
        optimizer (``optimizer=``, ``apply_optimizer_in_backward``) and take
        a new ``fused_optimizer`` instead."""
        if getattr(self, "_built", False):
            raise NotImplementedError("FusedOptimizer.add_param_group: its param groups are the fused tables' (one "
                                      "each), stepped inside backward(); a group added here would never be "
                                      "stepped nor saved. Give the table an optimizer and take the module's "
                                      "fused_optimizer again")
        super().add_param_group(param_group)

    def _sync(self) -> None:
        """The groups of tables fused from apply_optimizer_in_backward take the
        rate set on that optimizer since their last step (by its scheduler,
        say), as their next lookup would (_TableModule._sync_in_backward).
        A table whose rate is a schedule (a callable ``lr(step)``) shows its
        next value, also after a load or ``table.step = n`` moved the step.
        Not on every read of ``param_groups``, which stay plain (compiled
        code and schedulers read them)."""
        for _, m in self._entries:
            m._sync_in_backward(check=False)
            _ops.show_scheduled_rate(m._table, m._group)

    def step(self, closure=None):
        return closure() if closure is not None else None

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass

    def state_dict(self) -> dict:
        state: Dict[str, dict] = {}
        groups = []
        self._sync()  # (the rates the next steps use)
        for key, m in self._entries:
            state[key] = {"step": torch.tensor(m._table.step, dtype=torch.int64), **m._slots}
            groups.append({**{k: v for k, v in m._group.items() if k != "params"}, "params": [key]})
        return {"state": state, "param_groups": groups}

    def _slot_name(self, m, key: str, name) -> str:
        names = m._table.slot_names
        if not isinstance(name, str):
            raise TypeError(f"{key}: a slot name must be a str, got {name!r}")
        short = name.rsplit(".", 1)[-1]
        if short in names:
            return short
        for alias in _ALIASES.get(short, ()):
            if alias in names:
                return alias
        short = {"momentum_1": "momentum1", "momentum_2": "momentum2"}.get(short, short)  # TorchRec's fused modules'
        if short in ("momentum1", "momentum2") and len(names) >= int(short[-1]):
            return names[int(short[-1]) - 1]
        raise ValueError(f"{key}: table '{m._table.name}' ({type(m._table.optimizer).__name__}) has no slot "
                         f"{name!r}; its slots are {list(names)}")

    @staticmethod
    def _weight_key(by_key: dict, key, what: str) -> str:
        """The fused table's key that `key` names: itself, or, as TorchRec's
        fused modules key a table ("<table>.weight"), the one key ending with it."""
        if key in by_key:
            return key
        ends = [k for k in by_key if isinstance(key, str) and k.endswith("." + key)]
        if len(ends) == 1:
            return ends[0]
        raise ValueError(f"{what} {key!r}, which " +
                         (f"names several fused tables ({ends}): give the full key" if ends else
                          "is not a fused table of this module") + f" (those are {list(by_key)})")

    def _checked_lr(self, m, where: str, lr) -> float:
        """A param group's "lr" as loaded: a finite number >= 0 that the
        table's optimizer can use."""
        return _ops.checked_rate(m._table, lr, f"{where} (table '{m._table.name}'): lr", minimum=0.0)

    def load_state_dict(self, state_dict: dict) -> None:
        """Checks everything (keys, slot names, shapes, values, steps, rates:
        ``ValueError`` / ``TypeError`` naming the key or group) before any
        table changes."""
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"an optimizer state_dict must be a dict with \"state\" and/or \"param_groups\", "
                            f"got {type(state_dict).__name__}")
        by_key = dict(self._entries)
        states = state_dict.get("state", {})
        if not isinstance(states, Mapping):
            raise TypeError(f"state_dict[\"state\"] must be a dict of weight key -> dict of slots, got {states!r}")
        plan = []
        for key, s in states.items():
            key = self._weight_key(by_key, key, "optimizer state for")
            if not isinstance(s, Mapping):
                raise TypeError(f"{key}: its optimizer state must be a dict of slot name -> tensor (and \"step\"), "
                                f"got {s!r}")
            m = by_key[key]
            given = set()  # the table's slots this state gives
            for name, value in s.items():
                if name == "step":
                    step = value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value
                    if isinstance(step, float) and step.is_integer():
                        step = int(step)  # PyTorch's Adagrad / Adam keep the step as a float tensor
                    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= 2**62:
                        raise ValueError(f"{key}: step must be an int in [0, 2**62], got {value!r}")
                    plan.append((m, None, step))
                    continue
                slot = self._slot_name(m, key, name)
                given.add(slot)
                if value is None or isinstance(value, (str, bytes)):
                    raise TypeError(f"{key}: slot {name!r} must be a tensor (or array) of floats, got {value!r}")
                try:
                    value = torch.as_tensor(value)
                except (TypeError, ValueError, RuntimeError) as e:
                    raise TypeError(f"{key}: slot {name!r} must be a tensor (or array) of floats, got "
                                    f"{type(value).__name__} ({e})") from None
                if callable(getattr(value, "local_shards", None)) or callable(getattr(value, "to_local", None)):
                    # TorchRec's DMP keeps its fused optimizers' state as ShardedTensor (or DTensor)
                    raise ValueError(f"{key}: slot {name!r} is a {type(value).__name__}, the state of a sharded "
                                     "module: gather each table's shards into one tensor first (for one rank, "
                                     "ShardedTensor.local_shards()[0].tensor)")
                if value.layout != torch.strided:
                    raise TypeError(f"{key}: slot {name!r} must be a dense (strided) tensor, got {value.layout}")
                if value.dim() == 1 and tuple(m._slots[slot].shape) == (value.numel(), 1):
                    value = value.unsqueeze(1)  # TorchRec's row-wise momentum1 is [rows]
                if tuple(value.shape) != tuple(m._slots[slot].shape):
                    raise ValueError(f"{key}: slot {name!r} must have shape {tuple(m._slots[slot].shape)}, "
                                     f"got {tuple(value.shape)}")
                if not value.is_floating_point():
                    raise TypeError(f"{key}: slot {name!r} must hold real floats, got {value.dtype}")
                if value.device.type == "meta":
                    raise ValueError(f"{key}: slot {name!r} is on the meta device (it holds no data)")
                if value.dtype in _ops.NO_RANGE_KERNELS:  # float8: no isfinite on PyTorch's CPU (float32: exact)
                    value = value.to(torch.float32)
                if not torch.isfinite(value).all():
                    raise ValueError(f"{key}: slot {name!r} holds NaN or infinite values")
                if value.dtype != torch.float32:  # the slot's dtype: a wider value may not fit
                    wide = value
                    value = value.to(torch.float32)
                    if not torch.isfinite(value).all():
                        bad = int(torch.nonzero(~torch.isfinite(value.reshape(-1)))[0])
                        raise ValueError(f"{key}: slot {name!r} holds {float(wide.reshape(-1)[bad])!r} at flat "
                                         f"index {bad}, beyond float32's range (the slot's dtype)")
                problem = slot_problem(m._table, slot, float(value.min())) if value.numel() else None
                if problem is not None:
                    raise ValueError(f"{key}: slot {name!r} {problem}")
                plan.append((m, slot, value))
            missing = [n for n in m._table.slot_names if n not in given]
            if missing and given:  # (no slot, or a step alone: the slots stay, as torch.optim's for a param)
                raise ValueError(f"{key}: its optimizer state gives slots {sorted(given)} but not {missing} of table "
                                 f"'{m._table.name}' ({type(m._table.optimizer).__name__}): a state gives all of "
                                 "a table's slots or none (the others would stay as they were, a state no "
                                 "training made; TorchRec's KeyedOptimizer refuses it too)")
        groups = state_dict.get("param_groups", [])
        if not isinstance(groups, (list, tuple)):
            raise TypeError(f"state_dict[\"param_groups\"] must be a list of dicts, got {groups!r}")
        lrs = []
        for i, g in enumerate(groups):
            if not isinstance(g, Mapping):
                raise TypeError(f"param_groups[{i}] must be a dict, got {g!r}")
            params = g.get("params", [])
            if not isinstance(params, (list, tuple)):
                raise TypeError(f"param_groups[{i}][\"params\"] must be a list of weight keys, got {params!r}")
            for key in params:
                if isinstance(key, str) and "lr" in g:
                    key = self._weight_key(by_key, key, f"param_groups[{i}] names")
                    lrs.append((by_key[key], self._checked_lr(by_key[key], f"param_groups[{i}]", g["lr"])))
        # Everything checked; now change the tables, from the values as they are now: a value that views a slot
        # an earlier copy writes (this module's own state_dict(), its tables swapped) is read before it changes.
        written = []
        for i, (m, slot, value) in enumerate(plan):
            if slot is not None:
                if any(_overlap(value, t) for t in written):
                    plan[i] = (m, slot, value.clone())
                written.append(m._slots[slot])
        with torch.no_grad():
            for m, slot, value in plan:
                if slot is None:
                    m._table.step = value
                else:
                    m._slots[slot].copy_(value)
        for m, lr in lrs:
            m._group["lr"] = lr
