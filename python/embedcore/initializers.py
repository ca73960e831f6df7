"""Initializers of a table's values.

Every element is a pure function of ``(seed, element index)``, computed in the
engine, so the same seed gives the same table bit for bit whatever the number
of threads. The default initializer is TensorFlow's: a normal distribution
truncated at two standard deviations, with ``stddev = 1 / sqrt(dim)``, seeded
by the table's name (tables of one dim then start with different rows, as
TensorFlow draws each table on its own; before session 33 every default
table had seed 0, the same rows).
"""
from __future__ import annotations

import math
import numbers

from . import _embedcore

__all__ = ["Initializer", "Zeros", "Constant", "Uniform", "Normal", "TruncatedNormal"]

_Kind = _embedcore.InitializerSpec.Kind


def _finite(name: str, value) -> float:
    if isinstance(value, (bool, str, bytes)):
        raise TypeError(f"initializer {name} must be a number, got {value!r}")
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"initializer {name} must be a number, got {value!r}") from None
    if not math.isfinite(v):
        raise ValueError(f"initializer {name} must be finite, got {value!r}")
    return v


def _seed(seed) -> int:
    """An int in [0, 2**64) (NumPy's integers too, as the other int
    arguments: a seed drawn by ``rng.integers``)."""
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"initializer seed must be an int, got {seed!r}")
    seed = int(seed)
    if not 0 <= seed < 2**64:
        raise ValueError(f"initializer seed must be in [0, 2**64), got {seed}")
    return seed


class Initializer:
    """Base class; subclasses describe themselves to the engine (``_native``)."""

    def __new__(cls, *args, **kwargs):
        if cls is Initializer:
            raise TypeError("Initializer is a base class: use Zeros, Constant, Uniform, Normal or TruncatedNormal")
        if not issubclass(cls, (Zeros, Constant, Uniform, Normal)):
            # The engine draws the values (the same on every rank and shard): it cannot run Python.
            raise TypeError(f"{cls.__name__}: an embedcore initializer must be (a subclass of) Zeros, Constant, "
                            f"Uniform, Normal or TruncatedNormal, which the engine runs; to start from other "
                            f"values, write them with Table.assign(values)")
        return super().__new__(cls)

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({fields})"

    def __eq__(self, other) -> bool:
        return type(self) is type(other) and vars(self) == vars(other)

    def __hash__(self) -> int:
        return hash((type(self), tuple(sorted(vars(self).items()))))


class Zeros(Initializer):
    """Every value 0."""

    def __init__(self):  # (no arguments: Zeros(0.5) or Zeros(seed=3) was taken and ignored)
        pass

    def _native(self):
        spec = _embedcore.InitializerSpec()
        spec.kind = _Kind.Zeros
        return spec


class Constant(Initializer):
    """Every value ``value`` (finite; within the table's dtype's range)."""

    def __init__(self, value: float = 0.0):
        self.value = _finite("value", value)

    def _native(self):
        spec = _embedcore.InitializerSpec()
        spec.kind = _Kind.Constant
        spec.a = self.value
        return spec


class Uniform(Initializer):
    """Uniform in ``[low, high)``."""

    def __init__(self, low: float = -0.05, high: float = 0.05, seed: int = 0):
        self.low = _finite("low", low)
        self.high = _finite("high", high)
        if self.high < self.low:
            raise ValueError(f"Uniform: high ({high}) must be >= low ({low})")
        self.seed = _seed(seed)

    def _native(self):
        spec = _embedcore.InitializerSpec()
        spec.kind = _Kind.Uniform
        spec.a, spec.b, spec.seed = self.low, self.high, self.seed
        return spec


class Normal(Initializer):
    """Normal with ``mean`` and ``stddev`` (``None``: ``1 / sqrt(dim)``)."""

    _kind = _Kind.Normal

    def __init__(self, mean: float = 0.0, stddev: float | None = None, seed: int = 0):
        self.mean = _finite("mean", mean)
        self.stddev = None if stddev is None else _finite("stddev", stddev)
        if self.stddev is not None and self.stddev <= 0:
            raise ValueError(f"{type(self).__name__}: stddev must be > 0, got {stddev}")
        self.seed = _seed(seed)

    def _native(self):
        spec = _embedcore.InitializerSpec()
        spec.kind = self._kind
        spec.a = self.mean
        spec.b = 0.0 if self.stddev is None else self.stddev
        spec.seed = self.seed
        return spec


class TruncatedNormal(Normal):
    """Normal redrawn until within two standard deviations of the mean (TensorFlow's)."""

    _kind = _Kind.TruncatedNormal
