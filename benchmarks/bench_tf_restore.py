#!/usr/bin/env python
"""Restoring a TensorFlow TPU-embedding checkpoint on CPU (workload W5): one
table of ``--rows`` x ``--dim`` float32 (default 2,000,000 x 64, 512 MB) with
Adagrad's ``accumulators`` slot, saved by ``tf.train.Checkpoint`` from a
``TPUEmbeddingForServing`` (values and slot assigned random numbers).

Contenders, each restoring the whole checkpoint (values and slot) in a fresh
process, warm (the files in the page cache: one untimed read first), in
rounds with a rotating order:
- tensorflow: ``tf.train.Checkpoint(embedding=TPUEmbeddingForServing).restore``
  (TensorFlow's own restore, into its variables) - the anchor;
- embedcore: ``load_tf_checkpoint`` into the adapter's ``EmbeddingForServing``
  (a checksum pass that also finds each tensor's range for the checks, then
  rows read straight from the data files into the table's memory in 32 MiB
  blocks);
- embedcore via RestoreV2: the same with the adapter's bundle reader off, so
  that every 32 MiB block is a ``RestoreV2`` slice (the adapter's reader
  before session 16, and still its path for tensors saved as slices).
Each contender's figure is the median time of the restore call alone (the
process's imports and the tables' allocation excluded) and its peak memory
above the allocated tables (the peak RSS during the call, ``VmHWM`` reset
by ``/proc/self/clear_refs`` just before it, minus the RSS then; before
session 33, ``ru_maxrss`` counted the tables' set-up too). Every restore's
values and slot are compared with the saved ones.

Usage: python benchmarks/bench_tf_restore.py [--rows N] [--dim D] [--repeats 3] [--scratch DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

CONTENDERS = ("tensorflow", "embedcore", "embedcore via RestoreV2")


def _config(rows: int, dim: int):
    import tensorflow as tf

    E = tf.tpu.experimental.embedding
    table = E.TableConfig(vocabulary_size=rows, dim=dim, name="t")
    return {"f": E.FeatureConfig(table)}, table, E.Adagrad(learning_rate=0.1)


def _expected(rows: int, dim: int):
    import numpy as np

    rng = np.random.default_rng(0)
    # Accumulators in (0.1, 1.1): Adagrad's are > 0 (a load refuses 0 under epsilon 0, which rng.random() gives
    # about once in 2**24 draws: a 2M x 64 table held some).
    return rng.standard_normal((rows, dim), np.float32), rng.random((rows, dim), np.float32) + np.float32(0.1)


def save(path: str, rows: int, dim: int) -> None:
    import tensorflow as tf

    config, table, opt = _config(rows, dim)
    emb = tf.tpu.experimental.embedding.TPUEmbeddingForServing(config, opt)
    emb.build()
    values, accumulators = _expected(rows, dim)
    emb.embedding_tables[table].assign(values)
    slots = [v for d in emb.variables.values() for k, v in d.items() if k == "accumulators"]
    slots[0].assign(accumulators)
    tf.train.Checkpoint(embedding=emb).write(path)


def restore(contender: str, path: str, rows: int, dim: int) -> dict:
    """One restore in this process; returns its time, peak extra memory and check."""
    import numpy as np
    import tensorflow as tf

    config, table, opt = _config(rows, dim)
    if contender == "tensorflow":
        emb = tf.tpu.experimental.embedding.TPUEmbeddingForServing(config, opt)
        emb.build()
        variables = emb.variables[table.name]
        for v in variables.values():
            v.assign(tf.zeros_like(v))  # touched: the tables' memory is not the restore's
        rss = _rss_and_reset_peak()
        t0 = time.perf_counter()
        tf.train.Checkpoint(embedding=emb).restore(path).expect_partial()
        seconds = time.perf_counter() - t0
        got = variables["parameters"].numpy(), variables["accumulators"].numpy()
    else:
        from embedcore.adapters.tf import EmbeddingForServing, _checkpoint, load_tf_checkpoint

        if contender == "embedcore via RestoreV2":
            def off(path):
                raise _checkpoint.BundleError("off")

            _checkpoint.Bundle = off  # TFCheckpoint then reads every block with RestoreV2
        emb = EmbeddingForServing(config, opt)
        emb.build()
        t = emb._embedcore_tables()[0]
        t.assign(np.zeros((rows, dim), np.float32))  # touched, as TensorFlow's
        t.assign_slot("accumulators", np.full((rows, dim), 0.1, np.float32))
        rss = _rss_and_reset_peak()
        t0 = time.perf_counter()
        load_tf_checkpoint(path, emb)
        seconds = time.perf_counter() - t0
        got = t.values(), t.slots()["accumulators"]
    peak = _peak() - rss
    values, accumulators = _expected(rows, dim)
    ok = bool(np.array_equal(got[0], values) and np.array_equal(got[1], accumulators))
    return {"seconds": seconds, "peak_extra_bytes": max(0, peak), "ok": ok}


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _rss_and_reset_peak() -> int:
    """The resident memory now, after resetting the process's peak to it
    where Linux allows (``/proc/self/clear_refs``): the tables' set-up
    (a 512 MB temporary filling the slot) is then not counted as the
    restore's."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    return _rss()


def _peak() -> int:
    """The process's peak resident memory: VmHWM (reset by clear_refs), else ru_maxrss."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=2_000_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--scratch", default=None)
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(restore(args.child[0], args.child[1], args.rows, args.dim)))
        return 0
    scratch = tempfile.mkdtemp(prefix="bench_tf_restore_", dir=args.scratch)
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "TF_ENABLE_ONEDNN_OPTS": "0"}
    try:
        path = os.path.join(scratch, "ckpt")
        subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); "
                        f"import bench_tf_restore as b; b.save({path!r}, {args.rows}, {args.dim})"],
                       check=True, env=env)
        for name in os.listdir(scratch):  # warm: in the page cache
            with open(os.path.join(scratch, name), "rb") as f:
                while f.read(64 << 20):
                    pass
        mb = args.rows * args.dim * 4 * 2 / 1e6
        print(f"W5: {args.rows} x {args.dim} float32 + Adagrad accumulators ({mb:.0f} MB), warm, "
              f"{args.repeats} rounds")
        results = {c: [] for c in CONTENDERS}
        for r in range(args.repeats):
            order = CONTENDERS[r % 3:] + CONTENDERS[:r % 3]
            for c in order:
                out = subprocess.run([sys.executable, __file__, "--rows", str(args.rows), "--dim", str(args.dim),
                                      "--child", c, path], env=env, capture_output=True, text=True)
                if out.returncode != 0:
                    raise SystemExit(f"{c}: the restore failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
                res = json.loads(out.stdout.strip().splitlines()[-1])
                if not res["ok"]:
                    raise SystemExit(f"{c}: restored values differ from the saved ones")
                results[c].append(res)
        anchor = statistics.median(x["seconds"] for x in results["tensorflow"])
        print(f"{'contender':26s} {'median s':>9s} {'vs tensorflow':>14s} {'peak extra MB':>14s}")
        for c in CONTENDERS:
            s = statistics.median(x["seconds"] for x in results[c])
            peak = max(x["peak_extra_bytes"] for x in results[c]) / 1e6
            print(f"{c:26s} {s:9.2f} {s / anchor:13.2f}x {peak:14.0f}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
