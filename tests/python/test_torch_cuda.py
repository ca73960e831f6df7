"""The PyTorch adapter's modules on CUDA tensors: the same test bodies on
device="cpu" and device="cuda", each against PyTorch's own module on the same
device and weights, and the GPU against the CPU adapter. The CUDA cases need
the CUDA build of embedcore (EMBEDCORE_CUDA=ON), a GPU and a CUDA build of
PyTorch; elsewhere they are skipped, saying which is missing. On the CPU the
same bodies check the adapter's one code path (PyTorch ops on the tensors'
own device), which the GPU shares."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import embedcore as ec  # noqa: E402
import embedcore.adapters.torch as et  # noqa: E402

from helpers import cuda_skip_reason  # noqa: E402
from torch_helpers import bags, engine_optimizer, max_diff, torch_optimizer, uniform_weights  # noqa: E402

INFO = ec.build_info()


REASON = cuda_skip_reason()
needs_gpu = pytest.mark.skipif(REASON is not None, reason=str(REASON))
DEVICES = ["cpu", pytest.param("cuda", marks=needs_gpu)]
ROWS, DIM = 60, 7


def _to(device, t):
    return None if t is None else t.to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["sum", "mean"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("padding_idx", [None, 3])
@pytest.mark.parametrize("include_last_offset", [False, True])
def test_embedding_bag_forward_and_weight_grads_match_pytorch(device, mode, weighted, padding_idx,
                                                              include_last_offset):
    if weighted and mode != "sum":
        pytest.skip("PyTorch takes per_sample_weights with mode='sum' only")
    rng = np.random.default_rng(1)
    w0 = uniform_weights(rng, ROWS, DIM)
    ids, offsets, weights = bags(rng, ROWS, 33, weighted=weighted, pad=padding_idx)
    if include_last_offset:
        offsets_in = offsets
    else:
        offsets_in = offsets[:-1]
    ref = nn.EmbeddingBag(ROWS, DIM, mode=mode, padding_idx=padding_idx, include_last_offset=include_last_offset,
                          _weight=w0.clone()).to(device)
    ours = et.EmbeddingBag(ROWS, DIM, mode=mode, padding_idx=padding_idx, include_last_offset=include_last_offset,
                           _weight=w0.clone(), device=device)
    assert ours.weight.device.type == device
    pw_ref = pw_ours = None
    if weighted:
        pw_ref = weights.clone().to(device).requires_grad_()
        pw_ours = weights.clone().to(device).requires_grad_()
    a = ref(ids.to(device), offsets_in.to(device), per_sample_weights=pw_ref)
    b = ours(ids.to(device), offsets_in.to(device), per_sample_weights=pw_ours)
    assert b.device.type == device and b.shape == a.shape
    assert max_diff(a, b) <= 1e-6
    if weighted:
        g = torch.from_numpy(rng.standard_normal(a.shape).astype(np.float32)).to(device)
        (a * g).sum().backward()
        (b * g).sum().backward()
        assert max_diff(pw_ref.grad, pw_ours.grad) <= 1e-5


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["sum", "mean"])
@pytest.mark.parametrize("sparse", [True, False])
def test_unfused_training_matches_pytorch(device, mode, sparse):
    """weight.grad (sparse or dense, on the table's device) drives
    torch.optim.SGD through the engine's memory as it drives nn.EmbeddingBag."""
    rng = np.random.default_rng(2)
    w0 = uniform_weights(rng, ROWS, DIM)
    ref = nn.EmbeddingBag(ROWS, DIM, mode=mode, sparse=sparse, _weight=w0.clone()).to(device)
    ours = et.EmbeddingBag(ROWS, DIM, mode=mode, sparse=sparse, _weight=w0.clone(), device=device)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.3)
    opt_ours = torch.optim.SGD(ours.parameters(), lr=0.3)
    for _ in range(3):
        ids, offsets, _ = bags(rng, ROWS, 21)
        g = torch.from_numpy(rng.standard_normal((21, DIM)).astype(np.float32)).to(device)
        for m, opt in ((ref, opt_ref), (ours, opt_ours)):
            opt.zero_grad()
            (m(ids.to(device), offsets[:-1].to(device)) * g).sum().backward()
            assert m.weight.grad.is_sparse == sparse and m.weight.grad.device.type == device
            opt.step()
        assert max_diff(ref.weight, ours.weight) <= 1e-5
    assert max_diff(ours.weight.cpu(), torch.from_numpy(ours.table.to_numpy())) == 0  # the engine's memory


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["sgd", "adagrad", "adam"])
def test_fused_training_matches_pytorch(device, name):
    """The engine's optimizer inside backward() on the table's device, against
    nn.EmbeddingBag(sparse=True) with PyTorch's optimizer."""
    rng = np.random.default_rng(3)
    w0 = uniform_weights(rng, ROWS, DIM)
    ref = nn.EmbeddingBag(ROWS, DIM, mode="sum", sparse=True, _weight=w0.clone()).to(device)
    opt_ref = torch_optimizer(name, ref.parameters(), 0.05)
    ours = et.EmbeddingBag(ROWS, DIM, mode="sum", _weight=w0.clone(), optimizer=engine_optimizer(name, 0.05),
                           device=device)
    for _ in range(4):
        ids, offsets, _ = bags(rng, ROWS, 17)
        g = torch.from_numpy(rng.standard_normal((17, DIM)).astype(np.float32)).to(device)
        opt_ref.zero_grad()
        (ref(ids.to(device), offsets[:-1].to(device)) * g).sum().backward()
        opt_ref.step()
        (ours(ids.to(device), offsets[:-1].to(device)) * g).sum().backward()
        assert max_diff(ref.weight, ours.weight) <= 1e-5, name
    for slot in ours.optimizer_state_dict()["state"]["weight"].values():
        if isinstance(slot, torch.Tensor) and slot.dim() == 2:
            assert slot.device.type == device


@needs_gpu
@pytest.mark.parametrize("mode", ["sum", "mean", "sqrtn"])
def test_gpu_module_trains_as_the_cpu_module(mode):
    """A fused module on the GPU and one on the CPU, same weights and batches:
    the same outputs and the same table after three steps (the engine's GPU
    kernels give the CPU engine's results)."""
    rng = np.random.default_rng(4)
    w0 = uniform_weights(rng, ROWS, DIM)
    mods = {d: et.EmbeddingBag(ROWS, DIM, mode=mode, _weight=w0.clone(), optimizer=ec.optimizers.Adagrad(0.1),
                               device=d) for d in ("cpu", "cuda")}
    for _ in range(3):
        ids, offsets, weights = bags(rng, ROWS, 25)
        g = torch.from_numpy(rng.standard_normal((25, DIM)).astype(np.float32))
        outs = {}
        for d, m in mods.items():
            out = m(ids.to(d), offsets[:-1].to(d))
            outs[d] = out.detach().cpu()
            (out * g.to(d)).sum().backward()
        assert max_diff(outs["cpu"], outs["cuda"]) <= 1e-6
    assert max_diff(mods["cpu"].weight, mods["cuda"].weight.cpu()) <= 1e-6


@pytest.mark.parametrize("device", DEVICES)
def test_embedding_matches_pytorch(device):
    rng = np.random.default_rng(5)
    w0 = uniform_weights(rng, ROWS, DIM)
    ref = nn.Embedding(ROWS, DIM, padding_idx=2, _weight=w0.clone()).to(device)
    ours = et.Embedding(ROWS, DIM, padding_idx=2, _weight=w0.clone(), device=device)
    ids = torch.from_numpy(rng.integers(0, ROWS, (6, 5))).to(device)
    ids[0, :2] = 2
    a, b = ref(ids), ours(ids)
    assert b.device.type == device and max_diff(a, b) == 0
    g = torch.from_numpy(rng.standard_normal(a.shape).astype(np.float32)).to(device)
    (a * g).sum().backward()
    (b * g).sum().backward()
    assert max_diff(ref.weight.grad, ours.weight.grad) <= 1e-6


@pytest.mark.parametrize("device", DEVICES)
def test_collection_on_device_matches_pytorch(device):
    rng = np.random.default_rng(6)
    tables = [et.EmbeddingBagConfig(num_embeddings=ROWS, embedding_dim=DIM, name="a", feature_names=["f", "g"]),
              et.EmbeddingBagConfig(num_embeddings=40, embedding_dim=3, name="b", feature_names=["h"],
                                    pooling="mean")]
    ebc = et.EmbeddingBagCollection(tables, device=device)
    feats = {}
    for f, rows in (("f", ROWS), ("g", ROWS), ("h", 40)):
        ids, offsets, _ = bags(rng, rows, 9)
        feats[f] = (ids.to(device), offsets.to(device))
    out = ebc(feats)
    for f, t in (("f", "a"), ("g", "a"), ("h", "b")):
        m = ebc.embedding_bags[t]
        assert out[f].device.type == device
        want = nn.functional.embedding_bag(feats[f][0], m.weight.detach(), feats[f][1][:-1], mode=m.mode)
        assert max_diff(out[f], want) <= 1e-6


def test_segmented_denominators_equal_the_engines():
    """The GPU's per-bag mean / sqrtn denominators (a segmented sum in
    PyTorch ops), run here on CPU tensors, against the engine's own."""
    from embedcore.adapters.torch import _ops

    rng = np.random.default_rng(8)
    for weighted in (False, True):
        ids, offsets, weights = bags(rng, ROWS, 40, weighted=weighted)
        p = _ops._Part(0, ids, offsets, weights, 0, ids.shape[0], None, 40)
        for combiner in (_ops.MEAN, _ops.SQRTN):
            want = _ops._denominators(p, combiner)
            got = _ops._segmented_denominators(p, combiner)
            assert got.shape == want.shape and max_diff(got, want) <= 1e-6 * float(want.abs().max())


@pytest.mark.parametrize("device", DEVICES)
def test_collection_fills_missing_weights_on_the_device(device):
    """A table read by a weighted and an unweighted feature: the unweighted
    one's weights are ones, made on the ids' device."""
    rng = np.random.default_rng(9)
    ebc = et.EmbeddingBagCollection([et.EmbeddingBagConfig(num_embeddings=ROWS, embedding_dim=DIM, name="a",
                                                           feature_names=["f", "g"])], device=device)
    ids, offsets, weights = bags(rng, ROWS, 8, weighted=True)
    out = ebc({"f": (ids.to(device), offsets.to(device), weights.to(device)),
               "g": (ids.to(device), offsets.to(device))})
    w = ebc.embedding_bags["a"].weight.detach()
    want_f = nn.functional.embedding_bag(ids.to(device), w, offsets[:-1].to(device), mode="sum",
                                         per_sample_weights=weights.to(device))
    want_g = nn.functional.embedding_bag(ids.to(device), w, offsets[:-1].to(device), mode="sum")
    assert max_diff(out["f"], want_f) <= 1e-5 and max_diff(out["g"], want_g) <= 1e-6


@needs_gpu
def test_from_pretrained_keeps_a_cuda_tensors_device():
    w = torch.randn(ROWS, DIM, device="cuda")
    m = et.EmbeddingBag.from_pretrained(w, mode="sum")
    assert m.weight.device.type == "cuda" and max_diff(m.weight, w) == 0


@needs_gpu
def test_sharded_collections_refuse_tensors_on_another_device():
    from embedcore.distributed import run_local

    def fn(world):
        def ebc(device):
            return et.EmbeddingBagCollection([et.EmbeddingBagConfig(num_embeddings=ROWS, embedding_dim=DIM, name="a",
                                                                    feature_names=["f"])], world=world, device=device)

        ids, offsets = torch.tensor([1, 2]), torch.tensor([0, 2])
        with pytest.raises(RuntimeError, match="same device"):
            ebc(None)({"f": (ids.cuda(), offsets.cuda())})
        with pytest.raises(RuntimeError, match="same device"):
            ebc("cuda")({"f": (ids, offsets)})

    run_local(1, fn)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sharding", ["table_wise", "row_wise", "column_wise"])
def test_sharded_collections_with_shards_on_the_device(device, sharding):
    """Two ranks (threads) whose shards live on `device`: outputs on that
    device, and a fused Adagrad step per batch, equal to the unsharded CPU
    collection on the global batch (row-wise outputs within float rounding)."""
    from embedcore.distributed import run_local

    def tables():  # explicit initializers: run_local's threads share torch's generator
        init = {"initializer": ec.initializers.Uniform(-0.5, 0.5, seed=2)}
        return [et.EmbeddingBagConfig(num_embeddings=ROWS, embedding_dim=DIM, name="a", feature_names=["f"], **init),
                et.EmbeddingBagConfig(num_embeddings=30, embedding_dim=5, name="b", feature_names=["g"],
                                      pooling="mean", **init)]

    def opt():
        return ec.optimizers.Adagrad(0.1, initial_accumulator_value=0.1)

    rng = np.random.default_rng(4)
    steps = []
    for _ in range(3):
        f_ids, f_off, _ = bags(rng, ROWS, 6)
        g_ids, g_off, _ = bags(rng, 30, 6)
        steps.append({"f": (f_ids, f_off), "g": (g_ids, g_off)})

    def half(x, r):  # rank r's bags: the first or last three of six
        ids, off = x
        lo, hi = int(off[3 * r]), int(off[3 * r + 3])
        return ids[lo:hi], off[3 * r:3 * r + 4] - lo

    def fn(world):
        m = et.EmbeddingBagCollection(tables(), optimizer=opt(), world=world, sharding=sharding, device=device)
        outs = []
        for x in steps:
            out = m({k: tuple(t.to(device) for t in half(v, world.rank)) for k, v in x.items()})
            assert all(o.device.type == device for o in out.values())
            ((out["f"] - 1.0) ** 2).sum().add(out["g"].sum()).backward()
            outs.append({k: v.detach().cpu().clone() for k, v in out.items()})
        return outs

    results = run_local(2, fn)
    ref = et.EmbeddingBagCollection(tables(), optimizer=opt())
    for step, x in enumerate(steps):
        want = ref({k: (v[0], v[1]) for k, v in x.items()})
        for r in range(2):
            for k in want:
                assert max_diff(results[r][step][k], want[k][3 * r:3 * r + 3]) <= (1e-6 if sharding == "row_wise"
                                                                                  else 0), (step, r, k)
        ((want["f"] - 1.0) ** 2).sum().add(want["g"].sum()).backward()


@pytest.mark.parametrize("device", DEVICES)
def test_sharded_collections_take_keyed_jagged_tensors_on_the_device(device):
    """KeyedJaggedTensor inputs on `device`: a weighted EmbeddingBagCollection
    and an EmbeddingCollection (need_indices) with their shards there, one
    SGD step each, against the unsharded CPU modules."""
    torchrec = pytest.importorskip("torchrec")
    from embedcore.distributed import run_local

    init = {"initializer": ec.initializers.Uniform(-0.5, 0.5, seed=6)}

    def bag_tables():
        return [et.EmbeddingBagConfig(num_embeddings=ROWS, embedding_dim=DIM, name="a", feature_names=["f", "g"],
                                      **init)]

    def seq_tables():
        return [et.EmbeddingConfig(num_embeddings=ROWS, embedding_dim=DIM, name="e", feature_names=["f"], **init)]

    def kjt(rank, dev):  # batch 2 per rank: f then g, lengths per example
        values = torch.tensor([1, 2, 3, 4, 5, 59, 7, 8][rank:] + [9][:rank])
        lengths = torch.tensor([2, 1, 3, 2])
        weights = torch.linspace(0.5, 2.0, 8)
        return torchrec.KeyedJaggedTensor.from_lengths_sync(keys=["f", "g"], values=values.to(dev),
                                                            lengths=lengths.to(dev), weights=weights.to(dev))

    def fn(world):
        ebc = et.EmbeddingBagCollection(bag_tables(), optimizer=ec.optimizers.SGD(0.1), is_weighted=True,
                                        world=world, sharding="row_wise", device=device)
        ec_ = et.EmbeddingCollection(seq_tables(), optimizer=ec.optimizers.SGD(0.1), need_indices=True,
                                     world=world, sharding="column_wise", device=device)
        pooled = ebc(kjt(world.rank, device))
        assert pooled.values().device.type == device
        pooled.values().sum().backward()
        seq = ec_(kjt(world.rank, device))["f"]
        assert seq.values().device.type == device and seq.weights().device.type == device
        (seq.values() ** 2).sum().backward()
        return (pooled.values().detach().cpu(), seq.values().detach().cpu(), seq.weights().cpu(),
                ebc(kjt(world.rank, device)).values().detach().cpu())

    results = run_local(2, fn)
    ebc = et.EmbeddingBagCollection(bag_tables(), optimizer=ec.optimizers.SGD(0.1), is_weighted=True)
    ec_ = et.EmbeddingCollection(seq_tables(), optimizer=ec.optimizers.SGD(0.1), need_indices=True)
    # The global batch: both ranks' examples (per key: rank 0's two, then rank 1's two).
    parts = [kjt(r, "cpu") for r in range(2)]
    for r, res in enumerate(results):
        want = ebc(parts[r]).values()
        assert max_diff(res[0], want) <= 1e-6
        seq = ec_(parts[r])["f"]
        assert max_diff(res[1], seq.values()) == 0
        assert torch.equal(res[2], seq.weights())
    # One step on the global batch (the two ranks' gradients together), then the same lookups.
    glob = torchrec.KeyedJaggedTensor.from_lengths_sync(
        keys=["f", "g"], values=torch.cat([parts[0]["f"].values(), parts[1]["f"].values(), parts[0]["g"].values(),
                                           parts[1]["g"].values()]),
        lengths=torch.tensor([2, 1, 2, 1, 3, 2, 3, 2]),
        weights=torch.cat([parts[0]["f"].weights(), parts[1]["f"].weights(), parts[0]["g"].weights(),
                           parts[1]["g"].weights()]))
    ebc(glob).values().sum().backward()
    for r, res in enumerate(results):
        assert max_diff(res[3], ebc(parts[r]).values()) <= 1e-6


@needs_gpu
def test_tensors_on_another_device_than_the_table_are_refused():
    cpu_mod = et.EmbeddingBag(ROWS, DIM, mode="sum")
    gpu_mod = et.EmbeddingBag(ROWS, DIM, mode="sum", device="cuda")
    ids, offsets = torch.tensor([1, 2, 3]), torch.tensor([0, 2])
    with pytest.raises(RuntimeError, match="same device"):
        cpu_mod(ids.cuda(), offsets.cuda())
    with pytest.raises(RuntimeError, match="same device"):
        gpu_mod(ids, offsets)
    with pytest.raises(RuntimeError, match="same device"):
        gpu_mod(ids.cuda(), offsets)


@needs_gpu
def test_gpu_ids_out_of_range_raise_index_error():
    m = et.EmbeddingBag(ROWS, DIM, mode="sum", device="cuda")
    with pytest.raises(IndexError, match=str(ROWS + 5)):
        m(torch.tensor([1, ROWS + 5], device="cuda"), torch.tensor([0], device="cuda"))
    with pytest.raises(ValueError, match="non-decreasing"):
        m(torch.tensor([1, 2, 3], device="cuda"), torch.tensor([0, 2, 1], device="cuda"))


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_model_on_device_equals_eager(device):
    rng = np.random.default_rng(7)
    w0 = uniform_weights(rng, ROWS, DIM)
    m = et.EmbeddingBag(ROWS, DIM, mode="sum", _weight=w0.clone(), device=device)
    ids, offsets, _ = bags(rng, ROWS, 12)
    ids, offsets = ids.to(device), offsets[:-1].to(device)
    eager = m(ids, offsets)
    compiled = torch.compile(lambda i, o: m(i, o) * 2, fullgraph=True)(ids, offsets)
    assert compiled.device.type == device and max_diff(compiled, eager * 2) == 0


def test_cpu_build_refuses_a_cuda_module_clearly():
    if INFO["cuda"]:
        pytest.skip("checks the CPU-only build's error")
    with pytest.raises(NotImplementedError, match="CUDA build"):
        et.EmbeddingBag(ROWS, DIM, device="cuda")
    with pytest.raises(NotImplementedError, match="CPU or CUDA"):
        et.EmbeddingBag(ROWS, DIM, device="meta")


@pytest.mark.skipif(not INFO["cuda"] or INFO["cuda_devices"] > 0, reason="checks a CUDA build on a machine without a GPU")
def test_cuda_build_without_gpu_refuses_a_cuda_module_clearly():
    with pytest.raises(ValueError, match="no CUDA device"):
        et.EmbeddingBag(ROWS, DIM, device="cuda")
