"""Serving a checkpoint on CPU: read-only, memory-mapped, thread-safe.

``srv = embedcore.serving.open(path)`` maps each table's values file; opening
reads no values (it takes milliseconds whatever the size), processes that
serve the same checkpoint share its pages, and lookups release the GIL and
may run from many threads. No optimizer state is loaded.

Checksums (``verify``):
- ``True`` / ``"lazy"`` (default): each 4 MiB block of a values file is
  checksummed the first time a lookup touches it (``ServedTable.values()``
  touches them all); a block that fails raises ``CheckpointError`` for every
  lookup that touches it, and is never served.
  The manifest, headers and file sizes are checked on open.
- ``"eager"``: every block is checksummed on open.
- ``False``: no data checksums (headers and sizes are still checked).

Page size: the mappings are advised for transparent huge pages
(``MADV_HUGEPAGE``), so a values file read in through them (from a disk
whose filesystem gives the page cache large folios, such as ext4 and XFS on
recent Linux) is mapped on 2 MiB pages, as a trained table's memory is:
lookups of random rows of a table of GiBs then miss the TLB far less: as
fast as the in-memory table's, where 4 KiB pages took 1.1-1.3x its time on
512 MiB and 2.1-2.7x on 1 GiB here. Pages the cache already holds stay as
they came in: a checkpoint this machine has just saved (the save writes 256 KiB
at a time) is mapped on 4 KiB pages until its cache is dropped (``os.
posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)`` on each ``*.ecd`` file
before it is opened), and a tmpfs (``/dev/shm``) gives huge pages only where
shmem huge pages are enabled (``/sys/kernel/mm/transparent_hugepage/
shmem_enabled``). benchmarks/README.md (``bench_serving_dtypes.py``) has
the figures.

The mapped files must not be truncated or rewritten in place while they are
served: touching a page of a truncated mapping ends the process with SIGBUS,
and bytes rewritten after their block was verified are served unchecked.
embedcore's own saves do neither (they write new files, rename a new
manifest and delete the old files, which a served checkpoint keeps reading
until it is closed); tools that rewrite files in place do.

A ``ServedCheckpoint`` pickles and copies by its absolute path (so it crosses
to ``multiprocessing`` workers under any start method): the copy opens the
directory again, with the same ``verify``, and raises ``CheckpointError`` if
the path holds another checkpoint by then (a newer save, a re-pointed
symlink: its manifest differs), so a copy serves what the original serves.
A forked child serves the parent's handle.
"""
from __future__ import annotations

import json
import zlib
from collections.abc import Hashable
from typing import Dict, Optional

import numpy as np

from . import _embedcore
from . import _nest
from .checkpoint import CheckpointError, absolute_path, config_from_json, native_path
from .config import FeatureConfig
from .embedding import FeatureLookup
from .table import LookupMixin, _bfloat16_dtype

__all__ = ["open", "ServedCheckpoint", "ServedTable"]

_VERIFY = {True: 1, "lazy": 1, "eager": 2, False: 0}


class ServedTable(LookupMixin):
    """One table of a served checkpoint; ``lookup`` takes every input form
    ``Table.lookup`` takes."""

    def __init__(self, mapped, index: int, config, stored_dtype: str):
        self._mapped = mapped
        self._index = index
        self.config = config
        self.name = config.name
        self.rows = config.rows
        self.dim = config.dim
        self.dtype = stored_dtype  # as the values files store it ("uint8_rowwise": 8-bit rows, dequantized on lookup)
        # A PyTorch module's padding_idx (format 1.5), or None: pooled lookups leave that id out of their bags
        # (the sums and the mean's / sqrtn's denominators), as torch.nn.EmbeddingBag does; per-id and sequence
        # lookups give its row, as torch.nn.Embedding does. The engine applies it (MappedCheckpoint::Lookup).
        self.padding_idx = mapped.info.table_padding_idx(index)

    @property
    def _default_combiner(self) -> str:
        return self.config.combiner

    def _native_lookup(self, ids, offsets, weights, code, length, out, keep_padding=False):
        if out is None:
            return self._mapped.lookup(self._index, ids, offsets, weights, code, length, keep_padding)
        self._mapped.lookup_into(self._index, ids, offsets, weights, code, length, out, keep_padding)
        return out

    def values(self) -> np.ndarray:
        """Read-only view of the mapped values, as stored. Unless the
        checkpoint was opened with ``verify=False``, every block of the table
        not yet checked is checksummed first (a pass over the file the first
        time), and a corrupt one raises ``CheckpointError``: no corrupt byte
        is handed out. A table saved in several files (a sharded save) has no
        single view: ``CheckpointError``; its lookups work as any other's.

        A table stored as ``uint8_rowwise`` (``dtype``) has no float view:
        this returns a new float32 ``[rows, dim]`` array of its dequantized
        values, ``scale * code + bias`` rounded once, the bits of
        ``torch.ops.fbgemm.Fused8BitRowwiseQuantizedToFloat`` (also of a
        sharded save). Lookups dequantize inside the pooling instead, as
        FBGEMM's 8-bit bags do and with their bits: each id adds
        ``fma(w * scale, code, acc + w * bias)``; one id alone (a sequence
        or per-id lookup) gives ``fma(w * scale, code, w * bias)``, these
        rows' bits when ``w`` is 1."""
        if self.dtype == "uint8_rowwise":
            return self._mapped.dequantized_values(self._index)
        v = self._mapped.values(self._index)
        if v.dtype == np.uint16:  # bfloat16 bits
            bf16 = _bfloat16_dtype()
            if bf16 is not None:
                v = v.view(bf16)
        return v

    def __repr__(self) -> str:
        return f"ServedTable(name={self.name!r}, rows={self.rows}, dim={self.dim})"


class ServedCheckpoint(FeatureLookup):
    """A checkpoint opened for serving. ``tables`` maps names to
    ``ServedTable``; a checkpoint saved from an ``Embedding`` is also
    callable with the same nested features, like ``TPUEmbeddingForServing``."""

    _trains = False  # no apply_gradients: lookups keep no copies of their ids (see FeatureLookup.lookup)

    def __init__(self, path, verify=True):
        if not isinstance(verify, Hashable) or verify not in _VERIFY:
            raise ValueError(f"verify must be True, 'lazy', 'eager' or False, got {verify!r}")
        path = native_path(path)
        self._mapped = _embedcore.MappedCheckpoint(path, _VERIFY[verify])
        self._verify, self._abspath = verify, absolute_path(path)  # (for __reduce__)
        try:
            self._describe(self._mapped.info)
        except CheckpointError:
            raise
        except (TypeError, ValueError, KeyError, IndexError, AttributeError, RecursionError) as e:
            raise CheckpointError(f"{self._mapped.info.path}: malformed table config or feature metadata in the "
                                  f"manifest: {type(e).__name__}: {e}") from None

    def _generation(self) -> int:
        """The checksum of the manifest served: a save (or a re-pointed
        symlink) gives another."""
        return zlib.crc32(self._mapped.info.manifest_json.encode())

    def __reduce__(self):
        """Pickles and copies (``copy.deepcopy``, ``multiprocessing`` with
        spawn) hold the checkpoint's absolute path and open it again, with
        the same `verify`, wherever they are loaded: they serve the same
        checkpoint, or raise ``CheckpointError`` when the path holds another
        by then (a newer save, a re-pointed symlink)."""
        return _reopen, (self._abspath, self._verify, self._generation())

    def _describe(self, info) -> None:
        self.path = info.path
        self.format_version = tuple(info.format_version)
        self.tables: Dict[str, ServedTable] = {}
        configs = {}
        for i, name in enumerate(info.table_names):
            cfg_json = json.loads(info.table_config_json(i))
            if not isinstance(cfg_json, dict):
                raise CheckpointError(f"{info.path}: table {name!r} has a malformed config")
            rows, dim = info.table_shape(i)  # the manifest's shape is authoritative
            try:
                cfg = config_from_json({**cfg_json, "name": name, "rows": rows, "dim": dim, "optimizer": None},
                                       any_initializer=True)
            except CheckpointError as e:
                raise CheckpointError(f"{info.path}: table {name!r}: {e}") from None
            configs[name] = cfg
            self.tables[name] = ServedTable(self._mapped, i, cfg, info.table_values_dtype(i))
        self._by_config = {id(c): self.tables[n] for n, c in configs.items()}
        self._feature_config = None
        meta = json.loads(info.metadata_json)
        if not isinstance(meta, dict):
            raise CheckpointError(f"{self.path}: manifest metadata must be an object")
        if meta.get("kind") == "embedding" and meta.get("features"):
            if not isinstance(meta["features"], list):
                raise CheckpointError(f"{self.path}: manifest metadata.features must be a list")
            for i, f in enumerate(meta["features"]):  # as the C API checks them, with its messages
                where = f"{self.path}: manifest metadata.features[{i}]"
                if not (isinstance(f, dict) and isinstance(f.get("name"), str) and isinstance(f.get("table"), str)):
                    raise CheckpointError(f"{where} must be an object with a string name and table, got {f!r}")
                if f["table"] not in configs:
                    raise CheckpointError(f"{where}.table names no table of the checkpoint: {f['table']!r}")
                length = f.get("max_sequence_length")
                if type(length) is not int or length < 0:
                    raise CheckpointError(f"{where}.max_sequence_length must be an integer >= 0, got {length!r}")
            features = [FeatureConfig(configs[f["table"]], f["max_sequence_length"], f["name"]) for f in meta["features"]]
            self._features = features
            self._feature_names = [f.name for f in features]
            structure = meta.get("structure") or meta.get("structure_items")
            self._feature_config = _rebuild(structure, features, self.path) if structure else features
            # Inputs meet features in flattening order: the structure names each feature once, in that order.
            index = {id(f): i for i, f in enumerate(features)}
            named = [index[id(f)] for _, f in _nest.flatten_with_paths(self._feature_config)]
            if named != list(range(len(features))):
                raise CheckpointError(f"{self.path}: manifest metadata.structure names features {named} of "
                                      f"{len(features)}; it must name each once, in flattening order")

    @property
    def feature_config(self):
        return self._feature_config

    @property
    def embedding_tables(self) -> Dict[str, ServedTable]:
        return dict(self.tables)

    def _table(self, f: FeatureConfig) -> ServedTable:
        return self._by_config[id(f.table)]

    def lookup(self, features, weights=None):
        """The looked-up features, in the structure of `features` (as
        ``Embedding.lookup``: each feature pooled by its table's combiner, or
        a sequence), from the checkpoint's tables: for a checkpoint saved
        from an ``Embedding``, whose features it records. ``ValueError`` for
        one of tables only (use ``tables[name].lookup``)."""
        if self._feature_config is None:
            raise ValueError(f"{self.path}: this checkpoint holds tables, not features; use .tables[name].lookup")
        return super().lookup(features, weights)

    def __repr__(self) -> str:
        return f"ServedCheckpoint({self.path!r}, tables={list(self.tables)})"


def _rebuild(structure, features, path: str, depth: int = 0):
    if depth > 32 or not isinstance(structure, dict) or len(structure) != 1:
        raise CheckpointError(f"{path}: manifest metadata.structure is malformed")
    if "dict" in structure:
        return {k: _rebuild(v, features, path, depth + 1) for k, v in structure["dict"].items()}
    if "items" in structure:  # a dict whose keys may be ints
        items = structure["items"]
        if not isinstance(items, list) or not all(
                isinstance(kv, list) and len(kv) == 2 and isinstance(kv[0], (str, int)) and not isinstance(kv[0], bool)
                for kv in items):
            raise CheckpointError(f"{path}: manifest metadata.structure_items is malformed")
        return {k: _rebuild(v, features, path, depth + 1) for k, v in items}
    if "list" in structure:
        return [_rebuild(v, features, path, depth + 1) for v in structure["list"]]
    if "tuple" in structure:
        return tuple(_rebuild(v, features, path, depth + 1) for v in structure["tuple"])
    if "feature" in structure:
        i = structure["feature"]
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(features):
            raise CheckpointError(f"{path}: manifest metadata.structure names feature {i!r} of {len(features)}")
        return features[i]
    raise CheckpointError(f"{path}: manifest metadata.structure has an unknown kind {next(iter(structure))!r}")


def _reopen(path: str, verify, generation: int) -> ServedCheckpoint:
    served = ServedCheckpoint(path, verify)
    if served._generation() != generation:
        raise CheckpointError(f"{path}: holds another checkpoint than the one pickled (a newer save, or a re-pointed "
                              "symlink): open it with embedcore.serving.open to serve what it holds now")
    return served


def open(path, verify=True) -> ServedCheckpoint:  # noqa: A001 - the name users expect
    """Opens the checkpoint at `path` for serving (see the module docstring)."""
    return ServedCheckpoint(path, verify)

