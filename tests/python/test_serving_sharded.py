"""Serving a sharded checkpoint (several values files per table: row blocks
and column bands) with ec.serving.open: lookups equal the trained
Embedding's bit for bit, a corrupt block of one shard file is reported and
never served, and many threads may look up at once."""
from __future__ import annotations

import json
import os
import threading

import numpy as np
import pytest

import embedcore as ec
from embedcore.distributed import reshard, run_local
from test_checkpoint_forge import DATA_OFFSET, flip_byte, read_manifest, write_manifest


def _config():
    a = ec.TableConfig("a", 97, 7, dtype="float16", initializer=ec.initializers.Uniform(-1, 1, seed=3),
                       combiner="mean")
    b = ec.TableConfig("b", 13, 5, dtype="bfloat16", initializer=ec.initializers.Uniform(-1, 1, seed=4),
                       combiner="sqrtn")
    c = ec.TableConfig("c", 400, 6, initializer=ec.initializers.Uniform(-1, 1, seed=5), combiner="sum")
    return {"f": ec.FeatureConfig(a), "g": ec.FeatureConfig(b), "h": ec.FeatureConfig(c),
            "s": ec.FeatureConfig(a, max_sequence_length=3)}


def _batch(rng, n=11):
    x = {"f": rng.integers(0, 97, (n, 4)), "g": rng.integers(0, 13, (n, 2)), "h": rng.integers(0, 400, (n, 3)),
         "s": rng.integers(0, 97, (n, 5))}
    w = {k: rng.uniform(-1, 2, v.shape).astype(np.float32) for k, v in x.items()}
    return x, w


def _trained_sharded(path, world_size, plan, steps=2):
    """Trains a sharded Embedding and saves it; returns an unsharded Embedding
    loaded from that checkpoint (the reference: a server must return what
    its tables hold, bit for bit)."""
    batches = [_batch(np.random.default_rng(s)) for s in range(steps)]

    def fn(world):
        emb = ec.Embedding(_config(), ec.optimizers.Adagrad(0.1), world=world, sharding=plan)
        for x, w in batches:
            n = len(x["f"])
            lo, hi = world.rank * n // world.size, (world.rank + 1) * n // world.size
            out = emb({k: v[lo:hi] for k, v in x.items()}, {k: v[lo:hi] for k, v in w.items()})
            emb.apply_gradients({k: v + 1 for k, v in out.items()})
        ec.save(path, emb)

    run_local(world_size, fn)
    ref = ec.Embedding(_config(), ec.optimizers.Adagrad(0.1))
    ec.load(path, into=ref)
    return ref


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("plan", ["row_wise", "column_wise", "table_wise", "auto"])
def test_served_sharded_checkpoint_equals_the_trained_embedding(tmp_path, world_size, plan):
    path = tmp_path / "ckpt"
    ref = _trained_sharded(path, world_size, plan)
    manifest = json.loads(ec.checkpoint.read_info(path).manifest_json)
    assert any(len(t["values"]) > 1 for t in manifest["tables"]) or plan in ("table_wise", "auto")
    served = ec.serving.open(path)
    for seed in range(3):
        x, w = _batch(np.random.default_rng(100 + seed))
        want, got = ref(x, w), served(x, w)
        for k in want:
            np.testing.assert_array_equal(got[k], want[k])
        want, got = ref(x), served(x)
        for k in want:
            np.testing.assert_array_equal(got[k], want[k])
    table = served.tables["a"]
    assert table.dtype == "float16"
    ids = np.arange(97)
    for combiner in ("sum", "mean", "sqrtn", None):
        ref_table = [t for t in ref.embedding_tables.values() if t.name == "a"][0]
        np.testing.assert_array_equal(table.lookup(ids, np.array([0, 40, 40, 97]), combiner=combiner),
                                      ref_table.lookup(ids, np.array([0, 40, 40, 97]), combiner=combiner))
    with pytest.raises(IndexError):
        table.lookup(np.array([97]))


def test_a_split_table_has_no_single_view_but_serves(tmp_path):
    _trained_sharded(tmp_path / "c", 3, "row_wise")
    table = ec.serving.open(tmp_path / "c").tables["c"]
    with pytest.raises(ec.CheckpointError, match="3 files"):
        table.values()
    assert table.lookup(np.array([0, 399])).shape == (2, 6)
    # One file per table again: the view is back.
    reshard(tmp_path / "c", tmp_path / "one", 1, "row_wise", max_file_bytes=0)
    assert ec.serving.open(tmp_path / "one").tables["c"].values().shape == (400, 6)


@pytest.mark.parametrize("verify", [True, "lazy", "eager"])
def test_a_corrupt_shard_file_is_reported_not_served(tmp_path, verify):
    ref = _trained_sharded(tmp_path / "c", 2, "row_wise")
    manifest = json.loads(ec.checkpoint.read_info(tmp_path / "c").manifest_json)
    c = [t for t in manifest["tables"] if t["name"] == "c"][0]
    second = sorted(c["values"], key=lambda f: f["row_start"])[1]  # rows [200, 400)
    flip_byte(tmp_path / "c" / second["path"], DATA_OFFSET + 3)
    if verify == "eager":
        with pytest.raises(ec.CheckpointError, match="checksum"):
            ec.serving.open(tmp_path / "c", verify=verify)
        return
    table = ec.serving.open(tmp_path / "c", verify=verify).tables["c"]
    ref_c = [t for t in ref.embedding_tables.values() if t.name == "c"][0]
    np.testing.assert_array_equal(table.lookup(np.array([5, 150])), ref_c.lookup(np.array([5, 150])))
    for _ in range(2):  # reported every time, never served
        with pytest.raises(ec.CheckpointError, match="checksum"):
            table.lookup(np.array([5, 250]))
    # Batches the pool's threads gather (thousands of ids): the same rows, and the same refusal.
    good = np.tile(np.arange(200), 40)
    np.testing.assert_array_equal(table.lookup(good, np.arange(0, good.size + 1, 8)),
                                  ref_c.lookup(good, np.arange(0, good.size + 1, 8)))
    with pytest.raises(ec.CheckpointError, match="checksum"):
        table.lookup(np.concatenate([good, [399]]))


def test_many_threads_serve_a_sharded_checkpoint(tmp_path):
    ref = _trained_sharded(tmp_path / "c", 3, "column_wise")
    served = ec.serving.open(tmp_path / "c")
    x, w = _batch(np.random.default_rng(7), n=512)  # (thousands of ids a table: gathered by the pool's threads)
    want = ref(x, w)
    errors = []

    def worker():
        try:
            for _ in range(20):
                got = served(x, w)
                for k in want:
                    np.testing.assert_array_equal(got[k], want[k])
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


def test_a_row_of_several_bands_is_of_one_id_while_the_ids_are_rewritten(tmp_path):
    """A table in column bands gathers each occurrence's row band by band; the
    ids are read once for all bands, so each output row is one id's whole
    row even while another thread rewrites the ids (a caller's bug, which
    may give either id's row, never a mix). The ids were read once per
    band: a row took its first columns from one id and the rest from the
    other."""
    _trained_sharded(tmp_path / "c", 3, "column_wise", steps=1)
    table = ec.serving.open(tmp_path / "c").tables["c"]
    rows = table.lookup(np.array([5, 300]))
    assert not np.array_equal(rows[0][:2], rows[1][:2]) and not np.array_equal(rows[0][2:], rows[1][2:])
    n = 1 << 19
    ids = np.full(n, 5, np.int64)
    a, b = np.full(n, 5, np.int64), np.full(n, 300, np.int64)
    stop = threading.Event()

    def flip():
        while not stop.is_set():
            np.copyto(ids, b)
            np.copyto(ids, a)

    flipper = threading.Thread(target=flip)
    flipper.start()
    try:
        for _ in range(20):
            got = table.lookup(ids)
            whole = (got == rows[0]).all(axis=1) | (got == rows[1]).all(axis=1)
            assert whole.all(), f"{(~whole).sum()} of {n} rows mix two ids' columns"
    finally:
        stop.set()
        flipper.join()


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("plan", ["row_wise", "column_wise"])
def test_a_table_in_many_files_looks_up_the_one_files_bits(tmp_path, rng, restore_threads, dtype, plan):
    """A table saved in many files is looked up where each file maps its rows
    (each id's row by its address), a band of columns at a time for pooled
    bags: the bits of the same table in one file for every combiner, with
    and without weights, flat and padded sequences, at a width of whole
    vectors and a tail (133 columns; bands of 45 and 44), bags empty, of one
    id and longer than a thread's share, on one thread and on several."""
    rows, dim = 3000, 133
    table = ec.Table(name="t", rows=rows, dim=dim, dtype=dtype, combiner="sum",
                     initializer=ec.initializers.Uniform(-1, 1, seed=2))
    ec.save(tmp_path / "one", table, include_optimizer=False)
    reshard(tmp_path / "one", tmp_path / "many", 3, plan, max_file_bytes=64 << 10)
    (files,) = [t["values"] for t in json.loads(ec.checkpoint.read_info(tmp_path / "many").manifest_json)["tables"]]
    assert len(files) > 9 and len({f.get("col_start", 0) for f in files}) == (3 if plan == "column_wise" else 1)
    one = ec.serving.open(tmp_path / "one").tables["t"]
    many = ec.serving.open(tmp_path / "many").tables["t"]
    lengths = rng.integers(0, 40, 700)
    lengths[:3] = [0, 1, 5000]
    offsets = np.r_[0, np.cumsum(lengths)]
    ids = rng.integers(0, rows, offsets[-1])
    weights = rng.uniform(-1, 2, ids.size).astype(np.float32)
    for threads in (1, 3):
        ec.set_num_threads(threads)
        for combiner in ("sum", "mean", "sqrtn", None):
            for w in (None, weights):
                np.testing.assert_array_equal(many.lookup(ids, offsets, w, combiner=combiner),
                                              one.lookup(ids, offsets, w, combiner=combiner))
        np.testing.assert_array_equal(many.lookup(ids, offsets, weights, combiner=None, max_sequence_length=7),
                                      one.lookup(ids, offsets, weights, combiner=None, max_sequence_length=7))


def _rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads the process's memory from /proc")
def test_threads_that_looked_up_many_files_keep_no_memory_of_their_batches(tmp_path, rng):
    """A lookup of a table in several files works in buffers of a chunk of
    its bags: a server thread that looked up a large batch keeps nothing
    while it waits for the next. Buffers of the batch's size kept by each
    thread (for the next lookup) held 256 MiB here: 4 threads, 2 buffers of
    4M ids."""
    table = ec.Table(name="t", rows=1000, dim=4, initializer=ec.initializers.Uniform(-1, 1, seed=1))
    ec.save(tmp_path / "one", table, include_optimizer=False)
    reshard(tmp_path / "one", tmp_path / "many", 2, "row_wise", max_file_bytes=4 << 10)
    served = ec.serving.open(tmp_path / "many", verify="eager").tables["t"]
    ids = rng.integers(0, 1000, 1 << 22)
    offsets = np.arange(0, ids.size + 1, 32)
    want = served.lookup(ids, offsets)  # (the output's memory, once)
    np.testing.assert_array_equal(want, table.lookup(ids, offsets))
    done, release, errors = threading.Barrier(5), threading.Event(), []

    def server():
        try:
            np.testing.assert_array_equal(served.lookup(ids, offsets), want)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)
        done.wait()
        release.wait()  # alive, as a server's thread between requests

    before = _rss_bytes()
    threads = [threading.Thread(target=server) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        done.wait()
        grown = _rss_bytes() - before
    finally:
        release.set()
        for t in threads:
            t.join()
    assert not errors, errors[0]
    assert grown < (64 << 20), f"the process grew by {grown >> 20} MiB"


def test_a_manifest_naming_one_file_for_two_row_ranges_is_refused(tmp_path):
    """A data file's header names no rows, so a manifest that names one file
    for two row ranges (the tiling holds, every checksum matches) is refused
    by serving, loading and verify, naming the file: rows 20-29 were served
    and loaded as rows 10-19, and verify said OK."""
    table = ec.Table(name="t", rows=40, dim=4, initializer=ec.initializers.Uniform(-1, 1, seed=1))
    ec.save(tmp_path / "one", table, include_optimizer=False)
    reshard(tmp_path / "one", tmp_path / "c", 4, "row_wise", max_file_bytes=0)
    m = read_manifest(tmp_path / "c")
    files = sorted(m["tables"][0]["values"], key=lambda f: f["row_start"])
    assert [f["row_start"] for f in files] == [0, 10, 20, 30]
    files[2]["path"], files[2]["crc32c"] = files[1]["path"], files[1]["crc32c"]
    write_manifest(tmp_path / "c", m)
    message = f"tables\\[0\\].values names file '{files[1]['path']}', which it names too"
    with pytest.raises(ec.CheckpointError, match=message):
        ec.serving.open(tmp_path / "c")
    with pytest.raises(ec.CheckpointError, match=message):
        ec.load(tmp_path / "c", into=ec.Table(name="t", rows=40, dim=4))
    from embedcore import cli

    assert cli.main(["verify", str(tmp_path / "c")]) != 0
