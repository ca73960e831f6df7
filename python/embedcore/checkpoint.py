"""Checkpoints: ``save`` / ``load`` of tables and embeddings, and ``Saver``
with SOK's calls.

The format is specified in docs/format.md: a directory holding a
checksummed manifest and one data file per table shard and slot, written
atomically (a save killed at any moment leaves the previous checkpoint
loadable) and verified before anything is loaded (a corrupt checkpoint
leaves the target unchanged).
"""
from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
from typing import List, Optional, Sequence, Tuple

import numpy as np

from . import _embedcore
from . import initializers as _init
from . import optimizers as _opt
from ._inputs import as_float32
from .config import FeatureConfig, TableConfig, _check_utf8
from .embedding import Embedding
from .table import Table, check_storable

__all__ = ["CheckpointError", "save", "load", "Saver", "FORMAT_VERSION"]

CheckpointError = _embedcore.CheckpointError
FORMAT_VERSION: Tuple[int, int] = tuple(_embedcore.FORMAT_VERSION)


# ------------------------------------------------------------------ configs as JSON
def _initializer_json(init: _init.Initializer) -> dict:
    return {"class": type(init).__name__, **vars(init)}


def _optimizer_json(opt: Optional[_opt.Optimizer]) -> Optional[dict]:
    if opt is None:
        return None
    fields = {}
    for k, v in vars(opt).items():
        if k == "learning_rate" and callable(v):
            fields[k] = None  # a schedule: the step count in the checkpoint is its position
            fields["learning_rate_schedule"] = getattr(v, "__qualname__", type(v).__name__)
        else:
            fields[k] = list(v) if isinstance(v, tuple) else v
    return {"class": type(opt).__name__, **fields}


def _slot_counts(t: dict) -> Tuple[int, int]:
    """A manifest table's slots of [rows, dim] and of [rows, 1] (row-wise Adagrad's)."""
    row_wise = t["optimizer"] is not None and t["optimizer"]["kind"] == "rowwise_adagrad"
    return (0, len(t["slots"])) if row_wise else (len(t["slots"]), 0)


def _table_config_json(cfg: TableConfig, table: Optional[Table] = None) -> dict:
    """A manifest table's config: `cfg`'s shape, dtype, combiner and
    initializer, and `table`'s name, optimizer and padding_idx; without a
    table (a sharded save's rank 0, which may hold no shard of it), `cfg`'s
    name and optimizer, and no padding_idx."""
    config = {
        "name": cfg.name if table is None else table.name,
        "rows": cfg.rows,
        "dim": cfg.dim,
        "dtype": cfg.dtype,
        "combiner": cfg.combiner,
        "initializer": _initializer_json(cfg.initializer),
        "optimizer": _optimizer_json(cfg.optimizer if table is None else table.optimizer),
    }
    if table is not None and table._padding_idx is not None:  # format 1.5: serving leaves it out of pooled bags
        config["padding_idx"] = int(table._padding_idx)
    return config


def _check_padding(info, k: int, table: Table) -> None:
    """Refuses to load table `k` of a checkpoint that records a padding_idx
    (a PyTorch module's, format 1.5) into `table` unless the table's own is
    the same: its lookups would pool the padding rows that the checkpoint's
    served lookups leave out, and a save of it would lose the record. A
    checkpoint without one (every one before 1.5) loads anywhere."""
    saved = info.table_padding_idx(k)
    if saved is None or saved == table._padding_idx:
        return
    ours = "none" if table._padding_idx is None else table._padding_idx
    raise CheckpointError(
        f"{info.path}: table '{table.name}' was saved with padding_idx {saved} (its pooled lookups leave id {saved} "
        f"out of their bags), the table loaded into has padding_idx {ours}: load it into a PyTorch module made "
        f"with padding_idx={saved} (embedcore.adapters.torch.EmbeddingBag / Embedding), or serve it "
        f"(embedcore.serving.open); nothing was loaded")


def _structure_json(structure, counter=None, items: bool = False):
    """The nest of a feature config, each leaf replaced by its index in
    flattening order (dict keys sorted, as ``_nest`` flattens), so a config
    that holds one FeatureConfig twice names two features; None when a dict
    key is not a string. With `items`, dicts are ``{"items": [[key, ...],
    ...]}`` (in the dict's order), whose keys may also be ints (JSON object
    keys are strings): the ``structure_items`` record of docs/format.md."""
    counter = itertools.count() if counter is None else counter
    if isinstance(structure, dict):
        allowed = (str, int, np.integer) if items else (str,)
        if not all(isinstance(k, allowed) and not isinstance(k, (bool, np.bool_)) for k in structure):
            return None
        if items and not all(isinstance(k, str) or -2**63 <= int(k) < 2**64 for k in structure):
            return None  # the manifest's JSON holds 64-bit integers only
        structure = {(k if isinstance(k, str) else int(k)): v for k, v in structure.items()}  # (NumPy ints: JSON's)
        try:
            keys = sorted(structure)
        except TypeError:  # str and int keys together: no order to flatten in
            return None
        built = {k: _structure_json(structure[k], counter, items) for k in keys}
        if None in built.values():
            return None
        return {"items" if items else "dict": [[k, built[k]] for k in structure] if items else
                {k: built[k] for k in structure}}
    if isinstance(structure, (list, tuple)):
        parts = [_structure_json(v, counter, items) for v in structure]
        return None if None in parts else {"list" if isinstance(structure, list) else "tuple": parts}
    return {"feature": next(counter)}


def config_from_json(d: dict, any_initializer: bool = False) -> TableConfig:
    """A TableConfig rebuilt from a checkpoint's table config (no optimizer
    when the learning rate was a schedule: that callable is not stored).
    A malformed config raises CheckpointError. With ``any_initializer``
    (serving, which never fills a row), an initializer that this version
    cannot rebuild (a newer writer's class or arguments) gives
    TableConfig's default."""
    try:
        return _config_from_json(d, any_initializer)
    except CheckpointError:
        raise
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, RecursionError) as e:
        raise CheckpointError(f"malformed table config in checkpoint: {type(e).__name__}: {e}") from None


def _config_from_json(d: dict, any_initializer: bool = False) -> TableConfig:
    if not isinstance(d, dict):
        raise CheckpointError(f"table config must be an object, got {type(d).__name__}")
    init_d = d.get("initializer")
    cls = getattr(_init, init_d["class"], None) if isinstance(init_d, dict) and isinstance(init_d.get("class"), str) \
        else _init.Initializer  # (not a class name: _initializer_from_json names what is wrong)
    newer = not (isinstance(cls, type) and issubclass(cls, _init.Initializer))  # a class this version lacks
    if any_initializer:  # serving: a class, or arguments, of a newer writer (or none usable) give the default
        try:
            initializer = None if newer else _initializer_from_json(init_d)
        except (CheckpointError, TypeError, ValueError):
            initializer = None
    else:
        initializer = _initializer_from_json(init_d)
    optimizer = None
    opt_d = d.get("optimizer")
    if opt_d is not None and opt_d.get("learning_rate") is not None:
        opt_d = dict(opt_d)
        opt_cls = getattr(_opt, opt_d.pop("class"), None)
        if opt_cls is None or not isinstance(opt_cls, type) or not issubclass(opt_cls, _opt.Optimizer):
            raise CheckpointError(f"unknown optimizer in checkpoint: {d.get('optimizer')!r}")
        opt_d.pop("learning_rate_schedule", None)
        optimizer = opt_cls(**opt_d)
    return TableConfig(d["name"], d["rows"], d["dim"], d.get("dtype", "float32"), initializer, optimizer,
                       d.get("combiner", "mean"))


def _initializer_from_json(init_d) -> _init.Initializer:
    init_d = init_d or {"class": "TruncatedNormal"}
    if not isinstance(init_d, dict) or not isinstance(init_d.get("class"), str):
        raise CheckpointError(f"initializer must be an object with a string 'class', got {init_d!r}")
    args = dict(init_d)
    init_cls = getattr(_init, args.pop("class"), None)
    if init_cls is None or not isinstance(init_cls, type) or not issubclass(init_cls, _init.Initializer):
        raise CheckpointError(f"unknown initializer in checkpoint: {init_d!r}")
    return init_cls(**args)


# ------------------------------------------------------------------ load_embedding_values
def _stacked_values(arrays, rows: int, dim: int, name: str):
    """load_embedding_values' arrays (one, or a list / tuple) as float32
    ``[n_i, dim]`` arrays whose rows add up to `rows`, and their stack."""
    parts: Sequence = arrays if isinstance(arrays, (list, tuple)) else [arrays]
    if not parts:
        raise ValueError("load_embedding_values: no arrays given")
    values = []
    for i, a in enumerate(parts):
        v = as_float32(a, f"arrays[{i}]")
        if v.ndim != 2 or v.shape[1] != dim:
            raise ValueError(f"load_embedding_values: arrays[{i}] must have shape [n, {dim}], got {v.shape}")
        values.append(v)
    total = sum(v.shape[0] for v in values)
    if total != rows:
        raise ValueError(f"load_embedding_values: the arrays hold {total} rows, table '{name}' has {rows}")
    return values, values[0] if len(values) == 1 else np.concatenate(values, axis=0)


def _in_arrays(e: ValueError, values: list, row_start: int, col_start: int) -> ValueError:
    """`e`, a refusal of ``values[r, c]`` of a block at (`row_start`,
    `col_start`) of the stack, naming the value in the caller's arrays."""
    m = re.search(r"values\[(\d+), (\d+)\]", str(e))
    if m is None:
        return e
    row, col, i = int(m.group(1)) + row_start, int(m.group(2)) + col_start, 0
    while row >= values[i].shape[0]:
        row -= values[i].shape[0]
        i += 1
    where = f"arrays[{i}][{row}, {col}]" if len(values) > 1 else f"values[{row}, {col}]"
    return ValueError(f"{str(e)[:m.start()]}{where}{str(e)[m.end():]}")


def _load_shard_values(emb, arrays) -> str:
    """load_embedding_values into this rank's shards of a sharded Embedding's
    one table: each takes its block of the whole table's values; a refusal
    leaves every shard as it was."""
    if len(emb._configs) != 1:
        names = [emb._effective[c].name for c in emb._configs]
        raise TypeError(f"load_embedding_values takes one table; this sharded Embedding holds {len(names)} "
                        f"({', '.join(map(repr, names[:5]))}{', ...' if len(names) > 5 else ''}): give each table "
                        "an Embedding of its own, or load the values with ec.load")
    sharding = emb._sharding_of(0)
    values, stacked = _stacked_values(arrays, sharding.rows, sharding.dim, sharding.name)
    try:  # the whole table on every rank: each raises what any rank's shard would
        check_storable(sharding.name, emb._effective[emb._configs[0]].dtype, stacked, stacked)
    except ValueError as e:
        raise _in_arrays(e, values, 0, 0) from None
    shards = emb.local_shards.get(sharding.name, [])
    before = [t.to_numpy() for _, t in shards]  # (float32: exact for every table dtype)
    done = 0
    try:
        for shard, t in shards:
            block = stacked[shard.row_start:shard.row_start + shard.rows, shard.col_start:shard.col_start + shard.cols]
            try:
                t.assign(np.ascontiguousarray(block), 0)
            except ValueError as e:
                raise _in_arrays(e, values, shard.row_start, shard.col_start) from None
            done += 1
    except BaseException:
        for (_, t), old in zip(shards[:done], before):  # the stored values back, bit for bit
            t.assign(old, 0)
        raise
    return "OK"


# ------------------------------------------------------------------ save / load
def _tables_of(obj) -> List[Table]:
    if isinstance(obj, Table):
        return [obj]
    if isinstance(obj, Embedding):
        return list(obj.embedding_tables.values())
    if isinstance(obj, (list, tuple)) and obj and all(isinstance(t, Table) for t in obj):
        return list(obj)
    if isinstance(obj, (list, tuple)) and not obj:
        raise ValueError(f"expected an embedcore Table, a list of Tables, an Embedding or an adapter module holding "
                         f"tables, got an empty {type(obj).__name__}: no tables")
    if (isinstance(obj, (list, tuple)) and obj and all(isinstance(p, tuple) and len(p) == 2 and isinstance(p[1], Table)
                                                        and type(p[0]).__name__ == "Shard" for p in obj)):
        raise TypeError("got a list of (Shard, Table) pairs: a sharded Embedding's embedding_tables[config], "
                        "this rank's shards of a table; pass the sharded Embedding itself")
    tables = getattr(obj, "_embedcore_tables", None)  # framework adapters expose their tables
    if callable(tables):
        return list(tables())
    what = f"{type(obj).__module__}.{type(obj).__qualname__}"
    hint = ("; for a PyTorch model holding embedcore.adapters.torch modules, pass "
            "embedcore.adapters.torch.tables_of(model)" if callable(getattr(obj, "named_modules", None)) else "")
    raise TypeError(f"expected an embedcore Table, a list of Tables, an Embedding or an adapter module holding "
                    f"tables, got {what}{hint}")


_MAX_STRUCTURE_DEPTH = 24  # the manifest caps JSON nesting at 32 levels (docs/format.md)
# A table's index is 5 digits of its files' names; a save never writes a file of another name (it would not know
# it as its own, and no later save would remove it).
MAX_TABLES = 99999


def _check_table_count(n: int, call: str, kept: bool = False) -> None:
    if n > MAX_TABLES:
        raise ValueError(f"{call}: {n} tables{' with those the checkpoint there keeps' if kept else ''}; a "
                         f"checkpoint holds at most {MAX_TABLES} (a table's index is 5 digits of its file names)")


def _depth(x) -> int:
    if isinstance(x, dict):
        return 1 + max((_depth(v) for v in x.values()), default=0)
    if isinstance(x, list):
        return 1 + max((_depth(v) for v in x), default=0)
    return 0


def _metadata(obj) -> dict:
    if isinstance(obj, Embedding):
        return _features_metadata(obj.feature_config,
                                  [(n, obj._effective[f.table].name, f.max_sequence_length)
                                   for n, f in zip(obj._feature_names, obj._features)])
    hook = getattr(obj, "_embedcore_features", None)  # a framework adapter's features (TensorFlow's layer)
    got = hook() if callable(hook) else None
    if got is not None:
        feature_config, features = got
        for name, _, _ in features:
            _check_utf8(f"save: feature {name!r}", name)  # as an Embedding's names are checked
        return _features_metadata(feature_config, features, too_deep="tables")  # (its tables alone, as before)
    return {"kind": "table"}


def _features_metadata(feature_config, features, too_deep: str = "raise") -> dict:
    """The record of an embedding's features: `features` (name, table name,
    max_sequence_length) in the order `feature_config`, their nest, flattens
    (dict keys sorted); the nest itself where it can be recorded. A nest too
    deep for the manifest raises ValueError, or with ``too_deep="tables"``
    gives the record of tables alone."""
    structure = _structure_json(feature_config)
    if _depth(structure) > _MAX_STRUCTURE_DEPTH:
        if too_deep == "tables":
            return {"kind": "table"}
        # (n levels of lists and dicts take 2n + 1 levels of JSON)
        raise ValueError(f"save: the feature config nests too deeply to record ({(_depth(structure) - 1) // 2} "
                         f"levels of lists and dicts; at most {(_MAX_STRUCTURE_DEPTH - 1) // 2})")
    # Dicts with int keys: recorded as items, which readers before it ignore (they serve the features as a
    # list); left out, as before, where the items would nest too deeply for the manifest.
    structure_items = _structure_json(feature_config, items=True) if structure is None else None
    if structure_items is not None and _depth(structure_items) > _MAX_STRUCTURE_DEPTH:
        structure_items = None
    meta = {
        "kind": "embedding",
        "features": [{"name": n, "table": t, "max_sequence_length": length} for n, t, length in features],
        "structure": structure,
    }
    if structure_items is not None:
        meta["structure_items"] = structure_items
    return meta


def raise_interrupt_after_commit(error: BaseException, path: str, generation: int) -> None:
    """A KeyboardInterrupt (Ctrl-C) that came once a save's commit had made
    its `generation` the checkpoint at `path` (Python runs the handler as
    the native commit returns): raised again saying that the save took
    effect. Returns for anything else. Called while the save holds its
    claim on `generation` (no other save can commit that number)."""
    if not isinstance(error, KeyboardInterrupt):
        return
    try:
        committed = _embedcore.read_info(path).generation == generation
    except Exception:  # noqa: BLE001 - no readable manifest: not this save's
        committed = False
    if committed:
        raise KeyboardInterrupt(f"{path}: interrupted after the save committed: it holds the new checkpoint (step "
                                "and values of this save)").with_traceback(error.__traceback__) from None


def save(path, obj, include_optimizer: bool = True, values_dtype: Optional[str] = None) -> None:
    """Saves a Table or an Embedding into the directory `path`.

    include_optimizer: slots, step count and optimizer hyper-parameters, so
        that training resumed from the checkpoint continues bit-identically;
        False writes the values only (a serving export).
    values_dtype: the dtype the values are stored as, from a table of any
        dtype (an export option; slots stay float32). "float32" widens
        float16 and bfloat16 values exactly (they load back bit for bit into
        a table of their dtype); "float16" or "bfloat16" rounds the values to
        that dtype, and a value beyond its range (float16's 65504) fails the
        save, naming it. "uint8_rowwise" stores each row (of a table of any dtype) as FBGEMM's
        Fused8BitRowwise / TorchRec's INT8 rows do: ``dim`` uint8 codes, then
        a float32 scale and bias (value = scale * code + bias), a quarter of
        float32's bytes, with FBGEMM's rounding bit for bit
        (``torch.ops.fbgemm.FloatToFused8BitRowwiseQuantized``). Served by
        ``embedcore.serving.open`` (dequantized in the lookup) and loadable
        into tables of any dtype (dequantized); lossy, so ``reshard`` and
        ``Saver.dump_to_file`` refuse to copy it. A row holding NaN or an
        infinity, or whose range (max - min) overflows float32, fails the
        save (``ValueError`` naming the table and the row) and leaves `path`
        as it was. Format 1.4: older readers refuse such a checkpoint.

    A table of a PyTorch adapter module made with ``padding_idx`` records it
    (format 1.5): serving leaves that id out of the table's pooled bags, as
    the module does (docs/torch.md, State).

    A checkpoint holds finite values and slots only: a value or slot that is
    inf or NaN (a training step that diverged?) fails the save with a
    ``ValueError`` naming the table, the array (``values`` or the slot), the
    value and its row and column in the table.

    The save is atomic: the previous checkpoint at `path` stays loadable until
    the new one is complete and durable, and a save that fails leaves `path`
    as it was, but for one case its error says: the directory's sync after
    the new MANIFEST replaced the old one (the new checkpoint is then in
    place, not yet durable). A sharded Embedding is saved by every rank at once (each
    writes its own shards; see ``embedcore.distributed``); a failure on any
    rank fails the save on every rank.
    """
    if hasattr(obj, "_sharded_save"):  # collective: every rank writes its own shards
        return obj._sharded_save(path, include_optimizer, values_dtype)
    path = native_path(path)
    include_optimizer = _check_flag(include_optimizer, "include_optimizer", "save")
    _check_values_dtype(values_dtype)
    tables = _tables_of(obj)
    _check_table_count(len(tables), "save")
    names = set()
    for t in tables:
        if t.name in names:
            raise ValueError(f"save: two tables are named '{t.name}'; names must be unique")
        names.add(t.name)
    # Each table is written, and its config read, under its step lock (Saver._save_entries): the config recorded
    # is that of the optimizer whose slots are written, and a save never holds two tables' locks at once.
    Saver._save_entries(path, [(t, include_optimizer) for t in tables], False, _metadata(obj),
                        values_dtype=values_dtype, shard_index=-1)


VALUES_DTYPES = ("float32", "float16", "bfloat16", "uint8_rowwise")


def _check_flag(value, name: str, where: str) -> bool:
    """`value` as a bool, when it is one: Python's, NumPy's, or a 0-d bool
    array or tensor (NumPy, TensorFlow, PyTorch); TypeError otherwise:
    include_optimizer="no" is true, and would do the opposite of its word."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if type(value).__module__.split(".")[0] in ("numpy", "tensorflow", "torch") and hasattr(value, "dtype"):
        try:
            array = np.asarray(value)
        except Exception:  # noqa: BLE001 - a symbolic tensor, say: not a value
            array = None
        if array is not None and array.dtype == np.bool_ and array.shape == ():
            return bool(array)
    raise TypeError(f"{where}: {name} must be a bool, got {value!r}")


def _check_values_dtype(values_dtype) -> None:
    if values_dtype is not None and (not isinstance(values_dtype, str) or values_dtype not in VALUES_DTYPES):
        raise ValueError(f"values_dtype must be 'float32', 'float16', 'bfloat16' or 'uint8_rowwise', got "
                         f"{values_dtype!r}")


def _quantized_tables(manifest: dict) -> List[str]:
    """The tables of a manifest whose values files are uint8_rowwise."""
    return [t["name"] for t in manifest["tables"] if any(f["dtype"] == "uint8_rowwise" for f in t["values"])]


def _remove_if_created_and_empty(path: str, created: bool) -> None:
    """A failed save leaves no empty directory it created (rmdir only: never anything else)."""
    if created:
        with contextlib.suppress(OSError):
            os.rmdir(path)


def absolute_path(path: str) -> str:
    """`path` made absolute as the system reads it: the working directory
    joined in front, not ``os.path.abspath``'s textual normalisation, which
    makes "link/.." the link's own parent where the system goes to the link
    target's."""
    return path if os.path.isabs(path) else os.path.join(os.getcwd(), path)


def native_path(path, what: str = "path") -> str:
    """`path` (str, bytes or os.PathLike) as the str the engine takes; a
    ValueError names a path with a NUL byte (the system would cut it there)
    or one whose bytes are not UTF-8 (the engine's paths are UTF-8)."""
    p = os.fsdecode(path)
    if p == "":  # (the system's calls refuse it; os.path.realpath would make it the current directory)
        raise ValueError(f'{what} is empty ("." names the current directory)')
    if "\0" in p:
        raise ValueError(f"{what} {p!r} contains a NUL byte")
    try:
        p.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{what} {p!r} is not valid UTF-8; embedcore takes UTF-8 paths") from None
    return p


def check_destination(path, what: str = "path") -> None:
    """Raises CheckpointError when a save into `path` would refuse because
    `path` holds a MANIFEST that is not an embedcore manifest (another
    program's file): converters and the demo call it before their work,
    rather than failing at the save that ends it."""
    _embedcore.check_manifest_is_ours(native_path(path, what))


def resolved_path(path: str) -> str:
    """`path` with its symlinks resolved, so that a read opens every file in
    one directory even while a symlink such as /models/current is re-pointed
    to another checkpoint (where it does not resolve: `path`, and the read
    says what is missing)."""
    resolved = os.path.realpath(path)
    return resolved if os.path.isdir(resolved) else path


@contextlib.contextmanager
def _locked(path: str):
    """The checkpoint directory's shared lock (``flock``) for the block: a
    save's commit waits for it before it renames MANIFEST and removes older
    files, so the files this read opens stay there; it waits only while a
    commit runs (see docs/format.md, Concurrency)."""
    lock = _embedcore.CheckpointLock(path, False)
    try:
        yield
    finally:
        lock.release()


def read_info(path, slot_files: bool = True):
    """The validated manifest of the checkpoint at `path` (reads no values);
    checks that its files are present with their sizes (without
    `slot_files`: its values files only)."""
    return _embedcore.read_info(native_path(path), bool(slot_files))


def _scratch_dtype(values_dtype: Optional[str]) -> Optional[str]:
    """The dtype of the scratch block (``table_like``) that copies a table's
    data as stored into another checkpoint: the dtype its files store where
    a table can hold it (an export's bfloat16 of a float16 table, say), so
    that nothing is converted on the way (a bfloat16 value past float16's
    range survives); None: the table's own."""
    return values_dtype if values_dtype in ("float32", "float16", "bfloat16") else None


def _copy_block(info, index: int, block, row_start: int, col_start: int, has_optimizer: bool) -> None:
    """Reads the block `block` (a scratch table of `table_like`) of table
    `index`, its slots as stored (a copy into another checkpoint). A read
    error changed nothing the caller holds: it says so, not the engine's
    "partly loaded" note for a load into the caller's table."""
    try:
        _embedcore.load_table_block(info, index, block, row_start, col_start, has_optimizer, True, slot_domain=False)
    except (OSError, ValueError, MemoryError) as e:  # (an I/O error, a short read, memory for a buffer)
        errno_ = e.errno if isinstance(e, OSError) else None
        message = (e.strerror if errno_ else None) or str(e)
        cut = message.rfind("; table '", 0, max(0, message.find(" is partly loaded now")))
        if cut < 0:
            raise
        message = f"{message[:cut]}; nothing was written (the checkpoints are as they were): try again"
        raise (type(e)(errno_, message) if errno_ else type(e)(message)) from None


def load(path, into, include_optimizer: bool = True) -> None:
    """Loads the checkpoint at `path` into a Table or Embedding, matching
    tables by name. Every file the load needs is verified before any table
    changes, so a missing, truncated or corrupt checkpoint raises
    ``CheckpointError`` and leaves `into` exactly as it was. The copy reads
    the files through the descriptors the verification opened, so a file
    removed or replaced meanwhile changes nothing (past 256 files open for
    loads, a file is opened again, and one changed since its verification
    fails the load before any table changes). The tables
    change in one native call, so an interrupt (Ctrl-C) stops the load
    before any table changes or takes effect once all have. That call
    locks every target table and checks each again before the first copy:
    another thread's ``set_optimizer`` since the checks refuses the load
    with no table changed. (Another thread's lookup of one table sees it as
    it was or loaded; one of several tables may see some loaded.)

    Only an error of the copy itself (an I/O error of a disk failing
    between the verification and the copy; the tables are not staged in
    extra memory) can stop a load part way: it raises (``OSError`` with its
    errno, for an I/O error) with a message that names the table it partly
    loaded and the tables loaded before it, and says to load again: `into`
    then holds part of the checkpoint and part of what it held before. A
    sharded Embedding's collective load then raises on every rank, and
    every rank must load again.

    include_optimizer: also the slots and step count (when the checkpoint has
        them and the optimizers match); False loads the values only. A
        values-only checkpoint (saved with include_optimizer=False) loads its
        values and leaves the target's slots and step as they are. The
        optimizers match when they have the same slots; the hyper-parameters
        (learning rate, betas, ...) stay the target's, so a checkpoint can
        be fine-tuned with other ones.

    Any checkpoint loads into any Table, Embedding or sharded Embedding of
    the same table shapes, whatever world size and plan saved it. Values
    are converted to the target table's dtype; a value that would become
    infinite (a float32 beyond float16's range) raises ``CheckpointError``
    naming it, and nothing changes. A table saved with a ``padding_idx`` (a
    PyTorch module's) loads only into a table of the same one (a module made
    with it); any other target raises ``CheckpointError`` and nothing changes.
    """
    if hasattr(into, "_sharded_load"):  # collective: every rank reads only the blocks it owns
        return into._sharded_load(path, include_optimizer)
    path = resolved_path(native_path(path))
    include_optimizer = _check_flag(include_optimizer, "include_optimizer", "load")
    with _locked(path):  # no save's commit removes these files meanwhile
        _load(path, into, include_optimizer)


def _load(path: str, into, include_optimizer: bool) -> None:
    info = read_info(path, slot_files=include_optimizer)  # a values-only load needs no slot files
    names = list(info.table_names)
    index = {name: k for k, name in enumerate(names)}
    tables = _tables_of(into)
    plan = []
    for t in tables:
        if t.name not in index:
            raise CheckpointError(f"{info.path}: has no table '{t.name}' (it holds {names})")
        k = index[t.name]
        _check_padding(info, k, t)
        _embedcore.check_loadable(info, k, t._native, bool(include_optimizer))
        plan.append((k, t))
    # The files the verification opens stay open for the copy, which reads them: a file removed or replaced
    # in between changes nothing.
    files = _embedcore.LoadFiles()
    try:
        for k, t in plan:  # everything verified (and fits the target's dtype) before anything changes
            _embedcore.verify_table_block(info, k, t._native, 0, 0, bool(include_optimizer), files)
        # One native call for every table: an interrupt cannot leave some tables loaded and others not.
        _embedcore.load_tables(info, [(k, t._native, -1, 0) for k, t in plan], bool(include_optimizer), files)
    finally:
        files.close()


def _refuse_quantized_kept(path: str, manifest: dict, ours: set) -> None:
    """A dump keeps the other tables there as stored: a uint8_rowwise table
    would be dequantized and quantized again, which does not give its rows
    back (the codes of a row of a tiny range, for one), so it is refused."""
    kept = [n for n in _quantized_tables(manifest) if n not in ours]
    if kept:
        raise CheckpointError(f"dump_to_file: {path} holds table '{kept[0]}' stored as uint8_rowwise (a lossy export), "
                              "which a dump would have to keep by quantizing it again; dump into another directory, "
                              "or save the tables together with embedcore.save")


class Saver:
    """SOK's ``sok.Saver`` calls over embedcore checkpoints, with SOK's
    parameter names (``embedding_variable``: a Table, a list of tables, an
    Embedding or an adapter's module; ``filepath``: a directory), so SOK
    code that passes them by keyword runs unchanged. Each returns ``"OK"``
    on success, as SOK's do, and raises on failure."""

    def dump_to_file(self, embedding_variable, filepath) -> str:
        """Saves `embedding_variable`'s tables (with their optimizer state) into the
        checkpoint directory `filepath`, keeping the tables of other names
        already saved there, with their slots: SOK 1.x writes one pair of
        files per variable, so several variables can be dumped into one
        directory in turn, and each restored from it. The save is one atomic
        commit (a failure leaves the previous checkpoint as it was, as
        ``save``'s does); as
        ``save``, it refuses values or slots that are not finite, of
        `embedding_variable`'s tables or of the kept ones.

        Cost: the kept tables are read back (verified) and written again,
        block by block (64 MiB at most in memory), on every call; dumping N
        tables one call each rewrites the earlier ones N times, so pass them
        in one call (a list, or the Embedding) where you can. A kept table
        keeps its stored dtype, optimizer state and step, and is rewritten
        unsharded. The features of Embeddings dumped there are kept with
        their tables (served as one flat list of features). Two dumps into
        one directory at the same time are not merged: the last commit
        wins. A directory whose MANIFEST cannot be read is refused
        (its tables would be lost): remove it, or replace it with
        ``embedcore.save``. A sharded Embedding is dumped by every rank at
        once (its collective save), rank 0 keeping the other tables."""
        obj, path = embedding_variable, filepath
        if hasattr(obj, "_sharded_save"):
            obj._sharded_save(path, True, None, keep=True)
            return "OK"
        path = native_path(path)
        tables = _tables_of(obj)
        seen = set()
        for t in tables:  # as save refuses them, before anything is written
            if t.name in seen:
                raise ValueError(f"dump_to_file: two tables are named {t.name!r}; names must be unique")
            seen.add(t.name)
        if not os.path.isfile(os.path.join(path, "MANIFEST")):
            save(path, obj)
            return "OK"
        ours = {t.name for t in tables}
        with _locked(path):  # a commit meanwhile would remove the files the manifest names
            info = self._existing(path)
        old_manifest = json.loads(info.manifest_json)
        old_kind = (old_manifest.get("metadata") or {}).get("kind")
        _refuse_quantized_kept(path, old_manifest, ours)
        names, old = [t.name for t in tables], list(info.table_names)
        if names[:len(old)] == old and (old_kind != "embedding" or _metadata(obj).get("kind") == "embedding"):
            save(path, obj)  # nothing else there to keep (features included), the tables in their order
        else:
            self._save_entries(path, [(t, True) for t in tables], True, _metadata(obj))
        return "OK"

    @staticmethod
    def _existing(path: str):
        """The manifest of the checkpoint a dump adds to; CheckpointError,
        with what to do, when it cannot be read."""
        try:
            return _embedcore.read_info(path)
        except CheckpointError as e:
            raise CheckpointError(f"dump_to_file: {e}; the directory holds a checkpoint that cannot be read, whose "
                                  "other tables a dump keeps: remove it, or replace it with embedcore.save(path, obj)"
                                  ) from None

    @staticmethod
    def _save_entries(path: str, tables, keep: bool, metadata: dict, max_block_bytes: int = 64 << 20,
                      values_dtype: Optional[str] = None, shard_index: int = 0) -> None:
        """One atomic save into `path` of `tables`, (Table, include_optimizer)
        pairs (a table saved without optimizer is values-only), and with
        `keep` the tables of other names of the checkpoint already there,
        copied block by block as they are stored (dtype, slots, step). A
        failure removes what the save wrote and leaves the old checkpoint.
        Each table is written, and its config read, under its step lock
        (which ``Table.set_optimizer`` holds), one table at a time.
        `shard_index` -1 names the files as ``embedcore.save`` does
        (``t00000.values.g...``), 0 as a one-shard table's."""
        from .distributed._checkpoint import _manifest

        created = not os.path.lexists(path)  # removed again if this save fails (when empty)
        try:  # the claim makes the directory first: one that it cannot make its claim in is not left behind
            claim = _embedcore.GenerationClaim(path)
        except BaseException:
            _remove_if_created_and_empty(path, created)
            raise
        generation = claim.generation
        try:
            names = [t.name for t, _ in tables]
            order = Saver._dump_order(path, names) if keep else {n: i for i, n in enumerate(names)}
            entries = []
            for t, include_optimizer in tables:
                with t._schedule_lock():  # the config recorded is that of the optimizer whose slots are written
                    entry = json.loads(_embedcore.write_shard_files(path, generation, f"t{order[t.name]:05d}.",
                                                                    shard_index, t._native, 0, 0,
                                                                    bool(include_optimizer), values_dtype))
                    entry["config"] = _table_config_json(t.config, t)
                entry["rows"], entry["dim"] = t.rows, t.dim
                entry["sharding"] = {"plan": "none", "world_size": 1}
                entries.append((order[t.name], entry))
            if keep:
                kept, metadata = Saver._kept_entries(path, generation, set(names), order, metadata, max_block_bytes)
                entries += kept
            entries = [e for _, e in sorted(entries, key=lambda pair: pair[0])]
            _embedcore.commit_checkpoint(path, _manifest(generation, entries, metadata))
        except BaseException as e:
            _embedcore.remove_generation(path, generation)  # not once the manifest's rename made it the checkpoint
            try:  # (while the claim is held: once released, another save may commit this generation number)
                raise_interrupt_after_commit(e, path, generation)
            finally:
                claim.release()
                _remove_if_created_and_empty(path, created)
            raise
        finally:
            claim.release()

    @staticmethod
    def _dump_order(path: str, names) -> dict:
        """{table name: index} of a dump of the tables `names` that keeps the
        others at `path`: the checkpoint's tables in its order (each of
        `names` in its place), then the new ones. A dump that rewrites tables
        already there keeps the order, so a server reloads it (the C API's
        reload requires the same tables in the same order)."""
        old = []
        if os.path.isfile(os.path.join(path, "MANIFEST")):
            with _locked(path):
                old = list(Saver._existing(path).table_names)
        order = {n: i for i, n in enumerate(old + [n for n in names if n not in old])}
        _check_table_count(len(order), "dump_to_file", kept=len(order) > len(names))
        return order

    @staticmethod
    def _kept_entries(path: str, generation: int, ours: set, order: dict, metadata: dict,
                      max_block_bytes: int = 64 << 20):
        """The tables of the checkpoint at `path` whose names are not in
        `ours`, copied into the files of `generation` (the caller's claim),
        block by block as they are stored (dtype, slots, step), with the
        metadata that keeps their features beside `metadata`'s. Returns
        ([(index, entry)], metadata), the index `order`'s (``_dump_order``; a
        table it does not name, saved there since, comes after them all);
        nothing to keep (no checkpoint there, or only tables of `ours` and
        features of an Embedding's save) gives ([], metadata)."""
        from .distributed._checkpoint import _merge

        if not os.path.isfile(os.path.join(path, "MANIFEST")):
            return [], metadata
        element = {"float32": 4, "float16": 2, "bfloat16": 2}
        entries, later = [], max(order.values(), default=-1) + 1
        lock = _embedcore.CheckpointLock(path, False)  # no other commit removes its files meanwhile
        try:
            info = Saver._existing(path)
            manifest = json.loads(info.manifest_json)
            old_meta = manifest.get("metadata") or {}
            if (all(t["name"] in ours for t in manifest["tables"])
                    and (old_meta.get("kind") != "embedding" or metadata.get("kind") == "embedding")):
                return [], metadata
            _refuse_quantized_kept(path, manifest, ours)
            if old_meta.get("kind") == "embedding":
                metadata = Saver._merged_features(metadata, old_meta, ours)
            for k, t in enumerate(manifest["tables"]):
                if t["name"] in ours:
                    continue
                has_opt = bool(info.table_has_optimizer(k))
                stored = {f["dtype"] for f in t["values"]}
                values_dtype = stored.pop() if len(stored) == 1 else None
                if values_dtype == t["dtype"]:
                    values_dtype = None
                slots, row_slots = _slot_counts(t)
                row_bytes = t["dim"] * (element.get(values_dtype or t["dtype"], 4) + 4 * slots) + 4 * row_slots
                chunk = max(1, max_block_bytes // max(1, row_bytes))
                position = order.get(t["name"])
                if position is None:  # (saved there since the order was taken)
                    position, later = later, later + 1
                    _check_table_count(later, "dump_to_file", kept=True)
                prefix, pieces = f"t{position:05d}.", []
                for index, r0 in enumerate(range(0, t["rows"], chunk)):
                    block = _embedcore.table_like(info, k, min(chunk, t["rows"] - r0), t["dim"],
                                                  _scratch_dtype(values_dtype))
                    try:
                        _copy_block(info, k, block, r0, 0, has_opt)
                    except CheckpointError as e:  # e.g. an optimizer this version does not know
                        kept = "with their optimizer state" if has_opt else "as stored"
                        raise CheckpointError(f"dump_to_file keeps the other tables of {path} {kept}: {e}") from None
                    pieces.append(json.loads(_embedcore.write_shard_files(
                        path, generation, prefix, index, block, r0, 0, has_opt, values_dtype)))
                    del block
                entry = _merge(t, pieces)
                entry["sharding"] = {"plan": "none", "world_size": 1}
                entries.append((position, entry))
        finally:
            lock.release()
        return entries, metadata

    @staticmethod
    def _merged_features(new: dict, old: dict, ours: set) -> dict:
        """The metadata of a dump that keeps the tables of the checkpoint there:
        the features of `old` whose table is kept, in their order, each that a
        feature of `new` (an Embedding's, or none for tables) names again
        replaced in its place by it, then `new`'s other features; served as a
        flat list (no one structure holds both)."""
        kept = old.get("features") or []
        if not isinstance(kept, list) or not all(
                isinstance(f, dict) and isinstance(f.get("name"), str) and isinstance(f.get("table"), str)
                for f in kept):
            raise CheckpointError("dump_to_file: the checkpoint there has malformed metadata.features (a list of "
                                  "objects with a 'name' and a 'table' expected), which a dump would keep: remove "
                                  "it, or dump into another directory")
        if new.get("kind") != "embedding":  # tables: the old features all still have their tables
            features = list(kept)
        else:  # in the old order: a feature dumped again (or taking a kept one's name) in its place, new ones last
            fresh = {f["name"]: f for f in new.get("features") or []}
            features = [fresh.pop(f["name"]) if f["name"] in fresh else f for f in kept
                        if f["name"] in fresh or f["table"] not in ours]
            features += list(fresh.values())
        merged = {k: v for k, v in old.items() if k not in ("features", "structure", "structure_items")}
        merged.update(kind="embedding", features=features, structure=None)
        return merged

    def restore_from_file(self, embedding_variable, filepath, include_optimizer: bool = True) -> str:
        """Loads `embedding_variable`'s tables from the checkpoint `filepath` (``embedcore.load``),
        with their optimizer slots and step; `include_optimizer=False` takes
        the values alone, as SOK 1.x's restore does, so a checkpoint of one
        optimizer restores into a table of another."""
        obj, path = embedding_variable, filepath
        try:
            load(path, into=obj, include_optimizer=include_optimizer)
        except CheckpointError as e:
            p = native_path(path)
            if os.path.isdir(p) and not os.path.exists(os.path.join(p, "MANIFEST")):
                sok = [n for n in sorted(os.listdir(p)) if n.endswith(("_keys.file", "-key"))]
                if sok:
                    raise CheckpointError(
                        f"{e}; {p} holds no embedcore checkpoint but looks like a SOK dump ({', '.join(sok[:3])}"
                        f"{', ...' if len(sok) > 3 else ''}): convert it first with `python -m embedcore convert "
                        f"--from sok {p} DST` (or embedcore.sok.convert) and restore from DST") from None
            raise
        return "OK"

    def load_embedding_values(self, embedding_variable, tensors) -> str:
        """Fills the table `embedding_variable` with `tensors` (one ``[n,
        dim]`` array or tensor, or a list of them) stacked along rows; their
        rows must add up to the table's. `embedding_variable` is a Table, or
        an Embedding (an adapter's layer) of one table; a sharded
        Embedding of one table takes the whole table's values on every rank,
        as SOK's model-parallel variables do, and each rank fills its own
        shards (no communication). Values only: slots and step stay."""
        table, arrays = embedding_variable, tensors
        if isinstance(table, Embedding) and hasattr(table, "local_shards"):  # sharded: this rank's blocks
            return _load_shard_values(table, arrays)
        if not isinstance(table, Table):
            tables = _tables_of(table)
            if len(tables) != 1:
                raise TypeError(f"load_embedding_values takes one table; {type(table).__name__} holds {len(tables)} "
                                f"({', '.join(repr(t.name) for t in tables[:5])}{', ...' if len(tables) > 5 else ''}): "
                                "pass one of them (an Embedding's embedding_tables[config])")
            table = tables[0]
        values, stacked = _stacked_values(arrays, table.rows, table.dim, table.name)
        try:
            table.assign(stacked, 0)
        except ValueError as e:
            raise _in_arrays(e, values, 0, 0) from None
        return "OK"
