"""A checkpoint from a newer writer whose tables use an optimizer this reader
does not know: its values serve, load without the optimizer, verify and
reshard; anything that needs the optimizer's state refuses it, naming the
optimizer, and changes nothing (docs/format.md, "Compatibility")."""
from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

import embedcore as ec
import embedcore.cli
from embedcore import distributed as dist
from test_checkpoint_forge import flip_byte, read_manifest, snapshot, assert_same_state, write_manifest

ROWS, DIM = 120, 6


def _tables():
    init = ec.initializers.Uniform(-1.0, 1.0, seed=3)
    a = ec.TableConfig("a", ROWS, DIM, initializer=init, optimizer=ec.optimizers.Adam(0.01), combiner="sum")
    r = ec.TableConfig("r", ROWS, DIM, initializer=init, optimizer=ec.optimizers.RowWiseAdagrad(0.1), combiner="mean")
    s = ec.TableConfig("s", ROWS, DIM, initializer=init, optimizer=ec.optimizers.SGD(0.1), combiner="sum")
    return {"fa": ec.FeatureConfig(a), "fr": ec.FeatureConfig(r), "fs": ec.FeatureConfig(s)}


def _by_name(emb):
    return {t.name: t for t in emb.embedding_tables.values()}


@pytest.fixture(scope="module")
def newer(tmp_path_factory):
    """A trained Embedding saved, then its manifest rewritten as a newer
    writer's: table 'a' (Adam's two full-width slots) has optimizer 'lamb'
    with slots 'm' and 'v' and an option no reader knows; table 'r' (one
    one-column slot) has 'rowwise_lion' with slot 'row_m'; 's' stays SGD."""
    emb = ec.Embedding(_tables())
    rng = np.random.default_rng(0)
    for _ in range(3):
        ids = {k: rng.integers(0, ROWS, 8) for k in ("fa", "fr", "fs")}
        out = emb(ids)
        emb.apply_gradients({k: rng.standard_normal(v.shape).astype(np.float32) for k, v in out.items()})
    path = tmp_path_factory.mktemp("newer") / "ckpt"
    ec.save(path, emb)
    m = read_manifest(path)
    t = {e["name"]: e for e in m["tables"]}
    t["a"]["optimizer"] = {"kind": "lamb", "learning_rate_schedule": "cosine", "beta_1": 0.9}
    t["a"]["slots"] = {"m": t["a"]["slots"]["momenta"], "v": t["a"]["slots"]["velocities"]}
    t["r"]["optimizer"] = {"kind": "rowwise_lion"}
    t["r"]["slots"] = {"row_m": t["r"]["slots"]["row_accumulators"]}
    write_manifest(path, m)
    values = {n: np.array(t.values()) for n, t in _by_name(emb).items()}
    return {"path": path, "values": values, "manifest": m}


@pytest.fixture
def ckpt(tmp_path, newer):
    dst = tmp_path / "ckpt"
    shutil.copytree(newer["path"], dst)
    return dst


def _files(path):
    return {n: os.path.getsize(os.path.join(path, n)) for n in sorted(os.listdir(path))}


def test_serves_and_verifies(ckpt, newer, capsys):
    for verify in (True, "eager", False):
        srv = ec.serving.open(ckpt, verify=verify)
        ids = np.array([0, 5, 5, 119], np.int64)
        offsets = np.array([0, 1, 4])
        for name, combiner in (("a", "sum"), ("r", "mean"), ("s", "sum")):
            v = newer["values"][name]
            want = np.stack([v[[0]].sum(0), v[[5, 5, 119]].sum(0) / (3 if combiner == "mean" else 1)])
            np.testing.assert_allclose(srv.tables[name].lookup(ids, offsets), want, rtol=1e-6)
        got = srv({"fa": np.array([7]), "fr": np.array([8]), "fs": np.array([9])})
        np.testing.assert_array_equal(got["fa"][0], newer["values"]["a"][7])
    # verify reads the unknown optimizer's slot files too: every checksum.
    assert embedcore.cli.main(["verify", str(ckpt)]) == 0
    assert embedcore.cli.main(["inspect", str(ckpt)]) == 0
    out = capsys.readouterr().out
    assert "lamb" in out and "rowwise_lion" in out


@pytest.mark.parametrize("slot", [("a", "v"), ("r", "row_m")])
def test_verify_checks_the_unknown_optimizers_slots(ckpt, newer, capsys, slot):
    table, name = slot
    entry = next(t for t in newer["manifest"]["tables"] if t["name"] == table)
    f = entry["slots"][name][0]["path"]
    flip_byte(ckpt / f, 4096 + 5)
    assert embedcore.cli.main(["verify", str(ckpt)]) == 1
    assert f in capsys.readouterr().err


def test_loads_values_only_and_refuses_the_optimizer_state(ckpt, newer):
    emb = ec.Embedding(_tables())
    tables = _by_name(emb)
    before = {n: snapshot(t) for n, t in tables.items()}
    with pytest.raises(ec.CheckpointError, match=r"'a' was saved with optimizer 'lamb'.*include_optimizer=False"):
        ec.load(ckpt, into=emb)
    for n in ("a", "r", "s"):
        assert_same_state(tables[n], before[n], f"table {n} after a refused load")
    ec.load(ckpt, into=emb, include_optimizer=False)
    for n in ("a", "r", "s"):
        np.testing.assert_array_equal(tables[n].values(), newer["values"][n])
    # A single table: the same, and the row-wise one by its one-column slot.
    r = ec.Table(_tables()["fr"].table)
    with pytest.raises(ec.CheckpointError, match="'rowwise_lion'"):
        ec.load(ckpt, into=r)
    ec.load(ckpt, into=r, include_optimizer=False)
    np.testing.assert_array_equal(r.values(), newer["values"]["r"])


def test_sharded_values_only_load(ckpt, newer):
    def rank(world):
        emb = ec.Embedding(_tables(), world=world, sharding="row_wise")
        with pytest.raises(ec.CheckpointError, match="lamb"):
            ec.load(ckpt, into=emb)
        ec.load(ckpt, into=emb, include_optimizer=False)
        return emb({"fa": np.arange(ROWS), "fr": np.arange(ROWS), "fs": np.arange(ROWS)})

    for out in dist.run_local(2, rank):
        np.testing.assert_array_equal(out["fa"], newer["values"]["a"])
        np.testing.assert_array_equal(out["fs"], newer["values"]["s"])


def test_reshard_takes_the_values_only_when_asked(ckpt, newer, tmp_path, capsys):
    dst = tmp_path / "out"
    with pytest.raises(ec.CheckpointError, match="lamb"):
        dist.reshard(ckpt, dst, 2, "row_wise")
    assert not os.path.exists(dst)
    dist.reshard(ckpt, dst, 2, "row_wise", include_optimizer=False)
    m = read_manifest(dst)
    assert all(t["optimizer"] is None and t["slots"] == {} and t["step"] == 0 for t in m["tables"])
    emb = ec.Embedding(_tables())
    ec.load(dst, into=emb)  # values-only: loads whatever the target's optimizer
    for n, t in _by_name(emb).items():
        np.testing.assert_array_equal(t.values(), newer["values"][n])
    # The command line: refused without --no-optimizer, taken with it.
    assert embedcore.cli.main(["reshard", str(ckpt), str(tmp_path / "cli"), "--world", "3"]) == 1
    assert "lamb" in capsys.readouterr().err and not os.path.exists(tmp_path / "cli")
    assert embedcore.cli.main(["reshard", str(ckpt), str(tmp_path / "cli"), "--world", "3", "--no-optimizer"]) == 0
    srv = ec.serving.open(tmp_path / "cli")
    np.testing.assert_array_equal(srv.tables["r"].lookup(np.arange(ROWS), combiner=None), newer["values"]["r"])


def test_saver_refuses_to_drop_the_state_it_cannot_keep(ckpt):
    before = _files(ckpt)
    manifest = (ckpt / "MANIFEST").read_bytes()
    other = ec.Table(name="other", rows=10, dim=DIM, optimizer=ec.optimizers.Adagrad(0.1))
    with pytest.raises(ec.CheckpointError, match=r"dump_to_file keeps the other tables.*'lamb'"):
        ec.Saver().dump_to_file(other, str(ckpt))
    assert _files(ckpt) == before and (ckpt / "MANIFEST").read_bytes() == manifest


@pytest.mark.parametrize("label,forge,match", [
    ("a slot wider than the table", lambda e: e["slots"]["m"][0].update(cols=DIM + 1), "cols"),
    ("a slot stored as float16", lambda e: e["slots"]["m"][0].update(
        dtype="float16", bytes=4096 + ROWS * DIM * 2), "must be float32"),
    ("a slot with no files", lambda e: e["slots"].update(m=[]), "non-empty array"),
    ("a slot whose files leave rows out", lambda e: e["slots"]["m"][0].update(
        rows=ROWS - 1, bytes=4096 + (ROWS - 1) * DIM * 4), "cover"),
    ("a kind that is not a string", lambda e: e["optimizer"].update(kind=7), "kind"),
    ("an optimizer that is not an object", lambda e: e.update(optimizer="lamb"), "optimizer"),
], ids=lambda x: x if isinstance(x, str) else "")
def test_an_unknown_optimizers_entry_is_still_checked(ckpt, label, forge, match):
    m = read_manifest(ckpt)
    forge(next(t for t in m["tables"] if t["name"] == "a"))
    write_manifest(ckpt, m)
    with pytest.raises(ec.CheckpointError, match=match):
        ec.serving.open(ckpt)
    emb = ec.Embedding(_tables())
    with pytest.raises(ec.CheckpointError, match=match):
        ec.load(ckpt, into=emb, include_optimizer=False)


@pytest.mark.parametrize("config_initializer", [
    {"class": "Orthogonal", "gain": 2.0},  # a class this version lacks
    {"class": "Uniform", "minval": -1.0, "maxval": 1.0, "seed": 3, "dist_scale": 2.0},  # an argument it lacks
    7,  # nothing it can use
], ids=["class", "argument", "not-an-object"])
def test_an_initializer_this_reader_does_not_know(tmp_path, config_initializer):
    """A newer writer's initializer (a kind and arguments this version does
    not know, in the manifest and in the table's config) is only how the
    table was first filled: the checkpoint serves, verifies and loads, values
    and optimizer state, and a rewrite of it (reshard) keeps the initializer
    as written (docs/format.md, "Initializers a reader does not know")."""
    t = ec.Table(name="t", rows=ROWS, dim=DIM, optimizer=ec.optimizers.Adagrad(0.1), combiner="sum")
    t.apply_gradients(np.array([3, 4]), np.array([0, 2]), np.ones((1, DIM), np.float32))
    path = tmp_path / "ckpt"
    ec.save(path, t)
    m = read_manifest(path)
    m["tables"][0]["initializer"] = {"kind": "orthogonal", "gain": 2.0, "seed": 7}
    m["tables"][0]["config"]["initializer"] = config_initializer
    write_manifest(path, m)

    srv = ec.serving.open(path)
    np.testing.assert_array_equal(srv.tables["t"].values(), t.to_numpy())
    ids, offsets = np.array([3, 4, 5]), np.array([0, 2, 3])
    np.testing.assert_array_equal(srv.tables["t"].lookup(ids, offsets), t.lookup(ids, offsets))
    assert isinstance(srv.tables["t"].config.initializer, ec.initializers.TruncatedNormal)  # TableConfig's default
    assert ec.cli.main(["verify", str(path)]) == 0
    into = ec.Table(name="t", rows=ROWS, dim=DIM, optimizer=ec.optimizers.Adagrad(0.1), combiner="sum")
    ec.load(path, into=into)
    np.testing.assert_array_equal(into.to_numpy(), t.to_numpy())
    np.testing.assert_array_equal(into.slots()["accumulators"], t.slots()["accumulators"])
    assert into.step == t.step

    dist.reshard(path, tmp_path / "out", world_size=2)
    out = read_manifest(tmp_path / "out")
    assert out["tables"][0]["initializer"] == {"kind": "orthogonal", "gain": 2.0, "seed": 7}
    assert out["tables"][0]["config"]["initializer"] == config_initializer
    everything = np.arange(ROWS)  # one bag a row
    np.testing.assert_array_equal(ec.serving.open(tmp_path / "out").tables["t"].lookup(everything, np.arange(ROWS + 1)),
                                  t.to_numpy())


@pytest.mark.parametrize("kind", ["adagrad", "ftrl"])
def test_an_optimizer_record_of_an_earlier_version_still_rewrites(tmp_path, kind):
    """Records that earlier versions wrote and this one's tables refuse
    (accumulators from 0 beside a subnormal epsilon; FTRL's from a subnormal
    value: 0 where subnormals are flushed) still read, and rewrite (reshard,
    with and without the optimizer; a Saver keeping the table) with their
    record and stored slots as they were."""
    opt, patch = {
        "adagrad": (ec.optimizers.Adagrad(0.1, initial_accumulator_value=0.0, epsilon=1e-10),
                    {"adagrad_epsilon": 1e-40, "initial_accumulator_value": 0.0}),
        "ftrl": (ec.optimizers.FTRL(0.1), {"initial_accumulator_value": 1e-40}),
    }[kind]
    t = ec.Table(name="t", rows=8, dim=2, optimizer=opt)
    t.apply_gradients(np.array([1]), grads=np.ones((1, 2), np.float32))
    path = tmp_path / "ck"
    ec.save(path, t)
    m = read_manifest(path)
    m["tables"][0]["optimizer"].update(patch)
    write_manifest(path, m)
    assert ec.cli.main(["verify", str(path)]) == 0
    patch = {k: float(np.float32(v)) for k, v in patch.items()}  # (a rewrite records the engine's float32)
    dist.reshard(path, tmp_path / "out", world_size=2)
    out = read_manifest(tmp_path / "out")["tables"][0]
    assert {k: out["optimizer"][k] for k in patch} == patch
    into = ec.Table(name="t", rows=8, dim=2, optimizer=opt)
    ec.load(tmp_path / "out", into=into, include_optimizer=False)
    np.testing.assert_array_equal(into.to_numpy(), t.to_numpy())
    dist.reshard(path, tmp_path / "values", world_size=1, include_optimizer=False)
    ec.Saver().dump_to_file(ec.Table(name="other", rows=4, dim=2), str(path))  # keeps 't' as it was
    assert {k: read_manifest(path)["tables"][0]["optimizer"][k] for k in patch} == patch
