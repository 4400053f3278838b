"""Decode stored HDF5 chunks ourselves, in several threads at once.

h5py holds the GIL and its own global lock for the whole of ``H5Dread``, so a compressed
dataset read through h5py decompresses one chunk at a time however many threads ask. The
loader instead reads a chunk's stored bytes (``dset.id.chunk_iter`` gives their offsets and
sizes; ``os.preadv`` reads them) and hands them to :meth:`ChunkCodec.decode`, which undoes the
filter pipeline without holding the GIL for the byte work:

* deflate/gzip (filter 1): CPython's :mod:`zlib`, which releases the GIL while inflating;
* lzf (32000, h5py's own filter) and shuffle (2): the C extension ``hpctrain.data._codecs``.

Filters that hdf5plugin provides (Blosc, Blosc2, bitshuffle, LZ4, Zstd, ...) are undone by
the plugins' own filter functions, called without the GIL (:mod:`hpctrain.data.plugins`).
Anything else (fletcher32, szip, nbit, scaleoffset, ...) is not supported here:
:func:`codec_for` says why and the caller reads such datasets through h5py.

Usage::

    codec, why = codec_for(dset)
    if codec is None:
        ...  # read through h5py; `why` says what prevented the fast path
    out = np.empty(codec.chunk_bytes, dtype=np.uint8)
    codec.decode(stored_bytes, info.filter_mask, out)   # out holds the full (edge-padded) chunk
"""
from __future__ import annotations

import math
import threading
import zlib
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np

from hpctrain.data.errors import DataError

try:
    from hpctrain.data import _codecs
except ImportError:  # optional extension: pip install succeeds without a C compiler
    _codecs = None

FILTER_DEFLATE = 1
FILTER_SHUFFLE = 2
FILTER_FLETCHER32 = 3
FILTER_LZF = 32000

#: Names of the filters one meets in practice, for messages (HDF5 reports a name too, but
#: registered third-party filters that are not loaded report an empty one).
FILTER_NAMES = {
    FILTER_DEFLATE: "deflate",
    FILTER_SHUFFLE: "shuffle",
    FILTER_FLETCHER32: "fletcher32",
    4: "szip",
    5: "nbit",
    6: "scaleoffset",
    FILTER_LZF: "lzf",
    32001: "blosc",
    32004: "lz4",
    32008: "bitshuffle",
    32015: "zstd",
    32017: "sz",
}

_COMPRESSORS = (FILTER_DEFLATE, FILTER_LZF)
_SUPPORTED = (FILTER_SHUFFLE,) + _COMPRESSORS
_NEEDS_EXTENSION = (FILTER_SHUFFLE, FILTER_LZF)
_EXTENSION_MISSING = "hpctrain.data._codecs not built"


@dataclass(frozen=True)
class Filter:
    """One stage of a dataset's filter pipeline, as ``get_filter(i)`` reports it."""

    code: int
    cd_values: tuple[int, ...] = ()
    name: str = ""

    @property
    def label(self) -> str:
        """``name (code)``, e.g. ``fletcher32 (3)``."""
        return f"{self.name or FILTER_NAMES.get(self.code, 'unknown filter')} ({self.code})"


def unsupported_reason(filters: Sequence[Filter], have_extension: bool) -> str:
    """Why :class:`ChunkCodec` cannot decode this pipeline ("" when it can).

    Supported: any number of shuffles followed by at most one compressor (deflate or lzf),
    which is the order h5py writes. Every shuffle must come before the compressor so that each
    stage but the compressor keeps the chunk's decoded size.
    """
    if not filters:
        return "no filters"
    for f in filters:
        if f.code not in _SUPPORTED:
            return f"filter {f.label} is not supported"
    compressors = [i for i, f in enumerate(filters) if f.code in _COMPRESSORS]
    if len(compressors) > 1:
        return "more than one compression filter (" + ", ".join(filters[i].label for i in compressors) + ")"
    if compressors and compressors[0] != len(filters) - 1:
        after = filters[compressors[0] + 1]
        return f"filter {after.label} after the compressor {filters[compressors[0]].label} is not supported"
    if not have_extension and any(f.code in _NEEDS_EXTENSION for f in filters):
        return _EXTENSION_MISSING
    return ""


class ChunkCodec:
    """How to turn one stored chunk of a dataset back into its raw bytes.

    ``chunk_bytes`` = prod(chunk_shape) * itemsize is the decoded size of every chunk (HDF5
    stores edge chunks full-size). :meth:`decode` may be called from several threads at once:
    the only mutable state is a per-thread scratch buffer.
    """

    def __init__(self, filters: Sequence[Filter], chunk_shape: Sequence[int], itemsize: int) -> None:
        filters = tuple(filters)
        reason = unsupported_reason(filters, _codecs is not None)
        if reason:
            raise ValueError(f"cannot decode this filter pipeline: {reason}")
        shape = tuple(int(c) for c in chunk_shape)
        if not shape or any(c < 1 for c in shape):
            raise ValueError(f"chunk_shape must be a non-empty tuple of positive sizes, got {chunk_shape!r}")
        if int(itemsize) < 1:
            raise ValueError(f"itemsize must be >= 1, got {itemsize!r}")
        self.filters: tuple[Filter, ...] = filters
        self.chunk_shape: tuple[int, ...] = shape
        self.itemsize: int = int(itemsize)
        self.chunk_bytes: int = math.prod(shape) * self.itemsize
        # Element size the shuffle filter used: its first client value (HDF5 sets it to the
        # datatype size when the dataset is created), else the dataset's itemsize.
        self._shuffle_sizes = tuple(int(f.cd_values[0]) if f.cd_values else self.itemsize for f in filters)
        self._local = threading.local()

    def __repr__(self) -> str:
        stages = " > ".join(f.label for f in self.filters)
        return f"ChunkCodec({stages}; chunk {self.chunk_shape} x {self.itemsize} B = {self.chunk_bytes} B)"

    def _scratch(self) -> np.ndarray:
        buf = getattr(self._local, "buf", None)
        if buf is None:
            buf = self._local.buf = np.empty(self.chunk_bytes, dtype=np.uint8)
        return buf

    def decode(self, stored: Any, filter_mask: int, out: np.ndarray) -> None:
        """Undo the filters of one stored chunk into ``out``.

        ``stored``: the chunk's bytes as stored in the file (any buffer: bytes, memoryview,
        numpy array). ``filter_mask``: the chunk's mask from ``chunk_iter``/``get_chunk_info``;
        bit i set means filter i was skipped for this chunk (an optional filter that failed,
        e.g. lzf on incompressible data) and is not undone. ``out``: C-contiguous uint8
        array of exactly ``chunk_bytes``.

        Raises :class:`DataError` when the stored bytes do not decode to ``chunk_bytes``
        (corrupt or truncated data) or the mask names filters the pipeline does not have;
        ValueError when ``out`` is unusable (a caller's mistake, not the file's).
        """
        if not (isinstance(out, np.ndarray) and out.dtype == np.uint8 and out.ndim == 1
                and out.flags.c_contiguous and out.flags.writeable):
            raise ValueError("out must be a writable, C-contiguous, 1-d uint8 numpy array, got "
                             + (f"{out.dtype} array of shape {out.shape}" if isinstance(out, np.ndarray)
                                else type(out).__name__))
        if out.size != self.chunk_bytes:
            raise ValueError(f"out has {out.size} bytes, expected chunk_bytes = {self.chunk_bytes}")
        mask = int(filter_mask)
        if mask < 0 or mask >> len(self.filters):
            raise DataError(f"chunk filter mask {mask:#x} names filters beyond the {len(self.filters)} "
                            f"of the pipeline ({', '.join(f.label for f in self.filters)})",
                            hint="the file is corrupt or was written with a different pipeline")
        src = memoryview(stored).cast("B") if not isinstance(stored, bytes) else stored
        # Filters run in pipeline order on write; undo them in reverse, skipping masked ones.
        steps = [i for i in reversed(range(len(self.filters))) if not (mask >> i) & 1]
        compressed = any(self.filters[i].code in _COMPRESSORS for i in steps)
        if not compressed and len(src) != self.chunk_bytes:
            raise DataError(f"stored chunk has {len(src)} bytes, expected {self.chunk_bytes} "
                            f"(chunk {self.chunk_shape} x {self.itemsize} B, not compressed: "
                            f"filter mask {mask:#x})",
                            hint="the file is truncated or corrupt")
        if not steps:
            out[:] = np.frombuffer(src, dtype=np.uint8)
            return
        # Steps that write into a buffer (lzf, unshuffle) cannot work in place: they alternate
        # between out and the scratch buffer, counted from the end so that the last lands in out.
        writers_left = sum(1 for i in steps if self.filters[i].code != FILTER_DEFLATE)
        cur: Any = src
        for i in steps:
            code = self.filters[i].code
            if code == FILTER_DEFLATE:
                # A bytes object of its own: usable as the next step's source without a copy.
                data = _inflate(cur, self.chunk_bytes)
                if writers_left == 0:
                    out[:] = np.frombuffer(data, dtype=np.uint8)
                cur = data
                continue
            writers_left -= 1
            dst = out if writers_left % 2 == 0 else self._scratch()
            if code == FILTER_LZF:
                try:
                    n = _codecs.lzf_decompress_into(cur, dst)
                except ValueError as e:
                    raise DataError(f"lzf chunk ({len(cur)} stored bytes) does not decode to the expected "
                                    f"{self.chunk_bytes} bytes: {e}",
                                    hint="the file is corrupt or truncated") from None
                if n != self.chunk_bytes:
                    raise DataError(f"lzf chunk decodes to {n} bytes, expected {self.chunk_bytes} "
                                    f"(chunk {self.chunk_shape} x {self.itemsize} B)",
                                    hint="the file is corrupt or truncated")
            else:  # shuffle: every input here has chunk_bytes (checked above / by the compressor)
                _codecs.unshuffle_into(cur, dst, self._shuffle_sizes[i])
            cur = dst


def _inflate(src: Any, expected: int) -> bytes:
    """zlib-inflate ``src`` (HDF5's deflate filter writes zlib streams) to exactly ``expected``
    bytes. The output is capped at ``expected`` (a corrupt stream cannot balloon in memory)."""
    d = zlib.decompressobj()
    try:
        data = d.decompress(src, expected)
        if not d.eof:
            # Output full: the rest must be the end of the stream (its checksum), no more data.
            extra = d.decompress(d.unconsumed_tail, 1)
            if extra:
                raise DataError(f"deflate chunk decodes to more than the expected {expected} bytes",
                                hint="the file is corrupt")
            if not d.eof:
                raise DataError(f"deflate chunk is truncated: {len(data)} of {expected} bytes decoded "
                                "and the stream has no end", hint="the file is corrupt or truncated")
    except zlib.error as e:
        raise DataError(f"deflate chunk ({len(src)} stored bytes) does not decode to the expected "
                        f"{expected} bytes: {e}",
                        hint="the file is corrupt or truncated") from None
    if len(data) != expected:
        raise DataError(f"deflate chunk decodes to {len(data)} bytes, expected {expected}",
                        hint="the file is corrupt or truncated")
    return data


def codec_for(dset: Any) -> tuple[Optional[Any], str]:
    """The codec for an h5py dataset's stored chunks (a :class:`ChunkCodec`, or a
    :class:`hpctrain.data.plugins.PluginCodec` for hdf5plugin's filters): ``(codec, "")``, or ``(None, reason)``
    when this module cannot decode them (not chunked, no filters, an unsupported filter, or
    the C extension not built) and the dataset must be read through h5py."""
    if dset.chunks is None:
        return None, "not chunked"
    plist = dset.id.get_create_plist()
    filters = []
    for i in range(plist.get_nfilters()):
        code, _flags, cd_values, name = plist.get_filter(i)
        if isinstance(name, bytes):
            name = name.decode("ascii", "replace")
        filters.append(Filter(int(code), tuple(int(v) for v in cd_values), name.strip("\x00")))
    reason = unsupported_reason(filters, _codecs is not None)
    itemsize = dset.id.get_type().get_size()
    if reason:
        from hpctrain.data.plugins import PluginCodec, plugin_reason

        if plugin_reason(filters):
            return None, reason
        return PluginCodec(filters, dset.chunks, itemsize), ""
    return ChunkCodec(filters, dset.chunks, itemsize), ""
