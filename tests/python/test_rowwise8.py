"""Checkpoints of 8-bit row-wise quantized values (values_dtype="uint8_rowwise",
format 1.4): FBGEMM's Fused8BitRowwise layout and rounding, bit for bit;
served memory-mapped with the rows dequantized inside the lookup; loaded
into tables of any dtype; refused where they cannot be kept as stored."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import embedcore as ec
from embedcore import _embedcore
from test_checkpoint_forge import DATA_OFFSET, HEADER_BYTES, read_manifest, unpack_header, write_manifest

torch = pytest.importorskip("torch")
pytest.importorskip("fbgemm_gpu")


def fbgemm_quantize(values: np.ndarray) -> np.ndarray:
    """[rows, dim + 8] uint8: FBGEMM's rows of codes, scale and bias."""
    return torch.ops.fbgemm.FloatToFused8BitRowwiseQuantized(torch.from_numpy(np.ascontiguousarray(values))).numpy()


def fbgemm_dequantize(rows: np.ndarray) -> np.ndarray:
    return torch.ops.fbgemm.Fused8BitRowwiseQuantizedToFloat(torch.from_numpy(np.ascontiguousarray(rows))).numpy()


def table_with(values: np.ndarray, dtype: str = "float32", name: str = "t", combiner: str = "sum") -> ec.Table:
    t = ec.Table(name=name, rows=values.shape[0], dim=values.shape[1], dtype=dtype, combiner=combiner,
                 optimizer=ec.optimizers.Adagrad(0.1), initializer=ec.initializers.Zeros())
    t.assign(values, 0)
    return t


def payload(ckpt, table: str = "t") -> tuple:
    """The (header, payload bytes) of a table's single values file."""
    (entry,) = next(t for t in read_manifest(ckpt)["tables"] if t["name"] == table)["values"]
    with open(os.path.join(ckpt, entry["path"]), "rb") as f:
        raw = f.read()
    assert len(raw) == entry["bytes"]
    return unpack_header(raw[:HEADER_BYTES]), raw[DATA_OFFSET:], entry


def hard_rows(rng, dim: int) -> np.ndarray:
    """Rows of every kind the rounding must get right."""
    rows = [
        rng.standard_normal(dim),                               # random
        np.full(dim, 0.37),                                     # constant (max == min)
        np.zeros(dim),                                          # all zeros
        -rng.uniform(1, 5, dim),                                # negative
        rng.uniform(-1e30, 1e30, dim),                          # a large range
        rng.uniform(-3e37, 3e37, dim),                          # larger still
        1.0 + rng.uniform(0, 1e-6, dim),                        # a tiny range (below FBGEMM's epsilon's effect)
        rng.uniform(0, 1e-9, dim),                              # a range below the epsilon itself
        1e-40 * rng.integers(-5, 5, dim),                       # subnormals
        rng.integers(-3, 4, dim) * 0.25,                        # exact ties of the rounding
        np.linspace(-1, 1, dim),
        rng.standard_normal(dim) * 1e-3 + 100.0,
    ]
    return np.asarray(rows, dtype=np.float32)


@pytest.mark.parametrize("dim", [1, 2, 3, 7, 8, 13, 16, 37, 64, 130])
def test_the_file_holds_fbgemm_s_rows_bit_for_bit(tmp_path, rng, dim):
    values = np.concatenate([hard_rows(rng, dim), rng.standard_normal((300, dim)).astype(np.float32) * 3])
    t = table_with(values)
    ec.save(tmp_path / "c", t, values_dtype="uint8_rowwise")
    header, data, entry = payload(tmp_path / "c")
    expected = fbgemm_quantize(values)
    assert expected.shape == (values.shape[0], dim + 8)
    assert data == expected.tobytes()  # codes, scales and biases, bit for bit
    assert header["dtype"] == 3 and (header["rows"], header["cols"]) == (values.shape[0], dim)
    assert header["payload_bytes"] == values.shape[0] * (dim + 8)
    assert (header["major"], header["minor"]) == tuple(ec.FORMAT_VERSION) >= (1, 4)  # the dtype since 1.4
    assert entry["dtype"] == "uint8_rowwise" and entry["bytes"] == DATA_OFFSET + values.shape[0] * (dim + 8)
    assert entry["cols"] == dim and entry.get("col_start", 0) == 0
    manifest = read_manifest(tmp_path / "c")
    assert manifest["format_version"] == list(ec.FORMAT_VERSION) >= [1, 4]
    assert manifest["tables"][0]["dtype"] == "float32"
    # Served: values() is FBGEMM's dequantization, bit for bit.
    served = ec.serving.open(tmp_path / "c").tables["t"]
    assert served.dtype == "uint8_rowwise"
    v = served.values()
    assert v.dtype == np.float32 and v.shape == values.shape
    assert v.tobytes() == fbgemm_dequantize(expected).tobytes()


def test_zeros_of_both_signs_and_16_bit_tables(tmp_path, rng):
    # A row whose least value is a zero of both signs: FBGEMM's bias takes the sign its vector lanes meet first,
    # ours the first in column order (std::min_element's); the codes, scale and every value are the same.
    rows = np.array([[0.0, -0.0, 1.0, 2.0], [-0.0, 0.0, 3.0, 0.0], [5.0, -0.0, 0.0, -1.0]], np.float32)
    ec.save(tmp_path / "z", table_with(rows), values_dtype="uint8_rowwise")
    got = np.frombuffer(payload(tmp_path / "z")[1], np.uint8).reshape(3, 12)
    want = fbgemm_quantize(rows)
    np.testing.assert_array_equal(got[:, :8], want[:, :8])  # codes and scales, bit for bit
    np.testing.assert_array_equal(got[:, 8:].copy().view(np.float32), want[:, 8:].copy().view(np.float32))
    assert [np.signbit(got[r, 8:].copy().view(np.float32)[0]) for r in range(3)] == [False, True, True]
    # 16-bit tables quantize their values as float32 (exactly what they hold), as FBGEMM's half input does.
    values = rng.standard_normal((50, 24)).astype(np.float32)
    for dtype in ("float16", "bfloat16"):
        t = table_with(values, dtype)
        ec.save(tmp_path / dtype, t, values_dtype="uint8_rowwise")
        held = np.asarray(t.lookup(np.arange(50), combiner=None))
        assert payload(tmp_path / dtype)[1] == fbgemm_quantize(held).tobytes()
    if hasattr(torch.ops.fbgemm, "HalfToFused8BitRowwiseQuantized"):
        half = torch.from_numpy(values).half()
        assert (torch.ops.fbgemm.HalfToFused8BitRowwiseQuantized(half).numpy().tobytes() ==
                payload(tmp_path / "float16")[1])


def reference(deq: np.ndarray, ids, offsets, weights, combiner, q=None):
    """NumPy pooling of FBGEMM's dequantized rows (float64 sums); with the
    quantized rows `q`, also a bound on a float32 pooling's error: (n + 2)
    units of 2^-24 of the sum of the terms' magnitudes, w * scale * code
    and w * bias (the lookup adds those in float32)."""
    rows = deq[ids].astype(np.float64)
    w = np.ones(len(ids)) if weights is None else weights.astype(np.float64)
    dim = deq.shape[1]
    if q is not None:
        sb = q[:, dim:].copy().view(np.float32).astype(np.float64)[ids]
        mags = np.abs(w)[:, None] * (np.abs(sb[:, :1]) * q[ids, :dim] + np.abs(sb[:, 1:]))
    if combiner is None:
        out = (rows * w[:, None]).astype(np.float32)
        return out if q is None else (out, 4 * 2.0 ** -24 * mags)
    out, bound = np.zeros((len(offsets) - 1, dim)), np.zeros((len(offsets) - 1, dim))
    for b in range(len(offsets) - 1):
        k0, k1 = offsets[b], offsets[b + 1]
        s = (rows[k0:k1] * w[k0:k1, None]).sum(0)
        ws = w[k0:k1].astype(np.float32)  # summed in order in float32, as the engine sums them
        sum_w = ws.cumsum(dtype=np.float32)[-1] if k1 > k0 else np.float32(0)
        sum_w2 = (ws * ws).cumsum(dtype=np.float32)[-1] if k1 > k0 else np.float32(0)
        den = {"sum": 1.0, "mean": float(sum_w), "sqrtn": float(np.sqrt(sum_w2))}[combiner]
        out[b] = s / den if den != 0 else 0.0
        if q is not None and den != 0:
            bound[b] = (k1 - k0 + 3) * 2.0 ** -24 * mags[k0:k1].sum(0) / abs(den)
    return out.astype(np.float32) if q is None else (out.astype(np.float32), bound)


def close(got, want_and_bound):
    want, bound = want_and_bound
    assert got.shape == want.shape
    err = np.abs(got.astype(np.float64) - want)
    assert (err <= bound + 1e-30).all(), (err - bound).max()


@pytest.mark.parametrize("dim", [1, 5, 16, 33, 64, 200])
@pytest.mark.parametrize("verify", ["lazy", "eager", False])
def test_served_lookups_match_the_dequantized_table(tmp_path, rng, dim, verify):
    values = (rng.standard_normal((700, dim)) * rng.uniform(0.01, 10, (700, 1)) + rng.normal(0, 2, (700, 1)))
    values = values.astype(np.float32)
    ec.save(tmp_path / "c", table_with(values, combiner="mean"), values_dtype="uint8_rowwise")
    deq = fbgemm_dequantize(fbgemm_quantize(values))
    st = ec.serving.open(tmp_path / "c", verify=verify).tables["t"]
    ids = rng.integers(0, 700, 300)
    offsets = np.array([0, 0, 1, 50, 50, 120, 299, 300])
    weights = rng.uniform(-2, 2, 300).astype(np.float32)
    q = fbgemm_quantize(values)
    for combiner in ("sum", "mean", "sqrtn", None):
        for w in (None, weights):
            close(st.lookup(ids, offsets, w, combiner=combiner), reference(deq, ids, offsets, w, combiner, q))
    close(st.lookup(ids, offsets), reference(deq, ids, offsets, None, "mean", q))  # the table's combiner
    np.testing.assert_array_equal(st.lookup(ids.astype(np.int32), offsets), st.lookup(ids, offsets))
    # A row on its own is fma(scale, code, bias): FBGEMM's dequantized row, bit for bit.
    one = st.lookup(np.arange(700), combiner=None)
    assert one.tobytes() == deq.tobytes()
    np.testing.assert_array_equal(st.lookup(np.arange(700), combiner="sum"), one)
    dense = ids[:60].reshape(20, 3)
    seq = st.lookup(dense, combiner=None, max_sequence_length=4)
    assert seq.shape == (20, 4, dim) and not seq[:, 3].any()
    np.testing.assert_array_equal(seq[:, :3].reshape(60, dim), one[dense.reshape(-1)])
    ragged = st.lookup(ec.Ragged(ids, offsets), combiner="sum")
    np.testing.assert_array_equal(ragged, st.lookup(ids, offsets, combiner="sum"))
    sparse = st.lookup(ec.Sparse(indices=[[0, 0], [0, 1], [1, 0]], values=ids[:3], dense_shape=[2, 4]),
                       combiner="sum")
    np.testing.assert_array_equal(sparse, st.lookup(ids[:3], np.array([0, 2, 3]), combiner="sum"))
    out = np.empty((7, dim), np.float32)
    assert st.lookup(ids, offsets, combiner="sum", out=out) is out
    np.testing.assert_array_equal(out, st.lookup(ids, offsets, combiner="sum"))
    with pytest.raises(IndexError):
        st.lookup(np.array([700]))


@pytest.mark.parametrize("dim", [1, 3, 16, 33, 64, 128, 200])
def test_pooled_lookups_are_fbgemm_s_8_bit_bags_bit_for_bit(tmp_path, rng, dim):
    # FBGEMM's 8-bit bag kernel (PyTorch's quantized embedding_bag_byte_rowwise_offsets over FBGEMM's rows):
    # each id adds fma(w * scale, code, acc + w * bias), in order; so does every embedcore kernel set.
    values = (rng.standard_normal((500, dim)) * rng.uniform(0.01, 10, (500, 1)) + rng.normal(0, 2, (500, 1)))
    values = values.astype(np.float32)
    ec.save(tmp_path / "c", table_with(values), values_dtype="uint8_rowwise")
    st = ec.serving.open(tmp_path / "c").tables["t"]
    q = torch.from_numpy(fbgemm_quantize(values))
    ids = rng.integers(0, 500, 3000)
    offsets = np.sort(np.r_[0, rng.integers(0, 3000, 200), 3000])  # with empty bags
    for w in (None, rng.uniform(-2, 2, 3000).astype(np.float32)):
        want = torch.ops.quantized.embedding_bag_byte_rowwise_offsets(
            q, torch.from_numpy(ids), torch.from_numpy(offsets), False, 0, False,
            None if w is None else torch.from_numpy(w), None, True).numpy()
        got = st.lookup(ids, offsets, w, combiner="sum")
        assert got.tobytes() == want.tobytes(), np.abs(got - want).max()
    # One id with a weight: fma(w * scale, code, w * bias), as FBGEMM's bag of one.
    w1 = np.float32(-1.75)
    want = torch.ops.quantized.embedding_bag_byte_rowwise_offsets(
        q, torch.from_numpy(ids[:5]), torch.arange(6), False, 0, False, torch.full((5,), w1), None, True).numpy()
    got = st.lookup(ids[:5], weights=np.full(5, w1), combiner=None)
    assert got.tobytes() == want.tobytes()


_KERNEL_SCRIPT = """
import sys, numpy as np, embedcore as ec
st = ec.serving.open(sys.argv[1]).tables["t"]
rng = np.random.default_rng(3)
ids = rng.integers(0, 400, 5000); offsets = np.sort(np.r_[0, rng.integers(0, 5000, 300), 5000])
w = rng.uniform(-2, 2, 5000).astype(np.float32)
outs = [st.lookup(ids, offsets, w, combiner=c) for c in ("sum", "mean", "sqrtn")]
outs += [st.lookup(ids, offsets, combiner="sum"), st.lookup(ids, offsets, w, combiner=None),
         st.lookup(ids[:400].reshape(100, 4), weights=w[:400].reshape(100, 4), combiner=None, max_sequence_length=3)]
sys.stdout.write(ec.build_info()["simd"] + " " + str(hash(b"".join(np.ascontiguousarray(o).tobytes() for o in outs))))
"""


@pytest.mark.parametrize("dim", [3, 8, 16, 45, 128, 300])
def test_every_kernel_set_gives_the_same_bits(tmp_path, rng, dim):
    values = (rng.standard_normal((400, dim)) * 4).astype(np.float32)
    ec.save(tmp_path / "c", table_with(values), values_dtype="uint8_rowwise")
    env = {k: v for k, v in os.environ.items() if k != "EMBEDCORE_KERNELS"}
    results = {}
    for kernels in ("generic", "avx2", "avx512"):
        r = subprocess.run([sys.executable, "-c", _KERNEL_SCRIPT, str(tmp_path / "c")],
                           env=dict(env, EMBEDCORE_KERNELS=kernels, PYTHONHASHSEED="0"), capture_output=True,
                           text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        simd, digest = r.stdout.split()
        results[simd] = digest
    assert "generic" in results
    assert len(set(results.values())) == 1, results


def test_rows_that_cannot_be_quantized_fail_the_save_and_change_nothing(tmp_path, rng):
    values = rng.standard_normal((100, 6)).astype(np.float32)
    t = table_with(values, name="item")
    ec.save(tmp_path / "c", t, values_dtype="uint8_rowwise")
    before = sorted(os.listdir(tmp_path / "c"))
    with open(tmp_path / "c" / "MANIFEST", "rb") as f:
        manifest = f.read()
    for bad, match in [(np.nan, r"table 'item' values hold nan at row 42, column 3: a checkpoint holds finite "
                                r"values only"),
                       (np.inf, r"table 'item' values hold inf at row 42, column 3"),
                       (-np.inf, r"table 'item' values hold -inf at row 42, column 3")]:
        t2 = table_with(values, name="item")
        poke(t2, 42, 3, bad)  # (assign refuses it; training could leave it)
        with pytest.raises(ValueError, match=match):
            ec.save(tmp_path / "c", t2, values_dtype="uint8_rowwise")
        assert sorted(os.listdir(tmp_path / "c")) == before
        with open(tmp_path / "c" / "MANIFEST", "rb") as f:
            assert f.read() == manifest
    big = values.copy()
    big[17, :2] = [-3e38, 3e38]  # max - min overflows float32: no finite scale
    with pytest.raises(ValueError, match=r"table 'item' values row 17 spans a range \(max - min\) beyond float32"):
        ec.save(tmp_path / "c", table_with(big, name="item"), values_dtype="uint8_rowwise")
    assert sorted(os.listdir(tmp_path / "c")) == before
    with pytest.raises(ValueError, match="row 17"):  # a new directory is not left behind
        ec.save(tmp_path / "new", table_with(big, name="item"), values_dtype="uint8_rowwise")
    assert not os.path.exists(tmp_path / "new")
    np.testing.assert_array_equal(ec.serving.open(tmp_path / "c").tables["item"].values(),
                                  fbgemm_dequantize(fbgemm_quantize(values)))


def poke(table, row: int, col: int, value: float) -> None:
    """Writes one float32 value into a table's memory (as a diverged training step could leave it)."""
    import ctypes

    v = np.asarray(table.values())
    ctypes.memmove(v.ctypes.data + (row * v.shape[1] + col) * 4, np.float32(value).tobytes(), 4)
    assert np.asarray(table.values())[row, col].tobytes() == np.float32(value).tobytes()


def test_it_is_no_table_dtype_and_bad_values_dtypes_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"dtype must be one of \('float32', 'float16', 'bfloat16'\), got "
                                         r"'uint8_rowwise' \(an export format of checkpoints"):
        ec.Table(name="t", rows=4, dim=2, dtype="uint8_rowwise")
    t = table_with(np.ones((4, 2), np.float32))
    for bad in ("uint8", "int8", "UINT8_ROWWISE", 3):
        with pytest.raises(ValueError, match=r"values_dtype must be 'float32', 'float16', 'bfloat16' or "
                                             r"'uint8_rowwise'"):
            ec.save(tmp_path / "c", t, values_dtype=bad)
    assert not os.path.exists(tmp_path / "c")


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_a_load_dequantizes_into_the_table_s_dtype(tmp_path, rng, dtype):
    values = (rng.standard_normal((120, 10)) * 3).astype(np.float32)
    src = table_with(values)
    ec.save(tmp_path / "c", src, values_dtype="uint8_rowwise")
    deq = fbgemm_dequantize(fbgemm_quantize(values))
    target = table_with(np.zeros((120, 10), np.float32), dtype)
    ec.load(tmp_path / "c", target)
    expected = table_with(deq, dtype)  # the dequantized values, rounded to the table's dtype
    assert np.asarray(target.values()).tobytes() == np.asarray(expected.values()).tobytes()
    # Optimizer state too (slots stay float32); restore_from_file is the same load.
    src.apply_gradients(np.arange(5), None, np.ones((5, 10), np.float32))
    ec.save(tmp_path / "d", src, values_dtype="uint8_rowwise")
    other = table_with(np.zeros((120, 10), np.float32), dtype)
    assert ec.Saver().restore_from_file(other, tmp_path / "d") == "OK"
    np.testing.assert_array_equal(other.slots()["accumulators"], src.slots()["accumulators"])
    assert other.step == src.step


def test_a_load_refuses_values_beyond_the_target_dtype(tmp_path):
    values = np.array([[0.0, 70000.0], [1.0, 2.0]], np.float32)
    ec.save(tmp_path / "c", table_with(values, name="big"), values_dtype="uint8_rowwise")
    target = table_with(np.full((2, 2), 5, np.float32), "float16", name="big")
    with pytest.raises(ec.CheckpointError, match=r"table 'big' values \(uint8_rowwise\) at row 0, column 1 "
                                                 r"dequantize beyond the range of float16"):
        ec.load(tmp_path / "c", target)
    np.testing.assert_array_equal(np.asarray(target.values(), np.float32), np.full((2, 2), 5, np.float32))


def forge_scale(ckpt, row: int, scale: float) -> None:
    """Rewrites row `row`'s scale in the values file and re-seals its checksums."""
    manifest = read_manifest(ckpt)
    entry = manifest["tables"][0]["values"][0]
    path = os.path.join(ckpt, entry["path"])
    with open(path, "r+b") as f:
        f.seek(DATA_OFFSET + row * (entry["cols"] + 8) + entry["cols"])
        f.write(np.float32(scale).tobytes())
        f.seek(DATA_OFFSET)
        data = np.frombuffer(f.read(), np.uint8)
    bb = entry["block_bytes"]
    entry["crc32c"] = [_embedcore.crc32c(data[i:i + bb]) for i in range(0, len(data), bb)]
    write_manifest(ckpt, manifest)


def test_verify_and_load_refuse_scales_that_are_not_finite(tmp_path, rng):
    values = rng.standard_normal((50, 4)).astype(np.float32)
    ec.save(tmp_path / "c", table_with(values), values_dtype="uint8_rowwise")
    info = ec.checkpoint.read_info(tmp_path / "c")
    _embedcore.verify(info, True)
    forge_scale(tmp_path / "c", 31, np.nan)
    info = ec.checkpoint.read_info(tmp_path / "c")
    for check_finite in (False, True):
        with pytest.raises(ec.CheckpointError, match=r"uint8_rowwise row 31 has scale nan and bias .*; both must be "
                                                     r"finite"):
            _embedcore.verify(info, check_finite)
    r = subprocess.run([sys.executable, "-m", "embedcore", "verify", str(tmp_path / "c")], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode != 0 and "row 31 has scale nan" in r.stdout + r.stderr
    target = table_with(np.ones((50, 4), np.float32))
    with pytest.raises(ec.CheckpointError, match="row 31 has scale nan"):
        ec.load(tmp_path / "c", target)
    np.testing.assert_array_equal(target.values(), np.ones((50, 4), np.float32))


def test_a_reader_refuses_a_uint8_rowwise_file_that_is_not_whole_rows(tmp_path, rng):
    ec.save(tmp_path / "c", table_with(rng.standard_normal((10, 4)).astype(np.float32)),
            values_dtype="uint8_rowwise")
    manifest = read_manifest(tmp_path / "c")
    manifest["tables"][0]["dim"] = 5  # its file now holds 4 of 5 columns
    write_manifest(tmp_path / "c", manifest)
    with pytest.raises(ec.CheckpointError, match=r"values\[0\] is uint8_rowwise with columns \[0, 4\) of 5; a "
                                                 r"uint8_rowwise file holds whole rows"):
        ec.serving.open(tmp_path / "c")
    manifest["tables"][0]["dim"] = 4
    manifest["tables"][0]["dtype"] = "uint8_rowwise"  # never a table's dtype
    write_manifest(tmp_path / "c", manifest)
    with pytest.raises(ec.CheckpointError, match=r"tables\[0\].dtype has unknown dtype 'uint8_rowwise'"):
        ec.serving.open(tmp_path / "c")


def test_cli_inspect_and_verify(tmp_path, rng):
    ec.save(tmp_path / "c", table_with(rng.standard_normal((10, 4)).astype(np.float32)), values_dtype="uint8_rowwise")
    for cmd in ("inspect", "verify"):
        r = subprocess.run([sys.executable, "-m", "embedcore", cmd, str(tmp_path / "c")], capture_output=True,
                           text=True, timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
        if cmd == "inspect":
            assert "stored uint8_rowwise" in r.stdout


def test_a_dump_keeping_and_a_reshard_refuse_a_quantized_table(tmp_path, rng):
    values = rng.standard_normal((30, 4)).astype(np.float32)
    ec.save(tmp_path / "c", table_with(values, name="q"), values_dtype="uint8_rowwise")
    before = sorted(os.listdir(tmp_path / "c"))
    other = table_with(values, name="other")
    with pytest.raises(ec.CheckpointError, match=r"dump_to_file: .* holds table 'q' stored as uint8_rowwise"):
        ec.Saver().dump_to_file(other, tmp_path / "c")
    assert sorted(os.listdir(tmp_path / "c")) == before
    # Replacing the quantized table itself keeps nothing: a plain save.
    assert ec.Saver().dump_to_file(table_with(values, name="q"), tmp_path / "c") == "OK"
    ec.save(tmp_path / "c", table_with(values, name="q"), values_dtype="uint8_rowwise")
    from embedcore.distributed import reshard
    with pytest.raises(ec.CheckpointError, match=r"reshard: .* table 'q' is stored as uint8_rowwise"):
        reshard(tmp_path / "c", tmp_path / "d", 2)
    assert not os.path.exists(tmp_path / "d")


def test_sharded_saves_and_loads(tmp_path, rng):
    from embedcore import distributed as dist

    values = (rng.standard_normal((90, 12)) * 2).astype(np.float32)
    cfg = ec.TableConfig("t", rows=90, dim=12, combiner="sum", initializer=ec.initializers.Zeros())
    ids = rng.integers(0, 90, 200)
    offsets = np.sort(np.r_[0, rng.integers(0, 200, 30), 200])
    weights = rng.uniform(0.5, 2, 200).astype(np.float32)

    ec.save(tmp_path / "whole", table_with(values), values_dtype="uint8_rowwise")
    whole = ec.serving.open(tmp_path / "whole").tables["t"]

    def rank_main(world, sharding, path):
        emb = ec.Embedding({"f": ec.FeatureConfig(cfg)}, ec.optimizers.SGD(0.1), world=world, sharding=sharding)
        ec.load(tmp_path / "float", emb)  # every rank its shards of `values`
        ec.save(path, emb, values_dtype="uint8_rowwise")

    one = ec.Embedding({"f": ec.FeatureConfig(cfg)}, ec.optimizers.SGD(0.1))
    one.embedding_tables[cfg].assign(values, 0)
    ec.save(tmp_path / "float", one)
    dist.run_local(2, lambda w: rank_main(w, "row_wise", tmp_path / "rows"))
    files = read_manifest(tmp_path / "rows")["tables"][0]["values"]
    assert len(files) == 2 and {f["dtype"] for f in files} == {"uint8_rowwise"}
    served = ec.serving.open(tmp_path / "rows").tables["t"]
    for combiner in ("sum", "mean", None):  # the same bits as the single file's
        np.testing.assert_array_equal(served.lookup(ids, offsets, weights, combiner=combiner),
                                      whole.lookup(ids, offsets, weights, combiner=combiner))
    assert served.values().tobytes() == whole.values().tobytes()
    # Column-wise: refused before anything is written, with the ValueError on every rank (the plan is every
    # rank's; rank 0 alone raised it and the others RankFailedError).
    def refused(world):
        try:
            rank_main(world, "column_wise", tmp_path / "cols")
        except Exception as e:  # noqa: BLE001 - returned to be checked
            return e

    for e in dist.run_local(3, refused):
        assert type(e) is ValueError and re.search(
            r"table 't' is sharded column-wise .* values_dtype 'uint8_rowwise' stores whole rows", str(e))
    assert not os.path.exists(tmp_path / "cols")

    # A sharded load (any plan) dequantizes each rank's block.
    def load_main(world, sharding):
        emb = ec.Embedding({"f": ec.FeatureConfig(cfg)}, ec.optimizers.SGD(0.1), world=world, sharding=sharding)
        ec.load(tmp_path / "rows", emb)
        blocks = []
        for (ti, si), table in emb._local.items():
            s = emb._sharding_of(ti).shards[si]
            blocks.append((s.row_start, s.rows, s.col_start, s.cols, np.array(table.values())))
        return emb({"f": ec.Ragged(ids, offsets)})["f"], blocks

    deq = whole.values()
    loaded = ec.Embedding({"f": ec.FeatureConfig(cfg)}, ec.optimizers.SGD(0.1))
    ec.load(tmp_path / "rows", loaded)  # the dequantized values, exactly
    assert np.asarray(loaded.embedding_tables[cfg].values()).tobytes() == deq.tobytes()
    want = loaded({"f": ec.Ragged(ids, offsets)})["f"]
    for sharding in ("row_wise", "column_wise", "table_wise"):
        for out, blocks in dist.run_local(2, lambda w: load_main(w, sharding)):
            np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
            for r0, n, c0, cols, block in blocks:  # each rank's block: the dequantized values, exactly
                assert block.tobytes() == np.ascontiguousarray(deq[r0:r0 + n, c0:c0 + cols]).tobytes()


def test_a_served_embedding_takes_its_features(tmp_path, rng):
    user = ec.TableConfig("user", rows=40, dim=8, combiner="sum")
    item = ec.TableConfig("item", rows=90, dim=13, combiner="mean")
    emb = ec.Embedding({"user": ec.FeatureConfig(user), "item": ec.FeatureConfig(item),
                        "history": ec.FeatureConfig(item, max_sequence_length=3)}, ec.optimizers.SGD(0.1))
    ec.save(tmp_path / "c", emb, include_optimizer=False, values_dtype="uint8_rowwise")
    served = ec.serving.open(tmp_path / "c")
    assert {n: t.dtype for n, t in served.tables.items()} == {"user": "uint8_rowwise", "item": "uint8_rowwise"}
    features = {"user": np.array([1, 2, 39]), "item": np.array([[0, 5], [89, 89]]),
                "history": ec.Ragged(np.array([4, 5, 6, 7, 8]), np.array([0, 1, 5]))}
    out = served(features)
    np.testing.assert_array_equal(out["user"], served.tables["user"].lookup(features["user"]))
    np.testing.assert_array_equal(out["item"], served.tables["item"].lookup(features["item"], combiner="mean"))
    hist = out["history"]
    assert hist.shape == (2, 3, 13) and not hist[0, 1:].any()
    rows = served.tables["item"].lookup(np.array([4, 5, 6, 7]), combiner=None)
    np.testing.assert_array_equal(hist[0, 0], rows[0])
    np.testing.assert_array_equal(hist[1], rows[1:4])
    # Against the trained tables: the dequantized values, within the quantization step of each row.
    for name, table in (("user", emb.embedding_tables[user]), ("item", emb.embedding_tables[item])):
        v = np.asarray(table.values())
        step = (v.max(1) - v.min(1)) / 255
        assert (np.abs(served.tables[name].values() - v) <= step[:, None] * 0.5 + 1e-6).all()


def test_a_corrupt_block_is_refused_lazily_and_eagerly(tmp_path, rng):
    # 40,000 rows of 121 + 8 bytes: two checksum blocks of 4 MiB; row 32,513 (bytes 4,194,177 to 4,194,305)
    # straddles them.
    values = rng.standard_normal((40_000, 121)).astype(np.float32)
    ec.save(tmp_path / "c", table_with(values), values_dtype="uint8_rowwise")
    (entry,) = read_manifest(tmp_path / "c")["tables"][0]["values"]
    assert len(entry["crc32c"]) == 2
    with open(tmp_path / "c" / entry["path"], "r+b") as f:  # a code of row 35,000, in the second block
        f.seek(DATA_OFFSET + 35_000 * 129 + 7)
        b = f.read(1)
        f.seek(DATA_OFFSET + 35_000 * 129 + 7)
        f.write(bytes([b[0] ^ 0x10]))
    served = ec.serving.open(tmp_path / "c").tables["t"]  # lazy
    assert served.lookup(np.array([0, 32_512]), np.array([0, 2]), combiner="sum").shape == (1, 121)
    for row in (35_000, 32_513):
        with pytest.raises(ec.CheckpointError, match="checksum mismatch in block 1"):
            served.lookup(np.array([row]))
    with pytest.raises(ec.CheckpointError, match="checksum mismatch in block 1"):
        served.values()
    with pytest.raises(ec.CheckpointError, match="checksum mismatch in block 1"):
        ec.serving.open(tmp_path / "c", verify="eager")
    target = table_with(np.zeros((40_000, 121), np.float32))
    with pytest.raises(ec.CheckpointError, match="checksum mismatch in block 1"):
        ec.load(tmp_path / "c", target)
    assert not np.asarray(target.values()).any()
