"""Sparse optimizers with TensorFlow TPU-embedding semantics.

Each optimizer updates only the rows a batch touched; the gradients of every
occurrence of an id are summed (in a fixed order) before one update of that
row (plain SGD on a float32 table applies them one after another in input
order instead: see ``SGD``), so results are bit-identical whatever the thread
count. Slot variables
carry TensorFlow's names. Common options:

- ``learning_rate``: a float, or a callable ``lr(step)`` of the table's step
  count (the number of updates applied before this one).
- ``clipvalue``: clip the summed gradient to ``[-c, c]`` (a float) or
  ``[lo, hi]`` (a pair) before the update.
- ``clip_weight_min`` / ``clip_weight_max``: clip the weights after the update.
- ``weight_decay_factor``: decoupled decay ``w -= wd * w`` of the rows that
  are updated, before the update (times the learning rate with
  ``multiply_weight_decay_factor_by_learning_rate=True``).

An optimizer's options are fixed once made (``AttributeError``): a table
copies them when it is made, and a checkpoint records them. Only
``learning_rate`` may be set again (a number or a schedule, read at every
step).
"""
from __future__ import annotations

import math
import weakref
from typing import Callable, Union

import numpy as np

from . import _embedcore

__all__ = ["Optimizer", "SGD", "Adagrad", "RowWiseAdagrad", "Adam", "FTRL"]

LearningRate = Union[float, Callable[[int], float]]
_FLOAT32_MAX = 3.4028234663852886e38
_FLOAT32_TINY = 1.1754943508222875e-38  # the smallest normal float32: 1 / it is finite
# float32(epsilon)**2 is at least the smallest normal float32 (2**-126): not 0,
# even where subnormals are flushed to zero (TensorFlow's kernel threads).
_ADAM_MIN_EPSILON = 2.0**-63
_Kind = _embedcore.OptimizerSpec.Kind
# The options a table copies when it is made (and a checkpoint records): fixed once set. (A subclass's own
# attributes are its own.)
_OPTIONS = frozenset({
    "clip_weight_min", "clip_weight_max", "clipvalue", "weight_decay_factor",
    "multiply_weight_decay_factor_by_learning_rate", "epsilon", "initial_accumulator_value", "beta_1", "beta_2",
    "lazy_adam", "sum_inside_sqrt", "bias_correction", "learning_rate_power", "l1_regularization_strength",
    "l2_regularization_strength", "beta", "multiply_linear_by_learning_rate"})


def _flag(owner: str, field: str, value) -> bool:
    """`value` as a bool when it is one (as ``include_optimizer`` is taken:
    Python's, NumPy's, a 0-d bool array or tensor); TypeError otherwise:
    ``lazy_adam="False"`` is true, the opposite of its word."""
    from .checkpoint import _check_flag

    return _check_flag(value, field, owner)


def _number(owner: str, name: str, value, *, minimum=None, strict=False, normal=False, why="") -> float:
    """``value`` as a float that float32 holds, at least ``minimum`` (above it
    with ``strict``; then also not 0 as a float32). With ``normal``, not a
    subnormal float32 either: that is 0 where subnormals are flushed to zero
    (TensorFlow's kernel threads, ``torch.set_flush_denormal(True)``).
    ``why`` ends the messages of the minimum."""
    if isinstance(value, (bool, str, bytes)):
        raise TypeError(f"{owner}: {name} must be a number, got {value!r}")
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{owner}: {name} must be a number, got {value!r}") from None
    except OverflowError:  # (an int or a fraction beyond float64)
        raise ValueError(f"{owner}: {name} must be within float32's range (+-{_FLOAT32_MAX:.7g}), got a value "
                         f"too large even for float64 ({type(value).__name__})") from None
    if not math.isfinite(v):
        raise ValueError(f"{owner}: {name} must be finite, got {value!r}")
    if abs(v) > _FLOAT32_MAX:  # the engine keeps options as float32: this would become infinite
        raise ValueError(f"{owner}: {name} must be within float32's range (+-{_FLOAT32_MAX:.7g}), got {value!r}")
    op = ">" if strict else ">="
    if minimum is not None and v < minimum:
        raise ValueError(f"{owner}: {name} must be {op} {minimum}, got {value!r}{why}")
    f32 = abs(float(np.float32(v)))
    if strict and minimum == 0 and v != 0 and f32 == 0.0:
        raise ValueError(f"{owner}: {name} must be > 0, got {value!r}, which is 0 as a float32{why}")
    if normal and f32 < _FLOAT32_TINY and (strict or v != 0):
        flushed = ", which is 0 where subnormals are flushed to zero (TensorFlow's kernel threads, " \
                  "torch.set_flush_denormal)" if v != 0 else ""
        raise ValueError(f"{owner}: {name} must be {'' if strict else '0 or '}at least {_FLOAT32_TINY:.9g} (the "
                         f"smallest normal float32), got {value!r}{flushed}{why}")
    if minimum is not None and strict and v == minimum:
        raise ValueError(f"{owner}: {name} must be {op} {minimum}, got {value!r}{why}")
    return v


# How many times each optimizer's learning_rate has been set (Optimizer._rate_sets), by the optimizer's id
# until it is collected: not an attribute, which vars() would show (a checkpoint's optimizer config, repr),
# and not by the optimizer's hash, which a subclass may define by value, or not at all.
_RATE_SETS: dict = {}


class Optimizer:
    """Base class: the options every optimizer shares."""

    slot_names: tuple = ()

    def __new__(cls, *args, **kwargs):
        if cls is Optimizer or cls is _Accumulating:
            raise TypeError(f"{cls.__name__} is a base class: use SGD, Adagrad, RowWiseAdagrad, Adam or FTRL")
        if not issubclass(cls, (SGD, Adagrad, RowWiseAdagrad, Adam, FTRL)):
            # The update rules run in the engine: a new subclass has no rule the engine could run, and
            # would otherwise train with the spec's default (SGD).
            raise TypeError(f"{cls.__name__}: an embedcore optimizer must be (a subclass of) SGD, Adagrad, "
                            f"RowWiseAdagrad, Adam or FTRL, whose update rules the engine runs")
        return super().__new__(cls)

    def __init__(self, learning_rate: LearningRate, clip_weight_min=None, clip_weight_max=None,
                 weight_decay_factor=None, multiply_weight_decay_factor_by_learning_rate=False,
                 clipvalue=None):
        name = type(self).__name__
        if callable(learning_rate):
            self.learning_rate = learning_rate
        else:
            self.learning_rate = _number(name, "learning_rate", learning_rate)
        self.clip_weight_min = None if clip_weight_min is None else _number(name, "clip_weight_min", clip_weight_min)
        self.clip_weight_max = None if clip_weight_max is None else _number(name, "clip_weight_max", clip_weight_max)
        if (self.clip_weight_min is not None and self.clip_weight_max is not None
                and self.clip_weight_min > self.clip_weight_max):
            raise ValueError(f"{name}: clip_weight_min ({clip_weight_min}) > clip_weight_max ({clip_weight_max})")
        self.weight_decay_factor = (None if weight_decay_factor is None
                                    else _number(name, "weight_decay_factor", weight_decay_factor, minimum=0))
        self.multiply_weight_decay_factor_by_learning_rate = _flag(
            name, "multiply_weight_decay_factor_by_learning_rate", multiply_weight_decay_factor_by_learning_rate)
        if clipvalue is None:
            self.clipvalue = None
        elif isinstance(clipvalue, (tuple, list)):
            if len(clipvalue) != 2:
                raise ValueError(f"{name}: clipvalue must be a number or a (min, max) pair, got {clipvalue!r}")
            lo, hi = (_number(name, "clipvalue", v) for v in clipvalue)
            if lo > hi:
                raise ValueError(f"{name}: clipvalue min ({lo}) > max ({hi})")
            self.clipvalue = (lo, hi)
        else:
            c = _number(name, "clipvalue", clipvalue, minimum=0)
            self.clipvalue = (-c, c)

    def __setattr__(self, name: str, value) -> None:
        """The options are fixed once set: a table copies them when it is
        made and a checkpoint records them, so a later change would be
        recorded but not run (it was). ``learning_rate`` alone may change
        (a number or a schedule, read at every step, as Keras users set an
        optimizer's), checked as when made."""
        if name == "learning_rate":
            if not callable(value):
                value = _number(type(self).__name__, "learning_rate", value)
        elif name in _OPTIONS and name in self.__dict__:
            raise AttributeError(f"{type(self).__name__}: {name} cannot change once set (a table runs the value "
                                 "it copied when it was made, and a checkpoint records it): make a new "
                                 f"{type(self).__name__} (learning_rate alone may change, read at every step)")
        super().__setattr__(name, value)
        if name == "learning_rate":
            key = id(self)
            if key not in _RATE_SETS:
                weakref.finalize(self, _RATE_SETS.pop, key, None)
            _RATE_SETS[key] = _RATE_SETS.get(key, 0) + 1

    @property
    def _rate_sets(self) -> int:
        """How many times learning_rate has been set (made, then set again):
        a fused PyTorch table's group takes the rate set since it last
        looked, also a value it had before (adapters/torch/_ops.py)."""
        return _RATE_SETS.get(id(self), 0)

    def learning_rate_at(self, step: int) -> float:
        """The learning rate of the update that follows `step` earlier ones."""
        if callable(self.learning_rate):
            lr = _number(type(self).__name__, f"learning_rate({step})", self.learning_rate(step))
        else:
            lr = self.learning_rate  # within float32's range, as _number checks a schedule's rates
        self._check_learning_rate(lr, f"learning rate {lr!r} at step {step}")
        return lr

    def _check_learning_rate(self, lr: float, what: str) -> None:
        """Rates an optimizer's update cannot use (FTRL divides by it)."""

    def _native(self) -> "_embedcore.OptimizerSpec":
        spec = _embedcore.OptimizerSpec()
        if self.clip_weight_min is not None:
            spec.has_clip_weight_min, spec.clip_weight_min = True, self.clip_weight_min
        if self.clip_weight_max is not None:
            spec.has_clip_weight_max, spec.clip_weight_max = True, self.clip_weight_max
        if self.clipvalue is not None:
            spec.has_clipvalue = True
            spec.clip_gradient_min, spec.clip_gradient_max = self.clipvalue
        spec.weight_decay_factor = self.weight_decay_factor or 0.0
        spec.multiply_weight_decay_factor_by_learning_rate = self.multiply_weight_decay_factor_by_learning_rate
        return spec

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({fields})"


class SGD(Optimizer):
    """``w -= lr * g``, with ``g`` the sum of the gradients of a row's
    occurrences in the batch.

    On a float32 table with no clipping or weight decay, the occurrences are
    applied one at a time in input order (``w -= lr * (c_k * g_k)`` for each),
    which needs no sort of the batch: the same step (SGD is linear), rounded
    once per occurrence instead of once per row. The result does not depend
    on the thread count or the device (CPU and GPU give the same bits). With
    clipping or weight decay, and on 16-bit tables, the summed gradient is
    applied once.
    """

    def __init__(self, learning_rate: LearningRate = 0.01, **kwargs):
        super().__init__(learning_rate, **kwargs)

    def _native(self):
        spec = super()._native()
        spec.kind = _Kind.SGD
        return spec


class _Accumulating(Optimizer):
    """Adagrad and its row-wise variant: an accumulator of squared gradients
    from ``initial_accumulator_value``, ``epsilon`` outside its square root
    (an accumulator may start at 0 only with ``epsilon`` at least the
    smallest normal float32, 1.18e-38: a smaller one is 0 where subnormals are
    flushed to zero, and a zero gradient element would then be 0 / 0)."""

    _kind = None  # the engine's OptimizerSpec.Kind

    def __init__(self, learning_rate: LearningRate, initial_accumulator_value: float, epsilon: float, **kwargs):
        super().__init__(learning_rate, **kwargs)
        name = type(self).__name__
        self.epsilon = _number(name, "epsilon", epsilon, minimum=0)
        # sqrt(a) + epsilon must not be 0 (nor 0 once flushed) for a zero gradient element: 0 / 0.
        no_epsilon = abs(float(np.float32(self.epsilon))) < _FLOAT32_TINY
        why = f"; epsilon is {epsilon!r}, so the accumulator must keep sqrt(a) + epsilon above 0" if no_epsilon else ""
        self.initial_accumulator_value = _number(name, "initial_accumulator_value", initial_accumulator_value,
                                                 minimum=0, strict=no_epsilon, normal=no_epsilon, why=why)

    def _native(self):
        spec = super()._native()
        spec.kind = self._kind
        spec.initial_accumulator_value = self.initial_accumulator_value
        spec.adagrad_epsilon = self.epsilon
        return spec


class Adagrad(_Accumulating):
    """``a += g^2; w -= lr * g / (sqrt(a) + epsilon)``; slot ``accumulators``
    starts at ``initial_accumulator_value``.

    The defaults are TensorFlow's (``epsilon=0``, accumulators from 0.1);
    ``initial_accumulator_value=0, epsilon=1e-10`` is ``torch.optim.Adagrad``.
    """

    slot_names = ("accumulators",)
    _kind = _Kind.Adagrad

    def __init__(self, learning_rate: LearningRate = 0.001, initial_accumulator_value: float = 0.1,
                 epsilon: float = 0.0, **kwargs):
        super().__init__(learning_rate, initial_accumulator_value, epsilon, **kwargs)


class RowWiseAdagrad(_Accumulating):
    """Adagrad with one accumulator per row: ``a += mean(g^2)`` over the
    row's columns (summed in column order), then ``w -= lr * g / (sqrt(a) +
    epsilon)``. Slot ``row_accumulators`` (shape ``[rows, 1]``) starts at
    ``initial_accumulator_value``.

    This is FBGEMM's ``EXACT_ROWWISE_ADAGRAD``, TorchRec's default fused
    optimizer, whose defaults these are (``epsilon=1e-8``, accumulators from
    0); its slot takes ``1 / dim`` of plain Adagrad's memory. The two agree
    without weight decay: ``weight_decay_factor`` here decays the weights
    before the step (FBGEMM's ``WeightDecayMode.DECOUPLE`` formula with
    ``multiply_weight_decay_factor_by_learning_rate=True``), and FBGEMM's
    ``L2`` mode, which adds ``wd * w`` to the gradient, has no equivalent. A
    table trained with it cannot be sharded column-wise: the accumulator
    belongs to the whole row. As in FBGEMM, the step is ``(lr / (sqrt(a) +
    epsilon)) * g``; where ``lr / epsilon`` overflows float32 (an
    accumulator of 0, a learning rate above about 4 and the smallest
    epsilon, 1.18e-38) an element of zero gradient stays as it was (FBGEMM
    steps it by ``inf * 0``, to NaN) and the others step to infinity.
    """

    slot_names = ("row_accumulators",)
    _kind = _Kind.RowwiseAdagrad

    def __init__(self, learning_rate: LearningRate = 0.01, initial_accumulator_value: float = 0.0,
                 epsilon: float = 1e-8, **kwargs):
        super().__init__(learning_rate, initial_accumulator_value, epsilon, **kwargs)


class Adam(Optimizer):
    """Adam with slots ``momenta`` and ``velocities``.

    TensorFlow's TPU form by default: no bias correction, ``lazy_adam=True``
    (only touched rows move; with ``lazy_adam=False`` every row takes the
    full step each update, untouched rows with a zero gradient, weight decay
    and clipping included) and ``sum_inside_sqrt=True``
    (``m / sqrt(v + eps^2)``; ``epsilon`` must then be at least 2**-63,
    about 1.08e-19, so that its float32 square is a normal float32: not 0,
    even where subnormals are flushed to zero; with ``sum_inside_sqrt=False``
    at least the smallest normal float32, 1.18e-38). ``bias_correction=True`` with
    ``sum_inside_sqrt=False`` and ``epsilon=1e-8`` is PyTorch's ``SparseAdam``.
    """

    slot_names = ("momenta", "velocities")

    def __init__(self, learning_rate: LearningRate = 0.001, beta_1: float = 0.9, beta_2: float = 0.999,
                 epsilon: float = 1e-7, lazy_adam: bool = True, sum_inside_sqrt: bool = True,
                 bias_correction: bool = False, **kwargs):
        super().__init__(learning_rate, **kwargs)
        self.beta_1 = _number("Adam", "beta_1", beta_1, minimum=0)
        self.beta_2 = _number("Adam", "beta_2", beta_2, minimum=0)
        for n, v in (("beta_1", self.beta_1), ("beta_2", self.beta_2)):
            if v >= 1:
                raise ValueError(f"Adam: {n} must be in [0, 1), got {v!r}")
            if np.float32(v) >= 1:  # the engine keeps it as a float32
                raise ValueError(f"Adam: {n} must be in [0, 1), got {v!r}, which is 1 as a float32")
        self.lazy_adam = _flag("Adam", "lazy_adam", lazy_adam)
        self.sum_inside_sqrt = _flag("Adam", "sum_inside_sqrt", sum_inside_sqrt)
        # An element of zero gradient is 0 / sqrt(0 + eps**2), or 0 / (0 + eps): NaN if that is 0.
        self.epsilon = _number("Adam", "epsilon", epsilon, minimum=0, strict=True, normal=not self.sum_inside_sqrt)
        if self.sum_inside_sqrt and self.epsilon < _ADAM_MIN_EPSILON:
            raise ValueError(f"Adam: epsilon must be >= 2**-63 ({_ADAM_MIN_EPSILON:.8g}) with sum_inside_sqrt=True "
                             f"(epsilon**2 must be a normal float32: not 0, even where subnormals are flushed to "
                             f"zero), got {epsilon!r}")
        self.bias_correction = _flag("Adam", "bias_correction", bias_correction)

    def _native(self):
        spec = super()._native()
        spec.kind = _Kind.Adam
        spec.beta_1, spec.beta_2, spec.epsilon = self.beta_1, self.beta_2, self.epsilon
        spec.lazy_adam, spec.sum_inside_sqrt = self.lazy_adam, self.sum_inside_sqrt
        spec.bias_correction = self.bias_correction
        return spec


class FTRL(Optimizer):
    """FTRL-proximal with slots ``accumulators`` and ``linears`` (TensorFlow's
    ``FTRL``, including ``beta`` and ``multiply_linear_by_learning_rate``).

    The update divides by the learning rate: as in TensorFlow, it (and every
    rate a schedule returns) must be positive, at least float32's smallest
    normal 1.17549435e-38, or >= 0 with ``multiply_linear_by_learning_rate``;
    ``ValueError`` otherwise, before anything changes."""

    slot_names = ("accumulators", "linears")

    def __init__(self, learning_rate: LearningRate = 0.001, learning_rate_power: float = -0.5,
                 l1_regularization_strength: float = 0.0, l2_regularization_strength: float = 0.0,
                 beta: float = 0.0, initial_accumulator_value: float = 0.1,
                 multiply_linear_by_learning_rate: bool = False, **kwargs):
        super().__init__(learning_rate, **kwargs)
        self.learning_rate_power = _number("FTRL", "learning_rate_power", learning_rate_power)
        if self.learning_rate_power > 0:
            raise ValueError(f"FTRL: learning_rate_power must be <= 0, got {learning_rate_power}")
        self.l1_regularization_strength = _number("FTRL", "l1_regularization_strength",
                                                  l1_regularization_strength, minimum=0)
        self.l2_regularization_strength = _number("FTRL", "l2_regularization_strength",
                                                  l2_regularization_strength, minimum=0)
        self.beta = _number("FTRL", "beta", beta, minimum=0)
        self.initial_accumulator_value = _number("FTRL", "initial_accumulator_value",
                                                 initial_accumulator_value, minimum=0, strict=True, normal=True)
        self.multiply_linear_by_learning_rate = _flag("FTRL", "multiply_linear_by_learning_rate",
                                                       multiply_linear_by_learning_rate)
        if not callable(self.learning_rate):
            self._check_learning_rate(self.learning_rate, f"learning_rate {learning_rate!r}")

    def _check_learning_rate(self, lr: float, what: str) -> None:
        # TensorFlow's FTRL: "lr is not a positive scalar (or zero if multiply_linear_by_lr is set)".
        # The update divides by the float32 rate unless the linear slot is multiplied by it.
        if self.multiply_linear_by_learning_rate:
            if lr < 0:
                raise ValueError(f"FTRL: {what} must be >= 0")
        elif not lr >= _FLOAT32_TINY:
            raise ValueError(f"FTRL: {what} must be >= {_FLOAT32_TINY} (the update divides by it; 0 is allowed "
                             "with multiply_linear_by_learning_rate=True)")

    def _native(self):
        spec = super()._native()
        spec.kind = _Kind.FTRL
        spec.learning_rate_power = self.learning_rate_power
        spec.l1, spec.l2 = self.l1_regularization_strength, self.l2_regularization_strength
        spec.beta = self.beta
        spec.initial_accumulator_value = self.initial_accumulator_value
        spec.multiply_linear_by_learning_rate = self.multiply_linear_by_learning_rate
        return spec
