"""embedcore's sharded tables over a ``torch.distributed`` process group.

``TorchComm(group=None)`` is an ``embedcore.distributed.Comm`` whose
collectives are ``torch.distributed``'s (gloo on CPU, NCCL on GPU), so the
sharded ``ec.Embedding(..., world=comm)`` and the adapter's sharded
``EmbeddingBagCollection(..., world=comm)`` run under ``torchrun`` with
nothing else installed. ``init()`` starts the default process group from
torchrun's environment when it is not started yet and returns its
``TorchComm``::

    # torchrun --nproc_per_node 2 train.py
    import embedcore.adapters.torch as et
    from embedcore.adapters.torch import distributed as etd

    world = etd.init()                      # gloo on CPU
    ebc = et.EmbeddingBagCollection(tables, optimizer=..., world=world, sharding="row_wise")

The communicator moves no bytes itself: every exchange is one
``all_to_all_single`` (the arrays' bytes as one uint8 tensor, with split
sizes), ``all_gather_object`` or ``barrier`` of the group.
"""
from __future__ import annotations

import atexit
import os
import sys
import threading
import weakref
from typing import List, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist

from embedcore.distributed import Comm

__all__ = ["TorchComm", "init"]

# What torchrun (and torch.distributed's env:// initialisation) sets in every worker.
_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _transport_device(group) -> torch.device:
    """Where the tensors of the group's collectives must live: CPU when the
    group has a CPU backend (gloo, MPI), else the current CUDA device (NCCL)."""
    parts = _backend_parts(str(dist.get_backend(group)))
    # A default group may be mixed, e.g. "cpu:gloo,cuda:nccl": CPU tensors then go through gloo.
    takes_cpu = any(name in ("gloo", "mpi") or device == "cpu" for device, name in parts)
    if any(name == "nccl" for _, name in parts) and not takes_cpu:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# Per process group, the number of sharded embeddings made over it (Comm._embedding_numbering): shared by every
# TorchComm of the group (init() returns a new object each call), dropped with the group.
_numbering: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_numbering_lock = threading.Lock()


class TorchComm(Comm):
    """An ``embedcore.distributed.Comm`` over a ``torch.distributed`` group.

    group: a process group (``dist.new_group(...)``), or None for the
        default one; it must be initialised already (see ``init()``).

    ``rank`` / ``size`` are this process's rank in the group and the group's
    size; ``torch_backend`` names the group's backend ("gloo", "nccl", ...).
    ``all_to_all_v`` sends the arrays' bytes with one
    ``dist.all_to_all_single`` (after one of the int64 element counts when
    ``recv_counts`` is None); ``all_gather`` is ``dist.all_gather_object``;
    ``barrier`` is ``dist.barrier``. With NCCL the buffers go through the
    current CUDA device (``torch.cuda.set_device``, which ``init()`` sets
    from ``LOCAL_RANK``).
    """

    backend = "torch"

    def __init__(self, group=None):
        if not dist.is_available():
            raise RuntimeError("TorchComm: this PyTorch was built without torch.distributed")
        if not dist.is_initialized():
            raise RuntimeError("TorchComm: the torch.distributed process group is not initialised; call "
                               "torch.distributed.init_process_group(...) first, or "
                               "embedcore.adapters.torch.distributed.init() under torchrun")
        rank = dist.get_rank(group)
        if rank < 0:
            raise ValueError("TorchComm: this process is not a member of the given process group")
        self._group = group
        self.rank = rank
        self.size = dist.get_world_size(group)
        self.torch_backend = str(dist.get_backend(group))
        self._device = _transport_device(group)

    @property
    def group(self):
        """The ``torch.distributed`` process group (None: the default one)."""
        return self._group

    def _embedding_numbering(self) -> list:
        """Kept per process group (the default one for ``group=None``), so
        that every TorchComm of one group, however many ``init()`` made,
        numbers its embeddings in one sequence."""
        group = self._group if self._group is not None else dist.group.WORLD
        with _numbering_lock:
            holder = _numbering.get(group)
            if holder is None:
                holder = _numbering[group] = [0]
        return holder

    def __repr__(self) -> str:
        return (f"<TorchComm torch_backend={self.torch_backend!r} rank={self.rank} size={self.size} "
                f"device={self._device}>")

    # ------------------------------------------------------------ collectives
    def _tensor(self, a: np.ndarray) -> torch.Tensor:
        if not a.flags.writeable:
            a = a.copy()  # torch.from_numpy warns on read-only memory (collectives only read it)
        t = torch.from_numpy(a)  # a view of the array's memory
        return t if self._device.type == "cpu" else t.to(self._device)

    def _exchange_counts(self, send_counts: List[int]) -> List[int]:
        out = torch.empty(self.size, dtype=torch.int64, device=self._device)
        dist.all_to_all_single(out, self._tensor(np.asarray(send_counts, np.int64)), group=self._group)
        return [int(c) for c in out.cpu()]

    def all_to_all_v(self, send: Sequence[np.ndarray], recv_counts: Optional[Sequence[int]] = None
                     ) -> List[np.ndarray]:
        dtype = self._check_send(send)
        send = [np.ascontiguousarray(a, dtype=dtype).reshape(-1) for a in send]
        send_counts = [int(a.size) for a in send]
        if recv_counts is None:
            recv_counts = self._exchange_counts(send_counts)
        else:
            recv_counts = [int(c) for c in recv_counts]
            if len(recv_counts) != self.size:
                raise ValueError(f"all_to_all_v: recv_counts must hold one count per rank ({self.size}), "
                                 f"got {len(recv_counts)}")
        item = dtype.itemsize
        # Bytes, so that any dtype travels; one buffer, as all_to_all_single takes it.
        if sum(send_counts) == 0:
            sendbuf = np.zeros(0, np.uint8)
        elif len(send) == 1 or sum(c > 0 for c in send_counts) == 1:
            sendbuf = next(a for a in send if a.size).view(np.uint8)  # already one contiguous run: no copy
        else:
            sendbuf = np.concatenate(send).view(np.uint8)
        recv = torch.empty(sum(recv_counts) * item, dtype=torch.uint8, device=self._device)
        dist.all_to_all_single(recv, self._tensor(sendbuf), output_split_sizes=[c * item for c in recv_counts],
                               input_split_sizes=[c * item for c in send_counts], group=self._group)
        out = recv.cpu().numpy().view(dtype)  # a view of the received tensor on CPU
        bounds = np.concatenate([[0], np.cumsum(recv_counts, dtype=np.int64)])
        return [out[bounds[j]:bounds[j + 1]] for j in range(self.size)]

    def all_gather(self, obj) -> list:
        out: list = [None] * self.size
        dist.all_gather_object(out, obj, group=self._group)
        return out

    def barrier(self) -> None:
        dist.barrier(group=self._group)


def _backend_parts(backend: str) -> set:
    """{("", "gloo")} of "gloo", {("cpu", "gloo"), ("cuda", "nccl")} of "cpu:gloo,cuda:nccl"."""
    return {tuple(p.strip() for p in part.rpartition(":")[::2]) for part in backend.lower().split(",")}


def _backend_matches(asked: str, current: str) -> bool:
    """Each backend `asked` names is one of the group's, on the device it names (where both name one)."""
    have = _backend_parts(current)
    return all(any(name == n and "" in (device, d) or (device, name) == (d, n) for d, n in have)
               for device, name in _backend_parts(asked))


def init(backend: Optional[str] = None, **kwargs) -> TorchComm:
    """The ``TorchComm`` of the default process group, starting the group
    from torchrun's environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
    ``MASTER_PORT``) when it is not initialised yet.

    backend: the group's backend when this call starts it: None picks
        "gloo" without CUDA and ``"cpu:gloo,cuda:nccl"`` with it (CPU tensors
        through gloo, CUDA tensors through NCCL); "nccl" sets the CUDA device
        from ``LOCAL_RANK`` first. Other keyword arguments go to
        ``torch.distributed.init_process_group`` (e.g. ``timeout=``). When the
        group already exists they must be absent (or name its backend).

    A group this call starts is destroyed at interpreter exit, unless the
    script destroyed it first: a gloo group left to the interpreter's teardown
    can abort the process after the script's last line ("terminate called
    without an active exception").
    """
    if not dist.is_available():
        raise RuntimeError("embedcore.adapters.torch.distributed.init(): this PyTorch was built without "
                           "torch.distributed")
    if dist.is_initialized():
        if kwargs:
            raise ValueError(f"init(): the process group is initialised already; {sorted(kwargs)} would not apply")
        current = str(dist.get_backend())
        if backend is not None and not _backend_matches(backend, current):
            raise ValueError(f"init(backend={backend!r}): the process group is initialised already with "
                             f"backend {current!r}")
        return TorchComm()
    missing = [k for k in _TORCHRUN_ENV if k not in os.environ]
    if missing and "init_method" not in kwargs and "store" not in kwargs:
        raise RuntimeError(f"embedcore.adapters.torch.distributed.init(): no process group and no torchrun "
                           f"environment (missing {missing}); start the script with `torchrun --nproc_per_node N "
                           f"script.py`, or call torch.distributed.init_process_group(...) first")
    if backend is None:
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    if "nccl" in backend.lower() and "gloo" not in backend.lower() and torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend=backend, **kwargs)
    atexit.register(_destroy_at_exit, weakref.ref(dist.group.WORLD))  # weak: a group the script destroys goes
    return TorchComm()


def _destroy_at_exit(started: "weakref.ref") -> None:
    """Destroys the default group ``init()`` started, if it is still the
    default one. Exiting without ``destroy_process_group`` leaves the group's
    worker threads to static destruction, after the interpreter is gone; a
    process that had finished its work then dies of SIGABRT."""
    if not dist.is_initialized() or dist.group.WORLD is not started():
        return  # destroyed by the script (and perhaps another group started): not ours to end
    try:
        dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001 - at exit, a failed teardown is reported, not raised
        print(f"embedcore: destroying the process group at exit failed: {type(e).__name__}: {e}", file=sys.stderr)
