"""A save killed at any moment leaves a loadable checkpoint: the previous one
or a newer complete one, never a mix.

A child process saves a 500,000 x 64 float32 table with an Adagrad slot
(256 MB a save) over and over to a path that holds a good checkpoint, each
save a different constant (values k, slot k + 0.5, step k), and is killed
with SIGKILL at random moments. After each kill the checkpoint must load and
serve, holding a single k that a save completed or was completing.
"""
from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import embedcore as ec
from embedcore import _embedcore

ROWS, DIM = 500_000, 64
KILLS = 20
MAX_DELAY_S = 1.5

CHILD = r"""
import sys
import numpy as np
import embedcore as ec

path, rows, dim, base = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
t = ec.Table(name="big", rows=rows, dim=dim, initializer=ec.initializers.Zeros(),
             optimizer=ec.optimizers.Adagrad(0.1))
buf = np.zeros((rows, dim), np.float32)
t.assign(buf)  # touch every page before the clock starts
buf.fill(0.5)  # (Adagrad with epsilon 0 takes no accumulator of 0)
t.assign_slot("accumulators", buf)
print("ready", flush=True)
if sys.stdin.readline().strip() != "go":
    sys.exit(0)
k = base
while True:
    buf.fill(k)
    t.assign(buf)
    buf.fill(k + 0.5)
    t.assign_slot("accumulators", buf)
    t.step = k
    print("start", k, flush=True)
    ec.save(path, t)
    print("done", k, flush=True)
    k += 1
"""


class Child:
    """A saving child process, its stdout read line by line without blocking forever."""

    def __init__(self, path, base):
        env = dict(os.environ, SKBUILD_EDITABLE_VERBOSE="0")
        self.proc = subprocess.Popen([sys.executable, "-c", CHILD, str(path), str(ROWS), str(DIM), str(base)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     bufsize=0, env=env)
        self.lines = []
        self._partial = b""

    def _read(self, timeout):
        fd = self.proc.stdout.fileno()
        ready, _, _ = select.select([fd], [], [], timeout)
        if not ready:
            return False
        chunk = os.read(fd, 65536)
        if not chunk:
            return None  # end of file
        data = self._partial + chunk
        *complete, self._partial = data.split(b"\n")
        self.lines += [x.decode() for x in complete]
        return True

    def wait_for(self, prefix, timeout=60.0):
        """Reads lines until one starts with `prefix`."""
        deadline = time.monotonic() + timeout
        seen = len(self.lines)
        while True:
            for line in self.lines[seen:]:
                if line.startswith(prefix):
                    return line
            seen = len(self.lines)
            left = deadline - time.monotonic()
            got = self._read(max(left, 0)) if left > 0 else False
            if not got:
                raise AssertionError(f"the child never said {prefix!r} (it said {self.lines}): "
                                     f"{self.stderr_tail()}")

    def go(self):
        self.proc.stdin.write(b"go\n")

    def kill(self):
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        while self._read(10.0):
            pass
        return self.proc.returncode

    def stderr_tail(self):
        if self.proc.poll() is None:
            return "(running)"
        return self.proc.stderr.read().decode(errors="replace")[-2000:]

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            f.close()


def _check_checkpoint(path, probe):
    """Loads and serves `path`; returns the single k it holds."""
    ec.load(path, into=probe)
    values, slot = probe.values(), probe.slots()["accumulators"]
    k = float(values[0, 0])
    assert k == int(k)
    k = int(k)
    assert (values == np.float32(k)).all(), f"values mix saves: {np.unique(values)[:10]}"
    assert (slot == np.float32(k + 0.5)).all(), f"the slot is not of save {k}: {np.unique(slot)[:10]}"
    assert probe.step == k, f"step {probe.step} is not of save {k}"
    served = ec.serving.open(path, verify="eager")
    ids = np.array([0, 1, ROWS // 2, ROWS - 1])
    np.testing.assert_array_equal(served.tables["big"].lookup(ids, combiner=None), np.full((4, DIM), k, np.float32))
    return k


@pytest.fixture
def path(tmp_path):
    """The checkpoint directory, removed afterwards whatever the outcome
    (pytest would otherwise keep its hundreds of MB)."""
    yield tmp_path / "ckpt"
    shutil.rmtree(tmp_path / "ckpt", ignore_errors=True)


def test_a_save_killed_at_any_moment_leaves_a_loadable_checkpoint(path):
    rng = np.random.default_rng(20240611)
    probe = ec.Table(name="big", rows=ROWS, dim=DIM, initializer=ec.initializers.Zeros(),
                     optimizer=ec.optimizers.Adagrad(0.1))
    # The good checkpoint the saves replace: k = 1.
    probe.assign(np.ones((ROWS, DIM), np.float32))
    probe.assign_slot("accumulators", np.full((ROWS, DIM), 1.5, np.float32))
    probe.step = 1
    ec.save(path, probe)
    assert _check_checkpoint(path, probe) == 1

    current = 1
    mid_save = completed_total = 0
    outcomes = []
    child = Child(path, 1000)
    following = None
    t_start = time.perf_counter()
    try:
        for i in range(1, KILLS + 1):
            child.wait_for("ready")
            child.go()
            # The next child starts while this one saves (its imports and allocations overlap).
            following = Child(path, 1000 * (i + 1)) if i < KILLS else None
            if i % 2:
                # A random moment after the start.
                delay = float(rng.uniform(0.0, MAX_DELAY_S))
                time.sleep(delay)
            else:
                # A random moment of a save that follows a complete one, however slow the disk is today.
                t0 = time.perf_counter()
                child.wait_for("done")
                save_s = time.perf_counter() - t0
                delay = float(rng.uniform(0.0, save_s))
                time.sleep(delay)
            rc = child.kill()
            assert rc == -signal.SIGKILL, f"the child ended by itself (exit {rc}): {child.stderr_tail()}"
            lines = child.lines
            child.close()
            child, following = following, None
            started = [int(x.split()[1]) for x in lines if x.startswith("start")]
            done = [int(x.split()[1]) for x in lines if x.startswith("done")]

            k = _check_checkpoint(path, probe)
            # The last save that said "done", or the one after it if the kill came
            # between its commit and its "done"; the old checkpoint if none committed.
            allowed = {done[-1] if done else current}
            if started and (not done or started[-1] > done[-1]):
                allowed.add(started[-1])
            assert k in allowed, (f"kill {i} after {delay:.2f} s: the checkpoint holds save {k}; started {started}, "
                                  f"done {done}, the previous checkpoint held {current}")
            mid_save += bool(started) and (not done or started[-1] > done[-1])
            completed_total += len(done)
            outcomes.append((round(delay, 2), len(started), len(done), k))
            current = k
    finally:
        for c in (child, following):
            if c is not None:
                c.close()
    elapsed = time.perf_counter() - t_start
    # The kills must have hit saves in flight, and saves must have completed between kills.
    assert mid_save >= KILLS // 4, outcomes
    assert completed_total >= KILLS // 2, outcomes

    # Leftovers of the killed saves: a complete save removes them all.
    names = set(os.listdir(path))
    probe.step = 5
    ec.save(path, probe)
    gen = ec.checkpoint.read_info(path).generation
    assert sorted(os.listdir(path)) == ["MANIFEST", f"t00000.accumulators.g{gen:012d}.ecd",
                                        f"t00000.values.g{gen:012d}.ecd"], names
    print(f"{KILLS} kills in {elapsed:.0f} s; (delay, saves started, saves done, k loaded): {outcomes}")


FULL_DISK_CHILD = r"""
import os, resource, signal, sys
import numpy as np
import embedcore as ec

path, limit = sys.argv[1], int(sys.argv[2])
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, like a full disk
configs = [ec.TableConfig(name=n, rows=rows, dim=16, initializer=ec.initializers.Constant(9.0))
           for n, rows in (("small", 100), ("big", 100_000))]
emb = ec.Embedding({c.name: ec.FeatureConfig(table=c) for c in configs}, optimizer=ec.optimizers.Adagrad(0.1))
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
try:
    ec.save(path, emb)
except OSError as e:
    print("failed:", e)
    sys.exit(0)
print("saved")
sys.exit(1)
"""


def test_a_save_that_fails_on_a_full_disk_removes_what_it_wrote(tmp_path):
    """A save that fails part way (here: writing its largest file past
    RLIMIT_FSIZE, as a full disk would) raises, keeps the previous checkpoint
    byte for byte, and removes the files it had written, so that a full disk
    is not left fuller; the next save succeeds."""
    path = str(tmp_path / "c")
    old = ec.Table(name="small", rows=100, dim=16, initializer=ec.initializers.Constant(1.0))
    ec.save(path, old)
    before = {n: open(os.path.join(path, n), "rb").read() for n in os.listdir(path)}

    # "small"'s files (about 10 KB each) fit under the limit, "big"'s (6.4 MB) do not.
    res = subprocess.run([sys.executable, "-c", FULL_DISK_CHILD, path, str(1 << 20)], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "failed:" in res.stdout and "write failed" in res.stdout, res.stdout
    after = {n: open(os.path.join(path, n), "rb").read() for n in os.listdir(path)}
    assert after == before  # the files "small" had written are gone; the old checkpoint is as it was

    got = ec.Table(name="small", rows=100, dim=16, initializer=ec.initializers.Zeros())
    ec.load(path, into=got)
    np.testing.assert_array_equal(got.to_numpy(), np.ones((100, 16), np.float32))
    ec.save(path, got)
    manifest = json.loads(_embedcore.read_info(path).manifest_json)
    named = {f["path"] for t in manifest["tables"] for f in t["values"]}
    assert set(os.listdir(path)) == named | {"MANIFEST"}


class _Interrupted(Exception):
    pass


def test_an_interrupted_load_of_several_tables_loads_all_or_none(tmp_path):
    # A signal handler that raises (Ctrl-C's KeyboardInterrupt) runs between
    # two bytecodes: it must not land between two tables' loads. Timers of
    # several delays put the interrupt in the verify pass, in the loads and
    # after them; every outcome is the whole checkpoint or the tables untouched.
    n = 40
    saved = [ec.Table(name=f"t{i}", rows=2000, dim=16, initializer=ec.initializers.Uniform(-1, 1, seed=i))
             for i in range(n)]
    ec.save(tmp_path / "ckpt", saved)
    before = [np.full((2000, 16), -7.0, np.float32) for _ in range(n)]
    took_us = 10**9
    for _ in range(3):  # the load's duration, warm
        targets = [ec.Table(name=f"t{i}", rows=2000, dim=16) for i in range(n)]
        start = time.perf_counter()
        ec.load(tmp_path / "ckpt", targets)
        took_us = min(took_us, int((time.perf_counter() - start) * 1e6))
    outcomes = set()
    previous = signal.signal(signal.SIGALRM, lambda *_: (_ for _ in ()).throw(_Interrupted()))
    try:
        for delay_us in range(took_us // 8, took_us * 3 // 2, max(1, took_us // 120)):
            targets = [ec.Table(name=f"t{i}", rows=2000, dim=16, initializer=ec.initializers.Constant(-7.0))
                       for i in range(n)]
            try:  # (armed inside: on a busy machine the alarm may come before the load starts)
                signal.setitimer(signal.ITIMER_REAL, delay_us / 1e6)
                ec.load(tmp_path / "ckpt", targets)
                signal.setitimer(signal.ITIMER_REAL, 0)
            except _Interrupted:
                pass
            signal.setitimer(signal.ITIMER_REAL, 0)
            loaded = [np.array_equal(t.values(), s.values()) for t, s in zip(targets, saved)]
            untouched = [np.array_equal(t.values(), b) for t, b in zip(targets, before)]
            assert all(loaded) or all(untouched), f"interrupted at {delay_us} us: {sum(loaded)} of {n} tables loaded"
            outcomes.add(all(loaded))
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert outcomes == {True, False}, f"the interrupt never landed {'before' if True in outcomes else 'after'} the load"
