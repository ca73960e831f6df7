"""Checkpoints of sharded embeddings (embedcore.distributed, format 1.2).

A small Embedding with two tables ("a": 41 x 7 float16 with Adam, "b":
3 x 3 float32 with FTRL, fewer rows and columns than the largest world) is
trained on N ranks under each plan and saved; every checkpoint must restore
on M ranks under every plan, bit for bit, slots and step included, and load
unsharded; unsharded checkpoints must load sharded. Also: the manifest
records the plan; each rank writes only its own shards' files; one rank's
failed write or a corrupt file fails every rank and changes nothing; and
``reshard`` rewrites a checkpoint for another world (in place too).

The reference is the same model trained unsharded on the global batch (the
sharded updates are bit-identical to it, checked separately), so a block in
the wrong place, a lost slot or a wrong step shows as a byte difference.
Ranks are threads (``run_local``); each saved checkpoint is shared by the
tests through a module-scoped fixture, so the N x M x plan x plan grid
(256 loads) runs in seconds.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import threading
import time

import numpy as np
import pytest

import embedcore as ec
import embedcore.cli
from embedcore import _embedcore
from embedcore.distributed import CollectiveMismatchError, RankFailedError, Shard, run_local
from test_checkpoint_forge import DATA_OFFSET, flip_byte, read_manifest

WORLDS = (1, 2, 3, 4)
PLANS = ("table_wise", "row_wise", "column_wise", "auto")
BATCH, STEPS = 8, 3
SHAPES = {"a": (41, 7), "b": (3, 3)}
DTYPE = {"a": "float16", "b": "float32"}
SLOTS = {"a": ("momenta", "velocities"), "b": ("accumulators", "linears")}
TABLE_INDEX = {"a": 0, "b": 1}
FILE_NAME = re.compile(r"^t(\d{5})\.([a-z_]+)\.s(\d{5})\.g(\d{12,})\.ecd$")


# ------------------------------------------------------------------ the model and its data
def feature_config(seed=0, b_rows=SHAPES["b"][0]):
    """Two tables with different dims, dtypes and optimizers (so slots differ too)."""
    a = ec.TableConfig("a", *SHAPES["a"], DTYPE["a"], ec.initializers.Uniform(-1.0, 1.0, seed=seed + 1),
                       ec.optimizers.Adam(0.05), "mean")
    b = ec.TableConfig("b", b_rows, SHAPES["b"][1], DTYPE["b"], ec.initializers.Uniform(-1.0, 1.0, seed=seed + 2),
                       ec.optimizers.FTRL(0.1, l1_regularization_strength=0.01, beta=0.1), "sum")
    return {"a": ec.FeatureConfig(a, name="a"), "b": ec.FeatureConfig(b, name="b")}


def _global_batches():
    rng = np.random.default_rng(20261130)
    out = []
    for _ in range(STEPS):
        lengths = rng.integers(0, 4, BATCH)
        ids_a = rng.integers(0, SHAPES["a"][0], int(lengths.sum()))
        ids_b = rng.integers(0, SHAPES["b"][0], BATCH)
        grads_a = rng.standard_normal((BATCH, SHAPES["a"][1])).astype(np.float32)
        grads_b = rng.standard_normal((BATCH, SHAPES["b"][1])).astype(np.float32)
        out.append((lengths, ids_a, ids_b, grads_a, grads_b))
    return out


BATCHES = _global_batches()


def batch_part(step, rank, size):
    """Rank `rank`'s contiguous part of global batch `step` (the whole batch for size 1)."""
    lengths, ids_a, ids_b, grads_a, grads_b = BATCHES[step]
    lo, hi = rank * BATCH // size, (rank + 1) * BATCH // size
    off = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    feats = {"a": ec.Ragged(ids_a[off[lo]:off[hi]], off[lo:hi + 1] - off[lo]), "b": ids_b[lo:hi]}
    return feats, {"a": grads_a[lo:hi], "b": grads_b[lo:hi]}


def train(emb, rank=0, size=1, steps=range(STEPS)):
    for step in steps:
        feats, grads = batch_part(step, rank, size)
        emb(feats)
        emb.apply_gradients(grads)


# ------------------------------------------------------------------ states
def state(table):
    return {"values": np.array(table.values(), copy=True),
            "slots": {k: np.array(v, copy=True) for k, v in table.slots().items()},
            "step": table.step}


def block(st, s: Shard):
    rows, cols = slice(s.row_start, s.row_start + s.rows), slice(s.col_start, s.col_start + s.cols)
    return {"values": np.ascontiguousarray(st["values"][rows, cols]),
            "slots": {k: np.ascontiguousarray(v[rows, cols]) for k, v in st["slots"].items()},
            "step": st["step"]}


def same_state(a, b) -> bool:
    return (a["step"] == b["step"] and a["values"].dtype == b["values"].dtype
            and a["values"].tobytes() == b["values"].tobytes() and sorted(a["slots"]) == sorted(b["slots"])
            and all(a["slots"][k].tobytes() == b["slots"][k].tobytes() for k in a["slots"]))


def assert_state(got, expected, what):
    assert got["values"].dtype == expected["values"].dtype, f"{what}: values dtype"
    assert got["values"].shape == expected["values"].shape, f"{what}: shape"
    assert got["values"].tobytes() == expected["values"].tobytes(), f"{what}: values differ"
    assert sorted(got["slots"]) == sorted(expected["slots"]), f"{what}: slot names"
    for k in expected["slots"]:
        assert got["slots"][k].tobytes() == expected["slots"][k].tobytes(), f"{what}: slot {k} differs"
    assert got["step"] == expected["step"], f"{what}: step {got['step']} != {expected['step']}"


def shard_states(emb):
    """{(table name, Shard): state} of this rank's shards."""
    return {(name, s): state(t) for name, pairs in emb.local_shards.items() for s, t in pairs}


def assemble(per_rank):
    """The whole tables from every rank's shard states; checks that the shards tile them exactly."""
    pieces = {}
    for rank, states in enumerate(per_rank):
        for (name, s), st in states.items():
            assert s.rank == rank, f"rank {rank} holds a shard placed on rank {s.rank}"
            pieces.setdefault(name, []).append((s, st))
    out = {}
    for name, items in pieces.items():
        rows, dim = SHAPES[name]
        first = items[0][1]
        whole = {"values": np.zeros((rows, dim), first["values"].dtype),
                 "slots": {k: np.zeros((rows, dim), np.float32) for k in first["slots"]}, "step": first["step"]}
        seen = np.zeros((rows, dim), np.int64)
        for s, st in items:
            r, c = slice(s.row_start, s.row_start + s.rows), slice(s.col_start, s.col_start + s.cols)
            whole["values"][r, c] = st["values"]
            for k, v in st["slots"].items():
                whole["slots"][k][r, c] = v
            assert st["step"] == whole["step"], f"table '{name}': shards at different steps"
            seen[r, c] += 1
        assert (seen == 1).all(), f"table '{name}': the shards do not tile the table exactly once"
        out[name] = whole
    assert sorted(out) == sorted(SHAPES)
    return out


def tables_by_name(emb):
    return {t.name: t for t in emb.embedding_tables.values()}


def manifest_files(m):
    """Every data file a manifest names: (table name, array, entry)."""
    return [(t["name"], "values", f) for t in m["tables"] for f in t["values"]] + [
        (t["name"], slot, f) for t in m["tables"] for slot, files in t["slots"].items() for f in files]


def dir_bytes(path):
    out = {}
    for name in sorted(os.listdir(path)):
        with open(os.path.join(path, name), "rb") as f:
            out[name] = hashlib.sha256(f.read()).hexdigest()
    return out


def run_world(size, fn, timeout=120):
    """run_local(size, fn), failing the test instead of hanging when a rank is stuck in a collective."""
    box = {}

    def target():
        try:
            box["result"] = run_local(size, fn)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            box["error"] = e

    thread = threading.Thread(target=target, name=f"run_local({size})", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        pytest.fail(f"run_local({size}) did not finish in {timeout} s: a rank waits in a collective the others left")
    if "error" in box:
        raise box["error"]
    return box["result"]


def sharded_load(path, m, plan, seed=100, include_optimizer=True, b_rows=SHAPES["b"][0]):
    """Loads `path` into a fresh (untrained, other seeds) embedding on m ranks; per rank: (before, after, error)."""

    def fn(world):
        emb = ec.Embedding(feature_config(seed, b_rows), world=world, sharding=plan)
        before = shard_states(emb)
        try:
            ec.load(path, emb, include_optimizer=include_optimizer)
            error = None
        except Exception as e:  # noqa: BLE001 - what each rank raised is what is tested
            error = e
        return before, shard_states(emb), error, emb.plan

    return run_world(m, fn)


# ------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def reference():
    """The model trained unsharded on the global batches: {name: state}, and the Embedding."""
    emb = ec.Embedding(feature_config())
    train(emb)
    return {name: state(t) for name, t in tables_by_name(emb).items()}, emb


class Saved:
    def __init__(self, path, states, plan):
        self.path = path      # the checkpoint directory
        self.states = states  # per rank: {(name, Shard): state} when saved
        self.plan = plan      # the ShardingPlan it was saved under


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One checkpoint per (N, plan), trained on N ranks and saved collectively."""
    root = tmp_path_factory.mktemp("sharded")
    out = {}
    for n in WORLDS:
        for plan in PLANS:
            path = str(root / f"n{n}_{plan}")

            def fn(world, path=path, plan=plan):
                emb = ec.Embedding(feature_config(), world=world, sharding=plan)
                train(emb, world.rank, world.size)
                ec.save(path, emb)
                return shard_states(emb), emb.plan

            results = run_world(n, fn)
            out[(n, plan)] = Saved(path, [r[0] for r in results], results[0][1])
    return out


@pytest.fixture(scope="module")
def unsharded_checkpoint(tmp_path_factory, reference):
    path = str(tmp_path_factory.mktemp("unsharded") / "c")
    ec.save(path, reference[1])
    return path


def saved_params():
    return [pytest.param(n, plan, id=f"n{n}-{plan}") for n in WORLDS for plan in PLANS]


# ------------------------------------------------------------------ 1. save on N, restore on M
@pytest.mark.parametrize("n, plan", saved_params())
def test_sharded_training_matches_the_unsharded_reference(saved, reference, n, plan):
    """What each checkpoint holds: the unsharded model's state (the premise of the grid below)."""
    whole = assemble(saved[(n, plan)].states)
    for name in SHAPES:
        assert_state(whole[name], reference[0][name], f"table '{name}' trained on {n} ranks ({plan})")
        assert whole[name]["step"] == STEPS


@pytest.mark.parametrize("load_plan", PLANS)
@pytest.mark.parametrize("m", WORLDS)
@pytest.mark.parametrize("n, save_plan", saved_params())
def test_save_on_n_restore_on_m(saved, reference, n, save_plan, m, load_plan):
    ref = reference[0]
    results = sharded_load(saved[(n, save_plan)].path, m, load_plan)
    covered = {name: 0 for name in SHAPES}
    differed = {name: False for name in SHAPES}
    for rank, (before, after, error, _) in enumerate(results):
        assert error is None, f"rank {rank}: {error!r}"
        assert before.keys() == after.keys()
        for (name, s), st in after.items():
            assert s.rank == rank
            expected = block(ref[name], s)
            differed[name] |= not same_state(before[(name, s)], expected)
            assert_state(st, expected, f"rank {rank}/{m} ({load_plan}) table '{name}' rows {s.row_start}+{s.rows} "
                                       f"cols {s.col_start}+{s.cols}, saved on {n} ({save_plan})")
            covered[name] += s.rows * s.cols
    assert covered == {name: r * d for name, (r, d) in SHAPES.items()}, "the shards compared do not cover the tables"
    assert differed == {name: True for name in SHAPES}, "the targets held the checkpoint's state before the load"


# ------------------------------------------------------------------ 2. SOK's silent permutation
def test_row_wise_checkpoint_of_4_ranks_restores_on_3_with_every_row_in_place(saved, reference):
    """SOK restores a checkpoint saved on 4 GPUs onto 3 with rows silently
    permuted (the owner of an id depends on the world size). Here each id must
    look up its own row after a 4 -> 3 row-wise restore."""
    ref_emb = reference[1]
    ref_rows = {name: t.to_numpy() for name, t in tables_by_name(ref_emb).items()}
    perm = {name: np.random.default_rng(7).permutation(rows) for name, (rows, _) in SHAPES.items()}
    path = saved[(4, "row_wise")].path

    def lookups(world):
        emb = ec.Embedding(feature_config(seed=100), world=world, sharding="row_wise")
        ec.load(path, emb)
        # Every rank looks up every id (one id per bag), each rank in another order.
        ids = {name: np.roll(p, 5 * world.rank) for name, p in perm.items()}
        out = emb({"a": ec.Ragged(ids["a"], np.arange(ids["a"].size + 1)), "b": ids["b"]})
        return ids, out, emb.plan

    on4, on3 = run_world(4, lookups), run_world(3, lookups)
    starts = {w: [s.row_start for s in res[0][2]["a"].shards] for w, res in ((4, on4), (3, on3))}
    assert starts[4] != starts[3], "the two worlds place the rows alike: the test would not see a permutation"
    by_id = {}
    for world, results in ((4, on4), (3, on3)):
        for rank, (ids, out, _) in enumerate(results):
            for name in SHAPES:
                np.testing.assert_array_equal(out[name], ref_rows[name][ids[name]],
                                              err_msg=f"table '{name}' on rank {rank} of {world}")
                for i, row in zip(ids[name], out[name]):
                    by_id.setdefault((name, int(i)), []).append(row.tobytes())
    assert len(by_id) == sum(rows for rows, _ in SHAPES.values())
    for key, rows in by_id.items():
        assert len(rows) == 7 and len(set(rows)) == 1, f"{key}: the 4- and 3-rank worlds look up different rows"


# ------------------------------------------------------------------ 3. unsharded <-> sharded, manifest, tools
@pytest.mark.parametrize("n, plan", saved_params())
def test_sharded_checkpoint_loads_unsharded(saved, reference, n, plan):
    path = saved[(n, plan)].path
    emb = ec.Embedding(feature_config(seed=100))
    tables = tables_by_name(emb)
    for name in SHAPES:
        assert not same_state(state(tables[name]), reference[0][name])
    ec.load(path, emb)
    for name in SHAPES:
        assert_state(state(tables[name]), reference[0][name], f"plain Embedding, table '{name}'")
    # One table on its own, into a plain Table.
    lone = ec.Table(name="b", rows=3, dim=3, dtype="float32", optimizer=ec.optimizers.FTRL(0.1),
                    initializer=ec.initializers.Zeros())
    ec.load(path, lone)
    assert_state(state(lone), reference[0]["b"], "plain Table 'b'")
    lone_a = ec.Table(name="a", rows=41, dim=7, dtype="float16", optimizer=ec.optimizers.Adam(0.05))
    ec.load(path, lone_a, include_optimizer=False)
    assert lone_a.values().tobytes() == reference[0]["a"]["values"].tobytes()
    assert lone_a.step == 0 and not lone_a.slots()["momenta"].any()


@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("m", WORLDS)
def test_unsharded_checkpoint_loads_sharded(unsharded_checkpoint, reference, m, plan):
    m_json = read_manifest(unsharded_checkpoint)
    assert [t["sharding"] for t in m_json["tables"]] == [{"plan": "none", "world_size": 1}] * 2
    compared = 0
    for rank, (before, after, error, _) in enumerate(sharded_load(unsharded_checkpoint, m, plan)):
        assert error is None, f"rank {rank}: {error!r}"
        for (name, s), st in after.items():
            assert_state(st, block(reference[0][name], s), f"rank {rank}/{m} ({plan}) table '{name}'")
            compared += s.rows * s.cols
    assert compared == sum(r * d for r, d in SHAPES.values())


@pytest.mark.parametrize("n, plan", saved_params())
def test_manifest_records_the_plan(saved, n, plan, capsys):
    ckpt = saved[(n, plan)]
    m = read_manifest(ckpt.path)
    assert m["format_version"] == list(ec.FORMAT_VERSION)
    assert [t["name"] for t in m["tables"]] == ["a", "b"]
    for t in m["tables"]:
        name = t["name"]
        ts = ckpt.plan[name]
        if plan == "auto":
            assert ts.kind in ("table_wise", "row_wise"), ts.kind  # what "auto" chooses between
        else:
            assert ts.kind == plan
        assert t["sharding"] == {"plan": ts.kind, "world_size": n, "shards": [s._asdict() for s in ts.shards]}
        assert {s["rank"] for s in t["sharding"]["shards"]} <= set(range(n))
        assert (t["rows"], t["dim"], t["dtype"], t["step"]) == (*SHAPES[name], DTYPE[name], STEPS)
        assert tuple(t["slots"]) == SLOTS[name]
        # One file per shard and array, at the shard's place, named after its shard index.
        for array, files in [("values", t["values"]), *t["slots"].items()]:
            assert len(files) == len(ts.shards)
            for f in files:
                match = FILE_NAME.match(f["path"])
                assert match, f["path"]
                ti, arr, si, gen = int(match[1]), match[2], int(match[3]), int(match[4])
                assert (ti, arr, gen) == (TABLE_INDEX[name], array, m["generation"])
                s = ts.shards[si]
                assert (f["row_start"], f["rows"], f.get("col_start", 0), f["cols"]) == (
                    s.row_start, s.rows, s.col_start, s.cols), f["path"]
                assert f["dtype"] == (DTYPE[name] if array == "values" else "float32")
    # The checkpoint tools accept it.
    info = ec.checkpoint.read_info(ckpt.path)
    assert tuple(info.format_version) == tuple(ec.FORMAT_VERSION)
    assert list(info.table_names) == ["a", "b"]
    assert json.loads(info.table_sharding_json(0))["world_size"] == n
    assert embedcore.cli.main(["verify", ckpt.path]) == 0
    assert ": OK (2 table(s)" in capsys.readouterr().out
    assert embedcore.cli.main(["inspect", ckpt.path]) == 0
    out = capsys.readouterr().out
    assert f"over {n} rank(s)" in out


def test_sharded_and_unsharded_saves_to_one_path_replace_each_other(tmp_path, reference):
    """Generations go on across both kinds of save; each commit removes the other kind's files (ours only)."""
    path = str(tmp_path / "c")
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "t00000.values.s00000.g1.ecd").write_text("the user's (not our name: 1-digit generation)")
    ec.save(path, reference[1])
    unsharded_files = set(os.listdir(path))

    def save(world):
        emb = ec.Embedding(feature_config(), world=world, sharding="column_wise")
        train(emb, world.rank, world.size)
        ec.save(path, emb)

    run_world(3, save)
    m = read_manifest(path)
    assert m["generation"] == 2
    named = {f["path"] for _, _, f in manifest_files(m)}
    assert all(".s" in f for f in named)
    assert sorted(os.listdir(path)) == sorted(named | {"MANIFEST", "t00000.values.s00000.g1.ecd"})
    assert not (unsharded_files - {"MANIFEST", "t00000.values.s00000.g1.ecd"}) & set(os.listdir(path))
    _assert_loads_like_reference(path, reference, 2, "row_wise")

    # And back: an unsharded save removes the shard files.
    ec.save(path, reference[1])
    m = read_manifest(path)
    assert m["generation"] == 3
    named = {f["path"] for _, _, f in manifest_files(m)}
    assert not any(".s" in f for f in named)
    assert sorted(os.listdir(path)) == sorted(named | {"MANIFEST", "t00000.values.s00000.g1.ecd"})
    _assert_loads_like_reference(path, reference, 4, "column_wise")


# ------------------------------------------------------------------ 4. each rank writes its own shards
@pytest.mark.parametrize("n, plan", [p for p in saved_params() if p.values[0] > 1])
def test_each_rank_writes_only_its_own_shards(tmp_path, monkeypatch, n, plan):
    real = _embedcore.write_shard_files
    local = threading.local()
    lock = threading.Lock()
    calls = []  # (rank, table prefix, shard index, row_start, col_start, shard rows, shard cols, files)

    def spy(path, generation, prefix, shard_index, shard, row_start, col_start, *args, **kwargs):
        out = real(path, generation, prefix, shard_index, shard, row_start, col_start, *args, **kwargs)
        entry = json.loads(out)
        files = [f["path"] for f in entry["values"]] + [f["path"] for fs in entry["slots"].values() for f in fs]
        with lock:
            calls.append((local.rank, prefix, shard_index, row_start, col_start, shard.rows, shard.dim, files))
        return out

    monkeypatch.setattr(_embedcore, "write_shard_files", spy)
    path = str(tmp_path / "c")

    def fn(world):
        local.rank = world.rank
        assert threading.current_thread().name == f"embedcore-rank-{world.rank}"
        emb = ec.Embedding(feature_config(), world=world, sharding=plan)
        ec.save(path, emb)
        return emb.plan

    plan_obj = run_world(n, fn)[0]
    m = read_manifest(path)
    expected = {(TABLE_INDEX[name], si): s for name in SHAPES for si, s in enumerate(plan_obj[name].shards)}
    assert len(calls) == len(expected), "one write per shard"
    written_by = {}
    for rank, prefix, si, row_start, col_start, rows, cols, files in calls:
        ti = int(prefix[1:6])
        s = expected[(ti, si)]
        assert s.rank == rank, f"rank {rank} wrote shard {si} of table {ti}, which rank {s.rank} holds"
        assert (row_start, col_start, rows, cols) == (s.row_start, s.col_start, s.rows, s.cols)
        for f in files:
            match = FILE_NAME.match(f)
            assert match and (int(match[1]), int(match[3])) == (ti, si), f
            assert f not in written_by, f"{f} written twice"
            written_by[f] = rank
    assert {(int(c[1][1:6]), c[2]) for c in calls} == set(expected)
    # The manifest names exactly the files the ranks wrote, and each shard's rank.
    named = {f["path"] for _, _, f in manifest_files(m)}
    assert named == set(written_by)
    assert sorted(os.listdir(path)) == sorted(named | {"MANIFEST"})
    for t in m["tables"]:
        for si, s in enumerate(t["sharding"]["shards"]):
            mine = {f for f, r in written_by.items() if int(FILE_NAME.match(f)[3]) == si
                    and int(FILE_NAME.match(f)[1]) == TABLE_INDEX[t["name"]]}
            assert mine and {written_by[f] for f in mine} == {s["rank"]}
    assert len(set(written_by.values())) == len({s.rank for s in expected.values()})


# ------------------------------------------------------------------ 5. failures
class InjectedWriteError(OSError):
    pass


def test_a_failed_write_on_one_rank_fails_every_rank_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    real = _embedcore.write_shard_files
    local = threading.local()
    armed = threading.Event()
    injected = []

    wrote = []

    def failing(path, generation, prefix, shard_index, shard, *args, **kwargs):
        # Rank 1 writes its shard of table "a", then fails on its shard of "b".
        if armed.is_set() and local.rank == 1 and prefix == "t00001.":
            e = InjectedWriteError(28, "No space left on device (injected)")
            injected.append(e)
            raise e
        entry = real(path, generation, prefix, shard_index, shard, *args, **kwargs)
        if armed.is_set():
            wrote.append(entry)
        return entry

    monkeypatch.setattr(_embedcore, "write_shard_files", failing)
    real_remove, removers = _embedcore.remove_generation, []

    def remove(path, generation):
        removers.append(local.rank)
        return real_remove(path, generation)

    monkeypatch.setattr(_embedcore, "remove_generation", remove)
    path = str(tmp_path / "c")
    snap = {}

    def fn(world):
        local.rank = world.rank
        emb = ec.Embedding(feature_config(), world=world, sharding="row_wise")
        train(emb, world.rank, world.size, steps=[0])
        ec.save(path, emb)
        saved_state = shard_states(emb)
        if world.rank == 0:
            snap["manifest"] = read_manifest(path)
            snap["files"] = dir_bytes(path)
            armed.set()
        world.barrier()
        train(emb, world.rank, world.size, steps=[1])
        assert not all(same_state(saved_state[k], v) for k, v in shard_states(emb).items())
        try:
            ec.save(path, emb)
            error = None
        except Exception as e:  # noqa: BLE001
            error = e
        world.barrier()
        if world.rank == 0:
            snap["after_failure"] = sorted(os.listdir(path))
            snap["wrote"] = list(wrote)
            snap["files_after"] = dir_bytes(path)
            armed.clear()
        world.barrier()
        return saved_state, error, shard_states(emb)

    results = run_world(3, fn)
    errors = [r[1] for r in results]
    assert len(injected) == 1
    assert errors[1] is injected[0], f"rank 1 raised {errors[1]!r}"
    for rank in (0, 2):
        assert isinstance(errors[rank], RankFailedError), f"rank {rank} raised {errors[rank]!r}"
        assert "rank 1 of 3" in str(errors[rank]) and "No space left" in str(errors[rank])

    # The previous checkpoint is untouched: same manifest, same bytes of every file it names.
    old = snap["manifest"]
    assert read_manifest(path) == old
    named = {f["path"] for _, _, f in manifest_files(old)}
    for f in named | {"MANIFEST"}:
        assert snap["files_after"][f] == snap["files"][f], f"{f} changed"
    # The files the failed save wrote (ranks 0 and 2, and rank 1's "a") are removed again: nothing but the
    # previous checkpoint is left.
    assert snap["wrote"], "no rank wrote anything before the failure: the test does not exercise a partial save"
    assert set(snap["after_failure"]) == named | {"MANIFEST"}
    # By rank 0 alone, which holds the generation's claim: another rank's late removal could hit a later save
    # that claimed the generation again.
    assert removers == [0], removers

    # It still loads bit for bit (the state of the first save), on another world and plan.
    first = assemble([r[0] for r in results])
    for rank, (_, after, error, _) in enumerate(sharded_load(path, 2, "column_wise")):
        assert error is None
        for (name, s), st in after.items():
            assert_state(st, block(first[name], s), f"rank {rank} table '{name}'")

    # A later save succeeds.
    def save_again(world):
        emb = ec.Embedding(feature_config(seed=3), world=world, sharding="row_wise")
        ec.save(path, emb)

    run_world(3, save_again)
    m = read_manifest(path)
    assert m["generation"] > old["generation"]  # the failed generation left no file: its number may come again
    assert sorted(os.listdir(path)) == sorted({f["path"] for _, _, f in manifest_files(m)} | {"MANIFEST"})


class Preempted(BaseException):
    """A rank stopped on its own (a signal handler's SystemExit, an interrupt), outside any agreement."""


def test_a_rank_stopped_on_its_own_removes_nothing_while_rank_0_commits(tmp_path, monkeypatch):
    """Only failures that every rank saw (reported through the agreement)
    remove a save's files. A rank that stops on its own after the shard
    files were agreed must not: rank 0 goes on to commit them, and a removal
    racing that commit could leave a manifest naming deleted files, and the
    previous checkpoint deleted by the commit."""
    from embedcore.distributed import _checkpoint as dc

    real_agree, real_commit = dc.agree, _embedcore.commit_checkpoint
    removed, committed = [], threading.Event()
    local = threading.local()

    def agree(comm, error, payload=None, *, step):
        out = real_agree(comm, error, payload, step=step)
        if step.startswith("save: shard files") and comm.rank == 1:
            committed.wait(30)  # the commit has happened: a removal now would delete the live checkpoint's files
            raise Preempted("rank 1 stopped")
        return out

    def commit(path, manifest_json):
        real_commit(path, manifest_json)
        committed.set()

    monkeypatch.setattr(dc, "agree", agree)
    monkeypatch.setattr(_embedcore, "commit_checkpoint", commit)
    monkeypatch.setattr(_embedcore, "remove_generation", lambda *a: removed.append((local.rank, a)))
    path = str(tmp_path / "c")

    def fn(world):
        local.rank = world.rank
        emb = ec.Embedding(feature_config(seed=4), world=world, sharding="row_wise")
        ec.save(path, emb)

    with pytest.raises(Preempted):
        run_world(2, fn)
    assert removed == []
    m = read_manifest(path)
    assert sorted(os.listdir(path)) == sorted({f["path"] for _, _, f in manifest_files(m)} | {"MANIFEST"})
    for _, after, error, _ in sharded_load(path, 1, "row_wise"):
        assert error is None


def test_a_failed_commit_fails_every_rank_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch, saved):
    path = str(tmp_path / "c")
    shutil.copytree(saved[(2, "row_wise")].path, path)
    before = dir_bytes(path)

    def failing_commit(path, manifest_json):
        raise OSError(5, "Input/output error (injected)")

    monkeypatch.setattr(_embedcore, "commit_checkpoint", failing_commit)

    def fn(world):
        emb = ec.Embedding(feature_config(seed=9), world=world, sharding="column_wise")
        try:
            ec.save(path, emb)
        except Exception as e:  # noqa: BLE001
            return e

    errors = run_world(3, fn)
    assert isinstance(errors[0], OSError) and "injected" in str(errors[0])
    assert all(isinstance(e, RankFailedError) and "rank 0 of 3" in str(e) for e in errors[1:]), errors
    assert dir_bytes(path) == before  # every rank's shard files of the failed save removed again


def test_a_save_to_a_path_that_is_a_file_fails_every_rank(tmp_path):
    path = tmp_path / "not_a_dir"
    path.write_bytes(b"user data")

    def fn(world):
        emb = ec.Embedding(feature_config(), world=world, sharding="row_wise")
        try:
            ec.save(path, emb)
        except Exception as e:  # noqa: BLE001
            return e

    errors = run_world(3, fn)
    assert isinstance(errors[0], OSError) and not isinstance(errors[0], RankFailedError), errors[0]
    assert all(isinstance(e, RankFailedError) for e in errors[1:]), errors
    # The other ranks learn rank 0's own error through the save's agreement (not that rank 0 left).
    assert all("not a directory" in str(e) for e in errors[1:]), errors
    assert path.read_bytes() == b"user data"


def _shard_file(path, table, array, shard_index):
    m = read_manifest(path)
    (t,) = [t for t in m["tables"] if t["name"] == table]
    files = t["values"] if array == "values" else t["slots"][array]
    (f,) = [f for f in files if int(FILE_NAME.match(f["path"])[3]) == shard_index]
    return f


@pytest.mark.parametrize("array", ["values", "momenta"])
@pytest.mark.parametrize("m, plan", [(4, "row_wise"), (3, "row_wise"), (2, "column_wise"), (1, "table_wise"),
                                     (4, "auto")])
def test_a_corrupt_shard_file_fails_the_ranks_that_read_it_and_changes_no_rank(tmp_path, saved, reference, m, plan,
                                                                                array):
    path = str(tmp_path / "c")
    shutil.copytree(saved[(4, "row_wise")].path, path)
    f = _shard_file(path, "a", array, 2)
    elem = 2 if array == "values" else 4
    flip_byte(os.path.join(path, f["path"]), DATA_OFFSET + (f["rows"] // 2) * f["cols"] * elem + 1, 0x40)
    lo, hi = f["row_start"], f["row_start"] + f["rows"]

    results = sharded_load(path, m, plan)
    plan_obj = results[0][3]
    readers = {s.rank for s in plan_obj["a"].shards if s.row_start < hi and lo < s.row_start + s.rows}
    assert readers, "no rank reads the corrupt file"
    for rank, (before, after, error, _) in enumerate(results):
        if rank in readers:
            assert isinstance(error, ec.CheckpointError), f"rank {rank} raised {error!r}"
            assert f["path"] in str(error) and "checksum mismatch" in str(error)
        else:
            assert isinstance(error, RankFailedError), f"rank {rank} raised {error!r}"
            assert "CheckpointError" in str(error)
        assert before.keys() == after.keys()
        for key in before:
            assert_state(after[key], before[key], f"rank {rank}: {key} changed by a failed load")

    if array == "momenta":
        # Values only: the corrupt slot file is not read, and the load succeeds.
        for rank, (before, after, error, _) in enumerate(sharded_load(path, m, plan, include_optimizer=False)):
            assert error is None, f"rank {rank}: {error!r}"
            for (name, s), st in after.items():
                exp = block(reference[0][name], s)
                assert st["values"].tobytes() == exp["values"].tobytes()
                assert_state({**st, "values": before[(name, s)]["values"]}, before[(name, s)], "slots/step")


@pytest.mark.parametrize("m, plan", [(4, "row_wise"), (3, "table_wise"), (2, "column_wise")])
def test_a_table_of_another_shape_fails_the_load_and_changes_no_rank(saved, m, plan):
    path = saved[(3, "column_wise")].path
    results = sharded_load(path, m, plan, b_rows=4)
    holders = {s.rank for s in results[0][3]["b"].shards}
    for rank, (before, after, error, _) in enumerate(results):
        if rank in holders:
            assert isinstance(error, ec.CheckpointError), f"rank {rank} raised {error!r}"
            assert "'b'" in str(error) and "3 x 3" in str(error) and "4 x 3" in str(error), str(error)
        else:
            assert isinstance(error, RankFailedError) and "'b'" in str(error), f"rank {rank} raised {error!r}"
        for key in before:
            assert_state(after[key], before[key], f"rank {rank}: {key} changed by a failed load")
    # Unsharded too.
    emb = ec.Embedding(feature_config(seed=100, b_rows=4))
    snap = {name: state(t) for name, t in tables_by_name(emb).items()}
    with pytest.raises(ec.CheckpointError, match="'b'"):
        ec.load(path, emb)
    for name, t in tables_by_name(emb).items():
        assert_state(state(t), snap[name], f"unsharded table '{name}'")


# ------------------------------------------------------------------ 6. reshard
def _assert_loads_like_reference(path, reference, m, plan):
    compared = 0
    for rank, (_, after, error, _) in enumerate(sharded_load(path, m, plan)):
        assert error is None, f"rank {rank}: {error!r}"
        for (name, s), st in after.items():
            assert_state(st, block(reference[0][name], s), f"rank {rank}/{m} ({plan}) table '{name}'")
            compared += s.rows * s.cols
    assert compared == sum(r * d for r, d in SHAPES.values())
    emb = ec.Embedding(feature_config(seed=100))
    ec.load(path, emb)
    for name, t in tables_by_name(emb).items():
        assert_state(state(t), reference[0][name], f"unsharded table '{name}'")


@pytest.mark.parametrize("src, m, plan", [((4, "row_wise"), 3, "column_wise"), ((1, "table_wise"), 4, "row_wise"),
                                          ((3, "column_wise"), 2, "auto"), ((2, "auto"), 1, "table_wise"),
                                          ((4, "column_wise"), 3, "row_wise")])
def test_reshard_gives_a_checkpoint_that_loads_bit_exact(tmp_path, saved, reference, src, m, plan):
    src_path = saved[src].path
    src_before = dir_bytes(src_path)
    dst = str(tmp_path / "dst")
    max_file_bytes = 600
    text = ec.distributed.reshard(src_path, dst, m, plan, max_file_bytes=max_file_bytes)
    assert f"sharding over {m} ranks" in text
    assert dir_bytes(src_path) == src_before, "reshard changed its source"
    man = read_manifest(dst)
    assert man["format_version"] == list(ec.FORMAT_VERSION)
    for t in man["tables"]:
        sh = t["sharding"]
        assert sh["world_size"] == m
        assert (sh["plan"] in ("table_wise", "row_wise")) if plan == "auto" else (sh["plan"] == plan)
        assert {s["rank"] for s in sh["shards"]} <= set(range(m))
        bytes_per_element = {"float16": 2, "float32": 4}[t["dtype"]] + 4 * len(t["slots"])
        for f in t["values"]:
            # Each piece holds at most max_file_bytes of values and slots (or one row when a row is larger).
            assert f["rows"] * f["cols"] * bytes_per_element <= max(max_file_bytes, f["cols"] * bytes_per_element)
            # ... and lies within one shard of the new plan.
            assert any(s["row_start"] <= f["row_start"] and f["row_start"] + f["rows"] <= s["row_start"] + s["rows"]
                       and s["col_start"] == f.get("col_start", 0) and s["cols"] == f["cols"] for s in sh["shards"])
    (ta,) = [t for t in man["tables"] if t["name"] == "a"]
    assert len(ta["values"]) > len(ta["sharding"]["shards"]), "max_file_bytes did not split table 'a'"
    assert embedcore.cli.main(["verify", dst]) == 0
    _assert_loads_like_reference(dst, reference, m, plan)
    _assert_loads_like_reference(dst, reference, 2, "row_wise")


def test_reshard_with_max_file_bytes_0_writes_one_file_per_shard(tmp_path, saved, reference):
    dst = str(tmp_path / "dst")
    ec.distributed.reshard(saved[(2, "column_wise")].path, dst, 4, "row_wise", max_file_bytes=0)
    for t in read_manifest(dst)["tables"]:
        assert len(t["values"]) == len(t["sharding"]["shards"])
        assert [(f["row_start"], f["rows"]) for f in t["values"]] == [
            (s["row_start"], s["rows"]) for s in t["sharding"]["shards"]]
    _assert_loads_like_reference(dst, reference, 4, "row_wise")


def test_reshard_in_place(tmp_path, saved, reference):
    path = str(tmp_path / "c")
    shutil.copytree(saved[(4, "row_wise")].path, path)
    (tmp_path / "c" / "notes.txt").write_text("the user's")
    old = read_manifest(path)
    ec.distributed.reshard(path, path, 2, "column_wise", max_file_bytes=64)
    new = read_manifest(path)
    assert new["generation"] > old["generation"]
    assert [t["sharding"]["plan"] for t in new["tables"]] == ["column_wise", "column_wise"]
    assert all(t["sharding"]["world_size"] == 2 for t in new["tables"])
    # The old generation's files are gone, the user's file kept.
    assert sorted(os.listdir(path)) == sorted({f["path"] for _, _, f in manifest_files(new)} | {"MANIFEST", "notes.txt"})
    _assert_loads_like_reference(path, reference, 2, "column_wise")
    _assert_loads_like_reference(path, reference, 3, "row_wise")


@pytest.mark.parametrize("in_place", [False, True], ids=["to_another_dir", "in_place"])
def test_a_reshard_that_fails_part_way_removes_what_it_wrote(tmp_path, monkeypatch, saved, in_place):
    """Table "a" is rewritten, then a corrupt file of table "b" fails the
    reshard: it raises, leaves the source (and, in place, the directory)
    byte for byte as it was, and removes the files it had written."""
    src = str(tmp_path / "src")
    shutil.copytree(saved[(2, "row_wise")].path, src)
    (tmp_path / "src" / "notes.txt").write_text("the user's")
    victim = next(f["path"] for t, _, f in manifest_files(read_manifest(src)) if t == "b")
    with open(os.path.join(src, victim), "r+b") as fh:
        fh.seek(-1, os.SEEK_END)
        last = fh.read(1)
        fh.seek(-1, os.SEEK_END)
        fh.write(bytes([last[0] ^ 0x40]))
    before = dir_bytes(src)
    dst = src if in_place else str(tmp_path / "dst")
    written = []
    real = _embedcore.write_shard_files

    def spy(*args, **kwargs):
        written.append(real(*args, **kwargs))
        return written[-1]

    monkeypatch.setattr(_embedcore, "write_shard_files", spy)
    with pytest.raises(ec.CheckpointError, match=re.escape(victim) + ".*checksum mismatch"):
        ec.distributed.reshard(src, dst, 3, "row_wise", max_file_bytes=64)
    assert written, "nothing was written before the failure: the test does not exercise a partial reshard"
    assert dir_bytes(src) == before
    if not in_place:
        assert not os.path.exists(dst)  # the directory it made, removed with what it wrote


def test_an_in_place_reshard_removes_what_dead_saves_left(tmp_path, monkeypatch, saved):
    """An in-place reshard removes the files of a save that died (a killed
    reshard's) when it claims its generation, as every save does, also when
    it then fails: on a disk they filled it would otherwise fail for ever
    (its own shared lock on the source kept the removal from running)."""
    path = str(tmp_path / "c")
    shutil.copytree(saved[(2, "row_wise")].path, path)
    live = sorted(os.listdir(path))
    dead = ["MANIFEST.tmp.g000000000009", "t00000.values.s00001.g000000000009.ecd"]
    for name in dead:
        with open(os.path.join(path, name), "wb") as fh:
            fh.write(b"x" * 1000)

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(_embedcore, "write_shard_files", disk_full)
    with pytest.raises(OSError, match="No space left"):
        ec.distributed.reshard(path, path, 3, "row_wise")
    assert sorted(os.listdir(path)) == live
    monkeypatch.undo()
    ec.distributed.reshard(path, path, 3, "row_wise")
    assert read_manifest(path)["tables"][0]["sharding"]["world_size"] == 3


def test_reshard_cli(tmp_path, saved, reference, capsys):
    dst = str(tmp_path / "dst")
    assert embedcore.cli.main(["reshard", saved[(3, "auto")].path, dst, "--world", "3",
                               "--plan", "a=row_wise,b=column_wise", "--max-file-mb", "0"]) == 0
    assert f"wrote {dst}" in capsys.readouterr().out
    assert [t["sharding"]["plan"] for t in read_manifest(dst)["tables"]] == ["row_wise", "column_wise"]
    _assert_loads_like_reference(dst, reference, 3, {"a": "row_wise", "b": "column_wise"})
    assert embedcore.cli.main(["reshard", saved[(3, "auto")].path, str(tmp_path / "dst2"), "--world", "2",
                               "--plan", "a=row_wise,a=column_wise"]) == 1
    assert "--plan names table 'a' more than once" in capsys.readouterr().err
    assert not (tmp_path / "dst2").exists()


def test_reshard_cli_max_file_mb_and_no_optimizer(tmp_path, capsys):
    """docs/distributed.md: --max-file-mb N writes pieces of at most N MiB of
    values and slots, and --no-optimizer the values alone. An Adagrad table
    of 1025 rows of 1 KiB (1 MiB and a row of values, as much of slots):
    1 MiB pieces hold 512 rows with their accumulators, or 1024 rows of
    values alone."""
    src = tmp_path / "src"
    table = ec.Table(name="t", rows=1025, dim=256, optimizer=ec.optimizers.Adagrad(0.1),
                     initializer=ec.initializers.Uniform(-1, 1, seed=3))
    ec.save(src, table)
    for name, flags, pieces, slots in (("with_slots", ["--max-file-mb", "1"], [512, 512, 1], ["accumulators"]),
                                       ("values", ["--max-file-mb", "1", "--no-optimizer"], [1024, 1], [])):
        dst = tmp_path / name
        assert embedcore.cli.main(["reshard", str(src), str(dst), "--world", "1"] + flags) == 0, flags
        capsys.readouterr()
        (t,) = read_manifest(dst)["tables"]
        assert [f["rows"] for f in t["values"]] == pieces, flags
        assert sorted(t.get("slots") or {}) == slots, flags
        for slot in slots:
            assert [f["rows"] for f in t["slots"][slot]] == pieces, flags
        assert (t["optimizer"] or {}).get("kind") == ("adagrad" if slots else None), flags
        served = ec.serving.open(dst).tables["t"]
        np.testing.assert_array_equal(served.lookup(np.arange(1025), combiner=None), table.values())
    back = ec.Table(name="t", rows=1025, dim=256, optimizer=ec.optimizers.Adagrad(0.1))
    ec.load(tmp_path / "with_slots", into=back)
    assert back.slots()["accumulators"].tobytes() == table.slots()["accumulators"].tobytes()
    # A copy without its slot files (which serves, and loads values only) reshards values only: no slot
    # file is read (docs/format.md: only the files a read needs must be present).
    copy = tmp_path / "values_only_copy"
    copy.mkdir()
    for f in src.iterdir():
        if "accumulators" not in f.name:
            shutil.copy(f, copy / f.name)
    assert embedcore.cli.main(["reshard", str(copy), str(tmp_path / "from_copy"), "--world", "2",
                               "--no-optimizer"]) == 0
    capsys.readouterr()
    np.testing.assert_array_equal(ec.serving.open(tmp_path / "from_copy").tables["t"].lookup(
        np.arange(1025), combiner=None), table.values())
    assert embedcore.cli.main(["reshard", str(copy), str(tmp_path / "with_missing"), "--world", "2"]) == 1
    assert "missing file" in capsys.readouterr().err


@pytest.mark.parametrize("kwargs", [
    dict(world_size=0), dict(world_size=-2), dict(world_size=2.0), dict(world_size=True), dict(world_size="2"),
    dict(world_size=10**11),  # a MemoryError (a traceback from the CLI) while planning
    dict(max_file_bytes=-1), dict(max_file_bytes=1.5), dict(max_file_bytes=True),
    dict(plan="diagonal"), dict(plan={"nope": "row_wise"}), dict(plan={"a": "by_hash"}),
], ids=lambda kw: "-".join(f"{k}={v!r}" for k, v in kw.items()))
def test_reshard_rejects_bad_arguments(tmp_path, saved, kwargs):
    src = saved[(2, "row_wise")].path
    src_before = dir_bytes(src)
    dst = tmp_path / "dst"
    args = dict(world_size=2, plan="auto", max_file_bytes=1 << 20)
    args.update(kwargs)
    wrong_type = any(isinstance(v, (bool, float, str)) for k, v in kwargs.items() if k != "plan")
    with pytest.raises(TypeError if wrong_type else ValueError):  # (wrong types were ValueError)
        ec.distributed.reshard(src, dst, args["world_size"], args["plan"], max_file_bytes=args["max_file_bytes"])
    assert not dst.exists(), "a rejected reshard created its destination"
    assert dir_bytes(src) == src_before


@pytest.mark.parametrize("world,max_file_bytes", [(1, 4), (100_001, 0)])
def test_reshard_refuses_more_pieces_than_file_names_hold_before_writing(tmp_path, world, max_file_bytes):
    """100,001 one-row pieces: refused at once, naming the way out, rather than failing at piece 100,000."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    table = ec.Table(name="t", rows=100_001, dim=1, initializer=ec.initializers.Uniform(-1, 1, seed=4))
    ec.save(src, table)
    cpu0 = time.process_time()  # (CPU time, which the machine's load does not stretch)
    with pytest.raises(ValueError, match=r"table 't' would be written in 100001 pieces, over 99999: raise "
                                         r"max_file_bytes") as raised:
        ec.distributed.reshard(src, dst, world, "row_wise", max_file_bytes=max_file_bytes)
    assert ("lower world_size" in str(raised.value)) == (world > 1), "advice that cannot be followed (world_size 1)"
    assert time.process_time() - cpu0 < 10, "refused only after writing"
    assert not dst.exists()
    if world == 1:
        ec.distributed.reshard(src, dst, 1, "row_wise", max_file_bytes=400)  # 1,001 pieces of 100 rows
        served = ec.serving.open(dst).tables["t"].lookup(np.arange(100_001), combiner=None)
        np.testing.assert_array_equal(served, table.values())


def test_reshard_of_no_checkpoint_raises_checkpoint_error(tmp_path):
    with pytest.raises(ec.CheckpointError, match="no such checkpoint"):
        ec.distributed.reshard(tmp_path / "missing", tmp_path / "dst", 2)
    assert not (tmp_path / "dst").exists()


def test_reshard_keeps_the_stored_dtype_of_an_export(tmp_path, reference):
    """A float16 serving export of a float32 table ("b") stays float16 when
    resharded (docs/distributed.md suggests `reshard --world 1` to make a
    sharded export servable); it must not come back twice as large as float32."""
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")

    def export(world):
        emb = ec.Embedding(feature_config(), world=world, sharding="row_wise")
        train(emb, world.rank, world.size)
        ec.save(src, emb, include_optimizer=False, values_dtype="float16")

    run_world(2, export)
    stored = {t["name"]: {f["dtype"] for f in t["values"]} for t in read_manifest(src)["tables"]}
    assert stored == {"a": {"float16"}, "b": {"float16"}}
    ec.distributed.reshard(src, dst, 1, "table_wise", max_file_bytes=0)
    m = read_manifest(dst)
    # The values are the same either way (float16 -> float32 is exact) ...
    a, b = ec.Embedding(feature_config(seed=100)), ec.Embedding(feature_config(seed=100))
    ec.load(src, a)
    ec.load(dst, b)
    for name in SHAPES:
        assert tables_by_name(a)[name].to_numpy().tobytes() == tables_by_name(b)[name].to_numpy().tobytes()
    # ... but the export's stored dtype and size must be kept.
    assert {t["name"]: {f["dtype"] for f in t["values"]} for t in m["tables"]} == stored
    (tb,) = [t for t in m["tables"] if t["name"] == "b"]
    assert tb["values"][0]["bytes"] == DATA_OFFSET + 3 * 3 * 2


def test_bytes_paths_work_sharded_as_unsharded(tmp_path, reference):
    """ec.save / ec.load take a bytes path (os.fsdecode) for an unsharded
    Embedding; a sharded one and reshard raised TypeError from the engine."""
    path, dst = os.fsencode(tmp_path / "c"), os.fsencode(tmp_path / "r")

    def fn(world):
        emb = ec.Embedding(feature_config(), world=world, sharding="row_wise")
        train(emb, world.rank, world.size)
        ec.save(path, emb)
        ec.load(path, emb)

    run_world(2, fn)
    ec.distributed.reshard(path, dst, 3, "column_wise")
    _assert_loads_like_reference(os.fsdecode(dst), reference, 2, "row_wise")
    for rank, (_, _, error, _) in enumerate(sharded_load(dst, 3, "table_wise")):
        assert error is None, f"rank {rank}: {error!r}"


def test_ranks_that_read_different_checkpoints_load_nothing(tmp_path, monkeypatch):
    """A link re-pointed between two ranks' reads of the manifest (or a
    commit between them) would give each rank the blocks of another
    checkpoint: the ranks compare what they read, and refuse before any
    table changes."""
    import threading

    import embedcore.distributed._checkpoint as dc

    def filled(v):
        t = ec.Table(ec.TableConfig("t", 8, 2))
        t.assign(np.full((8, 2), v, np.float32))
        return t

    ec.save(tmp_path / "v1", filled(1.0))
    ec.save(tmp_path / "v2", filled(2.0))
    link = tmp_path / "current"
    os.symlink(tmp_path / "v1", link)
    resolve, lock, first_done, calls = dc.resolved_path, threading.Lock(), threading.Event(), []

    def repointed_after_the_first(p):
        with lock:
            calls.append(p)
            first = len(calls) == 1
        if first:
            r = resolve(p)
            os.unlink(link)
            os.symlink(tmp_path / "v2", link)
            first_done.set()
            return r
        first_done.wait()
        return resolve(p)

    monkeypatch.setattr(dc, "resolved_path", repointed_after_the_first)

    def fn(world):
        emb = ec.Embedding({"f": ec.FeatureConfig(ec.TableConfig("t", 8, 2, initializer=ec.initializers.Zeros()))},
                           world=world, sharding="row_wise")
        try:
            ec.load(link, emb)
            error = None
        except ec.CheckpointError as e:
            error = str(e)
        return error, sorted({float(x) for _, t in emb.local_shards["t"] for x in t.to_numpy().ravel()})

    for error, values in run_local(2, fn):
        assert error is not None and "the ranks read different checkpoints" in error
        assert values == [0.0]  # nothing loaded


# ------------------------------------------------------------------ arguments every rank must agree on
def _trained_and_saved_by_three_ranks(tmp_path) -> str:
    path = str(tmp_path / "c")

    def save(world):
        emb = ec.Embedding(feature_config(), world=world, sharding="row_wise")
        train(emb, world.rank, world.size)
        ec.save(path, emb)

    run_world(3, save)
    return path


@pytest.mark.parametrize("arg, values", [
    ("include_optimizer", (True, False, False)),
    ("include_optimizer", (False, True, True)),
    ("values_dtype", (None, "float16", "float16")),
], ids=["include_optimizer-rank0-only", "include_optimizer-all-but-rank0", "values_dtype"])
def test_ranks_saving_with_different_arguments_are_refused_and_write_nothing(tmp_path, arg, values):
    """include_optimizer and values_dtype decide what each rank writes and
    what rank 0's manifest says of every rank's files: they are compared in
    the step that compares the path, and every rank raises ValueError naming
    each rank's value; the previous checkpoint stays, byte for byte."""
    path = _trained_and_saved_by_three_ranks(tmp_path)
    before = dir_bytes(path)

    def fn(world):
        emb = ec.Embedding(feature_config(), world=world, sharding="row_wise")
        train(emb, world.rank, world.size)
        try:
            ec.save(path, emb, **{arg: values[world.rank]})
        except Exception as e:  # noqa: BLE001 - what each rank raised is what is tested
            return e
        return None

    listed = ", ".join(f"rank {r} {v!r}" for r, v in enumerate(values))
    for r, e in enumerate(run_world(3, fn)):
        assert isinstance(e, ValueError), (r, repr(e))
        assert f"different {arg} ({listed})" in str(e) and "nothing was written" in str(e), str(e)
    assert dir_bytes(path) == before


@pytest.mark.parametrize("existing", [False, True], ids=["new-directory", "over-a-checkpoint"])
@pytest.mark.parametrize("other", ["lookup", "raises"])
def test_a_save_other_ranks_do_not_join_leaves_the_directory_as_it_was(tmp_path, existing, other):
    """Rank 0 saves while rank 1 looks up (CollectiveMismatchError on both) or
    fails outside embedcore (rank 0's save raises RankFailedError): rank 0 had
    claimed the save's generation, and drops the claim, so the path is left as
    it was (no claim file beside the checkpoint, no new directory)."""
    path = _trained_and_saved_by_three_ranks(tmp_path) if existing else str(tmp_path / "new")
    before = dir_bytes(path) if existing else None

    def fn(world):
        emb = ec.Embedding(feature_config(), world=world, sharding="row_wise")
        if world.rank == 1:
            if other == "raises":
                raise RuntimeError("rank 1's own error")
            with pytest.raises(CollectiveMismatchError):
                emb({"a": np.array([1]), "b": np.array([2])})
            return None
        with pytest.raises(CollectiveMismatchError if other == "lookup" else RankFailedError):
            ec.save(path, emb)
        return None

    if other == "raises":
        with pytest.raises(RuntimeError, match="rank 1's own error"):
            run_world(2, fn)
    else:
        run_world(2, fn)
    if existing:
        assert dir_bytes(path) == before
    else:
        assert not os.path.lexists(path)


@pytest.mark.parametrize("plan", ["row_wise", "column_wise"])
def test_a_sharded_dump_to_file_keeps_the_other_tables_there(tmp_path, plan):
    """Saver.dump_to_file of a sharded Embedding, as of an unsharded one,
    keeps the tables of other names dumped into the directory before (SOK 1.x
    dumps several variables into one directory in turn), with their slots and
    step: the sharded tables restore from it bit for bit, and so do the
    others. Its own tables there are replaced."""
    path = str(tmp_path / "dump")
    saver = ec.Saver()
    user = ec.Table(name="user", rows=6, dim=3, optimizer=ec.optimizers.Adagrad(0.1),
                    initializer=ec.initializers.Uniform(-1, 1, seed=5))
    user.apply_gradients(np.array([1, 4]), np.array([0, 1, 2]), np.ones((2, 3), np.float32))
    saver.dump_to_file(user, path)
    stale = ec.Table(name="a", rows=SHAPES["a"][0], dim=SHAPES["a"][1], dtype=DTYPE["a"],
                     initializer=ec.initializers.Constant(7.0))
    saver.dump_to_file(stale, path)  # replaced by the sharded table "a"

    def fn(world):
        emb = ec.Embedding(feature_config(), world=world, sharding=plan)
        train(emb, world.rank, world.size)
        assert saver.dump_to_file(emb, path) == "OK"
        again = ec.Embedding(feature_config(seed=100), world=world, sharding=plan)
        assert saver.restore_from_file(again, path) == "OK"
        return shard_states(emb), shard_states(again)

    for mine, restored in run_world(2, fn):
        assert mine.keys() == restored.keys()
        for key in mine:
            assert_state(restored[key], mine[key], f"rank's shard {key}")
    assert list(ec.checkpoint.read_info(path).table_names) == ["user", "a", "b"]  # the order there, new ones last
    got = ec.Table(name="user", rows=6, dim=3, optimizer=ec.optimizers.Adagrad(0.1))
    saver.restore_from_file(got, path)
    assert_state(state(got), state(user), "the kept table")


def test_a_sharded_save_or_dump_of_more_tables_than_file_names_number_is_refused(tmp_path, monkeypatch):
    """As an unsharded one (test_checkpoint.py): a table's index is 5 digits
    of its file names; over that, nothing is written, and every rank raises
    the ValueError (a dump: rank 0, which reads the tables it keeps; the
    others RankFailedError naming it). The limit lowered here."""
    path = str(tmp_path / "dump")
    ec.save(path, ec.Table(name="user", rows=6, dim=3))
    before = sorted(os.listdir(path))
    monkeypatch.setattr(ec.checkpoint, "MAX_TABLES", 1)

    def fn(world):
        emb = ec.Embedding(feature_config(), world=world, sharding="table_wise")
        dump = ValueError if world.rank == 0 else RankFailedError
        with pytest.raises(dump, match="dump_to_file: 3 tables with those the checkpoint there keeps; a checkpoint "
                                       "holds at most 1"):
            ec.Saver().dump_to_file(emb, path)
        with pytest.raises(ValueError, match="save: 2 tables; a checkpoint holds at most 1"):
            ec.save(str(tmp_path / "new"), emb)
        return world.rank

    assert run_world(2, fn) == [0, 1]
    assert sorted(os.listdir(path)) == before
    assert not os.path.exists(tmp_path / "new")


def test_ranks_calling_save_and_dump_to_file_are_refused_and_write_nothing(tmp_path):
    """A dump keeps the other tables there and a save replaces them: ranks
    that make different calls would leave rank 0's choice deciding, so every
    rank raises ValueError naming each one's, and the checkpoint stays."""
    path = _trained_and_saved_by_three_ranks(tmp_path)
    before = dir_bytes(path)

    def fn(world):
        emb = ec.Embedding(feature_config(), world=world, sharding="row_wise")
        try:
            if world.rank == 1:
                ec.Saver().dump_to_file(emb, path)
            else:
                ec.save(path, emb)
        except Exception as e:  # noqa: BLE001 - what each rank raised is what is tested
            return e
        return None

    for r, e in enumerate(run_world(3, fn)):
        assert isinstance(e, ValueError), (r, repr(e))
        assert ("different calls (rank 0 'embedcore.save', rank 1 'Saver.dump_to_file', rank 2 'embedcore.save')"
                in str(e) and "nothing was written" in str(e)), str(e)
    assert dir_bytes(path) == before


def test_ranks_loading_with_different_include_optimizer_are_refused_and_change_nothing(tmp_path):
    """One rank loading without the optimizer state while the others load it
    would leave slots of two trainings: every rank raises ValueError naming
    each rank's value, before any table changes."""
    path = _trained_and_saved_by_three_ranks(tmp_path)

    def fn(world):
        emb = ec.Embedding(feature_config(seed=100), world=world, sharding="row_wise")
        before = shard_states(emb)
        try:
            ec.load(path, emb, include_optimizer=world.rank != 1)
            error = None
        except Exception as e:  # noqa: BLE001
            error = e
        return error, before, shard_states(emb)

    for r, (e, before, after) in enumerate(run_world(3, fn)):
        assert isinstance(e, ValueError), (r, repr(e))
        assert "different include_optimizer (rank 0 True, rank 1 False, rank 2 True)" in str(e), str(e)
        for key in before:
            assert same_state(before[key], after[key]), f"rank {r}: {key} changed"


# ------------------------------------------------------------------ reshard while SRC changes
def test_reshard_reads_src_under_its_lock_from_the_first_read(tmp_path, monkeypatch, saved):
    """docs/format.md: a reshard's reads hold SRC's shared lock, so that a
    save committing into SRC meanwhile (which takes it exclusive) cannot
    remove the files of the manifest it read. Every read of SRC's manifest,
    the first included, happens while the lock is held."""
    import fcntl

    src = str(tmp_path / "src")
    shutil.copytree(saved[(2, "row_wise")].path, src)
    real = _embedcore.read_info
    held = []

    def spy(path, *args, **kwargs):
        if os.path.realpath(path) == os.path.realpath(src):
            fd = os.open(src, os.O_RDONLY | os.O_DIRECTORY)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # what a commit takes: free unless a read holds it
                fcntl.flock(fd, fcntl.LOCK_UN)
                held.append(False)
            except BlockingIOError:
                held.append(True)
            finally:
                os.close(fd)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(_embedcore, "read_info", spy)
    ec.distributed.reshard(src, str(tmp_path / "dst"), 3, "column_wise")
    assert held and all(held), f"SRC's manifest read without its lock: {held}"


def test_reshard_resolves_a_src_link_once(tmp_path, monkeypatch, saved, reference):
    """SRC given as a link (/models/current) that a deploy re-points while the
    reshard runs: the reshard reads the checkpoint the link named when it
    began (as load, verify and serving do), instead of mixing the manifest
    of one with the files of the other (a false 'checksum mismatch')."""
    old, new = str(tmp_path / "old"), str(tmp_path / "new")
    shutil.copytree(saved[(2, "row_wise")].path, old)

    def other(world):
        emb = ec.Embedding(feature_config(seed=7), world=world, sharding="column_wise")
        ec.save(new, emb)

    run_world(3, other)
    link = tmp_path / "current"
    os.symlink(old, link)
    real = _embedcore.load_table_block
    repointed = []

    def repointing(*args, **kwargs):
        if not repointed:
            os.unlink(link)
            os.symlink(new, link)
            repointed.append(True)
        return real(*args, **kwargs)

    monkeypatch.setattr(_embedcore, "load_table_block", repointing)
    dst = str(tmp_path / "dst")
    ec.distributed.reshard(str(link), dst, 3, "row_wise", max_file_bytes=64)
    assert repointed
    monkeypatch.undo()
    _assert_loads_like_reference(dst, reference, 2, "column_wise")


@pytest.mark.parametrize("values_dtype,sharding,where", [
    ("uint8_rowwise", "row_wise", "values row 77 "),  # a range beyond float32's: no finite scale
    ("float16", "row_wise", "at row 77, column 3,"),
    ("float16", "column_wise", "at row 77, column 3,"),
])
def test_a_sharded_export_that_fails_names_the_tables_row_and_column(tmp_path, values_dtype, sharding, where):
    """The rank holding the bad value names it by the table's row and column,
    not by its shard's (was: row 27 of rank 1's rows [50, 100), and the
    column within a column-wise shard)."""
    values = np.zeros((100, 6), np.float32)
    if values_dtype == "uint8_rowwise":
        values[77, [0, 3]] = (-3e38, 3e38)
    else:
        values[77, 3] = 1e5  # beyond float16's 65504
    path = str(tmp_path / "export")

    def export(world):
        emb = ec.Embedding({"f": ec.FeatureConfig(ec.TableConfig("t", 100, 6))}, world=world, sharding=sharding)
        for s, table in emb.local_shards["t"]:
            table.assign(values[s.row_start:s.row_start + s.rows, s.col_start:s.col_start + s.cols])
        try:
            ec.save(path, emb, include_optimizer=False, values_dtype=values_dtype)
        except (ValueError, ec.distributed.RankFailedError) as e:
            return type(e).__name__, str(e)
        return None

    results = run_world(2, export)
    owner = 1 if sharding == "row_wise" else [r for r, (kind, _) in enumerate(results) if kind == "ValueError"][0]
    kind, message = results[owner]
    assert kind == "ValueError" and "table 't'" in message and where in message, message
    assert not os.path.exists(path)


@pytest.mark.parametrize("sharding", ["row_wise", "column_wise", "table_wise"])
@pytest.mark.parametrize("values_dtype", [None, "float16"])
def test_a_sharded_save_of_a_value_that_is_not_finite_fails_on_every_rank(tmp_path, sharding, values_dtype):
    """The rank that holds the NaN names it by the table's row and column; every
    rank raises, as for any other save error, and the checkpoint already there
    stays as it was."""
    values = np.arange(600, dtype=np.float32).reshape(100, 6) / 600
    path = str(tmp_path / "c")

    def save(world):
        emb = ec.Embedding({"f": ec.FeatureConfig(ec.TableConfig("t", 100, 6))}, world=world, sharding=sharding)
        for s, table in emb.local_shards.get("t", []):
            table.assign(values[s.row_start:s.row_start + s.rows, s.col_start:s.col_start + s.cols])
        ec.save(path, emb)
        before = {n: open(os.path.join(path, n), "rb").read() for n in sorted(os.listdir(path))}  # (rank 0's: before
        # its next save claims a generation, which the other ranks wait for)
        for s, table in emb.local_shards.get("t", []):
            for r, c in ((77, 3), (90, 5)):  # the first in the rank's file is named
                if s.row_start <= r < s.row_start + s.rows and s.col_start <= c < s.col_start + s.cols:
                    table._native.values_mut()[r - s.row_start, c - s.col_start] = np.nan
        try:
            ec.save(path, emb, include_optimizer=values_dtype is None, values_dtype=values_dtype)
        except (ValueError, RankFailedError) as e:
            return before, type(e).__name__, str(e)
        return before, None, None

    results = run_world(2, save)
    assert all(kind is not None for _, kind, _ in results), results
    owners = [m for _, kind, m in results if kind == "ValueError" and "hold nan" in m]
    assert owners and all("table 't' values hold nan at row 77, column 3: a checkpoint holds finite values only"
                          in m for m in owners), results
    before = results[0][0]
    assert {n: open(os.path.join(path, n), "rb").read() for n in sorted(os.listdir(path))} == before
