"""Sharding plans: which rank holds which rows and columns of each table.

- ``table_wise``: the whole table on one rank (the least loaded one).
- ``row_wise``: rows split over every rank in contiguous, near-equal blocks
  (rank r holds rows [r*rows//W, (r+1)*rows//W); a table with fewer rows
  than ranks leaves some ranks without a shard).
- ``column_wise``: the dimension split into min(W, dim) near-equal column
  ranges, each on a different rank (the least loaded ones). Not for a table
  with row-wise slots (``RowWiseAdagrad``: one accumulator per whole row).
- ``auto``: per table, the plan that keeps the bytes of values and slots per
  rank balanced: tables are taken largest first; one that fits within half a
  rank's fair share goes table-wise to the least loaded rank, a larger one
  row-wise over every rank.
"""
from __future__ import annotations

import numbers
from typing import Dict, List, NamedTuple, Sequence, Tuple, Union

import numpy as np

__all__ = ["Shard", "TableSharding", "ShardingPlan", "KINDS"]

KINDS = ("table_wise", "row_wise", "column_wise")
_ELEMENT_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
MAX_WORLD_SIZE = 1 << 20  # a plan holds a few numbers per rank


class Shard(NamedTuple):
    """A block of a table: rows [row_start, row_start + rows) and columns
    [col_start, col_start + cols), held by `rank`."""

    rank: int
    row_start: int
    rows: int
    col_start: int
    cols: int


class TableSharding(NamedTuple):
    name: str
    rows: int
    dim: int
    kind: str  # one of KINDS
    shards: tuple  # of Shard, none empty

    def to_json(self) -> dict:
        return {"plan": self.kind, "shards": [s._asdict() for s in self.shards]}


class ShardingPlan:
    """The shards of every table over `world_size` ranks, and the bytes of
    values and slots each rank holds."""

    def __init__(self, world_size: int, tables: Sequence[TableSharding],
                 bytes_of: Dict[str, Union[int, Tuple[int, int]]]):
        """bytes_of: by table name, (bytes per element, bytes per row besides),
        or the bytes per element alone."""
        bytes_of = {k: (v, 0) if isinstance(v, (int, np.integer)) else tuple(v) for k, v in bytes_of.items()}
        self.world_size = world_size
        self.tables: Dict[str, TableSharding] = {t.name: t for t in tables}
        load = np.zeros(world_size, np.int64)
        for t in tables:
            for s in t.shards:
                load[s.rank] += _shard_bytes(s, bytes_of[t.name])
        self.bytes_per_rank: List[int] = [int(b) for b in load]

    def __getitem__(self, name: str) -> TableSharding:
        return self.tables[name]

    def describe(self) -> str:
        """What the plan chose, one line per table, and the bytes per rank."""
        lines = [f"sharding over {self.world_size} ranks:"]
        for t in self.tables.values():
            where = ", ".join(f"r{s.rank}:rows[{s.row_start}:{s.row_start + s.rows}]"
                              f"{'' if s.cols == t.dim else f' cols[{s.col_start}:{s.col_start + s.cols}]'}"
                              for s in t.shards)
            lines.append(f"  {t.name} ({t.rows} x {t.dim}): {t.kind} -> {where}")
        lines.append("  bytes per rank (values + slots): " + ", ".join(f"{b:,}" for b in self.bytes_per_rank))
        return "\n".join(lines)

    __str__ = describe

    def __repr__(self) -> str:
        kinds = {n: t.kind for n, t in self.tables.items()}
        return f"ShardingPlan(world_size={self.world_size}, {kinds})"


def _split(n: int, parts: int) -> List[tuple]:
    """[start, length) of `parts` near-equal pieces of n."""
    bounds = [(i * n) // parts for i in range(parts + 1)]
    return [(bounds[i], bounds[i + 1] - bounds[i]) for i in range(parts)]


def _shard_bytes(s: Shard, bytes_of: Tuple[int, int]) -> int:
    per_element, per_row = bytes_of
    return s.rows * (s.cols * per_element + per_row)


def _table_tuple(t, i: int) -> tuple:
    """(name, rows, dim, dtype, num_slots, num_row_slots) of make_plan's
    table `i`, checked; dtype float32 and no slots where left out."""
    if not isinstance(t, (tuple, list)) or not 3 <= len(t) <= 6:
        raise TypeError(f"make_plan: tables[{i}] must be (name, rows, dim[, dtype, num_slots, num_row_slots]), "
                        f"got {t!r}")
    name, rows, dim, dtype, slots, row_slots = tuple(t) + ("float32", 0, 0)[len(t) - 3:]
    if not isinstance(name, str):
        raise TypeError(f"make_plan: tables[{i}] name must be a str, got {name!r}")
    for field, value, least in (("rows", rows, 1), ("dim", dim, 1), ("num_slots", slots, 0),
                                ("num_row_slots", row_slots, 0)):
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
            raise TypeError(f"make_plan: table {name!r} {field} must be an int, got {value!r}")
        if value < least:
            raise ValueError(f"make_plan: table {name!r} {field} must be >= {least}, got {value}")
    if not isinstance(dtype, str) or dtype not in _ELEMENT_BYTES:
        raise ValueError(f"make_plan: table {name!r} dtype must be one of {sorted(_ELEMENT_BYTES)}, got {dtype!r}")
    return name, int(rows), int(dim), dtype, int(slots), int(row_slots)


def make_plan(tables: Sequence[tuple], world_size: int, sharding) -> ShardingPlan:
    """tables: (name, rows, dim, dtype, num_slots, num_row_slots) in order
    (slots of [rows, dim], slots of [rows, 1]; dtype "float32" and no
    slots when left out); sharding: a kind or "auto" for every table, or a
    dict from table name to one. Bad arguments raise TypeError or
    ValueError naming them."""
    if isinstance(world_size, (bool, np.bool_)) or not isinstance(world_size, numbers.Integral):
        raise TypeError(f"make_plan: world_size must be an int, got {world_size!r}")
    if not 1 <= world_size <= MAX_WORLD_SIZE:
        raise ValueError(f"make_plan: world_size must be in [1, {MAX_WORLD_SIZE}], got {world_size}")
    world_size = int(world_size)
    if not isinstance(tables, (list, tuple)):
        raise TypeError(f"make_plan: tables must be a list of (name, rows, dim, ...) tuples, got "
                        f"{type(tables).__name__}")
    tables = [_table_tuple(t, i) for i, t in enumerate(tables)]
    seen = set()
    for name, *_ in tables:
        if name in seen:
            raise ValueError(f"make_plan: two tables are named {name!r}")
        seen.add(name)
    if isinstance(sharding, str) or sharding is None:
        kinds = {name: "auto" if sharding is None else sharding for name, *_ in tables}
    elif isinstance(sharding, dict):
        names = {name for name, *_ in tables}
        unknown = [k for k in sharding if not isinstance(k, str) or k not in names]
        if unknown:
            raise ValueError(f"sharding names tables that do not exist: {sorted(unknown, key=repr)}")
        kinds = {name: sharding.get(name, "auto") for name, *_ in tables}
    else:
        raise TypeError(f"sharding must be one of {KINDS + ('auto',)} or a dict of them by table name, "
                        f"got {sharding!r}")
    for name, kind in kinds.items():
        if kind not in KINDS + ("auto",):
            raise ValueError(f"sharding of table '{name}' must be one of {KINDS + ('auto',)}, got {kind!r}")

    for name, rows, dim, dtype, slots, row_slots in tables:
        if row_slots and kinds[name] == "column_wise":
            raise ValueError(f"sharding of table '{name}': column_wise splits its columns, but its optimizer keeps "
                             f"one value per whole row (RowWiseAdagrad); use row_wise or table_wise")
    W = world_size
    bytes_of = {name: (_ELEMENT_BYTES[dtype] + 4 * slots, 4 * row_slots)
                for name, rows, dim, dtype, slots, row_slots in tables}
    total = {name: _shard_bytes(Shard(0, 0, rows, 0, dim), bytes_of[name]) for name, rows, dim, *_ in tables}
    fair = sum(total.values()) / W
    load = [0] * W

    def least_loaded(k: int, exclude=()) -> List[int]:
        order = sorted((r for r in range(W) if r not in exclude), key=lambda r: (load[r], r))
        return order[:k]

    chosen: Dict[str, TableSharding] = {}
    # Largest first, so the greedy placement balances well; ties by name for determinism.
    for name, rows, dim, *_ in sorted(tables, key=lambda t: (-total[t[0]], t[0])):
        kind = kinds[name]
        if kind == "auto":
            kind = "table_wise" if W == 1 or total[name] <= fair / 2 else "row_wise"
        if kind == "table_wise":
            r = least_loaded(1)[0]
            shards = [Shard(r, 0, rows, 0, dim)]
        elif kind == "row_wise":
            shards = [Shard(r, start, n, 0, dim) for r, (start, n) in enumerate(_split(rows, W)) if n > 0]
        else:
            pieces = _split(dim, min(W, dim))
            ranks = least_loaded(len(pieces))
            shards = [Shard(r, 0, rows, start, n) for r, (start, n) in zip(ranks, pieces)]
        for s in shards:
            load[s.rank] += _shard_bytes(s, bytes_of[name])
        chosen[name] = TableSharding(name, rows, dim, kind, tuple(shards))
    return ShardingPlan(W, [chosen[name] for name, *_ in tables], bytes_of)
