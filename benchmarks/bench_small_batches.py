"""Per-call cost at small batches (online serving, many small features),
where Python and binding work, not memory, decide the time; against the
anchors in one run:

- ``lookup``: one 100,000 x 64 float32 table, sum pooling, batches of 1 x 1,
  8 x 8 and 64 x 8 (bags x ids), NumPy int64 ids and offsets:
  ``Table.lookup`` and a served checkpoint's ``ServedTable.lookup`` against
  ``F.embedding_bag`` and ``np.add.reduceat(np.take(...))``;
- ``torch``: the PyTorch adapter's ``EmbeddingBag`` of that table against
  ``nn.EmbeddingBag(sparse=True)``: forward under ``no_grad``, and a training
  step (forward, backward of ``(out * g).sum()``, step): fused (``optimizer=``
  SGD) and unfused (``sparse=True`` + ``torch.optim.SGD``) against
  ``nn.EmbeddingBag`` + ``torch.optim.SGD``;
- ``kjt`` (with TorchRec): an ``EmbeddingBagCollection`` of 1, 8 and 26
  features (one 10,000 x 16 table each), batch 8, one id a bag, given as a
  ``KeyedJaggedTensor``: forward under ``no_grad`` against TorchRec's CPU
  ``EmbeddingBagCollection``.

One thread. Each contender runs a loop of calls and reports its mean
microseconds a call; the contenders take turns in interleaved rounds
(_common.run_rounds) and the medians over rounds are reported, with the
time over the anchor's (below 1: faster). Outputs are checked against
PyTorch's first (lookups) or after one step (training).

    python benchmarks/bench_small_batches.py [--repeats N] [--json PATH]
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

ROWS, DIM = 100_000, 64
SHAPES = ((1, 1), (8, 8), (64, 8))  # (bags, ids a bag)


def _per_call(f, calls: int):
    """A contender that runs `calls` calls of `f` and reports seconds a call."""
    def run() -> float:
        t0 = time.perf_counter()
        for _ in range(calls):
            f()
        return (time.perf_counter() - t0) / calls
    return run


def _time(cases: dict, calls: int, repeats: int) -> dict:
    timing = C.run_rounds({k: _per_call(f, calls) for k, f in cases.items()}, repeats, warmup=1, prime=False)
    return {k: C.summarize(v)["median_s"] * 1e6 for k, v in timing.samples.items()}


def _lookups(ec, torch, rng, repeats, scratch, results):
    t = ec.Table(name="t", rows=ROWS, dim=DIM, combiner="sum",
                 initializer=ec.initializers.Uniform(-1, 1, seed=1))
    path = os.path.join(scratch, "ckpt")
    ec.save(path, t)
    served = ec.serving.open(path).tables["t"]
    w = np.array(t.values())
    wt = torch.from_numpy(w)
    for bags, k in SHAPES:
        ids = rng.integers(0, ROWS, bags * k).astype(np.int64)
        offsets = np.arange(0, bags * k + 1, k, dtype=np.int64)
        ids_t, starts_t = torch.from_numpy(ids), torch.from_numpy(offsets[:-1])
        cases = {
            "embedcore": lambda: t.lookup(ids, offsets),
            "embedcore_served": lambda: served.lookup(ids, offsets),
            "torch": lambda: torch.nn.functional.embedding_bag(ids_t, wt, starts_t, mode="sum"),
            "numpy": lambda: np.add.reduceat(np.take(w, ids, axis=0), offsets[:-1], axis=0),
        }
        ref = cases["torch"]().numpy()
        for name, f in cases.items():
            if not np.allclose(np.asarray(f()), ref, rtol=1e-6, atol=1e-6):
                raise SystemExit(f"FAILED: {name} differs from PyTorch at {bags} x {k}")
        us = _time(cases, 2000, repeats)
        for name, v in us.items():
            results.append({"part": "lookup", "case": f"{bags}x{k}", "contender": name, "us": v,
                            "vs": v / us["torch"], "anchor": "torch"})


def _torch_modules(ec, torch, et, rng, repeats, results):
    for bags, k in SHAPES:
        ids = torch.from_numpy(rng.integers(0, ROWS, bags * k))
        offs = torch.arange(0, bags * k, k)
        g = torch.from_numpy(rng.standard_normal((bags, DIM), dtype=np.float32))
        init = torch.from_numpy(rng.uniform(-1, 1, (ROWS, DIM)).astype(np.float32))

        def make_torch():
            m = torch.nn.EmbeddingBag.from_pretrained(init.clone(), mode="sum", sparse=True, freeze=False)
            return m, torch.optim.SGD(m.parameters(), lr=0.01)

        def make_unfused():
            m = et.EmbeddingBag.from_pretrained(init.clone(), mode="sum", sparse=True, freeze=False)
            return m, torch.optim.SGD(m.parameters(), lr=0.01)

        fused = et.EmbeddingBag.from_pretrained(init.clone(), mode="sum", freeze=False,
                                                optimizer=ec.optimizers.SGD(learning_rate=0.01))
        (tm, topt), (um, uopt) = make_torch(), make_unfused()

        def step(m, opt):
            (m(ids, offs) * g).sum().backward()
            if opt is not None:
                opt.step()
                opt.zero_grad()

        # One step each from the same weights: the same rows after it (the check), then the timing.
        for m, opt in ((tm, topt), (um, uopt), (fused, None)):
            step(m, opt)
        want = tm.weight.detach()[ids]
        for name, m in (("unfused", um), ("fused", fused)):
            if not torch.allclose(m.weight.detach()[ids], want, rtol=1e-6, atol=1e-6):
                raise SystemExit(f"FAILED: embedcore {name} step differs from PyTorch's at {bags} x {k}")
        with torch.no_grad():
            us = _time({"embedcore": lambda: fused(ids, offs), "torch": lambda: tm(ids, offs)}, 1000, repeats)
        for name, v in us.items():
            results.append({"part": "torch forward (no_grad)", "case": f"{bags}x{k}", "contender": name, "us": v,
                            "vs": v / us["torch"], "anchor": "torch"})
        us = _time({"embedcore_fused": lambda: step(fused, None), "embedcore_unfused": lambda: step(um, uopt),
                    "torch": lambda: step(tm, topt)}, 200, repeats)
        for name, v in us.items():
            results.append({"part": "torch training step (SGD)", "case": f"{bags}x{k}", "contender": name, "us": v,
                            "vs": v / us["torch"], "anchor": "torch"})


def _kjt(ec, torch, et, rng, repeats, results):
    try:
        import torchrec
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
    except ImportError:
        C.log("kjt: TorchRec is not installed; skipped")
        return
    batch = 8
    for features in (1, 8, 26):
        names = [f"f{i}" for i in range(features)]
        ours = et.EmbeddingBagCollection([et.EmbeddingBagConfig(num_embeddings=ROWS // 10, embedding_dim=16,
                                                                name=f"t{i}", feature_names=[n])
                                          for i, n in enumerate(names)])
        theirs = torchrec.EmbeddingBagCollection(tables=[torchrec.EmbeddingBagConfig(
            num_embeddings=ROWS // 10, embedding_dim=16, name=f"t{i}", feature_names=[n])
            for i, n in enumerate(names)], device=torch.device("cpu"))
        theirs.load_state_dict(ours.state_dict())
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=names, values=torch.from_numpy(
            rng.integers(0, ROWS // 10, batch * features)), lengths=torch.ones(batch * features, dtype=torch.int64))
        with torch.no_grad():
            if not torch.allclose(ours(kjt).values(), theirs(kjt).values(), rtol=1e-6, atol=1e-6):
                raise SystemExit(f"FAILED: the collection differs from TorchRec's at {features} features")
            us = _time({"embedcore": lambda: ours(kjt), "torchrec": lambda: theirs(kjt)}, 300, repeats)
        for name, v in us.items():
            results.append({"part": "KJT collection forward (no_grad), batch 8", "case": f"{features} features",
                            "contender": name, "us": v, "vs": v / us["torchrec"], "anchor": "torchrec"})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=7, help="interleaved rounds (default 7)")
    ap.add_argument("--json", metavar="PATH", help="write every figure as JSON")
    args = ap.parse_args()

    import torch

    import embedcore as ec
    import embedcore.adapters.torch as et

    C.set_threads(1)
    rng = np.random.default_rng(3)
    results: list = []
    t_start = time.perf_counter()
    scratch = C.scratch_dir()  # (its own directory, removed with what it holds)
    try:
        C.log("lookups ...")
        _lookups(ec, torch, rng, args.repeats, scratch, results)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    C.log("torch modules ...")
    _torch_modules(ec, torch, et, rng, args.repeats, results)
    C.log("KJT collections ...")
    _kjt(ec, torch, et, rng, args.repeats, results)

    print("\nPer call at small batches, 1 thread; medians of interleaved rounds (us a call; time over the anchor's)")
    for part in dict.fromkeys(r["part"] for r in results):
        rows = [r for r in results if r["part"] == part]
        print(f"\n{part} (anchor: {rows[0]['anchor']})")
        print(C.format_table(rows, [("case", "case", None), ("contender", "contender", None),
                                    ("us", "us", "{:.1f}"), ("vs", "time / anchor", "{:.2f}x")]))
    print(f"\ntotal time {time.perf_counter() - t_start:.0f} s")
    if args.json:
        C.write_json(args.json, {"machine": C.machine_info(), "versions": C.versions(), "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
