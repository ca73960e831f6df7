"""The ``embedcore`` command line (also ``python -m embedcore``)."""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from typing import List, Optional


def _progress(total: int, desc: str, unit: str = "file"):
    """A progress bar on a terminal (tqdm), nothing otherwise. unit="B"
    counts bytes (shown as KiB, MiB, ...)."""
    if not sys.stderr.isatty():
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    if unit == "B":
        return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, leave=False)
    return tqdm(total=total, desc=desc, unit=unit, leave=False)


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _shown(name) -> str:
    """A name as inspect prints it: as it is, or quoted with escapes where
    it is empty or holds a character that does not print (a newline, a
    terminal escape), so that no name can forge lines or reach the terminal."""
    name = str(name)
    return name if name and name.isprintable() else repr(name)


def _inspect(path: str, as_json: bool) -> int:
    from .checkpoint import _locked, native_path, read_info, resolved_path

    given = native_path(path)
    path = resolved_path(given)
    with _locked(path):  # as _verify: no save's commit removes the files the manifest names meanwhile
        info = read_info(path, slot_files=False)  # a copy without its slot files serves, so it is described too
        manifest = json.loads(info.manifest_json)
        missing = {f["path"] for t in manifest["tables"] for fs in t["slots"].values() for f in fs
                   if not os.path.isfile(os.path.join(path, f["path"]))}
    # Printed after the lock is released: a slow reader of the output (a pager) holds up no save.
    return _print_inspect(given, info, as_json, missing)


_SHARDS_SHOWN = 8  # inspect prints at most this many shards of a table


def _print_inspect(given: str, info, as_json: bool, missing=frozenset()) -> int:
    manifest = json.loads(info.manifest_json)
    if as_json:
        print(json.dumps(manifest, indent=1))
        return 0
    major, minor = info.format_version
    print(f"checkpoint {given}")
    print(f"  format {major}.{minor}, written by embedcore {info.library_version}, generation {info.generation}")
    # The reader validates what loading and serving use; the metadata and the sharding record are
    # printed as they are, whatever their shape (a '?' for what is missing).
    meta = manifest.get("metadata", {})
    features = meta.get("features")
    if isinstance(features, list) and features:
        described = []
        for f in features:
            f = f if isinstance(f, dict) else {}
            length = f.get("max_sequence_length")
            described.append(f"{_shown(f.get('name', '?'))} -> {_shown(f.get('table', '?'))}" +
                             (f" (sequence {length})" if length else ""))
        print("  features: " + ", ".join(described))
    total = 0
    for t in manifest["tables"]:
        files = list(t["values"]) + [f for fs in t["slots"].values() for f in fs]
        size = sum(f["bytes"] for f in files)
        total += size
        stored = sorted({f["dtype"] for f in t["values"]})
        opt = t["optimizer"]
        padding = t["config"].get("padding_idx")  # (format 1.5: pooled lookups leave that id out)
        print(f"  table {_shown(t['name'])}: {t['rows']} x {t['dim']} {t['dtype']} (stored {', '.join(stored)}), "
              f"combiner {t['config'].get('combiner', '?')}"
              f"{'' if padding is None else f', padding_idx {padding}'}, {_human(size)}")
        if opt is None:
            print("    optimizer: none saved (values only)")
        else:
            print(f"    optimizer: {opt['kind']}, step {t['step']}, slots: {', '.join(t['slots']) or 'none'}")
            gone = sorted(f["path"] for fs in t["slots"].values() for f in fs if f["path"] in missing)
            if gone:
                print(f"    slot files missing ({', '.join(gone)}): it serves, but loads without the optimizer "
                      "state only (include_optimizer=False)")
        sharding = t.get("sharding", {})
        print(f"    sharding at save: {sharding.get('plan', '?')} over {sharding.get('world_size', '?')} rank(s); "
              f"{len(files)} file(s)")
        shards = sharding.get("shards", []) if isinstance(sharding.get("shards"), list) else []
        # A table over many ranks: its first and last shards, not a line each (--json has them all).
        shown = shards if len(shards) <= _SHARDS_SHOWN else shards[:_SHARDS_SHOWN - 2] + shards[-2:]
        for k, s in enumerate(shown):
            s = s if isinstance(s, dict) else {}

            def end(start, n):
                return start + n if all(isinstance(v, int) for v in (start, n)) else "?"

            if len(shown) < len(shards) and k == _SHARDS_SHOWN - 2:
                print(f"      ... {len(shards) - len(shown)} more shard(s) (inspect --json lists every one)")
            row_start, col_start = s.get("row_start", "?"), s.get("col_start", "?")
            cols = "" if s.get("cols") == t["dim"] else f", columns [{col_start}, {end(col_start, s.get('cols'))})"
            print(f"      rank {s.get('rank', '?')}: rows [{row_start}, {end(row_start, s.get('rows'))}){cols}")
    print(f"  total {_human(total)}")
    return 0


def _verify(path: str) -> int:
    from .checkpoint import _locked, native_path, resolved_path

    path = resolved_path(native_path(path))
    with _locked(path):  # no save's commit removes the files meanwhile
        return _verify_locked(path)


def _verify_locked(path: str) -> int:
    from . import _embedcore
    from .checkpoint import read_info

    info = read_info(path)
    names = list(info.table_names)
    manifest = json.loads(info.manifest_json)
    # Bytes: each data file's payload (checksums and finiteness, in one pass).
    total = sum(f["bytes"] - 4096 for t in manifest["tables"]
                    for files in [t["values"], *t["slots"].values()] for f in files)
    bar = _progress(total, "verify", unit="B")
    for i in range(len(names)):
        _embedcore.verify_table(info, i, True, True, None if bar is None else bar.update)
    if bar is not None:
        bar.close()

    # Values and every slot hold the same rows: the manifest reader (read_info) refuses an array
    # whose files do not tile [rows, dim] exactly once, which is all the format asks (docs/format.md);
    # a slot may be split into other blocks than the values.
    print(f"{path}: OK ({len(names)} table(s); every checksum matches, every value and slot is finite, "
          "values and every slot cover the whole table)")
    return 0


# The --from formats that take each option: given with another format, it would have no effect.
_CONVERT_OPTIONS = {
    ("dim", "--dim"): ("sok",), ("key_dtype", "--key-dtype"): ("sok",), ("rows", "--rows"): ("sok",),
    ("rename", "--rename"): ("sok",), ("prefix", "--prefix"): ("tf", "torch"),
    ("combiner", "--combiner"): ("tf", "torch"),
}


def _convert(args) -> int:
    for (attr, flag), formats in _CONVERT_OPTIONS.items():
        if args.source_format not in formats and getattr(args, attr) is not None:
            print(f"embedcore convert: {flag} is an option of --from {' and '.join(formats)}; --from "
                  f"{args.source_format} does not take it", file=sys.stderr)
            return 2
    if args.source_format == "torch" and args.no_optimizer:  # (a flag: False when not given)
        print("embedcore convert: --no-optimizer is an option of --from tf and sok; --from torch converts the "
              "values only (a state dict holds no optimizer state)", file=sys.stderr)
        return 2
    if args.source_format == "sok":
        try:
            rows = _name_values(args.rows, "--rows", int, all_allowed=True)
            names = _name_values(args.rename, "--rename", str)
        except ValueError as e:
            print(f"embedcore convert: {e}", file=sys.stderr)
            return 2
        empty = [item for item in args.rename or () if not item.rpartition("=")[2]]
        if empty:
            print(f"embedcore convert: --rename {empty[0]!r}: no table name after '='", file=sys.stderr)
            return 2
    from .checkpoint import check_destination

    check_destination(args.dst, "dst")  # another program's MANIFEST: --overwrite would not help (a save keeps it)
    if os.path.lexists(os.path.join(args.dst, "MANIFEST")) and not args.overwrite:
        print(f"embedcore convert: {args.dst} already holds a checkpoint; pass --overwrite to replace it",
              file=sys.stderr)
        return 1
    if args.source_format == "tf":
        try:
            from embedcore.adapters.tf import convert_tf_checkpoint
        except ImportError as e:
            print(f"embedcore convert: --from tf needs TensorFlow: {e}", file=sys.stderr)
            return 1
        names = convert_tf_checkpoint(args.src, args.dst, prefix=args.prefix, include_optimizer=not args.no_optimizer,
                                      combiner=args.combiner)
        print(f"converted {len(names)} TensorFlow table(s) ({', '.join(names)}) into {args.dst}, combiner "
              f"{args.combiner or 'mean'}")
        return 0
    if args.source_format == "torch":
        try:
            from embedcore.adapters.torch import convert_state_dict
        except ImportError as e:
            print(f"embedcore convert: --from torch needs PyTorch: {e}", file=sys.stderr)
            return 1
        names = convert_state_dict(args.src, args.dst, prefix=args.prefix, combiner=args.combiner or "sum")
        print(f"converted {len(names)} PyTorch table(s) ({', '.join(names)}) into {args.dst}, values only, "
              f"pooled tables with combiner {args.combiner or 'sum'}")
        return 0
    from . import sok

    # sok.convert's steps, with a bar in bytes: the dump's arrays going into the tables, then the save.
    variables = sok.read_dump(args.src, dim=args.dim, key_dtype=args.key_dtype)
    slots = not args.no_optimizer
    arrays = sum(v.values.nbytes + (sum(a.nbytes for a in v.slots.values()) if slots else 0)
                 for v in variables.values())
    bar = _progress(arrays, "convert", unit="B")
    try:
        tables = sok.to_tables(variables, rows=rows, include_optimizer=slots, names=names,
                               progress=None if bar is None else bar.update)
        if bar is not None:
            bar.total = arrays + sok.table_bytes(tables)
            bar.refresh()
        sok.save_tables(args.dst, tables)  # values-only for tables without slots
        if bar is not None:
            bar.update(sok.table_bytes(tables))
    finally:
        if bar is not None:
            bar.close()
    names = [t.name for t in tables]
    print(f"converted {len(names)} SOK variable(s) ({', '.join(names)}) into {args.dst}")
    return 0


def _name_values(items, flag: str, kind, all_allowed: bool = False):
    """`--flag NAME=V` (repeatable) as {NAME: V}; with `all_allowed`, a plain
    `--flag V` (at most one) is the value of every name not given."""
    if not items:
        return None
    default, named = None, {}
    for item in items:
        name, eq, value = item.rpartition("=")
        if not eq and not all_allowed:
            raise ValueError(f"{flag} takes NAME=VALUE, got {item!r}")
        try:
            v = kind(value)
        except ValueError:
            raise ValueError(f"{flag} {item!r}: {value!r} is not a valid {kind.__name__}") from None
        if not eq:
            if default is not None:
                raise ValueError(f"{flag} {item!r}: a plain {flag} N is given twice; give NAME=N per table")
            default = v
        elif not name or name in named:
            raise ValueError(f"{flag} {item!r}: " + ("no name before '='" if not name else f"{name!r} given twice"))
        else:
            named[name] = v
    if not named:
        return default
    return named if default is None else _Defaulted(named, default)


class _Defaulted(dict):
    """{NAME: V} whose missing names get a default (a plain --rows N beside
    --rows NAME=M)."""

    def __init__(self, named, default):
        super().__init__(named)
        self.default = default

    def get(self, key, default=None):
        return super().get(key, self.default)


def _reshard(args) -> int:
    from .distributed import reshard

    # A malformed --plan or --max-file-mb is a ValueError (exit 1, as reshard's own checks of --world
    # and of the plan's kinds and tables; tests/python/test_distributed_checkpoint.py holds to it).
    plan = _plan_arg(args.plan)
    if args.max_file_mb < 0:
        raise ValueError(f"--max-file-mb must be >= 0, got {args.max_file_mb}")
    # (A SRC that is not there: reshard says so, not this.)
    if (os.path.lexists(os.path.join(args.dst, "MANIFEST")) and not args.overwrite and os.path.isdir(args.src)
            and not os.path.samefile(args.src, args.dst)):
        print(f"embedcore reshard: {args.dst} already holds a checkpoint; pass --overwrite to replace it (a reshard "
              "in place, DST the same directory as SRC, needs none)", file=sys.stderr)
        return 1
    print(_summarized(reshard(args.src, args.dst, args.world, plan, max_file_bytes=args.max_file_mb << 20,
                              include_optimizer=not args.no_optimizer)))
    print(f"wrote {args.dst}")
    return 0


def _plan_arg(plan: str):
    """--plan: one kind, or NAME=KIND,NAME=KIND,... as a dict (reshard checks
    the kinds and the table names)."""
    if "=" not in plan:
        return plan
    items = [item.strip() for item in plan.split(",") if item.strip()]
    bad = [item for item in items if item.count("=") != 1 or not all(p.strip() for p in item.split("="))]
    if bad:
        raise ValueError(f"--plan: {bad[0]!r} is not NAME=PLAN (give one plan, or NAME=PLAN,NAME=PLAN,...)")
    pairs = [(name.strip(), kind.strip()) for name, kind in (item.split("=") for item in items)]
    names = [name for name, _ in pairs]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"--plan names table {twice[0]!r} more than once")
    return dict(pairs)


_LISTED = 8  # a plan description lists at most this many shards, or ranks' bytes, in full


def _summarized(description: str) -> str:
    """reshard's plan description, with the lists of a large world cut short:
    a table's shards as the first few, '...' and the last; the bytes per rank
    as min / max / total (the full lists of --world 1048576 are megabytes)."""
    lines = []
    for line in description.splitlines():
        head, sep, rest = line.rpartition(" -> ")
        if sep and line.startswith("  ") and rest.count(", ") >= _LISTED:
            shards = rest.split(", ")
            line = f"{head}{sep}{', '.join(shards[:3])}, ... ({len(shards) - 4} more), {shards[-1]}"
        head, sep, rest = line.partition("bytes per rank (values + slots): ")
        if sep and rest.count(", ") >= _LISTED:
            try:
                per_rank = [int(b.replace(",", "")) for b in rest.split(", ")]
            except ValueError:  # not the numbers expected: as it is
                per_rank = None
            if per_rank:
                line = (f"{head}{sep}min {min(per_rank):,}, max {max(per_rank):,}, total {sum(per_rank):,} "
                        f"over {len(per_rank):,} ranks")
        lines.append(line)
    return "\n".join(lines)


def _cmake_dir() -> int:
    """Prints the directory of embedcore's CMake package (embedcoreConfig.cmake,
    for ``find_package(embedcore CONFIG)``), as ``python -m nanobind
    --cmake_dir`` does. It is ``share/cmake/embedcore`` inside the installed
    package; an editable install's package spans the source tree and the
    build's install tree, so every directory of ``embedcore.__path__`` is
    searched."""
    import embedcore

    for root in embedcore.__path__:
        d = os.path.join(root, "share", "cmake", "embedcore")
        if os.path.isfile(os.path.join(d, "embedcoreConfig.cmake")):
            print(os.path.abspath(d))
            return 0
    print("embedcore --cmake-dir: no share/cmake/embedcore/embedcoreConfig.cmake in the installed package "
          f"({', '.join(embedcore.__path__)}); was it built with EMBEDCORE_C_API=OFF?", file=sys.stderr)
    return 1


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="embedcore", description="embedcore: embedding tables in one native engine")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    parser.add_argument("--cmake-dir", action="store_true",
                        help="print the directory of the CMake package of the C API (libembedcore) and exit: "
                             "cmake -Dembedcore_DIR=\"$(python -m embedcore --cmake-dir)\"")
    sub = parser.add_subparsers(dest="command")

    demo = sub.add_parser("demo", help="train a small click-through model on synthetic data, save it and serve it")
    demo.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    demo.add_argument("--batch-size", type=int, default=1024)
    demo.add_argument("--threads", type=int, default=None, help="engine threads (default: all cores)")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--checkpoint", default=None, help="where to save the model (default: a temporary directory)")
    demo.add_argument("--overwrite", action="store_true",
                      help="replace the checkpoint --checkpoint holds (without it, one there is refused)")

    sub.add_parser("info", help="print what this build holds")
    p = sub.add_parser("inspect", help="describe a checkpoint (reads no values)")
    p.add_argument("path")
    p.add_argument("--json", action="store_true", help="print the whole manifest")
    p = sub.add_parser("verify", help="check every checksum, that values are finite and slots match")
    p.add_argument("path")
    p = sub.add_parser("convert", help="convert another format into an embedcore checkpoint")
    p.add_argument("--from", dest="source_format", required=True, choices=["sok", "tf", "torch"],
                   help="sok: SparseOperationKit dump files; tf: a tf.train.Checkpoint of TPUEmbedding; torch: "
                   "a file of torch.save(model.state_dict()) or a torch.distributed.checkpoint directory holding TorchRec "
                   "collections (values only)")
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--dim", type=int, default=None, help="SOK v1: embedding size, when the file sizes are ambiguous")
    p.add_argument("--key-dtype", choices=["int64", "uint32"], default=None, help="SOK v1: key type")
    p.add_argument("--rows", action="append", default=None, metavar="[NAME=]N",
                   help="SOK: table rows (default: largest key + 1): N for every table, or NAME=N for the SOK "
                   "variable NAME (repeatable; a plain N is then the rows of the others)")
    p.add_argument("--rename", action="append", default=None, metavar="NAME=TABLE",
                   help="SOK: save the SOK variable NAME as table TABLE (repeatable)")
    p.add_argument("--prefix", default=None, help="tf: object path of the embedding in the checkpoint (default: "
                   "found); torch: module path of the collection, before '.embedding_bags' (default: every one)")
    p.add_argument("--combiner", choices=["sum", "mean", "sqrtn"], default=None,
                   help="tf, torch: the combiner written for every pooled table (neither format records it; "
                   "default: tf mean, TableConfig's default; torch sum, TorchRec's)")
    p.add_argument("--no-optimizer", action="store_true", help="convert values only (without it, every optimizer "
                   "slot of the source must convert)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the checkpoint DST holds (without it, a DST with a checkpoint is refused)")

    p = sub.add_parser("reshard", help="rewrite a checkpoint for another number of ranks or sharding plan")
    p.add_argument("src")
    p.add_argument("dst", help="the new checkpoint directory (may be SRC: replaced atomically)")
    p.add_argument("--world", type=int, required=True, help="number of ranks to lay the checkpoint out for")
    p.add_argument("--plan", default="auto",
                   help="table_wise, row_wise, column_wise or auto (default), or NAME=PLAN,... per table")
    p.add_argument("--max-file-mb", type=int, default=64,
                   help="largest piece read and written at once, in MiB of values and slots (bounds memory; "
                        "0: one file per shard)")
    p.add_argument("--no-optimizer", action="store_true",
                   help="write the values only (also takes a table whose optimizer this version does not know)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the checkpoint DST holds when DST is not SRC (without it, such a DST is refused)")

    args = parser.parse_args(argv)
    who = f"embedcore {args.command}" if args.command else "embedcore"
    # convert and reshard create DST: one that did not exist is removed again when the command fails
    # leaving it empty (an empty directory reads as a checkpoint whose MANIFEST is missing).
    new_dst = args.dst if args.command in ("convert", "reshard") and not os.path.lexists(args.dst) else None
    rc = None
    interrupted = False
    try:
        rc = _run(args)
        if sys.stdout is not None:  # (None: started with stdout closed)
            sys.stdout.flush()  # a closed pipe shows here, inside the handler below
    except KeyboardInterrupt:  # Ctrl-C: one line (run_as_program ends the process by SIGINT, no traceback)
        # A checkpoint is replaced atomically: DST is the old one, or, when the interrupt came as the new one was
        # being committed, the new one whole.
        said = (f"; {args.dst} holds its old checkpoint, or the new one whole if it came as that was committed"
                if args.command in ("convert", "reshard") else "")
        print(f"{who}: interrupted{said}", file=sys.stderr)
        interrupted = True
    except BrokenPipeError:
        # The reader of stdout is gone (`embedcore inspect CKPT | head -1`). As the Python docs
        # recommend (library/signal.html, "Note on SIGPIPE"): point stdout at devnull, so that the
        # interpreter's last flush raises nothing, and exit quietly. The status is 141 (128 + SIGPIPE),
        # what a shell reports for a command stopped by its pipe closing early (cat, grep).
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError, AttributeError):  # a stdout without a descriptor (a test's capture)
            pass
        rc = 141
    except (ValueError, OSError) as e:  # CheckpointError is a ValueError
        print(f"{who}: {type(e).__name__}: {e}", file=sys.stderr)
        rc = 1
    except MemoryError as e:  # an argument too large for this machine (--batch-size, --rows)
        print(f"{who}: MemoryError: {e or 'out of memory'}", file=sys.stderr)
        rc = 1
    finally:
        if new_dst is not None and rc != 0 and os.path.isdir(new_dst) and not os.path.islink(new_dst):
            try:
                os.rmdir(new_dst)  # only an empty directory: never anything else
            except OSError:
                pass
    if interrupted:  # (after the clean-up above) the caller's, as any KeyboardInterrupt
        raise KeyboardInterrupt
    if rc is None:
        parser.print_help(sys.stderr)
        return 2
    return rc


def run_as_program() -> int:
    """The `embedcore` command (and ``python -m embedcore``): ``main()``, and
    on Ctrl-C, after its one line, the end Python gives an uncaught
    KeyboardInterrupt (by SIGINT, which a parent shell or make sees) without
    the traceback."""
    # The command's own process: TensorFlow's start-up logging (oneDNN, CPU features), should `convert --from
    # tf` import it, is not this command's output. A user's own setting wins. The oneDNN notice is logged
    # whatever the level unless oneDNN's custom operations are off, which changes nothing here (a conversion
    # restores tensors, it computes nothing). Not in main(): TensorFlow keeps these for the process, and a
    # program that calls main() keeps its own.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
    try:
        return main()
    except KeyboardInterrupt:
        for stream in (sys.stdout, sys.stderr):
            try:
                if stream is not None:
                    stream.flush()
            except (OSError, ValueError):
                pass
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        raise  # (SIGINT could not end it: the interpreter's own handling)


def _run(args) -> Optional[int]:
    """Runs the subcommand (or --version, --cmake-dir); None for none."""
    if args.version:
        from . import __version__

        print(__version__)
        return 0
    if args.cmake_dir:
        return _cmake_dir()
    if args.command == "demo":
        from .demo import run

        return run(steps=args.steps, batch_size=args.batch_size, threads=args.threads, seed=args.seed,
                   checkpoint=args.checkpoint, overwrite=args.overwrite)
    if args.command == "info":
        from . import build_info

        print(json.dumps(build_info(), indent=2))
        return 0
    if args.command == "inspect":
        return _inspect(args.path, args.json)
    if args.command == "verify":
        return _verify(args.path)
    if args.command == "convert":
        return _convert(args)
    if args.command == "reshard":
        return _reshard(args)
    return None
