"""Writes the golden checkpoints of format 1.1 and 1.2 (run once; the outputs
are committed and must load in every later version of embedcore, as the
1.0 ones in tests/golden/v1 do).

    python tests/golden/v1_2/make_golden.py [OUT_DIR]   # default: this directory

Writes, under OUT_DIR:
  adagrad_epsilon/   a table with Adagrad's epsilon outside the square root
                     (format 1.1's optimizer.adagrad_epsilon)
  row_wise/          an Embedding of two tables sharded row-wise over 2 ranks
                     (format 1.2: shard files, one per rank and array)
  column_wise/       the same sharded column-wise (column bands: col_start, cols < dim)
  int_keys/          an Embedding whose feature config has int dict keys
                     (metadata.structure_items)
  expected.npz       every table's whole values, slots and step, assembled from
                     the ranks' shards in the process that trained them; and a
                     lookup of int_keys
  SHA256SUMS         of every file above (tests/python/test_golden.py checks them)

Deterministic: seeded initializers and fixed batches. Not regenerated later
(a later library writes its own format and numerics): the files are what a
1.2 writer wrote.
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
CHECKPOINTS = ["adagrad_epsilon", "row_wise", "column_wise", "int_keys"]


def _configs():
    user = ec.TableConfig("user", 13, 6, "float32", ec.initializers.Uniform(-0.5, 0.5, seed=31), combiner="sum")
    item = ec.TableConfig("item", 21, 4, "float32", ec.initializers.Uniform(-0.5, 0.5, seed=32), combiner="mean")
    return user, item


def _batch(rng):
    """A rank's batch: 4 bags of each feature."""
    return {"user": rng.integers(0, 13, 4).astype(np.int64),
            "item": rng.integers(0, 21, (4, 2)).astype(np.int64)}


def _sharded(out, plan):
    """Trains a 2-rank sharded Embedding for 3 steps, saves it to out/plan, and
    returns {table: {"values", "slot/<name>", "step"}} assembled from every rank's shards."""
    path = os.path.join(out, plan)

    def rank_main(world):
        user, item = _configs()
        emb = ec.Embedding({"user": ec.FeatureConfig(user), "item": ec.FeatureConfig(item)},
                             ec.optimizers.Adagrad(0.3, initial_accumulator_value=0.2), world=world, sharding=plan)
        rng = np.random.default_rng(100 + world.rank)
        for _ in range(3):
            got = emb(_batch(rng))
            emb.apply_gradients({k: rng.standard_normal(v.shape).astype(np.float32) for k, v in got.items()})
        ec.save(path, emb)
        return {name: [(s, np.array(t.to_numpy()), {k: np.array(v) for k, v in t.slots().items()}, t.step)
                       for s, t in shards] for name, shards in emb.local_shards.items()}

    tables = {}
    for part in dist.run_local(2, rank_main):
        for name, shards in part.items():
            for shard, values, slots, step in shards:
                full = tables.setdefault(name, {})
                rows = {"user": 13, "item": 21}[name]
                dim = {"user": 6, "item": 4}[name]
                block = (slice(shard.row_start, shard.row_start + shard.rows),
                         slice(shard.col_start, shard.col_start + shard.cols))
                full.setdefault("values", np.full((rows, dim), np.nan, np.float32))[block] = values
                for k, v in slots.items():
                    full.setdefault(f"slot/{k}", np.full((rows, dim), np.nan, np.float32))[block] = v
                full["step"] = np.array(step, np.int64)
    for name, full in tables.items():
        for k, v in full.items():
            assert not np.isnan(v).any(), (plan, name, k)  # the shards tile each table
    return tables


def int_key_inputs():
    """The fixed batch test_golden.py looks int_keys up with."""
    rng = np.random.default_rng(7)
    return {3: rng.integers(0, 13, 5).astype(np.int64), 1: [rng.integers(0, 21, (5, 2)).astype(np.int64)]}


def main(out=HERE):
    ec.set_num_threads(1)
    expected = {}
    for name in CHECKPOINTS:
        shutil.rmtree(os.path.join(out, name), ignore_errors=True)

    t = ec.Table(name="t", rows=11, dim=3, combiner="sum", initializer=ec.initializers.Uniform(-0.5, 0.5, seed=41),
                 optimizer=ec.optimizers.Adagrad(0.1, initial_accumulator_value=0.0, epsilon=1e-3))
    rng = np.random.default_rng(42)
    for _ in range(3):
        ids = rng.integers(0, 11, 8).astype(np.int64)
        t.apply_gradients(ids, np.arange(0, 9, 2, dtype=np.int64), rng.standard_normal((4, 3)).astype(np.float32))
    ec.save(os.path.join(out, "adagrad_epsilon"), t)
    expected["adagrad_epsilon/t/values"] = t.to_numpy()
    expected["adagrad_epsilon/t/slot/accumulators"] = np.array(t.slots()["accumulators"])
    expected["adagrad_epsilon/t/step"] = np.array(t.step, np.int64)

    for plan in ("row_wise", "column_wise"):
        for name, full in _sharded(out, plan).items():
            for k, v in full.items():
                expected[f"{plan}/{name}/{k}"] = v

    user, item = _configs()
    emb = ec.Embedding({3: ec.FeatureConfig(user), 1: [ec.FeatureConfig(item)]}, ec.optimizers.SGD(0.2))
    inputs = int_key_inputs()
    got = emb(inputs)
    emb.apply_gradients({3: np.ones_like(got[3]), 1: [np.ones_like(got[1][0])]})
    ec.save(os.path.join(out, "int_keys"), emb)
    got = emb(inputs)
    expected["int_keys/lookup/3"] = got[3]
    expected["int_keys/lookup/1/0"] = got[1][0]
    for k, v in inputs.items():
        expected[f"int_keys/inputs/{k}"] = v if k == 3 else v[0]

    _v1._save_npz(os.path.join(out, "expected.npz"), expected)
    with open(os.path.join(out, "SHA256SUMS"), "w") as f:
        for rel, digest in _v1.sha256sums(out, CHECKPOINTS):
            f.write(f"{digest}  {rel}\n")
    print(f"wrote {len(CHECKPOINTS)} golden checkpoints, expected.npz ({len(expected)} arrays) and SHA256SUMS to {out}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else HERE)
