"""Device tables: parsing ``device=``, and CUDA arrays in and out.

A table on ``device="cuda:N"`` keeps its values and slots in GPU memory (the
CUDA build only). Its lookups and updates take CUDA tensors of PyTorch or
CuPy (anything with ``__dlpack__`` on a CUDA device), read without a copy,
run on the caller's current stream, and return a tensor of the same
framework. Everything here converts; the work is the engine's.
"""
from __future__ import annotations

from typing import Optional, Tuple

from . import _embedcore

_KDL_CUDA = 2  # DLPack device type of CUDA memory


def parse_device(device, where: str) -> int:
    """-1 for the host; N for "cuda:N" ("cuda" is device 0)."""
    if device is None or device == "cpu":
        return -1
    if isinstance(device, str) and (device == "cuda" or device.startswith("cuda:")):
        index = device[5:] if device != "cuda" else "0"
        if not index.isdigit():
            raise ValueError(f"{where}: device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
        n = int(index)
    elif hasattr(device, "type") and hasattr(device, "index"):  # torch.device
        if device.type == "cpu":
            return -1
        if device.type != "cuda":
            raise ValueError(f"{where}: device must be a CPU or CUDA device, got {device!r}")
        n = device.index or 0
    else:
        raise ValueError(f"{where}: device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    if not _embedcore.build_info()["cuda"]:
        raise _embedcore.NotCompiledError(
            f"{where}: device={device!r} needs the CUDA build of embedcore (EMBEDCORE_CUDA=ON pip install .); "
            "this one is CPU-only")
    return n


def dlpack_device(x) -> Optional[Tuple[int, int]]:
    f = getattr(x, "__dlpack_device__", None)
    if f is None:
        return None
    try:
        kind, index = f()
        return int(kind), int(index)
    except Exception:  # noqa: BLE001 - not a DLPack array after all
        return None


def is_cuda_array(x) -> bool:
    d = dlpack_device(x)
    return d is not None and d[0] == _KDL_CUDA


def _framework(x):
    mod = type(x).__module__.split(".")[0]
    if mod == "torch":
        import torch

        return "torch", torch
    if mod == "cupy":
        import cupy

        return "cupy", cupy
    raise TypeError(f"CUDA arrays of {type(x).__module__}.{type(x).__name__} are not supported: "
                    "pass a PyTorch or CuPy tensor")


def current_stream(x) -> int:
    """The caller's current CUDA stream on x's device, as an integer handle."""
    name, fw = _framework(x)
    if name == "torch":
        return int(fw.cuda.current_stream(x.device).cuda_stream)
    with fw.cuda.Device(x.device.id):
        return int(fw.cuda.get_current_stream().ptr)


def _as(x, dtype: str, where: str):
    """x (a CUDA tensor) as a C-contiguous 1-D array of `dtype`, converted on the device when needed."""
    name, fw = _framework(x)
    if name == "torch":
        want = {"int32": fw.int32, "int64": fw.int64, "float32": fw.float32}[dtype]
        if x.dtype.is_floating_point and dtype.startswith("int"):
            raise TypeError(f"{where} must hold integers, got {x.dtype}")
        return x.reshape(-1).to(want).contiguous()
    want = {"int32": fw.int32, "int64": fw.int64, "float32": fw.float32}[dtype]
    if fw.dtype(x.dtype).kind == "f" and dtype.startswith("int"):
        raise TypeError(f"{where} must hold integers, got {x.dtype}")
    return fw.ascontiguousarray(x.reshape(-1), dtype=want)


def _ids(x, where: str):
    name, fw = _framework(x)
    if name == "torch":
        if x.dtype in (fw.int32, fw.int64):
            return x.reshape(-1).contiguous()
        if x.dtype.is_floating_point or x.dtype == fw.bool:
            raise TypeError(f"{where} must be an integer tensor, got {x.dtype}")
        return x.reshape(-1).to(fw.int64).contiguous()
    if str(x.dtype) in ("int32", "int64"):
        return fw.ascontiguousarray(x.reshape(-1))
    if fw.dtype(x.dtype).kind not in "iu":
        raise TypeError(f"{where} must be an integer array, got {x.dtype}")
    return fw.ascontiguousarray(x.reshape(-1), dtype=fw.int64)


def cuda_batch(device: int, ids, offsets=None, weights=None, where: str = "ids"):
    """(ids, offsets, weights, reference tensor, width) on the device: a 2-D
    [batch, k] tensor is one bag per row (width k, which a sequence output
    keeps, as on the CPU); 1-D ids take offsets (or are one id per bag; width None)."""
    from ._inputs import Ragged, Sparse

    if isinstance(ids, Sparse):
        raise TypeError(f"{where}: Sparse input is not supported for CUDA tables; pass Ragged(values, offsets)")
    if isinstance(ids, Ragged):
        if offsets is not None:
            raise TypeError(f"{where}: pass offsets inside Ragged or as an argument, not both")
        ids, offsets = ids.values, ids.offsets
    if isinstance(weights, Ragged):
        weights = weights.values
    for what, a in (("ids", ids), ("offsets", offsets), ("weights", weights)):
        if a is None:
            continue
        d = dlpack_device(a)
        if d is None or d[0] != _KDL_CUDA:
            raise TypeError(f"{where}: the table is on cuda:{device}; {what} is not a CUDA tensor "
                            f"(got {type(a).__name__}): move it to the GPU")
        if d[1] != device:
            raise TypeError(f"{where}: the table is on cuda:{device}; {what} is on cuda:{d[1]}")
    name, fw = _framework(ids)
    shape = tuple(ids.shape)

    def steps(n: int, step: int):  # [0, step, 2 step, ...] (n values) on the table's device
        if name == "torch":
            return fw.arange(n, dtype=fw.int64, device=ids.device) * step
        with fw.cuda.Device(device):
            return fw.arange(n, dtype=fw.int64) * step

    width = None
    if len(shape) == 2:
        if offsets is not None:
            raise ValueError(f"{where}: a 2-D id tensor is one bag per row; offsets make no sense with it")
        b, width = shape
        ids = _ids(ids, where)
        offsets = steps(b + 1, width)  # all zeros when the rows are empty: b empty bags
    elif len(shape) == 1:
        ids = _ids(ids, where)
        offsets = steps(int(ids.shape[0]) + 1, 1) if offsets is None else _as(offsets, "int64", "offsets")
    else:
        raise ValueError(f"{where}: ids must be 1-D (with offsets) or 2-D, got shape {shape}")
    if weights is not None:
        weights = _as(weights, "float32", "weights")
    return ids, offsets, weights, ids, width


def owned(x):
    """A copy of the CUDA tensor `x` (None stays None), on the caller's
    current stream: what a lookup keeps for the step, which the caller may
    refill in place before it (as the host lookups keep copies)."""
    if x is None:
        return None
    name, _ = _framework(x)
    return x.clone() if name == "torch" else x.copy()


def empty(like, shape, device: int):
    name, fw = _framework(like)
    if name == "torch":
        return fw.empty(shape, dtype=fw.float32, device=like.device)
    with fw.cuda.Device(device):
        return fw.empty(shape, dtype=fw.float32)
