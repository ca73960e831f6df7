"""The checkpoint code under failing system calls, injected by the LD_PRELOAD
shim of faults.py in a child process: what a save or a load does when an
open, a read, a listing or an fsync fails (EIO, EACCES, EMFILE, EINTR)."""
from __future__ import annotations

import errno
import os
import subprocess
import sys

import numpy as np
import pytest

import embedcore as ec
import faults
from test_checkpoint_forge import read_manifest

ROWS, DIM = 1000, 16


def make_table(seed: int, name: str = "t") -> ec.Table:
    t = ec.Table(name=name, rows=ROWS, dim=DIM, optimizer=ec.optimizers.Adagrad(0.1),
                 initializer=ec.initializers.Uniform(-1, 1, seed=seed))
    ids = np.arange(0, ROWS, 7, dtype=np.int64)
    t.apply_gradients(ids, np.arange(len(ids) + 1, dtype=np.int64), np.full((len(ids), DIM), seed, np.float32))
    return t


_SAVE = """
import sys
import numpy as np
import embedcore as ec
t = ec.Table(name="t", rows={rows}, dim={dim}, optimizer=ec.optimizers.Adagrad(0.1),
             initializer=ec.initializers.Uniform(-1, 1, seed=int(sys.argv[2])))
try:
    ec.save(sys.argv[1], t)
except Exception as e:
    print("failed:", type(e).__name__, getattr(e, "errno", None), e)
else:
    print("saved")
""".format(rows=ROWS, dim=DIM)


def test_a_claim_that_cannot_be_opened_keeps_its_save_files(tmp_path):
    """A commit removes the files of a generation only when it holds that
    generation's claim, or when there is no claim file. A claim file that is
    there but cannot be opened (another user's mode 0600 claim: EACCES;
    EMFILE, ENFILE) may be a live save's: its files stay. (Every open failure
    read as "no claim file" removed a live save's files and claim.)"""
    path = tmp_path / "ckpt"
    ec.save(path, make_table(1))  # generation 1
    # Another user's save in progress, at generation 5: its claim and a data file it is writing.
    claim = path / "MANIFEST.tmp.g000000000005"
    data = path / "t00000.values.g000000000005.ecd"
    claim.write_bytes(b"")
    data.write_bytes(b"being written")
    for err in (errno.EACCES, errno.EMFILE, errno.EIO):
        r = faults.run(tmp_path, _SAVE, f"open:MANIFEST.tmp.g000000000005:*:{err}", path, 2)
        assert r.returncode == 0, r.stderr[-3000:]
        assert r.stdout.startswith("saved"), (r.stdout, r.stderr[-3000:])
        assert claim.exists() and data.exists(), (errno.errorcode[err], sorted(os.listdir(path)))
    assert read_manifest(path)["generation"] == 8  # above the claimed 5: 6, 7, 8
    # Without the fault the claim (not locked: its save died) is taken, and its files removed.
    ec.save(path, make_table(3))
    assert not claim.exists() and not data.exists()



@pytest.mark.parametrize("call,where,calls", [
    ("fsync", ".values.g", "1"),             # a data file's
    ("fsync", "MANIFEST.tmp.g", "1"),        # the temporary manifest's
    ("fsync", "{parent}", "1-2"),            # the parent's after the mkdir, then the directory's
    ("rename", "MANIFEST.tmp.g", "1"),
    ("mkdir", "ckpt", "1"),
    ("close", ".values.g", "1"),
    ("close", "MANIFEST.tmp.g", "1"),
])
def test_a_save_retries_calls_a_signal_interrupts(tmp_path, call, where, calls):
    """EINTR (a signal handled while a call waits, on NFS or FUSE) is no
    failure: fsync (of a data file, the manifest and the directories), the
    rename to MANIFEST and the mkdir of the directory are retried, and a
    close interrupted has closed (Linux), so a save completes. (Each raised
    InterruptedError.)"""
    path = tmp_path / "ckpt"
    rule = f"{call}:{where.format(parent=tmp_path)}:{calls}:{errno.EINTR}"
    r = faults.run(tmp_path, _SAVE, rule, path, 2)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.startswith("saved"), (rule, r.stdout, r.stderr[-3000:])
    got = make_table(7)
    ec.load(path, got)
    want = ec.Table(name="t", rows=ROWS, dim=DIM, initializer=ec.initializers.Uniform(-1, 1, seed=2))
    assert np.array_equal(got.values(), want.values())
    assert ec.checkpoint.read_info(path).generation == 1


_LOAD = """
import sys
import numpy as np
import embedcore as ec
t = ec.Table(name="t", rows={rows}, dim={dim}, optimizer=ec.optimizers.Adagrad(0.1), initializer=ec.initializers.Zeros())
try:
    ec.load(sys.argv[1], t)
except Exception as e:
    print("failed:", type(e).__name__, getattr(e, "errno", None), e)
    print("unchanged" if not t.values().any() and t.step == 0 else "changed")
else:
    print("loaded")
""".format(rows=ROWS, dim=DIM)


@pytest.mark.parametrize("err", [errno.EMFILE, errno.ENFILE, errno.EIO])
def test_a_directory_that_cannot_be_opened_to_lock_it_fails_the_load(tmp_path, err):
    """A load holds the directory's lock (flock) so that no commit removes
    its files meanwhile; an open of the directory that fails for any reason
    but its absence raises OSError naming it. (Only EACCES and EPERM did:
    EMFILE, ENFILE or EIO ran the load without the lock.)"""
    path = tmp_path / "ckpt"
    ec.save(path, make_table(1))
    r = faults.run(tmp_path, _LOAD, f"open:{path}$:*:{err}", path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.startswith(f"failed: OSError {err} "), r.stdout
    assert f"{path}: cannot open the directory to lock it: {os.strerror(err)}" in r.stdout
    assert r.stdout.endswith("unchanged\n")


def _saved_values(seed: int):
    return ec.Table(name="t", rows=ROWS, dim=DIM, initializer=ec.initializers.Uniform(-1, 1, seed=seed)).values()


@pytest.mark.parametrize("rule", ["opendir:ckpt$:*:5", "pread:MANIFEST$:2-99:5",
                                  "opendir:ckpt$:*:5;pread:MANIFEST$:2-99:5"])
def test_a_save_that_cannot_list_the_directory_or_read_its_manifest_fails(tmp_path, rule):
    """A save picks a generation above every one present, from the listing
    of the directory and its MANIFEST: one that cannot list it (opendir or
    readdir fails) or read a MANIFEST that is there (EIO) raises OSError,
    and the live checkpoint stays whole. (An empty list and an ignored read
    error made it pick the live generation, and open its files with
    O_TRUNC: the checkpoint was lost.)"""
    path = tmp_path / "ckpt"
    r = faults.run(tmp_path, _SAVE, "", path, 1)  # generation 1
    assert r.stdout.startswith("saved"), r.stdout + r.stderr[-2000:]
    r = faults.run(tmp_path, _SAVE, rule, path, 2)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.startswith("failed: OSError 5 "), r.stdout
    assert ("cannot list the directory" if rule.startswith("opendir") else "MANIFEST: read failed") in r.stdout
    got = make_table(7)
    ec.load(path, got)
    assert np.array_equal(got.values(), _saved_values(1))
    assert read_manifest(path)["generation"] == 1


def test_a_data_file_is_never_overwritten(tmp_path):
    """A save creates its data files (O_EXCL): a file of the same name
    (another writer's; the live checkpoint's, were the generation picked
    wrong) is refused with FileExistsError naming it, and stays as it was.
    (They were opened with O_TRUNC.)"""
    from embedcore import _embedcore
    path = tmp_path / "ckpt"
    ec.save(path, make_table(1))
    name = read_manifest(path)["tables"][0]["values"][0]["path"]
    before = (path / name).read_bytes()
    with pytest.raises(FileExistsError, match=f"{name}: exists already"):
        _embedcore.write_shard_files(str(path), 1, "t00000.", -1, make_table(2)._native, 0, 0, True)
    assert (path / name).read_bytes() == before
    got = make_table(7)
    ec.load(path, got)
    assert np.array_equal(got.values(), make_table(1).values())


def _state(t: ec.Table):
    return np.array(t.values(), copy=True), np.array(t.slots()["accumulators"], copy=True), t.step


@pytest.mark.parametrize("how", ["removed", "replaced"])
def test_a_file_removed_or_replaced_between_the_verification_and_the_copy_changes_nothing(tmp_path, monkeypatch,
                                                                                         how):
    """The verification opens every file a load reads and the copy reads
    through those descriptors: the data files removed (or replaced by zeros
    of the same size) between the two passes change nothing, the load takes
    the verified checkpoint whole. (The copy opened them again: a removed
    file failed the load with the first table loaded and the second half
    loaded, values without slots; a replaced one loaded unverified bytes.)"""
    from embedcore import _embedcore
    path = tmp_path / "ckpt"
    ec.save(path, [make_table(1, "a"), make_table(2, "b")])
    real = _embedcore.load_tables

    def between(*args, **kwargs):
        for name in os.listdir(path):
            if name.endswith(".ecd"):
                size = (path / name).stat().st_size
                (path / name).unlink()
                if how == "replaced":
                    (path / name).write_bytes(bytes(size))
        return real(*args, **kwargs)

    monkeypatch.setattr(_embedcore, "load_tables", between)
    got = [make_table(7, "a"), make_table(8, "b")]
    ec.load(path, got)
    for g, seed in zip(got, (1, 2)):
        want = _state(make_table(seed, g.name))
        have = _state(g)
        assert all(np.array_equal(x, y) for x, y in zip(have[:2], want[:2])) and have[2] == want[2], g.name


_LOAD_MANY = """
import os, resource, sys
import numpy as np
import embedcore as ec
from embedcore import _embedcore
resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
path, how = sys.argv[1], sys.argv[2]
def tables(seed):
    return [ec.Table(name=f"t{i}", rows=8, dim=4, optimizer=ec.optimizers.Adagrad(0.1),
                     initializer=ec.initializers.Uniform(-1, 1, seed=seed + i)) for i in range(60)]
ec.save(path, tables(1))
real = _embedcore.load_tables
def between(*args, **kwargs):
    # The last table's values: past the kept descriptors (the first 16 files opened are kept).
    name = os.path.join(path, [n for n in sorted(os.listdir(path)) if n.startswith("t00059.values")][0])
    size, st = os.path.getsize(name), os.stat(name)
    if how == "removed":
        os.unlink(name)
    elif how == "replaced":
        os.unlink(name)
        with open(name, "wb") as f:
            f.write(bytes(size))
    elif how in ("in place", "kept, in place, linked"):
        # The same inode rewritten, its modification time put back (cp -p, rsync -a --inplace); the second: the
        # first table's values, a kept descriptor, and a hard link added after (its link count moves).
        if how != "in place":
            name = os.path.join(path, [n for n in sorted(os.listdir(path)) if n.startswith("t00000.values")][0])
            st = os.stat(name)
        with open(name, "r+b") as f:
            f.seek(size - 64)
            f.write(bytes(64))
        os.utime(name, ns=(st.st_atime_ns, st.st_mtime_ns))
        if how != "in place":
            os.link(name, name + ".link")
    return real(*args, **kwargs)
_embedcore.load_tables = between
got = tables(100)
try:
    ec.load(path, got)
except Exception as e:
    print("failed:", type(e).__name__, e)
    print("unchanged", all(np.array_equal(g.values(), w.values()) for g, w in zip(got, tables(100))))
else:
    print("loaded", all(np.array_equal(g.values(), w.values()) for g, w in zip(got, tables(1))))
"""


@pytest.mark.parametrize("how", ["same", "removed", "replaced", "in place", "kept, in place, linked"])
def test_a_load_of_more_files_than_it_may_keep_open(tmp_path, how):
    """A process keeps at most a quarter of its descriptor limit (and 256) of
    the files its loads' verifications opened: 60 Adagrad tables (120
    files) under a limit of 64 descriptors load whole (keeping every one
    failed with EMFILE: 1,500 tables under the common limit of 1,024). A file
    past the kept ones, removed, replaced, or rewritten in place with its
    modification time put back, between the verification and the copy, is
    refused by its identity (its inode, size, modification and change times)
    before any table changes."""
    r = subprocess.run([sys.executable, "-c", _LOAD_MANY, str(tmp_path / "ckpt"), how], capture_output=True,
                       text=True, env=dict(os.environ, SKBUILD_EDITABLE_VERBOSE="0"), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    if how == "same":
        assert r.stdout.strip() == "loaded True", r.stdout
    else:
        assert "failed: CheckpointError" in r.stdout and ("t00000.values" if "kept" in how else "t00059.values") \
            in r.stdout and \
            "changed (removed, replaced or rewritten) after this load verified it" in r.stdout and \
            "unchanged True" in r.stdout, r.stdout


_LOAD_TWO = """
import sys
import numpy as np
import embedcore as ec
t = [ec.Table(name=n, rows={rows}, dim={dim}, optimizer=ec.optimizers.Adagrad(0.1), initializer=ec.initializers.Zeros())
     for n in "ab"]
try:
    ec.load(sys.argv[1], t)
except Exception as e:
    print("failed:", type(e).__name__, getattr(e, "errno", None), e)
else:
    print("loaded")
fresh = ec.Table(name="f", rows={rows}, dim={dim}, optimizer=ec.optimizers.Adagrad(0.1)).slots()["accumulators"]
for x in t:
    print(x.name, "values", bool(x.values().any()), "slots", not np.array_equal(x.slots()["accumulators"], fresh),
          "step", x.step)
""".format(rows=ROWS, dim=DIM)


def test_an_io_error_of_the_copy_says_which_tables_are_partly_loaded(tmp_path):
    """An I/O error of the copy itself (a disk failing after the verification;
    the tables are not staged in extra memory) leaves a table partly loaded:
    the OSError (its errno kept) says so, names the tables loaded before
    it, and says to load again. (It was the bare read error: a caller could
    not tell that the target had changed.)"""
    path = tmp_path / "ckpt"
    ec.save(path, [make_table(1, "a"), make_table(2, "b")])
    # Table b's slot file: its verification reads 3 times (header, padding, payload), the copy after that.
    r = faults.run(tmp_path, _LOAD_TWO, f"pread:t00001.accumulators.g:4-999:{errno.EIO}", path)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert lines[0].startswith("failed: OSError 5 [Errno 5] "), r.stdout
    assert "accumulators" in lines[0] and ": read failed: Input/output error" in lines[0]
    assert lines[0].endswith("; table 'b' is partly loaded now (its values and slots are part the checkpoint's, "
                             "part what it held before): load it again; this load had loaded 'a' before it: load "
                             "them all again"), lines[0]
    assert lines[1:] == ["a values True slots True step 1", "b values True slots False step 0"], r.stdout


_SAVE_FDS = """
import os, sys
import numpy as np
import embedcore as ec
def fds():
    out = {}
    for f in os.listdir("/proc/self/fd"):
        try:
            out[f] = os.readlink(f"/proc/self/fd/{f}")
        except OSError:
            pass
    return out
t = ec.Table(name="t", rows=100, dim=4, optimizer=ec.optimizers.Adagrad(0.1),
             initializer=ec.initializers.Uniform(-1, 1, seed=int(sys.argv[2])))
before = fds()
try:
    ec.save(sys.argv[1], t)
except Exception as e:
    print("failed:", type(e).__name__, getattr(e, "errno", None), e)
else:
    print("saved")
print("kept descriptors:", sorted(v for k, v in fds().items() if k not in before))
print("files:", sorted(os.listdir(sys.argv[1])))
"""


def test_a_claim_whose_check_fails_is_removed_and_closed(tmp_path):
    """The claimed generation is checked against the directory again after
    its claim is created and locked; when that listing fails (EIO), the save
    fails with the claim removed and its descriptor closed (it was left on
    disk, its lock held for the life of the process), and the live
    checkpoint still loads."""
    path = tmp_path / "ckpt"
    ec.save(path, make_table(1))
    # A save lists the directory first to choose its generation, then again once it holds the claim.
    r = faults.run(tmp_path, _SAVE_FDS, f"opendir:ckpt$:2:{errno.EIO}", path, 2)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"failed: OSError {errno.EIO}" in r.stdout and "kept descriptors: []" in r.stdout, r.stdout
    assert "MANIFEST.tmp" not in r.stdout, r.stdout
    got = make_table(9)
    ec.load(path, got)
    assert np.array_equal(got.values(), make_table(1).values())


def test_a_rename_to_manifest_interrupted_after_it_took_effect_is_a_commit(tmp_path):
    """A rename to MANIFEST that took effect before a signal interrupted it
    (its retry fails with ENOENT) has committed: the save succeeds, as the
    checkpoint is live (it failed with FileNotFoundError, and the removal of
    the older generation was skipped)."""
    path = tmp_path / "ckpt"
    ec.save(path, make_table(1))
    r = faults.run(tmp_path, _SAVE_FDS, f"rename_after:MANIFEST$:1:{errno.EINTR}", path, 2)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.startswith("saved"), r.stdout
    assert "g000000000001" not in r.stdout and "g000000000002" in r.stdout, r.stdout  # the older one removed
    def small(seed):
        return ec.Table(name="t", rows=100, dim=4, optimizer=ec.optimizers.Adagrad(0.1),
                        initializer=ec.initializers.Uniform(-1, 1, seed=seed))
    got = small(9)
    ec.load(path, got)
    assert np.array_equal(got.values(), small(2).values())


@pytest.mark.parametrize("sync", [1, 2])
def test_a_failed_directory_sync_says_whether_the_new_checkpoint_is_in_place(tmp_path, sync):
    """The directory is synced before the rename of MANIFEST (a failure
    there leaves the old checkpoint) and after it (the new one is then in
    place, not yet durable: the error says so, as the save's docstring)."""
    path = tmp_path / "ckpt"
    ec.save(path, make_table(1))
    r = faults.run(tmp_path, _SAVE, f"fsync:ckpt$:{sync}:{errno.EIO}", path, 2)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.startswith("failed: OSError 5 ") and "fsync failed: Input/output error" in r.stdout, r.stdout
    in_place = "; the new checkpoint is in place (MANIFEST was replaced)" in r.stdout
    assert in_place == (sync == 2), r.stdout
    t = ec.Table(name="t", rows=ROWS, dim=DIM, optimizer=ec.optimizers.Adagrad(0.1))
    ec.load(path, into=t)
    want = make_table(1) if sync == 1 else ec.Table(name="t", rows=ROWS, dim=DIM, optimizer=ec.optimizers.Adagrad(0.1),
                                                    initializer=ec.initializers.Uniform(-1, 1, seed=2))
    assert t.values().tobytes() == want.values().tobytes()


_DUMP_B = """
import sys
import embedcore as ec
b = ec.Table(name="b", rows={rows}, dim={dim}, optimizer=ec.optimizers.Adagrad(0.1), initializer=ec.initializers.Zeros())
try:
    ec.Saver().dump_to_file(b, sys.argv[1])
except Exception as e:
    print("failed:", type(e).__name__, getattr(e, "errno", None), e)
else:
    print("saved")
""".format(rows=ROWS, dim=DIM)


def test_an_io_error_copying_a_kept_table_says_nothing_was_written(tmp_path):
    """dump_to_file copies the other tables of the directory; a read error
    of that copy changed no table of the caller's and no checkpoint: the
    error says so (it said that table 'a' was partly loaded: load it again)."""
    path = tmp_path / "ckpt"
    ec.save(path, [make_table(1, "a"), make_table(2, "b")])
    before = {f.name: f.read_bytes() for f in path.iterdir()}
    # Table a's values file: its verification reads 3 times (header, padding, payload), the copy after that.
    r = faults.run(tmp_path, _DUMP_B, f"pread:t00000.values.g:4-999:{errno.EIO}", path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.startswith("failed: OSError 5 [Errno 5] ") and "t00000.values" in r.stdout, r.stdout
    assert r.stdout.rstrip().endswith(": read failed: Input/output error; nothing was written (the checkpoints are "
                                      "as they were): try again"), r.stdout
    assert {f.name: f.read_bytes() for f in path.iterdir()} == before


@pytest.mark.parametrize("kind", [ec.CheckpointError, MemoryError])
def test_a_copy_error_of_another_kind_says_nothing_was_written(tmp_path, monkeypatch, kind):
    """The engine adds its "partly loaded" note to every error of a block's
    copy (a short read: CheckpointError; a buffer: MemoryError); a copy into
    another checkpoint says nothing was written instead, keeping the type."""
    import embedcore.checkpoint as checkpoint

    path = tmp_path / "ckpt"
    ec.save(path, [make_table(1, "a"), make_table(2, "b")])
    before = {f.name: f.read_bytes() for f in path.iterdir()}

    def fail(*args, **kwargs):
        raise kind(f"{path}/t00000.values.g000000000001.ecd: truncated; table 'a' is partly loaded now (its values "
                   "and slots are part the checkpoint's, part what it held before): load it again")

    monkeypatch.setattr(checkpoint._embedcore, "load_table_block", fail)
    with pytest.raises(kind, match=r"t00000\.values\.g000000000001\.ecd: truncated; nothing was written \(the "
                                   r"checkpoints are as they were\): try again$") as info:
        ec.Saver().dump_to_file(make_table(3, "b"), path)
    assert "partly loaded" not in str(info.value)
    assert {f.name: f.read_bytes() for f in path.iterdir()} == before
