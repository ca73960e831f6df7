"""ec.Embedding: nested feature configs, shared tables, sequence features,
table naming, and all-or-nothing gradient application."""
import threading

import numpy as np
import pytest

import embedcore as ec
import reference as ref
from helpers import assert_close, assert_pooled, assert_unchanged, random_bags, snapshot

opt = ec.optimizers
init = ec.initializers


def _tables():
    t_sum = ec.TableConfig(rows=50, dim=4, combiner="sum", initializer=init.Uniform(-1, 1, seed=1))
    t_mean = ec.TableConfig(rows=30, dim=6, combiner="mean", initializer=init.Uniform(-1, 1, seed=2))
    return t_sum, t_mean


def _ref_opt():
    return ref.OptimizerRef("adagrad", learning_rate=0.1, initial_accumulator_value=0.1)


def test_shared_table_and_sequence_feature(rng):
    t_sum, t_mean = _tables()
    config = {
        "b_pooled": ec.FeatureConfig(t_sum),
        "a_other": ec.FeatureConfig(t_mean),
        "c_seq": ec.FeatureConfig(t_sum, max_sequence_length=3),
    }
    emb = ec.Embedding(config, opt.Adagrad(learning_rate=0.1))
    tables = emb.embedding_tables
    assert set(tables) == {t_sum, t_mean}
    # Tables are named in order of first use, dict keys sorted: a_other -> t_mean first.
    assert tables[t_mean].name == "table_0" and tables[t_sum].name == "table_1"
    assert (tables[t_sum].rows, tables[t_sum].dim, tables[t_sum].combiner) == (50, 4, "sum")
    ref_sum = ref.TableRef(tables[t_sum].to_numpy(), _ref_opt())
    ref_mean = ref.TableRef(tables[t_mean].to_numpy(), _ref_opt())

    for step in range(3):
        ids_b, off_b, w_b = random_bags(rng, 50, 7, weighted=True)
        ids_a = rng.integers(0, 30, size=(7, 2))  # dense [batch, k]
        ids_c, off_c, _ = random_bags(rng, 50, 7, max_len=5)
        features = {"b_pooled": ec.Ragged(ids_b, off_b), "a_other": ids_a, "c_seq": ec.Ragged(ids_c, off_c)}
        weights = {"b_pooled": w_b, "a_other": None, "c_seq": None}
        out = emb(features, weights)
        assert set(out) == set(config)
        assert out["b_pooled"].shape == (7, 4)
        assert out["a_other"].shape == (7, 6)
        assert out["c_seq"].shape == (7, 3, 4)
        e, bnd = ref.pooled(ref_sum.values, ids_b, off_b, w_b, "sum")
        assert_pooled(out["b_pooled"], e, bnd, 1e-6)
        e, bnd = ref.pooled(ref_mean.values, ids_a.ravel(), np.arange(0, 15, 2), None, "mean")
        assert_pooled(out["a_other"], e, bnd, 1e-5)
        np.testing.assert_allclose(out["c_seq"], ref.sequence_padded(ref_sum.values, ids_c, off_c, None, 3),
                                   rtol=1e-6, atol=1e-7)

        grads = {k: rng.normal(size=v.shape).astype(np.float32) for k, v in out.items()}
        emb.apply_gradients(grads)
        # One update per table; the shared table's gradients summed first.
        rg = ref_sum.row_grads().add_pooled(ids_b, off_b, w_b, "sum", grads["b_pooled"])
        rg.add_padded(ids_c, off_c, None, 3, grads["c_seq"])
        ref_sum.apply(rg)
        ref_mean.apply(ref_mean.row_grads().add_pooled(ids_a.ravel(), np.arange(0, 15, 2), None, "mean",
                                                       grads["a_other"]))
        for t, r in ((tables[t_sum], ref_sum), (tables[t_mean], ref_mean)):
            assert t.step == step + 1
            assert_close(t.to_numpy(), r.values, 1e-5, 1e-6, t.name)
            assert_close(t.slots()["accumulators"], r.slots["accumulators"], 1e-5, 1e-6, t.name)


def test_two_features_one_table_is_one_update_of_summed_gradients():
    t = ec.TableConfig(rows=10, dim=2, combiner="sum", initializer=init.Constant(1.0))
    emb = ec.Embedding({"x": ec.FeatureConfig(t), "y": ec.FeatureConfig(t)}, opt.Adagrad(learning_rate=1.0))
    emb({"x": np.array([3]), "y": np.array([3])})
    emb.apply_gradients({"x": np.full((1, 2), 1.0, np.float32), "y": np.full((1, 2), 2.0, np.float32)})
    table = emb.embedding_tables[t]
    assert table.step == 1
    # One Adagrad step with g = 3: a = 0.1 + 9, w = 1 - 3 / sqrt(9.1)
    expected = np.float32(1) - np.float32(3) / np.sqrt(np.float32(0.1) + np.float32(9))  # (float32 under NumPy 1 too)
    np.testing.assert_allclose(table.to_numpy()[3], [expected, expected], rtol=1e-6)
    np.testing.assert_allclose(table.slots()["accumulators"][3], [9.1, 9.1], rtol=1e-6)


def test_nested_lists_and_tuples(rng):
    t_sum, t_mean = _tables()
    config = [ec.FeatureConfig(t_sum), (ec.FeatureConfig(t_mean), {"z": ec.FeatureConfig(t_sum),
                                                                    "y": ec.FeatureConfig(t_mean, 2)})]
    emb = ec.Embedding(config, opt.SGD(learning_rate=0.5))
    tables = emb.embedding_tables
    assert tables[t_sum].name == "table_0" and tables[t_mean].name == "table_1"
    f0 = rng.integers(0, 50, size=5)
    f1 = ec.Ragged(rng.integers(0, 30, size=6), np.array([0, 2, 2, 6]))
    fz = rng.integers(0, 50, size=(2, 3))
    fy = ec.Ragged(rng.integers(0, 30, size=4), np.array([0, 3, 4]))
    out = emb([f0, (f1, {"z": fz, "y": fy})])
    assert isinstance(out, list) and isinstance(out[1], tuple) and isinstance(out[1][1], dict)
    assert out[0].shape == (5, 4) and out[1][0].shape == (3, 6)
    assert out[1][1]["z"].shape == (2, 4) and out[1][1]["y"].shape == (2, 2, 6)
    np.testing.assert_array_equal(out[0], tables[t_sum].lookup(f0))
    np.testing.assert_array_equal(out[1][1]["y"], tables[t_mean].lookup(fy, combiner=None, max_sequence_length=2))
    grads = [np.ones((5, 4), np.float32), (np.ones((3, 6), np.float32),
                                           {"z": np.ones((2, 4), np.float32), "y": np.ones((2, 2, 6), np.float32)})]
    before = tables[t_sum].to_numpy()
    emb.apply_gradients(grads)
    assert tables[t_sum].step == 1 and tables[t_mean].step == 1
    # SGD, sum combiner: each occurrence moves its row by -lr * 1.
    counts = np.bincount(np.concatenate([f0, fz.ravel()]), minlength=50)
    np.testing.assert_allclose(tables[t_sum].to_numpy(), before - 0.5 * counts[:, None], rtol=1e-6, atol=1e-7)


def test_default_names_follow_sorted_keys():
    a, b, c = (ec.TableConfig(rows=5, dim=2) for _ in range(3))
    emb = ec.Embedding({"zeta": ec.FeatureConfig(a), "alpha": ec.FeatureConfig(b),
                        "mid": ec.FeatureConfig(c), "beta": ec.FeatureConfig(a)})
    names = {cfg: t.name for cfg, t in emb.embedding_tables.items()}
    # sorted keys: alpha (b), beta (a), mid (c), zeta (a)
    assert names == {b: "table_0", a: "table_1", c: "table_2"}


def test_named_tables_keep_their_names():
    a = ec.TableConfig(name="users", rows=5, dim=2)
    b = ec.TableConfig(name="items", rows=5, dim=3)
    emb = ec.Embedding([ec.FeatureConfig(a), ec.FeatureConfig(b)])
    assert emb.embedding_tables[a].name == "users" and emb.embedding_tables[b].name == "items"
    with pytest.raises(ValueError):
        ec.Embedding([ec.FeatureConfig(ec.TableConfig(name="x", rows=2, dim=2)),
                      ec.FeatureConfig(ec.TableConfig(name="x", rows=2, dim=2))])


def test_table_optimizer_overrides_embedding_optimizer():
    a = ec.TableConfig(rows=5, dim=2, combiner="sum", initializer=init.Zeros(), optimizer=opt.SGD(learning_rate=2.0))
    b = ec.TableConfig(rows=5, dim=2, combiner="sum", initializer=init.Zeros())
    emb = ec.Embedding({"a": ec.FeatureConfig(a), "b": ec.FeatureConfig(b)}, opt.SGD(learning_rate=0.5))
    emb({"a": np.array([1]), "b": np.array([1])})
    emb.apply_gradients({"a": np.ones((1, 2), np.float32), "b": np.ones((1, 2), np.float32)})
    np.testing.assert_allclose(emb.embedding_tables[a].to_numpy()[1], [-2.0, -2.0])
    np.testing.assert_allclose(emb.embedding_tables[b].to_numpy()[1], [-0.5, -0.5])
    assert emb.embedding_tables[b].slot_names == ()


def test_outputs_take_the_callers_structure_trained_and_served(tmp_path):
    """As TensorFlow packs embedding outputs (tf.nest.pack_sequence_as of
    the features): a namedtuple, an OrderedDict and a defaultdict come back
    as such, from the trained Embedding and from its served checkpoint (a
    defaultdict config raised TypeError at every lookup; served, a
    namedtuple came back a tuple and an OrderedDict a dict). Dict keys that
    are NumPy ints are recorded as the ints they are (was: no structure, so
    the served call refused the dict)."""
    import collections

    tf = pytest.importorskip("tensorflow")
    E = tf.tpu.experimental.embedding
    NT = collections.namedtuple("NT", "x y")
    values = np.arange(20, dtype=np.float32).reshape(10, 2)

    def cases():
        t = ec.TableConfig("t", rows=10, dim=2, combiner="sum")
        dd = collections.defaultdict(list)
        dd["b"], dd["a"] = ec.FeatureConfig(t), ec.FeatureConfig(t, 2)
        yield t, NT(ec.FeatureConfig(t), ec.FeatureConfig(t, 2)), NT(np.array([1, 2]), np.array([[3, 4]]))
        yield t, collections.OrderedDict(b=ec.FeatureConfig(t), a=ec.FeatureConfig(t, 2)), \
            collections.OrderedDict(b=np.array([1, 2]), a=np.array([[3, 4]]))
        features = collections.defaultdict(list)
        features["b"], features["a"] = np.array([1, 2]), np.array([[3, 4]])
        yield t, dd, features
        yield t, {np.int64(0): ec.FeatureConfig(t), np.int64(1): ec.FeatureConfig(t, 2)}, \
            {np.int64(0): np.array([1, 2]), np.int64(1): np.array([[3, 4]])}

    for i, (t, config, features) in enumerate(cases()):
        emb = ec.Embedding(config, opt.SGD(0.1))
        emb.embedding_tables[t].assign(values)
        ec.save(tmp_path / str(i), emb)
        served = ec.serving.open(tmp_path / str(i))
        for out in (emb(features), served(features)):
            assert type(out) is type(features)
            if isinstance(features, dict):
                assert list(out) == list(features)
            flat_out, flat_in = tf.nest.flatten(out), tf.nest.flatten(features)
            for o, x in zip(flat_out, flat_in):  # (1-D: one id per bag; [1, 2]: a sequence of 2)
                np.testing.assert_array_equal(o, values[x])
        # TensorFlow's serving layer packs its outputs the same way (pooled features: it takes no dense sequence)
        tf_table = E.TableConfig(vocabulary_size=10, dim=2, combiner="sum", name="t")
        tf_config = tf.nest.map_structure(lambda f: E.FeatureConfig(tf_table), config)
        theirs = E.TPUEmbeddingForServing(tf_config, E.SGD(0.1))(
            tf.nest.map_structure(lambda x: tf.constant(x.reshape(-1)), features))
        assert type(theirs) is type(features)


def test_weights_structure(rng):
    t_sum, t_mean = _tables()
    emb = ec.Embedding({"a": ec.FeatureConfig(t_sum), "b": ec.FeatureConfig(t_mean)}, opt.SGD(0.1))
    ids_a, off_a, w_a = random_bags(rng, 50, 4, weighted=True)
    ids_b, off_b, w_b = random_bags(rng, 30, 4, weighted=True)
    feats = {"a": ec.Ragged(ids_a, off_a), "b": ec.Ragged(ids_b, off_b)}
    out = emb(feats, {"a": ec.Ragged(w_a, off_a), "b": w_b})
    tables = emb.embedding_tables
    np.testing.assert_array_equal(out["a"], tables[t_sum].lookup(feats["a"], weights=w_a))
    np.testing.assert_array_equal(out["b"], tables[t_mean].lookup(feats["b"], weights=w_b))
    with pytest.raises(ValueError):
        emb(feats, {"a": w_a})
    with pytest.raises(ValueError):
        emb(feats, [w_a, w_b])


def test_structure_mismatch():
    t_sum, t_mean = _tables()
    emb = ec.Embedding({"a": ec.FeatureConfig(t_sum), "b": [ec.FeatureConfig(t_mean), ec.FeatureConfig(t_sum)]},
                       opt.SGD(0.1))
    good = {"a": np.array([1, 2]), "b": [np.array([3]), np.array([4])]}
    emb(good)
    for bad in ({"a": np.array([1])},
                {"a": np.array([1]), "b": [np.array([3]), np.array([4])], "c": np.array([1])},
                {"a": np.array([1]), "b": [np.array([3])]},
                {"a": np.array([1]), "b": np.array([3, 4])},
                [np.array([1]), [np.array([3]), np.array([4])]]):
        with pytest.raises(ValueError):
            emb(bad)
    grads = {"a": np.zeros((2, 4), np.float32), "b": [np.zeros((1, 6), np.float32), np.zeros((1, 4), np.float32)]}
    tables = list(emb.embedding_tables.values())
    snaps = [snapshot(t) for t in tables]
    for bad in ({"a": grads["a"]}, {"a": grads["a"], "b": grads["b"][:1]}, [grads["a"], grads["b"]],
                {"a": grads["a"], "b": tuple(grads["b"]) + (grads["a"],)}):
        with pytest.raises(ValueError):
            emb.apply_gradients(bad)
    for t, s in zip(tables, snaps):
        assert_unchanged(t, s)
    emb.apply_gradients(grads)
    assert all(t.step == 1 for t in tables)


def test_unsortable_feature_keys():
    """Flattening sorts dict keys (as tf.nest does): keys that do not sort are
    a TypeError that names them."""
    t = ec.TableConfig("t", rows=5, dim=2)
    with pytest.raises(TypeError, match=r"dict keys must be sortable .* got keys \[1, 's'\]"):
        ec.Embedding({1: ec.FeatureConfig(t), "s": ec.FeatureConfig(t)}, opt.SGD(0.1))
    emb = ec.Embedding({"a": {"b": ec.FeatureConfig(t)}}, opt.SGD(0.1))
    with pytest.raises(ValueError, match="keys at a do not match"):
        emb({"a": {1: np.array([1]), "b": np.array([1])}})


@pytest.mark.parametrize("bad_key", ["a", "m", "z"])
def test_wrong_grad_shape_changes_nothing(rng, bad_key):
    """A bad gradient for any feature, including one for a table applied
    later, raises ValueError before any table changes."""
    tabs = {k: ec.TableConfig(rows=20, dim=3, combiner="mean") for k in ("a", "m", "z")}
    emb = ec.Embedding({k: ec.FeatureConfig(t) for k, t in tabs.items()},
                       opt.Adam(learning_rate=0.1, lazy_adam=False))
    emb({k: rng.integers(0, 20, size=(4, 2)) for k in tabs})
    good = {k: np.ones((4, 3), np.float32) for k in tabs}
    emb.apply_gradients(good)  # slots become non-zero
    tables = emb.embedding_tables
    snaps = {k: snapshot(tables[t]) for k, t in tabs.items()}
    for bad_shape in ((4, 2), (3, 3), (4, 3, 1), (12,)):
        grads = dict(good)
        grads[bad_key] = np.ones(bad_shape, np.float32)
        with pytest.raises(ValueError):
            emb.apply_gradients(grads)
        for k, t in tabs.items():
            assert_unchanged(tables[t], snaps[k])
    grads = dict(good)
    grads[bad_key] = "not an array"
    with pytest.raises((TypeError, ValueError)):
        emb.apply_gradients(grads)
    for k, t in tabs.items():
        assert_unchanged(tables[t], snaps[k])


def test_apply_gradients_before_lookup():
    emb = ec.Embedding([ec.FeatureConfig(ec.TableConfig(rows=3, dim=2))], opt.SGD(0.1))
    with pytest.raises(ValueError):
        emb.apply_gradients([np.zeros((1, 2), np.float32)])


def test_the_step_takes_the_last_lookup_of_any_thread():
    # Frameworks run a lookup and its step on different threads (tf.numpy_function in a tf.function, PyTorch's
    # backward on a device thread): the step takes the embedding's last lookup, whichever thread made it.
    cfg = ec.TableConfig("t", rows=10, dim=2, initializer=ec.initializers.Zeros())
    emb = ec.Embedding({"f": ec.FeatureConfig(cfg)}, optimizer=ec.optimizers.SGD(1.0))
    out = emb({"f": np.array([3])})
    t = threading.Thread(target=emb.apply_gradients, args=({"f": np.ones_like(out["f"])},))
    t.start()
    t.join(60)
    np.testing.assert_array_equal(emb.embedding_tables[cfg].to_numpy()[3], [-1, -1])


def test_no_optimizer_anywhere():
    t = ec.TableConfig(rows=3, dim=2)
    emb = ec.Embedding([ec.FeatureConfig(t)])
    emb([np.array([1])])
    s = snapshot(emb.embedding_tables[t])
    with pytest.raises(ValueError):
        emb.apply_gradients([np.zeros((1, 2), np.float32)])
    assert_unchanged(emb.embedding_tables[t], s)


def test_bad_feature_configs():
    with pytest.raises(ValueError):
        ec.Embedding({})
    with pytest.raises(TypeError):
        ec.Embedding({"a": ec.TableConfig(rows=3, dim=2)})
    with pytest.raises(TypeError):
        ec.Embedding([ec.FeatureConfig(ec.TableConfig(rows=3, dim=2))], optimizer="sgd")
    with pytest.raises(TypeError):
        ec.FeatureConfig("table")
    with pytest.raises(ValueError):
        ec.FeatureConfig(ec.TableConfig(rows=3, dim=2), max_sequence_length=-1)


def test_sequence_feature_with_dense_and_sparse_inputs(rng):
    t = ec.TableConfig(rows=40, dim=5, initializer=init.Uniform(-1, 1, seed=3))
    emb = ec.Embedding({"d": ec.FeatureConfig(t, max_sequence_length=2),
                        "s": ec.FeatureConfig(t, max_sequence_length=4)}, opt.Adagrad(0.1))
    dense = rng.integers(0, 40, size=(3, 3))
    indices = np.array([[0, 1], [0, 3], [2, 0], [2, 0]], np.int64)
    sp = ec.Sparse(indices, np.array([1, 2, 3, 4]), [3, 5])
    table = emb.embedding_tables[t]
    tref = ref.TableRef(table.to_numpy(), _ref_opt())
    out = emb({"d": dense, "s": sp})
    assert out["d"].shape == (3, 2, 5) and out["s"].shape == (3, 4, 5)
    np.testing.assert_allclose(out["d"], tref.values[dense[:, :2]], rtol=1e-7)
    np.testing.assert_allclose(out["s"], ref.sequence_sparse(tref.values, indices[:, 0], indices[:, 1],
                                                             [1, 2, 3, 4], None, 3, 4), rtol=1e-6)
    grads = {k: rng.normal(size=v.shape).astype(np.float32) for k, v in out.items()}
    emb.apply_gradients(grads)
    rg = tref.row_grads().add_padded(dense.ravel(), np.arange(0, 10, 3), None, 2, grads["d"])
    rg.add_sparse_sequence(indices[:, 0], indices[:, 1], [1, 2, 3, 4], None, 4, grads["s"])
    tref.apply(rg)
    assert_close(table.to_numpy(), tref.values)
    assert_close(table.slots()["accumulators"], tref.slots["accumulators"])


@pytest.mark.parametrize("name", [123, 1.5, ("x",), b"abc"])
def test_a_feature_name_that_is_not_a_str_is_refused(name):
    """As TableConfig's: a checkpoint records the name, and serving (and
    the C API) read a string; such a save was not served."""
    t = ec.TableConfig("t", rows=10, dim=2)
    with pytest.raises(TypeError, match=r"FeatureConfig: name must be a str or None, got"):
        ec.FeatureConfig(t, name=name)


def test_features_whose_paths_are_the_same_are_refused_unless_named():
    """The key 'a/b' and the key 'b' under 'a' make one path: two features
    were saved under one name, and the C API's find_feature reached only
    the first. Refused naming the path; unique FeatureConfig names do."""
    t1, t2 = ec.TableConfig("t1", rows=4, dim=2), ec.TableConfig("t2", rows=4, dim=2)
    with pytest.raises(ValueError, match=r"two features have the path 'a/b' \(a key with '/' in it names the same "
                                         r"path as nested keys\)"):
        ec.Embedding({"a/b": ec.FeatureConfig(t1), "a": {"b": ec.FeatureConfig(t2)}})
    emb = ec.Embedding({"a/b": ec.FeatureConfig(t1), "a": {"b": ec.FeatureConfig(t2, name="ab2")}})
    assert sorted(emb._feature_names) == ["a/b", "ab2"]


def test_repr_names_features_tables_and_optimizer():
    """It was object.__repr__ ("<... object at 0x...>")."""
    fc = {"u": ec.FeatureConfig(ec.TableConfig("user", rows=4, dim=2)),
          "h": ec.FeatureConfig(ec.TableConfig("item", rows=8, dim=2), max_sequence_length=2)}
    assert repr(ec.Embedding(fc)) == "Embedding(features=['h', 'u'], tables=['item', 'user'], optimizer=None)"
    sharded = ec.distributed.run_local(2, lambda w: repr(ec.Embedding(fc, world=w, sharding="row_wise")))
    assert sharded[1].startswith("ShardedEmbedding(features=['h', 'u'], tables=['item', 'user'], optimizer=None, "
                                 "world=<LocalComm backend='local' rank=1 size=2>")


def test_max_sequence_length_must_fit_int64():
    t = ec.TableConfig("t", rows=10, dim=2)
    with pytest.raises(ValueError, match=r"max_sequence_length must be < 2\*\*63, got 9223372036854775808"):
        ec.FeatureConfig(t, max_sequence_length=2**63)
    assert ec.FeatureConfig(t, max_sequence_length=2**63 - 1).max_sequence_length == 2**63 - 1


def test_signature_shows_init_s_parameters():
    """inspect.signature / help() of ec.Embedding showed the __new__ that
    picks the sharded class: feature_config=None, though it is required."""
    import inspect

    params = inspect.signature(ec.Embedding).parameters
    assert params["feature_config"].default is inspect.Parameter.empty
    assert list(params)[:2] == ["feature_config", "optimizer"] and "self" not in params
    emb = ec.Embedding({"f": ec.FeatureConfig(ec.TableConfig("t", 5, 2))})
    assert list(inspect.signature(emb).parameters) == ["features", "weights"]  # an instance's own: its call's
