"""Reading a TensorFlow checkpoint's tensors by rows, in bounded memory.

TensorFlow's reader (``RestoreV2``) reads a whole stored tensor for every
slice asked of it: restoring a 10 GB table in 32 MiB row blocks would read
it 320 times, holding it whole each time. A checkpoint (a "tensor bundle")
is an index, a LevelDB-format table that maps each tensor's name to a
``BundleEntryProto`` (dtype, shape, data file, offset, size, masked
CRC-32C), and data files that hold each tensor's bytes whole, row-major.
``Bundle`` reads the index, then reads rows of a tensor straight from its
data file and checks a tensor's checksum by streaming its bytes.

It reads only what it knows to be plain: a little-endian bundle whose index
blocks are uncompressed, and float32 matrices saved whole. Anything else
(``Bundle.plain`` is None: a tensor saved as slices, another dtype) is left
to ``RestoreV2``, as is a whole checkpoint whose index it cannot parse.
"""
from __future__ import annotations

import os
import struct
from typing import Dict, Optional, Tuple

import numpy as np
from tensorflow.core.framework import types_pb2
from tensorflow.core.protobuf import tensor_bundle_pb2

from embedcore import _embedcore

_MAGIC = 0xDB4775248B80FB57  # LevelDB's table magic, the last 8 bytes of the index
_FOOTER = 48
_CHUNK = 32 << 20


class BundleError(ValueError):
    """The index is not one this reader parses (the caller falls back to TensorFlow's reader)."""


def _unmask(masked: int) -> int:
    """LevelDB's (and TensorFlow's) stored CRC back to the CRC."""
    rot = (masked - 0xA282EAD8) & 0xFFFFFFFF
    return ((rot >> 17) | (rot << 15)) & 0xFFFFFFFF


def _varint(buf: bytes, pos: int) -> Tuple[int, int]:
    value, shift = 0, 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise BundleError("malformed varint")
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, pos
        shift += 7


def _block(data: bytes, handle: bytes) -> bytes:
    """The contents of the block `handle` (varint offset, size) points at,
    after checking its trailer: uncompressed, and its masked CRC-32C."""
    offset, pos = _varint(handle, 0)
    size, _ = _varint(handle, pos)
    if offset + size + 5 > len(data):
        raise BundleError("a block lies outside the index")
    kind = data[offset + size]
    if kind != 0:
        raise BundleError(f"compressed index block (kind {kind})")
    (stored,) = struct.unpack_from("<I", data, offset + size + 1)
    raw = np.frombuffer(data, np.uint8, size + 1, offset)  # the contents and the kind byte
    if _embedcore.crc32c(raw) != _unmask(stored):
        raise BundleError("index block checksum mismatch")
    return data[offset:offset + size]


def _entries(block: bytes):
    """(key, value) of a LevelDB block: prefix-compressed keys, then the restart array."""
    if len(block) < 4:
        raise BundleError("truncated block")
    (restarts,) = struct.unpack_from("<I", block, len(block) - 4)
    end = len(block) - 4 * (restarts + 1)
    if end < 0:
        raise BundleError("malformed block")
    pos, key = 0, b""
    while pos < end:
        shared, pos = _varint(block, pos)
        unshared, pos = _varint(block, pos)
        size, pos = _varint(block, pos)
        if shared > len(key) or pos + unshared + size > end:
            raise BundleError("malformed block entry")
        key = key[:shared] + block[pos:pos + unshared]
        pos += unshared
        yield key, block[pos:pos + size]
        pos += size


class Bundle:
    """The index of the checkpoint at `prefix` (``<prefix>.index``)."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        with open(prefix + ".index", "rb") as f:
            data = f.read()
        if len(data) < _FOOTER or struct.unpack_from("<Q", data, len(data) - 8)[0] != _MAGIC:
            raise BundleError("not a LevelDB table")
        footer = data[len(data) - _FOOTER:]
        _, pos = _varint(footer, 0)  # the metaindex block's handle: unused
        _, pos = _varint(footer, pos)
        index = _block(data, footer[pos:])
        self.entries: Dict[str, tensor_bundle_pb2.BundleEntryProto] = {}
        header = None
        for _, handle in _entries(index):
            for key, value in _entries(_block(data, handle)):
                if key == b"":
                    header = tensor_bundle_pb2.BundleHeaderProto.FromString(value)
                elif b"\0" not in key:  # a tensor's name ("\0"-led keys are its slices, read by RestoreV2)
                    self.entries[key.decode("utf-8", "replace")] = tensor_bundle_pb2.BundleEntryProto.FromString(value)
        if header is None or header.endianness != tensor_bundle_pb2.BundleHeaderProto.LITTLE:
            raise BundleError("no header, or a big-endian bundle")
        self.num_shards = header.num_shards

    def plain(self, key: str) -> Optional[Tuple[int, int]]:
        """[rows, cols] of `key` when it is a float32 matrix saved whole (read here), else None."""
        e = self.entries.get(key)
        if e is None or e.dtype != types_pb2.DT_FLOAT or e.slices or len(e.shape.dim) != 2:
            return None
        rows, cols = (d.size for d in e.shape.dim)
        if rows < 0 or cols < 0 or e.size != rows * cols * 4 or not 0 <= e.shard_id < self.num_shards:
            return None
        return rows, cols

    def data_file(self, key: str) -> str:
        return f"{self.prefix}.data-{self.entries[key].shard_id:05d}-of-{self.num_shards:05d}"

    def _pread(self, f, out: np.ndarray, offset: int, key: str) -> None:
        view = memoryview(out.reshape(-1).view(np.uint8))  # (cast("B") refuses a view of no elements)
        done = 0
        while done < len(view):
            n = os.preadv(f.fileno(), [view[done:]], offset + done)
            if n == 0:
                raise OSError(f"{self.data_file(key)}: truncated: {key} needs bytes up to "
                              f"{self.entries[key].offset + self.entries[key].size}")
            done += n

    def read_rows(self, key: str, start: int, count: int, out: Optional[np.ndarray] = None) -> np.ndarray:
        """Rows [start, start + count) of plain tensor `key`, read into `out`
        (a C-contiguous ``[count, cols]`` float32 array: a table's own rows,
        read without a copy) or a new array; returns it."""
        rows, cols = self.plain(key)
        if not (0 <= start and 0 <= count and start + count <= rows):  # (never bytes of another tensor)
            raise ValueError(f"{key}: rows [{start}, {start + count}) are not rows of its {rows}")
        if out is None:
            out = np.empty((count, cols), np.float32)
        elif out.shape != (count, cols) or out.dtype != np.float32 or not out.flags.c_contiguous:
            raise ValueError(f"{key}: cannot read rows into an array of {out.dtype} {out.shape}")
        with open(self.data_file(key), "rb") as f:
            self._pread(f, out, self.entries[key].offset + start * cols * 4, key)
        return out

    def verify(self, key: str) -> Tuple[float, float]:
        """Raises OSError unless plain tensor `key`'s bytes are all in its data
        file with the checksum its entry records (read in 32 MiB pieces).
        Returns the least and the greatest float in it, found in the same
        pieces as they are read (NaN where one is NaN; (inf, -inf) for no
        floats): whether the values are finite, and a slot's domain, at no
        further read."""
        e = self.entries[key]
        crc, buf = 0, np.empty(min(_CHUNK, e.size), np.uint8)
        lo, hi = np.float32(np.inf), np.float32(-np.inf)
        with open(self.data_file(key), "rb") as f:
            for off in range(0, e.size, _CHUNK):
                piece = buf[:min(_CHUNK, e.size - off)]
                self._pread(f, piece, e.offset + off, key)
                crc = _embedcore.crc32c(piece, crc)
                floats = piece.view(np.float32)  # (_CHUNK is a multiple of 4: each piece holds whole floats)
                if floats.size:  # (np.minimum propagates NaN)
                    lo, hi = np.minimum(lo, floats.min()), np.maximum(hi, floats.max())
        if crc != _unmask(e.crc32c):
            raise OSError(f"{self.data_file(key)}: checksum mismatch in {key} (bytes {e.offset} to "
                          f"{e.offset + e.size})")
        return float(lo), float(hi)
