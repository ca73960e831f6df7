"""Training through the PyTorch adapter: fused (the engine's optimizer inside
backward()) and unfused (PyTorch's sparse optimizers on weight.grad), one and
ten steps, against nn.EmbeddingBag(sparse=True) driven by torch.optim.SGD /
Adagrad / SparseAdam on the same weights and batches."""
import copy
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import embedcore as ec  # noqa: E402
import embedcore.adapters.torch as et  # noqa: E402
from torch_helpers import bags, engine_optimizer, max_diff, torch_optimizer, uniform_weights  # noqa: E402
from embedcore.adapters.torch import _ops  # noqa: E402

ROWS, DIM, BATCH = 50, 8, 16
LR = {"sgd": 0.1, "adagrad": 0.1, "adam": 0.01}


def _train(rng, modules_and_opts, steps, mode, weighted=False, padding_idx=None):
    """Runs the same `steps` batches and output gradients through every
    (module, optimizer or None) pair."""
    for _ in range(steps):
        ids, offsets, w = bags(rng, ROWS, BATCH, weighted=weighted, pad=padding_idx)
        g = torch.from_numpy(rng.standard_normal((BATCH, DIM)).astype(np.float32))
        for m, opt in modules_and_opts:
            if opt is not None:
                opt.zero_grad()
            (m(ids, offsets, w) * g).sum().backward()
            if opt is not None:
                opt.step()


@pytest.mark.parametrize("name", ["sgd", "adagrad", "adam"])
@pytest.mark.parametrize("steps", [1, 10])
@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_fused_and_unfused_match_torch(rng, name, steps, mode):
    w = uniform_weights(rng, ROWS, DIM)
    kw = dict(freeze=False, mode=mode, include_last_offset=True, padding_idx=2)
    ref = torch.nn.EmbeddingBag.from_pretrained(w.clone(), sparse=True, **kw)
    fused = et.EmbeddingBag.from_pretrained(w, optimizer=engine_optimizer(name, LR[name]), **kw)
    unfused = et.EmbeddingBag.from_pretrained(w, sparse=True, **kw)
    _train(rng, [(ref, torch_optimizer(name, ref.parameters(), LR[name])), (fused, None),
                 (unfused, torch_optimizer(name, unfused.parameters(), LR[name]))],
           steps, mode, weighted=mode == "sum", padding_idx=2)
    assert max_diff(fused.weight, ref.weight) <= 1e-5
    assert max_diff(unfused.weight, ref.weight) <= 1e-5
    assert fused.table.step == steps
    assert torch.equal(fused.weight[2], w[2]) and torch.equal(unfused.weight[2], w[2])  # padding row: no update


@pytest.mark.parametrize("name", ["sgd", "adagrad", "adam"])
def test_fused_sqrtn_matches_engine_table(rng, name):
    """sqrtn has no PyTorch counterpart: compare with the engine's own Table."""
    w = uniform_weights(rng, ROWS, DIM)
    fused = et.EmbeddingBag.from_pretrained(w, freeze=False, mode="sqrtn", include_last_offset=True,
                                            optimizer=engine_optimizer(name, LR[name]))
    table = ec.Table(name="ref", rows=ROWS, dim=DIM, optimizer=engine_optimizer(name, LR[name]))
    table.assign(w.numpy())
    for _ in range(5):
        ids, offsets, _ = bags(rng, ROWS, BATCH)
        g = torch.randn(BATCH, DIM)
        (fused(ids, offsets) * g).sum().backward()
        table.apply_gradients(ids.numpy(), offsets.numpy(), g.numpy(), combiner="sqrtn")
    assert np.array_equal(fused.weight.detach().numpy(), table.values())


def test_ftrl_fused_matches_engine_table(rng):
    def opt():
        return ec.optimizers.FTRL(learning_rate=0.2, l1_regularization_strength=0.01,
                                  l2_regularization_strength=0.1, beta=0.5)

    w = uniform_weights(rng, ROWS, DIM)
    fused = et.EmbeddingBag.from_pretrained(w, freeze=False, mode="mean", include_last_offset=True, optimizer=opt())
    table = ec.Table(name="ref", rows=ROWS, dim=DIM, optimizer=opt())
    table.assign(w.numpy())
    for _ in range(5):
        ids, offsets, _ = bags(rng, ROWS, BATCH)
        g = torch.randn(BATCH, DIM)
        (fused(ids, offsets) * g).sum().backward()
        table.apply_gradients(ids.numpy(), offsets.numpy(), g.numpy(), combiner="mean")
    assert np.array_equal(fused.weight.detach().numpy(), table.values())
    for k, v in table.slots().items():
        assert np.array_equal(fused.optimizer_state_dict()["state"]["weight"][k].numpy(), v)


def test_adagrad_matches_torch_defaults_with_engine_epsilon(rng):
    """PyTorch's Adagrad defaults (accumulators from 0, eps=1e-10 outside the
    sqrt) are the engine's ``Adagrad(initial_accumulator_value=0,
    epsilon=1e-10)``: ``w -= lr * g / (sqrt(acc) + epsilon)``."""
    opt = ec.optimizers.Adagrad(learning_rate=0.1, initial_accumulator_value=0.0, epsilon=1e-10)
    w = uniform_weights(rng, ROWS, DIM)
    ref = torch.nn.EmbeddingBag.from_pretrained(w.clone(), freeze=False, mode="sum", sparse=True,
                                                include_last_offset=True)
    fused = et.EmbeddingBag.from_pretrained(w, freeze=False, mode="sum", include_last_offset=True, optimizer=opt)
    _train(rng, [(ref, torch.optim.Adagrad(ref.parameters(), lr=0.1)), (fused, None)], 10, "sum")
    assert max_diff(fused.weight, ref.weight) <= 1e-5


def test_dense_gradients_with_dense_optimizer(rng):
    w = uniform_weights(rng, ROWS, DIM)
    ref = torch.nn.EmbeddingBag.from_pretrained(w.clone(), freeze=False, mode="mean", include_last_offset=True)
    ours = et.EmbeddingBag.from_pretrained(w, freeze=False, mode="mean", include_last_offset=True, sparse=False)
    _train(rng, [(ref, torch.optim.Adam(ref.parameters(), lr=0.01)),
                 (ours, torch.optim.Adam(ours.parameters(), lr=0.01))], 5, "mean")
    assert not ours.weight.grad.is_sparse
    assert max_diff(ours.weight, ref.weight) <= 1e-5


def test_unused_output_gets_no_update(rng):
    """Only features whose outputs reach the loss update their rows (as with
    PyTorch, where an unused lookup has no gradient at all)."""
    w = uniform_weights(rng, ROWS, DIM)
    ebc = et.EmbeddingBagCollection([et.EmbeddingBagConfig(ROWS, DIM, name="t", feature_names=["a", "b"],
                                                           init_fn=lambda t: t.copy_(w))],
                                    optimizer=ec.optimizers.Adam(0.1, bias_correction=True, sum_inside_sqrt=False))
    out = ebc({"a": (torch.tensor([1, 2]), torch.tensor([0, 2])), "b": (torch.tensor([3]), torch.tensor([0, 1]))})
    out["a"].sum().backward()
    moved = (ebc.embedding_bags["t"].weight - w).abs().sum(1) > 0
    assert moved.nonzero().flatten().tolist() == [1, 2]


def test_shared_table_gets_one_step_per_backward(rng):
    """Two features of one table: one optimizer step per backward, with the
    gradients of both summed, as SparseAdam over the two bags batched."""
    w = uniform_weights(rng, ROWS, DIM)
    opt = engine_optimizer("adam", 0.01)
    ebc = et.EmbeddingBagCollection([et.EmbeddingBagConfig(ROWS, DIM, name="t", feature_names=["a", "b"],
                                                           pooling="mean", init_fn=lambda t: t.copy_(w))],
                                    optimizer=opt)
    ref = torch.nn.EmbeddingBag.from_pretrained(w.clone(), freeze=False, mode="mean", sparse=True,
                                                include_last_offset=True)
    ref_opt = torch.optim.SparseAdam(ref.parameters(), lr=0.01)
    for _ in range(4):
        ia, oa, _ = bags(rng, ROWS, 5)
        ib, ob, _ = bags(rng, ROWS, 7)
        ga, gb = torch.randn(5, DIM), torch.randn(7, DIM)
        out = ebc({"a": (ia, oa), "b": {"values": ib, "lengths": ob.diff()}})
        ((out["a"] * ga).sum() + (out["b"] * gb).sum()).backward()
        ref_opt.zero_grad()
        both = ref(torch.cat([ia, ib]), torch.cat([oa[:-1], ob + oa[-1]]))
        (both * torch.cat([ga, gb])).sum().backward()
        ref_opt.step()
    assert ebc.embedding_bags["t"].table.step == 4
    assert max_diff(ebc.embedding_bags["t"].weight, ref.weight) <= 1e-5


def test_learning_rate_from_param_groups_and_scheduler(rng):
    """The fused optimizer's param groups carry "lr"; a PyTorch scheduler on
    them drives the engine's updates, as it drives torch.optim.SGD."""
    w = uniform_weights(rng, ROWS, DIM)
    ref = torch.nn.EmbeddingBag.from_pretrained(w.clone(), freeze=False, mode="sum", sparse=True,
                                                include_last_offset=True)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    fused = et.EmbeddingBag.from_pretrained(w, freeze=False, mode="sum", include_last_offset=True,
                                            optimizer=ec.optimizers.SGD(0.5))
    fo = fused.fused_optimizer
    assert isinstance(fo, torch.optim.Optimizer) and fo.param_groups[0]["lr"] == 0.5
    s1 = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=2, gamma=0.1)
    s2 = torch.optim.lr_scheduler.StepLR(fo, step_size=2, gamma=0.1)
    for _ in range(6):
        ids, offsets, _ = bags(rng, ROWS, BATCH)
        g = torch.randn(BATCH, DIM)
        ref_opt.zero_grad()
        (ref(ids, offsets) * g).sum().backward()
        ref_opt.step()
        (fused(ids, offsets) * g).sum().backward()
        fo.step()
        s1.step()
        s2.step()
    assert abs(fo.param_groups[0]["lr"] - 0.5 * 0.1**3) < 1e-12
    assert fused.table.learning_rate() == fo.param_groups[0]["lr"]  # (the next step's, not the optimizer's 0.5)
    assert max_diff(fused.weight, ref.weight) <= 1e-5


def test_fused_optimizer_refuses_a_param_group_added(rng):
    """fused_optimizer's groups are the fused tables' (stepped in backward):
    add_param_group raises, as TorchRec's KeyedOptimizer does (was: the
    group was kept, never stepped nor saved), and the groups stay."""
    fused = et.EmbeddingBag(ROWS, DIM, mode="sum", optimizer=ec.optimizers.SGD(0.5))
    fo = fused.fused_optimizer
    with pytest.raises(NotImplementedError, match="add_param_group: its param groups are the fused tables'"):
        fo.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))], "lr": 0.1})
    assert len(fo.param_groups) == 1 and len(fo.state_dict()["param_groups"]) == 1


def test_set_optimizer_on_a_fused_modules_table_is_refused():
    """A fused module's param group ("lr") and slot views are of the
    optimizer it fused: Table.set_optimizer on its table would leave them
    behind (its next step applied the group's SGD 0.1 under Adagrad's rule).
    Refused, naming the table and module, and the table trains on; also
    through a copy of the table made before the module fused, and while a
    graph of the module's lookups outlives the module (its backward steps
    with the group's rate). A module that trains unfused is not refused."""
    import copy
    import gc

    from torch.distributed.optim import _apply_optimizer_in_backward

    refused = (r"table '.*' trains fused in a PyTorch EmbeddingBag \(or a graph of its lookups\), whose param group "
               r"and slot views are of its SGD: set_optimizer would leave them behind")
    m = et.EmbeddingBag.from_pretrained(torch.ones(4, 2), freeze=False, mode="sum",
                                        optimizer=ec.optimizers.SGD(0.1))
    ids = torch.tensor([[0]])
    m(ids).sum().backward()
    with pytest.raises(ValueError, match=refused):
        m.table.set_optimizer(ec.optimizers.Adagrad(0.5))
    assert isinstance(m.table.optimizer, ec.optimizers.SGD)
    m(ids).sum().backward()
    np.testing.assert_allclose(m.table.to_numpy()[0], [0.8, 0.8], rtol=1e-6)

    out, table = m(ids), m.table  # a graph that outlives its module still steps with the group's rate
    del m
    gc.collect()
    with pytest.raises(ValueError, match=refused):
        table.set_optimizer(ec.optimizers.Adagrad(0.5))
    out.sum().backward()
    np.testing.assert_allclose(table.to_numpy()[0], [0.7, 0.7], rtol=1e-6)
    del out
    gc.collect()
    table.set_optimizer(ec.optimizers.SGD(0.5))  # no module nor graph left: its own again

    pending = et.EmbeddingBag.from_pretrained(torch.ones(4, 2), freeze=False, mode="sum")
    _apply_optimizer_in_backward(torch.optim.SGD, [pending.weight], {"lr": 0.1})
    twin = copy.copy(pending.table)  # made before the first lookup fuses the table
    pending(ids).sum().backward()
    assert pending.fused and isinstance(twin.optimizer, ec.optimizers.SGD)
    with pytest.raises(ValueError, match=refused):
        twin.set_optimizer(ec.optimizers.Adagrad(0.5))

    plain = et.EmbeddingBag.from_pretrained(torch.ones(4, 2), freeze=False, mode="sum")  # no optimizer: unfused
    plain(ids).sum().backward()
    plain.table.set_optimizer(ec.optimizers.SGD(0.5))
    assert isinstance(plain.table.optimizer, ec.optimizers.SGD)


def test_set_optimizer_during_the_adapters_own_fuse_is_refused(monkeypatch):
    """The first lookup of a table that apply_optimizer_in_backward named
    gives it the optimizer, then marks it fused: a set_optimizer from
    another thread in between replaced the optimizer under the module's
    param group and slot views. It now waits for the fuse, and is refused."""
    import threading

    from torch.distributed.optim import _apply_optimizer_in_backward

    m = et.EmbeddingBag.from_pretrained(torch.ones(4, 2), freeze=False, mode="sum")
    _apply_optimizer_in_backward(torch.optim.SGD, [m.weight], {"lr": 0.1})
    outcome = []

    def replace():
        try:
            m.table.set_optimizer(ec.optimizers.Adagrad(0.5))
            outcome.append("replaced")
        except ValueError as e:
            outcome.append(e)

    mark = type(m)._training_state
    other = threading.Thread(target=replace)

    def marked_late(self):  # the other thread's set_optimizer comes after the table took its optimizer
        other.start()
        other.join(0.5)
        mark(self)

    monkeypatch.setattr(type(m), "_training_state", marked_late)
    m(torch.tensor([[0]])).sum().backward()
    other.join()
    assert len(outcome) == 1 and isinstance(outcome[0], ValueError) and "trains fused" in str(outcome[0])
    assert m.fused and isinstance(m.table.optimizer, ec.optimizers.SGD)
    np.testing.assert_allclose(m.table.to_numpy()[0], [0.9, 0.9], rtol=1e-6)


def test_learning_rate_schedule_callable(rng):
    w = uniform_weights(rng, ROWS, DIM)
    fused = et.EmbeddingBag.from_pretrained(w, freeze=False, mode="sum", include_last_offset=True,
                                            optimizer=ec.optimizers.SGD(lambda step: 0.1 / (1 + step)))
    table = ec.Table(name="ref", rows=ROWS, dim=DIM, optimizer=ec.optimizers.SGD(lambda step: 0.1 / (1 + step)))
    table.assign(w.numpy())
    for _ in range(3):
        ids, offsets, _ = bags(rng, ROWS, BATCH)
        g = torch.randn(BATCH, DIM)
        (fused(ids, offsets) * g).sum().backward()
        table.apply_gradients(ids.numpy(), offsets.numpy(), g.numpy(), combiner="sum")
    assert np.array_equal(fused.weight.detach().numpy(), table.values())
    assert fused.fused_optimizer.param_groups[0]["lr"] == pytest.approx(0.1 / 4)


def test_frozen_and_no_grad_do_not_train(rng):
    w = uniform_weights(rng, ROWS, DIM)
    m = et.EmbeddingBag.from_pretrained(w, freeze=True, mode="sum", optimizer=ec.optimizers.SGD(1.0))
    ids, offsets, _ = bags(rng, ROWS, BATCH)
    assert not m(ids, offsets[:-1]).requires_grad
    m.weight.requires_grad_(True)
    with torch.no_grad():
        assert not m(ids, offsets[:-1]).requires_grad
    out = m(ids, offsets[:-1])
    out.sum().backward()
    assert m.table.step == 1 and m.weight.grad is None


@pytest.mark.parametrize("name", ["sgd", "adagrad", "adam"])
def test_unpooled_training_matches_nn_embedding(rng, name):
    """Embedding / EmbeddingCollection (one row per id), fused and unfused,
    against nn.Embedding(sparse=True); padding ids get no update."""
    w = uniform_weights(rng, ROWS, DIM)
    ref = torch.nn.Embedding.from_pretrained(w.clone(), freeze=False, sparse=True, padding_idx=0)
    ref_opt = torch_optimizer(name, ref.parameters(), LR[name])
    fused = et.Embedding.from_pretrained(w, freeze=False, padding_idx=0, optimizer=engine_optimizer(name, LR[name]))
    unfused = et.Embedding.from_pretrained(w, freeze=False, padding_idx=0, sparse=True)
    unfused_opt = torch_optimizer(name, unfused.parameters(), LR[name])
    coll = et.EmbeddingCollection([et.EmbeddingConfig(ROWS, DIM, name="t", feature_names=["a", "b"],
                                                      init_fn=lambda t: t.copy_(w))],
                                  optimizer=engine_optimizer(name, LR[name]))
    ref2 = torch.nn.Embedding.from_pretrained(w.clone(), freeze=False, sparse=True)  # collections: no padding
    ref2_opt = torch_optimizer(name, ref2.parameters(), LR[name])
    for _ in range(5):
        x = torch.from_numpy(rng.integers(0, ROWS, size=(4, 3)))
        x[0, 0] = 0
        g = torch.from_numpy(rng.standard_normal((4, 3, DIM)).astype(np.float32))
        ref_opt.zero_grad()
        (ref(x) * g).sum().backward()
        ref_opt.step()
        (fused(x) * g).sum().backward()
        unfused_opt.zero_grad()
        (unfused(x) * g).sum().backward()
        unfused_opt.step()
        out = coll({"a": x[:2], "b": x[2:]})  # two features of one table: one step, as the whole batch
        ((out["a"] * g[:2]).sum() + (out["b"] * g[2:]).sum()).backward()
        ref2_opt.zero_grad()
        (ref2(x) * g).sum().backward()
        ref2_opt.step()
    for m in (fused, unfused):
        assert max_diff(m.weight, ref.weight) <= 1e-5
    assert torch.equal(fused.weight[0], w[0])
    assert max_diff(coll.embeddings["t"].weight, ref2.weight) <= 1e-5
    assert coll.embeddings["t"].table.step == 5


def test_unfused_sequence_gradient_holds_the_output_gradient_as_nn_embedding_s(rng):
    """An unfused Embedding's sparse gradient (no padding id) holds the
    output's gradient itself, as nn.Embedding's does: it was copied, the
    custom op's rule (its outputs never alias its inputs) applied to the
    plain eager backward too, an 8 MiB copy a step at [2048, 16] x 64 (1.3-
    2x nn.Embedding's backward). The op (under torch.compile, or a graph
    recorded with create_graph) still copies; the values are the same."""
    w = uniform_weights(rng, ROWS, DIM)
    ref = torch.nn.Embedding.from_pretrained(w.clone(), freeze=False, sparse=True)
    ours = et.Embedding.from_pretrained(w, freeze=False, sparse=True)
    x = torch.from_numpy(rng.integers(0, ROWS, size=(5, 3)))
    g = torch.from_numpy(rng.standard_normal((5, 3, DIM)).astype(np.float32))
    for m in (ref, ours):
        out = m(x)
        out.backward(g)
        assert m.weight.grad._values().data_ptr() == g.data_ptr(), type(m)
    assert torch.equal(ours.weight.grad.coalesce().to_dense(), ref.weight.grad.coalesce().to_dense())
    values = _ops.lookup_backward_impl(ours._handle, DIM, ROWS, [x.reshape(-1)], [], [], [0, 0, _ops.WHOLE],
                                       _ops.SEQUENCE, -1, True, _ops.SPARSE, True, False,
                                       [g.reshape(-1, DIM)], None)[0]
    assert torch.equal(values, g.reshape(-1, DIM)) and values.data_ptr() != g.data_ptr()  # the op's: a copy


@pytest.mark.parametrize("mode", ["sum", "mean", "sqrtn"])
@pytest.mark.parametrize("sparse", [True, False])
@pytest.mark.parametrize("form", ["offsets", "last_offset", "2d"])
def test_unfused_host_gradient_matches_the_general_path_bit_for_bit(rng, monkeypatch, mode, sparse, form):
    """The unfused table gradient of a plain CPU call (``_host_table_grad``:
    NumPy, no padding id) is the general path's, bit for bit: the same sparse
    values and indices (one row per id occurrence, repeats and empty bags
    included; int32 ids too) or dense gradient, and the same weights after
    torch.optim steps; a sum's, nn.EmbeddingBag's."""
    from embedcore.adapters.torch import _ops

    host = _ops._host_table_grad
    taken = []
    w0 = uniform_weights(rng, ROWS, DIM)

    def run(fast, name, batches):
        monkeypatch.setattr(_ops, "_host_table_grad",
                            (lambda *a: taken.append(host(*a)) or taken[-1]) if fast else (lambda *a: None))
        m = et.EmbeddingBag.from_pretrained(w0, freeze=False, mode=mode, sparse=sparse,
                                            include_last_offset=form == "last_offset")
        opt = torch_optimizer(name, m.parameters(), LR[name])
        grads = []
        for ids, offsets, w, g in batches:
            opt.zero_grad()
            (m(ids, offsets, w) * g).sum().backward()
            grads.append(m.weight.grad.clone())
            opt.step()
        return grads, m.weight.detach().clone()

    batches = []
    for k in range(3):
        ids = torch.from_numpy(rng.integers(0, 6, 20)).to(torch.int32 if k == 1 else torch.int64)  # many repeats
        offsets = {"offsets": torch.tensor([0, 0, 3, 3, 9, 15]),  # empty bags
                   "last_offset": torch.tensor([0, 0, 3, 3, 9, 15, 17]),  # ids 17.. in no bag
                   "2d": None}[form]
        if form == "2d":
            ids = ids.reshape(5, 4)
        w = torch.from_numpy(rng.random(ids.shape, np.float32)) if mode == "sum" and k != 2 else None
        bags_ = ids.shape[0] if form == "2d" else 6
        batches.append((ids, offsets, w, torch.from_numpy(rng.standard_normal((bags_, DIM)).astype(np.float32))))
    for name in ("sgd", "adagrad"):
        (fast_grads, fast_w), (ref_grads, ref_w) = run(True, name, batches), run(False, name, batches)
        for a, b in zip(fast_grads, ref_grads):
            assert a.layout == b.layout
            if sparse:  # uncoalesced, as nn.EmbeddingBag's
                assert not a.is_coalesced() and not b.is_coalesced() and a._indices().dtype == torch.int64
                assert torch.equal(a._indices(), b._indices()) and torch.equal(a._values(), b._values())
            else:
                assert torch.equal(a, b)
        assert torch.equal(fast_w, ref_w)
        if mode == "sum" and sparse and form != "last_offset":  # (PyTorch's backward fails on ids after the last)
            ref = torch.nn.EmbeddingBag.from_pretrained(w0.clone(), freeze=False, mode="sum", sparse=True)
            ref_opt = torch_optimizer(name, ref.parameters(), LR[name])
            for (ids, offsets, w, g), grad in zip(batches, fast_grads):
                ref_opt.zero_grad()
                (ref(ids.long(), offsets, w) * g).sum().backward()
                assert torch.equal(ref.weight.grad._indices(), grad._indices())
                assert torch.equal(ref.weight.grad._values(), grad._values())
                ref_opt.step()
            assert torch.equal(ref.weight.detach(), fast_w)
    assert len(taken) == 6 and all(t is not None for t in taken)  # (3 batches, 2 optimizers): the host path


def test_double_backward_through_per_sample_weights_is_refused(rng):
    """The lookup's backward has no derivative of its own: differentiating a
    gradient taken with create_graph raises NotImplementedError saying so
    (nn.EmbeddingBag's backward refuses it too) rather than give a partial
    one; a gradient penalty that leaves the embedding out works."""
    m = et.EmbeddingBag(ROWS, DIM, mode="sum", include_last_offset=True)
    ids, offsets, w = bags(rng, ROWS, BATCH, weighted=True)
    w = w.clone().requires_grad_()
    gw, gpsw = torch.autograd.grad(m(ids, offsets, w).pow(3).sum(), [m.weight, w], create_graph=True)
    with pytest.raises(NotImplementedError, match="embedcore lookups have no second derivative"):
        torch.autograd.grad(gw.pow(2).sum() + gpsw.pow(2).sum(), [m.weight, w])
    e = et.Embedding(ROWS, DIM)  # nn.Embedding has one; the drop-in says it has none
    with pytest.raises(NotImplementedError, match="leave the embedding's parameters out of the penalty"):
        (g,) = torch.autograd.grad(e(ids).pow(2).sum(), [e.weight], create_graph=True)
        g.pow(2).sum().backward()
    linear = torch.nn.Linear(DIM, 1)
    loss = linear(e(ids)).pow(2).sum()
    (g,) = torch.autograd.grad(loss, [linear.weight], create_graph=True)
    (loss + g.pow(2).sum()).backward()  # the penalty over the dense layer alone
    assert e.weight.grad is not None and linear.weight.grad is not None


def test_a_schedule_without_a_next_rate_fails_the_next_lookup_not_this_backward(rng):
    """A schedule that has no valid rate for the step after this one (here it
    raises, or gives NaN): this step's backward applies it and returns; the
    next lookup raises, before anything changes. The backward raised after
    the engine's step (a caller retrying stepped twice), and
    fused_optimizer.state_dict() raised too."""
    def schedule(step):
        if step >= 1:
            raise ValueError("no rate past step 0")
        return 0.1

    m = et.EmbeddingBag(ROWS, DIM, mode="sum", include_last_offset=True,
                        optimizer=ec.optimizers.SGD(learning_rate=schedule))
    before = m.weight.detach().clone()
    ids, offsets, _ = bags(rng, ROWS, BATCH)
    m(ids, offsets).sum().backward()
    assert m.table.step == 1
    ref = et.EmbeddingBag.from_pretrained(before, freeze=False, mode="sum", include_last_offset=True,
                                          optimizer=ec.optimizers.SGD(learning_rate=0.1))
    ref(ids, offsets).sum().backward()
    assert torch.equal(m.weight.detach(), ref.weight.detach())
    assert m.fused_optimizer.state_dict()["param_groups"][0]["lr"] == 0.1  # (the last rate shown)
    after = m.weight.detach().clone()
    with pytest.raises(ValueError, match="no rate past step 0"):
        m(ids, offsets)
    assert m.table.step == 1 and torch.equal(m.weight.detach(), after)


def test_a_collection_s_tables_all_step_when_one_schedule_ends(rng):
    """Dict inputs (a backward per table) and a KeyedJaggedTensor (one for all):
    a step whose rates are valid steps every table, though one table's
    schedule has no rate for the next step (a list of two rates); the next
    lookup raises, and no table steps. With dict inputs the schedule's table
    stepped, then its backward raised, and the other table never stepped:
    their step counts differed for good."""
    torchrec = pytest.importorskip("torchrec")
    rates = [0.3, 0.2]

    def collection():
        return et.EmbeddingBagCollection([
            et.EmbeddingBagConfig(num_embeddings=10, embedding_dim=2, name="x", feature_names=["x"],
                                  optimizer=ec.optimizers.SGD(0.1)),
            et.EmbeddingBagConfig(num_embeddings=10, embedding_dim=2, name="y", feature_names=["y"],
                                  optimizer=ec.optimizers.SGD(lambda s: rates[s]))])

    def by_dict(ebc):
        out = ebc({"x": torch.tensor([[1]]), "y": torch.tensor([[2]])})
        return out["x"].sum() + out["y"].sum()

    def by_kjt(ebc):
        kjt = torchrec.KeyedJaggedTensor(keys=["x", "y"], values=torch.tensor([1, 2]), lengths=torch.tensor([1, 1]))
        return ebc(kjt).values().sum()

    for call in (by_dict, by_kjt):
        ebc = collection()
        tables = [ebc.embedding_bags[k].table for k in ("x", "y")]
        first = tables[1].values()[2].copy()
        for step in (1, 2):
            call(ebc).backward()
            assert [t.step for t in tables] == [step, step]
        assert (tables[1].values()[2] - first).tolist() == pytest.approx([-0.5, -0.5])  # rates 0.3 and 0.2
        values = [t.values().copy() for t in tables]
        with pytest.raises(IndexError):
            call(ebc)
        assert [t.step for t in tables] == [2, 2]
        assert all(np.array_equal(t.values(), v) for t, v in zip(tables, values))


class _SGDByValue(ec.optimizers.SGD):
    """A user's optimizer equal to and hashed as another of the same rate."""

    def __eq__(self, other):
        return type(other) is type(self) and other.learning_rate == self.learning_rate

    def __hash__(self):
        return hash((type(self), self.learning_rate))


class _SGDUnhashable(ec.optimizers.SGD):
    __hash__ = None  # (as a dataclass with eq=True)

    def __eq__(self, other):
        return other is self


@pytest.mark.parametrize("kind", [_SGDByValue, _SGDUnhashable])
def test_a_rate_set_on_a_user_s_optimizer_subclass_is_the_fused_steps(kind):
    """Rate assignments are counted per optimizer object, not by its hash: an
    optimizer subclass hashed by value had each assignment counted under
    another key (its new rate never taken), and one without a hash could
    not be made."""
    opt = kind(0.1)
    bag = et.EmbeddingBag(4, 2, mode="sum", optimizer=opt, initializer=ec.initializers.Zeros())
    opt.learning_rate = 1.0
    bag(torch.tensor([0]), torch.tensor([0])).sum().backward()
    assert bag.weight.detach()[0].tolist() == [-1.0, -1.0]
    assert bag.fused_optimizer.param_groups[0]["lr"] == 1.0


def test_a_rate_set_on_the_engine_s_optimizer_is_the_fused_steps(rng):
    """``optimizer.learning_rate = x`` after the module was made (a number,
    also in place of a schedule) is the rate of the next fused steps, as for
    an ``ec.Table``, and the group shows it; a scheduler's later rate on the
    group wins until the optimizer's is set again, also to a value it had.
    The steps kept the group's old rate while ``Table.learning_rate()``
    reported the new one."""
    opt = ec.optimizers.SGD(0.1)
    bag = et.EmbeddingBag(4, 2, mode="sum", optimizer=opt, initializer=ec.initializers.Zeros())
    zero = torch.tensor([0])

    def step(row):
        before = bag.weight.detach()[row].clone()
        bag(torch.tensor([row]), zero).sum().backward()  # gradient 1 in each column
        return (before - bag.weight.detach()[row]).tolist()

    opt.learning_rate = 1.0
    assert step(0) == [1.0, 1.0] and bag.fused_optimizer.param_groups[0]["lr"] == 1.0
    bag.fused_optimizer.param_groups[0]["lr"] = 0.5  # (a scheduler's)
    assert bag.table.learning_rate() == 0.5  # (the rate the next step uses: it said 1.0)
    assert step(1) == [0.5, 0.5]
    opt.learning_rate = 0.25
    assert step(2) == [0.25, 0.25] and bag.table.learning_rate() == 0.25
    bag.fused_optimizer.param_groups[0]["lr"] = 0.125  # (a scheduler's again)
    assert step(3) == [0.125, 0.125]
    opt.learning_rate = 0.25  # set again to the value it had: the steps' rate again
    assert step(0) == [0.25, 0.25] and bag.fused_optimizer.param_groups[0]["lr"] == 0.25

    opt3 = ec.optimizers.SGD(lambda s: 0.5 / (1 + s))
    bag3 = et.EmbeddingBag(4, 2, mode="sum", optimizer=opt3, initializer=ec.initializers.Zeros())
    bag3(torch.tensor([0]), zero).sum().backward()  # rate 0.5
    opt3.learning_rate = 0.125
    bag3(torch.tensor([1]), zero).sum().backward()
    assert bag3.weight.detach()[1].tolist() == [-0.125, -0.125]
    assert bag3.fused_optimizer.state_dict()["param_groups"][0]["lr"] == 0.125


def test_fused_training_under_float16_autocast_is_refused(rng):
    """A GradScaler would scale the gradient that the fused backward applies
    (and could not skip a step it finds inf in): a backward through a lookup
    made under float16 autocast raises before the update, and nothing
    changes. The forward alone (inference, eval mode, no_grad) works, and
    bfloat16 autocast (no loss scaling) trains."""
    w = uniform_weights(rng, ROWS, DIM)
    bag = et.EmbeddingBag.from_pretrained(w, freeze=False, mode="sum", optimizer=ec.optimizers.SGD(0.1))
    ids = torch.tensor([[1, 2], [3, 4]])
    want = (w[[1, 3]] + w[[2, 4]]).numpy()
    for device in ("cpu", "cuda"):  # a host table may feed a CUDA model: either autocast counts
        with torch.autocast(device, dtype=torch.float16, enabled=device == "cpu" or torch.cuda.is_available()):
            out = bag(ids)
            np.testing.assert_array_equal(out.detach().numpy(), want)
            bag.eval()
            np.testing.assert_array_equal(bag(ids).detach().numpy(), want)
            bag.train()
            with torch.no_grad():
                np.testing.assert_array_equal(bag(ids).numpy(), want)
        if device == "cpu" or torch.cuda.is_available():
            with pytest.raises(NotImplementedError, match="fused training under float16 autocast is not supported"):
                out.sum().backward()
    assert np.array_equal(bag.weight.detach().numpy(), w.numpy()) and bag.table.step == 0
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bag(ids).sum().backward()
    expected = w.clone()
    expected[[1, 2, 3, 4]] -= 0.1
    assert max_diff(bag.weight, expected) == 0


def test_fused_training_in_a_multi_rank_job_warns_once():
    """Under DDP each rank's engine would update its own copy of a fused,
    unsharded table from its own gradients: a job of several ranks warns
    (once per module), a job of one does not. A fake process group stands
    in for torchrun's ranks."""
    import warnings

    import torch.distributed as dist
    fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    m = et.EmbeddingBag(10, 4, optimizer=ec.optimizers.SGD(0.1))
    ids, offsets = torch.tensor([1, 2]), torch.tensor([0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m(ids, offsets).sum().backward()  # no process group: no warning
    dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=0, world_size=2)
    try:
        with pytest.warns(RuntimeWarning, match="fused training in a job of 2 ranks"):
            m(ids, offsets).sum().backward()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            m(ids, offsets).sum().backward()  # once per module
            with torch.no_grad():
                et.EmbeddingBag(10, 4, optimizer=ec.optimizers.SGD(0.1))(ids, offsets)  # lookups only: no warning
    finally:
        dist.destroy_process_group()


def _lookup_then_delete(rng, kind, module_cls, weighted, keep):
    """A lookup, then (unless `keep`) `del module` and a collection, then its
    backward. Returns what the backward trained: weight.grad (unfused) or the
    table's values (fused)."""
    import gc

    w = uniform_weights(rng, ROWS, DIM)
    kw = dict(optimizer=ec.optimizers.Adagrad(0.1)) if kind == "fused" else dict(sparse=kind == "sparse")
    if module_cls is et.EmbeddingBag:
        m = et.EmbeddingBag.from_pretrained(w, freeze=False, mode="sum", include_last_offset=True, **kw)
        ids, offsets, psw = bags(rng, ROWS, BATCH, weighted=weighted)
        psw = None if psw is None else psw.requires_grad_()
        out = m(ids, offsets, psw)
    else:
        m = et.Embedding.from_pretrained(w, freeze=False, **kw)
        psw, out = None, m(torch.from_numpy(rng.integers(0, ROWS, size=(BATCH, 3))))
    weight, table = m.weight, m.table  # (neither keeps a fused module's table registered)
    if not keep:
        del m
        gc.collect()
    (out * torch.linspace(-1, 1, DIM)).sum().backward()
    psw_grad = None if psw is None else psw.grad.clone()
    return (table.values().copy() if kind == "fused" else weight.grad.to_dense().numpy()), psw_grad


@pytest.mark.parametrize("kind", ["sparse", "dense", "fused"])
@pytest.mark.parametrize("module_cls, weighted", [(et.EmbeddingBag, False), (et.EmbeddingBag, True),
                                                  (et.Embedding, False)])  # (Embedding takes no per-sample weights)
def test_backward_after_the_module_is_deleted_trains_as_with_it(kind, module_cls, weighted):
    """As nn.EmbeddingBag's graph keeps its weight, a lookup's graph keeps the
    table registered: `out = m(...); del m; out.sum().backward()` gives the
    gradient / applies the fused update that it gives with the module alive."""
    got, got_psw = _lookup_then_delete(np.random.default_rng(7), kind, module_cls, weighted, keep=False)
    want, want_psw = _lookup_then_delete(np.random.default_rng(7), kind, module_cls, weighted, keep=True)
    np.testing.assert_array_equal(got, want)
    assert (got_psw is None and want_psw is None) or torch.equal(got_psw, want_psw)


@pytest.mark.parametrize("kind", ["sparse", "fused", "fused-frozen"])
@pytest.mark.parametrize("backward", [True, False])
def test_the_table_is_released_once_no_module_or_graph_can_use_it(kind, backward):
    """The table stays registered while the module or a lookup's graph lives,
    and is released (unregistered, the ec.Table collected) once neither does,
    whether the backward ran or not."""
    import gc
    import weakref

    from embedcore.adapters.torch import _ops

    opt = None if kind == "sparse" else ec.optimizers.SGD(0.1)
    m = et.EmbeddingBag(ROWS, DIM, mode="sum", sparse=True, optimizer=opt)
    if kind == "fused-frozen":
        m.weight.requires_grad = False  # only the per-sample weights' gradient reads the table
    handle, table = m._handle, weakref.ref(m.table)
    ids, offsets, psw = bags(np.random.default_rng(3), ROWS, BATCH, weighted=True)
    out = m(ids, offsets, psw.requires_grad_())
    del m
    gc.collect()
    assert handle in _ops._REGISTRY and table() is not None
    if backward:
        out.sum().backward()
        assert psw.grad is not None
    del out
    gc.collect()
    assert handle not in _ops._REGISTRY and table() is None


def test_collections_backward_after_they_are_deleted():
    import gc

    from embedcore.adapters.torch import _ops

    rng = np.random.default_rng(5)
    ids, offsets, _ = bags(rng, 30, 4)
    for optimizer in (None, ec.optimizers.SGD(0.1)):
        ebc = et.EmbeddingBagCollection([et.EmbeddingBagConfig(30, 4, name="t", feature_names=["f"])], optimizer)
        ecol = et.EmbeddingCollection([et.EmbeddingConfig(30, 4, name="s", feature_names=["g"])], optimizer)
        handles = [ebc.embedding_bags["t"]._handle, ecol.embeddings["s"]._handle]
        tables = [ebc.embedding_bags["t"].table, ecol.embeddings["s"].table]
        before = [t.values().copy() for t in tables]
        loss = ebc({"f": (ids, offsets)})["f"].sum() + ecol({"g": (ids, offsets)})["g"].sum()
        del ebc, ecol
        gc.collect()
        loss.backward()
        if optimizer is not None:  # the fused update ran
            assert all(not np.array_equal(t.values(), b) for t, b in zip(tables, before))
        del loss
        gc.collect()
        assert not any(h in _ops._REGISTRY for h in handles)


@pytest.mark.parametrize("fused", [False, True])
def test_compiled_backward_after_the_module_is_deleted(fused):
    import gc

    torch._dynamo.reset()
    try:
        results = []
        for keep in (True, False):
            rng = np.random.default_rng(11)
            w = uniform_weights(rng, ROWS, DIM)
            kw = dict(optimizer=ec.optimizers.SGD(0.1)) if fused else dict(sparse=True)
            m = et.EmbeddingBag.from_pretrained(w, freeze=False, mode="sum", include_last_offset=True, **kw)
            weight, table = m.weight, m.table
            compiled = torch.compile(m, fullgraph=True)
            ids, offsets, _ = bags(rng, ROWS, BATCH)
            out = compiled(ids, offsets)
            if not keep:
                del m, compiled
                gc.collect()
            out.sum().backward()
            results.append(table.values().copy() if fused else weight.grad.to_dense().numpy())
        np.testing.assert_array_equal(results[0], results[1])
    finally:
        torch._dynamo.reset()


# ------------------------------------------------------------------ apply_optimizer_in_backward
def _in_backward(cls, params, kwargs):
    from torch.distributed.optim import _apply_optimizer_in_backward

    _apply_optimizer_in_backward(cls, params, kwargs)


def _rowwise_adagrad():
    return pytest.importorskip("torchrec.optim.rowwise_adagrad", reason="torchrec is not installed").RowWiseAdagrad


@pytest.mark.parametrize("name", ["sgd", "adagrad_lr_decay", "rowwise_adagrad", "sparse_adam"])
def test_apply_optimizer_in_backward_trains_fused_as_pytorch(rng, name):
    """TorchRec's way to ask for a fused optimizer: the first lookup after
    apply_optimizer_in_backward trains the table fused with the engine's
    equal of that optimizer, which ends as PyTorch's in-backward optimizer on
    nn.EmbeddingBag (sparse gradients for SparseAdam, dense for the others)."""
    cls, kwargs = {
        "sgd": (torch.optim.SGD, {"lr": 0.1}),
        "adagrad_lr_decay": (torch.optim.Adagrad, {"lr": 0.1, "lr_decay": 0.05, "initial_accumulator_value": 0.1}),
        "rowwise_adagrad": (_rowwise_adagrad() if name == "rowwise_adagrad" else None, {"lr": 0.1, "eps": 1e-8}),
        "sparse_adam": (torch.optim.SparseAdam, {"lr": 0.01, "betas": (0.8, 0.99)}),
    }[name]
    w = uniform_weights(rng, ROWS, DIM)
    kw = dict(freeze=False, mode="sum", include_last_offset=True)
    ref = torch.nn.EmbeddingBag.from_pretrained(w.clone(), sparse=name == "sparse_adam", **kw)
    ours = et.EmbeddingBag.from_pretrained(w, **kw)
    for m in (ref, ours):
        _in_backward(cls, m.parameters(), kwargs)
    assert not ours.fused
    _train(rng, [(ref, None), (ours, None)], 4, "sum", weighted=True)
    assert ours.fused and ours.table.step == 4 and ours.weight.grad is None
    assert max_diff(ours.weight, ref.weight) <= 1e-5
    assert type(et.FusedOptimizer(ours).param_groups[0]["optimizer"]) is str


@pytest.mark.parametrize("name", ["sgd", "adagrad"])
def test_apply_optimizer_in_backward_s_rate_changes_are_followed(rng, name):
    """TorchRec's recipe schedules the in-backward optimizers
    (param._in_backward_optimizers): a fused table steps with their rate,
    which fused_optimizer shows too (the rate was read once, at fusing)."""
    cls, kwargs = {"sgd": (torch.optim.SGD, {"lr": 0.1}),
                   "adagrad": (torch.optim.Adagrad, {"lr": 0.1, "initial_accumulator_value": 0.1})}[name]
    w = uniform_weights(rng, ROWS, DIM)
    kw = dict(freeze=False, mode="sum", include_last_offset=True)
    ref = torch.nn.EmbeddingBag.from_pretrained(w.clone(), **kw)
    ours = et.EmbeddingBag.from_pretrained(w, **kw)
    schedulers = []
    for m in (ref, ours):
        _in_backward(cls, m.parameters(), kwargs)
        schedulers += [torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.1) for o in m.weight._in_backward_optimizers]
    for _ in range(3):
        _train(rng, [(ref, None), (ours, None)], 1, "sum", weighted=False)
        for sch in schedulers:
            sch.step()
    assert ours.fused and ours.table.step == 3
    assert max_diff(ours.weight, ref.weight) <= 1e-6
    # The in-backward optimizer's load_state_dict replaces its groups: their rate is still the one followed.
    for m in (ref, ours):
        opt = m.weight._in_backward_optimizers[0]
        opt.load_state_dict(opt.state_dict())
        opt.param_groups[0]["lr"] = 0.0
    before = ours.table.to_numpy().copy()
    _train(rng, [(ref, None), (ours, None)], 1, "sum", weighted=False)
    np.testing.assert_array_equal(ours.table.to_numpy(), before)
    assert et.FusedOptimizer(ours).param_groups[0]["lr"] == 0.0  # fused_optimizer shows the rate followed
    # A rate set on fused_optimizer shows on the in-backward optimizer too.
    et.FusedOptimizer(ours).param_groups[0]["lr"] = 0.05
    _train(rng, [(ours, None)], 1, "sum", weighted=False)
    assert ours.weight._in_backward_optimizers[0].param_groups[0]["lr"] == 0.05


def test_in_backward_scheduler_checkpoint_resumes_bit_identically(rng, tmp_path):
    """TorchRec's scheduler recipe (a scheduler on
    param._in_backward_optimizers), checkpointed as documented (ec.save,
    fused_optimizer.state_dict(), the scheduler's state_dict()) between a
    step and the next lookup: fused_optimizer shows the rate the next step
    uses, and the resumed run is bit-identical to an uninterrupted one, which
    follows TorchRec's collection with the same recipe."""
    torchrec = pytest.importorskip("torchrec")
    cfgs = [torchrec.EmbeddingBagConfig(num_embeddings=37, embedding_dim=8, name="t1", feature_names=["f1"])]
    batches = []
    for _ in range(6):
        ids, offsets, _ = bags(rng, 37, 4)
        batches.append(torchrec.KeyedJaggedTensor.from_lengths_sync(keys=["f1"], values=ids, lengths=offsets.diff()))
    start = torchrec.EmbeddingBagCollection(tables=cfgs, device=torch.device("cpu")).state_dict()

    def make(cls=et.EmbeddingBagCollection):
        m = cls(tables=cfgs)
        m.load_state_dict(start)
        _in_backward(torch.optim.Adagrad, m.parameters(), {"lr": 0.1, "initial_accumulator_value": 0.1})
        opt = m.embedding_bags.t1.weight._in_backward_optimizers[0]
        return m, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.3)

    def train(m, sched, bs):
        for kjt in bs:
            m(kjt).values().pow(2).sum().backward()
            sched.step()

    theirs, their_sched = make(torchrec.EmbeddingBagCollection)
    whole, whole_sched = make()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the scheduler steps with no optimizer.step(): the recipe's)
        train(theirs, their_sched, batches)
        train(whole, whole_sched, batches)
        assert max_diff(whole.embedding_bags.t1.weight, theirs.embedding_bags.t1.weight) <= 1e-6
        first, first_sched = make()
        train(first, first_sched, batches[:2])
        ib = first.embedding_bags.t1.weight._in_backward_optimizers[0]
        assert ib.param_groups[0]["lr"] == pytest.approx(0.03)
        ec.save(str(tmp_path / "ck"), first)
        saved, saved_sched = first.fused_optimizer.state_dict(), first_sched.state_dict()
        assert saved["param_groups"][0]["lr"] == ib.param_groups[0]["lr"]  # before any lookup
        assert copy.deepcopy(first).fused_optimizer.param_groups[0]["lr"] == ib.param_groups[0]["lr"]  # a copy too
        resumed, resumed_sched = make()
        _ = resumed.fused_optimizer  # (fuses the table, as documented, so that it takes the optimizer's slots)
        ec.load(str(tmp_path / "ck"), into=resumed)
        resumed.fused_optimizer.load_state_dict(saved)
        resumed_sched.load_state_dict(saved_sched)
        train(resumed, resumed_sched, batches[2:])  # the loaded rate reaches the in-backward optimizer at the lookup
    assert torch.equal(resumed.embedding_bags.t1.weight, whole.embedding_bags.t1.weight)
    assert resumed.fused_optimizer.state_dict()["param_groups"][0]["lr"] == \
        whole.fused_optimizer.state_dict()["param_groups"][0]["lr"]
    # A rate written on fused_optimizer reaches the in-backward optimizer at the next lookup; one written there
    # shows in fused_optimizer's state_dict() at once.
    resumed.fused_optimizer.param_groups[0]["lr"] = 0.5
    ib = resumed.embedding_bags.t1.weight._in_backward_optimizers[0]
    resumed(batches[0])
    assert ib.param_groups[0]["lr"] == 0.5
    ib.param_groups[0]["lr"] = 0.25
    assert resumed.fused_optimizer.state_dict()["param_groups"][0]["lr"] == 0.25
    assert resumed.fused_optimizer.param_groups[0]["lr"] == 0.25


def test_apply_optimizer_in_backward_option_changes_are_refused(rng):
    """The engine's optimizer follows the in-backward optimizer's lr only: a
    scheduler cycling its betas raises, before any table steps, rather than
    being ignored."""
    ours = et.EmbeddingBag(ROWS, DIM, mode="sum", include_last_offset=True)
    _in_backward(torch.optim.SparseAdam, ours.parameters(), {"lr": 0.01, "betas": (0.9, 0.999)})
    _train(rng, [(ours, None)], 1, "sum", weighted=False)
    ours.weight._in_backward_optimizers[0].param_groups[0]["betas"] = (0.85, 0.999)
    before = ours.table.to_numpy().copy()
    with pytest.raises(ValueError, match=r"made from apply_optimizer_in_backward's optimizer with betas=\(0.9, "
                                         r"0.999\); that optimizer's betas is now \(0.85, 0.999\)"):
        _train(rng, [(ours, None)], 1, "sum", weighted=False)
    np.testing.assert_array_equal(ours.table.to_numpy(), before)
    # Changed before the first lookup (the engine's optimizer is made from the kwargs): refused at that lookup.
    fresh = et.EmbeddingBag(ROWS, DIM, mode="sum", include_last_offset=True)
    _in_backward(torch.optim.SparseAdam, fresh.parameters(), {"lr": 0.01})
    fresh.weight._in_backward_optimizers[0].param_groups[0]["betas"] = (0.5, 0.9)
    before = fresh.table.to_numpy().copy()
    with pytest.raises(ValueError, match=r"with betas=\(0.9, 0.999\); that optimizer's betas is now \(0.5, 0.9\)"):
        _train(rng, [(fresh, None)], 1, "sum", weighted=False)
    np.testing.assert_array_equal(fresh.table.to_numpy(), before)


def test_apply_optimizer_in_backward_on_a_torchrec_collection(rng):
    """The TorchRec recipe, unchanged but for the module: a KJT collection
    with RowWiseAdagrad in backward equals TorchRec's own collection."""
    torchrec = pytest.importorskip("torchrec")
    RowWiseAdagrad = _rowwise_adagrad()
    cfgs = [torchrec.EmbeddingBagConfig(num_embeddings=30, embedding_dim=4, name="t1", feature_names=["f1"]),
            torchrec.EmbeddingBagConfig(num_embeddings=20, embedding_dim=8, name="t2", feature_names=["f2"])]
    theirs = torchrec.EmbeddingBagCollection(tables=cfgs, device=torch.device("cpu"))
    ours = et.EmbeddingBagCollection(cfgs)
    ours.load_state_dict(theirs.state_dict())
    for m in (theirs, ours):
        _in_backward(RowWiseAdagrad, m.parameters(), {"lr": 0.05})
    for _ in range(3):
        values, lengths = [], []
        for rows in (30, 20):
            ids, offsets, _ = bags(rng, rows, 6)
            values.append(ids)
            lengths.append(offsets.diff())
        kjt = torchrec.KeyedJaggedTensor.from_lengths_sync(keys=["f1", "f2"], values=torch.cat(values),
                                                           lengths=torch.cat(lengths))
        g = torch.randn(6, 12)
        for m in (theirs, ours):
            (m(kjt).values() * g).sum().backward()
    for t in ("t1", "t2"):
        assert max_diff(ours.embedding_bags[t].weight, theirs.embedding_bags[t].weight) <= 1e-5
        assert ours.embedding_bags[t].table.step == 3
    state = ours.fused_optimizer.state_dict()["state"]
    assert tuple(state["embedding_bags.t1.weight"]["row_accumulators"].shape) == (30, 1)


@pytest.mark.parametrize("flat", [False, True])
def test_torchrec_rowwise_adagrad_state_loads_and_training_goes_on(rng, flat):
    """TorchRec's RowWiseAdagrad keeps {"step", "sum": [rows, 1]}: loaded
    into a table trained fused from that optimizer ("sum" is its
    row_accumulators; a flat [rows] one too), training goes on along
    TorchRec's trajectory."""
    torchrec = pytest.importorskip("torchrec")
    RowWiseAdagrad = _rowwise_adagrad()
    cfgs = [torchrec.EmbeddingBagConfig(num_embeddings=37, embedding_dim=8, name="t1", feature_names=["f1"])]

    def batch():
        ids, offsets, _ = bags(rng, 37, 4)
        return torchrec.KeyedJaggedTensor.from_lengths_sync(keys=["f1"], values=ids, lengths=offsets.diff())

    theirs = torchrec.EmbeddingBagCollection(tables=cfgs, device=torch.device("cpu"))
    opt = RowWiseAdagrad(theirs.parameters(), lr=0.1)
    for _ in range(3):
        theirs(batch()).values().pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    state = dict(opt.state[theirs.embedding_bags.t1.weight])
    assert tuple(state["sum"].shape) == (37, 1)
    if flat:
        state["sum"] = state["sum"].reshape(-1)
    ours = et.EmbeddingBagCollection(cfgs)
    ours.load_state_dict(theirs.state_dict())
    _in_backward(RowWiseAdagrad, ours.parameters(), {"lr": 0.1})
    ours.load_optimizer_state_dict({"state": {"embedding_bags.t1.weight": state}})
    loaded = ours.fused_optimizer.state_dict()["state"]["embedding_bags.t1.weight"]
    assert torch.equal(loaded["row_accumulators"], opt.state[theirs.embedding_bags.t1.weight]["sum"])
    for _ in range(3):
        kjt = batch()
        theirs(kjt).values().pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
        ours(kjt).values().pow(2).sum().backward()
    assert max_diff(ours.embedding_bags.t1.weight, theirs.embedding_bags.t1.weight) <= 1e-6
    assert max_diff(ours.fused_optimizer.state_dict()["state"]["embedding_bags.t1.weight"]["row_accumulators"],
                    opt.state[theirs.embedding_bags.t1.weight]["sum"]) <= 1e-5
    # A slot the table lacks is still refused, naming it.
    with pytest.raises(ValueError, match=r"has no slot 'exp_avg'; its slots are \['row_accumulators'\]"):
        ours.load_optimizer_state_dict({"state": {"embedding_bags.t1.weight": {"exp_avg": state["sum"]}}})


def test_apply_optimizer_in_backward_refusals_leave_the_table_unfused(rng):
    w = uniform_weights(rng, ROWS, DIM)
    ids, offsets, _ = bags(rng, ROWS, 4)
    for cls, kwargs, match in [(torch.optim.Adam, {"lr": 0.1}, "Adam.*no engine equivalent"),
                               (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, "momentum"),
                               (torch.optim.Adagrad, {"lr": 0.1, "weight_decay": 0.01}, "weight_decay")]:
        m = et.EmbeddingBag.from_pretrained(w, freeze=False, mode="sum", include_last_offset=True)
        _in_backward(cls, m.parameters(), kwargs)
        with pytest.raises(NotImplementedError, match=match):
            m(ids, offsets)
        assert not m.fused and m.table.optimizer is None and torch.equal(m.weight, w)
    m = et.EmbeddingBag.from_pretrained(w, freeze=False, mode="sum", include_last_offset=True)
    _in_backward(torch.optim.SGD, m.parameters(), {"lr": 0.1})
    _in_backward(torch.optim.Adagrad, m.parameters(), {"lr": 0.1})
    with pytest.raises(NotImplementedError, match="2 optimizers"):
        m(ids, offsets)
    # Already fused by optimizer=: the two would disagree.
    m = et.EmbeddingBag.from_pretrained(w, freeze=False, mode="sum", include_last_offset=True,
                                        optimizer=ec.optimizers.SGD(0.1))
    _in_backward(torch.optim.Adagrad, m.parameters(), {"lr": 0.1})
    with pytest.raises(ValueError, match="optimizer= SGD.*apply_optimizer_in_backward"):
        m(ids, offsets)


@pytest.mark.parametrize("kind", ["bag_dict", "bag_kjt", "sequence_dict"])
def test_apply_optimizer_in_backward_a_refusal_fuses_no_table_of_the_module(kind):
    """fused_optimizer (and tables_of, ec.save, ...) fuse every pending table:
    one whose optimizer the engine lacks is refused, naming it, before any
    table switches (was: the tables before it had switched, unnamed). The
    collection's first forward too (was: it switched t0 and t1, then raised
    for t2); once t2's optimizer is one the engine has, a forward fuses all
    three."""
    features = {f"f{i}": torch.tensor([[1, 2], [3, 4]]) for i in range(3)}
    if kind == "bag_kjt":
        torchrec = pytest.importorskip("torchrec")
        features = torchrec.KeyedJaggedTensor.from_lengths_sync(
            keys=list(features), values=torch.arange(12) % 10, lengths=torch.full((6,), 2))
    if kind == "sequence_dict":
        ebc = et.EmbeddingCollection([et.EmbeddingConfig(10, 4, name=f"t{i}", feature_names=[f"f{i}"])
                                      for i in range(3)])
    else:
        ebc = et.EmbeddingBagCollection([et.EmbeddingBagConfig(10, 4, name=f"t{i}", feature_names=[f"f{i}"])
                                         for i in range(3)])
    modules = list(ebc.children())[0].values()
    ps = [b.weight for b in modules]
    before = [p.detach().clone() for p in ps]
    _in_backward(torch.optim.Adagrad, ps[:2], {"lr": 0.1})
    _in_backward(torch.optim.Adam, ps[2:], {"lr": 0.1})
    for how in (lambda: ebc.fused_optimizer, lambda: et.tables_of(ebc), lambda: ebc(features)):
        with pytest.raises(NotImplementedError, match=r"\(table 't2'\): apply_optimizer_in_backward\(Adam, "):
            how()
        assert [(b.fused, b.table.optimizer, b._group) for b in modules] == [(False, None, None)] * 3
        assert all(torch.equal(p, b) for p, b in zip(ps, before))
    for attr in ("_optimizer_classes", "_optimizer_kwargs", "_in_backward_optimizers"):
        delattr(ps[2], attr)
    _in_backward(torch.optim.Adagrad, ps[2:], {"lr": 0.1})
    out = ebc(features)
    values = out.values() if kind == "bag_kjt" else torch.cat([v.reshape(-1) for v in out.values()])
    values.sum().backward()
    assert [(b.fused, type(b.table.optimizer).__name__, b.table.step) for b in modules] == [(True, "Adagrad", 1)] * 3
    assert all(not torch.equal(p, b) for p, b in zip(ps, before))


def test_apply_optimizer_in_backward_a_first_lookup_fuses_only_its_own_table():
    """A table's first lookup checks its collection's pending tables but
    fuses only itself: a sibling that a compiled graph looked up unfused
    (traced before any eager call) stays unfused, and the backward through
    both graphs trains it with PyTorch's optimizer (a version that fused
    every sibling at once made that backward raise: the sibling's weight
    got a gradient of its own)."""
    ebc = et.EmbeddingBagCollection([et.EmbeddingBagConfig(10, 4, name=f"t{i}", feature_names=[f"f{i}"])
                                     for i in range(2)])
    b0, b1 = ebc.embedding_bags["t0"], ebc.embedding_bags["t1"]
    _in_backward(torch.optim.Adagrad, [b0.weight, b1.weight], {"lr": 0.1})
    ids, offsets = torch.tensor([1, 2, 3, 4]), torch.tensor([0, 2])
    before = b0.weight.detach().clone()
    out0 = torch.compile(lambda i, o: b0(i, o), backend="aot_eager")(ids, offsets)
    out1 = b1(ids, offsets)
    assert (b0.fused, b1.fused) == (False, True)
    (out0.sum() + out1.sum()).backward()
    assert not b0.fused and b1.table.step == 1
    assert not torch.equal(b0.weight.detach(), before)  # (PyTorch's Adagrad stepped it)


@pytest.mark.parametrize("copy_kind", ["shallow", "deep"])
def test_apply_optimizer_in_backward_a_copied_collection_refuses_all_or_none(copy_kind):
    """A shallow copy of a collection keeps the first lookup's check of
    every pending table, and so does the original, once a copy is gone (a
    shallow copy shares the original's tables, which keep their link to
    it; a deep copy's tables link to the copy)."""
    import copy
    import gc

    ebc = et.EmbeddingBagCollection([et.EmbeddingBagConfig(10, 4, name=f"t{i}", feature_names=[f"f{i}"])
                                     for i in range(3)])
    ps = [b.weight for b in ebc.embedding_bags.values()]
    _in_backward(torch.optim.Adagrad, ps[:2], {"lr": 0.1})
    _in_backward(torch.optim.Adam, ps[2:], {"lr": 0.1})
    features = {f"f{i}": torch.tensor([[1, 2], [3, 4]]) for i in range(3)}
    other = copy.copy(ebc) if copy_kind == "shallow" else copy.deepcopy(ebc)
    if copy_kind == "shallow":  # (a deep copy's weights are new Parameters, which PyTorch copies without
        with pytest.raises(NotImplementedError, match=r"\(table 't2'\)"):  # their in-backward optimizers)
            other(features)
        assert [b.fused for b in other.embedding_bags.values()] == [False] * 3
    survivor = copy.copy(ebc) if copy_kind == "shallow" else ebc
    del other
    gc.collect()
    with pytest.raises(NotImplementedError, match=r"\(table 't2'\)"):
        ebc(features)
    assert [b.fused for b in ebc.embedding_bags.values()] == [False] * 3
    del ebc  # (a shallow copy that outlives its original)
    gc.collect()
    with pytest.raises(NotImplementedError, match=r"\(table 't2'\)"):
        survivor(features)
    assert [b.fused for b in survivor.embedding_bags.values()] == [False] * 3


def test_apply_optimizer_in_backward_state_exists_before_the_first_lookup(rng):
    """TorchRec's order: apply_optimizer_in_backward, then restore the fused
    optimizer's state, then train; a parent's fused_optimizer made before a
    table fused is made anew."""
    w = uniform_weights(rng, ROWS, DIM)
    kw = dict(freeze=False, mode="sum", include_last_offset=True)

    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = et.EmbeddingBag.from_pretrained(w, optimizer=ec.optimizers.SGD(0.1), **kw)
            self.b = et.EmbeddingBag.from_pretrained(w, **kw)

    model = Two()
    assert list(et.FusedOptimizer(model).state_dict()["state"]) == ["a.weight"]
    early = model.a.fused_optimizer  # made while only `a` trains fused
    _in_backward(torch.optim.Adagrad, model.b.parameters(), {"lr": 0.1})
    opt = et.FusedOptimizer(model)  # fuses b now
    assert model.b.fused and list(opt.state_dict()["state"]) == ["a.weight", "b.weight"]
    acc = torch.full((ROWS, DIM), 0.5)
    opt.load_state_dict({"state": {"b.weight": {"sum": acc, "step": 7}}})
    assert model.b.table.step == 7 and np.array_equal(model.b.table.slots()["accumulators"], acc.numpy())
    assert early is model.a.fused_optimizer
    c = et.EmbeddingBag.from_pretrained(w, **kw)
    _in_backward(torch.optim.Adagrad, c.parameters(), {"lr": 0.1})
    assert list(c.optimizer_state_dict()["state"]) == ["weight"] and c.fused


def test_apply_optimizer_in_backward_leaves_a_table_pytorch_already_stepped_to_pytorch(rng):
    """Once PyTorch's optimizer holds state for the weight (a module compiled
    before any eager call trains unfused), the table is not converted: that
    state would be lost."""
    w = uniform_weights(rng, ROWS, DIM)
    m = et.EmbeddingBag.from_pretrained(w, freeze=False, mode="sum", include_last_offset=True, sparse=True)
    _in_backward(torch.optim.Adagrad, m.parameters(), {"lr": 0.1})
    m.weight._in_backward_optimizers[0].state[m.weight]["step"] = torch.tensor(3.0)  # as after three steps
    ids, offsets, _ = bags(rng, ROWS, 4)
    (m(ids, offsets) * torch.randn(4, DIM)).sum().backward()
    assert not m.fused and m.table.optimizer is None and not torch.equal(m.weight, w)


def test_apply_optimizer_in_backward_refuses_a_gradient_of_the_weight_itself(rng):
    w = uniform_weights(rng, ROWS, DIM)
    m = et.EmbeddingBag.from_pretrained(w, freeze=False, mode="sum", include_last_offset=True)
    _in_backward(torch.optim.Adagrad, m.parameters(), {"lr": 0.1})
    ids, offsets, _ = bags(rng, ROWS, 4)
    (m(ids, offsets) * torch.randn(4, DIM)).sum().backward()
    assert m.fused and m.table.step == 1
    with pytest.raises(RuntimeError, match="weight got a gradient of its own"):
        ((m(ids, offsets) ** 2).sum() + (m.weight ** 2).sum()).backward()


@pytest.mark.parametrize("how", ["as made", "unfrozen later", "deep-copied", "pickled"])
def test_optimizer_refuses_a_gradient_of_the_weight_itself(rng, how):
    """With optimizer= too (as with apply_optimizer_in_backward, above): a
    gradient of the fused weight itself (a tied output projection, a penalty)
    raises in backward. It was kept in weight.grad and never applied (the
    docs' dense optimizer leaves the weight out) while the lookups' rows
    stepped. A copy's weight, or one unfrozen after it was made, refuses too;
    a frozen one gets no gradient."""
    import copy
    import pickle

    w = uniform_weights(rng, ROWS, DIM)
    m = et.EmbeddingBag.from_pretrained(w, freeze=how == "unfrozen later", mode="sum", include_last_offset=True,
                                        optimizer=ec.optimizers.SGD(0.1))
    ids, offsets, _ = bags(rng, ROWS, 4)
    if how == "unfrozen later":
        assert not m(ids, offsets).requires_grad  # frozen: no hook
        m.weight.requires_grad_(True)
    elif how == "deep-copied":
        m = copy.deepcopy(m)
    elif how == "pickled":
        m = pickle.loads(pickle.dumps(m))
    before = m.table.to_numpy().copy()
    with pytest.raises(RuntimeError, match=r"trains fused with the engine's SGD \(optimizer=\).*weight got a "
                                           r"gradient of its own"):
        out = m(ids, offsets)
        (torch.nn.functional.linear(out, m.weight).sum() + (m.weight ** 2).sum()).backward()
    # The lookups alone still train it.
    (m(ids, offsets) * torch.randn(4, DIM)).sum().backward()
    assert m.weight.grad is None and not np.array_equal(m.table.to_numpy(), before)


def test_apply_optimizer_in_backward_with_lr_decay_pickles(rng):
    import pickle

    w = uniform_weights(rng, ROWS, DIM)
    kw = dict(freeze=False, mode="sum", include_last_offset=True)
    m = et.EmbeddingBag.from_pretrained(w, **kw)
    _in_backward(_rowwise_adagrad(), m.parameters(), {"lr": 0.1, "lr_decay": 0.5})
    _train(rng, [(m, None)], 2, "sum")
    copy = pickle.loads(pickle.dumps(m))
    group = copy.fused_optimizer.param_groups[0]
    assert copy.fused and copy.table.step == 2 and (group["lr"], group["lr_decay"]) == (0.1, 0.5)
    _train(np.random.default_rng(5), [(m, None)], 2, "sum")
    _train(np.random.default_rng(5), [(copy, None)], 2, "sum")
    assert torch.equal(copy.weight, m.weight)


def test_apply_optimizer_in_backward_lr_decay_follows_the_groups_lr_as_pytorch(rng):
    """Adagrad's lr_decay applies to the param group's current "lr", as a
    scheduler or a hand sets it: PyTorch's steps, and PyTorch's group."""
    w = uniform_weights(rng, ROWS, DIM)
    kw = dict(freeze=False, mode="sum", include_last_offset=True)
    kwargs = {"lr": 0.5, "lr_decay": 0.1, "initial_accumulator_value": 0.1}
    ref = torch.nn.EmbeddingBag.from_pretrained(w.clone(), **kw)
    ref_opt = torch.optim.Adagrad(ref.parameters(), **kwargs)
    ours = et.EmbeddingBag.from_pretrained(w, **kw)
    _in_backward(torch.optim.Adagrad, ours.parameters(), kwargs)
    opts = (ref_opt, ours.fused_optimizer)
    schedulers = [torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.5) for o in opts]
    for step in range(4):
        _train(rng, list(zip((ref, ours), opts)), 1, "sum", weighted=True)
        for s in schedulers:
            s.step()
        if step == 2:
            for o in opts:
                o.param_groups[0]["lr"] = 0.3  # by hand
        assert ours.fused_optimizer.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]
        assert max_diff(ours.weight, ref.weight) <= 1e-5


def test_apply_optimizer_in_backward_rate_float32_cannot_hold_changes_nothing(rng):
    w = uniform_weights(rng, ROWS, DIM)
    m = et.EmbeddingBag.from_pretrained(w, freeze=False, mode="sum", include_last_offset=True)
    _in_backward(torch.optim.SGD, m.parameters(), {"lr": 1e39})
    ids, offsets, _ = bags(rng, ROWS, 4)
    with pytest.raises(ValueError, match="learning_rate must be within float32's range"):
        m(ids, offsets)
    assert not m.fused and m.table.optimizer is None


def test_apply_optimizer_in_backward_then_frozen_fuses_without_training(rng):
    w = uniform_weights(rng, ROWS, DIM)
    m = et.EmbeddingBag.from_pretrained(w, freeze=False, mode="sum", include_last_offset=True)
    _in_backward(torch.optim.Adagrad, m.parameters(), {"lr": 0.1})
    m.weight.requires_grad_(False)
    ids, offsets, _ = bags(rng, ROWS, 4)
    out = m(ids, offsets)  # the table fuses; the frozen weight takes no hook and no step
    assert m.fused and not out.requires_grad and m.table.step == 0 and torch.equal(m.weight, w)


@pytest.mark.parametrize("kind", ["bag", "collection"])
def test_threads_training_one_fused_table_step_at_their_rates(kind):
    """Threads training one fused table with a rate that depends on the step
    (a schedule; an in-backward Adagrad's lr_decay): each step takes its own
    step's rate (the rate and the step are one, as Table.apply_gradients
    makes them), so the result is the sequential one (was: two backwards
    could read one step's rate, a different sum each run)."""
    import threading

    threads, steps = 4, 40
    schedule = ec.optimizers.SGD(lambda s: s + 1.0)
    if kind == "bag":
        m = et.EmbeddingBag(10, 4, mode="sum", optimizer=schedule, initializer=ec.initializers.Zeros())
        args = (torch.tensor([3]), torch.tensor([0]))
        weight = m.weight
    else:
        torchrec = pytest.importorskip("torchrec")
        cfg = et.EmbeddingBagConfig(num_embeddings=10, embedding_dim=4, name="t", feature_names=["f"],
                                    weight_init_min=0.0, weight_init_max=0.0)
        m = et.EmbeddingBagCollection(tables=[cfg], optimizer=schedule)
        args = (torchrec.KeyedJaggedTensor.from_lengths_sync(keys=["f"], values=torch.tensor([3]),
                                                             lengths=torch.tensor([1])),)
        weight = m.embedding_bags.t.weight
    errors = []
    start = threading.Barrier(threads)

    def train():
        try:
            start.wait()
            for _ in range(steps):
                out = m(*args)
                (out.values() if kind == "collection" else out).sum().backward()
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    workers = [threading.Thread(target=train) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert not errors, errors
    n = threads * steps
    expected = -sum(float(k + 1) for k in range(n))  # d out / d row 3 = 1; the rate of step k is k + 1
    assert torch.equal(weight[3], torch.full((4,), expected))


@pytest.mark.parametrize("pooling", ["mean", "sqrtn"])
@pytest.mark.parametrize("sparse", [True, False])
def test_unfused_host_gradient_of_weighted_mean_and_sqrtn_bags(monkeypatch, pooling, sparse):
    """Weighted mean / sqrtn bags through a collection's dict input (one
    feature a table: the host gradient's path), weights with zeros,
    negatives, bags whose weights sum to 0, denormals and 1e20: the host
    gradient is the general path's bit for bit (NaN and inf included), and
    no NumPy warning is raised (PyTorch's ops give them silently)."""
    from embedcore.adapters.torch import _ops
    host, taken = _ops._host_table_grad, []

    def spy(*args):
        r = host(*args)
        taken.append(r is not None)
        return r

    rng = np.random.default_rng(11)
    for case in range(40):
        n_ids, bags = int(rng.integers(0, 40)), int(rng.integers(1, 10))
        ids = torch.from_numpy(rng.integers(0, 30, n_ids))
        offsets = torch.from_numpy(np.concatenate([[0], np.sort(rng.integers(0, n_ids + 1, bags - 1)), [n_ids]]))
        w = torch.from_numpy(rng.choice(np.array([0.0, 1.0, -1.0, 0.5, -0.5, 2.0, 1e-30, 3e-39, 1e20, -1e20],
                                                 np.float32), n_ids))
        grads = []
        for fast in (True, False):
            monkeypatch.setattr(_ops, "_host_table_grad", spy if fast else (lambda *a: None))
            torch.manual_seed(0)
            ebc = et.EmbeddingBagCollection([et.EmbeddingBagConfig(num_embeddings=30, embedding_dim=5, name="t",
                                                                   feature_names=["f"], pooling=pooling)],
                                            sparse=sparse)
            out = ebc({"f": {"values": ids, "offsets": offsets, "weights": w}})["f"]
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                out.backward(torch.from_numpy(np.random.default_rng(case).standard_normal(out.shape,
                                                                                          dtype=np.float32)))
            g = ebc.embedding_bags["t"].weight.grad
            grads.append((g._indices(), g._values()) if sparse else (None, g))
        (i0, v0), (i1, v1) = grads
        assert i0 is None or torch.equal(i0, i1), case
        assert np.array_equal(v0.numpy().view(np.int32), v1.numpy().view(np.int32)), case  # bits: NaN too
    assert taken and all(taken)
