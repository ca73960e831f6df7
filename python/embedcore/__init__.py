"""embedcore: one native engine for embedding tables.

Tables of float32 / float16 / bfloat16 rows, lookups with sum / mean / sqrtn
pooling or as sequences, sparse optimizers with TensorFlow TPU-embedding
semantics, all in a C++ core that releases the GIL and uses every core.
``import embedcore`` needs only NumPy.
"""
import numbers

from . import _embedcore
from . import initializers, optimizers
from ._inputs import Ragged, Sparse
from .config import FeatureConfig, TableConfig
from .embedding import Embedding
from .table import Table
from .checkpoint import FORMAT_VERSION, CheckpointError, Saver, load, save
from . import distributed, serving, sok

__version__ = _embedcore.__version__
NotCompiledError = _embedcore.NotCompiledError


def _check_spin_setting() -> None:
    """The engine reads $EMBEDCORE_SPIN_US when its pool starts and ignores a
    value it cannot use; say so here instead."""
    import os
    import re

    v = os.environ.get("EMBEDCORE_SPIN_US", "")
    if v and not (re.fullmatch(r"[0-9]+", v) and int(v) <= 1_000_000):
        raise ValueError(f"environment variable EMBEDCORE_SPIN_US must be a whole number of microseconds "
                         f"from 0 to 1000000, got {v!r}")


_check_spin_setting()


def set_num_threads(n: int) -> None:
    """Sets the number of threads the engine's kernels use (results never depend on it).

    The calling thread works alongside ``n - 1`` pool threads (named
    ``embedcore-<i>`` on Linux). On Linux, while the thread that starts the
    pool (this call, or the first lookup) may run on at least two CPUs and
    on at least ``n``, the pool keeps its threads off the CPU of the thread
    that calls it (their affinity: every CPU of that set but the caller's,
    updated at most every 10 ms), and gives them the whole set back for good
    once anyone else sets their affinity.

    Spinning: after a job, a pool thread spins for a quarter of its own time
    in the job (100 us to 1 ms; at most 100 us with more threads than CPUs)
    before it sleeps, and the caller spins up to 1 ms (at most as long as it
    worked) for the pool's last chunks, so that back-to-back calls start at
    once. That holds a core a little longer after each call; where other
    threads (a framework's own pool, other ranks) need every core, set the
    environment variable ``EMBEDCORE_SPIN_US`` (read when the pool starts)
    to a lower limit in microseconds, or 0 for none.
    """
    if isinstance(n, bool) or not isinstance(n, numbers.Integral):  # NumPy's integers too, as the other int args
        raise TypeError(f"set_num_threads: n must be an int, got {n!r}")
    n = int(n)
    if n < 1:
        raise ValueError(f"set_num_threads: n must be >= 1, got {n}")
    if n > 4096:  # the engine's kMaxThreads: its pool starts every thread at once
        raise ValueError(f"set_num_threads: n must be <= 4096, got {n}")
    _embedcore.set_num_threads(n)


def get_num_threads() -> int:
    """The number of threads the engine's kernels use."""
    return _embedcore.get_num_threads()


def build_info() -> dict:
    """What this build holds: version, compiled features, kernels in use."""
    import importlib.util

    info = dict(_embedcore.build_info())
    # The mpi communicator is mpi4py's (embedcore.distributed): usable when it is installed.
    info["mpi"] = importlib.util.find_spec("mpi4py") is not None
    info["checkpoint_format"] = ".".join(map(str, FORMAT_VERSION))
    info["checkpoint_formats_read"] = [f"{major}.x" for major in range(1, FORMAT_VERSION[0] + 1)]
    return info


__all__ = [
    "CheckpointError",
    "Embedding",
    "FORMAT_VERSION",
    "FeatureConfig",
    "NotCompiledError",
    "Ragged",
    "Saver",
    "Sparse",
    "Table",
    "TableConfig",
    "build_info",
    "distributed",
    "get_num_threads",
    "initializers",
    "load",
    "optimizers",
    "save",
    "serving",
    "set_num_threads",
    "sok",
    "__version__",
]
