"""File I/O of ``hpctrain bench data`` (kept here: ``hpctrain.data`` is the only package that
imports h5py): the generated benchmark file, the raw slab read and the naive per-sample read.
"""
from __future__ import annotations

import os
import time
from typing import Dict, Optional, Tuple

import h5py
import numpy as np

from hpctrain.data.h5files import atomic_output


#: ``--compressions`` names: h5py's own filters and hdf5plugin's (as detector and PyTables files use them).
COMPRESSIONS = ("none", "lzf", "gzip", "blosc-lz4", "blosc-zstd", "bitshuffle-lz4", "lz4", "zstd")


def filter_options(compression: str) -> dict:
    """``create_dataset`` keywords of one ``COMPRESSIONS`` name."""
    if compression == "none":
        return {}
    if compression in ("lzf", "gzip"):
        return {"compression": compression}
    import hdf5plugin

    plugins = {
        "blosc-lz4": lambda: hdf5plugin.Blosc(cname="lz4", shuffle=hdf5plugin.Blosc.SHUFFLE),
        "blosc-zstd": lambda: hdf5plugin.Blosc(cname="zstd", shuffle=hdf5plugin.Blosc.SHUFFLE),
        "bitshuffle-lz4": lambda: hdf5plugin.Bitshuffle(cname="lz4"),
        "lz4": hdf5plugin.LZ4,
        "zstd": hdf5plugin.Zstd,
    }
    if compression not in plugins:
        raise ValueError(f"unknown compression {compression!r}; expected one of {', '.join(COMPRESSIONS)}")
    return dict(plugins[compression]())


def bench_file(directory: str, size: int, compression: str, features: int, chunk_rows: int,
               regenerate: bool = False) -> Tuple[str, float]:
    """Create (or reuse) the benchmark file; return its path and the seconds spent creating it."""
    os.makedirs(directory, exist_ok=True)
    row = features * 4 + 8
    n = max(chunk_rows, size // row // chunk_rows * chunk_rows)
    path = os.path.join(directory, f"bench-{n}x{features}-c{chunk_rows}-{compression}.h5")
    if os.path.exists(path) and not regenerate:
        try:
            with h5py.File(path, "r") as f:
                if f.attrs.get("complete") and f["x"].shape == (n, features):
                    return path, 0.0
        except OSError:
            pass
    t0 = time.perf_counter()
    filters = filter_options(compression)
    # Small integers as float32: realistic, partly compressible (lzf ~2x), fast to make.
    rng = np.random.default_rng(0)
    slab_rows = max(chunk_rows, (64 << 20) // (features * 4) // chunk_rows * chunk_rows)
    pattern = rng.integers(0, 200, size=(slab_rows, features)).astype(np.float32)
    with atomic_output(path) as tmp:
        with h5py.File(tmp, "w") as f:
            x = f.create_dataset("x", shape=(n, features), dtype=np.float32, chunks=(chunk_rows, features), **filters)
            y = f.create_dataset("y", shape=(n,), dtype=np.int64, chunks=(chunk_rows,), **filters)
            for lo in range(0, n, slab_rows):
                hi = min(n, lo + slab_rows)
                x[lo:hi] = pattern[: hi - lo]
                y[lo:hi] = np.arange(lo, hi, dtype=np.int64) % 10
            f.attrs["complete"] = True
    return path, time.perf_counter() - t0


def raw_read(path: str, lo: int, hi: int, buffers: Optional[Dict[str, np.ndarray]] = None) -> int:
    """Sequential 64 MiB slab reads of rows [lo, hi) of x and y into preallocated buffers
    (kept in ``buffers`` for the next call: a fresh 64 MiB buffer faults its pages in)."""
    buffers = {} if buffers is None else buffers
    with h5py.File(path, "r") as f:
        x, y = f["x"], f["y"]
        row = x.shape[1] * 4 + 8
        rows = max(1, (64 << 20) // row // x.chunks[0] * x.chunks[0])
        if buffers.get("x") is None or buffers["x"].shape != (rows, x.shape[1]):
            buffers["x"] = np.empty((rows, x.shape[1]), np.float32)
            buffers["y"] = np.empty(rows, np.int64)
        bx, by = buffers["x"], buffers["y"]
        for a in range(lo, hi, rows):
            b = min(hi, a + rows)
            x.read_direct(bx, np.s_[a:b], np.s_[0:b - a])
            y.read_direct(by, np.s_[a:b], np.s_[0:b - a])
    return hi - lo


def naive_read(path: str, lo: int, hi: int, seconds: float) -> Tuple[int, float]:
    """Per-sample ``x[i], y[i]`` in random order for about ``seconds``: (samples, seconds)."""
    order = np.random.default_rng(1).permutation(np.arange(lo, hi))
    with h5py.File(path, "r") as f:
        x, y = f["x"], f["y"]
        done = 0
        t0 = time.perf_counter()
        while done < len(order):
            for i in order[done:done + 64]:
                x[i]
                y[i]
            done = min(len(order), done + 64)
            if time.perf_counter() - t0 >= seconds:
                break
        return done, time.perf_counter() - t0


def file_stats(path: str) -> Tuple[int, int]:
    """Samples and stored bytes (x and y) of a benchmark file."""
    with h5py.File(path, "r") as f:
        return f["x"].shape[0], int(f["x"].id.get_storage_size() + f["y"].id.get_storage_size())


def pack_inputs(directory: str, size: int, features: int) -> Tuple[str, str, int]:
    """``X.npy`` (float32 rows of ``features``) and ``y.npy`` (int64) of about ``size`` bytes
    together, written slab by slab (never the whole array in memory): (x path, y path, bytes)."""
    os.makedirs(directory, exist_ok=True)
    row = features * 4 + 8
    n = max(1, size // row)
    xp, yp = os.path.join(directory, f"pack-X-{n}x{features}.npy"), os.path.join(directory, f"pack-y-{n}.npy")
    x = np.lib.format.open_memmap(xp, mode="w+", dtype=np.float32, shape=(n, features))
    y = np.lib.format.open_memmap(yp, mode="w+", dtype=np.int64, shape=(n,))
    rng = np.random.default_rng(0)
    slab = max(1, (64 << 20) // row)
    pattern = rng.integers(0, 200, size=(min(slab, n), features)).astype(np.float32)
    for lo in range(0, n, slab):
        hi = min(n, lo + slab)
        x[lo:hi] = pattern[:hi - lo]
        y[lo:hi] = np.arange(lo, hi) % 10
    x.flush()
    y.flush()
    del x, y
    return xp, yp, n * row


def pack_rate(directory: str, size: int, features: int, compression: str = "none") -> dict:
    """Time ``pack --x X.npy --y y.npy`` on generated inputs of about ``size`` bytes (read once
    before timing, so from the page cache): input bytes, seconds, MB/s."""
    from hpctrain.data.pack import pack

    xp, yp, nbytes = pack_inputs(directory, size, features)
    for p in (xp, yp):  # warm the page cache: the figure is pack's own work
        with open(p, "rb") as fh:
            while fh.read(64 << 20):
                pass
    out = os.path.join(directory, "pack-out.h5")
    t0 = time.perf_counter()
    pack([], out, x=[xp], y=[yp], quiet=True, compression=compression)
    seconds = time.perf_counter() - t0
    for p in (xp, yp, out):
        os.remove(p)
    return {"input_bytes": nbytes, "seconds": seconds, "MB_per_s": nbytes / seconds / 1e6,
            "compression": compression}
