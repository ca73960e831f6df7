"""embedcore.distributed with the local backend (ranks as threads).

The spec: for world sizes 1..4, every plan, combiner, weighted and
unweighted, pooled and sequence features, a sharded Embedding's outputs equal
those of an unsharded Embedding run on the concatenation of every rank's bags
(table- and column-wise bit-exact, row-wise within rtol 1e-6); ten training
steps with each optimizer equal the unsharded run (within 1e-5, bit-exact for
table- and column-wise); any table and dim sizes; a rank that fails makes
every rank raise instead of hanging.

Every world runs under a watchdog (``_run``): a hang fails the test instead of
blocking the suite.
"""
from __future__ import annotations

import re
import threading
import time

import os
import tempfile

import numpy as np
import pytest

import embedcore as ec
import embedcore.distributed as ed
import reference as ref
from embedcore.distributed._comm import LocalComm

opt = ec.optimizers
init = ec.initializers

WORLDS = (1, 2, 3, 4)
KINDS = ("table_wise", "row_wise", "column_wise")
COMBINERS = ("sum", "mean", "sqrtn")
HANG_TIMEOUT = 30.0

# Bags per rank: different sizes, and a rank without any bag once there are two.
BATCH_SIZES = {1: [5], 2: [4, 0], 3: [3, 0, 5], 4: [2, 5, 0, 3]}


# ---------------------------------------------------------------------- harness
def _run(world_size, fn, timeout=HANG_TIMEOUT):
    """run_local(world_size, fn) on a watchdog thread: fails the test if the
    world has not finished after `timeout` seconds (a hang)."""
    box = {}

    def target():
        try:
            box["result"] = ed.run_local(world_size, fn)
        except BaseException as e:  # noqa: BLE001 - re-raised below, on the test's thread
            box["error"] = e

    t = threading.Thread(target=target, name="test-run-local", daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        pytest.fail(f"run_local({world_size}, ...) did not finish within {timeout}s: the ranks hang")
    if "error" in box:
        raise box["error"]
    return box["result"]


def _catching(fn):
    """fn(world) that returns its exception instead of raising it (so that the
    test sees what every rank raised)."""

    def wrapped(world):
        try:
            return fn(world)
        except Exception as e:  # noqa: BLE001
            return e

    return wrapped


class Feature:
    """One feature's bags on every rank, in one input form.

    form: "ragged" (CSR), "dense" ([batch, width]) or "sparse" (COO with
    positions < width, entries shuffled). `per_rank[r]` = (ids, offsets,
    weights, positions) in CSR order; `inputs(r)` / `global_inputs()` build the
    input of rank r / of the concatenation of all ranks (rank 0's bags first).
    """

    def __init__(self, rng, rows, form, sizes, weighted, id_dtypes, max_len=5, width=3):
        self.form, self.weighted, self.width = form, weighted, width
        self.sizes = list(sizes)
        self.per_rank = []
        for r, n in enumerate(sizes):
            if form == "dense":
                lengths = np.full(n, width, np.int64)
            else:
                lengths = rng.integers(0, (width if form == "sparse" else max_len) + 1, size=n)
                lengths[::3] = 0  # empty bags
                if n > 1:
                    lengths[1] = max(int(lengths[1]), 1)
            offsets = np.zeros(n + 1, np.int64)
            np.cumsum(lengths, out=offsets[1:])
            nnz = int(offsets[-1])
            ids = rng.integers(0, rows, size=nnz).astype(id_dtypes[r % len(id_dtypes)])
            w = rng.uniform(0.25, 1.5, size=nnz).astype(np.float32) if weighted else None
            positions = None
            if form == "sparse":  # distinct, sorted positions in [0, width) per bag
                positions = np.concatenate(
                    [np.sort(rng.choice(width, size=int(k), replace=False)) for k in lengths] or
                    [np.zeros(0, np.int64)]).astype(np.int64)
            self.per_rank.append((ids, offsets, w, positions))

    def _build(self, ids, offsets, w, positions, n, rng_order):
        if self.form == "ragged":
            x = ec.Ragged(ids, offsets)
            return x, (None if w is None else ec.Ragged(w, offsets))
        if self.form == "dense":
            x = ids.reshape(n, self.width)
            return x, (None if w is None else w.reshape(n, self.width))
        bag = ref.bag_index(offsets)
        indices = np.stack([bag, positions], axis=1).astype(np.int64).reshape(-1, 2)
        order = rng_order(len(ids))  # COO entries in any order
        indices, vals = indices[order], ids[order]
        wv = None if w is None else w[order]
        x = ec.Sparse(indices, vals, np.array([n, self.width], np.int64))
        return x, (None if wv is None else ec.Sparse(indices, wv, np.array([n, self.width], np.int64)))

    def inputs(self, r):
        ids, offsets, w, positions = self.per_rank[r]
        return self._build(ids, offsets, w, positions, self.sizes[r], lambda k: np.arange(k)[::-1])

    def global_csr(self):
        ids = np.concatenate([p[0].astype(np.int64) for p in self.per_rank])
        offsets = [np.zeros(1, np.int64)]
        base = 0
        for p in self.per_rank:
            offsets.append(p[1][1:] + base)
            base += int(p[1][-1])
        offsets = np.concatenate(offsets)
        w = np.concatenate([p[2] for p in self.per_rank]) if self.weighted else None
        positions = np.concatenate([p[3] for p in self.per_rank]) if self.form == "sparse" else None
        return ids, offsets, w, positions

    def global_inputs(self):
        ids, offsets, w, positions = self.global_csr()
        return self._build(ids, offsets, w, positions, sum(self.sizes), lambda k: np.arange(k))

    def row_range(self, r):
        start = sum(self.sizes[:r])
        return slice(start, start + self.sizes[r])


def _rank_inputs(feats, r):
    xs, ws = {}, {}
    for name, f in feats.items():
        xs[name], ws[name] = f.inputs(r)
    return xs, ws


def _global_inputs(feats):
    xs, ws = {}, {}
    for name, f in feats.items():
        xs[name], ws[name] = f.global_inputs()
    return xs, ws


def _is_pooled(fc):
    return fc.max_sequence_length == 0


def _exact(plan, fc):
    """Whether the sharded output of feature config `fc` must be bit-exact:
    always but for pooled features of row-wise tables (partial sums)."""
    return not (_is_pooled(fc) and plan[fc.table.name].kind == "row_wise")


def _compare(actual, expected, exact, what, rtol=1e-6, atol=1e-6):
    assert actual.dtype == np.float32, what
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    if exact:
        if not np.array_equal(actual, expected):
            diff = np.argwhere(actual != expected)[0]
            raise AssertionError(f"{what}: not bit-exact; first difference at {tuple(diff)}: "
                                 f"{actual[tuple(diff)]!r} != {expected[tuple(diff)]!r}")
    else:
        np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol, err_msg=what)


def _shard_state(emb):
    """This rank's shards: name -> [(Shard, values, slots, step)], copied."""
    return {name: [(s, t.to_numpy(), {k: np.array(v, copy=True) for k, v in t.slots().items()}, t.step)
                   for s, t in shards]
            for name, shards in emb.local_shards.items()}


def _check_shards(states, plan, tables, exact_kinds=("table_wise", "column_wise"), tol=1e-5, what=""):
    """Every rank's shards against the blocks of the unsharded tables (by
    name), and the plan's shards covered exactly once by the ranks' shards."""
    seen = {name: [] for name in plan.tables}
    for r, state in enumerate(states):
        for name, shards in state.items():
            full = tables[name]
            values = full.to_numpy()
            slots = {k: np.asarray(v) for k, v in full.slots().items()}
            exact = plan[name].kind in exact_kinds
            for s, v, sl, step in shards:
                assert s.rank == r, f"{what} rank {r} holds a shard placed on rank {s.rank}"
                seen[name].append(s)
                block = (slice(s.row_start, s.row_start + s.rows), slice(s.col_start, s.col_start + s.cols))
                assert v.shape == (s.rows, s.cols)
                where = f"{what} table {name} shard {s}"
                _compare(v, values[block], exact, f"{where} values", rtol=tol, atol=tol)
                assert sorted(sl) == sorted(slots), where
                for k in slots:
                    _compare(np.asarray(sl[k], np.float32), slots[k][block], exact, f"{where} slot {k}",
                             rtol=tol, atol=tol)
                assert step == full.step, f"{where}: step {step}, unsharded {full.step}"
    for name, ts in plan.tables.items():
        assert sorted(seen[name]) == sorted(ts.shards), f"{what} table {name}: ranks hold {seen[name]}"
        cover = np.zeros((ts.rows, ts.dim), np.int64)
        for s in ts.shards:
            assert s.rows > 0 and s.cols > 0, f"table {name}: empty shard {s}"
            cover[s.row_start:s.row_start + s.rows, s.col_start:s.col_start + s.cols] += 1
        assert (cover == 1).all(), f"table {name}: the shards do not cover every element exactly once"


# ---------------------------------------------------------------------- configs
def _lookup_setup(rng, W, combiner, weighted, dtype="float32", id_dtypes=(np.int64,)):
    """Tables with rows and dims not divisible by 2, 3 or 4, tables smaller
    than the world, features sharing tables, pooled and sequence features in
    every input form."""
    def table(name, rows, dim, seed):
        return ec.TableConfig(name, rows, dim, dtype=dtype, combiner=combiner,
                              initializer=init.Uniform(-1.0, 1.0, seed=seed))

    A, B, C, D = table("A", 37, 5, 1), table("B", 2, 3, 2), table("C", 1, 1, 3), table("D", 11, 7, 4)
    config = {
        "a_ragged": ec.FeatureConfig(A),
        "a_dense": ec.FeatureConfig(A),
        "b_sparse": ec.FeatureConfig(B),
        "c_ragged": ec.FeatureConfig(C),
        "d_ragged": ec.FeatureConfig(D),
        "a_seq_ragged": ec.FeatureConfig(A, max_sequence_length=3),  # bags up to 5: truncated
        "b_seq_dense": ec.FeatureConfig(B, max_sequence_length=4),  # width 2: padded
        "d_seq_sparse": ec.FeatureConfig(D, max_sequence_length=2),  # positions up to 4: truncated
        "c_seq_dense": ec.FeatureConfig(C, max_sequence_length=1),  # width 3: truncated
    }
    sizes = BATCH_SIZES[W]
    feats = {
        "a_ragged": Feature(rng, 37, "ragged", sizes, weighted, id_dtypes, max_len=5),
        "a_dense": Feature(rng, 37, "dense", sizes, weighted, id_dtypes, width=3),
        "b_sparse": Feature(rng, 2, "sparse", sizes, weighted, id_dtypes, width=4),
        "c_ragged": Feature(rng, 1, "ragged", sizes, weighted, id_dtypes, max_len=3),
        "d_ragged": Feature(rng, 11, "ragged", sizes, weighted, id_dtypes, max_len=6),
        "a_seq_ragged": Feature(rng, 37, "ragged", sizes, weighted, id_dtypes, max_len=5),
        "b_seq_dense": Feature(rng, 2, "dense", sizes, weighted, id_dtypes, width=2),
        "d_seq_sparse": Feature(rng, 11, "sparse", sizes, weighted, id_dtypes, width=5),
        "c_seq_dense": Feature(rng, 1, "dense", sizes, weighted, id_dtypes, width=3),
    }
    return config, feats


PLANS = KINDS + ("auto", "mixed")


def _resolve_sharding(plan, config):
    if plan != "mixed":
        return plan
    tables = {fc.table.name: fc.table for fc in config.values()}
    return {"A": "row_wise", tables["B"]: "column_wise", "D": "table_wise"}


def _lookup_and_compare(W, plan, config, feats, optimizer=None):
    sharding = _resolve_sharding(plan, config)

    def fn(world):
        emb = ec.Embedding(config, optimizer, world=world, sharding=sharding)
        xs, ws = _rank_inputs(feats, world.rank)
        out = emb(xs, ws)
        again = emb.embedding_lookup(xs, ws)  # (TensorFlow's name: the same lookup)
        for name in out:
            np.testing.assert_array_equal(again[name], out[name])
        return out, emb.plan, _shard_state(emb)

    results = _run(W, fn)
    unsharded = ec.Embedding(config, optimizer)
    xs, ws = _global_inputs(feats)
    expected = unsharded(xs, ws)
    for name, again in unsharded.embedding_lookup(xs, ws).items():
        np.testing.assert_array_equal(again, expected[name])
    plan = results[0][1]
    for r, (out, p, _) in enumerate(results):
        assert p.describe() == plan.describe(), "every rank must build the same plan"
        assert set(out) == set(config)
        for name, fc in config.items():
            _compare(out[name], expected[name][feats[name].row_range(r)], _exact(plan, fc), f"rank {r} {name}")
    tables = {t.name: t for t in unsharded.embedding_tables.values()}
    _check_shards([s for _, _, s in results], plan, tables, exact_kinds=KINDS, what="initial")
    return expected, unsharded, plan


# ---------------------------------------------------------------------- 1. lookups
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("combiner", COMBINERS)
@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("W", WORLDS)
def test_lookup_equals_unsharded(rng, W, plan, combiner, weighted):
    config, feats = _lookup_setup(rng, W, combiner, weighted)
    expected, unsharded, p = _lookup_and_compare(W, plan, config, feats)
    if plan in KINDS:
        assert all(t.kind == plan for t in p.tables.values())
    if plan == "mixed":
        assert (p["A"].kind, p["B"].kind, p["D"].kind) == ("row_wise", "column_wise", "table_wise")
    # The unsharded reference itself against the NumPy reference (so that the
    # comparison above cannot pass with both wrong the same way), and not trivial.
    tables = {t.name: t.to_numpy() for t in unsharded.embedding_tables.values()}
    ids, offsets, w, _ = feats["d_ragged"].global_csr()
    e, _ = ref.pooled(tables["D"], ids, offsets, w, combiner)
    assert np.abs(expected["d_ragged"] - e).max(initial=0) <= 1e-5
    ids, offsets, w, _ = feats["a_seq_ragged"].global_csr()
    np.testing.assert_allclose(expected["a_seq_ragged"], ref.sequence_padded(tables["A"], ids, offsets, w, 3),
                               rtol=1e-6, atol=1e-7)
    assert np.abs(expected["a_ragged"]).max() > 0.01


@pytest.mark.parametrize("plan", KINDS)
@pytest.mark.parametrize("ids", ["int32", "int64", "mixed"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("W", [2, 3])
def test_lookup_low_precision_tables_and_id_dtypes(rng, W, dtype, ids, plan):
    id_dtypes = {"int32": (np.int32,), "int64": (np.int64,), "mixed": (np.int32, np.int64)}[ids]
    config, feats = _lookup_setup(rng, W, "mean", True, dtype=dtype, id_dtypes=id_dtypes)
    _lookup_and_compare(W, plan, config, feats)


@pytest.mark.parametrize("plan", PLANS)
def test_lookup_int32_ids_on_every_rank(rng, plan):
    config, feats = _lookup_setup(rng, 4, "sqrtn", False, id_dtypes=(np.int32,))
    for f in feats.values():
        assert all(p[0].dtype == np.int32 for p in f.per_rank)
    _lookup_and_compare(4, plan, config, feats)


@pytest.mark.parametrize("plan", KINDS)
@pytest.mark.parametrize("W", [2, 4])
def test_lookup_with_no_bags_anywhere(rng, W, plan):
    """Every rank with a batch of zero bags: empty outputs of the right shapes."""
    config, feats = _lookup_setup(rng, W, "mean", True)
    feats = {name: Feature(rng, 1, f.form, [0] * W, True, (np.int64,), width=f.width) for name, f in feats.items()}
    expected, _, _ = _lookup_and_compare(W, plan, config, feats)
    assert expected["a_ragged"].shape == (0, 5) and expected["a_seq_ragged"].shape == (0, 3, 5)


@pytest.mark.parametrize("plan", KINDS)
@pytest.mark.parametrize("W", [2, 3])
def test_lookup_only_empty_bags(rng, W, plan):
    """Bags that are all empty: zeros, for every combiner (no division by zero)."""
    for combiner in COMBINERS:
        t = ec.TableConfig("t", 5, 3, combiner=combiner, initializer=init.Uniform(-1, 1, seed=5))
        config = {"p": ec.FeatureConfig(t), "s": ec.FeatureConfig(t, max_sequence_length=2)}

        def fn(world):
            emb = ec.Embedding(config, world=world, sharding=plan)
            empty = ec.Ragged(np.zeros(0, np.int64), np.zeros(4, np.int64))
            return emb({"p": empty, "s": empty})

        for out in _run(W, fn):
            assert out["p"].shape == (3, 3) and out["s"].shape == (3, 2, 3)
            assert not out["p"].any() and not out["s"].any()


@pytest.mark.parametrize("combiner", COMBINERS)
@pytest.mark.parametrize("plan", PLANS)
def test_lookup_weights_on_some_ranks_only(rng, plan, combiner):
    """Rank 1 passes no weights: as if its weights were ones."""
    W = 3
    config, feats = _lookup_setup(rng, W, combiner, True)
    sharding = _resolve_sharding(plan, config)

    def fn(world):
        emb = ec.Embedding(config, world=world, sharding=sharding)
        xs, ws = _rank_inputs(feats, world.rank)
        return emb(xs, None if world.rank == 1 else ws), emb.plan

    results = _run(W, fn)
    for f in feats.values():
        ids, offsets, w, positions = f.per_rank[1]
        f.per_rank[1] = (ids, offsets, np.ones_like(w), positions)
    xs, ws = _global_inputs(feats)
    expected = ec.Embedding(config)(xs, ws)
    for r, (out, p) in enumerate(results):
        for name, fc in config.items():
            _compare(out[name], expected[name][feats[name].row_range(r)], _exact(p, fc), f"rank {r} {name}")


@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("W", [2, 3])
def test_lookup_nested_feature_structure(rng, W, plan):
    """Nested lists / tuples / dicts of features come back in the same structure."""
    config, feats = _lookup_setup(rng, W, "sum", True)
    nested_config = [config["a_ragged"], (config["b_sparse"], {"z": config["d_seq_sparse"],
                                                               "y": config["c_ragged"]})]
    order = ["a_ragged", "b_sparse", "d_seq_sparse", "c_ragged"]

    def nest(d):
        return [d["a_ragged"], (d["b_sparse"], {"z": d["d_seq_sparse"], "y": d["c_ragged"]})]

    sharding = _resolve_sharding(plan, config)

    def fn(world):
        emb = ec.Embedding(nested_config, world=world, sharding=sharding)
        xs, ws = _rank_inputs({k: feats[k] for k in order}, world.rank)
        return emb(nest(xs), nest(ws)), emb.plan

    results = _run(W, fn)
    xs, ws = _global_inputs({k: feats[k] for k in order})
    expected = ec.Embedding(nested_config)(nest(xs), nest(ws))
    for r, (out, p) in enumerate(results):
        assert isinstance(out, list) and isinstance(out[1], tuple) and isinstance(out[1][1], dict)
        flat_out = {"a_ragged": out[0], "b_sparse": out[1][0], "d_seq_sparse": out[1][1]["z"],
                    "c_ragged": out[1][1]["y"]}
        flat_exp = {"a_ragged": expected[0], "b_sparse": expected[1][0], "d_seq_sparse": expected[1][1]["z"],
                    "c_ragged": expected[1][1]["y"]}
        for name in order:
            _compare(flat_out[name], flat_exp[name][feats[name].row_range(r)], _exact(p, config[name]),
                     f"rank {r} {name}")


# ---------------------------------------------------------------------- 2. training
def _optimizers():
    return {
        "sgd": lambda: opt.SGD(learning_rate=lambda step: 0.5 / (1 + step)),
        "adagrad": lambda: opt.Adagrad(learning_rate=0.2, clipvalue=0.8, weight_decay_factor=0.01),
        "adam_lazy": lambda: opt.Adam(learning_rate=0.05, lazy_adam=True),
        "adam_dense": lambda: opt.Adam(learning_rate=0.05, lazy_adam=False, bias_correction=True,
                                       sum_inside_sqrt=False, epsilon=1e-8),
        "ftrl": lambda: opt.FTRL(learning_rate=0.2, l1_regularization_strength=0.01,
                                 l2_regularization_strength=0.02, beta=0.1),
    }


STEPS = 10


def _training_setup(dtype="float32"):
    A = ec.TableConfig("A", 23, 5, dtype=dtype, combiner="mean", initializer=init.Uniform(-1, 1, seed=11))
    B = ec.TableConfig("B", 3, 2, dtype=dtype, combiner="sqrtn", initializer=init.Uniform(-1, 1, seed=12))
    C = ec.TableConfig("C", 9, 7, dtype=dtype, combiner="sum", initializer=init.Uniform(-1, 1, seed=13))
    return {
        "a": ec.FeatureConfig(A),
        "a_seq": ec.FeatureConfig(A, max_sequence_length=3),
        "b": ec.FeatureConfig(B),
        "c": ec.FeatureConfig(C),
        "c_seq": ec.FeatureConfig(C, max_sequence_length=2),
    }


def _training_data(rng, W, steps):
    """Per step: the features (weighted pooled a, unweighted dense b, ...) and
    per-rank gradients of the outputs, drawn independently of any lookup."""
    data = []
    for step in range(steps):
        sizes = list(BATCH_SIZES[W])
        sizes = sizes[step % W:] + sizes[:step % W]  # which rank has no bags changes each step
        feats = {
            "a": Feature(rng, 23, "ragged", sizes, True, (np.int64, np.int32), max_len=5),
            "a_seq": Feature(rng, 23, "ragged", sizes, False, (np.int64,), max_len=4),
            "b": Feature(rng, 3, "dense", sizes, False, (np.int32,), width=2),
            "c": Feature(rng, 9, "sparse", sizes, True, (np.int64,), width=3),
            "c_seq": Feature(rng, 9, "sparse", sizes, True, (np.int64,), width=3),
        }
        dims = {"a": (5,), "a_seq": (3, 5), "b": (2,), "c": (7,), "c_seq": (2, 7)}
        grads = [{k: rng.normal(size=(sizes[r],) + dims[k]).astype(np.float32) for k in feats} for r in range(W)]
        data.append((feats, grads))
    return data


def _train_and_compare(rng, W, sharding, make_opt, dtype="float32", tol=1e-5):
    config = _training_setup(dtype)
    data = _training_data(rng, W, STEPS)

    def fn(world):
        emb = ec.Embedding(config, make_opt(), world=world, sharding=sharding)
        initial = _shard_state(emb)
        outs = []
        for feats, grads in data:
            xs, ws = _rank_inputs(feats, world.rank)
            outs.append(emb(xs, ws))
            emb.apply_gradients(grads[world.rank])
        return emb.plan, initial, outs, _shard_state(emb)

    results = _run(W, fn)
    plan = results[0][0]
    unsharded = ec.Embedding(config, make_opt())
    tables = {t.name: t for t in unsharded.embedding_tables.values()}
    _check_shards([r[1] for r in results], plan, tables, exact_kinds=KINDS, what="before training:")
    for step, (feats, grads) in enumerate(data):
        xs, ws = _global_inputs(feats)
        expected = unsharded(xs, ws)
        for r in range(W):
            for name, fc in config.items():
                exact = plan[fc.table.name].kind != "row_wise"
                _compare(results[r][2][step][name], expected[name][feats[name].row_range(r)], exact,
                         f"step {step} rank {r} {name}", rtol=tol, atol=tol)
        unsharded.apply_gradients({k: np.concatenate([grads[r][k] for r in range(W)]) for k in config})
    for t in tables.values():
        assert t.step == STEPS
    _check_shards([r[3] for r in results], plan, tables, what=f"after {STEPS} steps:", tol=tol)
    # The run moved the tables (so that the comparison means something).
    for t in ec.Embedding(config, make_opt()).embedding_tables.values():
        assert not np.array_equal(t.to_numpy(), tables[t.name].to_numpy()), t.name
    return plan


@pytest.mark.parametrize("optimizer", list(_optimizers()))
@pytest.mark.parametrize("plan", KINDS + ("auto",))
@pytest.mark.parametrize("W", WORLDS)
def test_training_equals_unsharded(rng, W, plan, optimizer):
    _train_and_compare(rng, W, plan, _optimizers()[optimizer])


@pytest.mark.parametrize("optimizer", ["adagrad", "adam_dense"])
@pytest.mark.parametrize("W", [2, 3])
def test_training_mixed_plan(rng, W, optimizer):
    p = _train_and_compare(rng, W, {"A": "row_wise", "B": "column_wise", "C": "table_wise"},
                           _optimizers()[optimizer])
    assert (p["A"].kind, p["B"].kind, p["C"].kind) == ("row_wise", "column_wise", "table_wise")


@pytest.mark.parametrize("plan", KINDS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_training_low_precision_tables(rng, dtype, plan):
    _train_and_compare(rng, 3, plan, _optimizers()["adagrad"], dtype=dtype)


@pytest.mark.parametrize("plan", ["table_wise", "row_wise", "auto"])
@pytest.mark.parametrize("W", [1, 2, 3])
def test_rowwise_adagrad_training_equals_unsharded(rng, W, plan):
    """Row-wise Adagrad's one accumulator per row shards with its row."""
    _train_and_compare(rng, W, plan, lambda: opt.RowWiseAdagrad(learning_rate=0.2, clipvalue=0.8))


def test_rowwise_adagrad_refuses_column_wise_sharding():
    """The accumulator belongs to the whole row: no rank can hold it for a few columns."""
    config = _training_setup("float32")

    def fn(world):
        return ec.Embedding(config, opt.RowWiseAdagrad(0.1), world=world, sharding={"A": "column_wise"})

    for e in _run(2, _catching(fn)):
        assert isinstance(e, ValueError) and "table 'A'" in str(e) and "column_wise" in str(e), repr(e)
    with pytest.raises(ValueError, match="table 'A'.*RowWiseAdagrad"):
        ed.make_plan([("A", 10, 4, "float32", 0, 1)], 2, "column_wise")
    # The bytes a plan counts: one float per row of a row-wise slot.
    plan = ed.make_plan([("A", 10, 4, "float32", 0, 1), ("B", 10, 4, "float32", 1, 0)], 2, "table_wise")
    assert sorted(plan.bytes_per_rank) == [10 * (4 * 4 + 4), 10 * 4 * 8]
    # A plan built by hand with bytes per element alone, as before row-wise slots.
    same = ed.ShardingPlan(2, list(plan.tables.values()), {"A": 20, "B": 8})
    assert sorted(same.bytes_per_rank) == [10 * 4 * 8, 10 * 4 * 20]


# ---------------------------------------------------------------------- 3. planner
def _plan_of(W, config, sharding, optimizer=None):
    plans = _run(W, lambda world: ec.Embedding(config, optimizer, world=world, sharding=sharding).plan)
    for p in plans[1:]:
        assert p.describe() == plans[0].describe()
    return plans[0]


def _expected_bytes(plan, specs):
    """Bytes of values and slots per rank, from the shards (spec: name -> (dtype bytes, slots))."""
    load = [0] * plan.world_size
    for name, ts in plan.tables.items():
        elem, slots = specs[name]
        for s in ts.shards:
            load[s.rank] += s.rows * s.cols * (elem + 4 * slots)
    return load


@pytest.mark.parametrize("W", WORLDS)
def test_auto_plan_describes_and_balances(W):
    sizes = [(1000, 8), (40, 3), (7, 5), (5, 2), (3, 1), (60, 6), (1, 1)]
    tables = [ec.TableConfig(f"tab{i}", rows, dim, dtype=("float16" if i % 2 else "float32"))
              for i, (rows, dim) in enumerate(sizes)]
    config = {f"f{i}": ec.FeatureConfig(t) for i, t in enumerate(tables)}
    plan = _plan_of(W, config, "auto", opt.Adam(0.1))
    text = plan.describe()
    assert str(plan) == text
    for t in tables:
        kind = plan[t.name].kind
        line = [ln for ln in text.splitlines() if ln.strip().startswith(t.name + " ")]
        assert len(line) == 1, text
        assert kind in line[0] and f"{t.rows} x {t.dim}" in line[0], line[0]
    specs = {t.name: (4 if t.dtype == "float32" else 2, 2) for t in tables}
    assert plan.bytes_per_rank == _expected_bytes(plan, specs)
    total = sum(t.rows * t.dim * (specs[t.name][0] + 8) for t in tables)
    assert sum(plan.bytes_per_rank) == total
    assert ", ".join(f"{b:,}" for b in plan.bytes_per_rank) in text
    if W == 1:
        assert all(ts.kind == "table_wise" for ts in plan.tables.values())
    else:
        # The big table is split over every rank; the small ones go whole.
        assert plan["tab0"].kind == "row_wise" and len(plan["tab0"].shards) == W
        assert all(plan[t.name].kind == "table_wise" for t in tables[1:])
        fair = total / W
        assert max(plan.bytes_per_rank) <= 1.25 * fair, text
    _check_plan_shapes(plan)


def _check_plan_shapes(plan):
    for name, ts in plan.tables.items():
        cover = np.zeros((ts.rows, ts.dim), np.int64)
        for s in ts.shards:
            assert 0 <= s.rank < plan.world_size
            assert s.rows > 0 and s.cols > 0
            cover[s.row_start:s.row_start + s.rows, s.col_start:s.col_start + s.cols] += 1
        assert (cover == 1).all(), name
        ranks = [s.rank for s in ts.shards]
        assert len(set(ranks)) == len(ranks), f"{name}: two shards on one rank"
        if ts.kind == "table_wise":
            assert len(ts.shards) == 1
        elif ts.kind == "row_wise":
            assert len(ts.shards) == min(plan.world_size, ts.rows)
            lengths = [s.rows for s in ts.shards]
            assert max(lengths) - min(lengths) <= 1
        else:
            assert len(ts.shards) == min(plan.world_size, ts.dim)
            widths = [s.cols for s in ts.shards]
            assert max(widths) - min(widths) <= 1


@pytest.mark.parametrize("W", WORLDS)
def test_auto_plan_balances_many_small_tables(W):
    tables = [ec.TableConfig(f"t{i}", 10 + i, 4) for i in range(4 * W + 1)]
    plan = _plan_of(W, {f"f{i}": ec.FeatureConfig(t) for i, t in enumerate(tables)}, "auto", opt.SGD(0.1))
    assert plan.bytes_per_rank == _expected_bytes(plan, {t.name: (4, 0) for t in tables})
    largest = max(t.rows * t.dim * 4 for t in tables)
    assert max(plan.bytes_per_rank) - min(plan.bytes_per_rank) <= largest, plan.describe()
    _check_plan_shapes(plan)


def test_auto_plan_puts_a_table_of_exactly_half_a_fair_share_whole_on_one_rank():
    """The documented boundary: a table that fits within half a rank's fair
    share (its bytes <= fair / 2) goes table_wise; one row more and it is
    split row_wise."""
    # float32, no slots: A is 10 x 4 x 4 = 160 bytes, B 480; fair = 640 / 2 = 320, so A is exactly fair / 2.
    plan = ed.make_plan([("A", 10, 4, "float32", 0, 0), ("B", 30, 4, "float32", 0, 0)], 2, "auto")
    assert (plan["A"].kind, plan["B"].kind) == ("table_wise", "row_wise"), plan.describe()
    # One row more: A is 176 bytes, fair / 2 = 656 / 4 = 164.
    plan = ed.make_plan([("A", 11, 4, "float32", 0, 0), ("B", 30, 4, "float32", 0, 0)], 2, "auto")
    assert (plan["A"].kind, plan["B"].kind) == ("row_wise", "row_wise"), plan.describe()


def test_column_wise_pieces_go_to_the_least_loaded_ranks():
    """Each of a column_wise table's pieces goes on a different rank, the
    least loaded ones (docs/distributed.md): a big table_wise table placed
    first on rank 0 keeps them off rank 0."""
    plan = ed.make_plan([("big", 1000, 8, "float32", 0, 0), ("c", 10, 2, "float32", 0, 0)], 4,
                        {"big": "table_wise", "c": "column_wise"})
    assert [s.rank for s in plan["big"].shards] == [0]
    assert [(s.rank, s.col_start, s.cols) for s in plan["c"].shards] == [(1, 0, 1), (2, 1, 1)], plan.describe()
    assert plan.bytes_per_rank == [32000, 40, 40, 0]
    _check_plan_shapes(plan)


@pytest.mark.parametrize("W", WORLDS)
def test_explicit_plans_any_sizes(W):
    """Rows and dims not divisible by W, and tables smaller than the world."""
    tables = [ec.TableConfig(n, rows, dim) for n, rows, dim in
              [("a", 1, 1), ("b", 2, 3), ("c", 7, 5), ("d", 50, 7), ("e", 3, 4)]]
    config = {t.name: ec.FeatureConfig(t) for t in tables}
    for kind in KINDS:
        plan = _plan_of(W, config, kind, opt.Adagrad(0.1))
        assert all(ts.kind == kind for ts in plan.tables.values())
        assert plan.bytes_per_rank == _expected_bytes(plan, {t.name: (4, 1) for t in tables})
        _check_plan_shapes(plan)
        assert plan["a"].shards[0][1:] == (0, 1, 0, 1)
        assert f"{kind}" in plan.describe()
    # Row-wise: rank r holds rows [r*rows//W, (r+1)*rows//W).
    plan = _plan_of(W, config, "row_wise")
    d = plan["d"]
    assert [(s.rank, s.row_start, s.rows) for s in d.shards] == \
        [(r, r * 50 // W, (r + 1) * 50 // W - r * 50 // W) for r in range(W)]
    # A dict: by name and by TableConfig; the others "auto".
    plan = _plan_of(W, config, {"d": "column_wise", tables[2]: "row_wise", "a": "table_wise"})
    assert (plan["d"].kind, plan["c"].kind, plan["a"].kind) == ("column_wise", "row_wise", "table_wise")
    assert plan["b"].kind in KINDS and plan["e"].kind in KINDS


@pytest.mark.parametrize("tables,world,error,match", [
    ([("a", 10, 4)], 0, ValueError, r"world_size must be in \[1, 1048576\], got 0"),
    ([("a", 10, 4)], 2**21, ValueError, r"world_size must be in \[1, 1048576\], got 2097152"),  # (minutes, GBs)
    ([("a", 10, 4, ["float32"])], 2, ValueError, "table 'a' dtype must be one of"),
    (None, 2, TypeError, "tables must be a list of"),
    ([("a", 10, 4)], "2", TypeError, "world_size must be an int, got '2'"),
    ([("a", 10, 0)], 2, ValueError, "table 'a' dim must be >= 1, got 0"),
    ([("a", -10, 4)], 2, ValueError, "table 'a' rows must be >= 1, got -10"),
    ([("a", 10, 4, "float64")], 2, ValueError, "table 'a' dtype must be one of"),
    ([("a", 10, 4), ("a", 5, 4)], 2, ValueError, "two tables are named 'a'"),
    ([("a",)], 2, TypeError, r"tables\[0\] must be \(name, rows, dim"),
])
def test_make_plan_refuses_bad_arguments_by_name(tables, world, error, match):
    """make_plan is public: a (name, rows, dim) table (its dtype padded with
    0: KeyError), world_size 0 (ZeroDivisionError), negative rows (taken),
    two tables of one name (merged) were not refused by name."""
    with pytest.raises(error, match=match):
        ed.make_plan(tables, world, "column_wise" if tables and len(tables[0]) > 2 and tables[0][2] == 0 else "auto")


def test_make_plan_takes_a_table_of_name_rows_and_dim():
    plan = ed.make_plan([("a", 10, 4)], 2, "row_wise")
    assert [(s.rank, s.row_start, s.rows) for s in plan["a"].shards] == [(0, 0, 5), (1, 5, 5)]


@pytest.mark.parametrize("W", [1, 3])
def test_invalid_plan_names_raise_value_error_naming_the_table(W):
    t1, t2 = ec.TableConfig("users", 10, 2), ec.TableConfig("items", 10, 2)
    config = {"u": ec.FeatureConfig(t1), "i": ec.FeatureConfig(t2)}
    for sharding, needle in [({"items": "diagonal"}, "items"), ({t1: "rows"}, "users"),
                             ({"users": None}, "users")]:
        with pytest.raises(ValueError, match=needle) as info:
            _run(W, lambda world: ec.Embedding(config, world=world, sharding=sharding))
        assert "row_wise" in str(info.value)  # says what is allowed
    with pytest.raises(ValueError, match="users|items"):
        _run(W, lambda world: ec.Embedding(config, world=world, sharding="diagonal"))
    with pytest.raises(ValueError, match="videos"):
        _run(W, lambda world: ec.Embedding(config, world=world, sharding={"videos": "row_wise"}))
    with pytest.raises(ValueError, match="videos"):
        _run(W, lambda world: ec.Embedding(config, world=world, sharding={"users": "row_wise",
                                                                           "videos": "table_wise"}))
    with pytest.raises(TypeError):
        _run(W, lambda world: ec.Embedding(config, world=world, sharding=["row_wise"]))
    with pytest.raises(TypeError):
        ec.Embedding(config, world="not a comm")


def test_sharding_dict_with_an_unknown_table_config_raises_value_error():
    """A TableConfig key that no feature uses is an unknown table, like an
    unknown name: ValueError naming it (not a KeyError from a lookup)."""
    used = ec.TableConfig("users", 10, 2)
    other = ec.TableConfig("videos", 10, 2)
    config = {"u": ec.FeatureConfig(used)}
    with pytest.raises(ValueError, match="videos"):
        _run(2, lambda world: ec.Embedding(config, world=world, sharding={other: "row_wise"}))


@pytest.mark.parametrize("W", [1, 2])
def test_sharding_dict_naming_a_table_twice_or_not_by_name_raises_value_error(W):
    """A table named by its name and by its TableConfig (one of the plans was
    silently dropped), a key that is not a name (a TypeError from sorting the
    unknown names), and an empty plan (it was taken as "auto")."""
    users, items = ec.TableConfig("users", 10, 2), ec.TableConfig("items", 10, 2)
    config = {"u": ec.FeatureConfig(users), "i": ec.FeatureConfig(items)}
    for sharding, needle in [({"users": "row_wise", users: "column_wise"}, "'users' twice"),
                             ({1: "row_wise", "videos": "table_wise"}, r"\['videos', 1\]"),
                             ({("users",): "row_wise"}, "do not exist"),
                             ("", "got ''"), ({"users": ""}, "got ''")]:
        with pytest.raises(ValueError, match=needle):
            _run(W, lambda world: ec.Embedding(config, world=world, sharding=sharding))
    with pytest.raises(ValueError, match=r"\[1\]"):
        ed.make_plan([("users", 10, 2, "float32", 0, 0)], 2, {1: "row_wise"})


# ---------------------------------------------------------------------- 4. errors
def _error_setup(plan_kind):
    t = ec.TableConfig("T", 13, 3, combiner="mean", initializer=init.Uniform(-1, 1, seed=21))
    u = ec.TableConfig("U", 5, 2, combiner="sum", initializer=init.Uniform(-1, 1, seed=22))
    config = {"f": ec.FeatureConfig(t), "g": ec.FeatureConfig(u), "s": ec.FeatureConfig(t, max_sequence_length=2)}
    return config, plan_kind


def _good_batch(rank):
    rng = np.random.default_rng(100 + rank)
    return {"f": rng.integers(0, 13, size=(2 + rank, 3)), "g": rng.integers(0, 5, size=(2 + rank, 2)),
            "s": ec.Ragged(rng.integers(0, 13, size=4), np.array([0, 1, 4]))}


def _good_grads(rank):
    rng = np.random.default_rng(200 + rank)
    return {"f": rng.normal(size=(2 + rank, 3)).astype(np.float32),
            "g": rng.normal(size=(2 + rank, 2)).astype(np.float32),
            "s": rng.normal(size=(2, 2, 3)).astype(np.float32)}


def _snapshot_bytes(emb):
    return {name: [(s, t.to_numpy().tobytes(), {k: np.array(v).tobytes() for k, v in t.slots().items()}, t.step)
                   for s, t in shards] for name, shards in emb.local_shards.items()}


@pytest.mark.parametrize("bad", [13, -1, 10**12], ids=["too_large", "negative", "huge"])
@pytest.mark.parametrize("plan", KINDS)
@pytest.mark.parametrize("W", [2, 3, 4])
def test_bad_id_on_one_rank_raises_everywhere(W, plan, bad):
    config, sharding = _error_setup(plan)
    bad_rank = W - 1

    def fn(world):
        emb = ec.Embedding(config, opt.Adagrad(0.1), world=world, sharding=sharding)
        # A good step first.
        emb(_good_batch(world.rank))
        emb.apply_gradients(_good_grads(world.rank))
        before = _snapshot_bytes(emb)
        batch = _good_batch(world.rank)
        if world.rank == bad_rank:
            batch["f"] = batch["f"].copy()
            batch["f"][1, 2] = bad  # named at its [row, column]
        try:
            emb(batch)
            error = None
        except Exception as e:  # noqa: BLE001
            error = e
        after = _snapshot_bytes(emb)
        # The world still works: a good step.
        out = emb(_good_batch(world.rank))
        emb.apply_gradients(_good_grads(world.rank))
        return error, before == after, out, _shard_state(emb), emb.plan

    results = _run(W, fn)
    for r, (error, unchanged, _, _, _) in enumerate(results):
        assert unchanged, f"rank {r}: a failed lookup changed a table"
        if r == bad_rank:
            assert isinstance(error, IndexError), repr(error)
            msg = str(error)
            assert "'f'" in msg and f"id {bad}" in msg and "index [1, 2]" in msg and "'T'" in msg, msg
        else:
            assert isinstance(error, ed.RankFailedError), repr(error)
            msg = str(error)
            assert f"rank {bad_rank} of {W}" in msg and "IndexError" in msg and f"id {bad}" in msg, msg
    # Two good steps, as if the failed one never happened.
    unsharded = ec.Embedding(config, opt.Adagrad(0.1))
    for _ in range(2):
        glob = _concat_batches([_good_batch(r) for r in range(W)])
        expected = unsharded(glob)
        unsharded.apply_gradients(_concat_grads([_good_grads(r) for r in range(W)]))
    plan_ = results[0][4]
    start = 0
    for r, (_, _, out, _, _) in enumerate(results):
        n = 2 + r
        for name in ("f", "g"):
            _compare(out[name], expected[name][start:start + n], _exact(plan_, config[name]), f"rank {r} {name}")
        _compare(out["s"], expected["s"][2 * r:2 * r + 2], True, f"rank {r} s")
        start += n
    _check_shards([r[3] for r in results], plan_, {t.name: t for t in unsharded.embedding_tables.values()},
                  what="after the failed step:")


def _concat_batches(batches):
    s_ids = np.concatenate([b["s"].values for b in batches])
    s_off = [0]
    for b in batches:
        s_off += list(np.asarray(b["s"].offsets[1:]) + s_off[-1])
    return {"f": np.concatenate([b["f"] for b in batches]), "g": np.concatenate([b["g"] for b in batches]),
            "s": ec.Ragged(s_ids, np.array(s_off))}


def _concat_grads(grads):
    return {k: np.concatenate([g[k] for g in grads]) for k in grads[0]}


def test_init_mpi_checks_its_arguments_before_mpi_starts(monkeypatch):
    import sys
    import types

    class Unloadable(types.ModuleType):
        def __getattr__(self, name):
            raise RuntimeError("cannot load MPI library")

    monkeypatch.setitem(sys.modules, "mpi4py", Unloadable("mpi4py"))
    monkeypatch.delitem(sys.modules, "mpi4py.MPI", raising=False)
    with pytest.raises(TypeError, match=r"init\('mpi'\): unexpected arguments \['foo'\]"):
        ed.init("mpi", foo=1)  # never reaches MPI (whose import would fail here)
    with pytest.raises(ImportError, match="mpi4py could not load its MPI library .cannot load MPI library."):
        ed.init("mpi")


@pytest.mark.parametrize("bad", ["a foreign TableConfig", "a table named twice"])
def test_a_bad_sharding_dict_on_one_rank_fails_every_rank(bad):
    """The sharding= checks run inside the agreed construction step: the rank
    whose dict is bad raises ValueError, the others RankFailedError, none waits."""
    config, _ = _error_setup("row_wise")
    seen = [None] * 2

    def fn(world):
        sharding = {"T": "row_wise"}
        if world.rank == 1:
            sharding = ({ec.TableConfig("elsewhere", 4, 2): "row_wise"} if bad == "a foreign TableConfig"
                        else {"T": "row_wise", config["f"].table: "table_wise"})
        try:
            ec.Embedding(config, world=world, sharding=sharding)
        except Exception as e:  # noqa: BLE001
            seen[world.rank] = e

    _run(2, fn)
    assert isinstance(seen[1], ValueError) and "sharding names" in str(seen[1]), repr(seen[1])
    assert isinstance(seen[0], ed.RankFailedError) and "sharding names" in str(seen[0]), repr(seen[0])


@pytest.mark.parametrize("bad_rank", ["first", "last"])
@pytest.mark.parametrize("W", [2, 3, 4])
def test_bad_id_uncaught_run_local_reraises_the_failing_ranks_error(W, bad_rank):
    """fn lets the lookup's error propagate: the failing rank raises its own
    IndexError, every other rank RankFailedError naming it, and run_local
    re-raises the IndexError. Repeated, since the ranks' timing varies."""
    config, _ = _error_setup("row_wise")
    bad = 0 if bad_rank == "first" else W - 1
    for attempt in range(20):
        seen = [None] * W

        def fn(world):
            emb = ec.Embedding(config, world=world, sharding="row_wise")
            batch = _good_batch(world.rank)
            if world.rank == bad:
                batch["g"] = -batch["g"] - 1
            try:
                return emb(batch)
            except Exception as e:
                seen[world.rank] = e
                raise

        with pytest.raises(Exception) as info:
            _run(W, fn)
        what = f"attempt {attempt}: rank {bad} raised {seen[bad]!r}; run_local raised {info.value!r}"
        assert isinstance(seen[bad], IndexError), what
        assert isinstance(info.value, IndexError) and "features['g']" in str(info.value), what
        for r in range(W):
            if r != bad:
                assert isinstance(seen[r], ed.RankFailedError), (r, seen[r])
                assert f"rank {bad} of {W}" in str(seen[r]) and "IndexError" in str(seen[r]), (r, seen[r])


def test_a_rank_that_left_with_its_error_does_not_leave_the_others_hanging():
    """Rank 1's bad id propagates out of fn (rank 1 is gone); rank 0 catches
    its RankFailedError and calls the embedding again: that call must raise
    RankFailedError (the world lost a rank), not wait forever for rank 1."""
    t = ec.TableConfig("T", 5, 3)
    config = {"f": ec.FeatureConfig(t)}
    seen = {}

    def fn(world):
        emb = ec.Embedding(config, world=world, sharding="row_wise")
        if world.rank == 1:
            emb({"f": np.array([99])})  # IndexError, not caught
        with pytest.raises(ed.RankFailedError, match="rank 1 of 2"):
            emb({"f": np.array([1])})
        try:
            emb({"f": np.array([1])})
            seen["retry"] = "returned"
        except Exception as e:  # noqa: BLE001
            seen["retry"] = e

    with pytest.raises(IndexError, match="id 99"):
        _run(2, fn, timeout=10.0)
    assert isinstance(seen["retry"], ed.RankFailedError) and "rank 1 of 2" in str(seen["retry"]), seen


@pytest.mark.parametrize("sharding", ["table_wise", "row_wise"])
def test_a_bad_id_of_a_reordered_sparse_input_is_named_at_the_callers_position(sharding):
    """A Sparse input whose indices are not row-major is reordered before the
    lookup; the error names the id's position in the values the caller
    gave, as the unsharded lookup does."""
    sp = ec.Sparse(indices=[[1, 0], [0, 0], [0, 1]], values=[1, 8, 2], dense_shape=[2, 2])  # 8 is values[1]
    config = {"f": ec.FeatureConfig(ec.TableConfig("a", 7, 4, combiner="sum"))}
    with pytest.raises(IndexError, match="id 8 at position 1 of ids"):
        ec.Embedding(config)({"f": sp})

    def fn(world):
        with pytest.raises(IndexError, match=r"features\['f'\]: id 8 at position 1 is out of range"):
            ec.Embedding(config, world=world, sharding=sharding)({"f": sp})
        # Several bad ids: the first in the caller's order, as unsharded (not the smallest or the largest).
        with pytest.raises(IndexError, match=r"id 9 at position 0 is out of range"):
            ec.Embedding(config, world=world, sharding=sharding)({"f": np.array([9, -1, 3])})
        with pytest.raises(IndexError, match=r"id 9 at index \[1, 0\] is out of range"):  # a 2-D array's
            ec.Embedding(config, world=world, sharding=sharding)({"f": np.array([[1, 2], [9, 3]])})

    with pytest.raises(IndexError, match="id 9 at position 0 of ids"):
        ec.Embedding(config)({"f": np.array([9, -1, 3])})
    _run(1, fn)


def test_bad_ids_on_two_ranks_name_the_first():
    config, _ = _error_setup("table_wise")

    def fn(world):
        emb = ec.Embedding(config, world=world, sharding="table_wise")
        batch = _good_batch(world.rank)
        if world.rank in (1, 2):
            batch["f"] = batch["f"] + 100
        return emb(batch)

    results = _run(4, _catching(fn))
    assert isinstance(results[1], IndexError) and isinstance(results[2], IndexError)
    for r in (0, 3):
        assert isinstance(results[r], ed.RankFailedError) and "rank 1 of 4" in str(results[r]), results[r]


@pytest.mark.parametrize("seq_form", ["ragged", "sparse"])
@pytest.mark.parametrize("plan", KINDS)
def test_bad_id_in_a_sequence_feature(plan, seq_form):
    config, _ = _error_setup(plan)

    def fn(world):
        emb = ec.Embedding(config, world=world, sharding=plan)
        batch = _good_batch(world.rank)
        if world.rank == 1:
            if seq_form == "ragged":
                batch["s"] = ec.Ragged(np.array([1, 2, 99]), np.array([0, 1, 3]))
            else:
                batch["s"] = ec.Sparse(np.array([[0, 0], [1, 1]]), np.array([4, 99]), np.array([2, 2]))
        return emb(batch)

    results = _run(2, _catching(fn))
    assert isinstance(results[1], IndexError) and "id 99" in str(results[1]) and "'s'" in str(results[1])
    assert isinstance(results[0], ed.RankFailedError) and "rank 1 of 2" in str(results[0])


@pytest.mark.parametrize("length", [2**60, 2**61 + 1, 2**62])
def test_a_sequence_output_too_big_to_address_is_refused_as_unsharded(length):
    """bags x max_sequence_length x dim past int64: the unsharded lookup's
    ValueError (the sharded one computed the size in wrapping int64)."""
    feats = {"f": ec.FeatureConfig(ec.TableConfig(name="t", rows=10, dim=4), max_sequence_length=length)}
    ids = ec.Ragged(np.array([1, 2, 3, 4]), np.array([0, 1, 2, 3, 4]))
    with pytest.raises(ValueError) as unsharded:
        ec.Embedding(feats)({"f": ids})
    assert "would not fit in memory: its size overflows" in str(unsharded.value)
    results = _run(2, _catching(lambda world: ec.Embedding(feats, world=world)({"f": ids})))
    assert all(type(r) is ValueError and str(r) == str(unsharded.value) for r in results), results


@pytest.mark.parametrize("plan", KINDS)
def test_offsets_that_fall_by_more_than_int64_holds_are_refused_on_their_rank(plan):
    """Offsets falling from 2**62 to -2**63 (a decrease np.diff wrapped to a
    rise) are refused by the rank that was given them, naming the feature,
    as the unsharded table refuses them; the others raise RankFailedError.
    A row-wise plan crashed the process (np.repeat over lengths whose total
    wrapped), a table-wise one raised from the owner about lengths never
    given."""
    feats = {"a": ec.FeatureConfig(ec.TableConfig(name="t", rows=10, dim=4))}
    wrapped = np.array([0, 2**62, -2**63, -2**62, 0, 1], np.int64)
    message = rf"offsets must be non-decreasing: offsets\[1\] = {2**62} > offsets\[2\] = {-2**63}"
    with pytest.raises(ValueError, match=message):
        ec.Embedding(feats)({"a": ec.Ragged(np.array([1]), wrapped)})

    def fn(world):
        x = ec.Ragged(np.array([1]), wrapped) if world.rank == 0 else ec.Ragged(np.array([1]), np.array([0, 1]))
        return ec.Embedding(feats, world=world, sharding=plan)({"a": x})

    results = _run(2, _catching(fn))
    assert type(results[0]) is ValueError and re.search(r"features\['a'\]: " + message, str(results[0])), results
    assert isinstance(results[1], ed.RankFailedError) and "rank 0 of 2" in str(results[1]), results


@pytest.mark.parametrize("plan", KINDS)
@pytest.mark.parametrize("W", [2, 3])
def test_wrong_grads_shape_on_one_rank(W, plan):
    config, _ = _error_setup(plan)

    def fn(world):
        emb = ec.Embedding(config, opt.Adam(0.1), world=world, sharding=plan)
        emb(_good_batch(world.rank))
        before = _snapshot_bytes(emb)
        grads = _good_grads(world.rank)
        if world.rank == 1:
            grads["g"] = grads["g"][:, :1]
        try:
            emb.apply_gradients(grads)
            error = None
        except Exception as e:  # noqa: BLE001
            error = e
        unchanged = before == _snapshot_bytes(emb)
        emb.apply_gradients(_good_grads(world.rank))  # the same lookup, good gradients
        return error, unchanged, _shard_state(emb), emb.plan

    results = _run(W, fn)
    for r, (error, unchanged, _, _) in enumerate(results):
        assert unchanged, f"rank {r}: a failed apply_gradients changed a table"
        if r == 1:
            assert isinstance(error, ValueError) and "grads['g']" in str(error) and "(3, 2)" in str(error), error
        else:
            assert isinstance(error, ed.RankFailedError) and "rank 1 of" in str(error), repr(error)
            assert "ValueError" in str(error)
    unsharded = ec.Embedding(config, opt.Adam(0.1))
    unsharded(_concat_batches([_good_batch(r) for r in range(W)]))
    unsharded.apply_gradients(_concat_grads([_good_grads(r) for r in range(W)]))
    _check_shards([r[2] for r in results], results[0][3],
                  {t.name: t for t in unsharded.embedding_tables.values()}, what="after the failed update:")
    assert all(t.step == 1 for t in unsharded.embedding_tables.values())


@pytest.mark.parametrize("W", [1, 2, 3])
def test_apply_gradients_before_any_lookup(W):
    config, _ = _error_setup("row_wise")

    def fn(world):
        emb = ec.Embedding(config, opt.SGD(0.1), world=world, sharding="row_wise")
        before = _snapshot_bytes(emb)
        try:
            emb.apply_gradients(_good_grads(world.rank))
            error = None
        except Exception as e:  # noqa: BLE001
            error = e
        return error, before == _snapshot_bytes(emb)

    for error, unchanged in _run(W, fn):
        assert isinstance(error, ValueError) and "first" in str(error), repr(error)
        assert unchanged


@pytest.mark.parametrize("exchange", ["requests", "answers", "gradients", "requests received"])
def test_an_exchange_over_the_backends_limit_fails_every_rank_before_it_starts(exchange):
    """A backend with a limit on one exchange (MPI: C int counts): a batch
    over it on one rank fails every rank before the exchange, whichever side
    (the sender or the receiver) is over, so no rank waits in an exchange the
    others skip, and the next call works. Only rank 0 has bags: it sends the
    requests, receives the answers, then sends the gradients (to whichever
    rank holds the table, itself included: a rank's share of its own batch
    goes through the exchange too). "requests received": both ranks send
    requests into table A's owner (rank 0), each under the limit, while
    rank 0 would receive both, over it; checking the senders alone let the
    requests through (MPI: a receive count over INT_MAX)."""
    config = {"f": ec.FeatureConfig(ec.TableConfig("A", 50, 8)), "g": ec.FeatureConfig(ec.TableConfig("B", 50, 8))}
    big = np.arange(40) % 50  # 40 bags of one id: 40 * 8 = 320 answer and gradient elements, ~90 request elements
    # The limits that let the earlier exchanges of the call through and stop this one.
    limit = {"requests": 60, "answers": 200, "gradients": 10_000, "requests received": 60}[exchange]
    received = exchange == "requests received"  # 20 bags on each rank: each sends 46 request elements

    def fn(world):
        emb = ec.Embedding(config, opt.SGD(0.5), world=world, sharding="table_wise")
        world.max_exchange_elements = limit
        assert [s.rank for s in emb.plan["A"].shards] == [0]
        ids = big[:20] if received else big if world.rank == 0 else np.zeros(0, np.int64)
        batch = {"f": ec.Ragged.from_lengths(ids, np.ones(ids.size, np.int64)),
                 "g": ec.Ragged.from_lengths(np.zeros(0, np.int64), np.zeros(0, np.int64))}
        before = _snapshot_bytes(emb)
        error = None
        try:
            out = emb(batch)
            if exchange == "gradients":
                world.max_exchange_elements = 200
                emb.apply_gradients({k: np.ones_like(v) for k, v in out.items()})
        except Exception as e:  # noqa: BLE001
            error = e
        unchanged = before == _snapshot_bytes(emb)
        world.max_exchange_elements = None
        small = {k: ec.Ragged.from_lengths(np.array([1]), np.array([1])) for k in config}
        return error, unchanged, emb(small)["f"].shape

    results = _run(2, fn)
    for rank, (error, unchanged, shape) in enumerate(results):
        assert isinstance(error, (ValueError, ed.RankFailedError)), (rank, repr(error))
        text = str(error)
        assert f"({exchange.split()[0]})" in text and "all_to_all_v exchange" in text, text
        assert "split the batch" in text, text
        if received:
            assert isinstance(error, ValueError) and "rank 0 would receive" in text, text
        assert unchanged and shape == (1, 8)


@pytest.mark.parametrize("failure", ["last_step", "schedule"])
def test_a_step_one_table_refuses_changes_no_table_on_any_rank(failure):
    """One rank's table refuses the step (at the last step a checkpoint
    records, or its learning-rate schedule raises) while another rank's table
    could take it: every rank raises and no table changes, as the unsharded
    Embedding checks every table before changing any (rank 0's table took
    the step)."""
    def schedule(step):
        raise ArithmeticError("no rate past step 0") if step else 0.1

    a = ec.TableConfig("A", 8, 2, initializer=init.Uniform(-1, 1, seed=1), optimizer=opt.SGD(0.1))
    b = ec.TableConfig("B", 8, 2, initializer=init.Uniform(-1, 1, seed=2),
                       optimizer=opt.SGD(schedule if failure == "schedule" else 0.1))
    config = {"a": ec.FeatureConfig(a), "b": ec.FeatureConfig(b)}

    def fn(world):
        emb = ec.Embedding(config, world=world, sharding="table_wise")
        assert {name: s.rank for name, ts in emb.plan.tables.items() for s in ts.shards} == {"A": 0, "B": 1}
        for s, t in emb.local_shards.get("B", []):
            t.step = 2**62 if failure == "last_step" else 1
        batch = {"a": np.array([[1], [2]]), "b": np.array([[3], [4]])}
        out = emb(batch)
        before = _snapshot_bytes(emb)
        try:
            emb.apply_gradients({k: np.ones_like(v) for k, v in out.items()})
            error = None
        except Exception as e:  # noqa: BLE001
            error = e
        return error, before == _snapshot_bytes(emb)

    (e0, unchanged0), (e1, unchanged1) = _run(2, fn)
    assert isinstance(e1, ValueError if failure == "last_step" else ArithmeticError), repr(e1)
    assert isinstance(e0, ed.RankFailedError) and "rank 1 of 2" in str(e0), repr(e0)
    assert unchanged0 and unchanged1


def test_apply_gradients_without_optimizer():
    config, _ = _error_setup("table_wise")

    def fn(world):
        emb = ec.Embedding(config, world=world, sharding="table_wise")
        emb(_good_batch(world.rank))
        emb.apply_gradients(_good_grads(world.rank))

    with pytest.raises(ValueError, match="optimizer"):
        _run(2, fn)


@pytest.mark.parametrize("where", ["lookup", "apply_gradients", "construction"])
@pytest.mark.parametrize("W", [2, 4])
def test_user_error_on_one_rank_while_others_wait(W, where):
    """A rank whose own code raises while the others wait in a collective:
    they raise RankFailedError naming it, and run_local raises its error."""
    config, _ = _error_setup("row_wise")
    seen = [None] * W

    class Boom(Exception):
        pass

    def fn(world):
        try:
            if where == "construction" and world.rank == W - 1:
                raise Boom("user code failed")
            emb = ec.Embedding(config, opt.SGD(0.1), world=world, sharding="column_wise")
            if where == "lookup" and world.rank == W - 1:
                time.sleep(0.05)  # the others are in the lookup's collective by now
                raise Boom("user code failed")
            emb(_good_batch(world.rank))
            if where == "apply_gradients" and world.rank == W - 1:
                time.sleep(0.05)
                raise Boom("user code failed")
            emb.apply_gradients(_good_grads(world.rank))
            return "finished"
        except BaseException as e:
            seen[world.rank] = e
            raise

    with pytest.raises(Boom, match="user code failed"):
        _run(W, fn)
    assert isinstance(seen[W - 1], Boom)
    for r in range(W - 1):
        assert isinstance(seen[r], ed.RankFailedError), repr(seen[r])
        assert f"rank {W - 1} of {W}" in str(seen[r]) and "Boom" in str(seen[r]) and "user code failed" in str(seen[r])


def test_lookup_before_apply_uses_the_last_successful_lookup():
    """A failed lookup does not replace the batch apply_gradients applies to:
    the gradients of the last successful lookup still fit."""
    config, _ = _error_setup("row_wise")

    def fn(world):
        emb = ec.Embedding(config, opt.SGD(0.1), world=world, sharding="row_wise")
        emb(_good_batch(world.rank))
        bad = _good_batch(world.rank)
        bad["f"] = bad["f"] + 1000
        with pytest.raises((IndexError, ed.RankFailedError)):
            emb(bad)
        emb.apply_gradients(_good_grads(world.rank))
        return _shard_state(emb), emb.plan

    results = _run(2, fn)
    unsharded = ec.Embedding(config, opt.SGD(0.1))
    unsharded(_concat_batches([_good_batch(r) for r in range(2)]))
    unsharded.apply_gradients(_concat_grads([_good_grads(r) for r in range(2)]))
    _check_shards([r[0] for r in results], results[0][1], {t.name: t for t in unsharded.embedding_tables.values()})


# ---------------------------------------------------------------------- 5. the Comm interface
COMM_DTYPES = [np.int64, np.int32, np.float32, np.float64, np.float16, np.uint8, np.bool_, np.complex64]


@pytest.mark.parametrize("dtype", COMM_DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("W", WORLDS)
def test_all_to_all_v(W, dtype):
    def payload(src, dst):
        n = (src * 3 + dst) % 4  # some sizes are 0
        return (np.arange(n) + 10 * src + 100 * dst).astype(dtype)

    def fn(world):
        assert isinstance(world, LocalComm) and world.backend == "local"
        assert world.size == W and 0 <= world.rank < W
        assert f"rank={world.rank}" in repr(world)
        send = [payload(world.rank, d) for d in range(W)]
        got_none = world.all_to_all_v(send)
        got_counts = world.all_to_all_v(send, [payload(j, world.rank).size for j in range(W)])
        # 2-D send arrays travel flattened.
        got_2d = world.all_to_all_v([np.stack([a, a]) for a in send])
        return world.rank, got_none, got_counts, got_2d

    results = _run(W, fn)
    assert [r[0] for r in results] == list(range(W))
    for rank, got_none, got_counts, got_2d in results:
        for got in (got_none, got_counts):
            assert len(got) == W
            for j in range(W):
                assert got[j].dtype == np.dtype(dtype) and got[j].ndim == 1
                np.testing.assert_array_equal(got[j], payload(j, rank))
        for j in range(W):
            np.testing.assert_array_equal(got_2d[j], np.concatenate([payload(j, rank)] * 2))


@pytest.mark.parametrize("W", WORLDS)
def test_all_to_all_v_all_empty(W):
    def fn(world):
        return world.all_to_all_v([np.zeros(0, np.float32) for _ in range(W)], [0] * W)

    for got in _run(W, fn):
        assert len(got) == W and all(a.size == 0 and a.dtype == np.float32 for a in got)


@pytest.mark.parametrize("W", WORLDS)
def test_all_gather_order_and_many_rounds(W):
    def fn(world):
        out = []
        for k in range(30):
            if (k + world.rank) % 7 == 0:
                time.sleep(0.001)  # a slow rank must not let the next round overwrite this one
            out.append(world.all_gather((world.rank, k)))
        world.barrier()
        return out

    for rounds in _run(W, fn):
        for k, got in enumerate(rounds):
            assert got == [(r, k) for r in range(W)]


@pytest.mark.parametrize("W", [1, 2, 3])
def test_all_to_all_v_wrong_number_of_send_arrays(W):
    def fn(world):
        with pytest.raises(ValueError, match=f"one array per rank \\({W}\\)"):
            world.all_to_all_v([np.zeros(1)] * (W + 1))
        with pytest.raises(ValueError):
            world.all_to_all_v([np.zeros(1)] * (W - 1))
        if W > 1:
            with pytest.raises(TypeError, match="dtype"):
                world.all_to_all_v([np.zeros(1, np.float32)] + [np.zeros(1, np.int64)] * (W - 1))
        # The world is still usable.
        return world.all_gather(world.rank)

    for got in _run(W, fn):
        assert got == list(range(W))


def test_all_to_all_v_wrong_send_count_on_one_rank_makes_the_others_fail():
    """The Comm itself does not agree on errors: the failing rank's error,
    propagating out of fn, frees the others waiting in the exchange."""
    seen = [None] * 4

    def fn(world):
        n = 3 if world.rank == 1 else 4
        try:
            return world.all_to_all_v([np.zeros(1)] * n)
        except Exception as e:
            seen[world.rank] = e
            raise

    with pytest.raises(ValueError, match="one array per rank"):
        _run(4, fn)
    assert isinstance(seen[1], ValueError)
    for r in (0, 2, 3):
        assert isinstance(seen[r], ed.RankFailedError) and "rank 1 of 4" in str(seen[r]), seen[r]


def test_all_to_all_v_recv_counts_mismatch():
    def fn(world):
        return world.all_to_all_v([np.zeros(2, np.int64)] * 2, [2, 3] if world.rank == 0 else [2, 2])

    results = _run(2, _catching(fn))
    assert isinstance(results[0], RuntimeError) and "rank 1 sent 2 elements" in str(results[0]), results[0]


def test_run_local_arguments_and_results():
    assert ed.run_local(3, lambda world: world.rank * 10) == [0, 10, 20]
    assert ed.run_local(np.int64(2), lambda world: world.size) == [2, 2]
    for bad in (0, -1):
        with pytest.raises(ValueError):
            ed.run_local(bad, lambda world: None)
    for bad in (True, 1.5, "2", None):  # (wrong types were ValueError)
        with pytest.raises(TypeError, match=r"run_local: size must be an int, got "):
            ed.run_local(bad, lambda world: None)
    with pytest.raises(TypeError):
        ed.run_local(2, "not callable")


@pytest.mark.parametrize("W", [2, 3])
def test_ranks_in_different_calls_raise_a_named_mismatch_and_change_nothing(W):
    """One rank applies gradients (or saves) while the others look up: every
    rank raises CollectiveMismatchError naming where each one is, before any
    data moves; no table changes, and the world still works afterwards."""
    config, _ = _error_setup("row_wise")

    def fn(world):
        emb = ec.Embedding(config, opt.Adagrad(0.1), world=world, sharding="row_wise")
        emb(_good_batch(world.rank))
        before = _snapshot_bytes(emb)
        errors = []
        for odd in ("apply", "save"):
            try:
                if world.rank == W - 1:
                    if odd == "apply":
                        emb.apply_gradients(_good_grads(world.rank))
                    else:
                        ec.save(os.path.join(tmp, "ck"), emb)
                else:
                    emb(_good_batch(world.rank))  # a second lookup: one call more than the last rank
            except Exception as e:  # noqa: BLE001
                errors.append(e)
        unchanged = _snapshot_bytes(emb) == before
        emb(_good_batch(world.rank))  # the same calls again everywhere: fine
        emb.apply_gradients(_good_grads(world.rank))
        return errors, unchanged

    with tempfile.TemporaryDirectory() as tmp:
        results = _run(W, fn)
        assert not os.path.exists(os.path.join(tmp, "ck")) or not os.listdir(os.path.join(tmp, "ck"))
    for r, (errors, unchanged) in enumerate(results):
        assert unchanged, f"rank {r}: a mismatched call changed a table"
        assert len(errors) == 2, (r, errors)
        for e, odd in zip(errors, ("apply_gradients: gradients", "save: generation")):
            assert isinstance(e, ed.CollectiveMismatchError), (r, repr(e))
            msg = str(e)
            assert f"rank {W - 1} in '{odd} of embedding 0 (tables T, U)'" in msg, msg
            assert "rank 0 in 'lookup: requests of embedding 0 (tables T, U)'" in msg, msg


def test_two_embeddings_called_in_different_orders_raise_a_named_mismatch():
    """Two sharded embeddings of one world, looked up in one order on rank 0
    and the other on rank 1 (e.g. a rank that skips a tower): every rank
    raises CollectiveMismatchError naming each embedding, before any data
    moves, instead of serving one embedding's requests from the other's
    shards."""
    def fn(world):
        user = ec.Embedding({"u": ec.FeatureConfig(ec.TableConfig("user", 10, 2))}, opt.SGD(0.1), world=world,
                            sharding="row_wise")
        item = ec.Embedding({"i": ec.FeatureConfig(ec.TableConfig("item", 10, 2))}, opt.SGD(0.1), world=world,
                            sharding="row_wise")
        first, second = (user, item) if world.rank == 0 else (item, user)
        try:
            first({"u" if first is user else "i": np.array([[1], [2]])})
        except ed.CollectiveMismatchError as e:
            return str(e)
        return "no error"

    for msg in _run(2, fn):
        assert ("rank 0 in 'lookup: requests of embedding 0 (tables user)', rank 1 in 'lookup: requests of "
                "embedding 1 (tables item)'") in msg, msg


def test_a_rank_s_second_thread_in_a_collective_call_is_refused_by_name():
    """Two threads of one rank looking up at once: the second raises
    RuntimeError naming both calls, before any exchange, and the first
    completes with the right rows. (The threads' exchanges used to pair with
    the other rank's in any order: AttributeError, an unpacking ValueError,
    a mismatch naming the wrong places.) Rank 1 looks up only once the
    refusal has happened, so the first thread is inside its call then."""
    config = {"f": ec.FeatureConfig(ec.TableConfig("t", 100, 2, initializer=ec.initializers.Uniform(-1, 1, seed=3)))}
    refused = threading.Event()

    def fn(world):
        emb = ec.Embedding(config, opt.SGD(0.1), world=world, sharding="row_wise")
        if world.rank == 1:
            assert refused.wait(60), "no call was refused"
            return [emb({"f": np.array([[7]])})["f"]]
        results = {}

        def call(name, ids):
            try:
                results[name] = emb({"f": ids})["f"]
            except RuntimeError as e:
                results[name] = e
                refused.set()

        threads = [threading.Thread(target=call, args=(n, np.array([[i]]))) for n, i in (("a", 5), ("b", 90))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        return [results["a"], results["b"]]

    (a, b), (other,) = _run(2, fn)
    errors = [x for x in (a, b) if isinstance(x, Exception)]
    assert len(errors) == 1, (a, b)
    assert re.fullmatch(r"lookup: rank 0 is already in a collective call \(lookup\) on another thread; a rank makes "
                        r"its collective calls one at a time.*", str(errors[0])), errors[0]
    values = ec.Table(config["f"].table).to_numpy()
    done = a if b is errors[0] else b
    np.testing.assert_array_equal(done, values[[5 if b is errors[0] else 90]])
    np.testing.assert_array_equal(other, values[[7]])


def test_ranks_with_other_optimizer_hyper_parameters_are_refused():
    """Every rank's optimizer must be the same, hyper-parameters included
    (each shard's owner applies its own): another learning rate on one rank
    is refused when the embedding is made, on every rank."""
    def fn(world):
        lr = 0.05 if world.rank == 0 else 0.5
        return ec.Embedding({"f": ec.FeatureConfig(ec.TableConfig("t", 10, 2))}, opt.Adagrad(lr), world=world,
                            sharding="row_wise")

    for e in _run(2, _catching(fn)):
        assert isinstance(e, ValueError) and "optimizers or plan differ" in str(e), repr(e)


def test_ranks_saving_to_different_paths_are_refused_and_write_nothing(tmp_path):
    """A per-rank path (a timestamp in it) would scatter the shards where rank
    0 does not commit them: every rank raises ValueError naming each rank's
    path, and nothing is written."""
    def fn(world):
        emb = ec.Embedding({"f": ec.FeatureConfig(ec.TableConfig("t", 10, 2))}, opt.Adagrad(0.1), world=world,
                           sharding="row_wise")
        path = tmp_path / f"ckpt_{world.rank}"
        path.mkdir()
        ec.save(path, emb)

    errors = _run(2, _catching(fn))
    for e in errors:
        assert isinstance(e, ValueError), repr(e)
        assert f"rank 0 {str(tmp_path / 'ckpt_0')!r}, rank 1 {str(tmp_path / 'ckpt_1')!r}" in str(e), str(e)
    assert os.listdir(tmp_path / "ckpt_0") == [] and os.listdir(tmp_path / "ckpt_1") == []

    def new_paths(world):  # directories that do not exist yet: none is left behind
        emb = ec.Embedding({"f": ec.FeatureConfig(ec.TableConfig("t", 10, 2))}, opt.Adagrad(0.1), world=world,
                           sharding="row_wise")
        ec.save(tmp_path / f"new_{world.rank}", emb)

    assert all(isinstance(e, ValueError) for e in _run(2, _catching(new_paths)))
    assert not (tmp_path / "new_0").exists() and not (tmp_path / "new_1").exists()


def test_run_local_a_rank_that_returns_early_does_not_hang_the_others():
    """A rank whose fn returns joins no further collective: another rank's
    next one raises RankFailedError naming it, instead of waiting forever."""
    def fn(world):
        if world.rank == 0:
            return "done"
        world.all_gather(1)

    with pytest.raises(ed.RankFailedError, match="rank 0 of 2 returned from fn while rank 1 called a collective"):
        ed.run_local(2, fn)
    # Ranks that all return after the same collectives are fine.
    assert ed.run_local(3, lambda world: world.all_gather(world.rank)) == [[0, 1, 2]] * 3


def test_init_local_points_to_run_local():
    with pytest.raises(ValueError, match="run_local"):
        ed.init("local")
    with pytest.raises(ValueError):
        ed.init("carrier-pigeon")


def test_shard_creation_failing_on_one_rank_reaches_every_rank(monkeypatch):
    """Creating a rank's shards can fail there alone (memory, a missing GPU):
    every rank raises at construction instead of waiting in the first lookup."""
    from embedcore.table import Table

    real = Table._shard.__func__

    def shard(cls, *args, **kwargs):
        if threading.current_thread().name == "embedcore-rank-1":
            raise MemoryError("no room for this shard")
        return real(cls, *args, **kwargs)

    monkeypatch.setattr(Table, "_shard", classmethod(shard))
    seen = {}

    def fn(world):
        try:
            ec.Embedding({"f": ec.FeatureConfig(ec.TableConfig("t", 30, 4))}, world=world, sharding="row_wise")
        except Exception as e:  # noqa: BLE001
            seen[world.rank] = e
            raise

    with pytest.raises(MemoryError, match="no room"):
        ed.run_local(3, fn)
    assert isinstance(seen[1], MemoryError)
    assert isinstance(seen[0], ed.RankFailedError) and "MemoryError" in str(seen[0])
    assert isinstance(seen[2], ed.RankFailedError)


@pytest.mark.parametrize("sharding", ["table_wise", "row_wise", "column_wise"])
def test_sparse_sequence_with_repeated_positions_matches_unsharded(sharding):
    """Several ids at one position (some on different row-wise shards) add
    up as the unsharded table adds them."""
    rng = np.random.default_rng(21)
    cfg = {"s": ec.FeatureConfig(ec.TableConfig("t", 40, 6, initializer=ec.initializers.Uniform(-1, 1, seed=2)),
                                 max_sequence_length=3)}
    batches = []
    for _ in range(3):
        coords = [(b, p) for b in range(4) for p in range(4) for _ in range(int(rng.integers(0, 4)))]
        indices = np.array(coords, np.int64).reshape(-1, 2)[rng.permutation(len(coords))]
        batches.append((indices, rng.integers(0, 40, len(coords)), rng.uniform(0.5, 2, len(coords)).astype(np.float32)))

    def fn(world):
        emb = ec.Embedding(cfg, world=world, sharding=sharding)
        i, v, w = batches[world.rank]
        return emb({"s": ec.Sparse(i, v, [4, 4])}, weights={"s": w})["s"]

    got = ed.run_local(3, fn)
    ref_emb = ec.Embedding(cfg)
    for r, (i, v, w) in enumerate(batches):
        want = ref_emb({"s": ec.Sparse(i, v, [4, 4])}, weights={"s": w})["s"]
        if sharding == "row_wise":  # each shard sums its own ids: the order of additions differs
            np.testing.assert_allclose(got[r], want, rtol=1e-6, atol=1e-6)
        else:
            np.testing.assert_array_equal(got[r].view(np.uint32), want.view(np.uint32))


def test_a_mismatch_names_the_field_given_not_another_table_s_shards_it_moved():
    """Table 'b' of another dim on rank 1 moves table 'a' to another rank
    (table-wise): the message named 'a' sharding, which the caller did not
    give differently; it names 'b' dim, as for the "auto" plan."""
    def fn(world):
        fc = {"fa": ec.FeatureConfig(ec.TableConfig("a", 100, 8)),
              "fb": ec.FeatureConfig(ec.TableConfig("b", 100, 9 if world.rank == 1 else 8))}
        return ec.Embedding(fc, opt.SGD(0.1), world=world, sharding="table_wise")

    for e in _run(2, _catching(fn)):
        assert isinstance(e, ValueError) and "table 'b' dim: rank " in str(e) and "sharding" not in str(e).split(
            "differ:")[1].split(";")[0], str(e)


def test_a_child_forked_from_a_rank_skips_the_exit_meeting(monkeypatch):
    """The exit meeting (an all-gather over MPI.COMM_WORLD) is the rank's
    process's: a child forked from a rank that ends with sys.exit() joined
    it as if it were a rank, and the job waited for it for ever."""
    from embedcore.distributed import _comm

    class FakeMPI:
        @staticmethod
        def Is_finalized():
            return False

    class FakeComm:
        _MPI = FakeMPI

    met = []
    monkeypatch.setattr(_comm, "agree", lambda *args, **kw: met.append(args))
    monkeypatch.setattr(_comm, "_exit_met", [])
    comm = FakeComm()
    monkeypatch.setattr(_comm, "_exit_check", [comm, os.getpid() + 1])  # registered by another process
    _comm._agree_at_exit(comm)
    assert met == [] and _comm._exit_met == []
    monkeypatch.setattr(_comm, "_exit_check", [comm, os.getpid()])  # the rank itself meets, once
    _comm._agree_at_exit(comm)
    _comm._agree_at_exit(comm)
    assert len(met) == 1


def _decay(step):
    return 0.05 / (1 + step)


def _warmup(step):
    return 0.05 * min(1, step / 100)


@pytest.mark.parametrize("case", ["dim", "learning rate", "schedule", "schedules", "max_sequence_length", "plan",
                                  "initializer", "dtype", "combiner"])
def test_a_construction_mismatch_names_the_table_the_field_and_both_values(case):
    """Every rank holds every rank's description of the embedding, so the
    ValueError says where they first differ: the table (or feature), the
    field, and both ranks' values. An initializer (here its seed), a dtype
    or a combiner that differs is refused too: each rank would otherwise
    start its shards from its own values, or pool its bags its own way. A
    learning-rate schedule is named (the rank that passed one was said to
    have a rate of None)."""
    def fn(world):
        odd = world.rank == 1
        table = ec.TableConfig("user", 100, 32 if odd and case == "dim" else 16,
                               combiner="mean" if odd and case == "combiner" else "sum",
                               dtype="float16" if odd and case == "dtype" else "float32",
                               initializer=init.Uniform(-1, 1, seed=8 if odd and case == "initializer" else 7))
        other = ec.TableConfig("item", 50, 4)
        seq = 7 if odd and case == "max_sequence_length" else 5
        lr = {"learning rate": 0.5 if odd else 0.05, "schedule": _decay if odd else 0.05,
              "schedules": _decay if odd else _warmup}.get(case, 0.05)
        sharding = {"user": "column_wise" if odd and case == "plan" else "row_wise"}
        return ec.Embedding({"u": ec.FeatureConfig(table), "h": ec.FeatureConfig(other, max_sequence_length=seq)},
                            opt.Adagrad(lr), world=world, sharding=sharding)

    want = {"dim": ("table 'user' dim", "32", "16"),
            "learning rate": ("optimizer learning_rate: rank", "0.5", "0.05"),
            "schedule": ("optimizer learning_rate: rank", "has the schedule '_decay'", "has 0.05"),
            "schedules": ("optimizer learning_rate: rank", "has the schedule '_decay'", "has the schedule '_warmup'"),
            "max_sequence_length": ("feature 'h' max_sequence_length", "7", "5"),
            "plan": ("table 'user' sharding", "column_wise", "row_wise"),
            "initializer": ("table 'user' initializer", "seed=8", "seed=7"),
            "dtype": ("table 'user' dtype", "float16", "float32"),
            "combiner": ("table 'user' combiner", "mean", "sum")}[case]
    for r, e in enumerate(_run(3, _catching(fn))):
        assert isinstance(e, ValueError), (r, repr(e))
        msg = str(e)
        assert "optimizers or plan differ" in msg and want[0] in msg, msg
        odd_rank, other_rank = (1, r) if r != 1 else (0, 1)  # each rank names the first rank that differs from it
        assert f"rank {odd_rank} has " in msg and f"rank {other_rank} has " in msg, msg
        assert want[1] in msg and want[2] in msg, msg


def _sigint_to_main_thread():
    """The signal module, for a test that sends SIGINT to this (main) thread
    as Ctrl-C; skips where that does not raise KeyboardInterrupt here."""
    import signal

    if threading.current_thread() is not threading.main_thread():
        pytest.skip("KeyboardInterrupt reaches the main thread only, and this test runs on another")
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        pytest.skip("SIGINT does not raise KeyboardInterrupt in this process (its handler was replaced)")
    return signal


def test_run_local_interrupted_while_its_ranks_start_stops_them_too(monkeypatch):
    """Ctrl-C that came while run_local started its ranks (inside
    Thread.start) raised there, before its wait: the started ranks went on
    (here, waiting for a rank that never started), unjoined. The ranks that
    started are stopped and waited for; the others never run."""
    signal = _sigint_to_main_thread()
    seen = []
    real_start = threading.Thread.start

    def start(self):
        real_start(self)
        if self.name == "embedcore-rank-0":  # Ctrl-C now, between the ranks' starts
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
            time.sleep(0.05)  # (where it is not held off, it is raised here)

    monkeypatch.setattr(threading.Thread, "start", start)

    def fn(world):
        try:
            for _ in range(10**5):
                world.all_gather(world.rank)
        except ed.RankFailedError as e:
            seen.append((world.rank, str(e)))
            raise
        seen.append((world.rank, "finished"))

    with pytest.raises(KeyboardInterrupt):
        ed.run_local(2, fn)
    # The rank that had started was stopped, and done, when run_local raised; the other never ran.
    assert [r for r, _ in seen] == [0] and "run_local was interrupted (KeyboardInterrupt)" in seen[0][1], seen
    time.sleep(0.2)
    assert len(seen) == 1


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="reads the thread's signal mask from /proc")
def test_run_local_ranks_take_ctrl_c_as_the_caller_does():
    """The ranks' threads (and the processes they start, which inherit a
    thread's signal mask) do not block SIGINT: a Ctrl-C reaches a rank's
    subprocess (an earlier fix blocked it while the ranks started, and the
    ranks kept it: an interrupted run_local waited for their children)."""

    def fn(world):
        with open(f"/proc/self/task/{threading.get_native_id()}/status") as f:
            blocked = int(next(line for line in f if line.startswith("SigBlk:")).split()[1], 16)
        return bool(blocked & (1 << (2 - 1)))  # SIGINT is signal 2

    assert ed.run_local(2, fn) == [False, False]


def test_run_local_interrupted_waits_for_ranks_slow_to_stop():
    """A Ctrl-C that interrupts run_local's wait for its ranks: it waited
    for them again with Thread.join, which CPython 3.11 had marked as
    stopped (the interrupted join) while they still ran, so a rank slow to
    stop (cleaning up after its RankFailedError) was still running when
    run_local raised."""
    signal = _sigint_to_main_thread()
    seen = []

    def fn(world):
        try:
            while True:
                world.all_gather(world.rank)
        except ed.RankFailedError:
            time.sleep(0.4 if world.rank == 0 else 0.0)  # rank 0's cleanup after it was stopped: the longer
            seen.append(world.rank)
            raise

    timer = threading.Timer(0.2, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT))
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        ed.run_local(2, fn)
    timer.join()
    assert sorted(seen) == [0, 1]  # both ranks were done when run_local raised


def test_run_local_interrupted_stops_its_ranks_before_it_raises():
    """Ctrl-C in run_local's caller raised there while the ranks went on
    (training, then saving) on their daemon threads. Now every rank stops
    at its next collective with RankFailedError, and run_local waits for
    them before it raises."""
    signal = _sigint_to_main_thread()
    seen = []

    def fn(world):
        try:
            for _ in range(10**5):  # collectives until interrupted (about 8 s uninterrupted)
                world.all_gather(world.rank)
        except ed.RankFailedError as e:
            seen.append((world.rank, str(e)))
            raise
        seen.append((world.rank, "finished"))

    # A real signal to the main thread, as Ctrl-C: it interrupts the wait in Thread.join.
    timer = threading.Timer(0.2, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT))
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        ed.run_local(2, fn)
    timer.join()
    assert sorted(r for r, _ in seen) == [0, 1]  # both ranks were done when run_local raised
    assert all("run_local was interrupted (KeyboardInterrupt)" in m for _, m in seen), seen
