"""Table and feature configurations, shaped like TensorFlow's
``tf.tpu.experimental.embedding.TableConfig`` / ``FeatureConfig``."""
from __future__ import annotations

import zlib
from typing import Optional

from . import initializers as _init
from . import optimizers as _opt

__all__ = ["TableConfig", "FeatureConfig", "COMBINERS", "DTYPES"]

COMBINERS = ("sum", "mean", "sqrtn")
DTYPES = ("float32", "float16", "bfloat16")


def _positive_int(owner: str, name: str, value) -> int:
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"{owner}: {name} must be an int, got {value!r}")
    v = int(value.__index__())
    if v < 1:
        raise ValueError(f"{owner}: {name} must be >= 1, got {v}")
    if v >= 2**63:  # (the engine's int64)
        raise ValueError(f"{owner}: {name} must be < 2**63, got {v}")
    return v


def _name_seed(name: Optional[str]) -> int:
    """The default initializer's seed of a table named `name`: the same on
    every rank and in every run, another for every other name (the TF
    adapter seeds unseeded tables the same way)."""
    return 0 if name is None else zlib.crc32(name.encode("utf-8")) & 0x7FFFFFFF


def _check_utf8(owner: str, name) -> None:
    """Checkpoints record table and feature names as UTF-8: a str decoded from
    undecodable bytes (a file name, with lone surrogates) is refused, and so
    is a NUL character (C strings end there: the C API could not name it)."""
    if isinstance(name, str):
        if "\0" in name:
            raise ValueError(f"{owner}: name has a NUL character at position {name.index(chr(0))}; names are "
                             "served by the C API as C strings, which end there")
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"{owner}: name is not valid UTF-8 text (a str decoded from undecodable bytes, such as "
                             "a file name); checkpoints record names as UTF-8") from None


class TableConfig:
    """One embedding table: ``rows x dim`` values of ``dtype``.

    Tables are compared and hashed by identity (as TensorFlow's are), so a
    config object names one table; several features may share it.
    """

    def __init__(self, name: Optional[str] = None, rows: Optional[int] = None, dim: Optional[int] = None,
                 dtype: str = "float32", initializer: Optional[_init.Initializer] = None,
                 optimizer: Optional[_opt.Optimizer] = None, combiner: str = "mean", *,
                 vocabulary_size: Optional[int] = None):
        owner = f"TableConfig {name!r}" if name else "TableConfig"
        if vocabulary_size is not None:
            if rows is not None and rows != vocabulary_size:
                raise ValueError(f"{owner}: rows ({rows}) and vocabulary_size ({vocabulary_size}) differ")
            rows = vocabulary_size
        if rows is None or dim is None:
            raise TypeError(f"{owner}: rows and dim are required")
        if name is not None and not isinstance(name, str):
            raise TypeError(f"{owner}: name must be a str, got {name!r}")
        _check_utf8(owner, name)
        self.name = name
        self.rows = _positive_int(owner, "rows", rows)
        self.dim = _positive_int(owner, "dim", dim)
        if dtype not in DTYPES:
            raise ValueError(f"{owner}: dtype must be one of {DTYPES}, got {dtype!r}" +
                             (" (an export format of checkpoints: save(..., values_dtype='uint8_rowwise'), not a "
                              "table dtype)" if dtype == "uint8_rowwise" else ""))
        self.dtype = DTYPES[DTYPES.index(dtype)]  # its name (np.dtype("float16") equals "float16" too)
        if initializer is not None and not isinstance(initializer, _init.Initializer):
            raise TypeError(f"{owner}: initializer must be an embedcore.initializers.Initializer, got {initializer!r}")
        # The default: TensorFlow's, seeded by the table's name (a seed of 0 for every table gave tables of one
        # dim the same rows: every feature's embedding of id k the same vector), the same on every rank.
        self.initializer = initializer if initializer is not None else _init.TruncatedNormal(seed=_name_seed(name))
        self._default_initializer = initializer is None  # (a table named later, by Embedding, is seeded by that name)
        if optimizer is not None and not isinstance(optimizer, _opt.Optimizer):
            raise TypeError(f"{owner}: optimizer must be an embedcore.optimizers.Optimizer, got {optimizer!r}")
        self.optimizer = optimizer
        if combiner not in COMBINERS:
            raise ValueError(f"{owner}: combiner must be one of {COMBINERS}, got {combiner!r}")
        self.combiner = combiner

    @property
    def vocabulary_size(self) -> int:
        return self.rows

    def __repr__(self) -> str:
        return (f"TableConfig(name={self.name!r}, rows={self.rows}, dim={self.dim}, dtype={self.dtype!r}, "
                f"initializer={self.initializer!r}, optimizer={self.optimizer!r}, combiner={self.combiner!r})")


class FeatureConfig:
    """One input feature looked up in ``table``.

    ``max_sequence_length = 0`` pools each bag with the table's combiner;
    ``L > 0`` makes a sequence feature whose output is ``[batch, L, dim]``
    (bags truncated or zero-padded to L).
    """

    def __init__(self, table: TableConfig, max_sequence_length: int = 0, name: Optional[str] = None):
        if not isinstance(table, TableConfig):
            raise TypeError(f"FeatureConfig {name!r}: table must be a TableConfig, got {table!r}")
        if isinstance(max_sequence_length, bool) or not hasattr(max_sequence_length, "__index__"):
            raise TypeError(f"FeatureConfig {name!r}: max_sequence_length must be an int, got {max_sequence_length!r}")
        if max_sequence_length < 0:
            raise ValueError(f"FeatureConfig {name!r}: max_sequence_length must be >= 0, got {max_sequence_length}")
        if max_sequence_length >= 2**63:  # (the engine's and the C API's int64)
            raise ValueError(f"FeatureConfig {name!r}: max_sequence_length must be < 2**63, got {max_sequence_length}")
        if name is not None and not isinstance(name, str):  # (checkpoints record it; serving reads a string)
            raise TypeError(f"FeatureConfig: name must be a str or None, got {name!r}")
        self.table = table
        self.max_sequence_length = int(max_sequence_length)
        _check_utf8(f"FeatureConfig {name!r}", name)
        self.name = name

    def __repr__(self) -> str:
        return (f"FeatureConfig(table={self.table.name!r}, max_sequence_length={self.max_sequence_length}, "
                f"name={self.name!r})")
