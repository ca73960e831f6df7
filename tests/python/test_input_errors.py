"""Input errors named in the caller's terms: a reordered Sparse batch's ids at
their given positions, the feature of an ec.Embedding / served checkpoint,
bfloat16 weights accepted, and edge values (huge ints, weights beyond
float32, max_sequence_length) refused with a message naming them."""
import re

import numpy as np
import pytest

import embedcore as ec
from helpers import assert_unchanged, snapshot


def _table(**kw):
    return ec.Table(name="t", rows=10, dim=2, initializer=ec.initializers.Uniform(-1, 1, seed=3), **kw)


# ------------------------------------------------ Sparse ids not in row-major order
@pytest.mark.parametrize("combiner", ["sum", None])
def test_sparse_unordered_bad_id_named_at_callers_position(combiner):
    t = _table()
    sp = ec.Sparse(indices=[[1, 0], [0, 0], [0, 1]], values=[99, 1, 2], dense_shape=[2, 2])
    with pytest.raises(IndexError, match=re.escape("table 't': id 99 at position 0 of ids is out of range [0, 10)")):
        t.lookup(sp, combiner=combiner)
    sp = ec.Sparse(indices=[[1, 0], [0, 0], [0, 1]], values=[1, 99, 2], dense_shape=[2, 2])
    with pytest.raises(IndexError, match=re.escape("id 99 at position 1 of ids is out of range")):
        t.lookup(sp, combiner=combiner)
    # With gaps (the run-summing sequence path) and past max_sequence_length (dropped but checked).
    sp = ec.Sparse(indices=[[1, 3], [1, 0], [0, 2]], values=[1, 2, 50], dense_shape=[2, 4])
    with pytest.raises(IndexError, match=re.escape("id 50 at position 2 of ids is out of range")):
        t.lookup(sp, combiner=combiner)
    with pytest.raises(IndexError, match=re.escape("id 50 at position 2 of ids is out of range")):
        t.lookup(sp, combiner=None, max_sequence_length=1)


def test_sparse_row_major_bad_id_position_unchanged():
    t = _table()
    sp = ec.Sparse(indices=[[0, 0], [0, 1], [1, 0]], values=[1, 2, 99], dense_shape=[2, 2])
    with pytest.raises(IndexError, match=re.escape("table 't': id 99 at position 2 of ids is out of range [0, 10)")):
        t.lookup(sp)


def test_sparse_unordered_bad_id_in_apply_gradients():
    t = _table(optimizer=ec.optimizers.SGD(0.1))
    before = snapshot(t)
    sp = ec.Sparse(indices=[[1, 0], [0, 0], [0, 1]], values=[99, 1, 2], dense_shape=[2, 2])
    with pytest.raises(IndexError, match=re.escape("id 99 at position 0 of ids is out of range [0, 10)")):
        t.apply_gradients(sp, grads=np.ones((2, 2), np.float32))
    assert_unchanged(t, before)


def test_dense_bad_id_named_at_its_row_and_column():
    t = _table(optimizer=ec.optimizers.SGD(0.1))
    ids = np.array([[1, 2, 3], [4, 99, 5]])
    for combiner in ("sum", None):
        with pytest.raises(IndexError, match=re.escape("table 't': id 99 at index [1, 1] of ids is out of range")):
            t.lookup(ids, combiner=combiner)
    before = snapshot(t)
    with pytest.raises(IndexError, match=re.escape("id 99 at index [1, 1] of ids")):
        t.apply_gradients(ids, grads=np.ones((2, 2), np.float32))
    assert_unchanged(t, before)
    with pytest.raises(IndexError, match=re.escape("features['item']: table 'item': id 50 at index [0, 1] of ids")):
        _embedding()({**_GOOD, "item": np.array([[3, 50]])})


def test_lengths_that_do_not_add_up_to_the_values_are_named():
    with pytest.raises(ValueError, match=re.escape("lengths add up to 1, but values has 2 elements")):
        ec.Ragged.from_lengths([1, 2], [1, 0])
    with pytest.raises(ValueError, match=re.escape("lengths add up to 3, but values has 2 elements")):
        ec.Ragged.from_lengths(np.array([1, 2]), np.array([2, 1], np.int32))
    r = ec.Ragged.from_lengths(np.array([1, 2]), [0, 2, 0])
    np.testing.assert_array_equal(r.offsets, [0, 0, 2, 2])


def test_ragged_weights_split_otherwise_than_the_ids_are_refused():
    """Ragged weights must have the ids' offsets, not only as many values:
    split otherwise, a bag's ids would take weights meant for another bag
    (TensorFlow refuses such weights too: test_tf_serving's "ragged weights
    of another partition"). A lookup, a step (which changes nothing) and an
    ec.Embedding feature (named) are refused."""
    t = _table(optimizer=ec.optimizers.SGD(0.1), combiner="sum")
    ids = ec.Ragged(np.array([0, 1, 2]), np.array([0, 2, 3]))
    w = ec.Ragged(np.array([1.0, 10.0, 100.0], np.float32), np.array([0, 1, 3]))
    with pytest.raises(ValueError, match=re.escape("weights must have the same offsets as ids")):
        t.lookup(ids, weights=w)
    before = snapshot(t)
    with pytest.raises(ValueError, match=re.escape("weights must have the same offsets as ids")):
        t.apply_gradients(ids, grads=np.ones((2, 2), np.float32), weights=w)
    assert_unchanged(t, before)
    emb = ec.Embedding({"f": ec.FeatureConfig(ec.TableConfig("f", rows=5, dim=2, combiner="sum"))})
    with pytest.raises(ValueError, match=re.escape("weights of features['f'] must have the same offsets as "
                                                   "features['f']")):
        emb({"f": ids}, weights={"f": w})
    # The same weights on the ids' offsets are taken.
    np.testing.assert_allclose(t.lookup(ids, weights=ec.Ragged(w.values, ids.offsets)),
                               [t.values()[0] + 10 * t.values()[1], 100 * t.values()[2]], rtol=1e-6)


def test_sparse_unordered_good_batch_unchanged():
    t = _table()
    W = t.to_numpy()
    sp = ec.Sparse(indices=[[1, 0], [0, 1], [0, 0]], values=[4, 5, 6], dense_shape=[2, 2])
    np.testing.assert_allclose(t.lookup(sp, combiner="sum"), np.stack([W[5] + W[6], W[4]]), rtol=1e-6)


# ------------------------------------------------ ec.Embedding / serving: the feature is named
def _embedding():
    item = ec.TableConfig("item", rows=20, dim=2)
    return ec.Embedding({"item": ec.FeatureConfig(item), "hist": ec.FeatureConfig(item, max_sequence_length=3)},
                        ec.optimizers.SGD(0.1))


_GOOD = {"item": np.array([3, 4]), "hist": ec.Ragged(np.array([1, 2, 3]), np.array([0, 2, 3]))}


def _check_feature_errors(lookup):
    with pytest.raises(IndexError, match=re.escape(
            "features['hist']: table 'item': id 50 at position 2 of ids is out of range [0, 20)")):
        lookup({**_GOOD, "hist": ec.Ragged(np.array([1, 2, 50]), np.array([0, 2, 3]))})
    with pytest.raises(IndexError, match=re.escape(
            "features['item']: table 'item': id 50 at position 1 of ids is out of range [0, 20)")):
        lookup({**_GOOD, "item": np.array([3, 50])})
    with pytest.raises(ValueError, match=re.escape("features['hist']: offsets must be non-decreasing")):
        lookup({**_GOOD, "hist": ec.Ragged(np.array([1, 2, 3]), np.array([0, 4, 3]))})
    # A Sparse feature not in row-major order: the feature and the id's given position.
    with pytest.raises(IndexError, match=re.escape(
            "features['hist']: table 'item': id 77 at position 0 of ids is out of range [0, 20)")):
        lookup({**_GOOD, "hist": ec.Sparse([[1, 0], [0, 0], [0, 1]], [77, 2, 3], [2, 3])})


def test_embedding_engine_errors_name_the_feature():
    emb = _embedding()
    _check_feature_errors(emb)
    assert emb(_GOOD)["hist"].shape == (2, 3, 2)


def test_served_checkpoint_engine_errors_name_the_feature(tmp_path):
    emb = _embedding()
    ec.checkpoint.save(str(tmp_path / "ckpt"), emb)
    srv = ec.serving.open(str(tmp_path / "ckpt"))
    _check_feature_errors(srv)
    np.testing.assert_array_equal(srv(_GOOD)["hist"], emb(_GOOD)["hist"])


def test_embedding_huge_max_sequence_length_is_refused_with_its_feature():
    """Refused as the FeatureConfig is made (a save of it was not served);
    it was refused at the first lookup, naming the feature."""
    t = ec.TableConfig("t", rows=5, dim=2)
    with pytest.raises(ValueError, match=re.escape(
            "FeatureConfig 's': max_sequence_length must be < 2**63, got 9223372036854775808")):
        ec.FeatureConfig(t, max_sequence_length=2**63, name="s")


# ------------------------------------------------ bfloat16 weights
_BF16_VALUES = [1.0, -0.375, 3.0e38, 1.5e-30, 0.0, 7.0]  # each exact in bfloat16 after the cast below


def _bf16_reference(t, ids, offs, w32):
    return t.lookup(ids, offs, weights=w32)


def test_numpy_bfloat16_weights_are_exact():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    t = _table(dtype="bfloat16")
    ids, offs = np.array([1, 2, 3, 4, 5, 6]), np.array([0, 2, 6])
    w = np.array(_BF16_VALUES, np.float32).astype(ml_dtypes.bfloat16)
    w32 = w.astype(np.float32)
    np.testing.assert_array_equal(t.lookup(ids, offs, weights=w), _bf16_reference(t, ids, offs, w32))
    np.testing.assert_array_equal(t.lookup(ec.Ragged(ids, offs), weights=ec.Ragged(w, offs)),
                                  _bf16_reference(t, ids, offs, w32))
    # A strided view is converted as well.
    wide = np.repeat(w, 2)[::2]
    np.testing.assert_array_equal(t.lookup(ids, offs, weights=wide), _bf16_reference(t, ids, offs, w32))


def test_torch_bfloat16_weights_are_exact():
    torch = pytest.importorskip("torch")
    t = _table()
    ids, offs = np.array([1, 2, 3, 4, 5, 6]), np.array([0, 2, 6])
    w = torch.tensor(_BF16_VALUES, dtype=torch.float32).to(torch.bfloat16)
    w32 = w.float().numpy()
    np.testing.assert_array_equal(t.lookup(torch.from_numpy(ids), torch.from_numpy(offs), weights=w),
                                  _bf16_reference(t, ids, offs, w32))
    w.requires_grad_(True)
    np.testing.assert_array_equal(t.lookup(ids, offs, weights=w), _bf16_reference(t, ids, offs, w32))


def test_other_void_dtypes_still_refused():
    t = _table()
    with pytest.raises(TypeError, match="weights must be a float array, got dtype"):
        t.lookup(np.array([1, 2]), np.array([0, 2]), weights=np.zeros(2, "V2"))


# ------------------------------------------------ edge values
def test_max_sequence_length_beyond_int64_is_a_value_error():
    t = _table()
    for value in (2**63, np.uint64(2**64 - 1), 2**100):
        with pytest.raises(ValueError, match=re.escape(f"max_sequence_length must be < 2**63, got {int(value)}")):
            t.lookup(np.array([1]), np.array([0, 1]), combiner=None, max_sequence_length=value)


def test_python_ints_beyond_int64_are_named():
    t = _table()
    with pytest.raises(IndexError, match=re.escape("ids: value 1180591620717411303424 at position 0 does not fit "
                                                   "in int64")):
        t.lookup([2**70])
    with pytest.raises(IndexError, match=re.escape(f"ids: value {-2**70} at position 2 does not fit in int64")):
        t.lookup([1, 2, -2**70], [0, 3])
    # Beyond int64 is an id outside the table (IndexError), but malformed offsets, groups, lengths and shapes
    # (ValueError, as the same offset within int64 is).
    with pytest.raises(ValueError, match=re.escape(f"offsets: value {2**70} at position 1 does not fit in int64")):
        t.lookup([1, 2], [0, 2**70])
    big = np.array([0, 2**64 - 1], np.uint64)
    with pytest.raises(ValueError, match=re.escape(f"offsets: value {2**64 - 1} at position 1 does not fit")):
        t.lookup([1, 2], big)
    with pytest.raises(ValueError, match=re.escape(f"lengths: value {2**64 - 1} at position 0 does not fit")):
        ec.Ragged.from_lengths(np.array([1]), np.array([2**64 - 1], np.uint64))
    with pytest.raises(ValueError, match=re.escape(f"ids.dense_shape: value {2**64 - 1} at position 0 does not")):
        t.lookup(ec.Sparse(np.array([[0, 0]]), np.array([1]), np.array([2**64 - 1, 2], np.uint64)))
    with pytest.raises(ValueError, match=re.escape(f"groups: value {2**64 - 1} at position 1 does not fit")):
        t.lookup_grouped([1, 2], [0, 1, 2], big)
    with pytest.raises(IndexError, match=re.escape(f"ids: value {2**64 - 1} at position 1 does not fit")):
        t.lookup(np.array([1, 2**64 - 1], np.uint64))
    with pytest.raises(IndexError, match=re.escape(f"ids.values: value {2**64 - 1} at position 0 does not fit")):
        t.lookup(ec.Ragged(np.array([2**64 - 1], np.uint64), np.array([0, 1])))
    # Other object arrays keep their TypeError.
    with pytest.raises(TypeError, match="got dtype object"):
        t.lookup(np.array([1], dtype=object))
    with pytest.raises(TypeError, match="got dtype object"):
        t.lookup([2**70, "x"])
    # An int in [2**63, 2**64) beside another makes NumPy's array float64: named too (was: a float64 TypeError),
    # and NumPy int64 and uint64 scalars that fit are ids (NumPy made them float64 as well).
    with pytest.raises(IndexError, match=re.escape(f"ids: value {2**63} at position 1 does not fit in int64")):
        t.lookup([1, 2**63])
    with pytest.raises(IndexError, match=re.escape(f"ids: value {2**63} at position 3 does not fit in int64")):
        t.lookup([[1, 2], [3, 2**63]])
    np.testing.assert_array_equal(t.lookup([np.int64(1), np.uint64(3)]), t.lookup(np.array([1, 3])))
    with pytest.raises(TypeError, match="got dtype float64"):  # floats stay refused
        t.lookup([1, 2.0])


def test_tensorflow_tensors_that_are_not_numbers_raise_type_error():
    """A TensorFlow tensor of strings or resources aborted the process in its
    __dlpack__ (a CHECK in TensorFlow); a quantized one let TensorFlow's own
    error out."""
    tf = pytest.importorskip("tensorflow")
    t = _table()
    with pytest.raises(TypeError, match="ids must be an integer array"):
        t.lookup(tf.constant(["1", "2"]))
    with pytest.raises(TypeError, match="weights must be a float array"):
        t.lookup(np.array([1, 2]), weights=tf.constant(["a", "b"]), combiner="sum")
    with pytest.raises(TypeError, match="ids must be an array, got EagerTensor"):
        t.lookup(tf.Variable([1, 2]).handle)
    quantized = tf.quantization.quantize(tf.constant([1.0, 2.0]), 0.0, 3.0, tf.qint8).output
    with pytest.raises(TypeError, match="ids must be an array of numbers, got a TensorFlow tensor of the quantized "
                                        "dtype qint8"):
        t.lookup(quantized)
    np.testing.assert_array_equal(t.lookup(tf.constant([1, 3])), t.lookup(np.array([1, 3])))


@pytest.mark.parametrize("value", [1e39, -1e300])
def test_float64_weights_beyond_float32_are_refused(value):
    t = _table()
    ids, offs = np.array([1, 2, 3]), np.array([0, 3])
    sign = "-" if value < 0 else ""
    with pytest.raises(ValueError, match=re.escape(f"weights: value {value!r} at position 1 is outside the float32 "
                                                   f"range (it would become {sign}inf)")):
        t.lookup(ids, offs, weights=np.array([1.0, value, 2.0]))
    with pytest.raises(ValueError, match=re.escape(f"weights: value {value!r} at index [1, 0] is outside")):
        t.lookup(ids.reshape(3, 1), weights=np.array([[1.0], [value], [2.0]]))


def test_float64_weights_that_round_to_float32_max_are_accepted():
    t = _table()
    big = float(np.finfo(np.float32).max) * (1 + 2.0**-30)  # rounds to FLT_MAX, not to inf
    out = t.lookup(np.array([1]), np.array([0, 1]), weights=np.array([big]), combiner="sum")
    np.testing.assert_array_equal(out, t.lookup(np.array([1]), np.array([0, 1]),
                                                weights=np.array([np.finfo(np.float32).max], np.float32),
                                                combiner="sum"))


def test_max_sequence_length_with_a_pooled_combiner_is_refused():
    t = _table(optimizer=ec.optimizers.SGD(0.1), combiner="mean")
    before = snapshot(t)
    ids, offs = np.array([1, 2, 3]), np.array([0, 3])
    msg = "max_sequence_length applies to sequence lookups (combiner=None), got max_sequence_length=2 with combiner "
    with pytest.raises(ValueError, match=re.escape(msg + "'sum'")):
        t.lookup(ids, offs, combiner="sum", max_sequence_length=2)
    with pytest.raises(ValueError, match=re.escape(msg + "'mean'")):  # the table's default combiner
        t.lookup(ids, offs, max_sequence_length=2)
    with pytest.raises(ValueError, match=re.escape(msg + "'mean'")):
        t.apply_gradients(ids, offs, np.ones((1, 2), np.float32), max_sequence_length=2)
    assert_unchanged(t, before)
    # 0 with a combiner, or a length with combiner=None, are fine.
    assert t.lookup(ids, offs, combiner="sum", max_sequence_length=0).shape == (1, 2)
    assert t.lookup(ids, offs, combiner=None, max_sequence_length=2).shape == (1, 2, 2)


def test_grads_whose_size_overflows_are_refused_through_the_native_call():
    """The size a step's grads must have (rows x dim) is a checked product: a
    sequence step of max_sequence_length 2**62 and dim 4 wants 2**64 values,
    which wrapped to 0, so an empty grads array passed and the engine read
    past it. Refused (ValueError) naming the shape, the table unchanged;
    the lookup of the same shape is refused as before."""
    t = ec.Table(name="t", rows=8, dim=4, initializer=ec.initializers.Constant(0.0),
                 optimizer=ec.optimizers.SGD(learning_rate=1.0))
    before = snapshot(t)
    ids, offsets = np.array([0], np.int64), np.array([0, 1], np.int64)
    with pytest.raises(ValueError, match=re.escape("grads (1 bags, max_sequence_length 4611686018427387904, "
                                                   "dim 4) would not fit in memory: its size overflows")):
        t._native.apply_gradients([(ids, offsets, None, 3, 2**62, np.empty(0, np.float32))], 1.0)
    assert_unchanged(t, before)
    with pytest.raises(ValueError, match="the lookup's output .* overflows"):
        t._native.lookup(ids, offsets, None, 3, 2**62)


def test_read_values_checks_its_rows_before_it_allocates():
    """read_values(start_row, n) past the table is an IndexError naming the
    rows, whatever n: it was allocated first (n = 10**12: MemoryError for
    58 TiB)."""
    t = ec.Table(name="t", rows=8, dim=16)
    for start, n in ((0, 9), (0, 10**12), (7, 2), (9, 0), (1, 2**63 - 1)):
        with pytest.raises(IndexError, match=re.escape(f"table 't': read rows [{start}, ") + ".* do not fit in "
                                             r"\[0, 8\)"):
            t._native.read_values(start, n)
    assert t._native.read_values(8, 0).shape == (0, 16)
    assert t._native.read_values(2, 6).shape == (6, 16)


# ------------------------------------------------ the direct path of NumPy ids and int64 offsets
_I64 = np.int64
_DIRECT_CASES = {  # (ids, offsets, the error or None)
    "good int64": (np.array([1, 2, 3], _I64), np.array([0, 1, 3], _I64), None),
    "good int32": (np.array([1, 2, 3], np.int32), np.array([0, 1, 3], _I64), None),
    "empty": (np.array([], _I64), np.array([0, 0], _I64), None),
    "bad id": (np.array([1, 20, 3], _I64), np.array([0, 1, 3], _I64),
               (IndexError, "table 't': id 20 at position 1 of ids is out of range [0, 10)")),
    "negative id": (np.array([1, -1], np.int32), np.array([0, 2], _I64),
                    (IndexError, "table 't': id -1 at position 1 of ids is out of range [0, 10)")),
    "decreasing": (np.array([1, 2, 3], _I64), np.array([0, 2, 1, 3], _I64),
                   (ValueError, "offsets must be non-decreasing: offsets[1] = 2 > offsets[2] = 1")),
    "not from 0": (np.array([1, 2, 3], _I64), np.array([1, 3], _I64), (ValueError, "offsets[0] must be 0, got 1")),
    "short end": (np.array([1, 2, 3], _I64), np.array([0, 2], _I64),
                  (ValueError, "offsets must end at the number of ids, 3, got offsets[1] = 2")),
    "long end": (np.array([1, 2, 3], _I64), np.array([0, 4], _I64),
                 (ValueError, "offsets must end at the number of ids, 3, got offsets[1] = 4")),
    "empty offsets": (np.array([1], _I64), np.array([], _I64),
                      (ValueError, "offsets must hold batch + 1 values starting at 0, got an empty array")),
    "2-D offsets": (np.array([1], _I64), np.array([[0, 1]], _I64),
                    (ValueError, "offsets must be 1-D, got shape (1, 2)")),
    "float ids": (np.array([1.0]), np.array([0, 1], _I64),
                  (TypeError, "ids must be an integer array (int32 or int64), got dtype float64")),
    "bool ids": (np.array([True]), np.array([0, 1], _I64),
                 (TypeError, "ids must be an integer array (int32 or int64), got dtype bool")),
    "2-D ids": (np.array([[1]], _I64), np.array([0, 1], _I64),
                (ValueError, "ids is 2-D (one bag per row): offsets= does not apply")),
    # Converted by the general path (the engine takes neither): results, as before.
    "uint8 ids": (np.array([1, 2], np.uint8), np.array([0, 2], _I64), None),
    "int32 offsets": (np.array([1, 2], _I64), np.array([0, 2], np.int32), None),
    "strided ids": (np.arange(8, dtype=_I64)[::2], np.array([0, 4], _I64), None),
    "big-endian ids": (np.array([1, 2], ">i8"), np.array([0, 2], _I64), None),
}


@pytest.mark.parametrize("served", [False, True])
@pytest.mark.parametrize("case", sorted(_DIRECT_CASES))
def test_numpy_ids_with_int64_offsets_same_results_and_errors_as_the_general_path(case, served, tmp_path,
                                                                                  monkeypatch):
    """Table.lookup / ServedTable.lookup of NumPy ids with int64 offsets and
    no other argument go straight to the engine: the same results, and the
    same exception and message for bad input, as the general path (which
    combiner= given takes)."""
    t = _table(combiner="sum")
    if served:
        ec.save(str(tmp_path / "ck"), [t])
        t = ec.serving.open(str(tmp_path / "ck")).tables["t"]
    ids, offs, error = _DIRECT_CASES[case]
    if error is None:
        np.testing.assert_array_equal(t.lookup(ids, offs), t.lookup(ids, offs, combiner="sum"))
    else:
        for call in (lambda: t.lookup(ids, offs), lambda: t.lookup(ids, offs, combiner="sum")):
            with pytest.raises(error[0]) as e:
                call()
            assert str(e.value) == error[1]
    if case.startswith("good"):  # the direct path, not make_batch
        monkeypatch.setattr(ec.table, "make_batch", None)
        np.testing.assert_array_equal(t.lookup(ids, offs), t.lookup(ids, offs.copy()))


def test_a_row_range_whose_end_overflows_is_named_without_overflowing():
    """An assignment at start_row 2**63 - 1 names its rows as start + n: the
    end itself would overflow int64 (it was computed anyway: undefined
    behaviour, in practice a negative end in the message)."""
    t = ec.Table(name="t", rows=8, dim=4)
    with pytest.raises(IndexError, match=re.escape("table 't': assigned rows [9223372036854775807, "
                                                   "9223372036854775807 + 1) do not fit in [0, 8)")):
        t._native.assign_values(2**63 - 1, np.zeros((1, 4), np.float32))
