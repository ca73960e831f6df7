"""Lookups and updates from several Python threads (the engine releases the GIL)."""
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import embedcore as ec
from helpers import make_table, random_bags


def _run_threads(targets):
    errors = []

    def wrap(fn):
        def run():
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)
        return run

    threads = [threading.Thread(target=wrap(fn)) for fn in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
        assert not t.is_alive(), "a thread hung"
    if errors:
        raise errors[0]


def test_concurrent_lookups_equal_serial():
    rng = np.random.default_rng(0)
    table = make_table(5000, 32, dtype="float32", seed=1)
    batches = []
    for i in range(16):
        ids, offsets, w = random_bags(rng, 5000, 2000, max_len=10, weighted=i % 2 == 0)
        combiner = ("sum", "mean", "sqrtn", None)[i % 4]
        batches.append((ids, offsets, w, combiner))

    def run(b):
        ids, offsets, w, c = b
        if c is None:
            return table.lookup(ids, offsets, w, combiner=None, max_sequence_length=4)
        return table.lookup(ids, offsets, w, combiner=c)

    serial = [run(b) for b in batches]
    results = [[None] * len(batches) for _ in range(4)]

    def worker(k):
        def fn():
            for rep in range(3):
                order = list(range(len(batches)))[k::1] + list(range(len(batches)))[:k]
                for i in order:
                    out = run(batches[i])
                    if results[k][i] is None:
                        results[k][i] = out
                    else:
                        assert out.tobytes() == results[k][i].tobytes()
        return fn

    _run_threads([worker(k) for k in range(4)])
    for k in range(4):
        for i in range(len(batches)):
            assert results[k][i].tobytes() == serial[i].tobytes(), (k, i)


def test_updates_while_looking_up_never_tear_rows():
    """SGD with lr 1 and a gradient of ones on every row: after k updates
    every element is exactly -k. A lookup must see each row whole, in a state
    -k with k never decreasing. The writer lets the readers look up between
    its updates, so lookups see many states (and run during updates too)."""
    rows, dim, readers = 512, 256, 4
    table = ec.Table(name="t", rows=rows, dim=dim, initializer=ec.initializers.Constant(0.0),
                     optimizer=ec.optimizers.SGD(learning_rate=1.0), combiner="sum")
    all_ids = np.arange(rows, dtype=np.int64)
    ones = np.ones((rows, dim), np.float32)
    done = threading.Event()
    counts = [0] * readers
    seen = []
    updates = [0]

    def writer():
        try:
            for _ in range(150):
                table.apply_gradients(all_ids, grads=ones)
                updates[0] += 1
                # Let the readers look up between updates (they also run during them).
                target = sum(counts) + 2
                deadline = time.monotonic() + 5
                while sum(counts) < target and time.monotonic() < deadline:
                    time.sleep(0)
        finally:
            done.set()

    def reader(k):
        def fn():
            rng = np.random.default_rng(k)
            last = np.zeros(rows)
            states = set()
            try:
                while not done.is_set():
                    ids = rng.permutation(rows)[:200] if k % 2 else all_ids
                    out = table.lookup(ids, combiner=None) if k < 2 else table.lookup(ids, combiner="sum")
                    first = out[:, :1]
                    assert np.all(out == first), f"torn row in lookup {counts[k]} of reader {k}"
                    v = first[:, 0]
                    assert np.all(v == np.round(v)) and np.all(v <= 0), "a row in no valid state"
                    assert np.all(v <= last[ids]), "a row went back to an older state"
                    last[ids] = v
                    states.update(np.unique(v).tolist())
                    counts[k] += 1
            finally:
                seen.append(states)
        return fn

    _run_threads([writer] + [reader(k) for k in range(readers)])
    n = updates[0]
    assert table.step == n
    np.testing.assert_array_equal(table.to_numpy(), np.full((rows, dim), -float(n), np.float32))
    assert len(seen) == readers
    # The readers ran while the writer did: they saw many intermediate states.
    assert len(set().union(*seen)) > 20, sorted(set().union(*seen))


def test_concurrent_updates_on_different_tables_and_threads_count(restore_threads):
    """Updates of separate tables from separate threads give the serial results."""
    rng = np.random.default_rng(5)
    work = []
    for i in range(4):
        ids, offsets, w = random_bags(rng, 2000, 3000, max_len=8, weighted=True)
        grads = rng.normal(size=(3000, 16)).astype(np.float32)
        work.append((ids, offsets, w, grads))

    def make():
        return [make_table(2000, 16, optimizer=ec.optimizers.Adam(0.01), seed=i) for i in range(4)]

    serial = make()
    for t, (ids, offsets, w, g) in zip(serial, work):
        for _ in range(3):
            t.apply_gradients(ids, offsets, g, weights=w)
    for n in (1, 2):
        ec.set_num_threads(n)
        par = make()

        def fn(i):
            def run():
                ids, offsets, w, g = work[i]
                for _ in range(3):
                    par[i].apply_gradients(ids, offsets, g, weights=w)
            return run

        _run_threads([fn(i) for i in range(4)])
        for a, b in zip(serial, par):
            assert a.values().tobytes() == b.values().tobytes()
            for k in a.slots():
                assert a.slots()[k].tobytes() == b.slots()[k].tobytes()


def test_changing_thread_count_during_lookups_and_updates(restore_threads):
    rng = np.random.default_rng(3)
    table = make_table(5000, 32, seed=4)
    ids, offsets, w = random_bags(rng, 5000, 5000, max_len=10, weighted=True)
    expected = table.lookup(ids, offsets, w).tobytes()
    upd = [make_table(3000, 8, optimizer=ec.optimizers.Adam(0.01), seed=5) for _ in range(2)]
    uids, uoffsets, uw = random_bags(rng, 3000, 4000, max_len=8, weighted=True)
    grads = rng.normal(size=(4000, 8)).astype(np.float32)
    stop = threading.Event()

    def toggler():
        n = 0
        while not stop.is_set():
            ec.set_num_threads(1 + n % 4)
            n += 1

    def reader():
        for _ in range(60):
            assert table.lookup(ids, offsets, w).tobytes() == expected

    def updater():
        for _ in range(5):
            upd[1].apply_gradients(uids, uoffsets, grads, weights=uw)

    t = threading.Thread(target=toggler)
    t.start()
    try:
        _run_threads([reader, reader, updater])
    finally:
        stop.set()
        t.join()
    ec.set_num_threads(2)
    for _ in range(5):
        upd[0].apply_gradients(uids, uoffsets, grads, weights=uw)
    assert upd[0].values().tobytes() == upd[1].values().tobytes()
    assert upd[0].slots()["momenta"].tobytes() == upd[1].slots()["momenta"].tobytes()


def test_set_optimizer_waits_for_a_step_between_its_rate_and_its_update():
    """A scheduled step (and the PyTorch adapter's fused step) reads its
    learning rate and steps under the table's step lock, and set_optimizer
    swaps the optimizer under it: such a step never takes the old
    optimizer's rate to the new rule (a thread's SGD rate once stepped
    Adagrad(0.5), found by stress). Here the lock is held as a step between
    reading its rate and stepping would hold it: set_optimizer, and another
    scheduled step, wait for it."""
    t = make_table(8, 2, optimizer=ec.optimizers.SGD(lambda step: 0.1), name="t")
    ids, offsets, grads = np.array([1]), np.array([0, 1]), np.ones((1, 2), np.float32)
    done = {}

    def run(name, call):
        call()
        done[name] = time.monotonic()

    with t._schedule_lock():
        held = time.monotonic()
        threads = [threading.Thread(target=run, args=("set", lambda: t.set_optimizer(
                       ec.optimizers.Adagrad(0.5, initial_accumulator_value=0.1)))),
                   threading.Thread(target=run, args=("step", lambda: t.apply_gradients(ids, offsets, grads)))]
        for th in threads:
            th.start()
        time.sleep(0.3)
        assert done == {}, "a call went ahead while a step held the table's step lock"
        released = time.monotonic()
    for th in threads:
        th.join(30)
    assert set(done) == {"set", "step"} and min(done.values()) >= released > held
    # Whichever came first, the step used the rate of the rule that stepped it.
    row = t.to_numpy()[1]
    before = make_table(8, 2, name="t").to_numpy()[1]
    sgd_then_nothing = before - np.float32(0.1)
    adagrad = before - np.float32(0.5) / np.sqrt(np.float32(1.1))
    assert np.allclose(row, sgd_then_nothing) or np.allclose(row, adagrad), (row, before)


class _SwapsOnFirstRead(ec.optimizers.SGD):
    """SGD(0.1) whose first rate read gives `table` Adagrad(0.5) by
    set_optimizer, as another thread could between a step's read of its
    constant rate (which takes no lock) and its native call."""

    def __init__(self, table_of):
        super().__init__(0.1)
        self.table_of, self.swapped = table_of, False

    def learning_rate_at(self, step):
        if not self.swapped:
            self.swapped = True
            self.table_of().set_optimizer(ec.optimizers.Adagrad(0.5, initial_accumulator_value=0.1))
        return super().learning_rate_at(step)


def test_a_step_whose_constant_rate_set_optimizer_replaced_reads_it_again():
    """A step with a constant rate reads it without the step lock. When
    set_optimizer replaces the optimizer after that read, the engine refuses
    the stale rate (the optimizer version it was read under), nothing
    changes, and the step reads the rate again: Adagrad's rule takes
    Adagrad's rate, never SGD's (it took SGD's 0.1 before)."""
    t = make_table(8, 2, name="t")
    before = t.to_numpy()
    t.set_optimizer(_SwapsOnFirstRead(lambda: t))
    t.apply_gradients(np.array([1]), np.array([0, 1]), np.ones((1, 2), np.float32))
    assert isinstance(t.optimizer, ec.optimizers.Adagrad) and t.step == 1
    expected = before.copy()
    expected[1] -= np.float32(0.5) / np.sqrt(np.float32(1.1))  # Adagrad(0.5) from 0.1: a = 1.1
    np.testing.assert_allclose(t.to_numpy(), expected, rtol=1e-6)
    np.testing.assert_allclose(t.slots()["accumulators"][1], [1.1, 1.1], rtol=1e-6)


def test_a_several_table_step_whose_rate_set_optimizer_replaced_changes_no_table_then_steps_all():
    """The same in one step of several tables (an Embedding's): the engine
    checks every table's optimizer version before any table steps, so the
    step changes no table (not 'a', checked before 'b', whose optimizer
    changed), then runs again with every rate read anew: each table steps
    once, 'b' by Adagrad(0.5). (A check of each table only as it steps
    would step 'a' twice.)"""
    cfg_a = ec.TableConfig(name="a", rows=8, dim=2, initializer=ec.initializers.Constant(1.0),
                           optimizer=ec.optimizers.SGD(0.25))
    cfg_b = ec.TableConfig(name="b", rows=8, dim=2, initializer=ec.initializers.Constant(1.0))
    emb = ec.Embedding({"fa": ec.FeatureConfig(cfg_a), "fb": ec.FeatureConfig(cfg_b)})
    a, b = emb.embedding_tables[cfg_a], emb.embedding_tables[cfg_b]
    b.set_optimizer(_SwapsOnFirstRead(lambda: b))
    ids = {"fa": np.array([[1]]), "fb": np.array([[2]])}
    emb(ids)
    emb.apply_gradients({"fa": np.ones((1, 2), np.float32), "fb": np.ones((1, 2), np.float32)})
    assert (a.step, b.step) == (1, 1)
    np.testing.assert_allclose(a.to_numpy()[1], [0.75, 0.75])
    np.testing.assert_allclose(b.to_numpy()[2], 1 - np.float32(0.5) / np.sqrt(np.float32(1.1)), rtol=1e-6)
    np.testing.assert_allclose(np.delete(a.to_numpy(), 1, 0), 1.0)
    np.testing.assert_allclose(np.delete(b.to_numpy(), 2, 0), 1.0)


def test_a_copy_of_a_table_takes_the_optimizer_set_on_the_table():
    """copy.copy(table) is the same native table: set_optimizer on either
    gives both the new optimizer, and a step through the copy applies the
    new rate (it applied SGD's 0.1 under Adagrad's rule, one engine refusal
    and retry per step)."""
    import copy

    t = make_table(8, 2, optimizer=ec.optimizers.SGD(0.1), name="t")
    c = copy.copy(t)
    before = t.to_numpy()
    t.set_optimizer(ec.optimizers.Adagrad(0.5, initial_accumulator_value=0.1))
    assert isinstance(c.optimizer, ec.optimizers.Adagrad) and c.config.optimizer is t.config.optimizer
    c.apply_gradients(np.array([1]), np.array([0, 1]), np.ones((1, 2), np.float32))
    np.testing.assert_allclose(t.to_numpy()[1], before[1] - np.float32(0.5) / np.sqrt(np.float32(1.1)), rtol=1e-6)
    u = make_table(8, 2, name="u")  # copies of copies, whichever one is set
    u1 = copy.copy(u)
    u2 = copy.copy(u1)
    u2.set_optimizer(ec.optimizers.SGD(0.5))
    assert all(x.optimizer is u2.optimizer for x in (u, u1, u2))
    assert u._stepping == u1._stepping == u2._stepping == (u2.optimizer, 1)


def test_a_shard_whose_rate_set_optimizer_replaced_steps_with_the_new_rate():
    """The distributed Embedding reads each local shard's rate before its
    collectives: a shard's set_optimizer meanwhile makes its step read the
    rate again (it applied SGD's 0.1 under Adagrad's rule)."""
    import embedcore.distributed as ed

    cfg = ec.TableConfig(name="t", rows=8, dim=2, initializer=ec.initializers.Constant(1.0))

    def fn(world):
        emb = ec.Embedding({"f": ec.FeatureConfig(cfg)}, ec.optimizers.SGD(0.1), world=world)
        ((_, shard),) = emb.local_shards["t"]
        shard.set_optimizer(_SwapsOnFirstRead(lambda: shard))
        emb({"f": np.array([[1]])})
        emb.apply_gradients({"f": np.ones((1, 2), np.float32)})
        return shard.step, shard.to_numpy()[1].tolist(), type(shard.optimizer).__name__

    step, row, kind = ed.run_local(1, fn)[0]
    assert (step, kind) == (1, "Adagrad")
    np.testing.assert_allclose(row, 1 - np.float32(0.5) / np.sqrt(np.float32(1.1)), rtol=1e-6)


def test_a_save_waits_for_set_optimizer_and_records_the_optimizer_of_its_slots(tmp_path):
    """ec.save reads each table's config and writes it under the table's
    step lock, which set_optimizer holds while it swaps the optimizer: a
    save never records one optimizer's config with the other's slots. Here
    the lock is held as set_optimizer holds it: the save waits."""
    other = make_table(8, 2, name="u")
    ec.save(tmp_path / "d", make_table(8, 2, name="kept"))
    saves = {"save": lambda t: ec.save(tmp_path / "c", [other, t]),
             # (a dump that keeps the table already there writes its own entries)
             "dump_to_file": lambda t: ec.Saver().dump_to_file(t, tmp_path / "d")}
    for name, call in saves.items():
        t = make_table(8, 2, optimizer=ec.optimizers.SGD(0.1), name="t")
        done = []
        with t._schedule_lock():
            saver = threading.Thread(target=lambda: (call(t), done.append(True)))
            saver.start()
            time.sleep(0.3)
            assert not done, f"{name} went ahead of set_optimizer"
            t.set_optimizer(ec.optimizers.Adagrad(0.5, initial_accumulator_value=0.1))  # (the lock is reentrant)
        saver.join(30)
        assert done == [True], name
        loaded = make_table(8, 2, optimizer=ec.optimizers.Adagrad(0.5, initial_accumulator_value=0.1), name="t")
        ec.load(tmp_path / ("c" if name == "save" else "d"), loaded)
        np.testing.assert_array_equal(loaded.slots()["accumulators"], np.full((8, 2), 0.1, np.float32))
    assert ec.checkpoint.read_info(tmp_path / "c").table_names == ["u", "t"]
    assert ec.checkpoint.read_info(tmp_path / "d").table_names == ["kept", "t"]


def test_a_save_holds_one_tables_step_lock_at_a_time(tmp_path, monkeypatch):
    """While ec.save (or Saver.dump_to_file) writes a table, the other
    tables' step locks are free: their steps (a schedule's, the PyTorch
    adapter's fused ones) go on, and a save made from a schedule's callback,
    which holds its table's lock, does not deadlock with another save."""
    tables = [make_table(8, 2, name=n, optimizer=ec.optimizers.SGD(0.1)) for n in "abc"]
    seen = []
    write = ec.checkpoint._embedcore.write_shard_files

    def checking_write(path, generation, prefix, shard_index, native, *rest):
        writing = [t for t in tables if t._native is native][0]
        free = []  # (probed from another thread: the locks are reentrant)
        probe = threading.Thread(target=lambda: free.extend(
            t.name for t in tables if t._schedule_lock().acquire(blocking=False) and not t._schedule_lock().release()))
        probe.start()
        probe.join()
        seen.append((writing.name, sorted(free)))
        return write(path, generation, prefix, shard_index, native, *rest)

    monkeypatch.setattr(ec.checkpoint._embedcore, "write_shard_files", checking_write)
    ec.save(tmp_path / "c", tables)
    ec.Saver().dump_to_file(tables, tmp_path / "d")
    assert seen == [(n, [m for m in "abc" if m != n]) for n in "abc"] * 2
    monkeypatch.undo()

    lo, hi = sorted(tables[:2], key=id)  # a save from hi's schedule takes lo's lock while holding hi's
    ready = threading.Event()

    def schedule(step):
        if step == 0:
            ready.set()
            time.sleep(0.2)
            ec.save(tmp_path / "from_schedule", [lo, hi])
        return 0.1

    hi.set_optimizer(ec.optimizers.SGD(schedule))
    steps = threading.Thread(target=lambda: hi.apply_gradients(np.arange(4), None, np.ones((4, 2), np.float32),
                                                               combiner=None), daemon=True)
    other = threading.Thread(target=lambda: (ready.wait(), ec.save(tmp_path / "other", [lo, hi])), daemon=True)
    steps.start()
    other.start()
    steps.join(60)
    other.join(60)
    assert not steps.is_alive() and not other.is_alive(), "the two saves deadlocked"
    assert hi.step == 1 and ec.checkpoint.read_info(tmp_path / "other").table_names == [lo.name, hi.name]


def test_spin_setting_is_checked_and_lookups_agree_without_spinning(tmp_path):
    """EMBEDCORE_SPIN_US: a bad value is refused at import, naming it; 0
    (no spinning) changes no result."""
    import subprocess
    import sys

    code = ("import numpy as np, embedcore as ec\n"
            "ec.set_num_threads(2)\n"
            "t = ec.Table(name='t', rows=1000, dim=8, initializer=ec.initializers.Uniform(-1, 1, seed=3))\n"
            "ids = np.random.default_rng(0).integers(0, 1000, 40000)\n"
            "np.save(r'%s', t.lookup(ids, np.arange(0, 40001, 8)))\n")
    outs = []
    for spin in ("0", "1000000", ""):
        path = tmp_path / f"out{spin or 'default'}.npy"
        env = dict(os.environ, EMBEDCORE_SPIN_US=spin)
        r = subprocess.run([sys.executable, "-c", code % path], env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        outs.append(np.load(path))
    assert all(np.array_equal(outs[0], o) for o in outs[1:])
    for bad in ("-5", "1.5", "abc", "1000001"):
        env = dict(os.environ, EMBEDCORE_SPIN_US=bad)
        r = subprocess.run([sys.executable, "-c", "import embedcore"], env=env, capture_output=True, text=True,
                           timeout=300)
        assert r.returncode != 0
        assert "ValueError: environment variable EMBEDCORE_SPIN_US must be a whole number" in r.stderr, r.stderr
        assert repr(bad) in r.stderr


_REWRITTEN_IDS = r"""
import sys, threading, time, numpy as np, embedcore as ec
kind, optimizer = sys.argv[1], sys.argv[2]
opt = ec.optimizers.SGD(0.1) if optimizer == "sgd" else ec.optimizers.Adagrad(0.1)
t = ec.Table(name="t", rows=1000, dim=16, optimizer=opt)
n = 400_000
ids = np.zeros(n, np.int64)
offsets = np.arange(0, n + 1, 100)
grads = np.ones((n // 100, 16), np.float32)
served = None
if kind == "served":
    ec.save(sys.argv[3], t)
    served = ec.serving.open(sys.argv[3]).tables["t"]
stop = False
def rewrite():  # the caller's own race: ids and offsets rewritten while a call reads them
    while not stop:
        ids[-1000:] = 1 << 40
        offsets[-3] = 1 << 50
        ids[-1000:] = 0
        offsets[-3] = n - 200
threading.Thread(target=rewrite, daemon=True).start()
errors = calls = 0
start = time.time()
while time.time() - start < 3:
    calls += 1
    try:
        if kind == "lookup":
            t.lookup(ids, offsets)
        elif kind == "served":
            served.lookup(ids, offsets)
        else:
            t.apply_gradients(ids, offsets, grads)
    except (IndexError, ValueError):
        errors += 1
stop = True
print(calls, errors, bool(np.isfinite(t.values()).all()))
"""


@pytest.mark.parametrize("kind,optimizer", [("lookup", "sgd"), ("served", "sgd"), ("apply", "sgd"),
                                            ("apply", "adagrad")])
def test_ids_and_offsets_rewritten_during_a_call_never_reach_outside_the_arrays(tmp_path, kind, optimizer):
    """Inputs are read in place: a caller's thread that rewrites them during
    a call (its own race) gets errors or wrong rows, never a crash: ids are
    guarded where they are used, offsets copied before they are validated.
    (Before: a segfault within seconds, and writes outside the table.)"""
    script = tmp_path / "race.py"
    script.write_text(_REWRITTEN_IDS)
    done = subprocess.run([sys.executable, str(script), kind, optimizer, str(tmp_path / "c")], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    calls, errors, finite = done.stdout.split()
    assert int(calls) > 0 and finite == "True"


_FORK_DURING_UPDATES = r"""
import os, signal, threading, time, numpy as np, embedcore as ec
ec.set_num_threads(1)
t = ec.Table(name="t", rows=50_000, dim=32, optimizer=ec.optimizers.SGD(0.1), combiner="sum")
ids = np.random.default_rng(0).integers(0, 50_000, 2_000_000)
offsets = np.arange(0, 2_000_001, 4)
grads = np.ones((500_000, 32), np.float32)
stop = threading.Event()
def train():
    while not stop.is_set():
        t.apply_gradients(ids, offsets, grads)  # almost all of it under the table's exclusive lock
def look():
    while not stop.is_set():
        t.lookup(ids[:200_000], offsets[:50_001])  # under its shared lock
threads = [threading.Thread(target=train), threading.Thread(target=look)]
for th in threads:
    th.start()
time.sleep(0.3)
codes = []
for _ in range(6):
    pid = os.fork()
    if pid == 0:
        signal.alarm(20)  # a hung child ends here
        before = t.values().copy()
        t.apply_gradients(np.array([1, 2]), np.array([0, 2]), np.ones((1, 32), np.float32))
        ok = np.array_equal(t.values()[1], before[1] - 0.1)  # one whole step: rows as a whole call left them
        os._exit(0 if ok else 3)
    codes.append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
    time.sleep(0.05)
stop.set()
for th in threads:
    th.join()
print(codes)
"""


def test_a_child_forked_during_updates_and_lookups_can_use_the_table(tmp_path):
    """fork() while other threads update and look up a table: the child
    neither inherits a held lock (its update hung for ever) nor a
    half-updated table (fork waits for the running calls)."""
    script = tmp_path / "fork.py"
    script.write_text(_FORK_DURING_UPDATES)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == str([0] * 6)


_EXIT_DURING_LOOKUPS = r"""
import threading, time, numpy as np, embedcore as ec
t = ec.Table(name="t", rows=1000, dim=8)
short, short_offsets = np.arange(64) % 1000, np.arange(0, 65, 8)
long_ = np.random.default_rng(0).integers(0, 1000, 20000)
long_offsets = np.arange(0, 20001, 4)
def look(i):  # short calls: many threads at once are taking the GIL back when the exit comes
    while True:
        t.lookup(short, short_offsets) if i % 2 else t.lookup(long_, long_offsets)
for i in range(4):
    threading.Thread(target=look, args=(i,), daemon=True).start()
time.sleep(0.05)

class Teardown:  # a lookup by the exiting thread itself, in the interpreter's last collection
    def __del__(self):
        print(t.lookup(np.array([1, 2]), np.array([0, 2])).shape, flush=True)
x = Teardown()
x.cycle = x
del x
"""


def test_the_process_exits_cleanly_while_daemon_threads_are_in_lookups(tmp_path):
    """The main thread returns while daemon threads are in short lookups:
    the exit is clean. (Python ended threads that were taking the GIL back
    inside a noexcept destructor: 'terminate called without an active
    exception', most runs aborted.) A lookup by the exiting thread in the
    interpreter's last collection still runs."""
    script = tmp_path / "exit.py"
    script.write_text(_EXIT_DURING_LOOKUPS)
    runs = [subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
            for _ in range(10)]
    assert [r.returncode for r in runs] == [0] * 10, runs[0].stderr[-1000:]
    assert all(r.stdout.strip() == "(1, 8)" for r in runs), runs[0].stdout


_FORK_DURING_NATIVE_LOOKUPS = r"""
import ctypes, os, threading, time
import numpy as np
import embedcore as ec
from embedcore import _embedcore
t = ec.Table(name="t", rows=1000, dim=64)
handle = _embedcore.register_native_table(t._native, t)
proto = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64,
                         ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_int64,
                         ctypes.c_char_p, ctypes.c_int64)
lookup = proto(_embedcore.native_entry_points()["ragged_lookup"])  # the TF kernels' entry point, without the GIL
ids = np.random.default_rng(0).integers(0, 1000, 4000)
splits = np.arange(0, 4001, 40)
stop = False
def loop():
    out = np.zeros((100, 64), np.float32)
    error = ctypes.create_string_buffer(256)
    while not stop:
        assert lookup(handle, ids.ctypes.data, 0, 4000, splits.ctypes.data, 100, 0, out.ctypes.data, 64, error,
                      256) == 0, error.value
threads = [threading.Thread(target=loop, daemon=True) for _ in range(3)]
for th in threads:
    th.start()
time.sleep(0.1)
for _ in range(150):
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
stop = True
print("ok")
"""


def test_forks_during_native_op_lookups_do_not_deadlock(tmp_path):
    """The TF kernels' entry point holds the native registry's lock, then the
    table's: fork takes them in that order too (it deadlocked within 100
    forks when it took the tables' first)."""
    script = tmp_path / "fork_native.py"
    script.write_text(_FORK_DURING_NATIVE_LOOKUPS)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


# Three daemon threads looking up without end, for the exit scripts below.
_DAEMON_LOOKUPS = r"""
import threading, time, numpy as np, embedcore as ec
t = ec.Table(name="t", rows=1000, dim=8)
ids, offsets = np.arange(64) % 1000, np.arange(0, 65, 8)
def look():
    while True:
        t.lookup(ids, offsets)
for _ in range(3):
    threading.Thread(target=look, daemon=True).start()
time.sleep(0.05)
"""

_AT_EXIT = {
    "a hook registered before the import joins daemon threads in lookups": r"""
import atexit, threading
stop = threading.Event()
workers = []
def shutdown():  # runs after embedcore's own atexit hook (last registered, first run)
    stop.set()
    for w in workers:
        w.join()
    print("joined", flush=True)
atexit.register(shutdown)
import time, numpy as np, embedcore as ec
t = ec.Table(name="t", rows=1000, dim=8)
ids, offsets = np.arange(64) % 1000, np.arange(0, 65, 8)
def look():
    while not stop.is_set():
        t.lookup(ids, offsets)
for _ in range(2):
    w = threading.Thread(target=look, daemon=True)
    w.start()
    workers.append(w)
time.sleep(0.05)
""",
    "a hook registered before the import holds the GIL while daemon threads are in lookups": r"""
import atexit, ctypes
# usleep through ctypes.PyDLL, which keeps the GIL: held for 0.7 s of wall time, however loaded the machine
# (a loop of sum() sized by timing it at start-up held it past 2 s when load came later).
atexit.register(ctypes.PyDLL(None).usleep, 700_000)  # runs after embedcore's own atexit hook
atexit.register(print, "joined", flush=True)  # (runs first: the exit's last Python output)
""" + _DAEMON_LOOKUPS,
    "a hook registered before the import holds the GIL past the threads' 2 s wait": r"""
import atexit, ctypes
atexit.register(ctypes.PyDLL(None).usleep, 3_000_000)  # the threads block on the GIL as finalization starts
atexit.register(print, "joined", flush=True)
""" + _DAEMON_LOOKUPS,
    "children forked during lookups exit through the interpreter": _DAEMON_LOOKUPS + r"""
import os, sys
codes = []
for _ in range(10):
    pid = os.fork()
    if pid == 0:
        sys.exit(0)  # atexit hooks run in the child, which has none of the parent's threads
    codes.append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
print("joined" if codes == [0] * 10 else codes, flush=True)
""",
}


@pytest.mark.parametrize("case", list(_AT_EXIT))
def test_exits_with_threads_in_lookups_end(tmp_path, case):
    """What ReleaseGil's exit handling must not break: an atexit hook that
    joins threads in lookups (they wait 2 s for finalization, then take the
    GIL back); one that holds the GIL for 0.7 s while threads come back from
    lookups (a thread blocked on the GIL when finalization starts is ended
    there: the process aborted, "terminate called without an active
    exception", when they waited only 100 ms); one that holds it for 3 s,
    past that wait (the threads are blocked on the GIL when finalization
    starts: Python's ending them aborted the process until they were parked
    instead); and forked children that exit normally (the parent's threads
    counted as taking the GIL back are forgotten in the child; they hung for
    ever)."""
    script = tmp_path / "exit.py"
    script.write_text(_AT_EXIT[case])
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "joined", (done.stdout, done.stderr[-1000:])


def test_racing_set_optimizer_calls_one_wins():
    """Two threads give one SGD table slots at once: exactly one succeeds, the
    other is refused (the table keeps slots); no slot view ever dangles."""
    for trial in range(20):
        t = make_table(20_000, 16, optimizer=ec.optimizers.SGD(0.1), seed=trial)
        outcomes, barrier = [], threading.Barrier(2)

        def give(opt):
            def run():
                barrier.wait()
                try:
                    t.set_optimizer(opt)
                    outcomes.append(type(opt).__name__)
                except ValueError as e:
                    assert "keeps slots" in str(e), e
                    outcomes.append("refused")
            return run

        _run_threads([give(ec.optimizers.Adagrad(0.1)), give(ec.optimizers.Adam(0.01))])
        assert sorted(outcomes)[1] == "refused" and sorted(outcomes)[0] in ("Adagrad", "Adam"), outcomes
        winner = outcomes[0] if outcomes[0] != "refused" else outcomes[1]
        assert type(t.optimizer).__name__ == winner
        assert sorted(t.slots()) == sorted(t.optimizer.slot_names)
        for v in t.slots().values():
            assert np.isfinite(v).all()


def test_apply_gradients_racing_set_optimizer_ends_in_a_serial_state():
    """set_optimizer(Adagrad) and apply_gradients queued behind a long lookup:
    the end state is one of the two serial orders' (step 1 with the
    accumulators updated, or step 0 with fresh accumulators), never an SGD
    step counted against Adagrad's fresh slots."""
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 2000, 400_000)
    offsets = np.arange(0, 400_001, 4)
    for trial in range(12):
        t = make_table(2000, 64, optimizer=ec.optimizers.SGD(0.1), seed=trial)
        before = np.array(t.values())
        grad = np.ones((1, 64), np.float32)
        started = threading.Event()

        def long_lookup():
            started.set()
            t.lookup(ids, offsets)

        def swap():
            started.wait()
            time.sleep(0.001)
            t.set_optimizer(ec.optimizers.Adagrad(0.1, initial_accumulator_value=0.1))

        def step():
            started.wait()
            time.sleep(0.002)
            t.apply_gradients(np.array([7]), None, grad)

        _run_threads([long_lookup, swap, step])
        acc = t.slots()["accumulators"][7]
        moved = not np.array_equal(t.values()[7], before[7])
        if t.step == 1:  # set_optimizer first, then the step: Adagrad's
            assert np.allclose(acc, 1.1) and moved, (trial, acc[:3])
        else:  # the step first (SGD's), then set_optimizer reset the step and made fresh slots
            assert t.step == 0 and np.allclose(acc, 0.1) and moved, (trial, t.step, acc[:3])


def test_a_schedules_rate_and_its_step_are_one():
    """Two threads stepping a table whose learning rate is a schedule: each
    step's rate is the one for the steps before it (0, then 1), as serially."""
    seen, lock = [], threading.Lock()

    def schedule(step):
        with lock:
            seen.append(step)
        time.sleep(0.01)  # the other thread's step would read the same count meanwhile
        return 1.0

    for _ in range(5):
        seen.clear()
        t = make_table(10, 2, optimizer=ec.optimizers.SGD(schedule))
        t.assign(np.zeros((10, 2), np.float32))
        step = lambda: t.apply_gradients(np.array([1]), None, np.ones((1, 2), np.float32))  # noqa: E731
        _run_threads([step, step])
        assert sorted(seen) == [0, 1] and t.step == 2
        np.testing.assert_array_equal(t.values()[1], [-2.0, -2.0])


def test_a_multi_table_steps_rates_and_steps_are_one():
    """The same for the all-or-nothing step of several tables (the Keras
    layer's and ec.Embedding's), with two threads stepping two scheduled
    tables in opposite orders: each table's rates are those of its steps 0
    and 1, and neither thread waits for the other for ever."""
    from embedcore._inputs import make_batch
    from embedcore.table import apply_gradients_many

    seen, lock = {"t": [], "u": []}, threading.Lock()

    def schedule(name):
        def rate(step):
            with lock:
                seen[name].append(step)
            time.sleep(0.01)
            return 1.0 if step == 0 else 0.5
        return rate

    for _ in range(3):
        tables = {n: make_table(10, 2, optimizer=ec.optimizers.SGD(schedule(n)), name=n) for n in "tu"}
        for t in tables.values():
            t.assign(np.zeros((10, 2), np.float32))
        seen["t"].clear()
        seen["u"].clear()

        def part(t):
            return t._gradient_part(make_batch(np.array([1]), None, None), "sum", 0, np.ones((1, 2), np.float32))

        def steps(order):
            return lambda: apply_gradients_many([(tables[n], [part(tables[n])], ["g"]) for n in order])

        _run_threads([steps("tu"), steps("ut")])
        for n, t in tables.items():
            assert sorted(seen[n]) == [0, 1] and t.step == 2, (n, seen)
            np.testing.assert_array_equal(t.values()[1], [-1.5, -1.5])


_INTERRUPTED = r"""
import _thread, signal, sys, threading, numpy as np, embedcore as ec
# A run started in the background inherits SIGINT ignored, and interrupt_main then does nothing.
signal.signal(signal.SIGINT, signal.default_int_handler)
kind, delay = sys.argv[1], float(sys.argv[2])
interrupted = 0
init = ec.initializers.Uniform(-1, 1, seed=3)
if kind == "embedding":
    tables = {n: ec.TableConfig(n, 400_000, 64, initializer=init, optimizer=ec.optimizers.Adam(0.01)) for n in "ab"}
    emb = ec.Embedding({n: ec.FeatureConfig(c) for n, c in tables.items()})
    ids = np.random.default_rng(0).integers(0, 400_000, 200_000)
    out = emb({"a": ids, "b": ids})
    grads = {k: np.ones_like(v) for k, v in out.items()}
    try:  # (started inside: on a busy machine the interrupt may come at once)
        threading.Timer(delay, _thread.interrupt_main).start()
        for _ in range(10_000):  # until interrupted
            emb.apply_gradients(grads)
    except KeyboardInterrupt:
        interrupted = 1
    steps = {t.name: t.step for t in emb.embedding_tables.values()}
    print(int(steps["a"] == steps["b"]), interrupted, steps)
else:
    t = ec.Table(name="t", rows=1_500_000, dim=32, initializer=init)
    first = np.array(t.values()[[0, -1]])
    t.assign(np.zeros((1_500_000, 32), np.float32))
    try:
        threading.Timer(delay, _thread.interrupt_main).start()
        for _ in range(10_000):  # until interrupted
            t.reset_values()
            t.assign(np.zeros((1_500_000, 32), np.float32))
    except KeyboardInterrupt:
        interrupted = 1
    v = t.values()
    whole = (np.array_equal(v[[0, -1]], first) or not (v[[0, -1]].any()))
    print(int(whole), interrupted)
"""


@pytest.mark.parametrize("kind", ["embedding", "reset_values"])
def test_an_interrupt_never_falls_inside_a_multi_table_step_or_a_reset(tmp_path, kind):
    """Ctrl-C (KeyboardInterrupt) while an Embedding steps its tables or a
    table resets its values: each is one native call, so the interrupt comes
    before or after it, never between two tables or two blocks."""
    script = tmp_path / "interrupted.py"
    script.write_text(_INTERRUPTED)
    for delay in (0.05, 0.13, 0.31):
        r = subprocess.run([sys.executable, str(script), kind, str(delay)], capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        assert r.stdout.split()[:2] == ["1", "1"], r.stdout  # whole, and interrupted


_FORK_DURING_SAVES = r"""
import os, sys, threading, numpy as np, embedcore as ec
path = sys.argv[1]
t = ec.Table(name="t", rows=20_000, dim=16, initializer=ec.initializers.Uniform(-1, 1, seed=1))
ec.save(path, t)
stop = threading.Event()
def saves():
    while not stop.is_set():
        ec.save(path, t)
threading.Thread(target=saves, daemon=True).start()
hung = 0
for i in range(8):
    pid = os.fork()
    if pid == 0:  # the child opens and saves the checkpoint its parent keeps saving
        try:
            ec.serving.open(path).tables["t"].lookup(np.array([1]))
            ec.save(path, t)
        finally:
            os._exit(0)
    for _ in range(400):  # 20 s
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        threading.Event().wait(0.05)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        hung += 1
stop.set()
print(hung)
"""


def test_a_child_forked_during_a_save_does_not_wait_on_the_lock_it_inherited(tmp_path):
    """A child forked while its parent's save held the directory's lock
    shares that lock; the parent unlocks it explicitly when its commit ends,
    so the child's own open and save of the directory go through (they used
    to wait for ever on the inherited lock)."""
    script = tmp_path / "fork_saves.py"
    script.write_text(_FORK_DURING_SAVES)
    r = subprocess.run([sys.executable, str(script), str(tmp_path / "ckpt")], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "0", r.stdout


_FORK_DURING_SCHEDULED_STEPS = r"""
import os, signal, threading, numpy as np, embedcore as ec
big = ec.Table(name="big", rows=200_000, dim=64, optimizer=ec.optimizers.Adagrad(lambda step: 0.1))
ids = np.random.default_rng(0).integers(0, 200_000, 200_000)
grads = np.ones((200_000, 64), np.float32)
stop = threading.Event()
def steps():
    while not stop.is_set():
        big.apply_gradients(ids, None, grads)
threading.Thread(target=steps, daemon=True).start()
hung = 0
for i in range(6):
    threading.Event().wait(0.02)
    pid = os.fork()
    if pid == 0:  # a scheduled step of its own table, and of the one the parent's thread was stepping
        signal.alarm(20)
        small = ec.Table(name="small", rows=10, dim=2, optimizer=ec.optimizers.SGD(lambda step: 0.5))
        small.apply_gradients(np.array([1]), None, np.ones((1, 2), np.float32))
        big.apply_gradients(np.array([1]), None, np.ones((1, 64), np.float32))
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    hung += status != 0
stop.set()
print(hung)
"""


_FORK_WITH_A_COPY = r"""
import copy, os, signal, threading, numpy as np, embedcore as ec
t = ec.Table(name="t", rows=10, dim=2, optimizer=ec.optimizers.SGD(lambda step: 0.5))
twin = copy.copy(t)  # before t has made its lock
assert twin._schedule_lock() is t._schedule_lock(), "a copy has a lock of its own"
held, release = threading.Event(), threading.Event()
def hold():
    with twin._schedule_lock():
        held.set()
        release.wait()
threading.Thread(target=hold, daemon=True).start()
held.wait()
pid = os.fork()
if pid == 0:  # the lock the parent's thread holds is renewed for both, and still one lock
    signal.alarm(20)
    ok = twin._schedule_lock() is t._schedule_lock() and twin._schedule_lock().acquire(blocking=False)
    twin.apply_gradients(np.array([1]), None, np.ones((1, 2), np.float32))
    os._exit(0 if ok and t.step == 1 else 3)
_, status = os.waitpid(pid, 0)
release.set()
print(os.waitstatus_to_exitcode(status))
"""


def test_a_copy_of_a_table_shares_its_step_lock_also_in_a_forked_child(tmp_path):
    """copy.copy(table) is the same native table: it shares the step lock
    (made by the copy if the table had none yet), and a forked child renews
    that one lock for both, though a parent's thread held it."""
    script = tmp_path / "fork_copy.py"
    script.write_text(_FORK_WITH_A_COPY)
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "0", r.stdout


def test_a_child_forked_during_scheduled_steps_can_step(tmp_path):
    """The lock that makes a schedule's rate and its step one is renewed in a
    forked child: one the parent's thread held at the fork would be held
    there for ever."""
    script = tmp_path / "fork_schedule.py"
    script.write_text(_FORK_DURING_SCHEDULED_STEPS)
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "0", r.stdout


_SET_OPTIMIZER_INTERRUPTED = r"""
import os, signal, threading, time, numpy as np, embedcore as ec
agree = 0
for attempt in range(3):
    t = ec.Table(name="t", rows=200_000, dim=64, optimizer=ec.optimizers.SGD(0.5))
    twin = __import__("copy").copy(t)
    ids = np.random.default_rng(0).integers(0, 200_000, 2_000_000)
    offsets = np.arange(0, 2_000_001, 4)
    stop = threading.Event()
    def looker():  # lookups hold the table's lock: set_optimizer waits behind them
        while not stop.is_set():
            t.lookup(ids, offsets)
    th = threading.Thread(target=looker, daemon=True)
    th.start()
    time.sleep(0.2)
    try:  # (the timer started inside: on a busy machine its interrupt may land in Timer.start)
        threading.Timer(0.005, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT)).start()
        t.set_optimizer(ec.optimizers.Adagrad(0.01))
        time.sleep(0.5)  # (the interrupt, had it come late)
    except KeyboardInterrupt:
        pass
    finally:
        stop.set()
    th.join()
    engine = "adagrad" if t.slot_names else "sgd"
    for table in (t, twin):  # Python's optimizer, its rate and the engine's agree: a step is one optimizer's
        python = type(table.optimizer).__name__.lower()
        assert python == engine, (attempt, python, engine)
        assert table.learning_rate() == (0.01 if engine == "adagrad" else 0.5)
    agree += engine == "adagrad"
print("ok", agree)
"""


def test_set_optimizer_interrupted_leaves_python_and_the_engine_on_one_optimizer(tmp_path):
    """A KeyboardInterrupt (Ctrl-C while set_optimizer waited) that lands
    as the engine's call returns left the engine on the new optimizer and
    the table (rate, config, copies) on the old: its next step applied
    SGD's rate under Adagrad's rule, and a save recorded SGD beside Adagrad's
    slots. Run in a process of its own: a real SIGINT to its main thread."""
    script = tmp_path / "interrupted.py"
    script.write_text(_SET_OPTIMIZER_INTERRUPTED)
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith("ok"), r.stdout
