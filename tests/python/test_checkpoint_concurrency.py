"""Saves and reads of one checkpoint directory at the same time: the
directory's lock (``flock``) makes saves run one after the other and keeps a
save's commit from removing the files a load, a verify or a serving open is
reading. Threads here (each call opens its own descriptor, so they contend as
processes do), and two processes once."""
from __future__ import annotations

import os
import subprocess
import sys
import threading

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
