"""Opening and checking HDF5 files: every failure becomes one :class:`DataError` naming
the file and the key. Also atomic output (temporary name, then ``os.replace``) and content
checksums. This and the other modules of ``hpctrain.data`` are the only ones importing h5py.
"""
from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple, Union

import h5py
import numpy as np

try:  # registers the filters it ships (Blosc, Blosc2, bitshuffle, LZ4, Zstd, ...) with HDF5
    import hdf5plugin  # noqa: F401
except ImportError:  # reads of plugin-filtered data then fail with FilterUnavailableError
    hdf5plugin = None

from hpctrain.data.errors import (
    ConfigError, CorruptFileError, DataError, DtypeError, EmptyDataError, FilterUnavailableError,
    LengthMismatchError, MissingFileError, MissingKeyError, NotHDF5Error, PermissionDeniedError,
)

PathLike = Union[str, os.PathLike]
PathsArg = Union[str, os.PathLike, Sequence[Union[str, os.PathLike]]]
FORMAT_ATTR = "hpctrain_format"  # root attribute marking files written by hpctrain
CHECKSUM_ATTR = "sha256"  # dataset attribute: sha256 of the dataset's C-order bytes
SLAB_BYTES = 64 << 20  # read/copy granularity of the tools
NUMERIC_KINDS = "biufc"  # bool, int, uint, float, complex
H5_SUFFIXES = (".h5", ".hdf5", ".hdf", ".he5", ".nc", ".nc4", ".nxs")  # netCDF-4 and NeXus are HDF5


def has_mpio() -> bool:
    """True when h5py was built against parallel HDF5 (``driver="mpio"`` is available)."""
    return bool(h5py.get_config().mpi)


def open_h5(path: PathLike, mode: str = "r", **kwargs) -> h5py.File:
    """``h5py.File`` with clear errors: missing, unreadable, not HDF5, truncated/corrupt."""
    p = os.fspath(path)
    if mode == "r":
        if not os.path.exists(p):
            raise MissingFileError("no such file", path=p,
                                   hint="check the path (and the working directory on every node)")
        if os.path.isdir(p):
            raise NotHDF5Error("is a directory, not an HDF5 file", path=p,
                               hint="pass the .h5 files inside it")
        if not os.access(p, os.R_OK):
            raise PermissionDeniedError("permission denied: this user may not read the file",
                                        path=p, hint=f"chmod a+r {p!s} (or run as its owner)")
    try:
        return h5py.File(p, mode, **kwargs)
    except PermissionError as exc:
        raise PermissionDeniedError(f"permission denied ({exc.strerror or exc})", path=p,
                                    hint="check the file's and directory's permissions") from exc
    except FileNotFoundError as exc:
        raise MissingFileError("no such file", path=p,
                               hint="check the path (and the working directory on every node)") from exc
    except OSError as exc:
        text = str(exc)
        if "signature" in text.lower() or "not an hdf5" in text.lower():
            raise NotHDF5Error("not an HDF5 file (no HDF5 signature found)", path=p,
                               hint="convert it first, e.g. `hpctrain data pack` for .npy/.npz/CSV") from exc
        if "ermission" in text:
            raise PermissionDeniedError(f"permission denied ({text})", path=p,
                                        hint="check the file's and directory's permissions") from exc
        raise CorruptFileError(f"HDF5 could not open it: truncated or damaged ({text})", path=p,
                               hint="re-create or re-copy the file; `hpctrain data verify` checks files") from exc


#: Registered HDF5 filter ids -> (name, what provides it). hdf5plugin ships most of them.
PLUGIN_FILTERS = {
    307: ("bzip2", "hdf5plugin"), 32001: ("blosc", "hdf5plugin"), 32004: ("lz4", "hdf5plugin"),
    32008: ("bitshuffle", "hdf5plugin"), 32013: ("zfp", "hdf5plugin"), 32015: ("zstd", "hdf5plugin"),
    32017: ("sz", "hdf5plugin"), 32024: ("sz3", "hdf5plugin"), 32026: ("blosc2", "hdf5plugin"),
    32016: ("fcidecomp", "hdf5plugin"), 4: ("szip", "an HDF5 built with szip/libaec"),
}


def filter_pipeline(dset: h5py.Dataset) -> List[Tuple[int, str]]:
    """``(filter id, name)`` of each stage of the dataset's filter pipeline, in order."""
    try:
        plist = dset.id.get_create_plist()
        stages = [plist.get_filter(i) for i in range(plist.get_nfilters())]
    except (RuntimeError, ValueError, OSError):
        return []
    out = []
    for code, _flags, _values, name in stages:
        name = name.decode(errors="replace") if isinstance(name, bytes) else str(name or "")
        known = PLUGIN_FILTERS.get(int(code), (None,))[0]
        out.append((int(code), known or name.split(";")[0].strip() or "unknown"))
    return out


def unavailable_filters(dset: h5py.Dataset) -> List[Tuple[int, str]]:
    """The stages of ``dset``'s pipeline that this HDF5 cannot run (plugin not found)."""
    return [(code, name) for code, name in filter_pipeline(dset) if not h5py.h5z.filter_avail(code)]


def filter_error(dset: h5py.Dataset, path: str, key: str) -> Optional[FilterUnavailableError]:
    """A FilterUnavailableError naming the first filter HDF5 cannot run, or None."""
    missing = unavailable_filters(dset)
    if not missing:
        return None
    code, name = missing[0]
    provider = PLUGIN_FILTERS.get(code, (name, None))[1]
    hint = (f"pip install {provider} (hpctrain imports it when it opens files)" if provider == "hdf5plugin"
            else f"install {provider}" if provider
            else "install the HDF5 plugin for this filter and point HDF5_PLUGIN_PATH at its directory")
    return FilterUnavailableError(f"filter {code} ({name}) not available: the data cannot be decoded here",
                                  path=path, key=key, hint=hint)


def read_error(exc: BaseException, path: str, key: str, dset: Optional[h5py.Dataset] = None) -> DataError:
    """Wrap an error raised while reading data: a missing filter plugin (with ``dset`` to name
    it), else a damaged chunk or checksum (fletcher32) mismatch."""
    if isinstance(exc, DataError):
        return exc
    missing = filter_error(dset, path, key) if dset is not None else None
    if missing is not None:
        return missing
    text = " ".join(str(exc).split())
    if "filter" in text.lower() and ("not registered" in text or "open directory" in text or "available" in text):
        return FilterUnavailableError(f"a filter of this dataset is not available ({text})", path=path, key=key,
                                      hint="pip install hdf5plugin, or point HDF5_PLUGIN_PATH at the plugin")
    return CorruptFileError(f"reading failed: {text}", path=path, key=key,
                            hint="the file is damaged (a checksum or decompression failed); "
                                 "re-create it and run `hpctrain data verify` on it")


def get_dataset(f: h5py.File, key: str, path: str) -> h5py.Dataset:
    """``f[key]`` as a numeric dataset with at least one dimension, or a clear error."""
    try:
        obj = f.get(key)
    except (OSError, KeyError, RuntimeError) as exc:
        raise CorruptFileError(f"cannot read key: {exc}", path=path, key=key,
                               hint="run `hpctrain data verify` on the file; re-copy it if it is damaged") from exc
    if obj is None or not isinstance(obj, h5py.Dataset):
        found = dataset_names(f)
        what = "no such key" if obj is None else "is a group, not a dataset"
        raise MissingKeyError(f"{what}; datasets in the file: {', '.join(found) or '(none)'}",
                              path=path, key=key, hint="pass keys that exist (see `hpctrain data inspect FILE`)")
    if obj.dtype.kind not in NUMERIC_KINDS:
        raise DtypeError(f"dtype {obj.dtype} is not numeric; expected bool, integers, floats or complex",
                         path=path, key=key, hint="store strings/labels as integer codes")
    if obj.ndim == 0:
        raise LengthMismatchError("is a scalar; expected an array with samples along axis 0",
                                  path=path, key=key,
                                  hint="store samples along axis 0 (shape (N, ...)), or leave this dataset out of the keys")
    return obj


def dataset_names(f: h5py.Group) -> List[str]:
    """Every dataset below ``f`` (full paths without the leading slash), sorted.

    Hard links and external links are followed (a dataset in another file reached through
    an external link is a dataset of this one); soft links are aliases of objects listed
    under their own name and are skipped, which also keeps link cycles finite."""
    names: List[str] = []

    def walk(group: h5py.Group, prefix: str, depth: int) -> None:
        for name in group:
            link = group.get(name, getlink=True)
            if isinstance(link, h5py.SoftLink) or depth > 32:
                continue
            try:
                obj = group.get(name)
            except (KeyError, OSError, RuntimeError):
                continue  # a dangling external link: nothing to read there
            if isinstance(obj, h5py.Dataset):
                names.append(prefix + name)
            elif isinstance(obj, h5py.Group):
                walk(obj, prefix + name + "/", depth + 1)

    walk(f, "", 0)
    return sorted(names)


#: Attributes that point at other objects of the file (dimension scale bookkeeping): a copy
#: into another file would point nowhere, so copies leave them out.
REFERENCE_ATTRS = ("DIMENSION_LIST", "REFERENCE_LIST")


def copyable_attrs(obj: Union[h5py.Dataset, h5py.Group]) -> dict:
    """``obj``'s attributes that can be written to another file as they are."""
    out = {}
    for name in obj.attrs:
        if name in REFERENCE_ATTRS:
            continue
        try:
            value = obj.attrs[name]
        except (OSError, TypeError, ValueError, RuntimeError):
            continue  # a type h5py cannot read back: nothing to carry
        if isinstance(value, (h5py.Reference, h5py.RegionReference)) or \
                (isinstance(value, np.ndarray) and value.dtype.kind == "O"):
            continue
        out[name] = value
    return out


def in_file(dset: h5py.Dataset, path: PathLike) -> bool:
    """True when ``dset``'s bytes are in the file ``path`` (not behind an external link)."""
    try:
        return os.path.samefile(dset.file.filename, os.fspath(path))
    except (OSError, ValueError):
        return False


def is_dimension_scale(d: h5py.Dataset) -> bool:
    """A coordinate axis (HDF5 dimension scale; netCDF-4 writes one per dimension)."""
    try:
        if h5py.h5ds.is_scale(d.id):
            return True
    except (RuntimeError, ValueError, TypeError, OSError):
        pass
    cls = d.attrs.get("CLASS")
    return (cls.decode(errors="replace") if isinstance(cls, bytes) else str(cls)) == "DIMENSION_SCALE"


@dataclass(frozen=True)
class Layout:
    """A file's datasets sorted by role: per-sample keys, coordinates, other metadata."""

    sample_keys: List[str]
    coordinates: List[str]
    metadata: Dict[str, str]  # name -> why it is not a sample key

    def role(self, name: str) -> str:
        return "sample" if name in self.sample_keys else "coordinate" if name in self.coordinates else "metadata"


def layout_of(f: h5py.File, keys: Optional[Sequence[str]] = None) -> Layout:
    """Which datasets hold one entry per sample.

    ``keys`` (given) or the root ``keys`` attribute (packed files) name them. Otherwise:
    every numeric dataset with an axis that is not a dimension scale, and of those the ones
    whose leading length most of them share (coordinate variables such as ``lat(4)`` or a
    class table do not). A tie between lengths keeps them all, so that the caller reports
    the disagreement instead of guessing."""
    names = dataset_names(f)
    coords = [n for n in names if is_dimension_scale(f[n])]
    meta: Dict[str, str] = {}
    named = list(keys) if keys else recorded_keys(f, names)
    if named:
        for n in names:
            if n not in named and n not in coords:
                meta[n] = "not named as a sample key"
        return Layout(named, coords, meta)
    lengths: Dict[str, int] = {}
    for n in names:
        d = f[n]
        if n in coords:
            continue
        if d.dtype.kind not in NUMERIC_KINDS or d.ndim == 0:
            meta[n] = "not a numeric array"
        else:
            lengths[n] = int(d.shape[0])
    counts = sorted(((list(lengths.values()).count(v), v) for v in set(lengths.values())), reverse=True)
    if len(counts) > 1 and counts[0][0] > counts[1][0]:
        axis = counts[0][1]
        for n, v in list(lengths.items()):
            if v != axis:
                meta[n] = f"{v} rows along axis 0, not the {axis} samples of the other keys"
                del lengths[n]
    return Layout([n for n in names if n in lengths], coords, meta)


def recorded_keys(f: h5py.File, names: Sequence[str]) -> List[str]:
    """The root ``keys`` attribute (JSON list) restricted to datasets present, or []."""
    if "keys" not in f.attrs:
        return []
    try:
        keys = json.loads(f.attrs["keys"])
    except (TypeError, ValueError):
        return []
    return [k for k in keys if k in names] if isinstance(keys, list) else []


@dataclass(frozen=True)
class KeyInfo:
    """What the loader needs to know about one key of one file."""

    shape: Tuple[int, ...]
    dtype: np.dtype
    chunk_rows: int  # rows per HDF5 chunk (for contiguous layout: a ~1 MiB equivalent)
    compression: Optional[str]

    @property
    def row_bytes(self) -> int:
        return int(np.prod(self.shape[1:], dtype=np.int64)) * self.dtype.itemsize


@dataclass(frozen=True)
class FileInfo:
    """Sample count and per-key layout of one file, checked."""

    path: str
    num_samples: int
    keys: Dict[str, KeyInfo] = field(default_factory=dict)


def chunk_rows_of(dset: h5py.Dataset) -> int:
    if dset.chunks:
        return int(dset.chunks[0])
    row = max(1, int(np.prod(dset.shape[1:], dtype=np.int64)) * dset.dtype.itemsize)
    return max(1, (1 << 20) // row)


def describe(path: PathLike, keys: Sequence[str], allow_empty: bool = False) -> FileInfo:
    """Open ``path``, check every key (exists, numeric, same length) and describe it."""
    p = os.fspath(path)
    with open_h5(p) as f:
        infos: Dict[str, KeyInfo] = {}
        lengths: Dict[str, int] = {}
        for key in keys:
            d = get_dataset(f, key, p)
            infos[key] = KeyInfo(tuple(int(s) for s in d.shape), d.dtype, chunk_rows_of(d), d.compression)
            lengths[key] = int(d.shape[0])
    if len(set(lengths.values())) > 1:
        listing = ", ".join(f"{k!r}: {n}" for k, n in lengths.items())
        raise LengthMismatchError(f"keys have different numbers of samples ({listing}); expected equal lengths",
                                  path=p, key=max(lengths, key=lengths.get),
                                  hint="every key must hold one entry per sample along axis 0")
    n = next(iter(lengths.values())) if lengths else 0
    if n == 0 and not allow_empty:
        raise EmptyDataError("has zero samples; expected at least one", path=p, key=keys[0] if keys else None,
                             hint="remove the empty file from the list or re-create it")
    return FileInfo(p, n, infos)


def check_compatible(infos: Sequence[FileInfo], keys: Sequence[str]) -> None:
    """Across files, each key must have the same dtype and per-sample shape."""
    first = infos[0]
    for info in infos[1:]:
        for key in keys:
            a, b = first.keys[key], info.keys[key]
            if a.shape[1:] != b.shape[1:] or a.dtype != b.dtype:
                raise LengthMismatchError(
                    f"sample shape {b.shape[1:]} dtype {b.dtype} differs from {first.path}'s "
                    f"{a.shape[1:]} {a.dtype}; expected the same in every file",
                    path=info.path, key=key,
                    hint="every file must hold the same per-sample shape and dtype; re-pack the odd one")


@contextlib.contextmanager
def atomic_output(path: PathLike) -> Iterator[str]:
    """Yield a temporary name in the target's directory; rename it to ``path`` on success.

    On any error the temporary file is removed, so no half-written output is ever left
    under the final name (``os.replace`` is atomic within one file system).
    """
    final = Path(path)
    directory = final.parent if str(final.parent) else Path(".")
    if not directory.is_dir():
        raise MissingFileError("output directory does not exist", path=str(directory),
                               hint=f"mkdir -p {directory}")
    if not os.access(directory, os.W_OK):
        raise PermissionDeniedError("output directory is not writable", path=str(directory),
                                    hint="choose a writable directory, or fix its permissions")
    tmp = directory / f".{final.name}.tmp-{os.getpid()}"
    try:
        yield str(tmp)
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def slabs(n: int, row_bytes: int, slab_bytes: int = SLAB_BYTES, align: int = 1) -> Iterator[Tuple[int, int]]:
    """[start, stop) row ranges of about ``slab_bytes`` each, multiples of ``align`` rows."""
    rows = max(1, slab_bytes // max(1, row_bytes))
    rows = max(align, rows // align * align)
    for start in range(0, n, rows):
        yield start, min(n, start + rows)


def dataset_checksum(dset: h5py.Dataset, path: str = "?", progress=None) -> str:
    """sha256 of the dataset's bytes in C order (independent of chunking and compression)."""
    h = hashlib.sha256()
    row = int(np.prod(dset.shape[1:], dtype=np.int64)) * dset.dtype.itemsize
    buf = None
    for lo, hi in slabs(dset.shape[0], row, align=chunk_rows_of(dset)):
        if buf is None or buf.shape[0] != hi - lo:
            buf = np.empty((hi - lo,) + dset.shape[1:], dset.dtype)
        try:
            if hi > lo:
                dset.read_direct(buf, np.s_[lo:hi])
        except Exception as exc:
            raise read_error(exc, path, dset.name.lstrip("/"), dset) from exc
        h.update(memoryview(buf).cast("B"))
        if progress is not None:
            progress.update((hi - lo) * row)
    return h.hexdigest()


def array_checksum(arr: np.ndarray) -> str:
    """sha256 of an in-memory array's C-order bytes (same as :func:`dataset_checksum`)."""
    return hashlib.sha256(np.ascontiguousarray(arr).view(np.uint8).reshape(-1).data).hexdigest()


def progress_bar(total: int, desc: str, quiet: bool = False, unit: str = "B"):
    """A tqdm bar on stderr, off when ``quiet`` or stderr is not a terminal."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, unit_scale=True, unit_divisor=1024 if unit == "B" else 1000,
                disable=quiet or not sys.stderr.isatty(), leave=False, file=sys.stderr)


def json_attr(value) -> str:
    return json.dumps(value, sort_keys=True)


H5PY_FILTERS = (1, 2, 3, 4, 5, 6, 32000)  # those h5py's create_dataset names (gzip, shuffle, ...)


def plugin_filter(dset: h5py.Dataset) -> Optional[Tuple[int, tuple]]:
    """``(filter id, client values)`` of the dataset's compression filter when it is a plugin
    one (Blosc, bitshuffle, Zstd, ...), else None."""
    try:
        plist = dset.id.get_create_plist()
        for i in range(plist.get_nfilters()):
            code, _flags, values, _name = plist.get_filter(i)
            if int(code) not in H5PY_FILTERS:
                return int(code), tuple(int(v) for v in values)
    except (RuntimeError, ValueError, OSError):
        pass
    return None


def creation_kwargs(dset: h5py.Dataset, rows: Optional[int] = None) -> dict:
    """Keyword arguments that re-create ``dset``'s layout and filters (for ``rows`` samples)."""
    kw: dict = {"dtype": dset.dtype}
    if dset.chunks:
        chunks = list(dset.chunks)
        if rows is not None:
            chunks[0] = max(1, min(chunks[0], rows))
        kw["chunks"] = tuple(chunks)
        if dset.maxshape != dset.shape:  # resizable (netCDF's unlimited dimension): stays so
            top = dset.maxshape[0] if rows is None or dset.maxshape[0] is None else rows
            kw["maxshape"] = (top,) + tuple(dset.maxshape[1:])
        plugin = plugin_filter(dset)
        if plugin is not None:  # h5py knows it by number only: pass the id and its values
            kw["compression"], kw["compression_opts"] = plugin
        elif dset.compression:
            kw["compression"] = dset.compression
            if dset.compression_opts is not None:
                kw["compression_opts"] = dset.compression_opts
        kw["shuffle"] = bool(dset.shuffle)
        kw["fletcher32"] = bool(dset.fletcher32)
        if dset.scaleoffset is not None:
            kw["scaleoffset"] = dset.scaleoffset
    if dset.fillvalue is not None and dset.dtype.kind in NUMERIC_KINDS:
        kw["fillvalue"] = dset.fillvalue
    return kw


def expand_paths(paths: PathsArg) -> List[str]:
    """Files from a path, a glob, a directory (its HDF5 files, sorted) or a list of those."""
    items = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    out: List[str] = []
    for item in items:
        p = os.fspath(item)
        if os.path.isdir(p):
            found = sorted(os.path.join(p, n) for n in os.listdir(p)
                           if n.endswith(H5_SUFFIXES) and not n.startswith(".")
                           and os.path.isfile(os.path.join(p, n)))
            if not found:
                raise DataError("directory holds no HDF5 files (*.h5, *.hdf5)", path=p,
                                hint="pass the files themselves, or a directory holding *.h5/*.hdf5 files")
            out.extend(found)
        elif any(c in p for c in "*?[") and not os.path.exists(p):
            found = sorted(glob.glob(p))
            if not found:
                raise DataError("pattern matches no file", path=p,
                                hint="check the pattern (quote it so the shell does not expand it)")
            out.extend(found)
        else:
            out.append(p)
    if not out:
        raise ConfigError("no input files given",
                          hint="pass HDF5 files, a directory of them, or a glob such as 'shards/*.h5'")
    return out
