"""State of the PyTorch adapter's modules: state_dict weights that view the
engine's memory, load_state_dict from PyTorch modules, the fused optimizers'
state, ec.save / ec.load / Saver, copies and pickles."""
import copy
import gc
import os
import pickle

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import embedcore as ec  # noqa: E402
import embedcore.adapters.torch as et  # noqa: E402
from embedcore.adapters.torch import _ops  # noqa: E402
from torch_helpers import bags, engine_optimizer, max_diff, uniform_weights  # noqa: E402

ROWS, DIM = 40, 5


def _step(m, rng, n=1):
    for _ in range(n):
        ids, offsets, _ = bags(rng, ROWS, 8)
        g = torch.from_numpy(rng.standard_normal((8, DIM)).astype(np.float32))
        (m(ids, offsets[:-1]) * g).sum().backward()


def _addr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def test_state_dict_views_engine_memory(rng):
    m = et.EmbeddingBag(ROWS, DIM, optimizer=engine_optimizer("adam", 0.1))
    sd = m.state_dict()
    assert list(sd) == ["weight"]
    assert sd["weight"].data_ptr() == _addr(m.table.values())
    m.table.assign(np.ones((ROWS, DIM), np.float32))
    assert float(sd["weight"].min()) == 1.0  # a view, not a copy
    state = m.optimizer_state_dict()["state"]["weight"]
    for name, view in m.table.slots().items():
        assert state[name].data_ptr() == _addr(view)


@pytest.mark.parametrize("source", ["embedding_bag", "embedding"])
@pytest.mark.parametrize("assign", [False, True])
def test_load_from_torch_modules(rng, source, assign):
    ref = (torch.nn.EmbeddingBag(ROWS, DIM) if source == "embedding_bag" else torch.nn.Embedding(ROWS, DIM))
    m = et.EmbeddingBag(ROWS, DIM, mode="sum")
    m.load_state_dict(ref.state_dict(), assign=assign)  # always copied into the engine, even with assign=True
    assert m.weight.data_ptr() == _addr(m.table.values())
    assert np.array_equal(m.table.values(), ref.weight.detach().numpy())
    with pytest.raises(RuntimeError, match="size mismatch"):
        m.load_state_dict({"weight": torch.zeros(ROWS + 1, DIM)})
    # Not a tensor: said so, in PyTorch's words (not as a size mismatch).
    with pytest.raises(RuntimeError, match=r"expected torch.Tensor or Tensor-like object from checkpoint but received "
                                           r"<class 'numpy.ndarray'>. \(No table was changed.\)"):
        m.load_state_dict({"weight": np.zeros((ROWS, DIM), np.float32)})


def test_conversions_that_would_detach_are_refused():
    m = et.EmbeddingBag(ROWS, DIM)
    m.to("cpu")
    m.float()
    with pytest.raises(NotImplementedError):
        m.half()
    with pytest.raises(NotImplementedError):
        m.to(torch.float64)
    assert m.weight.data_ptr() == _addr(m.table.values())


@pytest.mark.parametrize("name", ["sgd", "adagrad", "adam"])
def test_optimizer_state_roundtrip_resumes_bit_exact(rng, name):
    w = uniform_weights(rng, ROWS, DIM)
    a = et.EmbeddingBag.from_pretrained(w, freeze=False, optimizer=engine_optimizer(name, 0.05))
    _step(a, rng, 3)
    b = et.EmbeddingBag(ROWS, DIM, optimizer=engine_optimizer(name, 0.05))
    b.load_state_dict(a.state_dict())
    b.load_optimizer_state_dict(a.optimizer_state_dict())
    assert b.table.step == 3
    seed = int(rng.integers(1 << 30))
    _step(a, np.random.default_rng(seed), 2)
    _step(b, np.random.default_rng(seed), 2)
    assert torch.equal(a.weight, b.weight)
    for k, v in a.table.slots().items():
        assert np.array_equal(v, b.table.slots()[k])


def _torch_trained(rng, make_optimizer):
    """nn.EmbeddingBag(sparse=True) after three steps of a PyTorch optimizer."""
    w = uniform_weights(rng, ROWS, DIM)
    ref = torch.nn.EmbeddingBag.from_pretrained(w.clone(), freeze=False, sparse=True)
    opt = make_optimizer(ref.parameters())
    for _ in range(3):
        ids, offsets, _ = bags(rng, ROWS, 8)
        opt.zero_grad()
        ref(ids, offsets[:-1]).sum().backward()
        opt.step()
    return ref, opt


def _continues_as_torch(rng, ours, ref, opt):
    """One more step of each on the same batch gives the same table."""
    ids, offsets, _ = bags(rng, ROWS, 8)
    opt.zero_grad()
    ref(ids, offsets[:-1]).sum().backward()
    opt.step()
    ours(ids, offsets[:-1]).sum().backward()
    assert max_diff(ours.weight, ref.weight) <= 1e-5


def test_optimizer_state_from_sparse_adam(rng):
    """PyTorch's SparseAdam state (exp_avg / exp_avg_sq / step) loads into the
    fused Adam, and training continues as SparseAdam would."""
    ref, opt = _torch_trained(rng, lambda p: torch.optim.SparseAdam(p, lr=0.01))
    ours = et.EmbeddingBag(ROWS, DIM, optimizer=engine_optimizer("adam", 0.01))
    ours.load_state_dict(ref.state_dict())
    st = opt.state_dict()["state"][0]
    ours.load_optimizer_state_dict({"state": {"weight": st}})
    assert ours.table.step == 3
    _continues_as_torch(rng, ours, ref, opt)


@pytest.mark.parametrize("first, second", [("momentum1", "momentum2"), ("weight.momentum_1", "weight.momentum_2")],
                         ids=["collection", "fused module"])
def test_optimizer_state_of_torchrec_adam_slot_names(rng, first, second):
    """TorchRec's Adam state names the first moment (PyTorch's exp_avg)
    momentum1 and the second (exp_avg_sq) momentum2, or momentum_1 /
    momentum_2 in its fused modules: each loads into its own slot of the
    fused Adam, and training continues as SparseAdam would."""
    ref, opt = _torch_trained(rng, lambda p: torch.optim.SparseAdam(p, lr=0.01))
    ours = et.EmbeddingBag(ROWS, DIM, optimizer=engine_optimizer("adam", 0.01))
    ours.load_state_dict(ref.state_dict())
    st = opt.state_dict()["state"][0]
    et.FusedOptimizer(ours).load_state_dict(
        {"state": {"weight": {first: st["exp_avg"], second: st["exp_avg_sq"], "step": st["step"]}}})
    slots = ours.table.slots()
    np.testing.assert_array_equal(slots["momenta"], st["exp_avg"].numpy())
    np.testing.assert_array_equal(slots["velocities"], st["exp_avg_sq"].numpy())
    _continues_as_torch(rng, ours, ref, opt)


def test_optimizer_state_errors():
    m = et.EmbeddingBag(ROWS, DIM, optimizer=ec.optimizers.Adagrad(0.1))
    with pytest.raises(ValueError, match="'nope.weight', which is not a fused table"):
        m.load_optimizer_state_dict({"state": {"nope.weight": {}}})
    with pytest.raises(ValueError, match="weight: table .* has no slot 'momenta'"):
        m.load_optimizer_state_dict({"state": {"weight": {"momenta": torch.zeros(ROWS, DIM)}}})
    with pytest.raises(ValueError, match="shape"):
        m.load_optimizer_state_dict({"state": {"weight": {"accumulators": torch.zeros(3, DIM)}}})
    assert float(m.table.slots()["accumulators"].min()) == pytest.approx(0.1)  # nothing changed
    assert et.EmbeddingBag(ROWS, DIM).optimizer_state_dict() == {"state": {}, "param_groups": []}
    with pytest.raises(AttributeError):  # hasattr() is False (below)
        et.EmbeddingBag(ROWS, DIM).fused_optimizer


def test_torch_adagrad_state_loads_where_epsilon_allows_accumulators_of_0(rng):
    """PyTorch's Adagrad state (sums from 0) loads into the fused Adagrad
    that torch.optim.Adagrad maps to (epsilon 1e-10), and training continues
    as PyTorch's would."""
    ref, opt = _torch_trained(rng, lambda p: torch.optim.Adagrad(p, lr=0.1))
    ours = et.EmbeddingBag(ROWS, DIM, optimizer=ec.optimizers.Adagrad(0.1, initial_accumulator_value=0.0,
                                                                        epsilon=1e-10))
    ours.load_state_dict(ref.state_dict())
    st = opt.state_dict()["state"][0]
    assert float(st["sum"].min()) == 0.0  # rows no batch touched
    ours.load_optimizer_state_dict({"state": {"weight": st}})
    _continues_as_torch(rng, ours, ref, opt)


def test_collection_optimizer_state_keys():
    ebc = et.EmbeddingBagCollection([et.EmbeddingBagConfig(10, 3, name="a"), et.EmbeddingBagConfig(10, 3, name="b")],
                                    optimizer=ec.optimizers.Adagrad(0.1))
    sd = ebc.optimizer_state_dict()
    assert list(sd["state"]) == ["embedding_bags.a.weight", "embedding_bags.b.weight"]
    assert [g["params"] for g in sd["param_groups"]] == [["embedding_bags.a.weight"], ["embedding_bags.b.weight"]]
    # TorchRec's slot names (prefixed by the table) load too.
    ebc.load_optimizer_state_dict({"state": {"embedding_bags.b.weight": {"b.momentum1": torch.full((10, 3), 7.0)}}})
    assert float(ebc.embedding_bags["b"].table.slots()["accumulators"].min()) == 7.0
    # TorchRec's fused modules' (FusedEmbeddingBagCollection): "<table>.weight" keys, "momentum_1" slots.
    ebc.load_optimizer_state_dict({"state": {"b.weight": {"b.weight.momentum_1": torch.full((10, 3), 5.0)}}})
    assert float(ebc.embedding_bags["b"].table.slots()["accumulators"].max()) == 5.0
    with pytest.raises(ValueError, match=r"optimizer state for 'c.weight', which is not a fused table"):
        ebc.load_optimizer_state_dict({"state": {"c.weight": {"momentum_1": torch.full((10, 3), 5.0)}}})
    ebc.load_optimizer_state_dict({"param_groups": [{"params": ["b.weight"], "lr": 0.5}]})  # a group keyed so too
    assert ebc.fused_optimizer.param_groups[1]["lr"] == 0.5
    two = torch.nn.ModuleDict({"x": ebc, "y": et.EmbeddingBagCollection([et.EmbeddingBagConfig(10, 3, name="b")],
                                                                        optimizer=ec.optimizers.Adagrad(0.1))})
    with pytest.raises(ValueError, match=r"'b.weight', which names several fused tables"):
        et.FusedOptimizer(two).load_state_dict({"state": {"b.weight": {"momentum_1": torch.ones((10, 3))}}})


def test_optimizer_state_that_views_the_modules_own_slots_loads_as_it_was():
    """state_dict() gives views of the engine's slots: loaded back with two
    tables' state swapped, each table gets the other's, as torch.optim's
    load_state_dict gives (was: b read a's slot after a was overwritten, and
    kept its own state)."""
    ebc = et.EmbeddingBagCollection([et.EmbeddingBagConfig(10, 3, name="a"), et.EmbeddingBagConfig(10, 3, name="b")],
                                    optimizer=ec.optimizers.Adagrad(0.1))
    ka, kb = "embedding_bags.a.weight", "embedding_bags.b.weight"
    ebc.load_optimizer_state_dict({"state": {ka: {"accumulators": torch.full((10, 3), 2.0)},
                                             kb: {"accumulators": torch.full((10, 3), 5.0)}}})
    sd = ebc.optimizer_state_dict()
    ebc.load_optimizer_state_dict({"state": {ka: sd["state"][kb], kb: sd["state"][ka]}})
    assert (ebc.embedding_bags["a"].table.slots()["accumulators"] == 5.0).all()
    assert (ebc.embedding_bags["b"].table.slots()["accumulators"] == 2.0).all()
    ebc.load_optimizer_state_dict(ebc.optimizer_state_dict())  # its own state, as it is: nothing changes
    assert (ebc.embedding_bags["a"].table.slots()["accumulators"] == 5.0).all()
    assert (ebc.embedding_bags["b"].table.slots()["accumulators"] == 2.0).all()


@pytest.mark.parametrize("bad_b, exc, match", [
    ({"step": torch.tensor(-5)}, ValueError, r"step must be an int in \[0, 2\*\*62\]"),
    ({"step": 2**70}, ValueError, "step must be an int"),
    ({"accumulators": torch.full((10, 3), float("nan"))}, ValueError, "NaN or infinite"),
    ({"accumulators": torch.zeros((10, 3), dtype=torch.complex64)}, TypeError, "real floats"),
    # torch.optim.Adagrad's state (sums from 0, its eps 1e-10) into Adagrad with epsilon 0: a zero gradient
    # element would then step by 0 / 0 (NaN).
    ({"accumulators": torch.zeros((10, 3))}, ValueError,
     r"embedding_bags.b.weight: slot 'accumulators' must be >= 1.17549435e-38 \(with epsilon 0 .or subnormal, flushed to 0. the step divides .*"
     r"got 0.0"),
    ({"accumulators": torch.full((10, 3), -1.0)}, ValueError,
     r"slot 'accumulators' must be >= 1.17549435e-38 .*got -1.0"),
])
def test_a_bad_optimizer_state_changes_no_table(bad_b, exc, match):
    """Every table's state is checked before any table changes."""
    ebc = et.EmbeddingBagCollection([et.EmbeddingBagConfig(10, 3, name="a"), et.EmbeddingBagConfig(10, 3, name="b")],
                                    optimizer=ec.optimizers.Adagrad(0.1))
    before = {n: (ebc.embedding_bags[n].table.step, ebc.embedding_bags[n].table.slots()["accumulators"].copy())
              for n in ("a", "b")}
    with pytest.raises(exc, match=match):
        ebc.load_optimizer_state_dict({"state": {
            "embedding_bags.a.weight": {"step": torch.tensor(3), "accumulators": torch.full((10, 3), 2.0)},
            "embedding_bags.b.weight": bad_b}})
    for n, (step, acc) in before.items():
        assert ebc.embedding_bags[n].table.step == step
        np.testing.assert_array_equal(ebc.embedding_bags[n].table.slots()["accumulators"], acc)


@pytest.mark.parametrize("lr, exc, match", [
    (float("nan"), ValueError, "lr must be finite, >= 0"),
    (float("inf"), ValueError, "lr must be finite, >= 0"),
    (-0.1, ValueError, "lr must be finite, >= 0"),
    (1e39, ValueError, "lr must be .*float32's range"),
    ("0.1", TypeError, "lr must be a number"),
    (None, TypeError, "lr must be a number"),
])
def test_a_bad_learning_rate_loads_into_no_table(lr, exc, match):
    """load_state_dict refuses a rate the update cannot use, naming the group
    and its table, before any table or group changes (was: NaN loaded, and
    every later backward failed)."""
    ebc = et.EmbeddingBagCollection([et.EmbeddingBagConfig(10, 3, name="a"), et.EmbeddingBagConfig(10, 3, name="b")],
                                    optimizer=ec.optimizers.Adagrad(0.1))
    sd = ebc.optimizer_state_dict()
    sd = {"state": {"embedding_bags.a.weight": {"step": torch.tensor(4)}},
          "param_groups": [dict(sd["param_groups"][0], lr=0.5), dict(sd["param_groups"][1], lr=lr)]}
    with pytest.raises(exc, match=r"param_groups\[1\] \(table 'b'\): " + match):
        ebc.load_optimizer_state_dict(sd)
    assert [g["lr"] for g in ebc.fused_optimizer.param_groups] == [pytest.approx(0.1)] * 2
    assert ebc.embedding_bags["a"].table.step == 0
    sd["param_groups"][1]["lr"] = 0.25
    ebc.load_optimizer_state_dict(sd)
    assert [g["lr"] for g in ebc.fused_optimizer.param_groups] == [0.5, 0.25]
    assert ebc.embedding_bags["a"].table.step == 4


@pytest.mark.parametrize("optimizer, given", [(ec.optimizers.FTRL(0.1), "accumulators"),
                                               (ec.optimizers.Adam(0.1), "exp_avg")])
def test_a_state_of_some_of_a_table_s_slots_loads_into_no_table(optimizer, given):
    """A state giving some of a table's slots (FTRL's accumulators without
    its linears, Adam's first moment without its second) was loaded, the
    others left as they were: a state no training made. Refused, naming
    both, before any table changes, as TorchRec's KeyedOptimizer refuses
    it; a whole state, a step alone, or no state for a table still load."""
    ebc = et.EmbeddingBagCollection([et.EmbeddingBagConfig(6, 3, name="a"), et.EmbeddingBagConfig(6, 3, name="b")],
                                    optimizer=optimizer)
    whole = ebc.optimizer_state_dict()
    slots = {n: v.clone() for n, v in whole["state"]["embedding_bags.b.weight"].items()}
    before = {n: ebc.embedding_bags[n].table.slots() for n in ("a", "b")}
    partial = {"state": {"embedding_bags.a.weight": slots,  # whole: would load, but b's is partial
                         "embedding_bags.b.weight": {given: torch.full((6, 3), 5.0), "step": torch.tensor(100)}}}
    with pytest.raises(ValueError, match=r"embedding_bags.b.weight: its optimizer state gives slots \[.*\] but not "
                                         r"\['.*'\] of table 'b'.*all of a table's slots or none"):
        ebc.fused_optimizer.load_state_dict(partial)
    for n in ("a", "b"):
        for k, v in ebc.embedding_bags[n].table.slots().items():
            np.testing.assert_array_equal(v, before[n][k])
        assert ebc.embedding_bags[n].table.step == 0
    ebc.fused_optimizer.load_state_dict({"state": {"embedding_bags.b.weight": {"step": torch.tensor(3)}}})
    assert ebc.embedding_bags["b"].table.step == 3
    ebc.fused_optimizer.load_state_dict(whole)
    assert ebc.embedding_bags["b"].table.step == 0


class _ShardedLike(torch.Tensor):
    """A tensor with local shards, as TorchRec's DMP keeps its fused
    optimizers' state (ShardedTensor; torch.numel of one raised an internal
    RuntimeError)."""

    def local_shards(self):
        return []


@pytest.mark.parametrize("sd, exc, match", [
    (None, TypeError, "must be a dict"),
    ({"state": None}, TypeError, r'state_dict\["state"\] must be a dict'),
    ({"state": {"weight": None}}, TypeError, "weight: its optimizer state must be a dict"),
    ({"state": {"weight": {"accumulators": "zeros"}}}, TypeError, "weight: slot 'accumulators' must be a tensor"),
    ({"state": {"weight": {"accumulators": None}}}, TypeError, "weight: slot 'accumulators' must be a tensor"),
    ({"state": {"weight": {"accumulators": [["a"] * DIM] * ROWS}}}, TypeError, "slot 'accumulators' must be a"),
    ({"state": {"weight": {"accumulators": torch.ones(ROWS, DIM).to_sparse()}}}, TypeError, "dense"),
    ({"state": {"weight": {"accumulators": torch.ones(ROWS, DIM).as_subclass(_ShardedLike)}}}, ValueError,
     r"weight: slot 'accumulators' is a _ShardedLike, the state of a sharded module: gather each table's shards"),
    ({"state": {"weight": {3: torch.ones(ROWS, DIM)}}}, TypeError, "weight: a slot name must be a str"),
    ({"state": {"other.weight": {}}}, ValueError, "'other.weight', which is not a fused table"),
    ({"state": {"weight": {"momenta": torch.ones(ROWS, DIM)}}}, ValueError, "weight: table .* has no slot 'momenta'"),
    ({"state": {"weight": {"accumulators": torch.full((ROWS, DIM), 0.5, dtype=torch.float64).index_fill_(
        1, torch.tensor([1]), 1e39)}}}, ValueError,
     r"weight: slot 'accumulators' holds 1e\+39 at flat index 1, beyond float32's range"),
    ({"param_groups": None}, TypeError, r'state_dict\["param_groups"\] must be a list'),
    ({"param_groups": [None]}, TypeError, r"param_groups\[0\] must be a dict"),
    ({"param_groups": [{"params": "weight", "lr": 1.0}]}, TypeError, r'param_groups\[0\]\["params"\] must be a list'),
])
def test_malformed_optimizer_state_is_refused_naming_it(sd, exc, match):
    """Malformed optimizer state raises ValueError / TypeError naming the
    key (was: AttributeError, KeyError, or torch.as_tensor's own error), and
    changes nothing."""
    m = et.EmbeddingBag(ROWS, DIM, optimizer=ec.optimizers.Adagrad(0.1))
    full = {"state": {"weight": {"step": torch.tensor(2), "accumulators": torch.full((ROWS, DIM), 3.0)}},
            "param_groups": [{"params": ["weight"], "lr": 0.5}]}
    if isinstance(sd, dict):
        sd = {**full, **sd} if "state" not in sd else {**sd, "param_groups": full["param_groups"]}
    with pytest.raises(exc, match=match):
        m.load_optimizer_state_dict(sd)
    assert m.table.step == 0 and m.fused_optimizer.param_groups[0]["lr"] == pytest.approx(0.1)
    assert float(m.table.slots()["accumulators"].max()) == pytest.approx(0.1)


def test_optimizer_state_in_a_tensor_subclass_loads():
    """Only sharded tensors are refused: other subclasses (tensordict's
    MemoryMappedTensor, say) hold the whole slot and load."""
    class Plain(torch.Tensor):
        pass

    m = et.EmbeddingBag(ROWS, DIM, optimizer=ec.optimizers.Adagrad(0.1))
    m.load_optimizer_state_dict({"state": {"weight": {"step": torch.tensor(2),
                                                      "accumulators": torch.full((ROWS, DIM), 3.0).as_subclass(Plain)}},
                                 "param_groups": [{"params": ["weight"], "lr": 0.5}]})
    assert m.table.step == 2 and float(m.table.slots()["accumulators"].min()) == 3.0


def test_a_bad_learning_rate_fails_in_the_forward_before_any_table_steps():
    """Dict inputs give each table its own backward: a rate set bad (NaN, by
    hand, a scheduler or a load) raised only in its table's, after the other
    tables had stepped, without naming the table. The forward now checks
    every fused table's rate and names the table."""
    cfgs = [et.EmbeddingBagConfig(num_embeddings=10, embedding_dim=3, name="t1", feature_names=["fa"]),
            et.EmbeddingBagConfig(num_embeddings=10, embedding_dim=3, name="t2", feature_names=["fb"])]
    ebc = et.EmbeddingBagCollection(cfgs, optimizer=ec.optimizers.Adagrad(0.1))
    inputs = {"fa": torch.tensor([1, 2]), "fb": torch.tensor([3, 4])}
    before = {n: ebc.embedding_bags[n].table.to_numpy().copy() for n in ("t1", "t2")}
    for bad, exc in ((float("nan"), ValueError), (float("inf"), ValueError), ("fast", TypeError)):
        ebc.fused_optimizer.param_groups[0]["lr"] = bad
        with pytest.raises(exc, match="table 't1'.*param group"):
            ebc(inputs)
        for n, values in before.items():
            np.testing.assert_array_equal(ebc.embedding_bags[n].table.to_numpy(), values)
            assert ebc.embedding_bags[n].table.step == 0
    with torch.no_grad():  # no training, no update: the rate is not used
        ebc(inputs)
    # Set bad between forward and backward: the backward names the table too.
    ebc.fused_optimizer.param_groups[0]["lr"] = 0.1
    out = ebc(inputs)
    ebc.fused_optimizer.param_groups[0]["lr"] = float("nan")
    with pytest.raises(ValueError, match="table 't1'"):
        out["fa"].sum().backward()
    assert ebc.embedding_bags["t1"].table.step == 0
    ebc.fused_optimizer.param_groups[0]["lr"] = 0.1
    out = ebc(inputs)
    (out["fa"].sum() + out["fb"].sum()).backward()
    assert [ebc.embedding_bags[n].table.step for n in ("t1", "t2")] == [1, 1]


@pytest.mark.parametrize("how", ["save_load", "saver"])
def test_checkpoints_of_modules(rng, tmp_path, how):
    ebc = et.EmbeddingBagCollection([et.EmbeddingBagConfig(ROWS, DIM, name="a", feature_names=["x"]),
                                     et.EmbeddingBagConfig(ROWS, DIM, name="b", feature_names=["y"])],
                                    optimizer=engine_optimizer("adam", 0.1))

    def train(n):
        for _ in range(n):
            i1, o1, _ = bags(rng, ROWS, 4)
            i2, o2, _ = bags(rng, ROWS, 4)
            out = ebc({"x": (i1, o1), "y": (i2, o2)})
            (out["x"].sum() + out["y"].sum()).backward()

    train(2)
    want = {k: v.detach().clone() for k, v in ebc.state_dict().items()}
    want_slots = {k: {n: t.clone() for n, t in s.items()} for k, s in ebc.optimizer_state_dict()["state"].items()}
    if how == "save_load":
        ec.save(tmp_path / "ckpt", ebc)
    else:
        assert ec.Saver().dump_to_file(ebc, tmp_path / "ckpt") == "OK"
    train(2)
    views = {k: v for k, v in ebc.state_dict().items()}
    if how == "save_load":
        ec.load(tmp_path / "ckpt", into=ebc)
    else:
        assert ec.Saver().restore_from_file(ebc, tmp_path / "ckpt") == "OK"
    for k, v in want.items():
        assert torch.equal(views[k], v)  # restored in place: the module's tensors see it
    for k, s in ebc.optimizer_state_dict()["state"].items():
        for n, t in s.items():
            assert torch.equal(t, want_slots[k][n])
    # A plain EmbeddingBag, and tables_of() for any model holding adapter modules.
    m = et.EmbeddingBag(ROWS, DIM, name="solo")
    ec.save(tmp_path / "solo", m)
    model = torch.nn.Sequential(et.EmbeddingBag(ROWS, DIM, name="solo"))
    ec.load(tmp_path / "solo", into=et.tables_of(model))
    assert torch.equal(model[0].weight, m.weight)
    # Two modules made without name= both hold "embedding_bag": named by their paths, with the remedy.
    twins = torch.nn.Sequential(et.EmbeddingBag(ROWS, DIM), torch.nn.Sequential(et.EmbeddingBag(ROWS, DIM)))
    with pytest.raises(ValueError, match=r"tables_of: the modules '0' and '1\.0' both hold a table named "
                                         r"'embedding_bag'; .* \(name=\.\.\.\)"):
        et.tables_of(twins)


def test_checkpoints_record_the_modules_pooling(rng, tmp_path):
    """A module's mode (a collection's pooling) is its table's combiner: a
    checkpoint records it, and serving that checkpoint with its default
    combiner gives the module's output."""
    bag = et.EmbeddingBag(ROWS, DIM, mode="sqrtn", name="bag", include_last_offset=True)
    ebc = et.EmbeddingBagCollection([et.EmbeddingBagConfig(ROWS, DIM, name="a", feature_names=["x"], pooling="mean")])
    assert bag.table.combiner == "sqrtn" and ebc.embedding_bags["a"].table.combiner == "mean"
    ids, offsets, _ = bags(rng, ROWS, 6)
    outputs = {"bag": lambda: bag(ids, offsets), "a": lambda: ebc({"x": (ids, offsets)})["x"]}
    for module, name in ((bag, "bag"), (ebc, "a")):
        ec.save(tmp_path / name, module)
        served = ec.serving.open(tmp_path / name).tables[name]  # looks up with the recorded combiner by default
        np.testing.assert_allclose(served.lookup(ids.numpy(), offsets.numpy()), outputs[name]().detach().numpy(),
                                   rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "copy"])
def test_copies_are_independent_tables(rng, how):
    """Also copy.copy: a module of its own table (the original's weight
    pointed at the copy's table before, and its next lookup raised)."""
    a = et.EmbeddingBag(ROWS, DIM, mode="sum", optimizer=engine_optimizer("adagrad", 0.1), padding_idx=1)
    _step(a, rng, 2)
    b = {"deepcopy": copy.deepcopy, "copy": copy.copy, "pickle": lambda m: pickle.loads(pickle.dumps(m))}[how](a)
    assert b.table is not a.table and b._handle != a._handle
    assert torch.equal(a.weight, b.weight) and b.weight.data_ptr() == _addr(b.table.values())
    assert b.table.step == 2 and np.array_equal(a.table.slots()["accumulators"], b.table.slots()["accumulators"])
    before = a.weight.detach().clone()
    _step(b, rng, 1)
    assert torch.equal(a.weight, before) and not torch.equal(b.weight, before)
    assert b.padding_idx == 1 and b.fused_optimizer.param_groups[0]["params"][0] is b.weight
    assert a.weight.data_ptr() == _addr(a.table.values())  # the original trains on, its own table
    _step(a, rng, 1)
    assert a.table.step == 3 and b.table.step == 3 and not torch.equal(a.weight, before)


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
@pytest.mark.parametrize("sparse", [False, True])
def test_a_model_copied_with_its_torch_optimizer_trains_as_nn(rng, how, sparse):
    """copy.deepcopy((model, optimizer)) or a pickle of both, mid-training:
    the copied optimizer holds the copy's weight and steps the copy's table,
    as with nn.EmbeddingBag (it held an orphan copy of the weight, and the
    copied model stopped learning, silently)."""
    copy_of = {"deepcopy": copy.deepcopy, "pickle": lambda x: pickle.loads(pickle.dumps(x))}[how]
    w0 = torch.as_tensor(uniform_weights(rng, ROWS, DIM))
    batches = [bags(rng, ROWS, 8)[:2] for _ in range(3)]
    weights = []
    for cls in (torch.nn.EmbeddingBag, et.EmbeddingBag):
        m = cls.from_pretrained(w0.clone(), freeze=False, mode="sum", sparse=sparse)
        opt = (torch.optim.SparseAdam if sparse else torch.optim.Adam)(m.parameters(), lr=0.1)
        for k, (ids, offsets) in enumerate(batches):
            if k == 1:
                m, opt = copy_of((m, opt))
                assert opt.param_groups[0]["params"][0] is m.weight
            opt.zero_grad()
            m(ids, offsets[:-1]).pow(2).sum().backward()
            opt.step()
        weights.append(m.weight.detach().clone())
    assert max_diff(weights[0], weights[1]) <= 1e-6
    assert max_diff(weights[1], w0) > 0.1


@pytest.mark.parametrize("how", ["copy", "deepcopy", "pickle"])
def test_copies_of_a_fused_optimizer_keep_their_tables(rng, how):
    """A copy of ``fused_optimizer`` had no tables (torch.optim.Optimizer's
    state drops them: its state_dict() raised AttributeError). copy.copy
    shares the module's tables and groups; deepcopy and pickle copy the
    module too, and the copy's rate is the one its copied table steps with."""
    def make():
        m = et.EmbeddingBag(ROWS, DIM, mode="sum", name="t", optimizer=engine_optimizer("adagrad", 0.1))
        m.load_state_dict({"weight": uniform_weights(np.random.default_rng(3), ROWS, DIM)})
        _step(m, np.random.default_rng(4), 2)
        return m

    a, reference = make(), make()
    opt = a.fused_optimizer
    torch.optim.lr_scheduler.StepLR(opt, 1)  # (its "initial_lr", and a key of the user's: kept, as torch's copies)
    opt.param_groups[0]["mine"] = 1
    copied = {"copy": copy.copy, "deepcopy": copy.deepcopy, "pickle": lambda o: pickle.loads(pickle.dumps(o))}[how](opt)
    (key, module), = copied._entries
    assert key == "weight" and (module is a) == (how == "copy")
    assert copied.param_groups[0] is module._group and copied.param_groups[0]["params"][0] is module.weight
    assert copied.param_groups[0]["mine"] == 1 and copied.param_groups[0]["initial_lr"] == 0.1
    state, original = copied.state_dict(), opt.state_dict()
    assert state["param_groups"] == original["param_groups"]
    assert all(torch.equal(state["state"]["weight"][k], v) for k, v in original["state"]["weight"].items())
    before = a.weight.detach().clone()
    copied.param_groups[0]["lr"] = 0.5
    reference.fused_optimizer.param_groups[0]["lr"] = 0.5
    _step(module, np.random.default_rng(5), 1)
    _step(reference, np.random.default_rng(5), 1)
    assert torch.equal(module.weight, reference.weight)
    assert torch.equal(a.weight, before) == (how != "copy")
    assert opt.param_groups[0]["lr"] == (0.5 if how == "copy" else 0.1)
    torch.optim.lr_scheduler.StepLR(copied, 1, last_epoch=3)  # resumes on the copy (KeyError: 'initial_lr' before)


def test_the_state_dict_after_a_load_shows_the_scheduled_rate_of_the_loaded_step(rng, tmp_path):
    def schedule(step):
        return 0.1 / (1 + step)

    trained = et.EmbeddingBag(ROWS, DIM, name="t", optimizer=ec.optimizers.Adagrad(schedule))
    _step(trained, rng, 3)
    assert trained.fused_optimizer.param_groups[0]["lr"] == pytest.approx(schedule(3))
    ec.save(tmp_path / "c", trained)
    resumed = et.EmbeddingBag(ROWS, DIM, name="t", optimizer=ec.optimizers.Adagrad(schedule))
    ec.load(tmp_path / "c", into=resumed)
    assert resumed.table.step == 3
    assert resumed.fused_optimizer.state_dict()["param_groups"][0]["lr"] == pytest.approx(schedule(3))


def test_a_load_fuses_an_in_backward_table_first_to_fill_its_slots(rng, tmp_path):
    """ec.load into a module whose table apply_optimizer_in_backward named,
    before any lookup or fused_optimizer fused it: the slots load (the load
    used to refuse, pointing at include_optimizer=False, which drops them)."""
    from torch.distributed.optim import _apply_optimizer_in_backward

    def make():
        m = et.EmbeddingBag(ROWS, DIM, name="t")
        _apply_optimizer_in_backward(torch.optim.Adagrad, m.parameters(), {"lr": 0.1, "eps": 1e-10})
        return m

    trained = make()
    _step(trained, rng, 2)
    ec.save(tmp_path / "c", trained)
    resumed = make()
    ec.load(tmp_path / "c", into=resumed)
    assert resumed.table.step == 2
    np.testing.assert_array_equal(resumed.table.slots()["accumulators"], trained.table.slots()["accumulators"])
    _step(trained, np.random.default_rng(5), 1)
    _step(resumed, np.random.default_rng(5), 1)
    assert torch.equal(resumed.weight, trained.weight)


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copies_keep_the_initializer(rng, how):
    """reset_parameters() of a copy gives back the values the table was built
    with, and its checkpoint records the initializer (copies had Zeros)."""
    init = ec.initializers.Uniform(-0.1, 0.1, seed=1)
    ebc = et.EmbeddingBagCollection([et.EmbeddingBagConfig(num_embeddings=ROWS, embedding_dim=DIM, name="a",
                                                           feature_names=["f"], initializer=init)],
                                    optimizer=ec.optimizers.Adagrad(0.1))
    built = ebc.embedding_bags["a"].weight.detach().clone()
    ids, offsets, _ = bags(rng, ROWS, 4)
    ebc({"f": (ids, offsets)})["f"].sum().backward()
    copied = copy.deepcopy(ebc) if how == "deepcopy" else pickle.loads(pickle.dumps(ebc))
    table = copied.embedding_bags["a"].table
    assert table.config.initializer == init
    assert torch.equal(copied.embedding_bags["a"].weight, ebc.embedding_bags["a"].weight)  # the trained values
    copied.reset_parameters()
    assert torch.equal(copied.embedding_bags["a"].weight, built)


def test_deleted_module_releases_its_table():
    m = et.EmbeddingBag(ROWS, DIM)
    handle = m._handle
    assert handle in _ops._REGISTRY
    del m
    gc.collect()
    assert handle not in _ops._REGISTRY


def test_weight_cut_off_from_the_table_is_refused(rng):
    """share_memory() would move weight to new memory, and weight.data = ...
    replaces its storage: either would leave the table and the module
    disagreeing after the next fused update."""
    m = et.EmbeddingBag(ROWS, DIM, optimizer=ec.optimizers.SGD(0.1))
    with pytest.raises(NotImplementedError, match="cannot be moved to shared memory"):
        m.share_memory()
    ids, offsets, _ = bags(rng, ROWS, 4)
    m(ids, offsets)  # still attached
    # A parent's share_memory() (nn.Module's: in place, through _apply) and to_empty() are refused too, and
    # leave the module attached (share_memory had moved the weight, and every later lookup failed).
    parent = torch.nn.Sequential(m, torch.nn.Linear(DIM, 1))
    with pytest.raises(NotImplementedError, match="cannot be moved to shared memory"):
        parent.share_memory()
    with pytest.raises(NotImplementedError, match=r"cannot be moved to new memory \(to_empty"):
        parent.to_empty(device="cpu")
    before = m.table.to_numpy().copy()
    m(ids, offsets).sum().backward()  # attached: the fused step moves the table and the weight sees it
    assert not np.array_equal(m.table.to_numpy(), before)
    np.testing.assert_array_equal(m.weight.detach().numpy(), m.table.to_numpy())
    m.weight.data = m.weight.data.clone()
    with pytest.raises(RuntimeError, match="weight no longer views the engine's table"):
        m(ids, offsets)


@pytest.mark.parametrize("bad", ["shape", "missing"])
def test_a_bad_state_dict_changes_no_table(bad):
    """PyTorch copies module by module and reports errors at the end: the
    collection checks every table's weight first, so a bad one leaves every
    table as it was."""
    ebc = et.EmbeddingBagCollection([et.EmbeddingBagConfig(10, 3, name="a"), et.EmbeddingBagConfig(10, 3, name="b")])
    before = {n: ebc.embedding_bags[n].table.to_numpy().copy() for n in ("a", "b")}
    sd = {"embedding_bags.a.weight": torch.ones(10, 3), "embedding_bags.b.weight": torch.ones(11, 3)}
    if bad == "missing":
        del sd["embedding_bags.b.weight"]
    with pytest.raises(RuntimeError, match="No table was changed"):
        ebc.load_state_dict(sd)
    for n, values in before.items():
        np.testing.assert_array_equal(ebc.embedding_bags[n].table.to_numpy(), values)
    if bad == "missing":  # strict=False loads what is there
        ebc.load_state_dict(sd, strict=False)
        assert (ebc.embedding_bags["a"].table.to_numpy() == 1).all()


def test_a_meta_tensor_changes_no_table():
    """A weight on the meta device passes the shape check but cannot be
    copied: refused before table a is written (was: a loaded, then an error)."""
    ebc = et.EmbeddingBagCollection([et.EmbeddingBagConfig(10, 3, name="a"), et.EmbeddingBagConfig(10, 3, name="b")])
    before = {n: ebc.embedding_bags[n].table.to_numpy() for n in ("a", "b")}
    sd = {"embedding_bags.a.weight": torch.ones(10, 3), "embedding_bags.b.weight": torch.ones(10, 3, device="meta")}
    with pytest.raises(RuntimeError, match="meta device.*No table was changed"):
        ebc.load_state_dict(sd)
    for n, values in before.items():
        np.testing.assert_array_equal(ebc.embedding_bags[n].table.to_numpy(), values)
    ebc.load_state_dict({"embedding_bags.a.weight": torch.ones(10, 3, dtype=torch.int64),  # ints cast, as PyTorch
                         "embedding_bags.b.weight": torch.ones(10, 3)})
    assert (ebc.embedding_bags["a"].table.to_numpy() == 1).all()


@pytest.mark.parametrize("dtype, bad, match", [
    (torch.float16, 1e6, r"\[3, 1\] = 1000000.0 is beyond the range of the table's storage dtype float16"),
    (torch.bfloat16, 1e300, r"\[3, 1\] = 1e\+300 is beyond the range of the table's storage dtype bfloat16"),
    (torch.float32, 1e300, r"\[3, 1\] = 1e\+300 is beyond the range of the table's storage dtype float32"),
    (torch.float16, float("nan"), r"\[3, 1\] = nan is not finite"),
    (torch.float32, float("inf"), r"\[3, 1\] = inf is not finite"),
])
def test_a_weight_the_table_cannot_hold_changes_no_table(dtype, bad, match):
    """A value that is not finite, or that would round to infinity in the
    table's dtype, is refused as Table.assign refuses it, naming the key and
    the index, before table a is written (was: stored as inf / NaN, and
    ec.save then refused the table)."""
    ebc = et.EmbeddingBagCollection([et.EmbeddingBagConfig(4, 2, name=n, dtype=dtype) for n in ("a", "b")])
    before = {n: ebc.embedding_bags[n].table.to_numpy() for n in ("a", "b")}
    w = torch.zeros(4, 2, dtype=torch.float64)
    w[3, 1] = bad
    with pytest.raises(ValueError, match="embedding_bags.b.weight" + match + r".*No table was changed"):
        ebc.load_state_dict({"embedding_bags.a.weight": torch.ones(4, 2), "embedding_bags.b.weight": w})
    for n, values in before.items():
        np.testing.assert_array_equal(ebc.embedding_bags[n].table.to_numpy(), values)
    model = torch.nn.ModuleDict({"e": et.Embedding(4, 2, dtype=dtype)})  # in a model: PyTorch's order and error
    values = model["e"].table.to_numpy()
    with pytest.raises(RuntimeError, match="e.weight" + match):
        model.load_state_dict({"e.weight": w})
    np.testing.assert_array_equal(model["e"].table.to_numpy(), values)
    w[3, 1] = torch.finfo(dtype).max  # the dtype's largest: taken
    model.load_state_dict({"e.weight": w})
    assert model["e"].table.to_numpy()[3, 1] == torch.finfo(dtype).max


@pytest.mark.parametrize("wdtype", [torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fn, torch.float8_e5m2])
def test_weights_of_unsigned_and_float8_dtypes_are_checked_as_the_others(wdtype):
    """Unsigned ints wider than 8 bits skipped the range check (65535 in a
    float16 table loaded as inf: lookups returned inf, and only ec.save
    refused it), and float8 weights or slots raised PyTorch's own
    NotImplementedError ("aminmax_cpu" / "isfinite" not implemented).
    Both load as nn.EmbeddingBag loads them (copy_), or are refused as
    the other dtypes are, naming the key and the index."""
    ebc = et.EmbeddingBagCollection([et.EmbeddingBagConfig(4, 2, name=n, dtype=torch.float16) for n in ("a", "b")])
    before = {n: ebc.embedding_bags[n].table.to_numpy() for n in ("a", "b")}
    w = torch.zeros(4, 2).to(wdtype)
    if not wdtype.is_floating_point:
        w[3, 1] = 65535
        with pytest.raises(ValueError, match=r"embedding_bags.b.weight\[3, 1\] = 65535 is beyond the range of the "
                                             r"table's storage dtype float16.*No table was changed"):
            ebc.load_state_dict({"embedding_bags.a.weight": torch.ones(4, 2), "embedding_bags.b.weight": w})
        for n, values in before.items():
            np.testing.assert_array_equal(ebc.embedding_bags[n].table.to_numpy(), values)
        w[3, 1] = 65504  # float16's largest: taken
    else:
        w[3, 1] = 0.5
    ebc.load_state_dict({"embedding_bags.a.weight": torch.ones(4, 2), "embedding_bags.b.weight": w})
    ref = torch.nn.EmbeddingBag(4, 2, dtype=torch.float16)
    ref.load_state_dict({"weight": w})
    np.testing.assert_array_equal(ebc.embedding_bags["b"].table.to_numpy(), ref.weight.detach().numpy())
    if wdtype.is_floating_point:  # a fused table's slot of float8 too
        bag = et.EmbeddingBag(4, 2, optimizer=ec.optimizers.Adagrad(0.1))
        state = bag.fused_optimizer.state_dict()
        key = next(iter(state["state"]))
        slot = next(n for n in state["state"][key] if n != "step")
        state["state"][key][slot] = torch.full(tuple(state["state"][key][slot].shape), 0.5).to(wdtype)
        bag.fused_optimizer.load_state_dict(state)
        assert (bag.fused_optimizer.state_dict()["state"][key][slot] == 0.5).all()


@pytest.mark.parametrize("bad", ["sparse_coo", "sparse_csr", "quantized", "bits16"])
def test_a_weight_copy_refuses_changes_no_table(bad):
    """A weight of the right shape that copy_ refuses (a sparse layout, a
    quantized or bit-field dtype) is refused, naming its key, before table a
    is written (was: a loaded, then PyTorch's error for b)."""
    ebc = et.EmbeddingBagCollection([et.EmbeddingBagConfig(4, 2, name="a"), et.EmbeddingBagConfig(5, 2, name="b")])
    before = {n: ebc.embedding_bags[n].table.to_numpy().copy() for n in ("a", "b")}
    good = torch.ones(5, 2)
    value = {"sparse_coo": lambda: good.to_sparse(), "sparse_csr": lambda: good.to_sparse_csr(),
             "quantized": lambda: torch.quantize_per_tensor(good, 0.1, 0, torch.quint8),
             "bits16": lambda: torch.zeros(5, 2, dtype=torch.bits16)}[bad]
    with pytest.warns(UserWarning) if bad == "quantized" else _no_warning():
        sd = {"embedding_bags.a.weight": torch.ones(4, 2), "embedding_bags.b.weight": value()}
    expect = "torch.sparse_coo tensor" if bad == "sparse_coo" else "torch.sparse_csr tensor" if bad == "sparse_csr" \
        else "has dtype torch.quint8.*dequantize" if bad == "quantized" else "has dtype torch.bits16"
    with pytest.raises(RuntimeError, match=f"embedding_bags.b.weight.*{expect}.*No table was changed"):
        ebc.load_state_dict(sd)
    with pytest.raises(RuntimeError, match="No table was changed"):
        ebc.load_state_dict(sd, strict=False)
    for n, values in before.items():
        np.testing.assert_array_equal(ebc.embedding_bags[n].table.to_numpy(), values)
    sd["embedding_bags.b.weight"] = good  # and a dense one loads
    ebc.load_state_dict(sd)
    assert (ebc.embedding_bags["b"].table.to_numpy() == 1).all()


def _no_warning():
    import contextlib

    return contextlib.nullcontext()


def test_unexpected_key_changes_no_table():
    """strict=True with a key the module does not have: PyTorch loads every
    table and then raises; the adapter refuses before writing any."""
    ebc = et.EmbeddingBagCollection([et.EmbeddingBagConfig(10, 3, name="a"), et.EmbeddingBagConfig(10, 3, name="b")])
    before = {n: ebc.embedding_bags[n].table.to_numpy().copy() for n in ("a", "b")}
    sd = {"embedding_bags.a.weight": torch.ones(10, 3), "embedding_bags.b.weight": torch.ones(10, 3),
          "embedding_bags.c.weight": torch.ones(10, 3)}
    with pytest.raises(RuntimeError, match='Unexpected key.*"embedding_bags.c.weight".*No table was changed'):
        ebc.load_state_dict(sd)
    for n, values in before.items():
        np.testing.assert_array_equal(ebc.embedding_bags[n].table.to_numpy(), values)
    ebc.load_state_dict(sd, strict=False)  # as PyTorch: strict=False ignores it
    assert (ebc.embedding_bags["b"].table.to_numpy() == 1).all()


def test_optimizer_state_from_torch_adagrad(rng):
    """torch.optim.Adagrad keeps "step" as a float tensor: its state loads
    (was: ValueError "step must be an int"), and training continues as it would."""
    ref, opt = _torch_trained(rng, lambda p: torch.optim.Adagrad(p, lr=0.05, initial_accumulator_value=0.1,
                                                                 eps=1e-10))
    st = opt.state_dict()["state"][0]
    assert st["step"].dtype == torch.float32
    ours = et.EmbeddingBag(ROWS, DIM, optimizer=engine_optimizer("adagrad", 0.05))
    ours.load_state_dict(ref.state_dict())
    ours.load_optimizer_state_dict({"state": {"weight": st}})
    assert ours.table.step == 3
    _continues_as_torch(rng, ours, ref, opt)
    with pytest.raises(ValueError, match="step must be an int"):
        ours.load_optimizer_state_dict({"state": {"weight": {"step": torch.tensor(2.5)}}})


# ------------------------------------------------------------------ convert_state_dict
def _torchrec_model(torchrec):
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.sparse = torchrec.EmbeddingBagCollection(tables=[
                torchrec.EmbeddingBagConfig(num_embeddings=30, embedding_dim=4, name="t1", feature_names=["f1"]),
                torchrec.EmbeddingBagConfig(num_embeddings=20, embedding_dim=8, name="t2", feature_names=["f2"])],
                device=torch.device("cpu"))
            self.seq = torchrec.EmbeddingCollection(tables=[
                torchrec.EmbeddingConfig(num_embeddings=15, embedding_dim=4, name="s1", feature_names=["q"])],
                device=torch.device("cpu"))
            self.dense = torch.nn.Linear(4, 1)

    torch.manual_seed(0)
    model = Model()
    with torch.no_grad():  # a 16-bit table too: its bits must survive
        model.seq.embeddings["s1"].weight.data = model.seq.embeddings["s1"].weight.to(torch.bfloat16)
    return model


@pytest.mark.parametrize("saved_by", ["torch.save", "dcp.save"])
def test_convert_state_dict_serves_torchrec_collections(tmp_path, rng, saved_by):
    """torch.save(model.state_dict()) of a TorchRec model, or a
    torch.distributed.checkpoint of it -> a checkpoint that ec.serving
    serves: the pooled lookups of TorchRec's forward, and every table's
    values bit for bit in its dtype."""
    import warnings

    torchrec = pytest.importorskip("torchrec")
    model = _torchrec_model(torchrec)
    if saved_by == "torch.save":
        src = tmp_path / "model.pt"
        torch.save(model.state_dict(), src)
    else:
        import torch.distributed.checkpoint as dcp

        src = tmp_path / "dcp"
        with warnings.catch_warnings():  # (no process group: DCP saves as one process, and says so)
            warnings.simplefilter("ignore")
            dcp.save(model.state_dict(), checkpoint_id=src)
    assert et.convert_state_dict(src, tmp_path / "ckpt") == ["t1", "t2", "s1"]
    served = ec.serving.open(tmp_path / "ckpt", verify="eager")
    for name, w in [("t1", model.sparse.embedding_bags["t1"].weight), ("t2", model.sparse.embedding_bags["t2"].weight),
                    ("s1", model.seq.embeddings["s1"].weight)]:
        got = np.asarray(served.tables[name].values())
        bits = w.detach().view(torch.int16 if w.element_size() == 2 else torch.int32).numpy()
        assert got.dtype.itemsize == w.element_size() and got.tobytes() == bits.tobytes(), name
    ids1, off1, _ = bags(rng, 30, 6)
    ids2, off2, _ = bags(rng, 20, 6)
    kjt = torchrec.KeyedJaggedTensor.from_lengths_sync(keys=["f1", "f2"], values=torch.cat([ids1, ids2]),
                                                       lengths=torch.cat([off1.diff(), off2.diff()]))
    with torch.no_grad():
        want = model.sparse(kjt).to_dict()
    np.testing.assert_allclose(served.tables["t1"].lookup(ids1.numpy(), off1.numpy()), want["f1"].numpy(),
                               rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(served.tables["t2"].lookup(ids2.numpy(), off2.numpy()), want["f2"].numpy(),
                               rtol=1e-6, atol=1e-7)
    # One collection by its module path; the combiner given.
    assert et.convert_state_dict(src, tmp_path / "seq", prefix="seq", combiner="mean") == ["s1"]
    assert et.convert_state_dict(src, tmp_path / "sparse", prefix="sparse", combiner="mean") == ["t1", "t2"]
    got = ec.serving.open(tmp_path / "sparse").tables["t1"].lookup(ids1.numpy(), off1.numpy())  # pooled: mean
    lengths = off1.diff().numpy()
    long = lengths >= 2
    assert long.any()
    np.testing.assert_allclose(got[long], want["f1"].numpy()[long] / lengths[long, None], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("damage", ["missing", "truncated", "flipped"])
def test_convert_state_dict_of_a_damaged_dcp_directory_is_a_value_error(tmp_path, damage):
    """A torch.distributed.checkpoint whose data file is missing, cut short
    or damaged: DCP raises CheckpointException, a BaseException, which went
    past the adapter (and `embedcore convert` printed a traceback); it is
    the documented ValueError, in one line naming the cause, and nothing is
    written."""
    import glob
    import subprocess
    import sys
    import warnings

    import torch.distributed.checkpoint as dcp

    torchrec = pytest.importorskip("torchrec")
    src = tmp_path / "dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(_torchrec_model(torchrec).state_dict(), checkpoint_id=src)
    (data,) = glob.glob(str(src / "*.distcp"))
    if damage == "missing":
        os.remove(data)
    else:
        with open(data, "r+b") as f:
            if damage == "truncated":
                f.truncate(os.path.getsize(data) // 2)
            else:
                f.seek(200)
                byte = f.read(1)
                f.seek(200)
                f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(ValueError, match=f"{src}: cannot read its tables: ") as info:
        et.convert_state_dict(src, tmp_path / "out")
    assert "\n" not in str(info.value) and "CheckpointException" not in str(info.value), str(info.value)
    assert not (tmp_path / "out").exists()
    done = subprocess.run([sys.executable, "-m", "embedcore", "convert", "--from", "torch", str(src),
                           str(tmp_path / "out")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr
    assert "cannot read its tables" in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_convert_state_dict_of_a_bare_collection_with_prefix_empty(tmp_path):
    """prefix="" is the model itself: a bare TorchRec collection's state dict
    (keys embedding_bags.<table>.weight, no module path) converts, its tables
    alone where another module holds a table of the same name."""
    torchrec = pytest.importorskip("torchrec")
    torch.manual_seed(0)

    def collection():
        return torchrec.EmbeddingBagCollection(tables=[torchrec.EmbeddingBagConfig(
            num_embeddings=12, embedding_dim=4, name="t1", feature_names=["f1"])], device=torch.device("cpu"))

    bare, other = collection(), collection()
    state = {**bare.state_dict(), **{f"other.{k}": v for k, v in other.state_dict().items()}}
    torch.save(state, tmp_path / "m.pt")
    assert et.convert_state_dict(tmp_path / "m.pt", tmp_path / "bare", prefix="") == ["t1"]
    assert et.convert_state_dict(tmp_path / "m.pt", tmp_path / "other", prefix="other") == ["t1"]
    for name, ebc in (("bare", bare), ("other", other)):
        np.testing.assert_array_equal(ec.serving.open(tmp_path / name).tables["t1"].values(),
                                      ebc.embedding_bags["t1"].weight.detach().numpy(), err_msg=name)


def test_convert_state_dict_refusals_write_nothing(tmp_path):
    torchrec = pytest.importorskip("torchrec")
    model = _torchrec_model(torchrec)
    state = model.state_dict()
    cases = {
        "two tables of one name": ({**state, **{f"other.{k}": v for k, v in state.items() if "sparse." in k}},
                                   "both tables named 't1'.*prefix"),
        "no tables": ({"dense.weight": torch.zeros(1, 4)}, "no table weights.*'dense.weight'"),
        "not finite": ({"embedding_bags.t.weight": torch.tensor([[0.0, float("nan")]])},
                       r"embedding_bags.t.weight, rows from 0: .*values\[0, 1\] = nan is not finite"),
        "1-D": ({"embedding_bags.t.weight": torch.zeros(3)}, "1-D"),
        "not a dict": ([1, 2], "holds a list, not a state dict"),
    }
    for label, (content, match) in cases.items():
        src = tmp_path / f"{label}.pt"
        torch.save(content, src)
        with pytest.raises(ValueError, match=match):
            et.convert_state_dict(src, tmp_path / label)
        assert not (tmp_path / label / "MANIFEST").exists(), label
    (tmp_path / "garbage.pt").write_bytes(b"not a torch file")
    with pytest.raises(ValueError, match="cannot read it as a PyTorch state dict"):
        et.convert_state_dict(tmp_path / "garbage.pt", tmp_path / "g")
    with pytest.raises(ValueError, match="no table weights under the module 'nope'"):
        et.convert_state_dict(tmp_path / "no tables.pt", tmp_path / "g", prefix="nope")
    theirs = tmp_path / "theirs"  # another program's MANIFEST: refused before the source is read
    theirs.mkdir()
    (theirs / "MANIFEST").write_bytes(b"not ours")
    with pytest.raises(ec.CheckpointError, match="MANIFEST: not an embedcore manifest"):
        et.convert_state_dict(tmp_path / "missing.pt", theirs)
    assert os.listdir(theirs) == ["MANIFEST"] and (theirs / "MANIFEST").read_bytes() == b"not ours"


def test_convert_state_dict_takes_only_collections_and_refuses_what_it_cannot_serve(tmp_path):
    """Modules named `embeddings` that are not collections (a transformer's,
    an nn.Sequential) are skipped; a FeatureProcessedEmbeddingBagCollection
    (position weights before pooling) is refused, as are sharded tensors."""
    import subprocess
    import sys
    import textwrap

    torchrec = pytest.importorskip("torchrec")

    class Text(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.word_embeddings = torch.nn.Embedding(10, 4)
            self.LayerNorm = torch.nn.LayerNorm(4)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.sparse = torchrec.EmbeddingBagCollection(tables=[torchrec.EmbeddingBagConfig(
                num_embeddings=10, embedding_dim=4, name="t1", feature_names=["f1"])], device=torch.device("cpu"))
            self.text = torch.nn.Module()
            self.text.embeddings = Text()
            self.embeddings = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4))

    torch.save(Model().state_dict(), tmp_path / "m.pt")
    assert et.convert_state_dict(tmp_path / "m.pt", tmp_path / "m") == ["t1"]
    with pytest.raises(ValueError, match=r"text.embeddings is not a TorchRec collection's tables: .*LayerNorm"):
        et.convert_state_dict(tmp_path / "m.pt", tmp_path / "m2", prefix="text")

    from torchrec.modules.feature_processor_ import PositionWeightedModuleCollection
    from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection

    ebc = torchrec.EmbeddingBagCollection(tables=[torchrec.EmbeddingBagConfig(
        num_embeddings=10, embedding_dim=4, name="t1", feature_names=["f1"])], is_weighted=True,
        device=torch.device("cpu"))
    torch.save(FeatureProcessedEmbeddingBagCollection(ebc, PositionWeightedModuleCollection({"f1": 10})).state_dict(),
               tmp_path / "fp.pt")
    with pytest.raises(ValueError, match="FeatureProcessedEmbeddingBagCollection.*position_weights"):
        et.convert_state_dict(tmp_path / "fp.pt", tmp_path / "fp")
    assert not (tmp_path / "fp" / "MANIFEST").exists()

    # Sharded tensors (a process group of one, in a child process).
    script = textwrap.dedent(f"""
        import os, torch, torch.distributed as dist
        import embedcore.adapters.torch as et
        dist.init_process_group("gloo", init_method="file://{tmp_path}/store", rank=0, world_size=1)
        from torch.distributed._shard.sharded_tensor import empty
        from torch.distributed._shard.sharding_spec import ChunkShardingSpec
        from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh
        cases = {{"sharded": empty(ChunkShardingSpec(dim=0, placements=["rank:0/cpu"]), 4, 3),
                  "dtensor": distribute_tensor(torch.ones(4, 3), init_device_mesh("cpu", (1,)), [Shard(0)])}}
        for label, value in cases.items():
            torch.save({{"ebc.embedding_bags.t.weight": value}}, f"{tmp_path}/{{label}}.pt")
            try:
                et.convert_state_dict(f"{tmp_path}/{{label}}.pt", f"{tmp_path}/{{label}}")
            except ValueError as e:
                print(label, "refused:", "a sharded state dict" in str(e), os.path.exists(f"{tmp_path}/{{label}}/MANIFEST"))
        dist.destroy_process_group()
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240)
    assert "sharded refused: True False" in r.stdout and "dtensor refused: True False" in r.stdout, r.stdout + r.stderr


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_convert_state_dict_tables_named_like_kinds_and_tables_of_other_dtypes(tmp_path):
    """A TorchRec table named `embeddings` (or `embedding_bags`) converts
    (its key was read as a module of that name holding "weight", and the
    table left out, unsaid); a collection's float64 table, and a quantized
    collection's uint8 rows, raise ValueError naming the key (they were left
    out beside the tables converted, exit 0); nothing is written."""
    torchrec = pytest.importorskip("torchrec")

    def ebc(*names):
        return torchrec.EmbeddingBagCollection(tables=[torchrec.EmbeddingBagConfig(
            num_embeddings=10, embedding_dim=4, name=n, feature_names=[f"f_{n}"]) for n in names],
            device=torch.device("cpu"))

    m = torch.nn.Module()
    m.ebc = ebc("t0", "embeddings", "embedding_bags")
    m.ec = torchrec.EmbeddingCollection(tables=[torchrec.EmbeddingConfig(
        num_embeddings=6, embedding_dim=4, name="embeddings", feature_names=["g"])], device=torch.device("cpu"))
    torch.save(m.state_dict(), tmp_path / "m.pt")
    # (two tables named "embeddings": one module path each)
    assert et.convert_state_dict(tmp_path / "m.pt", tmp_path / "a", prefix="ebc") == [
        "t0", "embeddings", "embedding_bags"]
    assert et.convert_state_dict(tmp_path / "m.pt", tmp_path / "b", prefix="ec") == ["embeddings"]
    served = ec.serving.open(tmp_path / "a")
    np.testing.assert_array_equal(served.tables["embeddings"].values(),
                                  m.ebc.embedding_bags["embeddings"].weight.detach().numpy())

    m = torch.nn.Module()
    m.user, m.item = ebc("user"), ebc("item").double()
    torch.save(m.state_dict(), tmp_path / "d.pt")
    with pytest.raises(ValueError, match=r"item.embedding_bags.item.weight is a torch.float64 table"):
        et.convert_state_dict(tmp_path / "d.pt", tmp_path / "d")
    state = {"user.embedding_bags.user.weight": torch.zeros(10, 4),
             "item.embedding_bags.item.weight": torch.zeros(10, 16, dtype=torch.uint8)}  # QuantEBC's rows
    torch.save(state, tmp_path / "q.pt")
    with pytest.raises(ValueError, match=r"item.embedding_bags.item.weight is a torch.uint8 table.*quantized"):
        et.convert_state_dict(tmp_path / "q.pt", tmp_path / "q")
    assert not (tmp_path / "d").exists() and not (tmp_path / "q").exists()


def test_torch_distributed_checkpoint_of_weights_and_fused_state_resumes_bit_identically(tmp_path):
    """dcp.save / dcp.load of the module's state_dict() and
    optimizer_state_dict() (as TorchRec's KeyedOptimizer state is saved,
    docs/torch.md): values, Adam's slots and the step come back, and the
    next step of both modules is the same, bit for bit."""
    import warnings

    import torch.distributed.checkpoint as dcp

    def make():
        return et.EmbeddingBagCollection([et.EmbeddingBagConfig(6, 3, name="a", feature_names=["f"])],
                                         optimizer=ec.optimizers.Adam(0.1))

    def step(m):
        m({"f": (torch.tensor([1, 2, 2]), torch.tensor([0, 2, 3]))})["f"].pow(2).sum().backward()

    a = make()
    step(a)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # (no process group: "assuming ... a single process")
        dcp.save({"model": a.state_dict(), "optim": a.optimizer_state_dict()}, checkpoint_id=str(tmp_path))
        b = make()
        sd = {"model": b.state_dict(), "optim": b.optimizer_state_dict()}
        dcp.load(sd, checkpoint_id=str(tmp_path))
    b.load_state_dict(sd["model"])
    b.load_optimizer_state_dict(sd["optim"])
    step(a)
    step(b)
    ta, tb = a.embedding_bags["a"].table, b.embedding_bags["a"].table
    assert ta.values().tobytes() == tb.values().tobytes() and ta.step == tb.step == 2
    for name, v in ta.slots().items():
        assert v.tobytes() == tb.slots()[name].tobytes(), name


def test_convert_state_dict_refuses_managed_collision_collections(tmp_path):
    """A TorchRec ManagedCollisionEmbeddingBagCollection (or ...EmbeddingCollection)
    remaps raw ids to rows before its lookup: a served table of its weight
    alone would read other rows, so it is refused naming the key, whole
    model, with prefix= and from a DCP directory, writing nothing."""
    torchrec = pytest.importorskip("torchrec")
    import torch.distributed.checkpoint as dcp
    from torchrec.modules.mc_embedding_modules import (ManagedCollisionEmbeddingBagCollection,
                                                       ManagedCollisionEmbeddingCollection)
    from torchrec.modules.mc_modules import LFU_EvictionPolicy, MCHManagedCollisionModule, ManagedCollisionCollection

    def mcc(tables):
        return ManagedCollisionCollection({"t1": MCHManagedCollisionModule(
            zch_size=16, device=torch.device("cpu"), eviction_policy=LFU_EvictionPolicy(), eviction_interval=1,
            input_hash_size=1000)}, tables)

    bag_tables = [torchrec.EmbeddingBagConfig(num_embeddings=16, embedding_dim=4, name="t1", feature_names=["f1"])]
    seq_tables = [torchrec.EmbeddingConfig(num_embeddings=16, embedding_dim=4, name="t1", feature_names=["f1"])]
    models = {
        "bags": ("EmbeddingBagCollection", "mc._embedding_module.embedding_bags.t1.weight", torch.nn.ModuleDict({
            "mc": ManagedCollisionEmbeddingBagCollection(torchrec.EmbeddingBagCollection(
                tables=bag_tables, device=torch.device("cpu")), mcc(bag_tables), return_remapped_features=True)})),
        "seq": ("EmbeddingCollection", "mc._embedding_module.embeddings.t1.weight", torch.nn.ModuleDict({
            "mc": ManagedCollisionEmbeddingCollection(torchrec.EmbeddingCollection(
                tables=seq_tables, device=torch.device("cpu")), mcc(seq_tables), return_remapped_features=True)})),
    }
    kjt = torchrec.KeyedJaggedTensor.from_lengths_sync(["f1"], torch.tensor([5, 900, 123, 7]), torch.tensor([2, 2]))
    for label, (kind, key, model) in models.items():
        model.train()
        for _ in range(3):
            _, remapped = model["mc"](kjt)
        model.eval()
        assert model["mc"](kjt)[1]["f1"].values().tolist() != kjt.values().tolist()  # (ids are remapped)
        assert key in model.state_dict()
        torch.save(model.state_dict(), tmp_path / f"{label}.pt")
        dcp.save(model.state_dict(), checkpoint_id=tmp_path / f"{label}.dcp")
        for src, prefix in [(f"{label}.pt", None), (f"{label}.pt", "mc._embedding_module"), (f"{label}.dcp", None)]:
            with pytest.raises(ValueError, match=rf"{key} belongs to a TorchRec ManagedCollision{kind}.*"
                                                 r"mc\._managed_collision_collection\._managed_collision_modules\.t1\."):
                et.convert_state_dict(tmp_path / src, tmp_path / "out", prefix=prefix)
            assert not (tmp_path / "out").exists()


def test_convert_state_dict_of_a_checkpoint_two_ranks_saved_sharded(tmp_path):
    """A torch.distributed.checkpoint that two ranks wrote, each its rows of a
    ShardedTensor (how TorchRec's row-wise sharded tables save): one process
    converts each table whole."""
    import subprocess
    import sys
    import textwrap

    script = tmp_path / "save.py"
    script.write_text(textwrap.dedent("""
        import os, sys, torch, torch.distributed as dist, torch.multiprocessing as mp
        import torch.distributed.checkpoint as dcp

        def rank(r, path, store):  # (a file store: no port that another job may hold)
            dist.init_process_group("gloo", init_method="file://" + store, rank=r, world_size=2)
            from torch.distributed._shard.sharded_tensor import empty
            from torch.distributed._shard.sharding_spec import ChunkShardingSpec
            st = empty(ChunkShardingSpec(dim=0, placements=["rank:0/cpu", "rank:1/cpu"]), 7, 3)
            for shard in st.local_shards():
                o, n = shard.metadata.shard_offsets[0], shard.tensor.shape[0]
                shard.tensor.copy_(torch.arange(o * 3, (o + n) * 3, dtype=torch.float32).reshape(n, 3))
            dcp.save({"model.ebc.embedding_bags.t.weight": st, "model.head.weight": torch.ones(2)}, checkpoint_id=path)
            dist.destroy_process_group()

        if __name__ == "__main__":
            mp.spawn(rank, args=(sys.argv[1], sys.argv[2]), nprocs=2)
    """))
    r = subprocess.run([sys.executable, str(script), str(tmp_path / "dcp"), str(tmp_path / "store")],
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(tmp_path / "dcp")) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert et.convert_state_dict(tmp_path / "dcp", tmp_path / "ckpt") == ["t"]
    np.testing.assert_array_equal(ec.serving.open(tmp_path / "ckpt").tables["t"].values(),
                                  np.arange(21, dtype=np.float32).reshape(7, 3))
    (tmp_path / "plain").mkdir()
    with pytest.raises(ValueError, match="no torch.distributed.checkpoint"):
        et.convert_state_dict(tmp_path / "plain", tmp_path / "x")


def test_a_module_without_fused_tables_has_no_fused_optimizer_attribute():
    """As TorchRec's modules: hasattr() is False (it was a ValueError, which
    broke hasattr, inspect.getmembers and torch.jit.trace's attribute scan),
    and the AttributeError says why; loading optimizer state is refused."""
    import inspect

    weight = torch.randn(5, 2)
    for m in (et.EmbeddingBag.from_pretrained(weight.clone(), mode="sum"), et.Embedding(5, 2),
              et.EmbeddingBagCollection([et.EmbeddingBagConfig(5, 2, name="t", feature_names=["f"])])):
        assert not hasattr(m, "fused_optimizer")
        with pytest.raises(AttributeError, match="has no fused_optimizer: none of its tables trains fused"):
            m.fused_optimizer
        assert inspect.getmembers(m)
        assert m.optimizer_state_dict() == {"state": {}, "param_groups": []}
        m.load_optimizer_state_dict(m.optimizer_state_dict())  # what it gives round-trips: nothing to load
        with pytest.raises(ValueError, match="has no table trained fused .* it takes no optimizer state"):
            m.load_optimizer_state_dict({"state": {"weight": {}}, "param_groups": []})
    fused = et.Embedding(5, 2, optimizer=ec.optimizers.SGD(0.1))
    assert hasattr(fused, "fused_optimizer")

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = et.Embedding.from_pretrained(weight.clone())
            self.lin = torch.nn.Linear(2, 1)

        def forward(self, ids):
            return self.lin(self.emb(ids))

    model, ids = Model(), torch.tensor([1, 2, 3])
    traced = torch.jit.trace(model, (ids,))
    torch.testing.assert_close(traced(torch.tensor([4, 0])), model(torch.tensor([4, 0])))


def test_saving_a_whole_model_names_tables_of(tmp_path):
    """ec.save of a model that holds adapter modules (a DLRM, an nn.Sequential)
    points at tables_of, which gathers them; nothing is written."""
    model = torch.nn.Sequential(et.EmbeddingBag(ROWS, DIM, name="bag"), torch.nn.Linear(DIM, 1))
    with pytest.raises(TypeError, match=r"got torch\.nn\.modules\.container\.Sequential; for a PyTorch model .*"
                                        r"pass embedcore\.adapters\.torch\.tables_of\(model\)"):
        ec.save(tmp_path / "c", model)
    with pytest.raises(TypeError, match=r"an adapter module holding tables, got builtins\.int$"):
        ec.save(tmp_path / "c", 3)
    with pytest.raises(ValueError, match=r"got an empty list: no tables"):  # tables_of of a model without any
        ec.save(tmp_path / "c", et.tables_of(torch.nn.Linear(2, 2)))
    assert not (tmp_path / "c").exists()
    ec.save(tmp_path / "c", et.tables_of(model))
    assert ec.checkpoint.read_info(tmp_path / "c").table_names == ["bag"]


def test_load_state_dict_of_sharded_tensors_names_the_key(tmp_path):
    """A state dict of ShardedTensor weights (TorchRec's sharded modules')
    is refused naming the key and what to do, by the module and by a model
    holding it (were: "torch function '__get__' ... not supported for
    ShardedTensor", naming no key), and no table changes."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        import torch, torch.distributed as dist
        import embedcore.adapters.torch as et
        dist.init_process_group("gloo", init_method="file://{tmp_path}/store", rank=0, world_size=1)
        from torch.distributed._shard.sharded_tensor import rand
        from torch.distributed._shard.sharding_spec import ChunkShardingSpec
        st = rand(ChunkShardingSpec(dim=0, placements=["rank:0/cpu"]), 20, 4)
        ebc = et.EmbeddingBagCollection([et.EmbeddingBagConfig(num_embeddings=20, embedding_dim=4, name="t1",
                                                               feature_names=["f1"])])
        before = ebc.embedding_bags["t1"].weight.detach().clone()
        for m, key in ((ebc, "embedding_bags.t1.weight"), (torch.nn.Sequential(ebc), "0.embedding_bags.t1.weight")):
            try:
                m.load_state_dict({{key: st}})
            except RuntimeError as e:
                print("refused:", key + " is a ShardedTensor" in str(e) and "gather its shards" in str(e))
        print("unchanged:", torch.equal(ebc.embedding_bags["t1"].weight, before))
        dist.destroy_process_group()
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240)
    assert r.stdout.split("\n")[:3] == ["refused: True", "refused: True", "unchanged: True"], r.stdout + r.stderr


def test_load_state_dict_runs_pre_hooks_first_and_changes_no_table_on_error():
    """load_state_dict pre-hooks registered on an adapter module itself (a
    key migration: a renamed key, a grown vocabulary padded) run before the
    checks, as PyTorch runs them (they were ignored: "Unexpected key(s)",
    "size mismatch"); the tables are written only once every key passed."""
    w = torch.randn(10, 4)

    def rename(module, state_dict, prefix, *rest):
        if prefix + "legacy_table" in state_dict:
            state_dict[prefix + "weight"] = state_dict.pop(prefix + "legacy_table")

    def pad(module, state_dict, prefix, *rest):
        k = prefix + "weight"
        if k in state_dict and state_dict[k].shape[0] < 10:
            state_dict[k] = torch.cat([state_dict[k], torch.zeros(10 - state_dict[k].shape[0], 4)])

    m = et.EmbeddingBag(10, 4)
    m.register_load_state_dict_pre_hook(rename)
    assert not m.load_state_dict({"legacy_table": w}).missing_keys
    assert torch.equal(m.weight, w)
    m.register_load_state_dict_pre_hook(pad)
    m.load_state_dict({"weight": w[:7]})
    assert torch.equal(m.weight[:7], w[:7]) and not m.weight[7:].any()
    ebc = et.EmbeddingBagCollection([et.EmbeddingBagConfig(10, 4, name="a"), et.EmbeddingBagConfig(10, 4, name="b")])
    ebc.embedding_bags["a"].register_load_state_dict_pre_hook(pad)
    before = {t: b.weight.detach().clone() for t, b in ebc.embedding_bags.items()}
    for bad in (torch.full((10, 4), float("nan")), torch.ones(9, 4), "not a tensor"):
        with pytest.raises((RuntimeError, ValueError)):
            ebc.load_state_dict({"embedding_bags.a.weight": w[:7], "embedding_bags.b.weight": bad})
        assert all(torch.equal(b.weight, before[t]) for t, b in ebc.embedding_bags.items())  # "a" too
    with pytest.raises(RuntimeError, match="Unexpected key"):
        ebc.load_state_dict({"embedding_bags.a.weight": w[:7], "embedding_bags.b.weight": w, "extra": w})
    assert all(torch.equal(b.weight, before[t]) for t, b in ebc.embedding_bags.items())
    ebc.load_state_dict({"embedding_bags.a.weight": w[:7], "embedding_bags.b.weight": w})
    assert torch.equal(ebc.embedding_bags["b"].weight, w) and torch.equal(ebc.embedding_bags["a"].weight[:7], w[:7])
