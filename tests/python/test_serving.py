"""Serving a checkpoint (ec.serving.open): the lookups of a Table, from the
mapped file, from many threads at once, and a server that outlives a newer
save of its path."""
from __future__ import annotations

import copy
import gc
import json
import multiprocessing
import os
import pickle
import re
import subprocess
import sys
import threading
import weakref

import numpy as np
import pytest

import embedcore as ec
from test_checkpoint_forge import BLOCK_BYTES, DATA_OFFSET, flip_byte, read_manifest, train, write_manifest


def make_table(rows=500, dim=8, dtype="float32", combiner="mean", seed=1):
    return ec.Table(name="t", rows=rows, dim=dim, dtype=dtype, combiner=combiner,
                    optimizer=ec.optimizers.Adagrad(0.1), initializer=ec.initializers.Uniform(-1, 1, seed=seed))


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("verify", [True, "lazy", "eager", False])
def test_served_lookups_equal_the_table_s(tmp_path, rng, dtype, verify):
    t = make_table(dtype=dtype, combiner="sqrtn")
    train(t, rng, 3)
    ec.save(tmp_path / "c", t)
    st = ec.serving.open(tmp_path / "c", verify=verify).tables["t"]
    assert (st.name, st.rows, st.dim, st.dtype) == ("t", 500, 8, dtype)
    ids = rng.integers(0, 500, 200)
    offsets = np.array([0, 0, 1, 50, 50, 120, 200])
    weights = rng.uniform(0.5, 2, 200).astype(np.float32)
    for combiner in ("sum", "mean", "sqrtn", None):
        np.testing.assert_array_equal(st.lookup(ids, offsets, combiner=combiner),
                                      t.lookup(ids, offsets, combiner=combiner))
        np.testing.assert_array_equal(st.lookup(ids, offsets, weights, combiner=combiner),
                                      t.lookup(ids, offsets, weights, combiner=combiner))
    np.testing.assert_array_equal(st.lookup(ids, offsets), t.lookup(ids, offsets))  # the table's combiner
    np.testing.assert_array_equal(st.lookup(ids.astype(np.int32), offsets), t.lookup(ids, offsets))
    dense = ids[:60].reshape(20, 3)
    np.testing.assert_array_equal(st.lookup(dense, combiner=None, max_sequence_length=4),
                                  t.lookup(dense, combiner=None, max_sequence_length=4))
    out = np.empty((6, 8), np.float32)
    assert st.lookup(ids, offsets, combiner="sum", out=out) is out
    np.testing.assert_array_equal(out, t.lookup(ids, offsets, combiner="sum"))
    with pytest.raises(IndexError):
        st.lookup(np.array([500]))
    with pytest.raises(IndexError):
        st.lookup(np.array([-1]))
    v = st.values()
    assert not v.flags.writeable
    assert np.asarray(v).tobytes() == np.asarray(t.values()).tobytes()


def test_open_arguments_and_table_checkpoints(tmp_path):
    ec.save(tmp_path / "c", make_table())
    with pytest.raises(ValueError, match="verify"):
        ec.serving.open(tmp_path / "c", verify="sometimes")
    with pytest.raises(ValueError, match=r"verify must be True, 'lazy', 'eager' or False, got \['eager'\]"):
        ec.serving.open(tmp_path / "c", verify=["eager"])  # unhashable: still a ValueError naming it
    with pytest.raises(ValueError, match="verify must be True, 'lazy', 'eager' or False, got None"):
        ec.serving.open(tmp_path / "c", verify=None)  # (was: checksums off, unsaid)
    served = ec.serving.open(tmp_path / "c")
    assert list(served.tables) == ["t"] and served.feature_config is None
    for call in (served.lookup, served.embedding_lookup, served):  # (embedding_lookup: was an AttributeError)
        with pytest.raises(ValueError, match="tables, not features; use .tables\\[name\\].lookup"):
            call({"f": np.array([1])})
    assert "ServedCheckpoint" in repr(served)


def test_serving_and_a_values_only_load_need_no_slot_files(tmp_path, rng):
    # A trained checkpoint shipped to a serving host without its optimizer
    # slots (the bulk of an Adam checkpoint) serves and loads its values.
    t = make_table()
    train(t, rng, 2)
    ec.save(tmp_path / "c", t)
    slot_files = [f for f in os.listdir(tmp_path / "c") if ".accumulators." in f]
    assert slot_files
    for f in slot_files:
        os.remove(tmp_path / "c" / f)
    served = ec.serving.open(tmp_path / "c", verify="eager").tables["t"]
    ids = rng.integers(0, 500, 50)
    np.testing.assert_array_equal(served.lookup(ids, np.array([0, 20, 50])), t.lookup(ids, np.array([0, 20, 50])))
    fresh = make_table(seed=2)
    ec.load(tmp_path / "c", fresh, include_optimizer=False)
    np.testing.assert_array_equal(fresh.values(), t.values())
    with pytest.raises(ec.CheckpointError, match=f"{slot_files[0]}: missing file"):
        ec.load(tmp_path / "c", make_table(seed=2))  # the slots are asked for
    with pytest.raises(ec.CheckpointError, match="missing file"):
        ec.checkpoint.read_info(tmp_path / "c")  # what `embedcore verify` and `inspect` read


def test_a_data_file_that_cannot_be_looked_at_is_the_oserror_of_its_stat(tmp_path):
    """A values file that exists but cannot be stat'ed (a symlink loop here;
    permissions, an I/O error) raises the OSError of that call, with its
    errno, as docs/format.md says (it was CheckpointError "missing file"):
    opening for serving, loading, and the C API (EMBEDCORE_IO_ERROR, in
    test_c_api)."""
    import errno

    t = make_table(seed=1)
    ec.save(tmp_path / "c", t)
    (values,) = [f for f in os.listdir(tmp_path / "c") if ".values." in f]
    os.remove(tmp_path / "c" / values)
    os.symlink(values, tmp_path / "c" / values)  # a link to itself: ELOOP
    for call in (lambda: ec.serving.open(tmp_path / "c"), lambda: ec.load(tmp_path / "c", make_table(seed=2)),
                 lambda: ec.checkpoint.read_info(tmp_path / "c")):
        with pytest.raises(OSError, match=f"{values}: stat failed: ") as info:
            call()
        assert info.value.errno == errno.ELOOP and not isinstance(info.value, ec.CheckpointError), repr(info.value)


def test_a_lazy_open_reads_no_values(tmp_path):
    t = make_table(rows=100_000, dim=32)  # 12.8 MB of values in 4 blocks
    ec.save(tmp_path / "c", t)
    (entry,) = read_manifest(tmp_path / "c")["tables"]
    # Corrupt every block but the first: a lazy open reads none of them, a
    # lookup of rows in block 0 is served.
    name = entry["values"][0]["path"]
    for b in range(1, len(entry["values"][0]["crc32c"])):
        flip_byte(tmp_path / "c" / name, DATA_OFFSET + b * BLOCK_BYTES + 5)
    served = ec.serving.open(tmp_path / "c")
    np.testing.assert_array_equal(served.tables["t"].lookup(np.arange(100), combiner=None), t.values()[:100])
    with pytest.raises(ec.CheckpointError, match="block 3"):
        served.tables["t"].lookup(np.array([99_999]), combiner=None)
    served_unchecked = ec.serving.open(tmp_path / "c", verify=False)
    served_unchecked.tables["t"].lookup(np.array([99_999]), combiner=None)  # no checksums: served as stored
    # values() hands out the whole array: every block is checked first (the first bad one is named).
    with pytest.raises(ec.CheckpointError, match=rf"{name}: checksum mismatch in block 1 "):
        served.tables["t"].values()
    fresh = ec.serving.open(tmp_path / "c")
    with pytest.raises(ec.CheckpointError, match="block 1 "):
        fresh.tables["t"].values()
    np.testing.assert_array_equal(fresh.tables["t"].lookup(np.arange(100), combiner=None), t.values()[:100])
    assert np.asarray(served_unchecked.tables["t"].values()).tobytes() != np.asarray(t.values()).tobytes()


def _mapping_flags(path) -> list:
    """The VmFlags of each of this process's mappings of `path` (/proc/self/smaps)."""
    flags, mine, real = [], False, os.path.realpath(path)
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5:
                mine = len(head) >= 6 and head[5] == real
            elif mine and head and head[0] == "VmFlags:":
                flags.append(head[1:])
    return flags


@pytest.mark.skipif(not os.path.isdir("/sys/kernel/mm/transparent_hugepage"),
                    reason="no transparent huge pages in this kernel (or not Linux)")
def test_a_served_values_file_is_mapped_for_huge_pages(tmp_path):
    # MADV_HUGEPAGE ("hg"): a file read in through the mapping comes in 2 MiB folios and is mapped by them (about
    # 2x the rate of random rows of a table of GiBs: fewer TLB misses); whether the page cache has such folios is
    # the kernel's and the filesystem's, so the test checks the advice, which any THP kernel records.
    t = make_table(rows=1000, dim=8)
    ec.save(tmp_path / "c", t)
    (entry,) = read_manifest(tmp_path / "c")["tables"]
    path = tmp_path / "c" / entry["values"][0]["path"]
    served = ec.serving.open(tmp_path / "c")
    flags = _mapping_flags(path)
    assert len(flags) == 1 and "hg" in flags[0], flags
    np.testing.assert_array_equal(served.tables["t"].lookup(np.arange(10), combiner=None), t.values()[:10])


def test_a_lazy_lookup_verifies_every_block_its_row_spans(tmp_path):
    """Checksum blocks are BLOCK_BYTES of payload (docs/format.md), whatever
    the row size: a float32 row of 3 columns (12 bytes) straddles the first
    boundary at row BLOCK_BYTES // 12, 4 of its bytes in block 0 and 8 in
    block 1. Corrupting only its block-1 part, a lazy lookup of that row
    must check block 1 too (checking the block of its first byte alone
    would serve the corrupt value)."""
    row_bytes = 3 * 4
    straddler = BLOCK_BYTES // row_bytes
    assert straddler * row_bytes < BLOCK_BYTES < (straddler + 1) * row_bytes
    t = ec.Table(name="t", rows=straddler + 2, dim=3, initializer=ec.initializers.Constant(1.0))
    ec.save(tmp_path / "c", t)
    (entry,) = read_manifest(tmp_path / "c")["tables"]
    (values,) = entry["values"]
    assert values["block_bytes"] == BLOCK_BYTES and len(values["crc32c"]) == 2
    flip_byte(tmp_path / "c" / values["path"], DATA_OFFSET + (straddler + 1) * row_bytes - 1)  # its last column
    served = ec.serving.open(tmp_path / "c", verify="lazy").tables["t"]
    np.testing.assert_array_equal(served.lookup(np.array([straddler - 1]), combiner=None), [[1.0, 1.0, 1.0]])
    with pytest.raises(ec.CheckpointError, match=rf"{values['path']}: checksum mismatch in block 1 "):
        served.lookup(np.array([straddler]), combiner=None)
    with pytest.raises(ec.CheckpointError, match="block 1 "):  # and the bags that pool it
        ec.serving.open(tmp_path / "c", verify="lazy").tables["t"].lookup(np.array([straddler]), np.array([0, 1]))
    unchecked = ec.serving.open(tmp_path / "c", verify=False).tables["t"].lookup(np.array([straddler]), combiner=None)
    assert unchecked[0, :2].tolist() == [1.0, 1.0] and unchecked[0, 2] != 1.0  # the flipped byte is there


def test_many_threads_serve_a_lazily_verified_checkpoint(tmp_path, rng):
    """Threads race to verify the same blocks; every thread sees the right
    rows, and every thread that touches the corrupt block is refused."""
    rows = 3 * BLOCK_BYTES // (4 * 16)
    t = ec.Table(name="t", rows=rows, dim=16, initializer=ec.initializers.Uniform(-1, 1, seed=4))
    ec.save(tmp_path / "c", t)
    name = read_manifest(tmp_path / "c")["tables"][0]["values"][0]["path"]
    flip_byte(tmp_path / "c" / name, DATA_OFFSET + 2 * BLOCK_BYTES + 77)  # block 2: rows from 2 * rows / 3
    served = ec.serving.open(tmp_path / "c").tables["t"]
    expected = np.asarray(t.values())
    good_rows = 2 * rows // 3
    errors, wrong, refused = [], [], []

    def work(seed):
        r = np.random.default_rng(seed)
        try:
            for _ in range(30):
                ids = r.integers(0, good_rows, 64)
                got = served.lookup(ids, combiner=None)
                if not np.array_equal(got, expected[ids]):
                    wrong.append(seed)
                try:
                    served.lookup(np.array([good_rows + int(r.integers(0, rows - good_rows))]), combiner=None)
                    wrong.append(("served a corrupt row", seed))
                except ec.CheckpointError:
                    refused.append(seed)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors and not wrong
    assert len(refused) == 8 * 30


def test_a_server_keeps_its_checkpoint_when_a_newer_save_replaces_it(tmp_path, rng):
    t = make_table()
    ec.save(tmp_path / "c", t)
    old = np.array(t.values())
    served = ec.serving.open(tmp_path / "c", verify="eager")
    train(t, rng, 3)
    ec.save(tmp_path / "c", t)  # removes the old generation's files the server has mapped
    assert not any(".g000000000001." in f for f in os.listdir(tmp_path / "c"))
    ids = np.arange(500)
    np.testing.assert_array_equal(served.tables["t"].lookup(ids, combiner=None), old)
    fresh = ec.serving.open(tmp_path / "c", verify="eager")
    np.testing.assert_array_equal(fresh.tables["t"].lookup(ids, combiner=None), t.values())


def test_served_embedding_is_callable_with_the_features(tmp_path, rng):
    user = ec.TableConfig("user", 40, 4, combiner="sum", initializer=ec.initializers.Uniform(-1, 1, seed=1))
    item = ec.TableConfig("item", 60, 4, initializer=ec.initializers.Uniform(-1, 1, seed=2))
    config = [{"u": ec.FeatureConfig(user), "i": ec.FeatureConfig(item)},
              (ec.FeatureConfig(item, max_sequence_length=2, name="seq"),)]
    emb = ec.Embedding(config, optimizer=ec.optimizers.SGD(0.1))
    ec.save(tmp_path / "e", emb)
    served = ec.serving.open(tmp_path / "e")
    feats = [{"u": rng.integers(0, 40, 5), "i": rng.integers(0, 60, (5, 3))}, (rng.integers(0, 60, (5, 4)),)]
    want, got = emb(feats), served(feats)
    assert isinstance(got, list) and isinstance(got[0], dict) and isinstance(got[1], tuple)
    np.testing.assert_array_equal(got[0]["u"], want[0]["u"])
    np.testing.assert_array_equal(got[0]["i"], want[0]["i"])
    np.testing.assert_array_equal(got[1][0], want[1][0])
    assert got[1][0].shape == (5, 2, 4)
    assert sorted(served.embedding_tables) == ["item", "user"]


def test_a_served_lookup_keeps_nothing_of_its_request(tmp_path):
    """A server keeps no reference to a request's arrays once it returns:
    one huge batch must not stay in memory until the next request."""
    item = ec.TableConfig("item", 60, 4, initializer=ec.initializers.Uniform(-1, 1, seed=2))
    ec.save(tmp_path / "e", ec.Embedding({"i": ec.FeatureConfig(item)}))
    served = ec.serving.open(tmp_path / "e")
    ids = np.arange(6, dtype=np.int64).reshape(2, 3)
    weights = np.ones((2, 3), np.float32)
    gone = [weakref.ref(ids), weakref.ref(weights)]
    served({"i": ids}, {"i": weights})
    del ids, weights
    gc.collect()
    assert [r() for r in gone] == [None, None]


def test_an_optimizer_set_after_the_embedding_is_made_trains(rng):
    """An Embedding made without an optimizer keeps no batches; a table given
    one later (Table.set_optimizer) trains from the next lookup."""
    item = ec.TableConfig("item", 20, 4, initializer=ec.initializers.Uniform(-1, 1, seed=2))
    emb = ec.Embedding({"i": ec.FeatureConfig(item)})
    emb({"i": np.array([1, 2])})
    with pytest.raises(ValueError, match="no table has an optimizer"):
        emb.apply_gradients({"i": np.ones((2, 4), np.float32)})
    table = emb.embedding_tables[item]
    table.set_optimizer(ec.optimizers.SGD(0.5))
    ids = np.array([1, 2])
    before = table.to_numpy()
    emb({"i": ids})
    ids[:] = 7  # the caller reuses its buffer before the step: the lookup's ids are kept as copies
    emb.apply_gradients({"i": np.ones((2, 4), np.float32)})
    want = before.copy()
    want[[1, 2]] -= 0.5
    np.testing.assert_array_equal(table.to_numpy(), want)


def _served_sum(served, ids):
    return served({"i": ids})["i"]


def test_a_served_checkpoint_pickles_and_copies_by_its_path(tmp_path, monkeypatch):
    item = ec.TableConfig("item", 60, 4, initializer=ec.initializers.Uniform(-1, 1, seed=2))
    ec.save(tmp_path / "e", ec.Embedding({"i": ec.FeatureConfig(item)}))
    monkeypatch.chdir(tmp_path)
    served = ec.serving.open("e", verify="eager")
    ids = np.array([[1, 2], [3, 59]])
    want = served({"i": ids})["i"]
    pickled = pickle.dumps(served)
    monkeypatch.chdir("/")  # the copy holds the absolute path
    for copy_ in (pickle.loads(pickled), copy.deepcopy(served)):
        assert copy_.path == str(tmp_path / "e") and copy_._verify == "eager" and copy_._mapped is not served._mapped
        np.testing.assert_array_equal(copy_({"i": ids})["i"], want)
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        np.testing.assert_array_equal(pool.apply(_served_sum, (served, ids)), want)
    # The path holds another checkpoint (a newer save of the same shapes) by the time the copy is loaded.
    ec.save(tmp_path / "e", ec.Embedding({"i": ec.FeatureConfig(item)}))
    with pytest.raises(ec.CheckpointError, match="holds another checkpoint than the one pickled"):
        pickle.loads(pickled)
    with pytest.raises(ec.CheckpointError, match="holds another checkpoint than the one pickled"):
        copy.deepcopy(served)


def test_a_feature_config_used_twice_serves(tmp_path, rng):
    """One FeatureConfig object at two places of a feature config is two
    features: the checkpoint names each once, and serves as the embedding looks up."""
    table = ec.TableConfig("t", 30, 4, initializer=ec.initializers.Uniform(-1, 1, seed=1))
    f = ec.FeatureConfig(table)
    config = {"x": f, "y": [f, ec.FeatureConfig(table, max_sequence_length=2)]}
    emb = ec.Embedding(config, optimizer=ec.optimizers.SGD(0.1))
    ec.save(tmp_path / "e", emb)
    assert read_manifest(tmp_path / "e")["metadata"]["structure"] == {
        "dict": {"x": {"feature": 0}, "y": {"list": [{"feature": 1}, {"feature": 2}]}}}
    feats = {"x": rng.integers(0, 30, 5), "y": [rng.integers(0, 30, (5, 2)), rng.integers(0, 30, (5, 3))]}
    want, got = emb(feats), ec.serving.open(tmp_path / "e")(feats)
    np.testing.assert_array_equal(got["x"], want["x"])
    np.testing.assert_array_equal(got["y"][0], want["y"][0])
    np.testing.assert_array_equal(got["y"][1], want["y"][1])


def test_a_feature_config_s_own_name_names_its_feature(tmp_path, rng):
    """A FeatureConfig's name wins over its key in the structure (its path
    names only an unnamed one), as the TF adapter names TensorFlow's
    features (docs/tensorflow.md: "as an embedcore.Embedding's does"): in
    the checkpoint's features, which name-keyed consumers (the C API, the
    PyTorch served collections) serve by, and in an embedding's errors."""
    table = ec.TableConfig("t", 8, 2, initializer=ec.initializers.Uniform(-1, 1, seed=1))
    emb = ec.Embedding({"slot_a": ec.FeatureConfig(table, name="clicks"), "slot_b": ec.FeatureConfig(table)},
                       optimizer=ec.optimizers.SGD(0.1))
    ec.save(tmp_path / "e", emb)
    assert [f["name"] for f in read_manifest(tmp_path / "e")["metadata"]["features"]] == ["clicks", "slot_b"]
    served = ec.serving.open(tmp_path / "e")
    assert [f.name for f in served.feature_config.values()] == ["clicks", "slot_b"]
    feats = {"slot_a": rng.integers(0, 8, (3, 2)), "slot_b": rng.integers(0, 8, (3, 2))}
    want, got = emb(feats), served(feats)
    for k in feats:
        np.testing.assert_array_equal(got[k], want[k])
    with pytest.raises(IndexError, match=r"features\['slot_a'\] \(feature 'clicks'\): table 't': id 99"):
        emb({"slot_a": np.array([[99]]), "slot_b": np.array([[0]])})
    with pytest.raises(ValueError, match=r"grads\['slot_a'\] \(feature 'clicks'\)"):
        emb.apply_gradients({"slot_a": np.zeros((1, 3)), "slot_b": np.zeros((1, 2))})


@pytest.mark.parametrize("case", ["a name= equal to another's key", "one FeatureConfig at two places",
                                  "two alike name= values"])
def test_features_that_would_share_a_name_are_named_by_their_paths(tmp_path, rng, case):
    """Names are unique in a checkpoint, which the C API finds features by:
    where two features would share one, each is named by its path (as the
    TensorFlow adapter's layer names them). The second was unreachable by
    name, and a bad id in it was reported under the other's input."""
    user, item = (ec.TableConfig(n, 10, 2, initializer=ec.initializers.Uniform(-1, 1, seed=i))
                  for i, n in enumerate(["user", "item"]))
    shared = ec.FeatureConfig(user, name="clicks")
    config = {"a name= equal to another's key": {"clicks": ec.FeatureConfig(user),
                                                  "views": ec.FeatureConfig(item, name="clicks")},
              "one FeatureConfig at two places": {"clicks": shared, "views": {"x": shared}},
              "two alike name= values": {"clicks": ec.FeatureConfig(user, name="f"),
                                         "views": ec.FeatureConfig(item, name="f")}}[case]
    emb = ec.Embedding(config, ec.optimizers.SGD(0.1))
    paths = ["clicks", "views/x" if case == "one FeatureConfig at two places" else "views"]
    ec.save(tmp_path / "e", emb)
    assert [f["name"] for f in read_manifest(tmp_path / "e")["metadata"]["features"]] == paths
    bad = {"clicks": np.array([1]), "views": np.array([99])}
    if case == "one FeatureConfig at two places":
        bad["views"] = {"x": bad["views"]}
    with pytest.raises(IndexError, match=re.escape(f"features['{paths[1]}']:")):
        emb(bad)
    served = ec.serving.open(tmp_path / "e")
    with pytest.raises(IndexError, match=re.escape(f"features['{paths[1]}']:")):
        served(bad)


def test_a_feature_config_with_int_keys_serves_with_them(tmp_path, rng):
    """Dicts keyed by ints (JSON keys are strings) are recorded as
    structure_items; the served checkpoint takes the same features the
    embedding took. The records that cannot be read back are malformed."""
    a = ec.TableConfig("a", 30, 4, initializer=ec.initializers.Uniform(-1, 1, seed=1))
    b = ec.TableConfig("b", 30, 4, initializer=ec.initializers.Uniform(-1, 1, seed=2))
    config = {10: ec.FeatureConfig(a), 2: [ec.FeatureConfig(b), {"s": ec.FeatureConfig(b, max_sequence_length=2)}]}
    emb = ec.Embedding(config, optimizer=ec.optimizers.SGD(0.1))
    ec.save(tmp_path / "e", emb)
    meta = read_manifest(tmp_path / "e")["metadata"]
    assert meta["structure"] is None
    assert meta["structure_items"] == {"items": [[10, {"feature": 2}],
                                                 [2, {"list": [{"feature": 0}, {"items": [["s", {"feature": 1}]]}]}]]}
    feats = {10: rng.integers(0, 30, 5), 2: [rng.integers(0, 30, (5, 3)), {"s": rng.integers(0, 30, (5, 2))}]}
    served = ec.serving.open(tmp_path / "e")
    want, got = emb(feats), served(feats)
    assert list(served.feature_config) == [10, 2]
    np.testing.assert_array_equal(got[10], want[10])
    np.testing.assert_array_equal(got[2][0], want[2][0])
    np.testing.assert_array_equal(got[2][1]["s"], want[2][1]["s"])
    # Keys the manifest's 64-bit JSON integers cannot hold, or items nested past its depth: no structure_items
    # (as before it existed); the features serve as a list.
    deep = ec.FeatureConfig(a)
    for _ in range(9):
        deep = {1: deep}
    for odd in ({10**20: ec.FeatureConfig(a)}, {-2**70: ec.FeatureConfig(a)}, deep):
        ec.save(tmp_path / "odd", ec.Embedding(odd, optimizer=ec.optimizers.SGD(0.1)))
        assert "structure_items" not in read_manifest(tmp_path / "odd")["metadata"]
        assert isinstance(ec.serving.open(tmp_path / "odd").feature_config, list)
    m = read_manifest(tmp_path / "e")
    for bad in ({"items": [[True, {"feature": 0}]]}, {"items": [[1.5, {"feature": 0}]]}, {"items": {"1": 0}},
                {"items": [[1]]}):
        m["metadata"]["structure_items"] = bad
        write_manifest(tmp_path / "e", m)
        with pytest.raises(ec.CheckpointError, match="metadata.structure_items is malformed"):
            ec.serving.open(tmp_path / "e")


@pytest.mark.parametrize("structure", [
    {"dict": {"x": {"feature": 0}, "y": {"feature": 0}}},  # one feature twice (what writers before wrote)
    {"dict": {"x": {"feature": 1}, "y": {"feature": 1}}},
    {"dict": {"x": {"feature": 1}, "y": {"feature": 0}}},  # each once, out of order: inputs would meet other tables
    {"dict": {"x": {"feature": 0}}},                        # a feature left out
], ids=["first twice", "last twice", "swapped", "one left out"])
def test_a_structure_that_does_not_name_each_feature_once_is_refused(tmp_path, structure):
    """Inputs meet features in flattening order; a forged structure that
    names a feature twice (a StopIteration at lookup), leaves one out or
    swaps two (each input looked up in the other's table) is refused on open."""
    a = ec.TableConfig("a", 30, 4, initializer=ec.initializers.Uniform(-1, 1, seed=1))
    b = ec.TableConfig("b", 30, 4, initializer=ec.initializers.Uniform(-1, 1, seed=2))
    emb = ec.Embedding({"x": ec.FeatureConfig(a), "y": ec.FeatureConfig(b)}, optimizer=ec.optimizers.SGD(0.1))
    ec.save(tmp_path / "e", emb)
    m = read_manifest(tmp_path / "e")
    m["metadata"]["structure"] = structure
    write_manifest(tmp_path / "e", m)
    with pytest.raises(ec.CheckpointError, match="metadata.structure names features") as e:
        ec.serving.open(tmp_path / "e")
    assert str(tmp_path / "e") in str(e.value)


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs Linux's /proc/<pid>/smaps")
def test_processes_serving_one_checkpoint_share_its_pages(tmp_path):
    """The values files are mapped shared, read-only: a second process serving
    the same checkpoint maps the page-cache pages the first one touched
    (smaps counts them as Shared_Clean), instead of a copy of its own."""
    t = make_table(rows=20_000, dim=64)  # 5 MB of values
    ec.save(tmp_path / "c", t)
    (entry,) = read_manifest(tmp_path / "c")["tables"]
    path = str(tmp_path / "c" / entry["values"][0]["path"])
    here = ec.serving.open(tmp_path / "c")
    assert float(np.asarray(here.tables["t"].values(), np.float32).sum()) == float(t.values().sum())  # every page
    code = f"""
import json, numpy as np, embedcore as ec
served = ec.serving.open({str(tmp_path / "c")!r})
v = np.asarray(served.tables["t"].values(), np.float32)
print(float(v.sum()))
fields, mine = {{}}, False
for line in open("/proc/self/smaps"):
    parts = line.split()
    if "-" in parts[0] and not parts[0].endswith(":"):
        mine = parts[-1] == {path!r}
    elif mine and parts[0] in ("Rss:", "Shared_Clean:", "Private_Clean:", "Private_Dirty:"):
        fields[parts[0]] = fields.get(parts[0], 0) + int(parts[1]) * 1024
print(json.dumps(fields))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    total, fields = r.stdout.splitlines()[-2:]
    fields = json.loads(fields)
    assert float(total) == float(t.values().sum())
    payload = 20_000 * 64 * 4
    assert fields["Shared_Clean:"] >= 0.9 * payload, fields
    assert fields.get("Private_Dirty:", 0) == 0, fields
    del here


def test_a_mapping_without_address_space_says_so(tmp_path):
    """mmap's ENOMEM under an address-space limit is an OSError naming the
    bytes the mapping needs (one values file: no advice to reshard)."""
    ec.save(tmp_path / "c", ec.Table(ec.TableConfig("t", 1 << 20, 16, initializer=ec.initializers.Zeros())))
    code = ("import errno, resource, sys, embedcore as ec\n"
            "vm = int(open('/proc/self/statm').read().split()[0]) * 4096\n"
            "resource.setrlimit(resource.RLIMIT_AS, (vm + (16 << 20), resource.RLIM_INFINITY))\n"
            "try:\n    ec.serving.open(sys.argv[1])\n"
            "except OSError as e:\n    print(e.errno == errno.ENOMEM, e)\n")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "c")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith("True ") and "bytes needs that much free address space, ulimit -v, and one more of " \
        "the process's mappings, vm.max_map_count)" in r.stdout, r.stdout
    assert "reshard" not in r.stdout


def test_copies_of_a_checkpoint_opened_through_a_symlink_and_dotdot(tmp_path, monkeypatch):
    """"link/../c" is the link target's sibling c (the system's and the
    engine's reading), not the link's: a copy or pickle of the served
    checkpoint, and of a served PyTorch collection, opens the checkpoint the
    original serves (was: os.path.abspath's textual "c", "no such checkpoint
    directory")."""
    (tmp_path / "real" / "sub").mkdir(parents=True)
    (tmp_path / "cwd").mkdir()
    t = make_table(rows=30, dim=4)
    ec.save(tmp_path / "real" / "c", t)
    os.symlink(tmp_path / "real" / "sub", tmp_path / "cwd" / "link")
    monkeypatch.chdir(tmp_path / "cwd")
    served = ec.serving.open("link/../c")
    want = t.lookup(np.array([[1, 2]]))
    for other in (copy.deepcopy(served), pickle.loads(pickle.dumps(served))):
        np.testing.assert_array_equal(other.tables["t"].lookup(np.array([[1, 2]])), want)
    torch = pytest.importorskip("torch")
    et = pytest.importorskip("embedcore.adapters.torch")
    cfgs = [et.EmbeddingBagConfig(num_embeddings=30, embedding_dim=4, name="t", feature_names=["f"])]
    module = et.ServedEmbeddingBagCollection("link/../c", cfgs)
    x = {"f": torch.tensor([[1, 2]])}
    for other in (copy.deepcopy(module), pickle.loads(pickle.dumps(module))):
        assert torch.equal(other(x)["f"], module(x)["f"])
    # The demo's check of the checkpoint's parent reads the path as the system does too (was: "no directory").
    (tmp_path / "real" / "newdir").mkdir()
    from embedcore import demo

    assert demo.run(steps=1, batch_size=8, checkpoint="link/../newdir/ckpt") == 0
    assert (tmp_path / "real" / "newdir" / "ckpt" / "MANIFEST").exists()
