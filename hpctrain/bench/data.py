"""HDF5 loader benchmark: hpctrain's loader against (a) h5py's own sequential read of the same
file in 64 MiB slabs (``read_direct``; HDF5 decodes any filter) -- the limit -- and (b) naive
per-sample ``dset[i]``, for each of --compressions (default uncompressed and lzf; also gzip
and hdf5plugin's blosc-lz4, blosc-zstd, bitshuffle-lz4, lz4, zstd), in one run. With
--pack-bytes, also ``pack``'s throughput (MB/s of input) on generated ``.npy`` inputs of that
size (``--compressions ''`` skips the read benchmark).

A file of --size bytes (x: float32 rows of --features values, y: int64 labels; chunks of
--chunk-rows rows) is generated once per compression under --dir and reused. Before timing,
one raw pass puts the file in the page cache, so all methods read from memory ("cached").
The loader (contiguous policy, drop_last) runs in both shuffle modes: "window" (the
default: block order shuffled, samples split into batches at random within each window) and
"block" (block order only, batches of consecutive samples), "window" with
``memory_map=False`` (no map of the file: every read a ``preadv``) and "window" with
``through_hdf5=True`` (every key read with ``H5Dread``, then shuffled in memory: the slow
fallback, and the path before hpctrain read around HDF5 -- ``preadv`` for uncompressed keys,
its own chunk decoder for compressed ones; no target). As in training, each loader is built once and each timing reads one epoch
of it (a new shuffle); its first epoch (opening, mapping, planning, window memory) runs
before the timings and is reported on its own. The raw read reuses its buffers likewise.
Per-sample ``dset[i]`` in random order runs for --naive-seconds and is extrapolated. Each
figure is the median of --repeats, with the competitors' order rotated per repeat. Under mpiexec every rank reads its share (raw: a
contiguous 1/size of the rows) and samples/s are totals over ranks.

Threads: the raw read uses one thread; the loader reads in its prefetch thread, and the
consuming loop helps copy a window it is waiting for (in this benchmark it does nothing
else), so the loader may use two cores. "CPU s/GB" is the process CPU time (all threads,
all ranks) per GB delivered: the cost per byte, steadier than samples/s on a busy machine.

Targets: loader >= 90% of the raw slab rate, >= 20x naive dset[i].

  hpctrain bench data --size 1GiB
  hpctrain bench data --size 1GiB --compressions bitshuffle-lz4,blosc-lz4,zstd --pack-bytes 1GiB
  hpctrain launch -n 2 -- hpctrain bench data --size 1GiB --json data.json
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional, Tuple

from hpctrain import settings
from hpctrain.data.benchio import COMPRESSIONS, bench_file, file_stats, naive_read, pack_rate, raw_read

DEFAULT_DIR = "/tmp/hpctrain-bench-data"
TARGET_RAW = 0.90
TARGET_NAIVE = 20.0
LOADER = "loader, shuffle=window"
LOADER_BLOCK = "loader, shuffle=block"
LOADER_NOMAP = "loader, shuffle=window, memory_map=False"
LOADER_HDF5 = "loader, shuffle=window, through_hdf5"
RAW = "raw 64 MiB slabs"
NAIVE = "naive dset[i]"


def parse_size(text: str) -> int:
    """``--size``: :func:`hpctrain.settings.parse_size` (every unit a power of 1024), as an argparse type."""
    try:
        return settings.parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def compressions(text: str) -> List[str]:
    """``--compressions``: a comma list of :data:`COMPRESSIONS` names, as an argparse type."""
    names = [c.strip() for c in text.split(",") if c.strip()]
    bad = [c for c in names if c not in COMPRESSIONS]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown compression {bad[0]!r}; expected {', '.join(COMPRESSIONS)}")
    return names


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size", type=parse_size, default=parse_size("1GiB"), help="file size (default 1GiB)")
    p.add_argument("--dir", default=DEFAULT_DIR, help=f"where the generated files live (default {DEFAULT_DIR})")
    p.add_argument("--compressions", type=compressions, default="none,lzf",
                   help=f"comma list of {', '.join(COMPRESSIONS)} (default none,lzf; '' for none at all)")
    p.add_argument("--pack-bytes", type=parse_size, default=0, metavar="SIZE",
                   help="also time `hpctrain data pack` on generated .npy inputs of SIZE (e.g. 1GiB; default: skip)")
    p.add_argument("--pack-compression", choices=["none", "lzf", "gzip"], default="none",
                   help="compression of the packed file (default none)")
    p.add_argument("--features", type=int, default=256, help="float32 values per sample (default 256 = 1 KiB)")
    p.add_argument("--chunk-rows", type=int, default=1024, help="samples per HDF5 chunk (default 1024)")
    p.add_argument("--batch-size", type=int, default=512, help="loader batch size per rank (default 512)")
    p.add_argument("--prefetch", type=int, default=1, help="loader windows read ahead (default 1)")
    p.add_argument("--naive-seconds", type=float, default=1.5, help="time budget of the dset[i] run (default 1.5)")
    p.add_argument("--repeats", type=int, default=3, help="repeats per method; the median is shown (default 3)")
    p.add_argument("--regenerate", action="store_true", help="rewrite the files even if present")
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                   help="write the results as JSON to PATH (stdout without PATH)")


class LoaderEpochs:
    """One loader, built once as a training script builds it; each :meth:`read` reads its
    next epoch (a new shuffle). The first epoch runs at construction: ``first_seconds``."""

    def __init__(self, path: str, rank: int, size: int, batch: int, prefetch: int,
                 shuffle: str = "window", **options: bool) -> None:
        from hpctrain.data.loader import HDF5Dataset

        t0 = time.perf_counter()
        self.ds = HDF5Dataset(path, ["x", "y"], batch, rank=rank, world_size=size, seed=0, drop_last=True,
                              prefetch=prefetch, shuffle=shuffle, **options)
        self.epoch = 0
        self.read()
        self.first_seconds = time.perf_counter() - t0

    def read(self) -> int:
        self.ds.set_epoch(self.epoch)
        self.epoch += 1
        count = 0
        for b in self.ds:
            count += b["x"].shape[0]
        return count

    def close(self) -> None:
        self.ds.close()


class World:
    """Rank/size and timing across ranks (a single process without a launcher)."""

    def __init__(self) -> None:
        from hpctrain.comm.launcher import detect_launcher

        self.comm = None
        self.rank, self.size = 0, 1
        if detect_launcher(os.environ) != "none":
            from hpctrain import comm

            comm.init()
            self.comm = comm
            self.rank, self.size = comm.rank(), comm.size()

    def barrier(self) -> None:
        if self.comm is not None:
            self.comm.barrier()

    def total_rate(self, samples: int, seconds: float, cpu: float) -> Tuple[float, float]:
        """All ranks together: (samples over the slowest rank's time, CPU seconds per sample)."""
        got = [(samples, seconds, cpu)] if self.comm is None else self.comm.allgather_object((samples, seconds, cpu))
        total = sum(s for s, _, _ in got)
        return total / max(t for _, t, _ in got), sum(c for _, _, c in got) / max(1, total)

    def allgather(self, obj) -> list:
        return [obj] if self.comm is None else self.comm.allgather_object(obj)

    def bcast(self, obj):
        return obj if self.comm is None else self.comm.broadcast_object(obj)


def measure(world: World, fn: Callable[[], Tuple[int, float]]) -> Tuple[float, float]:
    world.barrier()
    c0 = time.process_time()
    samples, seconds = fn()
    return world.total_rate(samples, seconds, time.process_time() - c0)


def timed(fn: Callable[[], int]) -> Callable[[], Tuple[int, float]]:
    def run() -> Tuple[int, float]:
        t0 = time.perf_counter()
        n = fn()
        return n, time.perf_counter() - t0
    return run


def run(args: argparse.Namespace) -> int:
    importlib.import_module("hpctrain.data.loader")  # import torch now, not inside the first timing

    world = World()
    log = (lambda *a: print(*a, file=sys.stderr, flush=True)) if world.rank == 0 else (lambda *a: None)
    comps = args.compressions if isinstance(args.compressions, list) else compressions(args.compressions)
    records: List[Dict] = []
    for comp in comps:
        if world.rank == 0:
            path, gen_s = bench_file(args.dir, args.size, comp, args.features, args.chunk_rows, args.regenerate)
            log(f"[{comp}] {path}: " + (f"generated in {gen_s:.1f} s" if gen_s else "reused"))
        path = world.bcast(path if world.rank == 0 else None)
        got = bench_compression(world, args, comp, path)
        records += got
        by = {r["method"]: r for r in got}
        log(f"[{comp}] loader {by[LOADER]['samples_per_s']:,.0f} samples/s = {by[LOADER]['vs_raw']:.0%} of raw, "
            f"{by[LOADER]['vs_naive']:.0f}x naive")
    packed = None
    if args.pack_bytes and world.rank == 0:
        log(f"[pack] {args.pack_bytes / 2**20:.0f} MiB of .npy inputs under {args.dir}")
        packed = pack_rate(args.dir, args.pack_bytes, args.features, args.pack_compression)
    if world.rank == 0:
        report(records, packed, args)
    return 0


def bench_compression(world: World, args: argparse.Namespace, comp: str, path: str) -> List[Dict]:
    """Every method on one file, median of the rotated repeats: one record per method."""
    n, storage = file_stats(path)
    share = n // world.size
    lo, hi = world.rank * share, (world.rank + 1) * share
    buffers: Dict = {}  # the raw read's slab buffers, reused
    raw_read(path, lo, hi, buffers)  # warm the page cache (and allocate the buffers)
    loaders = {name: LoaderEpochs(path, world.rank, world.size, args.batch_size, args.prefetch, shuffle, **options)
               for name, shuffle, options in ((LOADER, "window", {}), (LOADER_BLOCK, "block", {}),
                                              (LOADER_NOMAP, "window", {"memory_map": False}),
                                              (LOADER_HDF5, "window", {"through_hdf5": True}))}
    methods: Dict[str, Callable[[], Tuple[int, float]]] = {
        RAW: timed(lambda: raw_read(path, lo, hi, buffers)),
        LOADER: timed(loaders[LOADER].read),
        LOADER_BLOCK: timed(loaders[LOADER_BLOCK].read),
        NAIVE: lambda: naive_read(path, lo, hi, args.naive_seconds),
        LOADER_NOMAP: timed(loaders[LOADER_NOMAP].read),
        LOADER_HDF5: timed(loaders[LOADER_HDF5].read),
    }
    names = list(methods)
    rates: Dict[str, List[float]] = {m: [] for m in names}
    cpus: Dict[str, List[float]] = {m: [] for m in names}
    for rep in range(args.repeats):
        for m in names[rep % len(names):] + names[:rep % len(names)]:
            rate, cpu = measure(world, methods[m])
            rates[m].append(rate)
            cpus[m].append(cpu)
    first = {m: max(world.allgather(loader.first_seconds)) for m, loader in loaders.items()}
    for loader in loaders.values():
        loader.close()
    row_bytes = args.features * 4 + 8
    med = {m: statistics.median(v) for m, v in rates.items()}
    cpu_gb = {m: statistics.median(v) / row_bytes * 1e9 for m, v in cpus.items()}
    return [{
        "compression": comp, "method": m, "samples_per_s": med[m], "all": rates[m],
        "cpu_s_per_GB": cpu_gb[m], "cpu_vs_raw": cpu_gb[RAW] / cpu_gb[m],
        "MB_per_s": med[m] * row_bytes / 1e6, "vs_raw": med[m] / med[RAW], "vs_naive": med[m] / med[NAIVE],
        "first_epoch_s": first.get(m), "epoch_s": (n // world.size * world.size) / med[m] if m in first else None,
        "ranks": world.size, "samples": n, "file_bytes": os.path.getsize(path),
        "storage_bytes": int(storage), "batch_size": args.batch_size,
    } for m in names]


def report(records: List[Dict], packed: Optional[Dict], args: argparse.Namespace) -> None:
    if records:
        print(render(records, args))
    if packed:
        print(f"\npack: {packed['input_bytes'] / 2**20:,.0f} MiB of .npy inputs (--x/--y, compression "
              f"{packed['compression']}) in {packed['seconds']:.2f} s = {packed['MB_per_s']:,.0f} MB/s")
    if args.json:
        text = json.dumps({"records": records, "pack": packed,
                           "targets": {"vs_raw": TARGET_RAW, "vs_naive": TARGET_NAIVE}}, indent=2)
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w") as fh:
                fh.write(text + "\n")


def render(records: List[Dict], args: argparse.Namespace) -> str:
    head = (f"HDF5 read benchmark: {records[0]['samples']:,} samples x {args.features} float32 + int64 label "
            f"({records[0]['samples'] * (args.features * 4 + 8) / 2**30:.2f} GiB), chunks of {args.chunk_rows} "
            f"rows, batch {args.batch_size}, {records[0]['ranks']} rank(s), page cache warm; "
            f"median of {args.repeats}")
    lines = [head, f"({RAW!r}: h5py's read_direct of 64 MiB slabs of the same file, HDF5 decoding the filters)", "",
             "| compression | method | samples/s | MB/s | vs raw slabs | vs dset[i] | CPU s/GB | raw's CPU/GB ÷ this |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in records:
        lines.append(f"| {r['compression']} | {r['method']} | {r['samples_per_s']:,.0f} | {r['MB_per_s']:,.0f} | "
                     f"{r['vs_raw']:.2f} | {r['vs_naive']:.1f}x | {r['cpu_s_per_GB']:.2f} | {r['cpu_vs_raw']:.2f} |")
    lines.append("")
    for r in records:
        if r.get("first_epoch_s") is not None:
            lines.append(f"{r['compression']}, {r['method']}: first epoch of a new loader (open, map, plan, window "
                         f"memory) {r['first_epoch_s']:.2f} s, a later one {r['epoch_s']:.2f} s")
    lines.append("")
    for r in records:
        if r["method"] in (LOADER, LOADER_BLOCK, LOADER_NOMAP):  # through HDF5: the slow fallback, no target
            ok_raw = r["vs_raw"] >= TARGET_RAW
            ok_naive = r["vs_naive"] >= TARGET_NAIVE
            lines.append(f"{r['compression']}, {r['method']}: at {r['vs_raw']:.0%} of raw slabs (target {TARGET_RAW:.0%}: "
                         f"{'met' if ok_raw else 'MISSED'}), {r['vs_naive']:.0f}x dset[i] "
                         f"(target {TARGET_NAIVE:.0f}x: {'met' if ok_naive else 'MISSED'})")
    return "\n".join(lines)
