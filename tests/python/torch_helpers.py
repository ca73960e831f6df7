"""Shared pieces of the PyTorch adapter tests (tests/python/test_torch_*.py):
random bags as tensors, and the PyTorch reference modules and optimizers
that the adapter is compared with."""
from __future__ import annotations

import numpy as np
import torch

import embedcore as ec


def bags(rng, rows, batch, max_len=6, id_dtype=torch.int64, weighted=False, pad=None):
    """1-D ids and CSR offsets ``[batch + 1]`` with empty bags, bags of one,
    repeated ids (and, with `pad`, some padding ids). Returns (ids, offsets,
    weights or None) as tensors."""
    lengths = rng.integers(1, max_len + 1, size=batch)
    if batch:
        lengths[::4] = 0
        lengths[1::5] = 1
    offsets = np.zeros(batch + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    nnz = int(offsets[-1])
    pool = rng.choice(rows, size=min(rows, max(1, nnz // 2 + 1)), replace=False)
    ids = pool[rng.integers(0, len(pool), size=nnz)]
    if pad is not None and nnz:
        ids[rng.random(nnz) < 0.2] = pad
    weights = torch.from_numpy(rng.uniform(0.25, 2.0, size=nnz).astype(np.float32)) if weighted else None
    return torch.from_numpy(ids).to(id_dtype), torch.from_numpy(offsets), weights


def uniform_weights(rng, rows, dim):
    return torch.from_numpy(rng.uniform(-1.0, 1.0, size=(rows, dim)).astype(np.float32))


# The adapter's fused optimizer and the PyTorch optimizer it matches, by name.
def engine_optimizer(name, lr):
    if name == "sgd":
        return ec.optimizers.SGD(learning_rate=lr)
    if name == "adagrad":
        return ec.optimizers.Adagrad(learning_rate=lr, initial_accumulator_value=0.1)
    if name == "adam":
        return ec.optimizers.Adam(learning_rate=lr, bias_correction=True, sum_inside_sqrt=False, epsilon=1e-8)
    raise ValueError(name)


def torch_optimizer(name, params, lr):
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if name == "adagrad":
        # The engine's Adagrad (TensorFlow's): no epsilon, accumulators start at 0.1.
        return torch.optim.Adagrad(params, lr=lr, initial_accumulator_value=0.1, eps=1e-10)
    if name == "adam":
        return torch.optim.SparseAdam(params, lr=lr)
    raise ValueError(name)


def max_diff(a, b) -> float:
    a = a.to_dense() if a.is_sparse else a
    b = b.to_dense() if b.is_sparse else b
    return float((a.detach().double() - b.detach().double()).abs().max()) if a.numel() else 0.0
