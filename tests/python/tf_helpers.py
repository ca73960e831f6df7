"""Shared pieces of the TensorFlow adapter tests (tests/python/test_tf_*.py):
TensorFlow's TPUEmbeddingForServing and the adapter built on the same
configs and tables, random inputs of every form, and comparisons."""
from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
E = tf.tpu.experimental.embedding

RTOL = ATOL = 1e-6


def wide_values(rng, rows, dim):
    """Table values spread over many magnitudes, so that a different order of
    additions shows in the last bits of a sum."""
    return (rng.standard_normal((rows, dim)) * np.exp(rng.standard_normal((rows, dim)) * 2)).astype(np.float32)


def pair(feature_config, rng, optimizer=None):
    """(TensorFlow's TPUEmbeddingForServing, the adapter's EmbeddingForServing)
    on the same configs, with the same random tables."""
    from embedcore.adapters.tf import EmbeddingForServing

    theirs = E.TPUEmbeddingForServing(feature_config, optimizer)
    theirs.build()
    ours = EmbeddingForServing(feature_config, optimizer)
    for cfg, var in theirs.embedding_tables.items():
        v = wide_values(rng, cfg.vocabulary_size, cfg.dim)
        var.assign(v)
        ours.embedding_tables[cfg].assign(v)
    return theirs, ours


def assert_same(expected, actual, combiner):
    """sum: equal bit for bit; mean and sqrtn: within rtol = atol = 1e-6."""
    flat_e, flat_a = tf.nest.flatten(expected), tf.nest.flatten(actual)
    assert len(flat_e) == len(flat_a)
    for e, a in zip(flat_e, flat_a):
        e, a = np.asarray(e), np.asarray(a)
        assert a.dtype == np.float32 and a.shape == e.shape, (a.dtype, a.shape, e.shape)
        if combiner == "sum":
            bad = np.argwhere(e != a)
            assert bad.size == 0, f"{len(bad)} elements differ, first at {tuple(bad[0])}: {e[tuple(bad[0])]!r} vs " \
                                  f"{a[tuple(bad[0])]!r}"
        else:
            np.testing.assert_allclose(a, e, rtol=RTOL, atol=ATOL)


def random_sparse(rng, lead, width, rows, max_len, neg=False, unsorted=False):
    """A SparseTensor of ids ``lead + [width]`` with bags of 0..max_len ids
    (empty, single and long bags, repeated ids), and positive / zero /
    negative weights on the same indices."""
    indices, values = [], []
    for r in np.ndindex(*lead):
        n = int(rng.integers(0, max_len + 1))
        for p in np.sort(rng.choice(width, min(n, width), replace=False)):
            indices.append(list(r) + [int(p)])
            values.append(int(rng.integers(-3 if neg else 0, rows)))
    rank = len(lead) + 1
    idx = np.array(indices, np.int64).reshape(-1, rank)
    ids = np.array(values, np.int64)
    w = rng.uniform(-0.5, 2.0, len(ids)).astype(np.float32)
    w[rng.random(len(ids)) < 0.1] = 0.0
    if unsorted and len(ids) > 1:
        order = rng.permutation(len(ids))
        idx, ids, w = idx[order], ids[order], w[order]
    shape = list(lead) + [width]
    return tf.SparseTensor(idx, ids, shape), tf.SparseTensor(idx, w, shape)


def random_ragged(rng, lengths, rows, zero_weight_bag=True):
    lengths = np.asarray(lengths)
    ids = rng.integers(0, rows, int(lengths.sum()))
    w = rng.uniform(-0.5, 2.0, len(ids)).astype(np.float32)
    if zero_weight_bag:  # a bag whose weights add up to 0: mean gives zeros (div_no_nan)
        k = int(np.argmax(lengths >= 2))
        if lengths[k] >= 2:
            s = int(lengths[:k].sum())
            w[s:s + 2] = [1.5, -1.5]
            w[s + 2:s + lengths[k]] = 0.0
    return (tf.RaggedTensor.from_row_lengths(ids, lengths), tf.RaggedTensor.from_row_lengths(w, lengths))
