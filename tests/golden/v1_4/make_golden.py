"""Writes the golden checkpoint of format 1.4 (run once; the outputs are
committed and must load in every later version of embedcore, as the earlier
ones in tests/golden/v1, v1_2 and v1_3 do).

    python tests/golden/v1_4/make_golden.py [OUT_DIR]   # default: this directory

Writes, under OUT_DIR:
  uint8_rowwise/     an Embedding of two tables (float32, sum; float16, mean)
                     trained with Adagrad and sharded row-wise over 2 ranks,
                     saved with values_dtype="uint8_rowwise" (format 1.4: data
                     file dtype 3, rows of codes, float32 scale and bias) and
                     its optimizer state (float32 slots)
  expected.npz       every table's trained values (float32, as the table held
                     them), FBGEMM's quantized rows of them
                     (torch.ops.fbgemm.FloatToFused8BitRowwiseQuantized: what
                     the files must hold) and their dequantization
                     (Fused8BitRowwiseQuantizedToFloat), the accumulators and
                     the step
  SHA256SUMS         of every file above (tests/python/test_golden.py checks them)

Needs torch and fbgemm_gpu. Deterministic: seeded initializers and fixed
batches. Not regenerated later: the files are what a 1.4 writer wrote.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import sys

import numpy as np
import torch
import fbgemm_gpu  # noqa: F401 - registers torch.ops.fbgemm

import embedcore as ec
import embedcore.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location("make_golden_v1", os.path.join(HERE, os.pardir, "v1", "make_golden.py"))
_v1 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_v1)
CHECKPOINTS = ["uint8_rowwise"]
SHAPES = {"user": (13, 6), "item": (21, 5)}


def _config():
    user = ec.TableConfig("user", 13, 6, "float32", ec.initializers.Uniform(-0.5, 0.5, seed=61), combiner="sum")
    item = ec.TableConfig("item", 21, 5, "float16", ec.initializers.Uniform(-2.0, 3.0, seed=62), combiner="mean")
    return {"user": ec.FeatureConfig(user), "item": ec.FeatureConfig(item)}


def main(out=HERE):
    ec.set_num_threads(1)
    for name in CHECKPOINTS:
        shutil.rmtree(os.path.join(out, name), ignore_errors=True)
    path = os.path.join(out, "uint8_rowwise")

    def rank_main(world):
        emb = ec.Embedding(_config(), ec.optimizers.Adagrad(0.3), world=world, sharding="row_wise")
        rng = np.random.default_rng(300 + world.rank)
        for _ in range(3):
            got = emb({"user": rng.integers(0, 13, 4).astype(np.int64),
                       "item": rng.integers(0, 21, (4, 2)).astype(np.int64)})
            emb.apply_gradients({k: rng.standard_normal(v.shape).astype(np.float32) for k, v in got.items()})
        ec.save(path, emb, values_dtype="uint8_rowwise")
        return {name: [(s, np.array(t.to_numpy(), np.float32), np.array(t.slots()["accumulators"]), t.step)
                       for s, t in shards] for name, shards in emb.local_shards.items()}

    expected = {}
    for part in dist.run_local(2, rank_main):
        for name, shards in part.items():
            rows, dim = SHAPES[name]
            values = expected.setdefault(f"uint8_rowwise/{name}/values", np.full((rows, dim), np.nan, np.float32))
            acc = expected.setdefault(f"uint8_rowwise/{name}/slot/accumulators", np.full((rows, dim), np.nan,
                                                                                        np.float32))
            for s, v, a, step in shards:
                values[s.row_start:s.row_start + s.rows] = v
                acc[s.row_start:s.row_start + s.rows] = a
                expected[f"uint8_rowwise/{name}/step"] = np.array(step, np.int64)
    for name in SHAPES:
        values = expected[f"uint8_rowwise/{name}/values"]
        assert not np.isnan(values).any(), name  # the shards tile each table
        quantized = torch.ops.fbgemm.FloatToFused8BitRowwiseQuantized(torch.from_numpy(values))
        expected[f"uint8_rowwise/{name}/fbgemm_rows"] = quantized.numpy()
        expected[f"uint8_rowwise/{name}/fbgemm_dequantized"] = (
            torch.ops.fbgemm.Fused8BitRowwiseQuantizedToFloat(quantized).numpy())

    _v1._save_npz(os.path.join(out, "expected.npz"), expected)
    with open(os.path.join(out, "SHA256SUMS"), "w") as f:
        for rel, digest in _v1.sha256sums(out, CHECKPOINTS):
            f.write(f"{digest}  {rel}\n")
    print(f"wrote {len(CHECKPOINTS)} golden checkpoint(s), expected.npz ({len(expected)} arrays) and SHA256SUMS to {out}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else HERE)
