"""Fuzz target of checkpoint reading (atheris / libFuzzer).

    python tests/fuzz/fuzz_checkpoint.py [libFuzzer flags] WORK_CORPUS tests/fuzz/corpus
    tests/fuzz/run_fuzz.sh SECONDS            # what CI runs

Each input is one selector byte and a body. The selector picks a base
checkpoint (the golden checkpoints of tests/golden/v1, copied to a scratch
directory) and what the body replaces in it:

  mode 0: the manifest's JSON; the target wraps it in a header with valid
          checksums, so the fuzzer reaches the parser and what reads the
          parsed manifest (most inputs would otherwise stop at a checksum);
  mode 1: the whole MANIFEST file, header included, as it is;
  mode 2: the values file of the checkpoint's first table, as it is.

    selector = mode * len(BASES) + base index      (modulo 3 * len(BASES))

Then ``ec.serving.open(path, verify="eager")`` (and a lookup of every row of
each table it opens) and ``ec.load(path, into=<tables of the base>)`` run.
Accepted outcomes: success, ``ec.CheckpointError``, ``ValueError`` or
``OSError``; a load that fails must leave its target unchanged. Anything
else, an exception of another type or a crash, is a finding.

EMBEDCORE_FUZZ_IGNORE=KeyError,TypeError (exception type names) accepts more
types too: an aid to look past known findings while exploring, never for CI.
"""
from __future__ import annotations

import json
import os
import shutil
import struct
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
GOLDEN = os.path.join(HERE, os.pardir, "golden", "v1")
BASES = ["opt_adagrad", "opt_ftrl", "dtype_bfloat16", "export_bfloat16", "embedding"]
MODES = 3

# ------------------------------------------------------------------ CRC-32C and the manifest header
_CRC_TABLE = []
for _i in range(256):
    _c = _i
    for _ in range(8):
        _c = (_c >> 1) ^ (0x82F63B78 if _c & 1 else 0)
    _CRC_TABLE.append(_c)


def crc32c(data: bytes) -> int:
    c = 0xFFFFFFFF
    t = _CRC_TABLE
    for b in data:
        c = t[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def manifest_file(json_bytes: bytes, major: int = 1, minor: int = 0) -> bytes:
    """A MANIFEST holding `json_bytes` with a valid header and checksums."""
    head = b"ECKPMANI" + struct.pack("<HHIIBBHqqQQI", major, minor, 0x01020304, 64, 0, 0, 0, 0, 0, 64,
                                     len(json_bytes), crc32c(json_bytes))
    return head + struct.pack("<I", crc32c(head)) + json_bytes


def encode(base: str, mode: int, body: bytes) -> bytes:
    return bytes([mode * len(BASES) + BASES.index(base)]) + body


# ------------------------------------------------------------------ the target
_state = {}
_ACCEPTED = None


def _accepted():
    import embedcore as ec

    import builtins

    names = [n.strip() for n in os.environ.get("EMBEDCORE_FUZZ_IGNORE", "").split(",") if n.strip()]
    extra = tuple(getattr(builtins, n, None) for n in names)
    return (ec.CheckpointError, ValueError, OSError) + tuple(e for e in extra if isinstance(e, type))


def setup(scratch: str = None) -> None:
    """Copies the bases to a scratch directory and builds their target tables."""
    global _ACCEPTED
    import embedcore as ec

    ec.set_num_threads(1)
    scratch = scratch or tempfile.mkdtemp(prefix="embedcore-fuzz-")
    _state["scratch"] = scratch
    _state["bases"] = []
    for name in BASES:
        path = os.path.join(scratch, name)
        shutil.rmtree(path, ignore_errors=True)
        shutil.copytree(os.path.join(GOLDEN, name), path)
        info = ec.checkpoint.read_info(path)
        manifest = json.loads(info.manifest_json)
        tables = []
        for i, _ in enumerate(info.table_names):
            cfg = ec.checkpoint.config_from_json(json.loads(info.table_config_json(i)))
            tables.append(ec.Table(cfg))
        values_file = manifest["tables"][0]["values"][0]["path"]
        originals = {f: open(os.path.join(path, f), "rb").read() for f in ("MANIFEST", values_file)}
        _state["bases"].append({"path": path, "tables": tables, "values_file": values_file, "originals": originals})
    _ACCEPTED = _accepted()


def _snapshot(tables):
    import numpy as np

    return [(np.array(t.values(), copy=True), {k: np.array(v, copy=True) for k, v in t.slots().items()}, t.step)
            for t in tables]


def _same(tables, snap):
    for t, (values, slots, step) in zip(tables, snap):
        if t.step != step or t.values().tobytes() != values.tobytes():
            return False
        for k, v in slots.items():
            if t.slots()[k].tobytes() != v.tobytes():
                return False
    return True


def check(data: bytes) -> None:
    """The entry function: one input; raises on a finding."""
    import numpy as np
    import embedcore as ec

    if not data:
        return
    if "bases" not in _state:
        setup()
    sel, body = data[0] % (MODES * len(BASES)), data[1:]
    base = _state["bases"][sel % len(BASES)]
    mode = sel // len(BASES)
    path = base["path"]
    target = "MANIFEST" if mode < 2 else base["values_file"]
    with open(os.path.join(path, target), "wb") as f:
        f.write(manifest_file(body) if mode == 0 else body)
    try:
        try:
            served = ec.serving.open(path, verify="eager")
            for t in served.tables.values():
                ids = np.arange(min(t.rows, 1 << 16), dtype=np.int64)
                t.lookup(ids, combiner=None)
        except _ACCEPTED:
            pass
        tables = base["tables"]
        before = _snapshot(tables)
        try:
            ec.load(path, into=tables if len(tables) > 1 else tables[0])
        except _ACCEPTED:
            if not _same(tables, before):
                raise AssertionError("a load that failed changed its target")
    finally:
        with open(os.path.join(path, target), "wb") as f:
            f.write(base["originals"][target])


def corpus_seeds() -> dict:
    """The seed corpus: file name -> input (see tests/fuzz/corpus)."""
    seeds = {}
    for name in BASES:
        raw = open(os.path.join(GOLDEN, name, "MANIFEST"), "rb").read()
        seeds[f"{name}.json"] = encode(name, 0, raw[64:])
    seeds["opt_adagrad.manifest"] = encode("opt_adagrad", 1, open(os.path.join(GOLDEN, "opt_adagrad", "MANIFEST"),
                                                                  "rb").read())
    m = json.loads(open(os.path.join(GOLDEN, "dtype_bfloat16", "MANIFEST"), "rb").read()[64:])
    data_file = m["tables"][0]["values"][0]["path"]
    seeds["dtype_bfloat16.values"] = encode("dtype_bfloat16", 2,
                                            open(os.path.join(GOLDEN, "dtype_bfloat16", data_file), "rb").read())
    return seeds


def write_corpus(out_dir: str = os.path.join(HERE, "corpus")) -> None:
    os.makedirs(out_dir, exist_ok=True)
    for name, data in corpus_seeds().items():
        with open(os.path.join(out_dir, name), "wb") as f:
            f.write(data)


def main(argv) -> None:
    import atheris

    import embedcore  # noqa: F401

    # The editable install imports through a custom loader, which
    # instrument_imports() does not see into: instrument what is loaded.
    atheris.instrument_all()
    setup()
    atheris.Setup(argv, check)
    atheris.Fuzz()


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--write-corpus":
        write_corpus()
    else:
        main(sys.argv)
