"""ServedEmbeddingBagCollection / ServedEmbeddingCollection: a checkpoint
served in TorchRec's inference shape. Compared bit for bit with the training
collections the checkpoints were saved from (KeyedJaggedTensors and dicts,
weights, poolings, stored dtypes), with TorchRec's own modules (float, and
its INT8 QuantEmbeddingBagCollection against uint8_rowwise exports), from
threads and under torch.compile; and their errors."""
import copy
import pickle
import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import embedcore as ec  # noqa: E402
import embedcore.adapters.torch as et  # noqa: E402
from torch_helpers import bags  # noqa: E402


def _configs(cls=et.EmbeddingBagConfig, pooling=None, **kw):
    extra = {} if pooling is None else {"pooling": pooling}
    return [cls(num_embeddings=30, embedding_dim=4, name="t1", feature_names=["f1", "f3"], **extra, **kw),
            cls(num_embeddings=50, embedding_dim=6, name="t2", feature_names=["f2", "f3"], **extra, **kw)]


def _saved(tmp_path, module, name="c", **save_kw):
    ec.save(tmp_path / name, module, **save_kw)
    return tmp_path / name


def _assert_same(a, b):
    """Bit for bit: the same dtype, shape and bits (NaN-free values)."""
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a, b)


def _dict_input(rng, batch=5):
    ids1, off1, w1 = bags(rng, 30, batch, weighted=True)
    ids2, off2, _ = bags(rng, 50, batch, id_dtype=torch.int32)
    x3 = torch.from_numpy(rng.integers(0, 30, size=(batch, 3)))
    return {"f1": (ids1, off1, w1), "f2": {"values": ids2, "lengths": off2.diff().int()}, "f3": x3}


# ------------------------------------------------------------------ against the training modules
@pytest.mark.parametrize("pooling", ["sum", "mean", "sqrtn"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_dict_input_matches_the_training_collection_bit_for_bit(tmp_path, rng, pooling, dtype):
    torch.manual_seed(1)
    ebc = et.EmbeddingBagCollection(_configs(pooling=pooling, dtype=dtype))
    served = et.ServedEmbeddingBagCollection(_saved(tmp_path, ebc), _configs(pooling=pooling))
    assert served.checkpoint.tables["t1"].dtype == dtype
    with torch.no_grad():
        for batch in (5, 1, 0):
            x = _dict_input(rng, batch)
            want, got = ebc(x), served(x)
            assert list(got) == list(want) == ["f1", "f3@t1", "f2", "f3@t2"]
            for k in want:
                _assert_same(got[k], want[k])
                assert got[k].dtype == torch.float32 and not got[k].requires_grad


@pytest.fixture
def torchrec():
    return pytest.importorskip("torchrec")


def _kjt(torchrec, rng, keys, rows, batch, weighted=False, lengths_dtype=torch.int64):
    lengths = [torch.from_numpy(np.diff(bags(rng, rows, batch)[1].numpy())) for _ in keys]
    n = int(sum(int(x.sum()) for x in lengths))
    v = torch.from_numpy(rng.integers(0, rows, size=n))
    w = torch.from_numpy(rng.uniform(0.5, 2.0, size=n).astype(np.float32)) if weighted else None
    return torchrec.KeyedJaggedTensor.from_lengths_sync(keys=keys, values=v, weights=w,
                                                        lengths=torch.cat(lengths).to(lengths_dtype))


@pytest.mark.parametrize("pooling", ["sum", "mean"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_kjt_matches_the_training_collection_bit_for_bit(tmp_path, rng, torchrec, pooling, weighted, dtype):
    torch.manual_seed(2)
    ebc = et.EmbeddingBagCollection(_configs(pooling=pooling, dtype=dtype), is_weighted=weighted)
    served = et.ServedEmbeddingBagCollection(_saved(tmp_path, ebc), _configs(pooling=pooling), is_weighted=weighted)
    assert served.is_weighted() == weighted and served.embedding_bag_configs()[0].name == "t1"
    for batch, keys in ((7, ["f2", "f3", "f1"]), (1, ["f1", "f2", "f3"]), (0, ["f3", "f1", "f2"])):
        kjt = _kjt(torchrec, rng, keys, 30, batch, weighted)
        with torch.inference_mode():
            want, got = ebc(kjt), served(kjt)
        assert isinstance(got, torchrec.KeyedTensor)
        assert got.keys() == want.keys() == ["f1", "f3@t1", "f2", "f3@t2"]
        assert got.length_per_key() == want.length_per_key()
        _assert_same(got.values(), want.values())


def test_exports_of_another_dtype_serve_their_rounded_values(tmp_path, rng, torchrec):
    """ec.save(values_dtype=...) of a float32 module serves what a module of
    that dtype holding the same values gives."""
    torch.manual_seed(3)
    ebc = et.EmbeddingBagCollection(_configs())
    for dtype in ("float16", "bfloat16"):
        twin = et.EmbeddingBagCollection(_configs(dtype=dtype))
        twin.load_state_dict(ebc.state_dict())  # rounded to dtype, as the export
        served = et.ServedEmbeddingBagCollection(_saved(tmp_path, ebc, dtype, values_dtype=dtype), _configs())
        kjt = _kjt(torchrec, rng, ["f1", "f2", "f3"], 30, 6)
        with torch.no_grad():
            _assert_same(served(kjt).values(), twin(kjt).values())


def test_sequence_outputs_match_the_training_collection(tmp_path, rng, torchrec):
    torch.manual_seed(4)
    cfgs = _configs(et.EmbeddingConfig)
    emb = et.EmbeddingCollection(cfgs, need_indices=True)
    served = et.ServedEmbeddingCollection(_saved(tmp_path, emb), cfgs, need_indices=True)
    assert served.embedding_names_by_table() == emb.embedding_names_by_table()
    with pytest.raises(ValueError, match="ServedEmbeddingCollection: the tables have dimensions"):
        served.embedding_dim()
    kjt = _kjt(torchrec, rng, ["f3", "f2", "f1"], 30, 6)
    with torch.no_grad():
        want, got = emb(kjt), served(kjt)
    assert list(got) == list(want)
    for k in want:
        _assert_same(got[k].values(), want[k].values())
        _assert_same(got[k].lengths(), want[k].lengths())
        _assert_same(got[k].weights(), want[k].weights())  # need_indices: the ids
    x = {"f1": torch.from_numpy(rng.integers(0, 30, (4, 3))), "f2": torch.from_numpy(rng.integers(0, 30, 5)),
         "f3": (torch.tensor([1, 2, 3]), torch.tensor([0, 2, 3]))}
    with torch.no_grad():
        want, got = emb(x), served(x)
    assert list(got) == list(want)
    for k in want:
        _assert_same(got[k], want[k])
    assert got["f1"].shape == (4, 3, 4) and got["f3@t2"].shape == (3, 6)


# ------------------------------------------------------------------ against TorchRec
def _torchrec_configs(torchrec, pooling="SUM", data_type=None):
    from torchrec.modules.embedding_configs import PoolingType

    kw = {} if data_type is None else {"data_type": data_type}
    return [torchrec.EmbeddingBagConfig(num_embeddings=30, embedding_dim=8, name="t1", feature_names=["f1", "f3"],
                                        pooling=PoolingType[pooling], **kw),
            torchrec.EmbeddingBagConfig(num_embeddings=50, embedding_dim=16, name="t2", feature_names=["f2"],
                                        pooling=PoolingType[pooling], **kw)]


@pytest.mark.parametrize("pooling", ["SUM", "MEAN"])
def test_matches_torchrec_embedding_bag_collection(tmp_path, rng, torchrec, pooling):
    torch.manual_seed(5)
    ref = torchrec.EmbeddingBagCollection(_torchrec_configs(torchrec, pooling))
    ebc = et.EmbeddingBagCollection(_torchrec_configs(torchrec, pooling))
    ebc.load_state_dict(ref.state_dict())
    served = et.ServedEmbeddingBagCollection(_saved(tmp_path, ebc), _torchrec_configs(torchrec, pooling))
    kjt = _kjt(torchrec, rng, ["f3", "f1", "f2"], 30, 9, lengths_dtype=torch.int32)
    with torch.no_grad():
        want, got = ref(kjt), served(kjt)
    assert got.keys() == want.keys() and got.length_per_key() == want.length_per_key()
    torch.testing.assert_close(got.values(), want.values(), rtol=1e-6, atol=1e-6)


def test_uint8_rowwise_export_against_torchrec_int8_inference(tmp_path, rng, torchrec):
    """TorchRec's INT8 inference module (QuantEmbeddingBagCollection: FBGEMM's
    8-bit rows with float16 scale and bias) and the served uint8_rowwise
    export of the same float weights (float32 scale and bias, FBGEMM's
    Fused8BitRowwise): the same keys and float32 outputs, both near the
    float module's, the export at least as near."""
    import torch.ao.quantization as tq
    from torchrec.modules.embedding_configs import DataType
    from torchrec.quant.embedding_modules import EmbeddingBagCollection as QuantEmbeddingBagCollection

    torch.manual_seed(6)
    ref = torchrec.EmbeddingBagCollection(_torchrec_configs(torchrec))
    ref.qconfig = tq.QConfig(activation=tq.PlaceholderObserver.with_args(dtype=torch.float),
                             weight=tq.PlaceholderObserver.with_args(dtype=torch.qint8))
    quant = QuantEmbeddingBagCollection.from_float(ref)
    ebc = et.EmbeddingBagCollection(_torchrec_configs(torchrec))
    ebc.load_state_dict(ref.state_dict())
    path = _saved(tmp_path, ebc, values_dtype="uint8_rowwise")
    # TorchRec's INT8 configs are taken as they are: the checkpoint's dtype rules.
    served = et.ServedEmbeddingBagCollection(path, _torchrec_configs(torchrec, data_type=DataType.INT8))
    assert served.checkpoint.tables["t1"].dtype == "uint8_rowwise"
    kjt = _kjt(torchrec, rng, ["f1", "f2", "f3"], 30, 16)
    with torch.no_grad():
        want, got, exact = quant(kjt), served(kjt), ref(kjt)
    assert got.keys() == want.keys() and got.values().dtype == want.values().dtype == torch.float32
    # Rows of values in [-0.18, 0.18]: 8-bit steps of 0.0014, a bag's error within a few of them.
    assert 0 < float((got.values() - exact.values()).abs().max()) < 0.01
    assert 0 < float((want.values() - exact.values()).abs().max()) < 0.01
    # The export's rows are FBGEMM's Fused8BitRowwise ones: a float module holding them gives the outputs.
    pytest.importorskip("fbgemm_gpu")
    dequantized = et.EmbeddingBagCollection(_torchrec_configs(torchrec))
    dequantized.load_state_dict({k: torch.ops.fbgemm.Fused8BitRowwiseQuantizedToFloat(
        torch.ops.fbgemm.FloatToFused8BitRowwiseQuantized(v)) for k, v in ref.state_dict().items()})
    with torch.no_grad():
        torch.testing.assert_close(got.values(), dequantized(kjt).values(), rtol=1e-5, atol=1e-6)
    # The same bits as the served table's own lookups.
    t1 = served.checkpoint.tables["t1"]
    f1 = kjt["f1"]
    np.testing.assert_array_equal(got["f1"].numpy(), t1.lookup(f1.values().numpy(), f1.offsets().numpy(),
                                                               combiner="sum"))


# ------------------------------------------------------------------ configs from the checkpoint
def test_tables_from_the_features_of_an_embedding_checkpoint(tmp_path, rng, torchrec):
    user = ec.TableConfig("user", 40, 4, combiner="sum", initializer=ec.initializers.Uniform(-1, 1, seed=1))
    item = ec.TableConfig("item", 60, 8, initializer=ec.initializers.Uniform(-1, 1, seed=2))
    config = {"u": ec.FeatureConfig(user, name="u"), "i": ec.FeatureConfig(item, name="i"),
              "h": ec.FeatureConfig(item, name="h"), "s": ec.FeatureConfig(item, max_sequence_length=3, name="s")}
    path = _saved(tmp_path, ec.Embedding(config))
    pooled = et.ServedEmbeddingBagCollection(path)
    assert [(c.name, c.feature_names, c.pooling) for c in pooled.embedding_bag_configs()] == [
        ("item", ["h", "i"], "mean"), ("user", ["u"], "sum")]  # the checkpoint's order (the features' sorted keys)
    seq = et.ServedEmbeddingCollection(pooled.checkpoint)  # one mapping for both
    assert seq.checkpoint is pooled.checkpoint
    assert [(c.name, c.feature_names) for c in seq.embedding_configs()] == [("item", ["s"])]
    kjt = _kjt(torchrec, rng, ["u", "i", "h"], 40, 5)
    got = pooled(kjt)
    for k in ("u", "i", "h"):
        f = kjt[k]
        want = pooled.checkpoint.tables["user" if k == "u" else "item"].lookup(f.values().numpy(),
                                                                               f.offsets().numpy())
        np.testing.assert_array_equal(got[k].numpy(), want)
    s = seq(_kjt(torchrec, rng, ["s"], 60, 4))["s"]
    assert s.values().shape[1] == 8


def test_tables_are_required_for_a_checkpoint_of_tables(tmp_path):
    path = _saved(tmp_path, et.EmbeddingBagCollection(_configs()))
    with pytest.raises(ValueError, match="records tables, not features.*pass tables="):
        et.ServedEmbeddingBagCollection(path)
    only_pooled = _saved(tmp_path, ec.Embedding({"a": ec.FeatureConfig(ec.TableConfig("t", 5, 2), name="a")}), "e")
    with pytest.raises(ValueError, match="records no sequence features"):
        et.ServedEmbeddingCollection(only_pooled)


def test_tables_are_checked_against_the_checkpoint(tmp_path):
    path = _saved(tmp_path, et.EmbeddingBagCollection(_configs()))
    cls = et.EmbeddingBagConfig
    with pytest.raises(ValueError, match=r"table 'nope' is not in the checkpoint .*\['t1', 't2'\]"):
        et.ServedEmbeddingBagCollection(path, [cls(30, 4, name="nope")])
    with pytest.raises(ValueError, match=r"table 't2' has num_embeddings=51, embedding_dim=6; the checkpoint's is "
                                         r"50 x 6"):
        et.ServedEmbeddingBagCollection(path, [cls(51, 6, name="t2")])
    with pytest.raises(TypeError, match="path must be a checkpoint directory"):
        et.ServedEmbeddingBagCollection(3, [cls(30, 4, name="t1")])
    # A subset of the tables serves; an EmbeddingCollection checks no pooling.
    et.ServedEmbeddingBagCollection(path, [cls(50, 6, name="t2")])
    et.ServedEmbeddingCollection(path, [et.EmbeddingConfig(30, 4, name="t1")])


def test_the_configs_pooling_serves_a_converted_state_dict_of_mixed_poolings(tmp_path, rng, torchrec):
    # A state dict records no pooling: convert_state_dict gives every table one combiner; the served module
    # pools as its configs say, as TorchRec does, so a model with a SUM and a MEAN table serves as it trained.
    configs = [et.EmbeddingBagConfig(num_embeddings=30, embedding_dim=4, name="t1", feature_names=["f1"]),
               et.EmbeddingBagConfig(num_embeddings=50, embedding_dim=6, name="t2", feature_names=["f2"],
                                     pooling="mean")]
    trained = et.EmbeddingBagCollection(configs)
    torch.save(trained.state_dict(), tmp_path / "model.pt")
    et.convert_state_dict(tmp_path / "model.pt", tmp_path / "c", combiner="sum")
    served = et.ServedEmbeddingBagCollection(tmp_path / "c", configs)
    kjt = _kjt(torchrec, rng, ["f1", "f2"], 30, 5)
    _assert_same(served(kjt).values(), trained(kjt).values())


# ------------------------------------------------------------------ errors
def test_input_errors(tmp_path, torchrec):
    path = _saved(tmp_path, et.EmbeddingBagCollection(_configs()))
    served = et.ServedEmbeddingBagCollection(path, _configs())
    ok = {"f1": torch.tensor([1]), "f2": torch.tensor([2]), "f3": torch.tensor([3])}
    # Features no table reads are ignored, as TorchRec's collections and the training ones ignore them.
    with_extra, want = served({**ok, "zz": torch.tensor([1])}), served(ok)
    assert with_extra.keys() == want.keys()
    for k in want:
        assert torch.equal(with_extra[k], want[k])
    kjt = torchrec.KeyedJaggedTensor.from_lengths_sync(keys=["f1", "zz", "f2", "f3"],
                                                       values=torch.tensor([1, 99, 2, 3]),
                                                       lengths=torch.ones(4, dtype=torch.int64))
    plain = torchrec.KeyedJaggedTensor.from_lengths_sync(keys=["f1", "f2", "f3"], values=torch.tensor([1, 2, 3]),
                                                         lengths=torch.ones(3, dtype=torch.int64))
    assert torch.equal(served(kjt).values(), served(plain).values())
    with pytest.raises(KeyError, match="'f3' of table 't1' is missing"):  # as the training collection
        served({"f1": torch.tensor([1]), "f2": torch.tensor([2])})
    with pytest.raises(IndexError, match=r"table 't1', feature 'f3': id 40 at position 2 of the "
                                         r"KeyedJaggedTensor's values is out of range \[0, 30\)"):
        served(torchrec.KeyedJaggedTensor.from_lengths_sync(keys=["f1", "f2", "f3"], values=torch.tensor([1, 2, 40]),
                                                            lengths=torch.ones(3, dtype=torch.int64)))
    with pytest.raises(IndexError, match=r"table 't2', feature 'f2': id 50 at position 1 of the "
                                         r"KeyedJaggedTensor's values is out of range \[0, 50\)"):
        served(torchrec.KeyedJaggedTensor.from_lengths_sync(keys=["f1", "f2", "f3"], values=torch.tensor([1, 50, 2]),
                                                            lengths=torch.ones(3, dtype=torch.int64)))
    with pytest.raises(IndexError, match=r"table 't2', feature 'f2': id -1 at position 0 of features\['f2'\]'s ids"):
        served({**ok, "f2": torch.tensor([-1])})
    # A table of one feature: a dict's tensor is that feature's own (not a KeyedJaggedTensor's values).
    one = [et.EmbeddingBagConfig(30, 4, name="t1", feature_names=["f1"]),
           et.EmbeddingBagConfig(20, 4, name="t2", feature_names=["f2"])]
    alone = et.ServedEmbeddingBagCollection(_saved(tmp_path, et.EmbeddingBagCollection(one), "one"), one)
    with pytest.raises(IndexError, match=r"table 't2', feature 'f2': id 25 at position 1 of features\['f2'\]'s ids"):
        alone({"f1": torch.tensor([[1, 2]]), "f2": torch.tensor([[1, 25]])})
    with pytest.raises(IndexError, match=r"table 't2', feature 'f2': id 25 at position 3 of the "
                                         r"KeyedJaggedTensor's values is out of range \[0, 20\)"):
        alone(torchrec.KeyedJaggedTensor.from_lengths_sync(keys=["f1", "f2"], values=torch.tensor([1, 2, 1, 25]),
                                                           lengths=torch.tensor([2, 2])))
    with pytest.raises(TypeError, match="int32 or int64"):
        served({**ok, "f2": torch.tensor([1.0])})
    with pytest.raises(TypeError, match="must be float32"):
        served({**ok, "f2": (torch.tensor([1]), torch.tensor([0, 1]), torch.tensor([1.0], dtype=torch.float64))})
    served({**ok, "dense": torch.tensor([1.0], device="meta")})  # a feature no table reads: ignored, anywhere
    with pytest.raises(ValueError, match=r"ServedEmbeddingBagCollection: the KeyedJaggedTensor\['lengths'\]\[1\] "
                                         r"= -1 is negative"):
        served(torchrec.KeyedJaggedTensor.from_lengths_sync(keys=["f1", "f2", "f3"], values=torch.tensor([1, 2, 3]),
                                                            lengths=torch.tensor([2, -1, 2])))
    with pytest.raises(TypeError, match=r"the input\['f2'\] is on meta; serving runs on the CPU"):
        served({**ok, "f2": torch.tensor([1], device="meta")})
    meta = torchrec.KeyedJaggedTensor.from_lengths_sync(keys=["f1"], values=torch.tensor([1], device="meta"),
                                                        lengths=torch.tensor([1], device="meta"))
    with pytest.raises(TypeError, match=r"the KeyedJaggedTensor's values\(\) is on meta; serving runs on the CPU"):
        served(meta)
    with pytest.raises(TypeError, match="takes a dict of features or a TorchRec KeyedJaggedTensor"):
        served([torch.tensor([1])])
    with pytest.raises(ValueError, match=r"ServedEmbeddingBagCollection\(is_weighted=True\) needs"):
        et.ServedEmbeddingBagCollection(path, _configs(), is_weighted=True)(plain.permute([0, 1, 2]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_inputs_are_refused(tmp_path, torchrec):
    served = et.ServedEmbeddingBagCollection(_saved(tmp_path, et.EmbeddingBagCollection(_configs())), _configs())
    kjt = torchrec.KeyedJaggedTensor.from_lengths_sync(keys=["f1", "f2", "f3"], values=torch.arange(3),
                                                       lengths=torch.ones(3, dtype=torch.int64)).to("cuda")
    with pytest.raises(TypeError, match="serving runs on the CPU"):
        served(kjt)


# ------------------------------------------------------------------ no autograd, threads, compile
def test_no_parameters_and_no_autograd(tmp_path, rng):
    ebc = et.EmbeddingBagCollection(_configs())
    served = et.ServedEmbeddingBagCollection(_saved(tmp_path, ebc), _configs())
    assert list(served.parameters()) == [] and served.state_dict() == {} and served.device == torch.device("cpu")
    x = _dict_input(rng)
    ids, off, w = x["f1"]
    x["f1"] = (ids, off, w.clone().requires_grad_())
    out = served(x)
    assert not any(t.requires_grad for t in out.values())
    with torch.no_grad():
        want = ebc(x)
    for k in want:
        _assert_same(out[k], want[k])


def test_threads_give_the_single_thread_results(tmp_path, rng, torchrec):
    ebc = et.EmbeddingBagCollection(_configs(pooling="mean"), is_weighted=True)
    served = et.ServedEmbeddingBagCollection(_saved(tmp_path, ebc), _configs(pooling="mean"), is_weighted=True)
    inputs = [_kjt(torchrec, rng, ["f1", "f2", "f3"], 30, 64, weighted=True) for _ in range(8)]
    want = [served(k).values() for k in inputs]
    errors = []

    def work(seed):
        try:
            for r in range(20):
                k = (seed + r) % len(inputs)
                with torch.inference_mode():
                    got = served(inputs[k]).values()
                if not torch.equal(got, want[k]):
                    errors.append(k)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_torch_compile_fullgraph_gives_eager_results(tmp_path, rng, torchrec):
    cfgs = _configs(pooling="mean")
    served = et.ServedEmbeddingBagCollection(_saved(tmp_path, et.EmbeddingBagCollection(cfgs)), cfgs)
    kjt = _kjt(torchrec, rng, ["f1", "f2", "f3"], 30, 6)
    x = _dict_input(rng)
    compiled = torch.compile(served, fullgraph=True, backend="aot_eager")
    _assert_same(compiled(kjt).values(), served(kjt).values())
    want, got = served(x), compiled(x)
    for k in want:
        _assert_same(got[k], want[k])
    bad = {**x, "f2": torch.tensor([99])}
    with pytest.raises(IndexError, match="id 99"):
        compiled(bad)


def test_pickle_and_deepcopy_open_the_checkpoint_again(tmp_path, rng, torchrec):
    cfgs = _configs(et.EmbeddingConfig)
    served = et.ServedEmbeddingCollection(_saved(tmp_path, et.EmbeddingCollection(cfgs)), cfgs, verify="eager")
    kjt = _kjt(torchrec, rng, ["f1", "f2", "f3"], 30, 5)
    want = served(kjt)
    for other in (pickle.loads(pickle.dumps(served)), copy.deepcopy(served)):
        assert other.checkpoint is not served.checkpoint and other._verify == "eager"
        got = other(kjt)
        for k in want:
            _assert_same(got[k].values(), want[k].values())
    # Opened by a relative path: a pickle loads from any working directory (it holds the absolute path).
    monkeypatch = pytest.MonkeyPatch()
    try:
        monkeypatch.chdir(tmp_path)
        rel = et.ServedEmbeddingCollection("c", cfgs)
        data = pickle.dumps(rel)
        monkeypatch.chdir("/")
        _assert_same(pickle.loads(data)(kjt)["f1"].values(), want["f1"].values())
    finally:
        monkeypatch.undo()
    # A module given a ServedCheckpoint, and one opened with verify=False, reopen as they were opened.
    given = et.ServedEmbeddingCollection(ec.serving.open(tmp_path / "c", verify=False), cfgs)
    assert copy.deepcopy(given)._verify is True
    assert copy.deepcopy(et.ServedEmbeddingCollection(tmp_path / "c", cfgs, verify=False))._verify is False


@pytest.mark.parametrize("pooling", ["sum", "sqrtn"])
@pytest.mark.parametrize("weighted", [False, True])
def test_one_engine_call_for_all_tables_gives_the_ops_bits(tmp_path, rng, torchrec, monkeypatch, pooling, weighted):
    """A KJT is looked up by one engine call for every table (eager, int64
    offsets); the per-table ops (compiled, int32 offsets, errors) give the same bits."""
    cfgs = _configs(pooling=pooling)
    served = et.ServedEmbeddingBagCollection(_saved(tmp_path, et.EmbeddingBagCollection(cfgs)), cfgs,
                                             is_weighted=weighted)
    kjts = [_kjt(torchrec, rng, ["f3", "f1", "f2"], 30, b, weighted) for b in (9, 1, 0)]
    fast = [served(k).values() for k in kjts]
    calls = []
    monkeypatch.setattr(type(served), "_lookup_windows", lambda *a: calls.append(1))
    for k, want in zip(kjts, fast):
        _assert_same(served(k).values(), want)
    assert len(calls) == len(kjts)
