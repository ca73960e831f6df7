"""Initializers: ranges, sample statistics, seeds, storage rounding and the default."""
import math
import re
import zlib

import numpy as np
import pytest

import embedcore as ec
import reference as ref
from helpers import DTYPES

init = ec.initializers


def _values(initializer, rows=200, dim=64, dtype="float32"):
    t = ec.Table(name="init", rows=rows, dim=dim, dtype=dtype, initializer=initializer)
    return t.to_numpy().astype(np.float64)


@pytest.mark.parametrize("dtype", DTYPES)
def test_zeros(dtype):
    v = _values(init.Zeros(), dtype=dtype)
    assert np.all(v == 0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("value", [0.37, -2.5, 0.0, 1e-3])
def test_constant(dtype, value):
    v = _values(init.Constant(value), rows=20, dim=9, dtype=dtype)
    assert np.all(v == ref.quantize(value, dtype))


def test_constant_default_is_zero():
    assert np.all(_values(init.Constant(), rows=5, dim=3) == 0)


@pytest.mark.parametrize("low,high", [(-0.05, 0.05), (2.0, 5.0), (-3.0, -1.0)])
def test_uniform_range_and_moments(low, high):
    v = _values(init.Uniform(low, high, seed=3))
    n = v.size
    assert v.min() >= np.float32(low) and v.max() < np.float32(high)  # [low, high)
    width = high - low
    # mean within 5 standard errors; variance of U(a, b) is (b - a)^2 / 12
    assert abs(v.mean() - (low + high) / 2) < 5 * width / math.sqrt(12 * n)
    assert abs(v.std() - width / math.sqrt(12)) < 0.03 * width / math.sqrt(12)
    # Values spread over the whole range.
    assert v.min() < low + 0.01 * width and v.max() > high - 0.01 * width
    hist, _ = np.histogram(v, bins=10, range=(low, high))
    assert hist.min() > 0.8 * n / 10


@pytest.mark.parametrize("dtype", DTYPES)
def test_uniform_stays_below_high_in_every_storage_dtype(dtype):
    """[low, high) holds for the stored values: a float32 draw just below
    `high` must not round up to `high` in a float16 / bfloat16 table."""
    v = _values(init.Uniform(0.0, 1.0, seed=1), rows=20000, dim=10, dtype=dtype)
    assert v.min() >= 0.0
    assert np.count_nonzero(v >= 1.0) == 0, f"{np.count_nonzero(v >= 1.0)} values equal high"


def test_uniform_default_range():
    u = init.Uniform()
    assert (u.low, u.high) == (-0.05, 0.05)
    v = _values(u)
    assert v.min() >= np.float32(-0.05) and v.max() <= np.float32(0.05)


@pytest.mark.parametrize("dim", [16, 100])
def test_normal_default_stddev(dim):
    v = _values(init.Normal(seed=5), rows=20000 // dim * 4, dim=dim)
    sigma = 1 / math.sqrt(dim)
    n = v.size
    assert abs(v.mean()) < 5 * sigma / math.sqrt(n)
    assert abs(v.std() / sigma - 1) < 0.03
    # An untruncated normal goes beyond two standard deviations about 4.55% of the time.
    assert abs(np.mean(np.abs(v) > 2 * sigma) - 0.0455) < 0.01
    assert abs(np.mean(np.abs(v) < sigma) - 0.6827) < 0.02


def test_normal_mean_and_stddev():
    v = _values(init.Normal(mean=1.5, stddev=0.2, seed=1))
    assert abs(v.mean() - 1.5) < 5 * 0.2 / math.sqrt(v.size)
    assert abs(v.std() / 0.2 - 1) < 0.03


@pytest.mark.parametrize("dim", [4, 64])
def test_truncated_normal_default(dim):
    v = _values(init.TruncatedNormal(seed=2), rows=40000 // dim, dim=dim)
    sigma = 1 / math.sqrt(dim)
    assert np.all(np.abs(v) <= 2 * sigma * (1 + 1e-6))
    # Standard deviation of a normal truncated at +-2 sigma: 0.8796 sigma.
    phi2 = math.exp(-2.0) / math.sqrt(2 * math.pi)
    z = math.erf(2 / math.sqrt(2))
    trunc_std = sigma * math.sqrt(1 - 2 * 2 * phi2 / z)
    assert abs(trunc_std / sigma - 0.8796) < 1e-3
    assert abs(v.mean()) < 5 * trunc_std / math.sqrt(v.size)
    assert abs(v.std() / trunc_std - 1) < 0.03
    # Not clipped: nothing piles up at the bounds.
    assert np.mean(np.abs(v) > 1.99 * sigma) < 0.002


def test_truncated_normal_mean_and_stddev():
    v = _values(init.TruncatedNormal(mean=-1.0, stddev=0.5, seed=9))
    assert np.all(np.abs(v + 1.0) <= 1.0 * (1 + 1e-6))
    assert abs(v.mean() + 1.0) < 0.01
    assert abs(v.std() / (0.5 * 0.8796) - 1) < 0.03


@pytest.mark.parametrize("make", [lambda s: init.Uniform(-1, 1, seed=s), lambda s: init.Normal(seed=s),
                                  lambda s: init.TruncatedNormal(seed=s)])
def test_seeds(make):
    a = _values(make(17), rows=50, dim=8)
    b = _values(make(17), rows=50, dim=8)
    c = _values(make(18), rows=50, dim=8)
    assert a.tobytes() == b.tobytes()
    assert not np.any(a == c) or np.mean(a == c) < 0.01
    # rows and columns differ from each other
    assert len(np.unique(a)) > 0.99 * a.size


@pytest.mark.parametrize("seed", [np.int64(850), np.int32(7), np.uint64(2**64 - 1), np.uint8(3)])
def test_numpy_integer_seeds_are_taken_as_their_int(seed):
    """A seed drawn by NumPy (rng.integers) is taken, as every other int
    argument takes NumPy's integers ("must be an int, got 850" before), and
    gives the values of the same Python int; a bool or a float is not a
    seed."""
    i = init.Uniform(-1, 1, seed=seed)
    assert type(i.seed) is int and i.seed == int(seed)
    assert _values(i, rows=10, dim=4).tobytes() == _values(init.Uniform(-1, 1, seed=int(seed)), rows=10,
                                                            dim=4).tobytes()
    for bad in (True, np.bool_(True), 3.0, np.float64(3)):
        with pytest.raises(TypeError, match=re.escape(f"initializer seed must be an int, got {bad!r}")):
            init.Normal(seed=bad)


def test_large_seed():
    a = _values(init.Uniform(seed=2**64 - 1), rows=10, dim=4)
    b = _values(init.Uniform(seed=2**63), rows=10, dim=4)
    assert not np.array_equal(a, b)


def test_element_is_a_function_of_its_index():
    """The first rows of a bigger table equal a smaller table with the same seed."""
    for i in (init.Uniform(seed=4), init.Normal(seed=4), init.TruncatedNormal(seed=4)):
        small = _values(i, rows=10, dim=8)
        big = _values(i, rows=5000, dim=8)
        assert small.tobytes() == big[:10].tobytes()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("make", [lambda: init.Uniform(-3, 3, seed=1), lambda: init.TruncatedNormal(seed=1),
                                  lambda: init.Normal(stddev=1e-4, seed=1)])
def test_low_precision_initial_values_are_rounded_float32(dtype, make):
    f32 = ec.Table(name="a", rows=64, dim=13, initializer=make()).values()
    low = ec.Table(name="b", rows=64, dim=13, dtype=dtype, initializer=make()).values()
    np_dtype = np.float16 if dtype == "float16" else ref.bfloat16_dtype()
    rounded = f32.astype(np_dtype)
    # (A Uniform value that would round up to `high` is kept below it instead;
    # test_uniform_stays_below_high_in_every_storage_dtype checks those.)
    keep = ~((rounded.astype(np.float32) >= 3.0) & isinstance(make(), init.Uniform))
    np.testing.assert_array_equal(low.view(np.uint16)[keep], rounded.view(np.uint16)[keep])


def test_default_initializer_is_truncated_normal():
    cfg = ec.TableConfig(name="t", rows=300, dim=25)
    assert isinstance(cfg.initializer, init.TruncatedNormal)
    assert cfg.initializer.stddev is None and cfg.initializer.mean == 0.0
    default = ec.Table(cfg).values()
    seed = zlib.crc32(b"t") & 0x7FFFFFFF  # seeded by the table's name
    explicit = ec.Table(name="t", rows=300, dim=25, initializer=init.TruncatedNormal(seed=seed)).values()
    assert default.tobytes() == explicit.tobytes()
    assert np.all(np.abs(default) <= 2 / 5 * (1 + 1e-6))
    assert abs(default.std() / (0.2 * 0.8796) - 1) < 0.05


def test_default_tables_start_with_rows_of_their_own():
    """Every table without initializer= had TruncatedNormal(seed=0): two
    tables of one dim started with the same rows (every feature's embedding
    of id k the same vector; another dim, the same draws scaled), where
    TensorFlow draws each table on its own. The seed is now the table's
    name's: tables differ, a table of one name starts the same in every run
    (and on every rank), and an Embedding's unnamed tables are seeded by
    the names it gives them ("table_0", "table_1")."""
    user, item = ec.Table(name="user", rows=1000, dim=16), ec.Table(name="item", rows=1000, dim=16)
    wide = ec.Table(name="wide", rows=1000, dim=8)
    assert not np.array_equal(user.values(), item.values())
    assert abs(np.corrcoef(wide.values().ravel(), item.values().ravel()[:8000])[0, 1]) < 0.05
    assert ec.Table(name="user", rows=1000, dim=16).values().tobytes() == user.values().tobytes()
    emb = ec.Embedding({"a": ec.FeatureConfig(ec.TableConfig(rows=50, dim=4)),
                        "b": ec.FeatureConfig(ec.TableConfig(rows=50, dim=4))})
    a, b = (t.values() for t in emb.embedding_tables.values())
    assert not np.array_equal(a, b)
    assert a.tobytes() == ec.Table(name="table_0", rows=50, dim=4).values().tobytes()


def test_initializers_do_not_depend_on_thread_count(restore_threads):
    out = {}
    for n in (1, 2, 4):
        ec.set_num_threads(n)
        out[n] = [ec.Table(name="t", rows=3000, dim=33, dtype=d, initializer=i).values().tobytes()
                  for d in ("float32", "bfloat16")
                  for i in (init.Uniform(seed=8), init.Normal(seed=8), init.TruncatedNormal(seed=8),
                            init.Constant(0.5))]
    assert out[1] == out[2] == out[4]


def test_initializer_validation():
    with pytest.raises(ValueError):
        init.Uniform(1.0, 0.0)
    with pytest.raises(ValueError):
        init.Normal(stddev=0.0)
    with pytest.raises(ValueError):
        init.TruncatedNormal(stddev=-1.0)
    with pytest.raises(ValueError):
        init.Constant(float("nan"))
    with pytest.raises(ValueError):
        init.Uniform(0.0, float("inf"))
    with pytest.raises(ValueError):
        init.Normal(seed=-1)
    with pytest.raises(ValueError):
        init.Normal(seed=2**64)
    with pytest.raises(TypeError):
        init.Uniform(seed=1.5)
    with pytest.raises(TypeError):
        init.Constant("a")
    with pytest.raises(TypeError):
        ec.TableConfig(name="t", rows=3, dim=2, initializer="zeros")


def test_initializer_equality():
    assert init.Uniform(0, 1, seed=2) == init.Uniform(0, 1, seed=2)
    assert init.Uniform(0, 1, seed=2) != init.Uniform(0, 1, seed=3)
    assert hash(init.Normal(seed=1)) == hash(init.Normal(seed=1))
    assert init.Normal(seed=1) != init.TruncatedNormal(seed=1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("make", [lambda: ec.initializers.Uniform(-1, 1, seed=3),
                                  lambda: ec.initializers.TruncatedNormal(0, 1, seed=5),
                                  lambda: ec.initializers.Constant(0.25), lambda: ec.initializers.Zeros()])
def test_reset_values_gives_the_values_at_creation(dtype, make):
    # 70000 x 300 float32 is 80 MiB: more than one 64 MiB block of the reset.
    t = ec.Table(name="x", rows=70000, dim=300, dtype=dtype, initializer=make(),
                 optimizer=ec.optimizers.Adagrad(0.1, initial_accumulator_value=0.5))
    built = t.values().view(np.uint8).copy()
    t.assign(np.full((70000, 300), 0.5, np.float32))
    t.assign_slot("accumulators", np.full((3, 300), 2.0, np.float32))
    t.reset_values()
    np.testing.assert_array_equal(t.values().view(np.uint8), built)
    assert t.slots()["accumulators"][0, 0] == 2.0 and t.slots()["accumulators"][3, 0] == 0.5  # slots stay
    shard = ec.Table._shard(t.config, 1000, 100, 500, 150)  # a shard resets to its block of the whole table
    shard.assign(np.zeros((1000, 100), np.float32))
    shard.reset_values()
    np.testing.assert_array_equal(shard.values().view(np.uint8), built.reshape(70000, -1)[500:1500].reshape(
        1000, 300, -1)[:, 150:250].reshape(1000, -1))


# ------------------------------------------------------------------ values beyond the table's dtype
@pytest.mark.parametrize("dtype,make,message", [
    ("float16", lambda: init.Constant(70000.0),
     r"table 't': initializer Constant\(value=70000\) gives values up to 70000 in magnitude \(\|value\|\), which "
     r"round to infinity in its dtype float16 \(largest finite value 65504\)"),
    ("float16", lambda: init.Uniform(-1e5, 1e5, seed=0),
     r"Uniform\(low=-100000, high=100000\) gives values up to 100000 in magnitude \(max\(\|low\|, \|high\|\)\)"),
    ("float32", lambda: init.Normal(0, 1e38),
     r"Normal\(mean=0, stddev=1e\+38\) gives values up to 8.65216132e\+38 in magnitude \(\|mean\| \+ 8.65216132 "
     r"stddev, the largest of its normal draws\), which round to infinity in its dtype float32"),
    ("float32", lambda: init.Constant(1e300), r"Constant\(value=1e\+300\)"),
    ("bfloat16", lambda: init.TruncatedNormal(0, 1.7e38), r"\(\|mean\| \+ 2 stddev\), which round to infinity in its "
                                                          r"dtype bfloat16"),
])
def test_an_initializer_beyond_the_dtype_is_refused(dtype, make, message):
    """Was: the table started with infinite rows (assign refuses the same
    values, and the table's checkpoint could not be saved)."""
    with pytest.raises(ValueError, match=message):
        ec.Table(name="t", rows=1000, dim=2, dtype=dtype, initializer=make())
    cfg = ec.TableConfig("t", 1000, 2, dtype, make())
    with pytest.raises(ValueError, match=message):
        ec.Embedding({"f": ec.FeatureConfig(cfg)})


@pytest.mark.parametrize("dtype,make", [
    ("float16", lambda: init.Constant(65519.0)),  # rounds to 65504
    ("float16", lambda: init.Uniform(-65504, 65504, seed=2)),
    ("float16", lambda: init.TruncatedNormal(65000, 250, seed=2)),
    ("float16", lambda: init.Normal(65000, 60, seed=2)),  # 65000 + 8.6522 * 60 = 65519.1
    ("bfloat16", lambda: init.Constant(70000.0)),
    ("float32", lambda: init.Normal(0, 3.4e38 / 8.652161319605298, seed=2)),
])
def test_an_initializer_within_the_dtype_is_taken(dtype, make):
    t = ec.Table(name="t", rows=5000, dim=4, dtype=dtype, initializer=make())
    assert np.isfinite(t.to_numpy()).all()


def test_the_refusal_reaches_every_rank_and_the_adapters():
    from embedcore.distributed import RankFailedError, run_local

    def build(world):
        try:
            ec.Embedding({"f": ec.FeatureConfig(ec.TableConfig("t", 100, 6, "float16", init.Constant(1e5))),
                          "g": ec.FeatureConfig(ec.TableConfig("u", 100, 6))}, world=world, sharding="table_wise")
        except (ValueError, RankFailedError) as e:
            return type(e).__name__, str(e)
        return None

    results = run_local(2, build)
    assert all(r is not None and "initializer Constant(value=100000)" in r[1] for r in results), results
    assert "ValueError" in [kind for kind, _ in results]


def test_the_torch_and_tf_adapters_refuse_it():
    torch = pytest.importorskip("torch")
    from embedcore.adapters import torch as ect

    with pytest.raises(ValueError, match=r"table 'embedding_bag': initializer Constant\(value=70000\)"):
        ect.EmbeddingBag(10, 4, dtype=torch.float16, initializer=init.Constant(70000.0))
    tf = pytest.importorskip("tensorflow")
    from embedcore.adapters.tf import Embedding

    layer = Embedding(10, 4, initializer=tf.keras.initializers.Constant(1e300))
    with pytest.raises(ValueError, match=r"initializer Constant\(value=1e\+300\) gives values up to 1e\+300"):
        layer(np.array([[1]]))
