"""EmbeddingBagCollection / EmbeddingCollection: dict features in every form,
and (when TorchRec is installed) KeyedJaggedTensor inputs, EmbeddingBagConfig,
KeyedTensor / JaggedTensor outputs and state dicts against TorchRec's modules."""
import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import embedcore as ec  # noqa: E402
import embedcore.adapters.torch as et  # noqa: E402
from torch_helpers import bags, max_diff  # noqa: E402


def _configs(cls=et.EmbeddingBagConfig, **kw):
    return [cls(num_embeddings=30, embedding_dim=4, name="t1", feature_names=["f1", "f3"], **kw),
            cls(num_embeddings=50, embedding_dim=6, name="t2", feature_names=["f2"], **kw)]


def _ref_bag(ebc, table, mode):
    w = ebc.embedding_bags[table].weight.detach().clone()
    return torch.nn.EmbeddingBag.from_pretrained(w, mode=mode, include_last_offset=True)


def test_dict_features_every_form(rng):
    ebc = et.EmbeddingBagCollection(_configs())
    ids1, off1, w1 = bags(rng, 30, 5, weighted=True)
    ids2, off2, _ = bags(rng, 50, 5)
    x3 = torch.from_numpy(rng.integers(0, 30, size=(5, 3)))
    out = ebc({"f1": (ids1, off1, w1), "f2": {"values": ids2, "lengths": off2.diff().int()}, "f3": x3})
    assert list(out) == ["f1", "f3", "f2"]  # table order, then feature order, as TorchRec
    r1, r2 = _ref_bag(ebc, "t1", "sum"), _ref_bag(ebc, "t2", "sum")
    assert max_diff(out["f1"], r1(ids1, off1, w1)) <= 1e-6
    assert max_diff(out["f2"], r2(ids2, off2)) <= 1e-6
    assert max_diff(out["f3"], r1(x3.reshape(-1), torch.arange(0, 16, 3))) <= 1e-6
    out2 = ebc({"f1": ec.Ragged(ids1, off1), "f2": ids2, "f3": {"values": x3.reshape(-1),
                                                               "offsets": torch.arange(0, 16, 3)}})
    assert max_diff(out2["f1"], r1(ids1, off1)) <= 1e-6
    assert max_diff(out2["f2"], r2(ids2, torch.arange(len(ids2) + 1))) <= 1e-6  # one id per bag
    assert max_diff(out2["f3"], out["f3"]) == 0


def test_pooling_and_config_options(rng):
    cfgs = [et.EmbeddingBagConfig(20, 3, name="a", pooling="mean", initializer=ec.initializers.Constant(0.5)),
            et.EmbeddingBagConfig(20, 3, name="b", pooling="sqrtn", weight_init_min=1.0, weight_init_max=2.0),
            et.EmbeddingBagConfig(20, 3, name="c", init_fn=lambda t: torch.nn.init.constant_(t, -1.0),
                                  optimizer=ec.optimizers.SGD(0.1))]
    ebc = et.EmbeddingBagCollection(cfgs)
    assert float(ebc.embedding_bags["a"].weight.detach().max()) == 0.5
    wb = ebc.embedding_bags["b"].weight.detach()
    assert 1.0 <= float(wb.min()) and float(wb.max()) <= 2.0
    assert float(ebc.embedding_bags["c"].weight.detach().max()) == -1.0
    assert ebc.embedding_bags["c"].fused and not ebc.embedding_bags["a"].fused
    out = ebc({"a": (torch.tensor([1, 2, 3]), torch.tensor([0, 3])), "b": (torch.tensor([1, 2, 3, 4]),
                                                                        torch.tensor([0, 4])),
               "c": (torch.tensor([5]), torch.tensor([0, 1]))})
    assert max_diff(out["a"], torch.full((1, 3), 0.5)) <= 1e-6
    assert max_diff(out["b"], wb[1:5].sum(0, keepdim=True) / 2.0) <= 1e-6


def test_collection_errors():
    ebc = et.EmbeddingBagCollection(_configs())
    with pytest.raises(TypeError, match=r"EmbeddingBagCollection: sharding='row_wise' applies over ranks"):
        et.EmbeddingBagCollection(_configs(), sharding="row_wise")  # (no world=: it was ignored)
    # Sizes that are not ints (10.7 was a 10-row table, True a 1-row one), and a str of feature names (four).
    for kw, match in ((dict(num_embeddings=10.7), "num_embeddings must be an int, got 10.7"),
                      (dict(num_embeddings=True), "num_embeddings must be an int, got True"),
                      (dict(embedding_dim=4.0), "embedding_dim must be an int, got 4.0"),
                      (dict(feature_names="user"), r"feature_names must be a list of names, got 'user'")):
        cfg = dict(num_embeddings=10, embedding_dim=4, name="t", feature_names=["f"])
        cfg.update(kw)
        with pytest.raises(TypeError, match=match):
            et.EmbeddingBagCollection([et.EmbeddingBagConfig(**cfg)])
    ok = (torch.tensor([1]), torch.tensor([0, 1]))
    with pytest.raises(KeyError, match="f3"):
        ebc({"f1": ok, "f2": ok})
    with pytest.raises(ValueError):
        ebc({"f1": ok, "f2": ok, "f3": {"values": ok[0]}})
    with pytest.raises(TypeError):
        ebc({"f1": ok, "f2": ok, "f3": "bad"})
    with pytest.raises(TypeError):
        ebc([ok])
    with pytest.raises(IndexError):
        ebc({"f1": ok, "f2": ok, "f3": (torch.tensor([30]), torch.tensor([0, 1]))})
    # Sparse and nested tensors are refused by name (they failed inside torch, naming no feature).
    with pytest.raises(TypeError, match=r"features\['f3'\] values is a torch.sparse_coo tensor"):
        ebc({"f1": ok, "f2": ok, "f3": (ok[0].to_sparse(), ok[1])})
    with pytest.raises(TypeError, match=r"features\['f3'\] is a nested tensor: .*\.values\(\) and \.offsets\(\)"):
        ebc({"f1": ok, "f2": ok, "f3": torch.nested.nested_tensor([ok[0]], layout=torch.jagged)})
    with pytest.raises(ValueError, match="duplicate"):
        et.EmbeddingBagCollection(_configs() + _configs()[:1])
    with pytest.raises(ValueError, match="pooling"):
        et.EmbeddingBagCollection([et.EmbeddingBagConfig(5, 2, name="x", pooling="max")])
    with pytest.raises(ValueError, match="name"):
        et.EmbeddingBagCollection([et.EmbeddingBagConfig(5, 2)])


def test_bags_must_cover_every_value_as_torchrec():
    """A feature whose offsets or lengths end before its last value is
    refused (TorchRec's split by lengths refuses it; nn.EmbeddingBag's rule
    that ids after the last offset belong to no bag is not TorchRec's)."""
    ebc = et.EmbeddingBagCollection(_configs())
    ok = (torch.tensor([1]), torch.tensor([0, 1]))
    short = "features\\['f3'\\]: the offsets \\(or lengths\\) end at 1, but there are 3 values"
    for feature in ({"values": torch.tensor([1, 2, 3]), "lengths": torch.tensor([1])},
                    (torch.tensor([1, 2, 3]), torch.tensor([0, 1])), ec.Ragged(torch.tensor([1, 2, 3]), torch.tensor([0, 1]))):
        with pytest.raises(ValueError, match=short):
            ebc({"f1": ok, "f2": ok, "f3": feature})
    with pytest.raises(ValueError, match=r"features\['f3'\]\['lengths'\]\[1\] = -1 is negative"):
        ebc({"f1": ok, "f2": ok, "f3": {"values": torch.tensor([1, 2]), "lengths": torch.tensor([3, -1])}})
    # int64 lengths whose sum wraps around to the number of values (was: an error about offsets never given)
    M = 2**63 - 1
    for lengths, k in (([M, M, 4], 0), ([1, 2**62, 2**62, 2**62, 2**62, 1], 1)):
        with pytest.raises(ValueError, match=rf"features\['f3'\]\['lengths'\]\[{k}\] = {lengths[k]} is greater than "
                                             r"the number of values \(2\)"):
            ebc({"f1": ok, "f2": ok, "f3": {"values": torch.tensor([1, 2]), "lengths": torch.tensor(lengths)}})
    ecol = et.EmbeddingCollection([et.EmbeddingConfig(10, 2, name="a", feature_names=["f"])])
    with pytest.raises(ValueError, match=r"features\['f'\] offsets must be non-decreasing"):
        ecol({"f": (torch.tensor([1, 2]), torch.tensor([0, 2, 1, 2]))})
    # A decrease by more than int64 holds (from 2**62 to -2**63), which np.diff wrapped to a rise: offsets
    # accepted, bags of no sense (the sharded collections crashed on them).
    wrapped = torch.tensor([0, 2**62, -2**63, -2**62, 0, 1])
    for module, key in ((ebc, "f3"), (ecol, "f")):
        with pytest.raises(ValueError, match=rf"features\['{key}'\] offsets must be non-decreasing: .*\[1\] = "
                                             rf"{2**62} > .*\[2\] = {-2**63}"):
            module({"f1": ok, "f2": ok, key: (torch.tensor([1]), wrapped)} if key == "f3" else {key: (torch.tensor([1]), wrapped)})
    with pytest.raises(ValueError, match="end at 1, but there are 2 values"):
        ecol({"f": {"values": torch.tensor([1, 2]), "lengths": torch.tensor([1])}})
    assert ecol({"f": {"values": torch.tensor([1, 2]), "lengths": torch.tensor([0, 2])}})["f"].shape == (2, 2)


def test_bad_lengths_and_offsets_name_the_feature():
    """As the sharded collections: a ValueError naming the feature, not a
    raw torch error or the lookup's "source 1"."""
    ebc = et.EmbeddingBagCollection([et.EmbeddingBagConfig(10, 2, name="t", feature_names=["f1", "f2"])])
    ok = (torch.tensor([1, 2]), torch.tensor([0, 2]))
    for lengths in (torch.tensor([[1, 2]]), torch.tensor(3)):
        with pytest.raises(ValueError, match=r"features\['f2'\]\['lengths'\] must be 1-D"):
            ebc({"f1": ok, "f2": {"values": torch.tensor([1, 2, 3]), "lengths": lengths}})
    with pytest.raises(ValueError, match=r"features\['f2'\] offsets must be non-decreasing: "
                                         r"features\['f2'\] offsets\[1\] = 2 > features\['f2'\] offsets\[2\] = 1"):
        ebc({"f1": ok, "f2": (torch.tensor([1, 2, 3]), torch.tensor([0, 2, 1, 3]))})
    with pytest.raises(ValueError, match=r"features\['f2'\] offsets\[0\] must be 0"):
        ebc({"f1": ok, "f2": (torch.tensor([1, 2, 3]), torch.tensor([1, 3]))})


@pytest.mark.parametrize("bags", [3, 200])  # (short offsets are checked as a list, long ones in NumPy)
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_bad_offsets_named_for_short_and_long_offsets(bags, dtype):
    ebc = et.EmbeddingBagCollection([et.EmbeddingBagConfig(10, 2, name="t", feature_names=["f"])])
    good = torch.arange(bags + 1, dtype=dtype)
    values = torch.ones(bags, dtype=torch.int64)
    assert ebc({"f": (values, good)})["f"].shape == (bags, 2)
    decreasing = good.clone()
    decreasing[2] = 0
    with pytest.raises(ValueError, match=re.escape("features['f'] offsets must be non-decreasing: features['f'] "
                                                   "offsets[1] = 1 > features['f'] offsets[2] = 0")):
        ebc({"f": (values, decreasing)})
    late = good.clone()
    late[0] = 1
    with pytest.raises(ValueError, match=re.escape("features['f'] offsets[0] must be 0 (the first bag starts at the "
                                                   "first id), got 1")):
        ebc({"f": (values, late)})
    with pytest.raises(ValueError, match=re.escape(f"features['f']: the offsets (or lengths) end at {bags - 1}, "
                                                   f"but there are {bags} values")):
        ebc({"f": (values, good[:-1])})


def test_kjt_whose_lengths_do_not_cover_its_values_is_refused_as_torchrec(torchrec):
    kjt = torchrec.KeyedJaggedTensor(keys=["f1", "f2", "f3"], values=torch.tensor([1, 2, 3, 4]),
                                     lengths=torch.tensor([1, 1, 1]))
    with pytest.raises(RuntimeError):
        torchrec.EmbeddingBagCollection([torchrec.EmbeddingBagConfig(
            num_embeddings=30, embedding_dim=4, name="t1", feature_names=["f1", "f2", "f3"])])(kjt)
    with pytest.raises(ValueError, match="KeyedJaggedTensor: the offsets \\(or lengths\\) end at 3, but there are 4"):
        et.EmbeddingBagCollection(_configs())(kjt)
    # Lengths and offsets given apart, the offsets short of the values: the offsets the lookup reads are checked.
    kjt = torchrec.KeyedJaggedTensor(keys=["f1", "f2", "f3"], values=torch.arange(1, 7),
                                     lengths=torch.tensor([2, 1, 2]), offsets=torch.tensor([0, 2, 3, 5]))
    with pytest.raises(ValueError, match="the offsets \\(or lengths\\) end at 5, but there are 6 values"):
        et.EmbeddingBagCollection(_configs())(kjt)
    # A negative length is named as such.
    kjt = torchrec.KeyedJaggedTensor.from_lengths_sync(keys=["f1", "f2", "f3"], values=torch.tensor([1, 2, 3]),
                                                       lengths=torch.tensor([2, -1, 2]))
    with pytest.raises(ValueError, match=r"the KeyedJaggedTensor\['lengths'\]\[1\] = -1 is negative"):
        et.EmbeddingBagCollection(_configs())(kjt)
    # int32 lengths past the values, whose running sum (TorchRec's offsets(), int32) wraps around: the length is
    # named (was: "the offsets (or lengths) end at 1").
    kjt = torchrec.KeyedJaggedTensor(keys=["f1", "f2", "f3"], values=torch.tensor([1, 2, 3]),
                                     lengths=torch.tensor([2**31 - 1, 2**31 - 1, 3], dtype=torch.int32))
    assert int(kjt.offsets()[-1]) == 1
    with pytest.raises(ValueError, match=r"the KeyedJaggedTensor\['lengths'\]\[0\] = 2147483647 is greater than "
                                         r"the number of values \(3\)"):
        et.EmbeddingBagCollection(_configs())(kjt)
    # Lengths that each fit but whose total is past 2**32 (TorchRec's int32 offsets() wrap around to 0).
    n = 2**16
    kjt = torchrec.KeyedJaggedTensor(keys=["f1"], values=torch.zeros(n, dtype=torch.int64),
                                     lengths=torch.full((n,), n, dtype=torch.int32))
    assert int(kjt.offsets()[-1]) == 0  # (and kept by the KJT, which the collection then finds beside the lengths)
    with pytest.raises(ValueError, match=r"the KeyedJaggedTensor: the offsets \(or lengths\) end at 4294967296, but "
                                         r"there are 65536 values"):
        et.EmbeddingBagCollection([et.EmbeddingBagConfig(30, 4, name="t1", feature_names=["f1"])])(kjt)
    # A JaggedTensor of a dict of features alike, its offsets() called or not.
    for made in (False, True):
        jt = torchrec.JaggedTensor(values=torch.tensor([1, 2, 3]),
                                   lengths=torch.tensor([2**31 - 1, 2**31 - 1, 3], dtype=torch.int32))
        if made:
            jt.offsets()
        with pytest.raises(ValueError, match=r"features\['f1'\]\['lengths'\]\[0\] = 2147483647 is greater than "
                                             r"the number of values \(3\)"):
            et.EmbeddingBagCollection([et.EmbeddingBagConfig(30, 4, name="t1", feature_names=["f1"])])({"f1": jt})
    # Beside good offsets too (TorchRec refuses it: RuntimeError from split_with_sizes).
    kjt = torchrec.KeyedJaggedTensor(keys=["f1", "f2", "f3"], values=torch.arange(1, 6),
                                     lengths=torch.tensor([2, -1, 2]), offsets=torch.tensor([0, 2, 3, 5]))
    with pytest.raises(RuntimeError, match="non-negative"):
        torchrec.EmbeddingBagCollection([torchrec.EmbeddingBagConfig(
            num_embeddings=30, embedding_dim=4, name="t1", feature_names=["f1", "f2", "f3"])])(kjt)
    with pytest.raises(ValueError, match=r"the KeyedJaggedTensor\['lengths'\]\[1\] = -1 is negative"):
        et.EmbeddingBagCollection(_configs())(kjt)
    # Lengths beside offsets that describe other bags (the same total): TorchRec pools by the lengths, the lookup
    # reads the offsets, so they are refused, naming the first that disagrees.
    kjt = torchrec.KeyedJaggedTensor(keys=["f1", "f2", "f3"], values=torch.arange(1, 6),
                                     lengths=torch.tensor([1, 2, 2]), offsets=torch.tensor([0, 2, 3, 5]))
    with pytest.raises(ValueError, match=r"\['lengths'\]\[0\] = 1 disagrees with its offsets \(0 to 2\)"):
        et.EmbeddingBagCollection(_configs())(kjt)
    kjt = torchrec.KeyedJaggedTensor(keys=["f1", "f2", "f3"], values=torch.arange(1, 6),
                                     lengths=torch.tensor([2, 2, 2]), offsets=torch.tensor([0, 2, 3, 5]))
    with pytest.raises(ValueError, match="end at 6, but there are 5 values"):
        et.EmbeddingBagCollection(_configs())(kjt)
    # Both, and consistent: looked up.
    kjt = torchrec.KeyedJaggedTensor(keys=["f1", "f2", "f3"], values=torch.arange(1, 6),
                                     lengths=torch.tensor([2, 1, 2]), offsets=torch.tensor([0, 2, 3, 5]))
    assert et.EmbeddingBagCollection(_configs())(kjt).values().shape == (1, 14)  # t1: f1 and f3 (4 + 4), t2: f2 (6)


def test_bad_id_position_names_the_feature():
    ebc = et.EmbeddingBagCollection(_configs())
    ok = (torch.tensor([1]), torch.tensor([0, 1]))
    with pytest.raises(IndexError, match=r"table 't1', feature 'f3': id 30 at position 1 of features\['f3'\]'s ids"):
        ebc({"f1": ok, "f2": ok, "f3": (torch.tensor([2, 30]), torch.tensor([0, 2]))})


def test_embedding_collection_dict(rng):
    ec_mod = et.EmbeddingCollection(_configs(et.EmbeddingConfig), sparse=True)
    x1 = torch.from_numpy(rng.integers(0, 30, size=(3, 4)))
    ids2, off2, _ = bags(rng, 50, 4)
    out = ec_mod({"f1": x1, "f2": (ids2, off2), "f3": torch.tensor([1, 2])})
    w1, w2 = ec_mod.embeddings["t1"].weight, ec_mod.embeddings["t2"].weight
    assert out["f1"].shape == (3, 4, 4) and max_diff(out["f1"], w1[x1]) == 0
    assert out["f2"].shape == (len(ids2), 6) and max_diff(out["f2"], w2[ids2]) == 0
    (out["f1"].sum() + out["f3"].sum()).backward()  # one sparse gradient for both features of t1
    assert w1.grad.is_sparse and w1.grad._nnz() == 14


# ------------------------------------------------------------------ TorchRec
@pytest.fixture
def torchrec():
    return pytest.importorskip("torchrec")


def _kjt(torchrec, rng, keys, rows, batch, weighted=False):
    values, lengths = [], []
    for k in keys:
        ids, off, _ = bags(rng, rows[k], batch)
        values.append(ids)
        lengths.append(off.diff())
    v = torch.cat(values)
    w = torch.rand(len(v)) if weighted else None
    return torchrec.KeyedJaggedTensor.from_lengths_sync(keys=keys, values=v, lengths=torch.cat(lengths), weights=w)


@pytest.mark.parametrize("weighted", [False, True])
def test_kjt_matches_torchrec(rng, torchrec, weighted):
    from torchrec.modules.embedding_configs import PoolingType

    pooling = PoolingType.SUM if weighted else PoolingType.MEAN
    cfgs = [torchrec.EmbeddingBagConfig(num_embeddings=30, embedding_dim=4, name="t1", feature_names=["f1", "f3"],
                                        pooling=pooling),
            torchrec.EmbeddingBagConfig(num_embeddings=50, embedding_dim=6, name="t2", feature_names=["f2", "f3"],
                                        pooling=pooling)]
    ref = torchrec.EmbeddingBagCollection(cfgs, is_weighted=weighted)
    ours = et.EmbeddingBagCollection(cfgs, is_weighted=weighted)
    assert list(ours.state_dict()) == list(ref.state_dict())
    ours.load_state_dict(ref.state_dict())  # TorchRec's state dict loads as is
    for _ in range(3):
        kjt = _kjt(torchrec, rng, ["f2", "f3", "f1"], {"f1": 30, "f2": 30, "f3": 30}, 7, weighted)
        a, b = ref(kjt), ours(kjt)
        assert isinstance(b, torchrec.KeyedTensor)
        assert b.keys() == a.keys() == ["f1", "f3@t1", "f2", "f3@t2"]
        assert b.length_per_key() == a.length_per_key()
        assert max_diff(b.values(), a.values()) <= 1e-6


def test_kjt_training_matches_torchrec(rng, torchrec):
    cfgs = [torchrec.EmbeddingBagConfig(num_embeddings=30, embedding_dim=4, name="t1", feature_names=["f1", "f2"])]
    ref = torchrec.EmbeddingBagCollection(cfgs)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ours = et.EmbeddingBagCollection(cfgs, optimizer=ec.optimizers.SGD(0.1))
    ours.load_state_dict(ref.state_dict())
    for _ in range(5):
        kjt = _kjt(torchrec, rng, ["f1", "f2"], {"f1": 30, "f2": 30}, 6)
        g = torch.randn(6, 8)
        ref_opt.zero_grad()
        (ref(kjt).values() * g).sum().backward()
        ref_opt.step()
        (ours(kjt).values() * g).sum().backward()
    assert max_diff(ours.embedding_bags["t1"].weight, ref.embedding_bags["t1"].weight) <= 1e-5
    assert ours.embedding_bags["t1"].table.step == 5


@pytest.mark.parametrize("path", ["collection", "per_table"])
@pytest.mark.parametrize("pooling", ["sum", "mean", "sqrtn"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("opt", ["adagrad", "rowwise_adagrad"])
def test_kjt_fast_paths_match_the_general_path_bit_for_bit(rng, torchrec, monkeypatch, path, pooling, weighted, opt):
    """A KJT of int64 or int32 offsets (TorchRec's of int32 lengths) is
    looked up and trained (fused) by every table at once, one engine call
    forward and one backward ("collection"), or, where that does not apply,
    by each table's op window by window ("per_table"); the general path
    (each table's op, its segments cut out with PyTorch ops: forced here)
    gives the same bits, forward and after fused Adagrad steps, and the
    fast paths never reach it. (int32 offsets took the general path, 5-13x
    slower at small batches.)"""
    from embedcore import _embedcore
    from embedcore.adapters.torch import _ops

    cfgs = [et.EmbeddingBagConfig(num_embeddings=30, embedding_dim=4, name="t1", feature_names=["f1", "f3"],
                                  pooling=pooling),
            et.EmbeddingBagConfig(num_embeddings=50, embedding_dim=20, name="t2", feature_names=["f2"],
                                  pooling=pooling)]
    make_opt = {"adagrad": ec.optimizers.Adagrad, "rowwise_adagrad": ec.optimizers.RowWiseAdagrad}[opt]
    fast, fast32, general = (et.EmbeddingBagCollection(cfgs, is_weighted=weighted, optimizer=make_opt(0.1))
                             for _ in range(3))
    fast32.load_state_dict(fast.state_dict())
    general.load_state_dict(fast.state_dict())
    real_parts, real_many, real_steps = _ops._parts, _embedcore.lookup_windows_into, _embedcore.apply_gradients_windows
    real_source = _ops._cpu_source
    calls = []
    monkeypatch.setattr(_embedcore, "lookup_windows_into", lambda *a: calls.append("lookup") or real_many(*a))
    monkeypatch.setattr(_embedcore, "apply_gradients_windows", lambda *a: calls.append(len(a[3])) or real_steps(*a))
    if path == "per_table":
        monkeypatch.setattr(_ops, "collection_lookup", lambda *args: None)
    for _ in range(3):
        kjt = _kjt(torchrec, rng, ["f2", "f3", "f1"], {"f1": 30, "f2": 50, "f3": 30}, 7, weighted)
        kjt32 = torchrec.KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values(), weights=kjt.weights_or_none(),
                                           offsets=kjt.offsets().to(torch.int32))
        g = torch.randn(7, 28)  # f1 and f3 of t1 (dim 4), f2 of t2 (dim 20)
        monkeypatch.setattr(_ops, "_parts", None)  # the fast paths must not need it
        a = fast(kjt).values()
        (a * g).sum().backward()
        c = fast32(kjt32).values()
        (c * g).sum().backward()
        monkeypatch.setattr(_ops, "_parts", real_parts)
        monkeypatch.setattr(_ops, "_cpu_source", lambda *args: None)  # the general path
        b = general(kjt32).values()
        (b * g).sum().backward()
        monkeypatch.setattr(_ops, "_cpu_source", real_source)
        assert torch.equal(a, b) and torch.equal(c, b)
    assert calls == (["lookup", 2] * 6 if path == "collection" else [])
    for t in ("t1", "t2"):
        for m in (fast, fast32):
            assert torch.equal(m.embedding_bags[t].weight, general.embedding_bags[t].weight)
            for k, v in m.embedding_bags[t].table.slots().items():
                assert np.array_equal(v, general.embedding_bags[t].table.slots()[k])
            assert m.embedding_bags[t].table.step == general.embedding_bags[t].table.step == 3


@pytest.mark.parametrize("sparse", [True, False])
@pytest.mark.parametrize("pooling", ["sum", "mean", "sqrtn"])
def test_kjt_unfused_gradients_from_windows_match_the_general_path(rng, torchrec, monkeypatch, sparse, pooling):
    """Unfused, each table's backward takes its KJT windows as the forward
    did (int64 or int32 offsets) instead of cutting the segments again with
    PyTorch ops (the general path, forced here): the same table and per-id
    weight gradients, bit for bit."""
    from embedcore.adapters.torch import _ops

    cfgs = [et.EmbeddingBagConfig(num_embeddings=30, embedding_dim=4, name="t1", feature_names=["f1", "f3"],
                                  pooling=pooling),
            et.EmbeddingBagConfig(num_embeddings=50, embedding_dim=20, name="t2", feature_names=["f2"],
                                  pooling=pooling)]
    a, a32, b = (et.EmbeddingBagCollection(cfgs, is_weighted=True, sparse=sparse) for _ in range(3))
    a32.load_state_dict(a.state_dict())
    b.load_state_dict(a.state_dict())
    kjt = _kjt(torchrec, rng, ["f2", "f3", "f1"], {"f1": 30, "f2": 50, "f3": 30}, 7, True)
    g = torch.randn(7, 28)
    grads = []
    for ebc, off in ((a, kjt.offsets()), (a32, kjt.offsets().to(torch.int32)), (b, kjt.offsets())):
        if ebc is b:
            monkeypatch.setattr(_ops, "_cpu_source", lambda *args: None)  # the general path
        w = kjt.weights().clone().requires_grad_(True)
        k = torchrec.KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values(), weights=w, offsets=off)
        (ebc(k).values() * g).sum().backward()
        grads.append((w.grad, {t: ebc.embedding_bags[t].weight.grad for t in ("t1", "t2")}))
    for other in grads[:2]:
        assert torch.equal(other[0], grads[2][0])
        for t in ("t1", "t2"):
            ga, gb = other[1][t], grads[2][1][t]
            assert ga.is_sparse == gb.is_sparse == sparse
            if sparse:
                assert torch.equal(ga._indices(), gb._indices()) and torch.equal(ga._values(), gb._values())
            else:
                assert torch.equal(ga, gb)


def test_kjt_collection_path_trains_only_what_trains(rng, torchrec):
    """In one call of every table: a frozen table (requires_grad False) and a
    no_grad forward change nothing; the KJT's values changed in place between
    forward and backward are refused, as by every op; a learning-rate change
    of a table's parameter group applies to its next step."""
    cfgs = [et.EmbeddingBagConfig(num_embeddings=30, embedding_dim=4, name="t1", feature_names=["f1"]),
            et.EmbeddingBagConfig(num_embeddings=30, embedding_dim=8, name="t2", feature_names=["f2"])]
    ebc = et.EmbeddingBagCollection(cfgs, optimizer=ec.optimizers.SGD(0.5))
    ref = et.EmbeddingBagCollection(cfgs)  # unfused: the reference step by hand
    ref.load_state_dict(ebc.state_dict())
    ebc.embedding_bags["t1"].weight.requires_grad_(False)
    kjt = _kjt(torchrec, rng, ["f1", "f2"], {"f1": 30, "f2": 30}, 5)
    with torch.no_grad():
        ebc(kjt)
    g = torch.randn(5, 12)
    (ebc(kjt).values() * g).sum().backward()
    (ref(kjt).values() * g).sum().backward()
    assert torch.equal(ebc.embedding_bags["t1"].weight, ref.embedding_bags["t1"].weight)
    assert ebc.embedding_bags["t1"].table.step == 0
    expect = ref.embedding_bags["t2"].weight - 0.5 * ref.embedding_bags["t2"].weight.grad.to_dense()
    assert max_diff(ebc.embedding_bags["t2"].weight, expect) < 1e-6
    assert ebc.embedding_bags["t2"].table.step == 1

    before = ebc.embedding_bags["t2"].weight.detach().clone()
    out = ebc(kjt).values()
    kjt.values().add_(0)  # an in-place change (its version counter moves)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()
    assert torch.equal(ebc.embedding_bags["t2"].weight, before)

    group = next(grp for grp in ebc.fused_optimizer.param_groups if grp["table"] == "t2")
    group["lr"] = 0.0
    (ebc(kjt).values() * g).sum().backward()
    assert torch.equal(ebc.embedding_bags["t2"].weight, before)
    assert ebc.embedding_bags["t2"].table.step == 2


def test_kjt_collection_step_refused_for_one_table_changes_none(rng, torchrec):
    """The collection's fused backward checks every table before any steps:
    one table at the step limit leaves the others as they were (as the
    per-table ops do)."""
    cfgs = [et.EmbeddingBagConfig(num_embeddings=30, embedding_dim=4, name=f"t{k}", feature_names=[f"f{k}"])
            for k in range(3)]
    ebc = et.EmbeddingBagCollection(cfgs, optimizer=ec.optimizers.Adagrad(0.1))
    kjt = _kjt(torchrec, rng, ["f0", "f1", "f2"], {"f0": 30, "f1": 30, "f2": 30}, 4)
    ebc.embedding_bags["t2"].table.step = 2**62
    before = {t: m.weight.detach().clone() for t, m in ebc.embedding_bags.items()}
    with pytest.raises(ValueError, match="table 't2' is at step"):
        ebc(kjt).values().sum().backward()
    for t, m in ebc.embedding_bags.items():
        assert torch.equal(m.weight, before[t]), t
    assert [ebc.embedding_bags[t].table.step for t in ("t0", "t1")] == [0, 0]


@pytest.mark.parametrize("need_indices", [False, True])
def test_embedding_collection_matches_torchrec(rng, torchrec, need_indices):
    """Each feature's JaggedTensor as TorchRec's: values, lengths, and with
    need_indices its weights() are that feature's ids (every one of them:
    its first bag is empty and its last holds one id), else None."""
    cfgs = [torchrec.EmbeddingConfig(num_embeddings=30, embedding_dim=4, name="t1", feature_names=["f1", "f3"]),
            torchrec.EmbeddingConfig(num_embeddings=30, embedding_dim=4, name="t2", feature_names=["f2"])]
    ref = torchrec.EmbeddingCollection(cfgs, need_indices=need_indices)
    ours = et.EmbeddingCollection(cfgs, need_indices=need_indices)
    assert list(ours.state_dict()) == list(ref.state_dict())
    ours.load_state_dict(ref.state_dict())
    for _ in range(3):
        kjt = _kjt(torchrec, rng, ["f1", "f2", "f3"], {"f1": 30, "f2": 30, "f3": 30}, 7)
        assert (kjt.lengths().view(3, 7)[:, [0, -1]] == torch.tensor([0, 1])).all()  # each feature's ends: 0 and 1 id
        a, b = ref(kjt), ours(kjt)
        assert list(a) == list(b)
        for k in a:
            assert isinstance(b[k], torchrec.JaggedTensor)
            assert max_diff(b[k].values(), a[k].values()) == 0
            assert torch.equal(b[k].lengths(), a[k].lengths())
            if need_indices:
                assert torch.equal(b[k].weights(), a[k].weights()), k
                assert torch.equal(b[k].weights(), kjt[k].values()), k
            else:
                assert b[k].weights_or_none() is None and a[k].weights_or_none() is None


@pytest.mark.parametrize("offsets_dtype", [torch.int64, torch.int32])
def test_embedding_collection_kjt_rows_come_straight_from_the_engine(rng, torchrec, monkeypatch, tmp_path,
                                                                    offsets_dtype):
    """An EmbeddingCollection's KJT features (and a served one's) are each
    table's rows of its windows of the KJT, read straight from the engine
    (were cut out by the general path, re-checking the whole KJT for every
    table: 1.45 ms for 26 tables at batch 16, 0.86 now); TorchRec's values,
    forward and fused backward; a bad id is still named by the general
    path."""
    from embedcore.adapters.torch import _ops

    cfgs = [torchrec.EmbeddingConfig(num_embeddings=30, embedding_dim=4, name="t1", feature_names=["f1", "f3"]),
            torchrec.EmbeddingConfig(num_embeddings=30, embedding_dim=4, name="t2", feature_names=["f2"])]
    ref = torchrec.EmbeddingCollection(cfgs)
    ours = et.EmbeddingCollection(cfgs, optimizer=ec.optimizers.SGD(0.5))
    ours.load_state_dict(ref.state_dict())
    ec.save(tmp_path / "c", et.tables_of(ours))
    served = et.ServedEmbeddingCollection(tmp_path / "c", cfgs)
    kjt = _kjt(torchrec, rng, ["f1", "f2", "f3"], {"f1": 30, "f2": 30, "f3": 30}, 7)
    kjt = torchrec.KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values(), offsets=kjt.offsets().to(offsets_dtype))
    real_parts, used = _ops._parts, []
    monkeypatch.setattr(_ops, "_parts", lambda *a: used.append(1) or real_parts(*a))
    a = ref(kjt)
    for module in (served, ours):
        b = module(kjt)
        for k in a:
            assert torch.equal(b[k].values(), a[k].values()) and torch.equal(b[k].lengths(), a[k].lengths())
    assert not used
    sum(v.values().sum() for v in ours(kjt).values()).backward()  # fused SGD: each id's row -= 0.5 per use
    expected = {t: ref.embeddings[t].weight.detach().clone() for t in ("t1", "t2")}
    for f, t in (("f1", "t1"), ("f3", "t1"), ("f2", "t2")):
        expected[t].index_add_(0, kjt[f].values(), torch.full((len(kjt[f].values()), 4), -0.5))
    for t in ("t1", "t2"):
        torch.testing.assert_close(ours.embeddings[t].weight, expected[t], rtol=0, atol=1e-6)
    bad = torchrec.KeyedJaggedTensor(keys=kjt.keys(), values=torch.cat([kjt.values()[:-1], torch.tensor([30])]),
                                     offsets=kjt.offsets())
    for module in (served, ours):
        with pytest.raises(IndexError, match="30"):
            module(bad)


@pytest.mark.parametrize("batch", [7, 1])
def test_embedding_collection_reads_every_tables_rows_in_one_pass(rng, torchrec, monkeypatch, tmp_path, batch):
    """An EmbeddingCollection's KJT (and a served one's) reads every table's
    rows in one pass (``_ops.collection_rows``; each table's op cost about
    25 us: 26 tables at batch 16, forward 1.2 -> 0.43 ms, fused SGD step
    5.6 -> 1.05 ms), TorchRec's values bit for bit, and the fused backward
    steps every table in one engine call, as each table's op steps it:
    each feature's rows, a table's features in one step. Unfused training
    (gradients for PyTorch's optimizers) runs each table's op; a bad id is
    named by it, the tables unchanged."""
    cfgs = [torchrec.EmbeddingConfig(num_embeddings=30, embedding_dim=4, name="t1", feature_names=["f1", "f3"]),
            torchrec.EmbeddingConfig(num_embeddings=40, embedding_dim=4, name="t2", feature_names=["f2"])]
    ref = torchrec.EmbeddingCollection(cfgs, need_indices=True)
    ours = et.EmbeddingCollection(cfgs, optimizer=ec.optimizers.Adagrad(0.5), need_indices=True)
    ours.load_state_dict(ref.state_dict())
    twin = et.EmbeddingCollection(cfgs, optimizer=ec.optimizers.Adagrad(0.5), need_indices=True)
    twin.load_state_dict(ref.state_dict())
    ec.save(tmp_path / "c", et.tables_of(ours))
    served = et.ServedEmbeddingCollection(tmp_path / "c", cfgs, need_indices=True)
    unfused = et.EmbeddingCollection(cfgs, need_indices=True)
    unfused.load_state_dict(ref.state_dict())
    kjt = _kjt(torchrec, rng, ["f3", "f1", "f2"], {"f1": 30, "f2": 40, "f3": 30}, batch)
    per_table = []
    for cls in (type(ours), type(served)):
        real = cls._table_lookup
        monkeypatch.setattr(cls, "_table_lookup", lambda self, *a, real=real: per_table.append(1) or real(self, *a))
    want = ref(kjt)

    def check(out):
        assert list(out) == list(want)
        for k in want:
            assert torch.equal(out[k].values(), want[k].values()), k
            assert torch.equal(out[k].lengths(), want[k].lengths()) and torch.equal(out[k].weights(), want[k].weights())

    with torch.no_grad():
        check(ours(kjt))
        check(unfused(kjt))
    check(served(kjt))
    unfused.requires_grad_(False)
    check(unfused(kjt))  # frozen, with grad enabled
    out = ours(kjt)  # fused training
    check(out)
    assert not per_table
    g = {k: torch.randn(v.values().shape) for k, v in out.items()}
    sum((v.values() * g[k]).sum() for k, v in out.items()).backward()
    assert not per_table and [m.table.step for m in ours.embeddings.values()] == [1, 1]
    # Each table's op (the per-table path, as under torch.compile) steps the same bits.
    one_pass = et._ops.collection_rows
    monkeypatch.setattr(et._ops, "collection_rows", lambda *a: None)
    out2 = twin(kjt)
    sum((v.values() * g[k]).sum() for k, v in out2.items()).backward()
    assert len(per_table) == 2
    for t, features in (("t1", ["f1", "f3"]), ("t2", ["f2"])):
        assert torch.equal(ours.embeddings[t].weight, twin.embeddings[t].weight), t
        looked_up = any(kjt[f].values().numel() for f in features)  # (batch 1's bags here are empty)
        assert torch.equal(ours.embeddings[t].weight, ref.embeddings[t].weight) != looked_up, t
        assert np.array_equal(ours.embeddings[t].table.slots()["accumulators"],
                              twin.embeddings[t].table.slots()["accumulators"]), t
    monkeypatch.setattr(et._ops, "collection_rows", one_pass)
    per_table.clear()
    twin.embeddings["t2"].weight.requires_grad_(False)  # a frozen table beside a trained one: still one pass
    frozen = twin.embeddings["t2"].weight.detach().clone()
    out = twin(kjt)
    sum((v.values() * g[k]).sum() for k, v in out.items()).backward()
    assert not per_table and [m.table.step for m in twin.embeddings.values()] == [2, 1]
    assert torch.equal(twin.embeddings["t2"].weight, frozen) and not out["f2"].values().requires_grad
    unfused.requires_grad_(True)
    out = unfused(kjt)  # unfused training: each table's op, with gradients for PyTorch's optimizers
    sum(v.values().sum() for v in out.values()).backward()
    assert len(per_table) == 2 and unfused.embeddings["t1"].weight.grad is not None
    bad = torchrec.KeyedJaggedTensor(keys=["f3", "f1", "f2"], values=torch.tensor([1, 2, 45]),
                                     lengths=torch.tensor([1, 1, 1]))
    before = {t: m.weight.detach().clone() for t, m in ours.embeddings.items()}
    for module in (served, ours):
        with pytest.raises(IndexError, match=r"table 't2'.*id 45 at position 2"):
            module(bad)
    assert all(torch.equal(m.weight, before[t]) for t, m in ours.embeddings.items())


def test_state_dict_into_torchrec(rng, torchrec):
    ours = et.EmbeddingBagCollection(_configs(), optimizer=ec.optimizers.Adagrad(0.1))
    ref = torchrec.EmbeddingBagCollection([torchrec.EmbeddingBagConfig(num_embeddings=30, embedding_dim=4, name="t1",
                                                                       feature_names=["f1", "f3"]),
                                           torchrec.EmbeddingBagConfig(num_embeddings=50, embedding_dim=6, name="t2",
                                                                       feature_names=["f2"])])
    ref.load_state_dict(ours.state_dict())
    for t in ("t1", "t2"):
        assert torch.equal(ref.embedding_bags[t].weight, ours.embedding_bags[t].weight)


def test_variable_stride_kjt_is_refused(torchrec):
    ebc = et.EmbeddingBagCollection(_configs())
    kjt = torchrec.KeyedJaggedTensor(keys=["f1", "f2", "f3"], values=torch.tensor([1, 2, 3, 4]),
                                     lengths=torch.tensor([1, 1, 1, 1]), stride_per_key_per_rank=[[1], [2], [1]])
    with pytest.raises(NotImplementedError):
        ebc(kjt)
    with pytest.raises(KeyError):
        ebc(torchrec.KeyedJaggedTensor.from_lengths_sync(keys=["f1"], values=torch.tensor([1]),
                                                         lengths=torch.tensor([1])))


# ----------------------------------------------------------------- weighted mean / sqrtn gradients
def _autograd_reference(weight, ids, offsets, w, pooling):
    """The same pooled output written with torch ops, for autograd."""
    rows = weight[ids] * w[:, None]
    out = []
    for b in range(len(offsets) - 1):
        s = rows[offsets[b]:offsets[b + 1]].sum(0)
        ww = w[offsets[b]:offsets[b + 1]]
        den = ww.sum() if pooling == "mean" else ww.pow(2).sum().sqrt() if pooling == "sqrtn" else None
        out.append(s if den is None else torch.where(den != 0, s / torch.where(den != 0, den, 1.0), 0.0 * s))
    return torch.stack(out)


@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("pooling", ["sum", "mean", "sqrtn"])
def test_weighted_pooling_gradients_match_autograd(pooling, sparse):
    """Unfused table gradients and per-id weight gradients of weighted bags
    (the forward divides by sum(w), or sqrt(sum(w^2))) equal autograd's on
    the same formula; a bag whose weights sum to 0 has zero gradients."""
    torch.manual_seed(3)
    ebc = et.EmbeddingBagCollection([et.EmbeddingBagConfig(num_embeddings=12, embedding_dim=5, name="t",
                                                           feature_names=["f"], pooling=pooling)], sparse=sparse)
    ids = torch.tensor([1, 2, 3, 4, 2, 7, 8, 9, 9])
    offsets = torch.tensor([0, 3, 4, 4, 7, 9])  # an empty bag, and a last bag whose weights sum to 0 (mean)
    w = torch.tensor([0.5, 2.0, -3.0, 4.0, 1.5, -0.5, 0.25, 2.0, -2.0], requires_grad=True)
    weight = ebc.embedding_bags["t"].weight.detach().clone().requires_grad_(True)
    w_ref = w.detach().clone().requires_grad_(True)
    out = ebc({"f": {"values": ids, "offsets": offsets, "weights": w}})["f"]
    ref = _autograd_reference(weight, ids, offsets, w_ref, pooling)
    assert max_diff(out, ref) < 1e-6
    g = torch.randn_like(out)
    out.backward(g)
    ref.backward(g)
    got = ebc.embedding_bags["t"].weight.grad
    got = got.to_dense() if got.is_sparse else got
    assert max_diff(got, weight.grad) < 1e-5
    assert max_diff(w.grad, w_ref.grad) < 1e-5


def test_kjt_bad_id_position_is_in_the_kjt_values(torchrec):
    """The engine sees one feature's window of the values; the error names
    the id's position in kjt.values() (was: in the window) and its feature
    (as the served collections do)."""
    ebc = et.EmbeddingBagCollection(_configs())
    kjt = torchrec.KeyedJaggedTensor.from_lengths_sync(keys=["f1", "f2", "f3"], values=torch.tensor([1, 2, 3, 60]),
                                                       lengths=torch.tensor([1, 1, 0, 2, 0, 0]))
    with pytest.raises(IndexError, match="table 't2', feature 'f2': id 60 at position 3 of the KeyedJaggedTensor's "
                                         r"values is out of range \[0, 50\)"):
        ebc(kjt)
    ec_mod = et.EmbeddingCollection(_configs(et.EmbeddingConfig))
    with pytest.raises(IndexError, match="table 't2', feature 'f2': id 60 at position 3 of the KeyedJaggedTensor's"):
        ec_mod(kjt)


def test_configs_are_returned_as_given(torchrec):
    """embedding_bag_configs() / embedding_configs() return the configs, as
    TorchRec's do (was: internal objects without num_embeddings etc.)."""
    cfgs = [torchrec.EmbeddingBagConfig(num_embeddings=30, embedding_dim=4, name="t1", feature_names=["f1"])]
    ref, ours = torchrec.EmbeddingBagCollection(cfgs), et.EmbeddingBagCollection(cfgs)
    for a, b in zip(ref.embedding_bag_configs(), ours.embedding_bag_configs()):
        assert (b.num_embeddings, b.embedding_dim, b.name, b.feature_names) == \
            (a.num_embeddings, a.embedding_dim, a.name, a.feature_names)
    assert et.EmbeddingBagCollection(_configs()).embedding_bag_configs()[1].num_embeddings == 50
    ecfgs = [torchrec.EmbeddingConfig(num_embeddings=30, embedding_dim=4, name="t1", feature_names=["f1"])]
    ref, ours = torchrec.EmbeddingCollection(ecfgs), et.EmbeddingCollection(ecfgs)
    assert [c.embedding_dim for c in ours.embedding_configs()] == [c.embedding_dim for c in ref.embedding_configs()]


def test_device_names_and_reset_parameters_as_torchrec(torchrec):
    """device, embedding_names_by_table(), embedding_dim() and
    reset_parameters() as TorchRec's collections have them."""
    ecfgs = [torchrec.EmbeddingConfig(num_embeddings=30, embedding_dim=4, name="t1", feature_names=["f1", "f2"]),
             torchrec.EmbeddingConfig(num_embeddings=20, embedding_dim=4, name="t2", feature_names=["f3"])]
    ref, ours = torchrec.EmbeddingCollection(ecfgs), et.EmbeddingCollection(ecfgs)
    assert ours.device == ref.device == torch.device("cpu")
    assert ours.embedding_names_by_table() == ref.embedding_names_by_table() == [["f1", "f2"], ["f3"]]
    assert ours.embedding_dim() == ref.embedding_dim() == 4
    with pytest.raises(ValueError, match=r"dimensions \[4, 6\]"):
        et.EmbeddingCollection([et.EmbeddingConfig(5, 4, name="a"), et.EmbeddingConfig(5, 6, name="b")]).embedding_dim()
    # A TorchRec config's init_fn draws again, within its bounds (as TorchRec's reset_parameters).
    bag_cfg = torchrec.EmbeddingBagConfig(num_embeddings=300, embedding_dim=4, name="t", feature_names=["f"],
                                          weight_init_min=-0.1, weight_init_max=0.1)
    ebc = et.EmbeddingBagCollection([bag_cfg, et.EmbeddingBagConfig(
        200, 3, name="u", feature_names=["g"], initializer=ec.initializers.Uniform(-1, 1, seed=4),
        optimizer=ec.optimizers.Adagrad(0.5))])
    assert ebc.device == torch.device("cpu")
    built_u = ebc.embedding_bags["u"].weight.detach().clone()
    out = ebc({"f": torch.tensor([[1, 2]]), "g": torch.tensor([[3, 4]])})
    (out["f"].sum() + out["g"].sum()).backward()  # trains u (fused) and leaves its accumulators changed
    accumulators = ebc.embedding_bags["u"]._table.slots()["accumulators"].copy()
    with torch.no_grad():
        ebc.embedding_bags["t"].weight.fill_(5.0)
    ebc.reset_parameters()
    t = ebc.embedding_bags["t"].weight.detach()
    assert float(t.min()) >= -0.1 and float(t.max()) <= 0.1 and torch.unique(t).numel() > 1000
    assert torch.equal(ebc.embedding_bags["u"].weight.detach(), built_u)  # the seeded initializer's values
    np.testing.assert_array_equal(ebc.embedding_bags["u"]._table.slots()["accumulators"], accumulators)


@pytest.mark.parametrize("pooled", [True, False], ids=["bag", "embedding"])
def test_default_init_is_torchrecs_uniform(torchrec, pooled):
    """A table of our config without any init is uniform in TorchRec's
    default range, the [a, b] of the init_fn TorchRec's config of the same
    size gets (+-sqrt(1 / num_embeddings)): on tables with rows != dim, both
    wider and narrower than +-sqrt(1 / dim), the values stay inside it and
    reach within 2% of both ends."""
    ours_cfg, their_cfg = ((et.EmbeddingBagConfig, torchrec.EmbeddingBagConfig) if pooled
                           else (et.EmbeddingConfig, torchrec.EmbeddingConfig))
    cls = et.EmbeddingBagCollection if pooled else et.EmbeddingCollection
    sizes = {"long": (2500, 8), "short": (16, 100)}
    module = cls([ours_cfg(rows, dim, name=name, feature_names=[name]) for name, (rows, dim) in sizes.items()])
    tables = module.embedding_bags if pooled else module.embeddings
    for name, (rows, dim) in sizes.items():
        init_fn = their_cfg(num_embeddings=rows, embedding_dim=dim, name=name, feature_names=[name]).init_fn
        lo, hi = init_fn.keywords["a"], init_fn.keywords["b"]
        w = tables[name].weight.detach()
        assert w.shape == (rows, dim)
        assert lo <= float(w.min()) < 0.98 * lo and 0.98 * hi < float(w.max()) <= hi, (name, lo, hi)
        assert torch.unique(w).numel() > 0.99 * w.numel()


def test_kjt_with_bags_not_one_per_key_and_example_is_refused():
    torchrec = pytest.importorskip("torchrec")
    kjt = torchrec.KeyedJaggedTensor(keys=["f", "g"], values=torch.tensor([1, 2, 3]), lengths=torch.tensor([1, 1, 1]))
    ebc = et.EmbeddingBagCollection([et.EmbeddingBagConfig(num_embeddings=10, embedding_dim=3, name="a",
                                                           feature_names=["f", "g"])])
    with pytest.raises(ValueError, match="has 3 bags for 2 keys; with batch size 1 it needs 2"):
        ebc(kjt)
    ec_ = et.EmbeddingCollection([et.EmbeddingConfig(num_embeddings=10, embedding_dim=3, name="a",
                                                     feature_names=["f", "g"])])
    with pytest.raises(ValueError, match="has 3 bags for 2 keys"):
        ec_(kjt)


def test_kjt_with_inverse_indices_is_refused(torchrec):
    """TorchRec expands a deduplicated batch by its inverse_indices after the
    lookup; the collections do not, so such a KJT is refused, not served
    at the deduplicated batch size."""
    kjt = torchrec.KeyedJaggedTensor(keys=["f1", "f2"], values=torch.tensor([1, 2, 3, 4, 5]),
                                     lengths=torch.tensor([1, 2, 1, 1]),
                                     inverse_indices=(["f1", "f2"], torch.tensor([[0, 1, 1, 0], [1, 0, 0, 1]])))
    cfgs = [et.EmbeddingBagConfig(num_embeddings=30, embedding_dim=4, name="t1", feature_names=["f1"]),
            et.EmbeddingBagConfig(num_embeddings=50, embedding_dim=6, name="t2", feature_names=["f2"])]
    with pytest.raises(NotImplementedError, match="inverse_indices"):
        et.EmbeddingBagCollection(cfgs)(kjt)
    plain = torchrec.KeyedJaggedTensor(keys=["f1", "f2"], values=kjt.values(), lengths=kjt.lengths())
    assert et.EmbeddingBagCollection(cfgs)(plain).values().shape == (2, 10)


def test_torchrec_positional_arguments_are_refused_by_name():
    """TorchRec's second positional argument is is_weighted (device for
    EmbeddingCollection); here it is optimizer: the error says so."""
    with pytest.raises(TypeError, match=r"EmbeddingBagCollection: the second argument is optimizer=.*is_weighted="):
        et.EmbeddingBagCollection(_configs(), True)
    with pytest.raises(TypeError, match=r"EmbeddingCollection: the second argument is optimizer=.*device="):
        et.EmbeddingCollection(_configs(et.EmbeddingConfig), "cpu")


@pytest.mark.parametrize("form", ["dict", "kjt", "kjt_int32_offsets"])
def test_features_outside_the_loss_step_only_with_kjt_inputs(rng, torchrec, form):
    """Which tables step when only feature a's output reaches the loss
    (docs/torch.md). Dict input: one output per feature; b's gets no gradient
    and its table does not step. KJT input: one KeyedTensor; b's columns get
    zero gradients and its table steps with them, as TorchRec's fused tables
    do (FBGEMM's TBE runs its optimizer on every looked-up row: with
    EXACT_ADAGRAD and eps=0 the unused table's rows become 0/0 = NaN). The
    reference: nn.EmbeddingBag(sparse=True) tables with SparseAdam, b's
    output given zero gradients (or none)."""
    cfgs = [et.EmbeddingBagConfig(num_embeddings=10, embedding_dim=4, name="t1", feature_names=["a"]),
            et.EmbeddingBagConfig(num_embeddings=10, embedding_dim=4, name="t2", feature_names=["b"])]
    ebc = et.EmbeddingBagCollection(cfgs, optimizer=ec.optimizers.Adam(0.1, bias_correction=True,
                                                                        sum_inside_sqrt=False, epsilon=1e-8))
    refs = {n: torch.nn.EmbeddingBag.from_pretrained(ebc.embedding_bags[n].weight.detach().clone(), freeze=False,
                                                     mode="sum", sparse=True) for n in ("t1", "t2")}
    opts = {n: torch.optim.SparseAdam([r.weight], lr=0.1) for n, r in refs.items()}
    ids = {"a": torch.tensor([1, 2]), "b": torch.tensor([3, 4])}

    def forward():
        if form == "dict":
            return ebc(ids)
        values, lengths = torch.cat([ids["a"], ids["b"]]), torch.ones(4, dtype=torch.int64)
        if form == "kjt":
            return ebc(torchrec.KeyedJaggedTensor.from_lengths_sync(keys=["a", "b"], values=values, lengths=lengths))
        return ebc(torchrec.KeyedJaggedTensor(keys=["a", "b"], values=values, lengths=lengths,
                                              offsets=torch.arange(5, dtype=torch.int32)))

    zero_grads_step_b = form != "dict"
    for both in (True, False, False):  # a first step of both tables, so that Adam's slots hold something
        out = forward()
        (out["a"].sum() + (out["b"].sum() if both else 0)).backward()
        for n, key in (("t1", "a"), ("t2", "b")):
            if n == "t1" or both or zero_grads_step_b:
                opts[n].zero_grad()
                (refs[n](ids[key], torch.tensor([0, 1])).sum() * (1.0 if n == "t1" or both else 0.0)).backward()
                opts[n].step()
    for n in ("t1", "t2"):
        assert max_diff(ebc.embedding_bags[n].weight, refs[n].weight) <= 1e-5, n
    assert ebc.embedding_bags["t1"].table.step == 3
    assert ebc.embedding_bags["t2"].table.step == (3 if zero_grads_step_b else 1)
    if zero_grads_step_b:  # the zero gradients moved b's rows (Adam's first moment decays, not to zero)
        before = ebc.embedding_bags["t2"].weight.detach().clone()
        forward()["a"].sum().backward()
        assert not torch.equal(ebc.embedding_bags["t2"].weight[3:5], before[3:5])
        assert torch.equal(ebc.embedding_bags["t2"].weight[5:], before[5:])


@pytest.mark.parametrize("dtype", [torch.int16, torch.int8, torch.uint8])
def test_kjt_with_narrow_int_lengths_as_torchrec(rng, torchrec, tmp_path, dtype):
    """A KJT's lengths may be int8, int16 or uint8, as TorchRec's collections
    take them (FBGEMM's cumsum behind kjt.offsets() has no kernel for them):
    the four collections give TorchRec's results; lengths of another dtype
    raise TypeError naming it."""
    bag_cfgs = [torchrec.EmbeddingBagConfig(num_embeddings=30, embedding_dim=4, name="t1", feature_names=["f1", "f2"])]
    seq_cfgs = [torchrec.EmbeddingConfig(num_embeddings=30, embedding_dim=4, name="t1", feature_names=["f1", "f2"])]
    modules = {}
    for kind, cfgs, theirs_cls, ours_cls, served_cls in [
            ("bags", bag_cfgs, torchrec.EmbeddingBagCollection, et.EmbeddingBagCollection,
             et.ServedEmbeddingBagCollection),
            ("seq", seq_cfgs, torchrec.EmbeddingCollection, et.EmbeddingCollection, et.ServedEmbeddingCollection)]:
        theirs, ours = theirs_cls(tables=cfgs), ours_cls(cfgs)
        ours.load_state_dict(theirs.state_dict())
        ec.save(str(tmp_path / kind), ours, include_optimizer=False)
        modules[kind] = (theirs, [ours, served_cls(str(tmp_path / kind), cfgs)])
    wide = _kjt(torchrec, rng, ["f2", "f1"], {"f1": 30, "f2": 30}, 5)
    kjt = torchrec.KeyedJaggedTensor(keys=wide.keys(), values=wide.values(), lengths=wide.lengths().to(dtype))
    with torch.no_grad():
        want = modules["bags"][0](kjt)
        assert want.keys() == ["f1", "f2"]
        for m in modules["bags"][1]:
            got = m(kjt)
            assert got.keys() == want.keys() and max_diff(got.values(), want.values()) <= 1e-6, type(m).__name__
        want = modules["seq"][0](kjt)
        for m in modules["seq"][1]:
            got = m(kjt)
            assert list(got) == list(want), type(m).__name__
            for k in want:
                assert max_diff(got[k].values(), want[k].values()) == 0
                assert torch.equal(got[k].lengths(), want[k].lengths())
    # A JaggedTensor feature of a dict input too.
    jt = torchrec.JaggedTensor(values=wide["f1"].values(), lengths=wide["f1"].lengths().to(dtype))
    jt64 = torchrec.JaggedTensor(values=wide["f1"].values(), lengths=wide["f1"].lengths())
    ours = modules["bags"][1][0]
    assert torch.equal(ours({"f1": jt, "f2": jt})["f1"], ours({"f1": jt64, "f2": jt64})["f1"])
    # Training steps the rows TorchRec's does.
    theirs, ours = modules["bags"][0], modules["bags"][1][0]
    opt = torch.optim.SGD(theirs.parameters(), lr=0.1)
    for m in (theirs, ours):
        (m(kjt).values() * torch.arange(8.0)).sum().backward()
    opt.step()
    ours_opt = torch.optim.SGD(ours.parameters(), lr=0.1)
    ours_opt.step()
    assert max_diff(ours.embedding_bags.t1.weight, theirs.embedding_bags.t1.weight) <= 1e-6
    # (TorchRec's KJT asserts integer lengths when made: float ones set after, as python -O would let through.)
    bad = torchrec.KeyedJaggedTensor(keys=wide.keys(), values=wide.values(), lengths=wide.lengths())
    bad._lengths = bad._lengths.float()
    for m in modules["bags"][1] + modules["seq"][1]:
        with pytest.raises(TypeError, match=r"KeyedJaggedTensor lengths must be an int32 or int64 tensor .*got "
                                            r"torch.float32"):
            m(bad)
    # Sparse lengths, alone or beside offsets, by name (torch's "Could not run 'aten::cumsum' ... 'SparseCPU'").
    sparse = torchrec.KeyedJaggedTensor(keys=wide.keys(), values=wide.values(), lengths=wide.lengths().to_sparse())
    beside = torchrec.KeyedJaggedTensor(keys=wide.keys(), values=wide.values(), offsets=wide.offsets(),
                                        lengths=wide.lengths().to_sparse())
    for m in modules["bags"][1] + modules["seq"][1]:
        for kjt in (sparse, beside):
            with pytest.raises(TypeError, match=r"KeyedJaggedTensor lengths is a torch.sparse_coo tensor"):
                m(kjt)


def test_kjt_with_values_not_1d_is_refused_naming_the_shape(torchrec, tmp_path):
    """A KJT's values must be 1-D ids: [n, 1] and [n, k] values raise
    ValueError giving the shape (not a count of values against the
    offsets), on every collection, before anything changes."""
    bag_cfgs = [torchrec.EmbeddingBagConfig(num_embeddings=10, embedding_dim=4, name="t1", feature_names=["f1"])]
    seq_cfgs = [torchrec.EmbeddingConfig(num_embeddings=10, embedding_dim=4, name="t1", feature_names=["f1"])]
    bags = et.EmbeddingBagCollection(bag_cfgs, optimizer=ec.optimizers.SGD(0.1))
    seq = et.EmbeddingCollection(seq_cfgs, optimizer=ec.optimizers.SGD(0.1))
    ec.save(str(tmp_path / "bags"), bags, include_optimizer=False)
    ec.save(str(tmp_path / "seq"), seq, include_optimizer=False)
    modules = [bags, seq, et.ServedEmbeddingBagCollection(str(tmp_path / "bags"), bag_cfgs),
               et.ServedEmbeddingCollection(str(tmp_path / "seq"), seq_cfgs)]
    before = [bags.embedding_bags.t1.weight.clone(), seq.embeddings.t1.weight.clone()]
    for values, lengths in [([[1], [2], [3]], [2, 1]), ([[1, 2], [3, 4]], [2, 2])]:
        kjt = torchrec.KeyedJaggedTensor(keys=["f1"], values=torch.tensor(values), lengths=torch.tensor(lengths))
        shape = tuple(torch.tensor(values).shape)
        for m in modules:
            with pytest.raises(ValueError, match=rf"{type(m).__name__}: the KeyedJaggedTensor's values must be 1-D "
                                                 rf"\(one id per value\), got shape \({shape[0]}, {shape[1]}\)"):
                m(kjt)
    assert torch.equal(bags.embedding_bags.t1.weight, before[0]) and torch.equal(seq.embeddings.t1.weight, before[1])
    assert bags.embedding_bags.t1.table.step == 0 and seq.embeddings.t1.table.step == 0


def test_configs_take_torchrec_s_fields_and_methods(torchrec):
    """data_type, need_pos, num_features() and get_weight_init_min/max(), as
    TorchRec's configs have them (data_type was a TypeError)."""
    from torchrec.modules.embedding_configs import DataType

    ours = et.EmbeddingBagConfig(num_embeddings=10, embedding_dim=4, name="t", feature_names=["a", "b"],
                                 data_type=DataType.FP16, need_pos=True, weight_init_min=-0.2)
    theirs = torchrec.EmbeddingBagConfig(num_embeddings=10, embedding_dim=4, name="t", feature_names=["a", "b"],
                                         data_type=DataType.FP16, need_pos=True, weight_init_min=-0.2)
    for method in ("num_features", "get_weight_init_min", "get_weight_init_max"):
        assert getattr(ours, method)() == pytest.approx(getattr(theirs, method)()), method
    assert ours.need_pos
    ebc = et.EmbeddingBagCollection([ours])
    assert ebc.embedding_bags["t"].weight.dtype == torch.float16
    assert et.EmbeddingBagCollection([et.EmbeddingBagConfig(10, 4, "t")]).embedding_bags["t"].weight.dtype == \
        torch.float32  # no data_type: dtype's default


@pytest.mark.parametrize("cls,torchrec_params", [
    (et.EmbeddingBagCollection, ["tables", "is_weighted", "device"]),
    (et.EmbeddingCollection, ["tables", "device", "need_indices"]),
])
def test_help_shows_the_collections_parameters(cls, torchrec_params):
    """The __new__ that picks the sharded class took (*args, **kwargs): help()
    and inspect.signature showed those instead of the parameters."""
    import inspect

    params = inspect.signature(cls).parameters
    assert set(torchrec_params) | {"optimizer", "sparse", "world", "sharding"} <= set(params)
    assert params["sparse"].default is True and params["world"].kind is inspect.Parameter.KEYWORD_ONLY
    module = cls([et.EmbeddingBagConfig(num_embeddings=4, embedding_dim=2, name="t", feature_names=["f"])])
    assert "tables" not in inspect.signature(module).parameters  # a module's own is its call's, as before


@pytest.mark.parametrize("opt", ["ftrl", "adam"])
def test_embedding_collection_one_pass_steps_only_what_reached_the_loss(rng, torchrec, monkeypatch, opt):
    """The one-pass fused step, as each table's op: a feature whose rows did
    not reach the loss gives its ids no update, and a table none of whose
    features did takes no step (a step of zeros moved FTRL's and Adam's
    values and slots, and the table's step)."""
    cfgs = [torchrec.EmbeddingConfig(num_embeddings=30, embedding_dim=4, name="t1", feature_names=["f1", "f2"]),
            torchrec.EmbeddingConfig(num_embeddings=30, embedding_dim=4, name="t2", feature_names=["f3"])]
    make = {"ftrl": lambda: ec.optimizers.FTRL(0.5), "adam": lambda: ec.optimizers.Adam(0.1)}[opt]
    one, per = (et.EmbeddingCollection(cfgs, optimizer=make()) for _ in range(2))
    per.load_state_dict(one.state_dict())
    kjt = torchrec.KeyedJaggedTensor.from_lengths_sync(keys=["f1", "f2", "f3"], values=torch.tensor([1, 5, 6, 7]),
                                                       lengths=torch.tensor([1, 1, 2]))
    g = torch.from_numpy(rng.standard_normal((1, 4)).astype(np.float32))
    (one(kjt)["f1"].values() * g).sum().backward()
    monkeypatch.setattr(et._ops, "collection_rows", lambda *a: None)  # each table's op
    (per(kjt)["f1"].values() * g).sum().backward()
    for t in ("t1", "t2"):
        assert torch.equal(one.embeddings[t].weight, per.embeddings[t].weight), t
        for name, slot in one.embeddings[t].table.slots().items():
            assert np.array_equal(slot, per.embeddings[t].table.slots()[name]), (t, name)
    assert [m.table.step for m in one.embeddings.values()] == [1, 0]


def test_configs_hold_what_torchrecs_hold(torchrec):
    """The adapter's configs take TorchRec's fields (recorded, not read, as by
    its unsharded collections), default init_fn as TorchRec's (still drawn
    by the engine, seeded from PyTorch's generator), and a collection names a config's feature after its table
    when it has none, as TorchRec's do; EmbeddingCollection takes
    use_gather_select."""
    from torchrec.modules.embedding_configs import DataType

    extra = dict(num_embeddings_post_pruning=5, input_dim=10, total_num_buckets=2, use_virtual_table=False,
                 enable_embedding_update=False, stash_weights=False)
    ours = et.EmbeddingBagConfig(num_embeddings=10, embedding_dim=4, name="t", **extra)
    theirs = torchrec.EmbeddingBagConfig(num_embeddings=10, embedding_dim=4, name="t", **extra)
    for k in extra:
        assert getattr(ours, k) == getattr(theirs, k), k
    assert ours.data_type is None and theirs.data_type == DataType.FP32  # (None: the dtype's, float32 here)
    half = et.EmbeddingBagConfig(10, 4, name="h", dtype="float16")
    half.dtype = "bfloat16"  # a config changed after it is made: its dtype is the table's
    assert et.EmbeddingBagCollection([half]).embedding_bags["h"].weight.dtype == torch.bfloat16
    w = torch.empty(10, 4)
    ours.init_fn(w)  # TorchRec's uniform in the config's bounds
    assert float(w.abs().max()) <= ours.get_weight_init_max() and float(w.std()) > 0
    torch.manual_seed(3)
    a = et.EmbeddingBagCollection([ours])
    torch.manual_seed(3)
    bound = (1.0 / 10) ** 0.5
    init = ec.initializers.Uniform(-bound, bound, seed=int(torch.randint(0, 2**62, (1,)).item()))
    b = et.EmbeddingBagCollection([et.EmbeddingBagConfig(num_embeddings=10, embedding_dim=4, name="t",
                                                         initializer=init)])
    assert torch.equal(a.embedding_bags["t"].weight, b.embedding_bags["t"].weight)  # drawn by the engine, seeded
    assert ours.feature_names == ["t"] and a.embedding_bag_configs()[0].feature_names == ["t"]
    assert list(a(torchrec.KeyedJaggedTensor.from_lengths_sync(keys=["t"], values=torch.tensor([1]),
                                                              lengths=torch.tensor([1]))).keys()) == ["t"]
    ec_ = et.EmbeddingCollection([et.EmbeddingConfig(10, 4, name="s")], use_gather_select=False,
                                 use_gather_select_per_sharding={"s": False})
    assert ec_.embedding_configs()[0].feature_names == ["s"]


@pytest.mark.parametrize("lengths_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("offsets_dtype", [torch.int32, torch.int64])
def test_kjt_lengths_are_checked_against_offsets_of_any_int_dtype(torchrec, lengths_dtype, offsets_dtype):
    """The one-pass check of a KJT's lengths against its offsets (the
    engine's, for CPU int32 / int64): agreeing ones look up, the first that
    disagrees is named."""
    ebc = et.EmbeddingBagCollection(_configs())

    def kjt(lengths):
        return torchrec.KeyedJaggedTensor(keys=["f1", "f2", "f3"], values=torch.arange(1, 6),
                                          lengths=torch.tensor(lengths, dtype=lengths_dtype),
                                          offsets=torch.tensor([0, 2, 3, 5], dtype=offsets_dtype))

    assert ebc(kjt([2, 1, 2])).values().shape == (1, 14)
    with pytest.raises(ValueError, match=r"\['lengths'\]\[1\] = 2 disagrees with its offsets \(2 to 3\)"):
        ebc(kjt([2, 2, 1]))
