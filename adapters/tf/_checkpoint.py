"""TensorFlow checkpoints of TPU embeddings, read into engine tables.

A ``tf.train.Checkpoint`` that holds a ``TPUEmbedding`` /
``TPUEmbeddingForServing`` (attached under any name, at any depth) stores,
under that object's path ``P``:

- ``P/<table>/.ATTRIBUTES/VARIABLE_VALUE``: the table ``[rows, dim]``; a
  table trained on several TPU hosts is saved as slices of that one
  variable, which the reader reassembles;
- ``P/<table>.S<slot>/.ATTRIBUTES/VARIABLE_VALUE``: its optimizer slots
  (``/`` in a name is escaped as ``.S``): accumulators, momenta,
  velocities, linears;
- in the adapter's own checkpoints, ``P/<table>/.ATTRIBUTES/step``: the
  table's optimizer step (``Table.step``, an int64 scalar) beside its
  values (TensorFlow's TPU embeddings keep no step per table);
- for SparseCore training (``TPUEmbeddingV2``): ``P/_sparse_core_table_layouts``
  (a serialized ``SparseCoreTableLayouts``) and one stacked variable per
  group of tables, ``P/<stacked>`` (and ``P/<stacked>.S<slot>``), whose rows
  are the tables interleaved over the SparseCores, each table's shards
  rotated and its rows and columns padded.

Values are read in row blocks straight into the engine's tables, so a
restore needs a block of memory, not a second copy of the table: from the
data files directly (``_bundle.Bundle``; ``RestoreV2`` would read a whole
stored tensor for every block), or, for a tensor saved as slices,
``RestoreV2`` with a slice spec.
"""
from __future__ import annotations

import functools
import os
import re
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf
from google.protobuf.message import DecodeError
from tensorflow.python.ops import resource_variable_ops
from tensorflow.python.training.saving import saveable_object

import embedcore as ec
from embedcore.checkpoint import check_destination
from embedcore.table import _MAX_STEP, _ROUNDS_TO_INF, slot_problem

from ._bundle import Bundle, BundleError

__all__ = ["TFCheckpoint", "load_tf_checkpoint", "convert_tf_checkpoint", "EngineVariable", "TableVariable"]

ATTR = "/.ATTRIBUTES/VARIABLE_VALUE"
STEP_ATTR = "/.ATTRIBUTES/step"  # a table's optimizer step, beside its values (the adapter's checkpoints)
LAYOUTS = "_sparse_core_table_layouts"
# TensorFlow's slot names, and embedcore's row-wise Adagrad's (a [rows, 1] variable).
SLOT_NAMES = ("accumulators", "momenta", "velocities", "linears", "row_accumulators")
_BLOCK_BYTES = 32 << 20

_Trackable = tf.__internal__.tracking.Trackable
_VALUE_KEY = "VARIABLE_VALUE"
_STEP_KEY = "step"


def escape(name: str) -> str:
    """A local name as checkpoint keys spell it."""
    return name.replace(".", "..").replace("/", ".S")


def unescape(local: str) -> str:
    """The local name that checkpoint keys spell as `local` (the inverse of
    ``escape``, TensorFlow's ``escape_local_name``: ``..`` is ``.``, ``.S``
    is ``/``)."""
    out = []
    i = 0
    while i < len(local):
        pair = local[i:i + 2]
        if pair == "..":
            out.append(".")
            i += 2
        elif pair == ".S":
            out.append("/")
            i += 2
        else:
            out.append(local[i])
            i += 1
    return "".join(out)


def _split_slot(name: str) -> Tuple[str, Optional[str]]:
    """``("table", "accumulators")`` for ``"table/accumulators"`` (a local
    name whose last component is an optimizer slot), else ``(name, None)``."""
    base, sep, last = name.rpartition("/")
    return (base, last) if sep and base and last in SLOT_NAMES else (name, None)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}/{escape(name)}" if prefix else escape(name)


def _resolve(path) -> str:
    path = os.fspath(path)
    if os.path.isdir(path):
        latest = tf.train.latest_checkpoint(path)
        if latest is None:
            raise ValueError(f"{path}: no TensorFlow checkpoint in this directory")
        return latest
    return path


class StackedTable:
    """Where one table lies in a SparseCore-stacked variable."""

    def __init__(self, layout):
        self.name = layout.table_name
        self.stacked = layout.stacked_table_name
        self.num_sparse_cores = int(layout.num_sparse_cores)
        self.rows_per_shard = int(layout.total_rows_per_sparse_core_shard)
        self.offset = int(layout.sparse_core_shard_row_offset)
        self.rotation = int(layout.sparse_core_shard_rotation)
        self.rows, self.dim = (int(d) for d in layout.unsharded_shape)
        self.padded_rows, self.padded_dim = (int(d) for d in layout.unsharded_padded_shape)

    @property
    def size_in_shard(self) -> int:
        return self.padded_rows // self.num_sparse_cores


class TFCheckpoint:
    """A TensorFlow checkpoint opened for reading embedding tables.

    ``path``: a checkpoint prefix (``.../ckpt-1``) or a directory (its
    latest checkpoint)."""

    def __init__(self, path):
        self.path = _resolve(path)
        try:
            self._reader = tf.train.load_checkpoint(self.path)
        except (tf.errors.OpError, ValueError) as e:
            raise ValueError(f"{self.path}: cannot read this TensorFlow checkpoint: {e}") from None
        self.shapes: Dict[str, list] = self._reader.get_variable_to_shape_map()
        self.dtypes = self._reader.get_variable_to_dtype_map()
        self._layouts: Dict[str, Dict[str, StackedTable]] = {}
        self._verified: Dict[str, Tuple[float, float]] = {}  # tensors whose checksums verify() checked: their range
        try:  # rows read straight from the data files (RestoreV2 reads a whole tensor for every slice)
            self._bundle: Optional[Bundle] = Bundle(self.path)
        except (ValueError, OSError, DecodeError):  # BundleError, or an index this reader does not parse
            self._bundle = None  # every read through RestoreV2

    # -------------------------------------------------------------- where the embedding is
    def layouts(self, prefix: str) -> Dict[str, StackedTable]:
        """The SparseCore layouts stored under `prefix`, by table name."""
        if prefix not in self._layouts:
            key = _join(prefix, LAYOUTS) + ATTR
            found: Dict[str, StackedTable] = {}
            if key in self.shapes:
                try:
                    raw = self._reader.get_tensor(key)
                except (tf.errors.OpError, ValueError, IndexError) as e:  # IndexError: a data file cut short
                    raise self._error(f"cannot read {key}", e) from None
                raw = raw.item() if isinstance(raw, np.ndarray) else raw
                if raw:
                    from tensorflow.core.tpu.kernels import sparse_core_layout_pb2

                    proto = sparse_core_layout_pb2.SparseCoreTableLayouts()
                    try:
                        proto.ParseFromString(raw)
                    except Exception as e:  # noqa: BLE001 - protobuf's DecodeError (not a ValueError): named
                        raise self._error(f"the SparseCore table layouts {key} (not a SparseCoreTableLayouts "
                                          "proto)", e) from None
                    for layout in proto.tables:
                        found[layout.table_name] = StackedTable(layout)
            self._layouts[prefix] = found
        return self._layouts[prefix]

    def _has(self, prefix: str, name: str) -> bool:
        return (_join(prefix, name) + ATTR) in self.shapes or name in self.layouts(prefix)

    def prefixes(self) -> List[str]:
        """Every object path that holds checkpointed 2-D variables."""
        out = set()
        for key, shape in self.shapes.items():
            if key.endswith(ATTR) and len(shape) == 2:
                head = key[: -len(ATTR)]
                out.add(head.rsplit("/", 1)[0] if "/" in head else "")
            elif key.endswith("/" + LAYOUTS + ATTR) or key == LAYOUTS + ATTR:
                head = key[: -len(LAYOUTS + ATTR)]
                out.add(head.rstrip("/"))
        return sorted(out)

    def find_prefix(self, names: Optional[Sequence[str]] = None, prefix: Optional[str] = None) -> str:
        """The path of the embedding object holding tables `names` (every
        table of a TPU embedding when None)."""
        if prefix is not None:
            prefix = prefix.strip("/")
            missing = [n for n in names or () if not self._has(prefix, n)]
            if missing:
                raise ValueError(f"{self.path}: no table {missing} under '{prefix}' (tables there: "
                                 f"{self.table_names(prefix)})")
            return prefix
        if names:
            found = [p for p in self.prefixes() if all(self._has(p, n) for n in names)]
            if not found:
                # Name what is missing: the tables no object holds, else (each held somewhere) that no one holds all.
                nowhere = sorted(n for n in names if not any(self._has(p, n) for p in self.prefixes()))
                if nowhere:
                    raise ValueError(f"{self.path}: no object holds the table(s) {nowhere}; objects with 2-D "
                                     f"variables: {self.prefixes()}")
                raise ValueError(f"{self.path}: no one object holds all the tables {sorted(names)}; objects with "
                                 f"2-D variables: {self.prefixes()}: convert them one object (prefix=) at a time")
        else:
            found = [p for p in self.prefixes() if self.layouts(p) or self._has_slots(p)]
            if not found and len(self.prefixes()) == 1:
                found = self.prefixes()
            if not found:
                raise ValueError(f"{self.path}: cannot tell which object is the embedding; pass prefix= (one of "
                                 f"{self.prefixes()})")
        if len(found) > 1:
            raise ValueError(f"{self.path}: several objects hold these tables: {found}; pass prefix=")
        return found[0]

    def _has_slots(self, prefix: str) -> bool:
        head = _join(prefix, "") if prefix else ""
        for key in self.shapes:
            if key.startswith(head) and key.endswith(ATTR):
                local = key[len(head): -len(ATTR)]
                if "/" not in local and _split_slot(unescape(local))[1] is not None:
                    return True
        return False

    def table_names(self, prefix: str) -> List[str]:
        """The tables under `prefix`: its 2-D variables other than slots and
        stacked variables, and the tables of its SparseCore layouts."""
        layouts = self.layouts(prefix)
        stacked = {s.stacked for s in layouts.values()}
        head = _join(prefix, "") if prefix else ""
        found = set()
        for key, shape in self.shapes.items():
            if not key.endswith(ATTR) or len(shape) != 2 or not key.startswith(head):
                continue
            local = key[len(head): -len(ATTR)]
            if "/" in local:  # a deeper object's variable (escaped names hold no "/")
                continue
            found.add(unescape(local))
        # "<table>/<slot>" is a slot of a table (or stacked variable) stored beside it; a table's own name may
        # hold "/" ("user/id" is stored as "user.Sid").
        names = [n for n in found if n not in stacked
                 and not (_split_slot(n)[1] is not None and _split_slot(n)[0] in found | stacked)]
        return sorted(set(names) | set(layouts))

    def slots(self, prefix: str, name: str) -> List[str]:
        """Slot names stored for table `name`."""
        layouts = self.layouts(prefix)
        base = layouts[name].stacked if name in layouts else name
        out = []
        for s in SLOT_NAMES:
            if _join(prefix, f"{base}/{s}") + ATTR in self.shapes:
                out.append(s)
        return out

    def step(self, prefix: str, name: str) -> Optional[int]:
        """The optimizer step stored for table `name` (the adapter's own
        checkpoints), or None where the checkpoint has none (TensorFlow's
        TPU embeddings', the adapter's before it saved the step). Raises
        ValueError for a step that is not an int64 scalar in [0, 2**62]."""
        key = _join(prefix, name) + STEP_ATTR
        if key not in self.shapes:
            return None
        if list(self.shapes[key]) != [] or self.dtypes[key] != tf.int64:
            raise ValueError(f"{self.path}: {key} holds {self.dtypes[key].name} {list(self.shapes[key])}, not an "
                             "int64 scalar")
        try:
            value = int(self._reader.get_tensor(key))
        except (tf.errors.OpError, ValueError, IndexError) as e:  # IndexError: a data file cut short
            raise self._error(f"cannot read {key}", e) from None
        if not 0 <= value <= _MAX_STEP:
            raise ValueError(f"{self.path}: {key} is {value}, not a step in [0, 2**62]")
        return value

    def shape(self, prefix: str, name: str) -> Tuple[int, int]:
        layouts = self.layouts(prefix)
        if name in layouts:
            return layouts[name].rows, layouts[name].dim
        return tuple(self.shapes[_join(prefix, name) + ATTR])

    # -------------------------------------------------------------- reading values
    def _plain(self, key: str) -> bool:
        """Whether `key` is read from its data file directly (``Bundle``)."""
        return self._bundle is not None and self._bundle.plain(key) == tuple(self.shapes.get(key, ()))

    def _read(self, key: str, rows: Tuple[int, int], cols: Optional[Tuple[int, int]] = None) -> np.ndarray:
        if self._plain(key):
            try:
                block = self._bundle.read_rows(key, *rows)
            except OSError as e:
                raise self._error(f"cannot read {key}", e) from None
            return block if cols is None else block[:, cols[0]:cols[0] + cols[1]]
        full = self.shapes[key]
        spec = f"{full[0]} {full[1]} {rows[0]},{rows[1]}:" + (f"{cols[0]},{cols[1]}" if cols else "-")
        dtype = self.dtypes[key]
        if dtype != tf.float32:
            raise ValueError(f"{self.path}: {key} holds {dtype.name}, not float32")
        try:
            with tf.device("/CPU:0"):
                t = tf.raw_ops.RestoreV2(prefix=self.path, tensor_names=[key], shape_and_slices=[spec],
                                         dtypes=[dtype])[0]
        except tf.errors.OpError as e:  # a corrupt or truncated data file: DataLossError, OutOfRangeError, ...
            raise self._error(f"cannot read {key}", e) from None
        return t.numpy()

    def _error(self, what: str, e: Exception) -> ValueError:
        """A read of the checkpoint's data failing with TensorFlow's error `e`,
        as the ValueError that a failed read of its index is (naming the data
        files the values are in)."""
        import glob

        data = sorted(glob.glob(glob.escape(self.path) + ".data-*")) or [self.path + ".data-*"]
        message = getattr(e, "message", None) or str(e)
        # An eager op's message: "{{function_node ...}} what went wrong [Op:RestoreV2]".
        message = re.sub(r"^\{\{function_node [^}]*\}\}\s*", "", message)
        message = re.sub(r"\s*\[Op:\w+\]$", "", message)
        return ValueError(f"{self.path}: cannot read this TensorFlow checkpoint: {what} from "
                          f"{', '.join(data)}: {type(e).__name__}: {message}")

    def read_into(self, prefix: str, name: str, slot: Optional[str], dest: np.ndarray) -> None:
        """Reads table `name` (or its `slot`) into `dest`, a writable
        ``[rows, dim]`` float32 array (an engine table's own memory)."""
        layouts = self.layouts(prefix)
        if name in layouts:
            return self._read_stacked(prefix, layouts[name], slot, dest)
        key = _join(prefix, name if slot is None else f"{name}/{slot}") + ATTR
        shape = tuple(self.shapes[key])
        if shape != dest.shape:
            raise ValueError(f"{self.path}: {key} has shape {list(shape)}, but table '{name}' is "
                             f"{list(dest.shape)}")
        step = max(1, _BLOCK_BYTES // max(1, shape[1] * 4))
        direct = (self._plain(key) and isinstance(dest, np.ndarray) and dest.dtype == np.float32
                  and dest.flags.c_contiguous and dest.flags.writeable)
        for r in range(0, shape[0], step):
            n = min(step, shape[0] - r)
            if direct:  # straight from the data file into the rows (no block between)
                try:
                    self._bundle.read_rows(key, r, n, out=dest[r:r + n])
                except OSError as e:
                    raise self._error(f"cannot read {key}", e) from None
            else:
                dest[r:r + n] = self._read(key, (r, n))

    def check(self, prefix: str, name: str, slots: Sequence[str], slot_cols: Optional[int] = None) -> None:
        """Raises unless table `name` and its `slots` can be read as
        ``[rows, dim]`` float32 arrays (``[rows, slot_cols]`` for the slots
        when given: row-wise Adagrad's one column); reads no values."""
        layouts = self.layouts(prefix)
        table_shape = self.shape(prefix, name)
        for slot in [None, *slots]:
            rows_dim = table_shape if slot is None or slot_cols is None else (table_shape[0], slot_cols)
            if name in layouts:
                s = layouts[name]
                key = _join(prefix, s.stacked if slot is None else f"{s.stacked}/{slot}") + ATTR
                if key not in self.shapes:
                    raise ValueError(f"{self.path}: no stacked variable {key} for table '{name}'")
                check_stacked(s, tuple(self.shapes[key]), rows_dim)
            else:
                key = _join(prefix, name if slot is None else f"{name}/{slot}") + ATTR
                if tuple(self.shapes[key]) != tuple(rows_dim):
                    raise ValueError(f"{self.path}: {key} has shape {self.shapes[key]}, the table {list(rows_dim)}")
            if self.dtypes[key] != tf.float32:
                raise ValueError(f"{self.path}: {key} holds {self.dtypes[key].name}, not float32")

    def verify(self, prefix: str, name: str, slots: Sequence[str],
               shapes: Dict[Optional[str], Tuple[int, int]]) -> Dict[Optional[str], Tuple[float, float]]:
        """Reads table `name` and its `slots` block by block as ``read_into``
        does, discarding the values: raises (naming the tensor and the data
        files) unless every block the restore reads can be read, in the
        memory of one block. `shapes`: the destination shape of the table
        (key None) and of each slot. Returns the least and the greatest
        float of the table's values (key None) and of each slot, as the
        reads found them (NaN where one is NaN): for a tensor read from its
        data file, of the whole stored tensor read for its checksum (a
        stacked variable's padding and other tables included: a bound, not
        the table's own); for one that RestoreV2 reads (saved as slices),
        of the blocks read."""
        layouts = self.layouts(prefix)
        ranges: Dict[Optional[str], Tuple[float, float]] = {}
        for slot in [None, *slots]:
            base = layouts[name].stacked if name in layouts else name
            key = _join(prefix, base if slot is None else f"{base}/{slot}") + ATTR
            if self._plain(key):  # its checksum, streaming its bytes (the row reads do not check it)
                if key not in self._verified:  # (a stacked variable holds several tables)
                    try:
                        self._verified[key] = self._bundle.verify(key)
                    except OSError as e:
                        raise self._error(f"cannot read {key}", e) from None
                ranges[slot] = self._verified[key]
            else:  # RestoreV2 checks what it reads
                sink = _RangeSink(shapes[slot])
                self.read_into(prefix, name, slot, sink)
                ranges[slot] = sink.range
        return ranges

    def _read_stacked(self, prefix: str, s: StackedTable, slot: Optional[str], dest: np.ndarray) -> None:
        key = _join(prefix, s.stacked if slot is None else f"{s.stacked}/{slot}") + ATTR
        if key not in self.shapes:
            raise ValueError(f"{self.path}: no stacked variable {key} for table '{s.name}'")
        unstack(s, tuple(self.shapes[key]), lambda rows, cols: self._read(key, rows, cols), dest)

    def all_layouts(self) -> Dict[str, Dict[str, StackedTable]]:
        """Every SparseCore layout in the checkpoint, by object path."""
        out = {}
        for key in self.shapes:
            if key == LAYOUTS + ATTR or key.endswith("/" + LAYOUTS + ATTR):
                prefix = key[: -len(LAYOUTS + ATTR)].rstrip("/")
                if self.layouts(prefix):
                    out[prefix] = self.layouts(prefix)
        return out


def check_stacked(s: StackedTable, shape: Tuple[int, int], dest_shape: Tuple[int, int]) -> None:
    """Raises unless table `s` fits a stacked variable of `shape` and a
    destination of `dest_shape`."""
    total, width = shape
    cores = s.num_sparse_cores
    if cores < 1 or total % cores:
        raise ValueError(f"The first dim of the table ({total}) should be multiple of number of sparse cores "
                         f"({cores})")
    if tuple(dest_shape) != (s.rows, s.dim):
        raise ValueError(f"table '{s.name}' is {s.rows} x {s.dim} in the checkpoint, but "
                         f"{dest_shape[0]} x {dest_shape[1]} here")
    # (A negative offset or size is no row of any shard: it read rows before the table's, or before the variable's
    # bytes in the data file, or counted from the variable's end, and restored them without an error.)
    for field, v in (("sparse_core_shard_row_offset", s.offset), ("unsharded_padded_shape[0]", s.padded_rows)):
        if v < 0:
            raise ValueError(f"the SparseCore layout of table '{s.name}' has {field} {v}: it must be >= 0")
    if s.dim > width or s.offset + s.size_in_shard > total // cores or s.size_in_shard * cores < s.rows:
        raise ValueError(f"the SparseCore layout of table '{s.name}' does not fit its stacked variable {[total, width]}")


def unstack(s: StackedTable, shape: Tuple[int, int], read, dest: np.ndarray) -> None:
    """Writes table `s` of a stacked variable of `shape` into `dest`.
    ``read((row, count), (col, count))`` returns a block of the stacked
    variable.

    Row ``p`` of SparseCore shard ``k`` (after the table's offset in the
    shard) is the table's row ``p * cores + (k - rotation) % cores``; rows
    and columns past the table's own shape are padding."""
    check_stacked(s, shape, dest.shape)
    total, _ = shape
    cores = s.num_sparse_cores
    per_shard = total // cores
    for k in range(cores):
        i = (k - s.rotation) % cores
        count = min(s.size_in_shard, max(0, -(-(s.rows - i) // cores)))
        if count:
            dest[i::cores][:count] = read((k * per_shard + s.offset, count), (0, s.dim))


class _RangeSink:
    """A destination for ``read_into`` that keeps only the least and the
    greatest float written into it (NaN once one is NaN): ``dest[r:r + n] =
    block``, and ``dest[i::cores][:count] = block`` for a stacked table.
    One block's memory, where the checks of a restore once read a whole
    table or slot."""

    def __init__(self, shape: Tuple[int, int]):
        self.shape = tuple(shape)
        self._lo, self._hi = np.float32(np.inf), np.float32(-np.inf)

    def __getitem__(self, index) -> "_RangeSink":
        return self

    def __setitem__(self, index, block) -> None:
        if block.size:  # (np.minimum propagates NaN)
            self._lo, self._hi = np.minimum(self._lo, block.min()), np.maximum(self._hi, block.max())

    @property
    def range(self) -> Tuple[float, float]:
        return float(self._lo), float(self._hi)


# ------------------------------------------------------------------ into engine tables
def _values_view(table: ec.Table) -> np.ndarray:
    if table.dtype != "float32":
        raise NotImplementedError(f"table '{table.name}': TensorFlow checkpoints restore into float32 tables only")
    return table._native.values_mut()


def _slot_view(table: ec.Table, slot: str) -> np.ndarray:
    return dict(table._native.slots_mut())[slot]


def _index(flat, shape) -> List[int]:
    return [int(i) for i in np.unravel_index(int(flat), shape)]


def values_problem(table: ec.Table, value: np.ndarray) -> Optional[str]:
    """Why `value` cannot be the values of `table` (``Table.assign``'s
    rule, which ``ec.save`` applies too: finite, and for a float16 /
    bfloat16 table also once rounded to its storage dtype), or None. One
    vectorised pass in the usual case; the first offender is looked for
    only when there is one."""
    limit = _ROUNDS_TO_INF.get(table.dtype)
    if np.isfinite(value).all() and (limit is None or not (np.abs(value) >= limit).any()):
        return None
    bad = np.flatnonzero(~np.isfinite(value))
    if bad.size:
        return f"values{_index(bad[0], value.shape)} = {value.flat[bad[0]]} is not finite"
    bad = np.flatnonzero(np.abs(value) >= limit)
    return (f"values{_index(bad[0], value.shape)} = {value.flat[bad[0]]} is beyond the range of its storage dtype "
            f"{table.dtype} (it would round to infinity)")


def _read_range(ckpt: TFCheckpoint, prefix: str, table: ec.Table, slot: Optional[str]) -> Tuple[float, float]:
    """The least and the greatest float of `table`'s values (`slot` None)
    or slot in the checkpoint, read block by block in one block's memory."""
    sink = _RangeSink((_values_view(table) if slot is None else _slot_view(table, slot)).shape)
    ckpt.read_into(prefix, table.name, slot, sink)
    return sink.range


def _check_values(ckpt: TFCheckpoint, prefix: str, table: ec.Table,
                  value_range: Optional[Tuple[float, float]] = None) -> None:
    """Raises ValueError unless the checkpoint's values of `table` may be
    restored (``values_problem``), before any table changes: from their
    range (`value_range`, what ``verify`` found; else, or where that allows
    a problem, read once more block by block), and where that finds one,
    once more in one table's memory to name the first offender."""
    limit = _ROUNDS_TO_INF.get(table.dtype, np.inf)

    def fits(lo: float, hi: float) -> bool:
        return bool(np.isfinite(lo) and np.isfinite(hi) and max(-lo, hi) < limit)

    if value_range is not None and fits(*value_range):
        return
    if fits(*_read_range(ckpt, prefix, table, None)):  # (a stacked variable's range only bounds the table's)
        return
    value = np.empty(_values_view(table).shape, np.float32)
    ckpt.read_into(prefix, table.name, None, value)
    problem = values_problem(table, value)
    if problem:
        raise ValueError(f"{ckpt.path}: table '{table.name}' {problem}; Table.assign and ec.save refuse it too")


def _slot_range_problem(table: ec.Table, slot: str, lo: float, hi: float, bounded: bool = True) -> Optional[str]:
    """Why values whose least is `lo` and greatest `hi` cannot be `slot`
    of `table` (``slot_value_problem``'s rule), without where: or None."""
    if not (np.isfinite(lo) and np.isfinite(hi)):
        return "is not finite"
    if bounded:
        return slot_problem(table, slot, lo)
    if lo < 0 and table._native.slot_lower_bound(table.slot_names.index(slot))[0]:
        return f"must be >= 0, got {lo}"
    return None


def slot_value_problem(table: ec.Table, slot: str, value: np.ndarray, bounded: bool = True) -> Optional[str]:
    """Why `value` cannot be `slot` of `table` (``Table.assign_slot``'s rule,
    which ``ec.load`` applies: finite, and within the optimizer's domain;
    not `bounded`: a slot the optimizer bounds at least 0, as every
    optimizer's accumulators are), or None."""
    if not value.size:
        return None
    lo, hi = float(value.min()), float(value.max())  # (NaN propagates: one pass each in the usual case)
    problem = _slot_range_problem(table, slot, lo, hi, bounded)
    if problem is None:
        return None
    if not (np.isfinite(lo) and np.isfinite(hi)):
        bad = np.flatnonzero(~np.isfinite(value))
        return f"holds {value.flat[bad[0]]} at {_index(bad[0], value.shape)}; a slot must be finite"
    return f"at {_index(np.argmin(value), value.shape)} {problem}"


def _check_slot_domain(ckpt: TFCheckpoint, prefix: str, table: ec.Table, slot: str, bounded: bool,
                       slot_range: Optional[Tuple[float, float]] = None) -> None:
    """Raises ValueError unless the checkpoint's `slot` of `table` may be
    restored (``slot_value_problem``), before any table changes: from its
    range (`slot_range`, what ``verify`` found; else, or where that allows
    a problem, read once more block by block), and where that finds one,
    once more in one slot's memory to name the first offender."""
    if slot_range is not None and _slot_range_problem(table, slot, *slot_range, bounded) is None:
        return
    if _slot_range_problem(table, slot, *_read_range(ckpt, prefix, table, slot), bounded) is None:
        return  # (a stacked variable's range only bounds the table's)
    value = np.empty(_slot_view(table, slot).shape, np.float32)
    ckpt.read_into(prefix, table.name, slot, value)
    problem = slot_value_problem(table, slot, value, bounded)
    if problem:
        raise ValueError(f"{ckpt.path}: slot '{slot}' of table '{table.name}' {problem}")


def _slots_to_restore(ckpt: TFCheckpoint, prefix: str, table: ec.Table) -> List[str]:
    """The slots of `table` to restore: every slot its optimizer keeps,
    when the checkpoint holds exactly those; none when the checkpoint or
    the table holds none (values only: a serving checkpoint, a table
    without optimizer state). Raises ValueError otherwise: a restore of
    some of a table's slots (Adagrad's accumulators into FTRL, whose
    linears would stay as they were) leaves a state no training made, as
    ``ec.load`` refuses it."""
    stored = ckpt.slots(prefix, table.name)
    if not stored or not table.slot_names:
        return []
    if sorted(stored) != sorted(table.slot_names):
        have = type(table.optimizer).__name__ if table.optimizer is not None else "none"
        raise ValueError(f"{ckpt.path}: table '{table.name}' has optimizer slots {stored} in the checkpoint, its "
                         f"optimizer here ({have}) keeps {list(table.slot_names)}: a restore takes all of a table's "
                         "optimizer state or none of it; give the table the checkpoint's optimizer, or "
                         "include_optimizer=False to restore the values only")
    return list(table.slot_names)


def restore_tables(ckpt: TFCheckpoint, tables: Sequence[ec.Table], prefix: Optional[str] = None,
                   include_optimizer: bool = True, verify: bool = True, slot_bounds: bool = True) -> str:
    """Reads every table (and, with `include_optimizer`, its slots as
    ``_slots_to_restore`` says, and the step where the checkpoint has one)
    of `tables` from `ckpt`.
    Every shape and dtype is checked before any table changes, and, with
    `verify`, every block that the restore reads is read once first and
    discarded (a truncated or corrupt data file raises ValueError naming
    the tensor and the files, with every table unchanged: the restore is
    all or nothing, at the cost of reading the values twice). Returns the
    prefix."""
    from embedcore.checkpoint import _check_flag

    include_optimizer = _check_flag(include_optimizer, "include_optimizer", "restore_tables")
    names = [t.name for t in tables]
    prefix = ckpt.find_prefix(names, prefix)
    plan = []
    for t in tables:
        _values_view(t)  # a table of another dtype is refused here, before any table changes
        shape = ckpt.shape(prefix, t.name)
        if tuple(shape) != (t.rows, t.dim):
            raise ValueError(f"{ckpt.path}: table '{t.name}' is {list(shape)} in the checkpoint, but "
                             f"{[t.rows, t.dim]} here")
        slots = _slots_to_restore(ckpt, prefix, t) if include_optimizer else []
        ckpt.check(prefix, t.name, slots, t._native.slot_dim)
        step = ckpt.step(prefix, t.name) if include_optimizer else None  # read (and checked) before any change
        plan.append((t, slots, step))
    ranges = {}
    for t, slots, _ in plan:  # (with `verify`: each tensor's range found on the read that checks its checksum)
        ranges[t.name] = (ckpt.verify(prefix, t.name, slots, {None: _values_view(t).shape,
                                                              **{s: _slot_view(t, s).shape for s in slots}})
                          if verify else {})
    for t, slots, _ in plan:  # the values, as Table.assign checks them, and the slots' domain, as assign_slot
        _check_values(ckpt, prefix, t, ranges[t.name].get(None))
        for s in slots:
            _check_slot_domain(ckpt, prefix, t, s, slot_bounds, ranges[t.name].get(s))
    for t, slots, step in plan:
        ckpt.read_into(prefix, t.name, None, _values_view(t))
        for s in slots:
            ckpt.read_into(prefix, t.name, s, _slot_view(t, s))
        if step is not None:
            t.step = step
    return prefix


def load_tf_checkpoint(path, into, prefix: Optional[str] = None, include_optimizer: bool = True) -> str:
    """Restores the tables of `into` (an ``EmbeddingForServing``, the Keras
    ``Embedding`` layer, an ``embedcore.Embedding``, a Table or a list of
    them) from a TensorFlow checkpoint written by ``TPUEmbedding``,
    ``TPUEmbeddingForServing`` or ``TPUEmbeddingV2`` (SparseCore), matching
    tables by name.

    prefix: the path under which the embedding object was attached in the
        checkpoint (e.g. ``"embedding"`` or ``"model/embedding"``); found
        from the table names when omitted.
    include_optimizer: also each table's optimizer slots, and its
        optimizer step where the checkpoint holds one (the adapter's own
        checkpoints; elsewhere the step stays as it is). A table whose
        optimizer keeps slots takes all of them, where the checkpoint holds
        that table's slots: a checkpoint holding other slots (Adagrad's
        accumulators for an FTRL table, Adam's for Adagrad) raises
        ValueError, as ``embedcore.load`` does; a checkpoint of values only,
        or a table without slots (serving, SGD), restores the values.

    Returns the prefix used. A sharded ``embedcore.Embedding``
    (``embedcore.distributed``) is refused (``TypeError``): convert the
    checkpoint (``convert_tf_checkpoint``) and ``embedcore.load`` it on every
    rank, which reads each rank's shards."""
    from embedcore.checkpoint import _check_flag, _tables_of

    if hasattr(into, "_sharded_save"):  # a rank holds shards, not tables: the collective load reads its part
        raise TypeError("load_tf_checkpoint: into is a sharded Embedding (embedcore.distributed), whose ranks hold "
                        "shards, not whole tables: convert the checkpoint with convert_tf_checkpoint(path, dst, "
                        "feature_config=...) and embedcore.load(dst, into) on every rank")
    # (_embedcore_tables() builds the adapter's objects; a Keras layer's _maybe_build is Keras's, with arguments.)
    include_optimizer = _check_flag(include_optimizer, "include_optimizer", "load_tf_checkpoint")
    return restore_tables(TFCheckpoint(path), _tables_of(into), prefix, include_optimizer)


_SLOTS_TO_OPTIMIZER = {
    (): ec.optimizers.SGD,
    ("accumulators",): ec.optimizers.Adagrad,
    ("momenta", "velocities"): ec.optimizers.Adam,
    ("accumulators", "linears"): ec.optimizers.FTRL,
    ("row_accumulators",): ec.optimizers.RowWiseAdagrad,
}


def convert_tf_checkpoint(src, dst, prefix: Optional[str] = None, feature_config=None, optimizer=None,
                          include_optimizer: bool = True, tables: Optional[Sequence[str]] = None,
                          combiner: Optional[str] = None) -> List[str]:
    """Converts the TPU-embedding tables of a TensorFlow checkpoint into an
    embedcore checkpoint at `dst` (``embedcore convert --from tf``).

    feature_config: the model's feature config (TensorFlow's or
        embedcore's); gives table names, combiners and optimizers. Without
        it, every table under `prefix` is converted, and each table's
        optimizer kind is read from its slots (accumulators: Adagrad;
        momenta + velocities: Adam; accumulators + linears: FTRL;
        row_accumulators: RowWiseAdagrad; none: SGD) with default hyper-parameters unless `optimizer` is given.
    include_optimizer: also the optimizer state: the slots, and the step
        where the checkpoint holds one (the adapter's own checkpoints; else
        0). Every slot the checkpoint holds for a converted table must be
        one its optimizer (inferred, `optimizer`, or the feature config's)
        keeps: otherwise ValueError, naming them, before anything is
        written.
    tables: only these table names (a str is one name); a name that is not
        in `feature_config` (or, without it, in the checkpoint) raises
        ValueError.
    combiner: without `feature_config`, the combiner written for every
        table ("sum", "mean" or "sqrtn"; default "mean", the default of
        TensorFlow's ``TableConfig``: a checkpoint does not record it). With
        `feature_config`, each table's combiner comes from the config.

    Returns the converted table names."""
    from embedcore.checkpoint import _check_flag

    include_optimizer = _check_flag(include_optimizer, "include_optimizer", "convert_tf_checkpoint")
    if combiner is not None and combiner not in ("sum", "mean", "sqrtn"):
        raise ValueError(f"combiner must be 'sum', 'mean' or 'sqrtn', not {combiner!r}")
    if combiner is not None and feature_config is not None:
        raise ValueError("combiner= applies without feature_config only: the feature config gives each table's "
                         "combiner")
    if isinstance(tables, str):
        tables = [tables]  # one table name (not its characters)
    elif tables is not None:
        tables = list(tables)
        bad = [n for n in tables if not isinstance(n, str)]
        if bad:
            raise TypeError(f"tables= takes table names (str), got {bad[0]!r} ({type(bad[0]).__name__})")
        if not tables:
            raise ValueError("tables= is empty: give at least one table name (or None for every table)")
    check_destination(dst, "dst")  # before the conversion's work, not at its save
    ckpt = TFCheckpoint(src)
    if feature_config is not None:
        from ._serving import EmbeddingForServing

        emb = EmbeddingForServing(feature_config, optimizer)
        emb.build()
        engine_tables = list(emb._embedcore_tables())
        if tables is not None:
            known = [t.name for t in engine_tables]
            unknown = [n for n in tables if n not in known]
            if unknown:
                raise ValueError(f"tables=: no table {unknown} in feature_config (its tables: {known})")
            engine_tables = [t for t in engine_tables if t.name in set(tables)]
    else:
        prefix = ckpt.find_prefix(tables, prefix)
        names = list(tables) if tables is not None else ckpt.table_names(prefix)
        if not names:
            raise ValueError(f"{ckpt.path}: no tables under '{prefix}'")
        from ._config import optimizer_from_tf

        engine_tables = []
        for name in names:
            rows, dim = ckpt.shape(prefix, name)
            opt = optimizer_from_tf(optimizer)
            if opt is None and include_optimizer:
                kind = _SLOTS_TO_OPTIMIZER.get(tuple(ckpt.slots(prefix, name)))
                opt = kind() if kind is not None else None
            engine_tables.append(ec.Table(name=name, rows=int(rows), dim=int(dim),
                                          initializer=ec.initializers.Zeros(), optimizer=opt,
                                          combiner=combiner or "mean"))
    if include_optimizer:  # a conversion drops no optimizer state silently
        prefix = ckpt.find_prefix([t.name for t in engine_tables], prefix)
        for t in engine_tables:
            stored = ckpt.slots(prefix, t.name)
            dropped = [s for s in stored if s not in t.slot_names]
            if dropped:
                have = type(t.optimizer).__name__ if t.optimizer is not None else "none"
                raise ValueError(f"{ckpt.path}: table '{t.name}' has optimizer slots {stored} in the checkpoint; its "
                                 f"optimizer here ({have}) would drop {dropped}: give optimizer= (or a feature "
                                 "config whose table has one) that keeps them, or include_optimizer=False "
                                 "(--no-optimizer) to convert the values only")
    # (checksums verified before the reads; an optimizer read from the slots' names has default
    # hyper-parameters: its domain is not the slots' (a zero accumulator of an Adagrad with an epsilon),
    # each load checks them against its own table's optimizer; a negative one no optimizer takes)
    guessed = feature_config is None and optimizer is None
    restore_tables(ckpt, engine_tables, prefix, include_optimizer, slot_bounds=not guessed)
    # With the whole feature config, the checkpoint records its features (served by feature name).
    whole = feature_config is not None and tables is None
    ec.save(dst, emb if whole else engine_tables, include_optimizer=include_optimizer)
    return [t.name for t in engine_tables]


# ------------------------------------------------------------------ tf.train.Checkpoint integration
def _as_tensor(view: np.ndarray) -> tf.Tensor:
    try:
        return tf.experimental.dlpack.from_dlpack(view.__dlpack__())
    except Exception:  # noqa: BLE001 - an unaligned or read-only buffer: copy it
        return tf.constant(view)


def _copy_into(dest: np.ndarray, value: tf.Tensor, what: str) -> None:
    if tuple(value.shape) != dest.shape:
        raise ValueError(f"cannot restore '{what}': the checkpoint holds shape {list(value.shape)}, the table is "
                         f"{list(dest.shape)}")
    np.copyto(dest, value.numpy())


def _snapshot(read, dtypes, shapes) -> list:
    """``read()`` (copies of engine state, as NumPy arrays) as tensors: now
    when eager, else (inside a ``tf.function``) a stateful
    ``tf.numpy_function`` that runs each time the graph does."""
    if tf.executing_eagerly():
        return [tf.constant(a) for a in read()]
    values = tf.numpy_function(read, [], list(dtypes), stateful=True)
    for v, shape in zip(values, shapes):
        v.set_shape(shape)
    return values


class EngineVariable(_Trackable):
    """One slot of a table as a checkpointed variable: saved under the name
    TensorFlow gives it, restored into the engine. (A table's values, with
    its step: ``TableVariable``.)"""

    def __init__(self, table: ec.Table, slot: Optional[str] = None):
        self._table = table
        self._slot = slot

    def _view(self) -> np.ndarray:
        return _values_view(self._table) if self._slot is None else _slot_view(self._table, self._slot)

    def _serialize_to_tensors(self):
        return {_VALUE_KEY: _as_tensor(np.asarray(self._view()))}

    def _restore_from_tensors(self, restored_tensors):
        value = restored_tensors[_VALUE_KEY]
        if self._slot is not None and tuple(value.shape) == self._view().shape:  # (a shape error comes next)
            problem = slot_value_problem(self._table, self._slot, value.numpy())
            if problem:
                raise ValueError(f"cannot restore '{self._name()}': {problem}")
        _copy_into(self._view(), value, self._name())
        return tf.no_op()

    def _copy_trackable_to_cpu(self, object_map):
        """For asynchronous checkpoints (``CheckpointOptions(
        experimental_enable_async_checkpoint=True)``): a snapshot of the
        values at the save, in a CPU variable that TensorFlow writes in the
        background while the engine's table keeps changing (as TensorFlow's
        own variables do). Called eagerly at the first save, and inside a
        ``tf.function`` at later ones, where the copy is a stateful
        ``tf.numpy_function`` that runs at each save."""
        shape = tuple(self._view().shape)
        if self not in object_map:
            with tf.init_scope(), tf.device("/CPU:0"):
                object_map[self] = resource_variable_ops.UninitializedVariable(
                    shape=shape, dtype=tf.float32, trainable=False, name=self._name())
        # a copy: the engine's memory keeps changing
        object_map[self].assign(_snapshot(lambda: [np.array(self._view())], [tf.float32], [shape])[0])

    def _name(self) -> str:
        return self._table.name if self._slot is None else f"{self._table.name}/{self._slot}"


class TableVariable(_Trackable):
    """A table's values and its optimizer step (``Table.step``) as one
    checkpointed object: ``<name>/.ATTRIBUTES/VARIABLE_VALUE`` (what
    TensorFlow's ``TPUEmbeddingForServing`` restores as the table's
    variable) and ``<name>/.ATTRIBUTES/step`` (an int64 scalar), both
    restored into the engine, so that training resumes where it stopped (a
    learning-rate schedule's position, Adam's bias correction).

    They are TensorFlow's per-attribute saveables
    (``_gather_saveables_for_checkpoint``), not ``_serialize_to_tensors``:
    TensorFlow restores those attribute by attribute, so a checkpoint
    without the step (the adapter's before it saved one, or TensorFlow's
    TPU embeddings') restores the values, leaves the step as it is, and
    passes ``assert_consumed`` / ``assert_existing_objects_matched``,
    where ``_serialize_to_tensors`` would ask it for both keys
    (``NotFoundError``). TensorFlow's own variables skip the step
    attribute."""

    def __init__(self, table: ec.Table):
        self._table = table

    def _gather_saveables_for_checkpoint(self):
        return {key: functools.partial(_TableSaveable, self, key) for key in (_VALUE_KEY, _STEP_KEY)}

    def _read(self, key: str) -> tf.Tensor:
        if key == _STEP_KEY:
            # Inside a tf.function, the step when the function runs (a constant would be the one it was traced
            # at); the values are a view of the table's memory, read when the save writes them.
            with tf.device("/CPU:0"):
                return _snapshot(lambda: [np.int64(self._table.step)], [tf.int64], [()])[0]
        return _as_tensor(np.asarray(_values_view(self._table)))

    def _restore(self, key: str, value: tf.Tensor) -> None:
        if key == _VALUE_KEY:
            dest = _values_view(self._table)
            if tuple(value.shape) == dest.shape:  # (a shape error comes next)
                problem = values_problem(self._table, value.numpy())
                if problem:
                    raise ValueError(f"cannot restore '{self._table.name}': {problem}")
            _copy_into(dest, value, self._table.name)
        elif value.shape.rank != 0:
            raise ValueError(f"cannot restore the step of '{self._table.name}': the checkpoint holds shape "
                             f"{list(value.shape)}, not a scalar")
        else:
            self._table.step = int(value.numpy())  # ValueError (naming the table) outside [0, 2**62]

    def _copy_trackable_to_cpu(self, object_map):
        """``EngineVariable._copy_trackable_to_cpu``, for the values and the
        step (read together)."""
        shape = tuple(_values_view(self._table).shape)
        if self not in object_map:
            with tf.init_scope(), tf.device("/CPU:0"):
                object_map[self] = _TableSnapshot(
                    resource_variable_ops.UninitializedVariable(shape=shape, dtype=tf.float32, trainable=False,
                                                                name=self._table.name),
                    resource_variable_ops.UninitializedVariable(shape=(), dtype=tf.int64, trainable=False,
                                                                name=f"{self._table.name}/step"))
        values, step = _snapshot(lambda: [np.array(_values_view(self._table)), np.int64(self._table.step)],
                                 [tf.float32, tf.int64], [shape, ()])
        object_map[self].values.assign(values)
        object_map[self].step.assign(step)


class _TableSaveable(saveable_object.SaveableObject):
    """One attribute (`key`) of a ``TableVariable``."""

    def __init__(self, owner: TableVariable, key: str, name: str):
        self._owner, self._key = owner, key
        # The tensor now (a save calls the factory when it saves; a restore, for the dtype and device only): the
        # values a zero-copy view of the table, both on the CPU device of the other tensors TensorFlow saves.
        spec = saveable_object.SaveSpec(owner._read(key), "", name)
        super().__init__(self, [spec], name)  # its own op: TensorFlow refuses two saveables of one op

    def restore(self, restored_tensors, restored_shapes):
        self._owner._restore(self._key, restored_tensors[0])
        return tf.no_op()


class _TableSnapshot(_Trackable):
    """What an asynchronous checkpoint writes for a ``TableVariable``: CPU
    copies of its values and step, under the same keys."""

    def __init__(self, values, step):
        self.values, self.step = values, step

    def _serialize_to_tensors(self):
        return {_VALUE_KEY: self.values.read_value(), _STEP_KEY: self.step.read_value()}


class StackedSink(_Trackable):
    """Receives a SparseCore-stacked variable during a
    ``tf.train.Checkpoint`` restore and un-stacks it into the engine tables
    it holds."""

    def __init__(self, owner, stacked: str, slot: Optional[str]):
        self._owner, self._stacked, self._slot = owner, stacked, slot

    def _serialize_to_tensors(self):
        return {_VALUE_KEY: tf.zeros([], tf.float32)}  # only names the key to read

    def _restore_from_tensors(self, restored_tensors):
        value = restored_tensors[_VALUE_KEY].numpy()
        self._owner._restore_stacked(self._stacked, self._slot, value)
        return tf.no_op()


def unstack_array(layouts: Dict[str, StackedTable], stacked: str, value: np.ndarray, dests) -> None:
    """Un-stacks an in-memory stacked variable into ``dests[table_name]``
    (writable arrays) for every table of `layouts` stacked in it."""
    if value.ndim != 2:
        raise ValueError(f"stacked variable '{stacked}' has shape {list(value.shape)}, expected 2-D")
    tables = [s for s in layouts.values() if s.stacked == stacked and s.name in dests]
    for s in tables:  # every table fits before any is written (dests may be the tables' own memory)
        check_stacked(s, value.shape, dests[s.name].shape)
    for s in tables:
        unstack(s, value.shape, lambda r, c: value[r[0]:r[0] + r[1], c[0]:c[0] + c[1]], dests[s.name])
