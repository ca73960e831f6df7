"""Lookups against the NumPy reference: every combiner, input form, id and
storage dtype, and the sequence (combiner=None) outputs."""
import numpy as np
import pytest

import embedcore as ec
import reference as ref
from helpers import COMBINERS, DTYPES, assert_pooled, make_table, random_bags

DIMS = (1, 3, 7, 8, 13, 128, 129)
RTOL = {"sum": 1e-6, "mean": 1e-5, "sqrtn": 1e-5}


def _check_pooled(table, out, ids, offsets, weights, combiner):
    expected, bound = ref.pooled(table.to_numpy(), ids, offsets, weights, combiner)
    assert_pooled(out, expected, bound, RTOL[combiner])


# ----------------------------------------------------------------- pooled, CSR


@pytest.mark.parametrize("dim", DIMS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("id_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("combiner", COMBINERS)
def test_pooled_csr(rng, combiner, weighted, id_dtype, dtype, dim):
    rows = int(rng.integers(20, 300))
    table = make_table(rows, dim, dtype, seed=int(rng.integers(1 << 30)))
    batch = int(rng.integers(1, 40))
    ids, offsets, weights = random_bags(rng, rows, batch, id_dtype=id_dtype, weighted=weighted)
    out = table.lookup(ids, offsets, weights, combiner=combiner)
    assert out.dtype == np.float32 and out.shape == (batch, dim) and out.flags.c_contiguous
    _check_pooled(table, out, ids, offsets, weights, combiner)


@pytest.mark.parametrize("combiner", COMBINERS)
def test_default_combiner_is_the_tables(rng, combiner):
    table = make_table(50, 5, combiner=combiner)
    ids, offsets, weights = random_bags(rng, 50, 12, weighted=True)
    _check_pooled(table, table.lookup(ids, offsets, weights), ids, offsets, weights, combiner)
    # __call__ is lookup
    np.testing.assert_array_equal(table(ids, offsets, weights), table.lookup(ids, offsets, weights))


def test_table_default_combiner_is_mean(rng):
    table = ec.Table(name="t", rows=30, dim=4)
    assert table.combiner == "mean"
    ids, offsets, weights = random_bags(rng, 30, 9, weighted=True)
    _check_pooled(table, table.lookup(ids, offsets, weights), ids, offsets, weights, "mean")


@pytest.mark.parametrize("combiner", COMBINERS)
def test_pooled_large_batch_many_threads(rng, combiner):
    # Enough bags and ids to split across threads and chunks.
    table = make_table(1000, 16, seed=3)
    ids, offsets, weights = random_bags(rng, 1000, 5000, max_len=10, weighted=True)
    _check_pooled(table, table.lookup(ids, offsets, weights, combiner=combiner), ids, offsets, weights, combiner)


# ----------------------------------------------------------------- bag semantics


@pytest.mark.parametrize("dtype", DTYPES)
def test_empty_bags_give_zeros(dtype):
    table = make_table(10, 6, dtype)
    offsets = np.array([0, 0, 2, 2, 2, 3, 3], np.int64)
    ids = np.array([1, 2, 3], np.int64)
    for combiner in COMBINERS:
        out = table.lookup(ids, offsets, combiner=combiner)
        assert out.shape == (6, 6)
        for b in (0, 2, 3, 5):
            assert np.all(out[b] == 0), (combiner, b)
        _check_pooled(table, out, ids, offsets, None, combiner)


def test_all_bags_empty():
    table = make_table(10, 4)
    for combiner in COMBINERS:
        out = table.lookup(np.zeros(0, np.int64), np.zeros(5, np.int64), combiner=combiner)
        np.testing.assert_array_equal(out, np.zeros((4, 4), np.float32))


def test_repeated_id_counts_once_per_occurrence():
    table = make_table(10, 5)
    row = table.to_numpy()[3].astype(np.float64)
    ids, offsets = np.array([3, 3, 3], np.int64), np.array([0, 3])
    np.testing.assert_allclose(table.lookup(ids, offsets, combiner="sum")[0], 3 * row, rtol=1e-6)
    np.testing.assert_allclose(table.lookup(ids, offsets, combiner="mean")[0], row, rtol=1e-6)
    np.testing.assert_allclose(table.lookup(ids, offsets, combiner="sqrtn")[0], 3 * row / np.sqrt(3), rtol=1e-6)
    # weighted: w = (1, 2, 0.5) -> sum 3.5 row; mean = row; sqrtn = 3.5 / sqrt(5.25) row
    w = np.array([1, 2, 0.5], np.float32)
    np.testing.assert_allclose(table.lookup(ids, offsets, w, combiner="sum")[0], 3.5 * row, rtol=1e-6)
    np.testing.assert_allclose(table.lookup(ids, offsets, w, combiner="mean")[0], row, rtol=1e-6)
    np.testing.assert_allclose(table.lookup(ids, offsets, w, combiner="sqrtn")[0], 3.5 * row / np.sqrt(5.25),
                               rtol=1e-6)


def test_zero_denominator_gives_zeros():
    table = make_table(10, 7)
    t = table.to_numpy().astype(np.float64)
    ids = np.array([1, 2, 4, 5, 6, 7], np.int64)
    offsets = np.array([0, 2, 4, 6])
    # bag 0: weights sum to 0 (mean -> 0); bag 1: all weights 0 (sqrtn -> 0, mean -> 0); bag 2: normal
    w = np.array([1.5, -1.5, 0.0, 0.0, 2.0, 1.0], np.float32)
    mean = table.lookup(ids, offsets, w, combiner="mean")
    sqrtn = table.lookup(ids, offsets, w, combiner="sqrtn")
    summ = table.lookup(ids, offsets, w, combiner="sum")
    assert np.all(mean[0] == 0) and np.all(mean[1] == 0)
    assert np.all(sqrtn[1] == 0)
    assert np.all(summ[1] == 0)
    np.testing.assert_allclose(summ[0], 1.5 * (t[1] - t[2]), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(sqrtn[0], 1.5 * (t[1] - t[2]) / np.sqrt(4.5), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(mean[2], (2 * t[6] + t[7]) / 3, rtol=1e-5)
    for c, out in (("mean", mean), ("sqrtn", sqrtn), ("sum", summ)):
        _check_pooled(table, out, ids, offsets, w, c)


def test_negative_weights(rng):
    table = make_table(40, 9)
    ids, offsets, _ = random_bags(rng, 40, 20)
    w = rng.uniform(-2, -0.25, size=len(ids)).astype(np.float32)
    for c in COMBINERS:
        _check_pooled(table, table.lookup(ids, offsets, w, combiner=c), ids, offsets, w, c)


@pytest.mark.parametrize("dim", (1, 8, 13))
def test_bags_of_one_without_offsets(rng, dim):
    table = make_table(30, dim)
    ids = rng.integers(0, 30, size=17)
    w = rng.uniform(0.5, 2, size=17).astype(np.float32)
    t = table.to_numpy()
    for c in COMBINERS:
        out = table.lookup(ids, combiner=c)
        assert out.shape == (17, dim)
        np.testing.assert_allclose(out, t[ids], rtol=1e-6)
    np.testing.assert_allclose(table.lookup(ids, weights=w, combiner="sum"), w[:, None] * t[ids], rtol=1e-6)
    np.testing.assert_allclose(table.lookup(ids, weights=w, combiner="mean"), t[ids], rtol=1e-6)
    np.testing.assert_allclose(table.lookup(ids, weights=w, combiner="sqrtn"), t[ids], rtol=1e-6)


@pytest.mark.parametrize("form", ["csr", "ragged", "dense", "sparse", "list"])
def test_batch_zero(form):
    table = make_table(10, 3)
    if form == "csr":
        args = (np.zeros(0, np.int64), np.array([0]))
    elif form == "ragged":
        args = (ec.Ragged(np.zeros(0, np.int32), np.array([0])),)
    elif form == "dense":
        args = (np.zeros((0, 4), np.int64),)
    elif form == "sparse":
        args = (ec.Sparse(np.zeros((0, 2), np.int64), np.zeros(0, np.int64), [0, 4]),)
    else:
        args = ([],)
    for c in COMBINERS:
        out = table.lookup(*args, combiner=c)
        assert out.shape == (0, 3) and out.dtype == np.float32
    assert table.lookup(*args, combiner=None, max_sequence_length=5).shape == (0, 5, 3)


# ----------------------------------------------------------------- input forms


@pytest.mark.parametrize("weights_form", ["none", "ragged", "flat"])
@pytest.mark.parametrize("combiner", COMBINERS)
def test_ragged(rng, combiner, weights_form):
    table = make_table(60, 13, seed=5)
    ids, offsets, w = random_bags(rng, 60, 15, id_dtype=np.int32, weighted=True)
    weights = {"none": None, "ragged": ec.Ragged(w, offsets), "flat": w}[weights_form]
    out = table.lookup(ec.Ragged(ids, offsets), weights=weights, combiner=combiner)
    _check_pooled(table, out, ids, offsets, None if weights is None else w, combiner)


def test_ragged_from_lengths(rng):
    table = make_table(60, 4)
    lengths = np.array([2, 0, 3, 1])
    ids = rng.integers(0, 60, size=6)
    r = ec.Ragged.from_lengths(ids, lengths)
    np.testing.assert_array_equal(r.offsets, [0, 2, 2, 5, 6])
    _check_pooled(table, table.lookup(r, combiner="sum"), ids, r.offsets, None, "sum")


def test_ragged_from_lengths_errors():
    """Lengths are checked as lengths: the error names them, not the offsets made from them."""
    with pytest.raises(ValueError, match=r"lengths must be 1-D, got shape \(1, 2\)"):
        ec.Ragged.from_lengths(np.array([1, 2]), [[1, 1]])
    with pytest.raises(ValueError, match="lengths must be >= 0, got -1 at position 1"):
        ec.Ragged.from_lengths(np.array([1, 2]), [3, -1])
    with pytest.raises(TypeError, match="lengths must be an integer array"):
        ec.Ragged.from_lengths(np.array([1, 2]), [1.0, 1.0])
    np.testing.assert_array_equal(ec.Ragged.from_lengths(np.zeros(0, np.int64), []).offsets, [0])
    # Lengths whose sum passes int64 (the offsets would wrap to negative values).
    with pytest.raises(ValueError, match=r"lengths add up to more than int64 holds \(2\*\*63 - 1\) by position 1"):
        ec.Ragged.from_lengths(np.array([1, 2]), np.array([2**62, 2**62, 2**62, 2**62 - 2], np.int64))


def test_array_subclasses_are_read_as_their_plain_arrays():
    """An np.matrix (which stays 2-D through reshape) or another ndarray
    subclass is read as its plain array, as NumPy's own functions read it."""
    table = make_table(10, 3)
    ids = np.array([[1, 2], [3, 4]])
    want = table.lookup(ids)
    np.testing.assert_array_equal(table.lookup(np.matrix(ids)), want)
    np.testing.assert_array_equal(table.lookup(ids, weights=np.matrix(np.ones((2, 2)))), want)
    np.testing.assert_array_equal(table.lookup(np.array([1, 2, 3, 4]), np.matrix([[0, 2, 4]]).A1), want)


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("combiner", COMBINERS)
def test_dense_2d(rng, combiner, weighted):
    table = make_table(50, 8, seed=2)
    ids = rng.integers(0, 50, size=(11, 4))
    ids[3, 1] = ids[3, 2]  # a repeat
    w = rng.uniform(0.5, 2, size=(11, 4)).astype(np.float32) if weighted else None
    out = table.lookup(ids, weights=w, combiner=combiner)
    assert out.shape == (11, 8)
    offsets = np.arange(0, 45, 4)
    _check_pooled(table, out, ids.ravel(), offsets, None if w is None else w.ravel(), combiner)


def _coo(rng, batch, width, rows, nnz_per_row=3, duplicates=False):
    """COO bags: (indices [nnz, 2] shuffled, ids, positions)."""
    coords = []
    for b in range(batch):
        if b % 4 == 2:
            continue  # an empty row
        k = int(rng.integers(1, nnz_per_row + 1))
        cols = rng.choice(width, size=k, replace=False)
        coords += [(b, int(c)) for c in cols]
        if duplicates and b % 3 == 0:
            coords.append((b, int(cols[0])))  # the same position twice
    indices = np.array(coords, np.int64).reshape(-1, 2)
    ids = rng.integers(0, rows, size=len(indices))
    return indices, ids


def _coo_pooled_ref(table, indices, ids, weights, batch, combiner):
    order = np.argsort(indices[:, 0], kind="stable")
    offsets = np.zeros(batch + 1, np.int64)
    np.cumsum(np.bincount(indices[:, 0], minlength=batch), out=offsets[1:])
    w = None if weights is None else np.asarray(weights)[order]
    return ref.pooled(table.to_numpy(), ids[order], offsets, w, combiner)


@pytest.mark.parametrize("weights_form", ["none", "sparse", "flat"])
@pytest.mark.parametrize("shuffled", [False, True])
@pytest.mark.parametrize("combiner", COMBINERS)
@pytest.mark.parametrize("index_dtype", [np.int64, np.int32])
def test_sparse_pooled(rng, combiner, shuffled, weights_form, index_dtype):
    table = make_table(40, 7, seed=9)
    batch, width = 9, 6
    indices, ids = _coo(rng, batch, width, 40, duplicates=True)
    order = np.lexsort(indices.T[::-1])
    indices, ids = indices[order], ids[order]  # row-major sorted
    if shuffled:
        perm = rng.permutation(len(ids))
        indices, ids = indices[perm], ids[perm]
    indices = indices.astype(index_dtype)
    w = rng.uniform(0.5, 2, size=len(ids)).astype(np.float32)
    weights = {"none": None, "sparse": ec.Sparse(indices, w, [batch, width]), "flat": w}[weights_form]
    out = table.lookup(ec.Sparse(indices, ids, [batch, width]), weights=weights, combiner=combiner)
    expected, bound = _coo_pooled_ref(table, indices, ids, None if weights is None else w, batch, combiner)
    assert_pooled(out, expected, bound, RTOL[combiner])


# ----------------------------------------------------------------- sequences


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("id_dtype", [np.int32, np.int64])
def test_sequence_flat(rng, id_dtype, weighted, dtype):
    table = make_table(70, 13, dtype, seed=4)
    ids, offsets, w = random_bags(rng, 70, 14, id_dtype=id_dtype, weighted=weighted)
    out = table.lookup(ids, offsets, w, combiner=None)
    assert out.shape == (len(ids), 13) and out.dtype == np.float32
    np.testing.assert_allclose(out, ref.sequence_flat(table.to_numpy(), ids, w), rtol=1e-7, atol=0)
    # Ragged form: the same.
    np.testing.assert_array_equal(table.lookup(ec.Ragged(ids, offsets), weights=w, combiner=None), out)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("length", [1, 3, 5, 12])
@pytest.mark.parametrize("weighted", [False, True])
def test_sequence_padded(rng, weighted, length, dtype):
    table = make_table(70, 9, dtype, seed=6)
    ids, offsets, w = random_bags(rng, 70, 13, max_len=7, weighted=weighted)
    out = table.lookup(ids, offsets, w, combiner=None, max_sequence_length=length)
    assert out.shape == (13, length, 9)
    expected = ref.sequence_padded(table.to_numpy(), ids, offsets, w, length)
    np.testing.assert_allclose(out, expected, rtol=1e-7, atol=0)
    out2 = table.lookup(ec.Ragged(ids, offsets), weights=None if w is None else ec.Ragged(w, offsets),
                        combiner=None, max_sequence_length=length)
    np.testing.assert_array_equal(out2, out)


@pytest.mark.parametrize("weighted", [False, True])
def test_dense_sequence(rng, weighted):
    table = make_table(30, 5)
    ids = rng.integers(0, 30, size=(6, 4))
    w = rng.uniform(0.5, 2, size=(6, 4)).astype(np.float32) if weighted else None
    out = table.lookup(ids, weights=w, combiner=None)
    assert out.shape == (6, 4, 5)
    expected = (1 if w is None else w[..., None]) * table.to_numpy()[ids]
    np.testing.assert_allclose(out, expected, rtol=1e-7)
    # An explicit length truncates / pads.
    short = table.lookup(ids, weights=w, combiner=None, max_sequence_length=2)
    np.testing.assert_array_equal(short, out[:, :2])
    long = table.lookup(ids, weights=w, combiner=None, max_sequence_length=7)
    assert long.shape == (6, 7, 5)
    np.testing.assert_array_equal(long[:, :4], out)
    assert np.all(long[:, 4:] == 0)


def test_dense_sequence_of_width_zero():
    # [batch, 0] ids: every bag is empty; the sequence output is [batch, 0, dim].
    table = make_table(10, 3)
    ids = np.zeros((5, 0), np.int64)
    np.testing.assert_array_equal(table.lookup(ids, combiner="sum"), np.zeros((5, 3), np.float32))
    assert table.lookup(ids, combiner=None).shape == (5, 0, 3)


def test_sparse_sequence_of_width_zero():
    table = make_table(10, 3)
    sp = ec.Sparse(np.zeros((0, 2), np.int64), np.zeros(0, np.int64), [4, 0])
    np.testing.assert_array_equal(table.lookup(sp, combiner="mean"), np.zeros((4, 3), np.float32))
    assert table.lookup(sp, combiner=None).shape == (4, 0, 3)


@pytest.mark.parametrize("shuffled", [False, True])
@pytest.mark.parametrize("weights_form", ["none", "sparse", "flat"])
def test_sparse_sequence(rng, weights_form, shuffled):
    table = make_table(40, 6, seed=8)
    batch, width = 10, 7
    indices, ids = _coo(rng, batch, width, 40, duplicates=True)
    if shuffled:
        perm = rng.permutation(len(ids))
        indices, ids = indices[perm], ids[perm]
    w = rng.uniform(0.5, 2, size=len(ids)).astype(np.float32)
    weights = {"none": None, "sparse": ec.Sparse(indices, w, [batch, width]), "flat": w}[weights_form]
    wv = None if weights is None else w
    sp = ec.Sparse(indices, ids, [batch, width])
    out = table.lookup(sp, weights=weights, combiner=None)
    assert out.shape == (batch, width, 6)
    expected = ref.sequence_sparse(table.to_numpy(), indices[:, 0], indices[:, 1], ids, wv, batch, width)
    np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-7)
    # An explicit, shorter length drops the ids at positions >= L.
    out3 = table.lookup(sp, weights=weights, combiner=None, max_sequence_length=3)
    expected3 = ref.sequence_sparse(table.to_numpy(), indices[:, 0], indices[:, 1], ids, wv, batch, 3)
    assert out3.shape == (batch, 3, 6)
    np.testing.assert_allclose(out3, expected3, rtol=1e-6, atol=1e-7)
    # A longer one pads with zeros.
    out9 = table.lookup(sp, weights=weights, combiner=None, max_sequence_length=width + 2)
    assert out9.shape == (batch, width + 2, 6)
    np.testing.assert_array_equal(out9[:, :width], out)
    assert np.all(out9[:, width:] == 0)


def test_sparse_sequence_places_ids_at_their_columns():
    table = make_table(10, 2)
    t = table.to_numpy()
    indices = np.array([[0, 2], [1, 0], [1, 3], [1, 3]], np.int64)
    ids = np.array([4, 5, 6, 7])
    out = table.lookup(ec.Sparse(indices, ids, [2, 4]), combiner=None)
    expected = np.zeros((2, 4, 2), np.float32)
    expected[0, 2] = t[4]
    expected[1, 0] = t[5]
    expected[1, 3] = t[6] + t[7]  # duplicates add
    np.testing.assert_allclose(out, expected, rtol=1e-6)


def test_sparse_sequence_of_many_empty_bags_takes_memory_of_its_output():
    """A sparse sequence lookup of few ids in very many bags needs its output
    and the bags' offsets, not more: each entry's bag was made from two
    arrays of the bags (np.arange, np.diff), 2x the output at its peak (3x
    in RSS); an OS that overcommits could kill the process instead of
    raising MemoryError."""
    import tracemalloc

    bags = 1 << 22
    table = ec.Table(name="t", rows=10, dim=1, initializer=ec.initializers.Constant(1.0))
    sp = ec.Sparse(np.array([[0, 5], [bags - 1, 1]], np.int64), np.array([1, 2]), [bags, 7])  # position 5 dropped
    tracemalloc.start()
    try:
        out = table.lookup(sp, combiner=None, max_sequence_length=2)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert out.shape == (bags, 2, 1) and out.sum() == 1.0 and out[bags - 1, 1, 0] == 1.0
    assert peak < 1.5 * out.nbytes, (peak, out.nbytes)  # (2x before)


def test_sparse_sequence_adds_many_ids_at_one_position_in_input_order():
    """Up to five ids at one position, shuffled: they add up in their input
    order (a stable sort by position), as a loop over the entries would."""
    rng = np.random.default_rng(12)
    table = make_table(50, 5, seed=2)
    t = table.to_numpy()
    coords = [(b, p) for b in range(6) for p in range(4) for _ in range(int(rng.integers(0, 6)))]
    perm = rng.permutation(len(coords))
    indices = np.array(coords, np.int64)[perm]
    ids = rng.integers(0, 50, len(coords))
    w = rng.uniform(-1, 2, len(coords)).astype(np.float32)
    out = table.lookup(ec.Sparse(indices, ids, [6, 4]), weights=w, combiner=None)
    expected = np.zeros((6, 4, 5), np.float32)
    seen = np.zeros((6, 4), bool)
    for k in np.lexsort(indices.T[::-1]):  # row-major, stable: input order within a position
        b, p = indices[k]
        row = w[k] * t[ids[k]]
        expected[b, p] = row if not seen[b, p] else expected[b, p] + row
        seen[b, p] = True
    np.testing.assert_array_equal(out, expected)


def test_sparse_batches_know_when_their_positions_are_dense():
    """What picks the padded kernels for a Sparse sequence: positions 0, 1, 2,
    ... in every bag, in row-major order once sorted; kept by owned()."""
    from embedcore._inputs import make_batch

    def dense(indices):
        return make_batch(ec.Sparse(np.array(indices, np.int64).reshape(-1, 2), np.ones(len(indices), np.int64),
                                    [3, 4])).dense_positions

    assert dense([[0, 0], [0, 1], [2, 0]]) and dense([]) and dense([[2, 0], [0, 0], [0, 1]])  # sorted first
    assert not dense([[0, 1]]) and not dense([[0, 0], [0, 0]]) and not dense([[1, 0], [1, 2]])
    assert make_batch(ec.Sparse([[0, 0], [0, 1]], [1, 2], [1, 2])).owned().dense_positions


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("length", [0, 3, 9])
def test_sparse_sequence_of_a_padded_batch_is_the_ragged_one(weighted, length):
    """A SparseTensor of a padded dense batch (positions 0, 1, 2, ... in each
    bag): lookups and updates equal the Ragged batch's, bit for bit."""
    rng = np.random.default_rng(13)
    lengths = rng.integers(0, 7, 8)
    offsets = np.r_[0, np.cumsum(lengths)].astype(np.int64)
    ids = rng.integers(0, 30, offsets[-1])
    indices = np.array([(b, p) for b in range(8) for p in range(lengths[b])], np.int64).reshape(-1, 2)
    w = rng.uniform(0.5, 2, ids.size).astype(np.float32) if weighted else None
    a = make_table(30, 4, seed=3, optimizer=ec.optimizers.Adagrad(0.1))
    b = make_table(30, 4, seed=3, optimizer=ec.optimizers.Adagrad(0.1))
    width = int(lengths.max())
    L = length or width
    sp = ec.Sparse(indices, ids, [8, width])
    got = a.lookup(sp, weights=w, combiner=None, max_sequence_length=length)
    want = b.lookup(ec.Ragged(ids, offsets), weights=w, combiner=None, max_sequence_length=L)
    np.testing.assert_array_equal(got, want)
    g = rng.standard_normal(got.shape).astype(np.float32)
    a.apply_gradients(sp, None, g, weights=w, combiner=None, max_sequence_length=length)
    b.apply_gradients(ec.Ragged(ids, offsets), None, g, weights=w, combiner=None, max_sequence_length=L)
    np.testing.assert_array_equal(a.to_numpy(), b.to_numpy())


# ----------------------------------------------------------------- dtypes


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_low_precision_storage_matches_numpy_rounding(rng, dtype):
    table = make_table(20, 13, dtype)
    x = rng.normal(size=(20, 13)).astype(np.float32) * np.float32(3.0)
    x[0, :4] = [65504.0, 1e-6, -2.5e-8, 0.0]  # largest half, subnormal halves
    table.assign(x)
    np_dtype = np.float16 if dtype == "float16" else ref.bfloat16_dtype()
    expected = x.astype(np_dtype)
    stored = table.values()
    assert stored.dtype == np_dtype and stored.shape == (20, 13)
    np.testing.assert_array_equal(stored.view(np.uint16), expected.view(np.uint16))
    np.testing.assert_array_equal(table.to_numpy(), expected.astype(np.float32))
    # Lookups read the stored values.
    ids = np.arange(20)
    np.testing.assert_array_equal(table.lookup(ids, combiner=None), expected.astype(np.float32))


def test_values_and_to_numpy(rng):
    table = make_table(25, 6)
    v = table.values()
    assert v.shape == (25, 6) and v.dtype == np.float32 and not v.flags.writeable
    np.testing.assert_array_equal(table.to_numpy(), v)
    np.testing.assert_array_equal(table.to_numpy(5, 7), v[5:12])
    x = rng.normal(size=(3, 6)).astype(np.float32)
    table.assign(x, start_row=10)
    np.testing.assert_array_equal(v[10:13], x)  # the view reflects updates


# ----------------------------------------------------------------- out=


@pytest.mark.parametrize("case", ["pooled", "flat", "padded", "dense_seq", "sparse_seq", "sparse_pooled"])
def test_out_argument(rng, case):
    table = make_table(40, 5)
    ids, offsets, w = random_bags(rng, 40, 8, weighted=True)
    if case == "pooled":
        args, kw = (ids, offsets, w), {"combiner": "sqrtn"}
    elif case == "flat":
        args, kw = (ids, offsets, w), {"combiner": None}
    elif case == "padded":
        args, kw = (ec.Ragged(ids, offsets),), {"weights": w, "combiner": None, "max_sequence_length": 3}
    elif case == "dense_seq":
        args, kw = (rng.integers(0, 40, size=(4, 3)),), {"combiner": None}
    else:
        indices = np.array([[0, 1], [2, 0], [2, 2], [3, 1]], np.int64)
        args = (ec.Sparse(indices, np.array([1, 2, 3, 4]), [5, 3]),)
        kw = {"combiner": None if case == "sparse_seq" else "sum"}
    expected = table.lookup(*args, **kw)
    out = np.full(expected.shape, np.nan, np.float32)
    result = table.lookup(*args, **kw, out=out)
    assert result is out
    np.testing.assert_array_equal(out, expected)


def test_out_errors(rng):
    table = make_table(40, 5)
    ids, offsets, _ = random_bags(rng, 40, 8)
    with pytest.raises(TypeError):
        table.lookup(ids, offsets, out=np.zeros((8, 5), np.float64))
    with pytest.raises(TypeError):
        table.lookup(ids, offsets, out=np.zeros((5, 8), np.float32).T)  # not C-contiguous
    with pytest.raises(TypeError):
        table.lookup(ids, offsets, out=[[0.0] * 5] * 8)
    with pytest.raises(ValueError):
        table.lookup(ids, offsets, out=np.zeros((8, 6), np.float32))
    with pytest.raises(ValueError):
        table.lookup(ids, offsets, out=np.zeros((9, 5), np.float32))
    with pytest.raises(ValueError):
        table.lookup(ids, offsets, out=np.zeros((8, 5, 1), np.float32))
    with pytest.raises(ValueError):
        table.lookup(ids, offsets, combiner=None, max_sequence_length=4, out=np.zeros((8, 5), np.float32))
    ro = np.zeros((8, 5), np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError):
        table.lookup(ids, offsets, out=ro)


def test_out_untouched_when_lookup_fails(rng):
    table = make_table(40, 5)
    out = np.full((2, 5), 7.0, np.float32)
    with pytest.raises(IndexError):
        table.lookup(np.array([1, 40]), np.array([0, 1, 2]), out=out)
    with pytest.raises(ValueError):
        table.lookup(np.array([1, 2]), np.array([0, 3, 2]), out=out)
    assert np.all(out == 7.0)


# ----------------------------------------------------------------- other id dtypes


@pytest.mark.parametrize("id_dtype", [np.int8, np.int16, np.uint8, np.uint16, np.uint32, np.uint64])
def test_other_integer_id_dtypes_are_converted(rng, id_dtype):
    table = make_table(100, 4)
    ids, offsets, _ = random_bags(rng, 100, 10)
    expected = table.lookup(ids, offsets, combiner="sum")
    np.testing.assert_array_equal(table.lookup(ids.astype(id_dtype), offsets, combiner="sum"), expected)


def test_python_lists(rng):
    table = make_table(100, 4)
    ids, offsets, w = random_bags(rng, 100, 10, weighted=True)
    expected = table.lookup(ids, offsets, w, combiner="mean")
    np.testing.assert_array_equal(table.lookup(ids.tolist(), offsets.tolist(), w.tolist(), combiner="mean"),
                                  expected)


def test_non_contiguous_inputs(rng):
    table = make_table(100, 4)
    ids, offsets, w = random_bags(rng, 100, 10, weighted=True)
    ids2 = np.repeat(ids, 2)[::2]
    w2 = np.repeat(w, 2)[::2]
    assert not ids2.flags.c_contiguous
    np.testing.assert_array_equal(table.lookup(ids2, offsets, w2, combiner="sum"),
                                  table.lookup(ids, offsets, w, combiner="sum"))


# ----------------------------------------------------------------- portable kernels

_GENERIC_SCRIPT = r"""
import sys
import numpy as np
import embedcore as ec

want = ("generic",) if sys.argv[2] == "generic" else ("avx2+f16c", "generic")  # the cap, or less on this CPU
assert ec.build_info()["simd"] in want, ec.build_info()
rng = np.random.default_rng(77)
saved = {}
for dtype in ("float32", "float16", "bfloat16"):
    for dim in (1, 3, 8, 13, 129):
        t = ec.Table(name="g", rows=60, dim=dim, dtype=dtype, initializer=ec.initializers.Uniform(-1, 1, seed=dim),
                     optimizer=ec.optimizers.Adagrad(0.1))
        lengths = rng.integers(0, 6, size=20)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        ids = rng.integers(0, 60, size=int(offsets[-1]))
        w = rng.uniform(0.5, 2, size=len(ids)).astype(np.float32)
        key = f"{dtype}_{dim}"
        saved[key + "_table"] = t.to_numpy()
        saved[key + "_ids"], saved[key + "_offsets"], saved[key + "_w"] = ids, offsets, w
        for c in ("sum", "mean", "sqrtn"):
            saved[key + "_" + c] = t.lookup(ids, offsets, w, combiner=c)
        saved[key + "_padded"] = t.lookup(ids, offsets, w, combiner=None, max_sequence_length=3)
        g = rng.normal(size=(20, dim)).astype(np.float32)
        t.apply_gradients(ids, offsets, g, weights=w, combiner="mean")
        saved[key + "_grads"] = g
        saved[key + "_after"] = t.to_numpy()
        saved[key + "_acc"] = np.array(t.slots()["accumulators"])
np.savez(sys.argv[1], **saved)
"""


@pytest.mark.parametrize("value,simd", [("avx512", None), ("", None), ("bogus", "error"), ("GENERIC", "error")])
def test_kernels_cap_values(value, simd):
    """EMBEDCORE_KERNELS takes generic, avx2 or avx512 (no cap: the best the
    CPU has, as when unset); anything else is a ValueError at the first use
    of the kernels, naming the value, not a silent choice."""
    import os
    import subprocess
    import sys

    code = ("import embedcore as ec\ntry:\n    print(ec.build_info()['simd'])\n"
            "except ValueError as e:\n    print('ValueError', e)")
    unset = {k: v for k, v in os.environ.items() if k != "EMBEDCORE_KERNELS"}
    best = subprocess.run([sys.executable, "-c", code], env=unset, capture_output=True, text=True, timeout=300)
    r = subprocess.run([sys.executable, "-c", code], env=dict(unset, EMBEDCORE_KERNELS=value), capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    if simd == "error":
        assert r.stdout.strip() == (f"ValueError EMBEDCORE_KERNELS must be generic, avx2 or avx512 (or unset), "
                                    f"got '{value}'"), r.stdout
    else:
        assert r.stdout == best.stdout and "ValueError" not in r.stdout


@pytest.mark.parametrize("cap", ["generic", "avx2"])
def test_capped_kernels_match_reference(tmp_path, cap):
    """EMBEDCORE_KERNELS=generic selects the portable kernels (used where AVX2
    is missing), =avx2 the AVX2 ones (where AVX-512 is missing): they must
    give the reference's results too."""
    import os
    import subprocess
    import sys

    script, out = tmp_path / "generic.py", tmp_path / "generic.npz"
    script.write_text(_GENERIC_SCRIPT)
    env = dict(os.environ, EMBEDCORE_KERNELS=cap)
    r = subprocess.run([sys.executable, str(script), str(out), cap], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    d = np.load(out)
    ropt = ref.OptimizerRef("adagrad", learning_rate=0.1)
    for dtype in DTYPES:
        for dim in (1, 3, 8, 13, 129):
            key = f"{dtype}_{dim}"
            table, ids, offsets, w = (d[key + s] for s in ("_table", "_ids", "_offsets", "_w"))
            for c in COMBINERS:
                e, bound = ref.pooled(table, ids, offsets, w, c)
                assert_pooled(d[key + "_" + c], e, bound, RTOL[c])
            np.testing.assert_allclose(d[key + "_padded"], ref.sequence_padded(table, ids, offsets, w, 3),
                                       rtol=1e-7, atol=0)
            tref = ref.TableRef(table, ropt, dtype=dtype)
            tref.apply(tref.row_grads().add_pooled(ids, offsets, w, "mean", d[key + "_grads"]))
            after = d[key + "_after"].astype(np.float64)
            tol = ref.storage_rtol(dtype) * np.maximum(np.abs(after), np.abs(tref.values)) + 1e-6
            assert np.all(np.abs(after - tref.values) <= tol), key
            np.testing.assert_allclose(d[key + "_acc"], tref.slots["accumulators"], rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------- grouped bags
def _grouped_reference(table, ids, offsets, weights, groups):
    """float64 sums of each group of bags, and the engine's own in-order
    composition: each bag summed by lookup(sum), then a group's bag sums
    added in order in float32 (what lookup_grouped promises, bit for bit)."""
    per_bag, bound = ref.pooled(table.to_numpy(), ids, offsets, weights, "sum")
    bags = table.lookup(ids, offsets, weights, combiner="sum")
    n = len(groups) - 1
    want64 = np.zeros((n, table.dim))
    bound64 = np.zeros((n, table.dim))
    exact = np.zeros((n, table.dim), np.float32)
    for g in range(n):
        for k in range(groups[g], groups[g + 1]):
            want64[g] += per_bag[k]
            bound64[g] += bound[k]
            exact[g] = bags[k] if k == groups[g] else exact[g] + bags[k]
    return want64, bound64, exact


@pytest.mark.parametrize("dim", (1, 7, 8, 13, 128, 129))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("id_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("weighted", [False, True])
def test_lookup_grouped(rng, weighted, id_dtype, dtype, dim):
    rows = int(rng.integers(20, 300))
    table = make_table(rows, dim, dtype, seed=int(rng.integers(1 << 30)))
    bags = int(rng.integers(1, 60))
    ids, offsets, weights = random_bags(rng, rows, bags, id_dtype=id_dtype, weighted=weighted)
    # Groups of 0 to 5 bags (empty groups too), covering every bag.
    sizes = []
    while sum(sizes) < bags:
        sizes.append(int(min(rng.integers(0, 6), bags - sum(sizes))))
    groups = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    out = table.lookup_grouped(ids, offsets, groups, weights=weights)
    assert out.dtype == np.float32 and out.shape == (len(sizes), dim) and out.flags.c_contiguous
    want, bound, exact = _grouped_reference(table, ids, offsets, weights, groups)
    np.testing.assert_array_equal(out, exact)
    assert_pooled(out, want, bound, 1e-6)
    assert not out[np.asarray(sizes) == 0].any()


def test_lookup_grouped_many_threads_and_edges(rng):
    table = make_table(500, 16, seed=5)
    ids, offsets, weights = random_bags(rng, 500, 6000, max_len=9, weighted=True)
    groups = np.arange(0, 6001, 3, dtype=np.int64)
    out = table.lookup_grouped(ids, offsets, groups, weights=weights)
    np.testing.assert_array_equal(out, _grouped_reference(table, ids, offsets, weights, groups)[2])
    # No ids and no groups; one group of every bag.
    empty = table.lookup_grouped(np.zeros(0, np.int64), np.array([0]), np.array([0]))
    assert empty.shape == (0, 16)
    whole = table.lookup_grouped(ec.Ragged(ids, offsets), groups=[0, 6000], weights=weights)
    np.testing.assert_array_equal(whole, _grouped_reference(table, ids, offsets, weights, [0, 6000])[2])


def _sparse_segment_reference(table, ids, offsets, combiner):
    """TensorFlow's sparse_segment_sum / _mean / _sqrt_n on CPU, written out
    in float32: a bag of n >= 10 rows adds rows [0, r) (r = n % 8, 8 when 0,
    9 when 1) and then each following group of 8 summed from its first row;
    mean / sqrtn multiply a bag of fewer than 10 by 1 / den, divide longer."""
    w = table.to_numpy()
    out = np.zeros((len(offsets) - 1, table.dim), np.float32)
    for b in range(len(offsets) - 1):
        rows = w[ids[offsets[b]:offsets[b + 1]]]
        n = len(rows)
        if n == 0:
            continue
        r = n if n < 10 else (8 if n % 8 == 0 else 9 if n % 8 == 1 else n % 8)
        acc = rows[0].copy()
        for k in range(1, r):
            acc = acc + rows[k]
        for g in range(r, n, 8):
            part = rows[g].copy()
            for k in range(g + 1, g + 8):
                part = part + rows[k]
            acc = acc + part
        if combiner != "sum":
            den = np.float32(n) if combiner == "mean" else np.float32(np.sqrt(np.float64(n)))
            acc = acc * (np.float32(1) / den) if n < 10 else acc / den
        out[b] = acc
    return out


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
@pytest.mark.parametrize("id_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("dtype", DTYPES)
def test_lookup_sparse_segment_adds_and_divides_as_tensorflow(rng, combiner, id_dtype, dtype):
    table = make_table(300, 13, dtype, seed=int(rng.integers(1 << 30)))
    # Every bag length from 0 to 41: below 10, n % 8 == 0 and == 1, and the rest.
    lengths = rng.permutation(np.arange(42))
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    ids = rng.integers(0, 300, int(offsets[-1])).astype(id_dtype)
    out = table.lookup_sparse_segment(ids, offsets, combiner)
    assert out.dtype == np.float32 and out.shape == (42, 13) and out.flags.c_contiguous
    np.testing.assert_array_equal(out, _sparse_segment_reference(table, ids, offsets, combiner))
    want, bound = ref.pooled(table.to_numpy(), ids, offsets, None, combiner)
    assert_pooled(out, want, bound, 1e-6)
    np.testing.assert_array_equal(table.lookup_sparse_segment(ec.Ragged(ids, offsets), combiner=combiner), out)
    ec.set_num_threads(3)  # conftest restores the count
    np.testing.assert_array_equal(table.lookup_sparse_segment(ids, offsets, combiner), out)


def test_lookup_sparse_segment_errors(rng):
    table = make_table(40, 4, seed=2)
    ids, offsets, _ = random_bags(rng, 40, 6)
    with pytest.raises(ValueError, match="combiner must be 'sum', 'mean' or 'sqrtn', got 'max'"):
        table.lookup_sparse_segment(ids, offsets, "max")
    with pytest.raises(ValueError, match="give the bags as ids and offsets"):
        table.lookup_sparse_segment(ids)
    bad = ids.copy()
    bad[3] = 40
    with pytest.raises(IndexError, match=r"id 40 at position 3 of ids is out of range \[0, 40\)"):
        table.lookup_sparse_segment(bad, offsets)
    with pytest.raises(ValueError, match="offsets"):
        table.lookup_sparse_segment(ids, offsets[::-1].copy())
    assert table.lookup_sparse_segment(np.zeros(0, np.int64), np.array([0])).shape == (0, 4)


def test_lookup_grouped_errors(rng):
    table = make_table(40, 4, seed=2)
    ids, offsets, _ = random_bags(rng, 40, 6)
    before = table.to_numpy().copy()
    with pytest.raises(ValueError, match=r"groups must end at the number of bags, 6, got groups\[2\] = 5"):
        table.lookup_grouped(ids, offsets, [0, 2, 5])
    with pytest.raises(ValueError, match=r"groups must be non-decreasing: groups\[1\] = 4 > groups\[2\] = 3"):
        table.lookup_grouped(ids, offsets, [0, 4, 3, 6])
    with pytest.raises(ValueError, match=r"groups\[0\] must be 0, got 1"):
        table.lookup_grouped(ids, offsets, [1, 6])
    with pytest.raises(ValueError, match="groups must hold batch \\+ 1 values"):
        table.lookup_grouped(ids, offsets, np.zeros(0, np.int64))
    with pytest.raises(TypeError, match="groups"):
        table.lookup_grouped(ids, offsets, np.array([0.0, 6.0]))
    with pytest.raises(ValueError, match="give the bags as ids and offsets"):
        table.lookup_grouped(ids, None, [0, 6])
    with pytest.raises(ValueError, match=r"groups must be 1-D, got shape \(\)"):
        table.lookup_grouped(ids, offsets, 6)
    bad = ids.copy()
    bad[3] = 40
    with pytest.raises(IndexError, match=r"id 40 at position 3 of ids is out of range \[0, 40\)"):
        table.lookup_grouped(bad, offsets, [0, 6])
    np.testing.assert_array_equal(table.to_numpy(), before)


def test_lookups_of_windows_of_one_source_into_the_columns_of_one_output(rng):
    """``lookup_windows_into`` (a collection's forward on a KeyedJaggedTensor):
    each (table, first bag, bags, combiner) window of one CSR source lands in
    its table's columns, bit for bit as the table's own lookup of those bags;
    a window or shape that does not fit raises before anything is written, a
    bad id names its table and its position in the window."""
    from embedcore import _embedcore

    t1 = ec.Table(name="a", rows=30, dim=3, combiner="mean")
    t2 = ec.Table(name="b", rows=40, dim=5, combiner="sum")
    lengths = np.array([2, 0, 5, 1, 3, 0, 4, 2, 2])  # 3 features x 3 bags
    offsets = np.r_[0, np.cumsum(lengths)].astype(np.int64)
    ids = rng.integers(0, 30, int(offsets[-1]))
    w = rng.random(len(ids)).astype(np.float32)
    windows = [(t1._native, 0, 3, 1), (t2._native, 6, 3, 2), (t1._native, 3, 3, 0)]
    out = np.full((3, 11), -7.0, np.float32)
    _embedcore.lookup_windows_into(ids, offsets, w, windows, out)
    for (t, first, cols, comb) in ((t1, 0, slice(0, 3), "mean"), (t2, 6, slice(3, 8), "sqrtn"),
                                   (t1, 3, slice(8, 11), "sum")):
        lo, hi = offsets[first], offsets[first + 3]
        want = t.lookup(ids[lo:hi], offsets[first:first + 4] - lo, weights=w[lo:hi], combiner=comb)
        assert np.array_equal(out[:, cols], want)

    out[:] = -7.0
    bad = ids.copy()
    bad[offsets[6] + 1] = 40  # the second id of t2's window
    with pytest.raises(IndexError, match="table 'b': id 40 at position 1"):
        _embedcore.lookup_windows_into(bad, offsets, w, windows, out)
    out[:] = -7.0
    for wins, message in (
            (windows[:1], "add up to 3, out has 11 columns"),
            ([windows[0], (t2._native, 6, 2, 2), windows[2]], "window 1 has 2 bags, out has 3 rows"),
            ([(t1._native, 0, 3, 3), windows[1], windows[2]], "window 0 is not pooled"),
            ([(t1._native, 7, 3, 1), windows[1], windows[2]], "3 bags from bag 7 are not within the source's 9 bags"),
            ([(t1._native, -1, 3, 1), windows[1], windows[2]], "3 bags from bag -1")):
        with pytest.raises(ValueError, match=message):
            _embedcore.lookup_windows_into(ids, offsets, w, wins, out)
    broken = offsets.copy()
    broken[3] = 100
    with pytest.raises(ValueError, match=r"offsets\[0\] = 0 and offsets\[3\] = 100 do not bound ids of the 19 given"):
        _embedcore.lookup_windows_into(ids, broken, w, windows, out)
    with pytest.raises(ValueError, match="overlaps the values of table 'a'"):
        in_table = t1._native.values_mut().reshape(-1)[:33].reshape(3, 11)
        _embedcore.lookup_windows_into(ids, offsets, w, windows, in_table)
    with pytest.raises(ValueError, match="out"):
        _embedcore.lookup_windows_into(ids, offsets, out.reshape(-1)[:19], windows, out)
    assert (out == -7.0).all()


def test_empty_result_is_the_engines_result_memory():
    """``_embedcore.empty_result``: a float32 [rows, cols] array of the
    engine's result memory (the collections' one-call outputs), whose freed
    blocks the next result of a loop reuses; bad sizes are refused."""
    from embedcore import _embedcore

    a = _embedcore.empty_result(4096, 416)
    assert a.shape == (4096, 416) and a.dtype == np.float32 and a.flags.c_contiguous and a.flags.writeable
    a[:] = 1.5
    address = a.__array_interface__["data"][0]
    del a
    b = _embedcore.empty_result(4096, 416)
    assert b.__array_interface__["data"][0] == address  # the freed block, kept
    assert _embedcore.empty_result(0, 7).shape == (0, 7)
    with pytest.raises(ValueError, match="-1 x 3"):
        _embedcore.empty_result(-1, 3)
