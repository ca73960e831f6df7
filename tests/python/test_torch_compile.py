"""torch.compile(fullgraph=True) over models that use the PyTorch adapter's
modules: no graph breaks (fullgraph raises on any), and the same results as
eager for inference and for fused and unfused training."""
import copy
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import embedcore as ec  # noqa: E402
import embedcore.adapters.torch as et  # noqa: E402
from torch_helpers import bags, engine_optimizer, max_diff, uniform_weights  # noqa: E402

ROWS, DIM, BATCH = 40, 8, 6


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class Model(torch.nn.Module):
    def __init__(self, w, **kw):
        super().__init__()
        self.emb = et.EmbeddingBag.from_pretrained(w, freeze=False, include_last_offset=True, **kw)
        self.top = torch.nn.Linear(DIM, 1)
        with torch.no_grad():
            self.top.weight.copy_(torch.linspace(-1, 1, DIM))
            self.top.bias.fill_(0.1)

    def forward(self, ids, offsets, psw=None):
        return self.top(torch.relu(self.emb(ids, offsets, psw))).sum()


def test_forward_forms_compile_without_graph_breaks(rng):
    w = uniform_weights(rng, ROWS, DIM)
    bag = et.EmbeddingBag.from_pretrained(w, mode="sum", padding_idx=0)
    emb = et.Embedding.from_pretrained(w)

    def f(ids, offsets, psw, x2d):
        return bag(ids, offsets) + bag(ids, offsets, psw), bag(x2d), emb(x2d)

    cf = torch.compile(f, fullgraph=True)
    for _ in range(3):
        ids, offsets, psw = bags(rng, ROWS, BATCH, weighted=True, pad=0)
        x2d = torch.from_numpy(rng.integers(0, ROWS, size=(BATCH, 3)))
        for a, b in zip(f(ids, offsets[:-1], psw, x2d), cf(ids, offsets[:-1], psw, x2d)):
            assert max_diff(a, b) == 0


@pytest.mark.parametrize("how", ["fused", "sparse", "dense"])
def test_training_compiled_equals_eager(rng, how):
    w = uniform_weights(rng, ROWS, DIM)
    kw = {"fused": dict(optimizer=engine_optimizer("adam", 0.05)), "sparse": dict(sparse=True),
          "dense": dict(sparse=False)}[how]
    eager, comp = Model(w, mode="sum", **kw), Model(w, mode="sum", **kw)
    compiled = torch.compile(comp, fullgraph=True)

    def opt(m):
        if how == "fused":
            return [torch.optim.SGD(m.top.parameters(), lr=0.1)]
        if how == "sparse":
            return [torch.optim.SGD(m.top.parameters(), lr=0.1), torch.optim.SparseAdam([m.emb.weight], lr=0.05)]
        return [torch.optim.Adam(m.parameters(), lr=0.05)]

    opts = {id(eager): opt(eager), id(comp): opt(comp)}
    for _ in range(4):
        ids, offsets, psw = bags(rng, ROWS, BATCH, weighted=True)
        p = {}
        for m, f in ((eager, eager), (comp, compiled)):
            for o in opts[id(m)]:
                o.zero_grad()
            p[id(m)] = psw.clone().requires_grad_()
            f(ids, offsets, p[id(m)]).backward()
            for o in opts[id(m)]:
                o.step()
        assert max_diff(p[id(eager)].grad, p[id(comp)].grad) <= 1e-6
    assert max_diff(eager.emb.weight, comp.emb.weight) <= 1e-6
    assert max_diff(eager.top.weight, comp.top.weight) <= 1e-6
    if how == "fused":
        assert comp.emb.table.step == eager.emb.table.step == 4


def test_collection_dict_compiled_training(rng):
    def make():
        torch.manual_seed(0)
        return et.EmbeddingBagCollection(
            [et.EmbeddingBagConfig(ROWS, DIM, name="t1", feature_names=["a", "b"], pooling="mean"),
             et.EmbeddingBagConfig(ROWS, 4, name="t2", feature_names=["c"])], optimizer=ec.optimizers.Adagrad(0.1))

    eager, comp = make(), make()
    compiled = torch.compile(comp, fullgraph=True)
    for _ in range(3):
        ia, oa, _ = bags(rng, ROWS, BATCH)
        ib, ob, _ = bags(rng, ROWS, BATCH)
        feats = {"a": (ia, oa), "b": {"values": ib, "lengths": ob.diff()},
                 "c": torch.from_numpy(rng.integers(0, ROWS, size=(BATCH, 2)))}
        for f in (eager, compiled):
            out = f(feats)
            (out["a"].sum() + 2 * out["b"].sum() + out["c"].pow(2).sum()).backward()
    for t in ("t1", "t2"):
        assert max_diff(eager.embedding_bags[t].weight, comp.embedding_bags[t].weight) <= 1e-6
        assert comp.embedding_bags[t].table.step == 3


def _error(f, *args):
    try:
        f(*args)
    except Exception as e:  # noqa: BLE001 (the test compares whatever is raised)
        return type(e), str(e)
    return None


def test_collection_input_errors_compiled_as_eager():
    """Checks that need the data (offsets and lengths of dict features and
    KJTs) run at run time in a compiled graph, with eager's errors: a
    feature whose bags leave values out is refused, not cut short."""
    ebc = et.EmbeddingBagCollection([et.EmbeddingBagConfig(10, 3, name="t", feature_names=["f1", "f2"])])
    ecol = et.EmbeddingCollection([et.EmbeddingConfig(10, 3, name="s", feature_names=["f2"])])
    ok = (torch.tensor([1, 2]), torch.tensor([0, 2]))
    bad = {"uncovered": (torch.tensor([1, 2, 3]), torch.tensor([0, 1, 2])),
           "uncovered lengths": {"values": torch.tensor([1, 2, 3]), "lengths": torch.tensor([1, 1])},
           "negative lengths": {"values": torch.tensor([1, 2]), "lengths": torch.tensor([3, -1])},
           "decreasing": (torch.tensor([1, 2, 3]), torch.tensor([0, 2, 1, 3])),
           "not from 0": (torch.tensor([1, 2, 3]), torch.tensor([1, 2, 3]))}
    for module in (ebc, ecol):
        compiled = torch.compile(lambda f2, m=module: m({"f1": ok, "f2": f2}), backend="aot_eager", fullgraph=True)
        for name, f2 in bad.items():
            expected = _error(module, {"f1": ok, "f2": f2})
            assert expected is not None and expected[0] is ValueError and "features['f2']" in expected[1], name
            assert _error(compiled, f2) == expected, name
        good = (torch.tensor([1, 2, 3]), torch.tensor([0, 1, 3]))
        assert all(torch.equal(a, b) for a, b in zip(compiled(good).values(), module({"f1": ok, "f2": good}).values()))
    torchrec = pytest.importorskip("torchrec")
    kjt = torchrec.KeyedJaggedTensor(keys=["f1", "f2"], values=torch.tensor([1, 2, 3, 4]),
                                     lengths=torch.tensor([1, 1, 1, 0]))
    for module in (ebc, ecol):
        expected = _error(module, kjt)
        assert expected is not None and "KeyedJaggedTensor: the offsets (or lengths) end at 3" in expected[1]
        assert _error(torch.compile(module, backend="aot_eager", fullgraph=True), kjt) == expected


def test_collection_id_out_of_range_compiled_names_the_feature_as_eager():
    """An id out of range in a compiled collection raises eager's IndexError,
    naming the table and the feature of a table that several features read
    (it named only the table, and the position "of ids" for a KJT's values);
    a table module called on its own names no feature, compiled or not (the
    op cannot tell it from a collection's call of a table of one feature:
    such a table's error names the table only, whose feature it is)."""
    torchrec = pytest.importorskip("torchrec")
    ebc = et.EmbeddingBagCollection([et.EmbeddingBagConfig(10, 4, name="t1", feature_names=["f1", "g1"]),
                                     et.EmbeddingBagConfig(10, 4, name="t2", feature_names=["f2"])])
    ecol = et.EmbeddingCollection([et.EmbeddingConfig(10, 4, name="t1", feature_names=["f1", "g1"]),
                                   et.EmbeddingConfig(10, 4, name="t2", feature_names=["f2"])])
    kjt = torchrec.KeyedJaggedTensor.from_lengths_sync(keys=["f1", "g1", "f2"], values=torch.tensor([1, 2, 3, 20, 3]),
                                                       lengths=torch.tensor([2, 2, 1]))
    features = {"f1": torch.tensor([[1, 2]]), "g1": torch.tensor([[3, 20]]), "f2": torch.tensor([[3]])}
    for module in (ebc, ecol):
        compiled = torch.compile(module, backend="aot_eager", fullgraph=True)
        for given, where in ((kjt, "position 3 of the KeyedJaggedTensor's values"),
                             (features, "position 1 of features['g1']'s ids")):
            expected = _error(module, given)
            assert expected == (IndexError, f"table 't1', feature 'g1': id 20 at {where} is out of range [0, 10)")
            assert _error(compiled, given) == expected
    for name in ("t1", "t2"):
        alone = ebc.embedding_bags[name]
        for f in (alone, torch.compile(alone, backend="aot_eager", fullgraph=True)):
            assert _error(f, torch.tensor([1, 20]), torch.tensor([0, 2])) == (
                IndexError, f"table '{name}': id 20 at position 1 of ids is out of range [0, 10)")
    bad_t2 = {"f1": torch.tensor([[1, 2]]), "g1": torch.tensor([[3, 4]]), "f2": torch.tensor([[20]])}
    assert _error(torch.compile(ebc, backend="aot_eager", fullgraph=True), bad_t2) == (
        IndexError, "table 't2': id 20 at position 0 of ids is out of range [0, 10)")


def test_torchrec_kjt_compiled(rng):
    torchrec = pytest.importorskip("torchrec")
    cfgs = [torchrec.EmbeddingBagConfig(num_embeddings=ROWS, embedding_dim=DIM, name="t1", feature_names=["f1", "f2"]),
            torchrec.EmbeddingBagConfig(num_embeddings=ROWS, embedding_dim=4, name="t2", feature_names=["f3"])]
    ref = torchrec.EmbeddingBagCollection(cfgs)
    eager = et.EmbeddingBagCollection(cfgs, optimizer=ec.optimizers.SGD(0.1))
    comp = et.EmbeddingBagCollection(cfgs, optimizer=ec.optimizers.SGD(0.1))
    eager.load_state_dict(ref.state_dict())
    comp.load_state_dict(ref.state_dict())
    compiled = torch.compile(comp, fullgraph=True)
    seq = et.EmbeddingCollection([torchrec.EmbeddingConfig(num_embeddings=ROWS, embedding_dim=4, name="s",
                                                           feature_names=["f3"])])
    compiled_seq = torch.compile(seq, fullgraph=True)
    for _ in range(3):
        values, lengths = [], []
        for _k in range(3):
            ids, off, _ = bags(rng, ROWS, BATCH)
            values.append(ids)
            lengths.append(off.diff())
        kjt = torchrec.KeyedJaggedTensor.from_lengths_sync(keys=["f1", "f2", "f3"], values=torch.cat(values),
                                                           lengths=torch.cat(lengths))
        a, b = eager(kjt), compiled(kjt)
        assert b.keys() == a.keys() and max_diff(a.values(), b.values()) == 0
        a.values().sum().backward()
        b.values().sum().backward()
        sa, sb = seq(kjt), compiled_seq(kjt)
        assert max_diff(sa["f3"].values(), sb["f3"].values()) == 0
    assert max_diff(eager.embedding_bags["t1"].weight, comp.embedding_bags["t1"].weight) == 0


@pytest.mark.parametrize("how", ["fused", "sparse", "dense"])
@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_eager_fast_path_equals_the_dispatched_ops(rng, monkeypatch, how, mode):
    """Eagerly, the modules run the ops' bodies and autograd without the
    dispatcher (_ops.plain_eager); forced through the custom ops instead,
    outputs, per_sample_weights gradients and updates are the same bits."""
    from embedcore.adapters.torch import _ops

    w = uniform_weights(rng, ROWS, DIM)
    kw = {"fused": dict(optimizer=engine_optimizer("adagrad", 0.1)), "sparse": dict(sparse=True),
          "dense": dict(sparse=False)}[how]
    batches = [bags(rng, ROWS, BATCH, weighted=True) for _ in range(3)]

    def run(force_ops):
        with monkeypatch.context() as mp:
            if force_ops:
                mp.setattr(_ops, "plain_eager", lambda tensors: False)
            return steps()

    def steps():
        m = Model(w, mode=mode, **kw)
        opts = [torch.optim.SGD(m.top.parameters(), lr=0.1)]
        if how != "fused":
            opts.append(torch.optim.SGD([m.emb.weight], lr=0.1))
        got = []
        for ids, offsets, psw in batches:
            for o in opts:
                o.zero_grad()
            p = psw.clone().requires_grad_(mode == "sum")
            m(ids, offsets, p if mode == "sum" else None).backward()
            for o in opts:
                o.step()
            with torch.no_grad():
                got.append(m.emb(ids, offsets).clone())
            if mode == "sum":
                got.append(p.grad.clone())
        return got + [m.emb.weight.detach().clone()]

    calls = []
    real = _ops.lookup_impl
    monkeypatch.setattr(_ops, "lookup_impl", lambda *a: calls.append(1) or real(*a))
    fast = run(False)
    assert calls, "the eager path was not taken"
    calls.clear()
    slow = run(True)
    assert not calls, "the forced path called the body directly"
    assert len(fast) == len(slow)
    for a, b in zip(fast, slow):
        assert torch.equal(a, b)


@pytest.mark.parametrize("compiled", [False, True])
def test_per_sample_weights_grad_refuses_rows_updated_since_forward(rng, compiled):
    """Fused, two lookups of one table with weights that require grad: the
    first backward updates the rows that the second's weight gradient reads,
    so the second raises, compiled as eagerly (was: compiled, a gradient
    from the updated rows, silently). One lookup per backward trains."""
    w = uniform_weights(rng, ROWS, DIM)
    m = et.EmbeddingBag.from_pretrained(w, freeze=False, mode="sum", optimizer=engine_optimizer("sgd", 0.5))
    ids, offsets = torch.tensor([1, 2, 3]), torch.tensor([0, 2])

    def twice(p, q):
        return m(ids, offsets, p).sum() + 2 * m(ids, offsets, q).sum()

    def once(p):
        return m(ids, offsets, p).sum()

    if compiled:
        twice, once = torch.compile(twice, fullgraph=True), torch.compile(once, fullgraph=True)
    p, q = torch.ones(3, requires_grad=True), torch.ones(3, requires_grad=True)
    with pytest.raises(RuntimeError, match="was updated .* after this lookup and before its backward"):
        twice(p, q).backward()
    before = m.weight.detach().clone()
    p = torch.ones(3, requires_grad=True)
    once(p).backward()
    # d out / d p_k = sum of row k (as it was before the update), and one SGD step of every row.
    assert max_diff(p.grad, before[ids].sum(1)) <= 1e-6
    assert not torch.equal(m.weight.detach(), before)


def test_tracing_records_the_custom_op(rng):
    """make_fx / torch.export see embedcore::lookup as one op (the eager fast
    path steps aside under tracing modes)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    w = uniform_weights(rng, ROWS, DIM)
    bag = et.EmbeddingBag.from_pretrained(w, mode="sum", include_last_offset=True)
    ids, offsets, _ = bags(rng, ROWS, BATCH)
    with torch.no_grad():
        gm = make_fx(lambda i, o: bag(i, o))(ids, offsets)
        assert "embedcore.lookup" in str(gm.graph)
        assert torch.equal(gm(ids, offsets), bag(ids, offsets))
        class M(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.bag = bag

            def forward(self, i, o):
                return self.bag(i, o)

        ep = torch.export.export(M(), (ids, offsets))
        assert "embedcore.lookup" in str(ep.graph)


def test_fast_path_steps_aside_under_jit_trace_and_vmap():
    from embedcore.adapters.torch import _ops

    seen = []

    def f(x):
        seen.append(_ops.plain_eager([x]))
        return x * 2

    x = torch.arange(4.0)
    assert _ops.plain_eager([x])
    torch.jit.trace(f, (x,), check_trace=False)
    torch.vmap(f)(x.reshape(2, 2))
    assert seen == [False, False]


@pytest.mark.parametrize("first", ["eager call", "fused_optimizer"])
def test_apply_optimizer_in_backward_then_compiled_steps_the_table(first):
    """docs/torch.md's recipe: fuse (one eager call, or fused_optimizer), then
    compile. The compiled backward steps the table as the eager one does (the
    weight's hook that refuses a gradient of its own was called without one
    under compile, and raised)."""
    from torch.distributed.optim import _apply_optimizer_in_backward

    ids, off = torch.tensor([1, 2, 3, 1, 5]), torch.tensor([0, 2])

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = et.EmbeddingBag(10, 4, mode="sum")
            self.lin = torch.nn.Linear(4, 1)

        def forward(self, i, o):
            return self.lin(self.emb(i, o))

    m = M()
    _apply_optimizer_in_backward(torch.optim.SGD, m.emb.parameters(), {"lr": 0.1})
    if first == "eager call":
        m(ids, off).sum().backward()
    else:
        assert m.emb.fused_optimizer is not None
    assert m.emb.fused
    before, step = m.emb.table.to_numpy().copy(), m.emb.table.step
    torch.compile(m)(ids, off).sum().backward()
    assert m.emb.table.step == step + 1
    assert not np.array_equal(m.emb.table.to_numpy(), before)


def test_fx_symbolic_trace_says_to_keep_the_modules_leaves(tmp_path):
    """FX symbolic tracing cannot go into the engine's lookup: a TypeError
    names FX and the workaround, which works: torchrec.fx.symbolic_trace
    with the module as a leaf (or a torch.fx.Tracer that keeps it one) gives
    the eager model's outputs, TorchRec's on the same weights, and trains
    the table as the eager model does."""
    torchrec = pytest.importorskip("torchrec")
    import copy

    import torch.fx
    import torchrec.fx

    bag_cfgs = [torchrec.EmbeddingBagConfig(num_embeddings=20, embedding_dim=4, name="t1", feature_names=["f1", "f2"])]
    seq_cfgs = [torchrec.EmbeddingConfig(num_embeddings=20, embedding_dim=4, name="t1", feature_names=["f1", "f2"])]
    kjt = torchrec.KeyedJaggedTensor.from_lengths_sync(keys=["f1", "f2"], values=torch.tensor([1, 2, 3, 19, 4, 0]),
                                                       lengths=torch.tensor([2, 1, 0, 3]))
    theirs_bags, theirs_seq = torchrec.EmbeddingBagCollection(tables=bag_cfgs), torchrec.EmbeddingCollection(seq_cfgs)
    bags = et.EmbeddingBagCollection(bag_cfgs, optimizer=ec.optimizers.Adagrad(0.1))
    seq = et.EmbeddingCollection(seq_cfgs)
    bags.load_state_dict(theirs_bags.state_dict())
    seq.load_state_dict(theirs_seq.state_dict())
    ec.save(str(tmp_path / "bags"), bags, include_optimizer=False)
    ec.save(str(tmp_path / "seq"), seq, include_optimizer=False)

    class Pooled(torch.nn.Module):
        def __init__(self, e):
            super().__init__()
            self.e = e

        def forward(self, kjt):
            return self.e(kjt).values() * 2

    class Sequence(Pooled):
        def forward(self, kjt):
            return self.e(kjt)["f2"].values() * 2

    class Single(Pooled):
        def forward(self, ids, offsets):
            return self.e(ids, offsets) * 2

    cases = [(Pooled(bags), Pooled(theirs_bags), (kjt,)),
             (Pooled(et.ServedEmbeddingBagCollection(str(tmp_path / "bags"), bag_cfgs)), Pooled(theirs_bags), (kjt,)),
             (Sequence(seq), Sequence(theirs_seq), (kjt,)),
             (Sequence(et.ServedEmbeddingCollection(str(tmp_path / "seq"), seq_cfgs)), Sequence(theirs_seq), (kjt,))]
    single = et.EmbeddingBag.from_pretrained(theirs_bags.embedding_bags.t1.weight.detach(), mode="sum")
    ref = torch.nn.EmbeddingBag.from_pretrained(theirs_bags.embedding_bags.t1.weight.detach(), mode="sum")
    cases.append((Single(single), Single(ref), (torch.tensor([1, 2, 3, 19]), torch.tensor([0, 2, 2]))))

    class Rows(Pooled):
        def forward(self, ids):
            return self.e(ids) * 2

    rows = et.Embedding.from_pretrained(theirs_bags.embedding_bags.t1.weight.detach())
    cases.append((Rows(rows), Rows(torch.nn.Embedding.from_pretrained(rows.weight.detach().clone())),
                  (torch.tensor([[1, 2], [3, 19]]),)))

    class ConstantIds(Pooled):  # plain ids, the offsets a Proxy: still refused
        def forward(self, offsets):
            return self.e(torch.tensor([1, 2, 3]), offsets)

    with pytest.raises(TypeError, match=r"EmbeddingBag: FX symbolic tracing cannot trace into its lookup"):
        torch.fx.symbolic_trace(ConstantIds(single))
    for model, reference, inputs in cases:
        name = type(model.e).__name__
        for trace in (torch.fx.symbolic_trace, torchrec.fx.symbolic_trace):
            with pytest.raises(TypeError, match=rf"{name}: FX symbolic tracing cannot trace into its lookup .*"
                                                rf"torchrec\.fx\.symbolic_trace\(model, leaf_modules=\['{name}'\]\)"):
                trace(model)
        traced = torchrec.fx.symbolic_trace(model, leaf_modules=[name])
        with torch.no_grad():
            want = reference(*inputs)
            assert torch.equal(traced(*inputs), model(*inputs)), name
            assert max_diff(traced(*inputs), want) <= 1e-6, name

        class Tracer(torch.fx.Tracer):
            def is_leaf_module(self, m, qualified_name):
                return m is model.e or super().is_leaf_module(m, qualified_name)

        graph = torch.fx.GraphModule(model, Tracer().trace(model))
        with torch.no_grad():
            assert torch.equal(graph(*inputs), model(*inputs)), name
    # A dict of features built from the traced inputs (tensors or (ids, offsets) tuples of Proxies) too.
    coll = et.EmbeddingBagCollection(tables=bag_cfgs)

    class Dict(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.e = coll

        def forward(self, a, b):
            return self.e({"f1": a, "f2": (b, b)})

    with pytest.raises(TypeError, match=r"EmbeddingBagCollection: FX symbolic tracing cannot trace into its lookup"):
        torch.fx.symbolic_trace(Dict())
    # The traced model trains the table as the eager one.
    eager = copy.deepcopy(bags)
    traced = torchrec.fx.symbolic_trace(Pooled(bags), leaf_modules=["EmbeddingBagCollection"])
    for _ in range(2):
        traced(kjt).pow(2).sum().backward()
        Pooled(eager)(kjt).pow(2).sum().backward()
    assert bags.embedding_bags.t1.table.step == 2
    assert torch.equal(bags.embedding_bags.t1.weight, eager.embedding_bags.t1.weight)


@pytest.mark.parametrize("kind", ["optimizer", "in_backward"])
def test_compiled_code_reads_and_schedules_fused_optimizer(kind):
    """fused_optimizer's param groups are plain dicts: compiled code reads
    their rate and steps a scheduler on them (Dynamo's optimizer handling
    takes no other kind of group), and copies of the optimizer keep them."""
    from torch.distributed.optim import _apply_optimizer_in_backward

    m = et.EmbeddingBag(20, 4, mode="sum", optimizer=ec.optimizers.SGD(0.1) if kind == "optimizer" else None)
    if kind == "in_backward":
        _apply_optimizer_in_backward(torch.optim.SGD, m.parameters(), {"lr": 0.1})
    m(torch.tensor([1, 2, 3]), torch.tensor([0, 2])).sum().backward()
    fo = m.fused_optimizer
    torch._dynamo.reset()
    got = torch.compile(lambda x: x * fo.param_groups[0]["lr"])(torch.ones(2))
    assert torch.allclose(got, torch.full((2,), 0.1))
    sched = torch.optim.lr_scheduler.StepLR(fo, 1, 0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (no optimizer.step() before the scheduler's: the recipe's)
        torch.compile(lambda x: (sched.step(), x * 2)[1])(torch.ones(2))
    assert fo.param_groups[0]["lr"] == pytest.approx(0.05)
    for copied in (copy.copy(fo), copy.deepcopy(fo)):
        assert copied.param_groups[0]["lr"] == pytest.approx(0.05)


def test_jit_script_and_pooled_jit_trace_are_refused_clearly(tmp_path):
    """torch.jit.script of any adapter module (a model holding one too), and
    torch.jit.trace of pooled lookups, whose bag count would be fixed at the
    trace, raise NotImplementedError pointing at torch.compile / export (were:
    an error deep in TorchScript's compiler, and PyTorch's internal assert
    "please report a bug to PyTorch"). jit.trace of Embedding traces."""
    bag, emb = et.EmbeddingBag(10, 4, mode="sum"), et.Embedding(10, 4)
    cfgs = [et.EmbeddingBagConfig(num_embeddings=10, embedding_dim=4, name="t", feature_names=["f"])]
    ebc = et.EmbeddingBagCollection(cfgs)
    ec.save(tmp_path / "c", et.tables_of(ebc))
    served = et.ServedEmbeddingBagCollection(tmp_path / "c", cfgs)
    for m in (bag, emb, ebc, served, torch.nn.Sequential(emb, torch.nn.Linear(4, 1))):
        with pytest.raises(NotImplementedError, match="torch.jit.script is not supported.*torch.compile"):
            torch.jit.script(m)
    ids, offsets = torch.tensor([1, 2, 3, 4]), torch.tensor([0, 2])
    with pytest.raises(NotImplementedError, match="torch.jit.trace of pooled lookups is not supported"):
        torch.jit.trace(bag, (ids, offsets))
    with pytest.raises(NotImplementedError, match="torch.jit.trace of pooled lookups is not supported"):
        torch.jit.trace(ebc, ({"f": torch.tensor([[1, 2], [3, 4]])},), strict=False)
    torchrec = pytest.importorskip("torchrec")

    class FromLengths(torch.nn.Module):  # a KJT made inside the traced function: its bag counts are traced
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, values, lengths):
            return self.m(torchrec.KeyedJaggedTensor(keys=["f"], values=values, lengths=lengths)).values()

    for m, owner in ((ebc, "EmbeddingBag"), (served, "ServedEmbeddingBagCollection")):
        with pytest.raises(NotImplementedError, match=f"{owner}: torch.jit.trace of pooled lookups"):
            torch.jit.trace(FromLengths(m), (torch.tensor([1, 2, 3]), torch.tensor([2, 1])), check_trace=False)
    traced = torch.jit.trace(emb, (ids,))
    torch.testing.assert_close(traced(torch.tensor([5, 0, 9])), emb(torch.tensor([5, 0, 9])))


def test_an_exported_program_reads_only_its_modules_table(tmp_path):
    """A torch.export program of an embedcore module holds the handle of its
    process's table, not the table: loaded in another process (which holds
    tables of its own) it raises, naming why, where a count of handles gave
    that process's table of the same number; a copy of the program given
    other weights raises rather than read the original's table."""
    import subprocess
    import sys

    class M(torch.nn.Module):
        def __init__(self, bag):
            super().__init__()
            self.bag = bag

        def forward(self, i, o):
            return self.bag(i, o)

    ids, offsets = torch.tensor([1, 2, 3]), torch.tensor([0, 1])
    m = M(et.EmbeddingBag.from_pretrained(torch.ones(10, 2), mode="sum"))
    ep = torch.export.export(m, (ids, offsets))
    assert torch.equal(ep.module()(ids, offsets), m(ids, offsets))  # in its process, on its module's table
    torch.export.save(ep, tmp_path / "m.pt2")
    code = ("import torch, embedcore.adapters.torch as et\n"
            "mine = [et.EmbeddingBag.from_pretrained(torch.full((10, 2), 7.0)) for _ in range(20)]\n"
            f"ep = torch.export.load({str(tmp_path / 'm.pt2')!r})\n"
            "print(ep.module()(torch.tensor([1, 2, 3]), torch.tensor([0, 1])).tolist())\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "7.0" not in r.stdout, r.stdout
    assert "is not registered" in r.stderr and "made in another process" in r.stderr, r.stderr[-2000:]
    twin = copy.deepcopy(ep.module())
    twin.load_state_dict({"bag.weight": torch.full((10, 2), 5.0)})
    with pytest.raises(RuntimeError, match="this lookup's weight is not its table's"):
        twin(ids, offsets)
    assert torch.equal(m.bag.weight, torch.ones(10, 2))


def test_modules_built_again_compile_past_the_recompile_limit(tmp_path):
    """Each module passed its table's handle, a random int, into the op:
    torch.compile fixed it in the graph and guarded on it, so every new
    module compiled again and the ninth failed (FailOnRecompileLimitHit
    under fullgraph=True: a model built again in one process, a notebook,
    a sweep, a collection's tables compiled one by one). The handle goes in
    as a tensor: twelve modules of each kind, trained fused, unfused and
    served, compile under the default limit (8) with eager's results."""
    limit = torch._dynamo.config.recompile_limit
    assert limit <= 8
    ids, offsets = torch.tensor([1, 2, 4, 4, 0]), torch.tensor([0, 2, 5])
    w = uniform_weights(np.random.default_rng(0), 6, 3)
    ec.save(tmp_path / "c", ec.Table(name="t", rows=6, dim=3, initializer=ec.initializers.Uniform(-1, 1, seed=3)))
    makers = {
        "fused": lambda: et.EmbeddingBag.from_pretrained(w, freeze=False, optimizer=ec.optimizers.SGD(0.1)),
        "unfused": lambda: et.EmbeddingBag.from_pretrained(w, freeze=False),
        "served": lambda: et.ServedEmbeddingBagCollection(
            tmp_path / "c", [et.EmbeddingBagConfig(num_embeddings=6, embedding_dim=3, name="t", feature_names=["f"])]),
    }
    for kind, make in makers.items():
        torch._dynamo.reset()
        for i in range(limit + 4):
            m = make()
            if kind == "served":
                compiled = torch.compile(lambda v, o, m=m: m({"f": (v, o)})["f"], backend="eager", fullgraph=True)
                want = m({"f": (ids, offsets)})["f"]
            else:
                compiled = torch.compile(m, backend="eager", fullgraph=True)
                want = m(ids, offsets)
            got = compiled(ids, offsets)
            assert torch.equal(got, want), (kind, i)
            if kind != "served":
                got.sum().backward()
