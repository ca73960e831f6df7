"""Sequence (unpooled) lookups of W1's ids: one row per id, as sequence
features and ``nn.Embedding`` need them.

W1's table (1,000,000 x 128 float32) and its 4,096 x 32 ids, looked up
without pooling into a [4096, 32, 128] float32 output (64 MiB), by:

- ``ec_dense``: ``Table.lookup(ids2d, combiner=None)`` (a [4096, 32] array);
- ``ec_dense_out``: the same into a preallocated ``out=`` (no allocation);
- ``ec_coo``: the same bags as ``ec.Sparse`` (COO, positions 0..31 in every
  bag: a padded batch's SparseTensor);
- ``ec_coo_repeats``: ``ec.Sparse`` whose positions are shifted by one, so
  that the last two ids of every bag share a position and add up;
- ``torch``: ``torch.nn.functional.embedding(ids2d, w)`` on the same weights;
- ``numpy``: ``np.take(w, ids2d, axis=0)``;
- ``tf``: ``tf.nn.embedding_lookup`` inside ``tf.function`` (where installed,
  in this process: TensorFlow's threads follow ``--threads``).

One thread (embedcore, PyTorch, TensorFlow). Contenders run interleaved (see
_common.run_rounds); each output is checked against NumPy's first.

    python benchmarks/bench_sequence.py [--repeats N] [--json PATH] [--no-tf]
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=10, help="timed rounds (default 10)")
    ap.add_argument("--json", metavar="PATH", help="write every sample and figure as JSON")
    ap.add_argument("--no-tf", action="store_true", help="leave TensorFlow out")
    args = ap.parse_args()

    tf = None
    if not args.no_tf and C.tf_available():
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(1)
        tf.config.threading.set_inter_op_parallelism_threads(1)
    import torch

    import embedcore as ec

    C.set_threads(1)
    C.log("building the table and ids ...")
    t = ec.Table(name="w1", rows=C.ROWS, dim=C.DIM)
    w = np.array(t.values())
    wt = torch.from_numpy(w)
    results = []
    for dist in C.DISTS:
        ids2d = C.make_ids(dist).reshape(C.BATCH, C.BAG)
        ids2d_t = torch.from_numpy(ids2d)
        coo = np.stack([np.repeat(np.arange(C.BATCH), C.BAG), np.tile(np.arange(C.BAG), C.BATCH)], 1)
        shifted = coo.copy()
        shifted[:, 1] = np.minimum(shifted[:, 1] + 1, C.BAG - 1)
        dense_sp = ec.Sparse(coo, ids2d.reshape(-1), [C.BATCH, C.BAG])
        repeats_sp = ec.Sparse(shifted, ids2d.reshape(-1), [C.BATCH, C.BAG])
        out = np.empty((C.BATCH, C.BAG, C.DIM), np.float32)
        cont = {
            "ec_dense": lambda: t.lookup(ids2d, combiner=None),
            "ec_dense_out": lambda: t.lookup(ids2d, combiner=None, out=out),
            "ec_coo": lambda: t.lookup(dense_sp, combiner=None),
            "ec_coo_repeats": lambda: t.lookup(repeats_sp, combiner=None),
            "torch": lambda: torch.nn.functional.embedding(ids2d_t, wt),
            "numpy": lambda: np.take(w, ids2d, axis=0),
        }
        if tf is not None:
            var = tf.Variable(w)
            ids_tf = tf.constant(ids2d)
            fn = tf.function(lambda x: tf.nn.embedding_lookup(var, x))
            cont["tf"] = lambda: fn(ids_tf).numpy()

        C.log(f"{dist}: checking outputs against NumPy ...")
        ref = np.take(w, ids2d, axis=0)
        ref_rep = ref.copy()
        ref_rep[:, 1:] = ref[:, :-1]
        ref_rep[:, 0] = 0
        ref_rep[:, -1] = ref[:, -2] + ref[:, -1]
        for name, f in cont.items():
            got = np.asarray(f())
            want = ref_rep if name == "ec_coo_repeats" else ref
            diff = float(np.abs(got - want).max())
            if not diff <= 1e-6:
                raise SystemExit(f"FAILED: {name} differs from NumPy by {diff:.3e} on {dist} ids")
        C.log(f"{dist}: timing {args.repeats} rounds ...")
        timing = C.run_rounds(cont, args.repeats, warmup=1)
        for name in cont:
            st = C.summarize(timing.samples[name])
            results.append({"dist": dist, "contender": name, "ms": st["median_s"] * 1e3,
                            "p25": st["p25_s"] * 1e3, "p75": st["p75_s"] * 1e3,
                            "vs_torch": None, "samples_s": timing.samples[name]})
        torch_ms = next(r["ms"] for r in results if r["dist"] == dist and r["contender"] == "torch")
        for r in results:
            if r["dist"] == dist:
                r["vs_torch"] = torch_ms / r["ms"]

    print("\nSequence lookups of W1's ids, [4096, 32, 128] float32 out, 1 thread; medians of interleaved rounds")
    print(C.format_table(results, [("dist", "ids", None), ("contender", "contender", None), ("ms", "ms", "{:.2f}"),
                                   ("p25", "p25", "{:.2f}"), ("p75", "p75", "{:.2f}"),
                                   ("vs_torch", "rate / torch", "{:.2f}x")]))
    if args.json:
        C.write_json(args.json, {"machine": C.machine_info(), "versions": C.versions(), "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
