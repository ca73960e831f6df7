"""The sharded Embedding under real MPI processes, checked against the
unsharded Embedding. A script, not a pytest module (tests/python/
test_distributed_mpi.py launches it):

    mpiexec -n N python tests/python/mpi_worker.py MODE [MODE ...] [--dir DIR]

Every rank builds the same global batches from the same seeds, passes the
sharded Embedding its own slice of bags, and compares what it gets with the
unsharded Embedding's outputs on the whole batch (the rows of its slice).

Modes:
  parity   forward outputs, for every plan (table_wise, row_wise, column_wise,
           auto, a per-table dict) x combiner (sum, mean, sqrtn) x weighted /
           unweighted / partly weighted x pooled / sequence feature, over
           ragged, dense and sparse inputs and float32 / float16 / bfloat16
           tables, with even slices, a rank without bags and an empty batch.
           Table- and column-wise tables: bit-exact; row-wise: within rtol
           1e-6 (partial sums are added in another order).
  train    ten training steps per optimizer (SGD with weight decay, Adagrad,
           Adam, Adam non-lazy with bias correction and a schedule, FTRL) and
           plan, weighted, unweighted and partly weighted in turn: outputs each
           step (row-wise within 1e-5, others bit-exact), then every local
           shard's values, slots and step against the unsharded table's block,
           bit-exact (the module documents updates as bit-identical for every
           plan). Per optimizer, a checkpoint saved on the N ranks is restored
           under the next plan on the same ranks (bit-exact against the state
           gathered from every rank, and unsharded), the unsharded table's
           checkpoint is restored sharded, and training resumes for one step.
  fail     rank 1 passes an out-of-range id: rank 1 must get IndexError, the
           others RankFailedError naming rank 1, and the world stays usable
           (the next lookup is checked); the same for a bad gradient shape in
           apply_gradients (no table may change), for two ranks failing at
           once, for a save that fails on rank 1 (the previous checkpoint stays,
           the next save works) and for a load that meets a corrupt file among
           rank 1's blocks (no rank changes). One line per rank and case:
           ``FAILCASE rank R/N: <case> -> <Exception>: <message>``.
  abort    rank 1 raises an uncaught exception while the others wait in a
           barrier: init("mpi")'s excepthook must abort the whole job (the
           caller checks the exit status; this mode prints nothing on success).
  save     (--dir) trains three steps under row_wise, saves DIR/ckpt and
           writes, from rank 0, DIR/expected.npz: every table's values, slots
           and step gathered from all ranks.
  restore  (--dir) loads DIR/ckpt under column_wise on this world: each local
           shard bit-exact against DIR/expected.npz, lookups bit-exact against
           an unsharded Embedding loaded from DIR/ckpt; then trains two more
           steps, saves over DIR/ckpt and writes DIR/expected2.npz.
  inject   the first parity case with one output element of the last rank
           perturbed: must report a MISMATCH and exit 1 (the checker can fail).
  towers   two embeddings with one table name, each built with its own
           ``dist.init("mpi")`` (two Comm objects over MPI.COMM_WORLD) and one
           with ``init("mpi", comm=MPI.COMM_WORLD)``, looked up in different
           orders on different ranks: every rank must raise
           CollectiveMismatchError naming embeddings 0 and 1 (the numbering
           belongs to the communicator, not the object), no rank may get the
           other tower's rows, and the world stays usable. One line per rank:
           ``TOWERS rank R/N: <outcome>``.

Several modes run in one launch, in order. Without --dir, train and fail use a
temporary directory rank 0 makes and removes (the ranks share a file system).

Each rank prints one summary line
    mpi_worker rank R/N [modes]: C checks, M mismatches, T s -> OK|FAILED
and rank 0 a world line ``mpi_worker world N: OK`` (or FAILED); the exit
status is 1 on any mismatch on any rank.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np

import embedcore as ec
from embedcore import distributed as dist
from embedcore.checkpoint import CheckpointError, read_info
from embedcore.distributed import RankFailedError, _checkpoint

OPTIMIZERS = {
    "SGD": lambda: ec.optimizers.SGD(0.05, weight_decay_factor=0.01),
    "Adagrad": lambda: ec.optimizers.Adagrad(0.1),
    "Adam": lambda: ec.optimizers.Adam(0.01),
    "Adam-dense-bias": lambda: ec.optimizers.Adam(lambda step: 0.01 / (1 + step), lazy_adam=False,
                                                  bias_correction=True),
    "FTRL": lambda: ec.optimizers.FTRL(0.1, l1_regularization_strength=0.001, l2_regularization_strength=0.01,
                                       beta=0.1),
}
PLANS = ["table_wise", "row_wise", "column_wise", "auto",
         {"A": "row_wise", "B": "column_wise", "C": "table_wise", "T": "row_wise", "D": "auto"}]
ROW_RTOL = 1e-6  # row-wise forward: partial sums added in another order
TRAIN_TOL = 1e-5


def plan_name(plan) -> str:
    return plan if isinstance(plan, str) else "dict"


# ------------------------------------------------------------------ the model
class Model:
    """Seven tables (every combiner; a tiny one with fewer rows than ranks; a
    large one that "auto" shards row-wise; float16 and bfloat16 ones) and
    eleven features over them: pooled and sequence, ragged, dense and sparse
    inputs, features sharing tables."""

    def __init__(self):
        U = ec.initializers.Uniform
        self.tables = {
            "A": ec.TableConfig("A", 29, 5, initializer=U(-1, 1, seed=11), combiner="sum"),
            "B": ec.TableConfig("B", 17, 4, initializer=U(-1, 1, seed=12), combiner="mean"),
            "C": ec.TableConfig("C", 13, 3, initializer=ec.initializers.Normal(0.0, 0.5, seed=13), combiner="sqrtn"),
            "T": ec.TableConfig("T", 2, 1, initializer=U(-1, 1, seed=14), combiner="mean"),
            "D": ec.TableConfig("D", 96, 8, initializer=ec.initializers.TruncatedNormal(seed=15), combiner="sum"),
            "H": ec.TableConfig("H", 11, 3, "float16", initializer=U(-1, 1, seed=16), combiner="sqrtn"),
            "G": ec.TableConfig("G", 7, 2, "bfloat16", initializer=U(-1, 1, seed=17), combiner="sum"),
        }
        t = self.tables
        # name: (table, max_sequence_length, input form, width for dense/sparse, duplicate positions)
        self.specs = {
            "pA": (t["A"], 0, "ragged", 0, False),
            "pB": (t["B"], 0, "dense", 3, False),
            "pC": (t["C"], 0, "ragged", 0, False),
            "pT": (t["T"], 0, "sparse", 4, False),
            "pD": (t["D"], 0, "ragged", 0, False),
            "sA": (t["A"], 4, "ragged", 0, False),
            "sB": (t["B"], 3, "sparse", 5, True),
            "sC": (t["C"], 2, "dense", 3, False),
            "sD": (t["D"], 3, "ragged", 0, False),
            "pH": (t["H"], 0, "dense", 2, False),
            "sG": (t["G"], 2, "ragged", 0, False),
        }
        self.features = {name: ec.FeatureConfig(tab, L, name=name) for name, (tab, L, *_) in self.specs.items()}

    def sharded(self, world, optimizer, plan):
        return ec.Embedding(self.features, optimizer, world=world, sharding=plan)

    def unsharded(self, optimizer):
        return ec.Embedding(self.features, optimizer)

    def batch(self, rng, num_bags: int) -> "GlobalBatch":
        return GlobalBatch(self, rng, num_bags)


class Input:
    """One feature's global input and weights, sliced by bags."""

    def __init__(self, form, ids, weights, offsets=None, indices=None, width=0):
        self.form, self.ids, self.weights = form, ids, weights
        self.offsets, self.indices, self.width = offsets, indices, width

    def part(self, lo: int, hi: int):
        """(ids input, weights) of bags [lo, hi)."""
        if self.form == "ragged":
            a, b = int(self.offsets[lo]), int(self.offsets[hi])
            return ec.Ragged(self.ids[a:b].copy(), self.offsets[lo:hi + 1] - a), self.weights[a:b].copy()
        if self.form == "dense":
            return self.ids[lo:hi].copy(), self.weights[lo:hi].copy()
        keep = (self.indices[:, 0] >= lo) & (self.indices[:, 0] < hi)
        idx = self.indices[keep] - np.array([lo, 0], np.int64)
        return (ec.Sparse(idx, self.ids[keep].copy(), np.array([hi - lo, self.width], np.int64)),
                self.weights[keep].copy())


class GlobalBatch:
    def __init__(self, model: Model, rng, num_bags: int):
        self.num_bags = num_bags
        self.inputs = {}
        for name, (tab, L, form, width, dup_pos) in model.specs.items():
            rows = tab.rows
            if form == "ragged":
                lengths = rng.integers(0, 7, num_bags)
                if num_bags > 1:
                    lengths[rng.integers(num_bags)] = 0  # an empty bag
                offsets = np.zeros(num_bags + 1, np.int64)
                np.cumsum(lengths, out=offsets[1:])
                ids = rng.integers(0, rows, offsets[-1]).astype(np.int64)
                if ids.size >= 2:
                    ids[1] = ids[0]  # a repeated id
                inp = Input(form, ids, self._weights(rng, ids.size), offsets=offsets)
            elif form == "dense":
                ids = rng.integers(0, rows, (num_bags, width)).astype(np.int64)
                inp = Input(form, ids, self._weights(rng, ids.size).reshape(ids.shape))
            else:  # sparse, entries in shuffled order
                entries = []
                for b in range(num_bags):
                    n = int(rng.integers(0, width + 1))
                    pos = rng.integers(0, width, n) if dup_pos else rng.choice(width, n, replace=False)
                    entries += [(b, int(p)) for p in pos]
                indices = np.array(entries, np.int64).reshape(-1, 2)
                indices = indices[rng.permutation(len(indices))]
                ids = rng.integers(0, rows, len(indices)).astype(np.int64)
                inp = Input(form, ids, self._weights(rng, ids.size), indices=indices, width=width)
            self.inputs[name] = inp
        # Weights that cancel: a mean bag whose weights sum to zero (pB's first bag).
        w = self.inputs["pB"].weights
        if w.shape[0] >= 1 and w.shape[1] >= 2:
            w[0, :] = 0
            w[0, 0], w[0, 1] = 1.5, -1.5

    @staticmethod
    def _weights(rng, n: int) -> np.ndarray:
        return rng.uniform(0.25, 2.0, n).astype(np.float32)

    def part(self, lo: int, hi: int, weighting: str):
        """(features, weights or None) of bags [lo, hi). weighting: "unweighted",
        "weighted" or "partial" (every other feature weighted)."""
        features, weights = {}, {}
        for i, (name, inp) in enumerate(self.inputs.items()):
            ids, w = inp.part(lo, hi)
            features[name] = ids
            weights[name] = w if weighting == "weighted" or (weighting == "partial" and i % 2 == 0) else None
        return features, (None if weighting == "unweighted" else weights)


def bounds(num_bags: int, size: int, empty_last: bool = False):
    """[lo, hi) of each rank's slice: near-equal, or the last rank empty."""
    parts = size - 1 if empty_last and size > 1 else size
    b = [(i * num_bags) // parts for i in range(parts + 1)]
    return [(b[r], b[r + 1]) if r < parts else (num_bags, num_bags) for r in range(size)]


# ------------------------------------------------------------------ checking
class Checker:
    def __init__(self, world):
        self.world = world
        self.checks = 0
        self.mismatches = 0

    MAX_PRINTED = 25

    def _report(self, what: str, detail: str) -> None:
        self.mismatches += 1
        if self.mismatches <= self.MAX_PRINTED:
            print(f"MISMATCH rank {self.world.rank}/{self.world.size}: {what}: {detail}", flush=True)
        elif self.mismatches == self.MAX_PRINTED + 1:
            print(f"MISMATCH rank {self.world.rank}/{self.world.size}: (more mismatches not shown)", flush=True)

    def ok(self, cond: bool, what: str, detail: str = "") -> bool:
        self.checks += 1
        if not cond:
            self._report(what, detail or "condition failed")
        return bool(cond)

    def equal(self, got, want, what: str) -> bool:
        self.checks += 1
        got, want = np.asarray(got), np.asarray(want)
        if got.shape != want.shape or got.dtype != want.dtype:
            self._report(what, f"shape/dtype {got.shape} {got.dtype} != {want.shape} {want.dtype}")
            return False
        # Bit for bit (NaN payloads and signed zeros included).
        same = np.array_equal(np.ascontiguousarray(got).view(np.uint8), np.ascontiguousarray(want).view(np.uint8))
        if not same:
            diff = np.abs(got.astype(np.float64) - want.astype(np.float64))
            k = np.unravel_index(int(np.nanargmax(diff)) if np.isfinite(diff).any() else 0, diff.shape)
            self._report(what, f"not bit-exact: {int((got != want).sum())} of {got.size} elements differ, "
                               f"max |diff| {np.nanmax(diff):.3g} at {tuple(int(i) for i in k)} "
                               f"(got {got[k]!r}, want {want[k]!r})")
            return False
        return True

    def close(self, got, want, what: str, rtol: float, atol: float) -> bool:
        self.checks += 1
        got, want = np.asarray(got), np.asarray(want)
        if got.shape != want.shape:
            self._report(what, f"shape {got.shape} != {want.shape}")
            return False
        bad = ~(np.abs(got.astype(np.float64) - want) <= atol + rtol * np.abs(want.astype(np.float64)))
        if bad.any():
            k = np.unravel_index(int(np.argmax(bad)), bad.shape)
            self._report(what, f"{int(bad.sum())} of {got.size} elements beyond rtol {rtol} atol {atol}: "
                               f"at {tuple(int(i) for i in k)} got {got[k]!r}, want {want[k]!r}")
            return False
        return True

    def expect_error(self, fn, kind, contains, what: str):
        """Runs fn; checks that it raises `kind` whose message holds every string in `contains`."""
        self.checks += 1
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - the point is to see which
            msg = f"{type(e).__name__}: {e}"
            if type(e) is not kind or not all(c in str(e) for c in contains):
                self._report(what, f"expected {kind.__name__} mentioning {contains}, got {msg}")
                return None
            return msg
        self._report(what, f"expected {kind.__name__}, nothing was raised")
        return None


def row_wise_tables(emb) -> set:
    return {name for name, ts in emb.plan.tables.items() if ts.kind == "row_wise"}


def compare_outputs(chk: Checker, model: Model, emb, got: dict, want: dict, lo: int, hi: int, label: str,
                    row_tol: float = ROW_RTOL) -> None:
    """Sharded outputs against the unsharded ones' rows [lo, hi): bit-exact,
    or within `row_tol` where the feature's table is row-wise."""
    chk.ok(sorted(got) == sorted(want), f"{label} output names", f"{sorted(got)} != {sorted(want)}")
    rw = row_wise_tables(emb)
    for name in model.specs:
        w = want[name][lo:hi]
        what = f"{label} {name}"
        if model.features[name].table.name in rw:
            chk.close(got[name], w, what + " (row_wise)", row_tol, row_tol)
        else:
            chk.equal(got[name], w, what)


def compare_shards(chk: Checker, emb, ref, label: str) -> None:
    """Every local shard's values, slots and step against the unsharded
    table's block (a table held whole or as one block per shard), bit-exact:
    updates are bit-identical for every plan (the sharded module's docstring
    says so; the gradients are the same numbers, summed in the same order)."""
    ref_tables = {t.name: t for t in ref.embedding_tables.values()}
    for name, shards in emb.local_shards.items():
        rt = ref_tables[name]
        for s, table in shards:
            rows, cols = slice(s.row_start, s.row_start + s.rows), slice(s.col_start, s.col_start + s.cols)
            what = f"{label} table {name} shard rows[{rows.start}:{rows.stop}] cols[{cols.start}:{cols.stop}]"
            pairs = [("values", table.to_numpy(), rt.to_numpy()[rows, cols])]
            slots, rslots = table.slots(), rt.slots()
            chk.ok(sorted(slots) == sorted(rslots), what + " slot names", f"{sorted(slots)} != {sorted(rslots)}")
            pairs += [(f"slot {k}", np.asarray(slots[k]), np.asarray(rslots[k])[rows, cols])
                      for k in sorted(set(slots) & set(rslots))]
            for kind, g, w in pairs:
                chk.equal(g, w, f"{what} {kind}")
            chk.ok(table.step == rt.step, what + " step", f"{table.step} != {rt.step}")


def gather_state(world, emb) -> dict:
    """Every table's full values and slots, assembled from all ranks' shards,
    and its step: {name: {"values": ..., "slot <k>": ..., "step": ...}}."""
    mine = []
    for name, shards in emb.local_shards.items():
        for s, table in shards:
            mine.append((name, tuple(s), table.to_numpy(),
                         {k: np.array(v) for k, v in table.slots().items()}, table.step))
    everything = [p for rank_parts in world.all_gather(mine) for p in rank_parts]
    state = {}
    for name, ts in emb.plan.tables.items():
        full = {"values": np.full((ts.rows, ts.dim), np.nan, np.float32)}
        covered = np.zeros((ts.rows, ts.dim), np.int32)
        steps = set()
        for pname, s, values, slots, step in everything:
            if pname != name:
                continue
            rank, r0, nr, c0, nc = s
            full["values"][r0:r0 + nr, c0:c0 + nc] = values
            for k, v in slots.items():
                full.setdefault(f"slot {k}", np.full((ts.rows, ts.dim), np.nan, np.float32))[r0:r0 + nr, c0:c0 + nc] = v
            covered[r0:r0 + nr, c0:c0 + nc] += 1
            steps.add(step)
        if not (covered == 1).all():
            raise AssertionError(f"the shards of table {name} do not cover it exactly once: {ts}")
        if len(steps) != 1:
            raise AssertionError(f"the shards of table {name} have different steps {sorted(steps)}")
        full["step"] = np.int64(steps.pop())
        state[name] = full
    return state


def compare_with_state(chk: Checker, emb, state: dict, label: str) -> None:
    """Local shards bit-exact against a gathered (or saved) full state."""
    for name, shards in emb.local_shards.items():
        full = state[name]
        for s, table in shards:
            rows, cols = slice(s.row_start, s.row_start + s.rows), slice(s.col_start, s.col_start + s.cols)
            what = f"{label} table {name} shard rows[{rows.start}:{rows.stop}] cols[{cols.start}:{cols.stop}]"
            chk.equal(table.to_numpy(), full["values"][rows, cols], what + " values")
            slots = table.slots()
            want_slots = sorted(k[5:] for k in full if k.startswith("slot "))
            chk.ok(sorted(slots) == want_slots, what + " slot names", f"{sorted(slots)} != {want_slots}")
            for k in sorted(set(slots) & set(want_slots)):
                chk.equal(np.asarray(slots[k]), full[f"slot {k}"][rows, cols], f"{what} slot {k}")
            chk.ok(table.step == int(full["step"]), what + " step", f"{table.step} != {int(full['step'])}")


# ------------------------------------------------------------------ modes
def mode_parity(world, chk: Checker, model: Model, inject: bool = False) -> None:
    # (plan, global bags, the last rank gets none): even slices for every
    # plan, then a rank without bags, and a batch without any.
    cases = [(plan, 7, False) for plan in PLANS] + [("auto", 5, True), ("row_wise", 4, True), (PLANS[-1], 0, False)]
    if inject:
        cases = cases[:1]
    for ci, (plan, num_bags, empty_last) in enumerate(cases):
        emb = model.sharded(world, ec.optimizers.SGD(0.1), plan)
        ref = model.unsharded(ec.optimizers.SGD(0.1))
        rng = np.random.default_rng(1000 + ci)
        gb = model.batch(rng, num_bags)
        lo, hi = bounds(num_bags, world.size, empty_last)[world.rank]
        for weighting in ("unweighted", "weighted", "partial"):
            label = f"parity plan={plan_name(plan)} bags={num_bags}{' empty-last' if empty_last else ''} {weighting}"
            feats, weights = gb.part(lo, hi, weighting)
            got = emb(feats, weights)
            gfeats, gweights = gb.part(0, num_bags, weighting)
            want = ref(gfeats, gweights)
            if inject and world.rank == world.size - 1:  # this case gives every rank bags
                got["pA"] = got["pA"].copy()
                got["pA"].flat[0] += 1e-3
            compare_outputs(chk, model, emb, got, want, lo, hi, label)
            if inject:
                return


def train_steps(world, chk: Checker, model: Model, emb, ref, seed: int, steps: int, label: str) -> None:
    rng = np.random.default_rng(seed)
    for step in range(steps):
        num_bags = 6
        gb = model.batch(rng, num_bags)
        lo, hi = bounds(num_bags, world.size, empty_last=(step == 3))[world.rank]
        weighting = ("weighted", "unweighted", "partial")[step % 3]
        feats, weights = gb.part(lo, hi, weighting)
        gfeats, gweights = gb.part(0, num_bags, weighting)
        got = emb(feats, weights)
        want = ref(gfeats, gweights)
        compare_outputs(chk, model, emb, got, want, lo, hi, f"{label} step {step} {weighting}", row_tol=TRAIN_TOL)
        grads = {name: rng.standard_normal(want[name].shape).astype(np.float32) for name in model.specs}
        emb.apply_gradients({name: g[lo:hi] for name, g in grads.items()})
        ref.apply_gradients(grads)


def shared_dir(world, given) -> tuple:
    """A directory every rank sees: `given`, or one rank 0 makes (and
    release_dir removes). No try/finally around its use: a collective in a
    finally block could hang when ranks fail at different points; an
    uncaught error aborts the job (init("mpi")) and leaves the directory."""
    if given:
        return given, False
    path = tempfile.mkdtemp(prefix="embedcore-mpi-") if world.rank == 0 else None
    return world.all_gather(path)[0], True


def release_dir(world, path: str, own: bool) -> None:
    world.barrier()
    if own and world.rank == 0:
        shutil.rmtree(path, ignore_errors=True)


def mode_train(world, chk: Checker, model: Model, directory) -> None:
    root, own = shared_dir(world, directory)
    for oi, (oname, make_opt) in enumerate(OPTIMIZERS.items()):
        for pi, plan in enumerate(PLANS):
            label = f"train {oname} plan={plan_name(plan)}"
            emb = model.sharded(world, make_opt(), plan)
            ref = model.unsharded(make_opt())
            train_steps(world, chk, model, emb, ref, seed=2000 + 10 * oi + pi, steps=10, label=label)
            compare_shards(chk, emb, ref, label + " after 10 steps")
            # Every table must have moved, or the comparisons above prove little.
            trained, initial = gather_state(world, emb), gather_state(world, model.sharded(world, make_opt(), plan))
            still = [t for t in trained if np.array_equal(trained[t]["values"], initial[t]["values"])]
            chk.ok(not still, label + " training changed every table", f"unchanged: {still}")
            if pi != (oi % len(PLANS)):
                continue
            # A checkpoint saved under this plan, restored under the next one.
            path = os.path.join(root, f"ckpt-{oi}")
            state = gather_state(world, emb)
            ec.save(path, emb)
            other = PLANS[(pi + 1) % len(PLANS)]
            clabel = f"checkpoint {oname} {plan_name(plan)} -> {plan_name(other)}"
            restored = model.sharded(world, make_opt(), other)
            ec.load(path, restored)
            compare_with_state(chk, restored, state, clabel)
            whole = model.unsharded(make_opt())
            ec.load(path, whole)
            for t in whole.embedding_tables.values():
                full = state[t.name]
                chk.ok(sorted(t.slots()) == sorted(k[5:] for k in full if k.startswith("slot ")),
                       f"{clabel} unsharded load {t.name} slot names")
                chk.equal(t.to_numpy(), full["values"], f"{clabel} unsharded load {t.name} values")
                for k, v in t.slots().items():
                    chk.equal(np.asarray(v), full[f"slot {k}"], f"{clabel} unsharded load {t.name} slot {k}")
                chk.ok(t.step == int(full["step"]), f"{clabel} unsharded load {t.name} step")
            # The unsharded table's own checkpoint loads into the sharded embedding too.
            upath = os.path.join(root, f"ckpt-{oi}-unsharded-rank{world.rank}")
            ec.save(upath, ref)
            from_whole = model.sharded(world, make_opt(), plan)
            ec.load(upath, from_whole)
            compare_shards(chk, from_whole, ref, f"checkpoint {oname} unsharded -> {plan_name(plan)}")
            # Training goes on from the restored state as from the original.
            train_steps(world, chk, model, restored, ref, seed=3000 + oi, steps=1, label=clabel + " resumed")
            compare_shards(chk, restored, ref, clabel + " resumed")
    release_dir(world, root, own)


def mode_fail(world, chk: Checker, model: Model, directory) -> None:
    n, r = world.size, world.rank
    bad_rank = 1
    emb = model.sharded(world, ec.optimizers.SGD(0.1), "row_wise")
    ref = model.unsharded(ec.optimizers.SGD(0.1))
    rng = np.random.default_rng(4000)
    num_bags = 6
    gb = model.batch(rng, num_bags)
    lo, hi = bounds(num_bags, n)[r]
    feats, weights = gb.part(lo, hi, "weighted")
    rows_a = model.tables["A"].rows

    # 1. An out-of-range id on rank 1 only.
    bad = dict(feats)
    if r == bad_rank:
        bad["pA"] = ec.Ragged(np.array([0, rows_a + 5], np.int64), np.r_[np.zeros(hi - lo, np.int64), 2])
    if r == bad_rank:
        msg = chk.expect_error(lambda: emb(bad, None), IndexError, [str(rows_a + 5), "out of range"],
                               "bad id: the failing rank")
    else:
        msg = chk.expect_error(lambda: emb(bad, None), RankFailedError,
                               [f"rank {bad_rank} of {n} failed", "IndexError", "out of range"],
                               "bad id: another rank")
    print(f"FAILCASE rank {r}/{n}: bad id on rank {bad_rank} -> {msg}", flush=True)

    # The world is still in step: a good lookup and update work and match.
    got = emb(feats, weights)
    want = ref(*gb.part(0, num_bags, "weighted"))
    compare_outputs(chk, model, emb, got, want, lo, hi, "fail: lookup after the failed one")

    # 2. A gradient of the wrong shape on rank 1: nothing may change anywhere.
    before = {(name, s): t.to_numpy() for name, shards in emb.local_shards.items() for s, t in shards}
    grads = {name: rng.standard_normal(want[name].shape).astype(np.float32) for name in model.specs}
    mine = {name: g[lo:hi] for name, g in grads.items()}
    wrong = dict(mine)
    if r == bad_rank:
        wrong["pB"] = np.zeros((hi - lo + 1, want["pB"].shape[1]), np.float32)
    if r == bad_rank:
        msg = chk.expect_error(lambda: emb.apply_gradients(wrong), ValueError, ["grads['pB']", "shape"],
                               "bad grads: the failing rank")
    else:
        msg = chk.expect_error(lambda: emb.apply_gradients(wrong), RankFailedError,
                               [f"rank {bad_rank} of {n} failed", "ValueError", "grads['pB']"],
                               "bad grads: another rank")
    print(f"FAILCASE rank {r}/{n}: bad gradient on rank {bad_rank} -> {msg}", flush=True)
    for (name, s), v in before.items():
        t = dict(emb.local_shards[name])[s]
        chk.equal(t.to_numpy(), v, f"fail: table {name} shard {tuple(s)} unchanged by the failed update")
        chk.ok(t.step == 0, f"fail: table {name} shard {tuple(s)} step still 0", f"step {t.step}")
    emb.apply_gradients(mine)
    ref.apply_gradients(grads)
    compare_shards(chk, emb, ref, "fail: after the good update")

    # 3. Two ranks fail at once (rank 0 and the last): each sees its own
    # error, the others the first failing rank's.
    failing = {0, n - 1}
    bad = dict(feats)
    if r in failing:
        bad["sA"] = ec.Ragged(np.array([-1], np.int64), np.r_[np.zeros(hi - lo, np.int64), 1])
    if r in failing:
        msg = chk.expect_error(lambda: emb(bad, None), IndexError, ["-1", "out of range"], "two fail: a failing rank")
    else:
        msg = chk.expect_error(lambda: emb(bad, None), RankFailedError, [f"rank 0 of {n} failed", "IndexError"],
                               "two fail: another rank")
    print(f"FAILCASE rank {r}/{n}: bad ids on ranks {sorted(failing)} -> {msg}", flush=True)
    got = emb(feats, weights)
    want = ref(*gb.part(0, num_bags, "weighted"))
    compare_outputs(chk, model, emb, got, want, lo, hi, "fail: lookup after two failed", row_tol=TRAIN_TOL)

    # An exchange of another byte order arrives as its values (in this machine's order; was: byte-swapped).
    got = world.all_to_all_v([(np.arange(3) + r).astype(">f4") for _ in range(n)])
    chk.ok(all(np.array_equal(g, np.arange(3, dtype=np.float32) + j) and g.dtype.isnative for j, g in enumerate(got)),
           "fail: a big-endian float32 exchange arrives as its values", repr(got))

    # 4. A batch over the exchange limit (MPI counts are C ints; lowered here
    # to 1 element): every rank raises before the exchange, none waits in it.
    world.max_exchange_elements = 1
    try:
        msg = chk.expect_error(lambda: emb(feats, weights), ValueError,
                               ["rank 0 would send", "all_to_all_v exchange", "split the batch"],
                               "over the exchange limit: every rank")
    finally:
        del world.max_exchange_elements  # the class's limit again
    print(f"FAILCASE rank {r}/{n}: a batch over the exchange limit -> {msg}", flush=True)
    got = emb(feats, weights)
    compare_outputs(chk, model, emb, got, want, lo, hi, "fail: lookup after the one over the limit",
                    row_tol=TRAIN_TOL)

    root, own = shared_dir(world, directory)
    checkpoint_failures(world, chk, model, emb, os.path.join(root, "fail-ckpt"))
    release_dir(world, root, own)


class _FailingWrites:
    """Stands in for the native module in _checkpoint: writing shard files
    fails (a full disk) on this rank."""

    def __init__(self, real):
        self._real = real

    def __getattr__(self, name):
        return getattr(self._real, name)

    def write_shard_files(self, *args, **kwargs):
        raise OSError("mpi_worker: simulated full disk")


def checkpoint_failures(world, chk: Checker, model: Model, emb, path: str) -> None:
    """4. A save that fails on rank 1 leaves the previous checkpoint; 5. a
    load that finds a corrupt file among rank 1's blocks changes no rank."""
    n, r, bad_rank = world.size, world.rank, 1
    ec.save(path, emb)
    saved = gather_state(world, emb)
    out = emb(*model.batch(np.random.default_rng(4100), n).part(r, r + 1, "weighted"))
    emb.apply_gradients({name: np.ones_like(o) for name, o in out.items()})
    if r == bad_rank:
        real = _checkpoint._embedcore
        _checkpoint._embedcore = _FailingWrites(real)
    try:
        if r == bad_rank:
            msg = chk.expect_error(lambda: ec.save(path, emb), OSError, ["simulated full disk"],
                                   "failed save: the failing rank")
        else:
            msg = chk.expect_error(lambda: ec.save(path, emb), RankFailedError,
                                   [f"rank {bad_rank} of {n} failed", "OSError", "simulated full disk"],
                                   "failed save: another rank")
    finally:
        if r == bad_rank:
            _checkpoint._embedcore = real
    print(f"FAILCASE rank {r}/{n}: save failing on rank {bad_rank} -> {msg}", flush=True)
    before = model.sharded(world, ec.optimizers.SGD(0.1), "column_wise")
    ec.load(path, before)
    compare_with_state(chk, before, saved, "fail: the checkpoint before the failed save")
    current = gather_state(world, emb)
    chk.ok(any(not np.array_equal(current[t]["values"], saved[t]["values"]) for t in saved),
           "fail: the update between the saves changed the tables")
    ec.save(path, emb)  # and the next save works over the failed one's leftovers
    ec.load(path, before)
    compare_with_state(chk, before, current, "fail: the save after the failed one")

    # 5. Corrupt the file of rank 1's rows of table D (row-wise saved, so
    # under row_wise only rank 1 reads it).
    if r == 0:
        manifest = json.loads(read_info(path).manifest_json)
        table = next(t for t in manifest["tables"] if t["name"] == "D")
        start = next(s for s in table["sharding"]["shards"] if s["rank"] == bad_rank)["row_start"]
        entry = next(f for f in table["values"] if f["row_start"] == start)
        where = 4096 + (entry["bytes"] - 4096) // 2  # a byte of the payload (docs/format.md)
        with open(os.path.join(path, entry["path"]), "r+b") as f:
            f.seek(where)
            byte = f.read(1)
            f.seek(where)
            f.write(bytes([byte[0] ^ 0xFF]))
    world.barrier()
    fresh = model.sharded(world, ec.optimizers.SGD(0.1), "row_wise")
    untouched = model.sharded(world, ec.optimizers.SGD(0.1), "row_wise")
    if r == bad_rank:
        msg = chk.expect_error(lambda: ec.load(path, fresh), CheckpointError, [], "corrupt load: the failing rank")
    else:
        msg = chk.expect_error(lambda: ec.load(path, fresh), RankFailedError,
                               [f"rank {bad_rank} of {n} failed", "CheckpointError"], "corrupt load: another rank")
    print(f"FAILCASE rank {r}/{n}: load of a file corrupt in rank {bad_rank}'s blocks -> {msg}", flush=True)
    compare_with_state(chk, fresh, gather_state(world, untouched), "fail: no rank loaded from the corrupt checkpoint")


def mode_abort(world) -> None:
    if world.rank == 1:
        raise RuntimeError("mpi_worker: deliberate uncaught error on rank 1")
    world.barrier()  # without the abort, the other ranks would wait here for ever
    print(f"UNREACHABLE rank {world.rank}: the job was not aborted", flush=True)


def mode_abort_in_save(world, model: "Model", directory: str) -> None:
    """Rank 1 dies of an uncaught exception while rank 0 saves (a collective call)."""
    emb = model.sharded(world, cross_optimizer(), "row_wise")
    if world.rank == 1:
        raise RuntimeError("mpi_worker: deliberate uncaught error on rank 1")
    ec.save(os.path.join(directory, "abort_in_save"), emb)
    print(f"UNREACHABLE rank {world.rank}: the save ended", flush=True)


def mode_rank0_save(world, model: "Model", directory: str, finalize: bool = False) -> None:
    """Only rank 0 saves (a collective call); the other ranks end the program
    normally (with `finalize`, calling MPI.Finalize() first, as mpi4py
    programs often do). Their exit meets rank 0's save, which raises
    CollectiveMismatchError (aborting the job) instead of waiting for them
    forever."""
    emb = model.sharded(world, cross_optimizer(), "row_wise")
    if world.rank == 0:
        ec.save(os.path.join(directory, "rank0_only"), emb)
        print("UNREACHABLE rank 0: the save returned", flush=True)
    else:
        print(f"rank {world.rank}: ending the program", flush=True)
        if finalize:
            from mpi4py import MPI

            MPI.Finalize()
            print(f"UNREACHABLE rank {world.rank}: MPI.Finalize() returned", flush=True)
        sys.exit(0)


def mode_towers(world, chk: Checker) -> None:
    from mpi4py import MPI

    def tower(value, comm):
        t = ec.TableConfig("emb", 4, 2, initializer=ec.initializers.Uniform(value, value), combiner="sum")
        return ec.Embedding({"ids": ec.FeatureConfig(t)}, world=comm, sharding="row_wise")

    first_tower = tower(1.0, dist.init("mpi"))
    base = int(first_tower.step_name("").split("embedding ")[1].split(" ")[0])  # embeddings the other modes made
    towers = [first_tower, tower(5.0, dist.init("mpi")), tower(9.0, dist.init("mpi", comm=MPI.COMM_WORLD))]
    x = {"ids": np.array([0, 3])}
    r = world.rank
    order = towers if r == 0 else towers[::-1]
    try:
        got = [t(x)["ids"] for t in order]
        outcome = f"no error; tower values {[float(g[0, 0]) for g in got]}"
    except dist.CollectiveMismatchError as e:
        outcome = f"CollectiveMismatchError: {e}"
    print(f"TOWERS rank {r}/{world.size}: {outcome}", flush=True)
    last = base + len(towers) - 1
    chk.ok(outcome.startswith("CollectiveMismatchError") and f"embedding {base} (tables emb)" in outcome
           and f"embedding {last} (tables emb)" in outcome, "towers: a mismatch naming both embeddings", outcome)
    for value, t in zip((1.0, 5.0, 9.0), towers):  # the same order everywhere: each tower its own rows
        chk.ok(np.all(t(x)["ids"] == value), f"towers: tower of {value} after the mismatch")


def cross_optimizer():
    """The optimizer of the save / restore modes (slots and a step that matters)."""
    return ec.optimizers.Adam(0.01, lazy_adam=False, bias_correction=True)


def mode_save(world, chk: Checker, model: Model, directory: str) -> None:
    make_opt = cross_optimizer
    emb = model.sharded(world, make_opt(), "row_wise")
    ref = model.unsharded(make_opt())
    train_steps(world, chk, model, emb, ref, seed=5000, steps=3, label="save row_wise")
    ec.save(os.path.join(directory, "ckpt"), emb)
    write_state(world, gather_state(world, emb), os.path.join(directory, "expected.npz"))


def write_state(world, state: dict, path: str) -> None:
    """Rank 0 writes a gathered state as NPZ: "<table>/values", "<table>/slot <k>", "<table>/step"."""
    if world.rank == 0:
        np.savez(path, **{f"{name}/{k}": v for name, full in state.items() for k, v in full.items()})
    world.barrier()


def read_state(path: str) -> dict:
    state: dict = {}
    with np.load(path) as z:
        for key in z.files:
            name, k = key.split("/", 1)
            state.setdefault(name, {})[k] = z[key]
    return state


def mode_restore(world, chk: Checker, model: Model, directory: str) -> None:
    make_opt = cross_optimizer
    state = read_state(os.path.join(directory, "expected.npz"))
    path = os.path.join(directory, "ckpt")
    emb = model.sharded(world, make_opt(), "column_wise")
    ec.load(path, emb)
    compare_with_state(chk, emb, state, f"restore on {world.size} column_wise")
    whole = model.unsharded(make_opt())
    ec.load(path, whole)
    gb = model.batch(np.random.default_rng(6000), 5)
    lo, hi = bounds(5, world.size)[world.rank]
    for weighting in ("weighted", "unweighted"):
        got = emb(*gb.part(lo, hi, weighting))
        want = whole(*gb.part(0, 5, weighting))
        compare_outputs(chk, model, emb, got, want, lo, hi, f"restore lookup {weighting}")
    # Training goes on in this world, which saves over the other world's checkpoint.
    train_steps(world, chk, model, emb, whole, seed=6100, steps=2, label=f"restore on {world.size} resumed")
    compare_shards(chk, emb, whole, f"restore on {world.size} resumed")
    ec.save(path, emb)
    write_state(world, gather_state(world, emb), os.path.join(directory, "expected2.npz"))


# ------------------------------------------------------------------ main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("modes", nargs="+", choices=["parity", "train", "fail", "abort", "save", "restore", "inject",
                                                   "rank0_save", "abort_in_save", "towers"])
    ap.add_argument("--dir", help="a directory every rank sees (save / restore; train makes one when absent)")
    ap.add_argument("--no-abort", action="store_true", help="init('mpi', abort_on_error=False)")
    ap.add_argument("--finalize", action="store_true", help="rank0_save: the other ranks call MPI.Finalize()")
    args = ap.parse_args(argv)
    if any(m in ("save", "restore", "rank0_save", "abort_in_save") for m in args.modes) and not args.dir:
        ap.error("save, restore, rank0_save and abort_in_save need --dir")

    world = dist.init("mpi", abort_on_error=not args.no_abort)  # by default an uncaught exception aborts the job
    ec.set_num_threads(1)  # N ranks share the machine's cores
    chk = Checker(world)
    model = Model()
    start = time.perf_counter()
    for mode in args.modes:
        if mode == "parity":
            mode_parity(world, chk, model)
        elif mode == "inject":
            mode_parity(world, chk, model, inject=True)
        elif mode == "train":
            mode_train(world, chk, model, args.dir)
        elif mode == "fail":
            mode_fail(world, chk, model, args.dir)
        elif mode == "abort":
            mode_abort(world)
        elif mode == "towers":
            mode_towers(world, chk)
        elif mode == "rank0_save":
            mode_rank0_save(world, model, args.dir, args.finalize)
        elif mode == "abort_in_save":
            mode_abort_in_save(world, model, args.dir)
        elif mode == "save":
            mode_save(world, chk, model, args.dir)
        elif mode == "restore":
            mode_restore(world, chk, model, args.dir)
    elapsed = time.perf_counter() - start
    verdict = "OK" if chk.mismatches == 0 and chk.checks > 0 else "FAILED"
    print(f"mpi_worker rank {world.rank}/{world.size} [{' '.join(args.modes)}]: {chk.checks} checks, "
          f"{chk.mismatches} mismatches, {elapsed:.1f} s -> {verdict}", flush=True)
    verdicts = world.all_gather(verdict)
    if world.rank == 0:
        failed = [r for r, v in enumerate(verdicts) if v != "OK"]
        print(f"mpi_worker world {world.size}: " + ("OK" if not failed else f"FAILED on ranks {failed}"), flush=True)
    return 0 if verdict == "OK" else 1


if __name__ == "__main__":
    sys.exit(main())
