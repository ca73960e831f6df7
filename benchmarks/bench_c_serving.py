"""Serving from C++ (libembedcore's C API) against Python (``ec.serving.open``)
on the same memory-mapped checkpoint.

    python benchmarks/bench_c_serving.py [--quick] [--json serving.json] [--seconds S] [--repeats R]

Checkpoint: W1's table (1,000,000 x 128 float32, ``Uniform(-0.05, 0.05)``,
values only, 512 MB) saved with ``ec.save``; both contenders open it
read-only (mmap, lazy checksums) and serve W1's batch (4,096 bags x 32 uniform
ids, sum) in windows of 4,096 bags (W1 itself), 64 bags and 1 bag (where the
per-call overhead shows).

Contenders, each in its own process:
- ``c++``: benchmarks/bench_c_serving/bench_c_serving.cpp, built here against
  the installed package (``find_package(embedcore)`` with ``python -m embedcore
  --cmake-dir``), a worker driven over a pipe; ``embedcore_lookup`` into a
  preallocated buffer.
- ``python``: ``ec.serving.open(path).tables["w1"].lookup(ids, offsets,
  combiner="sum")`` in this process, from Python threads (the engine releases
  the GIL; argument handling holds it), a new output array per call as users
  call it.

Threads: ``callers`` threads issue lookups concurrently, each lookup using up
to ``engine`` threads of the engine's pool (``embedcore_set_num_threads`` /
``ec.set_num_threads``): (1, 1), (2, 1) and (1, 2). Both warm up first with one
lookup of every row (page faults of the mapping and the lazy checksums), then
take turns: each (contender, configuration) runs ``--seconds`` per round,
``--repeats`` rounds, alternating. Reported: calls per second (median of the
rounds) and M ids/s, the latency of one call (p50 / p99 over every call of
every round), and ``other load``: the cores that processes other than the
benchmark kept busy meanwhile (the noise on a shared machine). Both
contenders' outputs are compared bit for bit before timing.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Dict, List

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import _common as C  # noqa: E402  (W1's definition, machine info, load monitor)

CONFIGS = [(1, 1), (2, 1), (1, 2)]  # (caller threads, engine threads per lookup)
WINDOWS = [C.BATCH, 64, 1]          # bags per call
ENV = dict(os.environ, SKBUILD_EDITABLE_VERBOSE="0")


def build_worker(build: Path) -> Path:
    cmake_dir = subprocess.run([sys.executable, "-m", "embedcore", "--cmake-dir"], capture_output=True, text=True,
                               env=ENV, check=True).stdout.strip().splitlines()[-1]
    cmake = shutil.which("cmake")
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    subprocess.run([cmake, "-S", str(HERE / "bench_c_serving"), "-B", str(build), *gen, f"-Dembedcore_DIR={cmake_dir}",
                    "-DCMAKE_BUILD_TYPE=Release"], check=True, stdout=subprocess.DEVNULL)
    subprocess.run([cmake, "--build", str(build)], check=True, stdout=subprocess.DEVNULL)
    return build / "bench_c_serving"


class CppWorker:
    def __init__(self, exe: Path):
        self.p = subprocess.Popen([str(exe)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)

    def call(self, line: str) -> dict:
        self.p.stdin.write(line + "\n")
        self.p.stdin.flush()
        reply = json.loads(self.p.stdout.readline())
        if "error" in reply:
            raise RuntimeError(f"bench_c_serving: {reply['error']}")
        return reply

    def close(self):
        try:
            self.p.stdin.write("quit\n")
            self.p.stdin.flush()
        except OSError:
            pass
        self.p.wait(timeout=30)


def windows(ids: np.ndarray, offsets: np.ndarray, bags: int):
    out = []
    for b0 in range(0, len(offsets) - 1 - bags + 1, bags):
        o = offsets[b0:b0 + bags + 1]
        out.append((ids[o[0]:o[-1]], (o - o[0]).astype(np.int64)))
    return out


def run_python(table, wins, callers: int, engine: int, seconds: float) -> dict:
    import embedcore as ec

    ec.set_num_threads(engine)
    stop = threading.Event()
    lat: List[List[float]] = [[] for _ in range(callers)]

    def work(c):
        mine = lat[c]
        i = c * 7
        pc = time.perf_counter
        while not stop.is_set():
            x, o = wins[i % len(wins)]
            t0 = pc()
            table.lookup(x, o, combiner="sum")
            mine.append(pc() - t0)
            i += 1

    threads = [threading.Thread(target=work, args=(c,)) for c in range(callers)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    all_us = np.concatenate([np.asarray(v) for v in lat]) * 1e6
    return {"calls": int(len(all_us)), "wall_s": wall, "mean_us": float(all_us.mean()),
            "p50_us": float(np.percentile(all_us, 50)), "p99_us": float(np.percentile(all_us, 99)), "lat": all_us}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 round of 0.5 s per configuration")
    ap.add_argument("--seconds", type=float, default=None, help="seconds per contender, configuration and round (1)")
    ap.add_argument("--repeats", type=int, default=None, help="rounds (3)")
    ap.add_argument("--json", default=None, help="write every figure here")
    args = ap.parse_args()
    seconds = args.seconds or (0.5 if args.quick else 1.0)
    repeats = args.repeats or (1 if args.quick else 3)

    import embedcore as ec

    scratch = Path(C.scratch_dir())
    try:
        C.log(f"saving W1's table ({C.ROWS:,} x {C.DIM} float32) into {scratch} ...")
        table = ec.Table(name="w1", rows=C.ROWS, dim=C.DIM, initializer=ec.initializers.Uniform(-0.05, 0.05, seed=0),
                         combiner="sum")
        ckpt = scratch / "w1"
        ec.save(ckpt, table, include_optimizer=False)
        del table
        ids, offsets = C.uniform_ids(), C.offsets()
        (scratch / "ids.bin").write_bytes(ids.astype("<i8").tobytes())
        (scratch / "offsets.bin").write_bytes(offsets.astype("<i8").tobytes())

        C.log("building the C++ worker against the installed package ...")
        exe = build_worker(Path(__file__).resolve().parents[1] / "build" / "bench_c_serving")
        worker = CppWorker(exe)
        try:
            info = worker.call(f"open {ckpt} w1 {scratch / 'ids.bin'} {scratch / 'offsets.bin'}")
            srv = ec.serving.open(ckpt)
            served = srv.tables["w1"]
            C.log("warming up (a lookup of every row, in both) and checking the outputs ...")
            worker.call("warm")
            all_ids = np.arange(C.ROWS, dtype=np.int64)
            served.lookup(all_ids, np.append(np.arange(0, C.ROWS, 1000), C.ROWS).astype(np.int64), combiner="sum")
            worker.call(f"dump {scratch / 'cpp.bin'}")
            want = served.lookup(ids, offsets, combiner="sum")
            same = (scratch / "cpp.bin").read_bytes() == want.tobytes()
            if not same:
                C.log("ERROR: C++ and Python lookups differ")
                return 1

            wins = {b: windows(ids, offsets, b) for b in WINDOWS}
            samples: Dict[tuple, Dict[str, list]] = {}
            for r in range(repeats):
                for bags in WINDOWS:
                    for callers, engine in CONFIGS:
                        key = (bags, callers, engine)
                        order = ("c++", "python") if r % 2 == 0 else ("python", "c++")
                        for who in order:
                            mon = C.CpuMonitor([worker.p.pid]).start()
                            if who == "c++":
                                res = worker.call(f"run {callers} {engine} {bags} {seconds}")
                            else:
                                res = run_python(served, wins[bags], callers, engine, seconds)
                            res["other_cores"] = mon.stop()["other_cores"]
                            samples.setdefault(key, {}).setdefault(who, []).append(res)
                C.log(f"round {r + 1}/{repeats} done")
        finally:
            worker.close()

        rows = []
        for (bags, callers, engine), by in samples.items():
            row = {"bags/call": bags, "callers": callers, "engine": engine}
            for who in ("c++", "python"):
                runs = by[who]
                rate = statistics.median(x["calls"] / x["wall_s"] for x in runs)
                row[f"{who} calls/s"] = rate
                row[f"{who} Mids/s"] = rate * bags * C.BAG / 1e6
                row[f"{who} p50"] = statistics.median(x["p50_us"] for x in runs)
                row[f"{who} p99"] = max(x["p99_us"] for x in runs)
                row[f"{who} load"] = max(x["other_cores"] for x in runs)
            row["c++/python"] = row["c++ calls/s"] / row["python calls/s"]
            rows.append(row)
        cols = [("bags/call", "bags/call", None), ("callers", "callers", None), ("engine", "engine thr", None),
                ("c++ calls/s", "C++ calls/s", "{:,.0f}"), ("python calls/s", "Py calls/s", "{:,.0f}"),
                ("c++/python", "C++/Py", "{:.2f}x"), ("c++ Mids/s", "C++ Mids/s", "{:.1f}"),
                ("python Mids/s", "Py Mids/s", "{:.1f}"), ("c++ p50", "C++ p50 us", "{:,.1f}"),
                ("c++ p99", "C++ p99 us", "{:,.1f}"), ("python p50", "Py p50 us", "{:,.1f}"),
                ("python p99", "Py p99 us", "{:,.1f}"), ("c++ load", "load C++", "{:.2f}"),
                ("python load", "load Py", "{:.2f}")]
        print(f"\nW1 table ({C.ROWS:,} x {C.DIM} float32, mmap), {C.BATCH} bags x {C.BAG} uniform ids, sum; "
              f"{seconds} s x {repeats} round(s) per cell; libembedcore {info['version']}")
        print("calls/s: median over rounds; p99: worst round; load: cores other processes kept busy (noise)\n")
        print(C.format_table(rows, cols))
        if args.json:
            for by in samples.values():
                for runs in by.values():
                    for x in runs:
                        x.pop("lat", None)
            C.write_json(args.json, {"machine": C.machine_info(), "versions": C.versions(), "seconds": seconds,
                                     "repeats": repeats, "outputs_identical": same, "rows": rows,
                                     "samples": {f"{k[0]}x{k[1]}x{k[2]}": v for k, v in samples.items()}})
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
