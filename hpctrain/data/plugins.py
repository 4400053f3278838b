"""Decode chunks stored with hdf5plugin's filters (Blosc, Blosc2, bitshuffle/LZ4, LZ4, Zstd,
...) outside HDF5, several at once.

Through h5py, a plugin-filtered dataset decompresses one chunk at a time: ``H5Dread`` runs
the filter while h5py holds the GIL and its own lock. Each plugin library hdf5plugin ships
describes its filter to HDF5 with ``H5PLget_plugin_info()`` (an ``H5Z_class2_t``), whose
``filter`` member is the function HDF5 itself would call. :class:`PluginCodec` calls that same
function through :mod:`ctypes`, which releases the GIL for the duration of a foreign call:
the prefetch thread and a waiting consumer decode two chunks at once, as they do for lzf.

The filter functions follow HDF5's contract: ``*buf`` is a ``malloc``-ed buffer of
``*buf_size`` bytes holding ``nbytes`` of input; the function returns the output length and
may replace ``*buf`` (freeing the old one), or returns 0 on failure and leaves ``*buf`` alone.
So every buffer handed over comes from the C library's ``malloc`` and goes back to its ``free``.

Supported pipelines: at most one HDF5 shuffle (undone last, by ``hpctrain.data._codecs``)
followed by filters that hdf5plugin provides. Anything else (fletcher32, deflate between
plugins, a filter hdf5plugin lacks) is read through h5py (:func:`plugin_reason` says why).
"""
from __future__ import annotations

import ctypes
import glob
import math
import os
import sys
import threading
from typing import Any, Callable, Dict, Optional, Sequence

import numpy as np

from hpctrain.data.errors import DataError

try:
    import hdf5plugin
except ImportError:  # pragma: no cover - a dependency; without it these filters are unreadable anyway
    hdf5plugin = None

try:
    from hpctrain.data import _codecs
except ImportError:  # pragma: no cover - the optional extension was not built
    _codecs = None

FILTER_SHUFFLE = 2
H5Z_FLAG_REVERSE = 0x0100

_FILTER_FN = ctypes.CFUNCTYPE(ctypes.c_size_t, ctypes.c_uint, ctypes.c_size_t, ctypes.POINTER(ctypes.c_uint),
                              ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_void_p))


class _H5ZClass2(ctypes.Structure):
    """HDF5's ``H5Z_class2_t`` (H5Zpublic.h), as ``H5PLget_plugin_info`` returns it."""

    _fields_ = [("version", ctypes.c_int), ("id", ctypes.c_int), ("encoder_present", ctypes.c_uint),
                ("decoder_present", ctypes.c_uint), ("name", ctypes.c_char_p), ("can_apply", ctypes.c_void_p),
                ("set_local", ctypes.c_void_p), ("filter", _FILTER_FN)]


_libc: Any = None
_found: Dict[int, Optional[Callable]] = {}
_lock = threading.Lock()


def _c_library() -> Any:
    global _libc
    if _libc is None:
        libc = ctypes.CDLL(None)
        libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
        libc.free.restype, libc.free.argtypes = None, [ctypes.c_void_p]
        _libc = libc
    return _libc


def _library_file(name: str) -> Optional[str]:
    """hdf5plugin's library of filter ``name`` (``libh5blosc`` and ``libh5blosc2`` share a prefix)."""
    for path in sorted(glob.glob(os.path.join(hdf5plugin.PLUGIN_PATH, f"libh5{name}*"))):
        rest = os.path.basename(path)[len(f"libh5{name}"):]
        if not rest[:1].isalnum():  # libh5blosc.so for 'blosc', not libh5blosc2.so
            return path
    return None


def plugin_filter(code: int) -> Optional[Callable]:
    """The decoding function of hdf5plugin's filter ``code``, or None when hdf5plugin does not
    provide it here. hdf5plugin has loaded and initialised its libraries when it was imported
    (``init_filter`` binds them to h5py's HDF5), so loading the same file again returns that
    library."""
    with _lock:
        if code in _found:
            return _found[code]
        fn = None
        if hdf5plugin is not None and not sys.platform.startswith("win"):
            names = {int(v): k for k, v in hdf5plugin.FILTERS.items()}
            path = _library_file(names[code]) if code in names else None
            if path is not None and names[code] in getattr(hdf5plugin.get_config(), "registered_filters", {}):
                try:
                    lib = ctypes.CDLL(path)
                    lib.H5PLget_plugin_info.restype = ctypes.POINTER(_H5ZClass2)
                    info = lib.H5PLget_plugin_info().contents
                    if info.id == code and info.decoder_present:
                        fn = info.filter
                except (OSError, AttributeError, ValueError):
                    fn = None
        _found[code] = fn
        return fn


def plugin_reason(filters: Sequence[Any], have_extension: bool = _codecs is not None) -> str:
    """Why :class:`PluginCodec` cannot decode this pipeline ("" when it can). ``filters``:
    objects with ``code`` and ``label`` (:class:`hpctrain.data.codecs.Filter`)."""
    if not filters:
        return "no filters"
    shuffles = [i for i, f in enumerate(filters) if f.code == FILTER_SHUFFLE]
    if len(shuffles) > 1 or (shuffles and shuffles[0] != 0):
        return "a shuffle that is not the first of one filter before the plugins"
    if shuffles and not have_extension:
        return "hpctrain.data._codecs not built"
    for f in filters[len(shuffles):]:
        if plugin_filter(f.code) is None:
            return f"filter {f.label} is not supported"
    if len(shuffles) == len(filters):
        return "no plugin filter"
    return ""


class PluginCodec:
    """Undo a pipeline of hdf5plugin filters (after at most one leading shuffle) for one stored
    chunk. Thread-safe: the state is read-only, every call has its own buffers."""

    def __init__(self, filters: Sequence[Any], chunk_shape: Sequence[int], itemsize: int) -> None:
        filters = tuple(filters)
        reason = plugin_reason(filters)
        if reason:
            raise ValueError(f"cannot decode this filter pipeline: {reason}")
        self.filters = filters
        self.chunk_shape = tuple(int(c) for c in chunk_shape)
        self.itemsize = int(itemsize)
        self.chunk_bytes = math.prod(self.chunk_shape) * self.itemsize
        self._fns = [None if f.code == FILTER_SHUFFLE else plugin_filter(f.code) for f in filters]
        self._cd = [(ctypes.c_uint * max(1, len(f.cd_values)))(*f.cd_values) for f in filters]
        self._shuffle_size = int(filters[0].cd_values[0]) if filters[0].code == FILTER_SHUFFLE and \
            filters[0].cd_values else self.itemsize

    def __repr__(self) -> str:
        stages = " > ".join(f.label for f in self.filters)
        return f"PluginCodec({stages}; chunk {self.chunk_shape} x {self.itemsize} B = {self.chunk_bytes} B)"

    def decode(self, stored: np.ndarray, filter_mask: int, out: np.ndarray) -> None:
        """Undo the filters of one stored chunk (``stored``: a C-contiguous uint8 array) into
        ``out`` (C-contiguous uint8, ``chunk_bytes`` long). Raises :class:`DataError` when a
        filter fails or the result has the wrong size (a damaged chunk)."""
        if out.dtype != np.uint8 or out.ndim != 1 or out.size != self.chunk_bytes or not out.flags.c_contiguous:
            raise ValueError(f"out must be a C-contiguous uint8 array of {self.chunk_bytes} bytes")
        stored = np.ascontiguousarray(stored, np.uint8)
        mask = int(filter_mask)
        if mask < 0 or mask >> len(self.filters):
            raise DataError(f"chunk filter mask {mask:#x} names filters beyond the {len(self.filters)} of the "
                            "pipeline", hint="the file is corrupt or was written with a different pipeline")
        libc = _c_library()
        size = max(1, stored.size)
        ptr = libc.malloc(size)
        if not ptr:
            raise MemoryError(f"cannot allocate {size} bytes to decode a chunk")
        buf, buf_size, n = ctypes.c_void_p(ptr), ctypes.c_size_t(size), stored.size
        try:
            ctypes.memmove(ptr, stored.ctypes.data, n)
            for i in reversed(range(len(self.filters))):
                fn = self._fns[i]
                if fn is None or (mask >> i) & 1:
                    continue
                got = fn(H5Z_FLAG_REVERSE, len(self.filters[i].cd_values), self._cd[i], n,
                         ctypes.byref(buf_size), ctypes.byref(buf))
                if got == 0:
                    raise DataError(f"filter {self.filters[i].label} failed on a chunk of {n} stored bytes",
                                    hint="the file is corrupt or truncated")
                n = got
            if n != self.chunk_bytes:
                raise DataError(f"chunk decodes to {n} bytes, expected {self.chunk_bytes} "
                                f"(chunk {self.chunk_shape} x {self.itemsize} B)", hint="the file is corrupt or truncated")
            if self._fns[0] is None and not mask & 1:  # a leading shuffle: undo it on the way to out
                src = np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(buf.value))
                _codecs.unshuffle_into(src, out, self._shuffle_size)
            else:
                ctypes.memmove(out.ctypes.data, buf.value, n)
        finally:
            libc.free(buf.value)
