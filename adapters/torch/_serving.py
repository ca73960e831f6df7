"""``ServedEmbeddingBagCollection`` and ``ServedEmbeddingCollection``: a
checkpoint served in TorchRec's inference shape, as TorchRec's
``QuantEmbeddingBagCollection`` / ``QuantEmbeddingCollection`` serve a model
after ``quantize_inference_model``: a ``KeyedJaggedTensor`` (or the dicts the
training collections take) in, a ``KeyedTensor`` / ``{name: JaggedTensor}``
(or dicts) out.

Every lookup is ``embedcore.serving``'s, on the checkpoint's memory-mapped
tables, of any stored dtype (float32, float16, bfloat16, uint8_rowwise),
through the op ``embedcore::served_lookup`` (one per table), or, for a
KeyedJaggedTensor's pooled tables, one engine call for all of them
(``MappedCheckpoint.lookup_windows_into``). The inputs are taken apart, and
the outputs named, by the training collections' own code
(``_collection._PooledInterface`` / ``_SequenceInterface``), so a served
module gives what the training collection it was saved from gives, bit for
bit. No parameters, no autograd, CPU only.
"""
from __future__ import annotations

import os
from typing import Dict, List, Optional, Sequence

import torch
from torch import Tensor, nn

import embedcore as ec
from embedcore import _embedcore
from embedcore.serving import ServedCheckpoint

from . import _modules, _ops
from ._collection import (EmbeddingBagConfig, EmbeddingConfig, _embedding_names, _is_kjt, _jagged_module,
                          _PooledInterface, _SequenceInterface, _specs)

__all__ = ["ServedEmbeddingBagCollection", "ServedEmbeddingCollection"]


class _ServedCollection(nn.Module):
    """What both served collections share: the checkpoint, the tables checked
    against it, the input checks, the lookup."""

    def __prepare_scriptable__(self):
        raise _modules.refuse_script(self)

    def _serve(self, path, tables: Optional[Sequence], verify, pooled: bool) -> None:
        owner = self._owner
        self._verify = verify  # for a copy's or pickle's opening (a ServedCheckpoint given: True, unknown)
        if isinstance(path, ServedCheckpoint):
            self.checkpoint = path
            self._verify = True
        elif isinstance(path, (str, bytes, os.PathLike)):
            self.checkpoint = ec.serving.open(path, verify=verify)
        else:
            raise TypeError(f"{owner}: path must be a checkpoint directory or an embedcore.serving.ServedCheckpoint, "
                            f"got {type(path).__name__}")
        # Absolute, as the checkpoint opened it: a pickle or copy opens it again from any working directory.
        self._path = self.checkpoint._abspath
        if tables is None:
            tables = _configs_of_features(self.checkpoint, pooled, owner)
        self._specs = _specs(tables, pooled, owner, build=False)
        self._names = _embedding_names(self._specs)
        self._features = {f for s in self._specs for f in s.features}
        self._register()

    def _register(self) -> None:
        pooled = self._specs[0].pooling is not None
        # Unregistered once this module is collected (outputs are the engine's buffers: they need no table).
        tables = [self._checked_table(spec, pooled) for spec in self._specs]
        self._indices = [t._index for t in tables]  # (the tables' in the checkpoint: lookup_windows_into)
        self._handles = [_ops.register(t, holders=(self,), features=spec.features)
                         for t, spec in zip(tables, self._specs)]
        self._handles_t = [_ops.handle_tensor(h) for h in self._handles]  # (what the op takes: see handle_tensor)

    def __getstate__(self):
        """Pickles and copies hold the checkpoint's absolute path:
        ``__setstate__`` opens it again (with the module's `verify`; True for
        a module given a ``ServedCheckpoint``) and checks the tables against
        it again."""
        state = dict(super().__getstate__())
        state["checkpoint"] = self._path
        del state["_handles"]
        state.pop("_handles_t", None)
        return state

    def __setstate__(self, state):
        state = dict(state)
        path = state.pop("checkpoint")
        super().__setstate__(state)
        self.checkpoint = ec.serving.open(path, verify=self._verify)
        self._register()

    def _checked_table(self, spec, pooled: bool):
        """The served table of `spec`, whose shape must be the checkpoint's.
        The pooling is the config's, as in TorchRec (a converted state dict
        records none: its tables all carry ``convert_state_dict``'s one
        ``combiner=``)."""
        where = f"{self._owner}: table '{spec.name}'"
        tables = self.checkpoint.tables
        if spec.name not in tables:
            raise ValueError(f"{where} is not in the checkpoint {self.checkpoint.path} (it holds {list(tables)})")
        t = tables[spec.name]
        if (spec.rows, spec.dim) != (t.rows, t.dim):
            raise ValueError(f"{where} has num_embeddings={spec.rows}, embedding_dim={spec.dim}; the checkpoint's is "
                             f"{t.rows} x {t.dim}")
        return t

    @property
    def device(self) -> torch.device:
        """Where the lookups run: the CPU (TorchRec's ``device``)."""
        return torch.device("cpu")

    def _check_input(self, features) -> None:
        """Refuses tensors off the CPU (TypeError). Features no table reads are
        ignored, as TorchRec's collections (its quantized ones included) and
        the training collections ignore them: one KJT may feed several modules."""
        if _is_kjt(features):
            what = "the KeyedJaggedTensor's "
            tensors = [("values()", features.values()), ("lengths()", features.lengths_or_none()),
                       ("offsets()", features.offsets_or_none()), ("weights()", features.weights_or_none())]
        else:
            what = "the input"
            tensors = [(f"[{k!r}]", t) for k, x in features.items() if k in self._features for t in _tensors_of(x)]
        for name, t in tensors:
            if isinstance(t, Tensor) and not t.is_cpu:
                raise TypeError(f"{self._owner}: {what}{name} is on {t.device}; serving runs on the CPU (the "
                                "checkpoint's memory-mapped tables): give CPU tensors (.cpu())")

    def _table_lookup(self, i: int, ids: List[Tensor], offsets: List[Tensor], weights: List[Tensor],
                      segments: List[int], combiner: int) -> List[Tensor]:
        _ops.refuse_traced_bag_counts(self._owner, segments)
        weights = [w.detach() for w in weights]
        # Eagerly, the op's body without the dispatcher (the same code and results).
        if _ops.plain_eager([*ids, *offsets, *weights]):
            return _ops.served_lookup_impl(self._handles[i], self._specs[i].dim, ids, offsets, weights, segments,
                                           combiner)
        return _ops.served_lookup(self._handles_t[i], self._specs[i].dim, ids, offsets, weights, segments, combiner)

    def extra_repr(self) -> str:
        return f"{self.checkpoint.path!r}, tables={[s.name for s in self._specs]}"


def _tensors_of(x) -> list:
    """The tensors of one dict feature (any form ``_collection._csr`` takes)."""
    jt = _jagged_module()
    if isinstance(x, Tensor):
        return [x]
    if isinstance(x, dict):
        return list(x.values())
    if isinstance(x, (tuple, list)):
        return list(x)
    if isinstance(x, ec.Ragged):
        return [x.values, x.offsets]
    if jt is not None and isinstance(x, jt.JaggedTensor):
        return [x.values(), x.lengths_or_none(), x.offsets_or_none(), x.weights_or_none()]
    return []


def _configs_of_features(served: ServedCheckpoint, pooled: bool, owner: str) -> list:
    """The tables of a checkpoint that records features (an ``ec.Embedding``'s):
    pooled features (``max_sequence_length == 0``) or sequence ones, by table
    in the checkpoint's order, each table's in the features' order."""
    if served.feature_config is None:
        raise ValueError(f"{owner}: the checkpoint {served.path} records tables, not features (only a checkpoint "
                         "of an embedcore Embedding does): pass tables=[...]")
    by_table: Dict[str, List[str]] = {}
    for name, f in zip(served._feature_names, served._features):
        if (f.max_sequence_length == 0) == pooled:
            by_table.setdefault(f.table.name, []).append(name)
    if not by_table:
        kind = "pooled features (max_sequence_length 0)" if pooled else "sequence features (max_sequence_length > 0)"
        raise ValueError(f"{owner}: the checkpoint {served.path} records no {kind}: pass tables=[...]")
    if pooled:
        return [EmbeddingBagConfig(t.rows, t.dim, name=n, feature_names=by_table[n], pooling=t.config.combiner)
                for n, t in served.tables.items() if n in by_table]
    return [EmbeddingConfig(t.rows, t.dim, name=n, feature_names=by_table[n])
            for n, t in served.tables.items() if n in by_table]


class ServedEmbeddingBagCollection(_PooledInterface, _ServedCollection):
    """Pooled lookups of a served checkpoint, shaped like TorchRec's
    ``EmbeddingBagCollection`` (and its inference twin,
    ``QuantEmbeddingBagCollection``).

    path: a checkpoint directory (opened with ``embedcore.serving.open(path,
        verify)``), or an opened ``ServedCheckpoint`` (shared, one mapping).
    tables: ``EmbeddingBagConfig`` (this adapter's or TorchRec's, any
        ``data_type``: the checkpoint's dtype rules); each names a table of
        the checkpoint, of its shape and pooling (its combiner), else
        ``ValueError``. None: the pooled features a checkpoint of an
        ``ec.Embedding`` records, by table.
    is_weighted: use a ``KeyedJaggedTensor``'s weights (TorchRec's flag).

    ``forward`` takes and gives what ``EmbeddingBagCollection`` does (a
    ``KeyedJaggedTensor`` -> ``KeyedTensor``; a dict -> dict), with its
    values for the same tables, bit for bit: float32 outputs whatever the
    stored dtype. ``checkpoint``: the ``ServedCheckpoint``."""

    _owner = "ServedEmbeddingBagCollection"

    def __init__(self, path, tables: Optional[Sequence] = None, is_weighted: bool = False, *, verify=True):
        super().__init__()
        self._serve(path, tables, verify, True)
        self._is_weighted = bool(is_weighted)
        self._dims = [s.dim for s, names in zip(self._specs, self._names) for _ in names]

    def _forward_kjt(self, kjt):
        values, offsets, weights, segments, combiners = self._kjt_segments(kjt)
        out = self._lookup_windows(values, offsets, weights, segments, combiners)
        if out is None:
            return self._lookup_kjt(values, offsets, weights, segments, combiners)
        return _jagged_module().KeyedTensor(keys=self._keys(), length_per_key=self._dims, values=out)

    def _lookup_windows(self, values: Tensor, offsets: Tensor, weights: List[Tensor], segments: List[List[int]],
                        combiners: List[int]) -> Optional[Tensor]:
        """Every table's windows of a KJT in one engine call, each writing its
        columns of the output (``lookup_windows_into``, as the training
        collection's ``_ops.collection_lookup``): the same bits as one op per
        table, without the op's per-table costs (a DLRM-shaped model's 26
        tables). None where the ops must run: under a tracer
        (``torch.compile``), offsets that are not int32 or int64, a bad id (the op
        raises it, naming the feature)."""
        if not _ops.plain_eager([values, offsets, *weights]):
            return None
        source = _ops._cpu_source([values], [offsets], weights, True)
        if source is None:
            return None
        windows = [(index, segs[k + 1], segs[k + 2], combiner)
                   for index, segs, combiner in zip(self._indices, segments, combiners) for k in range(0, len(segs), 3)]
        out = _embedcore.empty_result(segments[0][2], sum(self._dims))  # (the engine's result memory, as _ops')
        try:
            self.checkpoint._mapped.lookup_windows_into(*source, windows, out)
        except (IndexError, ValueError, TypeError):
            return None  # the ops raise it, in the caller's terms
        return torch.from_numpy(out)


class ServedEmbeddingCollection(_SequenceInterface, _ServedCollection):
    """Unpooled (sequence) lookups of a served checkpoint, shaped like
    TorchRec's ``EmbeddingCollection`` (``QuantEmbeddingCollection``): one
    row per id. Arguments as ``ServedEmbeddingBagCollection`` (``tables``:
    ``EmbeddingConfig``, no pooling to check; None: the sequence features of
    an ``ec.Embedding``'s checkpoint), and ``need_indices`` (TorchRec's: the
    output ``JaggedTensor``'s weights are its ids)."""

    _owner = "ServedEmbeddingCollection"

    def __init__(self, path, tables: Optional[Sequence] = None, need_indices: bool = False, *, verify=True):
        super().__init__()
        self._serve(path, tables, verify, False)
        self._need_indices = bool(need_indices)

    def _row_tables(self) -> tuple:
        """The served tables, for ``_ops.collection_rows`` (no autograd)."""
        return [_ops._entry(h).table for h in self._handles], [None] * len(self._handles)
