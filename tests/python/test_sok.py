"""SOK dumps (v1 and v2, written by hand here) converted with
``embedcore convert --from sok`` and ``ec.sok.convert``: every dumped row
lands at its key, optimizer slots come along, and bad dumps are refused."""
from __future__ import annotations

import json
import os
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


def v2_header(name: str, kind: int, slot: str, dtype: str) -> bytes:
    h = name.encode().ljust(256, b"\0") + kind.to_bytes(4, "big") + slot.encode().ljust(32, b"\0") + \
        V2_CODES[dtype].to_bytes(4, "big")
    assert len(h) == 296
    return h


def write_v2_file(path, name, kind, slot, array, dtype):
    data = np.ascontiguousarray(np.asarray(array).astype(np.dtype(dtype).newbyteorder("<")))
    with open(path, "wb") as f:
        f.write(v2_header(name, kind, slot, dtype) + data.tobytes())


def write_v2(src, var, keys, values, key_dtype="int64", value_dtype="float32", optimizer=None, slots=None):
    os.makedirs(src, exist_ok=True)
    write_v2_file(os.path.join(src, f"{var}-key"), var, KEY, "", keys, key_dtype)
    write_v2_file(os.path.join(src, f"{var}-weight"), var, VALUES, "", values, value_dtype)
    for slot, arr in (slots or {}).items():
        write_v2_file(os.path.join(src, f"{var}-{optimizer}-{slot}"), var, STATE, slot, arr, "float32")


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
    ("duplicate keys", _replace("bad-key", "bad", KEY, "int64", [0, 1, 2, 2, 4, 5]), "duplicate"),
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
