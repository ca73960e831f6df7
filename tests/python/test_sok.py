"""SOK dumps (v1 and v2, written by hand here) converted with
``embedcore convert --from sok`` and ``ec.sok.convert``: every dumped row
lands at its key, optimizer slots come along, and bad dumps are refused."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import embedcore as ec
import embedcore.cli

V2_CODES = {"int32": 0, "int64": 1, "uint32": 2, "uint64": 3, "float16": 4, "float32": 5, "float64": 6}
KEY, VALUES, STATE = 0, 1, 2


# ------------------------------------------------------------------ writing dumps
def write_v1(src, var, keys, values):
    os.makedirs(src, exist_ok=True)
    np.asarray(keys).astype(np.asarray(keys).dtype.newbyteorder("<")).tofile(os.path.join(src, f"{var}_keys.file"))
    np.asarray(values, "<f4").tofile(os.path.join(src, f"{var}_values.file"))


def v2_header(name: str, kind: int, slot: str, dtype: str, nul_pad: bool = False) -> bytes:
    """As SOK 2.x's dump_load.write_file_head writes it: the name fields
    right-justified with leading spaces (``rjust(n, " ")``); `nul_pad`
    pads them with trailing NULs instead (other writers)."""
    if nul_pad:
        h = name.encode().ljust(256, b"\0") + kind.to_bytes(4, "big") + slot.encode().ljust(32, b"\0")
    else:
        h = name.rjust(256, " ").encode() + kind.to_bytes(4, "big") + slot.rjust(32, " ").encode()
    h += V2_CODES[dtype].to_bytes(4, "big")
    assert len(h) == 296
    return h


def write_v2_file(path, name, kind, slot, array, dtype, nul_pad=False):
    data = np.ascontiguousarray(np.asarray(array).astype(np.dtype(dtype).newbyteorder("<")))
    with open(path, "wb") as f:
        f.write(v2_header(name, kind, slot, dtype, nul_pad) + data.tobytes())


def write_v2(src, var, keys, values, key_dtype="int64", value_dtype="float32", optimizer=None, slots=None,
             nul_pad=False):
    # SOK leaves the embedding-name field empty (all spaces); the slot name is the optimizer's.
    os.makedirs(src, exist_ok=True)
    write_v2_file(os.path.join(src, f"{var}-key"), "", KEY, "", keys, key_dtype, nul_pad)
    write_v2_file(os.path.join(src, f"{var}-weight"), "", VALUES, "", values, value_dtype, nul_pad)
    for slot, arr in (slots or {}).items():
        write_v2_file(os.path.join(src, f"{var}-{optimizer}-{slot}"), "", STATE, slot, arr, "float32", nul_pad)


def random_rows(rng, rows, n, dim):
    """n distinct keys below `rows`, in random order, and their values."""
    keys = np.append(rng.permutation(rows - 1)[:n - 1], rows - 1)  # rows - 1 is there: the table has `rows` rows
    rng.shuffle(keys)
    return keys, rng.standard_normal((n, dim)).astype(np.float32)


def run_cli(*args):
    env = dict(os.environ, SKBUILD_EDITABLE_VERBOSE="0")
    return subprocess.run([sys.executable, "-m", "embedcore", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=120)


def loaded(dst, name, rows, dim, optimizer=None):
    t = ec.Table(name=name, rows=rows, dim=dim, optimizer=optimizer,
                 initializer=ec.initializers.Constant(123.0))  # so rows the load misses show
    ec.load(dst, into=t)
    return t


def assert_rows_at_keys(table, keys, values):
    v = table.to_numpy()
    np.testing.assert_array_equal(v[keys], values)
    missing = np.setdiff1d(np.arange(table.rows), keys)
    assert (v[missing] == 0).all(), "rows without a key must be zero"


# ------------------------------------------------------------------ v1
def test_v1_int64_keys_via_the_cli_and_the_api(tmp_path, rng):
    keys, values = random_rows(rng, 200, 70, 5)
    write_v1(tmp_path / "sok", "emb", keys.astype(np.int64), values)

    r = run_cli("convert", "--from", "sok", tmp_path / "sok", tmp_path / "cli")
    assert r.returncode == 0, r.stderr
    assert "emb" in r.stdout and str(tmp_path / "cli") in r.stdout
    assert r.stderr == ""  # no progress bar when stderr is not a terminal
    assert_rows_at_keys(loaded(tmp_path / "cli", "emb", 200, 5), keys, values)

    assert ec.sok.convert(tmp_path / "sok", tmp_path / "api") == ["emb"]
    assert_rows_at_keys(loaded(tmp_path / "api", "emb", 200, 5), keys, values)
    served = ec.serving.open(tmp_path / "api", verify="eager").tables["emb"]
    np.testing.assert_array_equal(served.lookup(keys, combiner=None), values)


def test_v1_uint32_keys(tmp_path, rng):
    keys, values = random_rows(rng, 1000, 301, 4)  # 301 keys: 1204 bytes, not whole int64s
    write_v1(tmp_path / "sok", "u", keys.astype(np.uint32), values)
    assert ec.sok.convert(tmp_path / "sok", tmp_path / "out") == ["u"]
    assert_rows_at_keys(loaded(tmp_path / "out", "u", 1000, 4), keys, values)


def test_v1_rows_option(tmp_path, rng):
    keys, values = random_rows(rng, 50, 20, 3)
    write_v1(tmp_path / "sok", "e", keys.astype(np.int64), values)
    r = run_cli("convert", "--from", "sok", tmp_path / "sok", tmp_path / "out", "--rows", 64)
    assert r.returncode == 0, r.stderr
    assert_rows_at_keys(loaded(tmp_path / "out", "e", 64, 3), keys, values)
    assert embedcore.cli.main(["convert", "--from", "sok", str(tmp_path / "sok"), str(tmp_path / "o2"),
                               "--rows", "49"]) == 1  # key 49 does not fit 49 rows


def test_v1_ambiguous_sizes_need_dim(tmp_path, rng, capsys):
    """40 int64 keys and 40 x 6 floats are also 80 uint32 keys of dim 3."""
    keys, values = random_rows(rng, 100, 40, 6)
    write_v1(tmp_path / "sok", "amb", keys.astype(np.int64), values)

    r = run_cli("convert", "--from", "sok", tmp_path / "sok", tmp_path / "out")
    assert r.returncode == 1
    assert "amb_keys.file" in r.stderr and "dim" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "out" / "MANIFEST").exists()
    with pytest.raises(ec.CheckpointError, match="dim"):
        ec.sok.convert(tmp_path / "sok", tmp_path / "out")

    r = run_cli("convert", "--from", "sok", tmp_path / "sok", tmp_path / "out", "--dim", 6)
    assert r.returncode == 0, r.stderr
    assert_rows_at_keys(loaded(tmp_path / "out", "amb", 100, 6), keys, values)

    assert embedcore.cli.main(["convert", "--from", "sok", str(tmp_path / "sok"), str(tmp_path / "o2"),
                               "--key-dtype", "int64"]) == 0
    assert_rows_at_keys(loaded(tmp_path / "o2", "amb", 100, 6), keys, values)
    assert ec.sok.convert(tmp_path / "sok", tmp_path / "o3", dim=6) == ["amb"]
    assert_rows_at_keys(loaded(tmp_path / "o3", "amb", 100, 6), keys, values)
    with pytest.raises(ec.CheckpointError, match="dim 7"):
        ec.sok.convert(tmp_path / "sok", tmp_path / "o4", dim=7)  # fits neither


# ------------------------------------------------------------------ v2
@pytest.mark.parametrize("key_dtype", ["int64", "uint64", "int32", "uint32"])
@pytest.mark.parametrize("value_dtype", ["float32", "float16", "float64"])
def test_v2_keys_and_weights_of_every_dtype(tmp_path, rng, key_dtype, value_dtype):
    keys, values = random_rows(rng, 300, 90, 7)
    values = values.astype(value_dtype).astype(np.float32)  # exactly representable in the dump's dtype
    write_v2(tmp_path / "sok", "var", keys, values, key_dtype, value_dtype)
    assert ec.sok.convert(tmp_path / "sok", tmp_path / "out") == ["var"]
    assert_rows_at_keys(loaded(tmp_path / "out", "var", 300, 7), keys, values)


@pytest.mark.parametrize("where, bad, dtype, why", [
    ("weight", np.inf, "float32", "inf of key 9 (column 1) is not finite"),
    ("weight", 1e300, "float64", "1e+300 of key 9 (column 1) overflows float32"),
    ("Adagrad-accumulator", np.nan, "float32", "nan of key 9 (column 1) is not finite"),
    ("v1", -np.inf, "float32", "-inf of key 9 (column 1) is not finite"),
])
def test_values_a_checkpoint_cannot_hold_are_refused_naming_the_key_and_file(tmp_path, where, bad, dtype, why):
    """A value or slot that is not finite (or a float64 past float32's range)
    is refused as the dump is read, naming its file, key and column, before
    anything is written (a checkpoint holds finite values only)."""
    keys = np.array([5, 9, 2])
    values = np.arange(9, dtype=np.float64).reshape(3, 3)  # dim 3: v1 sizes fit int64 keys only
    acc = np.ones((3, 3))
    (acc if where == "Adagrad-accumulator" else values)[1, 1] = bad
    if where == "v1":
        write_v1(tmp_path / "sok", "emb", keys.astype(np.int64), values.astype(np.float32))
        file = "emb_values.file"
    else:
        os.makedirs(tmp_path / "sok")
        write_v2_file(tmp_path / "sok" / "emb-key", "", KEY, "", keys, "int64")
        write_v2_file(tmp_path / "sok" / "emb-weight", "", VALUES, "", values, dtype)
        write_v2_file(tmp_path / "sok" / "emb-Adagrad-accumulator", "", STATE, "accumulator", acc, "float32")
        file = f"emb-{where}"
    with pytest.raises(ec.CheckpointError) as e:
        ec.sok.convert(tmp_path / "sok", tmp_path / "out")
    assert f"{tmp_path / 'sok' / file}: the value {why}" in str(e.value), str(e.value)
    assert not os.path.lexists(tmp_path / "out")


@pytest.mark.parametrize("optimizer, slot, ours, bad", [("Adam", "v", "velocities", -1.0),
                                                      ("Adagrad", "accumulator", "accumulators", -0.5)])
def test_slot_values_the_optimizer_refuses_are_refused_naming_the_key_and_file(tmp_path, optimizer, slot, ours, bad):
    """A slot value outside the optimizer's domain (a negative velocity or
    accumulator, whose square root the step takes) is refused as a
    CheckpointError naming the dump file, the key and the column, as a value
    that is not finite is (it was a ValueError naming an index into an
    internal block of rows); nothing is written."""
    keys = np.array([1000, 1005, 1003])
    os.makedirs(tmp_path / "sok")
    write_v2_file(tmp_path / "sok" / "emb-key", "", KEY, "", keys, "int64")
    write_v2_file(tmp_path / "sok" / "emb-weight", "", VALUES, "", np.ones((3, 2)), "float32")
    state = np.ones((3, 2))
    state[1, 1] = bad
    slots = {"m": np.zeros((3, 2)), "v": state} if optimizer == "Adam" else {slot: state}
    for name, values in slots.items():
        write_v2_file(tmp_path / "sok" / f"emb-{optimizer}-{name}", "", STATE, name, values, "float32")
    with pytest.raises(ec.CheckpointError) as e:
        ec.sok.convert(tmp_path / "sok", tmp_path / "out")
    assert (f"{tmp_path / 'sok' / f'emb-{optimizer}-{slot}'}: key 1005 (column 1): slot {ours} of {optimizer} must "
            f"be >= 0 (the step divides by its square root), got {bad}") in str(e.value), str(e.value)
    assert not os.path.lexists(tmp_path / "out")


@pytest.mark.parametrize("kw, error, match", [
    (dict(dim="4"), TypeError, "dim must be an int, got '4'"),
    (dict(dim=0), ValueError, "dim must be >= 1, got 0"),
    (dict(rows="9"), TypeError, "rows for SOK variable 'emb' must be a positive int, got '9'"),
    (dict(rows=0), ValueError, "rows for SOK variable 'emb' must be a positive int, got 0"),
    (dict(names={"emb": 5}), TypeError, "the table name for SOK variable 'emb' must be a non-empty str, got 5"),
])
def test_convert_arguments_of_the_wrong_type_or_value(tmp_path, kw, error, match):
    """A wrong type is a TypeError, a wrong value a ValueError, each naming
    it (dim="4" was said not to fit dim 4, and rows="9" was a ValueError),
    and nothing is written."""
    keys = np.array([0, 7, 3], np.int64)
    write_v1(tmp_path / "sok", "emb", keys, np.ones((3, 4), np.float32))
    with pytest.raises(error, match=re.escape(match)):
        ec.sok.convert(tmp_path / "sok", tmp_path / "out", key_dtype="int64", **kw)
    assert not os.path.lexists(tmp_path / "out")


def test_v2_adam_slots(tmp_path, rng):
    keys, values = random_rows(rng, 128, 40, 8)
    m = rng.standard_normal((40, 8)).astype(np.float32)
    v = rng.random((40, 8)).astype(np.float32)
    write_v2(tmp_path / "sok", "emb", keys, values, optimizer="Adam", slots={"m": m, "v": v})

    r = run_cli("convert", "--from", "sok", tmp_path / "sok", tmp_path / "out")
    assert r.returncode == 0, r.stderr
    t = loaded(tmp_path / "out", "emb", 128, 8, ec.optimizers.Adam(0.01))
    assert_rows_at_keys(t, keys, values)
    slots = t.slots()
    np.testing.assert_array_equal(slots["momenta"][keys], m)
    np.testing.assert_array_equal(slots["velocities"][keys], v)
    missing = np.setdiff1d(np.arange(128), keys)
    assert (slots["momenta"][missing] == 0).all() and (slots["velocities"][missing] == 0).all()
    info = ec.checkpoint.read_info(tmp_path / "out")
    assert info.table_has_optimizer(0)
    # The optimizer recorded is the Keras Adam that SOK 2.x wraps: bias-corrected, epsilon outside the root.
    adam = json.loads(info.table_config_json(0))["optimizer"]
    assert (adam["class"], adam["bias_correction"], adam["sum_inside_sqrt"], adam["epsilon"]) == \
        ("Adam", True, False, pytest.approx(1e-7))


def test_v2_adagrad_slot_keeps_the_initial_accumulator_elsewhere(tmp_path, rng):
    keys, values = random_rows(rng, 64, 10, 4)
    acc = rng.random((10, 4)).astype(np.float32) + 0.5
    write_v2(tmp_path / "sok", "emb", keys, values, optimizer="Adagrad", slots={"accum": acc})
    assert ec.sok.convert(tmp_path / "sok", tmp_path / "out") == ["emb"]
    t = loaded(tmp_path / "out", "emb", 64, 4, ec.optimizers.Adagrad(0.1))
    np.testing.assert_array_equal(t.slots()["accumulators"][keys], acc)
    missing = np.setdiff1d(np.arange(64), keys)
    np.testing.assert_array_equal(t.slots()["accumulators"][missing], np.float32(0.1))


@pytest.mark.parametrize("optimizer, slots, match", [
    ("Adagrad", {"acc": 100.0}, r"emb-Adagrad-acc: Adagrad slot 'acc' of SOK variable 'emb' is none of"),
    ("Adam", {"m": 1.0}, r"the dump holds Adam slot\(s\) \['m'\] \(.*emb-Adam-m\) but not velocities, which "
                          r"Adam needs"),
    ("RMSprop", {"ms": 1.0}, r"optimizer RMSprop \(slots in .*emb-RMSprop-ms\) has no embedcore equivalent"),
    ("Adam", {"m": 1.0, "momenta": 2.0, "v": 3.0}, r"slots 'm' and 'momenta' are both Adam's momenta"),
], ids=["unknown slot", "missing slot", "unknown optimizer", "two files of one slot"])
def test_v2_optimizer_state_is_never_dropped_silently(tmp_path, rng, optimizer, slots, match):
    # Slots that would be lost, or left at their initial values, fail the conversion (naming the files)
    # and write nothing; --no-optimizer (include_optimizer=False) takes the values alone.
    keys, values = random_rows(rng, 16, 5, 4)
    write_v2(tmp_path / "sok", "emb", keys, values, optimizer=optimizer,
             slots={k: values + x for k, x in slots.items()})
    with pytest.raises(ec.CheckpointError, match=match + r".*include_optimizer=False \(--no-optimizer\)"):
        ec.sok.convert(tmp_path / "sok", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    r = run_cli("convert", "--from", "sok", tmp_path / "sok", tmp_path / "out")
    assert r.returncode == 1 and "CheckpointError" in r.stderr and not (tmp_path / "out").exists()
    r = run_cli("convert", "--from", "sok", "--no-optimizer", tmp_path / "sok", tmp_path / "out")
    assert r.returncode == 0, r.stderr
    assert json.loads(ec.checkpoint.read_info(tmp_path / "out").manifest_json)["tables"][0]["slots"] == {}
    assert_rows_at_keys(loaded(tmp_path / "out", "emb", 16, 4), keys, values)


def test_several_variables_v1_and_v2_in_one_dump(tmp_path, rng, capsys):
    k1, v1 = random_rows(rng, 30, 12, 3)
    k2, v2 = random_rows(rng, 40, 25, 5)
    write_v1(tmp_path / "sok", "first", k1.astype(np.int64), v1)
    write_v2(tmp_path / "sok", "second", k2, v2)
    assert embedcore.cli.main(["convert", "--from", "sok", str(tmp_path / "sok"), str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "2 SOK variable(s)" in out and "first" in out and "second" in out
    assert sorted(ec.checkpoint.read_info(tmp_path / "out").table_names) == ["first", "second"]
    assert_rows_at_keys(loaded(tmp_path / "out", "first", 30, 3), k1, v1)
    assert_rows_at_keys(loaded(tmp_path / "out", "second", 40, 5), k2, v2)


def test_read_dump_returns_the_variables(tmp_path, rng):
    keys, values = random_rows(rng, 20, 7, 2)
    write_v2(tmp_path / "sok", "x", keys, values, optimizer="Adam", slots={"m": values, "v": values})
    (var,) = ec.sok.read_dump(tmp_path / "sok").values()
    assert var.name == "x" and var.optimizer == "Adam" and sorted(var.slots) == ["m", "v"]
    np.testing.assert_array_equal(var.keys, keys)
    np.testing.assert_array_equal(var.values, values)


# ------------------------------------------------------------------ bad dumps
def _v2_good(src, rng):
    keys, values = random_rows(rng, 20, 6, 4)
    write_v2(src, "bad", keys, values)
    return keys, values


def _truncate(path, n):
    def f(src):
        os.truncate(os.path.join(src, path), n)
    return f


def _rewrite_header(path, kind=None, code=None):
    def f(src):
        p = os.path.join(src, path)
        raw = bytearray(open(p, "rb").read())
        if kind is not None:
            raw[256:260] = kind.to_bytes(4, "big")
        if code is not None:
            raw[292:296] = code.to_bytes(4, "big")
        open(p, "wb").write(bytes(raw))
    return f


def _append(path, data):
    def f(src):
        with open(os.path.join(src, path), "ab") as fh:
            fh.write(data)
    return f


def _replace(path, name, kind, dtype, array):
    def f(src):
        write_v2_file(os.path.join(src, path), name, kind, "", np.asarray(array), dtype)
    return f


BAD_V2 = [
    ("truncated key header", _truncate("bad-key", 100), "truncated"),
    ("empty weight file", _truncate("bad-weight", 0), "truncated"),
    ("key file says values", _rewrite_header("bad-key", kind=1), "kind"),
    ("weight file says optimizer state", _rewrite_header("bad-weight", kind=2), "kind"),
    ("kind in little-endian", _rewrite_header("bad-key", kind=0x01000000), "kind"),
    ("unknown dtype code", _rewrite_header("bad-weight", code=9), "dtype"),
    ("dtype code in little-endian", _rewrite_header("bad-weight", code=0x05000000), "dtype"),
    ("a partial float", _append("bad-weight", b"\1\2"), "bad-weight"),
    ("weights not a whole number of rows", _append("bad-weight", b"\0" * 4), "rows"),
    ("float keys", _replace("bad-key", "bad", KEY, "float32", np.arange(6)), "integers"),
    ("negative key", _replace("bad-key", "bad", KEY, "int64", [0, 1, 2, -3, 4, 5]), "negative"),
    ("duplicate keys", _replace("bad-key", "bad", KEY, "int64", [0, 1, 2, 4, 2, 5]),
     "bad-key: key 2 is dumped twice (at positions 2 and 4)"),
    ("uint64 key past int64", _replace("bad-key", "bad", KEY, "uint64", [0, 1, 2, 3, 4, 2**63 + 5]), "fit"),
    ("weight file missing", lambda src: os.unlink(os.path.join(src, "bad-weight")), "bad-weight"),
    ("slot of another size", _replace("bad-Adam-m", "bad", STATE, "float32", np.zeros(5)), "bad-Adam-m"),
    ("integer weights", _replace("bad-weight", "bad", VALUES, "int32", np.zeros((6, 4))), "must be floats"),
    ("a slot of a second optimizer", _replace("bad-Adagrad-accum", "bad", STATE, "float32", np.zeros((6, 4))),
     "keep one optimizer's files"),
    ("two files of one slot",  # the header names the slot: bad-Adam-m2 says it is "m" too
     lambda src: write_v2_file(os.path.join(src, "bad-Adam-m2"), "bad", STATE, "m", np.zeros((6, 4)), "float32"),
     "a second file of slot 'm'"),
    ("dumped as v1 and v2", lambda src: write_v1(src, "bad", np.arange(6), np.zeros((6, 3))), "dumped twice"),
]


@pytest.mark.parametrize("label,damage,match", BAD_V2, ids=[x[0] for x in BAD_V2])
def test_bad_v2_dumps_are_refused(tmp_path, rng, capsys, label, damage, match):
    src = tmp_path / "sok"
    _v2_good(src, rng)
    if "slot" in label:
        write_v2_file(src / "bad-Adam-m", "bad", STATE, "m", np.zeros((6, 4)), "float32")
    damage(str(src))
    with pytest.raises(ec.CheckpointError) as e:
        ec.sok.convert(src, tmp_path / "out")
    assert match in str(e.value), str(e.value)
    assert not (tmp_path / "out" / "MANIFEST").exists()
    assert embedcore.cli.main(["convert", "--from", "sok", str(src), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("embedcore convert: CheckpointError:") and match in err


BAD_V1 = [
    ("values file missing", lambda src: os.unlink(os.path.join(src, "v_values.file")), "v_values.file"),
    ("a partial float", _append("v_values.file", b"\1"), "float32"),
    ("sizes that fit no key dtype", _append("v_keys.file", b"\1\2\3"), "do not fit"),
    ("negative key", lambda src: np.array([0, -1, 2], "<i8").tofile(os.path.join(src, "v_keys.file")), "negative"),
    ("keys without values", _truncate("v_values.file", 0), "empty, but"),
    ("values without keys", _truncate("v_keys.file", 0), "no keys, but"),
]


def test_an_empty_v1_dump_needs_no_key_dtype(tmp_path):
    write_v1(tmp_path / "sok", "e", np.zeros(0, np.int64), np.zeros((0, 3), np.float32))
    assert ec.sok.read_dump(tmp_path / "sok", dim=3)["e"].values.shape == (0, 3)


@pytest.mark.parametrize("label,damage,match", BAD_V1, ids=[x[0] for x in BAD_V1])
def test_bad_v1_dumps_are_refused(tmp_path, capsys, label, damage, match):
    src = tmp_path / "sok"
    write_v1(src, "v", np.array([0, 1, 2], np.int64), np.ones((3, 5), np.float32))
    damage(str(src))
    with pytest.raises(ec.CheckpointError, match=match):
        ec.sok.convert(src, tmp_path / "out")
    assert embedcore.cli.main(["convert", "--from", "sok", str(src), str(tmp_path / "out")]) == 1
    assert match in capsys.readouterr().err


def test_not_a_sok_dump(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ec.CheckpointError, match="no SOK dump files"):
        ec.sok.convert(tmp_path / "empty", tmp_path / "out")
    with pytest.raises(ec.CheckpointError, match="not a directory"):
        ec.sok.convert(tmp_path / "absent", tmp_path / "out")
    r = run_cli("convert", "--from", "sok", tmp_path / "empty", tmp_path / "out")
    assert r.returncode == 1
    assert r.stderr.startswith("embedcore convert: CheckpointError:") and "no SOK dump files" in r.stderr
    assert "Traceback" not in r.stderr
    r = run_cli("convert", "--from", "nope", tmp_path / "empty", tmp_path / "out")
    assert r.returncode == 2  # argparse: an unknown --from


def test_v2_variable_names_that_prefix_each_other(tmp_path, rng):
    """Variables "emb" and "emb-b", each with Adam slots: the files
    emb-b-Adam-m / -v belong to "emb-b", not to "emb"."""
    k1, v1 = random_rows(rng, 30, 10, 4)
    k2, v2 = random_rows(rng, 30, 10, 4)
    m1, m2 = np.full((10, 4), 1.0, np.float32), np.full((10, 4), 2.0, np.float32)
    write_v2(tmp_path / "sok", "emb", k1, v1, optimizer="Adam", slots={"m": m1, "v": m1})
    write_v2(tmp_path / "sok", "emb-b", k2, v2, optimizer="Adam", slots={"m": m2, "v": m2})
    variables = ec.sok.read_dump(tmp_path / "sok")
    assert sorted(variables) == ["emb", "emb-b"]
    assert variables["emb"].optimizer == "Adam" and variables["emb-b"].optimizer == "Adam"
    np.testing.assert_array_equal(variables["emb"].slots["m"], m1)
    np.testing.assert_array_equal(variables["emb-b"].slots["m"], m2)


def test_a_hashed_key_asks_for_rows(tmp_path, rng, capsys):
    """SOK keys are often 64-bit hashes: a key far above the number of keys
    would make a table of terabytes. The import refuses it, saying why and
    what to pass, before it allocates; with rows= it is a plain bound check."""
    keys = np.array([3, 2**40, 7], np.int64)
    write_v2(tmp_path / "sok", "h", keys, rng.standard_normal((3, 8)).astype(np.float32))
    with pytest.raises(ec.CheckpointError, match=r"key 1099511627776 makes a table of 1099511627777 rows x 8 "
                                                 r"\(32768\.0 GiB\) for 3 keys; .*rows="):
        ec.sok.convert(tmp_path / "sok", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert embedcore.cli.main(["convert", "--from", "sok", str(tmp_path / "sok"), str(tmp_path / "out")]) == 1
    assert "pass rows= (--rows)" in capsys.readouterr().err
    with pytest.raises(ec.CheckpointError, match="key 1099511627776 >= rows 100"):
        ec.sok.convert(tmp_path / "sok", tmp_path / "out", rows=100)


def test_sparse_keys_over_a_large_table_fill_it_block_by_block(tmp_path, rng):
    """Keys spread over a table larger than one 64 MiB fill block (and a row
    range with no key at all): every row lands at its key, the rest stay zero
    (values) or at the initial accumulator (Adagrad), with no copy of the
    whole table."""
    rows, dim = 600_000, 32  # 73 MiB: two fill blocks
    keys = np.concatenate([rng.choice(100_000, 500, replace=False),
                           599_999 - rng.choice(np.arange(1, 50_000), 300, replace=False), [599_999]])
    rng.shuffle(keys)
    values = rng.standard_normal((keys.size, dim)).astype(np.float32)
    acc = rng.random((keys.size, dim)).astype(np.float32) + 1
    write_v2(tmp_path / "sok", "big", keys, values, optimizer="Adagrad", slots={"accum": acc})
    (table,) = ec.sok.to_tables(ec.sok.read_dump(tmp_path / "sok"))
    assert table.rows == rows
    assert_rows_at_keys(table, keys, values)
    slot = table.slots()["accumulators"]
    np.testing.assert_array_equal(slot[keys], acc)
    initial = ec.Table(name="i", rows=1, dim=dim, optimizer=ec.optimizers.Adagrad()).slots()["accumulators"][0]
    missing = np.setdiff1d(np.arange(rows), keys)
    np.testing.assert_array_equal(slot[missing], np.broadcast_to(initial, (missing.size, dim)))


def test_v2_adagrad_accumulators_of_0_convert_as_keras_adagrads(tmp_path, rng):
    """SOK's Adagrad is Keras's, which adds epsilon (1e-7) and so may hold
    accumulators of 0: they convert (into Adagrad(epsilon=1e-7)); a load
    into an Adagrad with epsilon 0, whose step would divide 0 by 0, refuses
    them, and include_optimizer=False takes the values."""
    keys, values = random_rows(rng, 64, 10, 4)
    acc = rng.random((10, 4)).astype(np.float32)
    acc[2, 1] = 0.0
    write_v2(tmp_path / "sok", "emb", keys, values, optimizer="Adagrad", slots={"accum": acc})
    assert ec.sok.convert(tmp_path / "sok", tmp_path / "out") == ["emb"]
    t = loaded(tmp_path / "out", "emb", 64, 4, ec.optimizers.Adagrad(0.1, epsilon=1e-7))
    np.testing.assert_array_equal(t.slots()["accumulators"][keys], acc)
    strict = ec.Table(name="emb", rows=64, dim=4, optimizer=ec.optimizers.Adagrad(0.1))
    with pytest.raises(ec.CheckpointError, match="slot accumulators hold 0 at row .* needs them >= 1.17549435e-38"):
        ec.load(tmp_path / "out", into=strict)
    ec.load(tmp_path / "out", into=strict, include_optimizer=False)


def test_v2_adagrad_resumes_with_keras_s_epsilon(tmp_path, rng):
    """The converted checkpoint records the optimizer SOK's Adagrad is:
    Keras's, whose epsilon is keras.optimizers.Adagrad's default (1e-7), and
    a table built from the recorded config and loaded takes Keras's step
    (its ApplyAdagradV2: ``a += g^2; w -= lr * g / (sqrt(a) + epsilon)``),
    from accumulators of 0 too, where epsilon is half the denominator."""
    import inspect

    keras = pytest.importorskip("keras")
    epsilon = inspect.signature(keras.optimizers.Adagrad).parameters["epsilon"].default
    keys, values = random_rows(rng, 64, 10, 4)
    acc = rng.random((10, 4)).astype(np.float32) + 0.05
    acc[:3] = 0.0
    write_v2(tmp_path / "sok", "emb", keys, values, optimizer="Adagrad", slots={"accum": acc})
    (converted,) = ec.sok.to_tables(ec.sok.read_dump(tmp_path / "sok"))
    assert type(converted.optimizer) is ec.optimizers.Adagrad and converted.optimizer.epsilon == epsilon
    ec.sok.convert(tmp_path / "sok", tmp_path / "out")
    info = ec.checkpoint.read_info(tmp_path / "out")
    cfg = ec.checkpoint.config_from_json(json.loads(info.table_config_json(0)))
    assert type(cfg.optimizer) is ec.optimizers.Adagrad and cfg.optimizer.epsilon == epsilon
    t = ec.Table(cfg)
    ec.load(tmp_path / "out", into=t)
    g = rng.standard_normal((10, 4)).astype(np.float32)
    g[:3] *= np.float32(1e-7)  # gradients of epsilon's size where the accumulators are 0
    t.apply_gradients(keys, grads=g)
    a = acc.astype(np.float64) + np.float64(g) ** 2
    lr = float(np.float32(cfg.optimizer.learning_rate))
    want = values - lr * np.float64(g) / (np.sqrt(a) + float(np.float32(epsilon)))
    np.testing.assert_allclose(t.to_numpy()[keys], want, rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(t.slots()["accumulators"][keys], a, rtol=1e-6, atol=0)


# ------------------------------------------------------------------ SOK 2.x headers as SOK writes them
def test_v2_headers_space_padded_as_sok_writes_them(tmp_path, rng):
    # dump_load.write_file_head right-justifies the names with spaces ("      m"); read_file_head strips them.
    keys, values = random_rows(rng, 10, 10, 4)
    m, v = rng.standard_normal((10, 4)).astype(np.float32), rng.random((10, 4)).astype(np.float32)
    write_v2(tmp_path / "sok", "Variable_0", keys, values, optimizer="Adam", slots={"m": m, "v": v})
    assert open(tmp_path / "sok" / "Variable_0-Adam-m", "rb").read(296)[260:292] == b" " * 31 + b"m"
    var = ec.sok.read_dump(tmp_path / "sok")["Variable_0"]
    assert sorted(var.slots) == ["m", "v"] and var.name == "Variable_0"
    assert ec.sok.convert(tmp_path / "sok", tmp_path / "out") == ["Variable_0"]
    t = loaded(tmp_path / "out", "Variable_0", 10, 4, ec.optimizers.Adam(0.1))
    np.testing.assert_array_equal(t.slots()["momenta"][keys], m)
    np.testing.assert_array_equal(t.slots()["velocities"][keys], v)


def test_v2_headers_nul_padded(tmp_path, rng):
    keys, values = random_rows(rng, 12, 6, 3)
    acc = rng.random((6, 3)).astype(np.float32)
    write_v2(tmp_path / "sok", "emb", keys, values, optimizer="Adagrad", slots={"accumulator": acc}, nul_pad=True)
    assert open(tmp_path / "sok" / "emb-Adagrad-accumulator", "rb").read(296)[260:292].endswith(b"\0")
    assert ec.sok.convert(tmp_path / "sok", tmp_path / "out") == ["emb"]
    t = loaded(tmp_path / "out", "emb", 12, 3, ec.optimizers.Adagrad(0.1))
    np.testing.assert_array_equal(t.slots()["accumulators"][keys], acc)


# ------------------------------------------------------------------ files of no variable
ORPHANS = [
    ("v2 weight and slot without key",
     lambda src, rng: (write_v2(src, "item", np.arange(6), np.ones((6, 4), np.float32), optimizer="Adagrad",
                                slots={"accumulator": np.ones((6, 4), np.float32)}), os.unlink(src / "item-key")),
     ["item-Adagrad-accumulator", "item-weight"]),
    ("v1 values without keys",
     lambda src, rng: np.ones((6, 4), "<f4").tofile(src / "item_values.file"), ["item_values.file"]),
    ("v2 slot of no variable",  # a renamed variable's slot file
     lambda src, rng: write_v2_file(src / "usr-Adagrad-accumulator", "", STATE, "accumulator",
                                    np.ones((8, 4)), "float32"),
     ["usr-Adagrad-accumulator"]),
]


@pytest.mark.parametrize("label,make,files", ORPHANS, ids=[x[0] for x in ORPHANS])
def test_files_of_no_variable_are_refused(tmp_path, rng, capsys, label, make, files):
    src = tmp_path / "sok"
    write_v2(src, "user", np.arange(8), np.ones((8, 4), np.float32))
    (src / "notes.txt").write_text("not a dump file")  # other files are left alone
    make(src, rng)
    for include_optimizer in (True, False):
        with pytest.raises(ec.CheckpointError, match="belong to no dumped variable") as e:
            ec.sok.convert(src, tmp_path / "out", include_optimizer=include_optimizer)
        assert f"file(s) {', '.join(files)} belong" in str(e.value)  # these, and no other
    assert not (tmp_path / "out").exists()
    assert embedcore.cli.main(["convert", "--from", "sok", "--no-optimizer", str(src), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert all(f in err for f in files)


# ------------------------------------------------------------------ dim, rows and names per table
def test_v2_dim_is_checked(tmp_path, rng):
    keys, values = random_rows(rng, 10, 5, 4)
    write_v2(tmp_path / "sok", "emb", keys, values)
    assert ec.sok.read_dump(tmp_path / "sok", dim=4)["emb"].values.shape == (5, 4)
    with pytest.raises(ec.CheckpointError, match=r"emb-weight: rows of 4 values .*dim=8"):
        ec.sok.convert(tmp_path / "sok", tmp_path / "out", dim=8)
    assert not (tmp_path / "out").exists()


def test_rows_and_names_per_table(tmp_path, rng, capsys):
    ku, vu = random_rows(rng, 901, 300, 8)
    ki, vi = random_rows(rng, 41, 30, 8)
    write_v2(tmp_path / "sok", "user_0", ku, vu)
    write_v2(tmp_path / "sok", "item_0", ki, vi)
    names = ec.sok.convert(tmp_path / "sok", tmp_path / "out", rows={"user_0": 1000, "item_0": 50},
                           names={"item_0": "item"})
    assert sorted(names) == ["item", "user_0"]
    assert_rows_at_keys(loaded(tmp_path / "out", "user_0", 1000, 8), ku, vu)
    assert_rows_at_keys(loaded(tmp_path / "out", "item", 50, 8), ki, vi)
    # A dict may leave variables out (largest key + 1); a name of no variable is refused.
    ec.sok.convert(tmp_path / "sok", tmp_path / "out2", rows={"item_0": 50})
    info = ec.checkpoint.read_info(tmp_path / "out2")
    assert dict(zip(info.table_names, [info.table_shape(i) for i in range(2)])) == {"user_0": (901, 8),
                                                                                  "item_0": (50, 8)}
    with pytest.raises(ec.CheckpointError, match="no SOK variable named 'items_0'"):
        ec.sok.convert(tmp_path / "sok", tmp_path / "out3", rows={"items_0": 50})
    with pytest.raises(ValueError, match="would both become table 'user_0'"):
        ec.sok.convert(tmp_path / "sok", tmp_path / "out3", names={"item_0": "user_0"})
    assert not (tmp_path / "out3").exists()

    # CLI: --rows NAME=N (repeatable), a plain --rows N for the others, --rename NAME=TABLE.
    assert embedcore.cli.main(["convert", "--from", "sok", str(tmp_path / "sok"), str(tmp_path / "cli"),
                               "--rows", "item_0=50", "--rows", "1000", "--rename", "user_0=user"]) == 0
    info = ec.checkpoint.read_info(tmp_path / "cli")
    assert dict(zip(info.table_names, [info.table_shape(i) for i in range(2)])) == {"user": (1000, 8),
                                                                                  "item_0": (50, 8)}
    assert embedcore.cli.main(["convert", "--from", "sok", str(tmp_path / "sok"), str(tmp_path / "cli2"),
                               "--rows", "1000"]) == 0  # one number for every table, as before
    assert ec.checkpoint.read_info(tmp_path / "cli2").table_shape(0) == (1000, 8)
    capsys.readouterr()
    for bad in (["--rows", "item_0=x"], ["--rows", "5", "--rows", "6"], ["--rename", "user"]):
        assert embedcore.cli.main(["convert", "--from", "sok", str(tmp_path / "sok"), str(tmp_path / "bad"),
                                   *bad]) == 2
        assert bad[0] in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()


# ------------------------------------------------------------------ values-only conversions
def test_to_tables_checks_a_hand_made_variable():
    """to_tables is public: a SokVariable made by hand with a negative key
    ("rows must be >= 1, got 0"), more keys than values (NumPy's
    IndexError), 1-D values ("tuple index out of range") or a list of
    variables ("unhashable type") is refused naming the variable."""
    V = ec.sok.SokVariable
    for v, error, match in [
            (V("emb", np.array([-1, 3]), np.ones((2, 2), np.float32)), ValueError, "negative key -1"),
            (V("emb", np.array([1, 2]), np.ones((1, 2), np.float32)), ValueError, "2 keys and 1 rows of values"),
            (V("emb", np.array([1]), np.ones(2, np.float32)), TypeError, "values must be a 2-D float array"),
            (V("emb", np.array([1.5]), np.ones((1, 2), np.float32)), TypeError, "keys must be a 1-D integer"),
            (V("emb", [1], np.ones((1, 2), np.float32)), TypeError, "keys must be a NumPy array, got list"),
            (V("emb", np.array([1, 2]), np.ones((2, 2), np.float32), "Adagrad", {"accumulator": np.ones((1, 2))}),
             ValueError, r"slot 'accumulator' must be a float array of the values' shape \(2, 2\), got float64 of "
                         r"shape \(1, 2\)"),
    ]:
        with pytest.raises(error, match=rf"SOK variable 'emb': {match}"):
            ec.sok.to_tables({"emb": v})
    with pytest.raises(TypeError, match="variables must be a dict of SokVariable"):
        ec.sok.to_tables([V("emb", np.array([1]), np.ones((1, 2), np.float32))])


def test_conversions_without_slots_are_values_only(tmp_path, rng):
    """A dump without slot files (SGD), or converted without them, loads into
    a table of any optimizer, which keeps its own slots."""
    keys, values = random_rows(rng, 6, 6, 2)
    acc = rng.random((6, 2)).astype(np.float32)
    write_v2(tmp_path / "sgd", "emb", keys, values)
    write_v2(tmp_path / "adagrad", "emb", keys, values, optimizer="Adagrad", slots={"accumulator": acc})
    ec.sok.convert(tmp_path / "sgd", tmp_path / "a")
    ec.sok.convert(tmp_path / "adagrad", tmp_path / "b", include_optimizer=False)
    assert run_cli("convert", "--from", "sok", "--no-optimizer", tmp_path / "adagrad", tmp_path / "c").returncode == 0
    for out in ("a", "b", "c"):
        assert not ec.checkpoint.read_info(tmp_path / out).table_has_optimizer(0)
        for opt in (ec.optimizers.Adagrad(0.1), ec.optimizers.Adam(0.1), None):
            t = loaded(tmp_path / out, "emb", 6, 2, opt)
            assert_rows_at_keys(t, keys, values)
            if isinstance(opt, ec.optimizers.Adagrad):
                np.testing.assert_array_equal(t.slots()["accumulators"], np.float32(0.1))
        t = ec.Table(name="emb", rows=6, dim=2, optimizer=ec.optimizers.Adagrad(0.1))
        assert ec.Saver().restore_from_file(t, tmp_path / out) == "OK"
        assert_rows_at_keys(t, keys, values)


def test_a_dump_of_tables_with_and_without_slots(tmp_path, rng):
    keys, values = random_rows(rng, 8, 8, 2)
    acc = rng.random((8, 2)).astype(np.float32) + 1
    write_v2(tmp_path / "sok", "a", keys, values, optimizer="Adagrad", slots={"accumulator": acc})
    write_v2(tmp_path / "sok", "b", keys, values)
    ec.sok.convert(tmp_path / "sok", tmp_path / "out")
    info = ec.checkpoint.read_info(tmp_path / "out")
    has = {n: info.table_has_optimizer(i) for i, n in enumerate(info.table_names)}
    assert has == {"a": True, "b": False}
    a = loaded(tmp_path / "out", "a", 8, 2, ec.optimizers.Adagrad(0.1))
    np.testing.assert_array_equal(a.slots()["accumulators"][keys], acc)
    assert_rows_at_keys(loaded(tmp_path / "out", "b", 8, 2, ec.optimizers.Adam(0.1)), keys, values)


FULL_DISK_CONVERT = r"""
import resource, signal, sys
import embedcore as ec

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, like a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
try:
    ec.sok.convert(sys.argv[1], sys.argv[2])
except OSError as e:
    print("failed:", e)
    sys.exit(0)
sys.exit(1)
"""


def test_a_conversion_of_tables_with_and_without_slots_that_fails_leaves_no_directory(tmp_path, rng):
    """A dump mixing variables with and without slots is written in one commit
    of its own; failing part way (a full disk: here a file-size limit), it
    removes the destination it made, as every failed save does."""
    keys, values = random_rows(rng, 100_000, 100_000, 16)  # 6.4 MB of values: past the 1 MiB limit
    write_v2(tmp_path / "sok", "a", keys[:8], values[:8], optimizer="Adagrad",
             slots={"accumulator": np.ones((8, 16), np.float32)})
    write_v2(tmp_path / "sok", "b", keys, values)
    res = subprocess.run([sys.executable, "-c", FULL_DISK_CONVERT, str(tmp_path / "sok"), str(tmp_path / "out")],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "failed:" in res.stdout, res.stdout + res.stderr
    assert not os.path.lexists(tmp_path / "out"), os.listdir(tmp_path / "out")


# ------------------------------------------------------------------ Saver, SOK 1.x style
def _table(name, rows, fill, optimizer="adagrad"):
    opt = {"adagrad": ec.optimizers.Adagrad(0.1), "adam": ec.optimizers.Adam(0.1), None: None}[optimizer]
    t = ec.Table(name=name, rows=rows, dim=4, optimizer=opt)
    t.assign(np.full((rows, 4), fill, np.float32), 0)
    if opt is not None:
        t.apply_gradients(np.array([1, 2]), np.array([0, 2]), np.ones((1, 4), np.float32))  # slot state, step 1
    return t


def test_saver_dumps_several_tables_into_one_directory(tmp_path):
    """SOK 1.x writes files per variable, so users dump each variable into
    one directory in a loop: every table stays there, with its slots."""
    saver, d = ec.Saver(), str(tmp_path / "ckpt")
    user, item, ctx = _table("user", 10, 1.0), _table("item", 20, 2.0, "adam"), _table("ctx", 5, 3.0, None)
    ec.save(tmp_path / "ctx_only", ctx, include_optimizer=False)
    for t in (user, item):
        assert saver.dump_to_file(t, d) == "OK"
    assert sorted(ec.checkpoint.read_info(d).table_names) == ["item", "user"]
    item.assign(np.full((20, 4), 5.0, np.float32), 0)  # a newer dump of item replaces it, user stays
    assert saver.dump_to_file(item, d) == "OK"
    assert saver.dump_to_file(ctx, d) == "OK"
    info = ec.checkpoint.read_info(d)
    assert sorted(info.table_names) == ["ctx", "item", "user"]
    for src in (user, item):
        dst = _table(src.name, src.rows, 0.0, "adam" if src.name == "item" else "adagrad")
        dst.assign(np.zeros((src.rows, 4), np.float32), 0)
        assert saver.restore_from_file(dst, d) == "OK"
        np.testing.assert_array_equal(dst.values(), src.values())
        for k, v in src.slots().items():
            np.testing.assert_array_equal(dst.slots()[k], v)
        assert dst.step == src.step == 1
    files = os.listdir(d)
    assert len(files) == 1 + 2 + 3 + 1  # MANIFEST, user (values, accumulators), item (+2 slots), ctx: no old files


def test_saver_dumps_again_keep_the_order_of_tables_and_features(tmp_path):
    """Dumping a variable again (SOK's loop over variables, each dumped in
    turn, on every save) keeps the tables and features in the checkpoint's
    order, so a server reloads the new dump (the C API's reload requires the
    same tables in the same order); new tables come last."""
    saver, d = ec.Saver(), str(tmp_path / "ckpt")
    a, b, c = _table("a", 10, 1.0), _table("b", 20, 2.0), _table("c", 5, 3.0)
    for t in (a, b, c):
        saver.dump_to_file(t, d)
    assert list(ec.checkpoint.read_info(d).table_names) == ["a", "b", "c"]
    for t in (a, b, c, b):  # each again, alone
        t.assign(np.full((t.rows, 4), 9.0, np.float32), 0)
        saver.dump_to_file(t, d)
        assert list(ec.checkpoint.read_info(d).table_names) == ["a", "b", "c"]
    saver.dump_to_file([c, _table("z", 3, 4.0), a], d)
    assert list(ec.checkpoint.read_info(d).table_names) == ["a", "b", "c", "z"]
    saver.dump_to_file([b, _table("z", 3, 5.0), c, a], d)  # all of them, in another order
    assert list(ec.checkpoint.read_info(d).table_names) == ["a", "b", "c", "z"]
    for t in (a, b, c):
        got = _table(t.name, t.rows, 0.0)
        saver.restore_from_file(got, d)
        np.testing.assert_array_equal(got.values(), t.values())

    def emb(*names):
        return ec.Embedding({n: ec.FeatureConfig(ec.TableConfig(n, 20, 4), name="f_" + n) for n in names},
                            ec.optimizers.SGD(0.1))

    e = str(tmp_path / "emb")
    for x in (emb("x1", "x2"), emb("y"), emb("w")):
        saver.dump_to_file(x, e)
    for x in (emb("y"), emb("x1", "x2"), emb("w", "v")):
        saver.dump_to_file(x, e)
    assert list(ec.checkpoint.read_info(e).table_names) == ["x1", "x2", "y", "w", "v"]
    assert [f.name for f in ec.serving.open(e).feature_config] == ["f_x1", "f_x2", "f_y", "f_w", "f_v"]


def test_saver_dump_keeps_other_tables_blockwise_and_stored_as_they_were(tmp_path):
    saver, d = ec.Saver(), str(tmp_path / "ckpt")
    big = _table("big", 1000, 0.0)
    big.assign(np.arange(4000, dtype=np.float32).reshape(1000, 4), 0)
    ec.save(d, big, values_dtype="float16")
    info = ec.checkpoint.read_info(d)
    saver._save_entries(d, [(_table("small", 3, 1.0), True)], True, {"kind": "table"}, max_block_bytes=1000)
    manifest = json.loads(ec.checkpoint.read_info(d).manifest_json)
    (entry,) = [t for t in manifest["tables"] if t["name"] == "big"]
    assert len(entry["values"]) > 1 and {f["dtype"] for f in entry["values"]} == {"float16"}
    back = _table("big", 1000, 9.0)
    ec.load(d, into=back)
    np.testing.assert_array_equal(back.values(), big.values().astype(np.float16).astype(np.float32))
    np.testing.assert_array_equal(back.slots()["accumulators"], big.slots()["accumulators"])
    assert info.generation < ec.checkpoint.read_info(d).generation


def test_saver_dump_is_atomic(tmp_path):
    saver, d = ec.Saver(), str(tmp_path / "ckpt")
    saver.dump_to_file(_table("user", 10, 1.0), d)
    manifest = open(os.path.join(d, "MANIFEST"), "rb").read()
    before = sorted(os.listdir(d))
    # A kept table that cannot be read back: the dump fails, the old checkpoint stays as it was.
    data = [f for f in before if f.startswith("t00000.values")][0]
    raw = bytearray(open(os.path.join(d, data), "rb").read())
    raw[-1] ^= 0xFF
    open(os.path.join(d, data), "wb").write(bytes(raw))
    with pytest.raises(ec.CheckpointError):
        saver.dump_to_file(_table("item", 5, 2.0), d)
    assert sorted(os.listdir(d)) == before and open(os.path.join(d, "MANIFEST"), "rb").read() == manifest
    # A MANIFEST that cannot be read: refused (its tables would be lost), nothing written.
    open(os.path.join(d, "MANIFEST"), "wb").write(b"garbage")
    with pytest.raises(ec.CheckpointError, match="cannot be read.*embedcore.save"):
        saver.dump_to_file(_table("item", 5, 2.0), d)
    assert sorted(os.listdir(d)) == before


def test_saver_restore_values_only_and_a_sok_dump(tmp_path, rng):
    saver, d = ec.Saver(), str(tmp_path / "ckpt")
    src = _table("emb", 10, 3.0)  # Adagrad
    saver.dump_to_file(src, d)
    for opt in ("adam", None):
        t = _table("emb", 10, 0.0, opt)
        slots = {k: v.copy() for k, v in t.slots().items()}
        with pytest.raises(ec.CheckpointError, match="include_optimizer=False"):
            saver.restore_from_file(t, d)
        assert saver.restore_from_file(t, d, include_optimizer=False) == "OK"
        np.testing.assert_array_equal(t.values(), src.values())
        for k, v in slots.items():
            np.testing.assert_array_equal(t.slots()[k], v)
    write_v2(tmp_path / "sok", "emb", np.arange(10), np.ones((10, 4), np.float32))
    with pytest.raises(ec.CheckpointError, match=r"looks like a SOK dump \(emb-key\).*python -m embedcore convert "
                                                 r"--from sok"):
        saver.restore_from_file(_table("emb", 10, 0.0), tmp_path / "sok")


def test_saver_dumps_of_embeddings_keep_each_ones_features(tmp_path):
    """Two Embeddings dumped into one directory in turn: both keep their
    features (served by name); a table dumped into an Embedding's
    checkpoint keeps the features too, whether or not other tables remain."""
    saver, d = ec.Saver(), str(tmp_path / "ckpt")

    def emb(name):
        return ec.Embedding({name: ec.FeatureConfig(ec.TableConfig(name, 20, 4), name="f_" + name)},
                            ec.optimizers.SGD(0.1))

    e1, e2 = emb("x"), emb("y")
    saver.dump_to_file(e1, d)
    saver.dump_to_file(e2, d)
    served = ec.serving.open(d)
    assert sorted(f.name for f in served.feature_config) == ["f_x", "f_y"]
    ids = np.array([[1, 3]])
    names = [f.name for f in served.feature_config]  # a flat list: no one structure holds both
    out = dict(zip(names, served([ids for _ in names])))
    np.testing.assert_array_equal(out["f_x"], e1({"x": ids})["x"])
    np.testing.assert_array_equal(out["f_y"], e2({"y": ids})["y"])
    for kept in (["x"], ["x", "y"]):  # the shortcut (nothing else kept) and the keep path
        p = str(tmp_path / ("one" if len(kept) == 1 else "two"))
        e = ec.Embedding({n: ec.FeatureConfig(ec.TableConfig(n, 20, 4), name="f_" + n) for n in kept})
        ec.save(p, e)
        saver.dump_to_file(e.embedding_tables[[c for c in e.embedding_tables if c.name == "x"][0]], p)
        assert sorted(f.name for f in ec.serving.open(p).feature_config) == sorted("f_" + n for n in kept)


def test_v2_weight_file_without_values_and_integer_slots_are_refused_naming_the_file(tmp_path):
    """A v2 weight file holding its header only, beside keys (was: "TableConfig
    'emb': dim must be >= 1, got 0", naming no file), and an optimizer-state
    file whose header says integers (was: converted as accumulators), are
    refused as the weights of another dtype are, naming the file; nothing is
    written."""
    keys = np.array([5, 9, 2])
    os.makedirs(tmp_path / "a")
    write_v2_file(tmp_path / "a" / "emb-key", "", KEY, "", keys, "int64")
    write_v2_file(tmp_path / "a" / "emb-weight", "", VALUES, "", np.zeros(0), "float32")
    with pytest.raises(ec.CheckpointError, match=f"{tmp_path / 'a' / 'emb-weight'}: 0 values do not split into 3 "
                                                 "rows"):
        ec.sok.convert(tmp_path / "a", tmp_path / "out")
    os.makedirs(tmp_path / "b")
    write_v2_file(tmp_path / "b" / "emb-key", "", KEY, "", keys, "int64")
    write_v2_file(tmp_path / "b" / "emb-weight", "", VALUES, "", np.ones((3, 2)), "float32")
    write_v2_file(tmp_path / "b" / "emb-Adagrad-accumulator", "", STATE, "accumulator", np.ones((3, 2)), "int64")
    with pytest.raises(ec.CheckpointError, match=f"{tmp_path / 'b' / 'emb-Adagrad-accumulator'}: optimizer state "
                                                 "must be floats, the header says int64"):
        ec.sok.convert(tmp_path / "b", tmp_path / "out")
    assert not os.path.lexists(tmp_path / "out")


def test_v1_dump_files_that_are_not_regular_files_are_refused(tmp_path):
    """A FIFO in place of a v1 dump's file is refused naming it (the
    conversion waited forever for a writer)."""
    src = tmp_path / "sok"
    src.mkdir()
    os.mkfifo(src / "emb_keys.file")
    os.mkfifo(src / "emb_values.file")
    with pytest.raises(ec.CheckpointError, match=r"emb_keys.file: not a regular file"):
        ec.sok.convert(src, tmp_path / "out")
    assert not os.path.lexists(tmp_path / "out")
