"""``embedcore.Table``: one embedding table held by the native engine."""
from __future__ import annotations

import contextlib
import copy
import os
import threading
import weakref
from typing import Dict, Optional

import numpy as np

from . import _device, _embedcore
from . import optimizers as _opt
from ._inputs import Batch, Ragged, as_float32, as_offsets, in_callers_terms, make_batch
from .config import COMBINERS, TableConfig

__all__ = ["Table"]

_COMBINER_CODE = {"sum": 0, "mean": 1, "sqrtn": 2, None: 3}
_ID_DTYPES = (np.dtype(np.int32), np.dtype(np.int64))
_INT64 = np.dtype(np.int64)
_DEFAULT = object()
# The tables that have a schedule lock (Table._schedule_lock()), renewed in a forked child: a lock that
# another thread of the parent held at the fork would be held there for ever.
_SCHEDULED = weakref.WeakSet()


def _renew_schedule_locks() -> None:
    renewed = {}  # one new lock for each old one: a table and its copies (one native table) keep sharing it
    for t in list(_SCHEDULED):
        t.__dict__["_step_lock"] = renewed.setdefault(id(t.__dict__["_step_lock"]), threading.RLock())


os.register_at_fork(after_in_child=_renew_schedule_locks)


# The smallest magnitude that rounds (to nearest even) to infinity in each narrow storage dtype.
_ROUNDS_TO_INF = {"float16": 65520.0, "bfloat16": float.fromhex("0x1.ffp+127")}


def _bfloat16_dtype():
    try:
        import ml_dtypes  # optional; ships with TensorFlow and JAX

        return np.dtype(ml_dtypes.bfloat16)
    except ImportError:
        return None


class LookupMixin:
    """The input forms and output shapes of a lookup, over a native lookup.

    Subclasses provide ``name``, ``dim``, ``_default_combiner`` and
    ``_native_lookup(ids, offsets, weights, code, length, out)``."""

    def _combiner(self, combiner) -> Optional[str]:
        if combiner is _DEFAULT:
            return self._default_combiner
        if combiner is not None and combiner not in COMBINERS:
            raise ValueError(f"table '{self.name}': combiner must be one of {COMBINERS} or None, got {combiner!r}")
        return combiner

    @staticmethod
    def _sequence_length(batch: Batch, max_sequence_length) -> Optional[int]:
        """The padded length of a sequence output, or None for the flat [nnz, dim] form."""
        _check_max_sequence_length(max_sequence_length)
        if max_sequence_length == 0:
            # A dense [batch, k] or sparse [batch, k] input keeps its width; CSR input stays flat.
            return batch.width if batch.kind in ("dense", "sparse") else None
        return int(max_sequence_length)

    def output_shape(self, batch: Batch, combiner: Optional[str], length: Optional[int]) -> tuple:
        if combiner is not None:
            return (batch.num_bags, self.dim)
        if length is not None:
            return (batch.num_bags, length, self.dim)
        return (len(batch.ids), self.dim)

    def lookup(self, ids, offsets=None, weights=None, combiner=_DEFAULT, max_sequence_length: int = 0,
               out: Optional[np.ndarray] = None) -> np.ndarray:
        """Looks up bags of ids.

        ids: ``Ragged(values, offsets)``; a 1-D id array with ``offsets``
            (``batch + 1`` values, CSR) or without (one id per bag); a 2-D
            ``[batch, k]`` array (one bag per row); or ``Sparse(indices,
            values, dense_shape)``. int32 or int64; NumPy, PyTorch, TensorFlow
            or any DLPack / buffer-protocol array, read without a copy when
            C-contiguous.
        weights: per-id float weights in the same form.
        combiner: "sum", "mean", "sqrtn" (default: the table's), or None for
            the unpooled rows: ``[nnz, dim]`` for CSR input, or
            ``[batch, max_sequence_length, dim]`` (truncated or zero-padded;
            dense and sparse inputs default to their width; sparse inputs
            place each id at its position index).
        max_sequence_length: with combiner=None, the ``L`` above (0: flat or
            the input's width); refused with a pooling combiner.
        out: optional C-contiguous float32 array of the output's shape.

        Returns float32 ``[batch, dim]`` (pooled) or the sequence shapes above.
        """
        # The common call straight to the engine (a few microseconds less): int32 / int64 NumPy ids, int64
        # NumPy offsets, every other argument its default. make_batch would pass such arrays on as they are,
        # and the engine checks the rest itself (the ids' range; offsets from 0, non-decreasing, ending at
        # len(ids)). 1-D C-contiguous arrays only: the general way converts others. Whatever the engine
        # refuses (an id out of range, bad offsets, empty offsets) goes again the general way below, which
        # raises the error it always raised.
        if (type(ids) is np.ndarray and type(offsets) is np.ndarray and weights is None and out is None
                and combiner is _DEFAULT and type(max_sequence_length) is int and max_sequence_length == 0
                and ids.dtype in _ID_DTYPES and offsets.dtype == _INT64 and ids.ndim == 1
                and ids.flags.c_contiguous and offsets.flags.c_contiguous and getattr(self, "_device", -1) < 0):
            try:
                return self._native_lookup(ids, offsets, None, _COMBINER_CODE[self._default_combiner], 0, None)
            except Exception:  # noqa: BLE001 - the general path raises it (lookups change nothing: safe to repeat)
                pass
        _check_max_sequence_length(max_sequence_length)
        combiner = self._combiner(combiner)
        _check_sequence_combiner(combiner, max_sequence_length)
        if getattr(self, "_device", -1) >= 0:
            return self._cuda_lookup(ids, offsets, weights, combiner, max_sequence_length, out)
        batch = make_batch(ids, offsets, weights)
        try:
            return self._lookup_batch(batch, combiner, max_sequence_length, out)
        except (IndexError, ValueError) as e:  # a reordered Sparse input: its ids' positions as the caller gave them
            raise in_callers_terms(e, batch) from None

    __call__ = lookup

    def _lookup_batch(self, batch: Batch, combiner, max_sequence_length, out=None) -> np.ndarray:
        length = self._sequence_length(batch, max_sequence_length) if combiner is None else None
        # (A pooled lookup without out= needs no shape: the engine's output has it.)
        shape = self.output_shape(batch, combiner, length) if out is not None or combiner is None else None
        code = _COMBINER_CODE[combiner]
        if out is not None:
            if not isinstance(out, np.ndarray) or out.dtype != np.float32 or not out.flags.c_contiguous:
                raise TypeError(f"out must be a C-contiguous float32 NumPy array, got {_describe(out)}")
            if not out.flags.writeable:
                raise ValueError("out must be writeable")
            if out.shape != shape:
                raise ValueError(f"out must have shape {shape}, got {out.shape}")
        if combiner is None and length == 0:  # [batch, 0, dim]: nothing to look up
            return np.zeros(shape, np.float32) if out is None else out
        if combiner is None and batch.kind == "sparse":
            # Each id goes to its own position (duplicates add up), as TensorFlow does.
            if out is not None:  # as every lookup: out may not share the inputs' memory (it would overwrite them)
                for what, a in (("ids", batch.ids), ("weights", batch.weights), ("ids.indices", batch.indices)):
                    if a is not None and np.may_share_memory(out, a):
                        raise ValueError(f"out shares memory with {what}: pass a separate output array")
            if batch.dense_positions:  # positions 0, 1, 2, ... in every bag: the CSR padded lookup
                return self._native_lookup(batch.ids, batch.offsets, batch.weights, code, length, out)
            return self._sparse_sequence(batch, length, shape, out)
        native_length = length if combiner is None and length is not None else 0
        return self._native_lookup(batch.ids, batch.offsets, batch.weights, code, native_length, out)


    def _sparse_sequence(self, batch: Batch, length: int, shape: tuple, out) -> np.ndarray:
        """[batch, length, dim] with each id's row at its position; the rows of
        ids at the same position add up from zero in input order, as
        TensorFlow's scatter does. The entries are in row-major order, so the
        ids of one position are a run: one native pooled (sum) lookup sums
        every run. Ids at positions past `length` are dropped, but still
        checked, each a run of its own."""
        n = batch.ids.size
        keep = batch.positions < length
        # Each entry's bag: memory of the entries, not of the bags (np.repeat over np.arange(num_bags) made two
        # arrays of the bags, 16 bytes a bag beside the output: a batch of many empty bags took 3x its output).
        bag = np.searchsorted(batch.offsets, np.arange(n, dtype=np.int64), side="right") - 1
        dest = bag * length + batch.positions
        new_run = np.ones(n, bool)
        new_run[1:] = (dest[1:] != dest[:-1]) | ~keep[1:] | ~keep[:-1]
        starts = np.flatnonzero(new_run)
        # (keep_padding: each run is a position of a sequence, where a padding id gives its row, not a bag)
        sums = self._native_lookup(batch.ids, np.append(starts, n).astype(np.int64), batch.weights,
                                   _COMBINER_CODE["sum"], 0, None, keep_padding=True)
        result = np.zeros(shape, np.float32) if out is None else out
        if out is not None:
            out.fill(0)
        kept = keep[starts]
        if kept.all():  # nothing dropped: no boolean-indexed copy of the sums
            result.reshape(-1, shape[-1])[dest[starts]] = sums
        else:
            result.reshape(-1, shape[-1])[dest[starts][kept]] = sums[kept]
        return result


class Table(LookupMixin):
    """An embedding table: ``rows x dim`` values and the optimizer's slots.

    ``Table(config)`` or ``Table(name=..., rows=..., dim=..., dtype=...,
    initializer=..., optimizer=..., combiner=...)``.

    Lookups and updates release the GIL and may run from many threads: any
    number of lookups at once, and an update waits for running lookups and
    holds off new ones, so no lookup sees a half-updated row.
    """

    # An id that the pooled lookups of the module owning this table leave out of their bags (a PyTorch
    # adapter module's padding_idx, which that module applies): checkpoints record it (config.padding_idx,
    # format 1.5) and serving honours it; a load takes a checkpoint that records one only into a table whose
    # own is the same. The table's own lookups do not read it.
    _padding_idx: Optional[int] = None

    def __init__(self, config: Optional[TableConfig] = None, *, device=None, _placement: tuple = (0, 0, 0),
                 **kwargs):
        if config is None:
            config = TableConfig(**kwargs)
        elif not isinstance(config, TableConfig):
            hint = (f"; give the name by keyword: Table(name={config!r}, ...)" if isinstance(config, str) else
                    " (or keyword arguments: Table(name=..., rows=..., dim=...))")
            raise TypeError(f"Table: the positional argument is a TableConfig, got {config!r}{hint}")
        elif kwargs:
            raise TypeError(f"Table: pass a TableConfig or keyword arguments, not both (got {sorted(kwargs)})")
        self._config = config
        self._name = config.name if config.name is not None else "table"
        optimizer = config.optimizer
        native_opt = optimizer._native() if optimizer is not None else _opt.SGD()._native()
        self._optimizer = optimizer
        # The optimizer whose rate a step reads and the engine's version of it (set_optimizer counts), read as one.
        self._stepping = (optimizer, 0)
        self._device = _device.parse_device(device, f"table '{self._name}'")
        self._placement = tuple(_placement)
        self._native = _embedcore.Table(self._name, config.rows, config.dim, config.dtype,
                                        config.initializer._native(), native_opt, *_placement, self._device)

    @classmethod
    def _shard(cls, config: TableConfig, rows: int, cols: int, row_start: int, col_start: int,
               device=None) -> "Table":
        """The block [row_start, +rows) x [col_start, +cols) of the table
        `config` describes, initialised with that table's values there."""
        shard = TableConfig(config.name, rows, cols, config.dtype, config.initializer, config.optimizer,
                            config.combiner)
        return cls(shard, device=device, _placement=(row_start, col_start, config.dim))

    # ------------------------------------------------------------ properties
    @property
    def config(self) -> TableConfig:
        return self._config

    @property
    def name(self) -> str:
        return self._name

    @property
    def rows(self) -> int:
        return self._config.rows

    @property
    def dim(self) -> int:
        return self._config.dim

    @property
    def dtype(self) -> str:
        return self._config.dtype

    @property
    def combiner(self) -> str:
        return self._config.combiner

    @property
    def optimizer(self) -> Optional[_opt.Optimizer]:
        return self._optimizer

    def set_optimizer(self, optimizer: _opt.Optimizer) -> None:
        """Gives a table without slots (no optimizer, or SGD) `optimizer`:
        its slots start at their initial values and the step count at 0;
        the values stay. (The PyTorch adapter uses it to fuse the optimizer
        that ``apply_optimizer_in_backward`` names.) Waits for running
        lookups, updates and saves (``ec.save`` records the optimizer whose
        slots it writes), and for steps of several tables (an Embedding's)
        that checked this one's optimizer. A step that another thread began
        before this call either finishes before it or reads its learning
        rate again after it: no step applies one optimizer's rate under the
        other's rule (also through a ``copy.copy`` of the table, which takes
        the new optimizer too). A table whose optimizer has slots is refused
        (views of its slots would dangle: copy its values into a new table
        instead), as is an impossible optimizer, and a table that a PyTorch
        module, or a graph of its lookups, trains fused (their param group
        and slot views are of the optimizer it fused), before anything
        changes. A KeyboardInterrupt while it waits lands before the change
        or after it, with the table (its rate, config and copies) on the
        optimizer the engine has."""
        if not isinstance(optimizer, _opt.Optimizer):
            raise TypeError(f"table '{self._name}': optimizer must be an embedcore.optimizers.Optimizer, "
                            f"got {optimizer!r}")
        # Under the lock that a scheduled step (and the PyTorch adapter's fused step) holds from reading its
        # rate to stepping: no such step takes the old optimizer's rate to the new rule. A step with a constant
        # rate takes no lock: it names the version it read the rate under, which the engine refuses once this
        # replaced it (_apply_parts). The adapter fuses a table under it too, marking it held.
        with self._schedule_lock():
            held = self.__dict__.get("_optimizer_held_by")
            if held is not None and held[0]() is not None:
                raise ValueError(f"table '{self._name}' trains fused in {held[1]} (or a graph of its lookups), "
                                 f"whose param group and slot views are of its {type(self._optimizer).__name__}: "
                                 "set_optimizer would leave them behind. Give a module its optimizer as it is "
                                 "made (optimizer=, or apply_optimizer_in_backward before its first lookup), or "
                                 "make a new module")
            c = self._config
            config = TableConfig(c.name, c.rows, c.dim, c.dtype, c.initializer, optimizer, c.combiner)
            native, aliases = optimizer._native(), list(self.__dict__.get("_aliases") or (self,))
            before = self._native.optimizer_version
            try:
                self._native.set_optimizer(native)
            finally:
                # Also when a KeyboardInterrupt (Ctrl-C while it waited) lands as the native call returns: the
                # engine may have changed, and the Python side then follows it (its steps, its saves' config).
                version = self._native.optimizer_version
                if version != before:
                    for t in aliases:  # the table and its copies: one native table
                        t._config, t._optimizer = config, optimizer
                        t._stepping = (optimizer, version)

    @property
    def step(self) -> int:
        """Optimizer steps applied so far."""
        return self._native.step

    @step.setter
    def step(self, value: int) -> None:
        # 2**62: the most a checkpoint records (docs/format.md), far from where the int64 count overflows.
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"table '{self._name}': step must be an int in [0, 2**62], got {value!r}")
        if not 0 <= value <= 2**62:
            raise ValueError(f"table '{self._name}': step must be an int in [0, 2**62], got {value!r}")
        self._native.step = int(value)

    @property
    def device(self) -> str:
        """"cpu", or "cuda:N" for a table in GPU memory."""
        return "cpu" if self._device < 0 else f"cuda:{self._device}"

    def __repr__(self) -> str:
        where = "" if self._device < 0 else f", device={self.device!r}"
        return f"Table(name={self._name!r}, rows={self.rows}, dim={self.dim}, dtype={self.dtype!r}{where})"

    # ------------------------------------------------------------ lookup
    @property
    def _default_combiner(self) -> str:
        return self._config.combiner

    def _native_lookup(self, ids, offsets, weights, code, length, out, keep_padding=False):
        # (keep_padding: a table's own lookups never leave its _padding_idx out; a served table's pooled ones do)
        if out is None:
            return self._native.lookup(ids, offsets, weights, code, length)
        self._native.lookup_into(ids, offsets, weights, code, length, out)
        return out

    def lookup_grouped(self, ids, offsets=None, groups=None, *, weights=None) -> np.ndarray:
        """Sums of groups of bags: float32 ``[len(groups) - 1, dim]``.

        ``ids`` and ``offsets`` (or ``ids=Ragged(values, offsets)``) are a CSR
        batch of bags, with optional per-id ``weights`` (keyword only);
        ``groups`` (``num_groups + 1`` non-decreasing bag indices from 0 to
        the number of bags) gathers consecutive bags. Each bag is summed from
        zero in id order, as ``lookup(combiner="sum")`` sums it, and output
        row ``g`` adds the sums of bags ``groups[g]`` .. ``groups[g + 1] - 1``
        in order; an empty group gives zeros. This is how kernels that add a
        bag's rows in groups (TensorFlow's ``sparse_segment_sum``, Eigen's
        4-way segment sums) order their float additions, so their results can
        be reproduced bit for bit. Threads split the groups: one huge group
        runs on one thread. CPU tables only.
        """
        if groups is None:
            raise TypeError("lookup_grouped: groups is required")
        batch = self._csr_batch("lookup_grouped", ids, offsets, weights)
        g = as_offsets(groups, "groups")
        return self._native.lookup_grouped(batch.ids, batch.offsets, batch.weights, g)

    def lookup_sparse_segment(self, ids, offsets=None, combiner: str = "sum") -> np.ndarray:
        """Each bag pooled as TensorFlow's CPU ``sparse_segment_sum`` /
        ``_mean`` / ``_sqrt_n`` pool it (what a ``tf.SparseTensor`` lookup
        runs), bit for bit: float32 ``[bags, dim]``.

        ``ids`` and ``offsets`` (or ``ids=Ragged(values, offsets)``) are a
        CSR batch, unweighted. A bag of ``n >= 10`` ids adds its first ``r``
        rows (``r = n % 8``, or 8 when that is 0, or 9 when it is 1), then
        the sum of each following group of 8 (see ``lookup_grouped``);
        ``mean`` and ``sqrtn`` multiply a bag of fewer than 10 ids by
        ``1 / n`` (``1 / sqrt(n)``) and divide a longer one by ``n``
        (``sqrt(n)``); an empty bag gives zeros. CPU tables only.
        """
        if combiner not in ("sum", "mean", "sqrtn"):
            raise ValueError(f"lookup_sparse_segment: combiner must be 'sum', 'mean' or 'sqrtn', got {combiner!r}")
        batch = self._csr_batch("lookup_sparse_segment", ids, offsets, None)
        return self._native.lookup_sparse_segment(batch.ids, batch.offsets, _COMBINER_CODE[combiner])

    def _csr_batch(self, what: str, ids, offsets, weights) -> Batch:
        """The CSR batch of a host-only grouped lookup (`what`), checked."""
        if getattr(self, "_device", -1) >= 0:
            raise ValueError(f"table '{self.name}' is on {self.device}: {what} takes CPU tables only")
        if offsets is None and not isinstance(ids, Ragged):
            raise ValueError(f"{what}: give the bags as ids and offsets, or as ids=Ragged(values, offsets)")
        batch = make_batch(ids, offsets, weights)
        if batch.kind != "ragged":
            raise ValueError(f"{what} takes bags as ids and offsets (CSR) or Ragged, not {batch.kind} input")
        return batch

    # ------------------------------------------------------------ training
    def _gradient_part(self, batch: Batch, combiner, max_sequence_length, grads, where: str = "grads") -> tuple:
        """Checks `grads` against the lookup it belongs to; returns the native part."""
        length = self._sequence_length(batch, max_sequence_length) if combiner is None else None
        shape = self.output_shape(batch, combiner, length)
        g = as_float32(grads, where)
        if g.shape != shape:
            raise ValueError(f"table '{self._name}': {where} must have shape {shape} (the lookup's output), "
                             f"got {g.shape}")
        if combiner is None and length == 0:  # nothing was looked up: an empty part still counts as a step
            return (np.zeros(0, np.int64), np.zeros(1, np.int64), None, 3, 0, np.zeros((0, self.dim), np.float32))
        if combiner is None and batch.kind == "sparse" and not batch.dense_positions:
            # Every id is checked as lookup checks them, those past the length too, at their positions
            # in the batch (in_callers_terms names the caller's).
            bad = np.flatnonzero((batch.ids < 0) | (batch.ids >= self.rows)) if batch.ids.size and (
                batch.ids.min() < 0 or batch.ids.max() >= self.rows) else ()
            if len(bad):
                raise IndexError(f"table '{self._name}': id {int(batch.ids[bad[0]])} at position {int(bad[0])} of "
                                 f"ids is out of range [0, {self.rows})")
            keep = batch.positions < length
            rows = np.repeat(np.arange(batch.num_bags), np.diff(batch.offsets))
            ids = np.ascontiguousarray(batch.ids[keep])
            w = None if batch.weights is None else np.ascontiguousarray(batch.weights[keep])
            flat = np.ascontiguousarray(g[rows[keep], batch.positions[keep]])
            return (ids, np.array([0, len(ids)], np.int64), w, 3, 0, flat)
        return (batch.ids, batch.offsets, batch.weights, _COMBINER_CODE[combiner],
                length if combiner is None and length is not None else 0, g)

    def learning_rate(self) -> float:
        """The learning rate the next update will use. (A table a PyTorch
        module trains fused, at a number: its param group's "lr", which a
        torch scheduler may have set, and which the module's steps use.)"""
        if self._optimizer is None:
            raise ValueError(f"table '{self._name}' has no optimizer: give its TableConfig or the Embedding one")
        if not callable(self._optimizer.learning_rate):
            held = self.__dict__.get("_optimizer_held_by")
            group_rate = getattr(held[0](), "group_rate", None) if held is not None else None
            if group_rate is not None:
                return group_rate()
        return self._optimizer.learning_rate_at(self.step)

    def apply_gradients(self, ids, offsets=None, grads=None, *, weights=None, combiner=_DEFAULT,
                        max_sequence_length: int = 0) -> None:
        """One optimizer step from the gradient of ``lookup(ids, offsets,
        weights, combiner, max_sequence_length)``'s output.

        Only the rows in ``ids`` change; the gradients of repeated ids are
        summed before one update (plain SGD on a float32 table applies them
        one after another instead: see ``optimizers.SGD``). Everything is validated before anything
        changes.
        """
        if grads is None:
            raise TypeError("apply_gradients() missing the gradients: apply_gradients(ids, offsets, grads)")
        _check_max_sequence_length(max_sequence_length)
        combiner = self._combiner(combiner)
        _check_sequence_combiner(combiner, max_sequence_length)
        if self._device >= 0:
            return self._cuda_apply([self._cuda_part(ids, offsets, weights, combiner, max_sequence_length, grads)])
        batch = make_batch(ids, offsets, weights)
        try:
            part = self._gradient_part(batch, combiner, max_sequence_length, grads)
            self._apply_parts([part])
        except (IndexError, ValueError) as e:  # as lookup: a reordered Sparse input's ids at the caller's positions
            raise in_callers_terms(e, batch) from None

    # ------------------------------------------------------------ device tables
    def _cuda_shape(self, ids, offsets, combiner, max_sequence_length) -> tuple:
        num_bags, nnz = int(offsets.shape[0]) - 1, int(ids.shape[0])
        if combiner is not None:
            return (num_bags, self.dim)
        if max_sequence_length:
            return (num_bags, int(max_sequence_length), self.dim)
        return (nnz, self.dim)

    def _cuda_lookup(self, ids, offsets, weights, combiner, max_sequence_length, out=None):
        """A lookup of CUDA tensors (PyTorch or CuPy) on the caller's current stream (`max_sequence_length`
        checked: by lookup, or a FeatureConfig's)."""
        batch = _device.cuda_batch(self._device, ids, offsets, weights, where=f"table '{self._name}'")
        return self._cuda_lookup_batch(batch, combiner, max_sequence_length, out)

    def _cuda_lookup_batch(self, batch: tuple, combiner, max_sequence_length, out=None):
        """_cuda_lookup of a batch already on this table's device: ``_device.cuda_batch``'s (ids, offsets,
        weights, reference tensor, width)."""
        ids, offsets, weights, ref, width = batch
        if combiner is None and max_sequence_length == 0 and width is not None:
            max_sequence_length = width  # a dense [batch, k] input keeps its width, as on the CPU
            if width == 0:
                return _device.empty(ref, (int(offsets.shape[0]) - 1, 0, self.dim), self._device)
        shape = self._cuda_shape(ids, offsets, combiner, max_sequence_length)
        if out is None:
            out = _device.empty(ref, shape, self._device)
        elif tuple(out.shape) != shape:
            raise ValueError(f"out must have shape {shape}, got {tuple(out.shape)}")
        self._native.lookup_cuda(ids, offsets, weights, _COMBINER_CODE[combiner], int(max_sequence_length), out,
                                 _device.current_stream(ref))
        return out

    def _cuda_part(self, ids, offsets, weights, combiner, max_sequence_length, grads) -> tuple:
        batch = _device.cuda_batch(self._device, ids, offsets, weights, where=f"table '{self._name}'")
        return self._cuda_part_batch(batch, combiner, max_sequence_length, grads)

    def _cuda_part_batch(self, batch: tuple, combiner, max_sequence_length, grads) -> tuple:
        """_cuda_part of a batch already on this table's device (as _cuda_lookup_batch)."""
        ids, offsets, weights, ref, width = batch
        flat = None  # [batch, 0, dim]: no ids (a dense input of width 0), a step all the same, as on the CPU
        if combiner is None and max_sequence_length == 0 and width is not None:
            if width == 0:
                flat = (0, self.dim)
            else:
                max_sequence_length = width
        shape = (int(offsets.shape[0]) - 1, 0, self.dim) if flat else self._cuda_shape(ids, offsets, combiner,
                                                                                       max_sequence_length)
        if not _device.is_cuda_array(grads):
            raise TypeError(f"table '{self._name}' is on {self.device}: grads must be a CUDA tensor")
        if tuple(grads.shape) != shape:
            raise ValueError(f"table '{self._name}': grads must have shape {shape} (the lookup's output), "
                             f"got {tuple(grads.shape)}")
        g = _device._as(grads, "float32", "grads").reshape(flat or shape)
        return (ids, offsets, weights, _COMBINER_CODE[combiner], int(max_sequence_length), g, ref)

    def _cuda_apply(self, parts, learning_rate: Optional[float] = None) -> None:
        stream = _device.current_stream(parts[0][-1]) if parts else 0
        with self._schedule_lock():  # (as _apply_parts)
            lr = self.learning_rate() if learning_rate is None else learning_rate
            self._native.apply_gradients_cuda([p[:-1] for p in parts], lr, stream)

    def _check_step_can_grow(self) -> None:
        """What the native step refuses, before a collective step reaches it
        (the distributed Embedding checks every rank first): a table at the
        last step a checkpoint records (as the core's CheckStepCanGrow)."""
        if self.step >= _MAX_STEP:
            raise ValueError(f"table '{self._name}' is at step {self.step}, the last a checkpoint records (2^62): "
                             "no further step")

    def __copy__(self) -> "Table":
        """A shallow copy (``copy.copy``): the same native table, so the
        same step lock, made now if the table has none yet, and renewed
        with the table's in a forked child, and the same optimizer, which
        ``set_optimizer`` of either replaces in both."""
        with self._schedule_lock():  # (which set_optimizer holds: the twin is among the aliases it updates)
            aliases = self.__dict__.get("_aliases")
            if aliases is None:
                aliases = self.__dict__.setdefault("_aliases", weakref.WeakSet([self]))
            twin = object.__new__(type(self))
            twin.__dict__.update(self.__dict__)
            aliases.add(twin)
        _SCHEDULED.add(twin)
        return twin

    def __reduce__(self):
        """Pickles a host table as a new table of the same config with the
        same values, slots and step, bit for bit (NaN and infinity too: a
        copy of a table whose training diverged is that table, though
        ``ec.save`` refuses both). They are read as one with the config,
        under the table's locks: another thread's step or ``set_optimizer``
        lands before or after them, not between. The copy writes only the
        rows that differ from its initializer's, so a ``Zeros`` table's
        untouched rows take no memory in it either; the snapshot taken to
        make it takes the table's size meanwhile. A table in GPU memory is
        refused (``ec.save`` it and ``ec.load`` it into a new table
        instead)."""
        if self._device >= 0:
            raise TypeError(f"table '{self._name}' is in GPU memory ({self.device}) and does not pickle or deepcopy: "
                            "save it (ec.save) and load it (ec.load) into a new table instead")
        with self._schedule_lock():  # (which set_optimizer holds while it changes the optimizer and the config)
            values, slots, step = self._native.snapshot()
            config = self._config
        return (_unpickle_table, (type(self), config, self._placement, self.__dict__.get("_padding_idx"),
                                  values, slots, step))

    def __deepcopy__(self, memo) -> "Table":
        """``copy.deepcopy``: as a pickle makes it (``__reduce__``), without
        a copy of the snapshot; the config is deep-copied with `memo`, so an
        Embedding's copied tables and features share their copied configs."""
        fn, (cls, config, *rest) = self.__reduce__()
        return fn(cls, copy.deepcopy(config, memo), *rest)

    def _hold_optimizer(self, token, holder: str) -> None:
        """Marks this table and its copies trained fused by `holder` (words
        for an error) for as long as `token` lives: ``set_optimizer`` refuses
        meanwhile. (The PyTorch adapter's fused modules: their param group
        and slot views are of this optimizer.)"""
        held = (weakref.ref(token), holder)
        with self._schedule_lock():
            for t in list(self.__dict__.get("_aliases") or (self,)):
                t.__dict__["_optimizer_held_by"] = held

    def _schedule_lock(self) -> threading.RLock:
        """This table's lock that makes reading a schedule's rate and stepping
        one, and that ``set_optimizer`` holds (reentrant: the PyTorch adapter
        holds it around its fused steps, which may step through
        ``_cuda_apply``)."""
        lock = self.__dict__.get("_step_lock")
        if lock is None:
            lock = self.__dict__.setdefault("_step_lock", threading.RLock())
            _SCHEDULED.add(self)
        return lock

    def _apply_parts(self, parts) -> None:
        optimizer, version = self._stepping
        if optimizer is not None and not callable(optimizer.learning_rate):
            # A constant rate is read without the lock (a lock on every step would cost each step, and steps of
            # several threads would no longer overlap their validation): the engine refuses the step, changing
            # nothing, when set_optimizer replaced the optimizer since; then the rate is read again, below.
            try:
                self._native.apply_gradients(parts, optimizer.learning_rate_at(self.step), version)
                return
            except _embedcore.OptimizerChanged:
                pass
        # A schedule's rate depends on the step: reading it and stepping are one, for threads that update this
        # table at once (the native step takes the table's lock only for its own part).
        with self._schedule_lock():
            self._native.apply_gradients(parts, self.learning_rate())

    # ------------------------------------------------------------ state
    def values(self) -> np.ndarray:
        """Read-only zero-copy view ``[rows, dim]`` of the stored values
        (bfloat16 as ``ml_dtypes.bfloat16`` when installed, else raw uint16
        bits). It reflects later updates; copy it for a snapshot."""
        if self._device >= 0:  # a DLPack tensor in GPU memory: torch.from_dlpack / cupy.from_dlpack
            return self._native.device_values()
        v = self._native.values()
        if self.dtype == "bfloat16":
            bf16 = _bfloat16_dtype()
            if bf16 is not None:
                v = v.view(bf16)
        return v

    def to_numpy(self, start_row: int = 0, num_rows: Optional[int] = None) -> np.ndarray:
        """A float32 copy of rows ``[start_row, start_row + num_rows)``."""
        start_row = _row_index(self._name, "start_row", start_row)
        if num_rows is None:
            if not 0 <= start_row <= self.rows:
                raise IndexError(f"table '{self._name}': start_row {start_row} is outside [0, {self.rows}]")
            n = self.rows - start_row
        else:
            n = _row_index(self._name, "num_rows", num_rows)
        if n < 0:
            raise ValueError(f"table '{self._name}': num_rows must be >= 0, got {n}")
        if start_row < 0 or start_row + n > self.rows:
            raise IndexError(f"table '{self._name}': read rows [{start_row}, {start_row + n}) do not fit in "
                             f"[0, {self.rows})")
        return self._native.read_values(start_row, n)

    def slots(self) -> Dict[str, np.ndarray]:
        """Read-only zero-copy float32 views of the slot variables, by name
        (DLPack tensors in GPU memory for a device table): ``[rows, dim]``,
        or ``[rows, 1]`` for ``RowWiseAdagrad``'s ``row_accumulators``."""
        if self._device >= 0:
            return dict(self._native.device_slots())
        return dict(self._native.slots())

    @property
    def slot_names(self) -> tuple:
        return tuple(self._native.slot_names)

    def assign(self, values, start_row: int = 0) -> None:
        """Overwrites rows ``[start_row, start_row + len(values))`` (float
        values, rounded to the storage dtype). Values must be finite (a
        checkpoint holding others fails ``embedcore verify``), also once
        rounded: a float16 table takes magnitudes below 65520 (largest
        65504), a bfloat16 one below about 3.396e38."""
        v = as_float32(values, "values")
        if v.ndim != 2 or v.shape[1] != self.dim:
            raise ValueError(f"table '{self._name}': values must have shape [n, {self.dim}], got {v.shape}")
        start_row = self._assigned_rows(start_row, len(v), "rows")
        check_storable(self._name, self.dtype, v, values)
        self._native.assign_values(start_row, v)

    def reset_values(self) -> None:
        """Fills the values with the table's initializer again: the values it
        had when created (every initializer is seeded; a shard gets those of
        its block of the whole table). The slots and step stay as they are.
        A ``Zeros`` table's memory is handed back (it takes memory again only
        as rows are written, as when it was made). One native call, under the table's lock: lookups see the old values
        or the new ones, and an interrupt (Ctrl-C) comes before or after it.
        A table that the TensorFlow adapter filled from a Keras / TensorFlow
        initializer it calls gets that initializer's values again (the same
        values for an int seed)."""
        again = self.__dict__.get("_reset_with")
        if again is not None:
            self.assign(again())
            return
        self._native.reset_values()

    def assign_slot(self, name: str, values, start_row: int = 0) -> None:
        """Overwrites rows ``[start_row, start_row + len(values))`` of
        optimizer slot `name` (one of ``slot_names``) with float values of
        shape ``[n, slot_dim]``: ``[n, dim]``, or ``[n, 1]`` for row-wise
        Adagrad's ``row_accumulators``. Values must be finite and within the
        optimizer's domain (README, Errors: accumulators and velocities at
        least 0; accumulators above 0 where the step would divide by them:
        Adagrad and row-wise Adagrad with ``epsilon=0``, FTRL), else
        ``ValueError`` naming the first offender, with the slot unchanged.
        (Values that another thread rewrites during the call are checked
        again as they are copied: one that became bad is refused there,
        the rows before it assigned, and no bad value reaches the slot.)"""
        names = self.slot_names
        if name not in names:
            raise ValueError(f"table '{self._name}' has no slot {name!r}; its slots are {list(names)}")
        v = as_float32(values, f"slot {name}")
        cols = self._native.slot_dim  # 1 for row-wise Adagrad
        if v.ndim != 2 or v.shape[1] != cols:
            raise ValueError(f"table '{self._name}': slot {name} values must have shape [n, {cols}], got {v.shape}")
        start_row = self._assigned_rows(start_row, len(v), "slot rows")
        # The engine refuses (naming the first) a value that is not finite or is outside the slot's domain
        # for the table's optimizer (slot_problem).
        self._native.assign_slot(names.index(name), start_row, v)

    def _assigned_rows(self, start_row, n: int, what: str) -> int:
        start_row = _row_index(self._name, "start_row", start_row)
        if not 0 <= start_row <= self.rows - n:
            raise IndexError(f"table '{self._name}': assigned {what} [{start_row}, {start_row + n}) do not fit in "
                             f"[0, {self.rows})")
        return start_row


_MAX_STEP = 2**62  # the last step a checkpoint records (docs/format.md)


def _unpickle_table(cls, config: TableConfig, placement: tuple, padding_idx, values: np.ndarray, slots: dict,
                    step: int) -> Table:
    """The table ``Table.__reduce__`` pickled: a new table of `config`, its
    values (in their storage dtype), slots and step written as they were."""
    table = object.__new__(cls)
    Table.__init__(table, config, _placement=placement)
    _copy_rows(table._native.values_mut(), values)
    mine = dict(table._native.slots_mut())
    for name, v in slots.items():
        _copy_rows(mine[name], v)
    table.step = step
    if padding_idx is not None:
        table._padding_idx = padding_idx
    return table


def _copy_rows(dst: np.ndarray, src: np.ndarray) -> None:
    """Copies `src` into `dst` (arrays of one shape and item size) bit for
    bit, in blocks of about 2 MiB, skipping the blocks that already hold the
    same bits (reading memory not yet written maps no page: a Zeros table's
    untouched rows stay untouched)."""
    if dst.shape != src.shape or dst.itemsize != src.itemsize:
        raise ValueError(f"the pickled array has shape {src.shape} of {src.dtype}, the table's {dst.shape} of "
                         f"{dst.dtype}")
    bits = np.dtype(f"u{dst.itemsize}")
    d, s = dst.view(bits), src.view(bits)
    rows = max(1, (2 << 20) // max(1, d[:1].nbytes))
    for r in range(0, len(s), rows):
        if not np.array_equal(d[r:r + rows], s[r:r + rows]):
            d[r:r + rows] = s[r:r + rows]


@contextlib.contextmanager
def _schedule_locks(tables):
    """Holds the step locks (``Table._schedule_lock``) of `tables`, taken
    in one order (by id), so that two callers holding several never
    deadlock."""
    with contextlib.ExitStack() as held:
        for _, table in sorted({id(t): t for t in tables}.items()):
            held.enter_context(table._schedule_lock())
        yield


def apply_gradients_many(steps) -> None:
    """One optimizer step of several host tables, all or nothing. `steps`:
    ``(table, parts, names)`` per table (its native gradient parts, from
    ``Table._gradient_part``, and what to call each in an error). Each
    learning rate, then one native call that checks every table (the last
    step a checkpoint records, gradients that view any table of the call)
    before any table changes, and runs the steps with no interrupt between
    two tables."""
    # A schedule's rate depends on the step: reading it and stepping are one (as in Table._apply_parts), for
    # threads that train these tables at once; the scheduled tables' locks are taken in one order (no deadlock).
    # A constant rate is read without the lock and named with the optimizer version it was read under, as in
    # Table._apply_parts: when set_optimizer replaced one meanwhile, no table changes (OptimizerChanged) and the
    # call runs again holding every table's lock.
    stepping = [table._stepping for table, _, _ in steps]
    scheduled = [t for (t, _, _), (o, _) in zip(steps, stepping) if o is not None and callable(o.learning_rate)]
    try:
        with _schedule_locks(scheduled):
            rates = [o.learning_rate_at(t.step) if o is not None else t.learning_rate()
                     for (t, _, _), (o, _) in zip(steps, stepping)]
            _embedcore.apply_gradients_many([(table._native, parts, rate, names, version)
                                             for (table, parts, names), rate, (_, version)
                                             in zip(steps, rates, stepping)])
        return
    except _embedcore.OptimizerChanged:
        pass
    with _schedule_locks([table for table, _, _ in steps]):
        rates = [table.learning_rate() for table, _, _ in steps]
        _embedcore.apply_gradients_many([(table._native, parts, rate, names, -1)
                                         for (table, parts, names), rate in zip(steps, rates)])


def _check_max_sequence_length(value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"max_sequence_length must be an int, got {value!r}")
    if value < 0:
        raise ValueError(f"max_sequence_length must be >= 0, got {value}")
    if value >= 2**63:
        raise ValueError(f"max_sequence_length must be < 2**63, got {value}")


def _check_sequence_combiner(combiner, max_sequence_length) -> None:
    """A pooled lookup has no sequence length: one given is refused, not ignored."""
    if combiner is not None and max_sequence_length:
        raise ValueError(f"max_sequence_length applies to sequence lookups (combiner=None), got "
                         f"max_sequence_length={max_sequence_length} with combiner {combiner!r}")


def _row_index(table: str, name: str, value) -> int:
    """`value` as a Python int: an int or NumPy integer, not a bool, a float or a string."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"table '{table}': {name} must be an int, got {value!r}")
    return int(value)


def check_storable(name: str, dtype: str, v: np.ndarray, given) -> None:
    """ValueError naming the first of the float32 values `v` (`given`, as
    the caller passed them) that table `name` of `dtype` cannot hold: not
    finite, or rounding to infinity in its storage dtype."""
    finite = np.isfinite(v)
    if not finite.all():
        r, c = (int(x) for x in np.argwhere(~finite)[0])
        as_given = "" if isinstance(given, np.ndarray) and given.dtype == np.float32 else " (as float32)"
        raise ValueError(f"table '{name}': values[{r}, {c}] = {v[r, c]}{as_given} is not finite")
    limit = _ROUNDS_TO_INF.get(dtype)
    if limit is not None:
        over = np.abs(v) >= limit
        if over.any():
            r, c = (int(x) for x in np.argwhere(over)[0])
            raise ValueError(f"table '{name}': values[{r}, {c}] = {v[r, c]} is beyond the range of its storage dtype "
                             f"{dtype} (it would round to infinity)")


def slot_problem(table: "Table", name: str, smallest: float) -> Optional[str]:
    """Why slot `name` of `table` cannot hold values whose least is
    `smallest` (an accumulator below 0, or at 0 where the optimizer's step
    would divide 0 by 0), or None: the engine's rule, which
    ``assign_slot`` and loads apply too."""
    bounded, minimum, strict, description = table._native.slot_lower_bound(table.slot_names.index(name))
    if bounded and not (smallest > minimum if strict else smallest >= minimum):
        return f"must be {description}, got {smallest}"
    return None


def _describe(x) -> str:
    if isinstance(x, np.ndarray):
        return f"ndarray of {x.dtype} {x.shape}{'' if x.flags.c_contiguous else ' (not C-contiguous)'}"
    return type(x).__name__
