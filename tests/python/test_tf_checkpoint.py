"""TensorFlow checkpoints of TPU embeddings, written by TensorFlow in the
test, restored into the adapter to the values TensorFlow itself restores:
slots of Adagrad / Adam / FTRL, a table sliced over several TPU hosts, and
SparseCore-stacked tables built with TensorFlow's own layout code; plus the
conversion into embedcore's format."""
import json
import os

import numpy as np
import pytest

from tf_helpers import E, pair, tf

import embedcore as ec
from embedcore.adapters.tf import EmbeddingForServing, TFCheckpoint, convert_tf_checkpoint, load_tf_checkpoint

AutoTrackable = tf.__internal__.tracking.AutoTrackable


def _state(emb):
    """{(table, slot): values} of a TPUEmbeddingForServing or the adapter."""
    return {(t, k): np.array(v.numpy()) for t, d in emb.variables.items() for k, v in d.items()}


def _slotted_config():
    ta = E.TableConfig(vocabulary_size=20, dim=4, name="ta", optimizer=E.Adagrad(0.1))
    tb = E.TableConfig(vocabulary_size=15, dim=3, name="tb", optimizer=E.FTRL(0.1))
    tc = E.TableConfig(vocabulary_size=9, dim=5, name="tc", optimizer=E.Adam(0.1))
    return {"a": E.FeatureConfig(ta), "b": E.FeatureConfig(tb), "c": E.FeatureConfig(tc)}


@pytest.fixture
def slotted_checkpoint(tmp_path, rng):
    """A checkpoint of TensorFlow's TPUEmbeddingForServing (Adagrad, FTRL and
    Adam tables, random values and slots), attached at model/embedding."""
    theirs = E.TPUEmbeddingForServing(_slotted_config(), None)
    theirs.build()
    for d in theirs.variables.values():
        for name, v in d.items():
            x = rng.standard_normal(v.shape).astype(np.float32)
            # Accumulators and velocities as training leaves them: > 0 (a load refuses what the optimizer cannot use).
            v.assign(np.abs(x) + np.float32(0.1) if name in ("accumulators", "velocities") else x)
    root = tf.train.Checkpoint(model=tf.Module())
    root.model.embedding = theirs
    path = root.save(str(tmp_path / "tf" / "ckpt"))
    return path, _state(theirs)


def test_slots_restore_like_tensorflow(slotted_checkpoint):
    path, written = slotted_checkpoint
    # What TensorFlow restores, through tf.train.Checkpoint ...
    theirs = E.TPUEmbeddingForServing(_slotted_config(), None)
    root = tf.train.Checkpoint(model=tf.Module())
    root.model.embedding = theirs
    root.restore(path)
    expected = _state(theirs)
    assert {k: v.tobytes() for k, v in expected.items()} == {k: v.tobytes() for k, v in written.items()}
    assert {s for _, s in expected} == {"parameters", "accumulators", "linears", "momenta", "velocities"}

    # ... the adapter restores the same way (the one-import switch) ...
    ours = EmbeddingForServing(_slotted_config(), None)
    root = tf.train.Checkpoint(model=tf.Module())
    root.model.embedding = ours
    root.restore(path).assert_existing_objects_matched()
    assert {k: v.tobytes() for k, v in _state(ours).items()} == {k: v.tobytes() for k, v in expected.items()}

    # ... and with load_tf_checkpoint, which finds the prefix from the table names.
    ours = EmbeddingForServing(_slotted_config(), None)
    assert load_tf_checkpoint(path, ours) == "model/embedding"
    assert {k: v.tobytes() for k, v in _state(ours).items()} == {k: v.tobytes() for k, v in expected.items()}
    ours = EmbeddingForServing(_slotted_config(), None)
    load_tf_checkpoint(path, ours, include_optimizer=False)
    # the initial accumulators, not the checkpoint's
    np.testing.assert_array_equal(ours.variables["ta"]["accumulators"].numpy(), np.float32(0.1))
    np.testing.assert_array_equal(ours.variables["ta"]["parameters"].numpy(), expected[("ta", "parameters")])


def test_adapter_checkpoints_restore_in_tensorflow(slotted_checkpoint, tmp_path):
    path, written = slotted_checkpoint
    ours = EmbeddingForServing(_slotted_config(), None)
    load_tf_checkpoint(path, ours)
    saved = tf.train.Checkpoint(embedding=ours).save(str(tmp_path / "ours" / "ckpt"))
    theirs = E.TPUEmbeddingForServing(_slotted_config(), None)
    tf.train.Checkpoint(embedding=theirs).restore(saved).assert_existing_objects_matched()
    assert {k: v.tobytes() for k, v in _state(theirs).items()} == {k: v.tobytes() for k, v in written.items()}


def test_errors(slotted_checkpoint, tmp_path):
    path, _ = slotted_checkpoint
    wrong = {"a": E.FeatureConfig(E.TableConfig(vocabulary_size=21, dim=4, name="ta"))}
    ours = EmbeddingForServing(wrong)
    before = ours.variables["ta"]["parameters"].numpy().copy()
    with pytest.raises(ValueError, match="ta"):
        load_tf_checkpoint(path, ours)
    np.testing.assert_array_equal(ours.variables["ta"]["parameters"].numpy(), before)  # unchanged
    with pytest.raises(ValueError, match="no object holds"):
        load_tf_checkpoint(path, EmbeddingForServing({"x": E.FeatureConfig(E.TableConfig(5, 2, name="zz"))}))
    with pytest.raises(ValueError, match="no TensorFlow checkpoint"):
        TFCheckpoint(tmp_path)

    def sharded(world):  # ranks hold shards: refused, pointing at convert + the collective load
        emb = ec.Embedding({"a": ec.FeatureConfig(ec.TableConfig("ta", 20, 4))}, world=world, sharding="row_wise")
        with pytest.raises(TypeError, match=r"sharded Embedding .* convert_tf_checkpoint"):
            load_tf_checkpoint(path, emb)

    ec.distributed.run_local(2, sharded)


@pytest.mark.parametrize("table, slot, where, bad, message", [
    ("ta", "accumulators", (19, 3), -0.5, r"slot 'accumulators' of table 'ta' at \[19, 3\] must be >= 1.17549435e-38 .*got -0.5"),
    ("tc", "momenta", (8, 4), np.nan, r"slot 'momenta' of table 'tc' holds nan at \[8, 4\]; a slot must be finite"),
    ("ta", "accumulators", (0, 0), 0.0, r"slot 'accumulators' of table 'ta' at \[0, 0\] must be >= 1.17549435e-38 .*got 0.0")])
def test_slots_outside_the_optimizers_domain_are_refused(tmp_path, rng, table, slot, where, bad, message):
    """A slot the table's optimizer cannot step from (a negative Adagrad
    accumulator, a NaN moment: hand-made, TensorFlow writes none) is refused
    as Table.assign_slot and ec.load refuse it, before any table changes."""
    theirs = E.TPUEmbeddingForServing(_slotted_config(), None)
    theirs.build()
    for t, d in theirs.variables.items():
        for name, v in d.items():
            x = rng.random(v.shape).astype(np.float32) + np.float32(0.1)
            if (t, name) == (table, slot):
                x[where] = bad
            v.assign(x)
    path = tf.train.Checkpoint(embedding=theirs).save(str(tmp_path / "tf" / "ckpt"))
    ours = EmbeddingForServing(_slotted_config(), None)
    before = {k: v.tobytes() for k, v in _state(ours).items()}
    with pytest.raises(ValueError, match=message):
        load_tf_checkpoint(path, ours)
    assert {k: v.tobytes() for k, v in _state(ours).items()} == before
    with pytest.raises(ValueError, match=message):
        convert_tf_checkpoint(path, tmp_path / "converted", feature_config=_slotted_config())
    assert not (tmp_path / "converted").exists()
    convert_tf_checkpoint(path, tmp_path / "values", feature_config=_slotted_config(), include_optimizer=False)
    # An optimizer read from the slots' names (no feature config, no optimizer=) has default hyper-parameters,
    # whose domain is not the slots': a zero accumulator converts (a load checks it against its own table's
    # optimizer), a negative one or a NaN (which no optimizer takes) is refused.
    if bad == 0:
        convert_tf_checkpoint(path, tmp_path / "guessed")
        keras_like = ec.Table(name="ta", rows=20, dim=4, optimizer=ec.optimizers.Adagrad(0.1, epsilon=1e-7))
        ec.load(tmp_path / "guessed", into=keras_like)
        assert keras_like.slots()["accumulators"][where] == 0
    else:
        with pytest.raises(ValueError, match=message if np.isnan(bad) else r"'ta' at \[19, 3\] must be >= 0, got -0.5"):
            convert_tf_checkpoint(path, tmp_path / "guessed")
    # tf.train.Checkpoint's restore into the adapter checks each slot as it writes it.
    with pytest.raises(ValueError, match=f"cannot restore '{table}/{slot}': " + message.split(f"'{table}' ")[1]):
        tf.train.Checkpoint(embedding=EmbeddingForServing(_slotted_config(), None)).restore(path)


def _restores_refused(path, config, message, optimizer=None):
    """Restores `path` into a new EmbeddingForServing through tf.train.Checkpoint
    and through the reader: each raises ValueError matching `message`.
    Returns each way's (state before, state after)."""
    states = []
    for restore in ("checkpoint", "reader"):
        ours = EmbeddingForServing(config, optimizer)
        before = {k: v.tobytes() for k, v in _state(ours).items()}
        with pytest.raises(ValueError, match=message):
            if restore == "checkpoint":
                tf.train.Checkpoint(embedding=ours).restore(path)
            else:
                load_tf_checkpoint(path, ours)
        states.append((before, {k: v.tobytes() for k, v in _state(ours).items()}))
    return states


@pytest.mark.parametrize("array", ["accumulators", "parameters"])
def test_stacked_slots_or_values_that_cannot_be_restored_are_refused(tmp_path, rng, array):
    """A SparseCore-stacked table's accumulator outside the optimizer's
    domain, or its value that is not finite, is refused naming the table and
    the element (in the table's own coordinates), with nothing of that kind
    written, through tf.train.Checkpoint and through the reader."""
    shapes = {"sa": (37, 5), "sb": (100, 8)}
    if array == "accumulators":
        bad = dict(bad_accumulator=("sb", (99, 7), 0.0))
        message = r"slot 'accumulators' of table 'sb' at \[99, 7\] must be >= 1.17549435e-38 .*got 0.0"
    else:
        bad = dict(bad_value=("sb", (99, 7), np.nan))
        message = r"table 'sb':? values\[99, 7\] = nan is not finite"
    path, _, _ = _sparsecore_checkpoint(str(tmp_path / "ckpt"), rng, shapes, **bad)
    config = {n: E.FeatureConfig(E.TableConfig(vocabulary_size=r, dim=d, name=n)) for n, (r, d) in shapes.items()}
    for before, after in _restores_refused(path, config, message, E.Adagrad(0.1)):
        assert {k: v for k, v in after.items() if k[1] == array} == {k: v for k, v in before.items() if k[1] == array}


@pytest.mark.parametrize("offset", [-1, -16])
def test_a_layout_with_a_negative_row_offset_is_refused(tmp_path, rng, offset):
    """A SparseCore layout whose sparse_core_shard_row_offset is negative is
    no row of any shard: refused naming the table and the field, with
    nothing written, through tf.train.Checkpoint and through the reader. It
    restored rows from before the table's (the reader, -1: every row wrong,
    and `embedcore convert` made a checkpoint of them that verified), or
    counted from the variable's end (tf.train.Checkpoint, -16), without an
    error."""
    shapes = {"sa": (37, 5), "sb": (100, 8)}
    path, _, _ = _sparsecore_checkpoint(str(tmp_path / "ckpt"), rng, shapes,
                                        bad_layout=("sa", "sparse_core_shard_row_offset", offset))
    config = {n: E.FeatureConfig(E.TableConfig(vocabulary_size=r, dim=d, name=n)) for n, (r, d) in shapes.items()}
    message = f"table 'sa' has sparse_core_shard_row_offset {offset}: it must be >= 0"
    for before, after in _restores_refused(path, config, message):
        assert after == before


def test_a_stacked_table_of_another_shape_changes_no_table_of_its_stack(tmp_path, rng):
    """Every table of a stacked variable is checked against its model's
    shape before any is written (its finite values were written table by
    table, the check of each just before it: the tables stacked before the
    one of another shape changed)."""
    shapes = {"sa": (37, 5), "sb": (100, 8), "sc": (20, 3)}
    path, _, _ = _sparsecore_checkpoint(str(tmp_path / "ckpt"), rng, shapes)
    here = {**shapes, "sc": (25, 3)}
    config = {n: E.FeatureConfig(E.TableConfig(vocabulary_size=r, dim=d, name=n)) for n, (r, d) in here.items()}
    message = r"table 'sc' is \[?20,? x? ?3\]? in the checkpoint, but \[?25,? x? ?3"
    for before, after in _restores_refused(path, config, message):
        assert after == before


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_values_that_are_not_finite_are_refused(tmp_path, rng, bad):
    """A NaN or an infinity in a table's values (hand-made, or a diverged
    run) is refused as Table.assign and ec.save refuse it, naming the table,
    the row and the column, before any table changes: here the second of
    three tables (was: restored silently; ec.save refused it later)."""
    theirs = E.TPUEmbeddingForServing(_slotted_config(), None)
    theirs.build()
    for t, d in theirs.variables.items():
        for name, v in d.items():
            x = rng.random(v.shape).astype(np.float32) + np.float32(0.1)
            if (t, name) == ("tb", "parameters"):
                x[11, 2] = bad
            v.assign(x)
    path = tf.train.Checkpoint(embedding=theirs).save(str(tmp_path / "tf" / "ckpt"))
    message = rf"table 'tb' values\[11, 2\] = {bad} is not finite"
    for include_optimizer in (True, False):
        ours = EmbeddingForServing(_slotted_config(), None)
        before = {k: v.tobytes() for k, v in _state(ours).items()}
        with pytest.raises(ValueError, match=message):
            load_tf_checkpoint(path, ours, include_optimizer=include_optimizer)
        assert {k: v.tobytes() for k, v in _state(ours).items()} == before
    for kwargs in (dict(feature_config=_slotted_config()), {}, dict(include_optimizer=False)):
        with pytest.raises(ValueError, match=message):
            convert_tf_checkpoint(path, tmp_path / "converted", **kwargs)
        assert not (tmp_path / "converted").exists()
    theirs = tmp_path / "theirs"  # another program's MANIFEST: refused before the checkpoint is read
    theirs.mkdir()
    (theirs / "MANIFEST").write_bytes(b"not ours")
    with pytest.raises(ec.CheckpointError, match="MANIFEST: not an embedcore manifest"):
        convert_tf_checkpoint(str(tmp_path / "missing" / "ckpt"), theirs)
    assert os.listdir(theirs) == ["MANIFEST"] and (theirs / "MANIFEST").read_bytes() == b"not ours"
    # tf.train.Checkpoint's restore into the adapter checks each table's values before it writes them.
    ours = EmbeddingForServing(_slotted_config(), None)
    before = ours.variables["tb"]["parameters"].numpy().tobytes()
    with pytest.raises(ValueError, match=rf"cannot restore 'tb': values\[11, 2\] = {bad} is not finite"):
        tf.train.Checkpoint(embedding=ours).restore(path)
    assert ours.variables["tb"]["parameters"].numpy().tobytes() == before


def test_refused_table_dtype_changes_no_table(slotted_checkpoint):
    # A float16 table among the targets is refused before any table is read (was: the tables before it restored).
    path, _ = slotted_checkpoint
    ta = ec.Table(name="ta", rows=20, dim=4, initializer=ec.initializers.Zeros())
    tb = ec.Table(ec.TableConfig("tb", 15, 3, "float16", ec.initializers.Zeros(), None, "mean"))
    with pytest.raises(NotImplementedError, match="float32"):
        load_tf_checkpoint(path, [ta, tb], include_optimizer=False)
    np.testing.assert_array_equal(ta.values(), 0.0)


def test_table_sliced_over_hosts(tmp_path, rng):
    from tensorflow.python.tpu.tpu_embedding_v2 import TPUEmbeddingVariable

    # TPUEmbedding on 3 hosts saves each table as slices of one variable (rows split 4 / 3 / 3).
    values = rng.standard_normal((10, 3)).astype(np.float32)
    accumulators = rng.random((10, 3)).astype(np.float32)

    def sharded(x, name):
        return TPUEmbeddingVariable([tf.Variable(x[0:4]), tf.Variable(x[4:7]), tf.Variable(x[7:])], name=name)

    written = AutoTrackable()
    written._track_trackable(sharded(values, "big"), name="big")
    written._track_trackable(sharded(accumulators, "big/accumulators"), name="big/accumulators")
    path = tf.train.Checkpoint(embedding=written).save(str(tmp_path / "ckpt"))
    assert tf.train.load_checkpoint(path).get_variable_to_shape_map()["embedding/big/.ATTRIBUTES/VARIABLE_VALUE"] \
        == [10, 3]

    def config():
        return {"f": E.FeatureConfig(E.TableConfig(vocabulary_size=10, dim=3, name="big"))}

    theirs = E.TPUEmbeddingForServing(config(), E.Adagrad(0.1))
    tf.train.Checkpoint(embedding=theirs).restore(path)
    expected = _state(theirs)
    np.testing.assert_array_equal(expected[("big", "parameters")], values)
    for restore in ("checkpoint", "reader"):
        ours = EmbeddingForServing(config(), E.Adagrad(0.1))
        if restore == "checkpoint":
            tf.train.Checkpoint(embedding=ours).restore(path)
        else:
            load_tf_checkpoint(path, ours, prefix="embedding")
        assert {k: v.tobytes() for k, v in _state(ours).items()} == {k: v.tobytes() for k, v in expected.items()}

    # A NaN in a slice (read by RestoreV2, not for its checksum) is refused too, before any table changes.
    values[5, 1] = np.nan
    written = AutoTrackable()
    written._track_trackable(sharded(values, "big"), name="big")
    path = tf.train.Checkpoint(embedding=written).save(str(tmp_path / "nan" / "ckpt"))
    ours = EmbeddingForServing(config(), None)
    before = ours.variables["big"]["parameters"].numpy().tobytes()
    with pytest.raises(ValueError, match=r"table 'big' values\[5, 1\] = nan is not finite"):
        load_tf_checkpoint(path, ours, prefix="embedding")
    assert ours.variables["big"]["parameters"].numpy().tobytes() == before


def _sparsecore_checkpoint(path, rng, shapes, bad_accumulator=None, bad_value=None, bad_layout=None):
    """A checkpoint as TPUEmbeddingV2 (SparseCore) writes it: layouts made by
    TensorFlow's SparseCoreLayoutStacker, tables stacked, rotated and padded
    by TensorFlow's own resharding code, plus accumulators stacked alike.
    `bad_layout`: (table, field, value) written into that table's layout
    after the stacking."""
    from tensorflow.python.tpu import _pywrap_sparse_core_layout as sc_layout
    from tensorflow.python.tpu import tpu_embedding_v3_checkpoint_adapter as adapter

    stacker = sc_layout.SparseCoreLayoutStacker(4, False, 4)  # 4 chips x 4 SparseCores
    for name, (rows, dim) in shapes.items():
        stacker.AddTable(table_name=name, table_height=rows, table_width=dim, group="g", output_samples=16,
                         num_features=1)
    layouts = stacker.GetLayouts()
    ordered = sorted(layouts.tables, key=lambda l: l.sparse_core_shard_row_offset)
    stacked_name = ordered[0].stacked_table_name
    total = ordered[0].total_rows_per_sparse_core_shard * ordered[0].num_sparse_cores
    width = ordered[0].unsharded_padded_shape[1]
    spec = f"{total} {width} 0,{total}:0,{width}"
    values = {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
    accumulators = {n: rng.random(s).astype(np.float32) for n, s in shapes.items()}
    if bad_accumulator is not None:  # (table, index, value)
        accumulators[bad_accumulator[0]][bad_accumulator[1]] = bad_accumulator[2]
    if bad_value is not None:  # (table, index, value)
        values[bad_value[0]][bad_value[1]] = bad_value[2]

    def stack(tables):
        return adapter._shard_from_cpu_to_sc([tf.constant(tables[l.table_name]) for l in ordered], spec, ordered)

    stacked_values, stacked_accumulators = stack(values), stack(accumulators)
    if bad_layout is not None:
        (layout,) = [l for l in layouts.tables if l.table_name == bad_layout[0]]
        setattr(layout, bad_layout[1], bad_layout[2])
    written = AutoTrackable()
    written._track_trackable(tf.Variable(layouts.SerializeToString()), name="_sparse_core_table_layouts")
    written._track_trackable(tf.Variable(stacked_values), name=stacked_name)
    written._track_trackable(tf.Variable(stacked_accumulators), name=stacked_name + "/accumulators")
    saved = tf.train.Checkpoint(embedding=written).save(path)
    assert len({l.stacked_table_name for l in layouts.tables}) == 1
    assert len(shapes) == 1 or any(l.sparse_core_shard_rotation for l in layouts.tables)
    return saved, values, accumulators


@pytest.mark.parametrize("shapes", [
    {"sa": (37, 5), "sb": (100, 8), "sc": (20, 3)},  # rows and widths padded, shards rotated
    {"sa": (50, 4)},  # a table alone in its stack: the stack has the table's name (tf.train.Checkpoint gave the
])                    # padded stacked variable to the table itself: "the checkpoint holds shape [64, 8]")
def test_sparsecore_stacked_tables(tmp_path, rng, shapes):
    path, values, accumulators = _sparsecore_checkpoint(str(tmp_path / "ckpt"), rng, shapes)

    def config():
        return {n: E.FeatureConfig(E.TableConfig(vocabulary_size=r, dim=d, name=n)) for n, (r, d) in shapes.items()}

    # TensorFlow's serving object restores stacked tables when the restore precedes build().
    theirs = E.TPUEmbeddingForServing(config(), None)
    tf.train.Checkpoint(embedding=theirs).restore(path)
    theirs.build()
    expected = {n: np.array(v.numpy()) for n, v in ((c.name, v) for c, v in theirs.embedding_tables.items())}
    for n in shapes:
        np.testing.assert_array_equal(expected[n], values[n])

    for restore in ("checkpoint", "reader"):
        ours = EmbeddingForServing(config(), E.Adagrad(0.1))
        if restore == "checkpoint":
            tf.train.Checkpoint(embedding=ours).restore(path)
        else:
            load_tf_checkpoint(path, ours)
        for n in shapes:
            assert ours.variables[n]["parameters"].numpy().tobytes() == expected[n].tobytes(), (restore, n)
            # and the stacked slots, which TensorFlow's serving object does not restore
            np.testing.assert_array_equal(ours.variables[n]["accumulators"].numpy(), accumulators[n])

    # Lookups after the restore match TensorFlow's.
    ids = tf.ragged.constant([[1, 2, 30], [], [7]], dtype=tf.int64)
    assert np.array_equal(ours({"sa": ids})["sa"].numpy(), theirs({"sa": ids})["sa"].numpy())


def test_convert_to_embedcore(slotted_checkpoint, tmp_path, rng):
    path, written = slotted_checkpoint
    # Without a feature config: every table under the prefix, optimizers read from the slots.
    names = convert_tf_checkpoint(path, tmp_path / "ec", prefix="model/embedding")
    assert sorted(names) == ["ta", "tb", "tc"]
    for name, kind in (("ta", ec.optimizers.Adagrad), ("tb", ec.optimizers.FTRL), ("tc", ec.optimizers.Adam)):
        rows, dim = written[(name, "parameters")].shape
        t = ec.Table(name=name, rows=rows, dim=dim, optimizer=kind())
        ec.load(tmp_path / "ec", into=t)
        np.testing.assert_array_equal(t.values(), written[(name, "parameters")])
        for slot, v in t.slots().items():
            np.testing.assert_array_equal(v, written[(name, slot)])
    # The same through the command line.
    from embedcore.cli import main as cli_main

    assert cli_main(["convert", "--from", "tf", str(path), str(tmp_path / "ec_cli"), "--prefix", "model/embedding"]) == 0
    t = ec.Table(name="ta", rows=written[("ta", "parameters")].shape[0], dim=written[("ta", "parameters")].shape[1],
                 optimizer=ec.optimizers.Adagrad())
    ec.load(tmp_path / "ec_cli", into=t)
    np.testing.assert_array_equal(t.values(), written[("ta", "parameters")])
    # With the model's feature config; a SparseCore checkpoint.
    sc, values, _ = _sparsecore_checkpoint(str(tmp_path / "sc" / "ckpt"), rng, {"u": (33, 4), "v": (50, 8)})
    config = {"u": E.FeatureConfig(E.TableConfig(vocabulary_size=33, dim=4, name="u", combiner="sum")),
              "v": E.FeatureConfig(E.TableConfig(vocabulary_size=50, dim=8, name="v"))}
    assert sorted(convert_tf_checkpoint(sc, tmp_path / "ec2", feature_config=config, include_optimizer=False)) == \
        ["u", "v"]
    served = ec.serving.open(tmp_path / "ec2")
    np.testing.assert_array_equal(served.embedding_tables["u"].values(), values["u"])


def test_convert_refuses_to_drop_optimizer_state(slotted_checkpoint, tmp_path):
    """A table whose checkpoint slots the conversion's optimizer would not keep
    (a feature config without optimizers; optimizer= of another kind):
    ValueError naming them, nothing written; include_optimizer=False takes
    the values."""
    path, written = slotted_checkpoint
    rows, dim = written[("ta", "parameters")].shape
    config = {"a": E.FeatureConfig(E.TableConfig(vocabulary_size=rows, dim=dim, name="ta"))}
    dst = tmp_path / "out"
    with pytest.raises(ValueError, match=r"table 'ta' has optimizer slots \['accumulators'\] in the checkpoint; "
                                         r"its optimizer here \(none\) would drop \['accumulators'\]"):
        convert_tf_checkpoint(path, dst, feature_config=config)
    with pytest.raises(ValueError, match=r"table 'tc' has optimizer slots \['momenta', 'velocities'\].*"
                                         r"\(Adagrad\) would drop"):
        convert_tf_checkpoint(path, dst, prefix="model/embedding", optimizer=ec.optimizers.Adagrad(0.1), tables="tc")
    assert not dst.exists()
    assert convert_tf_checkpoint(path, dst, feature_config=config, include_optimizer=False) == ["ta"]
    np.testing.assert_array_equal(ec.serving.open(dst).tables["ta"].values(), written[("ta", "parameters")])
    # With the optimizer in the feature config, the slots convert.
    config = {"a": E.FeatureConfig(E.TableConfig(vocabulary_size=rows, dim=dim, name="ta", optimizer=E.Adagrad(0.1)))}
    assert convert_tf_checkpoint(path, tmp_path / "with", feature_config=config) == ["ta"]
    t = ec.Table(name="ta", rows=rows, dim=dim, optimizer=ec.optimizers.Adagrad(0.1))
    ec.load(tmp_path / "with", into=t)
    np.testing.assert_array_equal(t.slots()["accumulators"], written[("ta", "accumulators")])


def test_a_restore_takes_all_of_a_table_s_slots_or_none(slotted_checkpoint, tmp_path):
    """Adagrad's accumulators restored into an FTRL table (its linears left
    as they were: the next small step wiped the trained rows), or Adam's
    into Adagrad (its accumulators left): ValueError naming both slot
    lists, as ec.load refuses it, every table unchanged; the values alone
    with include_optimizer=False, and into tables without slots (serving).
    A conversion to an optimizer keeping other slots is refused too."""
    path, written = slotted_checkpoint
    ta = written[("ta", "parameters")]
    for opt, table, stored in ((E.FTRL(0.1), "ta", r"\['accumulators'\]"),
                               (E.Adagrad(0.1), "tc", r"\['momenta', 'velocities'\]")):
        shape = written[(table, "parameters")].shape
        config = {"x": E.FeatureConfig(E.TableConfig(vocabulary_size=shape[0], dim=shape[1], name=table,
                                                     optimizer=opt))}
        ours = EmbeddingForServing(config)
        ours.build()
        before = _state(ours)
        with pytest.raises(ValueError, match=rf"table '{table}' has optimizer slots {stored} in the checkpoint, its "
                                             r"optimizer here \((FTRL|Adagrad)\) keeps .*all of a table's optimizer "
                                             r"state or none of it.*include_optimizer=False"):
            load_tf_checkpoint(path, ours)
        for k, v in _state(ours).items():
            np.testing.assert_array_equal(v, before[k])
        load_tf_checkpoint(path, ours, include_optimizer=False)
        np.testing.assert_array_equal(ours.embedding_tables[config["x"].table].numpy(),
                                      written[(table, "parameters")])
        with pytest.raises(ValueError, match=rf"table '{table}' has optimizer slots {stored}"):
            convert_tf_checkpoint(path, tmp_path / "out", feature_config=config)
        assert not (tmp_path / "out").exists()
    serving = EmbeddingForServing({"a": E.FeatureConfig(E.TableConfig(vocabulary_size=ta.shape[0], dim=ta.shape[1],
                                                                      name="ta"))})
    serving.build()
    load_tf_checkpoint(path, serving)  # no slots here: the values
    np.testing.assert_array_equal(serving.embedding_tables[next(iter(serving.embedding_tables))].numpy(), ta)


def test_async_checkpoint_saves_the_values_at_save(tmp_path):
    """With ``experimental_enable_async_checkpoint``, values (and steps)
    changed after ``save()`` returns do not reach that checkpoint (a
    snapshot is taken at the save, as for TensorFlow's variables), at the
    first save (eager copy) and at later ones (a traced copy)."""
    table = E.TableConfig(vocabulary_size=50_000, dim=16, combiner="sum", name="t", optimizer=E.Adagrad(0.1))
    emb = EmbeddingForServing({"a": E.FeatureConfig(table)})
    handle = emb.embedding_tables[table]
    acc = emb.variables["t"]["accumulators"]
    ckpt = tf.train.Checkpoint(embedding=emb)
    options = tf.train.CheckpointOptions(experimental_enable_async_checkpoint=True)
    paths = []
    for i in range(3):
        handle.assign(np.full([50_000, 16], float(i + 1), np.float32))
        acc.assign(np.full([50_000, 16], float(10 * (i + 1)), np.float32))
        handle.table.step = 100 * (i + 1)
        paths.append(ckpt.save(str(tmp_path / "c"), options=options))
        handle.assign(np.full([50_000, 16], -1.0, np.float32))  # right after save() returned
        acc.assign(np.full([50_000, 16], 0.5, np.float32))
        handle.table.step = 7
    ckpt.sync()
    for i, p in enumerate(paths):
        reader = tf.train.load_checkpoint(p)
        assert np.unique(reader.get_tensor("embedding/t/.ATTRIBUTES/VARIABLE_VALUE")).tolist() == [i + 1]
        assert np.unique(reader.get_tensor("embedding/t.Saccumulators/.ATTRIBUTES/VARIABLE_VALUE")).tolist() == \
            [10 * (i + 1)]
        assert reader.get_tensor("embedding/t/.ATTRIBUTES/step") == 100 * (i + 1)
    # and restores into the engine
    tf.train.Checkpoint(embedding=emb).restore(paths[1]).assert_consumed()
    assert np.unique(handle.numpy()).tolist() == [2] and handle.table.step == 200


def test_convert_tables_named_with_slashes_and_combiner(tmp_path):
    """A table whose name holds "/" (stored as ``user.Sid``) is a table, not
    a slot, and converts with its slots; ``combiner=`` / ``--combiner`` sets
    the combiner written without a feature config (default "mean")."""
    clicks = E.TableConfig(vocabulary_size=10, dim=2, combiner="sum", name="clicks")
    user = E.TableConfig(vocabulary_size=12, dim=3, combiner="sum", name="user/id")
    dotted = E.TableConfig(vocabulary_size=5, dim=2, combiner="sum", name="a.Sb")
    theirs = E.TPUEmbeddingForServing({"c": E.FeatureConfig(clicks), "u": E.FeatureConfig(user),
                                       "d": E.FeatureConfig(dotted)}, E.Adagrad(0.1))
    theirs.build()
    written = {}
    for name, d in theirs.variables.items():
        for slot, v in d.items():
            # (accumulators > 0: the converted Adagrad, epsilon 0, steps from none other)
            written[(name, slot)] = np.arange(np.prod(v.shape), dtype=np.float32).reshape(v.shape) + len(written) + 1
            v.assign(written[(name, slot)])
    path = tf.train.Checkpoint(embedding=theirs).save(str(tmp_path / "tf" / "ckpt"))
    reader = TFCheckpoint(path)
    assert reader.table_names("embedding") == ["a.Sb", "clicks", "user/id"]
    assert reader.slots("embedding", "user/id") == ["accumulators"]

    assert sorted(convert_tf_checkpoint(path, tmp_path / "ec")) == ["a.Sb", "clicks", "user/id"]
    served = ec.serving.open(tmp_path / "ec")
    assert {n: t.config.combiner for n, t in served.tables.items()} == dict.fromkeys(["a.Sb", "clicks", "user/id"],
                                                                                    "mean")
    t = ec.Table(name="user/id", rows=12, dim=3, optimizer=ec.optimizers.Adagrad())
    ec.load(tmp_path / "ec", into=t)
    np.testing.assert_array_equal(t.values(), written[("user/id", "parameters")])
    np.testing.assert_array_equal(t.slots()["accumulators"], written[("user/id", "accumulators")])

    convert_tf_checkpoint(path, tmp_path / "ec_sum", combiner="sum")
    served = ec.serving.open(tmp_path / "ec_sum")
    assert {t.config.combiner for t in served.tables.values()} == {"sum"}
    np.testing.assert_array_equal(served.tables["clicks"].lookup(np.array([1, 2], np.int64), np.array([0, 2], np.int64)),
                                  (written[("clicks", "parameters")][1] + written[("clicks", "parameters")][2])[None])
    with pytest.raises(ValueError, match="combiner"):
        convert_tf_checkpoint(path, tmp_path / "bad", combiner="max")
    with pytest.raises(ValueError, match="feature_config"):
        convert_tf_checkpoint(path, tmp_path / "bad", combiner="sum", feature_config={"c": E.FeatureConfig(clicks)})

    from embedcore.cli import main as cli_main

    assert cli_main(["convert", "--from", "tf", str(path), str(tmp_path / "ec_cli"), "--combiner", "sqrtn"]) == 0
    served = ec.serving.open(tmp_path / "ec_cli")
    assert sorted(served.tables) == ["a.Sb", "clicks", "user/id"]
    assert {t.config.combiner for t in served.tables.values()} == {"sqrtn"}


def test_rowwise_adagrad_slot_is_one_column_through_tf_checkpoints(tmp_path):
    """A RowWiseAdagrad table's [rows, 1] accumulators: a variable of that
    shape, saved by tf.train.Checkpoint and restored by it and by
    load_tf_checkpoint; a [rows, dim] value is refused."""
    cfg = {"a": E.FeatureConfig(E.TableConfig(vocabulary_size=20, dim=4, name="ta",
                                              optimizer=ec.optimizers.RowWiseAdagrad(0.1)))}
    ours = EmbeddingForServing(cfg, None)
    acc = ours.variables["ta"]["row_accumulators"]
    assert acc.shape == [20, 1] and acc.read_value().shape == [20, 1]
    with pytest.raises(ValueError, match=r"shape \[20, 4\].*\[20, 1\]"):
        acc.assign(np.zeros((20, 4), np.float32))
    acc.assign(np.arange(20, dtype=np.float32).reshape(20, 1))
    ours.variables["ta"]["parameters"].assign(np.full((20, 4), 0.5, np.float32))
    path = tf.train.Checkpoint(embedding=ours).save(str(tmp_path / "ckpt"))
    assert dict(tf.train.list_variables(path))["embedding/ta.Srow_accumulators/.ATTRIBUTES/VARIABLE_VALUE"] == [20, 1]
    for restore in ("tf", "load_tf_checkpoint"):
        back = EmbeddingForServing(cfg, None)
        if restore == "tf":
            tf.train.Checkpoint(embedding=back).restore(path).assert_existing_objects_matched()
        else:
            load_tf_checkpoint(path, back)
        assert {k: v.tobytes() for k, v in _state(back).items()} == {k: v.tobytes() for k, v in _state(ours).items()}
    # Converted without a feature config: the slot names the optimizer.
    assert convert_tf_checkpoint(path, str(tmp_path / "ec"), combiner="sum") == ["ta"]
    t = ec.Table(name="ta", rows=20, dim=4, optimizer=ec.optimizers.RowWiseAdagrad(0.1))
    ec.load(str(tmp_path / "ec"), into=t)
    np.testing.assert_array_equal(t.slots()["row_accumulators"][:, 0], np.arange(20, dtype=np.float32))
    np.testing.assert_array_equal(t.to_numpy(), np.full((20, 4), 0.5, np.float32))


def _two_table_config():
    return {"x": E.FeatureConfig(E.TableConfig(vocabulary_size=1000, dim=16, name="a", optimizer=E.Adagrad(0.1))),
            "y": E.FeatureConfig(E.TableConfig(vocabulary_size=1000, dim=16, name="b", optimizer=E.Adagrad(0.1)))}


@pytest.mark.parametrize("damage", ["truncated", "bit_flip"])
def test_damaged_data_file_changes_no_table(tmp_path, rng, damage):
    # A data file that fails to read part-way (a tensor past its end, or a checksum mismatch) is found before any
    # table is written: every table and slot keeps its values (was: the tables read before that tensor restored).
    import glob
    import os

    theirs = E.TPUEmbeddingForServing(_two_table_config(), None)
    theirs.build()
    for d in theirs.variables.values():
        for v in d.values():
            v.assign(rng.standard_normal(v.shape).astype(np.float32))
    path = tf.train.Checkpoint(embedding=theirs).save(str(tmp_path / "tf" / "ckpt"))
    (data,) = glob.glob(path + ".data-*")
    size = os.path.getsize(data)
    with open(data, "r+b") as f:  # 5000 bytes from the end: inside the last 64 KB tensor
        if damage == "truncated":
            f.truncate(size - 5000)
        else:
            f.seek(size - 5000)
            byte = f.read(1)
            f.seek(size - 5000)
            f.write(bytes([byte[0] ^ 0xFF]))
    # The reference: TensorFlow's own reader refuses one table or slot and reads the others.
    reader, failed = tf.train.load_checkpoint(path), []
    for key in reader.get_variable_to_shape_map():
        try:
            reader.get_tensor(key)
        except (tf.errors.OpError, IndexError, ValueError):
            failed.append(key)
    failed = [k for k in failed if k.startswith("embedding/")]  # (a truncation loses the object graph too)
    assert len(failed) == 1, failed
    ours = EmbeddingForServing(_two_table_config())
    ours.build()
    before = _state(ours)
    assert len(before) == 4  # a, b and their accumulators
    with pytest.raises(ValueError, match="cannot read this TensorFlow checkpoint") as info:
        load_tf_checkpoint(path, ours)
    assert data in str(info.value) and failed[0] in str(info.value)
    after = _state(ours)
    for k, v in before.items():
        np.testing.assert_array_equal(after[k], v, err_msg=f"{k} changed")


@pytest.mark.parametrize("kept", [0.25, 0.5, 0.75])
def test_an_adapter_checkpoint_cut_short_is_a_value_error(tmp_path, kept):
    """The adapter's own checkpoint (with its tables' steps) whose data file
    is cut short: TensorFlow's reader raises IndexError ("Read less bytes
    than requested") for the step, which went through as an IndexError (and
    a traceback from `embedcore convert`); it is the documented one-line
    ValueError naming the tensor and the file, and nothing changes."""
    import glob

    emb = EmbeddingForServing(_two_table_config(), tf.tpu.experimental.embedding.Adagrad(0.1))
    emb.build()
    path = tf.train.Checkpoint(embedding=emb).save(str(tmp_path / "tf" / "ckpt"))
    (data,) = glob.glob(path + ".data-*")
    with open(data, "r+b") as f:
        f.truncate(int(os.path.getsize(data) * kept))
    before = _state(emb)
    with pytest.raises(ValueError, match="cannot read this TensorFlow checkpoint") as info:
        load_tf_checkpoint(path, emb)
    assert data in str(info.value)
    after = _state(emb)
    for k, v in before.items():
        np.testing.assert_array_equal(after[k], v, err_msg=f"{k} changed")
    with pytest.raises(ValueError, match="cannot read this TensorFlow checkpoint"):
        convert_tf_checkpoint(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_include_optimizer_must_be_a_bool(slotted_checkpoint, tmp_path):
    """As ec.save / ec.load: include_optimizer="False" was true (the slots
    restored, or a conversion told to pass include_optimizer=False); a 0-d
    bool tensor is a bool."""
    path, _ = slotted_checkpoint
    with pytest.raises(TypeError, match="convert_tf_checkpoint: include_optimizer must be a bool, got 'False'"):
        convert_tf_checkpoint(path, tmp_path / "out", prefix="model/embedding", include_optimizer="False")
    assert not (tmp_path / "out").exists()
    names = convert_tf_checkpoint(path, tmp_path / "out", prefix="model/embedding",
                                  include_optimizer=tf.constant(False))
    served = ec.serving.open(tmp_path / "out")
    tables = [ec.Table(name=n, rows=served.tables[n].rows, dim=served.tables[n].dim,
                       optimizer=ec.optimizers.Adagrad(0.1)) for n in names]
    with pytest.raises(TypeError, match="load_tf_checkpoint: include_optimizer must be a bool, got 'False'"):
        load_tf_checkpoint(path, tables, prefix="model/embedding", include_optimizer="False")
    assert all(t.step == 0 for t in tables)


def test_convert_tables_names(slotted_checkpoint, tmp_path):
    path, written = slotted_checkpoint
    # A str is one table name, not its characters.
    assert convert_tf_checkpoint(path, tmp_path / "one", prefix="model/embedding", tables="ta") == ["ta"]
    np.testing.assert_array_equal(ec.checkpoint.read_info(str(tmp_path / "one")).table_names, ["ta"])
    assert convert_tf_checkpoint(path, tmp_path / "one_fc", feature_config=_slotted_config(), tables="tb") == ["tb"]
    # A name the checkpoint / feature config does not hold is a ValueError naming it, with or without a config.
    with pytest.raises(ValueError, match="typo"):
        convert_tf_checkpoint(path, tmp_path / "bad1", prefix="model/embedding", tables=["ta", "typo"])
    with pytest.raises(ValueError, match="typo"):
        convert_tf_checkpoint(path, tmp_path / "bad2", feature_config=_slotted_config(), tables=["ta", "typo"])
    with pytest.raises(ValueError, match="typo"):
        convert_tf_checkpoint(path, tmp_path / "bad3", feature_config=_slotted_config(), tables=["typo"])
    with pytest.raises(TypeError, match="tables="):
        convert_tf_checkpoint(path, tmp_path / "bad4", feature_config=_slotted_config(), tables=[3])
    # Without prefix= or a config: only the missing name is named (was: every name given).
    with pytest.raises(ValueError, match=r"no object holds the table\(s\) \['typo'\];"):
        convert_tf_checkpoint(path, tmp_path / "bad5", tables=["ta", "typo"])
    for bad in ("bad1", "bad2", "bad3", "bad4", "bad5"):
        assert not (tmp_path / bad).exists()


def _train_steps(layer, batches):
    """One engine step per batch (the gradient of sum(outputs ** 2))."""
    for ids in batches:
        with tf.GradientTape() as tape:
            y = layer(tf.constant(ids), training=True)
            loss = tf.reduce_sum(y * y)
        tape.gradient(loss, layer.trainable_variables)


def _engine_state(layer):
    t = layer._embedcore_tables()[0]
    return t.to_numpy().tobytes(), {k: v.tobytes() for k, v in t.slots().items()}, t.step


@pytest.mark.parametrize("make_optimizer", [
    lambda: ec.optimizers.SGD(lambda step: 0.1 / (1 + step)),  # a schedule: the step is its position
    lambda: ec.optimizers.Adam(0.05, bias_correction=True),
    lambda: ec.optimizers.Adagrad(0.1),
    lambda: ec.optimizers.FTRL(0.1),
], ids=["sgd-schedule", "adam-bias-correction", "adagrad", "ftrl"])
def test_keras_layer_resumes_from_tf_checkpoint(tmp_path, rng, make_optimizer):
    """tf.train.Checkpoint of the Keras layer saves each table's optimizer
    step beside its values and slots: a layer rebuilt and restored from it
    trains on bit for bit as the uninterrupted one (values, slots, step),
    where a step restored as 0 restarted the schedule and Adam's bias
    correction. load_tf_checkpoint and convert_tf_checkpoint read the step
    too (with the optimizer state)."""
    from embedcore.adapters.tf import Embedding

    def make():
        layer = Embedding(40, 4, table_name="items", optimizer=make_optimizer(), combiner="sum")
        layer(tf.zeros([1, 3], tf.int64))
        return layer

    batches = [rng.integers(0, 40, (5, 3)) for _ in range(5)]
    a = make()
    _train_steps(a, batches[:3])
    path = tf.train.Checkpoint(layer=a).save(str(tmp_path / "ckpt"))
    assert dict(tf.train.list_variables(path))["layer/embedding/items/.ATTRIBUTES/step"] == []
    assert tf.train.load_checkpoint(path).get_tensor("layer/embedding/items/.ATTRIBUTES/step") == 3

    b = make()
    tf.train.Checkpoint(layer=b).restore(path).assert_consumed()
    assert _engine_state(b) == _engine_state(a) and b._embedcore_tables()[0].step == 3
    _train_steps(a, batches[3:])  # the uninterrupted run
    _train_steps(b, batches[3:])  # the resumed one
    assert _engine_state(b) == _engine_state(a) and a._embedcore_tables()[0].step == 5

    # The bounded-memory reader and the conversion take the step with the optimizer state.
    c = make()
    load_tf_checkpoint(path, c)
    assert c._embedcore_tables()[0].step == 3
    d = make()
    d._embedcore_tables()[0].step = 7
    load_tf_checkpoint(path, d, include_optimizer=False)  # values only: slots and step stay
    assert d._embedcore_tables()[0].step == 7
    assert convert_tf_checkpoint(path, tmp_path / "ec", prefix="layer/embedding", optimizer=make_optimizer(),
                                 combiner="sum") == ["items"]
    e = make()
    ec.load(tmp_path / "ec", into=e)
    assert e._embedcore_tables()[0].step == 3


def test_checkpoint_without_step_restores_and_keeps_the_step(tmp_path, monkeypatch):
    """A checkpoint written before the adapter saved the step (a table's
    values alone under its name, as TensorFlow's TPU embeddings write
    them) restores the values and slots, leaves the step as it is, and
    passes assert_consumed / assert_existing_objects_matched; its tables
    restore into TensorFlow's TPUEmbeddingForServing, and the adapter's
    checkpoints with the step do too."""
    from embedcore.adapters.tf import _checkpoint

    cfg = _slotted_config()
    ours = EmbeddingForServing(cfg, None)
    for d in ours.variables.values():
        for name, v in d.items():
            v.assign(np.full(v.shape, 0.5 if name != "parameters" else -1.5, np.float32))
    for t in ours._embedcore_tables():
        t.step = 4
    with monkeypatch.context() as m:  # the adapter's checkpoints before the step
        m.setattr(_checkpoint, "TableVariable", _checkpoint.EngineVariable)
        old = tf.train.Checkpoint(embedding=EmbeddingForServing(cfg, None))
        old.embedding._maybe_build()
        for t, src in zip(old.embedding._embedcore_tables(), ours._embedcore_tables()):
            t._native.values_mut()[...] = src.to_numpy()
            for k, v in src.slots().items():
                dict(t._native.slots_mut())[k][...] = v
        old_path = old.save(str(tmp_path / "old" / "ckpt"))
    assert not any(k.endswith("/step") for k, _ in tf.train.list_variables(old_path))
    for check in ("assert_consumed", "assert_existing_objects_matched"):
        back = EmbeddingForServing(cfg, None)
        for t in back._embedcore_tables():
            t.step = 9
        getattr(tf.train.Checkpoint(embedding=back).restore(old_path), check)()
        assert {k: v.tobytes() for k, v in _state(back).items()} == {k: v.tobytes() for k, v in _state(ours).items()}
        assert [t.step for t in back._embedcore_tables()] == [9, 9, 9]
    back = EmbeddingForServing(cfg, None)
    load_tf_checkpoint(old_path, back)
    assert [t.step for t in back._embedcore_tables()] == [0, 0, 0]

    new_path = tf.train.Checkpoint(embedding=ours).save(str(tmp_path / "new" / "ckpt"))
    theirs = E.TPUEmbeddingForServing(cfg, None)
    theirs.build()
    tf.train.Checkpoint(embedding=theirs).restore(new_path).assert_consumed()  # the step attribute is skipped
    assert {k: v.tobytes() for k, v in _state(theirs).items()} == {k: v.tobytes() for k, v in _state(ours).items()}


def test_a_save_inside_a_tf_function_writes_the_step_when_it_runs(tmp_path):
    """A tf.train.Checkpoint write traced into a tf.function saved the step
    of the trace (a constant) at every later call, while the values were
    the table's then: a restore silently set the step back."""
    cfg = {"a": E.FeatureConfig(E.TableConfig(vocabulary_size=4, dim=2, name="t"))}
    emb = EmbeddingForServing(cfg, E.Adagrad(0.1))
    emb.build()
    table = emb._embedcore_tables()[0]
    counter = tf.Variable(0)
    ckpt = tf.train.Checkpoint(embedding=emb, counter=counter)

    @tf.function
    def write(path):
        return ckpt.write(path)

    write(tf.constant(str(tmp_path / "first")))  # traced with the step at 0
    table.assign(np.ones((4, 2), np.float32))
    table.step = 5
    counter.assign(5)
    write(tf.constant(str(tmp_path / "second")))
    reader = tf.train.load_checkpoint(str(tmp_path / "second"))
    assert reader.get_tensor("embedding/t/.ATTRIBUTES/step") == 5
    assert reader.get_tensor("counter/.ATTRIBUTES/VARIABLE_VALUE") == 5
    np.testing.assert_array_equal(reader.get_tensor("embedding/t/.ATTRIBUTES/VARIABLE_VALUE"), np.ones((4, 2)))
    assert tf.train.load_checkpoint(str(tmp_path / "first")).get_tensor("embedding/t/.ATTRIBUTES/step") == 0
    back = EmbeddingForServing(cfg, E.Adagrad(0.1))
    tf.train.Checkpoint(embedding=back).restore(str(tmp_path / "second")).expect_partial()
    assert back._embedcore_tables()[0].step == 5


def test_a_bad_step_in_a_checkpoint_is_refused(tmp_path, monkeypatch):
    from embedcore.adapters.tf import _checkpoint

    cfg = {"a": E.FeatureConfig(E.TableConfig(vocabulary_size=5, dim=2, name="ta", optimizer=E.Adam(0.1)))}
    with monkeypatch.context() as m:
        m.setattr(_checkpoint.TableVariable, "_read", lambda self, key: tf.constant(
            -1 if key == "step" else np.zeros((5, 2), np.float32), tf.int64 if key == "step" else tf.float32))
        path = tf.train.Checkpoint(embedding=EmbeddingForServing(cfg, None)).save(str(tmp_path / "ckpt"))
    with pytest.raises(ValueError, match="ta.*step"):
        tf.train.Checkpoint(embedding=EmbeddingForServing(cfg, None)).restore(path)
    back = EmbeddingForServing(cfg, None)
    with pytest.raises(ValueError, match=r"step.*-1"):
        load_tf_checkpoint(path, back)
    assert back._embedcore_tables()[0].step == 0


def test_a_table_named_as_another_table_s_slot_is_refused():
    """Tables "q" and "q/accumulators": the adapter's checkpoints key q's
    Adagrad slot and the other table's values "q/accumulators", so one was
    lost while save, restore and assert_consumed passed. Refused when the
    layer is built, naming both; "q/extra" (no slot's name) is a table."""
    q = E.TableConfig(vocabulary_size=5, dim=2, name="q")
    for other, refused in (("q/accumulators", True), ("q/linears", True), ("q/extra", False), ("r/momenta", False)):
        config = {"a": E.FeatureConfig(q), "b": E.FeatureConfig(E.TableConfig(vocabulary_size=4, dim=2, name=other))}
        if refused:
            with pytest.raises(ValueError, match=rf"table '{other}' is named as table 'q''s .* slot.*rename one"):
                EmbeddingForServing(config, E.Adagrad(0.1)).build()
        else:
            EmbeddingForServing(config, E.Adagrad(0.1)).build()


def test_checkpoints_of_the_layer_record_its_features(tmp_path):
    """embedcore checkpoints of the Keras layer, of EmbeddingForServing and
    of convert_tf_checkpoint with the feature config record the features
    (names, tables, sequence lengths, their nest), as an embedcore.Embedding's
    do: embedcore.serving serves them by feature, giving the layer's outputs
    (was: tables only, and the sequence length lost)."""
    from embedcore.adapters.tf import Embedding

    def config():
        t = E.TableConfig(vocabulary_size=80, dim=6, combiner="sum", name="item", optimizer=E.Adagrad(0.1))
        u = E.TableConfig(vocabulary_size=30, dim=3, combiner="sqrtn", name="user", optimizer=E.Adagrad(0.1))
        return {"item": E.FeatureConfig(t, name="item"), "hist": E.FeatureConfig(t, max_sequence_length=4),
                "ctx": {"user": E.FeatureConfig(u, name="user")}}

    layer = Embedding(feature_config=config(), optimizer=E.Adagrad(0.1))
    batch = {"item": tf.ragged.constant([[1], [2, 3]], dtype=tf.int64),
             "hist": tf.ragged.constant([[4, 5], [6, 7, 8, 9, 10]], dtype=tf.int64),
             "ctx": {"user": tf.ragged.constant([[0, 29], []], dtype=tf.int64)}}
    want = tf.nest.map_structure(lambda t: t.numpy(), layer(batch))
    serving = EmbeddingForServing(config())
    serving.build()
    ec.save(tmp_path / "layer", layer)
    ckpt = tf.train.Checkpoint(embedding=layer).save(str(tmp_path / "tf" / "ck"))
    convert_tf_checkpoint(ckpt, tmp_path / "converted", feature_config=config())
    ec.save(tmp_path / "serving", serving)
    ragged = tf.nest.map_structure(lambda t: ec.Ragged(t.values.numpy(), t.row_splits.numpy()), batch)
    for name in ("layer", "converted"):
        served = ec.serving.open(tmp_path / name)
        assert [(f.name, f.table.name, f.max_sequence_length) for f in served.feature_config["ctx"].values()] == \
            [("user", "user", 0)]
        got = served(ragged)
        assert sorted(got) == ["ctx", "hist", "item"] and got["hist"].shape == (2, 4, 6), name
        for path in (("item",), ("hist",), ("ctx", "user")):
            g, w = got, want
            for k in path:
                g, w = g[k], w[k]
            np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7, err_msg=f"{name} {path}")
    assert [f["name"] for f in json.loads(ec.checkpoint.read_info(tmp_path / "serving").manifest_json)
            ["metadata"]["features"]] == ["user", "hist", "item"]


def test_features_sharing_a_name_are_recorded_by_their_paths(tmp_path, rng):
    """TensorFlow's FeatureConfig names need not be unique: an
    EmbeddingForServing whose two features share one is saved with each
    feature named by its path (docs/tensorflow.md), so that the name-keyed
    consumers (the C API's feature lookups, the PyTorch served collections)
    tell them apart, and the checkpoint serves TensorFlow's outputs."""
    t = E.TableConfig(vocabulary_size=12, dim=3, combiner="sum", name="t")
    config = {"a": E.FeatureConfig(t, name="x"), "b": E.FeatureConfig(t, name="x"), "c": E.FeatureConfig(t, name="y")}
    theirs, ours = pair(config, rng)
    ec.save(tmp_path / "ck", ours)
    assert [f["name"] for f in json.loads(ec.checkpoint.read_info(tmp_path / "ck").manifest_json)
            ["metadata"]["features"]] == ["a", "b", "c"]
    served = ec.serving.open(tmp_path / "ck")
    assert {k: f.name for k, f in served.feature_config.items()} == {"a": "a", "b": "b", "c": "c"}
    batch = {k: tf.ragged.constant(v, dtype=tf.int64) for k, v in
             {"a": [[1, 2], [3]], "b": [[4], [5, 6, 7]], "c": [[8], []]}.items()}
    want = theirs(batch)
    got = served({k: ec.Ragged(v.values.numpy(), v.row_splits.numpy()) for k, v in batch.items()})
    for k in batch:
        np.testing.assert_array_equal(got[k], want[k].numpy(), err_msg=k)


def test_checkpoints_of_the_layer_record_no_feature_they_would_serve_otherwise(tmp_path):
    """The Embedding(input_dim, output_dim) form gathers dense ids (as
    keras.layers.Embedding), which no served feature does: its checkpoint
    records the table alone. A feature name with a NUL character (a C
    string's end: the C API could not name it) is refused before anything
    is written."""
    from embedcore.adapters.tf import Embedding

    layer = Embedding(10, 4)
    layer.build()
    ec.save(tmp_path / "plain", layer)
    assert json.loads(ec.checkpoint.read_info(tmp_path / "plain").manifest_json)["metadata"] == {"kind": "table"}
    bad = EmbeddingForServing({"x\0y": E.FeatureConfig(E.TableConfig(vocabulary_size=5, dim=2, name="t"))})
    bad.build()
    with pytest.raises(ValueError, match=r"save: feature 'x\\x00y': name has a NUL character"):
        ec.save(tmp_path / "bad", bad)
    assert not (tmp_path / "bad").exists()


def test_a_layer_nested_too_deeply_to_record_saves_its_tables(tmp_path):
    """A feature config nested past what the manifest records (over 11 levels):
    the layer's checkpoint holds its tables alone, as before features were
    recorded (an embedcore.Embedding's save refuses it instead)."""
    config = E.FeatureConfig(E.TableConfig(vocabulary_size=5, dim=2, name="t"))
    for level in range(13):
        config = {f"l{level}": config}
    serving = EmbeddingForServing(config)
    serving.build()
    ec.save(tmp_path / "deep", serving)
    assert json.loads(ec.checkpoint.read_info(tmp_path / "deep").manifest_json)["metadata"] == {"kind": "table"}
    assert ec.serving.open(tmp_path / "deep").tables["t"].rows == 5


def test_served_sparse_features_equal_tensorflow_s_once_pruned(tmp_path, rng):
    """docs/tensorflow.md: the checkpoint serves sparse input with the
    layer's (and TensorFlow's) outputs where nothing is pruned, and input
    TensorFlow prunes (ids < 0; weights <= 0 under mean) once pruned as the
    doc says; unpruned, a negative id is the served lookup's IndexError."""
    t = E.TableConfig(vocabulary_size=12, dim=3, combiner="mean", name="t")
    config = {"f": E.FeatureConfig(t)}
    theirs, ours = pair(config, rng)
    ec.save(tmp_path / "ck", ours)
    served = ec.serving.open(tmp_path / "ck")
    sp = tf.sparse.SparseTensor([[0, 0], [0, 1], [1, 0], [1, 1], [1, 2]], tf.constant([1, -1, 4, 5, 6], tf.int64),
                                [3, 3])
    w = tf.sparse.SparseTensor(sp.indices, tf.constant([1.0, 2.0, -0.5, 2.0, 3.0]), sp.dense_shape)
    want = theirs({"f": sp}, weights={"f": w})["f"].numpy()
    np.testing.assert_array_equal(ours({"f": sp}, weights={"f": w})["f"].numpy(), want)
    with pytest.raises(IndexError, match="-1"):
        served({"f": ec.Sparse(sp.indices.numpy(), sp.values.numpy(), sp.dense_shape.numpy())},
               weights={"f": ec.Sparse(w.indices.numpy(), w.values.numpy(), w.dense_shape.numpy())})
    keep = tf.logical_and(sp.values >= 0, w.values > 0)
    sp2, w2 = tf.sparse.retain(sp, keep), tf.sparse.retain(w, keep)
    got = served({"f": ec.Sparse(sp2.indices.numpy(), sp2.values.numpy(), sp2.dense_shape.numpy())},
                 weights={"f": ec.Sparse(w2.indices.numpy(), w2.values.numpy(), w2.dense_shape.numpy())})["f"]
    np.testing.assert_array_equal(got, want)


def test_corrupt_sparse_core_layouts_are_a_value_error_naming_the_key(tmp_path):
    """SparseCore layouts that are not a SparseCoreTableLayouts proto (a
    corrupt or foreign checkpoint) are reported in one line, as a ValueError
    naming the checkpoint and the key (protobuf's DecodeError escaped as a
    traceback); nothing is written."""
    emb = tf.Module()
    emb.t = tf.Variable(tf.ones([4, 3]))
    emb._sparse_core_table_layouts = tf.Variable(b"\xff\xff\xff garbage, not a proto")
    path = tf.train.Checkpoint(embedding=emb).write(str(tmp_path / "ckpt"))
    with pytest.raises(ValueError, match=r"cannot read this TensorFlow checkpoint: the SparseCore table layouts "
                                         r"embedding/_sparse_core_table_layouts.* DecodeError"):
        convert_tf_checkpoint(path, tmp_path / "dst")
    assert not (tmp_path / "dst").exists()
