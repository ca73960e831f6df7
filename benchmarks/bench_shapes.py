"""Pooled lookups of shapes W1 does not cover, against the anchors in one run:
narrow tables (dim 1, 4, 8, 16: less than one vector, as the first-order
"wide" terms of CTR models; 32 and 64, and float16 tables: rows of 16 to
256 bytes, where how far ahead rows are prefetched matters most, and, at
dims 8 and 20, where elements are converted one at a time), one id
per bag, and bags given in COO form out of row-major order (a shuffled
``tf.SparseTensor``).

Each case is a 1,000,000-row float32 table (float16 for ``f16_dim<d>``) and
uniform ids, sum combiner:

- ``dim<d>``: 4,096 bags of 32 ids at dim d;
- ``f16_dim<d>``: the same from a float16 table; PyTorch's anchor is
  ``F.embedding_bag`` on float16 weights (its output float16; the check
  compares with PyTorch on the same values widened to float32);
- ``one_id_bags``: 1,000,000 bags of one id at dim 8;
- ``coo_unsorted`` / ``coo_sorted``: 4,096 bags of up to 20 ids (about 45,000
  entries, each bag's positions drawn at random) at dim 64, as ``ec.Sparse``
  in a shuffled order or in row-major order; the anchors take the same bags
  in CSR form (the conversion is what the COO cases measure).

Contenders: ``embedcore`` (``Table.lookup`` of a sum table), ``torch``
(``F.embedding_bag(mode="sum")`` on the same weights) and ``numpy``
(``np.add.reduceat(np.take(...))``, left out where it is far off). One
thread each; interleaved rounds (see _common.run_rounds); every output is
checked against PyTorch's first. Reported: medians and embedcore's time
over PyTorch's.

    python benchmarks/bench_shapes.py [--repeats N] [--json PATH]
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402


def _cases(ec, rng):
    """(name, dim, ids, offsets, COO input or None)."""
    for dim in (1, 4, 8, 16, 32, 64):
        yield f"dim{dim}", dim, C.uniform_ids(C.BATCH * C.BAG), C.offsets(), None
    for dim in (8, 20, 64, 128):
        yield f"f16_dim{dim}", dim, C.uniform_ids(C.BATCH * C.BAG), C.offsets(), None
    yield "one_id_bags", 8, C.uniform_ids(1_000_000), np.arange(1_000_001, dtype=np.int64), None
    lengths = rng.integers(1, 21, C.BATCH)
    bags = np.repeat(np.arange(C.BATCH), lengths)
    positions = np.concatenate([rng.permutation(20)[:n] for n in lengths])
    order = np.lexsort((positions, bags))  # row-major: the CSR form the anchors take
    ids = C.uniform_ids(len(bags))
    csr_offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    coo = np.stack([bags, positions], 1)[order]
    shuffled = rng.permutation(len(bags))
    yield "coo_unsorted", 64, ids, csr_offsets, ec.Sparse(coo[shuffled], ids[shuffled], [C.BATCH, 20])
    yield "coo_sorted", 64, ids, csr_offsets, ec.Sparse(coo, ids, [C.BATCH, 20])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=10, help="timed rounds (default 10)")
    ap.add_argument("--json", metavar="PATH", help="write every sample and figure as JSON")
    args = ap.parse_args()

    import torch

    import embedcore as ec

    C.set_threads(1)
    rng = np.random.default_rng(5)
    results = []
    for name, dim, ids, offsets, coo in _cases(ec, rng):
        C.log(f"{name}: building ...")
        half = name.startswith("f16_")
        t = ec.Table(name="t", rows=C.ROWS, dim=dim, combiner="sum", dtype="float16" if half else "float32")
        w = np.array(t.values())
        wt, ids_t, starts_t = torch.from_numpy(w), torch.from_numpy(ids), torch.from_numpy(offsets[:-1])
        cont = {
            "embedcore": (lambda: t.lookup(coo)) if coo is not None else (lambda: t.lookup(ids, offsets)),
            "torch": lambda: torch.nn.functional.embedding_bag(ids_t, wt, starts_t, mode="sum"),
        }
        if dim >= 4 and name != "one_id_bags" and not half:  # far off for one-id bags and the narrowest rows
            cont["numpy"] = lambda: np.add.reduceat(np.take(w, ids, axis=0), offsets[:-1], axis=0)
        # The reference: PyTorch on float32 weights (float16 ones widened: PyTorch's float16 output is rounded).
        ref = np.asarray(torch.nn.functional.embedding_bag(ids_t, wt.float(), starts_t, mode="sum"))
        for contender, f in cont.items():
            if half and contender == "torch":
                continue
            diff = float(np.abs(np.asarray(f()) - ref).max())
            if not diff <= 1e-5:
                raise SystemExit(f"FAILED: {contender} differs from PyTorch by {diff:.3e} in {name}")
        C.log(f"{name}: timing {args.repeats} rounds ...")
        timing = C.run_rounds(cont, args.repeats, warmup=1)
        torch_ms = C.summarize(timing.samples["torch"])["median_s"] * 1e3
        for contender in cont:
            ms = C.summarize(timing.samples[contender])["median_s"] * 1e3
            results.append({"case": name, "contender": contender, "ms": ms, "vs_torch": ms / torch_ms,
                            "samples_s": timing.samples[contender]})

    print("\nPooled lookups (sum), 1,000,000-row float32 (f16_: float16) tables, 1 thread; medians of interleaved rounds")
    print(C.format_table(results, [("case", "case", None), ("contender", "contender", None), ("ms", "ms", "{:.2f}"),
                                   ("vs_torch", "time / torch", "{:.2f}x")]))
    if args.json:
        C.write_json(args.json, {"machine": C.machine_info(), "versions": C.versions(), "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
