"""Checkpoints of sharded tables.

Saving: rank 0 picks the generation; every rank writes and fsyncs the files
of its own shards at once (no gather, no rank holding what it does not own);
rank 0 then commits one manifest naming every rank's files and recording the
plan. A rank that fails makes every rank raise before the commit, so the
directory keeps its previous checkpoint.

Loading: every rank reads the manifest and, for each of its shards, verifies
and then copies only the byte ranges of the files that overlap it, whatever
plan and world size wrote them. All ranks verify before any rank loads.
"""
from __future__ import annotations

import contextlib
import json
import numbers
import os
import zlib
from typing import List, Optional

import numpy as np

from .. import _embedcore
from ..checkpoint import (FORMAT_VERSION, CheckpointError, _check_flag, _check_padding, _check_values_dtype,
                          _copy_block, _locked, _metadata, _quantized_tables, _remove_if_created_and_empty,
                          _scratch_dtype, _slot_counts, _table_config_json, absolute_path, native_path,
                          raise_interrupt_after_commit, resolved_path)
from ._comm import RankFailedError, agree, one_thread
from ._plan import MAX_WORLD_SIZE, make_plan  # (reshard's bound on world_size is the plan's)

__all__ = ["save_sharded", "load_sharded", "reshard"]


def _manifest(generation: int, tables: List[dict], metadata: dict) -> str:
    from .. import __version__

    return json.dumps({
        "format": "embedcore.checkpoint", "format_version": list(FORMAT_VERSION), "library_version": __version__,
        "byte_order": "little", "generation": generation, "tables": tables, "metadata": metadata,
    })


def _merge(base: dict, pieces: List[dict]) -> dict:
    """One table entry whose files are every piece's files."""
    out = dict(base)
    out["values"] = [f for p in pieces for f in p["values"]]
    out["slots"] = {name: [f for p in pieces for f in p["slots"][name]] for name in base["slots"]}
    return out


def save_sharded(path, emb, include_optimizer: bool = True, values_dtype: Optional[str] = None,
                 keep: bool = False, metadata: Optional[dict] = None) -> None:
    """`keep`: the tables of other names of a checkpoint at `path` stay in it
    (``Saver.dump_to_file``), copied by rank 0 into the new generation.
    `metadata`: the manifest's, when not `emb`'s features (a framework
    module built on `emb`, whose features are its own: ``{"kind": "table"}``)."""
    path = native_path(path)
    # Rank 0 claims the generation and holds the claim to the end of its commit (every rank's files are of it).
    with one_thread(emb.world, "save"), contextlib.ExitStack() as held:
        _save_sharded(path, emb, include_optimizer, values_dtype, keep, held, metadata)


def _save_sharded(path: str, emb, include_optimizer: bool, values_dtype: Optional[str], keep: bool, held,
                  given_metadata: Optional[dict] = None) -> None:
    comm = emb.world
    error, generation, order = None, None, None
    created = comm.rank == 0 and not os.path.lexists(path)  # removed again if this save fails (when empty)
    try:  # on every rank (the plan is every rank's): each raises the ValueError, not RankFailedError
        _check_flag(include_optimizer, "include_optimizer", "save")
        _check_values_dtype(values_dtype)
        if not keep:  # (a dump counts the tables it keeps too: rank 0, which reads them, checks)
            from ..checkpoint import _check_table_count

            _check_table_count(len(emb._configs), "save")
        if values_dtype == "uint8_rowwise":  # whole rows: each file's rows carry their scale and bias
            for ti, cfg in enumerate(emb._configs):
                split = [s for s in emb._sharding_of(ti).shards if s.cols != emb._effective[cfg].dim]
                if split:
                    raise ValueError(
                        f"save: table '{emb._effective[cfg].name}' is sharded column-wise (a shard holds columns "
                        f"[{split[0].col_start}, {split[0].col_start + split[0].cols}) of "
                        f"{emb._effective[cfg].dim}); values_dtype 'uint8_rowwise' stores whole rows (one scale "
                        f"and bias per row): save it as float32, float16 or bfloat16, or shard it by rows or "
                        f"whole tables")
    except Exception as e:  # noqa: BLE001 - every rank learns it (agree)
        error = e
    if comm.rank == 0 and error is None:
        try:
            metadata = _metadata(emb) if given_metadata is None else given_metadata
            names = [emb._effective[cfg].name for cfg in emb._configs]
            if keep:  # the kept tables' order (Saver._dump_order): a server reloads a dump of the same tables
                from ..checkpoint import Saver

                order = Saver._dump_order(path, names)
            else:
                order = {n: i for i, n in enumerate(names)}
            claim = _embedcore.GenerationClaim(path)
            held.callback(claim.release)
            generation = claim.generation
        except Exception as e:  # noqa: BLE001 - every rank learns it (agree)
            error = e
    # The arguments that decide what each rank writes are compared in the same step: every rank's files go
    # where rank 0 commits them, and rank 0's manifest describes every rank's files (their slots, their dtype).
    mine = (absolute_path(path), bool(include_optimizer), values_dtype,
            "Saver.dump_to_file" if keep else "embedcore.save")
    try:
        answers = agree(comm, error, (generation, order, mine), step=emb.step_name("save: generation"))
    except Exception:  # every rank fails here, before any rank writes: rank 0 drops its claim (and a new directory)
        if comm.rank == 0:
            with contextlib.suppress(Exception):
                if generation is not None:
                    _embedcore.remove_generation(path, generation)
                _remove_if_created_and_empty(path, created)
        raise
    generation, order = answers[0][0], answers[0][1]  # rank 0's
    given = [a for _, _, a in answers]
    differ = [(what, [g[i] for g in given])
              for i, what in enumerate(("paths", "include_optimizer", "values_dtype", "calls"))
              if any(g[i] != given[0][i] for g in given)]
    if differ:
        if comm.rank == 0:
            _embedcore.remove_generation(path, generation)  # its claim
            _remove_if_created_and_empty(path, created)
        what, values = differ[0]
        raise ValueError(f"save: the ranks gave different {what} (" +
                         ", ".join(f"rank {r} {v!r}" for r, v in enumerate(values)) +
                         ("): every rank must save to the same directory, which rank 0 commits" if what == "paths"
                          else "): every rank must make the same call (a dump keeps the other tables there, a save "
                          "replaces them)" if what == "calls"
                          else f"): every rank must pass the same {what} to the collective save") +
                         "; nothing was written")

    error, written = None, []
    try:
        for (ti, si), table in sorted(emb._local.items()):
            s = emb._sharding_of(ti).shards[si]
            prefix = f"t{order[emb._effective[emb._configs[ti]].name]:05d}."
            entry = _embedcore.write_shard_files(path, generation, prefix, si, table._native, s.row_start,
                                                 s.col_start, bool(include_optimizer), values_dtype)
            written.append((ti, si, json.loads(entry)))
    except Exception as e:  # noqa: BLE001 - a full disk on one rank fails the save on all
        error = e
    try:
        everything = agree(comm, error, written, step=emb.step_name("save: shard files"))
    except BaseException as e:
        # A failure every rank saw (this rank's own error or another's): no rank commits, so rank 0, which holds
        # the generation's claim, removes what every rank wrote (one remover: another rank's removal could run
        # late, after the claim is gone and a new save has claimed the generation again). Not on anything else
        # (an interrupt on one rank): rank 0 may be committing. If rank 0 is gone, the next commit removes them.
        if e is error or isinstance(e, RankFailedError):  # every rank is here
            failed = None
            if comm.rank == 0:
                try:
                    _embedcore.remove_generation(path, generation)
                    _remove_if_created_and_empty(path, created)
                except Exception as c:  # noqa: BLE001 - the save's own error is the one to raise
                    failed = c
            # Every rank waits for the removal before it raises: under MPI an error left uncaught on another
            # rank aborts the whole job, which would cut rank 0's removal short and leave the files.
            with contextlib.suppress(Exception):
                agree(comm, failed, step=emb.step_name("save: removal"))
        raise

    error = None
    if comm.rank == 0:
        try:
            pieces = sorted((p for rank_pieces in everything for p in rank_pieces), key=lambda p: (p[0], p[1]))
            tables = []
            for ti, cfg in enumerate(emb._configs):
                eff = emb._effective[cfg]
                mine = [p[2] for p in pieces if p[0] == ti]
                entry = _merge(mine[0], mine)
                entry["rows"], entry["dim"] = eff.rows, eff.dim
                entry["sharding"] = {**emb._sharding_of(ti).to_json(), "world_size": comm.size}
                entry["config"] = _table_config_json(eff)
                tables.append((order[eff.name], entry))
            if keep:
                from ..checkpoint import Saver

                kept, metadata = Saver._kept_entries(path, generation, {e["name"] for _, e in tables}, order, metadata)
                tables += kept
            tables = [e for _, e in sorted(tables, key=lambda pair: pair[0])]
            _embedcore.commit_checkpoint(path, _manifest(generation, tables, metadata))
        except Exception as e:  # noqa: BLE001
            error = e
            # Rank 0's own commit failed (it alone commits): it removes every rank's files of the save,
            # unless the manifest's rename happened and a later step failed (then that is the checkpoint).
            _embedcore.remove_generation(path, generation)
        except BaseException as e:  # Ctrl-C while the commit waited for the directory's lock: the same, then raised
            _embedcore.remove_generation(path, generation)
            raise_interrupt_after_commit(e, path, generation)
            raise
    agree(comm, error, step=emb.step_name("save: commit"))


@contextlib.contextmanager
def _removed_on_failure(path: str, generation: int):
    """For a single process's save (``reshard``): on an exception, removes the
    files of its `generation` from `path` (unless the manifest's rename made
    that generation the checkpoint), then lets the exception go on, so that a
    save that failed on a full disk frees what it wrote."""
    try:
        yield
    except BaseException as e:
        _embedcore.remove_generation(path, generation)
        raise_interrupt_after_commit(e, path, generation)
        raise


def load_sharded(path, emb, include_optimizer: bool = True) -> None:
    path = resolved_path(native_path(path))
    with one_thread(emb.world, "load"), _locked(path):  # no save's commit removes these files meanwhile
        _load_sharded(path, emb, include_optimizer)


def _load_sharded(path: str, emb, include_optimizer: bool) -> None:
    comm = emb.world
    files = _embedcore.LoadFiles()  # opened by the verification, read by the copy
    try:
        _load_sharded_with(path, emb, include_optimizer, comm, files)
    finally:
        files.close()


def _load_sharded_with(path: str, emb, include_optimizer: bool, comm, files) -> None:
    error, plan, read = None, [], None
    try:
        _check_flag(include_optimizer, "include_optimizer", "load")
        info = _embedcore.read_info(path, bool(include_optimizer))
        read = (path, zlib.crc32(info.manifest_json.encode()))
        names = list(info.table_names)
        index = {name: k for k, name in enumerate(names)}
        for (ti, si), table in sorted(emb._local.items()):
            eff = emb._effective[emb._configs[ti]]
            if eff.name not in index:
                raise CheckpointError(f"{info.path}: has no table '{eff.name}' (it holds {names})")
            k = index[eff.name]
            if tuple(info.table_shape(k)) != (eff.rows, eff.dim):
                rows, dim = info.table_shape(k)
                raise CheckpointError(f"{info.path}: table '{eff.name}' is {rows} x {dim}, the embedding's is "
                                      f"{eff.rows} x {eff.dim}")
            _check_padding(info, k, table)
            s = emb._sharding_of(ti).shards[si]
            _embedcore.verify_table_block(info, k, table._native, s.row_start, s.col_start, bool(include_optimizer),
                                          files)
            plan.append((k, table, s))
        files.check_unchanged()  # (a file changed after its verification: refused here, on every rank)
    except Exception as e:  # noqa: BLE001
        error = e
    # Every rank's blocks verified before any rank changes, and of one checkpoint: a symlink re-pointed, or a
    # commit, between two ranks' reads of the manifest would mix two.
    answers = agree(comm, error, (read, bool(include_optimizer)), step=emb.step_name("load: verify"))
    opts = [o for _, o in answers]
    if any(o != opts[0] for o in opts):  # some ranks would load slots, the others not: one inconsistent state
        raise ValueError("load: the ranks gave different include_optimizer (" +
                         ", ".join(f"rank {r} {o!r}" for r, o in enumerate(opts)) +
                         "): every rank must pass the same include_optimizer to the collective load; nothing "
                         "was loaded")
    reads = [r for r, _ in answers]
    if any(r[1] != reads[0][1] for r in reads):  # the manifests (their paths may differ between hosts)
        raise CheckpointError("load: the ranks read different checkpoints (" +
                              ", ".join(f"rank {r}: {p!r}" for r, (p, _) in enumerate(reads)) +
                              "; a link re-pointed or a save committed meanwhile); nothing was loaded, load again")
    error = None
    try:
        _embedcore.load_tables(info, [(k, table._native, s.row_start, s.col_start) for k, table, s in plan],
                               bool(include_optimizer), files,
                               f" (a sharded load, rank {comm.rank} of {comm.size}: the other ranks' blocks "
                               "loaded, or failed too; load again, on every rank)")
    except Exception as e:  # noqa: BLE001
        error = e
    agree(comm, error, step=emb.step_name("load: read"))


def _same_directory(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def reshard(src, dst, world_size: int, plan="auto", max_file_bytes: int = 64 << 20,
            include_optimizer: bool = True) -> str:
    """Rewrites the checkpoint `src` as `dst` laid out for `world_size` ranks
    under `plan` (a kind, "auto", or a dict by table name), without a training
    job: each table block is read, verified and written in pieces of at most
    `max_file_bytes` of values and slots (0: one file per shard), so memory
    stays bounded whatever the table size. Any world size and plan can load
    any checkpoint; resharding lays the files out so that each rank reads
    whole files. `dst` may be `src` (replaced atomically).
    `include_optimizer=False` writes the values alone (a values-only
    checkpoint, as ``save(..., include_optimizer=False)`` makes); it also
    takes the values of a table whose optimizer this version does not know,
    which a reshard with its optimizer state refuses. Returns the plan's
    description."""
    include_optimizer = _check_flag(include_optimizer, "include_optimizer", "reshard")
    for what, value in (("world_size", world_size), ("max_file_bytes", max_file_bytes)):
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
            raise TypeError(f"reshard: {what} must be an int, got {value!r}")
    world_size, max_file_bytes = int(world_size), int(max_file_bytes)
    if not 1 <= world_size <= MAX_WORLD_SIZE:
        raise ValueError(f"reshard: world_size must be an int in [1, {MAX_WORLD_SIZE}], got {world_size!r}")
    if max_file_bytes < 0:
        raise ValueError(f"reshard: max_file_bytes must be an int >= 0, got {max_file_bytes!r}")
    src, dst = native_path(src, "src"), native_path(dst, "dst")
    # Resolved once, as load, verify and serving do: every read opens the files of one directory even while a
    # link such as /models/current is re-pointed to another checkpoint meanwhile.
    src = resolved_path(src)

    claim = None
    created = not os.path.lexists(dst)  # removed again if the reshard fails (when empty)
    try:
        if not created and _same_directory(src, dst):
            # In place: dst's claim before src's lock, whose shared hold would keep the claim from removing what
            # saves that died left (it takes the directory's lock without waiting): a reshard into a disk they
            # filled would fail for ever.
            claim = _embedcore.GenerationClaim(dst)
        # src's shared lock from the first read of its manifest to the last read of its files: a save's commit
        # into src waits for it, so the manifest read and the files read are of one checkpoint. Released before
        # dst's commit (which takes dst's lock exclusive, and cleans src when it is dst).
        with _locked(src):
            info = _embedcore.read_info(src, bool(include_optimizer))  # (values only: no slot file is read)
            manifest = json.loads(info.manifest_json)
            quantized = _quantized_tables(manifest)
            if quantized:
                raise CheckpointError(
                    f"reshard: {src}: table '{quantized[0]}' is stored as uint8_rowwise (a lossy export); a reshard "
                    f"would dequantize and quantize it again, which does not give its rows back: export the trained "
                    f"table again with the layout you need (save_sharded / save with values_dtype='uint8_rowwise')")
            for k, name in enumerate(info.table_names):
                if include_optimizer and info.table_unknown_optimizer(k):
                    raise CheckpointError(
                        f"{src}: table '{name}' was saved with optimizer '{info.table_unknown_optimizer(k)}', which "
                        f"this version does not know; reshard with include_optimizer=False (--no-optimizer) to take "
                        f"the values only, or upgrade embedcore")
            if not include_optimizer:  # every table as a values-only save writes it
                manifest["tables"] = [{**t, "optimizer": None, "slots": {}, "step": 0} for t in manifest["tables"]]
            specs = [(t["name"], t["rows"], t["dim"], t["dtype"], *_slot_counts(t)) for t in manifest["tables"]]
            layout = make_plan(specs, world_size, plan)  # bad arguments are refused before dst is created
            for t in manifest["tables"]:
                count = sum(-(-s.rows // _rows_per_piece(t, s, max_file_bytes)) for s in layout[t["name"]].shards)
                if count > _MAX_PIECES:
                    fewer = f" or lower world_size ({world_size})" if world_size > 1 else ""
                    raise ValueError(f"reshard: table '{t['name']}' would be written in {count} pieces, over "
                                     f"{_MAX_PIECES}: raise max_file_bytes ({max_file_bytes}; --max-file-mb){fewer}")
            if claim is None:
                claim = _embedcore.GenerationClaim(dst)
            with _removed_on_failure(dst, claim.generation):
                tables = _reshard_into(info, manifest, layout, dst, claim.generation, world_size, max_file_bytes)
        with _removed_on_failure(dst, claim.generation):
            _embedcore.commit_checkpoint(dst, _manifest(claim.generation, tables, manifest["metadata"]))
    except BaseException:
        if claim is not None:
            claim.release()
            claim = None
        _remove_if_created_and_empty(dst, created)
        raise
    finally:
        if claim is not None:
            claim.release()
    return layout.describe()


_MAX_PIECES = 99999  # a piece's number is 5 digits of its file names


def _stored_dtype(t: dict) -> Optional[str]:
    """The dtype a table's values files store when it is not the table's
    (an export may store float32 as float16): kept by a reshard."""
    stored = {f["dtype"] for f in t["values"]}
    values_dtype = stored.pop() if len(stored) == 1 else None
    return None if values_dtype == t["dtype"] else values_dtype


def _rows_per_piece(t: dict, s, max_file_bytes: int) -> int:
    """Rows of shard `s` of table `t` that a reshard writes in one piece:
    at most `max_file_bytes` of values and slots (0: the whole shard)."""
    element = {"float32": 4, "float16": 2, "bfloat16": 2}
    slots, row_slots = _slot_counts(t)
    row_bytes = s.cols * (element[_stored_dtype(t) or t["dtype"]] + 4 * slots) + 4 * row_slots
    return s.rows if max_file_bytes == 0 else max(1, max_file_bytes // row_bytes)


def _pieces(t: dict, ts, max_file_bytes: int):
    """The (shard, first row, rows) pieces a reshard writes of table `t` laid out as `ts`."""
    for s in ts.shards:
        chunk = _rows_per_piece(t, s, max_file_bytes)
        for r0 in range(s.row_start, s.row_start + s.rows, chunk):
            yield s, r0, min(chunk, s.row_start + s.rows - r0)


def _reshard_into(info, manifest: dict, layout, dst: str, generation: int, world_size: int,
                  max_file_bytes: int) -> list:
    tables = []
    for k, t in enumerate(manifest["tables"]):
        ts = layout[t["name"]]
        has_opt = t["optimizer"] is not None
        values_dtype = _stored_dtype(t)
        pieces = []
        for index, (s, r0, n) in enumerate(_pieces(t, ts, max_file_bytes)):
            block = _embedcore.table_like(info, k, n, s.cols, _scratch_dtype(values_dtype))
            _copy_block(info, k, block, r0, s.col_start, has_opt)
            pieces.append(json.loads(_embedcore.write_shard_files(dst, generation, f"t{k:05d}.", index, block,
                                                                  r0, s.col_start, has_opt, values_dtype)))
            del block
        entry = _merge(t, pieces)
        entry["sharding"] = {**ts.to_json(), "world_size": world_size}
        tables.append(entry)
    return tables
