"""Pooled lookups that add up each bag in the order TensorFlow's CPU kernels
do, so that ``sum`` outputs equal TensorFlow's bit for bit.

The engine adds the rows of a bag one after the other (``acc += w * row``,
no fused multiply-add), which is what TensorFlow's ``unsorted_segment_sum``
(ragged inputs) does. Two other kernels group the additions differently:

- ``sparse_segment_sum`` (unweighted ``tf.SparseTensor`` input): a bag of
  ``n >= 10`` ids is summed as ``x[0:r]`` (``r = n % 8``, or 8 when that is
  0, or 9 when it is 1) and then ``+= `` the sum of each following group
  of 8, each group summed in order;
- ``segment_sum`` of the weighted rows (weighted ``tf.SparseTensor``
  input): Eigen keeps 4 accumulators over rows ``i % 4`` of a bag of
  ``n >= 16``, combines them as ``((a0 + a1) + a2) + a3`` and then adds the
  remaining ``n % 4`` rows in order; columns beyond the last full 8-float
  packet are summed in order.

The first is the engine's ``Table.lookup_sparse_segment``, which also
divides as ``sparse_segment_mean`` / ``_sqrt_n`` do (bags of fewer than 10
ids multiplied by the reciprocal of the count or of its square root, longer
ones divided by it). The second is reproduced with the engine's grouped
lookup (``Table.lookup_grouped``): each "sub-bag" (a group of rows) is
summed from zero as the engine sums a bag, and the sub-bag sums of a bag are
added in order; the adapter only computes the grouping, and divides weighted
means by the weights' in-order sum (``div_no_nan``) as TensorFlow does.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

SEQUENTIAL = "sequential"  # unsorted_segment_sum, and the engine's own order
GROUPED8 = "grouped8"  # sparse_segment_sum / _mean / _sqrt_n
EIGEN4 = "eigen4"  # segment_sum of weighted rows
EIGEN_PACKET = 8  # floats per packet of TensorFlow's CPU build (AVX)


class InvalidArgument(ValueError):
    """A runtime error TensorFlow reports as ``InvalidArgumentError`` (a
    ``ValueError`` raised inside ``tf.numpy_function`` becomes one)."""


def bad_id_error(table, ids: np.ndarray, shape=None, engine_message: str = "") -> InvalidArgument:
    """TensorFlow's message for an id out of range, for the first bad id."""
    flat = ids.reshape(-1)
    bad = np.nonzero((flat < 0) | (flat >= table.rows))[0]
    if not bad.size:  # the engine saw something else: report it as it is
        return InvalidArgument(engine_message or f"table '{table.name}': bad ids")
    k = int(bad[0])
    where = ",".join(str(int(i)) for i in np.unravel_index(k, shape)) if shape is not None and len(shape) > 1 else k
    return InvalidArgument(f"indices[{where}] = {int(flat[k])} is not in [0, {table.rows}) (table '{table.name}')")


def engine_lookup(table, ids, offsets, weights, combiner, max_sequence_length: int = 0, shape=None) -> np.ndarray:
    try:
        return table.lookup(ids, offsets, weights, combiner=combiner, max_sequence_length=max_sequence_length)
    except IndexError as e:
        raise bad_id_error(table, ids, shape, str(e)) from None


def _exclusive_cumsum(x: np.ndarray) -> np.ndarray:
    out = np.zeros(len(x), np.int64)
    np.cumsum(x[:-1], out=out[1:])
    return out


def _div_no_nan(sums: np.ndarray, den: np.ndarray) -> np.ndarray:
    den = den.astype(np.float32)
    out = np.zeros_like(sums)
    nz = den != 0
    np.divide(sums, den[:, None], out=out, where=nz[:, None])
    return out


def pooled(table, ids: np.ndarray, offsets: np.ndarray, weights: Optional[np.ndarray], combiner: str,
           order: str) -> np.ndarray:
    """``[bags, dim]``: each bag of the CSR batch pooled with `combiner`,
    its rows added in `order`. Mean and sqrtn divide as TensorFlow's
    ``div_no_nan`` does (zero when the denominator is zero)."""
    if order == SEQUENTIAL:
        return engine_lookup(table, ids, offsets, weights, combiner)
    lengths = np.diff(offsets)
    longest = int(lengths.max()) if lengths.size else 0
    if order == EIGEN4 and (longest < 16 or table.dim < EIGEN_PACKET):
        return engine_lookup(table, ids, offsets, weights, combiner)
    if order == GROUPED8:  # the engine groups and divides as sparse_segment_sum / _mean / _sqrt_n
        if weights is not None:
            raise TypeError("GROUPED8 is the unweighted kernels' order; weighted rows are added as EIGEN4")
        try:
            return table.lookup_sparse_segment(ids, offsets, combiner)
        except IndexError as e:
            raise bad_id_error(table, ids, None, str(e)) from None
    sums = _eigen4_sums(table, ids, offsets, weights, lengths)
    if combiner == "sum":
        return sums
    # div_no_nan(segment_sum(w * rows), segment_sum(w)): the weights are one column, added in order.
    w = weights if combiner == "mean" else weights * weights
    den = _sequential_totals(w, offsets[:-1], lengths, longest)
    return _div_no_nan(sums, den if combiner == "mean" else np.sqrt(den))


_LONG_SEGMENT = 64  # _sequential_totals: longer segments are added up one by one (a sequential accumulate)


def _sequential_totals(x: np.ndarray, starts: np.ndarray, lengths: np.ndarray, longest: int) -> np.ndarray:
    """float32 totals of each segment, added in order (as TensorFlow's
    segment sum adds a bag's weights). Segments longer than _LONG_SEGMENT
    are each one ``np.add.accumulate`` (sequential in float32); the others
    add position k of every segment longer than k in one vector step, the
    segments sorted longest first so that those are a prefix. Python steps:
    at most the long segments plus _LONG_SEGMENT (one step per position of
    the longest bag before: a bag of 50,000 weights took 0.3 s)."""
    out = np.zeros(len(starts), np.float32)
    if not len(starts) or longest == 0:
        return out
    order = np.argsort(-lengths, kind="stable")
    lens, firsts = lengths[order], starts[order]
    n_long = int(np.count_nonzero(lens > _LONG_SEGMENT))
    for i in range(n_long):
        out[order[i]] = np.add.accumulate(x[firsts[i]:firsts[i] + lens[i]])[-1]
    lens, firsts = lens[n_long:], firsts[n_long:]
    acc = np.zeros(len(lens), np.float32)
    active = np.searchsorted(-lens, -np.arange(min(longest, _LONG_SEGMENT)), side="left")  # bags longer than k
    for k, m in enumerate(active):
        acc[:m] += x[firsts[:m] + k]
    out[order[n_long:]] = acc
    return out


def _sum_sub_bags(table, ids, sub_offsets, weights, nsub) -> np.ndarray:
    """Pools each sub-bag (sum), then adds up each bag's sub-bag sums in
    order: one engine call (``Table.lookup_grouped``)."""
    groups = np.zeros(len(nsub) + 1, np.int64)
    np.cumsum(nsub, out=groups[1:])
    try:
        return table.lookup_grouped(ids, sub_offsets, groups, weights=weights)
    except IndexError as e:
        raise bad_id_error(table, ids, None, str(e)) from None


def _eigen4_sums(table, ids, offsets, weights, lengths) -> np.ndarray:
    n = lengths
    long = n >= 16
    u = (n // 4) * 4
    # New position of each element within its bag: long bags put rows 0,4,8.. then 1,5,9.. then 2.. and 3..
    # (one accumulator each), then the n % 4 remaining rows one by one; short bags keep their order.
    bag_of = np.repeat(np.arange(len(n)), n)
    j = np.arange(ids.size) - offsets[:-1][bag_of]
    ub = u[bag_of]
    strided = long[bag_of] & (j < ub)
    newpos = np.where(strided, (j % 4) * (ub // 4) + j // 4, j)
    perm = np.empty(ids.size, np.int64)
    perm[offsets[:-1][bag_of] + newpos] = np.arange(ids.size)
    nsub = np.where(long, 4 + (n - u), 1)
    bag = np.repeat(np.arange(len(n)), nsub)
    k = np.arange(bag.size) - np.repeat(_exclusive_cumsum(nsub), nsub)
    q = (u // 4)[bag]
    start = offsets[:-1][bag] + np.where(long[bag], np.where(k < 4, k * q, 4 * q + (k - 4)), 0)
    sub_offsets = np.append(start, offsets[-1]).astype(np.int64)
    w = None if weights is None else np.ascontiguousarray(weights[perm])
    sums = _sum_sub_bags(table, np.ascontiguousarray(ids[perm]), sub_offsets, w, nsub)
    packet_cols = (table.dim // EIGEN_PACKET) * EIGEN_PACKET
    if packet_cols < table.dim:  # the columns past the last packet are summed in order
        sums[:, packet_cols:] = engine_lookup(table, ids, offsets, weights, "sum")[:, packet_cols:]
    return sums
