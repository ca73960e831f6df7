"""Pickle and copy.deepcopy of host tables and embeddings: new native tables
with the same config, values (bit for bit, in every storage dtype), slots and
step, which then train exactly as the original would; a snapshot read as one
while another thread steps; the refusals (a sharded Embedding here, a GPU
table in test_cuda.py)."""
from __future__ import annotations

import copy
import os
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


@pytest.mark.parametrize("how", COPIES)
def test_a_table_whose_training_diverged_copies_as_it_is(how, tmp_path):
    # A gradient of 1e20 leaves Adagrad's values finite but its accumulators infinite; a NaN gradient makes
    # FTRL's weights NaN. The copy holds the same bits; ec.save refuses the copy as it refuses the original.
    a = ec.Table(name="a", rows=4, dim=2, optimizer=ec.optimizers.Adagrad(0.1))
    a.apply_gradients(np.array([1]), None, np.full((1, 2), 1e20, np.float32))
    f = ec.Table(name="f", rows=4, dim=2, optimizer=ec.optimizers.FTRL(0.1))
    f.apply_gradients(np.array([2]), None, np.full((1, 2), np.nan, np.float32))
    assert np.isinf(a.slots()["accumulators"][1]).all() and np.isnan(f.values()[2]).all()
    for t in (a, f):
        u = COPIES[how](t)
        assert np.array_equal(_bits(u), _bits(t))
        for name, v in t.slots().items():
            assert np.array_equal(u.slots()[name].view(np.uint32), v.view(np.uint32))
        with pytest.raises(ValueError, match="not finite|hold (inf|nan)"):
            ec.save(tmp_path / f"{t.name}_{how}", u)


def _resident_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads the resident size from /proc (Linux)")
@pytest.mark.parametrize("how", COPIES)
def test_a_copy_of_a_zeros_table_takes_memory_only_for_its_written_rows(how):
    # 256 MiB of Zeros, one row written: a copy writes only the blocks that differ from its own zeros.
    t = ec.Table(name="z", rows=1 << 20, dim=64, initializer=ec.initializers.Zeros())
    t.assign(np.ones((1, 64), np.float32), 12345)
    before = _resident_mib()
    u = COPIES[how](t)
    grown = _resident_mib() - before
    assert grown < 64, f"a copy of a 256 MiB Zeros table with one row written grew the process by {grown:.0f} MiB"
    np.testing.assert_array_equal(u.to_numpy(12344, 3), t.to_numpy(12344, 3))
    assert u.values()[: 12345].max() == 0 and u.values()[12346:].max() == 0


def test_a_copy_taken_beside_set_optimizer_is_of_one_optimizer_or_the_other():
    # set_optimizer starts the step count at 0 again: a copy whose config came from one side of it and whose
    # step from the other (SGD's step 3 under Adagrad) would be a state the table never had.
    for _ in range(20):
        t = ec.Table(name="t", rows=64, dim=4, optimizer=ec.optimizers.SGD(0.1))
        for k in range(3):
            _step(t, k)
        setter = threading.Thread(target=t.set_optimizer, args=(ec.optimizers.Adagrad(0.1),))
        setter.start()
        copies = [copy.deepcopy(t) for _ in range(30)]
        setter.join()
        for u in copies:
            kind = type(u.optimizer).__name__
            assert (kind, u.step) in {("SGD", 3), ("Adagrad", 0)}, (kind, u.step)
            assert u.slot_names == (("accumulators",) if kind == "Adagrad" else ())
