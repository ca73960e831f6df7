"""Serving W4 (bench_collection.py's DLRM-shaped collection: 26 tables of
1,000 + 3,000 i rows, dim 16, sum, one feature each) in TorchRec's inference
shape, a ``KeyedJaggedTensor`` in and a ``KeyedTensor`` out, at 1 thread,
under ``torch.inference_mode()``:

- ``ec_served_f32`` / ``ec_served_f16`` / ``ec_served_u8``:
  ``embedcore.adapters.torch.ServedEmbeddingBagCollection`` over exports of
  the same weights as float32, float16 and uint8_rowwise
  (``ec.save(..., values_dtype=...)``), memory-mapped;
- ``ec_training``: the training ``EmbeddingBagCollection`` holding them
  (float32, its one-call forward): what a served module adds or saves;
- ``torchrec_int8``: TorchRec's INT8 inference module,
  ``torchrec.quant.embedding_modules.EmbeddingBagCollection.from_float`` (what
  ``quantize_inference_model`` makes: FBGEMM's
  ``IntNBitTableBatchedEmbeddingBagsCodegen``, INT8 rows, on the CPU);
- ``fbgemm_tbe_int8``: that TBE alone, called on the KJT's values and
  offsets (int32), without TorchRec's module around it (as
  bench_serving_dtypes.py drives it).

Cases: one-hot batches (``--batches``, default 16, 256, 4096) and a
multi-hot batch of 256 (bags of 0..20 ids). Before timing, the served
float32 module's output is checked against the training module's (bit for
bit), the float16 one's against the training module's (within 5e-3 of the
largest output) and the uint8_rowwise one's against TorchRec's INT8 (within
0.05 of the largest output: TorchRec quantizes the rows on its own and keeps
float16 scales and biases), so that a table zeroed or read a row off fails.

    python benchmarks/bench_torch_serving.py [--quick] [--repeats N] [--batches 16,256,4096] [--json PATH]

Reports the median ms per batch of each and the ratios of time
ec_served_u8 / torchrec_int8, ec_served_u8 / fbgemm_tbe_int8 and
ec_served_f32 / ec_training (below 1: faster).
"""
from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402
from bench_collection import DIM, TABLES, make_kjt, table_rows  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds (a smoke run)")
    ap.add_argument("--repeats", type=int, help="timed rounds per case (default 30, 5 with --quick)")
    ap.add_argument("--batches", default="16,256,4096", help="one-hot batch sizes (default 16,256,4096)")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    repeats = args.repeats or (5 if args.quick else 30)
    batches = [int(x) for x in args.batches.split(",") if x]
    t_start = time.time()

    logging.disable(logging.INFO)
    import torch
    import torch.ao.quantization as tq
    import torchrec
    from torchrec.quant.embedding_modules import EmbeddingBagCollection as QuantEmbeddingBagCollection

    import embedcore as ec
    import embedcore.adapters.torch as et

    C.set_threads(1)
    configs = [torchrec.EmbeddingBagConfig(num_embeddings=table_rows(i), embedding_dim=DIM, name=f"t{i}",
                                           feature_names=[f"f{i}"]) for i in range(TABLES)]
    torch.manual_seed(0)
    training = et.EmbeddingBagCollection(configs)
    ref = torchrec.EmbeddingBagCollection(tables=configs, device=torch.device("cpu"))
    ref.load_state_dict(training.state_dict())
    ref.qconfig = tq.QConfig(activation=tq.PlaceholderObserver.with_args(dtype=torch.float),
                             weight=tq.PlaceholderObserver.with_args(dtype=torch.qint8))
    quant = QuantEmbeddingBagCollection.from_float(ref)
    (tbe,) = quant._emb_modules  # (one TBE for the 26 INT8 tables of one pooling)
    scratch = C.scratch_dir()
    served = {}
    try:
        for short, dtype in (("f32", "float32"), ("f16", "float16"), ("u8", "uint8_rowwise")):
            path = os.path.join(scratch, dtype)
            ec.save(path, training, include_optimizer=False, values_dtype=dtype)
            served[short] = et.ServedEmbeddingBagCollection(path, configs, verify="eager")

        cases = [(f"b{b}", b, False) for b in batches] + [("b256_multihot", 256, True)]
        results = []
        for case, batch, multihot in cases:
            kjt = make_kjt(torchrec, batch, multihot, seed=batch)
            values32, offsets32 = kjt.values().int(), kjt.offsets().int()
            with torch.inference_mode():
                if not torch.equal(served["f32"](kjt).values(), training(kjt).values()):
                    raise SystemExit(f"{case}: the served float32 module differs from the training one: stopping")
                # Relative to the outputs' size (a table's values are within +-sqrt(1 / rows)): a table's bags
                # zeroed, or read one row off, must fail this. TorchRec quantizes the same values on its own:
                # not its bits, within a few steps of the 8-bit grid; float16 within its rounding.
                want, want8 = training(kjt).values(), quant(kjt).values()
                err = float((served["u8"](kjt).values() - want8).abs().max() / want8.abs().max())
                if err > 0.05:
                    raise SystemExit(f"{case}: the served uint8_rowwise module differs from TorchRec's INT8 by {err:.2e}"
                                     " of the largest output")
                err = float((served["f16"](kjt).values() - want).abs().max() / want.abs().max())
                if err > 5e-3:
                    raise SystemExit(f"{case}: the served float16 module differs from the training one by {err:.2e} "
                                     "of the largest output")

            def inference(f):
                def run():
                    with torch.inference_mode():
                        return f()
                return run

            contenders = {f"ec_served_{k}": inference(lambda m=m: m(kjt).values()) for k, m in served.items()}
            contenders["ec_training"] = inference(lambda: training(kjt).values())
            contenders["torchrec_int8"] = inference(lambda: quant(kjt).values())
            contenders["fbgemm_tbe_int8"] = inference(lambda: tbe(values32, offsets32))
            samples = C.run_interleaved(contenders, repeats)
            med = {k: C.summarize(v)["median_s"] for k, v in samples.items()}
            results.append({"case": case, "batch": batch, "ids": int(kjt.values().numel()),
                            "ms": {k: 1e3 * v for k, v in med.items()},
                            "ratios": {"u8/torchrec_int8": med["ec_served_u8"] / med["torchrec_int8"],
                                       "u8/fbgemm_tbe_int8": med["ec_served_u8"] / med["fbgemm_tbe_int8"],
                                       "f32/ec_training": med["ec_served_f32"] / med["ec_training"]}})
        names = list(results[0]["ms"])
        print(f"\nW4 served: {TABLES} tables x dim {DIM}, sum, KeyedJaggedTensor -> KeyedTensor, 1 thread; "
              f"median ms of {repeats}")
        print(f"{'case':<15}" + "".join(f"{n:>17}" for n in names) + "   u8/trec_int8  u8/tbe_int8  f32/training")
        for r in results:
            q = r["ratios"]
            ratios = f"{q['u8/torchrec_int8']:>11.2f}x {q['u8/fbgemm_tbe_int8']:>10.2f}x {q['f32/ec_training']:>11.2f}x"
            print(f"{r['case']:<15}" + "".join(f"{r['ms'][n]:>17.3f}" for n in names) + "   " + ratios)
        if args.json:
            C.write_json(args.json, {"workload": "W4 served", "repeats": repeats, "results": results,
                                     "machine": C.machine_info(), "versions": C.versions()})
        print(f"\n{time.time() - t_start:.0f} s")
    finally:
        served.clear()
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
