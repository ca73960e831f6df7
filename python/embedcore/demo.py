"""``embedcore demo``: the main job on embedded defaults.

A click-through model on synthetic data: two tables ("user" and "item"),
three features (the user, the candidate item, and the user's recent items as a
mean-pooled bag sharing the item table), pooled embeddings into a logistic
regression written in NumPy. The embeddings train with the engine's Adagrad,
the dense layer with plain SGD. The clicks come from hidden per-id scores,
so the loss can fall well below log(2); a run of 100 steps or more fails
(exit status 1) when the mean loss of its last full window of 50 steps
(steps 51-100, 101-150, ...; a shorter window at the end is shown, not
judged) is not below that of its first 50.
"""
from __future__ import annotations

import os
import sys
import tempfile
import time

import numpy as np

import embedcore as ec

USERS, ITEMS, DIM, HISTORY = 2_000, 10_000, 16, 8


def _synthetic(rng: np.random.Generator, batch: int, user_score, item_score):
    users = rng.integers(0, USERS, batch)
    items = rng.integers(0, ITEMS, batch)
    lengths = rng.integers(0, HISTORY + 1, batch)
    history = rng.integers(0, ITEMS, int(lengths.sum()))
    logit = user_score[users] + item_score[items]
    clicks = (rng.random(batch) < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
    features = {"user": users, "item": items, "history": ec.Ragged.from_lengths(history, lengths)}
    return features, clicks


def run(steps: int = 300, batch_size: int = 1024, threads=None, seed: int = 0, checkpoint=None,
        overwrite: bool = False) -> int:
    for name, value in (("steps", steps), ("batch_size", batch_size)):
        if value < 1:
            raise ValueError(f"demo: {name} must be >= 1, got {value}")
    if seed < 0:
        raise ValueError(f"demo: seed must be >= 0, got {seed}")
    if checkpoint is not None:  # before training, not after it: "" is no directory to keep the model in
        from .checkpoint import absolute_path, check_destination, native_path
        checkpoint = native_path(checkpoint, "demo: checkpoint")
        check_destination(checkpoint)  # another program's MANIFEST: refused whatever `overwrite` says
        if os.path.lexists(os.path.join(checkpoint, "MANIFEST")) and not overwrite:
            raise ValueError(f"demo: {checkpoint} already holds a checkpoint; pass --overwrite to replace it")
        parent = os.path.dirname(absolute_path(checkpoint))
        if not os.path.isdir(parent):
            raise ValueError(f"demo: checkpoint {checkpoint}: no directory {parent} to save it in")
        if os.path.exists(checkpoint) and not os.path.isdir(checkpoint):
            raise ValueError(f"demo: checkpoint {checkpoint} is a file, not a directory")
    if threads is not None:
        ec.set_num_threads(threads)
    rng = np.random.default_rng(seed)
    user_score = rng.normal(0.0, 1.5, USERS)
    item_score = rng.normal(0.0, 1.5, ITEMS)

    user_table = ec.TableConfig("user", USERS, DIM, initializer=ec.initializers.Uniform(-0.05, 0.05, seed=1))
    item_table = ec.TableConfig("item", ITEMS, DIM, initializer=ec.initializers.Uniform(-0.05, 0.05, seed=2))
    features = {
        "user": ec.FeatureConfig(user_table, name="user"),
        "item": ec.FeatureConfig(item_table, name="item"),
        "history": ec.FeatureConfig(item_table, name="history"),
    }
    emb = ec.Embedding(features, optimizer=ec.optimizers.Adagrad(learning_rate=0.5))
    width = 3 * DIM
    w = rng.normal(0.0, 1.0, width).astype(np.float32)
    b = np.float32(0.0)
    dense_lr = 0.5

    print(f"embedcore {ec.__version__} demo: tables user {USERS}x{DIM}, item {ITEMS}x{DIM}; "
          f"{steps} steps of {batch_size}, Adagrad, {ec.get_num_threads()} threads")
    full = []  # the mean loss of each full window of 50 steps: the first and the last are compared
    window = []
    start = time.perf_counter()
    for step in range(1, steps + 1):
        feats, clicks = _synthetic(rng, batch_size, user_score, item_score)
        out = emb(feats)
        x = np.concatenate([out["history"], out["item"], out["user"]], axis=1)  # keys in sorted order
        logits = x @ w + b
        p = 1.0 / (1.0 + np.exp(-logits))
        eps = 1e-7
        loss = float(-np.mean(clicks * np.log(p + eps) + (1 - clicks) * np.log(1 - p + eps)))
        window.append(loss)
        dlogit = ((p - clicks) / batch_size).astype(np.float32)
        grad_x = np.outer(dlogit, w).astype(np.float32)
        w -= dense_lr * (x.T @ dlogit)
        b -= dense_lr * dlogit.sum()
        emb.apply_gradients({"history": grad_x[:, :DIM], "item": grad_x[:, DIM:2 * DIM],
                             "user": grad_x[:, 2 * DIM:]})
        if step % 50 == 0 or step == steps:
            mean = float(np.mean(window))
            if len(window) == 50:
                full.append(mean)
            window.clear()
            print(f"  step {step:5d}  loss {mean:.4f}")
    train_s = time.perf_counter() - start

    # Lookup throughput of the trained item table: 4,096 bags of 32 ids.
    item = emb.embedding_tables[item_table]
    ids = rng.integers(0, ITEMS, 4096 * 32)
    offsets = np.arange(0, ids.size + 1, 32, dtype=np.int64)
    item.lookup(ids, offsets, combiner="sum")
    reps, t0 = 20, time.perf_counter()
    for _ in range(reps):
        item.lookup(ids, offsets, combiner="sum")
    rate = reps * ids.size / (time.perf_counter() - t0)
    fell = f"; loss {full[0]:.4f} -> {full[-1]:.4f} (first and last 50 steps)" if len(full) >= 2 else ""
    print(f"trained {steps} steps in {train_s:.2f} s{fell}")
    print(f"lookup throughput: {rate / 1e6:.1f} M ids/s (sum of 32-id bags, dim {DIM})")
    if len(full) >= 2 and not full[-1] < full[0]:  # judged over full windows only
        print("error: the loss did not fall", file=sys.stderr)
        return 1

    # Save the model, reopen it for serving (memory-mapped, no optimizer) and
    # check that serving returns what training returns.
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ctr-model") if checkpoint is None else checkpoint
        t0 = time.perf_counter()
        ec.save(path, emb)
        save_ms = (time.perf_counter() - t0) * 1e3
        t0 = time.perf_counter()
        served = ec.serving.open(path)
        open_ms = (time.perf_counter() - t0) * 1e3
        feats, _ = _synthetic(rng, 256, user_score, item_score)
        trained, serving = emb(feats), served(feats)
        same = all(np.array_equal(trained[k], serving[k]) for k in trained)
        where = path if checkpoint is not None else "a temporary directory (--checkpoint DIR keeps it)"
        print(f"saved to {where} in {save_ms:.1f} ms; opened for serving in {open_ms:.2f} ms; "
              f"serving {'matches' if same else 'DIFFERS FROM'} training on a fresh batch")
        if not same:
            print("error: serving differs from training", file=sys.stderr)
            return 1
    return 0
