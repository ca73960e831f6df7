"""GPU tables: the same checks on device="cpu" and device="cuda", the CPU
engine as the reference. The CUDA cases need the CUDA build (EMBEDCORE_CUDA=ON)
and a GPU, with PyTorch built for CUDA; elsewhere they are skipped, saying
which is missing. The error paths of builds without a GPU run everywhere."""
import re

import numpy as np
import pytest

import embedcore as ec
from helpers import cuda_skip_reason

INFO = ec.build_info()


REASON = cuda_skip_reason()
needs_gpu = pytest.mark.skipif(REASON is not None, reason=str(REASON))
DEVICES = ["cpu", pytest.param("cuda", marks=needs_gpu)]


def _to(device, a):
    """NumPy -> the device's array: NumPy for the CPU, a torch CUDA tensor for the GPU."""
    if device == "cpu" or a is None:
        return a
    import torch

    return torch.from_numpy(np.ascontiguousarray(a)).cuda()


def _host(x):
    """A host copy of NumPy, a torch tensor or a DLPack array (a device table's slots)."""
    if isinstance(x, np.ndarray):
        return x
    import torch

    return (x if isinstance(x, torch.Tensor) else torch.from_dlpack(x)).cpu().numpy()


def _table(device, dtype="float32", optimizer=None, rows=97, dim=13, seed=3):
    return ec.Table(name="t", rows=rows, dim=dim, dtype=dtype, initializer=ec.initializers.Uniform(-1, 1, seed=seed),
                    optimizer=optimizer, device=None if device == "cpu" else device)


def _bags(rng, rows, bags=40, max_len=6, weighted=False):
    lengths = rng.integers(0, max_len + 1, bags)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    ids = rng.integers(0, rows, offsets[-1]).astype(np.int64)
    ids[: min(3, ids.size)] = 5  # repeated ids
    w = rng.uniform(-1, 2, ids.size).astype(np.float32) if weighted else None
    return ids, offsets, w


# -------------------------------------------------------------- errors on any machine
@pytest.mark.skipif(INFO["cuda"], reason="checks the CPU-only build's error")
def test_cpu_build_refuses_gpu_tables_clearly():
    with pytest.raises(ec.NotCompiledError, match="CUDA build"):
        _table("cuda")
    with pytest.raises(ec.NotCompiledError, match="CUDA build"):
        ec.Embedding({"f": ec.FeatureConfig(ec.TableConfig("t", 4, 2))}, device="cuda:0")


@pytest.mark.skipif(not INFO["cuda"] or INFO["cuda_devices"] > 0, reason="checks a CUDA build on a machine without a GPU")
def test_cuda_build_without_gpu_refuses_clearly():
    with pytest.raises(ValueError, match="no CUDA device"):
        _table("cuda")
    with pytest.raises(ValueError, match="no CUDA device"):
        ec.distributed.run_local(2, lambda w: ec.Embedding(_sharded_cfg(), world=w, device="cuda"))


def test_bad_device_names():
    for bad in ["tpu", "cuda:x", "gpu:0", 3]:
        with pytest.raises(ValueError, match="device"):
            _table(bad)


def test_build_info_reports_cuda():
    assert isinstance(INFO["cuda"], bool)
    assert isinstance(INFO["cuda_devices"], int)
    if INFO["cuda"]:
        assert INFO["cuda_architectures"]


# -------------------------------------------------------------- GPU vs CPU engine
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn", None])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("id_dtype", [np.int32, np.int64])
def test_lookup_equals_cpu_engine(device, dtype, combiner, weighted, id_dtype):
    rng = np.random.default_rng(7)
    ref, dev = _table("cpu", dtype), _table(device, dtype)
    ids, offsets, w = _bags(rng, ref.rows, weighted=weighted)
    ids = ids.astype(id_dtype)
    for length in ([0] if combiner is not None else [0, 4]):
        want = ref.lookup(ids, offsets, weights=w, combiner=combiner, max_sequence_length=length)
        got = _host(dev.lookup(_to(device, ids), _to(device, offsets), weights=_to(device, w), combiner=combiner,
                               max_sequence_length=length))
        # The same order of additions and no FMA on either side: the same bits.
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("dim", [1, 8, 24, 64, 128, 300])  # one column or 16-byte packs; under, at, over a warp
@pytest.mark.parametrize("combiner", ["sum", "sqrtn"])
def test_pooled_lookup_of_every_width_equals_cpu_engine(device, dtype, dim, combiner):
    rng = np.random.default_rng(dim)
    ref, dev = _table("cpu", dtype, dim=dim, rows=500), _table(device, dtype, dim=dim, rows=500)
    ids, offsets, w = _bags(rng, ref.rows, bags=70, max_len=40, weighted=True)  # bags over one batch of loads
    want = ref.lookup(ids, offsets, weights=w, combiner=combiner)
    got = _host(dev.lookup(_to(device, ids), _to(device, offsets), weights=_to(device, w), combiner=combiner))
    np.testing.assert_array_equal(got, want)
    # An output that is not 16-byte aligned (a view one float in) takes the one-column kernel: the same bits.
    if device == "cuda":
        import torch

        base = torch.empty(want.size + 1, device="cuda")
        out = base[1:].view(want.shape)
        dev.lookup(_to(device, ids), _to(device, offsets), weights=_to(device, w), combiner=combiner, out=out)
        np.testing.assert_array_equal(_host(out), want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("combiner", ["sum", None])
@pytest.mark.parametrize("ids, offsets", [
    ([1, 12, 3, -1], [0, 2, 4]),  # two bad ids: the first is named
    ([1, 2, 3, 4], [0, 3, 2, 4]),  # offsets decrease
    ([1, 2, 3, 4], [1, 2, 4]),  # do not start at 0
    ([1, 2, 3, 4], [0, 2, 3]),  # end before the ids
    ([1, 2, 3, 4], [0, 7, 4]),  # past the ids, then back
    ([1, 2, 3, 4], [0, -2, 4]),
    ([1, 2], [0]),  # no bags, ids left over
])
def test_device_batch_errors_name_what_the_cpu_engine_names(device, combiner, ids, offsets):
    ref = ec.Table(name="t", rows=10, dim=8)
    dev = ec.Table(name="t", rows=10, dim=8, device=None if device == "cpu" else device)
    ids, offsets = np.array(ids, np.int64), np.array(offsets, np.int64)
    with pytest.raises((IndexError, ValueError)) as want:
        ref.lookup(ids, offsets, combiner=combiner)
    with pytest.raises(want.type, match="^" + re.escape(str(want.value)) + "$"):
        dev.lookup(_to(device, ids), _to(device, offsets), combiner=combiner)


@pytest.mark.parametrize("device", DEVICES)
def test_dense_and_ragged_inputs(device):
    ref, dev = _table("cpu"), _table(device)
    dense = np.arange(24, dtype=np.int64).reshape(6, 4) % ref.rows
    np.testing.assert_array_equal(_host(dev.lookup(_to(device, dense))), ref.lookup(dense))
    ids, offsets, _ = _bags(np.random.default_rng(1), ref.rows)
    got = dev.lookup(ec.Ragged(_to(device, ids), _to(device, offsets)), combiner="sum")
    np.testing.assert_array_equal(_host(got), ref.lookup(ec.Ragged(ids, offsets), combiner="sum"))


def _optimizers():
    return {
        "sgd": ec.optimizers.SGD(0.1),
        "adagrad": ec.optimizers.Adagrad(0.1),
        "adam": ec.optimizers.Adam(0.01),
        "adam_nonlazy": ec.optimizers.Adam(0.01, lazy_adam=False),
        "ftrl": ec.optimizers.FTRL(0.1),
        "rowwise_adagrad": ec.optimizers.RowWiseAdagrad(0.1, clipvalue=1.5),
    }


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("opt", list(_optimizers()))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("combiner", ["sum", "mean", None])
def test_training_equals_cpu_engine(device, opt, dtype, combiner):
    rng = np.random.default_rng(11)
    ref = _table("cpu", dtype, _optimizers()[opt])
    dev = _table(device, dtype, _optimizers()[opt])
    for _ in range(4):
        ids, offsets, w = _bags(rng, ref.rows, weighted=True)
        length = 3 if combiner is None else 0
        out = ref.lookup(ids, offsets, weights=w, combiner=combiner, max_sequence_length=length)
        g = rng.standard_normal(out.shape).astype(np.float32)
        ref.apply_gradients(ids, offsets, g, weights=w, combiner=combiner, max_sequence_length=length)
        dev.apply_gradients(_to(device, ids), _to(device, offsets), _to(device, g), weights=_to(device, w),
                            combiner=combiner, max_sequence_length=length)
    np.testing.assert_array_equal(dev.to_numpy(), ref.to_numpy())
    for name, slot in ref.slots().items():
        np.testing.assert_array_equal(_host(dev.slots()[name]), slot, err_msg=name)
    assert dev.step == ref.step == 4


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dim", [13, 130, 300])  # under one block of threads, a little over one, several
@pytest.mark.parametrize("opt", ["adam", "rowwise_adagrad"])  # row-wise: a row's sum over column blocks
def test_hot_ids_train_as_the_cpu_engine(device, dim, opt):
    """Groups of many occurrences (the GPU sums them 32 at a time, in order):
    1000, 33, 32, 31 and 1 occurrences of an id, spread over the batch."""
    rng = np.random.default_rng(5)
    ids = np.concatenate([np.full(1000, 5), np.full(33, 7), np.full(32, 9), np.full(31, 11), [13]])
    ids = rng.permutation(ids).astype(np.int64)
    offsets = np.arange(0, ids.size + 1, 7, dtype=np.int64)
    offsets[-1] = ids.size
    w = rng.uniform(0.5, 2, ids.size).astype(np.float32)
    g = rng.standard_normal((offsets.size - 1, dim)).astype(np.float32)
    ref = _table("cpu", optimizer=_optimizers()[opt], dim=dim)
    dev = _table(device, optimizer=_optimizers()[opt], dim=dim)
    for _ in range(2):
        ref.apply_gradients(ids, offsets, g, weights=w, combiner="sqrtn")
        dev.apply_gradients(_to(device, ids), _to(device, offsets), _to(device, g), weights=_to(device, w),
                            combiner="sqrtn")
    np.testing.assert_array_equal(dev.to_numpy(), ref.to_numpy())
    for name, slot in ref.slots().items():
        np.testing.assert_array_equal(_host(dev.slots()[name]), slot, err_msg=name)


@needs_gpu
def test_gpu_updates_are_deterministic_run_to_run():
    rng = np.random.default_rng(2)
    ids, offsets, _ = _bags(rng, 97, bags=2000, max_len=30)  # many repeats of each id
    g = rng.standard_normal((2000, 13)).astype(np.float32)
    results = []
    for _ in range(3):
        t = _table("cuda", optimizer=ec.optimizers.Adagrad(0.1))
        t.apply_gradients(_to("cuda", ids), _to("cuda", offsets), _to("cuda", g), combiner="mean")
        results.append(t.to_numpy())
    np.testing.assert_array_equal(results[0], results[1])
    np.testing.assert_array_equal(results[0], results[2])


@needs_gpu
def test_outputs_are_tensors_on_the_callers_stream_without_copies():
    import torch

    t = _table("cuda")
    ids = torch.tensor([1, 2, 3], device="cuda")
    offsets = torch.tensor([0, 1, 3], device="cuda")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        out = t.lookup(ids, offsets, combiner="sum")
    assert isinstance(out, torch.Tensor) and out.is_cuda and out.shape == (2, 13)
    v = torch.from_dlpack(t.values())  # the table's own memory
    assert v.data_ptr() == torch.from_dlpack(t.values()).data_ptr()
    np.testing.assert_array_equal(v.cpu().numpy(), t.to_numpy())


@needs_gpu
def test_gpu_errors_are_clear():
    import torch

    t = _table("cuda", optimizer=ec.optimizers.SGD(0.1))
    before = t.to_numpy()
    with pytest.raises(IndexError, match="id 97 at position 1"):
        t.lookup(torch.tensor([1, 97], device="cuda"), torch.tensor([0, 2], device="cuda"))
    with pytest.raises(TypeError, match="not a CUDA tensor"):
        t.lookup(np.array([1, 2]), np.array([0, 2]))
    with pytest.raises(TypeError, match="not a CUDA tensor"):
        t.lookup(torch.tensor([1, 2]), torch.tensor([0, 2]))
    with pytest.raises(IndexError):
        t.apply_gradients(torch.tensor([1, -1], device="cuda"), torch.tensor([0, 2], device="cuda"),
                          torch.ones(1, 13, device="cuda"))
    # An out that is the table's memory or an input's is refused, as on the host.
    two = ec.Table(name="two", rows=2, dim=13, device="cuda")
    ids, offsets = torch.tensor([1, 0], device="cuda"), torch.tensor([0, 1, 2], device="cuda")
    with pytest.raises(ValueError, match="out overlaps the values of table 'two'"):
        two.lookup(ids, offsets, combiner="sum", out=torch.from_dlpack(two._native.device_values()))
    shared = torch.zeros(2 * 13, device="cuda")  # the ids (two int64 zeros) are out's last four floats
    with pytest.raises(ValueError, match="out shares memory with ids"):
        two.lookup(shared[22:].view(torch.int64), offsets, combiner="sum", out=shared.view(2, 13))
    np.testing.assert_array_equal(t.to_numpy(), before)


@needs_gpu
def test_a_gpu_table_refuses_pickle_and_deepcopy_saying_what_to_do():
    import copy
    import pickle

    t = _table("cuda")
    with pytest.raises(TypeError, match=r"table 't' is in GPU memory \(cuda:0\) and does not pickle.*ec\.save"):
        pickle.dumps(t)
    with pytest.raises(TypeError, match="does not pickle or deepcopy"):
        copy.deepcopy(t)


@needs_gpu
def test_gpu_step_inputs_viewing_the_table_are_refused():
    """A step's gradients (ids, offsets, weights) that view the table's own
    memory are refused, as on the host: the kernels would read rows other
    blocks are writing (a result that depends on the schedule)."""
    import torch

    t = ec.Table(name="v", rows=4, dim=13, optimizer=ec.optimizers.SGD(0.1), device="cuda")
    before = t.to_numpy()
    view = torch.from_dlpack(t._native.device_values())[:2]
    ids, offsets = torch.tensor([1, 0], device="cuda"), torch.tensor([0, 1, 2], device="cuda")
    with pytest.raises(ValueError, match="grads overlaps the values of table 'v'"):
        t.apply_gradients(ids, offsets, view, combiner="sum")
    np.testing.assert_array_equal(t.to_numpy(), before)
    assert t.step == 0


@pytest.mark.parametrize("device", DEVICES)
def test_a_step_of_a_dense_sequence_of_width_zero(device):
    """[batch, 0] ids look up to [batch, 0, dim], and the step of that
    output's gradient is a step (no row changes), on the GPU as on the CPU
    (the GPU asked for a (0, dim) gradient)."""
    t = _table(device, optimizer=ec.optimizers.SGD(0.1))
    ids = _to(device, np.zeros((4, 0), np.int64))
    out = t.lookup(ids, combiner=None)
    assert tuple(out.shape) == (4, 0, 13)
    before = t.to_numpy()
    grads = _to(device, np.zeros((4, 0, 13), np.float32))
    t.apply_gradients(ids, grads=grads, combiner=None)
    assert t.step == 1
    np.testing.assert_array_equal(t.to_numpy(), before)


@pytest.mark.parametrize("device", DEVICES)
def test_embedding_step_uses_the_ids_of_its_lookup_not_the_buffer_refilled_since(device):
    """The ids (and weights) a lookup keeps for the step are copies, on the
    GPU as on the CPU: a caller that refills its id buffer in place (a
    prefetching loader) before the step still updates the looked-up rows."""
    def make(dev):
        t = ec.TableConfig("a", 50, 8, initializer=ec.initializers.Uniform(-1, 1, seed=1), combiner="sum")
        return ec.Embedding({"x": ec.FeatureConfig(t)}, ec.optimizers.SGD(0.5),
                            device=None if dev == "cpu" else "cuda:0")

    ref, emb = make("cpu"), make(device)
    ids = np.array([[1, 2], [3, 4]], np.int64)
    buf = _to(device, ids.copy())
    out = emb({"x": buf})
    buf[...] = 7  # refilled in place before the step
    emb.apply_gradients({"x": _to(device, np.ones((2, 8), np.float32))})
    ref({"x": ids})
    ref.apply_gradients({"x": np.ones((2, 8), np.float32)})
    got = next(iter(emb.embedding_tables.values())).to_numpy()
    np.testing.assert_array_equal(got, next(iter(ref.embedding_tables.values())).to_numpy())
    assert tuple(out["x"].shape) == (2, 8)


@needs_gpu
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_gpu_checkpoints_are_the_cpu_format(tmp_path, dtype):
    gpu = _table("cuda", dtype, ec.optimizers.Adam(0.01))
    rng = np.random.default_rng(5)
    ids, offsets, _ = _bags(rng, 97)
    gpu.apply_gradients(_to("cuda", ids), _to("cuda", offsets), _to("cuda", np.ones((40, 13), np.float32)))
    ec.save(tmp_path / "g", gpu)
    cpu = _table("cpu", dtype, ec.optimizers.Adam(0.01), seed=9)
    ec.load(tmp_path / "g", cpu)
    np.testing.assert_array_equal(cpu.to_numpy(), gpu.to_numpy())
    assert cpu.step == 1
    ec.save(tmp_path / "c", cpu)
    back = _table("cuda", dtype, ec.optimizers.Adam(0.01), seed=11)
    ec.load(tmp_path / "c", back)
    np.testing.assert_array_equal(back.to_numpy(), cpu.to_numpy())
    for name, s in cpu.slots().items():
        import torch

        np.testing.assert_array_equal(torch.from_dlpack(back.slots()[name]).cpu().numpy(), s)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("opt", ["adam", "rowwise_adagrad", "ftrl"])
def test_assign_slot_over_several_blocks_then_a_step_equal_the_cpu_engine(device, opt):
    # 2,000 x 13 floats: the checked copy goes through two 16K-float blocks (one, for row-wise Adagrad's
    # [n, 1] accumulators); a bad value in the second block is refused before anything is written.
    rng = np.random.default_rng(17)
    ref = _table("cpu", optimizer=_optimizers()[opt], rows=2100)
    dev = _table(device, optimizer=_optimizers()[opt], rows=2100)
    for name in ref.slot_names:
        cols = 1 if opt == "rowwise_adagrad" else 13
        values = rng.uniform(0.5, 2.0, (2000, cols)).astype(np.float32)
        bad = values.copy()
        bad[-1, -1] = np.nan
        before = _host(dev.slots()[name]).copy()
        with pytest.raises(ValueError, match=rf"slot {name} values\[1999, {cols - 1}\] = nan \(table row 2049\)"):
            dev.assign_slot(name, bad, start_row=50)
        np.testing.assert_array_equal(_host(dev.slots()[name]), before)
        ref.assign_slot(name, values, start_row=50)
        dev.assign_slot(name, values, start_row=50)
        np.testing.assert_array_equal(_host(dev.slots()[name]), _host(ref.slots()[name]), err_msg=name)
    ids, offsets, _ = _bags(rng, ref.rows)
    g = rng.standard_normal((len(offsets) - 1, 13)).astype(np.float32)
    ref.apply_gradients(ids, offsets, g)
    dev.apply_gradients(_to(device, ids), _to(device, offsets), _to(device, g))
    np.testing.assert_array_equal(dev.to_numpy(), ref.to_numpy())
    for name, slot in ref.slots().items():
        np.testing.assert_array_equal(_host(dev.slots()[name]), slot, err_msg=name)


@needs_gpu
def test_embedding_on_gpu_equals_cpu():
    import torch

    def cfg():
        t1 = ec.TableConfig("a", 50, 8, initializer=ec.initializers.Uniform(-1, 1, seed=1), combiner="mean")
        t2 = ec.TableConfig("b", 20, 4, initializer=ec.initializers.Uniform(-1, 1, seed=2), combiner="sum")
        return {"x": ec.FeatureConfig(t1), "y": ec.FeatureConfig(t2), "s": ec.FeatureConfig(t2, max_sequence_length=3)}

    ref = ec.Embedding(cfg(), ec.optimizers.Adagrad(0.1))
    dev = ec.Embedding(cfg(), ec.optimizers.Adagrad(0.1), device="cuda:0")
    rng = np.random.default_rng(0)
    for _ in range(3):
        feats = {"x": rng.integers(0, 50, (6, 3)), "y": rng.integers(0, 20, (6, 2)), "s": rng.integers(0, 20, (6, 4))}
        a = ref(feats)
        b = dev({k: torch.from_numpy(v).cuda() for k, v in feats.items()})
        for k in a:
            np.testing.assert_array_equal(b[k].cpu().numpy(), a[k])
        ref.apply_gradients({k: v + 1 for k, v in a.items()})
        dev.apply_gradients({k: v + 1 for k, v in b.items()})
    for cfg_ref, t in ref.embedding_tables.items():
        other = [u for u in dev.embedding_tables.values() if u.name == t.name][0]
        np.testing.assert_array_equal(other.to_numpy(), t.to_numpy())


# -------------------------------------------------------------- the nccl communicator
@pytest.mark.skipif(INFO["nccl"], reason="checks a build without NCCL")
def test_nccl_absent_says_how_to_get_it(tmp_path):
    with pytest.raises(ec.NotCompiledError, match="without NCCL"):
        ec.distributed.init("nccl", file=str(tmp_path / "id"), rank=0, size=1)


@pytest.mark.skipif(not INFO["nccl"], reason="needs the CUDA build with NCCL (EMBEDCORE_CUDA=ON, nvidia-nccl-cu13)")
def test_nccl_unique_id_and_arguments(tmp_path):
    from embedcore.distributed._nccl import _library

    assert len(ec._embedcore.NcclTransport.unique_id(_library())) == 128
    with pytest.raises(ValueError, match="exactly one of"):
        ec.distributed.init("nccl", rank=0, size=1)
    with pytest.raises(ValueError, match="impossible"):
        ec.distributed.init("nccl", file=str(tmp_path / "id"), rank=2, size=2)


@needs_gpu
@pytest.mark.skipif(not INFO["nccl"], reason="needs the CUDA build with NCCL (EMBEDCORE_CUDA=ON, nvidia-nccl-cu13)")
@pytest.mark.parametrize("shards", [None, "cuda:0"])  # the shards in host or GPU memory
def test_nccl_world_of_one_runs_the_sharded_lookup(tmp_path, shards):
    """NCCL does not run two ranks on one GPU: the transport is checked at
    world size 1 here, the algorithm at larger sizes over the other backends
    (and with GPU shards over run_local above)."""
    world = ec.distributed.init("nccl", file=str(tmp_path / "nccl_id"), rank=0, size=1, device=0)
    assert (world.rank, world.size, world.backend) == (0, 1, "nccl")
    got = world.all_to_all_v([np.arange(10, dtype=np.float32)])
    np.testing.assert_array_equal(got[0], np.arange(10, dtype=np.float32))
    assert world.all_gather({"a": 1}) == [{"a": 1}]

    def cfg():
        t = ec.TableConfig("a", 40, 6, initializer=ec.initializers.Uniform(-1, 1, seed=4), combiner="mean")
        return {"f": ec.FeatureConfig(t), "s": ec.FeatureConfig(t, max_sequence_length=3)}

    ref = ec.Embedding(cfg(), ec.optimizers.Adagrad(0.1))
    emb = ec.Embedding(cfg(), ec.optimizers.Adagrad(0.1), world=world, sharding="row_wise", device=shards)
    assert emb.shard_device == shards
    rng = np.random.default_rng(3)
    for _ in range(3):
        x = {"f": rng.integers(0, 40, (8, 3)), "s": rng.integers(0, 40, (8, 4))}
        a, b = ref(x), emb(x)
        for k in a:
            np.testing.assert_array_equal(b[k], a[k])
        ref.apply_gradients({k: v + 1 for k, v in a.items()})
        emb.apply_gradients({k: v + 1 for k, v in b.items()})
    (shard, table), = emb.local_shards["a"]
    np.testing.assert_array_equal(table.to_numpy(), ref.embedding_tables[next(iter(ref.embedding_tables))].to_numpy())


def _sharded_cfg():
    a = ec.TableConfig("a", 50, 6, initializer=ec.initializers.Uniform(-1, 1, seed=4), combiner="mean")
    b = ec.TableConfig("b", 30, 8, initializer=ec.initializers.Uniform(-1, 1, seed=5), combiner="sum")
    return {"f": ec.FeatureConfig(a), "s": ec.FeatureConfig(a, max_sequence_length=3), "g": ec.FeatureConfig(b)}


@pytest.mark.skipif(INFO["cuda"], reason="checks the CPU-only build's error")
def test_cpu_build_refuses_gpu_shards_clearly():
    with pytest.raises(ec.NotCompiledError, match="CUDA build"):
        ec.distributed.run_local(1, lambda w: ec.Embedding(_sharded_cfg(), world=w, device="cuda"))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sharding", ["table_wise", "row_wise", "column_wise"])
def test_sharded_embedding_with_gpu_shards(tmp_path, device, sharding):
    """Three ranks (threads) whose shards live on the device: lookups, Adagrad
    steps and a checkpoint as the unsharded CPU embedding's. (Any number of
    ranks may share a GPU here: run_local needs no NCCL.)"""
    rng = np.random.default_rng(8)
    batches = [{"f": rng.integers(0, 50, (9, 4)), "s": rng.integers(0, 50, (9, 5)), "g": rng.integers(0, 30, (9, 2))}
               for _ in range(3)]
    # The global batch's gradients (27 bags: the three ranks' in order), fixed in advance.
    shapes = {"f": (27, 6), "s": (27, 3, 6), "g": (27, 8)}
    grads = [{k: rng.standard_normal(shape).astype(np.float32) for k, shape in shapes.items()} for _ in batches]

    def rank(world):
        emb = ec.Embedding(_sharded_cfg(), ec.optimizers.Adagrad(0.1), world=world, sharding=sharding,
                           device=None if device == "cpu" else device)
        assert emb.shard_device == (None if device == "cpu" else "cuda:0")
        assert all(t.device == ("cpu" if device == "cpu" else "cuda:0")
                   for shards in emb.local_shards.values() for _, t in shards)
        outs = []
        for x, g in zip(batches, grads):
            outs.append(emb(x))  # every rank passes the same batch: a third of the global one
            emb.apply_gradients({k: v[world.rank * 9:(world.rank + 1) * 9] for k, v in g.items()})
        ec.save(str(tmp_path / "ckpt"), emb)
        return outs

    results = ec.distributed.run_local(3, rank)
    # Each rank's batch is a third of the global batch, so compare against an
    # unsharded embedding fed the three copies in rank order.
    ref3 = ec.Embedding(_sharded_cfg(), ec.optimizers.Adagrad(0.1))
    for step, x in enumerate(batches):
        x3 = {k: np.concatenate([v] * 3) for k, v in x.items()}
        out = ref3(x3)
        for r in range(3):
            for k in out:
                got = results[r][step][k]
                want = out[k][r * 9:(r + 1) * 9]
                if sharding == "row_wise" and k != "s":
                    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
                else:
                    np.testing.assert_array_equal(got, want)
        ref3.apply_gradients(grads[step])
    back = ec.Embedding(_sharded_cfg(), ec.optimizers.Adagrad(0.1))
    ec.load(str(tmp_path / "ckpt"), into=back)
    loaded = {c.name: t for c, t in back.embedding_tables.items()}
    for cfg, table in ref3.embedding_tables.items():
        np.testing.assert_array_equal(loaded[cfg.name].to_numpy(), table.to_numpy())
        np.testing.assert_array_equal(loaded[cfg.name].slots()["accumulators"], table.slots()["accumulators"])

    # The checkpoint loads onto two ranks' shards on the device (another world size): the same values.
    def reload(world):
        emb = ec.Embedding(_sharded_cfg(), ec.optimizers.Adagrad(0.1), world=world, sharding=sharding,
                           device=None if device == "cpu" else device)
        ec.load(str(tmp_path / "ckpt"), into=emb)
        return {name: [(s, t.to_numpy()) for s, t in shards] for name, shards in emb.local_shards.items()}

    for got in ec.distributed.run_local(2, reload):
        for name, shards in got.items():
            want = loaded[name].to_numpy()
            for s, values in shards:
                np.testing.assert_array_equal(
                    values, want[s.row_start:s.row_start + s.rows, s.col_start:s.col_start + s.cols])
