"""Saves and reads of one checkpoint directory at the same time: the
directory's lock (``flock``) makes saves run one after the other and keeps a
save's commit from removing the files a load, a verify or a serving open is
reading. Threads here (each call opens its own descriptor, so they contend as
processes do), and two processes once."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import embedcore as ec
import embedcore.cli
from test_checkpoint_forge import read_manifest

ROWS, DIM = 2000, 16  # 128 KB of values: saves are quick, so many overlap


def make_table(seed: int, name: str = "t") -> ec.Table:
    t = ec.Table(name=name, rows=ROWS, dim=DIM, optimizer=ec.optimizers.Adagrad(0.1),
                 initializer=ec.initializers.Uniform(-1, 1, seed=seed))
    ids = np.arange(0, ROWS, 7, dtype=np.int64)
    offsets = np.arange(len(ids) + 1, dtype=np.int64)
    t.apply_gradients(ids, offsets, np.full((len(ids), DIM), seed, np.float32))  # slots differ between seeds too
    return t


def state(t: ec.Table):
    return np.array(t.values(), copy=True), np.array(t.slots()["accumulators"], copy=True), t.step


def same(a, b) -> bool:
    return np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]) and a[2] == b[2]


def our_files(path) -> set:
    return set(os.listdir(path))


def named_by_manifest(path) -> set:
    m = read_manifest(path)
    files = {"MANIFEST"}
    for t in m["tables"]:
        files.update(f["path"] for f in t["values"])
        files.update(f["path"] for fs in t["slots"].values() for f in fs)
    return files


def run_threads(targets):
    errors = []

    def wrap(fn):
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    threads = [threading.Thread(target=wrap, args=(fn,), daemon=True) for fn in targets]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=300)
        assert not th.is_alive(), "a thread did not finish (a lock never released?)"
    assert not errors, errors


def test_saves_into_one_directory_run_one_after_another(tmp_path):
    """Four threads save different tables into one directory, five times each:
    every save succeeds, and the directory ends holding one whole checkpoint
    (one of theirs) and no file of any other save. Without the lock, a save's
    commit removed the files of the other saves in flight: saves reported
    success and the directory held a manifest naming missing files."""
    path = tmp_path / "ckpt"
    tables = [make_table(seed=s) for s in range(1, 5)]
    states = [state(t) for t in tables]
    run_threads([lambda t=t: [ec.save(path, t) for _ in range(5)] for t in tables])
    assert our_files(path) == named_by_manifest(path)
    u = make_table(seed=9)
    ec.load(path, into=u)
    assert any(same(state(u), s) for s in states)
    assert embedcore.cli.main(["verify", str(path)]) == 0


def test_loads_during_saves_see_one_whole_checkpoint(tmp_path):
    """One thread saves two states in turn while others load, verify and open
    the checkpoint for serving: every read succeeds and sees exactly one
    save's state (values, slot and step together)."""
    path = tmp_path / "ckpt"
    a, b = make_table(seed=1), make_table(seed=2)
    ec.save(path, a)
    states = [state(a), state(b)]
    done = threading.Event()

    def saver():
        try:
            for k in range(30):
                ec.save(path, (a, b)[k % 2])
        finally:
            done.set()

    seen = []

    def loader():
        u = make_table(seed=5)
        while not done.is_set():
            ec.load(path, into=u)
            s = state(u)
            assert any(same(s, x) for x in states), "a load mixed two saves"
            seen.append(s[2])

    def server():
        while not done.is_set():
            served = ec.serving.open(path, verify="eager")
            v = np.array(served.embedding_tables["t"].values())
            assert any(np.array_equal(v, x[0]) for x in states), "serving mixed two saves"
            assert embedcore.cli.main(["verify", str(path)]) == 0

    run_threads([saver, loader, loader, server])
    assert seen, "no load ran during the saves"
    assert our_files(path) == named_by_manifest(path)


_SAVE_LOOP = """
import sys, numpy as np, embedcore as ec
seed = int(sys.argv[1])
t = ec.Table(name="t", rows={rows}, dim={dim}, optimizer=ec.optimizers.Adagrad(0.1),
             initializer=ec.initializers.Uniform(-1, 1, seed=seed))
for _ in range(20):
    ec.save({path!r}, t)
print("saved")
"""


@pytest.mark.parametrize("sharded", [False, True])
def test_an_optimizer_changed_during_a_load_refuses_it_before_any_table_changes(tmp_path, monkeypatch, sharded):
    """Another thread's set_optimizer on table 'b' after ec.load checked it,
    before the copy: the load raises CheckpointError naming 'b', and table
    'a', which comes first, keeps its values (it used to be loaded before the
    copy checked 'b' again)."""
    def make(value, world=None):
        tables = [ec.TableConfig(n, rows, 4, initializer=ec.initializers.Constant(value)) for n, rows in (("a", 6),
                                                                                                      ("b", 5))]
        kw = {} if world is None else {"world": world, "sharding": "row_wise"}
        return ec.Embedding({t.name: ec.FeatureConfig(t) for t in tables}, ec.optimizers.SGD(0.1), **kw)

    ec.save(tmp_path / "ck", make(1.0))
    native = ec.checkpoint._embedcore
    real = native.load_tables

    def changing_b_first(info, items, *args, **kwargs):
        for _, table, _, _ in items:  # (the engine's table: as set_optimizer from another thread leaves it)
            if table.name == "b":
                table.set_optimizer(ec.optimizers.Adagrad(0.1)._native())
        return real(info, items, *args, **kwargs)

    monkeypatch.setattr(native, "load_tables", changing_b_first)

    def load(emb):
        # (Sharded, the other ranks may have loaded theirs: the error says to load again, on every rank.)
        again = r".*load again, on every rank\)$" if sharded else ""
        with pytest.raises(ec.CheckpointError, match=r"table 'b' was saved with optimizer slots none, the target "
                                                     r"table's optimizer has slots \[accumulators\]" + again):
            ec.load(tmp_path / "ck", into=emb)
        if sharded:
            tables = [t for shards in emb.local_shards.values() for _, t in shards]
        else:
            tables = list(emb.embedding_tables.values())
        return [float(t.to_numpy().min()) for t in tables] + [float(t.to_numpy().max()) for t in tables]

    if sharded:
        for seen in ec.distributed.run_local(2, lambda world: load(make(2.0, world))):
            assert seen == [2.0] * len(seen)
    else:
        assert load(make(2.0)) == [2.0] * 4


@pytest.mark.parametrize("call", ["save", "reshard"])
def test_a_ctrl_c_after_the_commit_says_the_save_took_effect(tmp_path, monkeypatch, call):
    """Ctrl-C handled as the native commit returns (Python runs its handler
    then): the KeyboardInterrupt says that the directory holds the new
    checkpoint (it was bare, as if nothing had changed); one before the
    commit stays a plain KeyboardInterrupt, the old checkpoint kept."""
    t = ec.Table(name="t", rows=8, dim=2, initializer=ec.initializers.Constant(1.0))
    ec.save(tmp_path / "src", t)
    t.assign(np.full((8, 2), 2.0, np.float32))
    native = ec.checkpoint._embedcore
    real = native.commit_checkpoint

    def interrupted(after):
        def commit(*args):
            if after:
                real(*args)
            raise KeyboardInterrupt
        return commit

    def run(dst):
        if call == "save":
            ec.save(dst, t)
        else:
            ec.distributed.reshard(tmp_path / "src", dst, 2, "row_wise")

    dst = tmp_path / "dst"
    ec.save(dst, ec.Table(name="t", rows=8, dim=2, initializer=ec.initializers.Zeros()))  # the old checkpoint
    monkeypatch.setattr(native, "commit_checkpoint", interrupted(False))
    with pytest.raises(KeyboardInterrupt) as raised:
        run(dst)
    assert str(raised.value) == "" and ec.serving.open(dst).tables["t"].values().max() == 0.0
    monkeypatch.setattr(native, "commit_checkpoint", interrupted(True))
    with pytest.raises(KeyboardInterrupt, match=r"interrupted after the save committed: it holds the new checkpoint"):
        run(dst)
    served = ec.serving.open(dst).tables["t"].lookup(np.arange(8), combiner=None)
    assert served.min() == served.max() == (2.0 if call == "save" else 1.0)


def test_a_ctrl_c_before_the_commit_makes_no_claim_when_another_save_commits_next(tmp_path, monkeypatch):
    """A save interrupted before its commit lets its generation go; another
    save may then commit that generation number: the interrupted one's
    KeyboardInterrupt stays bare (it said "it holds the new checkpoint" when
    it looked after letting go)."""
    path = tmp_path / "ck"
    ec.save(path, ec.Table(name="old", rows=4, dim=2))
    native = ec.checkpoint._embedcore
    real_write, real_cleanup = native.write_shard_files, ec.checkpoint._remove_if_created_and_empty

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    def another_save_next(*args, **kwargs):  # (runs once this save let its claim go)
        monkeypatch.setattr(native, "write_shard_files", real_write)
        monkeypatch.setattr(ec.checkpoint, "_remove_if_created_and_empty", real_cleanup)
        ec.save(path, ec.Table(name="other", rows=4, dim=2))
        return real_cleanup(*args, **kwargs)

    monkeypatch.setattr(native, "write_shard_files", interrupted)
    monkeypatch.setattr(ec.checkpoint, "_remove_if_created_and_empty", another_save_next)
    with pytest.raises(KeyboardInterrupt) as raised:
        ec.save(path, ec.Table(name="mine", rows=4, dim=2))
    assert str(raised.value) == ""
    assert list(ec.serving.open(path).tables) == ["other"]


def test_two_processes_saving_into_one_directory(tmp_path):
    """Two processes (the lock is the file system's, not the process's)."""
    path = tmp_path / "ckpt"
    code = _SAVE_LOOP.format(rows=ROWS, dim=DIM, path=str(path))
    env = dict(os.environ, SKBUILD_EDITABLE_VERBOSE="0")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(seed)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for seed in (1, 2)]
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0 and out.strip() == "saved", err[-2000:]
    assert our_files(path) == named_by_manifest(path)
    u = ec.Table(name="t", rows=ROWS, dim=DIM, optimizer=ec.optimizers.Adagrad(0.1))
    ec.load(path, into=u)
    firsts = [ec.Table(name="t", rows=ROWS, dim=DIM, initializer=ec.initializers.Uniform(-1, 1, seed=s)).values()
              for s in (1, 2)]
    assert any(np.array_equal(u.values(), f) for f in firsts)


def test_a_commit_waits_for_a_reader(tmp_path):
    """While a reader holds the directory's lock, a save writes its files but
    commits (renames MANIFEST, removes the old files) only once the reader
    lets go: the files the reader opens stay there."""
    from embedcore import _embedcore

    path = tmp_path / "ckpt"
    ec.save(path, make_table(seed=1))
    first = named_by_manifest(path)
    reader = _embedcore.CheckpointLock(str(path), False)
    assert reader.held
    done = threading.Event()
    th = threading.Thread(target=lambda: (ec.save(path, make_table(seed=2)), done.set()), daemon=True)
    th.start()
    assert not done.wait(1.0), "a commit ran while a reader held the lock"
    assert named_by_manifest(path) == first and first <= our_files(path)
    assert len(our_files(path)) > len(first), "the waiting save has not written its files"
    reader.release()
    assert done.wait(60)
    th.join()
    assert our_files(path) == named_by_manifest(path)
    u = make_table(seed=9)
    ec.load(path, into=u)
    assert same(state(u), state(make_table(seed=2)))


_WAIT_THEN_CTRL_C = r"""
import signal, sys, time, numpy as np, embedcore as ec
# Python's own SIGINT handler, as in a terminal (a background job, as under CI, starts with SIGINT ignored).
signal.signal(signal.SIGINT, signal.default_int_handler)
path, call = sys.argv[1], sys.argv[2]
t = ec.Table(name="t", rows=10, dim=2, initializer=ec.initializers.Constant(2.0))
print("calling", flush=True)
start = time.monotonic()
try:
    if call == "save":
        ec.save(path, t)
    elif call == "load":
        ec.load(path, into=t)
    else:
        ec.serving.open(path)
    print("returned", flush=True)
except KeyboardInterrupt:
    print(f"KeyboardInterrupt after {time.monotonic() - start:.1f} s", flush=True)
"""


@pytest.mark.parametrize("call, held", [("save", "shared"), ("load", "exclusive"), ("serving.open", "exclusive")])
def test_ctrl_c_stops_a_wait_for_the_checkpoints_lock(tmp_path, call, held):
    """A save whose commit waits for a reader (a long load, `embedcore
    verify`, or a forked child that outlives its parent: the wait has no
    bound), and a load or an open for serving waiting for a commit, stop at
    Ctrl-C with KeyboardInterrupt, nothing changed. The wait ignored Ctrl-C
    until the lock was released (and a save then raised KeyboardInterrupt
    after it had committed)."""
    import fcntl
    import signal

    path = tmp_path / "ckpt"
    ec.save(path, make_table(seed=1))
    first = named_by_manifest(path)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH if held == "shared" else fcntl.LOCK_EX)
        script = tmp_path / "wait.py"
        script.write_text(_WAIT_THEN_CTRL_C)
        child = subprocess.Popen([sys.executable, str(script), str(path), call], stdout=subprocess.PIPE, text=True)
        assert child.stdout.readline().strip() == "calling"
        time.sleep(1.0)  # (in its wait: the lock is held until the end of the test)
        child.send_signal(signal.SIGINT)
        out, _ = child.communicate(timeout=60)
        assert out.startswith("KeyboardInterrupt after "), out
    finally:
        os.close(fd)
    assert named_by_manifest(path) == first and our_files(path) == first  # the save left nothing behind
    u = make_table(seed=9)
    ec.load(path, into=u)
    assert same(state(u), state(make_table(seed=1)))


def test_a_commit_keeps_the_files_of_a_save_in_progress(tmp_path):
    """Two claims get two generations; a commit removes no file of a
    generation whose claim is held, and does remove those of a claim that was
    let go (a save that died: the kernel drops its lock)."""
    from embedcore import _embedcore

    path = tmp_path / "ckpt"
    ec.save(path, make_table(seed=1))
    a = _embedcore.GenerationClaim(str(path))
    b = _embedcore.GenerationClaim(str(path))
    assert b.generation > a.generation > read_manifest(path)["generation"]
    for claim in (a, b):  # a data file of each, as a save in progress has
        (path / f"t00000.values.g{claim.generation:012d}.ecd").write_bytes(b"partial")
    b.release()  # b died: its claim file stays, unlocked
    ec.save(path, make_table(seed=2))
    left = our_files(path) - named_by_manifest(path)
    assert left == {f"MANIFEST.tmp.g{a.generation:012d}", f"t00000.values.g{a.generation:012d}.ecd"}, left
    a.release()
    ec.save(path, make_table(seed=3))
    assert our_files(path) == named_by_manifest(path)


def test_locks_and_claims_where_there_is_no_directory(tmp_path):
    from embedcore import _embedcore

    assert not _embedcore.CheckpointLock(str(tmp_path / "missing"), False).held
    (tmp_path / "file").write_text("x")
    assert not _embedcore.CheckpointLock(str(tmp_path / "file"), False).held
    with pytest.raises(OSError, match="not a directory"):
        _embedcore.GenerationClaim(str(tmp_path / "file"))
    claim = _embedcore.GenerationClaim(str(tmp_path / "new"))  # a save's claim creates the directory
    assert claim.generation == 1 and (tmp_path / "new" / "MANIFEST.tmp.g000000000001").is_file()
    claim.release()


def test_a_symlink_repointed_during_a_read_does_not_mix_two_checkpoints(tmp_path, monkeypatch):
    # /models/current re-pointed to a newer checkpoint while a load or a
    # serving open reads through it: both checkpoints are of generation 1, so
    # their files have the same names. The read must take every file from the
    # directory the link named when it began.
    a, b = make_table(1), make_table(2)
    ec.save(tmp_path / "a", a)
    ec.save(tmp_path / "b", b)
    link = tmp_path / "current"
    os.symlink(tmp_path / "a", link)

    def repoint():
        os.unlink(link)
        os.symlink(tmp_path / "b", link)

    from embedcore import _embedcore
    verify = _embedcore.verify_table_block

    def verify_then_repoint(*args):  # between the checksum pass and the copy
        verify(*args)
        repoint()

    monkeypatch.setattr(_embedcore, "verify_table_block", verify_then_repoint)
    target = make_table(3)
    ec.load(link, target)
    assert same(state(target), state(a))
    monkeypatch.undo()

    os.unlink(link)
    os.symlink(tmp_path / "a", link)
    read_info = ec.checkpoint.read_info

    def read_info_then_repoint(path):  # between the manifest and the files of `verify`
        info = read_info(path)
        repoint()
        return info

    monkeypatch.setattr(ec.checkpoint, "read_info", read_info_then_repoint)
    assert embedcore.cli.main(["verify", str(link)]) == 0


# An LD_PRELOAD shim: with EMBEDCORE_TEST_CLAIM_GATE=<dir> set, the first
# exclusive create of a claim file (MANIFEST.tmp.g...) creates <dir>/waiting,
# then waits (60 s at most) for <dir>/go before it goes on to the real open.
# The save has listed the directory (its generation chosen) by then and
# claimed nothing. Every open entry point a build may call is wrapped
# (open64, __open_2 with _FORTIFY_SOURCE, openat).
_CLAIM_GATE_SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int gated;

static void gate(const char* path, int flags) {
  const char* dir = getenv("EMBEDCORE_TEST_CLAIM_GATE");
  if (dir == NULL || gated || path == NULL || (flags & (O_CREAT | O_EXCL)) != (O_CREAT | O_EXCL)) return;
  const char* base = strrchr(path, '/');
  base = base ? base + 1 : path;
  if (strncmp(base, "MANIFEST.tmp.g", 14) != 0) return;
  gated = 1;  /* the opens below, and every later claim, pass straight through */
  char waiting[4096], go[4096];
  snprintf(waiting, sizeof(waiting), "%s/waiting", dir);
  snprintf(go, sizeof(go), "%s/go", dir);
  int fd = open(waiting, O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
  if (fd >= 0) close(fd);
  for (int i = 0; i < 6000 && access(go, F_OK) != 0; ++i) usleep(10000);
}

typedef int (*open_fn)(const char*, int, ...);
typedef int (*openat_fn)(int, const char*, int, ...);
typedef int (*open2_fn)(const char*, int);
typedef int (*openat2_fn)(int, const char*, int);
#define MODE(flags) \
  mode_t mode = 0; \
  if (((flags) & O_CREAT) || ((flags) & O_TMPFILE) == O_TMPFILE) { \
    va_list ap; \
    va_start(ap, flags); \
    mode = va_arg(ap, int); \
    va_end(ap); \
  }
#define REAL(name, type) \
  static type real; \
  if (!real) real = (type)dlsym(RTLD_NEXT, name)

int open(const char* p, int flags, ...) {
  MODE(flags) gate(p, flags); REAL("open", open_fn); return real(p, flags, mode);
}
int open64(const char* p, int flags, ...) {
  MODE(flags) gate(p, flags); REAL("open64", open_fn); return real(p, flags, mode);
}
int openat(int d, const char* p, int flags, ...) {
  MODE(flags) gate(p, flags); REAL("openat", openat_fn); return real(d, p, flags, mode);
}
int openat64(int d, const char* p, int flags, ...) {
  MODE(flags) gate(p, flags); REAL("openat64", openat_fn); return real(d, p, flags, mode);
}
int __open_2(const char* p, int flags) { gate(p, flags); REAL("__open_2", open2_fn); return real(p, flags); }
int __open64_2(const char* p, int flags) { gate(p, flags); REAL("__open64_2", open2_fn); return real(p, flags); }
int __openat_2(int d, const char* p, int flags) {
  gate(p, flags); REAL("__openat_2", openat2_fn); return real(d, p, flags);
}
int __openat64_2(int d, const char* p, int flags) {
  gate(p, flags); REAL("__openat64_2", openat2_fn); return real(d, p, flags);
}
"""

# Saver B: tables x and y; with "fail", stored as float16 while y holds a
# value beyond float16's range, so the save fails after writing x's values.
_GATED_SAVE = """
import sys
import numpy as np
import embedcore as ec
x = ec.Table(name="x", rows={rows}, dim={dim}, initializer=ec.initializers.Uniform(-1, 1, seed=99))
y = ec.Table(name="y", rows={rows}, dim={dim}, initializer=ec.initializers.Uniform(-1, 1, seed=98))
fail = sys.argv[1] == "fail"
if fail:
    y.assign(np.full((1, {dim}), 1e6, np.float32), start_row=5)
try:
    ec.save({path!r}, [x, y], include_optimizer=False, values_dtype="float16" if fail else None)
except ValueError as e:
    print("failed:", e)
else:
    print("saved")
"""


def _xy(seed: int):
    return [ec.Table(name=n, rows=ROWS, dim=DIM, initializer=ec.initializers.Uniform(-1, 1, seed=seed + k))
            for k, n in enumerate("xy")]


def _claim_gate_shim(tmp_path) -> str:
    if not sys.platform.startswith("linux"):
        pytest.skip("the claim-delaying shim is an LD_PRELOAD library (Linux, glibc)")
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler (cc or gcc) to build the LD_PRELOAD shim that delays a save's claim")
    src, lib = tmp_path / "claim_gate.c", tmp_path / "claim_gate.so"
    src.write_text(_CLAIM_GATE_SHIM)
    r = subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(lib), str(src), "-ldl"], capture_output=True,
                       text=True)
    assert r.returncode == 0, f"{cc} could not build the LD_PRELOAD shim: {r.stderr[-2000:]}"
    return str(lib)


@pytest.mark.parametrize("b_outcome", ["saved", "fail"])
def test_a_save_that_chose_its_generation_before_another_committed_it(tmp_path, b_outcome):
    """Saver B lists the directory (generation 2 is next) and, before it
    creates its claim, saver A claims, writes and commits generation 2. B's
    claim file is free again then (A's was renamed to MANIFEST), so B's
    create succeeds, but the generation is live: B must claim above it (3),
    never write files of A's names. Then a B that saves commits generation 3,
    whole; a B that fails leaves A's checkpoint whole. A claim kept when the
    newest generation present equals its own (`>` for `>=`) passed every
    other test: B overwrote the live checkpoint's files and committed
    generation 2 again, or, failing, left A's MANIFEST naming B's values."""
    shim = _claim_gate_shim(tmp_path)
    path, gate = tmp_path / "ckpt", tmp_path / "gate"
    gate.mkdir()
    ec.save(path, _xy(seed=1), include_optimizer=False)  # generation 1
    env = dict(os.environ, SKBUILD_EDITABLE_VERBOSE="0", EMBEDCORE_TEST_CLAIM_GATE=str(gate),
               LD_PRELOAD=" ".join(filter(None, [shim, os.environ.get("LD_PRELOAD")])))
    code = _GATED_SAVE.format(rows=ROWS, dim=DIM, path=str(path))
    b = subprocess.Popen([sys.executable, "-c", code, b_outcome], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=env)
    try:
        deadline = time.monotonic() + 120  # B's interpreter start and import
        while not (gate / "waiting").exists():
            assert b.poll() is None, f"saver B ended before its claim: {b.communicate()}"
            assert time.monotonic() < deadline, "saver B never reached its claim"
            time.sleep(0.01)
        a = _xy(seed=2)
        ec.save(path, a, include_optimizer=False)  # A: generation 2, committed while B waits
        assert read_manifest(path)["generation"] == 2
    finally:
        (gate / "go").touch()
        try:
            out, err = b.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            b.kill()  # (no saver left behind; the assertion that failed above, if one did, is chained)
            out, err = b.communicate()
            pytest.fail(f"saver B did not finish within 120 s of the gate opening:\n{err[-2000:]}")
    assert b.returncode == 0, err[-2000:]
    assert out.startswith(b_outcome), (out, err[-2000:])
    manifest = read_manifest(path)
    assert manifest["generation"] == (3 if b_outcome == "saved" else 2), manifest["generation"]
    assert embedcore.cli.main(["verify", str(path)]) == 0
    assert our_files(path) == named_by_manifest(path)
    want = a if b_outcome == "fail" else [ec.Table(name=n, rows=ROWS, dim=DIM, initializer=ec.initializers.Uniform(
        -1, 1, seed=s)) for n, s in (("x", 99), ("y", 98))]  # B's
    got = _xy(seed=7)
    ec.load(path, got)
    for g, w in zip(got, want):
        assert np.array_equal(g.values(), w.values()), g.name
