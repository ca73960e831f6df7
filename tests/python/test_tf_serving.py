"""embedcore.adapters.tf.EmbeddingForServing against TensorFlow's own
TPUEmbeddingForServing, on the same configs, tables and inputs: every input
form and combiner (sum bit for bit, mean and sqrtn within 1e-6), eagerly and
inside tf.function, and the same exception types for bad inputs."""
import re
import subprocess
import sys

import numpy as np
import pytest

from tf_helpers import E, assert_same, pair, random_ragged, random_sparse, tf

from embedcore.adapters.tf import EmbeddingForServing

COMBINERS = ("sum", "mean", "sqrtn")
ROWS, DIM = 60, 16


def _config(combiner, **feature_kwargs):
    table = E.TableConfig(vocabulary_size=ROWS, dim=DIM, combiner=combiner, name="t")
    return {"f": E.FeatureConfig(table, **feature_kwargs)}, table


def _both(theirs, ours, features, weights=None):
    """Outputs of TensorFlow and the adapter: eagerly, and inside tf.function
    (the adapter's graph output must equal its eager output)."""
    expected = theirs(features, weights)
    actual = ours(features, weights)

    @tf.function
    def traced(f, w):
        return ours(f, w)

    graph = traced(features, weights)
    for a, g in zip(tf.nest.flatten(actual), tf.nest.flatten(graph)):
        assert np.array_equal(np.asarray(a), np.asarray(g)), "the tf.function output differs from the eager one"
    return expected, actual


@pytest.mark.parametrize("combiner", COMBINERS)
@pytest.mark.parametrize("validate", [True, False])
@pytest.mark.parametrize("weighted", [False, True])
def test_sparse_rank2(rng, combiner, validate, weighted):
    # Bags of 0..40 ids cover TensorFlow's summation groups (8-id groups unweighted, 4 accumulators weighted);
    # negative ids and weights <= 0 exercise the safe path's pruning; the fast path drops trailing empty bags.
    config, _ = _config(combiner, validate_weights_and_indices=validate)
    theirs, ours = pair(config, rng)
    sp, w = random_sparse(rng, [14], 48, ROWS, 40, neg=validate)
    if not validate:  # and a batch whose last bags are empty
        keep = sp.indices[:, 0] < 10
        sp, w = tf.sparse.retain(sp, keep), tf.sparse.retain(w, keep)
    weights = {"f": w} if weighted else None
    expected, actual = _both(theirs, ours, {"f": sp}, weights)
    assert_same(expected, actual, combiner)
    if not validate:
        assert actual["f"].shape[0] <= 10


@pytest.mark.parametrize("combiner", COMBINERS)
def test_sparse_higher_rank_and_unsorted(rng, combiner):
    config, _ = _config(combiner)
    theirs, ours = pair(config, rng)
    for lead, unsorted in (([5, 3], False), ([2, 3, 2], False), ([9], True)):
        sp, w = random_sparse(rng, lead, 24, ROWS, 20, neg=True, unsorted=unsorted)
        expected, actual = _both(theirs, ours, {"f": sp}, {"f": w})
        assert_same(expected, actual, combiner)
        expected, actual = _both(theirs, ours, {"f": sp})
        assert_same(expected, actual, combiner)


@pytest.mark.parametrize("combiner", COMBINERS)
@pytest.mark.parametrize("weighted", [False, True])
def test_ragged(rng, combiner, weighted):
    config, _ = _config(combiner)
    theirs, ours = pair(config, rng)
    rt, rw = random_ragged(rng, [0, 1, 30, 9, 10, 17, 0, 33, 2, 5], ROWS)
    expected, actual = _both(theirs, ours, {"f": rt}, {"f": rw} if weighted else None)
    assert_same(expected, actual, combiner)


@pytest.mark.parametrize("combiner", ["mean", "sqrtn"])
def test_weighted_bags_far_longer_than_the_others(rng, combiner):
    """A weighted mean / sqrtn bag of thousands of ids among short ones
    (one heavy user in a batch): the weights' totals took one Python step
    per position of the longest bag (a bag of 20,000 made a 4,096-bag
    batch 10x slower than TensorFlow). Equal to TensorFlow, and the totals
    equal to adding the weights one by one in float32."""
    from embedcore.adapters.tf import _pooling

    config, _ = _config(combiner)
    theirs, ours = pair(config, rng)
    rt, rw = random_ragged(rng, [3, 0, 5000, 1, 64, 65, 0, 200, 2], ROWS)
    expected, actual = _both(theirs, ours, {"f": rt}, {"f": rw})
    assert_same(expected, actual, combiner)

    lengths = np.array([0, 1, 64, 65, 3000, 7, 0, 129, 2], np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    x = (rng.standard_normal(int(lengths.sum())) * 10.0 ** rng.uniform(-4, 4, int(lengths.sum()))).astype(np.float32)
    want = np.zeros(len(lengths), np.float32)
    for b, (s, n) in enumerate(zip(starts, lengths)):
        for v in x[s:s + n]:
            want[b] = np.float32(want[b] + v)
    got = _pooling._sequential_totals(x, starts, lengths, int(lengths.max()))
    assert got.tobytes() == want.tobytes()


def test_dense_any_rank(rng):
    config, _ = _config("mean")
    theirs, ours = pair(config, rng)
    for shape in ((7,), (4, 5), (2, 3, 4)):
        for dtype in (np.int32, np.int64):
            ids = tf.constant(rng.integers(0, ROWS, shape).astype(dtype))
            expected, actual = _both(theirs, ours, {"f": ids})
            assert actual["f"].shape == tuple(shape) + (DIM,)
            assert_same(expected, actual, "sum")


def test_sequence_features(rng):
    config, _ = _config("mean", max_sequence_length=4)
    theirs, ours = pair(config, rng)
    # Sparse: each id at its position, positions >= 4 truncated, duplicate positions added up.
    sp, _ = random_sparse(rng, [6], 7, ROWS, 6)
    dup = tf.sparse.reorder(tf.SparseTensor(tf.concat([sp.indices, sp.indices[:4]], 0),
                                            tf.concat([sp.values, sp.values[:4]], 0), sp.dense_shape))
    expected, actual = _both(theirs, ours, {"f": dup})
    assert actual["f"].shape == (6, 4, DIM)
    assert_same(expected, actual, "sum")
    # Ragged: packed, truncated or zero-padded.
    rt, _ = random_ragged(rng, [0, 1, 4, 9, 3], ROWS)
    expected, actual = _both(theirs, ours, {"f": rt})
    assert actual["f"].shape == (5, 4, DIM)
    assert_same(expected, actual, "sum")


@pytest.mark.parametrize("combiner", ["sum", "sqrtn"])
def test_ragged_output_shape(rng, combiner):
    # TensorFlow 2.21 supports output_shape eagerly only (it branches in Python on a tensor); the adapter
    # also inside tf.function, with the eager result.
    rt, rw = random_ragged(rng, [3, 0, 5, 2, 7, 1, 4, 2], ROWS)
    for shape in ([8], [2, 4], [16], [4, 8]):  # batch-sized: pooled; a multiple: a sequence
        config, _ = _config(combiner, output_shape=shape)
        theirs, ours = pair(config, rng)
        expected = theirs({"f": rt}, {"f": rw})
        assert_same(expected, ours({"f": rt}, {"f": rw}), combiner)
        traced = tf.function(lambda x, w: ours({"f": x}, {"f": w}))
        assert_same(expected, traced(rt, rw), combiner)
        assert tuple(traced(rt, rw)["f"].shape) == tuple(shape) + (DIM,)
    config, _ = _config(combiner, output_shape=[5])
    theirs, ours = pair(config, rng)
    with pytest.raises(ValueError):
        theirs({"f": rt})
    with pytest.raises(ValueError):
        ours({"f": rt})


def test_partly_known_output_shape(rng):
    """output_shape=[None, 4]: TensorFlow's FeatureConfig takes it; its lookup
    ignores it for dense and sparse input and refuses it for ragged input
    (ValueError); the adapter does the same (it raised TypeError on
    construction)."""
    config, _ = _config("sum", output_shape=[None, 4])
    theirs, ours = pair(config, rng)
    dense = tf.constant([[1, 2, 3]], tf.int64)
    sp, _ = random_sparse(rng, [5], 10, ROWS, 6, neg=False)
    for x in (dense, sp):
        expected, actual = _both(theirs, ours, {"f": x})
        assert_same(expected, actual, "sum")
    rt, _ = random_ragged(rng, [2, 1, 3, 1], ROWS)
    with pytest.raises(ValueError, match=r"partially known TensorShape \(None, 4\)"):
        theirs({"f": rt})
    with pytest.raises(ValueError, match=r"partially known TensorShape \(None, 4\)"):
        ours({"f": rt})


def test_ragged_output_shape_sequence_ignores_weights(rng):
    # A sequence output_shape ignores the weights, as TensorFlow does: their dtype, row partition and row
    # splits dtype are not checked (they are where the output is pooled).
    rt = tf.ragged.constant([[1, 2], [3], [4, 5, 6], []], dtype=tf.int64)
    config, _ = _config("mean", output_shape=[8])
    theirs, ours = pair(config, rng)
    for w in (tf.ragged.constant([[1.0, 2.0], [3.0], [4.0, 5.0, 6.0], []], dtype=tf.float64),
              tf.ragged.constant([[1.0], [2.0, 3.0], [4.0, 5.0, 6.0], []]),
              tf.RaggedTensor.from_row_splits([1.0, 2, 3, 4, 5, 6], tf.constant([0, 2, 3, 6, 6], tf.int32))):
        expected = theirs({"f": rt}, {"f": w})
        assert_same(expected, ours({"f": rt}, {"f": w}), "sum")
        assert_same(expected, tf.function(lambda x, w: ours({"f": x}, {"f": w}))(rt, w), "sum")


def test_ragged_output_shape_empty_batch(rng):
    # An empty batch and output_shape [4]: TensorFlow's 4 % 0 fails with InvalidArgumentError (eagerly; it
    # cannot run output_shape in a graph); the adapter raises it too, in a graph as well.
    empty = tf.RaggedTensor.from_row_splits(tf.zeros([0], tf.int64), tf.constant([0], tf.int64))
    config, _ = _config("sum", output_shape=[4])
    theirs, ours = pair(config, rng)
    with pytest.raises(tf.errors.InvalidArgumentError, match="division by zero"):
        theirs({"f": empty})
    with pytest.raises(tf.errors.InvalidArgumentError, match="division by zero"):
        ours({"f": empty})
    with pytest.raises(tf.errors.InvalidArgumentError, match="division by zero"):
        tf.function(lambda x: ours({"f": x}))(empty)


def test_out_of_memory_is_resource_exhausted():
    # A lookup the machine cannot hold (a [1, 2**45, 4] sequence output) raises ResourceExhaustedError, as
    # TensorFlow's kernels do, eagerly as inside tf.function.
    emb = EmbeddingForServing(_config("sum", max_sequence_length=2**45)[0])
    ids = {"f": tf.ragged.constant([[1]], dtype=tf.int64)}
    with pytest.raises(tf.errors.ResourceExhaustedError):
        emb(ids)
    with pytest.raises(tf.errors.ResourceExhaustedError):
        tf.function(lambda x: emb(x))(ids)


def test_mixed_structure_subset_and_shared_tables(rng):
    t_sum = E.TableConfig(vocabulary_size=40, dim=8, combiner="sum")
    t_mean = E.TableConfig(vocabulary_size=ROWS, dim=4, combiner="mean")
    config = {"user": {"clicks": E.FeatureConfig(t_sum), "country": E.FeatureConfig(t_mean)},
              "item": [E.FeatureConfig(t_sum), E.FeatureConfig(t_mean, validate_weights_and_indices=False)],
              "seq": E.FeatureConfig(t_sum, max_sequence_length=3)}
    theirs, ours = pair(config, rng)
    sp, w = random_sparse(rng, [6], 20, 40, 18, neg=True)
    rt, rw = random_ragged(rng, [2, 0, 11, 3, 1, 6], 40)
    fast, fast_w = random_sparse(rng, [6], 20, ROWS, 12)
    features = {"user": {"clicks": sp, "country": tf.constant([[1], [2], [3], [4], [5], [6]])},
                "item": [rt, fast], "seq": rt}
    weights = {"user": {"clicks": w, "country": None}, "item": [rw, fast_w], "seq": None}
    expected, actual = _both(theirs, ours, features, weights)
    assert set(actual) == {"user", "item", "seq"} and isinstance(actual["item"], list)
    # Bags of a sum table are exact; the mean table's within 1e-6.
    assert_same([expected["user"]["clicks"], expected["item"][0], expected["seq"]],
                [actual["user"]["clicks"], actual["item"][0], actual["seq"]], "sum")
    assert_same([expected["user"]["country"], expected["item"][1]],
                [actual["user"]["country"], actual["item"][1]], "mean")
    # A subset of the features, in a structure of its own.
    expected, actual = _both(theirs, ours, {"item": [rt, fast]})
    assert_same(expected["item"][0], actual["item"][0], "sum")


def test_table_names_and_configs(rng):
    def configs():
        a, b = E.TableConfig(vocabulary_size=10, dim=2), E.TableConfig(vocabulary_size=12, dim=3, name="named")
        c = E.TableConfig(vocabulary_size=14, dim=4)
        return {"z": E.FeatureConfig(a), "b": E.FeatureConfig(c), "m": E.FeatureConfig(b)}, (a, b, c)

    theirs_cfg, theirs_tables = configs()
    ours_cfg, ours_tables = configs()
    E.TPUEmbeddingForServing(theirs_cfg, E.Adagrad(0.1)).build()
    ours = EmbeddingForServing(ours_cfg, E.Adagrad(0.1))
    # Named in order of first use over the flattened config (dict keys sorted: b, m, z), as TensorFlow does.
    assert [t.name for t in ours_tables] == [t.name for t in theirs_tables] == ["table_2", "named", "table_0"]
    assert all(isinstance(t.optimizer, E.Adagrad) for t in ours_tables)
    assert set(ours.embedding_tables) == set(ours_tables)
    assert sorted(ours.variables["table_0"]) == ["accumulators", "parameters"]
    assert ours.embedding_tables[ours_tables[0]].shape == (10, 2)
    # One handle per table (and slot): every access gives the same object, so handles compare and key dicts.
    handle = ours.embedding_tables[ours_tables[0]]
    name = ours_tables[0].name
    assert ours.embedding_tables[ours_tables[0]] is handle and ours.variables[name]["parameters"] is handle
    assert ours.variables[name]["accumulators"] is ours.variables[name]["accumulators"]
    assert handle == ours.embedding_tables[ours_tables[0]] and handle != ours.embedding_tables[ours_tables[1]]
    assert {handle: 1}[ours.variables[name]["parameters"]] == 1
    with pytest.raises(ValueError, match="unique"):
        t = E.TableConfig(vocabulary_size=3, dim=2, name="x")
        EmbeddingForServing([E.FeatureConfig(t), E.FeatureConfig(E.TableConfig(vocabulary_size=3, dim=2, name="x"))])


def test_embedding_tables_act_as_tensors_like_tensorflows_variables(rng):
    # What code written for TPUEmbeddingForServing does with embedding_tables[cfg]: convert it, compute with
    # TensorFlow's operators, slice it, look rows up with tf.nn.embedding_lookup, eagerly and in tf.function.
    config, table = _config("sum")
    theirs, ours = pair(config, rng)
    ids = tf.constant([3, 0, 59], tf.int64)
    uses = {
        "convert": lambda t: tf.convert_to_tensor(t),
        "add": lambda t: t + 1.0, "radd": lambda t: 2.0 + t, "mul": lambda t: t * t, "neg": lambda t: -t,
        "matmul": lambda t: t @ tf.ones([DIM, 2]), "getitem": lambda t: t[3], "slice": lambda t: t[1:4, ::2],
        "reduce": lambda t: tf.reduce_sum(t, axis=0), "compare": lambda t: t > 0.0,
        "lookup": lambda t: tf.nn.embedding_lookup(t, ids), "shape": lambda t: tf.shape(t),
    }
    for name, use in uses.items():
        for graph in (False, True):
            run = tf.function(use) if graph else use
            expected, actual = run(theirs.embedding_tables[table]), run(ours.embedding_tables[table])
            assert expected.dtype == actual.dtype and expected.shape == actual.shape, (name, graph)
            np.testing.assert_array_equal(actual.numpy(), expected.numpy(), err_msg=f"{name} graph={graph}")
    handle = ours.embedding_tables[table]
    assert (handle == handle) is True and (handle != handle) is False  # identity, not element-wise
    assert {handle: 1}[handle] == 1
    # As a variable's, a traced read happens when the graph runs: later assigns are seen.
    for h in (theirs.embedding_tables[table], handle):
        scaled = tf.function(lambda: h * 2.0)
        np.testing.assert_array_equal(scaled().numpy(), 2.0 * h.numpy())
        h.assign(np.full((ROWS, DIM), 0.5, np.float32))
        np.testing.assert_array_equal(scaled().numpy(), np.full((ROWS, DIM), 1.0, np.float32))
    # And an assign traced into a graph happens each time the graph runs, from a tensor or a constant
    # (was: a symbolic tensor raised, and a constant was written once, while tracing).
    for h in (theirs.embedding_tables[table], handle):
        from_tensor = tf.function(lambda: h.assign(tf.fill([ROWS, DIM], 2.0)))
        from_constant = tf.function(lambda: h.assign(np.full((ROWS, DIM), 3.0, np.float32)))
        for reset, value in ((from_tensor, 2.0), (from_constant, 3.0), (from_tensor, 2.0), (from_constant, 3.0)):
            h.assign(np.zeros((ROWS, DIM), np.float32))
            reset()
            np.testing.assert_array_equal(h.numpy(), np.full((ROWS, DIM), value, np.float32))
    with pytest.raises(ValueError, match="cannot assign a value of shape"):
        tf.function(lambda: handle.assign(tf.zeros([ROWS + 1, DIM])))()
    # A tensor of another dtype is refused, as tf.Variable.assign refuses it (was: cast), eagerly and traced;
    # NumPy float64 converts, as for a variable.
    for h in (theirs.embedding_tables[table], handle):
        for bad in (tf.fill([ROWS, DIM], tf.constant(1 / 3, tf.float64)), tf.ones([ROWS, DIM], tf.int32)):
            for run in (lambda: h.assign(bad), tf.function(lambda: h.assign(bad))):
                with pytest.raises(ValueError, match="requested dtype float32 for Tensor with dtype|wrong dtype"):
                    run()
        h.assign(np.full((ROWS, DIM), 0.25))
        np.testing.assert_array_equal(h.numpy(), np.full((ROWS, DIM), 0.25, np.float32))
    # tf.Variable.assign's signature: read_value=False returns None (eagerly), use_locking and name are taken.
    for h in (theirs.embedding_tables[table], handle):
        assert h.assign(np.full((ROWS, DIM), 4.0, np.float32), read_value=False) is None
        assert h.assign(np.full((ROWS, DIM), 5.0, np.float32), use_locking=True, name="a") is not None
        np.testing.assert_array_equal(h.numpy(), np.full((ROWS, DIM), 5.0, np.float32))
        tf.function(lambda: h.assign(tf.fill([ROWS, DIM], 6.0), read_value=False) and None)()
        np.testing.assert_array_equal(h.numpy(), np.full((ROWS, DIM), 6.0, np.float32))
    rows = list(handle)  # iterates rows, as a variable does eagerly
    assert len(rows) == ROWS and isinstance(rows[0], tf.Tensor) and rows[0].shape == (DIM,)
    mixed = np.ones(DIM, np.float32) + handle  # numpy defers to the handle, as to a variable
    assert isinstance(mixed, tf.Tensor) and mixed.shape == (ROWS, DIM)


def test_embedcore_configs(rng):
    import embedcore as ec

    t = ec.TableConfig(rows=20, dim=4, combiner="sum", initializer=ec.initializers.Uniform(-1, 1, seed=3))
    emb = EmbeddingForServing({"a": ec.FeatureConfig(t), "s": ec.FeatureConfig(t, max_sequence_length=2)})
    rt = tf.ragged.constant([[1, 2, 3], [], [4]], dtype=tf.int64)
    out = emb({"a": rt, "s": rt})
    values = emb.embedding_tables[t].numpy()
    np.testing.assert_array_equal(out["a"].numpy()[0], values[1] + values[2] + values[3])
    np.testing.assert_array_equal(out["s"].numpy()[0], values[[1, 2]])
    assert emb.embedding_tables[t].table.name == "table_0"


@pytest.mark.parametrize("validate", [True, False])
def test_edge_inputs(rng, validate):
    # Empty batches and bags, rank-1 sparse input (one bag; or, on the fast path, one bag per index), a sequence
    # feature given rank-3 sparse input (pooled instead, as TensorFlow does), int32 row splits.
    config, _ = _config("mean", validate_weights_and_indices=validate)
    seq_config, _ = _config("mean", max_sequence_length=2)
    theirs, ours = pair(config, rng)
    seq_theirs, seq_ours = pair(seq_config, rng)
    cases = [
        {"f": tf.SparseTensor(tf.zeros([0, 2], tf.int64), tf.zeros([0], tf.int64), [3, 2])},
        {"f": tf.RaggedTensor.from_row_splits(tf.zeros([0], tf.int64), tf.constant([0], tf.int64))},
        {"f": tf.zeros([0, 3], tf.int64)},
        {"f": tf.SparseTensor([[0], [2], [3]], tf.constant([1, 2, 5], tf.int64), [4])},
        {"f": tf.RaggedTensor.from_row_splits(tf.constant([1, 2, 3], tf.int64), tf.constant([0, 1, 3], tf.int32))},
    ]
    for features in cases:
        expected, actual = _both(theirs, ours, features)
        assert_same(expected, actual, "mean")
    rank3 = {"f": tf.SparseTensor([[0, 0, 0], [1, 1, 1], [1, 1, 0]], tf.constant([1, 2, 7], tf.int64), [2, 2, 2])}
    expected, actual = _both(seq_theirs, seq_ours, rank3)
    assert_same(expected, actual, "mean")


@pytest.mark.parametrize("validate", [True, False])
def test_int16_ids_of_a_sparse_sequence_feature(rng, validate):
    # TensorFlow gathers a sequence's rows with tf.gather, which takes int16 ids (its pooling ops do not).
    config, _ = _config("sum", max_sequence_length=3, validate_weights_and_indices=validate)
    theirs, ours = pair(config, rng)
    sp = tf.SparseTensor([[0, 0], [0, 2], [2, 1]], tf.constant([4, 59, 0], tf.int16), [3, 3])
    expected, actual = _both(theirs, ours, {"f": sp})
    assert_same(expected, actual, "sum")


def _error_cases():
    sp = tf.SparseTensor([[0, 0], [0, 1], [2, 0]], tf.constant([1, 2, 3], tf.int64), [4, 3])
    rg = tf.ragged.constant([[1, 2], [], [3]], dtype=tf.int64)
    sparse_ids = lambda v: tf.SparseTensor([[0, 0]], tf.constant([v], tf.int64), [2, 2])  # noqa: E731
    return [
        ("dense id out of range", {}, lambda: ({"a": tf.constant([[1, 12]], tf.int64)}, None)),
        ("dense negative id", {}, lambda: ({"a": tf.constant([[1, -1]], tf.int64)}, None)),
        ("sparse id out of range", {}, lambda: ({"a": sparse_ids(12)}, None)),
        ("fast path id out of range", {"validate_weights_and_indices": False}, lambda: ({"a": sparse_ids(12)}, None)),
        ("fast path negative id", {"validate_weights_and_indices": False}, lambda: ({"a": sparse_ids(-3)}, None)),
        ("ragged id out of range", {}, lambda: ({"a": tf.ragged.constant([[12]], dtype=tf.int64)}, None)),
        ("ragged negative id", {}, lambda: ({"a": tf.ragged.constant([[-1]], dtype=tf.int64)}, None)),
        ("sequence id out of range", {"max_sequence_length": 2}, lambda: ({"a": sparse_ids(10)}, None)),
        ("weights for dense ids", {}, lambda: ({"a": tf.constant([[1]])}, {"a": tf.constant([[1.0]])})),
        ("weights for a sequence", {"max_sequence_length": 2}, lambda: ({"a": sp}, {"a": sp})),
        ("dense ids for a sequence", {"max_sequence_length": 2}, lambda: ({"a": tf.constant([[1]])}, None)),
        ("weights of another type", {}, lambda: ({"a": sp}, {"a": rg})),
        ("sparse weights of another size", {},
         lambda: ({"a": sp}, {"a": tf.SparseTensor([[0, 0], [0, 1]], [1.0, 2.0], [4, 3])})),
        ("ragged weights of another partition", {}, lambda: ({"a": rg}, {"a": tf.ragged.constant([[1.0], [2.0], [3.0]])})),
        ("unknown feature", {}, lambda: ({"b": rg}, None)),
        ("ragged rank 3", {}, lambda: ({"a": tf.ragged.constant([[[1]], [[2, 3]]], dtype=tf.int64)}, None)),
        ("not a tensor", {}, lambda: ({"a": np.array([[1]])}, None)),
        ("weights structure", {}, lambda: ({"a": rg}, [rg])),
        ("float ids", {}, lambda: ({"a": tf.constant([[1.0]])}, None)),
        ("ragged uint8 ids", {}, lambda: ({"a": tf.ragged.constant([[1]], dtype=tf.uint8)}, None)),
        ("sparse float ids", {}, lambda: ({"a": tf.SparseTensor([[0, 0]], tf.constant([1.0]), [2, 2])}, None)),
        ("sparse string ids", {}, lambda: ({"a": tf.SparseTensor([[0, 0]], tf.constant(["1"]), [2, 2])}, None)),
        ("sparse bool ids", {}, lambda: ({"a": tf.SparseTensor([[0, 0]], tf.constant([True]), [2, 2])}, None)),
        ("fast path string ids", {"validate_weights_and_indices": False},
         lambda: ({"a": tf.SparseTensor([[0, 0]], tf.constant(["1"]), [2, 2])}, None)),
        ("sequence string ids", {"max_sequence_length": 2},
         lambda: ({"a": tf.SparseTensor([[0, 0]], tf.constant(["1"]), [2, 2])}, None)),
        ("sparse int16 ids", {}, lambda: ({"a": tf.SparseTensor([[0, 0]], tf.constant([1], tf.int16), [2, 2])}, None)),
        ("fast path rows out of order", {"validate_weights_and_indices": False},
         lambda: ({"a": tf.SparseTensor([[1, 0], [0, 0]], tf.constant([1, 2], tf.int64), [3, 2])}, None)),
        ("ragged weights with int32 row splits", {},
         lambda: ({"a": rg}, {"a": tf.RaggedTensor.from_row_splits([1.0, 2.0, 3.0], tf.constant([0, 2, 2, 3], tf.int32))})),
        ("ragged weights with an inner dimension", {},
         lambda: ({"a": rg}, {"a": tf.RaggedTensor.from_row_splits(tf.ones([3, 1]), tf.constant([0, 2, 2, 3], tf.int64))})),
        ("ragged weights of ragged rank 2", {},
         lambda: ({"a": rg}, {"a": tf.RaggedTensor.from_row_splits(tf.RaggedTensor.from_row_lengths(
             [1.0, 2.0, 3.0], tf.constant([1, 1, 1], tf.int64)), tf.constant([0, 2, 2, 3], tf.int64))})),
        ("sparse float64 weights", {},
         lambda: ({"a": sp}, {"a": tf.SparseTensor(sp.indices, tf.constant([1.0, 2, 3], tf.float64), [4, 3])})),
    ]


@pytest.mark.parametrize("case", _error_cases(), ids=lambda c: c[0])
def test_same_exceptions(case):
    _, feature_kwargs, make = case

    def build(cls):
        table = E.TableConfig(vocabulary_size=10, dim=4, name="t")
        emb = cls({"a": E.FeatureConfig(table, **feature_kwargs)}, None)
        emb.build()
        return emb

    def raised(emb, graph):
        features, weights = make()
        try:
            if graph:
                tf.function(lambda: emb(features, weights))()
            else:
                emb(features, weights)
        except Exception as e:  # noqa: BLE001 - the type is what is compared
            return type(e)
        return None

    theirs, ours = build(E.TPUEmbeddingForServing), build(EmbeddingForServing)
    for graph in (False, True):
        expected = raised(theirs, graph)
        assert expected is not None
        assert raised(ours, graph) is expected, ("tf.function" if graph else "eager", expected)


def _index_cases():
    """Bad and unusual SparseTensor indices: (name, feature, indices, ids, dense_shape, weights). Features: "safe"
    (safe_embedding_lookup_sparse), "mean" (the same, weighted mean: weights <= 0 pruned), "fast"
    (validate_weights_and_indices=False: embedding_lookup_sparse; weighted, its segment ids are taken as int32),
    "seq" (max_sequence_length=3: sparse_slice to [batch, 3])."""
    big = 2**40
    return [
        ("safe row -1", "safe", [[-1, 0], [1, 0]], [1, 2], [2, 3], None),
        ("safe row 2**40", "safe", [[0, 0], [big, 0]], [1, 2], [2, 3], None),
        ("safe row == batch", "safe", [[0, 0], [2, 0]], [1, 2], [2, 3], None),
        ("safe bad row before bad id", "safe", [[0, 0], [5, 0]], [99, 1], [2, 3], None),
        ("safe pruned id then bad row", "safe", [[0, 0], [0, 1], [5, 0]], [-1, -1, 2], [2, 3], None),
        ("safe col -1", "safe", [[0, -1], [1, 0]], [1, 2], [2, 3], None),
        ("safe col past width", "safe", [[0, 5], [1, 0]], [1, 2], [2, 3], None),
        ("safe col 2**40", "safe", [[0, big], [1, 0]], [1, 2], [2, 3], None),
        ("safe rows unsorted", "safe", [[1, 0], [0, 1], [0, 0]], [1, 2, 3], [2, 3], None),
        ("safe rank 1 index -1", "safe", [[-1], [1]], [1, 2], [3], None),
        ("safe rank 1 index -5", "safe", [[-5], [1]], [1, 2], [3], None),
        ("safe rank 1 index past", "safe", [[0], [7]], [1, 2], [3], None),
        ("safe rank 3 middle past", "safe", [[0, 5, 0], [1, 1, 1]], [1, 2], [2, 2, 2], None),
        ("safe rank 3 first -1", "safe", [[-1, 0, 0], [1, 1, 1]], [1, 2], [2, 2, 2], None),
        ("safe rank 3 last past", "safe", [[0, 0, 7], [1, 1, 1]], [1, 2], [2, 2, 2], None),
        ("mean row 2**32+1", "mean", [[0, 0], [2**32 + 1, 0]], [1, 2], [2, 3], [1.0, 1.0]),
        ("mean pruned weight then bad row", "mean", [[0, 0], [0, 1], [5, 0]], [1, 2, 3], [2, 3], [0.0, 1.0, 1.0]),
        # Rows in order, ids >= 0 (nothing the unweighted path would prune): weights <= 0 are still pruned, and
        # a bag left with none gives zeros.
        ("mean weights <= 0 in ordered rows", "mean", [[0, 0], [0, 1], [1, 0]], [1, 2, 3], [2, 2],
         [2.0, -1.0, 0.0]),
        ("fast row -1", "fast", [[-1, 0], [1, 0]], [1, 2], [2, 3], None),
        ("fast only row -1", "fast", [[-1, 0]], [1], [2, 3], None),
        ("fast row 2**40", "fast", [[0, 0], [big, 0]], [1, 2], [2, 3], None),
        ("fast row past batch", "fast", [[0, 0], [5, 0]], [1, 2], [2, 3], None),
        ("fast rows unsorted", "fast", [[1, 0], [0, 0]], [1, 2], [2, 3], None),
        ("fast row -1 between", "fast", [[0, 0], [-1, 0], [1, 0]], [1, 2, 3], [2, 3], None),
        ("fast bad id before row -1", "fast", [[0, 0], [-1, 0], [1, 0]], [99, 1, 2], [2, 3], None),
        ("fast col -1 and past width", "fast", [[0, -1], [1, 9]], [1, 2], [2, 3], None),
        ("fast rank 1 index -1", "fast", [[-1], [1]], [1, 2], [3], None),
        ("fast rank 1 index past", "fast", [[0], [7]], [1, 2], [3], None),
        ("fast weighted row 2**40", "fast", [[big, 0]], [1], [2, 3], [1.0]),
        ("fast weighted row 2**32+1", "fast", [[0, 0], [2**32 + 1, 0]], [1, 2], [2, 3], [1.0, 2.0]),
        ("fast weighted row 2**31", "fast", [[2**31, 0]], [1], [2, 3], [1.0]),
        ("fast weighted row -1", "fast", [[-1, 0], [1, 0]], [1, 2], [2, 3], [1.0, 2.0]),
        ("seq row past batch", "seq", [[5, 0]], [1], [2, 3], None),
        ("seq row == batch", "seq", [[0, 0], [2, 0]], [1, 2], [2, 3], None),
        ("seq row -1", "seq", [[-1, 0], [1, 0]], [1, 2], [2, 3], None),
        ("seq row 2**40", "seq", [[0, 0], [big, 0]], [1, 2], [2, 3], None),
        ("seq col -1", "seq", [[0, -1], [1, 0]], [1, 2], [2, 3], None),
        ("seq col past length", "seq", [[0, 3], [1, 2**40]], [1, 2], [2, 9], None),
        ("seq col past dense_shape", "seq", [[0, 2], [1, 0]], [1, 2], [2, 2], None),
        ("seq unsorted and duplicate", "seq", [[1, 1], [0, 2], [1, 1]], [1, 2, 3], [2, 3], None),
        ("seq bad id dropped", "seq", [[0, 7], [-1, 0], [1, 0]], [99, 99, 1], [2, 3], None),
        ("seq batch 2**32+2 (int32: 2)", "seq", [[0, 0], [1, 1], [3, 0]], [1, 2, 3], [2**32 + 2, 3], None),
        ("seq batch 2**32 (int32: 0)", "seq", [[0, 0], [1, 1]], [1, 2], [2**32, 3], None),
        ("seq batch 2**31 (int32: < 0)", "seq", [[0, 0]], [1], [2**31, 3], None),
        ("seq dense shape overflows", "seq", [[0, 0]], [1], [2**62, 4], None),
        ("safe dense shape overflows", "safe", [[0, 0]], [1], [2, 2**62], None),
        ("safe rank 3 dense shape overflows", "safe", [[0, 0, 0]], [1], [2, 2, 2**62], None),
        ("mean rank 3 dense shape overflows", "mean", [[0, 0, 0]], [1], [2**62, 4, 3], [1.0]),
    ]


def _index_features():
    table = E.TableConfig(vocabulary_size=10, dim=4, combiner="sum", name="t")
    mean = E.TableConfig(vocabulary_size=10, dim=4, combiner="mean", name="m")
    return {"safe": E.FeatureConfig(table), "mean": E.FeatureConfig(mean),
            "fast": E.FeatureConfig(table, validate_weights_and_indices=False),
            "seq": E.FeatureConfig(table, max_sequence_length=3)}


@pytest.fixture(scope="module")
def index_pair():
    return pair(_index_features(), np.random.default_rng(7))


def _tf_message(e: Exception) -> str:
    """TensorFlow's error message without the op, node and function decorations."""
    lines = [line for line in str(e).splitlines() if line.strip() and not line.startswith("\t")]
    return re.sub(r"^\{\{function_node [^}]*\}\} | \[Op:\w+\].*$", "", lines[-1])


def _outcome(fn):
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - the type and message are what is compared
        return e


def _assert_same_outcome(expected, actual, where):
    if isinstance(expected, Exception):
        assert type(actual) is type(expected), (where, expected, actual)
        assert _tf_message(expected) in str(actual), (where, _tf_message(expected), str(actual))
    else:
        assert not isinstance(actual, Exception), (where, actual)
        assert_same(expected, actual, "sum")


@pytest.mark.parametrize("case", _index_cases(), ids=lambda c: c[0])
def test_sparse_indices_like_tensorflow(index_pair, case):
    # Bad indices raise TensorFlow's InvalidArgumentError with its message (before any allocation sized by an
    # index), or give TensorFlow's output where TensorFlow accepts them; eagerly and inside tf.function.
    _, name, indices, ids, shape, weights = case
    sp = tf.SparseTensor(tf.constant(indices, tf.int64), tf.constant(ids, tf.int64), shape)
    features = {name: sp}
    w = None if weights is None else {name: tf.SparseTensor(sp.indices, tf.constant(weights, tf.float32), shape)}
    theirs, ours = index_pair
    for graph in (False, True):
        results = [_outcome(lambda: (tf.function(lambda f, w: emb(f, w)) if graph else emb)(features, w))
                   for emb in (theirs, ours)]
        _assert_same_outcome(*results, "tf.function" if graph else "eager")


@pytest.mark.parametrize("name", ["safe", "fast", "seq"])
@pytest.mark.parametrize("indices, ids, shape", [
    ([0, 1], [1, 2], [2, 3]),  # indices not a matrix
    ([[0, 0, 0], [1, 0, 0]], [1, 2], [2, 3]),  # more index columns than dims
    ([[0], [1]], [1, 2], [2, 3]),  # fewer
    ([[0, 0], [1, 0]], [1], [2, 3]),  # fewer ids than indices
    ([[0, 0], [1, 0]], [1, 2, 3], [2, 3]),  # more
    ([[0, 0, 0], [1, 1, 1]], [1, 2], [2, 2, 2]),  # rank 3 (pooled, even for the sequence feature, when known)
    ([[0, 0, 0], [1, 1, 1]], [1, 2], [2, 2, 0]),  # a dimension 0
    ([[0, 0], [1, 0]], [1, 2], [2, -3]),  # a negative dimension
    ([[0, 0], [1, 0]], [1, 2], [-2, 3]),
    ([[0, 0], [1, 0]], [1, 2], [2**32, 2**31]),  # dimensions whose product overflows
], ids=["vector", "wide", "narrow", "fewer ids", "more ids", "rank 3", "empty dim", "negative dim",
        "negative batch", "overflowing dims"])
def test_sparse_index_shapes_like_tensorflow(index_pair, name, indices, ids, shape):
    # Shapes only checked when the graph runs: a tf.function taking indices, ids and dense shape of unknown shape.
    specs = [tf.TensorSpec(None, tf.int64), tf.TensorSpec([None], tf.int64), tf.TensorSpec([None], tf.int64)]
    args = [tf.constant(indices, tf.int64), tf.constant(ids, tf.int64), tf.constant(shape, tf.int64)]
    expected, actual = [
        _outcome(lambda: tf.function(lambda i, v, s: emb({name: tf.SparseTensor(i, v, s)}), input_signature=specs)(
            *args)) for emb in index_pair]
    _assert_same_outcome(expected, actual, "tf.function")


@pytest.mark.parametrize("combiner", COMBINERS)
@pytest.mark.parametrize("validate", [True, False])
@pytest.mark.parametrize("n_weights", [1, 2, 4])
@pytest.mark.parametrize("dense_shape", [[3, 2], [2, 2, 2]], ids=["rank2", "rank3"])
def test_weight_counts_unknown_while_tracing_like_tensorflow(rng, combiner, validate, n_weights, dense_shape):
    # A tf.function whose SparseTensors have unknown shapes: TensorFlow checks the count of weights only
    # when the graph runs. One weight for several ids is broadcast over them by the rank-2 fast path's sum
    # (embedding_lookup_sparse multiplies the rows by the weights), and refused by everything else.
    config, _ = _config(combiner, validate_weights_and_indices=validate)
    theirs, ours = pair(config, rng)
    indices = [[0, 0], [0, 1], [2, 0]] if len(dense_shape) == 2 else [[0, 0, 0], [0, 0, 1], [1, 1, 0]]
    ids = tf.SparseTensor(tf.constant(indices, tf.int64), tf.constant([5, 7, 11], tf.int64), dense_shape)
    w = tf.SparseTensor(tf.constant(indices[:n_weights] + [[0] * len(dense_shape)] * (n_weights - 3), tf.int64),
                        tf.constant([0.5, 2.0, 3.0, 1.5][:n_weights]), dense_shape)
    rank = len(dense_shape)
    specs = [tf.SparseTensorSpec([None] * rank, tf.int64), tf.SparseTensorSpec([None] * rank, tf.float32)]
    expected, actual = [
        _outcome(lambda: tf.function(lambda i, ww: emb({"f": i}, {"f": ww}), input_signature=specs)(ids, w))
        for emb in (theirs, ours)]
    if isinstance(expected, Exception):
        assert type(actual) is type(expected), (expected, actual)
    else:
        assert not isinstance(actual, Exception), actual
        assert_same(expected, actual, combiner)
    broadcast = n_weights == 1 and not validate and combiner == "sum" and rank == 2
    assert isinstance(expected, Exception) != broadcast


def test_import_embedcore_does_not_import_tensorflow():
    code = "import sys, embedcore, embedcore.adapters; print('tensorflow' in sys.modules, 'keras' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-2:] == ["False", "False"]


@pytest.mark.filterwarnings("ignore:__array__ implementation doesn't accept a copy keyword")  # tf.Variable's
def test_array_protocol_copies_like_numpy(rng):
    # np.array / np.asarray of a handle follow NumPy 2's copy= as for an ndarray or a tf.Variable: a writable
    # snapshot unless copy=False, which is the read-only view (was: the live view, whatever copy= said).
    config, table = _config("sum")
    emb = EmbeddingForServing(config)
    values = rng.standard_normal((ROWS, DIM)).astype(np.float32)
    handle = emb.embedding_tables[table]
    handle.assign(values)
    variable = tf.Variable(values)
    for convert in (np.array, np.asarray, lambda x: np.asarray(x, copy=True), lambda x: np.array(x, np.float64)):
        ours, theirs = convert(handle), convert(variable)
        assert ours.dtype == theirs.dtype and ours.flags.writeable == theirs.flags.writeable
        np.testing.assert_array_equal(ours, theirs)
        assert not np.shares_memory(ours, handle.numpy())
        handle.assign(values + 1)  # the snapshot keeps the values it was taken with
        np.testing.assert_array_equal(ours, theirs)
        handle.assign(values)
    view = np.asarray(handle, copy=False)
    assert np.shares_memory(view, handle.numpy()) and not view.flags.writeable
    np.testing.assert_array_equal(np.asarray(handle, dtype=np.float32, copy=False), values)
    # A conversion that needs a copy: NumPy's own ValueError for an ndarray, and ours.
    with pytest.raises(ValueError):
        np.asarray(values, dtype=np.float64, copy=False)
    with pytest.raises(ValueError, match="'t'.*copy=False"):
        np.asarray(handle, dtype=np.float64, copy=False)


@pytest.mark.parametrize("optimizer,match", [
    (lambda: E.AdagradMomentum(0.1), "embedcore has no AdagradMomentum optimizer"),
    (lambda: E.Adagrad(0.1, slot_variable_creation_fn=lambda table, names, initializers: {}),
     "Adagrad: slot_variable_creation_fn is not supported by embedcore"),
])
def test_an_optimizer_the_engine_cannot_follow_makes_a_table_without_one(optimizer, match):
    """optimizer_from_tf refuses it; a serving table is made without an
    optimizer, with a warning naming why (it serves and restores values)."""
    from embedcore.adapters.tf import optimizer_from_tf

    with pytest.raises(NotImplementedError, match=match):
        optimizer_from_tf(optimizer())
    table = E.TableConfig(vocabulary_size=10, dim=2, name=f"t_{match[:8]}")
    with pytest.warns(UserWarning, match=re.escape(match) + ".*is created without an optimizer"):
        serving = EmbeddingForServing({"f": E.FeatureConfig(table)}, optimizer())
        serving.build()
    assert all(t.optimizer is None for t in serving._embedcore_tables())
    assert serving({"f": tf.constant([1, 2])})["f"].shape == (2, 2)


def test_tf_optimizer_flags_given_as_ints_convert_as_tensorflow_takes_them():
    """TensorFlow's optimizers take truthy flags (lazy_adam=1): converted as
    TensorFlow reads them (embedcore's own optimizers take bools only)."""
    from embedcore.adapters.tf import optimizer_from_tf

    adam = optimizer_from_tf(E.Adam(0.1, lazy_adam=0, sum_inside_sqrt=1))
    assert adam.lazy_adam is False and adam.sum_inside_sqrt is True
    assert optimizer_from_tf(E.FTRL(0.1, multiply_linear_by_learning_rate=1)).multiply_linear_by_learning_rate is True


def test_built_and_looked_up_inside_a_tf1_style_graph():
    """Built inside tf.Graph().as_default() (TF1-style code, where
    tf.init_scope is not eager), a table's TensorFlow initializer gives its
    values (was: "Cannot convert a symbolic tf.Tensor to a numpy array"),
    and a session runs the lookup as serving_embedding_lookup does."""
    from embedcore.adapters.tf import EmbeddingForServing

    values = np.arange(18, dtype=np.float32).reshape(6, 3)
    t = E.TableConfig(6, 3, combiner="sum", name="t", initializer=tf.constant_initializer(values))
    g = tf.Graph()
    with g.as_default():
        emb = EmbeddingForServing({"f": E.FeatureConfig(t)})
        emb.build()
        ids = tf.compat.v1.placeholder(tf.int64, [None])
        splits = tf.compat.v1.placeholder(tf.int64, [None])
        out = emb({"f": tf.RaggedTensor.from_row_splits(ids, splits)})["f"]
        with tf.compat.v1.Session(graph=g) as s:
            got = s.run(out, {ids: [1, 2, 5], splits: [0, 2, 3]})
    np.testing.assert_array_equal(emb.embedding_tables[t].numpy(), values)
    np.testing.assert_array_equal(got, [values[1] + values[2], values[5]])


def test_first_calls_of_several_threads_at_once_build_one_set_of_tables():
    """Threads whose first lookups on a fresh layer come at once build its
    tables once: every call reads the same tables (each thread built its own
    before, and all but the last were thrown away, with any value written
    into them; an unseeded initializer showed it)."""
    import threading

    table = E.TableConfig(vocabulary_size=50_000, dim=8, combiner="sum", name="u",
                          initializer=lambda shape, dtype=tf.float32: tf.random.uniform(shape, dtype=dtype))
    x = {"f": tf.constant([[1], [2]])}
    for _ in range(4):
        layer = EmbeddingForServing({"f": E.FeatureConfig(table)}, None)
        results, barrier = {}, threading.Barrier(3)

        def first(k):
            barrier.wait()
            results[k] = layer(x)["f"].numpy()

        threads = [threading.Thread(target=first, args=(k,)) for k in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        later = layer(x)["f"].numpy()
        assert all(np.array_equal(r, later) for r in results.values()) and len(results) == 3


def _weights_grads(layer, features, weights, dy, traced):
    """d(sum(out * dy)) / d(each feature's weights' values), eagerly or in a tf.function."""

    def run(features, wvalues):
        with tf.GradientTape() as tape:
            tape.watch(wvalues)
            w = {k: (tf.SparseTensor(weights[k].indices, wvalues[k], weights[k].dense_shape)
                     if isinstance(weights[k], tf.SparseTensor) else weights[k].with_values(wvalues[k]))
                 for k in weights}
            out = layer(features, w)
            loss = tf.add_n([tf.reduce_sum(out[k] * dy[k]) for k in out])
        return {k: tf.convert_to_tensor(g) for k, g in tape.gradient(loss, wvalues).items()}  # (IndexedSlices)

    wvalues = {k: tf.identity(w.values) for k, w in weights.items()}
    return (tf.function(run) if traced else run)(features, wvalues)


@pytest.mark.parametrize("combiner", COMBINERS)
@pytest.mark.parametrize("traced", [False, True], ids=["eager", "tf.function"])
def test_gradient_with_respect_to_the_weights_is_tensorflows(rng, combiner, traced):
    """A weighted lookup is differentiable with respect to its per-id
    weights, as TensorFlow's (whose ops differentiate segment_sum(w * rows)
    and its division by segment_sum(w) or sqrt(segment_sum(w * w))): sparse
    rank 2 (safe, pruning negative ids and, for mean and sqrtn, weights <=
    0; and validate_weights_and_indices=False), sparse rank 3, ragged (a
    bag whose weights add up to 0). Was None: a trainable weighting never
    trained."""
    table = E.TableConfig(vocabulary_size=ROWS, dim=DIM, combiner=combiner, name="t")
    config = {"s": E.FeatureConfig(table), "u": E.FeatureConfig(table, validate_weights_and_indices=False),
              "r3": E.FeatureConfig(table), "g": E.FeatureConfig(table)}
    theirs, ours = pair(config, rng)
    s, sw = random_sparse(rng, [9], 30, ROWS, 20, neg=True)
    u, uw = random_sparse(rng, [7], 30, ROWS, 20)
    r3, r3w = random_sparse(rng, [3, 4], 10, ROWS, 8, neg=True)
    g, gw = random_ragged(rng, [3, 0, 7, 1, 4], ROWS)
    features, weights = {"s": s, "u": u, "r3": r3, "g": g}, {"s": sw, "u": uw, "r3": r3w, "g": gw}
    out = theirs(features, weights)
    dy = {k: tf.constant(rng.standard_normal(v.shape).astype(np.float32)) for k, v in out.items()}
    want = _weights_grads(theirs, features, weights, dy, traced)
    got = _weights_grads(ours, features, weights, dy, traced)
    for k in features:
        assert got[k] is not None, k
        scale = max(1.0, float(np.abs(want[k]).max()))
        np.testing.assert_allclose(got[k].numpy(), want[k].numpy(), rtol=0, atol=2e-5 * scale, err_msg=k)
    pruned = (sw.values.numpy() <= 0) | (s.values.numpy() < 0) if combiner != "sum" else s.values.numpy() < 0
    assert pruned.any() and not got["s"].numpy()[pruned].any()  # pruned ids' weights: no gradient
