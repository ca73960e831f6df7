"""Workload W4, a DLRM-shaped collection: embedcore's
``EmbeddingBagCollection`` against TorchRec's and FBGEMM's table-batched
embedding, forward and training step, on a ``KeyedJaggedTensor``.

26 sparse features ``f0..f25``, one table each (``t0..t25``, table i has
1,000 + 3,000 i rows: 1,001,000 rows in all), dim 16, float32, sum pooling.
The input is one ``torchrec.KeyedJaggedTensor`` per case, uniform ids within
each table:

- ``b16``, ``b256``, ``b4096`` (``--batches``): one id per bag (lengths all
  1), batch 16 / 256 / 4096;
- ``b256_multihot``: batch 256, each bag's length drawn uniformly in 0..20
  (seeded; about 10 ids per bag, some bags empty).

Contenders, all at 1 thread (``_common.set_threads(1)``: the engine's and
PyTorch's), all holding the same weights (embedcore's initial values, copied
into the others):

forward (under ``torch.no_grad()``):

- ``embedcore``: ``embedcore.adapters.torch.EmbeddingBagCollection(configs)``
  on the KJT (a ``KeyedTensor``);
- ``torchrec``: ``torchrec.EmbeddingBagCollection(tables=configs,
  device=cpu)`` on the same KJT (one ``nn.EmbeddingBag`` per table, after
  ``kjt.to_dict()``);
- ``fbgemm``: one ``SplitTableBatchedEmbeddingBagsCodegen`` holding the 26
  tables (``EmbeddingLocation.HOST``, ``ComputeDevice.CPU``), one call
  ``fb(kjt.values(), kjt.offsets())``: the KJT's key-major layout is the
  TBE's table-major one, and its ``[batch, 26 * 16]`` output is the
  ``KeyedTensor``'s values.

train (forward, backward of ``(out * g).sum()`` with a fixed standard-normal
``g`` of the output's shape, SGD with lr 0.01):

- ``embedcore``: the collection with ``optimizer=embedcore.optimizers.SGD(0.01)``
  (fused: the update runs inside ``backward()``);
- ``embedcore_unfused``: the collection without an optimizer (its weights
  get sparse gradients) + ``torch.optim.SGD``;
- ``torchrec``: TorchRec's collection + ``torch.optim.SGD``. Its
  ``nn.EmbeddingBag``s have dense gradients (TorchRec's default; sparse
  gradients and fused optimizers come with its sharding, not with the
  unsharded module): every step allocates a gradient of every table, 64 MB
  in all, and SGD walks all of it. That is what an unsharded TorchRec user
  runs;
- ``fbgemm``: the TBE with ``EmbOptimType.EXACT_SGD`` (learning_rate 0.01),
  fused into its backward.

train_rowwise (the same step with row-wise Adagrad, TorchRec's default fused
optimizer: lr 0.01, eps 1e-8, accumulators from 0):

- ``embedcore``: the collection with
  ``optimizer=embedcore.optimizers.RowWiseAdagrad(0.01)``;
- ``fbgemm``: the TBE with ``EmbOptimType.EXACT_ROWWISE_ADAGRAD``.
  (TorchRec's unsharded collection has no fused optimizer: no ``torchrec``
  row here.)

sequence (unpooled: each id's row, under ``torch.no_grad()``; the same
tables as ``EmbeddingConfig``s):

- ``embedcore``: ``embedcore.adapters.torch.EmbeddingCollection(configs)``
  on the KJT (a dict of ``JaggedTensor``);
- ``torchrec``: ``torchrec.EmbeddingCollection(tables=configs, device=cpu)``.

sequence_train (the same collections: forward, backward of ``(rows * gs).sum()``
with a fixed standard-normal ``gs`` of the rows' shape, SGD with lr 0.01):

- ``embedcore``: ``EmbeddingCollection(configs, optimizer=SGD(0.01))`` (fused);
- ``torchrec``: TorchRec's ``EmbeddingCollection`` + ``torch.optim.SGD`` (dense
  gradients, as its ``train`` row).

Before timing, every forward is compared with TorchRec's (max |diff| <=
1e-5) and one training step of every training contender, from the same
start, with one step of TorchRec + SGD (the EmbeddingCollection's with
TorchRec's EmbeddingCollection + SGD; every table's values, max |diff| <=
1e-5), and embedcore's row-wise Adagrad step with FBGEMM's (values and
accumulators); the script stops (SystemExit, with the numbers) otherwise. Timing then
uses freshly built modules. Interleaved rounds (_common.run_rounds: each
timed call right after an untimed one of the same contender, the order
rotated), the load of other processes measured per round and the quiet
rounds kept when there are enough; reported: the median time per call and
its ratio to TorchRec's and FBGEMM's.

    python benchmarks/bench_collection.py [--quick] [--json PATH] [--repeats N] [--batches 16,256,4096]
        [--no-multihot]
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

WORKLOAD = "W4"
TABLES = 26
DIM = 16
LR = 0.01
TOL = 1e-5
MULTIHOT_BATCH = 256
MULTIHOT_MAX = 20
EPS = 1e-8  # row-wise Adagrad's (FBGEMM's default)
CONTENDERS = {"forward": ("embedcore", "torchrec", "fbgemm"),
              "train": ("embedcore", "embedcore_unfused", "torchrec", "fbgemm"),
              "train_rowwise": ("embedcore", "fbgemm"),
              "sequence": ("embedcore", "torchrec"),
              "sequence_train": ("embedcore", "torchrec")}


def table_rows(i: int) -> int:
    return 1000 + 3000 * i


def make_kjt(torchrec, batch: int, multihot: bool, seed: int):
    """A KeyedJaggedTensor f0..f25 of `batch` bags each: one id per bag, or
    lengths uniform in 0..MULTIHOT_MAX; ids uniform within each table."""
    import torch

    rng = np.random.default_rng(seed)
    lengths, values = [], []
    for i in range(TABLES):
        n = (rng.integers(0, MULTIHOT_MAX + 1, batch) if multihot else np.ones(batch)).astype(np.int64)
        lengths.append(n)
        values.append(rng.integers(0, table_rows(i), int(n.sum()), dtype=np.int64))
    return torchrec.KeyedJaggedTensor.from_lengths_sync(
        keys=[f"f{i}" for i in range(TABLES)], values=torch.from_numpy(np.concatenate(values)),
        lengths=torch.from_numpy(np.concatenate(lengths)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer rounds (a smoke run)")
    ap.add_argument("--json", metavar="PATH", help="write every sample and figure as JSON")
    ap.add_argument("--repeats", type=int, help="timed rounds per case and op (default 30, 5 with --quick)")
    ap.add_argument("--batches", default="16,256,4096", help="one-hot batch sizes (default 16,256,4096)")
    ap.add_argument("--no-multihot", action="store_true", help="skip the multi-hot batch-256 case")
    args = ap.parse_args()
    repeats = args.repeats or (5 if args.quick else 30)
    warmup = 1 if args.quick else 2
    max_seconds = 3.0 if args.quick else 8.0  # per case and op, when other processes keep rounds from being quiet
    batches = [int(x) for x in args.batches.split(",") if x]
    t_start = time.time()

    logging.disable(logging.INFO)  # FBGEMM and TorchRec log at INFO
    import torch
    import torchrec
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice, EmbeddingLocation, SplitTableBatchedEmbeddingBagsCodegen)

    import embedcore as ec
    import embedcore.adapters.torch as et

    C.set_threads(1)
    if torch.get_num_threads() != 1 or ec.get_num_threads() != 1:
        raise SystemExit(f"FAILED: set_threads(1) left torch at {torch.get_num_threads()} and embedcore at "
                         f"{ec.get_num_threads()} threads")

    configs = [torchrec.EmbeddingBagConfig(num_embeddings=table_rows(i), embedding_dim=DIM, name=f"t{i}",
                                           feature_names=[f"f{i}"]) for i in range(TABLES)]
    names = [c.name for c in configs]
    seq_configs = [torchrec.EmbeddingConfig(num_embeddings=c.num_embeddings, embedding_dim=DIM, name=c.name,
                                            feature_names=list(c.feature_names)) for c in configs]

    # ------------------------------------------------------------ modules
    C.log("building the modules ...")
    torch.manual_seed(0)
    w0 = [m.weight.detach().clone() for m in et.EmbeddingBagCollection(configs).embedding_bags.values()]

    def load(params):
        with torch.no_grad():
            for p, w in zip(params, w0):
                p.copy_(w)

    def build():
        """Every contender's module (and optimizer), holding w0."""
        m = {}
        m["ec_fused"] = et.EmbeddingBagCollection(configs, optimizer=ec.optimizers.SGD(LR))
        m["ec_unfused"] = et.EmbeddingBagCollection(configs)
        m["ec_unfused_opt"] = torch.optim.SGD(m["ec_unfused"].parameters(), lr=LR)
        m["torchrec"] = torchrec.EmbeddingBagCollection(tables=configs, device=torch.device("cpu"))
        m["torchrec_opt"] = torch.optim.SGD(m["torchrec"].parameters(), lr=LR)
        specs = [(c.num_embeddings, DIM, EmbeddingLocation.HOST, ComputeDevice.CPU) for c in configs]
        m["fbgemm"] = SplitTableBatchedEmbeddingBagsCodegen(specs, optimizer=EmbOptimType.EXACT_SGD,
                                                            learning_rate=LR, pooling_mode=PoolingMode.SUM)
        m["ec_rowwise"] = et.EmbeddingBagCollection(configs, optimizer=ec.optimizers.RowWiseAdagrad(LR, epsilon=EPS))
        m["ec_seq"] = et.EmbeddingCollection(seq_configs)
        m["torchrec_seq"] = torchrec.EmbeddingCollection(tables=seq_configs, device=torch.device("cpu"))
        m["ec_seq_fused"] = et.EmbeddingCollection(seq_configs, optimizer=ec.optimizers.SGD(LR))
        m["torchrec_seq_train"] = torchrec.EmbeddingCollection(tables=seq_configs, device=torch.device("cpu"))
        m["torchrec_seq_opt"] = torch.optim.SGD(m["torchrec_seq_train"].parameters(), lr=LR)
        m["fbgemm_rowwise"] = SplitTableBatchedEmbeddingBagsCodegen(
            specs, optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=LR, eps=EPS,
            pooling_mode=PoolingMode.SUM)
        for k in ("ec_fused", "ec_unfused", "torchrec", "ec_rowwise"):
            load([m[k].embedding_bags[n].weight for n in names])
        for k in ("ec_seq", "torchrec_seq", "ec_seq_fused", "torchrec_seq_train"):
            load([m[k].embeddings[n].weight for n in names])
        load(m["fbgemm"].split_embedding_weights())
        load(m["fbgemm_rowwise"].split_embedding_weights())
        return m

    def tables_of(m, name):
        """The 26 tables of a training contender."""
        if name == "fbgemm":
            return list(m["fbgemm"].split_embedding_weights())
        mod = {"embedcore": m["ec_fused"], "embedcore_unfused": m["ec_unfused"], "torchrec": m["torchrec"]}[name]
        return [mod.embedding_bags[n].weight for n in names]

    def contenders(m, op, kjt, g, gs=None):
        if op == "sequence_train":
            def seq_loss(module):
                out = module(kjt)
                return (torch.cat([out[f"f{i}"].values() for i in range(TABLES)]) * gs).sum()

            def ec_seq_step():
                seq_loss(m["ec_seq_fused"]).backward()

            def torchrec_seq_step():
                m["torchrec_seq_opt"].zero_grad(set_to_none=True)
                seq_loss(m["torchrec_seq_train"]).backward()
                m["torchrec_seq_opt"].step()
            return {"embedcore": ec_seq_step, "torchrec": torchrec_seq_step}
        if op == "sequence":
            def rows(module):
                def run():
                    with torch.no_grad():
                        out = module(kjt)
                        return torch.cat([out[f"f{i}"].values() for i in range(TABLES)])
                return run
            return {"embedcore": rows(m["ec_seq"]), "torchrec": rows(m["torchrec_seq"])}
        if op == "forward":
            def fwd(f):
                def run():
                    with torch.no_grad():
                        return f()
                return run
            return {"embedcore": fwd(lambda: m["ec_unfused"](kjt).values()),
                    "torchrec": fwd(lambda: m["torchrec"](kjt).values()),
                    "fbgemm": fwd(lambda: m["fbgemm"](kjt.values(), kjt.offsets()))}

        def ec_fused():
            (m["ec_fused"](kjt).values() * g).sum().backward()

        def ec_unfused():
            m["ec_unfused_opt"].zero_grad(set_to_none=True)
            (m["ec_unfused"](kjt).values() * g).sum().backward()
            m["ec_unfused_opt"].step()

        def torchrec_step():
            m["torchrec_opt"].zero_grad(set_to_none=True)
            (m["torchrec"](kjt).values() * g).sum().backward()
            m["torchrec_opt"].step()

        def fbgemm_step():
            (m["fbgemm"](kjt.values(), kjt.offsets()) * g).sum().backward()

        if op == "train_rowwise":
            def ec_rowwise():
                (m["ec_rowwise"](kjt).values() * g).sum().backward()

            def fbgemm_rowwise():
                (m["fbgemm_rowwise"](kjt.values(), kjt.offsets()) * g).sum().backward()
            return {"embedcore": ec_rowwise, "fbgemm": fbgemm_rowwise}

        return {"embedcore": ec_fused, "embedcore_unfused": ec_unfused, "torchrec": torchrec_step,
                "fbgemm": fbgemm_step}

    # ------------------------------------------------------------ cases
    cases = [(f"b{b}", b, False, 100 + b) for b in batches]
    if not args.no_multihot:
        cases.append((f"b{MULTIHOT_BATCH}_multihot", MULTIHOT_BATCH, True, 7))
    data = {}
    for case, batch, multihot, seed in cases:
        kjt = make_kjt(torchrec, batch, multihot, seed)
        g = torch.from_numpy(np.random.default_rng(seed + 1).standard_normal((batch, TABLES * DIM),
                                                                             dtype=np.float32))
        gs = torch.from_numpy(np.random.default_rng(seed + 2).standard_normal((int(kjt.values().numel()), DIM),
                                                                              dtype=np.float32))
        data[case] = (kjt, g, int(kjt.values().numel()), gs)

    # ------------------------------------------------------------ correctness
    checks = {}
    for case, (kjt, g, nnz, gs) in data.items():
        m = build()
        with torch.no_grad():
            want = m["torchrec"](kjt).values()
        for name, f in contenders(m, "forward", kjt, g).items():
            got = f()
            diff = float((got - want).abs().max()) if tuple(got.shape) == tuple(want.shape) else float("inf")
            checks[f"{case} forward {name}"] = diff
            if not diff <= TOL:
                raise SystemExit(f"FAILED: {case}: the {name} forward differs from TorchRec's by {diff:.3e} "
                                 f"(shapes {tuple(got.shape)} / {tuple(want.shape)}; tolerance {TOL})")
        seq = contenders(m, "sequence", kjt, g)
        diff = float((seq["embedcore"]() - seq["torchrec"]()).abs().max())
        checks[f"{case} sequence embedcore"] = diff
        if not diff <= TOL:
            raise SystemExit(f"FAILED: {case}: the EmbeddingCollection's rows differ from TorchRec's by {diff:.3e}")
        seq_steps = contenders(m, "sequence_train", kjt, g, gs)
        for f in seq_steps.values():
            f()
        diff = max(float((m["ec_seq_fused"].embeddings[n].weight.detach() - m["torchrec_seq_train"].embeddings[n].weight
                          .detach()).abs().max()) for n in names)
        checks[f"{case} sequence_train embedcore"] = diff
        if not diff <= TOL:
            raise SystemExit(f"FAILED: {case}: after one SGD step, the EmbeddingCollection's tables differ from "
                             f"TorchRec + SGD's by {diff:.3e}")
        steps = contenders(m, "train", kjt, g)
        steps["torchrec"]()
        want = [t.detach().clone() for t in tables_of(m, "torchrec")]
        moved = max(float((a - b).abs().max()) for a, b in zip(want, w0))
        if not moved > 0:
            raise SystemExit(f"FAILED: {case}: one TorchRec + SGD step left every table unchanged")
        for name in ("embedcore", "embedcore_unfused", "fbgemm"):
            steps[name]()
            diffs = [float((t.detach() - w).abs().max()) for t, w in zip(tables_of(m, name), want)]
            worst = int(np.argmax(diffs))
            checks[f"{case} train {name}"] = diffs[worst]
            if not diffs[worst] <= TOL:
                raise SystemExit(f"FAILED: {case}: after one SGD step, {name}'s table {names[worst]} differs from "
                                 f"TorchRec + SGD's by {diffs[worst]:.3e} (tolerance {TOL}; the step moved values "
                                 f"by up to {moved:.3e})")
        rowwise = contenders(m, "train_rowwise", kjt, g)
        for f in rowwise.values():
            f()
        ours = [m["ec_rowwise"].embedding_bags[n] for n in names]
        fb_tables = m["fbgemm_rowwise"].split_embedding_weights()
        fb_acc = [a[0] for a in m["fbgemm_rowwise"].split_optimizer_states()]
        value_diff = max(float((o.weight.detach() - w).abs().max()) for o, w in zip(ours, fb_tables))
        acc_diff = max(float(np.abs(o._table.slots()["row_accumulators"][:, 0] - a.numpy()).max())
                       / max(1.0, float(a.abs().max())) for o, a in zip(ours, fb_acc))
        diff = max(value_diff, acc_diff)
        checks[f"{case} train_rowwise embedcore"] = diff
        if not diff <= TOL or not max(float(a.abs().max()) for a in fb_acc) > 0:
            raise SystemExit(f"FAILED: {case}: after one row-wise Adagrad step, embedcore's tables or accumulators "
                             f"differ from FBGEMM's by {diff:.3e} (tolerance {TOL}, relative for accumulators)")
        C.log(f"{case}: {nnz} ids; forward max |diff| vs TorchRec "
              + ", ".join(f"{n} {checks[f'{case} forward {n}']:.1e}" for n in CONTENDERS["forward"])
              + "; one SGD step " + ", ".join(f"{n} {checks[f'{case} train {n}']:.1e}"
                                              for n in ("embedcore", "embedcore_unfused", "fbgemm"))
              + f"; one row-wise Adagrad step vs FBGEMM {checks[f'{case} train_rowwise embedcore']:.1e}")
        del m

    # ------------------------------------------------------------ timing
    results, noise = [], {}
    m = build()  # fresh modules: the checks above stepped theirs
    for case, (kjt, g, nnz, gs) in data.items():
        for op in ("forward", "train", "train_rowwise", "sequence", "sequence_train"):
            C.log(f"timing {case} {op}: {repeats} rounds ...")
            timing = C.run_rounds(contenders(m, op, kjt, g, gs), repeats, warmup, monitor_pids=[],
                                  max_seconds=max_seconds)
            noise[(case, op)] = timing.info()
            med = {n: C.summarize(timing.kept_samples(n))["median_s"] for n in CONTENDERS[op]}
            for n in CONTENDERS[op]:
                st = C.summarize(timing.kept_samples(n))
                results.append({"case": case, "op": op, "contender": n, "nnz": nnz, **st,
                                "ms": st["median_s"] * 1e3,
                                "vs_torchrec": med[n] / med["torchrec"] if "torchrec" in med else None,
                                "vs_fbgemm": med[n] / med["fbgemm"] if "fbgemm" in med else None,
                                "rounds": timing.used,
                                "samples_s": timing.samples[n]})

    # ------------------------------------------------------------ report
    total_rows = sum(c.num_embeddings for c in configs)
    print(f"\n{WORKLOAD}: {TABLES} tables x dim {DIM} float32 (1,000 + 3,000 i rows, {total_rows:,} in all), sum;"
          f" KeyedJaggedTensor, uniform ids; train = forward + backward + SGD (lr {LR}), train_rowwise the same "
          f"with row-wise Adagrad (eps {EPS}), sequence an EmbeddingCollection's rows, "
          f"sequence_train its SGD step; 1 thread; "
          f"median of {repeats} interleaved rounds")
    cols = [("case", "case", None), ("op", "op", None), ("contender", "contender", None), ("ms", "ms", "{:.3f}"),
            ("vs_torchrec", "time / torchrec", "{:.2f}x"), ("vs_fbgemm", "time / fbgemm", "{:.2f}x")]
    print(C.format_table(results, cols))
    vers = C.versions()
    C.print_footer(noise, vers, t_start)
    if args.json:
        C.write_json(args.json, {"workload": f"{WORKLOAD} DLRM-shaped collection", "tables": TABLES, "dim": DIM,
                                 "lr": LR, "repeats": repeats, "warmup": warmup, "machine": C.machine_info(),
                                 "versions": vers, "checks": checks, "results": results,
                                 "noise": {f"{k[0]} {k[1]}": v for k, v in noise.items()}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
