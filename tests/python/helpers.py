"""Shared helpers of the Python tests: random batches, state snapshots and
comparisons against the reference (tests/python/reference.py)."""
from __future__ import annotations

import numpy as np

import embedcore as ec

DTYPES = ("float32", "float16", "bfloat16")
COMBINERS = ("sum", "mean", "sqrtn")


def make_table(rows=64, dim=8, dtype="float32", optimizer=None, initializer=None, combiner="mean", name="t",
               seed=0):
    if initializer is None:
        initializer = ec.initializers.Uniform(-1.0, 1.0, seed=seed)
    return ec.Table(name=name, rows=rows, dim=dim, dtype=dtype, initializer=initializer, optimizer=optimizer,
                    combiner=combiner)


def random_bags(rng, rows, batch, max_len=6, id_dtype=np.int64, empty_every=4, weighted=False):
    """CSR bags with empty bags, bags of one and repeated ids.
    Returns (ids, offsets, weights or None)."""
    lengths = rng.integers(1, max_len + 1, size=batch)
    if batch:
        lengths[:: max(empty_every, 1)] = 0  # some empty bags
        lengths[1::5] = 1  # some bags of one
    offsets = np.zeros(batch + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    nnz = int(offsets[-1])
    # Draw from a small pool of ids so that repeats (within and across bags) are common.
    pool = rng.choice(rows, size=min(rows, max(1, nnz // 2 + 1)), replace=False)
    ids = pool[rng.integers(0, len(pool), size=nnz)].astype(id_dtype)
    weights = rng.uniform(0.25, 2.0, size=nnz).astype(np.float32) if weighted else None
    return ids, offsets, weights


def assert_pooled(actual, expected, bound, rtol):
    """|actual - expected| <= rtol * bound elementwise, where bound >= |expected|
    is sum |w| |row| / |denominator| (the scale of float32 rounding)."""
    actual = np.asarray(actual)
    assert actual.dtype == np.float32
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    err = np.abs(actual.astype(np.float64) - expected)
    tol = rtol * bound + 1e-30
    bad = err > tol
    if bad.any():
        i = tuple(np.argwhere(bad)[0])
        raise AssertionError(f"{bad.sum()} of {bad.size} elements differ; first at {i}: "
                             f"actual {actual[i]!r}, expected {expected[i]!r}, tol {tol[i]!r}")


def assert_close(actual, expected, rtol=1e-5, atol=1e-6, what=""):
    np.testing.assert_allclose(np.asarray(actual, dtype=np.float64), expected, rtol=rtol, atol=atol,
                               err_msg=what)


def snapshot(table: ec.Table):
    """Everything an update may change, as exact copies."""
    return {
        "values": np.array(table.values(), copy=True),
        "slots": {k: np.array(v, copy=True) for k, v in table.slots().items()},
        "step": table.step,
    }


def assert_unchanged(table: ec.Table, snap) -> None:
    now = snapshot(table)
    assert now["step"] == snap["step"], f"table '{table.name}': step changed"
    assert now["values"].tobytes() == snap["values"].tobytes(), f"table '{table.name}': values changed"
    assert now["slots"].keys() == snap["slots"].keys()
    for k in snap["slots"]:
        assert now["slots"][k].tobytes() == snap["slots"][k].tobytes(), f"table '{table.name}': slot {k} changed"


def state_bytes(table: ec.Table) -> bytes:
    s = snapshot(table)
    return s["values"].tobytes() + b"".join(s["slots"][k].tobytes() for k in sorted(s["slots"])) + \
        str(s["step"]).encode()


def cuda_skip_reason():
    """Why the CUDA cases cannot run here (None when they can): they need
    embedcore's CUDA build, a GPU, and a CUDA build of PyTorch."""
    info = ec.build_info()
    if not info["cuda"]:
        return "needs the CUDA build of embedcore (EMBEDCORE_CUDA=ON); this one is CPU-only"
    if info["cuda_devices"] < 1:
        return "needs a CUDA GPU; this machine has none"
    try:
        import torch
    except ImportError:
        return "needs PyTorch for CUDA tensors"
    if not torch.cuda.is_available():
        return "needs a CUDA build of PyTorch that sees the GPU"
    return None
