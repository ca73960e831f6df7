"""Pickle and copy.deepcopy of host tables and embeddings: new native tables
with the same config, values (bit for bit, in every storage dtype), slots and
step, which then train exactly as the original would; a snapshot read as one
while another thread steps; the refusals (a sharded Embedding here, a GPU
table in test_cuda.py)."""
from __future__ import annotations

import copy
import pickle
import threading

import numpy as np
import pytest

import embedcore as ec
from embedcore import distributed as dist

OPTIMIZERS = {
    "none": None,
    "sgd": ec.optimizers.SGD(0.1),
    "adagrad": ec.optimizers.Adagrad(0.1),
    "adam": ec.optimizers.Adam(0.01),
    "ftrl": ec.optimizers.FTRL(0.1),
    "rowwise_adagrad": ec.optimizers.RowWiseAdagrad(0.1),
}
COPIES = {"pickle": lambda x: pickle.loads(pickle.dumps(x)), "deepcopy": copy.deepcopy}


def _bits(table):
    return np.asarray(table.values()).view(np.uint8).copy()


def _step(table, seed):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, table.rows, 12)
    table.apply_gradients(ids, np.array([0, 5, 5, 12]), rng.standard_normal((3, table.dim)).astype(np.float32))


@pytest.mark.parametrize("how", COPIES)
@pytest.mark.parametrize("opt", OPTIMIZERS)
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_a_copied_table_holds_the_same_state_and_trains_as_the_original(dtype, opt, how):
    t = ec.Table(name="t", rows=40, dim=6, dtype=dtype, optimizer=OPTIMIZERS[opt], combiner="mean")
    if t.optimizer is not None:
        _step(t, 0)
        _step(t, 1)
    u = COPIES[how](t)
    assert type(u) is ec.Table and u._native is not t._native
    assert repr(u.config) == repr(t.config) and u.step == t.step and u.slot_names == t.slot_names
    assert np.array_equal(_bits(u), _bits(t))
    for name, v in t.slots().items():
        assert np.array_equal(u.slots()[name], v)
    ids = np.array([3, 9, 9, 39])
    np.testing.assert_array_equal(u.lookup(ids, np.array([0, 2, 4])), t.lookup(ids, np.array([0, 2, 4])))
    u.reset_values()  # the config's initializer came along: the values the original was built with
    np.testing.assert_array_equal(u.values(), ec.Table(t.config).values())
    if t.optimizer is None:
        return
    u = COPIES[how](t)
    _step(t, 2)
    assert not np.array_equal(_bits(u), _bits(t))  # the copy is not the original's memory
    _step(u, 2)
    assert np.array_equal(_bits(u), _bits(t)) and u.step == t.step
    for name, v in t.slots().items():
        assert np.array_equal(u.slots()[name], v)


def test_a_table_set_optimizer_and_padding_idx_come_along():
    t = ec.Table(name="t", rows=8, dim=2)
    t.set_optimizer(ec.optimizers.Adagrad(0.5))
    t._padding_idx = 3  # (set by the PyTorch adapter's modules; checkpoints record it)
    _step(t, 0)
    u = pickle.loads(pickle.dumps(t))
    assert isinstance(u.optimizer, ec.optimizers.Adagrad) and u.optimizer.learning_rate == 0.5
    assert u._padding_idx == 3 and u.slot_names == ("accumulators",)
    np.testing.assert_array_equal(u.slots()["accumulators"], t.slots()["accumulators"])
    # the copy is a table of its own: set_optimizer on a copy.copy of the original does not reach it
    assert u._native.optimizer_version == 0


@pytest.mark.parametrize("opt", ["sgd", "adagrad"])
def test_a_snapshot_is_read_as_one_while_another_thread_steps(opt):
    # Gradient 1 on row 0 of a zeros table, n steps: SGD at rate 1 leaves -n there, exactly; Adagrad's accumulator
    # holds 1 + n, exactly. A copy whose values or slots came from another step than its step count breaks that.
    optimizer = (ec.optimizers.SGD(1.0) if opt == "sgd" else
                 ec.optimizers.Adagrad(1.0, initial_accumulator_value=1.0))
    t = ec.Table(name="t", rows=1 << 14, dim=16, initializer=ec.initializers.Zeros(), optimizer=optimizer)
    ids = np.zeros(1, np.int64)
    stop = threading.Event()

    def train():
        while not stop.is_set():
            t.apply_gradients(ids, None, np.ones((1, 16), np.float32))

    worker = threading.Thread(target=train, daemon=True)
    worker.start()
    try:
        seen = set()
        for _ in range(60):
            u = copy.deepcopy(t)
            n = u.step
            seen.add(n)
            if opt == "sgd":
                assert np.all(u.values()[0] == -n), (n, u.values()[0, :2])
            else:
                assert np.all(u.slots()["accumulators"][0] == 1 + n), (n, u.slots()["accumulators"][0, :2])
    finally:
        stop.set()
        worker.join()
    assert len(seen) > 1  # (copies of several steps were taken)


@pytest.mark.parametrize("how", COPIES)
def test_a_copied_embedding_keeps_its_features_on_shared_tables_and_trains_as_the_original(how):
    user = ec.TableConfig("user", rows=30, dim=4)
    item = ec.TableConfig("item", rows=20, dim=4)
    emb = ec.Embedding({"u": ec.FeatureConfig(user), "i": ec.FeatureConfig(item),
                        "h": ec.FeatureConfig(item, max_sequence_length=3)}, ec.optimizers.Adam(0.1))
    x = {"u": np.array([1, 2]), "i": np.array([3, 4]), "h": ec.Ragged(np.array([1, 2, 3]), np.array([0, 1, 3]))}
    out = emb(x)
    emb.apply_gradients({k: np.ones_like(v) for k, v in out.items()})
    e = COPIES[how](emb)
    assert e.feature_config["i"].table is e.feature_config["h"].table  # one table still, shared by two features
    assert set(e.embedding_tables) == {e.feature_config["u"].table, e.feature_config["i"].table}
    a, b = emb(x), e(x)
    for k in a:
        np.testing.assert_array_equal(b[k], a[k])
    grads = {k: np.full_like(v, 0.5) for k, v in a.items()}
    emb.apply_gradients(grads)
    e.apply_gradients(grads)
    for cfg, table in emb.embedding_tables.items():
        twin = e.embedding_tables[e.feature_config["u"].table if cfg.name == "user" else e.feature_config["i"].table]
        assert np.array_equal(_bits(twin), _bits(table)) and twin.step == table.step == 2


def test_a_sharded_embedding_refuses_to_pickle_with_what_to_do_instead():
    user = ec.TableConfig("user", rows=30, dim=4)

    def rank_main(world):
        emb = ec.Embedding({"u": ec.FeatureConfig(user)}, ec.optimizers.SGD(0.1), world=world)
        with pytest.raises(TypeError, match=r"sharded Embedding \(world=\) does not pickle.*ec\.save"):
            pickle.dumps(emb)
        with pytest.raises(TypeError, match="does not pickle or deepcopy"):
            copy.deepcopy(emb)
        # its shards are host tables: each pickles as a table of its own block
        (_, shard), = emb.local_shards["user"]
        twin = pickle.loads(pickle.dumps(shard))
        assert twin._placement == shard._placement and np.array_equal(twin.values(), shard.values())
        return True

    assert dist.run_local(2, rank_main) == [True, True]


def test_a_pickled_table_with_values_that_are_not_finite_is_refused_when_loaded():
    t = ec.Table(name="t", rows=4, dim=2, initializer=ec.initializers.Zeros())
    fn, args = t.__reduce__()
    values = np.array(args[4])
    values[2, 1] = np.nan
    with pytest.raises(ValueError, match=r"table 't': values\[2, 1\] = nan is not finite"):
        fn(*args[:4], values, *args[5:])
