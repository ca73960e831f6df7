"""The golden checkpoints of format v1 (tests/golden/v1, written once by
make_golden.py and committed) load, bit for bit, in this version: ec.load
into tables built from the configs they record, and ec.serving.open.

If a test here fails after an engine change, the change broke reading
checkpoints users already have: fix the engine, never regenerate the goldens
(SHA256SUMS guards them)."""
from __future__ import annotations

import hashlib
import json
import os

import numpy as np
import pytest

import embedcore as ec

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "golden", "v1")
CHECKPOINTS = ["dtype_float32", "dtype_float16", "dtype_bfloat16", "opt_sgd", "opt_adagrad", "opt_adam", "opt_ftrl",
               "export_values_only", "export_bfloat16", "embedding"]
SLOTS = {"opt_sgd": [], "opt_adagrad": ["accumulators"], "opt_adam": ["momenta", "velocities"],
         "opt_ftrl": ["accumulators", "linears"], "dtype_float32": [], "dtype_float16": [], "dtype_bfloat16": [],
         "embedding": ["accumulators"], "export_values_only": [], "export_bfloat16": []}


def golden(name=""):
    return os.path.join(GOLDEN, name)


@pytest.fixture(scope="module")
def expected():
    with np.load(golden("expected.npz"), allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def _sums():
    out = {}
    with open(golden("SHA256SUMS")) as f:
        for line in f:
            digest, rel = line.rstrip("\n").split("  ", 1)
            out[rel] = digest
    return out


def test_sha256sums_match_every_golden_file():
    sums = _sums()
    assert "expected.npz" in sums
    for rel, digest in sums.items():
        with open(golden(rel), "rb") as f:
            assert hashlib.sha256(f.read()).hexdigest() == digest, (
                f"tests/golden/v1/{rel} changed: golden checkpoints must never be regenerated or edited")
    listed = {rel.split("/")[0] for rel in sums if "/" in rel}
    assert listed == set(CHECKPOINTS)
    for name in CHECKPOINTS:  # no file added to a golden checkpoint either
        on_disk = {f"{name}/{f}" for f in os.listdir(golden(name))}
        assert on_disk == {rel for rel in sums if rel.startswith(name + "/")}


def _tables_from_configs(info):
    """A fresh Table per table of the checkpoint, built from the config it records."""
    tables = []
    for i, name in enumerate(info.table_names):
        cfg = ec.checkpoint.config_from_json(json.loads(info.table_config_json(i)))
        assert cfg.name == name
        tables.append(ec.Table(cfg))
    return tables


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_golden_checkpoint_loads(name, expected):
    path = golden(name)
    info = ec.checkpoint.read_info(path)
    assert tuple(info.format_version) == (1, 0)
    assert info.generation == 1
    tables = _tables_from_configs(info)
    ec.load(path, into=tables if len(tables) > 1 else tables[0])
    for t in tables:
        prefix = f"{name}/{t.name}"
        values = expected[f"{prefix}/values"]
        np.testing.assert_array_equal(t.to_numpy(), values)
        if name != "export_bfloat16":  # the export's table is float32; its bits are of the rounded values
            v = np.asarray(t.values())
            bits = v.view(np.uint16) if v.dtype.itemsize == 2 else v.view(np.uint32)
            assert bits.tobytes() == expected[f"{prefix}/bits"].tobytes()
        assert sorted(t.slots()) == sorted(SLOTS[name]) or name.startswith("export")
        if name.startswith("export"):
            assert not info.table_has_optimizer(0)
            assert t.step == 0  # a values-only checkpoint leaves the optimizer state as it was
            continue
        assert info.table_has_optimizer(info.table_names.index(t.name))
        assert t.step == int(expected[f"{prefix}/step"])
        for slot in SLOTS[name]:
            assert t.slots()[slot].tobytes() == expected[f"{prefix}/slot/{slot}"].tobytes(), (name, t.name, slot)


@pytest.mark.parametrize("name", CHECKPOINTS)
@pytest.mark.parametrize("verify", ["eager", "lazy"])
def test_golden_checkpoint_serves(name, verify, expected):
    served = ec.serving.open(golden(name), verify=verify)
    assert served.format_version == (1, 0)
    for t in served.tables.values():
        prefix = f"{name}/{t.name}"
        raw = np.asarray(t.values())
        bits = raw.view(np.uint16) if raw.dtype.itemsize == 2 else raw.view(np.uint32)
        assert bits.tobytes() == expected[f"{prefix}/bits"].tobytes()
        ids = np.arange(t.rows)
        np.testing.assert_array_equal(t.lookup(ids, combiner=None), expected[f"{prefix}/values"])
        offsets = np.array([0, 2, 2, t.rows])
        pooled = t.lookup(ids, offsets, combiner="sum")
        np.testing.assert_allclose(pooled[0], expected[f"{prefix}/values"][:2].sum(0), rtol=1e-6)


def _features(expected):
    return {"user": expected["embedding/inputs/user"], "item": expected["embedding/inputs/item"],
            "history": ec.Ragged(expected["embedding/inputs/history_ids"],
                                 expected["embedding/inputs/history_offsets"])}


def _rebuild(structure, features):
    if "dict" in structure:
        return {k: _rebuild(v, features) for k, v in structure["dict"].items()}
    if "list" in structure:
        return [_rebuild(v, features) for v in structure["list"]]
    if "tuple" in structure:
        return tuple(_rebuild(v, features) for v in structure["tuple"])
    return features[structure["feature"]]


def test_golden_embedding_rebuilds_and_looks_up(expected):
    path = golden("embedding")
    info = ec.checkpoint.read_info(path)
    meta = json.loads(info.metadata_json)
    assert meta["kind"] == "embedding"
    assert {(f["name"], f["table"], f["max_sequence_length"]) for f in meta["features"]} == {
        ("user", "user", 0), ("item", "item", 0), ("history", "item", 3)}
    configs = {}
    for i, name in enumerate(info.table_names):
        configs[name] = ec.checkpoint.config_from_json(json.loads(info.table_config_json(i)))
    features = [ec.FeatureConfig(configs[f["table"]], f["max_sequence_length"], f["name"]) for f in meta["features"]]
    emb = ec.Embedding(_rebuild(meta["structure"], features))
    ec.load(path, into=emb)
    got = emb(_features(expected))
    served = ec.serving.open(path, verify="eager")(_features(expected))
    assert sorted(got) == ["history", "item", "user"]
    for k in got:
        np.testing.assert_array_equal(got[k], expected[f"embedding/lookup/{k}"])
        np.testing.assert_array_equal(served[k], expected[f"embedding/lookup/{k}"])
    assert got["history"].shape == (5, 3, 4)
    # Training resumes from the golden state: the optimizer and step come back.
    for t in emb.embedding_tables.values():
        assert t.step == int(expected[f"embedding/{t.name}/step"]) == 3
        assert isinstance(t.optimizer, ec.optimizers.Adagrad)


def test_golden_optimizer_configs_round_trip():
    """The hyper-parameters recorded in each golden checkpoint rebuild the
    same optimizer (the config JSON is part of the format)."""
    want = {
        "opt_sgd": (ec.optimizers.SGD, {"learning_rate": 0.05, "clipvalue": (-1.5, 1.5)}),
        "opt_adagrad": (ec.optimizers.Adagrad, {"learning_rate": 0.1, "initial_accumulator_value": 0.2}),
        "opt_adam": (ec.optimizers.Adam, {"learning_rate": 0.01, "beta_1": 0.8, "beta_2": 0.95,
                                          "bias_correction": True}),
        "opt_ftrl": (ec.optimizers.FTRL, {"learning_rate": 0.2, "l1_regularization_strength": 0.01,
                                          "l2_regularization_strength": 0.02, "beta": 0.1}),
    }
    for name, (cls, fields) in want.items():
        info = ec.checkpoint.read_info(golden(name))
        cfg = ec.checkpoint.config_from_json(json.loads(info.table_config_json(0)))
        assert type(cfg.optimizer) is cls, name
        for k, v in fields.items():
            got = getattr(cfg.optimizer, k)
            assert (tuple(got) if isinstance(got, list) else got) == v, (name, k, got)


# ---------------------------------------------------------------- format 1.1 and 1.2 (tests/golden/v1_2)
GOLDEN_12 = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "golden", "v1_2")
CHECKPOINTS_12 = ["adagrad_epsilon", "row_wise", "column_wise", "int_keys"]


@pytest.fixture(scope="module")
def expected_12():
    with np.load(os.path.join(GOLDEN_12, "expected.npz"), allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def test_v1_2_sha256sums_match_every_golden_file():
    sums = {}
    with open(os.path.join(GOLDEN_12, "SHA256SUMS")) as f:
        for line in f:
            digest, rel = line.rstrip("\n").split("  ", 1)
            sums[rel] = digest
    for rel, digest in sums.items():
        with open(os.path.join(GOLDEN_12, rel), "rb") as f:
            assert hashlib.sha256(f.read()).hexdigest() == digest, (
                f"tests/golden/v1_2/{rel} changed: golden checkpoints must never be regenerated or edited")
    assert {rel.split("/")[0] for rel in sums if "/" in rel} == set(CHECKPOINTS_12)
    for name in CHECKPOINTS_12:
        on_disk = {f"{name}/{f}" for f in os.listdir(os.path.join(GOLDEN_12, name))}
        assert on_disk == {rel for rel in sums if rel.startswith(name + "/")}


@pytest.mark.parametrize("name", ["adagrad_epsilon", "row_wise", "column_wise"])
def test_v1_2_golden_checkpoint_loads_whole_and_serves(name, expected_12):
    """Into unsharded tables built from the recorded configs: the values,
    slots and step the training ranks held, bit for bit; and served."""
    path = os.path.join(GOLDEN_12, name)
    info = ec.checkpoint.read_info(path)
    assert tuple(info.format_version) == (1, 2)
    tables = _tables_from_configs(info)
    ec.load(path, into=tables if len(tables) > 1 else tables[0])
    served = ec.serving.open(path, verify="eager")
    for t in tables:
        prefix = f"{name}/{t.name}"
        assert t.to_numpy().tobytes() == expected_12[f"{prefix}/values"].tobytes(), prefix
        slots = sorted(k.split("/")[-1] for k in expected_12 if k.startswith(prefix + "/slot/"))
        assert sorted(t.slots()) == slots == ["accumulators"]
        assert t.slots()["accumulators"].tobytes() == expected_12[f"{prefix}/slot/accumulators"].tobytes(), prefix
        assert t.step == int(expected_12[f"{prefix}/step"]) == 3
        ids = np.arange(t.rows)
        np.testing.assert_array_equal(served.tables[t.name].lookup(ids, combiner=None), expected_12[f"{prefix}/values"])
    if name == "adagrad_epsilon":  # format 1.1: epsilon outside the square root, restored with the optimizer
        assert tables[0].optimizer.epsilon == pytest.approx(1e-3)


def _loaded_shards(path, world, plan, slot):
    """Every rank's (shard, values, `slot`, step) of each table, by table
    name, after `world` ranks built an Embedding from the checkpoint's
    recorded configs, sharded by `plan`, and loaded it."""
    import embedcore.distributed as dist

    info = ec.checkpoint.read_info(path)
    configs = {n: ec.checkpoint.config_from_json(json.loads(info.table_config_json(i)))
               for i, n in enumerate(info.table_names)}

    def rank_main(comm):
        emb = ec.Embedding({n: ec.FeatureConfig(c) for n, c in configs.items()}, world=comm, sharding=plan)
        ec.load(path, into=emb)
        return {n: [(s, np.array(t.to_numpy()), np.array(t.slots()[slot]), t.step) for s, t in shards]
                for n, shards in emb.local_shards.items()}

    return dist.run_local(world, rank_main)


@pytest.mark.parametrize("name", ["row_wise", "column_wise"])
@pytest.mark.parametrize("world, plan", [(3, "row_wise"), (2, "column_wise"), (1, "table_wise")])
def test_v1_2_sharded_golden_loads_on_other_worlds_and_plans(name, world, plan, expected_12):
    for part in _loaded_shards(os.path.join(GOLDEN_12, name), world, plan, "accumulators"):
        for n, shards in part.items():
            for s, values, acc, step in shards:
                block = (slice(s.row_start, s.row_start + s.rows), slice(s.col_start, s.col_start + s.cols))
                assert values.tobytes() == expected_12[f"{name}/{n}/values"][block].tobytes(), (n, s)
                assert acc.tobytes() == expected_12[f"{name}/{n}/slot/accumulators"][block].tobytes(), (n, s)
                assert step == 3


def test_v1_2_int_keys_golden_serves_its_feature_config(expected_12):
    served = ec.serving.open(os.path.join(GOLDEN_12, "int_keys"))
    assert list(served.feature_config) == [3, 1]
    inputs = {3: expected_12["int_keys/inputs/3"], 1: [expected_12["int_keys/inputs/1"]]}
    got = served(inputs)
    np.testing.assert_array_equal(got[3], expected_12["int_keys/lookup/3"])
    np.testing.assert_array_equal(got[1][0], expected_12["int_keys/lookup/1/0"])


# ---------------------------------------------------------------- format 1.3 (tests/golden/v1_3)
GOLDEN_13 = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "golden", "v1_3")


@pytest.fixture(scope="module")
def expected_13():
    with np.load(os.path.join(GOLDEN_13, "expected.npz"), allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def test_v1_3_sha256sums_match_every_golden_file():
    with open(os.path.join(GOLDEN_13, "SHA256SUMS")) as f:
        sums = dict(reversed(line.rstrip("\n").split("  ", 1)) for line in f)
    for rel, digest in sums.items():
        with open(os.path.join(GOLDEN_13, rel), "rb") as f:
            assert hashlib.sha256(f.read()).hexdigest() == digest, (
                f"tests/golden/v1_3/{rel} changed: golden checkpoints must never be regenerated or edited")
    on_disk = {f"rowwise_adagrad/{f}" for f in os.listdir(os.path.join(GOLDEN_13, "rowwise_adagrad"))}
    assert on_disk | {"expected.npz"} == set(sums)


def test_v1_3_rowwise_adagrad_golden_loads_whole_and_serves(expected_13):
    """Row-wise Adagrad's [rows, 1] accumulators, saved by 2 row-wise ranks:
    loaded into unsharded tables built from the recorded configs, bit for bit."""
    path = os.path.join(GOLDEN_13, "rowwise_adagrad")
    info = ec.checkpoint.read_info(path)
    assert tuple(info.format_version) == (1, 3)
    tables = _tables_from_configs(info)
    assert all(type(t.optimizer) is ec.optimizers.RowWiseAdagrad for t in tables)
    assert tables[0].optimizer.epsilon == pytest.approx(1e-6)
    ec.load(path, into=tables)
    served = ec.serving.open(path, verify="eager")
    for t in tables:
        prefix = f"rowwise_adagrad/{t.name}"
        assert t.to_numpy().tobytes() == expected_13[f"{prefix}/values"].tobytes(), prefix
        acc = expected_13[f"{prefix}/slot/row_accumulators"]
        assert acc.shape == (t.rows, 1) and t.slots()["row_accumulators"].tobytes() == acc.tobytes(), prefix
        assert t.step == int(expected_13[f"{prefix}/step"]) == 3
        np.testing.assert_array_equal(served.tables[t.name].lookup(np.arange(t.rows), combiner=None),
                                      expected_13[f"{prefix}/values"])


@pytest.mark.parametrize("world, plan", [(3, "row_wise"), (1, "table_wise")])
def test_v1_3_rowwise_adagrad_golden_loads_on_other_worlds(world, plan, expected_13):
    for part in _loaded_shards(os.path.join(GOLDEN_13, "rowwise_adagrad"), world, plan, "row_accumulators"):
        for n, shards in part.items():
            for s, values, acc, step in shards:
                rows = slice(s.row_start, s.row_start + s.rows)
                assert values.tobytes() == expected_13[f"rowwise_adagrad/{n}/values"][rows].tobytes(), (n, s)
                assert acc.tobytes() == expected_13[f"rowwise_adagrad/{n}/slot/row_accumulators"][rows].tobytes()
                assert step == 3


# ---------------------------------------------------------------- format 1.4 (tests/golden/v1_4)
GOLDEN_14 = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "golden", "v1_4")


@pytest.fixture(scope="module")
def expected_14():
    with np.load(os.path.join(GOLDEN_14, "expected.npz"), allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def test_v1_4_sha256sums_match_every_golden_file():
    with open(os.path.join(GOLDEN_14, "SHA256SUMS")) as f:
        sums = dict(reversed(line.rstrip("\n").split("  ", 1)) for line in f)
    for rel, digest in sums.items():
        with open(os.path.join(GOLDEN_14, rel), "rb") as f:
            assert hashlib.sha256(f.read()).hexdigest() == digest, (
                f"tests/golden/v1_4/{rel} changed: golden checkpoints must never be regenerated or edited")
    on_disk = {f"uint8_rowwise/{f}" for f in os.listdir(os.path.join(GOLDEN_14, "uint8_rowwise"))}
    assert on_disk | {"expected.npz"} == set(sums)


def test_v1_4_uint8_rowwise_golden_holds_fbgemm_s_rows_loads_and_serves(expected_14):
    """uint8_rowwise values files (FBGEMM's rows, bit for bit) saved by 2
    row-wise ranks with Adagrad's slots: served dequantized, and loaded into
    tables of the recorded configs (float32 and float16), slots bit for bit."""
    path = os.path.join(GOLDEN_14, "uint8_rowwise")
    info = ec.checkpoint.read_info(path)
    assert tuple(info.format_version) == (1, 4)
    manifest = json.loads(info.manifest_json)
    for t in manifest["tables"]:
        name = t["name"]
        rows = b"".join(open(os.path.join(path, f["path"]), "rb").read()[4096:]
                        for f in sorted(t["values"], key=lambda f: f["row_start"]))
        assert {f["dtype"] for f in t["values"]} == {"uint8_rowwise"} and len(t["values"]) == 2
        assert rows == expected_14[f"uint8_rowwise/{name}/fbgemm_rows"].tobytes(), name
    tables = _tables_from_configs(info)
    assert {t.name: t.dtype for t in tables} == {"user": "float32", "item": "float16"}
    ec.load(path, into=tables)
    served = ec.serving.open(path, verify="eager")
    for t in tables:
        prefix = f"uint8_rowwise/{t.name}"
        deq = expected_14[f"{prefix}/fbgemm_dequantized"]
        assert served.tables[t.name].dtype == "uint8_rowwise"
        assert served.tables[t.name].values().tobytes() == deq.tobytes(), prefix
        want = deq if t.dtype == "float32" else deq.astype(np.float16).astype(np.float32)
        assert t.to_numpy().tobytes() == want.tobytes(), prefix
        assert t.slots()["accumulators"].tobytes() == expected_14[f"{prefix}/slot/accumulators"].tobytes(), prefix
        assert t.step == int(expected_14[f"{prefix}/step"]) == 3
        one = served.tables[t.name].lookup(np.arange(t.rows), combiner=None)  # scale * code + bias: within an ulp
        np.testing.assert_allclose(one, deq, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("world, plan", [(3, "row_wise"), (2, "column_wise"), (1, "table_wise")])
def test_v1_4_uint8_rowwise_golden_loads_on_other_worlds(world, plan, expected_14):
    for part in _loaded_shards(os.path.join(GOLDEN_14, "uint8_rowwise"), world, plan, "accumulators"):
        for n, shards in part.items():
            deq = expected_14[f"uint8_rowwise/{n}/fbgemm_dequantized"]
            if n == "item":
                deq = deq.astype(np.float16).astype(np.float32)
            for s, values, acc, step in shards:
                block = (slice(s.row_start, s.row_start + s.rows), slice(s.col_start, s.col_start + s.cols))
                assert values.astype(np.float32).tobytes() == np.ascontiguousarray(deq[block]).tobytes(), (n, s)
                assert acc.tobytes() == np.ascontiguousarray(
                    expected_14[f"uint8_rowwise/{n}/slot/accumulators"][block]).tobytes()
                assert step == 3


# ---------------------------------------------------------------- format 1.5 (tests/golden/v1_5)
GOLDEN_15 = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "golden", "v1_5")


@pytest.fixture(scope="module")
def expected_15():
    with np.load(os.path.join(GOLDEN_15, "expected.npz"), allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def test_v1_5_sha256sums_match_every_golden_file():
    with open(os.path.join(GOLDEN_15, "SHA256SUMS")) as f:
        sums = dict(reversed(line.rstrip("\n").split("  ", 1)) for line in f)
    for rel, digest in sums.items():
        with open(os.path.join(GOLDEN_15, rel), "rb") as f:
            assert hashlib.sha256(f.read()).hexdigest() == digest, (
                f"tests/golden/v1_5/{rel} changed: golden checkpoints must never be regenerated or edited")
    on_disk = {f"padding_idx/{f}" for f in os.listdir(os.path.join(GOLDEN_15, "padding_idx"))}
    assert on_disk | {"expected.npz"} == set(sums)


def test_v1_5_padding_idx_golden_serves_torch_s_bags(expected_15):
    """Tables of PyTorch modules made with padding_idx (config.padding_idx):
    served bags leave the padding id out as torch.nn.EmbeddingBag does (a
    padding row that is not zero), per-id lookups give the padding rows as
    torch.nn.Embedding does; values load into tables of the same padding_idx."""
    path = os.path.join(GOLDEN_15, "padding_idx")
    info = ec.checkpoint.read_info(path)
    assert tuple(info.format_version) == (1, 5)
    served = ec.serving.open(path, verify="eager")
    bag, seq = served.tables["bag"], served.tables["seq"]
    assert (bag.padding_idx, seq.padding_idx) == (2, 0)
    e = expected_15
    np.testing.assert_allclose(bag.lookup(e["ids"], e["offsets"]), e["bag/torch_mean"], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(bag.lookup(e["ids"], e["offsets"], e["weights"], combiner="sum"),
                               e["bag/torch_sum_weighted"], rtol=1e-6, atol=1e-6)
    assert not bag.lookup(e["ids"], e["offsets"])[2].any()  # padding ids only
    np.testing.assert_array_equal(seq.lookup(e["seq_ids"], combiner=None), e["seq/torch_rows"])
    for name in ("bag", "seq"):
        t = ec.Table(name=name, rows=served.tables[name].rows, dim=served.tables[name].dim)
        with pytest.raises(ec.CheckpointError, match=f"table '{name}' was saved with padding_idx"):
            ec.load(path, into=t)
        t._padding_idx = served.tables[name].padding_idx  # as a PyTorch module made with it gives its table
        ec.load(path, into=t)
        assert t.to_numpy().tobytes() == e[f"{name}/values"].tobytes()
