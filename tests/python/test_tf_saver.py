"""embedcore.adapters.tf.Saver: SOK's dump_to_file / restore_from_file /
load_embedding_values on the adapter's tables, eagerly and inside
tf.function, each returning the string tensor "OK"; files in embedcore's
checkpoint format."""
import numpy as np
import pytest

from tf_helpers import E, tf

import embedcore as ec
from embedcore.adapters.tf import Embedding, EmbeddingForServing, Saver


def _layer():
    layer = Embedding(12, 3, optimizer=ec.optimizers.Adagrad(0.1), table_name="sok")
    layer.build()
    return layer


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "tf.function"])
def test_dump_restore_load(tmp_path, rng, traced):
    saver = Saver()
    wrap = tf.function if traced else (lambda f: f)
    layer = _layer()
    table = layer._embedcore_tables()[0]
    values = rng.standard_normal((12, 3)).astype(np.float32)

    # load_embedding_values: a list of [n_i, dim] tensors stacked along rows, as SOK takes them.
    parts = [tf.constant(values[:5]), tf.constant(values[5:])]
    out = wrap(lambda: saver.load_embedding_values(layer, parts))()
    assert out.dtype == tf.string and out.numpy() == b"OK"
    np.testing.assert_array_equal(table.values(), values)
    table.apply_gradients(np.array([1, 2]), np.array([0, 2]), np.ones((1, 3), np.float32))  # some slot state

    path = str(tmp_path / "dump")
    assert wrap(lambda: saver.dump_to_file(layer, path))().numpy() == b"OK"
    assert ec.checkpoint.read_info(path).table_names == ["sok"]  # an embedcore checkpoint
    saved_values, saved_slots = table.values().copy(), {k: v.copy() for k, v in table.slots().items()}

    other = _layer()
    assert wrap(lambda p: saver.restore_from_file(other, p))(tf.constant(path)).numpy() == b"OK"
    restored = other._embedcore_tables()[0]
    np.testing.assert_array_equal(restored.values(), saved_values)
    for k, v in saved_slots.items():
        np.testing.assert_array_equal(restored.slots()[k], v)
    assert restored.step == 1


def test_soks_parameter_names_by_keyword(tmp_path, rng):
    saver = Saver()
    layer = _layer()
    values = rng.standard_normal((12, 3)).astype(np.float32)
    assert saver.load_embedding_values(embedding_variable=layer, tensors=[tf.constant(values)]).numpy() == b"OK"
    path = str(tmp_path / "dump")
    assert saver.dump_to_file(embedding_variable=layer, filepath=path).numpy() == b"OK"
    other = _layer()
    assert saver.restore_from_file(embedding_variable=other, filepath=path).numpy() == b"OK"
    np.testing.assert_array_equal(other._embedcore_tables()[0].values(), values)


def test_tables_of_a_serving_object_and_errors(tmp_path, rng):
    cfg = E.TableConfig(vocabulary_size=6, dim=2, name="t")
    emb = EmbeddingForServing({"f": E.FeatureConfig(cfg)})
    saver = Saver()
    values = rng.standard_normal((6, 2)).astype(np.float32)
    assert saver.load_embedding_values(emb.embedding_tables[cfg], tf.constant(values)).numpy() == b"OK"
    np.testing.assert_array_equal(emb.embedding_tables[cfg].numpy(), values)
    assert saver.dump_to_file(emb, str(tmp_path / "d")).numpy() == b"OK"
    with pytest.raises(ValueError, match="rows"):
        saver.load_embedding_values(emb, [tf.constant(values[:4])])
    with pytest.raises(tf.errors.InvalidArgumentError):
        tf.function(lambda: saver.load_embedding_values(emb, [tf.constant(values[:4])]))()
    with pytest.raises(ValueError):
        saver.restore_from_file(emb, str(tmp_path / "missing"))


def test_list_mixing_tables_and_handles(tmp_path, rng):
    # A list of an engine Table and a handle of embedding_tables is two tables (was: TypeError when the
    # engine Table came first).
    ta, tb = E.TableConfig(vocabulary_size=6, dim=2, name="ta"), E.TableConfig(vocabulary_size=5, dim=2, name="tb")
    emb = EmbeddingForServing({"a": E.FeatureConfig(ta), "b": E.FeatureConfig(tb)})
    mixed = [emb.embedding_tables[ta].table, emb.embedding_tables[tb]]
    path = str(tmp_path / "mixed")
    assert Saver().dump_to_file(mixed, path).numpy() == b"OK"
    assert ec.checkpoint.read_info(path).table_names == ["ta", "tb"]
    values = emb.embedding_tables[tb].numpy().copy()
    emb.embedding_tables[tb].assign(np.zeros((5, 2), np.float32))
    assert tf.function(lambda: Saver().restore_from_file(mixed, path))().numpy() == b"OK"
    np.testing.assert_array_equal(emb.embedding_tables[tb].numpy(), values)


def test_restore_values_only_and_dumps_sharing_a_directory(tmp_path, rng):
    # SOK 1.x restores values only; several variables are dumped into one directory in turn.
    saver, path = Saver(), str(tmp_path / "dump")
    layer = _layer()
    other = Embedding(7, 3, optimizer=ec.optimizers.SGD(0.1), table_name="other")
    other.build()
    assert saver.dump_to_file(layer, path).numpy() == b"OK"
    assert saver.dump_to_file(other, path).numpy() == b"OK"
    assert sorted(ec.checkpoint.read_info(path).table_names) == ["other", "sok"]
    adam = Embedding(12, 3, optimizer=ec.optimizers.Adam(0.1), table_name="sok")
    adam.build()
    with pytest.raises(ec.CheckpointError, match="include_optimizer=False"):
        saver.restore_from_file(adam, path)
    out = tf.function(lambda: saver.restore_from_file(adam, path, include_optimizer=False))()
    assert out.numpy() == b"OK"
    np.testing.assert_array_equal(adam._embedcore_tables()[0].values(), layer._embedcore_tables()[0].values())


def test_include_optimizer_as_a_tensor(tmp_path):
    """include_optimizer may be a bool tensor: eagerly, and a tf.function's
    argument, read when the function runs (its symbolic tensor reached the
    type check, which refused it); a string is refused, naming it."""
    path = str(tmp_path / "c")
    ec.save(path, ec.Table(name="t", rows=4, dim=2, optimizer=ec.optimizers.Adam(0.1)))
    table = ec.Table(name="t", rows=4, dim=2, optimizer=ec.optimizers.Adagrad(0.1))  # other slots: values only
    saver = Saver()
    assert saver.restore_from_file(table, path, include_optimizer=tf.constant(False)).numpy() == b"OK"
    restore = tf.function(lambda flag: saver.restore_from_file(table, path, include_optimizer=flag))
    assert restore(tf.constant(False)).numpy() == b"OK"
    with pytest.raises(tf.errors.InvalidArgumentError, match="include_optimizer=False"):
        restore(tf.constant(True))  # (Adagrad's slots are not Adam's: the slots were asked for)
    with pytest.raises(TypeError, match="include_optimizer must be a bool, got 'no'"):
        saver.restore_from_file(table, path, include_optimizer="no")


def test_file_error_in_a_graph_is_invalid_argument(tmp_path):
    # A failed file operation raises OSError eagerly and, like every other error, InvalidArgumentError inside
    # tf.function, naming the file (was: UnknownError).
    cfg = E.TableConfig(vocabulary_size=4, dim=2, name="t")
    emb = EmbeddingForServing({"f": E.FeatureConfig(cfg)})
    path = str(tmp_path / "no_such_parent" / "x")
    with pytest.raises(OSError, match="no_such_parent"):
        Saver().dump_to_file(emb, path)
    with pytest.raises(tf.errors.InvalidArgumentError, match="no_such_parent"):
        tf.function(lambda p: Saver().dump_to_file(emb, p))(tf.constant(path))
    assert not (tmp_path / "no_such_parent").exists()


def test_filepath_not_a_path_is_a_type_error(tmp_path, monkeypatch):
    # None, an int or a list named a directory after their str() in the working directory (a restore read what an
    # earlier mistaken dump left there); a pathlib.Path and bytes are paths, as for embedcore.Saver.
    monkeypatch.chdir(tmp_path)
    layer, saver = _layer(), Saver()
    before = layer._embedcore_tables()[0].values().copy()
    for bad in (None, 5, ["dump"], tf.constant(5), tf.constant(["a", "b"])):
        with pytest.raises(TypeError, match="filepath must be a string"):
            saver.dump_to_file(layer, bad)
        with pytest.raises(TypeError, match="filepath must be a string"):
            saver.restore_from_file(layer, bad)
    with pytest.raises(TypeError, match="int32 tensor"):
        tf.function(lambda p: saver.dump_to_file(layer, p))(tf.constant(5))
    assert list(tmp_path.iterdir()) == []
    np.testing.assert_array_equal(layer._embedcore_tables()[0].values(), before)

    assert saver.dump_to_file(layer, tmp_path / "dump").numpy() == b"OK"
    assert saver.restore_from_file(layer, b"dump").numpy() == b"OK"
    assert tf.function(lambda: saver.restore_from_file(layer, tmp_path / "dump"))().numpy() == b"OK"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dump"]
