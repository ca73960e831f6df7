"""Many small tables: one ``embedcore.Embedding`` training step (lookup, then
``apply_gradients``) over T tables, against PyTorch's way of holding them
(one ``nn.EmbeddingBag(mode="sum", sparse=True)`` per table in a
``ModuleDict``, as an unsharded TorchRec collection holds them, though with
sparse gradients, the faster for this step, where TorchRec's are dense; +
``torch.optim.SGD`` over all their weights): forward, backward of the
outputs with the fixed gradients ``g`` (``torch.autograd.backward``), step.

Each table has 1,000 rows of dim 16 and one feature; the batch is 64 bags of
one uniform id per feature. What grows with T is the per-table work of a
step (checks, bookkeeping), not the gathered bytes (a step once compared
every gradient with every table, which grew with T squared; the time per
table still grows somewhat with T, for both contenders: more memory, colder
caches). One step of each is checked against NumPy
before timing. 1 thread (``_common.set_threads(1)``); contenders interleaved,
medians over the rounds.

    python benchmarks/bench_many_tables.py [--tables 100,1000,4000] [--repeats N] [--json PATH]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

ROWS, DIM, BATCH, LR = 1_000, 16, 64, 0.01


def _embedcore_step(tables: int, ids: dict, grads: dict):
    import embedcore as ec

    config = {f"f{i}": ec.FeatureConfig(ec.TableConfig(f"t{i}", ROWS, DIM, combiner="sum",
                                                       initializer=ec.initializers.Uniform(-0.1, 0.1, seed=i)))
              for i in range(tables)}
    emb = ec.Embedding(config, ec.optimizers.SGD(LR))

    def step():
        emb(ids)
        emb.apply_gradients(grads)
    return emb, step


def _tables_by_feature(emb, ids: dict) -> dict:
    """Feature f<i>'s table, t<i>."""
    tables = {t.name: t for t in emb.embedding_tables.values()}
    return {k: tables["t" + k[1:]] for k in ids}


def _torch_step(emb, ids: dict, grads: dict):
    import torch

    bags = torch.nn.ModuleDict()
    for feature, table in _tables_by_feature(emb, ids).items():
        bag = torch.nn.EmbeddingBag(ROWS, DIM, mode="sum", sparse=True)
        with torch.no_grad():
            bag.weight.copy_(torch.from_numpy(table.to_numpy()))
        bags[feature] = bag
    opt = torch.optim.SGD(bags.parameters(), lr=LR)
    t_ids = {k: torch.from_numpy(v).reshape(-1, 1) for k, v in ids.items()}
    t_grads = {k: torch.from_numpy(v) for k, v in grads.items()}

    def step():
        opt.zero_grad()
        torch.autograd.backward([bags[k](t_ids[k]) for k in t_ids], [t_grads[k] for k in t_ids])
        opt.step()
    return bags, step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tables", default="100,1000,4000", help="comma-separated table counts (default 100,1000,4000)")
    ap.add_argument("--repeats", type=int, default=7, help="timed rounds per table count (default 7)")
    ap.add_argument("--json", metavar="PATH", help="write every sample and figure as JSON")
    args = ap.parse_args()
    t_start = time.time()
    C.set_threads(1)
    rng = np.random.default_rng(0)
    rows, payload = [], {"machine": C.machine_info(), "versions": C.versions(), "cases": []}
    for tables in [int(x) for x in args.tables.split(",")]:
        ids = {f"f{i}": rng.integers(0, ROWS, BATCH) for i in range(tables)}
        grads = {f"f{i}": rng.standard_normal((BATCH, DIM)).astype(np.float32) for i in range(tables)}
        emb, ours = _embedcore_step(tables, ids, grads)
        bags, theirs = _torch_step(emb, ids, grads)
        by_feature = _tables_by_feature(emb, ids)
        before = {k: t.to_numpy() for k, t in by_feature.items()}
        ours()
        theirs()
        for k, t in by_feature.items():  # one step each: equal to NumPy's
            want = before[k].copy()
            np.subtract.at(want, ids[k], LR * grads[k])
            np.testing.assert_allclose(t.to_numpy(), want, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(bags[k].weight.detach().numpy(), want, rtol=1e-5, atol=1e-6)
        samples = C.run_interleaved({"embedcore": ours, "torch": theirs}, args.repeats, warmup=1)
        med = {k: C.summarize(v)["median_s"] for k, v in samples.items()}
        rows.append({"tables": tables, "ours_ms": med["embedcore"] * 1e3, "torch_ms": med["torch"] * 1e3,
                     "ours_us_table": med["embedcore"] / tables * 1e6, "torch_us_table": med["torch"] / tables * 1e6,
                     "speedup": med["torch"] / med["embedcore"]})
        payload["cases"].append({"tables": tables, "samples_s": samples})
        del emb, bags
    print(C.format_table(rows, [("tables", "tables", None), ("ours_ms", "embedcore ms", "{:.2f}"),
                                ("torch_ms", "torch ms", "{:.2f}"), ("ours_us_table", "embedcore us/table", "{:.1f}"),
                                ("torch_us_table", "torch us/table", "{:.1f}"),
                                ("speedup", "torch / embedcore", "{:.2f}x")]))
    print(f"total time {time.time() - t_start:.0f} s; load average now {os.getloadavg()[0]:.2f}")
    if args.json:
        C.write_json(args.json, payload)


if __name__ == "__main__":
    main()
