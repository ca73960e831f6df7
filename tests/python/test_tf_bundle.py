"""The TensorFlow checkpoint reader of the adapter (adapters/tf/_bundle.py):
rows read straight from the data files equal TensorFlow's reads, a restore
reads each tensor's bytes about twice (TensorFlow's RestoreV2 reads a whole
stored tensor for every slice), and damage is found by the checksums."""
from __future__ import annotations

import os

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

import embedcore as ec  # noqa: E402
from embedcore.adapters.tf import _bundle, _checkpoint, load_tf_checkpoint  # noqa: E402

SHAPES = {"v0": (1000, 64), "v1": (1000, 64), "v2": (1000, 64), "v3": (1000, 64), "narrow": (333, 1)}


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """Variables over two data files, one of them saved as slices (the
    sharding policy splits what does not fit), plus tensors of other dtypes
    and ranks, which the reader leaves to TensorFlow."""
    rng = np.random.default_rng(0)
    vs = {k: tf.Variable(rng.standard_normal(s).astype(np.float32)) for k, s in SHAPES.items()}
    vs["f64"] = tf.Variable(rng.standard_normal((10, 3)))
    vs["ints"] = tf.Variable(rng.integers(0, 9, (10, 3)))
    vs["vector"] = tf.Variable(rng.standard_normal(7).astype(np.float32))
    policy = tf.train.experimental.MaxShardSizePolicy(max_shard_size=600_000)
    path = str(tmp_path_factory.mktemp("bundle") / "ck")
    tf.train.Checkpoint(**vs).write(path, options=tf.train.CheckpointOptions(experimental_sharding_callback=policy))
    return path


def _key(name):
    return f"{name}/.ATTRIBUTES/VARIABLE_VALUE"


def test_rows_equal_tensorflows(sharded):
    b = _bundle.Bundle(sharded)
    reader = tf.train.load_checkpoint(sharded)
    assert b.num_shards >= 2
    plain = {k for k in SHAPES if b.plain(_key(k))}
    sliced = {k for k in SHAPES if b.entries[_key(k)].slices}
    assert sliced and len(plain) >= 4, (plain, sliced)  # both kinds, from more than one file
    assert len({b.entries[_key(k)].shard_id for k in plain}) >= 2
    assert plain | sliced == set(SHAPES)
    for k in plain:
        want = reader.get_tensor(_key(k))
        assert b.plain(_key(k)) == want.shape
        b.verify(_key(k))
        for start, count in ((0, want.shape[0]), (0, 1), (want.shape[0] // 3, want.shape[0] // 2)):
            np.testing.assert_array_equal(b.read_rows(_key(k), start, count), want[start:start + count])
        for start, count in ((-1, 1), (0, want.shape[0] + 1), (want.shape[0], 1), (2, -1)):  # never another's bytes
            with pytest.raises(ValueError, match=rf"rows \[{start}, {start + count}\) are not rows of its"):
                b.read_rows(_key(k), start, count)
    for k in ("f64", "ints", "vector"):
        assert b.plain(_key(k)) is None
    # Through TFCheckpoint: every variable read as TensorFlow reads it, the sliced one by RestoreV2.
    ck = _checkpoint.TFCheckpoint(sharded)
    assert ck._bundle is not None
    for k, shape in SHAPES.items():
        dest = np.full(shape, np.nan, np.float32)
        ck.read_into("", k, None, dest)
        np.testing.assert_array_equal(dest, reader.get_tensor(_key(k)))


def test_an_empty_table_and_an_unsharded_save(tmp_path):
    """(TensorFlow's sharding policy drops a tensor of no elements: saved here without one.)"""
    vs = {"empty": tf.Variable(np.zeros((0, 8), np.float32)),
          "w": tf.Variable(np.arange(21, dtype=np.float32).reshape(7, 3))}
    path = tf.train.Checkpoint(**vs).write(str(tmp_path / "ck"))
    b = _bundle.Bundle(path)
    assert b.num_shards == 1 and b.plain(_key("empty")) == (0, 8) and b.plain(_key("w")) == (7, 3)
    b.verify(_key("empty"))
    assert b.read_rows(_key("empty"), 0, 0).shape == (0, 8)
    np.testing.assert_array_equal(b.read_rows(_key("w"), 2, 5), vs["w"].numpy()[2:])


def test_a_restore_reads_each_tensor_about_twice(tmp_path, monkeypatch):
    """A 10 MB table in 1 MiB blocks: the bytes read are its size twice (the
    checksum pass, then the rows), not once per block as RestoreV2's whole-
    tensor reads would be; and RestoreV2 reads none of it."""
    rows, dim = 40_000, 64
    values = np.random.default_rng(1).standard_normal((rows, dim)).astype(np.float32)
    E = tf.tpu.experimental.embedding
    from embedcore.adapters.tf import EmbeddingForServing

    config = {"f": E.FeatureConfig(E.TableConfig(vocabulary_size=rows, dim=dim, name="t"))}
    theirs = E.TPUEmbeddingForServing(config, None)
    theirs.build()
    theirs.embedding_tables[config["f"].table].assign(values)
    path = tf.train.Checkpoint(embedding=theirs).save(str(tmp_path / "ck"))

    monkeypatch.setattr(_checkpoint, "_BLOCK_BYTES", 1 << 20)
    read, restores = [0], [0]
    preadv = os.preadv

    def counting_preadv(fd, buffers, offset):
        n = preadv(fd, buffers, offset)
        read[0] += n
        return n

    restore = tf.raw_ops.RestoreV2

    def counting_restore(**kw):
        restores[0] += 1
        return restore(**kw)

    monkeypatch.setattr(_bundle.os, "preadv", counting_preadv)
    monkeypatch.setattr(_checkpoint.tf.raw_ops, "RestoreV2", counting_restore)
    ours = EmbeddingForServing(config)
    ours.build()
    load_tf_checkpoint(path, ours)
    np.testing.assert_array_equal(ours.embedding_tables[config["f"].table].numpy(), values)
    assert read[0] == 2 * values.nbytes, read[0]
    assert restores[0] == 0


def test_a_restore_with_slots_reads_each_tensor_twice_in_one_block_of_memory(tmp_path, monkeypatch):
    """Values and Adagrad's accumulators, 10 MB each, in 1 MiB blocks: the
    checks (finite values, accumulators in Adagrad's domain) take their
    ranges from the checksum pass, and the rows are read straight into the
    tables: each tensor is read twice, and the restore holds about one
    block of memory (it read the accumulators a third time into a copy of
    the whole slot, and every block into an array of its own first: a
    2M x 64 restore peaked 533 MB above its tables)."""
    import tracemalloc

    rows, dim = 40_000, 64
    rng = np.random.default_rng(2)
    values = rng.standard_normal((rows, dim)).astype(np.float32)
    accumulators = rng.random((rows, dim), np.float32) + np.float32(0.1)
    E = tf.tpu.experimental.embedding
    from embedcore.adapters.tf import EmbeddingForServing

    config = {"f": E.FeatureConfig(E.TableConfig(vocabulary_size=rows, dim=dim, name="t"))}
    theirs = E.TPUEmbeddingForServing(config, E.Adagrad(0.1))
    theirs.build()
    theirs.embedding_tables[config["f"].table].assign(values)
    next(v for v in theirs.variables["t"].values() if "accumulators" in v.name).assign(accumulators)
    path = tf.train.Checkpoint(embedding=theirs).save(str(tmp_path / "ck"))

    monkeypatch.setattr(_checkpoint, "_BLOCK_BYTES", 1 << 20)
    monkeypatch.setattr(_bundle, "_CHUNK", 1 << 20)
    read = [0]
    preadv = os.preadv

    def counting_preadv(fd, buffers, offset):
        n = preadv(fd, buffers, offset)
        read[0] += n
        return n

    monkeypatch.setattr(_bundle.os, "preadv", counting_preadv)
    ours = EmbeddingForServing(config, E.Adagrad(0.1))
    ours.build()
    table = ours._embedcore_tables()[0]
    tracemalloc.start()
    try:
        load_tf_checkpoint(path, ours)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    np.testing.assert_array_equal(table.values(), values)
    np.testing.assert_array_equal(table.slots()["accumulators"], accumulators)
    assert read[0] == 2 * (values.nbytes + accumulators.nbytes), read[0]
    assert peak < 3 << 20, peak  # one 1 MiB block (and small objects), not a 10 MB table or slot

    bad = accumulators.copy()  # a check that finds a problem still names where
    bad[rows - 3, 5] = 0.0
    next(v for v in theirs.variables["t"].values() if "accumulators" in v.name).assign(bad)
    path = tf.train.Checkpoint(embedding=theirs).save(str(tmp_path / "bad"))
    with pytest.raises(ValueError, match=rf"slot 'accumulators' of table 't' at \[{rows - 3}, 5\] must be"):
        load_tf_checkpoint(path, ours)
    np.testing.assert_array_equal(table.slots()["accumulators"], accumulators)


def test_a_damaged_index_is_refused_by_its_block_checksum(sharded, tmp_path):
    import shutil

    for name in os.listdir(os.path.dirname(sharded)):
        shutil.copy(os.path.join(os.path.dirname(sharded), name), tmp_path / name)
    index = tmp_path / "ck.index"
    raw = bytearray(index.read_bytes())
    raw[20] ^= 0x01  # inside the first data block
    index.write_bytes(bytes(raw))
    with pytest.raises(_bundle.BundleError, match="checksum mismatch"):
        _bundle.Bundle(str(tmp_path / "ck"))
    index.write_bytes(b"short")
    with pytest.raises(_bundle.BundleError, match="not a LevelDB table"):
        _bundle.Bundle(str(tmp_path / "ck"))


def test_the_checksum_and_the_end_of_the_file_are_checked(sharded, tmp_path):
    import shutil

    for name in os.listdir(os.path.dirname(sharded)):
        shutil.copy(os.path.join(os.path.dirname(sharded), name), tmp_path / name)
    b = _bundle.Bundle(str(tmp_path / "ck"))
    key = next(_key(k) for k in SHAPES if b.plain(_key(k)) and b.entries[_key(k)].size)
    e = b.entries[key]
    data = b.data_file(key)
    with open(data, "r+b") as f:
        f.seek(e.offset + e.size // 2)
        byte = f.read(1)
        f.seek(e.offset + e.size // 2)
        f.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(OSError, match=f"checksum mismatch in {key}"):
        b.verify(key)
    os.truncate(data, e.offset + e.size - 4)
    with pytest.raises(OSError, match=f"truncated: {key} needs bytes up to {e.offset + e.size}"):
        b.read_rows(key, 0, b.plain(key)[0])


def test_a_stacked_variable_is_checksummed_once(tmp_path, monkeypatch):
    """A SparseCore checkpoint stacks several tables in one variable: the
    restore checks its checksum once, not once per table in it."""
    import collections

    from test_tf_checkpoint import _sparsecore_checkpoint

    E = tf.tpu.experimental.embedding
    from embedcore.adapters.tf import EmbeddingForServing

    shapes = {"sa": (37, 5), "sb": (100, 8), "sc": (20, 3)}
    path, values, accumulators = _sparsecore_checkpoint(str(tmp_path / "ck"), np.random.default_rng(0), shapes)
    calls = collections.Counter()
    verify = _bundle.Bundle.verify

    def counting(self, key, **kwargs):
        calls[key] += 1
        return verify(self, key, **kwargs)

    monkeypatch.setattr(_bundle.Bundle, "verify", counting)
    ours = EmbeddingForServing({n: E.FeatureConfig(E.TableConfig(vocabulary_size=r, dim=d, name=n))
                                for n, (r, d) in shapes.items()}, E.Adagrad(0.1))
    load_tf_checkpoint(path, ours)
    assert calls and set(calls.values()) == {1}, dict(calls)
    for n in shapes:
        np.testing.assert_array_equal(ours.variables[n]["parameters"].numpy(), values[n])
        np.testing.assert_array_equal(ours.variables[n]["accumulators"].numpy(), accumulators[n])
