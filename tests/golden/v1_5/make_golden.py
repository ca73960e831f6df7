"""Writes the golden checkpoint of format 1.5 (run once; the outputs are
committed and must load in every later version of embedcore, as the earlier
ones in tests/golden/v1, v1_2, v1_3 and v1_4 do).

    python tests/golden/v1_5/make_golden.py [OUT_DIR]   # default: this directory

Writes, under OUT_DIR:
  padding_idx/   the tables of two PyTorch adapter modules made with
                 padding_idx (format 1.5: config.padding_idx):
                 "bag", EmbeddingBag.from_pretrained(mode="mean",
                 padding_idx=2) of values whose padding row is not zero, and
                 "seq", Embedding.from_pretrained(padding_idx=0)
  expected.npz   the values, a batch of bags with padding ids (a bag of
                 padding ids only among them), and torch.nn.EmbeddingBag's
                 outputs for it (mean; sum with per_sample_weights) and
                 torch.nn.Embedding's rows (the padding rows as stored)
  SHA256SUMS     of every file above (tests/python/test_golden.py checks them)

Needs torch. Deterministic: fixed values and batches. Not regenerated later:
the files are what a 1.5 writer wrote.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import sys

import numpy as np
import torch

import embedcore as ec
import embedcore.adapters.torch as et

HERE = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location("make_golden_v1", os.path.join(HERE, os.pardir, "v1", "make_golden.py"))
_v1 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_v1)
CHECKPOINTS = ["padding_idx"]


def main(out=HERE):
    ec.set_num_threads(1)
    path = os.path.join(out, "padding_idx")
    shutil.rmtree(path, ignore_errors=True)
    rng = np.random.default_rng(150)
    bag_w = rng.uniform(-1, 1, (11, 4)).astype(np.float32)
    seq_w = rng.uniform(-1, 1, (7, 3)).astype(np.float32)
    model = torch.nn.ModuleDict({
        "bag": et.EmbeddingBag.from_pretrained(torch.from_numpy(bag_w), mode="mean", padding_idx=2,
                                               include_last_offset=True, name="bag"),
        "seq": et.Embedding.from_pretrained(torch.from_numpy(seq_w), padding_idx=0, name="seq")})
    ec.save(path, et.tables_of(model))
    ids = np.array([2, 1, 5, 2, 2, 2, 10, 3, 2, 0, 4], np.int64)
    offsets = np.array([0, 3, 3, 6, 9, 11], np.int64)  # bag 2: padding ids only; bag 1: empty
    weights = rng.uniform(0.25, 2.0, ids.shape[0]).astype(np.float32)
    seq_ids = np.array([0, 3, 0, 6, 1], np.int64)
    t = torch.from_numpy
    ref_mean = torch.nn.EmbeddingBag.from_pretrained(t(bag_w), mode="mean", padding_idx=2, include_last_offset=True)
    ref_sum = torch.nn.EmbeddingBag.from_pretrained(t(bag_w), mode="sum", padding_idx=2, include_last_offset=True)
    expected = {
        "bag/values": bag_w, "seq/values": seq_w, "ids": ids, "offsets": offsets, "weights": weights,
        "seq_ids": seq_ids,
        "bag/torch_mean": ref_mean(t(ids), t(offsets)).numpy(),
        "bag/torch_sum_weighted": ref_sum(t(ids), t(offsets), t(weights)).numpy(),
        "seq/torch_rows": torch.nn.Embedding.from_pretrained(t(seq_w), padding_idx=0)(t(seq_ids)).numpy(),
    }
    _v1._save_npz(os.path.join(out, "expected.npz"), expected)
    with open(os.path.join(out, "SHA256SUMS"), "w") as f:
        for rel, digest in _v1.sha256sums(out, CHECKPOINTS):
            f.write(f"{digest}  {rel}\n")
    print(f"wrote {len(CHECKPOINTS)} golden checkpoint(s), expected.npz ({len(expected)} arrays) and SHA256SUMS "
          f"to {out}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else HERE)
