"""The ``nccl`` communicator: one rank per process and GPU, the bytes moved by
NCCL (``ncclSend`` / ``ncclRecv`` in a group), loaded at run time from the
``nvidia-nccl-cu13`` wheel or the system. Needs the CUDA build.

NCCL's unique id comes from rank 0 over one of: another communicator
(``bootstrap=``: MPI or torch.distributed), a ``torch.distributed`` store
(``store=``), or a file on a filesystem every rank sees (``file=``).
"""
from __future__ import annotations

import contextlib
import os
import pickle
import time
from typing import Optional

import numpy as np

from .. import _embedcore
from ._comm import Comm

_KEY = "embedcore/nccl_unique_id"


def _library() -> str:
    """NCCL from the nvidia-nccl wheel when installed, else the system's libnccl.so.2."""
    try:
        import nvidia.nccl

        for root in list(nvidia.nccl.__path__):
            path = os.path.join(root, "lib", "libnccl.so.2")
            if os.path.exists(path):
                return path
    except ImportError:
        pass
    return ""


class NcclComm(Comm):
    """Rank `rank` of `size` over NCCL on CUDA device `device`. Arrays
    (host NumPy, as the sharded algorithm passes them) travel through the
    device; ``all_gather`` pickles small objects."""

    backend = "nccl"

    def __init__(self, rank: int, size: int, device: int, unique_id: bytes, library: str = ""):
        self._t = _embedcore.NcclTransport(library, unique_id, size, rank, device)
        self.rank, self.size, self.device = rank, size, device

    def all_to_all_v(self, send, recv_counts=None):
        dtype = self._check_send(send)
        send = [np.ascontiguousarray(a, dtype=dtype).reshape(-1) for a in send]
        if recv_counts is None:
            counts = [np.array([a.size], np.int64) for a in send]
            recv_counts = [int(c[0]) for c in self.all_to_all_v(counts, [1] * self.size)]
        item = dtype.itemsize
        buf = (np.concatenate([a.view(np.uint8) for a in send]) if any(a.size for a in send)
               else np.zeros(0, np.uint8))
        recv = np.empty(sum(recv_counts) * item, np.uint8)
        self._t.all_to_all_v_host(buf, [a.nbytes for a in send], recv, [c * item for c in recv_counts])
        out = recv.view(dtype)
        bounds = np.concatenate([[0], np.cumsum(recv_counts)]).astype(np.int64)
        return [out[bounds[j]:bounds[j + 1]] for j in range(self.size)]

    def all_gather(self, obj):
        data = np.frombuffer(pickle.dumps(obj), np.uint8)
        sizes = self.all_to_all_v([np.array([data.size], np.int64)] * self.size, [1] * self.size)
        got = self.all_to_all_v([data] * self.size, [int(s[0]) for s in sizes])
        return [pickle.loads(g.tobytes()) for g in got]


def init_nccl(bootstrap: Optional[Comm] = None, store=None, file: Optional[str] = None, rank: Optional[int] = None,
              size: Optional[int] = None, device: Optional[int] = None, library: Optional[str] = None,
              timeout: float = 300.0) -> NcclComm:
    if not _embedcore.build_info()["nccl"]:
        raise _embedcore.NotCompiledError(
            "init('nccl'): this embedcore was built without NCCL; build it with EMBEDCORE_CUDA=ON and "
            "nvidia-nccl-cu13 installed (the CPU backends are 'mpi' and run_local)")
    if sum(x is not None for x in (bootstrap, store, file)) != 1:
        raise ValueError("init('nccl'): give exactly one of bootstrap= (a Comm), store= (a torch.distributed "
                         "Store) or file= (a path every rank sees) to share NCCL's unique id")
    if bootstrap is not None:
        rank, size = bootstrap.rank, bootstrap.size
    if rank is None or size is None:
        raise ValueError("init('nccl'): rank= and size= are needed with store= or file=")
    if not 0 <= rank < size:
        raise ValueError(f"init('nccl'): rank {rank} of {size} is impossible")
    lib = _library() if library is None else library
    uid = _embedcore.NcclTransport.unique_id(lib) if rank == 0 else None
    if bootstrap is not None:
        uid = bootstrap.all_gather(uid)[0]
    elif store is not None:
        # One key per init on this store: each rank counts its inits there, and no rank starts its next one
        # before every rank has read this one's id (NCCL's init waits for them all), so the count // size is
        # the same on every rank, and a key an earlier init left is never read as this one's.
        generation = (int(store.add(f"{_KEY}/inits", 1)) - 1) // size
        key = f"{_KEY}/{generation}"
        if rank == 0:
            store.set(key, uid)
        else:
            store.wait([key])
            uid = store.get(key)
    else:
        if rank == 0:
            tmp = f"{file}.tmp.{os.getpid()}"
            with open(tmp, "wb") as f:
                f.write(uid)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, file)
        else:
            deadline = time.monotonic() + timeout
            while True:
                try:
                    with open(file, "rb") as f:
                        uid = f.read()
                    if len(uid) == 128:
                        break
                except FileNotFoundError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"init('nccl'): rank 0 wrote no unique id to {file!r} in {timeout} s")
                time.sleep(0.05)
    if device is None:
        devices = _embedcore.build_info()["cuda_devices"]
        device = int(os.environ.get("LOCAL_RANK", rank)) % max(devices, 1)
    comm = NcclComm(rank, size, device, bytes(uid), lib)
    if file is not None and rank == 0:
        # Every rank has read it (NCCL's init waited for them all): a later init's ranks must not find this id.
        with contextlib.suppress(FileNotFoundError):
            os.remove(file)
    return comm
