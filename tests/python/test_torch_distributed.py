"""embedcore.adapters.torch.distributed: TorchComm over a torch.distributed
process group, and the sharded EmbeddingBagCollection / EmbeddingCollection.

The collectives run in 2-process gloo groups started by ``torchrun
--nproc_per_node 2`` (tests/python/torch_dist_worker.py does the checks on
each rank and exits non-zero on a mismatch); argument checks and single
process behaviour run here, over ``run_local`` threads where a world is
needed (the sharded modules take any ``Comm``)."""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402

import embedcore as ec  # noqa: E402
import embedcore.adapters.torch as et  # noqa: E402
from embedcore.adapters.torch import distributed as etd  # noqa: E402
from embedcore.distributed import RankFailedError, run_local  # noqa: E402

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torch_dist_worker.py")
TIMEOUT_S = 240


def _torchrun():
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("this PyTorch has no torch.distributed with gloo")
    exe = os.path.join(os.path.dirname(sys.executable), "torchrun")
    exe = exe if os.path.exists(exe) else shutil.which("torchrun")
    if exe is None:
        pytest.skip("torchrun is not installed next to this Python or on PATH")
    return exe


def _free_ports(n: int = 1) -> list:
    """n distinct ports free now (another process may still take one before
    it is used: the runs below try once more on "address already in use")."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _run_torchrun(script, *args) -> str:
    """Runs `script` on 2 ranks under torchrun; returns its output, failing
    the test with it when torchrun fails or times out."""
    exe = _torchrun()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    what = " ".join([os.path.basename(str(script)), *args])
    for attempt in range(2):
        cmd = [exe, "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", str(_free_ports()[0]),
               str(script), *args]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # torchrun and its workers: the session this test started
            out, _ = proc.communicate()
            pytest.fail(f"torchrun {what} timed out after {TIMEOUT_S} s:\n{out[-6000:]}")
        if proc.returncode != 0 and "address already in use" in out.lower() and attempt == 0:
            continue  # the free port was taken in between: once more on another
        break
    assert proc.returncode == 0, f"torchrun {what} failed ({proc.returncode}):\n{out[-8000:]}"
    return out


def _run_workers(*args) -> str:
    """Runs the worker on 2 ranks (see _run_torchrun)."""
    return _run_torchrun(WORKER, *args)


def _passed(out: str, part: str) -> None:
    for r in (0, 1):
        assert f"PASS {part} rank {r}" in out, f"rank {r} did not finish part {part!r}:\n{out[-4000:]}"


# ====================================================================== torchrun
def test_torch_comm_collectives_under_torchrun():
    """TorchComm over a 2-rank gloo group: all_to_all_v for several dtypes
    and sizes (zero included), with counts given or exchanged, non-contiguous
    and read-only inputs, 4 MB payloads; all_gather, barrier, a subgroup;
    init() from torchrun's environment."""
    _passed(_run_workers("comm"), "comm")


def test_sharded_collections_under_torchrun(tmp_path):
    """The sharded EmbeddingBagCollection (dict and KJT inputs) and
    EmbeddingCollection, table-, row- and column-wise, and the generic
    sharded ec.Embedding over TorchComm, trained for three steps and
    compared with the unsharded modules on the global batch (bit-exact for
    table- and column-wise; row-wise within 1e-6 for outputs, 1e-5 for
    values and slots); a collective checkpoint; errors on one rank."""
    out = _run_workers("train", str(tmp_path))
    _passed(out, "train")
    _passed(out, "checkpoint")
    assert (tmp_path / "ckpt").is_dir()


# ====================================================================== in process
def test_torch_comm_needs_a_process_group():
    if dist.is_initialized():
        pytest.skip("a process group exists in this process")
    with pytest.raises(RuntimeError, match="not initialised"):
        etd.TorchComm()


def test_init_outside_torchrun(monkeypatch):
    if dist.is_initialized():
        pytest.skip("a process group exists in this process")
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(RuntimeError, match="torchrun"):
        etd.init()
    assert not dist.is_initialized()


def test_exports():
    assert et.distributed is etd
    assert issubclass(etd.TorchComm, ec.distributed.Comm)
    assert etd.TorchComm.backend == "torch"
    assert issubclass(et.ShardedEmbeddingBagCollection, et.EmbeddingBagCollection)
    assert issubclass(et.ShardedEmbeddingCollection, et.EmbeddingCollection)


def _tables(**kw):
    return [et.EmbeddingBagConfig(num_embeddings=20, embedding_dim=4, name="t1", feature_names=["a"], **kw),
            et.EmbeddingBagConfig(num_embeddings=9, embedding_dim=3, name="t2", feature_names=["b"], pooling="mean",
                                  **kw)]


def _feats(rank):
    return {"a": (torch.tensor([1, 2, 18, 2]) + rank, torch.tensor([0, 3, 3, 4])),
            "b": (torch.tensor([0, 8, 8]), torch.tensor([0, 1, 1, 3]))}


def test_sharded_collection_is_chosen_by_world():
    def fn(world):
        m = et.EmbeddingBagCollection(_tables(), optimizer=ec.optimizers.SGD(0.1), world=world, sharding="row_wise")
        assert type(m) is et.ShardedEmbeddingBagCollection
        assert m.world is world and m.embedding.plan is m.plan
        assert {n: t.kind for n, t in m.plan.tables.items()} == {"t1": "row_wise", "t2": "row_wise"}
        assert "row_wise" in repr(m)
        e = et.EmbeddingCollection([et.EmbeddingConfig(5, 2, name="e")], world=world, sharding="table_wise")
        assert type(e) is et.ShardedEmbeddingCollection
        return True

    assert run_local(2, fn) == [True, True]
    assert type(et.EmbeddingBagCollection(_tables())) is et.EmbeddingBagCollection  # world=None: unsharded

    class Mine(et.EmbeddingBagCollection):
        pass

    with pytest.raises(TypeError, match="subclass"):
        Mine(_tables(), world=object())
    with pytest.raises(TypeError, match="Comm"):
        et.EmbeddingBagCollection(_tables(), world="not a comm")


@pytest.mark.parametrize("bad", ["int16 ids", "sparse ids", "missing feature"])
def test_sharded_bad_input_on_one_rank_reaches_every_rank(bad):
    """An input that one rank refuses before any collective (its type, a
    missing feature) still reaches the others, as RankFailedError, instead
    of leaving them waiting in the lookup; the next step works on all."""
    def fn(world):
        m = et.EmbeddingBagCollection(_tables(), optimizer=ec.optimizers.SGD(0.1), world=world, sharding="row_wise")
        good = {"a": torch.tensor([[1, 2]]), "b": torch.tensor([[3, 0]])}
        feats = dict(good)
        if world.rank == 1:
            if bad == "int16 ids":
                feats["a"] = feats["a"].to(torch.int16)
            elif bad == "sparse ids":
                feats["a"] = feats["a"].to_sparse()
            else:
                del feats["b"]
        try:
            m(feats)
            first = "ok"
        except Exception as e:  # noqa: BLE001 - the point of the test
            first = type(e).__name__
        out = m(good)
        sum(o.sum() for o in out.values()).backward()
        return first

    assert run_local(2, fn) == ["RankFailedError", "KeyError" if bad == "missing feature" else "TypeError"]


def test_sharded_inference_only_matches_unsharded():
    """Without an optimizer the sharded module only looks up: outputs need
    no grad and equal the unsharded module's on the global batch."""
    # run_local's ranks are threads sharing torch's one generator, whose draws
    # would race: explicit initializers here (per-rank seeds: the torchrun test).
    init = {"initializer": ec.initializers.Uniform(-0.5, 0.5, seed=3)}

    def fn(world):
        m = et.EmbeddingBagCollection(_tables(**init), world=world, sharding="column_wise")
        out = m(_feats(world.rank))
        assert not any(o.requires_grad for o in out.values())
        m(_feats(world.rank))  # warned once
        m.eval()
        assert all(torch.equal(v, out[k]) for k, v in m(_feats(world.rank)).items())
        return {k: v.clone() for k, v in out.items()}

    # A training-mode call warns (once a module): TorchRec's apply_optimizer_in_backward, or a PyTorch
    # optimizer, finds no parameters in it, and such a module silently never trained.
    with pytest.warns(RuntimeWarning, match="built without an optimizer, so its tables do not train") as seen:
        outs = run_local(2, fn)
    untrained = [w for w in seen if "without an optimizer" in str(w.message)]
    assert len(untrained) == 2 and {w.filename for w in untrained} == {__file__}  # the module's call, here

    def frozen(world):  # frozen on purpose (requires_grad_(False), as the docs say): no warning
        m = et.EmbeddingBagCollection(_tables(**init), world=world, sharding="row_wise").requires_grad_(False)
        return m(_feats(world.rank))

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        run_local(2, frozen)
    ref = et.EmbeddingBagCollection(_tables(**init))
    for r, out in enumerate(outs):
        want = ref(_feats(r))
        for k in want:
            assert torch.equal(out[k], want[k].detach()), (r, k)


def test_sharded_collections_take_kjts_with_int16_lengths():
    """As the unsharded collections (and TorchRec's): a KJT's lengths may be
    int16; the outputs are those of its int64 lengths."""
    torchrec = pytest.importorskip("torchrec")
    init = {"initializer": ec.initializers.Uniform(-0.5, 0.5, seed=3)}

    def kjts(rank):
        values = torch.tensor([1 + rank, 2, 18, 2, 0, 8, 8])
        wide = torchrec.KeyedJaggedTensor.from_lengths_sync(keys=["a", "b"], values=values,
                                                            lengths=torch.tensor([3, 0, 1, 1, 0, 2]))
        return wide, torchrec.KeyedJaggedTensor(keys=["a", "b"], values=wide.values(),
                                                lengths=wide.lengths().to(torch.int16))

    def fn(world):
        bags = et.EmbeddingBagCollection(_tables(**init), world=world, sharding="row_wise")
        seq = et.EmbeddingCollection([et.EmbeddingConfig(20, 4, name="t1", feature_names=["a", "b"], **init)],
                                     world=world, sharding="row_wise")
        wide, narrow = kjts(world.rank)
        out = [bags(wide).values().clone(), bags(narrow).values().clone()]
        a, b = seq(wide), seq(narrow)
        out += [torch.equal(a[k].values(), b[k].values()) and torch.equal(a[k].lengths(), b[k].lengths())
                for k in a]
        return out

    for wide, narrow, *same in run_local(2, fn):
        assert torch.equal(wide, narrow) and same == [True, True]


def test_sharded_collections_refuse_fx_tracing_by_name():
    """FX symbolic tracing of a sharded collection raises TypeError naming
    FX and the leaf-module workaround, on every rank (none waits)."""
    import torch.fx

    def fn(world):
        m = et.EmbeddingBagCollection(_tables(), world=world, sharding="row_wise")
        # (What symbolic_trace passes, made by hand: its patching of nn.Module is not for threads at once.)
        proxy = torch.fx.Proxy(torch.fx.Graph().placeholder("features"))
        with pytest.raises(TypeError, match=r"ShardedEmbeddingBagCollection: FX symbolic tracing cannot trace into "
                                            r"its lookup .*leaf_modules=\['ShardedEmbeddingBagCollection'\]"):
            m(proxy)
        return sorted(m(_feats(world.rank)))  # (the ranks go on together)

    assert run_local(2, fn) == [["a", "b"], ["a", "b"]]


def test_sharded_collection_argument_errors():
    """Refusals that every rank raises alike (no rank is left waiting)."""
    def fn(world):
        errors = []
        with pytest.raises(NotImplementedError, match="init_fn"):
            et.EmbeddingBagCollection([et.EmbeddingBagConfig(5, 2, name="x", init_fn=torch.nn.init.zeros_)],
                                      world=world)
        errors.append("init_fn")
        mixed = _tables()
        mixed[0].optimizer = ec.optimizers.SGD(0.1)
        with pytest.raises(ValueError, match="every table or none"):
            et.EmbeddingBagCollection(mixed, world=world)
        errors.append("mixed")
        # GPU shards need the CUDA build, and a GPU (tests/python/test_torch_cuda.py runs them there).
        if not ec.build_info()["cuda"]:
            with pytest.raises(NotImplementedError, match="CUDA build"):
                et.EmbeddingBagCollection(_tables(), world=world, device="cuda")
        elif ec.build_info()["cuda_devices"] == 0:
            with pytest.raises(ValueError, match="no CUDA device"):
                et.EmbeddingBagCollection(_tables(), world=world, device="cuda")
        with pytest.raises(NotImplementedError, match="CPU or CUDA"):
            et.EmbeddingBagCollection(_tables(), world=world, device="meta")
        errors.append("device")
        m = et.EmbeddingBagCollection(_tables(), optimizer=ec.optimizers.SGD(0.1), world=world)
        f = _feats(world.rank)
        f["a"] = (f["a"][0], f["a"][1], torch.ones(4, requires_grad=True))
        with pytest.raises(NotImplementedError, match="require grad"):
            m(f)
        with torch.no_grad():  # no gradient wanted: weights are just weights
            assert m(f)["a"].shape == (3, 4)
        f = _feats(world.rank)
        f["b"] = (f["b"][0], torch.tensor([0, 2, 1, 3]))
        with pytest.raises(ValueError, match="non-decreasing"):
            m(f)
        with pytest.raises(KeyError, match="'b'"):
            m({"a": f["a"]})
        with pytest.raises(TypeError):
            m([f["a"]])
        with pytest.raises(AttributeError, match="no fused_optimizer object.*backward"):
            m.fused_optimizer
        assert not hasattr(m, "fused_optimizer") and getattr(m, "fused_optimizer", None) is None
        with pytest.raises(NotImplementedError, match="ec.save"):
            m.optimizer_state_dict()
        errors.append("module")
        return errors

    assert run_local(2, fn) == [["init_fn", "mixed", "device", "module"]] * 2


def test_sharded_ids_out_of_range_on_one_rank():
    """The rank with the bad id raises IndexError, the other RankFailedError;
    nothing changes, and the next step runs on both."""
    def fn(world):
        m = et.EmbeddingBagCollection(_tables(), optimizer=ec.optimizers.SGD(0.5), world=world, sharding="row_wise")
        before = {n: [t.to_numpy().copy() for _, t in s] for n, s in m.embedding.local_shards.items()}
        f = _feats(world.rank)
        if world.rank == 1:
            f["b"] = (torch.tensor([0, 9, 8]), f["b"][1])
        with pytest.raises(IndexError if world.rank == 1 else RankFailedError, match="9" if world.rank else "rank 1"):
            m(f)
        after = {n: [t.to_numpy() for _, t in s] for n, s in m.embedding.local_shards.items()}
        assert all(np.array_equal(a, b) for n in before for a, b in zip(before[n], after[n]))
        out = m(_feats(world.rank))
        sum(o.sum() for o in out.values()).backward()
        changed = any(not np.array_equal(a, t.to_numpy()) for n, s in m.embedding.local_shards.items()
                      for a, (_, t) in zip(before[n], s))
        return changed

    assert any(run_local(2, fn))  # the step after the failure trained


def test_ranks_building_different_kinds_of_sharded_object_raise_a_mismatch():
    """One rank builds a sharded EmbeddingBagCollection, the other an
    ec.Embedding, an EmbeddingCollection or the other collection: every rank
    raises CollectiveMismatchError naming what each one builds."""
    from embedcore.distributed import CollectiveMismatchError

    def build(kind, world):
        if kind == "ebc":
            return et.EmbeddingBagCollection(_tables(), world=world, sharding="row_wise")
        if kind == "ec":
            return et.EmbeddingCollection([et.EmbeddingConfig(20, 4, name="t1", feature_names=["a"])], world=world,
                                          sharding="row_wise")
        return ec.Embedding({"a": ec.FeatureConfig(ec.TableConfig("t1", 20, 4))}, world=world, sharding="row_wise")

    for other in ("embedding", "ec"):
        def fn(world):
            try:
                build("ebc" if world.rank == 0 else other, world)
            except CollectiveMismatchError as e:
                return str(e)
            return "built"

        for message in run_local(2, fn):
            assert "EmbeddingBagCollection(): construction" in message, message
            assert ("Embedding(): construction" if other == "embedding" else "EmbeddingCollection(): construction") \
                in message.replace("EmbeddingBagCollection", ""), message


def test_a_frozen_sharded_collection_does_not_train_as_the_unsharded_one():
    """requires_grad_(False) on the module stops its tables' updates (the
    outputs need no grad, so backward() of a head after it leaves them), as
    it does for the unsharded module; requires_grad_(True) trains again."""
    def fn(world):
        m = et.EmbeddingBagCollection(_tables(), optimizer=ec.optimizers.SGD(0.5), world=world, sharding="row_wise")
        head = torch.nn.Linear(sum(c.embedding_dim for c in _tables()), 1)

        def step():
            out = m(_feats(world.rank))
            head(torch.cat([out[k] for k in sorted(out)], 1)).sum().backward()
            return out

        def shards():
            return [t.to_numpy().copy() for _, s in sorted(m.embedding.local_shards.items()) for _, t in s]

        before = shards()
        assert m.requires_grad_(False) is m
        frozen = step()
        frozen_kept = all(np.array_equal(a, b) for a, b in zip(before, shards()))
        m.requires_grad_(True)
        step()
        trained = any(not np.array_equal(a, b) for a, b in zip(before, shards()))
        return frozen_kept, trained, all(not o.requires_grad for o in frozen.values())

    assert run_local(2, fn) == [(True, True, True)] * 2
    unsharded = et.EmbeddingBagCollection(_tables(), optimizer=ec.optimizers.SGD(0.5)).requires_grad_(False)
    assert all(not o.requires_grad for o in unsharded(_feats(0)).values())


@pytest.mark.parametrize("sharding", ["table_wise", "row_wise", "column_wise"])
def test_rank_with_no_bags(sharding):
    """A rank whose part of the batch is empty still takes part; the result
    is the unsharded module's on the other rank's bags alone."""
    def tables():  # an explicit initializer: run_local's threads share torch's generator
        return [et.EmbeddingBagConfig(10, 3, name="t", feature_names=["a"], pooling="mean",
                                      initializer=ec.initializers.Uniform(-0.5, 0.5, seed=1))]

    def opt():
        return ec.optimizers.Adagrad(0.1, initial_accumulator_value=0.1)

    full = {"a": (torch.tensor([1, 2, 9, 2]), torch.tensor([0, 3, 3, 4]))}
    empty = {"a": (torch.zeros(0, dtype=torch.int64), torch.tensor([0]))}

    def fn(world):
        m = et.EmbeddingBagCollection(tables(), optimizer=opt(), world=world, sharding=sharding)
        out = m(full if world.rank == 0 else empty)["a"]
        ((out - 1.0) ** 2).sum().backward()
        return out.detach().clone(), [(s, t.to_numpy().copy()) for s, t in m.embedding.local_shards.get("t", [])]

    results = run_local(2, fn)
    ref = et.EmbeddingBagCollection(tables(), optimizer=opt())
    w0 = ref.embedding_bags["t"].weight.detach().clone()
    want = ref(full)["a"]
    ((want - 1.0) ** 2).sum().backward()
    assert results[1][0].shape == (0, 3)
    assert float((results[0][0] - want.detach()).abs().max()) <= 1e-6
    w = ref.embedding_bags["t"].weight.detach().numpy()
    shards = [x for _, s in results for x in s]
    assert len(shards) == {"table_wise": 1, "row_wise": 2, "column_wise": 2}[sharding]
    for s, values in shards:
        assert np.abs(values - w[s.row_start:s.row_start + s.rows, s.col_start:s.col_start + s.cols]).max() <= 1e-6
    assert not torch.equal(w0, ref.embedding_bags["t"].weight.detach())  # the step did change the table


def test_sharded_collections_take_torchrec_configs():
    """TorchRec's configs always hold an init_fn (uniform_ in their weight
    bounds, filled in by the config): the sharded collections draw that
    uniform with the engine, within the config's bounds."""
    torchrec = pytest.importorskip("torchrec")
    cfg = torchrec.EmbeddingBagConfig(num_embeddings=40, embedding_dim=4, name="t", feature_names=["f"],
                                      weight_init_min=-0.1, weight_init_max=0.1)

    def fn(world):
        m = et.EmbeddingBagCollection([cfg], optimizer=ec.optimizers.SGD(0.1), world=world, sharding="row_wise")
        shard = np.concatenate([t.to_numpy() for _, t in m.embedding.local_shards["t"]])
        out = m({"f": torch.tensor([[1], [7]])})["f"]
        return shard, tuple(out.shape)

    shards = run_local(2, fn)
    values = np.concatenate([s for s, _ in shards])
    assert values.shape == (40, 4) and [shape for _, shape in shards] == [(2, 4), (2, 4)]
    assert values.min() >= -0.1 and values.max() <= 0.1 and np.unique(values).size > 100
    with pytest.raises(NotImplementedError, match="init_fn"):  # any other init_fn needs the whole table
        run_local(1, lambda world: et.EmbeddingBagCollection(
            [torchrec.EmbeddingBagConfig(num_embeddings=4, embedding_dim=2, name="t", feature_names=["f"],
                                         init_fn=torch.nn.init.zeros_)], world=world))


@pytest.mark.parametrize("sharding", ["row_wise", "column_wise"])
def test_sharded_reset_parameters_restores_the_built_values(sharding):
    """Each rank re-initializes its own shards; together they hold the
    values the unsharded collection is built with."""
    def tables():
        return [et.EmbeddingBagConfig(30, 4, name="t", feature_names=["a"],
                                      initializer=ec.initializers.TruncatedNormal(0, 0.3, seed=7))]

    def fn(world):
        m = et.EmbeddingBagCollection(tables(), optimizer=ec.optimizers.SGD(1.0), world=world, sharding=sharding)
        m({"a": torch.tensor([[1, 2, 29]])})["a"].sum().backward()  # trains: the values move
        trained = [t.to_numpy().copy() for _, t in m.embedding.local_shards["t"]]
        m.reset_parameters()
        return trained, [(s, t.to_numpy().copy()) for s, t in m.embedding.local_shards["t"]]

    want = et.EmbeddingBagCollection(tables()).embedding_bags["t"].weight.detach().numpy()
    results = run_local(2, fn)
    assert any(not np.array_equal(v, s_v) for trained, shards in results for v, (_, s_v) in zip(trained, shards))
    for _, shards in results:
        for s, values in shards:
            np.testing.assert_array_equal(values, want[s.row_start:s.row_start + s.rows,
                                                       s.col_start:s.col_start + s.cols])


def test_sharded_collection_under_torch_compile():
    """torch.compile (graph breaks allowed) runs the sharded collective
    lookup eagerly inside the compiled function (dynamo tracing into it
    failed): same losses and update as eager."""
    def fn(world, compiled):
        m = et.EmbeddingBagCollection(
            [et.EmbeddingBagConfig(num_embeddings=10, embedding_dim=4, name="t", feature_names=["f"],
                                   initializer=ec.initializers.Uniform(-0.5, 0.5, seed=3))],
            optimizer=ec.optimizers.SGD(0.1), world=world, sharding="row_wise")
        step = lambda x: m(x)["f"].sum()  # noqa: E731
        step = torch.compile(step) if compiled else step
        losses = []
        for _ in range(2):
            loss = step({"f": torch.tensor([[1], [7]]) + world.rank})
            loss.backward()
            losses.append(float(loss))
        return losses, [t.to_numpy().copy() for _, t in m.embedding.local_shards["t"]]

    eager = run_local(2, lambda world: fn(world, False))
    compiled = run_local(2, lambda world: fn(world, True))
    for (le, ve), (lc, vc) in zip(eager, compiled):
        assert le == pytest.approx(lc, rel=1e-6) and all(np.allclose(a, b, atol=1e-6) for a, b in zip(ve, vc))


def test_sharded_collection_ranks_with_other_module_arguments_are_refused():
    """is_weighted decides whether a rank pools its KJT's weights, and
    need_indices what its outputs carry: a rank built with another value
    makes every rank raise ValueError naming the argument and both values,
    instead of pooling differently in silence."""
    init = {"initializer": ec.initializers.Uniform(-0.5, 0.5, seed=3)}

    def bags(world):
        try:
            et.EmbeddingBagCollection(_tables(**init), is_weighted=world.rank == 0, world=world, sharding="row_wise")
        except ValueError as e:
            return str(e)
        return "built"

    for r, msg in enumerate(run_local(2, bags)):
        other = 1 - r
        assert (f"rank {other} built the collection with is_weighted={other == 0}, rank {r} with "
                f"is_weighted={r == 0}") in msg, msg

    def sequences(world):
        try:
            et.EmbeddingCollection([et.EmbeddingConfig(5, 2, name="e", **init)], need_indices=world.rank == 1,
                                   world=world, sharding="row_wise")
        except ValueError as e:
            return str(e)
        return "built"

    for r, msg in enumerate(run_local(2, sequences)):
        assert "need_indices=" in msg and "same arguments" in msg, msg

    # The same arguments everywhere: built.
    assert run_local(2, lambda w: type(et.EmbeddingBagCollection(_tables(**init), is_weighted=True, world=w,
                                                                 sharding="row_wise")).__name__) == \
        ["ShardedEmbeddingBagCollection"] * 2


@pytest.mark.parametrize("collection", ["EmbeddingBagCollection", "EmbeddingCollection"])
def test_a_bad_id_names_the_callers_feature_where_tables_share_it(collection):
    """The engine's features are the outputs ('s2@e2' where two tables read
    s2); a bad id's error names the feature the caller gave."""
    config = et.EmbeddingBagConfig if collection == "EmbeddingBagCollection" else et.EmbeddingConfig
    tables = [config(30, 4, name="e1", feature_names=["s1", "s2"]), config(20, 4, name="e2", feature_names=["s2"])]
    x = {"s1": torch.tensor([[1, 2]]), "s2": (torch.tensor([1, 25, 3]), torch.tensor([0, 3]))}

    def fn(world):
        module = getattr(et, collection)(tables, world=world, sharding="table_wise")
        module.eval()
        with pytest.raises(IndexError, match=r"^features\['s2'\]: id 25 at position 1 is out of range for "
                                             r"table 'e2' with 20 rows"):
            module(x)
        # module.embedding's own calls name its own features.
        with pytest.raises(IndexError, match=r"^features\['s2'\]: id 25 at position 1 is out of range"):
            module({"s1": torch.tensor([[1, 2]]), "s2": torch.tensor([[1, 25]])})
        with pytest.raises(IndexError, match=r"^features\['s2@e2'\]: id 25 at index \[0, 1\] "):
            module.embedding([np.array([[1, 2]]), np.array([[1]]), np.array([[1, 25]])])  # s1, s2@e1, s2@e2

    run_local(2, fn)


@pytest.mark.parametrize("collection", ["EmbeddingBagCollection", "EmbeddingCollection"])
def test_a_bad_id_of_a_kjt_is_named_at_its_position_in_values(collection):
    """As unsharded (docs/torch.md): the position of a bad id is the one in
    the KeyedJaggedTensor's values(), not in its feature's slice."""
    kjt_type = pytest.importorskip("torchrec.sparse.jagged_tensor").KeyedJaggedTensor
    kjt = kjt_type(keys=["f1", "f2"], values=torch.tensor([1, 2, 3, 11]), lengths=torch.tensor([1, 1, 1, 1]))
    make = getattr(et, collection)
    config = (et.EmbeddingBagConfig if collection == "EmbeddingBagCollection" else et.EmbeddingConfig)(
        num_embeddings=10, embedding_dim=4, name="t", feature_names=["f1", "f2"])
    with pytest.raises(IndexError, match="feature 'f2': id 11 at position 3 of the KeyedJaggedTensor's values"):
        make([config])(kjt)

    def fn(world):
        with pytest.raises(IndexError, match=r"features\['f2'\]: id 11 at position 3 of the KeyedJaggedTensor's "
                                             r"values\(\) is out of range for table 't'"):
            make([config], world=world, sharding="row_wise")(kjt)

    run_local(2, fn)

    # int32 lengths past the values (their running sum wraps around to the values' count): the length is named.
    wrapping = kjt_type(keys=["f1", "f2"], values=torch.tensor([1, 2, 3, 4]),
                        lengths=torch.tensor([2**31 - 1, 2**31 - 1, 3, 3], dtype=torch.int32))
    assert int(wrapping.offsets()[-1]) == 4
    length = r"KeyedJaggedTensor\['lengths'\]\[0\] = 2147483647 is greater than the number of values \(4\)"
    with pytest.raises(ValueError, match=length):
        make([config])(wrapping)

    def sharded(world):
        with pytest.raises(ValueError, match=length):
            make([config], world=world, sharding="row_wise")(wrapping)

    run_local(2, sharded)

    # The bad id on rank 1 only: rank 0's RankFailedError quotes the same position.
    good = kjt_type(keys=["f1", "f2"], values=torch.tensor([1, 2, 3, 4]), lengths=torch.tensor([1, 1, 1, 1]))

    def one_bad(world):
        module = make([config], world=world, sharding="row_wise")
        with pytest.raises(Exception) as info:
            module(kjt if world.rank == 1 else good)
        return type(info.value).__name__, str(info.value)

    where = "id 11 at position 3 of the KeyedJaggedTensor's values() is out of range for table 't'"
    (kind0, message0), (kind1, message1) = run_local(2, one_bad)
    assert (kind0, kind1) == ("RankFailedError", "IndexError"), (message0, message1)
    assert where in message1 and message0 == f"rank 1 of 2 failed: IndexError: {message1}", (message0, message1)

    # A KeyedJaggedTensor's positions are that call's only: a later direct lookup through module.embedding
    # names the position in its own input.
    def later(world):
        module = make([config], world=world, sharding="row_wise")
        module(good)
        with pytest.raises(IndexError) as info:
            module.embedding([ec.Ragged.from_lengths(np.array([1]), np.array([1])),
                              ec.Ragged.from_lengths(np.array([99]), np.array([1]))])
        return str(info.value)

    for message in run_local(2, later):
        assert "id 99 at position 0 is out of range" in message and "KeyedJaggedTensor" not in message, message


TWO_TOWERS = r'''
import atexit
import sys
import numpy as np
import torch.distributed as dist
import embedcore as ec
from embedcore.distributed import CollectiveMismatchError
from embedcore.adapters.torch import distributed as etd

def tower(value):  # each tower with its own init(): another TorchComm object over the one default group
    t = ec.TableConfig("emb", 4, 2, initializer=ec.initializers.Uniform(value, value), combiner="sum")
    return ec.Embedding({"ids": ec.FeatureConfig(t)}, world=etd.init(), sharding="row_wise")

# Registered before init(), so it runs after init()'s own exit hook (atexit is last in, first out).
atexit.register(lambda: print(f"AT EXIT rank {dist.get_rank() if dist.is_initialized() else r}: "
                              f"initialised={dist.is_initialized()}", flush=True))
user, item = tower(1.0), tower(5.0)
r = user.world.rank
first, second = (user, item) if r == 0 else (item, user)
x = {"ids": np.array([0, 3])}
try:
    a = first(x)["ids"]
    b = second(x)["ids"]
    print(f"NO ERROR rank {r}: user tower gave {(a if r == 0 else b).tolist()}", flush=True)
except CollectiveMismatchError as e:
    print(f"MISMATCH rank {r}: {e}", flush=True)
'''


def test_two_towers_each_with_its_own_init_called_in_different_orders_raise_a_mismatch(tmp_path):
    """init() returns a new TorchComm each call: the numbering of the
    embeddings (which makes each one's steps distinct) belongs to the process
    group, so two towers called in different orders on the two ranks raise
    CollectiveMismatchError instead of serving each other's rows."""
    script = tmp_path / "two_towers.py"
    script.write_text(TWO_TOWERS)
    out = _run_torchrun(script)
    assert "NO ERROR" not in out, out[-6000:]
    for r in (0, 1):
        assert (f"MISMATCH rank {r}: the ranks are in different collective calls (rank 0 in 'lookup: requests of "
                "embedding 0 (tables emb)', rank 1 in 'lookup: requests of embedding 1 (tables emb)')") in out, out
        # The group init() started was destroyed at exit, before the interpreter's teardown (a gloo group left
        # to it once aborted a rank there: "terminate called without an active exception").
        assert f"AT EXIT rank {r}: initialised=False" in out, out


def test_init_destroys_at_exit_only_the_group_it_started(tmp_path):
    """A group the script destroyed itself, and the one it started next, are
    not init()'s to end: the exit hook leaves the second one alone."""
    script = textwrap.dedent("""
        import atexit, os, sys
        import torch.distributed as dist
        from embedcore.adapters.torch import distributed as etd
        atexit.register(lambda: print("AT EXIT initialised", dist.is_initialized(), flush=True))
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
        etd.init()
        dist.destroy_process_group()
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[2], rank=0, world_size=1)
        print("second group started", flush=True)
    """)
    for attempt in range(2):
        r = subprocess.run([sys.executable, "-c", script, *map(str, _free_ports(2))], capture_output=True, text=True,
                           timeout=TIMEOUT_S)
        if "address already in use" not in r.stderr.lower():
            break  # (else a port was taken in between: once more on others)
    assert "second group started" in r.stdout, r.stdout + r.stderr
    assert "AT EXIT initialised True" in r.stdout, r.stdout + r.stderr  # (torch's own teardown ends it later)


def test_tables_of_a_model_with_a_sharded_collection_is_refused(tmp_path):
    """tables_of left a sharded collection out: ec.save(path, tables_of(model))
    saved the other modules' tables only, and a load restored none of it."""
    def fn(world):
        model = torch.nn.ModuleDict({
            "sharded": et.EmbeddingBagCollection(_tables(), optimizer=ec.optimizers.SGD(0.1), world=world,
                                                 sharding="row_wise"),
            "small": et.EmbeddingBag(4, 2, name="small")})
        with pytest.raises(ValueError, match=r"tables_of: 'sharded' is a ShardedEmbeddingBagCollection, whose "
                                             r"tables each rank holds a part of: save and load it with ec.save"):
            et.tables_of(model)
        ec.save(tmp_path / "sharded", model["sharded"])  # as the message says
        return True

    assert run_local(2, fn) == [True, True]
    assert sorted(ec.checkpoint.read_info(tmp_path / "sharded").table_names) == ["t1", "t2"]


@pytest.mark.parametrize("asked, group, matches", [
    ("gloo", "gloo", True), ("GLOO", "gloo", True), ("cpu:gloo", "gloo", True), ("oo", "gloo", False),
    ("nccl", "gloo", False), ("gloo", "cpu:gloo,cuda:nccl", True), ("cpu:gloo,cuda:nccl", "cpu:gloo,cuda:nccl", True),
    ("cpu:nccl", "cpu:gloo,cuda:nccl", False), ("cuda:gloo", "cpu:gloo,cuda:nccl", False)])
def test_init_backend_must_be_the_groups(asked, group, matches):
    """init(backend=) of an initialised group: each named backend is one of the
    group's, on the device it names (it compared substrings: "oo" passed)."""
    from embedcore.adapters.torch.distributed import _backend_matches

    assert _backend_matches(asked, group) is matches


@pytest.mark.parametrize("group, device", [("gloo", "cpu"), ("mpi", "cpu"), ("cpu:gloo,cuda:nccl", "cpu"),
                                           ("nccl", "cuda"), ("cuda:nccl", "cuda")])
def test_collectives_move_tensors_where_the_groups_backend_takes_them(monkeypatch, group, device):
    """A group with a CPU backend (gloo, MPI, a cpu: part) moves CPU tensors;
    an NCCL-only group, the current CUDA device's."""
    from embedcore.adapters.torch import distributed as d

    monkeypatch.setattr(d.dist, "get_backend", lambda group=None: group_name)
    monkeypatch.setattr(d.torch.cuda, "current_device", lambda: 0)
    group_name = group
    assert d._transport_device(None).type == device


@pytest.mark.parametrize("cls", ["EmbeddingBagCollection", "EmbeddingCollection"])
def test_a_sharded_collections_checkpoint_records_tables_as_the_unsharded_ones(tmp_path, cls):
    """A sharded collection saves its tables only, as an unsharded one does:
    not the engine's internal features ('c@t1' for a feature of two tables,
    sequence features as pooled rows), which a served collection would read
    wrongly. Served with tables=, it gives the trained module's outputs."""
    torchrec = pytest.importorskip("torchrec")
    pooled = cls == "EmbeddingBagCollection"
    config = (lambda: [et.EmbeddingBagConfig(30, 5, name="t1", feature_names=["a", "c"]),
                       et.EmbeddingBagConfig(20, 3, name="t2", feature_names=["b", "c"])]) if pooled else \
        (lambda: [et.EmbeddingConfig(30, 4, name="t1", feature_names=["a", "c"]),
                  et.EmbeddingConfig(20, 4, name="t2", feature_names=["b"])])
    kjt = torchrec.KeyedJaggedTensor.from_lengths_sync(keys=["a", "b", "c"], values=torch.tensor([1, 2, 3, 4, 5]),
                                                       lengths=torch.tensor([2, 1, 1, 0, 1, 0]))

    def fn(world):
        module = getattr(et, cls)(config(), world=world, sharding="row_wise")
        ec.save(tmp_path / "sharded", module)
        return module(kjt)

    out = run_local(2, fn)[0]
    assert json.loads(ec.checkpoint.read_info(tmp_path / "sharded").metadata_json) == {"kind": "table"}
    served_cls = getattr(et, "Served" + cls)
    with pytest.raises(ValueError, match="records tables, not features"):
        served_cls(tmp_path / "sharded")
    served = served_cls(tmp_path / "sharded", tables=config())(kjt)
    if pooled:
        assert served.keys() == out.keys()
        torch.testing.assert_close(served.values(), out.values(), rtol=0, atol=1e-6)
    else:
        assert sorted(served) == sorted(out)
        for k in out:
            torch.testing.assert_close(served[k].values(), out[k].values(), rtol=0, atol=0)
