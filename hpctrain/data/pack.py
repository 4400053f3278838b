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
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

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
        raise MissingFileError("no such file", path=path, hint="check the path")
    if not os.access(path, os.R_OK):
        raise PermissionDeniedError("permission denied: this user may not read the file", path=path,
                                    hint="chmod a+r the file (or run as its owner)")


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
        raise DataError(f"cannot read as .npz: {exc}", path=path,
                        hint="is it a numpy .npz file? (object arrays are not supported)") from exc


def load_csv(path: str, label_column: Optional[str] = None, dtype: str = "float32") -> Dict[str, np.ndarray]:
    """Numeric CSV -> ``x`` (all columns but the label) and ``y`` (the label column, if named).

    A first row that is not all numbers is taken as the header. ``label_column`` is a header
    name or a 0-based column number.
    """
    _check_readable(path)
    with open(path, newline="") as fh:
        rows = [r for r in csv.reader(fh) if r and any(c.strip() for c in r)]
    if not rows:
        raise EmptyDataError("CSV file has no rows", path=path,
                             hint="check the file; a CSV needs at least one row of numbers")

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
            raise LengthMismatchError(f"line {line} has {len(row)} columns; expected {width}", path=path,
                                      hint="every row needs the same number of columns")
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
                              path=path, hint="pass --label-column with a header name or a 0-based column number")
    out: Dict[str, np.ndarray] = {}
    if label is None:
        out["x"] = values.astype(dtype)
    else:
        out["x"] = np.delete(values, label, axis=1).astype(dtype)
        y = values[:, label]
        out["y"] = y.astype(np.int64) if np.all(y == np.round(y)) else y.astype(dtype)
    return out


IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp")
TABLE_SUFFIXES = (".parquet", ".pq", ".feather", ".arrow")
H5_INPUTS = (".h5", ".hdf5", ".hdf", ".he5", ".nc", ".nc4", ".nxs")


def load_image_folder(path: str) -> Dict[str, np.ndarray]:
    """A folder of class subfolders of images (the ``ImageFolder`` layout) -> ``x`` (uint8,
    N x H x W [x C]) and ``y`` (int64 class index, classes in sorted folder-name order)."""
    from PIL import Image

    classes = sorted(d for d in os.listdir(path) if os.path.isdir(os.path.join(path, d)) and not d.startswith("."))
    files = [(os.path.join(path, c, n), i) for i, c in enumerate(classes)
             for n in sorted(os.listdir(os.path.join(path, c))) if n.lower().endswith(IMAGE_SUFFIXES)]
    if not files:
        raise EmptyDataError("holds no images in class subfolders (expected DIR/CLASS/IMAGE.png)", path=path,
                             hint="lay the images out as DIR/<class name>/<image>, one folder per class")
    images = []
    for name, _ in files:
        try:
            with Image.open(name) as im:
                images.append(np.asarray(im))
        except OSError as exc:
            raise DataError(f"cannot read as an image: {exc}", path=name, hint="remove or re-save the file") from exc
        if images[-1].shape != images[0].shape:
            raise LengthMismatchError(f"image of shape {images[-1].shape} differs from {files[0][0]}'s "
                                      f"{images[0].shape}", path=name, hint="resize the images to one size first")
    return {"x": np.stack(images), "y": np.array([i for _, i in files], np.int64),
            "__classes__": np.array(classes, dtype=object)}


def load_table(path: str, label_column: Optional[str] = None, dtype: str = "float32") -> Dict[str, np.ndarray]:
    """Parquet or Feather (pyarrow) -> ``x`` (the numeric columns but the label) and ``y``."""
    try:
        import pyarrow.feather as feather
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise ConfigError("reading Parquet/Feather needs pyarrow", path=path, hint="pip install pyarrow") from exc
    try:
        table = (pq.read_table(path) if Path(path).suffix.lower() in (".parquet", ".pq")
                 else feather.read_table(path))
    except Exception as exc:  # noqa: BLE001 - pyarrow raises several types for bad files
        raise DataError(f"cannot read as Parquet/Feather: {exc}", path=path,
                        hint="check that the file is complete") from exc
    names = list(table.column_names)
    if label_column is not None and label_column not in names:
        raise ConfigError(f"label column {label_column!r} not found; columns: {names}", path=path,
                          hint="pass --label-column with one of the column names")
    cols = {n: table.column(n).to_numpy() for n in names}
    bad = [n for n, c in cols.items() if c.dtype.kind not in NUMERIC_KINDS]
    if bad:
        raise DtypeError(f"columns {bad} are not numeric", path=path, hint="encode categories as integer codes first")
    feats = [n for n in names if n != label_column]
    out = {"x": np.stack([cols[n] for n in feats], axis=1).astype(dtype)}
    if label_column is not None:
        y = cols[label_column]
        out["y"] = y.astype(np.int64) if y.dtype.kind in "biu" or np.all(y == np.round(y)) else y.astype(dtype)
    return out


def load_h5(path: str, keys: Optional[Sequence[str]] = None) -> Dict[str, np.ndarray]:
    """An HDF5/netCDF-4 file's per-sample datasets (``keys``, else its sample keys)."""
    from hpctrain.data.h5files import get_dataset, layout_of, open_h5, read_error

    with open_h5(path) as f:
        names = list(keys) if keys else layout_of(f).sample_keys
        out = {}
        for k in names:
            d = get_dataset(f, k, path)
            try:
                out[k] = d[()]
            except Exception as exc:
                raise read_error(exc, path, k, d) from exc
    return out


def load_source(source: str, *, key: Optional[str] = None, label_column: Optional[str] = None,
                csv_dtype: str = "float32", keys: Optional[Sequence[str]] = None) -> Dict[str, np.ndarray]:
    """One input -> ``{key: array}``."""
    if source in DIGITS:
        return load_digits_arrays()
    if os.path.isdir(source):
        return load_image_folder(source)
    suffix = Path(source).suffix.lower()
    if suffix == ".npy":
        return load_npy(source, key)
    if suffix == ".npz":
        return load_npz(source)
    if suffix in (".csv", ".txt"):
        return load_csv(source, label_column, csv_dtype)
    _check_readable(source)
    if suffix in TABLE_SUFFIXES:
        return load_table(source, label_column, csv_dtype)
    if suffix in H5_INPUTS:
        return load_h5(source, keys)
    raise DataError(f"unknown input type {suffix or '(no suffix)'!r}; expected .npy, .npz, .csv, .parquet, "
                    ".feather, .h5/.nc, a folder of class subfolders, or 'digits'", path=source,
                    hint="convert it to one of these first")


def default_chunk_rows(arrays: Dict[str, np.ndarray], chunk_bytes: int = CHUNK_BYTES) -> int:
    """Rows per chunk: about ``chunk_bytes`` for the widest key (the same for all keys)."""
    widest = max(int(np.prod(a.shape[1:], dtype=np.int64)) * a.dtype.itemsize for a in arrays.values())
    return max(1, chunk_bytes // max(1, widest))


def collect_arrays(sources: Sequence[str], *, key: Optional[str] = None, label_column: Optional[str] = None,
                   csv_dtype: str = "float32", keys: Optional[Sequence[str]] = None,
                   x: Sequence[str] = (), y: Sequence[str] = ()) -> Tuple[Dict[str, np.ndarray], Dict[str, str], dict]:
    """Load every input: ``(arrays, origin of each key, extra root attributes)``.

    A key found in several inputs (``a.npz`` and ``b.npz`` both holding ``x`` and ``y``) is
    their concatenation in the order given; ``x``/``y``: files whose single array is
    concatenated into the key of that name (``--x X_train.npy --y y_train.npy``)."""
    parts: Dict[str, List[np.ndarray]] = {}
    origin: Dict[str, str] = {}
    extra: dict = {}

    def add(k: str, arr: np.ndarray, src: str) -> None:
        if k in parts and (parts[k][0].shape[1:] != arr.shape[1:] or parts[k][0].dtype != arr.dtype):
            raise LengthMismatchError(f"sample shape {arr.shape[1:]} dtype {arr.dtype} differs from "
                                      f"{origin[k]}'s {parts[k][0].shape[1:]} {parts[k][0].dtype}; cannot "
                                      "concatenate", path=src, key=k, hint="convert the inputs to one dtype and shape")
        parts.setdefault(k, []).append(arr)
        origin.setdefault(k, src)

    for src in sources:
        for k, arr in load_source(src, key=key, label_column=label_column, csv_dtype=csv_dtype, keys=keys).items():
            if k == "__classes__":
                extra["classes"] = json_attr([str(c) for c in arr])
            else:
                add(k, arr, src)
    for role, files in (("x", x), ("y", y)):
        for src in files:
            got = load_source(src, label_column=label_column, csv_dtype=csv_dtype, keys=keys)
            got.pop("__classes__", None)
            if len(got) != 1:
                raise ConfigError(f"--{role} takes files holding one array; this one holds {len(got)} "
                                  f"({', '.join(got)})", path=src,
                                  hint=f"pass it as an input (keys {', '.join(got)}) or name one with --keys")
            add(role, next(iter(got.values())), src)
    arrays = {k: v[0] if len(v) == 1 else np.concatenate(v) for k, v in parts.items()}
    return arrays, origin, extra


def _roles_of(arrays: Mapping[str, np.ndarray], given: Mapping[str, str]) -> Dict[str, str]:
    """The roles to record: keys named ``x``/``y``, replaced by the ones ``given``."""
    for role, k in given.items():
        if role not in ("x", "y"):
            raise ConfigError(f"--roles: unknown role {role!r}; expected x (the input) and y (the target)",
                              hint="pass --roles x=KEY,y=KEY")
        if k not in arrays:
            raise ConfigError(f"--roles: {role}={k!r} names no packed key; keys: {', '.join(arrays)}",
                              hint="name one of the keys listed (nested paths as written, e.g. entry/data/data)")
    found = {r: r for r in ("x", "y") if r in arrays}
    found.update(given)
    return found


def _check_arrays(arrays: Dict[str, np.ndarray], origin: Dict[str, str]) -> int:
    """The common sample count, once every array is numeric, not a scalar, of one length."""
    if not arrays:
        raise EmptyDataError("the inputs hold no arrays", hint="check the input files (and --keys)")
    for k, a in arrays.items():
        if a.dtype.kind not in NUMERIC_KINDS:
            raise DtypeError(f"dtype {a.dtype} is not numeric", path=origin[k], key=k,
                             hint="store strings/labels as integer codes")
        if a.ndim == 0:
            raise LengthMismatchError("is a scalar; expected samples along axis 0", path=origin[k], key=k,
                                      hint="pass arrays with one row per sample")
    lengths = {k: a.shape[0] for k, a in arrays.items()}
    if len(set(lengths.values())) > 1:
        longest = max(lengths, key=lengths.get)
        raise LengthMismatchError(f"keys have different numbers of samples {lengths}; expected equal",
                                  path=origin[longest], key=longest,
                                  hint="pack train and test sets separately, e.g. --x X_train.npy --y y_train.npy")
    n = next(iter(lengths.values()))
    if n == 0:
        k0 = next(iter(arrays))
        raise EmptyDataError("has zero samples", path=origin[k0], key=k0, hint="pack a non-empty array")
    return n


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
    keys: Optional[Sequence[str]] = None,
    x: Sequence[str] = (),
    y: Sequence[str] = (),
    role_keys: Optional[Mapping[str, str]] = None,
) -> PackResult:
    """Write ``sources`` (one sample per row along axis 0 of every array) to ``out``.

    The root attribute ``roles`` (JSON) records which key is the input ``x`` and which the
    target ``y`` when known (``--x``/``--y``, keys named ``x``/``y``, or ``role_keys`` such as
    ``{"x": "entry/data/data", "y": "entry/data/label"}``): see :func:`roles`."""
    if not sources and not x and not y:
        raise ConfigError("nothing to pack", hint="example: hpctrain data pack digits --out digits.h5")
    if compression in (None, "none"):
        compression = None
    elif compression not in COMPRESSIONS:
        raise ConfigError(f"unknown compression {compression!r}; expected one of {', '.join(COMPRESSIONS)}",
                          hint="pass --compression none, gzip or lzf")
    if key and len(sources) > 1:
        raise ConfigError("--key names the dataset of a single .npy input; with several inputs each "
                          ".npy file's stem is its key", hint="use --x FILE... --y FILE... to give arrays roles")
    arrays, origin, extra = collect_arrays(sources, key=key, label_column=label_column, csv_dtype=csv_dtype,
                                           keys=keys, x=x, y=y)
    sources = list(sources) + list(x) + list(y)
    n = _check_arrays(arrays, origin)
    extra["roles"] = json_attr(_roles_of(arrays, role_keys or {}))
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
            f.attrs.update(extra)
    return PackResult(os.fspath(out), n, tuple(arrays), total)


def roles(path: str) -> Dict[str, str]:
    """``{"x": key, "y": key}`` of a packed file (its ``roles`` attribute; for files packed
    before roles were recorded, keys named ``x``/``y``); {} when the file does not say."""
    import json

    from hpctrain.data.h5files import open_h5, recorded_keys, dataset_names

    with open_h5(path) as f:
        raw = f.attrs.get("roles")
        if raw is not None:
            try:
                found = json.loads(raw)
                if isinstance(found, dict):
                    return {str(k): str(v) for k, v in found.items()}
            except (TypeError, ValueError):
                pass
        keys = recorded_keys(f, dataset_names(f))
    return {r: r for r in ("x", "y") if r in keys}
