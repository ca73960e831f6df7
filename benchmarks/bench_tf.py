"""Workload W1 inside tf.function: the TensorFlow adapter's
EmbeddingForServing against TensorFlow's own TPUEmbeddingForServing, in the
same process, on the same table and inputs.

One 1,000,000 x 128 float32 table, 4,096 bags of 32 ids, sum combiner; ids
uniform, or Zipf(1.05) over the whole vocabulary (ranks mapped to ids by a
fixed permutation, no clipping; see _common.zipf_ids). Each lookup is one
call of a tf.function whose output is fetched with .numpy(), for two input
forms of the same bags:

- ragged: a tf.RaggedTensor (row_splits);
- sparse: a tf.SparseTensor through the default safe path
  (validate_weights_and_indices=True: pruning, empty-bag handling).

Both run the adapter's kernels (EmbedcoreRaggedLookup, EmbedcoreSparseLookup);
the same adapter traced with EMBEDCORE_TF_OP=off (its tf.numpy_function path,
"adapter, no kernel") runs beside them.

Before timing, the adapter's output must equal TensorFlow's bit for bit.
TensorFlow's thread counts must be set before it initializes, so each thread
count runs in its own worker process (TensorFlow intra-/inter-op threads = n,
embedcore.set_num_threads(n)); inside a worker the four contenders of a
distribution run interleaved (one call each per round, rotating order, after
a warm-up), and figures are medians over rounds.

    python benchmarks/bench_tf.py [--quick] [--threads 1,2] [--repeats N] [--json PATH]

Target: the adapter at >= 4x TensorFlow's throughput at the same thread count.
About 1-2 minutes on a 2-core machine and ~3 GB of memory.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

TARGET = 4.0  # adapter rate / TensorFlow rate, at least
FORMS = ("ragged", "sparse")


def worker(threads: int, repeats: int, warmup: int) -> dict:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import numpy as np
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(threads)
    import embedcore as ec
    from embedcore.adapters.tf import EmbeddingForServing

    ec.set_num_threads(threads)
    E = tf.tpu.experimental.embedding
    table = E.TableConfig(vocabulary_size=C.ROWS, dim=C.DIM, combiner="sum", name="w1",
                          initializer=tf.zeros_initializer())
    feature_config = {"f": E.FeatureConfig(table)}
    ours = EmbeddingForServing(feature_config)
    theirs = E.TPUEmbeddingForServing(feature_config, None)
    ours.build()
    theirs.build()
    values = np.random.default_rng(0).random((C.ROWS, C.DIM), dtype=np.float32) - np.float32(0.5)
    ours.embedding_tables[table].assign(values)
    theirs.embedding_tables[table].assign(values)
    del values

    @tf.function
    def lookup_ours(x):
        return ours({"f": x})["f"]

    @tf.function
    def lookup_tf(x):
        return theirs({"f": x})["f"]

    # The adapter without its kernels (EMBEDCORE_TF_OP=off while it traces): the tf.numpy_function path,
    # to show what the kernels save, in the same run.
    @tf.function
    def lookup_callback(x):
        return ours({"f": x})["f"]

    def trace_callback(x):
        before = os.environ.get("EMBEDCORE_TF_OP")
        os.environ["EMBEDCORE_TF_OP"] = "off"
        try:
            return lookup_callback(x).numpy()
        finally:
            if before is None:
                del os.environ["EMBEDCORE_TF_OP"]
            else:
                os.environ["EMBEDCORE_TF_OP"] = before

    offsets = C.offsets()
    index = np.stack([np.repeat(np.arange(C.BATCH), C.BAG), np.tile(np.arange(C.BAG), C.BATCH)], 1).astype(np.int64)
    result = {"threads": threads, "groups": [], "checks": {}}
    for dist in C.DISTS:
        ids = C.make_ids(dist)
        inputs = {"ragged": tf.RaggedTensor.from_row_splits(tf.constant(ids), tf.constant(offsets)),
                  "sparse": tf.SparseTensor(tf.constant(index), tf.constant(ids), [C.BATCH, C.BAG])}
        contenders = {}
        for form, x in inputs.items():
            a, b = lookup_ours(x).numpy(), lookup_tf(x).numpy()
            result["checks"][f"{form}/{dist}"] = {"equal": bool(np.array_equal(a, b)),
                                                  "max_abs_diff": float(np.abs(a - b).max())}
            contenders[f"adapter/{form}"] = (lambda x=x: lookup_ours(x).numpy())
            contenders[f"tf/{form}"] = (lambda x=x: lookup_tf(x).numpy())
            kernel = {"sparse": "EmbedcoreSparseLookup", "ragged": "EmbedcoreRaggedLookup"}[form]
            result.setdefault("kernel", {})[form] = any(
                op.type == kernel for op in lookup_ours.get_concrete_function(x).graph.get_operations())
            result["checks"][f"callback/{form}/{dist}"] = {"equal": bool(np.array_equal(trace_callback(x), b))}
            contenders[f"adapter_callback/{form}"] = (lambda x=x: lookup_callback(x).numpy())
        mon = C.CpuMonitor().start()
        samples = C.run_interleaved(contenders, repeats, warmup)
        load = mon.stop()
        result["groups"].append({"dist": dist, "ids": C.describe_ids(ids), "load": load,
                                 "samples": samples, "summary": {k: C.summarize(v) for k, v in samples.items()}})
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer repeats (a smoke run)")
    ap.add_argument("--json", metavar="PATH", help="write every sample and figure as JSON")
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts (default 1,2)")
    ap.add_argument("--repeats", type=int, help="timed rounds per distribution (default 30, 8 with --quick)")
    ap.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--warmup", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    repeats = args.repeats or (8 if args.quick else 30)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    if args.worker is not None:
        res = worker(args.worker, repeats, warmup)
        sys.stdout.write("@@RESULT " + json.dumps(res) + "\n")
        return 0

    t0 = time.time()
    results = []
    for n in [int(x) for x in args.threads.split(",") if x]:
        C.log(f"[bench_tf] {n} thread(s): starting a worker")
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", str(n), "--repeats",
                               str(repeats), "--warmup", str(warmup)], capture_output=True, text=True)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("@@RESULT ")), None)
        if proc.returncode != 0 or line is None:
            sys.stderr.write(proc.stderr[-4000:])
            C.log(f"[bench_tf] worker for {n} thread(s) failed (exit {proc.returncode})")
            return 1
        results.append(json.loads(line[len("@@RESULT "):]))

    rows, verdicts, ok = [], [], True
    for r in results:
        for g in r["groups"]:
            s = g["summary"]
            for form in FORMS:
                ours, theirs = s[f"adapter/{form}"]["median_s"], s[f"tf/{form}"]["median_s"]
                check = r["checks"][f"{form}/{g['dist']}"]
                ok &= check["equal"]
                for who, med in (("adapter", ours), ("TPUEmbeddingForServing", theirs)):
                    q = s[f"{'adapter' if who == 'adapter' else 'tf'}/{form}"]
                    rows.append({"threads": r["threads"], "dist": g["dist"], "form": form, "who": who,
                                 "ms": med * 1e3, "p25": q["p25_s"] * 1e3, "p75": q["p75_s"] * 1e3,
                                 "mids": C.NNZ / med / 1e6, "load": g["load"]["other_cores"]})
                q = s[f"adapter_callback/{form}"]
                ok &= r["checks"][f"callback/{form}/{g['dist']}"]["equal"]
                rows.append({"threads": r["threads"], "dist": g["dist"], "form": form, "who": "adapter, no kernel",
                             "ms": q["median_s"] * 1e3, "p25": q["p25_s"] * 1e3, "p75": q["p75_s"] * 1e3,
                             "mids": C.NNZ / q["median_s"] / 1e6, "load": g["load"]["other_cores"]})
                speedup = theirs / ours
                verdicts.append({"threads": r["threads"], "dist": g["dist"], "form": form, "speedup": speedup,
                                 "equal": check["equal"], "verdict": C.verdict(speedup, TARGET)})
    print(f"W1 inside tf.function: {C.ROWS:,} x {C.DIM} float32, {C.BATCH} bags x {C.BAG} ids, sum; "
          f"{repeats} interleaved rounds, medians\n")
    print(C.format_table(rows, [("threads", "threads", None), ("dist", "ids", None), ("form", "input", None),
                                ("who", "contender", None), ("ms", "ms/batch", "{:.2f}"), ("p25", "p25", "{:.2f}"),
                                ("p75", "p75", "{:.2f}"), ("mids", "M ids/s", "{:.1f}"),
                                ("load", "other load (cores)", "{:.2f}")]))
    print(f"\nadapter throughput / TensorFlow's (target >= {TARGET:g}x); outputs equal bit for bit:\n")
    print(C.format_table(verdicts, [("threads", "threads", None), ("dist", "ids", None), ("form", "input", None),
                                    ("speedup", "speedup", "{:.2f}x"), ("equal", "equal", None),
                                    ("verdict", "verdict", None)]))
    missing = [(r["threads"], form) for r in results for form, used in r["kernel"].items() if not used]
    print("\nboth inputs ran the adapter's kernels (EmbedcoreSparseLookup, EmbedcoreRaggedLookup)" if not missing
          else f"\nthe adapter's kernels did NOT run for (threads, input) {missing} (EMBEDCORE_TF_OP, or no compiler)")
    print("'adapter, no kernel': the same adapter traced with EMBEDCORE_TF_OP=off (tf.numpy_function)")
    print(f"\ntotal {time.time() - t0:.0f} s")
    if args.json:
        C.write_json(args.json, {"workload": "W1", "machine": C.machine_info(), "versions": C.versions(),
                                 "repeats": repeats, "target": TARGET, "results": results, "verdicts": verdicts})
    if not ok:
        print("FAIL: the adapter's output differs from TensorFlow's", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
