"""``pack``: .npy / .npz / CSV files or the scikit-learn digits data -> one chunked HDF5 file.

The file gets, at the root, ``hpctrain_format``, ``num_samples``, ``keys`` and ``schema``
(JSON) and a ``source`` description; every dataset gets a ``sha256`` attribute: the
checksum of its C-order bytes, which ``verify`` recomputes and ``shard``/``merge`` carry.
"""
from __future__ import annotations

import csv
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import h5py
import numpy as np

import hpctrain
from hpctrain.data.errors import (
    ConfigError, DataError, DtypeError, EmptyDataError, LengthMismatchError, MissingFileError,
    PermissionDeniedError,
)
from hpctrain.data.h5files import (
    CHECKSUM_ATTR, FORMAT_ATTR, NUMERIC_KINDS, array_checksum, atomic_output, json_attr, progress_bar,
)
from hpctrain.extras import require

DIGITS = ("digits", "sklearn:digits")
COMPRESSIONS = ("none", "gzip", "lzf")
CHUNK_BYTES = 1 << 20


@dataclass(frozen=True)
class PackResult:
    """What ``pack`` wrote."""

    path: str
    num_samples: int
    keys: Tuple[str, ...]
    nbytes: int


def _check_readable(path: str) -> None:
    if not os.path.exists(path):
        raise MissingFileError("no such file", path=path)
    if not os.access(path, os.R_OK):
        raise PermissionDeniedError("permission denied: this user may not read the file", path=path)


def load_digits_arrays() -> Dict[str, np.ndarray]:
    """The scikit-learn digits set (1797 8x8 images, shipped with scikit-learn, no download;
    ``pip install 'hpctrain[examples]'``)."""
    datasets = require("sklearn.datasets", "the digits dataset")
    d = datasets.load_digits()
    return {"x": d.data.astype(np.float32), "y": d.target.astype(np.int64)}


def load_npy(path: str, key: Optional[str] = None) -> Dict[str, np.ndarray]:
    _check_readable(path)
    try:
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise DataError(f"cannot read as .npy: {exc}", path=path,
                        hint="is it a numpy .npy file? (object arrays are not supported)") from exc
    return {key or Path(path).stem: arr}


def load_npz(path: str) -> Dict[str, np.ndarray]:
    _check_readable(path)
    try:
        with np.load(path, allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    except (ValueError, OSError, EOFError) as exc:
        raise DataError(f"cannot read as .npz: {exc}", path=path) from exc


def load_csv(path: str, label_column: Optional[str] = None, dtype: str = "float32") -> Dict[str, np.ndarray]:
    """Numeric CSV -> ``x`` (all columns but the label) and ``y`` (the label column, if named).

    A first row that is not all numbers is taken as the header. ``label_column`` is a header
    name or a 0-based column number.
    """
    _check_readable(path)
    with open(path, newline="") as fh:
        rows = [r for r in csv.reader(fh) if r and any(c.strip() for c in r)]
    if not rows:
        raise EmptyDataError("CSV file has no rows", path=path)

    def numeric(row: List[str]) -> bool:
        try:
            [float(c) for c in row]
            return True
        except ValueError:
            return False

    header = None if numeric(rows[0]) else [c.strip() for c in rows[0]]
    body = rows[1:] if header else rows
    width = len(rows[0])
    values = np.empty((len(body), width), dtype=np.float64)
    for i, row in enumerate(body):
        line = i + (2 if header else 1)
        if len(row) != width:
            raise LengthMismatchError(f"line {line} has {len(row)} columns; expected {width}", path=path)
        try:
            values[i] = [float(c) for c in row]
        except ValueError as exc:
            raise DtypeError(f"line {line}: not a number ({exc}); expected numeric columns only", path=path,
                             hint="encode categories as integer codes first") from exc
    label: Optional[int] = None
    if label_column is not None:
        if header and label_column in header:
            label = header.index(label_column)
        elif str(label_column).lstrip("-").isdigit() and -width <= int(label_column) < width:
            label = int(label_column) % width
        else:
            raise ConfigError(f"label column {label_column!r} not found; columns: {header or list(range(width))}",
                              path=path)
    out: Dict[str, np.ndarray] = {}
    if label is None:
        out["x"] = values.astype(dtype)
    else:
        out["x"] = np.delete(values, label, axis=1).astype(dtype)
        y = values[:, label]
        out["y"] = y.astype(np.int64) if np.all(y == np.round(y)) else y.astype(dtype)
    return out


def load_source(source: str, *, key: Optional[str] = None, label_column: Optional[str] = None,
                csv_dtype: str = "float32") -> Dict[str, np.ndarray]:
    """One input -> ``{key: array}``."""
    if source in DIGITS:
        return load_digits_arrays()
    suffix = Path(source).suffix.lower()
    if suffix == ".npy":
        return load_npy(source, key)
    if suffix == ".npz":
        return load_npz(source)
    if suffix in (".csv", ".txt"):
        return load_csv(source, label_column, csv_dtype)
    _check_readable(source)
    raise DataError(f"unknown input type {suffix or '(no suffix)'!r}; expected .npy, .npz, .csv or 'digits'",
                    path=source)


def default_chunk_rows(arrays: Dict[str, np.ndarray], chunk_bytes: int = CHUNK_BYTES) -> int:
    """Rows per chunk: about ``chunk_bytes`` for the widest key (the same for all keys)."""
    widest = max(int(np.prod(a.shape[1:], dtype=np.int64)) * a.dtype.itemsize for a in arrays.values())
    return max(1, chunk_bytes // max(1, widest))


def pack(
    sources: Sequence[str],
    out: str,
    *,
    key: Optional[str] = None,
    label_column: Optional[str] = None,
    csv_dtype: str = "float32",
    compression: Optional[str] = None,
    compression_opts: Optional[int] = None,
    shuffle_filter: bool = False,
    fletcher32: bool = False,
    chunk_rows: Optional[int] = None,
    quiet: bool = False,
) -> PackResult:
    """Write ``sources`` (one sample per row along axis 0 of every array) to ``out``."""
    if not sources:
        raise ConfigError("nothing to pack", hint="example: hpctrain data pack digits --out digits.h5")
    if compression in (None, "none"):
        compression = None
    elif compression not in COMPRESSIONS:
        raise ConfigError(f"unknown compression {compression!r}; expected one of {', '.join(COMPRESSIONS)}")
    if key and len(sources) > 1:
        raise ConfigError("--key names the dataset of a single .npy input; with several inputs each "
                          ".npy file's stem is its key")
    arrays: Dict[str, np.ndarray] = {}
    origin: Dict[str, str] = {}
    for src in sources:
        for k, a in load_source(src, key=key, label_column=label_column, csv_dtype=csv_dtype).items():
            if k in arrays:
                raise ConfigError(f"key {k!r} comes from both {origin[k]} and {src}", path=src, key=k)
            arrays[k], origin[k] = a, src
    for k, a in arrays.items():
        if a.dtype.kind not in NUMERIC_KINDS:
            raise DtypeError(f"dtype {a.dtype} is not numeric", path=origin[k], key=k)
        if a.ndim == 0:
            raise LengthMismatchError("is a scalar; expected samples along axis 0", path=origin[k], key=k)
    lengths = {k: a.shape[0] for k, a in arrays.items()}
    if len(set(lengths.values())) > 1:
        longest = max(lengths, key=lengths.get)
        raise LengthMismatchError(f"keys have different numbers of samples {lengths}; expected equal",
                                  path=origin[longest], key=longest)
    n = next(iter(lengths.values()))
    if n == 0:
        k0 = next(iter(arrays))
        raise EmptyDataError("has zero samples", path=origin[k0], key=k0)
    rows = int(chunk_rows or default_chunk_rows(arrays))
    rows = max(1, min(rows, n))
    filters: dict = {}
    if compression:
        filters["compression"] = compression
        if compression == "gzip" and compression_opts is not None:
            filters["compression_opts"] = int(compression_opts)
    if shuffle_filter:
        filters["shuffle"] = True
    if fletcher32:
        filters["fletcher32"] = True
    schema = {k: {"dtype": a.dtype.str, "shape": list(a.shape[1:]), "chunks": [rows, *a.shape[1:]],
                  "compression": compression} for k, a in arrays.items()}
    total = sum(a.nbytes for a in arrays.values())
    with atomic_output(out) as tmp, progress_bar(total, f"pack {Path(out).name}", quiet) as bar:
        with h5py.File(tmp, "w") as f:
            for k, a in arrays.items():
                d = f.create_dataset(k, shape=a.shape, dtype=a.dtype, chunks=(rows, *a.shape[1:]), **filters)
                step = max(rows, (64 << 20) // max(1, a[:1].nbytes) // rows * rows)
                for lo in range(0, n, step):
                    block = np.ascontiguousarray(a[lo:lo + step])
                    d[lo:lo + len(block)] = block
                    bar.update(block.nbytes)
                d.attrs[CHECKSUM_ATTR] = array_checksum(a)
            f.attrs[FORMAT_ATTR] = 1
            f.attrs["num_samples"] = n
            f.attrs["keys"] = json_attr(list(arrays))
            f.attrs["schema"] = json_attr(schema)
            f.attrs["source"] = json_attr([("sklearn.datasets.load_digits" if s in DIGITS else os.path.basename(s))
                                           for s in sources])
            f.attrs["created_by"] = f"hpctrain {hpctrain.__version__}"
    return PackResult(os.fspath(out), n, tuple(arrays), total)
