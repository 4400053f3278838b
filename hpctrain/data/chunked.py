"""Rows of compressed HDF5 datasets decoded from their stored chunks, in several threads.

``H5Dread`` of an lzf- or gzip-compressed dataset decompresses one chunk after another while
h5py holds the GIL and its own lock: a prefetch thread reading through HDF5 cannot decompress
while another thread does. :class:`ChunkedKey` instead finds every chunk's file offset and
stored size once (``H5Dchunk_iter``), reads the stored bytes with ``preadv`` and undoes the
filters with :mod:`hpctrain.data.codecs` (lzf and shuffle in C, gzip in zlib, all without the
GIL): one task per chunk, which the prefetch thread and a waiting consumer run together.

Only datasets whose chunks span whole rows, are all allocated and use supported filters are
read this way (:func:`chunked_dataset` says why not otherwise); the result is checked against
an HDF5 read of a few rows before it is used.
"""
from __future__ import annotations

import functools
import threading
from typing import Callable, List, Optional, Tuple

import h5py
import numpy as np

from hpctrain.data.codecs import codec_for
from hpctrain.data.errors import CorruptFileError, DataError
from hpctrain.data.mapped import MappedFile, chunk_table, pread_into

_local = threading.local()


def _buffer(name: str, nbytes: int) -> np.ndarray:
    """A per-thread reusable uint8 buffer of at least ``nbytes`` (first ``nbytes`` returned)."""
    buf = getattr(_local, name, None)
    if buf is None or buf.nbytes < nbytes:
        buf = np.empty(max(nbytes, 1), np.uint8)
        setattr(_local, name, buf)
    return buf[:nbytes]


class ChunkedKey:
    """One compressed dataset of an open file: its chunk table and how to decode a chunk."""

    def __init__(self, dset: h5py.Dataset, codec, table: List[Tuple[int, int, int, int]], mf: MappedFile) -> None:
        self.codec = codec
        self.fd = mf.fd
        self.path = mf.path
        self.key = dset.name.lstrip("/")
        self.num_rows = int(dset.shape[0])
        self.chunk_rows = int(dset.chunks[0])
        self.row_bytes = int(np.prod(dset.shape[1:], dtype=np.int64)) * dset.dtype.itemsize
        table = sorted(table)
        self.offset = np.array([t[1] for t in table], np.int64)
        self.size = np.array([t[2] for t in table], np.int64)
        self.mask = np.array([t[3] for t in table], np.int64)

    def release(self) -> None:
        """Nothing to let go of (the file's descriptor belongs to its :class:`MappedFile`)."""

    def fill_tasks(self, lo: int, hi: int, out: np.ndarray) -> List[Callable[[], None]]:
        """Tasks that write rows ``[lo, hi)`` of the dataset into the C-contiguous ``out``
        (``hi - lo`` rows), one per chunk touched."""
        dst = out.reshape(hi - lo, -1).view(np.uint8)
        c = self.chunk_rows
        return [functools.partial(self._fill, k, max(lo, k * c), min(hi, (k + 1) * c), dst[max(lo, k * c) - lo:])
                for k in range(lo // c, -(-hi // c))]

    def _fill(self, k: int, a: int, b: int, dst: np.ndarray) -> None:
        """Decode chunk ``k`` and put its rows ``[a, b)`` at the start of ``dst``."""
        try:
            stored = _buffer("stored", int(self.size[k]))
            pread_into(self.fd, stored, int(self.offset[k]))
            c0 = k * self.chunk_rows
            whole = self.codec.chunk_bytes
            if a == c0 and (b - a) * self.row_bytes == whole:
                self.codec.decode(stored, int(self.mask[k]), dst[:b - a].reshape(-1))
                return
            chunk = _buffer("chunk", whole)
            self.codec.decode(stored, int(self.mask[k]), chunk)
            rows = chunk.reshape(-1, self.row_bytes)
            np.copyto(dst[:b - a], rows[a - c0:b - c0])
        except (DataError, ValueError, OSError) as exc:
            first = k * self.chunk_rows
            cause = str(exc).split("\nHINT:")[0]
            raise CorruptFileError(f"reading failed: chunk {k} (rows {first}..{first + self.chunk_rows - 1}): {cause}",
                                   path=self.path, key=self.key,
                                   hint="the file is damaged; re-create it and run `hpctrain data verify` on it") from exc


def chunked_dataset(dset: h5py.Dataset, mf: MappedFile) -> Tuple[Optional[ChunkedKey], str]:
    """``dset`` as a :class:`ChunkedKey`, checked against HDF5 reads of a few rows, or
    ``(None, why not)``."""
    try:
        codec, why = codec_for(dset)
        if codec is None:
            return None, why
        n = int(dset.shape[0]) if dset.shape else 0
        if n == 0 or dset.dtype.hasobject:
            return None, "empty or variable-length"
        if tuple(dset.chunks[1:]) != tuple(dset.shape[1:]):
            return None, "chunks do not span whole rows"
        table = chunk_table(dset)
        if table is None:
            return None, "too many chunks to list"
        if len(table) != -(-n // int(dset.chunks[0])) or any(off < 0 for _, off, _, _ in table):
            return None, "not every chunk is allocated"
        if any(off + size > len(mf) for _, off, size, _ in table):
            return None, "a chunk lies past the end of the file"
        ck = ChunkedKey(dset, codec, table, mf)
    except (ValueError, TypeError, RuntimeError, OSError, AttributeError) as exc:
        return None, f"cannot list chunks: {exc}"
    rows = sorted({0, n - 1, n // 2})
    for r in rows:
        got = np.empty((1,) + dset.shape[1:], dset.dtype)
        try:
            for task in ck.fill_tasks(r, r + 1, got):
                task()
        except DataError as exc:
            return None, f"decoding row {r} failed ({exc}); reading through HDF5"
        if not np.array_equal(got.view(np.uint8), np.ascontiguousarray(dset[r:r + 1]).view(np.uint8)):
            return None, f"decoded bytes of row {r} differ from HDF5's"
    return ck, ""
