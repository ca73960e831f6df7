"""``convert_state_dict``: the embedding tables of a PyTorch state dict
(``torch.save(model.state_dict())`` of a model that holds TorchRec's
collections, or this adapter's, or a ``torch.distributed.checkpoint``
directory of one) as an embedcore checkpoint, to serve them without PyTorch
(``embedcore convert --from torch``)."""
from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import List, Optional, Tuple

import torch

import embedcore as ec
from embedcore.checkpoint import check_destination

__all__ = ["convert_state_dict"]

# A TorchRec collection's tables in a state dict: <module>.embedding_bags.<table>.weight
# (EmbeddingBagCollection) or <module>.embeddings.<table>.weight (EmbeddingCollection), and nothing else
# under <module>.<kind>. (a module named `embeddings` that holds anything else is no collection).
_UNDER_KIND = re.compile(r"^(?:(?P<module>.*)\.)?(?P<kind>embedding_bags|embeddings)\.(?P<rest>.+)$")
# A key that is a table's: tried first, so that a table named `embeddings` or `embedding_bags`
# (<module>.embedding_bags.embeddings.weight) is not read as a module of that name holding "weight".
_TABLE_KEY = re.compile(r"^(?:(?P<module>.*)\.)?(?P<kind>embedding_bags|embeddings)\.(?P<rest>[^.]+\.weight)$")
_TABLE = re.compile(r"^(?P<table>[^.]+)\.weight$")
_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
_CHUNK_BYTES = 64 << 20  # rows converted to float32 at a time
_SHARDED = ("a sharded state dict: save the unsharded module's state dict, or gather each table's shards into "
            "one tensor first")



def _beside(state, parent: str, child: str) -> list:
    """The state dict's keys under the module `child` of `parent` (a wrapper's
    id processing beside its collection)."""
    start = f"{parent + '.' if parent else ''}{child}."
    return [k for k in state if isinstance(k, str) and k.startswith(start)]

def _not_a_table(key: str, value) -> Optional[str]:
    """Why `value` cannot be a table's weight (None when it can)."""
    if not isinstance(value, torch.Tensor):
        return f"{key} is a {type(value).__name__}, not a tensor"
    if value.dim() != 2 or value.dtype not in _DTYPES:
        return f"{key} is a {value.dim()}-D {value.dtype} tensor, not a 2-D float32, float16 or bfloat16 table"
    return None


def _tables(state: Mapping, path: str, prefix: Optional[str]) -> List[Tuple[str, str, str, torch.Tensor]]:
    """(key, table name, kind, weight) of every collection's table (under
    `prefix`, a module path; None: every collection), checked before any
    table is made."""
    groups = {}  # (module, kind) -> [(key, rest, value)]
    for key, value in state.items():
        m = (_TABLE_KEY.match(key) or _UNDER_KIND.match(key)) if isinstance(key, str) else None
        if m is not None and (prefix is None or (m["module"] or "") == prefix):
            groups.setdefault((m["module"] or "", m["kind"]), []).append((key, m["rest"], value))
    found, names, skipped = [], {}, []
    for (module, kind), items in groups.items():
        where = f"{module + '.' if module else ''}{kind}"
        why = next((f"{key} is not <table>.weight" for key, rest, _ in items if not _TABLE.match(rest)), None)
        # A collection's tables of another dtype (float64, a quantized collection's uint8 rows) cannot convert:
        # refused (they were left out, unsaid, beside the tables converted).
        bad = None if why else next(((key, value.dtype) for key, _, value in items
                                     if isinstance(value, torch.Tensor) and value.dim() == 2
                                     and value.dtype not in _DTYPES), None)
        if bad is not None:
            key, dtype = bad
            raise ValueError(f"{path}: {key} is a {dtype} table; tables convert from float32, float16 or bfloat16"
                             + (" (a quantized collection: convert its float module)"
                                if dtype in (torch.uint8, torch.int8) else " (cast it: .float())"))
        why = why or next((w for key, _, value in items for w in [_not_a_table(key, value)] if w), None)
        if why is not None:  # no collection (a transformer's `embeddings` module): skipped, unless named
            if prefix is not None:
                raise ValueError(f"{path}: {where} is not a TorchRec collection's tables: {why}")
            skipped.append(f"{where} ({why})")
            continue
        parent = module.rpartition(".")[0] if module.endswith("_embedding_bag_collection") else None
        if parent is not None:
            processors = _beside(state, parent, "_feature_processors")
            if processors:
                raise ValueError(f"{path}: {where} belongs to a FeatureProcessedEmbeddingBagCollection, whose "
                                 f"feature processors ({', '.join(processors[:3])}) weight each id before pooling; "
                                 "a served table pools the rows alone, so its lookups would differ")
        parent = module.rpartition(".")[0] if module.rpartition(".")[2] == "_embedding_module" else None
        if parent is not None:
            remaps = _beside(state, parent, "_managed_collision_collection")
            if remaps:
                raise ValueError(f"{path}: {items[0][0]} belongs to a TorchRec ManagedCollisionEmbedding"
                                 f"{'Bag' if kind == 'embedding_bags' else ''}Collection, whose "
                                 f"{parent + '.' if parent else ''}_managed_collision_collection ({len(remaps)} "
                                 f"keys, e.g. {remaps[0]}) remaps each raw id to a row before the lookup; a served "
                                 "table takes the ids as rows, so its lookups would read other rows")
        for key, rest, value in items:
            if type(value) not in (torch.Tensor, torch.nn.Parameter) or value.layout != torch.strided:
                raise ValueError(f"{path}: {key} is a {type(value).__name__} ({value.layout}): {_SHARDED}")
            if value.device.type == "meta":
                raise ValueError(f"{path}: {key} is on the meta device (it holds no values)")
            table = _TABLE.match(rest)["table"]
            if table in names:
                raise ValueError(f"{path}: {names[table]} and {key} are both tables named '{table}'; convert one "
                                 "collection at a time with prefix= (--prefix), the module path before "
                                 "'.embedding_bags' / '.embeddings'")
            names[table] = key
            found.append((key, table, kind, value))
    if not found:
        where = f" under the module '{prefix}'" if prefix is not None else ""
        some = ", ".join(repr(k) for k in list(state)[:5])
        raise ValueError(f"{path}: no table weights{where} (keys <module>.embedding_bags.<table>.weight or "
                         f"<module>.embeddings.<table>.weight); its first keys: {some or 'none'}"
                         + (f"; not tables: {'; '.join(skipped)}" if skipped else ""))
    return found


def _load(path: str) -> Mapping:
    """The state dict that torch.save wrote to the file `path`, memory-mapped
    (tables are read a chunk at a time, not all at once) unless the file is
    in torch.save's legacy format, which cannot be."""
    try:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:
            if "mmap" not in str(e):
                raise
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - a file torch cannot read, in the caller's terms
        text = str(e)
        if "sharded_tensor" in text or "ShardedTensor" in text or "DTensor" in text:
            raise ValueError(f"{path}: holds sharded tensors: {_SHARDED}") from None
        raise ValueError(f"{path}: cannot read it as a PyTorch state dict: {type(e).__name__}: "
                         f"{text.splitlines()[0] if text else ''}") from None
    if not isinstance(state, Mapping):
        raise ValueError(f"{path}: holds a {type(state).__name__}, not a state dict (write it with "
                         "torch.save(model.state_dict()))")
    return state


class _Object:
    """A value of a distributed checkpoint other than a tensor (left unread)."""


def _dcp_state(path: str) -> dict:
    """The state dict of the torch.distributed.checkpoint (DCP) directory
    `path`, as one process reads it: every tensor under a module named
    `embedding_bags` or `embeddings` whole (whatever shards wrote it), the
    other keys as _Object."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException  # (a BaseException, not an Exception)
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        metadata = dcp.FileSystemReader(path).read_metadata()
    except Exception as e:  # noqa: BLE001 - in the caller's terms
        raise ValueError(f"{path}: cannot read it as a torch.distributed.checkpoint directory: {type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''}") from None
    state, tensors = {}, {}
    for key, meta in metadata.state_dict_metadata.items():
        if isinstance(meta, TensorStorageMetadata) and _UNDER_KIND.match(key):
            tensors[key] = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        state[key] = tensors.get(key, _Object())
    if tensors:
        with warnings.catch_warnings():  # (one process and no process group: DCP says so, and reads it all)
            warnings.simplefilter("ignore")
            try:
                dcp.load(tensors, checkpoint_id=path)
            except (Exception, CheckpointException) as e:  # noqa: BLE001 - a data file missing, cut short, damaged
                raise ValueError(f"{path}: cannot read its tables: {_cause(e)}") from None
    return state


def _cause(e: BaseException) -> str:
    """`e` in one line: DCP's CheckpointException wraps each rank's error,
    with its traceback, in its message; the first rank's error is the cause."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        e = first[0] if isinstance(first, tuple) and first and isinstance(first[0], BaseException) else e
    lines = str(e).splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"


def convert_state_dict(src, dst, prefix: Optional[str] = None, combiner: str = "sum") -> List[str]:
    """Converts the embedding tables of a model's state dict into an
    embedcore checkpoint at `dst`, values only (each table's bit for bit in
    its own dtype: float32, float16 or bfloat16); returns the table names.
    `src`: the file ``torch.save(model.state_dict())`` wrote, or the
    directory of a ``torch.distributed.checkpoint`` (DCP) save, TorchRec's
    format for sharded training: one process reads each table whole,
    whatever shards and ranks wrote it.

    The tables are the keys ``<module>.embedding_bags.<table>.weight`` (an
    ``EmbeddingBagCollection``'s, TorchRec's or this adapter's: written with
    `combiner`, TorchRec's default "sum", since a state dict does not record
    the pooling) and ``<module>.embeddings.<table>.weight`` (an
    ``EmbeddingCollection``'s, written with "sum"; look them up with
    ``combiner=None``). `prefix`: only the tables of the module at that path
    ("" for the model itself); needed when two modules hold tables of one
    name. Every table is checked before the checkpoint is written: a bad one
    (sharded, not 2-D float, not finite, or a FeatureProcessed or
    ManagedCollision collection's, whose lookups a served table cannot
    reproduce) raises ``ValueError`` naming its key."""
    if combiner not in ("sum", "mean", "sqrtn"):
        raise ValueError(f"combiner must be 'sum', 'mean' or 'sqrtn', not {combiner!r}")
    check_destination(dst, "dst")  # before the conversion's work, not at its save
    path = os.fspath(src)
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, ".metadata")):
            raise ValueError(f"{path}: a directory, but no torch.distributed.checkpoint (it has no .metadata)")
        state = _dcp_state(path)
    else:
        state = _load(path)
    tables = []
    for key, name, kind, value in _tables(state, path, prefix):
        rows, dim = (int(n) for n in value.shape)
        table = ec.Table(name=name, rows=rows, dim=dim, dtype=_DTYPES[value.dtype],
                         initializer=ec.initializers.Zeros(), combiner=combiner if kind == "embedding_bags" else "sum")
        step = max(1, _CHUNK_BYTES // (4 * dim))
        for r in range(0, rows, step):  # float32 holds every float16 and bfloat16 value: exact
            try:
                table.assign(value[r:r + step].detach().to(torch.float32).resolve_neg().numpy(), r)
            except ValueError as e:  # (its row index counts from row r)
                raise ValueError(f"{path}: {key}, rows from {r}: {e}") from None
        tables.append(table)
    ec.save(dst, tables if len(tables) > 1 else tables[0], include_optimizer=False)
    return [t.name for t in tables]
