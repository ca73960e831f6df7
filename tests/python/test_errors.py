"""Errors: the right exception type and message, and nothing changed by a
failing call (validate, then mutate)."""
import re

import numpy as np
import pytest

import embedcore as ec
from helpers import assert_unchanged, make_table, snapshot

_FLT_MIN = float(np.finfo(np.float32).tiny)

opt = ec.optimizers


@pytest.fixture
def trained():
    """A table whose values, slots and step are all non-trivial."""
    table = make_table(20, 4, optimizer=opt.Adam(learning_rate=0.1), name="clicks")
    table.apply_gradients(np.arange(20), grads=np.linspace(-1, 1, 80, dtype=np.float32).reshape(20, 4))
    assert table.step == 1
    return table


def _all_failing_calls_leave_it_unchanged(table, call, exc):
    s = snapshot(table)
    with pytest.raises(exc):
        call()
    assert_unchanged(table, s)


# ----------------------------------------------------------------- ids


@pytest.mark.parametrize("id_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("bad", [20, 21, 2**31 - 1, -1, -7])
def test_out_of_range_id(trained, id_dtype, bad):
    ids = np.array([1, 2, 3, bad, 4], id_dtype)
    offsets = np.array([0, 2, 5])
    for call in (lambda: trained.lookup(ids, offsets),
                 lambda: trained.lookup(ids, offsets, out=np.zeros((2, 4), np.float32)),
                 lambda: trained.lookup(ids, offsets, combiner=None),
                 lambda: trained.lookup(ec.Ragged(ids, offsets), combiner=None, max_sequence_length=2),
                 lambda: trained.apply_gradients(ids, offsets, np.ones((2, 4), np.float32))):
        s = snapshot(trained)
        with pytest.raises(IndexError) as e:
            call()
        msg = str(e.value)
        assert "clicks" in msg, msg
        assert re.search(rf"(?<![\d-]){bad}(?!\d)", msg), msg
        assert re.search(r"position 3\b", msg), msg
        assert_unchanged(trained, s)


def test_out_of_range_id_in_a_large_batch(trained):
    ids = np.zeros(300_000, np.int64)
    ids[250_001] = 99
    with pytest.raises(IndexError) as e:
        trained.lookup(ids, np.array([0, 300_000]))
    assert "99" in str(e.value) and "250001" in str(e.value) and "clicks" in str(e.value)


def test_out_of_range_id_in_dense_and_sparse_inputs(trained):
    with pytest.raises(IndexError, match="clicks"):
        trained.lookup(np.array([[1, 2], [3, 25]]))
    with pytest.raises(IndexError, match="clicks"):
        trained.lookup(ec.Sparse(np.array([[0, 0], [1, 1]]), np.array([1, -3]), [2, 2]))


def test_uint64_id_too_large(trained):
    with pytest.raises(IndexError):
        trained.lookup(np.array([1, 2**64 - 1], np.uint64))


@pytest.mark.parametrize("ids", [np.array([1.0, 2.0]), np.array([1, 2], np.float32), [1.5, 2.5],
                                 np.array([True, False]), np.array(["1", "2"]), np.array([1 + 0j])])
def test_non_integer_ids(trained, ids):
    _all_failing_calls_leave_it_unchanged(trained, lambda: trained.lookup(ids), TypeError)
    _all_failing_calls_leave_it_unchanged(
        trained, lambda: trained.apply_gradients(ids, grads=np.ones((len(ids), 4), np.float32)), TypeError)


def test_three_d_ids(trained):
    ids = np.zeros((2, 2, 2), np.int64)
    _all_failing_calls_leave_it_unchanged(trained, lambda: trained.lookup(ids), ValueError)
    _all_failing_calls_leave_it_unchanged(
        trained, lambda: trained.apply_gradients(ids, grads=np.ones((2, 4), np.float32)), ValueError)


def test_offsets_with_2d_ids(trained):
    with pytest.raises(ValueError):
        trained.lookup(np.zeros((2, 2), np.int64), np.array([0, 2, 4]))
    with pytest.raises(ValueError):
        trained.lookup(ec.Ragged(np.array([1, 2]), np.array([0, 2])), np.array([0, 2]))


# ----------------------------------------------------------------- offsets


@pytest.mark.parametrize("offsets", [[0, 3, 2, 5], [1, 3, 5], [0, 2, 4], [0, 2, 6], [], [[0, 5]], [-1, 5],
                                     [0, 5, 5, 4]])
def test_bad_offsets(trained, offsets):
    ids = np.array([1, 2, 3, 4, 5])
    offsets = np.array(offsets, np.int64)
    out = np.full((max(offsets.size - 1, 1), 4), 3.0, np.float32)
    for call in (lambda: trained.lookup(ids, offsets),
                 lambda: trained.lookup(ids, offsets, combiner=None, max_sequence_length=3),
                 lambda: trained.lookup(ec.Ragged(ids, offsets)),
                 lambda: trained.apply_gradients(ids, offsets, np.ones((max(offsets.size - 1, 0), 4), np.float32))):
        _all_failing_calls_leave_it_unchanged(trained, call, ValueError)
    if offsets.ndim == 1 and offsets.size > 1:
        with pytest.raises(ValueError):
            trained.lookup(ids, offsets, out=out)
        assert np.all(out == 3.0)


def test_float_offsets(trained):
    with pytest.raises(TypeError):
        trained.lookup(np.array([1, 2]), np.array([0.0, 2.0]))


# ----------------------------------------------------------------- weights


def test_weights_of_wrong_length(trained):
    ids, offsets = np.array([1, 2, 3]), np.array([0, 1, 3])
    for w in (np.ones(2, np.float32), np.ones(4, np.float32), np.ones((3, 1), np.float32)):
        _all_failing_calls_leave_it_unchanged(trained, lambda: trained.lookup(ids, offsets, w), ValueError)
        _all_failing_calls_leave_it_unchanged(
            trained, lambda: trained.apply_gradients(ids, offsets, np.ones((2, 4), np.float32), weights=w),
            ValueError)
    with pytest.raises(ValueError):
        trained.lookup(np.array([[1, 2], [3, 4]]), weights=np.ones(4, np.float32))
    with pytest.raises(ValueError, match="weights must have the same offsets as ids"):
        trained.lookup(ec.Ragged(ids, offsets), weights=ec.Ragged(np.ones(3, np.float32), np.array([0, 2, 3])))
    sp = ec.Sparse(np.array([[0, 0], [1, 0]]), np.array([1, 2]), [2, 2])
    with pytest.raises(ValueError):
        trained.lookup(sp, weights=np.ones(3, np.float32))
    with pytest.raises(ValueError):
        trained.lookup(sp, weights=ec.Sparse(np.array([[0, 0], [1, 1]]), np.ones(2, np.float32), [2, 2]))


def test_weights_in_another_form_than_the_ids(trained):
    ragged = ec.Ragged(np.array([1.0, 2.0], np.float32), np.array([0, 1, 2]))
    sparse = ec.Sparse([[0, 0], [1, 0]], np.array([1.0, 2.0], np.float32), [2, 1])
    with pytest.raises(TypeError, match="weights is Ragged but ids is ndarray: give the weights in the form of the ids"):
        trained.lookup(np.array([1, 2]), np.array([0, 1, 2]), weights=ragged, combiner="sum")
    with pytest.raises(TypeError, match="weights is Sparse but ids is Ragged"):
        trained.lookup(ec.Ragged(np.array([1, 2]), np.array([0, 1, 2])), weights=sparse, combiner="sum")
    emb = ec.Embedding({"f": ec.FeatureConfig(ec.TableConfig("t", rows=5, dim=2))})
    with pytest.raises(TypeError, match=r"weights of features\['f'\] is Ragged but features\['f'\] is ndarray"):
        emb({"f": np.array([1, 2])}, weights={"f": ragged})


def test_non_numeric_weights(trained):
    with pytest.raises(TypeError):
        trained.lookup(np.array([1, 2]), weights=np.array(["a", "b"]))


# ----------------------------------------------------------------- sparse inputs


@pytest.mark.parametrize("indices,shape", [([[0, 0], [2, 0]], [2, 2]), ([[0, 0], [0, 5]], [2, 2]),
                                           ([[0, -1]], [2, 2]), ([0, 1], [2, 2]), ([[0, 0]], [2]),
                                           ([[0, 0]], [-1, 2])])
def test_bad_sparse(trained, indices, shape):
    n = np.asarray(indices).shape[0] if np.asarray(indices).ndim == 2 else 2
    sp = ec.Sparse(np.array(indices, np.int64), np.ones(n, np.int64), np.array(shape))
    with pytest.raises(ValueError):
        trained.lookup(sp)


@pytest.mark.parametrize("index_dtype", [np.int32, np.int64])
def test_bad_sparse_index_is_named(trained, index_dtype):
    """The first entry outside dense_shape is named, sorted input or not."""
    indices = np.array([[1, 1], [0, 0], [2, 1], [0, 5]], index_dtype)
    with pytest.raises(ValueError, match=r"ids\.indices\[2\] = \[2, 1\] is outside dense_shape \[2, 2\]"):
        trained.lookup(ec.Sparse(indices, np.ones(4, np.int64), [2, 2]))
    with pytest.raises(ValueError, match=r"ids\.indices\[0\] = \[0, -1\] is outside"):
        trained.lookup(ec.Sparse(np.array([[0, -1]], index_dtype), [1], [2, 2]))


def test_sparse_sequence_checks_the_ids_it_drops():
    """Ids at positions past max_sequence_length are dropped but checked, on
    every path: positions 0, 1, 2, ... (the padded kernels) or with gaps and
    repeats (runs summed per position). The position named is the id's
    place in the row-major order of the entries."""
    t = ec.Table(name="t", rows=4, dim=2, optimizer=ec.optimizers.Adagrad(0.1))
    before = t.to_numpy()
    grads = np.ones((1, 2, 2), np.float32)
    for indices in ([[0, 0], [0, 1], [0, 2]], [[0, 0], [0, 2], [0, 3]], [[0, 1], [0, 1], [0, 3]]):
        ids = ec.Sparse(np.array(indices), np.array([1, 2, 99]), [1, 4])
        with pytest.raises(IndexError, match="id 99 at position 2 of ids is out of range"):
            t.lookup(ids, combiner=None, max_sequence_length=2)
        # apply_gradients checks them as lookup does (it stepped past one dropped, and named a kept one's
        # position among the kept ids only).
        with pytest.raises(IndexError, match="id 99 at position 2 of ids is out of range"):
            t.apply_gradients(ids, grads=grads, combiner=None, max_sequence_length=2)
    # Entries not in row-major order: the caller's position, in both.
    ids = ec.Sparse(np.array([[0, 3], [0, 0], [0, 1]]), np.array([99, 1, 2]), [1, 4])
    for call in (lambda: t.lookup(ids, combiner=None, max_sequence_length=2),
                 lambda: t.apply_gradients(ids, grads=grads, combiner=None, max_sequence_length=2)):
        with pytest.raises(IndexError, match="id 99 at position 0 of ids is out of range"):
            call()
    assert t.step == 0 and np.array_equal(t.to_numpy(), before)


def test_huge_sparse_dense_shape_is_a_memory_error(trained):
    for bags in (2**61, 2**63 - 1):
        with pytest.raises(MemoryError):
            trained.lookup(ec.Sparse(np.zeros((0, 2), np.int64), np.zeros(0, np.int64), [bags, 3]), combiner="sum")


def test_memory_errors_say_what_and_how_much():
    """A result or a table beyond the address space (so that no overcommit
    setting lets the allocation through) is a MemoryError that names what
    could not be allocated and its size, not a bare std::bad_alloc."""
    t = ec.Table(name="t", rows=12, dim=6)
    with pytest.raises(MemoryError, match=r"the result \(\d+ values\): cannot allocate \d+ bytes \(1\.5 PiB\)"):
        t.lookup(np.array([1, 2]), np.array([0, 1, 2]), combiner=None, max_sequence_length=2**45)
    with pytest.raises(MemoryError, match=r"table 'huge': its float32 values \(1125899906842624 x 64\): cannot "
                                          r"allocate 288230376151711744 bytes \(256\.0 PiB\)"):
        ec.Table(name="huge", rows=2**50, dim=64)


def _overcommit_mode():
    try:
        return int(open("/proc/sys/vm/overcommit_memory").read())
    except (OSError, ValueError):
        return None


def test_a_table_larger_than_memory_is_a_memory_error_unless_it_stays_zero():
    """A table whose initializer fills it, of 32 TiB (more than any machine
    has, within the address space): a MemoryError naming the table when it is
    made, not a process killed while it is filled. A Zeros table (and Adam's
    zero moments) is mapped lazily: its rows take memory when first written,
    so it can be made."""
    mode = _overcommit_mode()
    if mode not in (0, 2):
        pytest.skip(f"vm.overcommit_memory is {mode}: the kernel grants any mapping, and filling it would kill us")
    rows = (32 << 40) // (64 * 4)
    with pytest.raises(MemoryError, match=rf"table 'big': its float32 values \({rows} x 64\): cannot allocate "
                                          r"\d+ bytes \(32\.0 TiB\)"):
        ec.Table(name="big", rows=rows, dim=64)
    with pytest.raises(MemoryError, match=r"table 'big': its slot 'accumulators'"):  # filled with 0.1
        ec.Table(name="big", rows=rows, dim=64, initializer=ec.initializers.Zeros(), optimizer=ec.optimizers.Adagrad())
    if mode == 0:  # heuristic accounting: mappings not accounted for are granted
        for optimizer in (ec.optimizers.Adam(0.1), ec.optimizers.Adagrad(0.1, initial_accumulator_value=0.0,
                                                                            epsilon=1e-10)):
            t = ec.Table(name="big", rows=rows, dim=64, initializer=ec.initializers.Zeros(), optimizer=optimizer)
            np.testing.assert_array_equal(t.lookup(np.array([0, rows - 1]), combiner=None), np.zeros((2, 64)))
            del t


def test_sparse_weights_of_another_dense_shape(trained):
    ids = ec.Sparse([[0, 0], [1, 1]], [1, 2], [3, 2])
    with pytest.raises(ValueError, match=r"weights.dense_shape \[5, 9\] differs from ids.dense_shape \[3, 2\]"):
        trained.lookup(ids, weights=ec.Sparse([[0, 0], [1, 1]], [1.0, 2.0], [5, 9]), combiner="sum")


def test_threads_that_cannot_start_raise_and_keep_the_pool():
    """Under a memory limit that stops thread creation part-way (each thread
    reserves its stack), set_num_threads raises RuntimeError and the engine
    keeps its old pool (was: a hang in the pool's constructor)."""
    import resource
    import subprocess
    import sys

    code = ("import embedcore as ec, numpy as np\n"
            "ec.set_num_threads(2)\n"
            "try:\n    ec.set_num_threads(4096)\nexcept RuntimeError as e:\n    print('refused:', e)\n"
            "assert ec.get_num_threads() == 2\n"
            "t = ec.Table(name='t', rows=10, dim=4)\n"
            "print('lookup ok', t.lookup(np.array([1, 2]), np.array([0, 2])).shape)\n")

    def limit():  # 4096 threads x 8 MiB stacks do not fit in 3 GiB of address space
        resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))

    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, preexec_fn=limit)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "refused: set_num_threads: could not start 4095 worker threads" in r.stdout, r.stdout
    assert "lookup ok (1, 4)" in r.stdout


_STEP_UNDER_A_LIMIT = """
import resource, sys, numpy as np, embedcore as ec
t = ec.Table(name="t", rows=1000, dim=1, initializer=ec.initializers.Uniform(-1, 1, seed=0),
             optimizer=ec.optimizers.Adagrad(0.1))
n = 4_000_000
ids, offsets = np.arange(n, dtype=np.int64) % 1000, np.arange(n + 1)
grads = np.ones((n, 1), np.float32)
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
if sys.argv[1] == "retained":
    t.apply_gradients(ids[:100], offsets[:101], grads[:100])
    before = rss()
    t.apply_gradients(ids, offsets, grads)  # its sort takes about 200 MB
    import time
    time.sleep(2.5)  # (buffers that no step needed for 2 s)
    t.apply_gradients(ids[:100], offsets[:101], grads[:100])  # a step of the usual size
    print("kept MB", (rss() - before) >> 20)
    sys.exit(0)
if sys.argv[1] == "steady":  # a large table stepped each iteration beside a small one, on one thread
    small = ec.Table(name="s", rows=10, dim=1, optimizer=ec.optimizers.Adagrad(0.1))
    for i in range(3):
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t.apply_gradients(ids, offsets, grads)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        small.apply_gradients(ids[:5] % 10, offsets[:6], grads[:5])
    print("faults", faults)
    sys.exit(0)
vm = int(open("/proc/self/statm").read().split()[0]) * 4096
resource.setrlimit(resource.RLIMIT_AS, (vm + (int(sys.argv[1]) << 20), resource.RLIM_INFINITY))
before = t.to_numpy()
try:
    t.apply_gradients(ids, offsets, grads)
except MemoryError as e:
    print("MemoryError:", e)
print("unchanged", bool(np.array_equal(before, t.to_numpy())), t.step)
"""


@pytest.mark.parametrize("headroom,message", [
    (16, "the engine's copy of the offsets of 4000000 bags: cannot allocate 32000008 bytes (30.5 MiB)"),
    (80, "table 't': apply_gradients of 4000000 ids: cannot allocate"),
])
def test_a_step_without_memory_for_its_sort_names_it_and_changes_nothing(headroom, message):
    """A MemoryError names what could not be allocated, and how much (was:
    'std::bad_alloc'); the table is unchanged."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", _STEP_UNDER_A_LIMIT, str(headroom)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"MemoryError: {message}" in r.stdout and "unchanged True 0" in r.stdout, r.stdout


_EMBEDDING_STEP_UNDER_A_LIMIT = r"""
import resource, sys, numpy as np, embedcore as ec
A = ec.TableConfig("a", rows=100, dim=4, initializer=ec.initializers.Uniform(-1, 1, seed=0))
B = ec.TableConfig("b", rows=1000, dim=1, initializer=ec.initializers.Uniform(-1, 1, seed=1))
emb = ec.Embedding({"a": ec.FeatureConfig(A), "b": ec.FeatureConfig(B)}, ec.optimizers.Adagrad(0.1))
n = 4_000_000
out = emb({"a": np.array([1, 2, 3]), "b": np.arange(n, dtype=np.int64) % 1000})
grads = {k: np.ones_like(v) for k, v in out.items()}
ta, tb = emb.embedding_tables[A], emb.embedding_tables[B]
before = (ta.to_numpy(), tb.to_numpy())
vm = int(open("/proc/self/statm").read().split()[0]) * 4096
resource.setrlimit(resource.RLIMIT_AS, (vm + (int(sys.argv[1]) << 20), resource.RLIM_INFINITY))
try:
    emb.apply_gradients(grads)
except MemoryError as e:
    print("MemoryError:", e)
print("unchanged", np.array_equal(before[0], ta.to_numpy()), ta.step, np.array_equal(before[1], tb.to_numpy()), tb.step)
"""


@pytest.mark.parametrize("headroom,message", [
    (16, "cannot allocate"),
    (100, "apply_gradients of 2 tables, before any steps: table 'b' (the "),
])
def test_an_embedding_step_without_memory_for_a_later_table_changes_no_table(headroom, message):
    """Each table allocated its step's buffers as it stepped: running out at
    the second left the first stepped. Now every step's memory is allocated
    before the first table changes. (Which allocation fails first depends on
    what the interpreter's start-up left free in malloc's heap: the engine's
    copy of the offsets, or one of table b's sort buffers.)"""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", _EMBEDDING_STEP_UNDER_A_LIMIT, str(headroom)], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    error = r.stdout.split("MemoryError: ", 1)[-1].split("\n")[0]
    assert "MemoryError: " in r.stdout and message in error and "unchanged True 0 True 0" in r.stdout, r.stdout


def test_a_non_lazy_adam_step_without_memory_for_its_row_flags_names_them_and_changes_nothing():
    """Non-lazy Adam flags the rows a step touched (a byte a row): without
    memory for them the MemoryError said only 'std::bad_alloc'."""
    import subprocess
    import sys

    script = """
import resource, numpy as np, embedcore as ec
t = ec.Table(name="t", rows=50_000_000, dim=1, dtype="float16", initializer=ec.initializers.Zeros(),
             optimizer=ec.optimizers.Adam(0.1, lazy_adam=False))
vm = int(open("/proc/self/statm").read().split()[0]) * 4096
resource.setrlimit(resource.RLIMIT_AS, (vm + (30 << 20), resource.RLIM_INFINITY))
try:
    t.apply_gradients(np.array([1]), None, np.ones((1, 1), np.float32))
except MemoryError as e:
    print("MemoryError:", e)
print("step", t.step, "row", float(t.values()[1, 0]))
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert ("MemoryError: table 't': apply_gradients of non-lazy Adam (a flag per row, for the rows no id touched): "
            "cannot allocate 50000000 bytes (47.7 MiB)") in r.stdout, r.stdout
    assert "step 0 row 0.0" in r.stdout, r.stdout


def test_an_outsized_step_gives_its_sort_memory_back():
    """A step's sort buffers are kept across steps of usual sizes, but one
    past 64 MiB that no step needed for 2 s is given back at the next step
    (the memory stayed with the thread for its life)."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", _STEP_UNDER_A_LIMIT, "retained"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert int(r.stdout.split("kept MB")[1]) < 100, r.stdout  # (kept, the keys and their sorted copy: 192 MB)


def test_a_large_table_stepped_beside_small_ones_keeps_its_sort_memory():
    """The buffers are the thread's, shared by its tables: a small table's
    step between two of a large one must not give them back (the large step
    faulted its 190 MB in again every time)."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", _STEP_UNDER_A_LIMIT, "steady"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert int(r.stdout.split("faults")[1]) < 5000, r.stdout  # (46,000 pages when they were given back)


def test_thread_counts_out_of_range():
    before = ec.get_num_threads()
    for bad, match in ((0, ">= 1"), (10**8, "<= 4096"), (np.int64(0), ">= 1")):
        with pytest.raises(ValueError, match=match):
            ec.set_num_threads(bad)
    for bad in (2.0, "2", True, None):
        with pytest.raises(TypeError, match="n must be an int"):
            ec.set_num_threads(bad)
    assert ec.get_num_threads() == before


def test_thread_count_of_a_numpy_integer(restore_threads):
    ec.set_num_threads(np.int64(2))  # as the other int arguments take NumPy's integers
    assert ec.get_num_threads() == 2


def test_assigned_values_must_be_finite(trained):
    """assign (and what goes through it: the Saver's load_embedding_values)
    refuses NaN / inf, as assign_slot does, naming where; nothing changes."""
    before = trained.to_numpy()
    bad = np.zeros((3, trained.dim), np.float32)
    bad[2, 1] = np.nan
    with pytest.raises(ValueError, match=r"values\[2, 1\] = nan is not finite"):
        trained.assign(bad, 1)
    big = np.zeros((1, trained.dim), np.float64)
    big[0, 0] = 1e300  # inf as float32
    with pytest.raises(ValueError, match=r"values: value 1e\+300 at index \[0, 0\] is outside the float32 range"):
        trained.assign(big)
    full = np.zeros((trained.rows, trained.dim), np.float32)
    full[-1, -1] = -np.inf
    with pytest.raises(ValueError, match="not finite"):
        ec.Saver().load_embedding_values(trained, [full[:2], full[2:]])
    np.testing.assert_array_equal(trained.to_numpy(), before)


def test_sparse_of_rank_3_is_refused_not_misread(trained):
    """Rank 3 used to be read as (bag, position) from its first two columns,
    adding both ids below into one position."""
    sp = ec.Sparse([[0, 0, 0], [0, 0, 1]], [1, 2], [2, 2, 2])
    before = trained.to_numpy()
    for combiner in ("sum", None):
        with pytest.raises(ValueError, match=r"\[nnz, 2\].*got \(2, 3\)"):
            trained.lookup(sp, combiner=combiner)
    with pytest.raises(ValueError, match="rank 2"):
        trained.apply_gradients(sp, grads=np.ones((2, trained.dim), np.float32), combiner="sum")
    np.testing.assert_array_equal(trained.to_numpy(), before)


def test_sparse_values_length(trained):
    with pytest.raises(ValueError):
        trained.lookup(ec.Sparse(np.array([[0, 0], [1, 0]]), np.array([1, 2, 3]), [2, 2]))


# ----------------------------------------------------------------- gradients


@pytest.mark.parametrize("combiner,length,shape", [("sum", 0, (3, 4)), ("sum", 0, (2, 3)), ("sum", 0, (2, 4, 1)),
                                                   ("mean", 0, (8,)), (None, 0, (2, 4)), (None, 0, (5, 3)),
                                                   (None, 3, (2, 4)), (None, 3, (2, 2, 4)), (None, 3, (2, 3, 5))])
def test_grads_of_wrong_shape(trained, combiner, length, shape):
    ids, offsets = np.array([1, 2, 3, 4]), np.array([0, 1, 4])
    g = np.ones(shape, np.float32)
    _all_failing_calls_leave_it_unchanged(
        trained, lambda: trained.apply_gradients(ids, offsets, g, combiner=combiner, max_sequence_length=length),
        ValueError)


def test_grads_missing_or_not_numbers(trained):
    ids = np.array([1, 2])
    _all_failing_calls_leave_it_unchanged(trained, lambda: trained.apply_gradients(ids), TypeError)
    _all_failing_calls_leave_it_unchanged(
        trained, lambda: trained.apply_gradients(ids, grads=np.array([["a"] * 4] * 2)), TypeError)


def test_non_finite_learning_rate_from_callable(trained):
    table = make_table(5, 2, optimizer=opt.SGD(learning_rate=lambda step: float("nan")))
    _all_failing_calls_leave_it_unchanged(
        table, lambda: table.apply_gradients(np.array([1]), grads=np.ones((1, 2), np.float32)), ValueError)
    table = make_table(5, 2, optimizer=opt.SGD(learning_rate=lambda step: "fast"))
    _all_failing_calls_leave_it_unchanged(
        table, lambda: table.apply_gradients(np.array([1]), grads=np.ones((1, 2), np.float32)), TypeError)


def test_no_optimizer(trained):
    table = ec.Table(name="t", rows=5, dim=2)
    _all_failing_calls_leave_it_unchanged(
        table, lambda: table.apply_gradients(np.array([1]), grads=np.ones((1, 2), np.float32)), ValueError)


def test_embedding_learning_rate_overflowing_float32_changes_no_table():
    """1e39 is a finite Python float but not a finite float32 (the engine's
    learning rate): the step must fail before any table changes."""
    a = ec.TableConfig(name="a", rows=5, dim=2, optimizer=opt.SGD(learning_rate=0.1))
    b = ec.TableConfig(name="b", rows=5, dim=2, optimizer=opt.SGD(learning_rate=lambda step: 1e39))
    emb = ec.Embedding({"a": ec.FeatureConfig(a), "b": ec.FeatureConfig(b)})
    emb({"a": np.array([1]), "b": np.array([1])})
    tables = emb.embedding_tables
    snaps = {k: snapshot(t) for k, t in tables.items()}
    with pytest.raises(ValueError):
        emb.apply_gradients({"a": np.ones((1, 2), np.float32), "b": np.ones((1, 2), np.float32)})
    for k, t in tables.items():
        assert_unchanged(t, snaps[k])


def test_embedding_step_a_later_table_refuses_changes_no_table():
    """Embedding.apply_gradients steps its tables one after another: what a
    later table's step refuses (gradients viewing the memory a step updates,
    or a table at the last step a checkpoint records) must fail before the
    earlier tables change."""
    a = ec.TableConfig(name="a", rows=6, dim=2, initializer=ec.initializers.Uniform(-1, 1, seed=1))
    b = ec.TableConfig(name="b", rows=6, dim=2, initializer=ec.initializers.Uniform(-1, 1, seed=2),
                       optimizer=opt.Adagrad(0.1))
    emb = ec.Embedding({"x": ec.FeatureConfig(a), "y": ec.FeatureConfig(b)}, opt.SGD(0.1))
    ta, tb = emb.embedding_tables[a], emb.embedding_tables[b]
    emb({"x": np.array([1, 2]), "y": np.array([3, 4])})
    ones = np.ones((2, 2), np.float32)
    snaps = {t.name: snapshot(t) for t in (ta, tb)}

    def refused(grads, match):
        with pytest.raises(ValueError, match=match):
            emb.apply_gradients(grads)
        for t in (ta, tb):
            assert_unchanged(t, snaps[t.name])

    # b's gradients view b's own values, or its accumulators: b's step would refuse them after a's step.
    refused({"x": ones, "y": tb.values()[2:4]},
            r"grads\['y'\] overlaps the values of table 'b' that the step updates: pass a copy")
    refused({"x": ones, "y": tb.slots()["accumulators"][:2]}, r"grads\['y'\] overlaps a slot of table 'b'")
    # b's gradients view a's values, which a's step would change before b's step reads them.
    refused({"x": ones, "y": ta.values()[:2]}, r"grads\['y'\] overlaps the values of table 'a'")
    tb.step = 2**62
    snaps["b"] = snapshot(tb)
    refused({"x": ones, "y": ones}, "table 'b' is at step 4611686018427387904, the last a checkpoint records")
    tb.step = 0
    emb.apply_gradients({"x": ones, "y": tb.values()[2:4].copy()})  # copies are fine
    assert ta.step == tb.step == 1


def test_sparse_sequence_out_sharing_memory_with_an_input_is_refused(trained):
    """A Sparse sequence lookup zeroes `out` before it places the rows: an
    `out` that shares memory with the ids, weights or indices is refused, as
    every other lookup refuses it, rather than reading what it zeroed."""
    v = trained.to_numpy()
    ref = np.zeros((2, 2, 4), np.float32)
    ref[1, 1] = v[3]
    buf = np.zeros(16, np.float32)
    out = buf.reshape(2, 2, 4)
    indices = buf.view(np.int64)[:2].reshape(1, 2)
    indices[:] = [[1, 1]]
    with pytest.raises(ValueError, match="out shares memory with ids.indices: pass a separate output array"):
        trained.lookup(ec.Sparse(indices, np.array([3]), [2, 2]), combiner=None, out=out)
    np.testing.assert_array_equal(indices, [[1, 1]])  # not overwritten
    buf = np.zeros(16, np.float32)
    ids = buf.view(np.int64)[:1]
    ids[:] = 3
    with pytest.raises(ValueError, match="out shares memory with ids"):
        trained.lookup(ec.Sparse([[1, 1]], ids, [2, 2]), combiner=None, out=buf.reshape(2, 2, 4))
    buf = np.zeros(16, np.float32)
    w = buf[:1]
    w[:] = 1.0
    with pytest.raises(ValueError, match="out shares memory with weights"):
        trained.lookup(ec.Sparse([[1, 1]], [3], [2, 2]), weights=w, combiner=None, out=buf.reshape(2, 2, 4))
    out = np.full((2, 2, 4), 7, np.float32)  # separate arrays are fine
    trained.lookup(ec.Sparse(indices.copy(), np.array([3]), [2, 2]), combiner=None, out=out)
    np.testing.assert_array_equal(out, ref)


def test_max_sequence_length_is_checked_whatever_the_combiner(trained):
    """A pooled lookup ignores max_sequence_length, but a bad one is an error
    there too, and apply_gradients refuses what lookup refuses."""
    ids, grads = np.array([1, 2]), np.ones((2, 4), np.float32)
    with pytest.raises(TypeError, match="max_sequence_length must be an int, got 'x'"):
        trained.lookup(ids, combiner="sum", max_sequence_length="x")
    s = snapshot(trained)
    with pytest.raises(ValueError, match="max_sequence_length must be >= 0, got -5"):
        trained.apply_gradients(ids, grads=grads, combiner="sum", max_sequence_length=-5)
    with pytest.raises(TypeError, match="max_sequence_length must be an int, got 2.0"):
        trained.apply_gradients(ids, grads=grads, combiner="mean", max_sequence_length=2.0)
    assert_unchanged(trained, s)


def test_embedding_bad_id_changes_nothing():
    a = ec.TableConfig(name="a", rows=5, dim=2)
    emb = ec.Embedding({"a": ec.FeatureConfig(a)}, opt.SGD(0.1))
    with pytest.raises(IndexError, match="'a'"):
        emb({"a": np.array([1, 5])})


# ----------------------------------------------------------------- configs


@pytest.mark.parametrize("kwargs,exc", [
    (dict(rows=0, dim=2), ValueError),
    (dict(rows=-3, dim=2), ValueError),
    (dict(rows=3, dim=0), ValueError),
    (dict(rows=3, dim=-1), ValueError),
    (dict(rows=2**63, dim=1), ValueError),  # (was nanobind's TypeError when the table was made)
    (dict(rows=3, dim=2**64), ValueError),
    (dict(rows=3.0, dim=2), TypeError),
    (dict(rows=3, dim="2"), TypeError),
    (dict(rows=True, dim=2), TypeError),
    (dict(rows=None, dim=2), TypeError),
    (dict(rows=3, dim=2, dtype="float64"), ValueError),
    (dict(rows=3, dim=2, dtype="int8"), ValueError),
    (dict(rows=3, dim=2, combiner="max"), ValueError),
    (dict(rows=3, dim=2, combiner=None), ValueError),
    (dict(rows=3, dim=2, optimizer="adam"), TypeError),
    (dict(rows=3, dim=2, vocabulary_size=4), ValueError),
])
def test_bad_table_config(kwargs, exc):
    with pytest.raises(exc):
        ec.TableConfig(name="t", **kwargs)
    with pytest.raises(exc):
        ec.Table(name="t", **kwargs)


def test_table_config_vocabulary_size():
    cfg = ec.TableConfig(name="t", vocabulary_size=7, dim=2)
    assert cfg.rows == 7 and cfg.vocabulary_size == 7


def test_table_arguments():
    with pytest.raises(TypeError):
        ec.Table(ec.TableConfig(name="t", rows=3, dim=2), rows=3)
    with pytest.raises(TypeError):
        ec.Table("t")
    # A name given first, as TableConfig takes it: said so (it was "not both", naming no TableConfig given).
    with pytest.raises(TypeError, match=r"the positional argument is a TableConfig, got 'a'; give the name by "
                                        r"keyword: Table\(name='a', \.\.\.\)"):
        ec.Table("a", rows=4, dim=2)


def test_lookup_arguments(trained):
    ids = np.array([1, 2])
    with pytest.raises(ValueError):
        trained.lookup(ids, combiner="max")
    with pytest.raises(ValueError):
        trained.lookup(ids, combiner=None, max_sequence_length=-1)
    with pytest.raises(TypeError):
        trained.lookup(ids, combiner=None, max_sequence_length=2.5)


def test_table_step_setter(trained):
    with pytest.raises(ValueError):
        trained.step = -1
    for bad in (1.5, True, "3"):  # not ints: TypeError, as the other int arguments
        with pytest.raises(TypeError):
            trained.step = bad
    assert trained.step == 1


def test_table_names_must_be_utf8():
    # A name from undecodable bytes (os.fsdecode of a file name) holds lone surrogates: not UTF-8 text.
    with pytest.raises(ValueError, match=r"TableConfig 'emb\\udcff': name is not valid UTF-8 text"):
        ec.Table(name="emb\udcff", rows=3, dim=2)
    assert ec.Table(name="émb ✓", rows=3, dim=2).name == "émb ✓"
    with pytest.raises(ValueError, match=r"FeatureConfig 'feat\\udcff': name is not valid UTF-8 text"):
        ec.FeatureConfig(ec.TableConfig("t", rows=3, dim=2), name="feat\udcff")
    # A NUL ends a C string: the C API would serve "a\0b" as "a" and find no table of that name.
    with pytest.raises(ValueError, match=r"TableConfig 'a\\x00b': name has a NUL character at position 1"):
        ec.Table(name="a\0b", rows=3, dim=2)
    with pytest.raises(ValueError, match=r"FeatureConfig 'f\\x00': name has a NUL character at position 1"):
        ec.FeatureConfig(ec.TableConfig("t", rows=3, dim=2), name="f\0")
    with pytest.raises(ValueError, match=r"Embedding: feature 'x/a\\x00b': name has a NUL character at position 3"):
        ec.Embedding({"x": {"a\0b": ec.FeatureConfig(ec.TableConfig("t", rows=3, dim=2))}})  # a name from the keys


def test_float64_gradients_beyond_float32_are_refused(trained):
    # As weights are: a gradient of 1e300 would become inf (then NaN rows); nothing changes.
    before = trained.to_numpy(), {k: v.copy() for k, v in trained.slots().items()}, trained.step
    grads = np.ones((2, trained.dim))
    grads[1, 0] = -1e300
    with pytest.raises(ValueError, match=r"grads: value -1e\+300 at index \[1, 0\] is outside the float32 range "
                                         r"\(it would become -inf\)"):
        trained.apply_gradients(np.array([0, 1]), grads=grads, combiner=None)
    np.testing.assert_array_equal(trained.to_numpy(), before[0])
    for k, v in trained.slots().items():
        np.testing.assert_array_equal(v, before[1][k])
    assert trained.step == before[2]


def test_assign_errors(trained):
    s = snapshot(trained)
    with pytest.raises(ValueError):
        trained.assign(np.ones((2, 3), np.float32))
    with pytest.raises(IndexError):
        trained.assign(np.ones((2, 4), np.float32), start_row=19)
    with pytest.raises(IndexError):
        trained.assign(np.ones((2, 4), np.float32), start_row=-1)
    with pytest.raises(IndexError):
        trained.assign_slot("momenta", np.ones((2, 4), np.float32), start_row=19)
    with pytest.raises(IndexError):
        trained.to_numpy(15, 6)
    # Without num_rows: the start row is named, not the num_rows it implies.
    for bad in (21, -1):
        with pytest.raises(IndexError, match=rf"table 'clicks': start_row {bad} is outside \[0, 20\]"):
            trained.to_numpy(bad)
    assert trained.to_numpy(20).shape == (0, 4)
    with pytest.raises(ValueError, match=r"table 'clicks' has no slot 'momentum'; its slots are \['momenta', "):
        trained.assign_slot("momentum", np.ones((2, 4), np.float32))
    assert_unchanged(trained, s)


@pytest.mark.parametrize("bad", [1.5, True, "1", np.float64(2.0), None])
def test_start_row_must_be_an_int(trained, bad):
    """A float, bool or string row is not truncated or parsed into a row."""
    s = snapshot(trained)
    for call in (lambda: trained.assign(np.ones((1, 4), np.float32), start_row=bad),
                 lambda: trained.assign_slot("momenta", np.ones((1, 4), np.float32), start_row=bad),
                 lambda: trained.to_numpy(bad, 1)):
        with pytest.raises(TypeError, match=f"table 'clicks': start_row must be an int, got {re.escape(repr(bad))}"):
            call()
    with pytest.raises(TypeError, match="num_rows must be an int, got 1.0"):
        trained.to_numpy(0, 1.0)
    assert_unchanged(trained, s)


def test_rows_past_int64_are_index_errors(trained):
    s = snapshot(trained)
    with pytest.raises(IndexError, match=r"table 'clicks': assigned rows \[18446744073709551616, "):
        trained.assign(np.ones((1, 4), np.float32), start_row=2**64)
    with pytest.raises(IndexError, match=r"assigned slot rows \[-18446744073709551616, "):
        trained.assign_slot("momenta", np.ones((1, 4), np.float32), start_row=-2**64)
    with pytest.raises(IndexError, match=r"read rows \[0, 18446744073709551616\)"):
        trained.to_numpy(0, 2**64)
    assert_unchanged(trained, s)


@pytest.mark.parametrize("make", [
    lambda: opt.SGD(learning_rate=float("nan")),
    lambda: opt.SGD(learning_rate=float("inf")),
    lambda: opt.SGD(learning_rate=0.1, clip_weight_min=1.0, clip_weight_max=0.5),
    lambda: opt.SGD(learning_rate=0.1, clipvalue=-1.0),
    lambda: opt.SGD(learning_rate=0.1, clipvalue=(1.0, -1.0)),
    lambda: opt.SGD(learning_rate=0.1, clipvalue=(1.0,)),
    lambda: opt.SGD(learning_rate=0.1, clipvalue=(0.0, 1.0, 2.0)),
    lambda: opt.SGD(learning_rate=0.1, weight_decay_factor=-0.1),
    lambda: opt.SGD(learning_rate=0.1, clip_weight_max=float("nan")),
    lambda: opt.Adagrad(learning_rate=0.1, initial_accumulator_value=0.0),
    lambda: opt.Adagrad(learning_rate=0.1, initial_accumulator_value=-1.0),
    lambda: opt.Adam(learning_rate=0.1, beta_1=1.0),
    lambda: opt.Adam(learning_rate=0.1, beta_1=-0.1),
    lambda: opt.Adam(learning_rate=0.1, beta_2=1.5),
    lambda: opt.Adam(learning_rate=0.1, epsilon=0.0),
    lambda: opt.Adam(learning_rate=0.1, epsilon=-1e-7),
    lambda: opt.FTRL(learning_rate=0.1, learning_rate_power=0.5),
    lambda: opt.FTRL(learning_rate=0.1, l1_regularization_strength=-1.0),
    lambda: opt.FTRL(learning_rate=0.1, l2_regularization_strength=-1.0),
    lambda: opt.FTRL(learning_rate=0.1, beta=-1.0),
    lambda: opt.FTRL(learning_rate=0.1, initial_accumulator_value=0.0),
    # FTRL divides by the float32 learning rate (TensorFlow: "lr is not a positive scalar").
    lambda: opt.FTRL(learning_rate=0.0),
    lambda: opt.FTRL(learning_rate=-0.1),
    lambda: opt.FTRL(learning_rate=1e-45),
    lambda: opt.FTRL(learning_rate=-0.1, multiply_linear_by_learning_rate=True),
    # m / sqrt(v + epsilon**2) with a float32 epsilon**2 of 0 is 0 / 0 for a zero gradient.
    lambda: opt.Adam(learning_rate=0.1, epsilon=1e-30),
])
def test_bad_optimizer_hyper_parameters(make):
    with pytest.raises(ValueError):
        make()


@pytest.mark.parametrize("make,match", [
    (lambda: opt.FTRL(0.1, learning_rate_power=-1e39), "learning_rate_power must be within float32's range"),
    (lambda: opt.FTRL(0.1, l2_regularization_strength=1e39), "l2_regularization_strength must be within"),
    (lambda: opt.SGD(0.1, clipvalue=(-1e39, 1e39)), "clipvalue must be within float32's range"),
    (lambda: opt.SGD(1e39), "learning_rate must be within"),
    (lambda: opt.SGD(10**400), "learning_rate must be within float32's range .* too large even for float64 .int."),
    (lambda: opt.SGD(10**5000), "learning_rate must be within float32's range .* too large even for float64 .int."),
    (lambda: opt.Adagrad(0.1, initial_accumulator_value=1e39), "initial_accumulator_value must be within"),
    (lambda: opt.Adam(0.1, epsilon=1e39), "epsilon must be within"),
    # Positive, but 0 once the engine holds it as a float32.
    (lambda: opt.Adagrad(0.1, initial_accumulator_value=1e-46), "got 1e-46, which is 0 as a float32"),
    # Below 1, but 1 as a float32 (the engine's check then said "got 1", naming no table, at the table's making).
    (lambda: opt.Adam(0.1, beta_1=0.99999999999), r"beta_1 must be in \[0, 1\), got 0.99999999999, which is 1 as"),
    (lambda: opt.Adam(0.1, beta_2=1 - 2**-30), r"beta_2 must be in \[0, 1\), got 0.9999999990686774, which is 1"),
    (lambda: opt.FTRL(0.1, initial_accumulator_value=1e-46), "got 1e-46, which is 0 as a float32"),
    (lambda: opt.Adagrad(0.1, initial_accumulator_value=0, epsilon=1e-50),
     "initial_accumulator_value must be at least 1.17549435e-38 .*got 0; epsilon is 1e-50"),
])
def test_options_a_float32_cannot_hold(make, match):
    """The engine keeps every option as a float32, and a checkpoint records
    it: an option that would become infinite (or 0 where 0 is refused) is an
    error naming it when the optimizer is made, not a save that fails later."""
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize("make,match", [
    (lambda: opt.Optimizer(0.1), "Optimizer is a base class: use SGD, Adagrad, RowWiseAdagrad, Adam or FTRL"),
    (lambda: opt._Accumulating(0.1, 0.1, 0.0), "_Accumulating is a base class"),
    (lambda: ec.initializers.Initializer(), "Initializer is a base class: use Zeros, Constant, Uniform, Normal"),
])
def test_the_base_classes_are_not_an_optimizer_or_an_initializer(make, match):
    """The bare Optimizer used to train as SGD, and the bare Initializer to
    fail in the engine with an empty NotImplementedError."""
    with pytest.raises(TypeError, match=match):
        make()


def test_a_new_optimizer_or_initializer_subclass_is_refused():
    """The engine runs the update rules and draws the initial values: a
    direct subclass of the bases has nothing it could run (such an optimizer
    trained as SGD, such an initializer was an AttributeError). Subclasses
    of the engine's own classes stay what they are."""
    class MyOptimizer(opt.Optimizer):
        def __init__(self):
            super().__init__(0.1)

    class MyInitializer(ec.initializers.Initializer):
        def __call__(self, shape):
            return np.ones(shape)

    with pytest.raises(TypeError, match=r"MyOptimizer: an embedcore optimizer must be \(a subclass of\) SGD"):
        MyOptimizer()
    with pytest.raises(TypeError, match=r"MyInitializer: an embedcore initializer must be .* Table.assign"):
        MyInitializer()

    class Sgd(opt.SGD):
        pass

    class Ones(ec.initializers.Constant):
        def __init__(self):
            super().__init__(1.0)

    table = make_table(4, 2, optimizer=Sgd(0.5), initializer=Ones())
    table.apply_gradients(np.array([1]), grads=np.ones((1, 2), np.float32))
    np.testing.assert_array_equal(table.values(), [[1, 1], [0.5, 0.5], [1, 1], [1, 1]])


def test_the_largest_float32_options_save_and_load(tmp_path):
    o = opt.FTRL(0.1, learning_rate_power=-3.4e38, l2_regularization_strength=3.4e38, clipvalue=(-3.4e38, 3.4e38))
    table = make_table(6, 2, optimizer=o)
    table.step = 1
    ec.save(tmp_path / "c", table)
    again = make_table(6, 2, optimizer=o)
    ec.load(tmp_path / "c", into=again)
    np.testing.assert_array_equal(again.values(), table.values())
    assert again.step == 1 and again.optimizer == o
    # A step with them overflows (the row becomes NaN): a checkpoint holds finite values only.
    table.apply_gradients(np.array([1]), grads=np.ones((1, 2), np.float32))
    with pytest.raises(ValueError, match=r"table 't' values hold -?nan at row 1, column 0: a checkpoint holds finite"):
        ec.save(tmp_path / "c", table)


def test_ftrl_learning_rates_it_cannot_divide_by():
    """FTRL's update divides by the learning rate (unless the linear slot is
    multiplied by it): a rate, or a schedule's rate, of 0 or one whose inverse
    overflows float32 is an error naming it and the step, not NaN weights."""
    with pytest.raises(ValueError, match=r"FTRL: learning_rate 0.0 must be >= 1.17"):
        opt.FTRL(learning_rate=0.0)
    table = make_table(6, 2, optimizer=opt.FTRL(learning_rate=lambda step: 0.1 if step == 0 else 0.0))
    table.apply_gradients(np.array([1]), grads=np.ones((1, 2), np.float32))
    s = snapshot(table)
    with pytest.raises(ValueError, match=r"FTRL: learning rate 0.0 at step 1 must be >= 1.17"):
        table.apply_gradients(np.array([1]), grads=np.ones((1, 2), np.float32))
    assert_unchanged(table, s)
    assert np.isfinite(table.to_numpy()).all()
    # With multiply_linear_by_learning_rate a rate of 0 divides nothing: allowed, and no step moves a weight.
    table = make_table(6, 2, optimizer=opt.FTRL(learning_rate=0.0, multiply_linear_by_learning_rate=True))
    table.apply_gradients(np.array([1]), grads=np.ones((1, 2), np.float32))
    assert np.isfinite(table.to_numpy()).all()
    # The smallest epsilon whose float32 square is a normal float32 still gives finite Adam steps.
    table = make_table(6, 3, optimizer=opt.Adam(learning_rate=0.1, epsilon=2.0**-63))
    table.apply_gradients(np.array([1]), grads=np.array([[0.0, 1.0, 0.0]], np.float32))
    assert np.isfinite(table.to_numpy()).all()


@pytest.mark.parametrize("make", [
    lambda: opt.Adam(0.1, epsilon=2.0**-63),
    lambda: opt.Adam(0.1, epsilon=_FLT_MIN, sum_inside_sqrt=False),
    lambda: opt.Adam(0.1, epsilon=_FLT_MIN, sum_inside_sqrt=False, lazy_adam=False),
    lambda: opt.Adagrad(0.1, initial_accumulator_value=0.0, epsilon=_FLT_MIN),
    lambda: opt.Adagrad(0.1, initial_accumulator_value=_FLT_MIN, epsilon=0.0),
    lambda: opt.RowWiseAdagrad(0.1, initial_accumulator_value=0.0, epsilon=_FLT_MIN),
    lambda: opt.FTRL(0.1, initial_accumulator_value=_FLT_MIN),
], ids=["adam", "adam_eps_outside", "adam_not_lazy", "adagrad_eps", "adagrad_acc", "rowwise", "ftrl"])
def test_smallest_epsilons_stay_finite_where_subnormals_flush(make):
    """The smallest epsilon (or first accumulator) each optimizer accepts
    keeps a zero-gradient element finite even where subnormals are flushed
    to zero, as in TensorFlow's kernel threads (a subnormal epsilon**2 there
    is 0, and the element 0 / 0)."""
    torch = pytest.importorskip("torch")
    optimizer = make()
    table = make_table(6, 3, optimizer=optimizer)
    before = table.to_numpy()
    torch.set_flush_denormal(True)
    try:
        for _ in range(2):
            table.apply_gradients(np.array([1]), grads=np.array([[1.0, 0.0, -1.0]], np.float32))
    finally:
        torch.set_flush_denormal(False)
    values = table.to_numpy()
    assert np.isfinite(values).all(), values
    if not isinstance(optimizer, opt.FTRL):  # (FTRL sets every element it steps from its slots)
        assert values[1, 1] == before[1, 1]  # the zero-gradient column did not move
    for name, slot in table.slots().items():
        assert np.isfinite(slot).all(), name


@pytest.mark.parametrize("make,match", [
    (lambda: opt.Adam(0.1, epsilon=1e-20), r"epsilon must be >= 2\*\*-63 .* got 1e-20"),
    (lambda: opt.Adam(0.1, epsilon=3e-23), r"epsilon must be >= 2\*\*-63 .* got 3e-23"),
    (lambda: opt.Adam(0.1, epsilon=1e-40), r"epsilon must be >= 2\*\*-63 .* got 1e-40"),  # not the smaller minimum
    (lambda: opt.Adam(0.1, epsilon=1e-40, sum_inside_sqrt=False),
     r"epsilon must be at least 1.17549435e-38 .*got 1e-40, which is 0 where subnormals are flushed"),
    (lambda: opt.Adagrad(0.1, initial_accumulator_value=0.0, epsilon=1e-40),
     r"Adagrad: initial_accumulator_value must be at least 1.17549435e-38 .*, got 0.0; epsilon is 1e-40"),
    (lambda: opt.RowWiseAdagrad(0.1, initial_accumulator_value=0.0, epsilon=1e-40),
     r"RowWiseAdagrad: initial_accumulator_value must be at least 1.17549435e-38 .*, got 0.0; epsilon is 1e-40"),
    (lambda: opt.Adagrad(0.1, initial_accumulator_value=1e-40, epsilon=0.0),
     r"initial_accumulator_value must be at least 1.17549435e-38 .* got 1e-40.*; epsilon is 0.0"),
    (lambda: opt.FTRL(0.1, initial_accumulator_value=1e-40),
     r"FTRL: initial_accumulator_value must be at least 1.17549435e-38 .* got 1e-40"),
])
def test_subnormal_epsilons_are_refused(make, match):
    """An epsilon (or first accumulator) that only keeps a zero-gradient
    element finite while subnormals are not flushed is refused when the
    optimizer is made, naming the value."""
    with pytest.raises(ValueError, match=match):
        make()


def test_subnormal_epsilons_are_fine_beside_a_normal_accumulator():
    # The accumulator keeps sqrt(a) + epsilon away from 0: a tiny epsilon is harmless.
    assert opt.Adagrad(0.1, initial_accumulator_value=0.1, epsilon=1e-40).epsilon == 1e-40
    assert opt.RowWiseAdagrad(0.1, initial_accumulator_value=0.1, epsilon=1e-40).epsilon == 1e-40


@pytest.mark.parametrize("make", [lambda: opt.SGD(learning_rate=None), lambda: opt.SGD(learning_rate=[0.1]),
                                  lambda: opt.Adam(beta_1=True), lambda: opt.FTRL(beta="x")])
def test_optimizer_hyper_parameters_of_wrong_type(make):
    with pytest.raises(TypeError):
        make()


@pytest.mark.parametrize("make,field", [
    (lambda v: opt.Adam(0.1, lazy_adam=v), "lazy_adam"),
    (lambda v: opt.Adam(0.1, sum_inside_sqrt=v), "sum_inside_sqrt"),
    (lambda v: opt.Adam(0.1, bias_correction=v), "bias_correction"),
    (lambda v: opt.SGD(0.1, multiply_weight_decay_factor_by_learning_rate=v),
     "multiply_weight_decay_factor_by_learning_rate"),
    (lambda v: opt.FTRL(0.1, multiply_linear_by_learning_rate=v), "multiply_linear_by_learning_rate")])
def test_optimizer_flags_must_be_bools(make, field):
    """"False" was true (bool("False")), the opposite of its word; an array
    raised NumPy's "truth value ... is ambiguous"."""
    for bad in ("False", 1, np.array([True, False]), None):
        with pytest.raises(TypeError, match=rf"{field} must be a bool, got "):
            make(bad)
    assert getattr(make(np.bool_(False)), field) is False and getattr(make(True), field) is True


def test_config_values_taken_as_their_names_or_refused():
    """Zeros() takes no arguments (Zeros(0.5) was taken and ignored);
    TableConfig's dtype may be a NumPy dtype (it equals the name), kept as
    the name (it was kept as the dtype, which the engine then refused);
    sharding= without world= shards nothing (a misspelt plan was ignored)."""
    with pytest.raises(TypeError):
        ec.initializers.Zeros(0.5)
    with pytest.raises(TypeError):
        ec.initializers.Zeros(seed=3)
    config = ec.TableConfig("t", rows=4, dim=2, dtype=np.dtype("float16"))
    assert config.dtype == "float16" and type(config.dtype) is str and ec.Table(config).dtype == "float16"
    feature = {"f": ec.FeatureConfig(ec.TableConfig("t", rows=4, dim=2))}
    for bad in ("rowwise", "row_wise", {"t": "row_wise"}):
        with pytest.raises(TypeError, match=r"Embedding: sharding=.* applies over ranks: pass world= too"):
            ec.Embedding(feature, sharding=bad)
    ec.Embedding(feature, sharding=None)  # (make_plan's "auto" too)


# ----------------------------------------------------------------- memory shared with outputs or the table
def test_out_sharing_memory_with_an_input_is_refused(trained):
    """A lookup writing over its own ids, offsets or weights would read what
    it wrote (a crash, or wrong sums): refused before anything is written."""
    buf = np.zeros(2 * 4, np.float32)
    out = buf.reshape(2, 4)
    ids = buf.view(np.int32)[:4]
    ids[:] = [1, 2, 3, 4]
    offsets = np.array([0, 2, 4])
    s = snapshot(trained)
    with pytest.raises(ValueError, match="out shares memory with ids: pass a separate output array"):
        trained.lookup(ids, offsets, out=out, combiner="sum")
    np.testing.assert_array_equal(ids, [1, 2, 3, 4])  # not overwritten
    w = np.ones(8, np.float32)
    with pytest.raises(ValueError, match="out shares memory with weights"):
        trained.lookup(np.arange(8), np.array([0, 4, 8]), weights=w, out=w.reshape(2, 4), combiner="sum")
    off = np.zeros(8, np.int64)
    off[:3] = [0, 1, 2]
    with pytest.raises(ValueError, match="out shares memory with offsets"):
        trained.lookup(np.array([1, 2]), off[:3], out=off.view(np.float32)[:8].reshape(2, 4), combiner="sum")
    assert_unchanged(trained, s)
    # Separate arrays are fine.
    assert trained.lookup(ids.copy(), offsets, out=np.zeros((2, 4), np.float32), combiner="sum").shape == (2, 4)


def test_step_inputs_viewing_the_table_are_refused(trained):
    """Gradients that view the values (or a slot) being updated would make the
    step depend on the order rows are written in, hence on the thread count."""
    s = snapshot(trained)
    with pytest.raises(ValueError, match="grads overlaps the values of table 'clicks' that the step updates: "
                                         "pass a copy"):
        trained.apply_gradients(np.arange(5), grads=trained.values()[1:6])
    with pytest.raises(ValueError, match="grads overlaps a slot of table 'clicks'"):
        trained.apply_gradients(np.arange(5), grads=trained.slots()["momenta"][2:7])
    assert_unchanged(trained, s)
    trained.apply_gradients(np.arange(5), grads=trained.values()[1:6].copy())  # a copy is fine
    assert trained.step == 2


def test_an_output_too_large_to_exist_is_a_value_error(trained):
    s = snapshot(trained)
    with pytest.raises(ValueError, match="max_sequence_length 4611686018427387904, dim 4\\) would not fit in memory"):
        trained.lookup(np.array([1, 2, 3]), np.array([0, 1, 3]), combiner=None, max_sequence_length=2**62)
    with pytest.raises(ValueError, match="max_sequence_length must be >= 0, got -5"):
        trained.lookup(np.array([1, 2, 3]), np.array([0, 1, 3]), combiner="sum", max_sequence_length=-5)
    assert_unchanged(trained, s)


def test_embedding_steps_on_the_ids_it_looked_up():
    """The caller may reuse its id buffers between the lookup and the step:
    the step applies to the ids that were looked up, to every table or none."""
    a = ec.TableConfig("a", rows=10, dim=3, initializer=ec.initializers.Zeros())
    b = ec.TableConfig("b", rows=10, dim=3, initializer=ec.initializers.Zeros())
    emb = ec.Embedding({"s": ec.FeatureConfig(b), "u": ec.FeatureConfig(a)}, ec.optimizers.SGD(1.0))
    feats = {"s": np.array([1, 2]), "u": np.array([3, 4])}
    out = emb(feats)
    feats["u"][:] = [1000, 7]  # out of range, and in range: neither may be what the step uses
    emb.apply_gradients({k: np.ones_like(v) for k, v in out.items()})
    ta, tb = emb.embedding_tables[a].to_numpy(), emb.embedding_tables[b].to_numpy()
    assert np.array_equal(np.nonzero(ta.any(1))[0], [3, 4]) and np.array_equal(np.nonzero(tb.any(1))[0], [1, 2])


def test_serving_output_too_large_is_a_value_error(tmp_path, trained):
    ec.save(tmp_path / "ck", trained)
    served = ec.serving.open(tmp_path / "ck")
    t = served.embedding_tables["clicks"]
    with pytest.raises(ValueError, match="would not fit in memory"):
        t.lookup(np.array([1]), np.array([0, 1]), combiner=None, max_sequence_length=2**62)


def test_slot_values_an_optimizer_cannot_use_are_refused(trained):
    """Slots must be finite, and those the optimizer takes the square root of
    (Adagrad's accumulators, Adam's velocities) non-negative."""
    s = snapshot(trained)
    with pytest.raises(ValueError,
                       match=r"slot velocities values\[0, 1\] = -1 \(table row 0\) is not >= 0 \(the step divides"):
        trained.assign_slot("velocities", np.array([[0.0, -1.0, 0.0, 0.0]], np.float32))
    with pytest.raises(ValueError, match=r"slot momenta values\[0, 2\] = nan \(table row 0\) is not finite"):
        trained.assign_slot("momenta", np.array([[0.0, 1.0, np.nan, 0.0]], np.float32))
    assert_unchanged(trained, s)
    trained.assign_slot("momenta", np.array([[0.0, -1.0, 0.5, 0.0]], np.float32))  # momenta may be negative


_NORMAL = ">= 1.17549435e-38"  # the smallest normal float32: a subnormal is 0 where subnormals are flushed


@pytest.mark.parametrize("optimizer, slot, refused, bound, why", [
    (opt.Adagrad(0.1), "accumulators", 0.0, _NORMAL, "with epsilon 0 .or subnormal, flushed to 0. the step divides"),
    (opt.Adagrad(0.1), "accumulators", 1e-40, _NORMAL, "with epsilon 0 .or subnormal, flushed to 0. the step divides"),
    (opt.RowWiseAdagrad(0.1, epsilon=0.0, initial_accumulator_value=0.1), "row_accumulators", 0.0, _NORMAL,
     "with epsilon 0 .or subnormal, flushed to 0. the step divides"),
    (opt.RowWiseAdagrad(0.1, epsilon=1e-40, initial_accumulator_value=0.1), "row_accumulators", 0.0, _NORMAL,
     "with epsilon 0 .or subnormal, flushed to 0. the step divides"),
    (opt.FTRL(0.1), "accumulators", 0.0, _NORMAL, "FTRL divides by a power of the accumulator"),
    (opt.FTRL(0.1), "accumulators", 1e-40, _NORMAL, "FTRL divides by a power of the accumulator"),
    (opt.Adagrad(0.1, epsilon=1e-10), "accumulators", -1e-30, ">= 0", "the step divides by its square root"),
])
def test_accumulators_of_0_are_refused_where_the_step_would_divide_0_by_0(tmp_path, optimizer, slot, refused, bound,
                                                                          why):
    """An accumulator of 0 is refused wherever the optimizer's constructor
    refuses initial_accumulator_value=0: a zero gradient element (a weight of
    0, a feature outside the loss) would step the weight by 0 / 0 (NaN). The
    same state through assign_slot and through a checkpoint load is refused,
    naming the slot, and changes nothing; values alone still load."""
    t = make_table(6, 4, optimizer=optimizer, name="t")
    cols = t._native.slot_dim
    s = snapshot(t)
    bad = np.full((2, cols), 0.5, np.float32)
    bad[1, cols - 1] = refused
    text = "%.9g" % np.float32(refused)  # as the engine prints a float32
    with pytest.raises(ValueError, match=f"table 't': slot {slot} values\\[1, {cols - 1}\\] = {text} \\(table row 1\\) "
                                         f"is not {re.escape(bound)} \\({why}"):
        t.assign_slot(slot, bad)
    assert_unchanged(t, s)

    # A checkpoint holding such a value (written into the engine's memory, as a bug or another writer might).
    src = make_table(6, 4, optimizer=optimizer, name="t", seed=5)
    dict(src._native.slots_mut())[slot][3, cols - 1] = refused
    ec.save(tmp_path / "ck", src)
    with pytest.raises(ec.CheckpointError, match=f"table 't' slot {slot} hold {text} at row 3, column "
                                                 f"{cols - 1}; the target table's optimizer needs them "
                                                 f"{re.escape(bound)}"):
        ec.load(tmp_path / "ck", into=t)
    assert_unchanged(t, s)
    ec.load(tmp_path / "ck", into=t, include_optimizer=False)
    np.testing.assert_array_equal(t.to_numpy(), src.to_numpy())


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("array", ["values", "accumulators"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_a_checkpoint_holding_a_value_that_is_not_finite_loads_nothing(tmp_path, bad, array, dtype):
    """A writer stores finite values and slots only (`embedcore verify` calls
    a checkpoint that holds NaN or infinity corrupt). One whose checksums
    were sealed over such a value (another writer, a forged file) is refused
    by a load, naming the table, the array, the value and where it is, with
    the table left as it was: loaded, the table could not be saved again.
    Without its optimizer state, a checkpoint whose bad value is in a slot
    loads its values."""
    import test_checkpoint_forge as forge

    src = make_table(6, 4, optimizer=opt.Adagrad(0.1), name="t", seed=5)
    ec.save(tmp_path / "ck", src)
    m = forge.read_manifest(tmp_path / "ck")
    entry = m["tables"][0]["values"][0] if array == "values" else m["tables"][0]["slots"][array][0]
    path = tmp_path / "ck" / entry["path"]
    blob = bytearray(open(path, "rb").read())
    at = forge.DATA_OFFSET + (3 * 4 + 1) * 4  # row 3, column 1 of a float32 file
    blob[at:at + 4] = np.float32(bad).tobytes()
    open(path, "wb").write(bytes(blob))
    entry["crc32c"] = forge.payload_crcs(bytes(blob[forge.DATA_OFFSET:]))
    forge.write_manifest(tmp_path / "ck", m)

    t = make_table(6, 4, optimizer=opt.Adagrad(0.1), name="t", dtype=dtype)
    s = snapshot(t)
    what = "values" if array == "values" else f"slot {array}"
    text = {"nan": "nan", "inf": "inf", "-inf": "-inf"}[str(np.float32(bad))]
    with pytest.raises(ec.CheckpointError, match=f"table 't' {what} hold {text} at row 3, column 1: a checkpoint "
                                                 "holds finite values only"):
        ec.load(tmp_path / "ck", into=t)
    assert_unchanged(t, s)
    from embedcore import cli
    assert cli.main(["verify", str(tmp_path / "ck")]) == 1  # (what `embedcore verify` says of it)
    if array == "values":
        with pytest.raises(ec.CheckpointError, match=f"table 't' values hold {text} at row 3"):
            ec.load(tmp_path / "ck", into=t, include_optimizer=False)
        assert_unchanged(t, s)
    else:
        ec.load(tmp_path / "ck", into=t, include_optimizer=False)
        np.testing.assert_array_equal(t.to_numpy(), src.to_numpy().astype(dtype).astype(np.float32))


def test_a_checkpoint_whose_accumulators_start_at_0_loads_only_where_epsilon_allows(tmp_path):
    """PyTorch's Adagrad (accumulators from 0, eps 1e-10) saved, then loaded
    into TensorFlow's (epsilon 0): refused, where it used to load and turn
    every zero gradient element into NaN. Into an optimizer with epsilon > 0
    it loads, and trains as the table it came from."""
    torch_like = opt.Adagrad(0.1, initial_accumulator_value=0.0, epsilon=1e-10)
    src = make_table(4, 2, optimizer=torch_like, name="t")
    grads = np.array([[0.0, 1e-30], [0.5, 0.0]], np.float32)
    ec.save(tmp_path / "ck", src)
    tf_like = make_table(4, 2, optimizer=opt.Adagrad(0.1), name="t")
    with pytest.raises(ec.CheckpointError,
                       match="slot accumulators hold 0 at row 0, column 0.*needs them >= 1.17549435e-38"):
        ec.load(tmp_path / "ck", into=tf_like)
    same = make_table(4, 2, optimizer=torch_like, name="t", seed=9)
    ec.load(tmp_path / "ck", into=same)
    for t in (src, same):
        t.apply_gradients(np.array([0, 1]), np.array([0, 1, 2]), grads)
    np.testing.assert_array_equal(same.to_numpy(), src.to_numpy())
    assert np.isfinite(same.to_numpy()).all()
