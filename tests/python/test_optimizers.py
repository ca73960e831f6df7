"""Sparse optimizer steps against the NumPy reference (values, slots, step),
the backward of every combiner and sequence form, low-precision tables, and
determinism across thread counts."""
import numpy as np
import pytest

import embedcore as ec
import reference as ref
from helpers import COMBINERS, assert_close, make_table, random_bags, snapshot, state_bytes

RTOL, ATOL = 1e-5, 1e-6

_CLASSES = {"sgd": ec.optimizers.SGD, "adagrad": ec.optimizers.Adagrad, "adam": ec.optimizers.Adam,
            "ftrl": ec.optimizers.FTRL, "rowwise_adagrad": ec.optimizers.RowWiseAdagrad}


def make_optimizer(kind, **kw):
    """The engine's optimizer and the reference's, from the same arguments
    (row-wise Adagrad's defaults, FBGEMM's, given to the reference)."""
    opt = _CLASSES[kind](**kw)
    if kind == "rowwise_adagrad":
        kw = {"epsilon": opt.epsilon, "initial_accumulator_value": opt.initial_accumulator_value, **kw}
    return opt, ref.OptimizerRef(kind, **kw)


def _decay(step):
    return 0.2 / (1.0 + step)


CASES = {
    "sgd": ("sgd", dict(learning_rate=0.1)),
    "sgd_clip_weight": ("sgd", dict(learning_rate=0.3, clip_weight_min=-0.4, clip_weight_max=0.35)),
    "sgd_clipvalue": ("sgd", dict(learning_rate=0.1, clipvalue=0.3)),
    "sgd_clipvalue_pair": ("sgd", dict(learning_rate=0.1, clipvalue=(-0.1, 0.4))),
    "sgd_weight_decay": ("sgd", dict(learning_rate=0.1, weight_decay_factor=0.05)),
    "sgd_weight_decay_lr": ("sgd", dict(learning_rate=0.1, weight_decay_factor=0.5,
                                        multiply_weight_decay_factor_by_learning_rate=True)),
    "sgd_callable_lr": ("sgd", dict(learning_rate=_decay)),
    "adagrad": ("adagrad", dict(learning_rate=0.1)),
    "adagrad_initial_acc": ("adagrad", dict(learning_rate=0.2, initial_accumulator_value=2.0, clipvalue=0.5)),
    # epsilon outside the root (torch.optim.Adagrad's eps): 0.1 is far from
    # sqrt(a + eps) for these accumulators; 0 accumulators as torch's default.
    "adagrad_epsilon": ("adagrad", dict(learning_rate=0.1, epsilon=0.1)),
    "adagrad_epsilon_zero_acc": ("adagrad", dict(learning_rate=0.2, epsilon=0.1, initial_accumulator_value=0.0,
                                                 clipvalue=0.5)),
    "adagrad_decay_clip": ("adagrad", dict(learning_rate=_decay, weight_decay_factor=0.3,
                                           multiply_weight_decay_factor_by_learning_rate=True,
                                           clip_weight_min=-0.5, clip_weight_max=0.5)),
    "rowwise_adagrad": ("rowwise_adagrad", dict(learning_rate=0.1)),
    "rowwise_adagrad_initial_acc": ("rowwise_adagrad", dict(learning_rate=0.2, initial_accumulator_value=0.5,
                                                            epsilon=0.0, clipvalue=(-0.4, 0.6))),
    "rowwise_adagrad_decay_clip": ("rowwise_adagrad", dict(learning_rate=_decay, weight_decay_factor=0.3,
                                                           multiply_weight_decay_factor_by_learning_rate=True,
                                                           clip_weight_min=-0.5, clip_weight_max=0.5,
                                                           epsilon=1e-3)),
    "adam": ("adam", dict(learning_rate=0.05)),
    "adam_non_lazy": ("adam", dict(learning_rate=0.05, lazy_adam=False)),
    "adam_sum_outside_sqrt": ("adam", dict(learning_rate=0.05, sum_inside_sqrt=False, epsilon=1e-3)),
    "adam_bias_correction": ("adam", dict(learning_rate=0.05, bias_correction=True, sum_inside_sqrt=False,
                                          epsilon=1e-8)),
    "adam_bias_correction_inside": ("adam", dict(learning_rate=0.05, bias_correction=True, beta_1=0.8,
                                                 beta_2=0.99)),
    "adam_non_lazy_bias_correction": ("adam", dict(learning_rate=0.05, lazy_adam=False, bias_correction=True)),
    # Non-lazy: every row takes the full step, untouched ones with a zero
    # gradient, weight decay and clipping included.
    "adam_non_lazy_decay_clip": ("adam", dict(learning_rate=0.05, lazy_adam=False, weight_decay_factor=0.05,
                                              clipvalue=(-0.5, 0.3), clip_weight_min=-0.7, clip_weight_max=0.6)),
    "adam_callable_clip": ("adam", dict(learning_rate=_decay, clipvalue=(-0.5, 0.3), clip_weight_max=0.6,
                                        weight_decay_factor=0.01)),
    "ftrl": ("ftrl", dict(learning_rate=0.1)),
    "ftrl_power": ("ftrl", dict(learning_rate=0.1, learning_rate_power=-0.3)),
    "ftrl_power_zero": ("ftrl", dict(learning_rate=0.1, learning_rate_power=0.0, initial_accumulator_value=0.5)),
    "ftrl_l1_l2": ("ftrl", dict(learning_rate=0.1, l1_regularization_strength=0.3,
                                l2_regularization_strength=0.2)),
    "ftrl_beta": ("ftrl", dict(learning_rate=0.2, beta=0.5, l2_regularization_strength=0.1,
                               initial_accumulator_value=0.4)),
    "ftrl_multiply_linear": ("ftrl", dict(learning_rate=0.1, multiply_linear_by_learning_rate=True,
                                          l1_regularization_strength=0.3, l2_regularization_strength=0.2,
                                          beta=0.3)),
    "ftrl_multiply_linear_power": ("ftrl", dict(learning_rate=0.2, learning_rate_power=-0.7,
                                                multiply_linear_by_learning_rate=True,
                                                l1_regularization_strength=0.05)),
    "ftrl_multiply_linear_callable": ("ftrl", dict(learning_rate=_decay, multiply_linear_by_learning_rate=True,
                                                   l2_regularization_strength=0.1)),
    "adam_bias_correction_callable": ("adam", dict(learning_rate=_decay, bias_correction=True)),
    "ftrl_callable_clip": ("ftrl", dict(learning_rate=_decay, clipvalue=0.8, clip_weight_min=-0.3,
                                        weight_decay_factor=0.02)),
}


def column_signed_grads(rng, shape):
    """Gradients whose sign is fixed per column within a step (it varies
    between columns and steps): with positive weights, a row's summed gradient
    has no cancellation, so the float32 sum the engine makes stays within a few
    ulps of the float64 reference. (Adam's first step from a summed gradient
    that cancels to ~epsilon amplifies any rounding without bound; that is
    arithmetic, not semantics.)"""
    sign = rng.choice([-1.0, 1.0], size=shape[-1])
    return (sign * rng.uniform(0.1, 2.0, size=shape)).astype(np.float32)


def _compare(table, tref, what=""):
    assert table.step == tref.step, what
    assert_close(table.to_numpy(), tref.values, RTOL, ATOL, f"{what} values")
    slots = table.slots()
    assert set(slots) == set(tref.slots), what
    for k, v in tref.slots.items():
        # A slot that accumulates signed terms (FTRL's linears) may cancel to
        # near 0 from terms of a few units: allow a few float32 ulps of the
        # slot's scale.
        assert_close(slots[k], v, RTOL, ATOL * max(1.0, float(np.abs(v).max(initial=0))), f"{what} slot {k}")


def _check_untouched(table, before, touched, tref):
    if tref.opt.kind == "adam" and not tref.opt.lazy_adam:
        return
    after = snapshot(table)
    keep = ~touched
    np.testing.assert_array_equal(after["values"][keep], before["values"][keep])
    for k in before["slots"]:
        np.testing.assert_array_equal(after["slots"][k][keep], before["slots"][k][keep])


@pytest.mark.parametrize("combiner", COMBINERS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_pooled_steps_match_reference(rng, case, combiner):
    kind, kw = CASES[case]
    opt, ropt = make_optimizer(kind, **kw)
    rows, dim = 40, 7
    table = make_table(rows, dim, optimizer=opt, combiner=combiner, seed=int(rng.integers(1 << 30)))
    tref = ref.TableRef(table.to_numpy(), ropt)
    _compare(table, tref, "initial")
    for step in range(4):
        ids, offsets, w = random_bags(rng, rows, 12, weighted=step % 2 == 1,
                                      id_dtype=np.int32 if step % 2 else np.int64)
        grads = column_signed_grads(rng, (12, dim))
        before = snapshot(table)
        table.apply_gradients(ids, offsets, grads, weights=w)
        rg = tref.row_grads().add_pooled(ids, offsets, w, combiner, grads)
        tref.apply(rg)
        _compare(table, tref, f"step {step}")
        _check_untouched(table, before, rg.touched, tref)


@pytest.mark.parametrize("kind", ["sgd", "adagrad", "adam", "ftrl"])
def test_repeated_ids_are_summed_before_one_update(kind):
    opt, ropt = make_optimizer(kind, learning_rate=0.1)
    table = make_table(10, 4, optimizer=opt, combiner="sum")
    tref = ref.TableRef(table.to_numpy(), ropt)
    # id 3 appears three times in one bag and once in another; id 5 once.
    ids = np.array([3, 3, 5, 3, 3], np.int64)
    offsets = np.array([0, 3, 5])
    grads = np.array([[1.0, -2.0, 0.5, 3.0], [0.25, 1.0, -1.0, 2.0]], np.float32)
    table.apply_gradients(ids, offsets, grads)
    rg = tref.row_grads().add_pooled(ids, offsets, None, "sum", grads)
    np.testing.assert_allclose(rg.grad[3], 2 * grads[0] + 2 * grads[1])
    tref.apply(rg)
    _compare(table, tref)
    if kind != "sgd":
        # Four updates with the separate gradients would give something else.
        other = ref.TableRef(make_table(10, 4).to_numpy(), ropt)
        for k in range(4):
            b = 0 if k < 2 else 1
            other.apply(other.row_grads().add([3], grads[b][None]))
        assert not np.allclose(other.values[3], tref.values[3], rtol=1e-4)


@pytest.mark.parametrize("kind", ["sgd", "adagrad"])
@pytest.mark.parametrize("length", [0, 2, 4])
def test_sequence_backward(rng, kind, length):
    """combiner=None: flat [nnz, dim] (length 0) and padded [batch, L, dim]
    gradients; ids truncated beyond L are not updated."""
    opt, ropt = make_optimizer(kind, learning_rate=0.1)
    rows, dim = 50, 6
    table = make_table(rows, dim, optimizer=opt)
    tref = ref.TableRef(table.to_numpy(), ropt)
    for step in range(3):
        ids, offsets, w = random_bags(rng, rows, 9, max_len=6, weighted=step == 1)
        # Make sure one bag is longer than L and its tail ids appear nowhere else.
        ids = np.concatenate([ids, [47, 48, 49, 46, 45, 44]]).astype(np.int64)
        offsets = np.concatenate([offsets, [offsets[-1] + 6]])
        if w is not None:
            w = np.concatenate([w, np.full(6, 1.5, np.float32)])
        nb = len(offsets) - 1
        shape = (len(ids), dim) if length == 0 else (nb, length, dim)
        grads = rng.normal(size=shape).astype(np.float32)
        before = snapshot(table)
        table.apply_gradients(ids, offsets, grads, weights=w, combiner=None, max_sequence_length=length)
        rg = tref.row_grads()
        if length == 0:
            rg.add_flat(ids, w, grads)
        else:
            rg.add_padded(ids, offsets, w, length, grads)
            # ids at positions >= L in the last bag were not looked up: unchanged.
            for r in (44, 45, 46, 47, 48, 49)[: 6 - length]:
                if not rg.touched[r]:
                    np.testing.assert_array_equal(snapshot(table)["values"][r], before["values"][r])
        tref.apply(rg)
        _compare(table, tref, f"step {step}")
        _check_untouched(table, before, rg.touched, tref)


def test_truncated_ids_are_not_updated():
    opt = ec.optimizers.Adagrad(learning_rate=0.5)
    table = make_table(10, 3, optimizer=opt)
    before = snapshot(table)
    # bag 0 = [1, 2, 9]; with L = 2, id 9 is cut off.
    table.apply_gradients(ec.Ragged(np.array([1, 2, 9]), np.array([0, 3])),
                          grads=np.ones((1, 2, 3), np.float32), combiner=None, max_sequence_length=2)
    after = snapshot(table)
    np.testing.assert_array_equal(after["values"][9], before["values"][9])
    np.testing.assert_array_equal(after["slots"]["accumulators"][9], before["slots"]["accumulators"][9])
    assert not np.array_equal(after["values"][1], before["values"][1])
    assert not np.array_equal(after["values"][2], before["values"][2])


@pytest.mark.parametrize("combiner", [None, "sum", "mean", "sqrtn"])
def test_dense_input_backward(rng, combiner):
    opt, ropt = make_optimizer("adagrad", learning_rate=0.1)
    table = make_table(30, 5, optimizer=opt)
    tref = ref.TableRef(table.to_numpy(), ropt)
    ids = rng.integers(0, 30, size=(7, 3))
    w = rng.uniform(0.5, 2, size=(7, 3)).astype(np.float32)
    out = table.lookup(ids, weights=w, combiner=combiner)
    grads = rng.normal(size=out.shape).astype(np.float32)
    table.apply_gradients(ids, grads=grads, weights=w, combiner=combiner)
    offsets = np.arange(0, 22, 3)
    rg = tref.row_grads()
    if combiner is None:
        rg.add_padded(ids.ravel(), offsets, w.ravel(), 3, grads)
    else:
        rg.add_pooled(ids.ravel(), offsets, w.ravel(), combiner, grads)
    tref.apply(rg)
    _compare(table, tref)


@pytest.mark.parametrize("combiner", [None, "sum", "mean", "sqrtn"])
@pytest.mark.parametrize("shuffled", [False, True])
def test_sparse_input_backward(rng, combiner, shuffled):
    opt, ropt = make_optimizer("adagrad", learning_rate=0.1)
    table = make_table(30, 4, optimizer=opt)
    tref = ref.TableRef(table.to_numpy(), ropt)
    indices = np.array([[0, 0], [0, 3], [1, 1], [1, 1], [3, 0], [3, 2], [3, 4]], np.int64)
    ids = np.array([5, 6, 7, 7, 8, 5, 9], np.int64)
    w = rng.uniform(0.5, 2, size=len(ids)).astype(np.float32)
    if shuffled:
        perm = rng.permutation(len(ids))
        indices, ids, w = indices[perm], ids[perm], w[perm]
    sp, spw = ec.Sparse(indices, ids, [4, 5]), ec.Sparse(indices, w, [4, 5])
    out = table.lookup(sp, weights=spw, combiner=combiner)
    grads = rng.normal(size=out.shape).astype(np.float32)
    table.apply_gradients(sp, grads=grads, weights=spw, combiner=combiner)
    rg = tref.row_grads()
    if combiner is None:
        rg.add_sparse_sequence(indices[:, 0], indices[:, 1], ids, w, 5, grads)
    else:
        order = np.argsort(indices[:, 0], kind="stable")
        offsets = np.concatenate([[0], np.cumsum(np.bincount(indices[:, 0], minlength=4))])
        rg.add_pooled(ids[order], offsets, w[order], combiner, grads)
    tref.apply(rg)
    _compare(table, tref)
    # Truncated sparse sequence: positions >= 2 are dropped.
    tref2 = ref.TableRef(table.to_numpy(), ropt, slots={k: np.array(v) for k, v in table.slots().items()},
                         step=table.step)
    g2 = rng.normal(size=(4, 2, 4)).astype(np.float32)
    table.apply_gradients(sp, grads=g2, weights=spw, combiner=None, max_sequence_length=2)
    tref2.apply(tref2.row_grads().add_sparse_sequence(indices[:, 0], indices[:, 1], ids, w, 2, g2))
    _compare(table, tref2)


def test_zero_denominator_backward():
    """Bags whose mean / sqrtn denominator is 0 pass no gradient (coefficient 0)."""
    opt, ropt = make_optimizer("sgd", learning_rate=1.0)
    table = make_table(10, 3, optimizer=opt, combiner="mean")
    tref = ref.TableRef(table.to_numpy(), ropt)
    ids, offsets = np.array([1, 2, 3]), np.array([0, 2, 3])
    w = np.array([1.0, -1.0, 2.0], np.float32)
    grads = np.ones((2, 3), np.float32)
    table.apply_gradients(ids, offsets, grads, weights=w)
    tref.apply(tref.row_grads().add_pooled(ids, offsets, w, "mean", grads))
    _compare(table, tref)
    np.testing.assert_allclose(table.to_numpy()[3], tref.values[3])


def test_ftrl_l1_zeroes_weights():
    table = make_table(20, 4, optimizer=ec.optimizers.FTRL(learning_rate=0.1, l1_regularization_strength=1e3))
    before = table.to_numpy()
    ids = np.array([1, 5, 5, 9])
    table.apply_gradients(ids, grads=np.ones((4, 4), np.float32), combiner="sum")
    after = table.to_numpy()
    assert np.all(after[[1, 5, 9]] == 0)
    keep = np.ones(20, bool)
    keep[[1, 5, 9]] = False
    np.testing.assert_array_equal(after[keep], before[keep])


def test_weight_clipping_bounds():
    table = make_table(20, 6, optimizer=ec.optimizers.SGD(learning_rate=1.0, clip_weight_min=-0.25,
                                                           clip_weight_max=0.5))
    rng = np.random.default_rng(0)
    ids = np.arange(20)
    table.apply_gradients(ids, grads=rng.normal(size=(20, 6)).astype(np.float32) * 3, combiner="sum")
    v = table.to_numpy()
    assert v.min() == np.float32(-0.25) and v.max() == np.float32(0.5)


@pytest.mark.parametrize("dtype, bounds, refused", [
    ("float16", dict(clip_weight_min=1e5), "clip_weight_min 100000 rounds to infinity in its dtype float16 "
                                           r"\(largest finite value 65504\)"),
    ("float16", dict(clip_weight_max=-7e4), "clip_weight_max -70000 rounds to infinity in its dtype float16"),
    ("bfloat16", dict(clip_weight_min=3.4e38), "clip_weight_min 3.39999995e\\+38 rounds to infinity in its dtype "
                                                "bfloat16"),
    ("float16", dict(clip_weight_min=-1e6, clip_weight_max=1e6), None),  # bounds that never bind: taken
])
def test_weight_clip_bounds_that_round_to_infinity_are_refused(dtype, bounds, refused):
    """A float16 / bfloat16 table refuses a weight clip bound that rounds to
    infinity on the side it binds (every weight it clipped became infinite,
    silently, until a save refused the table), at construction and in
    set_optimizer (the table unchanged), as an initializer whose values would
    round to infinity is."""
    opt = ec.optimizers.SGD(0.1, **bounds)
    if refused is None:
        table = make_table(4, 2, dtype=dtype, optimizer=opt)
        table.apply_gradients(np.array([1]), None, np.ones((1, 2), np.float32))
        assert np.isfinite(table.to_numpy()).all()
        return
    with pytest.raises(ValueError, match=f"table 't': {refused}.* a table holds finite values only"):
        make_table(4, 2, dtype=dtype, optimizer=opt, name="t")
    table = make_table(4, 2, dtype=dtype, optimizer=ec.optimizers.Adagrad(0.1), name="t")
    before = table.to_numpy().copy()
    with pytest.raises(ValueError, match=f"table 't': {refused}"):
        table.set_optimizer(opt)
    assert isinstance(table.optimizer, ec.optimizers.Adagrad) and np.array_equal(table.to_numpy(), before)


def test_zero_clipvalue_freezes_sgd():
    table = make_table(10, 3, optimizer=ec.optimizers.SGD(learning_rate=1.0, clipvalue=0.0))
    before = table.to_numpy()
    table.apply_gradients(np.arange(10), grads=np.ones((10, 3), np.float32))
    np.testing.assert_array_equal(table.to_numpy(), before)
    assert table.step == 1


# ----------------------------------------------------------------- low-precision tables


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("case", ["sgd", "adagrad", "rowwise_adagrad", "adam", "adam_non_lazy", "ftrl_l1_l2",
                                  "sgd_clip_weight"])
def test_low_precision_tables(rng, dtype, case):
    """Each step: the reference from the engine's current state, in float64,
    rounded to the storage dtype, must equal the engine's within one unit in
    the last place of that dtype (slots are float32: rtol 1e-5)."""
    kind, kw = CASES[case]
    opt, ropt = make_optimizer(kind, **kw)
    rows, dim = 40, 13  # 13: both the 8-wide and the scalar conversion paths
    table = make_table(rows, dim, dtype, optimizer=opt, combiner="mean", seed=11)
    ulp = ref.storage_rtol(dtype)
    for step in range(4):
        tref = ref.TableRef(table.to_numpy(), ropt, dtype=dtype,
                            slots={k: np.array(v) for k, v in table.slots().items()}, step=table.step)
        ids, offsets, w = random_bags(rng, rows, 10, weighted=True)
        grads = column_signed_grads(rng, (10, dim))
        before = snapshot(table)
        table.apply_gradients(ids, offsets, grads, weights=w)
        rg = tref.row_grads().add_pooled(ids, offsets, w, "mean", grads)
        tref.apply(rg)
        got = table.to_numpy().astype(np.float64)
        tol = ulp * np.maximum(np.abs(got), np.abs(tref.values)) + 1e-7
        bad = np.abs(got - tref.values) > tol
        assert not bad.any(), (step, np.argwhere(bad)[:3], got[bad][:3], tref.values[bad][:3])
        # Stored values are exactly representable in the storage dtype.
        np.testing.assert_array_equal(ref.quantize(got, dtype), got)
        for k, v in tref.slots.items():
            assert_close(table.slots()[k], v, RTOL, ATOL, f"slot {k}")
        _check_untouched(table, before, rg.touched, tref)


# ----------------------------------------------------------------- slots, learning rate, step


@pytest.mark.parametrize("kind,names", [("sgd", ()), ("adagrad", ("accumulators",)),
                                        ("rowwise_adagrad", ("row_accumulators",)),
                                        ("adam", ("momenta", "velocities")), ("ftrl", ("accumulators", "linears"))])
def test_slot_names_and_initial_values(kind, names):
    kw = {} if kind in ("sgd", "adam") else {"initial_accumulator_value": 0.375}
    opt = _CLASSES[kind](learning_rate=0.1, **kw)
    assert tuple(opt.slot_names) == names
    table = make_table(12, 5, optimizer=opt)
    assert table.slot_names == names
    slots = table.slots()
    assert tuple(slots) == names
    for name, s in slots.items():
        cols = 1 if name == "row_accumulators" else 5
        assert s.shape == (12, cols) and s.dtype == np.float32 and not s.flags.writeable
        expected = 0.375 if "accumulators" in name else 0.0
        assert np.all(s == np.float32(expected)), name


def test_default_initial_accumulator_value():
    for cls in (ec.optimizers.Adagrad, ec.optimizers.FTRL):
        table = make_table(4, 3, optimizer=cls(learning_rate=0.1))
        assert np.all(table.slots()["accumulators"] == np.float32(0.1))


@pytest.mark.parametrize("name", ["SGD", "Adagrad", "Adam", "FTRL"])
def test_defaults_are_tensorflows(name):
    """The optimizers' defaults (learning rate, epsilon, betas, initial
    accumulator, ...) are those of tf.tpu.experimental.embedding's, read from
    TensorFlow's signatures: every parameter the two share has the same
    default (TensorFlow's None for multiply_weight_decay_factor_by_learning_rate
    is our False). A default learning rate or epsilon of another library
    (Keras's Adagrad 0.01, PyTorch's Adam 1e-8) would pass every other test."""
    import inspect

    tf = pytest.importorskip("tensorflow")
    signature = inspect.signature(getattr(tf.tpu.experimental.embedding, name))
    theirs = {k: p.default for k, p in signature.parameters.items()}
    ours = vars(getattr(ec.optimizers, name)())  # the default optimizer as built, every hyper-parameter it holds
    shared = [k for k in theirs if k in ours]
    assert {"learning_rate", "clip_weight_min", "clipvalue"} <= set(shared), shared
    for k in shared:
        assert ours[k] == theirs[k] or (theirs[k] is None and ours[k] is False), (name, k, ours[k], theirs[k])


def test_callable_learning_rate_gets_the_step():
    calls = []

    def lr(step):
        calls.append(step)
        return 0.5 ** step

    table = make_table(5, 2, optimizer=ec.optimizers.SGD(learning_rate=lr),
                       initializer=ec.initializers.Zeros())
    assert table.learning_rate() == 1.0
    for _ in range(3):
        table.apply_gradients(np.array([1]), grads=np.ones((1, 2), np.float32))
    assert table.step == 3
    assert calls[-3:] == [0, 1, 2]
    np.testing.assert_allclose(table.to_numpy()[1], -(1 + 0.5 + 0.25))
    table.step = 10
    assert table.learning_rate() == 0.5 ** 10


@pytest.mark.parametrize("initial", [0.0, 0.1])
def test_adagrad_epsilon_is_torch_s(rng, initial):
    """Adagrad(epsilon=e) steps as torch.optim.Adagrad(eps=e) with the same
    initial accumulator: w -= lr * g / (sqrt(a) + e), the epsilon outside the
    root (the class's docstring). Dense torch gradients of rows the batch
    does not touch are 0, which leave torch's rows as the engine's lazy step
    does; repeated ids are summed, as in torch's embedding_bag backward."""
    torch = pytest.importorskip("torch")
    lr, eps = 0.1, 0.1
    table = make_table(12, 5, optimizer=ec.optimizers.Adagrad(lr, initial_accumulator_value=initial, epsilon=eps),
                       combiner="sum", seed=3)
    weight = torch.nn.Parameter(torch.tensor(table.to_numpy()))
    opt = torch.optim.Adagrad([weight], lr=lr, eps=eps, initial_accumulator_value=initial)
    for step in range(4):
        ids, offsets, _ = random_bags(rng, 10, 6)  # rows 10 and 11 are never touched
        grads = rng.normal(size=(len(offsets) - 1, 5)).astype(np.float32)
        table.apply_gradients(ids, offsets, grads)
        opt.zero_grad()
        out = torch.nn.functional.embedding_bag(torch.from_numpy(ids), weight, torch.from_numpy(offsets[:-1]),
                                                mode="sum", include_last_offset=False)
        out.backward(torch.from_numpy(grads))
        opt.step()
        np.testing.assert_allclose(table.to_numpy(), weight.detach().numpy(), rtol=1e-5, atol=1e-6,
                                   err_msg=f"step {step}")
        np.testing.assert_allclose(table.slots()["accumulators"], opt.state[weight]["sum"].numpy(), rtol=1e-5,
                                   atol=1e-6, err_msg=f"step {step}")


def test_step_feeds_bias_correction(rng):
    opt, ropt = make_optimizer("adam", learning_rate=0.05, bias_correction=True)
    table = make_table(10, 4, optimizer=opt)
    table.step = 7
    tref = ref.TableRef(table.to_numpy(), ropt, step=7)
    ids = np.array([1, 2, 2])
    grads = column_signed_grads(rng, (3, 4))
    table.apply_gradients(ids, grads=grads, combiner="sum")
    tref.apply(tref.row_grads().add_pooled(ids, np.arange(4), None, "sum", grads))
    _compare(table, tref)
    assert table.step == 8


def test_assign_slot_round_trip(rng):
    opt, ropt = make_optimizer("ftrl", learning_rate=0.1)
    table = make_table(10, 3, optimizer=opt)
    lin = rng.normal(size=(4, 3)).astype(np.float32)
    table.assign_slot("linears", lin, start_row=2)
    np.testing.assert_array_equal(table.slots()["linears"][2:6], lin)
    with pytest.raises(ValueError, match=r"table 't' has no slot 'momenta'; its slots are \['accumulators', 'linears'\]"):
        table.assign_slot("momenta", lin)
    # An update continues from the assigned state.
    tref = ref.TableRef(table.to_numpy(), ropt, slots={k: np.array(v) for k, v in table.slots().items()})
    ids = np.array([2, 3, 7])
    grads = rng.normal(size=(3, 3)).astype(np.float32)
    table.apply_gradients(ids, grads=grads, combiner="sum")
    tref.apply(tref.row_grads().add_pooled(ids, np.arange(4), None, "sum", grads))
    _compare(table, tref)


@pytest.mark.parametrize("threads", [1, 2])
def test_assign_from_the_table_s_own_shifted_rows(threads, restore_threads):
    # NumPy's a[1:] = a[:-1]: every row gets the source as it was before the call (the view was read while
    # the rows it shows were being written; the result depended on the threads' timing).
    ec.set_num_threads(threads)
    table = make_table(20000, 2, optimizer=ec.optimizers.Adagrad(0.1))
    table.assign(np.arange(40000, dtype=np.float32).reshape(20000, 2) % 997)
    table.assign_slot("accumulators", np.arange(40000, dtype=np.float32).reshape(20000, 2) % 997 + 1)
    values, acc = table.to_numpy(), table.slots()["accumulators"].copy()
    table.assign(table.values()[:-1], start_row=1)
    table.assign_slot("accumulators", table.slots()["accumulators"][1:], start_row=0)
    np.testing.assert_array_equal(table.to_numpy()[1:], values[:-1])
    np.testing.assert_array_equal(table.slots()["accumulators"][:-1], acc[1:])


def test_empty_update_counts_a_step():
    table = make_table(10, 3, optimizer=ec.optimizers.Adagrad(0.1))
    before = snapshot(table)
    table.apply_gradients(np.zeros(0, np.int64), np.array([0, 0]), np.zeros((1, 3), np.float32))
    after = snapshot(table)
    assert after["step"] == before["step"] + 1
    np.testing.assert_array_equal(after["values"], before["values"])


# ----------------------------------------------------------------- determinism


def _workload(dtype):
    rng = np.random.default_rng(1234)
    out = []
    for kind, kw in (("adam", dict(learning_rate=0.01)), ("ftrl", dict(learning_rate=0.1, l1_regularization_strength=0.01)),
                     ("adam", dict(learning_rate=0.01, lazy_adam=False)), ("rowwise_adagrad", dict(learning_rate=0.1))):
        opt = _CLASSES[kind](**kw)
        table = ec.Table(name="det", rows=3000, dim=24, dtype=dtype, optimizer=opt,
                         initializer=ec.initializers.TruncatedNormal(seed=7))
        ids, offsets, w = random_bags(rng, 3000, 4000, max_len=12, weighted=True)
        out.append(state_bytes(table))  # the initializer
        for c in ("sum", "mean", "sqrtn"):
            out.append(table.lookup(ids, offsets, w, combiner=c).tobytes())
        out.append(table.lookup(ids, offsets, w, combiner=None, max_sequence_length=5).tobytes())
        out.append(table.lookup(ids, offsets, w, combiner=None).tobytes())
        for step in range(2):
            grads = rng.normal(size=(4000, 24)).astype(np.float32)
            table.apply_gradients(ids, offsets, grads, weights=w, combiner="mean")
            out.append(state_bytes(table))
        out.append(table.lookup(ids, offsets, w, combiner="sum").tobytes())
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_results_do_not_depend_on_thread_count(restore_threads, dtype):
    results = {}
    for n in (1, 2, 4):
        ec.set_num_threads(n)
        assert ec.get_num_threads() == n
        results[n] = _workload(dtype)
    for n in (2, 4):
        assert len(results[n]) == len(results[1])
        for i, (a, b) in enumerate(zip(results[1], results[n])):
            assert a == b, f"result {i} differs between 1 and {n} threads"


def test_set_num_threads_validates(restore_threads):
    with pytest.raises(ValueError):
        ec.set_num_threads(0)
    with pytest.raises(TypeError):
        ec.set_num_threads(2.0)
    with pytest.raises(TypeError):
        ec.set_num_threads(True)
    assert ec.get_num_threads() == restore_threads


def test_steps_of_several_tables_in_one_call(rng):
    """``apply_gradients_windows`` (a collection's fused backward): each
    table's step from its windows of one CSR source and its columns of one
    gradient is its own ``apply_gradients`` of those bags, bit for bit; a bad
    id, window or column anywhere, a table given twice, a non-finite rate, a
    table at the step limit, or an array inside any table of the call changes
    no table."""
    from embedcore import _embedcore

    def tables():
        return [ec.Table(name=f"t{k}", rows=20, dim=3 + k, optimizer=ec.optimizers.Adam(0.1),
                         initializer=ec.initializers.Uniform(-1, 1, seed=k)) for k in range(3)]

    lengths = np.r_[rng.integers(1, 4, 8), 2]  # 4 windows of 2 bags, then one bag more
    offsets = np.r_[0, np.cumsum(lengths)].astype(np.int64)
    ids = rng.integers(0, 20, int(offsets[-1]))
    weights = rng.random(len(ids)).astype(np.float32)
    grads = rng.standard_normal((2, 20)).astype(np.float32)
    # t0 (dim 3): bags 0-1, columns 0-2, mean; t1 (dim 4): bags 2-3 at 3-6 and bags 6-7 at 7-10 (sum, one step);
    # t2 (dim 5): bags 4-5 at 11-15, sqrtn.
    plan = [[(0, 2, 1, 0)], [(2, 2, 0, 3), (6, 2, 0, 7)], [(4, 2, 2, 11)]]
    ours, refs = tables(), tables()
    _embedcore.apply_gradients_windows(ids, offsets, weights,
                                       [(t._native, p, 0.1 * (k + 1)) for k, (t, p) in enumerate(zip(ours, plan))],
                                       grads)
    for k, (t, parts) in enumerate(zip(refs, plan)):
        native = []
        for first, count, combiner, col in parts:
            lo, hi = offsets[first], offsets[first + count]
            native.append((ids[lo:hi], offsets[first:first + count + 1] - lo, weights[lo:hi], combiner, 0,
                           np.ascontiguousarray(grads[:, col:col + t.dim])))
        t._native.apply_gradients(native, 0.1 * (k + 1))
    for a, b in zip(ours, refs):
        assert state_bytes(a) == state_bytes(b) and a.step == b.step == 1

    before = [state_bytes(t) for t in ours]
    steps = [(t._native, p, 0.1) for t, p in zip(ours, plan)]
    bad_ids = ids.copy()
    bad_ids[offsets[8]:] = 20  # the last bag: in no window, so no error
    _embedcore.apply_gradients_windows(bad_ids, offsets, weights, [], grads)
    bad_ids[offsets[4]:offsets[6]] = 20  # t2's window
    with pytest.raises(IndexError, match="table 't2'"):
        _embedcore.apply_gradients_windows(bad_ids, offsets, weights, steps, grads)
    for wrong, message in (
            ([steps[0], (ours[1]._native, [(2, 2, 0, 17)], 0.1)], r"table 't1': part 0: columns \[17, 21\)"),
            ([steps[0], (ours[1]._native, [(8, 2, 0, 3)], 0.1)], "2 bags from bag 8 are not within the source's 9"),
            ([steps[0], (ours[1]._native, [(2, 1, 0, 3)], 0.1)], "part 0 has 1 bags, grads has 2 rows"),
            ([steps[0], steps[0]], "table 't0' is given twice"),
            ([steps[0], (ours[2]._native, plan[2], float("nan"))], "table 't2': learning_rate must be finite")):
        with pytest.raises(ValueError, match=message):
            _embedcore.apply_gradients_windows(ids, offsets, weights, wrong, grads)
    with pytest.raises(ValueError, match="contiguous rows"):
        _embedcore.apply_gradients_windows(ids, offsets, weights, steps, np.asfortranarray(grads))
    ours[2].step = 2**62  # the last step a checkpoint records
    with pytest.raises(ValueError, match="table 't2' is at step"):
        _embedcore.apply_gradients_windows(ids, offsets, weights, steps, grads)
    ours[2].step = 1
    in_t0 = ours[0]._native.values_mut().reshape(-1)[:40].reshape(2, 20)  # grads inside t0, which steps first
    with pytest.raises(ValueError, match="grads overlaps the values of table 't0'"):
        _embedcore.apply_gradients_windows(ids, offsets, weights, steps, in_t0)
    assert [state_bytes(t) for t in ours] == before

# ----------------------------------------------------------------- set_optimizer
def test_set_optimizer_keeps_values_and_starts_fresh_slots(rng):
    table = make_table(30, 5, optimizer=ec.optimizers.SGD(0.05), seed=4)
    for _ in range(2):
        ids, offsets, w = random_bags(rng, 30, 8, weighted=True)
        table.apply_gradients(ids, offsets, column_signed_grads(rng, (8, 5)), weights=w)
    values = table.to_numpy().copy()
    opt, ropt = make_optimizer("rowwise_adagrad", learning_rate=0.2, initial_accumulator_value=0.5)
    table.set_optimizer(opt)
    assert table.optimizer is opt and table.config.optimizer is opt and table.step == 0
    np.testing.assert_array_equal(table.to_numpy(), values)
    assert table.slot_names == ("row_accumulators",)
    np.testing.assert_array_equal(table.slots()["row_accumulators"], np.full((30, 1), 0.5, np.float32))
    tref = ref.TableRef(values, ropt)
    ids, offsets, w = random_bags(rng, 30, 8, weighted=True)
    grads = column_signed_grads(rng, (8, 5))
    table.apply_gradients(ids, offsets, grads, weights=w)
    tref.apply(tref.row_grads().add_pooled(ids, offsets, w, "mean", grads))
    _compare(table, tref, "after set_optimizer")
    # Refused before anything changes: a table with slots (views of them would dangle), not an optimizer,
    # row-wise slots on a column shard.
    before = snapshot(table)
    view = table.slots()["row_accumulators"]
    with pytest.raises(ValueError, match="keeps slots"):
        table.set_optimizer(ec.optimizers.Adagrad(0.1))
    np.testing.assert_array_equal(view, before["slots"]["row_accumulators"])
    with pytest.raises(TypeError, match="optimizer must be"):
        table.set_optimizer("adagrad")
    shard = ec.Table._shard(ec.TableConfig("s", 30, 5, optimizer=ec.optimizers.SGD(0.1)), 30, 2, 0, 3)  # cols [3, 5)
    with pytest.raises(ValueError, match="cannot be a column shard"):
        shard.set_optimizer(ec.optimizers.RowWiseAdagrad(0.1))
    assert type(shard.optimizer) is ec.optimizers.SGD and shard.slot_names == ()
    after = snapshot(table)
    np.testing.assert_array_equal(after["values"], before["values"])
    np.testing.assert_array_equal(after["slots"]["row_accumulators"], before["slots"]["row_accumulators"])
    assert after["step"] == before["step"] and type(table.optimizer) is ec.optimizers.RowWiseAdagrad


def test_options_are_fixed_once_set_but_the_learning_rate():
    """A table copies its optimizer's options when made and a checkpoint
    records the object's: a later change of epsilon or clipvalue was
    recorded but never run. They are fixed now (AttributeError naming
    them); learning_rate may change (read at every step), checked as when
    made, and the step uses the new one."""
    opt = ec.optimizers.Adagrad(0.1, epsilon=0.0)
    t = ec.Table(name="t", rows=4, dim=2, initializer=ec.initializers.Constant(1.0), optimizer=opt)
    for name, value in (("epsilon", 5.0), ("clipvalue", (-0.01, 0.01)), ("initial_accumulator_value", 1.0)):
        with pytest.raises(AttributeError, match=f"Adagrad: {name} cannot change once set"):
            setattr(opt, name, value)
    assert opt.epsilon == 0.0 and opt.clipvalue is None
    with pytest.raises(TypeError, match="learning_rate must be a number"):
        opt.learning_rate = "fast"
    with pytest.raises(ValueError, match="learning_rate must be finite"):
        opt.learning_rate = float("nan")
    opt.learning_rate = 1.0
    t.apply_gradients(np.array([0]), np.array([0, 1]), np.ones((1, 2), np.float32))
    # Adagrad: acc 0.1 + 1 = 1.1; value 1 - 1.0 * 1 / sqrt(1.1)
    np.testing.assert_allclose(t.values()[0], 1 - 1 / np.sqrt(np.float32(1.1)), rtol=1e-6)
    opt.learning_rate = lambda step: 0.5  # a schedule, too
    assert opt.learning_rate_at(3) == 0.5
    # Every option of every optimizer is one of the fixed ones (the list cannot fall behind the classes).
    from embedcore.optimizers import _OPTIONS

    for cls in (ec.optimizers.SGD, ec.optimizers.Adagrad, ec.optimizers.RowWiseAdagrad, ec.optimizers.Adam,
                ec.optimizers.FTRL):
        assert set(vars(cls(0.1))) - {"learning_rate"} <= _OPTIONS, cls


@pytest.mark.parametrize("multiply_linear_by_lr", [False, True])
def test_ftrl_spreads_a_gradient_that_is_not_finite_as_tensorflows_sparse_kernel(multiply_linear_by_lr):
    """A NaN or infinite gradient (and a row already infinite) under FTRL: the
    value, accumulator and linear of each element as TensorFlow's sparse FTRL
    kernel (ResourceSparseApplyFtrl, what tf.compat.v1's FtrlOptimizer runs
    for an embedding variable's gradient) leaves them: NaN where it gives NaN, not a weight of 0 beside a NaN
    linear (a row that would read as healthy, and stay 0 for good)."""
    tf = pytest.importorskip("tensorflow")
    lr, l1, l2 = 0.1, 0.01, 0.02
    values = np.full((3, 6), 0.5, np.float32)
    values[2, :2] = [np.inf, -np.inf]
    grads = np.array([[np.nan, np.inf, -np.inf, 1.0, 0.0, -2.0],
                      [0.5, np.nan, 0.25, -np.inf, 1e30, 3.0]], np.float32)
    ids = np.array([1, 2])
    table = ec.Table(name="t", rows=3, dim=6, initializer=ec.initializers.Zeros(),
                     optimizer=ec.optimizers.FTRL(lr, l1_regularization_strength=l1, l2_regularization_strength=l2,
                                                  initial_accumulator_value=0.1,
                                                  multiply_linear_by_learning_rate=multiply_linear_by_lr))
    table.assign(np.where(np.isfinite(values), values, 0.0))
    table._native.values_mut()[2, :2] = [np.inf, -np.inf]  # (assign refuses what a diverged row may hold)
    table.apply_gradients(ids, None, grads)

    var, acc, lin = (tf.Variable(values), tf.Variable(np.full((3, 6), 0.1, np.float32)),
                     tf.Variable(np.zeros((3, 6), np.float32)))
    tf.raw_ops.ResourceSparseApplyFtrl(var=var.handle, accum=acc.handle, linear=lin.handle, grad=grads, indices=ids,
                                       lr=np.float32(lr), l1=np.float32(l1), l2=np.float32(l2),
                                       lr_power=np.float32(-0.5), multiply_linear_by_lr=multiply_linear_by_lr)
    slots = table.slots()
    for name, ours, theirs in (("values", table.values(), var.numpy()), ("accumulators", slots["accumulators"],
                                                                         acc.numpy()),
                               ("linears", slots["linears"], lin.numpy())):
        np.testing.assert_array_equal(np.isnan(ours), np.isnan(theirs), err_msg=f"{name}: where NaN")
        np.testing.assert_allclose(ours, theirs, rtol=1e-6, err_msg=name)  # (NaN positions equal, inf signs too)
    assert np.isnan(table.values()[1, 0])  # the NaN gradient's element: NaN, not 0
