"""An independent NumPy reference of embedcore's math.

Nothing here imports embedcore: every formula is written from the
specification (TensorFlow's ``embedding_lookup_sparse`` combiners and its
TPU-embedding optimizers) and computed in float64, so the tests compare the
engine's float32 results against exact-ish values.

Conventions
-----------
- ``table`` is a ``[rows, dim]`` array of the table's stored values (for
  float16 / bfloat16 tables: those values converted to float32 exactly).
- A batch is CSR: ``ids`` (nnz), ``offsets`` (batch + 1), ``weights`` (nnz
  or None).
- Gradients of one step are first summed per row (every occurrence of an id
  in every part), then ONE update of that row is applied.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Optional

import numpy as np

# ----------------------------------------------------------------- storage


def bfloat16_dtype():
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


def quantize(x, dtype: str) -> np.ndarray:
    """x rounded (to nearest, ties to even) to the storage dtype, back as float64."""
    x = np.asarray(x, dtype=np.float64)
    if dtype == "float32":
        return x.astype(np.float32).astype(np.float64)
    if dtype == "float16":
        # float64 -> float32 -> float16 can double-round; the engine rounds a
        # float32 to storage, so do the same.
        return x.astype(np.float32).astype(np.float16).astype(np.float64)
    if dtype == "bfloat16":
        return x.astype(np.float32).astype(bfloat16_dtype()).astype(np.float64)
    raise ValueError(dtype)


def storage_rtol(dtype: str) -> float:
    """Relative spacing of the storage dtype (one unit in the last place)."""
    return {"float32": 2.0**-23, "float16": 2.0**-10, "bfloat16": 2.0**-7}[dtype]


# ----------------------------------------------------------------- batches


def bag_index(offsets) -> np.ndarray:
    """The bag of every occurrence: [nnz]."""
    offsets = np.asarray(offsets, dtype=np.int64)
    return np.repeat(np.arange(len(offsets) - 1), np.diff(offsets))


def position_in_bag(offsets) -> np.ndarray:
    offsets = np.asarray(offsets, dtype=np.int64)
    seg = bag_index(offsets)
    return np.arange(offsets[-1]) - offsets[:-1][seg]


def _weights(ids, weights) -> np.ndarray:
    if weights is None:
        return np.ones(len(ids), dtype=np.float64)
    return np.asarray(weights, dtype=np.float64)


def denominators(offsets, weights, combiner: str, nnz: int) -> np.ndarray:
    """The per-bag number the weighted sum is divided by (0: output zeros)."""
    seg = bag_index(offsets)
    w = np.ones(nnz) if weights is None else np.asarray(weights, dtype=np.float64)
    nb = len(offsets) - 1
    if combiner == "sum":
        return np.ones(nb)
    if combiner == "mean":
        return np.bincount(seg, weights=w, minlength=nb).astype(np.float64)
    if combiner == "sqrtn":
        return np.sqrt(np.bincount(seg, weights=w * w, minlength=nb))
    raise ValueError(combiner)


def pooled(table, ids, offsets, weights, combiner: str):
    """TF's combiners. Returns (out [batch, dim], bound [batch, dim]) where
    bound = sum_k |w_k| |row(i_k)| / |denominator| is the scale of rounding
    error a float32 accumulation may make."""
    table = np.asarray(table, dtype=np.float64)
    ids = np.asarray(ids, dtype=np.int64)
    offsets = np.asarray(offsets, dtype=np.int64)
    nb, dim = len(offsets) - 1, table.shape[1]
    w = _weights(ids, weights)
    seg = bag_index(offsets)
    rows = table[ids]
    acc = np.zeros((nb, dim))
    mag = np.zeros((nb, dim))
    np.add.at(acc, seg, w[:, None] * rows)
    np.add.at(mag, seg, np.abs(w)[:, None] * np.abs(rows))
    den = denominators(offsets, weights, combiner, len(ids))
    out = np.zeros_like(acc)
    bound = np.zeros_like(acc)
    nz = den != 0
    out[nz] = acc[nz] / den[nz, None]
    bound[nz] = mag[nz] / np.abs(den[nz, None])
    return out, bound


def sequence_flat(table, ids, weights=None) -> np.ndarray:
    """combiner=None on CSR input without a length: [nnz, dim], w * row."""
    table = np.asarray(table, dtype=np.float64)
    ids = np.asarray(ids, dtype=np.int64)
    return _weights(ids, weights)[:, None] * table[ids]


def sequence_padded(table, ids, offsets, weights, length: int) -> np.ndarray:
    """[batch, L, dim]: bag b's j-th id at [b, j] (j < L), zeros elsewhere."""
    table = np.asarray(table, dtype=np.float64)
    ids = np.asarray(ids, dtype=np.int64)
    offsets = np.asarray(offsets, dtype=np.int64)
    nb, dim = len(offsets) - 1, table.shape[1]
    out = np.zeros((nb, length, dim))
    w = _weights(ids, weights)
    seg, pos = bag_index(offsets), position_in_bag(offsets)
    keep = pos < length
    out[seg[keep], pos[keep]] = w[keep, None] * table[ids[keep]]
    return out


def sequence_sparse(table, rows, cols, ids, weights, batch: int, length: int) -> np.ndarray:
    """COO input with combiner=None: id k goes to [rows[k], cols[k]] (duplicates add)."""
    table = np.asarray(table, dtype=np.float64)
    ids = np.asarray(ids, dtype=np.int64)
    out = np.zeros((batch, length, table.shape[1]))
    w = _weights(ids, weights)
    rows, cols = np.asarray(rows), np.asarray(cols)
    keep = cols < length
    np.add.at(out, (rows[keep], cols[keep]), w[keep, None] * table[ids[keep]])
    return out


# ----------------------------------------------------------------- backward


@dataclass
class RowGrads:
    """Summed gradient per row and which rows a step touches."""

    rows: int
    dim: int
    grad: np.ndarray = None  # [rows, dim] float64
    touched: np.ndarray = None  # [rows] bool

    def __post_init__(self):
        if self.grad is None:
            self.grad = np.zeros((self.rows, self.dim))
        if self.touched is None:
            self.touched = np.zeros(self.rows, dtype=bool)

    def add(self, ids, per_occurrence_grads) -> "RowGrads":
        ids = np.asarray(ids, dtype=np.int64)
        np.add.at(self.grad, ids, np.asarray(per_occurrence_grads, dtype=np.float64))
        self.touched[ids] = True
        return self

    def add_pooled(self, ids, offsets, weights, combiner: str, grads) -> "RowGrads":
        """d out[b] / d row(i_k) = w_k / denominator(b) (0 when it is 0)."""
        ids = np.asarray(ids, dtype=np.int64)
        grads = np.asarray(grads, dtype=np.float64)
        seg = bag_index(offsets)
        den = denominators(offsets, weights, combiner, len(ids))
        w = _weights(ids, weights)
        d = den[seg]
        coef = np.where(d != 0, w / np.where(d != 0, d, 1.0), 0.0)
        return self.add(ids, coef[:, None] * grads[seg])

    def add_flat(self, ids, weights, grads) -> "RowGrads":
        """combiner=None, [nnz, dim] output: occurrence k gets w_k * grads[k]."""
        w = _weights(ids, weights)
        return self.add(ids, w[:, None] * np.asarray(grads, dtype=np.float64))

    def add_padded(self, ids, offsets, weights, length: int, grads) -> "RowGrads":
        """[batch, L, dim] output: occurrence at (b, j < L) gets w * grads[b, j];
        truncated occurrences (j >= L) do not touch their row."""
        ids = np.asarray(ids, dtype=np.int64)
        grads = np.asarray(grads, dtype=np.float64)
        seg, pos = bag_index(offsets), position_in_bag(offsets)
        w = _weights(ids, weights)
        keep = pos < length
        return self.add(ids[keep], w[keep, None] * grads[seg[keep], pos[keep]])

    def add_sparse_sequence(self, rows, cols, ids, weights, length: int, grads) -> "RowGrads":
        ids = np.asarray(ids, dtype=np.int64)
        grads = np.asarray(grads, dtype=np.float64)
        rows, cols = np.asarray(rows), np.asarray(cols)
        w = _weights(ids, weights)
        keep = cols < length
        return self.add(ids[keep], w[keep, None] * grads[rows[keep], cols[keep]])


# ----------------------------------------------------------------- optimizers


@dataclass
class OptimizerRef:
    """Hyper-parameters of one optimizer, named as embedcore.optimizers names them."""

    kind: str  # "sgd", "adagrad", "rowwise_adagrad", "adam", "ftrl"
    learning_rate: object = 0.01  # float or callable(step)
    clip_weight_min: Optional[float] = None
    clip_weight_max: Optional[float] = None
    weight_decay_factor: Optional[float] = None
    multiply_weight_decay_factor_by_learning_rate: bool = False
    clipvalue: object = None  # float c -> [-c, c], or (lo, hi)
    initial_accumulator_value: float = 0.1
    beta_1: float = 0.9
    beta_2: float = 0.999
    epsilon: Optional[float] = None  # None: the engine's default for `kind` (see __post_init__)
    lazy_adam: bool = True
    sum_inside_sqrt: bool = True
    bias_correction: bool = False
    learning_rate_power: float = -0.5
    l1_regularization_strength: float = 0.0
    l2_regularization_strength: float = 0.0
    beta: float = 0.0
    multiply_linear_by_learning_rate: bool = False

    def __post_init__(self):
        if self.epsilon is None:  # embedcore.optimizers' defaults: TensorFlow's Adagrad 0, FBGEMM's 1e-8
            self.epsilon = {"adagrad": 0.0, "rowwise_adagrad": 1e-8}.get(self.kind, 1e-7)

    @property
    def slot_names(self) -> tuple:
        return {"sgd": (), "adagrad": ("accumulators",), "rowwise_adagrad": ("row_accumulators",),
                "adam": ("momenta", "velocities"), "ftrl": ("accumulators", "linears")}[self.kind]

    def initial_slots(self, rows: int, dim: int) -> Dict[str, np.ndarray]:
        out = {}
        for name in self.slot_names:
            fill = self.f32("initial_accumulator_value") if "accumulators" in name else 0.0
            out[name] = np.full((rows, 1 if name == "row_accumulators" else dim), fill, dtype=np.float64)
        return out

    def lr_at(self, step: int) -> float:
        return float(self.learning_rate(step)) if callable(self.learning_rate) else float(self.learning_rate)

    def f32(self, name: str) -> float:
        """A hyper-parameter as the engine holds it: a float32."""
        return float(np.float32(getattr(self, name)))

    # One element-wise update of the given rows (all float64 arrays of the same shape).
    # Hyper-parameters and the learning rate are taken at float32 precision (the
    # engine's parameters are float32); the arithmetic is float64.
    def update_rows(self, w, g, slots: Dict[str, np.ndarray], lr: float, step: int):
        lr = float(np.float32(lr))
        w = np.array(w, dtype=np.float64)
        g = np.array(g, dtype=np.float64)
        slots = {k: np.array(v, dtype=np.float64) for k, v in slots.items()}
        if self.clipvalue is not None:
            lo, hi = ((-self.clipvalue, self.clipvalue) if not isinstance(self.clipvalue, (tuple, list))
                      else self.clipvalue)
            g = np.clip(g, np.float32(lo), np.float32(hi))
        if self.weight_decay_factor:
            wd = self.f32("weight_decay_factor") * (lr if self.multiply_weight_decay_factor_by_learning_rate else 1.0)
            w = w - wd * w
        if self.kind == "sgd":
            w = w - lr * g
        elif self.kind == "adagrad":
            a = slots["accumulators"] + g * g
            slots["accumulators"] = a
            w = w - lr * g / (np.sqrt(a) + self.f32("epsilon"))  # outside the root: torch.optim.Adagrad's eps
        elif self.kind == "rowwise_adagrad":  # FBGEMM's EXACT_ROWWISE_ADAGRAD
            a = slots["row_accumulators"] + np.mean(g * g, axis=1, keepdims=True)
            slots["row_accumulators"] = a
            w = w - (lr / (np.sqrt(a) + self.f32("epsilon"))) * g
        elif self.kind == "adam":
            b1, b2, eps = self.f32("beta_1"), self.f32("beta_2"), self.f32("epsilon")
            m = b1 * slots["momenta"] + (1 - b1) * g
            v = b2 * slots["velocities"] + (1 - b2) * g * g
            slots["momenta"], slots["velocities"] = m, v
            lr_t = lr
            if self.bias_correction:
                t = step + 1
                lr_t = lr * math.sqrt(1 - b2**t) / (1 - b1**t)
            if self.sum_inside_sqrt:
                w = w - lr_t * m / np.sqrt(v + eps**2)
            else:
                w = w - lr_t * m / (np.sqrt(v) + eps)
        elif self.kind == "ftrl":
            p = -self.f32("learning_rate_power")
            a = slots["accumulators"]
            an = a + g * g
            lin = slots["linears"]
            l1, l2, beta = (self.f32("l1_regularization_strength"), self.f32("l2_regularization_strength"),
                            self.f32("beta"))
            if self.multiply_linear_by_learning_rate:
                lin = lin + lr * g - (an**p - a**p) * w
                q = an**p + beta + 2 * l2 * lr
                thr = l1 * lr
            else:
                lin = lin + g - (an**p - a**p) / lr * w
                q = (an**p + beta) / lr + 2 * l2
                thr = l1
            w = (np.clip(lin, -thr, thr) - lin) / q  # (TensorFlow's sparse kernel: a NaN linear stays NaN)
            slots["accumulators"], slots["linears"] = an, lin
        else:
            raise ValueError(self.kind)
        if self.clip_weight_min is not None:
            w = np.maximum(w, self.f32("clip_weight_min"))
        if self.clip_weight_max is not None:
            w = np.minimum(w, self.f32("clip_weight_max"))
        return w, slots


class TableRef:
    """A reference table: values (float64, rounded to the storage dtype after
    each update), slots, step; ``apply`` does one optimizer step."""

    def __init__(self, values, optimizer: OptimizerRef, dtype: str = "float32", slots=None, step: int = 0):
        self.values = np.array(values, dtype=np.float64)
        self.dtype = dtype
        self.opt = optimizer
        rows, dim = self.values.shape
        self.slots = ({k: np.array(v, dtype=np.float64) for k, v in slots.items()} if slots is not None
                      else optimizer.initial_slots(rows, dim))
        self.step = step

    @property
    def rows(self) -> int:
        return self.values.shape[0]

    @property
    def dim(self) -> int:
        return self.values.shape[1]

    def row_grads(self) -> RowGrads:
        return RowGrads(self.rows, self.dim)

    def apply(self, rg: RowGrads) -> None:
        lr = self.opt.lr_at(self.step)
        if self.opt.kind == "adam" and not self.opt.lazy_adam:
            sel = np.arange(self.rows)  # every row steps; untouched ones with a zero gradient
        else:
            sel = np.nonzero(rg.touched)[0]
        w, s = self.opt.update_rows(self.values[sel], rg.grad[sel], {k: v[sel] for k, v in self.slots.items()},
                                    lr, self.step)
        self.values[sel] = quantize(w, self.dtype) if self.dtype != "float32" else w
        for k in self.slots:
            self.slots[k][sel] = s[k]
        self.step += 1

