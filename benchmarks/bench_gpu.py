"""GPU benchmark W1g: embedcore's CUDA tables against PyTorch's embedding_bag.

Workload W1g: a 10,000,000 x 128 float32 table on the GPU, 65,536 bags of
32 ids, sum combiner, ids uniform or Zipf(1.05) over the whole vocabulary.
Contenders, in one run:

- ``embedcore``: ``Table(device="cuda").lookup(ids, offsets)`` (forward), and
  forward + ``apply_gradients`` with SGD (a fused sparse update);
- ``torch``: ``torch.nn.functional.embedding_bag(mode="sum")`` on the same
  weights (forward), and ``nn.EmbeddingBag(sparse=True)`` + ``torch.optim.SGD``
  (forward, backward, step);
- ``adapter``: ``embedcore.adapters.torch.EmbeddingBag(device="cuda")`` with
  the engine's fused SGD: forward, and forward + backward (the update runs
  inside backward);
- ``copy``: a device-to-device copy of 2 GiB, the machine's bandwidth yardstick.

Reported: time per batch (median of CUDA-event-timed repeats), effective
gathered bandwidth (ids x 512 B / s), its ratio to the copy bandwidth
(counting the copy's bytes read and written), and embedcore / torch ratios.
Targets (issue #8): forward >= 60% of the copy bandwidth and >= 1.5x
PyTorch's embedding_bag.

    python benchmarks/bench_gpu.py [--quick] [--json gpu.json] [--repeats N]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

import numpy as np

ROWS, DIM, BATCH, BAG = 10_000_000, 128, 65_536, 32


def zipf_ids(n, rows, exponent=1.05, seed=2):
    """Zipf ids over the whole vocabulary, ranks mapped to ids by a fixed permutation."""
    rng = np.random.default_rng(seed)
    ranks = np.arange(1, rows + 1, dtype=np.float64)
    cdf = np.cumsum(ranks ** -exponent)
    cdf /= cdf[-1]
    r = np.searchsorted(cdf, rng.random(n))
    perm = np.random.default_rng(12345).permutation(rows)
    return perm[np.minimum(r, rows - 1)].astype(np.int64)


def timed(fn, repeats, torch):
    """Median milliseconds of fn() over repeats, by CUDA events, after a warm-up."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return statistics.median(samples)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a 1,000,000-row table and fewer repeats")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    import torch

    import embedcore as ec

    if not torch.cuda.is_available() or ec.build_info()["cuda_devices"] < 1:
        print(f"bench_gpu: needs a GPU and the CUDA build (build_info: {ec.build_info()})", file=sys.stderr)
        return 2
    rows = 1_000_000 if args.quick else ROWS
    repeats = args.repeats or (10 if args.quick else 30)
    dev = torch.device("cuda:0")
    print(f"device: {torch.cuda.get_device_name(0)}; torch {torch.__version__}; embedcore {ec.__version__}")
    print(f"W1g: {rows:,} x {DIM} float32, {BATCH:,} bags x {BAG} ids, sum")

    # The yardstick: a device-to-device copy (bytes read + written).
    n = 1 << 29
    a = torch.empty(n, dtype=torch.float32, device=dev)
    b = torch.empty_like(a)
    copy_ms = timed(lambda: b.copy_(a), repeats, torch)
    copy_bw = 2 * n * 4 / (copy_ms / 1e3)
    del a, b
    print(f"copy: {copy_ms:.3f} ms for 2 x {n * 4 / 2**30:.0f} GiB -> {copy_bw / 1e9:.0f} GB/s")

    table = ec.Table(name="w1g", rows=rows, dim=DIM, initializer=ec.initializers.Uniform(-0.05, 0.05, seed=1),
                     optimizer=ec.optimizers.SGD(0.01), device="cuda:0")
    weight = torch.from_dlpack(table.values())  # the same memory: both read the same rows
    offsets = torch.arange(0, BATCH * BAG + 1, BAG, dtype=torch.int64, device=dev)
    grad = torch.randn(BATCH, DIM, device=dev)
    bag_module = torch.nn.EmbeddingBag(rows, DIM, mode="sum", sparse=True, device=dev)
    with torch.no_grad():
        bag_module.weight.copy_(weight)
    opt = torch.optim.SGD(bag_module.parameters(), lr=0.01)
    import embedcore.adapters.torch as et

    adapter = et.EmbeddingBag(rows, DIM, mode="sum", optimizer=ec.optimizers.SGD(0.01), device=dev, _weight=weight)

    results = []
    for dist in ("uniform", "zipf"):
        host_ids = (np.random.default_rng(1).integers(0, rows, BATCH * BAG) if dist == "uniform"
                    else zipf_ids(BATCH * BAG, rows))
        ids = torch.from_numpy(host_ids).to(dev)
        nbytes = ids.numel() * DIM * 4

        # Correctness first: the same bits as PyTorch's sum within float rounding.
        ours = table.lookup(ids, offsets, combiner="sum")
        theirs = torch.nn.functional.embedding_bag(ids, weight, offsets[:-1], mode="sum")
        err = (ours - theirs).abs().max().item()
        assert err < 1e-4, f"embedcore and torch disagree by {err}"

        fwd_ec = timed(lambda: table.lookup(ids, offsets, combiner="sum"), repeats, torch)
        fwd_t = timed(lambda: torch.nn.functional.embedding_bag(ids, weight, offsets[:-1], mode="sum"), repeats, torch)

        def step_ec():
            table.lookup(ids, offsets, combiner="sum")
            table.apply_gradients(ids, offsets, grad, combiner="sum")

        def step_t():
            opt.zero_grad(set_to_none=True)
            out = bag_module(ids, offsets[:-1])
            out.backward(grad)
            opt.step()

        def step_adapter():
            adapter(ids, offsets[:-1]).backward(grad)

        fwd_a = timed(lambda: adapter(ids, offsets[:-1]), repeats, torch)
        train_ec = timed(step_ec, max(5, repeats // 3), torch)
        train_t = timed(step_t, max(5, repeats // 3), torch)
        train_a = timed(step_adapter, max(5, repeats // 3), torch)
        bw = nbytes / (fwd_ec / 1e3)
        targets = {"forward >= 60% of copy bandwidth": bw / copy_bw >= 0.6,
                   "forward >= 1.5x torch": fwd_t / fwd_ec >= 1.5}
        row = {
            "dist": dist,
            "forward_ms": {"embedcore": fwd_ec, "torch": fwd_t, "adapter": fwd_a},
            "train_ms": {"embedcore": train_ec, "torch": train_t, "adapter": train_a},
            "gathered_GBps": bw / 1e9,
            "fraction_of_copy_bandwidth": bw / copy_bw,
            "forward_speedup_vs_torch": fwd_t / fwd_ec,
            "train_speedup_vs_torch": train_t / train_ec,
            "targets_met": targets,
        }
        results.append(row)
        print(f"{dist:8s} forward: embedcore {fwd_ec:.3f} ms, torch {fwd_t:.3f} ms ({fwd_t / fwd_ec:.2f}x); "
              f"gathered {bw / 1e9:.0f} GB/s = {bw / copy_bw:.0%} of copy "
              f"[targets: " + ", ".join(f"{k} {'PASS' if ok else 'FAIL'}" for k, ok in targets.items()) + "]")
        print(f"{dist:8s} train step: embedcore {train_ec:.3f} ms, torch {train_t:.3f} ms ({train_t / train_ec:.2f}x)")
        print(f"{dist:8s} adapter EmbeddingBag(device='cuda'): forward {fwd_a:.3f} ms ({fwd_t / fwd_a:.2f}x torch), "
              f"forward + fused SGD backward {train_a:.3f} ms ({train_t / train_a:.2f}x torch)")
    # The fixed cost of a call (Python, the launch, the check's read-back, the sync): one bag of 32 ids.
    one_ids, one_offsets = ids[:BAG], offsets[:2]
    small_ec = timed(lambda: table.lookup(one_ids, one_offsets, combiner="sum"), repeats, torch)
    small_t = timed(lambda: torch.nn.functional.embedding_bag(one_ids, weight, one_offsets[:-1], mode="sum"), repeats,
                    torch)
    print(f"one bag of {BAG} ids (the fixed cost of a call): embedcore {small_ec * 1e3:.0f} us, "
          f"torch {small_t * 1e3:.0f} us")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"workload": "W1g", "rows": rows, "copy_GBps": copy_bw / 1e9, "results": results,
                       "one_bag_us": {"embedcore": small_ec * 1e3, "torch": small_t * 1e3}}, f, indent=1)
    missed = [f"{r['dist']}: {k}" for r in results for k, ok in r["targets_met"].items() if not ok]
    if missed:
        print(f"targets missed (exit 3): {'; '.join(missed)}")
        return 3
    print("every target met")
    return 0


if __name__ == "__main__":
    sys.exit(main())
