"""Reading NVIDIA SparseOperationKit (SOK) dumps, so SOK users can move over.

Two layouts are read:

- v1 (``sok.Saver`` of SOK 1.x): ``<var>_keys.file`` holding the keys (int64,
  or uint32) and ``<var>_values.file`` holding float32 ``[n, dim]`` rows.
  Raw bytes, no header: the key dtype and ``dim`` are inferred from the two
  sizes, or given when the sizes fit both.
- v2 (SOK 2.x): ``<name>-key``, ``<name>-weight`` and
  ``<name>-<Optimizer>-<slot>``, each with a 296-byte header (a 256-byte
  name, a 4-byte big-endian kind: 0 key, 1 values, 2 optimizer state; a
  32-byte slot name; a 4-byte big-endian dtype code: 0 i32, 1 i64, 2 u32,
  3 u64, 4 f16, 5 f32, 6 f64), then little-endian row-major data. SOK pads
  the name fields with leading spaces (``rjust``); NUL padding is read too.

Every file of a dump must belong to a variable: a values or slot file
whose key file is missing, or a slot file of no dumped variable, is refused
(CheckpointError naming the files) rather than skipped.

Keys are row indices: key ``k`` becomes row ``k`` of the table, whose row
count is ``max(key) + 1`` unless given.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Dict, Optional, Union

import numpy as np

from .checkpoint import CheckpointError, check_destination, native_path

__all__ = ["SokVariable", "read_dump", "to_tables", "save_tables", "convert"]

_V2_HEADER = 296
_V2_DTYPES = {0: np.dtype("<i4"), 1: np.dtype("<i8"), 2: np.dtype("<u4"), 3: np.dtype("<u8"),
              4: np.dtype("<f2"), 5: np.dtype("<f4"), 6: np.dtype("<f8")}
# SOK's optimizer slot names -> embedcore's (TensorFlow's) slot names.
_SLOT_NAMES = {
    "adagrad": {"accum": "accumulators", "accumulator": "accumulators", "accumulators": "accumulators"},
    "adam": {"m": "momenta", "v": "velocities", "momenta": "momenta", "velocities": "velocities"},
    "ftrl": {"accum": "accumulators", "accumulator": "accumulators", "linear": "linears", "n": "accumulators",
             "z": "linears", "accumulators": "accumulators", "linears": "linears"},
}


@dataclass
class SokVariable:
    """One dumped variable: keys [n], values [n, dim], and optimizer slots."""

    name: str
    keys: np.ndarray
    values: np.ndarray
    optimizer: Optional[str] = None
    slots: Dict[str, np.ndarray] = field(default_factory=dict)
    slot_files: Dict[str, str] = field(default_factory=dict)  # slot name -> the file it came from
    key_file: str = ""  # the file the keys came from


def _header_text(field: bytes) -> str:
    """A v2 header's name field: SOK writes ``name.rjust(n, " ")`` and reads
    it back with ``.strip()``; NUL padding (other writers) is taken too."""
    return field.strip(b" \0").split(b"\0", 1)[0].decode("utf-8", "replace").strip(" ")


def _read_v2(path: str, want_kind: int):
    size = os.path.getsize(path)
    if size < _V2_HEADER:
        raise CheckpointError(f"{path}: truncated SOK v2 file ({size} bytes, the header alone is {_V2_HEADER})")
    with open(path, "rb") as f:
        header = f.read(_V2_HEADER)
        name = _header_text(header[:256])
        kind = int.from_bytes(header[256:260], "big")
        slot = _header_text(header[260:292])
        code = int.from_bytes(header[292:296], "big")
        if kind != want_kind:
            raise CheckpointError(f"{path}: SOK v2 header says kind {kind}, expected {want_kind}")
        if code not in _V2_DTYPES:
            raise CheckpointError(f"{path}: SOK v2 header has unknown dtype code {code}")
        dtype = _V2_DTYPES[code]
        body = size - _V2_HEADER
        if body % dtype.itemsize:
            raise CheckpointError(f"{path}: {body} data bytes are not a whole number of {dtype.name} values")
        data = np.fromfile(f, dtype=dtype, count=body // dtype.itemsize)
    return name, slot, data


def _keys_as_rows(keys: np.ndarray, where: str) -> np.ndarray:
    if keys.dtype.kind == "u" and keys.size and int(keys.max()) > np.iinfo(np.int64).max:
        raise CheckpointError(f"{where}: key {int(keys.max())} does not fit a row index")
    k = keys.astype(np.int64)
    if k.size and k.min() < 0:
        raise CheckpointError(f"{where}: negative key {int(k.min())}")
    return k


def read_dump(src, dim: Optional[int] = None, key_dtype: Optional[str] = None) -> Dict[str, SokVariable]:
    """Reads every SOK variable dumped in the directory `src` (v1 and v2)."""
    if dim is not None and (isinstance(dim, bool) or not isinstance(dim, (int, np.integer))):
        raise TypeError(f"dim must be an int, got {dim!r}")
    if dim is not None and dim < 1:
        raise ValueError(f"dim must be >= 1, got {dim}")
    src = native_path(src, "src")
    if not os.path.isdir(src):
        raise CheckpointError(f"{src}: not a directory of SOK dump files")
    names = sorted(os.listdir(src))
    out: Dict[str, SokVariable] = {}
    for n in names:
        m = re.fullmatch(r"(.+)_keys\.file", n)
        if m:
            var = m.group(1)
            out[var] = _read_v1(src, var, dim, key_dtype)
    v2 = [m.group(1) for m in (re.fullmatch(r"(.+)-key", n) for n in names) if m]
    for var in v2:
        if var in out:
            raise CheckpointError(f"{src}: variable {var!r} is dumped twice, as SOK v1 ({var}_keys.file) and v2 "
                                  f"({var}-key); keep one")
        out[var] = _read_v2_var(src, var, names, v2, dim)
    used = set()
    for var, v in out.items():
        used.update((f"{var}_keys.file", f"{var}_values.file", f"{var}-key", f"{var}-weight"))
        used.update(os.path.basename(f) for f in v.slot_files.values())
    stray = [n for n in names if n not in used and _is_dump_file(src, n)]
    if stray:
        raise CheckpointError(
            f"{src}: SOK dump file(s) {', '.join(stray)} belong to no dumped variable (a values or slot file whose "
            "key file (<var>_keys.file, <name>-key) is missing, or a slot file of a variable not in the dump); "
            "nothing was converted: restore the missing files, or remove these to convert the rest")
    if not out:
        raise CheckpointError(f"{src}: no SOK dump files (<var>_keys.file or <name>-key) found")
    return out


def _is_dump_file(src: str, name: str) -> bool:
    """Whether `name` is a SOK dump file by its name (v1 values, v2 weights)
    or, for a v2 optimizer slot (``<name>-<Optimizer>-<slot>``), its header."""
    if name.endswith(("_values.file", "_keys.file", "-weight", "-key")):
        return True
    if not re.fullmatch(r".+-[A-Za-z]+-.+", name):
        return False
    path = os.path.join(src, name)
    try:
        if not os.path.isfile(path) or os.path.getsize(path) < _V2_HEADER:
            return False
        with open(path, "rb") as f:
            header = f.read(_V2_HEADER)
    except OSError:
        return False
    return int.from_bytes(header[256:260], "big") == 2 and int.from_bytes(header[292:296], "big") in _V2_DTYPES


def _read_v1(src: str, var: str, dim: Optional[int], key_dtype: Optional[str]) -> SokVariable:
    kpath = os.path.join(src, f"{var}_keys.file")
    vpath = os.path.join(src, f"{var}_values.file")
    if not os.path.exists(vpath):
        raise CheckpointError(f"{vpath}: missing (SOK v1 dumps come in _keys.file / _values.file pairs)")
    for path in (kpath, vpath):  # (a FIFO's read would wait for a writer: the conversion hung)
        if os.path.exists(path) and not os.path.isfile(path):
            raise CheckpointError(f"{path}: not a regular file (a SOK dump's files are)")
    kb, vb = os.path.getsize(kpath), os.path.getsize(vpath)
    if vb % 4:
        raise CheckpointError(f"{vpath}: {vb} bytes are not whole float32 values")
    candidates = []
    for kd in (["int64", "uint32"] if key_dtype is None else [key_dtype]):
        if kd not in ("int64", "uint32"):
            raise ValueError(f"key_dtype must be 'int64' or 'uint32', got {key_dtype!r}")
        size = 8 if kd == "int64" else 4
        if kb % size:
            continue
        n = kb // size
        if n == 0:
            if vb != 0:
                raise CheckpointError(f"{kpath}: no keys, but {vpath} holds {vb} bytes of values")
            candidates = [("int64", dim or 1)]  # no keys: their dtype does not matter
            break
        if vb == 0:
            raise CheckpointError(f"{vpath}: empty, but {kpath} holds {kb} bytes of keys")
        if (vb // 4) % n:
            continue
        d = (vb // 4) // n
        if dim is None or d == dim:
            candidates.append((kd, d))
    if not candidates:
        raise CheckpointError(f"{kpath}, {vpath}: sizes {kb} and {vb} bytes do not fit int64 or uint32 keys"
                              + (f" with dim {dim}" if dim else ""))
    if len(candidates) > 1:
        raise CheckpointError(f"{kpath}: the sizes fit both int64 keys (dim {candidates[0][1]}) and uint32 keys "
                              f"(dim {candidates[1][1]}); give dim= or key_dtype= (embedcore convert: --dim or --key-dtype)")
    kd, d = candidates[0]
    keys = np.fromfile(kpath, dtype="<i8" if kd == "int64" else "<u4")
    values = np.fromfile(vpath, dtype="<f4").reshape(len(keys), d) if len(keys) else np.zeros((0, d), np.float32)
    return SokVariable(var, _keys_as_rows(keys, kpath), _finite_float32(values, vpath, keys), key_file=kpath)


def _finite_float32(rows: np.ndarray, path: str, keys: np.ndarray) -> np.ndarray:
    """A dump file's rows (one per key) as float32, or CheckpointError naming
    the file, the key, the column and the value of the first that is not
    finite, or not once made float32 (a float64 beyond float32's range): a
    checkpoint holds finite values only."""
    with np.errstate(over="ignore", invalid="ignore"):
        out = rows.astype(np.float32, copy=False)
    bad = ~np.isfinite(out)
    if bad.any():
        i, c = (int(x) for x in np.argwhere(bad)[0])
        v = rows[i, c]
        why = "is not finite" if not np.isfinite(v) else "overflows float32"
        raise CheckpointError(f"{path}: the value {float(v)!r} of key {int(keys[i])} (column {c}) {why}; a checkpoint "
                              "holds finite values only")
    return out


def _slot_owner(filename: str, variables) -> Optional[str]:
    """The variable a `<name>-<Optimizer>-<slot>` file belongs to: the longest
    variable name it starts with (so "emb-b-Adam-m" is emb-b's, not emb's)."""
    if any(filename in (f"{v}-key", f"{v}-weight") for v in variables):
        return None
    owners = [v for v in variables
              if filename.startswith(v + "-") and re.fullmatch(r"[A-Za-z]+-.+", filename[len(v) + 1:])
              and filename[len(v) + 1:] not in ("key", "weight")]
    return max(owners, key=len) if owners else None


def _read_v2_var(src: str, var: str, names, variables, dim: Optional[int] = None) -> SokVariable:
    kpath = os.path.join(src, f"{var}-key")
    wpath = os.path.join(src, f"{var}-weight")
    if not os.path.exists(wpath):
        raise CheckpointError(f"{wpath}: missing (a SOK v2 dump has <name>-key and <name>-weight)")
    _, _, keys = _read_v2(kpath, 0)
    if keys.dtype.kind not in "iu":
        raise CheckpointError(f"{kpath}: keys must be integers, got {keys.dtype}")
    _, _, w = _read_v2(wpath, 1)
    if w.dtype.kind != "f":
        raise CheckpointError(f"{wpath}: weights must be floats, the header says {w.dtype}")
    n = len(keys)
    if n == 0 or w.size % n or (n and not w.size):  # (0 values for n keys would be rows of 0 values)
        if not (n == 0 and w.size == 0):
            raise CheckpointError(f"{wpath}: {w.size} values do not split into {n} rows")
    d = w.size // n if n else (dim or 1)
    if dim is not None and d != dim:
        raise CheckpointError(f"{wpath}: rows of {d} values ({w.size} values for {n} keys), but dim={dim} was given")
    values = _finite_float32(w.reshape(n, d), wpath, keys)
    var_obj = SokVariable(var, _keys_as_rows(keys, kpath), values, key_file=kpath)
    for n2 in names:
        if _slot_owner(n2, variables) != var:
            continue
        opt, slot = n2[len(var) + 1:].split("-", 1)
        spath = os.path.join(src, n2)
        _, header_slot, s = _read_v2(spath, 2)
        if s.dtype.kind != "f":
            raise CheckpointError(f"{spath}: optimizer state must be floats, the header says {s.dtype}")
        if s.size != values.size:
            raise CheckpointError(f"{spath}: {s.size} values, expected {values.size} (one per value)")
        if var_obj.optimizer not in (None, opt):
            raise CheckpointError(f"{spath}: optimizer {opt}, but {var!r} also has {var_obj.optimizer} slots; "
                                  "keep one optimizer's files")
        if (header_slot or slot) in var_obj.slots:
            raise CheckpointError(f"{spath}: a second file of slot {header_slot or slot!r} for {var!r}")
        var_obj.optimizer = opt
        var_obj.slots[header_slot or slot] = _finite_float32(s.reshape(values.shape), spath, keys)
        var_obj.slot_files[header_slot or slot] = spath
    return var_obj


def _optimizer_of(name: str, v: SokVariable):
    """The embedcore optimizer that takes every slot of `v` (Adagrad, Adam or
    FTRL, default hyper-parameters but the form of the Keras optimizers that
    SOK's wrap: Adagrad's epsilon is Keras's 1e-7, so accumulators of 0
    convert; Adam is bias-corrected with epsilon outside the square root),
    and SOK's slot name for each of its slots; CheckpointError,
    naming the files, for any slot that would be lost or left at its initial
    value."""
    from . import optimizers as _opt

    files = ", ".join(f"{v.slot_files.get(s, s)}" for s in v.slots)
    hint = "convert with include_optimizer=False (--no-optimizer) to take the values alone"
    mapping = _SLOT_NAMES.get((v.optimizer or "").lower())
    if mapping is None:
        raise CheckpointError(f"SOK variable {name!r}: optimizer {v.optimizer} (slots in {files}) has no embedcore "
                              f"equivalent (embedcore takes Adagrad, Adam and FTRL slots); {hint}")
    optimizer = {"adagrad": lambda: _opt.Adagrad(epsilon=1e-7),
                 "adam": lambda: _opt.Adam(epsilon=1e-7, bias_correction=True, sum_inside_sqrt=False),
                 "ftrl": _opt.FTRL}[v.optimizer.lower()]()
    ours = {}
    for sok_slot in v.slots:
        slot = mapping.get(sok_slot.lower())
        if slot is None:
            raise CheckpointError(f"{v.slot_files.get(sok_slot, sok_slot)}: {v.optimizer} slot {sok_slot!r} of SOK "
                                  f"variable {name!r} is none of {sorted(set(mapping))}; {hint}")
        if slot in ours:
            raise CheckpointError(f"SOK variable {name!r}: slots {ours[slot]!r} and {sok_slot!r} are both "
                                  f"{v.optimizer}'s {slot}; keep one, or {hint}")
        ours[slot] = sok_slot
    missing = [s for s in optimizer.slot_names if s not in ours]
    if missing:
        raise CheckpointError(f"SOK variable {name!r}: the dump holds {v.optimizer} slot(s) {sorted(v.slots)} "
                              f"({files}) but not {', '.join(missing)}, which {v.optimizer} needs; {hint}")
    return optimizer, ours


def _per_variable(arg, variables, what: str) -> dict:
    """`arg` (None, one value for every variable, or a dict by variable
    name) as a dict by variable name; a name of no variable is refused."""
    if not isinstance(arg, dict):
        return {name: arg for name in variables}
    unknown = sorted(set(arg) - set(variables))
    if unknown:
        raise CheckpointError(f"{what}: no SOK variable named {', '.join(map(repr, unknown))} in the dump (it holds "
                              f"{', '.join(map(repr, variables))})")
    return {name: arg.get(name) for name in variables}


def _check_variable(name, v) -> None:
    """A SokVariable as to_tables reads it (one made by hand too): int keys
    [n], >= 0; float values [n, dim]."""
    if not isinstance(v, SokVariable):
        raise TypeError(f"sok.to_tables: variables[{name!r}] must be a SokVariable, got {type(v).__name__}")
    for field in ("keys", "values"):
        if not isinstance(getattr(v, field), np.ndarray):
            raise TypeError(f"SOK variable {name!r}: {field} must be a NumPy array, got "
                            f"{type(getattr(v, field)).__name__}")
    keys, values = v.keys, v.values
    if keys.ndim != 1 or keys.dtype.kind not in "iu":
        raise TypeError(f"SOK variable {name!r}: keys must be a 1-D integer array, got {keys.dtype} of shape "
                        f"{keys.shape}")
    if values.ndim != 2 or values.dtype.kind != "f":
        raise TypeError(f"SOK variable {name!r}: values must be a 2-D float array [keys, dim], got {values.dtype} "
                        f"of shape {values.shape}")
    if values.shape[0] != keys.shape[0]:
        raise ValueError(f"SOK variable {name!r}: {keys.shape[0]} keys and {values.shape[0]} rows of values")
    if keys.size and keys.min() < 0:
        raise ValueError(f"SOK variable {name!r}: negative key {int(keys.min())} (a key is a row)")
    if not isinstance(v.slots, dict):
        raise TypeError(f"SOK variable {name!r}: slots must be a dict of arrays by name, got {type(v.slots).__name__}")
    for slot, array in v.slots.items():  # (as its values: a row per key, dim columns)
        if not isinstance(array, np.ndarray) or array.dtype.kind != "f" or array.shape != values.shape:
            got = (f"{array.dtype} of shape {array.shape}" if isinstance(array, np.ndarray)
                   else type(array).__name__)
            raise ValueError(f"SOK variable {name!r}: slot {slot!r} must be a float array of the values' shape "
                             f"{values.shape}, got {got}")


def to_tables(variables: Dict[str, SokVariable], rows: Union[None, int, Dict[str, int]] = None,
              include_optimizer: bool = True, progress=None, names: Optional[Dict[str, str]] = None):
    """Builds one embedcore Table per variable, row k holding key k's values,
    and with `include_optimizer` its optimizer slots (Adagrad, Adam or FTRL,
    every slot present; CheckpointError otherwise, so that no optimizer state
    is dropped without a word). A variable without slots (or every one, when
    `include_optimizer` is False) gets a table without optimizer.

    rows: the tables' row count: one number for every table, or a dict from
        SOK variable name to rows (variables it leaves out: largest key + 1).
    names: a dict from SOK variable name to the table's name (others keep
        the SOK name).

    `progress(nbytes)`, when given, is called as each block of values or
    slots (up to 64 MiB) is written into a table."""
    from .checkpoint import _check_flag
    from .config import TableConfig
    from .initializers import Zeros
    from .table import Table

    include_optimizer = _check_flag(include_optimizer, "include_optimizer", "sok.to_tables")
    if not isinstance(variables, dict):
        raise TypeError(f"sok.to_tables: variables must be a dict of SokVariable by name (read_dump's), got "
                        f"{type(variables).__name__}")
    for name, v in variables.items():
        _check_variable(name, v)
    row_counts = _per_variable(rows, variables, "rows")
    # None: the SOK name; an empty name is refused below, not taken as None.
    table_names = {name: name if new is None else new
                   for name, new in _per_variable(names, variables, "names").items()}
    for name, new in table_names.items():
        if not isinstance(new, str):
            raise TypeError(f"names: the table name for SOK variable {name!r} must be a non-empty str, got {new!r}")
        if not new:
            raise ValueError(f"names: the table name for SOK variable {name!r} must be a non-empty str, got {new!r}")
    clash = sorted({n for n in table_names.values() if list(table_names.values()).count(n) > 1})
    if clash:
        raise ValueError(f"names: two SOK variables would both become table {clash[0]!r}")
    tables = []
    for name, v in variables.items():
        rows = row_counts[name]
        if rows is not None and (isinstance(rows, bool) or not isinstance(rows, (int, np.integer))):
            raise TypeError(f"rows for SOK variable {name!r} must be a positive int, got {rows!r}")
        if rows is not None and rows < 1:
            raise ValueError(f"rows for SOK variable {name!r} must be a positive int, got {rows!r}")
        dim = v.values.shape[1]
        if rows is None and v.keys.size:
            implied = int(v.keys.max()) + 1
            # Keys map to rows: a hashed key (SOK's usual 64-bit keys) would ask for an absurd table.
            if implied * dim * 4 > max(_MAX_IMPLIED_BYTES, 16 * v.values.nbytes):
                raise CheckpointError(
                    f"SOK variable {name!r}: key {implied - 1} makes a table of {implied} rows x {dim} "
                    f"({implied * dim * 4 / 2**30:.1f} GiB) for {v.keys.size} keys; keys map to rows, so pass "
                    "rows= (--rows) to size the table on purpose, or map hashed keys to rows first")
        n_rows = rows if rows is not None else (int(v.keys.max()) + 1 if v.keys.size else 1)
        if v.keys.size and int(v.keys.max()) >= n_rows:
            raise CheckpointError(f"SOK variable {name!r}: key {int(v.keys.max())} >= rows {n_rows}")
        order = np.argsort(v.keys, kind="stable")
        keys = v.keys[order]
        if keys.size > 1 and (keys[1:] == keys[:-1]).any():
            key = keys[int(np.argmax(keys[1:] == keys[:-1]))]
            at = np.flatnonzero(v.keys == key)[:2].tolist()
            raise CheckpointError(f"{v.key_file or f'SOK variable {name!r}'}: key {int(key)} is dumped twice (at "
                                  f"positions {at[0]} and {at[1]}); a key is one row")
        optimizer, slots = _optimizer_of(name, v) if v.slots and include_optimizer else (None, {})
        table = Table(TableConfig(table_names[name], n_rows, dim, "float32", Zeros(), optimizer, "sum"))
        _scatter(keys, v.values[order], table.dim, lambda block, r0: table.assign(block, r0),
                 lambda r0, r1: np.zeros((r1 - r0, table.dim), np.float32), progress)
        for ours, sok_slot in slots.items():
            _check_slot_domain(table, ours, v, sok_slot)
            slot = table.slots()[ours]  # untouched rows keep their initial value
            _scatter(keys, v.slots[sok_slot][order], table.dim,
                     lambda block, r0, ours=ours: table.assign_slot(ours, block, r0),
                     lambda r0, r1, slot=slot: np.array(slot[r0:r1]), progress)
        tables.append(table)
    return tables


def _check_slot_domain(table, ours: str, v: SokVariable, sok_slot: str) -> None:
    """CheckpointError naming the dump file, the key, the column and the
    value where SOK slot `sok_slot` holds a value the table's optimizer
    refuses in its slot `ours` (an accumulator below 0, say): the engine's
    own check would name a row of an internal block."""
    from .table import slot_problem

    values = v.slots[sok_slot]
    if not values.size:
        return
    i, c = np.unravel_index(int(np.argmin(values)), values.shape)
    problem = slot_problem(table, ours, float(values[i, c]))
    if problem is not None:
        path = v.slot_files.get(sok_slot, f"SOK variable {v.name!r} slot {sok_slot!r}")
        raise CheckpointError(f"{path}: key {int(v.keys[i])} (column {int(c)}): slot {ours} of "
                              f"{type(table.optimizer).__name__} {problem}")


def table_bytes(tables) -> int:
    """The bytes of values and slots of converted (float32) tables."""
    return sum(t.rows * t.dim * 4 * (1 + len(t.slot_names)) for t in tables)


_MAX_IMPLIED_BYTES = 1 << 30  # a table a dump of few keys may imply without rows=


def _scatter(keys: np.ndarray, values: np.ndarray, dim: int, assign, current, progress=None) -> None:
    """Writes values[i] into row keys[i] (keys sorted) through `assign(block,
    row0)`, a block of at most 64 MiB of rows at a time, and only the blocks
    that hold keys (`current(r0, r1)` gives a block's rows as they are): no
    copy of the whole table. `progress(nbytes)` gets each block's share of
    `values`."""
    span = max(1, (64 << 20) // (4 * dim))
    i = 0
    while i < keys.size:
        r0 = int(keys[i])
        j = int(np.searchsorted(keys, r0 + span, side="left"))
        r1 = int(keys[j - 1]) + 1
        block = current(r0, r1)
        block[keys[i:j] - r0] = values[i:j]
        assign(block, r0)
        if progress is not None:
            progress(int(values[i:j].nbytes))
        i = j


def save_tables(dst, tables) -> None:
    """Saves converted tables into the checkpoint `dst`, atomically: a table
    with optimizer slots with them (and its step), a table without (its
    dump had no slots, or they were not taken) values-only, so that it loads
    into a table of any optimizer, which keeps its own slots."""
    from .checkpoint import Saver, save

    with_slots = [t.optimizer is not None for t in tables]
    if all(with_slots) or not any(with_slots):
        save(dst, tables if len(tables) > 1 else tables[0], include_optimizer=all(with_slots))
    else:
        Saver._save_entries(native_path(dst, "dst"), list(zip(tables, with_slots)), False, {"kind": "table"})


def convert(src, dst, dim: Optional[int] = None, key_dtype: Optional[str] = None,
            rows: Union[None, int, Dict[str, int]] = None, progress=None, include_optimizer: bool = True,
            names: Optional[Dict[str, str]] = None) -> list:
    """Converts the SOK dump in `src` into an embedcore checkpoint at `dst`;
    returns the table names. `include_optimizer=False` takes the values
    alone; otherwise a dump's optimizer slots must all map to embedcore's
    (see ``to_tables``). A table without slots is saved values-only (it
    loads into a table of any optimizer, whose slots stay as they are).
    `rows` and `names`: see ``to_tables`` (a number or a dict by variable).
    `dim`, when given, must be every variable's embedding size.
    `progress(nbytes)`, when given, is called with the
    bytes of the dump's arrays as they go into the tables, then once with the
    tables' bytes (values and slots) when they are saved."""
    from .checkpoint import _check_flag

    include_optimizer = _check_flag(include_optimizer, "include_optimizer", "sok.convert")
    check_destination(dst, "dst")
    variables = read_dump(src, dim=dim, key_dtype=key_dtype)
    tables = to_tables(variables, rows=rows, include_optimizer=include_optimizer, progress=progress, names=names)
    save_tables(dst, tables)
    if progress is not None:
        progress(table_bytes(tables))
    return [t.name for t in tables]
