"""The engine's lookup and update as ``torch.library`` custom ops.

Four ops, opaque to ``torch.compile`` (which sees only their fake
implementations, so a model that uses them compiles without graph breaks):

- ``embedcore::lookup``: looks up *segments* of one table: each segment is a
  run of bags of one CSR *source* (ids, offsets, optional per-id weights). One
  op call per table and step, whatever the number of features that read the
  table, so the fused optimizer applies exactly one update per table and step.
- ``embedcore::lookup_backward``: from the gradients of the outputs, the
  gradients of the per-id weights (when they require grad) and then either
  the engine's optimizer step (fused), or the table's gradient as a sparse
  (per occurrence, like ``nn.EmbeddingBag(sparse=True)``) or dense tensor.
- ``embedcore::checked_values``: the checks of a collection's jagged input
  (``checked_values``), run at run time where the lookup is traced.
- ``embedcore::served_lookup``: ``lookup`` of a served (memory-mapped,
  read-only) table, without autograd (the served collections).

A collection's tables can also run together, outside the ops, when nothing
needs to see them (``collection_lookup``: eager, CPU, fused or no training).

Tables are passed by an integer handle into a module-level registry. The
segments are cut out of their sources with PyTorch ops on the tensors' own
device, so one code path serves CPU tables and the CUDA build's GPU tables:
CPU tensors cross to the engine as NumPy views of their memory, CUDA tensors
by DLPack, on PyTorch's current stream (no copies when contiguous). The
engine validates ids and offsets and raises ``IndexError`` / ``ValueError``
that name the bad value.
"""
from __future__ import annotations

import contextlib
import random
import weakref
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch
from torch import Tensor

from embedcore import _embedcore

__all__ = ["SUM", "MEAN", "SQRTN", "SEQUENCE", "FUSED", "SPARSE", "DENSE", "WHOLE", "register", "unregister",
           "fused_rate", "checked_values", "lookup", "lookup_impl", "eager_lookup", "plain_eager", "needs_step",
           "lookup_backward", "lookup_backward_impl", "served_lookup", "served_lookup_impl"]

# Combiners (the engine's codes) and gradient modes.
SUM, MEAN, SQRTN, SEQUENCE = 0, 1, 2, 3
_COMBINER_NAMES = ("sum", "mean", "sqrtn", None)
FUSED, SPARSE, DENSE = 0, 1, 2
# Tensor dtypes that PyTorch's CPU cannot take the range (aminmax), compare or test for finiteness of: a
# weight's or a slot's checks read them from a wider copy (exact, but for uint64 past 2**53: its range).
NO_RANGE_KERNELS = frozenset(getattr(torch, n) for n in ("uint16", "uint32", "uint64", "float8_e4m3fn",
                                                       "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz",
                                                       "float8_e8m0fnu") if hasattr(torch, n))
WHOLE = -1  # a segment's bag count meaning "every id of its source, unpooled" (sequence lookups)


# ------------------------------------------------------------------ registry
class _Entry:
    """A registered table and, when it trains fused, its parameter group (whose
    "lr" a learning-rate scheduler may change); a collection's table's the
    names of its features, which its errors name (segment k reads
    ``features[k]``; in a compiled collection the op's error is the only one)."""

    __slots__ = ("table", "group", "features", "sync", "anchors", "rate_seen", "__weakref__")

    def __init__(self, table, group, features=None, sync=None, anchors=()):
        self.table = table
        self.group = group
        self.features = features
        self.sync = sync  # a weakref.WeakMethod called before each fused step (the module's _sync_in_backward)
        self.anchors = anchors  # the data pointers of the anchors a lookup of this table may pass
        # How many times the table's optimizer's learning_rate had been set when the group last took it
        # (adopt_optimizer_rate).
        self.rate_seen = table.optimizer._rate_sets if group is not None else None

    def group_rate(self) -> float:
        """The rate of the group's next fused step, for ``Table.learning_rate()``
        (a rate set on the table's optimizer since taken first; the rate set
        on an in-backward optimizer shows from the next lookup on, as in the
        group)."""
        adopt_optimizer_rate(self)
        return fused_rate(self.table, self.group)


_REGISTRY: Dict[int, _Entry] = {}
_HANDLE_BITS = random.SystemRandom()


def register(table, group: Optional[dict] = None, holders=(), features: Optional[List[str]] = None,
             sync=None, anchors=()) -> int:
    """Registers `table` (an ``ec.Table``, or a served one: ``served_lookup``);
    with `holders`, unregisters it (``release_with``) once they are all
    collected; `anchors`: the tensors a lookup passes as its anchor (a
    module's weight, or its fused anchors), which ``lookup`` checks. Handles
    are random 62-bit numbers, not a count: a program that
    ``torch.export`` / ``torch.jit.trace`` recorded one in, loaded in another
    process, finds no table there rather than that process's table of the
    same number."""
    handle = _HANDLE_BITS.getrandbits(62) | 1
    while handle in _REGISTRY:
        handle = _HANDLE_BITS.getrandbits(62) | 1
    _REGISTRY[handle] = _Entry(table, group, features, sync, tuple(a.data_ptr() for a in anchors))
    if holders:
        release_with(handle, holders)
    return handle


def release_with(handle: int, holders) -> None:
    """Unregisters `handle` once every object of `holders` has been
    collected: a module and the tensors it passes to ``lookup`` as the anchor
    (its weight, or its fused anchors), which the autograd graph of a lookup
    keeps alive (AccumulateGrad nodes, saved tensors) until its backward is
    done or the graph is freed, as ``nn.EmbeddingBag``'s graph keeps its
    weight: a backward after ``del module`` still finds the table, and the
    table is released when neither the module nor any graph can use it. (The
    holders must not be reachable from the registry's entry, or they would
    never be collected.)"""
    finalizers: List[weakref.finalize] = []

    def release():
        # The last holder's finalizer unregisters (a finalizer is no longer alive when it runs; finalizers
        # running in two threads at once: the later one to be popped sees none alive).
        if not any(f.alive for f in finalizers):
            unregister(handle)

    finalizers.extend(weakref.finalize(h, release) for h in holders)


def unregister(handle: int) -> None:
    _REGISTRY.pop(handle, None)


def handle_tensor(handle: int) -> Tensor:
    """`handle` as the ops take it: a CPU int64 scalar, kept by its module
    beside the int. torch.compile fixes an int attribute of a module in its
    graph, and guards on it: every new module (a model built again, a
    collection's tables compiled one by one) compiled again, and the ninth
    failed (the recompile limit: FailOnRecompileLimitHit under
    fullgraph=True); a tensor is a graph input, read in the op's body."""
    return torch.tensor(handle, dtype=torch.int64)


def _op_handle(handle) -> Tensor:
    """A handle as the ops take it (``handle_tensor``), from either form."""
    return handle if isinstance(handle, Tensor) else handle_tensor(handle)


def _as_handle(handle) -> int:
    """A handle given as an int (the eager paths) or as ``handle_tensor``'s scalar (the ops)."""
    return int(handle) if isinstance(handle, Tensor) else handle


def _entry(handle) -> _Entry:
    handle = _as_handle(handle)
    try:
        return _REGISTRY[handle]
    except KeyError:
        raise RuntimeError(f"embedcore table handle {handle} is not registered: its module, and every autograd "
                           "graph of its lookups, were deleted, or this is a program (torch.export, torch.jit.trace) "
                           "made in another process: such a program holds the handle of its process's table, not "
                           "the table (which lives in embedcore's memory), and runs only there; save the tables "
                           "with ec.save and serve them (ServedEmbeddingBagCollection) or build the modules "
                           "again") from None


# ------------------------------------------------------------------ inputs
class _Part:
    """One segment as the engine takes it: CSR ids/offsets (offsets from 0) and
    optional weights; `start` / `length` place its ids in their source, and
    `keep` (when padding ids were dropped) lists the ones kept, within it."""

    __slots__ = ("source", "ids", "offsets", "weights", "start", "length", "keep", "num_bags")

    def __init__(self, source, ids, offsets, weights, start, length, keep, num_bags):
        self.source = source
        self.ids = ids
        self.offsets = offsets
        self.weights = weights
        self.start = start
        self.length = length
        self.keep = keep
        self.num_bags = num_bags

    def positions(self):
        """Where this part's ids sit in their source (an index or a slice)."""
        if self.keep is None:
            return slice(self.start, self.start + self.length)
        return self.keep + self.start


def _np(t: Tensor) -> np.ndarray:
    """A NumPy view of a CPU tensor (a copy of a lazily negated or conjugated
    one, e.g. ``z.conj().imag``, whose ``numpy()`` PyTorch refuses)."""
    t = t.detach()
    if t.is_neg() or t.is_conj():
        t = t.resolve_neg().resolve_conj()
    return t.numpy()


def _engine(t: Optional[Tensor]):
    """A tensor as the engine takes it: a NumPy view of a CPU tensor's memory,
    a CUDA tensor as it is (DLPack)."""
    if t is None or t.device.type != "cpu":
        return t
    return _np(t)


def _tensor(x) -> Tensor:
    """An engine result as a tensor: CPU results are NumPy arrays the engine
    allocated (wrapped, no copy); GPU results are tensors already."""
    return x if isinstance(x, Tensor) else torch.from_numpy(x)


def _check_offsets(off: np.ndarray, n: int, where: str, appended: bool) -> None:
    """Raises the error for bad offsets (`appended`: the last is the end the
    adapter added, not the caller's)."""
    if appended and len(off) > 1 and off[:-1].max() > n:  # before the appended end would read as a decrease
        k = int(np.argmax(off[:-1] > n))
        raise ValueError(f"{where}[{k}] = {int(off[k])} is greater than the number of ids ({n})")
    if off[0] != 0:
        raise ValueError(f"{where}[0] must be 0 (the first bag starts at the first id), got {int(off[0])}")
    down = off[1:] < off[:-1]  # (not np.diff: a difference past int64's range wraps, and read as no decrease)
    if down.any():
        k = int(np.argmax(down))
        name = where.rpartition(": ")[2]  # (without the owner's prefix, said once)
        raise ValueError(f"{where} must be non-decreasing: {name}[{k}] = {int(off[k])} > "
                         f"{name}[{k + 1}] = {int(off[k + 1])}")
    if off[-1] > n:
        raise ValueError(f"{where}[-1] = {int(off[-1])} is greater than the number of ids ({n})")


def _check_jagged(values: Tensor, offsets: Tensor, where: str, lengths: bool) -> None:
    """Raises the error for a collection's jagged input `where` whose offsets
    (or, with `lengths`, lengths) are bad or do not end at its last value:
    a collection's bags cover every value, as TorchRec's (its split by
    lengths refuses the rest; nn.EmbeddingBag's rule that ids after the last
    offset belong to no bag is not TorchRec's)."""
    n = int(values.shape[0])
    if offsets.device.type != "cpu":  # checked on the device (one synchronisation), on the host for the message
        o = offsets.to(torch.int64)
        if lengths:  # (each in [0, n]: larger ones could wrap the sum around to n)
            bad = (o < 0).any() | (o > n).any() | (o.sum() != n)
        else:
            bad = (o[0] != 0) | (o[1:] < o[:-1]).any() | (o[-1] != n)
        if not bool(bad.item()):
            return
    else:  # the good case in a few NumPy calls (a few microseconds a feature); the message's work only when bad
        o = offsets.detach().numpy()
        if lengths:
            good = (o.min() >= 0 and o.max() <= n and int(o.sum(dtype=np.int64)) == n) if o.size else n == 0
        elif o.size <= 128:  # a short one as a list, cheaper than NumPy's calls (sorted: one pass in C when sorted)
            x = o.tolist()
            good = len(x) > 0 and x[0] == 0 and x[-1] == n and x == sorted(x)
        else:
            good = o[0] == 0 and o[-1] == n and not (o[1:] < o[:-1]).any()
        if good:
            return
    off = offsets.detach().cpu().numpy().astype(np.int64, copy=False)
    if lengths:
        if (off < 0).any():
            k = int(np.argmax(off < 0))
            raise ValueError(f"{where}['lengths'][{k}] = {int(off[k])} is negative")
        if (off > n).any():
            k = int(np.argmax(off > n))
            raise ValueError(f"{where}['lengths'][{k}] = {int(off[k])} is greater than the number of values ({n})")
        off = np.concatenate([np.zeros(1, np.int64), np.cumsum(off)])
    if int(off[-1]) != n:
        raise ValueError(f"{where}: the offsets (or lengths) end at {int(off[-1])}, but there are {n} values; a "
                         "collection's bags must cover every value")
    _check_offsets(off, n, f"{where} offsets", False)


def checked_values(values: Tensor, offsets: Tensor, where: str, lengths: bool = False) -> Tensor:
    """`values` once ``_check_jagged`` passes: checked now when eager, else
    by the op ``embedcore::checked_values`` at run time (a compiled graph
    holds no data to check when traced), which returns a copy for the
    lookup to use (an op's output may not alias its input, and an output
    nothing used would be dropped from the graph, with its check)."""
    if plain_eager([values, offsets]):
        _check_jagged(values, offsets, where, lengths)
        return values
    return _checked_values(values, offsets, where, lengths)


@torch.library.custom_op("embedcore::checked_values", mutates_args=())
def _checked_values(values: Tensor, offsets: Tensor, where: str, lengths: bool) -> Tensor:
    _check_jagged(values, offsets, where, lengths)
    return values.clone()


@_checked_values.register_fake
def _(values, offsets, where, lengths):
    return torch.empty_like(values)


def _source_offsets(ids: Tensor, offsets: Tensor, include_last_offset: bool, s: int) -> Tensor:
    """A source's offsets as int64 on its device, with the last one, checked.
    (GPU offsets are checked with one synchronisation, and looked at on the
    host only when they are bad, for the message.)"""
    n = int(ids.shape[0])
    where = "offsets" if s == 0 else f"offsets of source {s}"
    if offsets.device.type == "cpu":  # NumPy: fewer, cheaper calls for these small arrays
        off = _np(offsets).astype(np.int64, copy=False)
        if not include_last_offset:
            off = np.append(off, np.int64(n))
        if len(off) > 1:
            _check_offsets(off, n, where, not include_last_offset)
        return torch.from_numpy(off)
    off = offsets.to(torch.int64)
    if not include_last_offset:
        off = torch.cat([off, off.new_full((1,), n)])
    if off.shape[0] > 1 and bool(((off[0] != 0) | (off[1:] < off[:-1]).any() | (off > n).any()).item()):
        _check_offsets(off.cpu().numpy(), n, where, not include_last_offset)
    return off


def _parts(ids: List[Tensor], offsets: List[Tensor], weights: List[Tensor], segments: List[int],
           padding_idx: int, include_last_offset: bool, drop_padding: bool) -> List[_Part]:
    """The segments of a call, windowed out of their sources (views, no
    copies) and, when asked, without the ids equal to `padding_idx`."""
    for a in ids:
        if a.dim() != 1:
            raise ValueError(f"ids must be 1-D here, got shape {tuple(a.shape)}")
    offs: Dict[int, Tensor] = {}
    parts = []
    for k in range(0, len(segments), 3):
        s, b0, nb = segments[k], segments[k + 1], segments[k + 2]
        a = ids[s]
        w = weights[s].detach() if weights else None
        if nb == WHOLE:
            lo, hi = 0, int(a.shape[0])
            seg_off = torch.tensor([0, hi], dtype=torch.int64, device=a.device)
        else:
            if s not in offs:
                offs[s] = _source_offsets(a, offsets[s], include_last_offset, s)
            off = offs[s]
            if b0 < 0 or b0 + nb > off.shape[0] - 1:
                raise ValueError(f"bags [{b0}, {b0 + nb}) of source {s} do not exist: its offsets describe "
                                 f"{off.shape[0] - 1} bags")
            if not nb:
                lo, hi = 0, 0
            elif off.device.type == "cpu":
                lo, hi = int(_np(off)[b0]), int(_np(off)[b0 + nb])
            else:
                lo, hi = off[[b0, b0 + nb]].tolist()  # one synchronisation
            if not nb:
                seg_off = off.new_zeros(1)
            elif b0 == 0 and nb == off.shape[0] - 1:
                seg_off = off  # the whole source (lo is 0)
            else:
                seg_off = off[b0:b0 + nb + 1] - lo
        seg_ids = a.detach()[lo:hi]
        seg_w = None if w is None else w[lo:hi]
        keep = None
        if drop_padding and padding_idx >= 0 and seg_ids.shape[0]:
            pad = seg_ids == padding_idx
            if bool(pad.any()):
                keep = torch.nonzero(~pad).squeeze(1)
                removed = torch.cat([pad.new_zeros(1, dtype=torch.int64), torch.cumsum(pad, 0)])
                seg_off = seg_off - removed[seg_off]
                seg_ids = seg_ids[keep]
                seg_w = None if seg_w is None else seg_w[keep]
        parts.append(_Part(s, seg_ids, seg_off, seg_w, lo, hi - lo, keep, nb))
    return parts


_FLOAT32_MAX = 3.4028234663852886e38


def checked_rate(table, lr, where: str, minimum: Optional[float] = None) -> float:
    """`lr` as a float that `table`'s fused update can use: ``TypeError`` /
    ``ValueError`` naming `where` otherwise (NaN, infinity, a value beyond
    float32's range or below `minimum`, a rate the optimizer refuses)."""
    try:
        if isinstance(lr, (bool, str, bytes)):
            raise TypeError
        v = float(lr)
    except (TypeError, ValueError, RuntimeError):  # (RuntimeError: a tensor of several elements)
        raise TypeError(f"{where} must be a number, got {lr!r}") from None
    if not (-_FLOAT32_MAX if minimum is None else minimum) <= v <= _FLOAT32_MAX:  # (NaN fails too)
        at_least = "" if minimum is None else f", >= {minimum:g}"
        raise ValueError(f"{where} must be finite{at_least} and within float32's range, got {lr!r}")
    try:
        table.optimizer._check_learning_rate(v, f"learning rate {v!r}")
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    return v


def fused_rate(table, group: Optional[dict]) -> float:
    """The rate of `table`'s next fused step: its parameter group's "lr" (a
    scheduler or ``load_state_dict`` may have changed it; with the group's
    "lr_decay", PyTorch's Adagrad rate ``lr / (1 + (t - 1) lr_decay)``), or
    the table's own schedule's; checked, with an error naming the table (``TypeError`` /
    ``ValueError``) for a rate the engine's update cannot use. The modules
    call it in the forward too, so that a bad rate fails before any backward
    (one per table with dict inputs) has stepped any table."""
    if group is None or callable(table.optimizer.learning_rate):
        try:
            return table.learning_rate()
        except (TypeError, ValueError) as e:
            raise type(e)(f"table '{table.name}': {e}") from None
    lr = checked_rate(table, group["lr"], f"table '{table.name}': the learning rate of its fused optimizer's param "
                                          "group (\"lr\")")
    # An in-backward Adagrad's lr_decay: PyTorch's step t is the engine's step + 1.
    return lr / (1.0 + table.step * group["lr_decay"]) if "lr_decay" in group else lr


def adopt_optimizer_rate(entry: _Entry) -> None:
    """A rate set on the table's embedcore optimizer since its group last took
    one (``table.optimizer.learning_rate = 0.01``) becomes the group's
    "lr", which the fused steps use: a number at once, a schedule through
    ``fused_rate``. (It was ignored: the steps kept the group's old rate, a
    schedule's last shown value after a switch from a schedule to a number,
    while ``Table.learning_rate()`` reported the new one.) A rate set on the
    group (a scheduler, ``load_state_dict``) leaves the optimizer's as it was,
    so the group's stays the one used until the optimizer's is set again."""
    group = entry.group
    if group is None:
        return
    optimizer = entry.table.optimizer
    sets = optimizer._rate_sets
    if sets == entry.rate_seen:
        return
    entry.rate_seen = sets  # (set again to the value it had: taken too, over a scheduler's since)
    rate = optimizer.learning_rate
    if not callable(rate):
        group["lr"] = rate


def _fused_rate(entry: _Entry) -> float:
    """The rate of a fused step (``fused_rate``), after the entry's sync."""
    sync = entry.sync() if entry.sync is not None else None
    if sync is not None:
        sync()
    adopt_optimizer_rate(entry)
    return fused_rate(entry.table, entry.group)


def show_scheduled_rate(table, group: Optional[dict]) -> None:
    """The group of a table whose rate is a schedule shows its next value,
    where the schedule gives one the engine takes. Only shown: after a step
    that was applied, a schedule that has no valid rate for the next step
    (a list of N rates, a rate decayed to 0) raises from the next lookup's
    check, before any table steps, not from this step's backward (which
    had stepped the table, and left the other tables of a dict input
    unstepped) nor from ``fused_optimizer.state_dict()``."""
    if group is not None and callable(table.optimizer.learning_rate):
        try:
            group["lr"] = table.learning_rate()
        except Exception:  # noqa: BLE001 - the schedule is the user's code; fused_rate raises it, before a step
            pass


def _fused_stepped(entry: _Entry) -> None:
    """After a fused step: the group shows the table's scheduled rate."""
    show_scheduled_rate(entry.table, entry.group)


def _cpu_source(ids: List[Tensor], offsets: List[Tensor], weights: List[Tensor], include_last_offset: bool):
    """One CPU source of int32 / int64 ids and offsets as NumPy views ``(ids,
    int64 offsets with the end, weights or None)``, or None. (A copy of the
    offsets only when the caller left the end out, or gave them in int32:
    TorchRec's KJTs of int32 lengths, and ``kjt.offsets()`` of them.)"""
    if len(offsets) != 1 or len(ids) != 1:
        return None
    a, off = ids[0], offsets[0]
    if (not a.is_cpu or off.dtype not in (torch.int32, torch.int64) or a.dtype not in (torch.int32, torch.int64)
            or a.dim() != 1 or off.dim() != 1):
        return None
    # (Integer tensors never require grad: numpy() needs no detach.)
    a_np, w_np = a.numpy(), (_np(weights[0]) if weights else None)
    if include_last_offset:
        # (a strided view: the backward's helpers take C order)
        off = np.ascontiguousarray(off.numpy(), dtype=np.int64)
        if not off.shape[0]:
            return None
        end = int(off[-1])
        if 0 <= end < a_np.shape[0]:
            # The ids after the last offset belong to no bag (as in nn.EmbeddingBag): the source ends there, so
            # that every window, forward and backward, holds only its bags' ids.
            a_np = a_np[:end]
            w_np = None if w_np is None else w_np[:end]
    else:
        bags = off.shape[0]
        given, off = off.numpy(), np.empty(bags + 1, np.int64)
        off[:bags] = given
        off[bags] = a.shape[0]
    return a_np, off, w_np


def _windows(source, starts: List[int], nb: int):
    """Windows of `nb` bags of a `_cpu_source`, from each bag of `starts`, as
    the engine takes them: ``(ids, offsets from 0, weights)`` each, the ids
    and weights views, the offsets rebased (one NumPy operation for all), or
    None when a window is not within the source (the general path names what
    is wrong). The engine checks each window's ids and offsets."""
    a, off, w = source
    if off[0] != 0 or nb < 0 or not starts or min(starts) < 0 or max(starts) + nb > off.shape[0] - 1:
        return None
    rebased = off[np.add.outer(np.asarray(starts, np.int64), np.arange(nb + 1))]
    lo = rebased[:, 0].tolist()
    hi = rebased[:, -1].tolist()
    if min(lo) < 0 or max(hi) > a.shape[0] or any(l > h for l, h in zip(lo, hi)):
        return None
    rebased -= rebased[:, :1]
    return [(a[l:h], rebased[k], None if w is None else w[l:h]) for k, (l, h) in enumerate(zip(lo, hi))]


def _cpu_windows(ids: List[Tensor], offsets: List[Tensor], weights: List[Tensor], segments: List[int],
                 combiner: int, padding_idx: int, include_last_offset: bool, sequence: bool = False):
    """The most common calls, as the engine takes them, or None: pooled bags
    of one CPU source with int32 / int64 offsets and no padding id, whole (a module's
    own call) or in windows of equally many bags (a KeyedJaggedTensor's
    features). One ``(ids, offsets, weights)`` of NumPy views per segment
    (see ``_windows``). The engine checks each window's ids and offsets
    itself; the general path (``_parts``) is only needed for an error's
    message, and for padding ids (a module's `padding_idx` when the call
    holds it: without it, the same bits), several sources, and sequences
    but with `sequence` (the forward's rows of a window: an
    ``EmbeddingCollection``'s KJT features)."""
    if combiner == SEQUENCE and not sequence:
        return None
    source = _cpu_source(ids, offsets, weights, include_last_offset)
    if source is None or (padding_idx >= 0 and bool((source[0] == padding_idx).any())):
        return None
    bags = source[1].shape[0] - 1
    if len(segments) == 3 and segments[1] == 0 and segments[2] == bags:
        return [source]
    nb = segments[2]
    if any(segments[k] != nb for k in range(2, len(segments), 3)):
        return None
    return _windows(source, segments[1::3], nb)


def _window_parts(ids: List[Tensor], offsets: List[Tensor], weights: List[Tensor], segments: List[int],
                  combiner: int, padding_idx: int, include_last_offset: bool) -> Optional[List[_Part]]:
    """``_parts`` of the calls ``_cpu_windows`` takes (their forward checked
    them; the saved tensors cannot have changed since), from the NumPy
    windows, without checking the whole source again; or None."""
    windows = _cpu_windows(ids, offsets, weights, segments, combiner, padding_idx, include_last_offset)
    if windows is None:
        return None
    given = offsets[0]  # (without its end when not include_last_offset: bag `bags` starts at the end of the ids)
    parts = []
    for k, (a, off, w) in enumerate(windows):
        b0, nb = segments[3 * k + 1], segments[3 * k + 2]
        start = int(given[b0]) if b0 < given.shape[0] else int(ids[0].shape[0])
        parts.append(_Part(0, torch.from_numpy(a), torch.from_numpy(off),
                           None if w is None else weights[0].detach()[start:start + a.shape[0]],
                           start, a.shape[0], None, nb))
    return parts


def _bag_of(p: _Part) -> Tensor:
    """The bag (output row) of each id of a pooled part."""
    counts = torch.diff(p.offsets)
    return torch.repeat_interleave(torch.arange(p.num_bags, device=counts.device), counts,
                                   output_size=int(p.ids.shape[0]))


def _weights_or_ones(p: _Part) -> Tensor:
    if p.weights is None:
        return torch.ones(p.ids.shape[0], dtype=torch.float32, device=p.ids.device)
    return p.weights.to(torch.float32)


def _denominators(p: _Part, combiner: int) -> Tensor:
    """Each bag's combiner denominator, as the engine's lookup computes it:
    sum(w) for mean, sqrt(sum(w^2)) for sqrtn (the count n and sqrt(n)
    without weights). On
    the host, the engine's own function (the kernels' summation order), so
    that forward and backward agree bit for bit; on a GPU, a segmented sum
    (deterministic, within float rounding of the engine's)."""
    if p.ids.device.type == "cpu":
        w = None if p.weights is None else np.ascontiguousarray(_np(p.weights), np.float32)
        return torch.from_numpy(_embedcore.bag_denominators(np.ascontiguousarray(_np(p.offsets), np.int64), w,
                                                            combiner))
    return _segmented_denominators(p, combiner)


def _segmented_denominators(p: _Part, combiner: int) -> Tensor:
    if p.weights is None and combiner in (MEAN, SQRTN):  # the count (the engine's BagDenominator)
        n = (p.offsets[1:] - p.offsets[:-1]).to(torch.float64)
        return (n if combiner == MEAN else torch.sqrt(n)).to(torch.float32)
    w = _weights_or_ones(p)
    if combiner == MEAN:
        return torch.segment_reduce(w, "sum", offsets=p.offsets, initial=0.0)
    if combiner == SQRTN:
        return torch.sqrt(torch.segment_reduce(w * w, "sum", offsets=p.offsets, initial=0.0))
    return torch.ones(p.num_bags, dtype=torch.float32, device=w.device)


def _host_coefficients(offsets: np.ndarray, weights: Optional[np.ndarray], combiner: int) -> np.ndarray:
    """_coefficients on the host, float32 NumPy: of the ids of bags
    `offsets` (int64), with float32 `weights` or none (ones). (NumPy's warnings off: PyTorch's ops give the same inf and
    NaN silently.)"""
    counts = offsets[1:] - offsets[:-1]  # (cheaper than np.diff, which wraps this in Python)
    w = np.ones(int(offsets[-1] - offsets[0]), np.float32) if weights is None else weights
    if combiner == SUM:
        return w
    den = _embedcore.bag_denominators(offsets, weights, combiner).repeat(counts)
    nonzero = den != 0
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        return np.where(nonzero, w / np.where(nonzero, den, np.float32(1)), np.float32(0))


def _coefficients(p: _Part, combiner: int) -> Tensor:
    """d out[bag] / d row(id) for each id of a pooled part: w (sum), or
    w / denominator (mean, sqrtn; 0 where the denominator is 0), as the
    engine's own update uses."""
    w = _weights_or_ones(p)
    if combiner == SUM:
        return w
    if p.ids.device.type == "cpu":  # one implementation with the host gradient's (_host_table_grad)
        return torch.from_numpy(_host_coefficients(
            np.ascontiguousarray(_np(p.offsets), np.int64),
            None if p.weights is None else np.ascontiguousarray(_np(w), np.float32), combiner))
    den = _denominators(p, combiner)[_bag_of(p)]
    return torch.where(den == 0, torch.zeros_like(w), w / torch.where(den == 0, torch.ones_like(den), den))


def _engine_lookup(table, p: _Part, combiner: Optional[str]) -> Tensor:
    """The engine's lookup of a part: pooled with `combiner`, or its rows (None)."""
    if combiner is None:
        return _tensor(table.lookup(_engine(p.ids), combiner=None))
    return _tensor(table.lookup(_engine(p.ids), _engine(p.offsets), _engine(p.weights), combiner=combiner))


def _raise_bad_id(table, p: _Part, sources: int, parts: int, error: IndexError, feature: Optional[str] = None):
    """Re-raises the engine's out-of-range error with the id's position in
    the tensor the caller gave (the engine sees the segment, without the
    padding ids): e.g. in a KJT's values, or after dropped padding ids; and
    the feature whose id it is, when known."""
    bad = torch.nonzero((p.ids < 0) | (p.ids >= table.rows)).flatten()
    if not bad.shape[0]:
        raise error
    k = int(bad[0])
    pos = p.start + (int(p.keep[k]) if p.keep is not None else k)
    if feature is not None:
        # A KJT is one source for all of a table's features, a dict one per feature; a
        # lone feature at the start of a KJT has the same positions either way.
        in_kjt = sources == 1 and (parts > 1 or p.start > 0)
        where = "the KeyedJaggedTensor's values" if in_kjt else f"features[{feature!r}]'s ids"
        raise IndexError(f"table '{table.name}', feature {feature!r}: id {int(p.ids[k])} at position {pos} of "
                         f"{where} is out of range [0, {table.rows})") from None
    where = "ids" if sources == 1 else f"the ids of input {p.source} (the table's feature_names[{p.source}])"
    raise IndexError(f"table '{table.name}': id {int(p.ids[k])} at position {pos} of {where} is out of range "
                     f"[0, {table.rows})") from None


# ------------------------------------------------------------------ forward
def lookup_impl(anchor: Tensor, handle: Tensor, dim: int, ids: List[Tensor], offsets: List[Tensor],
                weights: List[Tensor], segments: List[int], combiner: int, padding_idx: int,
                include_last_offset: bool, grad_mode: int, with_step: bool) -> List[Tensor]:
    """Looks up `segments` (triples: source, first bag, number of bags, or
    WHOLE) of the table `handle`; one float32 output per segment:
    ``[bags, dim]`` pooled, or ``[ids, dim]`` unpooled. With `with_step`
    (``needs_step``), one more output: the table's step count, an int64
    scalar on the host, which the backward compares with the table's then.

    `anchor` carries autograd: the weight (unfused training) or a one-element
    tensor (fused training); its data is not read. Ids equal to `padding_idx`
    are left out of pooled bags (and of the mean's count), as PyTorch does."""
    entry = _entry(handle)
    if entry.anchors and anchor.data_ptr() not in entry.anchors:
        raise RuntimeError(f"embedcore table '{entry.table.name}': this lookup's weight is not its table's (a copy "
                           "of a torch.export / torch.jit.trace program, or one given other weights: such a program "
                           "holds the table of the module it was made from, not its weight); run the module, or a "
                           "program made from the module that holds the weights")
    table = entry.table
    # A training table's features only where several read it: one segment of a table of one feature may as well
    # be its module called on its own (the table's name says the feature anyway).
    features = entry.features if entry.features is not None and len(entry.features) > 1 else None
    outs = _lookup_outputs(table, dim, ids, offsets, weights, segments, combiner, padding_idx, include_last_offset,
                           features)
    if with_step:
        outs.append(torch.tensor(table.step, dtype=torch.int64))
    return outs


def needs_step(grad_mode: int, weights: List[Tensor]) -> bool:
    """Whether ``lookup`` should return the table's step after its outputs
    (`with_step`): fused training with per-id weights that require grad,
    whose gradient reads the rows in backward, so they must still be the
    forward's. A value, not a Python attribute of the autograd context, so
    that the check also runs in a compiled backward."""
    return grad_mode == FUSED and torch.is_grad_enabled() and any(w.requires_grad for w in weights)


def _lookup_outputs(table, dim: int, ids: List[Tensor], offsets: List[Tensor], weights: List[Tensor],
                    segments: List[int], combiner: int, padding_idx: int, include_last_offset: bool,
                    features: Optional[List[str]] = None) -> List[Tensor]:
    """The outputs of `lookup`, from `table` (an ``ec.Table`` or a served
    table); an id out of range raises ``IndexError`` naming the table, the
    id, its position in the caller's tensor and (`features`: segment k's
    is ``features[k]``) its feature."""
    windows = _cpu_windows(ids, offsets, weights, segments, combiner, padding_idx, include_last_offset, True)
    if windows is not None:
        try:
            if combiner == SEQUENCE:  # each id's row (sequences take no weights)
                return [torch.from_numpy(table._native_lookup(a, off, None, SEQUENCE, 0, None))
                        for a, off, _ in windows]
            return [torch.from_numpy(table._native_lookup(*w, combiner, 0, None)) for w in windows]
        except (IndexError, ValueError, TypeError):
            pass  # the general path below raises the error, with the caller's positions
    name = _COMBINER_NAMES[combiner]
    outs = []
    parts = _parts(ids, offsets, weights, segments, padding_idx, include_last_offset, combiner != SEQUENCE)
    if features is not None and len(features) != len(parts):
        features = None  # not a collection's call, which gives each of the table's features a segment
    for k, p in enumerate(parts):
        rows = int(p.ids.shape[0]) if combiner == SEQUENCE else p.num_bags
        if rows:  # the engine's own output buffer, wrapped without a copy
            try:
                out = _engine_lookup(table, p, name)
            except IndexError as e:
                _raise_bad_id(table, p, len(ids), len(parts), e, None if features is None else features[k])
            outs.append(out)
        else:
            outs.append(torch.empty((0, dim), dtype=torch.float32, device=p.ids.device))
    return outs


lookup = torch.library.custom_op("embedcore::lookup", mutates_args=())(lookup_impl)


def float16_autocast(device_type: str) -> bool:
    """Whether float16 autocast is on for the table's device or the usual
    model devices (a host table may feed a CUDA model). (A loop over a
    tuple: half the cost of any() over a set, on every fused forward.)"""
    for d in ("cpu", "cuda") if device_type in ("cpu", "cuda") else (device_type, "cpu", "cuda"):
        if torch.is_autocast_enabled(d) and torch.get_autocast_dtype(d) == torch.float16:
            return True
    return False


def refuse_traced_bag_counts(owner: str, segments: List) -> None:
    """NotImplementedError under ``torch.jit.trace`` when a bag count of
    `segments` is a traced shape (a tensor: PyTorch's internal assert in the
    op's ``int[]``); as a Python int it would be fixed at the trace, and
    another batch size would be looked up wrongly."""
    if torch.jit.is_tracing() and any(isinstance(n, Tensor) for n in segments):
        raise NotImplementedError(f"{owner}: torch.jit.trace of pooled lookups is not supported (the number of "
                                  "bags would be fixed at the trace); use torch.compile or torch.export")


def plain_eager(tensors: List[Tensor]) -> bool:
    """Whether a call on `tensors` may skip the custom ops' dispatch (schema
    checks, pytree, the generated autograd) and run their bodies directly
    (``eager_lookup``): eager, with no tracing or mode that must see the op
    (``torch.compile``, ``torch.export``, ``make_fx``, FX, tensor subclasses
    such as fake tensors). The dispatch cost about 0.05 ms a forward and
    0.3 ms a training step warm, two to three times that on the cold cache
    a lookup leaves: as much as a Zipf lookup's gap to ``nn.EmbeddingBag``
    (docs/torch.md)."""
    if torch.compiler.is_compiling() or torch.jit.is_tracing() or torch._C._are_functorch_transforms_active():
        return False
    if torch._C._is_torch_function_mode_enabled() or torch.utils._python_dispatch._get_current_dispatch_mode():
        return False
    return all(type(t) is Tensor or type(t) is torch.nn.Parameter for t in tensors)


@lookup.register_fake
def _(anchor, handle, dim, ids, offsets, weights, segments, combiner, padding_idx, include_last_offset, grad_mode,
      with_step):
    outs = _fake_outputs(dim, ids, segments, combiner)
    if with_step:
        outs.append(torch.empty((), dtype=torch.int64))
    return outs


def _fake_outputs(dim: int, ids: List[Tensor], segments: List[int], combiner: int) -> List[Tensor]:
    outs = []
    for k in range(0, len(segments), 3):
        s, nb = segments[k], segments[k + 2]
        if combiner != SEQUENCE:
            rows = nb
        elif nb == WHOLE:
            rows = ids[s].shape[0]
        else:
            rows = torch.library.get_ctx().new_dynamic_size()
        outs.append(ids[s].new_empty((rows, dim), dtype=torch.float32))
    return outs


# ------------------------------------------------------------------ serving
def served_lookup_impl(handle: Tensor, dim: int, ids: List[Tensor], offsets: List[Tensor], weights: List[Tensor],
                       segments: List[int], combiner: int) -> List[Tensor]:
    """``lookup`` of a served table (an ``embedcore.serving`` table,
    memory-mapped and read-only, registered with its features' names): the
    same segments and float32 outputs, whatever the stored dtype; no
    autograd (callers pass weights detached)."""
    entry = _entry(handle)
    return _lookup_outputs(entry.table, dim, ids, offsets, weights, segments, combiner, -1, True, entry.features)


served_lookup = torch.library.custom_op("embedcore::served_lookup", mutates_args=())(served_lookup_impl)


@served_lookup.register_fake
def _(handle, dim, ids, offsets, weights, segments, combiner):
    return _fake_outputs(dim, ids, segments, combiner)


# ------------------------------------------------------------------ backward
def lookup_backward_impl(handle: Tensor, dim: int, rows: int, ids: List[Tensor], offsets: List[Tensor],
                         weights: List[Tensor], segments: List[int], combiner: int, padding_idx: int,
                         include_last_offset: bool, grad_mode: int, table_grad: bool, weight_grads: bool,
                         grads: List[Tensor], forward_step: Optional[Tensor]) -> Tuple[Tensor, Tensor, List[Tensor]]:
    """The backward of `lookup` for the segments whose outputs got gradients
    (the op's body: its outputs never alias its inputs). See ``_lookup_backward``."""
    return _lookup_backward(handle, dim, rows, ids, offsets, weights, segments, combiner, padding_idx,
                            include_last_offset, grad_mode, table_grad, weight_grads, grads, forward_step, False)


def _lookup_backward(handle: int, dim: int, rows: int, ids: List[Tensor], offsets: List[Tensor],
                     weights: List[Tensor], segments: List[int], combiner: int, padding_idx: int,
                     include_last_offset: bool, grad_mode: int, table_grad: bool, weight_grads: bool,
                     grads: List[Tensor], forward_step: Optional[Tensor],
                     may_alias: bool) -> Tuple[Tensor, Tensor, List[Tensor]]:
    """The backward of `lookup` for the segments whose outputs got gradients.

    Returns ``(a, b, wgrads)``. Fused: ``a`` is the anchor's (zero) gradient,
    after the optimizer step. Sparse: ``a`` holds one gradient row per id
    occurrence and ``b`` its row index. Dense: ``a`` is ``[rows, dim]``.
    ``wgrads``: the gradient of each source's weights (zero where no segment
    reads them), computed before any update; empty unless asked.
    `forward_step`: the table's step at the forward (``with_step``), when the
    weights' gradient is asked for; an update since then raises.
    `may_alias`: an unfused sequence lookup's sparse gradient may hold the
    output's gradient itself, as ``nn.Embedding``'s does (the plain eager
    backward; the op's outputs may not alias its inputs: a copy)."""
    entry = _entry(handle)
    table = entry.table
    if forward_step is not None and weight_grads and int(forward_step) != table.step:
        raise RuntimeError(f"embedcore table '{table.name}' was updated (fused) after this lookup and before its "
                           "backward, so the gradient of its per-sample weights cannot be computed: look the table "
                           "up once per backward (one call for all its bags), or train unfused")
    if grad_mode == FUSED and table_grad and not (weight_grads and weights):
        windows = _cpu_windows(ids, offsets, weights, segments, combiner, padding_idx, include_last_offset)
        if windows is not None and all(g.device.type == "cpu" for g in grads):
            # The rate (a schedule's, or with lr_decay, of the step) and the step are one for threads that
            # train the table at once, as Table._apply_parts makes them.
            with table._schedule_lock():
                lr = _fused_rate(entry)
                try:  # the engine validates everything before it changes anything
                    table._native.apply_gradients(
                        [(*w, combiner, 0, _np(g.contiguous())) for w, g in zip(windows, grads)], lr)
                    stepped = True
                except (IndexError, ValueError, TypeError):
                    stepped = False  # nothing changed: the general path below raises the error
                if stepped:
                    _fused_stepped(entry)
            if stepped:
                return torch.zeros(1), torch.empty(0, dtype=torch.int64), []
    if grad_mode != FUSED and table_grad and not (weight_grads and weights):
        host = _host_table_grad(ids, offsets, weights, segments, combiner, padding_idx, include_last_offset, grads)
        if host is not None:
            v, i = host
            if grad_mode == SPARSE:
                return v, i, []
            return torch.zeros((rows, dim)).index_add_(0, i, v), torch.empty(0, dtype=torch.int64), []
    parts = (_window_parts(ids, offsets, weights, segments, combiner, padding_idx, include_last_offset)
             or _parts(ids, offsets, weights, segments, padding_idx, include_last_offset, True))
    gs = [g.contiguous() for g in grads]
    if combiner == SEQUENCE:
        # Unpooled: each id has its own output row; padding ids' rows get no gradient.
        gs = [g if p.keep is None else g[p.keep] for p, g in zip(parts, gs)]
    device = ids[0].device if ids else torch.device("cpu")

    wgrads: List[Tensor] = []
    if weight_grads and weights:
        wgrads = [torch.zeros(w.shape, dtype=torch.float32, device=w.device) for w in weights]
        for p, g in zip(parts, gs):
            if not p.ids.shape[0]:
                continue
            embs = _engine_lookup(table, p, None)  # the rows, before any update
            if combiner == SEQUENCE:  # out_k = w_k row_k
                dots = (embs * g).sum(1)
            else:
                bag = _bag_of(p)
                dots = (embs * g[bag]).sum(1)
                if combiner != SUM:
                    # out = sum(w row) / D, D = sum(w) (mean) or sqrt(sum(w^2)) (sqrtn):
                    # d out / d w_k = (row_k - out * dD/dw_k) / D, dD/dw_k = 1 or w_k / D.
                    den = _denominators(p, combiner)[bag]
                    out = _engine_lookup(table, p, _COMBINER_NAMES[combiner])[bag]
                    scale = 1.0 if combiner == MEAN else _weights_or_ones(p) / den
                    dots = dots - (out * g[bag]).sum(1) * scale
                    dots = torch.where(den != 0, dots / torch.where(den != 0, den, 1.0), 0.0)
            wgrads[p.source][p.positions()] += dots

    empty_rows = torch.empty(0, dtype=torch.int64, device=device)
    if not table_grad:
        return torch.empty(0, device=device), empty_rows, wgrads
    if grad_mode == FUSED:
        if device.type == "cpu":
            native = []
            for p, g in zip(parts, gs):
                if combiner == SEQUENCE:
                    native.append((_np(p.ids), np.array([0, p.ids.shape[0]], np.int64), None, SEQUENCE, 0, _np(g)))
                else:
                    native.append((_np(p.ids), _np(p.offsets), _engine(p.weights), combiner, 0, _np(g)))
        else:  # on the table's GPU, on PyTorch's current stream
            native = [table._cuda_part(p.ids, p.offsets, p.weights, _COMBINER_NAMES[combiner], 0, g)
                      for p, g in zip(parts, gs)]
        with table._schedule_lock():  # the rate and the step are one (as above)
            lr = _fused_rate(entry)
            if device.type == "cpu":
                table._native.apply_gradients(native, lr)
            else:
                table._cuda_apply(native, lr)
            _fused_stepped(entry)
        return torch.zeros(1, device=device), empty_rows, wgrads

    # Unfused: one gradient row per id occurrence, as nn.EmbeddingBag's backward gives them.
    values, index = [], []
    for p, g in zip(parts, gs):
        if combiner == SEQUENCE:
            values.append(g if len(parts) > 1 or may_alias else g.clone())
        else:
            v = g.index_select(0, _bag_of(p))
            if combiner != SUM or p.weights is not None:  # (a sum's coefficients are ones)
                v.mul_(_coefficients(p, combiner)[:, None])
            values.append(v)
        index.append(p.ids.to(torch.int64, copy=True))  # a copy: outputs never alias inputs
    v = (values[0] if len(values) == 1 else torch.cat(values)) if values else torch.empty((0, dim), device=device)
    i = (index[0] if len(index) == 1 else torch.cat(index)) if index else empty_rows
    if grad_mode == SPARSE:
        return v, i, wgrads
    # (On a GPU, index_add_ sums repeated ids with atomic adds, in no fixed order, unless
    # torch.use_deterministic_algorithms(True).)
    return torch.zeros((rows, dim), device=device).index_add_(0, i, v), empty_rows, wgrads


def _host_table_grad(ids: List[Tensor], offsets: List[Tensor], weights: List[Tensor], segments: List[int],
                     combiner: int, padding_idx: int, include_last_offset: bool,
                     grads: List[Tensor]) -> Optional[Tuple[Tensor, Tensor]]:
    """The unfused table gradient of the calls ``_cpu_windows`` takes (CPU,
    pooled, one source, no padding id; float32 weights, if any), in NumPy:
    ``(values, index)``, one row per id occurrence, as the general path below
    (``index_select`` of each id's bag row, times its coefficient) gives them,
    bit for bit: a row copy, and one float32 product (and quotient) per
    element. Or None. At small batches this takes a few microseconds where
    the general path's PyTorch ops took about 20 (an unfused step took twice
    ``nn.EmbeddingBag``'s)."""
    windows = _cpu_windows(ids, offsets, weights, segments, combiner, padding_idx, include_last_offset)
    if windows is None or (weights and windows[0][2].dtype != np.float32):
        return None
    values, index = [], []
    for (a, off, w), g in zip(windows, grads):
        if not g.is_cpu or g.dtype != torch.float32:
            return None
        counts = off[1:] - off[:-1]  # (cheaper than np.diff and np.repeat, which wrap these in Python)
        v = _np(g.contiguous()).repeat(counts, axis=0)  # the row of each id's bag
        if combiner != SUM or w is not None:
            coef = _host_coefficients(off, None if w is None else np.ascontiguousarray(w), combiner)
            with np.errstate(over="ignore", invalid="ignore"):
                v *= coef[:, None]
        values.append(v)
        index.append(a.astype(np.int64))  # (a copy: outputs never alias inputs)
    v = values[0] if len(values) == 1 else np.concatenate(values)
    i = index[0] if len(index) == 1 else np.concatenate(index)
    return torch.from_numpy(v), torch.from_numpy(i)


lookup_backward = torch.library.custom_op("embedcore::lookup_backward", mutates_args=())(lookup_backward_impl)


@lookup_backward.register_fake
def _(handle, dim, rows, ids, offsets, weights, segments, combiner, padding_idx, include_last_offset, grad_mode,
      table_grad, weight_grads, grads, forward_step):
    like = grads[0] if grads else ids[0]
    empty_rows = like.new_empty((0,), dtype=torch.int64)
    wgrads = [w.new_empty(w.shape, dtype=torch.float32) for w in weights] if weight_grads and weights else []
    if not table_grad:
        return like.new_empty((0,), dtype=torch.float32), empty_rows, wgrads
    if grad_mode == FUSED:
        return like.new_empty((1,), dtype=torch.float32), empty_rows, wgrads
    if grad_mode == SPARSE:
        n = torch.library.get_ctx().new_dynamic_size()
        return like.new_empty((n, dim), dtype=torch.float32), like.new_empty((n,), dtype=torch.int64), wgrads
    return like.new_empty((rows, dim), dtype=torch.float32), empty_rows, wgrads


# ------------------------------------------------------------------ autograd
def _setup_context(ctx, inputs, output):
    (anchor, handle, dim, ids, offsets, weights, segments, combiner, padding_idx, include_last_offset,
     grad_mode, with_step) = inputs
    ctx.set_materialize_grads(False)
    ctx.args = (handle, dim, segments, combiner, padding_idx, include_last_offset, grad_mode)
    ctx.table_shape = tuple(anchor.shape)
    ctx.table_dtype = anchor.dtype
    ctx.table_grad = anchor.requires_grad
    ctx.weight_grads = any(w.requires_grad for w in weights)
    ctx.counts = (len(ids), len(offsets), len(weights))
    # The weights' gradient reads the table's rows in backward: they must be the forward's. Unfused, saving
    # the weight makes autograd refuse in-place changes of it (as nn.EmbeddingBag's backward does); fused,
    # the table's step tells whether an update (another lookup's backward) ran since this forward.
    keep_weight = ctx.weight_grads and grad_mode != FUSED
    # Fused, the (frozen) anchor keeps the table registered (``release_with``) until this backward has read it.
    ctx.anchor = anchor if ctx.weight_grads and grad_mode == FUSED else None
    ctx.with_step = with_step
    step = [output[-1]] if ctx.with_step and ctx.weight_grads else []
    ctx.save_for_backward(*ids, *offsets, *weights, *([anchor] if keep_weight else []), *step)


def _backward(ctx, grads):
    handle, dim, segments, combiner, padding_idx, include_last_offset, grad_mode = ctx.args
    n_ids, n_off, n_w = ctx.counts
    saved = ctx.saved_tensors
    ids, offsets = list(saved[:n_ids]), list(saved[n_ids:n_ids + n_off])
    weights = list(saved[n_ids + n_off:n_ids + n_off + n_w])
    forward_step = saved[-1] if ctx.with_step and ctx.weight_grads else None
    if ctx.with_step:
        grads = grads[:-1]  # the step's (an integer: none)
    # Only the segments whose outputs were used get a gradient (and an update).
    used_segments: List[int] = []
    used_grads: List[Tensor] = []
    for k, g in enumerate(grads):
        if g is not None:
            used_segments.extend(segments[3 * k:3 * k + 3])
            used_grads.append(g)
    none_lists = ([None] * n_ids, [None] * n_off)
    if not used_grads:
        return (None, None, None, *none_lists, [None] * n_w, None, None, None, None, None, None)
    rows = ctx.table_shape[0] if grad_mode != FUSED else 0
    # The op when the backward is differentiated (create_graph): it has no formula for that and says so.
    plain = not torch.is_grad_enabled() and plain_eager([*used_grads, *ids, *offsets, *weights])
    args = (handle, dim, rows, ids, offsets, weights, used_segments, combiner, padding_idx, include_last_offset,
            grad_mode, ctx.table_grad, ctx.weight_grads, used_grads, forward_step)
    a, b, wgrads = (_lookup_backward(*args, True) if plain  # (the op takes the handle as a tensor)
                    else lookup_backward(_op_handle(handle), *args[1:]))
    if not ctx.table_grad:
        table_grad = None
    elif grad_mode == FUSED:
        table_grad = a
    elif grad_mode == SPARSE:
        values = a if a.dtype == ctx.table_dtype else a.to(ctx.table_dtype)
        table_grad = torch.sparse_coo_tensor(b.unsqueeze(0), values, ctx.table_shape, check_invariants=False)
    else:
        table_grad = a.to(ctx.table_dtype)
    weight_grads = list(wgrads) if ctx.weight_grads else [None] * n_w
    return (table_grad, None, None, *none_lists, weight_grads, None, None, None, None, None, None)


lookup.register_autograd(_backward, setup_context=_setup_context)


def _no_second_derivative(ctx, *grads):
    raise NotImplementedError(
        "embedcore lookups have no second derivative: a gradient taken with create_graph=True (a gradient "
        "penalty over the embedding's weight or per-id weights, torch.autograd.grad of a gradient) cannot be "
        "differentiated again through an embedcore table (nn.EmbeddingBag refuses it too); leave the "
        "embedding's parameters out of the penalty")


# A backward taken with create_graph=True records the gradient op: differentiating it again says why it cannot.
lookup_backward.register_autograd(_no_second_derivative, setup_context=lambda ctx, inputs, output: None)


class _EagerLookup(torch.autograd.Function):
    """``lookup`` with its autograd, without the dispatcher (see
    ``plain_eager``): the same body, context and backward. The tensors come
    flat after the other arguments, so that autograd sees the weights; the
    other arguments in one tuple (``apply`` looks at each argument: fewer
    are cheaper)."""

    @staticmethod
    def forward(ctx, anchor, how, counts, *tensors):
        handle, dim, segments, combiner, padding_idx, include_last_offset, grad_mode, with_step = how
        n_ids, n_off, _ = counts
        ids, offsets = list(tensors[:n_ids]), list(tensors[n_ids:n_ids + n_off])
        weights = list(tensors[n_ids + n_off:])
        inputs = (anchor, handle, dim, ids, offsets, weights, segments, combiner, padding_idx, include_last_offset,
                  grad_mode, with_step)
        outs = lookup_impl(*inputs)
        _setup_context(ctx, inputs, outs)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        table_grad, _, _, ids, offsets, weights, *_ = _backward(ctx, list(grads))
        return (table_grad, None, None, *ids, *offsets, *weights)


def eager_lookup(anchor: Tensor, handle: int, dim: int, ids: List[Tensor], offsets: List[Tensor],
                 weights: List[Tensor], segments: List[int], combiner: int, padding_idx: int,
                 include_last_offset: bool, grad_mode: int, with_step: bool) -> List[Tensor]:
    """``lookup``, eagerly (callers check ``plain_eager`` first)."""
    if not torch.is_grad_enabled() or not (anchor.requires_grad or any(w.requires_grad for w in weights)):
        return lookup_impl(anchor, handle, dim, ids, offsets, weights, segments, combiner, padding_idx,
                           include_last_offset, grad_mode, with_step)
    how = (handle, dim, segments, combiner, padding_idx, include_last_offset, grad_mode, with_step)
    return list(_EagerLookup.apply(anchor, how, (len(ids), len(offsets), len(weights)), *ids, *offsets, *weights))


# ------------------------------------------------------------------ collections
def collection_lookup(bags, values: Tensor, offsets: Tensor, weights: List[Tensor], segments: List[List[int]],
                      combiners: List[int]) -> Optional[Tensor]:
    """The pooled lookups of a collection's tables (`bags`, their modules)
    on one source (a KeyedJaggedTensor's values, offsets and weights), as one
    ``[bags, sum of the widths]`` tensor, each table's `segments` in order:
    one engine call forward (``lookup_windows_into``: each table reads its
    windows of the source and writes its columns of the output) and, for the
    tables that train
    fused, one in the backward (``apply_gradients_windows``), with the same
    results, bit for bit, as one ``lookup`` op per table. A DLRM-shaped
    collection at a small batch would otherwise pay the op's per-table costs
    once per table.

    None where a table needs the per-table op, which then runs (and raises
    any error, in the caller's terms): unfused training (gradients for
    PyTorch optimizers), per-id weights that require grad, GPU tables,
    offsets that are not int32 or int64, tracing or compiling (which must see the op),
    float16 autocast (its backward refuses fused training), a bad id."""
    if any(w.requires_grad for w in weights) or not plain_eager([values, offsets, *weights]):
        return None
    if float16_autocast("cpu"):
        return None
    source = _cpu_source([values], [offsets], weights, True)
    if source is None or SEQUENCE in combiners or not segments or not segments[0]:
        return None
    grad_on = torch.is_grad_enabled()
    calls, plan, anchors, col = [], [], [], 0
    for i, (bag, segs, combiner) in enumerate(zip(bags, segments, combiners)):
        anchor, mode = bag._anchor_and_mode(stacklevel=4)
        if not anchor.is_cpu:  # (the weight, or a fused table's anchor: on the table's device)
            return None
        trains = grad_on and anchor.requires_grad
        if trains and mode != FUSED:
            return None
        native = bag.table._native
        calls.extend((native, segs[k + 1], segs[k + 2], combiner) for k in range(0, len(segs), 3))
        if trains:
            anchors.append(anchor)
            plan.append((bag._handle, i, combiner, bag.embedding_dim, col))
        col += bag.embedding_dim * (len(segs) // 3)
    # Every table writes its columns: no concatenation. The engine's result memory, as its lookups' outputs: NumPy's
    # (malloc's heap, which glibc trims and grows again) was faulted in afresh every call.
    out = _embedcore.empty_result(segments[0][2], col)
    try:
        _embedcore.lookup_windows_into(*source, calls, out)
    except (IndexError, ValueError, TypeError):
        return None  # the per-table op raises it, with the caller's positions
    if anchors:
        return _CollectionStep.apply((plan, segments), out, values, offsets,
                                     weights[0] if weights else None, *anchors)
    return torch.from_numpy(out)


def collection_rows(tables, values: Tensor, offsets: Tensor, starts: List[List[int]], stride: int,
                    trains: List[Optional[Tuple[int, Tensor]]]) -> Optional[List[List[Tensor]]]:
    """The unpooled lookups of a collection's `tables` (engine or served
    tables) on one source (a KeyedJaggedTensor's values and offsets): for
    each table, the rows of the ids of each window of `stride` bags from each
    bag of its `starts`, as ``[ids, dim]`` float32 tensors, from the engine
    with no op per table (an ``EmbeddingCollection`` of DLRM's 26 tables
    paid the op's Python costs 26 times a batch, forward and backward).
    `trains`: by table, None (no autograd) or the (handle, anchor) of a table
    that trains fused: its rows carry autograd, and the backward steps every
    such table in one engine call (``apply_gradients_many``: each table
    checked before any changes). None where the per-table ops must run (and
    raise any error in the caller's terms): tracing or compiling, offsets
    that are not int32 or int64, tensors off the CPU, float16 autocast when
    training (its backward refuses fused training), a bad id."""
    if not (offsets.is_cpu and plain_eager([values, offsets])):
        return None
    trained = [i for i, t in enumerate(trains) if t is not None]
    if trained and float16_autocast("cpu"):
        return None
    windows = _row_windows(values, offsets, starts, stride)
    if windows is None:
        return None
    rows, k = [], 0
    try:
        for table, table_starts in zip(tables, starts):
            rows.append([torch.from_numpy(table._native_lookup(a, off, None, SEQUENCE, 0, None))
                         for a, off, _ in windows[k:k + len(table_starts)]])
            k += len(table_starts)
    except (IndexError, ValueError, TypeError):
        return None
    if trained:
        how = ([trains[i][0] for i in trained], [starts[i] for i in trained], stride,
               [r for i in trained for r in rows[i]])
        flat = iter(_CollectionRowsStep.apply(how, values, offsets, *(trains[i][1] for i in trained)))
        for i in trained:
            rows[i] = [next(flat) for _ in rows[i]]
    return rows


def _row_windows(values: Tensor, offsets: Tensor, starts: List[List[int]], stride: int):
    """``_windows`` of `collection_rows`'s source, every table's in order, or None."""
    source = _cpu_source([values], [offsets], [], True)
    flat = [s for table_starts in starts for s in table_starts]
    return None if source is None or not flat else _windows(source, flat, stride)


class _CollectionRowsStep(torch.autograd.Function):
    """``collection_rows`` of tables that train fused: the anchors carry
    autograd (as in ``lookup``), the rows come out as they went in; the
    backward steps every table at once."""

    @staticmethod
    def forward(ctx, how, values, offsets, *anchors):
        ctx.handles, ctx.starts, ctx.stride, rows = how
        ctx.set_materialize_grads(False)  # (outputs that did not reach the loss: None, no step, as the ops)
        ctx.save_for_backward(values, offsets)
        return tuple(rows)

    @staticmethod
    def backward(ctx, *grads):
        values, offsets = ctx.saved_tensors
        # The windows the forward read (the saved tensors cannot have changed).
        windows = _row_windows(values, offsets, ctx.starts, ctx.stride)
        # Each table steps with the windows whose rows got a gradient; a table none of whose rows did, not at
        # all (as each table's op: a step of zeros would still move Adam's and FTRL's slots, and the step).
        used, k = [], 0
        for handle, table_starts in zip(ctx.handles, ctx.starts):
            n = len(table_starts)
            parts = [(a, off, None, SEQUENCE, 0, _np(g.to(torch.float32).contiguous()))
                     for (a, off, _), g in zip(windows[k:k + n], grads[k:k + n]) if g is not None]
            if parts:
                used.append((_entry(handle), parts))
            k += n
        with contextlib.ExitStack() as held:  # each table's rate and step are one (the locks in one global order)
            for table in sorted({id(e.table): e.table for e, _ in used}.items()):
                held.enter_context(table[1]._schedule_lock())
            steps = [(e.table._native, parts, _fused_rate(e), ["grads"] * len(parts), -1) for e, parts in used]
            if steps:
                _embedcore.apply_gradients_many(steps)  # every table checked before any steps
            for e, _ in used:
                _fused_stepped(e)
        return (None, None, None, *(None for _ in ctx.handles))


class _CollectionStep(torch.autograd.Function):
    """``collection_lookup`` of tables that train fused: the anchors carry
    autograd as in ``lookup``; the backward applies every table's step."""

    @staticmethod
    def forward(ctx, how, out, values, offsets, weights, *anchors):
        ctx.plan, ctx.segments = how
        ctx.save_for_backward(values, offsets, *([] if weights is None else [weights]))
        return torch.from_numpy(out)

    @staticmethod
    def backward(ctx, grad):
        values, offsets, *weights = ctx.saved_tensors
        g = _np(grad.to(torch.float32).contiguous())
        entries = [_entry(handle) for handle, *_ in ctx.plan]
        with contextlib.ExitStack() as held:  # each table's rate and step are one (the locks in one global order)
            for table in sorted({id(e.table): e.table for e in entries}.items()):
                held.enter_context(table[1]._schedule_lock())
            steps = []
            for entry, (handle, table, combiner, dim, col) in zip(entries, ctx.plan):
                segs = ctx.segments[table]
                parts = [(segs[k + 1], segs[k + 2], combiner, col + k // 3 * dim) for k in range(0, len(segs), 3)]
                steps.append((entry.table._native, parts, _fused_rate(entry)))
            # The windows the forward read (the saved tensors cannot have changed); every table checked before
            # any steps.
            _embedcore.apply_gradients_windows(*_cpu_source([values], [offsets], weights, True), steps, g)
            for entry in entries:
                _fused_stepped(entry)
        return (None, None, None, None, None, *(None for _ in ctx.plan))  # (the anchors' gradients: none needed)
