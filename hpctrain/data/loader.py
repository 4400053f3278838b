"""Rank-aware batch loader over one or many HDF5 files (the hot path of every epoch).

:class:`HDF5Dataset` is a ``torch.utils.data.IterableDataset`` whose items are whole batches:
``{"x": tensor, "y": tensor, ..., "mask": bool tensor, "index": int64 tensor}``. ``mask`` is
False for padding samples (see :mod:`hpctrain.data.planner`), ``index`` holds the global
sample ids. ``len(ds)`` is the number of steps per epoch, the same on every rank.

How it reads (the design that makes it fast):

1. The planner gives this rank's sample ids for the epoch, in chunk-aligned blocks of at
   least ``block_bytes`` (whole HDF5 chunks) whose order is shuffled per epoch.
2. The ids are walked one *window* (about ``window_bytes``, 32 MiB by default, a whole
   number of batches) at a time, by a background thread, into reused window arrays.
3. A window is read as the few sorted runs of rows (whole blocks) that cover it. When its
   ids ascend (``shuffle="block"``, ``False``) the runs land in place; otherwise
   uncompressed keys are read with ``preadv`` calls that put each row at its place in plan
   order (one copy), and the other keys are read into a staging buffer and gathered into
   plan order with ``numpy.take``. How the runs are read depends on the key:
   uncompressed keys with ``preadv`` straight from the file (:mod:`hpctrain.data.mapped`:
   the offsets of their bytes are found once); lzf/gzip/shuffle-filtered keys and keys
   compressed with hdf5plugin's filters (Blosc, bitshuffle/LZ4, Zstd, ...) as stored chunks
   decoded here (:mod:`hpctrain.data.chunked`, :mod:`hpctrain.data.plugins`); anything else (other filters,
   ``through_hdf5=True``, files opened with ``mpio``) with one ``H5Dread`` per run. The
   ``preadv`` reads, chunk decodes and gathers are small GIL-free tasks that the prefetch
   thread and a waiting consumer run together (two cores decompress at once).
4. Batches are views of the window arrays (no copy); dtypes are cast and transforms applied
   per batch.

Files are opened lazily in the process that iterates and re-opened after a ``fork`` (the
handles are never shared with DataLoader worker processes). With ``driver="auto"`` the
files are opened with parallel HDF5 (``driver="mpio"``) when h5py was built with MPI, the
world has several ranks and we are not in a DataLoader worker; otherwise each rank reads
independently with the default (serial) driver. Opening an mpio file is collective, so with
mpio every rank opens every file when an iteration starts, in file order.
"""
from __future__ import annotations

import functools
import logging
import os
import queue
import sys
import threading
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import h5py
import numpy as np
import torch

from hpctrain.data.errors import ConfigError, DataError
from hpctrain.data.h5files import (
    FileInfo, PathsArg, check_compatible, describe, expand_paths, has_mpio, in_file, open_h5, read_error,
)
from hpctrain.data.chunked import ChunkedKey, chunked_dataset
from hpctrain.data.labels import read_labels
from hpctrain.data.mapped import CopyJob, MappedKey, SizedCall, gather_tasks, map_dataset, open_map, packed, take_tasks
from hpctrain.data.planner import POLICIES, RankPlan, WindowLayout, global_offsets, locate, plan_epoch, window_layout

log = logging.getLogger("hpctrain.data")

try:  # scattered preadv of shuffled windows (one copy); without it: read, then gather
    from hpctrain.data import _codecs as _codecs_ext  # noqa: F401
    SCATTER = True
except ImportError:  # pragma: no cover - the optional extension was not built
    SCATTER = False

Batch = Dict[str, torch.Tensor]
Reader = Union[MappedKey, ChunkedKey, None]


def choose_driver(requested: Optional[str], h5py_has_mpi: bool, world_size: int, in_worker: bool) -> Optional[str]:
    """The h5py driver to open files with: ``"mpio"`` or None (HDF5's default, serial)."""
    if requested in (None, "serial", "sec2"):
        return None
    if requested == "mpio":
        if not h5py_has_mpi:
            raise ConfigError("driver='mpio' needs h5py built against parallel HDF5; this h5py is serial",
                              hint="use driver='auto' (falls back to serial reads) or install a parallel h5py")
        if in_worker:
            raise ConfigError("driver='mpio' cannot be used in DataLoader worker processes (they are not MPI ranks)",
                              hint="use num_workers=0 with mpio, or driver='auto'")
        return "mpio"
    if requested == "auto":
        return "mpio" if (h5py_has_mpi and world_size > 1 and not in_worker) else None
    raise ConfigError(f"unknown driver {requested!r}; expected 'auto', 'mpio' or 'serial'",
                      hint="use driver='auto' (default), 'mpio' or 'serial'")


def _torch_dtype(dtype: Union[str, torch.dtype, np.dtype, None]) -> Optional[torch.dtype]:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and hasattr(torch, dtype) and isinstance(getattr(torch, dtype), torch.dtype):
        return getattr(torch, dtype)
    try:
        return torch.from_numpy(np.zeros(0, dtype=np.dtype(dtype))).dtype
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"unknown dtype {dtype!r}",
                          hint="use a numpy dtype name such as 'float32' or 'int64'") from exc


def _world_default(rank: Optional[int], world_size: Optional[int]) -> Tuple[int, int]:
    if rank is not None and world_size is not None:
        return int(rank), int(world_size)
    from hpctrain import comm

    comm.init()
    return (comm.rank() if rank is None else int(rank)), (comm.size() if world_size is None else int(world_size))



def _checked_keys(keys: Union[str, Sequence[str]], mask_key: str, index_key: str) -> List[str]:
    """The loader's dataset names as a list: at least one, none named like the batch's own
    mask and index entries."""
    names = [keys] if isinstance(keys, str) else list(keys)
    if not names:
        raise ConfigError("keys is empty; expected at least one dataset name, e.g. keys=['x', 'y']",
                          hint="pass the dataset names to read, e.g. keys=['x', 'y']")
    for reserved in (mask_key, index_key):
        if reserved in names:
            raise ConfigError(f"key {reserved!r} clashes with the batch's {reserved!r} entry",
                              hint="pass mask_key=/index_key= with other names")
    return names


_SHUFFLE_MODES = {True: "window", "window": "window", "block": "block", False: "none", "none": "none"}


def _shuffle_mode(shuffle: Union[bool, str]) -> str:
    """``shuffle`` as one of "window", "block", "none"."""
    if not isinstance(shuffle, (bool, str)) or shuffle not in _SHUFFLE_MODES:
        raise ConfigError(f"shuffle must be True, False, 'window', 'block' or 'none'; got {shuffle!r}",
                          hint="use one of the values listed")
    return _SHUFFLE_MODES[shuffle]


def block_rows(files: Sequence[FileInfo], keys: Sequence[str], row_bytes: int, block_bytes: int) -> List[int]:
    """Rows per shuffle block of each file: whole chunks of its widest key, at least
    ``block_bytes`` of all keys' rows (``row_bytes`` a sample) long."""
    rows = []
    for f in files:
        widest = max(keys, key=lambda k: f.keys[k].row_bytes)
        chunk = f.keys[widest].chunk_rows
        rows.append(chunk * max(1, -(-block_bytes // max(1, chunk * row_bytes))))
    return rows


class HDF5Dataset(torch.utils.data.IterableDataset):
    """Batches of this rank's share of HDF5 data; ``len()`` = steps per epoch on every rank.

    Args:
        paths: a file, directory, glob, or a list of those; files are one global index.
        keys: dataset names to load together (same sample count in a file).
        batch_size: samples per step per rank (``weighted``: the mean; see ``batch_size_here``).
        policy: ``"contiguous"`` (default), ``"strided"``, ``"weighted"`` or ``"stratified"``.
        stratify: ``policy="stratified"``: the key holding each sample's integer class
            (default ``"y"`` when it is among ``keys``); read once, when the loader is made.
        shuffle: ``True``/``"window"`` (default): block order shuffled per epoch, and samples
            shuffled inside each window (rows read to their shuffled places: about 1.4x the CPU
            per byte of ``"block"`` for uncompressed keys);
            ``"block"``: block order only, samples of a block stay in file order and batches
            are zero-copy slices of the read buffer (fastest); ``False``: file order.
        seed, drop_last, weights: see :func:`hpctrain.data.planner.plan_epoch`.
        rank, world_size: default ``hpctrain.comm.rank()`` / ``size()``.
        dtypes: per-key dtype to cast to, e.g. ``{"x": torch.float32}``.
        transforms: per-key callables ``tensor -> tensor``; ``transform``: ``dict -> dict``
            applied last, on the whole batch.
        prefetch: windows read ahead in a background thread (0 = read in the caller).
        window_bytes: bytes read per window (default 32 MiB); block_bytes: minimum bytes of
            a contiguous block (default 4 MiB, rounded up to whole HDF5 chunks). A window mixes about
            ``window_bytes / block_bytes`` blocks from different places of the data.
        driver: ``"auto"``, ``"mpio"`` or ``"serial"``.
        memory_map: also map files read-only (default True), to gather scattered single rows
            (a strided policy) from the map; False maps nothing: those rows are read as
            whole runs, and a file truncated while it is read is a read error, never a
            SIGBUS. Shuffled windows and blocks read at the same speed either way.
        through_hdf5: read every key with ``H5Dread`` (default False: keys of serially
            opened files are read around HDF5, uncompressed ones with ``preadv`` at their
            file offsets, compressed ones as stored chunks decoded in several threads, each
            checked against an HDF5 read of a few rows). The slow path: h5py holds the GIL
            for every read.
        mask_key, index_key: names of the padding mask and the global-id entries.
    """

    def __init__(
        self,
        paths: PathsArg,
        keys: Sequence[str] = ("x", "y"),
        batch_size: int = 32,
        *,
        policy: str = "contiguous",
        seed: int = 0,
        shuffle: Union[bool, str] = True,
        drop_last: bool = False,
        weights: Optional[Sequence[float]] = None,
        stratify: Optional[str] = None,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
        dtypes: Optional[Mapping[str, Any]] = None,
        transforms: Optional[Mapping[str, Callable[[torch.Tensor], torch.Tensor]]] = None,
        transform: Optional[Callable[[Batch], Batch]] = None,
        prefetch: int = 1,
        window_bytes: int = 32 << 20,
        block_bytes: int = 4 << 20,
        driver: Optional[str] = "auto",
        memory_map: bool = True,
        through_hdf5: bool = False,
        mask_key: str = "mask",
        index_key: str = "index",
    ) -> None:
        super().__init__()
        self.keys: List[str] = _checked_keys(keys, mask_key, index_key)
        if policy not in POLICIES:
            raise ConfigError(f"unknown policy {policy!r}; expected one of {', '.join(POLICIES)}",
                              hint="pick one of the policies listed")
        if prefetch < 0 or window_bytes < 1 or block_bytes < 1:
            raise ConfigError("prefetch must be >= 0 and window_bytes, block_bytes >= 1",
                              hint="use prefetch >= 0 and positive byte sizes")
        self.paths = expand_paths(paths)
        self.rank, self.world_size = _world_default(rank, world_size)
        self.batch_size = int(batch_size)
        self.policy = policy
        self.seed = int(seed)
        self.shuffle_mode = _shuffle_mode(shuffle)
        self.shuffle = self.shuffle_mode != "none"
        self.drop_last = bool(drop_last)
        self.weights = None if weights is None else [float(w) for w in weights]
        self.dtypes = {k: _torch_dtype(v) for k, v in (dtypes or {}).items()}
        self.transforms = dict(transforms or {})
        self.transform = transform
        for k in list(self.dtypes) + list(self.transforms):
            if k not in self.keys:
                raise ConfigError(f"dtypes/transforms name key {k!r}, which is not in keys {self.keys}",
                                  hint="name only keys that the loader reads")
        self.prefetch = int(prefetch)
        self.driver = driver
        self.memory_map = bool(memory_map)
        self.through_hdf5 = bool(through_hdf5)
        choose_driver(driver, has_mpio(), self.world_size, False)  # validate early
        self.mask_key, self.index_key = mask_key, index_key
        self.epoch = 0

        self.files: List[FileInfo] = [describe(p, self.keys) for p in self.paths]
        check_compatible(self.files, self.keys)
        self.counts = [f.num_samples for f in self.files]
        self.offsets = global_offsets(self.counts)
        self.stratify, self.labels = self._labels(stratify)
        self.row_bytes = sum(self.files[0].keys[k].row_bytes for k in self.keys)
        self.block_rows = block_rows(self.files, self.keys, self.row_bytes, block_bytes)
        self._gap = max(1, min(self.block_rows))
        try:
            first = self._plan(0)
        except DataError as exc:
            shown = self.paths[0] if len(self.paths) == 1 else f"{self.paths[0]} (+{len(self.paths) - 1} files)"
            raise type(exc)(str(exc), path=shown, key=self.keys[0]) from exc
        self.window_bytes = int(window_bytes)
        self._adopt(first)
        self._steps = first.steps
        self._handles: Dict[int, h5py.File] = {}
        self._dsets: Dict[int, Tuple[h5py.File, Dict[str, h5py.Dataset]]] = {}
        self._maps: Dict[int, Dict[str, Reader]] = {}
        self._mmaps: Dict[int, Any] = {}
        self._drivers: Dict[int, Optional[str]] = {}
        self._pid: Optional[int] = None
        self._window_pool: Optional[Tuple[Tuple[int, int], _WindowPool]] = None

    # -- planning ---------------------------------------------------------------------
    def _labels(self, stratify: Optional[str]) -> Tuple[Optional[str], Optional[np.ndarray]]:
        """The stratify key and its class codes per global sample (``stratified`` only)."""
        if self.policy != "stratified":
            if stratify is not None:
                raise ConfigError(f"stratify={stratify!r} is used only by policy 'stratified', not {self.policy!r}",
                                  hint="pass policy='stratified' or drop stratify")
            return None, None
        key = stratify or ("y" if "y" in self.keys else None)
        if key is None:
            raise ConfigError(f"policy 'stratified' needs the label key to balance; keys {self.keys} have no 'y'",
                              hint="pass stratify='<label key>'")
        return key, read_labels(self.paths, key, self.counts)

    def _plan(self, epoch: int, window_steps: int = 0, window_order: str = "shuffle") -> RankPlan:
        return plan_epoch(self.counts, self.world_size, self.rank, self.batch_size, seed=self.seed,
                          epoch=epoch, policy=self.policy, drop_last=self.drop_last, shuffle=self.shuffle,
                          weights=self.weights, block_rows=self.block_rows, window_steps=window_steps,
                          window_order=window_order, labels=self.labels)

    def plan(self, epoch: Optional[int] = None) -> RankPlan:
        """This rank's plan for ``epoch`` (default: the current one)."""
        order = "shuffle" if self.shuffle_mode == "window" else "sort"
        return self._plan(self.epoch if epoch is None else epoch, self.window_steps, order)

    def _adopt(self, first: RankPlan) -> None:
        self.batch_size_here = first.batch_size
        self.window_steps = max(1, self.window_bytes // max(1, first.batch_size * self.row_bytes))
        if self.rank == 0:
            log.debug("data: %d samples in %d file(s), %d steps/epoch of %d per rank (global batch %d), "
                      "policy %s, shuffle %s", self.num_samples, len(self.paths), first.steps,
                      first.batch_size, first.global_batch, self.policy, self.shuffle_mode)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch (reshuffles deterministically from ``seed`` and ``epoch``)."""
        self.epoch = int(epoch)

    def set_weights(self, weights: Sequence[float]) -> None:
        """New per-rank weights for ``policy="weighted"`` (e.g. measured samples/s), from the
        next iteration on. Call it with the same weights on every rank. The global batch and
        the steps per epoch stay the same; this rank's batch size may change."""
        if self.policy != "weighted":
            raise ConfigError(f"set_weights needs policy 'weighted', this loader uses {self.policy!r}",
                              hint="create the loader with policy='weighted' to change weights")
        old = self.weights
        self.weights = [float(w) for w in weights]
        try:
            first = self._plan(self.epoch)
        except DataError:
            self.weights = old
            raise
        assert first.steps == self._steps
        self._adopt(first)

    def __len__(self) -> int:
        return self._steps

    @property
    def num_samples(self) -> int:
        """Samples in all files together."""
        return int(self.offsets[-1])

    def dataloader(self, num_workers: int = 0, **kwargs) -> torch.utils.data.DataLoader:
        """A ``torch.utils.data.DataLoader`` over this dataset (batches are already made).

        Worker ``w`` of ``k`` reads windows ``w, w+k, ...``; all batches of the epoch are
        produced once. Call ``set_epoch`` before iterating; keep ``persistent_workers``
        False (the default) so the workers see the new epoch.
        """
        kwargs.setdefault("pin_memory", False)
        return torch.utils.data.DataLoader(self, batch_size=None, num_workers=num_workers, **kwargs)

    # -- files ------------------------------------------------------------------------
    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_handles"] = {}
        state["_dsets"] = {}
        state["_maps"] = {}
        state["_mmaps"] = {}
        state["_drivers"] = {}
        state["_pid"] = None
        state["_window_pool"] = None
        return state

    def _file(self, i: int) -> h5py.File:
        pid = os.getpid()
        if self._pid != pid:
            # Fresh process (fork or spawn): never use a parent's handles.
            self._handles = {}
            self._dsets = {}
            self._maps = {}
            self._mmaps = {}
            self._drivers = {}
            self._pid = pid
        f = self._handles.get(i)
        if f is None:
            in_worker = torch.utils.data.get_worker_info() is not None
            driver = choose_driver(self.driver, has_mpio(), self.world_size, in_worker)
            if driver == "mpio":
                from hpctrain import comm

                comm.init()  # rank and size may have been given: MPI not started yet
                f = open_h5(self.paths[i], "r", driver="mpio", comm=comm.world().comm)
            else:
                f = open_h5(self.paths[i], "r")
            self._handles[i] = f
            self._drivers[i] = driver
            self._maps.pop(i, None)
        return f

    def _readers(self, i: int) -> Dict[str, Reader]:
        """How each key of file ``i`` is read around HDF5: a :class:`MappedKey`
        (uncompressed), a :class:`ChunkedKey` (compressed, decoded here), or None (through
        HDF5: other filters, ``through_hdf5=True``, mpio files)."""
        found = self._maps.get(i)
        if found is not None and self._pid == os.getpid():
            return found
        dsets = self._datasets(i)
        found = {k: None for k in self.keys}
        # The driver we opened with (h5py's File.driver would duplicate an mpio file's
        # communicator: a collective call, not to be made by one rank's prefetch thread).
        if not self.through_hdf5 and self._drivers.get(i) is None:
            mm = self._mmaps.get(i) or open_map(self.paths[i], self.memory_map)
            if mm is not None:
                self._mmaps[i] = mm
                for key in self.keys:
                    if not in_file(dsets[key], self.paths[i]):
                        # Reached through an external link: its offsets are another file's.
                        log.debug("data: %s[%s] read through HDF5 (in another file)", self.paths[i], key)
                        continue
                    found[key], why = map_dataset(dsets[key], mm)
                    # Any filter: h5py names only its own (dset.compression), not hdf5plugin's.
                    if found[key] is None and dsets[key].chunks is not None:
                        found[key], why = chunked_dataset(dsets[key], mm)
                    if found[key] is None:
                        log.debug("data: %s[%s] read through HDF5 (%s)", self.paths[i], key, why)
        self._maps[i] = found
        return found

    def _datasets(self, i: int) -> Dict[str, h5py.Dataset]:
        f = self._file(i)
        found = self._dsets.get(i)
        if found is None or found[0] is not f:
            found = (f, {k: f[k] for k in self.keys})
            self._dsets[i] = found
        return found[1]

    def close(self) -> None:
        """Close the files opened by this process (they reopen on the next iteration).

        With ``driver="mpio"`` closing is collective: call it on every rank."""
        if self._pid == os.getpid():
            for f in self._handles.values():
                try:
                    f.close()
                except Exception:  # noqa: BLE001 - closing is best effort
                    pass
            for maps in self._maps.values():
                for mk in maps.values():
                    if mk is not None:
                        mk.release()
            for mf in self._mmaps.values():
                mf.close()
        self._handles = {}
        self._dsets = {}
        self._maps = {}
        self._mmaps = {}
        self._drivers = {}
        self._window_pool = None

    # -- reading ----------------------------------------------------------------------
    def _read_window(self, ids: np.ndarray, staging: Dict[str, np.ndarray], pool: "_WindowPool"
                     ) -> Tuple[Dict[str, np.ndarray], CopyJob]:
        """Read the rows of ``ids`` (in plan order) into window arrays taken from ``pool``.

        Returns ``(arrays, job)``: ``job`` holds the copies not yet run, in two phases (read
        the sorted runs of rows that cover the window, then shuffle them into plan order):
        the caller publishes it and runs it (``job.work()``), and whoever needs the window
        calls ``job.wait()``. Keys read through HDF5 are read here, before ``job`` exists.

        Ascending ids covered by few runs (``shuffle="block"`` sorts each window;
        ``shuffle=False``) are read straight into ``arrays``. A shuffled window covers its
        ids with sorted runs (whole blocks): uncompressed keys read each run with
        ``preadv`` calls that scatter its rows to their places in ``arrays`` (one copy;
        ``dest`` maps run rows to window rows), other keys read the runs into the reused
        ``staging`` buffers and gather them into plan order afterwards. Uncompressed keys
        whose ids are sparse (strided policy: the runs would hold several times the rows
        needed) are gathered from the file map instead (read as runs into ``staging`` and
        gathered from there where files are not mapped).
        """
        arrays = pool.take(len(ids))
        if not len(ids):
            return arrays, CopyJob([])
        files, rows = locate(ids, self.offsets)
        lo, hi = int(files.min()), int(files.max())
        touched = [lo] if lo == hi else np.unique(files).tolist()
        readers = {fi: self._readers(fi) for fi in touched}
        layout = window_layout(ids, self.offsets, self._gap, SCATTER)
        reads: List[Callable[[], None]] = []
        shuffles: List[Callable[[], None]] = []
        hdf5_keys = []
        for key in self.keys:
            found = [readers[fi][key] for fi in touched]
            if any(r is None for r in found):
                hdf5_keys.append(key)
            elif (layout.direct or layout.sparse) and all(isinstance(r, MappedKey) and r.mapped for r in found):
                which = files if len(touched) == 1 else np.searchsorted(np.array(touched), files)
                reads += gather_tasks(found, which, rows, arrays[key])
            elif layout.scattered and all(isinstance(r, MappedKey) for r in found):
                reads += self._scatter_tasks(layout, readers, key, arrays[key])
                if len(layout.repeats):
                    shuffles.append(functools.partial(_copy_rows, arrays[key], layout.repeat_src, layout.repeats))
            else:
                target = arrays[key] if layout.direct else self._staging(staging, key, layout.total)
                reads += self._run_tasks(layout, readers, key, target)
                if not layout.direct:
                    shuffles += take_tasks(target, layout.gather_rows, arrays[key])
        if hdf5_keys:
            shuffles += self._read_through_hdf5(layout, hdf5_keys, arrays, staging)
        return arrays, CopyJob(reads, shuffles)

    @staticmethod
    def _scatter_tasks(layout: WindowLayout, readers, key: str, out: np.ndarray) -> List[Callable[[], None]]:
        """``preadv`` calls that read each run of ``key`` with its rows scattered into ``out``."""
        return packed([call for (fi, r0, r1), at in zip(layout.runs, layout.where.tolist())
                       for call in readers[fi][key].scatter_calls(r0, r1, out, layout.dest[at:at + r1 - r0])])

    @staticmethod
    def _run_tasks(layout: WindowLayout, readers, key: str, target: np.ndarray) -> List[Callable[[], None]]:
        """Tasks that read the runs of ``key`` one after another into ``target``."""
        reads: List[Callable[[], None]] = []
        calls: List[SizedCall] = []
        for (fi, r0, r1), at in zip(layout.runs, layout.where.tolist()):
            if isinstance(readers[fi][key], MappedKey):
                calls += readers[fi][key].fill_calls(r0, r1, target[at:at + r1 - r0])
            else:
                reads += readers[fi][key].fill_tasks(r0, r1, target[at:at + r1 - r0])
        return reads + packed(calls)

    def _read_through_hdf5(self, layout: WindowLayout, keys: List[str], arrays: Dict[str, np.ndarray],
                           staging: Dict[str, np.ndarray]) -> List[Callable[[], None]]:
        """Read ``keys`` (no direct reader: through HDF5) now; the gathers into plan order left."""
        if layout.direct:
            self._read_runs(layout.runs, arrays, keys)
            return []
        for key in keys:
            self._staging(staging, key, layout.total)
        self._read_runs(layout.runs, staging, keys)
        return [task for key in keys for task in take_tasks(staging[key], layout.gather_rows, arrays[key])]

    def _staging(self, staging: Dict[str, np.ndarray], key: str, rows: int) -> np.ndarray:
        """The reused staging buffer of ``key``, at least ``rows`` rows (exactly ``rows`` returned)."""
        buf = staging.get(key)
        if buf is None or buf.shape[0] < rows:
            info = self.files[0].keys[key]
            buf = staging[key] = np.empty((max(rows, 1),) + info.shape[1:], dtype=info.dtype)
        return buf[:rows]

    def _read_runs(self, runs: List[Tuple[int, int, int]], out: Dict[str, np.ndarray], keys: Sequence[str]) -> None:
        """Read sorted runs of ``keys`` through HDF5 into ``out`` back to back.

        Runs are whole blocks (one or more HDF5 chunks), so per-call costs stay small.
        """
        pos = 0
        j = 0
        while j < len(runs):
            fi = runs[j][0]
            k = j
            while k < len(runs) and runs[k][0] == fi:
                k += 1
            mine = runs[j:k]
            rows = sum(hi - lo for _, lo, hi in mine)
            dsets = self._datasets(fi)
            for key in keys:
                try:
                    _read_union(dsets[key], mine, out[key][pos:pos + rows])
                except Exception as exc:  # damaged chunk, fletcher32 mismatch, ...
                    raise read_error(exc, self.paths[fi], key, dsets[key]) from exc
            pos += rows
            j = k

    def _windows(self, plan: RankPlan) -> List[Tuple[int, int]]:
        w = self.window_steps
        windows = [(s, min(s + w, plan.steps)) for s in range(0, plan.steps, w)]
        worker = torch.utils.data.get_worker_info()
        if worker is not None:
            windows = windows[worker.id::worker.num_workers]
        return windows

    def _batches(self, plan: RankPlan, window: Tuple[int, int], arrays: Dict[str, np.ndarray],
                 mask: torch.Tensor, index: torch.Tensor) -> Iterator[Batch]:
        """Batches of one window: views of its arrays (no copy), cast and transformed."""
        b = plan.batch_size
        s0, s1 = window
        # Batch tensors are views of these: they keep the window's arrays referenced (and so
        # out of the pool) for as long as any batch lives. One split per key, not one slice
        # per key and batch.
        keys = self.keys
        parts = [torch.from_numpy(arrays[key]).split(b) for key in keys]
        masks = mask[s0 * b:s1 * b].split(b)
        indices = index[s0 * b:s1 * b].split(b)
        casts = [self.dtypes.get(key) for key in keys]
        fns = [self.transforms.get(key) for key in keys]
        simple = not any(casts) and not any(fns) and self.transform is None
        for i in range(s1 - s0):
            if simple:
                batch: Batch = {key: part[i] for key, part in zip(keys, parts)}
            else:
                batch = {}
                for key, part, dt, fn in zip(keys, parts, casts, fns):
                    t = part[i]
                    if dt is not None and t.dtype != dt:
                        t = t.to(dt)
                    if fn is not None:
                        t = fn(t)
                    batch[key] = t
            batch[self.mask_key] = masks[i]
            batch[self.index_key] = indices[i]
            if self.transform is not None:
                batch = self.transform(batch)
            yield batch

    def _pool(self, plan: RankPlan) -> "_WindowPool":
        """The window arrays, kept from one epoch to the next: a fresh pool would page-fault
        its ~130 MiB in again every epoch (5-10% of an epoch's CPU time read from the page
        cache). A new process (fork, DataLoader worker) or batch size starts a new pool."""
        rows = self.window_steps * plan.batch_size
        key = (os.getpid(), rows)
        if self._window_pool is None or self._window_pool[0] != key:
            layout = {k: (self.files[0].keys[k].shape[1:], self.files[0].keys[k].dtype) for k in self.keys}
            self._window_pool = (key, _WindowPool(layout, rows, keep=self.prefetch + 3))
        return self._window_pool[1]

    def _open_collectively(self) -> None:
        """With ``driver="mpio"``, open every file and dataset now, in file order, on every
        rank: ``H5Fopen`` with the mpio driver is collective over the communicator, so
        ranks must not open files lazily, each when its own share first needs them (ranks
        touch different files at different times; mismatched collective opens hang or mix
        up the files' metadata)."""
        if torch.utils.data.get_worker_info() is not None:
            return
        if choose_driver(self.driver, has_mpio(), self.world_size, False) != "mpio":
            return
        for i in range(len(self.paths)):
            self._datasets(i)

    def __iter__(self) -> Iterator[Batch]:
        return self.iter_from(0)

    def iter_from(self, step: int) -> Iterator[Batch]:
        """This epoch's batches from batch ``step`` on: the same batches as ``iter(self)``
        minus the first ``step`` (resuming inside an epoch), without reading the windows
        that lie wholly before ``step``."""
        if not 0 <= step <= len(self):
            raise ConfigError(f"iter_from: step {step} is outside this epoch's 0..{len(self)} batches",
                              hint="pass a step between 0 and the number of batches of the epoch")
        if step and torch.utils.data.get_worker_info() is not None:
            raise ConfigError("iter_from: starting mid-epoch inside DataLoader workers is not supported; "
                              "HINT: iterate the dataset itself (num_workers=0) when resuming",
                              hint="resume at an epoch boundary, or use num_workers=0")
        return self._iterate(step)

    def _iterate(self, start: int) -> Iterator[Batch]:
        self._open_collectively()
        plan = self.plan()
        windows = [(max(s0, start), s1) for s0, s1 in self._windows(plan) if s1 > start]
        pool = self._pool(plan)
        b = plan.batch_size
        mask, index = torch.from_numpy(plan.mask), torch.from_numpy(plan.indices)
        if self.prefetch == 0:
            staging: Dict[str, np.ndarray] = {}
            for s0, s1 in windows:
                arrays, job = self._read_window(plan.indices[s0 * b:s1 * b], staging, pool)
                job.wait()
                yield from self._batches(plan, (s0, s1), arrays, mask, index)
                del arrays
            return
        yield from self._iter_prefetch(plan, windows, pool, mask, index)

    def _iter_prefetch(self, plan: RankPlan, windows: List[Tuple[int, int]], pool: "_WindowPool",
                       mask: torch.Tensor, index: torch.Tensor) -> Iterator[Batch]:
        b = plan.batch_size
        # Staging buffers circulate between the producer (reads) and the consumer (gathers).
        free: "queue.Queue[Dict[str, np.ndarray]]" = queue.Queue()
        for _ in range(self.prefetch + 1):
            free.put({})
        ready: "queue.Queue[Any]" = queue.Queue()
        stop = threading.Event()
        done = object()

        def produce() -> None:
            try:
                for s0, s1 in windows:
                    staging = free.get()
                    if stop.is_set():
                        return
                    arrays, job = self._read_window(plan.indices[s0 * b:s1 * b], staging, pool)
                    # Published before it is copied: a consumer waiting for it helps copy.
                    ready.put(((s0, s1), arrays, staging, job))
                    job.work()
                ready.put(done)
            except BaseException as exc:  # handed to the consumer, raised there
                ready.put(exc)

        thread = threading.Thread(target=produce, name="hpctrain-data-prefetch", daemon=True)
        thread.start()
        try:
            while True:
                item = ready.get()
                if item is done:
                    break
                if isinstance(item, BaseException):
                    raise item
                window, arrays, staging, job = item
                item = None
                job.wait()
                job = None
                free.put(staging)  # gathered (or never used): the producer may refill it
                staging = None
                yield from self._batches(plan, window, arrays, mask, index)
                arrays = None
        finally:
            stop.set()
            free.put({})  # wake the producer if it waits for a buffer
            thread.join()


def _copy_rows(out: np.ndarray, src_rows: np.ndarray, dst_rows: np.ndarray) -> None:
    out[dst_rows] = out[src_rows]


def _read_union(dset: h5py.Dataset, runs: Sequence[Tuple[int, int, int]], out: np.ndarray) -> None:
    """Rows ``[lo, hi)`` of every run, in order, into the C-contiguous ``out``.

    One low-level H5Dread per run into a contiguous slice of ``out`` (h5py's ``read_direct``
    builds selections in Python: ~0.1 ms a call). Not one read of a union of hyperslabs:
    HDF5 takes a slow element-wise path for irregular selections of 2-D datasets (~30x).
    """
    rest = dset.shape[1:]
    zeros = (0,) * len(rest)
    fspace = dset.id.get_space()
    pos = 0
    for _, lo, hi in runs:
        n = hi - lo
        fspace.select_hyperslab((lo,) + zeros, (n,) + rest)
        mspace = h5py.h5s.create_simple((n,) + rest)
        dset.id.read(mspace, fspace, out[pos:pos + n])
        pos += n


class _WindowPool:
    """Reusable window arrays (one per key), recycled once no batch refers to them.

    Batches are views of these arrays. An array set is reused only when nothing but the pool
    holds its arrays (CPython reference counts: a live batch tensor keeps a view, which keeps
    the array); otherwise fresh arrays are allocated. Reusing avoids the page faults of
    fresh 16 MiB allocations, which cost about as much as reading the data again.
    """

    def __init__(self, layout: Dict[str, Tuple[Tuple[int, ...], np.dtype]], rows: int, keep: int) -> None:
        self.layout = layout
        self.rows = max(1, rows)
        self.keep = keep
        self.sets: List[Dict[str, np.ndarray]] = []
        self.lock = threading.Lock()

    @staticmethod
    def _unused(arrays: Dict[str, np.ndarray]) -> bool:
        # References: the dict in self.sets, and getrefcount's own argument.
        return all(sys.getrefcount(arrays[k]) <= 2 for k in arrays)

    def take(self, rows: int) -> Dict[str, np.ndarray]:
        """Arrays of at least ``rows`` rows per key (views of exactly ``rows``)."""
        with self.lock:
            for arrays in self.sets:
                if self._unused(arrays) and next(iter(arrays.values())).shape[0] >= rows:
                    return {k: a[:rows] for k, a in arrays.items()}
            size = max(rows, self.rows)
            arrays = {k: np.empty((size,) + shape, dtype) for k, (shape, dtype) in self.layout.items()}
            if len(self.sets) < self.keep:
                self.sets.append(arrays)
            return {k: a[:rows] for k, a in arrays.items()}


HDF5Loader = HDF5Dataset  # the dataset *is* the loader: iterate it, or wrap it in .dataloader()
