"""Corrupt, truncated, missing and forged checkpoints: every one raises
``CheckpointError`` naming the bad file (never a crash, never a huge
allocation), and a load leaves its target exactly as it was."""
from __future__ import annotations

import copy
import json
import os
import re
import resource
import shutil
import subprocess
import sys

import numpy as np
import pytest

import embedcore as ec
import embedcore.cli
from test_checkpoint_forge import (BLOCK_BYTES, DATA_OFFSET, HEADER_BYTES, assert_same_state, crc32c, data_header,
                                   flip_byte, read_manifest, read_manifest_json, snapshot, train,
                                   unpack_header, pack_header, write_manifest)

ROWS, DIM = 300, 8
HERE = os.path.dirname(os.path.abspath(__file__))



def _cost():
    """This process's CPU seconds and MiB of pages faulted in so far: what
    refusing or opening a checkpoint may spend, measured as work (wall time
    stretches with the machine's load, and the peak RSS hides growth below an
    earlier test's peak)."""
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime, (u.ru_minflt + u.ru_majflt) * resource.getpagesize() / 2**20

def make_table(seed=1, rows=ROWS, dim=DIM):
    return ec.Table(name="t", rows=rows, dim=dim, optimizer=ec.optimizers.Adagrad(0.1),
                    initializer=ec.initializers.Uniform(-1, 1, seed=seed))


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """A small checkpoint: values + an Adagrad slot + the manifest; and the
    table it holds."""
    root = tmp_path_factory.mktemp("pristine")
    t = make_table(seed=1)
    train(t, np.random.default_rng(0), 2)
    ec.save(root / "ckpt", t)
    m = read_manifest(root / "ckpt")
    (entry,) = m["tables"]
    files = {"MANIFEST": "MANIFEST", "values": entry["values"][0]["path"],
             "slot": entry["slots"]["accumulators"][0]["path"]}
    return {"path": root / "ckpt", "files": files, "table": t, "snapshot": snapshot(t)}


@pytest.fixture
def target(rng):
    """A table of the checkpoint's shape in another state (step 1)."""
    t = make_table(seed=7)
    train(t, rng, 1)
    return t


@pytest.fixture
def ckpt(tmp_path, pristine):
    """A fresh copy of the pristine checkpoint to damage."""
    dst = tmp_path / "ckpt"
    shutil.copytree(pristine["path"], dst)
    return dst


def assert_load_fails(path, target, names, match=None, include_optimizer=True):
    """ec.load raises CheckpointError whose message names one of `names`
    (file base names), and leaves `target` unchanged."""
    before = snapshot(target)
    with pytest.raises(ec.CheckpointError) as e:
        ec.load(path, into=target, include_optimizer=include_optimizer)
    msg = str(e.value)
    assert isinstance(e.value, ValueError)
    if isinstance(names, str):
        names = [names]
    assert any(n in msg for n in names), f"the error does not name {names}: {msg}"
    if match is not None:
        assert match in msg, f"{match!r} not in {msg!r}"
    assert_same_state(target, before, "after a failed load")
    return msg


def assert_serving_fails(path, names, verify="eager"):
    with pytest.raises(ec.CheckpointError) as e:
        ec.serving.open(path, verify=verify)
    if isinstance(names, str):
        names = [names]
    assert any(n in str(e.value) for n in names), f"the error does not name {names}: {e.value}"
    return str(e.value)


def cli_verify_fails(path, capsys, names):
    assert embedcore.cli.main(["verify", str(path)]) == 1
    err = capsys.readouterr().err
    if isinstance(names, str):
        names = [names]
    assert any(n in err for n in names), err
    assert "Traceback" not in err


# ------------------------------------------------------------------ single-byte flips
# (file, region, count): 280 flips over the three files, in headers, padding and payloads.
FLIP_PLAN = [("MANIFEST", "header", 64), ("MANIFEST", "json", 40),
             ("values", "header", 32), ("values", "padding", 24), ("values", "payload", 32),
             ("slot", "header", 32), ("slot", "padding", 24), ("slot", "payload", 32)]
FLIPS = [(f, r, i) for f, r, n in FLIP_PLAN for i in range(n)]


# Header bytes every field of which is hit first: magic, version, byte order
# mark, header size, kind, dtype, reserved, rows, cols, payload offset and
# size, aux, header checksum.
FIELD_OFFSETS = [0, 7, 8, 10, 12, 16, 20, 21, 22, 24, 32, 40, 48, 56, 60, 63]


def flip_offset(which, region, i, size, rng):
    if region == "header":
        if which == "MANIFEST":
            return i  # every byte of the manifest's header
        return FIELD_OFFSETS[i] if i < len(FIELD_OFFSETS) else int(rng.integers(0, HEADER_BYTES))
    if region == "json":
        return int(rng.integers(HEADER_BYTES, size))
    if region == "padding":
        return int(rng.integers(HEADER_BYTES, DATA_OFFSET))
    return int(rng.integers(DATA_OFFSET, size))


@pytest.mark.parametrize("which,region,i", FLIPS, ids=[f"{f}-{r}-{i}" for f, r, i in FLIPS])
def test_single_byte_flip(ckpt, pristine, target, capsys, which, region, i):
    rng = np.random.default_rng([[p[:2] for p in FLIP_PLAN].index((which, region)), i])
    name = pristine["files"][which]
    path = ckpt / name
    offset = flip_offset(which, region, i, path.stat().st_size, rng)
    mask = int(rng.integers(1, 256))
    flip_byte(path, offset, mask)

    # The load refuses, naming the file, and the target keeps values, slots and step.
    assert_load_fails(ckpt, target, name)
    cli_verify_fails(ckpt, capsys, name)

    good_values = pristine["table"].values()
    ids = np.arange(ROWS)
    if which == "slot":
        # Serving reads no optimizer state, and a values-only load needs no slot file.
        served = ec.serving.open(ckpt, verify="eager")
        np.testing.assert_array_equal(served.tables["t"].lookup(ids, combiner=None), good_values)
        before = snapshot(target)
        ec.load(ckpt, into=target, include_optimizer=False)
        assert target.values().tobytes() == good_values.tobytes()
        assert target.step == before["step"]
        assert target.slots()["accumulators"].tobytes() == before["slots"]["accumulators"].tobytes()
        return

    assert_load_fails(ckpt, target, name, include_optimizer=False)
    assert_serving_fails(ckpt, name, verify="eager")
    if region == "payload":
        # Lazy: the open succeeds (no value is read), every lookup of the bad block fails.
        served = ec.serving.open(ckpt)
        for _ in range(2):
            with pytest.raises(ec.CheckpointError, match=name):
                served.tables["t"].lookup(ids[:1], combiner=None)
        with pytest.raises(ec.CheckpointError, match=name):
            served.tables["t"].lookup(ids, np.array([0, 5, ROWS]))
    else:
        assert_serving_fails(ckpt, name, verify="lazy")


def test_flip_plan_covers_every_file_and_region():
    assert len(FLIPS) >= 200
    assert {(f, r) for f, r, _ in FLIPS} >= {("MANIFEST", "header"), ("MANIFEST", "json"), ("values", "header"),
                                             ("values", "padding"), ("values", "payload"), ("slot", "header"),
                                             ("slot", "padding"), ("slot", "payload")}


def test_lazy_serving_refuses_only_the_corrupt_block(tmp_path, rng):
    """A 3-block values file with a bad middle block: lazy serving serves
    rows of the good blocks and refuses, every time, rows of the bad one."""
    rows_per_block = BLOCK_BYTES // (4 * 8)
    t = ec.Table(name="big", rows=3 * rows_per_block, dim=8, initializer=ec.initializers.Uniform(-1, 1, seed=2))
    ec.save(tmp_path / "c", t)
    (entry,) = read_manifest(tmp_path / "c")["tables"]
    assert len(entry["values"][0]["crc32c"]) == 3
    name = entry["values"][0]["path"]
    flip_byte(tmp_path / "c" / name, DATA_OFFSET + BLOCK_BYTES + 12345, 0x01)

    msg = assert_serving_fails(tmp_path / "c", name, verify="eager")
    assert "block 1" in msg
    served = ec.serving.open(tmp_path / "c")  # lazy
    good = np.array([0, 5, rows_per_block - 1, 2 * rows_per_block, 3 * rows_per_block - 1])
    np.testing.assert_array_equal(served.tables["big"].lookup(good, combiner=None), t.values()[good])
    for bad in ([rows_per_block], [rows_per_block + 100, 0], [2 * rows_per_block - 1]):
        for _ in range(2):
            with pytest.raises(ec.CheckpointError, match="block 1"):
                served.tables["big"].lookup(np.array(bad), combiner=None)
    np.testing.assert_array_equal(served.tables["big"].lookup(good, combiner=None), t.values()[good])
    target = ec.Table(name="big", rows=3 * rows_per_block, dim=8)
    assert_load_fails(tmp_path / "c", target, name, match="block 1")


# ------------------------------------------------------------------ truncated, extended, missing
@pytest.mark.parametrize("which", ["values", "slot"])
@pytest.mark.parametrize("keep", [0, 1, 63, 64, 100, 4095, 4096, -1])
def test_truncated_data_file(ckpt, pristine, target, capsys, which, keep):
    name = pristine["files"][which]
    path = ckpt / name
    size = path.stat().st_size
    os.truncate(path, keep if keep >= 0 else size - 1)
    assert_load_fails(ckpt, target, name, match="truncated")
    if which == "values":
        assert_serving_fails(ckpt, name)  # the values files' sizes are checked on open
    else:
        ec.serving.open(ckpt, verify="eager")  # serving reads no slot file
    cli_verify_fails(ckpt, capsys, name)


@pytest.mark.parametrize("which", ["values", "slot"])
def test_extended_data_file(ckpt, pristine, target, which):
    name = pristine["files"][which]
    with open(ckpt / name, "ab") as f:
        f.write(b"\0")
    assert_load_fails(ckpt, target, name)


@pytest.mark.parametrize("keep", [0, 1, 8, 63, 64, 65, -1])
def test_truncated_manifest(ckpt, target, capsys, keep):
    path = ckpt / "MANIFEST"
    os.truncate(path, keep if keep >= 0 else path.stat().st_size - 1)
    msg = assert_load_fails(ckpt, target, "MANIFEST")
    assert "truncated" in msg or keep >= 64 and "match" in msg
    assert_serving_fails(ckpt, "MANIFEST")
    assert_serving_fails(ckpt, "MANIFEST", verify=False)
    cli_verify_fails(ckpt, capsys, "MANIFEST")


def test_extended_manifest(ckpt, target):
    with open(ckpt / "MANIFEST", "ab") as f:
        f.write(b" ")
    assert_load_fails(ckpt, target, "MANIFEST")


@pytest.mark.parametrize("which", ["values", "slot"])
def test_missing_data_file(ckpt, pristine, target, which):
    name = pristine["files"][which]
    os.unlink(ckpt / name)
    assert_load_fails(ckpt, target, name, match="missing")
    if which == "values":
        assert_serving_fails(ckpt, name)  # the values files are all checked on open
    else:
        ec.serving.open(ckpt, verify="eager")  # serving reads no slot file


def test_data_file_replaced_by_a_directory(ckpt, pristine, target):
    name = pristine["files"]["values"]
    os.unlink(ckpt / name)
    os.mkdir(ckpt / name)
    assert_load_fails(ckpt, target, name)


def test_missing_manifest(ckpt, target, capsys):
    os.unlink(ckpt / "MANIFEST")
    assert_load_fails(ckpt, target, "MANIFEST")
    assert_serving_fails(ckpt, "MANIFEST")
    cli_verify_fails(ckpt, capsys, "MANIFEST")
    assert embedcore.cli.main(["inspect", str(ckpt)]) == 1


def test_not_a_checkpoint(tmp_path, target):
    (tmp_path / "empty").mkdir()
    assert_load_fails(tmp_path / "empty", target, "empty")
    assert_load_fails(tmp_path / "absent", target, "absent")
    (tmp_path / "file").write_bytes(b"ECKPMANI")
    assert_load_fails(tmp_path / "file", target, "file")
    assert_serving_fails(tmp_path / "absent", "absent")


def test_swapped_data_files(ckpt, pristine, target):
    """The values and slot files swapped: same sizes, valid headers, wrong data."""
    v, s = ckpt / pristine["files"]["values"], ckpt / pristine["files"]["slot"]
    a, b = v.read_bytes(), s.read_bytes()
    v.write_bytes(b)
    s.write_bytes(a)
    assert_load_fails(ckpt, target, [v.name, s.name], match="checksum")
    assert_serving_fails(ckpt, v.name)


# ------------------------------------------------------------------ wrong magic, other versions
@pytest.mark.parametrize("which,magic", [("MANIFEST", b"ECKPDATA"), ("MANIFEST", b"\0" * 8), ("MANIFEST", b"PK\3\4xxxx"),
                                         ("values", b"ECKPMANI"), ("values", b"ECKPDATB"), ("slot", b"\x93NUMPY\1\0")])
def test_wrong_magic(ckpt, pristine, target, which, magic):
    name = pristine["files"][which]
    raw = bytearray((ckpt / name).read_bytes())
    raw[:8] = magic
    (ckpt / name).write_bytes(bytes(raw))
    assert_load_fails(ckpt, target, name, match="magic")


@pytest.mark.parametrize("json_version,header_version", [((2, 0), (1, 0)), ((1, 0), (2, 0)), ((2, 0), (2, 0)),
                                                         ((7, 3), (7, 3))])
def test_newer_major_version_is_refused_clearly(ckpt, target, capsys, json_version, header_version):
    m = read_manifest(ckpt)
    m["format_version"] = list(json_version)
    write_manifest(ckpt, m, *header_version)
    newer = json_version if json_version[0] > 1 else header_version
    msg = assert_load_fails(ckpt, target, "MANIFEST", match=f"{newer[0]}.{newer[1]}")
    assert "newer" in msg and "upgrade" in msg
    msg = assert_serving_fails(ckpt, "MANIFEST")
    assert f"{newer[0]}.{newer[1]}" in msg
    assert embedcore.cli.main(["inspect", str(ckpt)]) == 1
    assert f"{newer[0]}.{newer[1]}" in capsys.readouterr().err


def test_newer_major_version_in_a_data_file_header(ckpt, pristine, target):
    name = pristine["files"]["values"]
    raw = (ckpt / name).read_bytes()
    h = unpack_header(raw)
    h["major"] = 2
    (ckpt / name).write_bytes(pack_header(h) + raw[HEADER_BYTES:])
    assert_load_fails(ckpt, target, name, match=f"format version 2.{h['minor']}")
    assert_serving_fails(ckpt, name)


@pytest.mark.parametrize("which", ["MANIFEST", "values"])
def test_newer_major_version_with_another_header_layout(ckpt, pristine, target, which):
    """A newer major version may checksum its header differently: the reader
    says it is newer (and may be corrupt), not only that the checksum fails."""
    name = pristine["files"][which]
    raw = (ckpt / name).read_bytes()
    h = unpack_header(raw)
    h["major"], h["header_crc"] = 3, 0x12345678
    (ckpt / name).write_bytes(pack_header(h, seal=False) + raw[HEADER_BYTES:])
    msg = assert_load_fails(ckpt, target, name, match=f"format version 3.{h['minor']} is newer")
    assert "or the header is corrupt" in msg
    assert "newer" in assert_serving_fails(ckpt, name)


@pytest.mark.parametrize("which", ["MANIFEST", "values"])
def test_a_sealed_header_of_another_size_is_refused(ckpt, pristine, target, which):
    """header_bytes is 64 (docs/format.md): a header that says otherwise, its
    checksum re-sealed so that the check is reached, is refused by name."""
    name = pristine["files"][which]
    raw = (ckpt / name).read_bytes()
    h = unpack_header(raw)
    h["header_bytes"] = 128
    (ckpt / name).write_bytes(pack_header(h) + raw[HEADER_BYTES:])
    assert_load_fails(ckpt, target, name, match="unexpected header size 128")
    assert_serving_fails(ckpt, name)
    assert ec.cli.main(["verify", str(ckpt)]) != 0


def test_version_zero_is_refused(ckpt, target):
    m = read_manifest(ckpt)
    m["format_version"] = [0, 9]
    write_manifest(ckpt, m, 0, 9)
    assert_load_fails(ckpt, target, "MANIFEST")


def test_newer_minor_version_still_loads(ckpt, pristine):
    """A minor version only adds what older readers may ignore."""
    m = read_manifest(ckpt)
    m["format_version"] = [1, 7]
    m["a_field_from_the_future"] = {"x": 1}
    write_manifest(ckpt, m, 1, 7)
    t = make_table(seed=9)
    ec.load(ckpt, into=t)
    assert_same_state(t, pristine["snapshot"])
    assert ec.serving.open(ckpt, verify="eager").format_version == (1, 7)


# ------------------------------------------------------------------ forged manifests (valid checksums)
def _values(m):
    return m["tables"][0]["values"][0]


def _slot(m):
    return m["tables"][0]["slots"]["accumulators"][0]


def _all_entries(m):
    return [_values(m), _slot(m)]


def _set(path, value):
    def f(m):
        obj = m
        for k in path[:-1]:
            obj = obj[k]
        obj[path[-1]] = value
        return m
    return f


def _del(path):
    def f(m):
        obj = m
        for k in path[:-1]:
            obj = obj[k]
        del obj[path[-1]]
        return m
    return f


def _rows(n, dim=DIM, block_bytes=None, bytes_=None):
    """Claims a table of n x dim, with self-consistent file entries."""
    def f(m):
        t = m["tables"][0]
        t["rows"], t["dim"] = n, dim
        for e in _all_entries(m):
            e["rows"], e["cols"] = n, dim
            if block_bytes:
                e["block_bytes"] = block_bytes
            payload = n * dim * 4
            e["bytes"] = DATA_OFFSET + payload if bytes_ is None else bytes_
            blocks = min(-(-payload // e["block_bytes"]), 8192)  # a list the size of the claim, when small
            e["crc32c"] = (e["crc32c"] * blocks)[:blocks] if e["crc32c"] else [0] * blocks
        return m
    return f


def _same_bytes_other_shape(m):
    """150 x 16: the same byte count as 300 x 8, so only the data headers tell."""
    return _rows(150, 16)(m)


@pytest.mark.parametrize("which", ["values", "slot"])
def test_same_bytes_in_another_shape_is_refused_by_the_data_headers(ckpt, pristine, which):
    """A manifest claiming 150 x 16 for files of 300 x 8 (the same byte
    counts, every size check passes): the data files' headers disagree."""
    m = _same_bytes_other_shape(read_manifest(ckpt))
    if which == "slot":  # only the slot entry lies; the values entry keeps the true shape
        m = read_manifest(ckpt)
        m["tables"][0]["slots"]["accumulators"][0].update(rows=150, cols=16)
        m["tables"][0].update(rows=150, dim=16)
        m["tables"][0]["values"][0].update(rows=150, cols=16)
        write_manifest(ckpt, m)
        vname = pristine["files"]["values"]
        # make the values file agree with the lie, so only the slot header tells
        raw = (ckpt / vname).read_bytes()
        h = unpack_header(raw)
        h["rows"], h["cols"] = 150, 16
        (ckpt / vname).write_bytes(pack_header(h) + raw[HEADER_BYTES:])
    else:
        write_manifest(ckpt, m)
    target = make_table(seed=5, rows=150, dim=16)
    name = pristine["files"][which]
    assert_load_fails(ckpt, target, name, match="header rows = 300, but the manifest says 150")
    if which == "values":
        assert_serving_fails(ckpt, name, verify="lazy")


def _float16_claim(m):
    t = m["tables"][0]
    t["rows"] = 600
    t["dtype"] = "float16"
    _values(m).update(rows=600, dtype="float16")  # 600 x 8 x 2 bytes: the size of 300 x 8 x 4
    _slot(m).update(rows=600, bytes=DATA_OFFSET + 600 * 8 * 4, crc32c=[0])
    return m


def _crc_values(m):
    _values(m)["crc32c"] = [(_values(m)["crc32c"][0] + 1) % 2**32]
    return m


def _crc_slot(m):
    _slot(m)["crc32c"] = [_slot(m)["crc32c"][0] ^ 0x80000000]
    return m


def _gap(m):
    _values(m)["row_start"] = 1
    _values(m)["rows"] = ROWS - 1
    return m


def _two_files_one_path(m):
    """The values listed as two halves of the same file."""
    a = dict(_values(m))
    b = dict(_values(m))
    a["rows"], b["row_start"], b["rows"] = ROWS // 2, ROWS // 2, ROWS - ROWS // 2
    for e in (a, b):
        e["bytes"] = DATA_OFFSET + e["rows"] * DIM * 4
    m["tables"][0]["values"] = [a, b]
    return m


def _json_text(text):
    return lambda m: text


def _same_name_twice(m):
    """A second entry of the same name over the same (valid) files."""
    m["tables"].append(copy.deepcopy(m["tables"][0]))
    return m


def _second_table_without_files(m):
    m["tables"].append(copy.deepcopy(m["tables"][0]))
    m["tables"][1]["name"] = "u"
    m["tables"][1]["values"][0]["path"] = "t00001.values.g000000000001.ecd"
    return m


def _rowwise_over_full_width_slot(m):
    """Row-wise Adagrad named over the Adagrad slot file ([rows, dim]: a row-wise slot is one column)."""
    m["tables"][0]["optimizer"]["kind"] = "rowwise_adagrad"
    m["tables"][0]["slots"] = {"row_accumulators": m["tables"][0]["slots"]["accumulators"]}
    return m


TERA = [
    ("rows 2^31 x dim 2^10 (8 TiB), 1 GiB blocks", _rows(2**31, 2**10, block_bytes=2**30)),
    ("rows 2^40 x dim 2^20", _rows(2**40, 2**20, block_bytes=2**30)),
    ("rows x dim overflowing int64", _rows(2**62, 2**10, block_bytes=2**30)),
    ("rows INT64_MAX, dim 1", _rows(2**63 - 1, 1, block_bytes=2**30)),
    ("1 TiB with the crc32c list of a 4 KiB block size", _rows(2**28, 2**10, block_bytes=4096)),
]

FORGED = [
    # what the files hold
    ("rows the files do not hold", _rows(600), "open"),
    ("fewer rows than the files hold", _rows(100), "open"),
    ("float16 claimed for float32 data", _float16_claim, "open"),
    ("wrong file byte count", _set(["tables", 0, "values", 0, "bytes"], DATA_OFFSET + 10), "open"),
    ("wrong values checksum", _crc_values, "eager"),
    ("wrong slot checksum", _crc_slot, "none"),
    ("too few checksums", _set(["tables", 0, "values", 0, "crc32c"], []), "open"),
    ("too many checksums", _set(["tables", 0, "values", 0, "crc32c"], [1, 2]), "open"),
    ("checksum not an integer", _set(["tables", 0, "values", 0, "crc32c"], ["x"]), "open"),
    ("checksum over 32 bits", _set(["tables", 0, "values", 0, "crc32c"], [2**32]), "open"),
    ("checksum negative", _set(["tables", 0, "values", 0, "crc32c"], [-1]), "open"),
    ("cols other than dim", _set(["tables", 0, "values", 0, "cols"], DIM + 1), "open"),
    ("rows missing from coverage", _gap, "open"),
    ("rows covered twice", _two_files_one_path, "open"),
    ("row_start past the end", _set(["tables", 0, "values", 0, "row_start"], ROWS + 1), "open"),
    ("negative rows", _set(["tables", 0, "rows"], -5), "open"),
    ("zero rows", _set(["tables", 0, "rows"], 0), "open"),
    ("rows a float", _set(["tables", 0, "rows"], 300.0), "open"),
    ("rows a string", _set(["tables", 0, "rows"], "300"), "open"),
    ("rows too big for int64", _set(["tables", 0, "rows"], 2**64), "open"),
    ("block size not a power of two", _set(["tables", 0, "values", 0, "block_bytes"], 3 << 20), "open"),
    ("block size too small", _set(["tables", 0, "values", 0, "block_bytes"], 1024), "open"),
    ("block size too big", _set(["tables", 0, "values", 0, "block_bytes"], 2**31), "open"),
    ("block size 0", _set(["tables", 0, "values", 0, "block_bytes"], 0), "open"),
    ("unknown stored dtype", _set(["tables", 0, "values", 0, "dtype"], "int8"), "open"),
    ("unknown table dtype", _set(["tables", 0, "dtype"], "float64"), "open"),
    ("slot stored as float16", _set(["tables", 0, "slots", "accumulators", 0, "dtype"], "float16"), "open"),
    ("slots missing for the optimizer", _set(["tables", 0, "slots"], {}), "open"),
    ("an extra slot", _set(["tables", 0, "slots", "linears"], []), "open"),
    ("slots without an optimizer", _set(["tables", 0, "optimizer"], None), "open"),
    # An optimizer this reader does not know is read as a newer writer's: test_checkpoint_newer_optimizer.py.
    ("a newer optimizer whose slot is wider than the table",
     lambda m: _set(["tables", 0, "slots", "accumulators", 0, "cols"], DIM + 1)(
         _set(["tables", 0, "optimizer", "kind"], "lamb")(m)), "open"),
    ("row-wise Adagrad over Adagrad's slot name", _set(["tables", 0, "optimizer", "kind"], "rowwise_adagrad"), "open"),
    ("row-wise Adagrad over a full-width slot file", _rowwise_over_full_width_slot, "open"),
    ("invalid optimizer option", _set(["tables", 0, "optimizer", "beta_1"], "high"), "open"),
    ("an option beyond float32 (inf once read)", _set(["tables", 0, "optimizer", "epsilon"], 1e300), "open"),
    ("clipvalue beyond float32", _set(["tables", 0, "optimizer", "clipvalue"], [-1e300, 1e300]), "open"),
    # (An unknown initializer kind is a newer writer's, and reads: test_checkpoint_newer_optimizer.py.)
    ("initializer not an object", _set(["tables", 0, "initializer"], "orthogonal"), "open"),
    ("known initializer without its numbers", _set(["tables", 0, "initializer"], {"kind": "uniform", "seed": 0}),
     "open"),
    ("negative initializer seed", _set(["tables", 0, "initializer", "seed"], -1), "open"),
    ("values not a list", _set(["tables", 0, "values"], {"path": "x"}), "open"),
    ("no values", _set(["tables", 0, "values"], []), "open"),
    ("file entry not an object", _set(["tables", 0, "values"], [7]), "open"),
    ("file entry without path", _del(["tables", 0, "values", 0, "path"]), "open"),
    ("path a number", _set(["tables", 0, "values", 0, "path"], 5), "open"),
    ("sharding not an object", _set(["tables", 0, "sharding"], "none"), "open"),
    ("config not an object", _set(["tables", 0, "config"], []), "open"),
    ("tables not a list", _set(["tables"], {"t": 1}), "open"),
    ("table not an object", _set(["tables"], [1]), "open"),
    ("table without name", _del(["tables", 0, "name"]), "open"),
    ("table without step", _del(["tables", 0, "step"]), "open"),
    ("negative step", _set(["tables", 0, "step"], -1), "open"),
    ("step over 2^62", _set(["tables", 0, "step"], 2**62 + 1), "open"),
    ("step INT64_MAX", _set(["tables", 0, "step"], 2**63 - 1), "open"),
    ("two tables of one name", _same_name_twice, "open"),
    ("a second table whose files are missing", _second_table_without_files, "open"),
    ("format of another kind", _set(["format"], "tensorflow.checkpoint"), "open"),
    ("byte order big", _set(["byte_order"], "big"), "open"),
    ("format_version one number", _set(["format_version"], [1]), "open"),
    ("format_version a string", _set(["format_version"], "1.0"), "open"),
    ("format_version of floats", _set(["format_version"], [1.0, 0.0]), "open"),
    ("format_version missing", _del(["format_version"]), "open"),
    ("format_version major over 16 bits (2^32 + 1 truncates to 1)", _set(["format_version"], [2**32 + 1, 0]), "open"),
    ("format_version minor over 16 bits", _set(["format_version"], [1, 2**32 + 2]), "open"),
    ("format_version minor negative", _set(["format_version"], [1, -1]), "open"),
    ("negative generation", _set(["generation"], -1), "open"),
    ("generation of 19 digits", _set(["generation"], 10**18), "open"),
    ("generation INT64_MAX", _set(["generation"], 2**63 - 1), "open"),
    ("metadata not an object", _set(["metadata"], "x"), "open"),
    ("metadata missing", _del(["metadata"]), "open"),
    ("not JSON", _json_text(b"this is not json"), "open"),
    ("truncated JSON", lambda m: json.dumps(m).encode()[:-40], "open"),
    ("JSON array", _json_text(b"[1, 2, 3]"), "open"),
    ("JSON null", _json_text(b"null"), "open"),
    ("empty JSON", _json_text(b""), "open"),
    ("invalid UTF-8", _json_text(b'{"format": "\xff\xfe"}'), "open"),
    ("NUL bytes", _json_text(b"\0" * 100), "open"),
] + [(label, f, "open") for label, f in TERA]


@pytest.mark.parametrize("label,forge,serving_fails", FORGED, ids=[x[0] for x in FORGED])
def test_forged_manifest_is_refused(ckpt, pristine, target, capsys, label, forge, serving_fails):
    """serving_fails: "open" (every open refuses), "eager" (only an eager
    open reads the bad checksums), "none" (only slots, which serving never reads)."""
    m = forge(read_manifest(ckpt))
    write_manifest(ckpt, m)
    names = ["MANIFEST", pristine["files"]["values"], pristine["files"]["slot"], "t00001.values.g000000000001.ecd"]
    cpu0, _ = _cost()
    assert_load_fails(ckpt, target, names)
    assert _cost()[0] - cpu0 < 2.0, "a forged manifest took long to refuse"
    if serving_fails in ("open", "eager"):
        assert_serving_fails(ckpt, names, verify="eager")
    if serving_fails == "open":
        assert_serving_fails(ckpt, names, verify="lazy")
        assert_serving_fails(ckpt, names, verify=False)
    # The command line says what is wrong, with no traceback.
    assert embedcore.cli.main(["verify", str(ckpt)]) == 1
    err = capsys.readouterr().err
    assert "CheckpointError" in err and "Traceback" not in err


@pytest.mark.parametrize("label,forge", TERA, ids=[x[0] for x in TERA])
def test_terabyte_shapes_are_refused_fast_without_allocating(ckpt, label, forge):
    write_manifest(ckpt, forge(read_manifest(ckpt)))
    cpu0, mib0 = _cost()
    with pytest.raises(ec.CheckpointError) as e:
        ec.checkpoint.read_info(ckpt)
    with pytest.raises(ec.CheckpointError):
        ec.serving.open(ckpt, verify="eager")
    with pytest.raises(ec.CheckpointError):
        ec.load(ckpt, into=make_table())
    cpu, mib = (b - a for a, b in zip((cpu0, mib0), _cost()))
    assert cpu < 1.0 and mib < 64, f"refusing the manifest took {cpu:.2f} CPU s and {mib:.0f} MiB"
    assert "MANIFEST" in str(e.value) or ".ecd" in str(e.value)


def test_terabyte_sparse_file_with_a_valid_header(ckpt, pristine):
    """The manifest and the data file agree on 2^31 x 2^10 float32 (8 TiB,
    sparse on disk): opening it must not allocate or read it, loading it into
    a small table is refused by shape, and serving refuses its zero blocks."""
    rows, dim, block = 2**31, 2**10, 2**28  # 256 MiB blocks: 32,768 checksums
    payload = rows * dim * 4
    m = read_manifest(ckpt)
    t = m["tables"][0]
    t["rows"], t["dim"], t["optimizer"], t["slots"], t["step"] = rows, dim, None, {}, 0
    t["config"] = {"name": "t", "rows": rows, "dim": dim, "dtype": "float32", "combiner": "mean"}
    e = t["values"][0]
    e.update(rows=rows, cols=dim, block_bytes=block, bytes=DATA_OFFSET + payload, crc32c=[0] * (payload // block))
    path = ckpt / e["path"]
    try:
        with open(path, "wb") as f:
            f.write(data_header("float32", rows, dim, payload, block))
            f.truncate(DATA_OFFSET + payload)
    except OSError as err:
        pytest.skip(f"this file system holds no 8 TiB sparse file: {err}")
    try:
        write_manifest(ckpt, m)
        cpu0, mib0 = _cost()
        info = ec.checkpoint.read_info(ckpt)
        assert info.table_names == ["t"]
        with pytest.raises(ec.CheckpointError, match="2147483648 x 1024"):
            ec.load(ckpt, into=make_table())
        served = ec.serving.open(ckpt)  # lazy: maps 8 TiB, reads none of it
        assert (served.tables["t"].rows, served.tables["t"].dim) == (rows, dim)
        cpu, mib = (b - a for a, b in zip((cpu0, mib0), _cost()))
        assert cpu < 2.0 and mib < 64, f"opening the sparse file took {cpu:.2f} CPU s and {mib:.0f} MiB"
        # The last block: 256 MiB of zeros, whose checksum is not 0 (the mapped
        # zero pages it reads count as resident, so no memory check here).
        with pytest.raises(ec.CheckpointError, match="block 32767"):
            served.tables["t"].lookup(np.array([rows - 1]), combiner=None)
        del served
    finally:
        os.unlink(path)


BAD_PATHS = ["/ABSOLUTE", "../outside.ecd", "sub/t.ecd", "..", ".", "", "..t.ecd", "sub\\t.ecd", "./t.ecd",
             "sub/../t.ecd", "a\0b"]


@pytest.mark.parametrize("which", ["values", "slot"])
@pytest.mark.parametrize("bad", BAD_PATHS, ids=[repr(p) for p in BAD_PATHS])
def test_data_file_path_must_be_a_plain_name(tmp_path, ckpt, pristine, target, which, bad):
    """Each forged path leads to a valid copy of the right file, so only the
    name check stands between the manifest and a file outside the checkpoint."""
    src = ckpt / pristine["files"][which]
    if bad == "/ABSOLUTE":
        bad = str(tmp_path / "elsewhere.ecd")
    if bad not in ("", ".", "..", "a\0b"):
        dst = os.path.normpath(os.path.join(str(ckpt), bad.replace("\\", "/")))
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        shutil.copyfile(src, dst)
    m = read_manifest(ckpt)
    entry = _values(m) if which == "values" else _slot(m)
    entry["path"] = bad
    write_manifest(ckpt, m)
    msg = assert_load_fails(ckpt, target, "MANIFEST")
    assert "plain file name" in msg or "\0" in bad  # (a message quoting a NUL ends there)
    assert_serving_fails(ckpt, "MANIFEST")


def test_duplicate_table_names_in_a_manifest(tmp_path):
    """Two tables of one name, each with its own valid files: a load took the
    first and a server the last. Names are unique (docs/format.md), so both refuse."""
    a = make_table(seed=1)
    b = ec.Table(name="b", rows=ROWS, dim=DIM, optimizer=ec.optimizers.Adagrad(0.1),
                 initializer=ec.initializers.Uniform(-1, 1, seed=2))
    ec.save(tmp_path / "c", [a, b])
    m = read_manifest(tmp_path / "c")
    m["tables"][1]["name"] = "t"
    write_manifest(tmp_path / "c", m)
    msg = assert_load_fails(tmp_path / "c", make_table(seed=3), "MANIFEST", match="names two tables")
    assert "tables[1].name 't'" in msg
    assert_serving_fails(tmp_path / "c", "MANIFEST", verify=False)


def test_empty_files_in_a_tiling_are_refused(tmp_path):
    """Ten 10-row files, with zero-row files next to them: an empty file at
    the end, or one at each file's row_start (some orders of which tile the
    rows, and serving, which finds a row's file by its row_start, could land
    on an empty one and read past its empty checksum list). No writer makes
    an empty file: a reader refuses one."""
    path = tmp_path / "c"
    t = ec.Table(name="t", rows=100, dim=4, initializer=ec.initializers.Uniform(-1, 1, seed=1))
    ec.save(path, t, include_optimizer=False)
    m = read_manifest(path)
    values = t.to_numpy()
    pad = bytes(DATA_OFFSET - HEADER_BYTES)
    files = []
    for i in range(10):
        payload = values[i * 10:(i + 1) * 10].tobytes()
        (path / f"p{i}.ecd").write_bytes(data_header("float32", 10, 4, len(payload), 4096) + pad + payload)
        (path / f"z{i}.ecd").write_bytes(data_header("float32", 0, 4, 0, 4096) + pad)
        files.append(dict(path=f"p{i}.ecd", bytes=DATA_OFFSET + len(payload), dtype="float32", row_start=i * 10,
                          rows=10, cols=4, block_bytes=4096, crc32c=[crc32c(payload)]))
        files.append(dict(path=f"z{i}.ecd", bytes=DATA_OFFSET, dtype="float32", row_start=i * 10, rows=0, cols=4,
                          block_bytes=4096, crc32c=[]))
    at_the_end = dict(files[1], row_start=100)
    for order in (files[::2] + [at_the_end], files, files[1::2] + files[::2], files[::-1]):
        m["tables"][0]["values"] = order
        write_manifest(path, m)
        assert_load_fails(path, ec.Table(name="t", rows=100, dim=4), "MANIFEST", match=" is outside [")
        assert_serving_fails(path, "MANIFEST", verify=False)
    # Without the empty files the same manifest loads and serves.
    m["tables"][0]["values"] = files[::2]
    write_manifest(path, m)
    back = ec.Table(name="t", rows=100, dim=4)
    ec.load(path, into=back)
    np.testing.assert_array_equal(back.to_numpy(), values)
    np.testing.assert_array_equal(ec.serving.open(path).tables["t"].lookup(np.arange(100), combiner=None), values)


# ------------------------------------------------------------------ crashes and Python errors from forged content
def _run_isolated(code: str, timeout=60):
    env = dict(os.environ, SKBUILD_EDITABLE_VERBOSE="0")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=HERE)


def _nest_in_manifest(ckpt, where, depth):
    text = read_manifest_json(ckpt).decode()
    deep = "[" * depth + "]" * depth
    if where == "metadata":
        text = text.replace('"metadata": {', '"metadata": {"x": ' + deep + ", ", 1)
    elif where == "config":
        text = text.replace('"config": {', '"config": {"x": ' + deep + ", ", 1)
    else:
        text = text[:text.rindex("}")] + ', "extra": ' + deep + "}"
    write_manifest(ckpt, text.encode())


_LOAD_AND_SERVE = """
import resource, sys, time
import embedcore as ec
t = ec.Table(name="t", rows={rows}, dim={dim}, optimizer=ec.optimizers.Adagrad(0.1))
rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
cpu0 = time.process_time()
for call in (lambda: ec.load({path!r}, into=t), lambda: ec.serving.open({path!r}, verify="eager")):
    try:
        call()
        print("ok")
    except (ec.CheckpointError, ValueError, OSError) as e:
        print("refused:", type(e).__name__, str(e)[:100])
print("cpu_seconds", time.process_time() - cpu0)
print("grown_mib", (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024)
"""


def _load_and_serve_in_a_child(ckpt):
    r = _run_isolated(_LOAD_AND_SERVE.format(rows=ROWS, dim=DIM, path=str(ckpt)))
    assert r.returncode == 0, f"the process died (exit {r.returncode}): {r.stderr[-2000:]}"
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
    out = dict(line.split(" ", 1) for line in r.stdout.splitlines() if line.startswith(("cpu_seconds", "grown_mib")))
    return float(out["cpu_seconds"]), float(out["grown_mib"])


@pytest.mark.parametrize("where", ["metadata", "config"])
def test_deeply_nested_manifest_json_does_not_crash(ckpt, where):
    """A 200 KB manifest (valid checksums) nesting 100,000 arrays: refused or
    read, but the process must survive (run in a child so that a crash fails
    this test instead of ending the test run)."""
    _nest_in_manifest(ckpt, where, 100_000)
    _load_and_serve_in_a_child(ckpt)


def test_nested_manifest_json_costs_no_more_than_its_size(ckpt):
    """A 40 KB manifest nesting 20,000 arrays must be refused or read at once,
    without memory out of proportion to its size (re-indenting it, one more
    space per level, would make a string of 200 MB)."""
    _nest_in_manifest(ckpt, "top level", 20_000)
    cpu_seconds, grown_mib = _load_and_serve_in_a_child(ckpt)
    assert cpu_seconds < 1.0 and grown_mib < 50, f"{cpu_seconds:.1f} CPU s, {grown_mib:.0f} MiB for a 40 KB manifest"


def test_a_nul_byte_after_the_manifest_json_is_refused(ckpt, target):
    """Valid JSON, then a NUL and anything: not JSON text (valid checksums)."""
    write_manifest(ckpt, read_manifest_json(ckpt) + b"\0 trailing garbage")
    assert_load_fails(ckpt, target, "MANIFEST", match="NUL byte")
    assert_serving_fails(ckpt, "MANIFEST")


def test_a_byte_order_mark_before_the_manifest_json_is_refused(ckpt, target):
    """The C++ parser would skip it, Python's json (CLI, reshard) would not."""
    write_manifest(ckpt, b"\xef\xbb\xbf" + read_manifest_json(ckpt))
    assert_load_fails(ckpt, target, "MANIFEST", match="byte-order mark")
    assert_serving_fails(ckpt, "MANIFEST")


@pytest.mark.parametrize("where,key", [("top level", "generation"), ("a table", "rows"),
                                       ("the metadata", "kind")])
def test_a_key_given_twice_in_one_manifest_object_is_refused(ckpt, target, where, key):
    """JSON leaves a repeated name to the reader (the last wins in this
    parser and in Python's json, the first in others): a manifest whose
    meaning depends on the reader is refused (valid checksums), whichever
    of the two values is the true one."""
    text = read_manifest_json(ckpt).decode()
    manifest = json.loads(text)
    if where == "top level":
        text = text.replace("{", '{"generation": %d, ' % manifest["generation"], 1)
    elif where == "a table":
        text = text.replace('"name": ', '"rows": %d, "name": ' % manifest["tables"][0]["rows"], 1)
    else:
        text = text.replace('"metadata": {', '"metadata": {"kind": "table", ', 1)
    assert text.count(f'"{key}"') >= 2
    write_manifest(ckpt, text.encode())
    assert_load_fails(ckpt, target, "MANIFEST", match=f'the key "{key}" twice in one object')
    assert_serving_fails(ckpt, "MANIFEST")


def test_manifest_json_is_the_text_as_written(ckpt):
    """read_info hands back the manifest as it is on disk, not a re-indented
    dump (which, for a wide array nested 30 deep, was 40x the file)."""
    text = read_manifest_json(ckpt).decode()
    wide = "[" * 30 + ",".join(["0"] * 1000) + "]" * 30
    text = text.replace('"metadata": {', '"metadata": {"x": ' + wide + ", ", 1)
    write_manifest(ckpt, text.encode())
    assert ec.checkpoint.read_info(ckpt).manifest_json == text


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_manifest_that_is_not_a_regular_file(tmp_path, kind):
    """MANIFEST a FIFO (an open() for reading would wait for a writer forever)
    or a directory: load, serving, verify and a save raise CheckpointError at
    once. In a child, so that a hang fails this test."""
    path = tmp_path / "ckpt"
    path.mkdir()
    if kind == "fifo":
        os.mkfifo(path / "MANIFEST")
    else:
        (path / "MANIFEST").mkdir()
    code = f"""
import embedcore as ec, embedcore.cli, numpy as np
p = {str(path)!r}
t = ec.Table(name="t", rows=4, dim=2)
for call in (lambda: ec.load(p, into=t), lambda: ec.serving.open(p), lambda: ec.checkpoint.read_info(p)):
    try:
        call()
        print("no error")
    except ec.CheckpointError as e:
        assert "MANIFEST: not a regular file" in str(e), e
        print("refused")
assert embedcore.cli.main(["verify", p]) == 1
try:
    ec.save(p, t)
except ec.CheckpointError as e:
    assert "MANIFEST: not an embedcore manifest (not a regular file)" in str(e), e
    print("refused")
"""
    r = _run_isolated(code)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["refused"] * 4, r.stdout
    assert sorted(os.listdir(path)) == ["MANIFEST"]


def test_a_save_does_not_replace_a_manifest_that_is_not_ours(tmp_path):
    """A file named MANIFEST of another tool: the save refuses, and leaves it
    and everything else as it was. An empty one, or the start of ours, is replaced."""
    path = tmp_path / "ckpt"
    path.mkdir()
    (path / "MANIFEST").write_bytes(b"my own manifest, not embedcore's")
    (path / "notes.txt").write_text("mine")
    with pytest.raises(ec.CheckpointError, match=r"MANIFEST: not an embedcore manifest \(another magic\); a save "
                                                 r"here would replace it"):
        ec.save(path, make_table(seed=3))
    assert (path / "MANIFEST").read_bytes() == b"my own manifest, not embedcore's"
    assert sorted(os.listdir(path)) == ["MANIFEST", "notes.txt"]
    # Shorter than the magic: refused too, unless it is how ours starts.
    for short in (b"v1.0\n", b"x"):
        (path / "MANIFEST").write_bytes(short)
        with pytest.raises(ec.CheckpointError, match=r"another magic"):
            ec.save(path, make_table(seed=3))
        assert (path / "MANIFEST").read_bytes() == short
    (path / "MANIFEST").write_bytes(b"ECKP")
    ec.save(path, make_table(seed=3))
    (path / "MANIFEST").write_bytes(b"")
    t = make_table(seed=3)
    ec.save(path, t)
    u = make_table(seed=4)
    ec.load(path, into=u)
    assert_same_state(u, snapshot(t))
    assert (path / "notes.txt").read_text() == "mine"


SERVING_FORGERIES = [
    ("initializer with an unknown option", ["tables", 0, "config", "initializer", "bogus"], 1),
    ("initializer not an object", ["tables", 0, "config", "initializer"], "uniform"),
    ("config rows a string", ["tables", 0, "config", "rows"], "many"),
    ("config dtype unknown", ["tables", 0, "config", "dtype"], "int4"),
    ("config combiner unknown", ["tables", 0, "config", "combiner"], "max"),
    ("feature without a table", ["metadata"], {"kind": "embedding", "features": [{"name": "f"}]}),
    ("feature of an unknown table", ["metadata"], {"kind": "embedding", "features": [
        {"name": "f", "table": "nope", "max_sequence_length": 0}]}),
    ("feature list not a list", ["metadata"], {"kind": "embedding", "features": 5}),
    ("feature name not a string", ["metadata"], {"kind": "embedding", "features": [
        {"name": 5, "table": "t", "max_sequence_length": 0}]}),
    ("structure naming feature 9 of 1", ["metadata"], {"kind": "embedding", "structure": {"feature": 9},
                                                       "features": [{"name": "f", "table": "t",
                                                                     "max_sequence_length": 0}]}),
    ("structure of an unknown kind", ["metadata"], {"kind": "embedding", "structure": {"set": []},
                                                   "features": [{"name": "f", "table": "t",
                                                                 "max_sequence_length": 0}]}),
    ("metadata nesting 1,000 arrays", ["metadata", "x"], "DEEP"),
]


def test_serving_refuses_a_feature_name_that_is_not_a_string(ckpt):
    """As the C API does (its features are looked up by name)."""
    m = read_manifest(ckpt)
    m["metadata"] = {"kind": "embedding", "features": [{"name": 5, "table": "t", "max_sequence_length": 0}]}
    write_manifest(ckpt, m)
    with pytest.raises(ec.CheckpointError, match=r"metadata.features\[0\] must be an object with a string name"):
        ec.serving.open(ckpt)


@pytest.mark.parametrize("feature,message", [
    ({"name": "f", "table": "nope", "max_sequence_length": 0},
     "metadata.features[0].table names no table of the checkpoint: 'nope'"),
    ({"name": "f", "table": "t"}, "metadata.features[0].max_sequence_length must be an integer >= 0"),
    ({"name": "f", "table": "t", "max_sequence_length": -1},
     "metadata.features[0].max_sequence_length must be an integer >= 0"),
    ({"name": "f", "table": "t", "max_sequence_length": 1.5},
     "metadata.features[0].max_sequence_length must be an integer >= 0"),
])
def test_serving_names_a_bad_feature_as_the_c_api_does(ckpt, feature, message):
    """A feature naming no table, or without a whole max_sequence_length >= 0:
    the message the C API gives (it was a KeyError's text, or accepted)."""
    m = read_manifest(ckpt)
    m["metadata"] = {"kind": "embedding", "features": [feature]}
    write_manifest(ckpt, m)
    with pytest.raises(ec.CheckpointError, match=re.escape(message)):
        ec.serving.open(ckpt)


@pytest.mark.parametrize("config,what", [
    ({"combiner": "max"}, "combiner must be one of"),
    ({"combiner": None}, "combiner must be one of"),
    ({"dtype": "float64"}, "float64"),
], ids=["combiner", "null combiner", "dtype"])
def test_serving_names_the_checkpoint_and_the_table_of_a_malformed_config(ckpt, config, what):
    m = read_manifest(ckpt)
    m["tables"][0]["config"].update(config)
    write_manifest(ckpt, m)
    with pytest.raises(ec.CheckpointError) as info:
        ec.serving.open(ckpt)
    message = str(info.value)
    assert message.startswith(f"{os.path.abspath(ckpt)}: table 't': ") and what in message, message


@pytest.mark.parametrize("initializer", [{"class": "Initializer"}, {"mean": 0.0}, {"class": "Uniform", "low": "x"}],
                         ids=["base initializer", "initializer without class", "initializer argument"])
def test_serving_takes_a_config_initializer_it_cannot_rebuild_as_the_default(ckpt, initializer):
    """Serving never fills a row, and a load and verify do not read the
    config's initializer: one this version cannot rebuild serves with
    TableConfig's default (docs/format.md)."""
    m = read_manifest(ckpt)
    m["tables"][0]["config"]["initializer"] = initializer
    write_manifest(ckpt, m)
    served = ec.serving.open(ckpt)
    assert isinstance(served.tables["t"].config.initializer, ec.initializers.TruncatedNormal)


@pytest.mark.parametrize("label,path,value", SERVING_FORGERIES, ids=[x[0] for x in SERVING_FORGERIES])
def test_serving_refuses_forged_configs_with_checkpoint_error(ckpt, label, path, value):
    """serving.open reads the table configs and feature metadata that a load
    ignores; forged ones (valid checksums) must raise CheckpointError (a
    ValueError), not TypeError, KeyError, IndexError or RecursionError."""
    m = read_manifest(ckpt)
    obj = m
    for k in path[:-1]:
        obj = obj[k]
    obj[path[-1]] = [] if value == "DEEP" else value
    text = json.dumps(m, indent=1)
    if value == "DEEP":
        text = text.replace('"x": []', '"x": ' + "[" * 1000 + "]" * 1000)
    write_manifest(ckpt, text.encode())
    try:
        ec.serving.open(ckpt, verify="eager")
    except ValueError:  # CheckpointError is one
        pass
    except Exception as e:  # noqa: BLE001 - any other type is the finding
        pytest.fail(f"serving.open raised {type(e).__name__}: {e}")
    t = make_table(seed=4)
    if value == "DEEP":
        # The format caps JSON nesting (docs/format.md), so every reader refuses it.
        with pytest.raises(ec.CheckpointError, match="nests deeper"):
            ec.load(ckpt, into=t)
        return
    # A load reads none of that, so it is not refused.
    ec.load(ckpt, into=t)
