"""Workload W1 forward lookup: embedcore against NumPy, PyTorch, FBGEMM,
TensorFlow and the bare C gather loop (the machine's random-row-gather limit).

One 1,000,000 x 128 float32 table, 4,096 bags of 32 ids, sum combiner;
uniform and Zipf(1.05) ids; 1 and 2 threads; plus embedcore with a float16
table, and embedcore given the same bags in COO form (ec.Sparse, as a rank-2
SparseTensor holds them; "COO/CSR" is its rate over the CSR input's). Every contender reads the same weights; outputs are checked against
NumPy's before timing. Contenders run interleaved (one call each per round,
rotating order); the figure is the median over the rounds in which other
processes left the machine quiet (all rounds, flagged, when too few were).

    python benchmarks/bench_lookup.py [--quick] [--json PATH] [--threads 1,2]

Reports ids/s, gathered GB/s (ids x 512 B, or x 256 B for float16) and the
ratios the issue sets targets for (PASS / FAIL).
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

TARGETS = {
    "limit": 1.15,       # embedcore time / gather-limit time at 1 thread, at most
    "torch": 1.0,        # embedcore rate / PyTorch rate, at least
    "fbgemm": 1.0,       # embedcore rate / FBGEMM rate, at least
    "tf": 5.0,           # embedcore rate / TensorFlow rate, at least
    "threads": 1.6,      # embedcore rate at 2 threads / at 1 thread, at least
    "fp16": 1.6,         # float16 table rate / float32 table rate, at least
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer repeats (a smoke run)")
    ap.add_argument("--json", metavar="PATH", help="write every sample and figure as JSON")
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts (default 1,2)")
    ap.add_argument("--repeats", type=int, help="timed rounds per configuration (default 30, 8 with --quick)")
    ap.add_argument("--max-seconds", type=float,
                    help="per configuration: keep adding rounds until REPEATS quiet ones (other processes using "
                         f"< {C.QUIET_CORES} cores) or this many seconds (default 30, 8 with --quick)")
    ap.add_argument("--no-tf", action="store_true", help="skip TensorFlow")
    args = ap.parse_args()
    repeats = args.repeats or (8 if args.quick else 30)
    max_seconds = args.max_seconds if args.max_seconds is not None else (8.0 if args.quick else 30.0)
    warmup = 1 if args.quick else 2
    thread_counts = [int(x) for x in args.threads.split(",") if x]
    t_start = time.time()

    logging.disable(logging.INFO)  # FBGEMM logs its arguments at INFO
    import torch
    import torch.nn.functional as F

    import embedcore as ec

    vers = C.versions()

    have_fbgemm = C.fbgemm_available()
    have_tf = not args.no_tf and C.tf_available()

    # ------------------------------------------------------------ data
    C.log("generating ids and tables ...")
    ids = {d: C.make_ids(d) for d in C.DISTS}
    off = C.offsets()
    ids_t = {d: torch.from_numpy(v) for d, v in ids.items()}
    off_t = torch.from_numpy(off)
    # The same bags in COO form (a rank-2 SparseTensor's (bag, position) indices), for embedcore_coo.
    coo = np.stack([np.repeat(np.arange(C.BATCH), C.BAG), np.tile(np.arange(C.BAG), C.BATCH)], 1).astype(np.int64)

    t32 = ec.Table(name="w1", rows=C.ROWS, dim=C.DIM, dtype="float32", combiner="sum",
                   optimizer=ec.optimizers.SGD(learning_rate=0.01))
    w, wt = C.shared_weights(t32.values())  # NumPy / PyTorch share this copy (on huge pages, as the tables)
    t16 = ec.Table(name="w1_fp16", rows=C.ROWS, dim=C.DIM, dtype="float16", combiner="sum",
                   optimizer=ec.optimizers.SGD(learning_rate=0.01))
    t16.assign(w)
    fb = None
    if have_fbgemm:
        fb = C.fbgemm_table(wt, "sgd", learning_rate=0.01)

    scratch = C.scratch_dir()
    cl = tfw = None
    try:
        wpath = os.path.join(scratch, "w.bin")
        w.tofile(wpath)
        id_paths = {}
        for d, v in ids.items():
            id_paths[d] = os.path.join(scratch, f"ids_{d}.bin")
            v.tofile(id_paths[d])
        C.log("compiling and starting the C gather loop ...")
        cl = C.CLoops(scratch, wpath, id_paths)

        # -------------------------------------------------------- correctness
        C.log("checking outputs against NumPy ...")
        w16 = w.astype(np.float16).astype(np.float32)
        correctness = {}
        out_buf = np.empty((C.BATCH, C.DIM), np.float32)  # embedcore_out's output, made once as the C loop's
        for d in C.DISTS:
            ref = np.add.reduceat(np.take(w, ids[d], axis=0), off[:-1], axis=0)
            ref16 = np.add.reduceat(np.take(w16, ids[d], axis=0), off[:-1], axis=0)
            got = {"embedcore": t32.lookup(ids[d], off), "embedcore_fp16": t16.lookup(ids[d], off),
                   "embedcore_coo": t32.lookup(ec.Sparse(coo, ids[d], [C.BATCH, C.BAG])),
                   "embedcore_out": t32.lookup(ids[d], off, out=out_buf).copy()}
            with torch.no_grad():
                got["torch"] = F.embedding_bag(ids_t[d], wt, off_t, mode="sum", include_last_offset=True).numpy()
                if fb is not None:
                    got["fbgemm"] = fb(ids_t[d], off_t).numpy()
            for m in (0, 1):
                got[f"c_{C.MODE_NAMES[m]}"] = cl.dump(d, m, os.path.join(scratch, "out.bin"))
            diffs = {k: float(np.abs(v - (ref16 if k == "embedcore_fp16" else ref)).max()) for k, v in got.items()}
            correctness[d] = diffs
            C.log(f"  {d}: max |diff| vs NumPy " + ", ".join(f"{k} {v:.2e}" for k, v in diffs.items()))
            for k, v in diffs.items():
                if not v <= 1e-4:
                    msg = f"{k} output differs from NumPy's by {v:.3e} (> 1e-4) on {d} ids"
                    if k.startswith("embedcore"):
                        raise SystemExit("FAILED: " + msg)
                    C.log("WARNING: " + msg)

        thp = {
            "embedcore_fp32": C.anon_huge_bytes(t32.values().__array_interface__["data"][0]),
            "embedcore_fp16": C.anon_huge_bytes(t16.values().__array_interface__["data"][0]),
            "numpy_torch_weights": C.anon_huge_bytes(w.__array_interface__["data"][0]),
            "fbgemm_weights": C.anon_huge_bytes(fb.split_embedding_weights()[0].data_ptr()) if fb is not None else None,
        }
        thp.update({f"c_{k}": v for k, v in cl.thp_bytes().items()})

        # -------------------------------------------------------- timing
        results = []
        noise = {}
        for nt in thread_counts:
            C.set_threads(nt)
            if have_tf:
                C.log(f"starting the TensorFlow worker ({nt} thread{'s' if nt > 1 else ''}) ...")
                tfw = C.TFWorker(nt, wpath, id_paths)
                if "tf" not in correctness.get(C.DISTS[0], {}):
                    for d in C.DISTS:
                        ref = np.add.reduceat(np.take(w, ids[d], axis=0), off[:-1], axis=0)
                        diff = float(np.abs(tfw.dump(d, os.path.join(scratch, "tf_out.npy")) - ref).max())
                        correctness[d]["tf"] = diff
                        C.log(f"  {d}: TensorFlow max |diff| vs NumPy {diff:.2e}")
                        if not diff <= 1e-4:
                            C.log(f"WARNING: TensorFlow output differs from NumPy's by {diff:.3e}")
            for d in C.DISTS:
                C.log(f"timing: {nt} thread(s), {d} ids, {repeats} rounds ...")
                i_np, i_t = ids[d], ids_t[d]

                def torch_fwd(i_t=i_t):
                    with torch.no_grad():
                        F.embedding_bag(i_t, wt, off_t, mode="sum", include_last_offset=True)

                def fbgemm_fwd(i_t=i_t):
                    with torch.no_grad():
                        fb(i_t, off_t)

                cont = {
                    "embedcore": lambda i=i_np: t32.lookup(i, off),
                    "embedcore_fp16": lambda i=i_np: t16.lookup(i, off),
                    "embedcore_coo": lambda i=i_np: t32.lookup(ec.Sparse(coo, i, [C.BATCH, C.BAG])),
                    "numpy": lambda i=i_np: np.add.reduceat(np.take(w, i, axis=0), off[:-1], axis=0),
                    "torch": torch_fwd,
                    "embedcore_out": lambda i=i_np: t32.lookup(i, off, out=out_buf),
                }
                if fb is not None:
                    cont["fbgemm"] = fbgemm_fwd
                if tfw is not None:
                    cont["tf"] = lambda d=d: tfw.run(d)
                for m, pf, isa in C.GATHER_VARIANTS:
                    cont[C.gather_variant_name(m, pf, isa)] = (
                        lambda d=d, m=m, pf=pf, isa=isa, nt=nt: cl.gather(d, m, nt, pf, isa))
                cont = _interleaved(cont)
                timing = C.run_rounds(cont, repeats, warmup,
                                      monitor_pids=[cl.pid] + ([tfw.pid] if tfw is not None else []),
                                      max_seconds=max_seconds)
                noise[(nt, d)] = timing.info()
                for name in cont:
                    s = timing.samples[name]
                    st = C.summarize(timing.kept_samples(name))
                    row_bytes = C.ROW_BYTES["float16" if name == "embedcore_fp16" else "float32"]
                    rate = C.NNZ / st["median_s"]
                    results.append({"threads": nt, "dist": d, "contender": name, **st,
                                    "ms": st["median_s"] * 1e3, "mids_per_s": rate / 1e6,
                                    "gb_per_s": rate * row_bytes / 1e9, "samples_s": s})
            if tfw is not None:
                tfw.close()
                tfw = None
    finally:
        if tfw is not None:
            tfw.close()
        if cl is not None:
            cl.close()
        import shutil

        shutil.rmtree(scratch, ignore_errors=True)

    # ------------------------------------------------------------ report
    def med(nt, d, name):
        for r in results:
            if r["threads"] == nt and r["dist"] == d and r["contender"] == name:
                return r["median_s"]
        return None

    def limit(nt, d, mode):
        v = [med(nt, d, C.gather_variant_name(m, pf, isa)) for m, pf, isa in C.GATHER_VARIANTS
             if C.MODE_NAMES[m] == mode]
        v = [x for x in v if x is not None]
        return min(v) if v else None

    def ratio(a, b):
        return None if a is None or b is None else a / b

    ratios, targets = [], []
    for nt in thread_counts:
        for d in C.DISTS:
            ecs = med(nt, d, "embedcore")
            r = {"threads": nt, "dist": d,
                 "vs_limit_thp": ratio(ecs, limit(nt, d, "thp")),
                 "vs_limit_malloc": ratio(ecs, limit(nt, d, "malloc")),
                 # Like for like: the C loop writes into an output made once, as embedcore_out does.
                 "out_vs_limit_thp": ratio(med(nt, d, "embedcore_out"), limit(nt, d, "thp")),
                 "vs_torch": ratio(med(nt, d, "torch"), ecs),
                 "vs_fbgemm": ratio(med(nt, d, "fbgemm"), ecs),
                 "vs_tf": ratio(med(nt, d, "tf"), ecs),
                 # What the machine allows against TensorFlow: the gather limit's rate / TF's.
                 "limit_vs_tf": ratio(med(nt, d, "tf"), limit(nt, d, "thp")),
                 "vs_numpy": ratio(med(nt, d, "numpy"), ecs),
                 "fp16_vs_fp32": ratio(ecs, med(nt, d, "embedcore_fp16")),
                 "coo_vs_csr": ratio(ecs, med(nt, d, "embedcore_coo"))}
            if 1 in thread_counts and nt != 1:
                r["ec_vs_1t"] = ratio(med(1, d, "embedcore"), ecs)
                r["fp16_vs_1t"] = ratio(med(1, d, "embedcore_fp16"), med(nt, d, "embedcore_fp16"))
                r["limit_thp_vs_1t"] = ratio(limit(1, d, "thp"), limit(nt, d, "thp"))
                r["torch_vs_1t"] = ratio(med(1, d, "torch"), med(nt, d, "torch"))
                r["fbgemm_vs_1t"] = ratio(med(1, d, "fbgemm"), med(nt, d, "fbgemm"))
            info = noise.get((nt, d), {})
            r["rounds"] = f"{info.get('quiet_rounds')}/{info.get('rounds')}"
            r["used"] = info.get("used")
            r["other_load"] = info.get("kept_other_cores")
            ratios.append(r)
            if nt == 1:
                targets += [
                    (f"1T {d}: embedcore time / gather limit (THP table)", r["vs_limit_thp"], TARGETS["limit"], False),
                    (f"1T {d}: embedcore / PyTorch rate", r["vs_torch"], TARGETS["torch"], True),
                    (f"1T {d}: embedcore / FBGEMM rate", r["vs_fbgemm"], TARGETS["fbgemm"], True),
                    (f"1T {d}: embedcore / TensorFlow rate", r["vs_tf"], TARGETS["tf"], True),
                ]
            if nt == 2 and 1 in thread_counts:
                targets.append((f"{d}: embedcore 2T / 1T rate", r["ec_vs_1t"], TARGETS["threads"], True))
            targets.append((f"{nt}T {d}: float16 / float32 table rate", r["fp16_vs_fp32"], TARGETS["fp16"], True))

    cols = [("threads", "thr", None), ("dist", "ids", None), ("contender", "contender", None),
            ("ms", "median ms", "{:.2f}"), ("mids_per_s", "M ids/s", "{:.2f}"), ("gb_per_s", "GB/s", "{:.2f}"),
            ("min_s", "min ms", None), ("spread", "p25-p75 ms", None)]
    rows = []
    for r in results:
        rows.append({**r, "min_s": f"{r['min_s'] * 1e3:.2f}", "spread": f"{r['p25_s'] * 1e3:.2f}-{r['p75_s'] * 1e3:.2f}"})
    print(f"\nW1 forward lookup: {C.ROWS:,} x {C.DIM} float32, {C.BATCH} bags x {C.BAG} ids, sum; "
          f"interleaved rounds (>= {repeats}), median of the quiet rounds (see 'rounds used' below)")
    print("c_<malloc|thp>_<O3|native>_pf<N>: bare C gather loop on a plain malloc or an mmap+MADV_HUGEPAGE table, "
          "built with `cc " + " ".join(C.C_FLAGS_BASE) + "` or `cc " + " ".join(C.C_FLAGS_NATIVE) + "`,\n"
          "software prefetch N ids ahead (0 = none); the gather limit is the fastest variant on that kind of table")
    print(C.format_table(rows, cols))

    rcols = [("threads", "thr", None), ("dist", "ids", None),
             ("vs_limit_thp", "ec/limit(THP) time", "{:.2f}x"), ("vs_limit_malloc", "ec/limit(malloc) time", "{:.2f}x"),
             ("out_vs_limit_thp", "ec out=/limit(THP) time", "{:.2f}x"),
             ("vs_torch", "ec vs torch", "{:.2f}x"), ("vs_fbgemm", "ec vs fbgemm", "{:.2f}x"),
             ("vs_tf", "ec vs TF", "{:.2f}x"), ("limit_vs_tf", "limit vs TF", "{:.2f}x"),
             ("vs_numpy", "ec vs numpy", "{:.2f}x"),
             ("fp16_vs_fp32", "fp16/fp32", "{:.2f}x"), ("coo_vs_csr", "COO/CSR", "{:.2f}x"), ("ec_vs_1t", "ec 2T/1T", "{:.2f}x"),
             ("fp16_vs_1t", "fp16 2T/1T", "{:.2f}x"), ("limit_thp_vs_1t", "limit 2T/1T", "{:.2f}x"),
             ("torch_vs_1t", "torch 2T/1T", "{:.2f}x"), ("fbgemm_vs_1t", "fbgemm 2T/1T", "{:.2f}x"),
             ("rounds", "quiet/all rounds", None), ("used", "rounds used", None),
             ("other_load", "other load (cores)", "{:.2f}")]
    print("\nRatios (rate ratios: > 1 means embedcore is faster; 'ec/limit' is a time ratio: 1.00 = at the limit;\n"
          "a round is quiet when other processes kept < " f"{C.QUIET_CORES}" " cores busy; medians use the quiet "
          "rounds when there are enough, else all;\n'other load': mean cores other processes kept busy in the rounds "
          "used, i.e. the noise left in the figures)")
    print(C.format_table(ratios, rcols))

    print("\nTargets")
    trows = [{"target": n, "value": v, "goal": ("<= " if not hib else ">= ") + f"{g:.2f}",
              "verdict": C.verdict(v, g, hib)} for n, v, g, hib in targets]
    print(C.format_table(trows, [("target", "target", None), ("value", "value", "{:.2f}"), ("goal", "goal", None),
                                 ("verdict", "", None)]))

    print("\nAnonHugePages of each table (MiB; 512 MiB fp32 table fully on huge pages = 512):")
    print("  " + ", ".join(f"{k} {'-' if v is None else f'{v / 2**20:.0f}'}" for k, v in thp.items()))
    for d in C.DISTS:
        info = C.describe_ids(ids[d])
        print(f"ids {d}: {info['unique']:,} unique of {info['nnz']:,} ({info['unique_fraction']:.1%}), "
              f"most frequent id x{info['max_count']:,}")
    C.print_footer(noise, vers, t_start)

    if args.json:
        C.write_json(args.json, {
            "benchmark": "lookup", "workload": "W1", "repeats": repeats, "warmup": warmup,
            "machine": C.machine_info(), "versions": vers, "c_flags": {"O3": C.C_FLAGS_BASE + C.C_FLAGS_COMMON,
                                                                           "native": C.C_FLAGS_NATIVE + C.C_FLAGS_COMMON},
            "ids": {d: C.describe_ids(ids[d]) for d in C.DISTS}, "correctness_max_abs_diff": correctness,
            "anon_huge_pages_bytes": thp, "results": results, "ratios": ratios,
            "rounds": {f"{nt}T_{d}": v for (nt, d), v in noise.items()},
            "targets": [{"name": n, "value": v, "goal": g, "higher_is_better": hib,
                         "verdict": C.verdict(v, g, hib)} for n, v, g, hib in targets]})
    return 0


def _interleaved(cont: dict) -> dict:
    """`cont` in a cyclic order where no contender follows another over the
    same memory: the C loops (alternately on their malloc and THP tables)
    between the others, the slowest C loops (no prefetch) first where there
    are more loops than others, and the others over the same memory spread
    apart. A contender that follows one over the same
    rows finds part of them cached beyond what its own priming call leaves
    (seen: a lookup into a preallocated output 30% faster right after a COO
    lookup of t32; the C loops' limit 1.6-1.8 ms a Zipf batch after the
    other C loops over its table, 2.3-2.7 ms otherwise), and the rotation
    keeps each one's neighbour in front of it."""
    # t32's lookups (embedcore, _coo, _out) apart, and NumPy apart from PyTorch (the same weights)
    spread = ["embedcore", "numpy", "embedcore_fp16", "embedcore_coo", "fbgemm", "torch", "embedcore_out", "tf"]
    ours = sorted((n for n in cont if not n.startswith("c_")),
                  key=lambda n: spread.index(n) if n in spread else len(spread))
    loops = [n for n in cont if n.startswith("c_")]
    lead = max(0, len(loops) - len(ours))
    order = loops[:lead]
    for k, n in enumerate(ours):
        order.append(n)
        if lead + k < len(loops):
            order.append(loops[lead + k])
    order += [n for n in loops[lead + len(ours):]]
    return {n: cont[n] for n in order}


if __name__ == "__main__":
    sys.exit(main())
