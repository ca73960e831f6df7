"""Serving lookups by storage dtype: one checkpoint of W1's table (1,000,000
x 128, 4,096 bags of 32 ids, sum) exported as float32, float16 and
uint8_rowwise (save(..., values_dtype=...)) and served with
ec.serving.open, against FBGEMM's CPU 8-bit row-wise embedding bags:

- `torch_byte_rowwise`: torch.ops.quantized.embedding_bag_byte_rowwise_offsets
  (FBGEMM's fused 8-bit row-wise kernel in PyTorch) on the very rows of the
  uint8_rowwise file (codes, float32 scale and bias: the same layout), sum;
- the float32 checkpoint resharded as a 2-rank save leaves it (64 MiB files:
  row blocks, or column bands whose rows come from two files), served from
  its several files (rows gathered, then pooled), timed against one file;
- the float32 checkpoint saved to a disk (the temp dir, or
  $EMBEDCORE_BENCH_DISK; the others go to /dev/shm when it has room), served
  from the page cache its save left (`float32_disk`), and saved again with its
  page cache dropped (posix_fadvise) before it is opened
  (`float32_disk_read_cold`: read in through the served mapping, as a server
  reads a checkpoint another machine wrote); the three float32 files are
  timed against the in-memory table's own lookup (`table`), and the MiB of
  each mapped on 2 MiB pages is printed;
- `fbgemm_tbe_int8`: fbgemm_gpu's IntNBitTableBatchedEmbeddingBagsCodegen
  with one SparseType.INT8 table on the CPU (TorchRec's quantized inference
  path; its rows keep a float16 scale and bias, filled with its own random
  weights: timed, not compared).

    python benchmarks/bench_serving_dtypes.py [--quick] [--threads 1,2] [--repeats N] [--json PATH]

Reports per thread count and id distribution the median ms per batch and M
ids/s of each, the bytes a lookup gathers per id (512 / 256 / 136), and the
ratios uint8_rowwise / float32, uint8_rowwise / float16 and uint8_rowwise /
torch_byte_rowwise (rates). Before timing it checks the served uint8_rowwise
lookups against torch_byte_rowwise's (the same bits), the float16
checkpoint's rows against the table's (rounded once) and its lookups against
float32 sums of those rows (within 1e-5 relative), and the float32
checkpoint's against the table's (exact).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

import embedcore as ec  # noqa: E402


def _filesystem(path: str) -> str:
    """The type of the filesystem that holds `path` (/proc/mounts: the
    longest mount point above it)."""
    real, best = os.path.realpath(path), ("", "unknown")
    try:
        with open("/proc/mounts") as f:
            for line in f:
                point, kind = line.split()[1:3]
                if (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) > len(best[0]):
                    best = (point, kind)
    except OSError:
        pass
    return best[1]


def _file_pmd_mapped_mib(directory: str) -> int:
    """MiB of this process's mappings of `directory`'s values files that are
    mapped on 2 MiB pages (``FilePmdMapped`` in /proc/self/smaps; 0 where
    there is no such file)."""
    kib, mine = 0, False
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split()
                if head and "-" in head[0] and len(head) >= 5:  # a mapping's first line: range perms ... [path]
                    mine = (len(head) >= 6 and head[5].startswith(os.path.realpath(directory) + os.sep)
                            and head[5].endswith(".ecd"))
                elif mine and head and head[0] == "FilePmdMapped:":
                    kib += int(head[1])
    except OSError:
        return 0
    return kib >> 10


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="200,000 rows, fewer repeats")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    rows = 200_000 if args.quick else C.ROWS
    repeats = args.repeats or (5 if args.quick else 15)
    threads = [int(t) for t in args.threads.split(",")]
    t_start = time.perf_counter()

    import torch

    try:
        import fbgemm_gpu  # noqa: F401
        have_fbgemm = True
    except ImportError:
        have_fbgemm = False

    rng = np.random.default_rng(0)
    values = (rng.standard_normal((rows, C.DIM), dtype=np.float32) * 0.05)
    table = ec.Table(name="w1", rows=rows, dim=C.DIM, dtype="float32", combiner="sum",
                     initializer=ec.initializers.Zeros())
    table.assign(values, 0)
    del values
    scratch = C.scratch_dir()
    served, disk = {}, None
    try:
        for dtype in ("float32", "float16", "uint8_rowwise"):
            path = os.path.join(scratch, dtype)
            ec.save(path, table, include_optimizer=False, values_dtype=dtype)
            served[dtype] = ec.serving.open(path, verify="eager").tables["w1"]
        # The float32 checkpoint on a disk (the scratch above is /dev/shm when it has room, whose tmpfs pages are
        # 4 KiB unless shmem huge pages are enabled), served from the page cache its save left (the save's 256
        # KiB writes: small folios, 4 KiB mappings), and saved once more with its page cache dropped before it
        # is opened: read in through the served mapping in 2 MiB folios, mapped on huge pages, as a server
        # reading a checkpoint another machine wrote. The in-memory table is timed too.
        disk = tempfile.mkdtemp(prefix="embedcore-bench-", dir=os.environ.get("EMBEDCORE_BENCH_DISK"))
        C.log(f"disk checkpoints in {disk} ({_filesystem(disk)})")
        for k in ("float32_disk", "float32_disk_read_cold"):
            path = os.path.join(disk, k)
            ec.save(path, table, include_optimizer=False)
            if k.endswith("cold"):
                for entry in os.listdir(path):
                    if entry.endswith(".ecd"):
                        fd = os.open(os.path.join(path, entry), os.O_RDONLY)
                        try:
                            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # (clean after the save's fsync)
                        finally:
                            os.close(fd)
            served[k] = ec.serving.open(path, verify="eager").tables["w1"]
        for k, where in (("float32", scratch), ("float32_disk", disk), ("float32_disk_read_cold", disk)):
            C.log(f"served {k}: {_file_pmd_mapped_mib(os.path.join(where, k))} MiB of its values file mapped on "
                  "2 MiB pages (FilePmdMapped)")
        # The float32 checkpoint as a sharded save leaves it (2 ranks, 64 MiB files): rows gathered from the files,
        # then pooled (row blocks; column bands: each row from two files).
        from embedcore.distributed import reshard

        for plan in ("row_wise", "column_wise"):
            path = os.path.join(scratch, plan)
            reshard(os.path.join(scratch, "float32"), path, 2, plan, max_file_bytes=64 << 20)
            files = sum(len(t["values"]) for t in json.loads(ec.checkpoint.read_info(path).manifest_json)["tables"])
            served[f"float32_{plan}_{files}_files"] = ec.serving.open(path, verify="eager").tables["w1"]
        # FBGEMM's rows: the uint8_rowwise file's payload, as torch's [rows, dim + 8] uint8.
        (entry,) = [f for f in os.listdir(os.path.join(scratch, "uint8_rowwise")) if f.endswith(".ecd")]
        with open(os.path.join(scratch, "uint8_rowwise", entry), "rb") as f:
            f.seek(4096)
            q8 = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8).reshape(rows, C.DIM + 8)
        off = C.offsets()
        ids = {d: C.make_ids(d, rows=rows) for d in C.DISTS}
        off_t = torch.from_numpy(off)
        ids_t = {d: torch.from_numpy(i) for d, i in ids.items()}
        tbe = None
        if have_fbgemm:
            from fbgemm_gpu.split_embedding_configs import SparseType
            from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
            from fbgemm_gpu.split_table_batched_embeddings_ops_inference import IntNBitTableBatchedEmbeddingBagsCodegen

            tbe = IntNBitTableBatchedEmbeddingBagsCodegen([("w1", rows, C.DIM, SparseType.INT8, EmbeddingLocation.HOST)],
                                                          device="cpu", pooling_mode=PoolingMode.SUM)
            tbe.fill_random_weights()
            ids32 = {d: i.int() for d, i in ids_t.items()}
            off32 = off_t.int()

        # Correctness first.
        for d in C.DISTS:
            for k, s in served.items():
                if k.startswith("float32"):  # (in one file or several: the table's bits)
                    np.testing.assert_array_equal(s.lookup(ids[d], off), table.lookup(ids[d], off))
            got = served["uint8_rowwise"].lookup(ids[d], off)
            ref = torch.ops.quantized.embedding_bag_byte_rowwise_offsets(q8, ids_t[d], off_t, False, 0, False, None,
                                                                           None, True).numpy()
            if got.tobytes() != ref.tobytes():  # FBGEMM's arithmetic, fused multiply-adds included: its bits
                err = float(np.abs(got - ref).max() / max(1e-30, np.abs(ref).max()))
                raise SystemExit(f"uint8_rowwise lookups differ from FBGEMM's bits (by {err:.2e}, relative): "
                                 "stopping")
            C.log(f"{d}: served uint8_rowwise vs torch_byte_rowwise: the same bits")
            rows16 = served["float16"].values()[ids[d]].astype(np.float32)  # the table's rows, rounded once
            np.testing.assert_allclose(rows16, table.values()[ids[d]], rtol=2.0**-11, atol=2.0**-24)
            np.testing.assert_allclose(served["float16"].lookup(ids[d], off),
                                       np.add.reduceat(rows16, off[:-1], axis=0), rtol=1e-5, atol=1e-6)

        results = []
        for nt in threads:
            C.set_threads(nt)
            for d in C.DISTS:
                contenders = {f"ec_{k}": (lambda s=s, i=ids[d]: s.lookup(i, off)) for k, s in served.items()}
                contenders["ec_table"] = lambda i=ids[d]: table.lookup(i, off)
                contenders["torch_byte_rowwise"] = lambda i=ids_t[d]: torch.ops.quantized.embedding_bag_byte_rowwise_offsets(
                    q8, i, off_t, False, 0, False, None, None, True)
                if tbe is not None:
                    contenders["fbgemm_tbe_int8"] = lambda i=ids32[d]: tbe(i, off32)
                samples = C.run_interleaved(contenders, repeats)
                med = {k: C.summarize(v)["median_s"] for k, v in samples.items()}
                for k, m in med.items():
                    results.append({"threads": nt, "ids": d, "contender": k, "ms": 1e3 * m, "Mids_s": C.NNZ / m / 1e6})
                r = lambda a, b: med[b] / med[a]  # noqa: E731 - rate of a over rate of b
                results.append({"threads": nt, "ids": d, "contender": "u8 / f32, u8 / f16, u8 / torch_byte",
                                "ms": None, "Mids_s": None,
                                "ratios": (r("ec_uint8_rowwise", "ec_float32"), r("ec_uint8_rowwise", "ec_float16"),
                                           r("ec_uint8_rowwise", "torch_byte_rowwise"))})
                for k in ("ec_float32", "ec_float32_disk", "ec_float32_disk_read_cold"):  # against the table
                    results.append({"threads": nt, "ids": d, "contender": f"{k[3:]} / table time", "ms": None,
                                    "Mids_s": None, "ratio": med[k] / med["ec_table"]})
                for k in med:
                    if k.startswith("ec_float32_") and "files" in k:  # several files: time against one file's
                        results.append({"threads": nt, "ids": d, "contender": f"{k[3:]} / float32 time",
                                        "ms": None, "Mids_s": None, "ratio": med[k] / med["ec_float32"]})
        print(f"\nserving lookups, {rows} x {C.DIM}, {C.BATCH} bags of {C.BAG}, sum; median of {repeats}")
        print(f"bytes gathered per id: float32 {C.DIM * 4}, float16 {C.DIM * 2}, uint8_rowwise {C.DIM + 8}")
        print(f"{'threads':>7} {'ids':>8} {'contender':<22} {'ms':>8} {'M ids/s':>9}")
        for row in results:
            if "ratio" in row:
                print(f"{row['threads']:>7} {row['ids']:>8}   time {row['contender']}: {row['ratio']:.2f}x")
            elif row["ms"] is None:
                a, b, c = row["ratios"]
                print(f"{row['threads']:>7} {row['ids']:>8} {'  rate u8/f32, u8/f16, u8/torch_byte':<22}   "
                      f"{a:.2f}x {b:.2f}x {c:.2f}x")
            else:
                print(f"{row['threads']:>7} {row['ids']:>8} {row['contender']:<22} {row['ms']:>8.2f} "
                      f"{row['Mids_s']:>9.1f}")
        if args.json:
            C.write_json(args.json, {"rows": rows, "dim": C.DIM, "repeats": repeats, "results": results,
                                     "machine": C.machine_info(), "versions": C.versions()})
        print(f"\n{time.perf_counter() - t_start:.0f} s")
    finally:
        served.clear()
        shutil.rmtree(scratch, ignore_errors=True)
        if disk is not None:
            shutil.rmtree(disk, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
