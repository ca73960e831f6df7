"""Shared pieces of the embedcore benchmarks.

- Workload W1: one 1,000,000 x 128 float32 table, 4,096 bags of 32 ids, sum
  combiner; ids uniform or Zipf(1.05) over the whole vocabulary.
- Interleaved timing: every contender runs once per round, in a rotating
  order, after a warm-up, each timed call right after an untimed one of the
  same contender (so none inherits another's caches); the figure is the
  median over rounds.
- Thread control for every contender (embedcore, PyTorch / FBGEMM in this
  process; TensorFlow and the C loops in worker processes told per call).
- The "gather limit": a bare C loop, compiled here with ``cc``, that does the
  same random-row gather (or the SGD / Adagrad update of every occurrence)
  from a plain ``malloc`` table and from an ``mmap`` + ``MADV_HUGEPAGE`` table
  (the way embedcore allocates), with and without software prefetch.
- JSON and plain-text table output.

Workers (the C loop, TensorFlow) are long-lived subprocesses driven over a
pipe, one command per timed call, so they take part in the same interleaved
rounds as the in-process contenders; each reports the time it measured itself
(the pipe round trip is not counted).
"""
from __future__ import annotations

import gc
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

# OpenMP threads (PyTorch's, FBGEMM's) spin for a while after each op, waiting
# for the next; in a run that interleaves contenders they hold a core that the
# next contender's threads need (an embedcore lookup at 2 threads right after
# a PyTorch op took 7.8 ms instead of 4.9). Passive waiting, set before
# PyTorch starts its threads, lets each contender have the cores it is given;
# PyTorch's own time changes within noise. An explicit setting is kept.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# embedcore's tables ask for transparent huge pages (madvise); where the kernel
# gives them only on request ("madvise" mode) a plain copy of the weights gets
# 4 KiB pages, and a lookup reading it pays a TLB miss per row that embedcore's
# does not (PyTorch's embedding_bag read the same rows 10-12% slower from such
# a copy). PyTorch's allocator asks too with this set before it starts: the
# anchors' weights are then torch allocations (`shared_weights`), FBGEMM's
# copies too. An explicit setting is kept.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

# ---------------------------------------------------------------- workload W1
ROWS = 1_000_000
DIM = 128
BATCH = 4096
BAG = 32
NNZ = BATCH * BAG
ZIPF_EXPONENT = 1.05
ROW_BYTES = {"float32": DIM * 4, "float16": DIM * 2}
DISTS = ("uniform", "zipf")

_ZIPF_CDF_CACHE: Dict[float, np.ndarray] = {}


def offsets(batch: int = BATCH, bag: int = BAG) -> np.ndarray:
    """CSR offsets [batch + 1] of fixed-size bags."""
    return np.arange(0, batch * bag + 1, bag, dtype=np.int64)


def uniform_ids(nnz: int = NNZ, rows: int = ROWS, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, rows, nnz, dtype=np.int64)


def zipf_ids(nnz: int = NNZ, rows: int = ROWS, exponent: float = ZIPF_EXPONENT, seed: int = 2,
             permutation_seed: int = 12345) -> np.ndarray:
    """Zipf ids over the whole vocabulary: P(rank r) ~ r^-exponent for
    r = 1..rows, drawn by inverse CDF (no clipping, no rejection), then each
    rank mapped to an id by a fixed random permutation of [0, rows)."""
    key = (rows, exponent)
    cdf = _ZIPF_CDF_CACHE.get(key)
    if cdf is None:
        p = np.arange(1, rows + 1, dtype=np.float64) ** -exponent
        cdf = np.cumsum(p)
        cdf /= cdf[-1]
        _ZIPF_CDF_CACHE[key] = cdf
    u = np.random.default_rng(seed).random(nnz)  # in [0, 1)
    rank0 = np.searchsorted(cdf, u, side="right")  # 0-based rank; cdf[-1] == 1 > u, so < rows
    perm = np.random.default_rng(permutation_seed).permutation(rows).astype(np.int64)
    return perm[rank0]


def make_ids(dist: str, **kw) -> np.ndarray:
    if dist == "uniform":
        return uniform_ids(**kw)
    if dist == "zipf":
        return zipf_ids(**kw)
    raise ValueError(f"unknown id distribution {dist!r}")


def describe_ids(ids: np.ndarray) -> dict:
    uniq = np.unique(ids)
    return {"nnz": int(len(ids)), "unique": int(len(uniq)), "unique_fraction": float(len(uniq) / len(ids)),
            "max_count": int(np.bincount(ids).max())}


# ---------------------------------------------------------------- threads
def set_threads(n: int) -> None:
    """Sets the thread count of every in-process contender: embedcore, and
    PyTorch (which FBGEMM's CPU ops use too) when it is imported. TensorFlow
    and the C loops run in workers that take their thread count per call /
    at start (TensorFlow's must be set before it initializes)."""
    import embedcore as ec

    ec.set_num_threads(n)
    if "torch" in sys.modules:
        import torch

        torch.set_num_threads(n)


# ---------------------------------------------------------------- timing
QUIET_CORES = 0.15  # a round is "quiet" when other processes kept fewer cores than this busy


class Timing:
    """The samples of one interleaved run: seconds by contender, one per
    round, and the other load (cores) during each round."""

    def __init__(self, samples: Dict[str, List[float]], round_load: List[Optional[float]], repeats: int,
                 quiet_cores: float = QUIET_CORES):
        self.samples = samples
        self.round_load = round_load
        quiet = [i for i, x in enumerate(round_load) if x is not None and x < quiet_cores]
        self.quiet_rounds = len(quiet)
        # Quiet rounds only, when there are enough of them; else every round (flagged).
        if all(x is None for x in round_load):
            self.used, self.kept = "all", list(range(len(round_load)))
        elif len(quiet) >= max(3, (repeats + 1) // 2):
            self.used, self.kept = "quiet", quiet
        else:
            self.used, self.kept = "all (noisy)", list(range(len(round_load)))
        known = [x for x in round_load if x is not None]
        self.mean_load = sum(known) / len(known) if known else None
        kept_known = [round_load[i] for i in self.kept if round_load[i] is not None]
        self.kept_load = sum(kept_known) / len(kept_known) if kept_known else None

    def kept_samples(self, name: str) -> List[float]:
        return [self.samples[name][i] for i in self.kept]

    def info(self) -> dict:
        return {"rounds": len(self.round_load), "quiet_rounds": self.quiet_rounds, "used": self.used,
                "mean_other_cores": self.mean_load, "kept_other_cores": self.kept_load,
                "round_other_cores": self.round_load}


def run_interleaved(contenders: Dict[str, Callable[[], Optional[float]]], repeats: int, warmup: int = 2,
                    ) -> Dict[str, List[float]]:
    """Times every contender `repeats` times, one call each per round, the
    order rotated from round to round, after `warmup` untimed rounds. A
    contender that returns a float reports its own time (a worker process);
    others are timed here. Returns the samples in seconds, by name."""
    return run_rounds(contenders, repeats, warmup).samples


def run_rounds(contenders: Dict[str, Callable[[], Optional[float]]], repeats: int, warmup: int = 2,
               monitor_pids: Optional[Sequence[int]] = None, max_seconds: float = 0.0,
               prime: bool = True) -> Timing:
    """Times every contender once per round, the order rotated from round to
    round, after `warmup` untimed rounds. A contender that returns a float
    reports its own time (a worker process); others are timed here.

    With `prime`, each timed call directly follows an untimed call of the
    same contender, so every contender is timed from its own warm caches.
    Without it, a contender would inherit the caches of whichever ran just
    before it: one that follows another over the same memory (NumPy then
    PyTorch on shared weights, the adapter then the bare table) finds the
    hot rows of a Zipf batch already cached, and the rotation keeps that
    neighbour in front of it in almost every round.

    With `monitor_pids` (worker processes of ours), the load other processes
    put on the machine is measured in each round; rounds go on until
    `repeats` of them were quiet, or, once `repeats` rounds ran, until
    `max_seconds` have passed (at most 4 x `repeats` rounds). Without it,
    exactly `repeats` rounds run."""
    names = list(contenders)
    for _ in range(warmup):
        for n in names:
            contenders[n]()
    samples: Dict[str, List[float]] = {n: [] for n in names}
    loads: List[Optional[float]] = []
    gc_was = gc.isenabled()
    gc.disable()
    t_start = time.perf_counter()
    try:
        r = quiet = 0
        while True:
            if monitor_pids is None:
                if r >= repeats:
                    break
            elif quiet >= repeats or r >= 4 * repeats or (r >= repeats and time.perf_counter() - t_start > max_seconds):
                break
            mon = CpuMonitor(monitor_pids).start() if monitor_pids is not None else None
            k = r % len(names)
            for n in names[k:] + names[:k]:
                if prime:
                    contenders[n]()
                res = None  # the previous contender's result is freed here, not on this one's clock
                t0 = time.perf_counter()
                res = contenders[n]()
                dt = time.perf_counter() - t0
                samples[n].append(float(res) if isinstance(res, float) else dt)
            load = mon.stop()["other_cores"] if mon is not None else None
            loads.append(load)
            if load is not None and load < QUIET_CORES:
                quiet += 1
            r += 1
    finally:
        if gc_was:
            gc.enable()
    return Timing(samples, loads, repeats)


def summarize(samples: Sequence[float]) -> dict:
    s = sorted(samples)
    q = statistics.quantiles(s, n=4) if len(s) >= 2 else [s[0]] * 3
    return {"median_s": statistics.median(s), "min_s": s[0], "p25_s": q[0], "p75_s": q[2], "n": len(s)}


# ---------------------------------------------------------------- other load on the machine
def _proc_ticks(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            rest = f.read().rsplit(")", 1)[1].split()
        return int(rest[11]) + int(rest[12])  # utime + stime, all threads
    except (OSError, IndexError, ValueError):
        return 0


def _machine_ticks() -> tuple:
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    busy = v[0] + v[1] + v[2] + v[5] + v[6]  # user nice system irq softirq
    steal = v[7] if len(v) > 7 else 0
    return busy, steal


class CpuMonitor:
    """How many cores, on average, processes other than ours (this one and
    the given worker pids) kept busy between start() and stop(), and how much
    the hypervisor stole: the noise the figures carry."""

    def __init__(self, pids: Sequence[int] = ()):
        self.pids = [os.getpid(), *pids]

    def start(self) -> "CpuMonitor":
        self.t0 = time.perf_counter()
        self.m0 = _machine_ticks()
        self.o0 = sum(_proc_ticks(p) for p in self.pids)
        return self

    def stop(self) -> dict:
        wall = time.perf_counter() - self.t0
        busy, steal = _machine_ticks()
        own = sum(_proc_ticks(p) for p in self.pids) - self.o0
        hz = os.sysconf("SC_CLK_TCK")
        other = max(0.0, (busy - self.m0[0] - own) / hz / wall) if wall > 0 else 0.0
        return {"other_cores": other, "steal_cores": (steal - self.m0[1]) / hz / wall if wall > 0 else 0.0,
                "wall_s": wall}


# ---------------------------------------------------------------- memory: transparent huge pages
def shared_weights(values: np.ndarray):
    """A copy of `values` for the anchors: a torch tensor (on huge pages, as
    embedcore's tables: THP_MEM_ALLOC_ENABLE above) and the NumPy array
    viewing it."""
    import torch

    wt = torch.from_numpy(np.ascontiguousarray(values)).clone()
    return wt.numpy(), wt


def anon_huge_bytes(address: int) -> Optional[int]:
    """AnonHugePages (bytes) of this process's mapping holding `address`."""
    try:
        with open("/proc/self/smaps") as f:
            inside = False
            for line in f:
                head = line.split(None, 1)[0]
                if "-" in head and not head.endswith(":"):
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    inside = lo <= address < hi
                elif inside and line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def thp_setting() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().strip()
    except OSError:
        return "unknown"


# ---------------------------------------------------------------- output
def machine_info() -> dict:
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    return {"cpu": model, "cpus": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)),
            "platform": platform.platform(), "python": platform.python_version(), "thp": thp_setting(),
            "loadavg_at_start": load, "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY")}


def versions() -> dict:
    import importlib.metadata as md

    import embedcore as ec

    v = {"embedcore": ec.__version__, "embedcore_build": ec.build_info(), "numpy": np.__version__}
    # The engine may be rebuilt between runs (editable install): say which build ran.
    try:
        import hashlib

        from embedcore import _embedcore

        with open(_embedcore.__file__, "rb") as f:
            v["embedcore_extension_sha256"] = hashlib.sha256(f.read()).hexdigest()[:16]
        v["embedcore_extension_mtime"] = time.strftime("%Y-%m-%d %H:%M:%S",
                                                       time.localtime(os.path.getmtime(_embedcore.__file__)))
    except (OSError, AttributeError, TypeError):
        pass
    try:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        head = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True)
        if head.returncode == 0:
            v["git"] = head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except OSError:
        pass
    for dist in ("torch", "fbgemm-gpu-cpu", "fbgemm-gpu", "tensorflow-cpu", "tensorflow"):
        try:
            v[dist] = md.version(dist)
        except md.PackageNotFoundError:
            pass
    return v


def print_footer(noise: dict, vers: dict, t_start: float) -> None:
    """The closing lines of a timed benchmark: a warning naming the cases
    timed without enough quiet rounds (`noise` as ``run_rounds`` fills it),
    what was measured (``versions()``), the run's time and load."""
    noisy = [k for k, v in noise.items() if v["used"] != "quiet"]
    if noisy:
        print("WARNING: too few quiet rounds (other processes were busy) while timing " + ", ".join(
            "/".join(str(x) + ("T" if isinstance(x, int) else "") for x in k) for k in noisy)
              + "; those figures (2-thread ones above all) are unreliable; rerun on a quiet machine")
    print(f"embedcore {vers.get('embedcore')} ({vers.get('embedcore_build', {}).get('simd')}), extension sha256 "
          f"{vers.get('embedcore_extension_sha256')} built {vers.get('embedcore_extension_mtime')}, git {vers.get('git')}")
    print(f"total time {time.time() - t_start:.0f} s; load average now {os.getloadavg()[0]:.2f}")


def write_json(path: str, payload: dict) -> None:
    with open(path, "w") as f:
        json.dump(payload, f, indent=2, default=str)
    print(f"\nwrote {path}")


def format_table(rows: List[dict], columns: List[tuple]) -> str:
    """columns: (key, header, format) triples; a missing value prints '-'."""
    cells = [[h for _, h, _ in columns]]
    for r in rows:
        line = []
        for key, _, fmt in columns:
            v = r.get(key)
            line.append("-" if v is None else (fmt.format(v) if fmt else str(v)))
        cells.append(line)
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    out = []
    for j, c in enumerate(cells):
        out.append("  ".join(x.ljust(w) if i == 0 else x.rjust(w) for i, (x, w) in enumerate(zip(c, widths))))
        if j == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def verdict(value: Optional[float], target: float, higher_is_better: bool = True) -> str:
    if value is None:
        return "n/a"
    ok = value >= target if higher_is_better else value <= target
    return "PASS" if ok else "FAIL"


def fbgemm_available() -> bool:
    """Whether FBGEMM's CPU table-batched embedding imports (it logs why not)."""
    try:
        import fbgemm_gpu.split_table_batched_embeddings_ops_training  # noqa: F401
        return True
    except ImportError as e:
        log(f"FBGEMM not available ({e}); skipping it")
        return False


def fbgemm_table(weights, optimizer: str = "sgd", learning_rate: float = 0.01, **kwargs):
    """FBGEMM's CPU table-batched embedding holding W1's table (a copy of the
    torch tensor `weights`), sum pooling, with its fused EXACT_SGD or
    EXACT_ADAGRAD optimizer."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType as OptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice, EmbeddingLocation, SplitTableBatchedEmbeddingBagsCodegen)

    kind = {"sgd": OptimType.EXACT_SGD, "adagrad": OptimType.EXACT_ADAGRAD}[optimizer]
    fb = SplitTableBatchedEmbeddingBagsCodegen([(ROWS, DIM, EmbeddingLocation.HOST, ComputeDevice.CPU)],
                                               optimizer=kind, learning_rate=learning_rate,
                                               pooling_mode=PoolingMode.SUM, **kwargs)
    fb.split_embedding_weights()[0].copy_(weights)
    return fb


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- scratch directory
def scratch_dir() -> str:
    """A temp dir in /dev/shm when it has room (fast loading of the 512 MB weights)."""
    base = None
    try:
        st = os.statvfs("/dev/shm")
        if st.f_bavail * st.f_frsize > 4 << 30:
            base = "/dev/shm"
    except OSError:
        pass
    return tempfile.mkdtemp(prefix="embedcore-bench-", dir=base)


# ---------------------------------------------------------------- the C loops
C_SOURCE = r"""
// The bare loops the benchmarks compare with: a random-row gather summing
// BAG rows per bag (the lookup), and the SGD / Adagrad update of every
// occurrence (no dedup; 2 threads race on repeated ids, Hogwild style).
// Two copies of the table: plain malloc, and mmap + madvise(MADV_HUGEPAGE)
// exactly as embedcore allocates. The loops are compiled twice, with plain
// -O3 (baseline x86-64: SSE2) and with -O3 -march=native, and linked into
// one program (this file is compiled three times: -DPART_KERNELS -DSUF=base,
// -DPART_KERNELS -DSUF=native, and the main part).
// Commands on stdin, one line each:
//   gather <set> <mode 0 malloc|1 thp> <threads> <prefetch> <isa 0 base|1 native>  -> seconds
//   step <set> <mode> <threads> <prefetch> <isa> <opt 0 sgd|1 adagrad> <fwd 0|1> <lr> -> seconds
//   dump <set> <mode> <path>                         (writes the gather output)
//   thp                                              -> AnonHugePages kB of each table
//   quit
#define _GNU_SOURCE
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#ifndef DIM
#define DIM 128
#endif
#ifndef BAG
#define BAG 32
#endif

typedef struct {
  int kind;  // 0 gather, 1 step
  int opt, fwd, pf, isa;
  float lr;
  float* t;
  float* a;
  const int64_t* ids;
  int64_t b0, b1;
} Job;

extern float* out;
extern float* grads;
void* run_job_base(void* arg);
void* run_job_native(void* arg);

#ifdef PART_KERNELS
#define CAT_(a, b) a##b
#define CAT(a, b) CAT_(a, b)

#define PREFETCH_ROW(p, w)                                                      \
  do {                                                                          \
    const char* q_ = (const char*)(p);                                          \
    for (int o_ = 0; o_ < DIM * 4; o_ += 64) __builtin_prefetch(q_ + o_, w, 3); \
  } while (0)

static inline __attribute__((always_inline)) void gather_impl(const Job* j, const int pf) {
  const int64_t* ids = j->ids;
  const float* t = j->t;
  const int64_t k_end = j->b1 * BAG;
  for (int64_t b = j->b0; b < j->b1; ++b) {
    float acc[DIM];
    for (int d = 0; d < DIM; ++d) acc[d] = 0.0f;
    for (int64_t k = b * BAG; k < (b + 1) * BAG; ++k) {
      if (pf && k + pf < k_end) PREFETCH_ROW(t + ids[k + pf] * DIM, 0);
      const float* r = t + ids[k] * DIM;
      for (int d = 0; d < DIM; ++d) acc[d] += r[d];
    }
    memcpy(out + b * DIM, acc, sizeof acc);
  }
}

static inline __attribute__((always_inline)) void update_impl(const Job* j, const int pf, const int opt) {
  const int64_t* ids = j->ids;
  float* t = j->t;
  float* a = j->a;
  const float lr = j->lr;
  const int64_t k_end = j->b1 * BAG;
  for (int64_t b = j->b0; b < j->b1; ++b) {
    const float* g = grads + b * DIM;
    for (int64_t k = b * BAG; k < (b + 1) * BAG; ++k) {
      if (pf && k + pf < k_end) {
        PREFETCH_ROW(t + ids[k + pf] * DIM, 1);
        if (opt) PREFETCH_ROW(a + ids[k + pf] * DIM, 1);
      }
      float* r = t + ids[k] * DIM;
      if (opt == 0) {
        for (int d = 0; d < DIM; ++d) r[d] -= lr * g[d];
      } else {
        float* s = a + ids[k] * DIM;
        for (int d = 0; d < DIM; ++d) {
          const float an = s[d] + g[d] * g[d];
          s[d] = an;
          r[d] -= lr * g[d] / sqrtf(an);
        }
      }
    }
  }
}

#define DISPATCH_PF(call, pf)                                     \
  switch (pf) {                                                   \
    case 0: call(0); break;                                       \
    case 4: call(4); break;                                       \
    case 8: call(8); break;                                       \
    case 16: call(16); break;                                     \
    default: fprintf(stderr, "bad prefetch %d\n", pf); exit(1);   \
  }

void* CAT(run_job_, SUF)(void* arg) {
  const Job* j = (const Job*)arg;
  if (j->kind == 0 || j->fwd) {
#define G(p) gather_impl(j, p)
    DISPATCH_PF(G, j->pf)
#undef G
  }
  if (j->kind == 1) {
    if (j->opt == 0) {
#define U(p) update_impl(j, p, 0)
      DISPATCH_PF(U, j->pf)
#undef U
    } else {
#define U(p) update_impl(j, p, 1)
      DISPATCH_PF(U, j->pf)
#undef U
    }
  }
  return NULL;
}

#else  // the main part

static int64_t ROWS, NBAGS;
static size_t BYTES;
static float* table[2];
static float* accum[2];
float* out;
float* grads;
static int64_t* sets[16];
static int nsets;

static float* alloc_table(int mode) {
  if (mode == 0) {
    float* p = (float*)malloc(BYTES);
    if (!p) { perror("malloc"); exit(1); }
    return p;
  }
  void* p = mmap(NULL, BYTES, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) { perror("mmap"); exit(1); }
  madvise(p, BYTES, MADV_HUGEPAGE);
  return (float*)p;
}

static long anon_huge_kb(const void* addr) {
  FILE* f = fopen("/proc/self/smaps", "r");
  if (!f) return -1;
  char line[512];
  int inside = 0;
  long kb = -1;
  while (fgets(line, sizeof line, f)) {
    unsigned long lo, hi;
    if (sscanf(line, "%lx-%lx ", &lo, &hi) == 2) {  // a mapping header, not a "Field: value" line
      inside = (uintptr_t)addr >= lo && (uintptr_t)addr < hi;
    } else if (inside && strncmp(line, "AnonHugePages:", 14) == 0) {
      kb = atol(line + 14);
      break;
    }
  }
  fclose(f);
  return kb;
}

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

static double run(Job proto, int threads) {
  Job jobs[64];
  pthread_t tid[64];
  void* (*fn)(void*) = proto.isa ? run_job_native : run_job_base;
  if (threads < 1 || threads > 64) threads = 1;
  double t0 = now();
  for (int i = 0; i < threads; ++i) {
    jobs[i] = proto;
    jobs[i].b0 = NBAGS * i / threads;
    jobs[i].b1 = NBAGS * (i + 1) / threads;
    if (i > 0) pthread_create(&tid[i], NULL, fn, &jobs[i]);
  }
  fn(&jobs[0]);
  for (int i = 1; i < threads; ++i) pthread_join(tid[i], NULL);
  return now() - t0;
}

static void check_set(int s) {
  if (s < 0 || s >= nsets) { fprintf(stderr, "bad id set %d\n", s); exit(1); }
}

int main(int argc, char** argv) {
  // argv: weights.bin rows nbags grads.bin|- ids0.bin [ids1.bin ...]
  if (argc < 6) { fprintf(stderr, "usage: %s weights rows nbags grads ids...\n", argv[0]); return 2; }
  ROWS = atoll(argv[2]);
  NBAGS = atoll(argv[3]);
  BYTES = (size_t)ROWS * DIM * sizeof(float);
  for (int m = 0; m < 2; ++m) {
    table[m] = alloc_table(m);
    FILE* f = fopen(argv[1], "rb");
    if (!f || fread(table[m], 1, BYTES, f) != BYTES) { fprintf(stderr, "cannot read %s\n", argv[1]); return 1; }
    fclose(f);
  }
  out = (float*)aligned_alloc(64, (size_t)NBAGS * DIM * sizeof(float));
  if (strcmp(argv[4], "-") != 0) {
    grads = (float*)aligned_alloc(64, (size_t)NBAGS * DIM * sizeof(float));
    FILE* f = fopen(argv[4], "rb");
    if (!f || fread(grads, sizeof(float), (size_t)NBAGS * DIM, f) != (size_t)NBAGS * DIM) {
      fprintf(stderr, "cannot read %s\n", argv[4]);
      return 1;
    }
    fclose(f);
  }
  for (int i = 5; i < argc && nsets < 16; ++i) {
    const size_t n = (size_t)NBAGS * BAG;
    sets[nsets] = (int64_t*)malloc(n * sizeof(int64_t));
    FILE* f = fopen(argv[i], "rb");
    if (!f || fread(sets[nsets], sizeof(int64_t), n, f) != n) { fprintf(stderr, "cannot read %s\n", argv[i]); return 1; }
    fclose(f);
    ++nsets;
  }
  printf("ready\n");
  fflush(stdout);
  char line[1024];
  while (fgets(line, sizeof line, stdin)) {
    int s, m, th, pf, isa, opt, fwd;
    float lr;
    char path[900];
    if (sscanf(line, "gather %d %d %d %d %d", &s, &m, &th, &pf, &isa) == 5) {
      check_set(s);
      Job j = {0};
      j.kind = 0; j.pf = pf; j.isa = isa; j.t = table[m & 1]; j.ids = sets[s];
      printf("%.9f\n", run(j, th));
    } else if (sscanf(line, "step %d %d %d %d %d %d %d %f", &s, &m, &th, &pf, &isa, &opt, &fwd, &lr) == 8) {
      check_set(s);
      if (!grads) { fprintf(stderr, "no gradients given\n"); return 1; }
      m &= 1;
      if (opt && !accum[m]) {
        accum[m] = alloc_table(m);
        for (size_t i = 0; i < (size_t)ROWS * DIM; ++i) accum[m][i] = 0.1f;
      }
      Job j = {0};
      j.kind = 1; j.pf = pf; j.isa = isa; j.opt = opt; j.fwd = fwd; j.lr = lr; j.t = table[m]; j.a = accum[m];
      j.ids = sets[s];
      printf("%.9f\n", run(j, th));
    } else if (sscanf(line, "dump %d %d %899s", &s, &m, path) == 3) {
      check_set(s);
      Job j = {0};
      j.kind = 0; j.pf = 8; j.isa = 1; j.t = table[m & 1]; j.ids = sets[s];
      run(j, 1);
      FILE* f = fopen(path, "wb");
      fwrite(out, sizeof(float), (size_t)NBAGS * DIM, f);
      fclose(f);
      printf("ok\n");
    } else if (strncmp(line, "thp", 3) == 0) {
      printf("%ld %ld\n", anon_huge_kb(table[0]), anon_huge_kb(table[1]));
    } else if (strncmp(line, "quit", 4) == 0) {
      break;
    } else {
      fprintf(stderr, "bad command: %s", line);
      return 2;
    }
    fflush(stdout);
  }
  return 0;
}
#endif
"""

# The loops are built twice: the plain `cc -O3` build (baseline x86-64, SSE2)
# and one for this CPU; the gather limit is the faster of the two.
C_FLAGS_BASE = ["-O3"]
C_FLAGS_NATIVE = ["-O3", "-march=native"]
C_FLAGS_COMMON = ["-fno-math-errno", "-pthread"]
C_FLAGS = C_FLAGS_NATIVE + C_FLAGS_COMMON  # for the report
ISA_NAMES = {0: "O3", 1: "native"}
MODE_NAMES = {0: "malloc", 1: "thp"}
# (mode, prefetch, isa) of the gather variants bench_lookup times: the
# literal `cc -O3` loop without software prefetch, then with prefetch 8 and
# 16 ids ahead (16: embedcore's distance for float32 rows), then the
# -march=native build.
GATHER_VARIANTS = [(0, 0, 0), (1, 0, 0), (0, 8, 0), (1, 8, 0), (0, 16, 0), (1, 16, 0), (0, 8, 1), (1, 8, 1),
                   (0, 16, 1), (1, 16, 1)]


def gather_variant_name(mode: int, pf: int, isa: int) -> str:
    return f"c_{MODE_NAMES[mode]}_{ISA_NAMES[isa]}_pf{pf}"


def compile_c(workdir: str) -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc / gcc) on PATH")
    src = os.path.join(workdir, "bare_loops.c")
    exe = os.path.join(workdir, "bare_loops")
    with open(src, "w") as f:
        f.write(C_SOURCE)
    defs = [f"-DDIM={DIM}", f"-DBAG={BAG}"]
    cmds = [
        [cc, *C_FLAGS_BASE, *C_FLAGS_COMMON, *defs, "-DPART_KERNELS", "-DSUF=base", "-c", src, "-o", exe + "_base.o"],
        [cc, *C_FLAGS_NATIVE, *C_FLAGS_COMMON, *defs, "-DPART_KERNELS", "-DSUF=native", "-c", src,
         "-o", exe + "_native.o"],
        [cc, "-O2", *C_FLAGS_COMMON, *defs, src, exe + "_base.o", exe + "_native.o", "-o", exe, "-lm"],
    ]
    for cmd in cmds:
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{r.stderr}")
    return exe


class Worker:
    """A subprocess answering one line per command line."""

    def __init__(self, argv: List[str], env: Optional[dict] = None, prefix: str = ""):
        self.prefix = prefix
        self.p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
                                  env=env)
        first = self._readline()
        if first != "ready":
            raise RuntimeError(f"worker {argv[0]} did not start: {first!r}")

    def _readline(self) -> str:
        while True:
            line = self.p.stdout.readline()
            if not line:
                raise RuntimeError(f"worker exited (rc={self.p.poll()})")
            line = line.strip()
            if not self.prefix:
                return line
            if line.startswith(self.prefix):
                return line[len(self.prefix):].strip()

    def ask(self, cmd: str) -> str:
        self.p.stdin.write(cmd + "\n")
        self.p.stdin.flush()
        return self._readline()

    def close(self) -> None:
        if self.p.poll() is None:
            try:
                self.p.stdin.write("quit\n")
                self.p.stdin.flush()
                self.p.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.p.kill()
                self.p.wait()


class CLoops:
    """The compiled bare loops, holding both tables (malloc, THP) filled with
    `weights` and the id sets given, by name."""

    def __init__(self, workdir: str, weights_path: str, id_paths: Dict[str, str], grads_path: Optional[str] = None):
        self.exe = compile_c(workdir)
        self.sets = {name: i for i, name in enumerate(id_paths)}
        self.w = Worker([self.exe, weights_path, str(ROWS), str(BATCH), grads_path or "-", *id_paths.values()])
        self.pid = self.w.p.pid

    def gather(self, dist: str, mode: int, threads: int, prefetch: int, isa: int = 1) -> float:
        return float(self.w.ask(f"gather {self.sets[dist]} {mode} {threads} {prefetch} {isa}"))

    def step(self, dist: str, mode: int, threads: int, prefetch: int, opt: int, fwd: int, lr: float,
             isa: int = 1) -> float:
        return float(self.w.ask(f"step {self.sets[dist]} {mode} {threads} {prefetch} {isa} {opt} {fwd} {lr}"))

    def dump(self, dist: str, mode: int, path: str) -> np.ndarray:
        self.w.ask(f"dump {self.sets[dist]} {mode} {path}")
        return np.fromfile(path, dtype=np.float32).reshape(BATCH, DIM)

    def thp_bytes(self) -> Dict[str, int]:
        a, b = (int(x) for x in self.w.ask("thp").split())
        return {"malloc": a * 1024 if a >= 0 else None, "thp": b * 1024 if b >= 0 else None}

    def close(self) -> None:
        self.w.close()


def tf_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("tensorflow") is not None


class TFWorker:
    """TensorFlow's tf.nn.safe_embedding_lookup_sparse in a subprocess whose
    intra-/inter-op thread counts are set before TensorFlow initializes."""

    def __init__(self, threads: int, weights_path: str, id_paths: Dict[str, str]):
        env = dict(os.environ)
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        env["OMP_NUM_THREADS"] = str(threads)
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_tf_worker.py")
        argv = [sys.executable, script, "--threads", str(threads), "--weights", weights_path,
                "--rows", str(ROWS), "--dim", str(DIM), "--batch", str(BATCH), "--bag", str(BAG)]
        for name, p in id_paths.items():
            argv += ["--ids", f"{name}={p}"]
        self.w = Worker(argv, env=env, prefix="@@")
        self.pid = self.w.p.pid
        self.threads = threads

    def run(self, dist: str) -> float:
        return float(self.w.ask(f"run {dist}"))

    def dump(self, dist: str, path: str) -> np.ndarray:
        self.w.ask(f"dump {dist} {path}")
        return np.load(path)

    def close(self) -> None:
        self.w.close()
