"""Workload W1 through the PyTorch adapter: ``embedcore.adapters.torch.EmbeddingBag``
against ``torch.nn.EmbeddingBag`` and FBGEMM's CPU table-batched embedding.

One 1,000,000 x 128 float32 table, 4,096 bags of 32 ids, sum; uniform and
Zipf(1.05) ids (whole vocabulary, ranks shuffled by a fixed permutation, no
clipping); 1 and 2 threads. Two measurements, each in one interleaved run of
every contender:

- forward alone (under ``torch.no_grad()``): the adapter's ``EmbeddingBag``,
  ``nn.EmbeddingBag``, FBGEMM's ``SplitTableBatchedEmbeddingBagsCodegen``;
- forward + backward + SGD update (lr 0.01, output gradient a fixed
  ``[4096, 128]`` standard normal): the adapter fused (``optimizer=
  ec.optimizers.SGD``: the update runs inside ``backward()``) and unfused
  (sparse ``weight.grad`` + ``torch.optim.SGD``); ``nn.EmbeddingBag(sparse=
  True)`` + ``torch.optim.SGD``; FBGEMM with ``EXACT_SGD`` fused into its
  backward.

``embedcore_table`` (the engine's ``Table.lookup`` / ``apply_gradients``
called directly) shows what the adapter adds. Every contender's forward is
checked against ``nn.EmbeddingBag``'s and one training step against a NumPy
reference before timing. Figures are medians over interleaved rounds; the
targets (forward at least as fast as both, training step at least 5x
``nn.EmbeddingBag`` and 2x FBGEMM) are printed with PASS / FAIL.

    python benchmarks/bench_torch.py [--quick] [--json PATH] [--threads 1,2] [--repeats N]
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

LR = 0.01
TARGETS = {"fwd_torch": 1.0, "fwd_fbgemm": 1.0, "train_torch": 5.0, "train_fbgemm": 2.0}


def reference_rows(w_rows, ids, g):
    """The touched rows (those of np.unique(ids)) after one SGD step."""
    bag_of = np.repeat(np.arange(C.BATCH), C.BAG)
    order = np.argsort(ids, kind="stable")
    sorted_ids = ids[order]
    starts = np.flatnonzero(np.r_[True, sorted_ids[1:] != sorted_ids[:-1]])
    gsum = np.add.reduceat(g[bag_of[order]].astype(np.float64), starts, axis=0)
    return (w_rows - LR * gsum).astype(np.float32)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer repeats (a smoke run)")
    ap.add_argument("--json", metavar="PATH", help="write every sample and figure as JSON")
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts (default 1,2)")
    ap.add_argument("--repeats", type=int, help="timed rounds per configuration (default 15, 5 with --quick)")
    args = ap.parse_args()
    repeats = args.repeats or (5 if args.quick else 15)
    warmup = 1 if args.quick else 2
    thread_counts = [int(x) for x in args.threads.split(",") if x]
    t_start = time.time()

    logging.disable(logging.INFO)  # FBGEMM logs its arguments at INFO
    import torch

    import embedcore as ec
    import embedcore.adapters.torch as et

    have_fbgemm = C.fbgemm_available()

    # ------------------------------------------------------------ data and modules
    C.log("generating ids, gradient and tables ...")
    ids_np = {d: C.make_ids(d) for d in C.DISTS}
    ids = {d: torch.from_numpy(v) for d, v in ids_np.items()}
    off = torch.from_numpy(C.offsets())
    g = torch.from_numpy(np.random.default_rng(7).standard_normal((C.BATCH, C.DIM), dtype=np.float32))

    fused = et.EmbeddingBag(C.ROWS, C.DIM, mode="sum", include_last_offset=True, name="w1_fused",
                            optimizer=ec.optimizers.SGD(learning_rate=LR))
    w = fused.weight.detach().clone()  # the engine's default-initialised values, shared by every contender
    unfused = et.EmbeddingBag.from_pretrained(w, freeze=False, mode="sum", include_last_offset=True, sparse=True,
                                              name="w1_unfused")
    unfused_opt = torch.optim.SGD(unfused.parameters(), lr=LR)
    ref = torch.nn.EmbeddingBag.from_pretrained(w.clone(), freeze=False, mode="sum", include_last_offset=True,
                                                sparse=True)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    table = fused.table
    fb = None
    if have_fbgemm:
        fb = C.fbgemm_table(w, "sgd", learning_rate=LR)

    def forward(d):
        return {
            "embedcore": lambda: fused(ids[d], off),
            "embedcore_table": lambda: table.lookup(ids_np[d], off.numpy()),
            "torch": lambda: ref(ids[d], off),
            **({"fbgemm": lambda: fb(ids[d], off)} if fb is not None else {}),
        }

    def train(d):
        def ec_fused():
            fused(ids[d], off).backward(g)

        def ec_unfused():
            unfused_opt.zero_grad(set_to_none=True)
            unfused(ids[d], off).backward(g)
            unfused_opt.step()

        def ec_table():
            table.lookup(ids_np[d], off.numpy())
            table.apply_gradients(ids_np[d], off.numpy(), g.numpy(), combiner="sum")

        def torch_step():
            ref_opt.zero_grad(set_to_none=True)
            ref(ids[d], off).backward(g)
            ref_opt.step()

        def fbgemm_step():
            fb(ids[d], off).backward(g)

        c = {"embedcore": ec_fused, "embedcore_unfused": ec_unfused, "embedcore_table": ec_table,
             "torch": torch_step}
        if fb is not None:
            c["fbgemm"] = fbgemm_step
        return c

    # ------------------------------------------------------------ correctness
    C.set_threads(thread_counts[0])
    checks = {}
    with torch.no_grad():
        for d in C.DISTS:
            want = ref(ids[d], off)
            for name, f in forward(d).items():
                got = torch.as_tensor(f())
                diff = float((got - want).abs().max())
                checks[f"forward {d} {name}"] = diff
                C.log(f"  forward, {d} ids: {name} max |diff| vs nn.EmbeddingBag {diff:.2e}")
                if not diff <= 1e-4:
                    msg = f"{name} forward differs from nn.EmbeddingBag by {diff:.3e} on {d} ids"
                    if name.startswith("embedcore"):
                        raise SystemExit("FAILED: " + msg)
                    C.log("WARNING: " + msg)
    d = "zipf"
    uniq = np.unique(ids_np[d])
    want = reference_rows(w.numpy()[uniq], ids_np[d], g.numpy())
    steps = train(d)
    for name in steps:
        if name == "embedcore_table":
            continue  # the same table as "embedcore"
        steps[name]()
        got = {"embedcore": fused.weight, "embedcore_unfused": unfused.weight, "torch": ref.weight,
               "fbgemm": fb.split_embedding_weights()[0] if fb is not None else None}[name]
        diff = float(np.abs(got.detach().numpy()[uniq] - want).max())
        checks[f"train {d} {name}"] = diff
        C.log(f"  one SGD step, {d} ids: {name} max |diff| vs NumPy {diff:.2e}")
        if not diff <= 1e-4:
            msg = f"{name} differs from the NumPy reference by {diff:.3e} after one step"
            if name.startswith("embedcore"):
                raise SystemExit("FAILED: " + msg)
            C.log("WARNING: " + msg)

    # ------------------------------------------------------------ timing
    results, noise = [], {}
    for phase, make in (("forward", forward), ("train", train)):
        for nt in thread_counts:
            C.set_threads(nt)
            for d in C.DISTS:
                C.log(f"timing {phase}: {nt} thread(s), {d} ids, {repeats} rounds ...")
                cont = make(d)
                if phase == "forward":
                    cont = {k: (lambda f=f: _no_grad(torch, f)) for k, f in cont.items()}
                mon = C.CpuMonitor().start()
                samples = C.run_interleaved(cont, repeats, warmup)
                noise[(phase, nt, d)] = mon.stop()
                for name, s in samples.items():
                    st = C.summarize(s)
                    results.append({"phase": phase, "threads": nt, "dist": d, "contender": name, **st,
                                    "ms": st["median_s"] * 1e3, "mids_per_s": C.NNZ / st["median_s"] / 1e6,
                                    "samples_s": s})

    # ------------------------------------------------------------ report
    def med(phase, nt, d, name):
        for r in results:
            if (r["phase"], r["threads"], r["dist"], r["contender"]) == (phase, nt, d, name):
                return r["median_s"]
        return None

    def ratio(a, b):
        return None if a is None or b is None else a / b

    rows = [{**r, "min": f"{r['min_s'] * 1e3:.1f}", "spread": f"{r['p25_s'] * 1e3:.1f}-{r['p75_s'] * 1e3:.1f}"}
            for r in results]
    print(f"\nW1 through the PyTorch adapter: {C.ROWS:,} x {C.DIM} float32, {C.BATCH} bags x {C.BAG} ids, sum; "
          f"train = forward + backward + SGD (lr {LR}); {repeats} interleaved rounds, median")
    cols = [("phase", "phase", None), ("threads", "thr", None), ("dist", "ids", None),
            ("contender", "contender", None), ("ms", "ms", "{:.2f}"), ("min", "min ms", None),
            ("spread", "p25-p75 ms", None), ("mids_per_s", "M ids/s", "{:.1f}")]
    print(C.format_table(rows, cols))

    ratios, targets = [], []
    for nt in thread_counts:
        for d in C.DISTS:
            r = {"threads": nt, "dist": d,
                 "fwd_vs_torch": ratio(med("forward", nt, d, "torch"), med("forward", nt, d, "embedcore")),
                 "fwd_vs_fbgemm": ratio(med("forward", nt, d, "fbgemm"), med("forward", nt, d, "embedcore")),
                 "fwd_adapter_overhead": ratio(med("forward", nt, d, "embedcore"),
                                               med("forward", nt, d, "embedcore_table")),
                 "train_vs_torch": ratio(med("train", nt, d, "torch"), med("train", nt, d, "embedcore")),
                 "train_vs_fbgemm": ratio(med("train", nt, d, "fbgemm"), med("train", nt, d, "embedcore")),
                 "train_adapter_overhead": ratio(med("train", nt, d, "embedcore"),
                                                 med("train", nt, d, "embedcore_table")),
                 "unfused_vs_torch": ratio(med("train", nt, d, "torch"), med("train", nt, d, "embedcore_unfused")),
                 "other_load": max(noise[(p, nt, d)]["other_cores"] for p in ("forward", "train"))}
            ratios.append(r)
            targets += [(f"{nt}T {d}: forward rate / nn.EmbeddingBag", r["fwd_vs_torch"], TARGETS["fwd_torch"]),
                        (f"{nt}T {d}: forward rate / FBGEMM", r["fwd_vs_fbgemm"], TARGETS["fwd_fbgemm"]),
                        (f"{nt}T {d}: fused train step rate / nn.EmbeddingBag + SGD", r["train_vs_torch"],
                         TARGETS["train_torch"]),
                        (f"{nt}T {d}: fused train step rate / FBGEMM EXACT_SGD", r["train_vs_fbgemm"],
                         TARGETS["train_fbgemm"])]
    print("\nRatios (rates: higher is faster for embedcore; overhead: adapter time / engine-direct time)")
    cols = [("threads", "thr", None), ("dist", "ids", None), ("fwd_vs_torch", "fwd/torch", "{:.2f}"),
            ("fwd_vs_fbgemm", "fwd/fbgemm", "{:.2f}"), ("fwd_adapter_overhead", "fwd overhead", "{:.3f}"),
            ("train_vs_torch", "train/torch", "{:.2f}"), ("train_vs_fbgemm", "train/fbgemm", "{:.2f}"),
            ("train_adapter_overhead", "train overhead", "{:.3f}"),
            ("unfused_vs_torch", "unfused/torch", "{:.2f}"), ("other_load", "other load (cores)", "{:.2f}")]
    print(C.format_table(ratios, cols))
    print("\nTargets")
    for label, value, target in targets:
        shown = "-" if value is None else f"{value:.2f}"
        print(f"  {C.verdict(value, target)}  {label}: {shown} (target >= {target})")
    print(f"\ntotal {time.time() - t_start:.0f} s")

    if args.json:
        C.write_json(args.json, {"workload": "W1 torch adapter", "lr": LR, "repeats": repeats, "machine":
                                 C.machine_info(), "versions": C.versions(), "checks": checks, "results": results,
                                 "ratios": ratios, "noise": {f"{k[0]} {k[1]}T {k[2]}": v for k, v in noise.items()},
                                 "targets": [{"what": a, "value": b, "target": c, "verdict": C.verdict(b, c)}
                                             for a, b, c in targets]})
    return 0


def _no_grad(torch, f):
    with torch.no_grad():
        f()


if __name__ == "__main__":
    sys.exit(main())
