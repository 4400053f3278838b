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

from hpctrain.data.errors import (
    ConfigError, CorruptFileError, DataError, DtypeError, EmptyDataError, LengthMismatchError,
    MissingFileError, MissingKeyError, NotHDF5Error, PermissionDeniedError,
)

PathLike = Union[str, os.PathLike]
PathsArg = Union[str, os.PathLike, Sequence[Union[str, os.PathLike]]]
FORMAT_ATTR = "hpctrain_format"  # root attribute marking files written by hpctrain
CHECKSUM_ATTR = "sha256"  # dataset attribute: sha256 of the dataset's C-order bytes
SLAB_BYTES = 64 << 20  # read/copy granularity of the tools
NUMERIC_KINDS = "biufc"  # bool, int, uint, float, complex
H5_SUFFIXES = (".h5", ".hdf5", ".hdf", ".he5")


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
        raise MissingFileError("no such file", path=p) from exc
    except OSError as exc:
        text = str(exc)
        if "signature" in text.lower() or "not an hdf5" in text.lower():
            raise NotHDF5Error("not an HDF5 file (no HDF5 signature found)", path=p,
                               hint="convert it first, e.g. `hpctrain data pack` for .npy/.npz/CSV") from exc
        if "ermission" in text:
            raise PermissionDeniedError(f"permission denied ({text})", path=p) from exc
        raise CorruptFileError(f"HDF5 could not open it: truncated or damaged ({text})", path=p,
                               hint="re-create or re-copy the file; `hpctrain data verify` checks files") from exc


def read_error(exc: BaseException, path: str, key: str) -> DataError:
    """Wrap an error raised while reading data (damaged chunk, fletcher32 mismatch)."""
    if isinstance(exc, DataError):
        return exc
    return CorruptFileError(f"reading failed: {exc}", path=path, key=key,
                            hint="the file is damaged (a checksum or decompression failed); "
                                 "re-create it and run `hpctrain data verify` on it")


def get_dataset(f: h5py.File, key: str, path: str) -> h5py.Dataset:
    """``f[key]`` as a numeric dataset with at least one dimension, or a clear error."""
    try:
        obj = f.get(key)
    except (OSError, KeyError, RuntimeError) as exc:
        raise CorruptFileError(f"cannot read key: {exc}", path=path, key=key) from exc
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
                                  path=path, key=key)
    return obj


def dataset_names(f: h5py.Group) -> List[str]:
    """Every dataset below ``f`` (full paths without the leading slash), sorted."""
    names: List[str] = []

    def visit(name: str, obj) -> None:
        if isinstance(obj, h5py.Dataset):
            names.append(name)

    f.visititems(visit)
    return sorted(names)


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
                    path=info.path, key=key)


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
        raise PermissionDeniedError("output directory is not writable", path=str(directory))
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
            raise read_error(exc, path, dset.name.lstrip("/")) from exc
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


def creation_kwargs(dset: h5py.Dataset, rows: Optional[int] = None) -> dict:
    """Keyword arguments that re-create ``dset``'s layout and filters (for ``rows`` samples)."""
    kw: dict = {"dtype": dset.dtype}
    if dset.chunks:
        chunks = list(dset.chunks)
        if rows is not None:
            chunks[0] = max(1, min(chunks[0], rows))
        kw["chunks"] = tuple(chunks)
        if dset.compression:
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
                           if n.endswith(H5_SUFFIXES) and not n.startswith("."))
            if not found:
                raise DataError("directory holds no HDF5 files (*.h5, *.hdf5)", path=p)
            out.extend(found)
        elif any(c in p for c in "*?[") and not os.path.exists(p):
            found = sorted(glob.glob(p))
            if not found:
                raise DataError("pattern matches no file", path=p)
            out.extend(found)
        else:
            out.append(p)
    if not out:
        raise ConfigError("no input files given")
    return out
