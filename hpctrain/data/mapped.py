"""Rows of uncompressed HDF5 datasets read straight from the file, around HDF5.

HDF5 stores an unfiltered dataset as plain bytes: one contiguous extent, or whole chunks at
known file offsets. :func:`map_dataset` finds those offsets once (``H5Dget_offset`` /
``H5Dchunk_iter``) and describes every sample row as a byte range of the file. A window of
samples is then copied from the page cache into the loader's arrays once, in plan order,
without the GIL: stretches of consecutive rows with one ``preadv`` straight into place (as a
raw slab read does), shuffled blocks with ``preadv`` calls that scatter each row to its
place (``H5Dread`` into a staging buffer followed by an in-memory shuffle copies every byte
twice). Scattered single rows (a strided policy, padding) are gathered with ``numpy.take``
from a read-only ``mmap`` of the file where one is allowed (:class:`MappedFile` with a map),
otherwise read as whole runs and gathered in memory: without a map a file truncated while it
is read is a read error, never a ``SIGBUS``.

Only datasets whose rows are whole byte ranges of the file are mapped: contiguous layout
without external storage, or chunked layout without filters whose chunks span the full
row (``chunks[1:] == shape[1:]``) and are all allocated. Compressed, filtered, virtual,
compact and partly written datasets return None and are read through HDF5. Every mapping
is checked against an HDF5 read of a few rows before it is used.
"""
from __future__ import annotations

import functools
import mmap
import os
import threading
from dataclasses import dataclass
from typing import Callable, Iterator, List, Optional, Sequence, Tuple

import h5py
import numpy as np
from h5py import h5d

from hpctrain.data.errors import DataError
from hpctrain.data.h5files import read_error

MAX_CHUNKS_WITHOUT_ITER = 100_000  # H5Dget_chunk_info(i) is linear in i: quadratic beyond


class MappedFile:
    """A read-only descriptor of a whole file and, unless maps are not wanted, a shared
    read-only map of it (pages map in on first use); ``size`` is the file's size at opening."""

    def __init__(self, fd: int, mm: Optional[mmap.mmap], path: str = "?", size: Optional[int] = None) -> None:
        self.fd = fd
        self.mm = mm
        self.path = path
        self.size = int(size) if size is not None else (len(mm) if mm is not None else 0)

    def __len__(self) -> int:
        return self.size

    def close(self) -> None:
        try:
            if self.mm is not None:
                self.mm.close()
        except BufferError:  # a view is still alive: unmapped when it goes
            pass
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def open_map(path: str, memory_map: bool = True) -> Optional[MappedFile]:
    """Open the file read-only, and map it if ``memory_map``; None where that fails (an
    empty file, no mmap support)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        size = os.fstat(fd).st_size
        if size > 0:
            return MappedFile(fd, mmap.mmap(fd, 0, access=mmap.ACCESS_READ) if memory_map else None, path, size)
    except (OSError, ValueError):
        pass
    os.close(fd)
    return None


def pread_into(fd: int, buf: np.ndarray, offset: int) -> None:
    """Fill the C-contiguous ``buf`` from file bytes at ``offset`` (the GIL is released)."""
    view = memoryview(buf).cast("B")
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise OSError(f"file ended at byte {offset + done} while reading {len(view)} bytes from {offset}")
        done += got


@dataclass(frozen=True)
class Segment:
    """Rows ``[row, row + rows)`` stored back to back from file byte ``offset``."""

    row: int
    rows: int
    offset: int


def chunk_table(dset: h5py.Dataset) -> Optional[List[Tuple[int, int, int, int]]]:
    """``(first row, byte offset or -1, stored size, filter mask)`` of every stored chunk, or
    None if unavailable."""
    found: List[Tuple[int, int, int, int]] = []
    dsid = dset.id
    if hasattr(dsid, "chunk_iter"):
        dsid.chunk_iter(lambda info: found.append(
            (int(info.chunk_offset[0]), -1 if info.byte_offset is None else int(info.byte_offset), int(info.size),
             int(info.filter_mask))))
        return found
    count = dsid.get_num_chunks()
    if count > MAX_CHUNKS_WITHOUT_ITER:
        return None
    for i in range(count):
        info = dsid.get_chunk_info(i)
        found.append((int(info.chunk_offset[0]), -1 if info.byte_offset is None else int(info.byte_offset),
                      int(info.size), int(info.filter_mask)))
    return found


def segments_of(dset: h5py.Dataset) -> Tuple[Optional[List[Segment]], str]:
    """The dataset's rows as contiguous byte ranges of the file, or ``(None, why not)``."""
    n = int(dset.shape[0]) if dset.shape else 0
    row_bytes = int(np.prod(dset.shape[1:], dtype=np.int64)) * dset.dtype.itemsize
    if n == 0 or row_bytes == 0:
        return None, "empty"
    if dset.dtype.hasobject:
        return None, "variable-length data"
    plist = dset.id.get_create_plist()
    layout = plist.get_layout()
    if layout == h5d.CONTIGUOUS:
        if plist.get_external_count():
            return None, "external storage"
        offset = dset.id.get_offset()
        if offset is None:
            return None, "not allocated"
        return [Segment(0, n, int(offset))], ""
    if layout != h5d.CHUNKED:
        return None, "compact or virtual layout"
    if plist.get_nfilters():
        return None, "filtered (compressed or checksummed)"
    chunk_rows = int(dset.chunks[0])
    if tuple(dset.chunks[1:]) != tuple(dset.shape[1:]):
        return None, "chunks do not span whole rows"
    chunk_bytes = chunk_rows * row_bytes
    chunks = chunk_table(dset)
    if chunks is None:
        return None, "too many chunks to list"
    if len(chunks) != -(-n // chunk_rows):
        return None, "not every chunk is allocated"
    chunks.sort()
    segs: List[Segment] = []
    for row, offset, size, _ in chunks:
        if offset < 0 or size != chunk_bytes:
            return None, "a chunk is not stored plainly"
        rows = min(chunk_rows, n - row)
        last = segs[-1] if segs else None
        if last is not None and last.row + last.rows == row and last.offset + last.rows * row_bytes == offset:
            segs[-1] = Segment(last.row, last.rows + rows, last.offset)
        else:
            segs.append(Segment(row, rows, offset))
    return segs, ""


class MappedKey:
    """One dataset's rows as byte ranges of the file, grouped so that one ``numpy.take``
    serves every segment of a group: segments whose byte offsets agree modulo the row size
    lie on one grid of rows (with a map, a ``(rows, row_bytes)`` ``uint8`` view spanning them
    all; without one, ``views`` is empty and rows are read with ``preadv`` only)."""

    def __init__(self, segs: Sequence[Segment], row_bytes: int, mf: MappedFile, key: str = "?") -> None:
        self.row_bytes = row_bytes
        self.fd = mf.fd
        self.path = mf.path
        self.key = key
        mm = mf.mm
        self.view_offset: List[int] = []
        groups: dict = {}
        for s in segs:
            groups.setdefault(s.offset % row_bytes, []).append(s)
        self.views: List[np.ndarray] = []
        seg_group, seg_vrow = {}, {}
        for members in groups.values():
            start = min(s.offset for s in members)
            end = max(s.offset + s.rows * row_bytes for s in members)
            if end > len(mf):
                raise ValueError(f"dataset bytes end at {end}, past the end of the file ({len(mf)})")
            g = len(self.view_offset)
            self.view_offset.append(start)
            if mm is not None:
                self.views.append(np.ndarray(((end - start) // row_bytes, row_bytes), np.uint8, buffer=mm, offset=start))
            for s in members:
                seg_group[s.row] = g
                seg_vrow[s.row] = (s.offset - start) // row_bytes
        order = sorted(seg_group)
        self.seg_row = np.array(order, np.int64)
        self.seg_group = np.array([seg_group[r] for r in order], np.int64)
        self.seg_vrow = np.array([seg_vrow[r] for r in order], np.int64)

    def locate(self, rows: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """For rows of the dataset: (group of each, row within that group's view)."""
        if len(self.seg_row) == 1:
            return np.zeros(len(rows), np.int64), rows + self.seg_vrow[0]
        s = np.searchsorted(self.seg_row, rows, side="right") - 1
        return self.seg_group[s], self.seg_vrow[s] + (rows - self.seg_row[s])

    @property
    def mapped(self) -> bool:
        """Whether rows can be gathered from a map of the file (:func:`gather_tasks`)."""
        return bool(self.views)

    def read_row(self, row: int) -> np.ndarray:
        """Row ``row``'s bytes, read with ``preadv`` (no map needed)."""
        g, v = self.locate(np.array([row], np.int64))
        out = np.empty(self.row_bytes, np.uint8)
        self._guarded(pread_into, self.fd, out, self.view_offset[int(g[0])] + int(v[0]) * self.row_bytes)
        return out

    def pieces(self, lo: int, hi: int) -> Iterator[Tuple[int, int, int]]:
        """Rows ``[lo, hi)`` as ``(a, b, file offset of row a)`` pieces stored back to back,
        each at most :data:`TASK_BYTES`."""
        per_task = max(1, TASK_BYTES // self.row_bytes)
        s = int(np.searchsorted(self.seg_row, lo, side="right")) - 1
        row = lo
        while row < hi:
            stop = min(hi, int(self.seg_row[s + 1])) if s + 1 < len(self.seg_row) else hi
            base = self.view_offset[int(self.seg_group[s])] + (int(self.seg_vrow[s]) - int(self.seg_row[s])) * self.row_bytes
            for a in range(row, stop, per_task):
                yield a, min(stop, a + per_task), base + a * self.row_bytes
            row = stop
            s += 1

    def fill_calls(self, lo: int, hi: int, out: np.ndarray) -> List[SizedCall]:
        """Calls that ``preadv`` rows ``[lo, hi)`` into the C-contiguous ``out`` (``hi - lo``
        rows), one per piece stored back to back; :func:`packed` makes them tasks."""
        dst = out.reshape(hi - lo, -1).view(np.uint8)
        return [((b - a) * self.row_bytes, functools.partial(self._guarded, pread_into, self.fd, dst[a - lo:b - lo], offset))
                for a, b, offset in self.pieces(lo, hi)]

    def scatter_calls(self, lo: int, hi: int, out: np.ndarray, dest: np.ndarray) -> List[SizedCall]:
        """Calls that read rows ``[lo, hi)`` and put row ``lo + r`` at row ``dest[r]`` of the
        C-contiguous ``out`` (``dest[r] < 0``: not read): a shuffled window read with one copy,
        ``preadv`` scattering rows to their places. Needs :mod:`hpctrain.data._codecs`."""
        from hpctrain.data import _codecs

        dst = out.reshape(len(out), -1).view(np.uint8)
        return [((b - a) * self.row_bytes,
                 functools.partial(self._guarded, _codecs.pread_rows, self.fd, offset, self.row_bytes,
                                   dest[a - lo:b - lo], dst))
                for a, b, offset in self.pieces(lo, hi)]

    def _guarded(self, fn: Callable, *args) -> None:
        try:
            fn(*args)
        except OSError as exc:  # e.g. the file was truncated after it was opened
            raise read_error(exc, self.path, self.key) from exc

    def release(self) -> None:
        self.views = []


def map_dataset(dset: h5py.Dataset, mf: MappedFile) -> Tuple[Optional[MappedKey], str]:
    """Map ``dset`` (of the file mapped as ``mf``), checked against HDF5 reads of a few rows."""
    try:
        segs, why = segments_of(dset)
        if segs is None:
            return None, why
        row_bytes = int(np.prod(dset.shape[1:], dtype=np.int64)) * dset.dtype.itemsize
        mk = MappedKey(segs, row_bytes, mf, dset.name.lstrip("/"))  # offsets are from the start of the file (user block included)
    except (ValueError, TypeError, RuntimeError, OSError, AttributeError) as exc:
        return None, f"cannot map: {exc}"
    n = int(dset.shape[0])
    probe = sorted({0, n - 1, n // 2} | {s.row for s in segs[:2]} | {s.row + s.rows - 1 for s in segs[-2:]})
    ids = np.array(probe, np.int64)
    group, vrow = mk.locate(ids)
    for r, g, v in zip(probe, group, vrow):
        expect = np.ascontiguousarray(dset[r]).view(np.uint8).reshape(-1)
        try:
            got = mk.views[int(g)][int(v)] if mk.mapped else mk.read_row(r)
        except DataError as exc:
            mk.release()
            return None, f"reading row {r} failed ({exc})"
        if not np.array_equal(got, expect):
            mk.release()
            return None, f"stored bytes of row {r} differ from HDF5's"
    return mk, ""


TASK_BYTES = 1 << 20  # copy tasks of about this size: a waiting consumer can take a share
MIN_PREAD_BYTES = 4096  # consecutive rows worth a preadv of their own rather than a gather


SizedCall = Tuple[int, Callable[[], None]]  # (bytes it copies, the call)


def packed(calls: Sequence[SizedCall]) -> List[Callable[[], None]]:
    """Consecutive calls joined into tasks of about :data:`TASK_BYTES`. A task costs a claim
    under the job's lock and a GIL hand-over between the threads sharing the job: more than
    reading one chunk of a narrow key (8 KiB of labels), and two threads writing 8-byte
    labels to neighbouring places would share cache lines."""
    tasks: List[Callable[[], None]] = []
    group: List[Callable[[], None]] = []
    size = 0
    for nbytes, call in calls:
        group.append(call)
        size += nbytes
        if size >= TASK_BYTES:
            tasks.append(_joined(group))
            group, size = [], 0
    if group:
        tasks.append(_joined(group))
    return tasks


def _joined(calls: List[Callable[[], None]]) -> Callable[[], None]:
    return calls[0] if len(calls) == 1 else functools.partial(_run_each, tuple(calls))


def _run_each(calls: Tuple[Callable[[], None], ...]) -> None:
    for call in calls:
        call()


class CopyJob:
    """A window's copies as small tasks that several threads may run together, in phases.

    The prefetch thread publishes the job, then works through it; a consumer that would
    otherwise wait for this window joins in (:meth:`work`) instead of idling. Each task is
    a GIL-free ``preadv``, chunk decode or ``numpy.take``, so two threads copy at once. The
    tasks of a phase start once every task of the phase before has finished (e.g. read
    the window's blocks into a staging buffer, then shuffle them into place while they are
    still in the CPU cache). After a failed task the later phases are skipped.
    """

    def __init__(self, tasks: List[Callable[[], None]], *later: List[Callable[[], None]]) -> None:
        self.phases = [p for p in (tasks,) + later if p]
        self._phase = 0
        self._next = 0
        self._left = len(self.phases[0]) if self.phases else 0
        self._cond = threading.Condition()
        self._done = threading.Event()
        self.error: Optional[BaseException] = None
        if not self.phases:
            self._done.set()

    def _advance(self) -> None:
        """The current phase has finished (lock held): open the next one, or finish."""
        self._phase += 1
        if self.error is not None:
            self._phase = len(self.phases)
        self._next = 0
        if self._phase >= len(self.phases):
            self._done.set()
        else:
            self._left = len(self.phases[self._phase])
        self._cond.notify_all()

    def _claim(self) -> Optional[Callable[[], None]]:
        """The next task to run, waiting for the current phase to finish if need be; None
        when every task has been claimed."""
        with self._cond:
            while self._phase < len(self.phases):
                tasks = self.phases[self._phase]
                if self._next < len(tasks):
                    self._next += 1
                    return tasks[self._next - 1]
                if self._phase == len(self.phases) - 1:
                    return None  # the last tasks are running: nothing left to claim
                self._cond.wait()
            return None

    def work(self) -> None:
        """Run unclaimed tasks until none is left."""
        while True:
            task = self._claim()
            if task is None:
                return
            try:
                task()
            except BaseException as exc:  # noqa: BLE001 - re-raised by wait()
                if self.error is None:
                    self.error = exc
            with self._cond:
                self._left -= 1
                if self._left == 0:
                    self._advance()

    def wait(self) -> None:
        """Help, then block until every task has finished; raise the first task's error."""
        self.work()
        self._done.wait()
        if self.error is not None:
            raise self.error


def take_tasks(src: np.ndarray, rows: np.ndarray, out: np.ndarray) -> List[Callable[[], None]]:
    """Tasks that copy ``out[i] = src[rows[i]]`` (rows valid), about :data:`TASK_BYTES` each."""
    n = len(rows)
    row_bytes = max(1, out[:1].nbytes)
    per_task = max(1, TASK_BYTES // row_bytes)
    # mode="clip": indices are valid, and numpy then writes into out unbuffered
    return [functools.partial(np.take, src, rows[lo:lo + per_task], 0, out[lo:lo + per_task], "clip")
            for lo in range(0, n, per_task)]


def gather_tasks(maps: Sequence[MappedKey], which: np.ndarray, rows: np.ndarray, out: np.ndarray
                 ) -> List[Callable[[], None]]:
    """Tasks that copy ``out[i] = row rows[i] of dataset maps[which[i]]`` (as bytes; ``out``
    is C-contiguous).

    The window is cut into stretches of consecutive samples that lie in one view of a map.
    A stretch of consecutive rows (block order, file order) is read with ``preadv``
    straight into ``out``: a raw read, no page mapped. Any other stretch (shuffled rows,
    padding repeats) is a ``numpy.take`` from the map, so every key needs one
    (:attr:`MappedKey.mapped`). Stretches are grouped (or split) into tasks of about
    :data:`TASK_BYTES`.
    """
    if not all(mk.mapped for mk in maps):
        raise ValueError("gather_tasks needs keys read from a file map (memory_map=True)")
    n = len(rows)
    if n == 0:
        return []
    dst = out.reshape(n, -1).view(np.uint8)
    if len(maps) == 1:
        group, vrow = maps[0].locate(rows)
        views = [(maps[0], g) for g in range(len(maps[0].views))]
    else:
        group = np.empty(n, np.int64)
        vrow = np.empty(n, np.int64)
        views = []
        for k, mk in enumerate(maps):
            sel = np.flatnonzero(which == k)
            if len(sel):
                g, v = mk.locate(rows[sel])
                group[sel] = g + len(views)
                vrow[sel] = v
            views.extend((mk, g) for g in range(len(mk.views)))
    if len(views) == 1:
        starts = np.zeros(1, np.int64)
    else:
        starts = np.concatenate(([0], np.flatnonzero(group[1:] != group[:-1]) + 1))
    stops = np.append(starts[1:], n)
    # Runs of consecutive rows: no step inside differs from +1. A run of at least
    # MIN_PREAD_BYTES is one preadv; the rows between such runs are one numpy.take.
    breaks = np.flatnonzero(np.diff(vrow) != 1) + 1
    run_starts = np.concatenate(([0], breaks))
    run_stops = np.append(breaks, n)
    long_runs = np.flatnonzero((run_stops - run_starts) * dst.shape[1] >= MIN_PREAD_BYTES)
    per_task = max(1, TASK_BYTES // dst.shape[1])
    tasks: List[Callable[[], None]] = []
    ops: list = []
    size = 0
    for a, b, g in zip(starts.tolist(), stops.tolist(), group[starts].tolist()):
        mk, view = views[g]
        for lo, hi, plain in _pieces_of_stretch(a, b, run_starts, run_stops, long_runs, per_task):
            if plain:
                ops.append((pread_into, (mk.fd, dst[lo:hi], mk.view_offset[view] + int(vrow[lo]) * mk.row_bytes)))
            else:
                # mode="clip": indices are valid, and numpy then writes into out unbuffered
                ops.append((np.take, (mk.views[view], vrow[lo:hi], 0, dst[lo:hi], "clip")))
            size += hi - lo
            if size >= per_task:
                tasks.append(functools.partial(_run_ops, ops, mk))
                ops, size = [], 0
    if ops:
        tasks.append(functools.partial(_run_ops, ops, mk))
    return tasks


def _pieces_of_stretch(a: int, b: int, run_starts: np.ndarray, run_stops: np.ndarray, long_runs: np.ndarray,
                       per_task: int) -> Iterator[Tuple[int, int, bool]]:
    """Rows ``[a, b)`` of one view as ``(lo, hi, plain)`` pieces of at most ``per_task``
    rows: ``plain`` pieces lie in a long run of consecutive rows (read with ``preadv``),
    the others are gathered. The labels of a block order read this way are a few 8 KiB
    reads instead of a ``numpy.take`` of 8-byte rows (~70 ns a row)."""
    first, last = np.searchsorted(run_stops[long_runs], a, side="right"), np.searchsorted(run_starts[long_runs], b)
    pos = a
    for k in long_runs[first:last].tolist():
        lo, hi = max(a, int(run_starts[k])), min(b, int(run_stops[k]))
        yield from _split(pos, lo, per_task, False)
        yield from _split(lo, hi, per_task, True)
        pos = hi
    yield from _split(pos, b, per_task, False)


def _split(lo: int, hi: int, per_task: int, plain: bool) -> Iterator[Tuple[int, int, bool]]:
    for x in range(lo, hi, per_task):
        yield x, min(hi, x + per_task), plain


def _run_ops(ops: list, mk: MappedKey) -> None:
    try:
        for fn, args in ops:
            fn(*args)
    except OSError as exc:  # e.g. the file was truncated after it was opened
        raise read_error(exc, mk.path, mk.key) from exc


def gather(maps: Sequence[MappedKey], which: np.ndarray, rows: np.ndarray, out: np.ndarray) -> None:
    """Run :func:`gather_tasks` here, in this thread."""
    for task in gather_tasks(maps, which, rows, out):
        task()
