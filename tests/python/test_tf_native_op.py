"""The TensorFlow adapter's kernels (adapters/tf/native/sparse_lookup_op.cc):
inside tf.function, an unweighted rank-2 tf.SparseTensor lookup runs as the
op EmbedcoreSparseLookup, and a pooled unweighted tf.RaggedTensor one as
EmbedcoreRaggedLookup, with no Python callback. Checked: the graph holds
the op; its outputs equal TensorFlow's (sum bit for bit) and the eager path's
bit for bit; inputs that need the general path (pruned ids, unordered or
out-of-shape indices, bad ids, an unknown rank) give what they gave before,
errors included; a handle whose table is gone fails cleanly; many threads at
once; the build's modes (off / required / auto without a compiler) and its
cache. CI has a C++ compiler, so the kernel must build here: these tests
require it (EMBEDCORE_TF_OP=required)."""
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

from tf_helpers import E, assert_same, pair, random_sparse, tf

from embedcore import _embedcore
from embedcore.adapters.tf import _native

COMBINERS = ("sum", "mean", "sqrtn")
ROWS, DIM = 60, 16
OP = "EmbedcoreSparseLookup"


@pytest.fixture(autouse=True)
def required(monkeypatch):
    monkeypatch.setenv("EMBEDCORE_TF_OP", "required")


def _config(combiner):
    table = E.TableConfig(vocabulary_size=ROWS, dim=DIM, combiner=combiner, name="t")
    return {"f": E.FeatureConfig(table)}


def _traced(layer):
    @tf.function
    def f(x):
        return layer({"f": x})["f"]
    return f


def _ops(fn, x):
    return [op.type for op in fn.get_concrete_function(x).graph.get_operations()]


def _sparse(indices, ids, shape, id_dtype=tf.int64):
    return tf.SparseTensor(tf.constant(np.asarray(indices, np.int64).reshape(-1, 2)),
                           tf.constant(np.asarray(ids), id_dtype), shape)


@pytest.mark.parametrize("combiner", COMBINERS)
@pytest.mark.parametrize("id_dtype", [tf.int32, tf.int64])
def test_the_graph_runs_the_kernel_and_equals_tensorflow(rng, combiner, id_dtype):
    theirs, ours = pair(_config(combiner), rng)
    # Bags of 0..40 ids (TensorFlow's groups of 8, the < 10 rule of mean / sqrtn), trailing empty bags.
    sp, _ = random_sparse(rng, [30], 48, ROWS, 40)
    sp = tf.SparseTensor(sp.indices, tf.cast(sp.values, id_dtype), [34, 48])
    f = _traced(ours)
    assert OP in _ops(f, sp) and "EagerPyFunc" not in _ops(f, sp)
    graph = f(sp)
    assert graph.shape == (34, DIM)
    np.testing.assert_array_equal(graph.numpy(), theirs({"f": sp})["f"].numpy())  # every combiner, bit for bit
    np.testing.assert_array_equal(graph.numpy(), ours({"f": sp})["f"].numpy())  # the eager (NumPy) path


@pytest.mark.parametrize("case", ["negative_id", "unordered", "row_outside", "empty"])
def test_inputs_for_the_general_path_give_what_they_gave(rng, case):
    theirs, ours = pair(_config("mean"), rng)
    indices, ids, shape = [[0, 0], [0, 1], [2, 0], [2, 3], [3, 1]], [5, 7, 9, 11, 13], [4, 5]
    if case == "negative_id":  # pruned by the safe path
        ids[1] = -1
    elif case == "unordered":  # sparse_fill_empty_rows groups by row, stably
        indices = [indices[2], indices[0], indices[4], indices[1], indices[3]]
    elif case == "row_outside":
        indices[4] = [7, 0]
    else:
        indices, ids = np.zeros((0, 2), np.int64), np.zeros(0, np.int64)
    sp = _sparse(indices, ids, shape)
    f = _traced(ours)
    assert OP in _ops(f, sp)
    if case == "row_outside":
        with pytest.raises(tf.errors.InvalidArgumentError, match=r"indices\(4, 0\) is invalid: 7 >= 4"):
            f(sp)
        with pytest.raises(tf.errors.InvalidArgumentError, match=r"indices\(4, 0\) is invalid: 7 >= 4"):
            ours({"f": sp})
        return
    got = f(sp)
    assert_same(theirs({"f": sp})["f"], got, "mean")
    np.testing.assert_array_equal(got.numpy(), ours({"f": sp})["f"].numpy())


def test_a_bad_id_raises_the_eager_paths_error(rng):
    _, ours = pair(_config("sum"), rng)
    sp = _sparse([[0, 0], [1, 0], [1, 1]], [3, ROWS, 4], [2, 2])
    f = _traced(ours)
    with pytest.raises(tf.errors.InvalidArgumentError) as graph_error:
        f(sp)
    with pytest.raises(tf.errors.InvalidArgumentError) as eager_error:
        ours({"f": sp})
    assert f"indices[1] = {ROWS} is not in [0, {ROWS})" in eager_error.value.message
    assert eager_error.value.message in graph_error.value.message  # with the callback's traceback, as before


def test_weighted_sequence_and_unknown_rank_input_keep_the_python_path(rng):
    _, ours = pair(_config("sum"), rng)
    sp, w = random_sparse(rng, [5], 8, ROWS, 6)
    table = E.TableConfig(vocabulary_size=ROWS, dim=DIM, combiner="sum", name="t")
    _, seq = pair({"f": E.FeatureConfig(table, max_sequence_length=3)}, rng)
    assert OP not in _ops(_traced(seq), sp)

    @tf.function
    def weighted(x, wt):
        return ours({"f": x}, {"f": wt})["f"]

    assert OP not in [op.type for op in weighted.get_concrete_function(sp, w).graph.get_operations()]
    spec = tf.SparseTensorSpec(shape=None, dtype=tf.int64)
    unknown = tf.function(lambda x: ours({"f": x})["f"], input_signature=[spec])
    assert OP not in [op.type for op in unknown.get_concrete_function().graph.get_operations()]
    np.testing.assert_array_equal(unknown(sp).numpy(), _traced(ours)(sp).numpy())


RAGGED_OP = "EmbedcoreRaggedLookup"


@pytest.mark.parametrize("combiner", COMBINERS)
@pytest.mark.parametrize("id_dtype", [tf.int32, tf.int64])
@pytest.mark.parametrize("splits_dtype", [tf.int32, tf.int64])
def test_ragged_input_runs_its_kernel_and_equals_tensorflow(rng, combiner, id_dtype, splits_dtype):
    theirs, ours = pair(_config(combiner), rng)
    lengths = rng.permutation(np.concatenate([np.arange(41), [0, 0]]))
    ids = rng.integers(0, ROWS, int(lengths.sum()))
    splits = np.concatenate([[0], np.cumsum(lengths)])
    rt = tf.RaggedTensor.from_row_splits(tf.constant(ids, id_dtype), tf.constant(splits, splits_dtype))
    f = _traced(ours)
    ops = _ops(f, rt)
    assert RAGGED_OP in ops and "EagerPyFunc" not in ops
    graph = f(rt)
    assert graph.shape == (len(lengths), DIM)
    assert_same(theirs({"f": rt})["f"], graph, combiner)
    np.testing.assert_array_equal(graph.numpy(), ours({"f": rt})["f"].numpy())


def test_ragged_inputs_for_the_general_path_give_what_they_gave(rng):
    _, ours = pair(_config("sum"), rng)
    f = _traced(ours)
    bad_id = tf.RaggedTensor.from_row_splits(tf.constant([1, ROWS, 2], tf.int64), tf.constant([0, 1, 3], tf.int64))
    with pytest.raises(tf.errors.InvalidArgumentError) as graph_error:
        f(bad_id)
    with pytest.raises(tf.errors.InvalidArgumentError) as eager_error:
        ours({"f": bad_id})
    assert f"= {ROWS} is not in [0, {ROWS})" in eager_error.value.message
    assert eager_error.value.message in graph_error.value.message
    # Weighted bags, sequences and output_shape keep the Python path.
    rt = tf.RaggedTensor.from_row_lengths(tf.constant([1, 2, 3, 4], tf.int64), [1, 3])
    w = tf.RaggedTensor.from_row_lengths(tf.constant([0.5, 1.0, 2.0, 1.0]), [1, 3])
    weighted = tf.function(lambda x, wt: ours({"f": x}, {"f": wt})["f"])
    assert RAGGED_OP not in [op.type for op in weighted.get_concrete_function(rt, w).graph.get_operations()]
    table = E.TableConfig(vocabulary_size=ROWS, dim=DIM, combiner="sum", name="t")
    _, seq = pair({"f": E.FeatureConfig(table, max_sequence_length=3)}, rng)
    assert RAGGED_OP not in _ops(_traced(seq), rt)


def test_a_handle_whose_table_is_gone_fails_cleanly(rng):
    _, ours = pair(_config("sum"), rng)
    sp, _ = random_sparse(rng, [4], 8, ROWS, 6)
    f = _traced(ours)
    f(sp)
    table = next(iter(ours._tables.values()))
    handle = _native.handle_of(table)
    assert _embedcore.unregister_native_table(handle)
    with pytest.raises(tf.errors.FailedPreconditionError, match=f"table handle {handle} is not registered"):
        f(sp)
    assert not _embedcore.unregister_native_table(handle)
    # Registered again (the tests' own doing; a live table keeps its handle), the graph works.
    _native._handles.pop(table)
    fresh = _traced(ours)
    np.testing.assert_array_equal(fresh(sp).numpy(), ours({"f": sp})["f"].numpy())


def test_a_collected_table_is_unregistered():
    import gc

    import embedcore as ec

    table = ec.Table(name="gone", rows=10, dim=4)
    handle = _native.handle_of(table)
    assert _native.handle_of(table) == handle  # one handle per table
    del table
    gc.collect()
    assert not _embedcore.unregister_native_table(handle)  # already unregistered


def test_many_threads_at_once(rng):
    theirs, ours = pair(_config("sqrtn"), rng)
    inputs = [random_sparse(rng, [20], 16, ROWS, 12)[0] for _ in range(6)]
    f = _traced(ours)
    want = [f(x).numpy() for x in inputs]
    errors, results = [], {}

    def worker(t):
        try:
            for k in range(30):
                i = (t + k) % len(inputs)
                results[(t, k)] = (i, f(inputs[i]).numpy())
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i, got in results.values():
        np.testing.assert_array_equal(got, want[i])


def test_a_stateful_op_sees_table_updates(rng):
    _, ours = pair(_config("sum"), rng)
    sp = _sparse([[0, 0], [1, 0]], [3, 4], [2, 1])
    f = _traced(ours)
    before = f(sp).numpy()
    var = next(iter(ours.embedding_tables.values()))
    var.assign(np.full((ROWS, DIM), 2.0, np.float32))
    np.testing.assert_array_equal(f(sp).numpy(), np.full((2, DIM), 2.0, np.float32))
    assert not np.array_equal(before, f(sp).numpy())


BUILD = r"""
import os, sys
import numpy as np
import tensorflow as tf
from embedcore.adapters.tf import EmbeddingForServing, NativeOpError
E = tf.tpu.experimental.embedding
table = E.TableConfig(vocabulary_size=10, dim=4, combiner="sum", name="t")
layer = EmbeddingForServing({"f": E.FeatureConfig(table)})
layer.build()
x = tf.SparseTensor([[0, 0], [1, 0]], tf.constant([3, 4], tf.int64), [2, 1])


@tf.function  # converted by AutoGraph (a function in a file): errors and warnings pass through it
def f(x):
    return layer({"f": x})["f"]


try:
    out = f(x)
except NativeOpError as e:
    print("ERROR", e)
    sys.exit(0)
ops = [op.type for op in f.get_concrete_function(x).graph.get_operations()]
print("OP" if "EmbedcoreSparseLookup" in ops else "NO-OP", out.shape)
"""


def _run(env_changes, cache):
    """Runs BUILD from a file (AutoGraph converts only functions whose source it can read)."""
    script = cache.parent / "build_check.py"
    script.write_text(BUILD)
    env = dict(os.environ, EMBEDCORE_CACHE_DIR=str(cache), TF_CPP_MIN_LOG_LEVEL="2", **env_changes)
    res = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "AutoGraph could not transform" not in res.stderr, res.stderr  # it does not try the adapter's code
    return res.stdout, res.stderr


def test_build_modes_and_cache(tmp_path):
    cache = tmp_path / "cache"
    out, _ = _run({"EMBEDCORE_TF_OP": "off"}, cache)
    assert out.splitlines()[-1] == "NO-OP (2, 4)" and not cache.exists()
    out, err = _run({"EMBEDCORE_TF_OP": "auto", "CXX": "/nonexistent/c++"}, cache)
    assert out.splitlines()[-1] == "NO-OP (2, 4)" and "TensorFlow kernels unavailable" in err and "/nonexistent/c++" in err
    out, _ = _run({"EMBEDCORE_TF_OP": "required", "CXX": "/nonexistent/c++"}, cache)
    assert out.startswith("ERROR") and "EMBEDCORE_TF_OP=required: no C++ compiler '/nonexistent/c++'" in out
    out, _ = _run({"EMBEDCORE_TF_OP": "auto"}, cache)
    assert out.splitlines()[-1] == "OP (2, 4)"
    built = sorted(cache.iterdir())
    assert len(built) == 1 and built[0].name.startswith("tf_sparse_lookup_op-") and built[0].suffix == ".so"
    stamp = built[0].stat().st_mtime_ns
    out, _ = _run({}, cache)  # the default is auto; the cached library is loaded, not rebuilt
    assert out.splitlines()[-1] == "OP (2, 4)"
    assert sorted(cache.iterdir()) == built and built[0].stat().st_mtime_ns == stamp
    built[0].write_bytes(b"not a library")  # damaged: built again, once
    out, _ = _run({"EMBEDCORE_TF_OP": "required"}, cache)
    assert out.splitlines()[-1] == "OP (2, 4)" and sorted(cache.iterdir()) == built
    assert built[0].stat().st_size > 1000


def test_a_bad_mode_is_refused(monkeypatch):
    for bad in ("sometimes", "1", "on"):
        monkeypatch.setenv("EMBEDCORE_TF_OP", bad)
        with pytest.raises(ValueError, match=f"EMBEDCORE_TF_OP must be auto, off or required, got '{bad}'"):
            _native.sparse_lookup_op()
