"""``convert_state_dict``: the embedding tables of a PyTorch state dict
(``torch.save(model.state_dict())`` of a model that holds TorchRec's
collections, or this adapter's) as an embedcore checkpoint, to serve them
without PyTorch (``embedcore convert --from torch``)."""
from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import List, Optional, Tuple

import torch

import embedcore as ec

__all__ = ["convert_state_dict"]

# TorchRec's state dict keys of a table: <module path>.embedding_bags.<table>.weight (EmbeddingBagCollection)
# or <module path>.embeddings.<table>.weight (EmbeddingCollection).
_TABLE_KEY = re.compile(r"^(?:(?P<module>.*)\.)?(?P<kind>embedding_bags|embeddings)\.(?P<table>[^.]+)\.weight$")
_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
_CHUNK_BYTES = 64 << 20  # rows converted to float32 at a time


def _tables(state: Mapping, path: str, prefix: Optional[str]) -> List[Tuple[str, str, str, torch.Tensor]]:
    """(key, table name, kind, weight) of every table under `prefix` (a
    module path; None: anywhere), checked before any table is made."""
    found, names = [], {}
    for key, value in state.items():
        m = _TABLE_KEY.match(key) if isinstance(key, str) else None
        if m is None or (prefix is not None and (m["module"] or "") != prefix):
            continue
        if not isinstance(value, torch.Tensor) or type(value).__name__ == "ShardedTensor":
            raise ValueError(f"{path}: {key} is a {type(value).__name__}, not a tensor (a sharded state dict: "
                             "save the unsharded module's state dict, or gather its shards to one tensor)")
        if value.dim() != 2 or value.dtype not in _DTYPES:
            raise ValueError(f"{path}: {key} is a {value.dim()}-D {value.dtype} tensor; a table's weight is 2-D "
                             "float32, float16 or bfloat16")
        if value.device.type == "meta":
            raise ValueError(f"{path}: {key} is on the meta device (it holds no values)")
        if m["table"] in names:
            raise ValueError(f"{path}: {names[m['table']]} and {key} are both tables named '{m['table']}'; convert "
                             "one collection at a time with prefix= (--prefix), the module path before "
                             "'.embedding_bags' / '.embeddings'")
        names[m["table"]] = key
        found.append((key, m["table"], m["kind"], value))
    if not found:
        where = f" under the module '{prefix}'" if prefix is not None else ""
        some = ", ".join(repr(k) for k in list(state)[:5])
        raise ValueError(f"{path}: no table weights{where} (keys <module>.embedding_bags.<table>.weight or "
                         f"<module>.embeddings.<table>.weight); its first keys: {some or 'none'}")
    return found


def convert_state_dict(src, dst, prefix: Optional[str] = None, combiner: str = "sum") -> List[str]:
    """Converts the embedding tables of the state dict that
    ``torch.save(model.state_dict())`` wrote to `src` into an embedcore
    checkpoint at `dst` (values only: a state dict holds no optimizer
    state), each table's values bit for bit in its own dtype (float32,
    float16 or bfloat16). Returns the table names.

    The tables are the keys ``<module>.embedding_bags.<table>.weight`` (an
    ``EmbeddingBagCollection``'s, TorchRec's or this adapter's: written with
    `combiner`, TorchRec's default "sum", since a state dict does not record
    the pooling) and ``<module>.embeddings.<table>.weight`` (an
    ``EmbeddingCollection``'s, written with "sum"; look them up with
    ``combiner=None``). `prefix`: only the tables of the module at that path
    ("" for the model itself); needed when two modules hold tables of one
    name. Every table is checked before the checkpoint is written: a bad one
    (sharded, not 2-D float, not finite) raises ``ValueError`` naming its key."""
    if combiner not in ("sum", "mean", "sqrtn"):
        raise ValueError(f"combiner must be 'sum', 'mean' or 'sqrtn', not {combiner!r}")
    path = os.fspath(src)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - a file torch cannot read, in the caller's terms
        raise ValueError(f"{path}: cannot read it as a PyTorch state dict: {type(e).__name__}: {e}") from None
    if not isinstance(state, Mapping):
        raise ValueError(f"{path}: holds a {type(state).__name__}, not a state dict (write it with "
                         "torch.save(model.state_dict()))")
    tables = []
    for key, name, kind, value in _tables(state, path, prefix):
        rows, dim = (int(n) for n in value.shape)
        table = ec.Table(name=name, rows=rows, dim=dim, dtype=_DTYPES[value.dtype],
                         initializer=ec.initializers.Zeros(), combiner=combiner if kind == "embedding_bags" else "sum")
        step = max(1, _CHUNK_BYTES // (4 * dim))
        for r in range(0, rows, step):  # float32 holds every float16 and bfloat16 value: exact
            try:
                table.assign(value[r:r + step].detach().to(torch.float32).numpy(), r)
            except ValueError as e:  # (its row index counts from row r)
                raise ValueError(f"{path}: {key}, rows from {r}: {e}") from None
        tables.append(table)
    ec.save(dst, tables if len(tables) > 1 else tables[0], include_optimizer=False)
    return [t.name for t in tables]
