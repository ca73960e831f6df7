"""The engine's C entry points for framework kernels (bindings/native.cc),
called here through ctypes as the TensorFlow adapter's kernels call them,
without TensorFlow: the table registry (handles, unregistering), each
status (a result, "take the general path" having written nothing, an error
with its message), and results equal to the Python API's."""
import ctypes
import subprocess
import sys

import numpy as np
import pytest

import embedcore as ec
from embedcore import _embedcore

OK, GENERAL, OOM, FAILED = 0, 1, 2, 3
I64, PTR, INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
SPARSE = ctypes.CFUNCTYPE(INT, I64, PTR, I64, PTR, INT, I64, INT, PTR, I64, PTR, I64)
RAGGED = ctypes.CFUNCTYPE(INT, I64, PTR, INT, I64, PTR, I64, INT, PTR, I64, PTR, I64)


@pytest.fixture
def entries():
    e = _embedcore.native_entry_points()
    assert e["version"] == 2
    return SPARSE(e["sparse_segment_lookup"]), RAGGED(e["ragged_lookup"])


@pytest.fixture
def table():
    t = ec.Table(name="t", rows=50, dim=8, initializer=ec.initializers.Uniform(-1.0, 1.0, seed=3))
    handle = _embedcore.register_native_table(t._native, t._native)
    yield t, handle
    _embedcore.unregister_native_table(handle)


def _sparse(fn, handle, indices, ids, bags, combiner=0, dim=8):
    indices = np.ascontiguousarray(indices, np.int64).reshape(-1, 2)
    ids = np.ascontiguousarray(ids)
    out = np.full((bags, dim), 7.0, np.float32)
    err = ctypes.create_string_buffer(512)
    status = fn(handle, indices.ctypes.data, len(ids), ids.ctypes.data, int(ids.dtype == np.int32), bags, combiner,
                out.ctypes.data, dim, ctypes.addressof(err), 512)
    return status, out, err.value.decode()


def _ragged(fn, handle, ids, splits, combiner=0, dim=8):
    ids, splits = np.ascontiguousarray(ids), np.ascontiguousarray(splits, np.int64)
    out = np.full((len(splits) - 1, dim), 7.0, np.float32)
    err = ctypes.create_string_buffer(512)
    status = fn(handle, ids.ctypes.data, int(ids.dtype == np.int32), len(ids), splits.ctypes.data, len(splits) - 1,
                combiner, out.ctypes.data, dim, ctypes.addressof(err), 512)
    return status, out, err.value.decode()


@pytest.mark.parametrize("combiner", [0, 1, 2])
@pytest.mark.parametrize("id_dtype", [np.int32, np.int64])
def test_results_equal_the_python_api(entries, table, rng, combiner, id_dtype):
    sparse, ragged = entries
    t, handle = table
    lengths = rng.permutation(np.arange(25))
    splits = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    ids = rng.integers(0, 50, int(splits[-1])).astype(id_dtype)
    indices = np.stack([np.repeat(np.arange(25), lengths), np.concatenate([np.arange(n) for n in lengths])], 1)
    name = ["sum", "mean", "sqrtn"][combiner]
    status, out, _ = _sparse(sparse, handle, indices, ids, 27, combiner)  # two trailing empty bags
    assert status == OK
    np.testing.assert_array_equal(out[:25], t.lookup_sparse_segment(ids, splits, name))
    assert not out[25:].any()
    status, out, _ = _ragged(ragged, handle, ids, splits, combiner)
    assert status == OK
    np.testing.assert_array_equal(out, t.lookup(ids, splits, combiner=name))


@pytest.mark.parametrize("case", ["negative_id", "id_past_the_table", "unordered", "row_outside"])
def test_the_general_path_is_taken_before_anything_is_written(entries, table, case):
    sparse, ragged = entries
    _, handle = table
    indices, ids = [[0, 0], [0, 1], [1, 0]], np.array([3, 4, 5], np.int64)
    if case == "negative_id":
        ids[1] = -1
    elif case == "id_past_the_table":
        ids[2] = 50
    elif case == "unordered":
        indices = [[1, 0], [0, 0], [0, 1]]
    else:
        indices[2] = [2, 0]
    status, out, _ = _sparse(sparse, handle, indices, ids, 2)
    assert status == GENERAL and (out == 7.0).all()
    if case in ("negative_id", "id_past_the_table"):
        status, out, _ = _ragged(ragged, handle, ids, [0, 2, 3])
        assert status == GENERAL and (out == 7.0).all()


def test_splits_that_do_not_partition_the_ids_take_the_general_path(entries, table):
    _, ragged = entries
    _, handle = table
    for splits in ([0, 3, 2], [1, 2, 3], [0, 1, 4]):
        status, out, _ = _ragged(ragged, handle, np.array([1, 2, 3], np.int64), splits)
        assert status == GENERAL and (out == 7.0).all(), splits


def test_an_unregistered_handle_and_a_wrong_call_are_errors(entries, table):
    sparse, ragged = entries
    t, handle = table
    status, _, err = _sparse(sparse, handle + 1000, [[0, 0]], np.array([1]), 1)
    assert status == FAILED and f"table handle {handle + 1000} is not registered in this process" in err
    status, _, err = _ragged(ragged, handle, np.array([1]), [0, 1], dim=4)
    assert status == FAILED and "bad call for table 't'" in err
    status, _, err = _sparse(sparse, handle, [[0, 0]], np.array([1]), 1, combiner=3)
    assert status == FAILED and "bad call" in err
    # A caller's null pointer is an error, not the general path.
    err = ctypes.create_string_buffer(512)
    ids, splits, idx = np.array([1, 2], np.int64), np.array([0, 2], np.int64), np.zeros((2, 2), np.int64)
    assert ragged(handle, ids.ctypes.data, 0, 2, splits.ctypes.data, 1, 0, None, 8, ctypes.addressof(err), 512) \
        == FAILED and "bad call" in err.value.decode()
    assert ragged(handle, ids.ctypes.data, 0, 2, None, 1, 0, None, 8, ctypes.addressof(err), 512) == FAILED
    assert sparse(handle, None, 2, ids.ctypes.data, 0, 1, 0, None, 8, ctypes.addressof(err), 512) == FAILED
    assert sparse(handle, idx.ctypes.data, 2, None, 0, 1, 0, None, 8, ctypes.addressof(err), 512) == FAILED
    assert _embedcore.unregister_native_table(handle)
    status, _, err = _ragged(ragged, handle, np.array([1]), [0, 1])
    assert status == FAILED and "not registered" in err
    assert not _embedcore.unregister_native_table(handle)


def test_registration(table):
    t, handle = table
    other = _embedcore.register_native_table(t._native, t._native)
    assert other != handle  # a handle per registration
    assert _embedcore.unregister_native_table(other)
    with pytest.raises(TypeError):
        _embedcore.register_native_table(np.zeros(3), t._native)  # not an engine table


def test_handles_differ_from_process_to_process():
    # A graph traced in one process and run in another (a SavedModel holding the adapter's kernel) must name
    # no table there, rather than the table registered under the same number: handles start at random.
    code = ("import embedcore as ec; from embedcore import _embedcore; t = ec.Table(name='t', rows=2, dim=2); "
            "print(_embedcore.register_native_table(t._native, t._native))")
    handles = {int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                  timeout=120).stdout) for _ in range(3)}
    assert len(handles) == 3 and all(h > 1000 for h in handles), handles
