"""A table of more than 2**31 elements. Its memory is mapped lazily and a
Zeros table touches none of it, so this is cheap and runs by default; it is
skipped (with the reason) only where the mapping itself fails."""
import numpy as np
import pytest

import embedcore as ec

ROWS = 2**31 + 16


@pytest.fixture(scope="module")
def big():
    try:
        return ec.Table(name="big", rows=ROWS, dim=1, dtype="float16", initializer=ec.initializers.Zeros(),
                        optimizer=ec.optimizers.SGD(learning_rate=0.5), combiner="sum")
    except MemoryError as e:
        pytest.skip(f"cannot map a {ROWS * 2 / 2**30:.1f} GiB table here (MemoryError: {e})")


def test_lookup_and_update_beyond_2_31(big):
    assert big.rows == ROWS and big.values().shape == (ROWS, 1)
    ids = np.array([ROWS - 6, ROWS - 1, 2**31, 2**31 - 1, 3, ROWS - 6], np.int64)
    offsets = np.array([0, 2, 3, 6])
    np.testing.assert_array_equal(big.lookup(ids, offsets), np.zeros((3, 1), np.float32))
    grads = np.array([[1.0], [2.0], [4.0]], np.float32)
    big.apply_gradients(ids, offsets, grads)
    # SGD, sum combiner: row r moves by -0.5 * (sum of its bags' grads, once per occurrence).
    expected = {ROWS - 6: -0.5 * (1 + 4), ROWS - 1: -0.5, 2**31: -1.0, 2**31 - 1: -2.0, 3: -2.0}
    for r, v in expected.items():
        assert big.to_numpy(r, 1)[0, 0] == v, r
        assert big.values()[r, 0] == np.float16(v), r
    flat = big.lookup(ids, combiner=None)
    np.testing.assert_array_equal(flat[:, 0], [expected[int(i)] for i in ids])
    # Neighbours are untouched.
    np.testing.assert_array_equal(big.to_numpy(ROWS - 16, 16)[:, 0],
                                  [expected.get(r, 0.0) for r in range(ROWS - 16, ROWS)])
    np.testing.assert_array_equal(big.to_numpy(2**31 - 2, 4)[:, 0], [0.0, -2.0, -1.0, 0.0])


def test_int32_ids_reach_the_top_of_their_range(big):
    out = big.lookup(np.array([2**31 - 1, 0], np.int32), combiner=None)
    assert out.shape == (2, 1)
    assert out[0, 0] == big.to_numpy(2**31 - 1, 1)[0, 0]


def test_assign_and_errors_at_the_end(big):
    big.assign(np.array([[7.0], [8.0]], np.float32), start_row=ROWS - 2)
    np.testing.assert_array_equal(big.lookup(np.array([ROWS - 2, ROWS - 1])), [[7.0], [8.0]])
    with pytest.raises(IndexError) as e:
        big.lookup(np.array([ROWS], np.int64))
    assert str(ROWS) in str(e.value)
    with pytest.raises(IndexError):
        big.assign(np.zeros((3, 1), np.float32), start_row=ROWS - 2)


def test_mean_and_sqrtn_of_a_bag_of_more_than_2_24_ids():
    """Without weights, mean and sqrtn divide by the count (float(n),
    sqrt(n)), as torch's embedding_bag and TensorFlow's sparse_segment_mean:
    a float32 sum of ones stops at 2**24, and a bag of 3 * 2**23 + 1 ids
    came out 1.5 times too large, in lookups and in the step's coefficient."""
    torch = pytest.importorskip("torch")
    n = 3 * 2**23 + 1
    ids = np.empty(n, np.int32)
    ids[:-1] = np.tile(np.array([0, 1, 2], np.int32), 2**23)
    ids[-1] = 3  # the running sum of the rows is 1, 2, 0, ... exactly; in all 1000
    offsets = np.array([0, n], np.int64)
    values = np.array([[1.0], [1.0], [-2.0], [1000.0]], np.float32)
    t = ec.Table(name="t", rows=4, dim=1, optimizer=ec.optimizers.SGD(1.0))
    t.assign(values)
    assert t.lookup(ids, offsets, combiner="sum")[0, 0] == 1000.0
    want_mean = torch.nn.functional.embedding_bag(torch.from_numpy(ids.astype(np.int64)), torch.from_numpy(values),
                                                  torch.tensor([0]), mode="mean")[0, 0].item()
    assert t.lookup(ids, offsets, combiner="mean")[0, 0] == np.float32(want_mean) == np.float32(1000) / np.float32(n)
    assert t.lookup(ids, offsets, combiner="mean")[0, 0] == t.lookup_sparse_segment(ids, offsets, "mean")[0, 0]
    assert t.lookup(ids, offsets, combiner="sqrtn")[0, 0] == np.float32(1000) / np.float32(np.sqrt(n))
    # The step: row 3, looked up once, moves by its coefficient 1 / n (SGD, learning rate 1, gradient 1).
    t.assign(np.zeros((1, 1), np.float32), 3)
    t.apply_gradients(ids, offsets, np.ones((1, 1), np.float32), combiner="mean")
    assert t.values()[3, 0] == -(np.float32(1) / np.float32(n))
