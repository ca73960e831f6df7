"""Writes the example's checkpoint from Python, and the lookups the C and C++
programs must reproduce bit for bit.

    python make_checkpoint.py CHECKPOINT [--reference FILE]

saves a small click-through model (an ``embedcore.Embedding`` trained for a few
steps) into the directory CHECKPOINT; with ``--reference FILE`` it also writes
the float32 results of the example lookups (below), as the Python serving path
computes them, to FILE: ``inference --dump`` and ``serve --dump`` write the same
bytes.

The example lookups, in this order (the programs build the same batches):

- every feature f: ``srv(feature f)`` on the example batch of slot f, with the
  weights when f is odd;
- every table t, on the example batch of slot 100 + t: sum (weights), mean
  (weights), sqrtn, the rows (weights), the rows padded to 3 per bag, and the
  table's own combiner with int32 ids.

The example batch of a slot s for a table of R rows: 6 bags of
(3 b + s) mod 5 ids (some empty), id k = (7919 k + 104729 s + 13) mod R, weight
k = 0.25 (1 + (k + s) mod 7).
"""
from __future__ import annotations

import argparse
import os
from typing import List, Tuple

import numpy as np

NUM_BAGS = 6


def example_batch(slot: int, rows: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ids (int64), offsets (int64) and weights (float32) of the example batch of `slot`."""
    sizes = [(3 * b + slot) % 5 for b in range(NUM_BAGS)]
    offsets = np.zeros(NUM_BAGS + 1, np.int64)
    offsets[1:] = np.cumsum(sizes)
    k = np.arange(offsets[-1], dtype=np.int64)
    ids = (k * 7919 + slot * 104729 + 13) % rows
    weights = (0.25 * (1 + (k + slot) % 7)).astype(np.float32)
    return ids, offsets, weights


def save_example(path: str, seed: int = 0, steps: int = 3) -> None:
    """A model with a float32, a bfloat16 and a float16 table, pooled and sequence features."""
    import embedcore as ec

    user = ec.TableConfig("user", 1000, 16, "float32", ec.initializers.Uniform(-1, 1, seed=seed + 1),
                          combiner="sum")
    item = ec.TableConfig("item", 5000, 8, "bfloat16", ec.initializers.Uniform(-1, 1, seed=seed + 2),
                          combiner="mean")
    query = ec.TableConfig("query", 300, 12, "float16", ec.initializers.Uniform(-1, 1, seed=seed + 3),
                           combiner="sqrtn")
    emb = ec.Embedding({"user": ec.FeatureConfig(user, name="user"),
                        "item": ec.FeatureConfig(item, name="item"),
                        "history": ec.FeatureConfig(item, max_sequence_length=5, name="history"),
                        "query": ec.FeatureConfig(query, name="query")},
                       optimizer=ec.optimizers.Adagrad(0.1))
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        feats = {"user": rng.integers(0, 1000, 8), "item": rng.integers(0, 5000, 8),
                 "history": rng.integers(0, 5000, (8, 5)), "query": rng.integers(0, 300, (8, 3))}
        out = emb(feats)
        emb.apply_gradients({k: rng.standard_normal(v.shape).astype(np.float32) for k, v in out.items()})
    ec.save(path, emb)


def reference_lookups(path: str) -> List[np.ndarray]:
    """The example lookups through ``embedcore.serving``, in the documented order."""
    import json

    import embedcore as ec

    srv = ec.serving.open(path)
    outputs: List[np.ndarray] = []
    # The features in the checkpoint's order (the C API's), with the tables they read.
    meta = json.loads(ec.checkpoint.read_info(path).metadata_json)
    features = meta.get("features") or []
    if features:
        # This model's feature config is a dict keyed by the feature names.
        inputs, weights = {}, {}
        for f, feature in enumerate(features):
            ids, offsets, w = example_batch(f, srv.tables[feature["table"]].rows)
            inputs[feature["name"]] = ec.Ragged(ids, offsets)
            weights[feature["name"]] = ec.Ragged(w, offsets) if f % 2 == 1 else None
        result = srv(inputs, weights)
        outputs += [result[feature["name"]] for feature in features]
    for t, table in enumerate(srv.tables.values()):
        ids, offsets, weights = example_batch(100 + t, table.rows)
        outputs.append(table.lookup(ids, offsets, weights, combiner="sum"))
        outputs.append(table.lookup(ids, offsets, weights, combiner="mean"))
        outputs.append(table.lookup(ids, offsets, combiner="sqrtn"))
        outputs.append(table.lookup(ids, offsets, weights, combiner=None))
        outputs.append(table.lookup(ids, offsets, combiner=None, max_sequence_length=3))
        outputs.append(table.lookup(ids.astype(np.int32), offsets))
    return [np.ascontiguousarray(o, dtype=np.float32) for o in outputs]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--reference", help="also write the example lookups (float32, little-endian) here")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    save_example(args.checkpoint, seed=args.seed)
    print(f"saved the example model into {os.path.abspath(args.checkpoint)}")
    if args.reference:
        data = b"".join(o.astype("<f4").tobytes() for o in reference_lookups(args.checkpoint))
        with open(args.reference, "wb") as f:
            f.write(data)
        print(f"wrote {len(data) // 4} floats of reference lookups to {args.reference}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
