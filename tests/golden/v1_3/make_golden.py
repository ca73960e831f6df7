"""Writes the golden checkpoint of format 1.3 (run once; the outputs are
committed and must load in every later version of embedcore, as the 1.0-1.2
ones in tests/golden/v1 and v1_2 do).

    python tests/golden/v1_3/make_golden.py [OUT_DIR]   # default: this directory

Writes, under OUT_DIR:
  rowwise_adagrad/   an Embedding of two tables trained with RowWiseAdagrad
                     and sharded row-wise over 2 ranks (format 1.3: optimizer
                     kind rowwise_adagrad, slot row_accumulators in files one
                     column wide, one per rank)
  expected.npz       every table's whole values, row accumulators ([rows, 1])
                     and step, assembled from the ranks' shards in the process
                     that trained them
  SHA256SUMS         of every file above (tests/python/test_golden.py checks them)

Deterministic: seeded initializers and fixed batches. Not regenerated later:
the files are what a 1.3 writer wrote.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import sys

import numpy as np

import embedcore as ec
import embedcore.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
# The npz writer (fixed timestamps) and SHA256SUMS of the v1 script.
_spec = importlib.util.spec_from_file_location("make_golden_v1", os.path.join(HERE, os.pardir, "v1", "make_golden.py"))
_v1 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_v1)
CHECKPOINTS = ["rowwise_adagrad"]
SHAPES = {"user": (13, 6), "item": (21, 4)}


def _config():
    user = ec.TableConfig("user", 13, 6, "float32", ec.initializers.Uniform(-0.5, 0.5, seed=51), combiner="sum")
    item = ec.TableConfig("item", 21, 4, "float32", ec.initializers.Uniform(-0.5, 0.5, seed=52), combiner="mean")
    return {"user": ec.FeatureConfig(user), "item": ec.FeatureConfig(item)}


def main(out=HERE):
    ec.set_num_threads(1)
    for name in CHECKPOINTS:
        shutil.rmtree(os.path.join(out, name), ignore_errors=True)
    path = os.path.join(out, "rowwise_adagrad")

    def rank_main(world):
        emb = ec.Embedding(_config(), ec.optimizers.RowWiseAdagrad(0.3, epsilon=1e-6, clipvalue=2.0), world=world,
                           sharding="row_wise")
        rng = np.random.default_rng(200 + world.rank)
        for _ in range(3):
            got = emb({"user": rng.integers(0, 13, 4).astype(np.int64),
                       "item": rng.integers(0, 21, (4, 2)).astype(np.int64)})
            emb.apply_gradients({k: rng.standard_normal(v.shape).astype(np.float32) for k, v in got.items()})
        ec.save(path, emb)
        return {name: [(s, np.array(t.to_numpy()), np.array(t.slots()["row_accumulators"]), t.step)
                       for s, t in shards] for name, shards in emb.local_shards.items()}

    expected = {}
    for part in dist.run_local(2, rank_main):
        for name, shards in part.items():
            rows, dim = SHAPES[name]
            values = expected.setdefault(f"rowwise_adagrad/{name}/values", np.full((rows, dim), np.nan, np.float32))
            acc = expected.setdefault(f"rowwise_adagrad/{name}/slot/row_accumulators",
                                      np.full((rows, 1), np.nan, np.float32))
            for s, v, a, step in shards:
                values[s.row_start:s.row_start + s.rows] = v
                acc[s.row_start:s.row_start + s.rows] = a
                expected[f"rowwise_adagrad/{name}/step"] = np.array(step, np.int64)
    for k, v in expected.items():
        assert not np.isnan(v).any(), k  # the shards tile each table

    _v1._save_npz(os.path.join(out, "expected.npz"), expected)
    with open(os.path.join(out, "SHA256SUMS"), "w") as f:
        for rel, digest in _v1.sha256sums(out, CHECKPOINTS):
            f.write(f"{digest}  {rel}\n")
    print(f"wrote {len(CHECKPOINTS)} golden checkpoint(s), expected.npz ({len(expected)} arrays) and SHA256SUMS to {out}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else HERE)
