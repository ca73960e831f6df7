"""Row-wise Adagrad (FBGEMM's EXACT_ROWWISE_ADAGRAD, TorchRec's default)
beyond the optimizer steps of test_optimizers.py: against FBGEMM's own CPU
kernels, directly and through the PyTorch collection; through checkpoints,
whose slot files are one column wide; and the column blocks it refuses."""
import json
import os

import numpy as np
import pytest

import embedcore as ec
from helpers import make_table, random_bags

RTOL, ATOL = 2e-5, 1e-6


def _zipf_bags(rng, rows, bags, max_len=5):
    """Bags whose ids repeat within and across bags (hot rows take many occurrences)."""
    lengths = rng.integers(0, max_len + 1, size=bags)
    offsets = np.zeros(bags + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    ids = np.minimum(rng.zipf(1.3, size=int(offsets[-1])) - 1, rows - 1).astype(np.int64)
    return ids, offsets


def _tbe(rows, dim, pooling, lr, eps, weights):
    """One FBGEMM TBE table on the CPU, trained with EXACT_ROWWISE_ADAGRAD, holding `weights`."""
    pytest.importorskip("fbgemm_gpu", reason="fbgemm-gpu-cpu (a test extra) is not installed")
    import torch
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice, EmbeddingLocation, SplitTableBatchedEmbeddingBagsCodegen)

    mode = {"sum": PoolingMode.SUM, "mean": PoolingMode.MEAN}[pooling]
    tbe = SplitTableBatchedEmbeddingBagsCodegen([(rows, dim, EmbeddingLocation.HOST, ComputeDevice.CPU)],
                                                optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=lr,
                                                eps=eps, pooling_mode=mode)
    with torch.no_grad():
        tbe.split_embedding_weights()[0].copy_(torch.from_numpy(weights))
    return tbe


@pytest.mark.parametrize("pooling,weighted", [("sum", False), ("sum", True), ("mean", False)])
@pytest.mark.parametrize("dim", [8, 24, 132])  # FBGEMM takes multiples of 4
def test_steps_match_fbgemm(rng, pooling, weighted, dim):
    """Values and accumulators after five steps equal FBGEMM's CPU kernels' on the same bags and gradients."""
    import torch

    rows, bags, lr, eps = 50, 16, 0.05, 1e-8
    table = make_table(rows, dim, optimizer=ec.optimizers.RowWiseAdagrad(learning_rate=lr, epsilon=eps),
                       combiner=pooling, seed=3)
    tbe = _tbe(rows, dim, pooling, lr, eps, table.to_numpy())
    for step in range(5):
        ids, offsets = _zipf_bags(rng, rows, bags)
        w = rng.uniform(0.5, 1.5, size=ids.size).astype(np.float32) if weighted else None
        g = rng.normal(size=(bags, dim)).astype(np.float32)
        out = tbe(torch.from_numpy(ids), torch.from_numpy(offsets),
                  per_sample_weights=None if w is None else torch.from_numpy(w))
        np.testing.assert_allclose(table.lookup(ids, offsets, w, combiner=pooling), out.detach().numpy(),
                                   rtol=RTOL, atol=ATOL, err_msg=f"step {step} forward")
        (out * torch.from_numpy(g)).sum().backward()
        table.apply_gradients(ids, offsets, g, weights=w, combiner=pooling)
        np.testing.assert_allclose(table.to_numpy(), tbe.split_embedding_weights()[0].numpy(), rtol=RTOL,
                                   atol=ATOL, err_msg=f"step {step} values")
        np.testing.assert_allclose(table.slots()["row_accumulators"][:, 0],
                                   tbe.split_optimizer_states()[0][0].numpy(), rtol=RTOL, atol=ATOL,
                                   err_msg=f"step {step} accumulators")
    assert table.step == 5


def test_torch_collection_trains_as_fbgemm(rng):
    """A fused EmbeddingBagCollection on a KeyedJaggedTensor, as TorchRec trains it with FBGEMM."""
    torchrec = pytest.importorskip("torchrec", reason="torchrec (installed with --no-deps) is not installed")
    import torch

    import embedcore.adapters.torch as et

    rows, dim, lr, eps = 40, 16, 0.1, 1e-8
    configs = [torchrec.EmbeddingBagConfig(num_embeddings=rows, embedding_dim=dim, name=f"t{i}",
                                           feature_names=[f"f{i}"]) for i in range(2)]
    ebc = et.EmbeddingBagCollection(configs, optimizer=ec.optimizers.RowWiseAdagrad(learning_rate=lr, epsilon=eps))
    tbes = [_tbe(rows, dim, "sum", lr, eps, ebc.embedding_bags[c.name].weight.detach().numpy()) for c in configs]
    for step in range(3):
        per = [_zipf_bags(rng, rows, 8) for _ in configs]
        kjt = torchrec.KeyedJaggedTensor(
            keys=["f0", "f1"], values=torch.from_numpy(np.concatenate([ids for ids, _ in per])),
            lengths=torch.from_numpy(np.concatenate([np.diff(offsets) for _, offsets in per])))
        g = torch.from_numpy(rng.normal(size=(8, 2 * dim)).astype(np.float32))
        (ebc(kjt).values() * g).sum().backward()
        for k, (ids, offsets) in enumerate(per):
            out = tbes[k](torch.from_numpy(ids), torch.from_numpy(offsets))
            (out * g[:, k * dim:(k + 1) * dim]).sum().backward()
    state = et.FusedOptimizer(ebc).state_dict()["state"]
    for k, c in enumerate(configs):
        np.testing.assert_allclose(ebc.embedding_bags[c.name].weight.detach().numpy(),
                                   tbes[k].split_embedding_weights()[0].numpy(), rtol=RTOL, atol=ATOL)
        acc = state[f"embedding_bags.{c.name}.weight"]["row_accumulators"]
        assert tuple(acc.shape) == (rows, 1)
        np.testing.assert_allclose(acc[:, 0].numpy(), tbes[k].split_optimizer_states()[0][0].numpy(),
                                   rtol=RTOL, atol=ATOL)


def test_fused_optimizer_takes_torchrecs_momentum1():
    """TorchRec's row-wise state is a [rows] momentum1; the slot is [rows, 1]."""
    torch = pytest.importorskip("torch")
    import embedcore.adapters.torch as et

    bag = et.EmbeddingBag(10, 4, optimizer=ec.optimizers.RowWiseAdagrad(0.1))
    fused = et.FusedOptimizer(bag)
    momentum1 = torch.arange(10, dtype=torch.float32)
    fused.load_state_dict({"state": {"weight": {"momentum1": momentum1, "step": 3}}})
    np.testing.assert_array_equal(bag._table.slots()["row_accumulators"][:, 0], momentum1.numpy())
    assert bag._table.step == 3
    with pytest.raises(ValueError, match="shape"):
        fused.load_state_dict({"state": {"weight": {"momentum1": torch.zeros(10, 4)}}})
    with pytest.raises(ValueError, match=">= 0"):
        fused.load_state_dict({"state": {"weight": {"momentum1": -torch.ones(10)}}})
    np.testing.assert_array_equal(bag._table.slots()["row_accumulators"][:, 0], momentum1.numpy())


def test_arguments_and_slot_shape():
    o = ec.optimizers.RowWiseAdagrad()
    assert (o.learning_rate, o.epsilon, o.initial_accumulator_value) == (0.01, 1e-8, 0.0)  # FBGEMM's
    with pytest.raises(ValueError, match="initial_accumulator_value must be at least 1.17549435e-38"):
        ec.optimizers.RowWiseAdagrad(epsilon=0.0)
    with pytest.raises(ValueError, match="epsilon"):
        ec.optimizers.RowWiseAdagrad(epsilon=-1.0)
    t = make_table(6, 5, optimizer=ec.optimizers.RowWiseAdagrad(0.1, initial_accumulator_value=0.25))
    assert t.slots()["row_accumulators"].shape == (6, 1)
    t.assign_slot("row_accumulators", np.full((2, 1), 3.0, np.float32), 4)
    np.testing.assert_array_equal(t.slots()["row_accumulators"][:, 0], [0.25] * 4 + [3.0] * 2)
    with pytest.raises(ValueError, match=r"shape \[n, 1\]"):
        t.assign_slot("row_accumulators", np.zeros((2, 5), np.float32))
    with pytest.raises(ValueError, match=">= 0"):
        t.assign_slot("row_accumulators", np.full((1, 1), -1.0, np.float32))


# ----------------------------------------------------------------- checkpoints
def _trained(rng, name="t", rows=30, dim=6, steps=3):
    t = make_table(rows, dim, optimizer=ec.optimizers.RowWiseAdagrad(0.1), name=name, seed=5)
    for _ in range(steps):
        ids, offsets, w = random_bags(rng, rows, 10, weighted=True)
        t.apply_gradients(ids, offsets, rng.normal(size=(10, dim)).astype(np.float32), weights=w)
    return t


def _state(t):
    return t.to_numpy().copy(), t.slots()["row_accumulators"].copy(), t.step


def test_checkpoint_round_trip_and_manifest(rng, tmp_path):
    t = _trained(rng)
    path = str(tmp_path / "ckpt")
    ec.save(path, t)
    m = json.loads(ec.checkpoint.read_info(path).manifest_json)
    assert m["format_version"] == list(ec.FORMAT_VERSION) and tuple(ec.FORMAT_VERSION) >= (1, 3)  # the kind since 1.3
    entry = m["tables"][0]
    assert entry["optimizer"]["kind"] == "rowwise_adagrad"
    files = entry["slots"]["row_accumulators"]
    assert [(f["rows"], f["cols"]) for f in files] == [(30, 1)]
    assert os.path.getsize(tmp_path / "ckpt" / files[0]["path"]) == files[0]["bytes"]
    u = make_table(30, 6, optimizer=ec.optimizers.RowWiseAdagrad(0.1), seed=9)
    ec.load(path, into=u)
    for a, b in zip(_state(t), _state(u)):
        np.testing.assert_array_equal(a, b)
    # The same steps on both from here on.
    ids, offsets, w = random_bags(rng, 30, 10, weighted=True)
    g = rng.normal(size=(10, 6)).astype(np.float32)
    for x in (t, u):
        x.apply_gradients(ids, offsets, g, weights=w)
    for a, b in zip(_state(t), _state(u)):
        np.testing.assert_array_equal(a, b)


def test_checkpoint_of_another_optimizer_is_refused_unchanged(rng, tmp_path):
    path = str(tmp_path / "ckpt")
    saved = _trained(rng)
    ec.save(path, saved)
    t = make_table(30, 6, optimizer=ec.optimizers.Adagrad(0.1), seed=1)
    before = _state_any(t)
    with pytest.raises(ec.checkpoint.CheckpointError, match=r"slots \[row_accumulators\].*\[accumulators\]"):
        ec.load(path, into=t)
    for a, b in zip(before, _state_any(t)):
        np.testing.assert_array_equal(a, b)
    ec.load(path, into=t, include_optimizer=False)  # the values alone
    np.testing.assert_array_equal(t.to_numpy(), saved.to_numpy())
    np.testing.assert_array_equal(t.slots()["accumulators"], before[1])


def _state_any(t):
    return (t.to_numpy().copy(), *[v.copy() for v in t.slots().values()], t.step)


@pytest.mark.parametrize("n,m", [(1, 3), (3, 2), (2, 1)])
def test_sharded_save_restores_at_another_world_size(rng, tmp_path, n, m):
    """Saved by n row-wise ranks, loaded by m: every rank's rows, accumulators and step, bit for bit."""
    import embedcore.distributed as ed

    config = {"f": ec.FeatureConfig(ec.TableConfig("t", 23, 5, combiner="sum",
                                                   initializer=ec.initializers.Uniform(-1, 1, seed=2)))}
    path = str(tmp_path / "ckpt")
    ids, offsets, _ = random_bags(rng, 23, 12)
    grads = rng.normal(size=(12, 5)).astype(np.float32)

    def train(world):
        emb = ec.Embedding(config, ec.optimizers.RowWiseAdagrad(0.3), world=world, sharding="row_wise")
        for _ in range(2):
            emb({"f": ec.Ragged(ids, offsets)} if world.rank == 0 else
                {"f": ec.Ragged(np.zeros(0, np.int64), np.zeros(1, np.int64))})
            emb.apply_gradients({"f": grads if world.rank == 0 else np.zeros((0, 5), np.float32)})
        ec.save(path, emb)

    ed.run_local(n, train)
    whole = ec.Embedding(config, ec.optimizers.RowWiseAdagrad(0.3))
    ec.load(path, into=whole)
    full, = whole.embedding_tables.values()
    assert full.step == 2 and (full.slots()["row_accumulators"] > 0).any()

    def restore(world):
        emb = ec.Embedding(config, ec.optimizers.RowWiseAdagrad(0.3), world=world, sharding="row_wise")
        ec.load(path, into=emb)
        return [(s, t.to_numpy(), {k: np.array(x) for k, x in t.slots().items()}, t.step)
                for s, t in emb.local_shards["t"]]

    for shards in ed.run_local(m, restore):
        for s, values, slots, step in shards:
            rows = slice(s.row_start, s.row_start + s.rows)
            np.testing.assert_array_equal(values, full.to_numpy()[rows])
            np.testing.assert_array_equal(slots["row_accumulators"], full.slots()["row_accumulators"][rows])
            assert step == 2


def test_reshard_refuses_column_wise_and_keeps_dst(rng, tmp_path):
    import embedcore.distributed as ed

    src = str(tmp_path / "src")
    ec.save(src, _trained(rng))
    dst = str(tmp_path / "dst")
    with pytest.raises(ValueError, match="table 't'.*RowWiseAdagrad"):
        ed.reshard(src, dst, 2, plan="column_wise")
    assert not os.path.exists(dst)
    ed.reshard(src, dst, 3, plan="row_wise", max_file_bytes=64)
    u = make_table(30, 6, optimizer=ec.optimizers.RowWiseAdagrad(0.1), seed=9)
    ec.load(dst, into=u)
    t = ec.Table(name="t", rows=30, dim=6, optimizer=ec.optimizers.RowWiseAdagrad(0.1))
    ec.load(src, into=t)
    for a, b in zip(_state(t), _state(u)):
        np.testing.assert_array_equal(a, b)


def test_a_column_block_takes_values_only(rng, tmp_path):
    """Loading columns [2, 5) of a row-wise Adagrad table with its slots is refused; the values load alone."""
    from embedcore import _embedcore

    path = str(tmp_path / "ckpt")
    t = _trained(rng)
    ec.save(path, t)
    info = _embedcore.read_info(path)
    block = _embedcore.table_like(info, 0, 30, 3)
    before = np.array(block.values(), copy=True)
    with pytest.raises(ec.checkpoint.CheckpointError, match=r"row-wise slots.*columns \[2, 5\)"):
        _embedcore.load_table_block(info, 0, block, 0, 2, True, True)
    np.testing.assert_array_equal(block.values(), before)
    _embedcore.load_table_block(info, 0, block, 0, 2, False, True)
    np.testing.assert_array_equal(block.values(), t.to_numpy()[:, 2:5])
    whole_rows = _embedcore.table_like(info, 0, 10, 6)
    _embedcore.load_table_block(info, 0, whole_rows, 20, 0, True, True)  # a row block takes them
    np.testing.assert_array_equal(np.asarray(dict(whole_rows.slots())["row_accumulators"]),
                                  t.slots()["row_accumulators"][20:30])


def test_a_zero_gradient_element_stays_where_lr_over_epsilon_overflows():
    """lr / (sqrt(0) + epsilon) is infinite for a learning rate of 10 and the
    smallest epsilon: an element of zero gradient stays as it was (FBGEMM's
    inf * 0 steps it to NaN), one of positive gradient steps to -inf."""
    tiny = float(np.finfo(np.float32).tiny)
    t = ec.Table(name="t", rows=4, dim=2, initializer=ec.initializers.Constant(0.5),
                 optimizer=ec.optimizers.RowWiseAdagrad(10.0, initial_accumulator_value=0.0, epsilon=tiny))
    t.apply_gradients(np.array([1]), grads=np.zeros((1, 2), np.float32))
    np.testing.assert_array_equal(t.to_numpy()[1], [0.5, 0.5])
    t.apply_gradients(np.array([2]), grads=np.array([[0.0, 1e-30]], np.float32))  # mean square 5e-61: 0
    np.testing.assert_array_equal(t.to_numpy()[2], [0.5, -np.inf])
