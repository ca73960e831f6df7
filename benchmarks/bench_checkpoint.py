#!/usr/bin/env python
"""Checkpoint benchmark, workload W3: save / load of one 4,000,000 x 64
float32 table (1 GiB) with its Adagrad slot ``accumulators`` (1 GiB), 2 GiB
in all.

Contenders, each timed in the same run, in rounds with a rotating order:
- embedcore: ``ec.save`` (fsyncs every file) and ``ec.load`` into an
  existing table (verifies every CRC-32C, then reads: two passes);
- numpy: ``np.save`` of the two arrays + fsync, ``np.load``;
- torch: ``torch.save`` of a dict of the two tensors (zero-copy from the
  table) + fsync, ``torch.load(weights_only=True)``;
- safetensors: ``safetensors.numpy.save_file`` + fsync, ``load_file`` (when
  installed);
- disk limit ("raw"): the same 2 GiB written with 32 MiB ``write`` calls +
  fsync into one file, read back with 32 MiB ``preadv`` calls into a
  preallocated (touched) buffer, with 1 and with 2 threads (the faster one
  is the limit);
- "raw, file by file" (save only): the same bytes in the engine's layout,
  one file per array with a 4 KiB header, each fsynced before the next is
  written: what the engine's write pattern costs without its checksums.
Every save writes a fresh path (the previous one is removed and ``sync``ed
before the clock starts); one untimed embedcore save and one raw save come
first (the first multi-GiB save of a process is 2-3x slower than later
ones on the VM this was written on, whoever makes it). Loads are timed
cold (page cache dropped: by ``echo 3 > /proc/sys/vm/drop_caches`` when
permitted, otherwise by fsync + ``posix_fadvise(DONTNEED)`` on each file;
the report says which) and then warm (right after the cold load). Figures
are medians over the rounds; each ratio also shows its per-round values.

Also measured, on the last embedcore checkpoint:
- ``ec.serving.open`` (lazy checksums): median of several warm opens, and
  one cold open;
- the checksum cost. Load: ``ec.load`` is read_info + verify pass + read
  pass, and the engine's read pass alone (``load_table(verify=False)``) is
  a load without checksums, so (all steps - the read pass alone) / all
  steps is the checksum cost, measured directly, cold and warm (3 times,
  after the rounds); also, in the same block, the warm steps minus a plain
  2-thread read of the same payload bytes (upper bound of checksum + extra
  pass). Save: checksums cannot be switched off, so the CRC-32C time is
  estimated as the user CPU time of ``ec.save`` (the save's only
  user-space work is the CRC; counted as if it overlapped nothing, an upper
  bound); cross-checks: the engine's CRC throughput,
  ``serving.open(verify="eager")`` minus ``verify="lazy"`` on the cached
  values file (CRC over mmap, page faults included), times 2 GiB; and
  ``ec.save`` minus "raw, file by file";
- peak extra memory of each save / load: ``VmHWM`` after the phase minus the
  larger of the RSS before and after it (a new array a load returns is its
  result, not extra), with ``VmHWM`` reset by ``echo 5 >
  /proc/self/clear_refs`` before the phase (fallback when that is refused:
  a 2 ms RSS sampler thread).

Usage:
    python benchmarks/bench_checkpoint.py [--quick] [--json out.json]
        [--repeats 3] [--scratch DIR] [--budget-s 420]

--quick uses a 4x smaller table. The scratch directory (default: the
system temp dir when it is on the same filesystem as this repository,
otherwise <repo>/tmp-bench) is removed at the end, also on errors and
Ctrl-C.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import resource
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
import warnings
from typing import Callable, Dict, List, Optional

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

ROWS = 4_000_000
DIM = 64
CHUNK = 32 << 20  # bytes per write / read call of the raw baseline (the engine's chunk size too)
SERVING_OPENS = 9
DECOMP_REPEATS = 3  # repeats of the ec.load step decomposition
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TARGETS = {
    "save_vs_disk": 1.2,       # ec.save / raw write+fsync  <= 1.2
    "cold_load_vs_disk": 1.2,  # ec.load cold / raw cold read <= 1.2
    "vs_torch": 1.4,           # torch time / ec time >= 1.4
    "vs_numpy_warm": 1.0,      # np.load warm / ec.load warm >= 1.0
    "serving_open_ms": 5.0,    # < 5 ms
    "checksum_frac": 0.10,     # < 10 % of save / load
    "peak_mem_frac": 0.10,     # < 10 % of the checkpoint size
}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def median(xs: List[float]) -> Optional[float]:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


# ---------------------------------------------------------------- page cache
class Cache:
    """Drops the page cache of given files: drop_caches when permitted, else fadvise."""

    def __init__(self, method: str):
        self.method = method
        if method == "auto":
            try:
                os.sync()
                with open("/proc/sys/vm/drop_caches", "w") as f:
                    f.write("3")
                self.method = "drop_caches"
            except OSError:
                self.method = "fadvise"

    def drop(self, paths: List[str]) -> None:
        if self.method == "drop_caches":
            os.sync()
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3")
            return
        for p in paths:
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)

    def describe(self) -> str:
        if self.method == "drop_caches":
            return "sync; echo 3 > /proc/sys/vm/drop_caches"
        return "fsync + posix_fadvise(POSIX_FADV_DONTNEED) per file"


def files_under(path: str) -> List[str]:
    if os.path.isfile(path):
        return [path]
    out = []
    for root, _, names in os.walk(path):
        out += [os.path.join(root, n) for n in names]
    return sorted(out)


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_files_and_dir(files: List[str]) -> None:
    for f in files:
        fsync_path(f)
    for d in sorted({os.path.dirname(f) for f in files}):
        fsync_path(d)


def remove(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.exists(path):
        os.unlink(path)


# ---------------------------------------------------------------- memory
def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(field + " not in /proc/self/status")


def pressure() -> Dict[str, float]:
    """Seconds of 'some' stall (PSI) so far, for cpu and io; {} when unsupported."""
    out = {}
    for kind in ("cpu", "io"):
        try:
            with open(f"/proc/pressure/{kind}") as f:
                line = f.readline()
            out[kind] = int(line.split("total=")[1]) / 1e6
        except (OSError, IndexError, ValueError):
            pass
    return out


def rss_bytes() -> int:
    return _status_kb("VmRSS") << 10


class PeakMeter:
    """Peak RSS of a phase: VmHWM reset through clear_refs, or a sampler thread."""

    def __init__(self, method: str):
        self.method = method
        if method == "auto":
            self.method = "clear_refs" if self._reset() else "sampler"
        self._stop = None
        self._peak = 0

    @staticmethod
    def _reset() -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            return True
        except OSError:
            return False

    def start(self) -> None:
        if self.method == "clear_refs":
            if not self._reset():
                raise RuntimeError("clear_refs stopped working")
            return
        self._peak = rss_bytes()
        self._stop = threading.Event()
        page = os.sysconf("SC_PAGE_SIZE")

        def sample():
            with open("/proc/self/statm") as f:
                while not self._stop.is_set():
                    f.seek(0)
                    self._peak = max(self._peak, int(f.read().split()[1]) * page)
                    time.sleep(0.002)

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()

    def stop(self) -> int:
        if self.method == "clear_refs":
            return _status_kb("VmHWM") << 10
        self._stop.set()
        self._thread.join()
        return max(self._peak, rss_bytes())

    def describe(self) -> str:
        if self.method == "clear_refs":
            return "VmHWM, reset by 'echo 5 > /proc/self/clear_refs' before each phase"
        return "RSS sampled every 2 ms by a thread"


def timed(fn: Callable[[], object], meter: PeakMeter):
    """Runs fn once; returns (record, result). The record has wall seconds,
    CPU seconds of the process (all threads) and peak memory figures."""
    gc.collect()
    meter.start()
    rss0 = rss_bytes()
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    result = fn()
    secs = time.perf_counter() - t0
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    hwm = meter.stop()
    rss1 = rss_bytes()
    rec = {
        "s": secs,
        "user_s": ru1.ru_utime - ru0.ru_utime,
        "sys_s": ru1.ru_stime - ru0.ru_stime,
        "rss_before": rss0,
        "rss_after": rss1,
        "peak": hwm,
        "peak_over_before": max(0, hwm - rss0),
        "peak_extra": max(0, hwm - max(rss0, rss1)),  # transient: above both the start and the end state
    }
    return rec, result


# ---------------------------------------------------------------- contenders
class Contender:
    name = ""
    loads = True  # False: only the save is timed

    def path(self, base: str) -> str:
        return os.path.join(base, self.name)

    def save(self, path: str) -> None:
        raise NotImplementedError

    def load(self, path: str):
        raise NotImplementedError

    def check(self, result) -> bool:
        return True


class Embedcore(Contender):
    name = "embedcore"

    def __init__(self, ec, table, target):
        self.ec, self.t, self.t2 = ec, table, target

    def save(self, path):
        self.ec.save(path, self.t)

    def load(self, path):
        self.ec.load(path, into=self.t2)
        return None

    def check(self, _):
        return (np.array_equal(self.t2.values(), self.t.values())
                and np.array_equal(self.t2.slots()["accumulators"], self.t.slots()["accumulators"]))


class Numpy(Contender):
    name = "numpy"

    def __init__(self, arrays):
        self.arrays = arrays

    def save(self, path):
        os.mkdir(path)
        files = []
        for k, a in self.arrays.items():
            files.append(os.path.join(path, k + ".npy"))
            np.save(files[-1], a)
        fsync_files_and_dir(files)

    def load(self, path):
        return {k: np.load(os.path.join(path, k + ".npy")) for k in self.arrays}

    def check(self, r):
        return all(np.array_equal(r[k], a) for k, a in self.arrays.items())


class Torch(Contender):
    name = "torch"

    def __init__(self, torch, arrays):
        self.torch = torch
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the table's views are read-only; torch only reads them here
            self.tensors = {k: torch.from_numpy(a) for k, a in arrays.items()}
        self.arrays = arrays

    def save(self, path):
        os.mkdir(path)
        f = os.path.join(path, "ckpt.pt")
        self.torch.save(self.tensors, f)
        fsync_files_and_dir([f])

    def load(self, path):
        return self.torch.load(os.path.join(path, "ckpt.pt"), weights_only=True)

    def check(self, r):
        return all(np.array_equal(r[k].numpy(), a) for k, a in self.arrays.items())


class Safetensors(Contender):
    name = "safetensors"

    def __init__(self, stnp, arrays):
        self.stnp = stnp
        self.arrays = arrays

    def save(self, path):
        os.mkdir(path)
        f = os.path.join(path, "ckpt.safetensors")
        self.stnp.save_file(self.arrays, f)
        fsync_files_and_dir([f])

    def load(self, path):
        return self.stnp.load_file(os.path.join(path, "ckpt.safetensors"))

    def check(self, r):
        return all(np.array_equal(r[k], a) for k, a in self.arrays.items())


class Raw(Contender):
    """The disk's own limit: 32 MiB writes + fsync; 32 MiB preadv into a touched buffer."""

    name = "raw"

    def __init__(self, arrays, buffer: np.ndarray):
        self.arrays = arrays
        self.buffer = buffer  # uint8 [total bytes], touched
        self.last_write = {}

    def save(self, path):
        os.mkdir(path)
        f = os.path.join(path, "raw.bin")
        t0 = time.perf_counter()
        fd = os.open(f, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for a in self.arrays.values():
                mv = memoryview(a).cast("B")
                for off in range(0, len(mv), CHUNK):
                    part = mv[off:off + CHUNK]
                    while len(part):
                        part = part[os.write(fd, part):]
            t1 = time.perf_counter()
            os.fsync(fd)
        finally:
            os.close(fd)
        fsync_path(path)
        self.last_write = {"write_s": t1 - t0, "fsync_s": time.perf_counter() - t1}

    def read_into(self, specs, threads: int = 1) -> None:
        """specs: (file, file offset, byte count) read in order into the buffer."""
        jobs = []
        pos = 0
        for f, foff, n in specs:
            for off in range(0, n, CHUNK):
                m = min(CHUNK, n - off)
                jobs.append((f, foff + off, pos + off, m))
            pos += n
        if pos > self.buffer.nbytes:
            raise ValueError("read buffer too small")
        fds = {f: os.open(f, os.O_RDONLY) for f, _, _ in specs}
        buf = memoryview(self.buffer)

        def work(k):
            for f, foff, boff, m in jobs[k::threads]:
                got = 0
                while got < m:
                    r = os.preadv(fds[f], [buf[boff + got:boff + m]], foff + got)
                    if r <= 0:
                        raise IOError(f"short read of {f}")
                    got += r

        try:
            if threads == 1:
                work(0)
            else:
                ts = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
                for t in ts:
                    t.start()
                for t in ts:
                    t.join()
        finally:
            for fd in fds.values():
                os.close(fd)

    def load(self, path, threads: int = 1):
        f = os.path.join(path, "raw.bin")
        self.read_into([(f, 0, os.path.getsize(f))], threads)
        return None


class RawPerFile(Contender):
    """The same bytes in embedcore's layout: one file per array (4 KiB header,
    then 32 MiB writes), each fsynced before the next is written. Save only:
    what the engine's write pattern costs without its checksums."""

    name = "raw_per_file"
    loads = False

    def __init__(self, arrays):
        self.arrays = arrays

    def save(self, path):
        os.mkdir(path)
        for k, a in self.arrays.items():
            fd = os.open(os.path.join(path, k + ".bin"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.write(fd, bytes(4096))
                mv = memoryview(a).cast("B")
                for off in range(0, len(mv), CHUNK):
                    part = mv[off:off + CHUNK]
                    while len(part):
                        part = part[os.write(fd, part):]
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_path(path)


# ---------------------------------------------------------------- output
def ratio(a, b):
    return None if a is None or b is None or b == 0 else a / b


# ---------------------------------------------------------------- main
def pick_scratch(requested: Optional[str]) -> str:
    if requested:
        base = requested
    else:
        tmp = tempfile.gettempdir()
        base = tmp if os.stat(tmp).st_dev == os.stat(REPO).st_dev else os.path.join(REPO, "tmp-bench")
    os.makedirs(base, exist_ok=True)
    return tempfile.mkdtemp(prefix="embedcore-ckpt-bench-", dir=base)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a 4x smaller table (1,000,000 x 64)")
    ap.add_argument("--json", metavar="PATH", help="also write every sample and figure as JSON")
    ap.add_argument("--repeats", type=int, default=3, help="rounds (median taken); default 3")
    ap.add_argument("--scratch", metavar="DIR", help="where to write checkpoints (a temp dir is made inside)")
    ap.add_argument("--budget-s", type=float, default=420.0,
                    help="skip the remaining rounds once this much time has passed (default 420)")
    ap.add_argument("--cache-method", choices=("auto", "drop_caches", "fadvise"), default="auto")
    ap.add_argument("--mem-method", choices=("auto", "clear_refs", "sampler"), default="auto")
    ap.add_argument("--skip", default="", help="comma-separated contenders to leave out (numpy,torch,safetensors)")
    args = ap.parse_args()

    start = time.perf_counter()
    rows = ROWS // 4 if args.quick else ROWS
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}

    import embedcore as ec

    cache = Cache(args.cache_method)
    meter = PeakMeter(args.mem_method)
    scratch = pick_scratch(args.scratch)
    log(f"scratch {scratch}; page cache: {cache.describe()}; peak memory: {meter.describe()}")

    def on_term(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    try:
        return run(args, ec, rows, skip, cache, meter, scratch, start)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        try:
            os.rmdir(os.path.dirname(scratch)) if os.path.basename(os.path.dirname(scratch)) == "tmp-bench" else None
        except OSError:
            pass


def run(args, ec, rows, skip, cache, meter, scratch, start) -> int:
    ckpt_bytes = rows * DIM * 4 * 2
    free = shutil.disk_usage(scratch).free
    if free < 3 * ckpt_bytes + (1 << 30):
        raise SystemExit(f"{scratch}: {free / 2**30:.1f} GiB free, need {(3 * ckpt_bytes + (1 << 30)) / 2**30:.1f}")

    log(f"creating the W3 table: {rows:,} x {DIM} float32 + Adagrad slot ({ckpt_bytes / 2**30:.2f} GiB)")
    opt = ec.optimizers.Adagrad(0.1)
    t = ec.Table(name="w3", rows=rows, dim=DIM, dtype="float32", optimizer=opt,
                 initializer=ec.initializers.Uniform(-0.1, 0.1, seed=0))
    t2 = ec.Table(name="w3", rows=rows, dim=DIM, dtype="float32", optimizer=ec.optimizers.Adagrad(0.1),
                  initializer=ec.initializers.Uniform(-0.1, 0.1, seed=1))  # load target: already resident
    arrays = {"values": t.values(), "accumulators": t.slots()["accumulators"]}
    assert all(a.flags.c_contiguous for a in arrays.values())
    buffer = np.ones(ckpt_bytes, dtype=np.uint8)  # touched: the raw read destination
    raw = Raw(arrays, buffer)

    contenders: List[Contender] = [Embedcore(ec, t, t2)]
    if "numpy" not in skip:
        contenders.append(Numpy(arrays))
    versions = {"embedcore": getattr(ec, "__version__", "?"), "numpy": np.__version__}
    notes = []
    if "torch" not in skip:
        try:
            import torch
            contenders.append(Torch(torch, arrays))
            versions["torch"] = torch.__version__
        except ImportError:
            notes.append("torch not installed: skipped")
    if "safetensors" not in skip:
        try:
            import safetensors
            import safetensors.numpy as stnp
            contenders.append(Safetensors(stnp, arrays))
            versions["safetensors"] = safetensors.__version__
        except ImportError:
            notes.append("safetensors not installed: skipped")
    contenders.append(raw)
    contenders.append(RawPerFile(arrays))

    # Warm-up, untimed: the first multi-GiB save of a process is much slower than later ones here (2-3x:
    # fresh page-cache memory from the hypervisor, ext4 allocator state), whoever does it.
    warmup = {}
    for c in (contenders[0], raw):
        p = os.path.join(scratch, "warmup." + c.name)
        t0 = time.perf_counter()
        c.save(p)
        warmup[c.name] = time.perf_counter() - t0
        remove(p)
    os.sync()
    log("warm-up saves (untimed): " + ", ".join(f"{k} {v:.2f} s" for k, v in warmup.items()))

    samples: Dict[str, Dict[str, List[dict]]] = {c.name: {"save": [], "cold": [], "warm": []} for c in contenders}
    samples["raw"]["cold2"] = []  # 2-thread cold read
    checks: Dict[str, bool] = {}
    ec_path = None
    rounds_done = 0
    load0 = os.getloadavg()
    psi0, wall0 = pressure(), time.perf_counter()

    for r in range(args.repeats):
        if r > 0:
            elapsed = time.perf_counter() - start
            per_round = elapsed / r
            if elapsed + per_round + 25 > args.budget_s:
                notes.append(f"stopped after {r} rounds: the next would pass the {args.budget_s:.0f} s budget")
                log(notes[-1])
                break
        order = contenders[r % len(contenders):] + contenders[:r % len(contenders)]
        for c in order:
            path = os.path.join(scratch, f"{c.name}.r{r}")
            os.sync()  # nothing of earlier phases left dirty when the clock starts
            rec, _ = timed(lambda: c.save(path), meter)
            if c is raw:
                rec.update(raw.last_write)
            samples[c.name]["save"].append(rec)
            if not c.loads:
                log(f"round {r + 1} {c.name:12s} save {rec['s']:6.2f} s")
                remove(path)
                continue
            files = files_under(path)
            cache.drop(files)
            rec, res = timed(lambda: c.load(path), meter)
            samples[c.name]["cold"].append(rec)
            if r == 0:
                checks[c.name] = bool(c.check(res))
            del res
            rec, res = timed(lambda: c.load(path), meter)
            samples[c.name]["warm"].append(rec)
            del res
            if c is raw:
                cache.drop(files)
                rec, _ = timed(lambda: raw.load(path, threads=2), meter)
                samples["raw"]["cold2"].append(rec)
            log(f"round {r + 1} {c.name:12s} save {samples[c.name]['save'][-1]['s']:6.2f} s  "
                f"cold load {samples[c.name]['cold'][-1]['s']:6.2f} s  warm load {samples[c.name]['warm'][-1]['s']:6.2f} s")
            if c.name == "embedcore":
                if ec_path is not None:
                    remove(ec_path)
                ec_path = path  # kept for the serving / checksum measurements
            else:
                remove(path)
        rounds_done = r + 1

    # ------------------------------------------------ embedcore extras on the last checkpoint
    log("serving.open, checksum decomposition")
    ec_files = files_under(ec_path)
    data_files = [f for f in ec_files if f.endswith(".ecd")]
    values_file = [f for f in data_files if ".values." in os.path.basename(f)][0]
    extras: Dict[str, object] = {}

    def open_close(verify):
        srv = ec.serving.open(ec_path, verify=verify)
        del srv

    cache.drop(ec_files)
    t0 = time.perf_counter()
    srv = ec.serving.open(ec_path)
    extras["serving_open_cold_ms"] = (time.perf_counter() - t0) * 1e3
    del srv
    opens = []
    for _ in range(SERVING_OPENS):
        t0 = time.perf_counter()
        open_close(True)
        opens.append((time.perf_counter() - t0) * 1e3)  # includes the close (munmap): an upper bound
    extras["serving_open_ms"] = opens
    # Cache the values file, then eager vs lazy opens: the engine's CRC-32C over 1 file.
    raw.read_into([(values_file, 0, os.path.getsize(values_file))])
    eager = []
    for _ in range(3):
        t0 = time.perf_counter()
        open_close("eager")
        eager.append(time.perf_counter() - t0)
    extras["serving_open_eager_s"] = eager
    crc_s = max(1e-9, median(eager) - median(opens) / 1e3)
    values_payload = rows * DIM * 4
    extras["crc_gbps"] = values_payload / crc_s / 1e9
    extras["crc_estimate_save_s"] = ckpt_bytes / (extras["crc_gbps"] * 1e9)

    # Load decomposition through the engine's own steps (the ones ec.load calls).
    native = ec._embedcore
    payload_specs = [(f, 4096, os.path.getsize(f) - 4096) for f in data_files]
    decomp = {"cold": [], "warm": [], "noverify_cold": [], "noverify_warm": [], "plain_warm": [], "plain_cold": []}
    for _ in range(DECOMP_REPEATS):
        for mode in ("cold", "warm"):
            if mode == "cold":
                cache.drop(ec_files)
            t0 = time.perf_counter()
            info = native.read_info(ec_path)
            t1 = time.perf_counter()
            native.verify_table(info, 0, True, False)
            t2_ = time.perf_counter()
            native.load_table(info, 0, t2._native, True, False)
            t3 = time.perf_counter()
            decomp[mode].append({"read_info_s": t1 - t0, "verify_s": t2_ - t1, "read_s": t3 - t2_, "s": t3 - t0})
        cache.drop(ec_files)
        for mode in ("noverify_cold", "noverify_warm"):
            t0 = time.perf_counter()
            info = native.read_info(ec_path)
            native.load_table(info, 0, t2._native, True, False)
            decomp[mode].append({"s": time.perf_counter() - t0})
        cache.drop(ec_files)
        for mode in ("plain_cold", "plain_warm"):
            t0 = time.perf_counter()
            raw.read_into(payload_specs, threads=2)
            decomp[mode].append({"s": time.perf_counter() - t0})
    extras["load_decomposition"] = decomp
    load1 = os.getloadavg()
    psi1, wall1 = pressure(), time.perf_counter()
    stall = {k: (psi1[k] - psi0[k]) / (wall1 - wall0) for k in psi0 if k in psi1}

    # ------------------------------------------------ figures
    def med(name, phase, key="s"):
        s = samples.get(name, {}).get(phase, [])
        return median([x[key] for x in s]) if s else None

    def mx(name, phase, key):
        s = samples.get(name, {}).get(phase, [])
        return max(x[key] for x in s) if s else None

    gib = ckpt_bytes / 2**30
    disk_write = med("raw", "save")
    disk_read = min(v for v in (med("raw", "cold"), med("raw", "cold2")) if v is not None)
    def mib(v):
        return None if v is None else v / 2**20

    def gbps(secs):
        return None if secs is None else ckpt_bytes / secs / 1e9

    table_rows = []
    for c in contenders:
        n = c.name
        loads = samples[n]["cold"] + samples[n]["warm"]
        row = {"contender": n, "save": med(n, "save"), "save_gbps": gbps(med(n, "save")),
               "cold": med(n, "cold"), "cold_gbps": gbps(med(n, "cold")),
               "warm": med(n, "warm"), "warm_gbps": gbps(med(n, "warm")),
               "save_cpu": med(n, "save", "user_s"), "save_sys": med(n, "save", "sys_s"),
               "mem_save": mib(mx(n, "save", "peak_extra")),
               "mem_load": mib(max(x["peak_extra"] for x in loads)) if loads else None,
               "mem_load_kept": (None if not samples[n]["cold"] else
                                 round(mib(median([x["rss_after"] - x["rss_before"] for x in samples[n]["cold"]])))),
               "ok": {True: "yes", False: "NO"}.get(checks.get(n), "-")}
        table_rows.append(row)
    next(r for r in table_rows if r["contender"] == "raw_per_file")["contender"] = "raw, file by file"
    raw_row = next(r for r in table_rows if r["contender"] == "raw")
    raw_row["contender"] = "raw (disk limit)"
    raw_row["cold"] = disk_read
    raw_row["cold_gbps"] = ckpt_bytes / disk_read / 1e9

    ecs, ecc, ecw = med("embedcore", "save"), med("embedcore", "cold"), med("embedcore", "warm")
    dm = {k: (median([x["s"] for x in v]) if v else None) for k, v in decomp.items()}
    verify_cold = median([x["verify_s"] for x in decomp["cold"]])
    verify_warm = median([x["verify_s"] for x in decomp["warm"]])
    read_cold = median([x["read_s"] for x in decomp["cold"]])
    read_warm = median([x["read_s"] for x in decomp["warm"]])
    ratios = []
    threads = native.get_num_threads()
    extras["engine_threads"] = threads

    def add(metric, value, target, higher, unit="x", note=""):
        ratios.append({"metric": metric, "value": value, "target": ("≥ " if higher else "≤ ") + f"{target:g}{unit}",
                       "verdict": C.verdict(value, target, higher), "note": note})

    def series(name, phase):
        if name == "raw" and phase == "cold":  # the disk read limit: the faster of 1 and 2 threads, per round
            return [min(a["s"], b["s"]) for a, b in zip(samples["raw"]["cold"], samples["raw"]["cold2"])]
        return [x["s"] for x in samples[name][phase]]

    def per_round(a, b):
        """a / b of each round (the two ran minutes apart at most): shows how noisy the ratio is."""
        rs = [x / y for x, y in zip(series(*a), series(*b))]
        return "per round: " + ", ".join(f"{x:.2f}" for x in rs)

    add("ec.save / disk write+fsync", ratio(ecs, disk_write), TARGETS["save_vs_disk"], False, "x",
        per_round(("embedcore", "save"), ("raw", "save")))
    add("ec.load cold / disk cold read", ratio(ecc, disk_read), TARGETS["cold_load_vs_disk"], False, "x",
        per_round(("embedcore", "cold"), ("raw", "cold")))
    if "torch" in samples:
        add("torch.save / ec.save", ratio(med("torch", "save"), ecs), TARGETS["vs_torch"], True, "x",
            per_round(("torch", "save"), ("embedcore", "save")))
        add("torch.load / ec.load (cold)", ratio(med("torch", "cold"), ecc), TARGETS["vs_torch"], True, "x",
            per_round(("torch", "cold"), ("embedcore", "cold")))
        add("torch.load / ec.load (warm)", ratio(med("torch", "warm"), ecw), TARGETS["vs_torch"], True, "x",
            per_round(("torch", "warm"), ("embedcore", "warm")))
    if "numpy" in samples:
        add("np.load / ec.load (warm)", ratio(med("numpy", "warm"), ecw), TARGETS["vs_numpy_warm"], True, "x",
            per_round(("numpy", "warm"), ("embedcore", "warm")))
    add("serving.open warm median (ms)", median(opens), TARGETS["serving_open_ms"], False, " ms",
        f"cold open {extras['serving_open_cold_ms']:.2f} ms")
    crc_cpu = med("embedcore", "save", "user_s")
    add("checksum cost of ec.save (est.)", ratio(crc_cpu, ecs), TARGETS["checksum_frac"], False, "",
        f"user CPU of ec.save {crc_cpu:.2f} s (all CRC; counted as if serial); CRC {extras['crc_gbps']:.1f} GB/s "
        f"by eager-lazy open -> {extras['crc_estimate_save_s']:.2f} s; ec.save - raw file by file "
        f"{ecs - med('raw_per_file', 'save'):+.2f} s")
    for mode in ("cold", "warm"):
        full, bare = dm[mode], dm["noverify_" + mode]
        verify = verify_cold if mode == "cold" else verify_warm
        add(f"checksum cost of ec.load {mode}", ratio(full - bare, full), TARGETS["checksum_frac"], False, "",
            f"steps: {full:.2f} s with the verify pass ({verify:.2f} s), {bare:.2f} s without")
    add("(ec.load warm - plain warm read) / ec.load warm", ratio(dm["warm"] - dm["plain_warm"], dm["warm"]),
        TARGETS["checksum_frac"], False, "",
        f"steps {dm['warm']:.2f} s vs a plain 2-thread read of the payloads {dm['plain_warm']:.2f} s, same block "
        "(upper bound of checksum + extra-pass cost)")
    add("ec.save peak extra memory / ckpt", ratio(mx("embedcore", "save", "peak_extra"), ckpt_bytes),
        TARGETS["peak_mem_frac"], False)
    add("ec.load peak extra memory / ckpt",
        ratio(max(mx("embedcore", "cold", "peak_extra"), mx("embedcore", "warm", "peak_extra")), ckpt_bytes),
        TARGETS["peak_mem_frac"], False)

    # ------------------------------------------------ print
    print(f"\nembedcore checkpoint benchmark, W3: {rows:,} x {DIM} float32 + Adagrad slot = {gib:.2f} GiB; "
          f"{rounds_done} round(s), medians")
    print(f"scratch {scratch} ({os.statvfs(scratch).f_bsize}-byte blocks); page cache dropped by: {cache.describe()}")
    print(f"peak memory: {meter.describe()}; 'peak extra' = peak RSS - max(RSS before, RSS after)")
    print(f"load average {load0[0]:.2f} at start, {load1[0]:.2f} at end; {os.cpu_count()} CPUs; "
          + ("PSI 'some' stall share of the run: " + ", ".join(f"{k} {v:.0%}" for k, v in stall.items())
             if stall else "no PSI") + " (other processes compete when these are high)\n")
    print(C.format_table(table_rows, [
        ("contender", "contender", None), ("save", "save s", "{:.2f}"), ("save_gbps", "GB/s", "{:.2f}"),
        ("save_cpu", "user s", "{:.2f}"), ("save_sys", "sys s", "{:.2f}"),
        ("cold", "cold load s", "{:.2f}"), ("cold_gbps", "GB/s", "{:.2f}"),
        ("warm", "warm load s", "{:.2f}"), ("warm_gbps", "GB/s", "{:.2f}"),
        ("mem_save", "save extra MiB", "{:.0f}"), ("mem_load", "load extra MiB", "{:.0f}"),
        ("mem_load_kept", "load kept MiB", None), ("ok", "data ok", None)]))
    rw = samples["raw"]["save"]
    print(f"\nraw write: {median([x['write_s'] for x in rw]):.2f} s of write() + {median([x['fsync_s'] for x in rw]):.2f} s "
          f"fsync; raw cold read 1 thread {med('raw', 'cold'):.2f} s, 2 threads {med('raw', 'cold2'):.2f} s; "
          f"warm 1 thread {med('raw', 'warm'):.2f} s")
    rpf = med("raw_per_file", "save")
    print(f"raw file by file (the engine's layout: 2 files, each fsynced before the next): {rpf:.2f} s = "
          f"{rpf / disk_write:.2f}x one file; ec.save = {ecs / rpf:.2f}x that (per round: "
          + ", ".join(f"{a['s'] / b['s']:.2f}" for a, b in zip(samples["embedcore"]["save"], samples["raw_per_file"]["save"]))
          + ")")
    print(f"ec.load steps (median of {DECOMP_REPEATS}): cold: read_info {median([x['read_info_s'] for x in decomp['cold']]) * 1e3:.1f} ms, "
          f"verify pass {verify_cold:.2f} s, read pass {read_cold:.2f} s; warm: verify {verify_warm:.2f} s, "
          f"read {read_warm:.2f} s; load_table(verify=False) alone: cold {dm['noverify_cold']:.2f} s, "
          f"warm {dm['noverify_warm']:.2f} s; plain 2-thread read of the payloads: cold {dm['plain_cold']:.2f} s, "
          f"warm {dm['plain_warm']:.2f} s")
    print(f"serving.open: warm opens {', '.join(f'{x:.2f}' for x in opens)} ms; eager open (CRC of the "
          f"{values_payload / 2**30:.2f} GiB values file) {median(eager):.2f} s -> CRC-32C {extras['crc_gbps']:.1f} GB/s\n")
    print(C.format_table(ratios, [("metric", "ratio / figure", None), ("value", "value", "{:.3f}"),
                             ("target", "target", None), ("verdict", "", None), ("note", "note", None)]))
    if "safetensors" in samples:
        notes.append("safetensors' load_file maps the file: its 'load extra' is mapped page-cache pages counted in "
                     "RSS (file-backed, reclaimable), not heap")
    for n in notes:
        print("note: " + n)
    if not all(checks.values()):
        print("ERROR: a load returned different data: " + ", ".join(k for k, v in checks.items() if not v))

    if args.json:
        payload = {"workload": {"rows": rows, "dim": DIM, "dtype": "float32", "slot": "accumulators",
                                "checkpoint_bytes": ckpt_bytes, "quick": args.quick},
                   "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "loadavg_start": load0,
                               "loadavg_end": load1, "psi_some_share": stall, "scratch": scratch},
                   "versions": versions, "cache_method": cache.method, "mem_method": meter.method,
                   "rounds": rounds_done, "warmup_s": warmup, "samples": samples, "extras": extras, "table": table_rows,
                   "ratios": ratios, "targets": TARGETS, "checks": checks, "notes": notes,
                   "elapsed_s": time.perf_counter() - start}
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=2, default=str)
        print(f"\nwrote {args.json}")
    log(f"done in {time.perf_counter() - start:.0f} s")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
