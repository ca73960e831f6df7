"""Workload W2 training step: W1's lookup plus one optimizer step (SGD, Adagrad).

embedcore (``lookup`` then ``apply_gradients`` with a fixed output gradient
[4096, 128]) against:

- PyTorch: ``nn.EmbeddingBag(mode="sum", sparse=True)`` + ``torch.optim.SGD``
  / ``torch.optim.Adagrad``: forward, backward of ``(out * g).sum()``, step;
- FBGEMM: the fused CPU training op (``EXACT_SGD`` / ``EXACT_ADAGRAD``):
  forward and ``out.backward(g)``, the optimizer running inside backward;
- bare C loops (compiled here): the gather plus an update of every occurrence
  (SGD, or Adagrad per occurrence), on a malloc and on an mmap+THP table,
  prefetching 8 ids ahead; and the update alone.

Uniform and Zipf(1.05) ids, 1 and 2 threads. One step of each contender is
checked against NumPy before timing (Adagrad accumulators start at 0.1 in
every contender, as in embedcore / TensorFlow; FBGEMM and PyTorch add an
epsilon of 1e-10 to sqrt(acc), a negligible difference). Contenders run
interleaved; figures are medians over the quiet rounds (see _common.run_rounds).

    python benchmarks/bench_train.py [--quick] [--json PATH] [--threads 1,2] [--grad random|ones]
"""
from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

LR = 0.01
ADAGRAD_INIT = 0.1
TARGETS = {"torch": 5.0, "fbgemm": 2.0}  # embedcore step rate / theirs, at least
OPTIMIZERS = ("sgd", "adagrad")


def reference_rows(w_rows, ids, g, opt):
    """The touched rows after one step from `w_rows` (rows of np.unique(ids))."""
    bag_of = np.repeat(np.arange(C.BATCH), C.BAG)
    order = np.argsort(ids, kind="stable")
    sorted_ids = ids[order]
    starts = np.flatnonzero(np.r_[True, sorted_ids[1:] != sorted_ids[:-1]])
    gsum = np.add.reduceat(g[bag_of[order]].astype(np.float64), starts, axis=0)
    if opt == "sgd":
        return (w_rows - LR * gsum).astype(np.float32)
    acc = ADAGRAD_INIT + gsum * gsum
    return (w_rows - LR * gsum / np.sqrt(acc)).astype(np.float32)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer repeats (a smoke run)")
    ap.add_argument("--json", metavar="PATH", help="write every sample and figure as JSON")
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts (default 1,2)")
    ap.add_argument("--repeats", type=int, help="timed rounds per configuration (default 10, 4 with --quick)")
    ap.add_argument("--grad", choices=("random", "ones"), default="random",
                    help="output gradient: standard normal (default) or ones")
    ap.add_argument("--optimizers", default="sgd,adagrad")
    ap.add_argument("--max-seconds", type=float,
                    help="per SGD configuration (x1.5 for Adagrad): keep adding rounds until REPEATS quiet ones "
                         f"(other processes using < {C.QUIET_CORES} cores) or this many seconds (default 20, 6 "
                         "with --quick)")
    args = ap.parse_args()
    repeats = args.repeats or (4 if args.quick else 10)
    # Per configuration: rounds go on until REPEATS quiet ones, or this long (Adagrad steps are slower).
    scale = args.max_seconds if args.max_seconds is not None else (6.0 if args.quick else 20.0)
    max_seconds = {"sgd": scale, "adagrad": 1.5 * scale}
    warmup = 1 if args.quick else 2
    thread_counts = [int(x) for x in args.threads.split(",") if x]
    optimizers = [o for o in args.optimizers.split(",") if o]
    t_start = time.time()

    logging.disable(logging.INFO)  # FBGEMM logs its arguments at INFO
    import torch

    import embedcore as ec

    vers = C.versions()

    have_fbgemm = C.fbgemm_available()

    C.log("generating ids, gradients and weights ...")
    ids = {d: C.make_ids(d) for d in C.DISTS}
    off = C.offsets()
    ids_t = {d: torch.from_numpy(v) for d, v in ids.items()}
    off_t = torch.from_numpy(off)
    if args.grad == "ones":
        g = np.ones((C.BATCH, C.DIM), np.float32)
    else:
        g = np.random.default_rng(7).standard_normal((C.BATCH, C.DIM), dtype=np.float32)
    g_t = torch.from_numpy(g)
    w = np.array(ec.Table(name="init", rows=C.ROWS, dim=C.DIM).values())  # embedcore's default initializer

    scratch = C.scratch_dir()
    cl = None
    results, parts, checks, noise = [], {}, {}, {}
    try:
        wpath = os.path.join(scratch, "w.bin")
        w.tofile(wpath)
        gpath = os.path.join(scratch, "g.bin")
        g.tofile(gpath)
        id_paths = {}
        for d, v in ids.items():
            id_paths[d] = os.path.join(scratch, f"ids_{d}.bin")
            v.tofile(id_paths[d])
        C.log("compiling and starting the C loops ...")
        cl = C.CLoops(scratch, wpath, id_paths, gpath)

        for opt in optimizers:
            C.log(f"[{opt}] building the tables ...")
            ec_opt = ec.optimizers.SGD(learning_rate=LR) if opt == "sgd" else \
                ec.optimizers.Adagrad(learning_rate=LR, initial_accumulator_value=ADAGRAD_INIT)
            et = ec.Table(name=f"w2_{opt}", rows=C.ROWS, dim=C.DIM, dtype="float32", combiner="sum", optimizer=ec_opt)
            et.assign(w)

            emb = torch.nn.EmbeddingBag.from_pretrained(torch.from_numpy(w).clone(), freeze=False, mode="sum",
                                                        sparse=True, include_last_offset=True)
            topt = torch.optim.SGD(emb.parameters(), lr=LR) if opt == "sgd" else \
                torch.optim.Adagrad(emb.parameters(), lr=LR, initial_accumulator_value=ADAGRAD_INIT)

            fb = None
            if have_fbgemm:
                fb = C.fbgemm_table(torch.from_numpy(w), opt, learning_rate=LR, eps=1e-10)
                if opt == "adagrad":
                    fb.split_optimizer_states()[0][0].fill_(ADAGRAD_INIT)

            ec_parts = []

            def ec_step(d):
                t0 = time.perf_counter()
                et.lookup(ids[d], off)
                t1 = time.perf_counter()
                et.apply_gradients(ids[d], off, g)
                ec_parts.append((t1 - t0, time.perf_counter() - t1))

            def torch_step(d):
                topt.zero_grad(set_to_none=True)
                out = emb(ids_t[d], off_t)
                (out * g_t).sum().backward()
                topt.step()

            def fbgemm_step(d):
                out = fb(ids_t[d], off_t)
                out.backward(g_t)

            # ---------------------------------------------------- correctness: one step on Zipf ids
            C.set_threads(thread_counts[0])
            d = "zipf"
            uniq = np.unique(ids[d])
            ref = reference_rows(w[uniq], ids[d], g, opt)
            ec_step(d)
            torch_step(d)
            got = {"embedcore": np.asarray(et.values())[uniq], "torch": emb.weight.detach().numpy()[uniq]}
            if fb is not None:
                fbgemm_step(d)
                got["fbgemm"] = fb.split_embedding_weights()[0].numpy()[uniq]
            tol = 1e-4
            checks[opt] = {}
            for k, v in got.items():
                diff = float(np.abs(v - ref).max())
                checks[opt][k] = diff
                C.log(f"  [{opt}] {k}: max |diff| vs NumPy after one step {diff:.2e}")
                if not diff <= tol:
                    msg = f"[{opt}] {k} differs from the NumPy reference by {diff:.3e} (> {tol})"
                    if k == "embedcore":
                        raise SystemExit("FAILED: " + msg)
                    C.log("WARNING: " + msg)
            ec_parts.clear()

            # ---------------------------------------------------- timing
            o = 0 if opt == "sgd" else 1
            for nt in thread_counts:
                C.set_threads(nt)
                for d in C.DISTS:
                    C.log(f"[{opt}] timing: {nt} thread(s), {d} ids, >= {repeats} rounds ...")
                    cont = {"embedcore": lambda d=d: ec_step(d), "torch": lambda d=d: torch_step(d)}
                    if fb is not None:
                        cont["fbgemm"] = lambda d=d: fbgemm_step(d)
                    cont["c_thp"] = lambda d=d, nt=nt: cl.step(d, 1, nt, 8, o, 1, LR)
                    cont["c_malloc"] = lambda d=d, nt=nt: cl.step(d, 0, nt, 8, o, 1, LR)
                    cont["c_thp_update_only"] = lambda d=d, nt=nt: cl.step(d, 1, nt, 8, o, 0, LR)
                    ec_parts.clear()
                    timing = C.run_rounds(cont, repeats, warmup, monitor_pids=[cl.pid],
                                          max_seconds=max_seconds[opt])
                    noise[(opt, nt, d)] = timing.info()
                    # After the warm-up rounds, two calls per round: the untimed priming call, then the timed one.
                    per_round = ec_parts[warmup + 1::2]
                    timed = [per_round[i] for i in timing.kept]
                    parts[(opt, nt, d)] = {"lookup_ms": statistics.median(p[0] for p in timed) * 1e3,
                                           "apply_ms": statistics.median(p[1] for p in timed) * 1e3,
                                           "lookup_s_per_round": [p[0] for p in per_round],
                                           "apply_s_per_round": [p[1] for p in per_round]}
                    for name in cont:
                        st = C.summarize(timing.kept_samples(name))
                        results.append({"optimizer": opt, "threads": nt, "dist": d, "contender": name, **st,
                                        "ms": st["median_s"] * 1e3, "samples_s": timing.samples[name]})
            del et, emb, topt, fb
    finally:
        if cl is not None:
            cl.close()
        shutil.rmtree(scratch, ignore_errors=True)

    # ------------------------------------------------------------ report
    def med(opt, nt, d, name):
        for r in results:
            if (r["optimizer"], r["threads"], r["dist"], r["contender"]) == (opt, nt, d, name):
                return r["median_s"]
        return None

    def ratio(a, b):
        return None if a is None or b is None else a / b

    rows, ratios, targets = [], [], []
    for r in results:
        row = {**r, "min": f"{r['min_s'] * 1e3:.1f}", "spread": f"{r['p25_s'] * 1e3:.1f}-{r['p75_s'] * 1e3:.1f}",
               "steps_per_s": 1.0 / r["median_s"], "mids_per_s": C.NNZ / r["median_s"] / 1e6}
        if r["contender"] == "embedcore":
            row.update(parts[(r["optimizer"], r["threads"], r["dist"])])
        rows.append(row)
    for opt in optimizers:
        for nt in thread_counts:
            for d in C.DISTS:
                ecs = med(opt, nt, d, "embedcore")
                limit = min(x for x in (med(opt, nt, d, "c_thp"), med(opt, nt, d, "c_malloc")) if x is not None)
                r = {"optimizer": opt, "threads": nt, "dist": d,
                     "vs_torch": ratio(med(opt, nt, d, "torch"), ecs),
                     "vs_fbgemm": ratio(med(opt, nt, d, "fbgemm"), ecs),
                     "vs_c": ratio(ecs, limit),
                     "apply_vs_c_update": ratio(parts[(opt, nt, d)]["apply_ms"] / 1e3,
                                                med(opt, nt, d, "c_thp_update_only")),
                     "rounds": f"{noise[(opt, nt, d)]['quiet_rounds']}/{noise[(opt, nt, d)]['rounds']}",
                     "used": noise[(opt, nt, d)]["used"],
                     "other_load": noise[(opt, nt, d)]["kept_other_cores"]}
                if nt != 1 and 1 in thread_counts:
                    r["ec_vs_1t"] = ratio(med(opt, 1, d, "embedcore"), ecs)
                    r["c_vs_1t"] = ratio(med(opt, 1, d, "c_thp"), med(opt, nt, d, "c_thp"))
                ratios.append(r)
                targets.append((f"{opt} {nt}T {d}: embedcore / PyTorch step rate", r["vs_torch"], TARGETS["torch"]))
                targets.append((f"{opt} {nt}T {d}: embedcore / FBGEMM step rate", r["vs_fbgemm"], TARGETS["fbgemm"]))

    print(f"\nW2 training step: W1 lookup + optimizer step, lr {LR}, gradient {args.grad} [4096, 128]; "
          f"interleaved rounds (>= {repeats}), median of the quiet rounds (see 'rounds used' below)")
    print("c_thp / c_malloc: bare C gather + per-occurrence update (prefetch 8 ahead), mmap+MADV_HUGEPAGE or "
          "malloc table; c_thp_update_only: the update alone (cc " + " ".join(C.C_FLAGS_NATIVE + C.C_FLAGS_COMMON) + ")")
    cols = [("optimizer", "opt", None), ("threads", "thr", None), ("dist", "ids", None),
            ("contender", "contender", None), ("ms", "ms/step", "{:.1f}"), ("min", "min ms", None),
            ("spread", "p25-p75 ms", None), ("mids_per_s", "M ids/s", "{:.2f}"),
            ("lookup_ms", "ec lookup ms", "{:.1f}"), ("apply_ms", "ec apply ms", "{:.1f}")]
    print(C.format_table(rows, cols))
    print("\nRatios (torch/ec, fbgemm/ec: step-time ratios, > 1 = embedcore faster; ec/C: embedcore step time over "
          "the bare C step; ec apply/C update: apply_gradients over the bare C update alone;\n"
          "a round is quiet when other processes kept < " f"{C.QUIET_CORES}" " cores busy; medians use the quiet "
          "rounds when there are enough, else all; 'other load': mean cores other processes kept busy in the rounds "
          "used)")
    rcols = [("optimizer", "opt", None), ("threads", "thr", None), ("dist", "ids", None),
             ("vs_torch", "torch/ec", "{:.2f}x"), ("vs_fbgemm", "fbgemm/ec", "{:.2f}x"), ("vs_c", "ec/C", "{:.2f}x"),
             ("apply_vs_c_update", "ec apply/C update", "{:.2f}x"), ("ec_vs_1t", "ec 2T/1T", "{:.2f}x"),
             ("c_vs_1t", "C 2T/1T", "{:.2f}x"), ("rounds", "quiet/all rounds", None), ("used", "rounds used", None),
             ("other_load", "other load (cores)", "{:.2f}")]
    print(C.format_table(ratios, rcols))
    print("\nTargets")
    trows = [{"target": n, "value": v, "goal": f">= {t:.1f}", "verdict": C.verdict(v, t)} for n, v, t in targets]
    print(C.format_table(trows, [("target", "target", None), ("value", "value", "{:.2f}"), ("goal", "goal", None),
                                 ("verdict", "", None)]))
    print("\nOne-step check, max |diff| vs NumPy: " + "; ".join(
        f"{o}: " + ", ".join(f"{k} {v:.1e}" for k, v in c.items()) for o, c in checks.items()))
    C.print_footer(noise, vers, t_start)

    if args.json:
        C.write_json(args.json, {
            "benchmark": "train", "workload": "W2", "repeats": repeats, "warmup": warmup, "lr": LR,
            "grad": args.grad, "machine": C.machine_info(), "versions": vers, "c_flags": C.C_FLAGS_NATIVE + C.C_FLAGS_COMMON,
            "ids": {d: C.describe_ids(ids[d]) for d in C.DISTS}, "check_max_abs_diff": checks,
            "results": results, "embedcore_parts_ms": {f"{o}_{nt}T_{d}": v for (o, nt, d), v in parts.items()},
            "ratios": ratios, "rounds": {f"{o}_{nt}T_{d}": v for (o, nt, d), v in noise.items()},
            "targets": [{"name": n, "value": v, "goal": t, "verdict": C.verdict(v, t)} for n, v, t in targets]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
