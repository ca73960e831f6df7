"""Writes the golden checkpoints of format v1 (run once; the outputs are
committed and must load in every later version of embedcore).

    python tests/golden/v1/make_golden.py [OUT_DIR]   # default: this directory

Writes, under OUT_DIR:
  dtype_float32/ dtype_float16/ dtype_bfloat16/   one table per storage dtype (SGD, 3 steps)
  opt_sgd/ opt_adagrad/ opt_adam/ opt_ftrl/       a float32 table after 4 steps of each optimizer, with slots
  export_values_only/                             include_optimizer=False
  export_bfloat16/                                a float32 table exported with values_dtype="bfloat16", values only
  embedding/                                      an Embedding: tables "user" and "item" read by three
                                                  features, "history" a sequence feature of the item table
  expected.npz    values (as float32 and as stored bits), slots, steps, and an embedding lookup
  SHA256SUMS      of every file above (tests/python/test_golden.py checks them)

Everything is deterministic (seeded initializers, fixed batches), and the npz
is written with fixed zip timestamps, so a rerun with the library that made
them (format 1.0) reproduced every byte. A rerun with a later library does
not: it writes the current format (1.2: `adagrad_epsilon` in the manifest)
and its numerics (e.g. SGD's), so the committed files are never regenerated;
they are what a 1.0 writer wrote, and test_golden.py checks that they load.
"""
from __future__ import annotations

import hashlib
import io
import os
import shutil
import sys
import zipfile

import numpy as np

import embedcore as ec

HERE = os.path.dirname(os.path.abspath(__file__))
CHECKPOINTS = ["dtype_float32", "dtype_float16", "dtype_bfloat16", "opt_sgd", "opt_adagrad", "opt_adam", "opt_ftrl",
               "export_values_only", "export_bfloat16", "embedding"]


def _batches(rows, dim, steps, seed):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        lengths = rng.integers(0, 4, 6)
        offsets = np.zeros(7, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        ids = rng.integers(0, rows, int(offsets[-1])).astype(np.int64)
        grads = rng.standard_normal((6, dim)).astype(np.float32)
        out.append((ids, offsets, grads))
    return out


def _train(table, steps, seed):
    for ids, offsets, grads in _batches(table.rows, table.dim, steps, seed):
        table.apply_gradients(ids, offsets, grads)


def _stored_bits(table):
    v = np.asarray(table.values())
    return v.view(np.uint16) if v.dtype.itemsize == 2 else v.view(np.uint32)


def _record(expected, name, table, stored_dtype=None):
    """Expected values as float32 and as the stored bits, slots, step."""
    prefix = f"{name}/{table.name}"
    values = table.to_numpy()
    expected[f"{prefix}/values"] = values
    if stored_dtype is None:
        expected[f"{prefix}/bits"] = _stored_bits(table)
    else:  # an export: the bits of the rounded values
        import ml_dtypes

        rounded = values.astype({"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}[stored_dtype])
        expected[f"{prefix}/bits"] = rounded.view(np.uint16)
        expected[f"{prefix}/values"] = rounded.astype(np.float32)
    for slot, arr in table.slots().items():
        expected[f"{prefix}/slot/{slot}"] = np.array(arr)
    expected[f"{prefix}/step"] = np.array(table.step, np.int64)


def _table(name, rows, dim, dtype, optimizer, seed):
    return ec.Table(name=name, rows=rows, dim=dim, dtype=dtype, optimizer=optimizer, combiner="sum",
                    initializer=ec.initializers.Uniform(-0.5, 0.5, seed=seed))


def _embedding():
    user = ec.TableConfig("user", 12, 4, "float32", ec.initializers.Uniform(-0.5, 0.5, seed=21), combiner="sum")
    item = ec.TableConfig("item", 20, 4, "float32", ec.initializers.Uniform(-0.5, 0.5, seed=22), combiner="mean")
    features = {
        "user": ec.FeatureConfig(user, name="user"),
        "item": ec.FeatureConfig(item, name="item"),
        "history": ec.FeatureConfig(item, max_sequence_length=3, name="history"),
    }
    return ec.Embedding(features, optimizer=ec.optimizers.Adagrad(0.2, initial_accumulator_value=0.1))


def embedding_inputs(seed=5, batch=5):
    """A fixed batch for the embedding (also what test_golden.py looks up)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 5, batch)
    offsets = np.zeros(batch + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return {
        "user": rng.integers(0, 12, batch).astype(np.int64),
        "item": rng.integers(0, 20, batch).astype(np.int64),
        "history_ids": rng.integers(0, 20, int(offsets[-1])).astype(np.int64),
        "history_offsets": offsets,
    }


def _features(inputs):
    return {"user": inputs["user"], "item": inputs["item"],
            "history": ec.Ragged(inputs["history_ids"], inputs["history_offsets"])}


def _save_npz(path, arrays):
    """np.savez, with fixed timestamps and order so the bytes are reproducible."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as z:
        for key in sorted(arrays):
            buf = io.BytesIO()
            np.lib.format.write_array(buf, np.asarray(arrays[key]), allow_pickle=False)
            info = zipfile.ZipInfo(key + ".npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.external_attr = 0o644 << 16
            z.writestr(info, buf.getvalue())


def sha256sums(root, names=None):
    """(relative path, sha256) of every file of the checkpoints `names`
    (default: this script's) and expected.npz."""
    out = []
    for name in CHECKPOINTS if names is None else names:
        for f in sorted(os.listdir(os.path.join(root, name))):
            rel = f"{name}/{f}"
            out.append((rel, hashlib.sha256(open(os.path.join(root, rel), "rb").read()).hexdigest()))
    out.append(("expected.npz", hashlib.sha256(open(os.path.join(root, "expected.npz"), "rb").read()).hexdigest()))
    return out


def main(out=HERE):
    ec.set_num_threads(1)  # (results never depend on it; one thread keeps this script simple to reason about)
    expected = {}
    for name in CHECKPOINTS:
        shutil.rmtree(os.path.join(out, name), ignore_errors=True)

    for dtype in ("float32", "float16", "bfloat16"):
        t = _table("t", 16, 4, dtype, ec.optimizers.SGD(0.1), seed=1)
        _train(t, 3, seed=11)
        ec.save(os.path.join(out, f"dtype_{dtype}"), t)
        _record(expected, f"dtype_{dtype}", t)

    optimizers = {
        "sgd": ec.optimizers.SGD(0.05, clipvalue=1.5),
        "adagrad": ec.optimizers.Adagrad(0.1, initial_accumulator_value=0.2),
        "adam": ec.optimizers.Adam(0.01, beta_1=0.8, beta_2=0.95, bias_correction=True),
        "ftrl": ec.optimizers.FTRL(0.2, l1_regularization_strength=0.01, l2_regularization_strength=0.02, beta=0.1),
    }
    for name, opt in optimizers.items():
        t = _table("t", 10, 3, "float32", opt, seed=2)
        _train(t, 4, seed=12)
        ec.save(os.path.join(out, f"opt_{name}"), t)
        _record(expected, f"opt_{name}", t)

    t = _table("values", 9, 5, "float32", ec.optimizers.Adagrad(0.1), seed=3)
    _train(t, 2, seed=13)
    ec.save(os.path.join(out, "export_values_only"), t, include_optimizer=False)
    expected["export_values_only/values/values"] = t.to_numpy()
    expected["export_values_only/values/bits"] = _stored_bits(t)

    t = _table("values", 9, 5, "float32", ec.optimizers.Adagrad(0.1), seed=4)
    _train(t, 2, seed=14)
    ec.save(os.path.join(out, "export_bfloat16"), t, include_optimizer=False, values_dtype="bfloat16")
    _record(expected, "export_bfloat16", t, stored_dtype="bfloat16")
    for k in [k for k in expected if k.startswith("export_bfloat16/") and ("/slot/" in k or k.endswith("/step"))]:
        del expected[k]  # a values-only export holds neither

    emb = _embedding()
    rng = np.random.default_rng(15)
    for _ in range(3):
        inputs = embedding_inputs(int(rng.integers(1 << 30)))
        out_ = emb(_features(inputs))
        emb.apply_gradients({k: rng.standard_normal(v.shape).astype(np.float32) for k, v in out_.items()})
    ec.save(os.path.join(out, "embedding"), emb)
    for table in emb.embedding_tables.values():
        _record(expected, "embedding", table)
    inputs = embedding_inputs()
    for k, v in inputs.items():
        expected[f"embedding/inputs/{k}"] = v
    for k, v in emb(_features(inputs)).items():
        expected[f"embedding/lookup/{k}"] = v

    _save_npz(os.path.join(out, "expected.npz"), expected)
    with open(os.path.join(out, "SHA256SUMS"), "w") as f:
        for rel, digest in sha256sums(out):
            f.write(f"{digest}  {rel}\n")
    print(f"wrote {len(CHECKPOINTS)} golden checkpoints, expected.npz ({len(expected)} arrays) and SHA256SUMS to {out}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else HERE)
