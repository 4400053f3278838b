"""Flag synchronisation among the ranks of one node, over a shared window (the C extension
``_shmsync``): a barrier, the agreement check and whole small all-reduces in one flag round
trip (~1 µs) instead of MPI barriers and messages (~4 µs each, ~50 µs for a checked call).

Where the extension is not built (no C compiler at install time) or HPCTRAIN_SHM_FLAGS=0,
``NodeFlags.create`` returns None and callers use MPI barriers and native collectives.
"""
from __future__ import annotations

import logging
import os
import struct
from typing import Optional

import numpy as np
from mpi4py import MPI

from .. import settings
from .buffers import DTYPE_CODES, OPS
from .errors import CollectiveMismatchError, RanksLostError
from .watchdog import text
from .windows import allocate_shared

try:
    from . import _shmsync
except ImportError:  # built with optional=True: no compiler, no extension
    _shmsync = None

# All-reduces up to this many bytes run as one flag exchange: every rank copies its data into
# its slot and reduces all slots itself (one round trip, no second barrier). Above it they are
# piped through the slots (``allreduce_piped``: each rank reduces only its part, two round trips
# per segment). Tuned on a 2-core machine: the exchange beats MPI_Allreduce up to 256 KiB at
# 2–3 ranks, while the piped path loses to MPI at 64 KiB (docs/performance.md; re-tune with
# HPCTRAIN_SHM_SMALL_BYTES and `hpctrain bench allreduce`).
SMALL_ALLREDUCE_BYTES = 256 * 1024
# Each local rank's two data slots: the staging of the piped path (one segment each).
SLOT_BYTES = 256 * 1024
PIPED_MIN_SLOT_BYTES = 4096  # smaller slots (HPCTRAIN_SHM_SLOT_BYTES) do not pipe


def spins(cores: int, local_ranks: int, wanted: Optional[bool], env) -> bool:
    """Whether a rank waiting on the flags spins before it yields: ``wanted`` (HPCTRAIN_SPIN_WAIT)
    where set; otherwise where the node's ranks have a core each (more ranks than cores: a
    spinning rank takes the core its peer needs) and Open MPI was not told to yield when idle,
    which is how a user says that the cores are shared with ranks this node cannot see (the
    namespace nodes of a test cluster: there a spinning wait held every hierarchical all-reduce
    at 2 x 2 ranks on 2 cores to ~2 ms)."""
    if wanted is not None:
        return wanted
    return cores >= local_ranks and env.get("OMPI_MCA_mpi_yield_when_idle", "").strip() not in ("1", "true", "yes")


def small_allreduce_bytes() -> int:
    """HPCTRAIN_SHM_SMALL_BYTES, default SMALL_ALLREDUCE_BYTES: the largest flag exchange."""
    return settings.rc.shm_small_bytes


def slot_bytes_wanted() -> int:
    """HPCTRAIN_SHM_SLOT_BYTES, default SLOT_BYTES, at least the largest flag exchange (the
    window holds two slots per local rank and group)."""
    return max(settings.rc.shm_slot_bytes, small_allreduce_bytes())
# dtypes and ops the C kernels reduce (float16/bfloat16/complex/bool take the MPI path)
FAST_DTYPES = frozenset(DTYPE_CODES[n] for n in (
    "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64", "float32", "float64"))
FAST_DTYPE_NUMS = {np.dtype(n).num: DTYPE_CODES[n] for n in (
    "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64", "float32", "float64")}
OP_CODES = {op: i for i, op in enumerate(OPS)}
log = logging.getLogger("hpctrain.comm")
HEADER = struct.Struct("8q")  # the 7 header fields of guard.make_header, padded to 64 bytes
ST_OK, ST_TIMEOUT, ST_MISMATCH, ST_ABANDONED = 0, 1, 2, 3


def streaming_bytes() -> int:
    """HPCTRAIN_SHM_STREAMING_BYTES (default 48 MiB): zero-copy all-reduces whose window data
    (all local slots together) exceed this write their results with streaming stores: no
    read-for-ownership of lines they overwrite, a third less memory traffic — but the result
    is not left in cache, which only pays beyond L3."""
    return settings.rc.shm_streaming_bytes


# Larger all-reduces on one node stream through the data slots in segments of up to this
# size (capped by the slot; staging that stays in L2): 256 KiB segments beat 128 KiB ones at
# 2 ranks from 512 KiB to 64 MiB on the machine this was tuned on.
PIPE_SEGMENT_BYTES = 256 * 1024
_SPIN_ITERATIONS = 1 << 16  # pause-loop iterations before a waiting rank starts yielding


def kernel_dtype_code(dtype_name: str) -> Optional[int]:
    """The dtype code of the C kernels for ``dtype_name``, or None (no extension / no kernel)."""
    if _shmsync is None:
        return None
    code = DTYPE_CODES.get(dtype_name)
    return code if code in FAST_DTYPES else None


def reduce_to_all(targets, sources, count: int, dtype_code: int, op: str, ranks: int, streaming: bool) -> None:
    """Elements [0, count) of every buffer in ``sources`` reduced (in rank order; 'avg'
    divides by ``ranks``) and stored into every (writable) buffer in ``targets``, which may be
    the sources themselves; GIL released. Every buffer must hold ``count`` elements."""
    _shmsync.reduce_to_all(targets, sources, count, dtype_code, OP_CODES[op], ranks, streaming)


def available() -> bool:
    return _shmsync is not None and settings.rc.shm_flags


class NodeFlags:
    """One flag, two header slots and two data slots per local rank of ``node_comm``."""

    def __init__(self, node_comm, slot_bytes: int, spin: int, small_bytes: Optional[int] = None,
                 pids: Optional[list] = None) -> None:
        self.comm = node_comm
        self.size = node_comm.Get_size()
        self.rank = node_comm.Get_rank()
        self.slot_bytes = slot_bytes
        self.small_bytes = slot_bytes if small_bytes is None else min(small_bytes, slot_bytes)  # flag exchange
        region = _shmsync.REGION_HEADER_BYTES + 2 * slot_bytes
        self.win = allocate_shared(region, node_comm)
        views = [np.frombuffer(self.win.Shared_query(q)[0], dtype=np.uint8) for q in range(self.size)]
        views[self.rank][:_shmsync.REGION_HEADER_BYTES] = 0  # window memory is not zeroed
        node_comm.Barrier()
        self.ctx = _shmsync.Ctx(views, self.rank, slot_bytes, spin, pids)
        self._views = views  # keep the mappings referenced as long as ctx uses them

    @classmethod
    def create(cls, node_comm, slot_bytes: Optional[int] = None) -> Optional["NodeFlags"]:
        """Collective over ``node_comm``: NodeFlags on every rank, or None on every rank
        (extension missing or switched off on any rank, or a single rank). The slot size and
        the flag-exchange limit are the smallest any rank asked for, so that every rank picks
        the same algorithms."""
        if node_comm.Get_size() == 1:
            return None
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
        wanted = slot_bytes_wanted() if slot_bytes is None else slot_bytes
        votes = node_comm.allgather((available(), cpus, wanted, small_allreduce_bytes(), os.getpid(),
                                     settings.rc.elastic))
        if not all(v[0] for v in votes):
            return None
        slot_bytes = min(v[2] for v in votes)
        small_bytes = min(v[3] for v in votes)
        usable = set().union(*(set(v[1]) for v in votes))
        spin = _SPIN_ITERATIONS if spins(len(usable), node_comm.Get_size(), settings.rc.spin_wait, os.environ) else 0
        # decided from the votes, so that every rank makes _watched_pids' collective or none does
        pids = _watched_pids(node_comm, [v[4] for v in votes]) if all(v[5] for v in votes) else None
        flags, error = None, None
        try:
            flags = cls(node_comm, slot_bytes, spin, small_bytes, pids)
        except MPI.Exception as exc:  # an MPI without usable shared windows
            error = exc
        if node_comm.allreduce(0 if flags is None else 1, op=MPI.MIN) == 0:
            # not freed: MPI_Win_free is collective and some ranks may hold no window
            if error is not None and node_comm.Get_rank() == 0:
                log.warning("comm: no shared-memory window on this node (%s); using MPI barriers and "
                            "native collectives instead of shared-memory flags", error)
            return None
        return flags

    # ------------------------------------------------------------------ operations
    def barrier(self, dog, what, describe) -> None:
        """Every local rank has arrived (a memory barrier too: writes before it are visible after)."""
        self.check(self.ctx.exchange(None, None, 0, 0, dog.timeout), dog, what, describe, None)

    def agree(self, header, dog, what, describe, group, shape=None) -> None:
        """The agreement check of guard.agree, in one flag exchange. ``header``: the 7 fields
        of guard.make_header, or those already packed with HEADER; ``shape``: this rank's,
        named in the error when the ranks' shapes differ."""
        if not isinstance(header, bytes):
            header = HEADER.pack(*(header.tolist() if isinstance(header, np.ndarray) else map(int, header)), 0)
        status = self.ctx.exchange(header, None, 0, 0, dog.timeout)
        if status:
            self.check(status, dog, what, describe, group, shape)

    def pipes(self, nbytes: int) -> bool:
        """Whether an all-reduce of ``nbytes`` (more than a flag exchange) streams through the slots."""
        return nbytes > self.small_bytes and self.slot_bytes >= PIPED_MIN_SLOT_BYTES

    def allreduce_piped(self, x: np.ndarray, code: int, op: str, divisor: int, header, dog, what, describe,
                        group, shape=None) -> None:
        """All-reduce the private array ``x`` in place through the data slots, one segment after
        another (see ``allreduce_piped`` in _shmsync.c): each rank reduces its part of every
        segment from its own buffer and its peers' slots, then copies the others' parts back.
        ``header``: the packed agreement check (riding on the first flag), or None; ``shape``:
        the caller's shape, for the error."""
        status = self.ctx.allreduce_piped(x, code, OP_CODES[op], divisor, header, dog.timeout, PIPE_SEGMENT_BYTES)
        if status:
            self.check(status, dog, what, describe, group, shape)

    def check(self, status: int, dog, what, describe, group, shape=None) -> None:
        """Raise for a failed exchange: a header mismatch (every rank's header named, and every
        rank's shape when they differ: every local rank saw the same headers, so all gather
        them), or a stall (reported and the job aborted by ``dog``)."""
        if status == ST_OK:
            return
        if status == ST_ABANDONED:
            gone = self.ctx.gone
            raise RanksLostError(f"{text(what)}: local rank {gone} of this node left the collective (its process "
                                 "exited, or it left the group after a failure elsewhere)")
        if status == ST_MISMATCH:
            from .guard import HEADER_LEN, mismatch_report

            headers = np.empty((self.size, 8), dtype=np.int64)
            self.ctx.headers(headers)
            headers = headers[:, :HEADER_LEN]
            raise CollectiveMismatchError(mismatch_report(self.comm, headers, group, shape, dog, what), headers, group)
        dog.stalled(what, dog.timeout, describe(self.ctx.missing()))

    def abandon(self) -> None:
        """This rank leaves the group after a failure: the other local ranks' waits on it end
        (with RanksLostError) instead of running into the stall watchdog. The window is not
        freed (MPI_Win_free is collective over ranks that may be dead)."""
        if self.ctx is not None:
            self.ctx.abandon()

    def free(self) -> None:
        if self.win is not None:
            self.comm.Barrier()
            self.ctx = None
            self._views = []
            self.win.Free()
            self.win = None


def _watched_pids(node_comm, pids: list) -> Optional[list]:
    """The local ranks' process ids when waits should check that their peers still exist
    (called in elastic jobs only: elsewhere the launcher ends the job when a rank dies), or
    None when some rank does not see every other's process (ranks in separate PID namespaces
    that share memory: a peer's id would look gone). Collective over ``node_comm``."""
    visible = 1
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            visible = 0
        except PermissionError:
            pass  # exists, owned by another user
    return pids if node_comm.allreduce(visible, op=MPI.MIN) == 1 else None
