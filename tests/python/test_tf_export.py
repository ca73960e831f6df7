"""SavedModel export: a model that uses the adapter is saved with
tf.saved_model.save, reloaded in a fresh process that never imports
embedcore, and gives the same outputs (the lookup is lowered to TensorFlow's
own ops at export)."""
import json
import subprocess
import sys

import numpy as np
import pytest

from tf_helpers import E, pair, tf

import embedcore as ec
from embedcore.adapters.tf import Embedding, EmbeddingForServing, export_mode

keras = __import__("pytest").importorskip("keras")

SIGNATURE = {"s": tf.SparseTensorSpec([None, None], tf.int64), "r": tf.RaggedTensorSpec([None, None], tf.int64, 1),
             "d": tf.TensorSpec([None, 2], tf.int64), "q": tf.SparseTensorSpec([None, None], tf.int64),
             "o": tf.RaggedTensorSpec([None, None], tf.int64, 1), "k": tf.TensorSpec([None, 3], tf.int64)}


def _inputs():
    return {"s": tf.SparseTensor([[0, 0], [0, 1], [2, 0], [3, 5]], tf.constant([1, 2, -3, 7], tf.int64), [4, 6]),
            "r": tf.ragged.constant([[1, 2], [], [3, 4, 5], [6]], dtype=tf.int64),
            "d": tf.constant([[1, 2], [3, 4], [5, 6], [7, 8]], tf.int64),
            "q": tf.SparseTensor([[0, 0], [0, 4], [3, 1]], tf.constant([5, 6, 7], tf.int64), [4, 5]),
            "o": tf.ragged.constant([[1, 2], [], [3, 4, 5], [6]], dtype=tf.int64),
            "k": tf.constant([[1, 2, 3], [4, 5, 6], [7, 8, 9], [0, 0, 0]], tf.int64)}


LOAD = """
import json, sys
import numpy as np
import pytest
import tensorflow as tf
args = json.loads(sys.argv[1])
m = tf.saved_model.load(args["path"])
f = {"s": tf.SparseTensor([[0, 0], [0, 1], [2, 0], [3, 5]], tf.constant([1, 2, -3, 7], tf.int64), [4, 6]),
     "r": tf.ragged.constant([[1, 2], [], [3, 4, 5], [6]], dtype=tf.int64),
     "d": tf.constant([[1, 2], [3, 4], [5, 6], [7, 8]], tf.int64),
     "q": tf.SparseTensor([[0, 0], [0, 4], [3, 1]], tf.constant([5, 6, 7], tf.int64), [4, 5]),
     "o": tf.ragged.constant([[1, 2], [], [3, 4, 5], [6]], dtype=tf.int64),
     "k": tf.constant([[1, 2, 3], [4, 5, 6], [7, 8, 9], [0, 0, 0]], tf.int64)}
out = {k: v.numpy() for k, v in m.serve(f).items()}
k = tf.saved_model.load(args["keras"])
out["keras_model"] = k.serve(tf.constant(np.arange(24).reshape(8, 3) % 20)).numpy()
np.savez(args["out"], **out)
print(json.dumps({"embedcore_imported": any(k.startswith("embedcore") for k in sys.modules)}))
"""


def test_saved_model_serves_without_embedcore(tmp_path, rng):
    t_sum = E.TableConfig(vocabulary_size=40, dim=8, combiner="sum", name="t_sum")
    t_mean = E.TableConfig(vocabulary_size=30, dim=4, combiner="sqrtn", name="t_mean")
    config = {"s": E.FeatureConfig(t_sum), "r": E.FeatureConfig(t_mean), "d": E.FeatureConfig(t_mean),
              "q": E.FeatureConfig(t_sum, max_sequence_length=3), "o": E.FeatureConfig(t_mean, output_shape=[8])}
    emb = EmbeddingForServing(config)
    for cfg in (t_sum, t_mean):
        emb.embedding_tables[cfg].assign(rng.standard_normal((cfg.vocabulary_size, cfg.dim)).astype(np.float32))
    layer = Embedding(10, 5, optimizer=ec.optimizers.SGD(0.1), table_name="keras_table")
    layer.build()

    class Model(tf.Module):
        def __init__(self):
            super().__init__()
            self.embedding = emb
            self.layer = layer
            self.kernel = tf.Variable(rng.standard_normal((8, 2)).astype(np.float32))

        @tf.function(input_signature=[SIGNATURE])
        def serve(self, f):
            f = dict(f)
            k = f.pop("k")
            out = self.embedding(f)
            out["s"] = tf.matmul(out["s"], self.kernel)
            out["k"] = self.layer(k, training=False)
            return out

    model = Model()
    before = {k: v.numpy() for k, v in model.serve(_inputs()).items()}  # traced with the engine first
    path = str(tmp_path / "saved")
    tf.saved_model.save(model, path)
    after = model.serve(_inputs())  # still the engine afterwards
    for k in before:
        np.testing.assert_array_equal(after[k].numpy(), before[k])

    # A Keras model with the layer, exported by Keras (which traces before it saves: export_mode lowers those traces).
    klayer = Embedding(20, 4, optimizer=ec.optimizers.SGD(0.1), combiner="sum", table_name="kt")
    inputs = keras.Input(shape=(3,), dtype="int64")
    kmodel = keras.Model(inputs, keras.layers.Dense(2)(keras.layers.Flatten()(klayer(inputs))))
    kmodel.compile("sgd", "mse")
    kids = np.arange(24).reshape(8, 3) % 20
    kmodel.fit(kids, np.ones((8, 2), np.float32), verbose=0)  # trains the table too
    before["keras_model"] = kmodel.predict(kids, verbose=0)
    with export_mode():
        kmodel.export(str(tmp_path / "keras"), verbose=False)
    np.testing.assert_array_equal(kmodel.predict(kids, verbose=0), before["keras_model"])

    out = str(tmp_path / "out.npz")
    args = json.dumps({"path": path, "keras": str(tmp_path / "keras"), "out": out})
    proc = subprocess.run([sys.executable, "-c", LOAD, args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"embedcore_imported": False}
    loaded = np.load(out)
    assert set(loaded.files) == set(before)
    for k in before:  # TensorFlow's own ops give the adapter's outputs
        np.testing.assert_array_equal(loaded[k], before[k], err_msg=k)


def test_export_refuses_a_partly_known_output_shape_for_ragged_input():
    """The lowered lookup refuses what TensorFlow's own lookup (and the
    adapter's engine path) refuses: output_shape [None, 4] for ragged input."""
    import pytest

    table = E.TableConfig(vocabulary_size=10, dim=4, combiner="sum", name="t")
    serving = EmbeddingForServing({"f": E.FeatureConfig(table, output_shape=[None, 4])})
    serving.build()
    rt = tf.ragged.constant([[1, 2], [3]], dtype=tf.int64)
    with export_mode():
        with pytest.raises(ValueError, match=r"partially known TensorShape \(None, 4\)"):
            tf.function(lambda x: serving({"f": x}))(rt)


def test_export_errors_name_the_feature_as_the_engine_path():
    """The lowered lookup's errors (TensorFlow's) name the feature by its
    path, as the engine path's do (they named "": "Feature  is a sequence
    feature but a dense tensor was passed")."""
    t = E.TableConfig(vocabulary_size=20, dim=2, name="t")
    emb = EmbeddingForServing({"hist": E.FeatureConfig(t, max_sequence_length=3), "item": E.FeatureConfig(t)})
    emb.build()
    dense = tf.constant([[1, 2]], tf.int64)
    for lowered in (False, True):
        def call(x, w=None):
            if not lowered:
                return emb(x, weights=w)
            with export_mode():
                return tf.function(lambda x, w: emb(x, weights=w))(x, w)

        with pytest.raises(ValueError, match="Feature hist is a sequence feature but a dense tensor was passed"):
            call({"hist": dense})
        with pytest.raises(ValueError, match="Weight specified for item, but input is dense"):
            call({"item": dense}, {"item": tf.constant([[1.0, 1.0]])})


HANDLE_LOAD = """
import json, sys
import numpy as np
import pytest
import tensorflow as tf
args = json.loads(sys.argv[1])
m = tf.saved_model.load(args["path"])
out = {"serve": m.serve({"a": tf.ragged.constant([[1, 2], [], [3]], dtype=tf.int64)})["a"].numpy(),
       "gather": m.gather(tf.constant([1, 7], tf.int64)).numpy()}
np.savez(args["out"], **out)
print(json.dumps({"embedcore_imported": any(k.startswith("embedcore") for k in sys.modules)}))
"""


def test_table_handles_export_as_tensorflow_serving_code_uses_them(tmp_path, rng):
    """TensorFlow's documented serving pattern over ``embedding_tables``
    (``serving_embedding_lookup``, ``tf.nn.embedding_lookup`` on a table)
    exports a SavedModel that serves in a fresh process without embedcore:
    during the export a handle reads the table's exported variable, not the
    engine through a ``tf.numpy_function``."""
    import pytest

    table = E.TableConfig(vocabulary_size=40, dim=4, combiner="sum", name="t")
    config = {"a": E.FeatureConfig(table)}
    emb = EmbeddingForServing(config, E.Adagrad(0.1))
    values = rng.standard_normal((40, 4)).astype(np.float32)
    emb.embedding_tables[table].assign(values)

    class Model(tf.Module):
        def __init__(self):
            super().__init__()
            self.embedding_api = emb

        @tf.function(input_signature=[{"a": tf.RaggedTensorSpec([None, None], tf.int64)}])
        def serve(self, x):
            return E.serving_embedding_lookup(x, None, self.embedding_api.embedding_tables, config)

        @tf.function(input_signature=[tf.TensorSpec([None], tf.int64)])
        def gather(self, ids):
            return tf.nn.embedding_lookup(self.embedding_api.embedding_tables[table], ids)

    model = Model()
    path = str(tmp_path / "saved")
    tf.saved_model.save(model, path)
    out = str(tmp_path / "out.npz")
    proc = subprocess.run([sys.executable, "-c", HANDLE_LOAD, json.dumps({"path": path, "out": out})],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"embedcore_imported": False}
    loaded = np.load(out)
    np.testing.assert_array_equal(loaded["serve"], np.stack([values[1] + values[2], np.zeros(4), values[3]]))
    np.testing.assert_array_equal(loaded["gather"], values[[1, 7]])
    # Outside an export the handle still reads the engine (the table changed after the save).
    emb.embedding_tables[table].assign(values + 1)
    np.testing.assert_array_equal(model.gather(tf.constant([1], tf.int64)).numpy(), values[[1]] + 1)
    # An optimizer slot has no exported copy: refused, not saved as a graph that cannot load.
    slot = emb.variables["t"]["accumulators"]
    with export_mode():
        with pytest.raises(ValueError, match="slot cannot be exported"):
            tf.function(lambda: tf.reduce_sum(slot))()


def _served_model(rows: int, dim: int):
    """(table, EmbeddingForServing of one sum feature "a", a tf.Module whose
    ``serve`` looks "a" up: what the export tests save)."""
    table = E.TableConfig(vocabulary_size=rows, dim=dim, combiner="sum", name="t")
    emb = EmbeddingForServing({"a": E.FeatureConfig(table)})

    class Model(tf.Module):
        def __init__(self):
            super().__init__()
            self.emb = emb

        @tf.function(input_signature=[{"a": tf.RaggedTensorSpec([None, None], tf.int64)}])
        def serve(self, x):
            return self.emb(x)

    return table, emb, Model()


def test_export_while_other_threads_serve(tmp_path, rng):
    """Saves of one model while another thread keeps running eager lookups
    on the same object all succeed (the lookups used to drop the table
    copies a save in progress had captured: "untracked resource"), and so do
    saves after such lookups (TensorFlow reuses the functions traced for the
    first save); each save holds the values of its time."""
    import threading

    table, emb, model = _served_model(100, 8)
    x = {"a": tf.ragged.constant([[1, 2, 3], [4]], dtype=tf.int64)}
    stop = threading.Event()
    errors = []

    def traffic():
        try:
            while not stop.is_set():
                emb(x)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    thread = threading.Thread(target=traffic)
    thread.start()
    try:
        for i in range(4):
            tf.saved_model.save(model, str(tmp_path / f"busy{i}"))
    finally:
        stop.set()
        thread.join()
    assert not errors
    values = {}
    for i in range(3):  # save, eager lookup (which used to drop the copies), new values, save again
        values[i] = rng.standard_normal((100, 8)).astype(np.float32)
        emb.embedding_tables[table].assign(values[i])
        emb(x)
        tf.saved_model.save(model, str(tmp_path / f"seq{i}"))
    for i in range(3):
        loaded = tf.saved_model.load(str(tmp_path / f"seq{i}"))
        np.testing.assert_array_equal(loaded.serve(x)["a"].numpy(),
                                      np.stack([values[i][1] + values[i][2] + values[i][3], values[i][4]]))


def test_export_after_a_save_reads_the_current_values(tmp_path, rng):
    """After a ``tf.saved_model.save`` the table copies are kept (TensorFlow
    reuses the functions traced for it), but they follow the engine: a later
    ``export_mode()`` block (an eager read of a handle, a lookup traced in
    it) and a later save see the values of their own time, not those of the
    earlier save; and the blocks that used the copies are not accumulated."""
    table, emb, model = _served_model(10, 2)
    handle = emb.embedding_tables[table]
    x = {"a": tf.ragged.constant([[1, 2], [3]], dtype=tf.int64)}
    spec = {"a": tf.RaggedTensorSpec([None, None], tf.int64)}

    def pooled(v):
        return np.stack([v[1] + v[2], v[3]])

    values = [rng.standard_normal((10, 2)).astype(np.float32) for _ in range(4)]
    handle.assign(values[0])
    tf.saved_model.save(model, str(tmp_path / "s0"))
    # New values through the handle alone (no engine lookup in between), then through a lookup.
    handle.assign(values[1])
    with export_mode():
        np.testing.assert_array_equal(handle.read_value().numpy(), values[1])
        f = tf.function(lambda x: emb(x)).get_concrete_function(spec)
        np.testing.assert_array_equal(f(x)["a"].numpy(), pooled(values[1]))
    emb.embedding_tables[table].assign(values[2])
    np.testing.assert_array_equal(emb(x)["a"].numpy(), pooled(values[2]))
    with export_mode():
        np.testing.assert_array_equal(handle.read_value().numpy(), values[2])
        np.testing.assert_array_equal(f(x)["a"].numpy(), pooled(values[2]))  # the function traced earlier too
    handle.assign(values[3])
    emb(x)
    tf.saved_model.save(model, str(tmp_path / "s1"))
    for name, v in (("s0", values[0]), ("s1", values[3])):
        loaded = tf.saved_model.load(str(tmp_path / name))
        np.testing.assert_array_equal(loaded.serve(x)["a"].numpy(), pooled(v))
    # Exited export_mode() blocks are forgotten at the next engine lookup.
    for _ in range(5):
        with export_mode():
            handle.read_value()
        emb(x)
    assert emb._export.modes == []
    assert emb._export.kept  # the copies stay for the functions TensorFlow keeps


def test_an_assign_inside_export_mode_is_read_as_tensorflows_variable_is(rng):
    """Inside one ``export_mode()`` block, a lookup and a handle's
    ``read_value`` after an ``assign`` to the table's handle read the new
    values, as TensorFlow's own TPUEmbeddingForServing reads its assigned
    variable (docs/tensorflow.md: the copies are refreshed at their next use
    after an assign), not the copies the block's first lookup made."""
    table = E.TableConfig(vocabulary_size=10, dim=2, combiner="sum", name="t")
    config = {"a": E.FeatureConfig(table)}
    theirs, ours = pair(config, rng)
    x = {"a": tf.ragged.constant([[1, 2], [3]], dtype=tf.int64)}
    spec = {"a": tf.RaggedTensorSpec([None, None], tf.int64)}
    new = rng.standard_normal((10, 2)).astype(np.float32)
    with export_mode():
        f = tf.function(lambda x: ours(x)).get_concrete_function(spec)
        np.testing.assert_array_equal(ours(x)["a"].numpy(), theirs(x)["a"].numpy())
        for emb in (theirs, ours):
            emb.embedding_tables[table].assign(new)
        want = theirs(x)["a"].numpy()
        np.testing.assert_array_equal(ours(x)["a"].numpy(), want)
        np.testing.assert_array_equal(f(x)["a"].numpy(), want)
        np.testing.assert_array_equal(ours.embedding_tables[table].read_value().numpy(),
                                      theirs.embedding_tables[table].read_value().numpy())


def test_exported_mean_and_sqrtn_of_a_bag_of_more_than_2_24_ids_divide_by_the_count():
    """The exported ragged lookup divides an unweighted bag by its count, as
    the engine (and so the adapter's own call) does: TensorFlow's float32
    sum of ones stops at 2**24."""
    from embedcore.adapters.tf import _export

    n = 3 * 2**23 + 1
    ids = np.empty(n, np.int32)
    ids[:-1] = np.tile(np.array([0, 1, 2], np.int32), 2**23)
    ids[-1] = 3
    values = np.array([[1.0], [1.0], [-2.0], [1000.0]], np.float32)
    table = ec.Table(name="t", rows=4, dim=1)
    table.assign(values)
    ragged = tf.RaggedTensor.from_row_splits(tf.constant(ids), tf.constant([0, n], tf.int64))
    for combiner in ("mean", "sqrtn"):
        got = _export._ragged_pooled(tf.constant(values), ragged, None, combiner).numpy()
        assert got[0, 0] == table.lookup(ids, np.array([0, n]), combiner=combiner)[0, 0]
    assert got[0, 0] == np.float32(1000) / np.float32(np.sqrt(n))


def test_a_training_function_is_refused_by_the_export(tmp_path):
    """A SavedModel's lookups read copies of the tables: a training function
    (a training=True call of a layer that trains) would be exported training
    the rest of the model and leaving the tables as they were, silently;
    the save raises naming the layer, and serving functions still export."""
    import embedcore as ec
    from embedcore.adapters.tf import Embedding

    m = tf.Module()
    m.emb = Embedding(20, 4, optimizer=ec.optimizers.SGD(0.5), combiner="sum", table_name="t", name="items")
    m.emb.build((None, 2))
    spec = [tf.TensorSpec([None, 2], tf.int64)]
    m.train = tf.function(lambda x: m.emb(x, training=True), input_signature=spec)
    with pytest.raises(ValueError, match="'items': a training call .* cannot be exported"):
        tf.saved_model.save(m, str(tmp_path / "a"))
    del m.train
    m.serve = tf.function(lambda x: m.emb(x), input_signature=spec)
    tf.saved_model.save(m, str(tmp_path / "b"))
    x = tf.constant([[1, 2]], tf.int64)
    assert np.array_equal(tf.saved_model.load(str(tmp_path / "b")).serve(x).numpy(), m.serve(x).numpy())
