"""Fuzz target of the lookup and update input paths (atheris / libFuzzer).

    python tests/fuzz/fuzz_lookup.py [libFuzzer flags] WORK_CORPUS
    FUZZ_TARGET=lookup tests/fuzz/run_fuzz.sh SECONDS     # a bounded run, as CI does

tests/python/test_lookup_fuzz.py runs the same target on fixed random
inputs (and past findings, tests/fuzz/findings/lookup-*) in the default test
run.

Each input is decoded (``Provider``) into a small table (rows,
dim, storage dtype, optimizer) and one call of ``Table.lookup``,
``Table.apply_gradients`` or ``Table.lookup_sparse_segment`` with ids in one
of the documented forms (1-D with or without offsets, 2-D dense, ``Ragged``,
``Sparse``, a list, a PyTorch tensor), of any NumPy dtype, strided or not,
with offsets, weights, combiner, ``max_sequence_length``, ``out`` and
gradients that are mostly well formed and sometimes not (out of range,
unsorted, of the wrong length, dtype or shape, NaN weights).

Accepted outcomes: success, or ``ValueError``, ``TypeError`` or
``IndexError`` (and ``MemoryError`` naming the size, for an output too large
to allocate). Also checked:
- a lookup never changes the table, and a call that raises leaves it
  exactly as it was (values, every slot, step);
- a lookup from every form but ``Sparse`` (pooled, flat or padded
  sequence rows, any storage dtype) matches tests/python/reference.py
  (float64, from the stored values) within the float32 rounding bound.
Anything else, another exception type, a crash, a mismatch, is a finding.
"""
from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, os.pardir, "python"))

_ACCEPTED = (ValueError, TypeError, IndexError)
_DEFAULT = object()
ID_DTYPES = ["int64", "int32", "int16", "int8", "uint64", "uint32", "uint8", "float32", "float64", "bool"]
WEIGHT_DTYPES = ["float32", "float64", "float16", "int32"]
COMBINERS = [_DEFAULT, "sum", "mean", "sqrtn", None] * 3 + ["bogus", 3]
OPTIMIZERS = ["sgd", "adagrad", "adam", "ftrl"]
# A sequence length whose output no machine can allocate (beyond the address
# space, so no overcommit setting lets it through): a MemoryError that says so.
HUGE = 1 << 47
STATS = {"ok": 0, "checked": 0, "refused": 0, "memory": 0}  # outcomes so far: succeeded, of which checked by
# the reference; raised ValueError / TypeError / IndexError; raised MemoryError (an output too large)
EXTREMES = [-(1 << 63), (1 << 63) - 1, 1 << 31, -(1 << 31) - 1, (1 << 32) + 1]


class Provider:
    """Decodes an input's bytes into choices, front to back (as
    atheris.FuzzedDataProvider does, so libFuzzer's mutations map to nearby
    inputs), without atheris: the default test run uses it too. When the
    bytes run out every choice is its lowest."""

    def __init__(self, data: bytes):
        self._data, self._pos = data, 0

    def ConsumeIntInRange(self, lo: int, hi: int) -> int:
        span = hi - lo + 1
        n = (span.bit_length() + 7) // 8
        raw = self._data[self._pos:self._pos + n]
        self._pos += n
        return lo + int.from_bytes(raw, "little") % span if raw else lo

    def ConsumeBool(self) -> bool:
        return bool(self.ConsumeIntInRange(0, 1))

    def PickValueInList(self, values):
        return values[self.ConsumeIntInRange(0, len(values) - 1)]


def _table(fdp):
    import embedcore as ec

    rows = fdp.ConsumeIntInRange(1, 40)
    dim = fdp.ConsumeIntInRange(1, 9)
    dtype = fdp.PickValueInList(["float32", "float32", "float16", "bfloat16"])
    opt = fdp.PickValueInList(OPTIMIZERS)
    optimizer = {"sgd": lambda: ec.optimizers.SGD(0.1), "adagrad": lambda: ec.optimizers.Adagrad(0.1),
                 "adam": lambda: ec.optimizers.Adam(0.01), "ftrl": lambda: ec.optimizers.FTRL(0.1)}[opt]()
    return ec.Table(name="t", rows=rows, dim=dim, dtype=dtype, optimizer=optimizer,
                    initializer=ec.initializers.Uniform(-1, 1, seed=7), combiner="sum")


def _ints(fdp, n, rows):
    """`n` ids in [0, rows); in one input of four, some just outside or extreme."""
    import numpy as np

    out = np.empty(n, dtype=object)
    wild = fdp.ConsumeIntInRange(0, 3) == 0
    for i in range(n):
        k = fdp.ConsumeIntInRange(0, 15) if wild else 0
        if k < 12:
            out[i] = fdp.ConsumeIntInRange(0, rows - 1)
        elif k < 15:
            out[i] = fdp.ConsumeIntInRange(-2, rows + 2)
        else:
            out[i] = fdp.PickValueInList(EXTREMES)
    return out


def _array(fdp, values, dtypes):
    """`values` (an object array) as an array of a dtype picked from
    `dtypes` (values that do not fit wrap, as a C cast would), sometimes
    strided or read-only."""
    import numpy as np

    dtype = np.dtype(fdp.PickValueInList(dtypes))
    if dtype.kind in "iu":
        wrapped = [(int(v) if np.isfinite(float(v)) else 0) % (1 << (8 * dtype.itemsize)) for v in values]
        a = np.array(wrapped, dtype=np.uint64).astype(dtype) if len(values) else np.zeros(0, dtype)
    else:
        a = np.array([float(v) for v in values], dtype=np.float64).astype(dtype)
    k = fdp.ConsumeIntInRange(0, 7)
    if k == 0 and a.size:  # strided: every other element of a twice-as-long array
        b = np.zeros(a.size * 2, a.dtype)
        b[::2] = a
        a = b[::2]
    elif k == 1:
        a.flags.writeable = False
    return a


def _offsets(fdp, nnz, batch):
    """CSR offsets: valid (0 .. nnz, non-decreasing) unless mutated."""
    import numpy as np

    cuts = sorted(fdp.ConsumeIntInRange(0, nnz) for _ in range(max(batch - 1, 0)))
    offs = [0] + cuts + [nnz] if batch > 0 else [0]
    if fdp.ConsumeIntInRange(0, 9) == 0 and len(offs) > 1:  # a bad one
        i = fdp.ConsumeIntInRange(0, len(offs) - 1)
        offs[i] = fdp.PickValueInList([-1, nnz + 1, offs[i] + 1, (1 << 40)])
    if fdp.ConsumeIntInRange(0, 19) == 0:
        offs = offs[:-1]
    return np.array(offs, dtype=np.int64).astype(fdp.PickValueInList(["int64", "int64", "int32", "float64"]))


def _weights(fdp, n):
    import numpy as np

    if fdp.ConsumeBool():
        return None
    m = n if fdp.ConsumeIntInRange(0, 9) else n + fdp.PickValueInList([-1, 1])
    vals = np.empty(max(m, 0), dtype=object)
    for i in range(vals.size):
        k = fdp.ConsumeIntInRange(0, 19)
        vals[i] = float("nan") if k == 0 else float("inf") if k == 1 else fdp.ConsumeIntInRange(-4, 4) / 2.0
    return _array(fdp, vals, WEIGHT_DTYPES)


def check(data: bytes) -> None:
    """The entry function: one input; raises on a finding."""
    import numpy as np

    import embedcore as ec
    import reference

    fdp = Provider(data)
    table = _table(fdp)
    rows, dim = table.rows, table.dim
    form = fdp.ConsumeIntInRange(0, 6)
    batch = fdp.ConsumeIntInRange(0, 6)
    nnz = fdp.ConsumeIntInRange(0, 24)
    ids = _array(fdp, _ints(fdp, nnz, rows), ID_DTYPES if fdp.ConsumeIntInRange(0, 3) == 0 else ["int64", "int32"])
    weights = _weights(fdp, nnz)
    offsets = None
    oracle = None  # (ids, offsets, weights, width of a dense input) as CSR, where the reference applies
    if form == 0:  # 1-D ids with CSR offsets
        offsets = _offsets(fdp, nnz, batch)
        args = (ids, offsets, weights)
        oracle = (ids, offsets, weights, None)
    elif form == 1:  # 1-D ids, one per bag
        args = (ids, None, weights)
        oracle = (ids, np.arange(nnz + 1), weights, None)
    elif form == 2:  # 2-D dense [batch, k]
        k = fdp.ConsumeIntInRange(0, 4)
        n = batch * k
        ids2 = _array(fdp, _ints(fdp, n, rows), ["int64", "int32"]).reshape(batch, k)
        w2 = None if weights is None else _array(fdp, np.ones(n, dtype=object), WEIGHT_DTYPES).reshape(batch, k)
        args = (ids2, None, w2)
        oracle = (ids2.reshape(-1), np.arange(batch + 1) * k, None if w2 is None else w2.reshape(-1), k)
    elif form == 3:  # Ragged
        offsets = _offsets(fdp, nnz, batch)
        rag_w = None if weights is None else ec.Ragged(weights, offsets)
        args = (ec.Ragged(ids, offsets), None, rag_w)
        oracle = (ids, offsets, weights, None)
    elif form == 4:  # Sparse [batch, width]
        width = fdp.ConsumeIntInRange(0, 5)
        idx = np.array([[fdp.ConsumeIntInRange(-1, batch), fdp.ConsumeIntInRange(-1, width)] for _ in range(nnz)],
                       dtype=np.int64).reshape(nnz, 2)
        if fdp.ConsumeIntInRange(0, 3):  # usually in order, within the shape
            idx = np.array(sorted({(r % max(batch, 1), c % max(width, 1)) for r, c in idx.tolist()}),
                           dtype=np.int64).reshape(-1, 2)
            ids = ids[:len(idx)]
            weights = None if weights is None else weights[:len(idx)]
        sw = None if weights is None else ec.Sparse(idx, weights, (batch, width))
        args = (ec.Sparse(idx, ids, (batch, width)), None, sw)
    elif form == 5:  # a Python list
        offsets = _offsets(fdp, nnz, batch)
        args = (ids.tolist(), offsets.tolist(), None if weights is None else weights.tolist())
        oracle = (ids, offsets, weights, None)
    else:  # PyTorch tensors
        import torch

        offsets = _offsets(fdp, nnz, batch)
        args = (torch.from_numpy(np.array(ids)), torch.from_numpy(np.array(offsets)),
                None if weights is None else torch.from_numpy(np.array(weights)))
        oracle = (ids, offsets, weights, None)

    combiner = fdp.PickValueInList(COMBINERS)
    kw = {} if combiner is _DEFAULT else {"combiner": combiner}
    if fdp.ConsumeIntInRange(0, 3) == 0:
        kw["max_sequence_length"] = fdp.PickValueInList([0, 1, 3, -1, HUGE, 2.5])
    before = _snapshot(table)
    op = fdp.ConsumeIntInRange(0, 5)
    try:
        if op <= 2:  # lookup, sometimes into `out`
            if op == 2:
                shape = fdp.PickValueInList([(batch, dim), (batch, dim), (nnz, dim), (batch, 3, dim), (1,)])
                kw["out"] = np.zeros(shape, dtype=fdp.PickValueInList(["float32", "float32", "float32", "float64"]))
            got = table.lookup(*args, **kw)
            if oracle is not None:
                _check_against_reference(table, got, oracle, combiner, kw.get("max_sequence_length", 0),
                                         kw.get("out"))
                STATS["checked"] += 1
            if not _same(table, before):
                raise AssertionError("a lookup changed the table")
        elif op <= 4:  # apply_gradients with gradients of the output's shape (or not)
            shape = fdp.PickValueInList([(batch, dim), (nnz, dim), (batch, 3, dim), (batch, dim + 1)])
            grads = np.full(shape, fdp.PickValueInList([0.5, -1.0, float("nan")]), np.float32)
            gkw = {k: v for k, v in kw.items() if k != "out"}
            table.apply_gradients(args[0], args[1], grads, weights=args[2], **gkw)
        else:
            table.lookup_sparse_segment(args[0], args[1], combiner=combiner if isinstance(combiner, str) else "sum")
            if not _same(table, before):
                raise AssertionError("lookup_sparse_segment changed the table")
        STATS["ok"] += 1
    except _ACCEPTED:
        STATS["refused"] += 1
        if not _same(table, before):
            raise AssertionError("a call that raised changed the table")
    except MemoryError as e:
        if kw.get("max_sequence_length") != HUGE or "allocate" not in str(e):  # ours, or NumPy's
            raise
        STATS["memory"] += 1
        if not _same(table, before):
            raise AssertionError("a call that raised changed the table")


def _check_against_reference(table, got, oracle, combiner, length, out) -> None:
    """A lookup's result against tests/python/reference.py (float64, from the
    stored values): pooled bags, or the rows of a sequence (flat, or padded to
    `length` / a dense input's width). The ids must be in range (the engine
    accepted them), the shape equal, `out` (when given) the result, finite
    values within the float32 rounding bound, and NaN and infinities where
    the reference has them. Any failure, the reference's own included, is an
    AssertionError: a finding, not a refusal."""
    import numpy as np

    import reference

    ids, offsets, weights, width = oracle
    try:
        ids, offsets = np.asarray(ids, np.int64), np.asarray(offsets, np.int64)
        if ids.size and not (ids.min() >= 0 and ids.max() < table.rows):
            raise AssertionError(f"the lookup accepted ids outside [0, {table.rows}): {ids.min()}..{ids.max()}")
        if out is not None and got is not out:
            raise AssertionError("the lookup into out= returned another array")
        values = table.to_numpy(0, table.rows)  # the stored values, float32
        w = None if weights is None else np.asarray(weights, np.float64)
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):  # NaN / inf weights
            if combiner is not None:
                want, bound = reference.pooled(values, ids, offsets, w, "sum" if combiner is _DEFAULT else combiner)
            else:
                if length == 0 and width is None:
                    want = reference.sequence_flat(values, ids, w)
                else:
                    want = reference.sequence_padded(values, ids, offsets, w, length or width)
                bound = np.abs(want)
        if got.shape != want.shape:
            raise AssertionError(f"shape {got.shape}, the reference's {want.shape}")
        got = got.astype(np.float64)
        finite = np.isfinite(want) & np.isfinite(bound)
        err = np.abs(got[finite] - want[finite])
        if not np.all(err <= bound[finite] * 1e-5 + 1e-6):
            raise AssertionError(f"a difference of {err.max()} from the reference")
        special = ~np.isfinite(want)
        if not np.array_equal(got[special], want[special], equal_nan=True):
            raise AssertionError(f"NaN / infinities differ from the reference's: {got[special]} against "
                                 f"{want[special]}")
    except AssertionError:
        raise
    except Exception as e:  # noqa: BLE001 - the reference failed on what the engine accepted
        raise AssertionError(f"the reference check failed: {type(e).__name__}: {e}") from e


def _snapshot(table):
    import numpy as np

    return (np.array(table.values(), copy=True).tobytes(),
            {k: np.array(v, copy=True).tobytes() for k, v in table.slots().items()}, table.step)


def _same(table, snap) -> bool:
    return _snapshot(table) == snap


def main(argv) -> None:
    import atheris

    import embedcore  # noqa: F401

    atheris.instrument_all()  # the editable install's loader hides modules from instrument_imports()
    atheris.Setup(argv, check)
    atheris.Fuzz()


if __name__ == "__main__":
    main(sys.argv)
