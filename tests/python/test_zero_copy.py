"""Inputs are read in place: NumPy arrays and DLPack tensors (PyTorch) are
not copied when they are C-contiguous and of a supported dtype."""
import gc
import tracemalloc

import numpy as np
import pytest

import embedcore as ec
from embedcore._inputs import make_batch
from helpers import make_table, random_bags


@pytest.mark.parametrize("id_dtype", [np.int32, np.int64])
def test_numpy_ids_are_not_copied(rng, id_dtype):
    ids, offsets, w = random_bags(rng, 100, 20, id_dtype=id_dtype, weighted=True)
    b = make_batch(ids, offsets, w)
    assert np.shares_memory(b.ids, ids)
    assert np.shares_memory(b.offsets, offsets)
    assert np.shares_memory(b.weights, w)
    b = make_batch(ec.Ragged(ids, offsets), weights=ec.Ragged(w, offsets))
    assert np.shares_memory(b.ids, ids) and np.shares_memory(b.weights, w)
    dense = ids[: len(ids) // 2 * 2].reshape(-1, 2)
    b = make_batch(dense)
    assert np.shares_memory(b.ids, ids)
    b = make_batch(ids)
    assert np.shares_memory(b.ids, ids)


def test_read_only_inputs_are_accepted_in_place(rng):
    table = make_table(100, 4, optimizer=ec.optimizers.SGD(0.1))
    ids, offsets, w = random_bags(rng, 100, 20, weighted=True)
    expected = table.lookup(ids, offsets, w)
    for a in (ids, offsets, w):
        a.flags.writeable = False
    assert np.shares_memory(make_batch(ids, offsets, w).ids, ids)
    np.testing.assert_array_equal(table.lookup(ids, offsets, w), expected)
    g = np.ones((20, 4), np.float32)
    g.flags.writeable = False
    table.apply_gradients(ids, offsets, g, weights=w)
    assert table.step == 1


def test_non_contiguous_or_other_dtypes_are_converted(rng):
    ids, offsets, _ = random_bags(rng, 100, 20)
    strided = np.repeat(ids, 2)[::2]
    b = make_batch(strided, offsets)
    assert b.ids.flags.c_contiguous and not np.shares_memory(b.ids, strided)
    b = make_batch(ids.astype(np.int16), offsets)
    assert b.ids.dtype == np.int64


def test_big_ids_array_is_not_copied_during_lookup():
    """A 320 MB int64 ids array: NumPy allocations are traced, the engine's
    output is allocated in C++, so the traced peak during the lookup must be
    far below the size of the ids."""
    n = 40_000_000
    ids = np.zeros(n, np.int64)
    ids[::3] = 5
    ids[1::7] = 2
    offsets = np.linspace(0, n, 1001).astype(np.int64)
    weights = None
    table = make_table(8, 4, combiner="sum")
    table.assign((np.arange(32).reshape(8, 4) % 5 - 2).astype(np.float32))  # small integers: exact sums
    gc.collect()
    tracemalloc.start()
    try:
        # Control: tracemalloc sees NumPy's allocations.
        tracemalloc.reset_peak()
        copy = np.ascontiguousarray(ids[:1_000_000][::-1])
        _, control_peak = tracemalloc.get_traced_memory()
        del copy
        assert control_peak >= 8_000_000, control_peak
        tracemalloc.reset_peak()
        base, _ = tracemalloc.get_traced_memory()
        out = table.lookup(ids, offsets, weights)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak - base < ids.nbytes // 20, f"traced peak {peak - base} bytes during a lookup of {ids.nbytes} bytes"
    # And the result is right: every bag sums rows 0, 2 and 5 in known counts.
    t = table.to_numpy().astype(np.float64)
    b = 17
    lo, hi = offsets[b], offsets[b + 1]
    counts = np.bincount(ids[lo:hi], minlength=8)
    np.testing.assert_array_equal(out[b], counts @ t)
    assert out.shape == (1000, 4)


# ----------------------------------------------------------------- torch


def test_torch_tensors_are_read_in_place(rng):
    torch = pytest.importorskip("torch")
    ids_np, offsets_np, w_np = random_bags(rng, 100, 30, weighted=True)
    for dtype in (torch.int32, torch.int64):
        ids = torch.from_numpy(ids_np).to(dtype)
        offsets = torch.from_numpy(offsets_np)
        w = torch.from_numpy(w_np.copy())
        b = make_batch(ids, offsets, w)
        assert np.shares_memory(b.ids, ids.numpy())
        assert np.shares_memory(b.offsets, offsets.numpy())
        assert np.shares_memory(b.weights, w.numpy())
        b = make_batch(ec.Ragged(ids, offsets), weights=ec.Ragged(w, offsets))
        assert np.shares_memory(b.ids, ids.numpy())
        b = make_batch(ids, offsets, w.requires_grad_(True))  # (read detached, in place)
        assert np.shares_memory(b.weights, w.detach().numpy())
        w.requires_grad_(False)
        p = torch.nn.Parameter(w.clone())  # a Parameter (a Tensor subclass) too (was: "requires grad" TypeError)
        b = make_batch(ids, offsets, p)
        assert np.shares_memory(b.weights, p.detach().numpy())
    # A lazily negated view is read with its sign (DLPack and numpy() ignore the negative bit: was +2, +4).
    neg = torch.tensor([1 + 2j, 3 + 4j]).conj().imag
    assert neg.is_neg()
    b = make_batch(np.array([1, 2]), np.array([0, 2]), neg)
    np.testing.assert_array_equal(b.weights, [-2.0, -4.0])


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn", None])
def test_torch_results_equal_numpy(rng, combiner):
    torch = pytest.importorskip("torch")
    ids, offsets, w = random_bags(rng, 100, 30, weighted=True)
    a = make_table(100, 6, optimizer=ec.optimizers.Adagrad(0.1))
    b = make_table(100, 6, optimizer=ec.optimizers.Adagrad(0.1))
    out_np = a.lookup(ids, offsets, w, combiner=combiner)
    out_t = b.lookup(torch.from_numpy(ids), torch.from_numpy(offsets), torch.from_numpy(w), combiner=combiner)
    assert isinstance(out_t, np.ndarray)
    np.testing.assert_array_equal(out_t, out_np)
    g = rng.normal(size=out_np.shape).astype(np.float32)
    a.apply_gradients(ids, offsets, g, weights=w, combiner=combiner)
    b.apply_gradients(torch.from_numpy(ids), torch.from_numpy(offsets), torch.from_numpy(g),
                      weights=torch.from_numpy(w), combiner=combiner)
    np.testing.assert_array_equal(a.values(), b.values())
    np.testing.assert_array_equal(a.slots()["accumulators"], b.slots()["accumulators"])
    # Dense 2-D tensors and non-contiguous tensors too.
    dense = torch.from_numpy(ids[:20].reshape(10, 2))
    np.testing.assert_array_equal(a.lookup(dense), a.lookup(ids[:20].reshape(10, 2)))
    strided = torch.from_numpy(np.repeat(ids, 2))[::2]
    assert not strided.is_contiguous()
    np.testing.assert_array_equal(a.lookup(strided, torch.from_numpy(offsets)), a.lookup(ids, offsets))


def test_torch_float_ids_are_rejected():
    torch = pytest.importorskip("torch")
    table = make_table(10, 2)
    with pytest.raises(TypeError):
        table.lookup(torch.tensor([1.0, 2.0]))


def test_values_and_slots_views_outlive_the_table():
    table = make_table(50_000, 4, optimizer=ec.optimizers.Adagrad(0.1, initial_accumulator_value=0.25),
                       initializer=ec.initializers.Constant(2.0))
    v, s = table.values(), table.slots()["accumulators"]
    del table
    gc.collect()
    junk = [np.ones(200_000) for _ in range(20)]  # reuse freed memory, if it was freed
    assert np.all(v == 2.0) and np.all(s == 0.25)
    del junk


def test_lookup_results_own_their_memory(rng):
    table = make_table(100, 4)
    ids, offsets, _ = random_bags(rng, 100, 10)
    out = table.lookup(ids, offsets)
    assert out.flags.writeable and out.flags.c_contiguous
    out[:] = 0  # the caller may write to it; the table is unaffected
    assert not np.all(table.lookup(ids, offsets) == 0)


def test_a_lookup_output_in_the_table_s_own_memory_is_refused():
    """A lookup's `out` inside the table it reads (the torch adapter's weight
    is a writable view of it) would overwrite rows while other bags read
    them: results that depended on the thread count. Refused; nothing changes."""
    t = ec.Table(name="t", rows=100, dim=4, optimizer=ec.optimizers.Adagrad(0.1),
                 initializer=ec.initializers.Uniform(-1, 1, seed=1))
    before = t.values().copy()
    values = t._native.values_mut()
    slot = dict(t._native.slots_mut())["accumulators"]
    ids, offsets = np.arange(20) % 100, np.arange(0, 21, 2)
    with pytest.raises(ValueError, match="out overlaps the values of table 't' that the lookup reads: pass a "
                                         "separate output array"):
        t.lookup(ids, offsets, out=values[10:20])
    with pytest.raises(ValueError, match="out overlaps a slot of table 't': pass a separate output array"):
        t.lookup(ids, offsets, out=slot[:10])
    np.testing.assert_array_equal(t.values(), before)
    assert t.lookup(ids, offsets, out=np.empty((10, 4), np.float32)).shape == (10, 4)


def test_tensors_inside_a_torch_func_transform_are_refused():
    """A tensor inside torch.func.functionalize (or vmap) has no memory of
    its values: refused, naming the argument (functionalize's were read as
    garbage: ids and offsets of another tensor's memory)."""
    torch = pytest.importorskip("torch")
    t = make_table(10, 2)

    def f(ids, offsets):
        return torch.from_numpy(t.lookup(ids, offsets))

    ids, offsets = torch.tensor([1, 2, 3]), torch.tensor([0, 3])
    for transform in (torch.func.functionalize, lambda g: torch.vmap(g, in_dims=(0, None))):
        with pytest.raises(TypeError, match="ids: a tensor inside a torch.func transform"):
            transform(f)(ids if transform is torch.func.functionalize else ids.reshape(1, 3), offsets)
