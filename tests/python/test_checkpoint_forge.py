"""Tools to read and forge checkpoint files (format v1) in tests, and the
tests of those tools against the engine.

The other checkpoint tests (and tests/fuzz) import this module: it holds a
pure-Python CRC-32C and the 64-byte header layout of core/checkpoint/format.h,
so a test can rewrite a manifest's JSON and re-seal its checksums, making a
manifest whose *content* is malicious while every checksum is valid.

Header (little-endian, 64 bytes):
  magic[8] | u16 major | u16 minor | u32 0x01020304 | u32 64 | u8 kind |
  u8 dtype | u16 0 | i64 rows | i64 cols | u64 payload_offset |
  u64 payload_bytes | u32 aux | u32 crc32c(bytes 0..60)
Manifest: kind 0, dtype 0, rows 0, cols 0, payload_offset 64,
  payload_bytes = len(json), aux = crc32c(json).
Data file: kind 1, dtype code, rows, cols, payload_offset 4096,
  payload_bytes, aux = checksum block size; zero padding up to 4096.
"""
from __future__ import annotations

import json
import os
import struct

import numpy as np

import embedcore as ec

FORMAT_MINOR = ec.FORMAT_VERSION[1]  # what this library writes

MANIFEST_MAGIC = b"ECKPMANI"
DATA_MAGIC = b"ECKPDATA"
HEADER_BYTES = 64
DATA_OFFSET = 4096
BLOCK_BYTES = 4 << 20
_HEADER = struct.Struct("<8sHHIIBBHqqQQII")
assert _HEADER.size == HEADER_BYTES
DTYPE_CODES = {"float32": 0, "float16": 1, "bfloat16": 2}

# ------------------------------------------------------------------ CRC-32C
_CRC_TABLE = []
for _i in range(256):
    _c = _i
    for _ in range(8):
        _c = (_c >> 1) ^ (0x82F63B78 if _c & 1 else 0)
    _CRC_TABLE.append(_c)
del _i, _c


def crc32c(data, crc: int = 0) -> int:
    """CRC-32C (Castagnoli, reflected, init and final xor 0xffffffff),
    table-driven; `crc` continues an earlier call's result."""
    c = crc ^ 0xFFFFFFFF
    table = _CRC_TABLE
    for b in bytes(data):
        c = table[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


# ------------------------------------------------------------------ headers
def unpack_header(raw: bytes) -> dict:
    (magic, major, minor, bom, header_bytes, kind, dtype, reserved, rows, cols, payload_offset, payload_bytes, aux,
     header_crc) = _HEADER.unpack(raw[:HEADER_BYTES])
    return dict(magic=magic, major=major, minor=minor, bom=bom, header_bytes=header_bytes, kind=kind, dtype=dtype,
                reserved=reserved, rows=rows, cols=cols, payload_offset=payload_offset, payload_bytes=payload_bytes,
                aux=aux, header_crc=header_crc)


def pack_header(h: dict, seal: bool = True) -> bytes:
    """Packs a header dict; seal=True recomputes the header checksum."""
    fields = [h["magic"], h["major"], h["minor"], h["bom"], h["header_bytes"], h["kind"], h["dtype"], h["reserved"],
              h["rows"], h["cols"], h["payload_offset"], h["payload_bytes"], h["aux"], h.get("header_crc", 0)]
    raw = _HEADER.pack(*fields)
    if seal:
        raw = raw[:60] + struct.pack("<I", crc32c(raw[:60]))
    return raw


def manifest_header(json_bytes: bytes, major: int = 1, minor: int = FORMAT_MINOR) -> bytes:
    return pack_header(dict(magic=MANIFEST_MAGIC, major=major, minor=minor, bom=0x01020304, header_bytes=64, kind=0,
                            dtype=0, reserved=0, rows=0, cols=0, payload_offset=64, payload_bytes=len(json_bytes),
                            aux=crc32c(json_bytes)))


def data_header(dtype: str, rows: int, cols: int, payload_bytes: int, block_bytes: int = BLOCK_BYTES,
                major: int = 1, minor: int = FORMAT_MINOR) -> bytes:
    return pack_header(dict(magic=DATA_MAGIC, major=major, minor=minor, bom=0x01020304, header_bytes=64, kind=1,
                            dtype=DTYPE_CODES[dtype], reserved=0, rows=rows, cols=cols, payload_offset=DATA_OFFSET,
                            payload_bytes=payload_bytes, aux=block_bytes))


# ------------------------------------------------------------------ manifests
def manifest_path(ckpt) -> str:
    return os.path.join(os.fspath(ckpt), "MANIFEST")


def read_manifest_json(ckpt) -> bytes:
    with open(manifest_path(ckpt), "rb") as f:
        raw = f.read()
    return raw[HEADER_BYTES:]


def read_manifest(ckpt) -> dict:
    return json.loads(read_manifest_json(ckpt))


def write_manifest(ckpt, manifest, major: int = 1, minor: int = FORMAT_MINOR) -> None:
    """Writes `manifest` (a dict, a str or bytes of JSON, or any bytes) as the
    checkpoint's MANIFEST with a valid header and valid checksums."""
    if isinstance(manifest, dict):
        payload = json.dumps(manifest, indent=1).encode()
    elif isinstance(manifest, str):
        payload = manifest.encode()
    else:
        payload = bytes(manifest)
    with open(manifest_path(ckpt), "wb") as f:
        f.write(manifest_header(payload, major, minor) + payload)


def data_files(ckpt) -> list:
    """The data files the manifest names, values first: (table, array, entry)."""
    out = []
    for t in read_manifest(ckpt)["tables"]:
        for e in t["values"]:
            out.append((t["name"], "values", e))
        for slot, entries in t["slots"].items():
            for e in entries:
                out.append((t["name"], slot, e))
    return out


def payload_crcs(payload: bytes, block_bytes: int = BLOCK_BYTES) -> list:
    return [crc32c(payload[i:i + block_bytes]) for i in range(0, len(payload), block_bytes)]


def flip_byte(path, offset: int, mask: int = 0xFF) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        assert len(b) == 1, f"{path}: no byte at {offset}"
        f.seek(offset)
        f.write(bytes([b[0] ^ mask]))


# ------------------------------------------------------------------ tables
def snapshot(table) -> dict:
    return {
        "values": np.array(table.values(), copy=True),
        "slots": {k: np.array(v, copy=True) for k, v in table.slots().items()},
        "step": table.step,
    }


def assert_same_state(table, snap, what: str = "") -> None:
    now = snapshot(table)
    where = f"table '{table.name}'" + (f" ({what})" if what else "")
    assert now["step"] == snap["step"], f"{where}: step {now['step']} != {snap['step']}"
    assert now["values"].tobytes() == snap["values"].tobytes(), f"{where}: values differ"
    assert sorted(now["slots"]) == sorted(snap["slots"]), f"{where}: slot names differ"
    for k in snap["slots"]:
        assert now["slots"][k].tobytes() == snap["slots"][k].tobytes(), f"{where}: slot {k} differs"


def train(table, rng, steps: int, batch: int = 16, max_len: int = 4) -> None:
    """`steps` optimizer steps of random bags and gradients (from `rng`)."""
    for _ in range(steps):
        lengths = rng.integers(0, max_len + 1, batch)
        offsets = np.zeros(batch + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        ids = rng.integers(0, table.rows, int(offsets[-1])).astype(np.int64)
        grads = rng.standard_normal((batch, table.dim)).astype(np.float32)
        table.apply_gradients(ids, offsets, grads)


# ------------------------------------------------------------------ tests of the tools
def test_crc32c_known_vectors():
    assert crc32c(b"") == 0
    assert crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value
    assert crc32c(bytes(32)) == 0x8A9136AA  # RFC 3720, 32 bytes of zeros
    assert crc32c(b"\xff" * 32) == 0x62A8AB43  # RFC 3720, 32 bytes of ones
    assert crc32c(bytes(range(32))) == 0x46DD794E  # RFC 3720, incrementing
    assert crc32c(b"6789", crc32c(b"12345")) == 0xE3069283


def test_tools_reproduce_what_the_engine_writes(tmp_path):
    t = ec.Table(name="t", rows=40, dim=3, optimizer=ec.optimizers.Adagrad(0.1),
                 initializer=ec.initializers.Uniform(-1, 1, seed=3))
    ec.save(tmp_path / "c", t)
    raw = open(manifest_path(tmp_path / "c"), "rb").read()
    assert raw[:HEADER_BYTES] == manifest_header(raw[HEADER_BYTES:])
    for _, _, e in data_files(tmp_path / "c"):
        blob = open(tmp_path / "c" / e["path"], "rb").read()
        payload = blob[DATA_OFFSET:]
        assert blob[:HEADER_BYTES] == data_header(e["dtype"], e["rows"], e["cols"], len(payload))
        assert blob[HEADER_BYTES:DATA_OFFSET] == bytes(DATA_OFFSET - HEADER_BYTES)
        assert payload_crcs(payload) == e["crc32c"]
    # A rewritten manifest with re-sealed checksums is accepted as it is.
    m = read_manifest(tmp_path / "c")
    m["metadata"]["note"] = "forged"
    write_manifest(tmp_path / "c", m)
    assert ec.checkpoint.read_info(tmp_path / "c").generation == m["generation"]
    t2 = ec.Table(name="t", rows=40, dim=3, optimizer=ec.optimizers.Adagrad(0.1))
    ec.load(tmp_path / "c", into=t2)
    assert np.array_equal(t2.values(), t.values())
