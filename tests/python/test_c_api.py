"""libembedcore, the C inference API, as installed with the package: loaded
with ctypes (any FFI can use the C ABI), its lookups compared bit for bit
with ``embedcore.serving`` on random batches of every kind, its errors, hot
reload from several threads, and the symbols it exports (only embedcore_*).

The C and C++ programs of examples/c_inference are built and checked by
test_c_api_example.py; the C ABI's own tests (every error case, the reload
stress test, under the sanitizers in CI) are tests/cpp/c_api_*_test.cc.
"""
from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

import embedcore as ec

ENV = dict(os.environ, SKBUILD_EDITABLE_VERBOSE="0")
OK, INVALID_ARGUMENT, OUT_OF_RANGE, CHECKPOINT_ERROR = 0, 1, 2, 3
COMBINERS = {"sum": 0, "mean": 1, "sqrtn": 2, None: 3}


class Batch(ctypes.Structure):
    _fields_ = [("ids", ctypes.c_void_p), ("offsets", ctypes.c_void_p), ("weights", ctypes.c_void_p),
                ("nnz", ctypes.c_int64), ("num_bags", ctypes.c_int64), ("id_type", ctypes.c_int32),
                ("reserved", ctypes.c_int32)]


class TableInfo(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("rows", ctypes.c_int64), ("dim", ctypes.c_int64),
                ("dtype", ctypes.c_int32), ("combiner", ctypes.c_int32)]


class FeatureInfo(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("table", ctypes.c_int64), ("max_sequence_length", ctypes.c_int64)]


def _cmake_dir() -> Path:
    proc = subprocess.run([sys.executable, "-m", "embedcore", "--cmake-dir"], capture_output=True, text=True,
                          env=ENV, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return Path(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def libpath() -> Path:
    path = _cmake_dir().parents[2] / "lib" / "libembedcore.so"
    assert path.is_file(), path
    return path


@pytest.fixture(scope="module")
def lib(libpath):
    lib = ctypes.CDLL(str(libpath))
    P, I64, I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
    lib.embedcore_last_error.restype = ctypes.c_char_p
    lib.embedcore_version.restype = ctypes.c_char_p
    sigs = {
        "embedcore_build_info": [ctypes.POINTER(ctypes.c_char_p)],
        "embedcore_open": [ctypes.c_char_p, ctypes.c_char_p, ctypes.POINTER(P)],
        "embedcore_reload": [P, ctypes.c_char_p, ctypes.c_char_p],
        "embedcore_close": [P],
        "embedcore_checkpoint_generation": [P, ctypes.POINTER(ctypes.c_uint64)],
        "embedcore_num_tables": [P, ctypes.POINTER(I64)],
        "embedcore_num_features": [P, ctypes.POINTER(I64)],
        "embedcore_describe_table": [P, I64, ctypes.POINTER(TableInfo)],
        "embedcore_describe_feature": [P, I64, ctypes.POINTER(FeatureInfo)],
        "embedcore_lookup": [P, I64, ctypes.POINTER(Batch), I32, I64, P, I64],
        "embedcore_lookup_feature": [P, I64, ctypes.POINTER(Batch), P, I64],
    }
    for name, args in sigs.items():
        getattr(lib, name).argtypes = args
        getattr(lib, name).restype = ctypes.c_int
    return lib


class Handle:
    def __init__(self, lib, path, options=None):
        self.lib = lib
        self.h = ctypes.c_void_p()
        status = lib.embedcore_open(os.fspath(path).encode(), options and options.encode(), ctypes.byref(self.h))
        if status != OK:
            raise RuntimeError(f"{status}: {lib.embedcore_last_error().decode()}")

    def close(self):
        assert self.lib.embedcore_close(self.h) == OK
        self.h = None

    def lookup(self, table, ids, offsets, weights=None, combiner=-1, length=0, feature=None):
        """(status, output or message)."""
        ids = np.ascontiguousarray(ids)
        offsets = np.ascontiguousarray(offsets, np.int64)
        b = Batch(ids.ctypes.data, offsets.ctypes.data, None if weights is None else weights.ctypes.data, len(ids),
                  len(offsets) - 1, 0 if ids.dtype == np.int32 else 1, 0)
        info = TableInfo()
        assert self.lib.embedcore_describe_table(self.h, table, ctypes.byref(info)) == OK
        bags = len(offsets) - 1
        if combiner != 3:
            shape = (bags, info.dim)
        else:
            shape = (bags, length, info.dim) if length else (len(ids), info.dim)
        out = np.full(shape, np.nan, np.float32)
        if feature is not None:
            status = self.lib.embedcore_lookup_feature(self.h, feature, ctypes.byref(b), out.ctypes.data, out.size)
        else:
            status = self.lib.embedcore_lookup(self.h, table, ctypes.byref(b), combiner, length, out.ctypes.data,
                                               out.size)
        return (status, out) if status == OK else (status, self.lib.embedcore_last_error().decode())


def _model(path, seed=0, rows=(20000, 3000, 500)):
    """user (float32, 20000 x 64: two 4 MiB checksum blocks), item (bfloat16), query (float16)."""
    user = ec.TableConfig("user", rows[0], 64, "float32", ec.initializers.Uniform(-1, 1, seed=seed + 1), combiner="sum")
    item = ec.TableConfig("item", rows[1], 8, "bfloat16", ec.initializers.Uniform(-1, 1, seed=seed + 2))
    query = ec.TableConfig("query", rows[2], 12, "float16", ec.initializers.Uniform(-1, 1, seed=seed + 3),
                           combiner="sqrtn")
    emb = ec.Embedding({"user": ec.FeatureConfig(user, name="user"), "item": ec.FeatureConfig(item, name="item"),
                        "history": ec.FeatureConfig(item, max_sequence_length=4, name="history"),
                        "query": ec.FeatureConfig(query, name="query")})
    ec.save(path, emb, include_optimizer=False)
    return emb


def _batch(rng, rows, bags, max_len):
    lengths = rng.integers(0, max_len + 1, bags)
    offsets = np.zeros(bags + 1, np.int64)
    offsets[1:] = np.cumsum(lengths)
    ids = rng.integers(0, rows, offsets[-1]).astype(np.int64)
    weights = rng.uniform(0.1, 2.0, offsets[-1]).astype(np.float32)
    return ids, offsets, weights


def test_version_and_build_info(lib):
    assert lib.embedcore_version().decode() == ec.__version__
    out = ctypes.c_char_p()
    assert lib.embedcore_build_info(ctypes.byref(out)) == OK
    info = json.loads(out.value)
    assert info["version"] == ec.__version__ and info["c_abi_version"] == 1
    assert tuple(info["format_version"]) == tuple(ec.FORMAT_VERSION)
    assert info["simd"] == ec.build_info()["simd"]


def test_lookups_equal_python_serving(lib, tmp_path, rng):
    path = tmp_path / "m"
    _model(path)
    srv = ec.serving.open(path)
    h = Handle(lib, path)
    n = ctypes.c_int64()
    assert lib.embedcore_num_tables(h.h, ctypes.byref(n)) == OK and n.value == 3
    names = []
    for t in range(3):
        info = TableInfo()
        assert lib.embedcore_describe_table(h.h, t, ctypes.byref(info)) == OK
        served = srv.tables[info.name.decode()]
        assert (info.rows, info.dim) == (served.rows, served.dim)
        assert ["float32", "float16", "bfloat16"][info.dtype] == served.dtype
        assert {0: "sum", 1: "mean", 2: "sqrtn"}[info.combiner] == served.config.combiner
        names.append(served.name)
    for t, name in enumerate(names):
        served = srv.tables[name]
        for trial in range(3):
            ids, offsets, weights = _batch(rng, served.rows, 1 + 50 * trial, 20)
            for id_dtype in (np.int64, np.int32):
                x = ids.astype(id_dtype)
                for combiner in ("sum", "mean", "sqrtn", None):
                    for w in (None, weights):
                        for length in ((0, 3) if combiner is None else (0,)):
                            want = served.lookup(x, offsets, w, combiner=combiner, max_sequence_length=length)
                            status, got = h.lookup(t, x, offsets, w, COMBINERS[combiner], length)
                            assert status == OK, got
                            assert got.shape == want.shape
                            assert got.tobytes() == want.tobytes(), (name, combiner, length, w is None, id_dtype)
    # Features: the served checkpoint called on each.
    assert lib.embedcore_num_features(h.h, ctypes.byref(n)) == OK and n.value == 4
    for f in range(4):
        info = FeatureInfo()
        assert lib.embedcore_describe_feature(h.h, f, ctypes.byref(info)) == OK
        name = info.name.decode()
        table = srv.tables[names[info.table]]
        ids, offsets, weights = _batch(rng, table.rows, 17, 6)
        inputs = {k: ec.Ragged(np.zeros(1, np.int64), np.array([0, 1])) for k in ("user", "item", "history", "query")}
        inputs[name] = ec.Ragged(ids, offsets)
        want = srv(inputs, {k: (ec.Ragged(weights, offsets) if k == name else None) for k in inputs})[name]
        combiner, length = (3, info.max_sequence_length) if info.max_sequence_length else (-1, 0)
        status, got = h.lookup(info.table, ids, offsets, weights, combiner, length, feature=f)
        assert status == OK, got
        assert got.tobytes() == np.ascontiguousarray(want).tobytes(), name
    h.close()


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_padding_idx_of_a_torch_module_is_left_out_of_bags(lib, tmp_path, rng, mode):
    """A PyTorch EmbeddingBag(padding_idx=...) saved with ec.save: the C
    lookups give the module's (and torch.nn.EmbeddingBag's) bags, without the
    padding id; per-id lookups give its row, as torch.nn.Embedding."""
    torch = pytest.importorskip("torch")
    import embedcore.adapters.torch as et

    W = torch.from_numpy(rng.uniform(-1, 1, (30, 8)).astype(np.float32))  # padding row 3 is not zero
    bag = et.EmbeddingBag.from_pretrained(W, mode=mode, padding_idx=3, include_last_offset=True, name="emb")
    ref = torch.nn.EmbeddingBag.from_pretrained(W, mode=mode, padding_idx=3, include_last_offset=True)
    ec.save(tmp_path / "m", bag)
    h = Handle(lib, tmp_path / "m")
    ids, offsets, weights = _batch(rng, 30, 40, 8)
    ids[::3] = 3
    ids[offsets[5]:offsets[6]] = 3
    for w in (None, weights) if mode == "sum" else (None,):  # PyTorch's per_sample_weights: sum only
        status, got = h.lookup(0, ids, offsets, w)
        assert status == OK, got
        tw = None if w is None else torch.from_numpy(w)
        want = bag(torch.from_numpy(ids), torch.from_numpy(offsets), tw).detach().numpy()
        assert got.tobytes() == want.tobytes()
        np.testing.assert_allclose(got, ref(torch.from_numpy(ids), torch.from_numpy(offsets), tw).numpy(),
                                   rtol=1e-6, atol=1e-6)
    status, got = h.lookup(0, ids, offsets, combiner=COMBINERS[None])
    assert status == OK, got
    np.testing.assert_array_equal(got, W.numpy()[ids])
    h.close()


def test_errors_through_ctypes(lib, tmp_path):
    path = tmp_path / "m"
    _model(path, rows=(100, 50, 20))
    h = ctypes.c_void_p()
    assert lib.embedcore_open(None, None, ctypes.byref(h)) == INVALID_ARGUMENT
    assert lib.embedcore_last_error().decode() == "embedcore_open: path: null pointer"
    assert lib.embedcore_open(str(tmp_path / "nope").encode(), None, ctypes.byref(h)) == CHECKPOINT_ERROR
    assert "no such checkpoint directory" in lib.embedcore_last_error().decode()
    assert h.value is None
    served = Handle(lib, path)
    status, message = served.lookup(0, np.array([1, 100], np.int64), np.array([0, 2]), combiner=0)
    assert status == OUT_OF_RANGE
    assert message == "embedcore_lookup: table 'item': id 100 at position 1 of ids is out of range [0, 50)"
    status, message = served.lookup(0, np.array([1, 2], np.int64), np.array([0, 3]), combiner=0)
    assert status == INVALID_ARGUMENT and "offsets must end at the number of ids, 2" in message
    # The last error is the calling thread's.
    seen = []
    t = threading.Thread(target=lambda: seen.append(lib.embedcore_last_error()))
    t.start()
    t.join()
    assert seen == [b""]
    served.close()


def test_hot_reload_from_threads(lib, tmp_path):
    """Python threads looking up through ctypes (the GIL is released in C
    calls) while another thread swaps the checkpoint: every result is one
    checkpoint's, whole."""
    a, b = tmp_path / "a", tmp_path / "b"
    _model(a, seed=0, rows=(500, 300, 100))
    _model(b, seed=10, rows=(500, 300, 100))
    rng = np.random.default_rng(0)
    batches = [_batch(rng, 100, 64, 8) for _ in range(4)]
    expected = []
    for ids, offsets, weights in batches:
        expected.append([ec.serving.open(p).tables["query"].lookup(ids, offsets, weights).tobytes() for p in (a, b)])
    h = Handle(lib, a)
    info = TableInfo()
    table = next(t for t in range(3) if lib.embedcore_describe_table(h.h, t, ctypes.byref(info)) == OK
                 and info.name == b"query")
    stop = threading.Event()
    results = {"a": 0, "b": 0, "bad": 0}
    lock = threading.Lock()

    # The reloads begin once every reader has looked up once (a reader that fails first breaks the barrier).
    started = threading.Barrier(5, timeout=120)

    def reader(k):
        i = k
        try:
            while i == k or not stop.is_set():
                ids, offsets, weights = batches[i % 4]
                status, got = h.lookup(table, ids, offsets, weights)
                key = "bad" if status != OK else ("a" if got.tobytes() == expected[i % 4][0] else
                                                  "b" if got.tobytes() == expected[i % 4][1] else "bad")
                with lock:
                    results[key] += 1
                if i == k:
                    started.wait()
                i += 1
        except BaseException:
            started.abort()
            raise

    threads = [threading.Thread(target=reader, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    try:
        started.wait()
        for i in range(40):
            assert lib.embedcore_reload(h.h, str(b if i % 2 == 0 else a).encode(), None) == OK
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert results["bad"] == 0, results
    h.close()


def test_reloads_the_dumps_of_a_saver_loop(lib, tmp_path):
    """SOK's way of saving: each variable dumped in turn (Saver.dump_to_file)
    into the directory a C server serves; every new dump keeps the tables in
    their order, so embedcore_reload(NULL) takes it and serves the new rows."""
    d = tmp_path / "dump"
    saver = ec.Saver()

    def dump(name, value):
        saver.dump_to_file(ec.Table(name=name, rows=10, dim=4, initializer=ec.initializers.Constant(value)), d)

    dump("A", 1.0)
    dump("B", 2.0)
    h = Handle(lib, d)
    ids, offsets = np.array([3], np.int64), np.array([0, 1])
    for name, value in (("B", 3.0), ("A", 4.0), ("B", 5.0)):
        dump(name, value)
        assert lib.embedcore_reload(h.h, None, None) == OK, lib.embedcore_last_error().decode()
        table = 0 if name == "A" else 1
        status, got = h.lookup(table, ids, offsets)
        assert status == OK and (got == value).all(), (name, got)
    h.close()


def test_exports_only_the_c_abi(libpath):
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm is not installed")
    out = subprocess.run([nm, "-D", "--defined-only", str(libpath)], capture_output=True, text=True, check=True).stdout
    names = [m.group(2) for m in re.finditer(r"^[0-9a-fA-F]+ ([A-Za-z]) (\S+)$", out, re.M) if m.group(1) != "A"]
    header = (libpath.parents[1] / "include" / "embedcore" / "c_api.h").read_text()
    declared = set(re.findall(r"EMBEDCORE_C_API [^;(]*?\b(embedcore_\w+)\(", header))
    assert declared and len(declared) >= 18
    assert [n for n in names if not n.startswith("embedcore_")] == []
    assert set(n.split("@")[0] for n in names) == declared


def test_cmake_dir_flag():
    proc = subprocess.run([sys.executable, "-m", "embedcore", "--cmake-dir"], capture_output=True, text=True,
                          env=ENV, timeout=600)
    assert proc.returncode == 0, proc.stderr
    d = Path(proc.stdout.strip().splitlines()[-1])
    assert d.name == "embedcore" and d.parent.name == "cmake" and (d / "embedcoreConfig.cmake").is_file()
    assert "--cmake-dir" in subprocess.run([sys.executable, "-m", "embedcore", "--help"], capture_output=True,
                                           text=True, env=ENV, timeout=600).stdout


@pytest.mark.parametrize("plan", ["row_wise", "column_wise"])
def test_serves_a_sharded_checkpoint(lib, tmp_path, rng, plan):
    """A checkpoint saved by 3 ranks (several files per table) serves through
    the C API as it is, with the unsharded table's results, bit for bit."""
    from embedcore.distributed import run_local

    emb = _model(tmp_path / "whole")

    def fn(world):
        sharded = ec.Embedding(emb.feature_config, world=world, sharding=plan)
        ec.load(tmp_path / "whole", into=sharded)
        ec.save(tmp_path / "sharded", sharded, include_optimizer=False)

    run_local(3, fn)
    manifest = json.loads(ec.checkpoint.read_info(tmp_path / "sharded").manifest_json)
    assert all(len(t["values"]) == 3 for t in manifest["tables"])
    h = Handle(lib, tmp_path / "sharded")
    srv = ec.serving.open(tmp_path / "whole")
    for t in range(3):
        info = TableInfo()
        assert lib.embedcore_describe_table(h.h, t, ctypes.byref(info)) == OK
        served = srv.tables[info.name.decode()]
        ids, offsets, weights = _batch(rng, served.rows, 40, 12)
        for combiner in ("sum", "mean", "sqrtn", None):
            want = served.lookup(ids, offsets, weights, combiner=combiner)
            status, got = h.lookup(t, ids, offsets, weights, COMBINERS[combiner])
            assert status == OK, got
            assert got.tobytes() == want.tobytes(), (info.name, combiner)
    h.close()
