"""The sharded ``Embedding``: one lookup algorithm over the ``Comm`` interface.

Forward, on every rank at once:
1. each rank validates its part of the batch and, per feature and shard,
   routes to the shard's owner only the ids that owner holds (all of a bag's
   ids for table- and column-wise shards; for row-wise shards the ids in the
   owner's rows, with weights already divided by the bag's combiner
   denominator, so that owners return partial weighted sums);
2. one ``all_gather`` agrees on success and on how much each rank sends;
   one ``all_to_all_v`` carries the ids and weights;
3. owners look up what they received with the native kernels (pooled per
   bag, or one row per id for sequence features) and send the results back
   in one ``all_to_all_v``;
4. each rank assembles its outputs: columns side by side for column-wise
   shards, partial sums added for row-wise shards.

Backward mirrors it: each rank sends each owner the gradient rows of the
bags (or ids) that owner served, and the owners apply the optimizer with the
batches they kept from the forward pass, in the order of features and then
ranks, which is the order an unsharded table sees the global batch in.

Table- and column-wise outputs are bit-identical to the unsharded table's;
row-wise outputs differ only by the order of float additions across shards.
Updates are bit-identical for every plan.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import numpy as np

from .. import _device, _embedcore, _nest
from ..checkpoint import _optimizer_json
from .._inputs import Batch, Ragged, as_float32, make_batch
from ..config import TableConfig
from ..embedding import Embedding
from ..table import _COMBINER_CODE, Table
from ._comm import Comm, agree, collective
from ._plan import Shard, ShardingPlan, TableSharding, make_plan

__all__ = ["ShardedEmbedding"]

_SUM, _NONE = _COMBINER_CODE["sum"], _COMBINER_CODE[None]


def _pack(ints: List[np.ndarray], floats: List[np.ndarray]) -> np.ndarray:
    """One int64 buffer: the int arrays, then the float32 arrays' bytes (padded to 8)."""
    f = np.concatenate(floats).astype(np.float32, copy=False) if floats else np.zeros(0, np.float32)
    if f.size % 2:
        f = np.concatenate([f, np.zeros(1, np.float32)])
    parts = [np.asarray(a, np.int64).reshape(-1) for a in ints] + [f.view(np.int64)]
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def _whole_bags(ts: TableSharding) -> bool:
    """Whether each shard of the table holds every row (table- and column-wise,
    or a row-wise table that one rank holds whole): then a bag goes whole to
    each shard, which combines it itself; else each owner gets its ids only."""
    return ts.kind != "row_wise" or len(ts.shards) == 1


# Fields of a table's description that follow from the others (its place in the plan: another table's size
# moves it): named only where no field given by the caller differs.
_DERIVED = frozenset({"sharding"})


def _rate(optimizer: dict) -> str:
    """An optimizer description's learning rate, as an error shows it: the
    constant, or the schedule's name (its description's rate is None)."""
    schedule = optimizer.get("learning_rate_schedule")
    return f"the schedule {schedule!r}" if schedule is not None else repr(optimizer.get("learning_rate"))


def _first_difference(r: int, theirs: tuple, m: int, mine: tuple) -> str:
    """Where rank `r`'s construction description first differs from rank
    `m`'s: the table or feature, the field, and both ranks' values; fields
    the caller gave (a table's dim) before those derived from them (its
    shards, which another table's dim can move)."""
    for derived in (False, True):
        for kind, a, b in (("table", theirs[1], mine[1]), ("feature", theirs[2], mine[2])):
            for i, (x, y) in enumerate(zip(a, b)):
                diffs = [(fx, vx, vy) for (fx, vx), (_, vy) in zip(x, y) if vx != vy and (fx in _DERIVED) == derived]
                if not diffs:
                    continue
                field, u, v = diffs[0]
                which = repr(dict(y)["name"]) if field != "name" else f"#{i}"
                if isinstance(u, dict) and isinstance(v, dict):  # an optimizer: its class, or its first other field
                    key = next(k for k in list(v) + list(u) if u.get(k) != v.get(k))
                    if key in ("learning_rate", "learning_rate_schedule"):  # a schedule is described by its name
                        return (f"{kind} {which} {field} learning_rate: rank {r} has {_rate(u)}, rank {m} has "
                                f"{_rate(v)}")
                    field, u, v = f"{field} {key}", u.get(key), v.get(key)
                return f"{kind} {which} {field}: rank {r} has {u!r}, rank {m} has {v!r}"
            if len(a) != len(b):
                return (f"rank {r} has {len(a)} {kind}s {[dict(x)['name'] for x in a]}, rank {m} has {len(b)} "
                        f"{[dict(y)['name'] for y in b]}")
    return f"plan: rank {r} has {theirs[0]!r}, rank {m} has {mine[0]!r}"


class _Route:
    """What one rank sends one shard's owner for one feature, and how the
    answer goes back into the output."""

    __slots__ = ("shard", "header", "lengths", "ids", "weights", "bags", "dest", "n_out")

    def __init__(self, shard: Shard):
        self.shard = shard


class _Reader:
    """Reads back, in order, what ``_pack`` wrote for several routes."""

    def __init__(self, buf: np.ndarray):
        self.buf = buf
        self.pos = 0

    def ints(self, n: int) -> np.ndarray:
        out = self.buf[self.pos:self.pos + n]
        if out.size != n:
            raise RuntimeError("sharded lookup: a rank sent a malformed request (a version mismatch?)")
        self.pos += n
        return out


class ShardedEmbedding(Embedding):
    """``Embedding(feature_config, optimizer, world=comm, sharding=...)``.

    Built on every rank with the same arguments. ``emb(features, weights)``
    takes this rank's part of the batch and returns this rank's outputs;
    ``emb.apply_gradients(grads)`` their gradients. Both are collective: every
    rank calls them, in the same order. ``emb.plan`` says which rank holds
    what; ``emb.local_shards`` are this rank's shards as Tables, in GPU memory
    with ``device="cuda:N"`` (the CUDA build), in host memory otherwise.
    """

    def __init__(self, feature_config, optimizer=None, *, world=None, sharding="auto", device=None):
        if not isinstance(world, Comm):
            raise TypeError(f"Embedding: world must be an embedcore.distributed.Comm, got {world!r}")
        self._world = world
        self._sharding = sharding
        # Where this rank's shards live; inputs, outputs and gradients stay host arrays either way.
        self._shard_device = _device.parse_device(device, "Embedding")
        super().__init__(feature_config, optimizer)

    def __reduce__(self):
        raise TypeError("a sharded Embedding (world=) does not pickle or deepcopy: its shards live on every rank "
                        "and its communicator is this process's; save it (ec.save) and build and load it again "
                        "(ec.load, at any world size)")

    # ------------------------------------------------------------ layout
    def _named_sharding(self):
        """`sharding=`, its TableConfig keys as table names."""
        if not isinstance(self._sharding, dict):
            return self._sharding
        named = {}
        for k, v in self._sharding.items():
            if isinstance(k, TableConfig):
                if k not in self._effective:
                    raise ValueError(f"sharding names a TableConfig that no feature uses: {k!r}")
                k = self._effective[k].name
            if k in named:
                raise ValueError(f"sharding names table {k!r} twice (by name and by TableConfig)")
            named[k] = v
        return named

    @collective("Embedding()")
    def _build_tables(self) -> None:
        self._configs: List[TableConfig] = list(self._effective)
        self._table_index = {cfg: i for i, cfg in enumerate(self._configs)}
        specs = []
        for cfg in self._configs:
            eff = self._effective[cfg]
            native = eff.optimizer._native() if eff.optimizer is not None else None
            slots = len(native.slot_names) if native is not None else 0
            row_slots = slots if native is not None and native.kind == native.Kind.RowwiseAdagrad else 0
            specs.append((eff.name, eff.rows, eff.dim, eff.dtype, slots - row_slots, row_slots))
        error, plan, mine = None, None, None
        try:  # every check inside: a rank that fails must still tell the others
            plan = make_plan(specs, self._world.size, self._named_sharding())
            # Every rank must build the same embedding: compare what decides routing and values.
            mine = (plan.describe(),
                    [(("name", e.name), ("rows", e.rows), ("dim", e.dim), ("dtype", e.dtype),
                      ("combiner", e.combiner), ("initializer", repr(e.initializer)),
                      ("optimizer", _optimizer_json(e.optimizer)),
                      ("sharding", (plan[e.name].kind, tuple(plan[e.name].shards))))
                     for e in (self._effective[c] for c in self._configs)],
                    [(("name", n), ("max_sequence_length", f.max_sequence_length),
                      ("table", self._effective[f.table].name))
                     for n, f in zip(self._feature_names, self._features)])
        except Exception as e:  # noqa: BLE001 - every rank must hear of it
            error = e
        everyone = agree(self._world, error, mine, step="Embedding(): construction")
        for r, theirs in enumerate(everyone):
            if theirs != mine:
                raise ValueError(f"Embedding: rank {r} built a different sharded embedding than rank "
                                 f"{self._world.rank} (tables, features, initializers, optimizers or plan differ: "
                                 f"{_first_difference(r, theirs, self._world.rank, mine)}); every rank must pass "
                                 "the same feature_config, optimizer and sharding")
        # The embeddings of a world are numbered in the order they are made (the same on every rank: construction
        # is agreed), and every later step names its embedding: ranks that call two embeddings in different
        # orders meet at steps of different names and raise CollectiveMismatchError, before any data moves. The
        # count belongs to the underlying communicator, not to the Comm object: two towers each made with its
        # own init("mpi") (two objects over one MPI.COMM_WORLD) are still embeddings 0 and 1.
        numbering = self._world._embedding_numbering()
        index = numbering[0]
        numbering[0] = index + 1
        self._tag = f"embedding {index} (tables {', '.join(e.name for e in self._effective.values())})"
        self._plan: ShardingPlan = plan
        # This rank's shards: (table index, shard index) -> Table.
        self._local: Dict[Tuple[int, int], Table] = {}
        error = None
        try:  # may fail on one rank alone (memory, no such GPU): every rank must hear of it
            for ti, cfg in enumerate(self._configs):
                eff = self._effective[cfg]
                for si, s in enumerate(self._plan[eff.name].shards):
                    if s.rank == self._world.rank:
                        self._local[(ti, si)] = Table._shard(eff, s.rows, s.cols, s.row_start, s.col_start,
                                                             device=self.shard_device)
        except Exception as e:  # noqa: BLE001
            error = e
        agree(self._world, error, step="Embedding(): shards")
        self._tables = {}
        self._fwd = None  # the last forward pass, for apply_gradients
        # A wrapper's translation of a lookup's input error into its caller's terms (the torch
        # adapter: positions in a KeyedJaggedTensor's values()), applied before the other ranks hear it.
        self._caller_terms = None

    @property
    def world(self) -> Comm:
        return self._world

    @property
    def shard_device(self) -> Optional[str]:
        """Where this rank's shards live: None (host memory) or "cuda:N"."""
        return None if self._shard_device < 0 else f"cuda:{self._shard_device}"

    @property
    def plan(self) -> ShardingPlan:
        """Which rank holds which rows and columns of each table (``print(emb.plan)``)."""
        return self._plan

    @property
    def local_shards(self) -> Dict[str, List[Tuple[Shard, Table]]]:
        """This rank's shards, by table name: (placement, Table) pairs."""
        out: Dict[str, List[Tuple[Shard, Table]]] = {}
        for (ti, si), table in self._local.items():
            ts = self._sharding_of(ti)
            out.setdefault(ts.name, []).append((ts.shards[si], table))
        return out

    @property
    def embedding_tables(self):
        """Each TableConfig mapped to this rank's (placement, Table) shards of it."""
        by_name = self.local_shards
        return {cfg: by_name.get(self._effective[cfg].name, []) for cfg in self._configs}

    def _repr_extra(self) -> str:
        return f", world={self._world!r}"

    def _sharding_of(self, ti: int) -> TableSharding:
        return self._plan[self._effective[self._configs[ti]].name]

    def _table(self, f):
        raise TypeError("a sharded Embedding has no whole tables on one rank")

    # ------------------------------------------------------------ forward
    @collective("lookup")
    def lookup(self, features, weights=None):
        comm = self._world
        error, counts = None, None
        try:
            routes, shapes, batches = self._route(features, weights)
            # Requests out: per destination, routes in (feature, shard) order.
            ints: List[list] = [[] for _ in range(comm.size)]
            floats: List[list] = [[] for _ in range(comm.size)]
            for fr in routes:
                for r in fr:
                    ints[r.shard.rank] += [r.header, r.lengths, r.ids]
                    floats[r.shard.rank].append(r.weights)
            send = [_pack(ints[d], floats[d]) for d in range(comm.size)]
            counts = [a.size for a in send]
        except Exception as e:  # noqa: BLE001 - every rank must hear of it
            error = e if self._caller_terms is None else self._caller_terms(e)
        all_counts = agree(comm, error, counts, step=self.step_name("lookup: requests"))
        if comm.max_exchange_elements is not None:  # on every rank alike, from the agreed counts: all raise, or none
            matrix = np.asarray(all_counts, np.int64)  # [sender, receiver]
            sent, received = matrix.sum(axis=1), matrix.sum(axis=0)
            for j in np.flatnonzero((sent > comm.max_exchange_elements) | (received > comm.max_exchange_elements)):
                comm.check_exchange([sent[j]], [received[j]], "Embedding lookup (requests)", rank=int(j))
        recv = comm.all_to_all_v(send, [all_counts[j][comm.rank] for j in range(comm.size)])

        # Serve: look up what every rank asked this one for.
        error = None
        served: Dict[tuple, tuple] = {}
        expect = [0] * comm.size  # what each rank will send this one
        for fr in routes:
            for r in fr:
                expect[r.shard.rank] += r.n_out * r.shard.cols
        try:
            answers = [self._serve(j, recv[j], served) for j in range(comm.size)]
            comm.check_exchange([a.size for a in answers], expect, "Embedding lookup (answers)", rank=comm.rank)
        except Exception as e:  # noqa: BLE001
            error, answers = e, None
        agree(comm, error, step=self.step_name("lookup: answers"))
        back = comm.all_to_all_v(answers, expect)

        # Assemble this rank's outputs.
        outputs = []
        offsets = [0] * comm.size
        for fi, (fr, shape) in enumerate(zip(routes, shapes)):
            f = self._features[fi]
            dim = self._effective[f.table].dim
            pooled = self._combiner(f) is not None
            n_rows = shape[0] if pooled else int(np.prod(shape[:-1]))
            sparse_seq = not pooled and batches[fi].kind == "sparse"
            if pooled and len(fr) == 1 and fr[0].bags is None:  # one shard, whole bags: its answer is the output
                s, d = fr[0].shard, fr[0].shard.rank
                n = fr[0].n_out * s.cols
                outputs.append(back[d][offsets[d]:offsets[d] + n].reshape(shape))
                offsets[d] += n
                continue
            out = np.zeros((n_rows, dim), np.float32)
            for r in fr:
                s, d = r.shard, r.shard.rank
                n = r.n_out * s.cols
                rows = back[d][offsets[d]:offsets[d] + n].reshape(r.n_out, s.cols)
                offsets[d] += n
                cols = slice(s.col_start, s.col_start + s.cols)
                if pooled:
                    if r.bags is None:
                        out[:, cols] = rows
                    else:
                        out[r.bags, cols] += rows  # row-wise partial sums; bags are unique
                elif sparse_seq:  # duplicate positions add up: each rank's in order, the ranks' in rank order
                    # The entries are row-major, so a position's ids are neighbours: add
                    # the first of each in one vector op, only the rest one by one.
                    first = np.ones(r.dest.size, bool)
                    first[1:] = r.dest[1:] != r.dest[:-1]
                    out[r.dest[first], cols] += rows[first]
                    if not first.all():
                        np.add.at(out, (r.dest[~first], cols), rows[~first])
                else:
                    out[r.dest, cols] = rows
            outputs.append(out.reshape(shape))
        self._fwd = (routes, shapes, served)
        return _nest.pack_like(self._feature_config, features, outputs)

    def _route(self, features, weights):
        """Validates this rank's features and splits them into routes."""
        flat_inputs = _nest.flatten_up_to(self._feature_config, features, "features")
        flat_weights = ([None] * len(flat_inputs) if weights is None
                        else _nest.flatten_up_to(self._feature_config, weights, "weights"))
        routes, shapes, batches = [], [], []
        for fi, (where, f, x, w) in enumerate(zip(self._wheres("features"), self._features, flat_inputs,
                                                   flat_weights)):
            b = make_batch(x, None, w, where=where)
            eff = self._effective[f.table]
            ids = b.ids
            # The owners never see this rank's offsets whole: check them here,
            # as the unsharded table does, so that this rank is the one named.
            off = b.offsets
            if off.size < 1 or off[0] != 0:
                raise ValueError(f"{where}: offsets[0] must be 0, got {off[0] if off.size else 'no offsets'}")
            down = off[1:] < off[:-1]  # (not np.diff: a difference past int64's range wraps to a rise)
            if down.any():
                i = int(np.argmax(down))
                raise ValueError(f"{where}: offsets must be non-decreasing: offsets[{i}] = {off[i]} > "
                                 f"offsets[{i + 1}] = {off[i + 1]}")
            if off[-1] != ids.size:
                raise ValueError(f"{where}: offsets must end at the number of ids, {ids.size}, got "
                                 f"offsets[{off.size - 1}] = {off[-1]}")
            if ids.size:
                lo, hi = int(ids.min()), int(ids.max())
                if lo < 0 or hi >= eff.rows:  # the first bad id in the caller's order, as the unsharded lookup names
                    at = np.flatnonzero((ids < 0) | (ids >= eff.rows))
                    k = int(np.argmin(at if b.order is None else b.order[at]))
                    pos = int(at[k] if b.order is None else b.order[at[k]])
                    place = (f"index [{pos // b.width}, {pos % b.width}]" if b.kind == "dense" and b.width
                             else f"position {pos}")
                    raise IndexError(f"{where}: id {int(ids[at[k]])} at {place} is out of range for table "
                                     f"'{eff.name}' with {eff.rows} rows")
            combiner = self._combiner(f)
            ts = self._sharding_of(self._table_index[f.table])
            if combiner is not None:
                shapes.append((b.num_bags, eff.dim))
                routes.append(self._route_pooled(b, combiner, ts))
            else:
                length = Table._sequence_length(b, f.max_sequence_length)
                if length is not None and 4 * b.num_bags * length * eff.dim > 2**63 - 1:  # (Python ints: no wrap)
                    raise ValueError(f"{where}: the lookup's output ({b.num_bags} bags, max_sequence_length "
                                     f"{f.max_sequence_length}, dim {eff.dim}) would not fit in memory: its size "
                                     "overflows")
                shapes.append((len(b.ids), eff.dim) if length is None else (b.num_bags, length, eff.dim))
                routes.append(self._route_sequence(b, length, ts))
            batches.append(b)
        return routes, shapes, batches

    @staticmethod
    def _route_pooled(b: Batch, combiner: str, ts: TableSharding) -> List[_Route]:
        ids = b.ids.astype(np.int64, copy=False)
        offsets = b.offsets
        lengths = np.diff(offsets)
        out = []
        if _whole_bags(ts):
            # Every shard holds every row: it gets the whole batch and combines it itself.
            w = b.weights if b.weights is not None else np.zeros(0, np.float32)
            for s in ts.shards:
                r = _Route(s)
                r.header = np.array([b.num_bags, ids.size, b.weights is not None], np.int64)
                r.lengths, r.ids, r.weights, r.bags, r.dest, r.n_out = lengths, ids, w, None, None, b.num_bags
                out.append(r)
            return out
        # Row-wise: each owner sums its ids' weighted rows; the weights already
        # carry the bag's combiner denominator, as the backward coefficients do.
        bag = np.repeat(np.arange(b.num_bags, dtype=np.int64), lengths)
        code = _COMBINER_CODE[combiner]
        w = b.weights
        if code != _SUM:
            den = _embedcore.bag_denominators(offsets, w, code)[bag]
            num = w if w is not None else np.ones(ids.size, np.float32)
            with np.errstate(divide="ignore", invalid="ignore"):
                w = np.where(den == 0, np.float32(0), num / den).astype(np.float32, copy=False)
        starts = np.array([s.row_start for s in ts.shards], np.int64)
        owner = np.searchsorted(starts, ids, side="right") - 1
        for si, s in enumerate(ts.shards):
            occ = np.flatnonzero(owner == si)
            # The bags this owner sees, in order, and how many of their ids it holds.
            counts = np.bincount(bag[occ], minlength=b.num_bags)
            bags = np.flatnonzero(counts)
            r = _Route(s)
            r.header = np.array([bags.size, occ.size, w is not None], np.int64)
            r.lengths = counts[bags].astype(np.int64)
            r.ids = ids[occ] - s.row_start
            r.weights = w[occ] if w is not None else np.zeros(0, np.float32)
            r.bags, r.dest, r.n_out = bags, None, bags.size
            out.append(r)
        return out

    @staticmethod
    def _route_sequence(b: Batch, length: Optional[int], ts: TableSharding) -> List[_Route]:
        ids = b.ids.astype(np.int64, copy=False)
        w = b.weights
        if length is None:  # flat [nnz, dim]
            dest = np.arange(ids.size, dtype=np.int64)
        else:
            bag = np.repeat(np.arange(b.num_bags, dtype=np.int64), np.diff(b.offsets))
            pos = b.positions if b.kind == "sparse" else np.arange(ids.size, dtype=np.int64) - b.offsets[bag]
            keep = np.flatnonzero(pos < length)  # ids past the length are not looked up
            dest = bag[keep] * length + pos[keep]
            ids = ids[keep]
            w = w[keep] if w is not None else None
        split = not _whole_bags(ts)
        if split:
            starts = np.array([s.row_start for s in ts.shards], np.int64)
            owner = np.searchsorted(starts, ids, side="right") - 1
        out = []
        for si, s in enumerate(ts.shards):
            occ = np.flatnonzero(owner == si) if split else None
            r = _Route(s)
            r.ids = (ids if occ is None else ids[occ]) - s.row_start
            r.dest = dest if occ is None else dest[occ]
            r.weights = np.zeros(0, np.float32) if w is None else (w if occ is None else w[occ])
            r.header = np.array([1, r.ids.size, w is not None], np.int64)
            r.lengths = np.zeros(0, np.int64)
            r.bags, r.n_out = None, r.ids.size
            out.append(r)
        return out

    def _serve(self, j: int, buf: np.ndarray, served: dict) -> np.ndarray:
        """Looks up rank j's requests; keeps each batch for the backward pass."""
        reader = _Reader(buf)
        requests = []
        for fi, f in enumerate(self._features):
            ti = self._table_index[f.table]
            ts = self._sharding_of(ti)
            pooled = self._combiner(f) is not None
            for si, s in enumerate(ts.shards):
                if s.rank != self._world.rank:
                    continue
                nb, nnz, has_w = (int(v) for v in reader.ints(3))
                lengths = reader.ints(nb) if pooled else None
                ids = reader.ints(nnz)
                requests.append((fi, ti, si, pooled, _whole_bags(ts), nb, lengths, ids, has_w))
        # The weights follow every route's ints.
        floats = buf[reader.pos:].view(np.float32)
        fpos = 0
        results = []
        for fi, ti, si, pooled, whole, nb, lengths, ids, has_w in requests:
            w = None
            if has_w:
                w = floats[fpos:fpos + ids.size]
                fpos += ids.size
            if pooled:
                offsets = Ragged.from_lengths(ids, lengths).offsets
                code = _COMBINER_CODE[self._combiner(self._features[fi])] if whole else _SUM
            else:
                offsets = np.array([0, ids.size], np.int64)
                code = _NONE
            ids = np.ascontiguousarray(ids)
            table = self._local[(ti, si)]
            results.append(table._native.lookup_staged(ids, offsets, w, code, 0).reshape(-1))
            served[(fi, si, j)] = (ids, offsets, w, code)
        return np.concatenate(results) if results else np.zeros(0, np.float32)

    # ------------------------------------------------------------ backward
    @collective("apply_gradients")
    def apply_gradients(self, grads) -> None:
        """One optimizer step per table from the gradients of this rank's last
        outputs; collective, like the lookup."""
        comm = self._world
        error = None
        send = None
        try:
            if self._fwd is None:
                raise ValueError("Embedding.apply_gradients: call the embedding on a batch first")
            routes, shapes, _ = self._fwd
            for cfg in self._configs:
                if self._effective[cfg].optimizer is None:
                    raise ValueError(f"Embedding.apply_gradients: table '{self._effective[cfg].name}' has no "
                                     "optimizer (give its TableConfig or the Embedding one)")
            # What the native step refuses (a table at the last step a checkpoint records) and each
            # learning rate, on every rank before any table changes, as the unsharded Embedding checks.
            rates, versions = {}, {}
            for key, table in self._local.items():
                table._check_step_can_grow()
                # (the version it is read under: a shard's set_optimizer meanwhile makes the step read it again)
                optimizer, versions[key] = table._stepping
                rates[key] = table.learning_rate() if optimizer is None else optimizer.learning_rate_at(table.step)
            flat = _nest.flatten_up_to(self._feature_config, grads, "grads")
            parts: List[list] = [[] for _ in range(comm.size)]
            for where, fr, shape, g in zip(self._wheres("grads"), routes, shapes, flat):
                g = as_float32(g, where)
                if g.shape != shape:
                    raise ValueError(f"{where} must have shape {shape} (the lookup's output), got {g.shape}")
                g2 = g.reshape(-1, shape[-1])
                for r in fr:
                    s = r.shard
                    cols = slice(s.col_start, s.col_start + s.cols)
                    if r.dest is not None:
                        rows = g2[r.dest, cols]
                    elif r.bags is not None:
                        rows = g2[r.bags, cols]
                    else:
                        rows = g2[:, cols]
                    parts[s.rank].append(rows.reshape(-1))
            send = [np.concatenate(p).astype(np.float32, copy=False) if p else np.zeros(0, np.float32)
                    for p in parts]
            # What each rank will send this one: the rows of the results it served.
            expect = [0] * comm.size
            for (fi, si, j), (ids, offsets, w, code) in self._fwd[2].items():
                cols = self._sharding_of(self._table_index[self._features[fi].table]).shards[si].cols
                expect[j] += (offsets.size - 1 if code != _NONE else ids.size) * cols
            comm.check_exchange([a.size for a in send], expect, "Embedding.apply_gradients (gradients)",
                                rank=comm.rank)
        except Exception as e:  # noqa: BLE001
            error = e
        agree(comm, error, step=self.step_name("apply_gradients: gradients"))
        routes, shapes, served = self._fwd
        recv = comm.all_to_all_v(send, expect)

        error = None
        try:
            pos = [0] * comm.size
            by_shard: Dict[Tuple[int, int], list] = {key: [] for key in self._local}
            # Each rank's gradients arrive in (feature, shard) order; each shard
            # applies them in (feature, rank) order: the global batch's order.
            for fi, f in enumerate(self._features):
                ti = self._table_index[f.table]
                for si, s in enumerate(self._sharding_of(ti).shards):
                    if s.rank != comm.rank:
                        continue
                    for j in range(comm.size):
                        ids, offsets, w, code = served[(fi, si, j)]
                        n = (offsets.size - 1 if code != _NONE else ids.size) * s.cols
                        g = recv[j][pos[j]:pos[j] + n].reshape(-1, s.cols)
                        pos[j] += n
                        by_shard[(ti, si)].append((ids, offsets, w, code, 0, g))
            for key, table in self._local.items():
                try:
                    table._native.apply_gradients_staged(by_shard[key], rates[key], versions[key])
                except _embedcore.OptimizerChanged:  # nothing changed: the rate again, under the step lock
                    with table._schedule_lock():
                        table._native.apply_gradients_staged(by_shard[key], table.learning_rate())
        except Exception as e:  # noqa: BLE001
            error = e
        agree(comm, error, step=self.step_name("apply_gradients: update"))

    def step_name(self, step: str) -> str:
        """`step` ("lookup: requests") of this embedding, as ``agree`` compares it across ranks."""
        return f"{step} of {self._tag}"

    # ------------------------------------------------------------ checkpoints
    def _sharded_save(self, path, include_optimizer: bool, values_dtype, keep: bool = False, metadata=None):
        from ._checkpoint import save_sharded

        save_sharded(path, self, include_optimizer, values_dtype, keep, metadata)

    def _sharded_load(self, path, include_optimizer: bool):
        from ._checkpoint import load_sharded

        load_sharded(path, self, include_optimizer)
