"""The ``embedcore`` command line: inspect, verify, demo, info (run as
``python -m embedcore`` in a child, and in-process through cli.main)."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

import embedcore as ec
import embedcore.cli
from embedcore import _embedcore
from test_checkpoint_forge import flip_byte, read_manifest, train, write_manifest

ENV = dict(os.environ, SKBUILD_EDITABLE_VERBOSE="0")


def run_cli(*args, **kwargs):
    return subprocess.run([sys.executable, "-m", "embedcore", *map(str, args)], capture_output=True, text=True,
                          env=ENV, timeout=120, **kwargs)


@pytest.fixture(scope="module")
def emb_ckpt(tmp_path_factory):
    """An Embedding checkpoint: tables user (float32, sum) and item (bfloat16),
    three features, one a sequence; Adagrad, 2 steps."""
    path = tmp_path_factory.mktemp("cli") / "emb"
    user = ec.TableConfig("user", 1000, 16, "float32", ec.initializers.Uniform(-1, 1, seed=1), combiner="sum")
    item = ec.TableConfig("item", 3000, 8, "bfloat16", ec.initializers.Uniform(-1, 1, seed=2))
    emb = ec.Embedding({"user": ec.FeatureConfig(user, name="user"), "item": ec.FeatureConfig(item, name="item"),
                        "history": ec.FeatureConfig(item, max_sequence_length=5, name="history")},
                       optimizer=ec.optimizers.Adagrad(0.1))
    rng = np.random.default_rng(0)
    for _ in range(2):
        feats = {"user": rng.integers(0, 1000, 4), "item": rng.integers(0, 3000, 4),
                 "history": rng.integers(0, 3000, (4, 5))}
        out = emb(feats)
        emb.apply_gradients({k: np.ones_like(v) for k, v in out.items()})
    ec.save(path, emb)
    return path


def test_inspect(emb_ckpt):
    r = run_cli("inspect", emb_ckpt)
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""
    out = r.stdout
    assert f"checkpoint {emb_ckpt}" in out
    assert "format {}.{}".format(*ec.FORMAT_VERSION) in out and f"embedcore {ec.__version__}" in out and "generation 1" in out
    assert "features:" in out and "history -> item (sequence 5)" in out and "user -> user" in out
    assert "table user: 1000 x 16 float32 (stored float32), combiner sum" in out
    assert "table item: 3000 x 8 bfloat16 (stored bfloat16), combiner mean" in out
    assert out.count("optimizer: adagrad, step 2, slots: accumulators") == 2
    assert out.count("sharding at save: none over 1 rank(s); 2 file(s)") == 2
    # sizes: user 2 x (4096 + 1000 x 16 x 4) bytes = 133.0 KiB;
    # item 4096 + 3000 x 8 x 2 (bfloat16 values) + 4096 + 3000 x 8 x 4 (float32 slot) = 148.6 KiB
    assert "combiner sum, 133.0 KiB" in out and "combiner mean, 148.6 KiB" in out
    assert "total 281.6 KiB" in out


def test_inspect_a_copy_without_its_slot_files(emb_ckpt, tmp_path):
    """A checkpoint copied without its optimizer slot files serves (the values
    files are all a server opens): inspect describes it too, naming the
    missing files, and the copy loads without the optimizer state."""
    copy = tmp_path / "copy"
    shutil.copytree(emb_ckpt, copy)
    manifest = json.loads(ec.checkpoint.read_info(copy).manifest_json)
    slot_files = [f["path"] for t in manifest["tables"] for fs in t["slots"].values() for f in fs]
    for name in slot_files:
        os.remove(copy / name)
    r = run_cli("inspect", copy)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("slot files missing (") == 2 and all(name in r.stdout for name in slot_files), r.stdout
    ec.serving.open(copy)
    user = ec.Table(name="user", rows=1000, dim=16, optimizer=ec.optimizers.Adagrad(0.1))
    ec.load(copy, into=user, include_optimizer=False)
    assert "slot files missing" not in run_cli("inspect", emb_ckpt).stdout


def test_inspect_json(emb_ckpt):
    r = run_cli("inspect", "--json", emb_ckpt)
    assert r.returncode == 0, r.stderr
    manifest = json.loads(r.stdout)
    assert manifest == read_manifest(emb_ckpt)
    assert manifest["format_version"] == list(ec.FORMAT_VERSION)
    tables = {t["name"]: t for t in manifest["tables"]}
    assert (tables["item"]["rows"], tables["item"]["dim"], tables["item"]["dtype"]) == (3000, 8, "bfloat16")
    assert tables["user"]["optimizer"]["kind"] == "adagrad"
    assert list(tables["user"]["slots"]) == ["accumulators"]
    assert tables["user"]["sharding"] == {"plan": "none", "world_size": 1}


def test_inspect_values_only_and_exports(tmp_path, capsys):
    t = ec.Table(name="t", rows=100, dim=4, optimizer=ec.optimizers.FTRL(0.1))
    ec.save(tmp_path / "v", t, include_optimizer=False, values_dtype="float16")
    assert embedcore.cli.main(["inspect", str(tmp_path / "v")]) == 0
    out = capsys.readouterr().out
    assert "table t: 100 x 4 float32 (stored float16)" in out
    assert "optimizer: none saved (values only)" in out
    assert "1 file(s)" in out


def test_inspect_shows_a_padding_idx(tmp_path, capsys):
    """A recorded padding_idx (format 1.5) changes what every served pooled
    lookup computes: inspect shows it."""
    et = pytest.importorskip("embedcore.adapters.torch")
    ec.save(tmp_path / "p", et.EmbeddingBag(10, 4, mode="sum", padding_idx=2))
    ec.save(tmp_path / "n", et.EmbeddingBag(10, 4, mode="sum"))
    assert embedcore.cli.main(["inspect", str(tmp_path / "p")]) == 0
    assert ", padding_idx 2," in capsys.readouterr().out
    assert embedcore.cli.main(["inspect", str(tmp_path / "n")]) == 0
    assert "padding_idx" not in capsys.readouterr().out


def test_inspect_quotes_names_that_do_not_print(tmp_path, capsys):
    """A table name with a newline or a terminal escape is quoted with
    escapes: it cannot forge a line of the listing or reach the terminal."""
    ec.save(tmp_path / "c", [ec.Table(name="a\n  table forged: 1 x 1", rows=2, dim=2),
                             ec.Table(name="b\x1b]0;title\x07", rows=2, dim=2), ec.Table(name="plain", rows=2, dim=2)])
    assert embedcore.cli.main(["inspect", str(tmp_path / "c")]) == 0
    out = capsys.readouterr().out
    assert "  table 'a\\n  table forged: 1 x 1': 2 x 2" in out and "\n  table forged" not in out
    assert "  table 'b\\x1b]0;title\\x07': 2 x 2" in out and "\x1b" not in out
    assert "  table plain: 2 x 2" in out


def test_verify_good(emb_ckpt):
    r = run_cli("verify", emb_ckpt)  # stderr is a pipe: no progress bar
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""
    assert r.stdout.startswith(f"{emb_ckpt}: OK (2 table(s)")


def test_verify_corrupt(tmp_path, emb_ckpt):
    import shutil

    path = tmp_path / "c"
    shutil.copytree(emb_ckpt, path)
    slot_file = [t for t in read_manifest(path)["tables"] if t["name"] == "item"][0]["slots"]["accumulators"][0]["path"]
    flip_byte(path / slot_file, 4096 + 777, 0x40)
    r = run_cli("verify", path)
    assert r.returncode != 0
    assert slot_file in r.stderr and "checksum" in r.stderr
    assert "Traceback" not in r.stderr
    assert r.stdout == ""


def forge_value(ckpt, table: str, array: str, row: int, col: int, value: float) -> None:
    """Writes `value` at (row, col) of `array` ("values" or a slot's name) of
    `table` in its (single) file and re-seals the file's checksums: what a
    writer of an older version could have saved (no save writes a value that
    is not finite now)."""
    manifest = read_manifest(ckpt)
    (t,) = [t for t in manifest["tables"] if t["name"] == table]
    (entry,) = t["values"] if array == "values" else t["slots"][array]
    dtype = entry["dtype"]
    if dtype == "bfloat16":  # uint16 bits: the upper half of the float32
        raw = (np.array([value], np.float32).view(np.uint32) >> 16).astype(np.uint16).tobytes()
    else:
        raw = np.array([value], dtype).tobytes()
    path = os.path.join(ckpt, entry["path"])
    with open(path, "r+b") as f:
        f.seek(4096 + (row * entry["cols"] + col) * len(raw))
        f.write(raw)
        f.seek(4096)
        data = np.frombuffer(f.read(), np.uint8)
    bb = entry["block_bytes"]
    entry["crc32c"] = [_embedcore.crc32c(data[i:i + bb]) for i in range(0, len(data), bb)]
    write_manifest(ckpt, manifest)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("where,value", [("values", np.nan), ("values", np.inf), ("values", -np.inf),
                                         ("slot", np.nan)])
def test_verify_finds_values_that_are_not_finite(tmp_path, capsys, dtype, where, value):
    t = ec.Table(name="t", rows=50, dim=3, dtype=dtype, optimizer=ec.optimizers.Adagrad(0.1))
    train(t, np.random.default_rng(1), 1)
    ec.save(tmp_path / "c", t)
    # A save refuses what is not finite (so do assign and assign_slot): forged, as an older version could save it.
    forge_value(tmp_path / "c", "t", "values" if where == "values" else "accumulators", 17, 0, value)
    (entry,) = read_manifest(tmp_path / "c")["tables"]
    name = entry["values"][0]["path"] if where == "values" else entry["slots"]["accumulators"][0]["path"]
    assert embedcore.cli.main(["verify", str(tmp_path / "c")]) == 1
    err = capsys.readouterr().err
    assert name in err and "row 17, column 0 is not finite" in err
    # The checksums are fine, but a load refuses it too (the table could not be saved again), changing
    # nothing; a slot's: the values alone load.
    t2 = ec.Table(name="t", rows=50, dim=3, dtype=dtype, optimizer=ec.optimizers.Adagrad(0.1))
    before = t2.to_numpy()
    label = "values" if where == "values" else "slot accumulators"
    with pytest.raises(ec.CheckpointError, match=f"{name}: table 't' {label} hold {value} at row 17, column 0: "
                                                 "a checkpoint holds finite values only"):
        ec.load(tmp_path / "c", into=t2)
    np.testing.assert_array_equal(t2.to_numpy(), before)
    if where == "slot":
        ec.load(tmp_path / "c", into=t2, include_optimizer=False)
        np.testing.assert_array_equal(t2.to_numpy(), t.to_numpy())


def test_verify_and_inspect_of_no_checkpoint(tmp_path, capsys):
    for cmd in ("verify", "inspect"):
        assert embedcore.cli.main([cmd, str(tmp_path / "absent")]) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"embedcore {cmd}: CheckpointError:") and "absent" in err


def test_demo(tmp_path):
    r = run_cli("demo", "--steps", 60, "--checkpoint", tmp_path / "demo")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "step    50" in r.stdout and "step    60" in r.stdout
    assert "serving matches training" in r.stdout
    assert r.stderr == ""  # no progress bar or warning when stderr is not a terminal
    assert sorted(ec.checkpoint.read_info(tmp_path / "demo").table_names) == ["item", "user"]
    assert embedcore.cli.main(["verify", str(tmp_path / "demo")]) == 0


def test_ctrl_c_says_interrupted_without_a_traceback_and_ends_by_sigint(tmp_path):
    """As Python ends on an uncaught KeyboardInterrupt (by SIGINT, which a
    shell or make sees), after one line instead of a traceback; a DST the
    command created is removed."""
    import signal

    # (SIGINT's default restored: a run started in the background inherits it ignored, and Python then
    # raises no KeyboardInterrupt)
    p = subprocess.Popen([sys.executable, "-m", "embedcore", "demo", "--steps", "10000000", "--batch-size", "8",
                          "--checkpoint", str(tmp_path / "new")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=dict(ENV, PYTHONUNBUFFERED="1"),
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert "demo:" in p.stdout.readline()  # training has begun
    p.send_signal(signal.SIGINT)
    try:
        out, err = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == -signal.SIGINT, (out, err)
    assert err == "embedcore demo: interrupted\n", err
    assert not (tmp_path / "new").exists()


def test_ctrl_c_in_process_reaches_the_caller(tmp_path, monkeypatch, capsys):
    """main() called from Python code (a script, a notebook, a test): the
    KeyboardInterrupt reaches the caller, after the one line and the
    clean-up; only the command (run_as_program) ends the process by SIGINT."""
    def interrupted(args):
        os.mkdir(args.dst)  # as a convert that had begun writing DST
        raise KeyboardInterrupt

    monkeypatch.setattr(embedcore.cli, "_run", interrupted)
    with pytest.raises(KeyboardInterrupt):
        embedcore.cli.main(["reshard", str(tmp_path / "src"), str(tmp_path / "dst"), "--world", "1"])
    assert capsys.readouterr().err == (f"embedcore reshard: interrupted; {tmp_path / 'dst'} holds its old checkpoint, "
                                       "or the new one whole if it came as that was committed\n")
    assert not (tmp_path / "dst").exists()


def test_version_and_help_to_a_closed_pipe_exit_quietly():
    r = subprocess.run(f"{sys.executable} -m embedcore --version | true; echo ${{PIPESTATUS[0]}}", shell=True,
                       executable="/bin/bash", capture_output=True, text=True, env=ENV, timeout=120)
    assert r.stdout.strip() in ("0", "141") and "Traceback" not in r.stderr, r.stderr
    r = subprocess.run([sys.executable, "-m", "embedcore", "info"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                       text=True, env=ENV, timeout=120, stdin=subprocess.DEVNULL, close_fds=True,
                       preexec_fn=lambda: os.close(1))
    assert "Traceback" not in r.stderr, r.stderr


def test_demo_judges_the_loss_over_full_windows():
    """The loss of steps 1-50 against that of steps 51-100; the one step
    after them is shown but not judged (its loss alone was higher, and the
    run failed)."""
    r = run_cli("demo", "--steps", 101, "--batch-size", 64, "--seed", 4)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "step   101  loss" in r.stdout and "loss 0.6780 -> 0.6582 (first and last 50 steps)" in r.stdout


@pytest.mark.parametrize("args,match", [(["--steps", "0"], "demo: steps must be >= 1, got 0"),
                                        (["--steps", "-3"], "demo: steps must be >= 1, got -3"),
                                        (["--batch-size", "0"], "demo: batch_size must be >= 1, got 0"),
                                        (["--seed", "-1"], "demo: seed must be >= 0, got -1"),
                                        (["--checkpoint", ""], 'demo: checkpoint is empty ("." names the current')])
def test_demo_arguments(capsys, args, match):
    assert embedcore.cli.main(["demo", *args]) == 1
    assert f"embedcore demo: ValueError: {match}" in capsys.readouterr().err


def test_demo_keeps_a_checkpoint_it_is_not_told_to_replace(tmp_path, capsys):
    """Refused before training (a --checkpoint of another model, a directory
    whose parent is missing); --overwrite replaces it."""
    ec.save(tmp_path / "c", ec.Table(ec.TableConfig("precious", 4, 2)))
    assert embedcore.cli.main(["demo", "--steps", "3", "--batch-size", "64", "--checkpoint", str(tmp_path / "c")]) == 1
    err = capsys.readouterr().err
    assert f"embedcore demo: ValueError: demo: {tmp_path / 'c'} already holds a checkpoint; pass --overwrite" in err
    assert ec.checkpoint.read_info(tmp_path / "c").table_names == ["precious"]
    missing = tmp_path / "no" / "c"
    assert embedcore.cli.main(["demo", "--steps", "3", "--checkpoint", str(missing)]) == 1
    out, err = capsys.readouterr()
    assert f"demo: checkpoint {missing}: no directory {tmp_path / 'no'} to save it in" in err and "step" not in out
    (tmp_path / "file").write_text("kept")
    assert embedcore.cli.main(["demo", "--steps", "3", "--checkpoint", str(tmp_path / "file"), "--overwrite"]) == 1
    out, err = capsys.readouterr()
    assert f"demo: checkpoint {tmp_path / 'file'} is a file, not a directory" in err and "step" not in out
    assert (tmp_path / "file").read_text() == "kept"
    assert embedcore.cli.main(["demo", "--steps", "3", "--batch-size", "64", "--checkpoint", str(tmp_path / "c"),
                               "--overwrite"]) == 0
    assert sorted(ec.checkpoint.read_info(tmp_path / "c").table_names) == ["item", "user"]


def test_a_short_demo_runs(tmp_path, capsys):
    """Fewer steps than two loss windows of 50: the demo runs, trains, saves
    and serves; whether the loss fell is judged from 100 steps."""
    assert embedcore.cli.main(["demo", "--steps", "3", "--batch-size", "64", "--checkpoint", str(tmp_path / "c")]) == 0
    assert "serving matches training" in capsys.readouterr().out


def test_progress_bar_only_on_a_terminal(emb_ckpt):
    """The control of the tests above: on a terminal, verify shows a bar."""
    pytest.importorskip("tqdm")
    pty = pytest.importorskip("pty")
    import fcntl
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))  # a 0-column terminal shows no bar
    try:
        p = subprocess.Popen([sys.executable, "-m", "embedcore", "verify", str(emb_ckpt)], stdout=subprocess.PIPE,
                             stderr=slave, env=ENV)
        os.close(slave)
        out, _ = p.communicate(timeout=120)
        chunks = []
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # the terminal's other end is closed
                break
            if not data:
                break
            chunks.append(data)
    finally:
        os.close(master)
    assert p.returncode == 0
    assert b"verify" in b"".join(chunks)


def test_version_info_and_usage(capsys):
    assert embedcore.cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == ec.__version__
    assert embedcore.cli.main(["info"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["checkpoint_format"] == "{}.{}".format(*ec.FORMAT_VERSION)
    assert embedcore.cli.main([]) == 2


@pytest.mark.parametrize("record", ["feature_without_fields", "features_not_a_list", "shards_not_objects",
                                    "shard_without_fields"])
def test_inspect_prints_any_metadata_and_sharding_record(tmp_path, capsys, emb_ckpt, record):
    """The reader validates what loading and serving use, not the features
    or the sharding record a manifest carries: inspect prints what is there
    (a '?' for what is missing) instead of a KeyError / TypeError traceback."""
    import shutil

    path = tmp_path / "c"
    shutil.copytree(emb_ckpt, path)
    m = read_manifest(path)
    if record == "feature_without_fields":
        m["metadata"]["features"] = [{"name": "user"}, {"table": "item", "max_sequence_length": 5}]
    elif record == "features_not_a_list":
        m["metadata"]["features"] = "user, item"
    elif record == "shards_not_objects":
        m["tables"][0]["sharding"] = {"plan": "row_wise", "world_size": 2, "shards": [1, 2]}
    else:
        m["tables"][0]["sharding"] = {"plan": "row_wise", "world_size": 2, "shards": [{"rank": 1, "rows": 3}]}
    write_manifest(path, m)
    assert embedcore.cli.main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "total " in out
    if record == "feature_without_fields":
        assert "features: user -> ?, ? -> item (sequence 5)" in out
    elif record == "shard_without_fields":
        assert "rank 1: rows [?, ?), columns [?, ?)" in out


@pytest.mark.parametrize("shards", [8, 9, 1000])
def test_inspect_shows_a_table_over_many_ranks_in_a_few_lines(tmp_path, capsys, emb_ckpt, shards):
    """A table sharded over 1,000 ranks printed 1,000 lines: inspect shows up
    to 8 shards, else the first 6, a line counting the rest and the last 2
    (inspect --json prints the whole manifest)."""
    import shutil

    path = tmp_path / "c"
    shutil.copytree(emb_ckpt, path)
    m = read_manifest(path)
    dim = m["tables"][0]["dim"]
    m["tables"][0]["sharding"] = {"plan": "row_wise", "world_size": shards,
                                  "shards": [{"rank": r, "row_start": 10 * r, "rows": 10, "col_start": 0, "cols": dim}
                                             for r in range(shards)]}
    write_manifest(path, m)
    assert embedcore.cli.main(["inspect", str(path)]) == 0
    lines = [line.strip() for line in capsys.readouterr().out.splitlines()]
    ranks = [line for line in lines if line.startswith("rank ")]
    if shards <= 8:
        assert ranks == [f"rank {r}: rows [{10 * r}, {10 * r + 10})" for r in range(shards)]
        assert not any(line.startswith("...") for line in lines)
    else:
        assert ranks == [f"rank {r}: rows [{10 * r}, {10 * r + 10})" for r in [0, 1, 2, 3, 4, 5, shards - 2, shards - 1]]
        more = lines.index(f"... {shards - 8} more shard(s) (inspect --json lists every one)")
        assert lines[more - 1] == "rank 5: rows [50, 60)" and lines[more + 1].startswith(f"rank {shards - 2}:")
    assert embedcore.cli.main(["inspect", "--json", str(path)]) == 0
    assert len(json.loads(capsys.readouterr().out)["tables"][0]["sharding"]["shards"]) == shards


def test_verify_accepts_slot_files_listed_in_another_order(tmp_path, capsys):
    """The format does not order a manifest's files: slot files listed in
    another order than the values' hold the same rows (verify said they did
    not); and slot files of other columns than the values' are reported."""
    import embedcore.distributed as ed

    path = str(tmp_path / "c")
    t = ec.TableConfig("t", 10, 4, initializer=ec.initializers.Uniform(-1, 1, seed=1))

    def fn(world):
        emb = ec.Embedding({"f": ec.FeatureConfig(t)}, ec.optimizers.Adam(0.1), world=world, sharding="row_wise")
        ec.save(path, emb)

    ed.run_local(2, fn)
    m = read_manifest(path)
    (entry,) = m["tables"]
    assert [f["row_start"] for f in entry["values"]] == [0, 5]
    entry["slots"]["momenta"].reverse()
    write_manifest(path, m)
    assert embedcore.cli.main(["verify", path]) == 0, capsys.readouterr().err
    assert "OK" in capsys.readouterr().out
    # Slot files that tile the rows otherwise than the values are valid too (docs/format.md asks each
    # array to tile [rows, dim]): the slot file of an unsharded save of the same table, rows [0, 10)
    # in one file, beside values in [0, 5) and [5, 10).
    import shutil

    whole = ec.Embedding({"f": ec.FeatureConfig(t)}, ec.optimizers.Adam(0.1))
    ec.save(tmp_path / "whole", whole)
    (whole_entry,) = read_manifest(tmp_path / "whole")["tables"]
    slot_file = whole_entry["slots"]["momenta"][0]
    shutil.copy(tmp_path / "whole" / slot_file["path"], os.path.join(path, "other." + slot_file["path"]))
    momenta = entry["slots"]["momenta"]
    entry["slots"]["momenta"] = [dict(slot_file, path="other." + slot_file["path"])]
    write_manifest(path, m)
    assert embedcore.cli.main(["verify", path]) == 0, capsys.readouterr().err
    # The control: a slot that leaves rows out (one of its two files) is reported.
    entry["slots"]["momenta"] = [f for f in momenta if f["row_start"] == 0]
    write_manifest(path, m)
    assert embedcore.cli.main(["verify", path]) == 1
    err = capsys.readouterr().err
    assert "slots.momenta" in err and "covers rows [0, 5) of 10" in err


def test_memory_error_and_a_huge_world_exit_cleanly(tmp_path, capsys, monkeypatch, emb_ckpt):
    """An argument too large for the machine (demo --batch-size 10**11, reshard
    --world 10**11) ended in a MemoryError traceback."""
    assert embedcore.cli.main(["reshard", str(emb_ckpt), str(tmp_path / "r"), "--world", str(10**11)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("embedcore reshard: ValueError: reshard: world_size must be an int in [1, ")
    assert not (tmp_path / "r").exists()

    def out_of_memory(**kwargs):
        raise MemoryError("Unable to allocate 745. GiB")

    monkeypatch.setattr("embedcore.demo.run", out_of_memory)
    assert embedcore.cli.main(["demo", "--batch-size", str(10**11)]) == 1
    assert capsys.readouterr().err == "embedcore demo: MemoryError: Unable to allocate 745. GiB\n"


def test_verify_and_sok_conversion_report_progress_in_bytes(tmp_path):
    # What the terminal's bars count: verify_table reports each part (up to 64 MiB) of its pass, so a single
    # large table advances in steps; to_tables reports each block of the dump it writes.
    t = ec.Table(name="big", rows=330_000, dim=64, optimizer=ec.optimizers.Adagrad(0.1))  # 2 x 84 MB
    ec.save(tmp_path / "c", t)
    info = ec.checkpoint.read_info(tmp_path / "c")
    parts = []
    _embedcore.verify_table(info, 0, True, True, parts.append)
    payload = 2 * 330_000 * 64 * 4
    assert sum(parts) == payload and max(parts) <= 64 << 20 and len(parts) >= 4
    parts.clear()
    _embedcore.verify_table(info, 0, False, False, parts.append)
    assert sum(parts) == payload // 2

    keys = np.arange(0, 600_000, 2, dtype=np.int64)
    variables = {"emb": ec.sok.SokVariable("emb", keys, np.ones((keys.size, 64), np.float32))}
    parts.clear()
    (table,) = ec.sok.to_tables(variables, progress=parts.append)
    assert sum(parts) == keys.size * 64 * 4 and len(parts) >= 2
    assert ec.sok.table_bytes([table]) == 599_999 * 64 * 4


def test_verify_names_the_first_value_that_is_not_finite_across_parts(tmp_path, capsys):
    # Values checked piece by piece in the checksum pass, on several threads: across pieces, blocks and
    # 64 MiB parts, the first bad value in the file is the one named. (Forged: no save writes them.)
    t = ec.Table(name="t", rows=70_000, dim=300)  # 84 MB: two parts of the pass
    ec.save(tmp_path / "c", t)
    forge_value(tmp_path / "c", "t", "values", 69_000, 299, np.nan)  # in the second part
    forge_value(tmp_path / "c", "t", "values", 40_000, 5, -np.inf)   # in a later piece than the next one, same part
    forge_value(tmp_path / "c", "t", "values", 3_000, 7, np.inf)     # the first
    assert embedcore.cli.main(["verify", str(tmp_path / "c")]) == 1
    assert "row 3000, column 7 is not finite" in capsys.readouterr().err
    forge_value(tmp_path / "c", "t", "values", 3_000, 7, 0.0)
    assert embedcore.cli.main(["verify", str(tmp_path / "c")]) == 1
    assert "row 40000, column 5 is not finite" in capsys.readouterr().err
    forge_value(tmp_path / "c", "t", "values", 40_000, 5, 0.0)
    assert embedcore.cli.main(["verify", str(tmp_path / "c")]) == 1
    assert "row 69000, column 299 is not finite" in capsys.readouterr().err
    # A save of the same values refuses them, naming the first.
    v = t._native.values_mut()
    v[69_000, 299] = np.nan
    v[40_000, 5] = -np.inf
    with pytest.raises(ValueError, match="table 't' values hold -inf at row 40000, column 5: a checkpoint holds"):
        ec.save(tmp_path / "c", t)


# ------------------------------------------------------------------ from the CLI audit
def _tf_checkpoint(path, nan_at=None):
    """A TensorFlow checkpoint of TPUEmbeddingForServing (one Adagrad table
    'ta', 20 x 4) at model/embedding; its data file. `nan_at`: an element
    of the table's values set to NaN."""
    tf = pytest.importorskip("tensorflow")
    E = tf.tpu.experimental.embedding
    theirs = E.TPUEmbeddingForServing(
        {"a": E.FeatureConfig(E.TableConfig(vocabulary_size=20, dim=4, name="ta", optimizer=E.Adagrad(0.1)))}, None)
    theirs.build()
    if nan_at is not None:
        values = theirs.embedding_tables[next(iter(theirs.embedding_tables))]
        values.assign(tf.tensor_scatter_nd_update(values, [nan_at], [float("nan")]))
    root = tf.train.Checkpoint(model=tf.Module())
    root.model.embedding = theirs
    prefix = root.save(str(path / "ckpt"))
    (data,) = [str(path / n) for n in os.listdir(path) if ".data-" in n]
    return prefix, data


def _tf_quiet_env():
    """ENV without the settings that silence TensorFlow's start-up logging."""
    return {k: v for k, v in ENV.items() if k not in ("TF_CPP_MIN_LOG_LEVEL", "TF_ENABLE_ONEDNN_OPTS")}


def test_convert_tf_of_a_corrupt_or_truncated_data_file_is_one_line(tmp_path, capsys):
    """A corrupt or truncated .data file (once RestoreV2's DataLossError /
    OutOfRangeError, a traceback) is a ValueError naming the file and the
    tensor, as a bad .index is, from the CLI and from load_tf_checkpoint."""
    prefix, data = _tf_checkpoint(tmp_path / "tf")
    from embedcore.adapters.tf import EmbeddingForServing, load_tf_checkpoint

    raw = bytearray(open(data, "rb").read())
    raw[10] ^= 0xFF
    open(data, "wb").write(raw)
    assert embedcore.cli.main(["convert", "--from", "tf", prefix, str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("embedcore convert: ValueError: ")
    assert "checksum mismatch in model/embedding/ta/.ATTRIBUTES/VARIABLE_VALUE" in err and data in err
    assert "Traceback" not in err
    assert not (tmp_path / "out").exists()  # and no empty DST left behind
    os.truncate(data, 10)
    assert embedcore.cli.main(["convert", "--from", "tf", prefix, str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{data}: truncated: model/embedding/ta/.ATTRIBUTES/VARIABLE_VALUE" in err
    import tensorflow as tf

    E = tf.tpu.experimental.embedding
    ours = EmbeddingForServing({"a": E.FeatureConfig(E.TableConfig(vocabulary_size=20, dim=4, name="ta"))})
    with pytest.raises(ValueError, match="cannot read this TensorFlow checkpoint: .*" + data):
        load_tf_checkpoint(prefix, ours, include_optimizer=False)


def test_convert_tf_of_values_that_are_not_finite_is_one_line(tmp_path, capsys):
    """A NaN in a table's values is refused before any table is read,
    naming the table and the element (was: read into the table, then
    refused by the save that ends the conversion)."""
    prefix, _ = _tf_checkpoint(tmp_path / "tf", nan_at=[13, 2])
    assert embedcore.cli.main(["convert", "--from", "tf", prefix, str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("embedcore convert: ValueError: ")
    assert "table 'ta' values[13, 2] = nan is not finite" in err
    assert not (tmp_path / "out").exists()


def test_convert_tf_prints_no_tensorflow_start_up_logging(tmp_path):
    prefix, _ = _tf_checkpoint(tmp_path / "tf")
    r = subprocess.run([sys.executable, "-m", "embedcore", "convert", "--from", "tf", prefix, str(tmp_path / "out")],
                       capture_output=True, text=True, env=_tf_quiet_env(), timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""  # no oneDNN or cpu_feature_guard lines
    assert "converted 1 TensorFlow table(s) (ta)" in r.stdout
    r = subprocess.run([sys.executable, "-m", "embedcore", "convert", "--from", "tf", str(tmp_path / "absent"),
                        str(tmp_path / "out2")], capture_output=True, text=True, env=_tf_quiet_env(), timeout=300)
    assert r.returncode == 1
    assert r.stderr.count("\n") == 1 and "cannot read this TensorFlow checkpoint" in r.stderr, r.stderr


def test_convert_tf_leaves_the_environment_as_it_was(tmp_path, monkeypatch, capsys):
    """Only the `embedcore` command's own process quiets TensorFlow's
    start-up logging: a program that calls main() keeps its environment, and
    so its TensorFlow's settings (read once a process) and its later
    subprocesses' (it was left with TF_CPP_MIN_LOG_LEVEL=2 and
    TF_ENABLE_ONEDNN_OPTS=0, oneDNN's operations off, for good)."""
    monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL", raising=False)
    monkeypatch.delenv("TF_ENABLE_ONEDNN_OPTS", raising=False)
    prefix, _ = _tf_checkpoint(tmp_path / "tf")
    before = dict(os.environ)
    assert embedcore.cli.main(["convert", "--from", "tf", prefix, str(tmp_path / "out")]) == 0
    assert dict(os.environ) == before
    assert embedcore.cli.main(["convert", "--from", "tf", str(tmp_path / "absent"), str(tmp_path / "out2")]) == 1
    assert dict(os.environ) == before
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "1")  # a user's own setting is used, and kept
    assert embedcore.cli.main(["convert", "--from", "tf", prefix, str(tmp_path / "out3")]) == 0
    assert os.environ["TF_CPP_MIN_LOG_LEVEL"] == "1" and "TF_ENABLE_ONEDNN_OPTS" not in os.environ
    capsys.readouterr()


def test_inspect_takes_the_directory_lock_while_saves_replace_the_checkpoint(tmp_path, capsys):
    """inspect read the manifest's files without the shared lock that verify
    takes: a save's commit removing the old generation between the MANIFEST
    read and the data files' made it fail ('missing file') now and then."""
    import threading

    path = str(tmp_path / "c")
    tables = [ec.Table(name=f"t{i}", rows=50, dim=4) for i in range(60)]
    ec.save(path, tables)
    stop = threading.Event()
    errors = []

    saves = [0]

    def saver():
        try:
            while not stop.is_set():
                ec.save(path, tables)
                saves[0] += 1
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    th = threading.Thread(target=saver)
    th.start()
    failures, runs = [], 0
    try:
        # 30 runs at least, over 10 saves at least (counted, not timed: a loaded machine only takes longer).
        while (runs < 30 or saves[0] < 10) and not errors and runs < 5000:
            if embedcore.cli.main(["inspect", path]) != 0:
                failures.append(capsys.readouterr().err)
            runs += 1
    finally:
        stop.set()
        th.join()
    capsys.readouterr()
    assert not errors
    assert saves[0] >= 10 and not failures, f"{len(failures)} of {runs} failed: {failures[:2]}"


def test_verify_accepts_slots_split_into_other_row_blocks_than_the_values(tmp_path, capsys):
    """docs/format.md asks each array (values, each slot) to tile [rows, dim];
    a slot in two files [0, 20) + [20, 37) beside values in one file is valid
    (load and serving take it), and verify said 'holds other rows'."""
    from test_checkpoint_forge import crc32c, data_header

    path = tmp_path / "c"
    t = ec.Table(name="a", rows=37, dim=5, optimizer=ec.optimizers.Adagrad(0.1))
    t.apply_gradients(np.arange(37), None, np.random.default_rng(0).standard_normal((37, 5)).astype(np.float32))
    ec.save(path, t)
    m = read_manifest(path)
    (entry,) = m["tables"][0]["slots"]["accumulators"]
    payload = open(path / entry["path"], "rb").read()[4096:]
    files = []
    for i, (r0, n) in enumerate(((0, 20), (20, 17))):
        part = payload[r0 * 20:(r0 + n) * 20]
        name = f"t00000.accumulators.p{i}.g000000000001.ecd"
        header = data_header("float32", n, 5, len(part), entry["block_bytes"])
        (path / name).write_bytes(header + b"\0" * (4096 - len(header)) + part)
        bb = entry["block_bytes"]
        files.append(dict(entry, path=name, bytes=4096 + len(part), row_start=r0, rows=n,
                          crc32c=[crc32c(part[j:j + bb]) for j in range(0, len(part), bb)]))
    os.remove(path / entry["path"])
    m["tables"][0]["slots"]["accumulators"] = files
    write_manifest(path, m)
    t2 = ec.Table(name="a", rows=37, dim=5, optimizer=ec.optimizers.Adagrad(0.1))
    ec.load(path, t2)  # the engine takes it
    np.testing.assert_array_equal(t2.slots()["accumulators"], t.slots()["accumulators"])
    assert embedcore.cli.main(["verify", str(path)]) == 0, capsys.readouterr().err
    assert "OK" in capsys.readouterr().out
    # The control: a corrupt slot block is still found.
    flip_byte(path / files[1]["path"], 4096 + 3, 0x01)
    assert embedcore.cli.main(["verify", str(path)]) == 1
    assert files[1]["path"] in capsys.readouterr().err


def test_failed_reshard_or_convert_leaves_no_new_empty_destination(tmp_path, capsys, monkeypatch):
    src = tmp_path / "src"
    ec.save(src, ec.Table(name="t", rows=100, dim=4))
    (name,) = [n for n in os.listdir(src) if n.endswith(".ecd")]
    flip_byte(src / name, 5000, 0x01)  # a corrupt payload: the reshard fails after creating DST
    assert embedcore.cli.main(["reshard", str(src), str(tmp_path / "new"), "--world", "2"]) == 1
    assert "checksum" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()
    # A DST that existed before, even empty, is left as it was; so is a non-empty one.
    (tmp_path / "empty").mkdir()
    assert embedcore.cli.main(["reshard", str(src), str(tmp_path / "empty"), "--world", "2"]) == 1
    assert (tmp_path / "empty").is_dir()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("x")
    assert embedcore.cli.main(["reshard", str(src), str(tmp_path / "full"), "--world", "2"]) == 1
    assert os.listdir(tmp_path / "full") == ["keep.txt"]
    # convert: a SOK conversion whose save fails after creating DST
    sok = tmp_path / "sok"
    sok.mkdir()
    np.array([0, 3], np.int64).tofile(sok / "emb_keys.file")
    np.ones((2, 4), np.float32).tofile(sok / "emb_values.file")
    capsys.readouterr()

    def failing_save(dst, tables):
        os.makedirs(dst, exist_ok=True)
        raise OSError("disk full")

    monkeypatch.setattr("embedcore.sok.save_tables", failing_save)
    assert embedcore.cli.main(["convert", "--from", "sok", str(sok), str(tmp_path / "conv"),
                               "--key-dtype", "int64"]) == 1
    assert "disk full" in capsys.readouterr().err
    assert not (tmp_path / "conv").exists()


@pytest.mark.parametrize("fmt,option", [
    ("sok", ["--combiner", "mean"]), ("sok", ["--prefix", "model/embedding"]),
    ("tf", ["--rows", "5"]), ("tf", ["--rename", "ta=zz"]), ("tf", ["--dim", "99"]), ("tf", ["--key-dtype", "uint32"]),
    ("torch", ["--rows", "5"]),
])
def test_convert_refuses_options_of_the_other_format(tmp_path, capsys, fmt, option):
    # Refused before anything is read (no TensorFlow needed): exit 2, as the other bad options of convert.
    assert embedcore.cli.main(["convert", "--from", fmt, str(tmp_path / "src"), str(tmp_path / "out"), *option]) == 2
    others = "tf and torch" if fmt == "sok" else "sok"
    assert capsys.readouterr().err == (f"embedcore convert: {option[0]} is an option of --from {others}; "
                                       f"--from {fmt} does not take it\n")
    assert not (tmp_path / "out").exists()


def test_convert_from_torch_refuses_no_optimizer(tmp_path, capsys):
    # A state dict holds no optimizer state: --no-optimizer changed nothing and was taken (exit 0); exit 2 now.
    assert embedcore.cli.main(["convert", "--from", "torch", str(tmp_path / "m.pt"), str(tmp_path / "out"),
                               "--no-optimizer"]) == 2
    assert "--no-optimizer is an option of --from tf and sok" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_convert_refuses_an_empty_rename_target(tmp_path, capsys):
    sok = tmp_path / "sok"
    sok.mkdir()
    np.array([0, 3], np.int64).tofile(sok / "emb_keys.file")
    np.ones((2, 4), np.float32).tofile(sok / "emb_values.file")
    assert embedcore.cli.main(["convert", "--from", "sok", str(sok), str(tmp_path / "out"), "--key-dtype", "int64",
                               "--rename", "emb="]) == 2
    assert "--rename 'emb=': no table name after '='" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    variables = ec.sok.read_dump(sok, key_dtype="int64")
    with pytest.raises(ValueError, match="must be a non-empty str, got ''"):
        ec.sok.to_tables(variables, names={"emb": ""})


def test_convert_into_a_checkpoint_needs_overwrite(tmp_path, capsys, emb_ckpt):
    import shutil

    dst = tmp_path / "prod"
    shutil.copytree(emb_ckpt, dst)
    before = read_manifest(dst)
    sok = tmp_path / "sok"
    sok.mkdir()
    np.array([0, 3], np.int64).tofile(sok / "emb_keys.file")
    np.ones((2, 4), np.float32).tofile(sok / "emb_values.file")
    args = ["convert", "--from", "sok", str(sok), str(dst), "--key-dtype", "int64"]
    assert embedcore.cli.main(args) == 1
    assert capsys.readouterr().err == (f"embedcore convert: {dst} already holds a checkpoint; "
                                       "pass --overwrite to replace it\n")
    assert read_manifest(dst) == before  # untouched
    assert embedcore.cli.main(args + ["--overwrite"]) == 0
    assert list(ec.checkpoint.read_info(dst).table_names) == ["emb"]
    # An existing directory without a checkpoint needs no --overwrite.
    (tmp_path / "empty").mkdir()
    assert embedcore.cli.main(["convert", "--from", "sok", str(sok), str(tmp_path / "empty"),
                               "--key-dtype", "int64"]) == 0


def test_a_destination_holding_another_programs_manifest_is_refused_before_any_work(tmp_path, capsys):
    """A MANIFEST that is not embedcore's: --overwrite would not help (a save
    never replaces another program's file), so neither the hint nor the
    work (training, reading the source) comes first: the demo and every
    converter refuse at once, the file untouched."""
    dst = tmp_path / "theirs"
    dst.mkdir()
    (dst / "MANIFEST").write_text("another program's manifest\n")
    refusal = f"{dst / 'MANIFEST'}: not an embedcore manifest (another magic); a save here would replace it"
    for overwrite in ([], ["--overwrite"]):
        assert embedcore.cli.main(["demo", "--steps", "3", "--checkpoint", str(dst), *overwrite]) == 1
        out, err = capsys.readouterr()
        assert refusal in err and "step" not in out, (out, err)
        # The source does not exist: the refusal comes before it is read.
        for fmt in ("sok", "tf", "torch"):
            assert embedcore.cli.main(["convert", "--from", fmt, str(tmp_path / "missing"), str(dst), *overwrite]) == 1
            assert capsys.readouterr().err == \
                f"embedcore convert: CheckpointError: {refusal}: move it away or save elsewhere\n"
    long = tmp_path / ("n" * 300)  # a MANIFEST that cannot be looked at: the save would fail on it too
    assert embedcore.cli.main(["convert", "--from", "sok", str(tmp_path / "missing"), str(long)]) == 1
    assert capsys.readouterr().err == \
        f"embedcore convert: OSError: [Errno 36] {long / 'MANIFEST'}: File name too long\n"
    assert embedcore.cli.main(["convert", "--from", "sok", str(tmp_path / "missing"), ""]) == 1
    assert capsys.readouterr().err == 'embedcore convert: ValueError: dst is empty ("." names the current directory)\n'
    with pytest.raises(ec.CheckpointError, match=re.escape(refusal)):
        ec.sok.convert(tmp_path / "missing", dst)
    assert (dst / "MANIFEST").read_text() == "another program's manifest\n" and os.listdir(dst) == ["MANIFEST"]


def test_inspect_into_a_closed_pipe_exits_quietly(emb_ckpt):
    """`embedcore inspect CKPT | head -1`: the reader goes away; no
    BrokenPipeError on stderr, and the status of a command stopped by
    SIGPIPE (141)."""
    p = subprocess.Popen([sys.executable, "-m", "embedcore", "inspect", "--json", str(emb_ckpt)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV)
    p.stdout.close()  # before the child writes: its first write finds no reader
    err = p.stderr.read().decode()
    p.wait(timeout=120)
    assert p.returncode == 141, err
    assert err == ""


def test_reshard_summary_of_a_huge_world_is_short(tmp_path, capsys):
    path = tmp_path / "c"
    ec.save(path, ec.Table(name="t", rows=40, dim=2))
    world = 1 << 20
    assert embedcore.cli.main(["reshard", str(path), str(tmp_path / "r"), "--world", str(world),
                               "--plan", "row_wise"]) == 0
    out = capsys.readouterr().out
    assert len(out) < 1000, len(out)
    assert "bytes per rank (values + slots): min 0, max 8, total 320 over 1,048,576 ranks" in out
    assert "row_wise -> " in out and "... (36 more), r1048575:rows[39:40]" in out
    # A small world is listed in full, as before.
    assert embedcore.cli.main(["reshard", str(path), str(tmp_path / "r2"), "--world", "2", "--plan", "row_wise"]) == 0
    out = capsys.readouterr().out
    assert "row_wise -> r0:rows[0:20], r1:rows[20:40]" in out and "bytes per rank (values + slots): 160, 160" in out


def test_reshard_into_another_checkpoint_needs_overwrite(tmp_path, capsys):
    """As convert and demo --checkpoint: a DST holding a checkpoint (not
    SRC) is refused without --overwrite, and left as it was (it was
    replaced without a word); in place (DST is SRC) needs none."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    ec.save(src, ec.Table(name="a", rows=8, dim=2))
    ec.save(dst, ec.Table(name="precious", rows=4, dim=2))
    before = (dst / "MANIFEST").read_bytes()
    assert embedcore.cli.main(["reshard", str(src), str(dst), "--world", "2"]) == 1
    assert "already holds a checkpoint; pass --overwrite to replace it" in capsys.readouterr().err
    assert (dst / "MANIFEST").read_bytes() == before
    assert embedcore.cli.main(["reshard", str(src), str(dst), "--world", "2", "--overwrite"]) == 0
    assert list(ec.serving.open(dst).tables) == ["a"]
    assert embedcore.cli.main(["reshard", str(dst), str(dst), "--world", "1"]) == 0
    capsys.readouterr()
    assert embedcore.cli.main(["reshard", str(tmp_path / "missing"), str(dst), "--world", "1"]) == 1
    err = capsys.readouterr().err
    assert "missing" in err and "--overwrite" not in err  # (the missing SRC, not DST's checkpoint)


def test_inspect_holds_no_lock_while_its_output_waits_for_a_reader(tmp_path):
    """inspect reads the manifest under the directory's shared lock and
    prints after releasing it: output that a pager has not read yet (a full
    pipe) holds up no save's commit (a save waited for the reader)."""
    import fcntl
    import select
    import time

    path = tmp_path / "many"
    ec.save(path, [ec.Table(name=f"table_{i:04d}", rows=2, dim=2) for i in range(400)])  # > 64 KiB of JSON
    p = subprocess.Popen([sys.executable, "-m", "embedcore", "inspect", "--json", str(path)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            assert select.select([p.stdout], [], [], 60)[0], "inspect printed nothing"  # it has started printing
            deadline = time.monotonic() + 60
            free = 0
            while time.monotonic() < deadline and free < 20:  # until it is blocked on the full pipe
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    fcntl.flock(fd, fcntl.LOCK_UN)
                    free += 1
                except BlockingIOError:
                    free = 0
                time.sleep(0.05)
            assert free >= 20 and p.poll() is None, "inspect held the lock while its output waited"
        finally:
            os.close(fd)
        out, _ = p.communicate(timeout=60)
        assert p.returncode == 0 and len(json.loads(out)["tables"]) == 400
    finally:
        p.kill()


def test_convert_torch_state_dict(tmp_path, capsys):
    """--from torch: the tables of a torch.save'd state dict, values only; --prefix and --combiner apply,
    the SOK options are refused, a file without tables fails in one line and leaves no DST behind."""
    torch = pytest.importorskip("torch")
    w = torch.arange(12, dtype=torch.float32).reshape(6, 2)
    torch.save({"model.ebc.embedding_bags.user.weight": w, "model.head.weight": torch.ones(1, 2)},
               tmp_path / "m.pt")
    argv = ["convert", "--from", "torch", str(tmp_path / "m.pt"), str(tmp_path / "out")]
    assert embedcore.cli.main(argv + ["--prefix", "model.ebc", "--combiner", "mean"]) == 0
    assert "converted 1 PyTorch table(s) (user)" in capsys.readouterr().out
    served = ec.serving.open(tmp_path / "out")
    np.testing.assert_array_equal(served.tables["user"].values(), w.numpy())
    np.testing.assert_array_equal(served.tables["user"].lookup(np.array([0, 2]), np.array([0, 2])), [[2.0, 3.0]])
    assert embedcore.cli.main(argv + ["--dim", "2"]) == 2
    assert "--dim is an option of --from sok" in capsys.readouterr().err
    torch.save({"head.weight": torch.ones(1, 2)}, tmp_path / "none.pt")
    assert embedcore.cli.main(["convert", "--from", "torch", str(tmp_path / "none.pt"), str(tmp_path / "out2")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no table weights" in err and not (tmp_path / "out2").exists()
