"""embedcore.adapters.tf.Embedding: a Keras layer whose tables live in the
engine and train with model.fit; one step equals the NumPy reference update
(tests/python/reference.py) from the layer's output gradient."""
import copy
import json
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest

from tf_helpers import E, tf

import embedcore as ec
import reference as ref
from embedcore.adapters.tf import Embedding

keras = pytest.importorskip("keras")


def _assert_table(table, expected: ref.TableRef):
    np.testing.assert_allclose(table.values(), expected.values, rtol=2e-6, atol=1e-7)
    for k, v in table.slots().items():
        np.testing.assert_allclose(v, expected.slots[k], rtol=2e-6, atol=1e-7)
    assert table.step == expected.step


@pytest.mark.parametrize("optimizer,reference", [
    (ec.optimizers.Adagrad(learning_rate=0.5, initial_accumulator_value=0.1), ref.OptimizerRef("adagrad", 0.5)),
    (E.SGD(0.3), ref.OptimizerRef("sgd", 0.3)),
    (E.Adam(0.05), ref.OptimizerRef("adam", 0.05)),
    (ec.optimizers.RowWiseAdagrad(learning_rate=0.5, epsilon=1e-3),
     ref.OptimizerRef("rowwise_adagrad", 0.5, epsilon=1e-3, initial_accumulator_value=0.0)),
    # TensorFlow's optimizers with each option the conversion must carry (the gradients here are ~0.02; the
    # reference's formulas are those of TensorFlow's docs, named as embedcore names them):
    (E.SGD(0.3, clipvalue=(-0.004, 0.002)), ref.OptimizerRef("sgd", 0.3, clipvalue=(-0.004, 0.002))),
    (E.SGD(0.3, clipvalue=(None, 0.002)), ref.OptimizerRef("sgd", 0.3, clipvalue=(-np.inf, 0.002))),
    (E.SGD(0.3, weight_decay_factor=0.5, multiply_weight_decay_factor_by_learning_rate=True),
     ref.OptimizerRef("sgd", 0.3, weight_decay_factor=0.5, multiply_weight_decay_factor_by_learning_rate=True)),
    (E.Adagrad(0.5, initial_accumulator_value=2.0), ref.OptimizerRef("adagrad", 0.5, initial_accumulator_value=2.0)),
    (E.Adam(0.05, epsilon=1e-3, sum_inside_sqrt=False),
     ref.OptimizerRef("adam", 0.05, epsilon=1e-3, sum_inside_sqrt=False)),
    (E.FTRL(0.5, beta=0.5, l2_regularization_strength=0.1),
     ref.OptimizerRef("ftrl", 0.5, beta=0.5, l2_regularization_strength=0.1)),
], ids=["ec-adagrad", "tf-sgd", "tf-adam", "ec-rowwise-adagrad", "tf-sgd-clip", "tf-sgd-clip-above",
        "tf-sgd-decay-times-lr", "tf-adagrad-accumulator", "tf-adam-sqrt-outside", "tf-ftrl-beta"])
def test_fit_step_equals_reference(rng, optimizer, reference):
    rows, dim, batch, k = 30, 4, 8, 3
    layer = Embedding(rows, dim, optimizer=optimizer, table_name="items")
    inputs = keras.Input(shape=(k,), dtype="int64")
    model = keras.Model(inputs, layer(inputs))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    table = layer._embedcore_tables()[0]
    expected = ref.TableRef(table.values().copy(), reference)
    for step in range(2):
        ids = rng.integers(0, rows, (batch, k))
        y = rng.standard_normal((batch, k, dim)).astype(np.float32)
        out = expected.values[ids]
        dloss = 2.0 * (out - y) / out.size  # mean squared error over every output
        model.fit(ids, y, batch_size=batch, epochs=1, verbose=0, shuffle=False)
        expected.apply(expected.row_grads().add_flat(ids.reshape(-1), None, dloss.reshape(-1, dim)))
        _assert_table(table, expected)
    # Inference does not train.
    before = table.values().copy()
    model.predict(ids, verbose=0)
    model.evaluate(ids, y, verbose=0)
    np.testing.assert_array_equal(table.values(), before)


def test_a_dropped_model_frees_its_tables_after_fit_and_traced_lookups():
    """A model trained with fit (a tf.function with the engine's update in
    the gradient) and layers looked up in tf.function with weighted sparse
    and ragged inputs: once dropped, their tables are freed. TensorFlow keeps
    every tf.numpy_function callable and graph custom gradient for the life
    of the process, and those held the tables (values and slots), a whole
    model's worth per model built."""
    import gc
    import weakref

    import keras
    from embedcore.adapters.tf import EmbeddingForServing

    refs = []

    def fit():
        layer = Embedding(100, 4, optimizer=ec.optimizers.Adagrad(0.05), combiner="mean")
        ids = keras.Input(shape=(4,), dtype="int64")
        model = keras.Model(ids, keras.layers.Dense(1)(layer(ids)))
        model.compile(optimizer="sgd", loss="mse")
        model.fit(np.arange(64).reshape(16, 4), np.ones((16, 1), np.float32), epochs=1, verbose=0)
        refs.extend(weakref.ref(h.table) for h in layer.embedding_tables.values())

    def traced(kind):
        t = tf.tpu.experimental.embedding.TableConfig(vocabulary_size=100, dim=4, combiner="mean", name="t")
        emb = EmbeddingForServing({"f": tf.tpu.experimental.embedding.FeatureConfig(t)}, None)
        if kind == "sparse":
            x, w = tf.sparse.from_dense(tf.constant([[1, 2]], tf.int64)), tf.sparse.from_dense(tf.constant([[.5, 2.]]))
        else:
            x, w = tf.ragged.constant([[1, 2], [3]], tf.int64), tf.ragged.constant([[0.5, 2.0], [1.0]])
        tf.function(lambda x, w: emb(x, weights=w))({"f": x}, {"f": w})
        refs.append(weakref.ref(emb.embedding_tables[t].table))

    def handle():  # a table's handle read and assigned in a tf.function
        t = tf.tpu.experimental.embedding.TableConfig(vocabulary_size=100, dim=4, name="t")
        emb = EmbeddingForServing({"f": tf.tpu.experimental.embedding.FeatureConfig(t)}, None)
        emb.build()
        h = emb.embedding_tables[t]

        @tf.function
        def rewrite():
            h.assign(tf.ones([100, 4]))
            return h.read_value()

        assert float(tf.reduce_sum(rewrite())) == 400.0
        refs.append(weakref.ref(h.table))

    fit()
    traced("sparse")
    traced("ragged")
    handle()
    gc.collect()
    assert [r() is None for r in refs] == [True] * 4


@pytest.mark.parametrize("keras_optimizer", ["adam", "sgd", "rmsprop", "adagrad"])
def test_fit_with_a_dense_head_trains_the_table(rng, keras_optimizer):
    """Embedding -> Flatten -> Dense(1) under model.fit with each Keras
    optimizer: one engine step per batch, equal to the reference update from
    the gradient that reaches the layer through the Dense kernel. (With a
    control dependency alone, Grappler pruned the engine's update of this
    model under Adam, silently.)"""
    rows, dim, batch, k = 40, 4, 8, 3
    layer = Embedding(rows, dim, optimizer=ec.optimizers.Adagrad(0.3), table_name="items")
    inputs = keras.Input(shape=(k,), dtype="int64")
    dense = keras.layers.Dense(1)
    model = keras.Model(inputs, dense(keras.layers.Flatten()(layer(inputs))))
    model.compile(optimizer=keras_optimizer, loss="mse")
    table = layer._embedcore_tables()[0]
    expected = ref.TableRef(table.values().copy(), ref.OptimizerRef("adagrad", 0.3))
    for step in range(3):
        ids = rng.integers(0, rows, (batch, k))
        y = rng.standard_normal((batch, 1)).astype(np.float32)
        kernel, bias = (np.asarray(v, np.float64) for v in dense.get_weights())
        emb = expected.values[ids].reshape(batch, k * dim)
        dpred = 2.0 * (emb @ kernel + bias - y) / batch
        demb = (dpred @ kernel.T).reshape(batch * k, dim)
        model.fit(ids, y, batch_size=batch, epochs=1, verbose=0, shuffle=False)
        assert table.step == step + 1
        expected.apply(expected.row_grads().add_flat(ids.reshape(-1), None, demb))
        np.testing.assert_allclose(table.values(), expected.values, rtol=1e-5, atol=1e-6)


class SharedTableModel(keras.Model):
    def __init__(self, layer):
        super().__init__()
        self.embedding = layer

    def call(self, inputs):
        out = self.embedding(inputs["features"], inputs["weights"])
        return tf.concat([out["a"], out["b"], tf.reshape(out["s"], [-1, 2 * 4])], axis=1)


def test_fit_features_sharing_a_table(rng):
    # Three features of one mean table (pooled ragged with weights, pooled sparse, a sequence): one optimizer
    # step per batch, with the gradients of all three summed before it.
    table = E.TableConfig(vocabulary_size=25, dim=4, combiner="mean", name="shared")
    config = {"a": E.FeatureConfig(table), "b": E.FeatureConfig(table), "s": E.FeatureConfig(table, max_sequence_length=2)}
    layer = Embedding(feature_config=config, optimizer=ec.optimizers.Adagrad(0.2))
    model = SharedTableModel(layer)
    model.compile(optimizer="sgd", loss="mse")
    batch = 5
    lengths = np.array([2, 0, 3, 1, 4])
    a_ids = rng.integers(0, 25, lengths.sum())
    a_w = rng.uniform(0.5, 2.0, lengths.sum()).astype(np.float32)
    b_idx = np.array([[0, 0], [0, 1], [2, 0], [3, 2], [4, 0]])
    b_ids = rng.integers(0, 25, len(b_idx))
    s_ids = rng.integers(0, 25, lengths.sum())
    a = tf.RaggedTensor.from_row_lengths(a_ids, lengths)
    features = {"features": {"a": a, "b": tf.SparseTensor(b_idx, b_ids, [batch, 3]),
                             "s": tf.RaggedTensor.from_row_lengths(s_ids, lengths)},
                "weights": {"a": tf.RaggedTensor.from_row_lengths(a_w, lengths), "b": None, "s": None}}
    y = rng.standard_normal((batch, 16)).astype(np.float32)
    engine = layer._embedcore_tables()[0]
    expected = ref.TableRef(engine.values().copy(), ref.OptimizerRef("adagrad", 0.2))

    offsets = np.concatenate([[0], np.cumsum(lengths)])
    b_offsets = np.array([0, 2, 2, 3, 4, 5])
    pred = np.concatenate([ref.pooled(expected.values, a_ids, offsets, a_w, "mean")[0],
                           ref.pooled(expected.values, b_ids, b_offsets, None, "mean")[0],
                           ref.sequence_padded(expected.values, s_ids, offsets, None, 2).reshape(batch, 8)], axis=1)
    g = 2.0 * (pred - y) / pred.size
    model.train_on_batch(features, y)
    rg = expected.row_grads()
    rg.add_pooled(a_ids, offsets, a_w, "mean", g[:, 0:4])
    rg.add_pooled(b_ids, b_offsets, None, "mean", g[:, 4:8])
    rg.add_padded(s_ids, offsets, None, 2, g[:, 8:].reshape(batch, 2, 4))
    expected.apply(rg)
    _assert_table(engine, expected)


def test_gradient_tape_eager_and_traced(rng):
    layer = Embedding(20, 3, optimizer=ec.optimizers.SGD(1.0), combiner="sum", table_name="t")
    layer.build()
    engine = layer._embedcore_tables()[0]
    ids = tf.ragged.constant([[1, 2, 2], [], [5]], dtype=tf.int64)

    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(layer(ids, training=True))
        return tape.gradient(loss, layer.trainable_weights)

    for run in (step, tf.function(step)):
        before = engine.values().copy()
        grads = run()
        assert float(grads[0]) == 0.0  # the anchor weight's gradient
        expected = before.copy()
        expected[1] -= 1.0
        expected[2] -= 2.0
        expected[5] -= 1.0
        np.testing.assert_array_equal(engine.values(), expected)
    # training=False: a plain lookup, no update.
    before = engine.values().copy()
    with tf.GradientTape() as tape:
        tf.reduce_sum(layer(ids, training=False))
    np.testing.assert_array_equal(engine.values(), before)


def test_a_step_one_table_refuses_changes_no_table():
    """Table "b"'s FTRL refuses its learning rate of 0 (the update divides by
    it): the step raises, eagerly and in a graph, and table "a", whose SGD
    step would have run first, is unchanged too."""
    rate = tf.Variable(0.1)
    config = {"a": E.FeatureConfig(E.TableConfig(4, 2, name="a", initializer=tf.constant_initializer(1.0),
                                                 optimizer=E.SGD(0.5))),
              "b": E.FeatureConfig(E.TableConfig(4, 2, name="b", initializer=tf.constant_initializer(1.0),
                                                 optimizer=E.FTRL(learning_rate=lambda: rate)))}
    layer = Embedding(feature_config=config)
    layer.build()
    x = {"a": tf.constant([[1]], tf.int64), "b": tf.constant([[2]], tf.int64)}

    def step():
        with tf.GradientTape() as tape:
            out = layer(x, training=True)
            loss = tf.reduce_sum(out["a"]) + tf.reduce_sum(out["b"])
        return tape.gradient(loss, layer.trainable_weights)

    tables = {t.name: t for t in layer._embedcore_tables()}
    for run in (step, tf.function(step)):
        rate.assign(0.1)
        run()  # a step both tables take
        rate.assign(0.0)
        before = {name: (t.to_numpy(), t.step) for name, t in tables.items()}
        with pytest.raises((ValueError, tf.errors.InvalidArgumentError), match="FTRL: learning rate 0.0"):
            run()
        for name, t in tables.items():
            np.testing.assert_array_equal(t.to_numpy(), before[name][0])
            assert t.step == before[name][1], name


def test_training_under_loss_scaling_is_refused(rng):
    # mixed_float16 makes compile() wrap the Keras optimizer in a LossScaleOptimizer, whose loss scale would
    # reach the engine's update (applied in the backward pass) unscaled: training is refused, naming the
    # policy, and nothing changes; inference works.
    previous = keras.config.dtype_policy()
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        layer = Embedding(30, 4, optimizer=ec.optimizers.SGD(0.5), table_name="items")
        inputs = keras.Input(shape=(3,), dtype="int64")
        model = keras.Model(inputs, keras.layers.Activation("linear", dtype="float32")(layer(inputs, training=False)))
        ids = rng.integers(0, 30, (8, 3))
        y = rng.standard_normal((8, 3, 4)).astype(np.float32)
        table = layer._embedcore_tables()[0]
        before = table.values().copy()
        # (The outputs are float16, the policy's compute dtype, as keras.layers.Embedding's.)
        np.testing.assert_array_equal(np.asarray(model.predict(ids, verbose=0)),
                                      before[ids].astype(np.float16).astype(np.float32))
        train = keras.Model(inputs, keras.layers.Activation("linear", dtype="float32")(layer(inputs)))
        train.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        with pytest.raises(NotImplementedError, match=r"'mixed_float16' dtype policy is not supported"):
            train.fit(ids, y, batch_size=8, epochs=1, verbose=0)
        np.testing.assert_array_equal(table.values(), before)
    finally:
        keras.mixed_precision.set_global_policy(previous)


@pytest.mark.parametrize("how", ["model policy", "optimizer given"])
def test_training_in_a_model_whose_optimizer_scales_the_loss_is_refused(rng, how):
    """A model's own 'mixed_float16' policy (the layer's and the global one
    float32) makes compile() wrap its optimizer in a LossScaleOptimizer, as
    does one given to compile: the layer sees it through Keras's call
    context and refuses to train (the update would be 32768 times too large)."""
    layer = Embedding(30, 4, optimizer=ec.optimizers.SGD(0.5), table_name="items")

    class Model(keras.Model):
        def __init__(self):
            super().__init__(dtype="mixed_float16" if how == "model policy" else None)
            self.emb, self.flat, self.head = layer, keras.layers.Flatten(dtype="float32"), keras.layers.Dense(1)

        def call(self, x):
            return self.head(self.flat(self.emb(x)))

    model = Model()
    optimizer = keras.optimizers.SGD(0.1)
    model.compile(optimizer=optimizer if how == "model policy" else keras.optimizers.LossScaleOptimizer(optimizer),
                  loss="mse")
    ids, y = rng.integers(0, 30, (8, 3)), rng.standard_normal((8, 1)).astype(np.float32)
    model.predict(ids, verbose=0)  # inference works
    table = layer._embedcore_tables()[0]
    before = table.values().copy()
    with pytest.raises(NotImplementedError, match=r"training in model '.*', whose optimizer is a LossScaleOptimizer"):
        model.fit(ids, y, batch_size=8, epochs=1, verbose=0)
    np.testing.assert_array_equal(table.values(), before)
    assert table.step == 0


def test_outputs_take_a_mixed_policy_s_compute_dtype(rng):
    """As keras.layers.Embedding's, so that they concatenate with the other
    layers' outputs; and the layer trains under mixed_bfloat16 as in float32
    from the bfloat16 gradient of its outputs."""
    previous = keras.config.dtype_policy()
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        layer = Embedding(30, 4, optimizer=ec.optimizers.SGD(0.5), table_name="items")
        ids = rng.integers(0, 30, (2, 3))
        out = layer(ids)
        assert out.dtype == keras.layers.Embedding(30, 4)(ids).dtype == tf.bfloat16
        table = layer._embedcore_tables()[0]
        before = table.values().copy()
        np.testing.assert_array_equal(out.numpy().astype(np.float32), before[ids].astype(tf.bfloat16.as_numpy_dtype)
                                      .astype(np.float32))
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.cast(layer(ids), tf.float32) * 2.0)
        tape.gradient(loss, layer.trainable_weights)
        want = before.copy()
        np.subtract.at(want, ids.reshape(-1), 0.5 * 2.0)
        np.testing.assert_allclose(table.values(), want, rtol=1e-6)
        # Float weights stay float32 (Keras would cast them to bfloat16, which the table refuses), and a
        # `training` tensor in a graph works.
        bags = tf.RaggedTensor.from_row_lengths(tf.constant([1, 2, 3], tf.int64), [2, 1])
        weights = tf.RaggedTensor.from_row_lengths(tf.constant([0.5, 2.0, 1.0]), [2, 1])

        @tf.function
        def step(training):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(tf.cast(layer(bags, weights=weights, training=training), tf.float32))
            return tape.gradient(loss, layer.trainable_weights)

        step(tf.constant(True))
        assert table.step == 2
    finally:
        keras.mixed_precision.set_global_policy(previous)


def test_a_layer_without_an_optimizer_warns_once_that_it_does_not_train(rng):
    layer = Embedding(30, 4, table_name="items")
    inputs = keras.Input(shape=(3,), dtype="int64")
    model = keras.Model(inputs, keras.layers.Dense(1)(keras.layers.Flatten()(layer(inputs))))
    model.compile(optimizer="sgd", loss="mse")
    table = layer._embedcore_tables()[0]
    before = table.values().copy()
    ids, y = rng.integers(0, 30, (8, 3)), rng.standard_normal((8, 1)).astype(np.float32)
    with pytest.warns(UserWarning, match=r"Embedding '.*': no table has an optimizer, so training does not change"):
        model.fit(ids, y, epochs=2, verbose=0)
    np.testing.assert_array_equal(table.values(), before)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*no table has an optimizer")
        model.fit(ids, y, verbose=0)  # once a layer
        Embedding(30, 4, optimizer=ec.optimizers.SGD(0.1))(ids, training=True)  # trains: no warning
        Embedding(30, 4)(ids)  # inference
        frozen = Embedding(30, 4)
        frozen.trainable = False
        frozen(ids, training=True)


def test_a_table_without_an_optimizer_stays_beside_one_that_trains():
    """A table without an engine optimizer (a frozen, pretrained one) beside
    a trained one: the step trains the one and leaves the other as it is,
    eagerly, in a graph and in fit (docs/tensorflow.md; was: every step
    refused, "table 'frozen' has no optimizer")."""
    config = {"a": E.FeatureConfig(E.TableConfig(5, 2, name="trained", initializer=tf.constant_initializer(1.0),
                                                 combiner="sum", optimizer=E.SGD(0.5))),
              "b": E.FeatureConfig(E.TableConfig(5, 2, name="frozen", initializer=tf.constant_initializer(1.0),
                                                 combiner="sum"))}
    layer = Embedding(feature_config=config)
    layer.build()
    tables = {t.name: t for t in layer._embedcore_tables()}
    x = {"a": tf.constant([[1, 1], [2, 3]], tf.int64), "b": tf.constant([[4, 0], [1, 2]], tf.int64)}

    def step():
        with tf.GradientTape() as tape:
            out = layer(x, training=True)
            loss = tf.reduce_sum(out["a"]) + tf.reduce_sum(out["b"])
        return tape.gradient(loss, layer.trainable_weights)

    expected = np.ones((5, 2), np.float32)
    for run in (step, tf.function(step)):
        run()
        expected[1] -= 2 * 0.5
        expected[[2, 3]] -= 0.5
        np.testing.assert_array_equal(tables["trained"].values(), expected)
        np.testing.assert_array_equal(tables["frozen"].values(), np.ones((5, 2), np.float32))
        assert tables["frozen"].step == 0
    inputs = {k: keras.Input(shape=(2,), dtype="int64", name=k) for k in x}
    out = layer(inputs)
    model = keras.Model(inputs, keras.layers.Concatenate()([out["a"], out["b"]]))
    model.compile(optimizer="sgd", loss="mse")
    model.fit(x, np.zeros((2, 4), np.float32), verbose=0)
    assert tables["trained"].step == 3
    np.testing.assert_array_equal(tables["frozen"].values(), np.ones((5, 2), np.float32))


def test_a_frozen_layer_does_not_train(rng):
    """layer.trainable = False (Keras's freezing) stops the engine's updates,
    also with a trainable head around it and under Adam; the head trains."""
    layer = Embedding(30, 4, optimizer=ec.optimizers.Adagrad(0.3), table_name="items")
    inputs = keras.Input(shape=(3,), dtype="int64")
    dense = keras.layers.Dense(1)
    model = keras.Model(inputs, dense(keras.layers.Flatten()(layer(inputs))))
    layer.trainable = False
    model.compile(optimizer="adam", loss="mse")
    table = layer._embedcore_tables()[0]
    before, kernel = table.values().copy(), dense.get_weights()[0].copy()
    for run_eagerly in (False, True):
        model.compile(optimizer="adam", loss="mse", run_eagerly=run_eagerly)
        model.fit(rng.integers(0, 30, (8, 3)), rng.standard_normal((8, 1)).astype(np.float32), verbose=0)
    assert table.step == 0 and np.array_equal(table.values(), before)
    assert not np.array_equal(dense.get_weights()[0], kernel)
    layer.trainable = True
    model.compile(optimizer="adam", loss="mse")
    model.fit(rng.integers(0, 30, (8, 3)), rng.standard_normal((8, 1)).astype(np.float32), verbose=0)
    assert table.step == 1


REPLICAS = r"""
import numpy as np
import tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
import keras
import embedcore as ec
from embedcore.adapters.tf import Embedding
strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
with strategy.scope():
    layer = Embedding(30, 4, optimizer=ec.optimizers.SGD(0.1), table_name="items")
    inputs = keras.Input(shape=(3,), dtype="int64")
    model = keras.Model(inputs, keras.layers.Dense(1)(keras.layers.Flatten()(layer(inputs))))
    model.compile(optimizer="adam", loss="mse")
table = layer._embedcore_tables()[0]
before = table.values().copy()
x = np.arange(24).reshape(8, 3) % 30
print("PREDICT", model.predict(x, verbose=0).shape)
try:
    model.fit(x, np.zeros((8, 1), np.float32), batch_size=8, verbose=0)
    print("TRAINED", table.step)
except NotImplementedError as e:
    print("REFUSED", table.step, np.array_equal(table.values(), before), e)
"""


def test_training_with_replicas_in_sync_is_refused(tmp_path):
    """Under a tf.distribute strategy with 2 replicas, each replica's backward
    would update the shared table in turn (two half-batch steps, the second
    from values the first changed): training is refused before anything
    changes; inference works. (A subprocess: the 2 logical CPUs must be set
    before TensorFlow starts.)"""
    script = tmp_path / "replicas.py"
    script.write_text(REPLICAS)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    res = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "PREDICT (8, 1)" in res.stdout, res.stdout + res.stderr
    assert "REFUSED 0 True" in res.stdout and "2 replicas in sync (tf.distribute) is not supported" in res.stdout, \
        res.stdout + res.stderr


def test_initializers_of_the_one_table_form():
    """Embedding(input_dim, output_dim, initializer=...) takes embedcore's
    initializers (drawn by the engine: the values of an ec.Table with the same
    initializer) and TensorFlow's (seeded: TensorFlow's own values)."""
    init = ec.initializers.Uniform(-0.1, 0.1, seed=5)
    layer = Embedding(50, 4, initializer=init, table_name="t")
    layer.build()
    expected = ec.Table(name="t", rows=50, dim=4, initializer=init).values()
    np.testing.assert_array_equal(layer._embedcore_tables()[0].values(), expected)
    tf_init = tf.keras.initializers.RandomUniform(-0.1, 0.1, seed=3)
    layer = Embedding(50, 4, initializer=tf_init, table_name="u")
    layer.build()
    np.testing.assert_array_equal(layer._embedcore_tables()[0].values(), tf_init((50, 4)).numpy())
    table = layer._embedcore_tables()[0]  # reset_values: the initializer's values again (was: zeros)
    table.assign(np.ones((50, 4), np.float32))
    table.reset_values()
    np.testing.assert_array_equal(table.values(), tf_init((50, 4)).numpy())
    # Unseeded (Keras 3 gives it a random seed of its own, which its config drops): drawn by the engine, seeded
    # by the table's name, so a layer rebuilt from its config starts from the same values.
    unseeded = keras.initializers.RandomUniform(-0.05, 0.05)
    layer = Embedding(50, 4, initializer=unseeded, table_name="w")
    layer.build()
    drawn = layer._embedcore_tables()[0].values()
    assert np.abs(drawn).max() <= 0.05 and drawn.std() > 0.01
    rebuilt = Embedding.from_config(layer.get_config())
    rebuilt.build()
    np.testing.assert_array_equal(rebuilt._embedcore_tables()[0].values(), drawn)
    # Seeded with a keras.random.SeedGenerator (was: a TypeError from int(seed)): TensorFlow's own values,
    # as TPUEmbeddingForServing gives them.
    from embedcore.adapters.tf import EmbeddingForServing

    def generated():
        return keras.initializers.RandomNormal(seed=keras.random.SeedGenerator(1))

    theirs = E.TPUEmbeddingForServing({"f": E.FeatureConfig(E.TableConfig(6, 2, name="g", initializer=generated()))},
                                      None)
    theirs.build()
    ours = EmbeddingForServing({"f": E.FeatureConfig(E.TableConfig(6, 2, name="g", initializer=generated()))})
    np.testing.assert_array_equal(ours._embedcore_tables()[0].values(),
                                  next(iter(theirs.embedding_tables.values())).numpy())
    layer = Embedding(6, 2, initializer=keras.initializers.GlorotUniform(seed=keras.random.SeedGenerator(2)))
    layer.build()
    assert layer._embedcore_tables()[0].values().std() > 0


@pytest.mark.parametrize("optimizer", [ec.optimizers.Adagrad(0.5, initial_accumulator_value=0.2, clipvalue=1.0),
                                       E.Adam(0.05), ec.optimizers.RowWiseAdagrad(0.3)],
                         ids=["ec-adagrad", "tf-adam", "ec-rowwise-adagrad"])
@pytest.mark.parametrize("initializer", [None, ec.initializers.Uniform(-0.1, 0.1, seed=5),
                                         keras.initializers.RandomNormal(0.0, 0.3, seed=4),
                                         keras.initializers.RandomUniform(-0.05, 0.05)],
                         ids=["default", "ec-uniform", "keras-normal", "keras-unseeded"])
def test_config_round_trip_keeps_optimizer_and_initializer(rng, optimizer, initializer):
    # from_config(get_config()) / clone_model build a layer with the same table values that trains as the
    # original does (was: no optimizer, so the clone's table silently never trained).
    import json

    layer = Embedding(30, 4, optimizer=optimizer, initializer=initializer, combiner="sum", table_name="items")
    config = json.loads(json.dumps(layer.get_config()))  # as model.save writes it
    clone = Embedding.from_config(config)
    inputs = keras.Input(shape=(3,), dtype="int64")
    model = keras.Model(inputs, layer(inputs))
    cloned = keras.models.clone_model(model)
    clone.build()
    originals = [layer._embedcore_tables()[0], clone._embedcore_tables()[0], cloned.layers[-1]._embedcore_tables()[0]]
    for t in originals[1:]:
        assert repr(t.optimizer) == repr(originals[0].optimizer)
        np.testing.assert_array_equal(t.values(), originals[0].values())
    ids = rng.integers(0, 30, (8, 3))
    dy = rng.standard_normal((8, 3, 4)).astype(np.float32)
    for lay in (layer, clone, cloned.layers[-1]):
        with tf.GradientTape() as tape:
            out = lay(tf.constant(ids), training=True)
            loss = tf.reduce_sum(out * dy)
        tape.gradient(loss, lay.trainable_weights)
    for t in originals[1:]:
        assert t.step == originals[0].step == 1
        np.testing.assert_array_equal(t.values(), originals[0].values())


def test_a_saved_model_loads_without_custom_objects_and_the_layer_copies(tmp_path):
    """The layer is registered with Keras ("embedcore>Embedding"): load_model
    finds it without custom_objects (it raised "Could not locate class
    'Embedding'"), and so does copy.copy, which Keras makes from the config
    (a new table with the same initial values); custom_objects still work."""
    import copy
    import pickle

    layer = Embedding(10, 4, optimizer=ec.optimizers.SGD(0.1), table_name="t")
    ids = keras.Input(shape=(2,), dtype="int64")
    model = keras.Model(ids, keras.layers.Dense(1)(layer(ids)))
    model.save(tmp_path / "m.keras")
    for loaded in (keras.models.load_model(tmp_path / "m.keras"),
                   keras.models.load_model(tmp_path / "m.keras", custom_objects={"Embedding": Embedding})):
        assert type(loaded.layers[1]) is Embedding and loaded.layers[1].get_config()["table_name"] == "t"
    # An EmbeddingForServing's tables are not Keras state: a deep copy or pickle is refused by name (it failed
    # on "cannot pickle '_thread.RLock'"); a shallow copy shares them.
    for refused in (copy.deepcopy, pickle.dumps):
        with pytest.raises(TypeError, match="EmbeddingForServing cannot be pickled or deep-copied"):
            refused(layer.embedding)
    assert copy.copy(layer.embedding)._embedcore_tables()[0] is layer._embedcore_tables()[0]
    twin = copy.copy(layer)
    assert type(twin) is Embedding and twin._embedcore_tables()[0] is not layer._embedcore_tables()[0]
    np.testing.assert_array_equal(twin._embedcore_tables()[0].values(), layer._embedcore_tables()[0].values())
    assert twin(tf.constant([[1, 2]])).shape == (1, 2, 4)


def test_config_of_unserializable_optimizer_or_initializer_is_refused():
    layer = Embedding(10, 4, optimizer=ec.optimizers.SGD(lambda step: 0.1 / (1 + step)), table_name="t")
    with pytest.raises(ValueError, match="schedule"):
        layer.get_config()
    layer = Embedding(10, 4, optimizer=ec.optimizers.SGD(0.1), table_name="t",
                      initializer=lambda shape, dtype=None: tf.zeros(shape, dtype))
    with pytest.raises(ValueError, match="initializer"):
        layer.get_config()
    # A feature_config= layer: refused, not written as a config from_config cannot build (was: saved, then
    # load_model failed with "give input_dim and output_dim, or feature_config=").
    table = E.TableConfig(vocabulary_size=5, dim=2, name="t2")
    layer = Embedding(feature_config={"f": E.FeatureConfig(table)}, name="featured")
    with pytest.raises(ValueError, match="Embedding layer 'featured': a layer made with feature_config= has no "
                                         "Keras config"):
        layer.get_config()
    config = Embedding(10, 4, optimizer=ec.optimizers.SGD(0.1), table_name="t").get_config()
    with pytest.raises(ValueError, match="NoSuchOptimizer"):
        Embedding.from_config({**config, "optimizer": {"class": "NoSuchOptimizer", "learning_rate": 0.1}})


@pytest.mark.parametrize("args,bad", [((2.5, 4), "input_dim must be an int, got 2.5"),
                                      ((10, 4.5), "output_dim must be an int, got 4.5"),
                                      ((True, 4), "input_dim must be an int, got True"),
                                      (("10", 4), "input_dim must be an int, got '10'")])
def test_non_integral_dims_are_refused(args, bad):
    # Was: int() truncated Embedding(2.5, 4) to a table of 2 rows, silently.
    with pytest.raises(TypeError, match=bad):
        Embedding(*args)
    layer = Embedding(np.int64(10), np.int32(4))  # NumPy integers are ints
    layer.build()
    assert (layer._embedcore_tables()[0].rows, layer._embedcore_tables()[0].dim) == (10, 4)
    config = layer.get_config()
    json.dumps(config)  # stored as Python ints
    # A whole float (the config of a layer made with input_dim=vocab / 2) is its int, as before the check.
    again = Embedding.from_config({**config, "input_dim": 10.0, "output_dim": np.float64(4.0)})
    again.build()
    assert (again._embedcore_tables()[0].rows, again._embedcore_tables()[0].dim) == (10, 4)


def _initializers():
    return {"keras-truncated-normal-seeded": keras.initializers.TruncatedNormal(seed=42),
            "keras-uniform-string": keras.initializers.get("uniform"),
            "keras-glorot-uniform": keras.initializers.GlorotUniform(),
            "tf-uniform-seeded": tf.random_uniform_initializer(-0.5, 0.5, seed=1)}


@pytest.mark.parametrize("name", list(_initializers()))
def test_first_build_inside_a_traced_function(rng, name):
    """A layer first built while Keras or tf.function traces (a subclassed
    model under model.fit, a first call inside tf.function) starts from the
    values an eager build gives (was: NotImplementedError, "Cannot convert a
    symbolic tf.Tensor ... to a numpy array", for every initializer that is
    called)."""
    rows, dim = 100, 8
    init = _initializers()[name]
    # One table name throughout: an unseeded uniform is drawn by the engine, seeded by the table's name.
    eager = Embedding(rows, dim, initializer=init, table_name="t")
    eager.build()
    expected = eager._embedcore_tables()[0].values().copy()
    # TensorFlow's own build of a table with this initializer, where TensorFlow's config takes it
    if name.startswith("tf"):
        theirs = E.TPUEmbeddingForServing({"f": E.FeatureConfig(E.TableConfig(rows, dim, initializer=init,
                                                                               name="t"))}, None)
        theirs.build()
        np.testing.assert_array_equal(expected, next(iter(theirs.embedding_tables.values())).numpy())

    # first call inside tf.function: both forms of the layer
    for layer in (Embedding(rows, dim, initializer=init, optimizer=E.SGD(0.1), table_name="t"),
                  Embedding(feature_config={"f": E.FeatureConfig(E.TableConfig(rows, dim, initializer=init,
                                                                               name="t"))}, optimizer=E.SGD(0.1))):
        ids = tf.constant([[1, 2]])
        out = tf.function(lambda x: layer(x if layer._config_args["input_dim"] else {"f": x}))(ids)
        out = out if not isinstance(out, dict) else out["f"]
        np.testing.assert_array_equal(layer._embedcore_tables()[0].values(), expected)
        np.testing.assert_array_equal(np.asarray(out).reshape(-1, dim), expected[[1, 2]])

    # a subclassed model, built by its first model.fit step (traced), trains from the eager build's values
    class Model(keras.Model):
        def __init__(self):
            super().__init__()
            self.emb = Embedding(rows, dim, optimizer=E.SGD(0.1), initializer=init, table_name="t")
            self.head = keras.layers.Dense(1)

        def call(self, ids):
            return self.head(keras.ops.sum(self.emb(ids), axis=1))

    model = Model()
    model.compile(optimizer="adam", loss="mse")
    ids = rng.integers(0, 50, (16, 5))
    model.fit(ids, np.zeros((16, 1), np.float32), batch_size=16, epochs=1, verbose=0)
    table = model.emb._embedcore_tables()[0]
    assert table.step == 1
    untouched = np.setdiff1d(np.arange(rows), ids)
    np.testing.assert_array_equal(table.values()[untouched], expected[untouched])
    assert not np.array_equal(table.values()[ids[0]], expected[ids[0]])


def _empty_batches():
    return [("one empty bag", tf.ragged.constant([[]], tf.int64, ragged_rank=1)),
            ("no rows", tf.RaggedTensor.from_row_splits(tf.zeros([0], tf.int64), [0])),
            ("all-empty sparse", tf.SparseTensor(tf.zeros([0, 2], tf.int64), tf.zeros([0], tf.int64), [4, 3])),
            ("every id pruned", tf.SparseTensor([[0, 0]], tf.constant([-1], tf.int64), [1, 3]))]  # (pooled only)


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "tf.function"])
def test_a_batch_without_ids_is_still_a_step(rng, traced):
    """A training batch that looks up no id of a table (empty bags, no rows,
    every id pruned) is one optimizer step, as in embedcore.Embedding and in
    TPUEmbedding (apply_gradients steps every table): TensorFlow's non-lazy
    Adam moves every row from its moments, and a schedule advances (was: no
    step at all). Compared with the NumPy reference of TPU Adam
    (lazy_adam=False, sum_inside_sqrt, no bias correction) and of SGD with
    the rate of the table's step."""
    adam = E.TableConfig(6, 2, combiner="sum", name="adam", initializer=tf.zeros_initializer())
    sgd = E.TableConfig(6, 2, combiner="sum", name="sgd", initializer=tf.zeros_initializer(),
                        optimizer=ec.optimizers.SGD(lambda step: 1.0 + step))
    layer = Embedding(feature_config={"a": E.FeatureConfig(adam), "s": E.FeatureConfig(sgd, max_sequence_length=2)},
                      optimizer=E.Adam(0.1, lazy_adam=False))
    layer.build()
    tables = {t.name: t for t in layer._embedcore_tables()}
    refs = {"adam": ref.TableRef(np.zeros((6, 2)), ref.OptimizerRef("adam", 0.1, lazy_adam=False)),
            "sgd": ref.TableRef(np.zeros((6, 2)), ref.OptimizerRef("sgd", lambda step: 1.0 + step))}
    for name, t in tables.items():
        v = rng.standard_normal((6, 2)).astype(np.float32)
        t.assign(v)
        refs[name].values[:] = v

    def step(features):
        with tf.GradientTape() as tape:
            out = layer(features)
            loss = tf.add_n([tf.reduce_sum(o) for o in out.values()])
        tape.gradient(loss, layer.trainable_variables)

    step_fn = tf.function(step) if traced else step
    first = tf.ragged.constant([[1]], tf.int64)
    step_fn({"a": first, "s": first})
    for name in refs:  # d loss / d row 1 = 1 (the sum; the sequence's one position)
        refs[name].apply(refs[name].row_grads().add(np.array([1]), np.ones((1, 2))))
    for what, batch in _empty_batches():
        sequence = batch if what != "every id pruned" else _empty_batches()[0][1]  # a sequence does not prune
        (tf.function(step) if traced else step)({"a": batch, "s": sequence})
        for name, r in refs.items():
            r.apply(r.row_grads())  # no row looked up: zero gradient
            t = tables[name]
            assert t.step == r.step, (what, name)
            _assert_table(t, r)
    assert tables["adam"].step == 1 + len(_empty_batches())


def _halving(optimizer):
    """TPUEmbedding's usual learning rate: a schedule of the Keras optimizer's
    iterations (1, 0.5, 0.25, ... at iterations 0, 1, 2, ...)."""
    schedule = keras.optimizers.schedules.ExponentialDecay(1.0, decay_steps=1, decay_rate=0.5)
    return lambda: schedule(optimizer.iterations)


def test_learning_rate_callable_reads_the_iterations_of_its_step(rng):
    """A TensorFlow learning-rate callable is evaluated as TensorFlow ops in
    the training step, before the update and before the Keras optimizer's
    iterations.assign_add, as TPUEmbedding.apply_gradients evaluates it: step
    k uses the rate of iterations k, in a custom tf.function loop and in
    model.fit, traced or eager (was: read inside the update's numpy_function,
    unordered with the increment: iterations 1, 2, 3, ... in a graph)."""
    def expected(steps):  # d loss / d row 1 = 1 in every step; SGD at 0.5**k
        return np.float32(-sum(0.5 ** k for k in range(steps)))

    # a custom tf.function loop
    opt = keras.optimizers.SGD(0.0)
    t = E.TableConfig(4, 1, combiner="sum", initializer=tf.zeros_initializer(), name="t")
    layer = Embedding(feature_config={"f": E.FeatureConfig(t)}, optimizer=E.SGD(learning_rate=_halving(opt)))
    layer.build()

    @tf.function
    def step(ids):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(layer({"f": ids})["f"])
        grads = tape.gradient(loss, layer.trainable_variables)
        opt.apply_gradients(zip(grads, layer.trainable_variables))

    table = layer._embedcore_tables()[0]
    for k in range(1, 4):
        step(tf.constant([1]))
        assert int(opt.iterations.numpy()) == k and table.step == k
        np.testing.assert_allclose(table.values()[1, 0], expected(k), rtol=1e-6)
    # The engine optimizer holding the callable deep-copies as it did: the same callable.
    copied = copy.deepcopy(table.optimizer)
    assert copied.learning_rate(0) == table.optimizer.learning_rate(0) == 0.5 ** 3

    # model.fit, one batch per step
    for run_eagerly in (False, True):
        opt = keras.optimizers.SGD(0.0)
        t = E.TableConfig(10, 2, combiner="sum", initializer=tf.zeros_initializer(), name="t2")
        layer = Embedding(feature_config={"f": E.FeatureConfig(t)}, optimizer=E.SGD(learning_rate=_halving(opt)))
        ids = keras.Input(shape=(1,), dtype="int64", name="f")
        model = keras.Model(ids, keras.layers.Flatten()(layer({"f": ids})["f"]))
        model.compile(opt, loss=lambda y, p: tf.reduce_sum(p), run_eagerly=run_eagerly)
        model.fit(np.ones((4, 1), np.int64), np.zeros((4, 2)), batch_size=1, epochs=1, verbose=0, shuffle=False)
        assert int(opt.iterations.numpy()) == 4
        np.testing.assert_allclose(layer._embedcore_tables()[0].values()[1], [expected(4)] * 2, rtol=1e-6)


def test_learning_rate_variable_assigned_in_the_step():
    """A learning-rate variable assigned at the start of a tf.function step:
    the update uses the value assigned in its step (TensorFlow orders the
    callable's read after the assign), every run alike (was: racy)."""
    expected = np.float32(0.0)
    for i in range(12):
        expected = np.float32(expected - np.float32(0.1) * np.float32(i + 1))
    for _ in range(3):
        lr = tf.Variable(0.0)
        t = E.TableConfig(4, 1, combiner="sum", initializer=tf.zeros_initializer(), name="t")
        layer = Embedding(feature_config={"f": E.FeatureConfig(t)}, optimizer=E.SGD(learning_rate=lambda: lr))
        layer.build()

        @tf.function
        def step(i, ids):
            lr.assign(0.1 * tf.cast(i + 1, tf.float32))
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(layer({"f": ids})["f"])
            tape.gradient(loss, layer.trainable_variables)

        for i in range(12):
            step(tf.constant(i), tf.constant([1]))
        np.testing.assert_allclose(layer._embedcore_tables()[0].values()[1, 0], expected, rtol=1e-6)


def test_learning_rate_callable_that_only_runs_eagerly():
    """A learning-rate callable that needs eager execution (it calls
    .numpy()) cannot be evaluated in the traced step, where TPUEmbedding
    evaluates it too: TypeError naming it and the table, before anything
    changes (was: called inside the update, off by one iteration). Eagerly
    it sees iterations 0, 1, 2, ..."""
    opt = keras.optimizers.SGD(0.0)
    seen = []

    def eager_only():
        seen.append(int(opt.iterations.numpy()))
        return 0.5 ** seen[-1]

    t = E.TableConfig(10, 2, combiner="sum", initializer=tf.zeros_initializer(), name="eager_t")
    layer = Embedding(feature_config={"f": E.FeatureConfig(t)}, optimizer=E.SGD(learning_rate=eager_only))
    ids = keras.Input(shape=(1,), dtype="int64", name="f")
    model = keras.Model(ids, keras.layers.Flatten()(layer({"f": ids})["f"]))
    model.compile(opt, loss=lambda y, p: tf.reduce_sum(p))
    with pytest.raises(TypeError, match=r"the learning rate <function .*eager_only.* of table 'eager_t' cannot be "
                                        r"evaluated inside tf.function"):
        model.fit(np.ones((4, 1), np.int64), np.zeros((4, 2)), batch_size=1, epochs=1, verbose=0, shuffle=False)
    table = layer._embedcore_tables()[0]
    assert table.step == 0 and not table.values().any() and int(opt.iterations.numpy()) == 0
    seen.clear()
    model.compile(opt, loss=lambda y, p: tf.reduce_sum(p), run_eagerly=True)
    model.fit(np.ones((4, 1), np.int64), np.zeros((4, 2)), batch_size=1, epochs=1, verbose=0, shuffle=False)
    assert seen == [0, 1, 2, 3]
    np.testing.assert_allclose(table.values()[1], [-1.875] * 2, rtol=1e-6)


@pytest.mark.parametrize("weighted", [False, True])
def test_functional_model_of_ragged_inputs_pools_them(rng, weighted):
    """keras.Input(ragged=True) ids are bags pooled to [batch, dim], as in
    call: Keras's TF backend traced the layer with dense placeholders, so the
    symbolic output was [batch, None, dim] (a Concatenate with a [batch, dim]
    input failed) and ragged weights were refused while the model was built."""
    rows, dim = 30, 4
    layer = Embedding(rows, dim, optimizer=ec.optimizers.SGD(0.1), combiner="sum")
    ids = keras.Input(shape=(None,), dtype="int64", ragged=True)
    w = keras.Input(shape=(None,), dtype="float32", ragged=True)
    other = keras.Input(shape=(3,))
    pooled = layer(ids, weights=w) if weighted else layer(ids)
    assert tuple(pooled.shape) == (None, dim)
    head = keras.layers.Dense(1)
    model = keras.Model([ids, w, other] if weighted else [ids, other],
                        head(keras.layers.Concatenate()([pooled, other])))
    bags = [[1, 2, 2], [5], [], [29, 0]]
    weights = [[0.5, 1.0, 2.0], [3.0], [], [1.5, -1.0]]
    x_ids = tf.ragged.constant(bags, dtype=tf.int64)
    x_w = tf.ragged.constant(weights, dtype=tf.float32, ragged_rank=1)
    x_other = tf.constant(rng.standard_normal((4, 3)).astype(np.float32))
    got = model([x_ids, x_w, x_other] if weighted else [x_ids, x_other]).numpy()
    values = layer._embedcore_tables()[0].values()
    emb = np.stack([sum(((ws if weighted else [1.0] * len(b))[i] * values[r] for i, r in enumerate(b)),
                        np.zeros(dim, np.float32)) for b, ws in zip(bags, weights)])
    kernel, bias = head.get_weights()
    np.testing.assert_allclose(got, np.concatenate([emb, x_other.numpy()], 1) @ kernel + bias, rtol=1e-5, atol=1e-6)
    model.compile(optimizer="sgd", loss="mse")
    model.fit([x_ids, x_w, x_other] if weighted else [x_ids, x_other], np.zeros((4, 1), np.float32), batch_size=4,
              epochs=1, verbose=0)
    assert layer._embedcore_tables()[0].step == 1


@pytest.mark.parametrize("dtype", ["float32", "float64", "int8", "int16", "uint8", "uint16"])
def test_ids_of_other_dtypes_are_cast_to_int32_as_keras_does(rng, dtype):
    """keras.layers.Embedding casts ids that are not int32 / int64 to int32
    (a keras.Input's default dtype is float32); the one-table form did not
    build a functional model on such an input."""
    values = rng.standard_normal((10, 4)).astype(np.float32)
    ours = Embedding(10, 4, optimizer=ec.optimizers.SGD(0.1), table_name="t")
    ours.build()
    ours.embedding_tables[next(iter(ours.embedding_tables))].assign(values)
    theirs = keras.layers.Embedding(10, 4)
    theirs.build()
    theirs.embeddings.assign(values)
    ids = np.array([[1, 2, 3], [4, 5, 9]]).astype(dtype)
    np.testing.assert_array_equal(ours(tf.constant(ids)).numpy(), theirs(tf.constant(ids)).numpy())
    np.testing.assert_array_equal(ours(ids).numpy(), theirs(ids).numpy())
    # pooled bags too (a ragged batch of float ids; the layer's default combiner, mean)
    ragged = tf.ragged.constant([[1.0, 2.0], [9.0]])
    np.testing.assert_allclose(ours(ragged).numpy(), [(values[1] + values[2]) / 2, values[9]], rtol=1e-6)

    inp = keras.Input(shape=(3,), dtype=dtype)
    model = keras.Model(inp, keras.layers.Dense(1)(keras.layers.Flatten()(ours(inp))))
    model.compile("sgd", "mse")
    before = ours.embedding_tables[next(iter(ours.embedding_tables))].numpy().copy()
    model.fit(ids, np.ones((2, 1), np.float32), verbose=0)
    after = ours.embedding_tables[next(iter(ours.embedding_tables))].numpy()
    assert not np.array_equal(before[[1, 2, 3, 4, 5, 9]], after[[1, 2, 3, 4, 5, 9]])
    np.testing.assert_array_equal(before[[0, 6, 7, 8]], after[[0, 6, 7, 8]])


def test_feature_config_layers_keep_refusing_float_ids():
    """The cast is keras.layers.Embedding's; a feature_config= layer takes
    ids as TPUEmbedding does (int32 / int64 only)."""
    table = E.TableConfig(vocabulary_size=10, dim=4, name="t")
    layer = Embedding(feature_config={"f": E.FeatureConfig(table)}, optimizer=ec.optimizers.SGD(0.1))
    with pytest.raises((TypeError, ValueError, tf.errors.InvalidArgumentError)):
        layer({"f": tf.constant([[1.0, 2.0]])})


def test_bag_gradients_are_the_output_gradient_itself_when_every_row_in_order():
    """The step takes the output gradient's rows of the bags: for dense ids
    (every row, in order) the gradient itself, not a copy (a copy of it cost
    a Keras step on [4096, 20] ids about half its time); else the rows
    gathered."""
    from embedcore.adapters.tf._keras import _bag_gradients

    dy = np.arange(12, dtype=np.float32).reshape(6, 2)
    same = _bag_gradients(dy, np.arange(6, dtype=np.int64))
    assert same is dy
    for rows in ([0, 2, 3, 4, 5], [1, 0, 2, 3, 4, 5], [0, 1, 2, 3, 5, 5], [0, 0, 1, 2, 3, 5], []):
        rows = np.array(rows, np.int64)
        got = _bag_gradients(dy, rows)
        assert not np.shares_memory(got, dy)
        np.testing.assert_array_equal(got, dy[rows])
    assert _bag_gradients(dy[:0], np.zeros(0, np.int64)).shape == (0, 2)


def test_negative_dense_ids_of_the_one_table_form_are_errors():
    """docs/tensorflow.md: Embedding(input_dim, output_dim) refuses an id
    outside [0, input_dim), a negative one too, naming it (Keras 3's take
    reads -1 as the last row; a silent wrap of a bad id is not taken)."""
    layer = Embedding(5, 2)
    layer.build()
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"-1 is not in \[0, 5\)"):
        layer(tf.constant([[-1, 2]]))
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"5 is not in \[0, 5\)"):
        layer(tf.constant([[1, 5]]))


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "tf.function"])
def test_training_gives_the_weights_gradient_of_the_rows_it_read(rng, traced):
    """A training call's per-id weights get TensorFlow's gradient (a
    trainable weighting trains: was None), computed from the rows the
    forward read, before the backward's engine update changes them."""
    table = E.TableConfig(vocabulary_size=40, dim=8, combiner="mean", name="t")
    layer = Embedding(feature_config={"f": E.FeatureConfig(table)}, optimizer=E.SGD(0.5))
    layer.build()
    ids = tf.RaggedTensor.from_row_lengths(rng.integers(0, 40, 12), [3, 0, 5, 4])
    w = tf.Variable(rng.uniform(0.5, 2.0, 12).astype(np.float32))
    dy = tf.constant(rng.standard_normal((4, 8)).astype(np.float32))

    def grads(call):
        with tf.GradientTape() as tape:
            out = call({"f": ids}, {"f": ids.with_values(w * 1.0)})["f"]
            loss = tf.reduce_sum(out * dy)
        return tape.gradient(loss, w)

    def run(call):
        return tf.function(lambda: grads(call))() if traced else grads(call)

    want = run(layer.embedding)  # the serving lookup of the same tables: no update
    before = layer.embedding.embedding_tables[table].numpy().copy()
    got = run(lambda f, w_: layer(f, w_, training=True))
    assert not np.array_equal(layer.embedding.embedding_tables[table].numpy(), before)  # the update ran
    assert np.array_equal(got.numpy(), want.numpy()) and np.abs(want.numpy()).max() > 0


def test_data_weights_in_a_tf_function_called_under_an_outer_tape_train():
    """The custom loop "tape outside, the model's call in a tf.function"
    with per-id weights that are data: TensorFlow's backward of the
    function asks for every float input's gradient; the step trains the
    table and the other variables (an attempt to refuse an untraced
    weights' gradient failed here)."""
    ids = tf.ragged.constant([[1, 2, 3], [4, 5]], dtype=tf.int64)
    w = tf.ragged.constant([[0.5, 1.0, 2.0], [1.0, 3.0]], dtype=tf.float32)
    v = tf.Variable(2.0)
    layer = Embedding(10, 4, optimizer=ec.optimizers.SGD(0.1), combiner="sum", table_name="t")
    forward = tf.function(lambda x, ww: layer(x, weights=ww, training=True))
    with tf.GradientTape() as tape:
        out = forward(ids, w)
        loss = tf.reduce_sum(out * v)
    table = layer._embedcore_tables()[0]
    before = table.to_numpy().copy()
    g = tape.gradient(loss, v)
    np.testing.assert_allclose(g.numpy(), float(tf.reduce_sum(out)), rtol=1e-6)
    assert not np.array_equal(table.to_numpy(), before)  # the backward's update ran


def test_data_weights_get_no_gradient_work(rng, monkeypatch):
    """Weights that no tape watches (a dataset's, the common case) get no
    gradient computation: it would cost a second lookup of every bag each
    training step (2.2x a Keras step of weighted bags)."""
    from embedcore.adapters.tf import _lookup

    calls = []
    real = _lookup.WeightsGradient.gradient
    monkeypatch.setattr(_lookup.WeightsGradient, "gradient",
                        lambda self, dy, w=None: calls.append(1) or real(self, dy, w))
    table = E.TableConfig(vocabulary_size=100, dim=8, combiner="mean", name="t")
    layer = Embedding(feature_config={"f": E.FeatureConfig(table)}, optimizer=E.Adagrad(0.1))
    ids = tf.RaggedTensor.from_row_lengths(rng.integers(0, 100, 40), np.full(4, 10))
    w = ids.with_values(tf.ones(40))

    def step(ids, w):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(layer({"f": ids}, {"f": w}, training=True)["f"])
        return tape.gradient(loss, layer.trainable_variables)

    step(ids, w)
    tf.function(step)(ids, w)
    assert not calls
    v = tf.Variable(tf.ones(40))
    with tf.GradientTape() as tape:  # a watched weighting: its gradient is computed
        loss = tf.reduce_sum(layer({"f": ids}, {"f": ids.with_values(v * 1.0)}, training=True)["f"])
    assert tape.gradient(loss, v) is not None and calls
